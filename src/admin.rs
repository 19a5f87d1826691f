//! Operator queries: the domain side of the admin surface. Requests arrive here validated
//! (by `api::admin`), run against the store's `AdminStore` half, and come back as plain
//! values. Page tokens are opaque to clients: base64 of a small JSON cursor.
//!
//! Both boxes are served by the same queries. The inbox adds one dimension: its lines
//! are (subscription, topic, key), so backlog groups, key rows and filters carry the
//! subscription; for the outbox it is empty (`""` / `None`).

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::domain::{BoxKind, EventId, Status, StoredEvent};
use crate::error::Error;
use crate::store::Store;

/// Largest requeue in one call.
pub const MAX_REQUEUE: u32 = 100_000;
/// Requeue size when the caller gives no limit.
pub const DEFAULT_REQUEUE: u32 = 1000;
/// Most ids one cancel may name.
pub const MAX_CANCEL: usize = 10_000;
/// Sample ids a requeue reports.
pub const SAMPLE_IDS: usize = 20;

/// Order of ListPending groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PendingOrder {
    /// Most pending first; ties by (topic, key).
    MostPending,
    /// Oldest pending event first; ties by (topic, key).
    Oldest,
}

/// Where the previous ListPending page ended: the last group's sort key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingCursor {
    /// The order the token was made for; a token is only valid with it.
    pub order: PendingOrder,
    pub pending: i64,
    /// Microseconds since the epoch of the group's oldest pending event.
    pub oldest_us: i64,
    /// The inbox's subscription; `""` for the outbox (and in tokens made before the
    /// inbox existed).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub subscription: String,
    pub topic: String,
    pub key: String,
}

#[derive(Debug, Clone)]
pub struct PendingQuery {
    /// Inbox only: one subscription.
    pub subscription: Option<String>,
    pub topic: Option<String>,
    pub key_prefix: Option<String>,
    pub only_blocked: bool,
    pub order: PendingOrder,
    pub page_size: u32,
    pub after: Option<PendingCursor>,
}

/// The pending backlog of one (topic, key) — for the inbox, of one (subscription, topic,
/// key); unkeyed events are grouped under key "".
#[derive(Debug, Clone, PartialEq)]
pub struct KeyBacklog {
    /// The inbox's subscription; `""` for the outbox.
    pub subscription: String,
    pub topic: String,
    pub key: String,
    pub pending: i64,
    /// The oldest pending event is the key's head: ids follow acceptance order.
    pub oldest_created_at: DateTime<Utc>,
    pub head_id: EventId,
    pub head_attempts: u32,
    pub head_next_attempt_at: DateTime<Utc>,
    pub head_last_error: Option<String>,
    pub blocked: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PendingPage {
    pub keys: Vec<KeyBacklog>,
    pub next: Option<PendingCursor>,
    /// Totals over the topic and key-prefix filters (not `only_blocked`, not the page).
    pub total_pending: i64,
    pub total_keys: i64,
    pub total_blocked_keys: i64,
}

/// Selects events by their attributes; every set field must match.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EventFilter {
    /// Inbox only: the subscription, exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscription: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    /// Last update at or after.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub updated_after: Option<DateTime<Utc>>,
    /// Last update strictly before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub updated_before: Option<DateTime<Utc>>,
    /// Case-sensitive substring of the last error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_contains: Option<String>,
}

/// Which failed events a requeue takes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    Ids(Vec<EventId>),
    Filter(EventFilter),
}

#[derive(Debug, Clone)]
pub struct RequeueRequest {
    pub selection: Selection,
    pub limit: u32,
    pub dry_run: bool,
    pub actor: String,
    /// The authenticated token name, recorded apart from the claimed operator.
    pub principal: Option<String>,
    /// A repeated id (per action and box) acts once.
    pub request_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RequeueOutcome {
    pub count: i64,
    pub sample_ids: Vec<EventId>,
    pub audit_id: Option<i64>,
    /// Keys a relay held at the time: its release may overwrite their readiness, so
    /// they are woken again once released.
    pub leased_keys: Vec<AdminKey>,
    /// The request_id named an action already done; nothing changed.
    pub replayed: bool,
}

/// A key row of either box: (topic, key) in the outbox, (subscription, topic, key) in
/// the inbox. Sorted in the lock order: subscription, topic, key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdminKey {
    /// `None` for the outbox.
    pub subscription: Option<String>,
    pub topic: String,
    pub key: String,
}

#[derive(Debug, Clone)]
pub struct CancelRequest {
    pub ids: Vec<EventId>,
    pub reason: String,
    pub dry_run: bool,
    pub actor: String,
    /// The authenticated token name, recorded apart from the claimed operator.
    pub principal: Option<String>,
    /// A repeated id (per action and box) acts once.
    pub request_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CancelOutcome {
    pub ids: Vec<EventId>,
    pub audit_id: Option<i64>,
    pub leased_keys: Vec<AdminKey>,
    /// The request_id named an action already done; nothing changed.
    pub replayed: bool,
}

/// One event with what an operator needs; the payload only on request.
#[derive(Debug, Clone, PartialEq)]
pub struct EventDetail {
    pub event: StoredEvent,
    pub payload_size: i64,
    /// Inbox messages: the subscription and the message id (dedup key).
    pub subscription: Option<String>,
    pub message_id: Option<String>,
}

#[derive(Debug, Clone)]
pub struct EventsQuery {
    pub status: Option<Status>,
    pub filter: EventFilter,
    pub page_size: u32,
    /// Ids strictly below this one (pages go newest first).
    pub before_id: Option<EventId>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct EventsPage {
    pub events: Vec<EventDetail>,
    pub next_before_id: Option<EventId>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AuditEntry {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub action: String,
    pub box_kind: BoxKind,
    pub selection: String,
    pub count: i64,
    pub principal: Option<String>,
    pub request_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AuditPage {
    pub entries: Vec<AuditEntry>,
    pub next_before_id: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct TopicStats {
    /// The inbox's subscription; `""` for the outbox.
    pub subscription: String,
    pub topic: String,
    pub pending: i64,
    pub completed: i64,
    pub failed: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    pub pending: i64,
    pub completed: i64,
    pub failed: i64,
    pub oldest_pending_age: Option<Duration>,
    pub blocked_keys: i64,
    pub topics: Vec<TopicStats>,
}

/// An opaque page token for any cursor.
pub fn encode_token<T: Serialize>(cursor: &T) -> String {
    let json = serde_json::to_vec(cursor).expect("cursors serialize");
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
}

/// Decodes a page token; a malformed one is `INVALID_ARGUMENT` naming `page_token`.
pub fn decode_token<T: for<'de> Deserialize<'de>>(token: &str) -> Result<T, Error> {
    let bad = || Error::invalid("page_token", "is not a token this server issued");
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    serde_json::from_slice(&bytes).map_err(|_| bad())
}

/// The operator surface over a store: runs the store's admin queries and, after a
/// requeue or cancel, wakes keys that a relay held at that moment once it lets go.
#[derive(Clone)]
pub struct Admin {
    store: Arc<dyn Store>,
    /// How long to keep waking a leased key: at most one relay lease.
    wake_for: Duration,
}

impl Admin {
    pub fn new(store: Arc<dyn Store>, relay_lease: Duration) -> Self {
        Admin {
            store,
            wake_for: relay_lease + Duration::from_secs(5),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub async fn list_pending(&self, b: BoxKind, q: &PendingQuery) -> Result<PendingPage, Error> {
        self.store.list_pending(b, q).await
    }

    pub async fn requeue(&self, b: BoxKind, r: &RequeueRequest) -> Result<RequeueOutcome, Error> {
        let out = self.store.requeue_failed(b, r).await?;
        self.wake_later(b, out.leased_keys.clone());
        Ok(out)
    }

    pub async fn cancel(&self, b: BoxKind, r: &CancelRequest) -> Result<CancelOutcome, Error> {
        let out = self.store.cancel_events(b, r).await?;
        self.wake_later(b, out.leased_keys.clone());
        Ok(out)
    }

    pub async fn get_event(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> Result<EventDetail, Error> {
        self.store
            .event_detail(b, id, with_payload)
            .await?
            .ok_or_else(|| Error::NotFound(format!("event {id}")))
    }

    pub async fn list_events(&self, b: BoxKind, q: &EventsQuery) -> Result<EventsPage, Error> {
        self.store.list_events(b, q).await
    }

    pub async fn list_audit(
        &self,
        page_size: u32,
        before_id: Option<i64>,
    ) -> Result<AuditPage, Error> {
        self.store.list_audit(page_size, before_id).await
    }

    pub async fn stats(&self, b: BoxKind, subscription: Option<&str>) -> Result<Stats, Error> {
        self.store.stats(b, subscription).await
    }

    /// A relay that held a key during a requeue or cancel sets the key's readiness from
    /// what it saw when it releases it, which may park the key although it now has
    /// work. Wake such keys once they are released (waking early is always harmless).
    fn wake_later(&self, b: BoxKind, mut keys: Vec<AdminKey>) {
        if keys.is_empty() {
            return;
        }
        let store = self.store.clone();
        let deadline = tokio::time::Instant::now() + self.wake_for;
        tokio::spawn(async move {
            while !keys.is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                match store.wake_released_keys(b, &keys).await {
                    Ok(still_leased) => keys = still_leased,
                    Err(e) => tracing::warn!(error = %e, "waking requeued keys failed"),
                }
            }
        });
    }
}

/// Constant-time comparison of two secrets (the length is not hidden).
pub fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_garbage_is_invalid() {
        let c = PendingCursor {
            order: PendingOrder::Oldest,
            pending: 3,
            oldest_us: 17,
            subscription: "billing".into(),
            topic: "t".into(),
            key: "k/é".into(),
        };
        let t = encode_token(&c);
        assert_eq!(decode_token::<PendingCursor>(&t).unwrap(), c);
        // A token made before the inbox existed has no subscription: still valid.
        let old = r#"{"order":"MostPending","pending":2,"oldest_us":1,"topic":"t","key":"k"}"#;
        let old = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(old);
        assert_eq!(
            decode_token::<PendingCursor>(&old).unwrap().subscription,
            ""
        );
        for bad in ["", "!!", "eyJ4Ijox", &encode_token(&5i64)] {
            match decode_token::<PendingCursor>(bad) {
                Err(Error::InvalidArgument(v)) => assert_eq!(v[0].field, "page_token"),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn secrets_compare() {
        assert!(secrets_equal(b"abc", b"abc"));
        assert!(!secrets_equal(b"abc", b"abd"));
        assert!(!secrets_equal(b"abc", b"abcd"));
        assert!(secrets_equal(b"", b""));
    }
}

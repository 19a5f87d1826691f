//! The operator's vocabulary: backlog queries, requeue and cancel requests and their
//! outcomes, event details, audit entries and stats. The store's admin half answers in
//! these types; `crate::admin` serves them and `api::admin` converts them to pb.
//!
//! Both boxes are served by the same queries. The inbox adds one dimension: its lines
//! are (subscription, topic, key), so backlog groups, key rows and filters carry the
//! subscription; for the outbox it is empty (`""` / `None`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{BoxKind, EventId, Status, StoredEvent};

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

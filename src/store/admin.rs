//! The operator half of the store: backlog by key, inspection, requeue, cancel, audit and
//! stats. Implemented per engine in `postgres_admin.rs` and `sqlite_admin.rs`; every
//! `Store` is an `AdminStore` too. Selection checks that need the transaction (unknown
//! ids, events in the wrong state) are made here and reported as service errors.

use crate::admin::{
    AdminKey, AuditPage, CancelOutcome, CancelRequest, EventDetail, EventsPage, EventsQuery,
    PendingPage, PendingQuery, RequeueOutcome, RequeueRequest, Stats,
};
use crate::domain::{BoxKind, EventId, Status};
use crate::error::Error;
use crate::store::StoreError;

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        StoreError::from(e).into()
    }
}

pub type AdminResult<T> = Result<T, Error>;

#[async_trait::async_trait]
pub trait AdminStore: Send + Sync {
    /// One page of the backlog grouped by (topic, key) — (subscription, topic, key) for
    /// the inbox — with totals.
    async fn list_pending(&self, b: BoxKind, q: &PendingQuery) -> AdminResult<PendingPage>;

    /// Puts failed events back in line (or counts them, on dry run), wakes their keys and
    /// records the audit entry, in one transaction. Explicit ids: all must exist
    /// (`NotFound`) and be failed (`FailedPrecondition`), else nothing changes.
    async fn requeue_failed(&self, b: BoxKind, r: &RequeueRequest) -> AdminResult<RequeueOutcome>;

    /// Moves pending events to failed with the operator's reason, wakes their keys and
    /// records the audit entry, in one transaction; same id checks as a requeue.
    async fn cancel_events(&self, b: BoxKind, r: &CancelRequest) -> AdminResult<CancelOutcome>;

    /// One event; the payload is left empty unless asked for.
    async fn event_detail(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> AdminResult<Option<EventDetail>>;

    /// Events newest first, without payloads.
    async fn list_events(&self, b: BoxKind, q: &EventsQuery) -> AdminResult<EventsPage>;

    /// Audit entries newest first.
    async fn list_audit(&self, page_size: u32, before_id: Option<i64>) -> AdminResult<AuditPage>;

    /// Counts by status and topic (by subscription and topic for the inbox), oldest
    /// pending age, blocked keys; `subscription` narrows the inbox to one subscription.
    async fn stats(&self, b: BoxKind, subscription: Option<&str>) -> AdminResult<Stats>;

    /// Makes the given keys ready now if no relay holds them (and they have pending
    /// events); returns the keys still held.
    async fn wake_released_keys(&self, b: BoxKind, keys: &[AdminKey])
    -> AdminResult<Vec<AdminKey>>;
}

/// The explicit-id checks shared by both engines: `found` holds (id, status) of the ids
/// that exist.
pub(crate) fn check_ids(
    ids: &[EventId],
    found: &[(EventId, Status)],
    wanted: Status,
    verb: &str,
) -> AdminResult<()> {
    let known: std::collections::HashSet<EventId> = found.iter().map(|(id, _)| *id).collect();
    let missing: Vec<String> = ids
        .iter()
        .filter(|id| !known.contains(*id))
        .map(ToString::to_string)
        .collect();
    if !missing.is_empty() {
        return Err(Error::NotFound(format!(
            "no event with id {}; nothing was changed",
            some_of(&missing)
        )));
    }
    let wrong: Vec<String> = found
        .iter()
        .filter(|(_, s)| *s != wanted)
        .map(|(id, s)| format!("{id} is {}", s.as_str()))
        .collect();
    if !wrong.is_empty() {
        return Err(Error::FailedPrecondition(format!(
            "only {} events can be {verb}: {}; nothing was changed",
            wanted.as_str(),
            some_of(&wrong)
        )));
    }
    Ok(())
}

/// At most the first `SHOWN` items and how many more: an error naming 100,000 ids must
/// stay far below gRPC's metadata limits (the message travels in a header).
pub(crate) fn some_of(items: &[String]) -> String {
    const SHOWN: usize = 10;
    let head = items[..items.len().min(SHOWN)].join(", ");
    match items.len().saturating_sub(SHOWN) {
        0 => head,
        more => format!("{head} and {more} more"),
    }
}

/// The keys of a set of events as (subscription, topic, key), sorted and distinct: the
/// lock order enqueue and receive use (the subscription is `""` in the outbox, where all
/// keys share it). Unkeyed events have no key row.
pub(crate) fn sorted_keys<'a>(
    keys: impl Iterator<Item = (&'a str, &'a str, Option<&'a str>)>,
) -> Vec<(&'a str, &'a str, &'a str)> {
    let set: std::collections::BTreeSet<(&str, &str, &str)> =
        keys.filter_map(|(s, t, k)| k.map(|k| (s, t, k))).collect();
    set.into_iter().collect()
}

/// A key row as the admin reports it: the subscription is kept for the inbox only.
pub(crate) fn admin_key(b: BoxKind, subscription: String, topic: String, key: String) -> AdminKey {
    AdminKey {
        subscription: match b {
            BoxKind::Outbox => None,
            BoxKind::Inbox => Some(subscription),
        },
        topic,
        key,
    }
}

#[cfg(test)]
mod short_errors {
    use super::*;

    #[test]
    fn an_error_naming_100000_ids_stays_short() {
        let ids: Vec<EventId> = (1..=100_000).collect();
        let e = check_ids(&ids, &[], Status::Failed, "requeued").unwrap_err();
        let msg = e.to_string();
        assert!(msg.len() < 200, "{} bytes", msg.len());
        assert!(msg.contains("99990 more"), "{msg}");
        let found: Vec<(EventId, Status)> = ids.iter().map(|i| (*i, Status::Pending)).collect();
        let e = check_ids(&ids, &found, Status::Failed, "requeued").unwrap_err();
        assert!(e.to_string().len() < 300, "{e}");
    }
}

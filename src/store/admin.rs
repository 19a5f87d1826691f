//! The operator half of the store: backlog by key, inspection, requeue, cancel, audit and
//! stats. Every `Store` is an `AdminStore` too: the flows are written once in
//! `admin_flow.rs` over each engine's statements (`postgres/admin.rs`,
//! `sqlite/admin.rs`). Selection checks that need the transaction (unknown ids, events in
//! the wrong state) are made there and reported as typed store errors
//! (`StoreError::Missing`, `StoreError::WrongState`).

use super::StoreResult;
use crate::domain::admin::{
    AdminKey, AuditPage, CancelOutcome, CancelRequest, DeadLetter, EventDetail, EventsPage,
    EventsQuery, PauseOutcome, PauseRequest, PendingPage, PendingQuery, RateCount,
    RepublishRequest, RepublishSelection, RequeueOutcome, RequeueRequest, Stats, TopicPause,
};
use crate::domain::{BoxKind, EventId};

/// The store's operator queries and actions, for both boxes.
#[async_trait::async_trait]
pub trait AdminStore: Send + Sync {
    /// One page of the backlog grouped by (topic, key) — (subscription, topic, key) for
    /// the inbox — with totals.
    async fn list_pending(&self, b: BoxKind, q: &PendingQuery) -> StoreResult<PendingPage>;

    /// Puts failed events back in line (or counts them, on dry run), wakes their keys and
    /// records the audit entry, in one transaction. Explicit ids: all must exist
    /// (`NotFound`) and be failed (`FailedPrecondition`), else nothing changes.
    async fn requeue_failed(&self, b: BoxKind, r: &RequeueRequest) -> StoreResult<RequeueOutcome>;

    /// Moves pending events to failed with the operator's reason, wakes their keys and
    /// records the audit entry, in one transaction; same id checks as a requeue.
    async fn cancel_events(&self, b: BoxKind, r: &CancelRequest) -> StoreResult<CancelOutcome>;

    /// The completed events a republish (outbox) or redelivery (inbox) selects, in id
    /// order, with their size and, unless on dry run or over `max_bytes`, their content;
    /// or, when the request id names such an action already recorded, that one (and
    /// nothing is read). Explicit ids: all must exist (`NotFound`) and be completed
    /// (`FailedPrecondition`).
    async fn copy_selection(
        &self,
        b: BoxKind,
        r: &RepublishRequest,
        max_bytes: i64,
    ) -> StoreResult<RepublishSelection>;

    /// Records the audit entry (`republish` or `redeliver`) of an action whose copies are
    /// stored: `count` events.
    async fn record_copies(&self, b: BoxKind, r: &RepublishRequest, count: i64)
    -> StoreResult<i64>;

    /// Adds deliveries to their minutes' rows and deletes the rows before `prune_before`,
    /// in one transaction.
    async fn add_rates(&self, counts: &[RateCount], prune_before: i64) -> StoreResult<()>;

    /// (minute, deliveries) of a box (and subscription, `""` for the outbox) from
    /// `since` on, by minute.
    async fn rates(
        &self,
        b: BoxKind,
        subscription: &str,
        since: i64,
    ) -> StoreResult<Vec<(i64, i64)>>;

    /// Up to `limit` failed events waiting for the dead-letter pump, oldest failure
    /// first, each with its content (or none when retention removed it).
    async fn dead_letters(&self, limit: u32) -> StoreResult<Vec<DeadLetter>>;

    /// Deletes the given dead letters (handled).
    async fn drop_dead_letters(&self, done: &[DeadLetter]) -> StoreResult<()>;

    /// One event; the payload is left empty unless asked for.
    async fn event_detail(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> StoreResult<Option<EventDetail>>;

    /// Events newest first, without payloads.
    async fn list_events(&self, b: BoxKind, q: &EventsQuery) -> StoreResult<EventsPage>;

    /// Audit entries newest first.
    async fn list_audit(&self, page_size: u32, before_id: Option<i64>) -> StoreResult<AuditPage>;

    /// Counts by status and topic (by subscription and topic for the inbox), oldest
    /// pending age, blocked keys; `subscription` narrows the inbox to one subscription.
    async fn stats(&self, b: BoxKind, subscription: Option<&str>) -> StoreResult<Stats>;

    /// Pauses an outbox topic (`Outbox`) or an inbox subscription (`Inbox`; its name in
    /// `r.topic`) and records the audit entry, in one transaction; one already paused
    /// keeps its pause (`changed` false, no entry).
    async fn pause(&self, b: BoxKind, r: &PauseRequest) -> StoreResult<PauseOutcome>;

    /// Lifts a topic's or subscription's pause and records the audit entry, in one
    /// transaction; one not paused is left as it is (`changed` false, no entry).
    async fn resume(&self, b: BoxKind, r: &PauseRequest) -> StoreResult<PauseOutcome>;

    /// The paused topics (`Outbox`) or subscriptions (`Inbox`; the name in `topic`), only
    /// `name`'s if given, by name.
    async fn paused(&self, b: BoxKind, name: Option<&str>) -> StoreResult<Vec<TopicPause>>;

    /// Makes the given keys ready now if no relay holds them (and they have pending
    /// events); returns the keys still held.
    async fn wake_released_keys(&self, b: BoxKind, keys: &[AdminKey])
    -> StoreResult<Vec<AdminKey>>;
}

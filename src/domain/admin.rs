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
    /// The group's pending count.
    pub pending: i64,
    /// Microseconds since the epoch of the group's oldest pending event.
    pub oldest_us: i64,
    /// The inbox's subscription; `""` for the outbox (and in tokens made before the
    /// inbox existed).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub subscription: String,
    /// The group's topic.
    pub topic: String,
    /// The group's key; `""` for unkeyed events.
    pub key: String,
}

/// A validated ListPending request: filters, order and page.
#[derive(Debug, Clone)]
pub struct PendingQuery {
    /// Inbox only: one subscription.
    pub subscription: Option<String>,
    /// Only this topic (exact).
    pub topic: Option<String>,
    /// Only keys starting with this prefix; unkeyed groups are left out when set.
    pub key_prefix: Option<String>,
    /// Only groups whose head is blocked (see `KeyBacklog::blocked`).
    pub only_blocked: bool,
    /// How the groups are sorted.
    pub order: PendingOrder,
    /// Groups per page; at least 1 (the API accepts 1..=1000).
    pub page_size: u32,
    /// Continue after this cursor (the previous page's `next`); `None` for the first page.
    pub after: Option<PendingCursor>,
}

/// The pending backlog of one (topic, key) — for the inbox, of one (subscription, topic,
/// key); unkeyed events are grouped under key "".
#[derive(Debug, Clone, PartialEq)]
pub struct KeyBacklog {
    /// The inbox's subscription; `""` for the outbox.
    pub subscription: String,
    /// The group's topic.
    pub topic: String,
    /// The group's key; `""` for the topic's unkeyed events.
    pub key: String,
    /// Pending events in the group.
    pub pending: i64,
    /// The oldest pending event is the key's head: ids follow acceptance order.
    pub oldest_created_at: DateTime<Utc>,
    /// The head's id: the group's lowest pending id.
    pub head_id: EventId,
    /// Delivery attempts the head has used so far.
    pub head_attempts: u32,
    /// When the head is next due (its `scheduled_at`).
    pub head_next_attempt_at: DateTime<Utc>,
    /// The head's last error; `None` if it has none.
    pub head_last_error: Option<String>,
    /// The head has been tried (or carries an error) and its retry is not due yet.
    pub blocked: bool,
    /// The group's topic is paused (outbox): nothing of it is published until resumed.
    pub paused: bool,
}

/// One page of the ListPending backlog.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingPage {
    /// This page's groups, in the query's order.
    pub keys: Vec<KeyBacklog>,
    /// Cursor for the next page; `None` on the last page.
    pub next: Option<PendingCursor>,
    /// Totals over the topic and key-prefix filters (not `only_blocked`, not the page).
    pub total_pending: i64,
    /// Groups over the same filters.
    pub total_keys: i64,
    /// Blocked groups over the same filters.
    pub total_blocked_keys: i64,
    /// The paused topics (outbox; within the topic filter).
    pub paused: Vec<TopicPause>,
}

/// Selects events by their attributes; every set field must match.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EventFilter {
    /// Inbox only: the subscription, exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscription: Option<String>,
    /// The topic, exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// The key, exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The event type, exact.
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
    /// The key starts with this text (unkeyed events never match).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_prefix: Option<String>,
    /// Created at or after.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_after: Option<DateTime<Utc>>,
    /// Created strictly before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_before: Option<DateTime<Utc>>,
    /// Every header named here has exactly this value.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The producer's idempotency key, exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Inbox only: the message id, exact.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    /// Only ids above this: where a job's next page starts. Not part of the API and not
    /// recorded with a selection.
    #[serde(skip)]
    pub after_id: Option<i64>,
    /// Only ids up to this: the highest id when a job started.
    #[serde(skip)]
    pub through_id: Option<i64>,
}

/// Which failed events a requeue takes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
// One per admin request: the filter's size costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Selection {
    /// These events, by id: each must exist and be failed, else nothing changes.
    Ids(Vec<EventId>),
    /// Failed events matching the filter, in id order, up to the request's `limit`.
    Filter(EventFilter),
}

/// Most events one republish copies (one transaction of the intake; larger selections
/// are several calls, each with its own request id).
pub const MAX_REPUBLISH: u32 = 1000;
/// Bytes (payloads, headers, strings) one republish may copy: the copies are held in
/// memory and stored in one transaction.
pub const MAX_REPUBLISH_BYTES: usize = 64 * 1024 * 1024;
/// The header a republished copy carries: its original's id.
pub const REPUBLISHED_FROM: &str = "mailroom-republished-from";
/// The header a redelivered inbox message carries: its original's id.
pub const REDELIVERED_FROM: &str = "mailroom-redelivered-from";

/// How `GetEvent` names an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventRef {
    /// By id.
    Id(EventId),
    /// Outbox: by the producer's idempotency key.
    IdempotencyKey(String),
    /// Inbox: by message id, in one subscription or in any.
    MessageId {
        /// The message id.
        message_id: String,
        /// The subscription, when the caller named one.
        subscription: Option<String>,
    },
}

/// A validated RepublishEvents (outbox) or RedeliverMessages (inbox) request.
#[derive(Debug, Clone)]
pub struct RepublishRequest {
    /// The completed events (outbox) or handled messages (inbox) to send again.
    pub selection: Selection,
    /// Most events a filter takes (1..=`MAX_REPUBLISH`); a list of ids may not be longer.
    pub limit: u32,
    /// Who acts, and whether for real (`dry_run` unless the caller confirmed).
    pub context: ActionContext,
}

/// An event to copy, as the store read it.
#[derive(Debug, Clone, PartialEq)]
pub struct EventCopy {
    /// The original's id.
    pub id: EventId,
    /// Inbox: the original's subscription and message id; `""`/`None` in the outbox.
    pub subscription: String,
    #[allow(missing_docs)]
    pub message_id: Option<String>,
    /// The original's topic, key, payload, headers, type and attempt budget, copied.
    pub topic: String,
    #[allow(missing_docs)]
    pub key: Option<String>,
    #[allow(missing_docs)]
    pub payload: Vec<u8>,
    #[allow(missing_docs)]
    pub headers: std::collections::BTreeMap<String, String>,
    #[allow(missing_docs)]
    pub event_type: Option<String>,
    #[allow(missing_docs)]
    pub max_attempts: u32,
}

/// What the store found for a republish.
#[derive(Debug, Clone, PartialEq)]
pub enum RepublishSelection {
    /// The request id named a republish done before.
    Replayed {
        /// Its audit entry.
        audit_id: i64,
        /// The events it republished.
        count: i64,
    },
    /// The selected originals.
    Selected {
        /// Their ids, in id order.
        ids: Vec<EventId>,
        /// Their content, in id order; empty on dry run and over the byte limit.
        copies: Vec<EventCopy>,
        /// Bytes their content holds (payloads, headers, topics, keys).
        bytes: i64,
    },
}

/// Deliveries of one minute (since the Unix epoch) in a box (and subscription), as the
/// rate history keeps them (`crate::rates`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateCount {
    /// The box.
    pub box_kind: BoxKind,
    /// The inbox's subscription; `""` for the outbox.
    pub subscription: String,
    /// Minutes since the Unix epoch.
    pub minute: i64,
    /// Deliveries to add.
    pub n: i64,
}

/// A failed event waiting for the dead-letter pump (`crate::dead_letter`).
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    /// The box it failed in.
    pub box_kind: BoxKind,
    /// The event (message) id.
    pub event_id: EventId,
    /// When it failed (its `updated_at` then): two failures of one event differ.
    pub failed_at: DateTime<Utc>,
    /// The event as it is now, with its payload; `None` when retention removed it.
    pub event: Option<EventDetail>,
}

/// What a republish did (or, on dry run, would do).
#[derive(Debug, Clone, PartialEq)]
pub struct RepublishOutcome {
    /// Events republished; on dry run, selected; on replay, republished the first time.
    pub count: i64,
    /// The first `SAMPLE_IDS` originals of the selection; empty on replay.
    pub sample_ids: Vec<EventId>,
    /// The audit entry written (or the earlier one, on replay); `None` on dry run or when
    /// nothing matched.
    pub audit_id: Option<i64>,
    /// Whether the request id named an action done before (nothing changed now).
    pub replayed: bool,
    /// (original, copy) ids, in id order; empty on dry run and replay.
    pub copies: Vec<(EventId, EventId)>,
}

/// Who runs an admin action (requeue, cancel) and how: what its audit entry records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionContext {
    /// Only check the selection: nothing changes, no audit entry is written.
    pub dry_run: bool,
    /// Who acts, as the audit entry records it: the operator the caller names, with its token.
    pub actor: String,
    /// The authenticated token name, recorded apart from the claimed operator.
    pub principal: Option<String>,
    /// A repeated id (per action and box) acts once.
    pub request_id: Option<String>,
}

impl ActionContext {
    /// An action for real by `actor`, with no token name and no request id.
    pub fn by(actor: impl Into<String>) -> Self {
        ActionContext {
            dry_run: false,
            actor: actor.into(),
            principal: None,
            request_id: None,
        }
    }
}

/// A validated RequeueFailed request.
#[derive(Debug, Clone)]
pub struct RequeueRequest {
    /// The failed events to put back in line.
    pub selection: Selection,
    /// Most events a filter takes (1..=`MAX_REQUEUE`; `DEFAULT_REQUEUE` when the caller gives
    /// none); a list of ids may not be longer.
    pub limit: u32,
    /// Who acts, and whether for real.
    pub context: ActionContext,
}

/// What a requeue did (or, on dry run, would do).
#[derive(Debug, Clone, PartialEq)]
pub struct RequeueOutcome {
    /// Events requeued; on dry run, selected; on replay, requeued the first time.
    pub count: i64,
    /// The first `SAMPLE_IDS` ids of the selection; empty on replay.
    pub sample_ids: Vec<EventId>,
    /// The audit entry written (or the earlier one, on replay); `None` on dry run or when
    /// nothing matched.
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
    /// The key's topic.
    pub topic: String,
    /// The key itself (keyed events only: unkeyed events have no key row).
    pub key: String,
}

/// A validated CancelEvents request.
#[derive(Debug, Clone)]
pub struct CancelRequest {
    /// The pending events to cancel: each must exist and be pending, else nothing changes.
    pub ids: Vec<EventId>,
    /// Why, kept as each event's last error (`cancelled: <reason>`) and in the audit entry.
    pub reason: String,
    /// Who acts, and whether for real.
    pub context: ActionContext,
}

/// What a cancel did (or, on dry run, would do).
#[derive(Debug, Clone, PartialEq)]
pub struct CancelOutcome {
    /// The events cancelled (on replay: as recorded the first time).
    pub ids: Vec<EventId>,
    /// The audit entry written (or the earlier one, on replay); `None` on dry run.
    pub audit_id: Option<i64>,
    /// Keys a relay held at the time; they are woken again once released.
    pub leased_keys: Vec<AdminKey>,
    /// The request_id named an action already done; nothing changed.
    pub replayed: bool,
}

/// One event with what an operator needs; the payload only on request.
#[derive(Debug, Clone, PartialEq)]
pub struct EventDetail {
    /// The event and its delivery state; the payload is empty unless asked for.
    pub event: StoredEvent,
    /// The payload's size in bytes, whether or not the payload is included.
    pub payload_size: i64,
    /// Inbox messages: the subscription and the message id (dedup key).
    pub subscription: Option<String>,
    /// The inbox message id (dedup key); `None` in the outbox.
    pub message_id: Option<String>,
    /// The last counted attempts (at most 10), oldest first; empty in listings.
    pub attempt_log: Vec<AttemptRecord>,
}

/// One counted delivery attempt of an event: its number, when it ended, and its error.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptRecord {
    /// The attempt's number (1 for the first).
    pub attempt: u32,
    /// When the relay settled it.
    pub at: DateTime<Utc>,
    /// Why it failed (at most 1000 characters).
    pub error: String,
}

/// A validated ListEvents request.
#[derive(Debug, Clone)]
pub struct EventsQuery {
    /// Only events in this status; `None` for every status.
    pub status: Option<Status>,
    /// Only events matching this filter.
    pub filter: EventFilter,
    /// Events per page; at least 1 (the API accepts 1..=1000).
    pub page_size: u32,
    /// Ids strictly below this one (pages go newest first).
    pub before_id: Option<EventId>,
}

/// One page of ListEvents, newest first.
#[derive(Debug, Clone, PartialEq)]
pub struct EventsPage {
    /// This page's events, without payloads.
    pub events: Vec<EventDetail>,
    /// `before_id` for the next page; `None` on the last page.
    pub next_before_id: Option<EventId>,
}

/// One entry of the admin audit log: a requeue or cancel that changed something.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditEntry {
    /// The entry's id; entries are listed newest (highest id) first.
    pub id: i64,
    /// When the action was recorded, by the database's clock.
    pub at: DateTime<Utc>,
    /// Who acted: the operator the caller named, with its token.
    pub actor: String,
    /// `"requeue"` or `"cancel"`.
    pub action: String,
    /// The box the action applied to.
    pub box_kind: BoxKind,
    /// The selection as JSON text: `{"ids": [...]}` (with `"reason"` for a cancel) or
    /// `{"filter": {...}, "limit": n}`.
    pub selection: String,
    /// Events changed.
    pub count: i64,
    /// The authenticated token name; `None` without one.
    pub principal: Option<String>,
    /// The caller's request id, if it gave one.
    pub request_id: Option<String>,
}

/// One page of the audit log, newest first.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditPage {
    /// This page's entries.
    pub entries: Vec<AuditEntry>,
    /// `before_id` for the next page; `None` on the last page.
    pub next_before_id: Option<i64>,
}

/// Event counts of one topic (for the inbox, of one subscription's topic) by status.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TopicStats {
    /// The inbox's subscription; `""` for the outbox.
    pub subscription: String,
    /// The topic.
    pub topic: String,
    /// Pending events.
    pub pending: i64,
    /// Completed events.
    pub completed: i64,
    /// Failed events.
    pub failed: i64,
    /// The topic is paused (outbox), or its subscription (inbox).
    pub paused: bool,
}

/// Counts over a box (or one inbox subscription).
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    /// Pending events in all.
    pub pending: i64,
    /// Completed events in all.
    pub completed: i64,
    /// Failed events in all.
    pub failed: i64,
    /// Age of the oldest pending event, by the database's clock; `None` when nothing is pending.
    pub oldest_pending_age: Option<Duration>,
    /// Keys whose head is blocked (see `KeyBacklog::blocked`).
    pub blocked_keys: i64,
    /// Per-topic counts, sorted by (subscription, topic).
    pub topics: Vec<TopicStats>,
}

/// A paused topic (outbox): relays claim none of its events until it is resumed, so they
/// stay pending and spend no attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct TopicPause {
    /// The topic.
    pub topic: String,
    /// The operator's reason.
    pub reason: String,
    /// Who paused it (the operator named, with the token).
    pub actor: String,
    /// The authenticated token name, if any.
    pub principal: Option<String>,
    /// When.
    pub paused_at: DateTime<Utc>,
}

/// A validated PauseTopic or ResumeTopic request.
#[derive(Debug, Clone)]
pub struct PauseRequest {
    /// The topic.
    pub topic: String,
    /// Pause: the operator's reason (required). Resume: unused.
    pub reason: String,
    /// Who acts; `dry_run` and `request_id` do not apply (both actions are idempotent).
    pub context: ActionContext,
}

/// What a pause or resume did.
#[derive(Debug, Clone, PartialEq)]
pub struct PauseOutcome {
    /// Whether anything changed: `false` when the topic was already paused (pause) or
    /// not paused (resume); no audit entry is written then.
    pub changed: bool,
    /// The pause in force after a pause (the earlier one when it was already paused);
    /// the pause lifted by a resume, if there was one.
    pub pause: Option<TopicPause>,
    /// The audit entry, when something changed.
    pub audit_id: Option<i64>,
}

/// A validated RewindSubscription request.
#[derive(Debug, Clone)]
pub struct RewindRequest {
    /// A configured subscription.
    pub subscription: String,
    /// Every partition goes back to its first record at or after this time.
    pub to_time: DateTime<Utc>,
    /// Hand the records read again to the handler (else they are dropped as duplicates).
    pub redeliver: bool,
    /// Who asks; `dry_run` unless confirmed; the request id.
    pub context: ActionContext,
}

/// A rewind an operator asked for, with the partitions consumers applied it to.
#[derive(Debug, Clone, PartialEq)]
pub struct Rewind {
    /// Id.
    pub id: i64,
    /// The subscription.
    pub subscription: String,
    /// The time it goes back to.
    pub to_time: DateTime<Utc>,
    /// Whether the records read again are handed over again.
    pub redeliver: bool,
    /// Who asked.
    pub actor: String,
    /// Their token's name.
    pub principal: Option<String>,
    /// The request id.
    pub request_id: Option<String>,
    /// When it was asked for.
    pub created_at: DateTime<Utc>,
    /// The partitions a consumer rewound, by topic and partition.
    pub partitions: Vec<RewindPartition>,
}

/// One partition a consumer rewound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewindPartition {
    /// The rewind.
    pub rewind_id: i64,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The offset it went back to: the first record at or after the rewind's time.
    pub from_offset: i64,
    /// The position it left: records from `from_offset` up to here are read again.
    pub until_offset: i64,
    /// When the new position was committed; `None` while it is being applied.
    pub applied_at: Option<DateTime<Utc>>,
}

/// What RewindSubscription did.
#[derive(Debug, Clone, PartialEq)]
pub struct RewindStart {
    /// The rewind stored (none on a dry run).
    pub rewind: Option<Rewind>,
    /// Messages of the subscription stored since the rewind's time: about what is read
    /// again (records never stored, or removed by retention, come on top).
    pub stored_since: i64,
    /// The request id named a rewind already asked for.
    pub replayed: bool,
    /// The audit entry (none on a dry run or a replay).
    pub audit_id: Option<i64>,
}

/// The header a message read again by a `redeliver` rewind carries: the rewind's id.
pub const REWOUND_BY: &str = "mailroom-rewound-by";

//! Storage: the `Store` trait every engine implements, and the types that cross it.
//! All SQL lives in the engines' folders, `postgres/` and `sqlite/`; nothing outside this
//! module runs a query. What is the same on every engine is written once here: the
//! errors (`error.rs`), admission of new events (`admission.rs`), row decoding
//! (`rows.rs`), the admin flows (`admin_flow.rs` over the engine interface
//! `admin_sql.rs`) and the admin statements' shared text (`shape.rs`).
//!
//! Keyed events are claimed through a per-key row (`*_keys`): a relay leases a key, reads
//! that key's line in id order from an index, and settles. The lease is the mutual
//! exclusion between relays; the key row's `ready_at` says when the key may next have
//! something to publish, so a claim touches only ready keys and its cost is proportional
//! to what it hands out, never to the depth of a key or the size of the table.

pub mod admin;
mod admin_flow;
mod admin_sql;
mod admission;
mod error;
pub mod postgres;
pub mod retention;
mod rows;
pub mod schema;
mod shape;
pub mod sqlite;

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::domain::{BoxKind, EventId, InboundMessage, NewEvent, Queue, Status, StoredEvent};

pub use error::{StoreError, StoreResult};

/// The outcome for one event of an enqueue call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Stored, with its new id.
    Inserted(EventId),
    /// Already stored (same idempotency key and content, or the same inbox message id):
    /// the stored event's id.
    Duplicate(EventId),
    /// The idempotency key is taken by an event with other content.
    Conflict,
}

/// An inbox row found by its message id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldId {
    /// The message id.
    pub message_id: String,
    /// The row holding it.
    pub id: EventId,
    /// When the row was stored.
    pub created_at: DateTime<Utc>,
}

/// The identity of an ordered line: one (topic, key).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LineKey {
    /// The topic.
    pub topic: String,
    /// The key; unkeyed events have no line.
    pub key: String,
}

/// The front of one leased key's line: its pending events in id order that are *in
/// line* (due, or tried and waiting for a retry), at most the claim's per-key limit and
/// within its byte budget. Never-tried events scheduled for later are not in line: the
/// read skips them (so any number of them cannot park the due events behind them) and
/// reports only the earliest schedule among those it passed. `full` says a limit cut
/// the window, so more may follow.
#[derive(Debug, Clone)]
pub struct KeyWindow {
    /// The key whose line this is.
    pub line: LineKey,
    /// The window's events, in id order.
    pub rows: Vec<StoredEvent>,
    /// A limit cut the window: more of the line may follow.
    pub full: bool,
    /// The earliest schedule of the never-tried delayed events before the window's end
    /// (of all of them when the window is not full): when the key must be looked at again.
    pub delayed_at: Option<DateTime<Utc>>,
    /// The highest pending id (delayed events included) before the window's end, i.e.
    /// of the whole key when the window is not full: anything above it arrived later.
    pub line_end: Option<EventId>,
}

/// How many of the leading items (of the given sizes) fit in `budget` bytes: always at
/// least one, so an event larger than the budget still goes out, alone.
pub fn fit_in_budget(sizes: impl IntoIterator<Item = u64>, budget: u64) -> usize {
    let mut total: u64 = 0;
    let mut n = 0;
    for size in sizes {
        total = total.saturating_add(size);
        if n > 0 && total > budget {
            break;
        }
        n += 1;
    }
    n
}

/// What one claim handed to a relay. `token` identifies this claim: settling with it
/// succeeds only while the claim's lease is still held.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The token passed to `claim`, for `settle` and `renew`.
    pub token: i64,
    /// The database's clock when the claim was made; planning compares schedules to it.
    /// (A claim that leased no key may carry the local clock: nothing plans against it.)
    pub now: DateTime<Utc>,
    /// One window per leased key.
    pub keyed: Vec<KeyWindow>,
    /// Due events without a key, each claimed individually.
    pub unkeyed: Vec<StoredEvent>,
}

impl ClaimLimits {
    /// Rows to read per key when `leased` keys share the budget.
    pub fn per_key(&self, leased: usize) -> u32 {
        // Saturate: past `u32::MAX` keys, each gets one row either way (the clamp).
        let leased = u32::try_from(leased.max(1)).unwrap_or(u32::MAX);
        (self.max_events / leased).clamp(1, self.max_run.max(1))
    }
}

/// Limits of one claim.
#[derive(Debug, Clone, Copy)]
pub struct ClaimLimits {
    /// Keys to lease.
    pub max_keys: u32,
    /// Keyed events to read in all: shared out among the leased keys.
    pub max_events: u32,
    /// Rows to read per key at most (the longest run one cycle may publish).
    pub max_run: u32,
    /// Unkeyed events to claim.
    pub max_unkeyed: u32,
    /// Bytes (payload and headers) of the events read, keyed and unkeyed each; at least
    /// one event is always read, however large.
    pub max_bytes: u64,
    /// How long the claim holds; longer than any publish timeout.
    pub lease: Duration,
}

/// A change to one claimed event, decided by the relay engine.
#[derive(Debug, Clone, PartialEq)]
pub enum EventUpdate {
    /// Delivered (published, or handled in the inbox).
    Completed {
        /// The event.
        id: EventId,
    },
    /// Published, but after an earlier event of its key failed in the same run: the
    /// broker may hold it ahead of that event. `note` is kept as the event's last error,
    /// so `GetEvent` shows it.
    CompletedAfterGap {
        /// The event.
        id: EventId,
        /// Kept as the event's last error.
        note: String,
    },
    /// A counted failure with budget left: `attempts` is the new count, the event is due
    /// again `delay` after the settle.
    Retry {
        /// The event.
        id: EventId,
        /// The new attempt count.
        attempts: u32,
        /// From the settle until the event is due again.
        delay: Duration,
        /// The failure, kept as the event's last error.
        error: String,
    },
    /// A retry at a time the destination named (a sink or inbox handler); it may or may
    /// not spend an attempt.
    RetryAt {
        /// The event.
        id: EventId,
        /// The new attempt count; unchanged when the retry spends no attempt.
        attempts: u32,
        /// When the event is due again.
        at: DateTime<Utc>,
        /// The failure, kept as the event's last error.
        error: String,
    },
    /// Out of attempts (or rejected): terminal until requeued.
    Failed {
        /// The event.
        id: EventId,
        /// The final attempt count.
        attempts: u32,
        /// Why, kept as the event's last error.
        error: String,
    },
    /// Claimed but not reached (unkeyed events only; a keyed line is released with its
    /// key): back in line at once, untouched.
    Release {
        /// The event.
        id: EventId,
    },
}

/// When a retried event is due again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Due {
    /// This long after the settle (the store's clock).
    After(Duration),
    /// At this time, named by the destination.
    At(DateTime<Utc>),
}

/// What an update writes to its event row, the same for every engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct UpdateColumns<'a> {
    /// The new status: `completed`, `failed`, or `pending` (retry, release).
    pub status: Status,
    /// The new attempt count; `None` leaves it.
    pub attempts: Option<u32>,
    /// When it is due again; `None` leaves `scheduled_at`.
    pub due: Option<Due>,
    /// The new last error; `None` leaves it.
    pub error: Option<&'a str>,
    /// A release: the row is untouched apart from its claim (not even `updated_at`).
    pub release: bool,
}

impl EventUpdate {
    /// The columns this update writes.
    pub(crate) fn columns(&self) -> UpdateColumns<'_> {
        let c = UpdateColumns {
            status: Status::Pending,
            attempts: None,
            due: None,
            error: None,
            release: false,
        };
        match self {
            EventUpdate::Completed { .. } => UpdateColumns {
                status: Status::Completed,
                ..c
            },
            EventUpdate::CompletedAfterGap { note, .. } => UpdateColumns {
                status: Status::Completed,
                error: Some(note),
                ..c
            },
            EventUpdate::Retry {
                attempts,
                delay,
                error,
                ..
            } => UpdateColumns {
                attempts: Some(*attempts),
                due: Some(Due::After(*delay)),
                error: Some(error),
                ..c
            },
            EventUpdate::RetryAt {
                attempts,
                at,
                error,
                ..
            } => UpdateColumns {
                attempts: Some(*attempts),
                due: Some(Due::At(*at)),
                error: Some(error),
                ..c
            },
            EventUpdate::Failed {
                attempts, error, ..
            } => UpdateColumns {
                status: Status::Failed,
                attempts: Some(*attempts),
                error: Some(error),
                ..c
            },
            EventUpdate::Release { .. } => UpdateColumns { release: true, ..c },
        }
    }

    /// The event this update is for.
    pub fn id(&self) -> EventId {
        match self {
            EventUpdate::Completed { id }
            | EventUpdate::CompletedAfterGap { id, .. }
            | EventUpdate::Retry { id, .. }
            | EventUpdate::RetryAt { id, .. }
            | EventUpdate::Failed { id, .. }
            | EventUpdate::Release { id } => *id,
        }
    }
}

/// When a released key may next have something to publish. The store takes the
/// earliest of the parts that are set; none set means "idle" (no due line left).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Readiness {
    /// An absolute time (a never-tried delayed event's schedule).
    pub at: Option<DateTime<Utc>>,
    /// Relative to the settle (the blocked head's new retry delay; zero for "now").
    pub after: Option<Duration>,
    /// The highest id the relay saw. If the key is otherwise idle and a newer pending
    /// event exists (enqueued during the claim), the key is ready at once.
    pub seen_up_to: Option<EventId>,
}

impl Readiness {
    /// Ready at once.
    pub fn now() -> Self {
        Readiness {
            after: Some(Duration::ZERO),
            ..Default::default()
        }
    }
}

/// The release of one leased key with its next readiness.
#[derive(Debug, Clone)]
pub struct KeyRelease {
    /// The leased key to release.
    pub line: LineKey,
    /// When it may next have something to publish.
    pub ready: Readiness,
}

/// What a settle achieved.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SettleReport {
    /// Updates applied.
    pub applied: usize,
    /// Updates dropped because the claim's keys or events moved to another relay (a
    /// late settle that no one raced is still applied: the lease token fences).
    pub stale: usize,
}

impl SettleReport {
    /// `applied` of `updates` updates went through; the rest were stale.
    pub(crate) fn of(applied: usize, updates: usize) -> Self {
        SettleReport {
            applied,
            stale: updates - applied,
        }
    }
}

/// Durable storage for both boxes.
#[async_trait::async_trait]
pub trait Store: admin::AdminStore + retention::RetentionStore + Send + Sync + 'static {
    /// The engine's name, for logs and health ("postgres", "sqlite").
    fn engine(&self) -> &'static str;

    /// Applies the binary's pending migrations; migrations it does not know (applied by a
    /// newer binary) are left for `schema::decide` to judge, not refused.
    async fn migrate(&self) -> StoreResult<()>;

    /// The schema this binary knows: its highest embedded migration.
    fn known_schema(&self) -> i64;

    /// The database's highest applied migration and what it requires of binaries.
    async fn schema_state(&self) -> StoreResult<schema::SchemaState>;

    /// A cheap round trip, for health checks.
    async fn ping(&self) -> StoreResult<()>;

    /// The UUID generated once for this database by its migrations (0006): names this
    /// installation in the default CloudEvents source.
    async fn installation_id(&self) -> StoreResult<String>;

    /// Stores events in one transaction, in order (ids increase in slice order within a
    /// key). With `atomic`, a `Conflict` anywhere rolls everything back: the returned
    /// outcomes then say which event conflicted and nothing is stored.
    async fn enqueue(&self, events: &[NewEvent], atomic: bool) -> StoreResult<Vec<Admission>>;

    /// Stores inbound messages in a subscription's inbox in one transaction; a message id
    /// already present is a `Duplicate` (of the stored id) and stores nothing.
    async fn receive(
        &self,
        subscription: &str,
        messages: &[InboundMessage],
    ) -> StoreResult<Vec<Admission>>;

    /// The rows of `subscription`'s inbox that hold any of `message_ids`.
    async fn held_ids(
        &self,
        subscription: &str,
        message_ids: &[String],
    ) -> StoreResult<Vec<HeldId>>;

    /// Takes events stored by the SQL API (PostgreSQL, migration 0015) into their keys'
    /// rows: creates or wakes the rows and counts the events. Every outbox claim does it
    /// first; the rest of the time counts and `ListPending` lag it by that much. Returns
    /// how many events it took in (at most a batch). Other engines have nothing to fold.
    async fn fold_sql_events(&self) -> StoreResult<u64> {
        Ok(0)
    }

    /// Leases ready keys, reads their lines and claims due unkeyed events of `box_kind`.
    async fn claim(&self, queue: &Queue, token: i64, limits: ClaimLimits) -> StoreResult<Claim>;

    /// Applies the relay's decisions for a claim and releases its keys, in one
    /// transaction. Updates for keys or events no longer held by `token` are dropped
    /// (counted as stale): another relay owns them now. An expired lease that no other
    /// relay took is still `token`'s, so its settle applies (fewer duplicates).
    async fn settle(&self, settlement: Settlement<'_>) -> StoreResult<SettleReport>;

    /// Extends the lease of keys and unkeyed events a claim still holds while their
    /// deliveries are in flight. Returns how many it still held (a key or event another
    /// relay has taken since is not renewed).
    async fn renew(&self, renewal: Renewal<'_>) -> StoreResult<usize>;

    /// One event by id.
    async fn get_event(&self, box_kind: BoxKind, id: EventId) -> StoreResult<Option<StoredEvent>>;

    /// Number of events, of one status or of all.
    async fn count_events(&self, box_kind: BoxKind, status: Option<Status>) -> StoreResult<i64>;
}

#[cfg(test)]
mod tests {
    use super::fit_in_budget;

    #[test]
    fn a_budget_takes_leading_items_and_always_one() {
        assert_eq!(fit_in_budget([10, 10, 10], 25), 2);
        assert_eq!(fit_in_budget([10, 10, 10], 30), 3);
        assert_eq!(fit_in_budget([100, 1], 10), 1, "one event even over budget");
        assert_eq!(fit_in_budget([], 10), 0);
        assert_eq!(fit_in_budget([0, 0, 5], 0), 2);
        assert_eq!(fit_in_budget([u64::MAX, 1], u64::MAX - 1), 1, "no overflow");
    }
}

/// A lease renewal: what one claim still has in flight, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct Renewal<'a> {
    /// The box (and subscription) the claim is in.
    pub queue: &'a Queue,
    /// The claim's lease token.
    pub token: i64,
    /// Keys whose lines are still being delivered.
    pub lines: &'a [LineKey],
    /// Unkeyed events still being delivered.
    pub unkeyed: &'a [EventId],
    /// The new lease, counted from now.
    pub lease: Duration,
}

/// A claim's settlement: the relay's decisions for its events and the keys it gives back.
#[derive(Debug, Clone, Copy)]
pub struct Settlement<'a> {
    /// The box (and subscription) the claim is in.
    pub queue: &'a Queue,
    /// The claim's lease token: updates under another token are stale.
    pub token: i64,
    /// What became of each delivered (or skipped) event.
    pub updates: &'a [EventUpdate],
    /// The keys released, each with when it is next ready.
    pub releases: &'a [KeyRelease],
}

impl<'a> Settlement<'a> {
    /// The settlement of `token`'s claim in `queue`.
    pub fn new(
        queue: &'a Queue,
        token: i64,
        updates: &'a [EventUpdate],
        releases: &'a [KeyRelease],
    ) -> Self {
        Settlement {
            queue,
            token,
            updates,
            releases,
        }
    }
}

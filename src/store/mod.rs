//! Storage: the `Store` trait every engine implements, and the types that cross it.
//! All SQL lives in the engines' folders, `postgres/` and `sqlite/`; nothing outside this
//! module runs a query. What is the same on every engine is written once here: the
//! errors (`error.rs`), admission of new events (`admission.rs`), row decoding
//! (`rows.rs`), the admin flows (`admin_flow.rs` over the engine interface
//! `admin_sql.rs`) and the admin statements' shared text (`shape.rs`); the types of the
//! relay protocol (claim, decisions, renewal, settlement) in `protocol.rs`.
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
pub mod jobs;
pub mod postgres;
mod protocol;
pub mod retention;
pub mod rewinds;
mod rows;
pub mod schema;
mod shape;
pub mod sqlite;

use chrono::{DateTime, Utc};

use crate::domain::{BoxKind, EventId, InboundMessage, NewEvent, Queue, Status, StoredEvent};

pub use error::{StoreError, StoreResult};
pub(crate) use protocol::Due;
pub use protocol::{
    Claim, ClaimLimits, Continued, EventUpdate, KeyRelease, KeyWindow, LineKey, Readiness, Renewal,
    SettleReport, Settlement, fit_in_budget,
};

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

/// Durable storage for both boxes.
#[async_trait::async_trait]
pub trait Store:
    admin::AdminStore
    + jobs::JobStore
    + rewinds::RewindStore
    + retention::RetentionStore
    + Send
    + Sync
    + 'static
{
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

    /// Whether `continue_line` can go on with lines of `box_kind` (else it always says
    /// `None`, and the relay does not ask).
    fn continues_lines(&self, _box_kind: BoxKind) -> bool {
        false
    }

    /// The window of `line` after `after` (the last event of the run `token` is
    /// delivering), read as a claim reads it, so the relay can send the line's next run
    /// as soon as this one is acknowledged instead of releasing the key and claiming it
    /// again. `horizon` is the one the line's previous `Continued` returned: while
    /// `after` is below it, the window is read up to it without a lock. `None` when the
    /// line cannot go on now: `token` no longer leases the key, its topic is paused, a
    /// SQL-API writer holds the key's order lock (past the horizon), or the engine does
    /// not continue lines (the default); the relay then releases the key as usual.
    async fn continue_line(
        &self,
        _queue: &Queue,
        _token: i64,
        _line: &LineKey,
        _after: EventId,
        _horizon: Option<EventId>,
        _limits: ClaimLimits,
    ) -> StoreResult<Option<Continued>> {
        Ok(None)
    }

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

    /// How each connection pool is used right now (for the metrics, read at scrape time).
    fn pool_use(&self) -> Vec<PoolUse> {
        Vec::new()
    }

    /// Keys whose order lock SQL-API writers have held for long, as this process's claims
    /// found them (for the metrics, read at scrape time). Other engines have no SQL API.
    fn held_keys(&self) -> Vec<HeldKey> {
        Vec::new()
    }
}

/// A key whose order lock SQL-API writers have held longer than the report threshold
/// (docs/sql-api.md, "Order locks"): its events wait for them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldKey {
    /// The key.
    pub line: LineKey,
    /// Since this process's claims first found it held.
    pub held_for: std::time::Duration,
    /// The backend holding it when last looked up (`pg_stat_activity.pid`).
    pub pid: Option<i32>,
}

/// A sqlx pool's use, as [`PoolUse`].
pub(crate) fn pool_use<DB: sqlx::Database>(pool: &'static str, p: &sqlx::Pool<DB>) -> PoolUse {
    PoolUse {
        pool,
        open: p.size(),
        idle: u32::try_from(p.num_idle()).unwrap_or(u32::MAX),
        max: p.options().get_max_connections(),
    }
}

/// One connection pool's use: its query class, open connections (idle and in use) and
/// its maximum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolUse {
    /// The query class (`enqueue`, `relay`, `admin`; `sqlite` for the embedded engine).
    pub pool: &'static str,
    /// Connections open, in use or idle.
    pub open: u32,
    /// Of those, idle.
    pub idle: u32,
    /// The pool's maximum.
    pub max: u32,
}

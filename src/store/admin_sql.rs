//! What an engine supplies to the admin flows (`admin_flow.rs`): the statements, named
//! (`Stmt`), with engine-neutral parameters (`Param`), and the small trait through
//! which an engine gives each statement its SQL text, binds its parameters and runs it.

use chrono::{DateTime, Utc};

use super::StoreResult;
use super::rows::Cols;
use crate::domain::admin::PendingOrder;
use crate::domain::{BoxKind, EventId};

/// The admin statements. The parameters, in order, are the same on both engines
/// (`Param`), listed here. The SQL text of the `Shared` ones is written once, with the
/// engine's marks and casts (`Shape::shared`); each engine writes the others itself.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stmt {
    Shared(Shared),
    /// actor, action, box, selection, count, principal, request_id, now: `id`.
    InsertAudit,
    /// topic, key prefix, only blocked, after pending, after oldest (µs), after topic,
    /// after key, limit, subscription, after subscription, now: backlog groups
    /// `subscription, topic, key, pending, created_at, head_id, attempts, scheduled_at,
    /// last_error, blocked` with `total_keys, total_pending, total_blocked` on every row
    /// (one row of totals only, `topic` NULL, when there is no group).
    Pending(PendingOrder),
    /// id, with payload: the event columns with `payload_size, subscription, message_id`.
    Detail,
    /// subscription, now: one row `blocked, oldest, now` over the keyed heads.
    StatsHeads,
    /// topic, key, subscription, now: makes a released key ready; `leased` if a relay
    /// holds it (no row if there is no such key).
    WakeReleased,
}

/// The statements whose SQL reads the same on both engines but for marks, casts and
/// the clock.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Shared {
    /// action, box, request_id: the audit row `id, count, selection` of an action done.
    AuditOfRequest,
    /// ids: candidates `id, subscription, topic, event_key, status`, in id order.
    CandidatesById,
    /// the filter (15), limit: failed candidates matching it, in id order.
    FailedByFilter,
    /// the filter (15), limit: completed candidates matching it, in id order.
    CompletedByFilter,
    /// ids: as `Detail` with payloads, in id order.
    Copies,
    /// ids: `id, status, size` (bytes of payload, headers, topic and key), in id order.
    CopySizes,
    /// limit: `box, event_id, failed_at` of the dead letters, oldest failure first.
    DeadLetters,
    /// box, event id, failed at: deletes that dead letter.
    DropDeadLetter,
    /// box, subscription, minute, n: adds n to that minute's deliveries.
    AddRate,
    /// minute: deletes the rate rows before it.
    PruneRates,
    /// box, subscription, first minute: `minute, n` from it on.
    Rates,
    /// A job statement.
    Job(JobSql),
    /// A rewind statement.
    Rewind(RewindSql),
    /// ids, now: failed events back to pending, due now.
    Requeue,
    /// ids, reason, now: pending events to failed with `cancelled: <reason>`.
    Cancel,
    /// status, before id, the filter (15), limit: as `Detail`, newest first, no payload.
    Events,
    /// before id, limit: `id, at, actor, action, box, selection, count, principal,
    /// request_id`, newest first.
    Audit,
    /// subscription: `subscription, topic, status, n`.
    StatsCounts,
    /// subscription: one row `oldest` of the unkeyed backlog.
    StatsUnkeyed,
    /// topic, reason, actor, principal, now: the pause row inserted (none when the
    /// topic is already paused). The outbox's only, as are the next two.
    Pause,
    /// topic: the pause row deleted (none when the topic is not paused).
    Resume,
    /// topic (NULL for all): `topic, reason, actor, principal, paused_at`, by topic.
    Paused,
}

/// The job statements (`mailroom_jobs`, migration 0025); a job row comes back as the
/// columns `decode_job` reads.
#[derive(Debug, Clone, Copy)]
pub(crate) enum JobSql {
    /// status, the filter (15): one row `n`, the events of that status it selects.
    Count,
    /// the filter (15), limit: pending candidates matching it, in id order.
    PendingByFilter,
    /// one row `id`: the box's highest event id (0 when empty).
    MaxId,
    /// kind, box, selection, reason, total, through id, actor, principal, request id,
    /// now: the job inserted (no row when the request id started one already).
    Insert,
    /// kind, box, request id: the job that request id started.
    OfRequest,
    /// id: the job.
    One,
    /// before id, limit: jobs newest first.
    Page,
    /// id, by, now: a running job to cancelling.
    Cancel,
    /// owner, lease (ms), now: the oldest open job whose lease ran out, now leased to owner.
    Claim,
    /// id, owner, done, after id, lease (ms), now: a page recorded and the lease renewed,
    /// while owner holds it; `state, done, after_id`.
    Advance,
    /// id, owner, state, error, now: the job ended, while owner holds it.
    End,
    /// id, owner: the lease given up.
    Release,
}

/// The rewind statements (`inbox_rewinds`, `inbox_rewind_partitions`, migration 0026).
#[derive(Debug, Clone, Copy)]
pub(crate) enum RewindSql {
    /// subscription, time: one row `n`, the subscription's messages stored since then
    /// (at most 100,000 counted).
    StoredSince,
    /// subscription, request id: the rewind that request id asked for.
    OfRequest,
    /// subscription, to time, redeliver, actor, principal, request id, now: the rewind
    /// inserted (no row when the request id asked for one already).
    Insert,
    /// subscription (NULL: all), created since (NULL: ever), limit: rewinds newest first.
    List,
    /// rewind ids: their partitions.
    Partitions,
    /// rewind id, topic, partition, from offset, until offset: the partition's row,
    /// unless there is one.
    Intend,
    /// rewind id, topic, partition: the partition's row.
    Partition,
    /// rewind id, topic, partition, now: the partition's new position committed.
    Applied,
}

/// A statement's parameter, engine-neutral: each engine binds it in its own encoding.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Param<'a> {
    Int(Option<i64>),
    Text(Option<&'a str>),
    Flag(bool),
    Time(Option<DateTime<Utc>>),
    /// A time in microseconds since the epoch, as page tokens carry it.
    Micros(Option<i64>),
    Ids(&'a [EventId]),
    /// Headers to match, bound as a JSON object (NULL when empty).
    Headers(&'a std::collections::BTreeMap<String, String>),
    /// The statement's clock, always last: SQLite binds the transaction's (or the
    /// read's) time; PostgreSQL's statements read `now()` and bind nothing.
    Now,
}

/// A header match as its parameter: a JSON object, or NULL when there is nothing to match.
pub(crate) fn headers_param(h: &std::collections::BTreeMap<String, String>) -> Option<String> {
    (!h.is_empty()).then(|| serde_json::to_string(h).expect("a map of strings is JSON"))
}

/// One statement with its parameters.
pub(crate) struct Query<'a> {
    pub stmt: Stmt,
    pub params: Vec<Param<'a>>,
}

pub(crate) fn query(stmt: Stmt, params: Vec<Param<'_>>) -> Query<'_> {
    Query { stmt, params }
}

/// How a batch of reads runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Read {
    /// Each statement on its own.
    Plain,
    /// The backlog and stats: short statements with simple plans, in one transaction
    /// with JIT off on PostgreSQL (JIT would cost more than it saves).
    Planned,
}

/// One engine's side of the admin flows: the SQL text of each statement and how it binds
/// and runs one, nothing else. Rows come back undecoded (`Cols`); a write transaction is
/// the engine's own (`Tx`).
#[async_trait::async_trait]
pub(crate) trait AdminSql: Send + Sync {
    type Row: Cols + Send + Sync;
    type Tx: Send;

    /// The SQL text of `stmt` for box `b`.
    fn sql(&self, b: BoxKind, stmt: Stmt) -> String;

    /// A write transaction of the admin's query class.
    async fn begin(&self) -> StoreResult<Self::Tx>;
    async fn commit(&self, tx: Self::Tx) -> StoreResult<()>;
    async fn rollback(&self, tx: Self::Tx) -> StoreResult<()>;

    /// Runs one statement in the transaction; its rows.
    async fn rows_in(
        &self,
        tx: &mut Self::Tx,
        sql: &str,
        params: &[Param<'_>],
    ) -> StoreResult<Vec<Self::Row>>;

    /// Runs one statement in the transaction; the rows it changed.
    async fn execute_in(
        &self,
        tx: &mut Self::Tx,
        sql: &str,
        params: &[Param<'_>],
    ) -> StoreResult<u64>;

    /// Runs reads outside any write transaction; each one's rows.
    async fn read(
        &self,
        how: Read,
        batch: &[(String, &[Param<'_>])],
    ) -> StoreResult<Vec<Vec<Self::Row>>>;

    /// Locks (creating missing ones) the key rows `keys` — (subscription, topic, key),
    /// sorted — and makes them ready now; returns those a relay holds at this moment,
    /// as (subscription, topic, key).
    async fn wake_keys(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        keys: &[(&str, &str, &str)],
    ) -> StoreResult<Vec<(String, String, String)>>;
}

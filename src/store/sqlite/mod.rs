//! SQLite engine: the embedded default. One process owns the file; writes are serialized
//! by `BEGIN IMMEDIATE`, so the ordering invariant holds trivially. Same schema and
//! semantics as PostgreSQL; times are stored as microseconds since the Unix epoch.

//!
//! Files, as on PostgreSQL: this one the store, `sql.rs` the relay's statements per box,
//! `relay.rs` the relay's calls (claim, settle, renew), `write.rs` enqueue and receive,
//! `admin.rs` the operator statements, `retention.rs` the purges.

mod admin;
mod relay;
mod retention;
mod sql;
mod write;

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row};

use super::rows::{Cols, decode_event};
use super::schema;
use super::{
    Admission, Claim, ClaimLimits, HeldId, Renewal, SettleReport, Settlement, Store, StoreError,
    StoreResult,
};
use crate::domain::{BoxKind, EventId, InboundMessage, NewEvent, Queue, Status, StoredEvent};

/// The columns `decode_event` reads (headers are stored as JSON text).
static EVENT_COLUMNS: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| super::rows::event_columns("payload", "headers"));

/// "Idle": later than any real time.
const NEVER: i64 = i64::MAX;

/// The SQLite engine: a `Store` over one database file and one connection.
pub struct SqliteStore {
    pool: SqlitePool,
    outbox: sql::Sql,
    inbox: sql::Sql,
    /// The schema this binary knows, checked inside each relay transaction (`relay.rs`).
    known: i64,
}

pub(crate) fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

pub(crate) fn from_micros(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

fn dur_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn tables(b: BoxKind) -> (&'static str, &'static str) {
    match b {
        BoxKind::Outbox => ("outbox_events", "outbox_keys"),
        BoxKind::Inbox => ("inbox_events", "inbox_keys"),
    }
}

impl Cols for SqliteRow {
    fn text(&self, col: &str) -> StoreResult<String> {
        Ok(self.try_get(col)?)
    }
    fn opt_text(&self, col: &str) -> StoreResult<Option<String>> {
        Ok(self.try_get(col)?)
    }
    fn int(&self, col: &str) -> StoreResult<i64> {
        Ok(self.try_get(col)?)
    }
    fn count(&self, col: &str) -> StoreResult<u32> {
        let n: i64 = self.try_get(col)?;
        u32::try_from(n).map_err(|_| StoreError::other(format!("{col} = {n} is not a count")))
    }
    fn flag(&self, col: &str) -> StoreResult<bool> {
        Ok(self.try_get(col)?)
    }
    fn bytes(&self, col: &str) -> StoreResult<Vec<u8>> {
        Ok(self.try_get(col)?)
    }
    fn time(&self, col: &str) -> StoreResult<DateTime<Utc>> {
        Ok(from_micros(self.try_get(col)?))
    }
    fn opt_time(&self, col: &str) -> StoreResult<Option<DateTime<Utc>>> {
        Ok(self.try_get::<Option<i64>, _>(col)?.map(from_micros))
    }
}

impl SqliteStore {
    /// Opens (creating if missing) the database file in WAL mode with full fsync.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        let opts = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::other(format!("bad database url: {e}")))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // FULL: a commit is on disk before Enqueue answers.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(5));
        // One connection: SQLite has one writer anyway, and this avoids SQLITE_BUSY.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(opts)
            .await?;
        Ok(SqliteStore {
            pool,
            outbox: sql::Sql::new("outbox_events", "outbox_keys", false),
            inbox: sql::Sql::new("inbox_events", "inbox_keys", true),
            known: schema::highest(&sqlx::migrate!("migrations/sqlite")),
        })
    }

    fn sql(&self, b: BoxKind) -> &sql::Sql {
        match b {
            BoxKind::Outbox => &self.outbox,
            BoxKind::Inbox => &self.inbox,
        }
    }

    /// The store's pool (one connection).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    fn engine(&self) -> &'static str {
        "sqlite"
    }

    async fn migrate(&self) -> StoreResult<()> {
        schema::tolerant(sqlx::migrate!("migrations/sqlite"))
            .run(&self.pool)
            .await
            .map_err(|e| StoreError::other(format!("migration failed: {e}")))
    }

    fn known_schema(&self) -> i64 {
        self.known
    }

    async fn schema_state(&self) -> StoreResult<schema::SchemaState> {
        Ok(schema::read_state(
            &self.pool,
            schema::DATABASE_SCHEMA_SQL,
            schema::REQUIRED_SCHEMA_SQL,
        )
        .await?)
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn installation_id(&self) -> StoreResult<String> {
        Ok(
            sqlx::query_scalar("SELECT installation_id FROM mailroom_installation")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    async fn enqueue(&self, events: &[NewEvent], atomic: bool) -> StoreResult<Vec<Admission>> {
        self.insert_events(events, atomic).await
    }

    async fn receive(&self, sub: &str, msgs: &[InboundMessage]) -> StoreResult<Vec<Admission>> {
        self.insert_messages(sub, msgs).await
    }

    async fn held_ids(&self, subscription: &str, ids: &[String]) -> StoreResult<Vec<HeldId>> {
        let list = serde_json::to_string(ids).map_err(|e| StoreError::other(e.to_string()))?;
        let rows = sqlx::query(
            "SELECT message_id, id, created_at FROM inbox_events
             WHERE subscription = ?1 AND message_id IN (SELECT value FROM json_each(?2))",
        )
        .bind(subscription)
        .bind(list)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(HeldId {
                    message_id: r.try_get(0)?,
                    id: r.try_get(1)?,
                    created_at: from_micros(r.try_get(2)?),
                })
            })
            .collect()
    }

    async fn claim(&self, queue: &Queue, token: i64, limits: ClaimLimits) -> StoreResult<Claim> {
        self.claim_lines(queue, token, limits).await
    }

    async fn settle(&self, settlement: Settlement<'_>) -> StoreResult<SettleReport> {
        self.settle_once(settlement).await
    }

    async fn renew(&self, renewal: Renewal<'_>) -> StoreResult<usize> {
        self.renew_once(renewal).await
    }

    async fn get_event(&self, b: BoxKind, id: EventId) -> StoreResult<Option<StoredEvent>> {
        let (events, _) = tables(b);
        let cols = &*EVENT_COLUMNS;
        sqlx::query(AssertSqlSafe(format!(
            "SELECT {cols} FROM {events} WHERE id = ?1"
        )))
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .as_ref()
        .map(decode_event)
        .transpose()
    }

    async fn count_events(&self, b: BoxKind, status: Option<Status>) -> StoreResult<i64> {
        let (events, _) = tables(b);
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {events} WHERE ?1 IS NULL OR status = ?1"
        )))
        .bind(status.map(Status::as_str))
        .fetch_one(&self.pool)
        .await?;
        Ok(n)
    }

    fn pool_use(&self) -> Vec<super::PoolUse> {
        vec![super::pool_use("sqlite", &self.pool)]
    }
}

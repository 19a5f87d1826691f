//! SQLite engine: the embedded default. One process owns the file; writes are serialized
//! by `BEGIN IMMEDIATE`, so the ordering invariant holds trivially. Same schema and
//! semantics as PostgreSQL; times are stored as microseconds since the Unix epoch.

//!
//! Files: `relay.rs` claim, settle and renew, `admin.rs` the operator statements,
//! `retention.rs` the purges.

mod admin;
mod relay;
mod retention;

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row};

use super::admission::{Holder, admissions, batch_keys, headers_json, inbox_admissions};
use super::rows::{Cols, decode_event};
use super::{
    Admission, Claim, ClaimLimits, EventUpdate, KeyRelease, LineKey, SettleReport, Store,
    StoreError, StoreResult,
};
use crate::domain::{
    BoxKind, EventId, InboundMessage, NewEvent, Queue, Status, StoredEvent, idempotency_scope,
};

pub(super) const EVENT_COLUMNS: &str = "id, topic, event_key, payload, headers, event_type, \
     idempotency_key, status, attempts, max_attempts, scheduled_at, created_at, updated_at, \
     published_at, last_error";

/// "Idle": later than any real time.
pub(super) const NEVER: i64 = i64::MAX;

pub struct SqliteStore {
    pool: SqlitePool,
}

pub(crate) fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

pub(crate) fn from_micros(us: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

pub(super) fn dur_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

pub(super) fn tables(b: BoxKind) -> (&'static str, &'static str) {
    match b {
        BoxKind::Outbox => ("outbox_events", "outbox_keys"),
        BoxKind::Inbox => ("inbox_events", "inbox_keys"),
    }
}

/// `" AND <frag>"` for the inbox's subscription-scoped statements, empty for the outbox.
pub(super) fn scope(queue: &Queue, frag: &str) -> String {
    if queue.subscription().is_some() {
        format!(" AND {frag}")
    } else {
        String::new()
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
        Ok(self.try_get::<i64, _>(col)? as u32)
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
            .map_err(|e| StoreError::Other(format!("bad database url: {e}")))?
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
        Ok(SqliteStore { pool })
    }

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
        sqlx::migrate!("migrations/sqlite")
            .run(&self.pool)
            .await
            .map_err(|e| StoreError::Other(format!("migration failed: {e}")))
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
        let now = micros(Utc::now());
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        for ((topic, key), ready) in batch_keys(events) {
            sqlx::query(
                "INSERT INTO outbox_keys (topic, event_key, ready_at) VALUES (?1, ?2, ?3)
                 ON CONFLICT (topic, event_key) DO UPDATE SET ready_at = MIN(ready_at, excluded.ready_at)",
            )
            .bind(topic)
            .bind(key)
            .bind(ready.map(micros).unwrap_or(now))
            .execute(&mut *tx)
            .await?;
        }
        let mut plain = Vec::new();
        let mut by_key = HashMap::new();
        let mut missing = Vec::new();
        for e in events {
            let row = sqlx::query(
                "INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                     idempotency_key, content_hash, max_attempts, scheduled_at, created_at, updated_at,
                     content_fp, content_fp_version)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10, ?11,
                         CASE WHEN ?11 IS NULL THEN NULL ELSE 2 END)
                 ON CONFLICT (topic, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
                 RETURNING id",
            )
            .bind(&e.topic)
            .bind(&e.key)
            .bind(&e.payload)
            .bind(headers_json(&e.headers))
            .bind(&e.event_type)
            .bind(&e.idempotency_key)
            .bind(e.idempotency_key.as_ref().map(|_| e.fingerprint()))
            .bind(e.max_attempts as i64)
            .bind(e.deliver_after.map(micros).unwrap_or(now))
            .bind(now)
            .bind(e.idempotency_key.as_ref().map(|_| e.fingerprint128()))
            .fetch_optional(&mut *tx)
            .await?;
            match (row, &e.idempotency_key) {
                (Some(r), None) => plain.push(r.try_get::<i64, _>(0)?),
                (Some(r), Some(k)) => {
                    by_key
                        .entry(idempotency_scope(&e.topic, k))
                        .or_insert(r.try_get::<i64, _>(0)?);
                }
                (None, Some(k)) => missing.push((e.topic.clone(), k.clone())),
                (None, None) => {
                    return Err(StoreError::Other(
                        "insert without idempotency key returned no id".into(),
                    ));
                }
            }
        }
        let mut existing = HashMap::new();
        for (t, k) in missing {
            if let Some(r) = sqlx::query(
                "SELECT id, content_hash, content_fp FROM outbox_events
                 WHERE topic = ?1 AND idempotency_key = ?2",
            )
            .bind(&t)
            .bind(&k)
            .fetch_optional(&mut *tx)
            .await?
            {
                existing.insert(
                    idempotency_scope(&t, &k),
                    (
                        r.try_get::<i64, _>(0)?,
                        Holder::of(r.try_get(1)?, r.try_get(2)?),
                    ),
                );
            }
        }
        let result = admissions(events, plain, &by_key, &existing);
        if atomic && result.contains(&Admission::Conflict) {
            tx.rollback().await?;
        } else {
            tx.commit().await?;
        }
        Ok(result)
    }

    async fn receive(
        &self,
        subscription: &str,
        messages: &[InboundMessage],
    ) -> StoreResult<Vec<Admission>> {
        let now = micros(Utc::now());
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let keys: std::collections::BTreeSet<(&str, &str)> = messages
            .iter()
            .filter(|m| m.failure.is_none())
            .filter_map(|m| m.key.as_deref().map(|k| (m.topic.as_str(), k)))
            .collect();
        for (topic, key) in keys {
            sqlx::query(
                "INSERT INTO inbox_keys (subscription, topic, event_key, ready_at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (subscription, topic, event_key) DO UPDATE SET ready_at = MIN(ready_at, excluded.ready_at)",
            )
            .bind(subscription)
            .bind(topic)
            .bind(key)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        let mut inserted = HashMap::new();
        let mut existing = HashMap::new();
        for m in messages {
            let row = sqlx::query(
                "INSERT INTO inbox_events (subscription, message_id, idempotency_key, topic, event_key,
                     payload, headers, event_type, max_attempts, scheduled_at, created_at, updated_at,
                     status, last_error)
                 VALUES (?1, ?2, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?9, ?9,
                     CASE WHEN ?10 IS NULL THEN 'pending' ELSE 'failed' END, ?10)
                 ON CONFLICT (subscription, message_id) DO NOTHING
                 RETURNING id",
            )
            .bind(subscription)
            .bind(&m.message_id)
            .bind(&m.topic)
            .bind(&m.key)
            .bind(&m.payload)
            .bind(headers_json(&m.headers))
            .bind(&m.event_type)
            .bind(m.max_attempts as i64)
            .bind(now)
            .bind(&m.failure)
            .fetch_optional(&mut *tx)
            .await?;
            match row {
                Some(r) => {
                    inserted.insert(m.message_id.clone(), r.try_get::<i64, _>(0)?);
                }
                None => {
                    let id: i64 = sqlx::query_scalar(
                        "SELECT id FROM inbox_events WHERE subscription = ?1 AND message_id = ?2",
                    )
                    .bind(subscription)
                    .bind(&m.message_id)
                    .fetch_one(&mut *tx)
                    .await?;
                    existing.entry(m.message_id.clone()).or_insert(id);
                }
            }
        }
        tx.commit().await?;
        Ok(inbox_admissions(messages, &inserted, &existing))
    }

    async fn claim(&self, queue: &Queue, token: i64, limits: ClaimLimits) -> StoreResult<Claim> {
        self.claim_lines(queue, token, limits).await
    }

    async fn settle(
        &self,
        queue: &Queue,
        token: i64,
        updates: &[EventUpdate],
        releases: &[KeyRelease],
    ) -> StoreResult<SettleReport> {
        self.settle_lines(queue, token, updates, releases).await
    }

    async fn renew(
        &self,
        queue: &Queue,
        token: i64,
        lines: &[LineKey],
        unkeyed: &[EventId],
        lease: Duration,
    ) -> StoreResult<usize> {
        self.renew_leases(queue, token, lines, unkeyed, lease).await
    }

    async fn get_event(&self, b: BoxKind, id: EventId) -> StoreResult<Option<StoredEvent>> {
        let (events, _) = tables(b);
        sqlx::query(AssertSqlSafe(format!(
            "SELECT {EVENT_COLUMNS} FROM {events} WHERE id = ?1"
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
}

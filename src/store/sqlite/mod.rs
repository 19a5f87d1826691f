//! SQLite engine: the embedded default. One process owns the file; writes are serialized
//! by `BEGIN IMMEDIATE`, so the ordering invariant holds trivially. Same schema and
//! semantics as PostgreSQL; times are stored as microseconds since the Unix epoch.

//!
//! Files: this one the store and the relay's calls (claim, settle, renew), `write.rs`
//! enqueue and receive, `admin.rs` the operator statements, `retention.rs` the purges.

mod admin;
mod retention;
mod write;

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Row};

use super::rows::{Cols, decode_event, in_due_order};
use super::schema;
use super::{
    Admission, Claim, ClaimLimits, Due, HeldId, KeyWindow, LineKey, Renewal, SettleReport,
    Settlement, Store, StoreError, StoreResult, fit_in_budget,
};
use crate::domain::{BoxKind, EventId, InboundMessage, NewEvent, Queue, Status, StoredEvent};

const EVENT_COLUMNS: &str = "id, topic, event_key, payload, headers, event_type, \
     idempotency_key, status, attempts, max_attempts, scheduled_at, created_at, updated_at, \
     published_at, last_error";

/// "Idle": later than any real time.
const NEVER: i64 = i64::MAX;

/// The SQLite engine: a `Store` over one database file and one connection.
pub struct SqliteStore {
    pool: SqlitePool,
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

/// `" AND <frag>"` for the inbox's subscription-scoped statements, empty for the outbox.
fn scope(queue: &Queue, frag: &str) -> String {
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
        let n: i64 = self.try_get(col)?;
        u32::try_from(n).map_err(|_| StoreError::Other(format!("{col} = {n} is not a count")))
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
            .map_err(|e| StoreError::Other(format!("migration failed: {e}")))
    }

    fn known_schema(&self) -> i64 {
        schema::highest(&sqlx::migrate!("migrations/sqlite"))
    }

    async fn schema_state(&self) -> StoreResult<schema::SchemaState> {
        let database: i64 = sqlx::query_scalar(schema::DATABASE_SCHEMA_SQL)
            .fetch_one(&self.pool)
            .await?;
        let required: i64 = if database < schema::COMPAT_SINCE {
            0
        } else {
            sqlx::query_scalar(schema::REQUIRED_SCHEMA_SQL)
                .fetch_one(&self.pool)
                .await?
        };
        Ok(schema::SchemaState { database, required })
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
        let list = serde_json::to_string(ids).map_err(|e| StoreError::Other(e.to_string()))?;
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
        let (events, keys) = tables(queue.box_kind());
        let sub = queue.subscription();
        let lease_scope = scope(queue, "subscription = ?5");
        let window_scope = scope(queue, "subscription = ?4");
        let now_t = Utc::now();
        let now = micros(now_t);
        let until = now.saturating_add(dur_micros(limits.lease));
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let leased = sqlx::query(AssertSqlSafe(format!(
            // As many keys as the cycle's events fill, each at its depth (as on
            // PostgreSQL, `lease_keys`). One pass: the transaction holds the database,
            // so there are no locked candidates to skip.
            "UPDATE {keys} SET lease_token = ?1, lease_until = ?2, ready_at = ?2
             WHERE rowid IN (
                SELECT rowid FROM (
                    SELECT rowid, sum(w) OVER (ORDER BY ready_at ROWS UNBOUNDED PRECEDING) - w AS before
                    FROM (SELECT rowid, ready_at, min(max(pending, 1), ?6) AS w FROM {keys}
                          WHERE ready_at <= ?3 AND (lease_until IS NULL OR lease_until <= ?3){lease_scope}
                          ORDER BY ready_at LIMIT ?4))
                WHERE before < ?7)
             RETURNING topic, event_key"
        )))
        .bind(token)
        .bind(until)
        .bind(now)
        .bind(limits.max_keys as i64)
        .bind(sub)
        .bind(limits.max_run.max(1) as i64)
        .bind(limits.max_events as i64)
        .fetch_all(&mut *tx)
        .await?;
        // Per leased key, with PostgreSQL's rules: the in-line ids and sizes (never-tried
        // delayed events skipped), the earliest delayed schedule before the window's end,
        // the highest pending id; then the byte budget, then the events themselves.
        // (PostgreSQL does it in one statement; here each is a cheap in-process query.)
        let line = format!("status = 'pending' AND topic = ?1 AND event_key = ?2{window_scope}");
        let delayed = "attempts = 0 AND last_error IS NULL AND scheduled_at > ?3";
        let heads_sql = format!(
            "SELECT id, length(payload) + length(headers) AS size FROM {events}
             WHERE {line} AND NOT ({delayed}) ORDER BY id LIMIT ?5"
        );
        let marks_sql = format!(
            "SELECT (SELECT min(scheduled_at) FROM {events}
                     WHERE {line} AND {delayed} AND id < ?5) AS delayed_at,
                    (SELECT max(id) FROM {events} WHERE {line}) AS line_end"
        );
        let rows_sql = format!(
            "SELECT {EVENT_COLUMNS} FROM {events}
             WHERE {line} AND NOT ({delayed}) AND id >= ?5 AND id <= ?6 ORDER BY id"
        );
        let mut keyed = Vec::with_capacity(leased.len());
        let mut in_line: Vec<Vec<(EventId, u64)>> = Vec::with_capacity(leased.len());
        let per_key = limits.per_key(leased.len());
        for r in &leased {
            let line = LineKey {
                topic: r.try_get(0)?,
                key: r.try_get(1)?,
            };
            let heads: Vec<(EventId, u64)> = sqlx::query(AssertSqlSafe(heads_sql.as_str()))
                .bind(&line.topic)
                .bind(&line.key)
                .bind(now)
                .bind(sub)
                .bind(per_key as i64)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get::<i64, _>(1)?.max(0) as u64)))
                .collect::<StoreResult<_>>()?;
            let boundary = if heads.len() >= per_key as usize {
                heads.last().map_or(i64::MAX, |h| h.0)
            } else {
                i64::MAX
            };
            let marks = sqlx::query(AssertSqlSafe(marks_sql.as_str()))
                .bind(&line.topic)
                .bind(&line.key)
                .bind(now)
                .bind(sub)
                .bind(boundary)
                .fetch_one(&mut *tx)
                .await?;
            keyed.push(KeyWindow {
                line,
                rows: Vec::new(),
                full: heads.len() >= per_key as usize,
                delayed_at: marks
                    .try_get::<Option<i64>, _>("delayed_at")?
                    .map(from_micros),
                line_end: marks.try_get("line_end")?,
            });
            in_line.push(heads);
        }
        // The byte budget, shared in claim order: keys past it get an empty window
        // marked full (looked at again at once).
        let mut take = fit_in_budget(
            in_line.iter().flatten().map(|&(_, size)| size),
            limits.max_bytes,
        );
        for (w, heads) in keyed.iter_mut().zip(&in_line) {
            let n = take.min(heads.len());
            take -= n;
            if n < heads.len() {
                w.full = true;
            }
            if n == 0 {
                continue;
            }
            w.rows = sqlx::query(AssertSqlSafe(rows_sql.as_str()))
                .bind(&w.line.topic)
                .bind(&w.line.key)
                .bind(now)
                .bind(sub)
                .bind(heads[0].0)
                .bind(heads[n - 1].0)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(decode_event)
                .collect::<StoreResult<Vec<_>>>()?;
        }
        let unkeyed = if limits.max_unkeyed > 0 {
            let rows = sqlx::query(AssertSqlSafe(format!(
                "UPDATE {events} SET claim_token = ?1, claimed_until = ?2
                 WHERE id IN (
                    SELECT id FROM (
                        SELECT id,
                               sum(size) OVER (ORDER BY scheduled_at, id) AS total,
                               row_number() OVER (ORDER BY scheduled_at, id) AS n
                        FROM (SELECT id, scheduled_at, length(payload) + length(headers) AS size
                              FROM {events}
                              WHERE status = 'pending' AND event_key IS NULL AND scheduled_at <= ?3
                                AND (claimed_until IS NULL OR claimed_until <= ?3){lease_scope}
                              ORDER BY scheduled_at, id LIMIT ?4))
                    WHERE n = 1 OR total <= ?6)
                 RETURNING {EVENT_COLUMNS}"
            )))
            .bind(token)
            .bind(until)
            .bind(now)
            .bind(limits.max_unkeyed as i64)
            .bind(sub)
            .bind(i64::try_from(limits.max_bytes).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await?;
            in_due_order(&rows)?
        } else {
            Vec::new()
        };
        tx.commit().await?;
        Ok(Claim {
            token,
            now: now_t,
            keyed,
            unkeyed,
        })
    }

    async fn settle(&self, s: Settlement<'_>) -> StoreResult<SettleReport> {
        let (queue, token, updates, releases) = (s.queue, s.token, s.updates, s.releases);
        let (events, keys) = tables(queue.box_kind());
        let sub = queue.subscription();
        let settle_scope = scope(queue, &format!("k.subscription = {events}.subscription"));
        let release_scope = scope(queue, "subscription = ?7");
        let release_exists = scope(queue, "e.subscription = ?7");
        let now = micros(Utc::now());
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let update_sql = format!(
            "UPDATE {events} SET status = ?2, attempts = COALESCE(?3, attempts),
                scheduled_at = COALESCE(?4, scheduled_at), last_error = COALESCE(?5, last_error),
                published_at = CASE WHEN ?2 = 'completed' THEN ?6 ELSE published_at END,
                updated_at = CASE WHEN ?7 THEN updated_at ELSE ?6 END,
                claim_token = NULL, claimed_until = NULL
             WHERE id = ?1 AND status = 'pending'
               AND ((event_key IS NULL AND claim_token = ?8)
                    OR (event_key IS NOT NULL AND EXISTS (
                        SELECT 1 FROM {keys} k WHERE k.topic = {events}.topic
                          AND k.event_key = {events}.event_key AND k.lease_token = ?8{settle_scope})))"
        );
        let mut applied = 0;
        for u in updates {
            let c = u.columns();
            let sched = c.due.map(|due| match due {
                Due::After(delay) => now.saturating_add(dur_micros(delay)),
                Due::At(at) => micros(at),
            });
            let (status, attempts, error) = (c.status.as_str(), c.attempts.map(i64::from), c.error);
            // `as usize` fits: the update names one event by id, so 0 or 1 rows.
            #[allow(clippy::cast_possible_truncation)]
            let changed = sqlx::query(AssertSqlSafe(update_sql.as_str()))
                .bind(u.id())
                .bind(status)
                .bind(attempts)
                .bind(sched)
                .bind(error)
                .bind(now)
                .bind(c.release)
                .bind(token)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
            applied += changed;
        }
        let release_sql = format!(
            "UPDATE {keys} SET lease_token = NULL, lease_until = NULL,
                ready_at = MIN(?4,
                    -- An enqueue during the lease pulled ready_at below lease_until.
                    CASE WHEN ready_at < lease_until THEN ready_at ELSE ?4 END,
                    CASE WHEN ?5 IS NOT NULL AND EXISTS (
                    SELECT 1 FROM {events} e WHERE e.status = 'pending' AND e.topic = ?1
                      AND e.event_key = ?2{release_exists} AND e.id > ?5) THEN ?6 ELSE ?4 END)
             WHERE topic = ?1 AND event_key = ?2 AND lease_token = ?3{release_scope}"
        );
        for r in releases {
            let at = r.ready.at.map(micros).unwrap_or(NEVER);
            let after = r
                .ready
                .after
                .map(|d| now.saturating_add(dur_micros(d)))
                .unwrap_or(NEVER);
            sqlx::query(AssertSqlSafe(release_sql.as_str()))
                .bind(&r.line.topic)
                .bind(&r.line.key)
                .bind(token)
                .bind(at.min(after))
                .bind(r.ready.seen_up_to)
                .bind(now)
                .bind(sub)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(SettleReport::of(applied, updates.len()))
    }

    async fn renew(&self, r: Renewal<'_>) -> StoreResult<usize> {
        let (queue, token, lines, unkeyed, lease) = (r.queue, r.token, r.lines, r.unkeyed, r.lease);
        let (events, keys) = tables(queue.box_kind());
        let sub = queue.subscription();
        let key_scope = scope(queue, "subscription = ?5");
        let event_scope = scope(queue, "subscription = ?4");
        let now = micros(Utc::now());
        let until = now.saturating_add(dur_micros(lease));
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut held = 0;
        let key_sql = format!(
            "UPDATE {keys} SET lease_until = ?4,
                ready_at = CASE WHEN ready_at >= lease_until THEN ?4 ELSE ready_at END
             WHERE topic = ?1 AND event_key = ?2 AND lease_token = ?3{key_scope}"
        );
        for l in lines {
            // `as usize` fits: one key row at most.
            #[allow(clippy::cast_possible_truncation)]
            let changed = sqlx::query(AssertSqlSafe(key_sql.as_str()))
                .bind(&l.topic)
                .bind(&l.key)
                .bind(token)
                .bind(until)
                .bind(sub)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
            held += changed;
        }
        let event_sql = format!(
            "UPDATE {events} SET claimed_until = ?3
             WHERE id = ?1 AND claim_token = ?2 AND status = 'pending'{event_scope}"
        );
        for id in unkeyed {
            // `as usize` fits: one event by id, so 0 or 1 rows.
            #[allow(clippy::cast_possible_truncation)]
            let changed = sqlx::query(AssertSqlSafe(event_sql.as_str()))
                .bind(id)
                .bind(token)
                .bind(until)
                .bind(sub)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
            held += changed;
        }
        tx.commit().await?;
        Ok(held)
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

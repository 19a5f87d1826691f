//! The relay's calls (as on PostgreSQL, `store/postgres/relay.rs`): claim (lease ready
//! keys, read their lines within the budgets, claim due unkeyed events), settle and
//! renew. Each runs in one `BEGIN IMMEDIATE` transaction.

use chrono::Utc;
use sqlx::sqlite::Sqlite;
use sqlx::{AssertSqlSafe, Row, Transaction};

use super::sql::Sql;
use super::{NEVER, SqliteStore, dur_micros, from_micros, micros};
use crate::domain::{EventId, Queue, StoredEvent};
use crate::store::rows::{decode_event, in_due_order};
use crate::store::{
    Claim, ClaimLimits, Due, KeyWindow, LineKey, Renewal, SettleReport, Settlement, StoreResult,
    fit_in_budget,
};

/// One claim's fixed inputs, shared by its phases.
struct ClaimScope<'a> {
    sql: &'a Sql,
    sub: Option<&'a str>,
    token: i64,
    now: i64,
    until: i64,
    limits: ClaimLimits,
}

/// A leased line's window before the byte budget: its in-line ids and sizes.
struct Heads {
    window: KeyWindow,
    heads: Vec<(EventId, u64)>,
}

impl SqliteStore {
    /// Leases ready keys, reads their windows, claims due unkeyed events: one transaction.
    pub(super) async fn claim_lines(
        &self,
        queue: &Queue,
        token: i64,
        limits: ClaimLimits,
    ) -> StoreResult<Claim> {
        let now_t = Utc::now();
        let now = micros(now_t);
        let c = ClaimScope {
            sql: self.sql(queue.box_kind()),
            sub: queue.subscription(),
            token,
            now,
            until: now.saturating_add(dur_micros(limits.lease)),
            limits,
        };
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        if self.refused(&mut tx).await?.is_some() {
            return Ok(Claim {
                token,
                now: now_t,
                keyed: Vec::new(),
                unkeyed: Vec::new(),
            });
        }
        let leased = lease_keys(&mut tx, &c).await?;
        // Per leased key, with PostgreSQL's rules: the in-line ids and sizes, the
        // earliest delayed schedule before the window's end, the highest pending id;
        // then the byte budget, then the events themselves. (PostgreSQL does it in one
        // statement; here each is a cheap in-process query.)
        let per_key = limits.per_key(leased.len());
        let mut lines = Vec::with_capacity(leased.len());
        for line in leased {
            lines.push(read_heads(&mut tx, &c, line, per_key).await?);
        }
        let keyed = read_within_budget(&mut tx, &c, lines).await?;
        let unkeyed = claim_unkeyed(&mut tx, &c).await?;
        tx.commit().await?;
        Ok(Claim {
            token,
            now: now_t,
            keyed,
            unkeyed,
        })
    }

    /// Applies the relay's decisions and releases the claim's keys: one transaction.
    pub(super) async fn settle_once(&self, s: Settlement<'_>) -> StoreResult<SettleReport> {
        let sql = self.sql(s.queue.box_kind());
        let sub = s.queue.subscription();
        let now = micros(Utc::now());
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        if let Some(refusal) = self.refused(&mut tx).await? {
            return Err(refusal);
        }
        let mut applied = 0;
        for u in s.updates {
            let c = u.columns();
            let sched = c.due.map(|due| match due {
                Due::After(delay) => now.saturating_add(dur_micros(delay)),
                Due::At(at) => micros(at),
            });
            let (status, attempts, error) = (c.status.as_str(), c.attempts.map(i64::from), c.error);
            // `as usize` fits: the update names one event by id, so 0 or 1 rows.
            #[allow(clippy::cast_possible_truncation)]
            let changed = sqlx::query(AssertSqlSafe(sql.settle_event.as_str()))
                .bind(u.id())
                .bind(status)
                .bind(attempts)
                .bind(sched)
                .bind(error)
                .bind(now)
                .bind(c.release)
                .bind(s.token)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
            applied += changed;
        }
        for r in s.releases {
            if let Some(lease) = r.keep {
                // Kept leased (the relay goes on with the line): a renewal.
                sqlx::query(AssertSqlSafe(sql.renew_key.as_str()))
                    .bind(&r.line.topic)
                    .bind(&r.line.key)
                    .bind(s.token)
                    .bind(now.saturating_add(dur_micros(lease)))
                    .bind(sub)
                    .execute(&mut *tx)
                    .await?;
                continue;
            }
            let at = r.ready.at.map(micros).unwrap_or(NEVER);
            let after = r
                .ready
                .after
                .map(|d| now.saturating_add(dur_micros(d)))
                .unwrap_or(NEVER);
            sqlx::query(AssertSqlSafe(sql.release_key.as_str()))
                .bind(&r.line.topic)
                .bind(&r.line.key)
                .bind(s.token)
                .bind(at.min(after))
                .bind(r.ready.seen_up_to)
                .bind(now)
                .bind(sub)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(SettleReport::of(applied, s.updates.len()))
    }

    /// Extends the leases a claim still holds: one transaction.
    pub(super) async fn renew_once(&self, r: Renewal<'_>) -> StoreResult<usize> {
        let sql = self.sql(r.queue.box_kind());
        let sub = r.queue.subscription();
        let until = micros(Utc::now()).saturating_add(dur_micros(r.lease));
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        if self.refused(&mut tx).await?.is_some() {
            return Ok(0);
        }
        let mut held = 0;
        for l in r.lines {
            // `as usize` fits: one key row at most.
            #[allow(clippy::cast_possible_truncation)]
            let changed = sqlx::query(AssertSqlSafe(sql.renew_key.as_str()))
                .bind(&l.topic)
                .bind(&l.key)
                .bind(r.token)
                .bind(until)
                .bind(sub)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
            held += changed;
        }
        for id in r.unkeyed {
            // `as usize` fits: one event by id, so 0 or 1 rows.
            #[allow(clippy::cast_possible_truncation)]
            let changed = sqlx::query(AssertSqlSafe(sql.renew_event.as_str()))
                .bind(id)
                .bind(r.token)
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
}

impl SqliteStore {
    /// The schema gate inside the relay's transactions (issue 42, item 2), as on
    /// PostgreSQL: the refusal when an applied migration requires a binary that knows
    /// more than this one. Read first: `BEGIN IMMEDIATE` holds the database's write lock,
    /// so no migration can raise the requirement before the transaction ends. A
    /// requirement that cannot be read fails the call (the gate fails closed).
    async fn refused(
        &self,
        tx: &mut Transaction<'_, Sqlite>,
    ) -> StoreResult<Option<crate::store::StoreError>> {
        let required: i64 = sqlx::query_scalar(crate::store::schema::REQUIRED_SCHEMA_SQL)
            .fetch_one(&mut **tx)
            .await?;
        let binary = self.known;
        Ok((required > binary)
            .then_some(crate::store::StoreError::SchemaRefused { binary, required }))
    }
}

/// Leases as many ready keys as the cycle's events fill, each at its depth.
async fn lease_keys(
    tx: &mut Transaction<'_, Sqlite>,
    c: &ClaimScope<'_>,
) -> StoreResult<Vec<LineKey>> {
    sqlx::query(AssertSqlSafe(c.sql.lease_keys.as_str()))
        .bind(c.token)
        .bind(c.until)
        .bind(c.now)
        .bind(c.limits.max_keys as i64)
        .bind(c.sub)
        .bind(c.limits.max_run.max(1) as i64)
        .bind(c.limits.max_events as i64)
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|r| {
            Ok(LineKey {
                topic: r.try_get(0)?,
                key: r.try_get(1)?,
            })
        })
        .collect()
}

/// One leased line's in-line ids and sizes (at most `per_key`) and its window's marks:
/// the earliest delayed schedule before the window's end, the highest pending id.
async fn read_heads(
    tx: &mut Transaction<'_, Sqlite>,
    c: &ClaimScope<'_>,
    line: LineKey,
    per_key: u32,
) -> StoreResult<Heads> {
    let heads: Vec<(EventId, u64)> = sqlx::query(AssertSqlSafe(c.sql.heads.as_str()))
        .bind(&line.topic)
        .bind(&line.key)
        .bind(c.now)
        .bind(c.sub)
        .bind(i64::from(per_key))
        .fetch_all(&mut **tx)
        .await?
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get::<i64, _>(1)?.max(0) as u64)))
        .collect::<StoreResult<_>>()?;
    let full = heads.len() >= per_key as usize;
    let boundary = if full {
        heads.last().map_or(i64::MAX, |h| h.0)
    } else {
        i64::MAX
    };
    let marks = sqlx::query(AssertSqlSafe(c.sql.marks.as_str()))
        .bind(&line.topic)
        .bind(&line.key)
        .bind(c.now)
        .bind(c.sub)
        .bind(boundary)
        .fetch_one(&mut **tx)
        .await?;
    let window = KeyWindow {
        line,
        rows: Vec::new(),
        full,
        delayed_at: marks
            .try_get::<Option<i64>, _>("delayed_at")?
            .map(from_micros),
        line_end: marks.try_get("line_end")?,
    };
    Ok(Heads { window, heads })
}

/// The byte budget, shared in claim order: each window reads the events that fit;
/// windows past the budget stay empty, marked full (looked at again at once).
async fn read_within_budget(
    tx: &mut Transaction<'_, Sqlite>,
    c: &ClaimScope<'_>,
    lines: Vec<Heads>,
) -> StoreResult<Vec<KeyWindow>> {
    let mut take = fit_in_budget(
        lines.iter().flat_map(|l| &l.heads).map(|&(_, size)| size),
        c.limits.max_bytes,
    );
    let mut keyed = Vec::with_capacity(lines.len());
    for Heads { mut window, heads } in lines {
        let n = take.min(heads.len());
        take -= n;
        if n < heads.len() {
            window.full = true;
        }
        if n > 0 {
            window.rows = sqlx::query(AssertSqlSafe(c.sql.rows.as_str()))
                .bind(&window.line.topic)
                .bind(&window.line.key)
                .bind(c.now)
                .bind(c.sub)
                .bind(heads[0].0)
                .bind(heads[n - 1].0)
                .fetch_all(&mut **tx)
                .await?
                .iter()
                .map(decode_event)
                .collect::<StoreResult<Vec<_>>>()?;
        }
        keyed.push(window);
    }
    Ok(keyed)
}

/// Claims due unkeyed events within the byte budget, in the order they are due.
async fn claim_unkeyed(
    tx: &mut Transaction<'_, Sqlite>,
    c: &ClaimScope<'_>,
) -> StoreResult<Vec<StoredEvent>> {
    if c.limits.max_unkeyed == 0 {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(AssertSqlSafe(c.sql.claim_unkeyed.as_str()))
        .bind(c.token)
        .bind(c.until)
        .bind(c.now)
        .bind(c.limits.max_unkeyed as i64)
        .bind(c.sub)
        .bind(i64::try_from(c.limits.max_bytes).unwrap_or(i64::MAX))
        .fetch_all(&mut **tx)
        .await?;
    in_due_order(&rows)
}

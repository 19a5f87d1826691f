//! The relay's calls on SQLite: claim, settle and renew, each in one `BEGIN IMMEDIATE`
//! transaction (one writer, so no lock order to keep).

use std::time::Duration;

use chrono::Utc;
use sqlx::{AssertSqlSafe, Row};

use super::{
    EVENT_COLUMNS, NEVER, SqliteStore, decode_event, dur_micros, from_micros, micros, scope, tables,
};
use crate::domain::{EventId, Queue};
use crate::store::{
    Claim, ClaimLimits, EventUpdate, KeyRelease, KeyWindow, LineKey, SettleReport, StoreResult,
    fit_in_budget,
};

impl SqliteStore {
    pub(super) async fn claim_lines(
        &self,
        queue: &Queue,
        token: i64,
        limits: ClaimLimits,
    ) -> StoreResult<Claim> {
        let (events, keys) = tables(queue.box_kind());
        let sub = queue.subscription();
        let lease_scope = scope(queue, "subscription = ?5");
        let window_scope = scope(queue, "subscription = ?4");
        let now_t = Utc::now();
        let now = micros(now_t);
        let until = now.saturating_add(dur_micros(limits.lease));
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let leased = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {keys} SET lease_token = ?1, lease_until = ?2, ready_at = ?2
             WHERE rowid IN (
                SELECT rowid FROM {keys}
                WHERE ready_at <= ?3 AND (lease_until IS NULL OR lease_until <= ?3){lease_scope}
                ORDER BY ready_at LIMIT ?4)
             RETURNING topic, event_key"
        )))
        .bind(token)
        .bind(until)
        .bind(now)
        .bind(limits.max_keys as i64)
        .bind(sub)
        .fetch_all(&mut *tx)
        .await?;
        // Per leased key, as on PostgreSQL: the in-line ids and sizes (never-tried delayed
        // events skipped), the earliest delayed schedule before the window's end, the
        // highest pending id; then the byte budget, then the events themselves.
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
            let mut v = sqlx::query(AssertSqlSafe(format!(
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
            .await?
            .iter()
            .map(decode_event)
            .collect::<StoreResult<Vec<_>>>()?;
            v.sort_by_key(|e| (e.scheduled_at, e.id));
            v
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

    pub(super) async fn settle_lines(
        &self,
        queue: &Queue,
        token: i64,
        updates: &[EventUpdate],
        releases: &[KeyRelease],
    ) -> StoreResult<SettleReport> {
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
            let (status, attempts, sched, error): (&str, Option<i64>, Option<i64>, Option<&str>) =
                match u {
                    EventUpdate::Completed { .. } => ("completed", None, None, None),
                    EventUpdate::CompletedAfterGap { note, .. } => {
                        ("completed", None, None, Some(note))
                    }
                    EventUpdate::Retry {
                        attempts,
                        delay,
                        error,
                        ..
                    } => (
                        "pending",
                        Some(*attempts as i64),
                        Some(now.saturating_add(dur_micros(*delay))),
                        Some(error),
                    ),
                    EventUpdate::RetryAt {
                        attempts,
                        at,
                        error,
                        ..
                    } => (
                        "pending",
                        Some(*attempts as i64),
                        Some(micros(*at)),
                        Some(error),
                    ),
                    EventUpdate::Failed {
                        attempts, error, ..
                    } => ("failed", Some(*attempts as i64), None, Some(error)),
                    EventUpdate::Release { .. } => ("pending", None, None, None),
                };
            applied += sqlx::query(AssertSqlSafe(update_sql.as_str()))
                .bind(u.id())
                .bind(status)
                .bind(attempts)
                .bind(sched)
                .bind(error)
                .bind(now)
                .bind(matches!(u, EventUpdate::Release { .. }))
                .bind(token)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
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
        Ok(SettleReport {
            applied,
            stale: updates.len() - applied,
        })
    }

    pub(super) async fn renew_leases(
        &self,
        queue: &Queue,
        token: i64,
        lines: &[LineKey],
        unkeyed: &[EventId],
        lease: Duration,
    ) -> StoreResult<usize> {
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
            held += sqlx::query(AssertSqlSafe(key_sql.as_str()))
                .bind(&l.topic)
                .bind(&l.key)
                .bind(token)
                .bind(until)
                .bind(sub)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
        }
        let event_sql = format!(
            "UPDATE {events} SET claimed_until = ?3
             WHERE id = ?1 AND claim_token = ?2 AND status = 'pending'{event_scope}"
        );
        for id in unkeyed {
            held += sqlx::query(AssertSqlSafe(event_sql.as_str()))
                .bind(id)
                .bind(token)
                .bind(until)
                .bind(sub)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
        }
        tx.commit().await?;
        Ok(held)
    }
}

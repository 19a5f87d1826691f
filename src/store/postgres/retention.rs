//! Retention on PostgreSQL: `DELETE … WHERE id IN (SELECT id … ORDER BY published_at
//! LIMIT n FOR UPDATE SKIP LOCKED)` over the partial index `outbox_events_completed
//! (published_at) WHERE status = 'completed'` (migration 0004); two processes running
//! retention at once skip each other's rows. Failed events use `outbox_events_failed
//! (updated_at)`.
//!
//! Events published by a key's cursor (migration 0011) have no row of their own to age:
//! their advance's log row in `outbox_publishes` carries the time, so retention takes
//! the oldest log rows (their event counts within the batch) and deletes the events up
//! to each, then the log rows. A key row is pruned only once no row of its line is left,
//! since its cursor is what says those rows were published.

use std::time::Duration;

use sqlx::AssertSqlSafe;

use super::PgStore;
use crate::store::StoreResult;
use crate::store::retention::{Finished, RetentionStore};

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl PgStore {
    /// Deletes up to `limit` rows of `events` (a table name constant) whose status is
    /// `finished` and older than `older_than`, oldest first, skipping rows a relay holds.
    async fn delete_finished(
        &self,
        events: &str,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64> {
        // Both names are constants of `Finished`, never caller text.
        let (status, time_column) = (finished.status(), finished.since_column());
        let r = sqlx::query(AssertSqlSafe(self.built(&format!(
            "DELETE FROM {events} WHERE id IN (
                 SELECT id FROM {events}
                 WHERE status = '{status}'
                   AND {time_column} < now() - make_interval(secs => $1)
                 ORDER BY {time_column}
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED)
             AND status = '{status}'"
        ))))
        .bind(secs(older_than))
        .bind(i64::from(limit))
        .execute(self.relay_pool())
        .await?;
        Ok(r.rows_affected())
    }
}

#[async_trait::async_trait]
impl RetentionStore for PgStore {
    async fn purge(
        &self,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64> {
        let explicit = self
            .delete_finished("outbox_events", finished, older_than, limit)
            .await?;
        if finished != Finished::Completed || explicit >= u64::from(limit) {
            return Ok(explicit);
        }
        // The rest of the batch from the cursor-published events, whole advances at a
        // time until the batch is reached (the last advance may pass it), so that a batch
        // is short only when nothing more is due: the round goes on while it is full.
        // (Stopping at the last advance that fit left nearly every batch a few events
        // short, and a round ended after one batch: 1,000 events a round, a round a
        // minute by default.) The keys'
        // rows are locked first, skipping any another transaction holds: a requeue that
        // lowers a cursor holds its key row before it counts and rewrites the rows the
        // cursor passed, so the two never interleave on a key (a requeue counted rows
        // this delete then removed, leaving the key's count too high for good; or they
        // deadlocked over the key row and the advance log row). Retention never waits.
        // Skipped keys' advances stay for the next round. Each advance's events are found
        // by a range scan of the key's line up to `upto` (the fenced LATERAL keeps the
        // bound an index condition): joined directly, the planner scanned each key's whole
        // retained line and filtered, so a batch cost grew with the history kept per key
        // (104 ms a batch of 1,000 at 100 rows per key, 24 ms now; docs/scaling.md).
        let rest = i64::from(limit) - i64::try_from(explicit).unwrap_or(0);
        let gone: i64 = sqlx::query_scalar(AssertSqlSafe(self.text(
            "WITH oldest AS (
                 SELECT topic, event_key, through, events FROM outbox_publishes
                 WHERE at < now() - make_interval(secs => $1)
                 ORDER BY at LIMIT $2 FOR UPDATE SKIP LOCKED),
             keys AS (
                 SELECT k.topic, k.event_key, k.published_through FROM outbox_keys k
                 WHERE (k.topic, k.event_key) IN (SELECT topic, event_key FROM oldest)
                 FOR UPDATE SKIP LOCKED),
             picked AS (
                 SELECT o.* FROM (
                     SELECT o.topic, o.event_key, o.through, o.events,
                            LEAST(o.through, k.published_through) AS upto,
                            sum(o.events) OVER (ORDER BY o.through, o.topic, o.event_key) AS total
                     FROM oldest o JOIN keys k USING (topic, event_key)) o
                 WHERE o.total - o.events < $2),
             events AS (
                 DELETE FROM outbox_events e WHERE e.id IN (
                     SELECT x.id FROM picked p
                     CROSS JOIN LATERAL (
                         SELECT id FROM outbox_events x
                         WHERE x.topic = p.topic AND x.event_key = p.event_key
                           AND x.status = 'pending' AND x.id <= p.upto
                         OFFSET 0) x)
                   AND e.status = 'pending'
                 RETURNING e.id),
             logs AS (
                 DELETE FROM outbox_publishes l USING picked p
                 WHERE l.topic = p.topic AND l.event_key = p.event_key AND l.through <= p.through)
             SELECT count(*) FROM events",
        )))
        .bind(secs(older_than))
        .bind(rest)
        .fetch_one(self.relay_pool())
        .await?;
        Ok(explicit + u64::try_from(gone).unwrap_or(0))
    }

    async fn prune_idle_keys(&self, limit: u32) -> StoreResult<u64> {
        // Fold the completed counters of other backends into shard 0 (migration 0016),
        // skipping rows a transaction is writing: retention never waits.
        sqlx::query(AssertSqlSafe(self.text(
            "WITH gone AS (
                 DELETE FROM outbox_completed_counts WHERE (topic, shard) IN (
                     SELECT topic, shard FROM outbox_completed_counts WHERE shard <> 0
                     FOR UPDATE SKIP LOCKED)
                 RETURNING topic, n)
             INSERT INTO outbox_completed_counts AS c (topic, shard, n)
             SELECT topic, 0, sum(n) FROM gone GROUP BY topic ORDER BY topic COLLATE \"C\"
             ON CONFLICT (topic, shard) DO UPDATE SET n = c.n + EXCLUDED.n",
        )))
        .execute(self.relay_pool())
        .await?;
        // A key whose line still holds rows keeps its row: its cursor says which of them
        // are published.
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.text(
            "WITH gone AS (
                 DELETE FROM outbox_keys WHERE (topic, event_key) IN (
                     SELECT k.topic, k.event_key FROM outbox_keys k
                     WHERE k.ready_at = 'infinity' AND k.lease_token IS NULL AND k.pending = 0
                       AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.status = 'pending'
                                       AND e.topic = k.topic AND e.event_key = k.event_key)
                     LIMIT $1
                     FOR UPDATE SKIP LOCKED)
                 AND ready_at = 'infinity' AND lease_token IS NULL AND pending = 0
                 RETURNING topic, event_key),
             logs AS (
                 DELETE FROM outbox_publishes l USING gone g
                 WHERE l.topic = g.topic AND l.event_key = g.event_key)
             SELECT count(*) FROM gone",
        )))
        .bind(i64::from(limit))
        .fetch_one(self.relay_pool())
        .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn purge_inbox(
        &self,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64> {
        // Completed rows use `inbox_events_completed (published_at)` (migration 0013),
        // failed ones `inbox_events_failed (updated_at)`.
        self.delete_finished("inbox_events", finished, older_than, limit)
            .await
    }

    async fn prune_idle_inbox_keys(&self, limit: u32) -> StoreResult<u64> {
        let r = sqlx::query(AssertSqlSafe(self.text(
            "DELETE FROM inbox_keys WHERE (subscription, topic, event_key) IN (
                 SELECT k.subscription, k.topic, k.event_key FROM inbox_keys k
                 WHERE k.ready_at = 'infinity' AND k.lease_token IS NULL AND k.pending = 0
                   AND NOT EXISTS (SELECT 1 FROM inbox_events e WHERE e.status = 'pending'
                                   AND e.subscription = k.subscription
                                   AND e.topic = k.topic AND e.event_key = k.event_key)
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED)
             AND ready_at = 'infinity' AND lease_token IS NULL AND pending = 0",
        )))
        .bind(i64::from(limit))
        .execute(self.relay_pool())
        .await?;
        Ok(r.rows_affected())
    }
}

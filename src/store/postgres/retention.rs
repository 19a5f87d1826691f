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

/// How many key rows one pruning call reads, per row it may delete: a call reads a slice
/// of the key table in key order, from where the last one stopped, so its cost is
/// bounded whatever the table holds (issue 46, item 1: the whole table was read each
/// round, 1.2 s at 1,000,000 idle keys deleting nothing, and past the relay's statement
/// timeout at some 25,000,000 keys, after which no key row was pruned again).
const PRUNE_SCAN_PER_ROW: u32 = 10;

/// Where each box's next pruning call starts: the key after the last one read.
#[derive(Debug, Default)]
pub(super) struct PruneFrom {
    outbox: Option<Vec<String>>,
    inbox: Option<Vec<String>>,
}

/// Which box's keys to prune.
#[derive(Debug, Clone, Copy)]
enum KeyBox {
    Outbox,
    Inbox,
}

impl PgStore {
    /// Deletes up to `limit` idle key rows whose line holds nothing, reading at most
    /// `PRUNE_SCAN_PER_ROW * limit` key rows from where the previous call stopped (back
    /// to the first key after the last). A key whose line still holds rows keeps its
    /// row: its cursor says which of them are published.
    async fn prune_keys(&self, b: KeyBox, limit: u32) -> StoreResult<u64> {
        let (keys, events, logs, cols, same) = match b {
            KeyBox::Outbox => (
                "outbox_keys",
                "outbox_events",
                "DELETE FROM outbox_publishes l USING gone g
                 WHERE l.topic = g.topic AND l.event_key = g.event_key",
                "topic, event_key",
                "",
            ),
            KeyBox::Inbox => (
                "inbox_keys",
                "inbox_events",
                // The inbox keeps no advance log: an empty statement keeps one shape.
                "SELECT 1",
                "subscription, topic, event_key",
                " AND e.subscription = s.subscription",
            ),
        };
        let n = cols.split(", ").count();
        let from = {
            let at = self.prune_from.lock().unwrap_or_else(|p| p.into_inner());
            match b {
                KeyBox::Outbox => at.outbox.clone(),
                KeyBox::Inbox => at.inbox.clone(),
            }
        };
        // After `($3, $4[, $5])`, the position; from the first key without one (two
        // statements, so that each plan is an index range scan).
        let after = match &from {
            Some(_) => {
                let params: Vec<String> = (0..n).map(|i| format!("${}::text", i + 3)).collect();
                format!("WHERE ({cols}) > ({})", params.join(", "))
            }
            None => String::new(),
        };
        let last = |set: &str| {
            let desc: Vec<String> = cols.split(", ").map(|c| format!("{c} DESC")).collect();
            format!(
                "(SELECT ARRAY[{cols}] FROM {set} ORDER BY {} LIMIT 1)",
                desc.join(", ")
            )
        };
        let sql = format!(
            "WITH scan AS MATERIALIZED (
                 SELECT {cols}, ready_at, lease_token, pending FROM {keys} {after}
                 ORDER BY {cols} LIMIT $2),
             idle AS MATERIALIZED (
                 SELECT {cols} FROM scan s
                 WHERE s.ready_at = 'infinity' AND s.lease_token IS NULL AND s.pending = 0
                   AND NOT EXISTS (SELECT 1 FROM {events} e WHERE e.status = 'pending'{same}
                                   AND e.topic = s.topic AND e.event_key = s.event_key)
                 ORDER BY {cols} LIMIT $1),
             gone AS (
                 DELETE FROM {keys} WHERE ({cols}) IN (
                     SELECT {cols} FROM {keys} k WHERE ({cols}) IN (SELECT {cols} FROM idle)
                     FOR UPDATE SKIP LOCKED)
                 AND ready_at = 'infinity' AND lease_token IS NULL AND pending = 0
                 RETURNING {cols}),
             logs AS ({logs})
             SELECT (SELECT count(*) FROM gone) AS gone,
                    (SELECT count(*) FROM idle) AS idle,
                    (SELECT count(*) FROM scan) AS scanned,
                    {} AS last_idle, {} AS last_scanned",
            last("idle"),
            last("scan"),
        );
        let scan = i64::from(limit.saturating_mul(PRUNE_SCAN_PER_ROW));
        let mut q = sqlx::query_as::<_, (i64, i64, i64, Option<Vec<String>>, Option<Vec<String>>)>(
            AssertSqlSafe(self.built(&sql)),
        )
        .bind(i64::from(limit))
        .bind(scan);
        for v in from.into_iter().flatten() {
            q = q.bind(v);
        }
        let (gone, idle, scanned, last_idle, last_scanned) = q.fetch_one(self.relay_pool()).await?;
        // A full batch of idle keys: go on after the last of them (the rest of the slice
        // was read but not taken). Else after the slice, or from the first key again.
        let next = if idle >= i64::from(limit) {
            last_idle
        } else if scanned >= scan {
            last_scanned
        } else {
            None
        };
        let mut at = self.prune_from.lock().unwrap_or_else(|p| p.into_inner());
        match b {
            KeyBox::Outbox => at.outbox = next,
            KeyBox::Inbox => at.inbox = next,
        }
        Ok(u64::try_from(gone).unwrap_or(0))
    }

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
        self.prune_keys(KeyBox::Outbox, limit).await
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
        self.prune_keys(KeyBox::Inbox, limit).await
    }
}

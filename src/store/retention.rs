//! Retention queries for the outbox, for both engines: batched deletes of completed
//! (and, when configured, failed) events, and pruning of idle key rows. Each call is one
//! short statement that removes at most `limit` rows, so a large backlog of expired rows
//! is worked off in many small transactions instead of one long one.
//!
//! PostgreSQL: `DELETE … WHERE id IN (SELECT id … ORDER BY published_at LIMIT n FOR
//! UPDATE SKIP LOCKED)` over the partial index `outbox_events_completed (published_at)
//! WHERE status = 'completed'` (migration 0004); two processes running retention at once
//! skip each other's rows. Failed events use `outbox_events_failed (updated_at)`.
//!
//! Key rows are pruned only when idle (`ready_at` = never), unleased and without pending
//! events. Every writer that needs a key row creates it with an upsert under the row's
//! lock (enqueue, requeue, cancel), so a pruned key comes back on its next event.

use std::time::Duration;

use chrono::Utc;

use super::postgres::PgStore;
use super::sqlite::SqliteStore;
use super::{StoreError, StoreResult};

#[async_trait::async_trait]
pub trait RetentionStore: Send + Sync {
    /// Deletes up to `limit` outbox events that were completed (published) more than
    /// `older_than` ago, oldest first; returns how many it deleted.
    async fn purge_completed(&self, older_than: Duration, limit: u32) -> StoreResult<u64>;

    /// Deletes up to `limit` outbox events that have been failed for more than
    /// `older_than` (since their last update); returns how many it deleted.
    async fn purge_failed(&self, older_than: Duration, limit: u32) -> StoreResult<u64>;

    /// Deletes up to `limit` idle outbox key rows: no pending event, no lease, not
    /// scheduled. Returns how many it deleted.
    async fn prune_idle_keys(&self, limit: u32) -> StoreResult<u64>;
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[async_trait::async_trait]
impl RetentionStore for PgStore {
    async fn purge_completed(&self, older_than: Duration, limit: u32) -> StoreResult<u64> {
        let r = sqlx::query(
            "DELETE FROM outbox_events WHERE id IN (
                 SELECT id FROM outbox_events
                 WHERE status = 'completed'
                   AND published_at < now() - make_interval(secs => $1)
                 ORDER BY published_at
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED)
             AND status = 'completed'",
        )
        .bind(secs(older_than))
        .bind(i64::from(limit))
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }

    async fn purge_failed(&self, older_than: Duration, limit: u32) -> StoreResult<u64> {
        let r = sqlx::query(
            "DELETE FROM outbox_events WHERE id IN (
                 SELECT id FROM outbox_events
                 WHERE status = 'failed'
                   AND updated_at < now() - make_interval(secs => $1)
                 ORDER BY updated_at
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED)
             AND status = 'failed'",
        )
        .bind(secs(older_than))
        .bind(i64::from(limit))
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }

    async fn prune_idle_keys(&self, limit: u32) -> StoreResult<u64> {
        let r = sqlx::query(
            "DELETE FROM outbox_keys WHERE (topic, event_key) IN (
                 SELECT topic, event_key FROM outbox_keys
                 WHERE ready_at = 'infinity' AND lease_token IS NULL AND pending = 0
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED)
             AND ready_at = 'infinity' AND lease_token IS NULL AND pending = 0",
        )
        .bind(i64::from(limit))
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }
}

fn cutoff_micros(older_than: Duration) -> StoreResult<i64> {
    let d = chrono::Duration::from_std(older_than)
        .map_err(|e| StoreError::Other(format!("retention period out of range: {e}")))?;
    Ok((Utc::now() - d).timestamp_micros())
}

#[async_trait::async_trait]
impl RetentionStore for SqliteStore {
    async fn purge_completed(&self, older_than: Duration, limit: u32) -> StoreResult<u64> {
        let r = sqlx::query(
            "DELETE FROM outbox_events WHERE id IN (
                 SELECT id FROM outbox_events
                 WHERE status = 'completed' AND published_at < ?1
                 ORDER BY published_at
                 LIMIT ?2)",
        )
        .bind(cutoff_micros(older_than)?)
        .bind(i64::from(limit))
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }

    async fn purge_failed(&self, older_than: Duration, limit: u32) -> StoreResult<u64> {
        let r = sqlx::query(
            "DELETE FROM outbox_events WHERE id IN (
                 SELECT id FROM outbox_events
                 WHERE status = 'failed' AND updated_at < ?1
                 ORDER BY updated_at
                 LIMIT ?2)",
        )
        .bind(cutoff_micros(older_than)?)
        .bind(i64::from(limit))
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }

    async fn prune_idle_keys(&self, limit: u32) -> StoreResult<u64> {
        // SQLite has one writer: nothing can hold the row between the select and delete.
        let r = sqlx::query(
            "DELETE FROM outbox_keys WHERE rowid IN (
                 SELECT rowid FROM outbox_keys
                 WHERE ready_at = ?1 AND lease_token IS NULL AND pending = 0
                 LIMIT ?2)",
        )
        .bind(i64::MAX)
        .bind(i64::from(limit))
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }
}

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
use sqlx::AssertSqlSafe;

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

/// Deletes up to `limit` events of `status` whose `time_column` is older than
/// `older_than`, oldest first. Both names are constants of this module.
async fn pg_purge(
    store: &PgStore,
    status: &'static str,
    time_column: &'static str,
    older_than: Duration,
    limit: u32,
) -> StoreResult<u64> {
    let r = sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM outbox_events WHERE id IN (
             SELECT id FROM outbox_events
             WHERE status = '{status}'
               AND {time_column} < now() - make_interval(secs => $1)
             ORDER BY {time_column}
             LIMIT $2
             FOR UPDATE SKIP LOCKED)
         AND status = '{status}'"
    )))
    .bind(secs(older_than))
    .bind(i64::from(limit))
    .execute(store.relay_pool())
    .await?;
    Ok(r.rows_affected())
}

/// The SQLite twin of `pg_purge` (one writer: no row can be taken in between).
async fn sqlite_purge(
    store: &SqliteStore,
    status: &'static str,
    time_column: &'static str,
    older_than: Duration,
    limit: u32,
) -> StoreResult<u64> {
    let r = sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM outbox_events WHERE id IN (
             SELECT id FROM outbox_events
             WHERE status = '{status}' AND {time_column} < ?1
             ORDER BY {time_column}
             LIMIT ?2)"
    )))
    .bind(cutoff_micros(older_than)?)
    .bind(i64::from(limit))
    .execute(store.pool())
    .await?;
    Ok(r.rows_affected())
}

#[async_trait::async_trait]
impl RetentionStore for PgStore {
    async fn purge_completed(&self, older_than: Duration, limit: u32) -> StoreResult<u64> {
        pg_purge(self, "completed", "published_at", older_than, limit).await
    }

    async fn purge_failed(&self, older_than: Duration, limit: u32) -> StoreResult<u64> {
        pg_purge(self, "failed", "updated_at", older_than, limit).await
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
        .execute(self.relay_pool())
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
        sqlite_purge(self, "completed", "published_at", older_than, limit).await
    }

    async fn purge_failed(&self, older_than: Duration, limit: u32) -> StoreResult<u64> {
        sqlite_purge(self, "failed", "updated_at", older_than, limit).await
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

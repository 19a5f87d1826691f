//! Retention on SQLite: the same batched deletes; times are microseconds since the epoch.

use std::time::Duration;

use chrono::Utc;
use sqlx::AssertSqlSafe;

use super::SqliteStore;
use crate::store::retention::{Finished, RetentionStore};
use crate::store::{StoreError, StoreResult};

fn cutoff_micros(older_than: Duration) -> StoreResult<i64> {
    let d = chrono::Duration::from_std(older_than)
        .map_err(|e| StoreError::other(format!("retention period out of range: {e}")))?;
    Ok((Utc::now() - d).timestamp_micros())
}

impl SqliteStore {
    /// Deletes up to `limit` `finished` rows of `events` (a table name constant) older
    /// than `older_than`, oldest first.
    async fn delete_finished(
        &self,
        events: &str,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64> {
        // Both names are constants of `Finished`, never caller text.
        let (status, time_column) = (finished.status(), finished.since_column());
        let r = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {events} WHERE id IN (
                 SELECT id FROM {events}
                 WHERE status = '{status}' AND {time_column} < ?1
                 ORDER BY {time_column}
                 LIMIT ?2)"
        )))
        .bind(cutoff_micros(older_than)?)
        .bind(i64::from(limit))
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }

    /// Deletes up to `limit` idle rows of `keys` (a table name constant): no pending
    /// event, no lease. SQLite has one writer: nothing can hold a row between the select
    /// and the delete.
    async fn delete_idle_keys(&self, keys: &str, limit: u32) -> StoreResult<u64> {
        let r = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM {keys} WHERE rowid IN (
                 SELECT rowid FROM {keys}
                 WHERE ready_at = ?1 AND lease_token IS NULL AND pending = 0
                 LIMIT ?2)"
        )))
        .bind(i64::MAX)
        .bind(i64::from(limit))
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }
}

#[async_trait::async_trait]
impl RetentionStore for SqliteStore {
    async fn purge(
        &self,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64> {
        self.delete_finished("outbox_events", finished, older_than, limit)
            .await
    }

    async fn prune_idle_keys(&self, limit: u32) -> StoreResult<u64> {
        self.delete_idle_keys("outbox_keys", limit).await
    }

    async fn purge_inbox(
        &self,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64> {
        self.delete_finished("inbox_events", finished, older_than, limit)
            .await
    }

    async fn prune_idle_inbox_keys(&self, limit: u32) -> StoreResult<u64> {
        self.delete_idle_keys("inbox_keys", limit).await
    }
}

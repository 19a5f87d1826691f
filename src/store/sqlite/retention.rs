//! Retention on SQLite: the same batched deletes; times are microseconds since the epoch.

use std::time::Duration;

use chrono::Utc;
use sqlx::AssertSqlSafe;

use super::SqliteStore;
use crate::store::retention::{Finished, RetentionStore};
use crate::store::{StoreError, StoreResult};

fn cutoff_micros(older_than: Duration) -> StoreResult<i64> {
    let d = chrono::Duration::from_std(older_than)
        .map_err(|e| StoreError::Other(format!("retention period out of range: {e}")))?;
    Ok((Utc::now() - d).timestamp_micros())
}

#[async_trait::async_trait]
impl RetentionStore for SqliteStore {
    async fn purge(
        &self,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64> {
        // Both names are constants of `Finished`, never caller text.
        let (status, time_column) = (finished.status(), finished.since_column());
        let r = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM outbox_events WHERE id IN (
                 SELECT id FROM outbox_events
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

    async fn purge_inbox(
        &self,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64> {
        // Both names are constants of `Finished`, never caller text.
        let (status, time_column) = (finished.status(), finished.since_column());
        let r = sqlx::query(AssertSqlSafe(format!(
            "DELETE FROM inbox_events WHERE id IN (
                 SELECT id FROM inbox_events
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

    async fn prune_idle_inbox_keys(&self, limit: u32) -> StoreResult<u64> {
        let r = sqlx::query(
            "DELETE FROM inbox_keys WHERE rowid IN (
                 SELECT rowid FROM inbox_keys
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

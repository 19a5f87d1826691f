//! Retention on PostgreSQL: `DELETE … WHERE id IN (SELECT id … ORDER BY published_at
//! LIMIT n FOR UPDATE SKIP LOCKED)` over the partial index `outbox_events_completed
//! (published_at) WHERE status = 'completed'` (migration 0004); two processes running
//! retention at once skip each other's rows. Failed events use `outbox_events_failed
//! (updated_at)`.

use std::time::Duration;

use sqlx::AssertSqlSafe;

use super::PgStore;
use crate::store::StoreResult;
use crate::store::retention::{Finished, RetentionStore};

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[async_trait::async_trait]
impl RetentionStore for PgStore {
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
                 WHERE status = '{status}'
                   AND {time_column} < now() - make_interval(secs => $1)
                 ORDER BY {time_column}
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED)
             AND status = '{status}'"
        )))
        .bind(secs(older_than))
        .bind(i64::from(limit))
        .execute(self.relay_pool())
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
        .execute(self.relay_pool())
        .await?;
        Ok(r.rows_affected())
    }
}

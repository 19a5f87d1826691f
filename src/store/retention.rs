//! Retention for the outbox, the calls every engine answers (`postgres/retention.rs`,
//! `sqlite/retention.rs`): batched deletes of completed (and, when configured, failed)
//! events, and pruning of idle key rows. Each call is one short statement that removes
//! at most `limit` rows, so a large backlog of expired rows is worked off in many small
//! transactions instead of one long one.
//!
//! Key rows are pruned only when idle (`ready_at` = never), unleased and without pending
//! events. Every writer that needs a key row creates it with an upsert under the row's
//! lock (enqueue, requeue, cancel), so a pruned key comes back on its next event.

use std::time::Duration;

use super::StoreResult;

/// The store's retention calls: bounded deletes of old outbox events and idle key rows.
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

//! Retention for the outbox, the calls every engine answers (`postgres/retention.rs`,
//! `sqlite/retention.rs`): batched deletes of completed (and, when configured, failed)
//! events, and pruning of idle key rows. Each call is one short statement that removes
//! at most `limit` rows, so a large backlog of expired rows is worked off in many small
//! transactions instead of one long one.
//!
//! Key rows are pruned only when idle (`ready_at` = never), unleased and without pending
//! events. Every writer that needs a key row creates it with an upsert under the row's
//! lock (enqueue, requeue, cancel), so a pruned key comes back on its next event.
//!
//! The inbox (`inbox_events`, `inbox_keys`) follows the same rules with its own calls:
//! its rows are settled one by one (no cursor), and its key rows are upserted by every
//! receive, so a pruned inbox key also comes back with its next message.

use std::time::Duration;

use super::StoreResult;

/// The end states retention deletes, each with the column that says since when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// Published: aged by `published_at` (index `outbox_events_completed`).
    Completed,
    /// Out of attempts: aged by `updated_at` (index `outbox_events_failed`).
    Failed,
}

impl Finished {
    /// The status column's value.
    pub fn status(self) -> &'static str {
        match self {
            Finished::Completed => "completed",
            Finished::Failed => "failed",
        }
    }

    /// The column the age is measured from.
    pub fn since_column(self) -> &'static str {
        match self {
            Finished::Completed => "published_at",
            Finished::Failed => "updated_at",
        }
    }
}

/// The store's retention calls: bounded deletes of old outbox events and idle key rows.
#[async_trait::async_trait]
pub trait RetentionStore: Send + Sync {
    /// Deletes up to `limit` outbox events that have been `finished` for more than
    /// `older_than`, oldest first; returns how many it deleted.
    async fn purge(&self, finished: Finished, older_than: Duration, limit: u32)
    -> StoreResult<u64>;

    /// Deletes up to `limit` idle outbox key rows: no pending event, no lease, not
    /// scheduled. Returns how many it deleted.
    async fn prune_idle_keys(&self, limit: u32) -> StoreResult<u64>;

    /// Deletes up to `limit` inbox messages `finished` for more than `older_than`,
    /// oldest first (completed ones aged by when they were handled). A message whose row
    /// is gone is no longer a duplicate: this age is the inbox's dedup window.
    async fn purge_inbox(
        &self,
        finished: Finished,
        older_than: Duration,
        limit: u32,
    ) -> StoreResult<u64>;

    /// Deletes up to `limit` idle inbox key rows (same rule as the outbox's).
    async fn prune_idle_inbox_keys(&self, limit: u32) -> StoreResult<u64>;
}

//! Retention: a background task that deletes what the outbox no longer needs, in small
//! batches (see `store::retention` for the queries).
//!
//! - Completed events: `completed` after publication (default 7 days). They are only
//!   kept for inspection and for idempotency: an `Enqueue` repeating the idempotency key
//!   of a deleted event is stored again, so the retention is also the deduplication
//!   window.
//! - Failed events: kept until an operator requeues (or cancels and purges) them, or,
//!   when `failed` is set, deleted that long after they failed (default: kept forever).
//! - Idle key rows: deleted once they have no pending event and no lease.
//! - The inbox, by the same rules and settings: completed messages (aged since they were
//!   handled), failed ones when `failed` is set, idle key rows. A completed message is
//!   the inbox's memory of its id, so `completed` is also the inbox's dedup window: a
//!   redelivery after it is handled again.
//!
//! Each round deletes batch after batch until a batch comes back short, pausing briefly
//! between batches so that the deletes never monopolise the database.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::schema::SchemaGate;
use crate::store::retention::Finished;
use crate::store::{Store, StoreResult};

/// What retention deletes, and how often.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetentionConfig {
    /// Age (since publication) past which completed events are deleted; `None`: never.
    pub completed: Option<Duration>,
    /// Age (since failing) past which failed events are deleted; `None`: never.
    pub failed: Option<Duration>,
    /// Time between rounds; `None`: the task does not run.
    pub interval: Option<Duration>,
    /// Rows per DELETE.
    pub batch: u32,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            completed: Some(Duration::from_secs(7 * 24 * 3600)),
            failed: None,
            interval: Some(Duration::from_secs(60)),
            batch: 1000,
        }
    }
}

/// What one round deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundReport {
    /// Completed events deleted.
    pub completed: u64,
    /// Failed events deleted.
    pub failed: u64,
    /// Idle key rows deleted.
    pub keys: u64,
    /// Completed inbox messages deleted.
    pub inbox_completed: u64,
    /// Failed inbox messages deleted.
    pub inbox_failed: u64,
    /// Idle inbox key rows deleted.
    pub inbox_keys: u64,
}

/// Pause between two batches of one round.
const BATCH_PAUSE: Duration = Duration::from_millis(10);
/// Most batches of one kind per round, so that a round always ends.
const MAX_BATCHES: u32 = 10_000;

async fn drain<F, Fut>(batch: u32, shutdown: &CancellationToken, mut f: F) -> StoreResult<u64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = StoreResult<u64>>,
{
    let mut total = 0;
    for _ in 0..MAX_BATCHES {
        let n = f().await?;
        total += n;
        if n < u64::from(batch) || shutdown.is_cancelled() {
            break;
        }
        tokio::time::sleep(BATCH_PAUSE).await;
    }
    Ok(total)
}

/// One retention round: completed, then failed events, then idle keys (last, so that
/// keys emptied by this round's deletes are not a concern: deletes never touch pending
/// events).
pub async fn run_round(
    store: &dyn Store,
    config: &RetentionConfig,
    shutdown: &CancellationToken,
) -> StoreResult<RoundReport> {
    let mut r = RoundReport::default();
    if let Some(age) = config.completed {
        r.completed = drain(config.batch, shutdown, || {
            store.purge(Finished::Completed, age, config.batch)
        })
        .await?;
    }
    if let Some(age) = config.failed {
        r.failed = drain(config.batch, shutdown, || {
            store.purge(Finished::Failed, age, config.batch)
        })
        .await?;
    }
    r.keys = drain(config.batch, shutdown, || {
        store.prune_idle_keys(config.batch)
    })
    .await?;
    // The inbox, by the same rules: its completed rows are its dedup memory, so the
    // completed age is also the window inside which a redelivery is dropped.
    if let Some(age) = config.completed {
        r.inbox_completed = drain(config.batch, shutdown, || {
            store.purge_inbox(Finished::Completed, age, config.batch)
        })
        .await?;
    }
    if let Some(age) = config.failed {
        r.inbox_failed = drain(config.batch, shutdown, || {
            store.purge_inbox(Finished::Failed, age, config.batch)
        })
        .await?;
    }
    r.inbox_keys = drain(config.batch, shutdown, || {
        store.prune_idle_inbox_keys(config.batch)
    })
    .await?;
    Ok(r)
}

/// Runs rounds every `config.interval` until `shutdown`. A round runs only when `schema`
/// (read afresh each round) allows this binary: an older binary's deletes could break
/// what a newer migration keeps (e.g. prune key rows whose cursor covers retained rows).
pub async fn run(
    store: Arc<dyn Store>,
    config: RetentionConfig,
    metrics: Option<Metrics>,
    schema: SchemaGate,
    shutdown: CancellationToken,
) {
    let Some(interval) = config.interval else {
        return;
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(interval) => {}
        }
        // The gate logs a refusal once; a read error is the round's failure.
        match schema.permit().await {
            Ok(()) => {}
            Err(crate::error::Error::SchemaIncompatible { .. }) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "retention round failed; retrying next round");
                continue;
            }
        }
        match run_round(store.as_ref(), &config, &shutdown).await {
            Ok(r) => {
                if r != RoundReport::default() {
                    tracing::info!(
                        completed = r.completed,
                        failed = r.failed,
                        keys = r.keys,
                        inbox_completed = r.inbox_completed,
                        inbox_failed = r.inbox_failed,
                        inbox_keys = r.inbox_keys,
                        "retention deleted expired rows"
                    );
                }
                if let Some(m) = &metrics {
                    m.retention_deleted("completed", r.completed);
                    m.retention_deleted("failed", r.failed);
                    m.keys_pruned(r.keys + r.inbox_keys);
                    m.retention_deleted("inbox_completed", r.inbox_completed);
                    m.retention_deleted("inbox_failed", r.inbox_failed);
                }
            }
            Err(e) => tracing::warn!(error = %e, "retention round failed; retrying next round"),
        }
    }
}

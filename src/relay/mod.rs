//! The relay engine, shared by both boxes: claim → plan → deliver → settle, in cycles.
//! The outbox relay runs it with a Kafka or local sink; the inbox dispatcher would run
//! the same engine with a handler as its sink.
//!
//! A cycle holds no database transaction across delivery: the claim commits, the sink
//! delivers, the settle commits. Keys that have nothing to publish this cycle are
//! released before delivery starts; keys and events a cycle claimed but did not reach are
//! released by its settle, at once.

pub mod backoff;
pub mod plan;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::RngExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::domain::Queue;
use crate::sink::Sink;
use crate::store::{ClaimLimits, KeyRelease, Store, StoreError};
use backoff::{ProbeBackoff, RetryPolicy};
use plan::{LinePlan, plan_line, plan_single};

/// Relay tuning.
#[derive(Debug, Clone, Copy)]
pub struct RelayConfig {
    /// Events one cycle may hand to the sink (keyed and unkeyed each).
    pub batch_size: u32,
    /// Keys one cycle leases. Fewer keys than events lets a cycle carry runs of several
    /// events per key: every leased key costs row writes (lease, release) whatever it
    /// carries.
    pub max_keys: u32,
    /// Longest run of one key in one cycle.
    pub max_run: u32,
    /// Bytes (payload and headers) one cycle may read, keyed and unkeyed each; at least
    /// one event goes out whatever its size.
    pub max_bytes: u64,
    /// Claim lease; longer than any delivery timeout.
    pub lease: Duration,
    /// Fallback poll when nothing wakes the relay.
    pub poll_interval: Duration,
    /// The relay's own pause after a transient failure, from `probe_min` to `probe_max`.
    pub probe_min: Duration,
    pub probe_max: Duration,
    pub retry: RetryPolicy,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch_size: 1000,
            max_keys: 250,
            max_run: 500,
            max_bytes: 64 * 1024 * 1024,
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_millis(250),
            probe_min: Duration::from_millis(200),
            probe_max: Duration::from_secs(5),
            retry: RetryPolicy::default(),
        }
    }
}

/// Counters, shared with whoever wants to watch the relay (tests, metrics, admin).
#[derive(Debug, Default)]
pub struct RelayStats {
    pub cycles: AtomicU64,
    pub delivered: AtomicU64,
    pub retried: AtomicU64,
    pub failed: AtomicU64,
    pub transient: AtomicU64,
    pub stale: AtomicU64,
    pub delivered_after_failure: AtomicU64,
    /// Events handed to the sink that came back with a transient failure (no attempt spent).
    pub transient_events: AtomicU64,
    /// Cycles that attempted deliveries, claim to settle.
    pub cycle_latency: crate::metrics::Latency,
    /// The sink's delivery of one cycle's runs.
    pub publish_latency: crate::metrics::Latency,
    /// Since when (Unix ms) deliveries have failed transiently with nothing delivered;
    /// 0 while the destination is reachable.
    pub unreachable_since_ms: std::sync::atomic::AtomicI64,
}

impl RelayStats {
    /// How long the destination has been unreachable, if it is.
    pub fn unreachable_for(&self) -> Option<Duration> {
        let since = self.unreachable_since_ms.load(Ordering::Relaxed);
        (since > 0).then(|| {
            Duration::from_millis((chrono::Utc::now().timestamp_millis() - since).max(0) as u64)
        })
    }
}

/// What one cycle did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CycleReport {
    pub keys: usize,
    pub attempted: usize,
    pub delivered: usize,
    pub retried: usize,
    pub failed: usize,
    pub transient: bool,
    pub stale: usize,
}

/// One relay task.
pub struct Relay {
    store: Arc<dyn Store>,
    sink: Arc<dyn Sink>,
    queue: Queue,
    config: RelayConfig,
    wake: Arc<Notify>,
    stats: Arc<RelayStats>,
    probe: ProbeBackoff,
}

impl Relay {
    pub fn new(
        store: Arc<dyn Store>,
        sink: Arc<dyn Sink>,
        queue: Queue,
        config: RelayConfig,
    ) -> Self {
        Relay {
            store,
            sink,
            queue,
            config,
            wake: Arc::new(Notify::new()),
            stats: Arc::new(RelayStats::default()),
            probe: ProbeBackoff::new(config.probe_min, config.probe_max),
        }
    }

    /// The handle that wakes this relay early (new events were committed).
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    fn limits(&self) -> ClaimLimits {
        let c = &self.config;
        if self.probe.probing() {
            // The destination looked down: one event probes it.
            return ClaimLimits {
                max_keys: 1,
                max_events: 1,
                max_run: 1,
                max_unkeyed: 1,
                max_bytes: c.max_bytes,
                lease: c.lease,
            };
        }
        ClaimLimits {
            max_keys: c.max_keys.clamp(1, c.batch_size),
            max_events: c.batch_size,
            max_run: c.max_run,
            max_unkeyed: c.batch_size,
            max_bytes: c.max_bytes,
            lease: c.lease,
        }
    }

    /// Runs one cycle. Public so tests can count cycles exactly.
    pub async fn cycle(&mut self) -> Result<CycleReport, StoreError> {
        let token: i64 = rand::rng().random();
        let limits = self.limits();
        let claim = self.store.claim(&self.queue, token, limits).await?;
        self.stats.cycles.fetch_add(1, Ordering::Relaxed);
        let mut report = CycleReport {
            keys: claim.keyed.len(),
            ..Default::default()
        };

        // Plan every line; the budget is shared in claim order.
        let mut budget = limits.max_events as usize;
        let mut plans: Vec<LinePlan<'_>> = Vec::new();
        let mut idle = Vec::new();
        for w in &claim.keyed {
            let p = plan_line(w, claim.now, budget);
            budget -= p.run.len();
            if p.run.is_empty() {
                idle.push(KeyRelease {
                    line: w.line.clone(),
                    ready: p.readiness_untouched(),
                });
            } else {
                plans.push(p);
            }
        }
        plans.extend(claim.unkeyed.iter().map(plan_single));
        // Keys with nothing to publish go back at once, not after the delivery.
        if !idle.is_empty() {
            self.store.settle(&self.queue, token, &[], &idle).await?;
        }
        if plans.is_empty() {
            return Ok(report);
        }

        let lines: Vec<Vec<&_>> = plans.iter().map(|p| p.run.clone()).collect();
        report.attempted = lines.iter().map(Vec::len).sum();
        let started = std::time::Instant::now();
        let deliveries = self.sink.deliver(&lines).await;
        self.stats.publish_latency.observe(started.elapsed());

        let mut updates = Vec::new();
        let mut releases = Vec::new();
        let mut out_of_order = 0;
        let mut transient_events = 0;
        for (p, d) in plans.iter().zip(&deliveries) {
            let o = p.settle(d, &self.config.retry, &mut rand::rng());
            report.delivered += o.delivered;
            report.retried += o.retried;
            report.failed += o.failed;
            report.transient |= o.transient;
            out_of_order += o.delivered_after_failure;
            if o.transient {
                transient_events += p
                    .run
                    .len()
                    .saturating_sub(o.delivered + o.retried + o.failed);
            }
            updates.extend(o.updates);
            if let Some(line) = p.line {
                releases.push(KeyRelease {
                    line: line.clone(),
                    ready: o.ready,
                });
            }
        }
        let settled = self
            .store
            .settle(&self.queue, token, &updates, &releases)
            .await?;
        report.stale = settled.stale;
        if settled.stale > 0 {
            tracing::warn!(
                stale = settled.stale,
                "claim expired before settle; another relay owns those events now"
            );
        }
        if out_of_order > 0 {
            tracing::warn!(
                count = out_of_order,
                "the sink delivered events after an earlier event of their key failed"
            );
        }
        let s = &self.stats;
        s.delivered
            .fetch_add(report.delivered as u64, Ordering::Relaxed);
        s.retried
            .fetch_add(report.retried as u64, Ordering::Relaxed);
        s.failed.fetch_add(report.failed as u64, Ordering::Relaxed);
        s.stale.fetch_add(report.stale as u64, Ordering::Relaxed);
        s.delivered_after_failure
            .fetch_add(out_of_order as u64, Ordering::Relaxed);
        s.transient_events
            .fetch_add(transient_events as u64, Ordering::Relaxed);
        if report.transient {
            s.transient.fetch_add(1, Ordering::Relaxed);
        }
        if report.delivered > 0 {
            s.unreachable_since_ms.store(0, Ordering::Relaxed);
        } else if report.transient {
            let now = chrono::Utc::now().timestamp_millis();
            let _ = s.unreachable_since_ms.compare_exchange(
                0,
                now,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        Ok(report)
    }

    /// Runs cycles until `shutdown`. A cycle in progress completes (its deliveries are
    /// bounded by the sink's timeout) so that it settles and releases what it claimed.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut db_backoff = ProbeBackoff::new(self.config.probe_min, self.config.probe_max);
        while !shutdown.is_cancelled() {
            let cycle_start = std::time::Instant::now();
            let pause = match self.cycle().await {
                Ok(r) => {
                    if r.attempted > 0 {
                        self.stats.cycle_latency.observe(cycle_start.elapsed());
                    }
                    db_backoff.succeeded();
                    if r.transient {
                        let d = self.probe.failed(&mut rand::rng());
                        tracing::info!(
                            pause_ms = d.as_millis() as u64,
                            "destination unavailable; probing again later"
                        );
                        Some(d)
                    } else if r.attempted > 0 {
                        if r.delivered > 0 {
                            self.probe.succeeded();
                        }
                        None
                    } else if r.keys > 0 {
                        // Only blocked keys came back; look again for others at once.
                        None
                    } else {
                        Some(self.config.poll_interval)
                    }
                }
                Err(e) => {
                    let d = db_backoff.failed(&mut rand::rng());
                    tracing::warn!(error = %e, pause_ms = d.as_millis() as u64, "relay cycle failed");
                    Some(d)
                }
            };
            if let Some(d) = pause {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = self.wake.notified(), if !self.probe.probing() => {}
                    _ = tokio::time::sleep(d) => {}
                }
            }
        }
    }
}

//! What a relay reports about itself: counters and latency histograms, shared with
//! whoever watches it (metrics, health, the console, tests), and one cycle's report.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;

/// Upper bounds (seconds) of the latency histograms.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0,
];

/// A latency histogram: a handle to the library's `Histogram` with the fixed buckets
/// above. Clones share the counts, so all relays of a process can record into one.
#[derive(Debug, Clone)]
pub struct Latency(Arc<Histogram>);

impl Default for Latency {
    fn default() -> Self {
        Latency(Arc::new(Histogram::new(LATENCY_BUCKETS)))
    }
}

impl Latency {
    /// Records one duration.
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }

    /// The library histogram, for encoding.
    pub fn histogram(&self) -> &Histogram {
        &self.0
    }

    /// Whether both handles record into the same histogram.
    pub fn same(&self, other: &Latency) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Counters, shared with whoever wants to watch the relay (tests, metrics, admin).
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Cycles run (claims made).
    pub cycles: AtomicU64,
    /// Events the destination acknowledged.
    pub delivered: AtomicU64,
    /// Failed attempts that will be retried (an attempt spent).
    pub retried: AtomicU64,
    /// Events that became failed.
    pub failed: AtomicU64,
    /// Cycles whose deliveries failed transiently (destination unreachable).
    pub transient: AtomicU64,
    /// Settle updates dropped because another relay had taken the key or event over.
    pub stale: AtomicU64,
    /// Events acknowledged after an earlier event of their run failed (flagged).
    pub delivered_after_failure: AtomicU64,
    /// Events handed to the sink that came back with a transient failure (no attempt spent).
    pub transient_events: AtomicU64,
    /// Cycles that attempted deliveries, claim to settle.
    pub cycle_latency: Latency,
    /// The sink's delivery of one cycle's runs.
    pub publish_latency: Latency,
    /// Since when (Unix ms) deliveries have failed transiently with nothing delivered;
    /// 0 while the destination is reachable.
    pub unreachable_since_ms: std::sync::atomic::AtomicI64,
    /// Lease renewals of lines still in flight, and the keys or events they found taken.
    pub renewals: AtomicU64,
    /// Keys or events whose lease another relay took while in flight.
    pub renewals_lost: AtomicU64,
    /// Lines held back because their topic is down and not due for a probe.
    pub held_back: AtomicU64,
    /// Runs sent on a deep key kept leased, right after its previous run (no release
    /// and claim in between).
    pub continued: AtomicU64,
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
    /// Keys leased.
    pub keys: usize,
    /// Events handed to the sink.
    pub attempted: usize,
    /// Events acknowledged and settled completed.
    pub delivered: usize,
    /// Events settled for a retry (an attempt spent).
    pub retried: usize,
    /// Events settled failed.
    pub failed: usize,
    /// The destination was unreachable.
    pub transient: bool,
    /// Settle updates another relay's lease made moot.
    pub stale: usize,
    /// Events published after an earlier event of their run failed (flagged).
    pub delivered_after_failure: usize,
    /// Events handed to the sink that came back transient (no attempt spent).
    pub transient_events: usize,
}

impl CycleReport {
    /// Adds what a later part of the same cycle (a continued line's runs) did.
    pub fn add(&mut self, other: &CycleReport) {
        self.attempted += other.attempted;
        self.delivered += other.delivered;
        self.retried += other.retried;
        self.failed += other.failed;
        self.transient |= other.transient;
        self.stale += other.stale;
        self.delivered_after_failure += other.delivered_after_failure;
        self.transient_events += other.transient_events;
    }
}

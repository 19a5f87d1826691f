//! The relay engine, shared by both boxes: claim → plan → deliver → settle, in cycles.
//! The outbox relay runs it with a Kafka or local sink; the inbox dispatcher runs the
//! same engine with the subscriber's handler as its sink.
//!
//! A cycle holds no database transaction across delivery: the claim commits, the sink
//! delivers, the settle commits. Keys that have nothing to publish this cycle are
//! released before delivery starts. Lines are settled as their deliveries finish (a
//! slow or dead topic does not hold the others back), and the leases of lines still in
//! flight are renewed. A relay keeps a few cycles in flight, so a cycle waiting on a
//! dead topic does not stop the next one from publishing to the healthy ones; each
//! topic that looks down is probed on its own (`domains`).
//!
//! One file per step of a cycle: `claim` (limits, the gated claim), `cycle` (plan the
//! claim, gate its lines by their topic's health, give back what goes nowhere), `deliver`
//! (hand lines to the sink, settle each as it finishes, renew leases), `settle` (decide
//! what finished lines come to, then commit it) and `continued` (deep lines that go on
//! past their first run). `cadence` spaces the claims; this file runs the cycles.

pub mod backoff;
mod cadence;
mod claim;
mod continued;
mod cycle;
mod deliver;
pub mod domains;
pub mod pauses;
pub mod plan;
mod settle;
mod stats;

pub use cadence::ClaimCadence;
pub use stats::{CycleReport, LATENCY_BUCKETS, Latency, RelayStats};

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::RngExt;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::domain::Queue;
use crate::schema::SchemaGate;
use crate::sink::Sink;
use crate::store::{Store, StoreError};
use backoff::{ProbeBackoff, RetryPolicy};
use cadence::spaced;
use domains::Domains;

/// Relay tuning.
#[derive(Debug, Clone, Copy)]
pub struct RelayConfig {
    /// Events one cycle may hand to the sink (keyed and unkeyed each).
    pub batch_size: u32,
    /// Keys one cycle leases at most. Fewer keys than events lets a cycle carry runs of
    /// several events per key: every leased key costs row writes (lease, release)
    /// whatever it carries. The store leases fewer still when lines are deep: as many
    /// as fill the batch, each counted at its depth.
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
    /// A topic's pause after a transient failure, from `probe_min` to `probe_max`.
    pub probe_min: Duration,
    /// The longest such pause.
    pub probe_max: Duration,
    /// Attempts and backoff of an event.
    pub retry: RetryPolicy,
    /// Renew the leases of lines still in flight every third of the lease.
    pub renew_leases: bool,
    /// Cycles one relay keeps in flight at most.
    pub max_cycles_in_flight: usize,
    /// After the first line of a cycle finishes, how long to gather others before
    /// settling them together (one transaction for many lines).
    pub settle_linger: Duration,
    /// After a claim that took all there was (it hit no limit), the relay's next claim
    /// begins no sooner than this after it began, whatever wakes the relay: under a
    /// steady trickle, claiming on every commit and every settle made many claims of a
    /// few events each, and their cost saturated the database (docs/relay.md, "Claim
    /// spacing"). A claim that hit a limit is followed at once, and a relay idle for
    /// longer claims at once. Zero: no spacing.
    pub claim_spacing: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch_size: 1000,
            max_keys: 250,
            max_run: 1000,
            max_bytes: 64 * 1024 * 1024,
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_millis(250),
            probe_min: Duration::from_millis(200),
            probe_max: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            renew_leases: true,
            max_cycles_in_flight: 4,
            settle_linger: Duration::from_millis(20),
            claim_spacing: Duration::from_millis(25),
        }
    }
}

/// One relay task. Clones share everything: the inbox's supervisor starts a dispatcher
/// that panicked again from a clone.
#[derive(Clone)]
pub struct Relay {
    shared: Arc<Shared>,
    wake: Arc<Notify>,
    cadence: Arc<ClaimCadence>,
}

/// What the cycles of one relay share.
struct Shared {
    store: Arc<dyn Store>,
    sink: Arc<dyn Sink>,
    queue: Queue,
    config: RelayConfig,
    stats: Arc<RelayStats>,
    domains: Mutex<Domains>,
    /// Signalled when a cycle settled something: the relay may claim again.
    progress: Notify,
    /// Claims only while the database's schema allows this binary (`crate::schema`).
    schema: Option<SchemaGate>,
    /// Cancelled when the relay stops: continued lines end after the run in flight.
    stopping: CancellationToken,
    /// Lines of this relay going on past their first run.
    continuing: Arc<std::sync::atomic::AtomicUsize>,
}

impl Relay {
    /// A relay over `store` publishing `queue` through `sink`.
    pub fn new(
        store: Arc<dyn Store>,
        sink: Arc<dyn Sink>,
        queue: Queue,
        config: RelayConfig,
    ) -> Self {
        Relay {
            shared: Arc::new(Shared {
                store,
                sink,
                queue,
                config,
                stats: Arc::new(RelayStats::default()),
                domains: Mutex::new(Domains::new(config.probe_min, config.probe_max)),
                progress: Notify::new(),
                schema: None,
                stopping: CancellationToken::new(),
                continuing: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            }),
            wake: Arc::new(Notify::new()),
            cadence: ClaimCadence::new(1),
        }
    }

    /// Spaces this relay's claims with the other relays sharing `cadence` (see
    /// `ClaimCadence`). Call before the relay runs.
    pub fn with_cadence(mut self, cadence: &Arc<ClaimCadence>) -> Self {
        self.cadence = cadence.clone();
        self
    }

    /// Records this relay's latencies into the given histograms (shared by the relays
    /// of one process, so that each is exported once). Call before the relay runs.
    pub fn with_latency(mut self, cycle: &Latency, publish: &Latency) -> Self {
        let shared = Arc::get_mut(&mut self.shared).expect("with_latency before the relay runs");
        let stats = Arc::get_mut(&mut shared.stats).expect("with_latency before stats() is taken");
        stats.cycle_latency = cycle.clone();
        stats.publish_latency = publish.clone();
        self
    }

    /// Claims only while `gate` allows this binary on the database's schema. Call before
    /// the relay runs.
    pub fn with_schema(mut self, gate: SchemaGate) -> Self {
        let shared = Arc::get_mut(&mut self.shared).expect("with_schema before the relay runs");
        shared.schema = Some(gate);
        self
    }

    /// The handle that wakes this relay early (new events were committed).
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// The relay's counters.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.shared.stats.clone()
    }

    /// Claims and runs one cycle to its end. Public so tests can count cycles exactly; a
    /// topic that looks down is probed at once rather than after its pause.
    pub async fn cycle(&mut self) -> Result<CycleReport, StoreError> {
        let token: i64 = rand::rng().random();
        let claim = self.shared.claim(token).await?;
        self.shared
            .clone()
            .run_cycle(claim, false, ActiveSlot::detached())
            .await
    }

    /// Runs cycles until `shutdown`. Cycles in progress complete (their deliveries are
    /// bounded by the sink's timeout) so that they settle and release what they claimed.
    pub async fn run(self, shutdown: CancellationToken) {
        let shared = self.shared;
        let config = shared.config;
        let mut db_backoff = ProbeBackoff::new(config.probe_min, config.probe_max);
        let mut cycles: JoinSet<Result<CycleReport, StoreError>> = JoinSet::new();
        // Cycles still delivering their first lines. A cycle that has settled some lines
        // and only waits on slow ones (a topic that is down) no longer counts, so it
        // does not hold the healthy topics back; `MAX_PARKED` bounds those.
        let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // Claim at once, then again whenever a cycle ended or settled something, a
        // wake-up came or the poll interval passed; after a claim that hit no limit, not
        // before `claim_spacing` (`due` holds the time it is due). An empty claim is not
        // spaced from: the next event found nothing in flight to wait with.
        let mut want = true;
        let mut pause = config.poll_interval;
        let mut spaced_from: Option<tokio::time::Instant> = None;
        let mut due: Option<tokio::time::Instant> = None;
        while !shutdown.is_cancelled() {
            if want
                && active.load(Ordering::Relaxed) < config.max_cycles_in_flight.max(1)
                && cycles.len() < MAX_PARKED
            {
                want = false;
                due = None;
                let began = tokio::time::Instant::now();
                pause = config.poll_interval;
                let token: i64 = rand::rng().random();
                match shared.claim_if_allowed(token).await {
                    Ok(claim) if claim.keyed.is_empty() && claim.unkeyed.is_empty() => {
                        db_backoff.succeeded();
                        spaced_from = None;
                    }
                    Ok(claim) => {
                        db_backoff.succeeded();
                        spaced_from = (!shared.filled(&claim)).then_some(began);
                        if spaced_from.is_some() {
                            self.cadence.began(began);
                        }
                        let slot = ActiveSlot::take(&active);
                        cycles.spawn(shared.clone().run_cycle(claim, true, slot));
                    }
                    Err(e) => {
                        pause = db_backoff.failed(&mut rand::rng());
                        tracing::warn!(error = %e, pause_ms = millis(pause), "relay claim failed");
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(done) = cycles.join_next(), if !cycles.is_empty() => {
                    match done {
                        Ok(Ok(_)) => spaced(&mut want, &mut due, self.cadence.next_claim(spaced_from, config.claim_spacing)),
                        Ok(Err(e)) => {
                            pause = db_backoff.failed(&mut rand::rng());
                            tracing::warn!(error = %e, pause_ms = millis(pause), "relay cycle failed");
                        }
                        Err(e) => tracing::error!(error = %e, "relay cycle panicked"),
                    }
                }
                _ = shared.progress.notified() => spaced(&mut want, &mut due, self.cadence.next_claim(spaced_from, config.claim_spacing)),
                _ = self.wake.notified() => spaced(&mut want, &mut due, self.cadence.next_claim(spaced_from, config.claim_spacing)),
                _ = async { tokio::time::sleep_until(due.expect("set")).await }, if due.is_some() => {
                    // Another relay may have claimed since the timer was set.
                    due = None;
                    spaced(&mut want, &mut due, self.cadence.next_claim(spaced_from, config.claim_spacing));
                }
                _ = tokio::time::sleep(pause) => want = true,
            }
        }
        shared.stopping.cancel();
        while let Some(done) = cycles.join_next().await {
            if let Ok(Err(e)) = done {
                tracing::warn!(error = %e, "relay cycle failed during shutdown");
            }
        }
    }
}

/// Cycles one relay keeps in flight at most, counting those that only wait on slow lines.
const MAX_PARKED: usize = 64;

/// The earlier of two optional times.
fn earliest<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A place counted in a shared counter, given back when released or dropped: a cycle's
/// among the relay's active cycles (until it has settled something, or ends), or a
/// continued line's among those of the relay.
struct ActiveSlot(Option<Arc<std::sync::atomic::AtomicUsize>>);

impl ActiveSlot {
    fn take(active: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        active.fetch_add(1, Ordering::Relaxed);
        ActiveSlot(Some(active.clone()))
    }
    fn detached() -> Self {
        ActiveSlot(None)
    }
    fn release(&mut self) {
        if let Some(a) = self.0.take() {
            a.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for ActiveSlot {
    fn drop(&mut self) {
        self.release();
    }
}

/// A duration in whole milliseconds for a log field, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

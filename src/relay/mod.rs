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

pub mod backoff;
pub mod domains;
pub mod pauses;
pub mod plan;
mod stats;

pub use stats::{CycleReport, LATENCY_BUCKETS, Latency, RelayStats};

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::RngExt;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::domain::{EventId, Queue};
use crate::schema::SchemaGate;
use crate::sink::{Delivery, Sink};
use crate::store::{
    Claim, ClaimLimits, Continued, EventUpdate, KeyRelease, LineKey, Readiness, Renewal,
    Settlement, Store, StoreError,
};
use backoff::{ProbeBackoff, RetryPolicy};
use domains::{Domains, Gate};
use plan::{LinePlan, Stop, plan_line, plan_single};

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

/// When the relays of one box in this process last began a claim that took all there
/// was, so that they space such claims between them and not only each its own: with the
/// spacing `s` and `n` relays, a relay's next claim waits until `s` after its own last
/// one and `s / n` after anyone's. Without it the relays' claims fell close together
/// (one relay's claim, then the other's on the next commit), and an event committed
/// after both waited nearly a whole spacing (docs/relay.md, "Claim spacing").
#[derive(Debug)]
pub struct ClaimCadence {
    relays: u32,
    last: Mutex<Option<tokio::time::Instant>>,
}

impl ClaimCadence {
    /// A cadence for `relays` relays (at least one).
    pub fn new(relays: usize) -> Arc<Self> {
        Arc::new(ClaimCadence {
            relays: u32::try_from(relays.max(1)).unwrap_or(u32::MAX),
            last: Mutex::new(None),
        })
    }

    /// A claim that took all there was began at `at`.
    fn began(&self, at: tokio::time::Instant) {
        let mut last = self.last.lock().expect("cadence lock");
        *last = Some(last.map_or(at, |l| l.max(at)));
    }

    /// When a relay whose last claim took all there was and began at `own` may claim
    /// again (`None`: at once).
    fn next_claim(
        &self,
        own: Option<tokio::time::Instant>,
        spacing: Duration,
    ) -> Option<tokio::time::Instant> {
        let own = own? + spacing;
        let anyone = *self.last.lock().expect("cadence lock");
        Some(anyone.map_or(own, |t| own.max(t + spacing / self.relays)))
    }
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

/// A line goes on past its first run when that run held at least this fraction of a full
/// run (`RelayConfig::max_run`).
const CONTINUE_FRACTION: usize = 8;

/// Lines one relay continues at a time at most; the other deep lines are released after
/// their run, as before, and go back in the ready order.
const MAX_CONTINUING: usize = 2;

/// The longest run of a continued line after its first. Shorter than a claim's runs:
/// the next run waits for the whole of this one to be acknowledged, and the time that
/// takes is the pause between the two.
const CONTINUED_RUN: u32 = 1000;

/// What a settle writes, decided before its transaction.
struct Decided {
    updates: Vec<EventUpdate>,
    releases: Vec<KeyRelease>,
    /// Events the sink published after an earlier event of their run failed.
    out_of_order: usize,
    /// Events that came back transient.
    transient_events: usize,
}

/// A finished line to settle: its deliveries, the lease to keep (`None`: release) and
/// the earliest delayed schedule an earlier run of the line passed.
type Finished<'o, 'a> = (
    &'o Outgoing<'a>,
    Vec<Delivery>,
    Option<Duration>,
    Option<chrono::DateTime<chrono::Utc>>,
);

/// Something asks for a claim: it is wanted at once, or (the last claim took all there
/// was) at `next`, a timer set in `due` (`ClaimCadence::next_claim`).
fn spaced(
    want: &mut bool,
    due: &mut Option<tokio::time::Instant>,
    next: Option<tokio::time::Instant>,
) {
    match next {
        Some(at) if tokio::time::Instant::now() < at => {
            due.get_or_insert(at);
        }
        _ => *want = true,
    }
}

/// Whether a continued line's next window has events to send now.
fn has_run(c: &Continued) -> bool {
    !plan_line(&c.window, c.now, usize::MAX).run.is_empty()
}

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

/// One line of a cycle that goes to the sink.
struct Outgoing<'a> {
    plan: LinePlan<'a>,
    /// The sink's fault domain of the line (a topic, or a Kafka partition).
    domain: String,
    probe: bool,
}

impl Shared {
    fn limits(&self) -> ClaimLimits {
        let c = &self.config;
        ClaimLimits {
            max_keys: c.max_keys.clamp(1, c.batch_size),
            max_events: c.batch_size,
            max_run: c.max_run,
            max_unkeyed: c.batch_size,
            max_bytes: c.max_bytes,
            lease: c.lease,
        }
    }

    /// The claim, in a debug-level database span (exported with
    /// `MAILROOM_TRACE_FILTER=mailroom=debug`: relays claim every poll interval).
    async fn claim(&self, token: i64) -> Result<Claim, StoreError> {
        let span = self.db_span("claim", 0);
        let claim = self.store.claim(&self.queue, token, self.limits());
        tracing::Instrument::instrument(claim, span).await
    }

    /// A debug-level database span for this relay's `operation` on its box's events
    /// (none, and nothing formatted, unless debug spans are wanted).
    fn db_span(&self, operation: &str, batch: usize) -> tracing::Span {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return tracing::Span::none();
        }
        let table = match self.queue.box_kind() {
            crate::domain::BoxKind::Outbox => "outbox_events",
            crate::domain::BoxKind::Inbox => "inbox_events",
        };
        crate::telemetry::db_span(
            tracing::Level::DEBUG,
            self.store.engine(),
            &format!("{operation} {table}"),
            operation,
            table,
            batch,
        )
    }

    /// A claim, or an empty one while the schema gate says no (the gate logs that once;
    /// the relay looks again after its poll interval).
    async fn claim_if_allowed(&self, token: i64) -> Result<Claim, StoreError> {
        match &self.schema {
            Some(gate) if !gate.allows().await => Ok(Claim {
                token,
                now: chrono::Utc::now(),
                keyed: Vec::new(),
                unkeyed: Vec::new(),
            }),
            _ => self.claim(token).await,
        }
    }

    /// Plans a claim, delivers its lines and settles each as it finishes.
    /// `honour_probe_pause`: a topic that looks down waits out its pause (the relay's
    /// loop) instead of being probed at once (a cycle run by hand).
    async fn run_cycle(
        self: Arc<Self>,
        claim: Claim,
        honour_probe_pause: bool,
        mut slot: ActiveSlot,
    ) -> Result<CycleReport, StoreError> {
        let started = Instant::now();
        let token = claim.token;
        self.stats.cycles.fetch_add(1, Ordering::Relaxed);
        let mut report = CycleReport {
            keys: claim.keyed.len(),
            ..Default::default()
        };
        let (plans, mut idle) = self.plan_claim(&claim);
        let (out, held_unkeyed) = self.gate_lines(plans, honour_probe_pause, &mut idle);
        self.give_back_held(token, &idle, &held_unkeyed).await?;
        if out.is_empty() {
            return Ok(report);
        }
        if out.iter().all(|o| o.probe) {
            // Only probes of domains that look down: a dead partition that never answers
            // would hold the slot until the delivery deadline, and a few of them would
            // stop the relay from claiming for every topic. Probes are bounded anyway
            // (one per domain in flight, and `MAX_PARKED`).
            slot.release();
        }
        report.attempted = out.iter().map(|o| o.plan.run.len()).sum();
        let delivered_at = Instant::now();
        let (failed, continued) = self
            .deliver_and_settle(token, &out, &mut report, slot)
            .await;
        self.stats.publish_latency.observe(delivered_at.elapsed());
        if report.attempted > 0 {
            self.stats.cycle_latency.observe(started.elapsed());
        }
        // Continued lines accounted for each of their runs as it settled.
        self.account(&report);
        report.add(&continued);
        match failed {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Whether a claim hit one of its limits (keys, events, a window cut): a backlog
    /// likely remains, so the next claim is not spaced (`RelayConfig::claim_spacing`).
    fn filled(&self, claim: &Claim) -> bool {
        let limits = self.limits();
        let events: usize = claim.keyed.iter().map(|w| w.rows.len()).sum();
        claim.keyed.len() >= limits.max_keys as usize
            || events >= limits.max_events as usize
            || claim.keyed.iter().any(|w| w.full)
            || claim.unkeyed.len() >= limits.max_unkeyed as usize
    }

    /// Plans every line of a claim, the event budget shared in claim order; keys with
    /// nothing to publish now come back as releases.
    fn plan_claim<'a>(&self, claim: &'a Claim) -> (Vec<LinePlan<'a>>, Vec<KeyRelease>) {
        let mut budget = self.limits().max_events as usize;
        let mut plans: Vec<LinePlan<'_>> = Vec::new();
        let mut idle = Vec::new();
        for w in &claim.keyed {
            let p = plan_line(w, claim.now, budget);
            budget -= p.run.len();
            if p.run.is_empty() {
                idle.push(KeyRelease {
                    line: w.line.clone(),
                    ready: p.readiness_untouched(),
                    completed: Vec::new(),
                    keep: None,
                });
            } else {
                plans.push(p);
            }
        }
        plans.extend(claim.unkeyed.iter().map(plan_single));
        (plans, idle)
    }

    /// Gates each line by its topic's health: open lines go out, a topic due for a
    /// probe sends one event, a topic that is down holds its lines (keys released with
    /// the wait; unkeyed events returned by how long they wait, one entry per wait).
    fn gate_lines<'a>(
        &self,
        plans: Vec<LinePlan<'a>>,
        honour_probe_pause: bool,
        idle: &mut Vec<KeyRelease>,
    ) -> (Vec<Outgoing<'a>>, HashMap<Duration, Vec<EventId>>) {
        let mut out: Vec<Outgoing<'_>> = Vec::with_capacity(plans.len());
        let mut held_unkeyed: HashMap<Duration, Vec<EventId>> = HashMap::new();
        let now = Instant::now();
        let mut domains = self.domains.lock().expect("domains lock");
        for mut plan in plans {
            let domain = self.sink.domain(plan.run[0]);
            match domains.gate(&domain, now, honour_probe_pause) {
                Gate::Open => out.push(Outgoing {
                    plan,
                    domain,
                    probe: false,
                }),
                Gate::Probe => {
                    plan.run.truncate(1);
                    plan.stop = Stop::Budget;
                    out.push(Outgoing {
                        plan,
                        domain,
                        probe: true,
                    });
                }
                Gate::Closed { until } => {
                    let wait = until.saturating_duration_since(now);
                    self.stats.held_back.fetch_add(1, Ordering::Relaxed);
                    match plan.line {
                        Some(line) => idle.push(KeyRelease {
                            line: line.clone(),
                            ready: Readiness {
                                after: Some(wait),
                                ..Default::default()
                            },
                            completed: Vec::new(),
                            keep: None,
                        }),
                        None => held_unkeyed.entry(wait).or_default().push(plan.run[0].id),
                    }
                }
            }
        }
        (out, held_unkeyed)
    }

    /// Keys with nothing to publish go back at once, not after the delivery; unkeyed
    /// events of a topic that is down stay claimed until it is due for a probe.
    async fn give_back_held(
        &self,
        token: i64,
        idle: &[KeyRelease],
        held_unkeyed: &HashMap<Duration, Vec<EventId>>,
    ) -> Result<(), StoreError> {
        if !idle.is_empty() {
            self.store
                .settle(Settlement::new(&self.queue, token, &[], idle))
                .await?;
        }
        for (wait, ids) in held_unkeyed {
            self.store
                .renew(Renewal {
                    queue: &self.queue,
                    token,
                    lines: &[],
                    unkeyed: ids,
                    lease: *wait,
                })
                .await?;
        }
        Ok(())
    }

    /// Delivers the lines and settles them as they finish (finished lines linger a
    /// moment to settle together), renewing the leases of those still in flight. The
    /// slot is given back at the first settle. Deep lines go on past their first run
    /// (`continue_line`). Returns the first settle error and what the continued lines
    /// did after their first run.
    async fn deliver_and_settle(
        &self,
        token: i64,
        out: &[Outgoing<'_>],
        report: &mut CycleReport,
        mut slot: ActiveSlot,
    ) -> (Option<StoreError>, CycleReport) {
        let lines: Vec<Vec<&_>> = out.iter().map(|o| o.plan.run.clone()).collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let sink = self.sink.clone();
        let deliver = async move {
            let mut done = |i: usize, d: Vec<Delivery>| {
                let _ = tx.send((i, d));
            };
            sink.deliver_each(&lines, &mut done).await;
        };
        // Deep lines hand their first run's deliveries to a continuation of their own.
        let mut handoff: HashMap<usize, tokio::sync::oneshot::Sender<Vec<Delivery>>> =
            HashMap::new();
        let continued = futures::future::join_all(
            out.iter()
                .enumerate()
                .filter_map(|(i, o)| Some((i, o, self.continues(o)?)))
                .map(|(i, o, permit)| {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    handoff.insert(i, tx);
                    self.continue_line(token, o, rx, permit)
                })
                .collect::<Vec<_>>(),
        );
        let settle_as_done = async {
            let mut outstanding: HashSet<usize> = (0..out.len()).collect();
            let mut finished: Vec<(usize, Vec<Delivery>)> = Vec::new();
            let mut linger: Option<tokio::time::Instant> = None;
            let every = (self.config.lease / 3).max(Duration::from_millis(100));
            let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            let mut first_error = None;
            loop {
                tokio::select! {
                    m = rx.recv() => match m {
                        Some((i, d)) => {
                            outstanding.remove(&i);
                            if let Some(next) = handoff.remove(&i) {
                                let _ = next.send(d);
                                continue;
                            }
                            finished.push((i, d));
                            linger.get_or_insert(tokio::time::Instant::now() + self.config.settle_linger);
                        }
                        None => break,
                    },
                    _ = async { tokio::time::sleep_until(linger.expect("set")).await }, if linger.is_some() => {
                        linger = None;
                        let batch = std::mem::take(&mut finished);
                        if let Err(e) = self.settle_lines(token, out, batch, report).await {
                            first_error.get_or_insert(e);
                        }
                        slot.release();
                        self.progress.notify_one();
                    }
                    _ = renew.tick(), if self.config.renew_leases => {
                        self.renew_outstanding(token, out, &outstanding).await;
                    }
                }
            }
            if !finished.is_empty()
                && let Err(e) = self.settle_lines(token, out, finished, report).await
            {
                first_error.get_or_insert(e);
            }
            // Only continued lines remain: the relay may claim beside them.
            slot.release();
            self.progress.notify_one();
            first_error
        };
        let ((), mut failed, continued) = tokio::join!(deliver, settle_as_done, continued);
        let mut more = CycleReport::default();
        for (r, e) in continued {
            more.add(&r);
            if let Some(e) = e {
                failed.get_or_insert(e);
            }
        }
        (failed, more)
    }

    /// Whether a line goes on past its run in this cycle, with the permit it holds
    /// meanwhile: a keyed line whose window a limit cut while it held a good part of a
    /// full run (deep lines only: every continued run is settled on its own, which a
    /// cycle of many short lines would pay for), while fewer than `MAX_CONTINUING` lines
    /// of this relay go on, unless the relay is stopping. The bound keeps the other keys'
    /// turn: a line that goes on does not go back in the ready order between its runs,
    /// and a continuing cycle no longer counts among the relay's active cycles.
    fn continues(&self, o: &Outgoing<'_>) -> Option<ActiveSlot> {
        let deep = o.plan.line.is_some()
            && !o.probe
            && matches!(o.plan.stop, Stop::Budget | Stop::End { full: true })
            && o.plan.run.len() >= (self.config.max_run as usize / CONTINUE_FRACTION).max(1)
            && self.store.continues_lines(self.queue.box_kind())
            && !self.stopping.is_cancelled();
        if !deep {
            return None;
        }
        let permit = ActiveSlot::take(&self.continuing);
        (self.continuing.load(Ordering::Relaxed) <= MAX_CONTINUING).then_some(permit)
    }

    /// Goes on with a deep line after its first run, keeping its key leased: the next
    /// window (runs of `CONTINUED_RUN`) is read while a run is in flight, and sent as
    /// soon as that run is acknowledged whole; the run's settle (which keeps the lease)
    /// commits behind it, in a lane that applies the line's settles one at a time, in
    /// order, at most one waiting. No run is sent before the one ahead of it is
    /// acknowledged, so the order and the failure rules are a single run's. The line is
    /// released, as any other, after a run that was not delivered whole, when nothing
    /// more is due, when the store says the line cannot go on (`Store::continue_line`),
    /// when a settle failed or when the relay stops. Each run is accounted for as it
    /// settles; returns the sum of the line's runs and the first settle error.
    async fn continue_line(
        &self,
        token: i64,
        first: &Outgoing<'_>,
        deliveries: tokio::sync::oneshot::Receiver<Vec<Delivery>>,
        _permit: ActiveSlot,
    ) -> (CycleReport, Option<StoreError>) {
        let (lane_tx, mut lane_rx) = tokio::sync::mpsc::channel::<(Decided, CycleReport)>(1);
        let failed = std::sync::atomic::AtomicBool::new(false);
        let lane_failed = &failed;
        let lane = async {
            let mut total = CycleReport::default();
            let mut error = None;
            while let Some((decided, mut this)) = lane_rx.recv().await {
                if let Err(e) = self.commit(token, decided, &mut this).await {
                    lane_failed.store(true, Ordering::Relaxed);
                    error.get_or_insert(e);
                }
                self.account(&this);
                total.add(&this);
            }
            (total, error)
        };
        let line = async move {
            let line = first.plan.line.expect("continued lines are keyed");
            let mut next = self.read_on(token, line, &first.plan, None).await;
            // The sink reports every line it was given; without a report, nothing went out.
            let mut d = deliveries
                .await
                .unwrap_or_else(|_| vec![Delivery::NotAttempted; first.plan.run.len()]);
            // The schedules of never-tried delayed events the line's earlier runs passed:
            // the release must still wake the key for them.
            let mut delayed: Option<chrono::DateTime<chrono::Utc>> = None;
            let mut held: Option<Continued> = None;
            loop {
                let current = Outgoing {
                    plan: match &held {
                        None => first.plan.clone(),
                        Some(c) => plan_line(&c.window, c.now, usize::MAX),
                    },
                    domain: first.domain.clone(),
                    probe: false,
                };
                let whole = d.len() == current.plan.run.len()
                    && d.iter().all(|x| matches!(x, Delivery::Delivered));
                let go_on = next.take().filter(|c| {
                    whole
                        && !self.stopping.is_cancelled()
                        && !lane_failed.load(Ordering::Relaxed)
                        && has_run(c)
                });
                let Some(following) = go_on else {
                    let mut last = CycleReport::default();
                    let decided = self.decide(vec![(&current, d, None, delayed)], &mut last);
                    let _ = lane_tx.send((decided, last)).await;
                    return;
                };
                let plan = plan_line(&following.window, following.now, usize::MAX);
                let run = plan.run.clone();
                self.stats.continued.fetch_add(1, Ordering::Relaxed);
                let mut this = CycleReport {
                    attempted: run.len(),
                    ..Default::default()
                };
                let keep = Some(self.config.lease);
                let decided = self.decide(vec![(&current, d, keep, None)], &mut this);
                delayed = earliest(delayed, current.plan.delayed_min);
                let (_, mut delivered, read) = tokio::join!(
                    lane_tx.send((decided, this)),
                    self.sink.deliver(std::slice::from_ref(&run)),
                    self.read_on(token, line, &plan, following.horizon),
                );
                d = delivered.pop().unwrap_or_default();
                next = read;
                drop((run, plan, current));
                held = Some(following);
            }
        };
        let ((), done) = tokio::join!(line, lane);
        done
    }

    /// The line's next window after `plan`'s run, or `None` (released then); `horizon`
    /// is the one the line's last window came with (`Store::continue_line`).
    async fn read_on(
        &self,
        token: i64,
        line: &LineKey,
        plan: &LinePlan<'_>,
        horizon: Option<EventId>,
    ) -> Option<Continued> {
        let after = plan.run.last()?.id;
        let limits = ClaimLimits {
            max_run: self.config.max_run.min(CONTINUED_RUN),
            ..self.limits()
        };
        let read = self
            .store
            .continue_line(&self.queue, token, line, after, horizon, limits);
        match read.await {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e, "could not read a continued line's next run; it is released");
                None
            }
        }
    }

    /// Settles finished lines of `out` in one transaction (`decide`, then `commit`).
    async fn settle_lines(
        &self,
        token: i64,
        out: &[Outgoing<'_>],
        finished: Vec<(usize, Vec<Delivery>)>,
        report: &mut CycleReport,
    ) -> Result<(), StoreError> {
        let finished = finished
            .into_iter()
            .map(|(i, d)| (&out[i], d, None, None))
            .collect();
        let decided = self.decide(finished, report);
        self.commit(token, decided, report).await
    }

    /// What finished lines come to: their event updates and key releases, counted in
    /// `report`; updates the topics' health. Each line comes with its deliveries,
    /// whether its key stays leased (and for how long), and the earliest delayed
    /// schedule an earlier run of the line passed.
    fn decide(&self, finished: Vec<Finished<'_, '_>>, report: &mut CycleReport) -> Decided {
        let mut updates = Vec::new();
        let mut releases = Vec::new();
        let mut out_of_order = 0;
        let mut transient_events = 0;
        {
            let now = Instant::now();
            let mut rng = rand::rng();
            let mut domains = self.domains.lock().expect("domains lock");
            for (o, d, keep, delayed) in &finished {
                let lo = o.plan.settle(d, &self.config.retry, &mut rng);
                report.delivered += lo.delivered;
                report.retried += lo.retried;
                report.failed += lo.failed;
                report.transient |= lo.transient;
                out_of_order += lo.delivered_after_failure;
                let answered = lo.delivered + lo.retried + lo.failed > 0;
                if lo.transient {
                    transient_events += o
                        .plan
                        .run
                        .len()
                        .saturating_sub(lo.delivered + lo.retried + lo.failed);
                }
                if lo.transient && !answered {
                    if let Some(pause) = domains.record(&o.domain, true, now, &mut rng) {
                        tracing::info!(
                            domain = o.domain,
                            pause_ms = millis(pause),
                            "destination unavailable for this domain (topic or partition); probing it again later"
                        );
                    }
                } else if answered {
                    domains.record(&o.domain, false, now, &mut rng);
                } else if o.probe {
                    domains.probe_abandoned(&o.domain);
                }
                if let Some(line) = o.plan.line {
                    let mut ready = lo.ready;
                    ready.at = earliest(ready.at, *delayed);
                    // In run order, which is id order (the store normalises it anyway).
                    let completed: Vec<EventId> = EventUpdate::completed_ids(&lo.updates).collect();
                    releases.push(KeyRelease {
                        line: line.clone(),
                        ready,
                        completed,
                        keep: *keep,
                    });
                }
                updates.extend(lo.updates);
            }
        }
        Decided {
            updates,
            releases,
            out_of_order,
            transient_events,
        }
    }

    /// Applies what `decide` decided, in one transaction.
    async fn commit(
        &self,
        token: i64,
        decided: Decided,
        report: &mut CycleReport,
    ) -> Result<(), StoreError> {
        let Decided {
            updates,
            releases,
            out_of_order,
            transient_events,
        } = decided;
        let span = self.db_span("settle", updates.len());
        let settle = self
            .store
            .settle(Settlement::new(&self.queue, token, &updates, &releases));
        let settled = tracing::Instrument::instrument(settle, span).await?;
        report.stale += settled.stale;
        report.delivered_after_failure += out_of_order;
        report.transient_events += transient_events;
        if settled.stale > 0 {
            tracing::warn!(
                stale = settled.stale,
                "another relay took these events over before the settle; it publishes them now"
            );
        }
        if out_of_order > 0 {
            tracing::warn!(
                count = out_of_order,
                "the sink published events after an earlier event of their key failed; \
                 they are flagged (GetEvent shows it in last_error)"
            );
        }
        Ok(())
    }

    /// Extends the leases of the lines still in flight.
    async fn renew_outstanding(
        &self,
        token: i64,
        out: &[Outgoing<'_>],
        outstanding: &HashSet<usize>,
    ) {
        let mut lines: Vec<LineKey> = Vec::new();
        let mut unkeyed: Vec<EventId> = Vec::new();
        for i in outstanding {
            match out[*i].plan.line {
                Some(l) => lines.push(l.clone()),
                None => unkeyed.push(out[*i].plan.run[0].id),
            }
        }
        if lines.is_empty() && unkeyed.is_empty() {
            return;
        }
        let asked = lines.len() + unkeyed.len();
        match self
            .store
            .renew(Renewal {
                queue: &self.queue,
                token,
                lines: &lines,
                unkeyed: &unkeyed,
                lease: self.config.lease,
            })
            .await
        {
            Ok(held) => {
                self.stats.renewals.fetch_add(1, Ordering::Relaxed);
                if held < asked {
                    self.stats
                        .renewals_lost
                        .fetch_add((asked - held) as u64, Ordering::Relaxed);
                    tracing::warn!(
                        lost = asked - held,
                        "leases of lines still in flight were taken by another relay"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not renew the leases of lines in flight"),
        }
    }

    fn account(&self, report: &CycleReport) {
        let s = &self.stats;
        s.delivered
            .fetch_add(report.delivered as u64, Ordering::Relaxed);
        s.retried
            .fetch_add(report.retried as u64, Ordering::Relaxed);
        s.failed.fetch_add(report.failed as u64, Ordering::Relaxed);
        s.stale.fetch_add(report.stale as u64, Ordering::Relaxed);
        s.delivered_after_failure
            .fetch_add(report.delivered_after_failure as u64, Ordering::Relaxed);
        s.transient_events
            .fetch_add(report.transient_events as u64, Ordering::Relaxed);
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
    }
}

/// A duration in whole milliseconds for a log field, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

//! Prometheus metrics, served as text on a separate HTTP port (`metrics_listen`, path
//! `/metrics`). Labels are bounded: topic (capped, see `TOPIC_LABELS`), gRPC method and
//! code, failure class, status. Never a key or an event id.
//!
//! Sources:
//! - counters the API bumps as requests are answered (enqueued, duplicates, requeued,
//!   cancelled, gRPC requests by method and code via `RpcMetricsLayer`);
//! - the relays' own counters and latency histograms (`RelayStats`), read at scrape time;
//! - backlog gauges (pending and failed per topic, blocked keys, oldest pending age),
//!   refreshed every `metrics_stats_interval` from the store's `stats` query;
//! - retention counters (rows deleted).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;

use crate::domain::BoxKind;
use crate::inbox::InboxHandles;
use crate::relay::RelayStats;
use crate::store::Store;

/// Distinct topic label values at most; later topics are counted under `_other`.
pub const TOPIC_LABELS: usize = 1000;

/// Upper bounds (seconds) of the latency histograms.
const LATENCY_BUCKETS: [f64; 14] = [
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
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }

    /// Whether both handles record into the same histogram.
    pub fn same(&self, other: &Latency) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Encodes the distinct histograms among `hs` as one metric: the shared one as is, or,
/// when relays were built without sharing (tests), one series per histogram under a
/// `relay` label.
fn encode_latencies(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    hs: &[&Latency],
) -> Result<(), std::fmt::Error> {
    let mut distinct: Vec<&Latency> = Vec::new();
    for h in hs {
        if !distinct.iter().any(|d| d.same(h)) {
            distinct.push(h);
        }
    }
    let mut e = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    match distinct.as_slice() {
        [] => Latency::default().0.encode(e),
        [one] => one.0.encode(e),
        many => {
            for (i, h) in many.iter().enumerate() {
                h.0.encode(e.encode_family(&[("relay", i.to_string())])?)?;
            }
            Ok(())
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TopicLabel {
    topic: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabel {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabel {
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: String,
}

/// The process's metrics. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    topics: Mutex<HashSet<String>>,
    enqueued: Family<TopicLabel, Counter>,
    duplicates: Family<TopicLabel, Counter>,
    requeued: Counter,
    cancelled: Counter,
    rpcs: Family<RpcLabel, Counter>,
    rpc_seconds: Family<MethodLabel, Histogram>,
    pending: Family<TopicLabel, Gauge>,
    failed: Family<TopicLabel, Gauge>,
    blocked_keys: Gauge,
    oldest_pending_age: Gauge<f64, AtomicU64>,
    stats_errors: Counter,
    retention_deleted: Family<StatusLabel, Counter>,
    keys_pruned: Counter,
}

/// The relays' counters and histograms, read at scrape time.
#[derive(Debug)]
struct RelayCollector {
    relays: Vec<Arc<RelayStats>>,
}

impl Collector for RelayCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let sum = |f: fn(&RelayStats) -> &AtomicU64| -> u64 {
            self.relays
                .iter()
                .map(|r| f(r).load(Ordering::Relaxed))
                .sum()
        };
        let counter = |e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64| {
            e.encode_descriptor(name, help, None, MetricType::Counter)?
                .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(&v, None)
        };
        counter(
            &mut encoder,
            "mailroom_outbox_published",
            "Events the relays published (acknowledged by the destination).",
            sum(|r| &r.delivered),
        )?;
        counter(
            &mut encoder,
            "mailroom_outbox_failed",
            "Events that used up their attempts (or were rejected) and became failed.",
            sum(|r| &r.failed),
        )?;
        counter(
            &mut encoder,
            "mailroom_relay_cycles",
            "Relay cycles (claims) run.",
            sum(|r| &r.cycles),
        )?;
        counter(
            &mut encoder,
            "mailroom_relay_stale_updates",
            "Settle updates dropped because another relay had taken the key or event over.",
            sum(|r| &r.stale),
        )?;
        counter(
            &mut encoder,
            "mailroom_relay_delivered_after_failure",
            "Events the destination acknowledged after an earlier event of their key failed \
             in the same run (possible reordering; each is flagged in its last_error). \
             Expected to stay 0.",
            sum(|r| &r.delivered_after_failure),
        )?;
        counter(
            &mut encoder,
            "mailroom_relay_held_back_lines",
            "Lines (a key's run, or an unkeyed event) not sent because their topic looked \
             down and was not due for a probe.",
            sum(|r| &r.held_back),
        )?;
        counter(
            &mut encoder,
            "mailroom_relay_lease_renewals",
            "Lease renewals of lines whose delivery outlasted a third of the lease.",
            sum(|r| &r.renewals),
        )?;
        counter(
            &mut encoder,
            "mailroom_relay_leases_lost",
            "Keys or events whose lease another relay took while their delivery was in flight.",
            sum(|r| &r.renewals_lost),
        )?;
        {
            let mut e = encoder.encode_descriptor(
                "mailroom_outbox_retried",
                "Failed delivery attempts that will be retried, by class: counted spends an \
                 attempt and backs off; transient (destination unreachable) spends none.",
                None,
                MetricType::Counter,
            )?;
            let counted = sum(|r| &r.retried);
            let transient = sum(|r| &r.transient_events);
            e.encode_family(&[("class", "counted")])?
                .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                    &counted, None,
                )?;
            e.encode_family(&[("class", "transient")])?
                .encode_counter::<prometheus_client::encoding::NoLabelSet, _, u64>(
                    &transient, None,
                )?;
        }
        encode_latencies(
            &mut encoder,
            "mailroom_relay_cycle_seconds",
            "Duration of relay cycles that published something: claim, delivery, settle.",
            &self
                .relays
                .iter()
                .map(|r| &r.cycle_latency)
                .collect::<Vec<_>>(),
        )?;
        encode_latencies(
            &mut encoder,
            "mailroom_relay_publish_seconds",
            "Duration of one cycle's delivery to the destination (all its runs).",
            &self
                .relays
                .iter()
                .map(|r| &r.publish_latency)
                .collect::<Vec<_>>(),
        )?;
        Ok(())
    }
}

/// The inbox's counters per subscription, read at scrape time. The subscription label is
/// bounded by the configuration.
struct InboxCollector {
    inbox: InboxHandles,
}

impl std::fmt::Debug for InboxCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InboxCollector")
    }
}

impl Collector for InboxCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::NoLabelSet;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut subs: Vec<&String> = self.inbox.dispatch_stats.keys().collect();
        subs.sort();
        {
            let mut e = encoder.encode_descriptor(
                "mailroom_inbox_received",
                "Records the inbox consumers read from Kafka.",
                None,
                MetricType::Counter,
            )?;
            for s in &subs {
                if let Some(i) = self.inbox.intake_stats.get(*s) {
                    e.encode_family(&[("subscription", s.as_str())])?
                        .encode_counter::<NoLabelSet, _, u64>(&load(&i.received), None)?;
                }
            }
        }
        for (name, help, field) in [
            (
                "mailroom_inbox_intake_failed",
                "Records stored as failed at intake: over the inbox limits, or refused by the database and stored stripped.",
                (|i: &crate::inbox::consumer::IntakeStats| i.failed.load(Ordering::Relaxed))
                    as fn(&crate::inbox::consumer::IntakeStats) -> u64,
            ),
            (
                "mailroom_inbox_intake_unstorable",
                "Records the database refused in every form: skipped and logged with their topic, partition and offset.",
                |i| i.unstorable.load(Ordering::Relaxed),
            ),
        ] {
            let mut e = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for s in &subs {
                if let Some(i) = self.inbox.intake_stats.get(*s) {
                    e.encode_family(&[("subscription", s.as_str())])?
                        .encode_counter::<NoLabelSet, _, u64>(&field(i), None)?;
                }
            }
        }
        {
            let mut e = encoder.encode_descriptor(
                "mailroom_inbox_duplicates",
                "Records dropped as duplicates (already in the inbox).",
                None,
                MetricType::Counter,
            )?;
            for s in &subs {
                if let Some(i) = self.inbox.intake_stats.get(*s) {
                    e.encode_family(&[("subscription", s.as_str())])?
                        .encode_counter::<NoLabelSet, _, u64>(&load(&i.duplicates), None)?;
                }
            }
        }
        {
            let mut e = encoder.encode_descriptor(
                "mailroom_inbox_handled",
                "Handler outcomes: completed, retried (counted or deferred), failed \
                 (rejected or out of attempts), transient (handler unreachable).",
                None,
                MetricType::Counter,
            )?;
            for s in &subs {
                let r = &self.inbox.dispatch_stats[*s];
                for (outcome, v) in [
                    ("completed", load(&r.delivered)),
                    ("retried", load(&r.retried)),
                    ("failed", load(&r.failed)),
                    ("transient", load(&r.transient_events)),
                ] {
                    e.encode_family(&[("subscription", s.as_str()), ("outcome", outcome)])?
                        .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
                }
            }
        }
        {
            let mut e = encoder.encode_descriptor(
                "mailroom_inbox_handle_seconds",
                "Duration of one HandlerService.Handle call.",
                None,
                MetricType::Histogram,
            )?;
            for s in &subs {
                if let Some(l) = self.inbox.handler_latency.get(*s) {
                    l.0.encode(e.encode_family(&[("subscription", s.as_str())])?)?;
                }
            }
        }
        Ok(())
    }
}

impl Metrics {
    /// Metrics over the given relays' stats (and the inbox's, when it has subscriptions).
    pub fn new(relays: Vec<Arc<RelayStats>>) -> Metrics {
        Metrics::with_inbox(relays, InboxHandles::default())
    }

    pub fn with_inbox(relays: Vec<Arc<RelayStats>>, inbox: InboxHandles) -> Metrics {
        let mut registry = Registry::default();
        let enqueued = Family::<TopicLabel, Counter>::default();
        let duplicates = Family::<TopicLabel, Counter>::default();
        let requeued = Counter::default();
        let cancelled = Counter::default();
        let rpcs = Family::<RpcLabel, Counter>::default();
        let rpc_seconds =
            Family::<MethodLabel, Histogram>::new_with_constructor(rpc_histogram as fn() -> _);
        let pending = Family::<TopicLabel, Gauge>::default();
        let failed = Family::<TopicLabel, Gauge>::default();
        let blocked_keys = Gauge::default();
        let oldest_pending_age = Gauge::<f64, AtomicU64>::default();
        let stats_errors = Counter::default();
        let retention_deleted = Family::<StatusLabel, Counter>::default();
        let keys_pruned = Counter::default();
        registry.register(
            "mailroom_outbox_enqueued",
            "Events stored by Enqueue/EnqueueBatch, by topic (duplicates not included).",
            enqueued.clone(),
        );
        registry.register(
            "mailroom_outbox_duplicates",
            "Enqueued events answered as duplicates of a stored event (idempotency key), by topic.",
            duplicates.clone(),
        );
        registry.register(
            "mailroom_outbox_requeued",
            "Failed events put back in line by operators.",
            requeued.clone(),
        );
        registry.register(
            "mailroom_outbox_cancelled",
            "Pending events cancelled (made failed) by operators.",
            cancelled.clone(),
        );
        registry.register(
            "mailroom_grpc_requests",
            "gRPC requests answered, by method and status code.",
            rpcs.clone(),
        );
        registry.register(
            "mailroom_grpc_request_seconds",
            "gRPC request latency in the server, by method.",
            rpc_seconds.clone(),
        );
        registry.register(
            "mailroom_outbox_pending",
            "Pending events by topic (refreshed every metrics_stats_interval).",
            pending.clone(),
        );
        registry.register(
            "mailroom_outbox_failed_events",
            "Failed events kept in the outbox by topic (refreshed every metrics_stats_interval).",
            failed.clone(),
        );
        registry.register(
            "mailroom_outbox_blocked_keys",
            "Keys whose head event waits out a retry backoff.",
            blocked_keys.clone(),
        );
        registry.register(
            "mailroom_outbox_oldest_pending_age_seconds",
            "Age of the oldest pending event (0 when none).",
            oldest_pending_age.clone(),
        );
        registry.register(
            "mailroom_stats_errors",
            "Failed refreshes of the backlog gauges.",
            stats_errors.clone(),
        );
        registry.register(
            "mailroom_retention_deleted",
            "Events deleted by retention, by status.",
            retention_deleted.clone(),
        );
        registry.register(
            "mailroom_retention_keys_pruned",
            "Idle key rows deleted by retention.",
            keys_pruned.clone(),
        );
        registry.register_collector(Box::new(RelayCollector { relays }));
        if !inbox.dispatch_stats.is_empty() {
            registry.register_collector(Box::new(InboxCollector { inbox }));
        }
        Metrics {
            inner: Arc::new(Inner {
                registry,
                topics: Mutex::new(HashSet::new()),
                enqueued,
                duplicates,
                requeued,
                cancelled,
                rpcs,
                rpc_seconds,
                pending,
                failed,
                blocked_keys,
                oldest_pending_age,
                stats_errors,
                retention_deleted,
                keys_pruned,
            }),
        }
    }

    /// The label for a topic: itself while fewer than `TOPIC_LABELS` are known.
    fn topic(&self, topic: &str) -> TopicLabel {
        let mut known = self.inner.topics.lock().expect("topics lock");
        let topic = if known.contains(topic) {
            topic.to_string()
        } else if known.len() < TOPIC_LABELS {
            known.insert(topic.to_string());
            topic.to_string()
        } else {
            "_other".to_string()
        };
        TopicLabel { topic }
    }

    pub fn enqueued(&self, topic: &str, inserted: u64, duplicates: u64) {
        let t = self.topic(topic);
        if inserted > 0 {
            self.inner.enqueued.get_or_create(&t).inc_by(inserted);
        }
        if duplicates > 0 {
            self.inner.duplicates.get_or_create(&t).inc_by(duplicates);
        }
    }

    pub fn requeued(&self, n: u64) {
        self.inner.requeued.inc_by(n);
    }

    pub fn cancelled(&self, n: u64) {
        self.inner.cancelled.inc_by(n);
    }

    pub fn retention_deleted(&self, status: &str, n: u64) {
        self.inner
            .retention_deleted
            .get_or_create(&StatusLabel {
                status: status.into(),
            })
            .inc_by(n);
    }

    pub fn keys_pruned(&self, n: u64) {
        self.inner.keys_pruned.inc_by(n);
    }

    /// Counts one RPC by method and gRPC code, with its latency.
    /// (`method` is the request path; see `known_method`.)
    pub fn rpc(&self, method: &str, code: tonic::Code, elapsed: Duration) {
        // Only the methods this server serves become labels: whatever path a caller
        // invents (answered UNIMPLEMENTED, or UNAUTHENTICATED before routing) is `unknown`.
        let method = if code == tonic::Code::Unimplemented || !known_method(method) {
            "unknown"
        } else {
            method
        };
        self.inner
            .rpcs
            .get_or_create(&RpcLabel {
                method: method.to_string(),
                code: code_name(code).to_string(),
            })
            .inc();
        self.inner
            .rpc_seconds
            .get_or_create(&MethodLabel {
                method: method.to_string(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// Refreshes the backlog gauges from the store.
    pub async fn refresh_stats(&self, store: &dyn Store) {
        match store.stats(BoxKind::Outbox, None).await {
            Ok(s) => {
                let i = &self.inner;
                i.pending.clear();
                i.failed.clear();
                for t in &s.topics {
                    let l = self.topic(&t.topic);
                    i.pending.get_or_create(&l).inc_by(t.pending);
                    i.failed.get_or_create(&l).inc_by(t.failed);
                }
                i.blocked_keys.set(s.blocked_keys);
                i.oldest_pending_age
                    .set(s.oldest_pending_age.map(|d| d.as_secs_f64()).unwrap_or(0.0));
            }
            Err(e) => {
                self.inner.stats_errors.inc();
                tracing::warn!(error = %e, "refreshing the backlog metrics failed");
            }
        }
    }

    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.inner.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// Serves `/metrics` on `listener` until `shutdown`.
    pub async fn serve(self, listener: tokio::net::TcpListener, shutdown: CancellationToken) {
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let m = self.clone();
                async move {
                    (
                        [(
                            http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        m.encode(),
                    )
                }
            }),
        );
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
        {
            tracing::error!(error = %e, "metrics server failed");
        }
    }

    /// Refreshes the backlog gauges every `interval` until `shutdown`.
    pub async fn poll_stats(
        self,
        store: Arc<dyn Store>,
        interval: Duration,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::timeout(interval.max(Duration::from_secs(5)), self.refresh_stats(store.as_ref())) => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}

/// The gRPC name of a status code (`OK`, `UNAVAILABLE`), as gRPC's own tools and
/// OpenTelemetry's `rpc.grpc.status_code` spell it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Checks every histogram of a text exposition: per series (labels other than `le`),
/// bucket counts never decrease with `le`, a `+Inf` bucket exists and equals `_count`.
/// Returns the number of series checked, or the problems found.
pub fn check_histograms(text: &str) -> Result<usize, Vec<String>> {
    use std::collections::BTreeMap;
    let mut histograms = HashSet::new();
    for l in text.lines() {
        let mut w = l.split_whitespace();
        if let (Some("#"), Some("TYPE"), Some(name), Some("histogram")) =
            (w.next(), w.next(), w.next(), w.next())
        {
            histograms.insert(name.to_string());
        }
    }
    // (name, other labels) -> (buckets by le, count)
    type Series = (Vec<(f64, f64)>, Option<f64>);
    let mut series: BTreeMap<(String, String), Series> = BTreeMap::new();
    let mut problems = Vec::new();
    for l in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let (head, value) = match l.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let value: f64 = match value.parse() {
            Ok(v) => v,
            Err(_) => {
                problems.push(format!("unparsable sample: {l}"));
                continue;
            }
        };
        let (name, labels) = match head.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (head, ""),
        };
        let (base, suffix) = match name.rsplit_once('_') {
            Some(x) => x,
            None => continue,
        };
        if !histograms.contains(base) {
            continue;
        }
        let mut le = None;
        let others: Vec<&str> = labels
            .split(',')
            .filter(|p| !p.is_empty())
            .filter(|p| match p.strip_prefix("le=") {
                Some(v) => {
                    le = Some(v.trim_matches('"').to_string());
                    false
                }
                None => true,
            })
            .collect();
        let entry = series
            .entry((base.to_string(), others.join(",")))
            .or_default();
        match (suffix, le) {
            ("bucket", Some(le)) => {
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap_or(f64::NAN)
                };
                entry.0.push((bound, value));
            }
            ("count", None) => entry.1 = Some(value),
            _ => {}
        }
    }
    for ((name, labels), (mut buckets, count)) in series.iter().map(|(k, v)| (k, v.clone())) {
        let id = format!("{name}{{{labels}}}");
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        if buckets.windows(2).any(|w| w[1].1 < w[0].1) {
            problems.push(format!("{id}: bucket counts decrease: {buckets:?}"));
        }
        match (buckets.last(), count) {
            (Some((b, inf)), Some(c)) if b.is_infinite() => {
                if *inf != c {
                    problems.push(format!("{id}: +Inf bucket {inf} != _count {c}"));
                }
            }
            _ => problems.push(format!("{id}: no +Inf bucket or no _count")),
        }
    }
    if problems.is_empty() {
        Ok(series.len())
    } else {
        Err(problems)
    }
}

fn rpc_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Whether `path` (`/package.Service/Method`) is a method this server serves: the
/// mailroom services, health and reflection, read from their descriptor sets once.
pub fn known_method(path: &str) -> bool {
    use prost::Message as _;
    static KNOWN: std::sync::OnceLock<HashSet<String>> = std::sync::OnceLock::new();
    KNOWN
        .get_or_init(|| {
            let mut known = HashSet::new();
            for set in [
                crate::pb::FILE_DESCRIPTOR_SET,
                tonic_health::pb::FILE_DESCRIPTOR_SET,
            ] {
                let Ok(set) = prost_types::FileDescriptorSet::decode(set) else {
                    continue;
                };
                for f in set.file {
                    let pkg = f.package.unwrap_or_default();
                    for svc in f.service {
                        let name = svc.name.unwrap_or_default();
                        for m in svc.method {
                            known.insert(format!("/{pkg}.{name}/{}", m.name.unwrap_or_default()));
                        }
                    }
                }
            }
            for v in ["v1", "v1alpha"] {
                known.insert(format!(
                    "/grpc.reflection.{v}.ServerReflection/ServerReflectionInfo"
                ));
            }
            known
        })
        .contains(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_once() {
        // Two relays sharing their histograms (as the app builds them), and a third on
        // its own: exported as one series and as per-relay series respectively.
        let shared = Arc::new(RelayStats::default());
        let observe = |l: &Latency| {
            l.observe(Duration::from_micros(300));
            l.observe(Duration::from_millis(3));
            l.observe(Duration::from_millis(30));
            l.observe(Duration::from_secs(100));
        };
        observe(&shared.cycle_latency);
        observe(&shared.cycle_latency);
        observe(&shared.publish_latency);
        let m = Metrics::new(vec![shared.clone(), shared.clone()]);
        m.rpc(
            "/mailroom.v1.OutboxService/Enqueue",
            tonic::Code::Ok,
            Duration::from_millis(2),
        );
        m.rpc(
            "/mailroom.v1.OutboxService/Enqueue",
            tonic::Code::Unavailable,
            Duration::from_secs(20),
        );
        let text = m.encode();
        assert_eq!(check_histograms(&text), Ok(3), "{text}");
        assert!(
            text.contains("mailroom_relay_cycle_seconds_bucket{le=\"+Inf\"} 8\n")
                && text.contains("mailroom_relay_cycle_seconds_count 8\n")
                && text.contains("mailroom_relay_cycle_seconds_bucket{le=\"0.005\"} 4\n"),
            "{text}"
        );
        assert!(text.contains("mailroom_grpc_requests_total{method=\"/mailroom.v1.OutboxService/Enqueue\",code=\"OK\"} 1"));
        assert!(text.contains("code=\"UNAVAILABLE\"} 1"), "{text}");

        let apart = Arc::new(RelayStats::default());
        observe(&apart.cycle_latency);
        let m = Metrics::new(vec![shared, apart]);
        let text = m.encode();
        assert_eq!(check_histograms(&text), Ok(4), "{text}");
        assert!(text.contains("mailroom_relay_cycle_seconds_count{relay=\"1\"} 4"));

        // The checker itself catches the old double accumulation.
        let bad = "# TYPE x histogram\nx_sum 1\nx_count 2\nx_bucket{le=\"1\"} 1\nx_bucket{le=\"+Inf\"} 3\n";
        assert!(check_histograms(bad).is_err());
        let bad = "# TYPE x histogram\nx_count 2\nx_bucket{le=\"1\"} 3\nx_bucket{le=\"+Inf\"} 2\n";
        assert!(check_histograms(bad).is_err());
    }

    #[test]
    fn only_served_methods_are_labels() {
        assert!(known_method("/mailroom.v1.OutboxService/Enqueue"));
        assert!(known_method("/mailroom.v1.AdminService/GetStats"));
        assert!(known_method("/grpc.health.v1.Health/Check"));
        assert!(known_method(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
        ));
        assert!(!known_method("/mailroom.v1.OutboxService/Nope"));
        assert!(!known_method("/evil.Service/x1"));
    }

    #[test]
    fn topic_labels_are_bounded() {
        let m = Metrics::new(vec![]);
        for i in 0..TOPIC_LABELS + 10 {
            m.enqueued(&format!("t{i}"), 1, 0);
        }
        let text = m.encode();
        assert!(text.contains("mailroom_outbox_enqueued_total{topic=\"_other\"} 10"));
        assert!(text.contains("mailroom_outbox_published_total 0"));
        assert!(text.contains("mailroom_relay_cycle_seconds_bucket"));
    }
}

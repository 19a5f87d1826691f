//! Prometheus metrics, served as text on a separate HTTP port (`metrics_listen`, path
//! `/metrics`). Labels are bounded: topic (capped, see `TOPIC_LABELS`), gRPC method and
//! code, failure class, status. Never a key or an event id.
//!
//! Sources:
//! - counters the API bumps as requests are answered (enqueued, duplicates, requeued,
//!   cancelled, gRPC requests by method and code via `api::layers::RpcLogLayer`);
//! - the relays' own counters and latency histograms (`RelayStats`), read at scrape time;
//! - backlog gauges (pending and failed per topic, blocked keys, oldest pending age),
//!   refreshed every `metrics_stats_interval` from the store's `stats` query;
//! - retention counters (rows deleted).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;

mod collectors;
mod exposition;

pub use exposition::check_histograms;

use crate::domain::BoxKind;
use crate::inbox::InboxHandles;
use crate::relay::RelayStats;
use crate::store::Store;
use collectors::{InboxCollector, PoolCollector, RelayCollector, SchemaCollector};

/// Distinct topic label values at most; later topics are counted under `_other`.
pub const TOPIC_LABELS: usize = 1000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TopicLabel {
    topic: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubTopicLabel {
    subscription: String,
    topic: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubscriptionLabel {
    subscription: String,
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

/// Sets a gauge family to `values`: each series is set in place and only the series no
/// longer present are removed, so a scrape during a refresh never sees the family empty
/// (a clear-then-fill left a window with no series). `labels` remembers the series set.
fn replace_series<L>(family: &Family<L, Gauge>, labels: &mut HashSet<L>, values: HashMap<L, i64>)
where
    L: Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug,
{
    for (l, v) in &values {
        family.get_or_create(l).set(*v);
    }
    for gone in labels.iter().filter(|l| !values.contains_key(*l)) {
        family.remove(gone);
    }
    *labels = values.into_keys().collect();
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
    republished: Counter,
    rpcs: Family<RpcLabel, Counter>,
    rpc_seconds: Family<MethodLabel, Histogram>,
    pending: Family<TopicLabel, Gauge>,
    failed: Family<TopicLabel, Gauge>,
    paused: Family<TopicLabel, Gauge>,
    /// The series each backlog family holds (`replace_series`).
    pending_labels: Mutex<HashSet<TopicLabel>>,
    failed_labels: Mutex<HashSet<TopicLabel>>,
    paused_labels: Mutex<HashSet<TopicLabel>>,
    /// The inbox's backlog, refreshed with the outbox's when it has subscriptions.
    inbox: bool,
    inbox_pending: Family<SubTopicLabel, Gauge>,
    inbox_failed: Family<SubTopicLabel, Gauge>,
    inbox_pending_labels: Mutex<HashSet<SubTopicLabel>>,
    inbox_failed_labels: Mutex<HashSet<SubTopicLabel>>,
    inbox_paused: Family<SubscriptionLabel, Gauge>,
    inbox_paused_labels: Mutex<HashSet<SubscriptionLabel>>,
    inbox_oldest_pending_age: Gauge<f64, AtomicU64>,
    blocked_keys: Gauge,
    oldest_pending_age: Gauge<f64, AtomicU64>,
    stats_errors: Counter,
    retention_deleted: Family<StatusLabel, Counter>,
    keys_pruned: Counter,
}

impl Inner {
    /// Registers the inbox's backlog gauges (with subscriptions only).
    fn register_inbox_backlog(&mut self) {
        let r = &mut self.registry;
        r.register(
            "mailroom_inbox_pending",
            "Pending inbox messages by subscription and topic (refreshed every metrics_stats_interval).",
            self.inbox_pending.clone(),
        );
        r.register(
            "mailroom_inbox_failed_events",
            "Failed inbox messages kept, by subscription and topic (refreshed every metrics_stats_interval).",
            self.inbox_failed.clone(),
        );
        r.register(
            "mailroom_inbox_subscription_paused",
            "1 for each paused inbox subscription (PauseSubscription; refreshed every metrics_stats_interval).",
            self.inbox_paused.clone(),
        );
        r.register(
            "mailroom_inbox_oldest_pending_age_seconds",
            "Age of the oldest pending inbox message (0 when none).",
            self.inbox_oldest_pending_age.clone(),
        );
    }

    /// Registers the metrics this process updates itself.
    fn register_own(&mut self) {
        let r = &mut self.registry;
        r.register(
            "mailroom_outbox_enqueued",
            "Events stored by Enqueue/EnqueueBatch, by topic (duplicates not included).",
            self.enqueued.clone(),
        );
        r.register(
            "mailroom_outbox_duplicates",
            "Enqueued events answered as duplicates of a stored event (idempotency key), by topic.",
            self.duplicates.clone(),
        );
        r.register(
            "mailroom_outbox_requeued",
            "Failed events put back in line by operators.",
            self.requeued.clone(),
        );
        r.register(
            "mailroom_outbox_cancelled",
            "Pending events cancelled (made failed) by operators.",
            self.cancelled.clone(),
        );
        r.register(
            "mailroom_outbox_republished",
            "Completed events published again as new events by operators (RepublishEvents).",
            self.republished.clone(),
        );
        r.register(
            "mailroom_grpc_requests",
            "gRPC requests answered, by method and status code.",
            self.rpcs.clone(),
        );
        r.register(
            "mailroom_grpc_request_seconds",
            "gRPC request latency in the server, by method.",
            self.rpc_seconds.clone(),
        );
        r.register(
            "mailroom_outbox_pending",
            "Pending events by topic (refreshed every metrics_stats_interval).",
            self.pending.clone(),
        );
        r.register(
            "mailroom_outbox_failed_events",
            "Failed events kept in the outbox by topic (refreshed every metrics_stats_interval).",
            self.failed.clone(),
        );
        r.register(
            "mailroom_outbox_topic_paused",
            "1 for each paused outbox topic (PauseTopic; refreshed every metrics_stats_interval).",
            self.paused.clone(),
        );
        r.register(
            "mailroom_outbox_blocked_keys",
            "Keys whose head event waits out a retry backoff.",
            self.blocked_keys.clone(),
        );
        r.register(
            "mailroom_outbox_oldest_pending_age_seconds",
            "Age of the oldest pending event (0 when none).",
            self.oldest_pending_age.clone(),
        );
        r.register(
            "mailroom_stats_errors",
            "Failed refreshes of the backlog gauges.",
            self.stats_errors.clone(),
        );
        r.register(
            "mailroom_retention_deleted",
            "Events deleted by retention, by status.",
            self.retention_deleted.clone(),
        );
        r.register(
            "mailroom_retention_keys_pruned",
            "Idle key rows deleted by retention.",
            self.keys_pruned.clone(),
        );
    }
}

impl Metrics {
    /// Metrics over the given relays' stats (and the inbox's, when it has subscriptions).
    pub fn new(relays: Vec<Arc<RelayStats>>) -> Metrics {
        Metrics::with_inbox(relays, InboxHandles::default())
    }

    /// Metrics over the relays' stats and the inbox's handles.
    pub fn with_inbox(relays: Vec<Arc<RelayStats>>, inbox: InboxHandles) -> Metrics {
        Metrics::build(relays, inbox, None)
    }

    /// The service's metrics: the relays', the inbox's, the store's connection pools
    /// (read at scrape time) and the build.
    pub fn for_service(
        relays: Vec<Arc<RelayStats>>,
        inbox: InboxHandles,
        store: Arc<dyn Store>,
        schema: crate::schema::SchemaGate,
    ) -> Metrics {
        Metrics::build(relays, inbox, Some((store, schema)))
    }

    fn build(
        relays: Vec<Arc<RelayStats>>,
        inbox: InboxHandles,
        store: Option<(Arc<dyn Store>, crate::schema::SchemaGate)>,
    ) -> Metrics {
        let mut inner = Inner {
            registry: Registry::default(),
            topics: Mutex::new(HashSet::new()),
            enqueued: Family::default(),
            duplicates: Family::default(),
            requeued: Counter::default(),
            cancelled: Counter::default(),
            republished: Counter::default(),
            rpcs: Family::default(),
            rpc_seconds: Family::new_with_constructor(rpc_histogram as fn() -> _),
            pending: Family::default(),
            failed: Family::default(),
            paused: Family::default(),
            pending_labels: Mutex::default(),
            failed_labels: Mutex::default(),
            paused_labels: Mutex::default(),
            inbox: !inbox.dispatch_stats.is_empty(),
            inbox_pending: Family::default(),
            inbox_failed: Family::default(),
            inbox_pending_labels: Mutex::default(),
            inbox_failed_labels: Mutex::default(),
            inbox_paused: Family::default(),
            inbox_paused_labels: Mutex::default(),
            inbox_oldest_pending_age: Gauge::default(),
            blocked_keys: Gauge::default(),
            oldest_pending_age: Gauge::default(),
            stats_errors: Counter::default(),
            retention_deleted: Family::default(),
            keys_pruned: Counter::default(),
        };
        inner.register_own();
        inner
            .registry
            .register_collector(Box::new(RelayCollector { relays }));
        if inner.inbox {
            inner.register_inbox_backlog();
            inner
                .registry
                .register_collector(Box::new(InboxCollector { inbox }));
        }
        let mut build = vec![("version", env!("CARGO_PKG_VERSION").to_string())];
        if let Some((store, schema)) = store {
            build.push(("schema", store.known_schema().to_string()));
            inner
                .registry
                .register_collector(Box::new(PoolCollector { store }));
            inner
                .registry
                .register_collector(Box::new(SchemaCollector { schema }));
        }
        inner.registry.register(
            "mailroom_build",
            "The running binary: its version and the schema it knows (always 1).",
            prometheus_client::metrics::info::Info::new(build),
        );
        Metrics {
            inner: Arc::new(inner),
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

    /// Counts an enqueue call's stored events and duplicates for `topic`.
    pub fn enqueued(&self, topic: &str, inserted: u64, duplicates: u64) {
        let t = self.topic(topic);
        if inserted > 0 {
            self.inner.enqueued.get_or_create(&t).inc_by(inserted);
        }
        if duplicates > 0 {
            self.inner.duplicates.get_or_create(&t).inc_by(duplicates);
        }
    }

    /// Counts events an operator requeued.
    pub fn requeued(&self, n: u64) {
        self.inner.requeued.inc_by(n);
    }

    /// Counts events an operator republished.
    pub fn republished(&self, n: u64) {
        self.inner.republished.inc_by(n);
    }

    /// Counts events an operator cancelled.
    pub fn cancelled(&self, n: u64) {
        self.inner.cancelled.inc_by(n);
    }

    /// Counts events retention deleted with `status`.
    pub fn retention_deleted(&self, status: &str, n: u64) {
        self.inner
            .retention_deleted
            .get_or_create(&StatusLabel {
                status: status.into(),
            })
            .inc_by(n);
    }

    /// Counts idle key rows retention deleted.
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
                code: crate::pb::code_name(code).to_string(),
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
                let mut pending: HashMap<TopicLabel, i64> = HashMap::new();
                let mut failed: HashMap<TopicLabel, i64> = HashMap::new();
                for t in &s.topics {
                    let l = self.topic(&t.topic);
                    *pending.entry(l.clone()).or_default() += t.pending;
                    *failed.entry(l).or_default() += t.failed;
                }
                let paused = match store.paused(BoxKind::Outbox, None).await {
                    Ok(p) => p.iter().map(|p| (self.topic(&p.topic), 1)).collect(),
                    Err(e) => {
                        self.inner.stats_errors.inc();
                        tracing::warn!(error = %e, "reading the paused topics failed");
                        HashMap::new()
                    }
                };
                replace_series(
                    &i.pending,
                    &mut i.pending_labels.lock().expect("labels"),
                    pending,
                );
                replace_series(
                    &i.failed,
                    &mut i.failed_labels.lock().expect("labels"),
                    failed,
                );
                replace_series(
                    &i.paused,
                    &mut i.paused_labels.lock().expect("labels"),
                    paused,
                );
                i.blocked_keys.set(s.blocked_keys);
                i.oldest_pending_age
                    .set(s.oldest_pending_age.map(|d| d.as_secs_f64()).unwrap_or(0.0));
            }
            Err(e) => {
                self.inner.stats_errors.inc();
                tracing::warn!(error = %e, "refreshing the backlog metrics failed");
            }
        }
        if self.inner.inbox {
            self.refresh_inbox_stats(store).await;
        }
    }

    /// Refreshes the inbox's backlog gauges from the store.
    async fn refresh_inbox_stats(&self, store: &dyn Store) {
        let i = &self.inner;
        match store.stats(BoxKind::Inbox, None).await {
            Ok(s) => {
                let mut pending = HashMap::new();
                let mut failed = HashMap::new();
                for t in &s.topics {
                    let l = SubTopicLabel {
                        subscription: t.subscription.clone(),
                        topic: self.topic(&t.topic).topic,
                    };
                    *pending.entry(l.clone()).or_default() += t.pending;
                    *failed.entry(l).or_default() += t.failed;
                }
                let mut labels = i.inbox_pending_labels.lock().expect("labels");
                replace_series(&i.inbox_pending, &mut labels, pending);
                let mut labels = i.inbox_failed_labels.lock().expect("labels");
                replace_series(&i.inbox_failed, &mut labels, failed);
                i.inbox_oldest_pending_age
                    .set(s.oldest_pending_age.map(|d| d.as_secs_f64()).unwrap_or(0.0));
            }
            Err(e) => {
                i.stats_errors.inc();
                tracing::warn!(error = %e, "refreshing the inbox backlog metrics failed");
            }
        }
        match store.paused(BoxKind::Inbox, None).await {
            Ok(p) => {
                let paused = p
                    .into_iter()
                    .map(|p| {
                        (
                            SubscriptionLabel {
                                subscription: p.topic,
                            },
                            1,
                        )
                    })
                    .collect();
                let mut labels = i.inbox_paused_labels.lock().expect("labels");
                replace_series(&i.inbox_paused, &mut labels, paused);
            }
            Err(e) => {
                i.stats_errors.inc();
                tracing::warn!(error = %e, "reading the paused subscriptions failed");
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

    /// Serves `/metrics` on `listener` until `shutdown`, to requests whose `Host` is an
    /// IP address, localhost with the port, or one of `allowed_hosts` (like the
    /// console: a rebinding page must not read the metrics through a browser on the
    /// host).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        allowed_hosts: Vec<String>,
        shutdown: CancellationToken,
    ) {
        let hosts = match listener.local_addr() {
            Ok(addr) => crate::web::Hosts::new(addr, &allowed_hosts).and_ip_addresses(),
            Err(e) => {
                tracing::error!(error = %e, "metrics: no local address; not serving");
                return;
            }
        };
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
        let app = crate::web::only_for(app, hosts, "metrics", "MAILROOM_METRICS_ALLOWED_HOSTS");
        crate::web::serve(listener, app, shutdown, "metrics").await;
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

fn rpc_histogram() -> Histogram {
    Histogram::new(crate::relay::LATENCY_BUCKETS)
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
    use crate::relay::Latency;

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

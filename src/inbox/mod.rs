//! The inbox: per subscription, a Kafka consumer (`consumer`) stores records deduplicated
//! by message id, and a dispatcher — the relay engine, with the subscriber's handler as
//! its sink (`handler`) — hands them over with the outbox's ordering and retry rules.

pub mod consumer;
pub mod handler;
pub mod identity;
mod legacy;
mod log_view;
mod receive;
pub mod record;
pub mod rewind;
pub mod rewind_to;
pub mod structured;
pub mod supervisor;

pub use receive::{Inbox, Received};

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use std::time::Duration;

use crate::domain::Limits;
use crate::domain::Queue;
use crate::relay::backoff::RetryPolicy;
use crate::relay::{Relay, RelayConfig, RelayStats};
use crate::schema::SchemaGate;
use crate::secret::Secret;
use crate::sink::SinkConfig;
use crate::store::Store;
use crate::tls::ClientTls;

/// A validated subscription.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriptionConfig {
    /// Name, `[a-zA-Z0-9._-]`, unique.
    pub name: String,
    /// Kafka topics consumed (none: `Receive` only).
    pub topics: Vec<String>,
    /// Kafka consumer group.
    pub group: String,
    /// The subscriber's `HandlerService` URL.
    pub handler: String,
    /// Deadline of one `Handle` call.
    pub handler_timeout: Duration,
    /// Keys handled at once.
    pub concurrency: usize,
    /// Attempts and backoff of a message.
    pub retry: RetryPolicy,
    /// TLS towards the handler (files read when the inbox starts).
    pub handler_tls: ClientTls,
    /// Bearer token sent with every Handle call.
    pub handler_token: Option<Secret>,
    /// Cap on a handler's `retry.not_before`.
    pub handler_max_defer: Duration,
    /// The outbox topic its failed messages are copied to (`crate::dead_letter`); none:
    /// they stay failed in the inbox only.
    pub dead_letter_topic: Option<String>,
}

impl SubscriptionConfig {
    /// Whether `Receive` may push a message of `topic`: one of the subscription's
    /// topics, none (empty), or any topic when it lists none (a `Receive`-only
    /// subscription).
    pub fn accepts_topic(&self, topic: &str) -> bool {
        // An empty topic names no topic: the message claims no topic's stream, so it
        // cannot pass for another topic's records.
        topic.is_empty() || self.topics.is_empty() || self.topics.iter().any(|t| t == topic)
    }
}

/// Handles of the running inbox, shared with the API.
#[derive(Clone, Default)]
pub struct InboxHandles {
    /// Wakes a subscription's dispatcher.
    pub wakers: Arc<HashMap<String, Arc<Notify>>>,
    /// Each subscription's dispatcher counters.
    pub dispatch_stats: Arc<HashMap<String, Arc<RelayStats>>>,
    /// Each subscription's Kafka intake counters.
    pub intake_stats: Arc<HashMap<String, Arc<consumer::IntakeStats>>>,
    /// Duration of each Handle call, per subscription.
    pub handler_latency: Arc<HashMap<String, Arc<crate::relay::Latency>>>,
    /// Handle calls refused with `UNAUTHENTICATED`/`PERMISSION_DENIED`, per subscription.
    pub handler_auth_refused: Arc<HashMap<String, Arc<std::sync::atomic::AtomicU64>>>,
    /// Each subscription's task restarts and crash-loop state.
    pub task_health: Arc<HashMap<String, Arc<supervisor::TaskHealth>>>,
}

impl InboxHandles {
    /// Wakes `subscription`'s dispatcher (new work is stored).
    pub fn wake(&self, subscription: &str) {
        if let Some(w) = self.wakers.get(subscription) {
            w.notify_one();
        }
    }
}

/// What the inbox runs on.
#[derive(Debug, Clone)]
pub struct InboxConfig {
    /// The subscriptions, each with its dispatcher.
    pub subscriptions: Vec<SubscriptionConfig>,
    /// Where subscriptions' topics are read from: a Kafka sink's brokers and properties
    /// (a local sink: `Receive` only).
    pub source: SinkConfig,
    /// The outbox relays' settings, which dispatchers share but for retries and leases.
    pub relay: RelayConfig,
    /// Limits a consumed record must meet to be stored.
    pub limits: Limits,
    /// Injected consumer faults (testing only; none by default).
    pub faults: consumer::ConsumerFaults,
}

/// Starts a dispatcher per subscription, and a Kafka consumer for those with topics
/// when brokers are configured.
pub fn start(
    store: Arc<dyn Store>,
    config: &InboxConfig,
    schema: &SchemaGate,
    shutdown: CancellationToken,
) -> anyhow::Result<(InboxHandles, Vec<JoinHandle<()>>)> {
    let mut wakers = HashMap::new();
    let mut dispatch_stats = HashMap::new();
    let mut intake_stats = HashMap::new();
    let mut handler_latency = HashMap::new();
    let mut handler_auth_refused = HashMap::new();
    let mut task_health = HashMap::new();
    let mut tasks = Vec::new();
    for sub in &config.subscriptions {
        let sink = handler::HandlerSink::new(sub)?;
        let latency = sink.latency();
        handler_latency.insert(sub.name.clone(), latency);
        handler_auth_refused.insert(sub.name.clone(), sink.auth_refused());
        let relay_config = RelayConfig {
            retry: sub.retry,
            // Leases of lines in flight are renewed every third of the lease, so one
            // must outlive a handler call and a renewal.
            lease: config.relay.lease.max(sub.handler_timeout * 3),
            // A slow handler keeps a cycle going for long: new messages are claimed
            // beside it at once, in cycles of their own.
            claim_spacing: Duration::ZERO,
            ..config.relay
        };
        let relay = Relay::new(
            store.clone(),
            Arc::new(sink),
            Queue::Inbox {
                subscription: sub.name.clone(),
            },
            relay_config,
        )
        .with_schema(schema.clone());
        wakers.insert(sub.name.clone(), relay.waker());
        dispatch_stats.insert(sub.name.clone(), relay.stats());
        let stats = Arc::new(consumer::IntakeStats::default());
        intake_stats.insert(sub.name.clone(), stats.clone());
        let waker = relay.waker();
        let health = Arc::new(supervisor::TaskHealth::default());
        task_health.insert(sub.name.clone(), health.clone());
        let token = shutdown.clone();
        tasks.push(tokio::spawn(supervisor::supervise(
            sub.name.clone(),
            supervisor::Task::Dispatcher,
            health.clone(),
            shutdown.clone(),
            move || relay.clone().run(token.clone()),
        )));
        let parts = ConsumerParts {
            health,
            waker,
            stats,
        };
        tasks.extend(spawn_consumer(&store, config, sub, parts, &shutdown));
    }
    Ok((
        InboxHandles {
            wakers: Arc::new(wakers),
            dispatch_stats: Arc::new(dispatch_stats),
            intake_stats: Arc::new(intake_stats),
            handler_latency: Arc::new(handler_latency),
            handler_auth_refused: Arc::new(handler_auth_refused),
            task_health: Arc::new(task_health),
        },
        tasks,
    ))
}

/// What a subscription's consumer shares with its dispatcher.
struct ConsumerParts {
    health: Arc<supervisor::TaskHealth>,
    waker: Arc<tokio::sync::Notify>,
    stats: Arc<consumer::IntakeStats>,
}

/// Starts a subscription's Kafka consumer, supervised, when it has topics and brokers
/// are configured (with topics and no brokers it is `Receive` only, and says so).
fn spawn_consumer(
    store: &Arc<dyn Store>,
    config: &InboxConfig,
    sub: &SubscriptionConfig,
    parts: ConsumerParts,
    shutdown: &CancellationToken,
) -> Option<JoinHandle<()>> {
    let SinkConfig::Kafka {
        brokers,
        properties,
        ..
    } = &config.source
    else {
        if !sub.topics.is_empty() {
            tracing::warn!(subscription = %sub.name, "topics configured but no MAILROOM_KAFKA_BROKERS: Receive only");
        }
        return None;
    };
    if sub.topics.is_empty() {
        return None;
    }
    let cc = consumer::consumer_config(brokers, &sub.group, properties);
    let ConsumerParts {
        health,
        waker,
        stats,
    } = parts;
    let (store, sub2, limits, faults, token) = (
        store.clone(),
        sub.clone(),
        config.limits,
        config.faults.clone(),
        shutdown.clone(),
    );
    Some(tokio::spawn(supervisor::supervise(
        sub.name.clone(),
        supervisor::Task::Consumer,
        health,
        shutdown.clone(),
        move || {
            consumer::run(
                store.clone(),
                sub2.clone(),
                cc.clone(),
                limits,
                faults.clone(),
                waker.clone(),
                stats.clone(),
                token.clone(),
            )
        },
    )))
}

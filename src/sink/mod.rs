//! Sinks: where the relay engine delivers a claimed line. The outbox publishes to Kafka
//! (`kafka`) or, embedded, to JSON lines (`local`); `fault` wraps any sink to inject
//! failures in tests. The engine only sees the `Sink` trait.

pub mod fault;
pub mod kafka;
pub mod local;

use chrono::{DateTime, Utc};

use crate::domain::StoredEvent;

/// Where the relay publishes. `Debug` hides the values of properties that may be
/// secrets (SASL and TLS passwords and keys).
#[derive(Clone, PartialEq)]
pub enum SinkConfig {
    /// A Kafka cluster, through rdkafka.
    Kafka {
        /// `bootstrap.servers`.
        brokers: String,
        /// Extra librdkafka properties (TLS, SASL, ...).
        properties: std::collections::BTreeMap<String, String>,
        /// `message.timeout.ms`: how long one publish may wait for the broker.
        message_timeout: std::time::Duration,
    },
    /// JSON lines; `None` is stdout.
    Local {
        /// The file appended to.
        path: Option<std::path::PathBuf>,
    },
}

impl std::fmt::Debug for SinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SinkConfig::Kafka {
                brokers,
                properties,
                message_timeout,
            } => {
                let shown: std::collections::BTreeMap<&str, &str> = properties
                    .iter()
                    .map(|(k, v)| {
                        let v = if secret_property(k) {
                            "***"
                        } else {
                            v.as_str()
                        };
                        (k.as_str(), v)
                    })
                    .collect();
                f.debug_struct("Kafka")
                    .field("brokers", brokers)
                    .field("properties", &shown)
                    .field("message_timeout", message_timeout)
                    .finish()
            }
            SinkConfig::Local { path } => f.debug_struct("Local").field("path", path).finish(),
        }
    }
}

/// Whether a librdkafka property may hold a secret (`sasl.password`,
/// `sasl.jaas.config`, `ssl.key.password`, `ssl.key.pem`, `sasl.oauthbearer.client.secret`, …).
pub fn secret_property(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["password", "secret", "jaas", "key.pem", "token", "keystore"]
        .iter()
        .any(|s| k.contains(s))
}

/// Why a delivery failed, which decides what it costs the event.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// The destination answered and refused this event: spends one attempt, then the
    /// event waits out its backoff (or `retry_at` when the destination named a time).
    Counted {
        /// What the destination said.
        error: String,
        /// When to retry, if the destination named a time.
        retry_at: Option<DateTime<Utc>>,
    },
    /// The destination asked for a later retry that spends no attempt.
    Deferred {
        /// What the destination said.
        error: String,
        /// Not before this time.
        retry_at: DateTime<Utc>,
    },
    /// Refused for good (an inbox handler's reject): `failed` at once.
    Rejected {
        /// What the handler said.
        error: String,
    },
    /// The environment's fault (destination unreachable, timeout, queue full): spends no
    /// attempt and leaves the schedule alone; the cycle stops publishing.
    Transient {
        /// What went wrong.
        error: String,
    },
}

impl Failure {
    /// What went wrong, as stored in the event's `last_error`.
    pub fn error(&self) -> &str {
        match self {
            Failure::Counted { error, .. }
            | Failure::Deferred { error, .. }
            | Failure::Rejected { error }
            | Failure::Transient { error } => error,
        }
    }
    /// Whether the failure spends no attempt.
    pub fn is_transient(&self) -> bool {
        matches!(self, Failure::Transient { .. })
    }
}

/// The result of one event's delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    /// Acknowledged by the destination.
    Delivered,
    /// Not acknowledged: what it costs the event.
    Failed(Failure),
    /// Not sent: an earlier event of its line failed, or the cycle stopped.
    NotAttempted,
}

/// Receives one line's deliveries (the line's index in `lines`) as soon as they are known.
pub type LineDone<'a> = &'a mut (dyn FnMut(usize, Vec<Delivery>) + Send);

/// A destination for claimed events. `lines` are ordered runs (one per key, or one
/// unkeyed event each). A sink may deliver many lines concurrently but within a line
/// must not send an event once an earlier one of that line has failed: the deliveries
/// of a line are a prefix of `Delivered`, then at most one failure, then `NotAttempted`
/// (anything else is a gap, which the relay counts and flags). Returns one `Delivery`
/// per event, shaped like `lines`.
#[async_trait::async_trait]
pub trait Sink: Send + Sync + 'static {
    /// Delivers each line in order and reports one `Delivery` per event of each line, in the same shape.
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>>;

    /// Like `deliver`, but reports each line through `done` as soon as it is finished,
    /// so the relay can settle fast lines while slow ones (a topic that is down) are
    /// still waiting. The default reports every line once all are delivered.
    async fn deliver_each(&self, lines: &[Vec<&StoredEvent>], done: LineDone<'_>) {
        for (i, d) in self.deliver(lines).await.into_iter().enumerate() {
            done(i, d);
        }
    }

    /// The fault domain `e` is delivered through: what one transient failure takes out
    /// of service while the rest keeps its pace (the relay probes it on its own). By
    /// default its topic; Kafka narrows a keyed event to its topic's partition.
    fn domain(&self, e: &StoredEvent) -> String {
        e.topic.clone()
    }

    /// The destination's per-topic record limits, which the intake checks events
    /// against; `None`: only the configured limits apply.
    fn topic_limits(&self) -> Option<kafka::topic_limits::TopicLimits> {
        None
    }

    /// Whether the sink wants the outbox's paused topics (`paused`): it may still hold
    /// records of a topic after the relay has stopped claiming it.
    fn follows_pauses(&self) -> bool {
        false
    }

    /// The outbox topics paused now, as the store holds them (read every poll interval
    /// by `relay::pauses::watch`, whichever process paused them). A sink still holding
    /// records of a topic newly paused drops them: they were reported not delivered, so
    /// they stay pending, in order, and go out after the resume. Blocking: call it off
    /// the runtime's threads.
    fn paused(&self, _topics: &std::collections::HashSet<String>) {}
}

/// `Sink::deliver` for a sink that implements `deliver_each`: gathers each line's report.
pub async fn deliver_by_line<S: Sink + ?Sized>(
    sink: &S,
    lines: &[Vec<&StoredEvent>],
) -> Vec<Vec<Delivery>> {
    let mut out: Vec<Vec<Delivery>> = lines
        .iter()
        .map(|l| vec![Delivery::NotAttempted; l.len()])
        .collect();
    sink.deliver_each(lines, &mut |i, d| out[i] = d).await;
    out
}

/// A shared sink is a sink (so wrappers such as `FaultySink` can hold one).
#[async_trait::async_trait]
impl Sink for std::sync::Arc<dyn Sink> {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        self.as_ref().deliver(lines).await
    }
    async fn deliver_each(&self, lines: &[Vec<&StoredEvent>], done: LineDone<'_>) {
        self.as_ref().deliver_each(lines, done).await
    }
    fn domain(&self, e: &StoredEvent) -> String {
        self.as_ref().domain(e)
    }
    fn topic_limits(&self) -> Option<kafka::topic_limits::TopicLimits> {
        self.as_ref().topic_limits()
    }
    fn follows_pauses(&self) -> bool {
        self.as_ref().follows_pauses()
    }
    fn paused(&self, topics: &std::collections::HashSet<String>) {
        self.as_ref().paused(topics)
    }
}

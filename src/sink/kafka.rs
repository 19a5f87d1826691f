//! Kafka sink: an idempotent rdkafka producer (`acks=all`, `murmur2_random`), pipelined:
//! every line of a cycle is handed to librdkafka at once and each line is reported as
//! soon as its records are acknowledged. Errors are classified by `classify` (see
//! docs/relay.md for the table). A producer that can no longer deliver (fenced, unknown
//! producer id after the broker lost its state, fatal error, or stuck across several
//! deliveries) is replaced.
//!
//! Ordering. librdkafka's idempotent producer writes each partition's records in produce
//! order, with one documented exception: a record that times out locally
//! (`message.timeout.ms`) leaves a gap, and records produced after it are written anyway.
//! A relay that then republishes the timed-out record puts it behind its successors. So
//! librdkafka never times a record out here (`message.timeout.ms=0`) and a permanent
//! error on a batch stops the producer instead of skipping it
//! (`enable.gapless.guarantee=true`). mailroom keeps its own deadline: a record not
//! acknowledged in time is reported transient and stays queued in the producer, ahead
//! of any later copy of it or of its successors, so the first copy of every record of a
//! key reaches the partition in id order. The cost is duplicates after an outage
//! (docs/relay.md, "Ordering under failures").

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};

use super::{Delivery, Failure, LineDone, Sink};
use crate::domain::StoredEvent;

/// How the relay treats a Kafka error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The broker (or the client, deterministically) refused this record: spend an attempt.
    Counted,
    /// The environment failed: spend nothing, stop the line, probe its topic again later.
    Transient,
    /// Transient, and the producer itself can no longer deliver: replace it.
    ProducerBroken,
}

/// The classification table. An error counts against the event only when it is about
/// the record itself (too large, invalid, refused by a policy); errors about the
/// network, the cluster, the credentials or the client's configuration are transient:
/// every record would get them, and an outage of credentials or of the cluster's state
/// must not burn every event's attempts. Unknown codes count, so nothing loops forever
/// at no cost (docs/relay.md keeps this table in prose).
pub fn classify(code: C) -> ErrorClass {
    match code {
        // No broker, no connection, no answer in time, local queue full, leadership moving.
        C::AllBrokersDown
        | C::BrokerTransportFailure
        | C::Resolve
        | C::MessageTimedOut
        | C::RequestTimedOut
        | C::OperationTimedOut
        | C::TimedOutQueue
        | C::QueueFull
        | C::NetworkException
        | C::LeaderNotAvailable
        | C::NotLeaderForPartition
        | C::BrokerNotAvailable
        | C::ReplicaNotAvailable
        | C::NotEnoughReplicas
        | C::NotEnoughReplicasAfterAppend
        | C::KafkaStorageError
        | C::ThrottlingQuotaExceeded
        | C::FencedLeaderEpoch
        | C::UnknownLeaderEpoch
        | C::PreferredLeaderNotAvailable
        | C::EligibleLeadersNotAvailable
        | C::CoordinatorLoadInProgress
        | C::CoordinatorNotAvailable
        | C::NotCoordinator
        | C::NotController
        | C::Retry
        | C::Interrupted
        | C::PurgeQueue
        | C::PurgeInflight
        | C::BrokerDestroy
        | C::DestroyBroker
        | C::WaitCache
        | C::RebootstrapRequired
        | C::NodeUpdate
        | C::UnknownBroker
        | C::CriticalSystemResource
        // The cluster lost or has not yet got the topic's metadata (a broker that lost
        // its state, a topic being created): about the cluster, not the record.
        | C::UnknownTopicOrPartition
        | C::UnknownTopic
        | C::UnknownPartition
        | C::UnknownTopicId
        // Credentials, authorization and TLS: an operator's fix, shared by every record.
        | C::Authentication
        | C::SSL
        | C::SaslAuthenticationFailed
        | C::UnsupportedSASLMechanism
        | C::IllegalSASLState
        | C::UnacceptableCredential
        | C::PrincipalDeserializationFailure
        | C::SecurityDisabled
        | C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed
        | C::DelegationTokenAuthorizationFailed
        | C::DelegationTokenExpired
        // The client and the cluster disagree on what they support or how they are set
        // up (an upgrade, a listener change, a compression type the cluster refuses).
        | C::UnsupportedVersion
        | C::UnsupportedFeature
        | C::UnsupportedForMessageFormat
        | C::UnsupportedCompressionType
        | C::InvalidRequiredAcks
        | C::ListenerNotFound
        | C::NotConfigured
        | C::InvalidConfig => ErrorClass::Transient,
        // The producer's identity or sequence is lost: only a new producer recovers.
        C::Fatal
        | C::Fenced
        | C::ProducerFenced
        | C::InvalidProducerEpoch
        | C::UnknownProducerId
        | C::OutOfOrderSequenceNumber
        | C::InvalidProducerIdMapping
        | C::GaplessGuarantee
        | C::InvalidTransactionalState => ErrorClass::ProducerBroken,
        // Everything else (too large, invalid record, bad timestamp, policy violation,
        // invalid topic name, serialization, ...) is the record's fault.
        _ => ErrorClass::Counted,
    }
}

fn class_of(e: &KafkaError) -> ErrorClass {
    match e.rdkafka_error_code() {
        Some(code) => classify(code),
        // Errors without a code (client creation, canceled delivery) are the client's.
        None => ErrorClass::Transient,
    }
}

/// After this many deliveries in a row that ended transient with nothing acknowledged,
/// the producer is replaced even without a telling error code: tansu, and real brokers
/// after losing state, can leave an idempotent producer stuck forever.
const STUCK_DELIVERIES: u32 = 3;

/// Bytes a record may carry beyond its payload and user headers: key, CloudEvents
/// headers and Kafka's record framing.
pub const RECORD_OVERHEAD_BYTES: usize = 16 * 1024;

pub struct KafkaSink {
    config: ClientConfig,
    producer: RwLock<Arc<FutureProducer>>,
    stuck: AtomicU32,
    source: String,
    /// mailroom's delivery deadline (`kafka_message_timeout_ms`); librdkafka's own is off.
    deadline: Duration,
}

/// Builds the producer configuration: safe defaults first, then the operator's
/// properties (which win, except what the ordering guarantee needs: idempotence, acks,
/// no local message timeout and the gapless guarantee). `delivery_timeout` is mailroom's
/// deadline for an acknowledgement (enforced by `KafkaSink`, not librdkafka); it also
/// bounds one request. `max_record_bytes` is the largest record mailroom accepts:
/// `message.max.bytes` is raised to fit it.
pub fn producer_config(
    brokers: &str,
    delivery_timeout: Duration,
    extra: &BTreeMap<String, String>,
) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("client.id", "mailroom")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "2")
        .set("queue.buffering.max.messages", "200000")
        .set(
            "request.timeout.ms",
            delivery_timeout.as_millis().clamp(1000, 30_000).to_string(),
        );
    for (k, v) in extra {
        // The alias of `message.timeout.ms`, which the ordering guarantee fixes below.
        if k != "delivery.timeout.ms" {
            c.set(k, v);
        }
    }
    c.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("message.timeout.ms", "0")
        .set("enable.gapless.guarantee", "true");
    c
}

/// The record size the producer must accept for events of `max_payload` bytes with up
/// to `max_headers` bytes of headers.
pub fn record_bytes_needed(max_payload: usize, max_headers: usize) -> usize {
    max_payload + max_headers + RECORD_OVERHEAD_BYTES
}

/// Raises `message.max.bytes` to `needed` unless the operator set it; an operator's value
/// below `needed` is refused (a payload the producer can never send would fail forever).
pub fn fit_record_size(c: &mut ClientConfig, needed: usize) -> Result<(), String> {
    match c.get("message.max.bytes").map(str::parse::<usize>) {
        None => {
            // librdkafka's default is 1,000,000 bytes, below a 1 MiB payload.
            c.set("message.max.bytes", needed.max(1_000_000).to_string());
            Ok(())
        }
        Some(Ok(set)) if set >= needed => Ok(()),
        Some(Ok(set)) => Err(format!(
            "kafka property message.max.bytes={set} is below the {needed} bytes a record of \
             max_payload_bytes plus max_header_bytes needs; raise it or lower the limits"
        )),
        Some(Err(_)) => Err("kafka property message.max.bytes is not a number".into()),
    }
}

impl KafkaSink {
    pub fn new(
        config: ClientConfig,
        source: String,
        deadline: Duration,
    ) -> Result<Self, KafkaError> {
        let producer: FutureProducer = config.create()?;
        Ok(KafkaSink {
            config,
            producer: RwLock::new(Arc::new(producer)),
            stuck: AtomicU32::new(0),
            source,
            deadline,
        })
    }

    fn current(&self) -> Arc<FutureProducer> {
        self.producer.read().expect("producer lock").clone()
    }

    fn replace(&self, why: &str) {
        match self.config.create::<FutureProducer>() {
            Ok(p) => {
                tracing::warn!(reason = why, "replacing Kafka producer");
                let old = std::mem::replace(
                    &mut *self.producer.write().expect("producer lock"),
                    Arc::new(p),
                );
                self.stuck.store(0, Ordering::Relaxed);
                // Dropping a producer purges and flushes for up to 500 ms: not on a
                // runtime thread.
                tokio::task::spawn_blocking(move || drop(old));
            }
            Err(e) => tracing::error!(error = %e, "could not create a new Kafka producer"),
        }
    }

    /// The record's headers (`cloud_event_headers`), with the producer span's trace
    /// context when spans are exported.
    fn headers(&self, e: &StoredEvent, trace: Option<&HashMap<String, String>>) -> OwnedHeaders {
        let mut all = cloud_event_headers(e, &self.source);
        if let Some(trace) = trace {
            all.retain(|(k, _)| k != "traceparent" && k != "tracestate");
            all.extend(trace.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        let mut h = OwnedHeaders::new_with_capacity(all.len());
        for (k, v) in &all {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        h
    }

    /// Hands one line's records to librdkafka in order, stopping at the first it refuses.
    /// Each record gets a producer span (OpenTelemetry messaging conventions), a child of
    /// the event's own trace context, kept open until the line's acknowledgements are in.
    fn produce_line(&self, producer: &FutureProducer, line: &[&StoredEvent]) -> ProducedLine {
        let mut futures = Vec::with_capacity(line.len());
        let mut spans = Vec::with_capacity(line.len());
        for e in line {
            let span = tracing::info_span!(
                "send",
                otel.name = %format!("send {}", e.topic),
                otel.kind = "producer",
                otel.status_code = tracing::field::Empty,
                messaging.system = "kafka",
                messaging.operation.type = "send",
                messaging.operation.name = "send",
                messaging.destination.name = %e.topic,
                messaging.message.id = %format!("{}-{}", e.id, e.created_at.timestamp_micros()),
                messaging.kafka.message.key = e.key.as_deref().unwrap_or(""),
                mailroom.event_id = e.id,
            );
            crate::telemetry::join_trace_state(
                &span,
                e.headers.get("traceparent").map(String::as_str),
                e.headers.get("tracestate").map(String::as_str),
            );
            let trace = crate::telemetry::inject(&span);
            let mut record = FutureRecord::<str, [u8]>::to(&e.topic)
                .payload(&e.payload)
                .headers(self.headers(e, trace.as_ref()));
            if let Some(k) = &e.key {
                record = record.key(k.as_str());
            }
            match producer.send_result(record) {
                Ok(f) => {
                    futures.push(f);
                    spans.push(span);
                }
                Err((err, _)) => {
                    span.record("otel.status_code", "ERROR");
                    let class = class_of(&err);
                    let d = Delivery::Failed(failure(&err, class));
                    return (futures, Some((d, class, err.to_string())), spans);
                }
            }
        }
        (futures, None, spans)
    }
}

/// A line handed to librdkafka: its records' acknowledgements, the refusal that stopped
/// it (if any), and the records' producer spans.
type ProducedLine = (
    Vec<DeliveryFuture>,
    Option<(Delivery, ErrorClass, String)>,
    Vec<tracing::Span>,
);

fn failure(e: &KafkaError, class: ErrorClass) -> Failure {
    let error = format!("kafka: {e}");
    match class {
        ErrorClass::Counted => Failure::Counted {
            error,
            retry_at: None,
        },
        ErrorClass::Transient | ErrorClass::ProducerBroken => Failure::Transient { error },
    }
}

/// What one line's acknowledgements said, beyond its deliveries.
#[derive(Default)]
struct LineNotes {
    delivered: bool,
    transient: bool,
    broken: Option<String>,
}

/// Awaits a line's acknowledgements in order until `deadline`. After the first record
/// that is not acknowledged, later ones are reported only if they already were (a gap
/// the relay counts as `delivered_after_failure`); otherwise they were not attempted.
async fn await_line(
    futures: Vec<DeliveryFuture>,
    refused: Option<(Delivery, ErrorClass, String)>,
    len: usize,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> (Vec<Delivery>, LineNotes) {
    let mut out = vec![Delivery::NotAttempted; len];
    let mut notes = LineNotes::default();
    let mut failed = false;
    let sent = futures.len();
    for (i, fut) in futures.into_iter().enumerate() {
        if failed {
            // Only an acknowledgement that has already arrived can be a gap.
            if let Some(Ok(Ok(_))) = fut.now_or_never() {
                out[i] = Delivery::Delivered;
            }
            continue;
        }
        out[i] = match tokio::time::timeout_at(deadline, fut).await {
            Ok(Ok(Ok(_))) => {
                notes.delivered = true;
                Delivery::Delivered
            }
            Ok(Ok(Err((err, _)))) => {
                let class = class_of(&err);
                match class {
                    ErrorClass::ProducerBroken => notes.broken = Some(err.to_string()),
                    ErrorClass::Transient => notes.transient = true,
                    ErrorClass::Counted => {}
                }
                Delivery::Failed(failure(&err, class))
            }
            Ok(Err(_canceled)) => {
                notes.transient = true;
                Delivery::Failed(Failure::Transient {
                    error: "kafka: delivery canceled (producer replaced)".into(),
                })
            }
            Err(_elapsed) => {
                notes.transient = true;
                Delivery::Failed(Failure::Transient {
                    error: format!(
                        "kafka: not acknowledged within {} ms (the record stays queued ahead \
                         of any later record of its key)",
                        timeout.as_millis()
                    ),
                })
            }
        };
        failed = out[i] != Delivery::Delivered;
    }
    if let Some((d, class, why)) = refused
        && !failed
    {
        match class {
            ErrorClass::ProducerBroken => notes.broken = Some(why),
            ErrorClass::Transient => notes.transient = true,
            ErrorClass::Counted => {}
        }
        out[sent] = d;
    }
    (out, notes)
}

#[async_trait::async_trait]
impl Sink for KafkaSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        super::deliver_by_line(self, lines).await
    }

    async fn deliver_each(&self, lines: &[Vec<&StoredEvent>], done: LineDone<'_>) {
        let producer = self.current();
        if let Some((_, why)) = producer.client().fatal_error() {
            self.replace(&format!("fatal producer error: {why}"));
            for (i, l) in lines.iter().enumerate() {
                let mut d = vec![Delivery::NotAttempted; l.len()];
                if let Some(first) = d.first_mut() {
                    *first = Delivery::Failed(Failure::Transient {
                        error: format!("kafka: producer failed: {why}"),
                    });
                }
                done(i, d);
            }
            return;
        }
        let deadline = tokio::time::Instant::now() + self.deadline;
        // Every line is handed to librdkafka first, so the whole cycle is pipelined.
        let mut running = FuturesUnordered::new();
        for (i, line) in lines.iter().enumerate() {
            let (futures, refused, spans) = self.produce_line(&producer, line);
            let (len, timeout) = (line.len(), self.deadline);
            running.push(async move {
                let (d, notes) = await_line(futures, refused, len, deadline, timeout).await;
                // A producer span ends at its record's acknowledgement (or failure).
                for (span, d) in spans.iter().zip(&d) {
                    if !matches!(d, Delivery::Delivered) {
                        span.record("otel.status_code", "ERROR");
                    }
                }
                drop(spans);
                (i, d, notes)
            });
        }
        let (mut delivered, mut transient, mut broken) = (false, false, None);
        while let Some((i, d, notes)) = running.next().await {
            delivered |= notes.delivered;
            transient |= notes.transient;
            if notes.broken.is_some() {
                broken = notes.broken;
            }
            done(i, d);
        }
        drop(producer);
        if let Some(why) = broken {
            self.replace(&why);
        } else if delivered {
            self.stuck.store(0, Ordering::Relaxed);
        } else if transient && self.stuck.fetch_add(1, Ordering::Relaxed) + 1 >= STUCK_DELIVERIES {
            self.replace("deliveries failed transiently several times in a row");
        }
    }
}

/// The CloudEvents attributes mailroom sets itself (binary content mode).
const CE_OWN: [&str; 5] = ["ce_specversion", "ce_id", "ce_type", "ce_source", "ce_time"];
/// The content type when an event names none.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

/// A record's headers, following the CloudEvents Kafka protocol binding (binary content
/// mode) exactly:
/// - `ce_specversion` = `1.0`, `ce_id` = `<event id>-<created_at in µs since the epoch>`
///   (unique within a database even after a restore from a backup: the restored
///   database issues the lost ids again, at later times), `ce_type` (the event's type,
///   `mailroom.event` when it has none), `ce_source` (`app::ce_source`: tells
///   deployments apart), `ce_time` (RFC 3339);
/// - `content-type` (the binding's name for `datacontenttype`): the event's own
///   `content-type` header (any case, or a `ce_datacontenttype` one), else
///   `application/octet-stream`;
/// - the event's other headers as they are, except those naming an attribute mailroom
///   sets (an event cannot forge its `ce_id` or `ce_source`). Other `ce_*` headers pass
///   through as extension attributes.
pub fn cloud_event_headers(e: &StoredEvent, source: &str) -> Vec<(String, String)> {
    let mut content_type = None;
    let mut out = Vec::with_capacity(e.headers.len() + 6);
    for (k, v) in &e.headers {
        let lower = k.to_ascii_lowercase();
        if lower == "content-type" || lower == "ce_datacontenttype" {
            content_type.get_or_insert_with(|| v.clone());
        } else if !CE_OWN.contains(&lower.as_str()) {
            out.push((k.clone(), v.clone()));
        }
    }
    let ty = e.event_type.as_deref().unwrap_or("mailroom.event");
    out.extend([
        ("ce_specversion".to_string(), "1.0".to_string()),
        (
            "ce_id".to_string(),
            format!("{}-{}", e.id, e.created_at.timestamp_micros()),
        ),
        ("ce_type".to_string(), ty.to_string()),
        ("ce_source".to_string(), source.to_string()),
        ("ce_time".to_string(), e.created_at.to_rfc3339()),
        (
            "content-type".to_string(),
            content_type.unwrap_or_else(|| DEFAULT_CONTENT_TYPE.to_string()),
        ),
    ]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(headers: &[(&str, &str)]) -> StoredEvent {
        let t = chrono::DateTime::from_timestamp(1_764_600_000, 123_456_000).unwrap();
        StoredEvent {
            id: 42,
            topic: "orders".into(),
            key: Some("k".into()),
            payload: b"{}".to_vec(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            event_type: Some("order.created".into()),
            idempotency_key: None,
            status: crate::domain::Status::Pending,
            attempts: 0,
            max_attempts: 6,
            scheduled_at: t,
            created_at: t,
            updated_at: t,
            published_at: None,
            last_error: None,
        }
    }

    #[test]
    fn headers_follow_the_cloudevents_kafka_binding() {
        let get = |h: &[(String, String)], k: &str| -> Vec<String> {
            h.iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .collect()
        };
        let h = cloud_event_headers(&stored(&[("source", "checkout")]), "mailroom/x");
        assert_eq!(get(&h, "ce_specversion"), ["1.0"]);
        assert_eq!(get(&h, "ce_id"), ["42-1764600000123456"]);
        assert_eq!(get(&h, "ce_type"), ["order.created"]);
        assert_eq!(get(&h, "ce_source"), ["mailroom/x"]);
        assert_eq!(get(&h, "ce_time"), ["2025-12-01T14:40:00.123456+00:00"]);
        assert_eq!(get(&h, "content-type"), [DEFAULT_CONTENT_TYPE]);
        assert_eq!(get(&h, "source"), ["checkout"]);
        // The event's content type, whatever its spelling; no forged ce_id/ce_source;
        // other ce_ extensions pass through.
        let h = cloud_event_headers(
            &stored(&[
                ("Content-Type", "application/json"),
                ("ce_id", "forged"),
                ("ce_source", "forged"),
                ("ce_subject", "order-42"),
            ]),
            "mailroom/x",
        );
        assert_eq!(get(&h, "content-type"), ["application/json"]);
        assert!(get(&h, "Content-Type").is_empty());
        assert_eq!(get(&h, "ce_id"), ["42-1764600000123456"]);
        assert_eq!(get(&h, "ce_source"), ["mailroom/x"]);
        assert_eq!(get(&h, "ce_subject"), ["order-42"]);
        let h = cloud_event_headers(&stored(&[("ce_datacontenttype", "text/plain")]), "s");
        assert_eq!(get(&h, "content-type"), ["text/plain"]);
        assert!(get(&h, "ce_datacontenttype").is_empty());
    }

    #[test]
    fn outage_errors_are_transient() {
        for c in [
            C::AllBrokersDown,
            C::BrokerTransportFailure,
            C::MessageTimedOut,
            C::RequestTimedOut,
            C::QueueFull,
            C::NotLeaderForPartition,
        ] {
            assert_eq!(classify(c), ErrorClass::Transient, "{c:?}");
        }
    }

    #[test]
    fn record_errors_count() {
        for c in [
            C::MessageSizeTooLarge,
            C::InvalidMessage,
            C::InvalidRecord,
            C::InvalidTimestamp,
            C::InvalidTopic,
            C::ValueSerialization,
            C::PolicyViolation,
            C::MessageBatchTooLarge,
        ] {
            assert_eq!(classify(c), ErrorClass::Counted, "{c:?}");
        }
    }

    /// Failures about the credentials, the cluster's state or the client's set-up are
    /// shared by every record: they must not spend attempts (issue 11, item 7).
    #[test]
    fn environment_errors_spend_no_attempt() {
        for c in [
            C::Authentication,
            C::SSL,
            C::SaslAuthenticationFailed,
            C::UnsupportedSASLMechanism,
            C::TopicAuthorizationFailed,
            C::ClusterAuthorizationFailed,
            C::UnknownTopicOrPartition,
            C::UnknownTopic,
            C::UnknownPartition,
            C::UnsupportedVersion,
            C::UnsupportedCompressionType,
            C::InvalidRequiredAcks,
        ] {
            assert_eq!(classify(c), ErrorClass::Transient, "{c:?}");
        }
    }

    #[test]
    fn lost_producer_state_replaces_the_producer() {
        for c in [
            C::Fatal,
            C::ProducerFenced,
            C::UnknownProducerId,
            C::InvalidProducerEpoch,
            C::OutOfOrderSequenceNumber,
        ] {
            assert_eq!(classify(c), ErrorClass::ProducerBroken, "{c:?}");
        }
    }

    #[test]
    fn config_keeps_idempotence_whatever_the_operator_sets() {
        let extra = BTreeMap::from([
            ("enable.idempotence".to_string(), "false".to_string()),
            ("linger.ms".to_string(), "20".to_string()),
        ]);
        let c = producer_config("h:1", Duration::from_secs(10), &extra);
        assert_eq!(c.get("enable.idempotence"), Some("true"));
        assert_eq!(c.get("acks"), Some("all"));
        assert_eq!(c.get("linger.ms"), Some("20"));
        assert_eq!(c.get("partitioner"), Some("murmur2_random"));
    }

    /// The ordering guarantee rests on these two: librdkafka never times a record out
    /// (the one gap its idempotent producer allows), and a permanent batch error stops
    /// the producer rather than skipping the batch. An operator cannot turn them off.
    #[test]
    fn config_never_lets_librdkafka_skip_a_record() {
        let extra = BTreeMap::from([
            ("message.timeout.ms".to_string(), "5000".to_string()),
            ("delivery.timeout.ms".to_string(), "5000".to_string()),
            ("enable.gapless.guarantee".to_string(), "false".to_string()),
        ]);
        let c = producer_config("h:1", Duration::from_secs(10), &extra);
        assert_eq!(c.get("message.timeout.ms"), Some("0"));
        assert_eq!(c.get("enable.gapless.guarantee"), Some("true"));
        // The alias must not survive either: the last one set wins in librdkafka.
        assert_ne!(c.get("delivery.timeout.ms"), Some("5000"));
    }

    #[test]
    fn the_record_size_fits_the_largest_payload() {
        let mut c = producer_config("h:1", Duration::from_secs(10), &BTreeMap::new());
        let needed = record_bytes_needed(1024 * 1024, 16 * 1024);
        fit_record_size(&mut c, needed).unwrap();
        assert_eq!(
            c.get("message.max.bytes"),
            Some(needed.to_string().as_str())
        );
        let mut small = producer_config(
            "h:1",
            Duration::from_secs(10),
            &BTreeMap::from([("message.max.bytes".to_string(), "1000000".to_string())]),
        );
        let err = fit_record_size(&mut small, needed).unwrap_err();
        assert!(err.contains("message.max.bytes=1000000"), "{err}");
    }
}

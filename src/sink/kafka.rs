//! Kafka sink: an idempotent rdkafka producer (`acks=all`, `murmur2_random`), pipelined:
//! every event of a cycle is handed to librdkafka at once and the deliveries awaited
//! together. Errors are classified by `classify` (see docs/relay.md for the table).
//! A producer that can no longer deliver (fenced, unknown producer id after the broker
//! lost its state, fatal error, or stuck across several cycles) is replaced.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::future::join_all;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::{Delivery, Failure, Sink};
use crate::domain::StoredEvent;

/// How the relay treats a Kafka error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The broker (or the client, deterministically) refused this record: spend an attempt.
    Counted,
    /// The environment failed: spend nothing, stop the cycle, probe again later.
    Transient,
    /// Transient, and the producer itself can no longer deliver: replace it.
    ProducerBroken,
}

/// The classification table. Anything not listed counts: an unknown error must not
/// loop forever at no cost; the table lists every outage-shaped error librdkafka reports.
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
        | C::CoordinatorLoadInProgress
        | C::CoordinatorNotAvailable
        | C::NotCoordinator
        | C::Retry
        | C::Interrupted
        | C::PurgeQueue
        | C::PurgeInflight
        | C::BrokerDestroy
        | C::DestroyBroker
        | C::WaitCache
        | C::RebootstrapRequired => ErrorClass::Transient,
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
        // Everything else (too large, invalid record, unknown topic the broker answered
        // about, authorization, serialization, ...) is the record's fault.
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

/// After this many cycles in a row that ended transient, the producer is replaced even
/// without a telling error code: tansu, and real brokers after losing state, can leave
/// an idempotent producer timing out forever.
const STUCK_CYCLES: u32 = 3;

pub struct KafkaSink {
    config: ClientConfig,
    producer: RwLock<Arc<FutureProducer>>,
    transient_cycles: AtomicU32,
    source: String,
}

/// Builds the producer configuration: safe defaults first, then the operator's
/// properties (which win, except idempotence and acks, which the guarantees need).
pub fn producer_config(
    brokers: &str,
    message_timeout: Duration,
    extra: &BTreeMap<String, String>,
) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("client.id", "mailroom")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "2")
        .set("queue.buffering.max.messages", "200000")
        .set(
            "message.timeout.ms",
            message_timeout.as_millis().to_string(),
        )
        .set(
            "request.timeout.ms",
            message_timeout.as_millis().min(30_000).to_string(),
        );
    for (k, v) in extra {
        c.set(k, v);
    }
    c.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5");
    c
}

impl KafkaSink {
    pub fn new(config: ClientConfig, source: String) -> Result<Self, KafkaError> {
        let producer: FutureProducer = config.create()?;
        Ok(KafkaSink {
            config,
            producer: RwLock::new(Arc::new(producer)),
            transient_cycles: AtomicU32::new(0),
            source,
        })
    }

    fn current(&self) -> Arc<FutureProducer> {
        self.producer.read().expect("producer lock").clone()
    }

    fn replace(&self, why: &str) {
        match self.config.create::<FutureProducer>() {
            Ok(p) => {
                tracing::warn!(reason = why, "replacing Kafka producer");
                *self.producer.write().expect("producer lock") = Arc::new(p);
                self.transient_cycles.store(0, Ordering::Relaxed);
            }
            Err(e) => tracing::error!(error = %e, "could not create a new Kafka producer"),
        }
    }

    /// CloudEvents headers. `ce_id` is `<event id>-<created_at in µs since the epoch>`:
    /// unique within a database even after a restore from a backup (the restored
    /// database issues the lost ids again, at later times); `ce_source` tells
    /// deployments apart (`app::ce_source`).
    fn headers(&self, e: &StoredEvent) -> OwnedHeaders {
        let id = format!("{}-{}", e.id, e.created_at.timestamp_micros());
        let time = e.created_at.to_rfc3339();
        let mut h = OwnedHeaders::new_with_capacity(e.headers.len() + 5);
        for (k, v) in &e.headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let ty = e.event_type.as_deref().unwrap_or("mailroom.event");
        for (k, v) in [
            ("ce_specversion", "1.0"),
            ("ce_id", id.as_str()),
            ("ce_type", ty),
            ("ce_source", self.source.as_str()),
            ("ce_time", time.as_str()),
        ] {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        h
    }
}

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

#[async_trait::async_trait]
impl Sink for KafkaSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        let producer = self.current();
        let mut out: Vec<Vec<Delivery>> = lines
            .iter()
            .map(|l| vec![Delivery::NotAttempted; l.len()])
            .collect();
        let mut pending = Vec::new();
        let mut broken = producer.client().fatal_error().map(|(_, s)| s);
        let mut transient = false;
        'lines: for (li, line) in lines.iter().enumerate() {
            for (ei, e) in line.iter().enumerate() {
                let mut record = FutureRecord::<str, [u8]>::to(&e.topic)
                    .payload(&e.payload)
                    .headers(self.headers(e));
                if let Some(k) = &e.key {
                    record = record.key(k.as_str());
                }
                match producer.send_result(record) {
                    Ok(fut) => pending.push((li, ei, fut)),
                    Err((err, _)) => {
                        let class = class_of(&err);
                        out[li][ei] = Delivery::Failed(failure(&err, class));
                        match class {
                            // This record is refused: the rest of its line waits behind it.
                            ErrorClass::Counted => continue 'lines,
                            ErrorClass::ProducerBroken => {
                                broken = Some(err.to_string());
                                break 'lines;
                            }
                            ErrorClass::Transient => {
                                transient = true;
                                break 'lines;
                            }
                        }
                    }
                }
            }
        }
        let keys: Vec<(usize, usize)> = pending.iter().map(|(l, e, _)| (*l, *e)).collect();
        let results = join_all(pending.into_iter().map(|(_, _, f)| f)).await;
        for ((li, ei), r) in keys.into_iter().zip(results) {
            out[li][ei] = match r {
                Ok(Ok(_)) => Delivery::Delivered,
                Ok(Err((err, _))) => {
                    let class = class_of(&err);
                    match class {
                        ErrorClass::ProducerBroken => broken = Some(err.to_string()),
                        ErrorClass::Transient => transient = true,
                        ErrorClass::Counted => {}
                    }
                    Delivery::Failed(failure(&err, class))
                }
                Err(_canceled) => {
                    transient = true;
                    Delivery::Failed(Failure::Transient {
                        error: "kafka: delivery canceled".into(),
                    })
                }
            };
        }
        if let Some(why) = broken {
            self.replace(&why);
        } else if transient {
            if self.transient_cycles.fetch_add(1, Ordering::Relaxed) + 1 >= STUCK_CYCLES {
                self.replace("deliveries failed transiently for several cycles");
            }
        } else {
            self.transient_cycles.store(0, Ordering::Relaxed);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            C::TopicAuthorizationFailed,
            C::UnknownTopicOrPartition,
            C::UnknownTopic,
            C::InvalidTopic,
            C::ValueSerialization,
            C::PolicyViolation,
        ] {
            assert_eq!(classify(c), ErrorClass::Counted, "{c:?}");
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
}

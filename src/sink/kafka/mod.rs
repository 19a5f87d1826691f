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
//!
//! A broker's refusal, fatal to that producer and blind to which record of the batch
//! was at fault, narrows the refused topic onto a producer of its own that sends one
//! record at a time (`narrowing`; docs/relay.md, "Broker refusals").

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};

mod classify;
mod cloudevents;
pub mod narrowing;
pub mod partitions;
mod pauses;
pub mod topic_limits;

pub use classify::{Attempt, Decision, Narrow, Row, decide, markdown_table};
pub use cloudevents::{CeHeader, DEFAULT_CONTENT_TYPE, cloud_event_headers};

use super::{Delivery, Failure, LineDone, Sink};
use crate::domain::StoredEvent;
use classify::{decision_of, failure, producer_lost};
use partitions::Placement;

/// After this many deliveries in a row that ended transient with nothing acknowledged,
/// the producer is replaced even without a telling error code: tansu, and real brokers
/// after losing state, can leave an idempotent producer stuck forever.
const STUCK_DELIVERIES: u32 = 3;

/// librdkafka's default `batch.size`.
const LIBRDKAFKA_BATCH_SIZE: usize = 1_000_000;

/// Bytes a record may carry beyond its payload and user headers: key, CloudEvents
/// headers and Kafka's record framing.
pub const RECORD_OVERHEAD_BYTES: usize = 16 * 1024;

/// The Kafka destination.
pub struct KafkaSink {
    /// The shared producer's configuration; its `batch.size` shrinks to the smallest
    /// topic limit in use (`fit_batches`).
    config: RwLock<ClientConfig>,
    /// The shared producer's `batch.size`.
    batch_size: AtomicUsize,
    producer: RwLock<Arc<FutureProducer>>,
    stuck: AtomicU32,
    /// Shared producers replaced so far.
    replacements: AtomicU64,
    source: String,
    /// mailroom's delivery deadline (`kafka_message_timeout_ms`); librdkafka's own is off.
    deadline: Duration,
    /// Each topic's partition count: keyed records go to their partition explicitly,
    /// and each partition is a fault domain (`partitions`).
    partitions: partitions::Partitions,
    /// Each topic's `max.message.bytes`: a record over it is refused here, counted.
    topic_limits: Option<topic_limits::TopicLimits>,
    /// Topics whose records the broker refused lately, published one record at a time
    /// by a producer of their own (`narrowing`).
    narrowed: narrowing::Narrowed,
    /// The paused topics and what each producer still holds of each topic (`pauses`).
    pauses: pauses::Pauses,
    /// Pauses that purged a producer.
    pause_purges: AtomicU64,
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
    /// A sink over a producer made from `config`, naming itself `source` in `ce_source`; a delivery not acknowledged within `deadline` is transient.
    pub fn new(
        config: ClientConfig,
        source: String,
        deadline: Duration,
    ) -> Result<Self, KafkaError> {
        let producer: FutureProducer = config.create()?;
        let batch_size = config
            .get("batch.size")
            .and_then(|v| v.parse().ok())
            .unwrap_or(LIBRDKAFKA_BATCH_SIZE);
        Ok(KafkaSink {
            narrowed: narrowing::Narrowed::new(&config),
            config: RwLock::new(config),
            batch_size: AtomicUsize::new(batch_size),
            producer: RwLock::new(Arc::new(producer)),
            stuck: AtomicU32::new(0),
            replacements: AtomicU64::new(0),
            source,
            deadline,
            partitions: partitions::Partitions::default(),
            topic_limits: None,
            pauses: pauses::Pauses::default(),
            pause_purges: AtomicU64::new(0),
        })
    }

    /// Refuses (counted) a record over its topic's `max.message.bytes` before the broker
    /// does (a broker's refusal would stop the shared producer and narrow the topic).
    pub fn with_topic_limits(mut self, limits: topic_limits::TopicLimits) -> Self {
        self.topic_limits = Some(limits);
        self
    }

    /// Records and requests librdkafka holds (queued or in flight), across all topics.
    pub fn queued(&self) -> i32 {
        self.current().in_flight_count()
    }

    /// Topics published one record at a time after a broker refusal (`narrowing`).
    pub fn narrowed_topics(&self) -> usize {
        self.narrowed.count()
    }

    /// Whether `topic` is narrowed now.
    pub fn is_narrowed(&self, topic: &str) -> bool {
        self.narrowed.is_narrowed(topic)
    }

    /// How many times the shared producer was replaced (each replacement purges what it
    /// held of every topic).
    pub fn replacements(&self) -> u64 {
        self.replacements.load(Ordering::Relaxed)
    }

    /// How many pauses purged a producer that still held records of the paused topic.
    pub fn pause_purges(&self) -> u64 {
        self.pause_purges.load(Ordering::Relaxed)
    }

    /// Whether `topic` is paused, as the sink last read it (`Sink::paused`).
    pub fn knows_paused(&self, topic: &str) -> bool {
        self.pauses.is_paused(topic)
    }

    /// Whether `e` goes to a partition the metadata shows without a leader.
    fn leaderless(&self, e: &StoredEvent, producer: &Arc<FutureProducer>) -> bool {
        self.partition(e, producer)
            .is_some_and(|p| self.partitions.leaderless(&e.topic, p, producer))
    }

    /// A keyed event's partition, once its topic's partition count is known.
    fn partition(&self, e: &StoredEvent, producer: &Arc<FutureProducer>) -> Option<i32> {
        let key = e.key.as_deref()?;
        let count = self.partitions.count(&e.topic, producer)?;
        Some(partitions::partition_for(key.as_bytes(), count))
    }

    /// The narrowed topics' producer when a line of the cycle needs it.
    fn narrowed_producer(&self, narrowed: &[bool]) -> Option<Arc<FutureProducer>> {
        if !narrowed.contains(&true) {
            return None;
        }
        match self.narrowed.producer() {
            Ok(p) if p.client().fatal_error().is_none() => Some(p),
            Ok(_) => {
                self.narrowed.replace("fatal producer error");
                self.narrowed.producer().ok()
            }
            Err(e) => {
                // Its lines go through the shared producer, as before narrowing.
                tracing::error!(error = %e, "could not create the narrowed topics' producer");
                None
            }
        }
    }

    /// The current producer, replaced first when librdkafka reports it fatally broken
    /// (a fatal error is that producer's state, not an outage).
    fn healthy_producer(&self) -> Arc<FutureProducer> {
        let producer = self.current();
        match producer.client().fatal_error() {
            Some((_, why)) => {
                self.narrow_fatal(&why);
                self.replace(&producer, &format!("fatal producer error: {why}"));
                release(producer);
                self.current()
            }
            None => producer,
        }
    }

    /// A topic's first records wait (a second at most) for its partitions and leaders,
    /// and for its record size limit.
    async fn learn_topics(&self, lines: &[Vec<&StoredEvent>], producer: &Arc<FutureProducer>) {
        let topics = lines
            .iter()
            .filter_map(|l| l.first())
            .map(|e| e.topic.as_str());
        self.partitions
            .learn(topics, producer, Duration::from_secs(1))
            .await;
        if let Some(limits) = &self.topic_limits {
            limits.learn(lines.iter().flatten().copied()).await;
        }
    }

    /// Keeps the shared producer's batches within the smallest `max.message.bytes` of
    /// the topics it publishes: librdkafka fills a batch up to `batch.size` (1 MB by
    /// default) whatever the topic, and a broker refuses a batch over the topic's limit
    /// whole, which is fatal to the producer and narrows the topic, again at each
    /// narrowing window. When a cycle's topics include one with a lower limit than the
    /// current `batch.size`, the producer is replaced by one with `batch.size` at that
    /// limit (once per lower limit learned; a topic's first cycle learns its limit
    /// before anything of it is sent). librdkafka counts the request's framing in
    /// `batch.size`, so a batch stays below it; a single record over it still goes
    /// alone (the topic-limit check refuses those before). Returns whether the producer
    /// was replaced.
    fn fit_batches(&self, lines: &[Vec<&StoredEvent>]) -> bool {
        let Some(limits) = &self.topic_limits else {
            return false;
        };
        let smallest = lines
            .iter()
            .filter_map(|l| l.first())
            .filter_map(|e| limits.cached(&e.topic))
            .min();
        let Some(limit) = smallest else {
            return false;
        };
        let limit = limit.max(MIN_BATCH_SIZE);
        if self.batch_size.fetch_min(limit, Ordering::Relaxed) <= limit {
            return false;
        }
        self.config
            .write()
            .expect("config lock")
            .set("batch.size", limit.to_string());
        // The current producer, whichever cycle made it: one made before the new
        // `batch.size` must not stay.
        self.replace(
            &self.current(),
            &format!("a topic's max.message.bytes ({limit}) is below the batch size"),
        );
        true
    }

    /// Narrows the topic a fatal error names. The delivery report that narrows it may
    /// still be on its way when another cycle finds the producer fatal and replaces it:
    /// without this, that cycle could send the topic's records to the new producer and
    /// reset it again. librdkafka names the topic of a fatal produce error in a fixed
    /// form ("ProduceRequest for <topic> [<partition>] ..."), and Kafka's topic names
    /// hold neither spaces nor brackets.
    fn narrow_fatal(&self, why: &str) {
        if let Some(topic) = fatal_topic(why) {
            self.narrowed.narrow(topic);
        }
    }

    /// After a cycle: a broken producer is replaced, and so is one whose deliveries
    /// failed transiently `STUCK_DELIVERIES` cycles in a row; a delivery resets that count.
    fn judge(&self, producer: &Arc<FutureProducer>, health: CycleHealth) {
        if let Some(why) = health.broken {
            if let Some((_, fatal)) = producer.client().fatal_error() {
                self.narrow_fatal(&fatal);
            }
            self.replace(producer, &why);
        } else if health.delivered {
            self.stuck.store(0, Ordering::Relaxed);
        } else if health.transient
            && self.stuck.fetch_add(1, Ordering::Relaxed) + 1 >= STUCK_DELIVERIES
        {
            self.replace(
                producer,
                "deliveries failed transiently several times in a row",
            );
        }
    }

    fn current(&self) -> Arc<FutureProducer> {
        self.producer.read().expect("producer lock").clone()
    }

    /// Replaces `broken` unless a concurrent delivery already did: a second replacement
    /// would drop the records the first one's successor holds.
    fn replace(&self, broken: &Arc<FutureProducer>, why: &str) {
        let mut slot = self.producer.write().expect("producer lock");
        if !Arc::ptr_eq(&slot, broken) {
            return;
        }
        let created = self
            .config
            .read()
            .expect("config lock")
            .create::<FutureProducer>();
        match created {
            Ok(p) => {
                tracing::warn!(reason = why, "replacing Kafka producer");
                let old = std::mem::replace(&mut *slot, Arc::new(p));
                drop(slot);
                self.replacements.fetch_add(1, Ordering::Relaxed);
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
    fn headers<'a>(
        mut all: Vec<CeHeader<'a>>,
        trace: Option<&'a HashMap<String, String>>,
    ) -> OwnedHeaders {
        if let Some(trace) = trace {
            all.retain(|(k, _)| k != "traceparent" && k != "tracestate");
            all.extend(
                trace
                    .iter()
                    .map(|(k, v)| (Cow::Borrowed(k.as_str()), Cow::Borrowed(v.as_str()))),
            );
        }
        let mut h = OwnedHeaders::new_with_capacity(all.len());
        for (k, v) in &all {
            h = h.insert(Header {
                key: k.as_ref(),
                value: Some(v.as_bytes()),
            });
        }
        h
    }

    /// Hands one line's records to librdkafka in order, stopping at the first it refuses.
    /// Each record gets a producer span (OpenTelemetry messaging conventions), a child of
    /// the event's own trace context, kept open until the line's acknowledgements are in.
    fn produce_line(&self, producer: &Arc<FutureProducer>, line: &[&StoredEvent]) -> ProducedLine {
        let mut futures = Vec::with_capacity(line.len());
        let mut spans = Vec::with_capacity(line.len());
        // A line is one key's events (or one unkeyed event): its topic's size limit and
        // its partition are read once, not per record (per record, the lookups took
        // about a tenth of the relay's CPU in a drain).
        let Some(first) = line.first() else {
            return (futures, None, spans);
        };
        let limit = self
            .topic_limits
            .as_ref()
            .and_then(|l| l.cached(&first.topic));
        let placement = self.partitions.place(
            &first.topic,
            first.key.as_deref().map(str::as_bytes),
            producer,
        );
        for e in line {
            debug_assert!(
                e.topic == first.topic && e.key == first.key,
                "one line, one key"
            );
            let span = tracing::info_span!(
                target: crate::telemetry::RECORD_SPANS,
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
            if let Some(Placement::Leaderless(p)) = placement {
                // Not queued in librdkafka: the relay probes the partition, and the
                // metadata is read again every second until it has a leader.
                span.record("otel.status_code", "ERROR");
                let d = Delivery::Failed(Failure::Transient {
                    error: format!(
                        "kafka: partition {p} of {} has no leader (cluster metadata)",
                        e.topic
                    ),
                });
                let stop = Stopped {
                    delivery: d,
                    transient: true,
                    broken: None,
                };
                return (futures, Some(stop), spans);
            }
            let ce = cloud_event_headers(e, &self.source);
            if let Some(too_large) = limit.and_then(|l| topic_limits::refusal_within(e, &ce, l)) {
                span.record("otel.status_code", "ERROR");
                let error = format!("kafka: not sent: {too_large}");
                let stop = Stopped {
                    delivery: Delivery::Failed(Failure::Counted {
                        error,
                        retry_at: None,
                    }),
                    transient: false,
                    broken: None,
                };
                return (futures, Some(stop), spans);
            }
            let mut record = FutureRecord::<str, [u8]>::to(&e.topic)
                .payload(&e.payload)
                .headers(Self::headers(ce, trace.as_ref()));
            if let Some(k) = &e.key {
                record = record.key(k.as_str());
            }
            if let Some(Placement::Partition(p)) = placement {
                record = record.partition(p);
            }
            match producer.send_result(record) {
                Ok(f) => {
                    futures.push(f);
                    spans.push(span);
                }
                Err((err, _)) => {
                    // Refused before it was sent: the record's own refusal (exact). A
                    // local refusal neither narrows nor makes the producer fatal, but a
                    // fatal producer refuses everything.
                    span.record("otel.status_code", "ERROR");
                    let f = failure(&err, decision_of(&err), true);
                    let broken = producer_lost(&err) || producer.client().fatal_error().is_some();
                    let stop = Stopped {
                        transient: f.is_transient(),
                        delivery: Delivery::Failed(f),
                        broken: broken.then(|| err.to_string()),
                    };
                    return (futures, Some(stop), spans);
                }
            }
        }
        (futures, None, spans)
    }
}

/// A line handed to librdkafka: its records' acknowledgements, the refusal that stopped
/// it (if any), and the records' producer spans.
type ProducedLine = (Vec<DeliveryFuture>, Option<Stopped>, Vec<tracing::Span>);

/// Why a line stopped before all its records were handed to librdkafka.
struct Stopped {
    /// The first record not handed over.
    delivery: Delivery,
    /// The environment's failure (no attempt spent).
    transient: bool,
    /// The producer can no longer deliver.
    broken: Option<String>,
}

/// What one line's acknowledgements said, beyond its deliveries.
#[derive(Default)]
struct LineNotes {
    delivered: bool,
    transient: bool,
    /// The broker refused a record of the line, or its topic, in a way that leaves the
    /// shared producer fatal (its topic is narrowed: `Narrow::Topic`).
    refused: bool,
    broken: Option<String>,
}

/// What a broker's refusal of a record's batch means for the line. `exact`: the record
/// was alone in its batch (a narrowed topic), so the refusal is its own and spends its
/// attempt when the code says the record is at fault; otherwise the batch may have been
/// refused for another record, and nothing is spent until narrowing finds the one at
/// fault.
fn refusal(err: &KafkaError, d: Decision, exact: bool) -> Delivery {
    if exact || d.attempt == Attempt::Keep {
        return Delivery::Failed(failure(err, d, exact));
    }
    Delivery::Failed(Failure::Transient {
        error: format!(
            "kafka: the broker refused a record batch holding this event ({err}); its \
             topic is published one record at a time until the record at fault is found"
        ),
    })
}

/// The topic a fatal produce error names ("ProduceRequest for <topic> [<partition>] ...",
/// librdkafka's form for every fatal error of a Produce response).
fn fatal_topic(why: &str) -> Option<&str> {
    let rest = why.strip_prefix("ProduceRequest for ")?;
    let (topic, _) = rest.split_once(" [")?;
    (!topic.is_empty() && !topic.contains(' ')).then_some(topic)
}

/// Whether `err` purged a record because the broker refused another batch, which the
/// gapless guarantee makes fatal to the whole producer.
fn purged_for_a_refusal(err: &KafkaError, producer: &Weak<FutureProducer>) -> bool {
    use rdkafka::types::RDKafkaErrorCode as C;
    matches!(
        err.rdkafka_error_code(),
        Some(C::PurgeQueue | C::PurgeInflight | C::Fatal)
    ) && producer
        .upgrade()
        .is_some_and(|p| matches!(p.client().fatal_error(), Some((C::GaplessGuarantee, _))))
}

/// The smallest `batch.size` set: below it, batches would hold few records for no gain
/// (a topic limit that low refuses most records anyway).
const MIN_BATCH_SIZE: usize = 4096;

/// How often a line waiting for acknowledgements looks whether its producer became fatal.
const FATAL_POLL: Duration = Duration::from_millis(50);

/// Resolves, with librdkafka's reason, once `producer` is fatal; never if it is gone
/// (its deliveries are then canceled).
async fn fatal(producer: &Weak<FutureProducer>) -> String {
    loop {
        match producer.upgrade() {
            Some(p) => {
                if let Some((_, why)) = p.client().fatal_error() {
                    return why;
                }
            }
            None => std::future::pending::<()>().await,
        }
        tokio::time::sleep(FATAL_POLL).await;
    }
}

/// What a cycle's lines on the main producer said about it.
#[derive(Default)]
struct CycleHealth {
    delivered: bool,
    transient: bool,
    broken: Option<String>,
}

impl CycleHealth {
    fn note(
        &mut self,
        sink: &KafkaSink,
        e: &StoredEvent,
        producer: &Arc<FutureProducer>,
        notes: LineNotes,
    ) {
        self.delivered |= notes.delivered || notes.refused;
        if notes.transient {
            // A line held back for a leaderless partition says nothing about the
            // producer: it must not count towards replacing it.
            self.transient |= !sink.leaderless(e, producer);
            sink.partitions.refresh(&e.topic, producer);
        }
        if notes.broken.is_some() {
            self.broken = notes.broken;
        }
    }
}

/// Lets go of a producer; the last holder of a replaced one drops it off the runtime
/// (dropping flushes for up to 500 ms).
fn release(producer: Arc<FutureProducer>) {
    if Arc::strong_count(&producer) == 1 {
        tokio::task::spawn_blocking(move || drop(producer));
    }
}

/// Awaits a line's acknowledgements in order until `deadline`. After the first record
/// that is not acknowledged, later ones are reported only if they already were (a gap
/// the relay counts as `delivered_after_failure`); otherwise they were not attempted.
/// `exact`: each record was alone in its batch (see [`refusal`]). `producer`: the one
/// the line went through.
async fn await_line(
    futures: Vec<DeliveryFuture>,
    refused: Option<Stopped>,
    len: usize,
    deadline: tokio::time::Instant,
    timeout: Duration,
    exact: bool,
    producer: Weak<FutureProducer>,
) -> (Vec<Delivery>, LineNotes, Vec<DeliveryFuture>) {
    let mut out = vec![Delivery::NotAttempted; len];
    let mut notes = LineNotes::default();
    let mut failed = false;
    let sent = futures.len();
    // Records librdkafka has not reported yet: it still holds them.
    let mut unreported = Vec::new();
    for (i, mut fut) in futures.into_iter().enumerate() {
        if failed {
            // Only an acknowledgement that has already arrived can be a gap.
            match (&mut fut).now_or_never() {
                Some(Ok(Ok(_))) => out[i] = Delivery::Delivered,
                Some(_) => {}
                None => unreported.push(fut),
            }
            continue;
        }
        let waited = tokio::select! {
            biased;
            r = &mut fut => Ok(r),
            why = fatal(&producer) => {
                // The producer is fatal: it sends nothing more, and what it still holds
                // would only be reported at the deadline. The record goes again at once
                // on the new producer (as a purged one does), not at the deadline.
                notes.broken = Some(why);
                failed = true;
                unreported.push(fut);
                continue;
            }
            () = tokio::time::sleep_until(deadline) => Err(()),
        };
        if waited.is_err() {
            unreported.push(fut);
        }
        out[i] = match waited {
            Ok(Ok(Ok(_))) => {
                notes.delivered = true;
                Delivery::Delivered
            }
            Ok(Ok(Err((err, _)))) if purged_for_a_refusal(&err, &producer) => {
                // Not this record's doing, nor an outage: it goes again at once, on the
                // new producer, and its topic is not taken for down.
                notes.broken = Some(err.to_string());
                Delivery::NotAttempted
            }
            Ok(Ok(Err((err, _)))) => {
                let d = decision_of(&err);
                if d.replace_producer {
                    notes.broken = Some(err.to_string());
                }
                if d.narrow == Narrow::Topic {
                    // The broker refused the batch or the topic (`classify`).
                    notes.refused = true;
                    refusal(&err, d, exact)
                } else {
                    let f = failure(&err, d, exact);
                    notes.transient |= f.is_transient();
                    Delivery::Failed(f)
                }
            }
            Ok(Err(_canceled)) => {
                notes.transient = true;
                Delivery::Failed(Failure::Transient {
                    error: "kafka: delivery canceled (producer replaced)".into(),
                })
            }
            Err(()) => {
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
    if let Some(stop) = refused
        && !failed
    {
        notes.transient |= stop.transient;
        if stop.broken.is_some() {
            notes.broken = stop.broken;
        }
        out[sent] = stop.delivery;
    }
    (out, notes, unreported)
}

/// Keeps a line counted as held by its producer (`pauses`) until librdkafka has
/// reported each of `unreported` (delivered, failed or purged), or the producer is gone.
fn track(unreported: Vec<DeliveryFuture>, held: pauses::HeldLine, producer: Weak<FutureProducer>) {
    if unreported.is_empty() {
        return;
    }
    tokio::spawn(async move {
        tokio::select! {
            _ = futures::future::join_all(unreported) => {}
            () = gone(&producer) => {}
        }
        drop(held);
    });
}

/// Resolves once `producer` is dropped.
async fn gone(producer: &Weak<FutureProducer>) {
    while producer.strong_count() > 0 {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[async_trait::async_trait]
impl Sink for KafkaSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        super::deliver_by_line(self, lines).await
    }

    async fn deliver_each(&self, lines: &[Vec<&StoredEvent>], done: LineDone<'_>) {
        let mut producer = self.healthy_producer();
        self.learn_topics(lines, &producer).await;
        if self.fit_batches(lines) {
            release(producer);
            producer = self.current();
        }
        let deadline = tokio::time::Instant::now() + self.deadline;
        let narrowed: Vec<bool> = lines
            .iter()
            .map(|l| {
                l.first()
                    .is_some_and(|e| self.narrowed.is_narrowed(&e.topic))
            })
            .collect();
        let careful = self.narrowed_producer(&narrowed);
        // Every line is handed to librdkafka first, so the whole cycle is pipelined.
        let mut running = FuturesUnordered::new();
        // Lines of a topic paused since they were claimed: not handed over. A pause
        // read meanwhile waits for the hand-over (`pauses`).
        let paused = {
            let mut paused = Vec::new();
            let mut gate = self.pauses.gate();
            for (i, line) in lines.iter().enumerate() {
                let topic = line.first().map(|e| e.topic.as_str());
                if topic.is_some_and(|t| gate.paused(t)) {
                    paused.push(i);
                    continue;
                }
                let (through, head_only) = match (&careful, narrowed[i]) {
                    // A narrowed topic: the line's head alone, in a batch of its own.
                    (Some(careful), true) => (careful.clone(), true),
                    _ => (producer.clone(), false),
                };
                let sent = if head_only { &line[..1] } else { &line[..] };
                let (futures, refused, spans) = self.produce_line(&through, sent);
                let held = match topic {
                    Some(t) if !futures.is_empty() => Some(gate.hold(&through, t)),
                    _ => None,
                };
                let through = Arc::downgrade(&through);
                let (len, timeout) = (line.len(), self.deadline);
                running.push(async move {
                    let (d, notes, unreported) = await_line(
                        futures,
                        refused,
                        len,
                        deadline,
                        timeout,
                        head_only,
                        through.clone(),
                    )
                    .await;
                    // The line's records stay held until librdkafka reports them all.
                    if let Some(held) = held {
                        track(unreported, held, through);
                    }
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
            paused
        };
        for i in paused {
            done(i, vec![Delivery::NotAttempted; lines[i].len()]);
        }
        let mut health = CycleHealth::default();
        while let Some((i, d, notes)) = running.next().await {
            let Some(e) = lines[i].first() else {
                done(i, d);
                continue;
            };
            if notes.refused {
                self.narrowed.narrow(&e.topic);
            }
            if let (true, Some(careful)) = (narrowed[i], &careful) {
                // The narrowed topics' producer answers for itself only. It is not
                // idempotent: a broker's refusal leaves it working, and it is replaced
                // only when it is fatal.
                if let Some((_, why)) = careful.client().fatal_error() {
                    self.narrowed.replace(&why);
                }
                if notes.transient || notes.refused {
                    // A refused topic (an ACL revoked) is marked in error in this
                    // producer, which then refuses its records locally until its
                    // metadata is read again: read it, so that a restored ACL is seen.
                    self.partitions.refresh(&e.topic, careful);
                }
            } else {
                health.note(self, e, &producer, notes);
            }
            done(i, d);
        }
        self.judge(&producer, health);
        release(producer);
    }

    fn topic_limits(&self) -> Option<topic_limits::TopicLimits> {
        self.topic_limits.clone()
    }

    fn follows_pauses(&self) -> bool {
        true
    }

    /// Purges every producer that still holds records of a topic newly paused
    /// (`pauses`): the shared one is replaced first, so that new records go to a fresh
    /// producer while the old one's queues are emptied at once (not when the last cycle
    /// holding it lets it go).
    fn paused(&self, topics: &std::collections::HashSet<String>) {
        let (held, producers) = self.pauses.update(topics);
        if producers.is_empty() {
            return;
        }
        tracing::warn!(
            topics = ?held,
            producers = producers.len(),
            "paused topics still had records in the Kafka producer: purging it (every \
             record it held, of any topic, goes again later, no attempt spent)"
        );
        self.pause_purges.fetch_add(1, Ordering::Relaxed);
        for p in producers {
            if Arc::ptr_eq(&p, &self.current()) {
                self.replace(&p, &format!("paused topics {held:?} had records in it"));
            }
            p.purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
            // Dropping the last holder of a producer flushes it: a blocking thread here.
            drop(p);
        }
    }

    fn domain(&self, e: &StoredEvent) -> String {
        match self.partition(e, &self.current()) {
            Some(p) => format!("{}[{p}]", e.topic),
            None => e.topic.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// librdkafka's fatal produce errors name their topic; a topic is read from them,
    /// and nothing from any other message.
    #[test]
    fn a_fatal_error_names_its_topic() {
        let why = "ProduceRequest for acl.orders [2] with 3 message(s) failed: Broker: \
                   Topic authorization failed (broker 1 PID{Id:1,Epoch:0}, base seq 0): \
                   unable to satisfy gap-less guarantee";
        assert_eq!(fatal_topic(why), Some("acl.orders"));
        assert_eq!(fatal_topic("Local: Fatal error"), None);
        assert_eq!(fatal_topic("ProduceRequest for  [2]"), None);
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

//! Kafka intake for one subscription: consume, store in the inbox (deduplicated), and
//! only then commit the offsets. A crash between the insert and the commit redelivers
//! records, which the dedup key drops; nothing is ever committed before it is stored.
//!
//! No record can stall a subscription: records are bounded by `Receive`'s limits before
//! they reach the database (over-long ids hashed, a record breaking a limit stored as
//! `failed` with the reason), and a batch the database still refuses is split until the
//! refused record is alone; that record is stored as `failed` without the parts that can
//! be refused, or, if even that is refused, counted and logged. Offsets then move on.
//! Only an unreachable database holds the offsets back (the batch is retried).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::SubscriptionConfig;
use super::identity;
use super::legacy;
use super::record::{Place, Record};
use super::rewind::{self, LogWatch};
use super::structured::{self, StructuredEvent};
use super::supervisor::panic_text;
use crate::domain::InboundMessage;
use crate::domain::Limits;
use crate::domain::headers::{self, text};
use crate::store::{Admission, Store, StoreError};

/// Records stored per insert at most.
const MAX_BATCH: usize = 500;

/// Longest message type, as for `Receive`.
const MAX_TYPE_BYTES: usize = 256;

/// How often an inbox consumer refreshes topic metadata unless the Kafka properties say
/// otherwise: a topic created after the subscription started is seen within this time
/// (librdkafka's default is 5 minutes).
pub const METADATA_REFRESH_MS: u32 = 3000;

/// Intake counters.
#[derive(Debug, Default)]
pub struct IntakeStats {
    /// Records read from Kafka.
    pub received: AtomicU64,
    /// Records dropped as duplicates.
    pub duplicates: AtomicU64,
    /// Records stored as `failed` at intake: over the limits, or refused by the database
    /// and stored stripped.
    pub failed: AtomicU64,
    /// Records the database refused even stripped to their place in the log: skipped
    /// (logged with topic, partition and offset).
    pub unstorable: AtomicU64,
    /// Partitions sent back to their log start because their topic has a new id.
    pub recreated: AtomicU64,
    /// Partitions sent back to their log start because the position was past its end.
    pub truncated: AtomicU64,
    /// Partitions moved back by an operator's rewind (`RewindSubscription`).
    pub rewound: AtomicU64,
}

/// The dedup identity of a record (see [`identity`]): (`ce_source`, `ce_id`) when it
/// has a `ce_id` header, else (`source`, `id`) of its structured CloudEvent, else its
/// place in the log and its timestamp.
pub fn message_id(r: &Record, event: Option<&StructuredEvent>) -> String {
    match (r.header("ce_id"), event) {
        (Some(id), _) => identity::cloud_event(r.header("ce_source").unwrap_or_default(), id),
        (None, Some(e)) => identity::cloud_event(e.source.as_bytes(), e.id.as_bytes()),
        (None, None) => r.place().identity(),
    }
}

/// The record's structured CloudEvent, unless it is a binary-mode one (a `ce_id` header
/// decides, as it always has). One that cannot be read is delivered as a plain record.
fn structured_event(r: &Record) -> Option<StructuredEvent> {
    if r.header("ce_id").is_some() {
        return None;
    }
    match structured::read(r)? {
        Ok(e) => Some(e),
        Err(why) => {
            tracing::debug!(topic = %r.topic, partition = r.partition, offset = r.offset,
                error = %why, "malformed structured CloudEvent: identified by its place");
            None
        }
    }
}

/// A record as an inbox message, within `Receive`'s limits: a key, headers or type over
/// them, or a payload over `max_payload_bytes`, make the message `failed` at once (the
/// reason is its last error), with the key replaced by `sha256:<hex>` and the headers
/// cut to the limits so that the row can always be stored. Headers the text map cannot
/// hold exactly are kept as bytes too (`domain::headers`). A structured CloudEvent's
/// attributes join the map as `ce_<name>` (binary mode's names), where no header of the
/// record has that name and within the limits.
pub fn inbound(m: &Record, max_attempts: u32, limits: &Limits) -> InboundMessage {
    let event = structured_event(m);
    let mut problems = Vec::new();
    let headers = inbound_headers(m, event.as_ref(), limits, &mut problems);
    let key = inbound_key(m, limits, &mut problems);
    let payload = m.payload.as_deref().unwrap_or_default();
    if payload.len() > limits.max_payload_bytes {
        problems.push(format!(
            "payload is {} bytes: the limit is {}",
            payload.len(),
            limits.max_payload_bytes
        ));
    }
    let event_type = m
        .header("ce_type")
        .map(text)
        .or_else(|| event.as_ref().and_then(|e| e.event_type.clone()))
        .filter(|t| {
            let ok = t.len() <= MAX_TYPE_BYTES;
            if !ok {
                problems.push(format!(
                    "ce_type is {} bytes: the limit is {MAX_TYPE_BYTES}",
                    t.len()
                ));
            }
            ok
        });
    InboundMessage {
        message_id: message_id(m, event.as_ref()),
        topic: m.topic.clone(),
        key,
        payload: payload.to_vec(),
        event_type,
        headers,
        max_attempts,
        failure: (!problems.is_empty())
            .then(|| format!("over the inbox limits: {}", problems.join("; "))),
    }
}

/// The headers stored with a record: its own (as text) within the limits, a structured
/// CloudEvent's attributes when they fit, and the exact bytes (record headers, binary
/// key) when the text map cannot stand for them.
fn inbound_headers(
    m: &Record,
    event: Option<&StructuredEvent>,
    limits: &Limits,
    problems: &mut Vec<String>,
) -> BTreeMap<String, String> {
    let mut headers = BTreeMap::new();
    let (mut count, mut bytes, mut kept_bytes, mut cut) = (0usize, 0usize, 0usize, 0usize);
    for x in &m.headers {
        let (k, v) = (text(&x.name), text(x.value.as_deref().unwrap_or_default()));
        count += 1;
        bytes += k.len() + v.len();
        if headers.len() < limits.max_headers
            && kept_bytes + k.len() + v.len() <= limits.max_header_bytes
        {
            kept_bytes += k.len() + v.len();
            headers.insert(k, v);
        } else {
            cut += 1;
        }
    }
    let raw_bytes: usize = m
        .headers
        .iter()
        .map(|h| h.name.len() + h.value.as_ref().map_or(0, Vec::len))
        .sum();
    // A record's own headers by these names are kept in the exact list, never taken for
    // mailroom's.
    headers.remove(headers::RECORD_HEADERS);
    headers.remove(headers::RECORD_KEY);
    let within = count <= limits.max_headers && bytes <= limits.max_header_bytes;
    let mut shown = false;
    for (k, v) in event
        .into_iter()
        .flat_map(|e| &e.attributes)
        .filter(|_| within)
    {
        if !headers.contains_key(k)
            && headers.len() < limits.max_headers
            && kept_bytes + k.len() + v.len() <= limits.max_header_bytes
        {
            kept_bytes += k.len() + v.len();
            headers.insert(k.clone(), v.clone());
            shown = true;
        }
    }
    // With attributes in the map, the map is no longer the record's headers: keep those.
    if (shown || !headers::map_is_exact(&m.headers)) && raw_bytes <= limits.max_header_bytes {
        headers.insert(
            headers::RECORD_HEADERS.to_string(),
            headers::encode(&m.headers),
        );
    }
    if count > limits.max_headers || bytes > limits.max_header_bytes {
        problems.push(format!(
            "{count} headers of {bytes} bytes: the limits are {} headers and {} bytes \
             ({cut} not stored)",
            limits.max_headers, limits.max_header_bytes
        ));
    }
    if let Some(k) = m
        .key
        .as_deref()
        .filter(|k| !k.is_empty() && !headers::is_exact_text(k) && k.len() <= limits.max_key_bytes)
    {
        headers.insert(headers::RECORD_KEY.to_string(), headers::encode_key(k));
    }
    headers
}

/// The record's key as stored: its text, or its SHA-256 when over the limit.
fn inbound_key(m: &Record, limits: &Limits, problems: &mut Vec<String>) -> Option<String> {
    m.key.as_deref().filter(|k| !k.is_empty()).map(|k| {
        // Measured as stored: each invalid UTF-8 byte becomes a 3-byte U+FFFD.
        let t = text(k);
        if t.len() > limits.max_key_bytes {
            problems.push(format!(
                "key is {} bytes: the limit is {} (stored as its SHA-256)",
                t.len(),
                limits.max_key_bytes
            ));
            format!("sha256:{}", identity::sha256_hex(&[k]))
        } else {
            t
        }
    })
}

/// The consumer's librdkafka settings: manual offset commits, from the earliest offset.
pub fn consumer_config(
    brokers: &str,
    group: &str,
    extra: &BTreeMap<String, String>,
) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set(
            "topic.metadata.refresh.interval.ms",
            METADATA_REFRESH_MS.to_string(),
        )
        .set("client.id", "mailroom-inbox");
    for (k, v) in extra {
        c.set(k, v);
    }
    // Offsets are committed by hand, after the inbox insert has committed.
    c.set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    c
}

/// Stores a batch, but for records an older version stored under their place alone
/// (`legacy`: duplicates). An unreachable database (any error but a refusal) is
/// returned: the caller retries the whole batch, and records already stored come back
/// as duplicates.
pub async fn store_batch(
    store: &dyn Store,
    subscription: &str,
    messages: &[InboundMessage],
    places: &[Place],
    stats: &IntakeStats,
) -> Result<(), StoreError> {
    let held = match legacy::stored_untimed(store, subscription, messages, places).await {
        Ok(held) => held,
        // Never a reason to stall: at worst an old record is handled once more.
        Err(StoreError::Refused(error)) => {
            tracing::warn!(
                subscription,
                %error,
                "looking up place-only ids refused; skipped"
            );
            vec![None; messages.len()]
        }
        Err(e) => return Err(e),
    };
    let known = held.iter().flatten().count();
    if known == 0 {
        return store_split(store, subscription, messages, places, stats).await;
    }
    let (rest, rest_places): (Vec<InboundMessage>, Vec<Place>) = messages
        .iter()
        .zip(places)
        .zip(&held)
        .filter(|(_, h)| h.is_none())
        .map(|((m, p), _)| (m.clone(), p.clone()))
        .unzip();
    store_split(store, subscription, &rest, &rest_places, stats).await?;
    tracing::debug!(
        subscription,
        known,
        "records stored before under their place alone"
    );
    stats.duplicates.fetch_add(known as u64, Ordering::Relaxed);
    Ok(())
}

/// Stores a batch, isolating records the database refuses: a refused batch is split in
/// halves (in order) until the refused record is alone, which is then quarantined.
async fn store_split(
    store: &dyn Store,
    subscription: &str,
    messages: &[InboundMessage],
    places: &[Place],
    stats: &IntakeStats,
) -> Result<(), StoreError> {
    let mut todo = vec![(0, messages.len())];
    while let Some((lo, hi)) = todo.pop() {
        if lo >= hi {
            continue;
        }
        match store.receive(subscription, &messages[lo..hi]).await {
            Ok(admissions) => count(stats, &messages[lo..hi], &admissions),
            Err(StoreError::Refused(error)) if hi - lo > 1 => {
                tracing::debug!(
                    subscription,
                    %error,
                    lo,
                    hi,
                    "inbox insert refused; splitting the batch"
                );
                let mid = lo + (hi - lo) / 2;
                todo.push((mid, hi));
                todo.push((lo, mid));
            }
            Err(StoreError::Refused(error)) => {
                quarantine(
                    store,
                    subscription,
                    &messages[lo],
                    &places[lo],
                    &error.to_string(),
                    stats,
                )
                .await?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn count(stats: &IntakeStats, messages: &[InboundMessage], admissions: &[Admission]) {
    for (m, a) in messages.iter().zip(admissions) {
        match a {
            Admission::Duplicate(_) => {
                stats.duplicates.fetch_add(1, Ordering::Relaxed);
            }
            Admission::Inserted(id) if m.failure.is_some() => {
                stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(inbox_id = id, topic = %m.topic, message_id = %m.message_id,
                    reason = m.failure.as_deref().unwrap_or_default(), "record stored as failed");
            }
            _ => {}
        }
    }
}

/// Stores one record the database refused as `failed`: first without its key, headers
/// and type (the text parts), then, if that is refused too, as its place in the log
/// only. If even that is refused, the record is counted as unstorable and logged.
async fn quarantine(
    store: &dyn Store,
    subscription: &str,
    m: &InboundMessage,
    place: &Place,
    error: &str,
    stats: &IntakeStats,
) -> Result<(), StoreError> {
    let why = format!("the database refused this record ({error})");
    let stripped = InboundMessage {
        key: None,
        headers: BTreeMap::new(),
        event_type: None,
        failure: Some(format!("{why}; stored without its key, headers and type")),
        ..m.clone()
    };
    let bare = InboundMessage {
        message_id: place.identity(),
        payload: Vec::new(),
        failure: Some(format!(
            "{why}; stored without its content: read it at {}:{}:{}",
            place.topic, place.partition, place.offset
        )),
        ..stripped.clone()
    };
    let mut last = error.to_string();
    for q in [stripped, bare] {
        match store.receive(subscription, std::slice::from_ref(&q)).await {
            Ok(a) => {
                count(stats, std::slice::from_ref(&q), &a);
                return Ok(());
            }
            Err(StoreError::Refused(e)) => last = e.to_string(),
            Err(e) => return Err(e),
        }
    }
    stats.unstorable.fetch_add(1, Ordering::Relaxed);
    tracing::error!(
        subscription, topic = %place.topic, partition = place.partition, offset = place.offset,
        error = %last, "the database refuses this record in every form: skipped"
    );
    Ok(())
}

/// Injected faults (testing only): a record whose payload contains `record_panic`
/// panics while it is read into an inbox message; one containing `task_panic` panics the
/// consumer task itself, at most [`TASK_PANICS`] times per process.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConsumerFaults {
    /// Marker of records whose conversion panics.
    pub record_panic: Option<String>,
    /// Marker of records that kill the consumer task.
    pub task_panic: Option<String>,
}

/// How many times `ConsumerFaults::task_panic` kills a task in one process.
pub const TASK_PANICS: u64 = 3;

static TASK_PANICS_SO_FAR: AtomicU64 = AtomicU64::new(0);

fn contains(haystack: &[u8], marker: &Option<String>) -> bool {
    marker
        .as_deref()
        .is_some_and(|m| !m.is_empty() && haystack.windows(m.len()).any(|w| w == m.as_bytes()))
}

/// [`inbound`], contained: a record whose conversion panics is stored `failed` with the
/// panic as its reason, under its place in the log, instead of killing the consumer.
pub fn inbound_contained(
    r: &Record,
    max_attempts: u32,
    limits: &Limits,
    faults: &ConsumerFaults,
) -> InboundMessage {
    let run = std::panic::AssertUnwindSafe(|| {
        if contains(
            r.payload.as_deref().unwrap_or_default(),
            &faults.record_panic,
        ) {
            panic!("injected fault: record_panic");
        }
        inbound(r, max_attempts, limits)
    });
    match std::panic::catch_unwind(run) {
        Ok(m) => m,
        Err(panic) => {
            let why = panic_text(panic.as_ref());
            tracing::error!(topic = %r.topic, partition = r.partition, offset = r.offset,
                panic = %why, "reading this record panicked: stored as failed");
            InboundMessage {
                message_id: r.place().identity(),
                topic: r.topic.clone(),
                key: None,
                payload: Vec::new(),
                event_type: None,
                headers: BTreeMap::new(),
                max_attempts,
                failure: Some(format!(
                    "mailroom could not read this record ({why}); stored without its \
                     content: read it at {}:{}:{}",
                    r.topic, r.partition, r.offset
                )),
            }
        }
    }
}

/// Runs one subscription's consumer until `shutdown`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    store: Arc<dyn Store>,
    sub: SubscriptionConfig,
    config: ClientConfig,
    limits: Limits,
    faults: ConsumerFaults,
    wake: Arc<Notify>,
    stats: Arc<IntakeStats>,
    shutdown: CancellationToken,
) {
    let consumer: Arc<StreamConsumer> = match config.create() {
        Ok(c) => Arc::new(c),
        Err(e) => {
            tracing::error!(subscription = %sub.name, error = %e, "cannot create Kafka consumer");
            return;
        }
    };
    let topics: Vec<&str> = sub.topics.iter().map(String::as_str).collect();
    if let Err(e) = consumer.subscribe(&topics) {
        tracing::error!(subscription = %sub.name, error = %e, "cannot subscribe");
        return;
    }
    let mut watch = Some(LogWatch::new(&sub.name, &sub.topics));
    let mut rewinds = super::rewind_to::Rewinds::new(store.clone(), &sub.name, config.clone());

    let mut check = tokio::time::interval(rewind::CHECK_EVERY);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let batch = match next_batch(&consumer, &sub.name, &mut check, &shutdown).await {
            Next::Shutdown => return,
            Next::Check => {
                // Between batches only: a rewind never crosses a batch being stored.
                let mut w = watch
                    .take()
                    .unwrap_or_else(|| LogWatch::new(&sub.name, &sub.topics));
                let c = consumer.clone();
                let checked = tokio::task::spawn_blocking(move || {
                    let rewound = w.check(&c);
                    (w, rewound)
                });
                let checked = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    r = checked => r,
                };
                // A check that panicked starts over with a fresh view of the topics.
                let (w, rewound) = checked.unwrap_or_else(|_| {
                    (LogWatch::new(&sub.name, &sub.topics), Default::default())
                });
                watch = Some(w);
                stats
                    .recreated
                    .fetch_add(rewound.recreated, Ordering::Relaxed);
                stats
                    .truncated
                    .fetch_add(rewound.truncated, Ordering::Relaxed);
                let moved = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    moved = rewinds.apply(&consumer) => moved,
                };
                stats.rewound.fetch_add(moved, Ordering::Relaxed);
                continue;
            }
            Next::Batch(batch) => batch,
        };
        for r in &batch {
            if contains(r.payload.as_deref().unwrap_or_default(), &faults.task_panic)
                && TASK_PANICS_SO_FAR.fetch_add(1, Ordering::Relaxed) < TASK_PANICS
            {
                panic!(
                    "injected fault: task_panic at {}:{}:{}",
                    r.topic, r.partition, r.offset
                );
            }
        }
        rewinds.prepare(&batch).await;
        let messages: Vec<InboundMessage> = batch
            .iter()
            .map(|r| {
                let mut m = inbound_contained(r, sub.retry.max_attempts, &limits, &faults);
                rewinds.tag(r, &mut m);
                m
            })
            .collect();
        let places: Vec<Place> = batch.iter().map(Record::place).collect();
        let span = receive_span(&sub, &messages);
        let stored = store_until_stored(&*store, &sub.name, &messages, &places, &stats, &shutdown);
        if !tracing::Instrument::instrument(stored, span).await {
            return;
        }
        stats
            .received
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        wake.notify_one();
        commit(&consumer, &sub.name, &places);
    }
}

/// The most producers' traces one receive span links to.
const MAX_LINKS: usize = 128;

/// A consumer span per batch taken in (OpenTelemetry messaging conventions: `receive`,
/// kind consumer), linked to each record's producer trace (its `traceparent`, up to
/// `MAX_LINKS`). The handler call of each message is a child of the producer's trace
/// itself (`handler`'s process span).
fn receive_span(sub: &SubscriptionConfig, messages: &[InboundMessage]) -> tracing::Span {
    let topic = messages
        .first()
        .map(|m| m.topic.as_str())
        .filter(|t| messages.iter().all(|m| m.topic == *t));
    let span = tracing::info_span!(
        "receive",
        otel.name = %topic.map_or_else(|| "receive".to_string(), |t| format!("receive {t}")),
        otel.kind = "consumer",
        messaging.system = "kafka",
        messaging.operation.type = "receive",
        messaging.operation.name = "poll",
        messaging.destination.name = topic.unwrap_or(""),
        messaging.destination.subscription.name = %sub.name,
        messaging.consumer.group.name = %sub.group,
        messaging.batch.message_count = messages.len(),
    );
    for m in messages.iter().take(MAX_LINKS) {
        crate::telemetry::link_to(
            &span,
            m.headers.get("traceparent").map(String::as_str),
            m.headers.get("tracestate").map(String::as_str),
        );
    }
    span
}

/// What the consumer does next.
enum Next {
    /// Store these records.
    Batch(Vec<Record>),
    /// Look for a replaced log (`rewind`).
    Check,
    Shutdown,
}

/// The next records (up to `MAX_BATCH`, gathered for 5 ms after the first), copied out
/// as bytes; or a check when `check` ticks while no record has come.
async fn next_batch(
    consumer: &StreamConsumer,
    subscription: &str,
    check: &mut tokio::time::Interval,
    shutdown: &CancellationToken,
) -> Next {
    let first = loop {
        let m = tokio::select! {
            _ = shutdown.cancelled() => return Next::Shutdown,
            _ = check.tick() => return Next::Check,
            m = consumer.recv() => m,
        };
        match m {
            Ok(m) => break Record::read(&m),
            Err(e) => {
                tracing::warn!(subscription, error = %e, "consumer error");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let mut batch = vec![first];
    while batch.len() < MAX_BATCH {
        match tokio::time::timeout(Duration::from_millis(5), consumer.recv()).await {
            Ok(Ok(m)) => batch.push(Record::read(&m)),
            _ => break,
        }
    }
    Next::Batch(batch)
}

/// Stores a batch before its offsets are committed, retrying while the database is
/// unreachable; `false` on shutdown.
async fn store_until_stored(
    store: &dyn Store,
    subscription: &str,
    messages: &[InboundMessage],
    places: &[Place],
    stats: &IntakeStats,
    shutdown: &CancellationToken,
) -> bool {
    let mut pause = Duration::from_millis(100);
    loop {
        match store_batch(store, subscription, messages, places, stats).await {
            Ok(()) => return true,
            Err(e) => {
                tracing::warn!(subscription, error = %e, "inbox insert failed; retrying, offsets not committed");
                tokio::select! {
                    _ = shutdown.cancelled() => return false,
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Commits the offsets after `places` (asynchronously: a failed commit redelivers
/// records the dedup key then drops).
fn commit(consumer: &StreamConsumer, subscription: &str, places: &[Place]) {
    let mut next: HashMap<(&str, i32), i64> = HashMap::new();
    for p in places {
        let e = next.entry((p.topic.as_str(), p.partition)).or_default();
        *e = (*e).max(p.offset + 1);
    }
    let mut tpl = TopicPartitionList::new();
    for ((t, p), o) in next {
        if let Err(e) = tpl.add_partition_offset(t, p, Offset::Offset(o)) {
            tracing::warn!(error = %e, "bad offset");
        }
    }
    if let Err(e) = consumer.commit(&tpl, CommitMode::Async) {
        // Not fatal: the records are stored; a redelivery is dropped as a duplicate.
        tracing::warn!(subscription, error = %e, "offset commit failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::headers::RecordHeader;

    fn record(key: &[u8], headers: &[(&str, &[u8])]) -> Record {
        raw_record(
            key,
            headers
                .iter()
                .map(|(k, v)| RecordHeader {
                    name: k.as_bytes().to_vec(),
                    value: Some(v.to_vec()),
                })
                .collect(),
        )
    }

    fn raw_record(key: &[u8], headers: Vec<RecordHeader>) -> Record {
        Record {
            topic: "t".into(),
            partition: 0,
            offset: 7,
            timestamp_ms: None,
            key: Some(key.to_vec()),
            payload: Some(b"payload\0ok".to_vec()),
            headers,
        }
    }

    #[test]
    fn raw_header_bytes_are_kept_exactly_beside_the_text_map() {
        let list = vec![
            RecordHeader {
                name: b"\xc3\x28bad".to_vec(),
                value: Some(b"\xff".to_vec()),
            },
            RecordHeader {
                name: b"ce_id".to_vec(),
                value: Some(b"1".to_vec()),
            },
            RecordHeader {
                name: b"empty".to_vec(),
                value: None,
            },
        ];
        let i = inbound(
            &raw_record(b"\x00\x01", list.clone()),
            3,
            &Limits::default(),
        );
        assert_eq!(i.failure, None);
        assert_eq!(i.headers["\u{FFFD}(bad"], "\u{FFFD}");
        assert_eq!(
            headers::decode(&i.headers[headers::RECORD_HEADERS]),
            Some(list)
        );
        assert_eq!(
            i.headers[headers::RECORD_KEY],
            "AAE=",
            "the key's bytes, base64"
        );
        let plain = inbound(&record(b"k", &[("a", b"b")]), 3, &Limits::default());
        assert!(!plain.headers.contains_key(headers::RECORD_HEADERS));
        let spoof = inbound(
            &record(b"k", &[(headers::RECORD_KEY, b"c3Bvb2Y=")]),
            3,
            &Limits::default(),
        );
        assert!(
            !spoof.headers.contains_key(headers::RECORD_KEY),
            "not taken for ours"
        );
        assert_eq!(
            headers::decode(&spoof.headers[headers::RECORD_HEADERS]).map(|l| l.len()),
            Some(1),
            "kept in the exact list"
        );
    }

    #[test]
    fn a_record_whose_reading_panics_is_stored_failed_at_its_place() {
        let faults = ConsumerFaults {
            record_panic: Some("ok".into()),
            task_panic: None,
        };
        let i = inbound_contained(&record(b"k", &[]), 3, &Limits::default(), &faults);
        assert_eq!(i.message_id, "kafka:t:0:7");
        let why = i.failure.unwrap_or_default();
        assert!(why.contains("injected fault: record_panic"), "{why}");
        assert!(why.contains("t:0:7"), "{why}");
    }

    #[test]
    fn nul_characters_never_reach_the_store() {
        let m = record(b"k\0ey", &[("ab", b"x\0y"), ("ce_id", b"id\0")]);
        let i = inbound(&m, 3, &Limits::default());
        assert_eq!(i.key.as_deref(), Some("k\u{FFFD}ey"));
        assert!(!i.message_id.contains('\0'));
        assert_eq!(i.headers["ab"], "x\u{FFFD}y");
        assert_eq!(
            i.payload, b"payload\0ok",
            "the payload is bytes and stays as it is"
        );
        assert_eq!(i.failure, None);
    }

    #[test]
    fn the_identity_is_source_and_id_or_the_place_in_the_log() {
        let id = |r: &Record| inbound(r, 3, &Limits::default()).message_id;
        let a = record(b"k", &[("ce_id", b"1"), ("ce_source", b"billing")]);
        let b = record(b"k", &[("ce_id", b"1"), ("ce_source", b"mailroom/x")]);
        let mut c = record(b"k", &[]);
        assert_eq!(id(&a), "ce:7:billing:1");
        assert_ne!(id(&a), id(&b));
        assert_eq!(id(&c), "kafka:t:0:7", "no timestamp: the place alone");
        c.timestamp_ms = Some(1_764_600_000_123);
        assert_eq!(id(&c), "kafka:t:0:7@1764600000123");
    }

    const STRUCTURED: &[u8] = br#"{"specversion":"1.0","id":"1","source":"billing",
        "type":"invoice.paid","data":{"n":1}}"#;

    fn structured(headers: &[(&str, &[u8])], value: &[u8]) -> Record {
        let mut r = record(b"k", headers);
        r.payload = Some(value.to_vec());
        r.timestamp_ms = Some(42);
        r
    }

    #[test]
    fn a_structured_cloud_event_is_identified_as_its_binary_twin() {
        let ct: (&str, &[u8]) = (
            "content-type",
            b"application/cloudevents+json; charset=utf-8",
        );
        let binary = record(b"k", &[("ce_id", b"1"), ("ce_source", b"billing")]);
        let twin = inbound(&structured(&[ct], STRUCTURED), 3, &Limits::default());
        assert_eq!(
            twin.message_id,
            inbound(&binary, 3, &Limits::default()).message_id
        );
        assert_eq!(twin.event_type.as_deref(), Some("invoice.paid"));
        assert_eq!(twin.payload, STRUCTURED, "the value as it came");
        // A ce_id header decides, as before: the value is not read.
        let both = structured(&[ct, ("ce_id", b"h"), ("ce_source", b"s")], STRUCTURED);
        assert_eq!(inbound(&both, 3, &Limits::default()).message_id, "ce:1:s:h");
        // Malformed: delivered, identified by its place.
        for bad in [&b"{not json"[..], br#"{"source":"billing"}"#, b""] {
            let m = inbound(&structured(&[ct], bad), 3, &Limits::default());
            assert_eq!(m.message_id, "kafka:t:0:7@42");
            assert_eq!((m.failure, m.event_type), (None, None));
        }
    }

    #[test]
    fn structured_attributes_join_the_map_and_the_record_headers_stay_exact() {
        let ct: (&str, &[u8]) = ("content-type", b"application/cloudevents+json");
        let r = structured(&[ct, ("ce_type", b"own")], STRUCTURED);
        let m = inbound(&r, 3, &Limits::default());
        let view = headers::for_handler(&m.headers, m.key.as_deref());
        let shown: Vec<(&str, &str)> = view
            .map
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            shown,
            [
                ("ce_id", "1"),
                ("ce_source", "billing"),
                ("ce_specversion", "1.0"),
                ("ce_type", "own"),
                ("content-type", "application/cloudevents+json"),
            ],
            "the attributes as binary mode names them; a header of the record wins"
        );
        assert_eq!(view.exact, r.headers, "record_headers: the record's own");
        assert_eq!(m.event_type.as_deref(), Some("own"));
        // No room left: the attributes are left out (they are in the payload), nothing fails.
        let tight = Limits {
            max_headers: 2,
            ..Limits::default()
        };
        let m = inbound(&r, 3, &tight);
        assert_eq!(m.failure, None);
        assert!(!m.headers.contains_key("ce_id"));
        assert_eq!(m.message_id, "ce:7:billing:1");
    }

    #[test]
    fn new_topics_are_looked_up_every_few_seconds_unless_overridden() {
        let c = consumer_config("b:9092", "g", &BTreeMap::new());
        assert_eq!(c.get("topic.metadata.refresh.interval.ms"), Some("3000"));
        let extra = [(
            "topic.metadata.refresh.interval.ms".to_string(),
            "60000".to_string(),
        )];
        let c = consumer_config("b:9092", "g", &extra.into_iter().collect());
        assert_eq!(c.get("topic.metadata.refresh.interval.ms"), Some("60000"));
    }

    #[test]
    fn records_over_the_limits_are_bounded_and_failed() {
        let limits = Limits::default();
        let long_key = vec![b'k'; 5000];
        let i = inbound(&record(&long_key, &[]), 3, &limits);
        assert!(i.key.as_deref().unwrap().starts_with("sha256:"));
        assert!(i.failure.as_deref().unwrap().contains("key is 5000 bytes"));

        let names: Vec<String> = (0..70).map(|n| format!("h{n}")).collect();
        let many: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b"v"[..])).collect();
        let i = inbound(&record(b"k", &many[..64]), 3, &limits);
        assert_eq!(
            (i.headers.len(), i.failure),
            (64, None),
            "64 headers are allowed"
        );
        let i = inbound(&record(&[0xff; 600], &[]), 3, &limits);
        assert!(
            i.key.as_deref().unwrap().starts_with("sha256:"),
            "600 invalid bytes are 1,800 bytes of text"
        );
        let i = inbound(&record(b"k", &many), 3, &limits);
        assert_eq!(i.headers.len(), 64);
        assert!(i.failure.as_deref().unwrap().contains("70 headers"));

        let long_id = vec![b'i'; 3000];
        let i = inbound(&record(b"k", &[("ce_id", &long_id)]), 3, &limits);
        assert!(i.message_id.len() <= identity::MAX_ID_BYTES);
        assert_eq!(i.failure, None, "a long id is hashed, not refused");
    }
}

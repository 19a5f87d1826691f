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
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::SubscriptionConfig;
use super::identity;
use crate::domain::InboundMessage;
use crate::domain::Limits;
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
}

fn header<'a>(m: &'a OwnedMessage, name: &str) -> Option<&'a [u8]> {
    m.headers().and_then(|h| {
        h.iter()
            .filter(|x| x.key == name)
            .last()
            .and_then(|x| x.value)
    })
}

/// The dedup identity of a record (see [`identity`]): (`ce_source`, `ce_id`) when it
/// has a `ce_id` header, else topic:partition:offset.
pub fn message_id(m: &OwnedMessage) -> String {
    match header(m, "ce_id") {
        Some(id) => identity::cloud_event(header(m, "ce_source").unwrap_or_default(), id),
        None => identity::kafka(m.topic(), m.partition(), m.offset()),
    }
}

/// Text from a record as UTF-8, without NUL characters (PostgreSQL text cannot hold
/// them; a poison record must not stall the subscription).
fn text(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    if s.contains('\0') {
        s.replace('\0', "\u{FFFD}")
    } else {
        s.into_owned()
    }
}

/// A record as an inbox message, within `Receive`'s limits: a key, headers or type over
/// them, or a payload over `max_payload_bytes`, make the message `failed` at once (the
/// reason is its last error), with the key replaced by `sha256:<hex>` and the headers
/// cut to the limits so that the row can always be stored.
pub fn inbound(m: &OwnedMessage, max_attempts: u32, limits: &Limits) -> InboundMessage {
    let mut problems = Vec::new();
    let mut headers = BTreeMap::new();
    let (mut count, mut bytes, mut kept_bytes, mut cut) = (0usize, 0usize, 0usize, 0usize);
    if let Some(h) = m.headers() {
        for x in h.iter() {
            let (k, v) = (text(x.key.as_bytes()), text(x.value.unwrap_or_default()));
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
    }
    if count > limits.max_headers || bytes > limits.max_header_bytes {
        problems.push(format!(
            "{count} headers of {bytes} bytes: the limits are {} headers and {} bytes \
             ({cut} not stored)",
            limits.max_headers, limits.max_header_bytes
        ));
    }
    let key = m.key().filter(|k| !k.is_empty()).map(|k| {
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
    });
    let payload = m.payload().unwrap_or_default();
    if payload.len() > limits.max_payload_bytes {
        problems.push(format!(
            "payload is {} bytes: the limit is {}",
            payload.len(),
            limits.max_payload_bytes
        ));
    }
    let event_type = header(m, "ce_type").map(text).filter(|t| {
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
        message_id: message_id(m),
        topic: m.topic().to_string(),
        key,
        payload: payload.to_vec(),
        event_type,
        headers,
        max_attempts,
        failure: (!problems.is_empty())
            .then(|| format!("over the inbox limits: {}", problems.join("; "))),
    }
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

/// Where a record sits in the log.
#[derive(Debug, Clone)]
pub struct Place {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The offset.
    pub offset: i64,
}

/// Stores a batch, isolating records the database refuses: a refused batch is split in
/// halves (in order) until the refused record is alone, which is then quarantined. An
/// unreachable database (any error but a refusal) is returned: the caller retries the
/// whole batch, and records already stored come back as duplicates.
pub async fn store_batch(
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
                    error,
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
                    &error,
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
        message_id: identity::kafka(&place.topic, place.partition, place.offset),
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
            Err(StoreError::Refused(e)) => last = e,
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

/// Runs one subscription's consumer until `shutdown`.
pub async fn run(
    store: Arc<dyn Store>,
    sub: SubscriptionConfig,
    config: ClientConfig,
    limits: Limits,
    wake: Arc<Notify>,
    stats: Arc<IntakeStats>,
    shutdown: CancellationToken,
) {
    let consumer: StreamConsumer = match config.create() {
        Ok(c) => c,
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
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return,
            m = consumer.recv() => m,
        };
        let first = match first {
            Ok(m) => m.detach(),
            Err(e) => {
                tracing::warn!(subscription = %sub.name, error = %e, "consumer error");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match tokio::time::timeout(Duration::from_millis(5), consumer.recv()).await {
                Ok(Ok(m)) => batch.push(m.detach()),
                _ => break,
            }
        }
        let messages: Vec<InboundMessage> = batch
            .iter()
            .map(|m| inbound(m, sub.retry.max_attempts, &limits))
            .collect();
        let places: Vec<Place> = batch
            .iter()
            .map(|m| Place {
                topic: m.topic().to_string(),
                partition: m.partition(),
                offset: m.offset(),
            })
            .collect();
        // Store before committing; retry while the database is unreachable.
        let mut pause = Duration::from_millis(100);
        loop {
            match store_batch(&*store, &sub.name, &messages, &places, &stats).await {
                Ok(()) => break,
                Err(e) => {
                    tracing::warn!(subscription = %sub.name, error = %e, "inbox insert failed; retrying, offsets not committed");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
        }
        stats
            .received
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        wake.notify_one();
        let mut next: HashMap<(String, i32), i64> = HashMap::new();
        for m in &batch {
            let e = next
                .entry((m.topic().to_string(), m.partition()))
                .or_default();
            *e = (*e).max(m.offset() + 1);
        }
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in next {
            if let Err(e) = tpl.add_partition_offset(&t, p, Offset::Offset(o)) {
                tracing::warn!(error = %e, "bad offset");
            }
        }
        if let Err(e) = consumer.commit(&tpl, CommitMode::Async) {
            // Not fatal: the records are stored; a redelivery is dropped as a duplicate.
            tracing::warn!(subscription = %sub.name, error = %e, "offset commit failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Timestamp;
    use rdkafka::message::{Header, OwnedHeaders};

    fn record(key: &[u8], headers: &[(&str, &[u8])]) -> OwnedMessage {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(*v),
            });
        }
        OwnedMessage::new(
            Some(b"payload\0ok".to_vec()),
            Some(key.to_vec()),
            "t".into(),
            Timestamp::NotAvailable,
            0,
            7,
            Some(h),
        )
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
        let a = record(b"k", &[("ce_id", b"1"), ("ce_source", b"billing")]);
        let b = record(b"k", &[("ce_id", b"1"), ("ce_source", b"mailroom/x")]);
        let c = record(b"k", &[]);
        assert_eq!(message_id(&a), "ce:7:billing:1");
        assert_ne!(message_id(&a), message_id(&b));
        assert_eq!(message_id(&c), "kafka:t:0:7");
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

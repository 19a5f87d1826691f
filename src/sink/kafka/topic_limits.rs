//! Each topic's record limit as the cluster reports it (`max.message.bytes`, read with
//! DescribeConfigs), cached and refreshed in the background, and the size of the record
//! batch the producer sends for one event, counted the way the broker counts it. The
//! intake refuses an event whose record would not fit (`check`); the sink refuses one
//! that no longer fits (the limit was lowered, or it came through the SQL API) as a
//! counted failure before the broker does (`cached`, then `refusal_within`).
//!
//! Nothing here blocks the flow: a topic the cluster reports no limit for (it does not
//! exist yet, or the broker does not say), or a cluster that does not answer within
//! `FIRST_WAIT`, falls back to the configured limits, and the answer, when it comes,
//! serves the next requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use tokio::sync::watch;
use tokio::time::Instant;

use super::cloudevents::{CeHeader, cloud_event_headers};
use crate::domain::{NewEvent, Status, StoredEvent};

/// Stock Kafka's `message.max.bytes` (and so each topic's `max.message.bytes`): the
/// largest record batch a broker appends, 1 MiB plus the 12-byte log entry header.
pub const KAFKA_DEFAULT_MAX_MESSAGE_BYTES: usize = 1_048_588;

/// A v2 record batch's header (base offset and length included, as the broker counts
/// them against `max.message.bytes`).
const BATCH_HEADER_BYTES: usize = 61;

/// A W3C `traceparent` header the producer span may add (name and 55-byte value, with
/// their varint lengths).
const TRACEPARENT_BYTES: usize = 1 + 11 + 1 + 55;

/// How long the first lookup of a topic waits for the cluster before it falls back.
const FIRST_WAIT: Duration = Duration::from_secs(2);

/// The DescribeConfigs request's own deadline (the answer still lands in the cache after
/// a caller gave up waiting).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// After a failed DescribeConfigs, how soon a topic is asked again, at most.
const RETRY_AFTER_ERROR: Duration = Duration::from_secs(5);

/// Topics remembered at most; beyond that the cache starts over (and refills on demand).
const MAX_TOPICS: usize = 10_000;

/// What the cluster said about a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Known {
    /// `max.message.bytes`; `None`: not reported (fall back to the configured limits).
    limit: Option<usize>,
    /// Asked again after this.
    until: Instant,
}

struct Entry {
    /// `None` until the first answer (or failure).
    state: watch::Sender<Option<Known>>,
    refreshing: bool,
    /// When the topic was first asked for: callers wait for its first answer until
    /// `FIRST_WAIT` after that, and no longer.
    asked: Instant,
}

struct Inner {
    admin: AdminClient<DefaultClientContext>,
    source: String,
    refresh: Duration,
    topics: Mutex<HashMap<String, Entry>>,
    /// Set while the cluster does not answer: lookups of new topics do not wait then.
    down_until: Mutex<Option<Instant>>,
}

/// The cluster's per-topic record limits, shared by the intake and the Kafka sink.
#[derive(Clone)]
pub struct TopicLimits {
    inner: Arc<Inner>,
}

/// Why an event does not fit its topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooLarge {
    /// The topic.
    pub topic: String,
    /// The record batch the event would be sent as, in bytes.
    pub record_bytes: usize,
    /// The topic's `max.message.bytes`.
    pub limit: usize,
}

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the Kafka record would be {} bytes (payload, key, headers, CloudEvents \
             attributes and record batch framing); topic '{}' takes at most {} bytes \
             (max.message.bytes)",
            self.record_bytes, self.topic, self.limit
        )
    }
}

impl TopicLimits {
    /// Reads limits through an admin client over `brokers` and the operator's properties
    /// (TLS, SASL: the producer's); `source` is the `ce_source` records carry; a topic's
    /// limit is asked again after `refresh`.
    pub fn new(
        brokers: &str,
        properties: &std::collections::BTreeMap<String, String>,
        source: String,
        refresh: Duration,
    ) -> Result<Self, rdkafka::error::KafkaError> {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", brokers)
            .set("client.id", "mailroom-topic-limits");
        for (k, v) in properties {
            c.set(k, v);
        }
        Ok(TopicLimits {
            inner: Arc::new(Inner {
                admin: c.create()?,
                source,
                refresh,
                topics: Mutex::new(HashMap::new()),
                down_until: Mutex::new(None),
            }),
        })
    }

    /// `topic`'s `max.message.bytes`, if the cluster reports one. The first lookup waits
    /// for the cluster (at most `FIRST_WAIT`, not at all while it is known to be down);
    /// later ones answer from the cache and refresh it in the background when stale.
    pub async fn limit(&self, topic: &str) -> Option<usize> {
        let (rx, deadline) = self.start(topic);
        self.wait(topic, rx, deadline).await
    }

    /// The topic's state, fetching it when it is unknown or stale, and until when to
    /// wait for a first answer.
    fn start(&self, topic: &str) -> (watch::Receiver<Option<Known>>, Instant) {
        let (rx, fetch, deadline) = self.lookup(topic);
        if fetch {
            self.spawn_fetch(topic.to_string());
        }
        (rx, deadline)
    }

    /// The limit in `rx`, waiting for a first answer until `deadline` (not at all while
    /// the cluster is known to be down).
    async fn wait(
        &self,
        topic: &str,
        mut rx: watch::Receiver<Option<Known>>,
        deadline: Instant,
    ) -> Option<usize> {
        if let Some(k) = *rx.borrow() {
            return k.limit;
        }
        let down = self
            .inner
            .down_until
            .lock()
            .expect("topic limits lock")
            .is_some_and(|t| t > Instant::now());
        if down {
            return None;
        }
        match tokio::time::timeout_at(deadline, rx.wait_for(Option::is_some)).await {
            Ok(Ok(k)) => k.and_then(|k| k.limit),
            _ => {
                tracing::info!(
                    topic,
                    "no record limit from the cluster in time; using the configured limits"
                );
                None
            }
        }
    }

    /// The cached limit of `topic`, without waiting (`None` also when not yet known).
    pub fn cached(&self, topic: &str) -> Option<usize> {
        let topics = self.inner.topics.lock().expect("topic limits lock");
        topics
            .get(topic)
            .and_then(|e| e.state.borrow().and_then(|k| k.limit))
    }

    /// Refuses `e` when its record would be over its topic's limit (the cluster's,
    /// looked up as `limit` does).
    pub async fn check(&self, e: &NewEvent) -> Result<(), TooLarge> {
        let Some(limit) = self.limit(&e.topic).await else {
            return Ok(());
        };
        let record_bytes = new_event_record_bytes(e, &self.inner.source);
        if record_bytes > limit {
            return Err(TooLarge {
                topic: e.topic.clone(),
                record_bytes,
                limit,
            });
        }
        Ok(())
    }

    /// Learns the limits of the topics of `events` (waiting as `limit` does), so that
    /// `cached` can answer from the cache.
    pub async fn learn<'a>(&self, events: impl Iterator<Item = &'a StoredEvent>) {
        let mut seen = std::collections::HashSet::new();
        let pending: Vec<_> = events
            .filter(|e| seen.insert(e.topic.as_str()))
            .map(|e| (e.topic.as_str(), self.start(&e.topic)))
            .collect();
        for (topic, (rx, deadline)) in pending {
            self.wait(topic, rx, deadline).await;
        }
    }

    /// The topic's state channel, whether a fetch must start (none yet, or stale), and
    /// until when to wait for its first answer.
    fn lookup(&self, topic: &str) -> (watch::Receiver<Option<Known>>, bool, Instant) {
        let mut topics = self.inner.topics.lock().expect("topic limits lock");
        if topics.len() >= MAX_TOPICS && !topics.contains_key(topic) {
            topics.clear();
        }
        let entry = topics.entry(topic.to_string()).or_insert_with(|| Entry {
            state: watch::channel(None).0,
            refreshing: false,
            asked: Instant::now(),
        });
        let stale = entry
            .state
            .borrow()
            .is_none_or(|k| k.until <= Instant::now());
        let fetch = stale && !entry.refreshing;
        if fetch {
            entry.refreshing = true;
        }
        (entry.state.subscribe(), fetch, entry.asked + FIRST_WAIT)
    }

    fn spawn_fetch(&self, topic: String) {
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let outcome = describe(&inner.admin, &topic).await;
            let now = Instant::now();
            let known = match outcome {
                Ok(limit) => {
                    *inner.down_until.lock().expect("topic limits lock") = None;
                    Known {
                        limit,
                        until: now + inner.refresh,
                    }
                }
                Err(why) => {
                    tracing::warn!(topic, error = %why, "could not read the topic's max.message.bytes; using the configured limits");
                    let retry = inner.refresh.min(RETRY_AFTER_ERROR);
                    *inner.down_until.lock().expect("topic limits lock") = Some(now + retry);
                    // Keep a limit learned before: the cluster did not change it by
                    // becoming unreachable.
                    let topics = inner.topics.lock().expect("topic limits lock");
                    let before = topics
                        .get(&topic)
                        .and_then(|e| e.state.borrow().and_then(|k| k.limit));
                    Known {
                        limit: before,
                        until: now + retry,
                    }
                }
            };
            let mut topics = inner.topics.lock().expect("topic limits lock");
            if let Some(e) = topics.get_mut(&topic) {
                e.refreshing = false;
                e.state.send_replace(Some(known));
            }
        });
    }
}

/// `max.message.bytes` of `topic` as the cluster describes it; `Ok(None)` when it does
/// not report one (a topic that does not exist yet, or a broker that does not say: Kafka
/// itself always reports the effective value, its broker default included).
async fn describe(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
) -> Result<Option<usize>, String> {
    let opts = AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT));
    let spec = [ResourceSpecifier::Topic(topic)];
    let results = admin
        .describe_configs(spec.iter(), &opts)
        .await
        .map_err(|e| e.to_string())?;
    let Some(result) = results.into_iter().next() else {
        return Ok(None);
    };
    match result {
        Err(code) => {
            tracing::debug!(topic, error = %code, "no config for the topic");
            Ok(None)
        }
        Ok(resource) => Ok(resource
            .get("max.message.bytes")
            .and_then(|e| e.value.as_deref())
            .and_then(|v| v.trim().parse::<usize>().ok())),
    }
}

/// Bytes of `v` as a zigzag varint (Kafka's record encoding).
fn varint_len(v: i64) -> usize {
    let mut z = ((v << 1) ^ (v >> 63)) as u64;
    let mut n = 1;
    while z >= 0x80 {
        z >>= 7;
        n += 1;
    }
    n
}

/// A length-prefixed field of a v2 record (`None`: null, length -1).
fn field_len(len: Option<usize>) -> usize {
    match len {
        None => varint_len(-1),
        Some(n) => varint_len(i64::try_from(n).unwrap_or(i64::MAX)) + n,
    }
}

/// Why the stored event `e`, sent with the CloudEvents headers `headers`
/// (`cloud_event_headers`), cannot go to a topic whose limit is `limit`
/// (`TopicLimits::cached`): its record batch, counted as the broker counts it (the
/// payload, the key, the headers and, when spans are exported, a `traceparent`;
/// uncompressed), is over it. The relay reads the limit once per line and builds each
/// record's headers once, for this and for the record itself.
pub fn refusal_within(e: &StoredEvent, headers: &[CeHeader<'_>], limit: usize) -> Option<TooLarge> {
    let record_bytes = batch_bytes(e.key.as_ref().map(String::len), e.payload.len(), headers);
    (record_bytes > limit).then(|| TooLarge {
        topic: e.topic.clone(),
        record_bytes,
        limit,
    })
}

/// A v2 record batch of one record with this key, payload and headers.
fn batch_bytes(key: Option<usize>, payload: usize, headers: &[CeHeader<'_>]) -> usize {
    let mut header_bytes: usize = headers
        .iter()
        .map(|(k, v)| field_len(Some(k.len())) + field_len(Some(v.len())))
        .sum();
    let mut count = headers.len();
    if !headers.iter().any(|(k, _)| k == "traceparent") {
        header_bytes += TRACEPARENT_BYTES;
        count += 1;
    }
    // attributes, timestamp delta 0, offset delta 0, key, value, header count, headers.
    let body = 1
        + varint_len(0)
        + varint_len(0)
        + field_len(key)
        + field_len(Some(payload))
        + varint_len(i64::try_from(count).unwrap_or(i64::MAX))
        + header_bytes;
    BATCH_HEADER_BYTES + varint_len(i64::try_from(body).unwrap_or(i64::MAX)) + body
}

/// The record batch of an event not stored yet (as `refusal_within` counts it), with the longest id and creation
/// time its `ce_id` and `ce_time` can carry.
pub fn new_event_record_bytes(e: &NewEvent, source: &str) -> usize {
    let now = chrono::Utc::now();
    // Nine fractional digits: the longest `ce_time`.
    let t = chrono::DateTime::from_timestamp(now.timestamp(), 999_999_999).unwrap_or(now);
    let stored = StoredEvent {
        id: i64::MAX,
        topic: e.topic.clone(),
        key: e.key.clone(),
        payload: Vec::new(),
        headers: e.headers.clone(),
        event_type: e.event_type.clone(),
        idempotency_key: None,
        status: Status::Pending,
        attempts: 0,
        max_attempts: e.max_attempts,
        scheduled_at: t,
        created_at: t,
        updated_at: t,
        published_at: None,
        last_error: None,
    };
    batch_bytes(
        e.key.as_ref().map(String::len),
        e.payload.len(),
        &cloud_event_headers(&stored, source),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_are_zigzag() {
        assert_eq!(varint_len(0), 1);
        assert_eq!(varint_len(-1), 1);
        assert_eq!(varint_len(63), 1);
        assert_eq!(varint_len(64), 2);
        assert_eq!(varint_len(1_048_576), 4);
    }

    fn new_event(payload: usize, key: Option<&str>) -> NewEvent {
        NewEvent {
            topic: "t".into(),
            key: key.map(str::to_string),
            payload: vec![0; payload],
            headers: Default::default(),
            event_type: None,
            idempotency_key: None,
            deliver_after: None,
            max_attempts: 6,
        }
    }

    /// A 1 MiB payload alone is already over stock Kafka's limit: that is why the
    /// default payload limit is lower.
    #[test]
    fn a_mebibyte_payload_never_fits_a_default_topic() {
        let n = new_event_record_bytes(&new_event(1024 * 1024, None), "mailroom/x");
        assert!(n > KAFKA_DEFAULT_MAX_MESSAGE_BYTES, "{n}");
        // The framing and CloudEvents attributes of an empty event: a few hundred bytes.
        let empty = new_event_record_bytes(&new_event(0, None), "mailroom/x");
        assert!((150..400).contains(&empty), "{empty}");
        // Each payload byte counts once (the length varint grows with it).
        let k = new_event_record_bytes(&new_event(1000, Some("k")), "mailroom/x");
        assert_eq!(k, empty + 1000 + 1 + 1);
    }
}

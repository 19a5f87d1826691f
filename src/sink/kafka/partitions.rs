//! Which partition a keyed record goes to, so that the relay can treat each partition as
//! a fault domain of its own (one leaderless partition must not hold its topic's other
//! partitions back). The partition is computed as librdkafka's `murmur2_random`
//! partitioner (Kafka's Java default) computes it, from each topic's partition count,
//! which is read from the cluster's metadata in the background and cached; the producer
//! then sends the record to that partition explicitly, so the relay's domain and the
//! record's partition agree by construction. While a topic's count is unknown, its
//! records are partitioned by librdkafka and the whole topic is one domain.
//!
//! The same metadata says which partitions have no leader. A record for such a
//! partition is not handed to librdkafka at all (it would sit in the producer's queue,
//! with every later copy the relay's probes add, until the leader returns): the sink
//! answers it transient at once, and the metadata of a topic with a leaderless
//! partition is read again every [`REFRESH_LEADERLESS`], so a returning leader is seen
//! within that time.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rdkafka::producer::{FutureProducer, Producer};

/// How long a topic's partition count is trusted before it is read again (librdkafka's
/// own `topic.metadata.refresh.interval.ms` default).
pub const REFRESH: Duration = Duration::from_secs(300);

/// How often the metadata of a topic with a leaderless partition is read again.
pub const REFRESH_LEADERLESS: Duration = Duration::from_secs(1);

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`), seed `0x9747b28c`.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    // Kafka hashes the length as a Java int (a record is far below 4 GiB).
    let mut h: u32 = SEED ^ u32::try_from(len).unwrap_or(u32::MAX);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition of `key` among `count` partitions: `murmur2(key) & 0x7fffffff % count`,
/// as librdkafka's `murmur2_random` and Kafka's Java producer choose it.
pub fn partition_for(key: &[u8], count: i32) -> i32 {
    (murmur2(key) & 0x7fff_ffff) % count.max(1)
}

/// Where a line's records go (`Partitions::place`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// This partition, which has a leader.
    Partition(i32),
    /// The key's partition, which the last metadata read found without a leader.
    Leaderless(i32),
}

/// What the metadata said of one topic, and when.
#[derive(Debug, Clone)]
struct Known {
    count: i32,
    leaderless: HashSet<i32>,
    read_at: Instant,
}

impl Known {
    fn stale(&self) -> bool {
        let ttl = if self.leaderless.is_empty() {
            REFRESH
        } else {
            REFRESH_LEADERLESS
        };
        self.read_at.elapsed() >= ttl
    }
}

type Counts = HashMap<String, Known>;

fn record(counts: &RwLock<Counts>, topic: &str, count: i32, leaderless: HashSet<i32>) {
    if count > 0
        && let Ok(mut m) = counts.write()
    {
        let read_at = Instant::now();
        m.insert(
            topic.to_string(),
            Known {
                count,
                leaderless,
                read_at,
            },
        );
    }
}

/// Partition counts per topic, read from the cluster's metadata.
#[derive(Default)]
pub struct Partitions {
    counts: Arc<RwLock<Counts>>,
    reading: Arc<Mutex<HashSet<String>>>,
}

impl Partitions {
    /// `topic`'s partition count when known. When unknown or stale, a background read of
    /// the metadata through `producer` is started (one per topic at a time).
    pub fn count(&self, topic: &str, producer: &Arc<FutureProducer>) -> Option<i32> {
        self.known(topic, producer).map(|k| k.count)
    }

    /// Whether the last metadata read said `partition` of `topic` has no leader.
    pub fn leaderless(&self, topic: &str, partition: i32, producer: &Arc<FutureProducer>) -> bool {
        self.known(topic, producer)
            .is_some_and(|k| k.leaderless.contains(&partition))
    }

    /// Where the records of one line go, read once for the line: a keyed line's records
    /// share their key and so their partition (`None`: librdkafka chooses, the count
    /// not being known yet, or an unkeyed record while every partition has a leader).
    pub fn place(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        producer: &Arc<FutureProducer>,
    ) -> Option<Placement> {
        let k = self.known(topic, producer)?;
        match key {
            Some(key) => {
                let p = partition_for(key, k.count);
                Some(if k.leaderless.contains(&p) {
                    Placement::Leaderless(p)
                } else {
                    Placement::Partition(p)
                })
            }
            None => {
                if k.leaderless.is_empty() {
                    return None;
                }
                let led: Vec<i32> = (0..k.count).filter(|p| !k.leaderless.contains(p)).collect();
                (!led.is_empty())
                    .then(|| Placement::Partition(led[rand::random_range(0..led.len())]))
            }
        }
    }

    fn known(&self, topic: &str, producer: &Arc<FutureProducer>) -> Option<Known> {
        let known = self.counts.read().ok().and_then(|m| m.get(topic).cloned());
        if known.as_ref().is_none_or(Known::stale) {
            let _ = self.read_in_background(topic, producer);
        }
        known
    }

    /// Records what the metadata said (tests, and the background read).
    pub fn set(&self, topic: &str, count: i32, leaderless: HashSet<i32>) {
        record(&self.counts, topic, count, leaderless);
    }

    /// Reads the metadata of the topics among `topics` never read yet, waiting up to
    /// `within` for them, so that a topic's first records already go to partitions
    /// that have a leader. Later reads happen in the background.
    pub async fn learn<'a>(
        &self,
        topics: impl IntoIterator<Item = &'a str>,
        producer: &Arc<FutureProducer>,
        within: Duration,
    ) {
        let unknown: HashSet<&str> = {
            let Ok(m) = self.counts.read() else {
                return;
            };
            topics.into_iter().filter(|t| !m.contains_key(*t)).collect()
        };
        let reads: Vec<_> = unknown
            .iter()
            .filter_map(|t| self.read_in_background(t, producer))
            .collect();
        // A read another cycle started (the other relay's first cycle, at the same
        // moment) is waited for too: without it, that cycle's records went out before
        // the metadata said which partitions have no leader, and waited out the
        // delivery deadline in a leaderless one.
        let others = async {
            while unknown
                .iter()
                .any(|t| !self.is_known(t) && self.is_reading(t))
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        let _ = tokio::time::timeout(within, async {
            futures::future::join_all(reads).await;
            others.await;
        })
        .await;
    }

    fn is_known(&self, topic: &str) -> bool {
        self.counts.read().is_ok_and(|m| m.contains_key(topic))
    }

    fn is_reading(&self, topic: &str) -> bool {
        self.reading.lock().is_ok_and(|r| r.contains(topic))
    }

    /// Reads `topic`'s metadata again now, in the background (a delivery to it came back
    /// transient: a leader may have gone).
    pub fn refresh(&self, topic: &str, producer: &Arc<FutureProducer>) {
        let _ = self.read_in_background(topic, producer);
    }

    /// Starts reading `topic`'s metadata unless a read is already running; the handle
    /// of the read it started.
    fn read_in_background(
        &self,
        topic: &str,
        producer: &Arc<FutureProducer>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        if !self
            .reading
            .lock()
            .is_ok_and(|mut r| r.insert(topic.to_string()))
        {
            return None;
        }
        let (topic, producer) = (topic.to_string(), producer.clone());
        let (counts, reading) = (self.counts.clone(), self.reading.clone());
        Some(runtime.spawn_blocking(move || {
            read(&topic, &producer, &counts);
            if let Ok(mut r) = reading.lock() {
                r.remove(&topic);
            }
        }))
    }
}

/// Reads `topic`'s partition count and leaderless partitions from the cluster (blocking).
fn read(topic: &str, producer: &FutureProducer, counts: &RwLock<Counts>) {
    match producer
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(5))
    {
        Ok(md) => {
            if let Some(t) = md
                .topics()
                .iter()
                .find(|t| t.name() == topic && t.error().is_none())
            {
                let n = i32::try_from(t.partitions().len()).unwrap_or(0);
                let leaderless = t
                    .partitions()
                    .iter()
                    .filter(|p| p.leader() < 0)
                    .map(|p| p.id())
                    .collect();
                record(counts, topic, n, leaderless);
            }
        }
        Err(e) => tracing::debug!(topic, error = %e, "partition count not read"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cycle that finds another cycle's metadata read of its topic running waits for
    /// that read (up to its bound) instead of producing blind.
    #[tokio::test]
    async fn learn_waits_for_a_read_another_cycle_started() {
        let producer: Arc<FutureProducer> = Arc::new(
            rdkafka::ClientConfig::new()
                .set("bootstrap.servers", "127.0.0.1:1")
                .create()
                .unwrap(),
        );
        let p = Arc::new(Partitions::default());
        p.reading.lock().unwrap().insert("t".to_string());
        let other = p.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            other.set("t", 3, HashSet::from([1]));
            other.reading.lock().unwrap().remove("t");
        });
        let started = std::time::Instant::now();
        p.learn(["t"], &producer, Duration::from_secs(5)).await;
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(4),
            "learn returned after {took:?}"
        );
        assert!(p.leaderless("t", 1, &producer));
        // Bounded: a read that never ends is waited for `within` at most.
        p.reading.lock().unwrap().insert("u".to_string());
        let started = std::time::Instant::now();
        p.learn(["u"], &producer, Duration::from_millis(200)).await;
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    /// A line's placement: a keyed line goes to its key's partition, flagged when that
    /// partition has no leader; an unkeyed record goes to a led partition while some
    /// partition has none, else where librdkafka chooses; nothing before the count is
    /// known.
    #[test]
    fn a_line_is_placed_by_its_key_and_the_leaders() {
        let producer: Arc<FutureProducer> = Arc::new(
            rdkafka::ClientConfig::new()
                .set("bootstrap.servers", "127.0.0.1:1")
                .create()
                .unwrap(),
        );
        let p = Partitions::default();
        // Unknown: no background read can answer from 127.0.0.1:1 within the test.
        assert_eq!(p.place("t", Some(b"k"), &producer), None);
        p.set("t", 4, HashSet::new());
        let home = partition_for(b"k", 4);
        assert_eq!(
            p.place("t", Some(b"k"), &producer),
            Some(Placement::Partition(home))
        );
        assert_eq!(p.place("t", None, &producer), None);
        p.set("t", 4, HashSet::from([home]));
        assert_eq!(
            p.place("t", Some(b"k"), &producer),
            Some(Placement::Leaderless(home))
        );
        for _ in 0..50 {
            match p.place("t", None, &producer) {
                Some(Placement::Partition(q)) => assert!(q != home && (0..4).contains(&q)),
                other => panic!("an unkeyed record went to {other:?}"),
            }
        }
        p.set("t", 2, HashSet::from([0, 1]));
        assert_eq!(
            p.place("t", None, &producer),
            None,
            "no partition has a leader"
        );
    }

    /// Kafka's own vectors (`UtilsTest.testMurmur2`).
    #[test]
    fn murmur2_matches_kafka() {
        for (input, want) in [
            ("21", -973932308),
            ("foobar", -790332482),
            ("a-little-bit-long-string", -985981536),
            ("a-little-bit-longer-string", -1486304829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58897971,
            ),
            ("abc", 479470107),
        ] {
            assert_eq!(murmur2(input.as_bytes()), want, "{input}");
        }
        assert!((0..3).contains(&partition_for(b"any", 3)));
    }
}

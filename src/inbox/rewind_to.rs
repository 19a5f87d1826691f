//! Rewinding a subscription to a time (issue 44, item 2): each consumer applies the
//! rewinds an operator asked for (`RewindSubscription`, stored by `store::rewinds`) to
//! the partitions it holds, once per partition, and tags the records a `redeliver`
//! rewind reads again.
//!
//! Applying, at the consumer's periodic check (between batches, like `rewind`): for the
//! oldest rewind asked for in the last [`APPLY_WITHIN`] that a partition this consumer
//! holds has not had, the partition's first offset at or after the rewind's time is
//! looked up ([`offset_for_time`]) in the background (broker requests never hold
//! consumption up); at a later check the window (that offset up to the current
//! position) is recorded, the consumer seeks to it and commits it (so a restart starts
//! there too), and the partition is marked applied. A crash in between applies the
//! recorded window again. A partition is never moved forward: a time past the position
//! changes nothing.
//!
//! Tagging: a record inside the window of a `redeliver` rewind is stored under the
//! identity `rewind:<rewind id>:<its identity>` with the header `mailroom-rewound-by`,
//! so the inbox takes it as a new message (once: read again, the tagged identity is a
//! duplicate). Without `redeliver` a record read again keeps its identity and is
//! dropped as a duplicate (while its first copy is retained). Windows are read from the
//! database before storing records of a partition not seen since the last check, so a
//! partition that moved to this consumer after another applied the rewind is tagged.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};

use super::record::Record;
use crate::domain::InboundMessage;
use crate::domain::admin::{REWOUND_BY, Rewind, RewindPartition};
use crate::store::Store;

/// Rewinds asked for longer ago than this are not applied to partitions that had none
/// of them yet (a consumer assigned a partition a day later does not go back).
pub const APPLY_WITHIN: Duration = Duration::from_secs(24 * 3600);

/// How long the windows of `redeliver` rewinds are kept for tagging.
const TAG_WITHIN: Duration = Duration::from_secs(7 * 24 * 3600);

/// The deadline of each broker request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A redeliver rewind's window on one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    rewind_id: i64,
    from: i64,
    until: i64,
}

/// One consumer's rewinds: what it applied, and the windows it tags.
pub struct Rewinds {
    store: Arc<dyn Store>,
    subscription: String,
    /// The subscription's client settings, for the probe that reads record times.
    config: ClientConfig,
    /// By topic, then partition: looked up for every record by the record's own topic,
    /// without building a key.
    windows: HashMap<String, HashMap<i32, Vec<Window>>>,
    /// Partitions whose windows were read since the last check, by topic.
    fresh: HashMap<String, HashSet<i32>>,
    /// Lookups of where a rewind sends a partition, by (rewind, topic, partition).
    lookups: HashMap<(i64, String, i32), tokio::task::JoinHandle<anyhow::Result<Found>>>,
}

impl Rewinds {
    /// The rewinds of `subscription`, whose consumer is configured by `config`.
    pub fn new(store: Arc<dyn Store>, subscription: &str, config: ClientConfig) -> Rewinds {
        Rewinds {
            store,
            subscription: subscription.to_string(),
            config,
            windows: HashMap::new(),
            fresh: HashMap::new(),
            lookups: HashMap::new(),
        }
    }

    fn since(d: Duration) -> Option<chrono::DateTime<chrono::Utc>> {
        chrono::Duration::from_std(d)
            .ok()
            .map(|d| chrono::Utc::now() - d)
    }

    /// Applies the subscription's open rewinds to the partitions `consumer` holds; how
    /// many partitions it moved. Between batches only: it seeks. The broker requests that
    /// find where a partition goes (which a partition that never answers can make last)
    /// run in the background and are applied at a later check, so consumption never
    /// waits on them.
    pub async fn apply(&mut self, consumer: &Arc<StreamConsumer>) -> u64 {
        self.fresh.clear();
        let open = match self
            .store
            .rewinds(Some(&self.subscription), Self::since(APPLY_WITHIN), 100)
            .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(subscription = %self.subscription, error = %e, "reading rewinds failed");
                return 0;
            }
        };
        let assigned: Vec<(String, i32)> = match consumer.assignment() {
            Ok(a) => a
                .elements()
                .iter()
                .map(|e| (e.topic().to_string(), e.partition()))
                .collect(),
            Err(_) => return 0,
        };
        let mut moved = 0;
        for (topic, partition) in assigned {
            // The oldest rewind the partition has not had: a later one waits for it, so
            // it starts from where the earlier one left the partition.
            let Some((rewind, recorded)) = open.iter().rev().find_map(|r| {
                let row = r
                    .partitions
                    .iter()
                    .find(|p| p.topic == topic && p.partition == partition);
                match row {
                    Some(p) if p.applied_at.is_some() => None,
                    row => Some((r, row)),
                }
            }) else {
                continue;
            };
            let key = (rewind.id, topic.clone(), partition);
            let found = match (recorded, self.lookups.get(&key)) {
                // A window recorded before a crash is applied as it was recorded.
                (Some(r), _) => Found {
                    from: r.from_offset,
                    committed: None,
                },
                (None, Some(h)) if h.is_finished() => {
                    let h = self.lookups.remove(&key).expect("the lookup is there");
                    match h.await {
                        Ok(Ok(found)) => found,
                        Ok(Err(e)) => {
                            tracing::warn!(subscription = %self.subscription, rewind = rewind.id,
                                topic, partition, error = %e, "finding where to rewind a partition failed; tried again");
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!(subscription = %self.subscription, error = %e, "a rewind lookup died");
                            continue;
                        }
                    }
                }
                (None, Some(_)) => continue,
                (None, None) => {
                    let (c, config, t) = (consumer.clone(), self.config.clone(), topic.clone());
                    let to_ms = rewind.to_time.timestamp_millis();
                    let lookup = tokio::task::spawn_blocking(move || -> anyhow::Result<Found> {
                        Ok(Found {
                            from: offset_for_time(&c, &config, &t, partition, to_ms)?,
                            committed: committed_of(&c, &t, partition)?,
                        })
                    });
                    self.lookups.insert(key, lookup);
                    continue;
                }
            };
            match self
                .apply_one(consumer, rewind, &topic, partition, recorded, found)
                .await
            {
                Ok(true) => moved += 1,
                Ok(false) => {}
                Err(e) => tracing::warn!(subscription = %self.subscription, rewind = rewind.id,
                    topic, partition, error = %e, "rewinding a partition failed; tried again at the next check"),
            }
        }
        moved
    }

    /// Applies `rewind` to one partition whose target `found` found (`recorded`: the
    /// window recorded before, if any); whether the position moved.
    async fn apply_one(
        &self,
        consumer: &Arc<StreamConsumer>,
        rewind: &Rewind,
        topic: &str,
        partition: i32,
        recorded: Option<&RewindPartition>,
        found: Found,
    ) -> anyhow::Result<bool> {
        // The position now (local, between batches), or the committed offset the lookup
        // read when the consumer has read nothing from the partition yet; with neither
        // (the group never read it: it starts at its log start anyway), the target.
        let position = position_of(consumer, topic, partition)?
            .or(found.committed)
            .unwrap_or(found.from);
        let window = match recorded {
            Some(r) => r.clone(),
            None => {
                let wanted = RewindPartition {
                    rewind_id: rewind.id,
                    topic: topic.to_string(),
                    partition,
                    from_offset: found.from.min(position),
                    until_offset: position,
                    applied_at: None,
                };
                self.store.intend_rewind(&wanted).await?
            }
        };
        let moved = window.from_offset < position;
        if moved {
            let (c, t, at) = (consumer.clone(), topic.to_string(), window.from_offset);
            tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                c.seek(&t, partition, Offset::Offset(at), REQUEST_TIMEOUT)?;
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition_offset(&t, partition, Offset::Offset(at))?;
                c.commit(&tpl, CommitMode::Sync)?;
                Ok(())
            })
            .await??;
        }
        self.store.rewind_applied(&window).await?;
        tracing::warn!(subscription = %self.subscription, rewind = rewind.id, topic, partition,
            from = window.from_offset, until = window.until_offset, redeliver = rewind.redeliver,
            "subscription rewound by an operator");
        Ok(moved)
    }

    /// Reads the windows of `redeliver` rewinds when `batch` holds a partition whose
    /// windows were not read since the last check.
    pub async fn prepare(&mut self, batch: &[Record]) {
        if batch.iter().all(|r| {
            self.fresh
                .get(r.topic.as_str())
                .is_some_and(|ps| ps.contains(&r.partition))
        }) {
            return;
        }
        match self
            .store
            .rewinds(Some(&self.subscription), Self::since(TAG_WITHIN), 1000)
            .await
        {
            Ok(rewinds) => {
                self.windows.clear();
                for r in rewinds.iter().filter(|r| r.redeliver) {
                    for p in &r.partitions {
                        self.windows
                            .entry(p.topic.clone())
                            .or_default()
                            .entry(p.partition)
                            .or_default()
                            .push(Window {
                                rewind_id: r.id,
                                from: p.from_offset,
                                until: p.until_offset,
                            });
                    }
                }
                for r in batch {
                    match self.fresh.get_mut(r.topic.as_str()) {
                        Some(ps) => {
                            ps.insert(r.partition);
                        }
                        None => {
                            self.fresh
                                .insert(r.topic.clone(), HashSet::from([r.partition]));
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(subscription = %self.subscription, error = %e,
                    "reading rewind windows failed; records are stored untagged");
            }
        }
    }

    /// Tags `m` (made of `r`) when `r` lies in a `redeliver` rewind's window: the newest
    /// rewind whose window holds it.
    pub fn tag(&self, r: &Record, m: &mut InboundMessage) {
        let Some(ws) = self
            .windows
            .get(r.topic.as_str())
            .and_then(|ps| ps.get(&r.partition))
        else {
            return;
        };
        if let Some(w) = ws
            .iter()
            .filter(|w| w.from <= r.offset && r.offset < w.until)
            .max_by_key(|w| w.rewind_id)
        {
            m.message_id = format!("rewind:{}:{}", w.rewind_id, m.message_id);
            m.headers
                .insert(REWOUND_BY.to_string(), w.rewind_id.to_string());
        }
    }
}

/// Where a rewind sends a partition, found in the background.
struct Found {
    /// The first offset at or after the rewind's time.
    from: i64,
    /// The group's committed offset, for a partition the consumer has read nothing from.
    committed: Option<i64>,
}

/// `tpl`'s offset of one partition, when it is one.
fn offset_in(tpl: &TopicPartitionList, topic: &str, partition: i32) -> Option<i64> {
    tpl.find_partition(topic, partition)
        .and_then(|e| match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        })
}

/// The consumer's position on a partition (the next offset it hands out; local, no
/// broker request), `None` when it has read nothing from it yet.
fn position_of(c: &StreamConsumer, topic: &str, partition: i32) -> anyhow::Result<Option<i64>> {
    Ok(offset_in(&c.position()?, topic, partition))
}

/// The group's committed offset of a partition (a broker request).
fn committed_of(c: &StreamConsumer, topic: &str, partition: i32) -> anyhow::Result<Option<i64>> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    Ok(offset_in(
        &c.committed_offsets(tpl, REQUEST_TIMEOUT)?,
        topic,
        partition,
    ))
}

/// The first offset of a partition whose record's timestamp is at or after `to_ms` (the
/// log end when there is none), as Kafka's ListOffsets answers it. The broker's answer
/// is checked against the records themselves, and when it does not hold (a broker that
/// does not index time answers the log start), the offset is found by a binary search
/// over the records' timestamps, which assumes they grow with the offsets (CreateTime
/// set by producers in order, or LogAppendTime).
pub fn offset_for_time(
    c: &StreamConsumer,
    config: &ClientConfig,
    topic: &str,
    partition: i32,
    to_ms: i64,
) -> anyhow::Result<i64> {
    let (low, high) = c.fetch_watermarks(topic, partition, REQUEST_TIMEOUT)?;
    if low >= high {
        return Ok(high);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(to_ms))?;
    let answer = c
        .offsets_for_times(tpl, REQUEST_TIMEOUT)
        .ok()
        .and_then(|t| {
            t.find_partition(topic, partition)
                .map(|e| match e.offset() {
                    Offset::Offset(o) => o,
                    _ => high,
                })
        });
    let probe = Probe::new(config, topic, partition)?;
    if let Some(o) = answer.filter(|o| (low..=high).contains(o)) {
        let at_or_after = o == high || probe.time_at(o)?.is_some_and(|(_, t)| t >= to_ms);
        let before = o == low || probe.time_at(o - 1)?.is_some_and(|(_, t)| t < to_ms);
        if at_or_after && before {
            return Ok(o);
        }
    }
    let (mut lo, mut hi) = (low, high);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match probe.time_at(mid)? {
            Some((_, t)) if t >= to_ms => hi = mid,
            Some((at, _)) => lo = (at + 1).max(mid + 1),
            // Nothing readable from `mid` on (the log end moved back): search below it.
            None => hi = mid,
        }
    }
    Ok(lo)
}

/// A consumer outside the group that reads single records to learn their timestamps.
struct Probe {
    consumer: BaseConsumer,
    topic: String,
    partition: i32,
}

impl Probe {
    fn new(config: &ClientConfig, topic: &str, partition: i32) -> anyhow::Result<Probe> {
        let mut config = config.clone();
        config
            .set(
                "group.id",
                format!("mailroom-rewind-probe-{}", uuid::Uuid::new_v4().simple()),
            )
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        Ok(Probe {
            consumer: config.create()?,
            topic: topic.to_string(),
            partition,
        })
    }

    /// The first record at or after `offset`: its offset and timestamp (ms).
    fn time_at(&self, offset: i64) -> anyhow::Result<Option<(i64, i64)>> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, self.partition, Offset::Offset(offset))?;
        self.consumer.assign(&tpl)?;
        let deadline = std::time::Instant::now() + REQUEST_TIMEOUT;
        while std::time::Instant::now() < deadline {
            match self.consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) if m.partition() == self.partition && m.offset() >= offset => {
                    let t = m.timestamp().to_millis().unwrap_or(i64::MIN);
                    return Ok(Some((m.offset(), t)));
                }
                Some(Err(e)) => return Err(e.into()),
                _ => {}
            }
        }
        Ok(None)
    }
}

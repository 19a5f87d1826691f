//! Notices a log replaced under the consumer and sends it back to the log's start.
//!
//! librdkafka keeps fetching at its position when a topic is deleted and created again
//! (offsets start at 0 again) or when a partition's log is cut shorter (an unclean leader
//! election): on a broker that answers an empty fetch there, new records are skipped
//! until the new log passes the old position. So every [`CHECK_EVERY`] the consumer:
//! - asks the topics' ids (`log_view::topic_ids`): a topic whose id changed was
//!   recreated, and each of its assigned partitions goes back to its log start;
//! - compares each assigned partition's position with the high watermark of its last
//!   fetch: a position past the log end (confirmed with the broker) goes back too.
//!
//! Going back is safe: records already stored come back as duplicates, which the inbox's
//! identity drops (a record without `ce_id` is identified by its place and timestamp),
//! so every new record is handled once. Each rewind is logged with both offsets and
//! counted (`mailroom_inbox_topic_recreations`, `mailroom_inbox_log_truncations`).
//!
//! What it cannot see: a topic recreated while no partition of it is assigned to this
//! consumer (or before the service started) whose new log already reached the old
//! committed offset; a broker without topic ids leaves only the watermark check.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};

use super::log_view::{self, TopicId};

/// How often the consumer looks for a replaced log.
pub const CHECK_EVERY: Duration = Duration::from_secs(3);

/// Deadline of each broker request a check makes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Partitions a check sent back to their log start, by cause.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rewound {
    /// Partitions of topics with a new id.
    pub recreated: u64,
    /// Partitions whose position was past their log end.
    pub truncated: u64,
}

/// Why a partition went back to its log start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// Its topic has a new id.
    Recreated,
    /// Its position was past its log end.
    Truncated,
}

/// One subscription's view of its topics, kept between checks.
#[derive(Debug)]
pub struct LogWatch {
    subscription: String,
    topics: Vec<String>,
    /// The last id seen of each topic.
    ids: HashMap<String, TopicId>,
}

/// The topics whose id differs from the one last seen, as (topic, old, new); `known`
/// takes the new ids. A topic seen for the first time, or missing now, is no change.
fn changed_ids(
    known: &mut HashMap<String, TopicId>,
    now: HashMap<String, TopicId>,
) -> Vec<(String, TopicId, TopicId)> {
    let mut changed = Vec::new();
    for (topic, id) in now {
        if let Some(old) = known.insert(topic.clone(), id)
            && old != id
        {
            changed.push((topic, old, id));
        }
    }
    changed.sort_by(|a, b| a.0.cmp(&b.0));
    changed
}

/// Whether a fetch position lies past the log's end (`high`, the next offset to be
/// written). A position at the end is where a caught-up consumer waits.
fn past_end(position: i64, high: i64) -> bool {
    high >= 0 && position > high
}

impl LogWatch {
    /// A watch over `subscription`'s `topics`.
    pub fn new(subscription: &str, topics: &[String]) -> LogWatch {
        LogWatch {
            subscription: subscription.to_string(),
            topics: topics.to_vec(),
            ids: HashMap::new(),
        }
    }

    /// One check (blocking: broker requests, up to a few seconds): partitions of a
    /// recreated topic, and partitions positioned past their log end, go back to their
    /// log start.
    pub fn check(&mut self, consumer: &StreamConsumer) -> Rewound {
        let mut rewound = Rewound::default();
        let assigned = match consumer.position() {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(subscription = %self.subscription, error = %e, "no assignment to check");
                return rewound;
            }
        };
        let mut positions: HashMap<(String, i32), Option<i64>> = HashMap::new();
        for e in assigned.elements() {
            let at = match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            };
            positions.insert((e.topic().to_string(), e.partition()), at);
        }
        match log_view::topic_ids(consumer, &self.topics, REQUEST_TIMEOUT) {
            Ok(now) => {
                for (topic, old, new) in changed_ids(&mut self.ids, now) {
                    let mut parts: Vec<_> = positions
                        .iter()
                        .filter(|((t, _), _)| *t == topic)
                        .map(|((_, p), at)| (*p, *at))
                        .collect();
                    parts.sort_unstable();
                    tracing::warn!(subscription = %self.subscription, topic, old_id = %old,
                        new_id = %new, assigned = parts.len(), "topic recreated: its log starts again");
                    for (p, at) in parts {
                        if self.rewind(consumer, &topic, p, at, Cause::Recreated) {
                            rewound.recreated += 1;
                        }
                        positions.remove(&(topic.clone(), p));
                    }
                }
            }
            Err(e) => {
                tracing::debug!(subscription = %self.subscription, error = %e, "topic ids not read");
            }
        }
        for ((topic, p), at) in positions {
            let Some(at) = at else { continue };
            let cached = log_view::cached_watermarks(consumer, &topic, p);
            if !cached.is_some_and(|(_, high)| past_end(at, high)) {
                continue;
            }
            // The cached end may be stale; the broker's own answer decides.
            match consumer.fetch_watermarks(&topic, p, REQUEST_TIMEOUT) {
                Ok((_, high)) if past_end(at, high) => {
                    if self.rewind(consumer, &topic, p, Some(at), Cause::Truncated) {
                        rewound.truncated += 1;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(subscription = %self.subscription, topic, partition = p,
                        error = %e, "watermarks not read");
                }
            }
        }
        rewound
    }

    /// Sends one partition back to its log start, and commits that offset so that a
    /// restart starts there too (the old committed offset may lie past the new log);
    /// whether it went back.
    fn rewind(
        &self,
        consumer: &StreamConsumer,
        topic: &str,
        partition: i32,
        position: Option<i64>,
        cause: Cause,
    ) -> bool {
        let sub = &self.subscription;
        let (start, end) = match consumer.fetch_watermarks(topic, partition, REQUEST_TIMEOUT) {
            Ok(w) => w,
            Err(e) => {
                // A position past the new log's end is found again by a later check.
                tracing::warn!(subscription = %sub, topic, partition, error = %e,
                    "log replaced, but its start is unknown: not rewound yet");
                return false;
            }
        };
        if let Err(e) = consumer.seek(topic, partition, Offset::Offset(start), REQUEST_TIMEOUT) {
            tracing::warn!(subscription = %sub, topic, partition, error = %e, "rewind failed");
            return false;
        }
        let mut tpl = TopicPartitionList::new();
        if tpl
            .add_partition_offset(topic, partition, Offset::Offset(start))
            .is_ok()
            && let Err(e) = consumer.commit(&tpl, CommitMode::Sync)
        {
            // The position moved: records are read again and committed as they are stored.
            tracing::warn!(subscription = %sub, topic, partition, error = %e,
                "rewound, but the log start not committed");
        }
        let why = match cause {
            Cause::Recreated => "topic recreated (new topic id)",
            Cause::Truncated => "position past the log end",
        };
        tracing::warn!(subscription = %sub, topic, partition,
            position = position.unwrap_or(-1), log_start = start, log_end = end, why,
            "log replaced under the consumer: reading it again from its start");
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_known_topic_with_another_id_was_recreated() {
        let mut known = HashMap::new();
        let ids = |v: &[(&str, u128)]| -> HashMap<String, TopicId> {
            v.iter()
                .map(|(t, i)| (t.to_string(), TopicId(*i)))
                .collect()
        };
        assert!(
            changed_ids(&mut known, ids(&[("a", 1), ("b", 2)])).is_empty(),
            "first sight"
        );
        assert!(
            changed_ids(&mut known, ids(&[("a", 1)])).is_empty(),
            "b missing: no change"
        );
        assert_eq!(
            changed_ids(&mut known, ids(&[("a", 1), ("b", 3)])),
            [("b".to_string(), TopicId(2), TopicId(3))],
            "b came back with a new id"
        );
        assert!(changed_ids(&mut known, ids(&[("b", 3)])).is_empty());
    }

    #[test]
    fn a_position_at_the_log_end_waits_and_past_it_goes_back() {
        assert!(!past_end(10, 10), "caught up");
        assert!(!past_end(3, 10));
        assert!(past_end(10, 3), "the log is shorter than the position");
        assert!(!past_end(10, -1), "no fetch answer yet");
    }
}

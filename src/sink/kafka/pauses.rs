//! What each live producer still holds, by topic, and the paused topics as last read
//! from the store, so that a pause purges what a producer holds of its topic.
//!
//! librdkafka purges only a whole producer's queues, not one topic's. A producer keeps
//! a record until the broker acknowledges it (librdkafka's own timeout is off), well
//! past mailroom's delivery deadline, which reports it transient: a record queued
//! behind a partition that does not answer is written whenever the partition answers
//! again, paused or not. So when a topic becomes paused, every producer still holding
//! records of it is purged (`rd_kafka_purge`, queued and in flight), once per pause. The
//! purged records were reported, or are reported, not delivered and transient: no
//! attempt spent, pending in order, published after the resume. Other topics' records
//! in that producer are purged too and go again at once.
//!
//! Handing a cycle's lines to librdkafka and reading a new pause take one lock, so a
//! line of a topic is either counted before its pause is seen (and purged with it) or
//! not handed over at all (`Gate::paused`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use rdkafka::producer::FutureProducer;

/// The paused topics and what each live producer holds.
#[derive(Default)]
pub(super) struct Pauses {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The paused topics as last read.
    paused: HashSet<String>,
    /// Each live producer's unfinished lines, by topic.
    producers: Vec<Arc<Held>>,
}

/// Lines of each topic handed to one producer whose records are not all reported yet.
struct Held {
    producer: Weak<FutureProducer>,
    lines: Mutex<HashMap<String, usize>>,
}

/// One line handed to a producer, counted until its records are all reported (dropped).
pub(super) struct HeldLine {
    held: Arc<Held>,
    topic: String,
}

impl Drop for HeldLine {
    fn drop(&mut self) {
        let mut lines = self.held.lines.lock().expect("held lock");
        if let Some(n) = lines.get_mut(&self.topic) {
            *n -= 1;
            if *n == 0 {
                lines.remove(&self.topic);
            }
        }
    }
}

/// The hand-over of a cycle's lines, which a new pause waits for.
pub(super) struct Gate<'a>(MutexGuard<'a, State>);

impl Gate<'_> {
    /// Whether `topic` is paused (as last read): its lines are not handed over.
    pub(super) fn paused(&self, topic: &str) -> bool {
        self.0.paused.contains(topic)
    }

    /// Counts a line of `topic` handed to `producer` until the returned guard drops.
    pub(super) fn hold(&mut self, producer: &Arc<FutureProducer>, topic: &str) -> HeldLine {
        let state = &mut self.0;
        let found = state
            .producers
            .iter()
            .find(|h| std::ptr::eq(h.producer.as_ptr(), Arc::as_ptr(producer)))
            .cloned();
        let held = match found {
            Some(h) => h,
            None => {
                // A producer gone is forgotten when a new one is first counted.
                state.producers.retain(|h| h.producer.strong_count() > 0);
                let h = Arc::new(Held {
                    producer: Arc::downgrade(producer),
                    lines: Mutex::default(),
                });
                state.producers.push(h.clone());
                h
            }
        };
        *held
            .lines
            .lock()
            .expect("held lock")
            .entry(topic.to_string())
            .or_default() += 1;
        HeldLine {
            held,
            topic: topic.to_string(),
        }
    }
}

impl Pauses {
    /// Takes the hand-over lock.
    pub(super) fn gate(&self) -> Gate<'_> {
        Gate(self.state.lock().expect("pauses lock"))
    }

    /// Whether `topic` is paused, as last read.
    pub(super) fn is_paused(&self, topic: &str) -> bool {
        self.gate().paused(topic)
    }

    /// Records the paused topics now; returns the topics newly paused that a live
    /// producer holds records of, and those producers (each once).
    pub(super) fn update(
        &self,
        topics: &HashSet<String>,
    ) -> (Vec<String>, Vec<Arc<FutureProducer>>) {
        let mut state = self.state.lock().expect("pauses lock");
        let newly: Vec<String> = topics.difference(&state.paused).cloned().collect();
        state.paused.clone_from(topics);
        if newly.is_empty() {
            return (Vec::new(), Vec::new());
        }
        let mut held_topics = HashSet::new();
        let mut producers = Vec::new();
        for h in &state.producers {
            let lines = h.lines.lock().expect("held lock");
            let holding: Vec<&String> = newly.iter().filter(|t| lines.contains_key(*t)).collect();
            if holding.is_empty() {
                continue;
            }
            if let Some(p) = h.producer.upgrade() {
                held_topics.extend(holding.into_iter().cloned());
                producers.push(p);
            }
        }
        let mut held_topics: Vec<String> = held_topics.into_iter().collect();
        held_topics.sort();
        (held_topics, producers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::ClientConfig;

    fn producer() -> Arc<FutureProducer> {
        Arc::new(
            ClientConfig::new()
                .set("bootstrap.servers", "127.0.0.1:1")
                .create()
                .unwrap(),
        )
    }

    fn set(topics: &[&str]) -> HashSet<String> {
        topics.iter().map(|t| t.to_string()).collect()
    }

    /// A newly paused topic names the producers holding lines of it, once per pause;
    /// a line whose records are all reported no longer counts; a topic paused is not
    /// handed over.
    #[test]
    fn a_pause_finds_the_producers_holding_its_topic_once() {
        let p = Pauses::default();
        let (a, b) = (producer(), producer());
        let held_a = p.gate().hold(&a, "t");
        let _held_b = p.gate().hold(&b, "u");
        let (topics, producers) = p.update(&set(&["t"]));
        assert_eq!(topics, ["t"]);
        assert_eq!(producers.len(), 1);
        assert!(Arc::ptr_eq(&producers[0], &a));
        assert!(p.is_paused("t") && !p.is_paused("u"));
        // Still paused: nothing new.
        assert_eq!(p.update(&set(&["t"])).1.len(), 0);
        // Resumed, its line reported, paused again: nothing held.
        p.update(&set(&[]));
        drop(held_a);
        assert_eq!(p.update(&set(&["t"])).1.len(), 0);
        // A pause of a topic nobody holds names no producer.
        assert_eq!(p.update(&set(&["t", "v"])).1.len(), 0);
        // And one of a topic held by `b`.
        let (topics, producers) = p.update(&set(&["u"]));
        assert_eq!(topics, ["u"]);
        assert!(Arc::ptr_eq(&producers[0], &b));
    }
}

//! Narrowing a broker's refusal down to the record at fault.
//!
//! Kafka refuses a record batch whole for one bad record (KIP-467), and the shared
//! producer's batches mix every key of a partition; with `enable.gapless.guarantee` the
//! refusal is also fatal to that producer, so every topic it carries is purged and
//! retried. Blaming the line that holds the first record of the batch would spend an
//! innocent event's attempt, and retrying the same way would disturb every topic at each
//! attempt. So a refusal seen on the shared producer spends no attempt: it marks its
//! topic *narrowed* for [`NARROWED_FOR`] after the last refusal. A narrowed topic is
//! published by a producer of its own: one record per batch (`batch.num.messages=1`)
//! and only the head of each line, so a refusal names exactly one record, which spends
//! its own attempt. That producer is not idempotent: order per key needs neither
//! idempotence nor the gapless guarantee there, because a key never has more than one
//! record in flight (a retried record can only follow a copy of itself), and a refusal
//! then costs nothing but the record's own failure: no fatal error, no epoch bump (which
//! some brokers answer by fencing the producer), and the shared producer and every other
//! topic never see it. docs/relay.md, "Broker refusals", says why.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;

/// How long a topic stays narrowed after the broker last refused one of its records.
pub const NARROWED_FOR: Duration = Duration::from_secs(60);

/// The narrowed topics and the producer that publishes them.
pub struct Narrowed {
    config: ClientConfig,
    until: Mutex<HashMap<String, Instant>>,
    producer: RwLock<Option<Arc<FutureProducer>>>,
}

impl Narrowed {
    /// Narrowing for a sink whose shared producer is built from `shared`.
    pub fn new(shared: &ClientConfig) -> Self {
        let mut config = shared.clone();
        let id = format!("{}-narrowed", shared.get("client.id").unwrap_or("mailroom"));
        config
            .set("client.id", id)
            .set("batch.num.messages", "1")
            .set("enable.idempotence", "false")
            .set("enable.gapless.guarantee", "false");
        Narrowed {
            config,
            until: Mutex::new(HashMap::new()),
            producer: RwLock::new(None),
        }
    }

    /// The broker refused a record of `topic`: narrow it (again) for [`NARROWED_FOR`].
    pub fn narrow(&self, topic: &str) {
        let until = Instant::now() + NARROWED_FOR;
        let mut map = self.until.lock().expect("narrowed lock");
        if map.insert(topic.to_string(), until).is_none() {
            tracing::warn!(
                topic,
                for_secs = NARROWED_FOR.as_secs(),
                "the broker refused a record batch: publishing this topic one record at a \
                 time to find the record at fault"
            );
        }
    }

    /// Whether `topic` is narrowed now.
    pub fn is_narrowed(&self, topic: &str) -> bool {
        let mut map = self.until.lock().expect("narrowed lock");
        match map.get(topic) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                map.remove(topic);
                tracing::info!(topic, "topic no longer narrowed: batches again");
                false
            }
            None => false,
        }
    }

    /// How many topics are narrowed.
    pub fn count(&self) -> usize {
        let now = Instant::now();
        let map = self.until.lock().expect("narrowed lock");
        map.values().filter(|u| **u > now).count()
    }

    /// The narrowed topics' producer, made on first use.
    pub fn producer(&self) -> Result<Arc<FutureProducer>, KafkaError> {
        if let Some(p) = &*self.producer.read().expect("producer lock") {
            return Ok(p.clone());
        }
        let mut slot = self.producer.write().expect("producer lock");
        if let Some(p) = &*slot {
            return Ok(p.clone());
        }
        let p = Arc::new(self.config.create::<FutureProducer>()?);
        *slot = Some(p.clone());
        Ok(p)
    }

    /// Drops the narrowed topics' producer (it can no longer deliver); the next use
    /// makes a new one.
    pub fn replace(&self, why: &str) {
        let old = self.producer.write().expect("producer lock").take();
        if let Some(old) = old {
            tracing::warn!(
                reason = why,
                "replacing the narrowed topics' Kafka producer"
            );
            // Dropping a producer flushes for up to 500 ms: not on a runtime thread.
            tokio::task::spawn_blocking(move || drop(old));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_narrowed_producer_sends_one_record_per_batch_without_idempotence() {
        let shared = crate::sink::kafka::producer_config(
            "h:1",
            Duration::from_secs(10),
            &Default::default(),
        );
        let n = Narrowed::new(&shared);
        assert_eq!(n.config.get("batch.num.messages"), Some("1"));
        assert_eq!(n.config.get("enable.idempotence"), Some("false"));
        assert_eq!(n.config.get("enable.gapless.guarantee"), Some("false"));
        // Still: every replica acknowledges, and librdkafka never times a record out.
        assert_eq!(n.config.get("acks"), Some("all"));
        assert_eq!(n.config.get("message.timeout.ms"), Some("0"));
        assert_eq!(n.config.get("client.id"), Some("mailroom-narrowed"));
    }

    #[test]
    fn a_topic_is_narrowed_until_its_time_is_up() {
        let n = Narrowed::new(&ClientConfig::new());
        assert!(!n.is_narrowed("orders"));
        n.narrow("orders");
        assert!(n.is_narrowed("orders"));
        assert!(!n.is_narrowed("payments"));
        assert_eq!(n.count(), 1);
        n.until
            .lock()
            .unwrap()
            .insert("orders".into(), Instant::now() - Duration::from_millis(1));
        assert!(!n.is_narrowed("orders"));
        assert_eq!(n.count(), 0);
    }
}

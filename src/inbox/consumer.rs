//! Kafka intake for one subscription: consume, store in the inbox (deduplicated), and
//! only then commit the offsets. A crash between the insert and the commit redelivers
//! records, which the dedup key drops; nothing is ever committed before it is stored.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::SubscriptionConfig;
use crate::domain::InboundMessage;
use crate::store::{Admission, Store};

/// Records stored per insert at most.
const MAX_BATCH: usize = 500;

/// Intake counters.
#[derive(Debug, Default)]
pub struct IntakeStats {
    pub received: AtomicU64,
    pub duplicates: AtomicU64,
}

/// The dedup id of a record: its `ce_id` header (mailroom's relay sets it), else
/// topic:partition:offset.
pub fn message_id(m: &OwnedMessage) -> String {
    m.headers()
        .and_then(|h| {
            h.iter()
                .find(|x| x.key == "ce_id")
                .and_then(|x| x.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        })
        .unwrap_or_else(|| format!("{}:{}:{}", m.topic(), m.partition(), m.offset()))
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

pub fn inbound(m: &OwnedMessage, max_attempts: u32) -> InboundMessage {
    let mut headers = BTreeMap::new();
    if let Some(h) = m.headers() {
        for x in h.iter() {
            headers.insert(text(x.key.as_bytes()), text(x.value.unwrap_or_default()));
        }
    }
    InboundMessage {
        message_id: text(message_id(m).as_bytes()),
        topic: m.topic().to_string(),
        key: m.key().filter(|k| !k.is_empty()).map(text),
        payload: m.payload().unwrap_or_default().to_vec(),
        event_type: headers.get("ce_type").cloned(),
        headers,
        max_attempts,
    }
}

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
        .set("client.id", "mailroom-inbox");
    for (k, v) in extra {
        c.set(k, v);
    }
    // Offsets are committed by hand, after the inbox insert has committed.
    c.set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    c
}

/// Runs one subscription's consumer until `shutdown`.
pub async fn run(
    store: Arc<dyn Store>,
    sub: SubscriptionConfig,
    config: ClientConfig,
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
            .map(|m| inbound(m, sub.retry.max_attempts))
            .collect();
        // Store before committing; retry the same batch until it is stored.
        let mut pause = Duration::from_millis(100);
        let admissions = loop {
            match store.receive(&sub.name, &messages).await {
                Ok(a) => break a,
                Err(e) => {
                    tracing::warn!(subscription = %sub.name, error = %e, "inbox insert failed; retrying, offsets not committed");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
        };
        let dups = admissions
            .iter()
            .filter(|a| matches!(a, Admission::Duplicate(_)))
            .count();
        stats
            .received
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        stats.duplicates.fetch_add(dups as u64, Ordering::Relaxed);
        if dups > 0 {
            tracing::debug!(subscription = %sub.name, dups, "duplicates dropped");
        }
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

    #[test]
    fn nul_characters_never_reach_the_store() {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "ab",
                value: Some(&b"x\0y"[..]),
            })
            .insert(Header {
                key: "ce_id",
                value: Some(&b"id\0"[..]),
            });
        let m = OwnedMessage::new(
            Some(b"payload\0ok".to_vec()),
            Some(b"k\0ey".to_vec()),
            "t".into(),
            Timestamp::NotAvailable,
            0,
            7,
            Some(headers),
        );
        let i = inbound(&m, 3);
        assert_eq!(i.key.as_deref(), Some("k\u{FFFD}ey"));
        assert_eq!(i.message_id, "id\u{FFFD}");
        assert_eq!(i.headers["ab"], "x\u{FFFD}y");
        assert_eq!(
            i.payload, b"payload\0ok",
            "the payload is bytes and stays as it is"
        );
    }
}

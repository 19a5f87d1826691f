//! Dead-letter topics (issue 44, item 3): every event that becomes `failed` is copied to
//! a dead-letter topic, when its outbox topic or its inbox subscription has one, so that
//! Kafka tools can work on failures. The event itself stays `failed` in mailroom (an
//! operator can still requeue it).
//!
//! A trigger records each failure in `mailroom_dead_letters` in the transaction that
//! failed the event (migration 0023), so no failure is missed by a process that dies
//! after its commit. This pump reads those rows, enqueues each copy as an ordinary
//! outbox event of the dead-letter topic, and then deletes the rows. A copy's idempotency
//! key names the box, the event and the failure's time, so a row read twice (a crash
//! between the enqueue and the delete, two replicas at once) stores one copy. The copy is
//! published by the relays like any event: in order per key, retried with attempts of
//! its own, never the original's.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::admin::DeadLetter;
use crate::domain::{BoxKind, NewEvent, check_topic};
use crate::intake::Wakeup;
use crate::schema::SchemaGate;
use crate::store::{Admission, Store};

/// Dead letters read per round.
const BATCH: u32 = 500;

/// The header names a dead-letter copy carries (besides the original's own headers).
pub mod headers {
    /// The failed event's (message's) id.
    pub const ORIGINAL_ID: &str = "mailroom-dlq-original-id";
    /// Its topic.
    pub const ORIGINAL_TOPIC: &str = "mailroom-dlq-original-topic";
    /// Its key (absent for an unkeyed event).
    pub const ORIGINAL_KEY: &str = "mailroom-dlq-original-key";
    /// The attempts it spent.
    pub const ATTEMPTS: &str = "mailroom-dlq-attempts";
    /// Its last error.
    pub const LAST_ERROR: &str = "mailroom-dlq-last-error";
    /// When it failed (RFC 3339).
    pub const FAILED_AT: &str = "mailroom-dlq-failed-at";
    /// `outbox` or `inbox`.
    pub const BOX: &str = "mailroom-dlq-box";
    /// Inbox: the subscription.
    pub const SUBSCRIPTION: &str = "mailroom-dlq-subscription";
    /// Inbox: the message id.
    pub const MESSAGE_ID: &str = "mailroom-dlq-message-id";
}

/// Which failures get a dead-letter copy, and where it goes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeadLetterConfig {
    /// Outbox topics whose failures are copied (`None`: none; `all`: every topic).
    pub topics: TopicChoice,
    /// Appended to an outbox topic's name to name its dead-letter topic.
    pub suffix: String,
    /// Inbox subscriptions with a dead-letter topic: name → topic.
    pub subscriptions: BTreeMap<String, String>,
    /// Time between rounds when nothing was waiting.
    pub interval: Duration,
}

/// The outbox topics that have a dead-letter topic.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum TopicChoice {
    /// None.
    #[default]
    None,
    /// Every topic (but dead-letter topics themselves).
    All,
    /// These.
    Some(HashSet<String>),
}

impl DeadLetterConfig {
    /// The dead-letter topic of a failure, if it has one. A dead-letter topic's own
    /// failures are never copied again (no `orders.dlq.dlq`).
    pub fn target(&self, b: BoxKind, topic: &str, subscription: &str) -> Option<String> {
        match b {
            BoxKind::Inbox => self.subscriptions.get(subscription).cloned(),
            BoxKind::Outbox => {
                let wanted = match &self.topics {
                    TopicChoice::None => false,
                    TopicChoice::All => true,
                    TopicChoice::Some(set) => set.contains(topic),
                };
                let is_dead_letter_topic = (!self.suffix.is_empty()
                    && topic.ends_with(&self.suffix))
                    || self.subscriptions.values().any(|t| t == topic);
                (wanted && !is_dead_letter_topic).then(|| format!("{topic}{}", self.suffix))
            }
        }
    }
}

/// The copy of a dead letter for `topic`, or `None` when the event is gone.
pub fn copy_of(d: &DeadLetter, topic: String) -> Option<NewEvent> {
    let detail = d.event.as_ref()?;
    let e = &detail.event;
    let mut h = e.headers.clone();
    h.insert(headers::ORIGINAL_ID.into(), e.id.to_string());
    h.insert(headers::ORIGINAL_TOPIC.into(), e.topic.clone());
    if let Some(k) = &e.key {
        h.insert(headers::ORIGINAL_KEY.into(), k.clone());
    }
    h.insert(headers::ATTEMPTS.into(), e.attempts.to_string());
    if let Some(err) = &e.last_error {
        h.insert(headers::LAST_ERROR.into(), err.clone());
    }
    h.insert(headers::FAILED_AT.into(), d.failed_at.to_rfc3339());
    h.insert(headers::BOX.into(), d.box_kind.as_str().into());
    if let Some(s) = &detail.subscription {
        h.insert(headers::SUBSCRIPTION.into(), s.clone());
    }
    if let Some(m) = &detail.message_id {
        h.insert(headers::MESSAGE_ID.into(), m.clone());
    }
    Some(NewEvent {
        topic,
        key: e.key.clone(),
        payload: e.payload.clone(),
        headers: h,
        event_type: e.event_type.clone(),
        idempotency_key: Some(format!(
            "mailroom.dead-letter/{}/{}/{}",
            d.box_kind.as_str(),
            e.id,
            d.failed_at.timestamp_micros()
        )),
        deliver_after: None,
        max_attempts: e.max_attempts,
    })
}

/// One round: up to `BATCH` dead letters copied (those with a dead-letter topic) and
/// deleted; how many copies were stored.
pub async fn round(
    store: &dyn Store,
    config: &DeadLetterConfig,
    wakeup: &Wakeup,
) -> Result<(usize, usize), crate::store::StoreError> {
    let letters = store.dead_letters(BATCH).await?;
    let mut copies = Vec::new();
    for d in &letters {
        let Some(detail) = &d.event else { continue };
        let sub = detail.subscription.as_deref().unwrap_or("");
        let Some(topic) = config.target(d.box_kind, &detail.event.topic, sub) else {
            continue;
        };
        if let Err(why) = check_topic(&topic) {
            tracing::warn!(event = d.event_id, %topic, %why, "dead-letter topic refused; the event stays failed only");
            continue;
        }
        copies.extend(copy_of(d, topic));
    }
    let stored = if copies.is_empty() {
        0
    } else {
        let admissions = store.enqueue(&copies, false).await?;
        let n = admissions
            .iter()
            .filter(|a| matches!(a, Admission::Inserted(_)))
            .count();
        if n > 0 {
            wakeup.wake();
        }
        n
    };
    store.drop_dead_letters(&letters).await?;
    Ok((letters.len(), stored))
}

/// Runs rounds until `shutdown`: at once again while a round found a full batch, else
/// every `config.interval`. Nothing is done while the schema gate refuses this binary.
pub async fn run(
    store: Arc<dyn Store>,
    config: DeadLetterConfig,
    wakeup: Wakeup,
    schema: SchemaGate,
    shutdown: CancellationToken,
) {
    loop {
        let mut busy = false;
        if schema.allows().await {
            match round(store.as_ref(), &config, &wakeup).await {
                Ok((read, stored)) => {
                    if stored > 0 {
                        tracing::info!(read, stored, "dead letters copied");
                    }
                    busy = read == BATCH as usize;
                }
                Err(e) => tracing::warn!(error = %e, "dead-letter round failed"),
            }
        }
        let wait = if busy {
            Duration::ZERO
        } else {
            config.interval
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_chosen_topics_and_never_a_dead_letter_topic() {
        let mut c = DeadLetterConfig {
            topics: TopicChoice::Some(["orders".to_string()].into()),
            suffix: ".dlq".into(),
            subscriptions: [("billing".to_string(), "billing.failed".to_string())].into(),
            interval: Duration::from_secs(1),
        };
        assert_eq!(
            c.target(BoxKind::Outbox, "orders", ""),
            Some("orders.dlq".into())
        );
        assert_eq!(c.target(BoxKind::Outbox, "payments", ""), None);
        assert_eq!(
            c.target(BoxKind::Inbox, "orders", "billing"),
            Some("billing.failed".into())
        );
        assert_eq!(c.target(BoxKind::Inbox, "orders", "other"), None);
        c.topics = TopicChoice::All;
        assert_eq!(
            c.target(BoxKind::Outbox, "payments", ""),
            Some("payments.dlq".into())
        );
        assert_eq!(c.target(BoxKind::Outbox, "orders.dlq", ""), None);
        assert_eq!(c.target(BoxKind::Outbox, "billing.failed", ""), None);
    }
}

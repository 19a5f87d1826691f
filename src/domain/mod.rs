//! Domain types shared by every layer: events as accepted, events as stored, statuses,
//! the box an event lives in, and the outcomes of storing one.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

pub mod admin;
pub mod headers;
pub mod jobs;

/// Server-assigned event id. Ids increase in acceptance order within a key.
pub type EventId = i64;

/// Which table family an operation applies to. The relay engine and the admin surface
/// are written once and pointed at either box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BoxKind {
    /// Events producers enqueue, published to Kafka.
    Outbox,
    /// Messages received for subscriptions, dispatched to their handlers.
    Inbox,
}

impl BoxKind {
    /// `"outbox"` or `"inbox"`, as stored and logged.
    pub fn as_str(self) -> &'static str {
        match self {
            BoxKind::Outbox => "outbox",
            BoxKind::Inbox => "inbox",
        }
    }
}

/// What a relay works on: the outbox, or one subscription's part of the inbox. Claims
/// and settles are scoped to it, so each subscription's dispatcher sees only its messages.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Queue {
    /// The whole outbox.
    Outbox,
    /// One subscription's part of the inbox.
    Inbox {
        /// The subscription's name.
        subscription: String,
    },
}

impl Queue {
    /// The box this queue is part of.
    pub fn box_kind(&self) -> BoxKind {
        match self {
            Queue::Outbox => BoxKind::Outbox,
            Queue::Inbox { .. } => BoxKind::Inbox,
        }
    }

    /// The inbox subscription; `None` for the outbox.
    pub fn subscription(&self) -> Option<&str> {
        match self {
            Queue::Outbox => None,
            Queue::Inbox { subscription } => Some(subscription),
        }
    }
}

/// Lifecycle of an event: `Pending` until published, then `Completed`; `Failed` is
/// terminal until an operator requeues it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Waiting for delivery: due now, or scheduled for later (a delay or a retry).
    Pending,
    /// Delivered: published to Kafka, or handled, in the inbox.
    Completed,
    /// Out of attempts, rejected, or cancelled by an operator.
    Failed,
}

impl Status {
    /// `"pending"`, `"completed"` or `"failed"`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Completed => "completed",
            Status::Failed => "failed",
        }
    }

    /// The status stored as `s`; `None` for any other text.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(Status::Pending),
            "completed" => Some(Status::Completed),
            "failed" => Some(Status::Failed),
            _ => None,
        }
    }
}

/// A validated event as a producer handed it over, before it has an id.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// The Kafka topic (see `check_topic`).
    pub topic: String,
    /// `None`: unordered.
    pub key: Option<String>,
    /// The payload, opaque to mailroom.
    pub payload: Vec<u8>,
    /// Sorted, so the stored JSON and the idempotency fingerprint are canonical.
    pub headers: BTreeMap<String, String>,
    /// The producer's event type; `None` if it gave none.
    pub event_type: Option<String>,
    /// Makes a retried enqueue with the same content return the stored event instead of
    /// storing another (scoped to the topic); `None`: no deduplication.
    pub idempotency_key: Option<String>,
    /// Not delivered before this time; `None`: at once.
    pub deliver_after: Option<DateTime<Utc>>,
    /// Resolved attempt budget (the server default when the client sent none).
    pub max_attempts: u32,
}

impl NewEvent {
    /// A stable 64-bit fingerprint of the content, used to tell an idempotent retry
    /// (same content) from a conflicting reuse of the key (other content). Version 2:
    /// the first 8 bytes (big-endian) of SHA-256 over a length-prefixed big-endian
    /// encoding, which the SQL API computes too (`mailroom_fingerprint` in migration
    /// 0007), so gRPC and SQL callers may share idempotency keys. It never changes
    /// between builds.
    pub fn fingerprint(&self) -> i64 {
        let d = self.digest();
        i64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
    }

    /// SHA-256 over the canonical big-endian encoding both fingerprints (and the SQL
    /// API's `mailroom_fingerprint`, `mailroom_fingerprint128`) take a prefix of.
    fn digest(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let field = |h: &mut Sha256, b: &[u8]| {
            h.update((b.len() as u64).to_be_bytes());
            h.update(b);
        };
        let opt = |h: &mut Sha256, b: Option<&[u8]>| match b {
            None => h.update([0]),
            Some(b) => {
                h.update([1]);
                h.update((b.len() as u64).to_be_bytes());
                h.update(b);
            }
        };
        field(&mut h, self.topic.as_bytes());
        opt(&mut h, self.key.as_deref().map(str::as_bytes));
        field(&mut h, &self.payload);
        // Trace context is not content: a retried request carries a new parent span id.
        let content = self
            .headers
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "traceparent" | "tracestate"));
        h.update((content.clone().count() as u64).to_be_bytes());
        for (k, v) in content {
            field(&mut h, k.as_bytes());
            field(&mut h, v.as_bytes());
        }
        opt(&mut h, self.event_type.as_deref().map(str::as_bytes));
        opt(
            &mut h,
            self.deliver_after
                .map(|t| t.timestamp_micros().to_be_bytes())
                .as_ref()
                .map(|b| &b[..]),
        );
        field(&mut h, &self.max_attempts.to_be_bytes());
        h.finalize().into()
    }

    /// The fingerprint stored before migration 0007 (FNV-1a over a length-prefixed
    /// little-endian encoding). Rows written then still carry it: a retry matches either.
    pub fn legacy_fingerprint(&self) -> i64 {
        let mut h = Fnv::default();
        self.encode(&mut h);
        h.0 as i64
    }

    /// The content fingerprint stored in `content_fp` (`content_fp_version = 2`, migration
    /// 0008): the first 128 bits of the same SHA-256 digest. It tells an idempotent retry
    /// (same content) from a reuse of the key with other content, and no producer can
    /// construct another content with the same value. The 64-bit `fingerprint` is its
    /// prefix, kept in `content_hash` for the SQL API's callers and older rows.
    pub fn fingerprint128(&self) -> Vec<u8> {
        self.digest()[..16].to_vec()
    }

    /// The length-prefixed little-endian encoding the legacy (FNV) fingerprint hashes.
    fn encode(&self, h: &mut impl Sink) {
        h.field(self.topic.as_bytes());
        h.opt(self.key.as_deref().map(str::as_bytes));
        h.field(&self.payload);
        let content = self
            .headers
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "traceparent" | "tracestate"));
        h.field(&(content.clone().count() as u64).to_le_bytes());
        for (k, v) in content {
            h.field(k.as_bytes());
            h.field(v.as_bytes());
        }
        h.opt(self.event_type.as_deref().map(str::as_bytes));
        h.opt(
            self.deliver_after
                .map(|t| t.timestamp_micros().to_le_bytes())
                .as_ref()
                .map(|b| &b[..]),
        );
        h.field(&self.max_attempts.to_le_bytes());
    }

    /// Whether a stored fingerprint is this content's (either version).
    pub fn same_content(&self, stored: i64) -> bool {
        stored == self.fingerprint() || stored == self.legacy_fingerprint()
    }
}

/// Where the fingerprint encoding goes.
trait Sink {
    fn bytes(&mut self, b: &[u8]);
    fn field(&mut self, b: &[u8]) {
        self.bytes(&(b.len() as u64).to_le_bytes());
        self.bytes(b);
    }
    fn opt(&mut self, b: Option<&[u8]>) {
        match b {
            None => self.bytes(&[0]),
            Some(b) => {
                self.bytes(&[1]);
                self.field(b);
            }
        }
    }
}

struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Sink for Fnv {
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// The scope of an idempotency key: its topic. One producer's key never meets another
/// topic's (and a token limited to topics can neither take nor probe other keys).
/// Topics cannot contain NUL, so the pair is unambiguous.
pub fn idempotency_scope(topic: &str, key: &str) -> String {
    format!("{topic}\0{key}")
}

/// A message arriving for a subscription's inbox (from Kafka or `InboxService.Receive`).
#[derive(Debug, Clone, PartialEq)]
pub struct InboundMessage {
    /// Deduplication identity, namespaced by origin (`src/inbox/identity.rs`):
    /// `ce:…` (a CloudEvent's source and id, binary or structured mode),
    /// `kafka:topic:partition:offset@timestamp`, or `rpc:<id>`.
    pub message_id: String,
    /// The message's topic.
    pub topic: String,
    /// `None`: unkeyed, so unordered.
    pub key: Option<String>,
    /// The payload, opaque to mailroom.
    pub payload: Vec<u8>,
    /// The message's headers, sorted.
    pub headers: BTreeMap<String, String>,
    /// The message's event type, if any.
    pub event_type: Option<String>,
    /// Attempt budget of the handler deliveries.
    pub max_attempts: u32,
    /// Set when the message must be stored as `failed` at once (a Kafka record over the
    /// inbox limits, or refused by the database): the reason, kept as its last error.
    pub failure: Option<String>,
}

/// What storing one event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// Stored by this call, with this id.
    Inserted(EventId),
    /// An earlier request with the same idempotency key and content stored it.
    Duplicate(EventId),
}

impl Enqueued {
    /// The stored event's id, new or earlier.
    pub fn id(self) -> EventId {
        match self {
            Enqueued::Inserted(id) | Enqueued::Duplicate(id) => id,
        }
    }
    /// Whether an earlier request had already stored it.
    pub fn is_duplicate(self) -> bool {
        matches!(self, Enqueued::Duplicate(_))
    }
}

/// An event as stored, with its delivery state.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEvent {
    /// Server-assigned id.
    pub id: EventId,
    /// The Kafka topic (the origin topic, in the inbox).
    pub topic: String,
    /// `None`: unkeyed, so unordered.
    pub key: Option<String>,
    /// The payload; empty when a query leaves it out.
    pub payload: Vec<u8>,
    /// Headers, sorted, with any trace context stored (`traceparent`, `tracestate`).
    pub headers: BTreeMap<String, String>,
    /// The event type, if any.
    pub event_type: Option<String>,
    /// The idempotency key it was enqueued with, if any.
    pub idempotency_key: Option<String>,
    /// Where it is in its lifecycle.
    pub status: Status,
    /// Delivery attempts counted so far.
    pub attempts: u32,
    /// Attempt budget: a counted failure that reaches it fails the event.
    pub max_attempts: u32,
    /// When it is next due (for a pending event).
    pub scheduled_at: DateTime<Utc>,
    /// When it was accepted.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// When it completed; `None` until then.
    pub published_at: Option<DateTime<Utc>>,
    /// The last delivery error, gap note or cancel reason; `None` if there is none.
    pub last_error: Option<String>,
}

/// Request limits, from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest payload per event, in bytes.
    pub max_payload_bytes: usize,
    /// Most headers per event.
    pub max_headers: usize,
    /// Bytes of header names and values per event, in all.
    pub max_header_bytes: usize,
    /// Largest key, in bytes.
    pub max_key_bytes: usize,
    /// Most events per `EnqueueBatch`.
    pub max_batch: usize,
    /// Largest `max_attempts` a producer may ask for.
    pub max_attempts_cap: u32,
    /// Attempt budget of an event that asks for none (`max_attempts` 0).
    pub default_max_attempts: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // Stock Kafka's 1,048,588-byte record batch less the largest headers and
            // 16 KiB of key, CloudEvents attributes and framing (`config::resolve`).
            max_payload_bytes: 1_015_820,
            max_headers: 64,
            max_header_bytes: 16 * 1024,
            max_key_bytes: 1024,
            max_batch: 1000,
            max_attempts_cap: 100,
            default_max_attempts: 6,
        }
    }
}

/// Kafka's topic rule: 1-249 characters of `[a-zA-Z0-9._-]`.
pub fn check_topic(topic: &str) -> Result<(), &'static str> {
    if topic.is_empty() {
        return Err("is required");
    }
    if topic.len() > 249 {
        return Err("must be at most 249 characters");
    }
    if topic == "." || topic == ".." {
        return Err("must not be '.' or '..'");
    }
    if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
    {
        return Err("may contain only [a-zA-Z0-9._-]");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> NewEvent {
        NewEvent {
            topic: "orders".into(),
            key: Some("42".into()),
            payload: vec![0, 1, 2],
            headers: BTreeMap::from([("a".into(), "b".into())]),
            event_type: None,
            idempotency_key: Some("k".into()),
            deliver_after: None,
            max_attempts: 6,
        }
    }

    #[test]
    fn fingerprint_changes_with_every_content_field() {
        let base = event().fingerprint();
        assert_eq!(base, event().fingerprint());
        let mut e = event();
        e.payload.push(3);
        assert_ne!(base, e.fingerprint());
        let mut e = event();
        e.key = None;
        assert_ne!(base, e.fingerprint());
        let mut e = event();
        e.headers.insert("c".into(), "d".into());
        assert_ne!(base, e.fingerprint());
        let mut e = event();
        e.event_type = Some(String::new());
        assert_ne!(base, e.fingerprint());
        let mut e = event();
        e.deliver_after = Some(Utc::now());
        assert_ne!(base, e.fingerprint());
        // Trace context is not content.
        let mut e = event();
        e.headers.insert("traceparent".into(), "00-x".into());
        assert_eq!(base, e.fingerprint());
        // The idempotency key itself is not content.
        let mut e = event();
        e.idempotency_key = Some("other".into());
        assert_eq!(base, e.fingerprint());
    }

    #[test]
    fn fingerprint_matches_the_sql_api() {
        // `SELECT mailroom_fingerprint('orders', '42', '\\x000102', '{"a":"b"}', NULL, NULL, 6)`
        // on a database migrated with 0007 (tests/it/sql_api.rs checks more cases live).
        assert_eq!(event().fingerprint(), 3233139743323162467);
        // Rows stored before 0007 carry the legacy fingerprint; both are accepted.
        assert!(event().same_content(event().legacy_fingerprint()));
        assert!(event().same_content(event().fingerprint()));
        assert_ne!(event().fingerprint(), event().legacy_fingerprint());
    }

    #[test]
    fn topics_follow_kafka_rules() {
        assert!(check_topic("orders.v1_x-y").is_ok());
        assert!(check_topic("").is_err());
        assert!(check_topic(&"a".repeat(249)).is_ok());
        assert!(check_topic(&"a".repeat(250)).is_err());
        assert!(check_topic("a b").is_err());
        assert!(check_topic("é").is_err());
        assert!(check_topic("..").is_err());
    }
}

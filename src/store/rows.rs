//! Reading rows the same way on every engine. An engine's row type says how it stores a
//! time (`timestamptz` on PostgreSQL, microseconds since the epoch on SQLite) and how
//! wide its small integers are; everything decoded from rows is written once over
//! `Cols`.

use chrono::{DateTime, Utc};

use super::{StoreError, StoreResult};
use crate::domain::admin::{
    AdminKey, AttemptRecord, AuditEntry, EventDetail, KeyBacklog, TopicPause,
};
use crate::domain::{BoxKind, EventId, Status, StoredEvent};

/// The columns of one result row, by name, in the engine's encoding.
pub(crate) trait Cols {
    fn text(&self, col: &str) -> StoreResult<String>;
    fn opt_text(&self, col: &str) -> StoreResult<Option<String>>;
    fn int(&self, col: &str) -> StoreResult<i64>;
    /// A small count (attempts): `int4` on PostgreSQL.
    fn count(&self, col: &str) -> StoreResult<u32>;
    fn flag(&self, col: &str) -> StoreResult<bool>;
    fn bytes(&self, col: &str) -> StoreResult<Vec<u8>>;
    fn time(&self, col: &str) -> StoreResult<DateTime<Utc>>;
    fn opt_time(&self, col: &str) -> StoreResult<Option<DateTime<Utc>>>;

    /// A status column.
    fn status(&self, col: &str) -> StoreResult<Status> {
        let status = self.text(col)?;
        Status::parse(&status)
            .ok_or_else(|| StoreError::other(format!("unknown status {status:?}")))
    }
}

/// The columns `decode_event` reads, in one list for every engine and statement:
/// `payload` is the payload's expression (a `CASE` where the admin may hide it) and
/// `headers` the engine's text form of the headers column.
pub(crate) fn event_columns(payload: &str, headers: &str) -> String {
    format!(
        "id, topic, event_key, {payload} AS payload, {headers} AS headers, event_type, \
         idempotency_key, status, attempts, max_attempts, scheduled_at, created_at, \
         updated_at, published_at, last_error"
    )
}

/// A `StoredEvent` from the event columns (headers as JSON text).
pub(crate) fn decode_event(row: &impl Cols) -> StoreResult<StoredEvent> {
    let headers = row.text("headers")?;
    Ok(StoredEvent {
        id: row.int("id")?,
        topic: row.text("topic")?,
        key: row.opt_text("event_key")?,
        payload: row.bytes("payload")?,
        headers: serde_json::from_str(&headers)
            .map_err(|e| StoreError::other(format!("stored headers are not a JSON map: {e}")))?,
        event_type: row.opt_text("event_type")?,
        idempotency_key: row.opt_text("idempotency_key")?,
        status: row.status("status")?,
        attempts: row.count("attempts")?,
        max_attempts: row.count("max_attempts")?,
        scheduled_at: row.time("scheduled_at")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        published_at: row.opt_time("published_at")?,
        last_error: row.opt_text("last_error")?,
    })
}

/// An event with its payload size and, in the inbox, subscription and message id.
/// Claimed unkeyed events in the order they are due: `UPDATE … RETURNING` keeps none.
pub(crate) fn in_due_order<R: Cols>(rows: &[R]) -> StoreResult<Vec<StoredEvent>> {
    let mut v = rows
        .iter()
        .map(decode_event)
        .collect::<StoreResult<Vec<_>>>()?;
    v.sort_by_key(|e| (e.scheduled_at, e.id));
    Ok(v)
}

pub(crate) fn decode_detail(row: &impl Cols) -> StoreResult<EventDetail> {
    Ok(EventDetail {
        event: decode_event(row)?,
        payload_size: row.int("payload_size")?,
        subscription: row.opt_text("subscription")?,
        message_id: row.opt_text("message_id")?,
        attempt_log: decode_attempt_log(row.opt_text("attempt_log")?.as_deref())?,
    })
}

/// The attempt history's JSON array (migration 0018): `at` is RFC 3339 text on
/// PostgreSQL, microseconds since the epoch on SQLite.
pub(crate) fn decode_attempt_log(json: Option<&str>) -> StoreResult<Vec<AttemptRecord>> {
    let Some(json) = json else {
        return Ok(Vec::new());
    };
    let bad = |what: &str| StoreError::other(format!("attempt log: {what}"));
    let items: Vec<serde_json::Value> =
        serde_json::from_str(json).map_err(|e| bad(&e.to_string()))?;
    items
        .iter()
        .map(|v| {
            let at = match &v["at"] {
                serde_json::Value::Number(n) => n
                    .as_i64()
                    .and_then(DateTime::<Utc>::from_timestamp_micros)
                    .ok_or_else(|| bad("time out of range"))?,
                serde_json::Value::String(t) => DateTime::parse_from_rfc3339(t)
                    .map_err(|e| bad(&e.to_string()))?
                    .with_timezone(&Utc),
                _ => return Err(bad("no time")),
            };
            Ok(AttemptRecord {
                attempt: v["attempt"]
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .unwrap_or(0),
                at,
                error: v["error"].as_str().unwrap_or_default().to_string(),
            })
        })
        .collect()
}

/// One event a requeue or cancel would change.
pub(crate) struct Candidate {
    pub id: EventId,
    /// `""` in the outbox.
    pub subscription: String,
    pub topic: String,
    pub key: Option<String>,
    pub status: Status,
}

pub(crate) fn decode_candidate(row: &impl Cols) -> StoreResult<Candidate> {
    Ok(Candidate {
        id: row.int("id")?,
        subscription: row.text("subscription")?,
        topic: row.text("topic")?,
        key: row.opt_text("event_key")?,
        status: row.status("status")?,
    })
}

/// A key row as the admin reports it: the subscription is kept for the inbox only.
pub(crate) fn admin_key(b: BoxKind, subscription: String, topic: String, key: String) -> AdminKey {
    AdminKey {
        subscription: match b {
            BoxKind::Outbox => None,
            BoxKind::Inbox => Some(subscription),
        },
        topic,
        key,
    }
}

/// One backlog group (a key and its head) of a row with a topic.
pub(crate) fn decode_backlog(r: &impl Cols, topic: String) -> StoreResult<KeyBacklog> {
    Ok(KeyBacklog {
        subscription: r.text("subscription")?,
        topic,
        key: r.text("key")?,
        pending: r.int("pending")?,
        oldest_created_at: r.time("created_at")?,
        head_id: r.int("head_id")?,
        head_attempts: r.count("attempts")?,
        head_next_attempt_at: r.time("scheduled_at")?,
        head_last_error: r.opt_text("last_error")?,
        blocked: r.flag("blocked")?,
        paused: false,
    })
}

pub(crate) fn decode_pause(row: &impl Cols) -> StoreResult<TopicPause> {
    Ok(TopicPause {
        topic: row.text("topic")?,
        reason: row.text("reason")?,
        actor: row.text("actor")?,
        principal: row.opt_text("principal")?,
        paused_at: row.time("paused_at")?,
    })
}

pub(crate) fn decode_audit(row: &impl Cols) -> StoreResult<AuditEntry> {
    Ok(AuditEntry {
        id: row.int("id")?,
        at: row.time("at")?,
        actor: row.text("actor")?,
        action: row.text("action")?,
        box_kind: if row.text("box")? == "inbox" {
            BoxKind::Inbox
        } else {
            BoxKind::Outbox
        },
        selection: row.text("selection")?,
        count: row.int("count")?,
        principal: row.opt_text("principal")?,
        request_id: row.opt_text("request_id")?,
    })
}

//! A record's headers under the CloudEvents Kafka protocol binding (binary content mode).

use std::borrow::Cow;

use crate::domain::StoredEvent;

/// One record header: its name and its value, borrowed from the event where they can be.
pub type CeHeader<'a> = (Cow<'a, str>, Cow<'a, str>);

/// The CloudEvents attributes mailroom sets itself (binary content mode).
const CE_OWN: [&str; 5] = ["ce_specversion", "ce_id", "ce_type", "ce_source", "ce_time"];
/// The content type when an event names none.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

/// A record's headers, following the CloudEvents Kafka protocol binding (binary content
/// mode) exactly:
/// - `ce_specversion` = `1.0`, `ce_id` = `<event id>-<created_at in µs since the epoch>`
///   (unique within a database even after a restore from a backup: the restored
///   database issues the lost ids again, at later times), `ce_type` (the event's type,
///   `mailroom.event` when it has none), `ce_source` (`app::ce_source`: tells
///   deployments apart), `ce_time` (RFC 3339);
/// - `content-type` (the binding's name for `datacontenttype`): the event's own
///   `content-type` header (any case, or a `ce_datacontenttype` one), else
///   `application/octet-stream`;
/// - the event's other headers as they are, except those naming an attribute mailroom
///   sets (an event cannot forge its `ce_id` or `ce_source`). Other `ce_*` headers pass
///   through as extension attributes.
pub fn cloud_event_headers<'a>(e: &'a StoredEvent, source: &'a str) -> Vec<CeHeader<'a>> {
    // Borrowed where the event or the source already hold the text: the relay builds
    // these for every record, and two owned strings per header were most of the cost.
    let mut content_type: Option<&'a str> = None;
    let mut out = Vec::with_capacity(e.headers.len() + 6);
    for (k, v) in &e.headers {
        if k.eq_ignore_ascii_case("content-type") || k.eq_ignore_ascii_case("ce_datacontenttype") {
            content_type.get_or_insert(v.as_str());
        } else if !CE_OWN.iter().any(|own| k.eq_ignore_ascii_case(own)) {
            out.push((Cow::Borrowed(k.as_str()), Cow::Borrowed(v.as_str())));
        }
    }
    let ty = e.event_type.as_deref().unwrap_or("mailroom.event");
    out.extend([
        (Cow::Borrowed("ce_specversion"), Cow::Borrowed("1.0")),
        (
            Cow::Borrowed("ce_id"),
            Cow::Owned(format!("{}-{}", e.id, e.created_at.timestamp_micros())),
        ),
        (Cow::Borrowed("ce_type"), Cow::Borrowed(ty)),
        (Cow::Borrowed("ce_source"), Cow::Borrowed(source)),
        (
            Cow::Borrowed("ce_time"),
            Cow::Owned(e.created_at.to_rfc3339()),
        ),
        (
            Cow::Borrowed("content-type"),
            Cow::Borrowed(content_type.unwrap_or(DEFAULT_CONTENT_TYPE)),
        ),
    ]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(headers: &[(&str, &str)]) -> StoredEvent {
        let t = chrono::DateTime::from_timestamp(1_764_600_000, 123_456_000).unwrap();
        StoredEvent {
            id: 42,
            topic: "orders".into(),
            key: Some("k".into()),
            payload: b"{}".to_vec(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            event_type: Some("order.created".into()),
            idempotency_key: None,
            status: crate::domain::Status::Pending,
            attempts: 0,
            max_attempts: 6,
            scheduled_at: t,
            created_at: t,
            updated_at: t,
            published_at: None,
            last_error: None,
        }
    }

    #[test]
    fn headers_follow_the_cloudevents_kafka_binding() {
        let get = |h: &[CeHeader<'_>], k: &str| -> Vec<String> {
            h.iter()
                .filter(|(n, _)| n == k)
                .map(|(_, v)| v.to_string())
                .collect()
        };
        let e = stored(&[("source", "checkout")]);
        let h = cloud_event_headers(&e, "mailroom/x");
        assert_eq!(get(&h, "ce_specversion"), ["1.0"]);
        assert_eq!(get(&h, "ce_id"), ["42-1764600000123456"]);
        assert_eq!(get(&h, "ce_type"), ["order.created"]);
        assert_eq!(get(&h, "ce_source"), ["mailroom/x"]);
        assert_eq!(get(&h, "ce_time"), ["2025-12-01T14:40:00.123456+00:00"]);
        assert_eq!(get(&h, "content-type"), [DEFAULT_CONTENT_TYPE]);
        assert_eq!(get(&h, "source"), ["checkout"]);
        // The event's content type, whatever its spelling; no forged ce_id/ce_source;
        // other ce_ extensions pass through.
        let e = stored(&[
            ("Content-Type", "application/json"),
            ("ce_id", "forged"),
            ("ce_source", "forged"),
            ("ce_subject", "order-42"),
        ]);
        let h = cloud_event_headers(&e, "mailroom/x");
        assert_eq!(get(&h, "content-type"), ["application/json"]);
        assert!(get(&h, "Content-Type").is_empty());
        assert_eq!(get(&h, "ce_id"), ["42-1764600000123456"]);
        assert_eq!(get(&h, "ce_source"), ["mailroom/x"]);
        assert_eq!(get(&h, "ce_subject"), ["order-42"]);
        let e = stored(&[("ce_datacontenttype", "text/plain")]);
        let h = cloud_event_headers(&e, "s");
        assert_eq!(get(&h, "content-type"), ["text/plain"]);
        assert!(get(&h, "ce_datacontenttype").is_empty());
    }
}

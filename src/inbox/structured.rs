//! Structured-mode CloudEvents (the Kafka protocol binding's other mode, Dapr's default):
//! the record's `content-type` header is `application/cloudevents+json` (parameters
//! such as `; charset=utf-8` allowed, any case) and its value is the event as a JSON
//! object, `id`, `source`, `specversion`, `type`, optional `data` or `data_base64` and
//! extensions. Such an event is identified by `source` and `id`, as a binary-mode one
//! is by `ce_source` and `ce_id`, and its attributes are shown to the handler the way
//! binary mode carries them: as `ce_<name>` headers.
//!
//! A value that is not such an object (not JSON, no string `id`) is not an error of the
//! record: it is delivered and deduplicated by its place in the log.

use serde_json::{Map, Value};

use super::record::Record;

/// The media type of one CloudEvent in JSON (the event format), without parameters.
pub const MEDIA_TYPE: &str = "application/cloudevents+json";

/// The header naming the content type (the binding's name, matched in any case).
pub const CONTENT_TYPE: &str = "content-type";

/// A structured-mode CloudEvent, as far as mailroom reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructuredEvent {
    /// `id`.
    pub id: String,
    /// `source` (empty when missing, as a binary-mode event without `ce_source`).
    pub source: String,
    /// `type`, when it is a string.
    pub event_type: Option<String>,
    /// The context attributes as `ce_<name>` headers would carry them, in name order:
    /// every member but `data` and `data_base64` whose value is a string, number or
    /// boolean (numbers and booleans as JSON text).
    pub attributes: Vec<(String, String)>,
}

/// Why a record that says it is a structured CloudEvent is not one mailroom can read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Malformed {
    /// The record has no value.
    #[error("the record has no value")]
    NoValue,
    /// The value is not a JSON object.
    #[error("the value is not a JSON object: {0}")]
    NotAnObject(String),
    /// `id` is missing, empty or not a string.
    #[error("`id` is missing, empty or not a string")]
    NoId,
    /// `source` is not a string.
    #[error("`source` is not a string")]
    BadSource,
}

/// Whether a `content-type` value names the CloudEvents JSON event format.
pub fn is_structured(content_type: &[u8]) -> bool {
    std::str::from_utf8(content_type).is_ok_and(|v| {
        let media = v.split(';').next().unwrap_or_default();
        media.trim().eq_ignore_ascii_case(MEDIA_TYPE)
    })
}

/// The record's structured CloudEvent: `None` when its content type does not say it is
/// one, else the event or why it cannot be read.
pub fn read(r: &Record) -> Option<Result<StructuredEvent, Malformed>> {
    let content_type = r
        .headers
        .iter()
        .rev()
        .find(|h| h.name.eq_ignore_ascii_case(CONTENT_TYPE.as_bytes()))?;
    if !content_type.value.as_deref().is_some_and(is_structured) {
        return None;
    }
    Some(parse(r.payload.as_deref()))
}

/// A structured CloudEvent from a record's value.
pub fn parse(value: Option<&[u8]>) -> Result<StructuredEvent, Malformed> {
    let value = value.ok_or(Malformed::NoValue)?;
    let object: Map<String, Value> =
        serde_json::from_slice(value).map_err(|e| Malformed::NotAnObject(e.to_string()))?;
    let id = match object.get("id") {
        Some(Value::String(id)) if !id.is_empty() => id.clone(),
        _ => return Err(Malformed::NoId),
    };
    let source = match object.get("source") {
        Some(Value::String(s)) => s.clone(),
        None => String::new(),
        Some(_) => return Err(Malformed::BadSource),
    };
    let event_type = object
        .get("type")
        .and_then(Value::as_str)
        .map(str::to_string);
    let attributes = object
        .iter()
        .filter(|(name, _)| !matches!(name.as_str(), "data" | "data_base64"))
        .filter_map(|(name, v)| {
            let text = match v {
                Value::String(s) => s.clone(),
                Value::Number(_) | Value::Bool(_) => v.to_string(),
                _ => return None,
            };
            Some((format!("ce_{name}"), text))
        })
        .collect();
    Ok(StructuredEvent {
        id,
        source,
        event_type,
        attributes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::headers::RecordHeader;

    fn record(content_type: Option<&[u8]>, value: &[u8]) -> Record {
        Record {
            topic: "t".into(),
            partition: 0,
            offset: 3,
            timestamp_ms: Some(1),
            key: None,
            payload: Some(value.to_vec()),
            headers: content_type
                .map(|v| RecordHeader {
                    name: b"Content-Type".to_vec(),
                    value: Some(v.to_vec()),
                })
                .into_iter()
                .collect(),
        }
    }

    const EVENT: &[u8] = br#"{"specversion":"1.0","id":"A-1","source":"/orders",
        "type":"order.created","time":"2026-12-01T10:00:00Z","datacontenttype":"application/json",
        "attempt":2,"urgent":true,"nested":{"x":1},"none":null,"data":{"n":1}}"#;

    #[test]
    fn the_media_type_is_matched_without_parameters_in_any_case() {
        assert!(is_structured(b"application/cloudevents+json"));
        assert!(is_structured(
            b"application/cloudevents+json; charset=utf-8"
        ));
        assert!(is_structured(
            b" Application/CloudEvents+JSON ;charset=UTF-8"
        ));
        assert!(!is_structured(b"application/cloudevents-batch+json"));
        assert!(!is_structured(b"application/json"));
        assert!(!is_structured(b"application/cloudevents+json\xff"));
        assert!(!is_structured(b""));
    }

    #[test]
    fn an_event_is_read_with_its_attributes() {
        let e = read(&record(
            Some(b"application/cloudevents+json; charset=utf-8"),
            EVENT,
        ))
        .unwrap()
        .unwrap();
        assert_eq!((e.id.as_str(), e.source.as_str()), ("A-1", "/orders"));
        assert_eq!(e.event_type.as_deref(), Some("order.created"));
        let names: Vec<&str> = e.attributes.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "ce_attempt",
                "ce_datacontenttype",
                "ce_id",
                "ce_source",
                "ce_specversion",
                "ce_time",
                "ce_type",
                "ce_urgent"
            ],
            "no data, no objects, no nulls"
        );
        assert!(e.attributes.contains(&("ce_attempt".into(), "2".into())));
        assert!(e.attributes.contains(&("ce_urgent".into(), "true".into())));
    }

    #[test]
    fn only_the_cloudevents_content_type_makes_a_record_structured() {
        assert_eq!(read(&record(None, EVENT)), None);
        assert_eq!(read(&record(Some(b"application/json"), EVENT)), None);
        let mut r = record(Some(b"application/cloudevents+json"), EVENT);
        r.headers.push(RecordHeader {
            name: b"content-type".to_vec(),
            value: Some(b"text/plain".to_vec()),
        });
        assert_eq!(read(&r), None, "the last content-type counts");
    }

    #[test]
    fn malformed_events_say_why() {
        let ct = Some(&b"application/cloudevents+json"[..]);
        let bad = |v: &[u8]| read(&record(ct, v)).unwrap().unwrap_err();
        assert!(matches!(bad(b"not json"), Malformed::NotAnObject(_)));
        assert!(matches!(bad(b"[1,2]"), Malformed::NotAnObject(_)));
        assert!(matches!(bad(b"\xff\xfe"), Malformed::NotAnObject(_)));
        assert_eq!(bad(br#"{"source":"s"}"#), Malformed::NoId);
        assert_eq!(bad(br#"{"id":"","source":"s"}"#), Malformed::NoId);
        assert_eq!(bad(br#"{"id":7,"source":"s"}"#), Malformed::NoId);
        assert_eq!(bad(br#"{"id":"1","source":{"a":1}}"#), Malformed::BadSource);
        let mut r = record(ct, b"");
        r.payload = None;
        assert_eq!(read(&r), Some(Err(Malformed::NoValue)));
        let no_source = parse(Some(br#"{"id":"1"}"#)).unwrap();
        assert_eq!(no_source.source, "", "as binary mode without ce_source");
        let nul = parse(Some(br#"{"id":"a\u0000b","source":"s"}"#)).unwrap();
        assert_eq!(nul.id, "a\0b", "kept exactly; the identity hex-encodes it");
    }
}

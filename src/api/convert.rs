//! pb ⇄ domain conversion with validation: a request is checked once, here, and either
//! becomes a domain value or an `InvalidArgument` naming every offending field.

use std::collections::BTreeMap;

use crate::domain::{Limits, NewEvent, check_topic};
use crate::error::{Error, FieldViolation};
use crate::pb;
use crate::pb::time::timestamp;

/// Validates one event; `field` prefixes violation paths (`event` or `events[3]`).
pub fn new_event(
    ev: pb::Event,
    field: &str,
    limits: &Limits,
) -> Result<NewEvent, Vec<FieldViolation>> {
    let mut v = Violations {
        field,
        found: Vec::new(),
    };
    if let Err(why) = check_topic(&ev.topic) {
        v.add("topic", why);
    }
    check_sizes(&ev, limits, &mut v);
    check_headers(&ev, limits, &mut v);
    check_text(&ev, &mut v);
    check_lengths(&ev, limits, &mut v);
    let deliver_after = match &ev.deliver_after {
        None => None,
        Some(t) => timestamp(t).or_else(|| {
            v.add(
                "deliver_after",
                "is not a valid timestamp (seconds in 0001..9999, nanos in 0..1e9)",
            );
            None
        }),
    };
    if !v.found.is_empty() {
        return Err(v.found);
    }
    let non_empty = |s: String| if s.is_empty() { None } else { Some(s) };
    Ok(NewEvent {
        topic: ev.topic,
        key: non_empty(ev.key),
        payload: ev.payload,
        headers: ev.headers.into_iter().collect::<BTreeMap<_, _>>(),
        event_type: non_empty(ev.r#type),
        idempotency_key: non_empty(ev.idempotency_key),
        deliver_after,
        max_attempts: if ev.max_attempts == 0 {
            limits.default_max_attempts
        } else {
            ev.max_attempts
        },
    })
}

/// The violations found in one event, each named `<field>.<name>`.
struct Violations<'a> {
    field: &'a str,
    found: Vec<FieldViolation>,
}

impl Violations<'_> {
    fn add(&mut self, name: &str, why: impl Into<String>) {
        let path = format!("{}.{name}", self.field);
        self.found.push(FieldViolation::new(path, why.into()));
    }
}

/// The key and the payload within their limits.
fn check_sizes(ev: &pb::Event, limits: &Limits, v: &mut Violations<'_>) {
    if ev.key.len() > limits.max_key_bytes {
        v.add(
            "key",
            format!("must be at most {} bytes", limits.max_key_bytes),
        );
    }
    if ev.payload.len() > limits.max_payload_bytes {
        v.add(
            "payload",
            format!(
                "is {} bytes; the limit is {}",
                ev.payload.len(),
                limits.max_payload_bytes
            ),
        );
    }
}

/// The type, the idempotency key and the attempts within their limits.
fn check_lengths(ev: &pb::Event, limits: &Limits, v: &mut Violations<'_>) {
    if ev.r#type.len() > 256 {
        v.add("type", "must be at most 256 bytes");
    }
    if ev.idempotency_key.len() > 256 {
        v.add("idempotency_key", "must be at most 256 bytes");
    }
    if ev.max_attempts > limits.max_attempts_cap {
        v.add(
            "max_attempts",
            format!("must be at most {}", limits.max_attempts_cap),
        );
    }
}

/// The headers: how many, how many bytes, and their names (not empty, not `ce_`, which
/// CloudEvents attributes own).
fn check_headers(ev: &pb::Event, limits: &Limits, v: &mut Violations<'_>) {
    if ev.headers.len() > limits.max_headers {
        v.add("headers", format!("at most {} headers", limits.max_headers));
    }
    let header_bytes: usize = ev.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    if header_bytes > limits.max_header_bytes {
        v.add(
            "headers",
            format!(
                "at most {} bytes of headers in all",
                limits.max_header_bytes
            ),
        );
    }
    if ev.headers.keys().any(|k| k.is_empty()) {
        v.add("headers", "header names must not be empty");
    }
    if ev.headers.keys().any(|k| k.starts_with("ce_")) {
        v.add(
            "headers",
            "header names starting with 'ce_' are reserved for CloudEvents attributes",
        );
    }
}

/// PostgreSQL's text cannot hold NUL: refuse it on every engine rather than fail the
/// insert (and, with group commit, the other requests sharing its transaction).
fn check_text(ev: &pb::Event, v: &mut Violations<'_>) {
    let nul = |s: &str| s.contains('\0');
    if nul(&ev.key) {
        v.add("key", "must not contain NUL characters");
    }
    if ev.headers.iter().any(|(k, v)| nul(k) || nul(v)) {
        v.add(
            "headers",
            "names and values must not contain NUL characters",
        );
    }
    if nul(&ev.r#type) {
        v.add("type", "must not contain NUL characters");
    }
    if nul(&ev.idempotency_key) {
        v.add("idempotency_key", "must not contain NUL characters");
    }
}

/// The W3C `traceparent` of a request, if it is well formed
/// (`00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`); a malformed one is ignored,
/// as the W3C spec asks.
pub fn traceparent(md: &tonic::metadata::MetadataMap) -> Option<String> {
    let v = md
        .get("traceparent")?
        .to_str()
        .ok()?
        .trim()
        .to_ascii_lowercase();
    let parts: Vec<&str> = v.split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let ok = parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && parts[1] != "0".repeat(32)
        && hex(parts[2], 16)
        && parts[2] != "0".repeat(16)
        && hex(parts[3], 2);
    ok.then_some(v)
}

/// The W3C `tracestate` of a request: kept with its `traceparent` when it is printable
/// ASCII of at most 512 bytes (the W3C limit), else dropped.
pub fn tracestate(md: &tonic::metadata::MetadataMap) -> Option<String> {
    let v = md.get("tracestate")?.to_str().ok()?.trim();
    (!v.is_empty() && v.len() <= 512 && v.bytes().all(|b| (0x20..0x7f).contains(&b)))
        .then(|| v.to_string())
}

/// Stores the request's trace context with the event, as its `traceparent` (and
/// `tracestate`) headers, sent to Kafka and on to inbox handlers. A `traceparent` the
/// producer set itself wins, with its own `tracestate` or none.
pub fn attach_trace(event: &mut NewEvent, traceparent: Option<&str>, tracestate: Option<&str>) {
    if let Some(tp) = traceparent
        && !event.headers.contains_key(TRACEPARENT)
    {
        event
            .headers
            .insert(TRACEPARENT.to_string(), tp.to_string());
        if let Some(ts) = tracestate {
            event
                .headers
                .entry("tracestate".to_string())
                .or_insert_with(|| ts.to_string());
        }
    }
}

/// The W3C trace context header name.
pub const TRACEPARENT: &str = "traceparent";

/// Validates an `Enqueue` request: its one event, required.
pub fn enqueue_request(req: pb::EnqueueRequest, limits: &Limits) -> Result<NewEvent, Error> {
    let ev = req
        .event
        .ok_or_else(|| Error::invalid("event", "is required"))?;
    new_event(ev, "event", limits).map_err(Error::InvalidArgument)
}

/// Validates an `EnqueueBatch` request: 1..=`max_batch` events, every violation named.
pub fn enqueue_batch_request(
    req: pb::EnqueueBatchRequest,
    limits: &Limits,
) -> Result<Vec<NewEvent>, Error> {
    if req.events.is_empty() {
        return Err(Error::invalid("events", "must not be empty"));
    }
    if req.events.len() > limits.max_batch {
        return Err(Error::invalid(
            "events",
            format!(
                "{} events; at most {} per batch",
                req.events.len(),
                limits.max_batch
            ),
        ));
    }
    let mut out = Vec::with_capacity(req.events.len());
    let mut violations = Vec::new();
    for (i, ev) in req.events.into_iter().enumerate() {
        match new_event(ev, &format!("events[{i}]"), limits) {
            Ok(e) => out.push(e),
            Err(v) => violations.extend(v),
        }
    }
    if violations.is_empty() {
        Ok(out)
    } else {
        Err(Error::InvalidArgument(violations))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_well_formed_traceparents_are_kept() {
        let md = |v: &str| {
            let mut m = tonic::metadata::MetadataMap::new();
            m.insert("traceparent", v.parse().unwrap());
            m
        };
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(traceparent(&md(good)).as_deref(), Some(good));
        for bad in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "nonsense",
        ] {
            assert_eq!(traceparent(&md(bad)), None, "{bad}");
        }
        assert_eq!(traceparent(&tonic::metadata::MetadataMap::new()), None);
    }

    #[test]
    fn every_bad_field_is_named() {
        let ev = pb::Event {
            topic: "bad topic".into(),
            payload: vec![0; 11],
            headers: [("ce_id".to_string(), "x".to_string())].into(),
            max_attempts: 1000,
            ..Default::default()
        };
        let limits = Limits {
            max_payload_bytes: 10,
            ..Default::default()
        };
        let v = new_event(ev, "events[2]", &limits).unwrap_err();
        let fields: Vec<&str> = v.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(
            fields,
            vec![
                "events[2].topic",
                "events[2].payload",
                "events[2].headers",
                "events[2].max_attempts"
            ]
        );
    }
}

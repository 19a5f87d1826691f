//! Dedup identities of inbox messages, one namespace per origin, so that messages from
//! different producers never collide:
//!
//! - `ce:<n>:<ce_source>:<ce_id>` — a Kafka record with a `ce_id` header, keyed as
//!   CloudEvents asks (source and id together); `n` is the byte length of the source,
//!   so no choice of source and id can imitate another pair. A record without
//!   `ce_source` has an empty one (`ce:0::<id>`).
//! - `ce-x:<n>:<hex source>:<hex id>` — the same for a source or id that is not UTF-8
//!   text or holds NUL characters (bytes are kept exactly: two different ids never merge).
//! - `kafka:<topic>:<partition>:<offset>@<timestamp ms>` — a record without `ce_id`: its
//!   place in the log and its timestamp. The place alone repeats when the topic is
//!   deleted and recreated or the cluster replaced (offsets start at 0 again); the
//!   timestamp travels with the record, so a redelivery keeps it and a new log's record
//!   at the same place almost never shares it. A record without a timestamp (message
//!   format v0) is `kafka:<topic>:<partition>:<offset>`, the form every place identity
//!   had before (`inbox::legacy`).
//! - `rpc:<message_id>` — `InboxService.Receive`.
//! - `<namespace>-h:<sha256 hex>` — any of them longer than [`MAX_ID_BYTES`]: the hash of
//!   the raw source and id, so an id of any size is deduplicated and fits the index.
//!
//! The identity is unique within a subscription; it is also `HandleRequest.message_id`.

use sha2::{Digest, Sha256};

/// Longest stored dedup id; longer ones are hashed (PostgreSQL refuses index rows over
/// about 2.7 kB, which would fail the whole insert).
pub const MAX_ID_BYTES: usize = 512;

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// SHA-256 as lowercase hex.
pub fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    hex(&h.finalize())
}

/// Text that PostgreSQL can store as is: UTF-8 without NUL.
fn clean(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes)
        .ok()
        .filter(|s| !s.contains('\0'))
}

/// The identity of a CloudEvent (a record with a `ce_id` header).
pub fn cloud_event(source: &[u8], id: &[u8]) -> String {
    let plain = match (clean(source), clean(id)) {
        (Some(s), Some(i)) => format!("ce:{}:{s}:{i}", s.len()),
        _ => {
            let s = hex(source);
            format!("ce-x:{}:{s}:{}", s.len(), hex(id))
        }
    };
    if plain.len() <= MAX_ID_BYTES {
        plain
    } else {
        let n = (source.len() as u64).to_be_bytes();
        format!("ce-h:{}", sha256_hex(&[&n, source, id]))
    }
}

/// The identity of a record without `ce_id`: its place in the log and its timestamp
/// (ms since the epoch), when it has one.
pub fn kafka(topic: &str, partition: i32, offset: i64, timestamp_ms: Option<i64>) -> String {
    let place = kafka_untimed(topic, partition, offset);
    match timestamp_ms {
        Some(ms) => format!("{place}@{ms}"),
        None => place,
    }
}

/// The identity of a place in the log alone: a record without a timestamp, and every
/// record without `ce_id` stored before timestamps joined the identity. Kafka topic
/// names hold neither `:` nor `@`, so the two forms never meet.
pub fn kafka_untimed(topic: &str, partition: i32, offset: i64) -> String {
    format!("kafka:{topic}:{partition}:{offset}")
}

/// The identity of a message pushed with `InboxService.Receive` (its id is at most
/// 256 bytes of text without NUL, checked by the API).
pub fn rpc(message_id: &str) -> String {
    let plain = format!("rpc:{message_id}");
    if plain.len() <= MAX_ID_BYTES {
        plain
    } else {
        format!("rpc-h:{}", sha256_hex(&[message_id.as_bytes()]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_and_namespaces_keep_ids_apart() {
        let a = cloud_event(b"mailroom/one", b"1");
        let b = cloud_event(b"mailroom/two", b"1");
        let c = cloud_event(b"", b"1");
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, "ce:12:mailroom/one:1");
        assert_eq!(c, "ce:0::1");
        // The length prefix: a source holding ':' cannot imitate another split.
        assert_ne!(cloud_event(b"a:b", b"c"), cloud_event(b"a", b"b:c"));
        assert_ne!(rpc("1"), cloud_event(b"", b"1"));
        assert_ne!(rpc("t:0:1"), kafka_untimed("t", 0, 1));
        assert_eq!(a, cloud_event(b"mailroom/one", b"1"), "deterministic");
    }

    #[test]
    fn a_place_in_the_log_is_told_apart_by_its_timestamp() {
        let first = kafka("orders", 0, 17, Some(1_764_600_000_123));
        assert_eq!(first, "kafka:orders:0:17@1764600000123");
        assert_eq!(first, kafka("orders", 0, 17, Some(1_764_600_000_123)));
        // The same place in a recreated log, a millisecond later.
        assert_ne!(first, kafka("orders", 0, 17, Some(1_764_600_000_124)));
        assert_ne!(first, kafka("orders", 1, 17, Some(1_764_600_000_123)));
        assert_eq!(kafka("orders", 0, 17, None), kafka_untimed("orders", 0, 17));
        assert_eq!(kafka_untimed("orders", 0, 17), "kafka:orders:0:17");
        assert_ne!(first, kafka_untimed("orders", 0, 17));
    }

    #[test]
    fn bytes_that_are_not_text_are_kept_exactly() {
        let x = cloud_event(b"s", b"a\xff");
        let y = cloud_event(b"s", b"a\xfe");
        let z = cloud_event(b"s", b"a\0");
        assert_ne!(x, y);
        assert!(x.starts_with("ce-x:"), "{x}");
        assert!(!z.contains('\0'));
        assert_ne!(z, cloud_event(b"s", "a\u{FFFD}".as_bytes()));
    }

    #[test]
    fn long_ids_are_hashed_and_stay_distinct() {
        let long = vec![b'i'; 5000];
        let mut other = long.clone();
        other[4999] = b'j';
        let a = cloud_event(b"s", &long);
        assert!(a.len() <= MAX_ID_BYTES && a.starts_with("ce-h:"), "{a}");
        assert_ne!(a, cloud_event(b"s", &other));
        assert_eq!(a, cloud_event(b"s", &long));
        assert_ne!(a, cloud_event(b"t", &long));
        // Invalid UTF-8 and long: hashed over the same raw bytes.
        let mut bad = long.clone();
        bad[0] = 0xff;
        assert!(cloud_event(b"s", &bad).starts_with("ce-h:"));
        assert_eq!(rpc("x"), "rpc:x");
        assert!(rpc(&"r".repeat(600)).starts_with("rpc-h:"));
    }
}

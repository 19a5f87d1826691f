//! Kafka record headers are bytes: a name or value need not be UTF-8 (Go's Sarama and
//! franz-go write raw bytes), names may repeat, and either may hold a NUL. mailroom's
//! headers are a text map (as on `Enqueue`), so a consumed record keeps two views:
//! - the map: each name and value as text, invalid UTF-8 and NUL replaced by U+FFFD,
//!   the last value of a repeated name;
//! - when that map cannot say exactly what the record carried, the exact list, in
//!   order, as bytes, in one more map entry, [`RECORD_HEADERS`] (a JSON array of
//!   `{"name": base64, "value": base64 | null}`), which the handler receives decoded as
//!   `HandleRequest.record_headers`.
//!
//! A record whose headers are all distinct UTF-8 text without NUL needs no extra entry:
//! its map is exact. A key that is not exact text is kept the same way, as base64 in
//! [`RECORD_KEY`] (`HandleRequest.record_key`).

use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};

/// The map entry that holds a record's exact headers when the text map cannot.
pub const RECORD_HEADERS: &str = "mailroom-record-headers";

/// The map entry that holds a record's exact key (base64) when it is not text (the
/// message's key, which orders it, is then the text view of those bytes).
pub const RECORD_KEY: &str = "mailroom-record-key";

/// One Kafka record header, as bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    /// The name (not necessarily UTF-8).
    pub name: Vec<u8>,
    /// The value; `None` is Kafka's null value, distinct from empty.
    pub value: Option<Vec<u8>>,
}

/// The JSON form of one header inside [`RECORD_HEADERS`].
#[derive(Serialize, Deserialize)]
struct Encoded {
    name: String,
    value: Option<String>,
}

/// Bytes as text: invalid UTF-8 and NUL become U+FFFD (PostgreSQL text cannot hold NUL,
/// and a protobuf `string` must be UTF-8).
pub fn text(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    if s.contains('\0') {
        s.replace('\0', "\u{FFFD}")
    } else {
        s.into_owned()
    }
}

/// Whether `bytes` survive [`text`] unchanged.
pub fn is_exact_text(bytes: &[u8]) -> bool {
    std::str::from_utf8(bytes).is_ok_and(|s| !s.contains('\0'))
}

/// Whether the text map of `headers` says exactly what they are: every name and value
/// exact text (a null value is not: the map would show it empty), no name repeated, and
/// none named [`RECORD_HEADERS`] or [`RECORD_KEY`].
pub fn map_is_exact(headers: &[RecordHeader]) -> bool {
    let mut seen = std::collections::HashSet::with_capacity(headers.len());
    headers.iter().all(|h| {
        is_exact_text(&h.name)
            && h.value.as_deref().is_some_and(is_exact_text)
            && h.name != RECORD_HEADERS.as_bytes()
            && h.name != RECORD_KEY.as_bytes()
            && seen.insert(h.name.as_slice())
    })
}

/// The [`RECORD_HEADERS`] value for `headers`.
pub fn encode(headers: &[RecordHeader]) -> String {
    let list: Vec<Encoded> = headers
        .iter()
        .map(|h| Encoded {
            name: STANDARD.encode(&h.name),
            value: h.value.as_ref().map(|v| STANDARD.encode(v)),
        })
        .collect();
    serde_json::to_string(&list).unwrap_or_default()
}

/// The headers a [`RECORD_HEADERS`] value holds; `None` if it is not one.
pub fn decode(value: &str) -> Option<Vec<RecordHeader>> {
    let list: Vec<Encoded> = serde_json::from_str(value).ok()?;
    list.into_iter()
        .map(|e| {
            Some(RecordHeader {
                name: STANDARD.decode(e.name).ok()?,
                value: match e.value {
                    Some(v) => Some(STANDARD.decode(v).ok()?),
                    None => None,
                },
            })
        })
        .collect()
}

/// What a handler receives of a stored message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerView {
    /// The text map, without mailroom's own entries.
    pub map: BTreeMap<String, String>,
    /// The exact headers: decoded from [`RECORD_HEADERS`], else the map in name order.
    pub exact: Vec<RecordHeader>,
    /// The exact key: decoded from [`RECORD_KEY`], else the text key's bytes.
    pub key: Vec<u8>,
}

/// A stored header map and key split into what a handler receives.
pub fn for_handler(stored: &BTreeMap<String, String>, key: Option<&str>) -> HandlerView {
    let mut map = stored.clone();
    let exact = match stored.get(RECORD_HEADERS).and_then(|v| decode(v)) {
        Some(list) => {
            map.remove(RECORD_HEADERS);
            list
        }
        None => map
            .iter()
            .map(|(k, v)| RecordHeader {
                name: k.as_bytes().to_vec(),
                value: Some(v.as_bytes().to_vec()),
            })
            .collect(),
    };
    let key = match stored.get(RECORD_KEY).and_then(|v| STANDARD.decode(v).ok()) {
        Some(k) => {
            map.remove(RECORD_KEY);
            k
        }
        None => key.unwrap_or_default().as_bytes().to_vec(),
    };
    HandlerView { map, exact, key }
}

/// The [`RECORD_KEY`] value for `key`.
pub fn encode_key(key: &[u8]) -> String {
    STANDARD.encode(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(name: &[u8], value: Option<&[u8]>) -> RecordHeader {
        RecordHeader {
            name: name.to_vec(),
            value: value.map(<[u8]>::to_vec),
        }
    }

    #[test]
    fn exact_lists_round_trip_through_the_map_entry() {
        let list = vec![
            h(b"\xff\xfe", Some(b"\x00\x01")),
            h(b"a\0b", None),
            h(b"a", Some(b"")),
            h(b"a", Some(b"2")),
        ];
        assert!(!map_is_exact(&list));
        assert_eq!(decode(&encode(&list)), Some(list.clone()));
        let stored = BTreeMap::from([
            ("a".to_string(), "2".to_string()),
            (RECORD_HEADERS.to_string(), encode(&list)),
            (RECORD_KEY.to_string(), encode_key(b"\xff\x00")),
        ]);
        let view = for_handler(&stored, Some("\u{FFFD}\u{FFFD}"));
        assert_eq!(view.exact, list);
        assert_eq!(view.key, b"\xff\x00");
        assert_eq!(view.map.keys().collect::<Vec<_>>(), ["a"]);
    }

    #[test]
    fn a_text_map_needs_no_extra_entry() {
        let list = vec![h(b"ce_id", Some(b"1")), h(b"b", Some(b""))];
        assert!(map_is_exact(&list));
        assert!(!map_is_exact(&[h(b"b", None)]), "null is not empty");
        assert!(!map_is_exact(&[h(RECORD_HEADERS.as_bytes(), Some(b"x"))]));
        assert!(!map_is_exact(&[h(RECORD_KEY.as_bytes(), Some(b"x"))]));
        let stored = BTreeMap::from([("b".to_string(), "2".to_string())]);
        let view = for_handler(&stored, Some("k"));
        assert_eq!(
            (view.exact, view.key),
            (vec![h(b"b", Some(b"2"))], b"k".to_vec())
        );
        assert_eq!(text(b"x\0\xffy"), "x\u{FFFD}\u{FFFD}y");
    }
}

//! What an enqueue or receive admitted, engine-neutral: which events were inserted,
//! which were idempotent duplicates and which conflicted, and the canonical forms
//! (headers, batch keys) both engines store.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};

use super::Admission;
use crate::domain::{EventId, InboundMessage, NewEvent, idempotency_scope};

/// Encodes headers canonically (sorted keys) for storage.
pub(crate) fn headers_json(h: &BTreeMap<String, String>) -> String {
    serde_json::to_string(h).expect("string map serializes")
}

/// Sorted distinct keys of a batch with the earliest schedule of each (None = now).
pub(crate) fn batch_keys(events: &[NewEvent]) -> BTreeMap<(&str, &str), Option<DateTime<Utc>>> {
    let mut keys: BTreeMap<(&str, &str), Option<DateTime<Utc>>> = BTreeMap::new();
    for e in events {
        if let Some(k) = &e.key {
            let slot = keys
                .entry((e.topic.as_str(), k.as_str()))
                .or_insert(e.deliver_after);
            *slot = match (*slot, e.deliver_after) {
                (Some(a), Some(b)) => Some(a.min(b)),
                _ => None,
            };
        }
    }
    keys
}

/// Inserted for the first message of each id that the insert returned; everything else
/// is a duplicate of the stored id.
pub(crate) fn inbox_admissions(
    messages: &[InboundMessage],
    inserted: &HashMap<String, EventId>,
    existing: &HashMap<String, EventId>,
) -> Vec<Admission> {
    let mut first = std::collections::HashSet::new();
    messages
        .iter()
        .map(|m| match inserted.get(&m.message_id) {
            Some(&id) if first.insert(m.message_id.as_str()) => Admission::Inserted(id),
            Some(&id) => Admission::Duplicate(id),
            None => existing
                .get(&m.message_id)
                .map_or(Admission::Conflict, |&id| Admission::Duplicate(id)),
        })
        .collect()
}

/// The stored fingerprint of the row holding an idempotency key: version 2 (128 bits,
/// `content_fp`) for rows written since migration 0008, version 1 (`content_hash`) before.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Holder {
    V1(i64),
    V2(Vec<u8>),
}

impl Holder {
    /// From the row's `content_hash` and `content_fp`.
    pub(crate) fn of(hash: Option<i64>, fp: Option<Vec<u8>>) -> Holder {
        match fp {
            Some(fp) => Holder::V2(fp),
            None => Holder::V1(hash.unwrap_or_default()),
        }
    }

    fn same_content(&self, e: &NewEvent) -> bool {
        match self {
            Holder::V2(fp) => *fp == e.fingerprint128(),
            // Rows from before 0008: the 64-bit fingerprint, or the FNV one before 0007.
            Holder::V1(h) => e.same_content(*h),
        }
    }
}

/// Resolves which events were inserted, which were idempotent duplicates and which
/// conflicted, from the ids the insert returned and the rows already holding the keys.
/// Keys are scoped by topic (`idempotency_scope`) in both maps.
pub(crate) fn admissions(
    events: &[NewEvent],
    mut inserted_unkeyed: Vec<EventId>,
    inserted_by_key: &HashMap<String, EventId>,
    existing: &HashMap<String, (EventId, Holder)>,
) -> Vec<Admission> {
    // Ids are drawn in slice order, so sorted ids of events without an idempotency key
    // line up with those events in order.
    inserted_unkeyed.sort_unstable();
    let mut plain = inserted_unkeyed.into_iter();
    let mut seen_in_batch: HashMap<String, (EventId, Vec<u8>)> = HashMap::new();
    events
        .iter()
        .map(|e| match &e.idempotency_key {
            None => Admission::Inserted(plain.next().expect("one id per plain insert")),
            Some(k) => {
                let scoped = idempotency_scope(&e.topic, k);
                if let Some((id, fp)) = seen_in_batch.get(&scoped) {
                    return if *fp == e.fingerprint128() {
                        Admission::Duplicate(*id)
                    } else {
                        Admission::Conflict
                    };
                }
                if let Some(&id) = inserted_by_key.get(&scoped) {
                    seen_in_batch.insert(scoped, (id, e.fingerprint128()));
                    Admission::Inserted(id)
                } else {
                    match existing.get(&scoped) {
                        Some((id, holder)) if holder.same_content(e) => Admission::Duplicate(*id),
                        _ => Admission::Conflict,
                    }
                }
            }
        })
        .collect()
}

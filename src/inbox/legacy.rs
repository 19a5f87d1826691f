//! Records stored under their place alone (`kafka:<topic>:<partition>:<offset>`, before
//! the record's timestamp joined the identity) are still duplicates when they come
//! again: right after an upgrade, a consumer re-reads the records whose offsets the
//! old version stored but had not committed.
//!
//! A row under the place alone is taken for the same record only if it was stored no
//! earlier than [`CLOCK_SKEW`] before the record's timestamp: a redelivered record was
//! written before its first copy was stored, while the record at that place in a
//! recreated topic (or a new cluster) was written after its old namesake was stored.
//! The allowance covers clocks that disagree (producer or broker against the
//! database's). Rows under the place alone are no longer written (but for records
//! without a timestamp, whose identity is that form anyway), so this matters only
//! until the completed retention has purged them.

use std::collections::HashMap;
use std::time::Duration;

use super::identity;
use super::record::Place;
use crate::domain::{EventId, InboundMessage};
use crate::store::{Store, StoreResult};

/// How far the database's clock (which stamped the old row) may lag the clock that
/// stamped the record (the producer's, or the broker's for `LogAppendTime`).
pub const CLOCK_SKEW: Duration = Duration::from_secs(300);

/// For each message, the row that stored it under its place alone, if one did.
pub async fn stored_untimed(
    store: &dyn Store,
    subscription: &str,
    messages: &[InboundMessage],
    places: &[Place],
) -> StoreResult<Vec<Option<EventId>>> {
    let wanted: Vec<Option<(String, i64)>> = messages
        .iter()
        .zip(places)
        .map(|(m, p)| untimed(m, p))
        .collect();
    let ids: Vec<String> = wanted.iter().flatten().map(|(id, _)| id.clone()).collect();
    if ids.is_empty() {
        return Ok(vec![None; messages.len()]);
    }
    let held: HashMap<String, (EventId, i64)> = store
        .held_ids(subscription, &ids)
        .await?
        .into_iter()
        .map(|h| (h.message_id, (h.id, h.created_at.timestamp_millis())))
        .collect();
    Ok(wanted
        .iter()
        .map(|w| {
            let (id, written_ms) = w.as_ref()?;
            let &(row, stored_ms) = held.get(id)?;
            same_record(stored_ms, *written_ms).then_some(row)
        })
        .collect())
}

/// Whether a row stored at `stored_ms` can hold the record written at `written_ms`.
fn same_record(stored_ms: i64, written_ms: i64) -> bool {
    let skew = i64::try_from(CLOCK_SKEW.as_millis()).unwrap_or(i64::MAX);
    stored_ms >= written_ms.saturating_sub(skew)
}

/// The untimed identity a message may have been stored under, and its record's
/// timestamp: only for a message identified by its timed place.
fn untimed(m: &InboundMessage, p: &Place) -> Option<(String, i64)> {
    let ms = p.timestamp_ms?;
    (m.message_id == p.identity())
        .then(|| (identity::kafka_untimed(&p.topic, p.partition, p.offset), ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(id: String) -> InboundMessage {
        InboundMessage {
            message_id: id,
            topic: "t".into(),
            key: None,
            payload: Vec::new(),
            event_type: None,
            headers: Default::default(),
            max_attempts: 3,
            failure: None,
        }
    }

    fn place(timestamp_ms: Option<i64>) -> Place {
        Place {
            topic: "t".into(),
            partition: 2,
            offset: 9,
            timestamp_ms,
        }
    }

    #[test]
    fn a_row_stored_after_the_record_was_written_holds_it() {
        let t = 1_764_600_000_000;
        assert!(same_record(t + 10, t), "stored after it was written");
        assert!(same_record(t - 1_000, t), "clocks a second apart");
        assert!(same_record(t - 300_000, t));
        assert!(
            !same_record(t - 300_001, t),
            "stored before: another log's record"
        );
        assert!(same_record(i64::MIN, i64::MIN), "no overflow");
    }

    #[test]
    fn only_records_identified_by_their_timed_place_are_looked_up() {
        let timed = place(Some(5));
        let by_place = message(timed.identity());
        assert_eq!(
            untimed(&by_place, &timed),
            Some(("kafka:t:2:9".to_string(), 5))
        );
        // A record without a timestamp already has the untimed form: the insert dedups it.
        let bare = place(None);
        assert_eq!(untimed(&message(bare.identity()), &bare), None);
        // A CloudEvent has an identity of its own.
        assert_eq!(untimed(&message("ce:1:s:1".into()), &timed), None);
    }
}

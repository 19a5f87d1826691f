//! `google.protobuf.Timestamp`/`Duration` and `google.rpc.RetryInfo` as Rust times.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tonic_types::StatusExt as _;

/// A protobuf timestamp as a UTC time, if it is a valid one.
pub fn timestamp(t: &prost_types::Timestamp) -> Option<DateTime<Utc>> {
    if !(0..1_000_000_000).contains(&t.nanos) {
        return None;
    }
    // RFC 3339 range: 0001-01-01 to 9999-12-31, as google.protobuf.Timestamp requires.
    if !(-62_135_596_800..=253_402_300_799).contains(&t.seconds) {
        return None;
    }
    // Both casts are in range: nanos was checked above.
    DateTime::from_timestamp(t.seconds, t.nanos as u32)
}

/// A UTC time as a protobuf timestamp.
pub fn to_timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        // Below 2·10⁹ (a leap second at most doubles the nanoseconds): fits an i32.
        nanos: t.timestamp_subsec_nanos() as i32,
    }
}

/// A duration as a protobuf duration; past `i64::MAX` seconds it saturates.
pub fn to_duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        // Below 10⁹: fits an i32.
        nanos: d.subsec_nanos() as i32,
    }
}

/// The delay a status asks for in its `RetryInfo`, if any (e.g. an inbox handler's).
pub fn retry_delay(s: &tonic::Status) -> Option<Duration> {
    s.get_details_retry_info()
        .and_then(|r| r.retry_delay)
        .filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_outside_the_range_are_rejected() {
        let ok = prost_types::Timestamp {
            seconds: 0,
            nanos: 0,
        };
        assert!(timestamp(&ok).is_some());
        for bad in [
            prost_types::Timestamp {
                seconds: 0,
                nanos: -1,
            },
            prost_types::Timestamp {
                seconds: 0,
                nanos: 1_000_000_000,
            },
            prost_types::Timestamp {
                seconds: -62_135_596_801,
                nanos: 0,
            },
            prost_types::Timestamp {
                seconds: 253_402_300_800,
                nanos: 0,
            },
        ] {
            assert!(timestamp(&bad).is_none(), "{bad:?}");
        }
        let t = DateTime::from_timestamp(1_700_000_000, 5).unwrap();
        assert_eq!(timestamp(&to_timestamp(t)), Some(t));
    }

    #[test]
    fn durations_convert_and_saturate() {
        let d = to_duration(Duration::from_millis(1500));
        assert_eq!((d.seconds, d.nanos), (1, 500_000_000));
        assert_eq!(to_duration(Duration::MAX).seconds, i64::MAX);
    }
}

//! The SQL text of the rewind statements (`RewindSql`), the same on both engines but for
//! marks, casts and the clock.

use super::Shape;
use crate::store::admin_sql::RewindSql;

/// The most messages a rewind's estimate counts.
pub const STORED_SINCE_CAP: i64 = 100_000;

/// The columns `decode_rewind` reads.
const REWIND_COLUMNS: &str =
    "id, subscription, to_time, redeliver, actor, principal, request_id, created_at";
/// The columns `decode_rewind_partition` reads.
const PARTITION_COLUMNS: &str =
    "rewind_id, topic, kafka_partition, from_offset, until_offset, applied_at";

impl Shape {
    /// The SQL text of a rewind statement.
    pub fn rewind(&self, stmt: RewindSql) -> String {
        let (t, ts, i8) = (self.text, self.time, self.int8);
        let p = |n| self.p(n);
        match stmt {
            // Capped: no index serves (subscription, created_at), and over a week of
            // history an estimate must not read every row it counts.
            RewindSql::StoredSince => format!(
                "SELECT count(*){i8} AS n FROM (SELECT 1 FROM inbox_events
                     WHERE subscription = {} AND created_at >= {} LIMIT {STORED_SINCE_CAP}) s",
                p(1),
                p(2)
            ),
            RewindSql::OfRequest => format!(
                "SELECT {REWIND_COLUMNS} FROM inbox_rewinds
                 WHERE subscription = {} AND request_id = {}",
                p(1),
                p(2)
            ),
            RewindSql::Insert => format!(
                "INSERT INTO inbox_rewinds
                     (subscription, to_time, redeliver, actor, principal, request_id, created_at)
                 VALUES ({}, {}, {}, {}, {}, {}, {})
                 ON CONFLICT (subscription, request_id) WHERE request_id IS NOT NULL DO NOTHING
                 RETURNING {REWIND_COLUMNS}",
                p(1),
                p(2),
                p(3),
                p(4),
                p(5),
                p(6),
                self.now(7)
            ),
            RewindSql::List => format!(
                "SELECT {REWIND_COLUMNS} FROM inbox_rewinds
                 WHERE ({0}{t} IS NULL OR subscription = {0}) AND ({1}{ts} IS NULL OR created_at >= {1})
                 ORDER BY id DESC LIMIT {2}",
                p(1),
                p(2),
                p(3)
            ),
            RewindSql::Partitions => format!(
                "SELECT {PARTITION_COLUMNS} FROM inbox_rewind_partitions
                 WHERE {} ORDER BY rewind_id, topic, kafka_partition",
                self.ids(1).replacen("id ", "rewind_id ", 1)
            ),
            RewindSql::Intend => format!(
                "INSERT INTO inbox_rewind_partitions
                     (rewind_id, topic, kafka_partition, from_offset, until_offset)
                 VALUES ({}, {}, {}, {}, {}) ON CONFLICT DO NOTHING",
                p(1),
                p(2),
                p(3),
                p(4),
                p(5)
            ),
            RewindSql::Partition => format!(
                "SELECT {PARTITION_COLUMNS} FROM inbox_rewind_partitions
                 WHERE rewind_id = {} AND topic = {} AND kafka_partition = {}",
                p(1),
                p(2),
                p(3)
            ),
            RewindSql::Applied => format!(
                "UPDATE inbox_rewind_partitions SET applied_at = {}
                 WHERE rewind_id = {} AND topic = {} AND kafka_partition = {} AND applied_at IS NULL",
                self.now(4),
                p(1),
                p(2),
                p(3)
            ),
        }
    }
}

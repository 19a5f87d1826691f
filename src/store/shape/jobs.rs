//! The SQL text of the job statements (`JobSql`), the same on both engines but for
//! marks, casts and the clock, like the rest of `Shape::shared`.

use super::Shape;
use crate::store::admin_sql::JobSql;

/// The columns `decode_job` reads.
const JOB_COLUMNS: &str = "id, kind, box, selection, reason, state, total, done, after_id, \
     through_id, actor, principal, request_id, cancelled_by, owner, error, created_at, \
     updated_at, finished_at";

/// A job that has not ended.
const OPEN: &str = "state IN ('running', 'cancelling')";

impl Shape {
    /// `now` plus the milliseconds in parameter `ms`.
    fn plus_ms(&self, now: &str, ms: &str) -> String {
        if self.postgres {
            format!("{now} + {ms}::int8 * interval '1 millisecond'")
        } else {
            format!("{now} + {ms} * 1000")
        }
    }

    /// The SQL text of a job statement.
    pub fn job(&self, stmt: JobSql) -> String {
        let (t, i8) = (self.text, self.int8);
        let p = |n| self.p(n);
        match stmt {
            JobSql::Count => format!(
                "SELECT count(*){i8} AS n FROM {} WHERE status = {}{t} AND {}",
                self.rows,
                p(1),
                self.filter(2)
            ),
            JobSql::PendingByFilter => format!(
                "SELECT {} FROM {} WHERE status = 'pending' AND {} ORDER BY id LIMIT {}",
                self.candidate_columns(),
                self.rows,
                self.filter(1),
                p(16)
            ),
            JobSql::MaxId => format!(
                "SELECT coalesce(max(id), 0){i8} AS id FROM {}",
                self.events
            ),
            JobSql::Insert => format!(
                "INSERT INTO mailroom_jobs (kind, box, selection, reason, state, total,
                     through_id, actor, principal, request_id, created_at, updated_at)
                 VALUES ({}, {}, {}, {}, 'running', {}, {}, {}, {}, {}, {now}, {now})
                 ON CONFLICT (kind, box, request_id) WHERE request_id IS NOT NULL DO NOTHING
                 RETURNING {JOB_COLUMNS}",
                p(1),
                p(2),
                p(3),
                p(4),
                p(5),
                p(6),
                p(7),
                p(8),
                p(9),
                now = self.now(10)
            ),
            JobSql::OfRequest => format!(
                "SELECT {JOB_COLUMNS} FROM mailroom_jobs
                 WHERE kind = {} AND box = {} AND request_id = {}",
                p(1),
                p(2),
                p(3)
            ),
            JobSql::One => format!("SELECT {JOB_COLUMNS} FROM mailroom_jobs WHERE id = {}", p(1)),
            JobSql::Page => format!(
                "SELECT {JOB_COLUMNS} FROM mailroom_jobs
                 WHERE ({0}{i8} IS NULL OR id < {0}) ORDER BY id DESC LIMIT {1}",
                p(1),
                p(2)
            ),
            JobSql::Cancel => format!(
                "UPDATE mailroom_jobs SET state = 'cancelling', cancelled_by = {}, updated_at = {now}
                 WHERE id = {} AND state = 'running' RETURNING {JOB_COLUMNS}",
                p(2),
                p(1),
                now = self.now(3)
            ),
            // The outer condition is checked again after a wait on the row's lock, so two
            // runners never both take a job (PostgreSQL also skips a row being taken).
            JobSql::Claim => {
                let now = self.now(3);
                let free = format!("(lease_until IS NULL OR lease_until < {now})");
                format!(
                    "UPDATE mailroom_jobs SET owner = {}, lease_until = {}
                     WHERE {OPEN} AND {free} AND id = (
                         SELECT id FROM mailroom_jobs WHERE {OPEN} AND {free}
                         ORDER BY id LIMIT 1{})
                     RETURNING {JOB_COLUMNS}",
                    p(1),
                    self.plus_ms(&now, &p(2)),
                    if self.postgres {
                        " FOR UPDATE SKIP LOCKED"
                    } else {
                        ""
                    }
                )
            }
            JobSql::Advance => {
                let now = self.now(6);
                format!(
                    "UPDATE mailroom_jobs SET done = done + {}, after_id = {}, lease_until = {},
                         updated_at = {now}
                     WHERE id = {} AND owner = {} AND {OPEN}
                     RETURNING state, done, after_id",
                    p(3),
                    p(4),
                    self.plus_ms(&now, &p(5)),
                    p(1),
                    p(2)
                )
            }
            JobSql::End => format!(
                "UPDATE mailroom_jobs SET state = {}, error = {}, owner = NULL, lease_until = NULL,
                     finished_at = {now}, updated_at = {now}
                 WHERE id = {} AND owner = {} AND {OPEN} RETURNING {JOB_COLUMNS}",
                p(3),
                p(4),
                p(1),
                p(2),
                now = self.now(5)
            ),
            JobSql::Release => format!(
                "UPDATE mailroom_jobs SET owner = NULL, lease_until = NULL
                 WHERE id = {} AND owner = {}",
                p(1),
                p(2)
            ),
        }
    }
}

//! The claim, settle and renew statements of a box, built once per box (as on
//! PostgreSQL, `store/postgres/sql.rs`): the boxes differ only in table names and the
//! inbox's subscription, bound as the parameter each statement names.

use super::EVENT_COLUMNS;

/// SQL text per box, built once.
pub(super) struct Sql {
    /// Leases as many ready keys as the cycle's events fill, each at its depth.
    pub(super) lease_keys: String,
    /// One leased line's in-line ids and sizes (never-tried delayed events skipped).
    pub(super) heads: String,
    /// One line's earliest delayed schedule before the window's end, and its highest
    /// pending id.
    pub(super) marks: String,
    /// One line's events between two ids, decoded.
    pub(super) rows: String,
    /// Claims due unkeyed events within the byte budget.
    pub(super) claim_unkeyed: String,
    /// Applies one decision to one event, if the claim still holds it.
    pub(super) settle_event: String,
    /// Releases one key with its next ready time.
    pub(super) release_key: String,
    /// Extends one key's lease.
    pub(super) renew_key: String,
    /// Extends one unkeyed event's claim.
    pub(super) renew_event: String,
}

impl Sql {
    /// `scoped`: the tables carry a `subscription` column (the inbox).
    pub(super) fn new(events: &str, keys: &str, scoped: bool) -> Self {
        let t = Tables {
            events,
            keys,
            scoped,
        };
        let cols = &*EVENT_COLUMNS;
        let line = format!(
            "status = 'pending' AND topic = ?1 AND event_key = ?2{}",
            t.scope("subscription = ?4")
        );
        let delayed = "attempts = 0 AND last_error IS NULL AND scheduled_at > ?3";
        Sql {
            lease_keys: t.lease_keys(),
            heads: format!(
                "SELECT id, length(payload) + length(headers) AS size FROM {events}
                 WHERE {line} AND NOT ({delayed}) ORDER BY id LIMIT ?5"
            ),
            marks: format!(
                "SELECT (SELECT min(scheduled_at) FROM {events}
                         WHERE {line} AND {delayed} AND id < ?5) AS delayed_at,
                        (SELECT max(id) FROM {events} WHERE {line}) AS line_end"
            ),
            rows: format!(
                "SELECT {cols} FROM {events}
                 WHERE {line} AND NOT ({delayed}) AND id >= ?5 AND id <= ?6 ORDER BY id"
            ),
            claim_unkeyed: t.claim_unkeyed(),
            settle_event: t.settle_event(),
            release_key: t.release_key(),
            renew_key: format!(
                "UPDATE {keys} SET lease_until = ?4,
                    ready_at = CASE WHEN ready_at >= lease_until THEN ?4 ELSE ready_at END
                 WHERE topic = ?1 AND event_key = ?2 AND lease_token = ?3{}",
                t.scope("subscription = ?5")
            ),
            renew_event: format!(
                "UPDATE {events} SET claimed_until = ?3
                 WHERE id = ?1 AND claim_token = ?2 AND status = 'pending'{}",
                t.scope("subscription = ?4")
            ),
        }
    }
}

/// The outbox's claims skip paused topics (migration 0017), as on PostgreSQL.
const NOT_PAUSED: &str = "topic NOT IN (SELECT p.topic FROM outbox_paused_topics p)";

/// A box's tables, from which each statement is written.
struct Tables<'a> {
    events: &'a str,
    keys: &'a str,
    scoped: bool,
}

impl Tables<'_> {
    /// ` AND frag` on scoped tables, nothing otherwise.
    fn scope(&self, frag: &str) -> String {
        if self.scoped {
            format!(" AND {frag}")
        } else {
            String::new()
        }
    }

    /// What a claim adds to its candidates' filter: the inbox's subscription `frag`, or
    /// in the outbox, topics not paused (migration 0017; their events stay pending and
    /// spend no attempt).
    fn claim_scope(&self, frag: &str) -> String {
        if self.scoped {
            // A paused subscription (migration 0022) claims nothing.
            self.scope(frag)
                + " AND NOT EXISTS (SELECT 1 FROM inbox_paused_subscriptions ps
                                    WHERE ps.subscription = ?5)"
        } else {
            format!(" AND {NOT_PAUSED}")
        }
    }

    /// One pass: the transaction holds the database, so there are no locked candidates
    /// to skip (PostgreSQL's `lease_keys` skips them).
    fn lease_keys(&self) -> String {
        let keys = self.keys;
        let lease_scope = self.claim_scope("subscription = ?5");
        format!(
            "UPDATE {keys} SET lease_token = ?1, lease_until = ?2, ready_at = ?2
                 WHERE rowid IN (
                    SELECT rowid FROM (
                        SELECT rowid, sum(w) OVER (ORDER BY ready_at ROWS UNBOUNDED PRECEDING) - w AS before
                        FROM (SELECT rowid, ready_at, min(max(pending, 1), ?6) AS w FROM {keys}
                              WHERE ready_at <= ?3 AND (lease_until IS NULL OR lease_until <= ?3){lease_scope}
                              ORDER BY ready_at LIMIT ?4))
                    WHERE before < ?7)
                 RETURNING topic, event_key"
        )
    }

    fn claim_unkeyed(&self) -> String {
        let events = self.events;
        let cols = &*EVENT_COLUMNS;
        let lease_scope = self.claim_scope("subscription = ?5");
        format!(
            "UPDATE {events} SET claim_token = ?1, claimed_until = ?2
                 WHERE id IN (
                    SELECT id FROM (
                        SELECT id,
                               sum(size) OVER (ORDER BY scheduled_at, id) AS total,
                               row_number() OVER (ORDER BY scheduled_at, id) AS n
                        FROM (SELECT id, scheduled_at, length(payload) + length(headers) AS size
                              FROM {events}
                              WHERE status = 'pending' AND event_key IS NULL AND scheduled_at <= ?3
                                AND (claimed_until IS NULL OR claimed_until <= ?3){lease_scope}
                              ORDER BY scheduled_at, id LIMIT ?4))
                    WHERE n = 1 OR total <= ?6)
                 RETURNING {cols}"
        )
    }

    fn settle_event(&self) -> String {
        let (events, keys) = (self.events, self.keys);
        // The attempt history (migration 0018): a counted attempt or a failure appends
        // (attempt, time, error) to the JSON array, which keeps its last 10.
        let entry = "json_insert(COALESCE(attempt_log, '[]'), '$[#]', \
                     json_object('attempt', ?3, 'at', ?6, 'error', substr(?5, 1, 1000)))";
        let push = format!(
            "CASE WHEN ?5 IS NOT NULL AND (?2 = 'failed' OR ?3 > attempts)
                  THEN CASE WHEN json_array_length({entry}) > 10
                            THEN json_remove({entry}, '$[0]') ELSE {entry} END
                  ELSE attempt_log END"
        );
        let settle_scope = self.scope(&format!("k.subscription = {events}.subscription"));
        format!(
            "UPDATE {events} SET status = ?2, attempts = COALESCE(?3, attempts),
                    scheduled_at = COALESCE(?4, scheduled_at), last_error = COALESCE(?5, last_error),
                    attempt_log = {push},
                    published_at = CASE WHEN ?2 = 'completed' THEN ?6 ELSE published_at END,
                    updated_at = CASE WHEN ?7 THEN updated_at ELSE ?6 END,
                    claim_token = NULL, claimed_until = NULL
                 WHERE id = ?1 AND status = 'pending'
                   AND ((event_key IS NULL AND claim_token = ?8)
                        OR (event_key IS NOT NULL AND EXISTS (
                            SELECT 1 FROM {keys} k WHERE k.topic = {events}.topic
                              AND k.event_key = {events}.event_key AND k.lease_token = ?8{settle_scope})))"
        )
    }

    fn release_key(&self) -> String {
        let (events, keys) = (self.events, self.keys);
        let release_scope = self.scope("subscription = ?7");
        let release_exists = self.scope("e.subscription = ?7");
        format!(
            "UPDATE {keys} SET lease_token = NULL, lease_until = NULL,
                    ready_at = MIN(?4,
                        -- An enqueue during the lease pulled ready_at below lease_until.
                        CASE WHEN ready_at < lease_until THEN ready_at ELSE ?4 END,
                        CASE WHEN ?5 IS NOT NULL AND EXISTS (
                        SELECT 1 FROM {events} e WHERE e.status = 'pending' AND e.topic = ?1
                          AND e.event_key = ?2{release_exists} AND e.id > ?5) THEN ?6 ELSE ?4 END)
                 WHERE topic = ?1 AND event_key = ?2 AND lease_token = ?3{release_scope}"
        )
    }
}

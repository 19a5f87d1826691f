//! The claim, settle and renew statements of a box, built once per box: the boxes differ
//! only in table names and the inbox's subscription.

use std::sync::Arc;

use super::profile::Qualifier;

/// SQL text per box, built once: the boxes differ only in table names.
pub(super) struct Sql {
    pub(super) lease_keys: Arc<str>,
    pub(super) windows: Arc<str>,
    pub(super) claim_unkeyed: Arc<str>,
    pub(super) lock_keys: Arc<str>,
    pub(super) settle_events: Arc<str>,
    pub(super) release_keys: Arc<str>,
    pub(super) renew_keys: Arc<str>,
    pub(super) renew_unkeyed: Arc<str>,
    pub(super) get_event: Arc<str>,
    /// The outbox's cursor advance: which runs it may cover, and the release that moves
    /// the cursors (`None` in the inbox, which settles row by row).
    pub(super) check_runs: Option<Arc<str>>,
    pub(super) release_advance: Option<Arc<str>>,
    /// The outbox's fold of SQL-API events into their keys (migration 0015; `None` in
    /// the inbox, which has no SQL API).
    pub(super) fold: Option<Arc<str>>,
    /// The outbox's check before a leased line's next window is read (`continue_line`;
    /// `None` in the inbox, whose lines are released after each run).
    pub(super) continue_line: Option<Arc<str>>,
    /// The outbox's read of a leased line's next window within the horizon the check
    /// returned: no lock (see `Tables::windows`).
    pub(super) windows_within: Option<Arc<str>>,
}

impl Sql {
    /// `scoped`: the tables carry a `subscription` column (the inbox), and every claim
    /// and settle statement takes the subscription as its last parameter.
    pub(super) fn new(events: &str, keys: &str, scoped: bool, names: &Qualifier) -> Self {
        let t = Tables {
            events,
            keys,
            scoped,
        };
        let q = |sql: String| -> Arc<str> { names.text(&sql).into() };
        Sql {
            lease_keys: q(t.lease_keys()),
            windows: q(t.windows(false)),
            claim_unkeyed: q(t.claim_unkeyed()),
            lock_keys: q(t.lock_keys()),
            settle_events: q(t.settle_events()),
            // Each key row found by a primary-key probe (the materialized `u`, which the
            // planner cannot turn around) and updated by its row id: the settle locked
            // these rows earlier in its transaction (`lock_keys`), so the id the probe
            // reads is the current version. (Joined on the key, the planner, which
            // estimates one row for a lease token, looped over the array once per key
            // row, as `lock_keys` did.)
            release_keys: q(t.release(false)),
            renew_keys: q(t.renew_keys()),
            renew_unkeyed: q(t.renew_unkeyed()),
            get_event: q(t.get_event()),
            check_runs: (!scoped).then(|| q(t.check_runs())),
            // The outbox's release also moves the cursors `check_runs` allowed ($7: the
            // new cursor, $8: the events it covers, NULL and 0 elsewhere) and logs each
            // advance with its time in `outbox_publishes`: one write per key row.
            release_advance: (!scoped).then(|| q(t.release(true))),
            fold: (!scoped).then(|| q(FOLD.replace("$GATE", &compatible(3)))),
            continue_line: (!scoped).then(|| q(continue_line().replace("$GATE", &compatible(4)))),
            windows_within: (!scoped).then(|| q(t.windows(true))),
        }
    }
}

/// A box's tables, from which each statement is written.
struct Tables<'a> {
    events: &'a str,
    keys: &'a str,
    scoped: bool,
}

/// A never-tried event scheduled for later: not in line (docs/relay.md). Later than the
/// windows' clock (`w_now`), read once after the statement's snapshot: an event
/// enqueued "now" by a statement that started after this claim's transaction but
/// committed before the read must not look delayed (it would be skipped while later
/// events of its key went out).
fn delayed(a: &str) -> String {
    format!(
        "{a}.attempts = 0 AND {a}.last_error IS NULL AND {a}.scheduled_at > (SELECT t FROM w_now)"
    )
}

/// Bytes an event weighs in a claim's budget.
fn size(a: &str) -> String {
    format!("octet_length({a}.payload)::int8 + pg_column_size({a}.headers)::int8")
}

/// The schema gate inside a statement (issue 42, item 2; docs/storage.md, "Schema
/// compatibility"): true while no applied migration requires a binary that knows more
/// than the caller's schema, bound as `$n` (its highest embedded migration). A condition
/// the planner runs once per statement (an InitPlan over a table of a few rows), in the
/// statement's own snapshot: a lease, a continued line or a renewal taken under a
/// requirement that this binary does not meet is not taken at all, whatever any cache
/// says; and a requirement that cannot be read fails the statement, so the gate fails
/// closed.
pub(super) fn compatible(n: u8) -> String {
    format!(
        "(SELECT COALESCE(max(sc.min_binary_schema), 0) FROM mailroom_schema_compat sc) <= ${n}"
    )
}

/// The requirement the settle reads last, in its transaction (see `settle_once`).
pub(super) const REQUIRED: &str =
    "SELECT COALESCE(max(min_binary_schema), 0) FROM mailroom_schema_compat";

/// SQL-API events (stored `counted = false`, with no key row written): the key rows are
/// created or woken first, then the events are marked counted, which the update trigger
/// counts. (The outbox's only: the inbox has no SQL API.)
///
/// One relay folds at a time: the fold locks the one row of `mailroom_fold_turn`, `FOR
/// UPDATE SKIP LOCKED`, for the length of the statement (migration 0020), and only when
/// there is something to fold (a row lock draws a transaction id). A second relay's fold
/// would read the same rows, wait for the first's row locks and then find them counted,
/// so its claim only waited. The turn was an advisory lock, which any role may take: a
/// session with no privilege at all held it and stopped every fold. Nobody but
/// mailroom's owner may lock the row.
///
/// A key is woken only when a folded event is above its cursor (read without a lock: a
/// cursor that moves on meanwhile only makes the wake unneeded; one lowered by a requeue
/// is woken by the requeue): the relays read events whether counted or not, so by the
/// time a deep backlog is folded most of it is published, and waking those keys (with
/// their events' old schedules, ahead of every key with work in the ready order) made the
/// relays lease empty lines while the rest waited.
///
/// A key row another session holds (a settle in flight, a replica cut off mid-settle,
/// an operator's `SELECT ... FOR UPDATE`) is skipped, `SKIP LOCKED`, and its events are
/// left for a later fold: waiting on it stopped the fold, and so every claim, for every
/// key. The scan starts above $2 (the last id of the previous fold when that one was
/// full, else 0), so events of held keys at the front cannot fill every batch.
///
/// New key rows are inserted first (in byte order, as every key-locking statement
/// locks: an insert may wait for a writer inserting the same key), and only then are the
/// existing rows locked: holding rows locked before that wait could close a cycle with a
/// gRPC writer that inserted one key and waits for another.
///
/// The turn is locked once, in a sub-select the planner runs before the scan (a
/// one-time filter): in the scan's filter it was evaluated per row. The schema gate
/// (`compatible`, $3) comes first: a binary the database does not accept neither folds
/// nor takes the turn.
///
/// The scan starts above the floor of `fold.rs`, which the statement's last columns
/// move: the snapshot's horizon, the id sequence's last value ($4 names the table) read
/// in `probe`, before the turn's row lock gives the fold its transaction id, and that
/// id; the lowest id left uncounted. The update of `marked` is bounded by the ids of `f`:
/// its plan may read the uncounted index for the join, which it did whole, dead entries
/// and all, on every fold, even with nothing to fold.
///
/// `present` is the first uncounted id, ordered, not an `EXISTS`: the relay's sessions
/// plan generically, and for an `EXISTS` over a table not yet analyzed (a fresh
/// deployment's first burst) the planner expected a third of the rows to match and chose
/// a sequential scan that stops at the first, which read the whole table on every claim
/// (25 ms at 100,000 events) since every row was counted. Ordered, only the partial index
/// can answer without a sort.
const FOLD: &str = "WITH probe AS MATERIALIZED (
                    SELECT $GATE AS gate,
                           (SELECT id FROM outbox_events WHERE NOT counted AND id > $2
                            ORDER BY id LIMIT 1) IS NOT NULL AS present,
                           pg_sequence_last_value(pg_get_serial_sequence($4, 'id')::regclass) AS seq),
                 turn AS MATERIALIZED (
                    SELECT true FROM mailroom_fold_turn
                    WHERE (SELECT gate AND present FROM probe)
                    FOR UPDATE SKIP LOCKED),
                 f AS MATERIALIZED (
                    SELECT id, topic, event_key, scheduled_at FROM outbox_events
                    WHERE (SELECT count(*) FROM turn) > 0 AND NOT counted AND id > $2
                    ORDER BY id LIMIT $1),
                 g AS MATERIALIZED (
                    SELECT g.topic, g.event_key,
                           CASE WHEN c.published_through IS NULL OR g.top > c.published_through
                                THEN g.at ELSE 'infinity' END AS at
                    FROM (SELECT topic, event_key, min(scheduled_at) AS at, max(id) AS top
                          FROM f GROUP BY topic, event_key) g
                    LEFT JOIN outbox_keys c ON c.topic = g.topic AND c.event_key = g.event_key),
                 fresh AS MATERIALIZED (
                    INSERT INTO outbox_keys AS k (topic, event_key, ready_at, pending)
                    SELECT topic, event_key, at, 0 FROM g
                    WHERE NOT EXISTS (SELECT 1 FROM outbox_keys c
                                      WHERE c.topic = g.topic AND c.event_key = g.event_key)
                    ORDER BY topic COLLATE \"C\", event_key COLLATE \"C\"
                    ON CONFLICT (topic, event_key) DO NOTHING
                    RETURNING k.topic, k.event_key),
                 held AS MATERIALIZED (
                    SELECT c.topic, c.event_key, g.at FROM outbox_keys c
                    JOIN g ON c.topic = g.topic AND c.event_key = g.event_key
                    WHERE (SELECT count(*) FROM fresh) >= 0
                    FOR UPDATE OF c SKIP LOCKED),
                 woken AS (
                    UPDATE outbox_keys k SET ready_at = held.at FROM held
                    WHERE k.topic = held.topic AND k.event_key = held.event_key
                      AND held.at < k.ready_at
                    RETURNING 1),
                 marked AS MATERIALIZED (
                    UPDATE outbox_events e SET counted = true
                    FROM f WHERE e.id = f.id AND NOT e.counted
                      AND e.id > $2 AND e.id <= (SELECT max(id) FROM f)
                      AND ((f.topic, f.event_key) IN (SELECT topic, event_key FROM held)
                           OR (f.topic, f.event_key) IN (SELECT topic, event_key FROM fresh))
                      AND (SELECT count(*) FROM woken) >= 0
                    RETURNING e.id)
                 SELECT (SELECT count(*) FROM f) AS scanned, (SELECT max(id) FROM f) AS last,
                        (SELECT count(*) FROM marked) AS folded,
                        (SELECT min(id) FROM f WHERE id NOT IN (SELECT id FROM marked)) AS skipped,
                        (SELECT gate FROM probe) AS gate, (SELECT present FROM probe) AS present,
                        (SELECT count(*) FROM turn) > 0 AS turned,
                        txid_snapshot_xmin(txid_current_snapshot()) AS xmin,
                        txid_current_if_assigned() AS xid, (SELECT seq FROM probe) AS seq";

/// Whether no SQL-API writer holds the order lock of key `k` (docs/sql-api.md, "Order
/// locks"): its slot row (migration 0020), tried in shared mode, `SKIP LOCKED`, and held
/// until the caller's transaction ends, so no writer draws an id below what the caller
/// then reads. While `legacy_order_lock` is on, the advisory lock that older writers
/// held is tried too (shared): a writer of a binary before 0020 may still be open.
const ORDER_FREE: &str = "(EXISTS (SELECT 1 FROM mailroom_order_slots o
                     WHERE o.slot = mailroom_order_slot(k.topic, k.event_key)
                     FOR SHARE SKIP LOCKED)
                 AND (NOT (SELECT s.legacy_order_lock FROM mailroom_sql_settings s)
                      OR pg_try_advisory_xact_lock_shared(mailroom_order_lock(k.topic, k.event_key))))";

/// Before a leased line's next window is read (in the same transaction): the key is
/// still leased by the relay's token ($3) and its topic is not paused; its row is locked,
/// as the claim's lease locks it, so no gRPC writer is between drawing an id and
/// committing it (they upsert the key row first); and then the key's order lock is tried
/// in shared mode, as the lease tries it, for the SQL-API writers (the row first: holding
/// the order lock while waiting on the row kept the key's SQL writers waiting too).
/// Returns the cursor and the line's *horizon*, its highest id in this statement's
/// snapshot. Every writer of a key holds the key row or the order lock from drawing its
/// id to its end, so once both are held here every id up to the horizon belongs to a
/// transaction that has ended, and every id drawn later is above it: the line's events up
/// to the horizon can no longer change by a writer, and the next windows are read up to
/// it without a lock (`windows_within`). Nothing comes back while the schema gate ($4,
/// `compatible`) refuses this binary: the line is then released, or left to its lease.
fn continue_line() -> String {
    format!(
        "WITH k AS MATERIALIZED (
            SELECT k.topic, k.event_key, k.published_through FROM outbox_keys k
            WHERE k.topic = $1 AND k.event_key = $2 AND k.lease_token = $3
              AND k.topic NOT IN (SELECT p.topic FROM outbox_paused_topics p)
              AND $GATE
            FOR UPDATE OF k)
         SELECT k.published_through, {ORDER_FREE} AS free,
                (SELECT max(h.id) FROM outbox_events h
                 WHERE h.status = 'pending' AND h.topic = k.topic AND h.event_key = k.event_key)
                  AS horizon
         FROM k"
    )
}

/// The inbox's claims take nothing of a paused subscription (migration 0022): one probe of
/// the pause table's key, a one-time filter since it reads only the parameter.
const SUBSCRIPTION_NOT_PAUSED: &str = " AND NOT EXISTS (SELECT 1 FROM inbox_paused_subscriptions ps
                                            WHERE ps.subscription = $S)";

/// The outbox's claims skip paused topics (migration 0017): their events stay pending and
/// spend no attempt. The table is small (one row per paused topic), so the anti-join is a
/// hashed subplan; a paused topic's ready keys are still walked past in ready order.
const NOT_PAUSED: &str = "topic NOT IN (SELECT p.topic FROM outbox_paused_topics p)";

impl Tables<'_> {
    /// The extra predicate `frag` on scoped tables (nothing otherwise), with `$S`
    /// replaced by the parameter number `n`.
    fn scope(&self, frag: &str, n: u8) -> String {
        if self.scoped {
            frag.replace("$S", &format!("${n}"))
        } else {
            String::new()
        }
    }

    /// The schema gate (`compatible`) with the binary's schema as the parameter after the
    /// statement's own: `n` on the outbox, `n + 1` on the inbox, whose subscription is
    /// bound before it (`scoped`, then the schema: see `PgStore::gated`).
    fn gate(&self, n: u8) -> String {
        compatible(if self.scoped { n + 1 } else { n })
    }

    /// What a claim adds to its candidates' filter: the inbox's subscription (`frag`, as
    /// `scope` takes it), or in the outbox, topics not paused (on `alias`'s `topic`).
    fn claim_scope(&self, frag: &str, n: u8, alias: &str) -> String {
        if self.scoped {
            self.scope(&format!("{frag}{SUBSCRIPTION_NOT_PAUSED}"), n)
        } else {
            format!(" AND {alias}{NOT_PAUSED}")
        }
    }

    /// Ready keys in ready order, as many as the cycle's events fill ($5), each counted
    /// at its depth (`pending`, at least 1, at most a run, $4), and no more than $1: deep
    /// lines come a few keys at a time with long runs, since every leased key costs its
    /// writes whatever it carries. The count is taken over the candidates without
    /// locking; the lease then skips the locked ones. It returns the claim's time too,
    /// which saves a round trip per cycle. Nothing is leased while the schema gate
    /// refuses this binary (`compatible`, the parameter after the others).
    fn lease_keys(&self) -> String {
        let keys = self.keys;
        let lease_scope = self.claim_scope(" AND subscription = $S", 6, "");
        let lease_join = self.scope(" AND k.subscription = $S", 6);
        let gate = self.gate(6);
        // Whether no SQL-API writer holds the key's order lock (`ORDER_FREE`). The inbox
        // has no SQL writers.
        let free = if self.scoped { "true" } else { ORDER_FREE };
        format!(
            "WITH picked AS (
                    SELECT topic, event_key FROM {keys}
                    WHERE ready_at <= now() AND (lease_until IS NULL OR lease_until <= now()){lease_scope}
                      AND {gate}
                    ORDER BY ready_at
                    LIMIT (SELECT count(*) FROM (
                              SELECT sum(w) OVER (ORDER BY ready_at ROWS UNBOUNDED PRECEDING) - w AS before
                              FROM (SELECT ready_at, LEAST(GREATEST(pending, 1), $4) AS w FROM {keys}
                                    WHERE ready_at <= now()
                                      AND (lease_until IS NULL OR lease_until <= now()){lease_scope}
                                    ORDER BY ready_at LIMIT $1) c) s
                           WHERE before < $5)
                    FOR UPDATE SKIP LOCKED)
                 UPDATE {keys} k SET lease_token = $2,
                        lease_until = now() + $3 * interval '1 millisecond',
                        ready_at = now() + $3 * interval '1 millisecond'
                 FROM picked WHERE k.topic = picked.topic AND k.event_key = picked.event_key{lease_join}
                 RETURNING k.topic, k.event_key, k.published_through, now(), {free} AS free"
        )
    }

    /// The front of each leased key's line: up to $3 in-line events in id order, skipping
    /// never-tried delayed ones; and, over the pending events before the $3-th in-line
    /// one (all of them when there are fewer), the earliest delayed schedule and the
    /// highest id. Each part walks the line and stops after $3 in-line rows plus the
    /// delayed ones in between, whatever the depth of the key. (`OFFSET 0` keeps the
    /// marks one evaluation per key.) The line starts above the key's cursor ($4): what
    /// is at or below it is published (migration 0011). The byte budget ($5) is shared in
    /// claim order, as `fit_in_budget` does (at least one event): every in-line row comes
    /// back, `taken` or not, but only taken rows carry their payload and headers, so one
    /// statement reads the lines and their events (a second read by id cost a round trip
    /// and 1,000 index probes a cycle). The sort under the running sum holds large
    /// payloads as TOAST pointers, and the `CASE` leaves those of rows past the budget
    /// unread.
    ///
    /// `within` (the outbox's continued lines): only the events up to the line's horizon
    /// ($7), and no row at all unless the key is still leased by the token $6 and its
    /// topic is not paused, the check `continue_line` makes under lock (docs/relay.md,
    /// "Continued lines"), and the schema gate ($8, `compatible`) accepts this binary.
    fn windows(&self, within: bool) -> String {
        debug_assert!(!(within && self.scoped), "continued lines are the outbox's");
        let events = self.events;
        let keys = self.keys;
        let window_scope = |alias: &str| {
            let bound = if within {
                format!(" AND {alias}.id <= $7")
            } else {
                String::new()
            };
            self.scope(&format!(" AND {alias}.subscription = $S"), 6) + &bound
        };
        let leased = if within {
            format!(
                " WHERE EXISTS (SELECT 1 FROM {keys} lk WHERE lk.topic = k.topic
                      AND lk.event_key = k.event_key AND lk.lease_token = $6
                      AND lk.{NOT_PAUSED} AND {gate})",
                gate = compatible(8)
            )
        } else {
            String::new()
        };
        let (e_scope, d_scope, b_scope) = (window_scope("e"), window_scope("d"), window_scope("b"));
        let (e_delayed, d_delayed, b_delayed) = (delayed("e"), delayed("d"), delayed("b"));
        let e_size = size("e");
        format!(
            "WITH w_now AS MATERIALIZED (SELECT clock_timestamp() AS t)
                 SELECT (SELECT t FROM w_now) AS now, w.o, w.delayed_at, w.line_end, w.id, w.taken,
                        w.topic, w.event_key, CASE WHEN w.taken THEN w.payload END AS payload,
                        CASE WHEN w.taken THEN w.headers::text END AS headers, w.event_type,
                        w.idempotency_key, w.status, w.attempts, w.max_attempts, w.scheduled_at,
                        w.created_at, w.updated_at, w.published_at, w.last_error
                 FROM (
                  SELECT v.*, v.id IS NOT NULL AND (v.n = 1 OR v.total <= $5) AS taken FROM (
                   SELECT k.o, m.delayed_at, m.line_end, l.*,
                          sum(l.size) OVER (ORDER BY k.o, l.id ROWS UNBOUNDED PRECEDING) AS total,
                          count(l.id) OVER (ORDER BY k.o, l.id ROWS UNBOUNDED PRECEDING) AS n
                   FROM unnest($1::text[], $2::text[], $4::int8[])
                        WITH ORDINALITY AS k(topic, event_key, through, o)
                   CROSS JOIN LATERAL (
                      SELECT min(d.scheduled_at) FILTER (WHERE {d_delayed}) AS delayed_at,
                             max(d.id) AS line_end
                      FROM {events} d
                      WHERE d.status = 'pending'{d_scope} AND d.topic = k.topic
                        AND d.event_key = k.event_key AND d.id > k.through
                        AND d.id < COALESCE((
                            SELECT b.id FROM {events} b
                            WHERE b.status = 'pending'{b_scope} AND b.topic = k.topic
                              AND b.event_key = k.event_key AND b.id > k.through
                              AND NOT ({b_delayed})
                            ORDER BY b.id OFFSET $3 - 1 LIMIT 1), 9223372036854775807)
                      OFFSET 0) m
                   LEFT JOIN LATERAL (
                      SELECT e.id, {e_size} AS size, e.topic, e.event_key, e.payload, e.headers,
                             e.event_type, e.idempotency_key, e.status, e.attempts,
                             e.max_attempts, e.scheduled_at, e.created_at, e.updated_at,
                             e.published_at, e.last_error
                      FROM {events} e
                      WHERE e.status = 'pending'{e_scope} AND e.topic = k.topic
                        AND e.event_key = k.event_key AND e.id > k.through AND NOT ({e_delayed})
                      ORDER BY e.id LIMIT $3) l ON true{leased}) v) w
                 ORDER BY w.o, w.id"
        )
    }

    /// Due unkeyed events in schedule order, at most $1 and $4 bytes (at least one); none
    /// while the schema gate refuses this binary.
    fn claim_unkeyed(&self) -> String {
        let events = self.events;
        let c = &crate::store::rows::event_columns("payload", "headers::text");
        let unkeyed_scope = self.claim_scope(" AND u.subscription = $S", 5, "u.");
        let gate = self.gate(5);
        let u_size = size("u");
        format!(
            "UPDATE {events} SET claim_token = $2,
                        claimed_until = now() + $3 * interval '1 millisecond'
                 WHERE id IN (
                    SELECT s.id FROM (
                        SELECT u.id,
                               sum(u.size) OVER (ORDER BY u.scheduled_at, u.id) AS total,
                               row_number() OVER (ORDER BY u.scheduled_at, u.id) AS n
                        FROM (SELECT u.id, u.scheduled_at, {u_size} AS size FROM {events} u
                              WHERE u.status = 'pending'{unkeyed_scope} AND u.event_key IS NULL
                                AND u.scheduled_at <= now()
                                AND (u.claimed_until IS NULL OR u.claimed_until <= now())
                                AND {gate}
                              ORDER BY u.scheduled_at, u.id LIMIT $1 FOR UPDATE SKIP LOCKED) u) s
                    WHERE s.n = 1 OR s.total <= $4)
                 RETURNING {c}"
        )
    }

    /// Driven by the array, one primary-key probe per key, locking in the array's order
    /// (the caller sorts it). A join let the planner, which estimates one row for a
    /// lease token, loop over the array once per key row (docs/benchmarks.md,
    /// "Performance v2, step 2").
    fn lock_keys(&self) -> String {
        let keys = self.keys;
        let lock_scope = self.scope(" AND k.subscription = $S", 4);
        format!(
            "SELECT l.topic, l.event_key
                 FROM unnest($1::text[], $2::text[]) AS u(topic, event_key)
                 CROSS JOIN LATERAL (
                    SELECT k.topic, k.event_key FROM {keys} k
                    WHERE k.topic = u.topic AND k.event_key = u.event_key
                      AND k.lease_token = $3{lock_scope}
                    FOR UPDATE) l"
        )
    }

    fn settle_events(&self) -> String {
        let (events, keys) = (self.events, self.keys);
        let settle_scope = self.scope(" AND k.subscription = e.subscription", 0);
        format!(
            "UPDATE {events} e SET
                    status = CASE u.kind WHEN 'completed' THEN 'completed'
                                         WHEN 'failed' THEN 'failed' ELSE 'pending' END,
                    attempts = COALESCE(u.attempts, e.attempts),
                    scheduled_at = CASE WHEN u.kind = 'retry'
                        THEN COALESCE(u.at, now() + u.delay_ms * interval '1 millisecond')
                        ELSE e.scheduled_at END,
                    last_error = COALESCE(u.error, e.last_error),
                    attempt_log = CASE WHEN u.error IS NOT NULL
                                        AND (u.kind = 'failed' OR u.attempts > e.attempts)
                        THEN mailroom_push_attempt(e.attempt_log, u.attempts, u.error)
                        ELSE e.attempt_log END,
                    published_at = CASE WHEN u.kind = 'completed' THEN now() ELSE e.published_at END,
                    updated_at = CASE WHEN u.kind = 'release' THEN e.updated_at ELSE now() END,
                    claim_token = NULL, claimed_until = NULL
                 FROM unnest($1::int8[], $2::text[], $3::int4[], $4::int8[], $5::timestamptz[], $6::text[])
                      AS u(id, kind, attempts, delay_ms, at, error)
                 WHERE e.id = u.id AND e.status = 'pending'
                   AND ((e.event_key IS NULL AND e.claim_token = $7)
                        OR (e.event_key IS NOT NULL AND EXISTS (
                            SELECT 1 FROM {keys} k WHERE k.topic = e.topic
                              AND k.event_key = e.event_key AND k.lease_token = $7
                              AND e.id > k.published_through{settle_scope})))"
        )
    }

    /// The key release, with the cursor advance when `advance`.
    fn release(&self, advance: bool) -> String {
        let (events, keys) = (self.events, self.keys);
        let release_scope = self.scope(" AND k.subscription = $S", 7);
        let release_probe = self.scope(" AND r.subscription = $S", 7);
        let release_exists = self.scope(" AND e.subscription = k.subscription", 0);
        // The outbox may keep a key leased (`KeyRelease::keep`, its lease in `after_ms`):
        // the cursor moves, the lease is extended as a renewal extends it. The inbox
        // always releases.
        let (cursor_cols, cursor_arrays, cursor_set, keep_col, keep_array, keep) = if advance {
            (
                ", through, n, counted",
                ", $7::int8[], $8::int8[], $9::int8[]",
                // Only counted events were in `pending` (migration 0015).
                ", published_through = COALESCE(u.through, k.published_through),
                       pending = k.pending - COALESCE(u.counted, 0)",
                ", keep",
                ", $10::bool[]",
                "u.keep",
            )
        } else if self.scoped {
            ("", "", "", "", "", "false")
        } else {
            ("", "", "", ", keep", ", $7::bool[]", "u.keep")
        };
        let update = format!(
            "UPDATE {keys} k SET
                    lease_token = CASE WHEN {keep} THEN k.lease_token END,
                    lease_until = CASE WHEN {keep}
                        THEN now() + u.after_ms * interval '1 millisecond' END{cursor_set},
                    ready_at = CASE WHEN {keep} THEN
                        CASE WHEN k.ready_at < k.lease_until THEN k.ready_at
                             ELSE now() + u.after_ms * interval '1 millisecond' END
                    ELSE LEAST(
                        -- An enqueue during the lease pulled ready_at below lease_until:
                        -- its wake-up must survive the release.
                        CASE WHEN k.ready_at < k.lease_until THEN k.ready_at END,
                        COALESCE(u.at, 'infinity'),
                        COALESCE(now() + u.after_ms * interval '1 millisecond', 'infinity'),
                        -- Something new in line: a pending event above what the claim
                        -- read and above the cursor. (The rows at or below the cursor are
                        -- published; counting them kept a drained key ready, re-leased
                        -- every cycle until retention deleted them.)
                        CASE WHEN u.seen IS NOT NULL AND EXISTS (
                                SELECT 1 FROM {events} e WHERE e.status = 'pending'
                                  AND e.topic = k.topic AND e.event_key = k.event_key{release_exists}
                                  AND e.id > GREATEST(u.seen, k.published_through))
                             THEN now() ELSE 'infinity' END) END
                 FROM u WHERE k.ctid = u.row_id AND k.lease_token = $6{release_scope}"
        );
        let u = format!(
            "u AS MATERIALIZED (
                    SELECT u.*, r.ctid AS row_id
                    FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::int8[], $5::int8[]{cursor_arrays}{keep_array})
                         AS u(topic, event_key, at, after_ms, seen{cursor_cols}{keep_col})
                    JOIN {keys} r ON r.topic = u.topic AND r.event_key = u.event_key{release_probe})"
        );
        if advance {
            format!(
                "WITH {u}, rel AS ({update} RETURNING k.topic, k.event_key, u.through, u.n)
                     INSERT INTO outbox_publishes (topic, event_key, through, at, events)
                     SELECT topic, event_key, through, now(), n FROM rel WHERE through IS NOT NULL"
            )
        } else {
            format!("WITH {u} {update}")
        }
    }

    /// Locks in the same collation-independent order as every key-locking statement;
    /// keeps an enqueue's wake-up (ready_at pulled below the lease). A binary the schema
    /// gate refuses renews nothing: its leases run out and a newer binary takes over.
    fn renew_keys(&self) -> String {
        let keys = self.keys;
        let renew_scope = self.scope(" AND k.subscription = $S", 5);
        let gate = self.gate(5);
        format!(
            "WITH held AS (
                    SELECT k.topic, k.event_key FROM {keys} k
                    JOIN unnest($1::text[], $2::text[]) AS u(topic, event_key)
                      ON k.topic = u.topic AND k.event_key = u.event_key
                    WHERE k.lease_token = $4{renew_scope} AND {gate}
                    ORDER BY k.topic COLLATE \"C\", k.event_key COLLATE \"C\" FOR UPDATE OF k)
                 UPDATE {keys} k SET lease_until = now() + $3 * interval '1 millisecond',
                        ready_at = CASE WHEN k.ready_at >= k.lease_until
                                        THEN now() + $3 * interval '1 millisecond'
                                        ELSE k.ready_at END
                 FROM held WHERE k.topic = held.topic AND k.event_key = held.event_key
                   AND k.lease_token = $4{renew_scope}"
        )
    }

    fn renew_unkeyed(&self) -> String {
        let events = self.events;
        let renew_unkeyed_scope = self.scope(" AND subscription = $S", 4);
        let gate = self.gate(4);
        format!(
            "UPDATE {events} SET claimed_until = now() + $3 * interval '1 millisecond'
                 WHERE id = ANY($1) AND claim_token = $2 AND status = 'pending'{renew_unkeyed_scope}
                   AND {gate}"
        )
    }

    /// The outbox reads statuses through the view that applies the cursor.
    fn get_event(&self) -> String {
        let c = &crate::store::rows::event_columns("payload", "headers::text");
        let events = self.events;
        format!(
            "SELECT {c} FROM {} WHERE id = $1",
            if self.scoped {
                events.to_string()
            } else {
                format!("{events}_view")
            }
        )
    }

    /// Which released keys' cursors may move over the events the settle completes on
    /// them: per key ($1 topics, $2 keys) still leased by $4, the pending rows between the
    /// cursor and the highest completion ($3). The cursor moves only when those rows are
    /// exactly the completions: a delayed event the window skipped, a row requeued
    /// meanwhile or one cancelled in flight keeps it where it is, and those completions
    /// are written row by row instead. Read after the settle has locked the keys, so the
    /// answer holds until it commits. The release then moves the cursors
    /// (`release_advance`).
    fn check_runs(&self) -> String {
        let (events, keys) = (self.events, self.keys);
        // Per released key still leased by the settle's token ($4): the cursor and the
        // pending events between it and the highest event the settle completes on the key
        // ($3), read once through the line index. The caller compares them with the
        // completions it holds: equal, the cursor covers them.
        format!(
            "SELECT r.o, k.published_through, x.ids, x.counted
                     FROM unnest($1::text[], $2::text[], $3::int8[])
                          WITH ORDINALITY AS r(topic, event_key, through, o)
                     JOIN {keys} k ON k.topic = r.topic AND k.event_key = r.event_key
                                  AND k.lease_token = $4
                     CROSS JOIN LATERAL (
                        SELECT array_agg(e.id ORDER BY e.id) AS ids,
                               count(*) FILTER (WHERE e.counted) AS counted
                        FROM {events} e
                        WHERE e.status = 'pending' AND e.topic = r.topic
                          AND e.event_key = r.event_key
                          AND e.id > k.published_through AND e.id <= r.through) x"
        )
    }
}

//! How the admin statements of a box are shaped: its tables, how they name the
//! subscription (the inbox has one; the outbox has none and reads as `''`), the event
//! filter and the backlog order. Shared by the PostgreSQL and SQLite admin statements,
//! which differ here only in parameter marks, the casts PostgreSQL needs and one
//! function name.

mod jobs;
mod rewinds;

use super::admin_sql::Shared;
use crate::domain::BoxKind;
use crate::domain::admin::PendingOrder;

/// The columns of a paused topic (`decode_pause`; a subscription's name comes as `topic`).
const PAUSE_COLUMNS: &str = "topic, reason, actor, principal, paused_at";

/// A box's tables and how its statements name the subscription.
pub(crate) struct Shape {
    pub events: &'static str,
    /// Where statuses are read: the events table, or on the PostgreSQL outbox the view
    /// that applies the keys' published-through cursors (migration 0011).
    pub rows: &'static str,
    /// The box publishes by cursor (the PostgreSQL outbox): a `pending` row at or below
    /// its key's cursor is published.
    cursor: bool,
    pub keys: &'static str,
    pub inbox: bool,
    /// `::text` on PostgreSQL (untyped parameters and literals need it), empty on SQLite.
    text: &'static str,
    /// `::timestamptz` on PostgreSQL, empty on SQLite.
    time: &'static str,
    /// The parameter mark: `$` on PostgreSQL, `?` on SQLite.
    mark: char,
    /// The substring position function: `strpos` on PostgreSQL, `instr` on SQLite.
    find: &'static str,
    /// `ready_at` of an idle key: `'infinity'` on PostgreSQL, `i64::MAX` on SQLite.
    idle: &'static str,
    /// `::int8` on PostgreSQL (sums are `numeric` there), empty on SQLite.
    int8: &'static str,
    /// Whether id lists travel as arrays (PostgreSQL, `= ANY`) or JSON text (SQLite,
    /// `json_each`), and the clock is the statement's `now()` or a parameter.
    postgres: bool,
}

impl Shape {
    pub fn postgres(b: BoxKind) -> Shape {
        Shape {
            text: "::text",
            time: "::timestamptz",
            mark: '$',
            find: "strpos",
            idle: "'infinity'",
            int8: "::int8",
            postgres: true,
            rows: match b {
                BoxKind::Outbox => "outbox_events_view",
                BoxKind::Inbox => "inbox_events",
            },
            cursor: b == BoxKind::Outbox,
            ..Shape::sqlite(b)
        }
    }

    pub fn sqlite(b: BoxKind) -> Shape {
        let (events, keys) = match b {
            BoxKind::Outbox => ("outbox_events", "outbox_keys"),
            BoxKind::Inbox => ("inbox_events", "inbox_keys"),
        };
        Shape {
            events,
            rows: events,
            cursor: false,
            keys,
            inbox: b == BoxKind::Inbox,
            text: "",
            time: "",
            mark: '?',
            find: "instr",
            idle: "9223372036854775807",
            int8: "",
            postgres: false,
        }
    }

    /// Event columns for `decode_event`, with the payload only when `with_payload` (a
    /// parameter or literal) is true, the inbox's origin columns (NULL in the outbox),
    /// and the attempt history (migration 0018) only when `with_log` (one event's
    /// detail; listings leave it out).
    pub fn detail_columns(&self, with_payload: &str, with_log: bool) -> String {
        let t = self.text;
        let (sub, mid) = if self.inbox {
            ("subscription", "message_id")
        } else {
            ("NULL", "NULL")
        };
        let (empty, headers, size) = if self.postgres {
            ("''::bytea", "headers::text", "octet_length(payload)::int8")
        } else {
            ("x''", "headers", "length(payload)")
        };
        let event = super::rows::event_columns(
            &format!("CASE WHEN {with_payload} THEN payload ELSE {empty} END"),
            headers,
        );
        let log = if with_log { "attempt_log" } else { "NULL" };
        format!(
            "{event}, {size} AS payload_size, {sub}{t} AS subscription, {mid}{t} AS message_id, \
             {log}{t} AS attempt_log"
        )
    }

    /// The subscription column `col` (`''` in the outbox, which has none).
    pub fn sub(&self, col: &str) -> String {
        if self.inbox {
            col.to_string()
        } else {
            format!("''{}", self.text)
        }
    }

    /// `AND a.subscription = b.subscription` in the inbox, nothing in the outbox.
    pub fn same_sub(&self, a: &str, b: &str) -> String {
        if self.inbox {
            format!(" AND {a}.subscription = {b}.subscription")
        } else {
            String::new()
        }
    }

    /// The optional subscription filter `param` on `col`; in the outbox it only matches
    /// when no subscription is asked for.
    pub fn sub_filter(&self, col: &str, param: &str) -> String {
        let t = self.text;
        if self.inbox {
            format!("({param}{t} IS NULL OR {col} = {param})")
        } else {
            format!("{param}{t} IS NULL")
        }
    }

    /// `subscription, ` to lead a GROUP BY in the inbox.
    pub fn group_sub(&self) -> &'static str {
        if self.inbox { "subscription, " } else { "" }
    }

    /// The subscription fragments of the backlog statement, `param` naming the
    /// subscription filter's parameter (`$9`, `?9`): the key row's subscription column,
    /// the join of events to it, the filter on it, the same column and filter over the
    /// result, and the `GROUP BY` column.
    pub fn backlog_parts(
        &self,
        param: &str,
    ) -> (String, String, String, String, String, &'static str) {
        (
            self.sub("k.subscription"),
            self.same_sub("e", "k"),
            self.sub_filter("k.subscription", param),
            self.sub("subscription"),
            self.sub_filter("subscription", param),
            self.group_sub(),
        )
    }

    /// The key rows with a backlog, as a condition over the key table aliased `alias`
    /// (`"k."`, or `""`): the ones with pending events, found through the `ready_at`
    /// index among the keys that are not idle (a key with pending events always has a
    /// finite `ready_at`, or the relay would never claim it), so that the admin reads and
    /// the readiness lag check follow the backlog, not the history of idle keys (issue
    /// 46: `pending > 0` alone read every key row, 47-50 ms at 1,000,000 keys). An
    /// index on `pending` would have served too, at the price of every enqueue's key
    /// update: no longer a HOT update (measured: the key upsert at 0.66x).
    pub fn backlog(&self, alias: &str) -> String {
        format!("{alias}ready_at < {} AND {alias}pending > 0", self.idle)
    }

    /// The event filter as SQL conditions over parameters `first..first+14`, in the order
    /// of `admin_flow::filter_params`.
    pub fn filter(&self, first: usize) -> String {
        let p = |i: usize| format!("{}{}", self.mark, first + i);
        let (t, ts, find) = (self.text, self.time, self.find);
        format!(
            "({0}{t} IS NULL OR topic = {0}) AND ({1}{t} IS NULL OR event_key = {1})
             AND ({2}{t} IS NULL OR event_type = {2})
             AND ({3}{ts} IS NULL OR updated_at >= {3})
             AND ({4}{ts} IS NULL OR updated_at < {4})
             AND ({5}{t} IS NULL OR {find}(last_error, {5}) > 0)
             AND {6}
             AND ({7}{t} IS NULL OR {find}(event_key, {7}) = 1)
             AND ({8}{ts} IS NULL OR created_at >= {8})
             AND ({9}{ts} IS NULL OR created_at < {9})
             AND ({10}{t} IS NULL OR {headers})
             AND ({11}{t} IS NULL OR idempotency_key = {11}) AND {message_id}
             AND ({after}{i8} IS NULL OR id > {after}) AND ({through}{i8} IS NULL OR id <= {through})",
            p(0),
            p(1),
            p(2),
            p(3),
            p(4),
            p(5),
            self.sub_filter("subscription", &p(6)),
            p(7),
            p(8),
            p(9),
            p(10),
            p(11),
            headers = self.headers_match(&p(10)),
            message_id = self.sub_filter("message_id", &p(12)),
            after = p(13),
            through = p(14),
            i8 = self.int8,
        )
    }

    /// The event's headers hold every pair of the JSON object `param`: containment on
    /// PostgreSQL's `jsonb`; on SQLite, no pair of `param` missing from the stored text.
    fn headers_match(&self, param: &str) -> String {
        if self.postgres {
            format!("headers @> {param}::jsonb")
        } else {
            format!(
                "NOT EXISTS (SELECT 1 FROM json_each({param}) w WHERE NOT EXISTS (
                     SELECT 1 FROM json_each(headers) h WHERE h.key = w.key AND h.value = w.value))"
            )
        }
    }

    /// The columns the flows read of a candidate for requeue or cancel.
    pub fn candidate_columns(&self) -> String {
        format!(
            "id, {} AS subscription, topic, event_key, status",
            self.sub("subscription")
        )
    }

    /// The backlog's ORDER BY.
    pub fn pending_order(order: PendingOrder) -> &'static str {
        match order {
            PendingOrder::MostPending => "pending DESC, subscription, topic, key",
            PendingOrder::Oldest => "created_at, subscription, topic, key",
        }
    }

    /// ` AND` the row (of `table`) is above its key's cursor, where the box has cursors:
    /// a `pending` row at or below it is published, not pending.
    pub fn above_cursor(&self, table: &str) -> String {
        if !self.cursor {
            return String::new();
        }
        let keys = self.keys;
        format!(
            " AND ({table}.event_key IS NULL OR {table}.id > COALESCE((
                SELECT c.published_through FROM {keys} c
                WHERE c.topic = {table}.topic AND c.event_key = {table}.event_key), 0))"
        )
    }

    /// The CTEs that make a requeue ($1, the ids) of events at or below their key's
    /// cursor possible on the PostgreSQL outbox: the cursor drops to just below the
    /// first requeued event of each key, and the events it passed that are still
    /// `pending` become `completed` rows of their own, with the publish time of their
    /// advance (the log rows above the new cursor go; the first of them is kept at the
    /// new cursor when events below it still need its time, counting only those, so
    /// the completed counts of migration 0016 stay exact). The key's pending count
    /// takes them in, so the count trigger's decrement for them nets to zero.
    fn lower_cursors() -> &'static str {
        "WITH r AS (
            SELECT e.topic, e.event_key, min(e.id) - 1 AS new, k.published_through AS old
            FROM outbox_events e
            JOIN outbox_keys k ON k.topic = e.topic AND k.event_key = e.event_key
            WHERE e.id = ANY($1) AND e.status = 'failed' AND e.event_key IS NOT NULL
            GROUP BY e.topic, e.event_key, k.published_through
            HAVING min(e.id) <= k.published_through),
         lowered AS (
            UPDATE outbox_keys k SET published_through = r.new,
                pending = k.pending + (SELECT count(*) FROM outbox_events e
                    WHERE e.status = 'pending' AND e.topic = k.topic AND e.event_key = k.event_key
                      AND e.id > r.new AND e.id <= r.old AND e.counted)
            FROM r WHERE k.topic = r.topic AND k.event_key = r.event_key),
         passed AS (
            UPDATE outbox_events e SET status = 'completed',
                published_at = COALESCE((SELECT p.at FROM outbox_publishes p
                    WHERE p.topic = e.topic AND p.event_key = e.event_key AND p.through >= e.id
                    ORDER BY p.through LIMIT 1), now()),
                updated_at = COALESCE((SELECT p.at FROM outbox_publishes p
                    WHERE p.topic = e.topic AND p.event_key = e.event_key AND p.through >= e.id
                    ORDER BY p.through LIMIT 1), now())
            FROM r WHERE e.topic = r.topic AND e.event_key = r.event_key
              AND e.status = 'pending' AND e.id > r.new AND e.id <= r.old),
         dropped AS (
            DELETE FROM outbox_publishes p USING r
            WHERE p.topic = r.topic AND p.event_key = r.event_key AND p.through > r.new
            RETURNING p.topic, p.event_key, p.through, p.at, p.events, r.new),
         kept AS (
            INSERT INTO outbox_publishes (topic, event_key, through, at, events)
            SELECT DISTINCT ON (d.topic, d.event_key) d.topic, d.event_key, d.new, d.at,
                   d.events - (SELECT count(*) FROM outbox_events e
                               WHERE e.topic = d.topic AND e.event_key = d.event_key
                                 AND e.status = 'pending' AND e.id > d.new AND e.id <= d.through)
            FROM dropped d
            ORDER BY d.topic, d.event_key, d.through
            ON CONFLICT DO NOTHING)"
    }

    /// Parameter `n`.
    fn p(&self, n: usize) -> String {
        format!("{}{n}", self.mark)
    }

    /// `id` is one of the ids in parameter `n`.
    fn ids(&self, n: usize) -> String {
        if self.postgres {
            format!("id = ANY(${n})")
        } else {
            format!("id IN (SELECT value FROM json_each(?{n}))")
        }
    }

    /// The statement's clock: `now()`, or the `Now` parameter `n`.
    fn now(&self, n: usize) -> String {
        if self.postgres {
            "now()".into()
        } else {
            self.p(n)
        }
    }

    /// The SQL text of the statements that read the same on both engines but for the
    /// marks, casts and clocks above. `listed` are the columns of a listed event
    /// (`Shared::Events`).
    pub fn shared(&self, stmt: Shared, listed: &str) -> String {
        let (events, rows) = (self.events, self.rows);
        let (t, i8) = (self.text, self.int8);
        let p = |n| self.p(n);
        let filter = self.sub_filter("subscription", &p(1));
        match stmt {
            Shared::AuditOfRequest => format!(
                "SELECT id, count, selection{t} AS selection FROM admin_audit
                 WHERE action = {} AND box = {} AND request_id = {}",
                p(1),
                p(2),
                p(3)
            ),
            Shared::CandidatesById => format!(
                "SELECT {} FROM {rows} WHERE {} ORDER BY id",
                self.candidate_columns(),
                self.ids(1)
            ),
            // A failed row reads failed in the view too (the cursor only completes
            // pending rows): the table itself, through its partial index on failed rows.
            Shared::FailedByFilter => format!(
                "SELECT {} FROM {events} WHERE status = 'failed' AND {} ORDER BY id LIMIT {}",
                self.candidate_columns(),
                self.filter(1),
                p(16)
            ),
            // Completed rows read completed only through the view (the cursor completes
            // pending rows), in id order from the oldest.
            Shared::CompletedByFilter => format!(
                "SELECT {} FROM {rows} WHERE status = 'completed' AND {} ORDER BY id LIMIT {}",
                self.candidate_columns(),
                self.filter(1),
                p(16)
            ),
            Shared::AddRate => format!(
                "INSERT INTO mailroom_rates (box, subscription, minute, n)
                 VALUES ({}, {}, {}, {})
                 ON CONFLICT (box, subscription, minute) DO UPDATE SET n = mailroom_rates.n + excluded.n",
                p(1),
                p(2),
                p(3),
                p(4)
            ),
            Shared::PruneRates => format!("DELETE FROM mailroom_rates WHERE minute < {}", p(1)),
            Shared::Rates => format!(
                "SELECT minute, n FROM mailroom_rates
                 WHERE box = {} AND subscription = {} AND minute >= {} ORDER BY minute",
                p(1),
                p(2),
                p(3)
            ),
            Shared::DeadLetters => format!(
                "SELECT box, event_id, failed_at FROM mailroom_dead_letters
                 ORDER BY failed_at, event_id LIMIT {}",
                p(1)
            ),
            Shared::DropDeadLetter => format!(
                "DELETE FROM mailroom_dead_letters
                 WHERE box = {} AND event_id = {} AND failed_at = {}",
                p(1),
                p(2),
                p(3)
            ),
            Shared::CopySizes => {
                let len = |c: &str| {
                    if self.postgres {
                        format!("octet_length({c})")
                    } else {
                        format!("length(CAST({c} AS BLOB))")
                    }
                };
                format!(
                    "SELECT id, status, ({} + {} + {} + COALESCE({}, 0)){i8} AS size
                     FROM {rows} WHERE {} ORDER BY id",
                    len("payload"),
                    len(if self.postgres {
                        "headers::text"
                    } else {
                        "headers"
                    }),
                    len("topic"),
                    len("event_key"),
                    self.ids(1)
                )
            }
            Shared::Copies => format!(
                "SELECT {} FROM {rows} WHERE {} ORDER BY id",
                self.detail_columns("true", false),
                self.ids(1)
            ),
            Shared::Job(j) => self.job(j),
            Shared::Rewind(r) => self.rewind(r),
            Shared::Requeue => self.requeue(),
            Shared::Cancel => self.cancel(),
            // Failed events from the table through their partial index (the view's
            // computed status has no index); other statuses through the view. The
            // conditions on the parameter alone are one-time filters: only one branch
            // reads rows.
            Shared::Events => self.events_listing(listed),
            Shared::Audit => format!(
                "SELECT id, at, actor, action, box, selection{t} AS selection, count,
                        principal, request_id
                 FROM admin_audit WHERE ({0}{i8} IS NULL OR id < {0}) ORDER BY id DESC LIMIT {1}",
                p(1),
                p(2)
            ),
            // Pending from the per-key counts (keyed) and the unkeyed index, failed
            // through its partial index; completed from the counters of migration 0016
            // where the box has cursors (PostgreSQL's outbox), else by one scan.
            Shared::StatsCounts => self.stats_counts(),
            Shared::StatsUnkeyed => format!(
                "SELECT min(created_at) AS oldest FROM {events}
                 WHERE status = 'pending' AND event_key IS NULL AND {filter}"
            ),
            Shared::Pause => self.pause(),
            Shared::Resume => {
                let (table, name, cols) = self.pauses();
                format!(
                    "DELETE FROM {table} WHERE {name} = {} RETURNING {cols}",
                    p(1)
                )
            }
            Shared::Paused => {
                let (table, name, cols) = self.pauses();
                format!(
                    "SELECT {cols} FROM {table}
                     WHERE {0}{t} IS NULL OR {name} = {0} ORDER BY {name}",
                    p(1)
                )
            }
        }
    }

    /// Failed events back to pending with a fresh budget (`Shared::Requeue`); with
    /// cursors, the keys' cursors are lowered first so the events are claimed again.
    fn requeue(&self) -> String {
        let events = self.events;
        if self.cursor {
            return format!(
                "{} UPDATE {events} SET status = 'pending', attempts = 0, scheduled_at = now(),
                     updated_at = now(), claim_token = NULL, claimed_until = NULL
                 WHERE {} AND status = 'failed'",
                Self::lower_cursors(),
                self.ids(1)
            );
        }
        format!(
            "UPDATE {events} SET status = 'pending', attempts = 0, scheduled_at = {now},
                 updated_at = {now}, claim_token = NULL, claimed_until = NULL
             WHERE {} AND status = 'failed'",
            self.ids(1),
            now = self.now(2)
        )
    }

    /// Pending events to failed with the operator's reason (`Shared::Cancel`).
    fn cancel(&self) -> String {
        let events = self.events;
        format!(
            "UPDATE {events} SET status = 'failed', last_error = 'cancelled: ' || {},
                 updated_at = {}, claim_token = NULL, claimed_until = NULL
             WHERE {} AND status = 'pending'{}",
            self.p(2),
            self.now(3),
            self.ids(1),
            self.above_cursor(events)
        )
    }

    /// The pauses of the box: the outbox's topics (migration 0017) or the inbox's
    /// subscriptions (0022), as (table, name column, the columns `decode_pause` reads).
    fn pauses(&self) -> (&'static str, &'static str, &'static str) {
        if self.inbox {
            (
                "inbox_paused_subscriptions",
                "subscription",
                "subscription AS topic, reason, actor, principal, paused_at",
            )
        } else {
            ("outbox_paused_topics", "topic", PAUSE_COLUMNS)
        }
    }

    /// A topic's (or subscription's) pause; a second pause keeps the first
    /// (`Shared::Pause`).
    fn pause(&self) -> String {
        let (table, name, cols) = self.pauses();
        format!(
            "INSERT INTO {table} ({name}, reason, actor, principal, paused_at)
             VALUES ({}, {}, {}, {}, {}) ON CONFLICT ({name}) DO NOTHING
             RETURNING {cols}",
            self.p(1),
            self.p(2),
            self.p(3),
            self.p(4),
            self.now(5)
        )
    }

    /// Listed events, newest first (`Shared::Events`): failed ones through their partial
    /// index, pending ones on PostgreSQL from the keys with a backlog (`pending_listing`),
    /// the rest by walking ids down.
    fn events_listing(&self, listed: &str) -> String {
        let (events, rows) = (self.events, self.rows);
        let (t, i8) = (self.text, self.int8);
        let p = |n| self.p(n);
        let (a, b, f, l) = (p(1), p(2), self.filter(3), p(18));
        let (pending, walked) = if self.postgres {
            (
                format!(
                    "UNION ALL
                    SELECT * FROM ({}) pending",
                    self.pending_listing(listed)
                ),
                format!("({a}{t} IS NULL OR {a}{t} NOT IN ('failed', 'pending'))"),
            )
        } else {
            (
                String::new(),
                format!("({a}{t} IS NULL OR {a}{t} <> 'failed')"),
            )
        };
        format!(
                "SELECT * FROM (
                    SELECT * FROM (
                        SELECT {listed} FROM {events}
                        WHERE {a}{t} = 'failed' AND status = 'failed'
                          AND ({b}{i8} IS NULL OR id < {b}) AND {f}
                        ORDER BY id DESC LIMIT {l}) failed
                    {pending}
                    UNION ALL
                    SELECT * FROM (
                        SELECT {listed} FROM {rows}
                        WHERE {walked}
                          AND ({a}{t} IS NULL OR status = {a}) AND ({b}{i8} IS NULL OR id < {b}) AND {f}
                        ORDER BY id DESC LIMIT {l}) other) e
                 ORDER BY id DESC LIMIT {l}"
        )
    }

    /// Pending events, newest first, on PostgreSQL (issue 46): walking ids down found
    /// them only past every newer event, a week of history when a few keys are stuck
    /// (about 1 s for 50 rows). Keyed ones are read from the keys with a backlog
    /// (`backlog`, through the `ready_at` index), each key's newest through its line
    /// index, at most a page per key; unkeyed ones through their partial index. On the
    /// outbox a key's pending events are those above its published-through cursor.
    fn pending_listing(&self, listed: &str) -> String {
        let (events, rows, keys) = (self.events, self.rows, self.keys);
        let (t, i8) = (self.text, self.int8);
        let p = |n| self.p(n);
        let (a, b, f, l) = (p(1), p(2), self.filter(3), p(18));
        let same_sub = self.same_sub("e", "k");
        let above_cursor = if self.cursor {
            " AND e.id > k.published_through"
        } else {
            ""
        };
        let backlog = self.backlog("k.");
        // The page's ids are chosen before any row is read through `rows` (on the outbox
        // a view that computes each row's status): reading every candidate through it
        // cost 48 ms for 3,000 of them.
        format!(
            "SELECT {listed} FROM {rows}
             WHERE status = 'pending' AND {f} AND id IN (SELECT id FROM (
                 SELECT e.id FROM {keys} k CROSS JOIN LATERAL (
                     SELECT e.id FROM {events} e
                     WHERE e.topic = k.topic AND e.event_key = k.event_key{same_sub}
                       AND e.status = 'pending'{above_cursor}
                       AND ({b}{i8} IS NULL OR e.id < {b}) AND {f}
                     ORDER BY e.id DESC LIMIT {l}) e
                 WHERE {a}{t} = 'pending' AND {backlog}
                 UNION ALL
                 SELECT id FROM (
                     SELECT id FROM {events}
                     WHERE {a}{t} = 'pending' AND status = 'pending' AND event_key IS NULL
                       AND ({b}{i8} IS NULL OR id < {b}) AND {f}
                     ORDER BY id DESC LIMIT {l}) u
                 ORDER BY id DESC LIMIT {l}) page)
             ORDER BY id DESC LIMIT {l}"
        )
    }

    /// The counts of `Shared::StatsCounts`.
    fn stats_counts(&self) -> String {
        let (events, keys) = (self.events, self.keys);
        let i8 = self.int8;
        let sub = self.sub("subscription");
        let filter = self.sub_filter("subscription", &self.p(1));
        let group_sub = self.group_sub();
        let completed = self.completed_counts();
        let backlog = self.backlog("");
        format!(
            "SELECT {sub} AS subscription, topic, 'pending' AS status, sum(pending){i8} AS n
                 FROM {keys} WHERE {backlog} AND {filter} GROUP BY {group_sub}topic
                 UNION ALL
                 SELECT {sub}, topic, 'pending', count(*) FROM {events}
                 WHERE status = 'pending' AND event_key IS NULL AND {filter}
                 GROUP BY {group_sub}topic
                 UNION ALL
                 SELECT {sub}, topic, 'failed', count(*) FROM {events}
                 WHERE status = 'failed' AND {filter}
                 GROUP BY {group_sub}topic
                 UNION ALL
                 {completed}"
        )
    }

    /// Completed events per topic: from the counters of migration 0016 where the box
    /// has cursors, else by one scan.
    fn completed_counts(&self) -> String {
        let (events, t, i8) = (self.events, self.text, self.int8);
        let sub = self.sub("subscription");
        let filter = self.sub_filter("subscription", &self.p(1));
        let group_sub = self.group_sub();
        if self.cursor {
            format!(
                "SELECT ''{t}, topic, 'completed', sum(n){i8} FROM outbox_completed_counts
                 WHERE {filter} GROUP BY topic HAVING sum(n) <> 0"
            )
        } else {
            format!(
                "SELECT {sub}, topic, 'completed', count(*) FROM {events}
                 WHERE status = 'completed' AND {filter} GROUP BY {group_sub}topic"
            )
        }
    }
}

//! The admin statements on PostgreSQL: their SQL text, and how a statement binds the
//! flows' parameters and runs; the flows themselves (requeue, cancel, paging, decoding)
//! are `store::admin_flow`'s.
//!
//! ListPending reads the per-key `pending` counts that triggers keep on `outbox_keys`
//! (migration 0002) and probes each listed key's head through `outbox_events_line`, so
//! its cost follows the number of keys with a backlog, not the number of pending events
//! (see docs/admin.md for the plan and timings). Requeue and cancel lock the affected key
//! rows first, in sorted order, like enqueue and settle do, then change the events.
//!
//! The same statements serve the inbox: its key rows and lines carry the subscription
//! (`Shape` adds it to joins, groups, filters and the lock order); for the outbox the
//! subscription is the constant `''`, so the outbox's plans are unchanged.

use chrono::DateTime;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use super::PgStore;
use crate::domain::BoxKind;
use crate::domain::admin::PendingOrder;
use crate::store::StoreResult;
use crate::store::admin_sql::{AdminSql, Param, Read, Stmt};
use crate::store::shape::Shape;

/// The backlog statement for `order`.
fn pending_sql(sh: &Shape, order: PendingOrder) -> String {
    let (events, keys) = (sh.events, sh.keys);
    let order = Shape::pending_order(order);
    let backlog = sh.backlog("k.");
    let (k_sub, same_sub, k_filter, sub, filter, group_sub) = sh.backlog_parts("$9");
    format!(
        "WITH h AS MATERIALIZED (
            SELECT {k_sub} AS subscription, k.topic, k.event_key AS key, k.pending,
                   e.id AS head_id, e.created_at, e.attempts, e.scheduled_at, e.last_error,
                   ((e.attempts > 0 OR e.last_error IS NOT NULL) AND e.scheduled_at > now()) AS blocked
            FROM {keys} k
            CROSS JOIN LATERAL (
                SELECT id, created_at, attempts, scheduled_at, last_error FROM {events} e
                WHERE e.status = 'pending'{same_sub} AND e.topic = k.topic
                  AND e.event_key = k.event_key AND e.id > k.published_through
                ORDER BY e.id LIMIT 1) e
            WHERE {backlog} AND {k_filter}
              AND ($1::text IS NULL OR k.topic = $1)
              AND ($2::text IS NULL OR starts_with(k.event_key, $2))
            UNION ALL
            SELECT u.subscription, u.topic, ''::text, u.pending, e.id, e.created_at,
                   e.attempts, e.scheduled_at, e.last_error,
                   ((e.attempts > 0 OR e.last_error IS NOT NULL) AND e.scheduled_at > now())
            FROM (SELECT {sub} AS subscription, topic, count(*) AS pending,
                         min(id) AS head_id FROM {events}
                  WHERE status = 'pending' AND event_key IS NULL AND $2::text IS NULL
                    AND ($1::text IS NULL OR topic = $1) AND {filter}
                  GROUP BY {group_sub}topic) u
            JOIN {events} e ON e.id = u.head_id
        ), t AS (
            SELECT count(*) AS total_keys, coalesce(sum(pending), 0)::int8 AS total_pending,
                   count(*) FILTER (WHERE blocked) AS total_blocked FROM h
        )
        SELECT p.*, t.total_keys, t.total_pending, t.total_blocked FROM t
        LEFT JOIN LATERAL (
            SELECT * FROM h
            WHERE (NOT $3 OR blocked)
              AND ($4::int8 IS NULL OR pending < $4
                   OR (pending = $4
                       AND (subscription, topic, key) > ($10::text, $6::text, $7::text)))
              AND ($5::timestamptz IS NULL
                   OR (created_at, subscription, topic, key)
                      > ($5, $10::text, $6::text, $7::text))
            ORDER BY {order} LIMIT $8) p ON true"
    )
}

/// The statement `stmt` of box `b`, with mailroom's names unqualified (`PgStore::built`
/// qualifies them).
fn admin_sql(b: BoxKind, stmt: Stmt) -> String {
    let sh = Shape::postgres(b);

    let (events, keys) = (sh.events, sh.keys);
    match stmt {
            Stmt::Shared(shared) => sh.shared(shared, &sh.detail_columns("false", false)),
            Stmt::InsertAudit => "INSERT INTO admin_audit
                     (actor, action, box, selection, count, principal, request_id)
                 VALUES ($1, $2, $3, $4::text::jsonb, $5, $6, $7) RETURNING id"
                .into(),
            Stmt::Pending(order) => pending_sql(&sh, order),
            Stmt::Detail => format!(
                "SELECT {} FROM {} WHERE id = $1",
                sh.detail_columns("$2", true),
                sh.rows
            ),
            Stmt::StatsHeads => format!(
                "SELECT count(*) FILTER (WHERE (h.attempts > 0 OR h.last_error IS NOT NULL) AND h.scheduled_at > now()) AS blocked,
                    min(h.created_at) AS oldest, now() AS now
             FROM {keys} k CROSS JOIN LATERAL (
                SELECT attempts, scheduled_at, created_at, last_error FROM {events} e
                WHERE e.status = 'pending'{same_sub} AND e.topic = k.topic
                  AND e.event_key = k.event_key AND e.id > k.published_through
                ORDER BY e.id LIMIT 1) h
             WHERE {backlog} AND {k_filter}",
            same_sub = sh.same_sub("e", "k"),
            k_filter = sh.sub_filter("k.subscription", "$1"),
            backlog = sh.backlog("k."),
            ),
            Stmt::WakeReleased => format!(
                "UPDATE {keys} SET ready_at = CASE
                     WHEN pending > 0 AND (lease_until IS NULL OR lease_until <= now())
                     THEN LEAST(ready_at, now()) ELSE ready_at END
                 WHERE topic = $1 AND event_key = $2 AND {}
                 RETURNING COALESCE(lease_until > now(), false) AS leased",
                if sh.inbox {
                    "subscription = $3"
                } else {
                    "$3::text IS NULL"
                }
            ),
        }
}

type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// Binds the flows' parameters: times as `timestamptz`, id lists as `int8[]`; `Now` is
/// the statement's own `now()`.
fn bind<'q>(sql: &'q str, params: &[Param<'q>]) -> PgQuery<'q> {
    let mut q = sqlx::query(AssertSqlSafe(sql));
    for p in params {
        q = match *p {
            Param::Int(v) => q.bind(v),
            Param::Text(v) => q.bind(v),
            Param::Flag(v) => q.bind(v),
            Param::Time(v) => q.bind(v),
            Param::Micros(v) => q.bind(v.and_then(DateTime::from_timestamp_micros)),
            Param::Ids(v) => q.bind(v),
            Param::Headers(h) => q.bind(crate::store::admin_sql::headers_param(h)),
            Param::Now => q,
        };
    }
    q
}

#[async_trait::async_trait]
impl AdminSql for PgStore {
    type Row = PgRow;
    type Tx = Transaction<'static, Postgres>;

    fn sql(&self, b: BoxKind, stmt: Stmt) -> String {
        self.built(&admin_sql(b, stmt))
    }

    async fn begin(&self) -> StoreResult<Self::Tx> {
        Ok(self.admin_pool().begin().await?)
    }

    async fn commit(&self, tx: Self::Tx) -> StoreResult<()> {
        Ok(tx.commit().await?)
    }

    async fn rollback(&self, tx: Self::Tx) -> StoreResult<()> {
        Ok(tx.rollback().await?)
    }

    async fn rows_in(
        &self,
        tx: &mut Self::Tx,
        sql: &str,
        params: &[Param<'_>],
    ) -> StoreResult<Vec<PgRow>> {
        Ok(bind(sql, params).fetch_all(&mut **tx).await?)
    }

    async fn execute_in(
        &self,
        tx: &mut Self::Tx,
        sql: &str,
        params: &[Param<'_>],
    ) -> StoreResult<u64> {
        Ok(bind(sql, params).execute(&mut **tx).await?.rows_affected())
    }

    async fn read(
        &self,
        how: Read,
        batch: &[(String, &[Param<'_>])],
    ) -> StoreResult<Vec<Vec<PgRow>>> {
        let mut out = Vec::with_capacity(batch.len());
        if how == Read::Plain {
            for (sql, params) in batch {
                out.push(bind(sql, params).fetch_all(self.admin_pool()).await?);
            }
            return Ok(out);
        }
        let mut tx = self.admin_pool().begin().await?;
        // The queries are short and their plans simple: JIT would cost more than it saves.
        sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
        for (sql, params) in batch {
            out.push(bind(sql, params).fetch_all(&mut *tx).await?);
        }
        tx.commit().await?;
        Ok(out)
    }

    /// One statement for all keys, locking them in the order given (`ORDER BY o`), as
    /// enqueue and receive take them.
    async fn wake_keys(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        keys: &[(&str, &str, &str)],
    ) -> StoreResult<Vec<(String, String, String)>> {
        let subs: Vec<&str> = keys.iter().map(|k| k.0).collect();
        let topics: Vec<&str> = keys.iter().map(|k| k.1).collect();
        let names: Vec<&str> = keys.iter().map(|k| k.2).collect();
        let rows = match b {
            BoxKind::Outbox => sqlx::query_as(AssertSqlSafe(self.text(
                "INSERT INTO outbox_keys (topic, event_key, ready_at)
                 SELECT t, k, now() FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(t, k, o)
                 ORDER BY o
                 ON CONFLICT (topic, event_key)
                 DO UPDATE SET ready_at = LEAST(outbox_keys.ready_at, now())
                 RETURNING ''::text AS subscription, topic, event_key,
                           COALESCE(lease_until > now(), false) AS leased",
            ))),
            BoxKind::Inbox => sqlx::query_as(AssertSqlSafe(self.text(
                "INSERT INTO inbox_keys (subscription, topic, event_key, ready_at)
                 SELECT s, t, k, now()
                 FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(s, t, k, o)
                 ORDER BY o
                 ON CONFLICT (subscription, topic, event_key)
                 DO UPDATE SET ready_at = LEAST(inbox_keys.ready_at, now())
                 RETURNING subscription, topic, event_key,
                           COALESCE(lease_until > now(), false) AS leased",
            )))
            .bind(&subs),
        };
        let rows: Vec<(String, String, String, bool)> =
            rows.bind(&topics).bind(&names).fetch_all(&mut **tx).await?;
        Ok(rows
            .into_iter()
            .filter(|r| r.3)
            .map(|(s, t, k, _)| (s, t, k))
            .collect())
    }
}

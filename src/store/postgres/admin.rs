//! The operator statements on PostgreSQL: SQL text and binding only; the flows that run
//! them (requeue, cancel, paging, decoding) are `store::admin_flow`'s.
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
use crate::domain::admin::{AdminKey, EventFilter, EventsQuery, PendingOrder, PendingQuery};
use crate::domain::{BoxKind, EventId, Status};
use crate::store::StoreResult;
use crate::store::admin_flow::{AdminSql, NewAudit, StatsRows};
use crate::store::shape::Shape;

/// Event columns for `decode_event`, with the payload only when `$n` is true.
fn detail_columns(shape: &Shape, with_payload: &str) -> String {
    let (sub, mid) = if shape.inbox {
        ("subscription", "message_id")
    } else {
        ("NULL::text", "NULL::text")
    };
    format!(
        "id, topic, event_key, CASE WHEN {with_payload} THEN payload ELSE ''::bytea END AS payload,
         headers::text AS headers, event_type, idempotency_key, status, attempts, max_attempts,
         scheduled_at, created_at, updated_at, published_at, last_error,
         octet_length(payload)::int8 AS payload_size, {sub} AS subscription,
         {mid} AS message_id"
    )
}

/// The filter as SQL conditions over `$first..$first+6` (the subscription last).
fn filter_sql(shape: &Shape, first: usize) -> String {
    let p = |i: usize| format!("${}", first + i);
    format!(
        "({0}::text IS NULL OR topic = {0}) AND ({1}::text IS NULL OR event_key = {1})
         AND ({2}::text IS NULL OR event_type = {2})
         AND ({3}::timestamptz IS NULL OR updated_at >= {3})
         AND ({4}::timestamptz IS NULL OR updated_at < {4})
         AND ({5}::text IS NULL OR strpos(last_error, {5}) > 0)
         AND {6}",
        p(0),
        p(1),
        p(2),
        p(3),
        p(4),
        p(5),
        shape.sub_filter("subscription", &p(6))
    )
}

type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

fn bind_filter<'q>(q: PgQuery<'q>, f: &'q EventFilter) -> PgQuery<'q> {
    q.bind(f.topic.as_deref())
        .bind(f.key.as_deref())
        .bind(f.event_type.as_deref())
        .bind(f.updated_after)
        .bind(f.updated_before)
        .bind(f.error_contains.as_deref())
        .bind(f.subscription.as_deref())
}

/// The columns the flows read of a candidate for requeue or cancel.
fn candidate_columns(shape: &Shape) -> String {
    format!(
        "id, {} AS subscription, topic, event_key, status",
        shape.sub("subscription")
    )
}

#[async_trait::async_trait]
impl AdminSql for PgStore {
    type Row = PgRow;
    type Tx = Transaction<'static, Postgres>;

    async fn begin(&self) -> StoreResult<Self::Tx> {
        Ok(self.admin_pool().begin().await?)
    }

    async fn commit(&self, tx: Self::Tx) -> StoreResult<()> {
        Ok(tx.commit().await?)
    }

    async fn rollback(&self, tx: Self::Tx) -> StoreResult<()> {
        Ok(tx.rollback().await?)
    }

    async fn audit_of_request(
        &self,
        tx: &mut Self::Tx,
        action: &str,
        b: BoxKind,
        request_id: &str,
    ) -> StoreResult<Option<PgRow>> {
        Ok(sqlx::query(
            "SELECT id, count, selection::text AS selection FROM admin_audit
             WHERE action = $1 AND box = $2 AND request_id = $3",
        )
        .bind(action)
        .bind(b.as_str())
        .bind(request_id)
        .fetch_optional(&mut **tx)
        .await?)
    }

    async fn candidates_by_id(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        ids: &[EventId],
    ) -> StoreResult<Vec<PgRow>> {
        let sh = Shape::postgres(b);
        Ok(sqlx::query(AssertSqlSafe(format!(
            "SELECT {} FROM {} WHERE id = ANY($1) ORDER BY id",
            candidate_columns(&sh),
            sh.events
        )))
        .bind(ids)
        .fetch_all(&mut **tx)
        .await?)
    }

    async fn failed_by_filter(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        f: &EventFilter,
        limit: u32,
    ) -> StoreResult<Vec<PgRow>> {
        let sh = Shape::postgres(b);
        let sql = format!(
            "SELECT {} FROM {} WHERE status = 'failed' AND {} ORDER BY id LIMIT $8",
            candidate_columns(&sh),
            sh.events,
            filter_sql(&sh, 1)
        );
        Ok(bind_filter(sqlx::query(AssertSqlSafe(sql)), f)
            .bind(i64::from(limit))
            .fetch_all(&mut **tx)
            .await?)
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
            BoxKind::Outbox => sqlx::query_as(
                "INSERT INTO outbox_keys (topic, event_key, ready_at)
                 SELECT t, k, now() FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(t, k, o)
                 ORDER BY o
                 ON CONFLICT (topic, event_key)
                 DO UPDATE SET ready_at = LEAST(outbox_keys.ready_at, now())
                 RETURNING ''::text AS subscription, topic, event_key,
                           COALESCE(lease_until > now(), false) AS leased",
            ),
            BoxKind::Inbox => sqlx::query_as(
                "INSERT INTO inbox_keys (subscription, topic, event_key, ready_at)
                 SELECT s, t, k, now()
                 FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS u(s, t, k, o)
                 ORDER BY o
                 ON CONFLICT (subscription, topic, event_key)
                 DO UPDATE SET ready_at = LEAST(inbox_keys.ready_at, now())
                 RETURNING subscription, topic, event_key,
                           COALESCE(lease_until > now(), false) AS leased",
            )
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

    async fn set_requeued(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        ids: &[EventId],
    ) -> StoreResult<u64> {
        let events = Shape::postgres(b).events;
        Ok(sqlx::query(AssertSqlSafe(format!(
            "UPDATE {events} SET status = 'pending', attempts = 0, scheduled_at = now(),
                 updated_at = now(), claim_token = NULL, claimed_until = NULL
             WHERE id = ANY($1) AND status = 'failed'"
        )))
        .bind(ids)
        .execute(&mut **tx)
        .await?
        .rows_affected())
    }

    async fn set_cancelled(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        ids: &[EventId],
        reason: &str,
    ) -> StoreResult<u64> {
        let events = Shape::postgres(b).events;
        Ok(sqlx::query(AssertSqlSafe(format!(
            "UPDATE {events} SET status = 'failed', last_error = 'cancelled: ' || $2,
                 updated_at = now(), claim_token = NULL, claimed_until = NULL
             WHERE id = ANY($1) AND status = 'pending'"
        )))
        .bind(ids)
        .bind(reason)
        .execute(&mut **tx)
        .await?
        .rows_affected())
    }

    async fn insert_audit(&self, tx: &mut Self::Tx, a: &NewAudit<'_>) -> StoreResult<i64> {
        Ok(sqlx::query_scalar(
            "INSERT INTO admin_audit (actor, action, box, selection, count, principal, request_id)
             VALUES ($1, $2, $3, $4::text::jsonb, $5, $6, $7) RETURNING id",
        )
        .bind(a.actor)
        .bind(a.action)
        .bind(a.box_kind.as_str())
        .bind(a.selection.to_string())
        .bind(a.count)
        .bind(a.principal)
        .bind(a.request_id)
        .fetch_one(&mut **tx)
        .await?)
    }

    async fn pending_rows(&self, b: BoxKind, q: &PendingQuery) -> StoreResult<Vec<PgRow>> {
        let sh = Shape::postgres(b);
        let (events, keys) = (sh.events, sh.keys);
        let order = match q.order {
            PendingOrder::MostPending => "pending DESC, subscription, topic, key",
            PendingOrder::Oldest => "created_at, subscription, topic, key",
        };
        let sql = format!(
            "WITH h AS MATERIALIZED (
                SELECT {k_sub} AS subscription, k.topic, k.event_key AS key, k.pending,
                       e.id AS head_id, e.created_at, e.attempts, e.scheduled_at, e.last_error,
                       ((e.attempts > 0 OR e.last_error IS NOT NULL) AND e.scheduled_at > now()) AS blocked
                FROM {keys} k
                CROSS JOIN LATERAL (
                    SELECT id, created_at, attempts, scheduled_at, last_error FROM {events} e
                    WHERE e.status = 'pending'{same_sub} AND e.topic = k.topic
                      AND e.event_key = k.event_key
                    ORDER BY e.id LIMIT 1) e
                WHERE k.pending > 0 AND {k_filter}
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
                ORDER BY {order} LIMIT $8) p ON true",
            k_sub = sh.sub("k.subscription"),
            same_sub = sh.same_sub("e", "k"),
            k_filter = sh.sub_filter("k.subscription", "$9"),
            sub = sh.sub("subscription"),
            filter = sh.sub_filter("subscription", "$9"),
            group_sub = sh.group_sub(),
        );
        let c = q.after.as_ref();
        let after_pending = c.filter(|c| c.order == PendingOrder::MostPending);
        let after_oldest = c.filter(|c| c.order == PendingOrder::Oldest);
        let mut tx = self.admin_pool().begin().await?;
        // The query is short and its plan simple: JIT would cost more than it saves.
        sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(q.topic.as_deref())
            .bind(q.key_prefix.as_deref())
            .bind(q.only_blocked)
            .bind(after_pending.map(|c| c.pending))
            .bind(after_oldest.map(|c| DateTime::from_timestamp_micros(c.oldest_us)))
            .bind(c.map(|c| c.topic.as_str()))
            .bind(c.map(|c| c.key.as_str()))
            .bind(i64::from(q.page_size) + 1)
            .bind(q.subscription.as_deref())
            .bind(c.map(|c| c.subscription.as_str()))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(rows)
    }

    async fn detail_row(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> StoreResult<Option<PgRow>> {
        let sh = Shape::postgres(b);
        Ok(sqlx::query(AssertSqlSafe(format!(
            "SELECT {} FROM {} WHERE id = $1",
            detail_columns(&sh, "$2"),
            sh.events
        )))
        .bind(id)
        .bind(with_payload)
        .fetch_optional(self.admin_pool())
        .await?)
    }

    async fn event_rows(&self, b: BoxKind, q: &EventsQuery) -> StoreResult<Vec<PgRow>> {
        let sh = Shape::postgres(b);
        let sql = format!(
            "SELECT {} FROM {}
             WHERE ($1::text IS NULL OR status = $1) AND ($2::int8 IS NULL OR id < $2) AND {}
             ORDER BY id DESC LIMIT $10",
            detail_columns(&sh, "false"),
            sh.events,
            filter_sql(&sh, 3)
        );
        let q2 = sqlx::query(AssertSqlSafe(sql))
            .bind(q.status.map(Status::as_str))
            .bind(q.before_id);
        Ok(bind_filter(q2, &q.filter)
            .bind(i64::from(q.page_size) + 1)
            .fetch_all(self.admin_pool())
            .await?)
    }

    async fn audit_rows(&self, limit: i64, before_id: Option<i64>) -> StoreResult<Vec<PgRow>> {
        Ok(sqlx::query(
            "SELECT id, at, actor, action, box, selection::text AS selection, count,
                    principal, request_id
             FROM admin_audit WHERE ($1::int8 IS NULL OR id < $1) ORDER BY id DESC LIMIT $2",
        )
        .bind(before_id)
        .bind(limit)
        .fetch_all(self.admin_pool())
        .await?)
    }

    async fn stats_rows(
        &self,
        b: BoxKind,
        subscription: Option<&str>,
    ) -> StoreResult<StatsRows<PgRow>> {
        let sh = Shape::postgres(b);
        let (events, keys) = (sh.events, sh.keys);
        let sub = sh.sub("subscription");
        let filter = sh.sub_filter("subscription", "$1");
        let group_sub = sh.group_sub();
        let mut tx = self.admin_pool().begin().await?;
        sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
        // Pending from the per-key counts (keyed) and the unkeyed index; the other
        // statuses by one scan.
        let counts = sqlx::query(AssertSqlSafe(format!(
            "SELECT {sub} AS subscription, topic, 'pending' AS status, sum(pending)::int8 AS n
             FROM {keys} WHERE pending > 0 AND {filter} GROUP BY {group_sub}topic
             UNION ALL
             SELECT {sub}, topic, 'pending', count(*) FROM {events}
             WHERE status = 'pending' AND event_key IS NULL AND {filter}
             GROUP BY {group_sub}topic
             UNION ALL
             SELECT {sub}, topic, status, count(*) FROM {events}
             WHERE status <> 'pending' AND {filter}
             GROUP BY {group_sub}topic, status"
        )))
        .bind(subscription)
        .fetch_all(&mut *tx)
        .await?;
        let heads = sqlx::query(AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE (h.attempts > 0 OR h.last_error IS NOT NULL) AND h.scheduled_at > now()) AS blocked,
                    min(h.created_at) AS oldest, now() AS now
             FROM {keys} k CROSS JOIN LATERAL (
                SELECT attempts, scheduled_at, created_at, last_error FROM {events} e
                WHERE e.status = 'pending'{same_sub} AND e.topic = k.topic
                  AND e.event_key = k.event_key
                ORDER BY e.id LIMIT 1) h
             WHERE k.pending > 0 AND {k_filter}",
            same_sub = sh.same_sub("e", "k"),
            k_filter = sh.sub_filter("k.subscription", "$1"),
        )))
        .bind(subscription)
        .fetch_one(&mut *tx)
        .await?;
        let unkeyed = sqlx::query(AssertSqlSafe(format!(
            "SELECT min(created_at) AS oldest FROM {events}
             WHERE status = 'pending' AND event_key IS NULL AND {filter}"
        )))
        .bind(subscription)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(StatsRows {
            counts,
            heads,
            unkeyed,
        })
    }

    async fn wake_released_key(&self, b: BoxKind, k: &AdminKey) -> StoreResult<Option<bool>> {
        let sh = Shape::postgres(b);
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "UPDATE {} SET ready_at = CASE
                 WHEN pending > 0 AND (lease_until IS NULL OR lease_until <= now())
                 THEN LEAST(ready_at, now()) ELSE ready_at END
             WHERE topic = $1 AND event_key = $2 AND {}
             RETURNING COALESCE(lease_until > now(), false)",
            sh.keys,
            if sh.inbox {
                "subscription = $3"
            } else {
                "$3::text IS NULL"
            }
        )))
        .bind(&k.topic)
        .bind(&k.key)
        .bind(k.subscription.as_deref())
        .fetch_optional(self.admin_pool())
        .await?)
    }
}

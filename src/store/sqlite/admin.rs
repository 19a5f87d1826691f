//! The operator statements on SQLite: SQL text and binding only, the flows are
//! `store::admin_flow`'s. Writes run in
//! `BEGIN IMMEDIATE` transactions (one writer), so lock order is moot; id lists travel as
//! JSON arrays (`json_each`), times as microseconds since the epoch. The inbox's
//! subscription dimension is added by `Shape`, as on PostgreSQL.

use chrono::Utc;
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Sqlite, Transaction};

use super::{SqliteStore, micros};
use crate::domain::admin::{AdminKey, EventFilter, EventsQuery, PendingOrder, PendingQuery};
use crate::domain::{BoxKind, EventId, Status};
use crate::store::StoreResult;
use crate::store::admin_flow::{AdminSql, NewAudit, StatsRows};
use crate::store::shape::Shape;

/// A write transaction and its clock: every time it writes is this one.
pub(crate) struct LiteTx {
    tx: Transaction<'static, Sqlite>,
    now: i64,
}

fn detail_columns(shape: &Shape, with_payload: &str) -> String {
    let (sub, mid) = if shape.inbox {
        ("subscription", "message_id")
    } else {
        ("NULL", "NULL")
    };
    format!(
        "id, topic, event_key, CASE WHEN {with_payload} THEN payload ELSE x'' END AS payload,
         headers, event_type, idempotency_key, status, attempts, max_attempts, scheduled_at,
         created_at, updated_at, published_at, last_error, length(payload) AS payload_size,
         {sub} AS subscription, {mid} AS message_id"
    )
}

/// The filter as SQL conditions over `?first..?first+6` (the subscription last).
fn filter_sql(shape: &Shape, first: usize) -> String {
    let p = |i: usize| format!("?{}", first + i);
    format!(
        "({0} IS NULL OR topic = {0}) AND ({1} IS NULL OR event_key = {1})
         AND ({2} IS NULL OR event_type = {2})
         AND ({3} IS NULL OR updated_at >= {3}) AND ({4} IS NULL OR updated_at < {4})
         AND ({5} IS NULL OR instr(last_error, {5}) > 0) AND {6}",
        p(0),
        p(1),
        p(2),
        p(3),
        p(4),
        p(5),
        shape.sub_filter("subscription", &p(6))
    )
}

type LiteQuery<'q> = sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments>;

fn bind_filter<'q>(q: LiteQuery<'q>, f: &'q EventFilter) -> LiteQuery<'q> {
    q.bind(f.topic.as_deref())
        .bind(f.key.as_deref())
        .bind(f.event_type.as_deref())
        .bind(f.updated_after.map(micros))
        .bind(f.updated_before.map(micros))
        .bind(f.error_contains.as_deref())
        .bind(f.subscription.as_deref())
}

fn json_ids(ids: &[EventId]) -> String {
    serde_json::to_string(ids).expect("ids serialize")
}

/// The columns the flows read of a candidate for requeue or cancel.
fn candidate_columns(shape: &Shape) -> String {
    format!(
        "id, {} AS subscription, topic, event_key, status",
        shape.sub("subscription")
    )
}

#[async_trait::async_trait]
impl AdminSql for SqliteStore {
    type Row = SqliteRow;
    type Tx = LiteTx;

    async fn begin(&self) -> StoreResult<LiteTx> {
        let now = micros(Utc::now());
        let tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
        Ok(LiteTx { tx, now })
    }

    async fn commit(&self, tx: LiteTx) -> StoreResult<()> {
        Ok(tx.tx.commit().await?)
    }

    async fn rollback(&self, tx: LiteTx) -> StoreResult<()> {
        Ok(tx.tx.rollback().await?)
    }

    async fn audit_of_request(
        &self,
        tx: &mut LiteTx,
        action: &str,
        b: BoxKind,
        request_id: &str,
    ) -> StoreResult<Option<SqliteRow>> {
        Ok(sqlx::query(
            "SELECT id, count, selection FROM admin_audit
             WHERE action = ?1 AND box = ?2 AND request_id = ?3",
        )
        .bind(action)
        .bind(b.as_str())
        .bind(request_id)
        .fetch_optional(&mut *tx.tx)
        .await?)
    }

    async fn candidates_by_id(
        &self,
        tx: &mut LiteTx,
        b: BoxKind,
        ids: &[EventId],
    ) -> StoreResult<Vec<SqliteRow>> {
        let sh = Shape::sqlite(b);
        Ok(sqlx::query(AssertSqlSafe(format!(
            "SELECT {} FROM {} WHERE id IN (SELECT value FROM json_each(?1)) ORDER BY id",
            candidate_columns(&sh),
            sh.events
        )))
        .bind(json_ids(ids))
        .fetch_all(&mut *tx.tx)
        .await?)
    }

    async fn failed_by_filter(
        &self,
        tx: &mut LiteTx,
        b: BoxKind,
        f: &EventFilter,
        limit: u32,
    ) -> StoreResult<Vec<SqliteRow>> {
        let sh = Shape::sqlite(b);
        let sql = format!(
            "SELECT {} FROM {} WHERE status = 'failed' AND {} ORDER BY id LIMIT ?8",
            candidate_columns(&sh),
            sh.events,
            filter_sql(&sh, 1)
        );
        Ok(bind_filter(sqlx::query(AssertSqlSafe(sql)), f)
            .bind(i64::from(limit))
            .fetch_all(&mut *tx.tx)
            .await?)
    }

    /// One statement per key (one writer: the order is moot, but kept).
    async fn wake_keys(
        &self,
        tx: &mut LiteTx,
        b: BoxKind,
        keys: &[(&str, &str, &str)],
    ) -> StoreResult<Vec<(String, String, String)>> {
        let sql = match b {
            BoxKind::Outbox => {
                "INSERT INTO outbox_keys (topic, event_key, ready_at) VALUES (?1, ?2, ?3)
                 ON CONFLICT (topic, event_key) DO UPDATE SET ready_at = MIN(ready_at, excluded.ready_at)
                 RETURNING (lease_until IS NOT NULL AND lease_until > ?3)"
            }
            BoxKind::Inbox => {
                "INSERT INTO inbox_keys (subscription, topic, event_key, ready_at)
                 VALUES (?4, ?1, ?2, ?3)
                 ON CONFLICT (subscription, topic, event_key)
                 DO UPDATE SET ready_at = MIN(ready_at, excluded.ready_at)
                 RETURNING (lease_until IS NOT NULL AND lease_until > ?3)"
            }
        };
        let mut leased = Vec::new();
        for &(sub, topic, key) in keys {
            let mut q = sqlx::query_scalar(sql).bind(topic).bind(key).bind(tx.now);
            if b == BoxKind::Inbox {
                q = q.bind(sub);
            }
            let held: bool = q.fetch_one(&mut *tx.tx).await?;
            if held {
                leased.push((sub.to_string(), topic.to_string(), key.to_string()));
            }
        }
        Ok(leased)
    }

    async fn set_requeued(&self, tx: &mut LiteTx, b: BoxKind, ids: &[EventId]) -> StoreResult<u64> {
        let events = Shape::sqlite(b).events;
        Ok(sqlx::query(AssertSqlSafe(format!(
            "UPDATE {events} SET status = 'pending', attempts = 0, scheduled_at = ?2,
                 updated_at = ?2, claim_token = NULL, claimed_until = NULL
             WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'failed'"
        )))
        .bind(json_ids(ids))
        .bind(tx.now)
        .execute(&mut *tx.tx)
        .await?
        .rows_affected())
    }

    async fn set_cancelled(
        &self,
        tx: &mut LiteTx,
        b: BoxKind,
        ids: &[EventId],
        reason: &str,
    ) -> StoreResult<u64> {
        let events = Shape::sqlite(b).events;
        Ok(sqlx::query(AssertSqlSafe(format!(
            "UPDATE {events} SET status = 'failed', last_error = 'cancelled: ' || ?2,
                 updated_at = ?3, claim_token = NULL, claimed_until = NULL
             WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'pending'"
        )))
        .bind(json_ids(ids))
        .bind(reason)
        .bind(tx.now)
        .execute(&mut *tx.tx)
        .await?
        .rows_affected())
    }

    async fn insert_audit(&self, tx: &mut LiteTx, a: &NewAudit<'_>) -> StoreResult<i64> {
        Ok(sqlx::query_scalar(
            "INSERT INTO admin_audit (at, actor, action, box, selection, count, principal, request_id)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) RETURNING id",
        )
        .bind(tx.now)
        .bind(a.actor)
        .bind(a.action)
        .bind(a.box_kind.as_str())
        .bind(a.selection.to_string())
        .bind(a.count)
        .bind(a.principal)
        .bind(a.request_id)
        .fetch_one(&mut *tx.tx)
        .await?)
    }

    async fn pending_rows(&self, b: BoxKind, q: &PendingQuery) -> StoreResult<Vec<SqliteRow>> {
        let sh = Shape::sqlite(b);
        let (events, keys) = (sh.events, sh.keys);
        let order = match q.order {
            PendingOrder::MostPending => "pending DESC, subscription, topic, key",
            PendingOrder::Oldest => "created_at, subscription, topic, key",
        };
        let sql = format!(
            "WITH heads AS (
                SELECT {k_sub} AS subscription, k.topic, k.event_key AS key, k.pending,
                       (SELECT id FROM {events} e WHERE e.status = 'pending'{same_sub}
                          AND e.topic = k.topic AND e.event_key = k.event_key
                        ORDER BY e.id LIMIT 1) AS head_id
                FROM {keys} k
                WHERE k.pending > 0 AND {k_filter} AND (?1 IS NULL OR k.topic = ?1)
                  AND (?2 IS NULL OR substr(k.event_key, 1, length(?2)) = ?2)
                UNION ALL
                SELECT {sub}, topic, '', count(*), min(id) FROM {events}
                WHERE status = 'pending' AND event_key IS NULL AND ?2 IS NULL
                  AND (?1 IS NULL OR topic = ?1) AND {filter}
                GROUP BY {group_sub}topic
            ), h AS (
                SELECT heads.subscription, heads.topic, heads.key, heads.pending,
                       e.id AS head_id, e.created_at,
                       e.attempts, e.scheduled_at, e.last_error,
                       ((e.attempts > 0 OR e.last_error IS NOT NULL) AND e.scheduled_at > ?9) AS blocked
                FROM heads JOIN {events} e ON e.id = heads.head_id
            ), t AS (
                SELECT count(*) AS total_keys, coalesce(sum(pending), 0) AS total_pending,
                       coalesce(sum(blocked), 0) AS total_blocked FROM h
            )
            SELECT p.*, t.total_keys, t.total_pending, t.total_blocked FROM t
            LEFT JOIN (
                SELECT * FROM h
                WHERE (NOT ?3 OR blocked)
                  AND (?4 IS NULL OR pending < ?4
                       OR (pending = ?4 AND (subscription, topic, key) > (?11, ?6, ?7)))
                  AND (?5 IS NULL OR (created_at, subscription, topic, key) > (?5, ?11, ?6, ?7))
                ORDER BY {order} LIMIT ?8) p ON 1",
            k_sub = sh.sub("k.subscription"),
            same_sub = sh.same_sub("e", "k"),
            k_filter = sh.sub_filter("k.subscription", "?10"),
            sub = sh.sub("subscription"),
            filter = sh.sub_filter("subscription", "?10"),
            group_sub = sh.group_sub(),
        );
        let c = q.after.as_ref();
        let rows = sqlx::query(AssertSqlSafe(sql))
            .bind(q.topic.as_deref())
            .bind(q.key_prefix.as_deref())
            .bind(q.only_blocked)
            .bind(
                c.filter(|c| c.order == PendingOrder::MostPending)
                    .map(|c| c.pending),
            )
            .bind(
                c.filter(|c| c.order == PendingOrder::Oldest)
                    .map(|c| c.oldest_us),
            )
            .bind(c.map(|c| c.topic.as_str()))
            .bind(c.map(|c| c.key.as_str()))
            .bind(i64::from(q.page_size) + 1)
            .bind(micros(Utc::now()))
            .bind(q.subscription.as_deref())
            .bind(c.map(|c| c.subscription.as_str()))
            .fetch_all(self.pool())
            .await?;
        Ok(rows)
    }

    async fn detail_row(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> StoreResult<Option<SqliteRow>> {
        let sh = Shape::sqlite(b);
        Ok(sqlx::query(AssertSqlSafe(format!(
            "SELECT {} FROM {} WHERE id = ?1",
            detail_columns(&sh, "?2"),
            sh.events
        )))
        .bind(id)
        .bind(with_payload)
        .fetch_optional(self.pool())
        .await?)
    }

    async fn event_rows(&self, b: BoxKind, q: &EventsQuery) -> StoreResult<Vec<SqliteRow>> {
        let sh = Shape::sqlite(b);
        let sql = format!(
            "SELECT {} FROM {}
             WHERE (?1 IS NULL OR status = ?1) AND (?2 IS NULL OR id < ?2) AND {}
             ORDER BY id DESC LIMIT ?10",
            detail_columns(&sh, "0"),
            sh.events,
            filter_sql(&sh, 3)
        );
        let q2 = sqlx::query(AssertSqlSafe(sql))
            .bind(q.status.map(Status::as_str))
            .bind(q.before_id);
        Ok(bind_filter(q2, &q.filter)
            .bind(i64::from(q.page_size) + 1)
            .fetch_all(self.pool())
            .await?)
    }

    async fn audit_rows(&self, limit: i64, before_id: Option<i64>) -> StoreResult<Vec<SqliteRow>> {
        Ok(sqlx::query(
            "SELECT id, at, actor, action, box, selection, count, principal, request_id
             FROM admin_audit
             WHERE (?1 IS NULL OR id < ?1) ORDER BY id DESC LIMIT ?2",
        )
        .bind(before_id)
        .bind(limit)
        .fetch_all(self.pool())
        .await?)
    }

    async fn stats_rows(
        &self,
        b: BoxKind,
        subscription: Option<&str>,
    ) -> StoreResult<StatsRows<SqliteRow>> {
        let sh = Shape::sqlite(b);
        let (events, keys) = (sh.events, sh.keys);
        let sub = sh.sub("subscription");
        let filter = sh.sub_filter("subscription", "?1");
        let group_sub = sh.group_sub();
        let now = micros(Utc::now());
        let counts = sqlx::query(AssertSqlSafe(format!(
            "SELECT {sub} AS subscription, topic, 'pending' AS status, sum(pending) AS n
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
        .fetch_all(self.pool())
        .await?;
        let heads = sqlx::query(AssertSqlSafe(format!(
            "SELECT coalesce(sum((e.attempts > 0 OR e.last_error IS NOT NULL) AND e.scheduled_at > ?2), 0) AS blocked,
                    min(e.created_at) AS oldest, ?2 AS now
             FROM (SELECT (SELECT id FROM {events} e WHERE e.status = 'pending'{same_sub}
                             AND e.topic = k.topic AND e.event_key = k.event_key
                           ORDER BY e.id LIMIT 1) AS head_id
                   FROM {keys} k WHERE k.pending > 0 AND {k_filter}) h
             JOIN {events} e ON e.id = h.head_id",
            same_sub = sh.same_sub("e", "k"),
            k_filter = sh.sub_filter("k.subscription", "?1"),
        )))
        .bind(subscription)
        .bind(now)
        .fetch_one(self.pool())
        .await?;
        let unkeyed = sqlx::query(AssertSqlSafe(format!(
            "SELECT min(created_at) AS oldest FROM {events}
             WHERE status = 'pending' AND event_key IS NULL AND {filter}"
        )))
        .bind(subscription)
        .fetch_one(self.pool())
        .await?;
        Ok(StatsRows {
            counts,
            heads,
            unkeyed,
        })
    }

    async fn wake_released_key(&self, b: BoxKind, k: &AdminKey) -> StoreResult<Option<bool>> {
        let sh = Shape::sqlite(b);
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "UPDATE {} SET ready_at = CASE
                 WHEN pending > 0 AND (lease_until IS NULL OR lease_until <= ?3)
                 THEN MIN(ready_at, ?3) ELSE ready_at END
             WHERE topic = ?1 AND event_key = ?2 AND {}
             RETURNING (lease_until IS NOT NULL AND lease_until > ?3)",
            sh.keys,
            sh.sub_filter("subscription", "?4")
        )))
        .bind(&k.topic)
        .bind(&k.key)
        .bind(micros(Utc::now()))
        .bind(k.subscription.as_deref())
        .fetch_optional(self.pool())
        .await?)
    }
}

//! The operator statements on SQLite: SQL text and binding only, the flows are
//! `store::admin_flow`'s. Writes run in
//! `BEGIN IMMEDIATE` transactions (one writer), so lock order is moot; id lists travel as
//! JSON arrays (`json_each`), times as microseconds since the epoch. The inbox's
//! subscription dimension is added by `Shape`, as on PostgreSQL.

use chrono::Utc;
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Sqlite, Transaction};

use super::{SqliteStore, micros};
use crate::domain::admin::PendingOrder;
use crate::domain::{BoxKind, EventId};
use crate::store::StoreResult;
use crate::store::admin_sql::{AdminSql, Param, Read, Stmt};
use crate::store::shape::Shape;

/// A write transaction and its clock: every time it writes is this one.
pub(crate) struct LiteTx {
    tx: Transaction<'static, Sqlite>,
    now: i64,
}

/// The backlog statement for `order`.
fn pending_sql(sh: &Shape, order: PendingOrder) -> String {
    let (events, keys) = (sh.events, sh.keys);
    let order = Shape::pending_order(order);
    let backlog = sh.backlog("k.");
    let (k_sub, same_sub, k_filter, sub, filter, group_sub) = sh.backlog_parts("?9");
    format!(
            "WITH heads AS (
                SELECT {k_sub} AS subscription, k.topic, k.event_key AS key, k.pending,
                       (SELECT id FROM {events} e WHERE e.status = 'pending'{same_sub}
                          AND e.topic = k.topic AND e.event_key = k.event_key
                        ORDER BY e.id LIMIT 1) AS head_id
                FROM {keys} k
                WHERE {backlog} AND {k_filter} AND (?1 IS NULL OR k.topic = ?1)
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
                       ((e.attempts > 0 OR e.last_error IS NOT NULL) AND e.scheduled_at > ?11) AS blocked
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
                       OR (pending = ?4 AND (subscription, topic, key) > (?10, ?6, ?7)))
                  AND (?5 IS NULL OR (created_at, subscription, topic, key) > (?5, ?10, ?6, ?7))
                ORDER BY {order} LIMIT ?8) p ON 1"
        )
}

type LiteQuery<'q> = sqlx::query::Query<'q, Sqlite, sqlx::sqlite::SqliteArguments>;

fn json_ids(ids: &[EventId]) -> String {
    serde_json::to_string(ids).expect("ids serialize")
}

/// Binds the flows' parameters: times as microseconds since the epoch, id lists as JSON
/// arrays (read with `json_each`), `Now` as `now`.
fn bind<'q>(sql: &'q str, params: &[Param<'q>], now: i64) -> LiteQuery<'q> {
    let mut q = sqlx::query(AssertSqlSafe(sql));
    for p in params {
        q = match *p {
            Param::Int(v) | Param::Micros(v) => q.bind(v),
            Param::Text(v) => q.bind(v),
            Param::Headers(h) => q.bind(crate::store::admin_sql::headers_param(h)),
            Param::Flag(v) => q.bind(v),
            Param::Time(v) => q.bind(v.map(micros)),
            Param::Ids(v) => q.bind(json_ids(v)),
            Param::Now => q.bind(now),
        };
    }
    q
}

#[async_trait::async_trait]
impl AdminSql for SqliteStore {
    type Row = SqliteRow;
    type Tx = LiteTx;

    fn sql(&self, b: BoxKind, stmt: Stmt) -> String {
        let sh = Shape::sqlite(b);
        let (events, keys) = (sh.events, sh.keys);
        match stmt {
            Stmt::Shared(shared) => sh.shared(shared, &sh.detail_columns("0", false)),
            Stmt::InsertAudit => "INSERT INTO admin_audit
                     (at, actor, action, box, selection, count, principal, request_id)
                 VALUES (?8, ?1, ?2, ?3, ?4, ?5, ?6, ?7) RETURNING id"
                .into(),
            Stmt::Pending(order) => pending_sql(&sh, order),
            Stmt::Detail => format!(
                "SELECT {} FROM {events} WHERE id = ?1",
                sh.detail_columns("?2", true)
            ),
            Stmt::StatsHeads => format!(
                "SELECT coalesce(sum((e.attempts > 0 OR e.last_error IS NOT NULL) AND e.scheduled_at > ?2), 0) AS blocked,
                    min(e.created_at) AS oldest, ?2 AS now
             FROM (SELECT (SELECT id FROM {events} e WHERE e.status = 'pending'{same_sub}
                             AND e.topic = k.topic AND e.event_key = k.event_key
                           ORDER BY e.id LIMIT 1) AS head_id
                   FROM {keys} k WHERE {backlog} AND {k_filter}) h
             JOIN {events} e ON e.id = h.head_id",
            same_sub = sh.same_sub("e", "k"),
            k_filter = sh.sub_filter("k.subscription", "?1"),
            backlog = sh.backlog("k."),
            ),
            Stmt::WakeReleased => format!(
                "UPDATE {keys} SET ready_at = CASE
                     WHEN pending > 0 AND (lease_until IS NULL OR lease_until <= ?4)
                     THEN MIN(ready_at, ?4) ELSE ready_at END
                 WHERE topic = ?1 AND event_key = ?2 AND {}
                 RETURNING (lease_until IS NOT NULL AND lease_until > ?4) AS leased",
                sh.sub_filter("subscription", "?3")
            ),
        }
    }

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

    async fn rows_in(
        &self,
        tx: &mut LiteTx,
        sql: &str,
        params: &[Param<'_>],
    ) -> StoreResult<Vec<SqliteRow>> {
        Ok(bind(sql, params, tx.now).fetch_all(&mut *tx.tx).await?)
    }

    async fn execute_in(
        &self,
        tx: &mut LiteTx,
        sql: &str,
        params: &[Param<'_>],
    ) -> StoreResult<u64> {
        let done = bind(sql, params, tx.now).execute(&mut *tx.tx).await?;
        Ok(done.rows_affected())
    }

    /// On the pool, one statement after the other, all with the same clock.
    async fn read(
        &self,
        _: Read,
        batch: &[(String, &[Param<'_>])],
    ) -> StoreResult<Vec<Vec<SqliteRow>>> {
        let now = micros(Utc::now());
        let mut out = Vec::with_capacity(batch.len());
        for (sql, params) in batch {
            out.push(bind(sql, params, now).fetch_all(self.pool()).await?);
        }
        Ok(out)
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
}

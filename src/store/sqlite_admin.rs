//! The operator queries on SQLite: same semantics as `postgres_admin.rs`. Writes run in
//! `BEGIN IMMEDIATE` transactions (one writer), so lock order is moot; id lists travel as
//! JSON arrays (`json_each`), times as microseconds since the epoch. The inbox's
//! subscription dimension is added by `Shape`, as on PostgreSQL.

use std::time::Duration;

use chrono::Utc;
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row, Sqlite, Transaction};

use super::admin::{AdminResult, AdminStore, admin_key, check_ids, sorted_keys};
use super::shape::Shape;
use super::sqlite::{SqliteStore, decode_event};
use super::sqlite::{from_micros, micros};
use crate::admin::{
    AdminKey, AuditEntry, AuditPage, CancelOutcome, CancelRequest, EventDetail, EventFilter,
    EventsPage, EventsQuery, KeyBacklog, PendingCursor, PendingOrder, PendingPage, PendingQuery,
    RequeueOutcome, RequeueRequest, SAMPLE_IDS, Selection, Stats, TopicStats,
};
use crate::domain::{BoxKind, EventId, Status};
use crate::error::Error;

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

fn decode_detail(row: &SqliteRow) -> AdminResult<EventDetail> {
    Ok(EventDetail {
        event: decode_event(row)?,
        payload_size: row.try_get("payload_size")?,
        subscription: row.try_get("subscription")?,
        message_id: row.try_get("message_id")?,
    })
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

struct Candidate {
    id: EventId,
    /// `""` in the outbox.
    subscription: String,
    topic: String,
    key: Option<String>,
    status: Status,
}

fn decode_candidate(r: &SqliteRow) -> AdminResult<Candidate> {
    let status: String = r.try_get("status")?;
    Ok(Candidate {
        id: r.try_get("id")?,
        subscription: r.try_get("subscription")?,
        topic: r.try_get("topic")?,
        key: r.try_get("event_key")?,
        status: Status::parse(&status)
            .ok_or_else(|| Error::Internal(format!("unknown status {status:?}")))?,
    })
}

fn json_ids(ids: &[EventId]) -> String {
    serde_json::to_string(ids).expect("ids serialize")
}

async fn candidates_by_id(
    tx: &mut Transaction<'static, Sqlite>,
    shape: &Shape,
    ids: &[EventId],
) -> AdminResult<Vec<Candidate>> {
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id, {} AS subscription, topic, event_key, status FROM {}
         WHERE id IN (SELECT value FROM json_each(?1)) ORDER BY id",
        shape.sub("subscription"),
        shape.events
    )))
    .bind(json_ids(ids))
    .fetch_all(&mut **tx)
    .await?
    .iter()
    .map(decode_candidate)
    .collect()
}

/// Makes the key rows of `cands` ready now (creating missing ones), in (subscription,
/// topic, key) order; returns the keys a relay holds at this moment.
async fn lock_and_wake_keys(
    tx: &mut Transaction<'static, Sqlite>,
    b: BoxKind,
    cands: &[Candidate],
    now: i64,
) -> AdminResult<Vec<AdminKey>> {
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
    let keys = sorted_keys(
        cands
            .iter()
            .map(|c| (c.subscription.as_str(), c.topic.as_str(), c.key.as_deref())),
    );
    for (sub, topic, key) in keys {
        let mut q = sqlx::query_scalar(sql).bind(topic).bind(key).bind(now);
        if b == BoxKind::Inbox {
            q = q.bind(sub);
        }
        let held: bool = q.fetch_one(&mut **tx).await?;
        if held {
            leased.push(admin_key(b, sub.into(), topic.into(), key.into()));
        }
    }
    Ok(leased)
}

/// The audit entry of an action already done under `request_id`: (id, count, selection).
async fn replayed(
    tx: &mut Transaction<'static, Sqlite>,
    action: &str,
    b: BoxKind,
    request_id: Option<&str>,
) -> AdminResult<Option<(i64, i64, String)>> {
    let Some(rid) = request_id else {
        return Ok(None);
    };
    let row = sqlx::query(
        "SELECT id, count, selection FROM admin_audit
         WHERE action = ?1 AND box = ?2 AND request_id = ?3",
    )
    .bind(action)
    .bind(b.as_str())
    .bind(rid)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(match row {
        None => None,
        Some(r) => Some((
            r.try_get("id")?,
            r.try_get("count")?,
            r.try_get("selection")?,
        )),
    })
}

#[allow(clippy::too_many_arguments)]
async fn audit(
    tx: &mut Transaction<'static, Sqlite>,
    now: i64,
    actor: &str,
    principal: Option<&str>,
    request_id: Option<&str>,
    action: &str,
    b: BoxKind,
    selection: &serde_json::Value,
    count: i64,
) -> AdminResult<i64> {
    Ok(sqlx::query_scalar(
        "INSERT INTO admin_audit (at, actor, action, box, selection, count, principal, request_id)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) RETURNING id",
    )
    .bind(now)
    .bind(actor)
    .bind(action)
    .bind(b.as_str())
    .bind(selection.to_string())
    .bind(count)
    .bind(principal)
    .bind(request_id)
    .fetch_one(&mut **tx)
    .await?)
}

fn changed_concurrently() -> Error {
    Error::FailedPrecondition(
        "some selected events changed state meanwhile; nothing was changed, try again".into(),
    )
}

#[async_trait::async_trait]
impl AdminStore for SqliteStore {
    async fn list_pending(&self, b: BoxKind, q: &PendingQuery) -> AdminResult<PendingPage> {
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
        let first = rows
            .first()
            .ok_or_else(|| Error::Internal("totals row missing".into()))?;
        let mut page = PendingPage {
            keys: Vec::with_capacity(rows.len()),
            next: None,
            total_pending: first.try_get("total_pending")?,
            total_keys: first.try_get("total_keys")?,
            total_blocked_keys: first.try_get("total_blocked")?,
        };
        for r in &rows {
            let Some(topic) = r.try_get::<Option<String>, _>("topic")? else {
                break;
            };
            page.keys.push(KeyBacklog {
                subscription: r.try_get("subscription")?,
                topic,
                key: r.try_get("key")?,
                pending: r.try_get("pending")?,
                oldest_created_at: from_micros(r.try_get("created_at")?),
                head_id: r.try_get("head_id")?,
                head_attempts: r.try_get::<i64, _>("attempts")? as u32,
                head_next_attempt_at: from_micros(r.try_get("scheduled_at")?),
                head_last_error: r.try_get("last_error")?,
                blocked: r.try_get("blocked")?,
            });
        }
        if page.keys.len() > q.page_size as usize {
            page.keys.truncate(q.page_size as usize);
            let last = page.keys.last().expect("page_size >= 1");
            page.next = Some(PendingCursor {
                order: q.order,
                pending: last.pending,
                oldest_us: micros(last.oldest_created_at),
                subscription: last.subscription.clone(),
                topic: last.topic.clone(),
                key: last.key.clone(),
            });
        }
        Ok(page)
    }

    async fn requeue_failed(&self, b: BoxKind, r: &RequeueRequest) -> AdminResult<RequeueOutcome> {
        let sh = Shape::sqlite(b);
        let events = sh.events;
        let now = micros(Utc::now());
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
        if !r.dry_run
            && let Some((audit_id, count, _)) =
                replayed(&mut tx, "requeue", b, r.request_id.as_deref()).await?
        {
            tx.rollback().await?;
            return Ok(RequeueOutcome {
                count,
                sample_ids: Vec::new(),
                audit_id: Some(audit_id),
                leased_keys: Vec::new(),
                replayed: true,
            });
        }
        let cands = match &r.selection {
            Selection::Ids(ids) => {
                let c = candidates_by_id(&mut tx, &sh, ids).await?;
                let found: Vec<(EventId, Status)> = c.iter().map(|c| (c.id, c.status)).collect();
                check_ids(ids, &found, Status::Failed, "requeued")?;
                c
            }
            Selection::Filter(f) => {
                let sql = format!(
                    "SELECT id, {} AS subscription, topic, event_key, status FROM {events}
                     WHERE status = 'failed' AND {} ORDER BY id LIMIT ?8",
                    sh.sub("subscription"),
                    filter_sql(&sh, 1)
                );
                bind_filter(sqlx::query(AssertSqlSafe(sql)), f)
                    .bind(i64::from(r.limit))
                    .fetch_all(&mut *tx)
                    .await?
                    .iter()
                    .map(decode_candidate)
                    .collect::<AdminResult<Vec<_>>>()?
            }
        };
        let ids: Vec<EventId> = cands.iter().map(|c| c.id).collect();
        let sample_ids: Vec<EventId> = ids.iter().take(SAMPLE_IDS).copied().collect();
        if r.dry_run || ids.is_empty() {
            tx.rollback().await?;
            return Ok(RequeueOutcome {
                count: ids.len() as i64,
                sample_ids,
                audit_id: None,
                leased_keys: Vec::new(),
                replayed: false,
            });
        }
        let leased_keys = lock_and_wake_keys(&mut tx, b, &cands, now).await?;
        let changed = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {events} SET status = 'pending', attempts = 0, scheduled_at = ?2,
                 updated_at = ?2, claim_token = NULL, claimed_until = NULL
             WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'failed'"
        )))
        .bind(json_ids(&ids))
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed != ids.len() as u64 {
            return Err(changed_concurrently());
        }
        let selection = match &r.selection {
            Selection::Ids(ids) => serde_json::json!({ "ids": ids }),
            Selection::Filter(f) => serde_json::json!({ "filter": f, "limit": r.limit }),
        };
        let audit_id = audit(
            &mut tx,
            now,
            &r.actor,
            r.principal.as_deref(),
            r.request_id.as_deref(),
            "requeue",
            b,
            &selection,
            ids.len() as i64,
        )
        .await?;
        tx.commit().await?;
        Ok(RequeueOutcome {
            count: ids.len() as i64,
            sample_ids,
            audit_id: Some(audit_id),
            leased_keys,
            replayed: false,
        })
    }

    async fn cancel_events(&self, b: BoxKind, r: &CancelRequest) -> AdminResult<CancelOutcome> {
        let sh = Shape::sqlite(b);
        let events = sh.events;
        let now = micros(Utc::now());
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
        if !r.dry_run
            && let Some((audit_id, _, selection)) =
                replayed(&mut tx, "cancel", b, r.request_id.as_deref()).await?
        {
            tx.rollback().await?;
            let ids = serde_json::from_str::<serde_json::Value>(&selection)
                .ok()
                .and_then(|v| serde_json::from_value::<Vec<EventId>>(v["ids"].clone()).ok())
                .unwrap_or_default();
            return Ok(CancelOutcome {
                ids,
                audit_id: Some(audit_id),
                leased_keys: Vec::new(),
                replayed: true,
            });
        }
        let cands = candidates_by_id(&mut tx, &sh, &r.ids).await?;
        let found: Vec<(EventId, Status)> = cands.iter().map(|c| (c.id, c.status)).collect();
        check_ids(&r.ids, &found, Status::Pending, "cancelled")?;
        let ids: Vec<EventId> = cands.iter().map(|c| c.id).collect();
        if r.dry_run {
            tx.rollback().await?;
            return Ok(CancelOutcome {
                ids,
                audit_id: None,
                leased_keys: Vec::new(),
                replayed: false,
            });
        }
        let leased_keys = lock_and_wake_keys(&mut tx, b, &cands, now).await?;
        let changed = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {events} SET status = 'failed', last_error = 'cancelled: ' || ?2,
                 updated_at = ?3, claim_token = NULL, claimed_until = NULL
             WHERE id IN (SELECT value FROM json_each(?1)) AND status = 'pending'"
        )))
        .bind(json_ids(&ids))
        .bind(&r.reason)
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed != ids.len() as u64 {
            return Err(changed_concurrently());
        }
        let selection = serde_json::json!({ "ids": ids, "reason": r.reason });
        let audit_id = audit(
            &mut tx,
            now,
            &r.actor,
            r.principal.as_deref(),
            r.request_id.as_deref(),
            "cancel",
            b,
            &selection,
            ids.len() as i64,
        )
        .await?;
        tx.commit().await?;
        Ok(CancelOutcome {
            ids,
            audit_id: Some(audit_id),
            leased_keys,
            replayed: false,
        })
    }

    async fn event_detail(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> AdminResult<Option<EventDetail>> {
        let sh = Shape::sqlite(b);
        sqlx::query(AssertSqlSafe(format!(
            "SELECT {} FROM {} WHERE id = ?1",
            detail_columns(&sh, "?2"),
            sh.events
        )))
        .bind(id)
        .bind(with_payload)
        .fetch_optional(self.pool())
        .await?
        .as_ref()
        .map(decode_detail)
        .transpose()
    }

    async fn list_events(&self, b: BoxKind, q: &EventsQuery) -> AdminResult<EventsPage> {
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
        let rows = bind_filter(q2, &q.filter)
            .bind(i64::from(q.page_size) + 1)
            .fetch_all(self.pool())
            .await?;
        let mut events = rows
            .iter()
            .map(decode_detail)
            .collect::<AdminResult<Vec<_>>>()?;
        let mut next_before_id = None;
        if events.len() > q.page_size as usize {
            events.truncate(q.page_size as usize);
            next_before_id = events.last().map(|e| e.event.id);
        }
        Ok(EventsPage {
            events,
            next_before_id,
        })
    }

    async fn list_audit(&self, page_size: u32, before_id: Option<i64>) -> AdminResult<AuditPage> {
        let rows = sqlx::query(
            "SELECT id, at, actor, action, box, selection, count, principal, request_id
             FROM admin_audit
             WHERE (?1 IS NULL OR id < ?1) ORDER BY id DESC LIMIT ?2",
        )
        .bind(before_id)
        .bind(i64::from(page_size) + 1)
        .fetch_all(self.pool())
        .await?;
        let mut entries = Vec::with_capacity(rows.len());
        for r in &rows {
            let box_name: String = r.try_get("box")?;
            entries.push(AuditEntry {
                id: r.try_get("id")?,
                at: from_micros(r.try_get("at")?),
                actor: r.try_get("actor")?,
                action: r.try_get("action")?,
                box_kind: if box_name == "inbox" {
                    BoxKind::Inbox
                } else {
                    BoxKind::Outbox
                },
                selection: r.try_get("selection")?,
                count: r.try_get("count")?,
                principal: r.try_get("principal")?,
                request_id: r.try_get("request_id")?,
            });
        }
        let mut next_before_id = None;
        if entries.len() > page_size as usize {
            entries.truncate(page_size as usize);
            next_before_id = entries.last().map(|e| e.id);
        }
        Ok(AuditPage {
            entries,
            next_before_id,
        })
    }

    async fn stats(&self, b: BoxKind, subscription: Option<&str>) -> AdminResult<Stats> {
        let sh = Shape::sqlite(b);
        let (events, keys) = (sh.events, sh.keys);
        let sub = sh.sub("subscription");
        let filter = sh.sub_filter("subscription", "?1");
        let group_sub = sh.group_sub();
        let now = micros(Utc::now());
        let rows = sqlx::query(AssertSqlSafe(format!(
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
                    min(e.created_at) AS oldest
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
        let unkeyed_oldest: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT min(created_at) FROM {events}
             WHERE status = 'pending' AND event_key IS NULL AND {filter}"
        )))
        .bind(subscription)
        .fetch_one(self.pool())
        .await?;
        let mut by_topic: std::collections::BTreeMap<(String, String), TopicStats> =
            Default::default();
        for r in &rows {
            let subscription: String = r.try_get("subscription")?;
            let topic: String = r.try_get("topic")?;
            let status: String = r.try_get("status")?;
            let n: i64 = r.try_get("n")?;
            let t = by_topic
                .entry((subscription.clone(), topic.clone()))
                .or_insert_with(|| TopicStats {
                    subscription,
                    topic,
                    ..Default::default()
                });
            match status.as_str() {
                "pending" => t.pending += n,
                "completed" => t.completed += n,
                _ => t.failed += n,
            }
        }
        let topics: Vec<TopicStats> = by_topic.into_values().collect();
        let oldest = [heads.try_get::<Option<i64>, _>("oldest")?, unkeyed_oldest]
            .into_iter()
            .flatten()
            .min();
        Ok(Stats {
            pending: topics.iter().map(|t| t.pending).sum(),
            completed: topics.iter().map(|t| t.completed).sum(),
            failed: topics.iter().map(|t| t.failed).sum(),
            oldest_pending_age: oldest
                .map(|o| Duration::from_micros(u64::try_from(now - o).unwrap_or(0))),
            blocked_keys: heads.try_get("blocked")?,
            topics,
        })
    }

    async fn wake_released_keys(
        &self,
        b: BoxKind,
        keys: &[AdminKey],
    ) -> AdminResult<Vec<AdminKey>> {
        let sh = Shape::sqlite(b);
        let now = micros(Utc::now());
        let mut held = Vec::new();
        for k in keys {
            let still_leased: Option<bool> = sqlx::query_scalar(AssertSqlSafe(format!(
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
            .bind(now)
            .bind(k.subscription.as_deref())
            .fetch_optional(self.pool())
            .await?;
            if still_leased == Some(true) {
                held.push(k.clone());
            }
        }
        Ok(held)
    }
}

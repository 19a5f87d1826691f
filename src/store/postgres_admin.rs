//! The operator queries on PostgreSQL.
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

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};

use super::admin::{AdminResult, AdminStore, admin_key, check_ids, sorted_keys};
use super::postgres::{PgStore, decode_event};
use super::shape::Shape;
use crate::admin::{
    AdminKey, AuditEntry, AuditPage, CancelOutcome, CancelRequest, EventDetail, EventFilter,
    EventsPage, EventsQuery, KeyBacklog, PendingCursor, PendingOrder, PendingPage, PendingQuery,
    RequeueOutcome, RequeueRequest, SAMPLE_IDS, Selection, Stats, TopicStats,
};
use crate::domain::{BoxKind, EventId, Status};
use crate::error::Error;

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

fn decode_detail(row: &PgRow) -> AdminResult<EventDetail> {
    Ok(EventDetail {
        event: decode_event(row)?,
        payload_size: row.try_get("payload_size")?,
        subscription: row.try_get("subscription")?,
        message_id: row.try_get("message_id")?,
    })
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

/// Rows of the candidates a requeue or cancel would change.
struct Candidate {
    id: EventId,
    /// `""` in the outbox.
    subscription: String,
    topic: String,
    key: Option<String>,
    status: Status,
}

fn decode_candidate(r: &PgRow) -> AdminResult<Candidate> {
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

async fn candidates_by_id(
    tx: &mut Transaction<'static, Postgres>,
    shape: &Shape,
    ids: &[EventId],
) -> AdminResult<Vec<Candidate>> {
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id, {} AS subscription, topic, event_key, status FROM {} WHERE id = ANY($1)
         ORDER BY id",
        shape.sub("subscription"),
        shape.events
    )))
    .bind(ids)
    .fetch_all(&mut **tx)
    .await?
    .iter()
    .map(decode_candidate)
    .collect()
}

/// Locks (creating if missing) the key rows of `cands` in sorted order — (subscription,
/// topic, key), as enqueue and receive take them — and makes them ready now; returns
/// the keys a relay holds at this moment.
async fn lock_and_wake_keys(
    tx: &mut Transaction<'static, Postgres>,
    b: BoxKind,
    cands: &[Candidate],
) -> AdminResult<Vec<AdminKey>> {
    let keys = sorted_keys(
        cands
            .iter()
            .map(|c| (c.subscription.as_str(), c.topic.as_str(), c.key.as_deref())),
    );
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let subs: Vec<&str> = keys.iter().map(|k| k.0).collect();
    let topics: Vec<&str> = keys.iter().map(|k| k.1).collect();
    let names: Vec<&str> = keys.iter().map(|k| k.2).collect();
    let rows = match b {
        BoxKind::Outbox => sqlx::query(
            "INSERT INTO outbox_keys (topic, event_key, ready_at)
             SELECT t, k, now() FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(t, k, o)
             ORDER BY o
             ON CONFLICT (topic, event_key)
             DO UPDATE SET ready_at = LEAST(outbox_keys.ready_at, now())
             RETURNING ''::text AS subscription, topic, event_key,
                       COALESCE(lease_until > now(), false) AS leased",
        ),
        BoxKind::Inbox => sqlx::query(
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
    let rows = rows.bind(&topics).bind(&names).fetch_all(&mut **tx).await?;
    let mut leased = Vec::new();
    for r in &rows {
        if r.try_get::<bool, _>("leased")? {
            leased.push(admin_key(
                b,
                r.try_get("subscription")?,
                r.try_get("topic")?,
                r.try_get("event_key")?,
            ));
        }
    }
    Ok(leased)
}

/// The audit entry of an action already done under `request_id`: (id, count, selection).
async fn replayed(
    tx: &mut Transaction<'static, Postgres>,
    action: &str,
    b: BoxKind,
    request_id: Option<&str>,
) -> AdminResult<Option<(i64, i64, String)>> {
    let Some(rid) = request_id else {
        return Ok(None);
    };
    let row = sqlx::query(
        "SELECT id, count, selection::text AS selection FROM admin_audit
         WHERE action = $1 AND box = $2 AND request_id = $3",
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
    tx: &mut Transaction<'static, Postgres>,
    actor: &str,
    principal: Option<&str>,
    request_id: Option<&str>,
    action: &str,
    b: BoxKind,
    selection: &serde_json::Value,
    count: i64,
) -> AdminResult<i64> {
    Ok(sqlx::query_scalar(
        "INSERT INTO admin_audit (actor, action, box, selection, count, principal, request_id)
         VALUES ($1, $2, $3, $4::text::jsonb, $5, $6, $7) RETURNING id",
    )
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
impl AdminStore for PgStore {
    async fn list_pending(&self, b: BoxKind, q: &PendingQuery) -> AdminResult<PendingPage> {
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
                break; // the empty page: totals only
            };
            page.keys.push(KeyBacklog {
                subscription: r.try_get("subscription")?,
                topic,
                key: r.try_get("key")?,
                pending: r.try_get("pending")?,
                oldest_created_at: r.try_get("created_at")?,
                head_id: r.try_get("head_id")?,
                head_attempts: r.try_get::<i32, _>("attempts")? as u32,
                head_next_attempt_at: r.try_get("scheduled_at")?,
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
                oldest_us: last.oldest_created_at.timestamp_micros(),
                subscription: last.subscription.clone(),
                topic: last.topic.clone(),
                key: last.key.clone(),
            });
        }
        Ok(page)
    }

    async fn requeue_failed(&self, b: BoxKind, r: &RequeueRequest) -> AdminResult<RequeueOutcome> {
        let sh = Shape::postgres(b);
        let events = sh.events;
        let mut tx = self.admin_pool().begin().await?;
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
                     WHERE status = 'failed' AND {} ORDER BY id LIMIT $8",
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
        let leased_keys = lock_and_wake_keys(&mut tx, b, &cands).await?;
        let changed = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {events} SET status = 'pending', attempts = 0, scheduled_at = now(),
                 updated_at = now(), claim_token = NULL, claimed_until = NULL
             WHERE id = ANY($1) AND status = 'failed'"
        )))
        .bind(&ids)
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
        let sh = Shape::postgres(b);
        let events = sh.events;
        let mut tx = self.admin_pool().begin().await?;
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
        let leased_keys = lock_and_wake_keys(&mut tx, b, &cands).await?;
        let changed = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {events} SET status = 'failed', last_error = 'cancelled: ' || $2,
                 updated_at = now(), claim_token = NULL, claimed_until = NULL
             WHERE id = ANY($1) AND status = 'pending'"
        )))
        .bind(&ids)
        .bind(&r.reason)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed != ids.len() as u64 {
            return Err(changed_concurrently());
        }
        let selection = serde_json::json!({ "ids": ids, "reason": r.reason });
        let audit_id = audit(
            &mut tx,
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
        let sh = Shape::postgres(b);
        sqlx::query(AssertSqlSafe(format!(
            "SELECT {} FROM {} WHERE id = $1",
            detail_columns(&sh, "$2"),
            sh.events
        )))
        .bind(id)
        .bind(with_payload)
        .fetch_optional(self.admin_pool())
        .await?
        .as_ref()
        .map(decode_detail)
        .transpose()
    }

    async fn list_events(&self, b: BoxKind, q: &EventsQuery) -> AdminResult<EventsPage> {
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
        let rows = bind_filter(q2, &q.filter)
            .bind(i64::from(q.page_size) + 1)
            .fetch_all(self.admin_pool())
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
            "SELECT id, at, actor, action, box, selection::text AS selection, count,
                    principal, request_id
             FROM admin_audit WHERE ($1::int8 IS NULL OR id < $1) ORDER BY id DESC LIMIT $2",
        )
        .bind(before_id)
        .bind(i64::from(page_size) + 1)
        .fetch_all(self.admin_pool())
        .await?;
        let mut entries = Vec::with_capacity(rows.len());
        for r in &rows {
            let box_name: String = r.try_get("box")?;
            entries.push(AuditEntry {
                id: r.try_get("id")?,
                at: r.try_get("at")?,
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
        let sh = Shape::postgres(b);
        let (events, keys) = (sh.events, sh.keys);
        let sub = sh.sub("subscription");
        let filter = sh.sub_filter("subscription", "$1");
        let group_sub = sh.group_sub();
        let mut tx = self.admin_pool().begin().await?;
        sqlx::query("SET LOCAL jit = off").execute(&mut *tx).await?;
        // Pending from the per-key counts (keyed) and the unkeyed index; the other
        // statuses by one scan.
        let rows = sqlx::query(AssertSqlSafe(format!(
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
        let unkeyed_oldest: Option<DateTime<Utc>> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT min(created_at) FROM {events}
             WHERE status = 'pending' AND event_key IS NULL AND {filter}"
        )))
        .bind(subscription)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
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
        let now: DateTime<Utc> = heads.try_get("now")?;
        let oldest = [
            heads.try_get::<Option<DateTime<Utc>>, _>("oldest")?,
            unkeyed_oldest,
        ]
        .into_iter()
        .flatten()
        .min();
        Ok(Stats {
            pending: topics.iter().map(|t| t.pending).sum(),
            completed: topics.iter().map(|t| t.completed).sum(),
            failed: topics.iter().map(|t| t.failed).sum(),
            oldest_pending_age: oldest.map(|o| (now - o).to_std().unwrap_or(Duration::ZERO)),
            blocked_keys: heads.try_get("blocked")?,
            topics,
        })
    }

    async fn wake_released_keys(
        &self,
        b: BoxKind,
        keys: &[AdminKey],
    ) -> AdminResult<Vec<AdminKey>> {
        let sh = Shape::postgres(b);
        // One key per statement: no transaction ever holds two key rows here, so this
        // cannot deadlock with enqueue or settle. Waking a key early is harmless.
        let mut held = Vec::new();
        for k in keys {
            let still_leased: Option<bool> = sqlx::query_scalar(AssertSqlSafe(format!(
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
            .await?;
            if still_leased == Some(true) {
                held.push(k.clone());
            }
        }
        Ok(held)
    }
}

//! The admin flows, written once for every engine: requeue and cancel (replay check,
//! selection, id checks, dry run, key wake-up, update, audit, all in one transaction),
//! page assembly and row decoding. An engine supplies only what differs between
//! databases, its SQL text and binding, through `AdminSql`; `AdminStore` follows for
//! every engine that implements it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::admin::AdminStore;
use super::rows::{Candidate, Cols, admin_key, decode_audit, decode_candidate, decode_detail};
use super::{StoreError, StoreResult};
use crate::domain::admin::{
    AdminKey, AuditPage, CancelOutcome, CancelRequest, EventDetail, EventFilter, EventsPage,
    EventsQuery, KeyBacklog, PendingCursor, PendingPage, PendingQuery, RequeueOutcome,
    RequeueRequest, SAMPLE_IDS, Selection, Stats, TopicStats,
};
use crate::domain::{BoxKind, EventId, Status};

/// An audit entry to record.
pub(crate) struct NewAudit<'a> {
    pub actor: &'a str,
    pub principal: Option<&'a str>,
    pub request_id: Option<&'a str>,
    pub action: &'static str,
    pub box_kind: BoxKind,
    pub selection: serde_json::Value,
    pub count: i64,
}

/// The rows behind `Stats`: counts by (subscription, topic, status) in columns
/// `subscription, topic, status, n`; one row of the keyed heads (`blocked`, `oldest`,
/// `now`, the database's clock); one row of the unkeyed backlog (`oldest`).
pub(crate) struct StatsRows<R> {
    pub counts: Vec<R>,
    pub heads: R,
    pub unkeyed: R,
}

/// One engine's side of the admin flows: the statements, nothing else. Rows come back
/// undecoded (`Cols`); a write transaction is the engine's own (`Tx`).
///
/// Row columns the flows read: candidates `id, subscription, topic, event_key, status`;
/// replays `id, count, selection`; details the event columns with `payload_size,
/// subscription, message_id`; the backlog `subscription, topic, key, pending,
/// created_at, head_id, attempts, scheduled_at, last_error, blocked` and the totals
/// `total_keys, total_pending, total_blocked` on every row; audit `id, at, actor,
/// action, box, selection, count, principal, request_id`.
#[async_trait::async_trait]
pub(crate) trait AdminSql: Send + Sync {
    type Row: Cols + Send + Sync;
    type Tx: Send;

    /// A write transaction of the admin's query class.
    async fn begin(&self) -> StoreResult<Self::Tx>;
    async fn commit(&self, tx: Self::Tx) -> StoreResult<()>;
    async fn rollback(&self, tx: Self::Tx) -> StoreResult<()>;

    /// The audit row of `action` already done under `request_id`, if any.
    async fn audit_of_request(
        &self,
        tx: &mut Self::Tx,
        action: &str,
        b: BoxKind,
        request_id: &str,
    ) -> StoreResult<Option<Self::Row>>;

    /// The named events that exist, in id order.
    async fn candidates_by_id(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        ids: &[EventId],
    ) -> StoreResult<Vec<Self::Row>>;

    /// Failed events matching the filter, in id order, at most `limit`.
    async fn failed_by_filter(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        f: &EventFilter,
        limit: u32,
    ) -> StoreResult<Vec<Self::Row>>;

    /// Locks (creating missing ones) the key rows `keys` — (subscription, topic, key),
    /// sorted — and makes them ready now; returns those a relay holds at this moment,
    /// as (subscription, topic, key).
    async fn wake_keys(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        keys: &[(&str, &str, &str)],
    ) -> StoreResult<Vec<(String, String, String)>>;

    /// Failed events `ids` back to pending, due now; returns how many changed.
    async fn set_requeued(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        ids: &[EventId],
    ) -> StoreResult<u64>;

    /// Pending events `ids` to failed with `cancelled: <reason>`; returns how many changed.
    async fn set_cancelled(
        &self,
        tx: &mut Self::Tx,
        b: BoxKind,
        ids: &[EventId],
        reason: &str,
    ) -> StoreResult<u64>;

    /// Records an audit entry; returns its id.
    async fn insert_audit(&self, tx: &mut Self::Tx, a: &NewAudit<'_>) -> StoreResult<i64>;

    /// The backlog page's rows (at most `page_size + 1` groups; with none, one row of
    /// totals whose `topic` is NULL).
    async fn pending_rows(&self, b: BoxKind, q: &PendingQuery) -> StoreResult<Vec<Self::Row>>;

    async fn detail_row(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> StoreResult<Option<Self::Row>>;

    /// At most `page_size + 1` events, newest first, without payloads.
    async fn event_rows(&self, b: BoxKind, q: &EventsQuery) -> StoreResult<Vec<Self::Row>>;

    /// At most `limit` audit rows below `before_id`, newest first.
    async fn audit_rows(&self, limit: i64, before_id: Option<i64>) -> StoreResult<Vec<Self::Row>>;

    async fn stats_rows(
        &self,
        b: BoxKind,
        subscription: Option<&str>,
    ) -> StoreResult<StatsRows<Self::Row>>;

    /// Makes one key ready now if no relay holds it and it has pending events; `None`
    /// if there is no such key row, else whether a relay still holds it.
    async fn wake_released_key(&self, b: BoxKind, key: &AdminKey) -> StoreResult<Option<bool>>;
}

/// The explicit-id checks of requeue and cancel: `found` holds (id, status) of the ids
/// that exist.
pub(crate) fn check_ids(
    ids: &[EventId],
    found: &[(EventId, Status)],
    wanted: Status,
    action: &'static str,
) -> StoreResult<()> {
    let known: HashSet<EventId> = found.iter().map(|(id, _)| *id).collect();
    let missing: Vec<EventId> = ids
        .iter()
        .filter(|id| !known.contains(*id))
        .copied()
        .collect();
    if !missing.is_empty() {
        return Err(StoreError::Missing { ids: missing });
    }
    let wrong: Vec<(EventId, Status)> = found
        .iter()
        .filter(|(_, s)| *s != wanted)
        .copied()
        .collect();
    if !wrong.is_empty() {
        return Err(StoreError::WrongState {
            wanted,
            action,
            found: wrong,
        });
    }
    Ok(())
}

/// The keys of a set of events as (subscription, topic, key), sorted and distinct: the
/// lock order enqueue and receive use (the subscription is `""` in the outbox, where all
/// keys share it). Unkeyed events have no key row.
pub(crate) fn sorted_keys<'a>(
    keys: impl Iterator<Item = (&'a str, &'a str, Option<&'a str>)>,
) -> Vec<(&'a str, &'a str, &'a str)> {
    let set: BTreeSet<(&str, &str, &str)> =
        keys.filter_map(|(s, t, k)| k.map(|k| (s, t, k))).collect();
    set.into_iter().collect()
}

/// An action done before under the same request id.
struct Replay {
    audit_id: i64,
    count: i64,
    selection: String,
}

async fn replayed<E: AdminSql>(
    e: &E,
    tx: &mut E::Tx,
    action: &str,
    b: BoxKind,
    request_id: Option<&str>,
) -> StoreResult<Option<Replay>> {
    let Some(rid) = request_id else {
        return Ok(None);
    };
    match e.audit_of_request(tx, action, b, rid).await? {
        None => Ok(None),
        Some(r) => Ok(Some(Replay {
            audit_id: r.int("id")?,
            count: r.int("count")?,
            selection: r.text("selection")?,
        })),
    }
}

fn decode_all<R: Cols, T>(rows: &[R], f: fn(&R) -> StoreResult<T>) -> StoreResult<Vec<T>> {
    rows.iter().map(f).collect()
}

/// Wakes the key rows of `cands` in lock order; returns the keys a relay holds.
async fn wake_keys_of<E: AdminSql>(
    e: &E,
    tx: &mut E::Tx,
    b: BoxKind,
    cands: &[Candidate],
) -> StoreResult<Vec<AdminKey>> {
    let keys = sorted_keys(
        cands
            .iter()
            .map(|c| (c.subscription.as_str(), c.topic.as_str(), c.key.as_deref())),
    );
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let held = e.wake_keys(tx, b, &keys).await?;
    Ok(held
        .into_iter()
        .map(|(s, t, k)| admin_key(b, s, t, k))
        .collect())
}

async fn requeue<E: AdminSql>(
    e: &E,
    b: BoxKind,
    r: &RequeueRequest,
) -> StoreResult<RequeueOutcome> {
    let mut tx = e.begin().await?;
    if !r.dry_run
        && let Some(rep) = replayed(e, &mut tx, "requeue", b, r.request_id.as_deref()).await?
    {
        e.rollback(tx).await?;
        return Ok(RequeueOutcome {
            count: rep.count,
            sample_ids: Vec::new(),
            audit_id: Some(rep.audit_id),
            leased_keys: Vec::new(),
            replayed: true,
        });
    }
    let cands = match &r.selection {
        Selection::Ids(ids) => {
            let rows = e.candidates_by_id(&mut tx, b, ids).await?;
            let c = decode_all(&rows, decode_candidate)?;
            let found: Vec<(EventId, Status)> = c.iter().map(|c| (c.id, c.status)).collect();
            check_ids(ids, &found, Status::Failed, "requeued")?;
            c
        }
        Selection::Filter(f) => {
            let rows = e.failed_by_filter(&mut tx, b, f, r.limit).await?;
            decode_all(&rows, decode_candidate)?
        }
    };
    let ids: Vec<EventId> = cands.iter().map(|c| c.id).collect();
    let sample_ids: Vec<EventId> = ids.iter().take(SAMPLE_IDS).copied().collect();
    if r.dry_run || ids.is_empty() {
        e.rollback(tx).await?;
        return Ok(RequeueOutcome {
            count: ids.len() as i64,
            sample_ids,
            audit_id: None,
            leased_keys: Vec::new(),
            replayed: false,
        });
    }
    let leased_keys = wake_keys_of(e, &mut tx, b, &cands).await?;
    if e.set_requeued(&mut tx, b, &ids).await? != ids.len() as u64 {
        return Err(StoreError::ChangedMeanwhile);
    }
    let selection = match &r.selection {
        Selection::Ids(ids) => serde_json::json!({ "ids": ids }),
        Selection::Filter(f) => serde_json::json!({ "filter": f, "limit": r.limit }),
    };
    let audit = NewAudit {
        actor: &r.actor,
        principal: r.principal.as_deref(),
        request_id: r.request_id.as_deref(),
        action: "requeue",
        box_kind: b,
        selection,
        count: ids.len() as i64,
    };
    let audit_id = e.insert_audit(&mut tx, &audit).await?;
    e.commit(tx).await?;
    Ok(RequeueOutcome {
        count: ids.len() as i64,
        sample_ids,
        audit_id: Some(audit_id),
        leased_keys,
        replayed: false,
    })
}

async fn cancel<E: AdminSql>(e: &E, b: BoxKind, r: &CancelRequest) -> StoreResult<CancelOutcome> {
    let mut tx = e.begin().await?;
    if !r.dry_run
        && let Some(rep) = replayed(e, &mut tx, "cancel", b, r.request_id.as_deref()).await?
    {
        e.rollback(tx).await?;
        let ids = serde_json::from_str::<serde_json::Value>(&rep.selection)
            .ok()
            .and_then(|v| serde_json::from_value::<Vec<EventId>>(v["ids"].clone()).ok())
            .unwrap_or_default();
        return Ok(CancelOutcome {
            ids,
            audit_id: Some(rep.audit_id),
            leased_keys: Vec::new(),
            replayed: true,
        });
    }
    let rows = e.candidates_by_id(&mut tx, b, &r.ids).await?;
    let cands = decode_all(&rows, decode_candidate)?;
    let found: Vec<(EventId, Status)> = cands.iter().map(|c| (c.id, c.status)).collect();
    check_ids(&r.ids, &found, Status::Pending, "cancelled")?;
    let ids: Vec<EventId> = cands.iter().map(|c| c.id).collect();
    if r.dry_run {
        e.rollback(tx).await?;
        return Ok(CancelOutcome {
            ids,
            audit_id: None,
            leased_keys: Vec::new(),
            replayed: false,
        });
    }
    let leased_keys = wake_keys_of(e, &mut tx, b, &cands).await?;
    if e.set_cancelled(&mut tx, b, &ids, &r.reason).await? != ids.len() as u64 {
        return Err(StoreError::ChangedMeanwhile);
    }
    let audit = NewAudit {
        actor: &r.actor,
        principal: r.principal.as_deref(),
        request_id: r.request_id.as_deref(),
        action: "cancel",
        box_kind: b,
        selection: serde_json::json!({ "ids": ids, "reason": r.reason }),
        count: ids.len() as i64,
    };
    let audit_id = e.insert_audit(&mut tx, &audit).await?;
    e.commit(tx).await?;
    Ok(CancelOutcome {
        ids,
        audit_id: Some(audit_id),
        leased_keys,
        replayed: false,
    })
}

/// The backlog page from its rows: totals from the first, one group per row with a
/// topic, and the cursor after the last group shown when more follow.
fn pending_page<R: Cols>(q: &PendingQuery, rows: &[R]) -> StoreResult<PendingPage> {
    let first = rows
        .first()
        .ok_or_else(|| StoreError::Other("totals row missing".into()))?;
    let mut page = PendingPage {
        keys: Vec::with_capacity(rows.len()),
        next: None,
        total_pending: first.int("total_pending")?,
        total_keys: first.int("total_keys")?,
        total_blocked_keys: first.int("total_blocked")?,
    };
    for r in rows {
        let Some(topic) = r.opt_text("topic")? else {
            break; // the empty page: totals only
        };
        page.keys.push(KeyBacklog {
            subscription: r.text("subscription")?,
            topic,
            key: r.text("key")?,
            pending: r.int("pending")?,
            oldest_created_at: r.time("created_at")?,
            head_id: r.int("head_id")?,
            head_attempts: r.count("attempts")?,
            head_next_attempt_at: r.time("scheduled_at")?,
            head_last_error: r.opt_text("last_error")?,
            blocked: r.flag("blocked")?,
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

/// Keeps the first `page_size` items; the id of the last one kept when more follow.
fn cut_page<T>(items: &mut Vec<T>, page_size: u32, id: fn(&T) -> i64) -> Option<i64> {
    if items.len() > page_size as usize {
        items.truncate(page_size as usize);
        items.last().map(id)
    } else {
        None
    }
}

fn stats_of<R: Cols>(rows: &StatsRows<R>) -> StoreResult<Stats> {
    let mut by_topic: BTreeMap<(String, String), TopicStats> = BTreeMap::new();
    for r in &rows.counts {
        let subscription = r.text("subscription")?;
        let topic = r.text("topic")?;
        let n = r.int("n")?;
        let t = by_topic
            .entry((subscription.clone(), topic.clone()))
            .or_insert_with(|| TopicStats {
                subscription,
                topic,
                ..Default::default()
            });
        match r.text("status")?.as_str() {
            "pending" => t.pending += n,
            "completed" => t.completed += n,
            _ => t.failed += n,
        }
    }
    let topics: Vec<TopicStats> = by_topic.into_values().collect();
    let now: DateTime<Utc> = rows.heads.time("now")?;
    let oldest = [
        rows.heads.opt_time("oldest")?,
        rows.unkeyed.opt_time("oldest")?,
    ]
    .into_iter()
    .flatten()
    .min();
    Ok(Stats {
        pending: topics.iter().map(|t| t.pending).sum(),
        completed: topics.iter().map(|t| t.completed).sum(),
        failed: topics.iter().map(|t| t.failed).sum(),
        oldest_pending_age: oldest.map(|o| (now - o).to_std().unwrap_or(Duration::ZERO)),
        blocked_keys: rows.heads.int("blocked")?,
        topics,
    })
}

#[async_trait::async_trait]
impl<E: AdminSql> AdminStore for E {
    async fn list_pending(&self, b: BoxKind, q: &PendingQuery) -> StoreResult<PendingPage> {
        pending_page(q, &self.pending_rows(b, q).await?)
    }

    async fn requeue_failed(&self, b: BoxKind, r: &RequeueRequest) -> StoreResult<RequeueOutcome> {
        requeue(self, b, r).await
    }

    async fn cancel_events(&self, b: BoxKind, r: &CancelRequest) -> StoreResult<CancelOutcome> {
        cancel(self, b, r).await
    }

    async fn event_detail(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> StoreResult<Option<EventDetail>> {
        self.detail_row(b, id, with_payload)
            .await?
            .as_ref()
            .map(decode_detail)
            .transpose()
    }

    async fn list_events(&self, b: BoxKind, q: &EventsQuery) -> StoreResult<EventsPage> {
        let mut events = decode_all(&self.event_rows(b, q).await?, decode_detail)?;
        let next_before_id = cut_page(&mut events, q.page_size, |e| e.event.id);
        Ok(EventsPage {
            events,
            next_before_id,
        })
    }

    async fn list_audit(&self, page_size: u32, before_id: Option<i64>) -> StoreResult<AuditPage> {
        let rows = self.audit_rows(i64::from(page_size) + 1, before_id).await?;
        let mut entries = decode_all(&rows, decode_audit)?;
        let next_before_id = cut_page(&mut entries, page_size, |e| e.id);
        Ok(AuditPage {
            entries,
            next_before_id,
        })
    }

    async fn stats(&self, b: BoxKind, subscription: Option<&str>) -> StoreResult<Stats> {
        stats_of(&self.stats_rows(b, subscription).await?)
    }

    async fn wake_released_keys(
        &self,
        b: BoxKind,
        keys: &[AdminKey],
    ) -> StoreResult<Vec<AdminKey>> {
        // One key per statement: no transaction ever holds two key rows here, so this
        // cannot deadlock with enqueue or settle. Waking a key early is harmless.
        let mut held = Vec::new();
        for k in keys {
            if self.wake_released_key(b, k).await? == Some(true) {
                held.push(k.clone());
            }
        }
        Ok(held)
    }
}

#[cfg(test)]
mod short_errors {
    use super::*;

    #[test]
    fn an_error_naming_100000_ids_stays_short() {
        let ids: Vec<EventId> = (1..=100_000).collect();
        let e = check_ids(&ids, &[], Status::Failed, "requeued").unwrap_err();
        let msg = e.to_string();
        assert!(msg.len() < 200, "{} bytes", msg.len());
        assert!(msg.contains("99990 more"), "{msg}");
        let found: Vec<(EventId, Status)> = ids.iter().map(|i| (*i, Status::Pending)).collect();
        let e = check_ids(&ids, &found, Status::Failed, "requeued").unwrap_err();
        assert!(e.to_string().len() < 300, "{e}");
    }
}

//! The admin flows, written once for every engine: requeue and cancel (replay check,
//! selection, id checks, dry run, key wake-up, update, audit, all in one transaction),
//! page assembly and row decoding, and the parameters of every statement. An engine
//! supplies only what differs between databases through `AdminSql`: the SQL text of each
//! statement (`Stmt`), how it binds the engine-neutral parameters (`Param`) and runs a
//! statement; `AdminStore` follows for every engine that implements it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::admin::AdminStore;
use super::admin_sql::{AdminSql, Param, Query, Read, Shared, Stmt, query};
use super::rows::{
    Candidate, Cols, admin_key, decode_audit, decode_backlog, decode_candidate, decode_detail,
    decode_pause,
};
use super::{StoreError, StoreResult};
use crate::domain::admin::{
    ActionContext, AdminKey, AuditPage, CancelOutcome, CancelRequest, DeadLetter, EventCopy,
    EventDetail, EventFilter, EventsPage, EventsQuery, PauseOutcome, PauseRequest, PendingCursor,
    PendingOrder, PendingPage, PendingQuery, RateCount, RepublishRequest, RepublishSelection,
    RequeueOutcome, RequeueRequest, SAMPLE_IDS, Selection, Stats, TopicPause, TopicStats,
};
use crate::domain::{BoxKind, EventId, Status};

/// Runs `q` in the transaction.
pub(super) async fn rows_in<E: AdminSql>(
    e: &E,
    tx: &mut E::Tx,
    b: BoxKind,
    q: Query<'_>,
) -> StoreResult<Vec<E::Row>> {
    e.rows_in(tx, &e.sql(b, q.stmt), &q.params).await
}

/// Runs the reads `qs`; each one's rows, in order.
pub(super) async fn read<E: AdminSql>(
    e: &E,
    how: Read,
    b: BoxKind,
    qs: &[Query<'_>],
) -> StoreResult<Vec<Vec<E::Row>>> {
    let batch: Vec<(String, &[Param<'_>])> = qs
        .iter()
        .map(|q| (e.sql(b, q.stmt), q.params.as_slice()))
        .collect();
    e.read(how, &batch).await
}

/// The fifteen parameters of an event filter, in statement order.
pub(super) fn filter_params(f: &EventFilter) -> [Param<'_>; 15] {
    [
        Param::Text(f.topic.as_deref()),
        Param::Text(f.key.as_deref()),
        Param::Text(f.event_type.as_deref()),
        Param::Time(f.updated_after),
        Param::Time(f.updated_before),
        Param::Text(f.error_contains.as_deref()),
        Param::Text(f.subscription.as_deref()),
        Param::Text(f.key_prefix.as_deref()),
        Param::Time(f.created_after),
        Param::Time(f.created_before),
        Param::Headers(&f.headers),
        Param::Text(f.idempotency_key.as_deref()),
        Param::Text(f.message_id.as_deref()),
        Param::Int(f.after_id),
        Param::Int(f.through_id),
    ]
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
    let params = vec![
        Param::Text(Some(action)),
        Param::Text(Some(b.as_str())),
        Param::Text(Some(rid)),
    ];
    let rows = rows_in(
        e,
        tx,
        b,
        query(Stmt::Shared(Shared::AuditOfRequest), params),
    )
    .await?;
    match rows.first() {
        None => Ok(None),
        Some(r) => Ok(Some(Replay {
            audit_id: r.int("id")?,
            count: r.int("count")?,
            selection: r.text("selection")?,
        })),
    }
}

pub(super) fn decode_all<R: Cols, T>(
    rows: &[R],
    f: fn(&R) -> StoreResult<T>,
) -> StoreResult<Vec<T>> {
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

/// An audit entry to record.
pub(super) struct NewAudit<'a> {
    pub context: &'a ActionContext,
    pub action: &'static str,
    pub box_kind: BoxKind,
    pub selection: serde_json::Value,
    pub count: i64,
}

pub(super) async fn insert_audit<E: AdminSql>(
    e: &E,
    tx: &mut E::Tx,
    a: &NewAudit<'_>,
) -> StoreResult<i64> {
    let selection = a.selection.to_string();
    let params = vec![
        Param::Text(Some(&a.context.actor)),
        Param::Text(Some(a.action)),
        Param::Text(Some(a.box_kind.as_str())),
        Param::Text(Some(&selection)),
        Param::Int(Some(a.count)),
        Param::Text(a.context.principal.as_deref()),
        Param::Text(a.context.request_id.as_deref()),
        Param::Now,
    ];
    let rows = rows_in(e, tx, a.box_kind, query(Stmt::InsertAudit, params)).await?;
    rows.first()
        .ok_or_else(|| StoreError::other("audit insert returned no id"))?
        .int("id")
}

/// What requeue and cancel share once the selection is checked: wake the keys a relay
/// holds, change exactly the candidates with `change` (or nothing: another writer got
/// there first), record the audit entry and commit. Returns the entry and the held keys.
async fn act<E: AdminSql>(
    e: &E,
    mut tx: E::Tx,
    cands: &[Candidate],
    params: &[Param<'_>],
    change: Shared,
    audit: NewAudit<'_>,
) -> StoreResult<(i64, Vec<AdminKey>)> {
    let leased_keys = change_candidates(e, &mut tx, audit.box_kind, cands, params, change).await?;
    let audit_id = insert_audit(e, &mut tx, &audit).await?;
    e.commit(tx).await?;
    Ok((audit_id, leased_keys))
}

/// Wakes the keys of `cands` and changes exactly them with `change` (or fails with
/// `ChangedMeanwhile`: another writer got there first); the keys a relay holds.
pub(super) async fn change_candidates<E: AdminSql>(
    e: &E,
    tx: &mut E::Tx,
    b: BoxKind,
    cands: &[Candidate],
    params: &[Param<'_>],
    change: Shared,
) -> StoreResult<Vec<AdminKey>> {
    let leased_keys = wake_keys_of(e, tx, b, cands).await?;
    let sql = e.sql(b, Stmt::Shared(change));
    if e.execute_in(tx, &sql, params).await? != cands.len() as u64 {
        return Err(StoreError::ChangedMeanwhile);
    }
    Ok(leased_keys)
}

async fn requeue<E: AdminSql>(
    e: &E,
    b: BoxKind,
    r: &RequeueRequest,
) -> StoreResult<RequeueOutcome> {
    let mut tx = e.begin().await?;
    if !r.context.dry_run
        && let Some(rep) =
            replayed(e, &mut tx, "requeue", b, r.context.request_id.as_deref()).await?
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
            let by_id = query(Stmt::Shared(Shared::CandidatesById), vec![Param::Ids(ids)]);
            let rows = rows_in(e, &mut tx, b, by_id).await?;
            let c = decode_all(&rows, decode_candidate)?;
            let found: Vec<(EventId, Status)> = c.iter().map(|c| (c.id, c.status)).collect();
            check_ids(ids, &found, Status::Failed, "requeued")?;
            c
        }
        Selection::Filter(f) => {
            let mut params = filter_params(f).to_vec();
            params.push(Param::Int(Some(i64::from(r.limit))));
            let rows = rows_in(
                e,
                &mut tx,
                b,
                query(Stmt::Shared(Shared::FailedByFilter), params),
            )
            .await?;
            decode_all(&rows, decode_candidate)?
        }
    };
    let ids: Vec<EventId> = cands.iter().map(|c| c.id).collect();
    let sample_ids: Vec<EventId> = ids.iter().take(SAMPLE_IDS).copied().collect();
    if r.context.dry_run || ids.is_empty() {
        e.rollback(tx).await?;
        return Ok(RequeueOutcome {
            count: ids.len() as i64,
            sample_ids,
            audit_id: None,
            leased_keys: Vec::new(),
            replayed: false,
        });
    }
    let selection = match &r.selection {
        Selection::Ids(ids) => serde_json::json!({ "ids": ids }),
        Selection::Filter(f) => serde_json::json!({ "filter": f, "limit": r.limit }),
    };
    let audit = NewAudit {
        context: &r.context,
        action: "requeue",
        box_kind: b,
        selection,
        count: ids.len() as i64,
    };
    let params = [Param::Ids(&ids), Param::Now];
    let (audit_id, leased_keys) = act(e, tx, &cands, &params, Shared::Requeue, audit).await?;
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
    if !r.context.dry_run
        && let Some(rep) =
            replayed(e, &mut tx, "cancel", b, r.context.request_id.as_deref()).await?
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
    let by_id = query(
        Stmt::Shared(Shared::CandidatesById),
        vec![Param::Ids(&r.ids)],
    );
    let rows = rows_in(e, &mut tx, b, by_id).await?;
    let cands = decode_all(&rows, decode_candidate)?;
    let found: Vec<(EventId, Status)> = cands.iter().map(|c| (c.id, c.status)).collect();
    check_ids(&r.ids, &found, Status::Pending, "cancelled")?;
    let ids: Vec<EventId> = cands.iter().map(|c| c.id).collect();
    if r.context.dry_run {
        e.rollback(tx).await?;
        return Ok(CancelOutcome {
            ids,
            audit_id: None,
            leased_keys: Vec::new(),
            replayed: false,
        });
    }
    let audit = NewAudit {
        context: &r.context,
        action: "cancel",
        box_kind: b,
        selection: serde_json::json!({ "ids": ids, "reason": r.reason }),
        count: ids.len() as i64,
    };
    let params = [Param::Ids(&ids), Param::Text(Some(&r.reason)), Param::Now];
    let (audit_id, leased_keys) = act(e, tx, &cands, &params, Shared::Cancel, audit).await?;
    Ok(CancelOutcome {
        ids,
        audit_id: Some(audit_id),
        leased_keys,
        replayed: false,
    })
}

/// The audit action of copying a box's completed events.
fn copy_action(b: BoxKind) -> &'static str {
    match b {
        BoxKind::Outbox => "republish",
        BoxKind::Inbox => "redeliver",
    }
}

async fn copy_selection<E: AdminSql>(
    e: &E,
    b: BoxKind,
    r: &RepublishRequest,
    max_bytes: i64,
) -> StoreResult<RepublishSelection> {
    let mut tx = e.begin().await?;
    if !r.context.dry_run
        && let Some(rep) = replayed(
            e,
            &mut tx,
            copy_action(b),
            b,
            r.context.request_id.as_deref(),
        )
        .await?
    {
        e.rollback(tx).await?;
        return Ok(RepublishSelection::Replayed {
            audit_id: rep.audit_id,
            count: rep.count,
        });
    }
    let ids = match &r.selection {
        Selection::Ids(ids) => ids.clone(),
        Selection::Filter(f) => {
            let mut params = filter_params(f).to_vec();
            params.push(Param::Int(Some(i64::from(r.limit))));
            let q = query(Stmt::Shared(Shared::CompletedByFilter), params);
            let rows = rows_in(e, &mut tx, b, q).await?;
            let c = decode_all(&rows, decode_candidate)?;
            c.iter().map(|c| c.id).collect()
        }
    };
    // Sizes first: the content is read only for a selection within `max_bytes` (a
    // thousand large payloads are not loaded to be refused).
    let q = query(Stmt::Shared(Shared::CopySizes), vec![Param::Ids(&ids)]);
    let rows = rows_in(e, &mut tx, b, q).await?;
    let mut found = Vec::with_capacity(rows.len());
    let mut bytes = 0i64;
    for row in &rows {
        found.push((row.int("id")?, row.status("status")?));
        bytes = bytes.saturating_add(row.int("size")?);
    }
    let action = match b {
        BoxKind::Outbox => "republished",
        BoxKind::Inbox => "redelivered",
    };
    check_ids(&ids, &found, Status::Completed, action)?;
    if r.context.dry_run || ids.is_empty() || bytes > max_bytes {
        e.rollback(tx).await?;
        return Ok(RepublishSelection::Selected {
            ids,
            copies: Vec::new(),
            bytes,
        });
    }
    let q = query(Stmt::Shared(Shared::Copies), vec![Param::Ids(&ids)]);
    let details = decode_all(&rows_in(e, &mut tx, b, q).await?, decode_detail)?;
    e.rollback(tx).await?;
    let copies = {
        details
            .into_iter()
            .map(|d| EventCopy {
                id: d.event.id,
                subscription: d.subscription.unwrap_or_default(),
                message_id: d.message_id,
                topic: d.event.topic,
                key: d.event.key,
                payload: d.event.payload,
                headers: d.event.headers,
                event_type: d.event.event_type,
                max_attempts: d.event.max_attempts,
            })
            .collect()
    };
    Ok(RepublishSelection::Selected { ids, copies, bytes })
}

async fn record_copies<E: AdminSql>(
    e: &E,
    b: BoxKind,
    r: &RepublishRequest,
    count: i64,
) -> StoreResult<i64> {
    let mut tx = e.begin().await?;
    // A call with the same request id that ran at the same time found the same copies
    // (their ids carry the request id) and recorded them first: its entry stands.
    if let Some(rep) = replayed(
        e,
        &mut tx,
        copy_action(b),
        b,
        r.context.request_id.as_deref(),
    )
    .await?
    {
        e.rollback(tx).await?;
        return Ok(rep.audit_id);
    }
    let selection = match &r.selection {
        Selection::Ids(ids) => serde_json::json!({ "ids": ids }),
        Selection::Filter(f) => serde_json::json!({ "filter": f, "limit": r.limit }),
    };
    let audit = NewAudit {
        context: &r.context,
        action: copy_action(b),
        box_kind: b,
        selection,
        count,
    };
    let id = insert_audit(e, &mut tx, &audit).await?;
    e.commit(tx).await?;
    Ok(id)
}

/// Pause (`Shared::Pause`) or resume (`Shared::Resume`) a topic: the row inserted or
/// deleted and, when one was, the audit entry, in one transaction. A pause that finds
/// the topic paused answers with the pause in force.
async fn pause_or_resume<E: AdminSql>(
    e: &E,
    b: BoxKind,
    r: &PauseRequest,
    change: Shared,
) -> StoreResult<PauseOutcome> {
    let ctx = &r.context;
    let mut tx = e.begin().await?;
    let params = match change {
        Shared::Pause => vec![
            Param::Text(Some(&r.topic)),
            Param::Text(Some(&r.reason)),
            Param::Text(Some(&ctx.actor)),
            Param::Text(ctx.principal.as_deref()),
            Param::Now,
        ],
        _ => vec![Param::Text(Some(&r.topic))],
    };
    let rows = rows_in(e, &mut tx, b, query(Stmt::Shared(change), params)).await?;
    let Some(row) = rows.first() else {
        let pause = match change {
            Shared::Pause => {
                let q = query(
                    Stmt::Shared(Shared::Paused),
                    vec![Param::Text(Some(&r.topic))],
                );
                decode_all(&rows_in(e, &mut tx, b, q).await?, decode_pause)?.pop()
            }
            _ => None,
        };
        e.rollback(tx).await?;
        return Ok(PauseOutcome {
            changed: false,
            pause,
            audit_id: None,
        });
    };
    let pause = decode_pause(row)?;
    let what = match b {
        BoxKind::Outbox => "topic",
        BoxKind::Inbox => "subscription",
    };
    let (action, selection) = match change {
        Shared::Pause => (
            "pause",
            serde_json::json!({ what: r.topic, "reason": r.reason }),
        ),
        _ => ("resume", serde_json::json!({ what: r.topic })),
    };
    let audit = NewAudit {
        context: ctx,
        action,
        box_kind: b,
        selection,
        count: 0,
    };
    let audit_id = insert_audit(e, &mut tx, &audit).await?;
    e.commit(tx).await?;
    Ok(PauseOutcome {
        changed: true,
        pause: Some(pause),
        audit_id: Some(audit_id),
    })
}

/// The backlog page from its rows: totals from the first, one group per row with a
/// topic, and the cursor after the last group shown when more follow.
fn pending_page<R: Cols>(q: &PendingQuery, rows: &[R]) -> StoreResult<PendingPage> {
    let first = rows
        .first()
        .ok_or_else(|| StoreError::other("totals row missing"))?;
    let mut page = PendingPage {
        keys: Vec::with_capacity(rows.len()),
        next: None,
        total_pending: first.int("total_pending")?,
        total_keys: first.int("total_keys")?,
        total_blocked_keys: first.int("total_blocked")?,
        paused: Vec::new(),
    };
    for r in rows {
        let Some(topic) = r.opt_text("topic")? else {
            break; // the empty page: totals only
        };
        page.keys.push(decode_backlog(r, topic)?);
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

/// The rows behind `Stats`: counts by (subscription, topic, status), one row of the
/// keyed heads (with the clock, `now`), one row of the unkeyed backlog.
struct StatsRows<R> {
    counts: Vec<R>,
    heads: R,
    unkeyed: R,
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

/// The only row a statement must return.
fn one<R>(rows: Vec<R>, what: &str) -> StoreResult<R> {
    rows.into_iter()
        .next()
        .ok_or_else(|| StoreError::other(format!("{what} row missing")))
}

#[async_trait::async_trait]
impl<E: AdminSql> AdminStore for E {
    async fn list_pending(&self, b: BoxKind, q: &PendingQuery) -> StoreResult<PendingPage> {
        let c = q.after.as_ref();
        let after_pending = c.filter(|c| c.order == PendingOrder::MostPending);
        let after_oldest = c.filter(|c| c.order == PendingOrder::Oldest);
        let params = vec![
            Param::Text(q.topic.as_deref()),
            Param::Text(q.key_prefix.as_deref()),
            Param::Flag(q.only_blocked),
            Param::Int(after_pending.map(|c| c.pending)),
            Param::Micros(after_oldest.map(|c| c.oldest_us)),
            Param::Text(c.map(|c| c.topic.as_str())),
            Param::Text(c.map(|c| c.key.as_str())),
            Param::Int(Some(i64::from(q.page_size) + 1)),
            Param::Text(q.subscription.as_deref()),
            Param::Text(c.map(|c| c.subscription.as_str())),
            Param::Now,
        ];
        let reads = [query(Stmt::Pending(q.order), params)];
        let rows = read(self, Read::Planned, b, &reads).await?;
        pending_page(q, &one(rows, "backlog")?)
    }

    async fn requeue_failed(&self, b: BoxKind, r: &RequeueRequest) -> StoreResult<RequeueOutcome> {
        requeue(self, b, r).await
    }

    async fn cancel_events(&self, b: BoxKind, r: &CancelRequest) -> StoreResult<CancelOutcome> {
        cancel(self, b, r).await
    }

    async fn copy_selection(
        &self,
        b: BoxKind,
        r: &RepublishRequest,
        max_bytes: i64,
    ) -> StoreResult<RepublishSelection> {
        copy_selection(self, b, r, max_bytes).await
    }

    async fn record_copies(
        &self,
        b: BoxKind,
        r: &RepublishRequest,
        count: i64,
    ) -> StoreResult<i64> {
        record_copies(self, b, r, count).await
    }

    async fn add_rates(&self, counts: &[RateCount], prune_before: i64) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        // The table serves both boxes: the box only picks the SQL text's shape.
        let add = self.sql(BoxKind::Outbox, Stmt::Shared(Shared::AddRate));
        for c in counts {
            let params = [
                Param::Text(Some(c.box_kind.as_str())),
                Param::Text(Some(&c.subscription)),
                Param::Int(Some(c.minute)),
                Param::Int(Some(c.n)),
            ];
            self.execute_in(&mut tx, &add, &params).await?;
        }
        let prune = self.sql(BoxKind::Outbox, Stmt::Shared(Shared::PruneRates));
        self.execute_in(&mut tx, &prune, &[Param::Int(Some(prune_before))])
            .await?;
        self.commit(tx).await
    }

    async fn rates(
        &self,
        b: BoxKind,
        subscription: &str,
        since: i64,
    ) -> StoreResult<Vec<(i64, i64)>> {
        let q = query(
            Stmt::Shared(Shared::Rates),
            vec![
                Param::Text(Some(b.as_str())),
                Param::Text(Some(subscription)),
                Param::Int(Some(since)),
            ],
        );
        let rows = one(
            read(self, Read::Plain, BoxKind::Outbox, &[q]).await?,
            "rates",
        )?;
        rows.iter()
            .map(|r| Ok((r.int("minute")?, r.int("n")?)))
            .collect()
    }

    async fn dead_letters(&self, limit: u32) -> StoreResult<Vec<DeadLetter>> {
        let q = query(
            Stmt::Shared(Shared::DeadLetters),
            vec![Param::Int(Some(i64::from(limit)))],
        );
        // The table serves both boxes: the box only picks the SQL text's shape.
        let rows = one(
            read(self, Read::Plain, BoxKind::Outbox, &[q]).await?,
            "dead letters",
        )?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            out.push(DeadLetter {
                box_kind: match r.text("box")?.as_str() {
                    "inbox" => BoxKind::Inbox,
                    _ => BoxKind::Outbox,
                },
                event_id: r.int("event_id")?,
                failed_at: r.time("failed_at")?,
                event: None,
            });
        }
        for b in [BoxKind::Outbox, BoxKind::Inbox] {
            let ids: Vec<EventId> = out
                .iter()
                .filter(|d| d.box_kind == b)
                .map(|d| d.event_id)
                .collect();
            if ids.is_empty() {
                continue;
            }
            let q = query(Stmt::Shared(Shared::Copies), vec![Param::Ids(&ids)]);
            let rows = one(
                read(self, Read::Plain, b, &[q]).await?,
                "dead letter events",
            )?;
            let details: std::collections::HashMap<EventId, EventDetail> = rows
                .iter()
                .map(decode_detail)
                .map(|d| d.map(|d| (d.event.id, d)))
                .collect::<StoreResult<_>>()?;
            for d in out.iter_mut().filter(|d| d.box_kind == b) {
                // One event may have failed twice: each dead letter gets its copy.
                d.event = details.get(&d.event_id).cloned();
            }
        }
        Ok(out)
    }

    async fn drop_dead_letters(&self, done: &[DeadLetter]) -> StoreResult<()> {
        if done.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin().await?;
        let sql = self.sql(BoxKind::Outbox, Stmt::Shared(Shared::DropDeadLetter));
        for d in done {
            let params = [
                Param::Text(Some(d.box_kind.as_str())),
                Param::Int(Some(d.event_id)),
                Param::Time(Some(d.failed_at)),
            ];
            self.execute_in(&mut tx, &sql, &params).await?;
        }
        self.commit(tx).await
    }

    async fn event_detail(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> StoreResult<Option<EventDetail>> {
        let params = vec![Param::Int(Some(id)), Param::Flag(with_payload)];
        let rows = read(self, Read::Plain, b, &[query(Stmt::Detail, params)]).await?;
        one(rows, "detail")?.first().map(decode_detail).transpose()
    }

    async fn list_events(&self, b: BoxKind, q: &EventsQuery) -> StoreResult<EventsPage> {
        let mut params = vec![
            Param::Text(q.status.map(Status::as_str)),
            Param::Int(q.before_id),
        ];
        params.extend(filter_params(&q.filter));
        params.push(Param::Int(Some(i64::from(q.page_size) + 1)));
        let rows = read(
            self,
            Read::Plain,
            b,
            &[query(Stmt::Shared(Shared::Events), params)],
        )
        .await?;
        let mut events = decode_all(&one(rows, "events")?, decode_detail)?;
        let next_before_id = cut_page(&mut events, q.page_size, |e| e.event.id);
        Ok(EventsPage {
            events,
            next_before_id,
        })
    }

    async fn list_audit(&self, page_size: u32, before_id: Option<i64>) -> StoreResult<AuditPage> {
        let params = vec![
            Param::Int(before_id),
            Param::Int(Some(i64::from(page_size) + 1)),
        ];
        // The audit table serves both boxes: the box only picks the SQL text's shape.
        let reads = [query(Stmt::Shared(Shared::Audit), params)];
        let rows = read(self, Read::Plain, BoxKind::Outbox, &reads).await?;
        let mut entries = decode_all(&one(rows, "audit")?, decode_audit)?;
        let next_before_id = cut_page(&mut entries, page_size, |e| e.id);
        Ok(AuditPage {
            entries,
            next_before_id,
        })
    }

    async fn stats(&self, b: BoxKind, subscription: Option<&str>) -> StoreResult<Stats> {
        let sub = Param::Text(subscription);
        let reads = [
            query(Stmt::Shared(Shared::StatsCounts), vec![sub]),
            query(Stmt::StatsHeads, vec![sub, Param::Now]),
            query(Stmt::Shared(Shared::StatsUnkeyed), vec![sub]),
        ];
        let mut rows = read(self, Read::Planned, b, &reads).await?.into_iter();
        let counts = rows.next().unwrap_or_default();
        let heads = one(rows.next().unwrap_or_default(), "heads")?;
        let unkeyed = one(rows.next().unwrap_or_default(), "unkeyed")?;
        stats_of(&StatsRows {
            counts,
            heads,
            unkeyed,
        })
    }

    async fn pause(&self, b: BoxKind, r: &PauseRequest) -> StoreResult<PauseOutcome> {
        pause_or_resume(self, b, r, Shared::Pause).await
    }

    async fn resume(&self, b: BoxKind, r: &PauseRequest) -> StoreResult<PauseOutcome> {
        pause_or_resume(self, b, r, Shared::Resume).await
    }

    async fn paused(&self, b: BoxKind, name: Option<&str>) -> StoreResult<Vec<TopicPause>> {
        let reads = [query(Stmt::Shared(Shared::Paused), vec![Param::Text(name)])];
        let rows = read(self, Read::Plain, b, &reads).await?;
        decode_all(&one(rows, "pauses")?, decode_pause)
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
            let params = vec![
                Param::Text(Some(&k.topic)),
                Param::Text(Some(&k.key)),
                Param::Text(k.subscription.as_deref()),
                Param::Now,
            ];
            let rows = read(self, Read::Plain, b, &[query(Stmt::WakeReleased, params)]).await?;
            if let Some(r) = one(rows, "wake")?.first()
                && r.flag("leased")?
            {
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

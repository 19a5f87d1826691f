//! Operator queries: the service layer of the admin surface. Requests arrive here
//! validated (by `api::admin`) as `domain::admin` values, run against the store's
//! `AdminStore` half, and come back as plain values; store errors become service errors
//! here, once (`From<StoreError>`). Page tokens are opaque to clients: base64 of a small
//! JSON cursor.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::domain::admin::{
    ActionContext, AdminKey, AuditPage, CancelOutcome, CancelRequest, EventCopy, EventDetail,
    EventFilter, EventRef, EventsPage, EventsQuery, MAX_REPUBLISH_BYTES, PauseOutcome,
    PauseRequest, PendingPage, PendingQuery, REDELIVERED_FROM, REPUBLISHED_FROM, RepublishOutcome,
    RepublishRequest, RepublishSelection, RequeueOutcome, RequeueRequest, Rewind, RewindRequest,
    RewindStart, SAMPLE_IDS, Stats, TopicPause, TopicStats,
};
use crate::domain::jobs::{Job, JobKind, JobStart, StartJob};
use crate::domain::{BoxKind, Enqueued, EventId, InboundMessage, NewEvent};
use crate::error::Error;
use crate::intake::Intake;
use crate::schema::SchemaGate;
use crate::store::{Admission, Store};

/// An opaque page token for any cursor.
pub fn encode_token<T: Serialize>(cursor: &T) -> String {
    let json = serde_json::to_vec(cursor).expect("cursors serialize");
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
}

/// Decodes a page token; a malformed one is `INVALID_ARGUMENT` naming `page_token`.
pub fn decode_token<T: for<'de> Deserialize<'de>>(token: &str) -> Result<T, Error> {
    let bad = || Error::invalid("page_token", "is not a token this server issued");
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| bad())?;
    serde_json::from_slice(&bytes).map_err(|_| bad())
}

/// The operator surface over a store: runs the store's admin queries and, after a
/// requeue or cancel, wakes keys that a relay held at that moment once it lets go.
#[derive(Clone)]
pub struct Admin {
    store: Arc<dyn Store>,
    /// How long to keep waking a leased key: at most one relay lease.
    wake_for: Duration,
    /// Writes only while the database's schema allows this binary (`crate::schema`).
    schema: Option<SchemaGate>,
    /// Where republished copies are stored, as every new event is (`with_intake`).
    intake: Option<Intake>,
}

impl Admin {
    /// The operator surface over `store`; held keys are woken for up to `relay_lease`
    /// plus five seconds.
    pub fn new(store: Arc<dyn Store>, relay_lease: Duration) -> Self {
        Admin {
            store,
            wake_for: relay_lease + Duration::from_secs(5),
            schema: None,
            intake: None,
        }
    }

    /// Stores republished copies through `intake` (without one, republish is refused).
    pub fn with_intake(mut self, intake: Intake) -> Self {
        self.intake = Some(intake);
        self
    }

    /// Refuses writes (`SchemaIncompatible`) while `gate` says this binary does not
    /// know the database's schema: an older requeue or cancel could break what a newer
    /// migration keeps (e.g. put an event below a key's cursor, 0011).
    pub fn with_schema(mut self, gate: SchemaGate) -> Self {
        self.schema = Some(gate);
        self
    }

    /// Reads the schema's verdict afresh before a write (writes are rare).
    pub(crate) async fn may_write(&self) -> Result<(), Error> {
        match &self.schema {
            Some(gate) => gate.permit().await,
            None => Ok(()),
        }
    }

    /// The store it runs against.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Publishes completed outbox events again (or, on dry run, counts and samples them).
    /// Each copy is a new event stored through the intake like any other: a new id at
    /// the end of its key's line, its own attempts, the original's id in the header
    /// `mailroom-republished-from`. The copies of one call are one transaction, each
    /// with the idempotency key `mailroom.republish/<request id>/<original id>`, so a
    /// call retried with its request id after the copies were stored but before the
    /// audit entry was (a crash between the two) stores no second copy. Without a
    /// request id a random one is used.
    pub async fn republish(&self, r: &RepublishRequest) -> Result<RepublishOutcome, Error> {
        self.copy(BoxKind::Outbox, r).await
    }

    /// Hands handled inbox messages to their handler again (or, on dry run, counts and
    /// samples them). Each copy is a new inbox message stored as a received one is: at
    /// the end of its key's line in its subscription, its own attempts, the message id
    /// `redeliver:<request id>:<original id>` (so a retried call stores no second copy)
    /// and the original's id in the header `mailroom-redelivered-from`.
    pub async fn redeliver(&self, r: &RepublishRequest) -> Result<RepublishOutcome, Error> {
        self.copy(BoxKind::Inbox, r).await
    }

    /// Republish (outbox) or redeliver (inbox): select, copy, record.
    async fn copy(&self, b: BoxKind, r: &RepublishRequest) -> Result<RepublishOutcome, Error> {
        if !r.context.dry_run {
            self.may_write().await?;
        }
        let max_bytes = MAX_REPUBLISH_BYTES as i64;
        let (ids, originals, bytes) = match self.store.copy_selection(b, r, max_bytes).await? {
            RepublishSelection::Replayed { audit_id, count } => {
                return Ok(RepublishOutcome {
                    count,
                    sample_ids: Vec::new(),
                    audit_id: Some(audit_id),
                    replayed: true,
                    copies: Vec::new(),
                });
            }
            RepublishSelection::Selected { ids, copies, bytes } => (ids, copies, bytes),
        };
        let mut out = RepublishOutcome {
            count: ids.len() as i64,
            sample_ids: ids.iter().take(SAMPLE_IDS).copied().collect(),
            audit_id: None,
            replayed: false,
            copies: Vec::new(),
        };
        if r.context.dry_run || ids.is_empty() {
            return Ok(out);
        }
        if bytes > max_bytes {
            return Err(Error::invalid(
                "limit",
                format!(
                    "the {} selected events hold {bytes} bytes, over the {MAX_REPUBLISH_BYTES} \
                     one call copies: lower the limit or narrow the filter",
                    ids.len()
                ),
            ));
        }
        let rid = r
            .context
            .request_id
            .clone()
            .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
        let copies = self.store_copies(b, originals, &rid).await?;
        out.copies = ids.iter().copied().zip(copies).collect();
        out.audit_id = Some(self.store.record_copies(b, r, out.count).await?);
        Ok(out)
    }

    /// Stores the copies of a republish (outbox) or redelivery (inbox) under request id
    /// `rid`; their ids, in the originals' order.
    pub(crate) async fn store_copies(
        &self,
        b: BoxKind,
        originals: Vec<EventCopy>,
        rid: &str,
    ) -> Result<Vec<EventId>, Error> {
        match b {
            BoxKind::Outbox => self.republish_copies(originals, rid).await,
            BoxKind::Inbox => self.redeliver_copies(originals, rid).await,
        }
    }

    /// Starts a background job (see `JobStore::start_job`), or on a dry run counts and
    /// samples its selection.
    pub async fn start_job(&self, r: &StartJob) -> Result<JobStart, Error> {
        if !r.context.dry_run {
            self.may_write().await?;
        }
        if r.kind == JobKind::Republish && self.intake.is_none() {
            return Err(Error::FailedPrecondition(
                "republish is served by the gRPC AdminService only".into(),
            ));
        }
        Ok(self.store.start_job(r).await?)
    }

    /// One job; `NotFound` if there is no such job.
    pub async fn job(&self, id: i64) -> Result<Job, Error> {
        self.store
            .job(id)
            .await?
            .ok_or_else(|| Error::NotFound(format!("job {id}")))
    }

    /// Up to `page_size` jobs with ids below `before_id`, newest first, and where the
    /// next page starts.
    pub async fn jobs(
        &self,
        page_size: u32,
        before_id: Option<i64>,
    ) -> Result<(Vec<Job>, Option<i64>), Error> {
        let mut jobs = self.store.jobs(page_size + 1, before_id).await?;
        let next = (jobs.len() > page_size as usize).then(|| {
            jobs.truncate(page_size as usize);
            jobs.last().map(|j| j.id).unwrap_or_default()
        });
        Ok((jobs, next))
    }

    /// Asks a running job to stop after its current page; `false` when it was not
    /// running. `NotFound` if there is no such job.
    pub async fn cancel_job(&self, id: i64, by: &ActionContext) -> Result<(Job, bool), Error> {
        self.may_write().await?;
        self.store
            .cancel_job(id, by)
            .await?
            .ok_or_else(|| Error::NotFound(format!("job {id}")))
    }

    /// Asks the consumers of a subscription to go back to a time (or, on a dry run,
    /// counts the messages stored since then); see `store::rewinds`.
    pub async fn rewind(&self, r: &RewindRequest) -> Result<RewindStart, Error> {
        if !r.context.dry_run {
            self.may_write().await?;
        }
        Ok(self.store.start_rewind(r).await?)
    }

    /// Up to `limit` rewinds, newest first (of one subscription, or all).
    pub async fn rewinds(
        &self,
        subscription: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Rewind>, Error> {
        Ok(self.store.rewinds(subscription, None, limit).await?)
    }

    /// Stores the outbox copies through the intake, in one transaction; their ids.
    async fn republish_copies(
        &self,
        originals: Vec<EventCopy>,
        rid: &str,
    ) -> Result<Vec<EventId>, Error> {
        let intake = self.intake.as_ref().ok_or_else(|| {
            Error::FailedPrecondition("republish is served by the gRPC AdminService only".into())
        })?;
        let events: Vec<NewEvent> = originals.into_iter().map(|o| copy_of(o, rid)).collect();
        let stored = intake.submit(events, true).await?;
        Ok(stored
            .into_iter()
            .map(|e| match e {
                Enqueued::Inserted(id) | Enqueued::Duplicate(id) => id,
            })
            .collect())
    }

    /// Stores the inbox copies as received messages, one transaction per subscription;
    /// their ids, in the originals' order.
    async fn redeliver_copies(
        &self,
        originals: Vec<EventCopy>,
        rid: &str,
    ) -> Result<Vec<EventId>, Error> {
        let mut by_sub: std::collections::BTreeMap<String, Vec<(usize, InboundMessage)>> =
            Default::default();
        let n = originals.len();
        for (i, o) in originals.into_iter().enumerate() {
            by_sub
                .entry(o.subscription.clone())
                .or_default()
                .push((i, redelivery_of(o, rid)));
        }
        let mut ids = vec![0; n];
        for (sub, items) in by_sub {
            let (at, messages): (Vec<usize>, Vec<InboundMessage>) = items.into_iter().unzip();
            let stored = self.store.receive(&sub, &messages).await?;
            for (i, a) in at.into_iter().zip(stored) {
                ids[i] = match a {
                    Admission::Inserted(id) | Admission::Duplicate(id) => id,
                    Admission::Conflict => {
                        return Err(Error::Internal(
                            "a redelivery's message id conflicted".into(),
                        ));
                    }
                };
            }
        }
        Ok(ids)
    }

    /// One page of a box's backlog, grouped by key; in the outbox, with the paused topics
    /// (within the topic filter) and each group of a paused topic marked.
    pub async fn list_pending(&self, b: BoxKind, q: &PendingQuery) -> Result<PendingPage, Error> {
        let mut page = self.store.list_pending(b, q).await?;
        if b == BoxKind::Outbox {
            page.paused = self.store.paused(b, q.topic.as_deref()).await?;
            for k in &mut page.keys {
                k.paused = page.paused.iter().any(|p| p.topic == k.topic);
            }
        }
        Ok(page)
    }

    /// Pauses publishing an outbox topic, or dispatching an inbox subscription (`b`; see
    /// `AdminStore::pause`): its events stay pending and spend no attempt; lines a relay
    /// or dispatcher already claimed finish.
    pub async fn pause(&self, b: BoxKind, r: &PauseRequest) -> Result<PauseOutcome, Error> {
        self.may_write().await?;
        Ok(self.store.pause(b, r).await?)
    }

    /// Lifts a pause; relays (dispatchers) claim its keys at their next cycle, in their
    /// order.
    pub async fn resume(&self, b: BoxKind, r: &PauseRequest) -> Result<PauseOutcome, Error> {
        self.may_write().await?;
        Ok(self.store.resume(b, r).await?)
    }

    /// The paused outbox topics (inbox subscriptions), by name.
    pub async fn paused(&self, b: BoxKind) -> Result<Vec<TopicPause>, Error> {
        Ok(self.store.paused(b, None).await?)
    }

    /// Puts failed events back in line (see `AdminStore::requeue_failed`), then wakes the
    /// keys a relay held meanwhile once it lets go.
    pub async fn requeue(&self, b: BoxKind, r: &RequeueRequest) -> Result<RequeueOutcome, Error> {
        self.may_write().await?;
        let out = self.store.requeue_failed(b, r).await?;
        self.wake_later(b, out.leased_keys.clone());
        Ok(out)
    }

    /// Fails pending events with the operator's reason (see `AdminStore::cancel_events`), then
    /// wakes the keys a relay held meanwhile once it lets go.
    pub async fn cancel(&self, b: BoxKind, r: &CancelRequest) -> Result<CancelOutcome, Error> {
        self.may_write().await?;
        let out = self.store.cancel_events(b, r).await?;
        self.wake_later(b, out.leased_keys.clone());
        Ok(out)
    }

    /// One event, with its payload if asked for; `NotFound` if there is no such event.
    pub async fn get_event(
        &self,
        b: BoxKind,
        id: EventId,
        with_payload: bool,
    ) -> Result<EventDetail, Error> {
        self.store
            .event_detail(b, id, with_payload)
            .await?
            .ok_or_else(|| Error::NotFound(format!("event {id}")))
    }

    /// One event named by id, idempotency key or message id (found through the same
    /// indexed filter `ListEvents` uses); `NotFound` if there is none, `InvalidArgument`
    /// naming `subscription` when a message id is held by several subscriptions.
    pub async fn find_event(
        &self,
        b: BoxKind,
        by: &EventRef,
        with_payload: bool,
    ) -> Result<EventDetail, Error> {
        let (filter, what) = match by {
            EventRef::Id(id) => return self.get_event(b, *id, with_payload).await,
            EventRef::IdempotencyKey(k) => (
                EventFilter {
                    idempotency_key: Some(k.clone()),
                    ..Default::default()
                },
                format!("event with idempotency key {k:?}"),
            ),
            EventRef::MessageId {
                message_id,
                subscription,
            } => (
                EventFilter {
                    message_id: Some(message_id.clone()),
                    subscription: subscription.clone(),
                    ..Default::default()
                },
                format!("message with id {message_id:?}"),
            ),
        };
        let q = EventsQuery {
            status: None,
            filter,
            page_size: 2,
            before_id: None,
        };
        let page = self.store.list_events(b, &q).await?;
        match page.events.as_slice() {
            [] => Err(Error::NotFound(what)),
            [one] => self.get_event(b, one.event.id, with_payload).await,
            _ => Err(Error::invalid(
                "subscription",
                format!("several subscriptions hold a {what}: name one"),
            )),
        }
    }

    /// One page of a box's events, newest first, without payloads.
    pub async fn list_events(&self, b: BoxKind, q: &EventsQuery) -> Result<EventsPage, Error> {
        Ok(self.store.list_events(b, q).await?)
    }

    /// One page of the audit log (both boxes), newest first: up to `page_size` entries with
    /// ids below `before_id` (`None`: from the newest).
    pub async fn list_audit(
        &self,
        page_size: u32,
        before_id: Option<i64>,
    ) -> Result<AuditPage, Error> {
        Ok(self.store.list_audit(page_size, before_id).await?)
    }

    /// Counts of a box; `subscription` narrows the inbox to one subscription.
    /// In the outbox, paused topics are marked (listed with zero counts when they hold
    /// no events); in the inbox, the rows of paused subscriptions.
    pub async fn stats(&self, b: BoxKind, subscription: Option<&str>) -> Result<Stats, Error> {
        let mut stats = self.store.stats(b, subscription).await?;
        let paused = self.store.paused(b, None).await?;
        if b == BoxKind::Inbox {
            for t in &mut stats.topics {
                t.paused = paused.iter().any(|p| p.topic == t.subscription);
            }
        } else {
            for p in paused {
                match stats.topics.iter_mut().find(|t| t.topic == p.topic) {
                    Some(t) => t.paused = true,
                    None => stats.topics.push(TopicStats {
                        topic: p.topic,
                        paused: true,
                        ..Default::default()
                    }),
                }
            }
            stats.topics.sort_by(|a, b| a.topic.cmp(&b.topic));
        }
        Ok(stats)
    }

    /// A relay that held a key during a requeue or cancel sets the key's readiness from
    /// what it saw when it releases it, which may park the key although it now has
    /// work. Wake such keys once they are released (waking early is always harmless).
    pub(crate) fn wake_later(&self, b: BoxKind, mut keys: Vec<AdminKey>) {
        if keys.is_empty() {
            return;
        }
        let store = self.store.clone();
        let deadline = tokio::time::Instant::now() + self.wake_for;
        tokio::spawn(async move {
            while !keys.is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                match store.wake_released_keys(b, &keys).await {
                    Ok(still_leased) => keys = still_leased,
                    Err(e) => tracing::warn!(error = %e, "waking requeued keys failed"),
                }
            }
        });
    }
}

/// The inbox message that hands `o` to its handler again under request id `rid`.
fn redelivery_of(o: EventCopy, rid: &str) -> InboundMessage {
    let mut headers = o.headers;
    headers.insert(REDELIVERED_FROM.to_string(), o.id.to_string());
    InboundMessage {
        message_id: format!("redeliver:{rid}:{}", o.id),
        topic: o.topic,
        key: o.key,
        payload: o.payload,
        headers,
        event_type: o.event_type,
        max_attempts: o.max_attempts,
        failure: None,
    }
}

/// The new event that republishes `o` under request id `rid`.
fn copy_of(o: EventCopy, rid: &str) -> NewEvent {
    let mut headers = o.headers;
    headers.insert(REPUBLISHED_FROM.to_string(), o.id.to_string());
    NewEvent {
        topic: o.topic,
        key: o.key,
        payload: o.payload,
        headers,
        event_type: o.event_type,
        idempotency_key: Some(format!("mailroom.republish/{rid}/{}", o.id)),
        deliver_after: None,
        max_attempts: o.max_attempts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::admin::{PendingCursor, PendingOrder};

    #[test]
    fn a_copy_keeps_the_content_and_names_its_original() {
        let mut headers = std::collections::BTreeMap::new();
        headers.insert("trace".to_string(), "t1".to_string());
        headers.insert(REPUBLISHED_FROM.to_string(), "3".to_string());
        let o = EventCopy {
            id: 17,
            subscription: String::new(),
            message_id: None,
            topic: "orders".into(),
            key: Some("k".into()),
            payload: b"p".to_vec(),
            headers,
            event_type: Some("order.placed".into()),
            max_attempts: 9,
        };
        let e = copy_of(o, "r1");
        assert_eq!(e.headers[REPUBLISHED_FROM], "17", "the immediate original");
        assert_eq!(e.headers["trace"], "t1");
        assert_eq!(
            e.idempotency_key.as_deref(),
            Some("mailroom.republish/r1/17")
        );
        assert_eq!(
            (
                e.topic.as_str(),
                e.key.as_deref(),
                e.max_attempts,
                e.deliver_after
            ),
            ("orders", Some("k"), 9, None)
        );
    }

    #[test]
    fn tokens_round_trip_and_garbage_is_invalid() {
        let c = PendingCursor {
            order: PendingOrder::Oldest,
            pending: 3,
            oldest_us: 17,
            subscription: "billing".into(),
            topic: "t".into(),
            key: "k/é".into(),
        };
        let t = encode_token(&c);
        assert_eq!(decode_token::<PendingCursor>(&t).unwrap(), c);
        // A token made before the inbox existed has no subscription: still valid.
        let old = r#"{"order":"MostPending","pending":2,"oldest_us":1,"topic":"t","key":"k"}"#;
        let old = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(old);
        assert_eq!(
            decode_token::<PendingCursor>(&old).unwrap().subscription,
            ""
        );
        for bad in ["", "!!", "eyJ4Ijox", &encode_token(&5i64)] {
            match decode_token::<PendingCursor>(bad) {
                Err(Error::InvalidArgument(v)) => assert_eq!(v[0].field, "page_token"),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }
}

//! AdminService requests validated into operator queries (`crate::domain::admin`), and
//! the answers mapped back to the wire: fields, filters, page sizes and page tokens.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::admin::{decode_token, encode_token};
use crate::domain::admin::{
    ActionContext, AuditEntry, CancelRequest, DEFAULT_REQUEUE, EventDetail, EventFilter, EventRef,
    KeyBacklog, MAX_CANCEL, MAX_REPUBLISH, MAX_REQUEUE, PauseRequest, PendingCursor, PendingOrder,
    PendingQuery, RepublishRequest, RequeueRequest, Selection, TopicPause,
};
use crate::domain::{BoxKind, Status as EventStatus, check_topic};
use crate::error::{Error, FieldViolation};
use crate::pb;
use crate::pb::time::{timestamp, to_timestamp};

const DEFAULT_PAGE: u32 = 100;
const MAX_PAGE: u32 = 1000;

/// The box a request names.
pub fn box_kind(v: i32) -> Result<BoxKind, Error> {
    match pb::Box::try_from(v) {
        Ok(pb::Box::Unspecified | pb::Box::Outbox) => Ok(BoxKind::Outbox),
        Ok(pb::Box::Inbox) => Ok(BoxKind::Inbox),
        Err(_) => Err(Error::invalid("box", format!("unknown box {v}"))),
    }
}

/// An optional subscription filter: the inbox's alone (the outbox has none, so asking
/// for one there is a mistake worth saying, not an empty answer).
pub(super) fn subscription(b: BoxKind, s: String, field: &str) -> Result<Option<String>, Error> {
    match (b, non_empty(s)) {
        (BoxKind::Outbox, Some(_)) => Err(Error::invalid(
            field,
            "applies to the inbox only (box = BOX_INBOX)",
        )),
        (_, s) => Ok(s),
    }
}

pub(super) fn pb_box(b: BoxKind) -> pb::Box {
    match b {
        BoxKind::Outbox => pb::Box::Outbox,
        BoxKind::Inbox => pb::Box::Inbox,
    }
}

pub(super) fn page_size(v: u32) -> Result<u32, Error> {
    match v {
        0 => Ok(DEFAULT_PAGE),
        1..=MAX_PAGE => Ok(v),
        _ => Err(Error::invalid(
            "page_size",
            format!("must be 1..={MAX_PAGE}"),
        )),
    }
}

pub(super) fn non_empty(s: String) -> Option<String> {
    if s.is_empty() { None } else { Some(s) }
}

/// Validates a filter for box `b`; `field` prefixes violation paths.
pub fn event_filter(
    b: BoxKind,
    f: Option<pb::EventFilter>,
    field: &str,
) -> Result<EventFilter, Error> {
    let f = f.unwrap_or_default();
    let mut v = Vec::new();
    let name = |n: &str| format!("{field}.{n}");
    for (value, field) in [
        (&f.subscription, "subscription"),
        (&f.message_id, "message_id"),
    ] {
        if b == BoxKind::Outbox && !value.is_empty() {
            v.push(FieldViolation::new(
                name(field),
                "applies to the inbox only (box = BOX_INBOX)",
            ));
        }
    }
    if !f.topic.is_empty()
        && let Err(why) = check_topic(&f.topic)
    {
        v.push(FieldViolation::new(name("topic"), why));
    }
    let mut time = |t: Option<prost_types::Timestamp>, n: &str| match t {
        None => None,
        Some(t) => {
            let parsed = timestamp(&t);
            if parsed.is_none() {
                v.push(FieldViolation::new(name(n), "is not a valid timestamp"));
            }
            parsed
        }
    };
    let updated_after = time(f.updated_after, "updated_after");
    let updated_before = time(f.updated_before, "updated_before");
    let created_after = time(f.created_after, "created_after");
    let created_before = time(f.created_before, "created_before");
    for (after, before, n) in [
        (updated_after, updated_before, "updated"),
        (created_after, created_before, "created"),
    ] {
        if let (Some(a), Some(b)) = (after, before)
            && a >= b
        {
            v.push(FieldViolation::new(
                name(&format!("{n}_before")),
                format!("must be later than {n}_after"),
            ));
        }
    }
    if !f.key.is_empty() && !f.key_prefix.is_empty() {
        v.push(FieldViolation::new(
            name("key_prefix"),
            "give either key or key_prefix, not both",
        ));
    }
    if !v.is_empty() {
        return Err(Error::InvalidArgument(v));
    }
    Ok(EventFilter {
        subscription: non_empty(f.subscription),
        topic: non_empty(f.topic),
        key: non_empty(f.key),
        event_type: non_empty(f.r#type),
        updated_after,
        updated_before,
        error_contains: non_empty(f.error_contains),
        key_prefix: non_empty(f.key_prefix),
        created_after,
        created_before,
        headers: f.headers.into_iter().collect(),
        idempotency_key: non_empty(f.idempotency_key),
        message_id: non_empty(f.message_id),
        after_id: None,
        through_id: None,
    })
}

pub(super) fn filter_is_empty(f: &EventFilter) -> bool {
    *f == EventFilter::default()
}

/// Validates a `ListPending` request.
pub fn pending_query(b: BoxKind, r: pb::ListPendingRequest) -> Result<PendingQuery, Error> {
    let order = match pb::PendingOrder::try_from(r.order) {
        Ok(pb::PendingOrder::Unspecified | pb::PendingOrder::MostPending) => {
            PendingOrder::MostPending
        }
        Ok(pb::PendingOrder::Oldest) => PendingOrder::Oldest,
        Err(_) => {
            return Err(Error::invalid(
                "order",
                format!("unknown order {}", r.order),
            ));
        }
    };
    if !r.topic.is_empty()
        && let Err(why) = check_topic(&r.topic)
    {
        return Err(Error::invalid("topic", why));
    }
    let after = if r.page_token.is_empty() {
        None
    } else {
        let c: PendingCursor = decode_token(&r.page_token)?;
        if c.order != order {
            return Err(Error::invalid(
                "page_token",
                "was issued for another order; repeat the request with the same order",
            ));
        }
        Some(c)
    };
    Ok(PendingQuery {
        subscription: subscription(b, r.subscription, "subscription")?,
        topic: non_empty(r.topic),
        key_prefix: non_empty(r.key_prefix),
        only_blocked: r.only_blocked,
        order,
        page_size: page_size(r.page_size)?,
        after,
    })
}

/// A request_id: at most 128 printable ASCII characters; empty means none.
pub(crate) fn request_id(v: String) -> Result<Option<String>, Error> {
    if v.is_empty() {
        return Ok(None);
    }
    if v.len() > 128 || !v.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(Error::invalid(
            "request_id",
            "must be at most 128 printable ASCII characters",
        ));
    }
    Ok(Some(v))
}

/// How a `GetEvent` request names its event: exactly one of id, idempotency key
/// (outbox) and message id (inbox, with an optional subscription).
pub fn event_ref(b: BoxKind, r: pb::GetEventRequest) -> Result<EventRef, Error> {
    let named = [
        r.id != 0,
        !r.idempotency_key.is_empty(),
        !r.message_id.is_empty(),
    ]
    .iter()
    .filter(|n| **n)
    .count();
    if named != 1 {
        return Err(Error::invalid(
            "id",
            "name the event by exactly one of id, idempotency_key (outbox) and message_id (inbox)",
        ));
    }
    if !r.subscription.is_empty() && r.message_id.is_empty() {
        return Err(Error::invalid("subscription", "goes with message_id"));
    }
    match b {
        BoxKind::Outbox if !r.message_id.is_empty() => Err(Error::invalid(
            "message_id",
            "applies to the inbox only (box = BOX_INBOX)",
        )),
        BoxKind::Inbox if !r.idempotency_key.is_empty() => Err(Error::invalid(
            "idempotency_key",
            "applies to the outbox (an inbox message is named by message_id)",
        )),
        _ if !r.idempotency_key.is_empty() => Ok(EventRef::IdempotencyKey(r.idempotency_key)),
        _ if !r.message_id.is_empty() => Ok(EventRef::MessageId {
            message_id: r.message_id,
            subscription: non_empty(r.subscription),
        }),
        _ => Ok(EventRef::Id(r.id)),
    }
}

/// Validates a `RequeueFailed` request; `context` names the authenticated caller.
pub fn requeue_request(
    b: BoxKind,
    r: pb::RequeueFailedRequest,
    context: ActionContext,
) -> Result<RequeueRequest, Error> {
    let filter = event_filter(b, r.filter, "filter")?;
    let limit = match r.limit {
        0 => DEFAULT_REQUEUE,
        l if l > MAX_REQUEUE => {
            return Err(Error::invalid(
                "limit",
                format!("must be at most {MAX_REQUEUE}"),
            ));
        }
        l => l,
    };
    let selection = selection(r.ids, filter, limit, r.all || r.dry_run, "failed")?;
    Ok(RequeueRequest {
        selection,
        limit,
        context: ActionContext {
            dry_run: r.dry_run,
            request_id: request_id(r.request_id)?,
            ..context
        },
    })
}

/// Ids or a filter, not both; ids sorted, distinct and at most `limit`. An empty filter
/// selects every `what` event of the box: only on purpose (`all`, or a dry run).
fn selection(
    ids: Vec<i64>,
    filter: EventFilter,
    limit: u32,
    all: bool,
    what: &str,
) -> Result<Selection, Error> {
    if ids.is_empty() {
        if filter_is_empty(&filter) && !all {
            return Err(Error::invalid(
                "all",
                format!(
                    "an empty filter selects every {what} event: set all = true (--all) to mean it"
                ),
            ));
        }
        return Ok(Selection::Filter(filter));
    }
    if !filter_is_empty(&filter) {
        return Err(Error::invalid(
            "ids",
            "give either ids or a filter, not both",
        ));
    }
    let mut ids = ids;
    ids.sort_unstable();
    ids.dedup();
    if ids.len() > limit as usize {
        return Err(Error::invalid(
            "ids",
            format!("{} ids exceed the limit of {limit}", ids.len()),
        ));
    }
    Ok(Selection::Ids(ids))
}

/// Validates a `RepublishEvents` request (outbox only); `context` names the
/// authenticated caller. Without `confirm` it is a dry run.
pub fn republish_request(
    r: pb::RepublishEventsRequest,
    context: ActionContext,
) -> Result<RepublishRequest, Error> {
    copy_request(
        BoxKind::Outbox,
        CopyFields {
            ids: r.ids,
            filter: r.filter,
            limit: r.limit,
            confirm: r.confirm,
            all: r.all,
            request_id: r.request_id,
        },
        context,
    )
}

/// Validates a `RedeliverMessages` request (inbox); without `confirm` it is a dry run.
pub fn redeliver_request(
    r: pb::RedeliverMessagesRequest,
    context: ActionContext,
) -> Result<RepublishRequest, Error> {
    copy_request(
        BoxKind::Inbox,
        CopyFields {
            ids: r.ids,
            filter: r.filter,
            limit: r.limit,
            confirm: r.confirm,
            all: r.all,
            request_id: r.request_id,
        },
        context,
    )
}

/// The fields `RepublishEvents` and `RedeliverMessages` share.
struct CopyFields {
    ids: Vec<i64>,
    filter: Option<pb::EventFilter>,
    limit: u32,
    confirm: bool,
    all: bool,
    request_id: String,
}

fn copy_request(
    b: BoxKind,
    r: CopyFields,
    context: ActionContext,
) -> Result<RepublishRequest, Error> {
    let filter = event_filter(b, r.filter, "filter")?;
    let limit = match r.limit {
        0 => MAX_REPUBLISH,
        l if l > MAX_REPUBLISH => {
            return Err(Error::invalid(
                "limit",
                format!(
                    "must be at most {MAX_REPUBLISH} (republish larger selections in several calls)"
                ),
            ));
        }
        l => l,
    };
    let dry_run = !r.confirm;
    let what = match b {
        BoxKind::Outbox => "completed",
        BoxKind::Inbox => "handled",
    };
    let selection = selection(r.ids, filter, limit, r.all || dry_run, what)?;
    Ok(RepublishRequest {
        selection,
        limit,
        context: ActionContext {
            dry_run,
            request_id: request_id(r.request_id)?,
            ..context
        },
    })
}

/// Validates a `CancelEvents` request; `context` names the authenticated caller.
pub fn cancel_request(
    r: pb::CancelEventsRequest,
    context: ActionContext,
) -> Result<CancelRequest, Error> {
    let request_id = request_id(r.request_id.clone())?;
    let mut v = Vec::new();
    if r.ids.is_empty() {
        v.push(FieldViolation::new(
            "ids",
            "name at least one pending event",
        ));
    }
    if r.ids.len() > MAX_CANCEL {
        v.push(FieldViolation::new(
            "ids",
            format!("at most {MAX_CANCEL} per call"),
        ));
    }
    let reason = r.reason.trim().to_string();
    if reason.is_empty() {
        v.push(FieldViolation::new(
            "reason",
            "is required (it becomes the events' last error)",
        ));
    } else if reason.len() > 1000 {
        v.push(FieldViolation::new("reason", "must be at most 1000 bytes"));
    }
    if !v.is_empty() {
        return Err(Error::InvalidArgument(v));
    }
    let mut ids = r.ids;
    ids.sort_unstable();
    ids.dedup();
    Ok(CancelRequest {
        ids,
        reason,
        context: ActionContext {
            dry_run: r.dry_run,
            request_id,
            ..context
        },
    })
}

/// The cursor of id-ordered pages (events, audit).
#[derive(Serialize, Deserialize)]
struct BeforeId {
    before: i64,
}

pub(super) fn before_id(token: &str) -> Result<Option<i64>, Error> {
    if token.is_empty() {
        return Ok(None);
    }
    Ok(Some(decode_token::<BeforeId>(token)?.before))
}

pub(super) fn before_token(id: Option<i64>) -> String {
    id.map(|before| encode_token(&BeforeId { before }))
        .unwrap_or_default()
}

pub(super) fn event_status(v: i32) -> Result<Option<EventStatus>, Error> {
    match pb::EventStatus::try_from(v) {
        Ok(pb::EventStatus::Unspecified) => Ok(None),
        Ok(pb::EventStatus::Pending) => Ok(Some(EventStatus::Pending)),
        Ok(pb::EventStatus::Completed) => Ok(Some(EventStatus::Completed)),
        Ok(pb::EventStatus::Failed) => Ok(Some(EventStatus::Failed)),
        Err(_) => Err(Error::invalid("status", format!("unknown status {v}"))),
    }
}

pub(super) fn pb_status(s: EventStatus) -> pb::EventStatus {
    match s {
        EventStatus::Pending => pb::EventStatus::Pending,
        EventStatus::Completed => pb::EventStatus::Completed,
        EventStatus::Failed => pb::EventStatus::Failed,
    }
}

/// An event as the wire shows it.
pub fn event_info(d: EventDetail) -> pb::EventInfo {
    let e = d.event;
    let subscription = d.subscription.unwrap_or_default();
    let message_id = d.message_id.unwrap_or_default();
    pb::EventInfo {
        id: e.id,
        topic: e.topic,
        key: e.key.unwrap_or_default(),
        r#type: e.event_type.unwrap_or_default(),
        status: pb_status(e.status) as i32,
        attempts: e.attempts,
        max_attempts: e.max_attempts,
        scheduled_at: Some(to_timestamp(e.scheduled_at)),
        created_at: Some(to_timestamp(e.created_at)),
        updated_at: Some(to_timestamp(e.updated_at)),
        published_at: e.published_at.map(to_timestamp),
        last_error: e.last_error.unwrap_or_default(),
        payload_size: d.payload_size,
        headers: e.headers.into_iter().collect::<HashMap<_, _>>(),
        payload: e.payload,
        idempotency_key: e.idempotency_key.unwrap_or_default(),
        subscription,
        message_id,
        attempt_history: d
            .attempt_log
            .into_iter()
            .map(|a| pb::AttemptRecord {
                attempt: a.attempt,
                at: Some(to_timestamp(a.at)),
                error: a.error,
            })
            .collect(),
    }
}

pub(super) fn key_backlog(k: KeyBacklog) -> pb::KeyBacklog {
    pb::KeyBacklog {
        topic: k.topic,
        key: k.key,
        pending: k.pending,
        oldest_created_at: Some(to_timestamp(k.oldest_created_at)),
        head_id: k.head_id,
        head_attempts: k.head_attempts,
        head_next_attempt_at: Some(to_timestamp(k.head_next_attempt_at)),
        head_last_error: k.head_last_error.unwrap_or_default(),
        blocked: k.blocked,
        subscription: k.subscription,
        paused: k.paused,
    }
}

pub(super) fn topic_pause(p: TopicPause) -> pb::TopicPause {
    pb::TopicPause {
        topic: p.topic,
        reason: p.reason,
        actor: p.actor,
        principal: p.principal.unwrap_or_default(),
        paused_at: Some(to_timestamp(p.paused_at)),
    }
}

pub(super) fn subscription_pause(p: TopicPause) -> pb::SubscriptionPause {
    pb::SubscriptionPause {
        subscription: p.topic,
        reason: p.reason,
        actor: p.actor,
        principal: p.principal.unwrap_or_default(),
        paused_at: Some(to_timestamp(p.paused_at)),
    }
}

/// Validates a `PauseSubscription` (`reason` required; the subscription one of
/// `configured`, else `NOT_FOUND`: a typo must not pause nothing silently) or a
/// `ResumeSubscription` (`reason` None; any name, so that a pause left on a subscription
/// no longer configured can be lifted). The name goes in `PauseRequest::topic`.
pub fn subscription_pause_request(
    subscription: String,
    reason: Option<String>,
    context: ActionContext,
    configured: &[String],
) -> Result<PauseRequest, Error> {
    let mut v = Vec::new();
    if subscription.trim().is_empty() {
        v.push(FieldViolation::new("subscription", "is required"));
    } else if subscription.len() > 1000 {
        v.push(FieldViolation::new(
            "subscription",
            "must be at most 1000 bytes",
        ));
    }
    let pausing = reason.is_some();
    let reason = pause_reason(reason, &mut v);
    if !v.is_empty() {
        return Err(Error::InvalidArgument(v));
    }
    if pausing && !configured.contains(&subscription) {
        return Err(Error::NotFound(format!(
            "no subscription named {subscription:?} is configured on this service"
        )));
    }
    Ok(PauseRequest {
        topic: subscription,
        reason,
        context,
    })
}

/// A pause's reason (required, trimmed, at most 1000 bytes; a resume has none: `""`),
/// its violations pushed to `v`.
fn pause_reason(reason: Option<String>, v: &mut Vec<FieldViolation>) -> String {
    let reason = reason.map(|r| r.trim().to_string());
    match reason.as_deref() {
        Some("") => v.push(FieldViolation::new(
            "reason",
            "is required (it is shown with the pause)",
        )),
        Some(r) if r.len() > 1000 => {
            v.push(FieldViolation::new("reason", "must be at most 1000 bytes"))
        }
        _ => {}
    }
    reason.unwrap_or_default()
}

/// Validates a `PauseTopic` (`reason` required) or `ResumeTopic` (`reason` None)
/// request's topic and reason; `context` names the authenticated caller.
pub fn pause_request(
    topic: String,
    reason: Option<String>,
    context: ActionContext,
) -> Result<PauseRequest, Error> {
    let mut v = Vec::new();
    if let Err(why) = check_topic(&topic) {
        v.push(FieldViolation::new("topic", why));
    }
    let reason = pause_reason(reason, &mut v);
    if !v.is_empty() {
        return Err(Error::InvalidArgument(v));
    }
    Ok(PauseRequest {
        topic,
        reason,
        context,
    })
}

pub(super) fn audit_entry(a: AuditEntry) -> pb::AuditEntry {
    pb::AuditEntry {
        id: a.id,
        at: Some(to_timestamp(a.at)),
        actor: a.actor,
        action: a.action,
        r#box: pb_box(a.box_kind) as i32,
        selection: a.selection,
        count: a.count,
        principal: a.principal.unwrap_or_default(),
        request_id: a.request_id.unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_values_parse() {
        use crate::access::bearer;
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
        assert_eq!(bearer("abc"), None);
    }

    #[test]
    fn a_republish_is_a_dry_run_unless_confirmed() {
        let r = pb::RepublishEventsRequest {
            ids: vec![3, 1, 3],
            ..Default::default()
        };
        let q = republish_request(r.clone(), ActionContext::by("x")).unwrap();
        assert!(q.context.dry_run);
        assert_eq!(q.selection, Selection::Ids(vec![1, 3]));
        assert_eq!(q.limit, MAX_REPUBLISH);
        let q = republish_request(
            pb::RepublishEventsRequest { confirm: true, ..r },
            ActionContext::by("x"),
        )
        .unwrap();
        assert!(!q.context.dry_run);
        // An empty filter is every completed event: a dry run may, a real one needs `all`.
        assert!(republish_request(Default::default(), ActionContext::by("x")).is_ok());
        let all = pb::RepublishEventsRequest {
            confirm: true,
            ..Default::default()
        };
        match republish_request(all.clone(), ActionContext::by("x")) {
            Err(Error::InvalidArgument(v)) => assert_eq!(v[0].field, "all"),
            other => panic!("{other:?}"),
        }
        assert!(
            republish_request(
                pb::RepublishEventsRequest { all: true, ..all },
                ActionContext::by("x")
            )
            .is_ok()
        );
    }

    #[test]
    fn ids_and_filter_together_are_refused() {
        let r = pb::RequeueFailedRequest {
            ids: vec![1],
            filter: Some(pb::EventFilter {
                topic: "t".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        match requeue_request(BoxKind::Inbox, r, ActionContext::by("x")) {
            Err(Error::InvalidArgument(v)) => assert_eq!(v[0].field, "ids"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_subscription_applies_to_the_inbox_only() {
        assert_eq!(box_kind(pb::Box::Inbox as i32).unwrap(), BoxKind::Inbox);
        let f = pb::EventFilter {
            subscription: "billing".into(),
            ..Default::default()
        };
        let got = event_filter(BoxKind::Inbox, Some(f.clone()), "filter").unwrap();
        assert_eq!(got.subscription.as_deref(), Some("billing"));
        match event_filter(BoxKind::Outbox, Some(f), "filter") {
            Err(Error::InvalidArgument(v)) => assert_eq!(v[0].field, "filter.subscription"),
            other => panic!("{other:?}"),
        }
        let r = pb::ListPendingRequest {
            subscription: "billing".into(),
            ..Default::default()
        };
        match pending_query(BoxKind::Outbox, r.clone()) {
            Err(Error::InvalidArgument(v)) => assert_eq!(v[0].field, "subscription"),
            other => panic!("{other:?}"),
        }
        let q = pending_query(BoxKind::Inbox, r).unwrap();
        assert_eq!(q.subscription.as_deref(), Some("billing"));
    }
}

//! The console's pages and actions: each request is routed to a page of a box (the
//! outbox or one subscription), read through the admin middle layer and rendered by
//! `pages`; an action posts a dry run first, then the change.

use super::*;

pub(super) fn error_page(nav: Option<&pages::Nav>, e: &Error) -> Response {
    let code = match e {
        Error::InvalidArgument(_) => StatusCode::BAD_REQUEST,
        Error::NotFound(_) => StatusCode::NOT_FOUND,
        Error::PermissionDenied { .. } => StatusCode::FORBIDDEN,
        Error::Unavailable(_) | Error::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    // The console's own refusals say what to fix; anything from the database or the
    // process is logged with a reference and shown only as that reference: its text
    // may name tables, constraints or values (issue 25, item 1).
    let message = match e {
        Error::InvalidArgument(_) | Error::NotFound(_) | Error::PermissionDenied { .. } => {
            e.to_string()
        }
        other => {
            let reference = &super::session::random_token()[..10];
            tracing::error!(error = %other, reference, "console: request failed");
            format!(
                "the request failed ({}); the server's log has the details under reference {reference}",
                match other {
                    Error::Unavailable(_) | Error::Overloaded(_) =>
                        "the database is busy or unreachable: retry",
                    _ => "internal error",
                }
            )
        }
    };
    (code, pages::error(nav, &message)).into_response()
}

pub(super) fn param<'a>(p: &'a Params, k: &str) -> Option<&'a str> {
    p.get(k).map(|s| s.trim()).filter(|s| !s.is_empty())
}

/// A list page's caller and where the page starts (`?before=<id>`), or the response
/// that refuses the request.
fn list_request(
    c: &Console,
    peer: &Peer,
    headers: &HeaderMap,
    q: &Params,
    path: &str,
) -> Result<(pages::Nav, Option<i64>), Box<Response>> {
    let access = match c.access(headers, peer.0) {
        Ok(Some(a)) => a,
        Ok(None) => return Err(Box::new(unauthorized(headers, path))),
        Err(too_many) => return Err(Box::new(too_many.into_response())),
    };
    let nav = c.nav(&access);
    match param(q, "before").map(str::parse::<i64>) {
        None => Ok((nav, None)),
        Some(Ok(b)) => Ok((nav, Some(b))),
        Some(Err(_)) => Err(Box::new(error_page(
            Some(&nav),
            &Error::invalid("before", "not an id"),
        ))),
    }
}

pub(super) async fn audit(
    State(c): State<Console>,
    peer: Peer,
    headers: HeaderMap,
    Query(q): Query<Params>,
) -> Response {
    let (nav, before) = match list_request(&c, &peer, &headers, &q, "/audit") {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    match c.inner.admin.list_audit(LIST_PAGE, before).await {
        Ok(page) => pages::audit(&nav, &page).into_response(),
        Err(e) => error_page(Some(&nav), &e),
    }
}

/// What a path under a box names.
pub(super) enum Page {
    Overview,
    Backlog,
    Events,
    Event(EventId),
}

/// `outbox[/…]` or `inbox/<subscription>[/…]`.
pub(super) fn route(c: &Console, path: &str) -> Option<(Target, Page)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (target, rest) = match parts.as_slice() {
        ["outbox", rest @ ..] => (Target::Outbox, rest),
        ["inbox", sub, rest @ ..] => (c.target(&pages::url_unescape(sub))?, rest),
        _ => return None,
    };
    let page = match rest {
        [] => Page::Overview,
        ["backlog"] => Page::Backlog,
        ["events"] => Page::Events,
        ["events", id] => Page::Event(id.parse().ok()?),
        _ => return None,
    };
    Some((target, page))
}

pub(super) async fn page_get(
    State(c): State<Console>,
    axum::extract::Path(path): axum::extract::Path<String>,
    peer: Peer,
    headers: HeaderMap,
    Query(q): Query<Params>,
) -> Response {
    let access = match c.access(&headers, peer.0) {
        Ok(Some(a)) => a,
        Ok(None) => return unauthorized(&headers, &format!("/{path}")),
        Err(too_many) => return too_many.into_response(),
    };
    let nav = c.nav(&access);
    let Some((target, page)) = route(&c, &path) else {
        return (
            StatusCode::NOT_FOUND,
            pages::error(Some(&nav), "no such page"),
        )
            .into_response();
    };
    let r = match page {
        Page::Overview => overview(&c, &nav, &target).await,
        Page::Backlog => backlog(&c, &nav, &target, &q).await,
        Page::Events => events(&c, &nav, &target, &q).await,
        Page::Event(id) => event(&c, &nav, &target, id).await,
    };
    r.unwrap_or_else(|e| error_page(Some(&nav), &e))
}

pub(super) async fn overview(c: &Console, nav: &pages::Nav, t: &Target) -> Result<Response, Error> {
    let stats = c.inner.admin.stats(t.box_kind(), t.subscription()).await?;
    let paused = c.inner.admin.paused(t.box_kind()).await?;
    let paused: Vec<_> = match t {
        Target::Outbox => paused,
        Target::Inbox(s) => paused.into_iter().filter(|p| p.topic == *s).collect(),
    };
    let (rate, covered) = c.inner.rates.per_minute(t.subscription()).await?;
    Ok(pages::overview(nav, t, &stats, &paused, &rate, covered).into_response())
}

/// The filters of the backlog page.
#[derive(Debug, Default, Clone)]
pub struct BacklogFilter {
    pub topic: String,
    pub key_prefix: String,
    pub only_blocked: bool,
    pub oldest_first: bool,
    /// Keys per page, when not the default.
    pub size: Option<String>,
}

pub(super) async fn backlog(
    c: &Console,
    nav: &pages::Nav,
    t: &Target,
    q: &Params,
) -> Result<Response, Error> {
    let f = BacklogFilter {
        topic: param(q, "topic").unwrap_or("").to_string(),
        key_prefix: param(q, "key_prefix").unwrap_or("").to_string(),
        only_blocked: param(q, "blocked").is_some(),
        oldest_first: param(q, "order") == Some("oldest"),
        size: param(q, "size").map(str::to_string),
    };
    if !f.topic.is_empty() {
        crate::domain::check_topic(&f.topic).map_err(|why| Error::invalid("topic", why))?;
    }
    let order = if f.oldest_first {
        PendingOrder::Oldest
    } else {
        PendingOrder::MostPending
    };
    let page_size = match param(q, "size").map(str::parse::<u32>) {
        None => BACKLOG_PAGE,
        Some(Ok(n @ 1..=1000)) => n,
        Some(_) => return Err(Error::invalid("size", "must be 1..=1000")),
    };
    let after = match param(q, "page") {
        None => None,
        Some(tok) => Some(decode_token(tok)?),
    };
    let query = |only_blocked: bool, after, page_size| PendingQuery {
        subscription: t.subscription().map(str::to_string),
        topic: Some(f.topic.clone()).filter(|s| !s.is_empty()),
        key_prefix: Some(f.key_prefix.clone()).filter(|s| !s.is_empty()),
        only_blocked,
        order,
        page_size,
        after,
    };
    // Blocked keys first: on the first page, the keys whose head waits out a retry.
    let blocked = if !f.only_blocked && after.is_none() {
        let b = c
            .inner
            .admin
            .list_pending(t.box_kind(), &query(true, None, 20))
            .await?;
        Some(b)
    } else {
        None
    };
    let page = c
        .inner
        .admin
        .list_pending(
            t.box_kind(),
            &query(f.only_blocked, after.clone(), page_size),
        )
        .await?;
    let next = page.next.as_ref().map(encode_token);
    Ok(pages::backlog(nav, t, &f, blocked.as_ref(), &page, next.as_deref()).into_response())
}

/// The filters of the events page, as form/query fields.
#[derive(Debug, Default, Clone)]
pub struct EventsFilter {
    pub status: Option<Status>,
    pub topic: String,
    pub key: String,
    pub event_type: String,
    pub error_contains: String,
    /// The producer's idempotency key (exact).
    pub idempotency_key: String,
    /// Inbox: the message id (exact).
    pub message_id: String,
    /// A header match, `NAME=VALUE`.
    pub header: String,
}

impl EventsFilter {
    pub(super) fn parse(q: &Params) -> EventsFilter {
        EventsFilter {
            status: match param(q, "status") {
                None => Some(Status::Failed),
                Some("any") => None,
                Some(s) => Some(Status::parse(s).unwrap_or(Status::Failed)),
            },
            topic: param(q, "topic").unwrap_or("").to_string(),
            key: param(q, "key").unwrap_or("").to_string(),
            event_type: param(q, "type").unwrap_or("").to_string(),
            error_contains: param(q, "error_contains").unwrap_or("").to_string(),
            idempotency_key: param(q, "idempotency_key").unwrap_or("").to_string(),
            message_id: param(q, "message_id").unwrap_or("").to_string(),
            header: param(q, "header").unwrap_or("").to_string(),
        }
    }

    pub(super) fn filter(&self, t: &Target) -> Result<EventFilter, Error> {
        if !self.topic.is_empty() {
            crate::domain::check_topic(&self.topic).map_err(|why| Error::invalid("topic", why))?;
        }
        let s = |v: &String| Some(v.clone()).filter(|v| !v.is_empty());
        let mut headers = std::collections::BTreeMap::new();
        if !self.header.is_empty() {
            let Some((n, v)) = self.header.split_once('=').filter(|(n, _)| !n.is_empty()) else {
                return Err(Error::invalid("header", "write it as NAME=VALUE"));
            };
            headers.insert(n.to_string(), v.to_string());
        }
        if !self.message_id.is_empty() && t.subscription().is_none() {
            return Err(Error::invalid("message_id", "applies to the inbox only"));
        }
        Ok(EventFilter {
            subscription: t.subscription().map(str::to_string),
            topic: s(&self.topic),
            key: s(&self.key),
            event_type: s(&self.event_type),
            error_contains: s(&self.error_contains),
            idempotency_key: s(&self.idempotency_key),
            message_id: s(&self.message_id),
            headers,
            ..Default::default()
        })
    }

    /// The query string that reproduces this filter.
    pub fn query(&self) -> String {
        let status = self.status.map(|s| s.as_str()).unwrap_or("any");
        let mut q = vec![format!("status={status}")];
        for (k, v) in [
            ("topic", &self.topic),
            ("key", &self.key),
            ("type", &self.event_type),
            ("error_contains", &self.error_contains),
            ("idempotency_key", &self.idempotency_key),
            ("message_id", &self.message_id),
            ("header", &self.header),
        ] {
            if !v.is_empty() {
                q.push(format!("{k}={}", pages::url_escape(v)));
            }
        }
        q.join("&")
    }
}

pub(super) async fn events(
    c: &Console,
    nav: &pages::Nav,
    t: &Target,
    q: &Params,
) -> Result<Response, Error> {
    let f = EventsFilter::parse(q);
    let before_id = match param(q, "before").map(str::parse::<i64>) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(_)) => return Err(Error::invalid("before", "not an id")),
    };
    let page = c
        .inner
        .admin
        .list_events(
            t.box_kind(),
            &EventsQuery {
                status: f.status,
                filter: f.filter(t)?,
                page_size: LIST_PAGE,
                before_id,
            },
        )
        .await?;
    Ok(pages::events(nav, t, &f, &page).into_response())
}

pub(super) async fn event(
    c: &Console,
    nav: &pages::Nav,
    t: &Target,
    id: EventId,
) -> Result<Response, Error> {
    let admin = &c.inner.admin;
    let d = admin.get_event(t.box_kind(), id, nav.sees_payloads).await?;
    if d.subscription.as_deref() != t.subscription() {
        return Err(Error::NotFound(format!("event {id}")));
    }
    // The key's line around it: the 5 events before it and the key's 5 newest.
    let key = d.event.key.clone();
    let filter = EventFilter {
        subscription: t.subscription().map(str::to_string),
        topic: Some(d.event.topic.clone()),
        key: Some(key.clone().unwrap_or_default()),
        ..Default::default()
    };
    let mut line = Vec::new();
    if key.is_some() {
        let q = |before_id, page_size| EventsQuery {
            status: None,
            filter: filter.clone(),
            page_size,
            before_id,
        };
        let newest = admin.list_events(t.box_kind(), &q(None, 5)).await?;
        let older = admin.list_events(t.box_kind(), &q(Some(id), 5)).await?;
        let mut seen = std::collections::BTreeMap::new();
        for e in newest.events.into_iter().chain(older.events) {
            seen.insert(e.event.id, e);
        }
        seen.insert(id, d.clone());
        line = seen.into_values().rev().collect();
    }
    Ok(pages::event(nav, t, &d, &line).into_response())
}

/// A requeue or cancel from the events or event page: a dry run unless `confirm`.
pub(super) async fn page_post(
    State(c): State<Console>,
    axum::extract::Path(path): axum::extract::Path<String>,
    peer: Peer,
    headers: HeaderMap,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let access = match c.access(&headers, peer.0) {
        Ok(Some(a)) => a,
        Ok(None) => return unauthorized(&headers, &format!("/{path}")),
        Err(too_many) => return too_many.into_response(),
    };
    let nav = c.nav(&access);
    let fields: Params = form.iter().cloned().collect();
    if let Some(refusal) = refuse_post(&c, &headers, &access, &nav, &fields) {
        return refusal;
    }
    if let Some((target, Page::Overview)) = route(&c, &path) {
        if param(&fields, "action") == Some("rewind") {
            return rewind_post(&c, &nav, &access, &target, &form).await;
        }
        return pause_post(&c, &nav, &access, &target, &fields).await;
    }
    let Some((target, Page::Events)) = route(&c, &path) else {
        return (
            StatusCode::NOT_FOUND,
            pages::error(Some(&nav), "no such action"),
        )
            .into_response();
    };
    let confirm = param(&fields, "confirm") == Some("yes");
    let action = param(&fields, "action").unwrap_or("");
    let input = ActionInput {
        ids: form
            .iter()
            .filter(|(k, _)| k == "id")
            .filter_map(|(_, v)| v.parse().ok())
            .collect(),
        confirm,
        // The confirmation form's id: the same form sent twice acts once.
        request_id: param(&fields, "request_id")
            .filter(|_| confirm)
            .unwrap_or("")
            .to_string(),
        context: ActionContext {
            dry_run: !confirm,
            principal: access.name.clone(),
            ..ActionContext::by(access.actor())
        },
        fields: &fields,
        target: &target,
    };
    let r = match action {
        "requeue" => requeue_action(&c, input, false).await,
        "requeue-filter" => requeue_action(&c, input, true).await,
        "cancel" => cancel_action(&c, input).await,
        "republish" => republish_action(&c, input).await,
        _ => Err(Error::invalid(
            "action",
            "requeue, requeue-filter, cancel or republish",
        )),
    };
    match r {
        Ok(result) => {
            if let (Some(id), false) = (result.audit_id, result.dry_run) {
                tracing::info!(audit_id = id, count = result.count, actor = %access.actor(), action, "console action");
                if let Target::Inbox(s) = &target {
                    c.inner.inbox.wake(s);
                }
            }
            pages::action(&nav, &target, action, &form, &result).into_response()
        }
        Err(e) => error_page(Some(&nav), &e),
    }
}

/// Pause or resume an outbox topic from the overview's topic table, or an inbox
/// subscription from its overview (reversible, so without a confirmation page), then
/// back to the overview.
async fn pause_post(
    c: &Console,
    nav: &pages::Nav,
    access: &Access,
    target: &Target,
    fields: &Params,
) -> Response {
    let context = ActionContext {
        principal: access.name.clone(),
        ..ActionContext::by(access.actor())
    };
    let admin = &c.inner.admin;
    let action = param(fields, "action").unwrap_or("");
    let reason = match action {
        "pause" => Some(param(fields, "reason").unwrap_or("").to_string()),
        _ => None,
    };
    let r = async {
        // The gRPC request's own validation (name, reason), not a copy.
        let req = match target {
            Target::Outbox => {
                let topic = param(fields, "topic").unwrap_or("").to_string();
                crate::api::admin::pause_request(topic, reason, context)?
            }
            Target::Inbox(s) => crate::api::admin::subscription_pause_request(
                s.clone(),
                reason,
                context,
                &c.inner.subscriptions,
            )?,
        };
        let b = target.box_kind();
        match action {
            "pause" => admin.pause(b, &req).await,
            "resume" => admin.resume(b, &req).await,
            _ => Err(Error::invalid("action", "pause or resume")),
        }
    }
    .await;
    match r {
        Ok(out) => {
            if let (true, Some(p)) = (out.changed, &out.pause) {
                tracing::info!(audit_id = ?out.audit_id, name = %p.topic, actor = %access.actor(), action, "console action");
            }
            axum::response::Redirect::to(&target.base()).into_response()
        }
        Err(e) => error_page(Some(nav), &e),
    }
}

/// Why a post may not act, as the page that says so: another origin, an expired form, or
/// a caller that may only read.
fn refuse_post(
    c: &Console,
    headers: &HeaderMap,
    access: &Access,
    nav: &pages::Nav,
    fields: &Params,
) -> Option<Response> {
    if !same_origin(headers) {
        return Some((StatusCode::FORBIDDEN, "cross-origin request refused").into_response());
    }
    if let Some(want) = &access.csrf
        && fields.get("csrf") != Some(want)
    {
        return Some(
            (
                StatusCode::FORBIDDEN,
                pages::error(Some(nav), "the form expired; reload the page"),
            )
                .into_response(),
        );
    }
    if !access.can_write {
        let why = if c.inner.read_only {
            "this console is read-only"
        } else {
            "this token may only read (admin_read): actions need the admin scope"
        };
        return Some((StatusCode::FORBIDDEN, pages::error(Some(nav), why)).into_response());
    }
    None
}

/// What a console action acts on and how.
struct ActionInput<'a> {
    ids: Vec<EventId>,
    confirm: bool,
    request_id: String,
    context: ActionContext,
    fields: &'a Params,
    target: &'a Target,
}

/// A requeue of the selected events, or (`by_filter`) of the events the page's filter
/// selects.
async fn requeue_action(
    c: &Console,
    a: ActionInput<'_>,
    by_filter: bool,
) -> Result<pages::ActionResult, Error> {
    let req = if !by_filter {
        if a.ids.is_empty() {
            return Err(Error::invalid("id", "select events first"));
        }
        // The gRPC request's own validation (id count, request id), not a copy.
        let pb_req = crate::pb::RequeueFailedRequest {
            ids: a.ids.clone(),
            dry_run: !a.confirm,
            request_id: a.request_id.clone(),
            ..Default::default()
        };
        crate::api::admin::requests::requeue_request(a.target.box_kind(), pb_req, a.context)?
    } else {
        let filter = EventsFilter::parse(a.fields).filter(a.target)?;
        RequeueRequest {
            selection: Selection::Filter(filter),
            limit: DEFAULT_REQUEUE,
            context: ActionContext {
                request_id: (!a.request_id.is_empty()).then(|| a.request_id.clone()),
                ..a.context
            },
        }
    };
    let out = c.inner.admin.requeue(a.target.box_kind(), &req).await?;
    Ok(pages::ActionResult {
        verb: "requeue",
        dry_run: !a.confirm,
        count: out.count,
        ids: out.sample_ids,
        audit_id: out.audit_id,
    })
}

/// A republish of the selected completed outbox events.
async fn republish_action(c: &Console, a: ActionInput<'_>) -> Result<pages::ActionResult, Error> {
    if a.target.box_kind() != crate::domain::BoxKind::Outbox {
        return Err(Error::invalid("action", "republish is for outbox events"));
    }
    if a.ids.is_empty() {
        return Err(Error::invalid("id", "select events first"));
    }
    // The gRPC request's own validation (id count, request id).
    let pb_req = crate::pb::RepublishEventsRequest {
        ids: a.ids.clone(),
        confirm: a.confirm,
        request_id: a.request_id.clone(),
        ..Default::default()
    };
    let req = crate::api::admin::requests::republish_request(pb_req, a.context)?;
    let out = c.inner.admin.republish(&req).await?;
    Ok(pages::ActionResult {
        verb: "republish",
        dry_run: !a.confirm,
        count: out.count,
        ids: if a.confirm {
            out.copies.iter().map(|(_, copy)| *copy).collect()
        } else {
            out.sample_ids
        },
        audit_id: out.audit_id,
    })
}

/// A cancel of the selected events, with the form's reason.
async fn cancel_action(c: &Console, a: ActionInput<'_>) -> Result<pages::ActionResult, Error> {
    if a.ids.is_empty() {
        return Err(Error::invalid("id", "select events first"));
    }
    let reason = param(a.fields, "reason").unwrap_or("cancelled in the console");
    // The gRPC request's own validation (id count, reason length, request id).
    let pb_req = crate::pb::CancelEventsRequest {
        ids: a.ids.clone(),
        reason: reason.to_string(),
        dry_run: !a.confirm,
        request_id: a.request_id.clone(),
        ..Default::default()
    };
    let req = crate::api::admin::requests::cancel_request(pb_req, a.context)?;
    let out = c.inner.admin.cancel(a.target.box_kind(), &req).await?;
    Ok(pages::ActionResult {
        verb: "cancel",
        dry_run: !a.confirm,
        count: out.ids.len() as i64,
        ids: out.ids,
        audit_id: out.audit_id,
    })
}

/// The jobs page.
pub(super) async fn jobs_get(
    State(c): State<Console>,
    peer: Peer,
    headers: HeaderMap,
    Query(q): Query<Params>,
) -> Response {
    let (nav, before) = match list_request(&c, &peer, &headers, &q, "/jobs") {
        Ok(r) => r,
        Err(refused) => return *refused,
    };
    jobs_page(&c, &nav, before, None).await
}

async fn jobs_page(
    c: &Console,
    nav: &pages::Nav,
    before: Option<i64>,
    preview: Option<pages::JobPreview<'_>>,
) -> Response {
    match c.inner.admin.jobs(LIST_PAGE, before).await {
        Ok((list, next)) => pages::jobs(nav, &list, next, preview).into_response(),
        Err(e) => error_page(Some(nav), &e),
    }
}

/// Starts a job (a dry run first, then the confirmed start) or cancels one.
pub(super) async fn jobs_post(
    State(c): State<Console>,
    peer: Peer,
    headers: HeaderMap,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let access = match c.access(&headers, peer.0) {
        Ok(Some(a)) => a,
        Ok(None) => return unauthorized(&headers, "/jobs"),
        Err(too_many) => return too_many.into_response(),
    };
    let nav = c.nav(&access);
    let fields: Params = form.iter().cloned().collect();
    if let Some(refusal) = refuse_post(&c, &headers, &access, &nav, &fields) {
        return refusal;
    }
    let context = ActionContext {
        principal: access.name.clone(),
        ..ActionContext::by(access.actor())
    };
    let admin = &c.inner.admin;
    match param(&fields, "action") {
        Some("cancel") => {
            let id = param(&fields, "id")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            match admin.cancel_job(id, &context).await {
                Ok(_) => Redirect::to("/jobs").into_response(),
                Err(e) => error_page(Some(&nav), &e),
            }
        }
        Some("start") => {
            let text = |k: &str| param(&fields, k).unwrap_or("").to_string();
            let kind = match text("kind").as_str() {
                "requeue" => crate::pb::JobKind::Requeue,
                "cancel" => crate::pb::JobKind::Cancel,
                "republish" => crate::pb::JobKind::Republish,
                "redeliver" => crate::pb::JobKind::Redeliver,
                _ => crate::pb::JobKind::Unspecified,
            };
            let bx = match text("box").as_str() {
                "inbox" => crate::pb::Box::Inbox,
                _ if kind == crate::pb::JobKind::Redeliver => crate::pb::Box::Inbox,
                _ => crate::pb::Box::Outbox,
            };
            // The gRPC request's own validation, not a copy.
            let req = crate::pb::StartJobRequest {
                kind: kind as i32,
                r#box: bx as i32,
                filter: Some(crate::pb::EventFilter {
                    subscription: text("subscription"),
                    topic: text("topic"),
                    key_prefix: text("key_prefix"),
                    error_contains: text("error_contains"),
                    ..Default::default()
                }),
                all: param(&fields, "all") == Some("yes"),
                confirm: param(&fields, "confirm") == Some("yes"),
                reason: text("reason"),
                operator: String::new(),
                request_id: text("request_id"),
            };
            let out = match crate::api::admin::jobs::start_job_request(req, context) {
                Ok(r) => admin.start_job(&r).await,
                Err(e) => Err(e),
            };
            match out {
                Ok(start) if start.job.is_none() => {
                    let preview = pages::JobPreview {
                        start: &start,
                        fields: &form,
                    };
                    jobs_page(&c, &nav, None, Some(preview)).await
                }
                Ok(start) => {
                    if let Some(j) = start.job.as_ref().filter(|_| !start.replayed) {
                        tracing::info!(job = j.id, kind = j.kind.as_str(), total = j.total, actor = %access.actor(), "console started a job");
                    }
                    Redirect::to("/jobs").into_response()
                }
                Err(e) => error_page(Some(&nav), &e),
            }
        }
        _ => error_page(Some(&nav), &Error::invalid("action", "start or cancel")),
    }
}

/// Rewinds an inbox subscription from its overview: the dry run's count first, then the
/// confirmed rewind, then back to the overview.
async fn rewind_post(
    c: &Console,
    nav: &pages::Nav,
    access: &Access,
    target: &Target,
    form: &[(String, String)],
) -> Response {
    let fields: Params = form.iter().cloned().collect();
    let Target::Inbox(sub) = target else {
        return error_page(
            Some(nav),
            &Error::invalid("action", "rewind is for an inbox subscription"),
        );
    };
    let to = param(&fields, "to").unwrap_or("");
    let to_time = chrono::DateTime::parse_from_rfc3339(to)
        .map(|t| t.with_timezone(&chrono::Utc))
        .ok()
        .or_else(|| {
            ["%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M"]
                .iter()
                .find_map(|f| {
                    chrono::NaiveDateTime::parse_from_str(to, f)
                        .ok()
                        .map(|n| n.and_utc())
                })
        });
    let req = crate::pb::RewindSubscriptionRequest {
        subscription: sub.clone(),
        to_time: to_time.map(crate::pb::time::to_timestamp),
        redeliver: param(&fields, "redeliver") == Some("yes"),
        confirm: param(&fields, "confirm") == Some("yes"),
        operator: String::new(),
        request_id: param(&fields, "request_id").unwrap_or("").to_string(),
    };
    let context = ActionContext {
        principal: access.name.clone(),
        ..ActionContext::by(access.actor())
    };
    // The gRPC request's own validation, not a copy.
    let out = match crate::api::admin::rewinds::rewind_request(req, context, &c.inner.subscriptions)
    {
        Ok(r) => c.inner.admin.rewind(&r).await,
        Err(e) => Err(e),
    };
    match out {
        Ok(start) if start.rewind.is_none() => {
            pages::rewind_preview(nav, target, &start, form).into_response()
        }
        Ok(start) => {
            if let Some(id) = start.audit_id {
                tracing::info!(audit_id = id, subscription = %sub, actor = %access.actor(), "console rewind");
            }
            axum::response::Redirect::to(&target.base()).into_response()
        }
        Err(e) => error_page(Some(nav), &e),
    }
}

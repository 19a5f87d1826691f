//! The operator console: server-rendered HTML over the same operator queries as the
//! AdminService (`crate::admin`), served on its own opt-in address (`console_listen`).
//!
//! - Access: the admin scope's tokens (`admin`, or `admin_read` to look without acting),
//!   as an `Authorization: Bearer` header or through the login form, which keeps the
//!   token in server memory behind a random session cookie (`HttpOnly`,
//!   `SameSite=Strict`). With no token configured the console is open, like the
//!   AdminService. `console_read_only`, or a token with `admin_read` and not `admin`,
//!   hides and refuses every action.
//! - Writes (requeue, cancel) are POST forms: a dry run first, then a confirmation; a
//!   session's forms carry its CSRF token, and a cross-origin POST is refused. Each
//!   action goes through `Admin` and lands in the audit log with the token's name.
//! - Pages work without JavaScript; a few lines of script add "select all" and keep the
//!   overview fresh.
//! - The publish/handle rate chart comes from the relays' own counters, sampled in
//!   memory every `SAMPLE_EVERY` (this process's deliveries since it started).

mod pages;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use base64::Engine as _;
use tokio_util::sync::CancellationToken;

use crate::admin::{Admin, decode_token, encode_token};
use crate::api::auth::{Auth, LEGACY_ADMIN_TOKEN, Scope};
use crate::domain::admin::{
    CancelRequest, DEFAULT_REQUEUE, EventFilter, EventsQuery, PendingOrder, PendingQuery,
    RequeueRequest, Selection,
};
use crate::domain::{BoxKind, EventId, Status};
use crate::error::Error;
use crate::inbox::InboxHandles;
use crate::relay::RelayStats;

/// How often the delivery counters are sampled for the rate chart.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// How long the chart looks back.
pub const RATE_WINDOW: Duration = Duration::from_secs(3600);
/// How long a login lasts.
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
const SESSION_COOKIE: &str = "mailroom_session";
/// Rows per page of the event and audit lists.
const LIST_PAGE: u32 = 50;
/// Keys per backlog page.
const BACKLOG_PAGE: u32 = 50;

/// Which box a page is about: the outbox, or one inbox subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Outbox,
    Inbox(String),
}

impl Target {
    pub fn box_kind(&self) -> BoxKind {
        match self {
            Target::Outbox => BoxKind::Outbox,
            Target::Inbox(_) => BoxKind::Inbox,
        }
    }

    pub fn subscription(&self) -> Option<&str> {
        match self {
            Target::Outbox => None,
            Target::Inbox(s) => Some(s),
        }
    }

    /// The URL prefix of its pages.
    pub fn base(&self) -> String {
        match self {
            Target::Outbox => "/outbox".into(),
            Target::Inbox(s) => format!("/inbox/{}", pages::url_escape(s)),
        }
    }

    pub fn title(&self) -> String {
        match self {
            Target::Outbox => "Outbox".into(),
            Target::Inbox(s) => format!("Inbox · {s}"),
        }
    }
}

/// Who is looking, and whether they may act.
#[derive(Debug, Clone)]
pub struct Access {
    /// The token's name, for the audit log; `None` when the console is open.
    pub name: Option<String>,
    /// Neither `console_read_only` nor a read-only (`admin_read`) token.
    pub can_write: bool,
    /// The session's CSRF token (forms must echo it); `None` for bearer-header callers.
    pub csrf: Option<String>,
    pub via_session: bool,
}

impl Access {
    fn actor(&self) -> String {
        match self.name.as_deref() {
            None => "console".to_string(),
            Some(LEGACY_ADMIN_TOKEN) => "console (token)".to_string(),
            Some(n) => format!("console (token {n})"),
        }
    }
}

struct Session {
    token: String,
    csrf: String,
    expires: Instant,
}

/// Counter samples for the rate chart.
#[derive(Clone)]
struct Sample {
    at: Instant,
    outbox: u64,
    inbox: HashMap<String, u64>,
}

/// The console's state. Cheap to clone.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

struct Inner {
    admin: Admin,
    auth: Auth,
    read_only: bool,
    subscriptions: Vec<String>,
    relays: Vec<Arc<RelayStats>>,
    inbox: InboxHandles,
    sessions: Mutex<HashMap<String, Session>>,
    samples: Mutex<VecDeque<Sample>>,
}

impl Console {
    pub fn new(
        admin: Admin,
        auth: Auth,
        read_only: bool,
        subscriptions: Vec<String>,
        relays: Vec<Arc<RelayStats>>,
        inbox: InboxHandles,
    ) -> Console {
        let c = Console {
            inner: Arc::new(Inner {
                admin,
                auth,
                read_only,
                subscriptions,
                relays,
                inbox,
                sessions: Mutex::new(HashMap::new()),
                samples: Mutex::new(VecDeque::new()),
            }),
        };
        c.sample();
        c
    }

    fn now_sample(&self) -> Sample {
        use std::sync::atomic::Ordering::Relaxed;
        let i = &self.inner;
        Sample {
            at: Instant::now(),
            outbox: i.relays.iter().map(|r| r.delivered.load(Relaxed)).sum(),
            inbox: i
                .inbox
                .dispatch_stats
                .iter()
                .map(|(k, r)| (k.clone(), r.delivered.load(Relaxed)))
                .collect(),
        }
    }

    /// Records the counters now and forgets samples older than the window.
    fn sample(&self) {
        let s = self.now_sample();
        let mut q = self.inner.samples.lock().expect("samples lock");
        q.push_back(s);
        while q
            .front()
            .is_some_and(|f| f.at.elapsed() > RATE_WINDOW + SAMPLE_EVERY)
        {
            q.pop_front();
        }
    }

    /// Deliveries per minute over the last hour, oldest minute first (60 values), and
    /// how many minutes of it the samples cover.
    pub fn rate_per_minute(&self, target: &Target) -> (Vec<u64>, usize) {
        let mut samples: Vec<Sample> = self
            .inner
            .samples
            .lock()
            .expect("samples lock")
            .iter()
            .cloned()
            .collect();
        samples.push(self.now_sample());
        let value = |s: &Sample| match target {
            Target::Outbox => s.outbox,
            Target::Inbox(n) => s.inbox.get(n).copied().unwrap_or(0),
        };
        let now = Instant::now();
        let mut bins = vec![0u64; 60];
        for w in samples.windows(2) {
            let delta = value(&w[1]).saturating_sub(value(&w[0]));
            let ago = now.saturating_duration_since(w[1].at).as_secs() / 60;
            if ago < 60 {
                bins[59 - ago as usize] += delta;
            }
        }
        let covered = samples
            .first()
            .map(|f| (now.saturating_duration_since(f.at).as_secs() / 60 + 1).min(60) as usize)
            .unwrap_or(0);
        (bins, covered)
    }

    /// Serves the console on `listener` until `shutdown`.
    pub async fn serve(self, listener: tokio::net::TcpListener, shutdown: CancellationToken) {
        let sampler = {
            let c = self.clone();
            let stop = shutdown.clone();
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(SAMPLE_EVERY) => c.sample(),
                    }
                }
            })
        };
        let app = self.router();
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
        {
            tracing::error!(error = %e, "console server failed");
        }
        sampler.abort();
    }

    pub fn router(self) -> axum::Router {
        use axum::routing::get;
        axum::Router::new()
            .route("/", get(|| async { Redirect::to("/outbox") }))
            .route("/login", get(login_page).post(login))
            .route("/logout", axum::routing::post(logout))
            .route("/audit", get(audit))
            .route("/{*path}", get(page_get).post(page_post))
            .with_state(self)
    }

    /// The caller's access, from a bearer header or a session cookie; `None`: log in.
    /// Any token that may read gets in; it may act only with the admin scope.
    fn access(&self, headers: &HeaderMap) -> Option<Access> {
        let auth = &self.inner.auth;
        let writable = !self.inner.read_only;
        // An open admin scope needs no token.
        if auth.check(Some(Scope::AdminRead), None).is_ok() {
            return Some(Access {
                name: None,
                can_write: writable && auth.check(Some(Scope::Admin), None).is_ok(),
                csrf: None,
                via_session: false,
            });
        }
        if let Some(h) = headers.get(header::AUTHORIZATION) {
            let p = auth.check(Some(Scope::AdminRead), Some(h)).ok()?;
            return Some(Access {
                can_write: writable && p.has(Scope::Admin),
                name: p.name,
                csrf: None,
                via_session: false,
            });
        }
        let id = cookie(headers, SESSION_COOKIE)?;
        let (token, csrf) = {
            let mut sessions = self.inner.sessions.lock().expect("sessions lock");
            sessions.retain(|_, s| s.expires > Instant::now());
            let s = sessions.get(&id)?;
            (s.token.clone(), s.csrf.clone())
        };
        // The token is checked again on every request: a revoked token ends the session.
        let value = axum::http::HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
        let p = auth.check(Some(Scope::AdminRead), Some(&value)).ok()?;
        Some(Access {
            can_write: writable && p.has(Scope::Admin),
            name: p.name,
            csrf: Some(csrf),
            via_session: true,
        })
    }

    fn target(&self, name: &str) -> Option<Target> {
        self.inner
            .subscriptions
            .iter()
            .any(|s| s == name)
            .then(|| Target::Inbox(name.to_string()))
    }

    fn nav(&self, access: &Access) -> pages::Nav {
        pages::Nav {
            subscriptions: self.inner.subscriptions.clone(),
            who: access.name.clone(),
            can_write: access.can_write,
            logout: access.via_session,
            csrf: access.csrf.clone(),
        }
    }
}

/// The value of cookie `name`.
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|p| p.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

fn random_token() -> String {
    let bytes: [u8; 32] = rand::random();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// A POST from another origin is refused (the session cookie is `SameSite=Strict`
/// already; this also covers the open console and older browsers).
fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    origin == "null" && host.is_empty()
        || origin
            .split_once("://")
            .is_some_and(|(_, rest)| rest.trim_end_matches('/') == host)
}

/// The response for a caller without access: the login form (browsers) or 401.
fn unauthorized(headers: &HeaderMap, path: &str) -> Response {
    if headers.contains_key(header::AUTHORIZATION) {
        return (StatusCode::UNAUTHORIZED, "missing or invalid admin token").into_response();
    }
    let next = pages::url_escape(path);
    Redirect::to(&format!("/login?next={next}")).into_response()
}

fn error_page(nav: Option<&pages::Nav>, e: &Error) -> Response {
    let code = match e {
        Error::InvalidArgument(_) => StatusCode::BAD_REQUEST,
        Error::NotFound(_) => StatusCode::NOT_FOUND,
        Error::PermissionDenied { .. } => StatusCode::FORBIDDEN,
        Error::Unavailable(_) | Error::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let message = match e {
        Error::Internal(m) => {
            tracing::error!(error = %m, "console: internal error");
            "internal error".to_string()
        }
        other => other.to_string(),
    };
    (code, pages::error(nav, &message)).into_response()
}

type Params = HashMap<String, String>;

fn param<'a>(p: &'a Params, k: &str) -> Option<&'a str> {
    p.get(k).map(|s| s.trim()).filter(|s| !s.is_empty())
}

async fn login_page(Query(q): Query<Params>) -> Response {
    let next = param(&q, "next").unwrap_or("/outbox").to_string();
    pages::login(&next, None).into_response()
}

async fn login(State(c): State<Console>, headers: HeaderMap, Form(f): Form<Params>) -> Response {
    if !same_origin(&headers) {
        return (StatusCode::FORBIDDEN, "cross-origin request refused").into_response();
    }
    let next = param(&f, "next")
        // Only a path on this console: never `//host` or `/\host` (browsers read both
        // as another site).
        .filter(|n| n.starts_with('/') && !n.starts_with("//") && !n.starts_with("/\\"))
        .unwrap_or("/outbox")
        .to_string();
    let token = param(&f, "token").unwrap_or("").to_string();
    let ok = axum::http::HeaderValue::from_str(&format!("Bearer {token}"))
        .ok()
        .is_some_and(|v| c.inner.auth.check(Some(Scope::AdminRead), Some(&v)).is_ok());
    if !ok {
        return (
            StatusCode::UNAUTHORIZED,
            pages::login(
                &next,
                Some("That token is not valid for the admin (or admin_read) scope."),
            ),
        )
            .into_response();
    }
    let id = random_token();
    c.inner.sessions.lock().expect("sessions lock").insert(
        id.clone(),
        Session {
            token,
            csrf: random_token(),
            expires: Instant::now() + SESSION_TTL,
        },
    );
    let cookie = format!(
        "{SESSION_COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        SESSION_TTL.as_secs()
    );
    ([(header::SET_COOKIE, cookie)], Redirect::to(&next)).into_response()
}

async fn logout(State(c): State<Console>, headers: HeaderMap) -> Response {
    if let Some(id) = cookie(&headers, SESSION_COOKIE) {
        c.inner.sessions.lock().expect("sessions lock").remove(&id);
    }
    let clear = format!("{SESSION_COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
    ([(header::SET_COOKIE, clear)], Redirect::to("/login")).into_response()
}

async fn audit(State(c): State<Console>, headers: HeaderMap, Query(q): Query<Params>) -> Response {
    let Some(access) = c.access(&headers) else {
        return unauthorized(&headers, "/audit");
    };
    let nav = c.nav(&access);
    let before = match param(&q, "before").map(str::parse::<i64>) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(_)) => return error_page(Some(&nav), &Error::invalid("before", "not an id")),
    };
    match c.inner.admin.list_audit(LIST_PAGE, before).await {
        Ok(page) => pages::audit(&nav, &page).into_response(),
        Err(e) => error_page(Some(&nav), &e),
    }
}

/// What a path under a box names.
enum Page {
    Overview,
    Backlog,
    Events,
    Event(EventId),
}

/// `outbox[/…]` or `inbox/<subscription>[/…]`.
fn route(c: &Console, path: &str) -> Option<(Target, Page)> {
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

async fn page_get(
    State(c): State<Console>,
    axum::extract::Path(path): axum::extract::Path<String>,
    headers: HeaderMap,
    Query(q): Query<Params>,
) -> Response {
    let Some(access) = c.access(&headers) else {
        return unauthorized(&headers, &format!("/{path}"));
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

async fn overview(c: &Console, nav: &pages::Nav, t: &Target) -> Result<Response, Error> {
    let stats = c.inner.admin.stats(t.box_kind(), t.subscription()).await?;
    let (rate, covered) = c.rate_per_minute(t);
    Ok(pages::overview(nav, t, &stats, &rate, covered).into_response())
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

async fn backlog(c: &Console, nav: &pages::Nav, t: &Target, q: &Params) -> Result<Response, Error> {
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
}

impl EventsFilter {
    fn parse(q: &Params) -> EventsFilter {
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
        }
    }

    fn filter(&self, t: &Target) -> Result<EventFilter, Error> {
        if !self.topic.is_empty() {
            crate::domain::check_topic(&self.topic).map_err(|why| Error::invalid("topic", why))?;
        }
        let s = |v: &String| Some(v.clone()).filter(|v| !v.is_empty());
        Ok(EventFilter {
            subscription: t.subscription().map(str::to_string),
            topic: s(&self.topic),
            key: s(&self.key),
            event_type: s(&self.event_type),
            error_contains: s(&self.error_contains),
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
        ] {
            if !v.is_empty() {
                q.push(format!("{k}={}", pages::url_escape(v)));
            }
        }
        q.join("&")
    }
}

async fn events(c: &Console, nav: &pages::Nav, t: &Target, q: &Params) -> Result<Response, Error> {
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

async fn event(c: &Console, nav: &pages::Nav, t: &Target, id: EventId) -> Result<Response, Error> {
    let admin = &c.inner.admin;
    let d = admin.get_event(t.box_kind(), id, true).await?;
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
async fn page_post(
    State(c): State<Console>,
    axum::extract::Path(path): axum::extract::Path<String>,
    headers: HeaderMap,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let Some(access) = c.access(&headers) else {
        return unauthorized(&headers, &format!("/{path}"));
    };
    let nav = c.nav(&access);
    if !same_origin(&headers) {
        return (StatusCode::FORBIDDEN, "cross-origin request refused").into_response();
    }
    let fields: Params = form.iter().cloned().collect();
    if let Some(want) = &access.csrf
        && fields.get("csrf") != Some(want)
    {
        return (
            StatusCode::FORBIDDEN,
            pages::error(Some(&nav), "the form expired; reload the page"),
        )
            .into_response();
    }
    if !access.can_write {
        let why = if c.inner.read_only {
            "this console is read-only"
        } else {
            "this token may only read (admin_read): actions need the admin scope"
        };
        return (StatusCode::FORBIDDEN, pages::error(Some(&nav), why)).into_response();
    }
    let Some((target, Page::Events)) = route(&c, &path) else {
        return (
            StatusCode::NOT_FOUND,
            pages::error(Some(&nav), "no such action"),
        )
            .into_response();
    };
    let ids: Vec<EventId> = form
        .iter()
        .filter(|(k, _)| k == "id")
        .filter_map(|(_, v)| v.parse().ok())
        .collect();
    let confirm = param(&fields, "confirm") == Some("yes");
    let action = param(&fields, "action").unwrap_or("");
    let filter = EventsFilter::parse(&fields);
    let r = match action {
        "requeue" | "requeue-filter" => {
            let selection = if action == "requeue" {
                if ids.is_empty() {
                    return error_page(Some(&nav), &Error::invalid("id", "select events first"));
                }
                Selection::Ids(ids.clone())
            } else {
                match filter.filter(&target) {
                    Ok(f) => Selection::Filter(f),
                    Err(e) => return error_page(Some(&nav), &e),
                }
            };
            let req = RequeueRequest {
                selection,
                limit: DEFAULT_REQUEUE,
                dry_run: !confirm,
                actor: access.actor(),
                principal: access.name.clone(),
                request_id: None,
            };
            c.inner
                .admin
                .requeue(target.box_kind(), &req)
                .await
                .map(|out| pages::ActionResult {
                    verb: "requeue",
                    dry_run: !confirm,
                    count: out.count,
                    ids: out.sample_ids,
                    audit_id: out.audit_id,
                })
        }
        "cancel" => {
            if ids.is_empty() {
                return error_page(Some(&nav), &Error::invalid("id", "select events first"));
            }
            let reason = param(&fields, "reason")
                .unwrap_or("cancelled in the console")
                .to_string();
            let req = CancelRequest {
                ids: ids.clone(),
                reason,
                dry_run: !confirm,
                actor: access.actor(),
                principal: access.name.clone(),
                request_id: None,
            };
            c.inner
                .admin
                .cancel(target.box_kind(), &req)
                .await
                .map(|out| pages::ActionResult {
                    verb: "cancel",
                    dry_run: !confirm,
                    count: out.ids.len() as i64,
                    ids: out.ids,
                    audit_id: out.audit_id,
                })
        }
        _ => Err(Error::invalid(
            "action",
            "requeue, requeue-filter or cancel",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_and_origins() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            "a=1; mailroom_session=xyz; b=2".parse().unwrap(),
        );
        assert_eq!(cookie(&h, SESSION_COOKIE).as_deref(), Some("xyz"));
        assert_eq!(cookie(&h, "c"), None);
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "127.0.0.1:8080".parse().unwrap());
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, "http://127.0.0.1:8080".parse().unwrap());
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, "http://evil.example".parse().unwrap());
        assert!(!same_origin(&h));
    }
}

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
//! - The publish/handle rate chart reads the deliveries per minute every replica adds
//!   to the database (`crate::rates`), so all replicas show the same history.

mod guard;
mod pages;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use base64::Engine as _;
use tokio_util::sync::CancellationToken;

use crate::access::{Auth, LEGACY_ADMIN_TOKEN, Scope};
use crate::admin::{Admin, decode_token, encode_token};
use crate::domain::admin::{
    ActionContext, DEFAULT_REQUEUE, EventFilter, EventsQuery, PendingOrder, PendingQuery,
    RequeueRequest, Selection,
};
use crate::domain::{BoxKind, EventId, Status};
use crate::error::Error;
use crate::inbox::InboxHandles;
use guard::Peer;

mod session;
mod views;

use session::*;
use views::*;

/// How long a login lasts.
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
const SESSION_COOKIE: &str = "mailroom_session";
/// The session cookie's name and attributes when browsers reach the console over TLS
/// (a TLS proxy in front): `__Host-` makes browsers refuse it unless it is `Secure`,
/// has `Path=/` and no `Domain`, so no other site or subdomain can plant or read it.
const SECURE_SESSION_COOKIE: &str = "__Host-mailroom_session";
/// Rows per page of the event and audit lists.
const LIST_PAGE: u32 = 50;
/// Keys per backlog page.
const BACKLOG_PAGE: u32 = 50;

/// Which box a page is about: the outbox, or one inbox subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The outbox.
    Outbox,
    /// One inbox subscription, by name.
    Inbox(String),
}

impl Target {
    /// The box it names.
    pub fn box_kind(&self) -> BoxKind {
        match self {
            Target::Outbox => BoxKind::Outbox,
            Target::Inbox(_) => BoxKind::Inbox,
        }
    }

    /// The subscription, for an inbox target.
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

    /// The page title.
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
    /// Logged in with the form (a session cookie) rather than a bearer header.
    pub via_session: bool,
    /// May see payloads (an open console, or a token with `payloads` or `admin`).
    pub sees_payloads: bool,
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

/// The console's state. Cheap to clone.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

/// What the console reads and acts through.
pub struct ConsoleParts {
    /// The admin middle layer every page and action goes through.
    pub admin: Admin,
    /// Checks the token a visitor signs in with.
    pub auth: Auth,
    /// Refuse every action (pages only).
    pub read_only: bool,
    /// `Host` names the console answers to besides its own address and localhost.
    pub allowed_hosts: Vec<String>,
    /// Browsers reach the console over TLS (through a proxy): the session cookie is
    /// `Secure` and named `__Host-…`.
    pub secure_cookie: bool,
    /// The inbox subscriptions, for the inbox pages.
    pub subscriptions: Vec<String>,
    /// The deliveries per minute, for the rate chart.
    pub rates: Arc<crate::rates::RateRecorder>,
    /// Wakes an inbox dispatcher after an action on its subscription.
    pub inbox: InboxHandles,
}

struct Inner {
    parts: ConsoleParts,
    sessions: Mutex<HashMap<String, Session>>,
    logins: guard::Logins,
}

impl std::ops::Deref for Inner {
    type Target = ConsoleParts;
    fn deref(&self) -> &ConsoleParts {
        &self.parts
    }
}

impl Console {
    /// The console over its parts; `parts.read_only` refuses every action.
    pub fn new(parts: ConsoleParts) -> Console {
        Console {
            inner: Arc::new(Inner {
                parts,
                sessions: Mutex::new(HashMap::new()),
                logins: guard::Logins::default(),
            }),
        }
    }

    /// Serves the console on `listener` until `shutdown`.
    pub async fn serve(self, listener: tokio::net::TcpListener, shutdown: CancellationToken) {
        let hosts = match listener.local_addr() {
            Ok(addr) => guard::Hosts::new(addr, &self.inner.allowed_hosts),
            Err(e) => {
                tracing::error!(error = %e, "console: no local address; not serving");
                return;
            }
        };
        crate::web::serve(
            listener,
            guard::wrap(self.router(), hosts),
            shutdown,
            "console",
        )
        .await;
    }

    /// The HTTP routes, to serve on the console's address.
    pub fn router(self) -> axum::Router {
        use axum::routing::get;
        axum::Router::new()
            .route("/", get(|| async { Redirect::to("/outbox") }))
            .route("/login", get(login_page).post(login))
            .route("/logout", axum::routing::post(logout))
            .route("/audit", get(audit))
            .route("/jobs", get(jobs_get).post(jobs_post))
            .route("/{*path}", get(page_get).post(page_post))
            .with_state(self)
    }

    /// The caller's access, from a bearer header or a session cookie; `None`: log in;
    /// `Err`: this address failed too often (a bearer header is a login attempt of
    /// `peer`, counted with the form's). Any token that may read gets in; it may act
    /// only with the admin scope.
    fn access(
        &self,
        headers: &HeaderMap,
        peer: std::net::IpAddr,
    ) -> Result<Option<Access>, guard::TooManyAttempts> {
        let auth = &self.inner.auth;
        let writable = !self.inner.read_only;
        // An open admin scope needs no token.
        if auth.check(Some(Scope::AdminRead), None, None).is_ok() {
            return Ok(Some(Access {
                name: None,
                can_write: writable && auth.check(Some(Scope::Admin), None, None).is_ok(),
                csrf: None,
                via_session: false,
                sees_payloads: auth
                    .check(Some(Scope::AdminRead), None, None)
                    .is_ok_and(|p| p.sees_payloads()),
            }));
        }
        if let Some(h) = headers.get(header::AUTHORIZATION) {
            let found = self.inner.logins.attempt(peer, || {
                auth.check(Some(Scope::AdminRead), Some(h), None).ok()
            })?;
            return Ok(found.map(|p| Access {
                can_write: writable && p.has(Scope::Admin),
                sees_payloads: p.sees_payloads(),
                name: p.name,
                csrf: None,
                via_session: false,
            }));
        }
        Ok(self.session_access(headers, writable))
    }

    /// The access of a session cookie's login (its token checked again).
    fn session_access(&self, headers: &HeaderMap, writable: bool) -> Option<Access> {
        let auth = &self.inner.auth;
        let id = cookie(headers, self.session_cookie())?;
        let (token, csrf) = {
            let mut sessions = self.inner.sessions.lock().expect("sessions lock");
            sessions.retain(|_, s| s.expires > Instant::now());
            let s = sessions.get(&id)?;
            (s.token.clone(), s.csrf.clone())
        };
        // The token is checked again on every request: a revoked token ends the session.
        let value = axum::http::HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
        let p = auth
            .check(Some(Scope::AdminRead), Some(&value), None)
            .ok()?;
        Some(Access {
            can_write: writable && p.has(Scope::Admin),
            sees_payloads: p.sees_payloads(),
            name: p.name,
            csrf: Some(csrf),
            via_session: true,
        })
    }

    /// The session cookie's name.
    fn session_cookie(&self) -> &'static str {
        if self.inner.secure_cookie {
            SECURE_SESSION_COOKIE
        } else {
            SESSION_COOKIE
        }
    }

    /// The session cookie's attributes after its value.
    fn cookie_attributes(&self) -> &'static str {
        if self.inner.secure_cookie {
            "Path=/; HttpOnly; Secure; SameSite=Strict"
        } else {
            "Path=/; HttpOnly; SameSite=Strict"
        }
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
            sees_payloads: access.sees_payloads,
        }
    }
}

type Params = HashMap<String, String>;

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

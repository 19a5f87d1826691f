//! What every console request and response passes (issue 25, item 1):
//! - **Host check.** The `Host` header must name the console's own address, `localhost`
//!   (or `127.0.0.1`, `[::1]`) with its port, or a name configured for a proxy
//!   (`MAILROOM_CONSOLE_ALLOWED_HOSTS`); anything else is `421 Misdirected Request`, GET
//!   included. After a DNS rebind a hostile page's requests reach the console with the
//!   attacker's name in `Host` (and the same in `Origin`), so comparing the two, as the
//!   cross-origin check does, is not enough on an open console.
//! - **Response headers.** A Content-Security-Policy that allows exactly the console's
//!   inline style and script (by hash) and nothing from elsewhere, no framing
//!   (`frame-ancestors 'none'`), forms only to the console; `nosniff`; no referrer to
//!   other sites; and `Cache-Control: no-store` (pages carry payloads and CSRF tokens).
//! - **Login attempts** ([`Logins`], used where a credential is checked: the login form
//!   and every `Authorization` header). At most `LOGIN_FAILURES` failed checks per
//!   client address per `LOGIN_WINDOW`, bearer guesses and the form's together; past
//!   that, `429` until the window ends. Each failure is logged with the address, never
//!   with what was typed.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use sha2::{Digest, Sha256};

pub(super) use crate::web::Hosts;

/// Failed logins a client address may make per window.
const LOGIN_FAILURES: u32 = 5;
/// The window failed logins are counted in.
const LOGIN_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

/// Failed credential checks per client address (the login form's and bearer headers'):
/// when its window began and how many.
#[derive(Clone, Default)]
pub(super) struct Logins(Arc<Mutex<HashMap<IpAddr, (Instant, u32)>>>);

/// The answer once an address has used up its attempts.
pub(super) struct TooManyAttempts;

impl Logins {
    /// Runs `check` (a credential check: `None` when it fails) for `ip`, unless the
    /// address has failed `LOGIN_FAILURES` times this window, and counts a failure. The
    /// limit is read, the credential checked and a failure counted under one lock, so
    /// attempts sent at once are counted one after another, never all against the
    /// same count. A limited address is refused without a check, the right token too:
    /// otherwise the answer would still tell a right guess from a wrong one.
    pub(super) fn attempt<T>(
        &self,
        ip: IpAddr,
        check: impl FnOnce() -> Option<T>,
    ) -> Result<Option<T>, TooManyAttempts> {
        let mut m = self.0.lock().expect("logins lock");
        if m.len() > 10_000 {
            m.retain(|_, (start, _)| start.elapsed() < LOGIN_WINDOW);
        }
        let e = m.entry(ip).or_insert((Instant::now(), 0));
        if e.0.elapsed() >= LOGIN_WINDOW {
            *e = (Instant::now(), 0);
        }
        if e.1 >= LOGIN_FAILURES {
            tracing::warn!(client = %ip, "console: too many failed logins; refused (429)");
            return Err(TooManyAttempts);
        }
        let found = check();
        if found.is_none() {
            if e.1 == 0 {
                e.0 = Instant::now();
            }
            e.1 += 1;
            tracing::warn!(client = %ip, "console: failed login");
        }
        Ok(found)
    }
}

impl IntoResponse for TooManyAttempts {
    fn into_response(self) -> Response {
        let mut r = (
            StatusCode::TOO_MANY_REQUESTS,
            "too many failed logins from this address; try again in a minute",
        )
            .into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("60"));
        r
    }
}

/// The client's address (`web::serve` puts it on every request; unspecified without).
pub(super) struct Peer(pub(super) IpAddr);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Peer(
            parts
                .extensions
                .get::<axum::extract::ConnectInfo<SocketAddr>>()
                .map_or(IpAddr::from([0, 0, 0, 0]), |c| c.0.ip()),
        ))
    }
}

/// The console's routes behind the host check and the response headers.
pub(super) fn wrap(router: axum::Router, hosts: Hosts) -> axum::Router {
    router.layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let hosts = hosts.clone();
            async move { guard(&hosts, req, next).await }
        },
    ))
}

async fn guard(hosts: &Hosts, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mut resp = if !hosts.allows(host) {
        tracing::warn!(
            host,
            "console: request for a host it does not serve refused (421)"
        );
        (
            StatusCode::MISDIRECTED_REQUEST,
            "this console does not answer to that host name (see MAILROOM_CONSOLE_ALLOWED_HOSTS)",
        )
            .into_response()
    } else {
        next.run(req).await
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_str(&content_security_policy()).expect("an ASCII policy"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // `same-origin`, not `no-referrer`: with no-referrer, browsers send `Origin: null` on
    // the console's own form posts, which the cross-origin check must refuse.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    resp
}

/// The policy: the inline style and script by their SHA-256, nothing else.
pub(super) fn content_security_policy() -> String {
    static POLICY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    POLICY
        .get_or_init(|| {
            let hash = |s: &str| {
                base64::engine::general_purpose::STANDARD.encode(Sha256::digest(s.as_bytes()))
            };
            format!(
                "default-src 'none'; style-src 'sha256-{}'; script-src 'sha256-{}'; \
                 connect-src 'self'; img-src 'self' data:; form-action 'self'; \
                 frame-ancestors 'none'; base-uri 'none'",
                hash(super::pages::CSS),
                hash(super::pages::SCRIPT)
            )
        })
        .clone()
}

//! Logging in and out: the session cookie, the CSRF token, the same-origin check of
//! every form post, and the login page's handlers.

use super::*;

/// The value of cookie `name`.
pub(super) fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|p| p.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

pub(super) fn random_token() -> String {
    let bytes: [u8; 32] = rand::random();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// A POST from another origin is refused (the session cookie is `SameSite=Strict`
/// already; this also covers the open console and older browsers).
pub(super) fn same_origin(headers: &HeaderMap) -> bool {
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

/// Whether `next` (already percent-decoded) is a path on this console. Browsers read
/// `//host`, `/\host` and, once they drop tabs and newlines from a URL, `/<TAB>/host` as
/// another site: only a single leading `/`, no backslash and no control or space
/// character anywhere.
pub(super) fn same_site_path(next: &str) -> bool {
    next.starts_with('/')
        && !next.starts_with("//")
        && !next.contains('\\')
        && !next.chars().any(|c| c.is_control() || c.is_whitespace())
}

/// The response for a caller without access: the login form (browsers) or 401.
pub(super) fn unauthorized(headers: &HeaderMap, path: &str) -> Response {
    if headers.contains_key(header::AUTHORIZATION) {
        return (StatusCode::UNAUTHORIZED, "missing or invalid admin token").into_response();
    }
    let next = pages::url_escape(path);
    Redirect::to(&format!("/login?next={next}")).into_response()
}

pub(super) async fn login_page(Query(q): Query<Params>) -> Response {
    let next = param(&q, "next").unwrap_or("/outbox").to_string();
    pages::login(&next, None).into_response()
}

pub(super) async fn login(
    State(c): State<Console>,
    peer: Peer,
    headers: HeaderMap,
    Form(f): Form<Params>,
) -> Response {
    if !same_origin(&headers) {
        return (StatusCode::FORBIDDEN, "cross-origin request refused").into_response();
    }
    let next = param(&f, "next")
        .filter(|n| same_site_path(n))
        .unwrap_or("/outbox")
        .to_string();
    let token = param(&f, "token").unwrap_or("").to_string();
    let checked = c.inner.logins.attempt(peer.0, || {
        let v = axum::http::HeaderValue::from_str(&format!("Bearer {token}")).ok()?;
        c.inner
            .auth
            .check(Some(Scope::AdminRead), Some(&v), None)
            .ok()
    });
    let ok = match checked {
        Ok(found) => found.is_some(),
        Err(too_many) => return too_many.into_response(),
    };
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
        "{}={id}; {}; Max-Age={}",
        c.session_cookie(),
        c.cookie_attributes(),
        SESSION_TTL.as_secs()
    );
    ([(header::SET_COOKIE, cookie)], Redirect::to(&next)).into_response()
}

pub(super) async fn logout(State(c): State<Console>, headers: HeaderMap) -> Response {
    // Another site must not end the operator's session (nor learn that it could).
    if !same_origin(&headers) {
        return (StatusCode::FORBIDDEN, "cross-origin request refused").into_response();
    }
    if let Some(id) = cookie(&headers, c.session_cookie()) {
        c.inner.sessions.lock().expect("sessions lock").remove(&id);
    }
    let clear = format!(
        "{}=; {}; Max-Age=0",
        c.session_cookie(),
        c.cookie_attributes()
    );
    ([(header::SET_COOKIE, clear)], Redirect::to("/login")).into_response()
}

//! The access model: bearer tokens with scopes, token files, and the `Principal` a
//! checked request carries. It knows nothing of gRPC: checks return the crate's
//! `Error`, which the gRPC layer (`api::layers::AuthLayer`, in front of every service)
//! and the console each turn into their own answer. The scope a call needs is the
//! method's ([`required_scope`]): the AdminService's reads need `admin_read`, which the
//! `admin` scope includes, and its actions `admin`. The one check that needs the
//! decoded request, a producer token's topic list, is `Principal::check_topic`, called
//! by the OutboxService before anything is stored.
//!
//! - No token configured at all: everything is open (the loopback default).
//! - Only the legacy `admin_token`: the AdminService needs it, Enqueue and the
//!   InboxService stay open.
//! - A token file: every service except health and reflection needs a token.
//! - mTLS (`tls_client_ca`): nothing is open. A bearer token decides as above; without
//!   one, the client certificate's identity is looked up among the file's
//!   `certificate` entries (the named one, else the catch-all `"*"`), which carry the
//!   same scopes, topics and subscriptions as a token. A certificate that matches no
//!   entry may call health and reflection only.
//!
//! Wrong or missing token: `UNAUTHENTICATED`; a valid token without the scope, or a
//! topic outside its list: `PERMISSION_DENIED` (both with a `google.rpc.ErrorInfo`,
//! reasons `UNAUTHENTICATED` and `PERMISSION_DENIED`; a missing scope is named in its
//! `required_scope` metadata). Tokens are compared in constant time
//! and never logged (`TokenEntry`'s `Debug` hides them).

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use crate::error::Error;
use crate::secret::secrets_equal;

/// The name the legacy `admin_token` goes by (audit entries say "(token)").
pub const LEGACY_ADMIN_TOKEN: &str = "admin-token";

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// `OutboxService`: Enqueue and EnqueueBatch (optionally only to listed topics).
    Enqueue,
    /// `AdminService`: every operator RPC, the reads and the actions (requeue, cancel);
    /// the console with its actions. Includes `admin_read`.
    Admin,
    /// `AdminService`: the reads only ([`ADMIN_READS`]); the console without actions.
    AdminRead,
    /// `InboxService`: Receive and ListSubscriptions (no topic lists: the inbox does not
    /// check them).
    Inbox,
    /// Event payloads in the admin reads (`GetEvent` with `include_payload`, the
    /// console's event page): with `admin_read`, a reader who may see the data as well
    /// as the backlog. `admin` includes it; no RPC needs it alone.
    Payloads,
}

impl Scope {
    /// The name the token file spells it with.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Enqueue => "enqueue",
            Scope::Admin => "admin",
            Scope::AdminRead => "admin_read",
            Scope::Inbox => "inbox",
            Scope::Payloads => "payloads",
        }
    }

    /// Whether this scope allows a call that needs `needed`: itself, and `admin`
    /// includes `admin_read`.
    pub fn covers(self, needed: Scope) -> bool {
        self == needed
            || (self == Scope::Admin && matches!(needed, Scope::AdminRead | Scope::Payloads))
    }
}

/// One configured identity: a bearer token, or (over mTLS) a client certificate.
#[derive(Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    /// Who holds it: logged and written to the audit log, unlike the token.
    pub name: String,
    /// The secret, sent as `authorization: Bearer <token>`; never logged. Empty in a
    /// certificate entry (an empty token never matches).
    #[serde(default)]
    pub token: String,
    /// Instead of a token: the client certificate identity this entry is for (see
    /// [`Principal::certificate`]), or [`ANY_CERTIFICATE`] for every certificate the
    /// client CA signed that no other entry names.
    #[serde(default)]
    pub certificate: Option<String>,
    /// What it may do.
    pub scopes: Vec<Scope>,
    /// Enqueue only to these topics; absent: any topic.
    #[serde(default)]
    pub topics: Option<Vec<String>>,
    /// Inbox scope: push to (and list) only these subscriptions; absent: any.
    #[serde(default)]
    pub subscriptions: Option<Vec<String>>,
}

impl std::fmt::Debug for TokenEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEntry")
            .field("name", &self.name)
            .field("token", &"***")
            .field("certificate", &self.certificate)
            .field("scopes", &self.scopes)
            .field("topics", &self.topics)
            .field("subscriptions", &self.subscriptions)
            .finish()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenFile {
    #[serde(default)]
    token: Vec<TokenEntry>,
}

/// The `certificate` of the catch-all entry: any certificate no other entry names.
pub const ANY_CERTIFICATE: &str = "*";

/// Reads a token file:
///
/// ```toml
/// [[token]]
/// name = "checkout"
/// token = "…"
/// scopes = ["enqueue"]
/// topics = ["orders", "payments"]   # optional
///
/// [[token]]
/// name = "on-call-viewer"
/// token = "…"
/// scopes = ["admin_read"]           # the admin reads and the console, no actions
///
/// [[token]]
/// name = "billing"
/// certificate = "billing.internal"  # over mTLS: this client certificate, no token
/// scopes = ["enqueue", "inbox"]
/// topics = ["invoices"]
/// subscriptions = ["billing"]
/// ```
///
/// Errors name the file and the problem, never a token.
pub fn load_tokens(path: &Path) -> Result<Vec<TokenEntry>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file: TokenFile = toml::from_str(&text).map_err(|e| {
        // toml's message quotes the offending line, which may hold a token.
        format!(
            "{}: not a token file ({})",
            path.display(),
            e.message().lines().next().unwrap_or("parse error")
        )
    })?;
    let mut names = std::collections::HashSet::new();
    let mut certificates = std::collections::HashSet::new();
    for t in &file.token {
        if t.name.trim().is_empty() {
            return Err(format!("{}: a token has an empty name", path.display()));
        }
        if !names.insert(t.name.clone()) {
            return Err(format!(
                "{}: token name {:?} repeats",
                path.display(),
                t.name
            ));
        }
        if let Some(c) = &t.certificate {
            check_certificate_entry(t, c).map_err(|why| format!("{}: {why}", path.display()))?;
            if !certificates.insert(c.clone()) {
                return Err(format!(
                    "{}: certificate {c:?} is named by more than one entry",
                    path.display()
                ));
            }
        } else if t.token.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "{}: token {:?} is shorter than {MIN_TOKEN_LEN} characters",
                path.display(),
                t.name
            ));
        }
        if t.scopes.is_empty() {
            return Err(format!(
                "{}: token {:?} has no scopes",
                path.display(),
                t.name
            ));
        }
        // A topic or subscription list limits Enqueue and the inbox only; the admin reads
        // show every topic and subscription, so a limited token with an admin scope would
        // read what its list seems to forbid.
        let admin = t
            .scopes
            .iter()
            .any(|s| matches!(s, Scope::Admin | Scope::AdminRead | Scope::Payloads));
        if admin && (t.topics.is_some() || t.subscriptions.is_some()) {
            return Err(format!(
                "{}: token {:?} has an admin scope and a topics or subscriptions list; the lists \
                 limit enqueue and inbox only, and the admin reads cover every topic: give the \
                 admin scopes a token of their own",
                path.display(),
                t.name
            ));
        }
    }
    let tokens = file.token;
    for (i, a) in tokens.iter().enumerate() {
        if a.certificate.is_none() && tokens[i + 1..].iter().any(|b| a.token == b.token) {
            return Err(format!(
                "{}: token {:?} has the same secret as another",
                path.display(),
                a.name
            ));
        }
    }
    Ok(tokens)
}

/// A certificate entry: a name and no token; the catch-all without admin scopes.
fn check_certificate_entry(t: &TokenEntry, certificate: &str) -> Result<(), String> {
    if !t.token.is_empty() {
        return Err(format!(
            "entry {:?} has a token and a certificate: give each its own entry",
            t.name
        ));
    }
    if certificate.trim().is_empty() {
        return Err(format!("entry {:?} has an empty certificate", t.name));
    }
    // Every certificate of the client CA an operator is rarely meant; name them.
    let admin = t
        .scopes
        .iter()
        .any(|s| matches!(s, Scope::Admin | Scope::AdminRead | Scope::Payloads));
    if certificate == ANY_CERTIFICATE && admin {
        return Err(format!(
            "entry {:?} gives every client certificate an admin scope: name the \
             operators' certificates in entries of their own",
            t.name
        ));
    }
    Ok(())
}

/// Whether any entry is for a client certificate.
pub fn has_certificate_entries(tokens: &[TokenEntry]) -> bool {
    tokens.iter().any(|t| t.certificate.is_some())
}

/// The shortest token accepted, in the token file and as the legacy admin token.
pub const MIN_TOKEN_LEN: usize = 16;

/// The caller of an RPC, as the handlers see it (request extension).
#[derive(Debug, Clone)]
pub struct Principal {
    /// The token's name; `None`: no token was needed and none checked.
    pub name: Option<String>,
    /// The verified client certificate's identity (its first DNS, URI or e-mail name,
    /// else its subject's common name), over mTLS: what a token file's `certificate`
    /// entries are matched against, exactly.
    pub certificate: Option<String>,
    /// Whether no token was needed for the admin scope either (an open server): the
    /// caller sees payloads.
    open_admin: bool,
    topics: Option<Arc<[String]>>,
    subscriptions: Option<Arc<[String]>>,
    /// The token's scopes (none for an anonymous caller).
    scopes: Arc<[Scope]>,
}

impl Principal {
    /// A caller without a token: no name and no scopes (topics and subscriptions unlimited).
    pub fn anonymous() -> Self {
        Principal {
            name: None,
            certificate: None,
            open_admin: false,
            topics: None,
            subscriptions: None,
            scopes: Arc::new([]),
        }
    }

    /// Whether this caller may see event payloads: an open server's caller, or a token
    /// with `payloads` (which `admin` includes).
    pub fn sees_payloads(&self) -> bool {
        self.open_admin || self.has(Scope::Payloads)
    }

    /// Who this caller is, for the audit log: the token's name, the certificate's
    /// identity, or both (`None`: neither).
    pub fn audit_label(&self) -> Option<String> {
        match (&self.name, &self.certificate) {
            (Some(t), Some(c)) => Some(format!("{t} (certificate {c})")),
            (Some(t), None) => Some(t.clone()),
            (None, Some(c)) => Some(format!("certificate {c}")),
            (None, None) => None,
        }
    }

    /// Whether the token authenticated has a scope that covers `scope` (never for an
    /// anonymous caller: ask `Auth::check` whether a scope is open).
    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.iter().any(|s| s.covers(scope))
    }

    /// `PERMISSION_DENIED` unless this caller may use the inbox `subscription`.
    pub fn check_subscription(&self, subscription: &str) -> Result<(), Error> {
        if self.may_use_subscription(subscription) {
            Ok(())
        } else {
            Err(Error::PermissionDenied {
                message: "this token may not use that subscription".into(),
                required_scope: None,
            })
        }
    }

    /// Whether this caller may use (and see) the inbox `subscription`.
    pub fn may_use_subscription(&self, subscription: &str) -> bool {
        match &self.subscriptions {
            Some(list) => list.iter().any(|s| s == subscription),
            None => true,
        }
    }

    /// Whether a token was checked (the caller has a name).
    pub fn authenticated(&self) -> bool {
        self.name.is_some()
    }

    /// `PERMISSION_DENIED` unless this caller may enqueue to `topic`.
    pub fn check_topic(&self, topic: &str) -> Result<(), Error> {
        match &self.topics {
            Some(list) if !list.iter().any(|t| t == topic) => Err(Error::PermissionDenied {
                message: format!("this token may not enqueue to topic {topic:?}"),
                required_scope: None,
            }),
            _ => Ok(()),
        }
    }

    /// The principal of a request (anonymous when no layer put one there).
    pub fn of(ext: &http::Extensions) -> Principal {
        ext.get::<Principal>()
            .cloned()
            .unwrap_or_else(Principal::anonymous)
    }
}

/// The AdminService methods that change nothing: the `admin_read` scope may call
/// them. Every other AdminService method (RequeueFailed, CancelEvents, and any method
/// added later until it is listed here) needs the `admin` scope.
pub const ADMIN_READS: &[&str] = &[
    "ListPending",
    "GetEvent",
    "ListEvents",
    "ListAudit",
    "GetStats",
    "ListPausedTopics",
    "ListPausedSubscriptions",
    "GetJob",
    "ListJobs",
    "ListRewinds",
];

/// The scope an RPC path (`/package.Service/Method`) needs; `None`: open to all (health
/// checks, reflection). Services not listed here need the admin scope, so a new service
/// is closed until it is given its own scope.
pub fn required_scope(path: &str) -> Option<Scope> {
    let (service, method) = path
        .trim_start_matches('/')
        .split_once('/')
        .unwrap_or((path.trim_start_matches('/'), ""));
    match service {
        "grpc.health.v1.Health"
        | "grpc.reflection.v1.ServerReflection"
        | "grpc.reflection.v1alpha.ServerReflection" => None,
        "mailroom.v1.OutboxService" => Some(Scope::Enqueue),
        "mailroom.v1.InboxService" => Some(Scope::Inbox),
        "mailroom.v1.AdminService" if ADMIN_READS.contains(&method) => Some(Scope::AdminRead),
        _ => Some(Scope::Admin),
    }
}

/// The token table and which scopes it protects.
#[derive(Debug, Clone, Default)]
pub struct Auth {
    tokens: Vec<TokenEntry>,
    /// Scopes anyone may use without a token.
    open: Vec<Scope>,
}

impl Auth {
    /// `tokens` from the token file (`file` says one was given) plus the legacy admin
    /// token.
    pub fn new(mut tokens: Vec<TokenEntry>, file: bool, admin_token: Option<&str>) -> Auth {
        if let Some(t) = admin_token.filter(|t| !t.is_empty()) {
            tokens.push(TokenEntry {
                name: LEGACY_ADMIN_TOKEN.into(),
                token: t.to_string(),
                certificate: None,
                scopes: vec![Scope::Admin],
                topics: None,
                subscriptions: None,
            });
        }
        let mut open = Vec::new();
        if tokens.is_empty() {
            open = vec![Scope::Enqueue, Scope::Admin, Scope::Inbox];
        } else if !file {
            // Only the admin token: producers stay open, as before token files existed.
            open = vec![Scope::Enqueue, Scope::Inbox];
        }
        Auth { tokens, open }
    }

    /// With client certificates required (mTLS): no scope is open. A caller is who its
    /// bearer token or its certificate's entry says; a certificate that no entry names
    /// (and no catch-all `"*"` entry covers) reaches health and reflection only.
    /// (Before issue 43, every certificate of the client CA could enqueue to any topic
    /// and push into any subscription.)
    pub fn with_mtls(mut self, mtls: bool) -> Auth {
        if mtls {
            self.open.clear();
        }
        self
    }

    /// Whether any scope is protected.
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// Authenticates a call that needs `scope`: by its `authorization` header when it
    /// has one, else by `certificate`, the verified client certificate's identity.
    pub fn check(
        &self,
        scope: Option<Scope>,
        authorization: Option<&http::HeaderValue>,
        certificate: Option<&str>,
    ) -> Result<Principal, Error> {
        let Some(scope) = scope else {
            return Ok(Principal {
                certificate: certificate.map(str::to_string),
                ..Principal::anonymous()
            });
        };
        if self.open.iter().any(|o| o.covers(scope)) {
            return Ok(Principal {
                certificate: certificate.map(str::to_string),
                open_admin: self.open.contains(&Scope::Admin),
                ..Principal::anonymous()
            });
        }
        let entry = match (authorization, certificate) {
            (Some(value), _) => self.token_entry(value)?,
            (None, Some(c)) => self.certificate_entry(c)?,
            (None, None) => return Err(Error::Unauthenticated),
        };
        if !entry.scopes.iter().any(|s| s.covers(scope)) {
            tracing::info!(token = %entry.name, scope = scope.name(), "token lacks the scope");
            let message = if scope == Scope::Admin && entry.scopes.contains(&Scope::AdminRead) {
                "this token may only read (admin_read): this call needs the admin scope".to_string()
            } else {
                format!("this token does not have the {} scope", scope.name())
            };
            return Err(Error::PermissionDenied {
                message,
                required_scope: Some(scope.name()),
            });
        }
        Ok(Principal {
            name: Some(entry.name.clone()),
            certificate: certificate.map(str::to_string),
            open_admin: false,
            topics: entry.topics.clone().map(Into::into),
            subscriptions: entry.subscriptions.clone().map(Into::into),
            scopes: entry.scopes.clone().into(),
        })
    }

    /// The token entry whose secret `authorization` carries.
    fn token_entry(&self, authorization: &http::HeaderValue) -> Result<&TokenEntry, Error> {
        let given = authorization
            .to_str()
            .ok()
            .and_then(bearer)
            .ok_or(Error::Unauthenticated)?;
        // Compare against every token (no early exit) so timing says nothing about which.
        let mut found: Option<&TokenEntry> = None;
        for t in &self.tokens {
            if t.certificate.is_none() && secrets_equal(given.as_bytes(), t.token.as_bytes()) {
                found = Some(t);
            }
        }
        found.ok_or(Error::Unauthenticated)
    }

    /// The entry that names `certificate`, else the catch-all one.
    fn certificate_entry(&self, certificate: &str) -> Result<&TokenEntry, Error> {
        let named = |name: &str| {
            self.tokens
                .iter()
                .find(|t| t.certificate.as_deref() == Some(name))
        };
        named(certificate)
            .or_else(|| named(ANY_CERTIFICATE))
            .ok_or_else(|| {
                tracing::info!(certificate, "client certificate named by no entry: refused");
                Error::Unauthenticated
            })
    }
}

/// The credentials of an `Authorization: Bearer …` value.
pub fn bearer(v: &str) -> Option<&str> {
    let (scheme, rest) = v.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, token: &str, scopes: &[Scope], topics: Option<&[&str]>) -> TokenEntry {
        TokenEntry {
            name: name.into(),
            token: token.into(),
            certificate: None,
            scopes: scopes.to_vec(),
            topics: topics.map(|t| t.iter().map(|s| s.to_string()).collect()),
            subscriptions: None,
        }
    }

    fn header(v: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(v).unwrap()
    }

    #[test]
    fn scopes_and_tokens() {
        let auth = Auth::new(
            vec![
                entry(
                    "p",
                    "producer-token-0001",
                    &[Scope::Enqueue],
                    Some(&["orders"]),
                ),
                entry("a", "admin-token-000001", &[Scope::Admin], None),
            ],
            true,
            None,
        );
        let enq = Some(Scope::Enqueue);
        let adm = Some(Scope::Admin);
        let p = auth
            .check(enq, Some(&header("Bearer producer-token-0001")), None)
            .unwrap();
        assert_eq!(p.name.as_deref(), Some("p"));
        assert!(p.check_topic("orders").is_ok());
        assert_eq!(
            p.check_topic("other")
                .map_err(tonic::Status::from)
                .unwrap_err()
                .code(),
            tonic::Code::PermissionDenied
        );
        let code = |s, h: Option<&str>| {
            auth.check(s, h.map(header).as_ref(), None)
                .map(|_| tonic::Code::Ok)
                .unwrap_or_else(|e| tonic::Status::from(e).code())
        };
        assert_eq!(
            code(adm, Some("Bearer producer-token-0001")),
            tonic::Code::PermissionDenied
        );
        assert_eq!(code(adm, None), tonic::Code::Unauthenticated);
        assert_eq!(code(adm, Some("Bearer nope")), tonic::Code::Unauthenticated);
        assert_eq!(
            code(adm, Some("Basic admin-token-000001")),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            code(adm, Some("bearer admin-token-000001")),
            tonic::Code::Ok
        );
        assert_eq!(code(None, None), tonic::Code::Ok);
    }

    #[test]
    fn mtls_opens_nothing_and_admin_includes_payloads() {
        let open = Auth::new(vec![], false, None);
        assert!(open.check(Some(Scope::Admin), None, None).is_ok());
        assert!(
            open.check(Some(Scope::AdminRead), None, None)
                .unwrap()
                .sees_payloads()
        );
        // mTLS without entries: a certificate reaches nothing but health.
        let mtls = Auth::new(vec![], false, None).with_mtls(true);
        for scope in [Scope::Enqueue, Scope::Inbox, Scope::Admin, Scope::AdminRead] {
            assert!(mtls.check(Some(scope), None, Some("client")).is_err());
        }
        assert!(mtls.check(None, None, Some("client")).is_ok());
        assert!(Scope::Admin.covers(Scope::Payloads));
        assert!(!Scope::AdminRead.covers(Scope::Payloads));
    }

    #[test]
    fn certificates_get_their_entrys_scopes_topics_and_subscriptions() {
        let cert = |name: &str, certificate: &str, scopes: &[Scope]| TokenEntry {
            certificate: Some(certificate.into()),
            ..entry(name, "", scopes, Some(&["orders"]))
        };
        let mut billing = cert(
            "billing",
            "billing.internal",
            &[Scope::Enqueue, Scope::Inbox],
        );
        billing.subscriptions = Some(vec!["billing".into()]);
        let code = |r: Result<Principal, Error>| {
            r.map(|_| tonic::Code::Ok)
                .unwrap_or_else(|e| tonic::Status::from(e).code())
        };
        let auth = Auth::new(vec![billing.clone()], true, None).with_mtls(true);
        let p = auth
            .check(Some(Scope::Inbox), None, Some("billing.internal"))
            .unwrap();
        assert_eq!(p.name.as_deref(), Some("billing"));
        assert_eq!(
            p.audit_label().as_deref(),
            Some("billing (certificate billing.internal)")
        );
        assert!(p.check_topic("orders").is_ok() && p.check_topic("payments").is_err());
        assert!(p.may_use_subscription("billing") && !p.may_use_subscription("shipping"));
        assert_eq!(
            code(auth.check(Some(Scope::Admin), None, Some("billing.internal"))),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            code(auth.check(Some(Scope::Enqueue), None, Some("stranger"))),
            tonic::Code::Unauthenticated
        );
        // A certificate entry has no token: an empty bearer never matches it.
        assert_eq!(
            code(auth.check(Some(Scope::Enqueue), Some(&header("Bearer ")), None)),
            tonic::Code::Unauthenticated
        );
        // The catch-all covers certificates no entry names; a named entry wins.
        let any = cert("anyone", ANY_CERTIFICATE, &[Scope::Enqueue]);
        let auth = Auth::new(vec![billing, any], true, None).with_mtls(true);
        let p = auth
            .check(Some(Scope::Enqueue), None, Some("stranger"))
            .unwrap();
        assert_eq!(p.name.as_deref(), Some("anyone"));
        assert_eq!(
            code(auth.check(Some(Scope::Inbox), None, Some("stranger"))),
            tonic::Code::PermissionDenied
        );
        let p = auth
            .check(Some(Scope::Enqueue), None, Some("billing.internal"))
            .unwrap();
        assert_eq!(p.name.as_deref(), Some("billing"));
    }

    #[test]
    fn legacy_admin_token_leaves_enqueue_open() {
        let auth = Auth::new(vec![], false, Some("legacy"));
        assert!(auth.check(Some(Scope::Enqueue), None, None).is_ok());
        assert!(auth.check(Some(Scope::Admin), None, None).is_err());
        let open = Auth::new(vec![], false, None);
        assert!(!open.enabled());
        assert!(open.check(Some(Scope::Admin), None, None).is_ok());
    }

    #[test]
    fn unknown_services_need_admin() {
        assert_eq!(required_scope("/grpc.health.v1.Health/Check"), None);
        assert_eq!(
            required_scope("/mailroom.v1.OutboxService/Enqueue"),
            Some(Scope::Enqueue)
        );
        for read in ADMIN_READS {
            assert_eq!(
                required_scope(&format!("/mailroom.v1.AdminService/{read}")),
                Some(Scope::AdminRead)
            );
        }
        // The actions, and a method not listed (a new one), need the admin scope.
        for write in ["RequeueFailed", "CancelEvents", "PurgeEverything", ""] {
            assert_eq!(
                required_scope(&format!("/mailroom.v1.AdminService/{write}")),
                Some(Scope::Admin),
                "{write}"
            );
        }
        assert_eq!(
            required_scope("/mailroom.v1.AdminService"),
            Some(Scope::Admin)
        );
        assert_eq!(
            required_scope("/x.Y/GetStats"),
            Some(Scope::Admin),
            "another service's read names open nothing"
        );
        assert_eq!(
            required_scope("/mailroom.v1.InboxService/Receive"),
            Some(Scope::Inbox)
        );
        assert_eq!(required_scope("/x.Y/Z"), Some(Scope::Admin));
    }

    #[test]
    fn admin_read_tokens_read_and_admin_tokens_do_both() {
        use tonic_types::StatusExt as _;
        let auth = Auth::new(
            vec![
                entry("viewer", "viewer-token-000001", &[Scope::AdminRead], None),
                entry("ops", "ops-token-00000001", &[Scope::Admin], None),
            ],
            true,
            None,
        );
        let read = Some(Scope::AdminRead);
        let write = Some(Scope::Admin);
        let v = header("Bearer viewer-token-000001");
        let o = header("Bearer ops-token-00000001");
        let p = auth.check(read, Some(&v), None).unwrap();
        assert!(p.has(Scope::AdminRead) && !p.has(Scope::Admin));
        let e = auth
            .check(write, Some(&v), None)
            .map_err(tonic::Status::from)
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("only read"), "{e:?}");
        let info = e.get_details_error_info().expect("ErrorInfo");
        assert_eq!(info.reason, "PERMISSION_DENIED");
        assert_eq!(info.metadata["required_scope"], "admin");
        let p = auth.check(read, Some(&o), None).unwrap();
        assert!(p.has(Scope::Admin) && p.has(Scope::AdminRead));
        assert!(auth.check(write, Some(&o), None).is_ok());
        // The legacy admin token and an open admin scope include the reads.
        let legacy = Auth::new(vec![], false, Some("legacy-admin-token-1"));
        assert!(
            legacy
                .check(read, Some(&header("Bearer legacy-admin-token-1")), None)
                .is_ok()
        );
        assert!(legacy.check(read, None, None).is_err());
        assert!(
            Auth::new(vec![], false, None)
                .check(read, None, None)
                .is_ok()
        );
        // An admin_read token reaches nothing else.
        for other in [Scope::Enqueue, Scope::Inbox] {
            assert_eq!(
                auth.check(Some(other), Some(&v), None)
                    .map_err(tonic::Status::from)
                    .unwrap_err()
                    .code(),
                tonic::Code::PermissionDenied
            );
        }
    }

    #[test]
    fn token_files_are_checked_and_never_echoed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokens.toml");
        std::fs::write(
            &p,
            "[[token]]\nname = \"a\"\ntoken = \"0123456789abcdef\"\nscopes = [\"enqueue\"]\n",
        )
        .unwrap();
        let t = load_tokens(&p).unwrap();
        assert_eq!(t[0].scopes, vec![Scope::Enqueue]);
        std::fs::write(
            &p,
            "[[token]]\nname = \"v\"\ntoken = \"0123456789abcdef\"\nscopes = [\"admin_read\"]\n",
        )
        .unwrap();
        assert_eq!(load_tokens(&p).unwrap()[0].scopes, vec![Scope::AdminRead]);
        assert!(!format!("{t:?}").contains("0123456789abcdef"));
        std::fs::write(
            &p,
            "[[token]]\nname = \"a\"\ntoken = \"0123456789abcdef-secret\"\nscopes = [\"root\"]\n",
        )
        .unwrap();
        let e = load_tokens(&p).unwrap_err();
        assert!(!e.contains("secret"), "{e}");
        std::fs::write(
            &p,
            "[[token]]\nname = \"a\"\ntoken = \"short\"\nscopes = [\"admin\"]\n",
        )
        .unwrap();
        assert!(load_tokens(&p).unwrap_err().contains("shorter"));
    }
}

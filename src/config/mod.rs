//! Configuration: typed and validated once at start-up. Precedence: command-line flags >
//! environment (`MAILROOM_*`) > TOML file (`--config`) > defaults. A bad setting is one
//! clear line naming it and exit code 64.

use std::net::SocketAddr;
use std::time::Duration;

use crate::domain::Limits;
use crate::inbox::SubscriptionConfig;
use crate::intake::IntakeConfig;
use crate::relay::RelayConfig;
use crate::sink::SinkConfig;
use crate::telemetry::LogFormat;
use crate::tls::ServerTls;

mod resolve;
mod settings;
#[cfg(test)]
mod tests;

pub use settings::{Settings, SubscriptionSettings};

use crate::secret::Secret;

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// gRPC listen address.
    pub listen: SocketAddr,
    /// `sqlite://FILE` (embedded) or `postgres://…`.
    pub database_url: Secret,
    /// PostgreSQL connections of the enqueue pool; the others are sized from it.
    pub database_max_connections: u32,
    /// Run the migrations at start-up.
    pub migrate: bool,
    /// How logs are written.
    pub log_format: LogFormat,
    /// Where relays publish.
    pub sink: SinkConfig,
    /// How often each topic's `max.message.bytes` is read again (Kafka sink).
    pub kafka_topic_limits_refresh: Duration,
    /// `MAILROOM_SOURCE`; `None` means `mailroom/<installation id>` (see `app::ce_source`).
    pub source: Option<String>,
    /// Relay tasks in this process.
    pub relays: usize,
    /// The relays' claim sizes, leases, polling and retry policy.
    pub relay: RelayConfig,
    /// Wake relays of other processes with PostgreSQL LISTEN/NOTIFY.
    pub listen_notify: bool,
    /// What one event may carry, and the largest batch.
    pub limits: Limits,
    /// The largest payload of a Kafka record the inbox stores for handling:
    /// `max_payload_bytes` when set, else stock Kafka's 1,048,588-byte batch (a record a
    /// default cluster carries is not over it; the outbox's default is lower only to
    /// leave room for its own headers).
    pub inbox_max_payload_bytes: usize,
    /// Largest `EnqueueBatch` request on the wire (`Enqueue` is limited to one event:
    /// `enqueue_request_bytes`).
    pub max_batch_bytes: usize,
    /// The group commit in front of the database.
    pub intake: IntakeConfig,
    /// How long a SIGTERM drain may take before in-flight work is cut.
    pub shutdown_grace: Duration,
    /// How often readiness checks the database.
    pub health_interval: Duration,
    /// Readiness drops once the broker has been unreachable this long.
    pub ready_max_broker_down: Option<Duration>,
    /// Readiness drops while the oldest pending event is older than this.
    pub ready_max_lag: Option<Duration>,
    /// OTLP/gRPC trace export endpoint; `None`: no export.
    pub otlp_endpoint: Option<String>,
    /// Fault injection at the sink (testing only): (counted rate, transient rate).
    pub faults: (f64, f64),
    /// Fault injection in the inbox consumers (testing only).
    pub inbox_faults: crate::inbox::consumer::ConsumerFaults,
    /// Token the AdminService requires; `None`: no token.
    pub admin_token: Option<Secret>,
    /// Serving unauthenticated RPCs on a non-loopback address (only with
    /// `--allow-unauthenticated`; warned at start-up).
    pub open_on_network: bool,
    /// Inbox subscriptions.
    pub subscriptions: Vec<SubscriptionConfig>,
    /// Tokens from `tokens_file` (the admin token is added to them by the app).
    pub tokens: Vec<crate::access::TokenEntry>,
    /// Prometheus `/metrics` address, when served.
    pub metrics_listen: Option<SocketAddr>,
    /// Extra `Host` names `/metrics` answers to (besides IP addresses and localhost).
    pub metrics_allowed_hosts: Vec<String>,
    /// The operator console's address, when it is served.
    pub console_listen: Option<SocketAddr>,
    /// Extra `Host` names the console answers to (behind a proxy).
    pub console_allowed_hosts: Vec<String>,
    /// The console shows but never acts, whatever the token.
    pub console_read_only: bool,
    /// The console's session cookie is `Secure` and `__Host-` (TLS in front of it).
    pub console_secure_cookie: bool,
    /// How often the backlog gauges are refreshed.
    pub metrics_stats_interval: Duration,
    /// TLS of the gRPC port; `None`: plaintext.
    pub tls: Option<ServerTls>,
    /// Concurrency limit and deadline of every RPC.
    pub overload: crate::api::layers::OverloadConfig,
    /// The gRPC port's connections: cap, handshake deadline, streams per connection.
    pub connections: crate::api::connections::ConnectionLimits,
    /// How long a query waits for a pooled connection.
    pub database_acquire_timeout: Duration,
    /// PostgreSQL `statement_timeout` per query class.
    pub database_timeouts: DatabaseTimeouts,
    /// What every PostgreSQL session of the service sets after connecting: the schema
    /// of mailroom's tables, the lock and idle-in-transaction timeouts.
    pub database_profile: crate::store::postgres::profile::SessionProfile,
    /// Refuse to start (instead of warning) when other roles may create in that schema.
    pub database_refuse_shared_schema: bool,
    /// How `migrate` (and a replica started with `migrate`) waits for PostgreSQL locks.
    pub migration: crate::store::postgres::migrate::MigrationWait,
    /// What retention deletes, and how often.
    pub retention: crate::retention::RetentionConfig,
    /// Which failures are copied to dead-letter topics.
    pub dead_letter: crate::dead_letter::DeadLetterConfig,
    /// How the background job runner works.
    pub jobs: crate::jobs::JobSettings,
}

/// The largest `Enqueue` request on the wire: one event of the largest payload, key and
/// headers, plus slack for the other fields (topic, type, idempotency key, framing).
pub fn enqueue_request_bytes(limits: &Limits) -> usize {
    limits.max_payload_bytes + limits.max_header_bytes + limits.max_key_bytes + 64 * 1024
}

/// PostgreSQL `statement_timeout` of each query class; each class has a pool of its own
/// (`app::pg_pools`). `None`: no timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatabaseTimeouts {
    /// Enqueues and inbox receives.
    pub enqueue: Option<Duration>,
    /// Claims, settles and lease renewals of relays and dispatchers; retention.
    pub relay: Option<Duration>,
    /// Admin RPCs, the console and stats.
    pub admin: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config::resolve(Settings::default()).expect("defaults are valid")
    }
}

impl Config {
    /// Merges flags/environment with the optional file, then validates.
    pub fn load(cli: Settings) -> Result<Config, ConfigError> {
        let file = match &cli.config {
            None => Settings::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| bad("config", format!("cannot read {}: {e}", path.display())))?;
                toml::from_str(&text).map_err(|e| bad("config", toml_error(path, &text, &e)))?
            }
        };
        Config::resolve(cli.or(file))
    }

    /// Applies defaults and validates.
    pub fn is_postgres(&self) -> bool {
        self.database_url.0.starts_with("postgres")
    }
}

/// A URL with every credential replaced by `***`, for logs and errors: the password of
/// `user:pass@`, and the value of any query parameter that names a secret
/// (`password`, `sslpassword`, `token`, `secret`, `key` …). Parameters such as
/// `sslmode` stay readable.
pub fn redact_url(url: &str) -> String {
    let (head, query) = match url.split_once('?') {
        Some((h, q)) => (h, Some(q)),
        None => (url, None),
    };
    let mut out = match (head.find("://"), head.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &head[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &head[..scheme + 3], &head[at..]),
                None => head.to_string(),
            }
        }
        _ => head.to_string(),
    };
    if let Some(q) = query {
        let secret = |k: &str| {
            let k = k.to_ascii_lowercase();
            [
                "pass",
                "pwd",
                "secret",
                "token",
                "key",
                "credential",
                "auth",
            ]
            .iter()
            .any(|w| k.contains(w))
        };
        let parts: Vec<String> = q
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) if secret(k) => format!("{k}=***"),
                _ => p.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&parts.join("&"));
    }
    out
}

/// A TOML error without the offending line: toml's `Display` quotes it, and it may hold
/// a secret (a database URL, a token). The line number and toml's short message say
/// enough; a message that itself quotes a value is cut at the first quote.
pub fn toml_error(path: &std::path::Path, text: &str, e: &toml::de::Error) -> String {
    let line = e
        .span()
        .map(|r| text[..r.start.min(text.len())].matches('\n').count() + 1);
    let msg = e.message().lines().next().unwrap_or("parse error");
    // "unknown field `name`, expected one of …": the name is a key, not a value.
    let keep = if msg.starts_with("unknown field `") {
        msg.match_indices('`').nth(1).map(|(i, _)| i + 1)
    } else {
        msg.find(['"', '`', '\'']).filter(|&i| i > 0)
    };
    let msg = keep.map_or(msg, |i| msg[..i].trim_end());
    match line {
        Some(l) => format!("{}: line {l}: {msg}", path.display()),
        None => format!("{}: {msg}", path.display()),
    }
}

/// A bad setting: names it and says why.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting {setting}: {reason}")]
pub struct ConfigError {
    /// The setting, as flag/file name and environment variable.
    pub setting: &'static str,
    /// Why its value was refused.
    pub reason: String,
}

fn bad(setting: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        setting,
        reason: reason.into(),
    }
}

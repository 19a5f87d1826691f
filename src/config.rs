//! Configuration: typed and validated once at start-up. Precedence: command-line flags >
//! environment (`MAILROOM_*`) > TOML file (`--config`) > defaults. A bad setting is one
//! clear line naming it and exit code 64.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use crate::domain::Limits;
use crate::intake::IntakeConfig;
use crate::relay::RelayConfig;
use crate::relay::backoff::RetryPolicy;

/// Settings as given on the command line or in the environment. Every field is optional
/// so that the file and the defaults can fill the gaps.
#[derive(Debug, Clone, Default, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// TOML configuration file (lowest precedence after defaults).
    #[arg(long, env = "MAILROOM_CONFIG", global = true)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// gRPC listen address [default: 127.0.0.1:50051].
    #[arg(long, env = "MAILROOM_LISTEN", global = true)]
    pub listen: Option<String>,
    /// Database URL: `sqlite://FILE` (embedded) or `postgres://…` [default: sqlite://mailroom.db].
    #[arg(
        long,
        env = "MAILROOM_DATABASE_URL",
        global = true,
        hide_env_values = true
    )]
    pub database_url: Option<String>,
    /// Database connection pool size (PostgreSQL) [default: 16].
    #[arg(long, env = "MAILROOM_DATABASE_MAX_CONNECTIONS", global = true)]
    pub database_max_connections: Option<u32>,
    /// Run migrations at start-up [default: true].
    #[arg(long, env = "MAILROOM_MIGRATE", global = true)]
    pub migrate: Option<bool>,
    /// Log format: `human` or `json` [default: human]. Levels come from RUST_LOG.
    #[arg(long, env = "MAILROOM_LOG_FORMAT", global = true)]
    pub log_format: Option<String>,
    /// Kafka bootstrap servers `host:port[,…]`. Set: the relay publishes to Kafka.
    /// Unset: the local sink.
    #[arg(long, env = "MAILROOM_KAFKA_BROKERS", global = true)]
    pub kafka_brokers: Option<String>,
    /// Extra librdkafka properties, `key=value[,key=value…]` (security.protocol,
    /// sasl.*, ssl.*, linger.ms, …). Idempotence and acks=all are always kept.
    #[arg(long, env = "MAILROOM_KAFKA_PROPERTIES", global = true, value_parser = parse_properties, hide_env_values = true)]
    pub kafka_properties: Option<BTreeMap<String, String>>,
    /// Kafka delivery timeout in ms; a delivery not acknowledged by then is a transient
    /// failure [default: 15000].
    #[arg(long, env = "MAILROOM_KAFKA_MESSAGE_TIMEOUT_MS", global = true)]
    pub kafka_message_timeout_ms: Option<u64>,
    /// Local sink target: `stdout` or a file path for JSON lines [default: stdout].
    #[arg(long, env = "MAILROOM_LOCAL_SINK", global = true)]
    pub local_sink: Option<String>,
    /// CloudEvents `ce_source` attribute; must differ between deployments that can feed
    /// one consumer [default: mailroom/<installation id>, a UUID generated once per
    /// database].
    #[arg(long, env = "MAILROOM_SOURCE", global = true)]
    pub source: Option<String>,
    /// Relay tasks in this process [default: 2].
    #[arg(long, env = "MAILROOM_RELAYS", global = true)]
    pub relays: Option<usize>,
    /// Events per relay cycle [default: 1000].
    #[arg(long, env = "MAILROOM_RELAY_BATCH_SIZE", global = true)]
    pub relay_batch_size: Option<u32>,
    /// Keys leased per relay cycle [default: 250].
    #[arg(long, env = "MAILROOM_RELAY_MAX_KEYS", global = true)]
    pub relay_max_keys: Option<u32>,
    /// Bytes (payload and headers) read per relay cycle, keyed and unkeyed each; at least
    /// one event [default: 67108864].
    #[arg(long, env = "MAILROOM_RELAY_MAX_BYTES", global = true)]
    pub relay_max_bytes: Option<u64>,
    /// Longest run of one key per cycle [default: 500].
    #[arg(long, env = "MAILROOM_RELAY_MAX_RUN", global = true)]
    pub relay_max_run: Option<u32>,
    /// Claim lease in ms; must exceed the Kafka message timeout [default: 60000].
    #[arg(long, env = "MAILROOM_RELAY_LEASE_MS", global = true)]
    pub relay_lease_ms: Option<u64>,
    /// Fallback poll interval in ms [default: 250].
    #[arg(long, env = "MAILROOM_RELAY_POLL_MS", global = true)]
    pub relay_poll_ms: Option<u64>,
    /// Wake other processes through PostgreSQL LISTEN/NOTIFY; false = poll only (for
    /// poolers without LISTEN) [default: true].
    #[arg(long, env = "MAILROOM_LISTEN_NOTIFY", global = true)]
    pub listen_notify: Option<bool>,
    /// Backoff base in ms for counted failures; 0 = next cycle [default: 10000].
    #[arg(long, env = "MAILROOM_RETRY_BASE_MS", global = true)]
    pub retry_base_ms: Option<u64>,
    /// Backoff cap in ms [default: 3600000].
    #[arg(long, env = "MAILROOM_RETRY_CAP_MS", global = true)]
    pub retry_cap_ms: Option<u64>,
    /// Default attempt budget per event [default: 6].
    #[arg(long, env = "MAILROOM_MAX_ATTEMPTS", global = true)]
    pub max_attempts: Option<u32>,
    /// Largest payload in bytes [default: 1048576].
    #[arg(long, env = "MAILROOM_MAX_PAYLOAD_BYTES", global = true)]
    pub max_payload_bytes: Option<usize>,
    /// Most events in one EnqueueBatch [default: 1000].
    #[arg(long, env = "MAILROOM_MAX_BATCH", global = true)]
    pub max_batch: Option<usize>,
    /// Largest EnqueueBatch request in bytes, as encoded on the wire [default: 67108864].
    #[arg(long, env = "MAILROOM_MAX_BATCH_BYTES", global = true)]
    pub max_batch_bytes: Option<usize>,
    /// Most headers per event [default: 64].
    #[arg(long, env = "MAILROOM_MAX_HEADERS", global = true)]
    pub max_headers: Option<usize>,
    /// Most header bytes per event [default: 16384].
    #[arg(long, env = "MAILROOM_MAX_HEADER_BYTES", global = true)]
    pub max_header_bytes: Option<usize>,
    /// Enqueue requests waiting for a writer before RESOURCE_EXHAUSTED [default: 10000].
    #[arg(long, env = "MAILROOM_INTAKE_QUEUE", global = true)]
    pub intake_queue: Option<usize>,
    /// Bytes of enqueue requests waiting for a writer before RESOURCE_EXHAUSTED
    /// [default: 268435456].
    #[arg(long, env = "MAILROOM_INTAKE_QUEUE_BYTES", global = true)]
    pub intake_queue_bytes: Option<usize>,
    /// Concurrent enqueue transactions [default: 4 on PostgreSQL, 1 on SQLite].
    #[arg(long, env = "MAILROOM_INTAKE_WRITERS", global = true)]
    pub intake_writers: Option<usize>,
    /// Grace period for in-flight work on SIGTERM, in ms [default: 30000].
    #[arg(long, env = "MAILROOM_SHUTDOWN_GRACE_MS", global = true)]
    pub shutdown_grace_ms: Option<u64>,
    /// Readiness: NOT_SERVING once the broker has been unreachable for this long, in ms
    /// [default: unset, the broker does not affect readiness].
    #[arg(long, env = "MAILROOM_READY_MAX_BROKER_DOWN_MS", global = true)]
    pub ready_max_broker_down_ms: Option<u64>,
    /// Readiness: NOT_SERVING while the oldest pending outbox event is older than this, in
    /// ms [default: unset]. Checked every 5 s with the admin stats query.
    #[arg(long, env = "MAILROOM_READY_MAX_LAG_MS", global = true)]
    pub ready_max_lag_ms: Option<u64>,
    /// OTLP/gRPC endpoint for trace export, e.g. `http://127.0.0.1:4317` [default: unset,
    /// no export].
    #[arg(long, env = "MAILROOM_OTLP_ENDPOINT", global = true)]
    pub otlp_endpoint: Option<String>,
    /// Database health check interval in ms [default: 1000].
    #[arg(long, env = "MAILROOM_HEALTH_INTERVAL_MS", global = true)]
    pub health_interval_ms: Option<u64>,
    /// Testing only: fraction of deliveries failed on purpose as counted failures
    /// [default: 0].
    #[arg(long, env = "MAILROOM_FAULT_COUNTED_RATE", global = true, hide = true)]
    pub fault_counted_rate: Option<f64>,
    /// Testing only: fraction of deliveries failed on purpose as transient failures
    /// [default: 0].
    #[arg(
        long,
        env = "MAILROOM_FAULT_TRANSIENT_RATE",
        global = true,
        hide = true
    )]
    pub fault_transient_rate: Option<f64>,
    /// Bearer token the AdminService requires (`authorization: Bearer <token>`). Unset:
    /// no token, and the admin RPCs are open to whoever reaches the listen address.
    #[arg(
        long,
        env = "MAILROOM_ADMIN_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// Serve without any token on a non-loopback address. Without it, such a setup
    /// refuses to start; with it, a warning is logged at start-up [default: false].
    #[arg(
        long,
        env = "MAILROOM_ALLOW_UNAUTHENTICATED",
        global = true,
        num_args = 0..=1,
        default_missing_value = "true"
    )]
    pub allow_unauthenticated: Option<bool>,
    /// Inbox subscriptions (`[[subscriptions]]` tables; file only).
    #[arg(skip)]
    pub subscriptions: Option<Vec<SubscriptionSettings>>,
    /// Token file (TOML, `[[token]]` entries with name, token, scopes, optional topics):
    /// set, every RPC except health and reflection needs a token of the right scope.
    #[arg(long, env = "MAILROOM_TOKENS_FILE", global = true)]
    pub tokens_file: Option<PathBuf>,
    /// Prometheus metrics address (HTTP, path /metrics); unset or empty: no metrics
    /// endpoint [default: off].
    #[arg(long, env = "MAILROOM_METRICS_LISTEN", global = true)]
    pub metrics_listen: Option<String>,
    /// Operator console address (HTTP, browser UI behind the admin tokens); unset or
    /// empty: no console [default: off].
    #[arg(long, env = "MAILROOM_CONSOLE_LISTEN", global = true)]
    pub console_listen: Option<String>,
    /// The console shows but never acts (no requeue, no cancel) [default: false].
    #[arg(long, env = "MAILROOM_CONSOLE_READ_ONLY", global = true)]
    pub console_read_only: Option<bool>,
    /// How often the backlog gauges (pending, blocked keys, oldest age) are refreshed
    /// from the database, in ms [default: 15000].
    #[arg(long, env = "MAILROOM_METRICS_STATS_INTERVAL_MS", global = true)]
    pub metrics_stats_interval_ms: Option<u64>,
    /// TLS certificate chain (PEM) for the gRPC port; needs tls_key [default: plaintext].
    #[arg(long, env = "MAILROOM_TLS_CERT", global = true)]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) for the gRPC port.
    #[arg(long, env = "MAILROOM_TLS_KEY", global = true)]
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM) for client certificates: set, clients must present a
    /// certificate it signed (mTLS).
    #[arg(long, env = "MAILROOM_TLS_CLIENT_CA", global = true)]
    pub tls_client_ca: Option<PathBuf>,
    /// RPCs served at once (health excluded); beyond it RESOURCE_EXHAUSTED at once;
    /// 0 = no limit [default: 1024].
    #[arg(long, env = "MAILROOM_MAX_CONCURRENT_RPCS", global = true)]
    pub max_concurrent_rpcs: Option<usize>,
    /// Server-side time limit of an RPC in ms, answered UNAVAILABLE; 0 = none
    /// [default: 30000].
    #[arg(long, env = "MAILROOM_RPC_TIMEOUT_MS", global = true)]
    pub rpc_timeout_ms: Option<u64>,
    /// How long a request waits for a database connection before UNAVAILABLE, in ms
    /// (PostgreSQL) [default: 3000].
    #[arg(long, env = "MAILROOM_DATABASE_ACQUIRE_TIMEOUT_MS", global = true)]
    pub database_acquire_timeout_ms: Option<u64>,
    /// PostgreSQL statement timeout, in ms, of every query class that has no setting
    /// of its own (below); migrations are exempt; 0 = none.
    #[arg(long, env = "MAILROOM_DATABASE_STATEMENT_TIMEOUT_MS", global = true)]
    pub database_statement_timeout_ms: Option<u64>,
    /// Statement timeout of enqueues and inbox receives (the writes a caller waits on),
    /// in ms; 0 = none [default: 10000].
    #[arg(long, env = "MAILROOM_DATABASE_ENQUEUE_TIMEOUT_MS", global = true)]
    pub database_enqueue_timeout_ms: Option<u64>,
    /// Statement timeout of the relays and dispatchers (claims, settles, lease renewals)
    /// and of retention, in ms; 0 = none [default: 30000].
    #[arg(long, env = "MAILROOM_DATABASE_RELAY_TIMEOUT_MS", global = true)]
    pub database_relay_timeout_ms: Option<u64>,
    /// Statement timeout of admin RPCs, the console and stats, in ms; 0 = none
    /// [default: 30000].
    #[arg(long, env = "MAILROOM_DATABASE_ADMIN_TIMEOUT_MS", global = true)]
    pub database_admin_timeout_ms: Option<u64>,
    /// Completed events are deleted this many hours after publication; 0 = keep
    /// forever [default: 168].
    #[arg(long, env = "MAILROOM_RETENTION_COMPLETED_HOURS", global = true)]
    pub retention_completed_hours: Option<u64>,
    /// Failed events are deleted this many hours after they failed; 0 = keep until
    /// requeued [default: 0].
    #[arg(long, env = "MAILROOM_RETENTION_FAILED_HOURS", global = true)]
    pub retention_failed_hours: Option<u64>,
    /// How often the retention task runs, in ms; 0 = never [default: 60000].
    #[arg(long, env = "MAILROOM_RETENTION_INTERVAL_MS", global = true)]
    pub retention_interval_ms: Option<u64>,
    /// Rows one retention DELETE removes at most [default: 1000].
    #[arg(long, env = "MAILROOM_RETENTION_BATCH", global = true)]
    pub retention_batch: Option<u32>,
}

/// One `[[subscriptions]]` table of the configuration file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SubscriptionSettings {
    /// Name, `[a-zA-Z0-9._-]`, unique.
    pub name: String,
    /// Kafka topics to consume (none: the subscription takes `InboxService.Receive` only).
    #[serde(default)]
    pub topics: Vec<String>,
    /// Kafka consumer group [default: mailroom-NAME].
    pub group: Option<String>,
    /// The subscriber's `HandlerService` endpoint, e.g. `http://127.0.0.1:7000`.
    pub handler: String,
    /// Timeout of one Handle call in ms [default: 10000].
    pub handler_timeout_ms: Option<u64>,
    /// Keys handled concurrently [default: 8].
    pub concurrency: Option<usize>,
    /// Attempt budget per message [default: the outbox's].
    pub max_attempts: Option<u32>,
    /// Backoff base in ms [default: the outbox's].
    pub retry_base_ms: Option<u64>,
    /// Backoff cap in ms [default: the outbox's].
    pub retry_cap_ms: Option<u64>,
    /// CA certificates (PEM) to verify an `https://` handler [default: the webpki roots].
    pub handler_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to the handler (mTLS); needs handler_key.
    pub handler_cert: Option<PathBuf>,
    /// Private key (PEM) of handler_cert.
    pub handler_key: Option<PathBuf>,
    /// Bearer token sent to the handler as `authorization: Bearer <token>`.
    pub handler_token: Option<String>,
    /// File holding the handler's bearer token (first line), instead of handler_token.
    pub handler_token_file: Option<PathBuf>,
    /// Latest `retry.not_before` a handler may ask for, in ms from now; later times are
    /// cut to it [default: 86400000, one day].
    pub handler_max_defer_ms: Option<u64>,
}

/// A validated subscription.
#[derive(Debug, Clone, PartialEq)]
pub struct SubscriptionConfig {
    pub name: String,
    pub topics: Vec<String>,
    pub group: String,
    pub handler: String,
    pub handler_timeout: Duration,
    pub concurrency: usize,
    pub retry: RetryPolicy,
    /// TLS towards the handler (files read when the inbox starts).
    pub handler_tls: ClientTls,
    /// Bearer token sent with every Handle call.
    pub handler_token: Option<Secret>,
    /// Cap on a handler's `retry.not_before`.
    pub handler_max_defer: Duration,
}

/// TLS settings of a gRPC client (the inbox's handler client, `mailroom admin`): PEM
/// files. All unset: the webpki roots verify an `https://` server, no client certificate.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClientTls {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl ClientTls {
    /// The tonic client configuration for `domain`; errors name the file, never its content.
    pub fn tonic(&self) -> anyhow::Result<tonic::transport::ClientTlsConfig> {
        use anyhow::Context as _;
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let read = |p: &std::path::Path, what: &str| {
            std::fs::read(p).with_context(|| format!("reading the TLS {what} {}", p.display()))
        };
        let mut c = ClientTlsConfig::new();
        c = match &self.ca {
            Some(ca) => c.ca_certificate(Certificate::from_pem(read(ca, "CA")?)),
            None => c.with_webpki_roots(),
        };
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                c = c.identity(Identity::from_pem(
                    read(cert, "client certificate")?,
                    read(key, "client key")?,
                ));
            }
            (None, None) => {}
            _ => {
                anyhow::bail!("a TLS client certificate needs its key and the key its certificate")
            }
        }
        Ok(c)
    }
}

/// A secret string: `Debug` never shows it.
#[derive(Clone, PartialEq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"***\"")
    }
}

fn subscription(
    s: SubscriptionSettings,
    outbox: RetryPolicy,
) -> Result<SubscriptionConfig, ConfigError> {
    const SETTING: &str = "subscriptions";
    let name_ok = !s.name.is_empty()
        && s.name.len() <= 100
        && s.name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !name_ok {
        return Err(bad(
            SETTING,
            format!(
                "name {:?} must be 1-100 characters of [a-zA-Z0-9._-]",
                s.name
            ),
        ));
    }
    for t in &s.topics {
        crate::domain::check_topic(t)
            .map_err(|why| bad(SETTING, format!("{}: topic {t:?} {why}", s.name)))?;
    }
    if !(s.handler.starts_with("http://") || s.handler.starts_with("https://"))
        || s.handler.parse::<tonic::codegen::http::Uri>().is_err()
    {
        return Err(bad(
            SETTING,
            format!("{}: handler {:?} is not an http(s) URL", s.name, s.handler),
        ));
    }
    let retry = RetryPolicy {
        base: s.retry_base_ms.map_or(outbox.base, Duration::from_millis),
        cap: s.retry_cap_ms.map_or(outbox.cap, Duration::from_millis),
        max_attempts: s.max_attempts.unwrap_or(outbox.max_attempts),
    };
    if retry.max_attempts == 0 || retry.max_attempts > 100 || retry.cap < retry.base {
        return Err(bad(
            SETTING,
            format!(
                "{}: max_attempts must be 1..=100 and retry_cap_ms >= retry_base_ms",
                s.name
            ),
        ));
    }
    let concurrency = s.concurrency.unwrap_or(8);
    if concurrency == 0 || concurrency > 1024 {
        return Err(bad(
            SETTING,
            format!("{}: concurrency must be 1..=1024", s.name),
        ));
    }
    if s.handler_cert.is_some() != s.handler_key.is_some() {
        return Err(bad(
            SETTING,
            format!("{}: set handler_cert and handler_key together", s.name),
        ));
    }
    let handler_token = match (s.handler_token, &s.handler_token_file) {
        (Some(_), Some(_)) => {
            return Err(bad(
                SETTING,
                format!(
                    "{}: set handler_token or handler_token_file, not both",
                    s.name
                ),
            ));
        }
        (Some(t), None) => Some(t),
        (None, Some(p)) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| {
                    bad(
                        SETTING,
                        format!("{}: cannot read {}: {}", s.name, p.display(), e.kind()),
                    )
                })?
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string(),
        ),
        (None, None) => None,
    };
    if let Some(t) = &handler_token
        && (t.is_empty() || !t.bytes().all(|b| (0x21..0x7f).contains(&b)))
    {
        return Err(bad(
            SETTING,
            format!(
                "{}: the handler token must be printable ASCII without spaces",
                s.name
            ),
        ));
    }
    Ok(SubscriptionConfig {
        handler_tls: ClientTls {
            ca: s.handler_ca,
            cert: s.handler_cert,
            key: s.handler_key,
        },
        handler_token: handler_token.map(Secret),
        handler_max_defer: Duration::from_millis(s.handler_max_defer_ms.unwrap_or(86_400_000)),
        group: s.group.unwrap_or_else(|| format!("mailroom-{}", s.name)),
        handler_timeout: Duration::from_millis(s.handler_timeout_ms.unwrap_or(10_000).max(1)),
        topics: s.topics,
        handler: s.handler,
        name: s.name,
        concurrency,
        retry,
    })
}

fn parse_properties(s: &str) -> Result<BTreeMap<String, String>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .ok_or_else(|| format!("{p:?} is not key=value"))
        })
        .collect()
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
    pub setting: &'static str,
    pub reason: String,
}

fn bad(setting: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        setting,
        reason: reason.into(),
    }
}

/// Where the relay publishes.
#[derive(Debug, Clone, PartialEq)]
pub enum SinkConfig {
    Kafka {
        brokers: String,
        properties: BTreeMap<String, String>,
        message_timeout: Duration,
    },
    /// JSON lines; `None` is stdout.
    Local { path: Option<PathBuf> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Human,
    Json,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub database_url: String,
    pub database_max_connections: u32,
    pub migrate: bool,
    pub log_format: LogFormat,
    pub sink: SinkConfig,
    /// `MAILROOM_SOURCE`; `None` means `mailroom/<installation id>` (see `app::ce_source`).
    pub source: Option<String>,
    pub relays: usize,
    pub relay: RelayConfig,
    pub listen_notify: bool,
    pub limits: Limits,
    /// Largest `EnqueueBatch` request on the wire (`Enqueue` is limited to one event:
    /// `enqueue_request_bytes`).
    pub max_batch_bytes: usize,
    pub intake: IntakeConfig,
    pub shutdown_grace: Duration,
    pub health_interval: Duration,
    /// Readiness drops once the broker has been unreachable this long.
    pub ready_max_broker_down: Option<Duration>,
    /// Readiness drops while the oldest pending event is older than this.
    pub ready_max_lag: Option<Duration>,
    /// OTLP/gRPC trace export endpoint; `None`: no export.
    pub otlp_endpoint: Option<String>,
    /// Fault injection at the sink (testing only): (counted rate, transient rate).
    pub faults: (f64, f64),
    /// Token the AdminService requires; `None`: no token.
    pub admin_token: Option<String>,
    /// Serving unauthenticated RPCs on a non-loopback address (only with
    /// `--allow-unauthenticated`; warned at start-up).
    pub open_on_network: bool,
    /// Inbox subscriptions.
    pub subscriptions: Vec<SubscriptionConfig>,
    /// Tokens from `tokens_file` (the admin token is added to them by the app).
    pub tokens: Vec<crate::api::auth::TokenEntry>,
    pub metrics_listen: Option<SocketAddr>,
    /// The operator console's address, when it is served.
    pub console_listen: Option<SocketAddr>,
    pub console_read_only: bool,
    pub metrics_stats_interval: Duration,
    pub tls: Option<TlsConfig>,
    pub overload: crate::api::overload::OverloadConfig,
    pub database_acquire_timeout: Duration,
    /// PostgreSQL `statement_timeout` per query class.
    pub database_timeouts: DatabaseTimeouts,
    pub retention: crate::retention::RetentionConfig,
}

/// TLS for the gRPC port: PEM files.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Set: clients must present a certificate signed by one of these CAs.
    pub client_ca: Option<PathBuf>,
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

impl Settings {
    /// Fills unset fields from `lower`.
    fn or(self, lower: Settings) -> Settings {
        macro_rules! pick {
            ($($f:ident),*) => { Settings { config: self.config.or(lower.config), $($f: self.$f.or(lower.$f)),* } };
        }
        pick!(
            listen,
            database_url,
            database_max_connections,
            migrate,
            log_format,
            kafka_brokers,
            kafka_properties,
            kafka_message_timeout_ms,
            local_sink,
            source,
            relays,
            relay_batch_size,
            relay_max_keys,
            relay_max_bytes,
            relay_max_run,
            relay_lease_ms,
            relay_poll_ms,
            listen_notify,
            retry_base_ms,
            retry_cap_ms,
            max_attempts,
            max_payload_bytes,
            max_batch,
            max_batch_bytes,
            max_headers,
            max_header_bytes,
            intake_queue,
            intake_queue_bytes,
            intake_writers,
            shutdown_grace_ms,
            health_interval_ms,
            ready_max_broker_down_ms,
            ready_max_lag_ms,
            otlp_endpoint,
            fault_counted_rate,
            fault_transient_rate,
            admin_token,
            allow_unauthenticated,
            subscriptions,
            tokens_file,
            metrics_listen,
            console_listen,
            console_read_only,
            metrics_stats_interval_ms,
            tls_cert,
            tls_key,
            tls_client_ca,
            max_concurrent_rpcs,
            rpc_timeout_ms,
            database_acquire_timeout_ms,
            database_statement_timeout_ms,
            database_enqueue_timeout_ms,
            database_relay_timeout_ms,
            database_admin_timeout_ms,
            retention_completed_hours,
            retention_failed_hours,
            retention_interval_ms,
            retention_batch
        )
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
    pub fn resolve(s: Settings) -> Result<Config, ConfigError> {
        let listen_s = s.listen.unwrap_or_else(|| "127.0.0.1:50051".into());
        let listen: SocketAddr = listen_s.parse().map_err(|_| {
            bad(
                "listen (MAILROOM_LISTEN)",
                format!("{listen_s:?} is not host:port with an IP host"),
            )
        })?;
        let database_url = s
            .database_url
            .unwrap_or_else(|| "sqlite://mailroom.db".into());
        let is_pg =
            database_url.starts_with("postgres://") || database_url.starts_with("postgresql://");
        if !is_pg && !database_url.starts_with("sqlite:") {
            return Err(bad(
                "database_url (MAILROOM_DATABASE_URL)",
                "must start with sqlite: or postgres://",
            ));
        }
        let log_format = match s.log_format.as_deref().unwrap_or("human") {
            "human" => LogFormat::Human,
            "json" => LogFormat::Json,
            other => {
                return Err(bad(
                    "log_format (MAILROOM_LOG_FORMAT)",
                    format!("{other:?} is not human or json"),
                ));
            }
        };
        let message_timeout = Duration::from_millis(s.kafka_message_timeout_ms.unwrap_or(15_000));
        let sink = match s.kafka_brokers.filter(|b| !b.trim().is_empty()) {
            Some(brokers) => SinkConfig::Kafka {
                brokers,
                properties: s.kafka_properties.unwrap_or_default(),
                message_timeout,
            },
            None => SinkConfig::Local {
                path: match s.local_sink.as_deref().unwrap_or("stdout") {
                    "stdout" | "-" => None,
                    p => Some(PathBuf::from(p)),
                },
            },
        };
        let retry = RetryPolicy {
            base: Duration::from_millis(s.retry_base_ms.unwrap_or(10_000)),
            cap: Duration::from_millis(s.retry_cap_ms.unwrap_or(3_600_000)),
            max_attempts: s.max_attempts.unwrap_or(6),
        };
        if retry.max_attempts == 0 || retry.max_attempts > 100 {
            return Err(bad(
                "max_attempts (MAILROOM_MAX_ATTEMPTS)",
                "must be 1..=100",
            ));
        }
        if retry.cap < retry.base {
            return Err(bad(
                "retry_cap_ms (MAILROOM_RETRY_CAP_MS)",
                "must be at least retry_base_ms",
            ));
        }
        let relay = RelayConfig {
            batch_size: s.relay_batch_size.unwrap_or(1000),
            max_keys: s.relay_max_keys.unwrap_or(250).max(1),
            max_run: s.relay_max_run.unwrap_or(500),
            max_bytes: s.relay_max_bytes.unwrap_or(64 * 1024 * 1024),
            lease: Duration::from_millis(s.relay_lease_ms.unwrap_or(60_000)),
            poll_interval: Duration::from_millis(s.relay_poll_ms.unwrap_or(250)),
            retry,
            ..RelayConfig::default()
        };
        if relay.batch_size == 0 || relay.batch_size > 100_000 {
            return Err(bad(
                "relay_batch_size (MAILROOM_RELAY_BATCH_SIZE)",
                "must be 1..=100000",
            ));
        }
        if relay.max_bytes == 0 {
            return Err(bad(
                "relay_max_bytes (MAILROOM_RELAY_MAX_BYTES)",
                "must be at least 1",
            ));
        }
        if relay.max_run == 0 {
            return Err(bad(
                "relay_max_run (MAILROOM_RELAY_MAX_RUN)",
                "must be at least 1",
            ));
        }
        if relay.poll_interval.is_zero() {
            return Err(bad(
                "relay_poll_ms (MAILROOM_RELAY_POLL_MS)",
                "must be positive",
            ));
        }
        if matches!(sink, SinkConfig::Kafka { .. })
            && relay.lease <= message_timeout + Duration::from_secs(5)
        {
            return Err(bad(
                "relay_lease_ms (MAILROOM_RELAY_LEASE_MS)",
                "must exceed kafka_message_timeout_ms by at least 5 s, or a slow delivery could outlive its claim",
            ));
        }
        let limits = Limits {
            max_payload_bytes: s.max_payload_bytes.unwrap_or(1024 * 1024),
            max_headers: s.max_headers.unwrap_or(64),
            max_header_bytes: s.max_header_bytes.unwrap_or(16 * 1024),
            max_batch: s.max_batch.unwrap_or(1000),
            default_max_attempts: retry.max_attempts,
            ..Limits::default()
        };
        if limits.max_payload_bytes > 64 * 1024 * 1024 {
            return Err(bad(
                "max_payload_bytes (MAILROOM_MAX_PAYLOAD_BYTES)",
                "must be at most 64 MiB",
            ));
        }
        if let SinkConfig::Kafka { properties, .. } = &sink
            && let Some(set) = properties.get("message.max.bytes")
        {
            let needed = crate::sink::kafka::record_bytes_needed(
                limits.max_payload_bytes,
                limits.max_header_bytes,
            );
            match set.parse::<usize>() {
                Ok(v) if v >= needed => {}
                _ => {
                    return Err(bad(
                        "kafka_properties (MAILROOM_KAFKA_PROPERTIES)",
                        format!(
                            "message.max.bytes={set} cannot carry a record of max_payload_bytes \
                             plus max_header_bytes ({needed} bytes); raise it or lower those limits"
                        ),
                    ));
                }
            }
        }
        if limits.max_batch == 0 || limits.max_batch > 100_000 {
            return Err(bad("max_batch (MAILROOM_MAX_BATCH)", "must be 1..=100000"));
        }
        let max_batch_bytes = s.max_batch_bytes.unwrap_or(64 * 1024 * 1024);
        // One event must fit in a batch: its payload, headers and the encoding's slack.
        let min_batch_bytes = enqueue_request_bytes(&limits);
        if max_batch_bytes < min_batch_bytes || max_batch_bytes > 1024 * 1024 * 1024 {
            return Err(bad(
                "max_batch_bytes (MAILROOM_MAX_BATCH_BYTES)",
                format!(
                    "must be {min_batch_bytes}..=1073741824 (one event of max_payload_bytes and \
                     max_header_bytes must fit)"
                ),
            ));
        }
        let queue_bytes = s.intake_queue_bytes.unwrap_or(256 * 1024 * 1024);
        if queue_bytes < max_batch_bytes {
            return Err(bad(
                "intake_queue_bytes (MAILROOM_INTAKE_QUEUE_BYTES)",
                "must be at least max_batch_bytes (one batch must fit)",
            ));
        }
        let intake = IntakeConfig {
            queue_bytes,
            queue_depth: s.intake_queue.unwrap_or(10_000).max(1),
            writers: s.intake_writers.unwrap_or(if is_pg { 4 } else { 1 }).max(1),
            max_group: limits.max_batch.max(1000),
            ..IntakeConfig::default()
        };
        let metrics_listen = match s.metrics_listen.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(a) => Some(a.parse::<SocketAddr>().map_err(|_| {
                bad(
                    "metrics_listen (MAILROOM_METRICS_LISTEN)",
                    format!("{a:?} is not host:port with an IP host"),
                )
            })?),
        };
        let console_listen = match s.console_listen.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(a) => Some(a.parse::<SocketAddr>().map_err(|_| {
                bad(
                    "console_listen (MAILROOM_CONSOLE_LISTEN)",
                    format!("{a:?} is not host:port with an IP host"),
                )
            })?),
        };
        let tls = match (s.tls_cert, s.tls_key) {
            (None, None) => {
                if s.tls_client_ca.is_some() {
                    return Err(bad(
                        "tls_client_ca (MAILROOM_TLS_CLIENT_CA)",
                        "needs tls_cert and tls_key",
                    ));
                }
                None
            }
            (Some(cert), Some(key)) => Some(TlsConfig {
                cert,
                key,
                client_ca: s.tls_client_ca,
            }),
            _ => {
                return Err(bad(
                    "tls_cert/tls_key (MAILROOM_TLS_CERT, MAILROOM_TLS_KEY)",
                    "set both or neither",
                ));
            }
        };
        let tokens = match &s.tokens_file {
            None => Vec::new(),
            Some(path) => crate::api::auth::load_tokens(path)
                .map_err(|why| bad("tokens_file (MAILROOM_TOKENS_FILE)", why))?,
        };
        let admin_token = s.admin_token.filter(|t| !t.is_empty());
        if let Some(t) = &admin_token {
            // The token file's rules: a minimum length, and no secret shared with a file token.
            if t.len() < crate::api::auth::MIN_TOKEN_LEN {
                return Err(bad(
                    "admin_token (MAILROOM_ADMIN_TOKEN)",
                    format!(
                        "is shorter than {} characters",
                        crate::api::auth::MIN_TOKEN_LEN
                    ),
                ));
            }
            if tokens.iter().any(|e| e.token == *t) {
                return Err(bad(
                    "admin_token (MAILROOM_ADMIN_TOKEN)",
                    "has the same secret as a token of tokens_file",
                ));
            }
        }
        let allow_unauthenticated = s.allow_unauthenticated.unwrap_or(false);
        // Closed by default: every caller is authenticated by a token file or a client
        // certificate (mTLS), or the port is reachable from this host only. The legacy
        // admin token alone leaves Enqueue and the inbox open, so it does not count.
        let authenticated =
            !tokens.is_empty() || tls.as_ref().is_some_and(|t| t.client_ca.is_some());
        if !listen.ip().is_loopback() && !authenticated && !allow_unauthenticated {
            return Err(bad(
                "listen (MAILROOM_LISTEN)",
                format!(
                    "{listen} is not a loopback address and no caller is authenticated: set \
                     tokens_file (MAILROOM_TOKENS_FILE) or tls_client_ca, or pass \
                     --allow-unauthenticated (MAILROOM_ALLOW_UNAUTHENTICATED=true) to serve \
                     every RPC to anyone who can connect"
                ),
            ));
        }
        // The console is closed by default too: off loopback it needs an admin-scope token.
        if let Some(c) = console_listen
            && !c.ip().is_loopback()
            && tokens.is_empty()
            && admin_token.is_none()
            && !allow_unauthenticated
        {
            return Err(bad(
                "console_listen (MAILROOM_CONSOLE_LISTEN)",
                format!(
                    "{c} is not a loopback address and no admin token is configured: set \
                     tokens_file (MAILROOM_TOKENS_FILE) or admin_token, or pass \
                     --allow-unauthenticated"
                ),
            ));
        }
        let hours = |h: u64| (h > 0).then(|| Duration::from_secs(h.saturating_mul(3600)));
        let retention = crate::retention::RetentionConfig {
            completed: hours(s.retention_completed_hours.unwrap_or(168)),
            failed: hours(s.retention_failed_hours.unwrap_or(0)),
            interval: Some(Duration::from_millis(
                s.retention_interval_ms.unwrap_or(60_000),
            ))
            .filter(|d| !d.is_zero()),
            batch: s.retention_batch.unwrap_or(1000),
        };
        if retention.batch == 0 || retention.batch > 100_000 {
            return Err(bad(
                "retention_batch (MAILROOM_RETENTION_BATCH)",
                "must be 1..=100000",
            ));
        }
        let overload = crate::api::overload::OverloadConfig {
            max_concurrent_rpcs: s.max_concurrent_rpcs.unwrap_or(1024),
            rpc_timeout: Some(Duration::from_millis(s.rpc_timeout_ms.unwrap_or(30_000)))
                .filter(|d| !d.is_zero()),
        };
        let relays = s.relays.unwrap_or(2);
        if relays > 64 {
            return Err(bad("relays (MAILROOM_RELAYS)", "must be at most 64"));
        }
        Ok(Config {
            listen,
            database_url,
            database_max_connections: s.database_max_connections.unwrap_or(16).max(2),
            migrate: s.migrate.unwrap_or(true),
            log_format,
            sink,
            source: s.source.filter(|x| !x.is_empty()),
            relays,
            relay,
            listen_notify: s.listen_notify.unwrap_or(true),
            limits,
            max_batch_bytes,
            intake,
            shutdown_grace: Duration::from_millis(s.shutdown_grace_ms.unwrap_or(30_000)),
            health_interval: Duration::from_millis(s.health_interval_ms.unwrap_or(1000).max(50)),
            ready_max_broker_down: s.ready_max_broker_down_ms.map(Duration::from_millis),
            ready_max_lag: s.ready_max_lag_ms.map(Duration::from_millis),
            otlp_endpoint: s.otlp_endpoint.filter(|e| !e.is_empty()),
            faults: {
                let f = (
                    s.fault_counted_rate.unwrap_or(0.0),
                    s.fault_transient_rate.unwrap_or(0.0),
                );
                if !(0.0..=1.0).contains(&f.0) || !(0.0..=1.0).contains(&f.1) {
                    return Err(bad("fault_*_rate", "must be within 0..=1"));
                }
                f
            },
            admin_token,
            open_on_network: !listen.ip().is_loopback() && !authenticated,
            subscriptions: {
                let subs = s
                    .subscriptions
                    .unwrap_or_default()
                    .into_iter()
                    .map(|sub| subscription(sub, retry))
                    .collect::<Result<Vec<_>, _>>()?;
                let mut names = std::collections::HashSet::new();
                if let Some(dup) = subs.iter().find(|s| !names.insert(s.name.as_str())) {
                    return Err(bad(
                        "subscriptions",
                        format!("name {:?} appears twice", dup.name),
                    ));
                }
                subs
            },
            tokens,
            metrics_listen,
            console_listen,
            console_read_only: s.console_read_only.unwrap_or(false),
            metrics_stats_interval: Duration::from_millis(
                s.metrics_stats_interval_ms.unwrap_or(15_000).max(100),
            ),
            tls,
            overload,
            database_acquire_timeout: Duration::from_millis(
                s.database_acquire_timeout_ms.unwrap_or(3000).max(10),
            ),
            database_timeouts: {
                // A class's own setting, else the general one, else the class default.
                let class = |own: Option<u64>, default: u64| {
                    Some(Duration::from_millis(
                        own.or(s.database_statement_timeout_ms).unwrap_or(default),
                    ))
                    .filter(|d| !d.is_zero())
                };
                DatabaseTimeouts {
                    enqueue: class(s.database_enqueue_timeout_ms, 10_000),
                    relay: class(s.database_relay_timeout_ms, 30_000),
                    admin: class(s.database_admin_timeout_ms, 30_000),
                }
            },
            retention,
        })
    }

    pub fn is_postgres(&self) -> bool {
        self.database_url.starts_with("postgres")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_embedded_service() {
        let c = Config::default();
        assert_eq!(c.listen.to_string(), "127.0.0.1:50051");
        assert_eq!(c.database_url, "sqlite://mailroom.db");
        assert_eq!(c.sink, SinkConfig::Local { path: None });
        assert_eq!(c.limits.max_batch, 1000);
        assert_eq!(c.limits.max_payload_bytes, 1024 * 1024);
    }

    #[test]
    fn flags_beat_the_file() {
        let flags = Settings {
            listen: Some("127.0.0.1:1".into()),
            ..Default::default()
        };
        let file: Settings = toml::from_str("listen = \"127.0.0.1:2\"\nrelays = 3\n").unwrap();
        let c = Config::resolve(flags.or(file)).unwrap();
        assert_eq!(c.listen.port(), 1);
        assert_eq!(c.relays, 3);
    }

    #[test]
    fn bad_settings_name_themselves() {
        let e = Config::resolve(Settings {
            listen: Some("nowhere".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("MAILROOM_LISTEN"), "{e}");
        let e = Config::resolve(Settings {
            database_url: Some("mysql://x".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("MAILROOM_DATABASE_URL"), "{e}");
        assert!(toml::from_str::<Settings>("no_such_setting = 1").is_err());
    }

    #[test]
    fn the_console_is_closed_by_default_off_loopback() {
        let s = Settings {
            console_listen: Some("0.0.0.0:8080".into()),
            ..Settings::default()
        };
        let e = Config::resolve(s).unwrap_err().to_string();
        assert!(e.contains("MAILROOM_CONSOLE_LISTEN"), "{e}");
        let s = Settings {
            console_listen: Some("127.0.0.1:8080".into()),
            ..Settings::default()
        };
        assert!(Config::resolve(s).is_ok());
        let s = Settings {
            console_listen: Some("0.0.0.0:8080".into()),
            admin_token: Some("a-long-enough-admin-token".into()),
            ..Settings::default()
        };
        assert!(Config::resolve(s).is_ok());
    }

    #[test]
    fn a_producer_record_limit_below_the_payload_limit_is_refused() {
        let s = Settings {
            kafka_brokers: Some("k:9092".into()),
            kafka_properties: Some(BTreeMap::from([(
                "message.max.bytes".to_string(),
                "1000000".to_string(),
            )])),
            ..Settings::default()
        };
        let e = Config::resolve(s).unwrap_err().to_string();
        assert!(e.contains("message.max.bytes=1000000"), "{e}");
        let s = Settings {
            kafka_brokers: Some("k:9092".into()),
            kafka_properties: Some(BTreeMap::from([(
                "message.max.bytes".to_string(),
                "1000000".to_string(),
            )])),
            max_payload_bytes: Some(900_000),
            ..Settings::default()
        };
        assert!(Config::resolve(s).is_ok());
    }

    #[test]
    fn byte_budgets_have_defaults_and_bounds() {
        let c = Config::resolve(Settings::default()).unwrap();
        assert_eq!(c.max_batch_bytes, 64 * 1024 * 1024);
        assert_eq!(c.relay.max_bytes, 64 * 1024 * 1024);
        assert_eq!(c.intake.queue_bytes, 256 * 1024 * 1024);
        assert!(enqueue_request_bytes(&c.limits) < 2 * 1024 * 1024);
        let e = Config::resolve(Settings {
            max_batch_bytes: Some(1000),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("MAILROOM_MAX_BATCH_BYTES"), "{e}");
        let e = Config::resolve(Settings {
            intake_queue_bytes: Some(1024 * 1024),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("MAILROOM_INTAKE_QUEUE_BYTES"), "{e}");
        let e = Config::resolve(Settings {
            relay_max_bytes: Some(0),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("MAILROOM_RELAY_MAX_BYTES"), "{e}");
    }

    #[test]
    fn kafka_properties_parse() {
        let p = parse_properties("security.protocol=SASL_SSL, sasl.mechanism=PLAIN").unwrap();
        assert_eq!(p["security.protocol"], "SASL_SSL");
        assert!(parse_properties("oops").is_err());
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact_url("sqlite://x.db"), "sqlite://x.db");
        // Every form a password can take in a URL.
        assert_eq!(
            redact_url("postgres://u:p%40ss@h/db?password=hunter2&sslmode=verify-full"),
            "postgres://u:***@h/db?password=***&sslmode=verify-full"
        );
        assert_eq!(
            redact_url("postgresql://h/db?user=u&PASSWORD=x&sslpassword=y&sslkey=/k.pem"),
            "postgresql://h/db?user=u&PASSWORD=***&sslpassword=***&sslkey=***"
        );
        assert_eq!(redact_url("postgres://u:a@b@h/db"), "postgres://u:***@h/db");
    }

    #[test]
    fn a_malformed_config_file_is_reported_without_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("mailroom.toml");
        for text in [
            "database_url = \"postgres://u:hunter2-secret@h/db\"\nrelays = \"two\"\n",
            "database_url = \"postgres://u:hunter2-secret@h/db\n",
            "database_url = postgres://u:hunter2-secret@h/db\n",
            "admin_token = 1234hunter2-secret\n",
        ] {
            std::fs::write(&p, text).unwrap();
            let e = Config::load(Settings {
                config: Some(p.clone()),
                ..Default::default()
            })
            .unwrap_err()
            .to_string();
            assert!(!e.contains("hunter2"), "{e}");
            assert!(e.contains("line "), "{e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
        std::fs::write(&p, "no_such_setting = 1\n").unwrap();
        let e = Config::load(Settings {
            config: Some(p.clone()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("no_such_setting"), "{e}");
    }

    #[test]
    fn closed_by_default_on_the_network() {
        // Non-loopback, no token: one line naming the setting and the way out.
        let e = Config::resolve(Settings {
            listen: Some("0.0.0.0:50051".into()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("MAILROOM_LISTEN"), "{e}");
        assert!(e.contains("--allow-unauthenticated"), "{e}");
        assert_eq!(e.lines().count(), 1);
        // The legacy admin token alone leaves Enqueue open: still refused.
        assert!(
            Config::resolve(Settings {
                listen: Some("0.0.0.0:50051".into()),
                admin_token: Some("a-long-enough-admin-token".into()),
                ..Default::default()
            })
            .is_err()
        );
        let c = Config::resolve(Settings {
            listen: Some("0.0.0.0:50051".into()),
            allow_unauthenticated: Some(true),
            ..Default::default()
        })
        .unwrap();
        assert!(c.open_on_network);
        let c = Config::resolve(Settings {
            listen: Some("127.0.0.1:50051".into()),
            ..Default::default()
        })
        .unwrap();
        assert!(!c.open_on_network);
        let e = Config::resolve(Settings {
            admin_token: Some("short".into()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("MAILROOM_ADMIN_TOKEN") && e.contains("shorter"),
            "{e}"
        );
        assert!(!e.contains("short\""), "{e}");
    }
}

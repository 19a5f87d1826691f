//! Settings → `Config`: defaults applied and every rule checked, one section at a time.
//! The first broken rule is the error, naming its setting.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::enqueue_request_bytes;
use super::{Config, ConfigError, DatabaseTimeouts, Settings, SubscriptionSettings, bad};
use crate::access::{MIN_TOKEN_LEN, TokenEntry, has_certificate_entries, load_tokens};
use crate::api::connections::ConnectionLimits;
use crate::api::layers::OverloadConfig;
use crate::domain::Limits;
use crate::inbox::SubscriptionConfig;
use crate::intake::IntakeConfig;
use crate::relay::RelayConfig;
use crate::relay::backoff::RetryPolicy;
use crate::retention::RetentionConfig;
use crate::secret::Secret;
use crate::sink::SinkConfig;
use crate::store::postgres::profile::SessionProfile;
use crate::telemetry::LogFormat;
use crate::tls::{ClientTls, ServerTls};

impl Config {
    /// Applies defaults and validates.
    pub fn resolve(mut s: Settings) -> Result<Config, ConfigError> {
        secrets_from_files(&mut s)?;
        let listen = listen(&s)?;
        let database_url = database_url(&s)?;
        let is_pg = database_url.starts_with("postgres");
        let (sink, message_timeout) = sink(&s);
        let retry = retry(&s)?;
        let relay = relay(&s, retry, &sink, message_timeout, is_pg)?;
        let limits = limits(&s, retry, &sink)?;
        let (max_batch_bytes, intake) = intake(&s, &limits, is_pg)?;
        let metrics_listen = address(
            "metrics_listen (MAILROOM_METRICS_LISTEN)",
            s.metrics_listen.as_deref(),
        )?;
        let console_listen = address(
            "console_listen (MAILROOM_CONSOLE_LISTEN)",
            s.console_listen.as_deref(),
        )?;
        let tls = server_tls(&s)?;
        let access = access(&s, listen, console_listen, tls.as_ref())?;
        let relays = s.relays.unwrap_or(2);
        if relays > 64 {
            return Err(bad("relays (MAILROOM_RELAYS)", "must be at most 64"));
        }
        let subscriptions = subscriptions(&s, retry)?;
        Ok(Config {
            listen,
            database_max_connections: s.database_max_connections.unwrap_or(16).max(2),
            migrate: s.migrate.unwrap_or(true),
            log_format: log_format(s.log_format.as_deref())?,
            source: s.source.clone().filter(|x| !x.is_empty()),
            relays,
            relay,
            kafka_topic_limits_refresh: Duration::from_millis(
                s.kafka_topic_limits_refresh_ms.unwrap_or(60_000).max(100),
            ),
            listen_notify: s.listen_notify.unwrap_or(true),
            limits,
            inbox_max_payload_bytes: s
                .max_payload_bytes
                .unwrap_or(crate::sink::kafka::topic_limits::KAFKA_DEFAULT_MAX_MESSAGE_BYTES),
            max_batch_bytes,
            intake,
            shutdown_grace: Duration::from_millis(s.shutdown_grace_ms.unwrap_or(30_000)),
            health_interval: Duration::from_millis(s.health_interval_ms.unwrap_or(1000).max(50)),
            ready_max_broker_down: s.ready_max_broker_down_ms.map(Duration::from_millis),
            ready_max_lag: s.ready_max_lag_ms.map(Duration::from_millis),
            otlp_endpoint: s.otlp_endpoint.clone().filter(|e| !e.is_empty()),
            faults: faults(&s)?,
            inbox_faults: crate::inbox::consumer::ConsumerFaults {
                record_panic: s.fault_record_panic.clone().filter(|m| !m.is_empty()),
                task_panic: s.fault_task_panic.clone().filter(|m| !m.is_empty()),
            },
            open_on_network: !listen.ip().is_loopback() && !access.authenticated,
            admin_token: access.admin_token.map(crate::secret::Secret),
            tokens: access.tokens,
            dead_letter: dead_letter(&s, &subscriptions)?,
            subscriptions,
            metrics_listen,
            console_listen,
            console_read_only: s.console_read_only.unwrap_or(false),
            console_secure_cookie: s.console_secure_cookie.unwrap_or(false),
            console_allowed_hosts: allowed_hosts(s.console_allowed_hosts.as_deref()),
            metrics_allowed_hosts: allowed_hosts(s.metrics_allowed_hosts.as_deref()),
            metrics_stats_interval: Duration::from_millis(
                s.metrics_stats_interval_ms.unwrap_or(15_000).max(100),
            ),
            tls,
            overload: overload(&s, max_batch_bytes)?,
            database_acquire_timeout: Duration::from_millis(
                s.database_acquire_timeout_ms.unwrap_or(3000).max(10),
            ),
            database_timeouts: database_timeouts(&s),
            connections: connections(&s)?,
            database_profile: database_profile(&s)?,
            database_refuse_shared_schema: s.database_refuse_shared_schema.unwrap_or(false),
            migration: migration(&s),
            retention: retention(&s)?,
            jobs: jobs(&s)?,
            sink,
            database_url: crate::secret::Secret(database_url),
        })
    }
}

/// The gRPC address: `host:port` with an IP host.
fn listen(s: &Settings) -> Result<SocketAddr, ConfigError> {
    let listen = s.listen.as_deref().unwrap_or("127.0.0.1:50051");
    listen.parse().map_err(|_| {
        bad(
            "listen (MAILROOM_LISTEN)",
            format!("{listen:?} is not host:port with an IP host"),
        )
    })
}

/// The Host names a web server (console, metrics) answers besides its own, lower-cased.
fn allowed_hosts(given: Option<&[String]>) -> Vec<String> {
    given
        .unwrap_or_default()
        .iter()
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
        .collect()
}

/// The gRPC server's admission limits.
fn overload(s: &Settings, max_batch_bytes: usize) -> Result<OverloadConfig, ConfigError> {
    Ok(OverloadConfig {
        max_concurrent_rpcs: s.max_concurrent_rpcs.unwrap_or(1024),
        rpc_timeout: Some(Duration::from_millis(s.rpc_timeout_ms.unwrap_or(30_000)))
            .filter(|d| !d.is_zero()),
        max_request_bytes: request_bytes_in_flight(s, max_batch_bytes)?,
        body_timeout: Some(Duration::from_millis(
            s.request_body_timeout_ms.unwrap_or(10_000),
        ))
        .filter(|d| !d.is_zero()),
        principal_share_percent: match s.principal_share_percent.unwrap_or(50) {
            p @ 1..=100 => p,
            _ => {
                return Err(bad(
                    "principal_share_percent (MAILROOM_PRINCIPAL_SHARE_PERCENT)",
                    "must be 1..=100",
                ));
            }
        },
    })
}

/// An optional `host:port` with an IP host; blank is unset.
fn address(setting: &'static str, value: Option<&str>) -> Result<Option<SocketAddr>, ConfigError> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some(a) => a
            .parse::<SocketAddr>()
            .map(Some)
            .map_err(|_| bad(setting, format!("{a:?} is not host:port with an IP host"))),
    }
}

/// Reads the `*_FILE` forms of the settings that hold secrets (issue 25, item 5), so
/// that manifests mount them from a secret instead of putting them in the environment
/// (`ps e`, `kubectl describe`) or on the command line (`ps`). A file holds the value
/// alone (one trailing newline is dropped); Kafka's holds `key=value` lines (`#`
/// comments), added to `MAILROOM_KAFKA_PROPERTIES`. A value given both ways is refused.
fn secrets_from_files(s: &mut Settings) -> Result<(), ConfigError> {
    fn read(path: &PathBuf, setting: &'static str) -> Result<String, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad(setting, format!("cannot read {}: {e}", path.display())))?;
        let value = text.strip_suffix('\n').unwrap_or(&text);
        let value = value.strip_suffix('\r').unwrap_or(value);
        if value.is_empty() {
            return Err(bad(setting, format!("{} is empty", path.display())));
        }
        Ok(value.to_string())
    }
    fn both(setting: &'static str) -> ConfigError {
        bad(setting, "given both as a value and as a file: set one")
    }
    if let Some(p) = &s.database_url_file {
        const SETTING: &str = "database_url_file (MAILROOM_DATABASE_URL_FILE)";
        if s.database_url.is_some() {
            return Err(both(SETTING));
        }
        s.database_url = Some(read(p, SETTING)?);
    }
    if let Some(p) = &s.admin_token_file {
        const SETTING: &str = "admin_token_file (MAILROOM_ADMIN_TOKEN_FILE)";
        if s.admin_token.is_some() {
            return Err(both(SETTING));
        }
        s.admin_token = Some(read(p, SETTING)?);
    }
    if let Some(p) = &s.kafka_properties_file {
        const SETTING: &str = "kafka_properties_file (MAILROOM_KAFKA_PROPERTIES_FILE)";
        // May be empty: no extra properties.
        let text = std::fs::read_to_string(p)
            .map_err(|e| bad(SETTING, format!("cannot read {}: {e}", p.display())))?;
        let mut props = s.kafka_properties.clone().unwrap_or_default();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            // The line is not echoed: it may hold the secret.
            let (k, v) = line
                .split_once('=')
                .ok_or_else(|| bad(SETTING, "a line is not key=value"))?;
            if props
                .insert(k.trim().to_string(), v.trim().to_string())
                .is_some()
            {
                return Err(bad(
                    SETTING,
                    format!("{:?} is also in MAILROOM_KAFKA_PROPERTIES", k.trim()),
                ));
            }
        }
        s.kafka_properties = Some(props);
    }
    Ok(())
}

fn database_url(s: &Settings) -> Result<String, ConfigError> {
    let url = s
        .database_url
        .clone()
        .unwrap_or_else(|| "sqlite://mailroom.db".into());
    let is_pg = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if !is_pg && !url.starts_with("sqlite:") {
        return Err(bad(
            "database_url (MAILROOM_DATABASE_URL)",
            "must start with sqlite: or postgres://",
        ));
    }
    Ok(url)
}

fn log_format(value: Option<&str>) -> Result<LogFormat, ConfigError> {
    match value.unwrap_or("human") {
        "human" => Ok(LogFormat::Human),
        "json" => Ok(LogFormat::Json),
        other => Err(bad(
            "log_format (MAILROOM_LOG_FORMAT)",
            format!("{other:?} is not human or json"),
        )),
    }
}

/// Kafka when brokers are set, else the local sink; and Kafka's delivery timeout.
fn sink(s: &Settings) -> (SinkConfig, Duration) {
    let message_timeout = Duration::from_millis(s.kafka_message_timeout_ms.unwrap_or(15_000));
    let sink = match s.kafka_brokers.clone().filter(|b| !b.trim().is_empty()) {
        Some(brokers) => SinkConfig::Kafka {
            brokers,
            properties: s.kafka_properties.clone().unwrap_or_default(),
            message_timeout,
        },
        None => SinkConfig::Local {
            path: match s.local_sink.as_deref().unwrap_or("stdout") {
                "stdout" | "-" => None,
                p => Some(PathBuf::from(p)),
            },
        },
    };
    (sink, message_timeout)
}

fn retry(s: &Settings) -> Result<RetryPolicy, ConfigError> {
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
    Ok(retry)
}

fn relay(
    s: &Settings,
    retry: RetryPolicy,
    sink: &SinkConfig,
    message_timeout: Duration,
    is_pg: bool,
) -> Result<RelayConfig, ConfigError> {
    // PostgreSQL: 5,000 events a cycle. A key's run boundary (last acknowledgement,
    // settle, next claim) costs about the same whatever the run, so longer runs drain
    // about 1.5x faster from outside with defaults (docs/benchmarks.md); the bytes a
    // cycle reads stay bounded by `relay_max_bytes`. SQLite keeps 1,000: its one writer
    // would hold enqueues back for a longer claim and settle.
    let events = if is_pg { 5000 } else { 1000 };
    let relay = RelayConfig {
        batch_size: s.relay_batch_size.unwrap_or(events),
        max_keys: s.relay_max_keys.unwrap_or(250).max(1),
        max_run: s.relay_max_run.unwrap_or(events),
        max_bytes: s.relay_max_bytes.unwrap_or(64 * 1024 * 1024),
        lease: Duration::from_millis(s.relay_lease_ms.unwrap_or(60_000)),
        poll_interval: Duration::from_millis(s.relay_poll_ms.unwrap_or(250)),
        claim_spacing: Duration::from_millis(s.relay_claim_spacing_ms.unwrap_or(25)),
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
    if relay.claim_spacing > Duration::from_secs(1) {
        return Err(bad(
            "relay_claim_spacing_ms (MAILROOM_RELAY_CLAIM_SPACING_MS)",
            "must be 0..=1000",
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
    Ok(relay)
}

/// The default payload limit: what stock Kafka's record batch (`message.max.bytes`,
/// 1,048,588 bytes) leaves after the largest headers and `RECORD_OVERHEAD_BYTES` (key,
/// CloudEvents attributes, trace context and framing), so the largest event mailroom
/// accepts by default can be published to a default cluster. `None`: no room left.
pub(super) fn default_max_payload(max_header_bytes: usize) -> Option<usize> {
    use crate::sink::kafka::{
        RECORD_OVERHEAD_BYTES, topic_limits::KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
    };
    KAFKA_DEFAULT_MAX_MESSAGE_BYTES
        .checked_sub(max_header_bytes + RECORD_OVERHEAD_BYTES)
        .filter(|&n| n > 0)
}

fn limits(s: &Settings, retry: RetryPolicy, sink: &SinkConfig) -> Result<Limits, ConfigError> {
    let max_header_bytes = s.max_header_bytes.unwrap_or(16 * 1024);
    let max_payload_bytes = match s.max_payload_bytes {
        Some(n) => n,
        None => default_max_payload(max_header_bytes).ok_or_else(|| {
            bad(
                "max_header_bytes (MAILROOM_MAX_HEADER_BYTES)",
                "leaves no room for a payload in stock Kafka's 1048588-byte record; set \
                 max_payload_bytes (MAILROOM_MAX_PAYLOAD_BYTES) too",
            )
        })?,
    };
    let limits = Limits {
        max_payload_bytes,
        max_headers: s.max_headers.unwrap_or(64),
        max_header_bytes,
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
    if let SinkConfig::Kafka { properties, .. } = sink
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
    Ok(limits)
}

/// The budget of request bytes in flight: one largest batch must fit (0 turns it off).
fn request_bytes_in_flight(s: &Settings, max_batch_bytes: usize) -> Result<usize, ConfigError> {
    let bytes = s
        .max_request_bytes_in_flight
        .unwrap_or(max_batch_bytes.saturating_mul(2));
    if bytes != 0 && (bytes < max_batch_bytes || bytes > u32::MAX as usize) {
        return Err(bad(
            "max_request_bytes_in_flight (MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT)",
            format!("must be 0 (no limit) or {max_batch_bytes}..=4294967295 (one batch must fit)"),
        ));
    }
    Ok(bytes)
}

/// The largest `EnqueueBatch` request, and the group commit in front of the database.
fn intake(
    s: &Settings,
    limits: &Limits,
    is_pg: bool,
) -> Result<(usize, IntakeConfig), ConfigError> {
    let max_batch_bytes = s.max_batch_bytes.unwrap_or(64 * 1024 * 1024);
    // One event must fit in a batch: its payload, headers and the encoding's slack.
    let min_batch_bytes = enqueue_request_bytes(limits);
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
    let overlap_ms = s.intake_overlap_ms.unwrap_or(20);
    if overlap_ms > 1000 {
        return Err(bad(
            "intake_overlap_ms (MAILROOM_INTAKE_OVERLAP_MS)",
            "must be 0..=1000",
        ));
    }
    let intake = IntakeConfig {
        queue_bytes,
        queue_depth: s.intake_queue.unwrap_or(10_000).max(1),
        writers: s.intake_writers.unwrap_or(if is_pg { 4 } else { 1 }).max(1),
        overlap_after: Duration::from_millis(overlap_ms),
        max_group: limits.max_batch.max(1000),
        ..IntakeConfig::default()
    };
    Ok((max_batch_bytes, intake))
}

fn server_tls(s: &Settings) -> Result<Option<ServerTls>, ConfigError> {
    match (s.tls_cert.clone(), s.tls_key.clone()) {
        (None, None) => {
            if s.tls_client_ca.is_some() {
                return Err(bad(
                    "tls_client_ca (MAILROOM_TLS_CLIENT_CA)",
                    "needs tls_cert and tls_key",
                ));
            }
            Ok(None)
        }
        (Some(cert), Some(key)) => Ok(Some(ServerTls {
            cert,
            key,
            client_ca: s.tls_client_ca.clone(),
        })),
        _ => Err(bad(
            "tls_cert/tls_key (MAILROOM_TLS_CERT, MAILROOM_TLS_KEY)",
            "set both or neither",
        )),
    }
}

/// Who may call: the token file, the legacy admin token, and whether every caller is
/// authenticated.
struct Access {
    tokens: Vec<TokenEntry>,
    admin_token: Option<String>,
    authenticated: bool,
}

fn access(
    s: &Settings,
    listen: SocketAddr,
    console_listen: Option<SocketAddr>,
    tls: Option<&ServerTls>,
) -> Result<Access, ConfigError> {
    let tokens = match &s.tokens_file {
        None => Vec::new(),
        Some(path) => {
            load_tokens(path).map_err(|why| bad("tokens_file (MAILROOM_TOKENS_FILE)", why))?
        }
    };
    let admin_token = s.admin_token.clone().filter(|t| !t.is_empty());
    if let Some(t) = &admin_token {
        // The token file's rules: a minimum length, and no secret shared with a file token.
        if t.len() < MIN_TOKEN_LEN {
            return Err(bad(
                "admin_token (MAILROOM_ADMIN_TOKEN)",
                format!("is shorter than {MIN_TOKEN_LEN} characters"),
            ));
        }
        if tokens.iter().any(|e| e.token == *t) {
            return Err(bad(
                "admin_token (MAILROOM_ADMIN_TOKEN)",
                "has the same secret as a token of tokens_file",
            ));
        }
    }
    let mtls = tls.is_some_and(|t| t.client_ca.is_some());
    if mtls && s.tokens_file.is_none() {
        // Before issue 43 this meant "every certificate may enqueue and push anywhere";
        // now a certificate alone may do nothing, so say how to get either back.
        return Err(bad(
            "tls_client_ca (MAILROOM_TLS_CLIENT_CA)",
            "needs tokens_file (MAILROOM_TOKENS_FILE): a client certificate may do only what \
             an entry with its name (certificate = \"<name>\") allows; an entry with \
             certificate = \"*\" and scopes = [\"enqueue\", \"inbox\"] lets every \
             certificate of the CA enqueue and push as before",
        ));
    }
    if !mtls && has_certificate_entries(&tokens) {
        return Err(bad(
            "tokens_file (MAILROOM_TOKENS_FILE)",
            "has certificate entries, which need tls_client_ca (MAILROOM_TLS_CLIENT_CA)",
        ));
    }
    let allow_unauthenticated = s.allow_unauthenticated.unwrap_or(false);
    // Closed by default: every caller is authenticated by a token file or a client
    // certificate (mTLS), or the port is reachable from this host only. The legacy
    // admin token alone leaves Enqueue and the inbox open, so it does not count.
    let authenticated = !tokens.is_empty() || mtls;
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
    Ok(Access {
        tokens,
        admin_token,
        authenticated,
    })
}

fn dead_letter(
    s: &Settings,
    subs: &[SubscriptionConfig],
) -> Result<crate::dead_letter::DeadLetterConfig, ConfigError> {
    use crate::dead_letter::{DeadLetterConfig, TopicChoice};
    const SETTING: &str = "dead_letter_topics (MAILROOM_DEAD_LETTER_TOPICS)";
    let suffix = s
        .dead_letter_suffix
        .clone()
        .unwrap_or_else(|| ".dlq".into());
    if suffix.is_empty() || crate::domain::check_topic(&format!("t{suffix}")).is_err() {
        return Err(bad(
            "dead_letter_suffix (MAILROOM_DEAD_LETTER_SUFFIX)",
            "must be non-empty and made of [a-zA-Z0-9._-]",
        ));
    }
    let listed: Vec<String> = s
        .dead_letter_topics
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    let topics = if listed.iter().any(|t| t == "*") {
        TopicChoice::All
    } else if listed.is_empty() {
        TopicChoice::None
    } else {
        for t in &listed {
            crate::domain::check_topic(&format!("{t}{suffix}"))
                .map_err(|why| bad(SETTING, format!("{t:?}: its dead-letter topic {why}")))?;
        }
        TopicChoice::Some(listed.into_iter().collect())
    };
    Ok(DeadLetterConfig {
        topics,
        suffix,
        subscriptions: subs
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.dead_letter_topic.clone()?)))
            .collect(),
        interval: Duration::from_secs(1),
    })
}

fn retention(s: &Settings) -> Result<RetentionConfig, ConfigError> {
    let hours = |h: u64| (h > 0).then(|| Duration::from_secs(h.saturating_mul(3600)));
    let retention = RetentionConfig {
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
    Ok(retention)
}

/// Fault injection at the sink (testing only): (counted rate, transient rate).
fn faults(s: &Settings) -> Result<(f64, f64), ConfigError> {
    let f = (
        s.fault_counted_rate.unwrap_or(0.0),
        s.fault_transient_rate.unwrap_or(0.0),
    );
    if !(0.0..=1.0).contains(&f.0) || !(0.0..=1.0).contains(&f.1) {
        return Err(bad("fault_*_rate", "must be within 0..=1"));
    }
    Ok(f)
}

/// The gRPC port's connection limits.
fn connections(s: &Settings) -> Result<ConnectionLimits, ConfigError> {
    let d = ConnectionLimits::default();
    let limits = ConnectionLimits {
        max_connections: s.max_connections.unwrap_or(d.max_connections),
        handshake_timeout: s
            .handshake_timeout_ms
            .map_or(d.handshake_timeout, Duration::from_millis),
        max_concurrent_streams: s.max_concurrent_streams.unwrap_or(d.max_concurrent_streams),
    };
    if limits.max_connections == 0 {
        return Err(bad(
            "max_connections (MAILROOM_MAX_CONNECTIONS)",
            "must be at least 1",
        ));
    }
    if limits.handshake_timeout.is_zero() {
        return Err(bad(
            "handshake_timeout_ms (MAILROOM_HANDSHAKE_TIMEOUT_MS)",
            "must be at least 1",
        ));
    }
    if limits.max_concurrent_streams == 0 {
        return Err(bad(
            "max_concurrent_streams (MAILROOM_MAX_CONCURRENT_STREAMS)",
            "must be at least 1",
        ));
    }
    Ok(limits)
}

/// The service sessions' profile. The schema is any PostgreSQL name except the SQL
/// API's own schema `mailroom` (whose USAGE producers hold) and the system schemas.
fn database_profile(s: &Settings) -> Result<SessionProfile, ConfigError> {
    use crate::store::postgres::profile::{
        self, DEFAULT_IDLE_IN_TRANSACTION, DEFAULT_LOCK_TIMEOUT,
    };
    let schema = s
        .database_schema
        .clone()
        .unwrap_or_else(|| profile::DEFAULT_SCHEMA.to_string());
    const SETTING: &str = "database_schema (MAILROOM_DATABASE_SCHEMA)";
    if schema.is_empty() || schema.len() > 63 || schema.contains('\0') {
        return Err(bad(SETTING, "must be a PostgreSQL name of 1 to 63 bytes"));
    }
    if schema == "mailroom" || schema.starts_with("pg_") || schema == "information_schema" {
        return Err(bad(
            SETTING,
            "must not be `mailroom` (the SQL API's schema), `information_schema` or start with `pg_`",
        ));
    }
    let ms = |v: Option<u64>, default: Duration| {
        v.map_or(Some(default), |ms| Some(Duration::from_millis(ms)))
            .filter(|d| !d.is_zero())
    };
    let mut p = SessionProfile::service(&schema);
    p.lock_timeout = ms(s.database_lock_timeout_ms, DEFAULT_LOCK_TIMEOUT);
    p.idle_in_transaction = ms(
        s.database_idle_in_transaction_timeout_ms,
        DEFAULT_IDLE_IN_TRANSACTION,
    );
    Ok(p)
}

/// A query class's own statement timeout, else the general one, else the class default.
fn database_timeouts(s: &Settings) -> DatabaseTimeouts {
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
}

/// The migrator's lock wait: a short `lock_timeout` (at least 10 ms), retried within
/// the whole wait (at least one try's worth).
fn migration(s: &Settings) -> crate::store::postgres::migrate::MigrationWait {
    let d = crate::store::postgres::migrate::MigrationWait::default();
    let lock_timeout = s
        .migration_lock_timeout_ms
        .map_or(d.lock_timeout, |ms| Duration::from_millis(ms.max(10)));
    crate::store::postgres::migrate::MigrationWait {
        lock_timeout,
        max_wait: s
            .migration_max_wait_ms
            .map_or(d.max_wait, Duration::from_millis)
            .max(lock_timeout),
        ..d
    }
}

fn subscriptions(
    s: &Settings,
    outbox: RetryPolicy,
) -> Result<Vec<SubscriptionConfig>, ConfigError> {
    let subs = s
        .subscriptions
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|sub| subscription(sub, outbox))
        .collect::<Result<Vec<_>, _>>()?;
    let mut names = HashSet::new();
    if let Some(dup) = subs.iter().find(|s| !names.insert(s.name.as_str())) {
        return Err(bad(
            "subscriptions",
            format!("name {:?} appears twice", dup.name),
        ));
    }
    Ok(subs)
}

fn subscription(
    s: SubscriptionSettings,
    outbox: RetryPolicy,
) -> Result<SubscriptionConfig, ConfigError> {
    check_subscription_name(&s.name)?;
    for t in &s.topics {
        crate::domain::check_topic(t)
            .map_err(|why| bad(SUBSCRIPTIONS, format!("{}: topic {t:?} {why}", s.name)))?;
    }
    check_handler(&s)?;
    let retry = subscription_retry(&s, outbox)?;
    let concurrency = s.concurrency.unwrap_or(8);
    if concurrency == 0 || concurrency > 1024 {
        return Err(bad(
            SUBSCRIPTIONS,
            format!("{}: concurrency must be 1..=1024", s.name),
        ));
    }
    if s.handler_cert.is_some() != s.handler_key.is_some() {
        return Err(bad(
            SUBSCRIPTIONS,
            format!("{}: set handler_cert and handler_key together", s.name),
        ));
    }
    let handler_token = handler_token(&s)?;
    if let Some(t) = &s.dead_letter_topic {
        crate::domain::check_topic(t).map_err(|why| {
            bad(
                SUBSCRIPTIONS,
                format!("{}: dead_letter_topic {t:?} {why}", s.name),
            )
        })?;
    }
    Ok(SubscriptionConfig {
        dead_letter_topic: s.dead_letter_topic,
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

/// The setting subscription errors name.
const SUBSCRIPTIONS: &str = "subscriptions";

fn check_subscription_name(name: &str) -> Result<(), ConfigError> {
    let name_ok = !name.is_empty()
        && name.len() <= 100
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if name_ok {
        Ok(())
    } else {
        Err(bad(
            SUBSCRIPTIONS,
            format!("name {name:?} must be 1-100 characters of [a-zA-Z0-9._-]"),
        ))
    }
}

/// The handler's URL: http(s).
fn check_handler(s: &SubscriptionSettings) -> Result<(), ConfigError> {
    if !(s.handler.starts_with("http://") || s.handler.starts_with("https://"))
        || s.handler.parse::<tonic::codegen::http::Uri>().is_err()
    {
        return Err(bad(
            SUBSCRIPTIONS,
            format!("{}: handler {:?} is not an http(s) URL", s.name, s.handler),
        ));
    }
    Ok(())
}

/// The subscription's retry policy: the outbox's, with its own overrides.
fn subscription_retry(
    s: &SubscriptionSettings,
    outbox: RetryPolicy,
) -> Result<RetryPolicy, ConfigError> {
    let retry = RetryPolicy {
        base: s.retry_base_ms.map_or(outbox.base, Duration::from_millis),
        cap: s.retry_cap_ms.map_or(outbox.cap, Duration::from_millis),
        max_attempts: s.max_attempts.unwrap_or(outbox.max_attempts),
    };
    if retry.max_attempts == 0 || retry.max_attempts > 100 || retry.cap < retry.base {
        return Err(bad(
            SUBSCRIPTIONS,
            format!(
                "{}: max_attempts must be 1..=100 and retry_cap_ms >= retry_base_ms",
                s.name
            ),
        ));
    }
    Ok(retry)
}

/// The token sent to the handler: inline or the first line of a file, printable ASCII.
fn handler_token(s: &SubscriptionSettings) -> Result<Option<String>, ConfigError> {
    let handler_token = match (&s.handler_token, &s.handler_token_file) {
        (Some(_), Some(_)) => {
            return Err(bad(
                SUBSCRIPTIONS,
                format!(
                    "{}: set handler_token or handler_token_file, not both",
                    s.name
                ),
            ));
        }
        (Some(t), None) => Some(t.clone()),
        (None, Some(p)) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| {
                    bad(
                        SUBSCRIPTIONS,
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
            SUBSCRIPTIONS,
            format!(
                "{}: the handler token must be printable ASCII without spaces",
                s.name
            ),
        ));
    }
    Ok(handler_token)
}

fn jobs(s: &Settings) -> Result<crate::jobs::JobSettings, ConfigError> {
    let d = crate::jobs::JobSettings::default();
    let lease = s.job_lease_ms.map_or(d.lease, Duration::from_millis);
    if lease < Duration::from_secs(1) {
        return Err(bad(
            "job_lease_ms (MAILROOM_JOB_LEASE_MS)",
            "must be at least 1000: a page must be recorded within one lease",
        ));
    }
    Ok(crate::jobs::JobSettings {
        lease,
        page_pause: s
            .job_page_pause_ms
            .map_or(d.page_pause, Duration::from_millis),
        ..d
    })
}

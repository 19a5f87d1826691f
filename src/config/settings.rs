//! The settings as given: every field optional, from the command line and the
//! environment (clap) or from the TOML file (serde), merged field by field.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Args;
use serde::Deserialize;

/// Settings as given on the command line or in the environment. Every field is optional
/// so that the file and the defaults can fill the gaps.
#[derive(Clone, Default, Args, Deserialize)]
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
    /// A file holding the database URL (a mounted secret), instead of
    /// MAILROOM_DATABASE_URL.
    #[arg(long, env = "MAILROOM_DATABASE_URL_FILE", global = true)]
    pub database_url_file: Option<PathBuf>,
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
    /// A file of extra librdkafka properties, `key=value` per line (`sasl.password`,
    /// …), added to MAILROOM_KAFKA_PROPERTIES.
    #[arg(long, env = "MAILROOM_KAFKA_PROPERTIES_FILE", global = true)]
    pub kafka_properties_file: Option<PathBuf>,
    /// Kafka delivery timeout in ms; a delivery not acknowledged by then is a transient
    /// failure [default: 15000].
    #[arg(long, env = "MAILROOM_KAFKA_MESSAGE_TIMEOUT_MS", global = true)]
    pub kafka_message_timeout_ms: Option<u64>,
    /// How often each topic's `max.message.bytes` is read again from the cluster, in ms
    /// [default: 60000].
    #[arg(long, env = "MAILROOM_KAFKA_TOPIC_LIMITS_REFRESH_MS", global = true)]
    pub kafka_topic_limits_refresh_ms: Option<u64>,
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
    /// Keys leased per relay cycle at most; fewer when lines are deep [default: 250].
    #[arg(long, env = "MAILROOM_RELAY_MAX_KEYS", global = true)]
    pub relay_max_keys: Option<u32>,
    /// Bytes (payload and headers) read per relay cycle, keyed and unkeyed each; at least
    /// one event [default: 67108864].
    #[arg(long, env = "MAILROOM_RELAY_MAX_BYTES", global = true)]
    pub relay_max_bytes: Option<u64>,
    /// Longest run of one key per cycle [default: 1000].
    #[arg(long, env = "MAILROOM_RELAY_MAX_RUN", global = true)]
    pub relay_max_run: Option<u32>,
    /// Claim lease in ms; must exceed the Kafka message timeout [default: 60000].
    #[arg(long, env = "MAILROOM_RELAY_LEASE_MS", global = true)]
    pub relay_lease_ms: Option<u64>,
    /// Fallback poll interval in ms [default: 250].
    #[arg(long, env = "MAILROOM_RELAY_POLL_MS", global = true)]
    pub relay_poll_ms: Option<u64>,
    /// After a claim that took all there was, an outbox relay's next claim waits this
    /// many ms from its start (0: none) [default: 25].
    #[arg(long, env = "MAILROOM_RELAY_CLAIM_SPACING_MS", global = true)]
    pub relay_claim_spacing_ms: Option<u64>,
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
    /// Largest payload in bytes [default: 1015820, so that the largest event fits stock
    /// Kafka's 1048588-byte record batch: 1048588 - max_header_bytes - 16384].
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
    /// An enqueue transaction starts while the previous one is still running only once
    /// that one has run this long, in ms; 0 starts one whenever a writer is free
    /// [default: 20].
    #[arg(long, env = "MAILROOM_INTAKE_OVERLAP_MS", global = true)]
    pub intake_overlap_ms: Option<u64>,
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
    /// Testing only: an inbox record whose value contains this text panics while it is
    /// read (it is stored as failed) [default: unset].
    #[arg(long, env = "MAILROOM_FAULT_RECORD_PANIC", global = true, hide = true)]
    pub fault_record_panic: Option<String>,
    /// Testing only: an inbox record whose value contains this text kills its consumer
    /// task, at most 3 times per process [default: unset].
    #[arg(long, env = "MAILROOM_FAULT_TASK_PANIC", global = true, hide = true)]
    pub fault_task_panic: Option<String>,
    /// Bearer token the AdminService requires (`authorization: Bearer <token>`). Unset:
    /// no token, and the admin RPCs are open to whoever reaches the listen address.
    #[arg(
        long,
        env = "MAILROOM_ADMIN_TOKEN",
        global = true,
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// A file holding the legacy admin token, instead of MAILROOM_ADMIN_TOKEN.
    #[arg(long, env = "MAILROOM_ADMIN_TOKEN_FILE", global = true)]
    pub admin_token_file: Option<PathBuf>,
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
    /// Host names (`name` or `name:port`) `/metrics` answers to besides its own address,
    /// localhost and IP addresses, comma-separated: the names scrapers use. Any other
    /// `Host` is refused (421), which stops DNS rebinding.
    #[arg(
        long,
        env = "MAILROOM_METRICS_ALLOWED_HOSTS",
        global = true,
        value_delimiter = ','
    )]
    pub metrics_allowed_hosts: Option<Vec<String>>,
    /// Operator console address (HTTP, browser UI behind the admin tokens); unset or
    /// empty: no console [default: off].
    #[arg(long, env = "MAILROOM_CONSOLE_LISTEN", global = true)]
    pub console_listen: Option<String>,
    /// The console shows but never acts (no requeue, no cancel) [default: false].
    #[arg(long, env = "MAILROOM_CONSOLE_READ_ONLY", global = true)]
    pub console_read_only: Option<bool>,
    /// Host names (`name` or `name:port`) the console answers to besides its own
    /// address and localhost, comma-separated: the names a reverse proxy forwards with.
    /// Any other `Host` is refused (421), which stops DNS rebinding.
    #[arg(
        long,
        env = "MAILROOM_CONSOLE_ALLOWED_HOSTS",
        global = true,
        value_delimiter = ','
    )]
    pub console_allowed_hosts: Option<Vec<String>>,
    /// Browsers reach the console over TLS (a TLS-terminating proxy in front): the
    /// session cookie is `Secure` and named `__Host-mailroom_session` [default: false].
    #[arg(long, env = "MAILROOM_CONSOLE_SECURE_COOKIE", global = true)]
    pub console_secure_cookie: Option<bool>,
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
    /// Bytes of requests in flight at once, counted as they arrive, decompressed, and
    /// with what they decode to; beyond it RESOURCE_EXHAUSTED with a retry delay. At least
    /// max_batch_bytes; 0 = no limit [default: twice max_batch_bytes, 128 MiB].
    #[arg(long, env = "MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT", global = true)]
    pub max_request_bytes_in_flight: Option<usize>,
    /// Server-side time limit of an RPC in ms, answered UNAVAILABLE; 0 = none
    /// [default: 30000].
    #[arg(long, env = "MAILROOM_RPC_TIMEOUT_MS", global = true)]
    pub rpc_timeout_ms: Option<u64>,
    /// gRPC connections open at once (at most half the open-file limit); at the cap the
    /// oldest connection that has not spoken is closed to make room [default: 1000].
    #[arg(long, env = "MAILROOM_MAX_CONNECTIONS", global = true)]
    pub max_connections: Option<usize>,
    /// How long a new gRPC connection has to send the HTTP/2 preface (or complete its
    /// TLS handshake) before it is closed, in ms [default: 5000].
    #[arg(long, env = "MAILROOM_HANDSHAKE_TIMEOUT_MS", global = true)]
    pub handshake_timeout_ms: Option<u64>,
    /// HTTP/2 streams (RPCs) at once on one gRPC connection [default: 100].
    #[arg(long, env = "MAILROOM_MAX_CONCURRENT_STREAMS", global = true)]
    pub max_concurrent_streams: Option<u32>,
    /// Longest pause in a request's bytes before its message is whole (a unary
    /// request's body has ended), in ms; past it UNAVAILABLE, and the request's bytes
    /// leave the budget; 0 = none [default: 10000].
    #[arg(long, env = "MAILROOM_REQUEST_BODY_TIMEOUT_MS", global = true)]
    pub request_body_timeout_ms: Option<u64>,
    /// The most one caller (a token, or a client certificate) may hold of the RPC slots
    /// and of the request bytes in flight, in percent; one request alone may pass it;
    /// callers without an identity are not told apart; 100 = no bound [default: 50].
    #[arg(long, env = "MAILROOM_PRINCIPAL_SHARE_PERCENT", global = true)]
    pub principal_share_percent: Option<u32>,
    /// How long a request waits for a database connection before UNAVAILABLE, in ms
    /// (PostgreSQL) [default: 3000].
    #[arg(long, env = "MAILROOM_DATABASE_ACQUIRE_TIMEOUT_MS", global = true)]
    pub database_acquire_timeout_ms: Option<u64>,
    /// PostgreSQL statement timeout, in ms, of every query class that has no setting
    /// of its own (below); migrations have none; 0 = none.
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
    /// The PostgreSQL schema that holds mailroom's tables; every statement names it, and
    /// no session of mailroom's searches it [default: public].
    #[arg(long, env = "MAILROOM_DATABASE_SCHEMA", global = true)]
    pub database_schema: Option<String>,
    /// PostgreSQL `lock_timeout` of the service's sessions, in ms: how long a statement
    /// waits for a lock another session holds before UNAVAILABLE; 0 = none
    /// [default: 5000].
    #[arg(long, env = "MAILROOM_DATABASE_LOCK_TIMEOUT_MS", global = true)]
    pub database_lock_timeout_ms: Option<u64>,
    /// PostgreSQL `idle_in_transaction_session_timeout` of every session, in ms; 0 =
    /// none [default: 60000].
    #[arg(
        long,
        env = "MAILROOM_DATABASE_IDLE_IN_TRANSACTION_TIMEOUT_MS",
        global = true
    )]
    pub database_idle_in_transaction_timeout_ms: Option<u64>,
    /// Refuse to start when roles other than mailroom's may create objects in the
    /// schema of its tables, instead of warning [default: false].
    #[arg(long, env = "MAILROOM_DATABASE_REFUSE_SHARED_SCHEMA", global = true)]
    pub database_refuse_shared_schema: Option<bool>,
    /// PostgreSQL `lock_timeout` of migrations, in ms: a migration waiting longer for a
    /// lock is rolled back and tried again, so the service's requests queued behind it
    /// wait at most this long [default: 500].
    #[arg(long, env = "MAILROOM_MIGRATION_LOCK_TIMEOUT_MS", global = true)]
    pub migration_lock_timeout_ms: Option<u64>,
    /// How long migrating keeps retrying lock waits, in all, before it fails, in ms
    /// [default: 600000].
    #[arg(long, env = "MAILROOM_MIGRATION_MAX_WAIT_MS", global = true)]
    pub migration_max_wait_ms: Option<u64>,
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
    /// Outbox topics whose failed events are also published to a dead-letter topic
    /// (`<topic><suffix>`), comma-separated; `*` for every topic [default: none].
    #[arg(
        long,
        env = "MAILROOM_DEAD_LETTER_TOPICS",
        global = true,
        value_delimiter = ','
    )]
    pub dead_letter_topics: Option<Vec<String>>,
    /// Appended to an outbox topic's name to name its dead-letter topic [default: .dlq].
    #[arg(long, env = "MAILROOM_DEAD_LETTER_SUFFIX", global = true)]
    pub dead_letter_suffix: Option<String>,
    /// How long a process holds a background job without recording a page before
    /// another process takes it over, in ms [default: 15000].
    #[arg(long, env = "MAILROOM_JOB_LEASE_MS", global = true)]
    pub job_lease_ms: Option<u64>,
    /// The pause between two pages (1,000 events) of a background job, in ms
    /// [default: 20].
    #[arg(long, env = "MAILROOM_JOB_PAGE_PAUSE_MS", global = true)]
    pub job_page_pause_ms: Option<u64>,
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
    /// Outbox topic that gets a copy of every message that fails (dead-letter topic),
    /// e.g. `billing.dlq` [default: none].
    pub dead_letter_topic: Option<String>,
}

/// Settings may hold secrets (the database URL, the admin token, Kafka properties):
/// `Debug` shows none of their values.
impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("config", &self.config)
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// Fills unset fields from `lower`.
    pub(super) fn or(self, lower: Settings) -> Settings {
        macro_rules! pick {
            ($($f:ident),*) => { Settings { config: self.config.or(lower.config), $($f: self.$f.or(lower.$f)),* } };
        }
        pick!(
            listen,
            database_url,
            database_url_file,
            database_max_connections,
            migrate,
            log_format,
            kafka_brokers,
            kafka_properties,
            kafka_properties_file,
            kafka_message_timeout_ms,
            kafka_topic_limits_refresh_ms,
            local_sink,
            source,
            relays,
            relay_batch_size,
            relay_max_keys,
            relay_max_bytes,
            relay_max_run,
            relay_lease_ms,
            relay_poll_ms,
            relay_claim_spacing_ms,
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
            intake_overlap_ms,
            shutdown_grace_ms,
            health_interval_ms,
            ready_max_broker_down_ms,
            ready_max_lag_ms,
            otlp_endpoint,
            fault_counted_rate,
            fault_transient_rate,
            fault_record_panic,
            fault_task_panic,
            admin_token,
            admin_token_file,
            allow_unauthenticated,
            subscriptions,
            tokens_file,
            metrics_listen,
            metrics_allowed_hosts,
            console_listen,
            console_read_only,
            console_allowed_hosts,
            console_secure_cookie,
            metrics_stats_interval_ms,
            tls_cert,
            tls_key,
            tls_client_ca,
            max_concurrent_rpcs,
            max_request_bytes_in_flight,
            rpc_timeout_ms,
            max_connections,
            handshake_timeout_ms,
            max_concurrent_streams,
            request_body_timeout_ms,
            principal_share_percent,
            database_acquire_timeout_ms,
            database_statement_timeout_ms,
            database_enqueue_timeout_ms,
            database_relay_timeout_ms,
            database_admin_timeout_ms,
            database_schema,
            database_lock_timeout_ms,
            database_idle_in_transaction_timeout_ms,
            database_refuse_shared_schema,
            migration_lock_timeout_ms,
            migration_max_wait_ms,
            retention_completed_hours,
            retention_failed_hours,
            retention_interval_ms,
            retention_batch,
            dead_letter_topics,
            dead_letter_suffix,
            job_lease_ms,
            job_page_pause_ms
        )
    }
}

pub(super) fn parse_properties(s: &str) -> Result<BTreeMap<String, String>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .ok_or_else(|| format!("{p:?} is not key=value"))
        })
        .collect()
}

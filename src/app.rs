//! Wiring: store, intake, sink, relays, health and the gRPC server, with one cancellation
//! token driving a graceful shutdown: health goes NOT_SERVING, the server stops taking
//! RPCs and lets in-flight ones finish (their commits complete), then the relays finish
//! their cycle and release what they claimed, all within the grace period.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::HealthService;

use crate::access::Auth;
use crate::admin::Admin;
use crate::api::admin::AdminApi;
use crate::api::layers::{AuthLayer, ByteAdmissionLayer, OverloadLayer, RpcLogLayer};
use crate::api::outbox::{OutboxApi, OutboxLimits};
use crate::config::{Config, redact_url};
use crate::domain::Queue;
use crate::health::Health;
use crate::intake::{Intake, Wakeup};
use crate::metrics::Metrics;
use crate::pb;
use crate::relay::{ClaimCadence, Relay, RelayStats};
use crate::schema::SchemaGate;
use crate::sink::Sink;
use crate::sink::SinkConfig;
use crate::sink::fault::FaultySink;
use crate::sink::kafka::topic_limits::TopicLimits;
use crate::sink::kafka::{KafkaSink, fit_record_size, producer_config, record_bytes_needed};
use crate::sink::local::LocalSink;
use crate::store::Store;
use crate::store::postgres::{PgPools, PgStore};
use crate::store::sqlite::SqliteStore;

/// The PostgreSQL pool of the store: every connection gets the statement timeout
/// (`MAILROOM_DATABASE_STATEMENT_TIMEOUT_MS`), so a query whose RPC was abandoned (or an
/// admin filter that scans) is cancelled by the server instead of running on.
pub async fn pg_pool(
    config: &Config,
    statement_timeout: Option<std::time::Duration>,
    max_connections: u32,
    plans: crate::store::postgres::Plans,
) -> anyhow::Result<sqlx::PgPool> {
    let redacted = redact_url(&config.database_url.0);
    crate::store::postgres::pool(
        &config.database_url.0,
        crate::store::postgres::PoolShape {
            max_connections,
            acquire_timeout: config.database_acquire_timeout,
            statement_timeout,
            lazy: false,
            plans,
        },
        &config.database_profile,
    )
    .await
    .with_context(|| format!("connecting to {redacted}"))
}

/// The service's pools, one per query class with its class's statement timeout:
/// enqueues get `database_max_connections`, relays half of it, the admin a quarter (at
/// least 2 each), so a burst of one class cannot take the others' connections.
pub async fn pg_pools(config: &Config) -> anyhow::Result<PgPools> {
    use crate::store::postgres::Plans;
    let n = config.database_max_connections;
    let t = config.database_timeouts;
    Ok(PgPools {
        enqueue: pg_pool(config, t.enqueue, n, Plans::Server).await?,
        relay: pg_pool(config, t.relay, (n / 2).max(2), Plans::Generic).await?,
        admin: pg_pool(config, t.admin, (n / 4).max(2), Plans::Custom).await?,
        schema: config.database_profile.schema.clone(),
    })
}

/// Applies this binary's PostgreSQL migrations beside a running service: the migrator's
/// session has the `lock_timeout` of `config.migration`, and a migration that waits longer
/// is rolled back and tried again (`store::postgres::migrate`). Without a statement
/// timeout: building an index on a large table may take longer than any query of the
/// service should.
async fn migrate_pg(config: &Config) -> anyhow::Result<()> {
    let report = crate::store::postgres::migrate_database(
        &config.database_url.0,
        &config.database_profile.schema,
        config.database_acquire_timeout,
        config.migration,
    )
    .await
    .with_context(|| {
        format!(
            "running migrations on {}",
            redact_url(&config.database_url.0)
        )
    });
    let report = report?;
    if report.attempts > 1 {
        tracing::info!(
            attempts = report.attempts,
            took_ms = u64::try_from(report.took.as_millis()).unwrap_or(u64::MAX),
            "migrations applied after waiting for locks"
        );
    }
    Ok(())
}

/// Opens the configured store (and migrates it when asked).
pub async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn Store>> {
    let store: Arc<dyn Store> = if config.is_postgres() {
        if config.migrate {
            migrate_pg(config).await?;
        }
        let store = PgStore::from_pools(pg_pools(config).await?);
        check_schema_privileges(&store, config.database_refuse_shared_schema).await?;
        refuse_cached_sequences(&store).await?;
        sync_sql_limits(&store, &config.limits).await;
        Arc::new(store)
    } else {
        let store = Arc::new(
            SqliteStore::connect(&config.database_url.0)
                .await
                .with_context(|| format!("opening {}", redact_url(&config.database_url.0)))?,
        );
        if config.migrate {
            store.migrate().await.context("running migrations")?;
        }
        store
    };
    Ok(store)
}

/// Warns, or refuses to start when `refuse`, when roles other than mailroom's may create
/// objects in the schema of its tables (docs/security.md, "A shared database"). Service
/// sessions never search that schema, so nothing planted there runs in them; the
/// migrator does search it, and such a role also sees mailroom's table names.
async fn check_schema_privileges(store: &PgStore, refuse: bool) -> anyhow::Result<()> {
    let Some(shared) = store
        .schema_creators()
        .await
        .context("reading who may create in mailroom's schema")?
    else {
        return Ok(());
    };
    let schema = store.schema_name();
    if refuse {
        anyhow::bail!(
            "roles other than mailroom's may create in schema {schema:?}: {shared}              (MAILROOM_DATABASE_REFUSE_SHARED_SCHEMA is set; REVOKE CREATE ON SCHEMA from them,              or give mailroom a schema of its own with MAILROOM_DATABASE_SCHEMA)"
        );
    }
    tracing::warn!(
        schema,
        roles = %shared,
        "other roles may create in the schema of mailroom's tables: mailroom's sessions never          search it, but its migrations do; REVOKE CREATE ON SCHEMA from them, or give mailroom          a schema of its own (MAILROOM_DATABASE_SCHEMA); MAILROOM_DATABASE_REFUSE_SHARED_SCHEMA          makes this fatal"
    );
    Ok(())
}

/// Refuses to start on identity sequences that hand out ids in blocks per session
/// (`PgStore::cached_sequences`): events would be lost under the per-key cursor.
async fn refuse_cached_sequences(store: &PgStore) -> anyhow::Result<()> {
    let cached = store
        .cached_sequences()
        .await
        .context("reading the identity sequences of outbox_events and inbox_events")?;
    let Some((table, sequence, cache)) = cached.first() else {
        return Ok(());
    };
    let fixes: Vec<String> = cached
        .iter()
        .map(|(_, seq, _)| format!("ALTER SEQUENCE {seq} CACHE 1;"))
        .collect();
    anyhow::bail!(
        "the identity sequence {sequence} of {table} hands out ids in blocks of {cache} per \
         session (CACHE {cache}): ids are then committed out of their order, and a key's \
         cursor can pass an event committed after a higher id, which is never published. \
         mailroom needs CACHE 1 on the ids of its events; run: {}",
        fixes.join(" ")
    )
}

/// Keeps the SQL API's limits equal to the service's (a replica that may not write them
/// says so and goes on: gRPC is unaffected, and the SQL API keeps the row's limits). A
/// binary the database's schema does not accept writes nothing (`SYNC`'s gate).
async fn sync_sql_limits(store: &PgStore, limits: &crate::domain::Limits) {
    match store.sync_sql_limits(limits).await {
        Ok(true) => tracing::info!("SQL API limits (mailroom_sql_settings) set to the service's"),
        Ok(false) => {}
        Err(e @ crate::store::StoreError::SchemaRefused { .. }) => tracing::warn!(
            error = %e,
            "the SQL API's limits (mailroom_sql_settings) left as they are: the database requires a newer binary"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            "could not set the SQL API's limits (mailroom_sql_settings) to the service's: \
             SQL enqueues keep the row's limits until a replica with UPDATE on it starts"
        ),
    }
}

/// The CloudEvents `ce_source` of published events: `MAILROOM_SOURCE` when set, else
/// `mailroom/<installation id>` (a UUID the migrations generate once per database), so
/// that two deployments never publish the same (`ce_source`, `ce_id`).
pub async fn ce_source(config: &Config, store: &dyn Store) -> anyhow::Result<String> {
    if let Some(s) = &config.source {
        return Ok(s.clone());
    }
    let id = store
        .installation_id()
        .await
        .context("reading the installation id (run `mailroom migrate`)")?;
    Ok(format!("mailroom/{id}"))
}

/// Builds the configured sink. A Kafka sink without `MAILROOM_SOURCE` opens (and
/// migrates, when asked) the store to read the installation id.
pub async fn open_sink(config: &Config) -> anyhow::Result<Arc<dyn Sink>> {
    let store = match (&config.sink, &config.source) {
        (SinkConfig::Kafka { .. }, None) => Some(open_store(config).await?),
        _ => None,
    };
    sink_for(config, store.as_deref()).await
}

/// The configured sink; `store` (needed for a Kafka sink without `MAILROOM_SOURCE`)
/// gives the installation id.
async fn sink_for(config: &Config, store: Option<&dyn Store>) -> anyhow::Result<Arc<dyn Sink>> {
    let source = match (&config.sink, &config.source, store) {
        (_, Some(s), _) => s.clone(),
        (SinkConfig::Kafka { .. }, None, Some(store)) => ce_source(config, store).await?,
        (SinkConfig::Kafka { .. }, None, None) => {
            anyhow::bail!("a Kafka sink without MAILROOM_SOURCE needs the store's installation id")
        }
        (SinkConfig::Local { .. }, None, _) => String::new(),
    };
    let sink = base_sink(config, source).await?;
    let (counted, transient) = config.faults;
    if counted > 0.0 || transient > 0.0 {
        tracing::warn!(counted, transient, "fault injection is ON (testing only)");
        return Ok(Arc::new(FaultySink::new(
            sink,
            counted,
            transient,
            rand::random(),
        )));
    }
    Ok(sink)
}

async fn base_sink(config: &Config, source: String) -> anyhow::Result<Arc<dyn Sink>> {
    Ok(match &config.sink {
        SinkConfig::Kafka {
            brokers,
            properties,
            message_timeout,
        } => Arc::new(
            KafkaSink::new(
                {
                    let mut c = producer_config(brokers, *message_timeout, properties);
                    fit_record_size(
                        &mut c,
                        record_bytes_needed(
                            config.limits.max_payload_bytes,
                            config.limits.max_header_bytes,
                        ),
                    )
                    .map_err(anyhow::Error::msg)?;
                    c
                },
                source.clone(),
                *message_timeout,
            )
            .context("creating the Kafka producer")?
            .with_topic_limits(
                TopicLimits::new(
                    brokers,
                    properties,
                    source,
                    config.kafka_topic_limits_refresh,
                )
                .context("creating the Kafka admin client (topic limits)")?,
            ),
        ),
        SinkConfig::Local { path: None } => Arc::new(LocalSink::stdout()),
        SinkConfig::Local { path: Some(p) } => Arc::new(
            LocalSink::file(p.clone())
                .await
                .with_context(|| format!("opening local sink file {}", p.display()))?,
        ),
    })
}

/// A running mailroom.
pub struct App {
    /// The gRPC address (port 0 resolved).
    pub addr: SocketAddr,
    /// The store every part shares.
    pub store: Arc<dyn Store>,
    /// Each outbox relay's counters.
    pub relay_stats: Vec<Arc<RelayStats>>,
    /// The inbox's dispatchers and consumers, by subscription.
    pub inbox: crate::inbox::InboxHandles,
    /// The Prometheus registry.
    pub metrics: Metrics,
    /// Where `/metrics` is served, when `metrics_listen` is set.
    pub metrics_addr: Option<SocketAddr>,
    /// Where the operator console is served, when `console_listen` is set.
    pub console_addr: Option<SocketAddr>,
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl App {
    /// Starts everything with the configured sink; returns once the server listens.
    pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<App> {
        // The store is opened (and migrated) once; the sink may need its installation id.
        let store = open_store(&config).await?;
        let sink = sink_for(&config, Some(&*store)).await?;
        App::start_parts(config, store, sink, shutdown).await
    }

    /// Starts everything with a given sink (tests wrap the real one to inject faults).
    pub async fn start_with_sink(
        config: Config,
        sink: Arc<dyn Sink>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<App> {
        let store = open_store(&config).await?;
        App::start_parts(config, store, sink, shutdown).await
    }

    async fn start_parts(
        config: Config,
        store: Arc<dyn Store>,
        sink: Arc<dyn Sink>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<App> {
        let schema = schema_gate(&store).await;
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        let addr = listener.local_addr()?;

        let (health, health_service) = serving_health().await;

        let mut bg = Background::default();
        let outbox = start_outbox(&config, &store, &sink, &schema, &mut bg).await?;
        let (inbox_handles, inbox_tasks) = crate::inbox::start(
            store.clone(),
            &inbox_config(&config),
            &schema,
            bg.token.clone(),
        )?;
        bg.tasks.extend(inbox_tasks);
        let checks = readiness_checks(&config, &store, &schema, &outbox, &inbox_handles);
        bg.spawn(health.clone().monitor(checks, bg.token.clone()));
        let metrics = Metrics::for_service(
            outbox.stats.clone(),
            inbox_handles.clone(),
            store.clone(),
            schema.clone(),
        );
        let metrics_addr = start_metrics(&config, &store, &metrics, &mut bg).await?;
        start_retention(&config, &store, &metrics, &schema, &mut bg);
        let rates = Arc::new(crate::rates::RateRecorder::new(
            store.clone(),
            outbox.stats.clone(),
            inbox_handles.clone(),
        ));
        bg.spawn(rates.clone().run(bg.token.clone()));
        // Background jobs, run by every replica (the one that holds a job's lease).
        let job_admin = Admin::new(store.clone(), config.relay.lease)
            .with_schema(schema.clone())
            .with_intake(outbox.intake.clone());
        bg.spawn(crate::jobs::JobRunner::new(job_admin, config.jobs).run(bg.token.clone()));
        let auth = auth_for(&config);
        let parts = Parts {
            config: &config,
            store: &store,
            schema: &schema,
            metrics: &metrics,
            inbox: &inbox_handles,
        };
        let console_addr = start_console(&parts, &auth, &outbox.intake, &rates, &mut bg).await?;
        let services = Services::new(&parts, health_service, outbox.intake);
        log_serving(&parts, addr, &auth, metrics_addr, console_addr);
        let stack = Stack {
            tls: config.tls.as_ref().map(|t| t.tonic()).transpose()?,
            rpc_log: RpcLogLayer::new(metrics.clone()),
            auth: AuthLayer::new(auth),
            overload: OverloadLayer::new(config.overload, services.shares.clone()),
            admission: services.admission.clone(),
            connections: config.connections,
        };
        let task = tokio::spawn(serve(
            listener,
            stack,
            services,
            Stop {
                shutdown: shutdown.clone(),
                grace: config.shutdown_grace,
                health,
                background: bg,
            },
        ));
        Ok(App {
            addr,
            store,
            relay_stats: outbox.stats,
            inbox: inbox_handles,
            metrics,
            metrics_addr,
            console_addr,
            shutdown,
            task,
        })
    }

    /// Starts the graceful shutdown.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the app has stopped.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task.await.context("app task panicked")?
    }

    /// Shuts down and waits.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown();
        self.wait().await
    }
}

/// The background tasks started so far and the token that stops them (after the gRPC
/// server has drained).
#[derive(Default)]
struct Background {
    token: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Background {
    fn spawn(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.push(tokio::spawn(task));
    }
}

/// Health, SERVING and live from the start, and the `grpc.health.v1` service reading it.
/// The schema verdict at start-up, logged once; every part that changes rows asks it.
async fn schema_gate(store: &Arc<dyn Store>) -> SchemaGate {
    let schema = SchemaGate::new(store.clone());
    if let Err(e) = schema.read().await {
        tracing::warn!(error = %e, "reading the database's schema version failed");
    }
    schema
}

/// Retention rounds in the background.
fn start_retention(
    config: &Config,
    store: &Arc<dyn Store>,
    metrics: &Metrics,
    schema: &SchemaGate,
    bg: &mut Background,
) {
    bg.spawn(crate::retention::run(
        store.clone(),
        config.retention,
        Some(metrics.clone()),
        schema.clone(),
        bg.token.clone(),
    ));
}

async fn serving_health() -> (Health, HealthServer<HealthService>) {
    let reporter = tonic_health::server::HealthReporter::new();
    let service = crate::api::compressed!(HealthServer::new(HealthService::from_health_reporter(
        reporter.clone()
    )));
    let health = Health::new(reporter);
    health.set_all(ServingStatus::Serving).await;
    health.set_live().await;
    (health, service)
}

/// What readiness watches: the store, the relays, the inbox's tasks, the schema.
fn readiness_checks(
    config: &Config,
    store: &Arc<dyn Store>,
    schema: &SchemaGate,
    outbox: &Outbox,
    inbox: &crate::inbox::InboxHandles,
) -> crate::health::Checks {
    crate::health::Checks {
        store: store.clone(),
        relays: outbox.stats.clone(),
        inbox: inbox.task_health.clone(),
        max_broker_down: config.ready_max_broker_down,
        max_lag: config.ready_max_lag,
        interval: config.health_interval,
        schema: schema.clone(),
    }
}

/// The outbox's running half: the intake `Enqueue` calls, and each relay's counters.
struct Outbox {
    intake: Intake,
    stats: Vec<Arc<RelayStats>>,
}

/// Starts the outbox relays, their wake-ups (in-process, and LISTEN/NOTIFY across
/// processes on PostgreSQL) and the intake that wakes them.
async fn start_outbox(
    config: &Config,
    store: &Arc<dyn Store>,
    sink: &Arc<dyn Sink>,
    schema: &SchemaGate,
    bg: &mut Background,
) -> anyhow::Result<Outbox> {
    let wakeup = Wakeup::default();
    let mut stats = Vec::new();
    let (cycle_latency, publish_latency) = Default::default();
    let cadence = ClaimCadence::new(config.relays);
    for _ in 0..config.relays {
        let relay = Relay::new(store.clone(), sink.clone(), Queue::Outbox, config.relay)
            .with_latency(&cycle_latency, &publish_latency)
            .with_schema(schema.clone())
            .with_cadence(&cadence);
        wakeup.register(relay.waker());
        stats.push(relay.stats());
        bg.spawn(relay.run(bg.token.clone()));
    }
    if config.relays > 0 {
        // Failed events to dead-letter topics (it also empties the failure log when no
        // topic has one); only where relays publish what it enqueues.
        bg.spawn(crate::dead_letter::run(
            store.clone(),
            config.dead_letter.clone(),
            wakeup.clone(),
            schema.clone(),
            bg.token.clone(),
        ));
        bg.spawn(crate::relay::pauses::watch(
            store.clone(),
            sink.clone(),
            config.relay.poll_interval,
            bg.token.clone(),
        ));
    }
    if config.is_postgres() && config.listen_notify {
        let pool = crate::store::postgres::pool(
            &config.database_url.0,
            crate::store::postgres::PoolShape {
                max_connections: 2,
                lazy: true,
                ..Default::default()
            },
            &config.database_profile,
        )
        .await
        .context("LISTEN/NOTIFY pool")?;
        let trigger = Arc::new(tokio::sync::Notify::new());
        wakeup.set_remote(trigger.clone());
        bg.spawn(crate::store::postgres::notify::notifier(
            pool.clone(),
            trigger,
            std::time::Duration::from_millis(5),
            bg.token.clone(),
        ));
        let local = wakeup.clone();
        bg.spawn(crate::store::postgres::notify::listener(
            pool,
            move || local.wake_local(),
            bg.token.clone(),
        ));
    }
    let intake =
        Intake::start(store.clone(), config.intake, wakeup).with_topic_limits(sink.topic_limits());
    Ok(Outbox { intake, stats })
}

/// The inbox's settings, from the service's.
fn inbox_config(config: &Config) -> crate::inbox::InboxConfig {
    crate::inbox::InboxConfig {
        subscriptions: config.subscriptions.clone(),
        source: config.sink.clone(),
        relay: config.relay,
        limits: crate::domain::Limits {
            max_payload_bytes: config.inbox_max_payload_bytes,
            ..config.limits
        },
        faults: config.inbox_faults.clone(),
    }
}

/// Serves `/metrics` and refreshes its database gauges, when `metrics_listen` is set.
async fn start_metrics(
    config: &Config,
    store: &Arc<dyn Store>,
    metrics: &Metrics,
    bg: &mut Background,
) -> anyhow::Result<Option<SocketAddr>> {
    let Some(listen) = config.metrics_listen else {
        return Ok(None);
    };
    let (l, addr) = bind(listen, "metrics").await?;
    bg.spawn(
        metrics
            .clone()
            .serve(l, config.metrics_allowed_hosts.clone(), bg.token.clone()),
    );
    bg.spawn(metrics.clone().poll_stats(
        store.clone(),
        config.metrics_stats_interval,
        bg.token.clone(),
    ));
    Ok(Some(addr))
}

/// The token table, with the start-up lines that say what is open.
fn auth_for(config: &Config) -> Auth {
    let mtls = config.tls.as_ref().is_some_and(|t| t.client_ca.is_some());
    let auth = Auth::new(
        config.tokens.clone(),
        !config.tokens.is_empty(),
        config.admin_token.as_ref().map(|t| t.0.as_str()),
    )
    .with_mtls(mtls);
    if mtls && !crate::access::has_certificate_entries(&config.tokens) {
        tracing::info!(
            "mTLS: no token file entry names a client certificate, so a certificate alone \
             reaches only health checks; every other call needs a bearer token"
        );
    }
    if config.open_on_network {
        tracing::warn!(
            addr = %config.listen,
            "--allow-unauthenticated: every RPC is open to anyone who can reach this address"
        );
    }
    auth
}

/// The gRPC services mailroom serves (reflection is added by `serve`).
struct Services {
    health: HealthServer<HealthService>,
    outbox: OutboxLimits,
    admin: pb::admin_service_server::AdminServiceServer<AdminApi>,
    inbox: pb::inbox_service_server::InboxServiceServer<crate::api::inbox::InboxApi>,
    /// What each method's request may cost, counted as it arrives (the innermost layer).
    admission: ByteAdmissionLayer,
    /// Each principal's share of the RPC slots and of the bytes in flight.
    shares: Option<Arc<crate::api::layers::Shares>>,
}

/// What the later start-up phases read: the settings and the parts already running.
struct Parts<'a> {
    config: &'a Config,
    store: &'a Arc<dyn Store>,
    schema: &'a SchemaGate,
    metrics: &'a Metrics,
    inbox: &'a crate::inbox::InboxHandles,
}

/// Serves the operator console, when `console_listen` is set.
async fn start_console(
    p: &Parts<'_>,
    auth: &Auth,
    intake: &Intake,
    rates: &Arc<crate::rates::RateRecorder>,
    bg: &mut Background,
) -> anyhow::Result<Option<SocketAddr>> {
    let Some(listen) = p.config.console_listen else {
        return Ok(None);
    };
    let (l, addr) = bind(listen, "console").await?;
    let console = crate::console::Console::new(crate::console::ConsoleParts {
        admin: Admin::new(p.store.clone(), p.config.relay.lease)
            .with_schema(p.schema.clone())
            .with_intake(intake.clone()),
        auth: auth.clone(),
        read_only: p.config.console_read_only,
        allowed_hosts: p.config.console_allowed_hosts.clone(),
        secure_cookie: p.config.console_secure_cookie,
        subscriptions: p
            .config
            .subscriptions
            .iter()
            .map(|s| s.name.clone())
            .collect(),
        rates: rates.clone(),
        inbox: p.inbox.clone(),
    });
    bg.spawn(console.serve(l, bg.token.clone()));
    Ok(Some(addr))
}

/// The one line that says what started, and where.
fn log_serving(
    p: &Parts<'_>,
    addr: SocketAddr,
    auth: &Auth,
    metrics: Option<SocketAddr>,
    console: Option<SocketAddr>,
) {
    let config = p.config;
    tracing::info!(
        %addr,
        store = p.store.engine(),
        database = %redact_url(&config.database_url.0),
        sink = match &config.sink { SinkConfig::Kafka { .. } => "kafka", SinkConfig::Local { .. } => "local" },
        relays = config.relays,
        tls = config.tls.is_some(),
        mtls = config.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
        tokens = auth.enabled(),
        metrics = ?metrics,
        console = ?console,
        "mailroom serving"
    );
}

impl Services {
    fn new(p: &Parts<'_>, health: HealthServer<HealthService>, intake: Intake) -> Services {
        let config = p.config;
        let shares = crate::api::layers::Shares::new(config.overload.principal_share_percent);
        let admin = Admin::new(p.store.clone(), config.relay.lease)
            .with_schema(p.schema.clone())
            .with_intake(intake.clone());
        let inbox = crate::inbox::Inbox::new(
            p.store.clone(),
            config.subscriptions.clone(),
            p.inbox.clone(),
        );
        // A decoding limit per method: one event for Enqueue (and one message for
        // Receive), MAILROOM_MAX_BATCH_BYTES for EnqueueBatch. The admission layer applies
        // them as the bytes arrive (decompressed), with the element counts and what the
        // message decodes to; tonic's own limits stay as a second check.
        let single = crate::config::enqueue_request_bytes(&config.limits);
        let rules =
            crate::api::costs::rules(single, config.max_batch_bytes, config.limits.max_batch);
        Services {
            health,
            outbox: OutboxLimits::new(
                OutboxApi::new(intake, config.limits).with_metrics(p.metrics.clone()),
                single,
                config.max_batch_bytes,
            ),
            admin: crate::api::compressed!(pb::admin_service_server::AdminServiceServer::new(
                AdminApi::new(admin)
                    .with_metrics(p.metrics.clone())
                    .with_subscriptions(
                        config
                            .subscriptions
                            .iter()
                            .map(|s| s.name.clone())
                            .collect(),
                    ),
            )),
            // One message per call, limited as one Enqueue is (tonic's default of 4 MiB
            // would refuse payloads an operator allowed above it).
            inbox: crate::api::compressed!(
                pb::inbox_service_server::InboxServiceServer::new(
                    crate::api::inbox::InboxApi::new(Arc::new(inbox), config.limits),
                )
                .max_decoding_message_size(single)
            ),
            admission: ByteAdmissionLayer::new(
                config.overload.max_request_bytes,
                shares.clone(),
                config.overload.body_timeout,
                rules,
            ),
            shares,
        }
    }
}

/// What every RPC passes through, outermost first, and the server's TLS.
struct Stack {
    tls: Option<tonic::transport::ServerTlsConfig>,
    rpc_log: RpcLogLayer,
    auth: AuthLayer,
    overload: OverloadLayer,
    admission: ByteAdmissionLayer,
    connections: crate::api::connections::ConnectionLimits,
}

/// How the server stops: the shutdown signal, the grace period, the health to turn
/// NOT_SERVING, and the background tasks to stop once RPCs are drained.
struct Stop {
    shutdown: CancellationToken,
    grace: std::time::Duration,
    health: Health,
    background: Background,
}

/// The reflection services: v1, and the same descriptors under v1alpha (Python's
/// grpcio-reflection and several GUI clients speak only that version).
fn reflection() -> anyhow::Result<(
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
)> {
    let v1 = served(tonic_reflection::server::Builder::configure())
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .build_v1()
        .context("building reflection service")?;
    let v1alpha = served(tonic_reflection::server::Builder::configure())
        .with_service_name("grpc.reflection.v1alpha.ServerReflection")
        .build_v1alpha()
        .context("building reflection service (v1alpha)")?;
    Ok((v1, v1alpha))
}

/// The descriptors and the names of the services mailroom serves: the proto package also
/// holds `HandlerService`, which subscribers serve and mailroom calls; listing it made
/// generic clients call it here and get `UNIMPLEMENTED`.
fn served(b: tonic_reflection::server::Builder<'_>) -> tonic_reflection::server::Builder<'_> {
    b.register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name(pb::outbox_service_server::SERVICE_NAME)
        .with_service_name(pb::admin_service_server::SERVICE_NAME)
        .with_service_name(pb::inbox_service_server::SERVICE_NAME)
        .with_service_name("grpc.health.v1.Health")
}

/// How often an idle gRPC connection is pinged, and how long the answer may take.
const HTTP2_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(30);
const HTTP2_KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves gRPC until the shutdown signal, lets in-flight RPCs finish within the grace
/// period, then stops the background tasks (each within the grace period too).
async fn serve(
    listener: tokio::net::TcpListener,
    stack: Stack,
    services: Services,
    stop: Stop,
) -> anyhow::Result<()> {
    let (reflection, reflection_v1alpha) = reflection()?;
    let signal = {
        let (shutdown, health) = (stop.shutdown.clone(), stop.health.clone());
        async move {
            shutdown.cancelled().await;
            tracing::info!("shutting down: NOT_SERVING, draining RPCs");
            health.set_all(ServingStatus::NotServing).await;
        }
    };
    // Our own accept loop: a handshake deadline, a connection cap, TCP keep-alive, and
    // accept errors waited out (api::connections). It sets TCP_NODELAY too: without it,
    // Nagle holds back the second write of a response until the client's delayed ACK
    // (~40 ms per call).
    let limits = stack.connections;
    let incoming =
        crate::api::connections::incoming(listener, limits, stop.background.token.clone());
    // HTTP/2 keep-alive finds peers that vanished without a reset; streams per
    // connection are bounded.
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(HTTP2_KEEPALIVE))
        .http2_keepalive_timeout(Some(HTTP2_KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(Some(limits.max_concurrent_streams));
    if let Some(tls) = stack.tls {
        builder = builder.tls_config(tls).context("TLS configuration")?;
    }
    // Outermost first: log and count every answer, then authenticate, then admit
    // (concurrency limit, timeout, then request bytes in flight) only what is allowed.
    let server = builder
        .layer(stack.rpc_log)
        .layer(stack.auth)
        .layer(stack.overload)
        .layer(stack.admission)
        .add_service(services.health)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(services.outbox)
        .add_service(services.admin)
        .add_service(services.inbox)
        .serve_with_incoming_shutdown(incoming, signal);
    let mut server = std::pin::pin!(server);
    // The server runs until the signal, then gets `grace` to finish in-flight RPCs.
    let grace = stop.grace;
    let served = tokio::select! {
        r = &mut server => r,
        _ = async { stop.shutdown.cancelled().await; tokio::time::sleep(grace).await } => {
            tracing::warn!("grace period over; abandoning in-flight RPCs");
            Ok(())
        }
    };
    stop.background.token.cancel();
    let drain = futures::future::join_all(stop.background.tasks);
    if tokio::time::timeout(grace, drain).await.is_err() {
        tracing::warn!("background tasks did not stop within the grace period");
    }
    tracing::info!("mailroom stopped");
    served.context("gRPC server")
}

/// Binds a side port (`what`: metrics, console); the address says which port port 0 got.
async fn bind(
    listen: std::net::SocketAddr,
    what: &str,
) -> anyhow::Result<(tokio::net::TcpListener, std::net::SocketAddr)> {
    let l = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the {what} address {listen}"))?;
    let addr = l.local_addr()?;
    Ok((l, addr))
}

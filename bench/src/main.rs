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

mod baselines;
mod history;
mod infra;
mod intake;
mod measure;
mod relay;
mod retention;
mod scale;
mod sql_api;
mod status_reads;
mod wal;

use infra::*;
use measure::*;

/// Every scenario, in the order a full run executes them.
const ALL: &[&str] = &[
    "raw-pg",
    "raw-kafka",
    "raw-e2e",
    "enqueue",
    "batch",
    "relay-keys",
    "relay-key",
    "relay-deep",
    "e2e",
    "list-pending",
    "status-reads",
    "history",
    "sql-api",
    "wal",
    "retention",
    "scale-drain",
    "scale-intake",
];

const PAYLOAD_BYTES: usize = 256;
const EVENT_TYPE: &str = "bench.event";
const KEYS: usize = 1000;
const ENQUEUE_LEVELS: &[usize] = &[1, 16, 64, 256];
const BATCH: usize = 100;
const BATCH_CLIENTS: usize = 16;
const RAW_ROW_CONNECTIONS: usize = 64;
const RAW_KAFKA_IN_FLIGHT: usize = 10_000;
/// Offered rates of the end-to-end scenarios (events/s).
const E2E_RATES: &[u64] = &[1_000, 10_000];
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
    /// Scenarios, comma-separated: raw-pg, raw-kafka, raw-e2e, enqueue, batch, relay-keys,
    /// relay-key, relay-deep, e2e, list-pending, status-reads, history, sql-api, wal, retention,
    /// scale-drain, scale-intake; `relay` = the three relay scenarios, `scale` = both scale
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
    /// The retention scenario's two volumes (the second 5× the first).
    retention: [usize; 2],
    /// Events of the history scenario (over a tenth as many keys).
    history_events: usize,
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
                retention: [4_000, 20_000],
                history_events: 200_000,
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
                retention: [40_000, 200_000],
                history_events: std::env::var("MAILROOM_BENCH_HISTORY_EVENTS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(10_000_000),
            }
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
        // Tuning experiments: the service's own variables, passed through (the relay
        // count only where the scenario runs relays).
        relays: Some(match relays {
            0 => 0,
            n => env_parse("MAILROOM_RELAYS").unwrap_or(n),
        }),
        relay_batch_size: env_parse("MAILROOM_RELAY_BATCH_SIZE"),
        relay_max_keys: env_parse("MAILROOM_RELAY_MAX_KEYS"),
        relay_max_run: env_parse("MAILROOM_RELAY_MAX_RUN"),
        intake_writers: env_parse("MAILROOM_INTAKE_WRITERS"),
        intake_overlap_ms: env_parse("MAILROOM_INTAKE_OVERLAP_MS"),
        relay_claim_spacing_ms: env_parse("MAILROOM_RELAY_CLAIM_SPACING_MS"),
        ..Default::default()
    })?)
}

/// Fails at once, naming the address, when no broker answers: otherwise every scenario
/// would wait out its producers' retries with only librdkafka's log lines to say why.
async fn broker_answers(brokers: &str) -> anyhow::Result<()> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    tokio::task::spawn_blocking(move || consumer.fetch_metadata(None, Duration::from_secs(10)))
        .await?
        .with_context(|| format!("no Kafka broker answered at {brokers} within 10 s"))?;
    Ok(())
}

fn env_parse<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.parse().ok()
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

impl Bench {
    fn topic(&self, what: &str) -> String {
        format!("bench.{what}.{}", self.run)
    }
}

fn selected(args: &[String]) -> anyhow::Result<Vec<&'static str>> {
    let mut out = Vec::new();
    for a in args {
        let names: Vec<&'static str> = match a.trim() {
            "all" => ALL.to_vec(),
            "relay" => vec!["relay-keys", "relay-key", "relay-deep"],
            "scale" => vec!["scale-drain", "scale-intake"],
            other => match ALL.iter().find(|n| **n == other) {
                Some(n) => vec![*n],
                None => bail!(
                    "unknown scenario {other:?}; known: {}, relay, scale, all",
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
    broker_answers(&brokers).await?;
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
            "raw-e2e" => bench.raw_e2e().await,
            "e2e" => {
                async {
                    let mut rows = Vec::new();
                    for &rate in E2E_RATES {
                        rows.push(bench.e2e(rate).await?);
                    }
                    Ok(rows)
                }
                .await
            }
            "list-pending" => bench.list_pending().await.map(|r| vec![r]),
            "status-reads" => bench.status_reads().await,
            "history" => bench.history().await,
            "sql-api" => bench.sql_api().await,
            "wal" => bench.wal().await,
            "retention" => bench.retention(sizes.retention).await,
            "scale-drain" => bench.scale(sizes.relay_keys).await,
            "scale-intake" => bench.scale_intake().await,
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
        "{header}\n## Results\n\n{}\n## Targets (issue 6)\n\n{}\n## Targets (issue 15)\n\n{}",
        table(&rows),
        targets(&rows),
        targets_v2(&rows)
    );
    println!("{report}");
    if let Some(path) = &args.out {
        std::fs::write(path, &report).with_context(|| format!("writing {}", path.display()))?;
    }
    drop(broker);
    Ok(())
}

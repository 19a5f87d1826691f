//! Helpers of the fault suite (`tests/it/faults.rs`, `tests/it/hostile.rs`): the soak factor,
//! mailroom processes that can be SIGKILLed and restarted, a broker that advertises a
//! proxy, writers that enqueue continuously and retry, and the end-of-run verdict
//! (acknowledged ⊆ delivered, first deliveries in order per key, duplicates).
//!
//! Soak mode: `MAILROOM_SOAK=1` multiplies durations and counts by 10; `MAILROOM_SOAK=N`
//! (N ≥ 2) by N. Unset or 0: the short form CI runs.

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mailroom::pb;
use mailroom::pb::outbox_service_client::OutboxServiceClient;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

use super::{Broker, Record, first_deliveries, free_port};

/// The soak factor: 1 in the short form.
pub fn soak() -> u32 {
    match std::env::var("MAILROOM_SOAK")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        None | Some(0) => 1,
        Some(1) => 10,
        Some(n) => n,
    }
}

/// A duration of the short form, scaled for soak mode.
pub fn scaled(d: Duration) -> Duration {
    d * soak()
}

/// A count of the short form, scaled for soak mode.
pub fn scaled_n(n: usize) -> usize {
    n * soak() as usize
}

/// A small deterministic PRNG (xorshift64*), seeded per test and printed, so a failing
/// run can be replayed with `MAILROOM_FAULT_SEED`.
pub struct Rng(u64);

impl Rng {
    pub fn seeded(test: &str) -> Rng {
        let seed = std::env::var("MAILROOM_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            })
            | 1;
        eprintln!("{test}: MAILROOM_FAULT_SEED={seed}");
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo).max(1)
    }
}

/// The mailroom binary as a separate process, SIGKILLed and restarted at will on the
/// same port with the same settings.
pub struct Mailroom {
    pub port: u16,
    envs: Vec<(String, String)>,
    child: Option<Child>,
    /// The process's stderr (RUST_LOG=warn), appended across restarts.
    pub log: std::path::PathBuf,
    pub starts: u32,
    /// Kills that found the process running and ended it by SIGKILL (proof a kill bit).
    pub sigkills: u32,
}

impl Mailroom {
    /// Settings of the fault suite: 2 relays, short Kafka timeout and lease, fast
    /// retries. `extra` overrides or adds `MAILROOM_*` variables.
    pub fn new(db: &str, brokers: Option<&str>, extra: &[(&str, &str)]) -> Mailroom {
        let port = free_port();
        let mut envs: Vec<(String, String)> = vec![
            ("MAILROOM_LISTEN".into(), format!("127.0.0.1:{port}")),
            ("MAILROOM_DATABASE_URL".into(), db.into()),
            ("MAILROOM_KAFKA_MESSAGE_TIMEOUT_MS".into(), "2000".into()),
            ("MAILROOM_RELAY_LEASE_MS".into(), "7500".into()),
            ("MAILROOM_RELAY_POLL_MS".into(), "100".into()),
            ("MAILROOM_RETRY_BASE_MS".into(), "100".into()),
            ("MAILROOM_RETRY_CAP_MS".into(), "1000".into()),
            ("MAILROOM_MAX_ATTEMPTS".into(), "100".into()),
            ("MAILROOM_RELAYS".into(), "2".into()),
            ("MAILROOM_HEALTH_INTERVAL_MS".into(), "200".into()),
            ("RUST_LOG".into(), "warn".into()),
        ];
        if let Some(b) = brokers {
            envs.push(("MAILROOM_KAFKA_BROKERS".into(), b.into()));
        }
        for (k, v) in extra {
            envs.retain(|(k2, _)| k2 != k);
            envs.push((k.to_string(), v.to_string()));
        }
        let log =
            std::env::temp_dir().join(format!("mailroom-fault-{}-{port}.log", std::process::id()));
        Mailroom {
            port,
            envs,
            child: None,
            log,
            starts: 0,
            sigkills: 0,
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the process (not waiting for it).
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mailroom"));
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        self.child = Some(
            cmd.stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn mailroom"),
        );
        self.starts += 1;
    }

    /// Starts the process and waits until it listens.
    pub async fn start_ready(&mut self) {
        self.start();
        self.ready().await;
    }

    /// Waits until the gRPC port accepts connections; fails with the process's log if
    /// it exits first.
    pub async fn ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return;
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!(
                    "mailroom exited ({status}) before listening: {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "mailroom did not listen in 30 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL: no shutdown, no release of leases, in-flight RPCs cut. Counted in
    /// `sigkills` when the process was running and died of the signal.
    pub fn kill(&mut self) {
        use std::os::unix::process::ExitStatusExt;
        let Some(mut c) = self.child.take() else {
            return;
        };
        let running = matches!(c.try_wait(), Ok(None));
        let _ = c.kill();
        let status = c.wait();
        if running && matches!(status, Ok(s) if s.signal() == Some(9)) {
            self.sigkills += 1;
        }
    }
}

impl Drop for Mailroom {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Broker {
    /// A private tansu broker that tells its clients to connect to `advertised`
    /// (`host:port`, e.g. a proxy in front of it) after bootstrap. Kafka clients use
    /// the advertised address for every request past the first metadata call, so a
    /// proxy on the path must be the advertised address.
    pub fn start_advertising(port: u16, advertised: &str) -> Broker {
        let child = super::spawn_tansu(port, &format!("tcp://{advertised}"));
        super::wait_tansu(port);
        Broker {
            port,
            child: Some(child),
        }
    }
}

/// A lazily connecting client with a per-call deadline, so a writer never hangs on a
/// dead process and reconnects by itself after a restart.
pub fn lazy_client(addr: &str, timeout: Duration) -> OutboxServiceClient<Channel> {
    let ch = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(1))
        .timeout(timeout)
        .connect_lazy();
    OutboxServiceClient::new(ch)
}

/// What writers saw.
#[derive(Debug, Default)]
pub struct WriteLog {
    /// Acknowledged (key, id), in acknowledgement order.
    pub acked: Vec<(String, i64)>,
    /// Failed calls by status code.
    pub errors: HashMap<Code, usize>,
    /// Failed calls that took longer than `slow`.
    pub slow_errors: usize,
    /// The longest a failed call took.
    pub max_error_latency: Duration,
    /// The longest any call took.
    pub max_latency: Duration,
    /// Calls answered OK with a `duplicate` flag (a retry of a committed request).
    pub replays: usize,
    pub requests: usize,
}

impl WriteLog {
    pub fn merge(&mut self, o: WriteLog) {
        self.acked.extend(o.acked);
        for (c, n) in o.errors {
            *self.errors.entry(c).or_default() += n;
        }
        self.slow_errors += o.slow_errors;
        self.max_error_latency = self.max_error_latency.max(o.max_error_latency);
        self.max_latency = self.max_latency.max(o.max_latency);
        self.replays += o.replays;
        self.requests += o.requests;
    }
    pub fn error_count(&self) -> usize {
        self.errors.values().sum()
    }
}

/// Writers that enqueue continuously, alternating `Enqueue` and `EnqueueBatch`, each
/// owning its keys (so per key, acceptance order is send order). A failed call is
/// retried with the same idempotency keys (a retry of a request that did commit gets
/// the original ids back) on the next endpoint, until it is acknowledged or the
/// writers are stopped.
pub struct Writers {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<WriteLog>>,
}

pub struct WriterSpec {
    pub topic: String,
    pub writers: usize,
    pub keys: usize,
    /// mailroom addresses (`host:port`); a writer tries them in turn.
    pub endpoints: Vec<String>,
    /// Pause between acknowledged requests.
    pub pace: Duration,
    /// Per-call deadline.
    pub timeout: Duration,
    /// A failed call slower than this counts in `slow_errors`.
    pub slow: Duration,
}

impl Writers {
    pub fn start(spec: WriterSpec) -> Writers {
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Vec<_> = spec
            .endpoints
            .iter()
            .map(|a| lazy_client(a, spec.timeout))
            .collect();
        let mut tasks = Vec::new();
        for w in 0..spec.writers {
            let stop = stop.clone();
            let mut clients = clients.clone();
            let topic = spec.topic.clone();
            let keys: Vec<String> = (0..spec.keys)
                .filter(|k| k % spec.writers == w)
                .map(|k| format!("key-{k}"))
                .collect();
            let (pace, slow) = (spec.pace, spec.slow);
            tasks.push(tokio::spawn(async move {
                let mut log = WriteLog::default();
                let mut seq = 0usize;
                let mut ep = w % clients.len();
                // Hard bound: no writer outlives 10 minutes whatever the test does.
                let hard = Instant::now() + Duration::from_secs(600);
                while !stop.load(Ordering::SeqCst) && Instant::now() < hard {
                    let n = if seq.is_multiple_of(2) {
                        1
                    } else {
                        1 + seq % 5
                    };
                    let events: Vec<pb::Event> = (0..n)
                        .map(|j| {
                            let i = seq * 5 + j;
                            pb::Event {
                                topic: topic.clone(),
                                key: keys[(i * 7 + j) % keys.len()].clone(),
                                payload: format!("w{w}-{i}").into_bytes(),
                                idempotency_key: format!("{topic}-w{w}-{seq}-{j}"),
                                ..Default::default()
                            }
                        })
                        .collect();
                    // Retry this request until it is acknowledged or we are stopped.
                    while !stop.load(Ordering::SeqCst) && Instant::now() < hard {
                        let t0 = Instant::now();
                        let client = &mut clients[ep];
                        let r: Result<Vec<(i64, bool)>, tonic::Status> = if n == 1 {
                            client
                                .enqueue(pb::EnqueueRequest {
                                    event: Some(events[0].clone()),
                                })
                                .await
                                .map(|r| {
                                    let r = r.into_inner();
                                    vec![(r.id, r.duplicate)]
                                })
                        } else {
                            client
                                .enqueue_batch(pb::EnqueueBatchRequest {
                                    events: events.clone(),
                                })
                                .await
                                .map(|r| {
                                    r.into_inner()
                                        .results
                                        .into_iter()
                                        .map(|r| (r.id, r.duplicate))
                                        .collect()
                                })
                        };
                        let took = t0.elapsed();
                        log.requests += 1;
                        log.max_latency = log.max_latency.max(took);
                        match r {
                            Ok(ids) => {
                                assert_eq!(ids.len(), events.len(), "one result per event");
                                for ((id, dup), e) in ids.into_iter().zip(&events) {
                                    log.acked.push((e.key.clone(), id));
                                    log.replays += dup as usize;
                                }
                                break;
                            }
                            Err(s) => {
                                *log.errors.entry(s.code()).or_default() += 1;
                                log.max_error_latency = log.max_error_latency.max(took);
                                if took > slow {
                                    log.slow_errors += 1;
                                }
                                ep = (ep + 1) % clients.len();
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                        }
                    }
                    seq += 1;
                    if !pace.is_zero() {
                        tokio::time::sleep(pace).await;
                    }
                }
                log
            }));
        }
        Writers { stop, tasks }
    }

    /// Stops the writers and returns what they saw.
    pub async fn stop(self) -> WriteLog {
        self.stop.store(true, Ordering::SeqCst);
        let mut all = WriteLog::default();
        for t in self.tasks {
            all.merge(t.await.expect("writer panicked"));
        }
        all
    }
}

/// Waits until the outbox has at least `min_total` events and none pending; returns how
/// long it took.
pub async fn drained(db: &str, min_total: usize, timeout: Duration) -> Duration {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(db)
        .await
        .expect("connect");
    let t0 = Instant::now();
    loop {
        let (total, pending): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE status <> 'completed') FROM outbox_events_view",
        )
        .fetch_one(&pool)
        .await
        .expect("count");
        if total as usize >= min_total && pending == 0 {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < timeout,
            "not drained after {timeout:?}: {total} events, {pending} not completed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The end of a run: what was acknowledged against what is on the topic.
#[derive(Debug)]
pub struct Verdict {
    pub acked: usize,
    /// Distinct events on the topic.
    pub delivered: usize,
    /// Acknowledged events not on the topic.
    pub missing: Vec<i64>,
    /// Deliveries of an event already seen.
    pub duplicates: usize,
    /// Keys whose first deliveries are not in id (acceptance) order.
    pub keys_out_of_order: usize,
    /// Keys whose acknowledged ids do not increase in send order (ids must follow
    /// acceptance order per key).
    pub keys_acked_out_of_order: usize,
    /// Events on the topic that no writer saw acknowledged (committed, answer lost).
    pub unacknowledged_extra: usize,
}

impl Verdict {
    pub fn of(acked: &[(String, i64)], records: &[Record]) -> Verdict {
        let (per_key, duplicates) = first_deliveries(records);
        let delivered: HashSet<i64> = per_key.values().flatten().copied().collect();
        let acked_ids: HashSet<i64> = acked.iter().map(|(_, id)| *id).collect();
        let mut missing: Vec<i64> = acked_ids.difference(&delivered).copied().collect();
        missing.sort_unstable();
        let keys_out_of_order = per_key
            .values()
            .filter(|ids| !ids.windows(2).all(|w| w[0] < w[1]))
            .count();
        let mut acked_per_key: HashMap<&str, Vec<i64>> = HashMap::new();
        for (k, id) in acked {
            acked_per_key.entry(k).or_default().push(*id);
        }
        let keys_acked_out_of_order = acked_per_key
            .values()
            .filter(|ids| !ids.windows(2).all(|w| w[0] < w[1]))
            .count();
        Verdict {
            acked: acked_ids.len(),
            delivered: delivered.len(),
            unacknowledged_extra: delivered.difference(&acked_ids).count(),
            missing,
            duplicates,
            keys_out_of_order,
            keys_acked_out_of_order,
        }
    }

    /// Nothing acknowledged lost, nothing reordered.
    pub fn assert_sound(&self, what: &str) {
        assert!(self.acked > 0, "{what}: nothing was acknowledged");
        assert!(
            self.missing.is_empty(),
            "{what}: {} acknowledged events never reached the topic (first: {:?})",
            self.missing.len(),
            &self.missing[..self.missing.len().min(10)]
        );
        assert_eq!(
            self.keys_out_of_order, 0,
            "{what}: keys with first deliveries out of order"
        );
        assert_eq!(
            self.keys_acked_out_of_order, 0,
            "{what}: ids not in acceptance order within a key"
        );
    }
}

/// Reads the topic off the test's async threads.
pub async fn consume_all(
    brokers: &str,
    topic: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<Record> {
    let (b, t) = (brokers.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || super::consume(&b, &t, expected, timeout))
        .await
        .unwrap()
}

//! The relay under crashes and load, against real PostgreSQL and a real broker (tansu):
//! a stand test of several relays in two processes, a killed process, readiness while the
//! broker or the backlog lags, a sink gap, a dead topic beside healthy ones, and leases
//! that expire or are renewed during slow deliveries.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::relay::{accept_only, enqueue_run, ev, relay_config};
use crate::support::probe::*;
use crate::support::*;
use mailroom::domain::{BoxKind, EventId, Queue, Status, StoredEvent};
use mailroom::pb;
use mailroom::relay::backoff::RetryPolicy;
use mailroom::relay::{Relay, RelayConfig};
use mailroom::sink::{Delivery, Failure, Sink};
use mailroom::store::Store;
use mailroom::store::postgres::PgStore;

/// An in-memory topic: what reached it, in order, as (key, id).
type Log = Arc<Mutex<Vec<(String, EventId)>>>;

/// Starts the mailroom binary as a separate process.
fn spawn_mailroom(
    port: u16,
    db: &str,
    brokers: &str,
    faults: (f64, f64),
    relays: u32,
) -> std::process::Child {
    mailroom_command(port, db, brokers, faults, relays)
        .spawn()
        .expect("spawn mailroom")
}

/// The command `spawn_mailroom` runs, for callers that add settings.
fn mailroom_command(
    port: u16,
    db: &str,
    brokers: &str,
    faults: (f64, f64),
    relays: u32,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"));
    cmd.env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env("MAILROOM_DATABASE_URL", db)
        .env("MAILROOM_KAFKA_BROKERS", brokers)
        .env("MAILROOM_KAFKA_MESSAGE_TIMEOUT_MS", "3000")
        .env("MAILROOM_RELAY_LEASE_MS", "10000")
        .env("MAILROOM_RETRY_BASE_MS", "100")
        .env("MAILROOM_RETRY_CAP_MS", "1000")
        .env("MAILROOM_RELAYS", relays.to_string())
        .env("MAILROOM_FAULT_COUNTED_RATE", faults.0.to_string())
        .env("MAILROOM_FAULT_TRANSIENT_RATE", faults.1.to_string())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    cmd
}

fn check_order(per_key: &HashMap<String, Vec<i64>>) -> usize {
    per_key
        .values()
        .filter(|ids| !ids.windows(2).all(|w| w[0] < w[1]))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stand_test_four_relays_two_processes_random_faults() {
    let url = fresh_pg().await;
    let broker = Broker::start();
    // Process 1: in this test process, 2 relays behind a fault-injecting sink.
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    c.relays = 2;
    c.faults = (0.05, 0.03);
    c.relay.retry = RetryPolicy {
        base: Duration::from_millis(100),
        cap: Duration::from_secs(1),
        max_attempts: 6,
    };
    c.relay.batch_size = 50;
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let s = Service::start(c).await;
    let metrics_1 = s.app.metrics_addr.expect("metrics address");
    // Process 2: the binary, 2 more relays, same faults.
    let port = free_port();
    let metrics_2: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut other = mailroom_command(port, &url, &broker.addr(), (0.05, 0.03), 2)
        .env("MAILROOM_METRICS_LISTEN", metrics_2.to_string())
        .spawn()
        .expect("spawn mailroom");
    wait_listening(port, "mailroom listening").await;

    // Two writers; each owns its keys, so per key the acceptance order is the send order.
    let mut writers = Vec::new();
    for w in 0..2 {
        let mut client = if w == 0 {
            s.client.clone()
        } else {
            client(format!("127.0.0.1:{port}").parse().unwrap()).await
        };
        writers.push(tokio::spawn(async move {
            let sizes = [1usize, 5, 20];
            let mut sent = 0;
            let mut i = 0;
            while sent < 300 {
                let n = sizes[i % 3].min(300 - sent);
                let events: Vec<pb::Event> = (0..n)
                    .map(|j| {
                        let k = (sent + j) % (13 - w) + w * 13; // writer 0: keys 0..=12, writer 1: 13..=24
                        event(
                            "stand",
                            &format!("key-{k}"),
                            format!("{w}-{}", sent + j).as_bytes(),
                        )
                    })
                    .collect();
                client
                    .enqueue_batch(pb::EnqueueBatchRequest { events })
                    .await
                    .unwrap();
                sent += n;
                i += 1;
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    wait_completed(&s.app.store, 600, Duration::from_secs(120)).await;
    // The faults fired and both processes published: each process's own counters.
    let (mut counted, mut transient) = (0.0, 0.0);
    for (name, addr) in [("in-test process", metrics_1), ("binary", metrics_2)] {
        let page = scrape(addr).await;
        let text = body(&page);
        let published = sample(text, "mailroom_outbox_published_total");
        assert!(published > 0.0, "the {name} published nothing");
        counted += sample(text, "mailroom_outbox_retried_total{class=\"counted\"}");
        transient += sample(text, "mailroom_outbox_retried_total{class=\"transient\"}");
        eprintln!("stand test: the {name} published {published}");
    }
    assert!(counted > 0.0, "no counted fault fired");
    assert!(transient > 0.0, "no transient fault fired");
    let _ = other.kill();
    let _ = other.wait();
    let records = consume(&broker.addr(), "stand", 600, Duration::from_secs(30));
    let (per_key, dups) = first_deliveries(&records);
    let distinct: usize = per_key.values().map(Vec::len).sum();
    assert_eq!(distinct, 600, "every event published");
    assert_eq!(per_key.len(), 25);
    assert_eq!(check_order(&per_key), 0, "keys out of order");
    eprintln!(
        "stand test: 600 published, {counted} counted and {transient} transient faults, \
         {dups} duplicate deliveries, 0 keys out of order"
    );
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_loses_nothing_and_keeps_order() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let port = free_port();
    // Accept the backlog first (no relays), so the kill below lands mid-publish.
    let mut p = spawn_mailroom(port, &url, &broker.addr(), (0.0, 0.0), 0);
    wait_listening(port, "mailroom listening").await;
    let mut c = client(format!("127.0.0.1:{port}").parse().unwrap()).await;
    let mut acked = HashSet::new();
    let total = 20_000i64;
    for b in 0..(total / 500) {
        let events: Vec<pb::Event> = (0..500)
            .map(|i| {
                event(
                    "crash",
                    &format!("k{}", (b * 500 + i) % 50),
                    format!("{b}-{i}").as_bytes(),
                )
            })
            .collect();
        for r in c
            .enqueue_batch(pb::EnqueueBatchRequest { events })
            .await
            .unwrap()
            .into_inner()
            .results
        {
            acked.insert(r.id);
        }
    }
    p.kill().unwrap();
    p.wait().unwrap();
    let mut p = spawn_mailroom(port, &url, &broker.addr(), (0.0, 0.0), 2);
    // Kill it while it publishes the backlog: some events out, most still pending.
    let pg = PgStore::connect(&url, 2).await.unwrap();
    eventually(Duration::from_secs(30), "publishing started", || async {
        pg.count_events(BoxKind::Outbox, Some(Status::Completed))
            .await
            .unwrap()
            > 0
    })
    .await;
    p.kill().unwrap();
    p.wait().unwrap();
    let done_at_kill = pg
        .count_events(BoxKind::Outbox, Some(Status::Completed))
        .await
        .unwrap();
    assert!(
        done_at_kill < total,
        "killed too late to test anything ({done_at_kill} done)"
    );
    let mut p = spawn_mailroom(port, &url, &broker.addr(), (0.0, 0.0), 2);
    wait_listening(port, "mailroom listening").await;
    eventually(
        Duration::from_secs(120),
        "backlog drained after restart",
        || async {
            pg.count_events(BoxKind::Outbox, Some(Status::Completed))
                .await
                .unwrap()
                == total
        },
    )
    .await;
    let _ = p.kill();
    let _ = p.wait();
    let records = consume(
        &broker.addr(),
        "crash",
        total as usize,
        Duration::from_secs(60),
    );
    let (per_key, dups) = first_deliveries(&records);
    let delivered: HashSet<i64> = per_key.values().flatten().copied().collect();
    assert!(
        acked.is_subset(&delivered),
        "{} acknowledged events missing",
        acked.difference(&delivered).count()
    );
    assert_eq!(check_order(&per_key), 0, "keys out of order");
    eprintln!(
        "crash test: {} acknowledged, {} delivered, {dups} duplicates, killed with {done_at_kill} done",
        acked.len(),
        delivered.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_drops_while_the_broker_is_down_longer_than_allowed() {
    const SERVING: i32 = 1;
    const NOT_SERVING: i32 = 2;
    let mut broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(1));
    c.relays = 1;
    c.ready_max_broker_down = Some(Duration::from_secs(1));
    let mut s = Service::start(c).await;
    let addr = s.app.addr;
    assert_eq!(health_status(addr, "").await, Some(SERVING));
    broker.stop();
    enqueue(&mut s.client, event("ready", "k", b"x")).await;
    wait_health(
        addr,
        NOT_SERVING,
        Duration::from_secs(30),
        "NOT_SERVING while the broker is down",
    )
    .await;
    assert_eq!(
        health_status(addr, "liveness").await,
        Some(SERVING),
        "liveness stays on"
    );
    broker.resume();
    wait_health(
        addr,
        SERVING,
        Duration::from_secs(60),
        "SERVING once the broker is back",
    )
    .await;
    assert_eq!(s.outbox_count(Some(Status::Completed)).await, 1);
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_drops_while_the_backlog_is_older_than_allowed() {
    const SERVING: i32 = 1;
    const NOT_SERVING: i32 = 2;
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.relays = 0; // nothing publishes: the backlog only ages
    c.ready_max_lag = Some(Duration::from_secs(1));
    let mut s = Service::start(c).await;
    let addr = s.app.addr;
    assert_eq!(health_status(addr, "").await, Some(SERVING));
    let id = enqueue(&mut s.client, event("lag", "k", b"x")).await;
    wait_health(
        addr,
        NOT_SERVING,
        Duration::from_secs(20),
        "NOT_SERVING once the backlog is too old",
    )
    .await;
    // The operator cancels the stuck event: no backlog, ready again.
    let mut admin = pb::admin_service_client::AdminServiceClient::new(channel(addr).await);
    let cancel = pb::CancelEventsRequest {
        ids: vec![id],
        reason: "test".into(),
        ..Default::default()
    };
    admin.cancel_events(cancel).await.unwrap();
    wait_health(
        addr,
        SERVING,
        Duration::from_secs(20),
        "SERVING without a backlog",
    )
    .await;
    s.app.stop().await.unwrap();
}

/// Issue 24, item 3: the lag check fails safe. With `ready_max_lag` set, a stats query
/// that cannot answer (here `outbox_keys` locked by another session, so it waits past
/// the check's 5 s) makes readiness `NOT_SERVING`; once it answers again (lock gone, no
/// backlog) the server is `SERVING`. The database itself stays reachable throughout (the
/// fault is the stats query alone). Before: the check kept its last verdict, `SERVING`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_drops_while_the_lag_cannot_be_measured() {
    const SERVING: i32 = 1;
    const NOT_SERVING: i32 = 2;
    use sqlx::Connection;
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.relays = 0;
    c.ready_max_lag = Some(Duration::from_secs(60));
    let s = Service::start(c).await;
    let addr = s.app.addr;
    assert_eq!(health_status(addr, "").await, Some(SERVING));
    let mut locker = sqlx::PgConnection::connect(&url).await.unwrap();
    let mut tx = locker.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox_keys IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await
        .unwrap();
    wait_health(
        addr,
        NOT_SERVING,
        Duration::from_secs(30),
        "NOT_SERVING while the stats query cannot answer",
    )
    .await;
    // The fault is the stats query alone: the database still answers a ping. Each check
    // waits on the lock until its lock timeout, then the next one queues again.
    eventually(
        Duration::from_secs(15),
        "the stats query waits on the lock",
        || async {
            count_rows(
                &url,
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .await
                >= 1
        },
    )
    .await;
    tx.rollback().await.unwrap();
    wait_health(
        addr,
        SERVING,
        Duration::from_secs(30),
        "SERVING once the lag is measured again",
    )
    .await;
    s.app.stop().await.unwrap();
}

// ---- Issue 11: guarantees under real faults -------------------------------------------

/// Writes every event of its lines to `log` after `delay`, and acknowledges them.
struct LogSink {
    log: Log,
    delay: Duration,
}

#[async_trait::async_trait]
impl Sink for LogSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        tokio::time::sleep(self.delay).await;
        let mut log = self.log.lock().unwrap();
        for e in lines.iter().flatten() {
            log.push((e.key.clone().unwrap_or_default(), e.id));
        }
        lines
            .iter()
            .map(|l| vec![Delivery::Delivered; l.len()])
            .collect()
    }
}

/// A relay over `s`'s store whose sink writes to `log` after `delay`.
fn log_relay(s: &Service, log: &Log, delay: Duration, config: RelayConfig) -> Relay {
    Relay::new(
        s.app.store.clone(),
        Arc::new(LogSink {
            log: log.clone(),
            delay,
        }),
        Queue::Outbox,
        config,
    )
}

/// Starts `relay.cycle()` in a task and returns once the cycle has claimed.
async fn cycle_in_background(
    mut relay: Relay,
) -> tokio::task::JoinHandle<mailroom::relay::CycleReport> {
    let stats = relay.stats();
    let task = tokio::spawn(async move { relay.cycle().await.unwrap() });
    while stats.cycles.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    task
}

/// Per key, are the first deliveries in id order?
fn first_deliveries_in_order(log: &[(String, EventId)]) -> bool {
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, EventId> = HashMap::new();
    for (k, id) in log {
        if !seen.insert(*id) {
            continue;
        }
        if let Some(prev) = last.insert(k.as_str(), *id)
            && prev > *id
        {
            return false;
        }
    }
    true
}

/// Item 1, the deterministic half: a sink that acknowledges a later record of a run
/// after failing an earlier one (the gap librdkafka produces when it times a record out).
/// The relay never hands a key's later events to the sink while an earlier one of that
/// key is unacknowledged from an earlier cycle, and when a sink does report a gap inside
/// one run the event is published, counted (`delivered_after_failure`) and flagged on the
/// event (`GetEvent` shows it), never silently completed. (The Kafka sink cannot report
/// such a gap: `config_never_lets_librdkafka_skip_a_record`, and the 20-stall scenario
/// `stalls_past_the_delivery_deadline_never_reorder_a_key`.)
#[tokio::test]
async fn a_sink_gap_is_counted_and_flagged_and_waves_never_overlap() {
    struct GapSink {
        log: Log,
        /// Ids the sink fails (transient) once while publishing the rest of their run.
        gap_once: Mutex<HashSet<EventId>>,
        outstanding: Mutex<HashSet<String>>,
        overlaps: std::sync::atomic::AtomicU64,
    }
    #[async_trait::async_trait]
    impl Sink for GapSink {
        async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
            for l in lines {
                let k = l[0].key.clone().unwrap_or_default();
                if !self.outstanding.lock().unwrap().insert(k) {
                    self.overlaps.fetch_add(1, Ordering::Relaxed);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut out = Vec::new();
            for l in lines {
                let mut d = Vec::new();
                for e in l {
                    if self.gap_once.lock().unwrap().remove(&e.id) {
                        d.push(Delivery::Failed(Failure::Transient {
                            error: "kafka: not acknowledged in time".into(),
                        }));
                    } else {
                        self.log
                            .lock()
                            .unwrap()
                            .push((e.key.clone().unwrap_or_default(), e.id));
                        d.push(Delivery::Delivered);
                    }
                }
                out.push(d);
                self.outstanding
                    .lock()
                    .unwrap()
                    .remove(l[0].key.as_deref().unwrap_or_default());
            }
            out
        }
    }
    let mut s = accept_only().await;
    let ids = enqueue_run(&mut s, "gaps", "k", &["a", "b", "c"]).await;
    let log: Log = Arc::default();
    let sink = Arc::new(GapSink {
        log: log.clone(),
        gap_once: Mutex::new(HashSet::from([ids[0]])),
        outstanding: Mutex::default(),
        overlaps: Default::default(),
    });
    let mut relay = Relay::new(
        s.app.store.clone(),
        sink.clone(),
        Queue::Outbox,
        relay_config(Duration::ZERO),
    );
    let r = relay.cycle().await.unwrap();
    assert_eq!(r.delivered_after_failure, 2, "the gap was seen: {r:?}");
    let stats = relay.stats();
    assert_eq!(stats.delivered_after_failure.load(Ordering::Relaxed), 2);
    for id in &ids[1..] {
        let e = ev(&s.app.store, *id).await;
        assert_eq!(e.status, Status::Completed, "published events are not lost");
        assert!(
            e.last_error
                .unwrap_or_default()
                .contains("possible reordering"),
            "the event carries the flag GetEvent shows"
        );
    }
    // The failed head goes out next, alone: no later event of its key is handed over
    // while it is unacknowledged.
    while ev(&s.app.store, ids[0]).await.status != Status::Completed {
        relay.cycle().await.unwrap();
    }
    assert_eq!(sink.overlaps.load(Ordering::Relaxed), 0);
    let got: Vec<EventId> = log.lock().unwrap().iter().map(|(_, id)| *id).collect();
    assert_eq!(
        got,
        vec![ids[1], ids[2], ids[0]],
        "what the gap did, on record"
    );
    s.app.stop().await.unwrap();
}

/// A sink in front of an in-memory log: lines of `dead` hang for `hang`, then fail
/// transiently; other lines are acknowledged after 2 ms. Each line is reported as soon as
/// it is done, as the Kafka and handler sinks do.
struct DeadTopicSink {
    dead: String,
    hang: Duration,
    live: std::sync::atomic::AtomicU64,
    dead_lines: std::sync::atomic::AtomicU64,
}

impl DeadTopicSink {
    /// A sink where every line of `dead` hangs for `hang` and comes back transient.
    fn new(dead: &str, hang: Duration) -> Arc<Self> {
        Arc::new(DeadTopicSink {
            dead: dead.into(),
            hang,
            live: Default::default(),
            dead_lines: Default::default(),
        })
    }
}

#[async_trait::async_trait]
impl Sink for DeadTopicSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        mailroom::sink::deliver_by_line(self, lines).await
    }
    async fn deliver_each(&self, lines: &[Vec<&StoredEvent>], done: mailroom::sink::LineDone<'_>) {
        use futures::StreamExt;
        let mut running: futures::stream::FuturesUnordered<_> = lines
            .iter()
            .enumerate()
            .map(|(i, l)| async move {
                let mut d = vec![Delivery::NotAttempted; l.len()];
                if l[0].topic == self.dead {
                    self.dead_lines.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(self.hang).await;
                    d[0] = Delivery::Failed(Failure::Transient {
                        error: "topic unreachable".into(),
                    });
                } else {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    d.iter_mut().for_each(|x| *x = Delivery::Delivered);
                    self.live.fetch_add(l.len() as u64, Ordering::Relaxed);
                }
                (i, d)
            })
            .collect();
        while let Some((i, d)) = running.next().await {
            done(i, d);
        }
    }
}

/// Drains `live` events of topic "live" with one relay; returns the time it took and the
/// lines the relay held back because their topic was down.
async fn drain_live(s: &Service, sink: Arc<DeadTopicSink>, live: u64) -> (Duration, u64) {
    let relay = Relay::new(
        s.app.store.clone(),
        sink.clone(),
        Queue::Outbox,
        relay_config(Duration::from_millis(100)),
    );
    let stats = relay.stats();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    let t0 = std::time::Instant::now();
    while sink.live.load(Ordering::Relaxed) < live {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "live topic did not drain"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = t0.elapsed();
    stop.cancel();
    task.await.unwrap();
    assert_eq!(stats.delivered_after_failure.load(Ordering::Relaxed), 0);
    (took, stats.held_back.load(Ordering::Relaxed))
}

async fn enqueue_keys(s: &mut Service, topic: &str, keys: usize, per_key: usize) {
    for k in 0..keys {
        let events = (0..per_key)
            .map(|i| event(topic, &format!("{topic}-{k}"), format!("{i}").as_bytes()))
            .collect();
        s.client
            .enqueue_batch(pb::EnqueueBatchRequest { events })
            .await
            .unwrap();
    }
}

/// Item 6: one topic unreachable (its deliveries hang, then fail transiently) while
/// another drains at >= 80 % of the rate it drains at alone. The dead topic's keys are
/// enqueued first, so every early claim carries them. The drain alone and the drain
/// beside the dead topic run at the same time (each with its own database and relay),
/// so that the shared machine's noise falls on both alike; the median of 3 rounds. (Run
/// one after the other, the ratio swung with whatever else ran: 62-78 % seen; paired,
/// 142 % in the first run here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_topic_does_not_slow_the_healthy_ones() {
    // Large enough that the dead topic's fixed cost (its first lines hang once) is small
    // against the drain, so the ratio measures the pace, not start-up.
    let (keys, per_key) = (300, 160);
    let live = (keys * per_key) as u64;
    let (mut alone, mut beside, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut held_back = 0;
    for _ in 0..3 {
        let start = Arc::new(tokio::sync::Barrier::new(2));
        let ((a, _), (b, held)) = tokio::join!(
            dead_topic_round(false, keys, per_key, start.clone()),
            dead_topic_round(true, keys, per_key, start)
        );
        alone.push(a);
        beside.push(b);
        held_back += held;
        ratios.push(a.as_secs_f64() / b.as_secs_f64());
    }
    // The median round: the pairing already cancels the machine's noise.
    ratios.sort_by(f64::total_cmp);
    let ratio = ratios[1];
    eprintln!(
        "dead topic: {live} live events drained alone in {alone:?}, beside a dead topic in \
         {beside:?}: {:.0} % of the pace",
        ratio * 100.0
    );
    assert!(
        held_back > 0,
        "the dead topic's lines were held back while it was down"
    );
    assert!(
        ratio >= 0.8,
        "the healthy topic kept {:.0} % of its pace",
        ratio * 100.0
    );
}

/// One drain of the live topic, beside the dead topic when `with_dead`, started with the
/// other half of the round at `start`: how long it took and how many lines were held back.
async fn dead_topic_round(
    with_dead: bool,
    keys: usize,
    per_key: usize,
    start: Arc<tokio::sync::Barrier>,
) -> (Duration, u64) {
    let live = (keys * per_key) as u64;
    let (url, mut s) = quiet_pg().await;
    if with_dead {
        enqueue_keys(&mut s, "dead", 100, 5).await;
    }
    enqueue_keys(&mut s, "live", keys, per_key).await;
    let sink = DeadTopicSink::new("dead", Duration::from_millis(400));
    start.wait().await;
    let (took, held) = drain_live(&s, sink.clone(), live).await;
    if with_dead {
        assert!(
            sink.dead_lines.load(Ordering::Relaxed) > 0,
            "the dead topic's lines reached the sink"
        );
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let dead_spent: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_events_view WHERE topic = 'dead' AND (attempts > 0 OR status <> 'pending')",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(dead_spent, 0, "the dead topic spent no attempts");
    }
    s.app.stop().await.unwrap();
    (took, held)
}

/// Item 9, without renewal: the lease expires during a slow delivery and a second relay
/// takes the key over. The slow relay's late settle is refused (stale), duplicates are
/// allowed, and the first deliveries stay in order.
#[tokio::test]
async fn a_lease_that_expires_during_a_slow_delivery_is_taken_over_without_reordering() {
    let mut s = accept_only().await;
    let ids = enqueue_run(&mut s, "leases", "k", &["1", "2", "3", "4", "5"]).await;
    let log: Log = Arc::default();
    let mut slow_config = relay_config(Duration::ZERO);
    slow_config.lease = Duration::from_secs(1);
    slow_config.renew_leases = false;
    let slow = log_relay(&s, &log, Duration::from_millis(2500), slow_config);
    let slow_task = cycle_in_background(slow).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let mut fast = log_relay(&s, &log, Duration::ZERO, relay_config(Duration::ZERO));
    let taken = fast.cycle().await.unwrap();
    assert_eq!(
        taken.delivered, 5,
        "the expired lease was taken over: {taken:?}"
    );
    let late = slow_task.await.unwrap();
    assert_eq!(late.stale, 5, "the late settle is refused: {late:?}");
    let log = log.lock().unwrap().clone();
    assert_eq!(log.len(), 10, "duplicates, nothing lost: {log:?}");
    assert!(first_deliveries_in_order(&log), "{log:?}");
    for id in ids {
        assert_eq!(ev(&s.app.store, id).await.status, Status::Completed);
    }
    s.app.stop().await.unwrap();
}

/// Item 9, with renewal (the default): a delivery that outlasts the lease keeps its key,
/// so a second relay takes nothing and nothing is published twice; a late settle that
/// no one raced is applied.
#[tokio::test]
async fn renewed_leases_keep_a_slow_delivery_exclusive() {
    let mut s = accept_only().await;
    enqueue_run(&mut s, "leases", "k", &["1", "2", "3"]).await;
    let log: Log = Arc::default();
    // A delivery of 2.5 leases. The lease is 2 s (renewed every third of it), so that a
    // renewal delayed by a busy machine still lands well before the lease would lapse
    // (with 1 s, a renewal delayed by over ~0.7 s would let the other relay take it).
    let mut slow_config = relay_config(Duration::ZERO);
    slow_config.lease = Duration::from_secs(2);
    let slow = log_relay(&s, &log, Duration::from_millis(5000), slow_config);
    let slow_stats = slow.stats();
    // The slow relay holds the key before the other starts looking.
    let slow_task = cycle_in_background(slow).await;
    let mut fast = log_relay(&s, &log, Duration::ZERO, relay_config(Duration::ZERO));
    let t0 = std::time::Instant::now();
    let mut taken = 0;
    while t0.elapsed() < Duration::from_millis(4800) {
        taken += fast.cycle().await.unwrap().delivered;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = slow_task.await.unwrap();
    assert!(
        slow_stats.renewals.load(Ordering::Relaxed) >= 2,
        "leases were renewed: {} renewals, {} lost, {r:?}",
        slow_stats.renewals.load(Ordering::Relaxed),
        slow_stats.renewals_lost.load(Ordering::Relaxed)
    );
    assert_eq!(taken, 0, "no other relay took the key");
    assert_eq!((r.delivered, r.stale), (3, 0), "{r:?}");
    assert_eq!(log.lock().unwrap().len(), 3, "nothing published twice");

    // A settle after the lease expired, with no one racing, is applied.
    enqueue_run(&mut s, "leases", "k2", &["x"]).await;
    let mut unrenewed = relay_config(Duration::ZERO);
    unrenewed.lease = Duration::from_millis(300);
    unrenewed.renew_leases = false;
    let mut late = log_relay(&s, &log, Duration::from_millis(900), unrenewed);
    let r = late.cycle().await.unwrap();
    assert_eq!(
        (r.delivered, r.stale),
        (1, 0),
        "a late settle no one raced: {r:?}"
    );
    s.app.stop().await.unwrap();
}

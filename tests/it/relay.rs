//! The relay's contract against real PostgreSQL and a real broker (tansu): per-key order
//! under transient and counted failures, backoff, attempt budgets, outages, several
//! relays, runs per key, claim cost, a stand test and a crash.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::probe::{body, sample, scrape};
use crate::support::*;
use mailroom::domain::{BoxKind, EventId, Queue, Status, StoredEvent};
use mailroom::pb;
use mailroom::relay::backoff::RetryPolicy;
use mailroom::relay::{Relay, RelayConfig};
use mailroom::sink::kafka::{KafkaSink, producer_config};
use mailroom::sink::{Delivery, Failure, Sink};
use mailroom::store::postgres::PgStore;
use mailroom::store::{LineKey, Store};

const TIMEOUT: Duration = Duration::from_secs(2);

fn kafka(broker: &str, props: &[(&str, &str)]) -> Arc<dyn Sink> {
    let props = props
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Arc::new(
        KafkaSink::new(
            producer_config(broker, TIMEOUT, &props),
            "mailroom-test".into(),
            TIMEOUT,
        )
        .unwrap(),
    )
}

pub(crate) fn relay_config(base: Duration) -> RelayConfig {
    RelayConfig {
        lease: Duration::from_secs(30),
        poll_interval: Duration::from_millis(50),
        retry: RetryPolicy {
            base,
            cap: Duration::from_secs(60),
            max_attempts: 6,
        },
        ..RelayConfig::default()
    }
}

/// A PostgreSQL-backed service that only accepts; the test drives relays by hand.
pub(crate) async fn accept_only() -> Service {
    let url = fresh_pg().await;
    Service::start(quiet_config(&url)).await
}

/// A relay of the service's outbox, stepped by the test (`cycle`), publishing to `broker`.
fn outbox_relay(s: &Service, broker: &Broker) -> Relay {
    Relay::new(
        s.app.store.clone(),
        kafka(&broker.addr(), &[]),
        Queue::Outbox,
        relay_config(Duration::ZERO),
    )
}

/// Fails chosen events a number of times with a chosen failure, then passes them on.
struct ScriptedSink {
    inner: Arc<dyn Sink>,
    script: Mutex<HashMap<EventId, (u32, Failure)>>,
    seen: Mutex<Vec<EventId>>,
}

impl ScriptedSink {
    fn new(inner: Arc<dyn Sink>) -> Arc<Self> {
        Arc::new(ScriptedSink {
            inner,
            script: Mutex::new(HashMap::new()),
            seen: Mutex::new(Vec::new()),
        })
    }
    fn fail(&self, id: EventId, times: u32, f: Failure) {
        self.script.lock().unwrap().insert(id, (times, f));
    }
    /// Ids handed to the sink, in order.
    fn seen(&self) -> Vec<EventId> {
        self.seen.lock().unwrap().clone()
    }
}

#[async_trait::async_trait]
impl Sink for ScriptedSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        let mut pass = Vec::new();
        let mut failed_at = Vec::new();
        {
            let mut script = self.script.lock().unwrap();
            for line in lines {
                let mut p = Vec::new();
                let mut f = None;
                for e in line {
                    self.seen.lock().unwrap().push(e.id);
                    if let Some((n, failure)) = script.get_mut(&e.id)
                        && *n > 0
                    {
                        *n -= 1;
                        f = Some(failure.clone());
                        break;
                    }
                    p.push(*e);
                }
                pass.push(p);
                failed_at.push(f);
            }
        }
        let mut out = self.inner.deliver(&pass).await;
        for ((o, f), line) in out.iter_mut().zip(failed_at).zip(lines) {
            if let Some(f) = f {
                o.push(Delivery::Failed(f));
            }
            o.resize(line.len(), Delivery::NotAttempted);
        }
        out
    }
}

fn counted() -> Failure {
    Failure::Counted {
        error: "scripted refusal".into(),
        retry_at: None,
    }
}

pub(crate) async fn ev(store: &Arc<dyn Store>, id: EventId) -> StoredEvent {
    store.get_event(BoxKind::Outbox, id).await.unwrap().unwrap()
}

pub(crate) async fn enqueue_run(
    s: &mut Service,
    topic: &str,
    key: &str,
    names: &[&str],
) -> Vec<EventId> {
    let mut ids = Vec::new();
    for n in names {
        let mut e = event(topic, key, n.as_bytes());
        e.r#type = format!("order.{n}");
        ids.push(enqueue(&mut s.client, e).await);
    }
    ids
}

fn payloads_of(records: &[Record], key: &str) -> Vec<String> {
    records
        .iter()
        .filter(|r| r.key == key)
        .map(|r| String::from_utf8(r.payload.clone()).unwrap())
        .collect()
}

#[tokio::test]
async fn a_transient_failure_on_the_head_keeps_the_key_in_order() {
    let mut broker = Broker::start();
    let mut s = accept_only().await;
    let ids = enqueue_run(&mut s, "orders-t", "o-1", &["created", "paid", "cancelled"]).await;
    let sink = ScriptedSink::new(kafka(&broker.addr(), &[]));
    // A real transient failure: the broker is down.
    broker.stop();
    let mut relay = Relay::new(
        s.app.store.clone(),
        sink.clone(),
        Queue::Outbox,
        relay_config(Duration::from_secs(10)),
    );
    for _ in 0..2 {
        let r = relay.cycle().await.unwrap();
        assert!(r.transient, "{r:?}");
        assert_eq!(r.delivered, 0);
    }
    for id in &ids {
        let e = ev(&s.app.store, *id).await;
        assert_eq!(
            (e.status, e.attempts),
            (Status::Pending, 0),
            "a transient failure spends nothing"
        );
    }
    broker.resume();
    let mut cycles = 0;
    while s.outbox_count(Some(Status::Pending)).await > 0 {
        relay.cycle().await.unwrap();
        cycles += 1;
        assert!(cycles < 30, "did not drain after the broker came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let records = consume(&broker.addr(), "orders-t", 3, Duration::from_secs(20));
    assert_eq!(
        payloads_of(&records, "o-1"),
        vec!["created", "paid", "cancelled"]
    );
    for r in &records {
        assert_eq!(r.headers["ce_specversion"], "1.0");
        assert!(r.headers["ce_type"].starts_with("order."));
        assert_eq!(r.headers["ce_source"], "mailroom-test");
        // The CloudEvents Kafka binding's name for datacontenttype.
        assert_eq!(r.headers["content-type"], "application/octet-stream");
    }
    assert_no_gaps(&[relay.stats()]);
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn a_counted_failure_on_the_head_holds_the_key_then_keeps_order() {
    for base in [Duration::from_millis(600), Duration::ZERO] {
        let broker = Broker::start();
        let mut s = accept_only().await;
        let topic = "orders-c";
        let ids = enqueue_run(&mut s, topic, "o-1", &["created", "paid", "cancelled"]).await;
        let sink = ScriptedSink::new(kafka(&broker.addr(), &[]));
        sink.fail(ids[0], 1, counted());
        let mut relay = Relay::new(
            s.app.store.clone(),
            sink.clone(),
            Queue::Outbox,
            relay_config(base),
        );
        let r = relay.cycle().await.unwrap();
        assert_eq!((r.delivered, r.retried), (0, 1), "{r:?}");
        let head = ev(&s.app.store, ids[0]).await;
        assert_eq!((head.status, head.attempts), (Status::Pending, 1));
        assert_eq!(head.last_error.as_deref(), Some("scripted refusal"));
        for id in &ids[1..] {
            let e = ev(&s.app.store, *id).await;
            assert_eq!(
                (e.attempts, e.status),
                (0, Status::Pending),
                "successors untouched"
            );
        }
        if !base.is_zero() {
            // While the head waits out its backoff, nothing of the key goes out.
            for _ in 0..3 {
                let r = relay.cycle().await.unwrap();
                assert_eq!(r.attempted, 0, "{r:?}");
            }
            assert_eq!(sink.seen(), vec![ids[0]], "only the head was ever tried");
            tokio::time::sleep(base).await;
        }
        let r = relay.cycle().await.unwrap();
        assert_eq!(r.delivered, 3, "{r:?}");
        let records = consume(&broker.addr(), topic, 3, Duration::from_secs(20));
        assert_eq!(
            payloads_of(&records, "o-1"),
            vec!["created", "paid", "cancelled"]
        );
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn an_oversized_record_is_a_real_counted_failure_and_failed_does_not_block() {
    let broker = Broker::start();
    let mut s = accept_only().await;
    let mut big = event("sizes", "k", &vec![7u8; 40_000]);
    big.max_attempts = 2;
    let big_id = enqueue(&mut s.client, big).await;
    let next = enqueue(&mut s.client, event("sizes", "k", b"small")).await;
    let sink = kafka(&broker.addr(), &[("message.max.bytes", "10000")]);
    let mut relay = Relay::new(
        s.app.store.clone(),
        sink,
        Queue::Outbox,
        relay_config(Duration::ZERO),
    );
    let r = relay.cycle().await.unwrap();
    assert_eq!((r.retried, r.delivered), (1, 0), "{r:?}");
    let e = ev(&s.app.store, big_id).await;
    assert_eq!((e.status, e.attempts), (Status::Pending, 1));
    assert!(
        e.last_error.unwrap().contains("too large"),
        "broker-side class: counted"
    );
    assert_eq!(ev(&s.app.store, next).await.attempts, 0);
    let r = relay.cycle().await.unwrap();
    assert_eq!(r.failed, 1, "{r:?}");
    let e = ev(&s.app.store, big_id).await;
    assert_eq!((e.status, e.attempts), (Status::Failed, 2));
    // A failed event no longer holds its key: the successor goes out.
    let r = relay.cycle().await.unwrap();
    assert_eq!(r.delivered, 1, "{r:?}");
    assert_eq!(ev(&s.app.store, next).await.status, Status::Completed);
    assert_no_gaps(&[relay.stats()]);
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn other_keys_delayed_events_and_failed_events_do_not_block() {
    let broker = Broker::start();
    let mut s = accept_only().await;
    let t = "mixed";
    let a = enqueue_run(&mut s, t, "A", &["a1", "a2"]).await;
    let b = enqueue_run(&mut s, t, "B", &["b1", "b2"]).await;
    // C: a never-tried event for an hour from now, then a due one.
    let mut later = event(t, "C", b"c-later");
    later.deliver_after = Some(prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() + 3600,
        nanos: 0,
    });
    let c_later = enqueue(&mut s.client, later).await;
    let c_now = enqueue(&mut s.client, event(t, "C", b"c-now")).await;
    // D: its head fails for good on the first try.
    let mut d_head = event(t, "D", b"d1");
    d_head.max_attempts = 1;
    let d1 = enqueue(&mut s.client, d_head).await;
    let d2 = enqueue(&mut s.client, event(t, "D", b"d2")).await;

    let sink = ScriptedSink::new(kafka(&broker.addr(), &[]));
    sink.fail(a[0], 1, counted()); // A waits a minute
    sink.fail(d1, 1, counted());
    let mut relay = Relay::new(
        s.app.store.clone(),
        sink.clone(),
        Queue::Outbox,
        relay_config(Duration::from_secs(60)),
    );
    for _ in 0..3 {
        relay.cycle().await.unwrap();
    }
    let status = |id| {
        let store = s.app.store.clone();
        async move { ev(&store, id).await.status }
    };
    assert_eq!(status(a[0]).await, Status::Pending);
    assert_eq!(status(a[1]).await, Status::Pending, "behind a waiting head");
    assert_eq!(
        status(b[0]).await,
        Status::Completed,
        "another key is not held back"
    );
    assert_eq!(status(b[1]).await, Status::Completed);
    assert_eq!(status(c_later).await, Status::Pending);
    assert_eq!(
        status(c_now).await,
        Status::Completed,
        "a delayed never-tried event does not block"
    );
    assert_eq!(status(d1).await, Status::Failed);
    assert_eq!(
        status(d2).await,
        Status::Completed,
        "a failed event does not block"
    );
    assert!(
        !sink.seen().contains(&c_later),
        "delayed events are not sent early"
    );
    assert_no_gaps(&[relay.stats()]);
    s.app.stop().await.unwrap();
}

/// Blocks deliveries until opened, to hold a claim mid-publish.
struct GatedSink {
    inner: Arc<dyn Sink>,
    open: tokio::sync::Notify,
    entered: tokio::sync::Notify,
    gated: AtomicBool,
}

#[async_trait::async_trait]
impl Sink for GatedSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        if self.gated.load(Ordering::SeqCst) {
            self.entered.notify_one();
            self.open.notified().await;
        }
        self.inner.deliver(lines).await
    }
}

#[tokio::test]
async fn two_relays_never_share_a_key() {
    let broker = Broker::start();
    let mut s = accept_only().await;
    let a = enqueue_run(&mut s, "two", "A", &["a1", "a2", "a3"]).await;
    let gated = Arc::new(GatedSink {
        inner: kafka(&broker.addr(), &[]),
        open: tokio::sync::Notify::new(),
        entered: tokio::sync::Notify::new(),
        gated: AtomicBool::new(true),
    });
    let mut cfg = relay_config(Duration::from_secs(10));
    cfg.batch_size = 1; // relay 1 takes exactly A's head
    let mut r1 = Relay::new(s.app.store.clone(), gated.clone(), Queue::Outbox, cfg);
    let held = tokio::spawn(async move { (r1.cycle().await.unwrap(), r1) });
    gated.entered.notified().await;
    // Relay 1 is publishing A's head. B arrives; relay 2 may take B only.
    let b = enqueue_run(&mut s, "two", "B", &["b1", "b2"]).await;
    let seen2 = ScriptedSink::new(kafka(&broker.addr(), &[]));
    let mut r2 = Relay::new(
        s.app.store.clone(),
        seen2.clone(),
        Queue::Outbox,
        relay_config(Duration::from_secs(10)),
    );
    for _ in 0..3 {
        r2.cycle().await.unwrap();
    }
    assert_eq!(seen2.seen(), b, "relay 2 took only the other key");
    gated.gated.store(false, Ordering::SeqCst);
    gated.open.notify_one();
    let (report, _r1) = held.await.unwrap();
    assert_eq!(report.delivered, 1);
    // Once relay 1 settled, A's rest is free for relay 2, in order.
    for _ in 0..3 {
        r2.cycle().await.unwrap();
    }
    assert_eq!(&seen2.seen()[2..], &a[1..]);
    let records = consume(&broker.addr(), "two", 5, Duration::from_secs(20));
    assert_eq!(payloads_of(&records, "A"), vec!["a1", "a2", "a3"]);
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn a_broker_outage_costs_no_attempts_and_drains_by_itself() {
    let mut broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), TIMEOUT);
    c.relays = 0;
    let mut s = Service::start(c.clone()).await;
    for i in 0..20 {
        enqueue(
            &mut s.client,
            event("outage", &format!("k{}", i % 4), format!("{i}").as_bytes()),
        )
        .await;
    }
    broker.stop();
    let sink = kafka(&broker.addr(), &[]);
    let mut relay = Relay::new(
        s.app.store.clone(),
        sink,
        Queue::Outbox,
        relay_config(Duration::from_secs(10)),
    );
    for _ in 0..4 {
        let r = relay.cycle().await.unwrap();
        assert!(r.transient && r.delivered == 0, "{r:?}");
    }
    let all = s.outbox_count(None).await;
    assert_eq!(all, 20);
    for id in 1..=20 {
        let e = ev(&s.app.store, id).await;
        assert_eq!((e.status, e.attempts), (Status::Pending, 0));
    }
    s.app.stop().await.unwrap();
    // The broker returns; a normally running service drains everything with no operator.
    broker.resume();
    c.relays = 2;
    let s = Service::start(c).await;
    wait_completed(&s.app.store, 20, Duration::from_secs(60)).await;
    let records = consume(&broker.addr(), "outage", 20, Duration::from_secs(20));
    let (per_key, _) = first_deliveries(&records);
    assert_eq!(per_key.values().map(Vec::len).sum::<usize>(), 20);
    for ids in per_key.values() {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "order kept: {ids:?}");
    }
    assert_no_gaps(&[relay.stats()]);
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn counted_failures_back_off_within_the_jitter_window_then_fail() {
    let broker = Broker::start();
    let mut s = accept_only().await;
    let mut e = event("backoff", "k", b"x");
    e.max_attempts = 4;
    let id = enqueue(&mut s.client, e).await;
    let sink = ScriptedSink::new(kafka(&broker.addr(), &[]));
    sink.fail(id, 100, counted());
    let base = Duration::from_millis(200);
    let mut relay = Relay::new(s.app.store.clone(), sink, Queue::Outbox, relay_config(base));
    for attempt in 1..=3u32 {
        loop {
            let r = relay.cycle().await.unwrap();
            if r.attempted > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let e = ev(&s.app.store, id).await;
        assert_eq!((e.status, e.attempts), (Status::Pending, attempt));
        // Both times come from the same settle statement: the difference is the delay.
        let wait = (e.scheduled_at - e.updated_at).to_std().unwrap();
        let d = base * 2u32.pow(attempt - 1);
        assert!(
            wait >= d / 2 && wait <= d,
            "attempt {attempt}: waited {wait:?}, window [{:?}, {d:?}]",
            d / 2
        );
    }
    loop {
        let r = relay.cycle().await.unwrap();
        if r.attempted > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e = ev(&s.app.store, id).await;
    assert_eq!((e.status, e.attempts), (Status::Failed, 4));
    assert_eq!(e.last_error.as_deref(), Some("scripted refusal"));

    // Base 0: the budget is spent in exactly max_attempts cycles.
    let mut e = event("backoff", "z", b"y");
    e.max_attempts = 5;
    let id = enqueue(&mut s.client, e).await;
    let sink = ScriptedSink::new(kafka(&broker.addr(), &[]));
    sink.fail(id, 100, counted());
    let mut relay = Relay::new(
        s.app.store.clone(),
        sink,
        Queue::Outbox,
        relay_config(Duration::ZERO),
    );
    for _ in 0..5 {
        relay.cycle().await.unwrap();
    }
    let e = ev(&s.app.store, id).await;
    assert_eq!((e.status, e.attempts), (Status::Failed, 5));
    assert_no_gaps(&[relay.stats()]);
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn one_deep_key_drains_in_runs_and_claims_cost_the_same_at_any_depth() {
    let broker = Broker::start();
    let mut s = accept_only().await;
    let events: Vec<pb::Event> = (0..1000)
        .map(|i| event("deep", "one", format!("{i}").as_bytes()))
        .collect();
    enqueue_in_batches(&mut s, &events).await;
    let mut relay = outbox_relay(&s, &broker);
    let stats = relay.stats();
    while s.outbox_count(Some(Status::Pending)).await > 0 {
        relay.cycle().await.unwrap();
        assert!(
            stats.cycles.load(Ordering::Relaxed) <= 10,
            "a run per cycle, not an event per cycle"
        );
    }
    // 1000 events with runs of up to 500: two publishing cycles.
    assert!(
        stats.cycles.load(Ordering::Relaxed) <= 3,
        "cycles: {:?}",
        stats.cycles
    );
    let records = consume(&broker.addr(), "deep", 1000, Duration::from_secs(30));
    let got: Vec<String> = payloads_of(&records, "one");
    let want: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
    assert_eq!(got, want);

    // Claim cost: read the front of a 20,000-deep key and of a 100-deep key.
    let url = fresh_pg().await;
    let pg = PgStore::connect(&url, 4).await.unwrap();
    pg.migrate().await.unwrap();
    for (key, depth) in [("shallow", 100), ("deep", 20_000)] {
        let batch: Vec<_> = (0..depth)
            .map(|i| mailroom::domain::NewEvent {
                topic: "cost".into(),
                key: Some(key.into()),
                payload: format!("{i}").into_bytes(),
                headers: Default::default(),
                event_type: None,
                idempotency_key: None,
                deliver_after: None,
                max_attempts: 6,
            })
            .collect();
        for chunk in batch.chunks(5000) {
            pg.enqueue(chunk, true).await.unwrap();
        }
    }
    sqlx::query("ANALYZE public.outbox_events")
        .execute(pg.pool())
        .await
        .unwrap();
    let visits = |plan: &serde_json::Value| -> (u64, u64) {
        // Rows the line's index scan produced and the buffers the whole read touched.
        fn walk(n: &serde_json::Value, rows: &mut u64) {
            if n["Node Type"].as_str().is_some_and(|t| t.contains("Index")) {
                *rows += n["Actual Rows"].as_f64().unwrap_or(0.0) as u64
                    * n["Actual Loops"].as_u64().unwrap_or(1);
            }
            if let Some(children) = n["Plans"].as_array() {
                for c in children {
                    walk(c, rows);
                }
            }
        }
        let root = &plan[0]["Plan"];
        let mut rows = 0;
        walk(root, &mut rows);
        let buffers = root["Shared Hit Blocks"].as_u64().unwrap()
            + root["Shared Read Blocks"].as_u64().unwrap();
        (rows, buffers)
    };
    let line = |k: &str| LineKey {
        topic: "cost".into(),
        key: k.into(),
    };
    let shallow = visits(
        &pg.explain_line_read(BoxKind::Outbox, &line("shallow"), 100)
            .await
            .unwrap(),
    );
    let deep = visits(
        &pg.explain_line_read(BoxKind::Outbox, &line("deep"), 100)
            .await
            .unwrap(),
    );
    // The read walks the line three times (in-line rows; the end of the window, for the
    // delayed events before it; the last pending id), each stopping at the run limit.
    println!("line read: shallow {shallow:?}, deep {deep:?} (index rows, buffers)");
    assert!(
        (100..=301).contains(&shallow.0),
        "index rows: {}",
        shallow.0
    );
    assert_eq!(
        deep.0, shallow.0,
        "the deep key's read stops at the run limit"
    );
    assert!(
        deep.1 <= shallow.1 * 2 + 10,
        "buffers: deep {} vs shallow {}",
        deep.1,
        shallow.1
    );
    s.app.stop().await.unwrap();
}

/// A drained key goes idle: no relay leases it again until its next event, and its row
/// says so (`ready_at` never). Its published rows stay, at or below the cursor, until
/// retention; the release used to count them as new events, so every drained key was
/// leased again each cycle, for as long as they were retained.
#[tokio::test]
async fn drained_keys_go_idle_and_are_not_leased_again() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut s = Service::start(quiet_config(&url)).await;
    // 20 keys 50 deep: one claim takes them all with windows of 50, which end full, so
    // the keys are released ready and the next claim finds their lines empty.
    let events: Vec<pb::Event> = (0..1000)
        .map(|i| event("idle", &format!("k{}", i % 20), format!("{i}").as_bytes()))
        .collect();
    enqueue_in_batches(&mut s, &events).await;
    let mut relay = outbox_relay(&s, &broker);
    let mut cycles = 0;
    while s.outbox_count(Some(Status::Pending)).await > 0 {
        relay.cycle().await.unwrap();
        cycles += 1;
        assert!(cycles <= 20, "not drained after {cycles} cycles");
    }
    // The cycle after the drain may look at keys released ready (a full window); from
    // then on, none is leased.
    let mut leased = Vec::new();
    for _ in 0..5 {
        leased.push(relay.cycle().await.unwrap().keys);
    }
    assert_eq!(
        leased[2..],
        [0, 0, 0],
        "keys leased per cycle after the drain: {leased:?}"
    );
    let pg = PgStore::connect(&url, 1).await.unwrap();
    let (keys, ready): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE ready_at <> 'infinity' OR lease_token IS NOT NULL)
         FROM public.outbox_keys",
    )
    .fetch_one(pg.pool())
    .await
    .unwrap();
    assert_eq!((keys, ready), (20, 0), "key rows, and those not idle");
    // The published rows are still there (the cursor covers them), and a new event
    // wakes its key at once.
    let retained: i64 = sqlx::query_scalar("SELECT count(*) FROM public.outbox_events")
        .fetch_one(pg.pool())
        .await
        .unwrap();
    assert_eq!(retained, 1000);
    enqueue(&mut s.client, event("idle", "k3", b"1000")).await;
    let report = relay.cycle().await.unwrap();
    assert_eq!((report.keys, report.delivered), (1, 1));
    let records = consume(&broker.addr(), "idle", 1001, Duration::from_secs(30));
    assert_eq!(records.len(), 1001);
    s.app.stop().await.unwrap();
}

/// SQL-API events are folded into their keys 1,000 per claim, while a claim reads every
/// pending event of a key whether folded or not: a relay that publishes faster than it
/// folds has published what later folds count. Those folds must not wake the drained
/// key (it was leased again, empty, once per fold, ahead of keys with work), and folding
/// must still count every event.
#[tokio::test]
async fn folding_published_sql_events_does_not_wake_their_drained_key() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let s = Service::start(quiet_config(&url)).await;
    let pg = PgStore::connect(&url, 1).await.unwrap();
    // 5,000 events on one key, in SQL-API calls of 1,000 (stored unfolded).
    for b in 0..5 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM mailroom.enqueue_batch(
                 array_fill('sqlfold'::text, ARRAY[1000]), array_fill('k'::text, ARRAY[1000]),
                 (SELECT array_agg(convert_to(g::text, 'UTF8') ORDER BY g)
                  FROM generate_series($1 * 1000 + 1, $1 * 1000 + 1000) g))",
        )
        .bind(b)
        .fetch_one(pg.pool())
        .await
        .unwrap();
        assert_eq!(n, 1000);
    }
    // One claim reads the whole line: batch and run of 5,000.
    let mut relay = Relay::new(
        s.app.store.clone(),
        kafka(&broker.addr(), &[]),
        Queue::Outbox,
        RelayConfig {
            batch_size: 5000,
            max_run: 5000,
            ..relay_config(Duration::ZERO)
        },
    );
    let first = relay.cycle().await.unwrap();
    assert_eq!(first.delivered, 5000, "{first:?}");
    let unfolded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM public.outbox_events WHERE NOT counted")
            .fetch_one(pg.pool())
            .await
            .unwrap();
    assert_eq!(unfolded, 4000, "the first claim folds 1,000");
    // The next four claims fold the rest.
    let mut leased = Vec::new();
    for _ in 0..5 {
        leased.push(relay.cycle().await.unwrap().keys);
    }
    let (unfolded, pending, ready): (i64, i64, bool) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM public.outbox_events WHERE NOT counted),
                k.pending, k.ready_at <> 'infinity'
         FROM public.outbox_keys k WHERE k.topic = 'sqlfold'",
    )
    .fetch_one(pg.pool())
    .await
    .unwrap();
    assert_eq!(unfolded, 0, "every event folded");
    // The first claim after the drain may look at the key once: its window ended full,
    // so it was released ready. Folding the rest never wakes it again.
    assert_eq!(
        leased[1..],
        [0, 0, 0, 0],
        "keys leased per claim after the drain: {leased:?}"
    );
    assert_eq!(
        (pending, ready),
        (0, false),
        "the key's count and whether it is ready"
    );
    assert_eq!(s.outbox_count(Some(Status::Pending)).await, 0);
    assert_eq!(
        consume(&broker.addr(), "sqlfold", 5000, Duration::from_secs(30)).len(),
        5000
    );
    s.app.stop().await.unwrap();
}

/// Item 8: a payload of exactly `max_payload_bytes` (1,015,820 bytes by default, so that
/// it fits stock Kafka: issue 23, item 5) is published: the producer's
/// `message.max.bytes` is raised to fit it (librdkafka's default, 1,000,000 bytes,
/// refused it forever).
#[tokio::test]
async fn a_payload_of_max_payload_bytes_is_published() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(5));
    let max = c.limits.max_payload_bytes;
    assert_eq!(max, 1_015_820);
    let mut s = Service::start(c).await;
    let payload = vec![42u8; max];
    let id = enqueue(&mut s.client, event("big", "k", &payload)).await;
    let t0 = std::time::Instant::now();
    while ev(&s.app.store, id).await.status == Status::Pending {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "not published: {:?}",
            ev(&s.app.store, id).await.last_error
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let records = consume(&broker.addr(), "big", 1, Duration::from_secs(30));
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].payload.len(), max);
    let e = ev(&s.app.store, id).await;
    assert_eq!((e.status, e.attempts), (Status::Completed, 0));
    s.app.stop().await.unwrap();
}

/// Issue 28, item 1, on both engines: `GetEvent` lists each counted attempt (number,
/// time, error), oldest first, and the failure that ended the event; transient failures
/// (no attempt spent) are not listed; the CLI's `get` shows them.
#[tokio::test]
async fn get_event_lists_each_counted_attempt_and_not_the_transient_ones() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let mut s = Service::start(quiet_config(&url)).await;
        let mut e = event("history", "k", b"x");
        e.max_attempts = 3;
        let id = enqueue(&mut s.client, e).await;
        let dir = tempfile::tempdir().unwrap();
        let local = mailroom::sink::local::LocalSink::file(dir.path().join("out.jsonl"))
            .await
            .unwrap();
        let sink = ScriptedSink::new(Arc::new(local));
        let mut relay = Relay::new(
            s.app.store.clone(),
            sink.clone(),
            Queue::Outbox,
            relay_config(Duration::ZERO),
        );
        // Two transient failures (an outage), then three counted ones: failed.
        sink.fail(
            id,
            2,
            Failure::Transient {
                error: "broker unreachable".into(),
            },
        );
        for _ in 0..2 {
            while relay.cycle().await.unwrap().attempted == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert_eq!(
            ev(&s.app.store, id).await.attempts,
            0,
            "the outage spent nothing"
        );
        sink.fail(id, 3, counted());
        for _ in 0..30 {
            relay.cycle().await.unwrap();
            if ev(&s.app.store, id).await.status == Status::Failed {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut a = pb::admin_service_client::AdminServiceClient::new(channel(s.app.addr).await);
        let info = event_info(s.app.addr, pb::Box::Outbox, id).await;
        assert_eq!(info.status, pb::EventStatus::Failed as i32, "{engine:?}");
        let h = &info.attempt_history;
        assert_eq!(
            h.iter().map(|a| a.attempt).collect::<Vec<_>>(),
            [1, 2, 3],
            "{engine:?}: {h:?}"
        );
        assert!(h.iter().all(|a| a.error == "scripted refusal"), "{h:?}");
        let at: Vec<i64> = h
            .iter()
            .map(|a| {
                a.at.as_ref().unwrap().seconds * 1_000_000_000
                    + i64::from(a.at.as_ref().unwrap().nanos)
            })
            .collect();
        assert!(at.windows(2).all(|w| w[0] <= w[1]), "{at:?}");
        let listed = a
            .list_events(pb::ListEventsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(
            listed.events.iter().all(|e| e.attempt_history.is_empty()),
            "listings leave it out"
        );
        let text = admin_cli_ok(s.app.addr, None, &["get", &id.to_string()]).await;
        assert_eq!(
            text.matches("scripted refusal").count(),
            4,
            "3 attempts and the last error: {text}"
        );
        assert!(text.contains("#3 at "), "{text}");
        s.app.stop().await.unwrap();
    }
}

/// Enqueues `events` in batches of 500; their ids, in order.
pub(crate) async fn enqueue_ids(client: &mut OutboxClient, events: &[pb::Event]) -> Vec<EventId> {
    let mut ids = Vec::with_capacity(events.len());
    for chunk in events.chunks(500) {
        let r = client
            .enqueue_batch(pb::EnqueueBatchRequest {
                events: chunk.to_vec(),
            })
            .await
            .unwrap()
            .into_inner();
        ids.extend(r.results.iter().map(|r| r.id));
    }
    ids
}

pub(crate) type OutboxClient =
    pb::outbox_service_client::OutboxServiceClient<tonic::transport::Channel>;

/// Runs of 500, so a key 3,000 deep is several runs.
fn short_runs(sink: Arc<dyn Sink>, s: &Service) -> Relay {
    Relay::new(
        s.app.store.clone(),
        sink,
        Queue::Outbox,
        RelayConfig {
            batch_size: 500,
            max_run: 500,
            ..relay_config(Duration::ZERO)
        },
    )
}

/// A deep key goes on without releasing its key: one cycle sends run after run, each
/// as soon as the one before is acknowledged, while events keep arriving on the key
/// (above the line's horizon: read once the line has passed it, under lock); every
/// event comes out once, in order, and the key is released at the end.
#[tokio::test]
async fn a_deep_key_goes_on_run_after_run_without_a_new_claim() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut s = Service::start(quiet_config(&url)).await;
    let first: Vec<pb::Event> = (0..3000)
        .map(|i| event("continued", "deep", format!("{i}").as_bytes()))
        .collect();
    enqueue_ids(&mut s.client, &first).await;
    let mut relay = short_runs(kafka(&broker.addr(), &[]), &s);
    let stats = relay.stats();
    // More of the key arrives while the cycle runs, once it has claimed: a writer holds
    // the key row while it enqueues, and a claim skips a key row another transaction
    // holds (it would then find nothing to do).
    let mut writer = s.client.clone();
    let claimed = stats.clone();
    let more = tokio::spawn(async move {
        while claimed.cycles.load(Ordering::Relaxed) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let later: Vec<pb::Event> = (3000..4000)
            .map(|i| event("continued", "deep", format!("{i}").as_bytes()))
            .collect();
        for chunk in later.chunks(100) {
            enqueue_ids(&mut writer, chunk).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let r = relay.cycle().await.unwrap();
    more.await.unwrap();
    assert_eq!(stats.cycles.load(Ordering::Relaxed), 1);
    let continued = stats.continued.load(Ordering::Relaxed);
    assert!(continued >= 5, "runs after the first: {continued}, {r:?}");
    assert!(r.delivered >= 3000, "{r:?}");
    assert_eq!(r.delivered as u64, stats.delivered.load(Ordering::Relaxed));
    // Whatever the cycle did not reach, later cycles do.
    let mut cycles = 1;
    while s.outbox_count(Some(Status::Pending)).await > 0 {
        relay.cycle().await.unwrap();
        cycles += 1;
        assert!(cycles < 20, "did not drain");
    }
    let records = consume(&broker.addr(), "continued", 4000, Duration::from_secs(30));
    let want: Vec<String> = (0..4000).map(|i| i.to_string()).collect();
    assert_eq!(payloads_of(&records, "deep"), want);
    let leased: Option<i64> = sqlx::query_scalar(
        "SELECT lease_token FROM outbox_keys WHERE topic = 'continued' AND event_key = 'deep'",
    )
    .fetch_one(&sqlx::PgPool::connect(&url).await.unwrap())
    .await
    .unwrap();
    assert_eq!(leased, None, "the key is released after its last run");
    assert_no_gaps(&[stats]);
    s.app.stop().await.unwrap();
}

/// A failure in a continued run stops the line there, as in any run: the events after
/// it are not sent, the failed one spends its attempt (counted) or nothing (transient),
/// the key is released, and the next cycle publishes from the failed event on, in order.
#[tokio::test]
async fn a_failure_in_a_continued_run_stops_the_line_and_keeps_order() {
    let broker = Broker::start();
    let mut s = accept_only().await;
    let events: Vec<pb::Event> = (0..3000)
        .map(|i| event("continued-f", "deep", format!("{i}").as_bytes()))
        .collect();
    let ids = enqueue_ids(&mut s.client, &events).await;
    let sink = ScriptedSink::new(kafka(&broker.addr(), &[]));
    // Runs of 500: 1,200 is in the third run, 2,300 in the fifth.
    sink.fail(ids[1200], 1, counted());
    sink.fail(
        ids[2300],
        1,
        Failure::Transient {
            error: "scripted outage".into(),
        },
    );
    let mut relay = short_runs(sink.clone(), &s);
    let stats = relay.stats();
    let r = relay.cycle().await.unwrap();
    assert_eq!((r.delivered, r.retried), (1200, 1), "{r:?}");
    assert_eq!(stats.continued.load(Ordering::Relaxed), 2, "runs 2 and 3");
    let failed = ev(&s.app.store, ids[1200]).await;
    assert_eq!((failed.status, failed.attempts), (Status::Pending, 1));
    let behind = ev(&s.app.store, ids[1201]).await;
    assert_eq!((behind.status, behind.attempts), (Status::Pending, 0));
    assert!(
        !sink.seen().contains(&ids[1201]),
        "nothing after the failure was sent"
    );
    let r = relay.cycle().await.unwrap();
    assert_eq!(r.delivered, 1100, "up to the transient failure: {r:?}");
    assert!(r.transient, "{r:?}");
    let outage = ev(&s.app.store, ids[2300]).await;
    assert_eq!(
        (outage.status, outage.attempts),
        (Status::Pending, 0),
        "a transient failure spends nothing"
    );
    let mut cycles = 2;
    while s.outbox_count(Some(Status::Pending)).await > 0 {
        relay.cycle().await.unwrap();
        cycles += 1;
        assert!(cycles < 20, "did not drain");
    }
    let records = consume(&broker.addr(), "continued-f", 3000, Duration::from_secs(30));
    let want: Vec<String> = (0..3000).map(|i| i.to_string()).collect();
    assert_eq!(payloads_of(&records, "deep"), want, "once each, in order");
    assert_no_gaps(&[stats]);
    s.app.stop().await.unwrap();
}

/// Through the binary with its defaults: a key 12,000 deep, stored with the relays off,
/// drains after a restart in one claim's run of 5,000 and continued runs (the metrics page
/// counts them: the continuation fired), every event read back once and in order.
#[tokio::test]
async fn the_binary_drains_a_deep_key_in_continued_runs() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let start = |relays: Option<&str>| {
        let (port, metrics) = (free_port(), free_port());
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"));
        cmd.env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
            .env("MAILROOM_METRICS_LISTEN", format!("127.0.0.1:{metrics}"))
            .env("MAILROOM_DATABASE_URL", &url)
            .env("MAILROOM_KAFKA_BROKERS", broker.addr())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if let Some(n) = relays {
            cmd.env("MAILROOM_RELAYS", n);
        }
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let metrics: std::net::SocketAddr = format!("127.0.0.1:{metrics}").parse().unwrap();
        (cmd.spawn().unwrap(), addr, metrics)
    };
    let connect = |addr: std::net::SocketAddr| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match tonic::transport::Channel::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
            {
                Ok(c) => break OutboxClient::new(c),
                Err(_) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("mailroom did not start: {e}"),
            }
        }
    };
    let (mut fill, addr, _) = start(Some("0"));
    let events: Vec<pb::Event> = (0..12_000)
        .map(|i| event("binary.deep", "k", format!("{i}").as_bytes()))
        .collect();
    enqueue_ids(&mut connect(addr).await, &events).await;
    let _ = fill.kill();
    let _ = fill.wait();

    let (mut run, addr, metrics) = start(None);
    connect(addr).await;
    let records = consume(
        &broker.addr(),
        "binary.deep",
        12_000,
        Duration::from_secs(60),
    );
    let want: Vec<String> = (0..12_000).map(|i| i.to_string()).collect();
    assert_eq!(payloads_of(&records, "k"), want, "once each, in order");
    let page = scrape(metrics).await;
    let continued = sample(body(&page), "mailroom_relay_continued_runs_total");
    assert!(continued >= 1.0, "continued runs: {continued}");
    let _ = run.kill();
    let _ = run.wait();
}

/// Marks every event delivered and notes when each was handed over, by payload.
#[derive(Default)]
struct TimedSink {
    at: Mutex<HashMap<String, std::time::Instant>>,
}

impl TimedSink {
    fn when(&self, payload: &str) -> Option<std::time::Instant> {
        self.at.lock().unwrap().get(payload).copied()
    }
    async fn wait_for(&self, payload: &str) -> std::time::Instant {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(t) = self.when(payload) {
                return t;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{payload} never delivered"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[async_trait::async_trait]
impl Sink for TimedSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        let now = std::time::Instant::now();
        let mut at = self.at.lock().unwrap();
        for e in lines.iter().flatten() {
            at.insert(String::from_utf8(e.payload.clone()).unwrap(), now);
        }
        lines
            .iter()
            .map(|l| vec![Delivery::Delivered; l.len()])
            .collect()
    }
}

/// Two relays sharing a `ClaimCadence` space their claims between them: after one
/// relay's claim that took all there was, the other's next claim waits half the spacing
/// from it, so under a trickle their claims alternate rather than fall together (one
/// relay right after the other, then both a whole spacing later). Spacing 4 s so the
/// bounds hold on a loaded machine; polls off. B claims a second after A: had B's own
/// spacing ended just after A's next claim began (B claimed right after A), B's timer
/// could fire while A's claim was still running, find nothing, leave B idle, and B took
/// "d" at once (the suite saw "d" 42 ms after "c").
#[tokio::test]
async fn relays_sharing_a_cadence_alternate_their_spaced_claims() {
    let mut s = accept_only().await;
    let sink = Arc::new(TimedSink::default());
    let spacing = Duration::from_millis(4000);
    let cadence = mailroom::relay::ClaimCadence::new(2);
    let config = RelayConfig {
        poll_interval: Duration::from_secs(60),
        claim_spacing: spacing,
        ..relay_config(Duration::ZERO)
    };
    let relay = |c: &Arc<mailroom::relay::ClaimCadence>| {
        Relay::new(s.app.store.clone(), sink.clone(), Queue::Outbox, config).with_cadence(c)
    };
    let (a, b) = (relay(&cadence), relay(&cadence));
    let (wake_a, wake_b) = (a.waker(), b.waker());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = [
        tokio::spawn(a.run(shutdown.clone())),
        tokio::spawn(b.run(shutdown.clone())),
    ];
    // Both first claims find nothing. Relay A claims "a"; relay B, idle, claims "b" a
    // second later, at once: both are now spaced, B's from a second after A's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    enqueue(&mut s.client, event("cadence", "ka", b"a")).await;
    wake_a.notify_one();
    let at_a = sink.wait_for("a").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    enqueue(&mut s.client, event("cadence", "kb", b"b")).await;
    let woke = std::time::Instant::now();
    wake_b.notify_one();
    let at_b = sink.wait_for("b").await;
    assert!(
        at_b - woke < Duration::from_secs(1),
        "idle B took {:?}",
        at_b - woke
    );
    // "c" goes with A's next claim, a spacing after its first.
    enqueue(&mut s.client, event("cadence", "kc", b"c")).await;
    wake_a.notify_one();
    wake_b.notify_one();
    let at_c = sink.wait_for("c").await;
    // Spacing runs from claim to claim; the sink sees each a delivery later, which a
    // loaded machine stretches more for "a" than for "c" (hence the margin).
    assert!(
        at_c - at_a >= spacing - Duration::from_millis(100),
        "c came {:?} after a",
        at_c - at_a
    );
    // B's own spacing ends a second after `at_c`, but A claimed at `at_c`: B waits half
    // a spacing from that (without the cadence it claims "d" a second after "c").
    enqueue(&mut s.client, event("cadence", "kd", b"d")).await;
    wake_a.notify_one();
    wake_b.notify_one();
    let at_d = sink.wait_for("d").await;
    let half = spacing / 2;
    // Measured at the sink: a claim's delivery may lag it by a few hundred ms on a
    // loaded machine, more for one claim than the next (hence the margin; without the
    // cadence "d" comes a second after "c").
    assert!(
        at_d - at_c >= half - Duration::from_millis(500),
        "d came {:?} after c, under half a spacing",
        at_d - at_c
    );
    assert!(
        at_d - at_c < spacing - Duration::from_millis(100),
        "d came {:?} after c: a whole spacing, not half",
        at_d - at_c
    );
    shutdown.cancel();
    for r in running {
        r.await.unwrap();
    }
    s.app.stop().await.unwrap();
}

/// Claim spacing (`RelayConfig::claim_spacing`): after a claim that took all there was,
/// the relay's next claim waits out the spacing from that claim's start, whatever wakes
/// it; an idle relay, and one whose claim hit a limit, claim at once. Spacing here is
/// 1.5 s so that the bounds hold on a loaded machine; polls are off (60 s).
#[tokio::test]
async fn a_relay_spaces_its_claims_unless_a_claim_hit_a_limit() {
    let mut s = accept_only().await;
    let sink = Arc::new(TimedSink::default());
    let spacing = Duration::from_millis(1500);
    let relay = Relay::new(
        s.app.store.clone(),
        sink.clone(),
        Queue::Outbox,
        RelayConfig {
            batch_size: 2,
            poll_interval: Duration::from_secs(60),
            claim_spacing: spacing,
            ..relay_config(Duration::ZERO)
        },
    );
    let wake = relay.waker();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(relay.run(shutdown.clone()));
    // The relay's first claim finds nothing: the next one is not spaced from it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    enqueue(&mut s.client, event("spaced", "a", b"a")).await;
    let woke = std::time::Instant::now();
    wake.notify_one();
    let a = sink.wait_for("a").await;
    assert!(
        a - woke < Duration::from_secs(1),
        "an idle relay took {:?} to claim",
        a - woke
    );
    // That claim took all there was: a wake-up now is held until the spacing has passed
    // since it began (after `woke`).
    enqueue(&mut s.client, event("spaced", "b", b"b")).await;
    wake.notify_one();
    let b = sink.wait_for("b").await;
    assert!(
        b - woke >= spacing - Duration::from_millis(20),
        "the second claim came {:?} after the first was woken",
        b - woke
    );
    // Idle again (past the spacing). Three keys with cycles of 2 events: the first claim
    // hits its limit, so the third event is claimed at once after it, not a spacing later.
    tokio::time::sleep(spacing + Duration::from_millis(200)).await;
    for k in ["c1", "c2", "c3"] {
        enqueue(&mut s.client, event("spaced", k, k.as_bytes())).await;
    }
    let woke = std::time::Instant::now();
    wake.notify_one();
    for k in ["c1", "c2", "c3"] {
        let t = sink.wait_for(k).await;
        assert!(
            t - woke < Duration::from_secs(1),
            "{k} came {:?} after the wake-up",
            t - woke
        );
    }
    shutdown.cancel();
    running.await.unwrap();
    s.app.stop().await.unwrap();
}

//! A deep key that goes on run after run without a new claim (docs/relay.md, "A deep key
//! goes on without a new claim"), under the faults that can strike a continued run while
//! the next window is already read: a broker that goes silent past the delivery
//! deadline, and a broker that refuses a batch. Real PostgreSQL, tansu behind a TCP or
//! Kafka-protocol proxy, read back by an independent consumer.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mailroom::domain::{Queue, Status};
use mailroom::pb;
use mailroom::relay::backoff::RetryPolicy;
use mailroom::relay::{Relay, RelayConfig, RelayStats};
use mailroom::sink::kafka::{KafkaSink, producer_config};
use tokio_util::sync::CancellationToken;

use crate::relay::{accept_only, enqueue_ids, ev};
use crate::support::faults::{Verdict, consume_all};
use crate::support::kafka_proxy::{INVALID_RECORD, KafkaProxy};
use crate::support::proxy::Proxy;
use crate::support::*;

/// A relay over `s`'s outbox publishing through `brokers` with a delivery deadline of
/// `deadline`, default runs (a claim's run of 1,000, continued runs after it), retries
/// soon and often.
fn relay(s: &Service, brokers: &str, deadline: Duration) -> Relay {
    leased_relay(s, brokers, deadline, Duration::from_secs(30))
}

/// [`relay`] with a lease of `lease` (longer than `deadline`).
pub(crate) fn leased_relay(
    s: &Service,
    brokers: &str,
    deadline: Duration,
    lease: Duration,
) -> Relay {
    let sink = KafkaSink::new(
        producer_config(brokers, deadline, &Default::default()),
        "mailroom-test".into(),
        deadline,
    )
    .unwrap();
    Relay::new(
        s.app.store.clone(),
        Arc::new(sink),
        Queue::Outbox,
        RelayConfig {
            lease,
            probe_max: Duration::from_millis(500),
            retry: RetryPolicy {
                base: Duration::from_millis(100),
                cap: Duration::from_secs(1),
                max_attempts: 100,
            },
            ..RelayConfig::default()
        },
    )
}

/// Waits until `stats` counts more than `above` continued runs; false after `within`.
pub(crate) async fn continued_past(stats: &RelayStats, above: u64, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if stats.continued.load(Ordering::Relaxed) > above {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    false
}

/// Events of one key, numbered in their payloads.
pub(crate) fn deep(topic: &str, n: usize) -> Vec<pb::Event> {
    (0..n)
        .map(|i| event(topic, "deep", format!("{i}").as_bytes()))
        .collect()
}

/// Pending events of the outbox, polled until none is left; false after `within`.
pub(crate) async fn drained(s: &Service, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if s.outbox_count(Some(Status::Pending)).await == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// The broker connection goes silent (a proxy holds every byte, nothing is closed) past
/// the delivery deadline while a deep key's continued runs are in flight, twice. The run
/// that outlives its deadline ends the line (its records stay queued in the producer,
/// and go again after it): read back, every event is there, the first copies in order,
/// no attempt is spent and nothing is flagged as published after a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_broker_under_runs_in_flight_loses_and_reorders_nothing() {
    let broker_port = free_port();
    let proxy = Arc::new(Proxy::start(format!("127.0.0.1:{broker_port}")).await);
    let broker = Broker::start_advertising(broker_port, &proxy.addr());
    let mut s = accept_only().await;
    let topic = "continued-stalls";
    let ids = enqueue_ids(&mut s.client, &deep(topic, 20_000)).await;
    let relay = relay(&s, &proxy.addr(), Duration::from_millis(1000));
    let stats = relay.stats();
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone()));
    let mut seen = 0;
    for round in 0..2 {
        assert!(
            continued_past(&stats, seen + 2, Duration::from_secs(60)).await,
            "round {round}: the line went on in continued runs"
        );
        proxy.stall();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        proxy.unstall();
        seen = stats.continued.load(Ordering::Relaxed);
    }
    assert!(drained(&s, Duration::from_secs(120)).await, "drained");
    stop.cancel();
    running.await.unwrap();
    let records = consume_all(&broker.addr(), topic, ids.len(), Duration::from_secs(60)).await;
    let acked: Vec<(String, i64)> = ids.iter().map(|id| ("deep".to_string(), *id)).collect();
    let v = Verdict::of(&acked, &records);
    let transient_events = stats.transient_events.load(Ordering::Relaxed);
    let gaps = stats.delivered_after_failure.load(Ordering::Relaxed);
    eprintln!(
        "silent broker under continued runs: {} continued runs, {} chunks held by the proxy, \
         {transient_events} events came back transient, {} read back, {} duplicates, {gaps} \
         delivered after a failure",
        stats.continued.load(Ordering::Relaxed),
        proxy.held_chunks.load(Ordering::Relaxed),
        v.delivered,
        v.duplicates,
    );
    // The faults fired: the stalls held traffic and deliveries outlived their deadline.
    assert!(
        proxy.held_chunks.load(Ordering::Relaxed) >= 2,
        "stalls held traffic"
    );
    assert!(
        transient_events > 0,
        "some deliveries outlived the deadline"
    );
    v.assert_sound("silent broker under continued runs");
    assert_eq!(v.delivered, ids.len());
    assert_eq!(
        gaps, 0,
        "nothing published after an earlier event of its key failed"
    );
    let spent = (
        stats.retried.load(Ordering::Relaxed),
        stats.failed.load(Ordering::Relaxed),
    );
    assert_eq!(spent, (0, 0), "a silent broker spends no attempt");
    for id in [ids[0], ids[ids.len() / 2], ids[ids.len() - 1]] {
        let e = ev(&s.app.store, id).await;
        assert_eq!(
            (e.status, e.attempts),
            (Status::Completed, 0),
            "no attempt spent"
        );
    }
    drop(broker);
    s.app.stop().await.unwrap();
}

/// The broker refuses the batch holding one event 1,100 deep in a key's backlog, in a
/// continued run: the refused event alone spends its attempts until
/// `failed`; the events around it spend none; the broker holds every other event once,
/// in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_under_runs_in_flight_spends_only_the_refused_event() {
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    proxy.refuse_marker(b"POISON", INVALID_RECORD);
    let mut s = accept_only().await;
    let topic = "continued-refusals";
    // In the first continued run (after the claim's run of 1,000), with a run behind it;
    // the 899 events behind it go one at a time once the topic is narrowed (docs/relay.md,
    // "Broker refusals").
    let poison = 1_100;
    let mut events = deep(topic, 2_000);
    for e in &mut events {
        e.max_attempts = 3;
    }
    events[poison].payload = format!("{poison}-POISON").into_bytes();
    let ids = enqueue_ids(&mut s.client, &events).await;
    let relay = relay(&s, &proxy.addr(), Duration::from_secs(10));
    let stats = relay.stats();
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone()));
    assert!(drained(&s, Duration::from_secs(120)).await, "drained");
    stop.cancel();
    running.await.unwrap();
    eprintln!(
        "refusal under continued runs: {} cycles, {} continued runs, {} batches refused, {} \
         answered OUT_OF_ORDER_SEQUENCE_NUMBER behind them",
        stats.cycles.load(Ordering::Relaxed),
        stats.continued.load(Ordering::Relaxed),
        proxy.refusals(),
        proxy.out_of_order()
    );
    // The faults fired, on a line that went on past its first run.
    assert!(proxy.refusals() >= 3, "refusals: {}", proxy.refusals());
    assert!(
        stats.continued.load(Ordering::Relaxed) >= 1,
        "the refused event was in a continued run"
    );
    let spent = (
        stats.retried.load(Ordering::Relaxed),
        stats.failed.load(Ordering::Relaxed),
    );
    assert_eq!(
        spent,
        (2, 1),
        "the refused event's three attempts, nothing else"
    );
    let refused = ev(&s.app.store, ids[poison]).await;
    assert_eq!((refused.status, refused.attempts), (Status::Failed, 3));
    for (i, id) in ids.iter().enumerate().filter(|(i, _)| *i != poison) {
        if i % 97 == 0 || i.abs_diff(poison) < 600 {
            let e = ev(&s.app.store, *id).await;
            assert_eq!((e.status, e.attempts), (Status::Completed, 0), "event {i}");
        }
    }
    assert_eq!(
        s.outbox_count(Some(Status::Completed)).await,
        ids.len() as i64 - 1
    );
    let records = consume(
        &broker.addr(),
        topic,
        ids.len() - 1,
        Duration::from_secs(60),
    );
    let want: Vec<String> = (0..ids.len())
        .filter(|i| *i != poison)
        .map(|i| i.to_string())
        .collect();
    let got: Vec<String> = records
        .iter()
        .map(|r| String::from_utf8(r.payload.clone()).unwrap())
        .collect();
    assert_eq!(got, want, "every other event once, in order");
    assert_eq!(stats.delivered_after_failure.load(Ordering::Relaxed), 0);
    s.app.stop().await.unwrap();
}

//! A broker-side refusal of one record (issue 23, item 4), through the Kafka protocol
//! proxy over tansu: the proxy refuses every batch holding a marker, as Kafka refuses a
//! batch whole for one bad record (KIP-467), and keeps the idempotent producer's
//! sequence rules (a later batch of the partition is not appended behind the refusal).

use std::sync::Arc;
use std::time::Duration;

use mailroom::domain::{Queue, Status};
use mailroom::relay::Relay;
use mailroom::sink::kafka::{KafkaSink, producer_config};

use crate::relay::{accept_only, ev, relay_config};
use crate::support::kafka_proxy::{INVALID_RECORD, KafkaProxy};
use crate::support::*;

const TIMEOUT: Duration = Duration::from_secs(10);

/// A run m0, m1, m2 of one key where the broker refuses only m1: m0 is published with
/// one attempt, m1 alone spends attempts until `failed`, m2 is published after m0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_record_spends_its_own_attempts_and_nothing_else() {
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    proxy.refuse_marker(b"POISON", INVALID_RECORD);
    let mut s = accept_only().await;
    let mut ids = Vec::new();
    for p in ["m0", "m1-POISON", "m2"] {
        let mut e = event("refusals", "k", p.as_bytes());
        e.max_attempts = 3;
        ids.push(enqueue(&mut s.client, e).await);
    }
    let sink = KafkaSink::new(
        producer_config(&proxy.addr(), TIMEOUT, &Default::default()),
        "mailroom-test".into(),
        TIMEOUT,
    )
    .unwrap();
    let mut relay = Relay::new(
        s.app.store.clone(),
        Arc::new(sink),
        Queue::Outbox,
        relay_config(Duration::ZERO),
    );
    for _ in 0..30 {
        relay.cycle().await.unwrap();
        let last = ev(&s.app.store, ids[2]).await;
        if last.status != Status::Pending {
            break;
        }
    }
    assert!(
        proxy.refusals() >= 3,
        "the fault fired: {}",
        proxy.refusals()
    );
    eprintln!(
        "broker refusal: {} batches refused, {} behind them answered OUT_OF_ORDER_SEQUENCE_NUMBER",
        proxy.refusals(),
        proxy.out_of_order()
    );
    let got: Vec<_> = statuses(&s, &ids).await;
    assert_eq!(
        &got[..2],
        &[(Status::Completed, 1), (Status::Failed, 3)],
        "m0, m1: (status, attempts)"
    );
    assert_eq!(got[2].0, Status::Completed, "m2 published: {got:?}");
    assert!(got[2].1 <= 1, "m2 spent no attempt of its own: {got:?}");
    let records = consume(&broker.addr(), "refusals", 2, Duration::from_secs(20));
    let payloads: Vec<_> = records.iter().map(|r| r.payload.clone()).collect();
    assert_eq!(
        payloads,
        vec![b"m0".to_vec(), b"m2".to_vec()],
        "in key order"
    );
    s.app.stop().await.unwrap();
}

/// (status, attempts) of each event.
async fn statuses(s: &Service, ids: &[i64]) -> Vec<(Status, u32)> {
    let mut out = Vec::new();
    for id in ids {
        let e = ev(&s.app.store, *id).await;
        out.push((e.status, e.attempts as u32));
    }
    out
}

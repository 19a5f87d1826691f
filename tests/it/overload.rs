//! Under load: shedding past the concurrency limit without losing anything, an
//! exhausted pool answered quickly, oversized messages refused by the transport.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::*;
use mailroom::domain::BoxKind;
use mailroom::pb;
use mailroom::pb::outbox_service_client::OutboxServiceClient;
use tonic::Code;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Far more concurrent callers than the server admits: every answer is OK,
/// RESOURCE_EXHAUSTED or UNAVAILABLE, refusals come fast, every OK is stored, and memory
/// stays bounded.
#[tokio::test]
async fn overload_sheds_fast_and_loses_nothing() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.overload.max_concurrent_rpcs = 8;
    c.intake.queue_depth = 16;
    c.intake.writers = 2;
    c.database_max_connections = 4;
    let s = Service::start(c).await;
    let addr = s.app.addr;
    let rss_before = rss_kib();

    let callers = 128;
    let until = Instant::now() + Duration::from_secs(4);
    let slowest_refusal = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..callers {
        let slowest = slowest_refusal.clone();
        // A channel per 8 callers: many HTTP/2 connections, many streams each.
        let ch = channel(addr).await;
        tasks.push(tokio::spawn(async move {
            let mut client = OutboxServiceClient::new(ch);
            let mut ok = Vec::new();
            let mut codes = Vec::new();
            let mut i = 0u64;
            while Instant::now() < until {
                i += 1;
                let mut e = event("load", &format!("k{}", w % 16), &[7u8; 256]);
                e.idempotency_key = format!("w{w}-{i}");
                let t = Instant::now();
                match client.enqueue(pb::EnqueueRequest { event: Some(e) }).await {
                    Ok(r) => ok.push(r.into_inner().id),
                    Err(st) => {
                        slowest.fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                        codes.push(st.code());
                    }
                }
            }
            (ok, codes)
        }));
    }
    let mut ok_ids = Vec::new();
    let mut refused = std::collections::HashMap::<Code, usize>::new();
    for t in tasks {
        let (ok, codes) = t.await.unwrap();
        ok_ids.extend(ok);
        for c in codes {
            *refused.entry(c).or_default() += 1;
        }
    }
    let rss_after = rss_kib();
    eprintln!(
        "ok={} refused={refused:?} slowest refusal={}µs rss {}→{} KiB",
        ok_ids.len(),
        slowest_refusal.load(Ordering::Relaxed),
        rss_before,
        rss_after
    );
    for c in refused.keys() {
        assert!(
            matches!(c, Code::ResourceExhausted | Code::Unavailable),
            "unexpected code {c:?}"
        );
    }
    assert!(
        refused.get(&Code::ResourceExhausted).copied().unwrap_or(0) > 0,
        "the load was meant to exceed the limit"
    );
    assert!(ok_ids.len() > 100, "the server kept serving");
    assert!(
        slowest_refusal.load(Ordering::Relaxed) < 2_000_000,
        "refusals must be quick"
    );
    // Every acknowledged event is stored.
    let distinct: HashSet<i64> = ok_ids.iter().copied().collect();
    assert_eq!(distinct.len(), ok_ids.len());
    for id in &ok_ids {
        assert!(
            s.found(BoxKind::Outbox, *id).await.is_some(),
            "acknowledged event {id} is missing"
        );
    }
    assert!(
        rss_after < rss_before + 256 * 1024,
        "memory grew without bound: {rss_before} → {rss_after} KiB"
    );
    s.app.stop().await.unwrap();
}

/// An exhausted database pool answers UNAVAILABLE within the acquire timeout and the RPC
/// timeout, instead of queueing; the service recovers when the database does.
#[tokio::test]
async fn exhausted_pool_is_unavailable_quickly() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.database_max_connections = 2;
    c.database_acquire_timeout = Duration::from_millis(300);
    c.overload.rpc_timeout = Some(Duration::from_millis(1500));
    c.intake.writers = 4;
    let mut s = Service::start(c).await;
    enqueue(&mut s.client, event("t", "k", b"warm")).await;

    // Hold a lock every insert needs: the writers' connections block on it.
    let (mut blocker, _) =
        hold_in_transaction(&url, "LOCK TABLE outbox_events IN EXCLUSIVE MODE").await;
    let mut tasks = Vec::new();
    for i in 0..12 {
        let mut client = s.client.clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = client
                .enqueue(pb::EnqueueRequest {
                    event: Some(event("t", &format!("k{i}"), b"x")),
                })
                .await;
            (code(r), t.elapsed())
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in tasks {
        let (c, took) = t.await.unwrap();
        assert_eq!(c, Code::Unavailable, "answer after {took:?}");
        assert!(took < Duration::from_secs(3), "took {took:?}");
    }
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    eventually(Duration::from_secs(10), "enqueue works again", || {
        let mut client = s.client.clone();
        async move {
            client
                .enqueue(pb::EnqueueRequest {
                    event: Some(event("t", "after", b"x")),
                })
                .await
                .is_ok()
        }
    })
    .await;
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn oversized_messages_are_refused_by_the_transport() {
    let (url, _dir) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.limits.max_payload_bytes = 1024;
    c.limits.max_batch = 1;
    let mut s = Service::start(c).await;
    let big = vec![1u8; 4 * 1024 * 1024];
    let t = Instant::now();
    let err = enqueue_err(&mut s.client, Some(event("t", "k", &big))).await;
    assert!(
        matches!(err.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{err:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(s.outbox_count(None).await, 0);
    s.app.stop().await.unwrap();
}

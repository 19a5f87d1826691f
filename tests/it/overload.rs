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

/// A process's resident memory in KiB (`VmRSS`, or `VmHWM` for its peak).
fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// The server as its own process (the binary), so that its memory is measured alone:
/// in-process, the test's clients and the other tests running beside it counted too.
struct Server {
    child: std::process::Child,
    addr: std::net::SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_server(url: &str, envs: &[(&str, &str)]) -> Server {
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"));
    cmd.env("MAILROOM_LISTEN", addr.to_string())
        .env("MAILROOM_DATABASE_URL", url)
        .env("MAILROOM_RELAYS", "0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let server = Server {
        child: cmd.spawn().unwrap(),
        addr,
    };
    eventually(Duration::from_secs(30), "the server listens", || async {
        tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .is_ok()
    })
    .await;
    server
}

/// Far more concurrent callers than the server admits: every answer is OK,
/// RESOURCE_EXHAUSTED or UNAVAILABLE, refusals come fast, every OK is stored, and memory
/// stays bounded.
#[tokio::test]
async fn overload_sheds_fast_and_loses_nothing() {
    let url = fresh_pg().await;
    let server = start_server(
        &url,
        &[
            ("MAILROOM_MAX_CONCURRENT_RPCS", "8"),
            ("MAILROOM_INTAKE_QUEUE", "16"),
            ("MAILROOM_INTAKE_WRITERS", "2"),
            ("MAILROOM_DATABASE_MAX_CONNECTIONS", "4"),
        ],
    )
    .await;
    let (addr, pid) = (server.addr, server.child.id());
    let store = mailroom::app::open_store(&config(&url)).await.unwrap();
    let rss_before = rss_kib(pid, "VmRSS:");

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
    let rss_after = rss_kib(pid, "VmHWM:");
    eprintln!(
        "ok={} refused={refused:?} slowest refusal={}µs server rss {} KiB, peak {} KiB",
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
            store
                .get_event(BoxKind::Outbox, *id)
                .await
                .unwrap()
                .is_some(),
            "acknowledged event {id} is missing"
        );
    }
    // The server's own peak, against its resident memory once it had started: the
    // queue (16 requests) and the concurrency limit (8) bound what it holds.
    assert!(
        rss_after < rss_before + 128 * 1024,
        "the server's peak grew without bound: {rss_before} → {rss_after} KiB"
    );
    drop(server);
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

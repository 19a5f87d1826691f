//! The foundation's contract, against real PostgreSQL and SQLite: round trips, batch
//! atomicity, idempotency, concurrency, validation, health and shutdown.

use std::collections::HashSet;
use std::time::Duration;

use crate::support::probe::*;
use crate::support::*;
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use tonic::Code;
use tonic_types::StatusExt;

/// A service that only accepts (no relays), so rows stay as stored.
async fn quiet_service(engine: &Engine) -> (Service, Option<tempfile::TempDir>) {
    let (s, _url, dir) = quiet_on(engine).await;
    (s, dir)
}

#[tokio::test]
async fn every_field_round_trips_byte_for_byte() {
    for engine in &ENGINES {
        let (mut s, _dir) = quiet_service(engine).await;
        let payload: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
        let after = prost_types::Timestamp {
            seconds: 1_900_000_000,
            nanos: 123_456_000,
        };
        let ev = pb::Event {
            topic: "orders.v1".into(),
            key: "clé-42 🔑".into(),
            payload: payload.clone(),
            headers: [
                ("trace".to_string(), "ünïcødé ✓".to_string()),
                ("empty".to_string(), String::new()),
            ]
            .into(),
            r#type: "order.created".into(),
            idempotency_key: "idem-1".into(),
            deliver_after: Some(after),
            max_attempts: 9,
        };
        let id = enqueue(&mut s.client, ev.clone()).await;
        let got = s.stored(BoxKind::Outbox, id).await;
        assert_eq!(got.topic, ev.topic);
        assert_eq!(got.key.as_deref(), Some(ev.key.as_str()));
        assert_eq!(got.payload, payload);
        assert_eq!(got.headers.len(), 2);
        assert_eq!(got.headers["trace"], "ünïcødé ✓");
        assert_eq!(got.headers["empty"], "");
        assert_eq!(got.event_type.as_deref(), Some("order.created"));
        assert_eq!(got.idempotency_key.as_deref(), Some("idem-1"));
        assert_eq!(got.status, Status::Pending);
        assert_eq!(got.attempts, 0);
        assert_eq!(got.max_attempts, 9);
        assert_eq!(got.scheduled_at.timestamp(), after.seconds);
        assert_eq!(got.scheduled_at.timestamp_subsec_micros(), 123_456);

        // An event without key, type or schedule stores NULLs and the default budget.
        let id2 = enqueue(&mut s.client, event("t", "", b"")).await;
        assert!(id2 > id, "ids increase in acceptance order");
        let got = s.stored(BoxKind::Outbox, id2).await;
        assert_eq!(got.key, None);
        assert_eq!(got.event_type, None);
        assert_eq!(got.max_attempts, 6);
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn a_batch_is_stored_whole_or_not_at_all() {
    for engine in &ENGINES {
        let (mut s, _dir) = quiet_service(engine).await;
        let bad = pb::EnqueueBatchRequest {
            events: vec![
                event("a", "k", b"1"),
                event("bad topic!", "k", b"2"),
                event("a", "k", b"3"),
            ],
        };
        let err = s.client.enqueue_batch(bad).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        let fields: Vec<String> = err
            .get_details_bad_request()
            .expect("bad request details")
            .field_violations
            .into_iter()
            .map(|v| v.field)
            .collect();
        assert_eq!(fields, vec!["events[1].topic"]);
        assert_eq!(s.outbox_count(None).await, 0);

        let events: Vec<pb::Event> = (0..1000)
            .map(|i| event("bulk", &format!("k{}", i % 10), format!("{i}").as_bytes()))
            .collect();
        let res = s
            .client
            .enqueue_batch(pb::EnqueueBatchRequest { events })
            .await
            .unwrap()
            .into_inner()
            .results;
        assert_eq!(res.len(), 1000);
        assert!(
            res.windows(2).all(|w| w[0].id < w[1].id),
            "ids follow batch order"
        );
        assert!(res.iter().all(|r| !r.duplicate));
        assert_eq!(s.outbox_count(None).await, 1000);

        let too_many = pb::EnqueueBatchRequest {
            events: (0..1001).map(|_| event("a", "", b"")).collect(),
        };
        let err = s.client.enqueue_batch(too_many).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(
            err.get_details_bad_request().unwrap().field_violations[0].field,
            "events"
        );
        assert_eq!(s.outbox_count(None).await, 1000);
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn idempotency_keys_make_retries_safe() {
    for engine in &ENGINES {
        let (mut s, _dir) = quiet_service(engine).await;
        let mut ev = event("pay", "acct-1", b"debit 10");
        ev.idempotency_key = "req-77".into();
        let first = enqueue_reply(&mut s.client, ev.clone()).await;
        assert!(!first.duplicate);
        let again = enqueue_reply(&mut s.client, ev.clone()).await;
        assert_eq!(again.id, first.id);
        assert!(again.duplicate);
        assert_eq!(s.outbox_count(None).await, 1);

        let mut other = ev.clone();
        other.payload = b"debit 20".to_vec();
        let err = enqueue_err(&mut s.client, Some(other.clone())).await;
        assert_eq!(err.code(), Code::AlreadyExists);

        // In a batch, a conflict rolls back the whole batch; a duplicate does not.
        let batch = pb::EnqueueBatchRequest {
            events: vec![event("pay", "acct-2", b"x"), other],
        };
        assert_eq!(
            s.client.enqueue_batch(batch).await.unwrap_err().code(),
            Code::AlreadyExists
        );
        assert_eq!(s.outbox_count(None).await, 1);
        let batch = pb::EnqueueBatchRequest {
            events: vec![event("pay", "acct-2", b"x"), ev],
        };
        let r = s
            .client
            .enqueue_batch(batch)
            .await
            .unwrap()
            .into_inner()
            .results;
        assert!(!r[0].duplicate);
        assert_eq!((r[1].id, r[1].duplicate), (first.id, true));
        assert_eq!(s.outbox_count(None).await, 2);

        // Concurrent retries of one request store it once.
        let mut ev = event("pay", "acct-3", b"credit");
        ev.idempotency_key = "req-race".into();
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let mut c = s.client.clone();
            let ev = ev.clone();
            tasks.push(tokio::spawn(async move {
                c.enqueue(pb::EnqueueRequest { event: Some(ev) })
                    .await
                    .unwrap()
                    .into_inner()
            }));
        }
        let answers: Vec<pb::EnqueueResponse> = futures::future::join_all(tasks)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let ids: HashSet<i64> = answers.iter().map(|a| a.id).collect();
        assert_eq!(ids.len(), 1);
        assert_eq!(answers.iter().filter(|a| !a.duplicate).count(), 1);
        assert_eq!(s.outbox_count(None).await, 3);
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn concurrent_enqueues_are_all_committed() {
    for engine in &ENGINES {
        let (s, _dir) = quiet_service(engine).await;
        let mut tasks = Vec::new();
        for c in 0..64 {
            let mut client = s.client.clone();
            tasks.push(tokio::spawn(async move {
                let n = if c < 16 { 32 } else { 31 }; // 16*32 + 48*31 = 2000
                let mut ids = Vec::new();
                for i in 0..n {
                    let key = format!("k{}", (c * 7 + i) % 50);
                    ids.push(enqueue(&mut client, event("load", &key, b"x")).await);
                }
                ids
            }));
        }
        let mut ids = Vec::new();
        for t in tasks {
            ids.extend(t.await.unwrap());
        }
        assert_eq!(ids.len(), 2000);
        let distinct: HashSet<i64> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), 2000);
        assert_eq!(s.outbox_count(None).await, 2000);
        for id in ids.iter().step_by(97) {
            assert!(s.found(BoxKind::Outbox, *id).await.is_some());
        }
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn invalid_input_names_the_field_and_stores_nothing() {
    let (mut s, _dir) = quiet_service(&Engine::Sqlite).await;
    let ok = || event("t", "k", b"p");
    let cases: Vec<(&str, pb::Event)> = vec![
        (
            "event.topic",
            pb::Event {
                topic: String::new(),
                ..ok()
            },
        ),
        (
            "event.topic",
            pb::Event {
                topic: "x".repeat(250),
                ..ok()
            },
        ),
        (
            "event.topic",
            pb::Event {
                topic: "has space".into(),
                ..ok()
            },
        ),
        (
            "event.topic",
            pb::Event {
                topic: "slash/no".into(),
                ..ok()
            },
        ),
        (
            "event.payload",
            pb::Event {
                payload: vec![0; 1024 * 1024 + 1],
                ..ok()
            },
        ),
        (
            "event.headers",
            pb::Event {
                headers: (0..65).map(|i| (format!("h{i}"), String::new())).collect(),
                ..ok()
            },
        ),
        (
            "event.headers",
            pb::Event {
                headers: [("big".to_string(), "v".repeat(17 * 1024))].into(),
                ..ok()
            },
        ),
        (
            "event.key",
            pb::Event {
                key: "k".repeat(1025),
                ..ok()
            },
        ),
        (
            "event.deliver_after",
            pb::Event {
                deliver_after: Some(prost_types::Timestamp {
                    seconds: 1,
                    nanos: -5,
                }),
                ..ok()
            },
        ),
        (
            "event.deliver_after",
            pb::Event {
                deliver_after: Some(prost_types::Timestamp {
                    seconds: i64::MAX,
                    nanos: 0,
                }),
                ..ok()
            },
        ),
        (
            "event.max_attempts",
            pb::Event {
                max_attempts: 101,
                ..ok()
            },
        ),
    ];
    for (field, ev) in cases {
        let err = enqueue_err(&mut s.client, Some(ev)).await;
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        let v = err.get_details_bad_request().expect("field violations");
        assert!(
            v.field_violations.iter().any(|f| f.field == field),
            "{field} not named in {:?}",
            v.field_violations
        );
    }
    let err = enqueue_err(&mut s.client, None).await;
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = s
        .client
        .enqueue_batch(pb::EnqueueBatchRequest { events: vec![] })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(s.outbox_count(None).await, 0);
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn health_follows_the_database() {
    const SERVING: i32 = 1;
    const NOT_SERVING: i32 = 2;
    let url = fresh_pg().await;
    // Point the service at PostgreSQL through a proxy we can cut.
    let pg_proxy = proxy::Proxy::start("127.0.0.1:5432".into()).await;
    let proxied = url.replacen("127.0.0.1:5432", &pg_proxy.addr(), 1);
    assert_ne!(proxied, url);
    let s = Service::start(quiet_config(&proxied)).await;
    let addr = s.app.addr;
    assert_eq!(health_status(addr, "").await, Some(SERVING));
    assert_eq!(
        health_status(addr, "mailroom.v1.OutboxService").await,
        Some(SERVING)
    );

    pg_proxy.cut();
    let what = "NOT_SERVING while the database is gone";
    wait_health(addr, NOT_SERVING, Duration::from_secs(10), what).await;
    assert_eq!(
        health_status(addr, "mailroom.v1.OutboxService").await,
        Some(NOT_SERVING)
    );
    // Enqueue fails cleanly (never OK without a commit).
    let mut client = s.client.clone();
    let err = client
        .enqueue(pb::EnqueueRequest {
            event: Some(event("t", "k", b"x")),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    pg_proxy.restore();
    let what = "SERVING once the database is back";
    wait_health(addr, SERVING, Duration::from_secs(15), what).await;
    enqueue(&mut client, event("t", "k", b"x")).await;
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn shutdown_never_acknowledges_an_uncommitted_event() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let c = quiet_config(&url);
        let s = Service::start(c.clone()).await;
        let mut tasks = Vec::new();
        for w in 0..32 {
            let mut client = s.client.clone();
            tasks.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                let mut failures = Vec::new();
                for i in 0..10_000 {
                    match client
                        .enqueue(pb::EnqueueRequest {
                            event: Some(event("sd", &format!("w{w}"), format!("{i}").as_bytes())),
                        })
                        .await
                    {
                        Ok(r) => acked.push(r.into_inner().id),
                        Err(e) => {
                            failures.push(e.code());
                            break;
                        }
                    }
                }
                (acked, failures)
            }));
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        let store = s.app.store.clone();
        s.app.stop().await.unwrap();
        let mut acked = Vec::new();
        for t in tasks {
            let (a, f) = t.await.unwrap();
            acked.extend(a);
            for code in f {
                assert!(
                    matches!(code, Code::Unavailable | Code::Cancelled | Code::Unknown),
                    "unclean failure during shutdown: {code:?}"
                );
            }
        }
        assert!(!acked.is_empty());
        for id in &acked {
            assert!(
                store
                    .get_event(BoxKind::Outbox, *id)
                    .await
                    .unwrap()
                    .is_some(),
                "event {id} was acknowledged but is not stored"
            );
        }
    }
}

#[test]
fn a_bad_setting_exits_64_naming_it() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .env("MAILROOM_LISTEN", "not-an-address")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("MAILROOM_LISTEN"), "{err}");
    assert_eq!(err.lines().count(), 1, "one clear line: {err}");
}

#[test]
fn sigterm_stops_the_binary_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("m.db").display()),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(std::time::Instant::now() < deadline, "binary did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = child.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

//! The polyglot contract: a Python `grpcio` client, with stubs generated from `proto/` at
//! test time, enqueues events and runs the standard health check.

#![allow(clippy::unwrap_used)] // a panic is how a test fails

mod common;

use common::*;
use mailroom::domain::BoxKind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_grpcio_client_enqueues_and_checks_health() {
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.relays = 0;
    let s = Service::start(c).await;
    let root = env!("CARGO_MANIFEST_DIR");
    let addr = s.app.addr.to_string();
    let out = tokio::process::Command::new("python3")
        .arg(format!("{root}/tests/python/outbox_client.py"))
        .arg(&addr)
        .arg(format!("{root}/proto"))
        .output()
        .await
        .expect("python3 is required (scripts/test.sh installs grpcio)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    let id = seen["id"].as_i64().unwrap();
    let stored = s
        .app
        .store
        .get_event(BoxKind::Outbox, id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.topic, "py.orders");
    assert_eq!(stored.key.as_deref(), Some("py-key-1"));
    assert_eq!(stored.payload, (0..=255u8).collect::<Vec<u8>>());
    assert_eq!(stored.headers["note"], "héllo");
    assert_eq!(stored.event_type.as_deref(), Some("order.created"));
    // One row for the two identical requests, plus the batch of three.
    assert_eq!(
        s.app
            .store
            .count_events(BoxKind::Outbox, None)
            .await
            .unwrap(),
        4
    );
    s.app.stop().await.unwrap();
}

/// `examples/python/producer.py` runs as documented: it enqueues (a retry is a duplicate)
/// and reads the `ErrorInfo` reason and `BadRequest` fields of a refused event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_producer_example_runs() {
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.relays = 0;
    let s = Service::start(c).await;
    let root = env!("CARGO_MANIFEST_DIR");
    let out = tokio::process::Command::new("python3")
        .arg(format!("{root}/examples/python/producer.py"))
        .arg(s.app.addr.to_string())
        .arg(format!("{root}/proto"))
        .output()
        .await
        .expect("python3 is required (scripts/test.sh installs grpcio-status)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "producer example failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    let stored = s
        .app
        .store
        .get_event(BoxKind::Outbox, seen["id"].as_i64().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.topic, "examples.orders");
    assert_eq!(seen["invalid"]["code"], "INVALID_ARGUMENT");
    assert_eq!(seen["invalid"]["reason"], "INVALID_ARGUMENT");
    assert_eq!(seen["invalid"]["domain"], "mailroom.v1");
    assert_eq!(seen["invalid"]["fields"][0], "event.topic");
    s.app.stop().await.unwrap();
}

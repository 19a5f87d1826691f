//! Records other teams' producers write reach the handler, and nothing read from the
//! wire stops a subscription (issue 23, item 1): header names and values that are not
//! UTF-8 (written raw by kafka-python, as Go clients do), a header name holding a NUL,
//! binary keys, a record with neither key nor value, a null header value. And whatever
//! still goes wrong in a consumer task is contained: the record is stored `failed`, the
//! task is started again, and a task that keeps dying shows in readiness and metrics.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use mailroom::domain::admin::EventsQuery;
use mailroom::domain::{BoxKind, Status};
use mailroom::inbox::consumer::{ConsumerFaults, TASK_PANICS};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::support::probe::*;
use crate::support::*;

const SERVING: i32 = 1;
const NOT_SERVING: i32 = 2;

/// Writes records with raw header bytes through kafka-python (tests/python/raw_records.py).
fn produce_raw(brokers: &str, topic: &str, records: serde_json::Value) {
    use std::io::Write;
    let script = format!("{}/tests/python/raw_records.py", env!("CARGO_MANIFEST_DIR"));
    let mut child = std::process::Command::new("python3")
        .args([&script, brokers, topic])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 with kafka-python is required (scripts/test.sh installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(records.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "raw_records.py failed");
    let written = String::from_utf8(out.stdout).unwrap().lines().count();
    assert_eq!(
        written,
        records.as_array().unwrap().len(),
        "every raw record written"
    );
}

fn b64(b: &[u8]) -> String {
    STANDARD.encode(b)
}

/// Sends one record to partition 0 and waits for its acknowledgement.
async fn send(
    p: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    payload: Option<&[u8]>,
    headers: OwnedHeaders,
) {
    let mut r: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).partition(0).headers(headers);
    if let Some(k) = key {
        r = r.key(k);
    }
    if let Some(v) = payload {
        r = r.payload(v);
    }
    p.send(r, Duration::from_secs(10)).await.unwrap();
}

/// An ordinary binary-mode CloudEvent of another team's producer.
fn cloud_event(i: usize) -> OwnedHeaders {
    let id = i.to_string();
    OwnedHeaders::new()
        .insert(Header {
            key: "ce_id",
            value: Some(id.as_bytes()),
        })
        .insert(Header {
            key: "ce_source",
            value: Some(b"other-team".as_slice()),
        })
        .insert(Header {
            key: "ce_type",
            value: Some(b"thing.happened".as_slice()),
        })
}

async fn inbox_count(s: &Service, status: Status) -> i64 {
    s.app
        .store
        .count_events(BoxKind::Inbox, Some(status))
        .await
        .unwrap()
}

/// A broker, a handler that keeps every request, and the service with one subscription
/// `name` over the topic `name` (metrics on, `faults` injected).
async fn subscribed(name: &str, faults: ConsumerFaults) -> (Broker, Keeper, Service) {
    let broker = Broker::start();
    let handler = Keeper::default();
    let url = serve_handler(handler.clone()).await;
    let db = fresh_pg().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(1));
    c.subscriptions = vec![subscription(name, &[name], &url)];
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c.inbox_faults = faults;
    let s = Service::start(c).await;
    (broker, handler, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_records_reach_the_handler_as_bytes_and_never_stop_a_subscription() {
    let (broker, handler, s) = subscribed("foreign", ConsumerFaults::default()).await;

    // The raw records first, in one partition, so that everything after them waits
    // behind them in the log.
    produce_raw(
        &broker.addr(),
        "foreign",
        serde_json::json!([
            {"key": b64(b"\xff\x00bin"), "value": b64(b"raw-name"),
             "headers": [[b64(b"\xc3\x28bad"), b64(b"\xff")], [b64(b"dup"), b64(b"1")],
                         [b64(b"dup"), b64(b"2")]]},
            {"key": b64(b"k-value"), "value": b64(b"raw-value"),
             "headers": [[b64(b"ok"), b64(b"\xfe\xfd\x00")]]},
            {"key": null, "value": b64(b"nul-name"),
             "headers": [[b64(b"ce\x00x"), b64(b"v")]]},
        ]),
    );
    let p = raw_producer(&broker.addr());
    send(&p, "foreign", None, None, OwnedHeaders::new()).await;
    let null_value = OwnedHeaders::new().insert(Header::<&[u8]> {
        key: "nothing",
        value: None,
    });
    send(
        &p,
        "foreign",
        Some(b"\x80\x81"),
        Some(b"null-header"),
        null_value,
    )
    .await;
    for i in 0..18 {
        let key = format!("k{}", i % 3);
        let payload = format!("ok-{i}");
        send(
            &p,
            "foreign",
            Some(key.as_bytes()),
            Some(payload.as_bytes()),
            cloud_event(i),
        )
        .await;
    }

    eventually(Duration::from_secs(60), "23 records handled", || async {
        inbox_count(&s, Status::Completed).await == 23
    })
    .await;
    let calls = handler.calls();
    assert_eq!(calls.len(), 23, "each record handled once");
    let by_payload = |p: &[u8]| calls.iter().find(|c| c.payload == p).unwrap().clone();

    let raw = by_payload(b"raw-name");
    let exact: Vec<(Vec<u8>, Option<Vec<u8>>)> = raw
        .record_headers
        .iter()
        .map(|h| (h.name.clone(), h.value.clone()))
        .collect();
    assert_eq!(
        exact,
        vec![
            (b"\xc3\x28bad".to_vec(), Some(b"\xff".to_vec())),
            (b"dup".to_vec(), Some(b"1".to_vec())),
            (b"dup".to_vec(), Some(b"2".to_vec())),
        ],
        "the record's headers, exactly, in order, repeats included"
    );
    assert_eq!(raw.headers["\u{FFFD}(bad"], "\u{FFFD}", "the text view");
    assert_eq!(
        raw.headers["dup"], "2",
        "a repeated name keeps its last value"
    );
    assert!(!raw.headers.keys().any(|k| k.starts_with("mailroom-")));
    assert_eq!(raw.record_key, b"\xff\x00bin");
    assert_eq!(raw.key, "\u{FFFD}\u{FFFD}bin");

    let value = by_payload(b"raw-value");
    assert_eq!(
        value.record_headers[0].value.as_deref(),
        Some(&b"\xfe\xfd\x00"[..])
    );
    assert_eq!(value.headers["ok"], "\u{FFFD}\u{FFFD}\u{FFFD}");
    assert_eq!(value.record_key, b"k-value");

    // librdkafka gives header names as C strings: a NUL cuts the name.
    let nul = by_payload(b"nul-name");
    assert_eq!(nul.record_headers[0].name, b"ce");
    assert_eq!(nul.key, "", "no key: unordered");

    let empty = by_payload(b"");
    assert!(empty.record_headers.is_empty() && empty.record_key.is_empty());

    let null = by_payload(b"null-header");
    assert_eq!(null.record_headers[0].name, b"nothing");
    assert_eq!(null.record_headers[0].value, None, "null is not empty");
    assert_eq!(null.record_key, b"\x80\x81");

    // The ordinary events after them: all there, in order per key, typed.
    for k in 0..3 {
        let key = format!("k{k}");
        let seen: Vec<String> = calls
            .iter()
            .filter(|c| c.key == key)
            .map(|c| String::from_utf8(c.payload.clone()).unwrap())
            .collect();
        let want: Vec<String> = (0..18)
            .filter(|i| i % 3 == k)
            .map(|i| format!("ok-{i}"))
            .collect();
        assert_eq!(seen, want, "key {key} in order");
    }
    assert!(
        calls
            .iter()
            .filter(|c| c.key.starts_with('k') && c.key.len() == 2)
            .all(|c| c.r#type == "thing.happened")
    );
    assert_eq!(
        health_status(s.app.addr, "inbox/foreign").await,
        Some(SERVING)
    );
    let text = scrape(s.app.metrics_addr.unwrap()).await;
    assert_eq!(
        sample(
            &text,
            r#"mailroom_inbox_task_restarts_total{subscription="foreign",task="consumer"}"#
        ),
        0.0,
        "no task died"
    );
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_task_that_dies_is_restarted_and_readiness_and_metrics_show_it() {
    let faults = ConsumerFaults {
        record_panic: Some("poison-read".into()),
        task_panic: Some("kill-task".into()),
    };
    let (broker, handler, s) = subscribed("fragile", faults).await;
    let p = raw_producer(&broker.addr());

    // A record whose reading panics: stored failed with the reason, the rest handled.
    for payload in ["before", "poison-read", "after"] {
        send(
            &p,
            "fragile",
            Some(b"k"),
            Some(payload.as_bytes()),
            OwnedHeaders::new(),
        )
        .await;
    }
    eventually(Duration::from_secs(60), "2 handled, 1 failed", || async {
        inbox_count(&s, Status::Completed).await == 2 && inbox_count(&s, Status::Failed).await == 1
    })
    .await;
    let failed = s
        .app
        .store
        .list_events(
            BoxKind::Inbox,
            &EventsQuery {
                status: Some(Status::Failed),
                filter: Default::default(),
                page_size: 10,
                before_id: None,
            },
        )
        .await
        .unwrap();
    let why = failed.events[0]
        .event
        .last_error
        .clone()
        .unwrap_or_default();
    assert!(why.contains("injected fault: record_panic"), "{why}");
    assert!(
        why.contains("fragile:0:1"),
        "the reason names the record's place: {why}"
    );

    // A record that kills the consumer task itself, three times.
    for payload in ["kill-task", "later-1", "later-2"] {
        send(
            &p,
            "fragile",
            Some(b"k"),
            Some(payload.as_bytes()),
            OwnedHeaders::new(),
        )
        .await;
    }
    eventually(
        Duration::from_secs(60),
        "the subscription NOT_SERVING",
        || async { health_status(s.app.addr, "inbox/fragile").await == Some(NOT_SERVING) },
    )
    .await;
    assert_eq!(
        health_status(s.app.addr, "mailroom.v1.InboxService").await,
        Some(NOT_SERVING)
    );
    assert_eq!(
        health_status(s.app.addr, "").await,
        Some(SERVING),
        "the outbox does not depend on the inbox"
    );
    let text = scrape(s.app.metrics_addr.unwrap()).await;
    assert_eq!(
        sample(
            &text,
            r#"mailroom_inbox_subscription_crash_looping{subscription="fragile"}"#
        ),
        1.0
    );
    // The fault stops after TASK_PANICS deaths: the restarted consumer goes on.
    eventually(Duration::from_secs(60), "5 handled", || async {
        inbox_count(&s, Status::Completed).await == 5
    })
    .await;
    let text = scrape(s.app.metrics_addr.unwrap()).await;
    assert_eq!(
        sample(
            &text,
            r#"mailroom_inbox_task_restarts_total{subscription="fragile",task="consumer"}"#
        ),
        TASK_PANICS as f64,
        "each death counted and restarted"
    );
    let handled: Vec<Vec<u8>> = handler.calls().into_iter().map(|c| c.payload).collect();
    assert_eq!(
        handled,
        [
            &b"before"[..],
            b"after",
            b"kill-task",
            b"later-1",
            b"later-2"
        ],
        "in order, each once"
    );
    eventually(Duration::from_secs(30), "ready again", || async {
        health_status(s.app.addr, "inbox/fragile").await == Some(SERVING)
            && health_status(s.app.addr, "mailroom.v1.InboxService").await == Some(SERVING)
    })
    .await;
    s.app.stop().await.unwrap();
}

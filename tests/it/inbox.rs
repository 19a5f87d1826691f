//! The inbox against real PostgreSQL, a real broker and real gRPC handlers (Rust and
//! Python): end to end from the outbox, redelivery, every handler outcome, `Receive`.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::probe::*;
use crate::support::*;
use mailroom::config::Config;
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tonic::{Code, Status as GrpcStatus};

/// A subscriber whose answer depends on the payload's first word.
type ScriptedHandler = Recorder<FirstWord>;

#[derive(Default)]
struct FirstWord;

#[tonic::async_trait]
impl Script for FirstWord {
    async fn answer(&self, call: &Call, _seen_before: bool) -> Answer {
        use pb::handle_response::Outcome;
        let outcome = match call.payload.split(':').next().unwrap() {
            "retry-counted" => Some(Outcome::Retry(pb::HandleRetry {
                not_before: None,
                count_attempt: true,
                reason: "busy".into(),
            })),
            "retry-later" => Some(Outcome::Retry(pb::HandleRetry {
                not_before: Some(prost_types::Timestamp {
                    seconds: chrono::Utc::now().timestamp() + 3600,
                    nanos: 0,
                }),
                count_attempt: false,
                reason: "not yet".into(),
            })),
            "reject" => Some(Outcome::Reject(pb::HandleReject {
                reason: "nope".into(),
            })),
            "hang" => {
                tokio::time::sleep(Duration::from_secs(5)).await;
                None
            }
            "error" => return Err(GrpcStatus::internal("handler bug")),
            _ => Some(Outcome::Success(pb::HandleSuccess {})),
        };
        Ok(outcome)
    }
}

async fn inbox_count(s: &Service, status: Status) -> i64 {
    s.app
        .store
        .count_events(BoxKind::Inbox, Some(status))
        .await
        .unwrap()
}

fn successes_by_key(calls: &[Call]) -> HashMap<String, Vec<i64>> {
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    for c in calls {
        per_key
            .entry(c.key.clone())
            .or_default()
            .push(event_id(&c.message_id));
    }
    per_key
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_to_broker_to_handler_once_each_in_order() {
    let broker = Broker::start();
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let db = fresh_pg().await;
    let mut c: Config = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(1));
    // The shortest lease the configuration allows, so the quiet window stays short.
    c.relay.lease = Duration::from_millis(6100);
    c.subscriptions = vec![subscription("billing", &["flow"], &url)];
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let quiet = quiet_window(&c);
    let mut s = Service::start(c).await;
    let mut sent: HashMap<String, Vec<i64>> = HashMap::new();
    // The first event carries W3C trace context from its producer.
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut req = tonic::Request::new(pb::EnqueueRequest {
        event: Some(event("flow", "traced", b"ok:traced")),
    });
    req.metadata_mut()
        .insert("traceparent", tp.parse().unwrap());
    let traced = s.client.enqueue(req).await.unwrap().into_inner().id;
    sent.entry("traced".into()).or_default().push(traced);
    for i in 0..100 {
        let key = format!("acct-{}", i % 5);
        let id = enqueue(
            &mut s.client,
            event("flow", &key, format!("ok:{i}").as_bytes()),
        )
        .await;
        sent.entry(key).or_default().push(id);
    }
    eventually(Duration::from_secs(60), "101 messages handled", || async {
        inbox_count(&s, Status::Completed).await == 101
    })
    .await;
    // Nothing more may come: not from a poll, not from an expired lease.
    tokio::time::sleep(quiet).await;
    let calls = handler.calls();
    assert_eq!(calls.len(), 101, "each message handled once");
    // Trace context: stored with the event, a Kafka header, then handler metadata.
    let traced_call = calls.iter().find(|c| c.key == "traced").unwrap();
    assert_eq!(traced_call.traceparent.as_deref(), Some(tp));
    assert!(
        calls
            .iter()
            .filter(|c| c.key != "traced")
            .all(|c| c.traceparent.is_none())
    );
    let records = consume(&broker.addr(), "flow", 101, Duration::from_secs(30));
    let rec = records.iter().find(|r| r.key == "traced").unwrap();
    assert_eq!(rec.headers["traceparent"], tp);
    // The inbox's metrics saw the same flow.
    let text = scrape(s.app.metrics_addr.unwrap()).await;
    let handled = r#"mailroom_inbox_handled_total{subscription="billing",outcome="completed"}"#;
    assert_eq!(sample(&text, handled), 101.0, "{text}");
    assert!(
        sample(
            &text,
            r#"mailroom_inbox_received_total{subscription="billing"}"#
        ) >= 101.0
    );
    assert!(
        sample(
            &text,
            r#"mailroom_inbox_handle_seconds_count{subscription="billing"}"#
        ) >= 101.0
    );
    mailroom::metrics::check_histograms(body(&text)).unwrap_or_else(|p| panic!("{p:#?}"));
    assert!(calls.iter().all(|c| c.attempt == 1));
    // message_id is `ce:<n>:<ce_source>:<ce_id>`, the ce_id `<outbox event id>-<µs>`;
    // per key, handled in enqueue order.
    assert_eq!(successes_by_key(&calls), sent);
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivered_records_are_handled_once() {
    let broker = Broker::start();
    // Records from a producer that is not mailroom: no ce_id, dedup by topic:partition:offset.
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.addr())
        .create()
        .unwrap();
    // Records `ok:<i>` for i in `ids`, keys k0..k2.
    let produce = |ids: std::ops::Range<u32>| {
        let producer = producer.clone();
        async move {
            for i in ids {
                let key = format!("k{}", i % 3);
                let payload = format!("ok:{i}");
                producer
                    .send(
                        FutureRecord::to("raw").key(&key).payload(&payload),
                        Duration::from_secs(10),
                    )
                    .await
                    .unwrap();
            }
        }
    };
    produce(0..50).await;
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let db = fresh_pg().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(1));
    c.relay.lease = Duration::from_millis(6100);
    let sub = subscription("audit", &["raw"], &url);
    c.subscriptions = vec![sub.clone()];
    let quiet = quiet_window(&c);
    let s = Service::start(c.clone()).await;
    eventually(Duration::from_secs(60), "50 handled", || async {
        inbox_count(&s, Status::Completed).await == 50
    })
    .await;
    s.app.stop().await.unwrap();
    // The same group resumes from its committed offsets: five new records are all it
    // receives (without the commits it would read all 55 again).
    produce(50..55).await;
    let s = Service::start(c.clone()).await;
    eventually(Duration::from_secs(60), "55 handled", || async {
        inbox_count(&s, Status::Completed).await == 55
    })
    .await;
    let resumed = s.app.inbox.intake_stats["audit"].clone();
    tokio::time::sleep(quiet).await;
    assert_eq!(
        resumed.received.load(std::sync::atomic::Ordering::Relaxed),
        5,
        "the group resumed from its committed offsets"
    );
    s.app.stop().await.unwrap();
    // A consumer that never saw the commits (a new group) gets every record again.
    let mut again = sub.clone();
    again.group = format!("{}-redelivered", sub.group);
    c.subscriptions = vec![again];
    let s = Service::start(c).await;
    let stats = s.app.inbox.intake_stats["audit"].clone();
    eventually(Duration::from_secs(60), "55 records redelivered", || {
        let stats = stats.clone();
        async move { stats.received.load(std::sync::atomic::Ordering::Relaxed) >= 55 }
    })
    .await;
    tokio::time::sleep(quiet).await;
    assert_eq!(
        stats.duplicates.load(std::sync::atomic::Ordering::Relaxed),
        55
    );
    assert_eq!(handler.calls().len(), 55, "no message handled twice");
    assert_eq!(
        s.app
            .store
            .count_events(BoxKind::Inbox, None)
            .await
            .unwrap(),
        55
    );
    let mut ids: Vec<String> = handler.calls().into_iter().map(|c| c.message_id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 55);
    assert!(ids.iter().all(|id| id.starts_with("kafka:raw:")), "{ids:?}");
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_handler_outcome_lands_in_the_right_state() {
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let down = format!("http://127.0.0.1:{}", free_port());
    let db = fresh_pg().await;
    let mut c = quiet_config(&db);
    c.subscriptions = vec![
        subscription("outcomes", &[], &url),
        subscription("down", &[], &down),
    ];
    let s = Service::start(c).await;
    let mut ic = inbox_client(&s).await;
    let ok = receive(&mut ic, "outcomes", "m-ok", "k-ok", "ok").await.id;
    let counted = receive(&mut ic, "outcomes", "m-c", "k-c", "retry-counted")
        .await
        .id;
    let later = receive(&mut ic, "outcomes", "m-l", "k-l", "retry-later")
        .await
        .id;
    let behind = receive(&mut ic, "outcomes", "m-l2", "k-l", "ok:behind")
        .await
        .id;
    let reject = receive(&mut ic, "outcomes", "m-r", "k-r", "reject")
        .await
        .id;
    let hang = receive(&mut ic, "outcomes", "m-h", "k-h", "hang").await.id;
    let error = receive(&mut ic, "outcomes", "m-e", "k-e", "error").await.id;
    let unreachable = receive(&mut ic, "down", "m-d", "k-d", "ok").await.id;
    let store = s.app.store.clone();
    let get = |id| {
        let store = store.clone();
        async move { store.get_event(BoxKind::Inbox, id).await.unwrap().unwrap() }
    };
    eventually(Duration::from_secs(20), "every message tried", || async {
        get(ok).await.status == Status::Completed
            && get(counted).await.attempts == 1
            && get(later).await.last_error.is_some()
            && get(reject).await.status == Status::Failed
            && get(hang).await.attempts == 1
            && get(error).await.attempts == 1
    })
    .await;

    let e = get(ok).await;
    assert_eq!((e.status, e.attempts), (Status::Completed, 0));

    let e = get(counted).await;
    assert_eq!((e.status, e.attempts), (Status::Pending, 1));
    let wait = (e.scheduled_at - e.updated_at).to_std().unwrap();
    assert!(
        wait >= Duration::from_secs(30) && wait <= Duration::from_secs(60),
        "{wait:?}"
    );
    assert!(e.last_error.unwrap().contains("busy"));

    let e = get(later).await;
    assert_eq!(
        (e.status, e.attempts),
        (Status::Pending, 0),
        "an uncounted retry spends nothing"
    );
    let until = (e.scheduled_at - chrono::Utc::now()).num_seconds();
    assert!(
        (3500..=3600).contains(&until),
        "due at the handler's time: {until}"
    );
    assert!(e.last_error.unwrap().contains("not yet"));
    assert_eq!(
        get(behind).await.status,
        Status::Pending,
        "the key waits behind it"
    );
    assert!(!handler.calls().iter().any(|c| c.payload == "ok:behind"));

    let e = get(reject).await;
    assert_eq!(e.status, Status::Failed);
    assert!(e.last_error.unwrap().contains("nope"));

    let e = get(hang).await;
    assert_eq!(
        (e.status, e.attempts),
        (Status::Pending, 1),
        "a timeout counts"
    );
    assert!(e.last_error.unwrap().contains("timed out"));

    let e = get(error).await;
    assert_eq!(
        (e.status, e.attempts),
        (Status::Pending, 1),
        "other statuses count"
    );

    // The handler that is down: several cycles later, nothing spent.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let e = get(unreachable).await;
    assert_eq!(
        (e.status, e.attempts),
        (Status::Pending, 0),
        "a handler outage is transient"
    );
    assert!(e.last_error.is_none());
    assert!(
        s.app.inbox.dispatch_stats["down"]
            .transient
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn receive_deduplicates_by_message_id() {
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let db = fresh_pg().await;
    let mut c = quiet_config(&db);
    c.relay.lease = Duration::from_secs(2);
    c.subscriptions = vec![subscription("hooks", &[], &url)];
    let quiet = quiet_window(&c);
    let s = Service::start(c).await;
    let mut ic = inbox_client(&s).await;
    let first = receive(&mut ic, "hooks", "wh-1", "", "ok").await;
    let second = receive(&mut ic, "hooks", "wh-1", "", "ok").await;
    assert!(!first.duplicate);
    assert!(second.duplicate);
    assert_eq!(second.id, first.id);
    assert_eq!(
        s.app
            .store
            .count_events(BoxKind::Inbox, None)
            .await
            .unwrap(),
        1
    );
    let err = ic
        .receive(pb::ReceiveRequest {
            subscription: "nope".into(),
            message_id: "x".into(),
            topic: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = ic
        .receive(pb::ReceiveRequest {
            subscription: "hooks".into(),
            topic: "t".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let subs = ic
        .list_subscriptions(pb::ListSubscriptionsRequest {})
        .await
        .unwrap()
        .into_inner()
        .subscriptions;
    assert_eq!(subs.len(), 1);
    assert_eq!(subs[0].name, "hooks");
    assert_eq!(subs[0].max_attempts, 5);
    eventually(Duration::from_secs(10), "handled", || async {
        handler.calls().len() == 1
    })
    .await;
    tokio::time::sleep(quiet).await;
    assert_eq!(handler.calls().len(), 1, "handled once");
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_grpcio_handler_is_a_subscriber() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("handled.jsonl");
    let root = env!("CARGO_MANIFEST_DIR");
    let mut py = tokio::process::Command::new("python3")
        .arg(format!("{root}/examples/python/handler.py"))
        .arg(port.to_string())
        .arg(format!("{root}/proto"))
        .arg(&log)
        .kill_on_drop(true)
        .spawn()
        .expect("python3 is required (scripts/test.sh installs grpcio)");
    wait_listening(port, "python handler listening").await;
    let db = fresh_pg().await;
    let mut c = quiet_config(&db);
    c.subscriptions = vec![subscription("py", &[], &format!("http://127.0.0.1:{port}"))];
    let s = Service::start(c).await;
    let mut ic = inbox_client(&s).await;
    for (i, p) in ["first", "second", "third"].iter().enumerate() {
        receive(&mut ic, "py", &format!("py-{i}"), "order-1", p).await;
    }
    let rejected = receive(&mut ic, "py", "py-x", "order-2", "reject").await.id;
    eventually(Duration::from_secs(20), "python handled all", || async {
        inbox_count(&s, Status::Completed).await == 3 && inbox_count(&s, Status::Failed).await == 1
    })
    .await;
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let order1: Vec<&str> = lines
        .iter()
        .filter(|l| l["key"] == "order-1")
        .map(|l| l["payload"].as_str().unwrap())
        .collect();
    assert_eq!(order1, vec!["first", "second", "third"]);
    assert!(
        lines
            .iter()
            .all(|l| l["subscription"] == "py" && l["attempt"] == 1)
    );
    let e = s.stored(BoxKind::Inbox, rejected).await;
    assert!(e.last_error.unwrap().contains("python says no"));
    s.app.stop().await.unwrap();
    let _ = py.kill().await;
}

// ---------------------------------------------------------------------------------------
// Issue 11: guarantees under real faults. Records come from an independent rdkafka
// producer with headers of its own, as any CloudEvents producer would write them.

async fn produce(
    p: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    payload: &[u8],
    headers: &[(&str, &[u8])],
) {
    use rdkafka::message::{Header, OwnedHeaders};
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: Some(*v),
        });
    }
    let mut r = FutureRecord::<[u8], [u8]>::to(topic)
        .payload(payload)
        .headers(h);
    if let Some(k) = key {
        r = r.key(k);
    }
    p.send(r, Duration::from_secs(10)).await.unwrap();
}

async fn pg(db: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(db)
        .await
        .unwrap()
}

async fn count_where(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM inbox_events WHERE {sql}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

fn duplicates(s: &Service) -> u64 {
    s.app
        .inbox
        .intake_stats
        .values()
        .map(|x| x.duplicates.load(std::sync::atomic::Ordering::Relaxed))
        .sum()
}

/// Waits until `n` inbox messages are completed or `timeout` passes (without failing, so
/// that the test can say what it saw); returns the count.
async fn completed_within(s: &Service, n: i64, timeout: Duration) -> i64 {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let done = inbox_count(s, Status::Completed).await;
        if done >= n || std::time::Instant::now() > deadline {
            return done;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Item 2: one subscription over two topics, one written by mailroom's outbox, the other
/// by an ordinary producer numbering its `ce_id` 1, 2, 3… with its own `ce_source`:
/// every message is handled; a same-source redelivery is dropped; a `Receive` id equal
/// to a Kafka `ce_id` is a message of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_different_producers_never_collide() {
    let broker = Broker::start();
    let other = raw_producer(&broker.addr());
    // Create both topics before the consumer starts.
    for i in 1..=20 {
        let id = i.to_string();
        produce(
            &other,
            "other-events",
            Some(format!("o{}", i % 3).as_bytes()),
            format!("ok:other-{i}").as_bytes(),
            &[
                ("ce_specversion", b"1.0"),
                ("ce_id", id.as_bytes()),
                ("ce_source", b"urn:other-producer"),
                ("ce_type", b"other.event"),
            ],
        )
        .await;
    }
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let db = fresh_pg().await;
    let mut c: Config = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    c.subscriptions = vec![subscription(
        "mixed",
        &["outbox-events", "other-events"],
        &url,
    )];
    let mut s = Service::start(c).await;
    for i in 1..=20 {
        enqueue(
            &mut s.client,
            event(
                "outbox-events",
                &format!("m{}", i % 3),
                format!("ok:outbox-{i}").as_bytes(),
            ),
        )
        .await;
    }
    let pool = pg(&db).await;
    let done = completed_within(&s, 40, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let calls = handler.calls();
    let payloads: std::collections::BTreeSet<String> =
        calls.iter().map(|c| c.payload.clone()).collect();
    println!(
        "handled {done} of 40 ({} distinct payloads, {} records dropped as duplicates)",
        payloads.len(),
        duplicates(&s)
    );
    assert_eq!(payloads.len(), 40, "every message handled: {payloads:?}");
    // The handler's message ids are the dedup identities: distinct, and they name the
    // producer's source.
    let ids: std::collections::BTreeSet<&str> =
        calls.iter().map(|c| c.message_id.as_str()).collect();
    assert_eq!(ids.len(), 40, "{ids:?}");
    assert!(ids.contains("ce:18:urn:other-producer:1"), "{ids:?}");
    // mailroom's own records: ce_source names the installation, ce_id carries the time.
    let installation: String =
        sqlx::query_scalar("SELECT installation_id::text FROM mailroom_installation")
            .fetch_one(&pool)
            .await
            .unwrap();
    let records = consume(&broker.addr(), "outbox-events", 20, Duration::from_secs(20));
    for r in &records {
        assert_eq!(r.headers["ce_source"], format!("mailroom/{installation}"));
        let (id, micros) = r.headers["ce_id"].split_once('-').unwrap();
        assert!(id.parse::<i64>().is_ok() && micros.parse::<i64>().unwrap() > 0);
    }
    // A producer's redelivery (same source, same id) is dropped; the same id from another
    // source is another message.
    let dups_before = duplicates(&s);
    for (source, payload) in [
        (&b"urn:other-producer"[..], "ok:redelivered-5"),
        (&b"urn:third-producer"[..], "ok:third-5"),
    ] {
        produce(
            &other,
            "other-events",
            Some(b"o2"),
            payload.as_bytes(),
            &[("ce_id", b"5"), ("ce_source", source)],
        )
        .await;
    }
    // Receive ids live in their own namespace: "3" is not Kafka's ce_id 3.
    let mut ic = inbox_client(&s).await;
    let r = receive_on(&mut ic, "mixed", "3", "other-events", "", b"ok:rpc-3").await;
    assert!(
        !r.duplicate,
        "a Receive id must not collide with a Kafka ce_id"
    );
    assert_eq!(completed_within(&s, 42, Duration::from_secs(20)).await, 42);
    eventually(
        Duration::from_secs(10),
        "the redelivery counted",
        || async { duplicates(&s) == dups_before + 1 },
    )
    .await;
    let payloads: Vec<String> = handler.calls().into_iter().map(|c| c.payload).collect();
    assert!(!payloads.contains(&"ok:redelivered-5".to_string()));
    assert!(payloads.contains(&"ok:third-5".to_string()));
    assert!(payloads.contains(&"ok:rpc-3".to_string()));
    assert_eq!(count_where(&pool, "message_id = 'rpc:3'").await, 1);
    s.app.stop().await.unwrap();
}

fn db_name(url: &str) -> &str {
    url.rsplit_once('/').unwrap().1
}

/// A producer-only mailroom on `db` publishing to `broker`.
async fn publisher(db: &str, broker: &Broker) -> Service {
    let mut c = config(db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    Service::start(c).await
}

async fn publish(s: &mut Service, topic: &str, tag: &str, n: usize) {
    for i in 0..n {
        enqueue(
            &mut s.client,
            event(
                topic,
                &format!("k{}", i % 2),
                format!("ok:{tag}-{i}").as_bytes(),
            ),
        )
        .await;
    }
    wait_completed(&s.app.store, n as i64, Duration::from_secs(30)).await;
}

/// Item 2: two mailroom deployments, and one of them restored from a backup (which
/// issues its lost event ids again), publish into one subscription: nothing collides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployments_and_a_restored_database_publish_distinct_ids() {
    let broker = Broker::start();
    let admin = pg(&pg_admin_url()).await;
    // Deployment A publishes 5 events, then a backup of its database is taken.
    let a_db = fresh_pg().await;
    let mut a = publisher(&a_db, &broker).await;
    publish(&mut a, "shared", "a-before-backup", 5).await;
    a.app.stop().await.unwrap();
    let backup_db = fresh_pg().await;
    let (a_name, b_name) = (db_name(&a_db), db_name(&backup_db));
    for sql in [
        format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{a_name}' AND pid <> pg_backend_pid()"
        ),
        format!("DROP DATABASE {b_name}"),
        format!("CREATE DATABASE {b_name} TEMPLATE {a_name}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&admin)
            .await
            .unwrap();
    }
    // A goes on (ids 6..10), then dies; its database is restored from the backup, which
    // issues ids 6..10 again for new events.
    let mut a = publisher(&a_db, &broker).await;
    for i in 0..5 {
        enqueue(
            &mut a.client,
            event("shared", "k", format!("ok:a-after-backup-{i}").as_bytes()),
        )
        .await;
    }
    wait_completed(&a.app.store, 10, Duration::from_secs(30)).await;
    a.app.stop().await.unwrap();
    let mut restored = publisher(&backup_db, &broker).await;
    for i in 0..5 {
        enqueue(
            &mut restored.client,
            event("shared", "k", format!("ok:restored-{i}").as_bytes()),
        )
        .await;
    }
    wait_completed(&restored.app.store, 10, Duration::from_secs(30)).await;
    restored.app.stop().await.unwrap();
    // Deployment D, another installation, numbers its events 1..5 too.
    let mut d = publisher(&fresh_pg().await, &broker).await;
    publish(&mut d, "shared", "d", 5).await;
    d.app.stop().await.unwrap();

    // The subscriber's mailroom reads them all.
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let mut c = config(&fresh_pg().await);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    c.subscriptions = vec![subscription("everything", &["shared"], &url)];
    let s = Service::start(c).await;
    let done = completed_within(&s, 20, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let payloads: std::collections::BTreeSet<String> =
        handler.calls().into_iter().map(|c| c.payload).collect();
    println!(
        "handled {done} of 20; {} records dropped as duplicates",
        duplicates(&s)
    );
    assert_eq!(payloads.len(), 20, "{payloads:?}");
    assert_eq!(duplicates(&s), 0);
    s.app.stop().await.unwrap();
}

/// Item 3: poison records in the middle of a stream of good ones. Each kind of bad record
/// is visible afterwards (a failed row with its reason, or a counter), every good record
/// is handled, and the subscription keeps going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_records_never_stall_a_subscription() {
    let broker = Broker::start();
    let p = raw_producer(&broker.addr());
    let db = fresh_pg().await;
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c.subscriptions = vec![subscription("stream", &["stream", "cursed"], &url)];
    // Three refusals only the database knows about (real PostgreSQL errors, class 23):
    // one that a record without its key passes, one that only its place in the log
    // passes, and one no form of the record passes.
    mailroom::app::open_store(&c).await.unwrap();
    let pool = pg(&db).await;
    for check in [
        "event_key IS DISTINCT FROM 'refused-key'",
        "payload <> convert_to('ok:refused-payload', 'UTF8')",
        "topic <> 'cursed'",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE inbox_events ADD CHECK ({check})"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    let long_key = vec![b'k'; 5000];
    let long_id = vec![b'i'; 3000];
    let names: Vec<String> = (0..70).map(|n| format!("h{n:02}")).collect();
    let many: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b"v"[..])).collect();
    let mut good = 0;
    let next_good = async |p: &FutureProducer, good: &mut i32| {
        for _ in 0..5 {
            let payload = format!("ok:good-{good}");
            produce(p, "stream", Some(b"g"), payload.as_bytes(), &[]).await;
            *good += 1;
        }
    };
    next_good(&p, &mut good).await;
    produce(&p, "stream", Some(&long_key), b"ok:long-key", &[]).await;
    next_good(&p, &mut good).await;
    produce(
        &p,
        "stream",
        Some(b"l"),
        b"ok:long-id",
        &[("ce_id", &long_id)],
    )
    .await;
    next_good(&p, &mut good).await;
    produce(
        &p,
        "stream",
        Some(b"u\xff\xfe"),
        b"ok:utf8-a",
        &[("ce_id", b"id\xff"), ("x", b"\xc3")],
    )
    .await;
    produce(
        &p,
        "stream",
        Some(b"u\xff\xfe"),
        b"ok:utf8-b",
        &[("ce_id", b"id\xfe")],
    )
    .await;
    next_good(&p, &mut good).await;
    produce(
        &p,
        "stream",
        Some(b"n\0ul"),
        b"ok:nul",
        &[("ce_id", b"nul\0id"), ("h\0", b"v\0")],
    )
    .await;
    next_good(&p, &mut good).await;
    produce(&p, "stream", Some(b"h64"), b"ok:64-headers", &many[..64]).await;
    produce(&p, "stream", Some(b"h70"), b"ok:70-headers", &many).await;
    next_good(&p, &mut good).await;
    produce(&p, "stream", Some(b"refused-key"), b"ok:refused-key", &[]).await;
    produce(
        &p,
        "stream",
        Some(b"r"),
        b"ok:refused-payload",
        &[("ce_id", b"rp")],
    )
    .await;
    produce(&p, "cursed", Some(b"c"), b"ok:cursed", &[]).await;
    next_good(&p, &mut good).await;

    let s = Service::start(c).await;
    // Good records: 35; handled bad ones: long id, two invalid UTF-8, NUL, 64 headers.
    let expected = i64::from(good) + 5;
    let done = completed_within(&s, expected, Duration::from_secs(30)).await;
    println!("handled {done} of {expected} ({good} good records)");
    assert_eq!(done, expected);
    let payloads: std::collections::BTreeSet<String> =
        handler.calls().into_iter().map(|c| c.payload).collect();
    for i in 0..good {
        assert!(
            payloads.contains(&format!("ok:good-{i}")),
            "good-{i} missing"
        );
    }
    for handled in [
        "ok:long-id",
        "ok:utf8-a",
        "ok:utf8-b",
        "ok:nul",
        "ok:64-headers",
    ] {
        assert!(payloads.contains(handled), "{handled} not handled");
    }
    // The bad records are visible: failed rows with their reasons…
    let failed: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8'), message_id, last_error FROM inbox_events
         WHERE status = 'failed' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    println!("failed rows: {failed:#?}");
    let reason = |payload: &str| {
        failed
            .iter()
            .find(|f| f.0 == payload)
            .map(|f| f.2.clone())
            .unwrap_or_else(|| panic!("no failed row for {payload:?}"))
    };
    assert!(reason("ok:long-key").contains("key is 5000 bytes"));
    assert!(reason("ok:70-headers").contains("70 headers"));
    assert!(reason("ok:refused-key").contains("refused"));
    assert!(reason("").contains("stored without its content"));
    assert_eq!(failed.len(), 4);
    // …and counters: 4 stored as failed, the cursed record unstorable.
    let text = scrape(s.app.metrics_addr.unwrap()).await;
    let series = |name: &str| sample(&text, &format!("{name}{{subscription=\"stream\"}}"));
    assert_eq!(series("mailroom_inbox_intake_failed_total"), 4.0, "{text}");
    assert_eq!(
        series("mailroom_inbox_intake_unstorable_total"),
        1.0,
        "{text}"
    );
    // Hashed and exact ids: the long id fits the index, the invalid UTF-8 ids stay apart.
    assert_eq!(count_where(&pool, "message_id LIKE 'ce-h:%'").await, 1);
    assert_eq!(count_where(&pool, "message_id LIKE 'ce-x:%'").await, 3);
    // The subscription goes on.
    next_good(&p, &mut good).await;
    assert_eq!(
        completed_within(&s, expected + 5, Duration::from_secs(20)).await,
        expected + 5
    );
    s.app.stop().await.unwrap();
}

/// Item 3b: a subscription running before one of its topics exists sees that topic's
/// messages within seconds of its creation (not after librdkafka's 5 minutes). The
/// subscription's other topic exists and is being consumed: the group is settled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_after_the_subscription_starts_is_seen_within_seconds() {
    let broker = Broker::start();
    let p = raw_producer(&broker.addr());
    produce(&p, "born-earlier", Some(b"k"), b"ok:earlier", &[]).await;
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let mut c = config(&fresh_pg().await);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    c.subscriptions = vec![subscription("early", &["born-earlier", "born-later"], &url)];
    let s = Service::start(c).await;
    assert_eq!(completed_within(&s, 1, Duration::from_secs(30)).await, 1);
    // The group has settled on the topic that exists.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let created = std::time::Instant::now();
    for i in 0..5 {
        produce(
            &p,
            "born-later",
            Some(b"k"),
            format!("ok:{i}").as_bytes(),
            &[],
        )
        .await;
    }
    let done = completed_within(&s, 6, Duration::from_secs(20)).await;
    println!(
        "handled {} of 5 from the new topic, {:.1} s after it was created",
        done - 1,
        created.elapsed().as_secs_f64()
    );
    assert_eq!(done, 6);
    s.app.stop().await.unwrap();
}

/// Item 2, upgrade: inbox rows stored before migration 0006 get the identities the intake
/// now computes (a redelivered record is still a duplicate), on both engines; the
/// installation id is generated once.
#[tokio::test]
async fn existing_inbox_rows_migrate_to_namespaced_ids() {
    use mailroom::domain::InboundMessage;
    use mailroom::inbox::identity;
    use mailroom::store::Admission;
    let long_id = "L".repeat(600);
    let old_rows: [(&str, &str, String); 4] = [
        (
            "42",
            "orders",
            r#"{"ce_id":"42","ce_source":"mailroom"}"#.into(),
        ),
        ("orders:0:17", "orders", "{}".into()),
        ("wh-1", "direct", r#"{"x":"y"}"#.into()),
        (
            &long_id,
            "orders",
            format!(r#"{{"ce_id":"{long_id}","ce_source":"s"}}"#),
        ),
    ];
    for engine in [Engine::Postgres, Engine::Sqlite] {
        let (url, _dir) = fresh_db(&engine).await;
        let insert = "INSERT INTO inbox_events (subscription, message_id, idempotency_key, topic,
             payload, headers, max_attempts, scheduled_at, created_at, updated_at)
             VALUES ('sub', $1, $1, $2, $3, $4, 5, $5, $5, $5)";
        match engine {
            Engine::Postgres => {
                let pool = pg(&url).await;
                sqlx::migrate::Migrator::new(std::path::Path::new("migrations/postgres"))
                    .await
                    .unwrap()
                    .run_to(5, &pool)
                    .await
                    .unwrap();
                let insert = insert.replace("$4,", "$4::jsonb,");
                for (id, topic, headers) in &old_rows {
                    sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
                        .bind(id)
                        .bind(topic)
                        .bind(&b"x"[..])
                        .bind(headers)
                        .bind(chrono::Utc::now())
                        .execute(&pool)
                        .await
                        .unwrap();
                }
                pool.close().await;
            }
            Engine::Sqlite => {
                let pool = sqlx::sqlite::SqlitePool::connect(&format!("{url}?mode=rwc"))
                    .await
                    .unwrap();
                sqlx::migrate::Migrator::new(std::path::Path::new("migrations/sqlite"))
                    .await
                    .unwrap()
                    .run_to(5, &pool)
                    .await
                    .unwrap();
                for (id, topic, headers) in &old_rows {
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(id)
                        .bind(topic)
                        .bind(&b"x"[..])
                        .bind(headers)
                        .bind(0i64)
                        .execute(&pool)
                        .await
                        .unwrap();
                }
                pool.close().await;
            }
        }
        let store = mailroom::app::open_store(&config(&url)).await.unwrap();
        let installation = store.installation_id().await.unwrap();
        assert!(
            uuid::Uuid::parse_str(&installation).is_ok(),
            "{installation}"
        );
        store.migrate().await.unwrap();
        assert_eq!(store.installation_id().await.unwrap(), installation);
        let long = identity::cloud_event(b"s", long_id.as_bytes());
        let long = match engine {
            Engine::Postgres => long,
            // SQLite has no SHA-256 in SQL: the plain form stays (docs/inbox.md).
            Engine::Sqlite => format!("ce:1:s:{long_id}"),
        };
        let expected = [
            (identity::cloud_event(b"mailroom", b"42"), "orders"),
            (identity::kafka_untimed("orders", 0, 17), "orders"),
            (identity::rpc("wh-1"), "direct"),
            (long, "orders"),
        ];
        for (id, topic) in expected {
            let again = InboundMessage {
                message_id: id.clone(),
                topic: topic.into(),
                key: None,
                payload: b"x".to_vec(),
                headers: Default::default(),
                event_type: None,
                max_attempts: 5,
                failure: None,
            };
            let a = store.receive("sub", &[again]).await.unwrap();
            assert!(matches!(a[0], Admission::Duplicate(_)), "{id}: {a:?}");
        }
        assert_eq!(store.count_events(BoxKind::Inbox, None).await.unwrap(), 4);
    }
}

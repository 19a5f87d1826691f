//! The inbox against real PostgreSQL, a real broker and real gRPC handlers (Rust and
//! Python): end to end from the outbox, redelivery, every handler outcome, `Receive`.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::probe::*;
use common::*;
use mailroom::config::{Config, SubscriptionConfig};
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use mailroom::pb::handler_service_server::HandlerService;
use mailroom::pb::inbox_service_client::InboxServiceClient;
use mailroom::relay::backoff::RetryPolicy;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tonic::{Code, Request, Response, Status as GrpcStatus};

/// One call the test handler received.
#[derive(Debug, Clone)]
struct Call {
    message_id: String,
    key: String,
    payload: String,
    attempt: u32,
    /// The `traceparent` gRPC metadata of the call.
    traceparent: Option<String>,
}

/// A subscriber whose answer depends on the payload's first word.
#[derive(Clone, Default)]
struct ScriptedHandler {
    calls: Arc<Mutex<Vec<Call>>>,
}

#[tonic::async_trait]
impl HandlerService for ScriptedHandler {
    async fn handle(
        &self,
        request: Request<pb::HandleRequest>,
    ) -> Result<Response<pb::HandleResponse>, GrpcStatus> {
        use pb::handle_response::Outcome;
        let traceparent = request
            .metadata()
            .get("traceparent")
            .map(|v| v.to_str().unwrap().to_string());
        let r = request.into_inner();
        let payload = String::from_utf8(r.payload.clone()).unwrap();
        self.calls.lock().unwrap().push(Call {
            message_id: r.message_id.clone(),
            key: r.key.clone(),
            payload: payload.clone(),
            attempt: r.attempt,
            traceparent,
        });
        let outcome = match payload.split(':').next().unwrap() {
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
        Ok(Response::new(pb::HandleResponse { outcome }))
    }
}

impl ScriptedHandler {
    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Serves on 127.0.0.1:0; returns the URL.
    async fn serve(&self) -> String {
        serve_handler(self.clone()).await
    }
}

fn subscription(name: &str, topics: &[&str], handler: &str) -> SubscriptionConfig {
    SubscriptionConfig {
        name: name.into(),
        topics: topics.iter().map(|t| t.to_string()).collect(),
        group: format!("g-{name}-{}", uuid::Uuid::new_v4().simple()),
        handler: handler.into(),
        handler_timeout: Duration::from_millis(300),
        concurrency: 4,
        retry: RetryPolicy {
            base: Duration::from_secs(60),
            cap: Duration::from_secs(600),
            max_attempts: 5,
        },
    }
}

async fn inbox_client(s: &Service) -> InboxServiceClient<tonic::transport::Channel> {
    InboxServiceClient::new(channel(s.app.addr).await)
}

async fn receive(
    c: &mut InboxServiceClient<tonic::transport::Channel>,
    sub: &str,
    id: &str,
    key: &str,
    payload: &str,
) -> pb::ReceiveResponse {
    c.receive(pb::ReceiveRequest {
        subscription: sub.into(),
        message_id: id.into(),
        topic: "direct".into(),
        key: key.into(),
        payload: payload.as_bytes().to_vec(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
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
            .push(c.message_id.parse().unwrap());
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
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    c.subscriptions = vec![subscription("billing", &["flow"], &url)];
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
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
    assert!(calls.iter().all(|c| c.attempt == 1));
    // message_id is the outbox event id (ce_id); per key, handled in enqueue order.
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
    for i in 0..50 {
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
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let db = fresh_pg().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    let sub = subscription("audit", &["raw"], &url);
    c.subscriptions = vec![sub.clone()];
    let s = Service::start(c.clone()).await;
    eventually(Duration::from_secs(60), "50 handled", || async {
        inbox_count(&s, Status::Completed).await == 50
    })
    .await;
    s.app.stop().await.unwrap();
    // A consumer that never saw the commits (a new group) gets every record again.
    let mut again = sub.clone();
    again.group = format!("{}-redelivered", sub.group);
    c.subscriptions = vec![again];
    let s = Service::start(c).await;
    let stats = s.app.inbox.intake_stats["audit"].clone();
    eventually(Duration::from_secs(60), "50 records redelivered", || {
        let stats = stats.clone();
        async move { stats.received.load(std::sync::atomic::Ordering::Relaxed) >= 50 }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        stats.duplicates.load(std::sync::atomic::Ordering::Relaxed),
        50
    );
    assert_eq!(handler.calls().len(), 50, "no message handled twice");
    assert_eq!(
        s.app
            .store
            .count_events(BoxKind::Inbox, None)
            .await
            .unwrap(),
        50
    );
    let mut ids: Vec<String> = handler.calls().into_iter().map(|c| c.message_id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 50);
    assert!(ids.iter().all(|id| id.starts_with("raw:")), "{ids:?}");
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_handler_outcome_lands_in_the_right_state() {
    let handler = ScriptedHandler::default();
    let url = handler.serve().await;
    let down = format!("http://127.0.0.1:{}", free_port());
    let db = fresh_pg().await;
    let mut c = config(&db);
    c.relays = 0;
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
    let mut c = config(&db);
    c.relays = 0;
    c.subscriptions = vec![subscription("hooks", &[], &url)];
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
    eventually(Duration::from_secs(10), "handled once", || async {
        handler.calls().len() == 1
    })
    .await;
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_grpcio_handler_is_a_subscriber() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("handled.jsonl");
    let root = env!("CARGO_MANIFEST_DIR");
    let mut py = tokio::process::Command::new("python3")
        .arg(format!("{root}/tests/python/handler_server.py"))
        .arg(port.to_string())
        .arg(format!("{root}/proto"))
        .arg(&log)
        .kill_on_drop(true)
        .spawn()
        .expect("python3 is required (scripts/test.sh installs grpcio)");
    eventually(
        Duration::from_secs(30),
        "python handler listening",
        || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        },
    )
    .await;
    let db = fresh_pg().await;
    let mut c = config(&db);
    c.relays = 0;
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
    let e = s
        .app
        .store
        .get_event(BoxKind::Inbox, rejected)
        .await
        .unwrap()
        .unwrap();
    assert!(e.last_error.unwrap().contains("python says no"));
    s.app.stop().await.unwrap();
    let _ = py.kill().await;
}

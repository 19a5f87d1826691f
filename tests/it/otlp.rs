//! Optional OTLP trace export: the binary, pointed at a collector, exports the span of an
//! `Enqueue` call inside the producer's trace (its W3C `traceparent`), named and tagged
//! after OpenTelemetry's RPC conventions, configured by the standard `OTEL_*` variables,
//! and not silenced by `RUST_LOG`; mailroom's own calls (a Kafka publish, an inbox
//! handler call) get spans of their own that become the receiver's parent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use mailroom::pb;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::AnyValue;
use tokio_stream::wrappers::TcpListenerStream;

/// One span received.
#[derive(Clone, Debug)]
struct Seen {
    trace_id: String,
    span_id: String,
    name: String,
    kind: i32,
    attributes: HashMap<String, String>,
    service_name: String,
    /// The trace ids of the span's links.
    links: Vec<String>,
}

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Seen>>>,
}

fn value(v: &Option<AnyValue>) -> String {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let service_name = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .map(|a| value(&a.value))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    spans.push(Seen {
                        trace_id: s.trace_id.iter().map(|b| format!("{b:02x}")).collect(),
                        span_id: s.span_id.iter().map(|b| format!("{b:02x}")).collect(),
                        name: s.name,
                        kind: s.kind,
                        attributes: s
                            .attributes
                            .iter()
                            .map(|a| (a.key.clone(), value(&a.value)))
                            .collect(),
                        service_name: service_name.clone(),
                        links: s
                            .links
                            .iter()
                            .map(|l| l.trace_id.iter().map(|b| format!("{b:02x}")).collect())
                            .collect(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A collector on 127.0.0.1, plain or with TLS.
async fn start_collector(tls: Option<tonic::transport::ServerTlsConfig>) -> (Collector, u16) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let collector = Collector::default();
    let svc = TraceServiceServer::new(collector.clone());
    tokio::spawn(async move {
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = tls {
            server = server.tls_config(tls).unwrap();
        }
        server
            .add_service(svc)
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (collector, port)
}

/// Runs the binary (SQLite, a local sink, logs quieted to errors only) with `env`, sends
/// one `Enqueue` in trace `trace_id` and stops it with SIGTERM, which flushes the
/// exporter on the way out.
async fn one_traced_enqueue(env: &[(&str, String)], trace_id: &str) {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"));
    cmd.env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("m.db").display()),
        )
        .env("MAILROOM_LOCAL_SINK", dir.path().join("out.jsonl"))
        .env("RUST_LOG", "error")
        .env_remove("MAILROOM_OTLP_ENDPOINT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    wait_listening(port, "mailroom listening").await;
    let mut c = client(format!("127.0.0.1:{port}").parse().unwrap()).await;
    let mut req = tonic::Request::new(pb::EnqueueRequest {
        event: Some(event("traced", "k", b"x")),
    });
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-00f067aa0ba902b7-01")
            .parse()
            .unwrap(),
    );
    c.enqueue(req).await.unwrap();
    stop_gracefully(child).await;
}

/// Each attribute of `expected` is on `span` with that value.
fn assert_attributes(span: &Seen, expected: &[(&str, &str)]) {
    for (k, v) in expected {
        assert_eq!(
            span.attributes.get(*k).map(String::as_str),
            Some(*v),
            "{k} in {span:?}"
        );
    }
}

/// Stops the binary with SIGTERM (which flushes the exporter on the way out) and checks
/// that it exited cleanly.
async fn stop_gracefully(mut child: std::process::Child) {
    let pid = child.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status}");
}

const ENQUEUE_SPAN: &str = "mailroom.v1.OutboxService/Enqueue";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_spans_join_the_producers_trace() {
    let (collector, port) = start_collector(None).await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    // OpenTelemetry's own variables.
    one_traced_enqueue(
        &[
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("http://127.0.0.1:{port}"),
            ),
            ("OTEL_SERVICE_NAME", "mailroom-under-test".into()),
        ],
        trace_id,
    )
    .await;
    let spans = collector.spans.lock().unwrap().clone();
    let rpc = spans
        .iter()
        .find(|s| s.trace_id == trace_id && s.name == ENQUEUE_SPAN)
        .unwrap_or_else(|| panic!("no Enqueue span in the producer's trace among {spans:#?}"));
    // SpanKind::Server = 2.
    assert_eq!(rpc.kind, 2, "{rpc:?}");
    assert_attributes(
        rpc,
        &[
            ("rpc.system", "grpc"),
            ("rpc.service", "mailroom.v1.OutboxService"),
            ("rpc.method", "Enqueue"),
            ("rpc.grpc.status_code", "0"),
            // The newer conventions' attributes that do not clash (v1.38+).
            ("rpc.system.name", "grpc"),
            ("rpc.response.status_code", "OK"),
        ],
    );
    assert_eq!(rpc.service_name, "mailroom-under-test");
    // The group commit that stored the event: a database client span linked to the
    // Enqueue's trace (it serves several callers, so it is a child of none).
    let db = spans
        .iter()
        .find(|s| s.name == "INSERT outbox_events" && s.links.iter().any(|l| l == trace_id))
        .unwrap_or_else(|| panic!("no linked database span among {spans:#?}"));
    // SpanKind::Client = 3.
    assert_eq!(db.kind, 3, "{db:?}");
    assert_attributes(
        db,
        &[
            ("db.system.name", "sqlite"),
            ("db.operation.name", "INSERT"),
            ("db.collection.name", "outbox_events"),
            ("db.query.summary", "INSERT outbox_events"),
            ("db.operation.batch.size", "1"),
        ],
    );

    // OTEL_SEMCONV_STABILITY_OPT_IN=rpc: the newer conventions only.
    let stable_trace = "5bf92f3577b34da6a3ce929d0e0e4737";
    one_traced_enqueue(
        &[
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                format!("http://127.0.0.1:{port}"),
            ),
            ("OTEL_SEMCONV_STABILITY_OPT_IN", "http,rpc".into()),
        ],
        stable_trace,
    )
    .await;
    let spans = collector.spans.lock().unwrap().clone();
    let rpc = spans
        .iter()
        .find(|s| s.trace_id == stable_trace && s.name == ENQUEUE_SPAN)
        .unwrap_or_else(|| panic!("no Enqueue span among {spans:#?}"));
    assert_eq!(
        rpc.attributes.get("rpc.method").map(String::as_str),
        Some("mailroom.v1.OutboxService/Enqueue")
    );
    assert_eq!(
        rpc.attributes
            .get("rpc.response.status_code")
            .map(String::as_str),
        Some("OK")
    );
    for gone in ["rpc.system", "rpc.service", "rpc.grpc.status_code"] {
        assert!(!rpc.attributes.contains_key(gone), "{gone} in {rpc:?}");
    }
}

/// Export over TLS with mTLS: a collector that requires a client certificate signed by
/// the test CA receives the `Enqueue` span when the binary is given the CA, the client
/// certificate and the key (`OTEL_EXPORTER_OTLP_CERTIFICATE`,
/// `…_CLIENT_CERTIFICATE`, `…_CLIENT_KEY`); without the CA (the webpki roots then
/// refuse the test CA) and without the client certificate it receives nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_tls_with_a_client_certificate() {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let pki = crate::support::pki::pki();
    let read = |p: &std::path::Path| std::fs::read(p).unwrap();
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(
            read(&pki.server_cert),
            read(&pki.server_key),
        ))
        .client_ca_root(Certificate::from_pem(read(&pki.ca)));
    let (collector, port) = start_collector(Some(tls)).await;
    let endpoint = (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        format!("https://localhost:{port}"),
    );
    let ca = (
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
        pki.ca.display().to_string(),
    );
    let cert = (
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        pki.client_cert.display().to_string(),
    );
    let key = (
        "OTEL_EXPORTER_OTLP_CLIENT_KEY",
        pki.client_key.display().to_string(),
    );
    let refused = [
        (
            "11111111111111111111111111111111",
            vec![endpoint.clone(), cert.clone(), key.clone()],
        ),
        (
            "22222222222222222222222222222222",
            vec![endpoint.clone(), ca.clone()],
        ),
    ];
    for (trace_id, env) in &refused {
        one_traced_enqueue(env, trace_id).await;
    }
    let trusted = "33333333333333333333333333333333";
    one_traced_enqueue(&[endpoint, ca, cert, key], trusted).await;
    let spans = collector.spans.lock().unwrap().clone();
    assert!(
        spans
            .iter()
            .any(|s| s.trace_id == trusted && s.name == ENQUEUE_SPAN),
        "no Enqueue span over mTLS among {spans:#?}"
    );
    for (trace_id, _) in &refused {
        assert!(
            spans.iter().all(|s| s.trace_id != *trace_id),
            "a span of {trace_id} arrived without the CA or the client certificate"
        );
    }
}

/// A producer span per Kafka publish (OpenTelemetry messaging conventions), a child of the
/// event's trace; the record carries the producer span as its parent and keeps the
/// caller's `tracestate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_publishes_get_producer_spans() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector_addr = listener.local_addr().unwrap();
    let collector = Collector::default();
    let svc = TraceServiceServer::new(collector.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("m.db").display()),
        )
        .env("MAILROOM_KAFKA_BROKERS", broker.addr())
        .env("MAILROOM_SOURCE", "otel-test")
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://{collector_addr}"),
        )
        .env_remove("MAILROOM_OTLP_ENDPOINT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port, "mailroom listening").await;
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let caller_span = "b7ad6b7169203331";
    let mut c = client(format!("127.0.0.1:{port}").parse().unwrap()).await;
    let mut req = tonic::Request::new(pb::EnqueueRequest {
        event: Some(event("otel.orders", "o-1", b"x")),
    });
    let md = req.metadata_mut();
    md.insert(
        "traceparent",
        format!("00-{trace_id}-{caller_span}-01").parse().unwrap(),
    );
    md.insert("tracestate", "vendor=abc,other=1".parse().unwrap());
    c.enqueue(req).await.unwrap();
    let brokers = broker.addr();
    let records = tokio::task::spawn_blocking(move || {
        consume(&brokers, "otel.orders", 1, Duration::from_secs(30))
    })
    .await
    .unwrap();
    assert_eq!(records.len(), 1);
    let h = &records[0].headers;
    let tp: Vec<&str> = h["traceparent"].split('-').collect();
    assert_eq!(tp[1], trace_id, "the record stays in the caller's trace");
    assert_ne!(tp[2], caller_span, "its parent is mailroom's producer span");
    assert_eq!(h["tracestate"], "vendor=abc,other=1");
    stop_gracefully(child).await;
    let spans = collector.spans.lock().unwrap().clone();
    let send = spans
        .iter()
        .find(|s| s.name == "send otel.orders")
        .unwrap_or_else(|| panic!("no producer span among {spans:#?}"));
    // SpanKind::Producer = 4.
    assert_eq!(send.kind, 4, "{send:?}");
    assert_eq!(send.trace_id, trace_id);
    assert_eq!(
        send.span_id, tp[2],
        "the record's parent is the producer span"
    );
    assert_attributes(
        send,
        &[
            ("messaging.system", "kafka"),
            ("messaging.operation.type", "send"),
            ("messaging.destination.name", "otel.orders"),
            ("messaging.kafka.message.key", "o-1"),
        ],
    );
}

/// What the subscriber's handler saw: the `traceparent` and `tracestate` metadata of each
/// call.
#[derive(Clone, Default)]
struct TraceSeen(Arc<Mutex<Vec<(String, String)>>>);

#[tonic::async_trait]
impl pb::handler_service_server::HandlerService for TraceSeen {
    async fn handle(
        &self,
        request: tonic::Request<pb::HandleRequest>,
    ) -> Result<tonic::Response<pb::HandleResponse>, tonic::Status> {
        let get = |k: &str| {
            request
                .metadata()
                .get(k)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string()
        };
        self.0
            .lock()
            .unwrap()
            .push((get("traceparent"), get("tracestate")));
        Ok(tonic::Response::new(pb::HandleResponse::default()))
    }
}

/// A client span per inbox handler call (OpenTelemetry RPC conventions), a child of the
/// message's stored trace context; the handler gets that span as its parent and the
/// stored `tracestate`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_calls_get_client_spans() {
    let (collector, collector_port) = start_collector(None).await;
    let seen = TraceSeen::default();
    let handler = serve_handler(seen.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("mailroom.toml");
    std::fs::write(
        &toml,
        format!("[[subscriptions]]\nname = \"billing\"\nhandler = \"{handler}\"\n"),
    )
    .unwrap();
    let port = free_port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .env("MAILROOM_CONFIG", &toml)
        .env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("m.db").display()),
        )
        .env("MAILROOM_LOCAL_SINK", dir.path().join("out.jsonl"))
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{collector_port}"),
        )
        .env("RUST_LOG", "error")
        .env_remove("MAILROOM_OTLP_ENDPOINT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port, "mailroom listening").await;
    let trace_id = "5b8efff798038103d269b633813fc60c";
    let producer_span = "eee19b7ec3c1b174";
    let mut inbox = pb::inbox_service_client::InboxServiceClient::new(
        channel(format!("127.0.0.1:{port}").parse().unwrap()).await,
    );
    inbox
        .receive(pb::ReceiveRequest {
            subscription: "billing".into(),
            message_id: "m-traced".into(),
            topic: "invoices".into(),
            payload: b"x".to_vec(),
            headers: HashMap::from([
                (
                    "traceparent".to_string(),
                    format!("00-{trace_id}-{producer_span}-01"),
                ),
                ("tracestate".to_string(), "vendor=abc,other=1".to_string()),
            ]),
            ..Default::default()
        })
        .await
        .unwrap();
    // A message without trace headers, from a caller that sends its trace context as
    // call metadata (as it would for Enqueue): the message joins the caller's trace.
    let meta_trace = "0af7651916cd43dd8448eb211c80319c";
    let mut req = tonic::Request::new(pb::ReceiveRequest {
        subscription: "billing".into(),
        message_id: "m-metadata".into(),
        topic: "invoices".into(),
        payload: b"y".to_vec(),
        ..Default::default()
    });
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{meta_trace}-b7ad6b7169203331-01")
            .parse()
            .unwrap(),
    );
    req.metadata_mut()
        .insert("tracestate", "caller=meta".parse().unwrap());
    inbox.receive(req).await.unwrap();
    let calls = seen.0.clone();
    eventually(Duration::from_secs(20), "the handler called twice", || {
        let calls = calls.clone();
        async move { calls.lock().unwrap().len() >= 2 }
    })
    .await;
    stop_gracefully(child).await;

    let calls = seen.0.lock().unwrap().clone();
    let in_trace = |t: &str| {
        calls
            .iter()
            .find(|(tp, _)| tp.split('-').nth(1) == Some(t))
            .cloned()
            .unwrap_or_else(|| panic!("no handler call in trace {t}: {calls:?}"))
    };
    let (_, meta_state) = in_trace(meta_trace);
    assert_eq!(
        meta_state, "caller=meta",
        "the call's tracestate travels too"
    );
    let (traceparent, tracestate) = in_trace(trace_id);
    let tp: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(tp.len(), 4, "{traceparent:?}");
    assert_eq!(tp[1], trace_id, "the call stays in the message's trace");
    assert_ne!(tp[2], producer_span, "its parent is mailroom's client span");
    assert_eq!(tracestate, "vendor=abc,other=1");
    let spans = collector.spans.lock().unwrap().clone();
    let call = spans
        .iter()
        .find(|s| s.name == "mailroom.v1.HandlerService/Handle" && s.trace_id == trace_id)
        .unwrap_or_else(|| panic!("no handler client span in trace {trace_id} among {spans:#?}"));
    // Each message's call has its own span in its own trace: the metadata-traced one too.
    assert!(
        spans
            .iter()
            .any(|s| s.name == "mailroom.v1.HandlerService/Handle" && s.trace_id == meta_trace),
        "no handler client span in the caller's trace among {spans:#?}"
    );
    // SpanKind::Client = 3.
    assert_eq!(call.kind, 3, "{call:?}");
    assert_eq!(
        call.span_id, tp[2],
        "the handler's parent is the client span"
    );
    assert_attributes(
        call,
        &[
            ("rpc.system", "grpc"),
            ("rpc.service", "mailroom.v1.HandlerService"),
            ("rpc.method", "Handle"),
            ("rpc.grpc.status_code", "0"),
            ("rpc.system.name", "grpc"),
            ("rpc.response.status_code", "OK"),
            ("server.address", "127.0.0.1"),
            ("messaging.destination.name", "invoices"),
            ("messaging.destination.subscription.name", "billing"),
            ("mailroom.outcome", "success"),
        ],
    );
    assert!(
        call.attributes
            .get("messaging.message.id")
            .is_some_and(|id| !id.is_empty()),
        "{call:?}"
    );
    // The Receive RPC's server span joined the caller's trace from the metadata.
    assert!(
        spans
            .iter()
            .any(|s| s.name == "mailroom.v1.InboxService/Receive" && s.trace_id == meta_trace),
        "no Receive server span in the caller's trace among {spans:#?}"
    );
}

/// Issue 28, item 3: JSON logs carry the OpenTelemetry `trace_id` and `span_id` of the
/// span each line was logged in, without an exporter too: the RPC's lines name the
/// caller's trace and mailroom's own span. With nothing exported, the published record
/// keeps the producer's `traceparent` (a span id nobody can see is not propagated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_the_trace_and_span_ids() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let log = dir.path().join("stderr.jsonl");
    let sink = dir.path().join("out.jsonl");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("m.db").display()),
        )
        .env("MAILROOM_LOCAL_SINK", &sink)
        .env("MAILROOM_LOG_FORMAT", "json")
        .env("RUST_LOG", "debug")
        .env_remove("MAILROOM_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    wait_listening(port, "mailroom listening").await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let tp = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let mut c = client(format!("127.0.0.1:{port}").parse().unwrap()).await;
    let mut req = tonic::Request::new(pb::EnqueueRequest {
        event: Some(event("traced", "k", b"x")),
    });
    req.metadata_mut()
        .insert("traceparent", tp.parse().unwrap());
    c.enqueue(req).await.unwrap();
    eventually(Duration::from_secs(10), "the event published", || {
        let sink = sink.clone();
        async move { std::fs::read_to_string(&sink).is_ok_and(|t| !t.is_empty()) }
    })
    .await;
    stop_gracefully(child).await;

    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let in_rpc: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["span"]["otel.name"] == "mailroom.v1.OutboxService/Enqueue")
        .collect();
    assert!(
        !in_rpc.is_empty(),
        "no line inside the Enqueue span:\n{text}"
    );
    for l in &in_rpc {
        assert_eq!(l["trace_id"], trace_id, "{l}");
        let span = l["span_id"].as_str().unwrap_or_else(|| panic!("{l}"));
        assert_eq!(span.len(), 16, "{l}");
        assert_ne!(
            span, "00f067aa0ba902b7",
            "mailroom's own span, not the caller's"
        );
    }
    assert!(
        lines
            .iter()
            .filter(|l| l["span"].is_null())
            .all(|l| l.get("trace_id").is_none()),
        "a line outside any span names no trace"
    );
    let record: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&sink)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(record["headers"]["traceparent"], tp.as_str(), "{record}");
}

/// Issue 28, item 3: the inbox's consumer gets a `receive` span per batch taken in
/// (messaging conventions: kind consumer, `messaging.operation.type=receive`), linked to
/// the trace of each record's producer; the handler call that follows is in that trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_receives_get_consumer_spans_linked_to_the_producer() {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let (collector, collector_port) = start_collector(None).await;
    let broker = Broker::start();
    let trace_id = "7c8efff798038103d269b633813fc60d";
    let tp = format!("00-{trace_id}-aee19b7ec3c1b175-01");
    // The record first, so that the topic exists when the consumer subscribes.
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.addr())
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::<str, [u8]>::to("traced.in")
                .key("k")
                .payload(b"x")
                .headers(OwnedHeaders::new().insert(Header {
                    key: "traceparent",
                    value: Some(tp.as_bytes()),
                })),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    let seen = TraceSeen::default();
    let handler = serve_handler(seen.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("mailroom.toml");
    std::fs::write(
        &toml,
        format!(
            "[[subscriptions]]\nname = \"billing\"\ntopics = [\"traced.in\"]\nhandler = \"{handler}\"\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .env("MAILROOM_CONFIG", &toml)
        .env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("m.db").display()),
        )
        .env("MAILROOM_KAFKA_BROKERS", broker.addr())
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{collector_port}"),
        )
        .env("RUST_LOG", "error")
        .env_remove("MAILROOM_OTLP_ENDPOINT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port, "mailroom listening").await;
    eventually(Duration::from_secs(30), "the handler called", || {
        let seen = seen.clone();
        async move { !seen.0.lock().unwrap().is_empty() }
    })
    .await;
    stop_gracefully(child).await;
    let spans = collector.spans.lock().unwrap().clone();
    let receive = spans
        .iter()
        .find(|s| s.name == "receive traced.in")
        .unwrap_or_else(|| panic!("no receive span among {spans:#?}"));
    // SpanKind::Consumer = 5.
    assert_eq!(receive.kind, 5, "{receive:?}");
    assert_attributes(
        receive,
        &[
            ("messaging.system", "kafka"),
            ("messaging.operation.type", "receive"),
            ("messaging.destination.name", "traced.in"),
            ("messaging.destination.subscription.name", "billing"),
            ("messaging.batch.message_count", "1"),
        ],
    );
    assert_eq!(receive.links, [trace_id], "linked to the producer's trace");
    assert!(
        spans
            .iter()
            .any(|s| s.name == "mailroom.v1.HandlerService/Handle" && s.trace_id == trace_id),
        "the handler call is in the producer's trace: {spans:#?}"
    );
}

//! Optional OTLP trace export: the binary, pointed at a collector, exports the span of an
//! `Enqueue` call inside the producer's trace (its W3C `traceparent`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use mailroom::pb;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use tokio_stream::wrappers::TcpListenerStream;

/// (trace id hex, span name) of every span received.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<(String, String)>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let id: String = s.trace_id.iter().map(|b| format!("{b:02x}")).collect();
                    spans.push((id, s.name));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_spans_join_the_producers_trace() {
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

    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("m.db").display()),
        )
        .env("MAILROOM_LOCAL_SINK", dir.path().join("out.jsonl"))
        .env("MAILROOM_OTLP_ENDPOINT", format!("http://{collector_addr}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "mailroom listening",
        || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        },
    )
    .await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
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
    // SIGTERM flushes the exporter on the way out.
    let pid = child.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status}");
    let spans = collector.spans.lock().unwrap().clone();
    assert!(
        spans
            .iter()
            .any(|(id, name)| id == trace_id && name == "rpc"),
        "no rpc span in the producer's trace among {spans:?}"
    );
}

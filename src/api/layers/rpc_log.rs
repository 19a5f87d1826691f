//! One span, one log line and one count per RPC, after OpenTelemetry's RPC conventions.

use std::time::Instant;

use tonic::codegen::http;

use super::{Inner, Middleware, MiddlewareLayer, Outcome};
use crate::metrics::Metrics;

/// Observes every RPC once it completes: logs method, gRPC code and latency, and counts
/// them in the metrics.
#[derive(Clone)]
pub struct RpcLog {
    metrics: Metrics,
}

/// The layer of `RpcLog`.
pub type RpcLogLayer = MiddlewareLayer<RpcLog>;

impl RpcLogLayer {
    /// The layer, counting into `metrics`.
    pub fn new(metrics: Metrics) -> Self {
        MiddlewareLayer(RpcLog { metrics })
    }
}

impl Middleware for RpcLog {
    fn call<S, B, RB>(&self, inner: &mut S, req: http::Request<B>) -> Outcome<RB, S::Error>
    where
        S: Inner<B, RB>,
        RB: Default + Send + 'static,
    {
        let method = req.uri().path().to_string();
        let start = Instant::now();
        // One span per RPC: everything the handler logs is inside it, and it ends with the
        // gRPC code and the latency. Named and tagged after OpenTelemetry's RPC
        // conventions (`telemetry::record_rpc`): `package.Service/Method`, kind server.
        let (service, name) = method
            .trim_start_matches('/')
            .split_once('/')
            .unwrap_or(("", method.as_str()));
        let span = tracing::info_span!(
            "rpc",
            otel.name = %method.trim_start_matches('/'),
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            rpc.system = tracing::field::Empty,
            rpc.system.name = tracing::field::Empty,
            rpc.service = tracing::field::Empty,
            rpc.method = tracing::field::Empty,
            rpc.grpc.status_code = tracing::field::Empty,
            rpc.response.status_code = tracing::field::Empty,
            rpc.code = tracing::field::Empty,
            latency_ms = tracing::field::Empty
        );
        crate::telemetry::record_rpc(&span, service, name);
        let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
        crate::telemetry::join_trace_state(&span, header("traceparent"), header("tracestate"));
        let fut = tracing::Instrument::instrument(inner.call(req), span.clone());
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let res = fut.await;
            let elapsed = start.elapsed();
            let ms = elapsed.as_secs_f64() * 1000.0;
            let code = match &res {
                // Unary errors travel as trailers-only responses: the status is in the
                // headers. A status sent in trailers (streams) counts as OK here.
                Ok(r) => r
                    .headers()
                    .get("grpc-status")
                    .map(|c| tonic::Code::from_bytes(c.as_bytes()))
                    .unwrap_or(tonic::Code::Ok),
                Err(e) => {
                    span.in_scope(|| tracing::warn!(error = %e, latency_ms = ms, "rpc failed"));
                    tonic::Code::Internal
                }
            };
            span.record("rpc.code", crate::pb::code_name(code));
            crate::telemetry::record_rpc_code(&span, code);
            // OpenTelemetry: a server span is an error for the server's own faults only.
            if matches!(
                code,
                tonic::Code::Unknown
                    | tonic::Code::DeadlineExceeded
                    | tonic::Code::Unimplemented
                    | tonic::Code::Internal
                    | tonic::Code::Unavailable
                    | tonic::Code::DataLoss
            ) {
                span.record("otel.status_code", "ERROR");
            }
            span.record("latency_ms", ms);
            span.in_scope(|| tracing::debug!("rpc done"));
            metrics.rpc(&method, code, elapsed);
            res
        })
    }
}

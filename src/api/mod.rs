//! The gRPC surface: services convert and validate, call the middle, and map errors in
//! `status`. `serve` assembles them with health, reflection and per-RPC logging.

pub mod admin;
pub mod auth;
pub mod convert;
pub mod inbox;
pub mod outbox;
pub mod overload;
pub mod status;

use std::task::{Context, Poll};
use std::time::Instant;

use tonic::codegen::http;
use tower::{Layer, Service};

/// Logs every RPC once it completes: method, gRPC status and latency, in a span.
#[derive(Clone, Default)]
pub struct RpcLogLayer;

impl<S> Layer<S> for RpcLogLayer {
    type Service = RpcLog<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RpcLog { inner }
    }
}

#[derive(Clone)]
pub struct RpcLog<S> {
    inner: S,
}

impl<S, B, RB> Service<http::Request<B>> for RpcLog<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Send,
    S::Future: Send + 'static,
    S::Error: std::fmt::Display,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = req.uri().path().to_string();
        let start = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            let ms = start.elapsed().as_secs_f64() * 1000.0;
            match &res {
                Ok(r) => {
                    // Unary errors travel as trailers-only responses: status in the headers.
                    let code = r
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .map(|c| tonic::Code::from_bytes(c.as_bytes()))
                        .unwrap_or(tonic::Code::Ok);
                    tracing::debug!(rpc.method = %method, rpc.code = ?code, latency_ms = ms, "rpc");
                }
                Err(e) => {
                    tracing::warn!(rpc.method = %method, error = %e, latency_ms = ms, "rpc failed")
                }
            }
            res
        })
    }
}

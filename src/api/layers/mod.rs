//! The tower layers every RPC passes through, outermost first: `rpc_log` (span, log
//! line, metrics), `authenticate` (token and scope), `overload` (concurrency limit,
//! deadline), `admission` (what each request becomes, counted as it arrives, with `walk`
//! counting the elements of its repeated fields); `shares` bounds what one principal
//! holds of the last two. Each is a `Middleware`, what it does around one request; `MiddlewareLayer`
//! makes any of them a tower layer, so the Layer/Service plumbing is written once.

mod admission;
mod authenticate;
mod overload;
mod rpc_log;
mod shares;
pub mod walk;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::codegen::http;
use tower::{Layer, Service};

pub use admission::{ByteAdmission, ByteAdmissionLayer, DEFAULT_LIMIT, Rule, Rules};
pub use authenticate::{AuthLayer, Authenticate};
pub use overload::{Overload, OverloadConfig, OverloadLayer};
pub use rpc_log::{RpcLog, RpcLogLayer};
pub use shares::Shares;

/// The answer a middleware gives for one request, later.
pub type Outcome<RB, E> = Pin<Box<dyn Future<Output = Result<http::Response<RB>, E>> + Send>>;

/// What a layer does with one request: answer it itself, or call `inner` (and watch the
/// answer).
pub trait Middleware: Clone + Send + Sync + 'static {
    /// Handles `req`, calling `inner` when it passes it on.
    fn call<S, B, RB>(&self, inner: &mut S, req: http::Request<B>) -> Outcome<RB, S::Error>
    where
        S: Inner<B, RB>,
        RB: Default + Send + 'static;
}

/// The service a middleware wraps: the routes, or the next layer.
pub trait Inner<B, RB>:
    Service<
        http::Request<B>,
        Response = http::Response<RB>,
        Future: Send + 'static,
        Error: std::fmt::Display + Send + 'static,
    > + Send
{
}

impl<S, B, RB> Inner<B, RB> for S where
    S: Service<
            http::Request<B>,
            Response = http::Response<RB>,
            Future: Send + 'static,
            Error: std::fmt::Display + Send + 'static,
        > + Send
{
}

/// A `Middleware` as a tower layer.
#[derive(Clone)]
pub struct MiddlewareLayer<M>(M);

impl<S, M: Clone> Layer<S> for MiddlewareLayer<M> {
    type Service = WithMiddleware<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        WithMiddleware {
            inner,
            middleware: self.0.clone(),
        }
    }
}

/// A service behind a `Middleware`.
#[derive(Clone)]
pub struct WithMiddleware<S, M> {
    inner: S,
    middleware: M,
}

impl<S, M, B, RB> Service<http::Request<B>> for WithMiddleware<S, M>
where
    M: Middleware,
    S: Service<http::Request<B>, Response = http::Response<RB>> + Inner<B, RB>,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = Outcome<RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        self.middleware.call(&mut self.inner, req)
    }
}

//! Overload protection in front of the gRPC services: a concurrency limit shared by all
//! connections that sheds load instead of queueing it, and a server-side time limit.
//!
//! - More than `max_concurrent_rpcs` RPCs in flight: the next is answered
//!   `RESOURCE_EXHAUSTED` at once, before its body is read (a semaphore tried without
//!   waiting, so that the refusal is a gRPC status rather than a queue or a transport
//!   error). Bytes in flight are `admission`'s.
//! - An RPC still running after `rpc_timeout`: answered `UNAVAILABLE`. An enqueue whose
//!   commit was already under way may still commit: the client retries with its
//!   idempotency key and gets the stored id back.
//!
//! - A principal holding its share of the slots (`shares`): its next RPC is answered
//!   `RESOURCE_EXHAUSTED` at once, while other callers keep theirs.
//!
//! Health checks bypass all of these, so that probes keep working while the server sheds
//! load.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tonic::codegen::http;

use super::shares::{Shares, principal_of};
use super::{Inner, Middleware, MiddlewareLayer, Outcome};

/// Limits that keep the server answering under load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverloadConfig {
    /// RPCs in flight at once; 0 = no limit.
    pub max_concurrent_rpcs: usize,
    /// Longest an RPC may run in the server.
    pub rpc_timeout: Option<Duration>,
    /// Request bytes in flight at once (`admission`); 0 = no limit.
    pub max_request_bytes: usize,
    /// Time for a request's message to arrive whole (`admission`).
    pub body_timeout: Option<Duration>,
    /// The most one principal may hold of the RPC slots and of the bytes in flight, in
    /// percent; 100: no bound beyond the server's.
    pub principal_share_percent: u32,
}

impl Default for OverloadConfig {
    fn default() -> Self {
        OverloadConfig {
            max_concurrent_rpcs: 1024,
            rpc_timeout: Some(Duration::from_secs(30)),
            max_request_bytes: 128 * 1024 * 1024,
            body_timeout: Some(Duration::from_secs(10)),
            principal_share_percent: 50,
        }
    }
}

/// Refuses RPCs past the concurrency limit and cuts them at the deadline.
#[derive(Clone)]
pub struct Overload {
    permits: Option<Arc<Semaphore>>,
    slots: usize,
    shares: Option<Arc<Shares>>,
    timeout: Option<Duration>,
}

/// The layer of `Overload`.
pub type OverloadLayer = MiddlewareLayer<Overload>;

impl OverloadLayer {
    /// The layer for `c`, each principal holding at most its share of the slots.
    pub fn new(c: OverloadConfig, shares: Option<Arc<Shares>>) -> Self {
        MiddlewareLayer(Overload {
            permits: (c.max_concurrent_rpcs > 0)
                .then(|| Arc::new(Semaphore::new(c.max_concurrent_rpcs))),
            slots: c.max_concurrent_rpcs,
            shares: shares.filter(|_| c.max_concurrent_rpcs > 0),
            timeout: c.rpc_timeout,
        })
    }
}

fn exempt(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/")
}

impl Middleware for Overload {
    fn call<S, B, RB>(&self, inner: &mut S, req: http::Request<B>) -> Outcome<RB, S::Error>
    where
        S: Inner<B, RB>,
        RB: Default + Send + 'static,
    {
        if exempt(req.uri().path()) {
            return Box::pin(inner.call(req));
        }
        let permit = match &self.permits {
            None => None,
            Some(p) => match p.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    return Box::pin(async {
                        Ok(crate::api::status::status(
                            tonic::Code::ResourceExhausted,
                            "server busy: too many requests in flight; retry with backoff",
                            crate::api::status::reason::SERVER_BUSY,
                            Default::default(),
                            Some(crate::api::status::RETRY_OVERLOADED),
                        )
                        .into_http())
                    });
                }
            },
        };
        let share = match (&self.shares, principal_of(req.extensions())) {
            (Some(shares), Some(who)) => match shares.take_rpc(who, self.slots) {
                Some(share) => Some(share),
                None => {
                    let percent = shares.percent();
                    return Box::pin(async move {
                        Ok(crate::api::status::status(
                            tonic::Code::ResourceExhausted,
                            format!(
                                "server busy for this caller: it holds its share of the RPC \
                                 slots ({percent} % of MAILROOM_MAX_CONCURRENT_RPCS, \
                                 MAILROOM_PRINCIPAL_SHARE_PERCENT); retry with backoff"
                            ),
                            crate::api::status::reason::SERVER_BUSY,
                            Default::default(),
                            Some(crate::api::status::RETRY_OVERLOADED),
                        )
                        .into_http())
                    });
                }
            },
            _ => None,
        };
        let fut = inner.call(req);
        let timeout = self.timeout;
        Box::pin(async move {
            let res = match timeout {
                None => fut.await,
                Some(t) => match tokio::time::timeout(t, fut).await {
                    Ok(r) => r,
                    Err(_) => Ok(crate::api::status::status(
                        tonic::Code::Unavailable,
                        "request timed out in the server; retry with backoff",
                        crate::api::status::reason::SERVER_TIMEOUT,
                        Default::default(),
                        Some(crate::api::status::RETRY_OVERLOADED),
                    )
                    .into_http()),
                },
            };
            drop((permit, share));
            res
        })
    }
}

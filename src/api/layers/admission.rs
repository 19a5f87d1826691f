//! Admission by bytes (issue 25, item 4): the count of RPCs in flight (`overload`) does
//! not bound memory, since one `EnqueueBatch` may carry up to `max_batch_bytes` (64 MiB by
//! default) and tonic buffers a request whole before the handler runs. This layer reads
//! the first 5 bytes of each request body, the gRPC length prefix, and admits the
//! request only when its declared size fits the server's budget of request bytes in
//! flight (`max_request_bytes_in_flight`); otherwise the answer is `RESOURCE_EXHAUSTED`
//! with a retry delay, before the message is read. The bytes stay counted until the
//! handler has answered (the decoded events live as long), then return to the budget.
//! Health checks bypass it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::codegen::http;
use tower::{Layer, Service};

/// The gRPC message prefix: a compression flag and a 4-byte big-endian length.
const PREFIX: usize = 5;
/// The prefix's length, as the budget counts bytes.
const PREFIX_BYTES: u32 = 5;

/// The budget of request bytes in flight, shared by every connection.
#[derive(Clone)]
pub struct ByteAdmissionLayer {
    budget: Option<Arc<Semaphore>>,
    total: u32,
}

impl ByteAdmissionLayer {
    /// A budget of `bytes` (0: no limit).
    pub fn new(bytes: usize) -> Self {
        let total = u32::try_from(bytes.min(Semaphore::MAX_PERMITS)).unwrap_or(u32::MAX);
        ByteAdmissionLayer {
            budget: (bytes > 0).then(|| Arc::new(Semaphore::new(total as usize))),
            total,
        }
    }
}

impl<S> Layer<S> for ByteAdmissionLayer {
    type Service = ByteAdmission<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ByteAdmission {
            inner,
            budget: self.budget.clone(),
            total: self.total,
        }
    }
}

/// See the module documentation.
#[derive(Clone)]
pub struct ByteAdmission<S> {
    inner: S,
    budget: Option<Arc<Semaphore>>,
    total: u32,
}

type Answer<RB, E> = Pin<Box<dyn Future<Output = Result<http::Response<RB>, E>> + Send>>;

impl<S, RB> Service<http::Request<Body>> for ByteAdmission<S>
where
    S: Service<http::Request<Body>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = Answer<RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let Some(budget) = self.budget.clone() else {
            return Box::pin(self.inner.call(req));
        };
        if req.uri().path().starts_with("/grpc.health.v1.Health/") {
            return Box::pin(self.inner.call(req));
        }
        // The service that was polled ready goes into the future; a clone stays.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let total = self.total;
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let (head, body) = read_prefix(body).await;
            let declared = declared_len(&head);
            // One request larger than the whole budget is still admitted alone; the
            // per-method limit then refuses it before reading it.
            let want = declared.saturating_add(PREFIX_BYTES).min(total).max(1);
            let Ok(permit) = budget.try_acquire_many_owned(want) else {
                tracing::debug!(declared, "request refused: bytes in flight over the budget");
                return Ok(crate::api::status::status(
                    tonic::Code::ResourceExhausted,
                    format!(
                        "server busy: {declared} bytes would take the requests in flight over \
                         MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT ({total}); retry with backoff"
                    ),
                    crate::api::status::reason::SERVER_BUSY,
                    Default::default(),
                    Some(crate::api::status::RETRY_OVERLOADED),
                )
                .into_http());
            };
            let answer = inner
                .call(http::Request::from_parts(parts, body.prepend(head)))
                .await;
            drop(permit);
            answer
        })
    }
}

/// The request body with its first bytes read off (at least the prefix, unless the body
/// ends or fails first; a failure is left for the decoder to meet).
struct Peeked {
    rest: Body,
    ended: bool,
}

impl Peeked {
    /// The whole body again: `head`, then the rest.
    fn prepend(self, head: Bytes) -> Body {
        let first =
            futures::stream::once(async move { Ok::<_, Infallible>(http_body::Frame::data(head)) });
        if self.ended {
            return Body::new(http_body_util::StreamBody::new(first));
        }
        let rest =
            futures::TryStreamExt::map_ok(self.rest.into_data_stream(), http_body::Frame::data);
        let first = futures::StreamExt::map(first, |r| r.map_err(|never| match never {}));
        Body::new(http_body_util::StreamBody::new(futures::StreamExt::chain(
            first, rest,
        )))
    }
}

async fn read_prefix(mut body: Body) -> (Bytes, Peeked) {
    let mut head = BytesMut::new();
    let mut ended = false;
    while head.len() < PREFIX {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    head.extend_from_slice(&data);
                }
            }
            // An error or the end: the decoder will answer as it always did.
            Some(Err(_)) | None => {
                ended = true;
                break;
            }
        }
    }
    (head.freeze(), Peeked { rest: body, ended })
}

/// The message length the prefix declares (0 when there is no whole prefix).
fn declared_len(head: &[u8]) -> u32 {
    match head.get(1..PREFIX) {
        Some(b) => u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_declares_the_length() {
        assert_eq!(declared_len(&[0, 0, 0, 1, 0, 9, 9]), 256);
        assert_eq!(declared_len(&[1, 0x04, 0, 0, 0]), 64 * 1024 * 1024);
        assert_eq!(declared_len(&[0, 0]), 0);
    }
}

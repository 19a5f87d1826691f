//! The console's and the metrics' HTTP/1.1 servers (issue 25, item 1). `axum::serve`
//! reads request headers for as long as a client cares to send them and accepts any
//! number of connections, so a handful of slow clients (slowloris) could hold every
//! socket and task. Here each connection must send its request headers within
//! [`HEADER_READ_TIMEOUT`] (then it is closed), each request must be read and answered
//! within [`REQUEST_TIMEOUT`] (a body that trickles or stalls gets `408` and the
//! connection is closed), and at most [`MAX_CONNECTIONS`] are open at once (past that, a
//! new connection is closed at once and logged). Each request carries its peer address
//! as `axum::extract::ConnectInfo`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// How long a client may take to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request may take from its headers to its answer, body included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections open at once, per server.
pub const MAX_CONNECTIONS: usize = 256;

/// Serves `router` on `listener` until `shutdown` (`what` names the server in logs).
pub async fn serve(
    listener: TcpListener,
    router: axum::Router,
    shutdown: CancellationToken,
    what: &'static str,
) {
    serve_with(listener, router, shutdown, what, REQUEST_TIMEOUT).await
}

/// [`serve`] with another request deadline (tests).
pub async fn serve_with(
    listener: TcpListener,
    router: axum::Router,
    shutdown: CancellationToken,
    what: &'static str,
    request_timeout: Duration,
) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    tracing::warn!(error = %e, server = what, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, server = what, max = MAX_CONNECTIONS, "connection refused: too many open");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let router =
            router
                .clone()
                .layer(axum::Extension(axum::extract::ConnectInfo::<SocketAddr>(
                    peer,
                )));
        let service = hyper_util::service::TowerToHyperService::new(tower::service_fn(
            move |req: axum::extract::Request<hyper::body::Incoming>| {
                let mut router = router.clone();
                async move {
                    use tower::Service as _;
                    let answer = tokio::time::timeout(request_timeout, router.call(req)).await;
                    Ok::<_, std::convert::Infallible>(match answer {
                        Ok(Ok(r)) => r,
                        Ok(Err(never)) => match never {},
                        Err(_) => {
                            let mut r = axum::response::Response::new(axum::body::Body::from(
                                "request timed out\n",
                            ));
                            *r.status_mut() = axum::http::StatusCode::REQUEST_TIMEOUT;
                            r.headers_mut().insert(
                                axum::http::header::CONNECTION,
                                axum::http::HeaderValue::from_static("close"),
                            );
                            r
                        }
                    })
                }
            },
        ));
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, %peer, server = what, "connection ended");
                    }
                }
                _ = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(permit);
        });
    }
}

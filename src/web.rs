//! The console's and the metrics' HTTP/1.1 servers (issue 25, item 1). `axum::serve`
//! reads request headers for as long as a client cares to send them and accepts any
//! number of connections, so a handful of slow clients (slowloris) could hold every
//! socket and task. Here each connection must send its request headers within
//! [`HEADER_READ_TIMEOUT`] (then it is closed), each request must be read and answered
//! within [`REQUEST_TIMEOUT`] (a body that trickles or stalls gets `408` and the
//! connection is closed), and at most [`MAX_CONNECTIONS`] are open at once (past that, a
//! new connection is closed at once and logged). Each request carries its peer address
//! as `axum::extract::ConnectInfo`.
//!
//! Both answer only to their own names ([`Hosts`]): after a DNS rebind a hostile page's
//! requests reach a loopback server with the attacker's name in `Host`.

use std::collections::HashSet;
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

/// The `Host` values a server answers to, lower-cased.
#[derive(Clone)]
pub struct Hosts {
    names: Arc<HashSet<String>>,
    ip_literals: bool,
}

impl Hosts {
    /// The server's own address and localhost's names with its port, and `extra`
    /// (`name` or `name:port`; a bare name matches any port).
    pub fn new(addr: SocketAddr, extra: &[String]) -> Hosts {
        let port = addr.port();
        let mut set: HashSet<String> = [
            addr.to_string(),
            format!("localhost:{port}"),
            format!("127.0.0.1:{port}"),
            format!("[::1]:{port}"),
        ]
        .into_iter()
        .collect();
        set.extend(extra.iter().map(|h| h.to_ascii_lowercase()));
        Hosts {
            names: Arc::new(set),
            ip_literals: false,
        }
    }

    /// Also any IP address, with any port. A rebinding page always sends a name (its
    /// origin is one); scrapers that find their targets by address (Kubernetes pod IPs,
    /// a port published by Docker) send the address they connected to.
    pub fn and_ip_addresses(mut self) -> Hosts {
        self.ip_literals = true;
        self
    }

    /// Whether a request with this `Host` is answered.
    pub fn allows(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        if self.names.contains(&host) || (self.ip_literals && is_ip_address(&host)) {
            return true;
        }
        // A configured bare name covers any port the proxy forwards with (the server's
        // own names are in the set with their port only).
        match host.rsplit_once(':') {
            Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
                self.names.contains(name)
            }
            _ => false,
        }
    }
}

/// `1.2.3.4`, `1.2.3.4:80`, `[::1]`, `[::1]:80`.
fn is_ip_address(host: &str) -> bool {
    host.parse::<SocketAddr>().is_ok()
        || host.parse::<std::net::Ipv4Addr>().is_ok()
        || host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .is_some_and(|h| h.parse::<std::net::Ipv6Addr>().is_ok())
}

/// `router` answering only requests whose `Host` `hosts` allows; others get `421
/// Misdirected Request` and a warning naming `what` and the setting that adds names.
pub fn only_for(
    router: axum::Router,
    hosts: Hosts,
    what: &'static str,
    setting: &'static str,
) -> axum::Router {
    use axum::response::IntoResponse as _;
    router.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let hosts = hosts.clone();
            async move {
                let host = req
                    .headers()
                    .get(http::header::HOST)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                if hosts.allows(host) {
                    return next.run(req).await;
                }
                tracing::warn!(
                    host,
                    server = what,
                    "request for a host this server does not serve refused (421)"
                );
                (
                    http::StatusCode::MISDIRECTED_REQUEST,
                    format!("this server does not answer to that host name (see {setting})"),
                )
                    .into_response()
            }
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_servers_own_names_are_served() {
        let addr: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let h = Hosts::new(
            addr,
            &["console.example.com".into(), "ops.example.com:8443".into()],
        );
        for ok in [
            "127.0.0.1:8080",
            "localhost:8080",
            "LOCALHOST:8080",
            "[::1]:8080",
            "console.example.com",
            "console.example.com:443",
            "ops.example.com:8443",
        ] {
            assert!(h.allows(ok), "{ok}");
        }
        for refused in [
            "a.test:8080",
            "a.test",
            "",
            "localhost:9999",
            "127.0.0.1:9999",
            "10.1.2.3:8080",
            "ops.example.com:9999",
            "evil.console.example.com",
        ] {
            assert!(!h.allows(refused), "{refused}");
        }
        let h = h.and_ip_addresses();
        for ok in ["10.1.2.3:8080", "10.1.2.3", "[fd00::1]:9090", "[fd00::1]"] {
            assert!(h.allows(ok), "{ok}");
        }
        for refused in [
            "a.test:8080",
            "10.1.2.3.a.test",
            "1.2.3.4.nip.io:8080",
            "[a.test]",
        ] {
            assert!(!h.allows(refused), "{refused}");
        }
    }
}

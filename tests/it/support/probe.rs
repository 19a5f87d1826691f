//! Probes of a running service from the outside: its gRPC health and its metrics page.

/// The `grpc.health.v1` status of `service` (1 SERVING, 2 NOT_SERVING), if it answers.
pub async fn health_status(addr: std::net::SocketAddr, service: &str) -> Option<i32> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let mut h = HealthClient::new(super::channel(addr).await);
    h.check(HealthCheckRequest {
        service: service.into(),
    })
    .await
    .ok()
    .map(|r| r.into_inner().status)
}

/// Waits (`timeout` at most; `what` names it in the failure) until the server's overall
/// health is `want`.
pub async fn wait_health(
    addr: std::net::SocketAddr,
    want: i32,
    timeout: std::time::Duration,
    what: &str,
) {
    let reached = || async move { health_status(addr, "").await == Some(want) };
    super::eventually(timeout, what, reached).await;
}

/// GETs `/metrics` with a bare HTTP/1.1 request, `Host` its own address.
pub async fn scrape(addr: std::net::SocketAddr) -> String {
    let out = get_with_host(addr, "/metrics", &addr.to_string()).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

/// GETs `path` with a bare HTTP/1.1 request naming `host`; the whole response.
pub async fn get_with_host(addr: std::net::SocketAddr, path: &str, host: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The value of one sample line (`name{labels} value`). A series that is not on the page
/// fails the test: reading it as 0 would hide a renamed or missing metric.
pub fn sample(text: &str, series: &str) -> f64 {
    sample_opt(text, series)
        .unwrap_or_else(|| panic!("metric series {series} is not exported; the page was:\n{text}"))
}

/// The body of a raw HTTP response from `scrape`.
pub fn body(response: &str) -> &str {
    response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or(response)
}

/// The value of one sample line, or `None` while the series is not on the page yet (for
/// polling loops that wait for a series to appear; assertions use `sample`).
pub fn sample_opt(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .map(|v| v.trim().parse().unwrap())
}

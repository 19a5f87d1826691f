//! Issue 43, item 2: connections that never speak are closed, and they cannot lock out
//! a client that does (`src/api/connections.rs`, docs/security.md "Connections").

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::support::*;
use mailroom::pb;
use mailroom::pb::outbox_service_client::OutboxServiceClient;

/// Descriptors the process `pid` holds open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// One fresh client (a new connection) enqueues once, within `within`.
async fn fresh_enqueue(port: u16, i: usize, within: Duration) -> Result<(), String> {
    let call = async {
        let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
            .map_err(|e| format!("connect: {e}"))?;
        OutboxServiceClient::new(channel)
            .enqueue(pb::EnqueueRequest {
                event: Some(event("fresh", &format!("k{i}"), b"x")),
            })
            .await
            .map_err(|e| format!("enqueue: {e}"))?;
        Ok::<(), String>(())
    };
    tokio::time::timeout(within, call)
        .await
        .map_err(|_| "timed out".to_string())?
}

/// 2,000 sockets connect to the gRPC port and send nothing, against the binary run with
/// a common open-file limit of 1,024. Throughout, a fresh client connects and enqueues
/// every 250 ms, and every one is answered; within 10 s every silent socket has been
/// closed by the server, and the process is back to a few dozen descriptors. Before: the
/// process reached 1,024 descriptors and 1,139 of the silent sockets were still open
/// 40 s later (no preface deadline, no cap; tonic's accept loop also ends on `EMFILE`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_and_never_lock_out_a_client() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = std::process::Command::new("bash")
        .arg("-c")
        .arg("ulimit -n 1024 && exec \"$0\"")
        .arg(env!("CARGO_BIN_EXE_mailroom"))
        .env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.path().join("m.db").display()),
        )
        .env("MAILROOM_LOCAL_SINK", dir.path().join("sink.jsonl"))
        .env("MAILROOM_RELAYS", "0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let start = Instant::now();
    while fresh_enqueue(port, 0, Duration::from_secs(2))
        .await
        .is_err()
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "mailroom did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let baseline = open_fds(pid);

    // The silent sockets, opened from a thread while fresh clients call.
    let silent = std::thread::spawn(move || {
        (0..2000)
            .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
            .collect::<Vec<_>>()
    });
    let mut failures = Vec::new();
    let mut peak = 0;
    let calls_from = Instant::now();
    let mut i = 1;
    while calls_from.elapsed() < Duration::from_secs(8) {
        if let Err(e) = fresh_enqueue(port, i, Duration::from_secs(3)).await {
            failures.push(format!("call {i} at {:?}: {e}", calls_from.elapsed()));
        }
        peak = peak.max(open_fds(pid));
        i += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let silent = silent.join().unwrap();
    let connected = silent.len();
    println!(
        "silent sockets connected {connected}, fresh calls {}, failed {}, descriptors: baseline {baseline}, peak {peak}",
        i - 1,
        failures.len()
    );
    assert!(
        connected >= 1900,
        "the silent sockets connected ({connected})"
    );
    assert_eq!(
        failures,
        Vec::<String>::new(),
        "every fresh client was answered"
    );

    // Every silent socket is closed by the server within 10 s of the last one.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut open = connected;
    while Instant::now() < deadline {
        open = silent
            .iter()
            .filter(|s| {
                s.set_nonblocking(true).unwrap();
                let mut b = [0u8; 64];
                match (&**s).read(&mut b) {
                    Ok(0) => false,
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                }
            })
            .count();
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let after = open_fds(pid);
    println!("still open after the deadline: {open}; descriptors now {after}");
    assert_eq!(open, 0, "silent sockets the server kept");
    assert!(
        after < baseline + 50,
        "descriptors {after} (baseline {baseline})"
    );
    fresh_enqueue(port, i, Duration::from_secs(3))
        .await
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
}

/// The console's and the metrics' HTTP servers (`web::serve`) answer a request whose
/// body stalls with `408` once the request deadline passes, and close the connection;
/// a request that completes is answered as usual. Before: the handler waited for the
/// body for as long as the client kept the connection.
#[tokio::test]
async fn a_stalled_request_body_on_the_side_ports_gets_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let router = axum::Router::new().route(
        "/echo",
        axum::routing::post(|body: String| async move { body }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(mailroom::web::serve_with(
        listener,
        router,
        shutdown.clone(),
        "test",
        Duration::from_millis(500),
    ));
    let post = |body: &str, declared: usize| {
        format!("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n{body}")
    };
    // Whole: answered.
    let mut ok = tokio::net::TcpStream::connect(addr).await.unwrap();
    ok.write_all(post("hello", 5).as_bytes()).await.unwrap();
    let mut got = vec![0u8; 1024];
    let n = ok.read(&mut got).await.unwrap();
    assert!(String::from_utf8_lossy(&got[..n]).starts_with("HTTP/1.1 200"));
    // Declares 100 bytes, sends 10, stalls.
    let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
    stalled
        .write_all(post("0123456789", 100).as_bytes())
        .await
        .unwrap();
    let t = Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut answer))
        .await
        .expect("the server answered and closed within the deadline")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    shutdown.cancel();
}

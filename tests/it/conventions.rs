//! The conventions generic gRPC tools assume (issue 14): server reflection in both
//! versions, standard error details, and an operator client whose `--help` is its own.

use std::time::Duration;

use crate::support::*;
use mailroom::api::status::{DOMAIN, reason};
use mailroom::pb;
use tonic::Code;
use tonic_types::StatusExt;

/// Python's grpcio-reflection speaks only `grpc.reflection.v1alpha`: with it, a client
/// with no stubs finds OutboxService.Enqueue and calls it. grpcurl's `v1` works too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_serves_v1_and_v1alpha() {
    let (_url, s) = quiet_pg().await;
    let seen = run_json(
        "python3",
        "tests/python/reflection_client.py",
        &[s.app.addr.to_string()],
        &[],
        "python3 is required (scripts/test.sh installs grpcio-reflection)",
        "v1alpha reflection client",
    )
    .await;
    let services: Vec<&str> = seen["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for want in [
        "mailroom.v1.OutboxService",
        "mailroom.v1.AdminService",
        "mailroom.v1.InboxService",
        "grpc.health.v1.Health",
    ] {
        assert!(services.contains(&want), "{want} not in {services:?}");
    }
    // Only what is served: subscribers serve HandlerService, mailroom calls it.
    assert!(
        !services.contains(&"mailroom.v1.HandlerService"),
        "{services:?}"
    );
    let id = seen["id"].as_i64().expect("an id from Enqueue");
    let stored = s.stored(mailroom::domain::BoxKind::Outbox, id).await;
    assert_eq!(stored.topic, "reflected");

    // v1, as grpcurl and tonic's client speak it.
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut v1 = ServerReflectionClient::new(channel(s.app.addr).await);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = v1
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    match answer.message_response {
        Some(MessageResponse::ListServicesResponse(l)) => {
            let mut names: Vec<&str> = l.service.iter().map(|s| s.name.as_str()).collect();
            names.sort_unstable();
            assert_eq!(
                names,
                [
                    "grpc.health.v1.Health",
                    "grpc.reflection.v1.ServerReflection",
                    "mailroom.v1.AdminService",
                    "mailroom.v1.InboxService",
                    "mailroom.v1.OutboxService",
                ]
            );
        }
        other => panic!("{other:?}"),
    }
    s.app.stop().await.unwrap();
}

/// The `grpc-retry-pushback-ms` trailer of a status, if any.
fn pushback(s: &tonic::Status) -> Option<i64> {
    s.metadata()
        .get("grpc-retry-pushback-ms")
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

fn reason_of(s: &tonic::Status) -> String {
    let info = s
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {s:?}"));
    assert_eq!(info.domain, DOMAIN);
    info.reason.clone()
}

/// Errors a caller branches on carry `google.rpc.ErrorInfo` with a stable reason; the
/// retryable ones (`UNAVAILABLE`, `RESOURCE_EXHAUSTED` from load) carry `RetryInfo`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_carry_error_info_and_retry_info() {
    let (url, mut s) = quiet_pg().await;

    // INVALID_ARGUMENT: BadRequest and ErrorInfo.
    let e = enqueue_err(&mut s.client, Some(event("bad topic", "", b""))).await;
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(reason_of(&e), reason::INVALID_ARGUMENT);
    assert!(e.get_details_bad_request().is_some());
    assert!(e.get_details_retry_info().is_none());

    // ALREADY_EXISTS: the idempotency key in the metadata.
    let mut first = event("conv", "k", b"one");
    first.idempotency_key = "idem-1".into();
    enqueue(&mut s.client, first.clone()).await;
    first.payload = b"two".to_vec();
    let e = enqueue_err(&mut s.client, Some(first)).await;
    assert_eq!(e.code(), Code::AlreadyExists);
    assert_eq!(reason_of(&e), reason::IDEMPOTENCY_KEY_REUSED);
    assert_eq!(
        e.get_details_error_info().unwrap().metadata["idempotency_key"],
        "idem-1"
    );

    // RESOURCE_EXHAUSTED for size: a reason, and no RetryInfo (the same request cannot
    // succeed later).
    let huge = event("conv", "k", &vec![0u8; 4 * 1024 * 1024]);
    let e = enqueue_err(&mut s.client, Some(huge)).await;
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(reason_of(&e), reason::REQUEST_TOO_LARGE);
    assert!(e.get_details_retry_info().is_none());
    // gRFC A6: a negative pushback tells a client's built-in retries not to retry.
    assert_eq!(pushback(&e), Some(-1), "{e:?}");
    s.app.stop().await.unwrap();

    // UNAVAILABLE from the server's request timeout: RetryInfo with a delay. The enqueue
    // is held past the timeout for certain: another transaction holds its key row (a
    // timeout of a nanosecond alone lost the race to a fast commit on a quiet machine).
    let mut c = quiet_config(&url);
    c.overload.rpc_timeout = Some(Duration::from_millis(300));
    let mut s = Service::start(c).await;
    // The first enqueue only creates the key row the lock needs. On a loaded machine it can
    // itself outlast the 300 ms timeout (seen once in CI), so it is tried until it succeeds.
    let mut tries = 0;
    while let Err(e) = s
        .client
        .enqueue(pb::EnqueueRequest {
            event: Some(event("conv", "slow", b"first")),
        })
        .await
    {
        tries += 1;
        assert!(
            e.code() == Code::Unavailable && tries < 20,
            "the key row's enqueue: {e:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (mut locker, locked) = hold_in_transaction(
        &url,
        "SELECT 1 FROM outbox_keys WHERE topic = 'conv' AND event_key = 'slow' FOR UPDATE",
    )
    .await;
    assert_eq!(locked, 1, "the key row is locked");
    let e = enqueue_err(&mut s.client, Some(event("conv", "slow", b"x"))).await;
    sqlx::query("ROLLBACK").execute(&mut locker).await.unwrap();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(reason_of(&e), reason::SERVER_TIMEOUT);
    let delay = e.get_details_retry_info().unwrap().retry_delay.unwrap();
    assert!(delay > Duration::ZERO);
    // The delay as gRPC's own retries read it, with up to half again of jitter.
    let ms = delay.as_millis() as i64;
    let p = pushback(&e).expect("a pushback");
    assert!(
        (ms..=ms + ms / 2).contains(&p),
        "{p} for a delay of {ms} ms"
    );
    s.app.stop().await.unwrap();

    // RESOURCE_EXHAUSTED from load: one RPC in flight at most, sixteen batches at once.
    let mut c = quiet_config(&url);
    c.overload.max_concurrent_rpcs = 1;
    let s = Service::start(c).await;
    let mut seen_busy = None;
    let mut calls = Vec::new();
    for _ in 0..16 {
        let mut client = s.client.clone();
        calls.push(tokio::spawn(async move {
            let events = (0..500)
                .map(|i| event("conv.busy", &format!("k{i}"), &[0u8; 512]))
                .collect();
            client
                .enqueue_batch(pb::EnqueueBatchRequest { events })
                .await
        }));
    }
    for c in calls {
        if let Err(e) = c.await.unwrap() {
            seen_busy = Some(e);
        }
    }
    let e = seen_busy.expect("sixteen concurrent batches against a limit of one: some are refused");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(reason_of(&e), reason::SERVER_BUSY);
    assert!(e.get_details_retry_info().unwrap().retry_delay.is_some());
    s.app.stop().await.unwrap();
}

/// `mailroom admin --help` lists the operator client's options, not the server's.
#[test]
fn admin_help_shows_only_the_client_options() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .args(["admin", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for want in [
        "--server",
        "--token",
        "--json",
        "--inbox",
        "--subscription",
        "requeue",
    ] {
        assert!(help.contains(want), "{want} missing from:\n{help}");
    }
    for server_only in [
        "--database-url",
        "--kafka-brokers",
        "--relay-lease-ms",
        "--listen ",
    ] {
        assert!(!help.contains(server_only), "{server_only} in:\n{help}");
    }
    assert!(help.lines().count() < 40, "{help}");
    assert!(help.starts_with("Operate a running mailroom"), "{help}");
    // A subcommand's help too.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .args(["admin", "pending", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("--topic") && !help.contains("--database-url"),
        "{help}"
    );
    // The server's own help still lists its settings and the admin command.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--database-url") && help.contains("admin"));
}

/// Every test the documentation cites exists: a backticked name whose last segment is a
/// snake_case name of three or more words counts as a citation when it goes through a
/// `tests` module, starts with a module of this suite (`faults::…`), or follows the
/// word "test" ("test `x`", "tested by `x`"). Each must be a `fn` in `tests/`, `src/` or
/// `bench/`.
#[test]
fn every_test_the_docs_cite_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut fns = std::collections::HashSet::new();
    let mut suite_modules = std::collections::HashSet::new();
    for dir in ["tests", "src", "bench/src"] {
        for file in rust_files(&root.join(dir)) {
            let text = std::fs::read_to_string(&file).expect("read a source file");
            for word in text.split("fn ").skip(1) {
                let name: String = word
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                fns.insert(name);
            }
        }
    }
    for file in rust_files(&root.join("tests/it")) {
        if let Some(stem) = file.file_stem().and_then(|s| s.to_str()) {
            suite_modules.insert(stem.to_string());
        }
    }
    let mut docs: Vec<std::path::PathBuf> = vec![root.join("README.md")];
    for dir in ["docs", "deploy"] {
        for entry in std::fs::read_dir(root.join(dir)).expect("read docs") {
            let path = entry.expect("a docs entry").path();
            if path.extension().is_some_and(|e| e == "md") {
                docs.push(path);
            }
        }
    }
    let mut cited = 0;
    let mut missing = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).expect("read a doc");
        for (n, line) in text.lines().enumerate() {
            for (i, token) in line.split('`').enumerate().filter(|(i, _)| i % 2 == 1) {
                let last = token.rsplit("::").next().unwrap_or(token);
                let words: Vec<&str> = last.split('_').collect();
                let snake = words.len() >= 3
                    && words.iter().all(|w| {
                        !w.is_empty()
                            && w.chars()
                                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
                    });
                if !snake {
                    continue;
                }
                let before = line.split('`').take(i).collect::<Vec<_>>().join("`");
                let before = before.trim_end();
                let first = token.split("::").next().unwrap_or("");
                let is_citation = token.contains("tests::")
                    || (token.contains("::") && suite_modules.contains(first))
                    || ["test", "tests", "test:", "tested by"]
                        .iter()
                        .any(|w| before.ends_with(w));
                if is_citation {
                    cited += 1;
                    if !fns.contains(last) {
                        missing.push(format!("{}:{}: {token}", doc.display(), n + 1));
                    }
                }
            }
        }
    }
    assert!(cited >= 10, "the check found only {cited} citations");
    assert!(
        missing.is_empty(),
        "the docs cite tests that do not exist: {missing:#?}"
    );
}

/// The `.rs` files below `dir`.
fn rust_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).expect("read a source dir") {
            let path = entry.expect("a dir entry").path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out
}

/// Issue 46, item 4: `scripts/test.sh` runs the suite under `scripts/test-watchdog.py`,
/// which stops a run whose test hangs and names it (libtest has no time limit). A fake
/// run whose test was noted running 60 s ago, with a limit of 62 s, is stopped within
/// seconds with status 124 naming it; a run that ends keeps its own status.
#[test]
fn a_hung_test_stops_the_run_and_is_named() {
    use std::process::Command;
    let started = std::time::Instant::now();
    let out = Command::new("python3")
        .args([
            "scripts/test-watchdog.py",
            "sh",
            "-c",
            "echo 'test quick ... ok'; \
             echo 'test stuck::forever has been running for over 60 seconds'; \
             sleep 60; echo never",
        ])
        .env("MAILROOM_TEST_LIMIT_SECS", "62")
        .current_dir(repo_path("."))
        .output()
        .expect("python3");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(124), "{text}");
    assert!(
        text.contains("watchdog: test stuck::forever hung"),
        "{text}"
    );
    assert!(
        !text.contains("test quick hung") && !text.contains("never"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    // A whole-run limit, and a run that ends in time with its own status.
    let out = Command::new("python3")
        .args(["scripts/test-watchdog.py", "sh", "-c", "sleep 30"])
        .env("MAILROOM_SUITE_LIMIT_SECS", "2")
        .current_dir(repo_path("."))
        .output()
        .expect("python3");
    assert_eq!(out.status.code(), Some(124));
    assert!(String::from_utf8_lossy(&out.stdout).contains("MAILROOM_SUITE_LIMIT_SECS"));
    let out = Command::new("python3")
        .args([
            "scripts/test-watchdog.py",
            "sh",
            "-c",
            "echo 'test a ... FAILED'; exit 101",
        ])
        .current_dir(repo_path("."))
        .output()
        .expect("python3");
    assert_eq!(out.status.code(), Some(101));
}

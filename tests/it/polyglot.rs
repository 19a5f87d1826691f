//! The polyglot contract: a Python `grpcio` client, with stubs generated from `proto/` at
//! test time, enqueues events and runs the standard health check.

use crate::support::*;
use mailroom::domain::BoxKind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_grpcio_client_enqueues_and_checks_health() {
    let (_url, s) = quiet_pg().await;
    let addr = s.app.addr.to_string();
    let args = [addr.clone(), repo_path("proto")];
    let needs = "python3 is required (scripts/test.sh installs grpcio)";
    let client = "tests/python/outbox_client.py";
    let seen = run_json("python3", client, &args, &[], needs, "python client").await;
    let id = seen["id"].as_i64().unwrap();
    let stored = s.stored(BoxKind::Outbox, id).await;
    assert_eq!(stored.topic, "py.orders");
    assert_eq!(stored.key.as_deref(), Some("py-key-1"));
    assert_eq!(stored.payload, (0..=255u8).collect::<Vec<u8>>());
    assert_eq!(stored.headers["note"], "héllo");
    assert_eq!(stored.event_type.as_deref(), Some("order.created"));
    // Sent gzipped (grpcio with compression on): stored whole.
    let gz = s
        .stored(BoxKind::Outbox, seen["gzip_id"].as_i64().unwrap())
        .await;
    assert_eq!(
        (gz.key.as_deref(), gz.payload.len()),
        (Some("py-gzip"), 100_000)
    );
    assert!(gz.payload.iter().all(|b| *b == b'z'));
    // One row for the two identical requests, the batch of three, the gzipped Enqueue
    // and batch of two, and the deflated Enqueue.
    assert_eq!(s.outbox_count(None).await, 8);
    s.app.stop().await.unwrap();
}

/// gRPC's built-in retries do the right thing with `docs/grpc-service-config.json`: a
/// server admitting one RPC at a time refuses eight concurrent batches (`RESOURCE_EXHAUSTED`,
/// `RetryInfo` and `grpc-retry-pushback-ms`); grpcio without the config fails some
/// calls (the fault fired), with it every call succeeds and every event is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_retries_with_the_service_config_honour_the_pushback() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.overload.max_concurrent_rpcs = 1;
    let s = Service::start(c).await;
    let args = [
        s.app.addr.to_string(),
        repo_path("proto"),
        repo_path("docs/grpc-service-config.json"),
    ];
    let seen = run_json(
        "python3",
        "tests/python/retry_client.py",
        &args,
        &[],
        "python3 is required (scripts/test.sh installs grpcio)",
        "retry client",
    )
    .await;
    let refused = seen["plain_refused"].as_array().unwrap();
    assert!(
        !refused.is_empty(),
        "no call was refused without retries: {seen}"
    );
    assert!(refused.iter().all(|c| c == "RESOURCE_EXHAUSTED"), "{seen}");
    assert_eq!(seen["retried_ok"], 8, "{seen}");
    assert_eq!(
        seen["retried_refused"].as_array().unwrap().len(),
        0,
        "{seen}"
    );
    let stored = seen["plain_ok"].as_i64().unwrap() * 100 + 800;
    assert_eq!(s.outbox_count(None).await, stored);
    s.app.stop().await.unwrap();
}

/// `examples/python/producer.py` runs as documented: it enqueues (a retry is a duplicate)
/// and reads the `ErrorInfo` reason and `BadRequest` fields of a refused event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_producer_example_runs() {
    let (_url, s) = quiet_pg().await;
    let needs = "python3 is required (scripts/test.sh installs grpcio-status)";
    let example = "examples/python/producer.py";
    let args = [s.app.addr.to_string(), repo_path("proto")];
    let seen = run_json("python3", example, &args, &[], needs, "producer example").await;
    let stored = s
        .stored(BoxKind::Outbox, seen["id"].as_i64().unwrap())
        .await;
    assert_eq!(stored.topic, "examples.orders");
    assert_eq!(seen["invalid"]["code"], "INVALID_ARGUMENT");
    assert_eq!(seen["invalid"]["reason"], "INVALID_ARGUMENT");
    assert_eq!(seen["invalid"]["domain"], "mailroom.v1");
    assert_eq!(seen["invalid"]["fields"][0], "event.topic");
    s.app.stop().await.unwrap();
}

/// The buf binary `scripts/test.sh` uses: `BUF`, else `.work/buf`'s, else `buf` on PATH.
/// Missing, the test fails: `scripts/test.sh` installs it.
fn buf() -> String {
    if let Ok(b) = std::env::var("BUF") {
        return b;
    }
    let local = format!(
        "{}/.work/buf/node_modules/.bin/buf",
        env!("CARGO_MANIFEST_DIR")
    );
    if std::path::Path::new(&local).exists() {
        return local;
    }
    let on_path = std::process::Command::new("buf").arg("--version").output();
    assert!(
        on_path.is_ok_and(|o| o.status.success()),
        "buf is required: scripts/test.sh installs it into .work/buf (or set BUF)"
    );
    "buf".into()
}

/// Runs a command to completion and returns (success, stdout + stderr).
fn run(cmd: &mut std::process::Command) -> (bool, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `scripts/gen-stubs.sh` runs `buf generate` with `buf.gen.yaml`'s local plugins: every
/// language's files appear where the proto options put them, the Python stubs import and
/// round-trip an event, and the TypeScript ones type-check (`tsc --strict`) and load in
/// Node. Go and Java are checked for their files and packages here; the producers' test
/// compiles and runs them (`producers_in_four_languages_connect_with_tls_and_a_token`).
#[test]
fn the_stubs_generate_for_python_go_java_and_typescript() {
    let root = env!("CARGO_MANIFEST_DIR");
    let tmp = tempfile::tempdir().unwrap();
    let (ok, log) = run(std::process::Command::new("bash")
        .arg(format!("{root}/scripts/gen-stubs.sh"))
        .arg(tmp.path())
        .env("BUF", buf()));
    assert!(ok, "scripts/gen-stubs.sh failed:\n{log}");
    let gen_dir = tmp.path().join("gen");

    let mut expected = Vec::new();
    for (file, outer, service) in [
        ("outbox", "OutboxProto", "OutboxService"),
        ("admin", "AdminProto", "AdminService"),
        ("inbox", "InboxProto", "InboxService"),
        ("handler", "HandlerProto", "HandlerService"),
    ] {
        expected.extend([
            format!("python/mailroom/v1/{file}_pb2.py"),
            format!("python/mailroom/v1/{file}_pb2.pyi"),
            format!("python/mailroom/v1/{file}_pb2_grpc.py"),
            format!("go/mailroom/v1/{file}.pb.go"),
            format!("go/mailroom/v1/{file}_grpc.pb.go"),
            format!("java/dev/mailroom/v1/{outer}.java"),
            format!("java/dev/mailroom/v1/{service}Grpc.java"),
            format!("ts/mailroom/v1/{file}.ts"),
        ]);
    }
    let missing: Vec<_> = expected
        .iter()
        .filter(|f| !gen_dir.join(f).is_file())
        .collect();
    assert!(missing.is_empty(), "not generated: {missing:?}\n{log}");
    let read = |f: &str| std::fs::read_to_string(gen_dir.join(f)).unwrap();
    assert!(read("go/mailroom/v1/outbox.pb.go").contains("\npackage mailroomv1\n"));
    assert!(read("go/mailroom/v1/outbox_grpc.pb.go").contains("func NewOutboxServiceClient("));
    assert!(
        read("java/dev/mailroom/v1/OutboxServiceGrpc.java").contains("package dev.mailroom.v1;")
    );
    // java_multiple_files: one file per message.
    assert!(gen_dir.join("java/dev/mailroom/v1/Event.java").is_file());

    let (ok, out) = run(std::process::Command::new("python3")
        .arg("-c")
        .arg(
            r#"
import sys
sys.path.insert(0, sys.argv[1])
from mailroom.v1 import outbox_pb2, outbox_pb2_grpc, admin_pb2_grpc, inbox_pb2_grpc, handler_pb2_grpc
e = outbox_pb2.Event(topic="py.stubs", key="k", payload=b"\x00\xff", headers={"a": "b"})
back = outbox_pb2.Event.FromString(e.SerializeToString())
assert back == e, back
for cls in (outbox_pb2_grpc.OutboxServiceStub, admin_pb2_grpc.AdminServiceStub,
            inbox_pb2_grpc.InboxServiceStub, handler_pb2_grpc.HandlerServiceServicer):
    assert callable(cls)
print("python stubs ok", outbox_pb2.DESCRIPTOR.package)
"#,
        )
        .arg(gen_dir.join("python")));
    assert!(ok, "the generated Python stubs do not load:\n{out}");
    assert!(out.contains("python stubs ok mailroom.v1"), "{out}");

    // ts-proto's output imports @bufbuild/protobuf and @grpc/grpc-js: gen-stubs.sh
    // installed both (with tsc) in .work/stubs.
    let modules = format!("{root}/.work/stubs/node_modules");
    let ts = gen_dir.join("ts");
    std::os::unix::fs::symlink(&modules, ts.join("node_modules")).unwrap();
    let mut tsc = std::process::Command::new(format!("{modules}/.bin/tsc"));
    tsc.args([
        "--strict",
        "--target",
        "es2020",
        "--module",
        "commonjs",
        "--moduleResolution",
        "node",
        "--esModuleInterop",
        "--skipLibCheck",
        "--outDir",
    ])
    .arg(ts.join("dist"));
    for file in ["outbox", "admin", "inbox", "handler"] {
        tsc.arg(ts.join(format!("mailroom/v1/{file}.ts")));
    }
    let (ok, out) = run(&mut tsc);
    assert!(ok, "the generated TypeScript does not compile:\n{out}");
    let (ok, out) = run(std::process::Command::new("node")
        .arg("-e")
        .arg(
            r#"
const { Event, OutboxServiceClient } = require(process.argv[1]);
const e = Event.fromPartial({ topic: "ts.stubs", key: "k", payload: Buffer.from([0, 255]), headers: { a: "b" } });
const back = Event.decode(Event.encode(e).finish());
if (back.topic !== "ts.stubs" || back.headers.a !== "b" || back.payload[1] !== 255) throw new Error(JSON.stringify(back));
if (typeof OutboxServiceClient !== "function") throw new Error("no OutboxServiceClient");
console.log("ts stubs ok");
"#,
        )
        .arg(ts.join("dist/mailroom/v1/outbox.js")));
    assert!(ok, "the compiled TypeScript stubs do not load:\n{out}");
    assert!(out.contains("ts stubs ok"), "{out}");
}

/// The newest release image in `proto/releases/` (`vMAJOR.MINOR.PATCH.binpb`), the one
/// `scripts/test.sh` checks against.
fn last_release() -> String {
    let dir = format!("{}/proto/releases", env!("CARGO_MANIFEST_DIR"));
    let version = |name: &str| -> Option<Vec<u64>> {
        let v = name.strip_prefix('v')?.strip_suffix(".binpb")?;
        v.split('.').map(|n| n.parse().ok()).collect()
    };
    let newest = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().ok())
        .filter_map(|name| Some((version(&name)?, name)))
        .max()
        .unwrap_or_else(|| panic!("no release image in {dir}"));
    format!("{dir}/{}", newest.1)
}

/// CI's `buf breaking` against the committed image of the last release
/// (`proto/releases/v0.1.0.binpb`) passes on the unchanged protos and fails, naming the
/// change, on a renumbered field and a deleted RPC.
#[test]
fn buf_breaking_against_the_release_names_a_breaking_change() {
    let root = env!("CARGO_MANIFEST_DIR");
    let against = last_release();
    let breaking = |dir: &std::path::Path| {
        run(std::process::Command::new(buf())
            .args(["breaking", "--against", &against])
            .current_dir(dir))
    };
    let (ok, out) = breaking(std::path::Path::new(root));
    assert!(ok, "the repository's protos break the release:\n{out}");

    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(format!("{root}/buf.yaml"), tmp.path().join("buf.yaml")).unwrap();
    let v1 = tmp.path().join("proto/mailroom/v1");
    std::fs::create_dir_all(&v1).unwrap();
    for file in ["outbox", "admin", "inbox", "handler"] {
        std::fs::copy(
            format!("{root}/proto/mailroom/v1/{file}.proto"),
            v1.join(format!("{file}.proto")),
        )
        .unwrap();
    }
    let (ok, out) = breaking(tmp.path());
    assert!(ok, "an unchanged copy breaks the release:\n{out}");

    let outbox = v1.join("outbox.proto");
    let text = std::fs::read_to_string(&outbox).unwrap();
    let changed = text
        .replacen("  string key = 2;\n", "  string key = 9;\n", 1)
        .replacen(
            "  rpc EnqueueBatch(EnqueueBatchRequest) returns (EnqueueBatchResponse);\n",
            "",
            1,
        );
    assert!(changed.contains("string key = 9;") && !changed.contains("rpc EnqueueBatch("));
    std::fs::write(&outbox, changed).unwrap();
    let (ok, out) = breaking(tmp.path());
    assert!(
        !ok,
        "a renumbered field and a deleted RPC passed buf breaking:\n{out}"
    );
    assert!(
        out.contains(r#"field "2" with name "key" on message "Event" was deleted"#),
        "{out}"
    );
    assert!(
        out.contains(r#"RPC "EnqueueBatch" on service "OutboxService" was deleted"#),
        "{out}"
    );
}

/// The `node_modules` of `examples/node` (its committed lock file), kept in
/// `.work/node-example`; `npm ci` runs only when they are missing or the lock changed.
fn node_example_modules() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = format!("{root}/.work/node-example");
    let lock = format!("{root}/examples/node/package-lock.json");
    let installed = std::fs::read(format!("{dir}/package-lock.json")).ok();
    let fresh = installed == std::fs::read(&lock).ok()
        && std::path::Path::new(&format!("{dir}/node_modules/@grpc/grpc-js")).exists();
    if !fresh {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            format!("{root}/examples/node/package.json"),
            format!("{dir}/package.json"),
        )
        .unwrap();
        std::fs::copy(&lock, format!("{dir}/package-lock.json")).unwrap();
        let (ok, out) = run(std::process::Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--prefer-offline"])
            .current_dir(&dir));
        assert!(
            ok,
            "npm ci for examples/node failed (npm is required):\n{out}"
        );
    }
    format!("{dir}/node_modules")
}

/// `examples/node/producer.js` runs as documented: @grpc/grpc-js with the protos loaded
/// at run time enqueues (a retry is a duplicate) and decodes the `ErrorInfo` reason and
/// `BadRequest` fields of a refused event from `grpc-status-details-bin`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_producer_example_runs() {
    let modules = node_example_modules();
    let (_url, s) = quiet_pg().await;
    let env = [("NODE_PATH", modules.as_str())];
    let (example, what) = ("examples/node/producer.js", "node producer example");
    let args = [s.app.addr.to_string(), repo_path("proto")];
    let seen = run_json("node", example, &args, &env, "node is required", what).await;
    let id: i64 = seen["id"]
        .as_str()
        .expect("id as a string")
        .parse()
        .unwrap();
    assert_eq!(seen["duplicate_id"], seen["id"]);
    let stored = s.stored(BoxKind::Outbox, id).await;
    assert_eq!(stored.topic, "examples.orders");
    assert_eq!(stored.key.as_deref(), Some("order-42"));
    assert_eq!(stored.payload, br#"{"total":10}"#);
    assert_eq!(stored.headers["content-type"], "application/json");
    assert_eq!(stored.event_type.as_deref(), Some("order.created"));
    // The retry with the same idempotency key stored nothing new.
    assert_eq!(s.outbox_count(None).await, 1);
    assert_eq!(seen["invalid"]["code"], "INVALID_ARGUMENT");
    assert_eq!(seen["invalid"]["reason"], "INVALID_ARGUMENT");
    assert_eq!(seen["invalid"]["domain"], "mailroom.v1");
    assert_eq!(seen["invalid"]["fields"][0], "event.topic");
    s.app.stop().await.unwrap();
}

/// Issue 28, item 4: the producer examples in Python, Node.js, Go and Java connect as the
/// shipped deployment requires, TLS (`MAILROOM_CA`) and a bearer token
/// (`MAILROOM_TOKEN`), and each enqueues (a retry answered as a duplicate) and reads the
/// `ErrorInfo` reason and `BadRequest` field of a refused event. Go and Java are built by
/// `scripts/build-examples.sh` with Debian's toolchains and gRPC libraries. Without the
/// token a producer is refused `UNAUTHENTICATED`; without the CA (plaintext to a TLS
/// port) it fails: both settings are what made the calls pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_in_four_languages_connect_with_tls_and_a_token() {
    let pki = crate::support::pki::pki();
    let (db, _dir) = fresh_sqlite();
    let mut c = quiet_config(&db);
    c.tls = Some(mailroom::tls::ServerTls {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        client_ca: None,
    });
    let secret = "producer-token-0123456789";
    c.tokens = vec![crate::security::token(
        "producer",
        secret,
        &[mailroom::access::Scope::Enqueue],
    )];
    let app = mailroom::app::App::start(c, tokio_util::sync::CancellationToken::new())
        .await
        .expect("start mailroom");
    let addr = format!("localhost:{}", app.addr.port());

    let out = tempfile::tempdir().unwrap();
    let (ok, log) = run(std::process::Command::new("bash")
        .arg(repo_path("scripts/build-examples.sh"))
        .arg(out.path())
        .env("BUF", buf()));
    assert!(ok, "scripts/build-examples.sh failed:\n{log}");
    let go = out.path().join("go-producer").display().to_string();
    let java = out.path().join("java-producer").display().to_string();
    let modules = node_example_modules();
    let proto = repo_path("proto");
    let programs: Vec<(&str, Vec<String>)> = vec![
        (
            "python",
            vec![
                "python3".into(),
                repo_path("examples/python/producer.py"),
                addr.clone(),
                proto.clone(),
            ],
        ),
        (
            "node",
            vec![
                "node".into(),
                repo_path("examples/node/producer.js"),
                addr.clone(),
                proto,
            ],
        ),
        ("go", vec![go, addr.clone()]),
        ("java", vec![java, addr.clone()]),
    ];
    let ca = pki.ca.display().to_string();
    let exec = |argv: &[String], envs: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env("NODE_PATH", &modules)
            .env_remove("MAILROOM_CA")
            .env_remove("MAILROOM_TOKEN")
            .envs(envs.iter().copied());
        cmd.output().unwrap_or_else(|e| panic!("{argv:?}: {e}"))
    };
    let both = [("MAILROOM_CA", ca.as_str()), ("MAILROOM_TOKEN", secret)];
    for (lang, argv) in &programs {
        let o = exec(argv, &both);
        let (stdout, stderr) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(o.status.success(), "{lang}: {stderr}\n{stdout}");
        let seen: serde_json::Value = serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("{lang} printed {stdout}: {e}"));
        let id = match &seen["id"] {
            serde_json::Value::String(s) => s.parse::<i64>().unwrap(),
            v => v.as_i64().unwrap_or_else(|| panic!("{lang}: {seen}")),
        };
        let stored = app.store.get_event(BoxKind::Outbox, id).await.unwrap();
        let stored = stored.unwrap_or_else(|| panic!("{lang}: event {id} is stored"));
        assert_eq!(stored.topic, "examples.orders", "{lang}");
        assert_eq!(stored.key.as_deref(), Some("order-42"), "{lang}");
        assert_eq!(
            seen["invalid"]["code"]
                .as_str()
                .map(|c| c.to_uppercase().replace('_', "")),
            Some("INVALIDARGUMENT".into()),
            "{lang}: {seen}"
        );
        assert_eq!(
            seen["invalid"]["reason"], "INVALID_ARGUMENT",
            "{lang}: {seen}"
        );
        assert_eq!(seen["invalid"]["domain"], "mailroom.v1", "{lang}: {seen}");
        assert_eq!(
            seen["invalid"]["fields"][0], "event.topic",
            "{lang}: {seen}"
        );

        let no_token = exec(argv, &both[..1]);
        let stderr = String::from_utf8_lossy(&no_token.stderr).to_lowercase();
        assert!(!no_token.status.success(), "{lang} without a token");
        assert!(
            stderr.contains("unauthenticated"),
            "{lang} without a token: {stderr}"
        );
        let no_tls = exec(argv, &both[1..]);
        assert!(
            !no_tls.status.success(),
            "{lang} in plaintext to a TLS port"
        );
    }
    app.stop().await.unwrap();
}

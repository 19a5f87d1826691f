//! Issue 12, the secured setups: TLS towards Kafka (a TLS-terminating proxy in front of a
//! private tansu, zstd records), towards PostgreSQL (a throwaway `ssl = on` cluster that
//! refuses plaintext), and TLS and mTLS towards an inbox handler and from `mailroom admin`.
//! Each test names the control it checks in `docs/security.md`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use crate::security::{Seen, token};
use crate::support::pki::{Pki, pki};
use crate::support::*;
use mailroom::access::Scope;
use mailroom::config::{Config, Settings};
use mailroom::pb::handler_service_server::HandlerServiceServer;
use mailroom::pb::inbox_service_client::InboxServiceClient;
use mailroom::sink::SinkConfig;

// ---------------------------------------------------------------- a recording handler

/// Serves `h` with TLS (and, with `client_ca`, mTLS) on localhost; returns its https URL.
/// Returns its URL and the count of TCP connections it accepted (each a TLS handshake
/// tried, whether or not it succeeded).
async fn serve_tls_handler(
    h: Seen,
    pki: &Pki,
    client_ca: bool,
) -> (String, Arc<std::sync::atomic::AtomicU64>) {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
        std::fs::read(&pki.server_cert).unwrap(),
        std::fs::read(&pki.server_key).unwrap(),
    ));
    if client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(std::fs::read(&pki.ca).unwrap()));
    }
    let accepted = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = accepted.clone();
    let incoming = futures::StreamExt::inspect(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        move |_| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        },
    );
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .tls_config(tls)
            .unwrap()
            .add_service(HandlerServiceServer::new(h))
            .serve_with_incoming(incoming)
            .await
            .unwrap();
    });
    (format!("https://localhost:{port}"), accepted)
}

/// The README code block (```toml / ```sh …) that contains `marker`.
fn readme_block(marker: &str) -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let mut blocks = readme.split("```").skip(1).step_by(2);
    let block = blocks
        .find(|b| b.contains(marker))
        .unwrap_or_else(|| panic!("README has no code block with {marker:?}"));
    block
        .split_once('\n')
        .map(|x| x.1)
        .unwrap_or("")
        .to_string()
}

// ---------------------------------------------------------------- §1 closed by default

/// An `https://` handler that requires a client certificate (mTLS) handles messages;
/// every call carries the subscription's bearer token and a `grpc-timeout`. The same
/// handler without mailroom's client certificate never sees a call.
#[tokio::test]
async fn https_handler_with_mtls_gets_a_bearer_token_and_a_deadline() {
    let pki = pki();
    let seen = Seen::default();
    let (url, _) = serve_tls_handler(seen.clone(), &pki, true).await;
    let (db, _dir) = fresh_sqlite();
    let mut c = config(&db);
    c.relays = 0;
    // The subscription as the README shows it, with this test's files.
    let toml_text = readme_block("handler_token_file")
        .replace("https://billing.internal:7443", &url)
        .replace("/etc/mailroom/handler-ca.pem", pki.ca.to_str().unwrap())
        .replace(
            "/etc/mailroom/client.pem",
            pki.client_cert.to_str().unwrap(),
        )
        .replace("/etc/mailroom/client.key", pki.client_key.to_str().unwrap());
    let token_file = pki.dir.path().join("billing-token");
    std::fs::write(&token_file, "handler-secret-42\n").unwrap();
    let toml_text = toml_text.replace("/etc/mailroom/billing-token", token_file.to_str().unwrap());
    let file = pki.dir.path().join("mailroom.toml");
    std::fs::write(&file, toml_text).unwrap();
    let from_readme = Config::load(Settings {
        config: Some(file),
        listen: Some("127.0.0.1:0".into()),
        database_url: Some(db.clone()),
        ..Default::default()
    })
    .expect("the README's subscription example is valid");
    c.subscriptions = from_readme.subscriptions;
    assert_eq!(c.subscriptions[0].handler, url);
    let name = c.subscriptions[0].name.clone();
    let s = Service::start(c).await;
    let mut inbox = InboxServiceClient::new(channel(s.app.addr).await);
    receive_on(&mut inbox, &name, "tls-1", "orders", "", b"over tls").await;
    eventually(
        Duration::from_secs(15),
        "the https handler is called",
        || {
            let n = seen.payloads.lock().unwrap().len();
            async move { n >= 1 }
        },
    )
    .await;
    assert_eq!(seen.payloads.lock().unwrap()[0], b"over tls");
    assert_eq!(
        seen.authorization.lock().unwrap()[0],
        "Bearer handler-secret-42"
    );
    let timeout = seen.grpc_timeout.lock().unwrap()[0].clone();
    assert!(!timeout.is_empty(), "the call carries grpc-timeout");
    s.app.stop().await.unwrap();

    // Without the client certificate the mTLS handler refuses the connection.
    let seen2 = Seen::default();
    let (url2, handshakes) = serve_tls_handler(seen2.clone(), &pki, true).await;
    let (db2, _dir2) = fresh_sqlite();
    let mut c = config(&db2);
    c.relays = 0;
    let mut sub = subscription("nocert", &[], &url2);
    sub.handler_tls.ca = Some(pki.ca.clone());
    c.subscriptions = vec![sub];
    let s = Service::start(c).await;
    let mut inbox = InboxServiceClient::new(channel(s.app.addr).await);
    receive_on(&mut inbox, "nocert", "tls-2", "orders", "", b"x").await;
    // mailroom tried, and tried again (a refused handshake spends no attempt): each try
    // reached the server and none got through.
    eventually(
        Duration::from_secs(15),
        "mailroom retries the handshake",
        || {
            let n = handshakes.load(std::sync::atomic::Ordering::SeqCst);
            async move { n >= 2 }
        },
    )
    .await;
    assert!(seen2.payloads.lock().unwrap().is_empty());
    s.app.stop().await.unwrap();
}

// ---------------------------------------------------------------- §2 admin CLI TLS

/// `mailroom admin` reaches a server that requires TLS and a client certificate, with
/// the README's flags; without the client certificate it is refused.
#[tokio::test]
async fn admin_cli_speaks_tls_and_mtls() {
    let pki = pki();
    let (db, _dir) = fresh_sqlite();
    let mut c = config(&db);
    c.relays = 0;
    c.tls = Some(mailroom::tls::ServerTls {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        client_ca: Some(pki.ca.clone()),
    });
    c.tokens = vec![token("ops", "ops-token-0123456789", &[Scope::Admin])];
    let s = start_tls(c).await;
    let port = s.addr.port();
    let cmd_line = readme_block("mailroom admin --server https://");
    let line = cmd_line
        .lines()
        .find(|l| l.contains("mailroom admin --server https://"))
        .unwrap()
        .to_string();
    let args: Vec<String> = line
        .replace("\\", "")
        .split_whitespace()
        .skip(2) // "mailroom admin"
        .map(|a| {
            a.replace("mailroom.internal:50051", &format!("localhost:{port}"))
                .replace("/etc/mailroom/ca.pem", pki.ca.to_str().unwrap())
                .replace("/etc/mailroom/admin.pem", pki.client_cert.to_str().unwrap())
                .replace("/etc/mailroom/admin.key", pki.client_key.to_str().unwrap())
        })
        .collect();
    let run = |args: &[String]| {
        let db = db.clone();
        let args = args.to_vec();
        async move {
            tokio::task::spawn_blocking(move || {
                let _ = db;
                Command::new(env!("CARGO_BIN_EXE_mailroom"))
                    .arg("admin")
                    .args(&args)
                    .env_clear()
                    .env("MAILROOM_ADMIN_TOKEN", "ops-token-0123456789")
                    .output()
                    .unwrap()
            })
            .await
            .unwrap()
        }
    };
    let out = run(&args).await;
    assert!(
        out.status.success(),
        "{:?}\n{}",
        args,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.stdout.is_empty());
    // The connection options are global: after the command too, as kubectl's are.
    let mut command_first = args.clone();
    let command = command_first.pop().expect("the README names a command");
    command_first.insert(0, command);
    command_first.push("--json".into());
    let out = run(&command_first).await;
    assert!(
        out.status.success(),
        "{:?}\n{}",
        command_first,
        String::from_utf8_lossy(&out.stderr)
    );
    let stats: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("--json after the command");
    assert!(stats.is_object(), "{stats}");
    // Without --cert/--client-key: the handshake is refused.
    let no_cert: Vec<String> = args
        .iter()
        .filter(|a| !a.contains("client.") && *a != "--cert" && *a != "--client-key")
        .cloned()
        .collect();
    let out = run(&no_cert).await;
    assert!(!out.status.success(), "{no_cert:?}");
    // Refused by the transport (TLS 1.3: the server ends the handshake it did not get a
    // certificate in; the client sees the connection closed), not by an RPC status.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("transport error") && !stderr.contains("UNAUTHENTICATED"),
        "refused at the transport: {stderr}"
    );
    s.app.stop().await.unwrap();
}

/// A started service with TLS on its port (no plaintext client).
struct TlsService {
    app: mailroom::app::App,
    addr: std::net::SocketAddr,
}

async fn start_tls(c: Config) -> TlsService {
    let app = mailroom::app::App::start(c, tokio_util::sync::CancellationToken::new())
        .await
        .expect("start mailroom");
    let addr = app.addr;
    TlsService { app, addr }
}

// ---------------------------------------------------------------- §2 Kafka TLS + zstd

/// A TLS-terminating proxy: accepts TLS on `listener`, forwards plaintext to `target`.
fn tls_proxy(listener: std::net::TcpListener, target: String, pki: &Pki) {
    use tokio_rustls::rustls;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![rustls::pki_types::CertificateDer::from(
                pki.server_cert_der.clone(),
            )],
            rustls::pki_types::PrivateKeyDer::Pkcs8(rustls::pki_types::PrivatePkcs8KeyDer::from(
                pki.server_key_der.clone(),
            )),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let target = target.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut upstream) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
            });
        }
    });
}

/// The README's `SASL_SSL` properties create a producer and a consumer (librdkafka is
/// built with SSL and SASL; SCRAM and PLAIN need OpenSSL at build time).
#[test]
fn the_readmes_sasl_ssl_example_creates_a_producer_and_a_consumer() {
    let settings: Settings = toml::from_str(&readme_block("SASL_SSL")).unwrap();
    let c = Config::resolve(settings).expect("the README example resolves");
    let SinkConfig::Kafka {
        brokers,
        properties,
        message_timeout,
    } = &c.sink
    else {
        panic!("the example configures Kafka")
    };
    assert_eq!(properties["security.protocol"], "SASL_SSL");
    let pc = mailroom::sink::kafka::producer_config(brokers, *message_timeout, properties);
    let producer: Result<rdkafka::producer::BaseProducer, _> = pc.create();
    producer.expect("a SASL_SSL producer");
    for mechanism in ["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN", "OAUTHBEARER"] {
        let mut props = properties.clone();
        props.insert("sasl.mechanism".into(), mechanism.into());
        if mechanism == "OAUTHBEARER" {
            props.remove("sasl.username");
            props.remove("sasl.password");
        }
        let cc = mailroom::inbox::consumer::consumer_config(brokers, "g", &props);
        let consumer: Result<rdkafka::consumer::BaseConsumer, _> = cc.create();
        consumer.unwrap_or_else(|e| panic!("a {mechanism} consumer: {e}"));
    }
    let mut zstd = properties.clone();
    zstd.insert("compression.type".into(), "zstd".into());
    let pc = mailroom::sink::kafka::producer_config(brokers, *message_timeout, &zstd);
    let producer: Result<rdkafka::producer::BaseProducer, _> = pc.create();
    producer.expect("a zstd producer");
}

/// The relay's producer and the inbox's consumer reach the broker through TLS only
/// (verifying its certificate with the test CA), and zstd-compressed records are
/// consumed by the inbox and handed to the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_with_zstd_reaches_the_inbox() {
    let pki = pki();
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_port = proxy.local_addr().unwrap().port();
    let broker_port = free_port();
    let _broker =
        crate::support::Broker::start_advertising(broker_port, &format!("localhost:{proxy_port}"));
    tls_proxy(proxy, format!("127.0.0.1:{broker_port}"), &pki);
    let brokers = format!("localhost:{proxy_port}");
    let props = BTreeMap::from([
        ("security.protocol".to_string(), "SSL".to_string()),
        (
            "ssl.ca.location".to_string(),
            pki.ca.to_str().unwrap().to_string(),
        ),
        ("compression.type".to_string(), "zstd".to_string()),
        // The proxy listens on 127.0.0.1 only; "localhost" may resolve to ::1 first.
        ("broker.address.family".to_string(), "v4".to_string()),
    ]);
    let topic = format!("tls-zstd-{}", uuid::Uuid::new_v4().simple());

    // Create the topic over TLS first (tansu auto-creates it), so the consumer finds it.
    {
        use rdkafka::producer::{FutureProducer, FutureRecord};
        let mut pc = rdkafka::ClientConfig::new();
        pc.set("bootstrap.servers", &brokers);
        for (k, v) in &props {
            pc.set(k, v);
        }
        pc.set("message.timeout.ms", "15000");
        if std::env::var("MAILROOM_TEST_KAFKA_DEBUG").is_ok() {
            pc.set("debug", "security,broker,protocol");
        }
        let p: FutureProducer<PrintLogs> = pc
            .create_with_context(PrintLogs)
            .expect("a TLS zstd producer");
        p.send(
            FutureRecord::to(&topic)
                .key("warm-up")
                .payload("a".repeat(4096).as_str()),
            Duration::from_secs(20),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("a record over TLS");
    }

    let seen = Seen::default();
    let handler = serve_handler(seen.clone()).await;
    let (db, _dir) = fresh_sqlite();
    let mut c = config(&db);
    c.sink = SinkConfig::Kafka {
        brokers: brokers.clone(),
        properties: props.clone(),
        message_timeout: Duration::from_secs(10),
    };
    c.relay.lease = Duration::from_secs(20);
    c.source = Some("mailroom/tls-test".into());
    c.subscriptions = vec![subscription("tls-in", &[&topic], &handler)];
    let mut s = Service::start(c).await;
    let payload = "zstd-compressible ".repeat(500);
    enqueue(&mut s.client, event(&topic, "order-1", payload.as_bytes())).await;
    eventually(
        Duration::from_secs(40),
        "the relayed record is consumed over TLS and handled",
        || {
            let got = seen
                .payloads
                .lock()
                .unwrap()
                .iter()
                .any(|p| p == payload.as_bytes());
            async move { got }
        },
    )
    .await;
    s.app.stop().await.unwrap();

    // The same broker without TLS on the client side: nothing gets through the proxy.
    let mut plain = rdkafka::ClientConfig::new();
    plain
        .set("bootstrap.servers", &brokers)
        .set("broker.address.family", "v4")
        .set("socket.timeout.ms", "2000");
    let consumer: rdkafka::consumer::BaseConsumer = plain.create().unwrap();
    use rdkafka::consumer::Consumer;
    // A plaintext request to a TLS listener: the transport fails (not a timeout).
    let e = consumer
        .fetch_metadata(Some(&topic), Duration::from_secs(3))
        .expect_err("the proxy only speaks TLS");
    assert!(
        format!("{e:?}").contains("BrokerTransportFailure"),
        "the transport fails: {e:?}"
    );
}

/// Prints librdkafka's log lines (they go nowhere otherwise): a failing TLS handshake
/// names its cause there.
struct PrintLogs;

impl rdkafka::ClientContext for PrintLogs {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        if (level as i32) <= (rdkafka::config::RDKafkaLogLevel::Warning as i32)
            || std::env::var("MAILROOM_TEST_KAFKA_DEBUG").is_ok()
        {
            eprintln!("librdkafka {level:?} {fac}: {log_message}");
        }
    }
}

// ---------------------------------------------------------------- §2 PostgreSQL TLS

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A throwaway PostgreSQL cluster with `ssl = on` and a certificate from the test CA,
/// that rejects connections without TLS (`hostnossl … reject`).
struct TlsPostgres {
    dir: tempfile::TempDir,
    port: u16,
}

impl TlsPostgres {
    fn start(pki: &Pki) -> TlsPostgres {
        let dir = tempfile::Builder::new()
            .prefix("mailroom-pg-tls")
            .tempdir()
            .unwrap();
        let data = dir.path().join("data");
        let as_postgres = |args: &[&str]| {
            let root = is_root();
            let mut cmd = if root {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]);
                c
            } else {
                Command::new(args[0])
            };
            if root {
                cmd.args(args);
            } else {
                cmd.args(&args[1..]);
            }
            let out = cmd
                .current_dir(std::env::temp_dir())
                .output()
                .expect("run a PostgreSQL tool");
            assert!(
                out.status.success(),
                "{args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let initdb = format!("{PG_BIN}/initdb");
        as_postgres(&[
            &initdb,
            "-D",
            data.to_str().unwrap(),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
        ]);
        let port = free_port();
        std::fs::copy(&pki.server_cert, data.join("server.crt")).unwrap();
        std::fs::copy(&pki.server_key, data.join("server.key")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            data.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .unwrap();
        use std::io::Write;
        writeln!(
            conf,
            "port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nfsync = off",
            dir.path().display()
        )
        .unwrap();
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n\
             hostnossl all all 127.0.0.1/32 reject\n",
        )
        .unwrap();
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&data)
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let pg_ctl = format!("{PG_BIN}/pg_ctl");
        let log = dir.path().join("log");
        as_postgres(&[
            &pg_ctl,
            "-D",
            data.to_str().unwrap(),
            "-l",
            log.to_str().unwrap(),
            "-w",
            "start",
        ]);
        TlsPostgres { dir, port }
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let pg_ctl = format!("{PG_BIN}/pg_ctl");
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", &pg_ctl]);
            c
        } else {
            Command::new(&pg_ctl)
        };
        let _ = cmd
            .args(["-D", data.to_str().unwrap(), "-m", "immediate", "stop"])
            .output();
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// mailroom connects to PostgreSQL over TLS: `sslmode=require`, and `verify-full` with
/// the README's `sslrootcert`; a cluster that refuses plaintext refuses `disable`, and
/// `verify-full` against another CA fails. The whole service (pool, LISTEN/NOTIFY,
/// migrations, an enqueue) runs over it.
#[tokio::test]
async fn postgres_over_tls_require_and_verify_full() {
    let pki = pki();
    let pg = TlsPostgres::start(&pki);
    let url = |query: &str| format!("postgres://postgres@localhost:{}/postgres?{query}", pg.port);
    let try_open = |u: String| async move {
        let mut c = config(&u);
        c.database_acquire_timeout = Duration::from_secs(3);
        mailroom::app::open_store(&c).await.map(|_| ())
    };
    // Plaintext is refused by the server.
    let e = try_open(url("sslmode=disable")).await.unwrap_err();
    assert!(
        format!("{e:#}").contains("no encryption"),
        "refused for want of TLS: {e:#}"
    );
    try_open(url("sslmode=require"))
        .await
        .expect("sslmode=require");
    // The README's verify-full URL with this test's CA.
    let readme_url = readme_block("sslmode=verify-full");
    let readme_url = readme_url
        .split_whitespace()
        .find(|w| w.contains("sslmode=verify-full"))
        .unwrap()
        .trim_matches(|c| c == '"' || c == '\'')
        .to_string();
    let query = readme_url.split_once('?').unwrap().1;
    let verify = url(&query.replace("/etc/mailroom/db-ca.pem", pki.ca.to_str().unwrap()));
    try_open(verify.clone()).await.expect("sslmode=verify-full");
    let wrong = url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        pki.other_ca.display()
    ));
    let e = try_open(wrong).await.unwrap_err();
    assert!(
        format!("{e:#}").to_lowercase().contains("certificate"),
        "another CA must not verify, as a certificate error: {e:#}"
    );

    let mut c = config(&verify);
    c.relays = 1;
    let mut s = Service::start(c).await;
    let id = enqueue(&mut s.client, event("orders", "k", b"over tls")).await;
    assert!(id > 0);
    s.app.stop().await.unwrap();
}

// ---------------------------------------------------------------- §3 handler deferrals

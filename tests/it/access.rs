//! Who may call, and what leaks: tokens and scopes, TLS and mutual TLS, and secrets
//! kept out of logs and errors (issue 7), against real PostgreSQL and SQLite.

use std::time::{Duration, Instant};

use crate::support::*;
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::pb::outbox_service_client::OutboxServiceClient;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

const PRODUCER: &str = "producer-orders-0123456789";

const PRODUCER_ANY: &str = "producer-any-topic-0123456789";

const ADMIN: &str = "admin-operator-0123456789";

struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
    other_client_cert: String,
    other_client_key: String,
    /// Named `billing.internal` (a DNS name).
    billing_cert: String,
    billing_key: String,
    /// No subject alternative name: named by its common name, `cn-only`.
    cn_cert: String,
    cn_key: String,
}

#[tokio::test]
async fn tokens_scopes_and_topics() {
    let (url, dir) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.tokens = mailroom::access::load_tokens(&token_file(dir.path())).unwrap();
    let mut s = Service::start(c).await;
    let mut admin = AdminServiceClient::new(channel(s.app.addr).await);
    let enq = |topic: &str| pb::EnqueueRequest {
        event: Some(event(topic, "k", b"x")),
    };

    // Enqueue: missing or wrong token, a token of the wrong scope, a topic outside the list.
    let cases: [(Option<&str>, &str, Code); 7] = [
        (None, "orders", Code::Unauthenticated),
        (
            Some("not-a-token-at-all-000"),
            "orders",
            Code::Unauthenticated,
        ),
        (Some(ADMIN), "orders", Code::PermissionDenied),
        (Some(PRODUCER), "payments", Code::PermissionDenied),
        (Some(PRODUCER), "orders", Code::Ok),
        (Some(PRODUCER_ANY), "payments", Code::Ok),
        (
            Some(&PRODUCER[..PRODUCER.len() - 1]),
            "orders",
            Code::Unauthenticated,
        ),
    ];
    for (token, topic, want) in cases {
        let got = code(s.client.enqueue(with_token(enq(topic), token)).await);
        assert_eq!(got, want, "token {token:?} topic {topic}");
    }
    // A batch with one forbidden topic is refused whole.
    let batch = pb::EnqueueBatchRequest {
        events: vec![event("orders", "k", b"1"), event("refunds", "k", b"2")],
    };
    assert_eq!(
        code(
            s.client
                .enqueue_batch(with_token(batch, Some(PRODUCER)))
                .await
        ),
        Code::PermissionDenied
    );
    assert_eq!(
        s.outbox_count(None).await,
        2,
        "only the two allowed enqueues stored anything"
    );

    // Admin: only the admin scope.
    for (token, want) in [
        (None, Code::Unauthenticated),
        (Some(PRODUCER_ANY), Code::PermissionDenied),
        (Some("Bearer-looking-garbage-0000"), Code::Unauthenticated),
        (Some(ADMIN), Code::Ok),
    ] {
        let got = code(
            admin
                .get_stats(with_token(pb::GetStatsRequest::default(), token))
                .await,
        );
        assert_eq!(got, want, "admin with {token:?}");
    }
    // The audit log names the token, not the secret.
    let id = s.outbox_count(Some(Status::Pending)).await;
    assert_eq!(id, 2);
    let cancel = pb::CancelEventsRequest {
        ids: vec![1],
        reason: "test".into(),
        operator: "alice".into(),
        ..Default::default()
    };
    admin
        .cancel_events(with_token(cancel, Some(ADMIN)))
        .await
        .unwrap();
    let audit = admin
        .list_audit(with_token(pb::ListAuditRequest::default(), Some(ADMIN)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(audit.entries[0].actor, "alice (token ops)");

    // Health stays open for probes.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel(s.app.addr).await);
    health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    s.app.stop().await.unwrap();
}

fn token_file(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("tokens.toml");
    std::fs::write(
        &p,
        format!(
            r#"
[[token]]
name = "checkout"
token = "{PRODUCER}"
scopes = ["enqueue"]
topics = ["orders"]

[[token]]
name = "firehose"
token = "{PRODUCER_ANY}"
scopes = ["enqueue"]

[[token]]
name = "ops"
token = "{ADMIN}"
scopes = ["admin"]
"#
        ),
    )
    .unwrap();
    p
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()]);
    let (client_cert, client_key) = leaf(vec!["client".into()]);
    let (billing_cert, billing_key) = leaf(vec!["billing.internal".into()]);
    let (cn_cert, cn_key) = {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "cn-only");
        (
            params.signed_by(&key, &issuer).unwrap().pem(),
            key.serialize_pem(),
        )
    };
    // A client certificate from another CA.
    let other_key = KeyPair::generate().unwrap();
    let other = CertificateParams::new(vec!["intruder".to_string()])
        .unwrap()
        .self_signed(&other_key)
        .unwrap();
    Pki {
        ca: ca_cert.pem(),
        server_cert,
        server_key,
        client_cert,
        client_key,
        other_client_cert: other.pem(),
        other_client_key: other_key.serialize_pem(),
        billing_cert,
        billing_key,
        cn_cert,
        cn_key,
    }
}

async fn tls_client(
    addr: std::net::SocketAddr,
    ca: &str,
    identity: Option<(&str, &str)>,
) -> Result<OutboxServiceClient<Channel>, tonic::transport::Error> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some((c, k)) = identity {
        tls = tls.identity(Identity::from_pem(c, k));
    }
    let ch = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(OutboxServiceClient::new(ch))
}

async fn try_enqueue(
    client: Result<OutboxServiceClient<Channel>, tonic::transport::Error>,
) -> bool {
    match client {
        Err(_) => false,
        Ok(mut c) => c
            .enqueue(pb::EnqueueRequest {
                event: Some(event("tls", "k", b"x")),
            })
            .await
            .is_ok(),
    }
}

#[tokio::test]
async fn tls_and_mutual_tls() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, pem: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    let cert = write("server.pem", &pki.server_cert);
    let key = write("server.key", &pki.server_key);
    let ca = write("ca.pem", &pki.ca);

    // TLS: a client trusting the CA gets through; plaintext does not.
    let (url, _d) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.tls = Some(mailroom::tls::ServerTls {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: None,
    });
    let app = mailroom::app::App::start(c, CancellationToken::new())
        .await
        .unwrap();
    assert!(try_enqueue(tls_client(app.addr, &pki.ca, None).await).await);
    let plain = Channel::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(3))
        .connect()
        .await;
    let plain_ok = match plain {
        Err(_) => false,
        Ok(ch) => OutboxServiceClient::new(ch)
            .enqueue(pb::EnqueueRequest {
                event: Some(event("tls", "k", b"x")),
            })
            .await
            .is_ok(),
    };
    assert!(!plain_ok, "plaintext must not reach a TLS port");
    app.stop().await.unwrap();

    // mTLS: a client certificate from the CA is required (and an entry naming it).
    let (url, _d) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.tls = Some(mailroom::tls::ServerTls {
        cert,
        key,
        client_ca: Some(ca),
    });
    c.tokens = entries(
        dir.path(),
        "[[token]]\nname = \"c\"\ncertificate = \"client\"\nscopes = [\"enqueue\"]\n",
    );
    let app = mailroom::app::App::start(c, CancellationToken::new())
        .await
        .unwrap();
    assert!(
        try_enqueue(tls_client(app.addr, &pki.ca, Some((&pki.client_cert, &pki.client_key))).await)
            .await
    );
    assert!(!try_enqueue(tls_client(app.addr, &pki.ca, None).await).await);
    assert!(
        !try_enqueue(
            tls_client(
                app.addr,
                &pki.ca,
                Some((&pki.other_client_cert, &pki.other_client_key))
            )
            .await
        )
        .await
    );
    assert_eq!(
        app.store.count_events(BoxKind::Outbox, None).await.unwrap(),
        1
    );
    app.stop().await.unwrap();
}

/// Issue 25, item 3: identities decide what a caller may do.
/// - mTLS with a certificate entry that may enqueue: the admin service needs a token
///   (before: every certificate got every scope, admin included).
/// - mTLS with a token file: the audit log records the token *and* the certificate.
/// - An admin token with a topic list is refused at start-up (before: the list was
///   ignored and the token read every topic).
/// - `admin_read` sees the backlog without payloads; `payloads` (or `admin`) adds them.
#[tokio::test]
async fn identities_decide_what_a_caller_may_do() {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, pem: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    let tls = mailroom::tls::ServerTls {
        cert: write("server.pem", &pki.server_cert),
        key: write("server.key", &pki.server_key),
        client_ca: Some(write("ca.pem", &pki.ca)),
    };
    let mtls_channel = |addr: std::net::SocketAddr| {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&pki.ca))
            .domain_name("localhost")
            .identity(Identity::from_pem(&pki.client_cert, &pki.client_key));
        async move {
            Channel::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(tls)
                .unwrap()
                .connect()
                .await
                .unwrap()
        }
    };

    // mTLS with a catch-all certificate entry that may enqueue: a certificate is not an
    // operator.
    let (url, d1) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.tls = Some(tls.clone());
    c.tokens = entries(
        d1.path(),
        "[[token]]\nname = \"any\"\ncertificate = \"*\"\nscopes = [\"enqueue\"]\n",
    );
    let app = mailroom::app::App::start(c, CancellationToken::new())
        .await
        .unwrap();
    let ch = mtls_channel(app.addr).await;
    let id = OutboxServiceClient::new(ch.clone())
        .enqueue(pb::EnqueueRequest {
            event: Some(event("mtls", "k", b"x")),
        })
        .await
        .expect("the catch-all entry may enqueue")
        .into_inner()
        .id;
    let mut admin = AdminServiceClient::new(ch);
    let cancel = |token: Option<&str>| {
        with_token(
            pb::CancelEventsRequest {
                ids: vec![id],
                reason: "test".into(),
                operator: "alice".into(),
                ..Default::default()
            },
            token,
        )
    };
    assert_eq!(
        code(admin.cancel_events(cancel(None)).await),
        Code::PermissionDenied,
        "a certificate alone is not an operator"
    );
    assert_eq!(
        code(admin.get_stats(pb::GetStatsRequest::default()).await),
        Code::PermissionDenied
    );
    app.stop().await.unwrap();

    // mTLS and tokens: the audit log names both.
    let (url, d2) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.tls = Some(tls.clone());
    c.tokens = mailroom::access::load_tokens(&token_file(d2.path())).unwrap();
    let app = mailroom::app::App::start(c, CancellationToken::new())
        .await
        .unwrap();
    let ch = mtls_channel(app.addr).await;
    let id = OutboxServiceClient::new(ch.clone())
        .enqueue(with_token(
            pb::EnqueueRequest {
                event: Some(event("orders", "k", b"x")),
            },
            Some(PRODUCER),
        ))
        .await
        .unwrap()
        .into_inner()
        .id;
    let mut admin = AdminServiceClient::new(ch);
    admin
        .cancel_events(with_token(
            pb::CancelEventsRequest {
                ids: vec![id],
                reason: "test".into(),
                operator: "alice".into(),
                ..Default::default()
            },
            Some(ADMIN),
        ))
        .await
        .unwrap();
    let audit = admin
        .list_audit(with_token(pb::ListAuditRequest::default(), Some(ADMIN)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(audit.entries[0].principal, "ops (certificate client)");
    app.stop().await.unwrap();

    // An admin token with a topic list is refused when the file is read.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[token]]\nname = \"orders-reader\"\ntoken = \"orders-reader-0123456789\"\n\
         scopes = [\"admin_read\"]\ntopics = [\"orders\"]\n",
    )
    .unwrap();
    let err = mailroom::access::load_tokens(&bad).unwrap_err();
    assert!(
        err.contains("orders-reader") && err.contains("admin"),
        "{err}"
    );

    // Payloads are a scope of their own.
    let (url, d3) = fresh_sqlite();
    let mut c = quiet_config(&url);
    let tokens = d3.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "{}\n[[token]]\nname = \"viewer\"\ntoken = \"viewer-0123456789abc\"\nscopes = [\"admin_read\"]\n\
             \n[[token]]\nname = \"support\"\ntoken = \"support-0123456789abc\"\nscopes = [\"admin_read\", \"payloads\"]\n",
            std::fs::read_to_string(token_file(d3.path())).unwrap()
        ),
    )
    .unwrap();
    c.tokens = mailroom::access::load_tokens(&tokens).unwrap();
    let mut s = Service::start(c).await;
    let id = s
        .client
        .enqueue(with_token(
            pb::EnqueueRequest {
                event: Some(event("orders", "k", b"secret")),
            },
            Some(PRODUCER),
        ))
        .await
        .unwrap()
        .into_inner()
        .id;
    let mut admin = AdminServiceClient::new(channel(s.app.addr).await);
    let get = |include_payload: bool, token: &str| {
        with_token(
            pb::GetEventRequest {
                id,
                include_payload,
                ..Default::default()
            },
            Some(token),
        )
    };
    let viewer = "viewer-0123456789abc";
    let e = admin
        .get_event(get(false, viewer))
        .await
        .unwrap()
        .into_inner();
    assert!(
        e.event.unwrap().payload.is_empty(),
        "the backlog without the data"
    );
    assert_eq!(
        code(admin.get_event(get(true, viewer)).await),
        Code::PermissionDenied
    );
    for token in ["support-0123456789abc", ADMIN] {
        let e = admin
            .get_event(get(true, token))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(e.event.unwrap().payload, b"secret", "{token}");
    }
    s.app.stop().await.unwrap();
}

/// Writes `text` as a token file in `dir` and reads it.
fn entries(dir: &std::path::Path, text: &str) -> Vec<mailroom::access::TokenEntry> {
    let p = dir.join("entries.toml");
    std::fs::write(&p, text).unwrap();
    mailroom::access::load_tokens(&p).unwrap()
}

/// Issue 43, item 5: a client certificate may do what the token file's entry naming it
/// allows, and nothing else.
/// - mTLS without entries: a certificate of the client CA reaches health only (before:
///   it enqueued to every topic, pushed into every subscription and listed every
///   handler address).
/// - A certificate named by an entry (its DNS name, or its common name without one) gets
///   that entry's scopes, topics and subscriptions, exactly as a token would.
/// - `Receive` refuses a topic its subscription does not consume (before: stored it).
/// - A bearer token still decides when one is sent; a `"*"` entry covers the rest.
#[tokio::test]
async fn certificates_are_scoped_like_tokens() {
    use mailroom::pb::inbox_service_client::InboxServiceClient;
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, pem: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    let tls = mailroom::tls::ServerTls {
        cert: write("server.pem", &pki.server_cert),
        key: write("server.key", &pki.server_key),
        client_ca: Some(write("ca.pem", &pki.ca)),
    };
    let connect = |addr: std::net::SocketAddr, cert: &str, key: &str| {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&pki.ca))
            .domain_name("localhost")
            .identity(Identity::from_pem(cert, key));
        async move {
            Channel::from_shared(format!("https://{addr}"))
                .unwrap()
                .tls_config(tls)
                .unwrap()
                .connect()
                .await
                .unwrap()
        }
    };
    let start = |tokens: Vec<mailroom::access::TokenEntry>| {
        let (url, d) = fresh_sqlite();
        let mut c = quiet_config(&url);
        c.tls = Some(tls.clone());
        c.tokens = tokens;
        c.subscriptions = vec![
            subscription("billing", &["invoices"], "http://127.0.0.1:9"),
            subscription("shipping", &["parcels"], "http://127.0.0.1:9"),
        ];
        async move {
            let app = mailroom::app::App::start(c, CancellationToken::new())
                .await
                .unwrap();
            (app, d)
        }
    };
    let enqueue = |ch: &Channel, topic: &str, token: Option<&str>| {
        let mut c = OutboxServiceClient::new(ch.clone());
        let r = with_token(
            pb::EnqueueRequest {
                event: Some(event(topic, "k", b"x")),
            },
            token,
        );
        async move { code(c.enqueue(r).await) }
    };
    let receive = |ch: &Channel, sub: &str, topic: &str| {
        let mut c = InboxServiceClient::new(ch.clone());
        let r = pb::ReceiveRequest {
            subscription: sub.into(),
            message_id: uuid::Uuid::new_v4().to_string(),
            topic: topic.into(),
            key: "k".into(),
            payload: b"x".to_vec(),
            ..Default::default()
        };
        async move { code(c.receive(r).await) }
    };
    let listed = |ch: &Channel| {
        let mut c = InboxServiceClient::new(ch.clone());
        async move {
            c.list_subscriptions(pb::ListSubscriptionsRequest::default())
                .await
                .map(|r| {
                    r.into_inner()
                        .subscriptions
                        .into_iter()
                        .map(|s| s.name)
                        .collect::<Vec<_>>()
                })
                .map_err(|s| s.code())
        }
    };
    let stats = |ch: &Channel, token: Option<&str>| {
        let mut c = AdminServiceClient::new(ch.clone());
        let r = with_token(pb::GetStatsRequest::default(), token);
        async move { code(c.get_stats(r).await) }
    };

    // mTLS without entries: a certificate of the CA reaches health and nothing else.
    let (app, _d) = start(vec![]).await;
    let ch = connect(app.addr, &pki.client_cert, &pki.client_key).await;
    assert_eq!(enqueue(&ch, "orders", None).await, Code::Unauthenticated);
    assert_eq!(
        receive(&ch, "billing", "invoices").await,
        Code::Unauthenticated
    );
    assert_eq!(listed(&ch).await, Err(Code::Unauthenticated));
    tonic_health::pb::health_client::HealthClient::new(ch.clone())
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health stays open");
    assert_eq!(
        app.store.count_events(BoxKind::Outbox, None).await.unwrap()
            + app.store.count_events(BoxKind::Inbox, None).await.unwrap(),
        0
    );
    app.stop().await.unwrap();

    // Entries for two certificates and an operator's token.
    let file = format!(
        r#"
[[token]]
name = "billing"
certificate = "billing.internal"
scopes = ["enqueue", "inbox"]
topics = ["invoices"]
subscriptions = ["billing"]

[[token]]
name = "cn"
certificate = "cn-only"
scopes = ["enqueue"]
topics = ["cn"]

[[token]]
name = "ops"
token = "{ADMIN}"
scopes = ["admin"]
"#
    );
    let (app, _d) = start(entries(dir.path(), &file)).await;
    let billing = connect(app.addr, &pki.billing_cert, &pki.billing_key).await;
    assert_eq!(enqueue(&billing, "invoices", None).await, Code::Ok);
    assert_eq!(
        enqueue(&billing, "orders", None).await,
        Code::PermissionDenied
    );
    assert_eq!(receive(&billing, "billing", "invoices").await, Code::Ok);
    assert_eq!(
        receive(&billing, "billing", "parcels").await,
        Code::InvalidArgument,
        "a topic the subscription does not consume"
    );
    assert_eq!(
        receive(&billing, "shipping", "parcels").await,
        Code::PermissionDenied
    );
    assert_eq!(listed(&billing).await, Ok(vec!["billing".to_string()]));
    assert_eq!(stats(&billing, None).await, Code::PermissionDenied);
    let cn = connect(app.addr, &pki.cn_cert, &pki.cn_key).await;
    assert_eq!(enqueue(&cn, "cn", None).await, Code::Ok);
    assert_eq!(enqueue(&cn, "invoices", None).await, Code::PermissionDenied);
    assert_eq!(
        receive(&cn, "billing", "invoices").await,
        Code::PermissionDenied
    );
    // A certificate no entry names: nothing without a token; the token decides with one.
    let client = connect(app.addr, &pki.client_cert, &pki.client_key).await;
    assert_eq!(
        enqueue(&client, "invoices", None).await,
        Code::Unauthenticated
    );
    assert_eq!(stats(&client, None).await, Code::Unauthenticated);
    assert_eq!(stats(&client, Some(ADMIN)).await, Code::Ok);
    assert_eq!(stats(&billing, Some(ADMIN)).await, Code::Ok);
    assert_eq!(
        enqueue(&billing, "invoices", Some("not-a-token-at-all-000")).await,
        Code::Unauthenticated,
        "a wrong token is not made up for by the certificate"
    );
    assert_eq!(
        app.store.count_events(BoxKind::Outbox, None).await.unwrap(),
        2
    );
    assert_eq!(
        app.store.count_events(BoxKind::Inbox, None).await.unwrap(),
        1,
        "only the allowed push was stored"
    );
    app.stop().await.unwrap();

    // A catch-all entry: every other certificate of the CA may enqueue, not push.
    let file = format!(
        "{file}\n[[token]]\nname = \"fleet\"\ncertificate = \"*\"\nscopes = [\"enqueue\"]\n"
    );
    let (app, _d) = start(entries(dir.path(), &file)).await;
    let client = connect(app.addr, &pki.client_cert, &pki.client_key).await;
    assert_eq!(enqueue(&client, "anything", None).await, Code::Ok);
    assert_eq!(
        receive(&client, "billing", "invoices").await,
        Code::PermissionDenied
    );
    let billing = connect(app.addr, &pki.billing_cert, &pki.billing_key).await;
    assert_eq!(
        enqueue(&billing, "anything", None).await,
        Code::PermissionDenied,
        "a named entry wins over the catch-all"
    );
    app.stop().await.unwrap();

    // The catch-all may not carry an admin scope; an entry has a token or a certificate.
    for (bad, why) in [
        (
            "[[token]]\nname = \"x\"\ncertificate = \"*\"\nscopes = [\"admin_read\"]\n",
            "admin scope",
        ),
        (
            "[[token]]\nname = \"x\"\ncertificate = \"a\"\ntoken = \"0123456789abcdef0\"\nscopes = [\"enqueue\"]\n",
            "a token and a certificate",
        ),
        (
            "[[token]]\nname = \"x\"\ncertificate = \"a\"\nscopes = [\"enqueue\"]\n\
             [[token]]\nname = \"y\"\ncertificate = \"a\"\nscopes = [\"inbox\"]\n",
            "more than one entry",
        ),
    ] {
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, bad).unwrap();
        let e = mailroom::access::load_tokens(&p).unwrap_err();
        assert!(e.contains(why), "{e}");
    }
}

/// Issue 43, item 5, through the binary: mTLS without a token file is refused at start
/// (it used to mean "every certificate may enqueue and push"), naming the way to keep
/// that; certificate entries without mTLS are refused too.
#[tokio::test]
async fn mtls_without_entries_is_refused_at_start() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, pem: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p.to_str().unwrap().to_string()
    };
    let (cert, key, ca) = (
        write("server.pem", &pki.server_cert),
        write("server.key", &pki.server_key),
        write("ca.pem", &pki.ca),
    );
    let (url, _d) = fresh_sqlite();
    let base = [
        ("MAILROOM_DATABASE_URL", url.as_str()),
        ("MAILROOM_LISTEN", "127.0.0.1:0"),
        ("MAILROOM_TLS_CERT", cert.as_str()),
        ("MAILROOM_TLS_KEY", key.as_str()),
    ];
    let mut envs = base.to_vec();
    envs.push(("MAILROOM_TLS_CLIENT_CA", ca.as_str()));
    let out = run_binary(&envs, &[], Duration::from_secs(3)).await;
    assert!(
        out.contains("MAILROOM_TLS_CLIENT_CA")
            && out.contains("MAILROOM_TOKENS_FILE")
            && out.contains(r#"certificate = "*""#)
            && !out.contains("mailroom serving"),
        "{out}"
    );
    let tokens = write(
        "tokens.toml",
        "[[token]]\nname = \"b\"\ncertificate = \"billing.internal\"\nscopes = [\"enqueue\"]\n",
    );
    let mut envs = base.to_vec();
    envs.push(("MAILROOM_TOKENS_FILE", tokens.as_str()));
    let out = run_binary(&envs, &[], Duration::from_secs(3)).await;
    assert!(
        out.contains("certificate entries") && !out.contains("mailroom serving"),
        "{out}"
    );
    // With the CA and the file: it serves.
    envs.push(("MAILROOM_TLS_CLIENT_CA", ca.as_str()));
    let out = run_binary(&envs, &[], Duration::from_secs(3)).await;
    assert!(out.contains("mailroom serving"), "{out}");
}

/// Runs the binary with secrets in its settings until it exits or `run_for` passes
/// (then SIGTERM); returns stdout and stderr together.
async fn run_binary(envs: &[(&str, &str)], args: &[&str], run_for: Duration) -> String {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_mailroom"));
    cmd.args(args)
        .env_remove("RUST_LOG")
        .env("RUST_LOG", "debug")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    let pid = child.id().unwrap();
    let waiter = tokio::spawn(child.wait_with_output());
    tokio::time::sleep(run_for).await;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let out = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the binary stops on SIGTERM")
        .unwrap()
        .unwrap();
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test]
async fn secrets_never_reach_logs_or_errors() {
    const DB_PW: &str = "PgPassw0rd-7f3a";
    const SASL_PW: &str = "SaslPassw0rd-91c2";
    const ADMIN_TOKEN: &str = "AdminT0ken-55e1-long-enough";
    let secrets = [DB_PW, SASL_PW, ADMIN_TOKEN, PRODUCER, PRODUCER_ANY, ADMIN];
    let check = |what: &str, out: &str| {
        for s in secrets {
            assert!(!out.contains(s), "{what}: secret {s:?} leaked:\n{out}");
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let tokens = token_file(dir.path());
    let kafka_props = format!(
        "security.protocol=SASL_PLAINTEXT,sasl.mechanism=PLAIN,sasl.username=mailroom,sasl.password={SASL_PW}"
    );

    // 1. The database refuses: the start-up error names the URL without its password.
    let port = free_port();
    let bad_db = format!("postgres://mailroom:{DB_PW}@127.0.0.1:{port}/mailroom");
    let out = run_binary(
        &[
            ("MAILROOM_DATABASE_URL", bad_db.as_str()),
            ("MAILROOM_KAFKA_BROKERS", "127.0.0.1:1"),
            ("MAILROOM_KAFKA_PROPERTIES", kafka_props.as_str()),
            ("MAILROOM_ADMIN_TOKEN", ADMIN_TOKEN),
            ("MAILROOM_TOKENS_FILE", tokens.to_str().unwrap()),
            ("MAILROOM_LISTEN", "127.0.0.1:0"),
        ],
        &[],
        Duration::from_secs(3),
    )
    .await;
    check("failing database", &out);
    assert!(out.contains("postgres://mailroom:***@127.0.0.1"), "{out}");

    // 2. A running service (PostgreSQL accepts any password here: trust) whose broker
    //    is unreachable, with debug logs, a bad token and a relay failing to publish.
    let db = fresh_pg().await;
    let with_pw = db.replacen(
        "postgres://postgres@",
        &format!("postgres://postgres:{DB_PW}@"),
        1,
    );
    assert_ne!(with_pw, db);
    let listen = format!("127.0.0.1:{}", free_port());
    let broker_port = free_port().to_string();
    let envs = [
        ("MAILROOM_DATABASE_URL", with_pw.as_str()),
        (
            "MAILROOM_KAFKA_BROKERS",
            &format!("127.0.0.1:{broker_port}"),
        ),
        ("MAILROOM_KAFKA_PROPERTIES", kafka_props.as_str()),
        ("MAILROOM_KAFKA_MESSAGE_TIMEOUT_MS", "1000"),
        ("MAILROOM_RELAY_LEASE_MS", "7000"),
        ("MAILROOM_ADMIN_TOKEN", ADMIN_TOKEN),
        ("MAILROOM_TOKENS_FILE", tokens.to_str().unwrap()),
        ("MAILROOM_LISTEN", listen.as_str()),
    ];
    let addr: std::net::SocketAddr = listen.parse().unwrap();
    let poke = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        let ch = loop {
            if let Ok(ch) = Channel::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
            {
                break ch;
            }
            assert!(Instant::now() < deadline, "the service did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let mut c = OutboxServiceClient::new(ch.clone());
        let ok = c
            .enqueue(with_token(
                pb::EnqueueRequest {
                    event: Some(event("orders", "k", b"x")),
                },
                Some(PRODUCER),
            ))
            .await;
        assert!(ok.is_ok(), "{ok:?}");
        let bad = c
            .enqueue(with_token(
                pb::EnqueueRequest {
                    event: Some(event("orders", "k", b"x")),
                },
                Some(&format!("{PRODUCER}x")),
            ))
            .await;
        assert_eq!(code(bad), Code::Unauthenticated);
        let mut a = AdminServiceClient::new(ch);
        let denied = a
            .get_stats(with_token(pb::GetStatsRequest::default(), Some(PRODUCER)))
            .await;
        assert_eq!(code(denied), Code::PermissionDenied);
    });
    let out = run_binary(&envs, &[], Duration::from_secs(6)).await;
    poke.await.unwrap();
    check("running service", &out);
    assert!(out.contains("mailroom serving"), "{out}");

    // 3. --help with the secrets in the environment.
    let out = run_binary(&envs, &["--help"], Duration::from_millis(500)).await;
    check("--help", &out);
    assert!(out.contains("MAILROOM_DATABASE_URL"), "{out}");
}

//! The production surface (issue 7): tokens and scopes, overload, transport limits,
//! secrets in logs, metrics, retention and TLS, against real PostgreSQL and SQLite.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support::probe::*;
use crate::support::*;
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::pb::outbox_service_client::OutboxServiceClient;
use mailroom::retention::{RetentionConfig, run_round};
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::Channel;

const ENGINES: [Engine; 2] = [Engine::Postgres, Engine::Sqlite];

fn with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

fn code<T>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(e) => e.code(),
    }
}

const PRODUCER: &str = "producer-orders-0123456789";
const PRODUCER_ANY: &str = "producer-any-topic-0123456789";
const ADMIN: &str = "admin-operator-0123456789";

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

#[tokio::test]
async fn tokens_scopes_and_topics() {
    let (url, dir) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.tokens = mailroom::api::auth::load_tokens(&token_file(dir.path())).unwrap();
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

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Far more concurrent callers than the server admits: every answer is OK,
/// RESOURCE_EXHAUSTED or UNAVAILABLE, refusals come fast, every OK is stored, and memory
/// stays bounded.
#[tokio::test]
async fn overload_sheds_fast_and_loses_nothing() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.overload.max_concurrent_rpcs = 8;
    c.intake.queue_depth = 16;
    c.intake.writers = 2;
    c.database_max_connections = 4;
    let s = Service::start(c).await;
    let addr = s.app.addr;
    let rss_before = rss_kib();

    let callers = 128;
    let until = Instant::now() + Duration::from_secs(4);
    let slowest_refusal = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..callers {
        let slowest = slowest_refusal.clone();
        // A channel per 8 callers: many HTTP/2 connections, many streams each.
        let ch = channel(addr).await;
        tasks.push(tokio::spawn(async move {
            let mut client = OutboxServiceClient::new(ch);
            let mut ok = Vec::new();
            let mut codes = Vec::new();
            let mut i = 0u64;
            while Instant::now() < until {
                i += 1;
                let mut e = event("load", &format!("k{}", w % 16), &[7u8; 256]);
                e.idempotency_key = format!("w{w}-{i}");
                let t = Instant::now();
                match client.enqueue(pb::EnqueueRequest { event: Some(e) }).await {
                    Ok(r) => ok.push(r.into_inner().id),
                    Err(st) => {
                        slowest.fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                        codes.push(st.code());
                    }
                }
            }
            (ok, codes)
        }));
    }
    let mut ok_ids = Vec::new();
    let mut refused = std::collections::HashMap::<Code, usize>::new();
    for t in tasks {
        let (ok, codes) = t.await.unwrap();
        ok_ids.extend(ok);
        for c in codes {
            *refused.entry(c).or_default() += 1;
        }
    }
    let rss_after = rss_kib();
    eprintln!(
        "ok={} refused={refused:?} slowest refusal={}µs rss {}→{} KiB",
        ok_ids.len(),
        slowest_refusal.load(Ordering::Relaxed),
        rss_before,
        rss_after
    );
    for c in refused.keys() {
        assert!(
            matches!(c, Code::ResourceExhausted | Code::Unavailable),
            "unexpected code {c:?}"
        );
    }
    assert!(
        refused.get(&Code::ResourceExhausted).copied().unwrap_or(0) > 0,
        "the load was meant to exceed the limit"
    );
    assert!(ok_ids.len() > 100, "the server kept serving");
    assert!(
        slowest_refusal.load(Ordering::Relaxed) < 2_000_000,
        "refusals must be quick"
    );
    // Every acknowledged event is stored.
    let distinct: HashSet<i64> = ok_ids.iter().copied().collect();
    assert_eq!(distinct.len(), ok_ids.len());
    for id in &ok_ids {
        assert!(
            s.found(BoxKind::Outbox, *id).await.is_some(),
            "acknowledged event {id} is missing"
        );
    }
    assert!(
        rss_after < rss_before + 256 * 1024,
        "memory grew without bound: {rss_before} → {rss_after} KiB"
    );
    s.app.stop().await.unwrap();
}

/// An exhausted database pool answers UNAVAILABLE within the acquire timeout and the RPC
/// timeout, instead of queueing; the service recovers when the database does.
#[tokio::test]
async fn exhausted_pool_is_unavailable_quickly() {
    use sqlx::Connection;
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.database_max_connections = 2;
    c.database_acquire_timeout = Duration::from_millis(300);
    c.overload.rpc_timeout = Some(Duration::from_millis(1500));
    c.intake.writers = 4;
    let mut s = Service::start(c).await;
    enqueue(&mut s.client, event("t", "k", b"warm")).await;

    // Hold a lock every insert needs: the writers' connections block on it.
    let mut blocker = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query("LOCK TABLE outbox_events IN EXCLUSIVE MODE")
        .execute(&mut blocker)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..12 {
        let mut client = s.client.clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = client
                .enqueue(pb::EnqueueRequest {
                    event: Some(event("t", &format!("k{i}"), b"x")),
                })
                .await;
            (code(r), t.elapsed())
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in tasks {
        let (c, took) = t.await.unwrap();
        assert_eq!(c, Code::Unavailable, "answer after {took:?}");
        assert!(took < Duration::from_secs(3), "took {took:?}");
    }
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    eventually(Duration::from_secs(10), "enqueue works again", || {
        let mut client = s.client.clone();
        async move {
            client
                .enqueue(pb::EnqueueRequest {
                    event: Some(event("t", "after", b"x")),
                })
                .await
                .is_ok()
        }
    })
    .await;
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn oversized_messages_are_refused_by_the_transport() {
    let (url, _dir) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.limits.max_payload_bytes = 1024;
    c.limits.max_batch = 1;
    let mut s = Service::start(c).await;
    let big = vec![1u8; 4 * 1024 * 1024];
    let t = Instant::now();
    let err = enqueue_err(&mut s.client, Some(event("t", "k", &big))).await;
    assert!(
        matches!(err.code(), Code::OutOfRange | Code::ResourceExhausted),
        "{err:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(s.outbox_count(None).await, 0);
    s.app.stop().await.unwrap();
}

#[tokio::test]
async fn metrics_follow_the_events() {
    let url = fresh_pg().await;
    let dir = tempfile::tempdir().unwrap();

    // 1. Published events.
    let mut c = config(&url);
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c.metrics_stats_interval = Duration::from_millis(100);
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(dir.path().join("out.jsonl")),
    };
    let mut s = Service::start(c).await;
    let maddr = s.app.metrics_addr.expect("metrics address");
    for i in 0..5 {
        enqueue(
            &mut s.client,
            event("metrics.a", "secret-key-42", format!("{i}").as_bytes()),
        )
        .await;
    }
    let mut dup = event("metrics.a", "secret-key-42", b"d");
    dup.idempotency_key = "idem".into();
    enqueue(&mut s.client, dup.clone()).await;
    enqueue(&mut s.client, dup).await;
    eventually(Duration::from_secs(10), "published counter", || async {
        sample(&scrape(maddr).await, "mailroom_outbox_published_total") >= 6.0
    })
    .await;
    eventually(
        Duration::from_secs(10),
        "pending gauge back to 0",
        || async {
            let t = scrape(maddr).await;
            sample_opt(&t, "mailroom_outbox_oldest_pending_age_seconds") == Some(0.0)
                && !t.contains("mailroom_outbox_pending{topic=\"metrics.a\"} 1")
        },
    )
    .await;
    let text = scrape(maddr).await;
    assert_eq!(
        sample(&text, "mailroom_outbox_enqueued_total{topic=\"metrics.a\"}"),
        6.0
    );
    assert_eq!(
        sample(
            &text,
            "mailroom_outbox_duplicates_total{topic=\"metrics.a\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            "mailroom_grpc_requests_total{method=\"/mailroom.v1.OutboxService/Enqueue\",code=\"OK\"}"
        ),
        7.0
    );
    assert!(sample(&text, "mailroom_relay_cycle_seconds_count") >= 1.0);
    assert_eq!(
        sample(&text, "mailroom_relay_delivered_after_failure_total"),
        0.0
    );
    assert_eq!(sample(&text, "mailroom_relay_leases_lost_total"), 0.0);
    assert!(sample(&text, "mailroom_relay_publish_seconds_count") >= 1.0);
    // Every histogram is cumulative once: buckets never decrease, +Inf equals _count.
    let checked =
        mailroom::metrics::check_histograms(body(&text)).unwrap_or_else(|p| panic!("{p:#?}"));
    assert!(checked >= 3, "{checked} histogram series");
    assert!(!text.contains("secret-key-42"), "keys are never labels");
    // An invalid request is counted under its code.
    let _ = s
        .client
        .enqueue(pb::EnqueueRequest {
            event: Some(event("bad topic", "", b"")),
        })
        .await;
    let text = scrape(maddr).await;
    assert_eq!(
        sample(
            &text,
            "mailroom_grpc_requests_total{method=\"/mailroom.v1.OutboxService/Enqueue\",code=\"INVALID_ARGUMENT\"}"
        ),
        1.0
    );
    s.app.stop().await.unwrap();

    // 2. Counted failures, failed events, requeue (every delivery fails).
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c.metrics_stats_interval = Duration::from_millis(100);
    c.faults = (1.0, 0.0);
    c.relay.retry.base = Duration::ZERO;
    c.relay.retry.cap = Duration::ZERO;
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(dir.path().join("out2.jsonl")),
    };
    let mut s = Service::start(c).await;
    let maddr = s.app.metrics_addr.unwrap();
    for i in 0..3 {
        let mut e = event("metrics.b", &format!("k{i}"), b"x");
        e.max_attempts = 2;
        enqueue(&mut s.client, e).await;
    }
    eventually(Duration::from_secs(15), "failed events", || async {
        let t = scrape(maddr).await;
        sample(&t, "mailroom_outbox_failed_total") == 3.0
            && sample_opt(&t, "mailroom_outbox_failed_events{topic=\"metrics.b\"}") == Some(3.0)
    })
    .await;
    let text = scrape(maddr).await;
    assert_eq!(
        sample(&text, "mailroom_outbox_retried_total{class=\"counted\"}"),
        3.0
    );
    assert_eq!(sample(&text, "mailroom_outbox_published_total"), 0.0);
    let mut admin = AdminServiceClient::new(channel(s.app.addr).await);
    admin
        .requeue_failed(pb::RequeueFailedRequest {
            filter: Some(pb::EventFilter {
                topic: "metrics.b".into(),
                ..Default::default()
            }),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    let text = scrape(maddr).await;
    assert_eq!(sample(&text, "mailroom_outbox_requeued_total"), 3.0);
    s.app.stop().await.unwrap();
}

/// Runs SQL on the test database of either engine.
async fn exec(url: &str, sql: &str) {
    use sqlx::Connection;
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&mut c)
            .await
            .unwrap();
    } else {
        let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&mut c)
            .await
            .unwrap();
    }
}

async fn count(url: &str, sql: &str) -> i64 {
    use sqlx::Connection;
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_one(&mut c)
            .await
            .unwrap()
    } else {
        let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
            .fetch_one(&mut c)
            .await
            .unwrap()
    }
}

/// Retention deletes old completed events, then (when asked) old failed ones, and idle
/// unleased keys; never pending events, recent rows, leased or busy keys.
#[tokio::test]
async fn retention_removes_only_what_it_should() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let pg = url.starts_with("postgres");
        let mut c = quiet_config(&url);
        c.retention.interval = None;
        let mut s = Service::start(c).await;
        // ids 1..=12: old-done (1-3), new-done (4-5), old-failed (6-7), new-failed (8),
        // old pending (9-10), pending on a leased key (11), unkeyed done (12).
        let keys = [
            "a", "a", "b", "c", "c", "d", "d", "e", "f", "f", "leased", "",
        ];
        let mut ids = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            ids.push(enqueue(&mut s.client, event("ret", k, format!("{i}").as_bytes())).await);
        }
        assert_eq!(ids, (1..=12).collect::<Vec<i64>>());
        let (old, recent, infinity, leased_until) = if pg {
            (
                "now() - interval '8 days'".to_string(),
                "now() - interval '1 day'".to_string(),
                "'infinity'".to_string(),
                "now() + interval '1 minute'".to_string(),
            )
        } else {
            let now = chrono::Utc::now().timestamp_micros();
            let day = 86_400_000_000i64;
            (
                (now - 8 * day).to_string(),
                (now - day).to_string(),
                i64::MAX.to_string(),
                (now + 60_000_000).to_string(),
            )
        };
        exec(
            &url,
            &format!(
                "UPDATE outbox_events SET status = 'completed', published_at = {old}, updated_at = {old} WHERE id IN (1, 2, 3, 12);
                 UPDATE outbox_events SET status = 'completed', published_at = {recent}, updated_at = {recent} WHERE id IN (4, 5);
                 UPDATE outbox_events SET status = 'failed', updated_at = {old}, last_error = 'x' WHERE id IN (6, 7);
                 UPDATE outbox_events SET status = 'failed', updated_at = {recent}, last_error = 'x' WHERE id = 8;
                 UPDATE outbox_events SET created_at = {old}, updated_at = {old} WHERE id IN (9, 10, 11);
                 UPDATE outbox_keys SET ready_at = {infinity} WHERE pending = 0;
                 UPDATE outbox_keys SET ready_at = {infinity}, lease_token = 7, lease_until = {leased_until} WHERE event_key = 'leased';"
            ),
        )
        .await;
        // The leased key has a pending event; make one more leased key without any.
        exec(
            &url,
            &format!(
                "INSERT INTO outbox_keys (topic, event_key, ready_at, lease_token, lease_until)
                 VALUES ('ret', 'leased-idle', {infinity}, 8, {leased_until})"
            ),
        )
        .await;

        let stop = CancellationToken::new();
        let mut cfg = RetentionConfig {
            completed: Some(Duration::from_secs(7 * 86_400)),
            failed: None,
            interval: None,
            batch: 2, // several batches per kind
        };
        let r = run_round(s.app.store.as_ref(), &cfg, &stop).await.unwrap();
        assert_eq!((r.completed, r.failed), (4, 0), "{r:?}");
        let left =
            |url: String| async move { count(&url, "SELECT count(*) FROM outbox_events").await };
        assert_eq!(left(url.clone()).await, 8);
        for id in [4, 5, 6, 7, 8, 9, 10, 11] {
            assert!(
                s.found(BoxKind::Outbox, id).await.is_some(),
                "event {id} must survive"
            );
        }
        // Keys: a (all done), b (done), c (recent done), d (failed), e (failed) are idle
        // and go; f (pending), leased (pending, leased) and leased-idle (leased) stay.
        assert_eq!(r.keys, 5, "{r:?}");
        let mut kept: Vec<String> = {
            use sqlx::Connection;
            if pg {
                let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
                sqlx::query_scalar("SELECT event_key FROM outbox_keys")
                    .fetch_all(&mut c)
                    .await
                    .unwrap()
            } else {
                let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
                sqlx::query_scalar("SELECT event_key FROM outbox_keys")
                    .fetch_all(&mut c)
                    .await
                    .unwrap()
            }
        };
        kept.sort();
        assert_eq!(kept, vec!["f", "leased", "leased-idle"]);

        // Failed retention, when configured.
        cfg.failed = Some(Duration::from_secs(7 * 86_400));
        let r = run_round(s.app.store.as_ref(), &cfg, &stop).await.unwrap();
        assert_eq!((r.completed, r.failed, r.keys), (0, 2, 0), "{r:?}");
        assert_eq!(left(url.clone()).await, 6);
        assert!(s.found(BoxKind::Outbox, 8).await.is_some());

        // A pruned key comes back with its next event, and requeue of a failed event on
        // a pruned key works.
        let id = enqueue(&mut s.client, event("ret", "a", b"again")).await;
        assert_eq!(
            count(
                &url,
                "SELECT count(*) FROM outbox_keys WHERE event_key = 'a' AND pending = 1"
            )
            .await,
            1
        );
        let mut admin = AdminServiceClient::new(channel(s.app.addr).await);
        admin
            .requeue_failed(pb::RequeueFailedRequest {
                ids: vec![8],
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(
            count(
                &url,
                "SELECT count(*) FROM outbox_keys WHERE event_key = 'e' AND pending = 1"
            )
            .await,
            1
        );
        assert!(id > 12);
        s.app.stop().await.unwrap();
    }
}

/// The background task runs on its interval and counts what it deletes.
#[tokio::test]
async fn retention_runs_in_the_background() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.retention = RetentionConfig {
        completed: Some(Duration::from_secs(3600)),
        failed: None,
        interval: Some(Duration::from_millis(100)),
        batch: 10,
    };
    let mut s = Service::start(c).await;
    for i in 0..25 {
        enqueue(&mut s.client, event("bg", &format!("k{}", i % 3), b"x")).await;
    }
    exec(
        &url,
        "UPDATE outbox_events SET status = 'completed', published_at = now() - interval '2 hours' WHERE id <= 20",
    )
    .await;
    eventually(Duration::from_secs(10), "expired rows deleted", || async {
        count(&url, "SELECT count(*) FROM outbox_events").await == 5
    })
    .await;
    // The round counts what it deleted once it has finished (idle keys come last).
    let metrics = s.app.metrics.clone();
    eventually(Duration::from_secs(5), "the deletes counted", || {
        let text = metrics.encode();
        async move {
            sample_opt(
                &text,
                "mailroom_retention_deleted_total{status=\"completed\"}",
            ) == Some(20.0)
        }
    })
    .await;
    s.app.stop().await.unwrap();
}

struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
    other_client_cert: String,
    other_client_key: String,
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

    // mTLS: a client certificate from the CA is required.
    let (url, _d) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.tls = Some(mailroom::tls::ServerTls {
        cert,
        key,
        client_ca: Some(ca),
    });
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

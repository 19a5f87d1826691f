//! Issue 12: safe by default, and the secured setups the docs promise work. Each test
//! names the control it checks in `docs/security.md`; removing the control fails it.
//!
//! - TLS towards Kafka: a TLS-terminating proxy (rustls) in front of a private tansu that
//!   advertises the proxy; the relay's producer and the inbox's consumer go through it,
//!   with zstd-compressed records.
//! - TLS towards PostgreSQL: a throwaway cluster (`initdb`, `ssl = on`, a test CA) on a
//!   free port that refuses connections without TLS.
//! - TLS and mTLS towards an inbox handler and from `mailroom admin`.

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use mailroom::access::{Scope, TokenEntry};
use mailroom::config::{Config, Settings};
use mailroom::inbox::SubscriptionConfig;
use mailroom::pb;
use mailroom::pb::handler_service_server::HandlerService;
use mailroom::pb::inbox_service_client::InboxServiceClient;
use mailroom::relay::backoff::RetryPolicy;
use mailroom::tls::ClientTls;
use tonic::{Request, Response, Status};
use tonic_types::StatusExt;

// ---------------------------------------------------------------- a recording handler

#[derive(Clone, Default)]
pub(crate) struct Seen {
    pub(crate) payloads: Arc<Mutex<Vec<Vec<u8>>>>,
    pub(crate) authorization: Arc<Mutex<Vec<String>>>,
    pub(crate) grpc_timeout: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl HandlerService for Seen {
    async fn handle(
        &self,
        request: Request<pb::HandleRequest>,
    ) -> Result<Response<pb::HandleResponse>, Status> {
        let md = request.metadata();
        let get = |k: &str| {
            md.get(k)
                .map(|v| v.to_str().unwrap_or("").to_string())
                .unwrap_or_default()
        };
        self.authorization
            .lock()
            .unwrap()
            .push(get("authorization"));
        self.grpc_timeout.lock().unwrap().push(get("grpc-timeout"));
        self.payloads
            .lock()
            .unwrap()
            .push(request.into_inner().payload);
        Ok(Response::new(pb::HandleResponse::default()))
    }
}

fn subscription(name: &str, topics: &[&str], handler: &str) -> SubscriptionConfig {
    SubscriptionConfig {
        name: name.into(),
        topics: topics.iter().map(|t| t.to_string()).collect(),
        group: format!("g-{name}-{}", uuid::Uuid::new_v4().simple()),
        handler: handler.into(),
        handler_timeout: Duration::from_secs(2),
        concurrency: 4,
        retry: RetryPolicy {
            base: Duration::from_millis(200),
            cap: Duration::from_secs(1),
            max_attempts: 5,
        },
        handler_tls: ClientTls::default(),
        handler_token: None,
        dead_letter_topic: None,
        handler_max_defer: Duration::from_secs(86_400),
    }
}

pub(crate) fn token(name: &str, secret: &str, scopes: &[Scope]) -> TokenEntry {
    TokenEntry {
        name: name.into(),
        token: secret.into(),
        certificate: None,
        scopes: scopes.to_vec(),
        topics: None,
        subscriptions: None,
    }
}

fn bearer<T>(msg: T, secret: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut()
        .insert("authorization", format!("Bearer {secret}").parse().unwrap());
    r
}

/// An unauthenticated caller inventing method paths must not grow the metrics' label
/// set: every path the server does not serve is counted as `unknown`.
#[tokio::test]
async fn invented_paths_do_not_grow_metric_labels() {
    let (db, _dir) = fresh_sqlite();
    let mut c = config(&db);
    c.tokens = vec![token(
        "ops",
        "ops-token-0123456789",
        &[Scope::Admin, Scope::Enqueue],
    )];
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let s = Service::start(c).await;
    let ch = channel(s.app.addr).await;
    let mut grpc = tonic::client::Grpc::new(ch);
    for i in 0..25 {
        grpc.ready().await.unwrap();
        let path: tonic::codegen::http::uri::PathAndQuery =
            format!("/evil{i}.Service/Grow{i}").parse().unwrap();
        let r = grpc
            .unary(
                Request::new(pb::GetStatsRequest::default()),
                path,
                tonic_prost::ProstCodec::<pb::GetStatsRequest, pb::GetStatsResponse>::default(),
            )
            .await;
        assert_eq!(r.unwrap_err().code(), tonic::Code::Unauthenticated);
    }
    let text = crate::support::probe::scrape(s.app.metrics_addr.unwrap()).await;
    assert!(
        !text.contains("evil"),
        "invented paths became labels:\n{text}"
    );
    assert!(
        text.contains("method=\"unknown\",code=\"UNAUTHENTICATED\""),
        "{text}"
    );
    s.app.stop().await.unwrap();
}

/// A token with the inbox scope limited to subscriptions may push to those only, sees
/// only those in ListSubscriptions, and cannot probe the names of others.
#[tokio::test]
async fn inbox_tokens_are_limited_to_their_subscriptions() {
    let (db, _dir) = fresh_sqlite();
    let mut c = config(&db);
    c.relays = 0;
    let handler = serve_handler(Seen::default()).await;
    c.subscriptions = vec![
        subscription("billing", &[], &handler),
        subscription("shipping", &[], &handler),
    ];
    let mut limited = token("billing-pusher", "billing-token-0123456", &[Scope::Inbox]);
    limited.subscriptions = Some(vec!["billing".into()]);
    c.tokens = vec![limited];
    let s = Service::start(c).await;
    let mut inbox = InboxServiceClient::new(channel(s.app.addr).await);
    let msg = |sub: &str| pb::ReceiveRequest {
        subscription: sub.into(),
        message_id: "m-1".into(),
        topic: "orders".into(),
        payload: b"x".to_vec(),
        ..Default::default()
    };
    let secret = "billing-token-0123456";
    inbox
        .receive(bearer(msg("billing"), secret))
        .await
        .expect("its own subscription");
    for other in ["shipping", "no-such-subscription"] {
        let e = inbox.receive(bearer(msg(other), secret)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{other}: {e:?}");
        assert!(!e.message().contains(other), "{e:?}");
    }
    let list = inbox
        .list_subscriptions(bearer(pb::ListSubscriptionsRequest::default(), secret))
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = list.subscriptions.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["billing"]);
    s.app.stop().await.unwrap();
}

// ---------------------------------------------------------------- §2 handler TLS

/// Defers every message, not counted, to ten years from now.
#[derive(Clone, Default)]
struct Deferrer {
    calls: Arc<Mutex<u32>>,
}

#[tonic::async_trait]
impl HandlerService for Deferrer {
    async fn handle(
        &self,
        _request: Request<pb::HandleRequest>,
    ) -> Result<Response<pb::HandleResponse>, Status> {
        *self.calls.lock().unwrap() += 1;
        let far = chrono::Utc::now() + chrono::Duration::days(3650);
        Ok(Response::new(pb::HandleResponse {
            outcome: Some(pb::handle_response::Outcome::Retry(pb::HandleRetry {
                not_before: Some(prost_types::Timestamp {
                    seconds: far.timestamp(),
                    nanos: 0,
                }),
                count_attempt: false,
                reason: "come back in ten years".into(),
            })),
        }))
    }
}

/// A handler's `retry.not_before` is cut to `handler_max_defer_ms`, and the key parked
/// by that uncounted deferral (attempts still 0) shows in `ListPending` as blocked, with
/// the deferral as its last error, on both engines.
#[tokio::test]
async fn a_handlers_deferral_is_capped_and_visible_in_list_pending() {
    for (name, engine) in [("sqlite", Engine::Sqlite), ("postgres", Engine::Postgres)] {
        let (db, _dir) = fresh_db(&engine).await;
        let d = Deferrer::default();
        let url = serve_handler(d.clone()).await;
        let mut c = config(&db);
        c.relays = 0;
        let mut sub = subscription("parked", &[], &url);
        sub.handler_max_defer = Duration::from_secs(3600);
        c.subscriptions = vec![sub];
        let s = Service::start(c).await;
        let mut inbox = InboxServiceClient::new(channel(s.app.addr).await);
        receive_on(&mut inbox, "parked", "d-1", "orders", "k-1", b"x").await;
        let mut admin =
            pb::admin_service_client::AdminServiceClient::new(channel(s.app.addr).await);
        let mut page = pb::ListPendingResponse::default();
        for _ in 0..100 {
            page = admin
                .list_pending(pb::ListPendingRequest {
                    r#box: pb::Box::Inbox as i32,
                    only_blocked: true,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            if !page.keys.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            page.keys.len(),
            1,
            "{name}: the parked key is listed as blocked"
        );
        let k = &page.keys[0];
        assert_eq!(k.key, "k-1");
        assert_eq!(k.head_attempts, 0, "an uncounted deferral");
        assert!(
            k.head_last_error.contains("deferred"),
            "{}",
            k.head_last_error
        );
        assert_eq!(page.total_blocked_keys, 1);
        let next = k.head_next_attempt_at.as_ref().unwrap().seconds;
        let cap = chrono::Utc::now().timestamp() + 3600 + 5;
        assert!(
            next <= cap,
            "{name}: not_before capped to an hour, got {next}"
        );
        assert_eq!(*d.calls.lock().unwrap(), 1);
        s.app.stop().await.unwrap();
    }
}

// ---------------------------------------------------------------- §4 admin actions

/// The audit entry records the authenticated token apart from the operator name the
/// caller claims; a bulk requeue with an empty filter needs `all = true`; a repeated
/// `request_id` acts once and answers the first outcome again.
#[tokio::test]
async fn admin_actions_record_the_principal_need_all_and_replay_request_ids() {
    for (name, engine) in [("sqlite", Engine::Sqlite), ("postgres", Engine::Postgres)] {
        let (db, _dir) = fresh_db(&engine).await;
        let mut c = config(&db);
        c.relays = 0;
        c.tokens = vec![token(
            "ops",
            "ops-token-0123456789",
            &[Scope::Admin, Scope::Enqueue],
        )];
        let secret = "ops-token-0123456789";
        let s = Service::start(c).await;
        let mut outbox = s.client.clone();
        let mut ids = Vec::new();
        for i in 0..3 {
            let r = outbox
                .enqueue(bearer(
                    pb::EnqueueRequest {
                        event: Some(event("orders", &format!("k{i}"), b"x")),
                    },
                    secret,
                ))
                .await
                .unwrap()
                .into_inner();
            ids.push(r.id);
        }
        let mut admin =
            pb::admin_service_client::AdminServiceClient::new(channel(s.app.addr).await);
        let cancel = |rid: &str| pb::CancelEventsRequest {
            ids: vec![ids[0]],
            reason: "bad data".into(),
            operator: "mallory (token root)".into(),
            request_id: rid.into(),
            ..Default::default()
        };
        let first = admin
            .cancel_events(bearer(cancel("cancel-1"), secret))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((first.count, first.replayed), (1, false), "{name}");
        // The retry of the same call: not a second action, not an error.
        let again = admin
            .cancel_events(bearer(cancel("cancel-1"), secret))
            .await
            .unwrap()
            .into_inner();
        assert!(again.replayed, "{name}");
        assert_eq!(again.audit_id, first.audit_id);
        assert_eq!(again.ids, vec![ids[0]]);
        // Without a request id, the same call is a second (refused) action.
        let e = admin
            .cancel_events(bearer(cancel(""), secret))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{name}");

        // Bulk requeue with an empty filter: refused without all = true.
        let bulk = |all: bool, rid: &str| pb::RequeueFailedRequest {
            filter: Some(pb::EventFilter::default()),
            all,
            operator: "ops-person".into(),
            request_id: rid.into(),
            ..Default::default()
        };
        let e = admin
            .requeue_failed(bearer(bulk(false, ""), secret))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}");
        assert!(e.message().contains("all"), "{}", e.message());
        let r1 = admin
            .requeue_failed(bearer(bulk(true, "requeue-1"), secret))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r1.count, r1.replayed), (1, false), "{name}");
        let r2 = admin
            .requeue_failed(bearer(bulk(true, "requeue-1"), secret))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r2.count, r2.replayed, r2.audit_id), (1, true, r1.audit_id));

        let audit = admin
            .list_audit(bearer(pb::ListAuditRequest::default(), secret))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(audit.entries.len(), 2, "{name}: one entry per action");
        for e in &audit.entries {
            assert_eq!(e.principal, "ops", "{name}: the authenticated token");
        }
        let cancel_entry = audit.entries.iter().find(|e| e.action == "cancel").unwrap();
        assert!(cancel_entry.actor.starts_with("mallory"));
        assert_eq!(cancel_entry.request_id, "cancel-1");
        s.app.stop().await.unwrap();
    }
}

// ---------------------------------------------------------------- §4 read-only admin tokens

/// A sink that fails every record (counted) while `failing` is set, else delivers.
#[derive(Default)]
struct SwitchSink {
    failing: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl mailroom::sink::Sink for SwitchSink {
    async fn deliver(
        &self,
        lines: &[Vec<&mailroom::domain::StoredEvent>],
    ) -> Vec<Vec<mailroom::sink::Delivery>> {
        use mailroom::sink::{Delivery, Failure};
        let failing = self.failing.load(std::sync::atomic::Ordering::SeqCst);
        lines
            .iter()
            .map(|l| {
                l.iter()
                    .map(|_| {
                        if failing {
                            Delivery::Failed(Failure::Counted {
                                error: "broker down".into(),
                                retry_at: None,
                            })
                        } else {
                            Delivery::Delivered
                        }
                    })
                    .collect()
            })
            .collect()
    }
}

/// The `admin_read` scope: the AdminService's reads answer, its actions (RequeueFailed,
/// CancelEvents, even as a dry run) are `PERMISSION_DENIED` with reason
/// `PERMISSION_DENIED` and `required_scope = admin`, and change nothing; `mailroom admin
/// requeue` with such a token says why. An `admin` token of the same server still
/// requeues.
#[tokio::test]
async fn admin_read_tokens_read_but_cannot_act() {
    use mailroom::domain::{BoxKind, Status as EventStatus};
    use mailroom::pb::admin_service_client::AdminServiceClient;
    let (db, _dir) = fresh_sqlite();
    let mut c = config(&db);
    let viewer = "viewer-token-0123456789";
    let ops = "ops-token-0123456789";
    c.tokens = vec![
        token("viewer", viewer, &[Scope::AdminRead]),
        token("ops", ops, &[Scope::Admin, Scope::Enqueue]),
    ];
    let sink = Arc::new(SwitchSink::default());
    sink.failing
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let s = Service::start_with_sink(c, sink.clone()).await;
    let mut e = event("orders", "o-1", b"x");
    e.max_attempts = 1;
    let id = s
        .client
        .clone()
        .enqueue(bearer(pb::EnqueueRequest { event: Some(e) }, ops))
        .await
        .unwrap()
        .into_inner()
        .id;
    let status_of = || {
        let store = s.app.store.clone();
        async move {
            store
                .get_event(BoxKind::Outbox, id)
                .await
                .unwrap()
                .unwrap()
                .status
        }
    };
    eventually(Duration::from_secs(20), "the event failed", || async {
        status_of().await == EventStatus::Failed
    })
    .await;

    let mut admin = AdminServiceClient::new(channel(s.app.addr).await);
    admin
        .list_pending(bearer(pb::ListPendingRequest::default(), viewer))
        .await
        .expect("ListPending with admin_read");
    let failed = admin
        .list_events(bearer(
            pb::ListEventsRequest {
                status: pb::EventStatus::Failed as i32,
                ..Default::default()
            },
            viewer,
        ))
        .await
        .expect("ListEvents with admin_read")
        .into_inner();
    assert_eq!(failed.events.len(), 1);
    admin
        .get_event(bearer(
            pb::GetEventRequest {
                id,
                ..Default::default()
            },
            viewer,
        ))
        .await
        .expect("GetEvent with admin_read");
    admin
        .get_stats(bearer(pb::GetStatsRequest::default(), viewer))
        .await
        .expect("GetStats with admin_read");
    admin
        .list_audit(bearer(pb::ListAuditRequest::default(), viewer))
        .await
        .expect("ListAudit with admin_read");

    let requeue = |dry_run: bool| pb::RequeueFailedRequest {
        ids: vec![id],
        dry_run,
        operator: "viewer-person".into(),
        ..Default::default()
    };
    let denied = |e: Status, what: &str| {
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{what}: {e:?}");
        let info = e
            .get_details_error_info()
            .unwrap_or_else(|| panic!("{what}: no ErrorInfo in {e:?}"));
        assert_eq!(info.reason, "PERMISSION_DENIED", "{what}");
        assert_eq!(info.domain, "mailroom.v1", "{what}");
        assert_eq!(info.metadata["required_scope"], "admin", "{what}");
        assert!(e.message().contains("admin_read"), "{what}: {e:?}");
    };
    for dry_run in [false, true] {
        let e = admin
            .requeue_failed(bearer(requeue(dry_run), viewer))
            .await
            .unwrap_err();
        denied(e, &format!("RequeueFailed dry_run={dry_run}"));
    }
    let e = admin
        .cancel_events(bearer(
            pb::CancelEventsRequest {
                ids: vec![id],
                reason: "no".into(),
                ..Default::default()
            },
            viewer,
        ))
        .await
        .unwrap_err();
    denied(e, "CancelEvents");
    // Nor does admin_read reach the other services.
    let e = s
        .client
        .clone()
        .enqueue(bearer(
            pb::EnqueueRequest {
                event: Some(event("orders", "o-2", b"x")),
            },
            viewer,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied);

    // The CLI with the read-only token: a clear error, exit status 1.
    let server = format!("http://{}", s.app.addr);
    let out = tokio::task::spawn_blocking({
        let id = id.to_string();
        move || {
            Command::new(env!("CARGO_BIN_EXE_mailroom"))
                .args(["admin", "--server", &server, "requeue", &id, "--yes"])
                .env_clear()
                .env("MAILROOM_ADMIN_TOKEN", "viewer-token-0123456789")
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("PERMISSION_DENIED: ") && stderr.contains("may only read (admin_read)"),
        "{stderr}"
    );

    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(status_of().await, EventStatus::Failed, "nothing requeued");
    assert!(
        s.app
            .store
            .list_audit(10, None)
            .await
            .unwrap()
            .entries
            .is_empty(),
        "no audit entry for a refused action"
    );

    // The admin token still acts.
    sink.failing
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let r = admin
        .requeue_failed(bearer(requeue(false), ops))
        .await
        .expect("RequeueFailed with admin")
        .into_inner();
    assert_eq!(r.count, 1);
    eventually(
        Duration::from_secs(20),
        "the requeued event completed",
        || async { status_of().await == EventStatus::Completed },
    )
    .await;
    s.app.stop().await.unwrap();
}

// ---------------------------------------------------------------- §3 statement timeout

/// Each query class has its own pool with its own `statement_timeout`, so a query that
/// outlives its class's timeout is cancelled by the server (`57014`) and the RPC is
/// `DEADLINE_EXCEEDED` with nothing changed, while the other classes go on; migrations
/// run without a timeout. Through the service: with a 300 ms admin timeout, a `GetStats`
/// that waits on a lock is cancelled while `Enqueue` still answers OK.
#[tokio::test]
async fn postgres_statement_timeouts_are_per_query_class() {
    let db = fresh_pg().await;
    let mut c = config(&db);
    c.relays = 0;
    c.database_timeouts = mailroom::config::DatabaseTimeouts {
        enqueue: Some(Duration::from_millis(4000)),
        relay: Some(Duration::from_millis(2500)),
        admin: Some(Duration::from_millis(300)),
    };
    // Migrations (run by open_store) are exempt; the service's pools are not.
    mailroom::app::open_store(&c).await.expect("migrated");
    let pools = mailroom::app::pg_pools(&c).await.unwrap();
    for (pool, want) in [
        (&pools.enqueue, "4s"),
        (&pools.relay, "2500ms"),
        (&pools.admin, "300ms"),
    ] {
        let t: String = sqlx::query_scalar("SHOW statement_timeout")
            .fetch_one(pool)
            .await
            .unwrap();
        assert_eq!(t, want);
    }
    let started = std::time::Instant::now();
    let e = sqlx::query("SELECT pg_sleep(5)")
        .execute(&pools.admin)
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3), "{e}");
    assert!(e.to_string().contains("statement timeout"), "{e}");
    sqlx::query("SELECT pg_sleep(1)")
        .execute(&pools.enqueue)
        .await
        .expect("the enqueue class allows 4 s");

    // Through the service: GetStats reads small count tables, so make it wait on a lock
    // another session holds (a statement timeout counts lock waits too). Enqueues do not
    // touch that table and keep their own, longer timeout.
    let mut holder = pools.enqueue.begin().await.unwrap();
    sqlx::query("LOCK TABLE public.outbox_completed_counts IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let s = Service::start(c).await;
    let mut admin = pb::admin_service_client::AdminServiceClient::new(channel(s.app.addr).await);
    let e = admin
        .get_stats(pb::GetStatsRequest {
            r#box: pb::Box::Outbox as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    assert_eq!(
        e.get_details_error_info().map(|i| i.reason),
        Some("STATEMENT_TIMEOUT".to_string())
    );
    let mut client = s.client.clone();
    client
        .enqueue(pb::EnqueueRequest {
            event: Some(event("orders", "k", b"still accepted")),
        })
        .await
        .expect("enqueues have their own timeout");
    holder.rollback().await.unwrap();
    s.app.stop().await.unwrap();

    // The defaults: 10 s for enqueues, 30 s for relays and the admin; the general
    // setting applies to every class without its own.
    let d = config(&db).database_timeouts;
    assert_eq!(d.enqueue, Some(Duration::from_secs(10)));
    assert_eq!(d.relay, Some(Duration::from_secs(30)));
    assert_eq!(d.admin, Some(Duration::from_secs(30)));
    let general = Config::resolve(Settings {
        database_statement_timeout_ms: Some(5000),
        database_admin_timeout_ms: Some(0),
        ..Default::default()
    })
    .unwrap()
    .database_timeouts;
    assert_eq!(general.enqueue, Some(Duration::from_secs(5)));
    assert_eq!(general.relay, Some(Duration::from_secs(5)));
    assert_eq!(general.admin, None);
}

// ---------------------------------------------------------------- §4 idempotency tenancy

/// Idempotency keys are scoped by topic: a producer limited to its topic cannot take,
/// or learn anything about, a key another topic uses (its enqueue is simply stored); a
/// retry on the same topic is still a duplicate and other content still a conflict. The
/// 128-bit fingerprint is stored in `content_fp` (version 2). Both engines.
#[tokio::test]
async fn idempotency_keys_are_scoped_by_topic_with_a_128_bit_fingerprint() {
    for (name, engine) in [("sqlite", Engine::Sqlite), ("postgres", Engine::Postgres)] {
        let (db, _dir) = fresh_db(&engine).await;
        let mut c = config(&db);
        c.relays = 0;
        let mut payments = token("payments", "payments-token-012345", &[Scope::Enqueue]);
        payments.topics = Some(vec!["payments".into()]);
        let mut orders = token("orders", "orders-token-01234567", &[Scope::Enqueue]);
        orders.topics = Some(vec!["orders".into()]);
        c.tokens = vec![payments, orders];
        let s = Service::start(c).await;
        let mut client = s.client.clone();
        let send = |topic: &str, payload: &[u8]| {
            let mut e = event(topic, "k", payload);
            e.idempotency_key = "req-1".into();
            pb::EnqueueRequest { event: Some(e) }
        };
        let p1 = client
            .enqueue(bearer(
                send("payments", b"debit 10"),
                "payments-token-012345",
            ))
            .await
            .unwrap()
            .into_inner();
        // Another tenant, another topic, the same key: stored, not a duplicate of (or a
        // conflict with) the payments event.
        let o1 = client
            .enqueue(bearer(send("orders", b"anything"), "orders-token-01234567"))
            .await
            .unwrap()
            .into_inner();
        assert!(!o1.duplicate, "{name}");
        assert_ne!(o1.id, p1.id, "{name}");
        // Within a topic the key keeps its meaning.
        let p2 = client
            .enqueue(bearer(
                send("payments", b"debit 10"),
                "payments-token-012345",
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((p2.id, p2.duplicate), (p1.id, true), "{name}");
        let e = client
            .enqueue(bearer(
                send("payments", b"debit 99"),
                "payments-token-012345",
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::AlreadyExists, "{name}");
        s.app.stop().await.unwrap();
        // The stored fingerprint: 16 bytes, version 2.
        let (fp_len, version): (i64, i64) = match engine {
            Engine::Sqlite => {
                let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
                sqlx::query_as(
                    "SELECT length(content_fp), content_fp_version FROM outbox_events
                     WHERE id = ?1",
                )
                .bind(p1.id)
                .fetch_one(&pool)
                .await
                .unwrap()
            }
            Engine::Postgres => {
                let pool = sqlx::PgPool::connect(&db).await.unwrap();
                sqlx::query_as(
                    "SELECT octet_length(content_fp)::int8, content_fp_version::int8
                     FROM outbox_events WHERE id = $1",
                )
                .bind(p1.id)
                .fetch_one(&pool)
                .await
                .unwrap()
            }
        };
        assert_eq!((fp_len, version), (16, 2), "{name}");
    }
}

//! The operator surface over the inbox (issue 5), against real PostgreSQL and SQLite:
//! messages pushed with `InboxService.Receive` to subscriptions whose handlers are real
//! gRPC servers (or down), then ListPending, GetStats, GetEvent, ListEvents,
//! RequeueFailed, CancelEvents with `box = BOX_INBOX`, the wake-up of keys a dispatcher
//! held, and `mailroom admin --inbox`.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::*;
use mailroom::config::Config;
use mailroom::domain::admin::{ActionContext, AdminKey, RequeueRequest, Selection};
use mailroom::domain::{BoxKind, InboundMessage, Status};
use mailroom::inbox::SubscriptionConfig;
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::pb::inbox_service_client::InboxServiceClient;
use tonic::Code;
use tonic::transport::Channel;

const INBOX: i32 = pb::Box::Inbox as i32;

/// A subscriber whose answer depends on the payload: `reject-once` is rejected the first
/// time its message id is seen and handled the next; `retry` asks for a counted retry;
/// anything else is handled.
type Handler = Recorder<RejectOnce>;

#[derive(Default)]
struct RejectOnce;

#[tonic::async_trait]
impl Script for RejectOnce {
    async fn answer(&self, call: &Call, seen_before: bool) -> Answer {
        use pb::handle_response::Outcome;
        // Messages pushed with Receive reach the handler as `rpc:<the producer's id>`.
        producer_id(call);
        Ok(Some(match call.payload.as_str() {
            "reject-once" if !seen_before => Outcome::Reject(pb::HandleReject {
                reason: "not today".into(),
            }),
            "retry" => Outcome::Retry(pb::HandleRetry {
                not_before: None,
                count_attempt: true,
                reason: "busy".into(),
            }),
            _ => Outcome::Success(pb::HandleSuccess {}),
        }))
    }
}

/// The producer's id of a message pushed with Receive (`rpc:<id>` at the handler).
fn producer_id(c: &Call) -> String {
    let id = c.message_id.strip_prefix("rpc:");
    id.expect("a Receive id is rpc:<id>").to_string()
}

/// The handler's calls, with the producer's message ids.
fn calls(h: &Handler) -> Vec<Call> {
    let by_producer = |c: Call| Call {
        message_id: producer_id(&c),
        ..c
    };
    h.calls().into_iter().map(by_producer).collect()
}

/// Message ids handled for `key`, in call order.
fn ids_for(h: &Handler, key: &str) -> Vec<String> {
    let of_key = calls(h).into_iter().filter(|c| c.key == key);
    of_key.map(|c| c.message_id).collect()
}

/// A handler URL nobody listens on: delivery fails transiently, nothing is spent, the
/// messages stay pending with their heads unblocked.
fn down() -> String {
    format!("http://127.0.0.1:{}", free_port())
}

fn subscription(name: &str, handler: &str) -> SubscriptionConfig {
    SubscriptionConfig {
        group: format!("g-{name}"),
        handler_timeout: Duration::from_secs(2),
        ..crate::support::subscription(name, &[], handler)
    }
}

/// A service with the given subscriptions and no outbox relay.
async fn service(
    engine: &Engine,
    subs: Vec<SubscriptionConfig>,
) -> (Service, String, Option<tempfile::TempDir>) {
    let (url, dir) = fresh_db(engine).await;
    let mut c: Config = quiet_config(&url);
    c.subscriptions = subs;
    (Service::start(c).await, url, dir)
}

async fn admin(s: &Service) -> AdminServiceClient<Channel> {
    AdminServiceClient::new(channel(s.app.addr).await)
}

async fn inbox(s: &Service) -> Inbox {
    inbox_client(s).await
}

type Inbox = InboxServiceClient<Channel>;

/// A Receive that must store a new message; its id.
async fn receive(c: &mut Inbox, sub: &str, id: &str, key: &str, payload: &str) -> i64 {
    let r = crate::support::receive(c, sub, id, key, payload).await;
    assert!(!r.duplicate);
    r.id
}

async fn status(s: &Service, id: i64) -> (Status, u32, Option<String>) {
    let e = s.found(BoxKind::Inbox, id).await.expect("inbox message");
    (e.status, e.attempts, e.last_error)
}

async fn pending(
    a: &mut AdminServiceClient<Channel>,
    r: pb::ListPendingRequest,
) -> pb::ListPendingResponse {
    a.list_pending(pb::ListPendingRequest { r#box: INBOX, ..r })
        .await
        .expect("list pending")
        .into_inner()
}

fn groups(r: &pb::ListPendingResponse) -> Vec<(String, String, i64)> {
    r.keys
        .iter()
        .map(|k| (k.subscription.clone(), k.key.clone(), k.pending))
        .collect()
}

fn g(sub: &str, key: &str, n: i64) -> (String, String, i64) {
    (sub.into(), key.into(), n)
}

#[tokio::test]
async fn the_inbox_backlog_by_subscription_and_key_stats_events_and_the_cli() {
    for engine in &ENGINES {
        // Both handlers are down: every message stays pending, nothing is spent.
        let (s, _url, _dir) = service(
            engine,
            vec![
                subscription("billing", &down()),
                subscription("shipping", &down()),
            ],
        )
        .await;
        let mut ic = inbox(&s).await;
        let mut ids: HashMap<(&str, &str), Vec<i64>> = HashMap::new();
        for (sub, key, n) in [
            ("billing", "k1", 3),
            ("billing", "k2", 1),
            ("billing", "", 2),
            ("shipping", "k1", 2),
        ] {
            for i in 0..n {
                let mid = format!("{sub}-{key}-{i}");
                let id = receive(&mut ic, sub, &mid, key, "x").await;
                ids.entry((sub, key)).or_default().push(id);
            }
        }
        let mut a = admin(&s).await;

        // The same key name in two subscriptions is two groups; ties go by
        // (subscription, topic, key).
        let all = pending(&mut a, Default::default()).await;
        assert_eq!(
            groups(&all),
            vec![
                g("billing", "k1", 3),
                g("billing", "", 2),
                g("shipping", "k1", 2),
                g("billing", "k2", 1),
            ]
        );
        assert_eq!(
            (all.total_pending, all.total_keys, all.total_blocked_keys),
            (8, 4, 0)
        );
        let ship = all
            .keys
            .iter()
            .find(|k| k.subscription == "shipping")
            .unwrap();
        assert_eq!(ship.head_id, ids[&("shipping", "k1")][0]);
        assert_eq!((ship.head_attempts, ship.blocked), (0, false));
        assert_eq!(ship.topic, "direct");

        // Pages of two: the cursor carries the subscription.
        let p1 = pending(
            &mut a,
            pb::ListPendingRequest {
                page_size: 2,
                ..Default::default()
            },
        )
        .await;
        let p2 = pending(
            &mut a,
            pb::ListPendingRequest {
                page_size: 2,
                page_token: p1.next_page_token.clone(),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(groups(&p1), groups(&all)[..2].to_vec());
        assert_eq!(groups(&p2), groups(&all)[2..].to_vec());
        assert!(p2.next_page_token.is_empty());
        // Oldest first, over both subscriptions.
        let oldest = pending(
            &mut a,
            pb::ListPendingRequest {
                order: pb::PendingOrder::Oldest as i32,
                ..Default::default()
            },
        )
        .await;
        let heads: Vec<i64> = oldest.keys.iter().map(|k| k.head_id).collect();
        assert_eq!(
            heads,
            vec![
                ids[&("billing", "k1")][0],
                ids[&("billing", "k2")][0],
                ids[&("billing", "")][0],
                ids[&("shipping", "k1")][0],
            ]
        );

        // One subscription.
        let only = pending(
            &mut a,
            pb::ListPendingRequest {
                subscription: "shipping".into(),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(groups(&only), vec![g("shipping", "k1", 2)]);
        assert_eq!((only.total_pending, only.total_keys), (2, 1));
        let none = pending(
            &mut a,
            pb::ListPendingRequest {
                subscription: "nobody".into(),
                ..Default::default()
            },
        )
        .await;
        assert_eq!((none.keys.len(), none.total_pending), (0, 0));

        // The outbox is another box: empty, and it has no subscriptions.
        let outbox = a
            .list_pending(pb::ListPendingRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!((outbox.keys.len(), outbox.total_pending), (0, 0));
        let err = a
            .list_pending(pb::ListPendingRequest {
                subscription: "billing".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(field_of(&err), "subscription");

        // Stats per (subscription, topic), and for one subscription.
        let st = a
            .get_stats(pb::GetStatsRequest {
                r#box: INBOX,
                ..Default::default()
            })
            .await
            .expect("inbox stats")
            .into_inner();
        assert_eq!((st.pending, st.completed, st.failed), (8, 0, 0));
        assert!(st.oldest_pending_age.is_some());
        let topics: Vec<(String, String, i64)> = st
            .topics
            .iter()
            .map(|t| (t.subscription.clone(), t.topic.clone(), t.pending))
            .collect();
        assert_eq!(
            topics,
            vec![
                ("billing".into(), "direct".into(), 6),
                ("shipping".into(), "direct".into(), 2)
            ]
        );
        let st = a
            .get_stats(pb::GetStatsRequest {
                r#box: INBOX,
                subscription: "shipping".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((st.pending, st.topics.len()), (2, 1));
        let st = a
            .get_stats(pb::GetStatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(st.pending, 0, "the outbox is empty");

        // GetEvent and ListEvents carry the subscription and the message id.
        let id = ids[&("shipping", "k1")][1];
        let e = a
            .get_event(pb::GetEventRequest {
                r#box: INBOX,
                id,
                include_payload: true,
                ..Default::default()
            })
            .await
            .expect("inbox event")
            .into_inner()
            .event
            .unwrap();
        assert_eq!(
            (e.subscription.as_str(), e.message_id.as_str()),
            ("shipping", "rpc:shipping-k1-1")
        );
        assert_eq!((e.status, e.attempts), (pb::EventStatus::Pending as i32, 0));
        assert_eq!(e.payload, b"x");
        let err = a
            .get_event(pb::GetEventRequest {
                id,
                ..Default::default()
            })
            .await;
        // The outbox has no such event (its ids are its own).
        assert_eq!(err.unwrap_err().code(), Code::NotFound);
        let listed = a
            .list_events(pb::ListEventsRequest {
                r#box: INBOX,
                filter: Some(pb::EventFilter {
                    subscription: "shipping".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut got: Vec<i64> = listed.events.iter().map(|e| e.id).collect();
        got.reverse();
        assert_eq!(got, ids[&("shipping", "k1")]);
        assert!(listed.events.iter().all(|e| e.subscription == "shipping"));

        // The CLI: --inbox shows the subscription column, --subscription narrows.
        let out = cli_ok(s.app.addr, &["pending", "--inbox"]).await;
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("SUBSCRIPTION  TOPIC"), "{out}");
        assert!(
            lines[1].starts_with("billing") && lines[1].contains("k1"),
            "{out}"
        );
        assert!(lines.iter().any(|l| l.starts_with("shipping")), "{out}");
        assert!(
            out.contains("total: 8 pending in 4 key(s), 0 blocked"),
            "{out}"
        );
        let j = cli_json(
            s.app.addr,
            &["pending", "--box", "inbox", "--subscription", "shipping"],
        )
        .await;
        assert_eq!(j["keys"].as_array().unwrap().len(), 1);
        assert_eq!(j["keys"][0]["subscription"], "shipping");
        assert_eq!(j["keys"][0]["pending"], 2);
        let j = cli_json(s.app.addr, &["pending", "--subscription", "billing"]).await;
        assert_eq!(j["total_pending"], 6, "--subscription implies --inbox");
        let out = cli_ok(s.app.addr, &["get", &id.to_string(), "--inbox"]).await;
        assert!(out.contains("subscription    shipping"), "{out}");
        assert!(out.contains("message_id      rpc:shipping-k1-1"), "{out}");
        let j = cli_json(s.app.addr, &["get", &id.to_string(), "--inbox"]).await;
        assert_eq!(
            (j["subscription"].as_str(), j["message_id"].as_str()),
            (Some("shipping"), Some("rpc:shipping-k1-1"))
        );
        let out = cli_ok(s.app.addr, &["stats", "--inbox"]).await;
        assert!(out.starts_with("SUBSCRIPTION  TOPIC"), "{out}");
        assert!(out.contains("shipping"), "{out}");
        let j = cli_json(s.app.addr, &["stats", "--inbox"]).await;
        assert_eq!(j["topics"][1]["subscription"], "shipping");
        assert_eq!(j["pending"], 8);
        // Without --inbox, the outbox as before: no subscription column.
        let out = cli_ok(s.app.addr, &["pending"]).await;
        assert!(out.starts_with("TOPIC"), "{out}");
        let (ok, _, err) = cli(
            s.app.addr,
            &["pending", "--box", "outbox", "--subscription", "x"],
        )
        .await;
        assert!(!ok && err.contains("contradicts"), "{err}");

        // Nothing was spent against the handlers that are down.
        for id in ids.values().flatten() {
            assert_eq!(status(&s, *id).await, (Status::Pending, 0, None));
        }
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn requeued_inbox_messages_go_back_to_the_handler_in_order() {
    for engine in &ENGINES {
        let handler = Handler::default();
        let url = handler.serve().await;
        let (s, _url, _dir) = service(
            engine,
            vec![subscription("orders", &url), subscription("other", &url)],
        )
        .await;
        let mut ic = inbox(&s).await;
        let mut r = Vec::new();
        for i in 0..3 {
            r.push(receive(&mut ic, "orders", &format!("r-{i}"), "r", "reject-once").await);
        }
        let ok = receive(&mut ic, "orders", "ok-0", "ok", "fine").await;
        let other = receive(&mut ic, "other", "o-0", "r", "reject-once").await;
        eventually(Duration::from_secs(20), "rejected messages failed", || {
            let s = &s;
            let r = r.clone();
            async move {
                let mut all = r;
                all.push(other);
                for id in all {
                    if status(s, id).await.0 != Status::Failed {
                        return false;
                    }
                }
                status(s, ok).await.0 == Status::Completed
            }
        })
        .await;
        let (_, _, err) = status(&s, r[0]).await;
        assert!(err.unwrap().contains("not today"));
        assert_eq!(ids_for(&handler, "r").len(), 4);

        let mut a = admin(&s).await;
        let st = a
            .get_stats(pb::GetStatsRequest {
                r#box: INBOX,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((st.pending, st.completed, st.failed), (0, 1, 4));
        let failed = a
            .list_events(pb::ListEventsRequest {
                r#box: INBOX,
                status: pb::EventStatus::Failed as i32,
                filter: Some(pb::EventFilter {
                    subscription: "orders".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(failed.events.len(), 3);
        let out = cli_ok_open(s.app.addr, &["failed", "--inbox"]).await;
        assert!(
            out.starts_with("ID") && out.contains("SUBSCRIPTION  MESSAGE ID  TOPIC"),
            "{out}"
        );
        assert!(out.contains("orders") && out.contains("r-2"), "{out}");
        assert!(out.contains("other") && out.contains("not today"), "{out}");

        // A subscription filter with the outbox is refused; a dry run changes nothing.
        let filter = pb::EventFilter {
            subscription: "orders".into(),
            error_contains: "not today".into(),
            ..Default::default()
        };
        let err = a
            .requeue_failed(pb::RequeueFailedRequest {
                filter: Some(filter.clone()),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(field_of(&err), "filter.subscription");
        let dry = a
            .requeue_failed(pb::RequeueFailedRequest {
                r#box: INBOX,
                filter: Some(filter.clone()),
                dry_run: true,
                ..Default::default()
            })
            .await
            .expect("inbox dry run")
            .into_inner();
        assert_eq!((dry.count, dry.sample_ids.clone()), (3, r.clone()));
        assert_eq!(status(&s, r[0]).await.0, Status::Failed);

        let res = a
            .requeue_failed(pb::RequeueFailedRequest {
                r#box: INBOX,
                filter: Some(filter),
                operator: "dora".into(),
                ..Default::default()
            })
            .await
            .expect("inbox requeue")
            .into_inner();
        assert_eq!(res.count, 3);
        assert!(res.audit_id > 0);
        eventually(Duration::from_secs(20), "requeued messages handled", || {
            let s = &s;
            let r = r.clone();
            async move {
                for id in r {
                    if status(s, id).await.0 != Status::Completed {
                        return false;
                    }
                }
                true
            }
        })
        .await;
        // Each went to the handler a second time, in the original order, with the
        // attempts reset; the other subscription's message was left alone.
        let second: Vec<Call> = calls(&handler).into_iter().skip(5).collect();
        let again: Vec<&str> = second
            .iter()
            .filter(|c| c.key == "r")
            .map(|c| c.message_id.as_str())
            .collect();
        assert_eq!(again, vec!["r-0", "r-1", "r-2"]);
        assert!(second.iter().all(|c| c.attempt == 1), "{second:?}");
        assert_eq!(status(&s, other).await.0, Status::Failed);

        // The audit entry says inbox, and its selection names the subscription.
        let audit = a
            .list_audit(pb::ListAuditRequest::default())
            .await
            .unwrap()
            .into_inner();
        let entry = &audit.entries[0];
        assert_eq!(
            (
                entry.id,
                pb::Box::try_from(entry.r#box),
                entry.action.as_str()
            ),
            (res.audit_id, Ok(pb::Box::Inbox), "requeue")
        );
        let sel: serde_json::Value = serde_json::from_str(&entry.selection).unwrap();
        assert_eq!(sel["filter"]["subscription"], "orders");
        assert_eq!(entry.actor, "dora");

        // By id, with the CLI: the other subscription's message goes back too.
        let out = cli_ok_open(
            s.app.addr,
            &["requeue", &other.to_string(), "--inbox", "--yes"],
        )
        .await;
        assert!(out.starts_with("requeued 1 event(s)"), "{out}");
        eventually(Duration::from_secs(20), "other handled", || async {
            status(&s, other).await.0 == Status::Completed
        })
        .await;
        let out = cli_ok_open(s.app.addr, &["audit"]).await;
        assert!(out.lines().nth(1).unwrap().contains("inbox"), "{out}");
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn cancelling_an_inbox_head_unblocks_its_key() {
    for engine in &ENGINES {
        let handler = Handler::default();
        let url = handler.serve().await;
        let (s, _url, _dir) = service(engine, vec![subscription("jobs", &url)]).await;
        let mut ic = inbox(&s).await;
        // The head asks for a counted retry: its key waits out a 30-60 s backoff.
        let head = receive(&mut ic, "jobs", "j-0", "b", "retry").await;
        let behind = receive(&mut ic, "jobs", "j-1", "b", "fine").await;
        eventually(Duration::from_secs(20), "the head retried once", || async {
            status(&s, head).await.1 == 1
        })
        .await;
        let mut a = admin(&s).await;
        let p = pending(&mut a, Default::default()).await;
        assert_eq!(groups(&p), vec![g("jobs", "b", 2)]);
        assert!(p.keys[0].blocked);
        assert_eq!(p.keys[0].head_id, head);
        assert!(p.keys[0].head_last_error.contains("busy"));
        assert_eq!(p.total_blocked_keys, 1);
        let st = a
            .get_stats(pb::GetStatsRequest {
                r#box: INBOX,
                subscription: "jobs".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(st.blocked_keys, 1);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(status(&s, behind).await.0, Status::Pending, "held back");

        // Dry run, then for real.
        let dry = a
            .cancel_events(pb::CancelEventsRequest {
                r#box: INBOX,
                ids: vec![head],
                reason: "poison".into(),
                dry_run: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((dry.count, dry.audit_id), (1, 0));
        assert_eq!(status(&s, head).await.0, Status::Pending);
        // The outbox has no event with this id.
        let err = a
            .cancel_events(pb::CancelEventsRequest {
                ids: vec![head],
                reason: "poison".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        let res = a
            .cancel_events(pb::CancelEventsRequest {
                r#box: INBOX,
                ids: vec![head],
                reason: "poison".into(),
                ..Default::default()
            })
            .await
            .expect("inbox cancel")
            .into_inner();
        assert_eq!(res.ids, vec![head]);
        eventually(Duration::from_secs(10), "the successor handled", || async {
            status(&s, behind).await.0 == Status::Completed
        })
        .await;
        let (st, _, err) = status(&s, head).await;
        assert_eq!(
            (st, err.as_deref()),
            (Status::Failed, Some("cancelled: poison"))
        );
        assert_eq!(
            ids_for(&handler, "b").last().map(String::as_str),
            Some("j-1")
        );
        let audit = a
            .list_audit(pb::ListAuditRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (
                pb::Box::try_from(audit.entries[0].r#box),
                audit.entries[0].action.as_str()
            ),
            (Ok(pb::Box::Inbox), "cancel")
        );
        let p = pending(&mut a, Default::default()).await;
        assert_eq!((p.total_pending, p.total_keys), (0, 0));
        s.app.stop().await.unwrap();
    }
}

/// Sets a key row's lease and readiness straight in the database, as a dispatcher's
/// claim (`leased`) or its release with "idle" (not leased, ready in the far future)
/// would leave it. Returns whether the key is ready now.
async fn key_row(url: &str, sub: &str, key: &str, set: Option<bool>) -> bool {
    use sqlx::{Connection, Row};
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.unwrap();
        if let Some(leased) = set {
            sqlx::query(
                "UPDATE inbox_keys SET
                     lease_until = CASE WHEN $3 THEN now() + interval '1 hour' END,
                     lease_token = CASE WHEN $3 THEN 1 END,
                     ready_at = 'infinity'
                 WHERE subscription = $1 AND event_key = $2",
            )
            .bind(sub)
            .bind(key)
            .bind(leased)
            .execute(&mut c)
            .await
            .unwrap();
        }
        sqlx::query(
            "SELECT ready_at <= now() AS ready FROM inbox_keys
             WHERE subscription = $1 AND event_key = $2",
        )
        .bind(sub)
        .bind(key)
        .fetch_one(&mut c)
        .await
        .unwrap()
        .get("ready")
    } else {
        let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
        let now = chrono::Utc::now().timestamp_micros();
        if let Some(leased) = set {
            sqlx::query(
                "UPDATE inbox_keys SET
                     lease_until = CASE WHEN ?3 THEN ?4 + 3600000000 END,
                     lease_token = CASE WHEN ?3 THEN 1 END,
                     ready_at = 9223372036854775807
                 WHERE subscription = ?1 AND event_key = ?2",
            )
            .bind(sub)
            .bind(key)
            .bind(leased)
            .bind(now)
            .execute(&mut c)
            .await
            .unwrap();
        }
        sqlx::query(
            "SELECT ready_at <= ?3 AS ready FROM inbox_keys
             WHERE subscription = ?1 AND event_key = ?2",
        )
        .bind(sub)
        .bind(key)
        .bind(now + 1_000_000)
        .fetch_one(&mut c)
        .await
        .unwrap()
        .get("ready")
    }
}

/// A requeue while a dispatcher holds the key reports the key (with its subscription);
/// once the dispatcher has released it as idle, waking makes it ready again. Only the
/// named subscription's key row is touched.
#[tokio::test]
async fn keys_a_dispatcher_held_during_a_requeue_are_woken_once_released() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let store = mailroom::app::open_store(&config(&url)).await.unwrap();
        store.migrate().await.unwrap();
        let msg = |id: &str| InboundMessage {
            message_id: id.into(),
            topic: "t".into(),
            key: Some("k".into()),
            payload: b"x".to_vec(),
            headers: Default::default(),
            event_type: None,
            max_attempts: 5,
            failure: None,
        };
        let a = store.receive("s1", &[msg("a")]).await.unwrap()[0];
        store.receive("s2", &[msg("a")]).await.unwrap();
        let mailroom::store::Admission::Inserted(id) = a else {
            panic!("{a:?}")
        };
        // Fail it, as a handler's reject would.
        let cancel = mailroom::domain::admin::CancelRequest {
            ids: vec![id],
            reason: "r".into(),
            context: ActionContext::by("t"),
        };
        store.cancel_events(BoxKind::Inbox, &cancel).await.unwrap();
        key_row(&url, "s1", "k", Some(true)).await;
        key_row(&url, "s2", "k", Some(false)).await;
        let out = store
            .requeue_failed(
                BoxKind::Inbox,
                &RequeueRequest {
                    selection: Selection::Ids(vec![id]),
                    limit: 10,
                    context: ActionContext::by("t"),
                },
            )
            .await
            .unwrap();
        let held = AdminKey {
            subscription: Some("s1".into()),
            topic: "t".into(),
            key: "k".into(),
        };
        assert_eq!(out.leased_keys, vec![held.clone()]);
        // Still leased: reported again, left as it is.
        let still = store
            .wake_released_keys(BoxKind::Inbox, std::slice::from_ref(&held))
            .await
            .unwrap();
        assert_eq!(still, vec![held.clone()]);
        // The dispatcher releases it as idle; the wake-up makes it ready.
        key_row(&url, "s1", "k", Some(false)).await;
        assert!(!key_row(&url, "s1", "k", None).await);
        let still = store
            .wake_released_keys(BoxKind::Inbox, std::slice::from_ref(&held))
            .await
            .unwrap();
        assert!(still.is_empty());
        assert!(key_row(&url, "s1", "k", None).await, "woken");
        assert!(
            !key_row(&url, "s2", "k", None).await,
            "the other subscription's key is untouched"
        );
    }
}

async fn cli(addr: std::net::SocketAddr, args: &[&str]) -> (bool, String, String) {
    admin_cli(addr, Some("tok"), args).await
}

async fn cli_ok(addr: std::net::SocketAddr, args: &[&str]) -> String {
    admin_cli_ok(addr, Some("tok"), args).await
}

/// Without a token (the servers here have none; the others send one, ignored).
async fn cli_ok_open(addr: std::net::SocketAddr, args: &[&str]) -> String {
    admin_cli_ok(addr, None, args).await
}

async fn cli_json(addr: std::net::SocketAddr, args: &[&str]) -> serde_json::Value {
    admin_cli_json(addr, Some("tok"), args).await
}

/// Issue 44, item 2: on both engines, a paused subscription's messages are stored but
/// not handed to its handler, spend no attempt, and are handed over in key order after
/// the resume, while another subscription goes on; the pause shows in
/// ListPausedSubscriptions, GetStats, the metric and the audit log; a pause of a
/// subscription that is not configured is NOT_FOUND, one without a reason
/// INVALID_ARGUMENT; pausing twice and resuming twice change nothing the second time;
/// the CLI lists and resumes.
#[tokio::test]
async fn a_paused_subscription_hands_nothing_over_until_it_is_resumed() {
    for engine in &ENGINES {
        let handler = Handler::default();
        let url = handler.serve().await;
        let (db, _dir) = fresh_db(engine).await;
        let mut c: Config = quiet_config(&db);
        c.subscriptions = vec![subscription("orders", &url), subscription("other", &url)];
        c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
        c.metrics_stats_interval = Duration::from_millis(100);
        let s = Service::start(c).await;
        let mut a = admin(&s).await;
        let pause = |sub: &str, reason: &str| pb::PauseSubscriptionRequest {
            subscription: sub.into(),
            reason: reason.into(),
            operator: "erin".into(),
        };

        let e = a.pause_subscription(pause("nope", "x")).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{engine:?}: {e:?}");
        let e = a
            .pause_subscription(pause("orders", " "))
            .await
            .unwrap_err();
        assert_eq!(
            (e.code(), field_of(&e)),
            (Code::InvalidArgument, "reason".into()),
            "{engine:?}"
        );
        let p = a
            .pause_subscription(pause("orders", "handler deploy"))
            .await
            .unwrap()
            .into_inner();
        assert!(p.changed && p.audit_id > 0, "{engine:?}: {p:?}");
        let again = a
            .pause_subscription(pause("orders", "other reason"))
            .await
            .unwrap()
            .into_inner();
        assert!(!again.changed && again.audit_id == 0, "{engine:?}");
        assert_eq!(again.pause.unwrap().reason, "handler deploy");

        let mut ic = inbox(&s).await;
        let mut held = Vec::new();
        for i in 0..3 {
            held.push(receive(&mut ic, "orders", &format!("p-{i}"), "held", "fine").await);
        }
        let open = receive(&mut ic, "other", "o-0", "open", "fine").await;
        eventually(
            Duration::from_secs(20),
            "the other subscription handled",
            || {
                let s = &s;
                async move { status(s, open).await.0 == Status::Completed }
            },
        )
        .await;
        // Many dispatch polls later: nothing of the paused subscription was handed over.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(ids_for(&handler, "held").is_empty(), "{engine:?}");
        for id in &held {
            assert_eq!(status(&s, *id).await.0, Status::Pending, "{engine:?}");
            assert_eq!(status(&s, *id).await.1, 0, "{engine:?}: no attempt spent");
        }

        let listed = a
            .list_paused_subscriptions(pb::ListPausedSubscriptionsRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(listed.subscriptions.len(), 1, "{engine:?}");
        assert_eq!(listed.subscriptions[0].subscription, "orders");
        assert_eq!(listed.subscriptions[0].actor, "erin");
        let st = a
            .get_stats(pb::GetStatsRequest {
                r#box: INBOX,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let paused: HashMap<&str, bool> = st
            .topics
            .iter()
            .map(|t| (t.subscription.as_str(), t.paused))
            .collect();
        assert_eq!(paused.get("orders"), Some(&true), "{engine:?}: {st:?}");
        assert_eq!(paused.get("other"), Some(&false), "{engine:?}: {st:?}");
        let maddr = s.app.metrics_addr.unwrap();
        eventually(Duration::from_secs(10), "the pause metric", || async move {
            let text = crate::support::probe::scrape(maddr).await;
            crate::support::probe::sample_opt(
                &text,
                "mailroom_inbox_subscription_paused{subscription=\"orders\"}",
            ) == Some(1.0)
        })
        .await;
        let out = cli_json(s.app.addr, &["--inbox", "paused"]).await;
        assert_eq!(out["subscriptions"][0]["subscription"], "orders", "{out}");

        let out = cli_json(s.app.addr, &["--subscription", "orders", "resume"]).await;
        assert_eq!(out["changed"], true, "{engine:?}: {out}");
        let r = a
            .resume_subscription(pb::ResumeSubscriptionRequest {
                subscription: "orders".into(),
                operator: "erin".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!r.changed, "{engine:?}: no longer paused");
        eventually(
            Duration::from_secs(20),
            "the resumed messages handled",
            || {
                let h = &handler;
                async move { ids_for(h, "held").len() == 3 }
            },
        )
        .await;
        assert_eq!(
            ids_for(&handler, "held"),
            ["p-0", "p-1", "p-2"],
            "{engine:?}"
        );
        eventually(
            Duration::from_secs(10),
            "the pause metric gone",
            || async move {
                let text = crate::support::probe::scrape(maddr).await;
                crate::support::probe::sample_opt(
                    &text,
                    "mailroom_inbox_subscription_paused{subscription=\"orders\"}",
                )
                .is_none()
            },
        )
        .await;

        let audit = a
            .list_audit(pb::ListAuditRequest::default())
            .await
            .unwrap()
            .into_inner();
        let entries: Vec<(&str, i32)> = audit
            .entries
            .iter()
            .map(|e| (e.action.as_str(), e.r#box))
            .collect();
        assert_eq!(
            entries,
            [("resume", INBOX), ("pause", INBOX)],
            "{engine:?}: newest first"
        );
        s.app.stop().await.unwrap();
    }
}

/// Issue 44, item 2: on both engines, handled messages are handed to the handler again
/// by filter: a dry run counts and stores nothing; the real call stores copies at the
/// end of their keys' lines, with the message id `redeliver:<request id>:<original id>`
/// and the header `mailroom-redelivered-from`; the handler gets them after the key's
/// earlier messages, in the originals' order; the same request id again does nothing;
/// the CLI redelivers by id; an unknown id is NOT_FOUND.
#[tokio::test]
async fn handled_messages_are_redelivered_at_the_end_of_their_keys_lines() {
    for engine in &ENGINES {
        let handler = Recorder::<crate::support::handler::Accept>::default();
        let url = handler.serve().await;
        let (s, _url, _dir) = service(engine, vec![subscription("orders", &url)]).await;
        let mut ic = inbox(&s).await;
        let mut ids = Vec::new();
        for i in 0..4 {
            ids.push(receive(&mut ic, "orders", &format!("m-{i}"), "k", &format!("p{i}")).await);
        }
        let other = receive(&mut ic, "orders", "j-0", "j", "pj").await;
        eventually(Duration::from_secs(20), "all handled", || {
            let h = &handler;
            async move { h.calls().len() == 5 }
        })
        .await;
        wait_inbox_completed(&s, 5).await;

        let mut a = admin(&s).await;
        // Finding a message by its message id (issue 44, item 5).
        let found = a
            .list_events(pb::ListEventsRequest {
                r#box: INBOX,
                filter: Some(pb::EventFilter {
                    message_id: "rpc:m-2".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let found: Vec<i64> = found.events.iter().map(|e| e.id).collect();
        assert_eq!(found, [ids[2]], "{engine:?}");
        // GetEvent by message id, in any subscription or in the one named.
        for sub in ["", "orders"] {
            let got = a
                .get_event(pb::GetEventRequest {
                    r#box: INBOX,
                    message_id: "rpc:m-2".into(),
                    subscription: sub.into(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .event
                .unwrap();
            assert_eq!(got.id, ids[2], "{engine:?}");
        }
        let e = a
            .get_event(pb::GetEventRequest {
                r#box: INBOX,
                message_id: "rpc:m-2".into(),
                subscription: "billing".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{engine:?}");
        let filter = pb::EventFilter {
            subscription: "orders".into(),
            key: "k".into(),
            ..Default::default()
        };
        let dry = a
            .redeliver_messages(pb::RedeliverMessagesRequest {
                filter: Some(filter.clone()),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(dry.dry_run, "{engine:?}");
        assert_eq!(dry.count, 4, "{engine:?}");
        assert_eq!(dry.sample_ids, ids, "{engine:?}");
        let real = pb::RedeliverMessagesRequest {
            filter: Some(filter),
            limit: 2,
            confirm: true,
            operator: "fay".into(),
            request_id: "rd-1".into(),
            ..Default::default()
        };
        let done = a
            .redeliver_messages(real.clone())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(done.count, 2, "{engine:?}");
        let originals: Vec<i64> = done.copies.iter().map(|c| c.original_id).collect();
        assert_eq!(originals, ids[..2], "{engine:?}: the oldest first");
        let again = a.redeliver_messages(real).await.unwrap().into_inner();
        assert!(again.replayed && again.copies.is_empty(), "{engine:?}");
        assert_eq!(again.audit_id, done.audit_id);

        // By id, through the CLI (the inbox's `republish`, spelled `redeliver`).
        let out = cli_json(
            s.app.addr,
            &["--inbox", "redeliver", &other.to_string(), "--yes"],
        )
        .await;
        assert_eq!(out["count"], 1, "{engine:?}: {out}");
        // An unknown id: NOT_FOUND, nothing stored.
        let e = a
            .redeliver_messages(pb::RedeliverMessagesRequest {
                ids: vec![ids[0], 999_999],
                confirm: true,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{engine:?}: {e:?}");

        eventually(Duration::from_secs(20), "the copies handled", || {
            let h = &handler;
            async move { h.calls().len() == 8 }
        })
        .await;
        let k: Vec<String> = handler
            .calls()
            .into_iter()
            .filter(|c| c.key == "k")
            .map(|c| c.message_id)
            .collect();
        assert_eq!(
            k,
            [
                "rpc:m-0".to_string(),
                "rpc:m-1".into(),
                "rpc:m-2".into(),
                "rpc:m-3".into(),
                format!("redeliver:rd-1:{}", ids[0]),
                format!("redeliver:rd-1:{}", ids[1]),
            ],
            "{engine:?}"
        );
        let payloads: Vec<String> = handler
            .calls()
            .into_iter()
            .filter(|c| c.message_id.starts_with("redeliver:rd-1:"))
            .map(|c| c.payload)
            .collect();
        assert_eq!(payloads, ["p0", "p1"], "{engine:?}");
        let copy = s.stored(BoxKind::Inbox, done.copies[0].id).await;
        assert_eq!(
            copy.headers.get("mailroom-redelivered-from"),
            Some(&ids[0].to_string()),
            "{engine:?}"
        );
        let audit = a
            .list_audit(pb::ListAuditRequest::default())
            .await
            .unwrap()
            .into_inner();
        let redeliveries: Vec<(i64, i32, &str)> = audit
            .entries
            .iter()
            .filter(|e| e.action == "redeliver")
            .map(|e| (e.count, e.r#box, e.actor.as_str()))
            .collect();
        assert_eq!(redeliveries.len(), 2, "{engine:?}: {redeliveries:?}");
        assert!(redeliveries.contains(&(2, INBOX, "fay")), "{engine:?}");

        // A redeliver job (issue 44, item 4): every handled message of key `k`, the two
        // copies included, handed over again after them, in id order.
        wait_inbox_completed(&s, 8).await;
        let job = a
            .start_job(pb::StartJobRequest {
                kind: pb::JobKind::Redeliver as i32,
                filter: Some(pb::EventFilter {
                    subscription: "orders".into(),
                    key: "k".into(),
                    ..Default::default()
                }),
                confirm: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .job
            .unwrap();
        assert_eq!((job.total, job.r#box), (6, INBOX), "{engine:?}");
        eventually(Duration::from_secs(30), "the job's copies handled", || {
            let h = &handler;
            async move { h.calls().len() == 14 }
        })
        .await;
        let ended = loop {
            let j = a
                .get_job(pb::GetJobRequest { id: job.id })
                .await
                .unwrap()
                .into_inner()
                .job
                .unwrap();
            if j.finished_at.is_some() {
                break j;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(
            (ended.state, ended.done),
            (pb::JobState::Completed as i32, 6),
            "{engine:?}"
        );
        let by_job: Vec<String> = handler
            .calls()
            .into_iter()
            .filter(|c| c.key == "k")
            .skip(6)
            .map(|c| c.message_id)
            .collect();
        let mut originals = ids.clone();
        originals.extend(done.copies.iter().map(|c| c.id));
        let want: Vec<String> = originals
            .iter()
            .map(|o| format!("redeliver:job-{}:{o}", job.id))
            .collect();
        assert_eq!(by_job, want, "{engine:?}");
        s.app.stop().await.unwrap();
    }
}

/// Waits until `n` inbox messages are completed.
async fn wait_inbox_completed(s: &Service, n: i64) {
    let store = &s.app.store;
    eventually(
        Duration::from_secs(20),
        "inbox messages completed",
        || async move {
            store
                .count_events(BoxKind::Inbox, Some(Status::Completed))
                .await
                .unwrap()
                == n
        },
    )
    .await;
}

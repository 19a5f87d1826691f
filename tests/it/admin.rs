//! The operator surface (issue 4), against real PostgreSQL and SQLite: ListPending,
//! RequeueFailed, CancelEvents, GetEvent, ListEvents, ListAudit, GetStats, the bearer
//! token, and the `mailroom admin` CLI end to end.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::*;
use mailroom::domain::BoxKind;
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::sink::SinkConfig;
use mailroom::store::Store;
use tonic::Code;
use tonic::transport::Channel;

const HOUR: Duration = Duration::from_secs(3600);

async fn admin(addr: std::net::SocketAddr) -> AdminServiceClient<Channel> {
    AdminServiceClient::new(channel(addr).await)
}

/// A state a relay's settle would leave an event in.
enum Mark<'a> {
    /// Out of attempts.
    Failed(&'a str),
    /// The key's head waits out a retry for an hour; the key row waits with it.
    Blocked { attempts: i32, error: &'a str },
}

/// Puts one event into a relay-made state, straight in the database (the service runs
/// without relays while a test sets up its backlog).
async fn mark(url: &str, id: i64, m: Mark<'_>) {
    use sqlx::Connection;
    let (failed, attempts, error) = match m {
        Mark::Failed(e) => (true, 3, e),
        Mark::Blocked { attempts, error } => (false, attempts, error),
    };
    if url.starts_with("postgres") {
        let mut c = sqlx::PgConnection::connect(url).await.unwrap();
        let n = sqlx::query(
            "UPDATE outbox_events SET attempts = $2, last_error = $3, updated_at = now(),
                 status = CASE WHEN $4 THEN 'failed' ELSE status END,
                 scheduled_at = CASE WHEN $4 THEN scheduled_at ELSE now() + interval '1 hour' END
             WHERE id = $1 AND status = 'pending'",
        )
        .bind(id)
        .bind(attempts)
        .bind(error)
        .bind(failed)
        .execute(&mut c)
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(n, 1, "event {id} is pending");
        if !failed {
            sqlx::query(
                "UPDATE outbox_keys k SET ready_at = now() + interval '1 hour' FROM outbox_events e
                 WHERE e.id = $1 AND k.topic = e.topic AND k.event_key = e.event_key",
            )
            .bind(id)
            .execute(&mut c)
            .await
            .unwrap();
        }
    } else {
        let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
        let now = chrono::Utc::now().timestamp_micros();
        let later = now + HOUR.as_micros() as i64;
        let n = sqlx::query(
            "UPDATE outbox_events SET attempts = ?2, last_error = ?3, updated_at = ?5,
                 status = CASE WHEN ?4 THEN 'failed' ELSE status END,
                 scheduled_at = CASE WHEN ?4 THEN scheduled_at ELSE ?6 END
             WHERE id = ?1 AND status = 'pending'",
        )
        .bind(id)
        .bind(attempts)
        .bind(error)
        .bind(failed)
        .bind(now)
        .bind(later)
        .execute(&mut c)
        .await
        .unwrap()
        .rows_affected();
        assert_eq!(n, 1, "event {id} is pending");
        if !failed {
            sqlx::query(
                "UPDATE outbox_keys SET ready_at = ?2 WHERE (topic, event_key) =
                     (SELECT topic, event_key FROM outbox_events WHERE id = ?1)",
            )
            .bind(id)
            .bind(later)
            .execute(&mut c)
            .await
            .unwrap();
        }
    }
}

fn blocked(error: &str) -> Mark<'_> {
    Mark::Blocked { attempts: 1, error }
}

fn typed(topic: &str, key: &str, ty: &str) -> pb::Event {
    pb::Event {
        r#type: ty.into(),
        ..event(topic, key, b"x")
    }
}

async fn list_pending(
    a: &mut AdminServiceClient<Channel>,
    r: pb::ListPendingRequest,
) -> pb::ListPendingResponse {
    a.list_pending(r).await.expect("list pending").into_inner()
}

fn groups(r: &pb::ListPendingResponse) -> Vec<(String, String, i64)> {
    r.keys
        .iter()
        .map(|k| (k.topic.clone(), k.key.clone(), k.pending))
        .collect()
}

fn g(t: &str, k: &str, n: i64) -> (String, String, i64) {
    (t.into(), k.into(), n)
}

#[tokio::test]
async fn list_pending_groups_orders_filters_and_pages() {
    for engine in &ENGINES {
        let (mut s, url, _dir) = quiet_on(engine).await;
        let mut ids: HashMap<(&str, &str), Vec<i64>> = HashMap::new();
        // One by one, so creation times follow ids.
        for (t, k, n) in [
            ("a", "k1", 3),
            ("a", "k2", 1),
            ("a", "k3", 2),
            ("a", "", 2),
            ("b", "k1", 4),
            ("b", "x9", 1),
        ] {
            for _ in 0..n {
                let id = enqueue(&mut s.client, event(t, k, b"p")).await;
                ids.entry((t, k)).or_default().push(id);
            }
        }
        let blocked_head = ids[&("a", "k3")][0];
        mark(&url, blocked_head, blocked("broker said no")).await;
        let mut a = admin(s.app.addr).await;

        let all = list_pending(&mut a, pb::ListPendingRequest::default()).await;
        assert_eq!(
            groups(&all),
            vec![
                g("b", "k1", 4),
                g("a", "k1", 3),
                g("a", "", 2),
                g("a", "k3", 2),
                g("a", "k2", 1),
                g("b", "x9", 1),
            ]
        );
        assert_eq!(
            (all.total_pending, all.total_keys, all.total_blocked_keys),
            (13, 6, 1)
        );
        assert!(all.next_page_token.is_empty());
        let k3 = all.keys.iter().find(|k| k.key == "k3").unwrap();
        assert!(k3.blocked);
        assert_eq!(k3.head_id, blocked_head);
        assert_eq!(k3.head_attempts, 1);
        assert_eq!(k3.head_last_error, "broker said no");
        let next = k3.head_next_attempt_at.unwrap().seconds;
        assert!(
            next > chrono::Utc::now().timestamp() + 3000,
            "due in an hour"
        );
        let b1 = all
            .keys
            .iter()
            .find(|k| k.topic == "b" && k.key == "k1")
            .unwrap();
        assert!(!b1.blocked);
        assert_eq!(b1.head_id, ids[&("b", "k1")][0]);
        assert_eq!(b1.head_attempts, 0);
        let unkeyed = all.keys.iter().find(|k| k.key.is_empty()).unwrap();
        assert_eq!(unkeyed.head_id, ids[&("a", "")][0]);

        // Oldest first: the heads in acceptance order.
        let oldest = list_pending(
            &mut a,
            pb::ListPendingRequest {
                order: pb::PendingOrder::Oldest as i32,
                ..Default::default()
            },
        )
        .await;
        let heads: Vec<i64> = oldest.keys.iter().map(|k| k.head_id).collect();
        let mut sorted = heads.clone();
        sorted.sort();
        assert_eq!(heads, sorted);
        assert_eq!(heads.len(), 6);

        // Filters.
        let by_topic = list_pending(
            &mut a,
            pb::ListPendingRequest {
                topic: "a".into(),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(
            groups(&by_topic),
            vec![
                g("a", "k1", 3),
                g("a", "", 2),
                g("a", "k3", 2),
                g("a", "k2", 1)
            ]
        );
        assert_eq!((by_topic.total_pending, by_topic.total_keys), (8, 4));
        let by_prefix = list_pending(
            &mut a,
            pb::ListPendingRequest {
                key_prefix: "k".into(),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(
            groups(&by_prefix),
            vec![
                g("b", "k1", 4),
                g("a", "k1", 3),
                g("a", "k3", 2),
                g("a", "k2", 1)
            ]
        );
        let only_blocked = list_pending(
            &mut a,
            pb::ListPendingRequest {
                only_blocked: true,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(groups(&only_blocked), vec![g("a", "k3", 2)]);
        assert_eq!(only_blocked.total_blocked_keys, 1);

        // Pages of two cover everything once, also while the backlog changes.
        for order in [pb::PendingOrder::MostPending, pb::PendingOrder::Oldest] {
            let mut seen = Vec::new();
            let mut token = String::new();
            let mut pages = 0;
            loop {
                let p = list_pending(
                    &mut a,
                    pb::ListPendingRequest {
                        order: order as i32,
                        page_size: 2,
                        page_token: token.clone(),
                        ..Default::default()
                    },
                )
                .await;
                assert!(p.keys.len() <= 2);
                seen.extend(p.keys.iter().map(|k| (k.topic.clone(), k.key.clone())));
                pages += 1;
                if pages == 1 {
                    // A new key arrives between pages: it sorts before the cursor in
                    // both orders (1 pending / newest) or after it, never twice.
                    enqueue(&mut s.client, event("c", &format!("new-{order:?}"), b"")).await;
                }
                if p.next_page_token.is_empty() {
                    break;
                }
                token = p.next_page_token;
            }
            let mut uniq = seen.clone();
            uniq.sort();
            uniq.dedup();
            assert_eq!(uniq.len(), seen.len(), "no group twice: {seen:?}");
            for k in &all.keys {
                assert!(
                    seen.contains(&(k.topic.clone(), k.key.clone())),
                    "{order:?} lost {}/{}",
                    k.topic,
                    k.key
                );
            }
        }

        // Bad requests.
        let err = a
            .list_pending(pb::ListPendingRequest {
                page_token: "not a token".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(field_of(&err), "page_token");
        let p = list_pending(
            &mut a,
            pb::ListPendingRequest {
                page_size: 1,
                ..Default::default()
            },
        )
        .await;
        let err = a
            .list_pending(pb::ListPendingRequest {
                page_token: p.next_page_token,
                order: pb::PendingOrder::Oldest as i32,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(field_of(&err), "page_token");
        let err = a
            .list_pending(pb::ListPendingRequest {
                page_size: 1001,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(field_of(&err), "page_size");
        // The inbox is another box (tests/it/admin_inbox.rs): here it is empty.
        let inbox = list_pending(
            &mut a,
            pb::ListPendingRequest {
                r#box: pb::Box::Inbox as i32,
                ..Default::default()
            },
        )
        .await;
        assert_eq!((inbox.keys.len(), inbox.total_pending), (0, 0));
        let err = a
            .list_pending(pb::ListPendingRequest {
                r#box: 7,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(field_of(&err), "box");
        s.app.stop().await.unwrap();
    }
}

async fn statuses(store: &dyn Store, ids: &[i64]) -> Vec<(String, u32, Option<String>)> {
    let mut out = Vec::new();
    for id in ids {
        let e = store
            .get_event(BoxKind::Outbox, *id)
            .await
            .unwrap()
            .unwrap();
        out.push((e.status.as_str().to_string(), e.attempts, e.last_error));
    }
    out
}

async fn requeue(
    a: &mut AdminServiceClient<Channel>,
    ids: Vec<i64>,
    filter: pb::EventFilter,
    dry_run: bool,
) -> pb::RequeueFailedResponse {
    a.requeue_failed(pb::RequeueFailedRequest {
        ids,
        filter: Some(filter),
        dry_run,
        operator: "ops".into(),
        ..Default::default()
    })
    .await
    .expect("requeue")
    .into_inner()
}

#[tokio::test]
async fn requeue_by_ids_and_by_each_filter_with_dry_run_and_audit() {
    for engine in &ENGINES {
        let (mut s, url, _dir) = quiet_on(engine).await;
        let store = s.app.store.clone();
        let mut a = admin(s.app.addr).await;
        // Early failures.
        let e1 = enqueue(&mut s.client, typed("orders", "o1", "created")).await;
        let e2 = enqueue(&mut s.client, typed("orders", "o2", "paid")).await;
        let e3 = enqueue(&mut s.client, typed("users", "u1", "created")).await;
        for id in [e1, e2, e3] {
            mark(&url, id, Mark::Failed(&format!("timeout on {id}"))).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let between = chrono::Utc::now();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Later failures.
        let e4 = enqueue(&mut s.client, typed("orders", "o1", "created")).await;
        let e5 = enqueue(&mut s.client, typed("users", "u2", "deleted")).await;
        let pending = enqueue(&mut s.client, typed("users", "u3", "created")).await;
        for id in [e4, e5] {
            mark(&url, id, Mark::Failed("poison payload")).await;
        }
        let all_failed = [e1, e2, e3, e4, e5];

        // Dry run: count and sample, nothing changes, no audit entry.
        let r = requeue(&mut a, vec![], pb::EventFilter::default(), true).await;
        assert_eq!((r.count, r.dry_run, r.audit_id), (5, true, 0));
        assert_eq!(r.sample_ids, all_failed.to_vec());
        assert!(
            statuses(store.as_ref(), &all_failed)
                .await
                .iter()
                .all(|s| s.0 == "failed")
        );
        let audit = a
            .list_audit(pb::ListAuditRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(audit.entries.is_empty());

        // Each filter, dry run.
        let ts = |t: chrono::DateTime<chrono::Utc>| prost_types::Timestamp {
            seconds: t.timestamp(),
            nanos: t.timestamp_subsec_nanos() as i32,
        };
        let cases: Vec<(pb::EventFilter, Vec<i64>)> = vec![
            (
                pb::EventFilter {
                    topic: "orders".into(),
                    ..Default::default()
                },
                vec![e1, e2, e4],
            ),
            (
                pb::EventFilter {
                    key: "o1".into(),
                    ..Default::default()
                },
                vec![e1, e4],
            ),
            (
                pb::EventFilter {
                    r#type: "created".into(),
                    ..Default::default()
                },
                vec![e1, e3, e4],
            ),
            (
                pb::EventFilter {
                    error_contains: "poison".into(),
                    ..Default::default()
                },
                vec![e4, e5],
            ),
            (
                pb::EventFilter {
                    error_contains: format!("on {e2}"),
                    ..Default::default()
                },
                vec![e2],
            ),
            (
                pb::EventFilter {
                    updated_after: Some(ts(between)),
                    ..Default::default()
                },
                vec![e4, e5],
            ),
            (
                pb::EventFilter {
                    updated_before: Some(ts(between)),
                    ..Default::default()
                },
                vec![e1, e2, e3],
            ),
            (
                pb::EventFilter {
                    topic: "users".into(),
                    r#type: "created".into(),
                    ..Default::default()
                },
                vec![e3],
            ),
        ];
        for (f, want) in cases {
            let r = requeue(&mut a, vec![], f.clone(), true).await;
            assert_eq!(r.sample_ids, want, "{f:?}");
            assert_eq!(r.count, want.len() as i64);
        }
        let limited = a
            .requeue_failed(pb::RequeueFailedRequest {
                limit: 2,
                dry_run: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((limited.count, limited.sample_ids), (2, vec![e1, e2]));

        // Errors change nothing.
        let err = a
            .requeue_failed(pb::RequeueFailedRequest {
                ids: vec![e1, 999_999],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        assert!(err.message().contains("999999"), "{}", err.message());
        let err = a
            .requeue_failed(pb::RequeueFailedRequest {
                ids: vec![e1, pending],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert_eq!(statuses(store.as_ref(), &[e1]).await[0].0, "failed");
        let err = a
            .requeue_failed(pb::RequeueFailedRequest {
                ids: vec![e1],
                filter: Some(pb::EventFilter {
                    topic: "orders".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(
            (err.code(), field_of(&err)),
            (Code::InvalidArgument, "ids".into())
        );
        let err = a
            .requeue_failed(pb::RequeueFailedRequest {
                filter: Some(pb::EventFilter {
                    topic: "bad topic!".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(field_of(&err), "filter.topic");
        let err = a
            .requeue_failed(pb::RequeueFailedRequest {
                limit: 100_001,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(field_of(&err), "limit");

        // By ids: back in line, attempts reset, error kept, audited.
        let r = requeue(&mut a, vec![e2, e1], pb::EventFilter::default(), false).await;
        assert_eq!((r.count, r.dry_run), (2, false));
        assert!(r.audit_id > 0);
        assert_eq!(
            statuses(store.as_ref(), &[e1, e2]).await,
            vec![
                ("pending".into(), 0, Some(format!("timeout on {e1}"))),
                ("pending".into(), 0, Some(format!("timeout on {e2}"))),
            ]
        );
        // By filter: the rest of "poison".
        let r = requeue(
            &mut a,
            vec![],
            pb::EventFilter {
                error_contains: "poison".into(),
                ..Default::default()
            },
            false,
        )
        .await;
        assert_eq!(r.sample_ids, vec![e4, e5]);
        assert_eq!(statuses(store.as_ref(), &[e3]).await[0].0, "failed");
        assert_eq!(statuses(store.as_ref(), &[e5]).await[0].0, "pending");

        let audit = a
            .list_audit(pb::ListAuditRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(audit.entries.len(), 2);
        let newest = &audit.entries[0];
        assert_eq!((newest.action.as_str(), newest.count), ("requeue", 2));
        assert_eq!(newest.actor, "ops");
        assert!(newest.selection.contains("poison"), "{}", newest.selection);
        assert_eq!(newest.r#box, pb::Box::Outbox as i32);
        assert!(audit.entries[1].selection.contains(&e1.to_string()));
        assert!(audit.entries[0].id > audit.entries[1].id);
        // Audit pages.
        let p1 = a
            .list_audit(pb::ListAuditRequest {
                page_size: 1,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(p1.entries[0].id, audit.entries[0].id);
        let p2 = a
            .list_audit(pb::ListAuditRequest {
                page_size: 1,
                page_token: p1.next_page_token,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(p2.entries[0].id, audit.entries[1].id);
        assert!(p2.next_page_token.is_empty());

        // The requeued keyed events are counted in the backlog again.
        let p = list_pending(&mut a, pb::ListPendingRequest::default()).await;
        assert_eq!(p.total_pending, 5); // e1, e2, e4, e5 and the never-failed one
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn cancel_moves_pending_to_failed_with_the_reason() {
    for engine in &ENGINES {
        let (mut s, _url, _dir) = quiet_on(engine).await;
        let store = s.app.store.clone();
        let mut a = admin(s.app.addr).await;
        let e1 = enqueue(&mut s.client, event("t", "k", b"1")).await;
        let e2 = enqueue(&mut s.client, event("t", "k", b"2")).await;
        let err = a
            .cancel_events(pb::CancelEventsRequest {
                ids: vec![e1],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(
            (err.code(), field_of(&err)),
            (Code::InvalidArgument, "reason".into())
        );
        let err = a
            .cancel_events(pb::CancelEventsRequest {
                ids: vec![e1, 424_242],
                reason: "x".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        let dry = a
            .cancel_events(pb::CancelEventsRequest {
                ids: vec![e1],
                reason: "poison".into(),
                dry_run: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((dry.count, dry.audit_id), (1, 0));
        assert_eq!(statuses(store.as_ref(), &[e1]).await[0].0, "pending");
        let r = a
            .cancel_events(pb::CancelEventsRequest {
                ids: vec![e1],
                reason: "poison".into(),
                operator: "bob".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r.count, r.ids.clone()), (1, vec![e1]));
        assert!(r.audit_id > 0);
        assert_eq!(
            statuses(store.as_ref(), &[e1, e2]).await,
            vec![
                ("failed".into(), 0, Some("cancelled: poison".into())),
                ("pending".into(), 0, None)
            ]
        );
        // Cancelling it again: it is not pending any more.
        let err = a
            .cancel_events(pb::CancelEventsRequest {
                ids: vec![e1],
                reason: "again".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        let p = list_pending(&mut a, pb::ListPendingRequest::default()).await;
        assert_eq!(groups(&p), vec![g("t", "k", 1)]);
        assert_eq!(p.keys[0].head_id, e2);
        let audit = a
            .list_audit(pb::ListAuditRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(audit.entries[0].action, "cancel");
        assert_eq!(audit.entries[0].actor, "bob");
        s.app.stop().await.unwrap();
    }
}

/// The ids a local sink file holds per key, in the order they were written.
fn published(path: &std::path::Path) -> HashMap<String, Vec<i64>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out: HashMap<String, Vec<i64>> = HashMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json line");
        let key = v["key"].as_str().unwrap_or("").to_string();
        out.entry(key).or_default().push(v["id"].as_i64().unwrap());
    }
    out
}

#[tokio::test]
async fn the_relay_publishes_requeued_events_in_order_and_cancel_unblocks_a_key() {
    for engine in &ENGINES {
        // Phase 1, no relay: key "r" has three failed events, key "b" a blocked head
        // and two successors.
        let (mut s, url, _dir) = quiet_on(engine).await;
        let r: Vec<i64> = {
            let mut v = Vec::new();
            for i in 0..3 {
                v.push(enqueue(&mut s.client, event("t", "r", format!("{i}").as_bytes())).await);
            }
            v
        };
        let b: Vec<i64> = {
            let mut v = Vec::new();
            for i in 0..3 {
                v.push(enqueue(&mut s.client, event("t", "b", format!("{i}").as_bytes())).await);
            }
            v
        };
        for id in &r {
            mark(&url, *id, Mark::Failed("rejected")).await;
        }
        mark(&url, b[0], blocked("broker said no")).await;
        s.app.stop().await.unwrap();

        // Phase 2: a relay publishing to a file.
        let out = tempfile::tempdir().unwrap();
        let sink = out.path().join("sink.jsonl");
        let mut c = config(&url);
        c.relays = 1;
        c.sink = SinkConfig::Local {
            path: Some(sink.clone()),
        };
        let s = Service::start(c).await;
        let mut a = admin(s.app.addr).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(published(&sink).is_empty(), "nothing is due yet");

        let res = requeue(&mut a, r.clone(), pb::EventFilter::default(), false).await;
        assert_eq!(res.count, 3);
        eventually(Duration::from_secs(10), "requeued events published", || {
            let sink = sink.clone();
            async move { published(&sink).get("r").map(Vec::len) == Some(3) }
        })
        .await;
        assert_eq!(published(&sink)["r"], r, "in their original order");

        let res = a
            .cancel_events(pb::CancelEventsRequest {
                ids: vec![b[0]],
                reason: "poison".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(res.count, 1);
        eventually(Duration::from_secs(10), "successors published", || {
            let sink = sink.clone();
            async move { published(&sink).get("b").map(Vec::len) == Some(2) }
        })
        .await;
        assert_eq!(published(&sink)["b"], b[1..].to_vec());
        // The sink writes before the relay's settle commits: wait for the settle.
        let mut counts = (0, 0, 0);
        for _ in 0..100 {
            let st = a
                .get_stats(pb::GetStatsRequest::default())
                .await
                .unwrap()
                .into_inner();
            counts = (st.pending, st.completed, st.failed);
            if counts == (0, 5, 1) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(counts, (0, 5, 1));
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn get_event_list_events_and_stats() {
    for engine in &ENGINES {
        let (mut s, url, _dir) = quiet_on(engine).await;
        let mut a = admin(s.app.addr).await;
        let mut ev = typed("orders", "o1", "created");
        ev.payload = b"hello".to_vec();
        ev.headers = [("h".to_string(), "v".to_string())].into();
        ev.idempotency_key = "idem".into();
        let id = enqueue(&mut s.client, ev).await;
        let blocked = enqueue(&mut s.client, event("orders", "o2", b"")).await;
        let failed = enqueue(&mut s.client, event("users", "u1", b"")).await;
        let unkeyed = enqueue(&mut s.client, event("users", "", b"")).await;
        mark(&url, blocked, self::blocked("broker said no")).await;
        mark(&url, failed, Mark::Failed("nope")).await;

        let e = a
            .get_event(pb::GetEventRequest {
                id,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .event
            .unwrap();
        assert_eq!(
            (e.topic.as_str(), e.key.as_str(), e.r#type.as_str()),
            ("orders", "o1", "created")
        );
        assert_eq!(e.status, pb::EventStatus::Pending as i32);
        assert_eq!((e.payload_size, e.payload.len()), (5, 0));
        assert_eq!(e.headers["h"], "v");
        assert_eq!(e.idempotency_key, "idem");
        let e = a
            .get_event(pb::GetEventRequest {
                id,
                include_payload: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .event
            .unwrap();
        assert_eq!(e.payload, b"hello");
        let err = a
            .get_event(pb::GetEventRequest {
                id: 123_456,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);

        // ListEvents: newest first, by status, paged.
        let page = |status: pb::EventStatus, size: u32, token: String| pb::ListEventsRequest {
            status: status as i32,
            page_size: size,
            page_token: token,
            ..Default::default()
        };
        let all = a
            .list_events(page(pb::EventStatus::Unspecified, 0, String::new()))
            .await
            .unwrap()
            .into_inner();
        let ids: Vec<i64> = all.events.iter().map(|e| e.id).collect();
        assert_eq!(ids, vec![unkeyed, failed, blocked, id]);
        let f = a
            .list_events(page(pb::EventStatus::Failed, 0, String::new()))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            f.events.iter().map(|e| e.id).collect::<Vec<_>>(),
            vec![failed]
        );
        assert_eq!(f.events[0].last_error, "nope");
        let p1 = a
            .list_events(page(pb::EventStatus::Pending, 2, String::new()))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            p1.events.iter().map(|e| e.id).collect::<Vec<_>>(),
            vec![unkeyed, blocked]
        );
        let p2 = a
            .list_events(page(pb::EventStatus::Pending, 2, p1.next_page_token))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(p2.events.iter().map(|e| e.id).collect::<Vec<_>>(), vec![id]);
        assert!(p2.next_page_token.is_empty());
        let by_key = a
            .list_events(pb::ListEventsRequest {
                filter: Some(pb::EventFilter {
                    key: "o2".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            by_key.events.iter().map(|e| e.id).collect::<Vec<_>>(),
            vec![blocked]
        );
        let err = a
            .list_events(page(pb::EventStatus::Unspecified, 0, "%%%".into()))
            .await
            .unwrap_err();
        assert_eq!(field_of(&err), "page_token");

        let st = a
            .get_stats(pb::GetStatsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!((st.pending, st.completed, st.failed), (3, 0, 1));
        assert_eq!(st.blocked_keys, 1);
        assert!(st.oldest_pending_age.is_some());
        let topics: Vec<(String, i64, i64)> = st
            .topics
            .iter()
            .map(|t| (t.topic.clone(), t.pending, t.failed))
            .collect();
        assert_eq!(
            topics,
            vec![("orders".into(), 2, 0), ("users".into(), 1, 1)]
        );
        s.app.stop().await.unwrap();
    }
}

#[tokio::test]
async fn the_admin_token_guards_the_admin_service_only() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let mut c = quiet_config(&url);
        c.admin_token = Some(mailroom::secret::Secret("s3cret".into()));
        let mut s = Service::start(c).await;
        // Producers need no admin token.
        let id = enqueue(&mut s.client, event("t", "k", b"")).await;
        let mut a = admin(s.app.addr).await;
        let with = |auth: Option<&str>| {
            let mut r = tonic::Request::new(pb::GetEventRequest {
                id,
                ..Default::default()
            });
            if let Some(v) = auth {
                r.metadata_mut().insert("authorization", v.parse().unwrap());
            }
            r
        };
        for bad in [
            None,
            Some("Bearer wrong"),
            Some("Bearer s3cre"),
            Some("Basic s3cret"),
        ] {
            let err = a.get_event(with(bad)).await.unwrap_err();
            assert_eq!(err.code(), Code::Unauthenticated, "{bad:?}");
        }
        let err = a
            .get_stats(pb::GetStatsRequest::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated);
        let ok = a
            .get_event(with(Some("Bearer s3cret")))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ok.event.unwrap().id, id);
        // The actor of an authenticated call says so.
        let mut r = tonic::Request::new(pb::CancelEventsRequest {
            ids: vec![id],
            reason: "r".into(),
            operator: "alice".into(),
            ..Default::default()
        });
        r.metadata_mut()
            .insert("authorization", "Bearer s3cret".parse().unwrap());
        a.cancel_events(r).await.unwrap();
        let mut r = tonic::Request::new(pb::ListAuditRequest::default());
        r.metadata_mut()
            .insert("authorization", "Bearer s3cret".parse().unwrap());
        let audit = a.list_audit(r).await.unwrap().into_inner();
        assert_eq!(audit.entries[0].actor, "alice (token)");
        s.app.stop().await.unwrap();
    }
}

async fn cli_ok(addr: std::net::SocketAddr, args: &[&str]) -> String {
    admin_cli_ok(addr, Some("tok"), args).await
}

async fn cli_json(addr: std::net::SocketAddr, args: &[&str]) -> serde_json::Value {
    admin_cli_json(addr, Some("tok"), args).await
}

#[tokio::test]
async fn the_cli_end_to_end() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let mut c = quiet_config(&url);
        c.admin_token = Some(mailroom::secret::Secret("tok".into()));
        let mut s = Service::start(c).await;
        let addr = s.app.addr;
        let k1 = enqueue(&mut s.client, event("orders", "k1", b"a")).await;
        let k1b = enqueue(&mut s.client, event("orders", "k1", b"b")).await;
        let k2 = enqueue(&mut s.client, event("orders", "k2", b"c")).await;
        let long_error = format!("broker said: {}", "x".repeat(200));
        mark(
            &url,
            k1,
            Mark::Blocked {
                attempts: 2,
                error: &long_error,
            },
        )
        .await;
        mark(&url, k2, Mark::Failed("rejected by broker")).await;

        // Without the token: refused, non-zero exit.
        let (ok, _, err) = admin_cli(addr, None, &["stats"]).await;
        assert!(!ok);
        assert!(err.contains("mailroom admin: UNAUTHENTICATED: "), "{err}");
        // Exit statuses say what failed (docs/admin.md), with the connection options
        // after the command (they are global).
        let (code, err) = admin_cli_code(addr, None, &["stats", "--json"]).await;
        assert_eq!(code, Some(4), "refused: {err}");
        let (code, err) = admin_cli_code(addr, Some("tok"), &["get", "999999999"]).await;
        assert_eq!(code, Some(3), "not found: {err}");
        assert!(err.contains("NOT_FOUND: "), "{err}");
        let (code, err) = admin_cli_code(
            addr,
            Some("tok"),
            &["pending", "--page-token", "not-a-token"],
        )
        .await;
        assert_eq!(code, Some(6), "rejected: {err}");
        assert!(err.contains("INVALID_ARGUMENT: "), "{err}");
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let (code, err) = admin_cli_code(closed, Some("tok"), &["stats"]).await;
        assert_eq!(code, Some(5), "unreachable: {err}");
        // Each cause once (the transport's chain repeats "tcp connect error").
        let causes: Vec<&str> = err.trim().split(": ").collect();
        let mut unique = causes.clone();
        unique.dedup();
        assert_eq!(causes, unique, "{err}");
        assert!(err.contains("tcp connect error"), "{err}");
        let (code, err) = admin_cli_code(addr, Some("tok"), &["stats", "--no-such-flag"]).await;
        assert_eq!(code, Some(2), "usage: {err}");

        // pending
        let out = cli_ok(addr, &["pending"]).await;
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("TOPIC"), "{out}");
        assert!(lines[0].contains("BLOCKED"));
        assert!(
            lines[1].contains("orders") && lines[1].contains("k1") && lines[1].contains("yes"),
            "{out}"
        );
        assert!(lines[1].contains('…'), "long errors are truncated: {out}");
        assert!(!out.contains(&"x".repeat(100)));
        assert!(
            out.contains("total: 2 pending in 1 key(s), 1 blocked"),
            "{out}"
        );
        let j = cli_json(addr, &["pending"]).await;
        assert_eq!(j["keys"][0]["key"], "k1");
        assert_eq!(j["keys"][0]["pending"], 2);
        assert_eq!(j["keys"][0]["blocked"], true);
        assert_eq!(j["keys"][0]["head_id"], k1);
        assert_eq!(j["keys"][0]["head_last_error"], long_error.as_str());
        assert_eq!(j["total_blocked_keys"], 1);

        // failed
        let out = cli_ok(addr, &["failed"]).await;
        assert!(out.starts_with("ID"), "{out}");
        assert!(
            out.contains(&k2.to_string()) && out.contains("rejected by broker"),
            "{out}"
        );
        let j = cli_json(addr, &["failed", "--topic", "orders"]).await;
        assert_eq!(j["events"].as_array().unwrap().len(), 1);
        assert_eq!(j["events"][0]["id"], k2);
        assert_eq!(j["events"][0]["status"], "failed");

        // get
        let out = cli_ok(addr, &["get", &k1b.to_string(), "--payload"]).await;
        assert!(out.contains("status          pending"), "{out}");
        assert!(out.contains("payload         b"), "{out}");
        let j = cli_json(addr, &["get", &k1b.to_string()]).await;
        assert_eq!(j["id"], k1b);
        assert_eq!(j["payload_size"], 1);
        let (ok, _, err) = admin_cli(addr, Some("tok"), &["get", "99999"]).await;
        assert!(!ok && err.contains("NOT_FOUND: "), "{err}");

        // requeue: dry run unless --yes
        let out = cli_ok(addr, &["requeue", "--topic", "orders"]).await;
        assert!(
            out.contains("dry run: would requeue 1 failed event(s)"),
            "{out}"
        );
        assert!(out.contains("--yes"));
        let j = cli_json(addr, &["requeue", &k2.to_string()]).await;
        assert_eq!(
            (j["dry_run"].as_bool(), j["count"].as_i64()),
            (Some(true), Some(1))
        );
        assert_eq!(
            s.stored(BoxKind::Outbox, k2).await.status.as_str(),
            "failed"
        );
        let out = cli_ok(
            addr,
            &[
                "requeue",
                &k2.to_string(),
                "--yes",
                "--operator",
                "carol",
                "--request-id",
                "req-cli-1",
            ],
        )
        .await;
        assert!(out.starts_with("requeued 1 event(s)"), "{out}");
        assert!(!out.contains("already done"), "{out}");
        // The same request id again: answered from the first outcome, and said so.
        let again = cli_json(
            addr,
            &[
                "requeue",
                &k2.to_string(),
                "--yes",
                "--request-id",
                "req-cli-1",
            ],
        )
        .await;
        assert_eq!(again["replayed"], true, "{again}");
        let out = cli_ok(
            addr,
            &[
                "requeue",
                &k2.to_string(),
                "--yes",
                "--request-id",
                "req-cli-1",
            ],
        )
        .await;
        assert!(out.contains("already done under this request id"), "{out}");
        assert_eq!(
            s.stored(BoxKind::Outbox, k2).await.status.as_str(),
            "pending"
        );

        // cancel: dry run unless --yes
        let out = cli_ok(addr, &["cancel", &k1.to_string(), "--reason", "poison"]).await;
        assert!(
            out.contains("dry run: would cancel 1 pending event(s)"),
            "{out}"
        );
        let j = cli_json(
            addr,
            &["cancel", &k1.to_string(), "--reason", "poison", "--yes"],
        )
        .await;
        assert_eq!(
            (j["dry_run"].as_bool(), j["count"].as_i64()),
            (Some(false), Some(1))
        );
        assert!(j["audit_id"].as_i64().unwrap() > 0);
        let e = s.stored(BoxKind::Outbox, k1).await;
        assert_eq!(e.last_error.as_deref(), Some("cancelled: poison"));

        // stats
        let out = cli_ok(addr, &["stats"]).await;
        assert!(out.starts_with("TOPIC"), "{out}");
        assert!(out.contains("blocked keys: 0"), "{out}");
        let j = cli_json(addr, &["stats"]).await;
        assert_eq!(
            (j["pending"].as_i64(), j["failed"].as_i64()),
            (Some(2), Some(1))
        );
        assert_eq!(j["topics"][0]["topic"], "orders");

        // audit
        let out = cli_ok(addr, &["audit"]).await;
        assert!(out.starts_with("ID"), "{out}");
        assert!(
            out.contains("carol (token)") && out.contains("requeue") && out.contains("cancel"),
            "{out}"
        );
        let j = cli_json(addr, &["audit"]).await;
        assert_eq!(j["entries"][0]["action"], "cancel");
        assert_eq!(j["entries"][1]["action"], "requeue");
        assert_eq!(j["entries"][1]["selection"]["ids"][0], k2);
        s.app.stop().await.unwrap();
    }
}

/// Issue 43, item 5: text another operator (pause reasons, operator names) or the server
/// (status messages, page tokens) wrote reaches the terminal escaped in every command's
/// output, tables, sentences, JSON and errors alike: ESC, BEL, CR, the 8-bit CSI (U+009B)
/// and bidi overrides are shown as escapes, never written.
#[tokio::test]
async fn the_cli_never_writes_control_characters_to_the_terminal() {
    const HOSTILE: &str = "x\u{1b}]0;pwned\u{7}\r\u{9b}2J\u{7f}\u{202e}txt";
    let raw = |s: &str| {
        s.chars().find(|c| {
            matches!(
                c,
                '\u{1b}' | '\u{7}' | '\r' | '\u{9b}' | '\u{7f}' | '\u{202e}'
            )
        })
    };
    let (url, _dir) = fresh_sqlite();
    let s = Service::start(quiet_config(&url)).await;
    let addr = s.app.addr;
    let mut a = admin(addr).await;
    a.pause_topic(pb::PauseTopicRequest {
        topic: "held".into(),
        reason: HOSTILE.into(),
        operator: HOSTILE.into(),
    })
    .await
    .unwrap();
    let mut written = Vec::new();
    for args in [
        &["pause", "held", "--reason", "again"][..],
        &["paused"],
        &["pending"],
        &["--json", "paused"],
        &["--json", "pending"],
        &["resume", "held"],
    ] {
        let (ok, out, err) = admin_cli(addr, None, args).await;
        assert!(ok, "{args:?}: {err}");
        assert!(out.contains("pwned"), "{args:?} shows the text:\n{out}");
        if let Some(c) = raw(&out) {
            written.push(format!("{args:?} wrote {c:?}:\n{out:?}"));
        }
    }
    s.app.stop().await.unwrap();

    // A server (or anything on the way) answering with a hostile status message.
    let port = free_port();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(HostileAdmin)
            .serve(format!("127.0.0.1:{port}").parse().unwrap()),
    );
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let err = loop {
        let (ok, _, err) = admin_cli(addr, None, &["stats"]).await;
        assert!(!ok);
        if err.contains("pwned") || std::time::Instant::now() > deadline {
            break err;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(err.contains("NOT_FOUND") && err.contains("pwned"), "{err}");
    if let Some(c) = raw(&err) {
        written.push(format!("the error wrote {c:?}:\n{err:?}"));
    }
    server.abort();
    assert!(written.is_empty(), "{}", written.join("\n"));
}

/// An AdminService that answers every call NOT_FOUND with a hostile message.
#[derive(Clone)]
struct HostileAdmin;

impl tonic::server::NamedService for HostileAdmin {
    const NAME: &'static str = "mailroom.v1.AdminService";
}

impl tower::Service<http::Request<tonic::body::Body>> for HostileAdmin {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
        std::future::ready(Ok(tonic::Status::not_found(
            "gone\u{1b}]0;pwned\u{7}\u{9b}2J\u{202e}",
        )
        .into_http()))
    }
}

/// `ListEvents` for pending events pages through them exactly when they lie under a
/// published history (issue 46: on PostgreSQL they are read from the keys with a
/// backlog, no longer by walking every newer event): a paused topic's keyed and unkeyed
/// events stay pending while another topic's events are published after them; pages of
/// 7, with and without a type or key filter, return exactly the pending events, newest
/// first, on both engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_events_are_listed_exactly_under_a_published_history() {
    let url = fresh_pg().await;
    pending_listing_under_history(&url).await;
    let (url, _dir) = fresh_sqlite();
    pending_listing_under_history(&url).await;
}

async fn pending_listing_under_history(url: &str) {
    let s = Service::start(config(url)).await;
    let mut a = admin(s.app.addr).await;
    a.pause_topic(pb::PauseTopicRequest {
        topic: "stuck".into(),
        reason: "test".into(),
        operator: "test".into(),
    })
    .await
    .unwrap();
    let mut client = s.client.clone();
    // (id, key, type) of the stuck events.
    let mut stuck: Vec<(i64, String, String)> = Vec::new();
    let mut flow = 0;
    for i in 0..60 {
        let key = if i % 10 == 9 {
            String::new()
        } else {
            format!("s{}", i % 3)
        };
        let ty = if i % 2 == 0 { "a" } else { "b" };
        let mut e = event("stuck", &key, format!("stuck-{i}").as_bytes());
        e.r#type = ty.into();
        stuck.push((enqueue(&mut client, e).await, key, ty.into()));
        for j in 0..3 {
            enqueue(&mut client, event("flow", &format!("f{j}"), b"flow")).await;
            flow += 1;
        }
    }
    wait_completed(&s.app.store, flow, Duration::from_secs(30)).await;
    let list = |filter: pb::EventFilter, token: String| pb::ListEventsRequest {
        status: pb::EventStatus::Pending as i32,
        filter: Some(filter),
        page_size: 7,
        page_token: token,
        ..Default::default()
    };
    type Wanted = Box<dyn Fn(&(i64, String, String)) -> bool>;
    let cases: Vec<(pb::EventFilter, Wanted)> = vec![
        (pb::EventFilter::default(), Box::new(|_| true)),
        (
            pb::EventFilter {
                r#type: "a".into(),
                ..Default::default()
            },
            Box::new(|e| e.2 == "a"),
        ),
        (
            pb::EventFilter {
                key: "s1".into(),
                ..Default::default()
            },
            Box::new(|e| e.1 == "s1"),
        ),
        (
            pb::EventFilter {
                topic: "flow".into(),
                ..Default::default()
            },
            Box::new(|_| false),
        ),
    ];
    for (filter, wanted) in cases {
        let expected: Vec<i64> = stuck
            .iter()
            .rev()
            .filter(|e| wanted(e))
            .map(|e| e.0)
            .collect();
        let mut got = Vec::new();
        let mut token = String::new();
        loop {
            let page = a
                .list_events(list(filter.clone(), token))
                .await
                .unwrap()
                .into_inner();
            assert!(page.events.len() <= 7);
            assert!(
                page.events
                    .iter()
                    .all(|e| e.status == pb::EventStatus::Pending as i32 && e.topic == "stuck")
            );
            got.extend(page.events.iter().map(|e| e.id));
            if page.next_page_token.is_empty() {
                break;
            }
            token = page.next_page_token;
        }
        assert_eq!(got, expected, "{url}: pending events with {filter:?}");
    }
    s.app.stop().await.unwrap();
}

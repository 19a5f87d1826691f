//! Dead-letter topics (issue 44, item 3): failed outbox events and failed inbox messages
//! are copied to their dead-letter topic, against PostgreSQL and the broker (the failures
//! injected by a protocol proxy and a handler that refuses), and on both engines.

use std::collections::HashMap;
use std::time::Duration;

use crate::support::kafka_proxy::{INVALID_RECORD, KafkaProxy};
use crate::support::*;
use mailroom::dead_letter::{TopicChoice, headers};
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::relay::backoff::RetryPolicy;
use mailroom::sink::SinkConfig;

/// Against PostgreSQL and the broker: a protocol proxy refuses every record of one topic
/// (`INVALID_RECORD`, which spends attempts); its 3 events end `failed` after their 3
/// attempts and the broker receives on `<topic>.dlq` one copy of each, in key order,
/// with the original's payload, key and headers plus the dead-letter headers (original
/// id, topic, key, attempts, last error); the originals stay `failed`. One of them,
/// requeued, fails again and is copied again (a second failure, a second copy). A
/// subscription whose handler refuses a message copies it to the subscription's
/// dead-letter topic. A topic without a dead-letter topic gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_events_and_messages_reach_their_dead_letter_topics() {
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    let refused = "dl.orders";
    for p in 0..16 {
        proxy.refuse_produce(refused, p, INVALID_RECORD);
    }
    let handler =
        crate::support::handler::Recorder::<crate::support::handler::RejectAll>::default();
    let handler_url = handler.serve().await;
    let db = fresh_pg().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &proxy.addr(), Duration::from_secs(5));
    c.relay.retry = RetryPolicy {
        base: Duration::from_millis(100),
        cap: Duration::from_millis(300),
        max_attempts: 3,
    };
    c.dead_letter.topics = TopicChoice::Some([refused.to_string()].into());
    let mut sub = crate::support::subscription("billing", &[], &handler_url);
    sub.dead_letter_topic = Some("dl.billing.failed".into());
    sub.retry.max_attempts = 1;
    c.dead_letter
        .subscriptions
        .insert("billing".into(), "dl.billing.failed".into());
    c.subscriptions = vec![sub];
    let mut s = Service::start(c).await;

    let mut ids = Vec::new();
    for (i, key) in ["a", "a", "b"].iter().enumerate() {
        let mut e = event(refused, key, format!("m{i}").as_bytes());
        e.headers.insert("trace".into(), format!("t{i}"));
        e.r#type = "order.placed".into();
        e.max_attempts = 3;
        ids.push(enqueue(&mut s.client, e).await);
    }
    let fine = enqueue(&mut s.client, event("dl.fine", "a", b"ok")).await;
    let mut ic = inbox_client(&s).await;
    let msg = receive(&mut ic, "billing", "inv-1", "c", "invoice")
        .await
        .id;

    eventually(
        Duration::from_secs(60),
        "the refused topic's events failed",
        || {
            let s = &s;
            let ids = ids.clone();
            async move {
                for id in ids {
                    if s.stored(BoxKind::Outbox, id).await.status != Status::Failed {
                        return false;
                    }
                }
                true
            }
        },
    )
    .await;
    assert!(
        proxy.refusals() >= 3,
        "the fault fired: {}",
        proxy.refusals()
    );
    for id in &ids {
        let e = s.stored(BoxKind::Outbox, *id).await;
        assert_eq!((e.status, e.attempts), (Status::Failed, 3), "event {id}");
    }

    // The copies are published before the topic is read (a consumer subscribed to a
    // topic that does not exist yet finds it only at its next metadata refresh).
    let published = |topic: &'static str, n: i64| {
        let db = db.clone();
        move || {
            let db = db.clone();
            async move {
                let sql = format!(
                    "SELECT count(*) FROM outbox_events_view WHERE topic = '{topic}' AND status = 'completed'"
                );
                count_rows(&db, &sql).await == n
            }
        }
    };
    eventually(
        Duration::from_secs(30),
        "the copies published",
        published("dl.orders.dlq", 3),
    )
    .await;
    let dlq = consume(&broker.addr(), "dl.orders.dlq", 3, Duration::from_secs(30));
    let (per_key, dups) = first_deliveries(&dlq);
    assert_eq!(dups, 0);
    assert_eq!(per_key.values().map(Vec::len).sum::<usize>(), 3, "{dlq:?}");
    let by_original: HashMap<i64, &Record> = dlq
        .iter()
        .map(|r| (r.headers[headers::ORIGINAL_ID].parse().unwrap(), r))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        let r = by_original
            .get(id)
            .unwrap_or_else(|| panic!("no dead letter of {id}"));
        assert_eq!(r.payload, format!("m{i}").as_bytes());
        assert_eq!(r.key, ["a", "a", "b"][i]);
        assert_eq!(r.headers["trace"], format!("t{i}"));
        assert_eq!(r.headers["ce_type"], "order.placed");
        assert_eq!(r.headers[headers::ORIGINAL_TOPIC], refused);
        assert_eq!(r.headers[headers::ORIGINAL_KEY], ["a", "a", "b"][i]);
        assert_eq!(r.headers[headers::ATTEMPTS], "3");
        assert_eq!(r.headers[headers::BOX], "outbox");
        assert!(!r.headers[headers::LAST_ERROR].is_empty());
    }
    // Key a's copies in its originals' order.
    let a: Vec<i64> = dlq
        .iter()
        .filter(|r| r.key == "a")
        .map(|r| r.headers[headers::ORIGINAL_ID].parse().unwrap())
        .collect();
    assert_eq!(a, ids[..2]);
    for id in &ids {
        assert_eq!(s.stored(BoxKind::Outbox, *id).await.status, Status::Failed);
    }

    // Requeued, it fails again: a second failure, a second copy.
    let mut admin = AdminServiceClient::new(channel(s.app.addr).await);
    admin
        .requeue_failed(pb::RequeueFailedRequest {
            ids: vec![ids[2]],
            ..Default::default()
        })
        .await
        .unwrap();
    let dlq = consume(&broker.addr(), "dl.orders.dlq", 4, Duration::from_secs(60));
    let copies_of_b = dlq
        .iter()
        .filter(|r| r.headers[headers::ORIGINAL_ID] == ids[2].to_string())
        .map(|r| r.headers["ce_id"].clone())
        .collect::<std::collections::HashSet<_>>();
    assert_eq!(copies_of_b.len(), 2, "two failures, two copies: {dlq:?}");

    // The inbox: the refused message, on the subscription's dead-letter topic.
    eventually(
        Duration::from_secs(30),
        "the inbox copy published",
        published("dl.billing.failed", 1),
    )
    .await;
    let failed = consume(
        &broker.addr(),
        "dl.billing.failed",
        1,
        Duration::from_secs(30),
    );
    assert_eq!(failed.len(), 1, "{failed:?}");
    let r = &failed[0];
    assert_eq!(r.payload, b"invoice");
    assert_eq!(r.key, "c");
    assert_eq!(r.headers[headers::BOX], "inbox");
    assert_eq!(r.headers[headers::SUBSCRIPTION], "billing");
    assert_eq!(r.headers[headers::ORIGINAL_ID], msg.to_string());
    assert_eq!(r.headers[headers::MESSAGE_ID], "rpc:inv-1");
    assert!(
        r.headers[headers::LAST_ERROR].contains("refused by the handler"),
        "{r:?}"
    );
    assert_eq!(s.stored(BoxKind::Inbox, msg).await.status, Status::Failed);

    // The topic without one published normally, and no dead-letter topic of its own.
    assert_eq!(
        s.stored(BoxKind::Outbox, fine).await.status,
        Status::Completed
    );
    assert_eq!(
        count_rows(
            &db,
            "SELECT count(*) FROM outbox_events WHERE topic LIKE 'dl.fine%' AND topic <> 'dl.fine'"
        )
        .await,
        0,
        "no dead letters for a topic without a dead-letter topic"
    );
    s.app.stop().await.unwrap();
}

/// On both engines, with a local sink: events cancelled while their topic is paused
/// (a cancel is a failure too) are copied to `<topic>.dlq` once each, the failure log is
/// emptied, and a topic that has no dead-letter topic leaves none behind.
#[tokio::test]
async fn cancelled_events_are_dead_lettered_on_both_engines() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let out = tempfile::tempdir().unwrap();
        let sink = out.path().join("sink.jsonl");
        let mut c = config(&url);
        c.relays = 1;
        c.sink = SinkConfig::Local {
            path: Some(sink.clone()),
        };
        c.dead_letter.topics = TopicChoice::Some(["dl.t".to_string()].into());
        let mut s = Service::start(c).await;
        let mut a = AdminServiceClient::new(channel(s.app.addr).await);
        for t in ["dl.t", "dl.other"] {
            a.pause_topic(pb::PauseTopicRequest {
                topic: t.into(),
                reason: "hold".into(),
                operator: String::new(),
            })
            .await
            .unwrap();
        }
        let mut ids = Vec::new();
        for i in 0..3 {
            ids.push(enqueue(&mut s.client, event("dl.t", "k", format!("{i}").as_bytes())).await);
        }
        let other = enqueue(&mut s.client, event("dl.other", "k", b"o")).await;
        let mut cancel = ids.clone();
        cancel.push(other);
        a.cancel_events(pb::CancelEventsRequest {
            ids: cancel,
            reason: "bad batch".into(),
            ..Default::default()
        })
        .await
        .unwrap();
        eventually(Duration::from_secs(20), "the copies published", || {
            let sink = sink.clone();
            async move {
                std::fs::read_to_string(&sink)
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.contains("\"dl.t.dlq\""))
                    .count()
                    == 3
            }
        })
        .await;
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&sink)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let originals: Vec<i64> = lines
            .iter()
            .filter(|v| v["topic"] == "dl.t.dlq")
            .map(|v| {
                v["headers"][headers::ORIGINAL_ID]
                    .as_str()
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        assert_eq!(originals, ids, "{engine:?}: once each, in key order");
        assert!(
            lines.iter().all(|v| v["topic"] != "dl.other.dlq"),
            "{engine:?}"
        );
        for v in lines.iter().filter(|v| v["topic"] == "dl.t.dlq") {
            assert!(
                v["headers"][headers::LAST_ERROR]
                    .as_str()
                    .unwrap()
                    .contains("bad batch"),
                "{engine:?}: {v}"
            );
        }
        // The failure log is emptied (the other topic's row too).
        eventually(Duration::from_secs(10), "the failure log emptied", || {
            let store = &s.app.store;
            async move { store.dead_letters(10).await.unwrap().is_empty() }
        })
        .await;
        for id in &ids {
            assert_eq!(s.stored(BoxKind::Outbox, *id).await.status, Status::Failed);
        }
        s.app.stop().await.unwrap();
    }
}

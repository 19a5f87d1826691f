//! Rewinding an inbox subscription to a time (issue 44, item 2), against the broker: the
//! consumer goes back to the first record at or after the time (looked up in the log
//! itself where the broker does not answer by time, as tansu does not), drops what it
//! reads again as duplicates unless the rewind redelivers, and never repeats itself.

use std::time::Duration;

use crate::support::handler::{Accept, Recorder, subscription};
use crate::support::*;
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use rdkafka::producer::FutureRecord;
use tonic::Code;

async fn metric(addr: std::net::SocketAddr, name: &str) -> f64 {
    let body = crate::support::probe::scrape(addr).await;
    body.lines()
        .filter(|l| l.starts_with(name) && l.contains("subscription=\"rw\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// 20 records on partition 0 of a topic, one second apart by their timestamps, over three keys, all
/// handled. A dry run of a rewind to the 11th record's time asks nothing; the rewind
/// itself (no redeliver) sends partition 0 back to offset 10 (its window 10..20 in
/// `ListRewinds`), the 10 records are read again and dropped as duplicates (the
/// duplicates counter rises by 10, the handler sees nothing); its request id again asks
/// nothing new. A redeliver rewind to the 16th record's time hands records 15..19 to the
/// handler again, in each key's order, once, under `rewind:<id>:…` with `mailroom-rewound-by`.
/// Bad requests name their field; an unknown subscription is `NOT_FOUND`; a read-only
/// caller could list but the audit log has both rewinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_rewound_to_a_time_reads_its_records_again() {
    let broker = Broker::start();
    let p = raw_producer(&broker.addr());
    let db = fresh_pg().await;
    let handler = Recorder::<Accept>::default();
    let url = handler.serve().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(3));
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let topic = "rw.topic";
    c.subscriptions = vec![subscription("rw", &[topic], &url)];
    let s = Service::start(c).await;
    let metrics = s.app.metrics_addr.unwrap();
    let t0 = chrono::Utc::now().timestamp_millis() - 100_000;
    for i in 0..20i64 {
        let payload = format!("r{i}");
        let key = format!("k{}", i % 3);
        p.send(
            FutureRecord::<str, str>::to(topic)
                .partition(0)
                .key(&key)
                .payload(&payload)
                .timestamp(t0 + i * 1000),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    }
    eventually(Duration::from_secs(60), "20 records handled", || {
        let h = &handler;
        async move { h.calls().len() == 20 }
    })
    .await;
    let mut a = AdminServiceClient::new(channel(s.app.addr).await);
    let at = |ms: i64| {
        Some(pb::time::to_timestamp(
            chrono::DateTime::from_timestamp_millis(ms).unwrap(),
        ))
    };
    let ask = pb::RewindSubscriptionRequest {
        subscription: "rw".into(),
        to_time: at(t0 + 10_000),
        operator: "ann".into(),
        request_id: "rw-1".into(),
        ..Default::default()
    };
    let dry = a
        .rewind_subscription(ask.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(
        dry.dry_run && dry.rewind.is_none() && dry.stored_since == 20,
        "{dry:?}"
    );
    for (bad, field) in [
        (
            pb::RewindSubscriptionRequest {
                to_time: None,
                ..ask.clone()
            },
            "to_time",
        ),
        (
            pb::RewindSubscriptionRequest {
                to_time: at(t0 + 10_000_000),
                ..ask.clone()
            },
            "to_time",
        ),
    ] {
        let e = a.rewind_subscription(bad).await.unwrap_err();
        assert_eq!(
            (e.code(), field_of(&e)),
            (Code::InvalidArgument, field.into())
        );
    }
    let unknown = a
        .rewind_subscription(pb::RewindSubscriptionRequest {
            subscription: "nope".into(),
            ..ask.clone()
        })
        .await;
    assert_eq!(code(unknown), Code::NotFound);
    let duplicates_before = metric(metrics, "mailroom_inbox_duplicates_total").await;

    let first = a
        .rewind_subscription(pb::RewindSubscriptionRequest {
            confirm: true,
            ..ask.clone()
        })
        .await
        .unwrap()
        .into_inner();
    let first_id = first.rewind.as_ref().unwrap().id;
    assert!(first.audit_id > 0 && !first.replayed, "{first:?}");
    let again = a
        .rewind_subscription(pb::RewindSubscriptionRequest {
            confirm: true,
            ..ask.clone()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(again.replayed && again.rewind.unwrap().id == first_id);
    let lister = a.clone();
    let window = |rewind: i64| {
        let mut a = lister.clone();
        async move {
            let r = a
                .list_rewinds(pb::ListRewindsRequest {
                    subscription: "rw".into(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            r.rewinds
                .into_iter()
                .find(|r| r.id == rewind)
                .and_then(|r| {
                    r.partitions
                        .into_iter()
                        .find(|p| p.partition == 0 && p.applied_at.is_some())
                })
                .map(|p| (p.from_offset, p.until_offset))
        }
    };
    eventually(Duration::from_secs(30), "partition 0 rewound", || async {
        window(first_id).await.is_some()
    })
    .await;
    assert_eq!(
        window(first_id).await,
        Some((10, 20)),
        "the first record at or after the time"
    );
    eventually(
        Duration::from_secs(30),
        "10 records read again as duplicates",
        || async {
            metric(metrics, "mailroom_inbox_duplicates_total").await - duplicates_before >= 10.0
        },
    )
    .await;
    assert_eq!(
        metric(metrics, "mailroom_inbox_operator_rewinds_total").await,
        1.0
    );
    assert_eq!(
        handler.calls().len(),
        20,
        "nothing handed over again without redeliver"
    );

    let second = a
        .rewind_subscription(pb::RewindSubscriptionRequest {
            to_time: at(t0 + 15_000),
            redeliver: true,
            confirm: true,
            request_id: "rw-2".into(),
            ..ask.clone()
        })
        .await
        .unwrap()
        .into_inner();
    let rid = second.rewind.unwrap().id;
    eventually(
        Duration::from_secs(30),
        "5 records handed over again",
        || {
            let h = &handler;
            async move { h.calls().len() == 25 }
        },
    )
    .await;
    assert_eq!(window(rid).await, Some((15, 20)));
    let again: Vec<(String, String, String)> = handler.calls()[20..]
        .iter()
        .map(|c| (c.key.clone(), c.message_id.clone(), c.payload.clone()))
        .collect();
    assert!(
        again
            .iter()
            .all(|(_, id, _)| id.starts_with(&format!("rewind:{rid}:"))),
        "{again:?}"
    );
    let mut payloads: Vec<&str> = again.iter().map(|(_, _, p)| p.as_str()).collect();
    payloads.sort_unstable();
    assert_eq!(payloads, ["r15", "r16", "r17", "r18", "r19"], "{again:?}");
    for key in ["k0", "k1", "k2"] {
        let of_key: Vec<u32> = again
            .iter()
            .filter(|(k, _, _)| k == key)
            .map(|(_, _, p)| p[1..].parse().unwrap())
            .collect();
        assert!(
            of_key.windows(2).all(|w| w[0] < w[1]),
            "per-key order: {again:?}"
        );
    }
    let tagged = a
        .list_events(pb::ListEventsRequest {
            r#box: pb::Box::Inbox as i32,
            filter: Some(pb::EventFilter {
                headers: [("mailroom-rewound-by".to_string(), rid.to_string())].into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(tagged.events.len(), 5);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(handler.calls().len(), 25, "each record redelivered once");
    // The CLI: a dry run, and the list with each rewind's window.
    use crate::support::cli::admin_cli_json;
    let to = chrono::DateTime::from_timestamp_millis(t0)
        .unwrap()
        .to_rfc3339();
    let dry = admin_cli_json(
        s.app.addr,
        None,
        &["--subscription", "rw", "rewind", "--to", &to],
    )
    .await;
    assert_eq!(
        (dry["dry_run"].as_bool(), dry["stored_since"].as_i64()),
        (Some(true), Some(25)),
        "{dry}"
    );
    let listed = admin_cli_json(s.app.addr, None, &["--subscription", "rw", "rewinds"]).await;
    let ids: Vec<i64> = listed["rewinds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [rid, first_id], "{listed}");
    let p0 = listed["rewinds"][0]["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["partition"] == 0)
        .cloned()
        .unwrap();
    assert_eq!(
        (p0["from_offset"].as_i64(), p0["until_offset"].as_i64()),
        (Some(15), Some(20)),
        "{listed}"
    );
    let audit = a
        .list_audit(pb::ListAuditRequest::default())
        .await
        .unwrap()
        .into_inner();
    let rewinds = audit
        .entries
        .iter()
        .filter(|e| e.action == "rewind")
        .count();
    assert_eq!(rewinds, 2);
    s.app.stop().await.unwrap();
}

/// The store's side on both engines: a rewind and its audit entry, a request id that
/// asks once, a partition's window recorded once (applying again keeps the first one)
/// and then marked applied, and the listing with its partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewind_rows_are_the_same_on_both_engines() {
    use mailroom::domain::admin::{ActionContext, RewindPartition, RewindRequest};
    for engine in ENGINES {
        let (s, _url, _guard) = quiet_on(&engine).await;
        let store = &s.app.store;
        let mut r = RewindRequest {
            subscription: "rw".into(),
            to_time: chrono::Utc::now() - chrono::Duration::minutes(5),
            redeliver: true,
            context: ActionContext {
                dry_run: true,
                request_id: Some("q-1".into()),
                ..ActionContext::by("ann")
            },
        };
        let dry = store.start_rewind(&r).await.unwrap();
        assert!(
            dry.rewind.is_none() && dry.audit_id.is_none(),
            "{engine:?}: {dry:?}"
        );
        r.context.dry_run = false;
        let first = store.start_rewind(&r).await.unwrap();
        let id = first.rewind.as_ref().unwrap().id;
        assert!(first.audit_id.is_some() && !first.replayed, "{engine:?}");
        let again = store.start_rewind(&r).await.unwrap();
        assert!(
            again.replayed && again.rewind.unwrap().id == id,
            "{engine:?}"
        );
        let window = RewindPartition {
            rewind_id: id,
            topic: "t".into(),
            partition: 3,
            from_offset: 10,
            until_offset: 20,
            applied_at: None,
        };
        assert_eq!(
            store.intend_rewind(&window).await.unwrap(),
            window,
            "{engine:?}"
        );
        let later = RewindPartition {
            from_offset: 12,
            until_offset: 30,
            ..window.clone()
        };
        assert_eq!(
            store.intend_rewind(&later).await.unwrap(),
            window,
            "{engine:?}: the first window stays"
        );
        store.rewind_applied(&window).await.unwrap();
        let listed = store.rewinds(Some("rw"), None, 10).await.unwrap();
        assert_eq!(listed.len(), 1, "{engine:?}");
        let p = &listed[0].partitions;
        assert_eq!(p.len(), 1, "{engine:?}");
        assert!(
            p[0].applied_at.is_some() && p[0].from_offset == 10 && p[0].partition == 3,
            "{engine:?}: {p:?}"
        );
        assert!(
            listed[0].redeliver && listed[0].actor == "ann",
            "{engine:?}"
        );
        assert!(
            store
                .rewinds(Some("other"), None, 10)
                .await
                .unwrap()
                .is_empty()
        );
        s.app.stop().await.unwrap();
    }
}

/// A partition whose leader never answers `ListOffsets` (a protocol proxy swallows every
/// one) cannot be rewound yet, but the subscription keeps consuming: records written
/// while the rewind waits are all handled, none later than a few seconds. Once the
/// broker answers again, the rewind applies (partition 0 back to its start) and, with
/// `redeliver`, every record of the window is handed over again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewind_the_broker_never_answers_holds_no_consumption_up() {
    use crate::support::kafka_proxy::KafkaProxy;
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    let p = raw_producer(&proxy.addr());
    let db = fresh_pg().await;
    let handler = Recorder::<Accept>::default();
    let url = handler.serve().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &proxy.addr(), Duration::from_secs(3));
    let topic = "rw.stalled";
    c.subscriptions = vec![subscription("rw", &[topic], &url)];
    let s = Service::start(c).await;
    let send = |i: i64| {
        let p = p.clone();
        async move {
            let payload = format!("r{i}");
            p.send(
                FutureRecord::<str, str>::to(topic)
                    .partition(0)
                    .key("k")
                    .payload(&payload),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        }
    };
    for i in 0..5 {
        send(i).await;
    }
    let handled = |n: usize| {
        let h = handler.clone();
        async move { h.calls().len() >= n }
    };
    eventually(Duration::from_secs(60), "5 records handled", || handled(5)).await;
    proxy.swallow_list_offsets(true);
    let mut a = AdminServiceClient::new(channel(s.app.addr).await);
    let rewind = a
        .rewind_subscription(pb::RewindSubscriptionRequest {
            subscription: "rw".into(),
            to_time: Some(pb::time::to_timestamp(
                chrono::Utc::now() - chrono::Duration::hours(1),
            )),
            redeliver: true,
            confirm: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .rewind
        .unwrap();
    // Ten records over about 10 s while every lookup hangs: each handled within 5 s.
    let mut slowest = Duration::ZERO;
    for i in 5..15 {
        let sent = std::time::Instant::now();
        send(i).await;
        eventually(
            Duration::from_secs(5),
            "a record handled while the rewind waits",
            || handled(i as usize + 1),
        )
        .await;
        slowest = slowest.max(sent.elapsed());
        tokio::time::sleep(Duration::from_millis(800)).await;
    }
    assert!(proxy.swallowed() > 0, "the lookups met the fault");
    let applied = |id: i64| {
        let mut a = a.clone();
        async move {
            a.list_rewinds(pb::ListRewindsRequest::default())
                .await
                .unwrap()
                .into_inner()
                .rewinds
                .into_iter()
                .find(|r| r.id == id)
                .and_then(|r| {
                    r.partitions
                        .into_iter()
                        .find(|p| p.partition == 0 && p.applied_at.is_some())
                })
        }
    };
    assert!(
        applied(rewind.id).await.is_none(),
        "not applied without an answer"
    );
    assert_eq!(handler.calls().len(), 15, "nothing redelivered yet");
    proxy.swallow_list_offsets(false);
    eventually(Duration::from_secs(60), "the rewind applied", || async {
        applied(rewind.id).await.is_some()
    })
    .await;
    let w = applied(rewind.id).await.unwrap();
    assert_eq!((w.from_offset, w.until_offset), (0, 15));
    eventually(
        Duration::from_secs(30),
        "15 records handed over again",
        || handled(30),
    )
    .await;
    let again: Vec<String> = handler.calls()[15..]
        .iter()
        .map(|c| c.payload.clone())
        .collect();
    let want: Vec<String> = (0..15).map(|i| format!("r{i}")).collect();
    assert_eq!(again, want, "one key: in offset order");
    eprintln!(
        "stalled rewind: {} ListOffsets swallowed; slowest record while waiting {slowest:?}",
        proxy.swallowed()
    );
    s.app.stop().await.unwrap();
}

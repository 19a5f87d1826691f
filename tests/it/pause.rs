//! Pausing and resuming publishing per topic (issue 28, item 1): through the admin RPCs,
//! the CLI and the console's form, on both engines, and against the real broker.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::support::probe::{sample_opt, scrape};
use crate::support::*;
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::sink::SinkConfig;
use tonic::Code;
use tonic::transport::Channel;

fn authed<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("authorization", "Bearer tok".parse().unwrap());
    r
}

async fn pause(
    a: &mut AdminServiceClient<Channel>,
    topic: &str,
    reason: &str,
) -> Result<pb::PauseTopicResponse, tonic::Status> {
    a.pause_topic(authed(pb::PauseTopicRequest {
        topic: topic.into(),
        reason: reason.into(),
        operator: "alice".into(),
    }))
    .await
    .map(|r| r.into_inner())
}

async fn resume(a: &mut AdminServiceClient<Channel>, topic: &str) -> pb::ResumeTopicResponse {
    a.resume_topic(authed(pb::ResumeTopicRequest {
        topic: topic.into(),
        operator: "bob".into(),
    }))
    .await
    .unwrap()
    .into_inner()
}

/// The ids a local sink file holds per topic, in the order they were written.
fn sink_ids(path: &std::path::Path) -> HashMap<String, Vec<i64>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out: HashMap<String, Vec<i64>> = HashMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json line");
        out.entry(v["topic"].as_str().unwrap().to_string())
            .or_default()
            .push(v["id"].as_i64().unwrap());
    }
    out
}

/// On both engines, a relay publishing to a file: a paused topic's events (keyed and
/// unkeyed) stay pending with no attempt spent while another topic's go out; the pause
/// shows in ListPending, GetStats, ListPausedTopics and the audit log; a second pause
/// and a resume of a topic not paused change nothing; bad requests are refused naming
/// the field; after the resume the events go out once each, in id order.
#[tokio::test]
async fn a_paused_topic_spends_no_attempt_and_resumes_in_order() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let out = tempfile::tempdir().unwrap();
        let sink = out.path().join("sink.jsonl");
        let mut c = config(&url);
        c.relays = 1;
        c.admin_token = Some(mailroom::secret::Secret("tok".into()));
        c.sink = SinkConfig::Local {
            path: Some(sink.clone()),
        };
        let mut s = Service::start(c).await;
        let mut a = AdminServiceClient::new(channel(s.app.addr).await);

        // Bad requests change nothing.
        let e = pause(&mut a, "held", " ").await.unwrap_err();
        assert_eq!(
            (e.code(), field_of(&e)),
            (Code::InvalidArgument, "reason".into())
        );
        let e = pause(&mut a, "bad topic!", "x").await.unwrap_err();
        assert_eq!(
            (e.code(), field_of(&e)),
            (Code::InvalidArgument, "topic".into())
        );
        let e = a
            .pause_topic(pb::PauseTopicRequest {
                topic: "held".into(),
                reason: "no token".into(),
                operator: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");

        let p = pause(&mut a, "held", "broker maintenance").await.unwrap();
        assert!(p.changed);
        assert!(p.audit_id > 0);
        let again = pause(&mut a, "held", "another reason").await.unwrap();
        assert!(!again.changed, "already paused");
        assert_eq!(again.pause.as_ref().unwrap().reason, "broker maintenance");
        assert_eq!(again.audit_id, 0);

        let mut held = Vec::new();
        for i in 0..4 {
            held.push(enqueue(&mut s.client, event("held", "k", format!("{i}").as_bytes())).await);
        }
        let mut unkeyed = event("held", "", b"u");
        unkeyed.key.clear();
        held.push(enqueue(&mut s.client, unkeyed).await);
        let mut open = Vec::new();
        for i in 0..3 {
            open.push(enqueue(&mut s.client, event("open", "k", format!("{i}").as_bytes())).await);
        }
        eventually(Duration::from_secs(10), "the open topic published", || {
            let sink = sink.clone();
            async move { sink_ids(&sink).get("open").map(Vec::len) == Some(3) }
        })
        .await;
        // Twenty poll intervals more: the relay cycles on without touching `held`.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            sink_ids(&sink).get("held"),
            None,
            "nothing of a paused topic"
        );
        for id in &held {
            let e = s.stored(BoxKind::Outbox, *id).await;
            assert_eq!((e.status, e.attempts), (Status::Pending, 0), "event {id}");
        }

        let page = a
            .list_pending(authed(pb::ListPendingRequest::default()))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(page.paused_topics.len(), 1);
        assert_eq!(page.paused_topics[0].topic, "held");
        assert_eq!(page.paused_topics[0].actor, "alice (token)");
        assert!(!page.keys.is_empty());
        assert!(
            page.keys.iter().all(|k| k.topic == "held" && k.paused),
            "{page:?}"
        );
        let stats = a
            .get_stats(authed(pb::GetStatsRequest::default()))
            .await
            .unwrap()
            .into_inner();
        let by_topic: HashMap<&str, bool> = stats
            .topics
            .iter()
            .map(|t| (t.topic.as_str(), t.paused))
            .collect();
        assert_eq!(by_topic, HashMap::from([("held", true), ("open", false)]));
        let listed = a
            .list_paused_topics(authed(pb::ListPausedTopicsRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(listed.topics.len(), 1);

        let r = resume(&mut a, "held").await;
        assert!(r.changed);
        assert_eq!(r.lifted.unwrap().reason, "broker maintenance");
        assert!(!resume(&mut a, "held").await.changed, "no longer paused");
        eventually(
            Duration::from_secs(10),
            "the resumed topic published",
            || {
                let sink = sink.clone();
                async move { sink_ids(&sink).get("held").map(Vec::len) == Some(5) }
            },
        )
        .await;
        let mut got = sink_ids(&sink)["held"].clone();
        let keyed: Vec<i64> = got
            .iter()
            .copied()
            .filter(|id| held[..4].contains(id))
            .collect();
        assert_eq!(keyed, held[..4], "the key's events in id order");
        got.sort();
        assert_eq!(got, held, "each once");

        let audit = a
            .list_audit(authed(pb::ListAuditRequest::default()))
            .await
            .unwrap()
            .into_inner();
        let actions: Vec<(&str, &str)> = audit
            .entries
            .iter()
            .map(|e| (e.action.as_str(), e.actor.as_str()))
            .collect();
        assert_eq!(
            actions,
            [("resume", "bob (token)"), ("pause", "alice (token)")],
            "one entry per change"
        );
        assert!(audit.entries[1].selection.contains("broker maintenance"));
        s.app.stop().await.unwrap();
    }
}

/// Against PostgreSQL and the broker: a paused topic's events are not produced (the
/// broker holds none of them when the resume comes; afterwards it holds each once, in
/// key order), no attempt is spent, the pause is a metric, and the CLI pauses, lists
/// and resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_gets_nothing_of_a_paused_topic_until_it_is_resumed() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(5));
    c.admin_token = Some(mailroom::secret::Secret("tok".into()));
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c.metrics_stats_interval = Duration::from_millis(100);
    let mut s = Service::start(c).await;
    let addr = s.app.addr;
    let maddr = s.app.metrics_addr.unwrap();

    let out = admin_cli_json(
        addr,
        Some("tok"),
        &[
            "pause",
            "pause.held",
            "--reason",
            "downstream incident",
            "--operator",
            "carol",
        ],
    )
    .await;
    assert_eq!(out["changed"], true, "{out}");
    assert_eq!(out["pause"]["reason"], "downstream incident");
    let listed = admin_cli_json(addr, Some("tok"), &["paused"]).await;
    assert_eq!(listed["topics"][0]["topic"], "pause.held", "{listed}");
    let table = admin_cli_ok(addr, Some("tok"), &["paused"]).await;
    assert!(
        table.contains("pause.held") && table.contains("downstream incident"),
        "{table}"
    );

    let mut held = Vec::new();
    for i in 0..6 {
        let key = format!("k{}", i % 2);
        held.push(
            enqueue(
                &mut s.client,
                event("pause.held", &key, format!("{i}").as_bytes()),
            )
            .await,
        );
    }
    for i in 0..3 {
        enqueue(
            &mut s.client,
            event("pause.open", "k", format!("{i}").as_bytes()),
        )
        .await;
    }
    wait_completed(&s.app.store, 3, Duration::from_secs(30)).await;
    let open = consume(&broker.addr(), "pause.open", 3, Duration::from_secs(30));
    assert_eq!(open.len(), 3, "the other topic flows");
    eventually(Duration::from_secs(10), "the paused gauge", || async {
        sample_opt(
            &scrape(maddr).await,
            "mailroom_outbox_topic_paused{topic=\"pause.held\"}",
        ) == Some(1.0)
    })
    .await;
    let waited = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for id in &held {
        let e = s.stored(BoxKind::Outbox, *id).await;
        assert_eq!((e.status, e.attempts), (Status::Pending, 0), "event {id}");
    }
    let pending = admin_cli_json(addr, Some("tok"), &["pending", "--topic", "pause.held"]).await;
    assert_eq!(
        pending["paused_topics"][0]["topic"], "pause.held",
        "{pending}"
    );
    assert!(
        pending["keys"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k["paused"] == true),
        "{pending}"
    );
    assert!(waited.elapsed() >= Duration::from_secs(2));

    let out = admin_cli_json(addr, Some("tok"), &["resume", "pause.held"]).await;
    assert_eq!(out["changed"], true, "{out}");
    // Published first, so that the topic exists when the reader subscribes (a consumer
    // subscribed to a topic not created yet may not see it for minutes).
    wait_completed(&s.app.store, 9, Duration::from_secs(30)).await;
    let recs = consume(&broker.addr(), "pause.held", 6, Duration::from_secs(30));
    let (per_key, dups) = first_deliveries(&recs);
    assert_eq!(
        dups, 0,
        "nothing was produced before the resume, nothing twice"
    );
    assert_eq!(per_key["k0"], [held[0], held[2], held[4]]);
    assert_eq!(per_key["k1"], [held[1], held[3], held[5]]);
    eventually(Duration::from_secs(10), "the paused gauge gone", || async {
        sample_opt(
            &scrape(maddr).await,
            "mailroom_outbox_topic_paused{topic=\"pause.held\"}",
        )
        .is_none()
    })
    .await;
    let text = admin_cli_ok(addr, Some("tok"), &["resume", "pause.held"]).await;
    assert!(text.contains("was not paused"), "{text}");
    s.app.stop().await.unwrap();
}

/// Kafka's `NOT_ENOUGH_REPLICAS`: librdkafka retries it for as long as it holds the
/// record (here: forever, `message.timeout.ms=0`), and nothing is appended.
const NOT_ENOUGH_REPLICAS: i16 = 19;

/// Issue 43, item 3: a pause purges what the Kafka producer still holds of its topic.
/// Through the running service (its relays, the real sink, a 2 s delivery deadline) and
/// the protocol proxy over tansu: every partition of `purge.held` answers
/// `NOT_ENOUGH_REPLICAS`, so its records stay in the producer past the deadline
/// (reported transient, retried by librdkafka). The topic is paused, then the
/// partitions answer again: the broker (asked directly) holds none of its records until
/// the resume, while `purge.open` keeps being published. After `ResumeTopic` every
/// event reaches the broker, in key order, with no attempt spent. (Before the purge, the
/// producer wrote the held records as soon as the partitions answered, paused or not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_purges_what_the_producer_still_holds_of_its_topic() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::partitions::{PARTITIONS, create_topics};
    use crate::support::kafka_proxy::{KafkaProxy, latest_offsets};
    use mailroom::sink::kafka::{KafkaSink, producer_config};

    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    create_topics(&proxy.addr(), &["purge.held", "purge.open"]).await;
    for p in 0..PARTITIONS {
        proxy.refuse_produce("purge.held", p, NOT_ENOUGH_REPLICAS);
    }
    let url = fresh_pg().await;
    let mut c = config(&url);
    let deadline = Duration::from_secs(2);
    kafka_sink_config(&mut c, &proxy.addr(), deadline);
    c.admin_token = Some(mailroom::secret::Secret("tok".into()));
    let sink = Arc::new(
        KafkaSink::new(
            producer_config(&proxy.addr(), deadline, &Default::default()),
            "mailroom-test".into(),
            deadline,
        )
        .unwrap(),
    );
    let mut s = Service::start_with_sink(c, sink.clone()).await;
    let mut a = AdminServiceClient::new(channel(s.app.addr).await);

    // Another topic keeps flowing throughout: an event every 100 ms.
    let trickling = Arc::new(AtomicBool::new(true));
    let trickle = {
        let (mut client, on) = (s.client.clone(), trickling.clone());
        tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut i = 0;
            while on.load(Ordering::Relaxed) {
                let key = format!("o{}", i % 5);
                ids.push(
                    enqueue(
                        &mut client,
                        event("purge.open", &key, format!("{i}").as_bytes()),
                    )
                    .await,
                );
                i += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            ids
        })
    };

    let keys = ["h0", "h1", "h2", "h3"];
    let events = (0..20)
        .map(|i| event("purge.held", keys[i % 4], format!("{i}").as_bytes()))
        .collect();
    let held: Vec<i64> = s
        .client
        .enqueue_batch(pb::EnqueueBatchRequest { events })
        .await
        .unwrap()
        .into_inner()
        .results
        .iter()
        .map(|r| r.id)
        .collect();
    // Past the deadline: reported transient (the relay counts them), still in the
    // producer, retried there.
    eventually(
        Duration::from_secs(60),
        "the held topic's records past the deadline",
        || async {
            let transient: u64 = s
                .app
                .relay_stats
                .iter()
                .map(|r| r.transient.load(Ordering::Relaxed))
                .sum();
            transient > 0 && proxy.refusals() > 0 && sink.queued() >= held.len() as i32
        },
    )
    .await;
    for id in &held {
        let e = s.stored(BoxKind::Outbox, *id).await;
        assert_eq!((e.status, e.attempts), (Status::Pending, 0), "event {id}");
    }

    let out = pause(&mut a, "purge.held", "purge test").await.unwrap();
    assert!(out.changed);
    eventually(
        Duration::from_secs(10),
        "the sink read the pause",
        || async { sink.knows_paused("purge.held") && sink.pause_purges() > 0 },
    )
    .await;
    // The partitions answer again.
    proxy.accept_produce();
    let refusals = proxy.refusals();
    let answered = Instant::now();
    let open_done = "SELECT count(*) FROM public.outbox_events_view WHERE topic = 'purge.open' AND status = 'completed'";
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let open_before = count(open_done).await;
    // The other topic goes on (20 more events published) and librdkafka has had time
    // for several retries (its backoff is 1 s at most) of anything it still held.
    eventually(Duration::from_secs(60), "the other topic flows", || async {
        count(open_done).await >= open_before + 20 && answered.elapsed() >= Duration::from_secs(3)
    })
    .await;
    let written = latest_offsets(&broker.addr(), "purge.held", PARTITIONS).await;
    let open_written = latest_offsets(&broker.addr(), "purge.open", PARTITIONS).await;
    eprintln!(
        "pause purge: {} pause purge(s), {refusals} refused batches, held topic's records \
         on the broker while paused: {written:?}, other topic's: {open_written:?}",
        sink.pause_purges()
    );
    assert!(refusals > 0, "the proxy held the partitions");
    assert!(
        open_written.iter().sum::<i64>() > 0,
        "the other topic flowed"
    );
    assert_eq!(
        written.iter().sum::<i64>(),
        0,
        "records of the paused topic written while it was paused: {written:?}"
    );
    assert_eq!(sink.pause_purges(), 1, "one purge for the one pause");
    for id in &held {
        let e = s.stored(BoxKind::Outbox, *id).await;
        assert_eq!((e.status, e.attempts), (Status::Pending, 0), "event {id}");
    }

    resume(&mut a, "purge.held").await;
    eventually(
        Duration::from_secs(60),
        "the held topic published",
        || async {
            let mut done = true;
            for id in &held {
                done &= s.stored(BoxKind::Outbox, *id).await.status == Status::Completed;
            }
            done
        },
    )
    .await;
    trickling.store(false, Ordering::Relaxed);
    let open = trickle.await.unwrap();
    eventually(
        Duration::from_secs(60),
        "the other topic published",
        || async { count(open_done).await == open.len() as i64 },
    )
    .await;
    let spent = count(
        "SELECT count(*) FROM public.outbox_events_view WHERE attempts > 0 OR status <> 'completed'",
    )
    .await;
    assert_eq!(spent, 0, "no attempt spent, everything published");
    let recs = consume(
        &broker.addr(),
        "purge.held",
        held.len(),
        Duration::from_secs(30),
    );
    let (per_key, dups) = first_deliveries(&recs);
    eprintln!(
        "after the resume: {} records of the held topic, {dups} duplicates",
        recs.len()
    );
    for (k, key) in keys.iter().enumerate() {
        let want: Vec<i64> = held.iter().copied().skip(k).step_by(4).collect();
        assert_eq!(per_key[*key], want, "key {key}: each event, in order");
    }
    assert_eq!(
        consume(
            &broker.addr(),
            "purge.open",
            open.len(),
            Duration::from_secs(30)
        )
        .len(),
        open.len()
    );
    s.app.stop().await.unwrap();
}

//! Inbox identities that hold beyond one log (issue 23, item 2): records without `ce_id`
//! are still told apart after their topic is deleted and recreated or their cluster is
//! replaced (offsets start at 0 again), and rows stored under the older place-only
//! identity still drop redeliveries; structured-mode CloudEvents are identified by
//! their `source` and `id`.
//!
//! A log replaced under a running subscription (issue 43, item 4) is noticed and read
//! again from its start: a topic recreated (a new topic id) even when its new log
//! already reached the consumer's old position, and a position past the log end.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mailroom::config::Config;
use mailroom::domain::InboundMessage;
use mailroom::inbox::identity;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::support::kafka_proxy::KafkaProxy;
use crate::support::probe::{sample, scrape};
use crate::support::*;

/// A subscriber that handles everything.
type Handler = Recorder<Accept>;

fn admin(brokers: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap()
}

async fn create_topic(brokers: &str, topic: &str) {
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    for r in admin(brokers)
        .create_topics([&new], &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
}

async fn delete_topic(brokers: &str, topic: &str) {
    for r in admin(brokers)
        .delete_topics(&[topic], &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
}

/// Writes `payloads` to partition 0 of `topic` without headers (so without `ce_id`), in
/// order; returns their offsets.
async fn produce(p: &FutureProducer, topic: &str, payloads: &[String]) -> Vec<i64> {
    let mut offsets = Vec::new();
    for v in payloads {
        let r = FutureRecord::<str, str>::to(topic)
            .partition(0)
            .key("k")
            .payload(v)
            .headers(OwnedHeaders::new());
        offsets.push(p.send(r, Duration::from_secs(10)).await.unwrap().offset);
    }
    offsets
}

fn named(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Polls `f` until it holds or `timeout` passes; whether it held.
async fn within<F: FnMut() -> bool>(timeout: Duration, mut f: F) -> bool {
    let deadline = Instant::now() + timeout;
    while !f() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

/// Runs the service until it has read `read` records from Kafka and then until the
/// handler has seen each of `payloads` (or 15 s more have passed), and stops it; the
/// payloads handled so far and the records dropped as duplicates.
async fn run(
    c: &Config,
    handler: &Handler,
    read: u64,
    payloads: &BTreeSet<String>,
) -> (BTreeSet<String>, u64) {
    let s = Service::start(c.clone()).await;
    let stats = s.app.inbox.intake_stats["reborn"].clone();
    let all_read = within(Duration::from_secs(60), || {
        stats.received.load(Ordering::Relaxed) >= read
    })
    .await;
    assert!(all_read, "{read} records read from Kafka");
    let seen = || -> BTreeSet<String> { handler.calls().into_iter().map(|c| c.payload).collect() };
    within(Duration::from_secs(15), || seen().is_superset(payloads)).await;
    s.app.stop().await.unwrap();
    (seen(), stats.duplicates.load(Ordering::Relaxed))
}

// The service is stopped while the topic is missing: tansu answers a fetch of a missing
// topic with a `CurrentLeader` tag, which librdkafka 2.12 reads as a topic without a
// name and crashes on (SIGSEGV in `rd_kafka_metadata_cache_find`). Kafka sends that tag
// only from Fetch v16, with topic ids. Stopped or not, the consumer reads the new log
// from offset 0 (the group's offsets went with the topic, or with the cluster).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_without_ce_id_survive_a_recreated_topic_and_a_new_cluster() {
    let mut broker = Broker::start();
    let brokers = broker.addr();
    create_topic(&brokers, "reborn").await;
    let handler = Handler::default();
    let url = handler.serve().await;
    let db = fresh_pg().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &brokers, Duration::from_secs(1));
    c.subscriptions = vec![subscription("reborn", &["reborn"], &url)];
    let p = raw_producer(&brokers);

    // The first life of the topic: offsets 0, 1, 2.
    let old = named("old", 3);
    assert_eq!(produce(&p, "reborn", &old).await, [0, 1, 2]);
    let mut want: BTreeSet<String> = old.iter().cloned().collect();
    let (seen, _) = run(&c, &handler, 3, &want).await;
    assert_eq!(seen, want);

    // Deleted and created again: the new log starts at offset 0.
    delete_topic(&brokers, "reborn").await;
    create_topic(&brokers, "reborn").await;
    let recreated = named("recreated", 5);
    assert_eq!(
        produce(&p, "reborn", &recreated).await,
        [0, 1, 2, 3, 4],
        "offsets start again"
    );
    want.extend(recreated.iter().cloned());
    let (seen, duplicates) = run(&c, &handler, 5, &want).await;
    assert_eq!(
        seen, want,
        "every record of the recreated topic handled ({duplicates} dropped as duplicates)"
    );

    // A new cluster on the same address (a migration): the topic starts at 0 once more.
    drop(p);
    broker.stop();
    broker.resume();
    create_topic(&brokers, "reborn").await;
    let p = raw_producer(&brokers);
    let migrated = named("migrated", 4);
    assert_eq!(produce(&p, "reborn", &migrated).await, [0, 1, 2, 3]);
    want.extend(migrated.iter().cloned());
    let (seen, duplicates) = run(&c, &handler, 4, &want).await;
    assert_eq!(
        seen, want,
        "every record of the new cluster handled ({duplicates} dropped as duplicates)"
    );
    assert_eq!(handler.calls().len(), 12, "each handled once");
}

/// A subscription to `topic` on `brokers` handles 10 records; the topic is then deleted
/// and created again under the running service and `new` records are written at once,
/// before the consumer looks again. Every new record must reach the handler once, and
/// the partition's rewind be counted once in `metric`.
async fn replaced_under_a_running_subscription(
    brokers: &str,
    topic: &str,
    new: usize,
    metric: &str,
) {
    create_topic(brokers, topic).await;
    let handler = Handler::default();
    let url = handler.serve().await;
    let db = fresh_pg().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, brokers, Duration::from_secs(1));
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c.subscriptions = vec![subscription(topic, &[topic], &url)];
    let p = raw_producer(brokers);
    let old = named("old", 10);
    produce(&p, topic, &old).await;
    let s = Service::start(c).await;
    let seen = || -> BTreeSet<String> { handler.calls().into_iter().map(|c| c.payload).collect() };
    let mut want: BTreeSet<String> = old.iter().cloned().collect();
    assert!(
        within(Duration::from_secs(60), || seen() == want).await,
        "the first life handled"
    );
    // Deleted and created again in a moment, and written to at once: the new log starts
    // at 0, and with 10 records it ends where the consumer waits.
    delete_topic(brokers, topic).await;
    create_topic(brokers, topic).await;
    let fresh = named("new", new);
    let offsets: Vec<i64> = (0..new as i64).collect();
    assert_eq!(
        produce(&p, topic, &fresh).await,
        offsets,
        "offsets start again"
    );
    want.extend(fresh.iter().cloned());
    let started = Instant::now();
    let all = within(Duration::from_secs(20), || seen() == want).await;
    let took = started.elapsed();
    // Duplicates would be handled right after the last new record.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let text = scrape(s.app.metrics_addr.unwrap()).await;
    s.app.stop().await.unwrap();
    let handled = seen();
    let missing: Vec<&String> = want.difference(&handled).collect();
    assert!(all, "every new record handled: {missing:?} missing");
    println!("the new records were handled {took:?} after they were written");
    assert_eq!(handler.calls().len(), 10 + new, "each handled once");
    let series = format!("{metric}{{subscription=\"{topic}\"}}");
    assert_eq!(sample(&text, &series), 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_recreated_under_a_running_subscription_is_read_from_its_start() {
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    proxy.no_leader_for_missing_topics();
    // Ten new records: the consumer's position (10) is the new log's end, so only the
    // topic's new id tells the logs apart.
    replaced_under_a_running_subscription(
        &proxy.addr(),
        "recreated",
        10,
        "mailroom_inbox_topic_recreations_total",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_past_the_log_end_goes_back_to_the_log_start() {
    // A broker without topic ids (as before Kafka 2.8): the new log, 3 records long,
    // ends before the consumer's position (10), as after an unclean leader election.
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    proxy.hide_topic_ids();
    proxy.no_leader_for_missing_topics();
    replaced_under_a_running_subscription(
        &proxy.addr(),
        "truncated",
        3,
        "mailroom_inbox_log_truncations_total",
    )
    .await;
}

/// Stores `kafka:<topic>:0:<offset>` for `subscription` as a version that identified
/// records by their place alone did, handled; `days_ago`: stored that long ago.
async fn store_untimed(url: &str, subscription: &str, topic: &str, offset: i64, days_ago: i64) {
    let store = mailroom::app::open_store(&config(url)).await.unwrap();
    let old = InboundMessage {
        message_id: identity::kafka_untimed(topic, 0, offset),
        topic: topic.into(),
        key: Some("k".into()),
        payload: b"stored by the old version".to_vec(),
        headers: Default::default(),
        event_type: None,
        max_attempts: 5,
        failure: None,
    };
    store
        .receive(subscription, std::slice::from_ref(&old))
        .await
        .unwrap();
    let back = if url.starts_with("postgres") {
        format!("now() - interval '{days_ago} days'")
    } else {
        format!("created_at - {days_ago} * 86400000000")
    };
    exec(
        url,
        &format!(
            "UPDATE inbox_events SET status = 'completed', published_at = created_at,
                 created_at = {back}
             WHERE message_id = '{}'",
            old.message_id
        ),
    )
    .await;
    exec(url, "UPDATE inbox_keys SET pending = 0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_stored_under_the_place_alone_still_drop_a_redelivery_after_an_upgrade() {
    let broker = Broker::start();
    let p = raw_producer(&broker.addr());
    let records = named("record", 4);
    assert_eq!(produce(&p, "upgraded", &records).await, [0, 1, 2, 3]);
    for engine in &ENGINES {
        let handler = Handler::default();
        let url_h = handler.serve().await;
        let (url, _dir) = fresh_db(engine).await;
        // The old version stored offsets 0 and 1 (after they were written) without
        // committing them; offset 2 is another record: it was stored a day before this
        // one was written, in the topic's previous life.
        store_untimed(&url, "upgraded", "upgraded", 0, 0).await;
        store_untimed(&url, "upgraded", "upgraded", 1, 0).await;
        store_untimed(&url, "upgraded", "upgraded", 2, 1).await;
        let mut c = config(&url);
        kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(1));
        c.subscriptions = vec![subscription("upgraded", &["upgraded"], &url_h)];
        let s = Service::start(c).await;
        let stats = s.app.inbox.intake_stats["upgraded"].clone();
        let read = within(Duration::from_secs(60), || {
            stats.received.load(Ordering::Relaxed) >= 4
        })
        .await;
        assert!(read, "{engine:?}: 4 records read");
        let want: BTreeSet<String> = ["record-2", "record-3"].map(String::from).into();
        let seen =
            || -> BTreeSet<String> { handler.calls().into_iter().map(|c| c.payload).collect() };
        within(Duration::from_secs(15), || seen() == want).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            seen(),
            want,
            "{engine:?}: the redeliveries dropped, the new record handled"
        );
        assert_eq!(stats.duplicates.load(Ordering::Relaxed), 2, "{engine:?}");
        assert_eq!(
            count_rows(&url, "SELECT count(*) FROM inbox_events").await,
            5,
            "{engine:?}: 3 old rows and 2 new"
        );
        s.app.stop().await.unwrap();
    }
}

/// Writes one record to partition 0 of `topic` with `headers`.
async fn send(p: &FutureProducer, topic: &str, value: &[u8], headers: &[(&str, &str)]) {
    let mut h = OwnedHeaders::new();
    for (k, v) in headers {
        h = h.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    let r = FutureRecord::<str, [u8]>::to(topic)
        .partition(0)
        .key("k")
        .payload(value)
        .headers(h);
    p.send(r, Duration::from_secs(10)).await.unwrap();
}

/// A structured-mode CloudEvent, as Dapr writes one.
fn structured_event(id: &str, source: &str, n: u32) -> Vec<u8> {
    serde_json::json!({
        "specversion": "1.0", "id": id, "source": source, "type": "order.created",
        "datacontenttype": "application/json", "data": {"n": n},
    })
    .to_string()
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_cloud_events_are_deduplicated_by_source_and_id() {
    let broker = Broker::start();
    let handler = Keeper::default();
    let url = serve_handler(handler.clone()).await;
    let db = fresh_pg().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(1));
    c.subscriptions = vec![subscription("structured", &["structured"], &url)];
    let s = Service::start(c).await;
    let stats = s.app.inbox.intake_stats["structured"].clone();
    let p = raw_producer(&broker.addr());
    let ct = [(
        "content-type",
        "application/cloudevents+json; charset=utf-8",
    )];
    let first = structured_event("evt-1", "/dapr/orders", 1);
    send(&p, "structured", &first, &ct).await;
    // The same event again (a producer's retry), at another offset.
    send(
        &p,
        "structured",
        &structured_event("evt-1", "/dapr/orders", 1),
        &ct,
    )
    .await;
    send(&p, "structured", b"{not json", &ct).await;
    send(
        &p,
        "structured",
        br#"{"specversion":"1.0","source":"/dapr/orders"}"#,
        &ct,
    )
    .await;
    // The same id from another source is another event.
    let other = structured_event("evt-1", "/dapr/billing", 2);
    send(&p, "structured", &other, &ct).await;
    // The same event in binary mode.
    let binary = [("ce_id", "evt-1"), ("ce_source", "/dapr/orders")];
    send(&p, "structured", b"binary twin", &binary).await;

    let read = within(Duration::from_secs(60), || {
        stats.received.load(Ordering::Relaxed) >= 6
    })
    .await;
    assert!(read, "6 records read");
    let want: BTreeSet<Vec<u8>> = [
        first.clone(),
        b"{not json".to_vec(),
        br#"{"specversion":"1.0","source":"/dapr/orders"}"#.to_vec(),
        other.clone(),
    ]
    .into();
    let seen = || -> BTreeSet<Vec<u8>> { handler.calls().into_iter().map(|c| c.payload).collect() };
    within(Duration::from_secs(15), || seen() == want).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        handler.calls().len(),
        4,
        "one event handled once, the malformed ones delivered: {:?}",
        handler
            .calls()
            .iter()
            .map(|c| &c.message_id)
            .collect::<Vec<_>>()
    );
    assert_eq!(seen(), want);
    assert_eq!(stats.duplicates.load(Ordering::Relaxed), 2);

    let calls = handler.calls();
    let event = calls.iter().find(|c| c.payload == first).unwrap();
    assert_eq!(event.message_id, "ce:12:/dapr/orders:evt-1");
    assert_eq!(event.r#type, "order.created");
    for (k, v) in [
        ("ce_id", "evt-1"),
        ("ce_source", "/dapr/orders"),
        ("ce_type", "order.created"),
        ("ce_specversion", "1.0"),
        ("ce_datacontenttype", "application/json"),
        ("content-type", ct[0].1),
    ] {
        assert_eq!(event.headers.get(k).map(String::as_str), Some(v), "{k}");
    }
    let exact: Vec<&[u8]> = event.record_headers.iter().map(|h| &h.name[..]).collect();
    assert_eq!(exact, [&b"content-type"[..]], "the record's own headers");
    let billing = calls.iter().find(|c| c.payload == other).unwrap();
    assert_eq!(billing.message_id, "ce:13:/dapr/billing:evt-1");
    for bad in calls
        .iter()
        .filter(|c| c.payload != first && c.payload != other)
    {
        assert!(
            bad.message_id.starts_with("kafka:structured:0:") && bad.message_id.contains('@'),
            "a malformed event is identified by its place: {}",
            bad.message_id
        );
        assert_eq!(bad.r#type, "");
        assert!(!bad.headers.contains_key("ce_id"));
    }
    s.app.stop().await.unwrap();
}

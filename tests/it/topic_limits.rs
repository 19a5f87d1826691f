//! Defaults that fit stock Kafka, and each topic's own record limit (issue 23, item 5):
//! mailroom reads a topic's `max.message.bytes` from the cluster (DescribeConfigs) and
//! refuses an `Enqueue` whose record would not fit, names the limit, and stores nothing;
//! a record that reaches the relay anyway (the SQL API cannot ask) fails counted with a
//! clear reason instead of going to the broker; the largest event the defaults accept
//! fits stock Kafka's 1,048,588-byte record batch and is published.
//!
//! tansu never enforces `max.message.bytes`, but it keeps the value a topic was created
//! with and reports it through DescribeConfigs (checked first in each test), which is
//! all mailroom reads.

use std::time::Duration;

use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;

use crate::support::*;

/// Stock Kafka's `message.max.bytes`.
const STOCK_KAFKA_MAX_MESSAGE_BYTES: usize = 1_048_588;

fn admin(brokers: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap()
}

/// Creates `topic` with `max.message.bytes` = `limit` (none: the broker's default), and
/// checks that the broker reports the value back, as mailroom will read it.
pub(crate) async fn create_topic(brokers: &str, topic: &str, limit: Option<usize>) {
    let a = admin(brokers);
    let limit_s = limit.map(|l| l.to_string());
    let mut t = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    if let Some(l) = &limit_s {
        t = t.set("max.message.bytes", l);
    }
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let r = a.create_topics([&t], &opts).await.unwrap();
    assert!(r[0].is_ok(), "create {topic}: {r:?}");
    let described = a
        .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
        .await
        .unwrap();
    let reported = described[0]
        .as_ref()
        .unwrap()
        .get("max.message.bytes")
        .and_then(|e| e.value.clone());
    assert_eq!(reported, limit_s, "the broker reports {topic}'s limit back");
}

async fn kafka_service(brokers: &str) -> (String, Service) {
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, brokers, Duration::from_secs(5));
    c.source = Some("mailroom/topic-limits".into());
    (url.clone(), Service::start(c).await)
}

/// Item 5: a topic whose `max.message.bytes` is below an event's record: `Enqueue` and
/// `EnqueueBatch` answer `INVALID_ARGUMENT` naming the topic and its limit, and nothing
/// is stored; a small event on the same topic, and the big one on a topic without a
/// limit of its own, are accepted and published. Before: the 5,000-byte event was
/// stored (and published: tansu has no limit; stock Kafka would refuse it forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_its_topics_max_message_bytes_is_refused_naming_the_limit() {
    let broker = Broker::start();
    create_topic(&broker.addr(), "limited", Some(1000)).await;
    create_topic(&broker.addr(), "unlimited", None).await;
    let (_url, mut s) = kafka_service(&broker.addr()).await;

    let big = vec![7u8; 5000];
    let err = enqueue_err(&mut s.client, Some(event("limited", "k", &big))).await;
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert_eq!(field_of(&err), "event.payload");
    let msg = format!("{err:?}");
    for part in ["'limited'", "at most 1000 bytes", "max.message.bytes"] {
        assert!(msg.contains(part), "{part} not in {msg}");
    }
    let err = s
        .client
        .enqueue_batch(pb::EnqueueBatchRequest {
            events: vec![event("limited", "k", b"small"), event("limited", "k", &big)],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert_eq!(field_of(&err), "events[1].payload");
    assert_eq!(s.outbox_count(None).await, 0, "nothing stored");

    // What fits is accepted and published; a topic without a limit of its own falls back
    // to the configured limits.
    let small = enqueue(&mut s.client, event("limited", "k", b"small")).await;
    let other = enqueue(&mut s.client, event("unlimited", "k", &big)).await;
    wait_completed(&s, &[small, other]).await;
    assert_eq!(
        consume(&broker.addr(), "limited", 1, Duration::from_secs(30)).len(),
        1
    );
    let r = consume(&broker.addr(), "unlimited", 1, Duration::from_secs(30));
    assert_eq!(r[0].payload, big);
    s.app.stop().await.unwrap();
}

/// Waits until each outbox event is `completed`.
async fn wait_completed(s: &Service, ids: &[i64]) {
    for &id in ids {
        eventually(Duration::from_secs(30), "published", || async {
            s.stored(BoxKind::Outbox, id).await.status == Status::Completed
        })
        .await;
    }
}

/// The bytes of a v2 record batch of one record, counted here from what was read back
/// (independently of mailroom's own arithmetic): the 61-byte batch header, then the
/// record's varint-framed key, value and headers.
fn batch_bytes(r: &Record) -> usize {
    fn varint(v: i64) -> usize {
        let mut z = ((v << 1) ^ (v >> 63)) as u64;
        let mut n = 1;
        while z >= 0x80 {
            z >>= 7;
            n += 1;
        }
        n
    }
    let field = |n: usize| varint(n as i64) + n;
    let key = if r.key.is_empty() {
        varint(-1)
    } else {
        field(r.key.len())
    };
    let headers: usize = r
        .headers
        .iter()
        .map(|(k, v)| field(k.len()) + field(v.len()))
        .sum();
    let body = 1 + 1 + 1 + key + field(r.payload.len()) + varint(r.headers.len() as i64) + headers;
    61 + varint(body as i64) + body
}

/// Item 5: the largest event the default limits accept (payload of
/// `max_payload_bytes`, `max_header_bytes` of headers, the longest key and type) is
/// accepted for a topic at stock Kafka's limit and published, and the record read back
/// is within 1,048,588 bytes. Before: the default payload limit was 1 MiB, and the
/// largest event's record was 1,066,673 bytes: stock Kafka refuses it forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_default_event_fits_stock_kafka_and_is_published() {
    let broker = Broker::start();
    create_topic(&broker.addr(), "stock", Some(STOCK_KAFKA_MAX_MESSAGE_BYTES)).await;
    let (_url, mut s) = kafka_service(&broker.addr()).await;
    let limits = mailroom::domain::Limits::default();
    let config = config("postgres://unused");
    assert_eq!(config.limits.max_payload_bytes, limits.max_payload_bytes);
    // 64 headers of max_header_bytes in all.
    let per = limits.max_header_bytes / limits.max_headers;
    let headers = (0..limits.max_headers)
        .map(|i| {
            let name = format!("h{i:02}");
            let value = "v".repeat(per - name.len());
            (name, value)
        })
        .collect::<std::collections::HashMap<_, _>>();
    let e = pb::Event {
        topic: "stock".into(),
        key: "k".repeat(limits.max_key_bytes),
        payload: vec![42u8; limits.max_payload_bytes],
        headers,
        r#type: "t".repeat(256),
        ..Default::default()
    };
    let id = enqueue(&mut s.client, e).await;
    wait_completed(&s, &[id]).await;
    let r = consume(&broker.addr(), "stock", 1, Duration::from_secs(30));
    assert_eq!(r[0].payload.len(), limits.max_payload_bytes);
    let bytes = batch_bytes(&r[0]);
    assert!(
        bytes <= STOCK_KAFKA_MAX_MESSAGE_BYTES,
        "the largest default record is {bytes} bytes"
    );
    println!(
        "largest default record: {bytes} bytes ({} to spare)",
        STOCK_KAFKA_MAX_MESSAGE_BYTES - bytes
    );
    let stored = s.stored(BoxKind::Outbox, id).await;
    assert_eq!(stored.attempts, 0);
    s.app.stop().await.unwrap();
}

/// Item 5: the SQL API's `mailroom.enqueue` cannot ask the cluster, so an event over its
/// topic's limit is stored; the relay refuses it before the broker would (a broker's
/// refusal stops the gapless producer for every topic), as a counted failure naming the
/// topic, the record's size and the limit, and it ends `failed` without reaching the
/// topic. Before: it was published (tansu has no limit; stock Kafka refuses it at each
/// attempt, with "Broker: Message size too large").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_its_topics_limit_fails_counted_with_a_clear_reason() {
    let broker = Broker::start();
    create_topic(&broker.addr(), "sql.limited", Some(1000)).await;
    let (url, s) = kafka_service(&broker.addr()).await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let id: i64 = sqlx::query_scalar(
        "SELECT mailroom.enqueue(topic => 'sql.limited', key => 'k', payload => $1,
                                 max_attempts => 1)",
    )
    .bind(vec![1u8; 5000])
    .fetch_one(&pool)
    .await
    .unwrap();
    // A small one behind it on another key is published.
    let small: i64 = sqlx::query_scalar(
        "SELECT mailroom.enqueue(topic => 'sql.limited', key => 'other', payload => '\\x01')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    eventually(Duration::from_secs(60), "the big event fails", || async {
        s.stored(BoxKind::Outbox, id).await.status == Status::Failed
    })
    .await;
    let e = s.stored(BoxKind::Outbox, id).await;
    assert_eq!(e.attempts, 1, "the refusal is a counted attempt");
    let why = e.last_error.unwrap_or_default();
    for part in [
        "'sql.limited'",
        "at most 1000 bytes",
        "max.message.bytes",
        "not sent",
    ] {
        assert!(why.contains(part), "{part} not in {why}");
    }
    wait_completed(&s, &[small]).await;
    let records = consume(&broker.addr(), "sql.limited", 2, Duration::from_secs(5));
    let ids: Vec<i64> = records
        .iter()
        .map(|r| event_id(&r.headers["ce_id"]))
        .collect();
    assert_eq!(
        ids,
        vec![small],
        "the oversized record never reached the topic"
    );
    pool.close().await;
    s.app.stop().await.unwrap();
}

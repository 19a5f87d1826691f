//! Partitions as fault domains (issue 23, item 6): keyed events go to the partition
//! Kafka's own partitioner picks for their key, sent there explicitly, so the relay can
//! hold back and probe one partition that has no leader while the others keep going.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mailroom::domain::Queue;
use mailroom::pb;
use mailroom::relay::{Relay, RelayConfig};
use mailroom::sink::kafka::partitions::partition_for;
use mailroom::sink::kafka::{KafkaSink, producer_config};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use crate::support::kafka_proxy::{KafkaProxy, NOT_LEADER_OR_FOLLOWER};
use crate::support::*;

/// This process's resident set, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// The partition count of `topic` (created by the first produce on tansu).
fn partition_count(p: &FutureProducer, topic: &str) -> i32 {
    let md = p
        .client()
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    md.topics()[0].partitions().len() as i32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_events_land_on_the_partition_kafkas_partitioner_picks() {
    let broker = Broker::start();
    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.addr())
        .set("partitioner", "murmur2_random")
        .set("message.timeout.ms", "10000")
        .create()
        .unwrap();
    let keys: Vec<String> = (0..60).map(|i| format!("key-{i}")).collect();
    // librdkafka's own murmur2_random is the reference.
    let mut count = 0;
    for k in &keys {
        let p = plain
            .send(
                FutureRecord::to("reference").key(k).payload("x"),
                Duration::from_secs(10),
            )
            .await
            .unwrap()
            .partition;
        if count == 0 {
            count = partition_count(&plain, "reference");
            assert!(count > 1, "tansu creates topics with several partitions");
        }
        assert_eq!(p, partition_for(k.as_bytes(), count), "key {k}");
    }

    let db = fresh_pg().await;
    let mut c = config(&db);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(5));
    let mut s = Service::start(c).await;
    for round in 0..3 {
        for k in &keys {
            enqueue(
                &mut s.client,
                event("placed", k, format!("{round}").as_bytes()),
            )
            .await;
        }
        // Later rounds go out after the sink has read the partition count.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let n = keys.len() * 3;
    let records = consume(&broker.addr(), "placed", n, Duration::from_secs(60));
    assert_eq!(records.len(), n);
    let placed_count = partition_count(&plain, "placed");
    for r in &records {
        assert_eq!(
            r.partition,
            partition_for(r.key.as_bytes(), placed_count),
            "key {} on the partition Kafka's partitioner picks",
            r.key
        );
    }
    s.app.stop().await.unwrap();
}

/// Partitions of the topics the outage test creates.
pub(crate) const PARTITIONS: i32 = 3;
/// The partition whose leader goes away.
const DEAD: i32 = 1;

pub(crate) async fn create_topics(brokers: &str, topics: &[&str]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, PARTITIONS, TopicReplication::Fixed(1)))
        .collect();
    for r in admin
        .create_topics(&new, &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
}

/// A relay with default settings over a real Kafka sink to `brokers` whose delivery
/// deadline is `deadline`, running until the returned token is cancelled.
fn start_relay(
    s: &Service,
    brokers: &str,
    deadline: Duration,
) -> (
    Arc<KafkaSink>,
    Arc<mailroom::relay::RelayStats>,
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let sink = Arc::new(
        KafkaSink::new(
            producer_config(brokers, deadline, &Default::default()),
            "mailroom-test".into(),
            deadline,
        )
        .unwrap(),
    );
    let relay = Relay::new(
        s.app.store.clone(),
        sink.clone(),
        Queue::Outbox,
        RelayConfig::default(),
    );
    let stats = relay.stats();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    (sink, stats, stop, task)
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// One drain of a backlog over `dp` (200 keys, a third of them on partition DEAD, and
/// 1,000 unkeyed events) and `other` (60 keys), 250 events per key, by one relay with default settings over the
/// real sink, through the protocol proxy. With `hide`, partition DEAD of `dp` has no
/// leader until the healthy events are drained and (with `outage_checks`) its lines have
/// come back transient and been probed. Returns the time the healthy events took. What
/// follows the stopwatch waits until every party of `stopped` has stopped its own.
async fn drain(
    hide: bool,
    outage_checks: bool,
    start: Arc<tokio::sync::Barrier>,
    stopped: Arc<tokio::sync::Barrier>,
) -> Duration {
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    create_topics(&proxy.addr(), &["dp", "other"]).await;
    if hide {
        proxy.hide_leader("dp", DEAD);
    }
    let (url, mut s) = quiet_pg().await;
    let per_key = 250;
    let mut dead_keys = Vec::new();
    for (topic, keys) in [("dp", 200), ("other", 60)] {
        for k in 0..keys {
            let key = format!("{topic}-{k}");
            if topic == "dp" && partition_for(key.as_bytes(), PARTITIONS) == DEAD {
                dead_keys.push(key.clone());
            }
            let events = (0..per_key)
                .map(|i| event(topic, &key, format!("{i}").as_bytes()))
                .collect();
            s.client
                .enqueue_batch(pb::EnqueueBatchRequest { events })
                .await
                .unwrap();
        }
    }
    // Unkeyed events of the topic with the dead partition go to partitions that have a
    // leader.
    let unkeyed = 1000;
    for chunk in 0..unkeyed / 500 {
        let events = (0..500)
            .map(|i| event("dp", "", format!("u{chunk}-{i}").as_bytes()))
            .collect();
        s.client
            .enqueue_batch(pb::EnqueueBatchRequest { events })
            .await
            .unwrap();
    }
    let dead = (dead_keys.len() * per_key) as i64;
    let healthy = 260 * per_key as i64 - dead + unkeyed;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let dead_list = dead_keys
        .iter()
        .map(|k| format!("'{k}'"))
        .collect::<Vec<_>>()
        .join(",");
    let healthy_done = format!(
        "SELECT count(*) FROM outbox_events_view WHERE status = 'completed' \
         AND NOT (topic = 'dp' AND event_key IS NOT NULL AND event_key IN ({dead_list}))"
    );

    // Default settings: the default delivery deadline (15 s) and relay configuration.
    start.wait().await;
    let (sink, stats, stop, task) = start_relay(&s, &proxy.addr(), Duration::from_secs(15));
    let t0 = Instant::now();
    while count(&pool, &healthy_done).await < healthy {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the healthy events did not drain"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = t0.elapsed();
    meet(&stopped).await;

    if hide {
        assert!(proxy.hidden_answers() > 0, "the proxy hid the leader");
    }
    if outage_checks {
        // The dead lines come back transient at the delivery deadline; from then on the
        // partition is held back and probed on its own.
        eventually(
            Duration::from_secs(60),
            "the dead partition held back",
            || async { stats.held_back.load(Ordering::Relaxed) > 0 },
        )
        .await;
        // Probed again and again, while nothing of it waits in the producer's queue:
        // its records are not handed to librdkafka while the metadata shows no leader.
        let probes = stats.transient.load(Ordering::Relaxed);
        let first = sink.queued();
        let mut queued = first;
        let rss_first = rss_kib();
        let mut rss_max = rss_first;
        let t = Instant::now();
        // Longer than the longest probe pause (5 s); `MAILROOM_TEST_OUTAGE_SECS` holds
        // the outage longer by hand (the 5 minutes: 300).
        let hold = std::env::var("MAILROOM_TEST_OUTAGE_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::from_secs(6), Duration::from_secs);
        while t.elapsed() < hold {
            queued = queued.max(sink.queued());
            rss_max = rss_max.max(rss_kib());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let last = sink.queued();
        eprintln!(
            "outage of {hold:?}: test process RSS {} MiB at first, at most {} MiB",
            rss_first / 1024,
            rss_max / 1024
        );
        // Probing allocates nothing that stays: over the hand-held soak, run alone, the
        // process (service, relay, proxy, test) grows by less than 64 MiB. In the suite
        // other tests share the process, so its RSS says nothing there.
        if std::env::var_os("MAILROOM_TEST_OUTAGE_SECS").is_some() {
            assert!(
                rss_max < rss_first + 64 * 1024,
                "memory stays bounded during the outage: {rss_first} KiB then {rss_max} KiB"
            );
        }
        assert!(
            stats.transient.load(Ordering::Relaxed) > probes,
            "the dead partition was probed again"
        );
        eprintln!(
            "producer queue during the outage: {first} at first, at most {queued}, {last} at last"
        );
        // The probes queue nothing: what librdkafka holds is what was handed over before
        // the metadata said "no leader", at most the claims in flight then (4 cycles of
        // the default batch of 1,000; 292 to 1,000 seen).
        assert!(
            last <= first,
            "the probes queued nothing: {first} then {last}"
        );
        assert!(
            queued <= 4000,
            "the producer's queue stays bounded: {queued} held"
        );
        let spent = count(
            &pool,
            &format!(
                "SELECT count(*) FROM outbox_events_view WHERE event_key IN ({dead_list}) \
                 AND (attempts > 0 OR status <> 'pending')"
            ),
        )
        .await;
        assert_eq!(
            spent, 0,
            "the dead partition spent no attempts and published nothing"
        );
    }
    // The leader comes back: the partition's backlog goes out, in order.
    proxy.show_leaders();
    let all_done = "SELECT count(*) FROM outbox_events_view WHERE status = 'completed'";
    eventually(Duration::from_secs(90), "every event published", || async {
        count(&pool, all_done).await == healthy + dead
    })
    .await;
    stop.cancel();
    task.await.unwrap();
    assert_eq!(stats.delivered_after_failure.load(Ordering::Relaxed), 0);
    assert_eq!(stats.failed.load(Ordering::Relaxed), 0);
    if outage_checks {
        let total = 200 * per_key + unkeyed as usize;
        let addr = proxy.addr();
        let records = tokio::task::spawn_blocking(move || {
            consume(&addr, "dp", total, Duration::from_secs(60))
        })
        .await
        .unwrap();
        let (per_key_ids, _dups) = first_deliveries(&records);
        assert_eq!(
            per_key_ids.values().map(Vec::len).sum::<usize>(),
            total,
            "nothing lost"
        );
        for k in &dead_keys {
            let ids = &per_key_ids[k];
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "key {k} in order");
        }
    }
    s.app.stop().await.unwrap();
    took
}

/// Item 6: one partition without a leader (the proxy's `Metadata` says so) holds back
/// only its own keys: its topic's other partitions and another topic drain at >= 90 %
/// of their undisturbed pace, no attempt is spent, and when the leader returns the
/// partition's backlog goes out in order, nothing lost. The undisturbed drain and the
/// one beside the leaderless partition run at the same time; the best of 3 rounds,
/// because the machine is shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaderless_partition_does_not_slow_the_rest() {
    let _alone = measuring().await;
    let (mut alone, mut beside, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..3 {
        // Both drains at once, each with its own service, proxy and broker, so that the
        // shared machine's noise falls on both alike.
        // Each in a task of its own; nothing after either stopwatch runs before both
        // have stopped.
        let start = Arc::new(tokio::sync::Barrier::new(2));
        let stopped = Arc::new(tokio::sync::Barrier::new(2));
        let quiet = tokio::spawn(drain(false, false, start.clone(), stopped.clone()));
        let dead = tokio::spawn(drain(true, round == 0, start, stopped));
        let (a, b) = (quiet.await.unwrap(), dead.await.unwrap());
        alone.push(a);
        beside.push(b);
        ratios.push(a.as_secs_f64() / b.as_secs_f64());
    }
    let ratio = ratios.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "leaderless partition: healthy events drained undisturbed in {alone:?}, beside a \
         leaderless partition in {beside:?}: {:.0} % of the pace",
        ratio * 100.0
    );
    // The bar: 90 % (99-117 % measured on this 2-core machine). Until issue 46
    // the two drains shared one task and the test asserted 80 %.
    assert!(
        ratio >= 0.9,
        "the healthy partitions kept {:.0} % of their pace",
        ratio * 100.0
    );
}

/// A partition that loses its leader after the sink read the topic's metadata: its
/// lines come back transient at the delivery deadline, which makes the sink read the
/// metadata again, and from then on its probes queue nothing more in librdkafka. The
/// deadline is 2 s here (not the default 15 s) to keep the test short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_that_loses_its_leader_later_is_seen_and_queues_nothing_more() {
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    create_topics(&proxy.addr(), &["late"]).await;
    let (url, mut s) = quiet_pg().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let (sink, stats, stop, task) = start_relay(&s, &proxy.addr(), Duration::from_secs(2));
    let keys: Vec<String> = (0..30).map(|k| format!("late-{k}")).collect();
    let send_round = |round: usize| {
        keys.iter()
            .map(|k| event("late", k, format!("{round}").as_bytes()))
            .collect::<Vec<_>>()
    };
    s.client
        .enqueue_batch(pb::EnqueueBatchRequest {
            events: send_round(0),
        })
        .await
        .unwrap();
    let done = "SELECT count(*) FROM outbox_events_view WHERE status = 'completed'";
    eventually(
        Duration::from_secs(30),
        "the first round published",
        || async { count(&pool, done).await == 30 },
    )
    .await;

    // The leader dies: its broker refuses the partition's batches, and the metadata
    // shows no leader.
    proxy.hide_leader("late", DEAD);
    proxy.refuse_produce("late", DEAD, NOT_LEADER_OR_FOLLOWER);
    for round in 1..=10 {
        s.client
            .enqueue_batch(pb::EnqueueBatchRequest {
                events: send_round(round),
            })
            .await
            .unwrap();
    }
    let dead = keys
        .iter()
        .filter(|k| partition_for(k.as_bytes(), PARTITIONS) == DEAD)
        .count() as i64;
    eventually(
        Duration::from_secs(60),
        "the other partitions published",
        || async { count(&pool, done).await == 30 + (30 - dead) * 10 },
    )
    .await;
    eventually(
        Duration::from_secs(60),
        "the dead partition held back",
        || async { stats.held_back.load(Ordering::Relaxed) > 0 },
    )
    .await;
    assert!(proxy.hidden_answers() > 0, "the proxy hid the leader");
    assert!(
        proxy.refusals() > 0,
        "the proxy refused the partition's batches"
    );
    // Probes go on, and librdkafka's queue does not grow with them.
    let before = sink.queued();
    let probes = stats.transient.load(Ordering::Relaxed);
    // Longer than the longest probe pause (5 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        stats.transient.load(Ordering::Relaxed) > probes,
        "probed meanwhile"
    );
    let after = sink.queued();
    eprintln!("late leader loss: {before} records held, {after} after 6 s of probes");
    assert!(
        after <= before,
        "no probe copies queued: {before} then {after}"
    );
    let spent = count(
        &pool,
        "SELECT count(*) FROM outbox_events_view WHERE attempts > 0 OR status = 'failed'",
    )
    .await;
    assert_eq!(spent, 0, "no attempt spent");

    proxy.show_leaders();
    proxy.accept_produce();
    eventually(Duration::from_secs(60), "everything published", || async {
        count(&pool, done).await == 330
    })
    .await;
    stop.cancel();
    task.await.unwrap();
    let records = consume(&proxy.addr(), "late", 330, Duration::from_secs(60));
    let (per_key, _dups) = first_deliveries(&records);
    for (k, ids) in &per_key {
        assert_eq!(ids.len(), 11, "key {k}: nothing lost");
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "key {k} in order");
    }
    s.app.stop().await.unwrap();
}

/// Events of the trickle, one every 200 ms.
const TRICKLE: i64 = 75;

/// Kafka's `NOT_ENOUGH_REPLICAS`: librdkafka retries it forever (here: until mailroom's
/// delivery deadline).
const NOT_ENOUGH_REPLICAS: i16 = 19;

/// Issue 43, item 3: partitions that keep a leader but never answer (the proxy answers
/// their batches `NOT_ENOUGH_REPLICAS`, which librdkafka retries until mailroom's 15 s
/// deadline). Each is probed by a cycle of its own; before, such a probe-only cycle held
/// one of the relay's 4 active slots for the whole deadline, so five of them stopped
/// the relay from claiming for every topic. A trickle on another topic (an event every
/// 200 ms for 15 s, once the partitions are being probed) keeps its latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_of_silent_partitions_do_not_hold_the_relay() {
    let _alone = measuring().await;
    let proxy = KafkaProxy::listen().await;
    let broker = Broker::start_advertising(free_port(), &proxy.addr());
    proxy.set_upstream(&broker.addr());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", proxy.addr())
        .create()
        .unwrap();
    let new = [
        NewTopic::new("silent", 5, TopicReplication::Fixed(1)),
        NewTopic::new("trickle", 3, TopicReplication::Fixed(1)),
    ];
    for r in admin
        .create_topics(&new, &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
    for p in 0..5 {
        proxy.refuse_produce("silent", p, NOT_ENOUGH_REPLICAS);
    }
    let (url, mut s) = quiet_pg().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    // Keys on each of the five partitions.
    let keys: Vec<String> = (0..40).map(|k| format!("s{k}")).collect();
    let covered: std::collections::HashSet<i32> = keys
        .iter()
        .map(|k| partition_for(k.as_bytes(), 5))
        .collect();
    assert_eq!(covered.len(), 5, "every partition has keys");
    let events = keys
        .iter()
        .flat_map(|k| (0..3).map(move |i| event("silent", k, format!("{i}").as_bytes())))
        .collect();
    s.client
        .enqueue_batch(pb::EnqueueBatchRequest { events })
        .await
        .unwrap();
    let (_sink, stats, stop, task) = start_relay(&s, &proxy.addr(), Duration::from_secs(15));
    // The first deliveries time out at the deadline; from then on the partitions are
    // held back and probed.
    eventually(
        Duration::from_secs(40),
        "the silent partitions held back",
        || async { stats.held_back.load(Ordering::Relaxed) > 0 },
    )
    .await;
    assert!(
        proxy.refusals() > 0,
        "the proxy refused the partitions' batches"
    );
    for i in 0..TRICKLE {
        s.client
            .enqueue_batch(pb::EnqueueBatchRequest {
                events: vec![event(
                    "trickle",
                    &format!("t{}", i % 20),
                    format!("{i}").as_bytes(),
                )],
            })
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let done =
        "SELECT count(*) FROM outbox_events_view WHERE topic = 'trickle' AND status = 'completed'";
    eventually(Duration::from_secs(60), "the trickle published", || async {
        count(&pool, done).await == TRICKLE
    })
    .await;
    let (p50, p99, max): (f64, f64, f64) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::float8, \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::float8, max(ms)::float8 \
         FROM (SELECT extract(epoch FROM published_at - created_at) * 1000 AS ms \
               FROM outbox_events_view WHERE topic = 'trickle') l",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let spent = count(
        &pool,
        "SELECT count(*) FROM outbox_events_view WHERE attempts > 0 OR status = 'failed'",
    )
    .await;
    eprintln!(
        "silent partitions: trickle latency from commit to publication p50 {p50:.0} ms, \
         p99 {p99:.0} ms, max {max:.0} ms; {} refusals",
        proxy.refusals()
    );
    assert_eq!(spent, 0, "no attempt spent");
    stop.cancel();
    task.await.unwrap();
    // Measured on the loaded 2-core machine: p99 286 ms (max 287); before, with the
    // probe-only cycles holding active slots, p99 1,340 ms (max 1,383).
    assert!(p99 < 700.0, "trickle p99 {p99:.0} ms (p50 {p50:.0} ms)");
    s.app.stop().await.unwrap();
}

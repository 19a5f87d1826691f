//! Partitions as fault domains (issue 23, item 6): keyed events go to the partition
//! Kafka's own partitioner picks for their key, sent there explicitly, so the relay can
//! hold back and probe one partition that has no leader while the others keep going.

use std::time::Duration;

use mailroom::sink::kafka::partitions::partition_for;
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use crate::support::*;

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

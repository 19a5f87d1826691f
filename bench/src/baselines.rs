//! The baselines measured in the same run: raw PostgreSQL inserts of the same rows and
//! raw rdkafka produce of the same records to the same broker.

use super::*;

/// The raw baseline's multi-row insert: one row per key, each with `payload`, into
/// `raw_events` (a copy of `outbox_events`), in one statement.
pub(crate) async fn raw_insert(
    pool: &sqlx::PgPool,
    topic: &str,
    keys: &[String],
    payload: &[u8],
) -> anyhow::Result<()> {
    let payloads: Vec<&[u8]> = vec![payload; keys.len()];
    sqlx::query(
        "INSERT INTO raw_events (topic, event_key, payload, headers, event_type,
             max_attempts, scheduled_at)
         SELECT $1, k, p, '{}'::jsonb, $4, 6, now()
         FROM unnest($2::text[], $3::bytea[]) AS u(k, p)",
    )
    .bind(topic)
    .bind(keys)
    .bind(&payloads)
    .bind(EVENT_TYPE)
    .execute(pool)
    .await?;
    Ok(())
}

impl Bench {
    /// Raw PostgreSQL: the same rows into a copy of `outbox_events` (same columns and
    /// indexes), one row per transaction from 64 connections, then 100 rows per statement.
    pub(crate) async fn raw_pg(&self) -> anyhow::Result<Vec<Row>> {
        let (db, url) = self.dbs.fresh().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(RAW_ROW_CONNECTIONS as u32)
            .min_connections(RAW_ROW_CONNECTIONS as u32)
            .connect(&url)
            .await?;
        sqlx::query("CREATE TABLE raw_events (LIKE outbox_events INCLUDING ALL)")
            .execute(&pool)
            .await?;
        // Open every connection before timing.
        let warm: Vec<_> = (0..RAW_ROW_CONNECTIONS).map(|_| pool.acquire()).collect();
        drop(futures::future::try_join_all(warm).await?);
        let mut rows = Vec::new();

        let topic = self.topic("raw_pg");
        let payload: Arc<[u8]> = self.payload.clone().into();
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let (p, t, pl) = (pool.clone(), topic.clone(), payload.clone());
        let load = drive(RAW_ROW_CONNECTIONS, self.sizes.duration, move |c, seq| {
            let (p, t, pl) = (p.clone(), t.clone(), pl.clone());
            async move {
                sqlx::query(
                    "INSERT INTO raw_events (topic, event_key, payload, headers, event_type,
                         max_attempts, scheduled_at)
                     VALUES ($1, $2, $3, $4::jsonb, $5, $6, now())",
                )
                .bind(&t)
                .bind(key(c * 7919 + seq as usize, KEYS))
                .bind(&pl[..])
                .bind("{}")
                .bind(EVENT_TYPE)
                .bind(6_i32)
                .execute(&p)
                .await?;
                Ok(1)
            }
        })
        .await;
        rows.push(load_row(
            "raw-pg-1-row-per-tx-c64",
            load,
            mark.since(self.broker_pid),
            None,
        ));

        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let (p, t, pl) = (pool.clone(), topic.clone(), payload.clone());
        let load = drive(BATCH_CLIENTS, self.sizes.duration, move |c, seq| {
            let (p, t, pl) = (p.clone(), t.clone(), pl.clone());
            async move {
                let keys: Vec<String> = (0..BATCH)
                    .map(|i| key(c * 7919 + seq as usize * BATCH + i, KEYS))
                    .collect();
                raw_insert(&p, &t, &keys, &pl).await?;
                Ok(BATCH as u64)
            }
        })
        .await;
        rows.push(load_row(
            "raw-pg-100-rows-per-stmt-c16",
            load,
            mark.since(self.broker_pid),
            None,
        ));
        pool.close().await;
        self.dbs.drop_db(&db).await;
        Ok(rows)
    }

    /// Raw rdkafka: the records mailroom would publish (same payload, key and CloudEvents
    /// headers), idempotent, acks=all, mailroom's own producer settings, up to 10,000 in
    /// flight; over 1,000 keys and over a single key.
    pub(crate) async fn raw_kafka(&self) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for (name, keys) in [("raw-kafka-1000-keys", KEYS), ("raw-kafka-1-key", 1)] {
            let producer: FutureProducer =
                producer_config(&self.brokers, Duration::from_secs(15), &BTreeMap::new())
                    .create()?;
            let topic = self.topic(&name.replace('-', "_"));
            // Create the topic and the producer id outside the timing.
            producer
                .send(
                    FutureRecord::<str, [u8]>::to(&topic)
                        .payload(&self.payload[..])
                        .key("warm"),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|(e, _)| e)?;
            let n = self.sizes.raw_kafka;
            let mark = CpuMark::take(self.broker_pid);
            reset_peak_rss();
            let start = Instant::now();
            let mut inflight = FuturesUnordered::new();
            let mut lat = Vec::with_capacity(n);
            let mut errors = 0u64;
            let mut first_error = None;
            let (mut send_errors, mut send_error) = (0u64, None);
            let ce_time = chrono::Utc::now().to_rfc3339();
            let mut collect = |r: (Result<_, _>, Duration)| match r.0 {
                Ok(Ok(_)) => lat.push(r.1.as_micros() as u64),
                Ok(Err((e, _))) => {
                    errors += 1;
                    first_error.get_or_insert_with(|| format!("{e}"));
                }
                Err(_) => errors += 1,
            };
            for i in 0..n {
                while inflight.len() >= RAW_KAFKA_IN_FLIGHT {
                    if let Some(r) = inflight.next().await {
                        collect(r);
                    }
                }
                let id = (i + 1).to_string();
                let k = key(i, keys);
                let mut h = OwnedHeaders::new_with_capacity(5);
                for (hk, hv) in [
                    ("ce_specversion", "1.0"),
                    ("ce_id", id.as_str()),
                    ("ce_type", EVENT_TYPE),
                    ("ce_source", "mailroom"),
                    ("ce_time", ce_time.as_str()),
                ] {
                    h = h.insert(Header {
                        key: hk,
                        value: Some(hv.as_bytes()),
                    });
                }
                let record = FutureRecord::<str, [u8]>::to(&topic)
                    .payload(&self.payload[..])
                    .key(k.as_str())
                    .headers(h);
                let t = Instant::now();
                match producer.send_result(record) {
                    Ok(f) => inflight.push(async move { (f.await, t.elapsed()) }),
                    Err((e, _)) => {
                        send_errors += 1;
                        send_error.get_or_insert_with(|| format!("{e}"));
                    }
                }
            }
            while let Some(r) = inflight.next().await {
                collect(r);
            }
            errors += send_errors;
            let first_error = first_error.or(send_error);
            let elapsed = start.elapsed();
            let mut notes = vec![format!("{RAW_KAFKA_IN_FLIGHT} in flight")];
            if errors > 0 {
                notes.push(format!(
                    "{errors} errors (first: {})",
                    first_error.unwrap_or_default()
                ));
            }
            rows.push(Row {
                name: name.into(),
                events: lat.len() as u64,
                secs: elapsed.as_secs_f64(),
                latency: latency(lat),
                peak_rss_mb: mb(status_kb("VmHWM:")),
                cpu: mark.since(self.broker_pid),
                baseline: None,
                notes,
                wal_bytes: None,
            });
        }
        Ok(rows)
    }

    /// The broker's own end-to-end floor at each rate of the `e2e` scenarios: the same
    /// records produced open loop by an rdkafka producer with mailroom's settings, each
    /// timed from `send` to being consumed back by the same reader. mailroom's
    /// end-to-end latency is this plus what the outbox adds (commit, claim, settle).
    pub(crate) async fn raw_e2e(&self) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for &rate in E2E_RATES {
            let topic = self.topic(&format!("raw_e2e_{rate}"));
            let producer = create_topic(&self.brokers, &topic).await?;
            let reader = TopicReader::start(&self.brokers, &topic)?;
            let total = (rate as f64 * self.sizes.e2e.as_secs_f64()) as usize;
            let mut sent: HashMap<i64, i64> = HashMap::with_capacity(total);
            let mut acks = FuturesUnordered::new();
            let mut errors = 0u64;
            let mark = CpuMark::take(self.broker_pid);
            reset_peak_rss();
            let start = Instant::now();
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for i in 0..total {
                tick.tick().await;
                // Collect acknowledgements as they come, so that none waits on the loop.
                while let Some(Some(r)) = futures::FutureExt::now_or_never(acks.next()) {
                    if !matches!(r, Ok(Ok(_))) {
                        errors += 1;
                    }
                }
                let id = (i + 1) as i64;
                let ce_id = id.to_string();
                let k = key(i, KEYS);
                let h = OwnedHeaders::new_with_capacity(1).insert(Header {
                    key: "ce_id",
                    value: Some(ce_id.as_bytes()),
                });
                let record = FutureRecord::<str, [u8]>::to(&topic)
                    .payload(&self.payload[..])
                    .key(k.as_str())
                    .headers(h);
                sent.insert(id, now_us());
                match producer.send_result(record) {
                    Ok(f) => acks.push(f),
                    Err(_) => errors += 1,
                }
            }
            while let Some(r) = acks.next().await {
                if !matches!(r, Ok(Ok(_))) {
                    errors += 1;
                }
            }
            let offered_secs = start.elapsed().as_secs_f64();
            let recs = reader
                .collect(total, Duration::from_secs(60), |r| sent.contains_key(&r.id))
                .await;
            let cpu = mark.since(self.broker_pid);
            let consumed: Vec<u64> = recs
                .iter()
                .filter_map(|r| Some((r.consumed_us - sent.get(&r.id)?).max(0) as u64))
                .collect();
            let mut notes = vec![format!(
                "offered {total} in {offered_secs:.1} s; latency = send → record consumed back"
            )];
            if recs.len() < total || errors > 0 {
                notes.push(format!(
                    "{} of {total} read back; {errors} produce errors",
                    recs.len()
                ));
            }
            rows.push(Row {
                name: format!("raw-e2e-{rate}-per-s"),
                events: recs.len() as u64,
                secs: offered_secs,
                latency: latency(consumed),
                peak_rss_mb: mb(status_kb("VmHWM:")),
                cpu,
                baseline: None,
                notes,
                ..Default::default()
            });
        }
        Ok(rows)
    }
}

//! Scale-out (issue 15): the relay drain of one backlog, and the intake, with 1, 2 and 3
//! mailroom instances over one PostgreSQL database. The instances run in this
//! process, each a whole `App` with its own pools and producer: on a 2-core machine,
//! separate processes would add no CPU, only address spaces.

use super::*;

impl Bench {
    /// For each instance count, a fresh database with `events` pending over 1,000 keys,
    /// drained by that many instances at once; the clock runs from their start until
    /// nothing is pending.
    pub(crate) async fn scale(&self, events: usize) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for instances in 1..=3usize {
            let (db, url) = self.dbs.fresh().await?;
            let topic = self.topic(&format!("scale_{instances}"));
            {
                let store = PgStore::connect(&url, 2).await?;
                for start in (0..events).step_by(1000) {
                    let chunk: Vec<NewEvent> = (start..(start + 1000).min(events))
                        .map(|j| new_event(&topic, key(j, KEYS), &self.payload))
                        .collect();
                    store.enqueue(&chunk, false).await?;
                }
                sqlx::query("ANALYZE").execute(store.pool()).await?;
                store.pool().close().await;
            }
            let mark = CpuMark::take(self.broker_pid);
            let start = Instant::now();
            let mut apps = Vec::with_capacity(instances);
            for _ in 0..instances {
                let config = mailroom_config(&url, &self.brokers, 2)?;
                apps.push(App::start(config, CancellationToken::new()).await?);
            }
            let limit = Duration::from_secs(60) + Duration::from_millis(events as u64 * 10);
            let mut pending = i64::MAX;
            while pending > 0 && start.elapsed() < limit {
                tokio::time::sleep(Duration::from_millis(5)).await;
                pending = apps[0]
                    .store
                    .count_events(BoxKind::Outbox, Some(Status::Pending))
                    .await?;
            }
            let elapsed = start.elapsed();
            let cpu = mark.since(self.broker_pid);
            let per_instance: Vec<String> = apps
                .iter()
                .map(|a| {
                    let n: u64 = a
                        .relay_stats
                        .iter()
                        .map(|s| s.delivered.load(Ordering::Relaxed))
                        .sum();
                    n.to_string()
                })
                .collect();
            for app in apps {
                app.stop().await?;
            }
            self.dbs.drop_db(&db).await;
            let mut notes = vec![
                format!("{events} events / {KEYS} keys, {instances} instance(s) × 2 relays"),
                format!("delivered per instance: {}", per_instance.join(" / ")),
            ];
            if pending > 0 {
                notes.push(format!("NOT DRAINED: {pending} pending"));
            }
            rows.push(Row {
                name: format!("scale-{instances}-instance"),
                events: events as u64,
                secs: elapsed.as_secs_f64(),
                cpu,
                baseline: Some("raw-kafka-1000-keys"),
                notes,
                ..Default::default()
            });
        }
        Ok(rows)
    }

    /// The intake with 1, 2 and 3 instances (relays off) over one fresh database each:
    /// unary `Enqueue` from 64 clients and `EnqueueBatch` of 100 from 16, the clients
    /// spread round robin over the instances, closed loop for the timed duration.
    pub(crate) async fn scale_intake(&self) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for (clients, batch) in [(64usize, 1usize), (BATCH_CLIENTS, BATCH)] {
            for instances in 1..=3usize {
                let (db, url) = self.dbs.fresh().await?;
                let mut apps = Vec::with_capacity(instances);
                let mut chans = Vec::new();
                for _ in 0..instances {
                    let app = App::start(
                        mailroom_config(&url, &self.brokers, 0)?,
                        CancellationToken::new(),
                    )
                    .await?;
                    chans.push(channels(app.addr, clients.div_ceil(instances).min(64)).await?);
                    apps.push(app);
                }
                // Client c talks to instance c % instances, over that instance's channels.
                let clients_v: Arc<Vec<pb::outbox_service_client::OutboxServiceClient<Channel>>> =
                    Arc::new(
                        (0..clients)
                            .map(|c| {
                                let mine = &chans[c % instances];
                                pb::outbox_service_client::OutboxServiceClient::new(
                                    mine[(c / instances) % mine.len()].clone(),
                                )
                            })
                            .collect(),
                    );
                let topic: Arc<str> = self.topic("scale-intake").into();
                let payload: Arc<[u8]> = self.payload.clone().into();
                let stats_pool = sqlx::PgPool::connect(&url).await?;
                let c0 = commits(&stats_pool, &db).await;
                let mark = CpuMark::take(self.broker_pid);
                let (cv, t, pl) = (clients_v.clone(), topic.clone(), payload.clone());
                let load = drive(clients, self.sizes.duration, move |c, seq| {
                    let mut client = cv[c].clone();
                    let events: Vec<pb::Event> = (0..batch)
                        .map(|i| pb_event(&t, key(c * 7919 + seq as usize * batch + i, KEYS), &pl))
                        .collect();
                    async move {
                        let n = events.len() as u64;
                        if n == 1 {
                            let event = events.into_iter().next();
                            client.enqueue(pb::EnqueueRequest { event }).await?;
                        } else {
                            client
                                .enqueue_batch(pb::EnqueueBatchRequest { events })
                                .await?;
                        }
                        Ok(n)
                    }
                })
                .await;
                let (name, baseline) = if batch == 1 {
                    (
                        format!("scale-enqueue-c{clients}-{instances}-instance"),
                        "raw-pg-1-row-per-tx-c64",
                    )
                } else {
                    (
                        format!("scale-batch-100-{instances}-instance"),
                        "raw-pg-100-rows-per-stmt-c16",
                    )
                };
                let mut row = load_row(&name, load, mark.since(self.broker_pid), Some(baseline));
                tokio::time::sleep(Duration::from_millis(600)).await; // let backends flush their stats
                let commits = commits(&stats_pool, &db).await - c0;
                stats_pool.close().await;
                row.notes.push(format!(
                    "{clients} clients over {instances} instance(s), relays off; {commits} commits, ≈{:.1} events/commit",
                    row.events as f64 / commits.max(1) as f64
                ));
                rows.push(row);
                for app in apps {
                    app.stop().await?;
                }
                self.dbs.drop_db(&db).await;
            }
        }
        Ok(rows)
    }
}

//! Intake: `Enqueue` at several client counts and `EnqueueBatch`.

use super::*;

impl Bench {
    /// `Enqueue` unary over gRPC, closed loop, at each concurrency level; relays off so
    /// that intake is measured alone. Connections: one per client up to 64, then shared.
    pub(crate) async fn enqueue(&self) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        let levels = ENQUEUE_LEVELS
            .iter()
            .map(|&c| (c, None))
            .chain([(64, Some(diag_writers()))]);
        for (clients, writers) in levels {
            let (db, url) = self.dbs.fresh().await?;
            let mut config = mailroom_config(&url, &self.brokers, 0)?;
            if let Some(w) = writers {
                config.intake.writers = w;
            }
            let app = App::start(config, CancellationToken::new()).await?;
            let stats_pool = sqlx::PgPool::connect(&url).await?;
            let chans = channels(app.addr, clients.min(64)).await?;
            let clients_v: Arc<Vec<pb::outbox_service_client::OutboxServiceClient<Channel>>> =
                Arc::new(
                    (0..clients)
                        .map(|c| {
                            pb::outbox_service_client::OutboxServiceClient::new(
                                chans[c % chans.len()].clone(),
                            )
                        })
                        .collect(),
                );
            let topic: Arc<str> = self.topic("enqueue").into();
            let payload: Arc<[u8]> = self.payload.clone().into();
            let c0 = commits(&stats_pool, &db).await;
            let mark = CpuMark::take(self.broker_pid);
            reset_peak_rss();
            let (cv, t, pl) = (clients_v.clone(), topic.clone(), payload.clone());
            let load = drive(clients, self.sizes.duration, move |c, seq| {
                let mut client = cv[c].clone();
                let e = pb_event(&t, key(c * 7919 + seq as usize, KEYS), &pl);
                async move {
                    client
                        .enqueue(pb::EnqueueRequest { event: Some(e) })
                        .await?;
                    Ok(1)
                }
            })
            .await;
            let cpu = mark.since(self.broker_pid);
            tokio::time::sleep(Duration::from_millis(600)).await; // let backends flush their stats
            let commits = commits(&stats_pool, &db).await - c0;
            let name = match writers {
                None => format!("enqueue-c{clients}"),
                Some(w) => format!("diag-enqueue-c{clients}-writers{w}"),
            };
            let mut row = load_row(&name, load, cpu, Some("raw-pg-1-row-per-tx-c64"));
            if commits > 0 {
                row.notes.push(format!(
                    "{commits} commits, ≈{:.1} events/commit",
                    row.events as f64 / commits as f64
                ));
            }
            row.notes.push(key_churn(&stats_pool).await);
            rows.push(row);
            stats_pool.close().await;
            app.stop().await?;
            self.dbs.drop_db(&db).await;
        }
        Ok(rows)
    }

    /// `EnqueueBatch` of 100 events from 16 clients, closed loop, relays off.
    pub(crate) async fn batch(&self) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for writers in [None, Some(diag_writers())] {
            rows.push(self.batch_with(writers).await?);
        }
        Ok(rows)
    }

    pub(crate) async fn batch_with(&self, writers: Option<usize>) -> anyhow::Result<Row> {
        let (db, url) = self.dbs.fresh().await?;
        let name = match writers {
            None => "batch-100".to_string(),
            Some(w) => format!("diag-batch-100-writers{w}"),
        };
        let row = self.batch_on(&name, writers, &url).await;
        self.dbs.drop_db(&db).await;
        row
    }

    /// [`Bench::batch_with`] into the database at `url`, whatever it already holds.
    pub(crate) async fn batch_on(
        &self,
        name: &str,
        writers: Option<usize>,
        url: &str,
    ) -> anyhow::Result<Row> {
        let mut config = mailroom_config(url, &self.brokers, 0)?;
        if let Some(w) = writers {
            config.intake.writers = w;
        }
        let app = App::start(config, CancellationToken::new()).await?;
        let chans = channels(app.addr, BATCH_CLIENTS).await?;
        let clients_v: Arc<Vec<_>> = Arc::new(
            chans
                .into_iter()
                .map(pb::outbox_service_client::OutboxServiceClient::new)
                .collect(),
        );
        let topic: Arc<str> = self.topic("batch").into();
        let payload: Arc<[u8]> = self.payload.clone().into();
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let (cv, t, pl) = (clients_v.clone(), topic.clone(), payload.clone());
        let load = drive(BATCH_CLIENTS, self.sizes.duration, move |c, seq| {
            let mut client: pb::outbox_service_client::OutboxServiceClient<Channel> = cv[c].clone();
            let events: Vec<pb::Event> = (0..BATCH)
                .map(|i| pb_event(&t, key(c * 7919 + seq as usize * BATCH + i, KEYS), &pl))
                .collect();
            async move {
                let r = client
                    .enqueue_batch(pb::EnqueueBatchRequest { events })
                    .await?;
                Ok(r.into_inner().results.len() as u64)
            }
        })
        .await;
        let mut row = load_row(
            name,
            load,
            mark.since(self.broker_pid),
            Some("raw-pg-100-rows-per-stmt-c16"),
        );
        row.notes
            .push(format!("{BATCH_CLIENTS} clients; latency per call"));
        tokio::time::sleep(Duration::from_millis(600)).await; // let backends flush their stats
        if let Ok(pool) = sqlx::PgPool::connect(url).await {
            row.notes.push(key_churn(&pool).await);
            pool.close().await;
        }
        app.stop().await?;
        Ok(row)
    }
}

//! Reads that filter by status over a long history (issue 24, item 3): `GetStats`,
//! `ListEvents(status = failed)` and `RequeueFailed` by filter (a dry run, so every
//! call selects the same events) against 1,000,000 retained completed events and 1,000
//! failed ones, with default settings and relays off. The history is generated in SQL
//! the way the relays leave it: per key, events published by the cursor (rows still
//! `pending` at or below `published_through`, one `outbox_publishes` row per advance of
//! 100 events), and one failed event every 1,001 ids.

use super::*;

/// Calls per read.
const CALLS: usize = 200;

impl Bench {
    pub(crate) async fn status_reads(&self) -> anyhow::Result<Vec<Row>> {
        let (db, url) = self.dbs.fresh().await?;
        let completed = self.sizes.pending_events;
        let failed = completed / 1000;
        let keys = KEYS as i64;
        let topic = self.topic("reads");
        let prep = Instant::now();
        {
            let pool = sqlx::PgPool::connect(&url).await?;
            sqlx::query(
                "INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                     max_attempts, scheduled_at, status, attempts, last_error, created_at,
                     updated_at, published_at)
                 SELECT $1, 'key-' || (i % $3), $4, '{}'::jsonb, $5, 6, now() - interval '1 hour',
                        CASE WHEN i % 1001 = 1000 THEN 'failed' ELSE 'pending' END,
                        CASE WHEN i % 1001 = 1000 THEN 6 ELSE 0 END,
                        CASE WHEN i % 1001 = 1000 THEN 'broker refused the record' END,
                        now() - interval '1 hour', now() - interval '1 hour', NULL
                 FROM generate_series(0, $2 - 1) AS i ORDER BY i",
            )
            .bind(&topic)
            .bind((completed + failed) as i64)
            .bind(keys)
            .bind(&self.payload)
            .bind(EVENT_TYPE)
            .execute(&pool)
            .await?;
            sqlx::query(
                "INSERT INTO outbox_keys (topic, event_key, ready_at, pending, published_through)
                 SELECT topic, event_key, 'infinity', 0, max(id) FROM outbox_events GROUP BY 1, 2",
            )
            .execute(&pool)
            .await?;
            // One advance per 100 published events of a key.
            sqlx::query(
                "INSERT INTO outbox_publishes (topic, event_key, through, at, events)
                 SELECT topic, event_key, max(id), now() - interval '1 hour', count(*)
                 FROM (SELECT topic, event_key, id,
                              (row_number() OVER (PARTITION BY topic, event_key ORDER BY id) - 1) / 100 AS run
                       FROM outbox_events WHERE status = 'pending') e
                 GROUP BY topic, event_key, run",
            )
            .execute(&pool)
            .await?;
            sqlx::query("VACUUM ANALYZE").execute(&pool).await?;
            pool.close().await;
        }
        let prep = prep.elapsed();
        let app = App::start(
            mailroom_config(&url, &self.brokers, 0)?,
            CancellationToken::new(),
        )
        .await?;
        let chan = channels(app.addr, 1).await?.remove(0);
        let mut admin = pb::admin_service_client::AdminServiceClient::new(chan);
        let outbox = pb::Box::Outbox as i32;
        let mut rows = Vec::new();

        // Each read is checked on its first answer: a wrong answer measures nothing.
        let stats = admin
            .get_stats(pb::GetStatsRequest {
                r#box: outbox,
                ..Default::default()
            })
            .await?
            .into_inner();
        anyhow::ensure!(
            stats.completed == completed as i64 && stats.failed == failed as i64,
            "GetStats said {} completed, {} failed: not the prepared history",
            stats.completed,
            stats.failed
        );
        let list = pb::ListEventsRequest {
            r#box: outbox,
            status: pb::EventStatus::Failed as i32,
            page_size: 100,
            ..Default::default()
        };
        let page = admin.list_events(list.clone()).await?.into_inner();
        anyhow::ensure!(
            page.events.len() == 100,
            "ListEvents(failed) returned {}",
            page.events.len()
        );
        let requeue = pb::RequeueFailedRequest {
            r#box: outbox,
            filter: Some(pb::EventFilter {
                topic: topic.clone(),
                ..Default::default()
            }),
            limit: 1000,
            dry_run: true,
            ..Default::default()
        };
        let dry = admin.requeue_failed(requeue.clone()).await?.into_inner();
        anyhow::ensure!(
            dry.count == failed as i64,
            "RequeueFailed (dry run) selected {}",
            dry.count
        );

        for name in ["get-stats", "list-events-failed", "requeue-by-filter"] {
            let mark = CpuMark::take(self.broker_pid);
            reset_peak_rss();
            let mut lat = Vec::with_capacity(CALLS);
            let start = Instant::now();
            for _ in 0..CALLS {
                let t = Instant::now();
                match name {
                    "get-stats" => {
                        admin
                            .get_stats(pb::GetStatsRequest {
                                r#box: outbox,
                                ..Default::default()
                            })
                            .await?;
                    }
                    "list-events-failed" => {
                        admin.list_events(list.clone()).await?;
                    }
                    _ => {
                        admin.requeue_failed(requeue.clone()).await?;
                    }
                }
                lat.push(t.elapsed().as_micros() as u64);
            }
            rows.push(Row {
                name: format!("status-reads {name}"),
                events: CALLS as u64,
                secs: start.elapsed().as_secs_f64(),
                latency: latency(lat),
                peak_rss_mb: mb(status_kb("VmHWM:")),
                cpu: mark.since(self.broker_pid),
                baseline: None,
                notes: vec![format!(
                    "{completed} completed + {failed} failed retained, {KEYS} keys (prepared in SQL in {:.0} s); {CALLS} calls over gRPC",
                    prep.as_secs_f64()
                )],
                wal_bytes: None,
            });
        }
        app.stop().await?;
        self.dbs.drop_db(&db).await;
        Ok(rows)
    }
}

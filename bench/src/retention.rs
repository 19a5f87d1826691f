//! Retention of a "day" of completed events (issue 15), at two volumes: the events are
//! enqueued, published by the relays against the broker, then aged by 8 days, and
//! mailroom's retention (`RetentionStore::purge` and `prune_idle_keys`, batches of
//! 1,000, no pause between them) deletes them all. Two floors over copies of the same
//! rows, measured in the same run: a raw batched `DELETE` of 1,000 rows by id, and a
//! `DROP TABLE`, what dropping a time partition would cost. Each measured step starts
//! after a `CHECKPOINT`.

use super::*;
use mailroom::store::retention::{Finished, RetentionStore};
use sqlx::AssertSqlSafe;

/// Rows per retention batch (mailroom's default).
const RETENTION_BATCH: u32 = 1000;
/// The age retention is given; the events are aged past it.
const SEVEN_DAYS: Duration = Duration::from_secs(7 * 24 * 3600);

/// Time and WAL of one step.
struct Cost {
    elapsed: Duration,
    wal: i64,
}

/// The cost of `step`, after a checkpoint, with what it returned.
async fn cost_of<T, Fut>(pool: &sqlx::PgPool, step: Fut) -> anyhow::Result<(Cost, T)>
where
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    sqlx::query("CHECKPOINT").execute(pool).await?;
    let before: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?;
    let start = Instant::now();
    let out = step.await?;
    let elapsed = start.elapsed();
    let wal: i64 =
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::int8")
            .bind(&before)
            .fetch_one(pool)
            .await?;
    Ok((Cost { elapsed, wal }, out))
}

fn cost_row(name: String, events: u64, c: &Cost, notes: Vec<String>) -> Row {
    let mut all = vec![
        format!(
            "{:.2} µs/event, {:.0} WAL bytes/event",
            c.elapsed.as_secs_f64() * 1e6 / events.max(1) as f64,
            c.wal as f64 / events.max(1) as f64
        ),
        format!("{:.1} ms in all", c.elapsed.as_secs_f64() * 1e3),
    ];
    all.extend(notes);
    Row {
        name,
        events,
        secs: c.elapsed.as_secs_f64(),
        notes: all,
        wal_bytes: Some(c.wal),
        ..Default::default()
    }
}

impl Bench {
    /// One volume: fill, publish, age, then the floors and mailroom's retention.
    async fn retention_at(&self, volume: usize) -> anyhow::Result<Vec<Row>> {
        let (db, url) = self.dbs.fresh().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await?;
        let topic = self.topic(&format!("retention-{volume}"));
        let store = PgStore::connect(&url, 2).await?;
        for chunk in 0..volume / BATCH {
            let events: Vec<NewEvent> = (0..BATCH)
                .map(|i| new_event(&topic, key(chunk * BATCH + i, KEYS), &self.payload))
                .collect();
            store.enqueue(&events, false).await?;
        }
        let app = App::start(
            mailroom_config(&url, &self.brokers, 2)?,
            CancellationToken::new(),
        )
        .await?;
        wait_drained(&app, Duration::from_secs(300)).await?;
        let limit = Instant::now() + Duration::from_secs(60);
        // Then until the relays have let every key go idle (released with nothing
        // left), as a running service does: only idle key rows are pruned.
        loop {
            let busy: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_keys WHERE ready_at <> 'infinity' OR lease_token IS NOT NULL",
            )
            .fetch_one(&pool)
            .await?;
            if busy == 0 {
                break;
            }
            anyhow::ensure!(Instant::now() < limit, "{busy} keys still not idle");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        app.stop().await?;
        // A day older than the retention age: the advances' times and any row-settled
        // completion (the relays settle some rows one by one, e.g. a run's tail).
        sqlx::query("UPDATE outbox_publishes SET at = at - interval '8 days'")
            .execute(&pool)
            .await?;
        sqlx::query(
            "UPDATE outbox_events SET published_at = published_at - interval '8 days'
             WHERE status = 'completed'",
        )
        .execute(&pool)
        .await?;
        for copy in ["raw_delete", "raw_drop"] {
            sqlx::query(AssertSqlSafe(format!(
                "CREATE TABLE {copy} (LIKE outbox_events INCLUDING ALL)"
            )))
            .execute(&pool)
            .await?;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {copy} OVERRIDING SYSTEM VALUE SELECT * FROM outbox_events"
            )))
            .execute(&pool)
            .await?;
        }
        sqlx::query("VACUUM ANALYZE").execute(&pool).await?;

        let (raw_delete, ()) = cost_of(&pool, async {
            loop {
                let n = sqlx::query(
                    "DELETE FROM raw_delete WHERE id IN (
                         SELECT id FROM raw_delete ORDER BY id LIMIT 1000)",
                )
                .execute(&pool)
                .await?
                .rows_affected();
                if n < 1000 {
                    return Ok(());
                }
            }
        })
        .await?;
        let (raw_drop, ()) = cost_of(&pool, async {
            sqlx::query("DROP TABLE raw_drop").execute(&pool).await?;
            Ok(())
        })
        .await?;
        let (retention, (deleted, batches, pruned)) = cost_of(&pool, async {
            let (mut deleted, mut batches, mut pruned) = (0u64, 0u32, 0u64);
            loop {
                let n = store
                    .purge(Finished::Completed, SEVEN_DAYS, RETENTION_BATCH)
                    .await?;
                deleted += n;
                batches += 1;
                if n < u64::from(RETENTION_BATCH) {
                    break;
                }
            }
            loop {
                let n = store.prune_idle_keys(RETENTION_BATCH).await?;
                pruned += n;
                if n < u64::from(RETENTION_BATCH) {
                    return Ok((deleted, batches, pruned));
                }
            }
        })
        .await?;
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events")
            .fetch_one(&pool)
            .await?;
        store.pool().close().await;
        pool.close().await;
        self.dbs.drop_db(&db).await;
        anyhow::ensure!(
            deleted == volume as u64 && left == 0,
            "retention deleted {deleted} of {volume} events; {left} left"
        );

        let x = |c: &Cost| {
            format!(
                "{:.1}× the raw delete's time",
                c.elapsed.as_secs_f64() / raw_delete.elapsed.as_secs_f64().max(1e-9)
            )
        };
        let v = volume as u64;
        Ok(vec![
            cost_row(
                format!("retention-{volume}-raw-delete"),
                v,
                &raw_delete,
                vec![],
            ),
            cost_row(
                format!("retention-{volume}-drop"),
                v,
                &raw_drop,
                vec!["a partition drop's floor".into()],
            ),
            cost_row(
                format!("retention-{volume}"),
                v,
                &retention,
                vec![
                    x(&retention),
                    format!("{deleted} events in {batches} batches, {pruned} idle keys pruned"),
                ],
            ),
        ])
    }

    /// Retention at `volumes[0]` and at `volumes[1]` events (the second 5× the first):
    /// a cost independent of the volume would be the same at both.
    pub(crate) async fn retention(&self, volumes: [usize; 2]) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for v in volumes {
            rows.extend(self.retention_at(v).await?);
        }
        Ok(rows)
    }
}

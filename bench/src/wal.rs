//! WAL written per event (issue 15): the same rows inserted raw, then enqueued through
//! the store and published by the relays, each measured by the server's WAL position.
//! The raw insert and the enqueue each start after a `CHECKPOINT`; the publish follows
//! its enqueue in the same checkpoint cycle, as it does in service.

use super::*;
use crate::baselines::raw_insert;

/// Events per step: enough to make per-event figures stable, few enough to stay short.
const WAL_EVENTS: usize = 20_000;

/// The cluster's WAL position.
async fn wal_lsn(pool: &sqlx::PgPool) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?)
}

/// What one step wrote to the WAL.
struct Wal {
    bytes: i64,
    elapsed: Duration,
    /// Per event, by resource manager (`pg_walinspect`), largest first; empty when the
    /// extension is not available.
    split: String,
}

/// The WAL `step` writes; from a fresh checkpoint when `checkpoint` (a step that
/// follows another in the same checkpoint cycle, as a publish follows its enqueue within
/// seconds, goes without, so that it pays full-page images only where that would).
async fn wal_of<F, Fut>(pool: &sqlx::PgPool, checkpoint: bool, step: F) -> anyhow::Result<Wal>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    if checkpoint {
        sqlx::query("CHECKPOINT").execute(pool).await?;
    }
    let before = wal_lsn(pool).await?;
    let start = Instant::now();
    step().await?;
    let elapsed = start.elapsed();
    let after = wal_lsn(pool).await?;
    let bytes: i64 = sqlx::query_scalar("SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)::int8")
        .bind(&before)
        .bind(&after)
        .fetch_one(pool)
        .await?;
    let split: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT \"resource_manager/record_type\", record_size::int8, fpi_size::int8
         FROM pg_get_wal_stats($1::pg_lsn, $2::pg_lsn, false)
         WHERE count > 0 ORDER BY combined_size DESC LIMIT 4",
    )
    .bind(&before)
    .bind(&after)
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    let per = |b: i64| b as f64 / WAL_EVENTS as f64;
    let split = split
        .iter()
        .map(|(rm, rec, fpi)| format!("{rm} {:.0} + FPI {:.0}", per(*rec), per(*fpi)))
        .collect::<Vec<_>>()
        .join(", ");
    Ok(Wal {
        bytes,
        elapsed,
        split,
    })
}

fn wal_row(name: &str, w: &Wal, notes: Vec<String>) -> Row {
    let mut all = vec![format!(
        "{:.0} WAL bytes/event ({} bytes for {WAL_EVENTS} events)",
        w.bytes as f64 / WAL_EVENTS as f64,
        w.bytes
    )];
    if !w.split.is_empty() {
        all.push(format!("by record, bytes/event: {}", w.split));
    }
    all.extend(notes);
    let elapsed = w.elapsed;
    Row {
        name: name.into(),
        events: WAL_EVENTS as u64,
        secs: elapsed.as_secs_f64(),
        notes: all,
        wal_bytes: Some(w.bytes),
        ..Default::default()
    }
}

impl Bench {
    /// WAL per event: a raw multi-row insert into a copy of `outbox_events` (same
    /// columns and indexes), mailroom's enqueue (groups of 100, as the intake commits
    /// them), and the relays' publish of the same events (claim, settle, key rows).
    /// Nothing else writes to the cluster while a step runs.
    pub(crate) async fn wal(&self) -> anyhow::Result<Vec<Row>> {
        let (db, url) = self.dbs.fresh().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await?;
        sqlx::query("CREATE TABLE raw_events (LIKE outbox_events INCLUDING ALL)")
            .execute(&pool)
            .await?;
        // The breakdown by record type needs a superuser; without it the totals stand alone.
        if let Err(e) = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            .execute(&pool)
            .await
        {
            eprintln!("wal: no pg_walinspect ({e}); totals only");
        }
        let topic = self.topic("wal");

        let raw = wal_of(&pool, true, || async {
            for chunk in 0..WAL_EVENTS / BATCH {
                let keys: Vec<String> = (0..BATCH).map(|i| key(chunk * BATCH + i, KEYS)).collect();
                raw_insert(&pool, &topic, &keys, &self.payload).await?;
            }
            Ok(())
        })
        .await?;

        let store = PgStore::connect(&url, 2).await?;
        let enqueued = wal_of(&pool, true, || async {
            for chunk in 0..WAL_EVENTS / BATCH {
                let events: Vec<NewEvent> = (0..BATCH)
                    .map(|i| new_event(&topic, key(chunk * BATCH + i, KEYS), &self.payload))
                    .collect();
                store.enqueue(&events, false).await?;
            }
            Ok(())
        })
        .await?;
        store.pool().close().await;

        let config = mailroom_config(&url, &self.brokers, 2)?;
        let published = wal_of(&pool, false, || async {
            let app = App::start(config, CancellationToken::new()).await?;
            wait_drained(&app, Duration::from_secs(120)).await?;
            app.stop().await?;
            Ok(())
        })
        .await?;
        pool.close().await;
        self.dbs.drop_db(&db).await;

        let per = |b: i64| b as f64 / WAL_EVENTS as f64;
        let ratio = |b: i64| {
            format!(
                "{:.2}× the raw insert's WAL",
                b as f64 / raw.bytes.max(1) as f64
            )
        };
        let total = Wal {
            bytes: enqueued.bytes + published.bytes,
            elapsed: enqueued.elapsed + published.elapsed,
            split: String::new(),
        };
        Ok(vec![
            wal_row("wal-raw-insert-100", &raw, vec![]),
            wal_row("wal-enqueue-100", &enqueued, vec![ratio(enqueued.bytes)]),
            wal_row(
                "wal-publish",
                &published,
                vec![format!(
                    "{:.0} bytes/event on top of the enqueue",
                    per(published.bytes)
                )],
            ),
            wal_row("wal-enqueue+publish", &total, vec![ratio(total.bytes)]),
        ])
    }
}

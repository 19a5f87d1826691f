//! A week of history (issue 46, item 1): the operator reads and the readiness check
//! against a database that holds what a week of production leaves behind, with default
//! settings and relays off. `history_events` events over a tenth as many keys (10 per
//! key), generated in SQL the way the relays leave them: published by the per-key
//! cursor (rows still `pending` at or below `published_through`, one `outbox_publishes`
//! row per key, spread over the last 7 days), one failed event in 1,001, and a backlog
//! of 100 keys with 20 events each above their cursors. The reads run over gRPC as
//! shipped; the statements that changed (the key reads of `GetStats` and the readiness
//! check, and a key-pruning call) also run as main had them before issue 46, in the same
//! database, so the ratio needs no second build.

use super::*;

/// Calls per read.
const CALLS: usize = 200;
/// Calls of a key-pruning round's statement.
const PRUNE_CALLS: usize = 20;

/// The idle-key pruning statement of main before issue 46 (`prune_idle_keys`), run as it
/// was for the comparison: it read every idle key and probed its line each call.
const PRUNE_BEFORE: &str = "WITH gone AS (
         DELETE FROM outbox_keys WHERE (topic, event_key) IN (
             SELECT k.topic, k.event_key FROM outbox_keys k
             WHERE k.ready_at = 'infinity' AND k.lease_token IS NULL AND k.pending = 0
               AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.status = 'pending'
                               AND e.topic = k.topic AND e.event_key = k.event_key)
             LIMIT $1
             FOR UPDATE SKIP LOCKED)
         AND ready_at = 'infinity' AND lease_token IS NULL AND pending = 0
         RETURNING topic, event_key),
     logs AS (
         DELETE FROM outbox_publishes l USING gone g
         WHERE l.topic = g.topic AND l.event_key = g.event_key)
     SELECT count(*) FROM gone";
/// Keys with a backlog, and the events each holds.
const BACKLOG_KEYS: i64 = 100;
const BACKLOG_EACH: i64 = 20;
/// Rounds of intake and drain, beside the history and in an empty database.
const HOT_ROUNDS: usize = 3;
/// Keys whose cursor stopped a week ago: all their retained events are pending.
const STUCK_KEYS: i64 = 100;

/// How `ListEvents` found pending events before issue 46: walking ids down through the
/// view (one page past the backlog).
const PENDING_BEFORE: &str = "SELECT id FROM outbox_events_view
     WHERE status = 'pending' AND id < $1 ORDER BY id DESC LIMIT 51";

impl Bench {
    pub(crate) async fn history(&self) -> anyhow::Result<Vec<Row>> {
        let (db, url) = self.dbs.fresh().await?;
        let events = self.sizes.history_events as i64;
        let keys = (events / 10).max(1);
        let topic = self.topic("history");
        let prep = Instant::now();
        let pool = sqlx::PgPool::connect(&url).await?;
        sqlx::query(
            "INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                 max_attempts, scheduled_at, status, attempts, last_error, created_at,
                 updated_at, published_at)
             SELECT $1, 'key-' || (i % $3), $4, '{}'::jsonb, $5, 6, t, 
                    CASE WHEN i % 1001 = 1000 THEN 'failed' ELSE 'pending' END,
                    CASE WHEN i % 1001 = 1000 THEN 6 ELSE 0 END,
                    CASE WHEN i % 1001 = 1000 THEN 'broker refused the record' END,
                    t, t, NULL
             FROM generate_series(0, $2 - 1) AS i,
                  LATERAL (SELECT now() - interval '7 days' * (1 - i::float8 / $2) AS t) w
             ORDER BY i",
        )
        .bind(&topic)
        .bind(events)
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
        sqlx::query(
            "INSERT INTO outbox_publishes (topic, event_key, through, at, events)
             SELECT topic, event_key, max(id), max(created_at), count(*)
             FROM outbox_events WHERE status = 'pending' GROUP BY topic, event_key",
        )
        .execute(&pool)
        .await?;
        // The backlog: events above the cursors of 100 keys (the triggers count them).
        sqlx::query(
            "INSERT INTO outbox_events (topic, event_key, payload, max_attempts, scheduled_at)
             SELECT $1, 'key-' || (k * 997 % $2), $3, 6, now() + interval '1 hour'
             FROM generate_series(1, $4) AS k, generate_series(1, $5) AS n ORDER BY n, k",
        )
        .bind(&topic)
        .bind(keys)
        .bind(&self.payload)
        .bind(BACKLOG_KEYS)
        .bind(BACKLOG_EACH)
        .execute(&pool)
        .await?;
        // The enqueue's key upsert counts them (the insert trigger counts only events
        // with an idempotency key): done here as the enqueue does it.
        sqlx::query(
            "UPDATE outbox_keys k SET pending = k.pending + b.n, ready_at = LEAST(k.ready_at, b.at)
             FROM (SELECT e.topic, e.event_key, count(*) AS n, min(e.scheduled_at) AS at
                   FROM outbox_events e JOIN outbox_keys k
                     ON k.topic = e.topic AND k.event_key = e.event_key
                   WHERE e.status = 'pending' AND e.id > k.published_through
                   GROUP BY 1, 2) b
             WHERE k.topic = b.topic AND k.event_key = b.event_key",
        )
        .execute(&pool)
        .await?;
        // Stuck keys: cursors lowered below all their events (a key that stopped a week
        // ago), so their pending events lie spread over the whole history.
        sqlx::query(
            "WITH s AS (SELECT topic, event_key FROM outbox_keys WHERE pending = 0
                        ORDER BY hashtext(event_key) LIMIT $1),
                  gone AS (DELETE FROM outbox_publishes p USING s
                           WHERE p.topic = s.topic AND p.event_key = s.event_key)
             UPDATE outbox_keys k SET published_through = l.first - 1, pending = l.n,
                    ready_at = now() + interval '1 hour'
             FROM s, LATERAL (SELECT min(id) AS first, count(*) AS n
                              FROM outbox_events e
                              WHERE e.status = 'pending' AND e.topic = s.topic
                                AND e.event_key = s.event_key) l
             WHERE k.topic = s.topic AND k.event_key = s.event_key",
        )
        .bind(STUCK_KEYS)
        .execute(&pool)
        .await?;
        sqlx::query("VACUUM ANALYZE").execute(&pool).await?;
        let prep = prep.elapsed();
        let pending_total: i64 =
            sqlx::query_scalar("SELECT sum(pending)::int8 FROM outbox_keys WHERE pending > 0")
                .fetch_one(&pool)
                .await?;
        let backlog_top: i64 = sqlx::query_scalar(
            "SELECT min(e.id) FROM outbox_events e JOIN outbox_keys k
               ON k.topic = e.topic AND k.event_key = e.event_key
             WHERE e.scheduled_at > now() + interval '30 minutes' AND e.id > k.published_through
               AND e.created_at > now() - interval '1 hour'",
        )
        .fetch_one(&pool)
        .await?;
        let with_backlog: i64 =
            sqlx::query_scalar("SELECT count(*) FROM outbox_keys WHERE pending > 0")
                .fetch_one(&pool)
                .await?;
        anyhow::ensure!(
            with_backlog == BACKLOG_KEYS + STUCK_KEYS,
            "{with_backlog} keys with a backlog, not {}",
            BACKLOG_KEYS + STUCK_KEYS
        );

        let app = App::start(
            mailroom_config(&url, &self.brokers, 0)?,
            CancellationToken::new(),
        )
        .await?;
        let chan = channels(app.addr, 1).await?.remove(0);
        let mut admin = pb::admin_service_client::AdminServiceClient::new(chan);
        let outbox = pb::Box::Outbox as i32;
        let stats = pb::GetStatsRequest {
            r#box: outbox,
            ..Default::default()
        };
        let pending = |order: pb::PendingOrder| pb::ListPendingRequest {
            r#box: outbox,
            page_size: 50,
            order: order as i32,
            ..Default::default()
        };
        // Each read is checked on its first answer: a wrong answer measures nothing.
        let s = admin.get_stats(stats.clone()).await?.into_inner();
        anyhow::ensure!(
            s.pending == pending_total && s.oldest_pending_age.is_some(),
            "GetStats said {} pending: not the prepared backlog",
            s.pending
        );
        let page = admin
            .list_pending(pending(pb::PendingOrder::MostPending))
            .await?
            .into_inner();
        anyhow::ensure!(
            page.keys.len() == 50,
            "ListPending returned {} keys",
            page.keys.len()
        );

        let mut rows = Vec::new();
        let note = format!(
            "{events} events retained over {keys} keys, {BACKLOG_KEYS} keys with \
             {BACKLOG_EACH} new events pending each, {STUCK_KEYS} keys stuck for the week \
             ({pending_total} pending in all; prepared in SQL in {:.0} s)",
            prep.as_secs_f64()
        );
        let listing = self
            .history_listings(&mut admin, &pool, backlog_top, &note)
            .await?;
        for name in ["get-stats", "list-pending-most", "list-pending-oldest"] {
            let row = self
                .timed_row(
                    format!("history {name} (gRPC)"),
                    CALLS,
                    format!(
                        "{note}; {CALLS} calls over gRPC; GetStats is also the readiness lag check's read"
                    ),
                    || {
                        let (mut admin, stats) = (admin.clone(), stats.clone());
                        let order = match name {
                            "list-pending-most" => pb::PendingOrder::MostPending,
                            _ => pb::PendingOrder::Oldest,
                        };
                        let list = pending(order);
                        async move {
                            if name == "get-stats" {
                                admin.get_stats(stats).await?;
                            } else {
                                admin.list_pending(list).await?;
                            }
                            Ok(())
                        }
                    },
                )
                .await?;
            rows.push(row);
        }
        // The two statements of GetStats (and the readiness check) that read the key
        // rows, as SQL: as shipped, and as main had them before issue 46.
        for (variant, backlog) in [
            ("as shipped", "k.ready_at < 'infinity' AND k.pending > 0"),
            ("main's before issue 46", "k.pending > 0"),
        ] {
            let heads = format!(
                "SELECT count(*) FILTER (WHERE (h.attempts > 0 OR h.last_error IS NOT NULL)
                                          AND h.scheduled_at > now()), min(h.created_at)
                 FROM outbox_keys k CROSS JOIN LATERAL (
                    SELECT attempts, scheduled_at, created_at, last_error FROM outbox_events e
                    WHERE e.status = 'pending' AND e.topic = k.topic
                      AND e.event_key = k.event_key AND e.id > k.published_through
                    ORDER BY e.id LIMIT 1) h
                 WHERE {backlog}"
            );
            let counts = format!(
                "SELECT k.topic, sum(k.pending)::int8 FROM outbox_keys k WHERE {backlog} GROUP BY k.topic"
            );
            let row = self
                .timed_row(
                    format!("history stats key reads (SQL), {variant}"),
                    CALLS,
                    format!("{note}; {CALLS} pairs of statements"),
                    || {
                        let (pool, heads, counts) = (pool.clone(), heads.clone(), counts.clone());
                        async move {
                            let (_, oldest): (i64, Option<chrono::DateTime<chrono::Utc>>) =
                                sqlx::query_as(sqlx::AssertSqlSafe(heads))
                                    .fetch_one(&pool)
                                    .await?;
                            let per_topic: Vec<(String, i64)> =
                                sqlx::query_as(sqlx::AssertSqlSafe(counts))
                                    .fetch_all(&pool)
                                    .await?;
                            anyhow::ensure!(
                                oldest.is_some()
                                    && per_topic.iter().map(|t| t.1).sum::<i64>() == pending_total,
                                "{variant}: not the prepared backlog"
                            );
                            Ok(())
                        }
                    },
                )
                .await?;
            rows.push(row);
        }
        rows.extend(listing);
        rows.extend(self.history_pruning(&app, &pool, events, keys).await?);
        pool.close().await;
        app.stop().await?;
        rows.extend(self.history_hot_paths(&url).await?);
        self.dbs.drop_db(&db).await;
        Ok(rows)
    }

    /// Intake and drain beside the history against the same in an empty database, in
    /// alternating rounds (2 cores: the median round of each is what the docs quote).
    async fn history_hot_paths(&self, url: &str) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for round in 1..=HOT_ROUNDS {
            let (db, empty) = self.dbs.fresh().await?;
            for (place, at) in [
                ("empty database", empty.as_str()),
                ("beside the history", url),
            ] {
                rows.push(
                    self.batch_on(
                        &format!("history batch-100, {place}, round {round}"),
                        None,
                        at,
                    )
                    .await?,
                );
                // The batch's events are not drained: gone before the drain starts (the
                // drain counts every event it delivers).
                let pool = sqlx::PgPool::connect(at).await?;
                let topic = self.topic("batch");
                for table in ["outbox_events", "outbox_keys"] {
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DELETE FROM {table} WHERE topic = $1"
                    )))
                    .bind(&topic)
                    .execute(&pool)
                    .await?;
                }
                sqlx::query("VACUUM outbox_events, outbox_keys")
                    .execute(&pool)
                    .await?;
                pool.close().await;
                rows.push(
                    self.relay_on(
                        &format!("history drain-100k-1000-keys, {place}, round {round}"),
                        100_000,
                        KEYS,
                        at,
                    )
                    .await?,
                );
            }
            self.dbs.drop_db(&db).await;
        }
        Ok(rows)
    }

    /// `ListEvents` over the history: each status, the pending page past the new backlog
    /// (the stuck keys' events, spread over the week), and that page as main read it
    /// before issue 46.
    async fn history_listings(
        &self,
        admin: &mut pb::admin_service_client::AdminServiceClient<tonic::transport::Channel>,
        pool: &sqlx::PgPool,
        backlog_top: i64,
        note: &str,
    ) -> anyhow::Result<Vec<Row>> {
        let list = |status: pb::EventStatus, page_token: String| pb::ListEventsRequest {
            r#box: pb::Box::Outbox as i32,
            status: status as i32,
            page_size: 50,
            page_token,
            ..Default::default()
        };
        // The page token past the backlog: pages of 1,000 until one reaches below it.
        let mut token = String::new();
        loop {
            let mut r = list(pb::EventStatus::Pending, token.clone());
            r.page_size = 1000;
            let page = admin.list_events(r).await?.into_inner();
            anyhow::ensure!(
                !page.events.is_empty(),
                "no pending events past the backlog"
            );
            if page.events.iter().any(|e| e.id < backlog_top) {
                break;
            }
            token = page.next_page_token;
        }
        let deep = admin
            .list_events(list(pb::EventStatus::Pending, token.clone()))
            .await?
            .into_inner();
        anyhow::ensure!(
            deep.events.len() == 50
                && deep
                    .events
                    .iter()
                    .all(|e| e.status == pb::EventStatus::Pending as i32),
            "the deep pending page has {} events",
            deep.events.len()
        );
        let cases = [
            (
                "list-events-pending",
                pb::EventStatus::Pending,
                String::new(),
            ),
            (
                "list-events-pending-past-backlog",
                pb::EventStatus::Pending,
                token,
            ),
            (
                "list-events-completed",
                pb::EventStatus::Completed,
                String::new(),
            ),
            ("list-events-failed", pb::EventStatus::Failed, String::new()),
            (
                "list-events-any",
                pb::EventStatus::Unspecified,
                String::new(),
            ),
        ];
        let mut rows = Vec::new();
        for (name, status, token) in cases {
            let first = admin
                .list_events(list(status, token.clone()))
                .await?
                .into_inner();
            anyhow::ensure!(
                first.events.len() == 50,
                "{name}: {} events",
                first.events.len()
            );
            let row = self
                .timed_row(
                    format!("history {name} (gRPC)"),
                    CALLS,
                    format!("{note}; {CALLS} calls of 50 events over gRPC"),
                    || {
                        let (mut admin, r) = (admin.clone(), list(status, token.clone()));
                        async move {
                            admin.list_events(r).await?;
                            Ok(())
                        }
                    },
                )
                .await?;
            rows.push(row);
        }
        let below = deep.events.first().map_or(backlog_top, |e| e.id + 1);
        let row = self
            .timed_row(
                "history list-events-pending-past-backlog, main's statement before issue 46".into(),
                PRUNE_CALLS,
                format!("{note}; {PRUNE_CALLS} calls of the pending branch as SQL"),
                || {
                    let pool = pool.clone();
                    async move {
                        let ids: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(PENDING_BEFORE))
                            .bind(below)
                            .fetch_all(&pool)
                            .await?;
                        anyhow::ensure!(ids.len() == 51, "before: {} events", ids.len());
                        Ok(())
                    }
                },
            )
            .await?;
        rows.push(row);
        Ok(rows)
    }

    /// A retention round's key pruning over the history, where every idle key still has
    /// retained rows (nothing to prune): mailroom's call as shipped, then main's statement
    /// before issue 46 in the same database.
    async fn history_pruning(
        &self,
        app: &App,
        pool: &sqlx::PgPool,
        events: i64,
        keys: i64,
    ) -> anyhow::Result<Vec<Row>> {
        let mut rows = Vec::new();
        for variant in ["as shipped", "main's statement before issue 46"] {
            let row = self
                .timed_row(
                    format!("history prune-idle-keys, {variant}"),
                    PRUNE_CALLS,
                    format!(
                        "{events} events retained over {keys} keys, none prunable; {PRUNE_CALLS} \
                         calls of a batch of 1,000 (a retention round's last call)"
                    ),
                    || {
                        let (store, pool) = (app.store.clone(), pool.clone());
                        async move {
                            let pruned = if variant == "as shipped" {
                                store.prune_idle_keys(1000).await? as i64
                            } else {
                                sqlx::query_scalar::<_, i64>(PRUNE_BEFORE)
                                    .bind(1000i64)
                                    .fetch_one(&pool)
                                    .await?
                            };
                            anyhow::ensure!(
                                pruned == 0,
                                "{pruned} keys pruned: the history has none to prune"
                            );
                            Ok(())
                        }
                    },
                )
                .await?;
            rows.push(row);
        }
        Ok(rows)
    }

    /// The row of a read timed call by call: `calls` calls of `call`, each call's
    /// microseconds, and the CPU they cost.
    async fn timed_row<F, Fut>(
        &self,
        name: String,
        calls: usize,
        note: String,
        mut call: F,
    ) -> anyhow::Result<Row>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        let mark = CpuMark::take(self.broker_pid);
        let mut lat = Vec::with_capacity(calls);
        let start = Instant::now();
        for _ in 0..calls {
            let t = Instant::now();
            call().await?;
            lat.push(t.elapsed().as_micros() as u64);
        }
        Ok(Row {
            name,
            events: lat.len() as u64,
            secs: start.elapsed().as_secs_f64(),
            latency: latency(lat),
            peak_rss_mb: mb(status_kb("VmHWM:")),
            cpu: mark.since(self.broker_pid),
            baseline: None,
            notes: vec![note],
            wal_bytes: None,
        })
    }
}

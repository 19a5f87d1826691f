//! The SQL API scenario: `mailroom.enqueue` / `enqueue_batch` against the raw inserts of
//! the same rows, with NOTIFY on and off.

use super::*;

impl Bench {
    /// The SQL API (issue 16) against raw inserts, all in one migrated database, 16
    /// connections, no relays: the baselines (a multi-row insert of 100 rows into a copy
    /// of `outbox_events`, and one row per transaction) are measured in the same run, and
    /// so is the gRPC store's own statement (key rows locked, then the events: `keyed`).
    /// `mailroom.enqueue_batch` of 100 events, 100 `mailroom.enqueue` calls in one
    /// statement (keys sorted, as a caller enqueuing several keys should), and one
    /// `mailroom.enqueue` per transaction, from 1 and 16 clients, with and without its
    /// NOTIFY.
    pub(crate) async fn sql_api(&self) -> anyhow::Result<Vec<Row>> {
        const C: usize = 16;
        let (db, url) = self.dbs.fresh().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(C as u32)
            .min_connections(C as u32)
            .connect(&url)
            .await?;
        sqlx::query("CREATE TABLE raw_events (LIKE outbox_events INCLUDING ALL)")
            .execute(&pool)
            .await?;
        let warm: Vec<_> = (0..C).map(|_| pool.acquire()).collect();
        drop(futures::future::try_join_all(warm).await?);
        let topic = self.topic("sql_api");
        let payload: Arc<[u8]> = self.payload.clone().into();
        let keys_of = |c: usize, seq: u64| -> Vec<String> {
            let mut k: Vec<String> = (0..BATCH)
                .map(|i| key(c * 7919 + seq as usize * BATCH + i, KEYS))
                .collect();
            k.sort();
            k
        };
        // The statement the gRPC store runs (src/store/postgres.rs `enqueue`): key rows
        // upserted (locked) in byte order, then the events; the same work as the SQL
        // API minus validation, fingerprints and PL/pgSQL.
        const KEYED: &str = "WITH keys AS (
                INSERT INTO outbox_keys (topic, event_key, ready_at, pending)
                SELECT $1, k, now(), count(*) FROM unnest($2::text[]) AS u(k)
                GROUP BY k ORDER BY k COLLATE \"C\"
                ON CONFLICT (topic, event_key)
                DO UPDATE SET ready_at = LEAST(outbox_keys.ready_at, EXCLUDED.ready_at),
                              pending = outbox_keys.pending + EXCLUDED.pending
                RETURNING 1)
             INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                 max_attempts, scheduled_at)
             SELECT $1, k, p, '{}'::jsonb, $4, 6, now()
             FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS u(k, p, o)
             WHERE (SELECT count(*) FROM keys) >= 0
             ORDER BY o";
        const RAW: &str = "INSERT INTO raw_events (topic, event_key, payload, headers,
                 event_type, max_attempts, scheduled_at)
             SELECT $1, k, p, '{}'::jsonb, $4, 6, now()
             FROM unnest($2::text[], $3::bytea[]) AS u(k, p)";
        // (row name, SQL, events per statement, clients, NOTIFY on, baseline)
        type Spec = (
            &'static str,
            &'static str,
            usize,
            usize,
            bool,
            Option<&'static str>,
        );
        let specs: [Spec; 12] = [
            ("sql-raw-100-rows-per-stmt-c16", RAW, BATCH, C, false, None),
            (
                "sql-keyed-100-rows-per-stmt-c16",
                KEYED,
                BATCH,
                C,
                false,
                Some("sql-raw-100-rows-per-stmt-c16"),
            ),
            (
                "sql-api-enqueue_batch-100-c16",
                "SELECT count(*) FROM mailroom.enqueue_batch(
                     array_fill($1::text, ARRAY[cardinality($2::text[])]), $2::text[],
                     $3::bytea[], NULL, array_fill($4::text, ARRAY[cardinality($2::text[])]))",
                BATCH,
                C,
                true,
                Some("sql-raw-100-rows-per-stmt-c16"),
            ),
            (
                "sql-api-enqueue-x100-per-stmt-c16",
                "SELECT count(mailroom.enqueue($1, u.k, u.p, '{}', $4))
                 FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS u(k, p, o)",
                BATCH,
                C,
                true,
                Some("sql-raw-100-rows-per-stmt-c16"),
            ),
            ("sql-raw-1-row-per-tx-c1", RAW, 1, 1, false, None),
            (
                "sql-keyed-1-row-per-tx-c1",
                KEYED,
                1,
                1,
                false,
                Some("sql-raw-1-row-per-tx-c1"),
            ),
            (
                "sql-api-enqueue-1-per-tx-c1",
                "SELECT mailroom.enqueue($1, $2[1], $3[1], '{}', $4)",
                1,
                1,
                true,
                Some("sql-raw-1-row-per-tx-c1"),
            ),
            ("sql-raw-1-row-per-tx-c16", RAW, 1, C, false, None),
            (
                "sql-keyed-1-row-per-tx-c16",
                KEYED,
                1,
                C,
                false,
                Some("sql-raw-1-row-per-tx-c16"),
            ),
            (
                "sql-api-enqueue-1-per-tx-c16",
                "SELECT mailroom.enqueue($1, $2[1], $3[1], '{}', $4)",
                1,
                C,
                true,
                Some("sql-raw-1-row-per-tx-c16"),
            ),
            (
                "sql-api-enqueue-1-per-tx-c16-no-notify",
                "SELECT mailroom.enqueue($1, $2[1], $3[1], '{}', $4)",
                1,
                C,
                false,
                Some("sql-raw-1-row-per-tx-c16"),
            ),
            (
                "sql-api-enqueue-1-per-tx-c1-no-notify",
                "SELECT mailroom.enqueue($1, $2[1], $3[1], '{}', $4)",
                1,
                1,
                false,
                Some("sql-raw-1-row-per-tx-c1"),
            ),
        ];
        let mut rows = Vec::new();
        for (name, sql, per_op, clients, notify, baseline) in specs {
            sqlx::query("UPDATE mailroom_sql_settings SET notify = $1")
                .bind(notify)
                .execute(&pool)
                .await?;
            let mark = CpuMark::take(self.broker_pid);
            reset_peak_rss();
            let (p, t, pl) = (pool.clone(), topic.clone(), payload.clone());
            let load = drive(clients, self.sizes.duration, move |c, seq| {
                let (p, t, pl) = (p.clone(), t.clone(), pl.clone());
                let mut keys = keys_of(c, seq);
                keys.truncate(per_op);
                if per_op == 1 {
                    keys = vec![key(c * 7919 + seq as usize, KEYS)];
                }
                async move {
                    let payloads: Vec<&[u8]> = vec![&pl[..]; keys.len()];
                    sqlx::query(sqlx::AssertSqlSafe(sql))
                        .bind(&t)
                        .bind(&keys)
                        .bind(&payloads)
                        .bind(EVENT_TYPE)
                        .execute(&p)
                        .await?;
                    Ok(keys.len() as u64)
                }
            })
            .await;
            let mut row = load_row(name, load, mark.since(self.broker_pid), baseline);
            if name.starts_with("sql-api") {
                row.notes
                    .push(format!("NOTIFY {}", if notify { "on" } else { "off" }));
            }
            rows.push(row);
        }
        // The pending counts stayed exact under this load.
        let off: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_keys k WHERE k.pending <> (SELECT count(*)
                 FROM outbox_events_view e WHERE e.topic = k.topic AND e.event_key = k.event_key
                 AND e.status = 'pending')",
        )
        .fetch_one(&pool)
        .await?;
        rows[0].notes.push(format!(
            "keys with a wrong pending count after the scenario: {off}"
        ));
        pool.close().await;
        self.dbs.drop_db(&db).await;
        Ok(rows)
    }
}

//! The relay: drain rates by key spread and depth (order checked on read-back), end to
//! end latency at a fixed rate, and `ListPending` over a large backlog.

use super::*;

impl Bench {
    /// Relay drain of a prepared backlog: events stored through the store (relays off),
    /// then mailroom starts with 2 relays (the default) and the clock runs until every
    /// event is completed. Single-key runs read the topic back to check the order.
    pub(crate) async fn relay(
        &self,
        name: &'static str,
        events: usize,
        keys: usize,
    ) -> anyhow::Result<Row> {
        let (db, url) = self.dbs.fresh().await?;
        let row = self.relay_on(name, events, keys, &url).await;
        self.dbs.drop_db(&db).await;
        row
    }

    /// [`Bench::relay`] in the database at `url`, whatever it already holds (its own
    /// topic: the drain waits for its events only).
    pub(crate) async fn relay_on(
        &self,
        name: &str,
        events: usize,
        keys: usize,
        url: &str,
    ) -> anyhow::Result<Row> {
        let topic = self.topic(&name.replace(['-', ' ', '(', ')', ','], "_"));
        {
            let store = PgStore::connect(url, 2).await?;
            let mut i = 0;
            while i < events {
                let chunk: Vec<NewEvent> = (i..(i + 1000).min(events))
                    .map(|j| new_event(&topic, key(j, keys), &self.payload))
                    .collect();
                i += chunk.len();
                store.enqueue(&chunk, false).await?;
            }
            sqlx::query("ANALYZE").execute(store.pool()).await?;
            store.pool().close().await;
        }
        let config = mailroom_config(url, &self.brokers, 2)?;
        let relays = config.relays;
        let sink = Arc::new(TimedSink {
            inner: open_sink(&config).await?,
            nanos: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        });
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let start = Instant::now();
        let app = App::start_with_sink(config, sink.clone(), CancellationToken::new()).await?;
        let delivered = |stats: &[Arc<RelayStats>]| -> u64 {
            stats
                .iter()
                .map(|s| s.delivered.load(Ordering::Relaxed))
                .sum()
        };
        let limit = Duration::from_secs(60) + Duration::from_millis(events as u64 * 10);
        let mut timed_out = false;
        while delivered(&app.relay_stats) < events as u64 {
            if start.elapsed() > limit {
                timed_out = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let elapsed = start.elapsed();
        let cpu = mark.since(self.broker_pid);
        let peak = mb(status_kb("VmHWM:"));
        let pending = app
            .store
            .count_events(BoxKind::Outbox, Some(Status::Pending))
            .await?;
        let sum = |f: fn(&RelayStats) -> &AtomicU64| -> u64 {
            app.relay_stats
                .iter()
                .map(|s| f(s).load(Ordering::Relaxed))
                .sum()
        };
        let cycles = sum(|s| &s.cycles);
        let done = delivered(&app.relay_stats);
        let mut notes = vec![
            format!("{events} events / {keys} keys, {relays} relays"),
            format!(
                "{cycles} cycles, {:.0} events/cycle, {:.1} ms/cycle per relay",
                done as f64 / cycles.max(1) as f64,
                elapsed.as_secs_f64() * 1000.0 * relays as f64 / cycles.max(1) as f64
            ),
            format!(
                "{:.0}% of relay time in sink.deliver",
                sink.nanos.load(Ordering::Relaxed) as f64
                    / 1e9
                    / (elapsed.as_secs_f64() * relays as f64)
                    * 100.0
            ),
        ];
        let (failed, retried, stale, transient, after_failure) = (
            sum(|s| &s.failed),
            sum(|s| &s.retried),
            sum(|s| &s.stale),
            sum(|s| &s.transient),
            sum(|s| &s.delivered_after_failure),
        );
        if failed + retried + stale + transient + after_failure > 0 {
            notes.push(format!(
                "stats: failed {failed}, retried {retried}, stale {stale}, transient {transient}, out of order {after_failure}"
            ));
        }
        if timed_out || pending > 0 {
            notes.push(format!(
                "NOT DRAINED: {done} delivered, {pending} pending after {:.0} s",
                elapsed.as_secs_f64()
            ));
        }
        app.stop().await?;
        // What a user sees: the records read back from the broker, their count and the
        // span and gaps of their CreateTime (set when mailroom handed each to the
        // producer). The row's rate is the broker's, not the in-process counters'.
        let seen = self.read_back(&topic, events, keys == 1).await;
        notes.push(seen.note());
        if !seen.complete() {
            anyhow::bail!("{name}: {}", seen.note());
        }
        Ok(Row {
            name: name.into(),
            events: seen.records as u64,
            secs: seen.span_ms as f64 / 1000.0,
            latency: None,
            peak_rss_mb: peak,
            cpu,
            baseline: Some(if keys == 1 {
                "raw-kafka-1-key"
            } else {
                "raw-kafka-1000-keys"
            }),
            notes,
            wal_bytes: None,
        })
    }

    /// Reads a drained topic back (every partition): how many distinct events arrived,
    /// whether ids increase within the topic when `ordered` (one key), and the records'
    /// CreateTime span and gaps.
    pub(crate) async fn read_back(&self, topic: &str, expected: usize, ordered: bool) -> DrainSeen {
        let reader = match TopicReader::start(&self.brokers, topic) {
            Ok(r) => r,
            Err(e) => {
                return DrainSeen {
                    error: Some(format!("{e:#}")),
                    ..DrainSeen::default()
                };
            }
        };
        let recs = reader
            .collect(expected, Duration::from_secs(120), |_| true)
            .await;
        let ids: Vec<i64> = recs.iter().map(|r| r.id).collect();
        let distinct = ids.iter().collect::<std::collections::HashSet<_>>().len();
        let mut times: Vec<i64> = recs
            .iter()
            .filter_map(|r| match r.timestamp {
                Some(("CreateTime", ms)) => Some(ms),
                _ => None,
            })
            .collect();
        times.sort_unstable();
        let gaps: Vec<i64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        DrainSeen {
            expected,
            records: recs.len(),
            distinct,
            in_order: !ordered || ids.windows(2).all(|w| w[0] < w[1]),
            span_ms: times
                .last()
                .zip(times.first())
                .map_or(0, |(l, f)| (l - f).max(1)),
            max_gap_ms: gaps.iter().copied().max().unwrap_or(0),
            gaps_over_20ms: gaps.iter().filter(|g| **g > 20).count(),
            error: None,
        }
    }

    /// End to end at a fixed offered rate (open loop): each answered `Enqueue` is matched,
    /// by `ce_id`, with its record read back from the broker.
    pub(crate) async fn e2e(&self, rate: u64) -> anyhow::Result<Row> {
        let (db, url) = self.dbs.fresh().await?;
        // A topic per rate: each rate's database numbers its events from 1 again, and the
        // reader matches records by id from the topic's beginning.
        let topic = self.topic(&format!("e2e_{rate}"));
        drop(create_topic(&self.brokers, &topic).await?);
        let reader = TopicReader::start(&self.brokers, &topic)?;
        let app = App::start(
            mailroom_config(&url, &self.brokers, 2)?,
            CancellationToken::new(),
        )
        .await?;
        let chans = channels(app.addr, 8).await?;
        // Warm up mailroom's own producer (connection, metadata, idempotent producer id:
        // about a second on a fresh process) before the clock starts: the scenario measures
        // the steady state, not process start-up.
        pb::outbox_service_client::OutboxServiceClient::new(chans[0].clone())
            .enqueue(pb::EnqueueRequest {
                event: Some(pb_event(&topic, "warm-up".to_string(), &self.payload)),
            })
            .await?;
        let warm = Instant::now();
        while app
            .store
            .count_events(BoxKind::Outbox, Some(Status::Completed))
            .await?
            < 1
        {
            anyhow::ensure!(
                warm.elapsed() < Duration::from_secs(30),
                "warm-up event not published"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let answered: Arc<Mutex<HashMap<i64, i64>>> = Arc::default();
        let rpc_lat: Arc<Mutex<Vec<u64>>> = Arc::default();
        // Refusals by gRPC code, so that a run says what failed (load shedding or else).
        let errors: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
        let total = (rate as f64 * self.sizes.e2e.as_secs_f64()) as usize;
        let interval_us = 1_000_000 / rate;
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let start = Instant::now();
        let start_us = now_us();
        let mut tick = tokio::time::interval(Duration::from_micros(interval_us));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut tasks = Vec::with_capacity(total);
        for i in 0..total {
            tick.tick().await;
            // The clock starts at the intended send time (the tick), as the plain
            // producer's does: a late send or a slow answer counts.
            let intended = start_us + (i as u64 * interval_us) as i64;
            let mut client =
                pb::outbox_service_client::OutboxServiceClient::new(chans[i % chans.len()].clone());
            let e = pb_event(&topic, key(i, KEYS), &self.payload);
            let (answered, rpc_lat, errors) = (answered.clone(), rpc_lat.clone(), errors.clone());
            tasks.push(tokio::spawn(async move {
                let t = Instant::now();
                match client.enqueue(pb::EnqueueRequest { event: Some(e) }).await {
                    Ok(r) => {
                        rpc_lat
                            .lock()
                            .expect("lock")
                            .push(t.elapsed().as_micros() as u64);
                        answered
                            .lock()
                            .expect("lock")
                            .insert(r.into_inner().id, intended);
                    }
                    Err(status) => {
                        *errors
                            .lock()
                            .expect("lock")
                            .entry(format!("{:?}", status.code()))
                            .or_default() += 1;
                    }
                }
            }));
        }
        futures::future::join_all(tasks).await;
        let offered_secs = start.elapsed().as_secs_f64();
        let answered = std::mem::take(&mut *answered.lock().expect("lock"));
        let expected = answered.len();
        let recs = reader
            .collect(expected, Duration::from_secs(60), |r| {
                answered.contains_key(&r.id)
            })
            .await;
        let cpu = mark.since(self.broker_pid);
        let peak = mb(status_kb("VmHWM:"));
        let stranded = if recs.len() < expected {
            Some(stranded(&url).await)
        } else {
            None
        };
        let mut consumed = Vec::with_capacity(recs.len());
        let mut produced = Vec::new();
        let mut ts_kind = "none";
        for r in &recs {
            if let Some(&at) = answered.get(&r.id) {
                consumed.push((r.consumed_us - at).max(0) as u64);
                if let Some((kind, ms)) = r.timestamp {
                    ts_kind = kind;
                    produced.push(ms * 1000 - at);
                }
            }
        }
        let mut notes = vec![format!(
            "offered {total} in {offered_secs:.1} s; latency = intended send time of the Enqueue → record consumed back"
        )];
        if let Some(l) = latency(std::mem::take(&mut *rpc_lat.lock().expect("lock"))) {
            notes.push(format!(
                "Enqueue RPC p50/p99 {} / {} ms",
                fmt_ms(l.p50),
                fmt_ms(l.p99)
            ));
        }
        if !produced.is_empty() {
            produced.sort_unstable();
            let at = |p: f64| {
                produced[((p * produced.len() as f64).ceil() as usize).clamp(1, produced.len()) - 1]
                    as f64
                    / 1000.0
            };
            notes.push(format!(
                "intended send → record {ts_kind} timestamp (ms resolution) p50/p99/p99.9 {} / {} / {} ms",
                fmt_ms(at(0.5)),
                fmt_ms(at(0.99)),
                fmt_ms(at(0.999))
            ));
        }
        let errors = std::mem::take(&mut *errors.lock().expect("lock"));
        if recs.len() < expected || !errors.is_empty() {
            notes.push(format!(
                "{} of {expected} read back; enqueue errors by code: {errors:?}",
                recs.len(),
            ));
        }
        if let Some((pending, idle)) = stranded {
            notes.push(format!(
                "after the wait {pending} events still pending, {idle} of them on keys marked idle (ready_at = infinity, no lease)"
            ));
        }
        app.stop().await?;
        self.dbs.drop_db(&db).await;
        Ok(Row {
            name: format!("e2e-{rate}-per-s"),
            events: recs.len() as u64,
            secs: offered_secs,
            latency: latency(consumed),
            peak_rss_mb: peak,
            cpu,
            baseline: None,
            notes,
            wal_bytes: None,
        })
    }

    /// `ListPending` (top 100 keys by backlog) over a backlog generated in SQL: rows like
    /// the ones `Enqueue` stores, spread evenly over the keys, relays off.
    pub(crate) async fn list_pending(&self) -> anyhow::Result<Row> {
        let (db, url) = self.dbs.fresh().await?;
        let (events, keys) = (self.sizes.pending_events, self.sizes.pending_keys);
        let topic = self.topic("admin");
        let prep = Instant::now();
        {
            let pool = sqlx::PgPool::connect(&url).await?;
            sqlx::query(
                "INSERT INTO outbox_keys (topic, event_key, ready_at)
                 SELECT $1, 'key-' || i, now() FROM generate_series(0, $2 - 1) AS i",
            )
            .bind(&topic)
            .bind(keys as i64)
            .execute(&pool)
            .await?;
            sqlx::query(
                "INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                     max_attempts, scheduled_at)
                 SELECT $1, 'key-' || (i % $3), $4, '{}'::jsonb, $5, 6, now()
                 FROM generate_series(0, $2 - 1) AS i",
            )
            .bind(&topic)
            .bind(events as i64)
            .bind(keys as i64)
            .bind(&self.payload)
            .bind(EVENT_TYPE)
            .execute(&pool)
            .await?;
            // Rows written behind the intake's back: set the per-key pending counts the
            // way enqueue keeps them (its key upsert counts the events it inserts).
            sqlx::query(
                "UPDATE outbox_keys k SET pending = c.n
                 FROM (SELECT topic, event_key, count(*) AS n FROM outbox_events
                       WHERE status = 'pending' GROUP BY topic, event_key) c
                 WHERE k.topic = c.topic AND k.event_key = c.event_key",
            )
            .execute(&pool)
            .await?;
            sqlx::query("VACUUM ANALYZE outbox_events")
                .execute(&pool)
                .await?;
            sqlx::query("VACUUM ANALYZE outbox_keys")
                .execute(&pool)
                .await?;
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
        let request = pb::ListPendingRequest {
            page_size: 100,
            order: pb::PendingOrder::MostPending as i32,
            ..Default::default()
        };
        let mut notes = vec![format!(
            "{events} pending / {keys} keys (prepared in SQL in {:.0} s)",
            prep.as_secs_f64()
        )];
        let mut lat = Vec::new();
        let mut via = "gRPC AdminService/ListPending";
        let pool = sqlx::PgPool::connect(&url).await?;
        let mark = CpuMark::take(self.broker_pid);
        reset_peak_rss();
        let start = Instant::now();
        for call in 0..self.sizes.list_calls {
            let t = Instant::now();
            match admin.list_pending(request.clone()).await {
                Ok(r) => {
                    lat.push(t.elapsed().as_micros() as u64);
                    if call == 0 {
                        let r = r.into_inner();
                        // A page that is not the prepared backlog measures nothing.
                        anyhow::ensure!(
                            r.keys.len() == 100 && r.total_pending == events as i64,
                            "ListPending returned {} groups and total_pending {}: not the prepared backlog",
                            r.keys.len(),
                            r.total_pending
                        );
                        notes.push(format!(
                            "{} groups returned, total_pending {}, total_keys {}",
                            r.keys.len(),
                            r.total_pending,
                            r.total_keys
                        ));
                    }
                }
                Err(status) => {
                    if call == 0 {
                        notes.push(format!(
                            "ListPending over gRPC answered {:?}",
                            status.code()
                        ));
                    }
                    via = "SQL directly (the AdminService is not served yet)";
                    let t = Instant::now();
                    let top: Vec<(String, Option<String>, i64)> = sqlx::query_as(
                        "SELECT topic, event_key, count(*) AS pending
                         FROM outbox_events_view WHERE status = 'pending'
                         GROUP BY topic, event_key ORDER BY pending DESC, topic, event_key LIMIT 100",
                    )
                    .fetch_all(&pool)
                    .await?;
                    let (total, groups): (i64, i64) = sqlx::query_as(
                        "SELECT count(*), count(DISTINCT (topic, event_key))
                         FROM outbox_events_view WHERE status = 'pending'",
                    )
                    .fetch_one(&pool)
                    .await?;
                    lat.push(t.elapsed().as_micros() as u64);
                    if call == 0 {
                        notes.push(format!(
                            "{} groups, total_pending {total}, total_keys {groups}",
                            top.len()
                        ));
                    }
                }
            }
        }
        let secs = start.elapsed().as_secs_f64();
        notes.insert(0, format!("{} calls via {via}", lat.len()));
        let row = Row {
            name: "list-pending".into(),
            events: lat.len() as u64,
            secs,
            latency: latency(lat),
            peak_rss_mb: mb(status_kb("VmHWM:")),
            cpu: mark.since(self.broker_pid),
            baseline: None,
            notes,
            wal_bytes: None,
        };
        pool.close().await;
        app.stop().await?;
        self.dbs.drop_db(&db).await;
        Ok(row)
    }
}

/// A drain as the broker saw it.
#[derive(Debug, Default)]
pub(crate) struct DrainSeen {
    expected: usize,
    records: usize,
    distinct: usize,
    in_order: bool,
    /// From the first record's CreateTime to the last's.
    pub(crate) span_ms: i64,
    /// The longest pause between consecutive CreateTimes while records remained.
    pub(crate) max_gap_ms: i64,
    gaps_over_20ms: usize,
    error: Option<String>,
}

impl DrainSeen {
    fn complete(&self) -> bool {
        self.error.is_none() && self.distinct == self.expected && self.in_order
    }

    fn note(&self) -> String {
        if let Some(e) = &self.error {
            return format!("READ-BACK FAILED: {e}");
        }
        let status = if self.complete() {
            "complete"
        } else {
            "INCOMPLETE OR OUT OF ORDER"
        };
        format!(
            "broker read-back {status}: {} records ({} distinct of {}), ids in order: {}; \
             CreateTime span {} ms = {:.0}/s; longest gap {} ms, {} gaps over 20 ms",
            self.records,
            self.distinct,
            self.expected,
            self.in_order,
            self.span_ms,
            self.distinct as f64 * 1000.0 / self.span_ms.max(1) as f64,
            self.max_gap_ms,
            self.gaps_over_20ms
        )
    }
}

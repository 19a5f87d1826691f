//! PostgreSQL engine: the production store. Several mailroom processes may share one
//! database; leases on key rows (taken with `FOR UPDATE SKIP LOCKED`) keep relays apart.
//!
//! Ordering invariant: an enqueue locks its keys' rows *before* it draws ids, so within a
//! key ids are drawn and committed in the same order, and a relay can never see event
//! n+1 of a key committed while event n is still in flight.
//!
//! Files: `sql.rs` the claim and settle statements per box, `write.rs` enqueue and
//! receive, `relay.rs` claim, settle and renew, `held.rs` keys SQL-API writers keep held, `admin.rs` the operator statements,
//! `retention.rs` the purges, `notify.rs` LISTEN/NOTIFY wake-ups.

mod admin;
mod fold;
mod held;
pub mod migrate;
pub mod notify;
pub mod profile;
mod relay;
mod retention;
mod sql;
mod sql_settings;
mod write;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Executor, Row};

use self::profile::{Qualifier, SessionProfile};
use self::sql::Sql;
use super::rows::{Cols, decode_event};
use super::schema;
use super::{
    Admission, Claim, ClaimLimits, Continued, HeldId, LineKey, Renewal, SettleReport, Settlement,
    Store, StoreError, StoreResult,
};
use crate::domain::{BoxKind, EventId, InboundMessage, NewEvent, Queue, Status, StoredEvent};

/// The PostgreSQL engine: a `Store` over three connection pools (see `PgPools`).
pub struct PgStore {
    /// Enqueues, receives and health checks.
    pool: PgPool,
    /// Claims, settles, renewals and retention.
    relay_pool: PgPool,
    /// Admin reads and actions.
    admin_pool: PgPool,
    /// Qualifies mailroom's names in every statement with the data schema (`profile`).
    names: Qualifier,
    outbox: Sql,
    inbox: Sql,
    /// Where the next fold's scan starts (`fold.rs`); held while a fold runs.
    fold_floor: tokio::sync::Mutex<fold::FoldFloor>,
    /// The outbox's events table, qualified, as text (the fold reads its id sequence).
    events_table: String,
    /// Where the next pruning of idle key rows starts, per box (`retention.rs`).
    prune_from: std::sync::Mutex<retention::PruneFrom>,
    /// Keys this replica's claims found held by SQL-API writers (`held.rs`).
    held: Arc<held::HeldKeys>,
    /// `held.rs`'s statements, qualified.
    held_sql: Arc<held::Statements>,
    /// The schema this binary knows (`Store::known_schema`), bound into every claim,
    /// continued-line, renewal and settle statement: the database refuses them itself
    /// when a migration requires more (`sql::compatible`).
    known: i64,
}

/// The service's connection pools, one per query class so that each carries the
/// `statement_timeout` of its class (`config::DatabaseTimeouts`).
pub struct PgPools {
    /// Enqueues, receives and health checks.
    pub enqueue: PgPool,
    /// Claims, settles, renewals and retention.
    pub relay: PgPool,
    /// Admin reads and actions.
    pub admin: PgPool,
    /// The schema that holds mailroom's tables (unquoted).
    pub schema: String,
}

/// What a pool is: its size, how long a request waits for a connection (then fails
/// `UNAVAILABLE` rather than queueing behind an exhausted pool), the statement timeout
/// its sessions run with (`None`: the server's), and whether it connects at once (a bad
/// URL fails at start-up) or on first use.
#[derive(Debug, Clone, Copy)]
pub struct PoolShape {
    /// Connections at most.
    pub max_connections: u32,
    /// How long a request waits for a connection.
    pub acquire_timeout: Duration,
    /// `statement_timeout` of every session (the `options` startup parameter).
    pub statement_timeout: Option<Duration>,
    /// Connect on first use instead of at once.
    pub lazy: bool,
    /// How prepared statements are planned (`plan_cache_mode`).
    pub plans: Plans,
}

/// How a pool's sessions plan their prepared statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Plans {
    /// As the server decides (custom plans first, then a generic plan when it looks no
    /// dearer).
    #[default]
    Server,
    /// Once per session (`force_generic_plan`): for the relay's fixed-shape claims and
    /// settles, whose best plan does not depend on the values (docs/relay.md, "Generic
    /// plans").
    Generic,
    /// For every call's values (`force_custom_plan`): for the admin's reads, whose
    /// filters are optional (`$1 IS NULL OR topic = $1`). A generic plan cannot tell which
    /// are set, and the server chose one after five calls that read and sorted the whole
    /// events table for a page of 50 (issue 46: 178 ms at 200,000 events, seconds at a
    /// week's history); a custom plan drops the unset filters and walks an index.
    Custom,
}

impl Default for PoolShape {
    fn default() -> Self {
        PoolShape {
            max_connections: 4,
            acquire_timeout: Duration::from_secs(3),
            statement_timeout: None,
            lazy: false,
            plans: Plans::Server,
        }
    }
}

/// Every PostgreSQL pool mailroom opens (the query classes' pools, the migrations', the
/// LISTEN connection's) is built here, and each of its connections runs `profile`.
pub async fn pool(url: &str, shape: PoolShape, profile: &SessionProfile) -> StoreResult<PgPool> {
    let opts: PgConnectOptions = url
        .parse()
        .map_err(|e: sqlx::Error| StoreError::other(format!("bad database url: {e}")))?;
    pool_with(opts, shape, profile).await
}

/// Migrates the database at `url`, whose mailroom tables are in `schema`, on a pool of
/// its own: the migrator's profile (the released migrations name objects without a
/// schema) with `wait`'s lock timeout, retrying lock waits as `migrate::run` does.
pub async fn migrate_database(
    url: &str,
    schema: &str,
    acquire_timeout: Duration,
    wait: migrate::MigrationWait,
) -> StoreResult<migrate::MigrationReport> {
    let opts: PgConnectOptions = url
        .parse()
        .map_err(|e: sqlx::Error| StoreError::other(format!("bad database url: {e}")))?;
    migrate_on(opts, schema, acquire_timeout, wait).await
}

async fn migrate_on(
    opts: PgConnectOptions,
    schema: &str,
    acquire_timeout: Duration,
    wait: migrate::MigrationWait,
) -> StoreResult<migrate::MigrationReport> {
    let migrator = pool_with(
        opts,
        wait.pool_shape(acquire_timeout),
        &wait.profile(schema),
    )
    .await?;
    let ran = async {
        refuse_other_home(&migrator, schema).await?;
        ensure_schema(&migrator, schema).await?;
        migrate::run(PgStore::migrator(), &migrator, wait)
            .await
            .map_err(|e| StoreError::other(format!("migrating: {e}")))
    }
    .await;
    migrator.close().await;
    ran
}

async fn pool_with(
    mut opts: PgConnectOptions,
    shape: PoolShape,
    profile: &SessionProfile,
) -> StoreResult<PgPool> {
    if let Some(t) = shape.statement_timeout {
        opts = opts.options([("statement_timeout", t.as_millis().to_string())]);
    }
    let profile = Arc::new(profile.clone());
    let plans = match shape.plans {
        Plans::Server => None,
        Plans::Generic => Some("force_generic_plan"),
        Plans::Custom => Some("force_custom_plan"),
    };
    let options = PgPoolOptions::new()
        .max_connections(shape.max_connections)
        .acquire_timeout(shape.acquire_timeout)
        .after_connect(move |conn, _| {
            let profile = profile.clone();
            Box::pin(async move {
                profile.apply(conn).await?;
                if let Some(mode) = plans {
                    // A statement after connecting rather than a startup option: PgBouncer
                    // refuses unknown startup parameters. `plan_cache_mode` is PostgreSQL
                    // 12's; older servers plan as they do.
                    conn.execute(AssertSqlSafe(format!(
                        "SELECT set_config('plan_cache_mode', '{mode}', false)
                         WHERE current_setting('server_version_num')::int >= 120000"
                    )))
                    .await?;
                }
                Ok(())
            })
        });
    if shape.lazy {
        Ok(options.connect_lazy_with(opts))
    } else {
        Ok(options.connect_with(opts).await?)
    }
}

impl PgStore {
    /// Connects lazily-checked: the pool is created and one connection tried, so a bad
    /// URL fails at start-up while a database that goes away later only degrades health.
    /// (Mailroom's tables in the default schema, sessions with the default profile.)
    pub async fn connect(url: &str, max_connections: u32) -> StoreResult<Self> {
        let pool = pool(
            url,
            PoolShape {
                max_connections,
                ..PoolShape::default()
            },
            &SessionProfile::service(profile::DEFAULT_SCHEMA),
        )
        .await?;
        Ok(Self::from_pool(pool))
    }

    /// One pool for every query class, mailroom's tables in the default schema.
    pub fn from_pool(pool: PgPool) -> Self {
        Self::from_pools(PgPools {
            enqueue: pool.clone(),
            relay: pool.clone(),
            admin: pool,
            schema: profile::DEFAULT_SCHEMA.to_string(),
        })
    }

    /// A store over the given pools, one per query class.
    pub fn from_pools(pools: PgPools) -> Self {
        let names = Qualifier::new(&pools.schema);
        let events_table = format!("{}.outbox_events", profile::quote_ident(names.schema()));
        PgStore {
            pool: pools.enqueue,
            relay_pool: pools.relay,
            admin_pool: pools.admin,
            outbox: Sql::new("outbox_events", "outbox_keys", false, &names),
            inbox: Sql::new("inbox_events", "inbox_keys", true, &names),
            held_sql: held::Statements::new(&names),
            names,
            fold_floor: tokio::sync::Mutex::new(fold::FoldFloor::new(std::time::Instant::now())),
            events_table,
            prune_from: std::sync::Mutex::default(),
            held: Arc::default(),
            known: schema::highest(&sqlx::migrate!("migrations/postgres")),
        }
    }

    /// The schema of mailroom's tables (unquoted).
    pub fn schema_name(&self) -> &str {
        self.names.schema()
    }

    /// The roles other than mailroom's own (its user, the roles granted to it,
    /// superusers and PostgreSQL's predefined roles) that may create objects in the
    /// schema of mailroom's tables, as a readable list; `None` when there is none.
    pub async fn schema_creators(&self) -> StoreResult<Option<String>> {
        Ok(sqlx::query_scalar(
            "WITH s AS (SELECT oid, nspowner, nspacl FROM pg_catalog.pg_namespace
                        WHERE nspname = $1)
             SELECT CASE
                 WHEN EXISTS (SELECT 1 FROM s, aclexplode(COALESCE(s.nspacl,
                                                acldefault('n', s.nspowner))) a
                              WHERE a.grantee = 0 AND a.privilege_type = 'CREATE')
                 THEN 'PUBLIC (every role)'
                 ELSE (SELECT string_agg(r.rolname, ', ' ORDER BY r.rolname)
                       FROM pg_catalog.pg_roles r, s
                       WHERE has_schema_privilege(r.oid, s.oid, 'CREATE')
                         AND NOT r.rolsuper AND NOT starts_with(r.rolname, 'pg_')
                         AND r.rolname <> current_user
                         AND r.oid NOT IN (SELECT m.roleid FROM pg_catalog.pg_auth_members m
                                           JOIN pg_catalog.pg_roles u ON u.oid = m.member
                                           WHERE u.rolname = current_user))
             END",
        )
        .bind(self.names.schema())
        .fetch_one(&self.admin_pool)
        .await?)
    }

    /// A constant statement with mailroom's names qualified (see `profile::Qualifier`).
    pub(crate) fn text(&self, sql: &'static str) -> Arc<str> {
        self.names.fixed(sql)
    }

    /// A built statement with mailroom's names qualified.
    pub(crate) fn built(&self, sql: &str) -> String {
        self.names.text(sql)
    }

    /// This binary's migrations, set to tolerate newer ones (`schema::tolerant`).
    pub fn migrator() -> sqlx::migrate::Migrator {
        schema::tolerant(sqlx::migrate!("migrations/postgres"))
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
        let keys = match b {
            BoxKind::Outbox => "outbox_keys",
            BoxKind::Inbox => "inbox_keys",
        };
        // The line starts above the key's cursor, as in a claim.
        let cursor: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.built(&format!(
            "SELECT max(published_through) FROM {keys} WHERE topic = $1 AND event_key = $2"
        ))))
        .bind(&line.topic)
        .bind(&line.key)
        .fetch_one(&self.pool)
        .await?;
        let plan: serde_json::Value = sqlx::query_scalar(AssertSqlSafe(sql))
            .bind(vec![line.topic.clone()])
            .bind(vec![line.key.clone()])
            .bind(per_key)
            .bind(vec![cursor.unwrap_or(0)])
            .bind(i64::MAX)
            .fetch_one(&self.pool)
            .await?;
        Ok(plan)
    }

    /// The identity sequences of the tables whose ids the relay's order relies on that
    /// hand out ids in blocks per session (`CACHE` above 1): `(table, sequence, cache)`.
    /// With a cache, a session can commit a lower id after another session committed a
    /// higher one for the same key, and the per-key cursor (migration 0011), already
    /// past it, never publishes it; the inbox dispatches it out of order.
    pub async fn cached_sequences(&self) -> StoreResult<Vec<(String, String, i64)>> {
        Ok(
            sqlx::query_as(AssertSqlSafe(self.names.fixed(CACHED_SEQUENCES)))
                .fetch_all(&self.pool)
                .await?,
        )
    }

    fn sql(&self, b: BoxKind) -> &Sql {
        match b {
            BoxKind::Outbox => &self.outbox,
            BoxKind::Inbox => &self.inbox,
        }
    }
}

/// Creates the data schema when it is missing (a configured schema on a new database;
/// `public` exists already).
async fn ensure_schema(pool: &PgPool, schema: &str) -> StoreResult<()> {
    let exists: bool = sqlx::query_scalar("SELECT to_regnamespace($1) IS NOT NULL")
        .bind(profile::quote_ident(schema))
        .fetch_one(pool)
        .await?;
    if !exists {
        pool.execute(AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            profile::quote_ident(schema)
        )))
        .await?;
    }
    Ok(())
}

/// Refuses to migrate a schema without mailroom's tables when another schema of the
/// database has them: the tables were created under another search path (an earlier
/// release followed the role's), and migrating here would start a second, empty copy
/// that some sessions would then use.
async fn refuse_other_home(pool: &PgPool, schema: &str) -> StoreResult<()> {
    let other: Option<String> = sqlx::query_scalar(
        "SELECT string_agg(n.nspname, ', ' ORDER BY n.nspname)
         FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relname = 'outbox_events' AND c.relkind = 'r' AND n.nspname <> $1
           AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_class c2
                           JOIN pg_catalog.pg_namespace n2 ON n2.oid = c2.relnamespace
                           WHERE c2.relname = 'outbox_events' AND n2.nspname = $1)",
    )
    .bind(schema)
    .fetch_one(pool)
    .await?;
    match other {
        Some(found) => Err(StoreError::other(format!(
            "mailroom's tables are in schema {found}, not {schema:?}: set \
             MAILROOM_DATABASE_SCHEMA to the schema that holds them"
        ))),
        None => Ok(()),
    }
}

/// See `PgStore::cached_sequences`. The tables are named as types (`NULL::outbox_events`),
/// where a name is resolved as everywhere else in mailroom's SQL, not in a string
/// literal; each one's identity sequences are found through `pg_depend` (`deptype`
/// `i`: owned by an identity column).
const CACHED_SEQUENCES: &str = "SELECT c.relname::text, s.seqrelid::regclass::text, s.seqcache
     FROM (VALUES (pg_typeof(NULL::outbox_events)::oid),
                  (pg_typeof(NULL::inbox_events)::oid)) AS t(typ)
     JOIN pg_type ty ON ty.oid = t.typ
     JOIN pg_class c ON c.oid = ty.typrelid
     JOIN pg_depend d ON d.refclassid = 'pg_class'::regclass AND d.refobjid = c.oid
                     AND d.classid = 'pg_class'::regclass AND d.deptype = 'i'
     JOIN pg_sequence s ON s.seqrelid = d.objid
     WHERE s.seqcache > 1
     ORDER BY 1";

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

/// Binds what a gated statement takes after its own parameters: the subscription of a
/// scoped (inbox) statement, then the binary's schema (`sql::compatible`).
fn gated(
    query: sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
    queue: &Queue,
    known: i64,
) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments> {
    scoped(query, queue).bind(known)
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
    let mut backoff =
        crate::backoff::Backoff::new(Duration::from_millis(10), Duration::from_millis(40));
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
                let pause = backoff.failed(&mut rand::rng());
                tokio::time::sleep(pause).await;
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

impl Cols for PgRow {
    fn text(&self, col: &str) -> StoreResult<String> {
        Ok(self.try_get(col)?)
    }
    fn opt_text(&self, col: &str) -> StoreResult<Option<String>> {
        Ok(self.try_get(col)?)
    }
    fn int(&self, col: &str) -> StoreResult<i64> {
        Ok(self.try_get(col)?)
    }
    fn count(&self, col: &str) -> StoreResult<u32> {
        Ok(self.try_get::<i32, _>(col)? as u32)
    }
    fn flag(&self, col: &str) -> StoreResult<bool> {
        Ok(self.try_get(col)?)
    }
    fn bytes(&self, col: &str) -> StoreResult<Vec<u8>> {
        Ok(self.try_get(col)?)
    }
    fn time(&self, col: &str) -> StoreResult<DateTime<Utc>> {
        Ok(self.try_get(col)?)
    }
    fn opt_time(&self, col: &str) -> StoreResult<Option<DateTime<Utc>>> {
        Ok(self.try_get(col)?)
    }
}

#[async_trait::async_trait]
impl Store for PgStore {
    fn engine(&self) -> &'static str {
        "postgres"
    }

    async fn migrate(&self) -> StoreResult<()> {
        // The store's database, with the default lock wait (`migrate_database`).
        migrate_on(
            (*self.pool.connect_options()).clone(),
            self.names.schema(),
            self.pool.options().get_acquire_timeout(),
            migrate::MigrationWait::default(),
        )
        .await
        .map(drop)
    }

    fn known_schema(&self) -> i64 {
        self.known
    }

    async fn schema_state(&self) -> StoreResult<schema::SchemaState> {
        Ok(schema::read_state(
            &self.pool,
            &self.text(schema::DATABASE_SCHEMA_SQL),
            &self.text(schema::REQUIRED_SCHEMA_SQL),
        )
        .await?)
    }

    async fn ping(&self) -> StoreResult<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn installation_id(&self) -> StoreResult<String> {
        Ok(sqlx::query_scalar(AssertSqlSafe(
            self.text("SELECT installation_id::text FROM mailroom_installation"),
        ))
        .fetch_one(&self.pool)
        .await?)
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

    async fn held_ids(&self, subscription: &str, ids: &[String]) -> StoreResult<Vec<HeldId>> {
        let rows = sqlx::query(AssertSqlSafe(self.text(
            "SELECT message_id, id, created_at FROM inbox_events
             WHERE subscription = $1 AND message_id = ANY($2)",
        )))
        .bind(subscription)
        .bind(ids)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(HeldId {
                    message_id: r.try_get(0)?,
                    id: r.try_get(1)?,
                    created_at: r.try_get(2)?,
                })
            })
            .collect()
    }

    async fn settle(&self, settlement: Settlement<'_>) -> StoreResult<SettleReport> {
        retry_aborted(|| self.settle_once(settlement)).await?
    }

    async fn renew(&self, renewal: Renewal<'_>) -> StoreResult<usize> {
        retry_aborted(|| self.renew_once(renewal)).await
    }

    async fn fold_sql_events(&self) -> StoreResult<u64> {
        self.fold(true).await
    }

    async fn claim(&self, queue: &Queue, token: i64, limits: ClaimLimits) -> StoreResult<Claim> {
        self.claim_lines(queue, token, limits).await
    }

    fn continues_lines(&self, box_kind: BoxKind) -> bool {
        self.sql(box_kind).continue_line.is_some()
    }

    async fn continue_line(
        &self,
        queue: &Queue,
        token: i64,
        line: &LineKey,
        after: EventId,
        horizon: Option<EventId>,
        limits: ClaimLimits,
    ) -> StoreResult<Option<Continued>> {
        // Not retried: a line that cannot go on now is released as usual.
        if let Some(h) = horizon.filter(|&h| after < h)
            && let Some(c) = self
                .read_within(queue, token, line, after, h, limits)
                .await?
        {
            return Ok(Some(c));
        }
        self.read_on_line(queue, token, line, after, limits).await
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
        // The outbox's statuses apply the keys' cursors (migration 0011).
        let table = match b {
            BoxKind::Outbox => "outbox_events_view",
            BoxKind::Inbox => "inbox_events",
        };
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(self.built(&format!(
            "SELECT count(*) FROM {table} WHERE $1::text IS NULL OR status = $1"
        ))))
        .bind(status.map(Status::as_str))
        .fetch_one(&self.admin_pool)
        .await?;
        Ok(n)
    }

    fn held_keys(&self) -> Vec<super::HeldKey> {
        self.held.snapshot(std::time::Instant::now())
    }

    fn pool_use(&self) -> Vec<super::PoolUse> {
        vec![
            super::pool_use("enqueue", &self.pool),
            super::pool_use("relay", &self.relay_pool),
            super::pool_use("admin", &self.admin_pool),
        ]
    }
}

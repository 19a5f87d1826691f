//! Migrations beside a running service (issue 42, item 4; docs/storage.md, "Migrations
//! beside traffic"). A migration that waits for a lock also queues every later request for
//! that table behind it: an `ALTER TABLE outbox_events` waiting on one open SQL-API
//! transaction would stop every Enqueue and relay until that transaction ends. So the
//! migrator's session runs with a short `lock_timeout` ([`MigrationWait::lock_timeout`]):
//! a migration that cannot get its lock within it fails with `55P03` and is rolled back
//! (sqlx runs each migration in its own transaction), the service's queued requests go on,
//! and the migrator tries again after a pause (doubling, with jitter) until
//! [`MigrationWait::max_wait`] has passed; then it fails and names who held the lock. The
//! same holds for sqlx's own advisory lock, which serializes migrators: the migrator only
//! tries it, so a session that keeps it (another migrator, or anyone: advisory locks need
//! no privilege) makes this one try again and then fail, never hang.

use std::collections::HashSet;
use std::fmt;
use std::time::{Duration, Instant};

use sqlx::migrate::{Migrate, MigrateError, Migrator};
use sqlx::{PgConnection, PgPool};

use super::PoolShape;
use crate::backoff::Backoff;

/// How the migrator waits for locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationWait {
    /// `lock_timeout` of the migrator's session: the longest any request of the service
    /// queues behind a migration that waits for a lock.
    pub lock_timeout: Duration,
    /// How long the migrator keeps trying, in all, before it fails.
    pub max_wait: Duration,
    /// The first pause between tries; it doubles up to `backoff_max`, with equal jitter.
    pub backoff_min: Duration,
    /// The longest pause between tries.
    pub backoff_max: Duration,
}

impl Default for MigrationWait {
    fn default() -> Self {
        MigrationWait {
            lock_timeout: Duration::from_millis(500),
            max_wait: Duration::from_secs(600),
            backoff_min: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
        }
    }
}

impl MigrationWait {
    /// The migrator's pool: two connections (one migrates, one reads who holds a lock),
    /// no statement timeout (building an index on a large table may take longer than any
    /// query of the service should); its `lock_timeout` is in the profile (`profile`).
    pub fn pool_shape(&self, acquire_timeout: Duration) -> PoolShape {
        PoolShape {
            max_connections: 2,
            acquire_timeout,
            statement_timeout: None,
            lazy: false,
            plans: super::Plans::Server,
        }
    }

    /// The migrator's session profile for the data schema `schema`, with this wait's
    /// `lock_timeout`.
    pub fn profile(&self, schema: &str) -> super::profile::SessionProfile {
        super::profile::SessionProfile {
            lock_timeout: Some(self.lock_timeout),
            ..super::profile::SessionProfile::migrator(schema)
        }
    }
}

/// Why migrating failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// Every try waited longer than `lock_timeout` for a lock, until `max_wait` passed.
    #[error(
        "gave up after {attempts} tries over {waited:?} (MAILROOM_MIGRATION_MAX_WAIT_MS): \
         {what} stayed locked (each try waits at most lock_timeout {lock_timeout:?}); \
         sessions holding locks on mailroom's tables or the migration lock: {holders}"
    )]
    LockWait {
        /// What the last try waited for.
        what: Waited,
        /// Tries made.
        attempts: u32,
        /// Time since the first try.
        waited: Duration,
        /// The migrator's `lock_timeout`.
        lock_timeout: Duration,
        /// Who held locks when the last try gave up (see [`lock_holders`]).
        holders: String,
    },
    /// A migration failed for another reason: retrying cannot help.
    #[error("migration failed: {0}")]
    Failed(#[from] MigrateError),
}

/// What a try waited for when it timed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Waited {
    /// A lock a migration's SQL needed (it was rolled back).
    Migration {
        /// Its version.
        version: i64,
        /// Its description (the file name's tail).
        description: String,
    },
    /// sqlx's advisory lock that serializes migrators: another session holds it.
    MigrationLock,
    /// sqlx's bookkeeping table, `_sqlx_migrations`.
    Bookkeeping,
}

impl fmt::Display for Waited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Waited::Migration {
                version,
                description,
            } => write!(f, "migration {version} ({description})"),
            Waited::MigrationLock => {
                f.write_str("the migration lock (another migrator, or a session holding it)")
            }
            Waited::Bookkeeping => f.write_str("the migrations table (_sqlx_migrations)"),
        }
    }
}

/// How a successful run went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationReport {
    /// Tries made (1: no lock wait ran out).
    pub attempts: u32,
    /// Time from the first try to success.
    pub took: Duration,
}

/// Runs `migrator` on `pool` (built from [`MigrationWait::pool_shape`], so that its
/// sessions carry the `lock_timeout`), trying again whenever a try fails on a lock wait.
pub async fn run(
    mut migrator: Migrator,
    pool: &PgPool,
    wait: MigrationWait,
) -> Result<MigrationReport, MigrationError> {
    // The runner tries sqlx's lock itself (the same key, so older binaries' migrators
    // are still kept apart), and holds it across the steps of `attempt`.
    migrator.set_locking(false);
    let started = Instant::now();
    let mut backoff = Backoff::new(wait.backoff_min, wait.backoff_max);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let mut conn = pool.acquire().await.map_err(MigrateError::from)?;
        let e = match attempt(&migrator, &mut conn).await {
            Ok(()) => {
                return Ok(MigrationReport {
                    attempts,
                    took: started.elapsed(),
                });
            }
            Err(e) => e,
        };
        // The session may still hold the migration lock (a session lock) and a failed
        // transaction: end it rather than hand it back to the pool.
        let _ = conn.close().await;
        let what = match e {
            Try::LockBusy => Waited::MigrationLock,
            Try::Failed(e) => match lock_wait(&migrator, &e) {
                Some(what) => what,
                None => return Err(MigrationError::Failed(e)),
            },
        };
        let holders = lock_holders(pool, wait.lock_timeout).await;
        let pause = backoff.failed(&mut rand::rng());
        let waited = started.elapsed();
        if waited + pause > wait.max_wait {
            return Err(MigrationError::LockWait {
                what,
                attempts,
                waited,
                lock_timeout: wait.lock_timeout,
                holders,
            });
        }
        tracing::warn!(
            attempt = attempts,
            waited_for = %what,
            lock_timeout_ms = super::millis(wait.lock_timeout),
            %holders,
            retry_in_ms = super::millis(pause),
            waited_ms = super::millis(waited),
            "migrating waits for a lock: this try was rolled back (the service's requests \
             queued behind it waited at most lock_timeout); trying again"
        );
        tokio::time::sleep(pause).await;
    }
}

/// How a try failed.
enum Try {
    /// Another session holds the migration lock.
    LockBusy,
    /// A migration or sqlx's bookkeeping failed.
    Failed(MigrateError),
}

impl From<MigrateError> for Try {
    fn from(e: MigrateError) -> Self {
        Try::Failed(e)
    }
}

impl From<sqlx::Error> for Try {
    fn from(e: sqlx::Error) -> Self {
        Try::Failed(e.into())
    }
}

/// One try: the migration lock, then each pending migration in a step of its own, so
/// that a `-- no-transaction` migration (an index built `CONCURRENTLY`, alone in its
/// file: docs/storage.md, "Writing a migration") runs without the `lock_timeout`. Such a
/// build never queues the service's requests (its lock, SHARE UPDATE EXCLUSIVE, does not
/// conflict with reads and writes), but it waits for every transaction older than itself;
/// timed out, it would leave an invalid index behind.
///
/// The migration lock is only *tried*: a migrator waiting in `pg_advisory_lock` is a
/// transaction a concurrent index build of the migrator holding the lock waits for, a
/// deadlock (docs/guarantees.md, "Replicas started together"). Between tries a waiting
/// migrator holds nothing.
async fn attempt(migrator: &Migrator, conn: &mut PgConnection) -> Result<(), Try> {
    let database: String = sqlx::query_scalar("SELECT pg_catalog.current_database()")
        .fetch_one(&mut *conn)
        .await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_catalog.pg_try_advisory_lock($1)")
        .bind(migration_lock_id(&database))
        .fetch_one(&mut *conn)
        .await?;
    if !locked {
        return Err(Try::LockBusy);
    }
    conn.ensure_migrations_table(&migrator.table_name).await?;
    let applied: HashSet<i64> = conn
        .list_applied_migrations(&migrator.table_name)
        .await?
        .into_iter()
        .map(|m| m.version)
        .collect();
    let pending = migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration() && !applied.contains(&m.version));
    // The session's own value, restored after each lift: `RESET` would return to the
    // value the session started with, not one its profile set after connecting.
    let lock_timeout: String =
        sqlx::query_scalar("SELECT pg_catalog.current_setting('lock_timeout')")
            .fetch_one(&mut *conn)
            .await?;
    for m in pending {
        if m.no_tx {
            set_lock_timeout(conn, "0").await?;
        }
        // Applies `m` (and checks what is applied, as a whole run would).
        migrator
            .run_direct(Some(m.version), &mut *conn, false)
            .await?;
        if m.no_tx {
            set_lock_timeout(conn, &lock_timeout).await?;
        }
    }
    // Validates what is applied even when nothing was pending.
    migrator.run_direct(None, &mut *conn, false).await?;
    sqlx::query("SELECT pg_catalog.pg_advisory_unlock($1)")
        .bind(migration_lock_id(&database))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn set_lock_timeout(conn: &mut PgConnection, value: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_catalog.set_config('lock_timeout', $1, false)")
        .bind(value)
        .execute(conn)
        .await
        .map(drop)
}

/// Whether `e` is a lock wait that ran out (`55P03 lock_not_available`), and of what.
fn lock_wait(migrator: &Migrator, e: &MigrateError) -> Option<Waited> {
    let timed_out = |e: &sqlx::Error| matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"));
    match e {
        MigrateError::ExecuteMigration(e, version) if timed_out(e) => {
            let description = migrator
                .iter()
                .find(|m| m.version == *version)
                .map(|m| m.description.to_string())
                .unwrap_or_default();
            Some(Waited::Migration {
                version: *version,
                description,
            })
        }
        MigrateError::Execute(e) if timed_out(e) => Some(Waited::Bookkeeping),
        _ => None,
    }
}

/// The sessions that hold what a migration may wait for: locks on tables of the schema
/// holding `_sqlx_migrations` in a transaction open longer than `lock_timeout` (a
/// service request holds its locks for milliseconds), and the migration lock. Best
/// effort: the log line says so when they cannot be read.
async fn lock_holders(pool: &PgPool, lock_timeout: Duration) -> String {
    let read = async {
        let database: String = sqlx::query_scalar("SELECT current_database()")
            .fetch_one(pool)
            .await?;
        let key = migration_lock_id(&database);
        sqlx::query_scalar::<_, Option<String>>(
            "SELECT string_agg(format('pid %s (%s, %s, %s, last statement: %s)',
                                      a.pid, a.usename, a.state,
                                      COALESCE('transaction open '
                                               || floor(extract(epoch FROM now() - a.xact_start))
                                               || ' s', 'no transaction'),
                                      left(regexp_replace(a.query, '\\s+', ' ', 'g'), 80)),
                               '; ' ORDER BY a.pid)
             FROM pg_stat_activity a
             WHERE a.pid <> pg_backend_pid() AND a.pid IN (
                 SELECT l.pid FROM pg_locks l
                 WHERE l.granted
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                   AND ((l.locktype = 'relation'
                         AND l.relation IN (
                             SELECT c.oid FROM pg_class c
                             WHERE c.relnamespace = (SELECT relnamespace FROM pg_class
                                                     WHERE oid = to_regclass('_sqlx_migrations')))
                         AND a.xact_start < now() - make_interval(secs => $1))
                        OR (l.locktype = 'advisory' AND l.objsubid = 1
                            AND ((l.classid::bigint << 32) | l.objid::bigint) = $2)))",
        )
        .bind(lock_timeout.as_secs_f64())
        .bind(key)
        .fetch_one(pool)
        .await
    };
    match read.await {
        Ok(Some(holders)) => holders,
        Ok(None) => "none any more".into(),
        Err(e) => format!("could not be read: {e}"),
    }
}

/// The key of sqlx's advisory lock that serializes migrators on a database
/// (sqlx-postgres `generate_lock_id`: `0x3d32ad9e · crc32(database name)`).
fn migration_lock_id(database: &str) -> i64 {
    0x3d32_ad9e * i64::from(crc32(database.as_bytes()))
}

/// CRC-32 (ISO HDLC, the zlib one), bit by bit: only ever of a database name.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key itself is checked against a held lock in tests/it/migrations.rs.
    #[test]
    fn crc32_is_the_zlib_one() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }
}

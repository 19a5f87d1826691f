//! Migrations never stop the service (issue 42, item 4; docs/storage.md, "Migrations
//! beside traffic"): the migrator waits for locks with a short `lock_timeout` and tries
//! again, so a pending `ALTER TABLE` behind an open SQL-API transaction never queues the
//! service's Enqueues for longer; a session holding the migration lock makes migrating
//! fail after the bounded wait, naming it; counters are exact after a migration that ran
//! beside settles; indexes are built concurrently in migrations of their own.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::*;
use mailroom::pb;
use mailroom::store::postgres::migrate::{self, MigrationError, MigrationWait, Waited};
use mailroom::store::postgres::{PgStore, pool};
use sqlx::migrate::{Migrate, Migrator};
use sqlx::{Connection, PgConnection, PgPool};

/// The migrator's wait in these tests: quick tries, so a migration lands soon after the
/// lock it needs is free.
fn quick_wait(lock_timeout: Duration, max_wait: Duration) -> MigrationWait {
    MigrationWait {
        lock_timeout,
        max_wait,
        backoff_min: Duration::from_millis(250),
        backoff_max: Duration::from_secs(1),
    }
}

async fn migrator_pool(url: &str, wait: MigrationWait) -> PgPool {
    pool(
        url,
        wait.pool_shape(Duration::from_secs(3)),
        &wait.profile("public"),
    )
    .await
    .unwrap()
}

/// A runtime migrator of the real migrations plus `extra` files (name, SQL).
async fn migrator_with(extra: &[(&str, &str)]) -> Migrator {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir("migrations/postgres").unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    for (name, sql) in extra {
        std::fs::write(dir.path().join(name), sql).unwrap();
    }
    Migrator::new(dir.path()).await.unwrap()
}

fn summary(ms: &[Duration]) -> String {
    let mut v: Vec<u128> = ms.iter().map(|d| d.as_millis()).collect();
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
    format!(
        "{} Enqueues, p50 {} ms, p99 {} ms, max {} ms",
        v.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

/// The case, shortened: a producer's SQL-API transaction stays open (8 s here,
/// standing for the 60 s: what matters is that it outlasts many lock timeouts
/// and backoffs) while a migration with an `ALTER TABLE outbox_events` is pending. On
/// today's main the migration's ACCESS EXCLUSIVE request queued every Enqueue behind it
/// for the whole transaction. Now each try waits at most `lock_timeout` (200 ms) and is
/// rolled back: Enqueues keep answering within that bound, and the migration lands once
/// the transaction ends. The relays publish meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueues_keep_answering_while_a_migration_waits_behind_an_open_sql_transaction() {
    const HOLD: Duration = Duration::from_secs(8);
    let lock_timeout = Duration::from_millis(200);
    // Relays on (the embedded sink): they settle beside the migration too.
    let url = fresh_pg().await;
    let mut s = Service::start(config(&url)).await;

    let mut before = Vec::new();
    for i in 0..50 {
        let t = Instant::now();
        enqueue(&mut s.client, event("mig.before", &format!("k{i}"), b"x")).await;
        before.push(t.elapsed());
    }

    let mut producer = PgConnection::connect(&url).await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    sqlx::query("SELECT mailroom.enqueue('sql.open', 'held', '\\x01'::bytea)")
        .execute(&mut *tx)
        .await
        .unwrap();

    let migrator = migrator_with(&[(
        "9000_test_alter.sql",
        "ALTER TABLE outbox_events ADD COLUMN migration_test_note TEXT;",
    )])
    .await;
    let wait = quick_wait(lock_timeout, Duration::from_secs(60));
    let mpool = migrator_pool(&url, wait).await;
    let running = tokio::spawn({
        let mpool = mpool.clone();
        async move { migrate::run(migrator, &mpool, wait).await }
    });

    let held = Instant::now();
    let (mut during, mut refused) = (Vec::new(), Vec::new());
    let mut i = 0;
    while held.elapsed() < HOLD {
        let t = Instant::now();
        let e = event("mig.during", &format!("k{i}"), b"x");
        let r = s
            .client
            .enqueue(pb::EnqueueRequest { event: Some(e) })
            .await;
        during.push(t.elapsed());
        if let Err(e) = r {
            refused.push(format!(
                "after {:?}: {:?} {}",
                t.elapsed(),
                e.code(),
                e.message()
            ));
        }
        i += 1;
    }
    assert!(
        refused.is_empty(),
        "Enqueues refused during the migration: {refused:?}; {}",
        summary(&during)
    );
    // The relays publish what was enqueued meanwhile, while the transaction is still
    // open and the migration still trying.
    let enqueued = (before.len() + during.len()) as i64;
    wait_completed(&s.app.store, enqueued, Duration::from_secs(5)).await;
    assert!(
        !running.is_finished(),
        "the migration cannot land while the transaction is open"
    );
    tx.commit().await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(20), running)
        .await
        .expect("the migration lands once the transaction ends")
        .unwrap()
        .expect("migrated");
    let landed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute
                        WHERE attrelid = 'outbox_events'::regclass
                          AND attname = 'migration_test_note')",
    )
    .fetch_one(&mpool)
    .await
    .unwrap();
    assert!(landed);

    let mut after = Vec::new();
    for i in 0..50 {
        let t = Instant::now();
        enqueue(&mut s.client, event("mig.after", &format!("k{i}"), b"x")).await;
        after.push(t.elapsed());
    }
    println!(
        "before: {}\nduring an {HOLD:?} hold ({} migration tries, lock_timeout {lock_timeout:?}): {}\nafter: {}",
        summary(&before),
        report.attempts,
        summary(&during),
        summary(&after)
    );
    assert!(report.attempts > 1, "{report:?}");
    let worst = during.iter().max().unwrap();
    assert!(
        *worst <= lock_timeout + Duration::from_millis(500),
        "an Enqueue took {worst:?} during the migration: {}",
        summary(&during)
    );
}

/// What an operator reads when the wait runs out behind a transaction: the migration
/// that waited (version and name) and the session to wait for or end, with its pid, its
/// state and its open transaction (the retry log lines carry the same fields).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_that_keeps_waiting_fails_naming_itself_and_the_holder() {
    let url = fresh_pg().await;
    let wait = quick_wait(Duration::from_millis(200), Duration::from_secs(1));
    let mpool = migrator_pool(&url, wait).await;
    migrate::run(PgStore::migrator(), &mpool, wait)
        .await
        .unwrap();
    let mut producer = PgConnection::connect(&url).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut producer)
        .await
        .unwrap();
    let mut tx = producer.begin().await.unwrap();
    sqlx::query("SELECT mailroom.enqueue('sql.open', 'held', '\\x01'::bytea)")
        .execute(&mut *tx)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let migrator = migrator_with(&[(
        "9000_test_alter.sql",
        "ALTER TABLE outbox_events ADD COLUMN migration_test_note TEXT;",
    )])
    .await;
    let e = migrate::run(migrator, &mpool, wait).await.unwrap_err();
    let text = e.to_string();
    println!("{text}");
    let MigrationError::LockWait { what, holders, .. } = e else {
        panic!("expected a lock wait: {text}");
    };
    assert_eq!(
        what,
        Waited::Migration {
            version: 9000,
            description: "test alter".into()
        }
    );
    assert!(
        holders.contains(&format!(
            "pid {pid} (postgres, idle in transaction, transaction open"
        )),
        "{holders}"
    );
    assert!(holders.contains("mailroom.enqueue"), "{holders}");
    tx.rollback().await.unwrap();
}

/// A `-- no-transaction` migration building an index `CONCURRENTLY` runs without the
/// lock timeout: it waits for the open SQL-API transaction (its lock queues no Enqueue)
/// and completes at its first try with a valid index. Under the lock timeout it would
/// fail with `55P03`, leave an invalid index behind, and its retry would fail on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_index_build_waits_out_an_open_transaction_at_its_first_try() {
    const HOLD: Duration = Duration::from_secs(2);
    let lock_timeout = Duration::from_millis(200);
    let (url, mut s) = quiet_pg().await;
    let mut producer = PgConnection::connect(&url).await.unwrap();
    let mut tx = producer.begin().await.unwrap();
    sqlx::query("SELECT mailroom.enqueue('sql.open', 'held', '\\x01'::bytea)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let migrator = migrator_with(&[(
        "9000_test_index.sql",
        "-- no-transaction\nCREATE INDEX CONCURRENTLY outbox_events_test_type \
         ON outbox_events (event_type);",
    )])
    .await;
    let wait = quick_wait(lock_timeout, Duration::from_secs(60));
    let mpool = migrator_pool(&url, wait).await;
    let running = tokio::spawn({
        let mpool = mpool.clone();
        async move { migrate::run(migrator, &mpool, wait).await }
    });
    let held = Instant::now();
    let mut during = Vec::new();
    while held.elapsed() < HOLD {
        let t = Instant::now();
        enqueue(&mut s.client, event("mig.index", "k", b"x")).await;
        during.push(t.elapsed());
    }
    if running.is_finished() {
        panic!(
            "the build did not wait for the transaction: {:?}",
            running.await.unwrap()
        );
    }
    tx.commit().await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(20), running)
        .await
        .expect("the build completes once the transaction ends")
        .unwrap()
        .expect("migrated");
    println!(
        "index build: {report:?}; Enqueues meanwhile: {}",
        summary(&during)
    );
    assert_eq!(report.attempts, 1);
    let valid: bool = sqlx::query_scalar(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'outbox_events_test_type'::regclass",
    )
    .fetch_one(&mpool)
    .await
    .unwrap();
    assert!(valid);
    let worst = during.iter().max().unwrap();
    assert!(*worst <= Duration::from_millis(500), "{}", summary(&during));
}

/// sqlx's advisory lock serializes migrators, and any session may take it (advisory
/// locks need no privilege). Held, it made the migrator wait forever; now the migrator
/// tries within its bounded wait, then fails naming the holder, and migrates once the
/// lock is free. The holder takes the lock through sqlx's own `Migrate::lock`, so the
/// runner's key is checked against sqlx's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_holding_the_migration_lock_makes_migrating_fail_not_hang() {
    let url = fresh_pg().await;
    let mut holder = PgConnection::connect(&url).await.unwrap();
    holder.lock().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut holder)
        .await
        .unwrap();

    let wait = quick_wait(Duration::from_millis(200), Duration::from_secs(2));
    let mpool = migrator_pool(&url, wait).await;
    let t = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        migrate::run(PgStore::migrator(), &mpool, wait),
    )
    .await
    .expect("the migrator gives up within its bounded wait instead of hanging");
    let took = t.elapsed();
    match r {
        Err(e @ MigrationError::LockWait { .. }) => {
            let text = e.to_string();
            println!("after {took:?}: {text}");
            let MigrationError::LockWait {
                what,
                attempts,
                holders,
                ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!(what, Waited::MigrationLock);
            assert!(attempts > 1, "{attempts}");
            assert!(holders.contains(&format!("pid {pid} ")), "{holders}");
        }
        other => panic!("expected a lock wait, got {other:?}"),
    }
    assert!(took < Duration::from_secs(5), "{took:?}");

    holder.unlock().await.unwrap();
    let report = migrate::run(PgStore::migrator(), &mpool, wait)
        .await
        .unwrap();
    assert_eq!(report.attempts, 1);
}

/// Completed events and the counters' sum, per topic `counted`.
async fn completed(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox_events_view
                 WHERE status = 'completed' AND topic = 'counted'),
                (SELECT COALESCE(sum(n), 0)::bigint FROM outbox_completed_counts
                 WHERE topic = 'counted')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// 0016 counted the completed events once and then created the triggers that keep the
/// count. A relay's settle in flight during the count (6 events here: settled, not yet
/// committed) committed while the trigger creation waited for it: neither counted nor
/// triggered, the counter stayed 6 short for good (500 vs 506 on today's main). A relay
/// settling one event at a time throughout the migration adds whatever lands in the same
/// window. Now 0021 reconciles the counters from one snapshot: they are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settles_during_a_counting_migration_leave_exact_counters() {
    let url = fresh_pg().await;
    let pool = PgPool::connect(&url).await.unwrap();
    Migrator::new(Path::new("migrations/postgres"))
        .await
        .unwrap()
        .run_to(15, &pool)
        .await
        .unwrap();
    for (status, kind, n) in [
        ("completed", "old", 500),
        ("pending", "inflight", 6),
        ("pending", "steady", 300),
    ] {
        sqlx::query(
            "INSERT INTO outbox_events (topic, payload, event_type, status, max_attempts,
                                        scheduled_at, published_at)
             SELECT 'counted', '\\x00', $2, $1, 5, now(),
                    CASE WHEN $1 = 'completed' THEN now() END
             FROM generate_series(1, $3)",
        )
        .bind(status)
        .bind(kind)
        .bind(n)
        .execute(&pool)
        .await
        .unwrap();
    }
    // The statement a relay settles unkeyed events with.
    const SETTLE: &str = "UPDATE outbox_events
        SET status = 'completed', published_at = now(), updated_at = now()
        WHERE id IN (SELECT id FROM outbox_events
                     WHERE status = 'pending' AND event_type = $1
                     ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)";

    let mut inflight = pool.begin().await.unwrap();
    sqlx::query(SETTLE)
        .bind("inflight")
        .bind(6i64)
        .execute(&mut *inflight)
        .await
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let steady = tokio::spawn({
        let (pool, stop) = (pool.clone(), stop.clone());
        async move {
            let mut settled = 0u64;
            while !stop.is_cancelled() {
                let r = sqlx::query(SETTLE)
                    .bind("steady")
                    .bind(1i64)
                    .execute(&pool)
                    .await
                    .unwrap();
                settled += r.rows_affected();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            settled
        }
    });

    // A lock_timeout longer than the test's wait: the migration waits for the settle
    // instead of being rolled back and tried again (a later try would count it).
    let wait = quick_wait(Duration::from_secs(15), Duration::from_secs(60));
    let mpool = migrator_pool(&url, wait).await;
    let running = tokio::spawn({
        let mpool = mpool.clone();
        async move { migrate::run(PgStore::migrator(), &mpool, wait).await }
    });
    eventually(
        Duration::from_secs(30),
        "0016 waits for the in-flight settle",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                                WHERE datname = current_database() AND wait_event_type = 'Lock'
                                  AND query LIKE '-- Completed events counted as they complete%')",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        },
    )
    .await;
    inflight.commit().await.unwrap();
    running.await.unwrap().expect("migrated");
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.cancel();
    let settled = steady.await.unwrap();

    let (events, counters) = completed(&pool).await;
    println!("completed events {events}, counters {counters} ({settled} settled one by one)");
    assert_eq!(events, 500 + 6 + settled as i64);
    assert_eq!(
        counters, events,
        "the counters after migrating beside settles"
    );
}

/// What breaks the rule of docs/storage.md ("Writing a migration") in one migration file
/// `name` holding `sql`: from 0019 on, an index on an existing mailroom table is built
/// `CONCURRENTLY`, in a `-- no-transaction` migration holding that one statement (a
/// concurrent build cannot run in a transaction, and a no-transaction migration is sent
/// as one query string, which PostgreSQL runs as one transaction when it holds several
/// statements). An index on a table the same migration creates is built empty, at once.
fn index_rule_violations(name: &str, sql: &str) -> Vec<String> {
    let no_tx = sql.starts_with("-- no-transaction");
    let code: String = sql
        .lines()
        .map(|l| l.split("--").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase();
    let statements: Vec<Vec<&str>> = code
        .split(';')
        .map(|s| s.split_whitespace().collect::<Vec<_>>())
        .filter(|w| !w.is_empty())
        .collect();
    let unqualified = |t: &str| {
        t.rsplit('.')
            .next()
            .unwrap_or(t)
            .trim_matches('"')
            .to_string()
    };
    let mut created = Vec::new();
    let mut bad = Vec::new();
    for w in &statements {
        if w.starts_with(&["create", "table"]) {
            let t = w
                .iter()
                .skip(2)
                .find(|t| !["if", "not", "exists"].contains(t));
            created.extend(t.map(|t| unqualified(t.split('(').next().unwrap_or(t))));
        }
        let index_at = match w.as_slice() {
            ["create", "index", ..] => 2,
            ["create", "unique", "index", ..] => 3,
            _ => continue,
        };
        let on = w.iter().position(|t| *t == "on").map(|i| {
            let t = w.get(i + 1).copied().unwrap_or("");
            let t = if t == "only" {
                w.get(i + 2).copied().unwrap_or("")
            } else {
                t
            };
            unqualified(t.split('(').next().unwrap_or(t))
        });
        if on.as_ref().is_some_and(|t| created.contains(t)) {
            continue;
        }
        if w.get(index_at) != Some(&"concurrently") {
            bad.push(format!(
                "{name}: CREATE INDEX on {on:?} without CONCURRENTLY"
            ));
        } else if !no_tx {
            bad.push(format!(
                "{name}: a concurrent index build needs -- no-transaction"
            ));
        } else if statements.len() != 1 {
            bad.push(format!(
                "{name}: a concurrent index build is a migration of its own ({} statements)",
                statements.len()
            ));
        }
    }
    if no_tx
        && statements.iter().any(|w| {
            !(w.starts_with(&["create", "index", "concurrently"])
                || w.starts_with(&["create", "unique", "index", "concurrently"])
                || w.starts_with(&["drop", "index", "concurrently"]))
        })
    {
        // The migrator lifts its lock_timeout for these (src/store/postgres/migrate.rs):
        // only an index build or drop may run that way.
        bad.push(format!(
            "{name}: a -- no-transaction migration holds one concurrent index statement only"
        ));
    }
    bad
}

/// The rule above, over migrations/postgres from 0019 on (0015 built an index under the
/// ACCESS EXCLUSIVE lock of its ALTER TABLE, before the rule), and checked on examples
/// that break it.
#[test]
fn indexes_on_mailroom_tables_are_built_concurrently_in_migrations_of_their_own() {
    let mut bad = Vec::new();
    for f in std::fs::read_dir("migrations/postgres").unwrap() {
        let f = f.unwrap();
        let name = f.file_name().to_string_lossy().to_string();
        let version: i64 = name.split('_').next().unwrap().parse().unwrap();
        if version >= 19 {
            bad.extend(index_rule_violations(
                &name,
                &std::fs::read_to_string(f.path()).unwrap(),
            ));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");

    let fine = [
        "-- no-transaction\n-- why\nCREATE INDEX CONCURRENTLY outbox_x ON outbox_events (topic);\n",
        "-- no-transaction\nCREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS x ON @mr.outbox_keys (a)",
        "CREATE TABLE t_new (a int);\nCREATE INDEX t_new_a ON t_new (a);",
        "ALTER TABLE outbox_events ADD COLUMN z int; -- CREATE INDEX in a comment",
    ];
    for sql in fine {
        assert_eq!(
            index_rule_violations("fine", sql),
            Vec::<String>::new(),
            "{sql}"
        );
    }
    let broken = [
        "CREATE INDEX outbox_x ON outbox_events (topic);",
        "create unique index x on only @mr.outbox_keys (a);",
        "CREATE INDEX CONCURRENTLY outbox_x ON outbox_events (topic);",
        "-- no-transaction\nCREATE INDEX CONCURRENTLY a ON outbox_events (topic);\nCREATE INDEX CONCURRENTLY b ON outbox_events (id);",
        "-- no-transaction\nALTER TABLE outbox_events ADD COLUMN z int;",
    ];
    for sql in broken {
        assert!(!index_rule_violations("broken", sql).is_empty(), "{sql}");
    }
}

//! The SQL API (issue 16, docs/sql-api.md): `mailroom.enqueue` and `mailroom.enqueue_batch`
//! called inside the caller's own business transaction, from Rust (sqlx), against a real
//! mailroom. Commit publishes in key order; rollback and a crashed caller publish nothing;
//! concurrent transactions on one key publish in commit order; the rules, SQLSTATEs,
//! idempotency, pending counts and wake-ups are those of gRPC Enqueue; the producer role
//! can do nothing else.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::*;
use mailroom::domain::{BoxKind, NewEvent, Status};
use mailroom::pb;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Connection, Row};
use tonic_types::StatusExt;

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// `url` with another user.
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, h)| h);
    format!("{scheme}://{user}@{host}")
}

async fn admin(url: &str) -> sqlx::PgConnection {
    sqlx::PgConnection::connect(url).await.expect("connect")
}

/// The database's producer role (migration 0015: one per database).
async fn producer_role(url: &str) -> String {
    sqlx::query_scalar("SELECT mailroom_producer_role()")
        .fetch_one(&mut admin(url).await)
        .await
        .unwrap()
}

/// An application login role that holds the database's producer role, and its business
/// table `orders`, in the database at `url` (migrated already). Returns the role's pool.
async fn app_role(url: &str) -> (String, PgPool) {
    let role = unique("app");
    let producer = producer_role(url).await;
    let mut a = admin(url).await;
    for sql in [
        format!("CREATE ROLE {role} LOGIN IN ROLE \"{producer}\""),
        "CREATE TABLE IF NOT EXISTS orders (id BIGINT PRIMARY KEY, total INTEGER NOT NULL)"
            .to_string(),
        format!("GRANT SELECT, INSERT ON orders TO {role}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut a)
            .await
            .unwrap();
    }
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&as_user(url, &role))
        .await
        .expect("connect as the application role");
    (role, pool)
}

/// The SQLSTATE and the COLUMN field of a database error.
fn sqlstate(e: &sqlx::Error) -> (String, Option<String>) {
    let db = e.as_database_error().unwrap_or_else(|| panic!("{e}"));
    let pg = db
        .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        .unwrap();
    (pg.code().to_string(), pg.column().map(str::to_string))
}

async fn outbox_rows(url: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_events")
        .fetch_one(&mut admin(url).await)
        .await
        .unwrap()
}

/// Per key, `outbox_keys.pending` and the pending events actually stored.
async fn pending_counts(url: &str) -> Vec<(String, i64, i64)> {
    sqlx::query(
        "SELECT k.event_key, k.pending,
                (SELECT count(*) FROM outbox_events_view e WHERE e.topic = k.topic
                 AND e.event_key = k.event_key AND e.status = 'pending')
         FROM outbox_keys k ORDER BY 1",
    )
    .fetch_all(&mut admin(url).await)
    .await
    .unwrap()
    .into_iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// One business transaction: the order row and its events commit together or not at all.
async fn place_order(pool: &PgPool, order: i64, key: &str, payloads: &[&str], commit: bool) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id, total) VALUES ($1, 10)")
        .bind(order)
        .execute(&mut *tx)
        .await
        .unwrap();
    for p in payloads {
        let id: i64 = sqlx::query_scalar(
            "SELECT mailroom.enqueue(topic => $1, key => $2, payload => $3,
                                     headers => $4, type => 'order.created')",
        )
        .bind("sql.orders")
        .bind(key)
        .bind(p.as_bytes())
        .bind(serde_json::json!({"order": order.to_string()}))
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        assert!(id > 0);
    }
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
}

/// Starts `psql` as `user`, opens a transaction that inserts an order and enqueues an
/// event on `key`, waits until the server shows it idle in that transaction, holding the
/// key row, then kills the process (SIGKILL) with the transaction open.
async fn crash_in_transaction(url: &str, user: &str, order: i64, key: &str) {
    use tokio::io::AsyncWriteExt;
    let app_name = unique("crash");
    let mut child = tokio::process::Command::new("psql")
        .arg("-X")
        .arg("-q")
        .arg(as_user(url, user) + &format!("?application_name={app_name}"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("psql is required");
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(
            format!(
                "BEGIN;\nINSERT INTO orders (id, total) VALUES ({order}, 10);\n\
                 SELECT mailroom.enqueue('sql.orders', '{key}', 'crash'::bytea);\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    stdin.flush().await.unwrap();
    let mut a = admin(url).await;
    // The fault must fire with the event inserted: the caller's backend sits idle in its
    // transaction after the enqueue, and holds the key's order lock (a probe fails).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state: Option<String> = sqlx::query_scalar(
            "SELECT state FROM pg_stat_activity WHERE application_name = $1
             AND query LIKE '%mailroom.enqueue%'",
        )
        .bind(&app_name)
        .fetch_optional(&mut a)
        .await
        .unwrap();
        if state.as_deref() == Some("idle in transaction") {
            break;
        }
        assert!(Instant::now() < deadline, "psql never reached its enqueue");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut probe = a.begin().await.unwrap();
    // The order lock is the key's slot row (migration 0020), tried as a relay tries it.
    let free: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM mailroom_order_slots
                        WHERE slot = mailroom_order_slot('sql.orders', $1)
                        FOR SHARE SKIP LOCKED)",
    )
    .bind(key)
    .fetch_one(&mut *probe)
    .await
    .unwrap();
    assert!(!free, "the crashing caller holds the key's order lock");
    probe.rollback().await.unwrap();
    // Crash: the process dies with its transaction open.
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
                .bind(&app_name)
                .fetch_one(&mut a)
                .await
                .unwrap();
        if n == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server kept the dead backend"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_publishes_in_key_order_rollback_and_crash_publish_nothing() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(2));
    let quiet = quiet_window(&c);
    let s = Service::start(c).await;
    let (role, pool) = app_role(&url).await;

    // Committed: three events on o-1, then a batch of two on o-2 and one more on o-1.
    place_order(&pool, 1, "o-1", &["c1", "c2", "c3"], true).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id, total) VALUES (2, 20)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let rows = sqlx::query(
        "SELECT ord, id, duplicate FROM mailroom.enqueue_batch(
             topics => $1, keys => $2, payloads => $3)",
    )
    .bind(vec!["sql.orders"; 3])
    .bind(vec!["o-2", "o-2", "o-1"])
    .bind(vec![b"d1".to_vec(), b"d2".to_vec(), b"c4".to_vec()])
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let batch_ids: Vec<i64> = rows.iter().map(|r| r.get(1)).collect();
    assert!(batch_ids.windows(2).all(|w| w[0] < w[1]), "{batch_ids:?}");
    assert!(rows.iter().all(|r| !r.get::<bool, _>(2)));

    // Rolled back: the order and its event vanish together.
    place_order(&pool, 3, "o-1", &["rolled-back"], false).await;
    // Crashed between its insert and its commit.
    crash_in_transaction(&url, &role, 4, "o-1").await;
    // A last committed event on o-1, after both.
    place_order(&pool, 5, "o-1", &["c5"], true).await;

    wait_completed(&s.app.store, 7, Duration::from_secs(30)).await;
    let recs = consume(&broker.addr(), "sql.orders", 7, Duration::from_secs(30));
    let payloads = |key: &str| -> Vec<String> {
        recs.iter()
            .filter(|r| r.key == key)
            .map(|r| String::from_utf8(r.payload.clone()).unwrap())
            .collect()
    };
    assert_eq!(payloads("o-1"), ["c1", "c2", "c3", "c4", "c5"]);
    assert_eq!(payloads("o-2"), ["d1", "d2"]);
    let (per_key, dups) = first_deliveries(&recs);
    assert_eq!(dups, 0);
    for ids in per_key.values() {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    }

    // Nothing more comes: watch twice the poll and lease windows.
    tokio::time::sleep(quiet).await;
    let recs = consume(&broker.addr(), "sql.orders", 8, Duration::from_secs(5));
    assert_eq!(recs.len(), 7, "only the committed events were published");
    assert!(
        recs.iter()
            .all(|r| r.payload != b"rolled-back" && r.payload != b"crash")
    );
    assert_eq!(
        outbox_rows(&url).await,
        7,
        "rollback and crash stored nothing"
    );
    let orders: Vec<i64> = sqlx::query_scalar("SELECT id FROM orders ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(orders, [1, 2, 5]);
    for (key, counted, actual) in pending_counts(&url).await {
        assert_eq!((counted, actual), (0, 0), "pending count of {key}");
    }
    assert_no_gaps(&s.app.relay_stats);
    s.app.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transactions_on_one_key_publish_in_commit_order() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(2));
    let s = Service::start(c).await;
    let (_role, pool) = app_role(&url).await;

    const N: usize = 8;
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    // Order in which the transactions got the key (the enqueue returns once the key row
    // is locked, and it stays locked until the commit): the commit order.
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..N {
        let (pool, barrier, order) = (pool.clone(), barrier.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("INSERT INTO orders (id, total) VALUES ($1, 1)")
                .bind(100 + i as i64)
                .execute(&mut *tx)
                .await
                .unwrap();
            barrier.wait().await;
            let t0 = Instant::now();
            let id: i64 = sqlx::query_scalar("SELECT mailroom.enqueue('sql.hot', 'hot', $1)")
                .bind(format!("t{i}").into_bytes())
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            let waited = t0.elapsed();
            order.lock().unwrap().push((id, format!("t{i}")));
            tokio::time::sleep(Duration::from_millis(30)).await;
            // One of them rolls back: its id is never published.
            if i == 3 {
                tx.rollback().await.unwrap();
                (id, waited, false)
            } else {
                tx.commit().await.unwrap();
                (id, waited, true)
            }
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    // The transactions really overlapped: all but the first waited for the key row.
    let waited = results
        .iter()
        .filter(|(_, w, _)| *w >= Duration::from_millis(20))
        .count();
    assert!(
        waited >= N - 1,
        "only {waited} transactions waited for the key"
    );
    let order = order.lock().unwrap().clone();
    let ids: Vec<i64> = order.iter().map(|(id, _)| *id).collect();
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "ids in commit order: {ids:?}"
    );
    let rolled_back = results.iter().find(|r| !r.2).unwrap().0;
    let expected: Vec<String> = order
        .iter()
        .filter(|(id, _)| *id != rolled_back)
        .map(|(_, p)| p.clone())
        .collect();

    wait_completed(&s.app.store, (N - 1) as i64, Duration::from_secs(30)).await;
    let recs = consume(&broker.addr(), "sql.hot", N - 1, Duration::from_secs(30));
    let got: Vec<String> = recs
        .iter()
        .map(|r| String::from_utf8(r.payload.clone()).unwrap())
        .collect();
    assert_eq!(got, expected, "published in commit order");
    let (per_key, _) = first_deliveries(&recs);
    assert!(!per_key["hot"].contains(&rolled_back));
    assert_no_gaps(&s.app.relay_stats);
    s.app.stop().await.unwrap();
}

/// The same content fingerprint, idempotency answers and pending counts as gRPC Enqueue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_and_pending_counts_match_grpc() {
    let (url, mut s) = quiet_pg().await;
    let (_role, pool) = app_role(&url).await;

    // The SQL fingerprint is Rust's, for every content field.
    let after = chrono::DateTime::parse_from_rfc3339("2030-01-02T03:04:05.123456Z")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let cases = [
        NewEvent {
            topic: "orders".into(),
            key: Some("42".into()),
            payload: vec![0, 1, 2],
            headers: [("a".to_string(), "b".to_string())].into(),
            event_type: None,
            idempotency_key: Some("k".into()),
            deliver_after: None,
            max_attempts: 6,
        },
        NewEvent {
            topic: "a.b-c_d".into(),
            key: None,
            payload: (0..=255u8).collect(),
            headers: [
                ("zz".to_string(), "ünï ✓".to_string()),
                ("B".to_string(), String::new()),
                ("a".to_string(), "x".to_string()),
                ("traceparent".to_string(), "00-1-2-01".to_string()),
            ]
            .into(),
            event_type: Some("t".into()),
            idempotency_key: Some("k".into()),
            deliver_after: Some(after),
            max_attempts: 100,
        },
    ];
    let mut a = admin(&url).await;
    // `function(topic, key, payload, headers, type, deliver_after, max_attempts)` of `e`.
    fn fingerprint_call<'q, T>(
        function: &'q str,
        e: &'q NewEvent,
    ) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, T, sqlx::postgres::PgArguments>
    where
        T: Send + Unpin,
        (T,): for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
    {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT {function}($1, $2, $3, $4, $5, $6, $7)"
        )))
        .bind(&e.topic)
        .bind(&e.key)
        .bind(&e.payload)
        .bind(serde_json::to_value(&e.headers).unwrap())
        .bind(&e.event_type)
        .bind(e.deliver_after)
        .bind(e.max_attempts as i32)
    }
    for e in &cases {
        let sql: i64 = fingerprint_call("mailroom_fingerprint", e)
            .fetch_one(&mut a)
            .await
            .unwrap();
        assert_eq!(sql, e.fingerprint(), "{e:?}");
        // The 128-bit form, the one idempotency compares today (content_fp version 2).
        let sql128: Vec<u8> = fingerprint_call("mailroom_fingerprint128", e)
            .fetch_one(&mut a)
            .await
            .unwrap();
        assert_eq!(sql128, e.fingerprint128(), "{e:?}");
    }

    // SQL first, then gRPC with the same content: the original id, a duplicate.
    let sql_id: i64 = sqlx::query_scalar(
        "SELECT mailroom.enqueue('shared', 'k1', '\\x0102', '{\"h\":\"v\"}', 'ty', 'idem-1',
                                 '2030-01-02T03:04:05.123456Z', 0)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let grpc_event = pb::Event {
        topic: "shared".into(),
        key: "k1".into(),
        payload: vec![1, 2],
        headers: [("h".to_string(), "v".to_string())].into(),
        r#type: "ty".into(),
        idempotency_key: "idem-1".into(),
        deliver_after: Some(prost_types::Timestamp {
            seconds: after.timestamp(),
            nanos: 123_456_000,
        }),
        max_attempts: 0,
    };
    let r = enqueue_reply(&mut s.client, grpc_event.clone()).await;
    assert_eq!((r.id, r.duplicate), (sql_id, true));
    // gRPC with other content: ALREADY_EXISTS.
    let mut other = grpc_event.clone();
    other.payload = vec![9];
    let e = enqueue_err(&mut s.client, Some(other)).await;
    assert_eq!(e.code(), tonic::Code::AlreadyExists);
    // SQL again: same content is the original id; other content is MR020 and stores nothing.
    let again: i64 = sqlx::query_scalar(
        "SELECT mailroom.enqueue('shared', 'k1', '\\x0102', '{\"h\":\"v\", \"traceparent\": \"00-x\"}',
                                 'ty', 'idem-1', '2030-01-02T03:04:05.123456Z', 6)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(again, sql_id);
    let e = sqlx::query_scalar::<_, i64>(
        "SELECT mailroom.enqueue('shared', 'k1', '\\x09', idempotency_key => 'idem-1')",
    )
    .fetch_one(&pool)
    .await
    .unwrap_err();
    assert_eq!(
        sqlstate(&e),
        ("MR020".to_string(), Some("idempotency_key".to_string()))
    );
    // gRPC first, then SQL.
    let r = s
        .client
        .enqueue(pb::EnqueueRequest {
            event: Some(pb::Event {
                topic: "shared".into(),
                key: "k2".into(),
                payload: b"p".to_vec(),
                idempotency_key: "idem-2".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let from_sql: i64 = sqlx::query_scalar(
        "SELECT mailroom.enqueue('shared', 'k2', 'p'::bytea, idempotency_key => 'idem-2')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(from_sql, r.id);

    // The batch form: duplicates within the batch and of stored events are flagged.
    let rows = sqlx::query(
        "SELECT ord, id, duplicate FROM mailroom.enqueue_batch(
             ARRAY['shared','shared','shared','shared'], ARRAY['k1','k3','k3','k1'],
             ARRAY['\\x0102'::bytea, 'a', 'a', 'plain'],
             ARRAY['{\"h\":\"v\"}'::jsonb, NULL, NULL, NULL], ARRAY['ty', NULL, NULL, NULL],
             ARRAY['idem-1', 'idem-3', 'idem-3', NULL],
             ARRAY['2030-01-02T03:04:05.123456Z'::timestamptz, NULL, NULL, NULL])",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let got: Vec<(i32, bool)> = rows.iter().map(|r| (r.get(0), r.get(2))).collect();
    assert_eq!(got, [(1, true), (2, false), (3, true), (4, false)]);
    assert_eq!(rows[0].get::<i64, _>(1), sql_id);
    assert_eq!(rows[1].get::<i64, _>(1), rows[2].get::<i64, _>(1));
    // A batch with a conflict stores nothing of it.
    let before = outbox_rows(&url).await;
    let e = sqlx::query(
        "SELECT * FROM mailroom.enqueue_batch(ARRAY['shared','shared'], ARRAY['k4','k1'],
             idempotency_keys => ARRAY[NULL, 'idem-1'])",
    )
    .fetch_all(&pool)
    .await
    .unwrap_err();
    assert_eq!(
        sqlstate(&e),
        (
            "MR020".to_string(),
            Some("events[2].idempotency_key".to_string())
        )
    );
    assert_eq!(outbox_rows(&url).await, before);

    // Rolled back events leave the counts alone; every key's count is exact.
    let mut tx = pool.begin().await.unwrap();
    for k in ["k1", "k5", "k5"] {
        sqlx::query("SELECT mailroom.enqueue('shared', $1)")
            .bind(k)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.rollback().await.unwrap();
    // No relay runs here: take the SQL events into their keys as a relay's claim does.
    s.app.store.fold_sql_events().await.unwrap();
    let counts = pending_counts(&url).await;
    assert!(!counts.is_empty());
    for (key, counted, actual) in &counts {
        assert_eq!(counted, actual, "pending count of {key}: {counts:?}");
    }
    let k1 = counts.iter().find(|c| c.0 == "k1").unwrap();
    assert_eq!(k1.2, 2, "idem-1 once, plus the batch's plain event");
    // The stored event has the content and the resolved defaults.
    let stored = s.stored(BoxKind::Outbox, sql_id).await;
    assert_eq!(stored.payload, vec![1, 2]);
    assert_eq!(stored.max_attempts, 6);
    assert_eq!(stored.event_type.as_deref(), Some("ty"));
    assert_eq!(stored.scheduled_at, after);
    assert_eq!(stored.status, Status::Pending);
    s.app.stop().await.unwrap();
}

/// Every rule has its SQLSTATE and names its argument; a refused call stores nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_errors_have_documented_sqlstates_and_store_nothing() {
    let (url, s) = quiet_pg().await;
    let (_role, pool) = app_role(&url).await;
    let long = |n: usize| format!("'{}'", "x".repeat(n));
    let cases: Vec<(String, &str, &str)> = vec![
        ("mailroom.enqueue('')".into(), "MR001", "topic"),
        ("mailroom.enqueue(NULL)".into(), "MR001", "topic"),
        ("mailroom.enqueue('a b')".into(), "MR001", "topic"),
        ("mailroom.enqueue('é')".into(), "MR001", "topic"),
        ("mailroom.enqueue('..')".into(), "MR001", "topic"),
        (format!("mailroom.enqueue({})", long(250)), "MR001", "topic"),
        (format!("mailroom.enqueue('t', {})", long(1025)), "MR002", "key"),
        (
            "mailroom.enqueue('t', payload => convert_to(repeat('x', 1015821), 'UTF8'))".into(),
            "MR003",
            "payload",
        ),
        ("mailroom.enqueue('t', headers => '[1]')".into(), "MR004", "headers"),
        ("mailroom.enqueue('t', headers => '{\"a\": 1}')".into(), "MR004", "headers"),
        (
            "mailroom.enqueue('t', headers => (SELECT jsonb_object_agg('h' || i, 'v') FROM generate_series(1, 65) i))"
                .into(),
            "MR005",
            "headers",
        ),
        (
            "mailroom.enqueue('t', headers => jsonb_build_object('h', repeat('v', 16384)))".into(),
            "MR006",
            "headers",
        ),
        ("mailroom.enqueue('t', headers => '{\"\": \"v\"}')".into(), "MR007", "headers"),
        ("mailroom.enqueue('t', headers => '{\"ce_id\": \"v\"}')".into(), "MR008", "headers"),
        (format!("mailroom.enqueue('t', type => {})", long(257)), "MR009", "type"),
        (
            format!("mailroom.enqueue('t', idempotency_key => {})", long(257)),
            "MR010",
            "idempotency_key",
        ),
        ("mailroom.enqueue('t', max_attempts => 101)".into(), "MR011", "max_attempts"),
        ("mailroom.enqueue('t', max_attempts => -1)".into(), "MR011", "max_attempts"),
        ("mailroom.enqueue('t', deliver_after => 'infinity')".into(), "MR012", "deliver_after"),
        (
            "mailroom.enqueue('t', deliver_after => '10000-01-01T00:00:00Z')".into(),
            "MR012",
            "deliver_after",
        ),
        ("mailroom.enqueue_batch(ARRAY[]::text[])".into(), "MR030", "topics"),
        (
            "mailroom.enqueue_batch(array_fill('t'::text, ARRAY[1001]))".into(),
            "MR031",
            "topics",
        ),
        ("mailroom.enqueue_batch(ARRAY['t','t'], ARRAY['k'])".into(), "MR032", "keys"),
        (
            "mailroom.enqueue_batch(ARRAY['t','t'], payloads => ARRAY['\\x'::bytea])".into(),
            "MR032",
            "payloads",
        ),
        (
            "mailroom.enqueue_batch(ARRAY['t','bad topic'], ARRAY['k1','k2'])".into(),
            "MR001",
            "events[2].topic",
        ),
        // Arrays are indexed from 1: another lower bound (or a second dimension) once put
        // events on other events' keys (issue 42, item 3).
        (
            "mailroom.enqueue_batch('[0:1]={t,t}'::text[], ARRAY['k1','k2'])".into(),
            "MR033",
            "topics",
        ),
        (
            "mailroom.enqueue_batch(ARRAY['t','t'], '[0:1]={k1,k2}'::text[])".into(),
            "MR033",
            "keys",
        ),
        (
            "mailroom.enqueue_batch(ARRAY['t','t'], ARRAY[['k1'],['k2']])".into(),
            "MR033",
            "keys",
        ),
        (
            "mailroom.enqueue_batch(ARRAY['t','t'], max_attempts => '[2:3]={1,2}'::int[])".into(),
            "MR033",
            "max_attempts",
        ),
        // PostgreSQL itself refuses NUL in text and jsonb, before the function runs.
        ("mailroom.enqueue('t', headers => '{\"a\": \"\\u0000\"}')".into(), "22P05", ""),
    ];
    for (call, code, column) in &cases {
        let mut tx = pool.begin().await.unwrap();
        // The key row of a refused event must not be left behind either.
        let e = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT * FROM {call}")))
            .fetch_all(&mut *tx)
            .await
            .expect_err(call);
        let (got, col) = sqlstate(&e);
        assert_eq!(got, *code, "{call}: {e}");
        if !column.is_empty() {
            assert_eq!(col.as_deref(), Some(*column), "{call}");
            assert!(e.to_string().contains("mailroom: "), "{call}: {e}");
        }
        tx.rollback().await.unwrap();
    }
    // NUL in text arguments never reaches the function either (22021).
    let e = sqlx::query("SELECT mailroom.enqueue('t', $1)")
        .bind("a\0b")
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).0, "22021");
    // The limits are exactly gRPC's defaults: the largest valid values pass.
    let id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT mailroom.enqueue({}, {}, convert_to(repeat('x', 1015820), 'UTF8'),
             jsonb_build_object('h', repeat('v', 16383)), {}, {}, '9999-12-31T23:59:59Z', 100)",
        long(249),
        long(1024),
        long(256),
        long(256)
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(outbox_rows(&url).await, 1, "only the valid event is stored");
    assert_eq!(s.app.store.fold_sql_events().await.unwrap(), 1);
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_keys")
        .fetch_one(&mut admin(&url).await)
        .await
        .unwrap();
    assert_eq!(keys, 1, "refused events left no key rows");
    assert!(id > 0);
    s.app.stop().await.unwrap();
}

/// Migrated by a non-superuser owner: the functions run as that owner with a pinned
/// search_path; the producer role can call them and nothing else; other roles nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_role_may_only_call_the_functions() {
    let admin_url = pg_admin_url();
    let owner = unique("mr_owner");
    let db = unique("mailroom_test_sqlapi");
    let mut a = admin(&admin_url).await;
    for sql in [
        format!("CREATE ROLE {owner} LOGIN"),
        format!("CREATE DATABASE {db} OWNER {owner}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut a)
            .await
            .unwrap();
    }
    // The owner has no CREATEROLE: the database's producer role must exist already, as
    // a DBA would create it (docs/sql-api.md, "Roles").
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE ROLE \"mailroom_producer_{db}\" NOLOGIN"
    )))
    .execute(&mut a)
    .await
    .unwrap();
    let base = admin_url.rsplit_once('/').unwrap().0;
    let owner_url = as_user(&format!("{base}/{db}"), &owner);
    let s = Service::start(quiet_config(&owner_url)).await;
    let url = format!("{base}/{db}");
    let (_app, pool) = app_role(&url).await;

    let id: i64 = sqlx::query_scalar("SELECT mailroom.enqueue('t', 'k', 'x'::bytea)")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(id > 0);
    let version: i32 = sqlx::query_scalar("SELECT mailroom.api_version()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(version, 1);
    for sql in [
        "SELECT * FROM outbox_events",
        "SELECT * FROM outbox_keys",
        "SELECT * FROM mailroom_sql_settings",
        "UPDATE outbox_events SET status = 'failed'",
        "DELETE FROM outbox_events",
        "INSERT INTO outbox_keys (topic, event_key, ready_at) VALUES ('t', 'x', now())",
        "UPDATE mailroom_sql_settings SET max_payload_bytes = 1",
        "SELECT mailroom_fingerprint('t', NULL, '', '{}', NULL, NULL, 6)",
        "SELECT mailroom_fp_field('x')",
    ] {
        let e = sqlx::query(sql).execute(&pool).await.expect_err(sql);
        assert_eq!(sqlstate(&e).0, "42501", "{sql}: {e}");
    }
    // A temporary table cannot stand in for the private one: the search_path is pinned.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("CREATE TEMP TABLE outbox_events (id bigint, topic text)")
        .execute(&mut *conn)
        .await
        .unwrap();
    let id2: i64 = sqlx::query_scalar("SELECT mailroom.enqueue('t', 'k', 'y'::bytea)")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(id2, id + 1);
    drop(conn);
    assert_eq!(outbox_rows(&url).await, 2);

    // A role without the grant cannot even see the schema.
    let stranger = unique("stranger");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE ROLE {stranger} LOGIN")))
        .execute(&mut a)
        .await
        .unwrap();
    let mut sc = sqlx::PgConnection::connect(&as_user(&url, &stranger))
        .await
        .unwrap();
    let e = sqlx::query("SELECT mailroom.enqueue('t')")
        .execute(&mut sc)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).0, "42501");

    // Run as the owner, SECURITY DEFINER, with the pinned search_path.
    let rows = sqlx::query(
        "SELECT p.proname, pg_get_userbyid(p.proowner), p.prosecdef, p.proconfig::text
         FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'mailroom' ORDER BY 1",
    )
    .fetch_all(&mut admin(&url).await)
    .await
    .unwrap();
    let got: HashMap<String, (String, bool, Option<String>)> = rows
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3))))
        .collect();
    assert_eq!(got.len(), 3);
    for name in ["enqueue", "enqueue_batch"] {
        let (o, secdef, cfg) = &got[name];
        assert_eq!(o, &owner);
        assert!(secdef);
        assert_eq!(
            cfg.as_deref(),
            Some("{\"search_path=pg_catalog, pg_temp\"}")
        );
    }
    drop(sc);
    s.app.stop().await.unwrap();
}

/// NOTIFY on commit wakes the relays at once; a rollback wakes nobody; with the switch
/// off only the poll finds the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_wakes_the_relays_and_a_rollback_wakes_nobody() {
    let url = fresh_pg().await;
    let mut c = config(&url);
    c.relay.poll_interval = Duration::from_secs(8);
    let sink = Arc::new(RecordingSink::default());
    let s = Service::start_with_sink(c, sink.clone()).await;
    let (_role, pool) = app_role(&url).await;
    let mut listener = sqlx::postgres::PgListener::connect(&url).await.unwrap();
    listener.listen("mailroom_outbox").await.unwrap();
    // Let the relays go idle (into their 8 s poll sleep).
    tokio::time::sleep(Duration::from_millis(1500)).await;

    place_order(&pool, 1, "w-1", &["rolled-back"], false).await;
    let n = tokio::time::timeout(Duration::from_secs(1), listener.recv()).await;
    assert!(n.is_err(), "a rollback notified: {n:?}");

    let t0 = Instant::now();
    place_order(&pool, 2, "w-1", &["committed"], true).await;
    let n = tokio::time::timeout(Duration::from_secs(2), listener.recv())
        .await
        .expect("a commit notifies")
        .unwrap();
    assert_eq!(n.channel(), "mailroom_outbox");
    wait_completed(&s.app.store, 1, Duration::from_secs(3)).await;
    let woke = t0.elapsed();
    assert!(woke < Duration::from_secs(3), "published after {woke:?}");

    // Control: with NOTIFY switched off the same commit waits for the 8 s poll.
    sqlx::query("UPDATE mailroom_sql_settings SET notify = false")
        .execute(&mut admin(&url).await)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    place_order(&pool, 3, "w-1", &["silent"], true).await;
    let n = tokio::time::timeout(Duration::from_secs(1), listener.recv()).await;
    assert!(n.is_err(), "notify=false still notified");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let done = s.outbox_count(Some(Status::Completed)).await;
    assert_eq!(done, 1, "without NOTIFY the relay slept through the commit");
    wait_completed(&s.app.store, 2, Duration::from_secs(15)).await;
    let seen: Vec<Vec<u8>> = sink
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.payload.clone())
        .collect();
    assert_eq!(seen, [b"committed".to_vec(), b"silent".to_vec()]);
    s.app.stop().await.unwrap();
}

async fn run_python(args: &[&str]) -> serde_json::Value {
    let out = tokio::process::Command::new("python3")
        .args(args)
        .output()
        .await
        .expect("python3 is required (scripts/test.sh installs psycopg)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).expect("one JSON line")
}

fn payloads_by_key(recs: &[Record]) -> HashMap<String, Vec<String>> {
    let mut m: HashMap<String, Vec<String>> = HashMap::new();
    for r in recs {
        m.entry(r.key.clone())
            .or_default()
            .push(String::from_utf8(r.payload.clone()).unwrap());
    }
    m
}

/// The same from Python (psycopg 3): commit, rollback, a killed caller, concurrent
/// transactions, SQLSTATEs; then the worked example (examples/python-orders) against a
/// second database with its own mailroom, both publishing to one broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_psycopg_caller_and_the_orders_example() {
    let root = env!("CARGO_MANIFEST_DIR");
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(2));
    let quiet = quiet_window(&c);
    let s = Service::start(c).await;
    let (role, _pool) = app_role(&url).await;
    let app_url = as_user(&url, &role);
    let out = run_python(&[&format!("{root}/tests/python/sql_api_client.py"), &app_url]).await;

    let committed: HashMap<String, Vec<String>> =
        serde_json::from_value(out["committed"].clone()).unwrap();
    let n: usize = committed.values().map(Vec::len).sum();
    assert_eq!(n, 12);
    // Plus the one event of the idempotency checks, on topic `t`.
    wait_completed(&s.app.store, n as i64 + 1, Duration::from_secs(30)).await;
    let recs = consume(&broker.addr(), "py.sql.orders", n, Duration::from_secs(30));
    assert_eq!(
        payloads_by_key(&recs),
        committed,
        "published in commit order per key"
    );
    let unwanted: Vec<i64> = out["rolled_back"]
        .as_array()
        .unwrap()
        .iter()
        .chain(out["crashed"].as_array().unwrap())
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert_eq!(unwanted.len(), 2, "{out}");
    let (per_key, dups) = first_deliveries(&recs);
    assert_eq!(dups, 0);
    assert!(per_key.values().flatten().all(|id| !unwanted.contains(id)));
    let errors = &out["errors"];
    assert_eq!(errors["bad_topic"], serde_json::json!(["MR001", "topic"]));
    assert_eq!(
        errors["reserved_header"],
        serde_json::json!(["MR008", "headers"])
    );
    assert_eq!(
        errors["payload_too_large"],
        serde_json::json!(["MR003", "payload"])
    );
    assert_eq!(
        errors["conflict"],
        serde_json::json!(["MR020", "idempotency_key"])
    );
    assert_eq!(errors["select_outbox"][0], "42501");
    assert_eq!(
        out["orders"],
        serde_json::json!([1, 3, 5, 200, 201, 202, 203, 204, 205])
    );

    // The worked example, in a database of its own with its own mailroom.
    let url2 = fresh_pg().await;
    let mut c2 = config(&url2);
    kafka_sink_config(&mut c2, &broker.addr(), Duration::from_secs(2));
    let s2 = Service::start(c2).await;
    let shop_role = unique("orders_service");
    let mut a = admin(&url2).await;
    let schema =
        std::fs::read_to_string(format!("{root}/examples/python-orders/schema.sql")).unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(schema))
        .execute(&mut a)
        .await
        .unwrap();
    for sql in [
        format!(
            "CREATE ROLE {shop_role} LOGIN IN ROLE \"{}\"",
            producer_role(&url2).await
        ),
        format!("GRANT SELECT, INSERT, UPDATE ON orders TO {shop_role}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut a)
            .await
            .unwrap();
    }
    let shop = run_python(&[
        &format!("{root}/examples/python-orders/orders_service.py"),
        &as_user(&url2, &shop_role),
    ])
    .await;
    assert_eq!(shop["refused"], serde_json::json!(["mallory"]));
    let placed: Vec<(i64, i64)> = serde_json::from_value(shop["placed"].clone()).unwrap();
    assert_eq!(placed.len(), 3);
    wait_completed(&s2.app.store, 4, Duration::from_secs(30)).await;
    let recs2 = consume(&broker.addr(), "orders", 4, Duration::from_secs(30));
    let types: Vec<(String, String)> = recs2
        .iter()
        .map(|r| (r.key.clone(), r.headers["ce_type"].clone()))
        .collect();
    let first = placed[0].0.to_string();
    let of_first: Vec<&str> = types
        .iter()
        .filter(|(k, _)| *k == first)
        .map(|(_, t)| t.as_str())
        .collect();
    assert_eq!(of_first, ["order.placed", "order.cancelled"]);
    assert_eq!(recs2.len(), 4);
    assert!(
        recs2
            .iter()
            .all(|r| !String::from_utf8_lossy(&r.payload).contains("mallory"))
    );
    let statuses: Vec<(String, String)> =
        sqlx::query_as("SELECT customer, status FROM orders ORDER BY id")
            .fetch_all(&mut a)
            .await
            .unwrap();
    assert_eq!(
        statuses,
        [
            ("ada".to_string(), "cancelled".to_string()),
            ("grace".to_string(), "placed".to_string()),
            ("edsger".to_string(), "placed".to_string())
        ]
    );

    // Nothing more comes from either database: twice the poll and lease windows.
    tokio::time::sleep(quiet).await;
    let again = consume(
        &broker.addr(),
        "py.sql.orders",
        n + 1,
        Duration::from_secs(5),
    );
    assert_eq!(
        again.len(),
        n,
        "rolled back and crashed events stay unpublished"
    );
    let again2 = consume(&broker.addr(), "orders", 5, Duration::from_secs(5));
    assert_eq!(again2.len(), 4);
    assert_eq!(outbox_rows(&url).await, n as i64 + 1);
    for (key, counted, actual) in pending_counts(&url).await {
        assert_eq!((counted, actual), (0, 0), "pending count of {key}");
    }
    s.app.stop().await.unwrap();
    s2.app.stop().await.unwrap();
}

/// Idempotent retries from transactions that overlap: the second waits for the first;
/// the first's commit makes it a duplicate, the first's rollback lets it insert. Under
/// REPEATABLE READ the waiting retry gets 40001, as docs/sql-api.md says: the key row
/// was updated by a transaction that committed after its snapshot (any enqueue of the
/// key, or a relay's claim or settle, does that too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_idempotent_retries_wait_for_the_first_transaction() {
    let (url, s) = quiet_pg().await;
    let (_role, pool) = app_role(&url).await;
    const CALL: &str = "SELECT mailroom.enqueue('t', 'k', 'same'::bytea, idempotency_key => $1)";

    for (first_commits, isolation) in [
        (true, "READ COMMITTED"),
        (false, "READ COMMITTED"),
        (true, "REPEATABLE READ"),
    ] {
        let idem = unique("idem");
        let mut t1 = pool.begin().await.unwrap();
        let id1: i64 = sqlx::query_scalar(CALL)
            .bind(&idem)
            .fetch_one(&mut *t1)
            .await
            .unwrap();
        let (p, i2) = (pool.clone(), idem.clone());
        let second = tokio::spawn(async move {
            let mut t2 = p.begin().await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SET TRANSACTION ISOLATION LEVEL {isolation}"
            )))
            .execute(&mut *t2)
            .await
            .unwrap();
            // Take the snapshot before the first transaction ends.
            sqlx::query("SELECT 1").execute(&mut *t2).await.unwrap();
            let r = sqlx::query_scalar::<_, i64>(CALL)
                .bind(&i2)
                .fetch_one(&mut *t2)
                .await;
            if r.is_ok() {
                t2.commit().await.unwrap();
            }
            r
        });
        // The retry started and waits on a lock the first transaction holds (a task that
        // had not started yet would pass a plain "not finished" check).
        let url2 = url.clone();
        eventually(Duration::from_secs(10), "the retry waits on a lock", || {
            let url = url2.clone();
            async move {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                         AND datname = current_database() AND query LIKE '%mailroom.enqueue%'",
                )
                .fetch_one(&mut admin(&url).await)
                .await
                .unwrap();
                waiting == 1
            }
        })
        .await;
        assert!(
            !second.is_finished(),
            "the retry did not wait for the first transaction"
        );
        if first_commits {
            t1.commit().await.unwrap();
        } else {
            t1.rollback().await.unwrap();
        }
        let r = second.await.unwrap();
        let stored: Vec<i64> =
            sqlx::query_scalar("SELECT id FROM outbox_events WHERE idempotency_key = $1")
                .bind(&idem)
                .fetch_all(&mut admin(&url).await)
                .await
                .unwrap();
        match (first_commits, isolation) {
            (true, "READ COMMITTED") => {
                assert_eq!(r.unwrap(), id1, "a duplicate of the committed event");
                assert_eq!(stored, [id1]);
            }
            (false, _) => {
                let id2 = r.unwrap();
                assert!(id2 > id1, "inserted anew after the rollback");
                assert_eq!(stored, [id2]);
            }
            _ => {
                assert_eq!(sqlstate(&r.unwrap_err()).0, "40001");
                assert_eq!(stored, [id1]);
            }
        }
    }
    for (key, counted, actual) in pending_counts(&url).await {
        assert_eq!(counted, actual, "pending count of {key}");
    }
    s.app.stop().await.unwrap();
}

/// The SQL API validates with the service's limits: a service started with
/// `max_attempts` 10 and a 2,000-byte payload limit writes them into
/// `mailroom_sql_settings`, so an SQL event gets 10 attempts (6 before: the row kept
/// its defaults) and a 3,000-byte payload is `MR003`, as it is for gRPC; a row edited by
/// hand is set back at the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_api_follows_the_services_limits() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.limits.default_max_attempts = 10;
    c.limits.max_payload_bytes = 2000;
    let s = Service::start(c.clone()).await;
    let (_, pool) = app_role(&url).await;
    let id: i64 = sqlx::query_scalar("SELECT mailroom.enqueue('sql.limits', 'k', 'x'::bytea)")
        .fetch_one(&pool)
        .await
        .unwrap();
    let e = s
        .app
        .store
        .get_event(mailroom::domain::BoxKind::Outbox, id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(e.max_attempts, 10, "the service's default_max_attempts");
    let err = sqlx::query("SELECT mailroom.enqueue('sql.limits', 'k', $1)")
        .bind(vec![0u8; 3000])
        .execute(&pool)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&err), ("MR003".into(), Some("payload".into())));
    s.app.stop().await.unwrap();

    // Drift by hand is undone at the next start.
    let mut a = admin(&url).await;
    sqlx::query("UPDATE mailroom_sql_settings SET default_max_attempts = 3")
        .execute(&mut a)
        .await
        .unwrap();
    let s = Service::start(c).await;
    let attempts: i32 =
        sqlx::query_scalar("SELECT default_max_attempts FROM mailroom_sql_settings")
            .fetch_one(&mut a)
            .await
            .unwrap();
    assert_eq!(attempts, 10);
    s.app.stop().await.unwrap();
}

/// A gRPC `Enqueue` that waits on a key row past the enqueue statement timeout (here a
/// row lock held from outside, as a stuck session or a DBA's `SELECT … FOR UPDATE` would)
/// is answered `DEADLINE_EXCEEDED`, reason `STATEMENT_TIMEOUT`, with a retry delay, as
/// docs/operations.md promises, and nothing is stored. Other keys are answered at once;
/// once the lock goes, the key is accepted. Before: `INTERNAL` (the group commit's error
/// lost its kind when it was handed to each request of the group). SQL API callers no
/// longer hold key rows at all (see the next test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_behind_a_locked_key_row_times_out_retryably() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.database_timeouts.enqueue = Some(Duration::from_millis(1000));
    let mut s = Service::start(c).await;
    enqueue(&mut s.client, event("held", "m", b"creates the key row")).await;
    let mut held = admin(&url).await;
    let mut held = held.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox_keys WHERE topic = 'held' AND event_key = 'm' FOR UPDATE")
        .fetch_one(&mut *held)
        .await
        .unwrap();
    let before = outbox_rows(&url).await;
    let t = Instant::now();
    let err = s
        .client
        .enqueue(pb::EnqueueRequest {
            event: Some(event("held", "m", b"grpc")),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "it waited for the key"
    );
    assert_eq!(
        err.get_details_error_info().map(|i| i.reason).as_deref(),
        Some("STATEMENT_TIMEOUT")
    );
    assert!(err.get_details_retry_info().is_some(), "retryable: {err:?}");
    assert!(
        err.message().contains("transaction that holds the key"),
        "{err:?}"
    );
    assert_eq!(outbox_rows(&url).await, before, "nothing stored");
    // Another key is not held.
    let t = Instant::now();
    enqueue(&mut s.client, event("held", "other", b"free")).await;
    assert!(t.elapsed() < Duration::from_millis(900));
    held.commit().await.unwrap();
    enqueue(&mut s.client, event("held", "m", b"grpc, again")).await;
    s.app.stop().await.unwrap();
}

/// The scenario (issue 24, item 2, "Open transactions"): a SQL API caller
/// enqueues on key `m` and keeps its transaction open while gRPC writers enqueue on 26
/// other keys and on `m` itself. Nothing waits for the caller: every `Enqueue` (on `m`
/// too) is answered at once, the other keys are published while the transaction is
/// still open, and `m` is held back, not republished: after the commit its events come
/// out once each, the caller's first (it drew its id first). Before migration 0015 the
/// caller held `m`'s key row: the relays' settle of a claim with `m` waited on it while
/// holding its other keys, gRPC enqueues on those keys and on `m` timed out, and the
/// claim's keys stayed leased past the lease and were republished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_sql_transaction_holds_back_only_its_own_key() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    // A lease shorter than the hold: a settle or renewal stuck behind the caller would
    // let the lease lapse and the key be published again.
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(2));
    c.relay.lease = Duration::from_secs(3);
    let s = Service::start(c).await;
    let (_, pool) = app_role(&url).await;
    let topic = "sql.held";
    // Make `m` a busy key first, so relays hold it in their claims with other keys.
    let mut client = s.client.clone();
    for i in 0..5 {
        enqueue(
            &mut client,
            event(topic, "m", format!("before-{i}").as_bytes()),
        )
        .await;
    }
    wait_completed(&s.app.store, 5, Duration::from_secs(30)).await;

    let mut held = pool.begin().await.unwrap();
    let sql_id: i64 =
        sqlx::query_scalar("SELECT mailroom.enqueue('sql.held', 'm', 'sql-1'::bytea)")
            .fetch_one(&mut *held)
            .await
            .unwrap();
    // The fault is in place: the caller's backend holds m's order lock. Order locks are
    // 64-bit advisory locks (objsubid 1); a relay's fold takes the two-int form (7110, 1)
    // for an instant (objsubid 2), which is not what this counts.
    let locks = count_rows(
        &url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND mode = 'ExclusiveLock' AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .await;
    assert_eq!(locks, 1, "the open transaction holds the key's order lock");

    // gRPC on m itself: answered at once, stored after the caller's event.
    let t = Instant::now();
    let grpc_m = enqueue(&mut client, event(topic, "m", b"grpc-1")).await;
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(grpc_m > sql_id);

    // 26 keys flow for six seconds while the transaction stays open.
    let hold = Duration::from_secs(6);
    let started = Instant::now();
    let mut sent = 0usize;
    let mut slowest = Duration::ZERO;
    while started.elapsed() < hold {
        for k in b'a'..=b'z' {
            let key = format!("other-{}", k as char);
            let t = Instant::now();
            enqueue(
                &mut client,
                event(topic, &key, format!("{key}-{sent}").as_bytes()),
            )
            .await;
            slowest = slowest.max(t.elapsed());
            sent += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        slowest < Duration::from_secs(1),
        "slowest Enqueue {slowest:?}"
    );
    // Everything but m's two events is published before the transaction ends.
    eventually(
        Duration::from_secs(20),
        "the other keys published",
        || async { s.outbox_count(Some(Status::Completed)).await == (5 + sent) as i64 },
    )
    .await;
    let grpc_m_status = s.stored(BoxKind::Outbox, grpc_m).await.status;
    assert_eq!(
        grpc_m_status,
        Status::Pending,
        "m waits for the open transaction"
    );
    held.commit().await.unwrap();

    let total = 5 + sent + 2;
    wait_completed(&s.app.store, total as i64, Duration::from_secs(30)).await;
    let recs = consume(&broker.addr(), topic, total, Duration::from_secs(30));
    let (per_key, dups) = first_deliveries(&recs);
    assert_eq!(dups, 0, "nothing published twice");
    assert_eq!(per_key.values().map(Vec::len).sum::<usize>(), total);
    for ids in per_key.values() {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    }
    let m = &per_key["m"];
    assert_eq!(
        &m[m.len() - 2..],
        &[sql_id, grpc_m],
        "the caller's event, then gRPC's"
    );
    s.app.stop().await.unwrap();
}

/// A gRPC `Enqueue` whose idempotency key an open SQL transaction holds waits for that
/// transaction (the unique index decides when it ends); the intake's other calls do not
/// wait for it. Transactions follow one another, so the next call waits for the stuck one
/// until it has run `overlap_after` (here 500 ms), then starts beside it; and once the
/// caller commits, the stuck call is answered as a duplicate of the caller's event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_enqueue_holds_back_only_itself() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.intake.overlap_after = Duration::from_millis(500);
    let s = Service::start(c).await;
    let (_, pool) = app_role(&url).await;
    let topic = "sql.stuck";
    let mut held = pool.begin().await.unwrap();
    let sql_id: i64 = sqlx::query_scalar(
        "SELECT mailroom.enqueue('sql.stuck', 'k', 'same'::bytea, idempotency_key => 'taken')",
    )
    .fetch_one(&mut *held)
    .await
    .unwrap();
    let mut client = s.client.clone();
    let began = Instant::now();
    let stuck = tokio::spawn(async move {
        let mut e = event(topic, "k", b"same");
        e.idempotency_key = "taken".into();
        client.enqueue(pb::EnqueueRequest { event: Some(e) }).await
    });
    // The fault fired: the gRPC transaction waits on the caller's.
    eventually(
        Duration::from_secs(10),
        "the Enqueue waits on the open transaction",
        || async {
            count_rows(
                &url,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND wait_event = 'transactionid' AND datname = current_database()",
            )
            .await
                == 1
        },
    )
    .await;
    let sent = began.elapsed();
    let mut client = s.client.clone();
    let other = enqueue(&mut client, event(topic, "other", b"x")).await;
    let answered = began.elapsed();
    assert!(other > sql_id);
    // Not before the stuck transaction had run 500 ms (it began after `began`)...
    assert!(
        answered >= Duration::from_millis(500),
        "sent {sent:?} after the stuck call, answered {answered:?}: no wait for it"
    );
    // ...and not long after: the caller's transaction is still open.
    assert!(
        answered < Duration::from_secs(3),
        "an Enqueue waited until {answered:?} behind a stuck transaction"
    );
    assert!(!stuck.is_finished(), "the stuck call is still waiting");
    held.commit().await.unwrap();
    let r = stuck
        .await
        .unwrap()
        .expect("answered once the caller committed");
    let r = r.into_inner();
    assert_eq!(r.id, sql_id, "a duplicate of the caller's event");
    s.app.stop().await.unwrap();
}

/// The scenario for stricter isolation (issue 24, item 2): a least-privileged
/// role's business transactions (a row in its own table plus `mailroom.enqueue` on 6
/// shared keys), two writers at READ COMMITTED and two at SERIALIZABLE, while two gRPC
/// writers enqueue on the same keys. Every transaction is retried on 40001/40P01 and
/// the retries are counted: mailroom adds none (before migration 0015, 950 retries for
/// 300 transactions, "could not serialize access due to concurrent update", because
/// the function updated the hot key rows inside the caller's snapshot). Order holds:
/// every committed event is published once, each key in id order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serializable_callers_retry_only_for_their_own_conflicts() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(5));
    let s = Service::start(c).await;
    let (_, pool) = app_role(&url).await;
    let topic = "sql.iso";
    let keys = ["k1", "k2", "k3", "k4", "k5", "k6"];
    const PER_WRITER: usize = 50;
    let next_order = Arc::new(std::sync::atomic::AtomicI64::new(1));
    let mut writers = Vec::new();
    for (w, isolation) in [
        "READ COMMITTED",
        "READ COMMITTED",
        "SERIALIZABLE",
        "SERIALIZABLE",
    ]
    .into_iter()
    .enumerate()
    {
        let (pool, next_order) = (pool.clone(), next_order.clone());
        writers.push(tokio::spawn(async move {
            let mut retries: Vec<String> = Vec::new();
            for t in 0..PER_WRITER {
                let order = next_order.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                loop {
                    let attempt = async {
                        let mut tx = pool.begin().await?;
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "SET TRANSACTION ISOLATION LEVEL {isolation}"
                        )))
                        .execute(&mut *tx)
                        .await?;
                        sqlx::query("INSERT INTO orders (id, total) VALUES ($1, 1)")
                            .bind(order)
                            .execute(&mut *tx)
                            .await?;
                        // The same key order in every transaction, as docs/sql-api.md asks.
                        for k in keys {
                            sqlx::query("SELECT mailroom.enqueue('sql.iso', $1, $2)")
                                .bind(k)
                                .bind(format!("w{w}-t{t}").into_bytes())
                                .execute(&mut *tx)
                                .await?;
                        }
                        tx.commit().await
                    };
                    match attempt.await {
                        Ok(()) => break,
                        Err(e) => {
                            let code = e
                                .as_database_error()
                                .and_then(|d| d.code())
                                .map(|c| c.to_string());
                            assert!(matches!(code.as_deref(), Some("40001" | "40P01")), "{e}");
                            retries.push(e.to_string());
                        }
                    }
                }
            }
            (isolation, retries)
        }));
    }
    let mut grpc = Vec::new();
    for g in 0..2 {
        let mut client = s.client.clone();
        grpc.push(tokio::spawn(async move {
            for i in 0..150 {
                let k = keys[i % keys.len()];
                enqueue(&mut client, event(topic, k, format!("g{g}-{i}").as_bytes())).await;
            }
        }));
    }
    let mut serializable_retries = Vec::new();
    let mut all_retries = 0;
    for w in writers {
        let (isolation, retries) = w.await.unwrap();
        all_retries += retries.len();
        if isolation == "SERIALIZABLE" {
            serializable_retries.extend(retries);
        }
    }
    for g in grpc {
        g.await.unwrap();
    }
    let per_tx = serializable_retries.len() as f64 / (2 * PER_WRITER) as f64;
    eprintln!(
        "retries: {} in all, {} at SERIALIZABLE ({per_tx:.3} per transaction): {:?}",
        all_retries,
        serializable_retries.len(),
        serializable_retries.iter().take(3).collect::<Vec<_>>()
    );
    assert!(
        serializable_retries
            .iter()
            .all(|e| !e.contains("concurrent update")),
        "a conflict on mailroom's rows: {serializable_retries:?}"
    );
    assert!(
        per_tx < 0.1,
        "{per_tx} retries per SERIALIZABLE transaction"
    );

    let total = 4 * PER_WRITER * keys.len() + 2 * 150;
    wait_completed(&s.app.store, total as i64, Duration::from_secs(60)).await;
    let recs = consume(&broker.addr(), topic, total, Duration::from_secs(30));
    let (per_key, dups) = first_deliveries(&recs);
    assert_eq!(dups, 0);
    assert_eq!(per_key.values().map(Vec::len).sum::<usize>(), total);
    for ids in per_key.values() {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    }
    s.app.stop().await.unwrap();
}

/// Issue 25, item 2: the `SECURITY DEFINER` functions cannot be hijacked through
/// `public`. The application's role, allowed to create objects in `public` (the usual
/// "one database per service" setup), plants operators and functions that would win
/// over `pg_catalog`'s for the argument types the functions use (`text || integer`,
/// `numeric * integer`, `hashtextextended(text, integer)`), each recording that it ran.
/// Called from the application's own session they do run (the fault is live); through
/// `mailroom.enqueue` and `mailroom.enqueue_batch`, with every code path that uses such
/// operators (idempotency fingerprint with `deliver_after`, batch field names, order
/// locks), they never do. Before migration 0015 the functions ran with
/// `search_path = pg_catalog, public, pg_temp`, where an exact-match operator in
/// `public` beats `pg_catalog`'s polymorphic one, as the function's owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_and_functions_planted_in_public_never_run() {
    let (url, s) = quiet_pg().await;
    let (role, pool) = app_role(&url).await;
    exec(&url, &format!("GRANT CREATE ON SCHEMA public TO {role}")).await;
    for sql in [
        "CREATE TABLE public.hijacked (what text)",
        "GRANT INSERT ON public.hijacked TO PUBLIC",
        "CREATE FUNCTION public.evil_concat(a text, b integer) RETURNS text LANGUAGE plpgsql AS
         $$ BEGIN INSERT INTO public.hijacked VALUES ('text || integer as ' || current_user);
            RETURN a || b::text; END $$",
        "CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = integer, FUNCTION = public.evil_concat)",
        "CREATE FUNCTION public.evil_mul(a numeric, b integer) RETURNS numeric LANGUAGE plpgsql AS
         $$ BEGIN INSERT INTO public.hijacked VALUES ('numeric * integer as ' || current_user);
            RETURN a * b::numeric; END $$",
        "CREATE OPERATOR public.* (LEFTARG = numeric, RIGHTARG = integer, FUNCTION = public.evil_mul)",
        "CREATE FUNCTION public.hashtextextended(t text, seed integer) RETURNS bigint LANGUAGE plpgsql AS
         $$ BEGIN INSERT INTO public.hijacked VALUES ('hashtextextended as ' || current_user);
            RETURN 1; END $$",
        "GRANT EXECUTE ON FUNCTION public.evil_concat(text, integer), public.evil_mul(numeric, integer),
             public.hashtextextended(text, integer) TO PUBLIC",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let hijacked = || async {
        sqlx::query_scalar::<_, String>("SELECT what FROM public.hijacked ORDER BY 1")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    // The plants are live: in the application's own session they win.
    sqlx::query("SELECT 'x' || 1, 1.5::numeric * 2, hashtextextended('k', 7)")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(hijacked().await.len(), 3, "{:?}", hijacked().await);
    sqlx::query("DELETE FROM public.hijacked")
        .execute(&mut admin(&url).await)
        .await
        .unwrap();

    sqlx::query(
        "SELECT mailroom.enqueue('t', 'k', 'x'::bytea, '{\"h\":\"v\"}', 'ty', 'idem-1',
                                 '2030-01-02T03:04:05Z', 3)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "SELECT * FROM mailroom.enqueue_batch(ARRAY['t','t'], ARRAY['k','j'],
             idempotency_keys => ARRAY['idem-2', NULL],
             deliver_afters => ARRAY['2030-01-02T03:04:05Z'::timestamptz, NULL])",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    // A refused event formats its message with the batch position.
    let e = sqlx::query("SELECT * FROM mailroom.enqueue_batch(ARRAY['t', 'bad topic'])")
        .fetch_all(&pool)
        .await
        .unwrap_err();
    assert_eq!(
        sqlstate(&e),
        ("MR001".into(), Some("events[2].topic".into()))
    );
    assert_eq!(s.app.store.fold_sql_events().await.unwrap(), 3);
    assert_eq!(
        hijacked().await,
        Vec::<String>::new(),
        "a planted object ran"
    );
    assert_eq!(outbox_rows(&url).await, 3);
    s.app.stop().await.unwrap();
}

/// Issue 24, item 2, "Scope": the producer role is per database. A role granted the
/// producer role of one database enqueues there and gets `42501` in another database
/// that has a mailroom too; the cluster-wide `mailroom_producer` (granted before
/// migration 0015) no longer grants the SQL API anywhere. Before 0015, membership in
/// `mailroom_producer` let a service enqueue into every database of the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_role_works_in_its_own_database_only() {
    let (url_a, s_a) = quiet_pg().await;
    let (url_b, s_b) = quiet_pg().await;
    let (role, pool_a) = app_role(&url_a).await;
    let id: i64 = sqlx::query_scalar("SELECT mailroom.enqueue('t', 'k')")
        .fetch_one(&pool_a)
        .await
        .unwrap();
    assert!(id > 0);
    let pool_b = PgPoolOptions::new()
        .max_connections(1)
        .connect(&as_user(&url_b, &role))
        .await
        .expect("PUBLIC may connect: the database is not what stops it");
    let e = sqlx::query("SELECT mailroom.enqueue('t', 'k')")
        .execute(&pool_b)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).0, "42501", "{e}");
    // The cluster-wide role of before grants nothing either.
    let legacy = unique("legacy");
    let _ = sqlx::query("CREATE ROLE mailroom_producer NOLOGIN")
        .execute(&mut admin(&url_b).await)
        .await;
    exec(
        &url_b,
        &format!("CREATE ROLE {legacy} LOGIN IN ROLE mailroom_producer"),
    )
    .await;
    let pool_legacy = PgPoolOptions::new()
        .max_connections(1)
        .connect(&as_user(&url_b, &legacy))
        .await
        .unwrap();
    let e = sqlx::query("SELECT mailroom.enqueue('t', 'k')")
        .execute(&pool_legacy)
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e).0, "42501", "{e}");
    assert_ne!(producer_role(&url_a).await, producer_role(&url_b).await);
    s_a.app.stop().await.unwrap();
    s_b.app.stop().await.unwrap();
}

/// A login role with no grant at all, connected to the database at `url`: what any
/// neighbour on a shared cluster can be.
async fn outsider(url: &str) -> sqlx::PgConnection {
    let role = unique("nobody");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE ROLE {role} LOGIN")))
        .execute(&mut admin(url).await)
        .await
        .unwrap();
    sqlx::PgConnection::connect(&as_user(url, &role))
        .await
        .expect("connect as a role with no grants")
}

/// `n` SQL-API events, each in its own committed transaction, on the keys
/// `{prefix}-0`.. of `topic`.
async fn enqueue_keys(pool: &PgPool, topic: &str, prefix: &str, n: usize) -> Vec<String> {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    for k in &keys {
        sqlx::query("SELECT mailroom.enqueue($1, $2, 'x'::bytea)")
            .bind(topic)
            .bind(k)
            .execute(pool)
            .await
            .unwrap();
    }
    keys
}

/// Advisory locks need no privilege (issue 42, item 3): a role with no grant held the
/// fold's (7110, 1) and SQL-API events on new keys waited as long as it held it. The fold
/// turn and the order locks are rows now, which only mailroom's owner may lock: events
/// are published within a few poll intervals whatever the outsider holds, and it cannot
/// lock the rows. Relays find SQL events by polling here (NOTIFY off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_with_no_privilege_stalls_neither_the_fold_nor_a_key() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(2));
    let s = Service::start(c).await;
    let (_, pool) = app_role(&url).await;
    let mut a = admin(&url).await;
    sqlx::query("UPDATE mailroom_sql_settings SET notify = false")
        .execute(&mut a)
        .await
        .unwrap();
    let topic = "sql.neighbour";
    let mut outsider = outsider(&url).await;
    sqlx::query("SELECT pg_advisory_lock(7110, 1)")
        .execute(&mut outsider)
        .await
        .unwrap();

    // The fold: 10 new keys while the outsider holds what was the fold's lock.
    let t = Instant::now();
    enqueue_keys(&pool, topic, "new", 10).await;
    eventually(
        Duration::from_secs(5),
        "SQL events on new keys published while (7110, 1) is held",
        || async { s.outbox_count(Some(Status::Completed)).await == 10 },
    )
    .await;
    eprintln!("10 new keys published in {:?}", t.elapsed());

    // A key: with the transitional advisory lock off, the outsider holds every key's
    // former order lock, exclusive and shared, and the keys flow all the same.
    sqlx::query("UPDATE mailroom_sql_settings SET legacy_order_lock = false")
        .execute(&mut a)
        .await
        .unwrap();
    for i in 0..10 {
        let id: i64 = sqlx::query_scalar("SELECT mailroom_order_lock($1, $2)")
            .bind(topic)
            .bind(format!("held-{i}"))
            .fetch_one(&mut a)
            .await
            .unwrap();
        let take = if i % 2 == 0 {
            "SELECT pg_advisory_lock($1)"
        } else {
            "SELECT pg_advisory_lock_shared($1)"
        };
        sqlx::query(take)
            .bind(id)
            .execute(&mut outsider)
            .await
            .unwrap();
    }
    let t = Instant::now();
    enqueue_keys(&pool, topic, "held", 10).await;
    eventually(
        Duration::from_secs(5),
        "SQL events published while their keys' advisory locks are held",
        || async { s.outbox_count(Some(Status::Completed)).await == 20 },
    )
    .await;
    eprintln!(
        "10 keys with held advisory locks published in {:?}",
        t.elapsed()
    );

    // The rows themselves: neither the outsider nor the producer role may lock them.
    for (who, conn) in [
        ("outsider", &mut outsider),
        ("producer", &mut *pool.acquire().await.unwrap()),
    ] {
        for table in ["mailroom_order_slots", "mailroom_fold_turn"] {
            let e = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT 1 FROM {table} LIMIT 1 FOR SHARE"
            )))
            .execute(&mut *conn)
            .await
            .expect_err(table);
            assert_eq!(sqlstate(&e).0, "42501", "{who} locks {table}: {e}");
        }
    }
    let recs = consume(&broker.addr(), topic, 20, Duration::from_secs(30));
    assert_eq!(first_deliveries(&recs).1, 0, "nothing published twice");
    s.app.stop().await.unwrap();
}

/// Row locks take no lock-table entry: an `enqueue_batch` over 1,000 keys holds a fixed
/// handful of entries (its relations) instead of one advisory lock per key, which a few
/// bulk callers used to run out of (`53200` for every database of the cluster). With the
/// transitional advisory lock on, the count is the old one (docs/sql-api.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_batch_takes_a_bounded_number_of_lock_table_entries() {
    let (url, s) = quiet_pg().await;
    let (_, pool) = app_role(&url).await;
    let batch = "SELECT count(*) FROM mailroom.enqueue_batch(array_fill('t'::text, ARRAY[1000]),
                     (SELECT array_agg($1 || i) FROM generate_series(1, 1000) i))";
    let mut entries = Vec::new();
    for legacy in [true, false] {
        sqlx::query("UPDATE mailroom_sql_settings SET legacy_order_lock = $1")
            .bind(legacy)
            .execute(&mut admin(&url).await)
            .await
            .unwrap();
        let mut tx = pool.begin().await.unwrap();
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let n: i64 = sqlx::query_scalar(batch)
            .bind(format!("k{legacy}-"))
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(n, 1000);
        let held = count_rows(
            &url,
            &format!("SELECT count(*) FROM pg_locks WHERE pid = {pid}"),
        )
        .await;
        // The keys are held all the same: another writer of one of them waits.
        let mut other = pool.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = '100ms'")
            .execute(&mut *other)
            .await
            .unwrap();
        let e = sqlx::query("SELECT mailroom.enqueue('t', $1)")
            .bind(format!("k{legacy}-500"))
            .execute(&mut *other)
            .await
            .expect_err("the key's order lock is held");
        assert_eq!(sqlstate(&e).0, "55P03", "{e}");
        other.rollback().await.unwrap();
        tx.commit().await.unwrap();
        entries.push(held);
    }
    eprintln!(
        "lock-table entries of a 1,000-key batch: legacy on {}, off {}",
        entries[0], entries[1]
    );
    assert!(
        entries[0] > 1000,
        "the transitional advisory locks: {}",
        entries[0]
    );
    assert!(entries[1] <= 32, "row locks only: {} entries", entries[1]);
    s.app.stop().await.unwrap();
}

/// The slot rows are only ever locked, never updated: REPEATABLE READ and SERIALIZABLE
/// writers of one key wait for each other, and for a relay's share lock, and never fail
/// with 40001 for it, whatever locked the row since their snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_isolated_writers_of_one_key_never_fail_on_its_order_lock() {
    let (url, s) = quiet_pg().await;
    let (_, pool) = app_role(&url).await;
    let hot = "SELECT mailroom.enqueue('t', 'hot', 'x'::bytea)";
    for iso in ["REPEATABLE READ", "SERIALIZABLE"] {
        let begin = format!("SET TRANSACTION ISOLATION LEVEL {iso}");
        let mut first = pool.begin().await.unwrap();
        let mut second = pool.begin().await.unwrap();
        for tx in [&mut first, &mut second] {
            sqlx::query(sqlx::AssertSqlSafe(begin.clone()))
                .execute(&mut **tx)
                .await
                .unwrap();
            // The snapshot is taken here, before anyone locks the slot.
            sqlx::query("SELECT count(*) FROM orders")
                .execute(&mut **tx)
                .await
                .unwrap();
        }
        // A relay's share lock comes and goes, then a committed writer's lock.
        let mut relay = admin(&url).await;
        let mut r = relay.begin().await.unwrap();
        sqlx::query(
            "SELECT 1 FROM mailroom_order_slots WHERE slot = mailroom_order_slot('t', 'hot') FOR SHARE",
        )
        .execute(&mut *r)
        .await
        .unwrap();
        r.commit().await.unwrap();
        sqlx::query(hot).execute(&pool).await.unwrap();
        // Then the two, overlapping: the second waits for the first's commit.
        sqlx::query(hot).execute(&mut *first).await.unwrap();
        let waiting = tokio::spawn(async move {
            sqlx::query(hot).execute(&mut *second).await?;
            second.commit().await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "{iso}: the second writer waits");
        first.commit().await.unwrap();
        waiting
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{iso}: {e}"));
    }
    assert_eq!(outbox_rows(&url).await, 6);
    s.app.stop().await.unwrap();
}

/// One key row held elsewhere (an operator's `SELECT ... FOR UPDATE`, a replica cut off
/// mid-settle) delays only its key: the fold skips it (it waited on it, and every claim
/// behind it, until the relay's statement timeout) and the other keys, SQL and gRPC, are
/// published meanwhile. Its own SQL event goes out once the row is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_row_held_elsewhere_holds_back_only_its_key() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(2));
    let s = Service::start(c).await;
    let (_, pool) = app_role(&url).await;
    let topic = "sql.rowheld";
    let mut client = s.client.clone();
    enqueue(&mut client, event(topic, "held", b"before")).await;
    wait_completed(&s.app.store, 1, Duration::from_secs(30)).await;

    let mut operator = admin(&url).await;
    let mut hold = operator.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox_keys WHERE event_key = 'held' FOR UPDATE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let held_id: i64 = sqlx::query_scalar("SELECT mailroom.enqueue($1, 'held', 'sql'::bytea)")
        .bind(topic)
        .fetch_one(&pool)
        .await
        .unwrap();
    let t = Instant::now();
    enqueue_keys(&pool, topic, "sql", 10).await;
    for i in 0..5 {
        enqueue(&mut client, event(topic, &format!("grpc-{i}"), b"g")).await;
    }
    eventually(
        Duration::from_secs(5),
        "the other keys published while one key row is held",
        || async { s.outbox_count(Some(Status::Completed)).await == 16 },
    )
    .await;
    eprintln!(
        "15 other keys published in {:?} with a key row held",
        t.elapsed()
    );
    assert_eq!(
        s.stored(BoxKind::Outbox, held_id).await.status,
        Status::Pending,
        "the held key waits"
    );
    hold.rollback().await.unwrap();
    let t = Instant::now();
    wait_completed(&s.app.store, 17, Duration::from_secs(10)).await;
    eprintln!(
        "the held key published {:?} after its row was freed",
        t.elapsed()
    );
    let recs = consume(&broker.addr(), topic, 17, Duration::from_secs(30));
    assert_eq!(first_deliveries(&recs).1, 0, "nothing published twice");
    s.app.stop().await.unwrap();
}

/// Two SQL writers loop `BEGIN; enqueue(hot); pg_sleep(0.05); COMMIT` on one key: their
/// transactions overlap, so the key's order lock is never free when a relay tries it
/// (PostgreSQL hands it to the next writer in line). A key found held for a second gets
/// a relay's turn in that line (`src/store/postgres/held.rs`): its events are published
/// while the writers go on, within a bounded wait. Before, they waited until the loops
/// stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_kept_busy_by_overlapping_writers_is_published_while_they_go_on() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(2));
    let s = Service::start(c).await;
    let (_, pool) = app_role(&url).await;
    let topic = "sql.hot";
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2 {
        let (pool, stop) = (pool.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query("SELECT mailroom.enqueue($1, 'hot', $2)")
                    .bind(topic)
                    .bind(format!("w{w}-{n}").into_bytes())
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                sqlx::query("SELECT pg_sleep(0.05)")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                n += 1;
            }
            n
        }));
    }
    let started = Instant::now();
    let run = Duration::from_secs(8);
    let mut first = None;
    let mut during = 0;
    while started.elapsed() < run {
        during = s.outbox_count(Some(Status::Completed)).await;
        if during > 0 && first.is_none() {
            first = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for w in writers {
        total += w.await.unwrap();
    }
    eprintln!(
        "busy key: {total} events in {run:?}; first published after {first:?}; {during} published while the writers ran"
    );
    let first = first.expect("the busy key published nothing while its writers ran");
    assert!(
        first < Duration::from_secs(4),
        "first published after {first:?}"
    );
    assert!(
        during as usize * 2 >= total,
        "{during} of {total} published while the writers ran"
    );
    wait_completed(&s.app.store, total as i64, Duration::from_secs(30)).await;
    let recs = consume(&broker.addr(), topic, total, Duration::from_secs(30));
    let (per_key, dups) = first_deliveries(&recs);
    assert_eq!(dups, 0, "nothing published twice");
    let ids = &per_key["hot"];
    assert_eq!(ids.len(), total);
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "in id order");
    s.app.stop().await.unwrap();
}

/// A SQL transaction that holds a key's order lock past the report threshold (5 s) while
/// events of the key wait is named, with its backend pid, in `mailroom_outbox_key_held_seconds` (and a warning
/// in the log); the series goes once the key is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_long_is_named_with_its_holders_pid() {
    let url = fresh_pg().await;
    let s = Service::start(config(&url)).await;
    let (_, pool) = app_role(&url).await;
    let mut tx = pool.begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SELECT mailroom.enqueue('sql.long', 'm', 'x'::bytea)")
        .execute(&mut *tx)
        .await
        .unwrap();
    // An event that waits behind it (a key with nothing waiting is never leased).
    let mut client = s.client.clone();
    enqueue(&mut client, event("sql.long", "m", b"behind")).await;
    let series =
        format!("mailroom_outbox_key_held_seconds{{topic=\"sql.long\",key=\"m\",pid=\"{pid}\"}}");
    let t = Instant::now();
    eventually(
        Duration::from_secs(15),
        "the held key named with its holder's pid",
        || async { s.app.metrics.encode().contains(&series) },
    )
    .await;
    eprintln!("named after {:?}", t.elapsed());
    assert!(
        t.elapsed() >= Duration::from_secs(4),
        "not before the threshold"
    );
    tx.commit().await.unwrap();
    eventually(Duration::from_secs(10), "the series gone", || async {
        !s.app
            .metrics
            .encode()
            .contains("mailroom_outbox_key_held_seconds{")
    })
    .await;
    wait_completed(&s.app.store, 2, Duration::from_secs(10)).await;
    s.app.stop().await.unwrap();
}

/// A key a SQL transaction keeps held is looked at less and less often (200 ms at
/// first, then half the time it has been held, at most 2 s), not leased and released
/// five times a second for as long as the transaction stays open; and the commit still
/// wakes it at once. The key row's version (`xmin`) changes with each lease and release:
/// polled every 10 ms, its distinct values count the looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_open_is_looked_at_less_and_less_often() {
    let url = fresh_pg().await;
    let s = Service::start(config(&url)).await;
    let (_, pool) = app_role(&url).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT mailroom.enqueue('sql.open', 'm', 'x'::bytea)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut client = s.client.clone();
    enqueue(&mut client, event("sql.open", "m", b"behind")).await;
    let mut a = admin(&url).await;
    let version =
        "SELECT xmin::text FROM public.outbox_keys WHERE topic = 'sql.open' AND event_key = 'm'";
    let hold = Duration::from_secs(8);
    let started = Instant::now();
    let (mut last, mut looks) = (String::new(), 0usize);
    while started.elapsed() < hold {
        let v: Option<String> = sqlx::query_scalar(version)
            .fetch_optional(&mut a)
            .await
            .unwrap();
        if let Some(v) = v.filter(|v| *v != last) {
            looks += 1;
            last = v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("key row versions seen in {hold:?}: {looks}");
    // Without the backoff: a look every 200 ms, 40 in 8 s, each a lease and a release
    // (measured: 56 versions). With it: about 9 looks, with the turn that queues after
    // 1 s and its retry after the 5 s queue wait (measured: 18 versions).
    assert!(looks >= 4, "the relays did look at the held key ({looks})");
    assert!(
        looks <= 28,
        "the held key backs off ({looks} versions in {hold:?})"
    );
    let committed = Instant::now();
    tx.commit().await.unwrap();
    wait_completed(&s.app.store, 2, Duration::from_secs(10)).await;
    let after = committed.elapsed();
    eprintln!("published {after:?} after the commit");
    assert!(
        after < Duration::from_millis(1_500),
        "the commit wakes the key at once, not after the backoff: {after:?}"
    );
    s.app.stop().await.unwrap();
}

/// Index entries the scans of `outbox_events_uncounted` have read so far (dead ones
/// included), as the statistics last reported by every backend have them.
async fn uncounted_entries_read(a: &mut sqlx::PgConnection) -> i64 {
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *a)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'outbox_events_uncounted'",
    )
    .fetch_one(&mut *a)
    .await
    .unwrap()
}

/// The fold's cost follows what it folds, not what it folded since the oldest open
/// snapshot (issue 46). A REPEATABLE READ reader stays open while 3,000 SQL-API events
/// are folded: each fold leaves a dead entry in the partial index of uncounted events,
/// which VACUUM may not remove while the reader's snapshot stands. Before, every claim's
/// fold scanned from id 0 through all of them (about 20 folds a second here); now the scan
/// starts at a floor below which everything is counted. The floor never passes a writer
/// still open: an event drawn before one already folded but committed after it is folded
/// and published at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fold_reads_what_it_folds_beside_an_old_snapshot() {
    let url = fresh_pg().await;
    let s = Service::start(config(&url)).await;
    let (_, pool) = app_role(&url).await;
    let mut reader = admin(&url).await;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut reader)
        .await
        .unwrap();
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM public.outbox_events")
        .fetch_one(&mut reader)
        .await
        .unwrap();
    assert_eq!(before, 0, "the reader's snapshot is taken");
    for t in 0..30 {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(
            "SELECT mailroom.enqueue('sql.fold', 'k-' || (i % 50), 'x'::bytea) FROM generate_series(1, 100) i",
        )
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        assert!(t < 30);
    }
    wait_completed(&s.app.store, 3_000, Duration::from_secs(60)).await;

    // As autovacuum would on a table this size (plans then read the partial index).
    let mut a = admin(&url).await;
    sqlx::query("ANALYZE public.outbox_events")
        .execute(&mut a)
        .await
        .unwrap();
    // The fault: 3,000 dead entries the old snapshot keeps; one scan reads them all.
    sqlx::query("SET enable_seqscan = off")
        .execute(&mut a)
        .await
        .unwrap();
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut a)
        .await
        .unwrap();
    let t0 = uncounted_entries_read(&mut a).await;
    let uncounted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT id FROM public.outbox_events WHERE NOT counted ORDER BY id) u",
    )
    .fetch_one(&mut a)
    .await
    .unwrap();
    assert_eq!(uncounted, 0);
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut a)
        .await
        .unwrap();
    let t1 = uncounted_entries_read(&mut a).await;
    eprintln!("one scan from 0 read {} entries", t1 - t0);
    assert!(
        t1 - t0 >= 3_000,
        "the dead entries are there: one scan read {} of them",
        t1 - t0
    );

    // The relays' folds over 4 s of claims (20 a second): before, 80 such scans. Backends
    // report at most once a second: the reports of the folding above come in first.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let t2 = uncounted_entries_read(&mut a).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Backends report at most once a second; wait for the last reports.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let t3 = uncounted_entries_read(&mut a).await;
    eprintln!("the folds of 4 s read {} entries", t3 - t2);
    assert!(
        t3 - t2 < 3_000,
        "the folds read less than one scan of the dead entries in 4 s: {}",
        t3 - t2
    );

    // A writer that drew its id before another one was folded, and commits after.
    let mut early = pool.begin().await.unwrap();
    let early_id: i64 =
        sqlx::query_scalar("SELECT mailroom.enqueue('sql.fold', 'early', 'e'::bytea)")
            .fetch_one(&mut *early)
            .await
            .unwrap();
    let mut late = pool.begin().await.unwrap();
    let late_id: i64 =
        sqlx::query_scalar("SELECT mailroom.enqueue('sql.fold', 'late', 'l'::bytea)")
            .fetch_one(&mut *late)
            .await
            .unwrap();
    assert!(early_id < late_id);
    late.commit().await.unwrap();
    wait_completed(&s.app.store, 3_001, Duration::from_secs(10)).await;
    // Folds go on above the late event while the early writer stays open.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let committed = Instant::now();
    early.commit().await.unwrap();
    wait_completed(&s.app.store, 3_002, Duration::from_secs(10)).await;
    let after = committed.elapsed();
    eprintln!("the early writer's event published {after:?} after its commit");
    assert!(
        after < Duration::from_millis(1_500),
        "folded at once, not at the next sweep: {after:?}"
    );
    sqlx::query("COMMIT").execute(&mut reader).await.unwrap();
    s.app.stop().await.unwrap();
}

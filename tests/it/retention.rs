//! Retention deletes completed (and expired failed) events and idle keys, and only them.

use std::time::Duration;

use crate::support::probe::*;
use crate::support::*;
use mailroom::domain::BoxKind;
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::retention::{RetentionConfig, run_round};
use tokio_util::sync::CancellationToken;

/// Retention deletes old completed events, then (when asked) old failed ones, and idle
/// unleased keys; never pending events, recent rows, leased or busy keys.
#[tokio::test]
async fn retention_removes_only_what_it_should() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let pg = url.starts_with("postgres");
        let mut c = quiet_config(&url);
        c.retention.interval = None;
        let mut s = Service::start(c).await;
        // ids 1..=12: old-done (1-3), new-done (4-5), old-failed (6-7), new-failed (8),
        // old pending (9-10), pending on a leased key (11), unkeyed done (12).
        let keys = [
            "a", "a", "b", "c", "c", "d", "d", "e", "f", "f", "leased", "",
        ];
        let mut ids = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            ids.push(enqueue(&mut s.client, event("ret", k, format!("{i}").as_bytes())).await);
        }
        assert_eq!(ids, (1..=12).collect::<Vec<i64>>());
        let (old, recent, infinity, leased_until) = if pg {
            (
                "now() - interval '8 days'".to_string(),
                "now() - interval '1 day'".to_string(),
                "'infinity'".to_string(),
                "now() + interval '1 minute'".to_string(),
            )
        } else {
            let now = chrono::Utc::now().timestamp_micros();
            let day = 86_400_000_000i64;
            (
                (now - 8 * day).to_string(),
                (now - day).to_string(),
                i64::MAX.to_string(),
                (now + 60_000_000).to_string(),
            )
        };
        exec(
            &url,
            &format!(
                "UPDATE outbox_events SET status = 'completed', published_at = {old}, updated_at = {old} WHERE id IN (1, 2, 3, 12);
                 UPDATE outbox_events SET status = 'completed', published_at = {recent}, updated_at = {recent} WHERE id IN (4, 5);
                 UPDATE outbox_events SET status = 'failed', updated_at = {old}, last_error = 'x' WHERE id IN (6, 7);
                 UPDATE outbox_events SET status = 'failed', updated_at = {recent}, last_error = 'x' WHERE id = 8;
                 UPDATE outbox_events SET created_at = {old}, updated_at = {old} WHERE id IN (9, 10, 11);
                 UPDATE outbox_keys SET ready_at = {infinity} WHERE pending = 0;
                 UPDATE outbox_keys SET ready_at = {infinity}, lease_token = 7, lease_until = {leased_until} WHERE event_key = 'leased';"
            ),
        )
        .await;
        // The leased key has a pending event; make one more leased key without any.
        exec(
            &url,
            &format!(
                "INSERT INTO outbox_keys (topic, event_key, ready_at, lease_token, lease_until)
                 VALUES ('ret', 'leased-idle', {infinity}, 8, {leased_until})"
            ),
        )
        .await;

        let stop = CancellationToken::new();
        let mut cfg = RetentionConfig {
            completed: Some(Duration::from_secs(7 * 86_400)),
            failed: None,
            interval: None,
            batch: 2, // several batches per kind
        };
        let r = run_round(s.app.store.as_ref(), &cfg, &stop).await.unwrap();
        assert_eq!((r.completed, r.failed), (4, 0), "{r:?}");
        let left = |url: String| async move {
            count_rows(&url, "SELECT count(*) FROM outbox_events").await
        };
        assert_eq!(left(url.clone()).await, 8);
        for id in [4, 5, 6, 7, 8, 9, 10, 11] {
            assert!(
                s.found(BoxKind::Outbox, id).await.is_some(),
                "event {id} must survive"
            );
        }
        // Keys: a (all done), b (done), c (recent done), d (failed), e (failed) are idle
        // and go; f (pending), leased (pending, leased) and leased-idle (leased) stay.
        assert_eq!(r.keys, 5, "{r:?}");
        let mut kept: Vec<String> = {
            use sqlx::Connection;
            if pg {
                let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
                sqlx::query_scalar("SELECT event_key FROM outbox_keys")
                    .fetch_all(&mut c)
                    .await
                    .unwrap()
            } else {
                let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
                sqlx::query_scalar("SELECT event_key FROM outbox_keys")
                    .fetch_all(&mut c)
                    .await
                    .unwrap()
            }
        };
        kept.sort();
        assert_eq!(kept, vec!["f", "leased", "leased-idle"]);

        // Failed retention, when configured.
        cfg.failed = Some(Duration::from_secs(7 * 86_400));
        let r = run_round(s.app.store.as_ref(), &cfg, &stop).await.unwrap();
        assert_eq!((r.completed, r.failed, r.keys), (0, 2, 0), "{r:?}");
        assert_eq!(left(url.clone()).await, 6);
        assert!(s.found(BoxKind::Outbox, 8).await.is_some());

        // A pruned key comes back with its next event, and requeue of a failed event on
        // a pruned key works.
        let id = enqueue(&mut s.client, event("ret", "a", b"again")).await;
        assert_eq!(
            count_rows(
                &url,
                "SELECT count(*) FROM outbox_keys WHERE event_key = 'a' AND pending = 1"
            )
            .await,
            1
        );
        let mut admin = AdminServiceClient::new(channel(s.app.addr).await);
        admin
            .requeue_failed(pb::RequeueFailedRequest {
                ids: vec![8],
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(
            count_rows(
                &url,
                "SELECT count(*) FROM outbox_keys WHERE event_key = 'e' AND pending = 1"
            )
            .await,
            1
        );
        assert!(id > 12);
        s.app.stop().await.unwrap();
    }
}

/// The background task runs on its interval and counts what it deletes.
#[tokio::test]
async fn retention_runs_in_the_background() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.retention = RetentionConfig {
        completed: Some(Duration::from_secs(3600)),
        failed: None,
        interval: Some(Duration::from_millis(100)),
        batch: 10,
    };
    let mut s = Service::start(c).await;
    for i in 0..25 {
        enqueue(&mut s.client, event("bg", &format!("k{}", i % 3), b"x")).await;
    }
    exec(
        &url,
        "UPDATE outbox_events SET status = 'completed', published_at = now() - interval '2 hours' WHERE id <= 20",
    )
    .await;
    eventually(Duration::from_secs(10), "expired rows deleted", || async {
        count_rows(&url, "SELECT count(*) FROM outbox_events").await == 5
    })
    .await;
    // The round counts what it deleted once it has finished (idle keys come last).
    let metrics = s.app.metrics.clone();
    eventually(Duration::from_secs(5), "the deletes counted", || {
        let text = metrics.encode();
        async move {
            sample_opt(
                &text,
                "mailroom_retention_deleted_total{status=\"completed\"}",
            ) == Some(20.0)
        }
    })
    .await;
    s.app.stop().await.unwrap();
}

/// Issue 24, item 4: a requeue that lowers a key's cursor (its failed event sits below
/// events the cursor published) racing a retention round that deletes those
/// cursor-published events. 300 keys, each `[failed, 4 published by the cursor an hour
/// ago]`; one task requeues the failed events one key at a time (two requests in
/// flight), another runs retention rounds of 20 events. Every requeue succeeds (admin
/// flows are not retried: a deadlock would be an error), and afterwards every key's
/// pending count is exact: its requeued event, 1. Before the fix, the requeue counted
/// the published rows it was about to mark `completed` while retention deleted them, so
/// the key's count stayed too high for good; or the two deadlocked (the requeue held the
/// key row and waited for the advance log row that retention held while its delete
/// waited for the key row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_racing_retention_keeps_counts_exact_and_never_deadlocks() {
    use mailroom::domain::admin::{ActionContext, RequeueRequest, Selection};
    use mailroom::store::retention::Finished;
    const KEYS: i64 = 300;
    let (url, s) = quiet_pg().await;
    exec(
        &url,
        &format!(
            "INSERT INTO outbox_events (topic, event_key, payload, headers, max_attempts,
                 scheduled_at, status, attempts, last_error, created_at, updated_at)
             SELECT 'race', 'k' || k, '\\x00'::bytea, '{{}}'::jsonb, 3, now() - interval '1 hour',
                    CASE WHEN n = 1 THEN 'failed' ELSE 'pending' END,
                    CASE WHEN n = 1 THEN 3 ELSE 0 END,
                    CASE WHEN n = 1 THEN 'refused' END,
                    now() - interval '1 hour', now() - interval '1 hour'
             FROM generate_series(1, {KEYS}) k, generate_series(1, 5) n ORDER BY k, n;
             INSERT INTO outbox_keys (topic, event_key, ready_at, pending, published_through)
             SELECT topic, event_key, 'infinity', 0, max(id) FROM outbox_events GROUP BY 1, 2;
             INSERT INTO outbox_publishes (topic, event_key, through, at, events)
             SELECT topic, event_key, max(id), now() - interval '1 hour', 4
             FROM outbox_events GROUP BY 1, 2;"
        ),
    )
    .await;
    let failed: Vec<i64> = {
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        sqlx::query_scalar("SELECT id FROM outbox_events WHERE status = 'failed' ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    assert_eq!(failed.len() as i64, KEYS);

    let store = s.app.store.clone();
    let retention = tokio::spawn(async move {
        let mut deleted = 0;
        loop {
            let n = store
                .purge(Finished::Completed, Duration::from_secs(60), 20)
                .await
                .expect("a retention round");
            deleted += n;
            if n == 0 {
                return deleted;
            }
        }
    });
    let mut requeuers = Vec::new();
    for half in failed.chunks(failed.len() / 2) {
        let (store, ids) = (s.app.store.clone(), half.to_vec());
        requeuers.push(tokio::spawn(async move {
            for id in ids {
                let r = RequeueRequest {
                    selection: Selection::Ids(vec![id]),
                    limit: 1,
                    context: ActionContext::by("race test"),
                };
                let out = store
                    .requeue_failed(BoxKind::Outbox, &r)
                    .await
                    .unwrap_or_else(|e| panic!("requeue of {id}: {e}"));
                assert_eq!(out.count, 1);
            }
        }));
    }
    for r in requeuers {
        r.await.unwrap();
    }
    let deleted = retention.await.unwrap();
    // Both sides acted: retention deleted published rows the requeue had not yet
    // reached (keys it got to first), and the requeue kept the others as rows.
    assert!(deleted > 0, "retention deleted nothing");
    let wrong = count_rows(
        &url,
        "SELECT count(*) FROM outbox_keys k WHERE k.pending <> (
             SELECT count(*) FROM outbox_events_view e WHERE e.topic = k.topic
               AND e.event_key = k.event_key AND e.status = 'pending')",
    )
    .await;
    assert_eq!(wrong, 0, "keys whose pending count is off");
    let pending = count_rows(&url, "SELECT sum(pending)::int8 FROM outbox_keys").await;
    assert_eq!(pending, KEYS, "each key holds its requeued event");
    // GetStats' completed counters (migration 0016) agree with the rows.
    let completed = count_rows(
        &url,
        "SELECT count(*) FROM outbox_events_view WHERE status = 'completed'",
    )
    .await;
    let stats = s.app.store.stats(BoxKind::Outbox, None).await.unwrap();
    assert_eq!(stats.completed, completed, "GetStats' completed count");
    s.app.stop().await.unwrap();
}

/// The same race made certain: a retention round's delete of a key's cursor-published
/// events is held half-way (a test transaction locks one of the rows it must delete),
/// then a requeue of the key's failed event starts; when the round goes on, the requeue
/// must see what it deleted. Both are seen waiting on a lock (the fault fired) before the
/// test lets go. Before the fix the requeue counted the 4 rows the round then deleted:
/// the key's pending count stayed at 5 for 1 pending event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requeue_behind_a_retention_round_counts_what_is_left() {
    use mailroom::domain::admin::{ActionContext, RequeueRequest, Selection};
    use mailroom::store::retention::Finished;
    use sqlx::Connection;
    let (url, s) = quiet_pg().await;
    exec(
        &url,
        "INSERT INTO outbox_events (topic, event_key, payload, headers, max_attempts,
             scheduled_at, status, attempts, last_error, created_at, updated_at)
         SELECT 'race', 'k', '\\x00'::bytea, '{}'::jsonb, 3, now() - interval '1 hour',
                CASE WHEN n = 1 THEN 'failed' ELSE 'pending' END, CASE WHEN n = 1 THEN 3 ELSE 0 END,
                CASE WHEN n = 1 THEN 'refused' END, now() - interval '1 hour', now() - interval '1 hour'
         FROM generate_series(1, 5) n ORDER BY n;
         INSERT INTO outbox_keys (topic, event_key, ready_at, pending, published_through)
         SELECT topic, event_key, 'infinity', 0, max(id) FROM outbox_events GROUP BY 1, 2;
         INSERT INTO outbox_publishes (topic, event_key, through, at, events)
         SELECT topic, event_key, max(id), now() - interval '1 hour', 4 FROM outbox_events GROUP BY 1, 2;",
    )
    .await;
    let mut holder = sqlx::PgConnection::connect(&url).await.unwrap();
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox_events ORDER BY id")
        .fetch_all(&mut holder)
        .await
        .unwrap();
    let mut hold = holder.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox_events WHERE id = $1 FOR UPDATE")
        .bind(ids[3])
        .fetch_one(&mut *hold)
        .await
        .unwrap();
    let waiting = |n: i64| {
        let url = url.clone();
        async move {
            count_rows(
                &url,
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .await
                >= n
        }
    };
    let store = s.app.store.clone();
    let round = tokio::spawn(async move {
        store
            .purge(Finished::Completed, Duration::from_secs(60), 100)
            .await
    });
    eventually(
        Duration::from_secs(10),
        "the round waits on the held row",
        || waiting(1),
    )
    .await;
    let store = s.app.store.clone();
    let failed = ids[0];
    let requeue = tokio::spawn(async move {
        let r = RequeueRequest {
            selection: Selection::Ids(vec![failed]),
            limit: 1,
            context: ActionContext::by("race test"),
        };
        store.requeue_failed(BoxKind::Outbox, &r).await
    });
    eventually(Duration::from_secs(10), "the requeue waits too", || {
        waiting(2)
    })
    .await;
    hold.rollback().await.unwrap();
    let deleted = round.await.unwrap().expect("the round");
    let out = requeue.await.unwrap().expect("the requeue");
    assert_eq!(out.count, 1);
    assert_eq!(deleted, 4, "the round deleted the published events");
    let pending = count_rows(&url, "SELECT pending::int8 FROM outbox_keys").await;
    let actual = count_rows(
        &url,
        "SELECT count(*) FROM outbox_events_view WHERE status = 'pending'",
    )
    .await;
    assert_eq!(
        (pending, actual),
        (1, 1),
        "the key's count and its pending events"
    );
    let stats = s.app.store.stats(BoxKind::Outbox, None).await.unwrap();
    assert_eq!(
        (stats.completed, stats.failed),
        (0, 0),
        "GetStats after the race"
    );
    s.app.stop().await.unwrap();
}

/// Issue 27, item 4: one round deletes every due event a relay published by cursor, batch
/// after batch, not one batch. Events are published the way a drain publishes them (a
/// relay, short runs over many keys, so each cursor advance covers a few events) and
/// dated back. Before, each batch took whole advances up to the batch size and so came
/// back a few events short, which ended the round: one batch a round, a round a minute
/// by default (about 17 events/s), behind any real load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_deletes_every_due_cursor_published_event() {
    const EVENTS: i64 = 1500;
    let url = fresh_pg().await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(&url);
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(dir.path().join("out.jsonl")),
    };
    let mut s = Service::start(c).await;
    let events: Vec<pb::Event> = (0..EVENTS)
        .map(|i| event("ret.cursor", &format!("k{}", i % 300), b"x"))
        .collect();
    enqueue_in_batches(&mut s, &events).await;
    wait_completed(&s.app.store, EVENTS, Duration::from_secs(60)).await;
    let advances = count_rows(&url, "SELECT count(*) FROM outbox_publishes").await;
    assert!(advances > 300, "several advances per key: {advances}");
    exec(
        &url,
        "UPDATE outbox_publishes SET at = at - interval '2 hours';
         UPDATE outbox_events SET published_at = published_at - interval '2 hours'
         WHERE status = 'completed'",
    )
    .await;
    let cfg = RetentionConfig {
        completed: Some(Duration::from_secs(3600)),
        failed: None,
        interval: None,
        batch: 100,
    };
    let stop = CancellationToken::new();
    let r = run_round(s.app.store.as_ref(), &cfg, &stop).await.unwrap();
    assert_eq!(r.completed, EVENTS as u64, "{r:?}");
    assert_eq!(
        count_rows(&url, "SELECT count(*) FROM outbox_events").await,
        0
    );
    assert_eq!(
        count_rows(&url, "SELECT count(*) FROM outbox_publishes").await,
        0
    );
    s.app.stop().await.unwrap();
}

/// Issue 46, item 1: pruning idle key rows reads a bounded slice of the key table per
/// call (ten key rows per row it may delete), from where the previous call stopped,
/// wrapping round, so a call's cost does not grow with the history; every prunable key
/// is still pruned within one turn of the table, and keys whose line still holds rows
/// are kept. 190 keys whose lines hold retained rows and 10 empty idle keys among them
/// (every twentieth): with a limit of 1 a call reads 10 rows, so a call that reads only
/// kept keys deletes nothing (main read the whole table for its one row: 1 per call).
#[tokio::test]
async fn pruning_reads_a_bounded_slice_and_goes_round_the_whole_table() {
    let url = fresh_pg().await;
    let store = mailroom::app::open_store(&quiet_config(&url))
        .await
        .unwrap();
    // Retained lines: events published by the cursor (still `pending`, at or below it).
    exec(
        &url,
        "INSERT INTO outbox_events (topic, event_key, payload, max_attempts, scheduled_at)
         SELECT 'prune', 'k' || lpad(i::text, 3, '0'), '\\x01', 6, now()
         FROM generate_series(0, 199) i WHERE i % 20 <> 19",
    )
    .await;
    exec(
        &url,
        "INSERT INTO outbox_keys (topic, event_key, ready_at, pending, published_through)
         SELECT 'prune', 'k' || lpad(i::text, 3, '0'), 'infinity', 0,
                coalesce((SELECT max(id) FROM outbox_events), 0)
         FROM generate_series(0, 199) i
         ON CONFLICT (topic, event_key) DO UPDATE SET ready_at = 'infinity', pending = 0,
             published_through = EXCLUDED.published_through",
    )
    .await;
    let keys = "SELECT count(*) FROM outbox_keys";
    assert_eq!(count_rows(&url, keys).await, 200);
    // The first slice (k000..k009) holds no empty key.
    assert_eq!(store.prune_idle_keys(1).await.unwrap(), 0);
    let mut calls = 1;
    let mut empty_calls = 1;
    while count_rows(&url, keys).await > 190 {
        let n = store.prune_idle_keys(1).await.unwrap();
        assert!(n <= 1);
        empty_calls += usize::from(n == 0);
        calls += 1;
        assert!(calls <= 40, "the turn never ended: {calls} calls");
    }
    println!("10 empty keys pruned in {calls} calls ({empty_calls} found none in their slice)");
    // Every kept key still has its line.
    assert_eq!(
        count_rows(
            &url,
            "SELECT count(*) FROM outbox_keys k WHERE EXISTS (SELECT 1 FROM outbox_events e
             WHERE e.topic = k.topic AND e.event_key = k.event_key)"
        )
        .await,
        190
    );
    // Past the last key the next call starts again from the first.
    assert_eq!(store.prune_idle_keys(1000).await.unwrap(), 0);
    assert!(
        empty_calls > 0,
        "every call found a row: the whole table was read"
    );
}

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

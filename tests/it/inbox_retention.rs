//! Retention of the inbox (issue 23, item 2), on PostgreSQL and SQLite: handled messages
//! older than the completed retention, failed ones past the failed retention and idle
//! key rows are deleted; a redelivery inside the window is still dropped as a duplicate,
//! one after it is handled again (the dedup window the retention implies).

use std::time::Duration;

use crate::support::*;
use mailroom::config::Config;
use mailroom::retention::{RetentionConfig, run_round};
use tokio_util::sync::CancellationToken;

/// A subscriber that handles everything.
type Handler = Recorder<Accept>;

#[tokio::test]
async fn inbox_retention_purges_old_rows_and_keeps_the_dedup_window() {
    for engine in &ENGINES {
        let handler = Handler::default();
        let url_h = handler.serve().await;
        let (url, _dir) = fresh_db(engine).await;
        let pg = url.starts_with("postgres");
        let mut c: Config = quiet_config(&url);
        c.retention.interval = None;
        c.subscriptions = vec![subscription("ret", &[], &url_h)];
        let s = Service::start(c).await;
        let mut inbox = inbox_client(&s).await;
        // old-1, old-2 (key a), recent (key b), old-failed (key c), each handled.
        for (id, key) in [
            ("old-1", "a"),
            ("old-2", "a"),
            ("recent", "b"),
            ("gone-bad", "c"),
        ] {
            let r = receive(&mut inbox, "ret", id, key, "x").await;
            assert!(!r.duplicate, "{id}");
        }
        eventually(Duration::from_secs(20), "all handled", || async {
            count_rows(
                &url,
                "SELECT count(*) FROM inbox_events WHERE status = 'completed'",
            )
            .await
                == 4
        })
        .await;
        eventually(Duration::from_secs(20), "keys idle", || async {
            count_rows(
                &url,
                "SELECT count(*) FROM inbox_keys WHERE lease_token IS NULL AND pending = 0",
            )
            .await
                == 3
        })
        .await;
        let (old, recent) = if pg {
            (
                "now() - interval '8 days'".to_string(),
                "now() - interval '1 day'".to_string(),
            )
        } else {
            let now = chrono::Utc::now().timestamp_micros();
            let day = 86_400_000_000i64;
            ((now - 8 * day).to_string(), (now - day).to_string())
        };
        exec(
            &url,
            &format!(
                "UPDATE inbox_events SET published_at = {old}, updated_at = {old}
                     WHERE message_id IN ('rpc:old-1', 'rpc:old-2');
                 UPDATE inbox_events SET published_at = {recent}, updated_at = {recent}
                     WHERE message_id = 'rpc:recent';
                 UPDATE inbox_events SET status = 'failed', last_error = 'x', updated_at = {old}
                     WHERE message_id = 'rpc:gone-bad';"
            ),
        )
        .await;

        let stop = CancellationToken::new();
        let mut cfg = RetentionConfig {
            completed: Some(Duration::from_secs(7 * 86_400)),
            failed: None,
            interval: None,
            batch: 1, // several batches
        };
        let r = run_round(s.app.store.as_ref(), &cfg, &stop).await.unwrap();
        assert_eq!((r.inbox_completed, r.inbox_failed), (2, 0), "{r:?}");
        assert_eq!(r.inbox_keys, 3, "every key is idle: {r:?}");
        assert_eq!(
            count_rows(&url, "SELECT count(*) FROM inbox_events").await,
            2
        );
        assert_eq!(count_rows(&url, "SELECT count(*) FROM inbox_keys").await, 0);

        // Inside the window: dropped as a duplicate. After it: handled again.
        let again = receive(&mut inbox, "ret", "recent", "b", "x").await;
        assert!(again.duplicate, "a redelivery inside the window is dropped");
        let again = receive(&mut inbox, "ret", "old-1", "a", "x").await;
        assert!(!again.duplicate, "after the window the message is new");
        eventually(Duration::from_secs(20), "handled again", || async {
            handler
                .calls()
                .iter()
                .filter(|c| c.message_id == "rpc:old-1")
                .count()
                == 2
        })
        .await;

        // Failed retention, when configured.
        cfg.failed = Some(Duration::from_secs(7 * 86_400));
        let r = run_round(s.app.store.as_ref(), &cfg, &stop).await.unwrap();
        assert_eq!(r.inbox_failed, 1, "{r:?}");
        assert_eq!(
            count_rows(
                &url,
                "SELECT count(*) FROM inbox_events WHERE message_id = 'rpc:gone-bad'"
            )
            .await,
            0
        );
        s.app.stop().await.unwrap();
    }
}

//! A binary never acts on a schema it does not know (issue 24, item 1). Today's binary
//! (the `App` the tests start) against a database migrated one version ahead, by hand:
//! a row in `_sqlx_migrations` it does not know and a `mailroom_schema_compat` record.
//! When the record requires a newer binary, the relay publishes nothing, `RequeueFailed`
//! is `FAILED_PRECONDITION` naming both versions, retention deletes nothing and health
//! `""` is `NOT_SERVING`, while enqueues are still stored. When the record says this
//! binary is fine (an additive migration), everything works. Both engines.

use std::sync::Arc;
use std::time::Duration;

use crate::support::probe::{health_status, wait_health};
use crate::support::*;
use mailroom::config::Config;
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use tonic::Code;
use tonic_types::StatusExt;

const SERVING: i32 = 1;
const NOT_SERVING: i32 = 2;

/// Relays and retention quick enough to act (or not) within a second.
fn quick(url: &str, retention: bool) -> Config {
    let mut c = config(url);
    c.relays = 1;
    c.retention.completed = Some(Duration::ZERO);
    c.retention.interval = retention.then_some(Duration::from_millis(100));
    c
}

async fn start(c: Config, sink: &Arc<RecordingSink>) -> Service {
    Service::start_with_sink(c, sink.clone()).await
}

fn published(sink: &RecordingSink) -> usize {
    sink.seen.lock().unwrap().len()
}

/// Runs `sql` (binding `a`, `b`) on the database at `url`, whichever its engine.
async fn exec(url: &str, sql: &str, a: i64, b: i64) {
    if url.starts_with("sqlite") {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        let sql = sql.replace("$1", "?1").replace("$2", "?2");
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(a)
            .bind(b)
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    } else {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
            .bind(a)
            .bind(b)
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
}

/// What a newer release's migration `version` would leave: applied, and requiring
/// binaries that know `required`.
async fn migrate_ahead(url: &str, version: i64, required: i64) {
    exec(
        url,
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES ($1, 'from a newer release', TRUE, '', $2)",
        version,
        0,
    )
    .await;
    exec(
        url,
        "INSERT INTO mailroom_schema_compat (version, min_binary_schema) VALUES ($1, $2)",
        version,
        required,
    )
    .await;
}

async fn requeue(
    a: &mut AdminServiceClient<tonic::transport::Channel>,
    id: i64,
) -> Result<pb::RequeueFailedResponse, tonic::Status> {
    a.requeue_failed(pb::RequeueFailedRequest {
        ids: vec![id],
        operator: "ops".into(),
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner())
}

/// Three published events, and one cancelled (failed) before its time: what the older
/// replica finds when it starts again.
async fn history(url: &str, sink: &Arc<RecordingSink>) -> (i64, i64) {
    let mut s = start(quick(url, false), sink).await;
    let known = s.app.store.known_schema();
    for i in 0..3 {
        enqueue(
            &mut s.client,
            event("orders", "k", format!("{i}").as_bytes()),
        )
        .await;
    }
    let mut later = event("orders", "later", b"later");
    later.deliver_after = Some(prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() + 3600,
        nanos: 0,
    });
    let failed = enqueue(&mut s.client, later).await;
    AdminServiceClient::new(channel(s.app.addr).await)
        .cancel_events(pb::CancelEventsRequest {
            ids: vec![failed],
            reason: "test".into(),
            operator: "ops".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    eventually(Duration::from_secs(10), "3 published", || async {
        s.outbox_count(Some(Status::Completed)).await == 3
    })
    .await;
    s.app.stop().await.unwrap();
    (known, failed)
}

#[tokio::test]
async fn an_older_binary_stops_on_an_incompatible_schema_and_runs_on_an_additive_one() {
    for engine in [Engine::Postgres, Engine::Sqlite] {
        let (url, _dir) = fresh_db(&engine).await;
        let sink = Arc::new(RecordingSink::default());
        let (known, failed) = history(&url, &sink).await;
        let before = published(&sink);
        let next = known + 1;

        // A newer release applied `next`, which old binaries must not run on.
        migrate_ahead(&url, next, next).await;
        let mut s = start(quick(&url, true), &sink).await;
        // Enqueues are stored (the insert path is kept compatible, docs/storage.md).
        let queued = enqueue(&mut s.client, event("orders", "k", b"after")).await;
        wait_health(
            s.app.addr,
            NOT_SERVING,
            Duration::from_secs(5),
            "NOT_SERVING on an incompatible schema",
        )
        .await;
        let mut a = AdminServiceClient::new(channel(s.app.addr).await);
        let err = requeue(&mut a, failed).await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        for v in [format!("schema {known}"), format!("version {next}")] {
            assert!(err.message().contains(&v), "{v} in {}", err.message());
        }
        let info = err.get_details_error_info().expect("ErrorInfo");
        assert_eq!(info.reason, "SCHEMA_INCOMPATIBLE");
        assert_eq!(info.metadata["binary_schema"], known.to_string());
        assert_eq!(info.metadata["database_schema"], next.to_string());
        // A second of relay polls and retention rounds: nothing moves.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(published(&sink), before, "{engine:?}: nothing published");
        assert_eq!(s.outbox_count(Some(Status::Completed)).await, 3, "kept");
        assert_eq!(
            s.stored(BoxKind::Outbox, failed).await.status,
            Status::Failed
        );
        assert_eq!(
            s.stored(BoxKind::Outbox, queued).await.status,
            Status::Pending
        );
        assert_eq!(health_status(s.app.addr, "").await, Some(NOT_SERVING));
        s.app.stop().await.unwrap();

        // The same migration, declared additive: this binary runs on it.
        exec(
            &url,
            "UPDATE mailroom_schema_compat SET min_binary_schema = $2 WHERE version = $1",
            next,
            known,
        )
        .await;
        let s = start(quick(&url, true), &sink).await;
        assert_eq!(health_status(s.app.addr, "").await, Some(SERVING));
        let mut a = AdminServiceClient::new(channel(s.app.addr).await);
        assert_eq!(requeue(&mut a, failed).await.unwrap().count, 1);
        eventually(
            Duration::from_secs(10),
            "published, then deleted by retention",
            || async { s.outbox_count(None).await == 0 },
        )
        .await;
        assert_eq!(published(&sink), before + 2, "{engine:?}");
        s.app.stop().await.unwrap();
    }
}

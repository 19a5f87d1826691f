//! Issue 42, item 1: one session profile for every connection mailroom opens. A database
//! shared with other roles: what they create, how they are named, and the session
//! defaults of the database or a role change nothing in mailroom's sessions
//! (docs/security.md, "A shared database").

use std::time::Duration;

use crate::support::handler::{Accept, Recorder, inbox_client, receive, subscription};
use crate::support::*;
use mailroom::app::{open_store, pg_pools};
use mailroom::domain::Status;
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use sqlx::Connection;
use tonic_types::StatusExt;

fn as_user(url: &str, role: &str) -> String {
    url.replacen("postgres://postgres@", &format!("postgres://{role}@"), 1)
}

fn unique_role(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// What an application role that may create in `public` plants there: better matches
/// than pg_catalog's for calls mailroom makes (`bigint * interval` in every lease,
/// `pg_column_size(jsonb)` in every claim's byte budget, `jsonb_build_object` and
/// `jsonb_build_array` in a counted failure's attempt log, `hashtextextended` under the
/// order lock). Each records the user it ran as.
const PLANTS: &[&str] = &[
    "CREATE TABLE public.hijacked (what text)",
    "GRANT INSERT ON public.hijacked TO PUBLIC",
    "CREATE FUNCTION public.evil_mul(a bigint, b interval) RETURNS interval LANGUAGE plpgsql AS
     $$ BEGIN INSERT INTO public.hijacked VALUES ('bigint * interval as ' || current_user);
        RETURN a::float8 * b; END $$",
    "CREATE OPERATOR public.* (LEFTARG = bigint, RIGHTARG = interval, FUNCTION = public.evil_mul)",
    "CREATE FUNCTION public.pg_column_size(a jsonb) RETURNS integer LANGUAGE plpgsql AS
     $$ BEGIN INSERT INTO public.hijacked VALUES ('pg_column_size as ' || current_user);
        RETURN pg_catalog.octet_length(a::text); END $$",
    "CREATE FUNCTION public.jsonb_build_object(a text, b integer, c text, d timestamptz, e text, f text)
     RETURNS jsonb LANGUAGE plpgsql AS
     $$ BEGIN INSERT INTO public.hijacked VALUES ('jsonb_build_object as ' || current_user);
        RETURN '{}'::jsonb; END $$",
    "CREATE FUNCTION public.jsonb_build_array(a jsonb) RETURNS jsonb LANGUAGE plpgsql AS
     $$ BEGIN INSERT INTO public.hijacked VALUES ('jsonb_build_array as ' || current_user);
        RETURN '[]'::jsonb; END $$",
    "CREATE FUNCTION public.hashtextextended(t text, seed integer) RETURNS bigint LANGUAGE plpgsql AS
     $$ BEGIN INSERT INTO public.hijacked VALUES ('hashtextextended as ' || current_user);
        RETURN 1; END $$",
];

async fn hijacked(url: &str) -> Vec<String> {
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query_scalar("SELECT what FROM public.hijacked ORDER BY 1")
        .fetch_all(&mut c)
        .await
        .unwrap()
}

/// Objects planted in `public` by a role that may create there never run in any of
/// mailroom's sessions: relay cycles with counted failures and failed events, a requeue,
/// retention, admin reads and the inbox. (On the release before the profile, the lease's
/// `bigint * interval` alone ran once per claim, as mailroom's database user.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_planted_in_public_never_run_in_mailroom_sessions() {
    let url = fresh_pg().await;
    // Migrated before the plants: the migrator searches the data schema (docs/security.md).
    let store = open_store(&config(&url)).await.unwrap();
    drop(store);
    let role = unique_role("planter");
    exec(
        &url,
        &format!(
            "CREATE ROLE {role} LOGIN; GRANT CREATE ON SCHEMA public TO {role};
             GRANT CONNECT ON DATABASE {} TO {role}",
            url.rsplit('/').next().unwrap()
        ),
    )
    .await;
    let mut planter = sqlx::PgConnection::connect(&as_user(&url, &role))
        .await
        .unwrap();
    for sql in PLANTS {
        sqlx::query(sqlx::AssertSqlSafe(*sql))
            .execute(&mut planter)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    // The plants are live: a session with the default search path runs them.
    exec(
        &url,
        "SELECT 2::bigint * interval '1 ms', pg_column_size('{}'::jsonb),
                jsonb_build_array(jsonb_build_object('a', 1, 'b', now(), 'c', 'd'));
         SELECT hashtextextended('k', 7)",
    )
    .await;
    assert_eq!(hijacked(&url).await.len(), 5, "{:?}", hijacked(&url).await);
    exec(&url, "DELETE FROM public.hijacked").await;

    // Outbox: half the deliveries fail (counted), two attempts each; completed events
    // are purged at once; an inbox subscription fed by Receive.
    let handler = Recorder::<Accept>::default();
    let handler_url = handler.serve().await;
    let mut c = config(&url);
    c.faults = (0.5, 0.0);
    c.relay.retry.base = Duration::ZERO;
    c.relay.retry.cap = Duration::ZERO;
    c.retention.completed = Some(Duration::ZERO);
    c.retention.interval = Some(Duration::from_millis(200));
    c.subscriptions = vec![subscription("hooks", &[], &handler_url)];
    let dir = tempfile::tempdir().unwrap();
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(dir.path().join("out.jsonl")),
    };
    let mut s = Service::start(c).await;
    for i in 0..40 {
        let mut e = event("planted", &format!("k{}", i % 10), b"x");
        e.max_attempts = 2;
        e.headers.insert("h".into(), "v".into());
        enqueue(&mut s.client, e).await;
    }
    eventually(Duration::from_secs(30), "every event settled", || async {
        s.outbox_count(Some(Status::Pending)).await == 0
    })
    .await;
    let failed = s.outbox_count(Some(Status::Failed)).await;
    assert!(failed > 0, "some events failed (counted failures ran)");
    let mut admin = AdminServiceClient::new(channel(s.app.addr).await);
    admin
        .get_stats(pb::GetStatsRequest::default())
        .await
        .unwrap();
    admin
        .list_pending(pb::ListPendingRequest::default())
        .await
        .unwrap();
    for status in [pb::EventStatus::Failed, pb::EventStatus::Completed] {
        admin
            .list_events(pb::ListEventsRequest {
                r#box: pb::Box::Outbox as i32,
                status: status as i32,
                page_size: 50,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    admin
        .requeue_failed(pb::RequeueFailedRequest {
            filter: Some(pb::EventFilter {
                topic: "planted".into(),
                ..Default::default()
            }),
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut ic = inbox_client(&s).await;
    for i in 0..3 {
        receive(&mut ic, "hooks", &format!("m{i}"), "k", "ok").await;
    }
    eventually(Duration::from_secs(20), "handled and purged", || async {
        handler.calls().len() == 3
            && count_rows(
                &url,
                "SELECT count(*) FROM public.outbox_events WHERE status = 'completed'",
            )
            .await
                == 0
    })
    .await;
    assert_eq!(
        hijacked(&url).await,
        Vec::<String>::new(),
        "a planted object ran"
    );
    s.app.stop().await.unwrap();
}

/// Every pool mailroom opens runs the profile, whatever the database and role defaults
/// say: a role default of REPEATABLE READ (which breaks the claim's handshake with
/// writers), `synchronous_commit = off` (an answered Enqueue lost in a crash) and a
/// `search_path` naming `public` first change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pool_runs_the_session_profile_whatever_the_defaults() {
    let url = fresh_pg().await;
    let db = url.rsplit('/').next().unwrap().to_string();
    exec(
        &url,
        &format!(
            "ALTER DATABASE {db} SET default_transaction_isolation = 'repeatable read';
             ALTER DATABASE {db} SET synchronous_commit = off;
             ALTER DATABASE {db} SET search_path = public, pg_catalog;"
        ),
    )
    .await;
    let c = config(&url);
    open_store(&c).await.unwrap();
    let pools = pg_pools(&c).await.unwrap();
    for pool in [&pools.enqueue, &pools.relay, &pools.admin] {
        let row: (String, String, String, String, String) = sqlx::query_as(
            "SELECT current_setting('transaction_isolation'), current_setting('search_path'),
                    current_setting('lock_timeout'),
                    current_setting('idle_in_transaction_session_timeout'),
                    current_setting('synchronous_commit')",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(
            row,
            (
                "read committed".into(),
                "pg_catalog, pg_temp".into(),
                "5s".into(),
                "1min".into(),
                "on".into()
            )
        );
    }
    // And the service works on it end to end.
    let dir = tempfile::tempdir().unwrap();
    let mut c = c;
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(dir.path().join("out.jsonl")),
    };
    let mut s = Service::start(c).await;
    enqueue(&mut s.client, event("profile", "k", b"x")).await;
    wait_completed(&s.app.store, 1, Duration::from_secs(10)).await;
    s.app.stop().await.unwrap();
}

/// The deploy files connect as a role named `mailroom` that owns its database: its
/// `"$user"` schema is the SQL API's schema `mailroom`, which migration 0007 creates. The
/// migrator's pinned path keeps every migration in the data schema: `mailroom migrate`
/// runs twice (the second applies nothing), then Enqueue, the relay and the SQL API work.
/// (Before: migration 0015 failed, "type mailroom.mailroom_sql_settings does not exist",
/// and a second run started again at migration 2 inside schema `mailroom`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_named_mailroom_migrates_twice_into_one_schema() {
    let admin = pg_admin_url();
    let db = format!("mailroom_test_role_{}", uuid::Uuid::new_v4().simple());
    // The role is cluster-wide and named as the deploy files name it (a superuser there,
    // as the postgres image makes POSTGRES_USER); created once, kept.
    exec(
        &admin,
        "DO $$ BEGIN
             CREATE ROLE mailroom LOGIN SUPERUSER;
         EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$",
    )
    .await;
    exec(&admin, &format!("CREATE DATABASE {db} OWNER mailroom")).await;
    let base = admin.rsplit_once('/').unwrap().0;
    let url = as_user(&format!("{base}/{db}"), "mailroom");
    for run in 1..=2 {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"))
            .arg("migrate")
            .env("MAILROOM_DATABASE_URL", &url)
            .env("MAILROOM_LOG_FORMAT", "json")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "migrate run {run}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // One copy of everything, in public; schema mailroom holds the SQL API only.
    let in_mailroom = count_rows(
        &url,
        "SELECT count(*) FROM pg_class WHERE relnamespace = 'mailroom'::regnamespace",
    )
    .await;
    assert_eq!(in_mailroom, 0, "no table or type in schema mailroom");
    let applied = count_rows(
        &url,
        "SELECT count(*) FROM public._sqlx_migrations WHERE success",
    )
    .await;
    assert_eq!(
        applied,
        sqlx::migrate!("migrations/postgres").iter().count() as i64
    );

    let mut c = config(&url);
    let dir = tempfile::tempdir().unwrap();
    c.sink = mailroom::sink::SinkConfig::Local {
        path: Some(dir.path().join("out.jsonl")),
    };
    let mut s = Service::start(c).await;
    enqueue(&mut s.client, event("as.mailroom", "k", b"x")).await;
    wait_completed(&s.app.store, 1, Duration::from_secs(10)).await;
    count_rows(
        &url,
        "SELECT mailroom.enqueue('as.mailroom', 'k', 'y'::bytea)",
    )
    .await;
    wait_completed(&s.app.store, 2, Duration::from_secs(10)).await;
    s.app.stop().await.unwrap();
    let mut a = sqlx::PgConnection::connect(&admin).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(&mut a)
    .await
    .unwrap();
}

/// Who may create in the schema of mailroom's tables is checked at start-up: warned
/// about by default, fatal with `database_refuse_shared_schema`; and a configured schema
/// without mailroom's tables, on a database whose tables are elsewhere, is refused
/// rather than migrated into a second, empty copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_schema_is_refused_when_asked_and_a_wrong_schema_always() {
    let url = fresh_pg().await;
    let c = config(&url);
    open_store(&c).await.unwrap();
    let role = unique_role("neighbour");
    exec(
        &url,
        &format!("CREATE ROLE {role}; GRANT CREATE ON SCHEMA public TO {role}"),
    )
    .await;
    let mut refusing = config(&url);
    refusing.database_refuse_shared_schema = true;
    let err = open_store(&refusing)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(&role), "{err}");
    // Warned only, by default.
    open_store(&c).await.unwrap();

    let mut elsewhere = config(&url);
    elsewhere.database_profile.schema = "other".into();
    let err = format!("{:#}", open_store(&elsewhere).await.err().expect("refused"));
    assert!(err.contains("MAILROOM_DATABASE_SCHEMA"), "{err}");
    assert_eq!(
        count_rows(
            &url,
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'other'"
        )
        .await,
        0,
        "nothing was created"
    );
}

/// A key row another session keeps locked (an operator's `SELECT … FOR UPDATE`) costs an
/// `Enqueue` of that key the session's `lock_timeout`, not its whole statement timeout:
/// answered `DEADLINE_EXCEEDED` (retryable), nothing stored, other keys at once.
/// (Before the profile set a `lock_timeout`, the call waited the 10 s enqueue timeout.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_row_held_elsewhere_costs_the_lock_timeout_only() {
    let url = fresh_pg().await;
    let mut c = quiet_config(&url);
    c.database_profile.lock_timeout = Some(Duration::from_millis(500));
    let mut s = Service::start(c).await;
    enqueue(&mut s.client, event("held", "m", b"creates the key row")).await;
    let (held, locked) = hold_in_transaction(
        &url,
        "SELECT 1 FROM outbox_keys WHERE topic = 'held' AND event_key = 'm' FOR UPDATE",
    )
    .await;
    assert_eq!(locked, 1);
    let t = std::time::Instant::now();
    let err = s
        .client
        .enqueue(pb::EnqueueRequest {
            event: Some(event("held", "m", b"grpc")),
        })
        .await
        .unwrap_err();
    let waited = t.elapsed();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(err.get_details_retry_info().is_some(), "retryable: {err:?}");
    assert!(
        waited >= Duration::from_millis(450) && waited < Duration::from_secs(5),
        "waited {waited:?}"
    );
    assert_eq!(s.outbox_count(None).await, 1, "nothing stored");
    let t = std::time::Instant::now();
    enqueue(&mut s.client, event("held", "other", b"free")).await;
    assert!(t.elapsed() < Duration::from_millis(450));
    drop(held);
    enqueue(&mut s.client, event("held", "m", b"after")).await;
    s.app.stop().await.unwrap();
}

/// Every function the migrations create (in the data schema and in the SQL API's schema
/// `mailroom`) runs with `search_path = pg_catalog, pg_temp`: none resolves names
/// through the path of the session that calls it or fires its trigger. (Before 0019:
/// the inbox count triggers had no setting and the helpers of 0016 and 0018 kept the
/// migrator's `"$user", public`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_function_of_the_migrations_is_pinned() {
    let url = fresh_pg().await;
    open_store(&config(&url)).await.unwrap();
    let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
    let unpinned: Vec<String> = sqlx::query_scalar(
        "SELECT n.nspname || '.' || p.proname || ' ' || COALESCE(p.proconfig::text, 'no setting')
         FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname IN ('public', 'mailroom')
           AND p.proconfig IS DISTINCT FROM ARRAY['search_path=pg_catalog, pg_temp']
         ORDER BY 1",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    assert_eq!(unpinned, Vec::<String>::new());
    let all: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname IN ('public', 'mailroom')",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    assert!(all >= 20, "the migrations' functions were found ({all})");
}

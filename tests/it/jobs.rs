//! Background jobs (issue 44, item 4): requeue, cancel, republish and redeliver over more
//! than a page, stored in the database, cancellable, taken over after a crash, audited.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::support::faults::Mailroom;
use crate::support::*;
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use tonic::Code;
use tonic::transport::Channel;

const OPS: &str = "ops-0123456789abcdefgh";
const VIEWER: &str = "viewer-0123456789abcd";

fn token_file(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("tokens.toml");
    std::fs::write(
        &p,
        format!(
            "[[token]]\nname = \"ops\"\ntoken = \"{OPS}\"\nscopes = [\"admin\", \"enqueue\"]\n\n\
             [[token]]\nname = \"viewer\"\ntoken = \"{VIEWER}\"\nscopes = [\"admin_read\"]\n"
        ),
    )
    .unwrap();
    p
}

async fn get_job(a: &mut AdminServiceClient<Channel>, id: i64) -> pb::Job {
    a.get_job(with_token(pb::GetJobRequest { id }, Some(OPS)))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap()
}

/// Polls job `id` until `done` says so (or fails after `timeout`); the job then.
async fn job_until(
    a: &mut AdminServiceClient<Channel>,
    id: i64,
    timeout: Duration,
    what: &str,
    done: impl Fn(&pb::Job) -> bool,
) -> pb::Job {
    let deadline = Instant::now() + timeout;
    loop {
        let j = get_job(a, id).await;
        if done(&j) {
            return j;
        }
        assert!(
            Instant::now() < deadline,
            "job {id}: {what} within {timeout:?}; last {j:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ended(j: &pb::Job) -> bool {
    j.finished_at.is_some()
}

/// On both engines, with no relay (events stay pending): 2,500 pending events are
/// cancelled by one cancel job (three pages) and put back by one requeue job; events
/// enqueued after a job started are outside it; a dry run counts and changes nothing; a
/// request id starts one job; a read-only token may read jobs but not start or cancel
/// one; bad requests name their field; the audit log has the start and end of each job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_requeue_jobs_cover_every_page_exactly() {
    for engine in ENGINES {
        let (url, _guard) = fresh_db(&engine).await;
        let dir = tempfile::tempdir().unwrap();
        let mut c = quiet_config(&url);
        c.tokens = mailroom::access::load_tokens(&token_file(dir.path())).unwrap();
        let mut s = Service::start(c).await;
        let mut a = AdminServiceClient::new(channel(s.app.addr).await);
        let topic = "jobs.pages";
        let events: Vec<pb::Event> = (0..2500)
            .map(|i| event(topic, &format!("k{}", i % 40), b"p"))
            .collect();
        for chunk in events.chunks(500) {
            s.client
                .enqueue_batch(with_token(
                    pb::EnqueueBatchRequest {
                        events: chunk.to_vec(),
                    },
                    Some(OPS),
                ))
                .await
                .unwrap();
        }
        let filter = pb::EventFilter {
            topic: topic.into(),
            ..Default::default()
        };
        let cancel = pb::StartJobRequest {
            kind: pb::JobKind::Cancel as i32,
            filter: Some(filter.clone()),
            reason: "bad prices".into(),
            operator: "alice".into(),
            request_id: "cancel-1".into(),
            ..Default::default()
        };
        // A dry run counts and samples.
        let dry = a
            .start_job(with_token(cancel.clone(), Some(OPS)))
            .await
            .unwrap()
            .into_inner();
        assert!(dry.dry_run && dry.job.is_none(), "{dry:?}");
        assert_eq!((dry.count, dry.sample_ids.len()), (2500, 20), "{engine:?}");
        // A read-only token reads jobs but does not start them; bad requests name a field.
        let refused = a
            .start_job(with_token(
                pb::StartJobRequest {
                    confirm: true,
                    ..cancel.clone()
                },
                Some(VIEWER),
            ))
            .await;
        assert_eq!(code(refused), Code::PermissionDenied);
        let no_reason = pb::StartJobRequest {
            reason: String::new(),
            confirm: true,
            ..cancel.clone()
        };
        let err = a
            .start_job(with_token(no_reason, Some(OPS)))
            .await
            .unwrap_err();
        assert_eq!(
            (err.code(), field_of(&err)),
            (Code::InvalidArgument, "reason".into())
        );
        let missing = a
            .get_job(with_token(pb::GetJobRequest { id: 999_999 }, Some(VIEWER)))
            .await;
        assert_eq!(code(missing), Code::NotFound);

        let started = a
            .start_job(with_token(
                pb::StartJobRequest {
                    confirm: true,
                    ..cancel.clone()
                },
                Some(OPS),
            ))
            .await
            .unwrap()
            .into_inner();
        let job = started.job.clone().unwrap();
        assert_eq!((job.total, started.replayed), (2500, false));
        // Enqueued after the start: outside the job.
        let late = s
            .client
            .enqueue(with_token(
                pb::EnqueueRequest {
                    event: Some(event(topic, "k1", b"late")),
                },
                Some(OPS),
            ))
            .await
            .unwrap()
            .into_inner()
            .id;
        let again = a
            .start_job(with_token(
                pb::StartJobRequest {
                    confirm: true,
                    ..cancel.clone()
                },
                Some(OPS),
            ))
            .await
            .unwrap()
            .into_inner();
        assert!(
            again.replayed && again.job.as_ref().unwrap().id == job.id,
            "{again:?}"
        );
        let j = job_until(&mut a, job.id, Duration::from_secs(60), "ends", ended).await;
        assert_eq!(
            (j.state, j.done, j.total),
            (pb::JobState::Completed as i32, 2500, 2500),
            "{engine:?}: {j:?}"
        );
        let stats = |a: &mut AdminServiceClient<Channel>| {
            let mut a = a.clone();
            async move {
                a.get_stats(with_token(pb::GetStatsRequest::default(), Some(VIEWER)))
                    .await
                    .unwrap()
                    .into_inner()
            }
        };
        let st = stats(&mut a).await;
        assert_eq!(
            (st.failed, st.pending),
            (2500, 1),
            "{engine:?}: the late event stays pending"
        );
        let late_info = event_info_with(&mut a, late).await;
        assert_eq!(late_info.status, pb::EventStatus::Pending as i32);

        // A requeue job puts all 2,500 back.
        let requeue = pb::StartJobRequest {
            kind: pb::JobKind::Requeue as i32,
            filter: Some(pb::EventFilter {
                error_contains: "bad prices".into(),
                ..filter.clone()
            }),
            confirm: true,
            operator: "alice".into(),
            ..Default::default()
        };
        let r = a
            .start_job(with_token(requeue, Some(OPS)))
            .await
            .unwrap()
            .into_inner();
        let r = r.job.unwrap();
        let r = job_until(&mut a, r.id, Duration::from_secs(60), "ends", ended).await;
        assert_eq!(
            (r.state, r.done, r.total),
            (pb::JobState::Completed as i32, 2500, 2500),
            "{r:?}"
        );
        let st = stats(&mut a).await;
        assert_eq!((st.failed, st.pending), (0, 2501), "{engine:?}");

        // Listing, newest first, readable with a read-only token; the audit has both ends.
        let listed = a
            .list_jobs(with_token(
                pb::ListJobsRequest {
                    page_size: 1,
                    ..Default::default()
                },
                Some(VIEWER),
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            listed.jobs.iter().map(|j| j.id).collect::<Vec<_>>(),
            vec![r.id]
        );
        let next = a
            .list_jobs(with_token(
                pb::ListJobsRequest {
                    page_size: 10,
                    page_token: listed.next_page_token,
                },
                Some(VIEWER),
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            next.jobs.iter().map(|j| j.id).collect::<Vec<_>>(),
            vec![job.id]
        );
        let audit = a
            .list_audit(with_token(pb::ListAuditRequest::default(), Some(VIEWER)))
            .await
            .unwrap()
            .into_inner();
        let actions: Vec<(&str, i64)> = audit
            .entries
            .iter()
            .map(|e| (e.action.as_str(), e.count))
            .collect();
        assert_eq!(
            actions,
            vec![
                ("job.completed", 2500),
                ("job.start", 2500),
                ("job.completed", 2500),
                ("job.start", 2500)
            ],
            "{engine:?}"
        );
        assert!(
            audit.entries[3].principal == "ops"
                && audit.entries[3].selection.contains("bad prices"),
            "{:?}",
            audit.entries[3]
        );
    }
}

async fn event_info_with(a: &mut AdminServiceClient<Channel>, id: i64) -> pb::EventInfo {
    a.get_event(with_token(
        pb::GetEventRequest {
            id,
            ..Default::default()
        },
        Some(VIEWER),
    ))
    .await
    .unwrap()
    .into_inner()
    .event
    .unwrap()
}

/// The issue's test: a republish job of 50,000 completed events (PostgreSQL, the broker,
/// the binary) is SIGKILLed mid-way with its process, taken over by the restarted process
/// once its lease runs out, and cancelled halfway. At the end its `done` is exactly the
/// copies stored and the copies the broker received: each original at most once, none
/// beyond what the job counted, none lost. The audit has its start, cancel and end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_republish_job_survives_a_kill_and_stops_exactly_when_cancelled() {
    const N: usize = 50_000;
    let broker = Broker::start();
    let db = fresh_pg().await;
    let dir = tempfile::tempdir().unwrap();
    let tokens = token_file(dir.path());
    let mut m = Mailroom::new(
        &db,
        Some(&broker.addr()),
        &[
            ("MAILROOM_TOKENS_FILE", tokens.to_str().unwrap()),
            ("MAILROOM_JOB_LEASE_MS", "2000"),
            ("MAILROOM_JOB_PAGE_PAUSE_MS", "150"),
        ],
    );
    m.start_ready().await;
    let ch = Channel::from_shared(format!("http://{}", m.addr()))
        .unwrap()
        .connect_lazy();
    let mut a = AdminServiceClient::new(ch.clone());
    let mut o = mailroom::pb::outbox_service_client::OutboxServiceClient::new(ch);
    let topic = "jobs.republish";
    let events: Vec<pb::Event> = (0..N)
        .map(|i| event(topic, &format!("k{}", i % 500), format!("p{i}").as_bytes()))
        .collect();
    for chunk in events.chunks(1000) {
        o.enqueue_batch(with_token(
            pb::EnqueueBatchRequest {
                events: chunk.to_vec(),
            },
            Some(OPS),
        ))
        .await
        .unwrap();
    }
    let completed = "SELECT count(*) FROM outbox_events_view WHERE status = 'completed'";
    eventually(
        Duration::from_secs(120),
        "the originals published",
        || async { count_rows(&db, completed).await == N as i64 },
    )
    .await;

    let filter = pb::EventFilter {
        topic: topic.into(),
        ..Default::default()
    };
    let start = pb::StartJobRequest {
        kind: pb::JobKind::Republish as i32,
        filter: Some(filter),
        confirm: true,
        operator: "bob".into(),
        ..Default::default()
    };
    let job = a
        .start_job(with_token(start, Some(OPS)))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(job.total, N as i64);
    let before_kill = job_until(
        &mut a,
        job.id,
        Duration::from_secs(60),
        "10,000 done",
        |j| j.done >= 10_000,
    )
    .await;
    m.kill();
    assert_eq!(m.sigkills, 1, "the kill hit a running process");
    let owner_killed = before_kill.owner.clone();
    assert!(!owner_killed.is_empty(), "{before_kill:?}");
    m.start_ready().await;
    let taken = job_until(&mut a, job.id, Duration::from_secs(30), "taken over", |j| {
        !j.owner.is_empty() && j.owner != owner_killed && j.done > before_kill.done
    })
    .await;
    assert_eq!(taken.state, pb::JobState::Running as i32);
    job_until(
        &mut a,
        job.id,
        Duration::from_secs(60),
        "25,000 done",
        |j| j.done >= 25_000,
    )
    .await;
    let cancelled = a
        .cancel_job(with_token(
            pb::CancelJobRequest {
                id: job.id,
                operator: "bob".into(),
            },
            Some(OPS),
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(cancelled.changed, "{cancelled:?}");
    let end = job_until(&mut a, job.id, Duration::from_secs(30), "ends", ended).await;
    assert_eq!(end.state, pb::JobState::Cancelled as i32, "{end:?}");
    assert!(
        end.done >= 25_000 && end.done < N as i64,
        "stopped mid-way: {end:?}"
    );

    // Exact: the copies stored are the job's count, each original at most once.
    let copies = count_rows(
        &db,
        "SELECT count(*) FROM outbox_events WHERE headers ? 'mailroom-republished-from'",
    )
    .await;
    let originals = count_rows(
        &db,
        "SELECT count(DISTINCT headers->>'mailroom-republished-from') FROM outbox_events \
         WHERE headers ? 'mailroom-republished-from'",
    )
    .await;
    assert_eq!((copies, originals), (end.done, end.done), "{end:?}");
    // Nothing more is copied after the end.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        count_rows(
            &db,
            "SELECT count(*) FROM outbox_events WHERE headers ? 'mailroom-republished-from'"
        )
        .await,
        end.done
    );
    // The broker holds each copy once.
    let total = N + end.done as usize;
    eventually(Duration::from_secs(120), "the copies published", || async {
        count_rows(&db, completed).await == total as i64
    })
    .await;
    let brokers = broker.addr();
    let records = tokio::task::spawn_blocking(move || {
        consume(&brokers, topic, total, Duration::from_secs(120))
    })
    .await
    .unwrap();
    let from: Vec<&String> = records
        .iter()
        .filter_map(|r| r.headers.get("mailroom-republished-from"))
        .collect();
    let distinct: HashSet<&String> = from.iter().copied().collect();
    // Distinct by `ce_id`: a relay killed mid-publish may send a record again (at least
    // once), which is not a second copy.
    let events: HashSet<&String> = records
        .iter()
        .filter_map(|r| r.headers.get("ce_id"))
        .collect();
    assert_eq!(
        (events.len(), distinct.len()),
        (total, end.done as usize),
        "every original and every copy, each copy of a distinct original"
    );
    let audit = a
        .list_audit(with_token(pb::ListAuditRequest::default(), Some(VIEWER)))
        .await
        .unwrap()
        .into_inner();
    let actions: Vec<&str> = audit.entries.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, vec!["job.cancelled", "job.cancel", "job.start"]);
    assert_eq!(audit.entries[0].count, end.done);
    eprintln!(
        "republish job: {} of {N} copied; killed at {} (owner {owner_killed}), taken over by {}",
        end.done, before_kill.done, taken.owner
    );
}

/// The CLI (SQLite, no relay): `cancel --background --yes --wait` runs a cancel job over
/// 1,200 pending events to its end and prints it; without `--yes` it is a dry run; `jobs`
/// lists it; `job ID` shows it and `job ID --cancel` on an ended job changes nothing;
/// ids with `--background` and filter flags without it are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_starts_follows_and_lists_jobs() {
    use crate::support::cli::{admin_cli, admin_cli_json};
    let (mut s, _url, _guard) = quiet_on(&Engine::Sqlite).await;
    let events: Vec<pb::Event> = (0..1200)
        .map(|i| event("jobs.cli", &format!("k{}", i % 7), b"x"))
        .collect();
    enqueue_in_batches(&mut s, &events).await;
    let addr = s.app.addr;
    let base = [
        "cancel",
        "--background",
        "--topic",
        "jobs.cli",
        "--reason",
        "bad batch",
    ];
    let dry = admin_cli_json(addr, None, &base).await;
    assert_eq!(
        (dry["dry_run"].as_bool(), dry["count"].as_i64()),
        (Some(true), Some(1200)),
        "{dry}"
    );
    let mut args = base.to_vec();
    args.extend(["--yes", "--wait"]);
    let done = admin_cli_json(addr, None, &args).await;
    assert_eq!(
        (
            done["state"].as_str(),
            done["done"].as_i64(),
            done["kind"].as_str()
        ),
        (Some("completed"), Some(1200), Some("cancel")),
        "{done}"
    );
    assert_eq!(
        s.outbox_count(Some(mailroom::domain::Status::Failed)).await,
        1200
    );
    let id = done["id"].as_i64().unwrap();
    let listed = admin_cli_json(addr, None, &["jobs"]).await;
    assert_eq!(listed["jobs"][0]["id"].as_i64(), Some(id), "{listed}");
    let shown = admin_cli_json(addr, None, &["job", &id.to_string(), "--cancel"]).await;
    assert_eq!(shown["state"].as_str(), Some("completed"), "{shown}");
    let (ok, _, err) = admin_cli(
        addr,
        None,
        &["cancel", "5", "--background", "--reason", "r"],
    )
    .await;
    assert!(!ok && err.contains("not ids"), "{err}");
    let (ok, _, err) = admin_cli(
        addr,
        None,
        &["cancel", "5", "--topic", "t", "--reason", "r"],
    )
    .await;
    assert!(!ok && err.contains("need --background"), "{err}");
    let (ok, out, _) = admin_cli(addr, None, &["job", &id.to_string()]).await;
    assert!(
        ok && out.contains("completed") && out.contains("1200/1200"),
        "{out}"
    );
}

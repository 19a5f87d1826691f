//! `mailroom admin … --background`, `jobs` and `job`: starting a background job, listing
//! jobs, following one with a progress bar, cancelling one.

use std::io::Write as _;
use std::time::Duration;

use serde_json::{Value, json};

use super::AdminCommand;
use super::client::{Client, Target, answer, operator, request_id};
use super::render::{Table, box_name, lines, next_page, sample, truncate, ts};
use crate::pb;

/// How often `--wait` asks for the job's progress.
const POLL: Duration = Duration::from_millis(500);

/// A `--background` action.
pub(super) struct Start {
    pub kind: pb::JobKind,
    pub ids: Vec<i64>,
    pub filter: pb::EventFilter,
    pub reason: Option<String>,
    pub yes: bool,
    pub all: bool,
    pub wait: bool,
    pub request_id: Option<String>,
    pub operator: Option<String>,
}

fn kind_name(k: i32) -> &'static str {
    match pb::JobKind::try_from(k) {
        Ok(pb::JobKind::Requeue) => "requeue",
        Ok(pb::JobKind::Cancel) => "cancel",
        Ok(pb::JobKind::Republish) => "republish",
        Ok(pb::JobKind::Redeliver) => "redeliver",
        _ => "unknown",
    }
}

fn state_name(s: i32) -> &'static str {
    match pb::JobState::try_from(s) {
        Ok(pb::JobState::Running) => "running",
        Ok(pb::JobState::Cancelling) => "cancelling",
        Ok(pb::JobState::Completed) => "completed",
        Ok(pb::JobState::Cancelled) => "cancelled",
        Ok(pb::JobState::Failed) => "failed",
        _ => "unknown",
    }
}

/// Starts a job (or, without `--yes`, counts what it would select).
pub(super) async fn start(c: &mut Client, t: &Target, s: Start) -> anyhow::Result<String> {
    if !s.ids.is_empty() {
        anyhow::bail!("--background works by filter: give filter flags, not ids");
    }
    let req = pb::StartJobRequest {
        kind: s.kind as i32,
        r#box: t.bx,
        filter: Some(s.filter),
        all: s.all,
        confirm: s.yes,
        reason: s.reason.unwrap_or_default(),
        operator: operator(s.operator),
        request_id: request_id(s.request_id),
    };
    let r = answer(c.inner.start_job(c.req(req)).await)?;
    let verb = kind_name(s.kind as i32);
    let Some(job) = r.job else {
        return Ok(if t.json {
            lines(&json!({ "dry_run": true, "count": r.count, "sample_ids": r.sample_ids }))
        } else {
            format!(
                "dry run: a {verb} job would select {} event(s){}\nrun again with --yes to start it\n",
                r.count,
                sample(&r.sample_ids, r.count)
            )
        });
    };
    if s.wait {
        return follow(c, t, job.id).await;
    }
    Ok(if t.json {
        lines(&json!({ "dry_run": false, "replayed": r.replayed, "job": job_json(&job) }))
    } else {
        let again = if r.replayed {
            " (this request id started it before: nothing new)"
        } else {
            ""
        };
        format!(
            "started {verb} job {} over {} event(s){again}\nfollow it with: mailroom admin job {} --wait\n",
            job.id, job.total, job.id
        )
    })
}

/// `jobs` and `job`.
pub(super) async fn run(
    c: &mut Client,
    t: &Target,
    command: AdminCommand,
) -> anyhow::Result<String> {
    match command {
        AdminCommand::Jobs { limit, page_token } => {
            let req = pb::ListJobsRequest {
                page_size: limit,
                page_token: page_token.unwrap_or_default(),
            };
            let r = answer(c.inner.list_jobs(c.req(req)).await)?;
            Ok(jobs_out(&r, t.json))
        }
        AdminCommand::Job {
            id,
            wait,
            cancel,
            operator: who,
        } => {
            if wait {
                return follow(c, t, id).await;
            }
            let job = if cancel {
                let req = pb::CancelJobRequest {
                    id,
                    operator: operator(who),
                };
                answer(c.inner.cancel_job(c.req(req)).await)?.job
            } else {
                answer(c.inner.get_job(c.req(pb::GetJobRequest { id })).await)?.job
            };
            let job = job.ok_or_else(|| anyhow::anyhow!("the server answered no job"))?;
            Ok(if t.json {
                lines(&job_json(&job))
            } else {
                job_text(&job)
            })
        }
        _ => unreachable!("dispatched by execute"),
    }
}

/// Waits for job `id` to end, drawing its progress on stderr when it is a terminal;
/// prints the job at the end.
async fn follow(c: &mut Client, t: &Target, id: i64) -> anyhow::Result<String> {
    use std::io::IsTerminal as _;
    let draw = !t.json && std::io::stderr().is_terminal();
    loop {
        let job = answer(c.inner.get_job(c.req(pb::GetJobRequest { id })).await)?
            .job
            .ok_or_else(|| anyhow::anyhow!("the server answered no job"))?;
        let ended = job.finished_at.is_some();
        if draw {
            let mut err = std::io::stderr();
            let _ = write!(err, "\r{}", progress_bar(&job));
            if ended {
                let _ = writeln!(err);
            }
            let _ = err.flush();
        }
        if ended {
            return Ok(if t.json {
                lines(&job_json(&job))
            } else {
                job_text(&job)
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// `[#########-----------]  45%  22,000/50,000 running`
pub(super) fn progress_bar(j: &pb::Job) -> String {
    const WIDTH: i64 = 30;
    let total = j.total.max(1);
    let filled = (j.done.min(total) * WIDTH / total).clamp(0, WIDTH);
    let bar: String = (0..WIDTH)
        .map(|i| if i < filled { '#' } else { '-' })
        .collect();
    format!(
        "[{bar}] {:>3}%  {}/{} {:<10}",
        j.done.min(total) * 100 / total,
        j.done,
        j.total,
        state_name(j.state)
    )
}

fn job_json(j: &pb::Job) -> Value {
    json!({
        "id": j.id,
        "kind": kind_name(j.kind),
        "box": box_name(j.r#box),
        "state": state_name(j.state),
        "total": j.total,
        "done": j.done,
        "selection": serde_json::from_str::<Value>(&j.selection).unwrap_or(Value::String(j.selection.clone())),
        "actor": j.actor,
        "principal": j.principal,
        "request_id": j.request_id,
        "reason": j.reason,
        "error": j.error,
        "owner": j.owner,
        "cancelled_by": j.cancelled_by,
        "created_at": ts(j.created_at.as_ref()),
        "updated_at": ts(j.updated_at.as_ref()),
        "finished_at": ts(j.finished_at.as_ref()),
    })
}

fn job_text(j: &pb::Job) -> String {
    let mut t = Table::new(&["FIELD", "VALUE"]);
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    for (k, v) in [
        ("id", j.id.to_string()),
        ("kind", kind_name(j.kind).into()),
        ("box", box_name(j.r#box).into()),
        ("state", state_name(j.state).into()),
        ("progress", progress_bar(j).trim_end().to_string()),
        ("selection", j.selection.clone()),
        ("started by", j.actor.clone()),
        ("principal", dash(&j.principal)),
        ("request id", dash(&j.request_id)),
        ("reason", dash(&j.reason)),
        ("error", dash(&j.error)),
        ("owner", dash(&j.owner)),
        ("cancelled by", dash(&j.cancelled_by)),
        ("started", ts(j.created_at.as_ref()).unwrap_or_default()),
        ("updated", ts(j.updated_at.as_ref()).unwrap_or_default()),
        (
            "ended",
            ts(j.finished_at.as_ref()).unwrap_or_else(|| "-".into()),
        ),
    ] {
        t.row(vec![k.to_string(), v]);
    }
    t.render()
}

fn jobs_out(r: &pb::ListJobsResponse, json_out: bool) -> String {
    if json_out {
        return lines(&json!({
            "jobs": r.jobs.iter().map(job_json).collect::<Vec<_>>(),
            "next_page_token": r.next_page_token,
        }));
    }
    let mut t = Table::new(&[
        "ID",
        "KIND",
        "BOX",
        "STATE",
        "DONE",
        "TOTAL",
        "STARTED",
        "ACTOR",
        "SELECTION",
    ]);
    for j in &r.jobs {
        t.row(vec![
            j.id.to_string(),
            kind_name(j.kind).into(),
            box_name(j.r#box).into(),
            state_name(j.state).into(),
            j.done.to_string(),
            j.total.to_string(),
            ts(j.created_at.as_ref()).unwrap_or_default(),
            j.actor.clone(),
            truncate(&j.selection, 60),
        ]);
    }
    t.render() + &next_page(&r.next_page_token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_progress_bar_fills_with_the_job() {
        let j = pb::Job {
            total: 50_000,
            done: 25_000,
            state: pb::JobState::Running as i32,
            ..Default::default()
        };
        assert_eq!(
            progress_bar(&j).trim_end(),
            "[###############---------------]  50%  25000/50000 running"
        );
        let empty = pb::Job {
            state: pb::JobState::Completed as i32,
            ..Default::default()
        };
        assert!(
            progress_bar(&empty)
                .starts_with("[------------------------------]   0%  0/0 completed")
        );
    }
}

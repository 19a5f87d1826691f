//! Validation and conversion of the job RPCs (`StartJob`, `GetJob`, `ListJobs`,
//! `CancelJob`).

use super::requests::{event_filter, filter_is_empty, non_empty, pb_box, request_id};
use crate::domain::BoxKind;
use crate::domain::admin::ActionContext;
use crate::domain::jobs::{Job, JobKind, JobState, StartJob};
use crate::error::{Error, FieldViolation};
use crate::pb;
use crate::pb::time::to_timestamp;

/// Validates a `StartJob` request; without `confirm` it is a dry run.
pub fn start_job_request(
    r: pb::StartJobRequest,
    context: ActionContext,
) -> Result<StartJob, Error> {
    let kind = match pb::JobKind::try_from(r.kind) {
        Ok(pb::JobKind::Requeue) => JobKind::Requeue,
        Ok(pb::JobKind::Cancel) => JobKind::Cancel,
        Ok(pb::JobKind::Republish) => JobKind::Republish,
        Ok(pb::JobKind::Redeliver) => JobKind::Redeliver,
        Ok(pb::JobKind::Unspecified) | Err(_) => {
            return Err(Error::invalid(
                "kind",
                "name what the job does: JOB_KIND_REQUEUE, _CANCEL, _REPUBLISH or _REDELIVER",
            ));
        }
    };
    let box_kind = match (pb::Box::try_from(r.r#box), kind.only_box()) {
        (Ok(pb::Box::Unspecified), Some(only)) => only,
        (Ok(pb::Box::Unspecified | pb::Box::Outbox), None) => BoxKind::Outbox,
        (Ok(pb::Box::Inbox), None) => BoxKind::Inbox,
        (Ok(b), Some(only)) if b == pb_box(only) => only,
        (Ok(_), Some(only)) => {
            return Err(Error::invalid(
                "box",
                format!(
                    "a {} job works on the {} only",
                    kind.as_str(),
                    only.as_str()
                ),
            ));
        }
        (Err(_), _) => return Err(Error::invalid("box", format!("unknown box {}", r.r#box))),
    };
    let filter = event_filter(box_kind, r.filter, "filter")?;
    let mut v = Vec::new();
    if filter_is_empty(&filter) && !r.all && r.confirm {
        v.push(FieldViolation::new(
            "all",
            format!(
                "an empty filter selects every {} event: set all = true (--all) to mean it",
                kind.selects()
            ),
        ));
    }
    let reason = non_empty(r.reason.trim().to_string());
    match (kind, &reason) {
        (JobKind::Cancel, None) => v.push(FieldViolation::new(
            "reason",
            "is required (it becomes the events' last error)",
        )),
        (JobKind::Cancel, Some(why)) if why.len() > 1000 => {
            v.push(FieldViolation::new("reason", "must be at most 1000 bytes"));
        }
        (JobKind::Cancel, Some(_)) | (_, None) => {}
        (_, Some(_)) => v.push(FieldViolation::new("reason", "applies to cancel jobs only")),
    }
    if !v.is_empty() {
        return Err(Error::InvalidArgument(v));
    }
    Ok(StartJob {
        kind,
        box_kind,
        filter,
        reason,
        context: ActionContext {
            dry_run: !r.confirm,
            request_id: request_id(r.request_id)?,
            ..context
        },
    })
}

/// A job id from a request: positive.
pub fn job_id(id: i64) -> Result<i64, Error> {
    if id <= 0 {
        return Err(Error::invalid("id", "must be a job id (positive)"));
    }
    Ok(id)
}

fn pb_kind(k: JobKind) -> pb::JobKind {
    match k {
        JobKind::Requeue => pb::JobKind::Requeue,
        JobKind::Cancel => pb::JobKind::Cancel,
        JobKind::Republish => pb::JobKind::Republish,
        JobKind::Redeliver => pb::JobKind::Redeliver,
    }
}

fn pb_state(s: JobState) -> pb::JobState {
    match s {
        JobState::Running => pb::JobState::Running,
        JobState::Cancelling => pb::JobState::Cancelling,
        JobState::Completed => pb::JobState::Completed,
        JobState::Cancelled => pb::JobState::Cancelled,
        JobState::Failed => pb::JobState::Failed,
    }
}

/// A job as the API shows it.
pub fn job_info(j: Job) -> pb::Job {
    pb::Job {
        id: j.id,
        kind: pb_kind(j.kind) as i32,
        r#box: pb_box(j.box_kind) as i32,
        selection: j.selection,
        state: pb_state(j.state) as i32,
        total: j.total,
        done: j.done,
        actor: j.actor,
        principal: j.principal.unwrap_or_default(),
        request_id: j.request_id.unwrap_or_default(),
        reason: j.reason.unwrap_or_default(),
        error: j.error.unwrap_or_default(),
        created_at: Some(to_timestamp(j.created_at)),
        updated_at: Some(to_timestamp(j.updated_at)),
        finished_at: j.finished_at.map(to_timestamp),
        owner: j.owner.unwrap_or_default(),
        cancelled_by: j.cancelled_by.unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(r: pb::StartJobRequest) -> Result<StartJob, Error> {
        start_job_request(r, ActionContext::by("ops"))
    }

    fn field(e: Error) -> String {
        match e {
            Error::InvalidArgument(v) => v[0].field.clone(),
            other => panic!("not invalid: {other:?}"),
        }
    }

    #[test]
    fn a_job_names_its_kind_box_and_reason() {
        let topic = pb::EventFilter {
            topic: "orders".into(),
            ..Default::default()
        };
        let r = pb::StartJobRequest {
            kind: pb::JobKind::Republish as i32,
            filter: Some(topic.clone()),
            ..Default::default()
        };
        let j = start(r.clone()).unwrap();
        assert_eq!(
            (j.kind, j.box_kind, j.context.dry_run),
            (JobKind::Republish, BoxKind::Outbox, true)
        );
        let inbox = pb::StartJobRequest {
            r#box: pb::Box::Inbox as i32,
            ..r.clone()
        };
        assert_eq!(field(start(inbox).unwrap_err()), "box");
        assert_eq!(
            field(
                start(pb::StartJobRequest {
                    kind: 0,
                    ..r.clone()
                })
                .unwrap_err()
            ),
            "kind"
        );
        let cancel = pb::StartJobRequest {
            kind: pb::JobKind::Cancel as i32,
            confirm: true,
            ..r.clone()
        };
        assert_eq!(field(start(cancel.clone()).unwrap_err()), "reason");
        let c = start(pb::StartJobRequest {
            reason: " bad data ".into(),
            r#box: pb::Box::Inbox as i32,
            ..cancel
        })
        .unwrap();
        assert_eq!(
            (c.box_kind, c.reason.as_deref(), c.context.dry_run),
            (BoxKind::Inbox, Some("bad data"), false)
        );
        let requeue_reason = pb::StartJobRequest {
            kind: pb::JobKind::Requeue as i32,
            reason: "x".into(),
            ..r.clone()
        };
        assert_eq!(field(start(requeue_reason).unwrap_err()), "reason");
        let everything = pb::StartJobRequest {
            kind: pb::JobKind::Requeue as i32,
            confirm: true,
            ..Default::default()
        };
        assert_eq!(field(start(everything.clone()).unwrap_err()), "all");
        assert!(
            start(pb::StartJobRequest {
                all: true,
                ..everything.clone()
            })
            .is_ok()
        );
        assert!(
            start(pb::StartJobRequest {
                confirm: false,
                ..everything
            })
            .is_ok(),
            "a dry run counts everything"
        );
        assert_eq!(field(job_id(0).unwrap_err()), "id");
    }
}

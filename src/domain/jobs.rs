//! Background jobs (issue 44, item 4): a requeue, cancel, republish or redeliver over
//! every event a filter selects, worked through in pages by whichever process holds the
//! job's lease (`crate::jobs`), with its progress stored beside each page's change.

use chrono::{DateTime, Utc};

use super::BoxKind;
use super::admin::{ActionContext, EventFilter};

/// Events one page of a job changes or copies.
pub const JOB_PAGE: u32 = 1000;

/// What a job does to each event it selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// Failed events back to pending.
    Requeue,
    /// Pending events to failed with the job's reason.
    Cancel,
    /// Completed outbox events published again as new events.
    Republish,
    /// Handled inbox messages handed to their handler again.
    Redeliver,
}

impl JobKind {
    /// The name stored in the database and shown to operators.
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Requeue => "requeue",
            JobKind::Cancel => "cancel",
            JobKind::Republish => "republish",
            JobKind::Redeliver => "redeliver",
        }
    }

    /// The kind named `s`.
    pub fn parse(s: &str) -> Option<JobKind> {
        Some(match s {
            "requeue" => JobKind::Requeue,
            "cancel" => JobKind::Cancel,
            "republish" => JobKind::Republish,
            "redeliver" => JobKind::Redeliver,
            _ => return None,
        })
    }

    /// The box a kind is bound to (republish: the outbox; redeliver: the inbox).
    pub fn only_box(self) -> Option<BoxKind> {
        match self {
            JobKind::Republish => Some(BoxKind::Outbox),
            JobKind::Redeliver => Some(BoxKind::Inbox),
            JobKind::Requeue | JobKind::Cancel => None,
        }
    }

    /// The status of the events the kind selects, as stored.
    pub fn selects(self) -> &'static str {
        match self {
            JobKind::Requeue => "failed",
            JobKind::Cancel => "pending",
            JobKind::Republish | JobKind::Redeliver => "completed",
        }
    }
}

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    /// Working through its pages, or waiting for a process to take it over.
    Running,
    /// Asked to stop: stops after its current page.
    Cancelling,
    /// Every selected event handled.
    Completed,
    /// Stopped by an operator.
    Cancelled,
    /// Stopped by an error it could not get past.
    Failed,
}

impl JobState {
    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Running => "running",
            JobState::Cancelling => "cancelling",
            JobState::Completed => "completed",
            JobState::Cancelled => "cancelled",
            JobState::Failed => "failed",
        }
    }

    /// The state named `s`.
    pub fn parse(s: &str) -> Option<JobState> {
        Some(match s {
            "running" => JobState::Running,
            "cancelling" => JobState::Cancelling,
            "completed" => JobState::Completed,
            "cancelled" => JobState::Cancelled,
            "failed" => JobState::Failed,
            _ => return None,
        })
    }

    /// Whether the job has ended (nothing more will run).
    pub fn ended(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Cancelled | JobState::Failed
        )
    }
}

/// A job as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// Id.
    pub id: i64,
    /// What it does.
    pub kind: JobKind,
    /// The box it works on.
    pub box_kind: BoxKind,
    /// Its filter, as JSON.
    pub selection: String,
    /// Cancel jobs: the operator's reason.
    pub reason: Option<String>,
    /// State.
    pub state: JobState,
    /// Events selected when it started.
    pub total: i64,
    /// Events changed or copied so far.
    pub done: i64,
    /// The highest id its pages have covered.
    pub after_id: i64,
    /// The highest id that existed when it started: it never goes past it.
    pub through_id: i64,
    /// Who started it.
    pub actor: String,
    /// The starter's token name.
    pub principal: Option<String>,
    /// The request id it was started with.
    pub request_id: Option<String>,
    /// Who asked to cancel it.
    pub cancelled_by: Option<String>,
    /// The process holding its lease.
    pub owner: Option<String>,
    /// Failed jobs: why.
    pub error: Option<String>,
    /// Started at.
    pub created_at: DateTime<Utc>,
    /// Last progress or change of state.
    pub updated_at: DateTime<Utc>,
    /// Ended at.
    pub finished_at: Option<DateTime<Utc>>,
}

impl Job {
    /// The job's filter, read back from its selection.
    pub fn filter(&self) -> Result<EventFilter, String> {
        serde_json::from_str::<serde_json::Value>(&self.selection)
            .ok()
            .and_then(|v| serde_json::from_value(v["filter"].clone()).ok())
            .ok_or_else(|| format!("job {} has an unreadable selection", self.id))
    }
}

/// A validated StartJob request.
#[derive(Debug, Clone)]
pub struct StartJob {
    /// What to do.
    pub kind: JobKind,
    /// The box.
    pub box_kind: BoxKind,
    /// The selection.
    pub filter: EventFilter,
    /// Cancel: the reason.
    pub reason: Option<String>,
    /// Who asks; `dry_run` unless confirmed; the request id.
    pub context: ActionContext,
}

/// What StartJob did.
#[derive(Debug, Clone, PartialEq)]
pub struct JobStart {
    /// The job (none on a dry run).
    pub job: Option<Job>,
    /// Events selected.
    pub count: i64,
    /// The lowest of their ids.
    pub sample_ids: Vec<i64>,
    /// The request id named a job already started.
    pub replayed: bool,
}

/// One page of a job's progress, as stored with the page's change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobStep {
    /// Events changed or copied by the page.
    pub done: i64,
    /// The highest id the page covered.
    pub after_id: i64,
}

impl JobStep {
    /// The step of a page that changed or copied `done` of the `ids` it selected (at
    /// most `limit`, in id order): a short page is the job's last, so the job's next
    /// page starts past `through_id`, its bound.
    pub fn of_page(done: i64, ids: &[i64], limit: u32, through_id: i64) -> JobStep {
        let last = ids.len() < limit as usize;
        JobStep {
            done,
            after_id: match ids.last() {
                Some(id) if !last => *id,
                _ => through_id,
            },
        }
    }
}

/// The job after a page was recorded: its state (an operator may have asked it to
/// stop meanwhile) and counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobProgress {
    /// State.
    pub state: JobState,
    /// Events done in all.
    pub done: i64,
    /// Where the next page starts.
    pub after_id: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_page_ends_the_job_and_a_full_one_goes_on_after_its_last_id() {
        assert_eq!(
            JobStep::of_page(3, &[4, 7, 9], 3, 50),
            JobStep {
                done: 3,
                after_id: 9
            }
        );
        assert_eq!(
            JobStep::of_page(2, &[4, 7], 3, 50),
            JobStep {
                done: 2,
                after_id: 50
            }
        );
        assert_eq!(
            JobStep::of_page(0, &[], 3, 50),
            JobStep {
                done: 0,
                after_id: 50
            }
        );
        assert_eq!(JobKind::parse("redeliver"), Some(JobKind::Redeliver));
        assert!(JobState::parse("cancelled").is_some_and(JobState::ended));
        assert!(!JobState::Cancelling.ended());
    }
}

//! The job runner (issue 44, item 4): works through the background jobs stored in the
//! database (`store::jobs`), one at a time per process. A runner leases the oldest job
//! no process holds, then runs its pages: a requeue or cancel page changes its events
//! and records the progress in one transaction; a republish or redeliver page copies
//! its events through the intake (each copy's idempotency key or message id names the
//! job and the original, so a page run twice stores nothing twice) and then records the
//! progress. Every recorded page renews the lease; a process that dies stops renewing,
//! and another runner (or the restarted process) takes the job over once the lease runs
//! out and goes on after its last recorded page. A runner that stops gives its lease up.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::admin::Admin;
use crate::domain::admin::{
    ActionContext, MAX_REPUBLISH_BYTES, RepublishRequest, RepublishSelection, Selection,
};
use crate::domain::jobs::{JOB_PAGE, Job, JobKind, JobProgress, JobState, JobStep};
use crate::error::Error;

/// Errors in a row after which a job fails.
const MAX_FAILURES: u32 = 10;

/// How the runner works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobSettings {
    /// How long a runner holds a job without recording a page before another process
    /// may take it over.
    pub lease: Duration,
    /// The pause between two pages of a job, so a large job leaves the database to the
    /// relays and the intake.
    pub page_pause: Duration,
    /// How often an idle runner looks for a job.
    pub poll: Duration,
}

impl Default for JobSettings {
    fn default() -> Self {
        JobSettings {
            lease: Duration::from_secs(15),
            page_pause: Duration::from_millis(20),
            poll: Duration::from_secs(1),
        }
    }
}

/// One process's job runner.
pub struct JobRunner {
    admin: Admin,
    settings: JobSettings,
    /// This process, as the job's `owner` shows it.
    owner: String,
}

impl JobRunner {
    /// A runner acting through `admin`.
    pub fn new(admin: Admin, settings: JobSettings) -> JobRunner {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "mailroom".into());
        JobRunner {
            admin,
            settings,
            owner: format!(
                "{host} pid {} #{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ),
        }
    }

    /// Runs jobs until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(self.settings.poll) => {}
            }
            // A binary that does not know the database's schema changes nothing.
            if self.admin.may_write().await.is_err() {
                continue;
            }
            match self
                .admin
                .store()
                .claim_job(&self.owner, self.settings.lease)
                .await
            {
                Ok(Some(job)) => self.work(job, &stop).await,
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "looking for a job failed"),
            }
        }
    }

    /// Runs `job`'s pages until it ends, its lease is lost or the process stops.
    async fn work(&self, mut job: Job, stop: &CancellationToken) {
        tracing::info!(job = job.id, kind = job.kind.as_str(), done = job.done, total = job.total, owner = %self.owner, "job taken");
        let mut failures = 0u32;
        loop {
            if job.state == JobState::Cancelling {
                return self.end(&job, JobState::Cancelled, None).await;
            }
            if job.after_id >= job.through_id {
                return self.end(&job, JobState::Completed, None).await;
            }
            if stop.is_cancelled() {
                return self.release(&job).await;
            }
            // A cancel that came during the pause stops the job before its next page.
            match self.admin.store().job(job.id).await {
                Ok(Some(now)) if now.state == JobState::Cancelling => {
                    return self.end(&job, JobState::Cancelled, None).await;
                }
                Ok(Some(now)) if now.owner.as_deref() != Some(self.owner.as_str()) => {
                    tracing::warn!(
                        job = job.id,
                        "the job's lease ran out: another process took it over"
                    );
                    return;
                }
                Ok(_) | Err(_) => {}
            }
            match self.page(&job).await {
                Ok(Some(p)) => {
                    failures = 0;
                    (job.state, job.done, job.after_id) = (p.state, p.done, p.after_id);
                }
                Ok(None) => {
                    tracing::warn!(
                        job = job.id,
                        "the job's lease ran out: another process took it over"
                    );
                    return;
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(job = job.id, failures, error = %e, "a page of the job failed");
                    if failures >= MAX_FAILURES {
                        return self.end(&job, JobState::Failed, Some(&e.to_string())).await;
                    }
                    self.pause(Duration::from_millis(200) * failures, stop)
                        .await;
                    continue;
                }
            }
            self.pause(self.settings.page_pause, stop).await;
        }
    }

    async fn pause(&self, d: Duration, stop: &CancellationToken) {
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(d) => {}
        }
    }

    /// Runs the job's next page and records it.
    async fn page(&self, job: &Job) -> Result<Option<JobProgress>, Error> {
        let (store, lease) = (self.admin.store(), self.settings.lease);
        match job.kind {
            JobKind::Requeue | JobKind::Cancel => {
                match store.act_job_page(job, &self.owner, lease).await? {
                    Some((progress, held)) => {
                        self.admin.wake_later(job.box_kind, held);
                        Ok(Some(progress))
                    }
                    None => Ok(None),
                }
            }
            JobKind::Republish | JobKind::Redeliver => self.copy_page(job).await,
        }
    }

    /// Copies the job's next page (fewer events when a page's content is over what one
    /// transaction copies), then records it.
    async fn copy_page(&self, job: &Job) -> Result<Option<JobProgress>, Error> {
        let mut filter = job.filter().map_err(Error::Internal)?;
        filter.after_id = Some(job.after_id);
        filter.through_id = Some(job.through_id);
        let mut limit = JOB_PAGE;
        let context = ActionContext {
            principal: job.principal.clone(),
            ..ActionContext::by(job.actor.clone())
        };
        loop {
            let r = RepublishRequest {
                selection: Selection::Filter(filter.clone()),
                limit,
                context: context.clone(),
            };
            let max = MAX_REPUBLISH_BYTES as i64;
            let (ids, copies) = match self
                .admin
                .store()
                .copy_selection(job.box_kind, &r, max)
                .await?
            {
                RepublishSelection::Selected { ids, copies, .. } => (ids, copies),
                RepublishSelection::Replayed { .. } => {
                    return Err(Error::Internal("a job's page has no request id".into()));
                }
            };
            if !ids.is_empty() && copies.is_empty() {
                if limit == 1 {
                    return Err(Error::Internal(format!(
                        "event {} is over {MAX_REPUBLISH_BYTES} bytes to copy",
                        ids[0]
                    )));
                }
                limit /= 2;
                continue;
            }
            let copied = self
                .admin
                .store_copies(job.box_kind, copies, &format!("job-{}", job.id))
                .await?;
            let step = JobStep::of_page(copied.len() as i64, &ids, limit, job.through_id);
            return Ok(self
                .admin
                .store()
                .advance_job(job, &self.owner, step, self.settings.lease)
                .await?);
        }
    }

    async fn end(&self, job: &Job, state: JobState, error: Option<&str>) {
        match self
            .admin
            .store()
            .end_job(job, &self.owner, state, error)
            .await
        {
            Ok(Some(j)) => {
                tracing::info!(
                    job = j.id,
                    kind = j.kind.as_str(),
                    state = state.as_str(),
                    done = j.done,
                    total = j.total,
                    "job ended"
                );
            }
            Ok(None) => tracing::warn!(job = job.id, "the job's lease ran out before it ended"),
            Err(e) => {
                tracing::warn!(job = job.id, error = %e, "ending the job failed; it is taken over when its lease runs out")
            }
        }
    }

    async fn release(&self, job: &Job) {
        if let Err(e) = self.admin.store().release_job(job.id, &self.owner).await {
            tracing::warn!(job = job.id, error = %e, "giving the job's lease up failed; it is taken over when the lease runs out");
        }
    }
}

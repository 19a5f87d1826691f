//! Background jobs in the database (`mailroom_jobs`, migration 0025), written once for
//! every engine over `AdminSql`: starting one (its selection counted and bounded by the
//! highest id at that moment, audited), the lease a runner holds, each page's progress
//! stored with the page's change, cancelling and ending. The runner is `crate::jobs`.

use std::time::Duration;

use super::admin_flow::{
    NewAudit, change_candidates, decode_all, filter_params, insert_audit, read, rows_in,
};
use super::admin_sql::{AdminSql, JobSql, Param, Read, Shared, Stmt, query};
use super::rows::{Candidate, Cols, decode_candidate};
use super::{StoreError, StoreResult};
use crate::domain::BoxKind;
use crate::domain::admin::{ActionContext, AdminKey, EventFilter, SAMPLE_IDS};
use crate::domain::jobs::{
    JOB_PAGE, Job, JobKind, JobProgress, JobStart, JobState, JobStep, StartJob,
};

/// The job half of the store.
#[async_trait::async_trait]
pub trait JobStore: Send + Sync {
    /// Starts a job (or, on a dry run, counts and samples its selection): the selection
    /// is bounded by the box's highest id now, counted, and the job and its audit entry
    /// are stored in one transaction. A request id that started a job answers that job.
    async fn start_job(&self, r: &StartJob) -> StoreResult<JobStart>;

    /// One job.
    async fn job(&self, id: i64) -> StoreResult<Option<Job>>;

    /// Up to `limit` jobs with ids below `before_id` (`None`: from the newest), newest first.
    async fn jobs(&self, limit: u32, before_id: Option<i64>) -> StoreResult<Vec<Job>>;

    /// Asks a running job to stop (audited); `changed` is false when it was not running.
    /// `None` when there is no such job.
    async fn cancel_job(&self, id: i64, by: &ActionContext) -> StoreResult<Option<(Job, bool)>>;

    /// Leases the oldest job that has not ended and that no process holds to `owner`.
    async fn claim_job(&self, owner: &str, lease: Duration) -> StoreResult<Option<Job>>;

    /// Requeues or cancels the job's next page, and records it with the change in one
    /// transaction (renewing the lease). `None` when `owner` no longer holds the job: the
    /// page was not changed. Also the keys a relay held (to wake once released).
    async fn act_job_page(
        &self,
        job: &Job,
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Option<(JobProgress, Vec<AdminKey>)>>;

    /// Records a page done outside the store's transaction (republish, redeliver: the
    /// copies' ids make a page run twice store nothing twice). `None` when `owner` no
    /// longer holds the job.
    async fn advance_job(
        &self,
        job: &Job,
        owner: &str,
        step: JobStep,
        lease: Duration,
    ) -> StoreResult<Option<JobProgress>>;

    /// Ends the job in `state` (audited). `None` when `owner` no longer holds it.
    async fn end_job(
        &self,
        job: &Job,
        owner: &str,
        state: JobState,
        error: Option<&str>,
    ) -> StoreResult<Option<Job>>;

    /// Gives up `owner`'s lease (a process stopping), so another process takes the job
    /// over at once.
    async fn release_job(&self, id: i64, owner: &str) -> StoreResult<()>;
}

pub(crate) fn decode_job(row: &impl Cols) -> StoreResult<Job> {
    let kind = row.text("kind")?;
    let state = row.text("state")?;
    Ok(Job {
        id: row.int("id")?,
        kind: JobKind::parse(&kind)
            .ok_or_else(|| StoreError::other(format!("unknown job kind {kind:?}")))?,
        box_kind: box_of(&row.text("box")?),
        selection: row.text("selection")?,
        reason: row.opt_text("reason")?,
        state: JobState::parse(&state)
            .ok_or_else(|| StoreError::other(format!("unknown job state {state:?}")))?,
        total: row.int("total")?,
        done: row.int("done")?,
        after_id: row.int("after_id")?,
        through_id: row.int("through_id")?,
        actor: row.text("actor")?,
        principal: row.opt_text("principal")?,
        request_id: row.opt_text("request_id")?,
        cancelled_by: row.opt_text("cancelled_by")?,
        owner: row.opt_text("owner")?,
        error: row.opt_text("error")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        finished_at: row.opt_time("finished_at")?,
    })
}

fn box_of(s: &str) -> BoxKind {
    if s == "inbox" {
        BoxKind::Inbox
    } else {
        BoxKind::Outbox
    }
}

fn one_job<R: Cols>(rows: &[R]) -> StoreResult<Option<Job>> {
    rows.first().map(decode_job).transpose()
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The statement that selects a page of candidates of `kind`: filter (15), limit.
fn page_stmt(kind: JobKind) -> Stmt {
    Stmt::Shared(match kind {
        JobKind::Requeue => Shared::FailedByFilter,
        JobKind::Cancel => Shared::Job(JobSql::PendingByFilter),
        JobKind::Republish | JobKind::Redeliver => Shared::CompletedByFilter,
    })
}

/// The job's filter from `after_id` to `through_id`.
fn page_filter(job: &Job) -> StoreResult<EventFilter> {
    let mut f = job.filter().map_err(StoreError::other)?;
    f.after_id = Some(job.after_id);
    f.through_id = Some(job.through_id);
    Ok(f)
}

/// The selection a job records: its filter (and a cancel's reason).
fn selection_of(r: &StartJob) -> serde_json::Value {
    match &r.reason {
        Some(reason) => serde_json::json!({ "filter": r.filter, "reason": reason }),
        None => serde_json::json!({ "filter": r.filter }),
    }
}

/// An audit entry about a job: `{"job": id, "kind": ..., "filter": ...}`.
fn job_audit<'a>(
    job: &Job,
    context: &'a ActionContext,
    action: &'static str,
    count: i64,
) -> NewAudit<'a> {
    let mut selection: serde_json::Value =
        serde_json::from_str(&job.selection).unwrap_or(serde_json::Value::Null);
    if let Some(m) = selection.as_object_mut() {
        m.insert("job".into(), job.id.into());
        m.insert("kind".into(), job.kind.as_str().into());
    }
    NewAudit {
        context,
        action,
        box_kind: job.box_kind,
        selection,
        count,
    }
}

/// What the end of a job is audited as.
fn end_action(state: JobState) -> &'static str {
    match state {
        JobState::Completed => "job.completed",
        JobState::Cancelled => "job.cancelled",
        _ => "job.failed",
    }
}

fn decode_progress<R: Cols>(rows: &[R]) -> StoreResult<Option<JobProgress>> {
    let Some(r) = rows.first() else {
        return Ok(None);
    };
    let state = r.text("state")?;
    Ok(Some(JobProgress {
        state: JobState::parse(&state)
            .ok_or_else(|| StoreError::other(format!("unknown job state {state:?}")))?,
        done: r.int("done")?,
        after_id: r.int("after_id")?,
    }))
}

async fn advance_in<E: AdminSql>(
    e: &E,
    tx: &mut E::Tx,
    job: &Job,
    owner: &str,
    step: JobStep,
    lease: Duration,
) -> StoreResult<Option<JobProgress>> {
    let params = vec![
        Param::Int(Some(job.id)),
        Param::Text(Some(owner)),
        Param::Int(Some(step.done)),
        Param::Int(Some(step.after_id)),
        Param::Int(Some(millis(lease))),
        Param::Now,
    ];
    let q = query(Stmt::Shared(Shared::Job(JobSql::Advance)), params);
    decode_progress(&rows_in(e, tx, job.box_kind, q).await?)
}

#[async_trait::async_trait]
impl<E: AdminSql> JobStore for E {
    async fn start_job(&self, r: &StartJob) -> StoreResult<JobStart> {
        let (b, kind) = (r.box_kind, r.kind);
        let job_stmt = |j| Stmt::Shared(Shared::Job(j));
        let mut tx = self.begin().await?;
        let of_request = |rid| {
            query(
                job_stmt(JobSql::OfRequest),
                vec![
                    Param::Text(Some(kind.as_str())),
                    Param::Text(Some(b.as_str())),
                    Param::Text(Some(rid)),
                ],
            )
        };
        if !r.context.dry_run
            && let Some(rid) = r.context.request_id.as_deref()
            && let Some(job) = one_job(&rows_in(self, &mut tx, b, of_request(rid)).await?)?
        {
            self.rollback(tx).await?;
            return Ok(JobStart {
                count: job.total,
                job: Some(job),
                sample_ids: Vec::new(),
                replayed: true,
            });
        }
        let rows = rows_in(self, &mut tx, b, query(job_stmt(JobSql::MaxId), vec![])).await?;
        let through = rows.first().map(|r| r.int("id")).transpose()?.unwrap_or(0);
        let mut f = r.filter.clone();
        f.through_id = Some(through);
        let mut params = vec![Param::Text(Some(kind.selects()))];
        params.extend(filter_params(&f));
        let rows = rows_in(self, &mut tx, b, query(job_stmt(JobSql::Count), params)).await?;
        let count = rows.first().map(|r| r.int("n")).transpose()?.unwrap_or(0);
        let mut params = filter_params(&f).to_vec();
        params.push(Param::Int(Some(SAMPLE_IDS as i64)));
        let rows = rows_in(self, &mut tx, b, query(page_stmt(kind), params)).await?;
        let sample_ids = decode_all(&rows, decode_candidate)?
            .into_iter()
            .map(|c| c.id)
            .collect();
        if r.context.dry_run {
            self.rollback(tx).await?;
            return Ok(JobStart {
                job: None,
                count,
                sample_ids,
                replayed: false,
            });
        }
        let selection = selection_of(r).to_string();
        let params = vec![
            Param::Text(Some(kind.as_str())),
            Param::Text(Some(b.as_str())),
            Param::Text(Some(&selection)),
            Param::Text(r.reason.as_deref()),
            Param::Int(Some(count)),
            Param::Int(Some(through)),
            Param::Text(Some(&r.context.actor)),
            Param::Text(r.context.principal.as_deref()),
            Param::Text(r.context.request_id.as_deref()),
            Param::Now,
        ];
        let rows = rows_in(self, &mut tx, b, query(job_stmt(JobSql::Insert), params)).await?;
        let Some(job) = one_job(&rows)? else {
            // The same request id started a job meanwhile (the insert met its row).
            self.rollback(tx).await?;
            let rid = r.context.request_id.as_deref().unwrap_or_default();
            let mut tx = self.begin().await?;
            let job = one_job(&rows_in(self, &mut tx, b, of_request(rid)).await?)?;
            self.rollback(tx).await?;
            let job = job.ok_or_else(|| StoreError::other("a job's request id has no job"))?;
            return Ok(JobStart {
                count: job.total,
                job: Some(job),
                sample_ids: Vec::new(),
                replayed: true,
            });
        };
        insert_audit(
            self,
            &mut tx,
            &job_audit(&job, &r.context, "job.start", count),
        )
        .await?;
        self.commit(tx).await?;
        Ok(JobStart {
            job: Some(job),
            count,
            sample_ids,
            replayed: false,
        })
    }

    async fn job(&self, id: i64) -> StoreResult<Option<Job>> {
        let q = query(
            Stmt::Shared(Shared::Job(JobSql::One)),
            vec![Param::Int(Some(id))],
        );
        let rows = read(self, Read::Plain, BoxKind::Outbox, &[q]).await?;
        one_job(rows.first().map_or(&[][..], Vec::as_slice))
    }

    async fn jobs(&self, limit: u32, before_id: Option<i64>) -> StoreResult<Vec<Job>> {
        let q = query(
            Stmt::Shared(Shared::Job(JobSql::Page)),
            vec![Param::Int(before_id), Param::Int(Some(i64::from(limit)))],
        );
        let rows = read(self, Read::Plain, BoxKind::Outbox, &[q]).await?;
        decode_all(rows.first().map_or(&[][..], Vec::as_slice), decode_job)
    }

    async fn cancel_job(&self, id: i64, by: &ActionContext) -> StoreResult<Option<(Job, bool)>> {
        let mut tx = self.begin().await?;
        let q = query(
            Stmt::Shared(Shared::Job(JobSql::Cancel)),
            vec![
                Param::Int(Some(id)),
                Param::Text(Some(&by.actor)),
                Param::Now,
            ],
        );
        if let Some(job) = one_job(&rows_in(self, &mut tx, BoxKind::Outbox, q).await?)? {
            insert_audit(self, &mut tx, &job_audit(&job, by, "job.cancel", job.done)).await?;
            self.commit(tx).await?;
            return Ok(Some((job, true)));
        }
        self.rollback(tx).await?;
        Ok(self.job(id).await?.map(|j| (j, false)))
    }

    async fn claim_job(&self, owner: &str, lease: Duration) -> StoreResult<Option<Job>> {
        let mut tx = self.begin().await?;
        let q = query(
            Stmt::Shared(Shared::Job(JobSql::Claim)),
            vec![
                Param::Text(Some(owner)),
                Param::Int(Some(millis(lease))),
                Param::Now,
            ],
        );
        let job = one_job(&rows_in(self, &mut tx, BoxKind::Outbox, q).await?)?;
        self.commit(tx).await?;
        Ok(job)
    }

    async fn act_job_page(
        &self,
        job: &Job,
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Option<(JobProgress, Vec<AdminKey>)>> {
        let b = job.box_kind;
        let f = page_filter(job)?;
        let mut tx = self.begin().await?;
        let mut params = filter_params(&f).to_vec();
        params.push(Param::Int(Some(i64::from(JOB_PAGE))));
        let rows = rows_in(self, &mut tx, b, query(page_stmt(job.kind), params)).await?;
        let cands: Vec<Candidate> = decode_all(&rows, decode_candidate)?;
        let ids: Vec<i64> = cands.iter().map(|c| c.id).collect();
        let keys = match (job.kind, ids.is_empty()) {
            (_, true) => Vec::new(),
            (JobKind::Requeue, false) => {
                let params = [Param::Ids(&ids), Param::Now];
                change_candidates(self, &mut tx, b, &cands, &params, Shared::Requeue).await?
            }
            (JobKind::Cancel, false) => {
                let reason = job.reason.as_deref().unwrap_or_default();
                let params = [Param::Ids(&ids), Param::Text(Some(reason)), Param::Now];
                change_candidates(self, &mut tx, b, &cands, &params, Shared::Cancel).await?
            }
            (JobKind::Republish | JobKind::Redeliver, false) => {
                return Err(StoreError::other("copies are not changed in the store"));
            }
        };
        let step = JobStep::of_page(ids.len() as i64, &ids, JOB_PAGE, job.through_id);
        match advance_in(self, &mut tx, job, owner, step, lease).await? {
            // Cancelled while the page ran: the page is undone, so a cancel stops the job
            // at the last page recorded before it.
            Some(p) if p.state == JobState::Cancelling => {
                self.rollback(tx).await?;
                let p = JobProgress {
                    state: p.state,
                    done: p.done - step.done,
                    after_id: job.after_id,
                };
                Ok(Some((p, Vec::new())))
            }
            Some(p) => {
                self.commit(tx).await?;
                Ok(Some((p, keys)))
            }
            None => {
                self.rollback(tx).await?;
                Ok(None)
            }
        }
    }

    async fn advance_job(
        &self,
        job: &Job,
        owner: &str,
        step: JobStep,
        lease: Duration,
    ) -> StoreResult<Option<JobProgress>> {
        let mut tx = self.begin().await?;
        let p = advance_in(self, &mut tx, job, owner, step, lease).await?;
        self.commit(tx).await?;
        Ok(p)
    }

    async fn end_job(
        &self,
        job: &Job,
        owner: &str,
        state: JobState,
        error: Option<&str>,
    ) -> StoreResult<Option<Job>> {
        let mut tx = self.begin().await?;
        let q = query(
            Stmt::Shared(Shared::Job(JobSql::End)),
            vec![
                Param::Int(Some(job.id)),
                Param::Text(Some(owner)),
                Param::Text(Some(state.as_str())),
                Param::Text(error),
                Param::Now,
            ],
        );
        let Some(ended) = one_job(&rows_in(self, &mut tx, job.box_kind, q).await?)? else {
            self.rollback(tx).await?;
            return Ok(None);
        };
        let context = ActionContext {
            principal: ended.principal.clone(),
            ..ActionContext::by(ended.actor.clone())
        };
        let audit = job_audit(&ended, &context, end_action(state), ended.done);
        insert_audit(self, &mut tx, &audit).await?;
        self.commit(tx).await?;
        Ok(Some(ended))
    }

    async fn release_job(&self, id: i64, owner: &str) -> StoreResult<()> {
        let mut tx = self.begin().await?;
        let sql = self.sql(BoxKind::Outbox, Stmt::Shared(Shared::Job(JobSql::Release)));
        self.execute_in(
            &mut tx,
            &sql,
            &[Param::Int(Some(id)), Param::Text(Some(owner))],
        )
        .await?;
        self.commit(tx).await?;
        Ok(())
    }
}

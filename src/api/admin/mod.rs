//! `mailroom.v1.AdminService`: the operator surface. Each RPC (its token already checked
//! by `api::layers::AuthLayer`) converts and validates its request into an operator query
//! (`crate::admin`), runs it and converts the result back. Validation lives here.
//! Validation and conversion are in `requests`.

pub mod jobs;
pub mod requests;
pub mod rewinds;

use tonic::{Request, Response, Status};

use crate::access::{LEGACY_ADMIN_TOKEN, Principal, Scope};
use crate::admin::{Admin, encode_token};
use crate::domain::BoxKind;
use crate::domain::admin::{ActionContext, EventsQuery};
use crate::error::Error;
use crate::metrics::Metrics;
use crate::pb;
use crate::pb::time::to_duration;
use jobs::{job_id, job_info, start_job_request};
use requests::*;
pub use requests::{
    box_kind, cancel_request, event_filter, event_info, event_ref, pause_request, pending_query,
    redeliver_request, republish_request, requeue_request, subscription_pause_request,
};
use rewinds::{rewind_info, rewind_request};

/// The admin RPCs. Tokens and scopes are checked before a call reaches it
/// (`api::layers::AuthLayer`); the caller arrives as a `Principal` for the audit log.
pub struct AdminApi {
    admin: Admin,
    metrics: Option<Metrics>,
    /// The inbox subscriptions this service is configured with (pauses name one).
    subscriptions: Vec<String>,
}

/// Who made a call, for the audit log.
struct Caller {
    principal: Principal,
}

impl Caller {
    fn actor(&self, operator: &str) -> String {
        let name = if operator.trim().is_empty() {
            "anonymous"
        } else {
            operator.trim()
        };
        match self.principal.name.as_deref() {
            None => name.to_string(),
            Some(LEGACY_ADMIN_TOKEN) => format!("{name} (token)"),
            Some(token) => format!("{name} (token {token})"),
        }
    }

    /// The caller acting as `operator`; the request fills in the dry run and request id.
    fn context(&self, operator: &str) -> ActionContext {
        ActionContext {
            principal: self.principal.audit_label(),
            ..ActionContext::by(self.actor(operator))
        }
    }
}

impl AdminApi {
    /// The service over the admin middle layer.
    pub fn new(admin: Admin) -> Self {
        AdminApi {
            admin,
            metrics: None,
            subscriptions: Vec::new(),
        }
    }

    /// The inbox subscriptions this service is configured with.
    pub fn with_subscriptions(mut self, names: Vec<String>) -> Self {
        self.subscriptions = names;
        self
    }

    /// Counts requeues and cancels in `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn authorize(&self, ext: &tonic::Extensions) -> Result<Caller, Error> {
        Ok(Caller {
            principal: Principal::of(ext),
        })
    }
}

#[tonic::async_trait]
impl pb::admin_service_server::AdminService for AdminApi {
    async fn start_job(
        &self,
        request: Request<pb::StartJobRequest>,
    ) -> Result<Response<pb::StartJobResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let context = caller.context(&r.operator);
        let req = start_job_request(r, context)?;
        let out = self.admin.start_job(&req).await?;
        if let Some(j) = out.job.as_ref().filter(|_| !out.replayed) {
            tracing::info!(job = j.id, kind = j.kind.as_str(), total = j.total, actor = %j.actor, "job started");
        }
        Ok(Response::new(pb::StartJobResponse {
            job: out.job.map(job_info),
            count: out.count,
            sample_ids: out.sample_ids,
            dry_run: req.context.dry_run,
            replayed: out.replayed,
        }))
    }

    async fn rewind_subscription(
        &self,
        request: Request<pb::RewindSubscriptionRequest>,
    ) -> Result<Response<pb::RewindSubscriptionResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let context = caller.context(&r.operator);
        let req = rewind_request(r, context, &self.subscriptions)?;
        let out = self.admin.rewind(&req).await?;
        if let Some(id) = out.audit_id {
            tracing::info!(audit_id = id, subscription = %req.subscription, to_time = %req.to_time,
                redeliver = req.redeliver, actor = %req.context.actor, "subscription rewind asked for");
        }
        Ok(Response::new(pb::RewindSubscriptionResponse {
            rewind: out.rewind.map(rewind_info),
            stored_since: out.stored_since,
            dry_run: req.context.dry_run,
            replayed: out.replayed,
            audit_id: out.audit_id.unwrap_or(0),
        }))
    }

    async fn list_rewinds(
        &self,
        request: Request<pb::ListRewindsRequest>,
    ) -> Result<Response<pb::ListRewindsResponse>, Status> {
        self.authorize(request.extensions())?;
        let r = request.into_inner();
        let sub = (!r.subscription.is_empty()).then_some(r.subscription.as_str());
        let rewinds = self.admin.rewinds(sub, page_size(r.page_size)?).await?;
        Ok(Response::new(pb::ListRewindsResponse {
            rewinds: rewinds.into_iter().map(rewind_info).collect(),
        }))
    }

    async fn get_job(
        &self,
        request: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::GetJobResponse>, Status> {
        self.authorize(request.extensions())?;
        let job = self.admin.job(job_id(request.into_inner().id)?).await?;
        Ok(Response::new(pb::GetJobResponse {
            job: Some(job_info(job)),
        }))
    }

    async fn list_jobs(
        &self,
        request: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsResponse>, Status> {
        self.authorize(request.extensions())?;
        let r = request.into_inner();
        let (jobs, next) = self
            .admin
            .jobs(page_size(r.page_size)?, before_id(&r.page_token)?)
            .await?;
        Ok(Response::new(pb::ListJobsResponse {
            jobs: jobs.into_iter().map(job_info).collect(),
            next_page_token: before_token(next),
        }))
    }

    async fn cancel_job(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::CancelJobResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let context = caller.context(&r.operator);
        let (job, changed) = self.admin.cancel_job(job_id(r.id)?, &context).await?;
        if changed {
            tracing::info!(job = job.id, actor = %context.actor, "job cancelling");
        }
        Ok(Response::new(pb::CancelJobResponse {
            job: Some(job_info(job)),
            changed,
        }))
    }

    async fn list_pending(
        &self,
        request: Request<pb::ListPendingRequest>,
    ) -> Result<Response<pb::ListPendingResponse>, Status> {
        self.authorize(request.extensions())?;
        let r = request.into_inner();
        let b = box_kind(r.r#box)?;
        let q = pending_query(b, r)?;
        let page = self.admin.list_pending(b, &q).await?;
        Ok(Response::new(pb::ListPendingResponse {
            keys: page.keys.into_iter().map(key_backlog).collect(),
            next_page_token: page.next.map(|c| encode_token(&c)).unwrap_or_default(),
            total_pending: page.total_pending,
            total_keys: page.total_keys,
            total_blocked_keys: page.total_blocked_keys,
            paused_topics: page.paused.into_iter().map(topic_pause).collect(),
        }))
    }

    async fn requeue_failed(
        &self,
        request: Request<pb::RequeueFailedRequest>,
    ) -> Result<Response<pb::RequeueFailedResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let b = box_kind(r.r#box)?;
        let context = caller.context(&r.operator);
        let req = requeue_request(b, r, context)?;
        let out = self.admin.requeue(b, &req).await?;
        if let Some(id) = out.audit_id.filter(|_| !out.replayed) {
            tracing::info!(audit_id = id, count = out.count, actor = %req.context.actor, "requeued failed events");
            if let Some(m) = &self.metrics {
                m.requeued(out.count.max(0) as u64);
            }
        }
        Ok(Response::new(pb::RequeueFailedResponse {
            count: out.count,
            sample_ids: out.sample_ids,
            dry_run: req.context.dry_run,
            audit_id: out.audit_id.unwrap_or(0),
            replayed: out.replayed,
        }))
    }

    async fn republish_events(
        &self,
        request: Request<pb::RepublishEventsRequest>,
    ) -> Result<Response<pb::RepublishEventsResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let context = caller.context(&r.operator);
        let req = republish_request(r, context)?;
        let out = self.admin.republish(&req).await?;
        if let Some(id) = out.audit_id.filter(|_| !out.replayed) {
            tracing::info!(audit_id = id, count = out.count, actor = %req.context.actor, "republished events");
            if let Some(m) = &self.metrics {
                m.republished(out.count.max(0) as u64);
            }
        }
        Ok(Response::new(pb::RepublishEventsResponse {
            count: out.count,
            sample_ids: out.sample_ids,
            dry_run: req.context.dry_run,
            audit_id: out.audit_id.unwrap_or(0),
            replayed: out.replayed,
            copies: out
                .copies
                .into_iter()
                .map(|(original_id, id)| pb::CopiedEvent { original_id, id })
                .collect(),
        }))
    }

    async fn redeliver_messages(
        &self,
        request: Request<pb::RedeliverMessagesRequest>,
    ) -> Result<Response<pb::RedeliverMessagesResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let context = caller.context(&r.operator);
        let req = redeliver_request(r, context)?;
        let out = self.admin.redeliver(&req).await?;
        if let Some(id) = out.audit_id.filter(|_| !out.replayed) {
            tracing::info!(audit_id = id, count = out.count, actor = %req.context.actor, "redelivered inbox messages");
        }
        Ok(Response::new(pb::RedeliverMessagesResponse {
            count: out.count,
            sample_ids: out.sample_ids,
            dry_run: req.context.dry_run,
            audit_id: out.audit_id.unwrap_or(0),
            replayed: out.replayed,
            copies: out
                .copies
                .into_iter()
                .map(|(original_id, id)| pb::CopiedEvent { original_id, id })
                .collect(),
        }))
    }

    async fn get_event(
        &self,
        request: Request<pb::GetEventRequest>,
    ) -> Result<Response<pb::GetEventResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let b = box_kind(r.r#box)?;
        if r.include_payload && !caller.principal.sees_payloads() {
            return Err(Error::PermissionDenied {
                message: "this token may read the backlog but not payloads: include_payload \
                          needs the payloads scope (or admin)"
                    .into(),
                required_scope: Some(Scope::Payloads.name()),
            }
            .into());
        }
        let with_payload = r.include_payload;
        let by = event_ref(b, r)?;
        let d = self.admin.find_event(b, &by, with_payload).await?;
        Ok(Response::new(pb::GetEventResponse {
            event: Some(event_info(d)),
        }))
    }

    async fn list_events(
        &self,
        request: Request<pb::ListEventsRequest>,
    ) -> Result<Response<pb::ListEventsResponse>, Status> {
        self.authorize(request.extensions())?;
        let r = request.into_inner();
        let b = box_kind(r.r#box)?;
        let q = EventsQuery {
            status: event_status(r.status)?,
            filter: event_filter(b, r.filter, "filter")?,
            page_size: page_size(r.page_size)?,
            before_id: before_id(&r.page_token)?,
        };
        let page = self.admin.list_events(b, &q).await?;
        Ok(Response::new(pb::ListEventsResponse {
            events: page.events.into_iter().map(event_info).collect(),
            next_page_token: before_token(page.next_before_id),
        }))
    }

    async fn cancel_events(
        &self,
        request: Request<pb::CancelEventsRequest>,
    ) -> Result<Response<pb::CancelEventsResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let b = box_kind(r.r#box)?;
        let context = caller.context(&r.operator);
        let req = cancel_request(r, context)?;
        let out = self.admin.cancel(b, &req).await?;
        if let Some(id) = out.audit_id.filter(|_| !out.replayed) {
            tracing::info!(audit_id = id, count = out.ids.len(), actor = %req.context.actor, "cancelled events");
            if let Some(m) = &self.metrics {
                m.cancelled(out.ids.len() as u64);
            }
        }
        Ok(Response::new(pb::CancelEventsResponse {
            count: out.ids.len() as i64,
            ids: out.ids,
            audit_id: out.audit_id.unwrap_or(0),
            replayed: out.replayed,
        }))
    }

    async fn list_audit(
        &self,
        request: Request<pb::ListAuditRequest>,
    ) -> Result<Response<pb::ListAuditResponse>, Status> {
        self.authorize(request.extensions())?;
        let r = request.into_inner();
        let page = self
            .admin
            .list_audit(page_size(r.page_size)?, before_id(&r.page_token)?)
            .await?;
        Ok(Response::new(pb::ListAuditResponse {
            entries: page.entries.into_iter().map(audit_entry).collect(),
            next_page_token: before_token(page.next_before_id),
        }))
    }

    async fn get_stats(
        &self,
        request: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::GetStatsResponse>, Status> {
        self.authorize(request.extensions())?;
        let r = request.into_inner();
        let b = box_kind(r.r#box)?;
        let sub = subscription(b, r.subscription, "subscription")?;
        let s = self.admin.stats(b, sub.as_deref()).await?;
        Ok(Response::new(pb::GetStatsResponse {
            pending: s.pending,
            completed: s.completed,
            failed: s.failed,
            oldest_pending_age: s.oldest_pending_age.map(to_duration),
            blocked_keys: s.blocked_keys,
            topics: s
                .topics
                .into_iter()
                .map(|t| pb::TopicStats {
                    subscription: t.subscription,
                    topic: t.topic,
                    pending: t.pending,
                    completed: t.completed,
                    failed: t.failed,
                    paused: t.paused,
                })
                .collect(),
        }))
    }

    async fn pause_topic(
        &self,
        request: Request<pb::PauseTopicRequest>,
    ) -> Result<Response<pb::PauseTopicResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let req = pause_request(r.topic, Some(r.reason), caller.context(&r.operator))?;
        let out = self.admin.pause(BoxKind::Outbox, &req).await?;
        if out.changed {
            tracing::warn!(topic = %req.topic, reason = %req.reason, actor = %req.context.actor, "topic paused: its events are not published until it is resumed");
        }
        Ok(Response::new(pb::PauseTopicResponse {
            pause: out.pause.map(topic_pause),
            changed: out.changed,
            audit_id: out.audit_id.unwrap_or(0),
        }))
    }

    async fn resume_topic(
        &self,
        request: Request<pb::ResumeTopicRequest>,
    ) -> Result<Response<pb::ResumeTopicResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let req = pause_request(r.topic, None, caller.context(&r.operator))?;
        let out = self.admin.resume(BoxKind::Outbox, &req).await?;
        if out.changed {
            tracing::info!(topic = %req.topic, actor = %req.context.actor, "topic resumed");
        }
        Ok(Response::new(pb::ResumeTopicResponse {
            lifted: out.pause.map(topic_pause),
            changed: out.changed,
            audit_id: out.audit_id.unwrap_or(0),
        }))
    }

    async fn list_paused_topics(
        &self,
        request: Request<pb::ListPausedTopicsRequest>,
    ) -> Result<Response<pb::ListPausedTopicsResponse>, Status> {
        self.authorize(request.extensions())?;
        let topics = self.admin.paused(BoxKind::Outbox).await?;
        Ok(Response::new(pb::ListPausedTopicsResponse {
            topics: topics.into_iter().map(topic_pause).collect(),
        }))
    }

    async fn pause_subscription(
        &self,
        request: Request<pb::PauseSubscriptionRequest>,
    ) -> Result<Response<pb::PauseSubscriptionResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let req = subscription_pause_request(
            r.subscription,
            Some(r.reason),
            caller.context(&r.operator),
            &self.subscriptions,
        )?;
        let out = self.admin.pause(BoxKind::Inbox, &req).await?;
        if out.changed {
            tracing::warn!(subscription = %req.topic, reason = %req.reason, actor = %req.context.actor, "subscription paused: its messages are not handed to the handler until it is resumed");
        }
        Ok(Response::new(pb::PauseSubscriptionResponse {
            pause: out.pause.map(subscription_pause),
            changed: out.changed,
            audit_id: out.audit_id.unwrap_or(0),
        }))
    }

    async fn resume_subscription(
        &self,
        request: Request<pb::ResumeSubscriptionRequest>,
    ) -> Result<Response<pb::ResumeSubscriptionResponse>, Status> {
        let caller = self.authorize(request.extensions())?;
        let r = request.into_inner();
        let req = subscription_pause_request(
            r.subscription,
            None,
            caller.context(&r.operator),
            &self.subscriptions,
        )?;
        let out = self.admin.resume(BoxKind::Inbox, &req).await?;
        if out.changed {
            tracing::info!(subscription = %req.topic, actor = %req.context.actor, "subscription resumed");
        }
        Ok(Response::new(pb::ResumeSubscriptionResponse {
            lifted: out.pause.map(subscription_pause),
            changed: out.changed,
            audit_id: out.audit_id.unwrap_or(0),
        }))
    }

    async fn list_paused_subscriptions(
        &self,
        request: Request<pb::ListPausedSubscriptionsRequest>,
    ) -> Result<Response<pb::ListPausedSubscriptionsResponse>, Status> {
        self.authorize(request.extensions())?;
        let subs = self.admin.paused(BoxKind::Inbox).await?;
        Ok(Response::new(pb::ListPausedSubscriptionsResponse {
            subscriptions: subs.into_iter().map(subscription_pause).collect(),
        }))
    }
}

//! `mailroom.v1.OutboxService`: validate, hand to the group committer, answer. The
//! caller's token was checked by `api::auth::AuthLayer`; a token limited to some topics
//! is checked against each event's topic here, before anything is stored.

use tonic::{Request, Response, Status};

use super::auth::Principal;
use super::convert::{self, Limits};
use crate::domain::Enqueued;
use crate::intake::Intake;
use crate::metrics::Metrics;
use crate::pb;

pub struct OutboxApi {
    intake: Intake,
    limits: Limits,
    metrics: Option<Metrics>,
}

impl OutboxApi {
    pub fn new(intake: Intake, limits: Limits) -> Self {
        OutboxApi {
            intake,
            limits,
            metrics: None,
        }
    }

    /// Counts stored events and duplicates by topic in `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn count<'a>(&self, topics: impl Iterator<Item = &'a str>, stored: &[Enqueued]) {
        let Some(m) = &self.metrics else { return };
        for (topic, e) in topics.zip(stored) {
            let dup = u64::from(e.is_duplicate());
            m.enqueued(topic, 1 - dup, dup);
        }
    }
}

#[tonic::async_trait]
impl pb::outbox_service_server::OutboxService for OutboxApi {
    async fn enqueue(
        &self,
        request: Request<pb::EnqueueRequest>,
    ) -> Result<Response<pb::EnqueueResponse>, Status> {
        let principal = Principal::of(request.extensions());
        if let Some(e) = &request.get_ref().event {
            principal.check_topic(&e.topic)?;
        }
        let trace = convert::traceparent(request.metadata());
        let mut event = convert::enqueue_request(request.into_inner(), &self.limits)?;
        convert::attach_trace(&mut event, trace.as_deref());
        let topic = event.topic.clone();
        let stored = self.intake.submit(vec![event], false).await?;
        self.count(std::iter::once(topic.as_str()), &stored);
        let first = stored[0];
        Ok(Response::new(pb::EnqueueResponse {
            id: first.id(),
            duplicate: first.is_duplicate(),
        }))
    }

    async fn enqueue_batch(
        &self,
        request: Request<pb::EnqueueBatchRequest>,
    ) -> Result<Response<pb::EnqueueBatchResponse>, Status> {
        let principal = Principal::of(request.extensions());
        for e in &request.get_ref().events {
            principal.check_topic(&e.topic)?;
        }
        let trace = convert::traceparent(request.metadata());
        let mut events = convert::enqueue_batch_request(request.into_inner(), &self.limits)?;
        for e in &mut events {
            convert::attach_trace(e, trace.as_deref());
        }
        let topics: Vec<String> = match &self.metrics {
            Some(_) => events.iter().map(|e| e.topic.clone()).collect(),
            None => Vec::new(),
        };
        let stored = self.intake.submit(events, true).await?;
        self.count(topics.iter().map(String::as_str), &stored);
        Ok(Response::new(pb::EnqueueBatchResponse {
            results: stored
                .into_iter()
                .map(|e| pb::EnqueueResult {
                    id: e.id(),
                    duplicate: e.is_duplicate(),
                })
                .collect(),
        }))
    }
}

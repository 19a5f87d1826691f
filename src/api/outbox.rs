//! `mailroom.v1.OutboxService`: validate, hand to the group committer, answer. The
//! caller's token was checked by `api::layers::AuthLayer`; a token limited to some topics
//! is checked against each event's topic here, before anything is stored.

use tonic::{Request, Response, Status};

use super::convert;
use crate::access::Principal;
use crate::domain::Enqueued;
use crate::domain::Limits;
use crate::intake::Intake;
use crate::metrics::Metrics;
use crate::pb;

/// `OutboxService`: validates, then hands events to the group commit.
pub struct OutboxApi {
    intake: Intake,
    limits: Limits,
    metrics: Option<Metrics>,
}

impl OutboxApi {
    /// The service over `intake`, validating against `limits`.
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
        let state = convert::tracestate(request.metadata());
        let mut event = convert::enqueue_request(request.into_inner(), &self.limits)?;
        convert::attach_trace(&mut event, trace.as_deref(), state.as_deref());
        self.intake
            .check_records(std::slice::from_ref(&event), |_| "event.payload".into())
            .await?;
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
        let state = convert::tracestate(request.metadata());
        let mut events = convert::enqueue_batch_request(request.into_inner(), &self.limits)?;
        for e in &mut events {
            convert::attach_trace(e, trace.as_deref(), state.as_deref());
        }
        self.intake
            .check_records(&events, |i| format!("events[{i}].payload"))
            .await?;
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

/// `OutboxService` with a decoding limit per method: an `Enqueue` carries one event (its
/// largest payload, key and headers plus slack), an `EnqueueBatch` up to
/// `max_batch_bytes`. tonic checks a limit per service, against the length prefix of
/// the message before buffering it, so this routes each method to a copy of the service
/// with its own limit, and turns tonic's `OUT_OF_RANGE` into `RESOURCE_EXHAUSTED` naming
/// the setting.
#[derive(Clone)]
pub struct OutboxLimits {
    single: pb::outbox_service_server::OutboxServiceServer<OutboxApi>,
    batch: pb::outbox_service_server::OutboxServiceServer<OutboxApi>,
    single_limit: usize,
    batch_limit: usize,
}

impl OutboxLimits {
    /// The service with its per-method request size limits.
    pub fn new(api: OutboxApi, single_limit: usize, batch_limit: usize) -> Self {
        use pb::outbox_service_server::OutboxServiceServer;
        let api = std::sync::Arc::new(api);
        OutboxLimits {
            single: super::compressed!(
                OutboxServiceServer::from_arc(api.clone()).max_decoding_message_size(single_limit)
            ),
            batch: super::compressed!(
                OutboxServiceServer::from_arc(api).max_decoding_message_size(batch_limit)
            ),
            single_limit,
            batch_limit,
        }
    }
}

impl tonic::server::NamedService for OutboxLimits {
    const NAME: &'static str =
        <pb::outbox_service_server::OutboxServiceServer<OutboxApi> as tonic::server::NamedService>::NAME;
}

type HttpResponse = tonic::codegen::http::Response<tonic::body::Body>;

impl tower::Service<tonic::codegen::http::Request<tonic::body::Body>> for OutboxLimits {
    type Response = HttpResponse;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<HttpResponse, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        // The generated services are always ready.
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        let batch = req.uri().path().ends_with("/EnqueueBatch");
        let (mut svc, limit, what) = if batch {
            (
                self.batch.clone(),
                self.batch_limit,
                "EnqueueBatch request; the limit is MAILROOM_MAX_BATCH_BYTES",
            )
        } else {
            (
                self.single.clone(),
                self.single_limit,
                "Enqueue request (one event); the limit follows MAILROOM_MAX_PAYLOAD_BYTES and \
                 MAILROOM_MAX_HEADER_BYTES",
            )
        };
        Box::pin(async move {
            let resp = tower::Service::call(&mut svc, req).await?;
            Ok(too_large_is_resource_exhausted(resp, limit, what))
        })
    }
}

/// tonic refuses a message over the decoding limit with `OUT_OF_RANGE` (the only place
/// these services answer that code: no handler returns it); callers get
/// `RESOURCE_EXHAUSTED` naming the limit and the setting. The code decides, not tonic's
/// wording, which is not part of its API.
fn too_large_is_resource_exhausted(resp: HttpResponse, limit: usize, what: &str) -> HttpResponse {
    match Status::from_header_map(resp.headers()) {
        Some(s) if s.code() == tonic::Code::OutOfRange => super::status::too_large(
            format!("the request is over the {limit}-byte limit of an {what}"),
            limit,
        )
        .into_http(),
        _ => resp,
    }
}

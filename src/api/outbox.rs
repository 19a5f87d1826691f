//! `mailroom.v1.OutboxService`: validate, hand to the group committer, answer.

use tonic::{Request, Response, Status};

use super::convert::{self, Limits};
use crate::intake::Intake;
use crate::pb;

pub struct OutboxApi {
    intake: Intake,
    limits: Limits,
}

impl OutboxApi {
    pub fn new(intake: Intake, limits: Limits) -> Self {
        OutboxApi { intake, limits }
    }
}

#[tonic::async_trait]
impl pb::outbox_service_server::OutboxService for OutboxApi {
    async fn enqueue(
        &self,
        request: Request<pb::EnqueueRequest>,
    ) -> Result<Response<pb::EnqueueResponse>, Status> {
        let event = convert::enqueue_request(request.into_inner(), &self.limits)?;
        let stored = self.intake.submit(vec![event], false).await?;
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
        let events = convert::enqueue_batch_request(request.into_inner(), &self.limits)?;
        let stored = self.intake.submit(events, true).await?;
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

//! `mailroom.v1.InboxService`: push messages into a subscription's inbox; list
//! subscriptions.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::convert;
use crate::domain::Limits;
use crate::error::{Error, FieldViolation};
use crate::inbox::Inbox;
use crate::pb;
use crate::pb::time::to_duration;

/// `InboxService` over the inbox's middle layer.
pub struct InboxApi {
    inbox: Arc<Inbox>,
    limits: Limits,
}

impl InboxApi {
    /// The service for `inbox`, validating messages against `limits`.
    pub fn new(inbox: Arc<Inbox>, limits: Limits) -> Self {
        InboxApi { inbox, limits }
    }
}

#[tonic::async_trait]
impl pb::inbox_service_server::InboxService for InboxApi {
    async fn receive(
        &self,
        request: Request<pb::ReceiveRequest>,
    ) -> Result<Response<pb::ReceiveResponse>, Status> {
        let principal = crate::access::Principal::of(request.extensions());
        let trace = convert::traceparent(request.metadata());
        let state = convert::tracestate(request.metadata());
        let r = request.into_inner();
        // Before the lookup: a token limited to some subscriptions learns nothing about
        // the names of others.
        principal.check_subscription(&r.subscription)?;
        if r.subscription.is_empty() {
            return Err(Error::invalid("subscription", "is required").into());
        }
        let sub = self.inbox.subscription(&r.subscription)?;
        let mut v = Vec::new();
        if !sub.accepts_topic(&r.topic) {
            // A handler trusts that a message of its subscription is of one of its topics.
            v.push(FieldViolation::new(
                "topic",
                "is not one of the subscription's topics",
            ));
        }
        if r.message_id.is_empty() || r.message_id.len() > 256 {
            v.push(FieldViolation::new(
                "message_id",
                "is required, at most 256 bytes",
            ));
        }
        if r.message_id.contains('\0') {
            v.push(FieldViolation::new(
                "message_id",
                "must not contain NUL characters",
            ));
        }
        // The rest of a message follows the outbox's event rules.
        let as_event = pb::Event {
            topic: r.topic,
            key: r.key,
            payload: r.payload,
            headers: r.headers,
            r#type: r.r#type,
            ..Default::default()
        };
        let event = match convert::new_event(as_event, "message", &self.limits) {
            Ok(e) if v.is_empty() => e,
            Ok(_) => return Err(Error::InvalidArgument(v).into()),
            Err(mut more) => {
                for f in &mut more {
                    f.field = f.field.trim_start_matches("message.").to_string();
                }
                v.extend(more);
                return Err(Error::InvalidArgument(v).into());
            }
        };
        // Like Enqueue: the call's trace context travels with the message, unless the
        // message's own headers carry one.
        let mut event = event;
        convert::attach_trace(&mut event, trace.as_deref(), state.as_deref());
        let received = self.inbox.receive(sub, &r.message_id, event).await?;
        Ok(Response::new(pb::ReceiveResponse {
            id: received.id,
            duplicate: received.duplicate,
        }))
    }

    async fn list_subscriptions(
        &self,
        request: Request<pb::ListSubscriptionsRequest>,
    ) -> Result<Response<pb::ListSubscriptionsResponse>, Status> {
        let principal = crate::access::Principal::of(request.extensions());
        Ok(Response::new(pb::ListSubscriptionsResponse {
            subscriptions: self
                .inbox
                .subscriptions()
                .iter()
                .filter(|s| principal.may_use_subscription(&s.name))
                .map(|s| pb::Subscription {
                    name: s.name.clone(),
                    topics: s.topics.clone(),
                    group: s.group.clone(),
                    handler: s.handler.clone(),
                    handler_timeout: Some(to_duration(s.handler_timeout)),
                    // Config caps concurrency at 1024.
                    concurrency: u32::try_from(s.concurrency).unwrap_or(u32::MAX),
                    max_attempts: s.retry.max_attempts,
                    retry_base: Some(to_duration(s.retry.base)),
                    retry_cap: Some(to_duration(s.retry.cap)),
                })
                .collect(),
        }))
    }
}

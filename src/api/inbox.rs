//! `mailroom.v1.InboxService`: push messages into a subscription's inbox; list
//! subscriptions.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::convert;
use crate::config::SubscriptionConfig;
use crate::domain::Limits;
use crate::error::{Error, FieldViolation};
use crate::inbox::InboxHandles;
use crate::pb;
use crate::store::{Admission, Store};

pub struct InboxApi {
    store: Arc<dyn Store>,
    subscriptions: Vec<SubscriptionConfig>,
    limits: Limits,
    handles: InboxHandles,
}

impl InboxApi {
    pub fn new(
        store: Arc<dyn Store>,
        subscriptions: Vec<SubscriptionConfig>,
        limits: Limits,
        handles: InboxHandles,
    ) -> Self {
        InboxApi {
            store,
            subscriptions,
            limits,
            handles,
        }
    }
}

fn duration(d: std::time::Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

#[tonic::async_trait]
impl pb::inbox_service_server::InboxService for InboxApi {
    async fn receive(
        &self,
        request: Request<pb::ReceiveRequest>,
    ) -> Result<Response<pb::ReceiveResponse>, Status> {
        let principal = crate::api::auth::Principal::of(request.extensions());
        let r = request.into_inner();
        // Before the lookup: a token limited to some subscriptions learns nothing about
        // the names of others.
        principal.check_subscription(&r.subscription)?;
        let Some(sub) = self.subscriptions.iter().find(|s| s.name == r.subscription) else {
            return Err(if r.subscription.is_empty() {
                Error::invalid("subscription", "is required")
            } else {
                Error::NotFound(format!("no subscription named {:?}", r.subscription))
            }
            .into());
        };
        let mut v = Vec::new();
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
        // Receive's ids have a namespace of their own: they never meet a Kafka record's.
        let message = crate::domain::InboundMessage {
            message_id: crate::inbox::identity::rpc(&r.message_id),
            topic: event.topic,
            key: event.key,
            payload: event.payload,
            headers: event.headers,
            event_type: event.event_type,
            max_attempts: sub.retry.max_attempts,
            failure: None,
        };
        let admitted = self
            .store
            .receive(&sub.name, std::slice::from_ref(&message))
            .await
            .map_err(Error::from)?;
        let (id, duplicate) = match admitted[0] {
            Admission::Inserted(id) => {
                self.handles.wake(&sub.name);
                (id, false)
            }
            Admission::Duplicate(id) => (id, true),
            Admission::Conflict => {
                return Err(Error::Internal("inbox insert conflict".into()).into());
            }
        };
        Ok(Response::new(pb::ReceiveResponse { id, duplicate }))
    }

    async fn list_subscriptions(
        &self,
        request: Request<pb::ListSubscriptionsRequest>,
    ) -> Result<Response<pb::ListSubscriptionsResponse>, Status> {
        let principal = crate::api::auth::Principal::of(request.extensions());
        Ok(Response::new(pb::ListSubscriptionsResponse {
            subscriptions: self
                .subscriptions
                .iter()
                .filter(|s| principal.may_use_subscription(&s.name))
                .map(|s| pb::Subscription {
                    name: s.name.clone(),
                    topics: s.topics.clone(),
                    group: s.group.clone(),
                    handler: s.handler.clone(),
                    handler_timeout: Some(duration(s.handler_timeout)),
                    concurrency: s.concurrency as u32,
                    max_attempts: s.retry.max_attempts,
                    retry_base: Some(duration(s.retry.base)),
                    retry_cap: Some(duration(s.retry.cap)),
                })
                .collect(),
        }))
    }
}

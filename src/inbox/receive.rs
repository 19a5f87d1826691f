//! The inbox's middle layer for `InboxService`: which subscriptions there are, and a
//! pushed message stored deduplicated, its dispatcher woken. The API validates the
//! request and converts; the store runs the SQL.

use std::sync::Arc;

use super::{InboxHandles, SubscriptionConfig, identity};
use crate::domain::{EventId, InboundMessage, NewEvent};
use crate::error::Error;
use crate::store::{Admission, Store};

/// The subscriptions and what `Receive` does with a message.
pub struct Inbox {
    store: Arc<dyn Store>,
    subscriptions: Vec<SubscriptionConfig>,
    handles: InboxHandles,
}

/// A stored message: its id, and whether it was there already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// The inbox row's id.
    pub id: EventId,
    /// The message id was already in this subscription's inbox: nothing was stored.
    pub duplicate: bool,
}

impl Inbox {
    /// The inbox over `store`, with the running dispatchers' `handles`.
    pub fn new(
        store: Arc<dyn Store>,
        subscriptions: Vec<SubscriptionConfig>,
        handles: InboxHandles,
    ) -> Self {
        Inbox {
            store,
            subscriptions,
            handles,
        }
    }

    /// Every configured subscription.
    pub fn subscriptions(&self) -> &[SubscriptionConfig] {
        &self.subscriptions
    }

    /// The subscription named `name`: `NotFound` if there is none.
    pub fn subscription(&self, name: &str) -> Result<&SubscriptionConfig, Error> {
        self.subscriptions
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::NotFound(format!("no subscription named {name:?}")))
    }

    /// Stores a message pushed with `Receive`, deduplicated by `message_id` within the
    /// subscription, and wakes its dispatcher when it is new.
    pub async fn receive(
        &self,
        sub: &SubscriptionConfig,
        message_id: &str,
        event: NewEvent,
    ) -> Result<Received, Error> {
        // Receive's ids have a namespace of their own: they never meet a Kafka record's.
        let message = InboundMessage {
            message_id: identity::rpc(message_id),
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
            .await?;
        match admitted.first() {
            Some(Admission::Inserted(id)) => {
                self.handles.wake(&sub.name);
                Ok(Received {
                    id: *id,
                    duplicate: false,
                })
            }
            Some(Admission::Duplicate(id)) => Ok(Received {
                id: *id,
                duplicate: true,
            }),
            Some(Admission::Conflict) | None => {
                Err(Error::Internal("inbox insert conflict".into()))
            }
        }
    }
}

//! Subscriber fakes: a `HandlerService` that records every call and answers as a
//! [`Script`] says, and the subscription configuration tests point at it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mailroom::inbox::SubscriptionConfig;
use mailroom::pb;
use mailroom::pb::handle_response::Outcome;
use mailroom::pb::inbox_service_client::InboxServiceClient;
use mailroom::relay::backoff::RetryPolicy;
use tonic::transport::Channel;

/// One call a [`Recorder`] received.
#[derive(Debug, Clone)]
pub struct Call {
    pub message_id: String,
    pub key: String,
    pub payload: String,
    pub attempt: u32,
    /// The `traceparent` gRPC metadata of the call.
    pub traceparent: Option<String>,
}

/// What a handler answers: an outcome (none: an empty response), or a gRPC error.
pub type Answer = Result<Option<Outcome>, tonic::Status>;

/// How a [`Recorder`] answers a call.
#[tonic::async_trait]
pub trait Script: Default + Send + Sync + 'static {
    /// The answer to `call`; `seen_before`: an earlier call carried its message id.
    async fn answer(&self, call: &Call, seen_before: bool) -> Answer;
}

/// A script that handles every message.
#[derive(Default)]
pub struct Accept;

#[tonic::async_trait]
impl Script for Accept {
    async fn answer(&self, _call: &Call, _seen_before: bool) -> Answer {
        Ok(Some(Outcome::Success(pb::HandleSuccess {})))
    }
}

/// A script that refuses every message (`HandleReject` with the reason "refused by the
/// handler"): each fails at its first attempt.
#[derive(Default)]
pub struct RejectAll;

#[tonic::async_trait]
impl Script for RejectAll {
    async fn answer(&self, _call: &Call, _seen_before: bool) -> Answer {
        Ok(Some(Outcome::Reject(pb::HandleReject {
            reason: "refused by the handler".into(),
        })))
    }
}

/// A subscriber that records its calls in order and answers them by its script.
#[derive(Default)]
pub struct Recorder<S> {
    calls: Arc<Mutex<Vec<Call>>>,
    script: Arc<S>,
}

impl<S> Clone for Recorder<S> {
    fn clone(&self) -> Self {
        let (calls, script) = (self.calls.clone(), self.script.clone());
        Recorder { calls, script }
    }
}

impl<S: Script> Recorder<S> {
    /// The calls so far, in the order they arrived.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Serves on 127.0.0.1:0; returns the URL.
    pub async fn serve(&self) -> String {
        super::serve_handler(self.clone()).await
    }
}

#[tonic::async_trait]
impl<S: Script> pb::handler_service_server::HandlerService for Recorder<S> {
    async fn handle(
        &self,
        req: tonic::Request<pb::HandleRequest>,
    ) -> Result<tonic::Response<pb::HandleResponse>, tonic::Status> {
        let md = req.metadata().get("traceparent");
        let traceparent = md.map(|v| v.to_str().unwrap().to_string());
        let r = req.into_inner();
        let call = Call {
            payload: String::from_utf8(r.payload).unwrap(),
            message_id: r.message_id,
            key: r.key,
            attempt: r.attempt,
            traceparent,
        };
        let seen_before = {
            let mut calls = self.calls.lock().unwrap();
            let seen = calls.iter().any(|c| c.message_id == call.message_id);
            calls.push(call.clone());
            seen
        };
        let outcome = self.script.answer(&call, seen_before).await?;
        Ok(tonic::Response::new(pb::HandleResponse { outcome }))
    }
}

/// A subscriber that keeps every request whole and handles it.
#[derive(Clone, Default)]
pub struct Keeper {
    calls: Arc<Mutex<Vec<pb::HandleRequest>>>,
}

impl Keeper {
    /// The requests so far, in the order they arrived.
    pub fn calls(&self) -> Vec<pb::HandleRequest> {
        self.calls.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl pb::handler_service_server::HandlerService for Keeper {
    async fn handle(
        &self,
        r: tonic::Request<pb::HandleRequest>,
    ) -> Result<tonic::Response<pb::HandleResponse>, tonic::Status> {
        self.calls.lock().unwrap().push(r.into_inner());
        Ok(tonic::Response::new(pb::HandleResponse {
            outcome: Some(Outcome::Success(pb::HandleSuccess {})),
        }))
    }
}

/// A client of the service's `InboxService`.
pub async fn inbox_client(s: &super::Service) -> InboxServiceClient<Channel> {
    InboxServiceClient::new(super::channel(s.app.addr).await)
}

/// Receives `payload` for `sub` under message id `id`, on topic `direct` with `key`.
pub async fn receive(
    c: &mut InboxServiceClient<Channel>,
    sub: &str,
    id: &str,
    key: &str,
    payload: &str,
) -> pb::ReceiveResponse {
    receive_on(c, sub, id, "direct", key, payload.as_bytes()).await
}

/// Receives `payload` for `sub` under message id `id`, on `topic` with `key` (`""`: none).
pub async fn receive_on(
    c: &mut InboxServiceClient<Channel>,
    sub: &str,
    id: &str,
    topic: &str,
    key: &str,
    payload: &[u8],
) -> pb::ReceiveResponse {
    let request = pb::ReceiveRequest {
        subscription: sub.into(),
        message_id: id.into(),
        topic: topic.into(),
        key: key.into(),
        payload: payload.to_vec(),
        ..Default::default()
    };
    c.receive(request).await.expect("receive").into_inner()
}

/// A subscription `name` of `topics` (none: fed by `Receive` only) in a group of its own,
/// handled at `handler` within 300 ms, retried after a minute, five attempts.
pub fn subscription(name: &str, topics: &[&str], handler: &str) -> SubscriptionConfig {
    let retry = RetryPolicy {
        base: Duration::from_secs(60),
        cap: Duration::from_secs(600),
        max_attempts: 5,
    };
    let group = format!("g-{name}-{}", uuid::Uuid::new_v4().simple());
    let topics = topics.iter().map(|t| t.to_string()).collect();
    SubscriptionConfig {
        name: name.into(),
        topics,
        group,
        handler: handler.into(),
        handler_timeout: Duration::from_millis(300),
        concurrency: 4,
        retry,
        handler_tls: Default::default(),
        handler_token: None,
        dead_letter_topic: None,
        handler_max_defer: Duration::from_secs(86_400),
    }
}

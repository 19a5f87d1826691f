//! The inbox's sink: hands each message to the subscriber's `HandlerService.Handle` and
//! turns the answer into the relay engine's delivery outcomes. Lines (keys) run
//! concurrently up to the subscription's concurrency; within a line, one message at a
//! time, in order, stopping at the first that is not handled.
//!
//! | handler answer | outcome |
//! |---|---|
//! | success (or an empty response) | completed |
//! | retry, counted | attempt spent; due at `not_before` or after the backoff |
//! | retry, not counted | no attempt spent; due at `not_before` (or in 1 s); still holds its key |
//! | reject | failed at once, with the reason |
//! | gRPC `UNAVAILABLE`, connection refused or reset | transient: nothing spent, the cycle stops |
//! | timeout, any other gRPC status | counted |

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::domain::StoredEvent;
use crate::metrics::Latency;
use crate::pb;
use crate::pb::handler_service_client::HandlerServiceClient;
use crate::sink::{Delivery, Failure, Sink};

/// Wait before an uncounted retry that named no time.
const DEFER_DEFAULT: Duration = Duration::from_secs(1);

pub struct HandlerSink {
    client: HandlerServiceClient<Channel>,
    subscription: String,
    timeout: Duration,
    /// Handle calls in flight at most, shared by every cycle of the dispatcher (cycles
    /// overlap while a slow line finishes).
    slots: tokio::sync::Semaphore,
    latency: Arc<Latency>,
}

impl HandlerSink {
    /// Connects lazily: a handler that is down is a transient failure at delivery time,
    /// not a start-up error.
    pub fn new(
        subscription: &str,
        url: &str,
        timeout: Duration,
        concurrency: usize,
    ) -> Result<Self, tonic::transport::Error> {
        let channel = Endpoint::from_shared(url.to_string())?
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .connect_lazy();
        Ok(HandlerSink {
            client: HandlerServiceClient::new(channel),
            subscription: subscription.to_string(),
            timeout,
            slots: tokio::sync::Semaphore::new(concurrency.max(1)),
            latency: Arc::new(Latency::default()),
        })
    }

    /// The histogram of Handle call durations.
    pub fn latency(&self) -> Arc<Latency> {
        self.latency.clone()
    }

    async fn handle(&self, e: &StoredEvent) -> Delivery {
        let span = tracing::info_span!(
            "handle",
            subscription = %self.subscription,
            inbox_id = e.id,
            traceparent = e.headers.get("traceparent").map(String::as_str).unwrap_or("")
        );
        let req = pb::HandleRequest {
            message_id: e.idempotency_key.clone().unwrap_or_default(),
            inbox_id: e.id,
            subscription: self.subscription.clone(),
            topic: e.topic.clone(),
            key: e.key.clone().unwrap_or_default(),
            payload: e.payload.clone(),
            headers: e.headers.clone().into_iter().collect(),
            r#type: e.event_type.clone().unwrap_or_default(),
            attempt: e.attempts + 1,
        };
        let mut req = tonic::Request::new(req);
        // Propagate the producer's trace context to the subscriber.
        if let Some(tp) = e.headers.get("traceparent").and_then(|v| v.parse().ok()) {
            req.metadata_mut().insert("traceparent", tp);
        }
        let mut client = self.client.clone();
        crate::telemetry::join_trace(&span, e.headers.get("traceparent").map(String::as_str));
        let call = tracing::Instrument::instrument(client.handle(req), span);
        let started = std::time::Instant::now();
        let answer = tokio::time::timeout(self.timeout, call).await;
        self.latency.observe(started.elapsed());
        match answer {
            Err(_) => Delivery::Failed(Failure::Counted {
                error: format!("handler timed out after {} ms", self.timeout.as_millis()),
                retry_at: None,
            }),
            Ok(Err(status)) => Delivery::Failed(classify_status(&status)),
            Ok(Ok(resp)) => outcome(resp.into_inner()),
        }
    }

    /// One line, once one of the `concurrency` slots is free.
    async fn line_in_slot(&self, line: &[&StoredEvent], stop: &AtomicBool) -> Vec<Delivery> {
        let _slot = self.slots.acquire().await.expect("semaphore open");
        self.line(line, stop).await
    }

    async fn line(&self, line: &[&StoredEvent], stop: &AtomicBool) -> Vec<Delivery> {
        let mut out = vec![Delivery::NotAttempted; line.len()];
        for (i, e) in line.iter().enumerate() {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let d = self.handle(e).await;
            let handled = d == Delivery::Delivered;
            if let Delivery::Failed(f) = &d
                && f.is_transient()
            {
                // The handler looks down: start nothing new this cycle.
                stop.store(true, Ordering::Relaxed);
            }
            out[i] = d;
            if !handled {
                break;
            }
        }
        out
    }
}

/// A gRPC error from the handler: unreachable is the environment's fault, anything else
/// the message's.
pub fn classify_status(status: &tonic::Status) -> Failure {
    let error = format!("handler: {:?}: {}", status.code(), status.message());
    match status.code() {
        tonic::Code::Unavailable => Failure::Transient { error },
        // A google.rpc.RetryInfo in the status is honoured: not before its delay.
        _ => Failure::Counted {
            error,
            retry_at: crate::api::status::retry_delay(status)
                .and_then(|d| chrono::Duration::from_std(d).ok())
                .map(|d| chrono::Utc::now() + d),
        },
    }
}

fn outcome(resp: pb::HandleResponse) -> Delivery {
    use pb::handle_response::Outcome;
    let time =
        |t: Option<prost_types::Timestamp>| t.as_ref().and_then(crate::api::convert::timestamp);
    match resp.outcome {
        None | Some(Outcome::Success(_)) => Delivery::Delivered,
        Some(Outcome::Reject(r)) => Delivery::Failed(Failure::Rejected {
            error: format!("rejected by handler: {}", r.reason),
        }),
        Some(Outcome::Retry(r)) if r.count_attempt => Delivery::Failed(Failure::Counted {
            error: format!("retry requested by handler: {}", r.reason),
            retry_at: time(r.not_before),
        }),
        Some(Outcome::Retry(r)) => Delivery::Failed(Failure::Deferred {
            error: format!("deferred by handler: {}", r.reason),
            retry_at: time(r.not_before).unwrap_or_else(|| chrono::Utc::now() + DEFER_DEFAULT),
        }),
    }
}

#[async_trait::async_trait]
impl Sink for HandlerSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        let stop = AtomicBool::new(false);
        futures::future::join_all(lines.iter().map(|l| self.line_in_slot(l, &stop))).await
    }

    async fn deliver_each(&self, lines: &[Vec<&StoredEvent>], done: crate::sink::LineDone<'_>) {
        use futures::StreamExt;
        let stop = AtomicBool::new(false);
        let mut running: futures::stream::FuturesUnordered<_> = lines
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let stop = &stop;
                async move { (i, self.line_in_slot(l, stop).await) }
            })
            .collect();
        while let Some((i, d)) = running.next().await {
            done(i, d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::handle_response::Outcome;

    #[test]
    fn answers_map_to_outcomes() {
        assert_eq!(outcome(pb::HandleResponse::default()), Delivery::Delivered);
        let reject = outcome(pb::HandleResponse {
            outcome: Some(Outcome::Reject(pb::HandleReject {
                reason: "bad".into(),
            })),
        });
        assert!(matches!(reject, Delivery::Failed(Failure::Rejected { .. })));
        let counted = outcome(pb::HandleResponse {
            outcome: Some(Outcome::Retry(pb::HandleRetry {
                not_before: None,
                count_attempt: true,
                reason: "busy".into(),
            })),
        });
        assert!(matches!(
            counted,
            Delivery::Failed(Failure::Counted { retry_at: None, .. })
        ));
        let deferred = outcome(pb::HandleResponse {
            outcome: Some(Outcome::Retry(pb::HandleRetry {
                not_before: Some(prost_types::Timestamp {
                    seconds: 4_000_000_000,
                    nanos: 0,
                }),
                count_attempt: false,
                reason: String::new(),
            })),
        });
        match deferred {
            Delivery::Failed(Failure::Deferred { retry_at, .. }) => {
                assert_eq!(retry_at.timestamp(), 4_000_000_000)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unavailable_is_transient_and_the_rest_counts() {
        assert!(classify_status(&tonic::Status::unavailable("down")).is_transient());
        // The handler's RetryInfo sets the next attempt.
        let mut d = tonic_types::ErrorDetails::new();
        d.set_retry_info(Some(std::time::Duration::from_secs(30)));
        let s = <tonic::Status as tonic_types::StatusExt>::with_error_details(
            tonic::Code::ResourceExhausted,
            "slow down",
            d,
        );
        match classify_status(&s) {
            Failure::Counted {
                retry_at: Some(t), ..
            } => {
                let wait = t - chrono::Utc::now();
                assert!(
                    wait > chrono::Duration::seconds(25) && wait <= chrono::Duration::seconds(30)
                );
            }
            other => panic!("{other:?}"),
        }
        for s in [
            tonic::Status::internal("x"),
            tonic::Status::deadline_exceeded("x"),
            tonic::Status::invalid_argument("x"),
            tonic::Status::unimplemented("x"),
        ] {
            assert!(!classify_status(&s).is_transient());
        }
    }
}

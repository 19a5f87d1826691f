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
//! | gRPC `UNAVAILABLE`, connection refused or reset, and a probe of the handler fails | transient: nothing spent, the cycle stops |
//! | the same, but the handler answers a probe right after | the failure follows the message: transient the first time, counted from the [`POISON_STRIKES`]th in a row; after its first strike the message is called alone, so that a crash another message causes is not counted against it |
//! | timeout, and a probe of the handler fails (a vanished host, a partition) | transient |
//! | timeout while the handler answers a probe | counted |
//! | `UNAUTHENTICATED`, `PERMISSION_DENIED` (a rotated token: the operator's fault) | transient; counted in `mailroom_inbox_handler_auth_refused`, logged once per change |
//! | any other gRPC status | counted |
//!
//! The probe is a `grpc.health.v1.Health/Check` on the handler's channel, bounded by
//! [`PROBE_TIMEOUT`]: any gRPC answer (even `UNIMPLEMENTED`) shows the handler's server
//! is up, so a crash that follows one message (a poison message) ends in `failed`
//! after its attempts, while a handler that is really down spends nothing. The channel
//! keeps HTTP/2 and TCP keepalives, so a host that vanishes without a reset is found
//! dead and redialled rather than waited on.
//!
//! Each call has a client span of its own, [`HANDLE_SPAN`] (OpenTelemetry RPC
//! conventions, with the message's `messaging.*` attributes), a child of the message's
//! stored trace context (`traceparent` and `tracestate` headers); the call's
//! `traceparent` metadata names that span as the subscriber's parent and its
//! `tracestate` is the stored one. Without span export the stored headers travel on
//! unchanged. The request's `headers` field is the message's headers as stored, less
//! mailroom's exact-bytes entries, which arrive decoded as `record_headers` and
//! `record_key` (`domain::headers`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::domain::StoredEvent;
use crate::domain::headers;
use crate::pb;
use crate::pb::handler_service_client::HandlerServiceClient;
use crate::relay::Latency;
use crate::sink::{Delivery, Failure, Sink};

/// The handler call's span name (OpenTelemetry RPC conventions: `package.Service/Method`).
pub const HANDLE_SPAN: &str = "mailroom.v1.HandlerService/Handle";

/// Transport failures of one message in a row, each followed by a probe the handler
/// answered, after which they count: the first may be a coincidence (a handler
/// restarting while the message was in flight); the second follows the message.
pub const POISON_STRIKES: u32 = 2;

/// How long the probe after a failure waits for the handler to answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// HTTP/2 PING interval on the handler's channel, and how long a PING may go unanswered.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// TCP keepalive on the handler's connection.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// Messages remembered with strikes at most: a bound, cleared when reached.
const SUSPECTS_MAX: usize = 10_000;

/// Wait before an uncounted retry that named no time.
const DEFER_DEFAULT: Duration = Duration::from_secs(1);

/// Delivers a subscription's inbox messages to its `HandlerService` over gRPC.
pub struct HandlerSink {
    client: HandlerServiceClient<Channel>,
    subscription: String,
    /// The handler's host and port, for the client span (`server.address`, `server.port`).
    server: (String, u16),
    timeout: Duration,
    /// `authorization: Bearer …` sent with every call, when configured.
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// Latest `retry.not_before` honoured, from now.
    max_defer: Duration,
    /// Handle calls in flight at most, shared by every cycle of the dispatcher (cycles
    /// overlap while a slow line finishes).
    slots: tokio::sync::Semaphore,
    latency: Arc<Latency>,
    /// The probe: the handler's gRPC health service, on the same channel.
    health: tonic_health::pb::health_client::HealthClient<Channel>,
    /// Transport failures in a row per inbox id, while the handler answered probes.
    strikes: Mutex<HashMap<i64, u32>>,
    /// A suspect (a message with a strike) is called alone: a crash that takes the
    /// connection down fails every call in flight on it, so a strike from a call that
    /// had company may belong to another message. Other calls share the lock.
    alone: tokio::sync::RwLock<()>,
    /// Calls the handler refused with `UNAUTHENTICATED`/`PERMISSION_DENIED`.
    auth_refused: Arc<AtomicU64>,
    /// Whether the last answer was an auth refusal (logged once per change).
    refusing: AtomicBool,
}

/// How a call ended, before the probe decides what it costs.
enum CallEnd {
    /// The handler answered: what it costs.
    Answered(Delivery),
    /// The handler refused our credentials.
    AuthRefused(String),
    /// No answer from the handler: a transport failure, or a timeout.
    NoAnswer { error: String, timed_out: bool },
}

impl HandlerSink {
    /// Connects lazily: a handler that is down is a transient failure at delivery time,
    /// not a start-up error. An `https://` handler gets TLS (the subscription's CA or the
    /// webpki roots, and its client certificate when one is set); the TLS files are read
    /// here, so a missing file stops the start-up.
    pub fn new(sub: &super::SubscriptionConfig) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let mut endpoint = Endpoint::from_shared(sub.handler.clone())
            .with_context(|| format!("subscription {}: handler URL", sub.name))?
            .connect_timeout(sub.handler_timeout.min(Duration::from_secs(5)))
            // A host that vanishes without a reset is found dead by its keepalives.
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_keepalive(Some(TCP_KEEPALIVE));
        if sub.handler.starts_with("https://") {
            let tls = sub
                .handler_tls
                .tonic()
                .with_context(|| format!("subscription {}", sub.name))?;
            endpoint = endpoint
                .tls_config(tls)
                .with_context(|| format!("subscription {}: handler TLS", sub.name))?;
        } else if sub.handler_tls != crate::tls::ClientTls::default() {
            anyhow::bail!(
                "subscription {}: handler_ca/handler_cert need an https:// handler",
                sub.name
            );
        }
        let authorization = match &sub.handler_token {
            None => None,
            Some(t) => Some(
                format!("Bearer {}", t.0)
                    .parse()
                    .map_err(|_| anyhow::anyhow!("subscription {}: handler token", sub.name))?,
            ),
        };
        let server = (
            endpoint.uri().host().unwrap_or("").to_string(),
            endpoint
                .uri()
                .port_u16()
                .unwrap_or(if endpoint.uri().scheme_str() == Some("https") {
                    443
                } else {
                    80
                }),
        );
        let channel = endpoint.connect_lazy();
        Ok(HandlerSink {
            client: HandlerServiceClient::new(channel.clone()),
            health: tonic_health::pb::health_client::HealthClient::new(channel),
            strikes: Mutex::new(HashMap::new()),
            alone: tokio::sync::RwLock::new(()),
            auth_refused: Arc::new(AtomicU64::new(0)),
            refusing: AtomicBool::new(false),
            subscription: sub.name.clone(),
            server,
            timeout: sub.handler_timeout,
            authorization,
            max_defer: sub.handler_max_defer,
            slots: tokio::sync::Semaphore::new(sub.concurrency.max(1)),
            latency: Arc::new(Latency::default()),
        })
    }

    /// The histogram of Handle call durations.
    pub fn latency(&self) -> Arc<Latency> {
        self.latency.clone()
    }

    /// Calls the handler refused with `UNAUTHENTICATED`/`PERMISSION_DENIED`.
    pub fn auth_refused(&self) -> Arc<AtomicU64> {
        self.auth_refused.clone()
    }

    /// Hands `e` to the handler, and decides what a failure costs (the table above).
    async fn handle(&self, e: &StoredEvent) -> Delivery {
        // A suspect waits until it is the only call in flight, and keeps the others out
        // until its answer (and probe) is in: its next strike is its own.
        let (_shared, _alone) = if self.is_suspect(e.id) {
            (None, Some(self.alone.write().await))
        } else {
            (Some(self.alone.read().await), None)
        };
        match self.call(e).await {
            CallEnd::Answered(d) => {
                self.forget(e.id);
                if self.refusing.swap(false, Ordering::Relaxed) {
                    tracing::info!(subscription = %self.subscription, "handler accepts mailroom's credentials again");
                }
                d
            }
            CallEnd::AuthRefused(error) => {
                self.auth_refused.fetch_add(1, Ordering::Relaxed);
                if !self.refusing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(subscription = %self.subscription, %error, "handler refuses mailroom's credentials: nothing is spent until it accepts them");
                }
                Delivery::Failed(Failure::Transient { error })
            }
            CallEnd::NoAnswer { error, timed_out } => {
                if !self.probe().await {
                    // Nobody answers: the handler (or the way to it) is down.
                    return Delivery::Failed(Failure::Transient {
                        error: format!("{error}; handler unreachable (probe unanswered)"),
                    });
                }
                if timed_out {
                    self.forget(e.id);
                    return Delivery::Failed(Failure::Counted {
                        error,
                        retry_at: None,
                    });
                }
                let strikes = self.strike(e.id);
                if strikes >= POISON_STRIKES {
                    Delivery::Failed(Failure::Counted {
                        error: format!(
                            "{error}; the handler failed on this message {strikes} times in a row while answering probes"
                        ),
                        retry_at: None,
                    })
                } else {
                    Delivery::Failed(Failure::Transient { error })
                }
            }
        }
    }

    /// Whether the handler's server answers a health check (any gRPC status but
    /// `UNAVAILABLE` is an answer) within [`PROBE_TIMEOUT`].
    async fn probe(&self) -> bool {
        let mut health = self.health.clone();
        let mut req = tonic::Request::new(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        });
        req.set_timeout(PROBE_TIMEOUT);
        match tokio::time::timeout(PROBE_TIMEOUT, health.check(req)).await {
            Err(_) => false,
            Ok(Ok(_)) => true,
            Ok(Err(s)) => !matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
            ),
        }
    }

    /// Whether inbox id `id` has a strike.
    fn is_suspect(&self, id: i64) -> bool {
        let s = self.strikes.lock().unwrap_or_else(|p| p.into_inner());
        !s.is_empty() && s.contains_key(&id)
    }

    /// One more strike against inbox id `id`; returns its strikes.
    fn strike(&self, id: i64) -> u32 {
        let mut s = self.strikes.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() >= SUSPECTS_MAX && !s.contains_key(&id) {
            s.clear();
        }
        let n = s.entry(id).or_insert(0);
        *n += 1;
        *n
    }

    fn forget(&self, id: i64) {
        let mut s = self.strikes.lock().unwrap_or_else(|p| p.into_inner());
        if !s.is_empty() {
            s.remove(&id);
        }
    }

    async fn call(&self, e: &StoredEvent) -> CallEnd {
        let message_id = e.idempotency_key.clone().unwrap_or_default();
        let stored_tp = e.headers.get("traceparent").map(String::as_str);
        let stored_ts = e.headers.get("tracestate").map(String::as_str);
        let span = self.span(e, &message_id, stored_tp);
        crate::telemetry::join_trace_state(&span, stored_tp, stored_ts);
        let req = self.request(e, message_id, &span, (stored_tp, stored_ts));
        let mut client = self.client.clone();
        let call = tracing::Instrument::instrument(client.handle(req), span.clone());
        let started = std::time::Instant::now();
        let answer = tokio::time::timeout(self.timeout, call).await;
        let elapsed = started.elapsed();
        self.latency.observe(elapsed);
        record_answer(&span, &answer);
        self.call_end(answer, elapsed)
    }

    /// A client span per call (OpenTelemetry RPC conventions), a child of the message's
    /// own trace context; the subscriber gets it as its parent.
    fn span(&self, e: &StoredEvent, message_id: &str, stored_tp: Option<&str>) -> tracing::Span {
        let span = tracing::info_span!(
            "handle",
            otel.name = HANDLE_SPAN,
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            rpc.system = tracing::field::Empty,
            rpc.system.name = tracing::field::Empty,
            rpc.service = tracing::field::Empty,
            rpc.method = tracing::field::Empty,
            rpc.grpc.status_code = tracing::field::Empty,
            rpc.response.status_code = tracing::field::Empty,
            server.address = %self.server.0,
            server.port = self.server.1,
            messaging.operation.type = "process",
            messaging.destination.name = %e.topic,
            messaging.destination.subscription.name = %self.subscription,
            messaging.message.id = %message_id,
            mailroom.outcome = tracing::field::Empty,
            subscription = %self.subscription,
            inbox_id = e.id,
            traceparent = stored_tp.unwrap_or("")
        );
        crate::telemetry::record_rpc(&span, "mailroom.v1.HandlerService", "Handle");
        span
    }

    /// The `Handle` request: the message, `grpc-timeout` (the subscriber knows when
    /// mailroom stops waiting), the subscription's token and the trace context.
    fn request(
        &self,
        e: &StoredEvent,
        message_id: String,
        span: &tracing::Span,
        (stored_tp, stored_ts): (Option<&str>, Option<&str>),
    ) -> tonic::Request<pb::HandleRequest> {
        let view = headers::for_handler(&e.headers, e.key.as_deref());
        let req = pb::HandleRequest {
            message_id,
            inbox_id: e.id,
            subscription: self.subscription.clone(),
            topic: e.topic.clone(),
            key: e.key.clone().unwrap_or_default(),
            payload: e.payload.clone(),
            headers: view.map.into_iter().collect(),
            r#type: e.event_type.clone().unwrap_or_default(),
            attempt: e.attempts + 1,
            record_headers: view
                .exact
                .into_iter()
                .map(|h| pb::RecordHeader {
                    name: h.name,
                    value: h.value,
                })
                .collect(),
            record_key: view.key,
        };
        let mut req = tonic::Request::new(req);
        // `grpc-timeout`: the subscriber knows when mailroom stops waiting.
        req.set_timeout(self.timeout);
        if let Some(a) = &self.authorization {
            req.metadata_mut().insert("authorization", a.clone());
        }
        // The trace context: the client span's when spans are exported, else the stored
        // one unchanged; the stored `tracestate` either way.
        let trace = crate::telemetry::inject(span).unwrap_or_else(|| {
            [("traceparent", stored_tp), ("tracestate", stored_ts)]
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_string(), v?.to_string())))
                .collect()
        });
        for k in ["traceparent", "tracestate"] {
            if let Some(v) = trace.get(k).and_then(|v| v.parse().ok()) {
                req.metadata_mut().insert(k, v);
            }
        }
        req
    }

    /// What the call's answer (or its absence) means for the message.
    fn call_end(
        &self,
        answer: Result<
            Result<tonic::Response<pb::HandleResponse>, tonic::Status>,
            tokio::time::error::Elapsed,
        >,
        elapsed: Duration,
    ) -> CallEnd {
        let timed_out = || CallEnd::NoAnswer {
            error: format!("handler timed out after {} ms", self.timeout.as_millis()),
            timed_out: true,
        };
        match answer {
            Err(_) => timed_out(),
            // The `grpc-timeout` deadline, enforced by the client or the subscriber's
            // server, ends the call just before our own timer: the same outcome.
            Ok(Err(status))
                if matches!(
                    status.code(),
                    tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
                ) && elapsed + Duration::from_millis(50) >= self.timeout =>
            {
                timed_out()
            }
            // A connection dropped mid-call: `UNKNOWN` with the transport's error as its
            // source (a status the handler sent has none).
            Ok(Err(status))
                if status.code() == tonic::Code::Unknown
                    && std::error::Error::source(&status).is_some() =>
            {
                CallEnd::NoAnswer {
                    error: format!("handler: connection lost mid-call: {}", status.message()),
                    timed_out: false,
                }
            }
            Ok(Err(status)) => match classify_status(&status) {
                Failure::Transient { error } if status.code() == tonic::Code::Unavailable => {
                    CallEnd::NoAnswer {
                        error,
                        timed_out: false,
                    }
                }
                Failure::Transient { error } => CallEnd::AuthRefused(error),
                f => CallEnd::Answered(Delivery::Failed(f)),
            },
            Ok(Ok(resp)) => {
                CallEnd::Answered(cap_defer(outcome(resp.into_inner()), self.max_defer))
            }
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

/// Records the call's end on its client span: the gRPC code (a timeout is
/// `DEADLINE_EXCEEDED`), an error status for any code but OK (the client side of
/// OpenTelemetry's RPC conventions), and the handler's answer.
fn record_answer(
    span: &tracing::Span,
    answer: &Result<
        Result<tonic::Response<pb::HandleResponse>, tonic::Status>,
        tokio::time::error::Elapsed,
    >,
) {
    use pb::handle_response::Outcome;
    let code = match answer {
        Err(_) => tonic::Code::DeadlineExceeded,
        Ok(Err(s)) => s.code(),
        Ok(Ok(r)) => {
            let outcome = match &r.get_ref().outcome {
                None | Some(Outcome::Success(_)) => "success",
                Some(Outcome::Reject(_)) => "reject",
                Some(Outcome::Retry(r)) if r.count_attempt => "retry",
                Some(Outcome::Retry(_)) => "defer",
            };
            span.record("mailroom.outcome", outcome);
            tonic::Code::Ok
        }
    };
    crate::telemetry::record_rpc_code(span, code);
    if code != tonic::Code::Ok {
        span.record("otel.status_code", "ERROR");
    }
}

/// A gRPC error from the handler: unreachable, or refusing our credentials, is the
/// environment's (or the operator's) fault, anything else the message's. (`handle`
/// then probes an unreachable handler to tell a poison message from an outage.)
pub fn classify_status(status: &tonic::Status) -> Failure {
    let error = format!("handler: {:?}: {}", status.code(), status.message());
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
            Failure::Transient { error }
        }
        // A google.rpc.RetryInfo in the status is honoured: not before its delay.
        _ => Failure::Counted {
            error,
            retry_at: crate::pb::time::retry_delay(status)
                .and_then(|d| chrono::Duration::from_std(d).ok())
                .map(|d| chrono::Utc::now() + d),
        },
    }
}

fn outcome(resp: pb::HandleResponse) -> Delivery {
    use pb::handle_response::Outcome;
    let time = |t: Option<prost_types::Timestamp>| t.as_ref().and_then(crate::pb::time::timestamp);
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

/// Cuts a handler's `not_before` to at most `max` from now: a handler cannot park a key
/// (and everything behind it) for years.
fn cap_defer(d: Delivery, max: Duration) -> Delivery {
    let limit =
        chrono::Utc::now() + chrono::Duration::from_std(max).unwrap_or(chrono::Duration::MAX);
    match d {
        Delivery::Failed(Failure::Deferred { error, retry_at }) => {
            Delivery::Failed(Failure::Deferred {
                error,
                retry_at: retry_at.min(limit),
            })
        }
        Delivery::Failed(Failure::Counted {
            error,
            retry_at: Some(t),
        }) => Delivery::Failed(Failure::Counted {
            error,
            retry_at: Some(t.min(limit)),
        }),
        other => other,
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
    fn a_handlers_not_before_is_capped() {
        let far = chrono::Utc::now() + chrono::Duration::days(3650);
        let cap = Duration::from_secs(3600);
        for d in [
            Delivery::Failed(Failure::Deferred {
                error: String::new(),
                retry_at: far,
            }),
            Delivery::Failed(Failure::Counted {
                error: String::new(),
                retry_at: Some(far),
            }),
        ] {
            let at = match cap_defer(d, cap) {
                Delivery::Failed(Failure::Deferred { retry_at, .. }) => retry_at,
                Delivery::Failed(Failure::Counted {
                    retry_at: Some(t), ..
                }) => t,
                other => panic!("{other:?}"),
            };
            assert!(
                at <= chrono::Utc::now() + chrono::Duration::seconds(3601),
                "{at}"
            );
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

//! The admin commands: one AdminService call each, its answer rendered by `render`.

use std::time::Duration;

use anyhow::Context as _;
use tonic::Request;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

use super::render::*;
use super::{AdminArgs, AdminCommand};
use crate::pb;
use crate::pb::admin_service_client::AdminServiceClient;

pub(super) struct Client {
    pub(super) inner: AdminServiceClient<Channel>,
    token: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl Client {
    pub(super) fn req<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        if let Some(t) = &self.token {
            r.metadata_mut().insert("authorization", t.clone());
        }
        r
    }
}

/// A failed RPC: its gRPC code (for the exit status) and the message printed.
#[derive(Debug)]
pub struct RpcFailure {
    code: tonic::Code,
    message: String,
}

impl std::fmt::Display for RpcFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RpcFailure {}

/// The status as the command's error, its code named as gRPC names it
/// (`INVALID_ARGUMENT`). A transport failure (refused, TLS handshake) travels as the
/// status's source chain: each cause is named once.
fn rpc_error(s: tonic::Status) -> anyhow::Error {
    let mut message = format!("{}: {}", crate::pb::code_name(s.code()), s.message());
    let mut source = std::error::Error::source(&s);
    while let Some(e) = source {
        let cause = e.to_string();
        if !message.contains(&cause) {
            message.push_str(": ");
            message.push_str(&cause);
        }
        source = e.source();
    }
    anyhow::Error::new(RpcFailure {
        code: s.code(),
        message,
    })
}

/// The exit status of a failed command (docs/admin.md, "Exit status"): 3 not found, 4
/// refused (token or scope), 5 unreachable or unavailable, 6 a request the server
/// rejected (invalid, wrong state, conflict), 1 anything else. Usage errors exit with 2
/// (clap's).
pub fn exit_code(e: &anyhow::Error) -> u8 {
    use tonic::Code;
    if let Some(f) = e.chain().find_map(|c| c.downcast_ref::<RpcFailure>()) {
        return match f.code {
            Code::NotFound => 3,
            Code::Unauthenticated | Code::PermissionDenied => 4,
            Code::Unavailable | Code::DeadlineExceeded => 5,
            Code::InvalidArgument
            | Code::FailedPrecondition
            | Code::AlreadyExists
            | Code::OutOfRange => 6,
            _ => 1,
        };
    }
    if e.chain()
        .any(|c| c.downcast_ref::<tonic::transport::Error>().is_some())
    {
        return 5;
    }
    1
}

/// An RPC's answer, or its status as the command's error.
pub(super) fn answer<T>(r: Result<tonic::Response<T>, tonic::Status>) -> anyhow::Result<T> {
    r.map(tonic::Response::into_inner).map_err(rpc_error)
}

pub(super) fn operator(o: Option<String>) -> String {
    o.or_else(|| std::env::var("USER").ok()).unwrap_or_default()
}

/// A request id for an action: the operator's, or a new one.
pub(super) fn request_id(given: Option<String>) -> String {
    given.unwrap_or_else(|| uuid::Uuid::new_v4().to_string())
}

/// Connects to `--server` (TLS for https://) with the operator's token.
async fn connect(args: &AdminArgs) -> anyhow::Result<Client> {
    let mut endpoint = Channel::from_shared(args.server.clone())
        .context("--server is not a URL")?
        .connect_timeout(Duration::from_secs(5));
    let tls = crate::tls::ClientTls {
        ca: args.ca.clone(),
        cert: args.cert.clone(),
        key: args.client_key.clone().or_else(|| args.key.clone()),
    };
    if args.server.starts_with("https://") {
        endpoint = endpoint
            .tls_config(tls.tonic()?)
            .context("TLS configuration")?;
    } else if tls != crate::tls::ClientTls::default() {
        anyhow::bail!("--ca/--cert/--client-key need an https:// --server");
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to {}", args.server))?;
    let token = match args.token.as_deref().filter(|t| !t.is_empty()) {
        None => None,
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .context("the token must be printable ASCII")?,
        ),
    };
    Ok(Client {
        inner: AdminServiceClient::new(channel),
        token,
    })
}

/// What every command is about: the box (and subscription), and the output format.
pub(super) struct Target {
    pub(super) bx: i32,
    pub(super) inbox: bool,
    pub(super) sub: String,
    pub(super) json: bool,
}

/// Runs one admin command and returns what it prints.
pub async fn execute(args: AdminArgs) -> anyhow::Result<String> {
    let mut c = connect(&args).await?;
    let target = args.target()?;
    let t = Target {
        bx: target as i32,
        inbox: target == pb::Box::Inbox,
        sub: args.subscription.clone().unwrap_or_default(),
        json: args.json,
    };
    match args.command {
        command @ (AdminCommand::Pending { .. } | AdminCommand::Failed { .. }) => {
            backlog(&mut c, &t, command).await
        }
        command @ (AdminCommand::Requeue { .. }
        | AdminCommand::Cancel { .. }
        | AdminCommand::Republish { .. }) => actions(&mut c, &t, command).await,
        command @ (AdminCommand::Jobs { .. } | AdminCommand::Job { .. }) => {
            super::jobs::run(&mut c, &t, command).await
        }
        command @ (AdminCommand::Pause { .. }
        | AdminCommand::Resume { .. }
        | AdminCommand::Paused) => pauses(&mut c, &t, command).await,
        command => lookups(&mut c, &t, command).await,
    }
}

/// The backlog: pending keys, failed events.
async fn backlog(c: &mut Client, t: &Target, command: AdminCommand) -> anyhow::Result<String> {
    match command {
        AdminCommand::Pending {
            topic,
            key_prefix,
            blocked,
            oldest,
            limit,
            page_token,
        } => {
            let order = if oldest {
                pb::PendingOrder::Oldest
            } else {
                pb::PendingOrder::MostPending
            };
            let req = pb::ListPendingRequest {
                r#box: t.bx,
                subscription: t.sub.clone(),
                topic: topic.unwrap_or_default(),
                key_prefix: key_prefix.unwrap_or_default(),
                only_blocked: blocked,
                order: order as i32,
                page_size: limit,
                page_token: page_token.unwrap_or_default(),
            };
            let r = answer(c.inner.list_pending(c.req(req)).await)?;
            Ok(if t.json {
                pending_json(&r, t.inbox)
            } else {
                pending_table(&r, t.inbox)
            })
        }
        AdminCommand::Failed {
            filter,
            limit,
            page_token,
        } => {
            let req = pb::ListEventsRequest {
                r#box: t.bx,
                status: pb::EventStatus::Failed as i32,
                filter: Some(filter.to_pb(&t.sub)),
                page_size: limit,
                page_token: page_token.unwrap_or_default(),
            };
            let r = answer(c.inner.list_events(c.req(req)).await)?;
            Ok(failed_out(&r, t.json, t.inbox))
        }
        _ => unreachable!("dispatched by execute"),
    }
}

/// The actions (a dry run unless `--yes`): requeue, cancel.
async fn actions(c: &mut Client, t: &Target, command: AdminCommand) -> anyhow::Result<String> {
    match command {
        AdminCommand::Requeue {
            ids,
            filter,
            limit,
            yes,
            all,
            background,
            wait,
            request_id: rid,
            operator: who,
        } => {
            if background {
                let start = super::jobs::Start {
                    kind: pb::JobKind::Requeue,
                    ids,
                    filter: filter.to_pb(&t.sub),
                    reason: None,
                    yes,
                    all,
                    wait,
                    request_id: rid,
                    operator: who,
                };
                return super::jobs::start(c, t, start).await;
            }
            let req = pb::RequeueFailedRequest {
                r#box: t.bx,
                // Ids name events exactly: the filter flags are not sent with them.
                filter: ids.is_empty().then(|| filter.to_pb(&t.sub)),
                ids,
                limit: limit.unwrap_or(0),
                dry_run: !yes,
                operator: operator(who),
                all,
                request_id: request_id(rid),
            };
            let r = answer(c.inner.requeue_failed(c.req(req)).await)?;
            Ok(requeue_out(&r, t.json))
        }
        AdminCommand::Cancel {
            ids,
            filter,
            reason,
            yes,
            all,
            background,
            wait,
            request_id: rid,
            operator: who,
        } => {
            if background {
                let start = super::jobs::Start {
                    kind: pb::JobKind::Cancel,
                    ids,
                    filter: filter.to_pb(&t.sub),
                    reason: Some(reason),
                    yes,
                    all,
                    wait,
                    request_id: rid,
                    operator: who,
                };
                return super::jobs::start(c, t, start).await;
            }
            if filter.to_pb("") != pb::EventFilter::default() || all {
                anyhow::bail!("cancel takes ids; filter flags and --all need --background");
            }
            let req = pb::CancelEventsRequest {
                r#box: t.bx,
                ids,
                reason,
                dry_run: !yes,
                operator: operator(who),
                request_id: request_id(rid),
            };
            let r = answer(c.inner.cancel_events(c.req(req)).await)?;
            Ok(cancel_out(&r, !yes, t.json))
        }
        AdminCommand::Republish {
            ids,
            filter,
            limit,
            yes,
            all,
            background,
            wait,
            request_id: rid,
            operator: who,
        } => {
            if background {
                let start = super::jobs::Start {
                    kind: if t.inbox {
                        pb::JobKind::Redeliver
                    } else {
                        pb::JobKind::Republish
                    },
                    ids,
                    filter: filter.to_pb(&t.sub),
                    reason: None,
                    yes,
                    all,
                    wait,
                    request_id: rid,
                    operator: who,
                };
                return super::jobs::start(c, t, start).await;
            }
            if t.inbox {
                let req = pb::RedeliverMessagesRequest {
                    filter: ids.is_empty().then(|| filter.to_pb(&t.sub)),
                    ids,
                    limit: limit.unwrap_or(0),
                    confirm: yes,
                    operator: operator(who),
                    all,
                    request_id: request_id(rid),
                };
                let r = answer(c.inner.redeliver_messages(c.req(req)).await)?;
                let as_republish = pb::RepublishEventsResponse {
                    count: r.count,
                    sample_ids: r.sample_ids,
                    dry_run: r.dry_run,
                    audit_id: r.audit_id,
                    replayed: r.replayed,
                    copies: r.copies,
                };
                return Ok(republish_out(&as_republish, "redeliver", t.json));
            }
            let req = pb::RepublishEventsRequest {
                // Ids name events exactly: the filter flags are not sent with them.
                filter: ids.is_empty().then(|| filter.to_pb("")),
                ids,
                limit: limit.unwrap_or(0),
                confirm: yes,
                operator: operator(who),
                all,
                request_id: request_id(rid),
            };
            let r = answer(c.inner.republish_events(c.req(req)).await)?;
            Ok(republish_out(&r, "republish", t.json))
        }
        _ => unreachable!("dispatched by execute"),
    }
}

/// What `pause`, `resume` and `paused` act on: "topic", or "subscription" in the inbox.
fn what(t: &Target) -> &'static str {
    if t.inbox { "subscription" } else { "topic" }
}

/// The name a pause or resume acts on: the topic given, or `--subscription` (then no
/// topic may be given).
fn pause_target(t: &Target, topic: Option<String>) -> anyhow::Result<String> {
    match (t.inbox, topic) {
        (false, Some(topic)) => Ok(topic),
        (false, None) => anyhow::bail!("name the topic to act on (or --subscription NAME)"),
        (true, None) if !t.sub.is_empty() => Ok(t.sub.clone()),
        (true, None) => anyhow::bail!("name the subscription with --subscription NAME"),
        (true, Some(_)) => {
            anyhow::bail!("a subscription is paused as a whole: give --subscription NAME, no topic")
        }
    }
}

/// The paused topics: pause, resume, list.
async fn pauses(c: &mut Client, t: &Target, command: AdminCommand) -> anyhow::Result<String> {
    match command {
        AdminCommand::Pause {
            topic,
            reason,
            operator: who,
        } => {
            let name = pause_target(t, topic)?;
            let (pause, changed, audit_id) = if t.inbox {
                let req = pb::PauseSubscriptionRequest {
                    subscription: name,
                    reason,
                    operator: operator(who),
                };
                let r = answer(c.inner.pause_subscription(c.req(req)).await)?;
                let p = r.pause.as_ref().map(subscription_as_topic);
                (p, r.changed, r.audit_id)
            } else {
                let req = pb::PauseTopicRequest {
                    topic: name,
                    reason,
                    operator: operator(who),
                };
                let r = answer(c.inner.pause_topic(c.req(req)).await)?;
                (r.pause, r.changed, r.audit_id)
            };
            Ok(pause_out(
                pause.as_ref(),
                what(t),
                changed,
                audit_id,
                true,
                t.json,
            ))
        }
        AdminCommand::Resume {
            topic,
            operator: who,
        } => {
            let name = pause_target(t, topic)?;
            let (lifted, changed, audit_id) = if t.inbox {
                let req = pb::ResumeSubscriptionRequest {
                    subscription: name.clone(),
                    operator: operator(who),
                };
                let r = answer(c.inner.resume_subscription(c.req(req)).await)?;
                let p = r.lifted.as_ref().map(subscription_as_topic);
                (p, r.changed, r.audit_id)
            } else {
                let req = pb::ResumeTopicRequest {
                    topic: name.clone(),
                    operator: operator(who),
                };
                let r = answer(c.inner.resume_topic(c.req(req)).await)?;
                (r.lifted, r.changed, r.audit_id)
            };
            if !changed && !t.json {
                return Ok(format!(
                    "{} was not paused: nothing changed\n",
                    escape(&name)
                ));
            }
            Ok(pause_out(
                lifted.as_ref(),
                what(t),
                changed,
                audit_id,
                false,
                t.json,
            ))
        }
        AdminCommand::Paused if t.inbox => {
            let req = pb::ListPausedSubscriptionsRequest {};
            let r = answer(c.inner.list_paused_subscriptions(c.req(req)).await)?;
            let list: Vec<pb::TopicPause> =
                r.subscriptions.iter().map(subscription_as_topic).collect();
            Ok(paused_out(&list, "subscription", t.json))
        }
        AdminCommand::Paused => {
            let r = answer(
                c.inner
                    .list_paused_topics(c.req(pb::ListPausedTopicsRequest {}))
                    .await,
            )?;
            Ok(paused_out(&r.topics, "topic", t.json))
        }
        _ => unreachable!("dispatched by execute"),
    }
}

/// One event, the counts, the audit log.
async fn lookups(c: &mut Client, t: &Target, command: AdminCommand) -> anyhow::Result<String> {
    match command {
        AdminCommand::Get { id, payload } => {
            let req = pb::GetEventRequest {
                r#box: t.bx,
                id,
                include_payload: payload,
            };
            let r = answer(c.inner.get_event(c.req(req)).await)?;
            let e = r.event.context("server sent no event")?;
            Ok(if t.json {
                lines(&event_json(&e, payload, t.inbox))
            } else {
                event_text(&e, payload, t.inbox)
            })
        }
        AdminCommand::Stats => {
            let req = pb::GetStatsRequest {
                r#box: t.bx,
                subscription: t.sub.clone(),
            };
            let r = answer(c.inner.get_stats(c.req(req)).await)?;
            Ok(if t.json {
                stats_json(&r, t.inbox)
            } else {
                stats_table(&r, t.inbox)
            })
        }
        AdminCommand::Audit { limit, page_token } => {
            let req = pb::ListAuditRequest {
                page_size: limit,
                page_token: page_token.unwrap_or_default(),
            };
            let r = answer(c.inner.list_audit(c.req(req)).await)?;
            Ok(audit_out(&r, t.json))
        }
        _ => unreachable!("dispatched by execute"),
    }
}

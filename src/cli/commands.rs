//! The admin commands: one AdminService call each, its answer rendered by `render`.

use anyhow::Context as _;

use super::client::{Client, Target, answer, connect, operator, request_id};
use super::render::*;
use super::{AdminArgs, AdminCommand};
use crate::pb;

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
        command @ (AdminCommand::Rewind { .. } | AdminCommand::Rewinds { .. }) => {
            super::rewinds::run(&mut c, &t, command).await
        }
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
        AdminCommand::Get {
            id,
            idempotency_key,
            message_id,
            payload,
        } => {
            let req = pb::GetEventRequest {
                r#box: t.bx,
                id: id.unwrap_or(0),
                include_payload: payload,
                subscription: if message_id.is_some() {
                    t.sub.clone()
                } else {
                    String::new()
                },
                idempotency_key: idempotency_key.unwrap_or_default(),
                message_id: message_id.unwrap_or_default(),
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

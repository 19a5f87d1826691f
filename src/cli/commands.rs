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

struct Client {
    inner: AdminServiceClient<Channel>,
    token: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl Client {
    fn req<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        if let Some(t) = &self.token {
            r.metadata_mut().insert("authorization", t.clone());
        }
        r
    }
}

fn rpc_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

/// An RPC's answer, or its status as the command's error.
fn answer<T>(r: Result<tonic::Response<T>, tonic::Status>) -> anyhow::Result<T> {
    r.map(tonic::Response::into_inner).map_err(rpc_error)
}

fn operator(o: Option<String>) -> String {
    o.or_else(|| std::env::var("USER").ok()).unwrap_or_default()
}

/// Runs one admin command and returns what it prints.
pub async fn execute(args: AdminArgs) -> anyhow::Result<String> {
    let mut endpoint = Channel::from_shared(args.server.clone())
        .context("--server is not a URL")?
        .connect_timeout(Duration::from_secs(5));
    let tls = crate::tls::ClientTls {
        ca: args.ca.clone(),
        cert: args.cert.clone(),
        key: args.key.clone(),
    };
    if args.server.starts_with("https://") {
        endpoint = endpoint
            .tls_config(tls.tonic()?)
            .context("TLS configuration")?;
    } else if tls != crate::tls::ClientTls::default() {
        anyhow::bail!("--ca/--cert/--key need an https:// --server");
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
    let mut c = Client {
        inner: AdminServiceClient::new(channel),
        token,
    };
    let json_out = args.json;
    let target = args.target()?;
    let bx = target as i32;
    let inbox = target == pb::Box::Inbox;
    let sub = args.subscription.clone().unwrap_or_default();
    match args.command {
        AdminCommand::Pending {
            topic,
            key_prefix,
            blocked,
            oldest,
            limit,
            page_token,
        } => {
            let r = answer(
                c.inner
                    .list_pending(c.req(pb::ListPendingRequest {
                        r#box: bx,
                        subscription: sub,
                        topic: topic.unwrap_or_default(),
                        key_prefix: key_prefix.unwrap_or_default(),
                        only_blocked: blocked,
                        order: if oldest {
                            pb::PendingOrder::Oldest
                        } else {
                            pb::PendingOrder::MostPending
                        } as i32,
                        page_size: limit,
                        page_token: page_token.unwrap_or_default(),
                    }))
                    .await,
            )?;
            Ok(if json_out {
                pending_json(&r, inbox)
            } else {
                pending_table(&r, inbox)
            })
        }
        AdminCommand::Failed {
            filter,
            limit,
            page_token,
        } => {
            let r = answer(
                c.inner
                    .list_events(c.req(pb::ListEventsRequest {
                        r#box: bx,
                        status: pb::EventStatus::Failed as i32,
                        filter: Some(filter.to_pb(&sub)),
                        page_size: limit,
                        page_token: page_token.unwrap_or_default(),
                    }))
                    .await,
            )?;
            Ok(failed_out(&r, json_out, inbox))
        }
        AdminCommand::Get { id, payload } => {
            let r = answer(
                c.inner
                    .get_event(c.req(pb::GetEventRequest {
                        r#box: bx,
                        id,
                        include_payload: payload,
                    }))
                    .await,
            )?;
            let e = r.event.context("server sent no event")?;
            Ok(if json_out {
                lines(&event_json(&e, payload, inbox))
            } else {
                event_text(&e, payload, inbox)
            })
        }
        AdminCommand::Requeue {
            ids,
            filter,
            limit,
            yes,
            all,
            request_id,
            operator: who,
        } => {
            let req = pb::RequeueFailedRequest {
                r#box: bx,
                // Ids name events exactly: the filter flags are not sent with them.
                filter: if ids.is_empty() {
                    Some(filter.to_pb(&sub))
                } else {
                    None
                },
                ids,
                limit: limit.unwrap_or(0),
                dry_run: !yes,
                operator: operator(who),
                all,
                request_id: request_id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
            };
            let r = answer(c.inner.requeue_failed(c.req(req)).await)?;
            Ok(requeue_out(&r, json_out))
        }
        AdminCommand::Cancel {
            ids,
            reason,
            yes,
            request_id,
            operator: who,
        } => {
            let r = answer(
                c.inner
                    .cancel_events(c.req(pb::CancelEventsRequest {
                        r#box: bx,
                        ids,
                        reason,
                        dry_run: !yes,
                        operator: operator(who),
                        request_id: request_id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
                    }))
                    .await,
            )?;
            Ok(cancel_out(&r, !yes, json_out))
        }
        AdminCommand::Stats => {
            let r = answer(
                c.inner
                    .get_stats(c.req(pb::GetStatsRequest {
                        r#box: bx,
                        subscription: sub,
                    }))
                    .await,
            )?;
            Ok(if json_out {
                stats_json(&r, inbox)
            } else {
                stats_table(&r, inbox)
            })
        }
        AdminCommand::Audit { limit, page_token } => {
            let r = answer(
                c.inner
                    .list_audit(c.req(pb::ListAuditRequest {
                        page_size: limit,
                        page_token: page_token.unwrap_or_default(),
                    }))
                    .await,
            )?;
            Ok(audit_out(&r, json_out))
        }
    }
}

//! `mailroom admin …`: the operator's command line, a gRPC client of the AdminService of
//! a running server. Human tables by default, `--json` for scripts. `requeue` and
//! `cancel` only show what they would do unless given `--yes`. `--inbox` (or
//! `--box inbox`) points every command at the inbox, `--subscription NAME` narrows it to
//! one subscription; tables and JSON then show the subscription.

use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{Value, json};
use tonic::Request;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

use crate::api::convert::{timestamp, to_timestamp};
use crate::pb;
use crate::pb::admin_service_client::AdminServiceClient;

#[derive(Debug, Args)]
pub struct AdminArgs {
    /// Address of the running mailroom.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub server: String,
    /// Admin bearer token, if the server requires one.
    #[arg(long, env = "MAILROOM_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// CA certificates (PEM) that verify an `https://` server [default: webpki roots].
    #[arg(long, env = "MAILROOM_ADMIN_TLS_CA")]
    pub ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for a server that requires mTLS; needs --key.
    #[arg(long, env = "MAILROOM_ADMIN_TLS_CERT")]
    pub cert: Option<std::path::PathBuf>,
    /// Private key (PEM) of --cert.
    #[arg(long, env = "MAILROOM_ADMIN_TLS_KEY")]
    pub key: Option<std::path::PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Operate on the inbox (same as --box inbox).
    #[arg(long, global = true)]
    pub inbox: bool,
    /// The box to operate on [default: outbox].
    #[arg(long = "box", value_enum, global = true)]
    pub box_kind: Option<BoxArg>,
    /// Inbox only: only this subscription (implies --inbox). Used by pending, failed,
    /// requeue by filter, and stats.
    #[arg(long, global = true)]
    pub subscription: Option<String>,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BoxArg {
    Outbox,
    Inbox,
}

impl AdminArgs {
    /// The box the flags select: `--inbox`, `--box inbox` or `--subscription` mean the
    /// inbox; `--box outbox` together with either of the others is a mistake.
    fn target(&self) -> anyhow::Result<pb::Box> {
        let wants_inbox = self.inbox || self.subscription.is_some();
        match (self.box_kind, wants_inbox) {
            (Some(BoxArg::Outbox), true) => {
                anyhow::bail!("--box outbox contradicts --inbox / --subscription")
            }
            (Some(BoxArg::Inbox), _) | (None, true) => Ok(pb::Box::Inbox),
            (Some(BoxArg::Outbox), false) | (None, false) => Ok(pb::Box::Outbox),
        }
    }
}

#[derive(Debug, Args, Default)]
pub struct FilterArgs {
    /// Only this topic.
    #[arg(long)]
    pub topic: Option<String>,
    /// Only this key.
    #[arg(long)]
    pub key: Option<String>,
    /// Only this event type.
    #[arg(long = "type")]
    pub event_type: Option<String>,
    /// Only events whose last error contains this text.
    #[arg(long)]
    pub error_contains: Option<String>,
    /// Only events last updated at or after this RFC 3339 time.
    #[arg(long)]
    pub since: Option<DateTime<Utc>>,
    /// Only events last updated before this RFC 3339 time.
    #[arg(long)]
    pub until: Option<DateTime<Utc>>,
}

impl FilterArgs {
    fn to_pb(&self, subscription: &str) -> pb::EventFilter {
        pb::EventFilter {
            subscription: subscription.to_string(),
            topic: self.topic.clone().unwrap_or_default(),
            key: self.key.clone().unwrap_or_default(),
            r#type: self.event_type.clone().unwrap_or_default(),
            updated_after: self.since.map(to_timestamp),
            updated_before: self.until.map(to_timestamp),
            error_contains: self.error_contains.clone().unwrap_or_default(),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// The backlog grouped by (topic, key); by (subscription, topic, key) for the inbox.
    Pending {
        /// Only this topic.
        #[arg(long)]
        topic: Option<String>,
        /// Only keys starting with this prefix.
        #[arg(long)]
        key_prefix: Option<String>,
        /// Only keys whose head waits out a retry.
        #[arg(long)]
        blocked: bool,
        /// Oldest first (default: most pending first).
        #[arg(long)]
        oldest: bool,
        /// Keys per page.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Continue from a previous page.
        #[arg(long)]
        page_token: Option<String>,
    },
    /// Failed events, newest first.
    Failed {
        #[command(flatten)]
        filter: FilterArgs,
        /// Events per page.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Continue from a previous page.
        #[arg(long)]
        page_token: Option<String>,
    },
    /// One event with everything known about it.
    Get {
        id: i64,
        /// Include the payload (base64 in JSON, text when printable otherwise).
        #[arg(long)]
        payload: bool,
    },
    /// Put failed events back in line, by ids or by filter (dry run unless --yes).
    Requeue {
        /// Event ids; when given, no filter flags.
        ids: Vec<i64>,
        #[command(flatten)]
        filter: FilterArgs,
        /// At most this many events [server default: 1000].
        #[arg(long)]
        limit: Option<u32>,
        /// Act; without it only show what would be requeued.
        #[arg(long)]
        yes: bool,
        /// With no ids and no filter flags: yes, every failed event of the box.
        #[arg(long)]
        all: bool,
        /// Idempotency of the action: a repeated id acts once [default: a new UUID].
        #[arg(long)]
        request_id: Option<String>,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
    /// Move pending events to failed with a reason (dry run unless --yes).
    Cancel {
        /// Pending event ids.
        #[arg(required = true)]
        ids: Vec<i64>,
        /// Why; stored as the events' last error.
        #[arg(long)]
        reason: String,
        /// Act; without it only show what would be cancelled.
        #[arg(long)]
        yes: bool,
        /// Idempotency of the action: a repeated id acts once [default: a new UUID].
        #[arg(long)]
        request_id: Option<String>,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
    /// Counts by status and topic, oldest pending age, blocked keys.
    Stats,
    /// The audit log, newest first.
    Audit {
        /// Entries per page.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Continue from a previous page.
        #[arg(long)]
        page_token: Option<String>,
    },
}

/// Runs one admin command, printing to stdout.
pub async fn run(args: AdminArgs) -> anyhow::Result<()> {
    let out = execute(args).await?;
    print!("{out}");
    Ok(())
}

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

fn operator(o: Option<String>) -> String {
    o.or_else(|| std::env::var("USER").ok()).unwrap_or_default()
}

/// Runs one admin command and returns what it prints.
pub async fn execute(args: AdminArgs) -> anyhow::Result<String> {
    let mut endpoint = Channel::from_shared(args.server.clone())
        .context("--server is not a URL")?
        .connect_timeout(Duration::from_secs(5));
    let tls = crate::config::ClientTls {
        ca: args.ca.clone(),
        cert: args.cert.clone(),
        key: args.key.clone(),
    };
    if args.server.starts_with("https://") {
        endpoint = endpoint
            .tls_config(tls.tonic()?)
            .context("TLS configuration")?;
    } else if tls != crate::config::ClientTls::default() {
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
            let r = c
                .inner
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
                .await
                .map_err(rpc_error)?
                .into_inner();
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
            let r = c
                .inner
                .list_events(c.req(pb::ListEventsRequest {
                    r#box: bx,
                    status: pb::EventStatus::Failed as i32,
                    filter: Some(filter.to_pb(&sub)),
                    page_size: limit,
                    page_token: page_token.unwrap_or_default(),
                }))
                .await
                .map_err(rpc_error)?
                .into_inner();
            Ok(if json_out {
                lines(&json!({
                    "events": r.events.iter().map(|e| event_json(e, false, inbox)).collect::<Vec<_>>(),
                    "next_page_token": r.next_page_token,
                }))
            } else {
                events_table(&r, inbox)
            })
        }
        AdminCommand::Get { id, payload } => {
            let r = c
                .inner
                .get_event(c.req(pb::GetEventRequest {
                    r#box: bx,
                    id,
                    include_payload: payload,
                }))
                .await
                .map_err(rpc_error)?
                .into_inner();
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
            let r = c
                .inner
                .requeue_failed(c.req(req))
                .await
                .map_err(rpc_error)?
                .into_inner();
            Ok(if json_out {
                lines(&json!({
                    "dry_run": r.dry_run,
                    "count": r.count,
                    "sample_ids": r.sample_ids,
                    "audit_id": r.audit_id,
                }))
            } else if r.dry_run {
                format!(
                    "dry run: would requeue {} failed event(s){}\nrun again with --yes to requeue them\n",
                    r.count,
                    sample(&r.sample_ids, r.count)
                )
            } else {
                format!(
                    "requeued {} event(s){} (audit entry {})\n",
                    r.count,
                    sample(&r.sample_ids, r.count),
                    r.audit_id
                )
            })
        }
        AdminCommand::Cancel {
            ids,
            reason,
            yes,
            request_id,
            operator: who,
        } => {
            let r = c
                .inner
                .cancel_events(c.req(pb::CancelEventsRequest {
                    r#box: bx,
                    ids,
                    reason,
                    dry_run: !yes,
                    operator: operator(who),
                    request_id: request_id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
                }))
                .await
                .map_err(rpc_error)?
                .into_inner();
            Ok(if json_out {
                lines(&json!({
                    "dry_run": !yes,
                    "count": r.count,
                    "ids": r.ids,
                    "audit_id": r.audit_id,
                }))
            } else if !yes {
                format!(
                    "dry run: would cancel {} pending event(s): {}\nrun again with --yes to cancel them\n",
                    r.count,
                    join_ids(&r.ids)
                )
            } else {
                format!(
                    "cancelled {} event(s): {} (audit entry {})\n",
                    r.count,
                    join_ids(&r.ids),
                    r.audit_id
                )
            })
        }
        AdminCommand::Stats => {
            let r = c
                .inner
                .get_stats(c.req(pb::GetStatsRequest {
                    r#box: bx,
                    subscription: sub,
                }))
                .await
                .map_err(rpc_error)?
                .into_inner();
            Ok(if json_out {
                stats_json(&r, inbox)
            } else {
                stats_table(&r, inbox)
            })
        }
        AdminCommand::Audit { limit, page_token } => {
            let r = c
                .inner
                .list_audit(c.req(pb::ListAuditRequest {
                    page_size: limit,
                    page_token: page_token.unwrap_or_default(),
                }))
                .await
                .map_err(rpc_error)?
                .into_inner();
            Ok(if json_out {
                lines(&json!({
                    "entries": r.entries.iter().map(|a| json!({
                        "id": a.id,
                        "at": ts(a.at.as_ref()),
                        "actor": a.actor,
                        "action": a.action,
                        "box": box_name(a.r#box),
                        "selection": serde_json::from_str::<Value>(&a.selection).unwrap_or(Value::String(a.selection.clone())),
                        "count": a.count,
                        "principal": a.principal,
                        "request_id": a.request_id,
                    })).collect::<Vec<_>>(),
                    "next_page_token": r.next_page_token,
                }))
            } else {
                let mut t =
                    Table::new(&["ID", "AT", "ACTOR", "ACTION", "BOX", "COUNT", "SELECTION"]);
                for a in &r.entries {
                    t.row(vec![
                        a.id.to_string(),
                        ts(a.at.as_ref()).unwrap_or_default(),
                        a.actor.clone(),
                        a.action.clone(),
                        box_name(a.r#box).into(),
                        a.count.to_string(),
                        truncate(&a.selection, 80),
                    ]);
                }
                t.render() + &next_page(&r.next_page_token)
            })
        }
    }
}

fn lines(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("json");
    s.push('\n');
    s
}

fn ts(t: Option<&prost_types::Timestamp>) -> Option<String> {
    t.and_then(timestamp)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}

fn age_since(t: Option<&prost_types::Timestamp>) -> String {
    match t.and_then(timestamp) {
        None => "-".into(),
        Some(t) => age((Utc::now() - t).to_std().unwrap_or(Duration::ZERO)),
    }
}

/// In how long from now, `now` if due.
fn due_in(t: Option<&prost_types::Timestamp>) -> String {
    match t.and_then(timestamp) {
        None => "-".into(),
        Some(t) => match (t - Utc::now()).to_std() {
            Ok(d) if d >= Duration::from_secs(1) => format!("in {}", age(d)),
            _ => "now".into(),
        },
    }
}

/// A duration the way operators read it: `850ms`, `45s`, `3m12s`, `2h05m`, `3d4h`.
pub fn age(d: Duration) -> String {
    let s = d.as_secs();
    if s == 0 {
        format!("{}ms", d.as_millis())
    } else if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}d{}h", s / 86_400, (s % 86_400) / 3600)
    }
}

/// At most `max` characters, on one line, with `…` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    let one_line: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if one_line.chars().count() <= max {
        one_line
    } else {
        let mut t: String = one_line.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

fn join_ids(ids: &[i64]) -> String {
    ids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn sample(ids: &[i64], count: i64) -> String {
    if ids.is_empty() {
        String::new()
    } else if (ids.len() as i64) < count {
        format!(": {}, …", join_ids(ids))
    } else {
        format!(": {}", join_ids(ids))
    }
}

fn next_page(token: &str) -> String {
    if token.is_empty() {
        String::new()
    } else {
        format!("next page: --page-token {token}\n")
    }
}

fn box_name(b: i32) -> &'static str {
    match pb::Box::try_from(b) {
        Ok(pb::Box::Inbox) => "inbox",
        _ => "outbox",
    }
}

/// A plain text table: left-aligned columns, two spaces apart.
struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(header: &[&str]) -> Self {
        Table {
            rows: vec![header.iter().map(ToString::to_string).collect()],
        }
    }
    /// The same, led by a SUBSCRIPTION column when `inbox`.
    fn with_sub(inbox: bool, header: &[&str]) -> Self {
        let mut h = Vec::with_capacity(header.len() + 1);
        if inbox {
            h.push("SUBSCRIPTION");
        }
        h.extend_from_slice(header);
        Table::new(&h)
    }
    /// A row, led by `sub` when `inbox`.
    fn row_with_sub(&mut self, inbox: bool, sub: &str, mut r: Vec<String>) {
        if inbox {
            r.insert(0, sub.to_string());
        }
        self.rows.push(r);
    }
    fn row(&mut self, r: Vec<String>) {
        self.rows.push(r);
    }
    fn render(&self) -> String {
        let n = self.rows[0].len();
        let widths: Vec<usize> = (0..n)
            .map(|i| {
                self.rows
                    .iter()
                    .map(|r| r[i].chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for r in &self.rows {
            let mut line = String::new();
            for (i, cell) in r.iter().enumerate() {
                line.push_str(cell);
                if i + 1 < n {
                    let pad = widths[i] - cell.chars().count() + 2;
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

fn pending_table(r: &pb::ListPendingResponse, inbox: bool) -> String {
    let mut t = Table::with_sub(
        inbox,
        &[
            "TOPIC",
            "KEY",
            "PENDING",
            "OLDEST",
            "HEAD",
            "ATTEMPTS",
            "NEXT",
            "BLOCKED",
            "LAST ERROR",
        ],
    );
    for k in &r.keys {
        t.row_with_sub(
            inbox,
            &k.subscription,
            vec![
                k.topic.clone(),
                if k.key.is_empty() {
                    "(unkeyed)".into()
                } else {
                    k.key.clone()
                },
                k.pending.to_string(),
                age_since(k.oldest_created_at.as_ref()),
                k.head_id.to_string(),
                k.head_attempts.to_string(),
                due_in(k.head_next_attempt_at.as_ref()),
                if k.blocked { "yes" } else { "no" }.into(),
                truncate(&k.head_last_error, 60),
            ],
        );
    }
    format!(
        "{}total: {} pending in {} key(s), {} blocked\n{}",
        t.render(),
        r.total_pending,
        r.total_keys,
        r.total_blocked_keys,
        next_page(&r.next_page_token)
    )
}

fn pending_json(r: &pb::ListPendingResponse, inbox: bool) -> String {
    lines(&json!({
        "keys": r.keys.iter().map(|k| {
            let mut v = json!({
                "topic": k.topic,
                "key": k.key,
                "pending": k.pending,
                "oldest_created_at": ts(k.oldest_created_at.as_ref()),
                "head_id": k.head_id,
                "head_attempts": k.head_attempts,
                "head_next_attempt_at": ts(k.head_next_attempt_at.as_ref()),
                "head_last_error": k.head_last_error,
                "blocked": k.blocked,
            });
            if inbox {
                v["subscription"] = k.subscription.clone().into();
            }
            v
        }).collect::<Vec<_>>(),
        "total_pending": r.total_pending,
        "total_keys": r.total_keys,
        "total_blocked_keys": r.total_blocked_keys,
        "next_page_token": r.next_page_token,
    }))
}

fn status_name(s: i32) -> &'static str {
    match pb::EventStatus::try_from(s) {
        Ok(pb::EventStatus::Pending) => "pending",
        Ok(pb::EventStatus::Completed) => "completed",
        Ok(pb::EventStatus::Failed) => "failed",
        _ => "unknown",
    }
}

fn event_json(e: &pb::EventInfo, with_payload: bool, inbox: bool) -> Value {
    use base64::Engine as _;
    let mut v = json!({
        "id": e.id,
        "topic": e.topic,
        "key": e.key,
        "type": e.r#type,
        "status": status_name(e.status),
        "attempts": e.attempts,
        "max_attempts": e.max_attempts,
        "scheduled_at": ts(e.scheduled_at.as_ref()),
        "created_at": ts(e.created_at.as_ref()),
        "updated_at": ts(e.updated_at.as_ref()),
        "published_at": ts(e.published_at.as_ref()),
        "last_error": e.last_error,
        "payload_size": e.payload_size,
        "headers": e.headers,
        "idempotency_key": e.idempotency_key,
    });
    if inbox {
        v["subscription"] = e.subscription.clone().into();
        v["message_id"] = e.message_id.clone().into();
    }
    if with_payload {
        v["payload_base64"] = base64::engine::general_purpose::STANDARD
            .encode(&e.payload)
            .into();
    }
    v
}

fn event_text(e: &pb::EventInfo, with_payload: bool, inbox: bool) -> String {
    let mut headers: Vec<_> = e.headers.iter().collect();
    headers.sort();
    let mut out = String::new();
    let mut field = |k: &str, v: String| out.push_str(&format!("{k:<16}{v}\n"));
    field("id", e.id.to_string());
    if inbox {
        field("subscription", e.subscription.clone());
        field("message_id", e.message_id.clone());
    }
    field("topic", e.topic.clone());
    field("key", e.key.clone());
    field("type", e.r#type.clone());
    field("status", status_name(e.status).into());
    field("attempts", format!("{}/{}", e.attempts, e.max_attempts));
    field(
        "scheduled_at",
        ts(e.scheduled_at.as_ref()).unwrap_or_default(),
    );
    field(
        "created_at",
        format!(
            "{} ({} ago)",
            ts(e.created_at.as_ref()).unwrap_or_default(),
            age_since(e.created_at.as_ref())
        ),
    );
    field("updated_at", ts(e.updated_at.as_ref()).unwrap_or_default());
    field(
        "published_at",
        ts(e.published_at.as_ref()).unwrap_or_else(|| "-".into()),
    );
    field("last_error", e.last_error.clone());
    field("idempotency_key", e.idempotency_key.clone());
    field("payload_size", format!("{} bytes", e.payload_size));
    for (k, v) in headers {
        field("header", format!("{k}: {v}"));
    }
    if with_payload {
        field("payload", String::from_utf8_lossy(&e.payload).into_owned());
    }
    out
}

fn events_table(r: &pb::ListEventsResponse, inbox: bool) -> String {
    let mut header = vec!["ID"];
    if inbox {
        header.extend(["SUBSCRIPTION", "MESSAGE ID"]);
    }
    header.extend(["TOPIC", "KEY", "TYPE", "ATTEMPTS", "UPDATED", "LAST ERROR"]);
    let mut t = Table::new(&header);
    for e in &r.events {
        let mut row = vec![e.id.to_string()];
        if inbox {
            row.extend([e.subscription.clone(), e.message_id.clone()]);
        }
        row.extend([
            e.topic.clone(),
            e.key.clone(),
            e.r#type.clone(),
            format!("{}/{}", e.attempts, e.max_attempts),
            format!("{} ago", age_since(e.updated_at.as_ref())),
            truncate(&e.last_error, 60),
        ]);
        t.row(row);
    }
    t.render() + &next_page(&r.next_page_token)
}

fn stats_json(r: &pb::GetStatsResponse, inbox: bool) -> String {
    lines(&json!({
        "pending": r.pending,
        "completed": r.completed,
        "failed": r.failed,
        "oldest_pending_age_seconds": r.oldest_pending_age.as_ref()
            .map(|d| d.seconds as f64 + f64::from(d.nanos) / 1e9),
        "blocked_keys": r.blocked_keys,
        "topics": r.topics.iter().map(|t| {
            let mut v = json!({
                "topic": t.topic, "pending": t.pending, "completed": t.completed,
                "failed": t.failed,
            });
            if inbox {
                v["subscription"] = t.subscription.clone().into();
            }
            v
        }).collect::<Vec<_>>(),
    }))
}

fn stats_table(r: &pb::GetStatsResponse, inbox: bool) -> String {
    let oldest = r
        .oldest_pending_age
        .as_ref()
        .map(|d| {
            age(Duration::new(
                d.seconds.max(0) as u64,
                d.nanos.max(0) as u32,
            ))
        })
        .unwrap_or_else(|| "-".into());
    let mut t = Table::with_sub(inbox, &["TOPIC", "PENDING", "COMPLETED", "FAILED"]);
    for s in &r.topics {
        t.row_with_sub(
            inbox,
            &s.subscription,
            vec![
                s.topic.clone(),
                s.pending.to_string(),
                s.completed.to_string(),
                s.failed.to_string(),
            ],
        );
    }
    t.row_with_sub(
        inbox,
        "(all)",
        vec![
            "(all)".into(),
            r.pending.to_string(),
            r.completed.to_string(),
            r.failed.to_string(),
        ],
    );
    format!(
        "{}oldest pending: {oldest}\nblocked keys: {}\n",
        t.render(),
        r.blocked_keys
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_an_operator_writes_them() {
        assert_eq!(age(Duration::from_millis(850)), "850ms");
        assert_eq!(age(Duration::from_secs(45)), "45s");
        assert_eq!(age(Duration::from_secs(192)), "3m12s");
        assert_eq!(age(Duration::from_secs(2 * 3600 + 5 * 60)), "2h05m");
        assert_eq!(age(Duration::from_secs(3 * 86_400 + 4 * 3600)), "3d4h");
    }

    #[test]
    fn errors_are_truncated_to_one_line() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("a\nb", 10), "a b");
        assert_eq!(truncate("0123456789abc", 5), "0123…");
    }
}

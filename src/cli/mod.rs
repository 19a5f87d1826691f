//! `mailroom admin …`: the operator's command line, a gRPC client of the AdminService of
//! a running server. Human tables by default, `--json` for scripts. `requeue` and
//! `cancel` only show what they would do unless given `--yes`. `--inbox` (or
//! `--box inbox`) points every command at the inbox, `--subscription NAME` narrows it to
//! one subscription; tables and JSON then show the subscription.

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand, ValueEnum};

mod client;
mod commands;
mod jobs;
mod render;
mod rewinds;

pub use client::exit_code;
pub use commands::execute;
pub use render::{age, truncate};

use crate::pb;
use crate::pb::time::to_timestamp;

/// `mailroom admin`'s own options, parsed apart from the server's. The connection and
/// output options are global, as kubectl's and gh's are: they go before or after the
/// command (`mailroom admin stats --json`).
#[derive(Debug, Args)]
pub struct AdminArgs {
    /// Address of the running mailroom.
    #[arg(long, default_value = "http://127.0.0.1:50051", global = true)]
    pub server: String,
    /// Admin bearer token, if the server requires one.
    #[arg(
        long,
        env = "MAILROOM_ADMIN_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub token: Option<String>,
    /// CA certificates (PEM) that verify an `https://` server [default: webpki roots].
    #[arg(long, env = "MAILROOM_ADMIN_TLS_CA", global = true)]
    pub ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM) for a server that requires mTLS; needs --client-key.
    #[arg(long, env = "MAILROOM_ADMIN_TLS_CERT", global = true)]
    pub cert: Option<std::path::PathBuf>,
    /// Private key (PEM) of --cert.
    #[arg(long = "client-key", env = "MAILROOM_ADMIN_TLS_KEY", global = true)]
    pub client_key: Option<std::path::PathBuf>,
    /// --client-key, before the command only (`failed --key` filters by event key).
    #[arg(long, hide = true)]
    pub key: Option<std::path::PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
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
    /// The command to run.
    #[command(subcommand)]
    pub command: AdminCommand,
}

/// Which box a command acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
// No variant docs: clap would print them as value help and switch `--help` to its
// long form.
#[allow(missing_docs)]
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

/// The event filter of `failed`, `requeue` and `republish`.
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
    /// Only keys starting with this text.
    #[arg(long)]
    pub key_prefix: Option<String>,
    /// Only events created at or after this RFC 3339 time.
    #[arg(long)]
    pub created_since: Option<DateTime<Utc>>,
    /// Only events created before this RFC 3339 time.
    #[arg(long)]
    pub created_until: Option<DateTime<Utc>>,
    /// Only events with this header value, as NAME=VALUE (repeatable: every one must match).
    #[arg(long = "header", value_parser = header_pair)]
    pub headers: Vec<(String, String)>,
    /// Only the event with this idempotency key.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Inbox only: the message with this message id (e.g. `ce:1:<source>:<id>`).
    #[arg(long)]
    pub message_id: Option<String>,
}

/// A `--header NAME=VALUE` flag.
fn header_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, v)) if !n.is_empty() => Ok((n.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not NAME=VALUE")),
    }
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
            key_prefix: self.key_prefix.clone().unwrap_or_default(),
            created_after: self.created_since.map(to_timestamp),
            created_before: self.created_until.map(to_timestamp),
            headers: self.headers.iter().cloned().collect(),
            idempotency_key: self.idempotency_key.clone().unwrap_or_default(),
            message_id: self.message_id.clone().unwrap_or_default(),
        }
    }
}

/// The admin commands.
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
        /// Which failed events.
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
        /// The event's id; or name it by --idempotency-key (outbox) or --message-id
        /// (inbox).
        #[arg(required_unless_present_any = ["idempotency_key", "message_id"])]
        id: Option<i64>,
        /// Outbox: the event with this idempotency key.
        #[arg(long, conflicts_with = "id")]
        idempotency_key: Option<String>,
        /// Inbox: the message with this message id (with --subscription when several
        /// subscriptions hold one).
        #[arg(long, conflicts_with_all = ["id", "idempotency_key"])]
        message_id: Option<String>,
        /// Include the payload (base64 in JSON, text when printable otherwise).
        #[arg(long)]
        payload: bool,
    },
    /// Put failed events back in line, by ids or by filter (dry run unless --yes).
    Requeue {
        /// Event ids; when given, no filter flags.
        ids: Vec<i64>,
        /// Which failed events.
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
        /// Run as a background job over every matching event, however many (no ids;
        /// `--yes` starts it, without it a dry run counts them). See `job`.
        #[arg(long)]
        background: bool,
        /// With --background: wait for the job to end, showing its progress.
        #[arg(long, requires = "background")]
        wait: bool,
        /// Idempotency of the action: a repeated id acts once [default: a new UUID].
        #[arg(long)]
        request_id: Option<String>,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
    /// Publish completed outbox events again as new events, by ids or by filter (dry run
    /// unless --yes). `--since`/`--until` bound the publication time. With `--inbox` or
    /// `--subscription` (or as `redeliver`): hand handled inbox messages to their
    /// handler again.
    #[command(alias = "redeliver")]
    Republish {
        /// Completed event ids; when given, no filter flags.
        ids: Vec<i64>,
        /// Which completed events.
        #[command(flatten)]
        filter: FilterArgs,
        /// At most this many events (messages), oldest first [server default and max: 1000].
        #[arg(long)]
        limit: Option<u32>,
        /// Act; without it only show what would be republished.
        #[arg(long)]
        yes: bool,
        /// With no ids and no filter flags: yes, every completed event.
        #[arg(long)]
        all: bool,
        /// Run as a background job over every matching event, however many (no ids;
        /// `--yes` starts it, without it a dry run counts them). See `job`.
        #[arg(long)]
        background: bool,
        /// With --background: wait for the job to end, showing its progress.
        #[arg(long, requires = "background")]
        wait: bool,
        /// Idempotency of the action: a repeated id acts once [default: a new UUID].
        #[arg(long)]
        request_id: Option<String>,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
    /// Move pending events to failed with a reason, by ids, or by filter with
    /// --background (dry run unless --yes).
    Cancel {
        /// Pending event ids; without --background, at least one.
        #[arg(required_unless_present = "background")]
        ids: Vec<i64>,
        /// With --background: which pending events.
        #[command(flatten)]
        filter: FilterArgs,
        /// Why; stored as the events' last error.
        #[arg(long)]
        reason: String,
        /// Act; without it only show what would be cancelled.
        #[arg(long)]
        yes: bool,
        /// With --background and no filter flags: yes, every pending event of the box.
        #[arg(long)]
        all: bool,
        /// Run as a background job over every matching event, however many (no ids;
        /// `--yes` starts it, without it a dry run counts them). See `job`.
        #[arg(long)]
        background: bool,
        /// With --background: wait for the job to end, showing its progress.
        #[arg(long, requires = "background")]
        wait: bool,
        /// Idempotency of the action: a repeated id acts once [default: a new UUID].
        #[arg(long)]
        request_id: Option<String>,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
    /// Stop publishing an outbox topic until `resume`: its events stay pending and
    /// spend no attempt; enqueues are still stored.
    Pause {
        /// The outbox topic; with `--subscription`, none (the subscription is paused).
        topic: Option<String>,
        /// Why (shown with the pause and in the audit log).
        #[arg(long)]
        reason: String,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
    /// Resume publishing a paused outbox topic (with `--subscription`: dispatching a
    /// paused subscription).
    Resume {
        /// The outbox topic; with `--subscription`, none.
        topic: Option<String>,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
    /// The paused outbox topics (with `--inbox`: the paused subscriptions).
    Paused,
    /// Counts by status and topic, oldest pending age, blocked keys.
    Stats,
    /// Send `--subscription`'s consumers back to a time: each partition to its first
    /// record at or after `--to` (dry run unless --yes). Records read again are dropped as
    /// duplicates unless `--redeliver`.
    Rewind {
        /// The time to go back to (RFC 3339).
        #[arg(long)]
        to: DateTime<Utc>,
        /// Hand the records read again to the handler as new messages.
        #[arg(long)]
        redeliver: bool,
        /// Act; without it only show what would be read again.
        #[arg(long)]
        yes: bool,
        /// Idempotency of the action: a repeated id acts once [default: a new UUID].
        #[arg(long)]
        request_id: Option<String>,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
    /// The rewinds asked for, newest first, with the partitions each was applied to
    /// (`--subscription` narrows them to one subscription).
    Rewinds {
        /// At most this many.
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// The background jobs, newest first.
    Jobs {
        /// Jobs per page.
        #[arg(long, default_value_t = 20)]
        limit: u32,
        /// Continue from a previous page.
        #[arg(long)]
        page_token: Option<String>,
    },
    /// One background job and its progress; `--wait` follows it to its end, `--cancel`
    /// stops it after its current page.
    Job {
        /// The job's id.
        id: i64,
        /// Wait for the job to end, showing its progress.
        #[arg(long)]
        wait: bool,
        /// Stop the job after its current page (what it did stays done).
        #[arg(long, conflicts_with = "wait")]
        cancel: bool,
        /// Name recorded in the audit log [default: $USER].
        #[arg(long)]
        operator: Option<String>,
    },
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

/// A failed command's message: its causes joined with `: `, each said once (a
/// transport error's chain repeats itself: "tcp connect error: tcp connect error"),
/// escaped: a status message is the server's (or a proxy's) text, shown, never obeyed.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    render::escape(&out)
}

/// Runs one admin command, printing to stdout.
pub async fn run(args: AdminArgs) -> anyhow::Result<()> {
    let out = execute(args).await?;
    print!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_said_once() {
        let e = anyhow::anyhow!("tcp connect error")
            .context("tcp connect error")
            .context("transport error")
            .context("connecting to http://x");
        assert_eq!(
            error_text(&e),
            "connecting to http://x: transport error: tcp connect error"
        );
    }
}

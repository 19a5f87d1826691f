//! How answers are shown: aligned tables and short texts for people, one JSON document
//! per answer for scripts.

use std::time::Duration;

use chrono::Utc;
use serde_json::{Value, json};

use crate::pb;
use crate::pb::time::timestamp;

/// What `requeue` prints.
pub(super) fn requeue_out(r: &pb::RequeueFailedResponse, json_out: bool) -> String {
    if json_out {
        lines(&json!({
            "dry_run": r.dry_run,
            "count": r.count,
            "sample_ids": r.sample_ids,
            "audit_id": r.audit_id,
            "replayed": r.replayed,
        }))
    } else if r.dry_run {
        format!(
            "dry run: would requeue {} failed event(s){}\nrun again with --yes to requeue them\n",
            r.count,
            sample(&r.sample_ids, r.count)
        )
    } else {
        format!(
            "requeued {} event(s){} (audit entry {}){}\n",
            r.count,
            sample(&r.sample_ids, r.count),
            r.audit_id,
            replayed(r.replayed)
        )
    }
}

/// What `republish` (`verb`: "republish" or "redeliver") prints.
pub(super) fn republish_out(r: &pb::RepublishEventsResponse, verb: &str, json_out: bool) -> String {
    if json_out {
        let copies: Vec<_> = r
            .copies
            .iter()
            .map(|c| json!({ "original_id": c.original_id, "id": c.id }))
            .collect();
        lines(&json!({
            "dry_run": r.dry_run,
            "count": r.count,
            "sample_ids": r.sample_ids,
            "audit_id": r.audit_id,
            "replayed": r.replayed,
            "copies": copies,
        }))
    } else if r.dry_run {
        format!(
            "dry run: would {verb} {} event(s){}\nrun again with --yes to {verb} them\n",
            r.count,
            sample(&r.sample_ids, r.count)
        )
    } else {
        let first = r
            .copies
            .first()
            .map(|c| format!("; first copy {} of {}", c.id, c.original_id))
            .unwrap_or_default();
        format!(
            "{verb}ed {} event(s){}{first} (audit entry {}){}\n",
            r.count,
            sample(&r.sample_ids, r.count),
            r.audit_id,
            replayed(r.replayed)
        )
    }
}

/// The note on an action answered from its earlier outcome (the same `--request-id`
/// again): nothing was done this time.
fn replayed(replayed: bool) -> &'static str {
    if replayed {
        "; already done under this request id, nothing done again"
    } else {
        ""
    }
}

/// What `cancel` prints; `dry_run` unless given `--yes`.
pub(super) fn cancel_out(r: &pb::CancelEventsResponse, dry_run: bool, json_out: bool) -> String {
    if json_out {
        lines(&json!({
            "dry_run": dry_run,
            "count": r.count,
            "ids": r.ids,
            "audit_id": r.audit_id,
            "replayed": r.replayed,
        }))
    } else if dry_run {
        format!(
            "dry run: would cancel {} pending event(s): {}\nrun again with --yes to cancel them\n",
            r.count,
            join_ids(&r.ids)
        )
    } else {
        format!(
            "cancelled {} event(s): {} (audit entry {}){}\n",
            r.count,
            join_ids(&r.ids),
            r.audit_id,
            replayed(r.replayed)
        )
    }
}

/// A subscription's pause in the shape of a topic's, for the renderers below (`what`
/// names the field).
pub(super) fn subscription_as_topic(p: &pb::SubscriptionPause) -> pb::TopicPause {
    pb::TopicPause {
        topic: p.subscription.clone(),
        reason: p.reason.clone(),
        actor: p.actor.clone(),
        principal: p.principal.clone(),
        paused_at: p.paused_at,
    }
}

fn pause_json(p: &pb::TopicPause, what: &str) -> Value {
    json!({
        what: p.topic,
        "reason": p.reason,
        "actor": p.actor,
        "principal": p.principal,
        "paused_at": ts(p.paused_at.as_ref()),
    })
}

/// What `pause` and `resume` print: the pause in force (or lifted) and whether anything
/// changed.
/// `what` is "topic" or "subscription".
pub(super) fn pause_out(
    p: Option<&pb::TopicPause>,
    what: &str,
    changed: bool,
    audit_id: i64,
    pausing: bool,
    json_out: bool,
) -> String {
    if json_out {
        let mut v = json!({ "changed": changed, "audit_id": audit_id });
        v[if pausing { "pause" } else { "lifted" }] = p.map(|p| pause_json(p, what)).into();
        return lines(&v);
    }
    let Some(p) = p else {
        return "nothing changed\n".into();
    };
    // Another operator wrote the reason and the name: shown, never obeyed.
    let topic = escape(&p.topic);
    let by = format!(
        "by {} at {}: {}",
        escape(&p.actor),
        ts(p.paused_at.as_ref()).unwrap_or_default(),
        escape(&p.reason)
    );
    match (pausing, changed) {
        (true, true) => format!("paused {topic} (audit entry {audit_id})\n"),
        (true, false) => format!("{topic} was already paused, {by}: nothing changed\n"),
        (false, _) => format!("resumed {topic} (audit entry {audit_id}); it was paused {by}\n"),
    }
}

/// What `paused` prints; `what` is "topic" or "subscription".
pub(super) fn paused_out(topics: &[pb::TopicPause], what: &str, json_out: bool) -> String {
    if json_out {
        let list: Vec<Value> = topics.iter().map(|p| pause_json(p, what)).collect();
        return lines(&json!({ format!("{what}s"): list }));
    }
    if topics.is_empty() {
        return format!("no {what} is paused\n");
    }
    let header = what.to_uppercase();
    let mut t = Table::new(&[header.as_str(), "SINCE", "BY", "REASON"]);
    for p in topics {
        t.row(vec![
            p.topic.clone(),
            format!("{} ago", age_since(p.paused_at.as_ref())),
            p.actor.clone(),
            truncate(&p.reason, 60),
        ]);
    }
    t.render()
}

/// What `audit` prints.
pub(super) fn audit_out(r: &pb::ListAuditResponse, json_out: bool) -> String {
    if json_out {
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
        let mut t = Table::new(&[
            "ID",
            "AT",
            "ACTOR",
            "PRINCIPAL",
            "ACTION",
            "BOX",
            "COUNT",
            "SELECTION",
        ]);
        for a in &r.entries {
            t.row(vec![
                a.id.to_string(),
                ts(a.at.as_ref()).unwrap_or_default(),
                a.actor.clone(),
                if a.principal.is_empty() {
                    "-".into()
                } else {
                    a.principal.clone()
                },
                a.action.clone(),
                box_name(a.r#box).into(),
                a.count.to_string(),
                truncate(&a.selection, 80),
            ]);
        }
        t.render() + &next_page(&r.next_page_token)
    }
}

/// What `failed` prints.
pub(super) fn failed_out(r: &pb::ListEventsResponse, json_out: bool, inbox: bool) -> String {
    if json_out {
        lines(&json!({
            "events": r.events.iter().map(|e| event_json(e, false, inbox)).collect::<Vec<_>>(),
            "next_page_token": r.next_page_token,
        }))
    } else {
        events_table(r, inbox)
    }
}

/// `v` as pretty JSON, one document. serde_json escapes only the C0 controls; DEL, the
/// C1 controls (U+009B is CSI to many terminals) and the invisible formatting characters
/// are written as `\uXXXX` too, so that `--json` printed to a terminal cannot steer it.
/// Outside strings the JSON holds only ASCII structure, so every such character is
/// inside a string, where the escape means the same character.
pub(super) fn lines(v: &Value) -> String {
    let pretty = serde_json::to_string_pretty(v).expect("json");
    let mut s = String::with_capacity(pretty.len() + 1);
    for c in pretty.chars() {
        if c != '\n' && steers_terminal(c) {
            s.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            s.push(c);
        }
    }
    s.push('\n');
    s
}

pub(super) fn ts(t: Option<&prost_types::Timestamp>) -> Option<String> {
    t.and_then(timestamp)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}

pub(super) fn age_since(t: Option<&prost_types::Timestamp>) -> String {
    match t.and_then(timestamp) {
        None => "-".into(),
        Some(t) => age((Utc::now() - t).to_std().unwrap_or(Duration::ZERO)),
    }
}

/// In how long from now, `now` if due.
pub(super) fn due_in(t: Option<&prost_types::Timestamp>) -> String {
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

/// `s` with every character that could steer a terminal written as an escape (`\u{1b}`):
/// control characters (ESC, CR, LF, BEL, …) and the invisible formatting ones (bidi
/// overrides, zero-width characters) that make text read differently from what it is.
/// Producers and handlers write topics, keys, headers and errors; an operator's
/// terminal must show them, not obey them.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if steers_terminal(c) {
            out.push_str(&c.escape_unicode().to_string());
        } else {
            out.push(c);
        }
    }
    out
}

/// A control character (C0, DEL, C1) or an invisible formatting one (bidi overrides and
/// isolates, zero-width characters, the BOM).
fn steers_terminal(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
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

pub(super) fn join_ids(ids: &[i64]) -> String {
    ids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn sample(ids: &[i64], count: i64) -> String {
    if ids.is_empty() {
        String::new()
    } else if (ids.len() as i64) < count {
        format!(": {}, …", join_ids(ids))
    } else {
        format!(": {}", join_ids(ids))
    }
}

pub(super) fn next_page(token: &str) -> String {
    if token.is_empty() {
        String::new()
    } else {
        format!("next page: --page-token {}\n", escape(token))
    }
}

pub(super) fn box_name(b: i32) -> &'static str {
    match pb::Box::try_from(b) {
        Ok(pb::Box::Inbox) => "inbox",
        _ => "outbox",
    }
}

/// A plain text table: left-aligned columns, two spaces apart.
pub(super) struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(super) fn new(header: &[&str]) -> Self {
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
        self.row(r);
    }
    /// Cells are producer- or handler-controlled text: escaped (see [`escape`]).
    pub(super) fn row(&mut self, r: Vec<String>) {
        self.rows.push(r.iter().map(|c| escape(c)).collect());
    }
    pub(super) fn render(&self) -> String {
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

pub(super) fn pending_table(r: &pb::ListPendingResponse, inbox: bool) -> String {
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
    let paused = |k: &pb::KeyBacklog| if k.paused { " (paused)" } else { "" };
    for k in &r.keys {
        t.row_with_sub(
            inbox,
            &k.subscription,
            vec![
                format!("{}{}", k.topic, paused(k)),
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
    let paused_topics: String = r
        .paused_topics
        .iter()
        .map(|p| {
            format!(
                "paused: {} since {} by {}: {}\n",
                escape(&p.topic),
                ts(p.paused_at.as_ref()).unwrap_or_default(),
                escape(&p.actor),
                escape(&p.reason)
            )
        })
        .collect();
    format!(
        "{}total: {} pending in {} key(s), {} blocked\n{paused_topics}{}",
        t.render(),
        r.total_pending,
        r.total_keys,
        r.total_blocked_keys,
        next_page(&r.next_page_token)
    )
}

pub(super) fn pending_json(r: &pb::ListPendingResponse, inbox: bool) -> String {
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
                "paused": k.paused,
            });
            if inbox {
                v["subscription"] = k.subscription.clone().into();
            }
            v
        }).collect::<Vec<_>>(),
        "total_pending": r.total_pending,
        "total_keys": r.total_keys,
        "total_blocked_keys": r.total_blocked_keys,
        "paused_topics": r.paused_topics.iter().map(|p| pause_json(p, "topic")).collect::<Vec<_>>(),
        "next_page_token": r.next_page_token,
    }))
}

pub(super) fn status_name(s: i32) -> &'static str {
    match pb::EventStatus::try_from(s) {
        Ok(pb::EventStatus::Pending) => "pending",
        Ok(pb::EventStatus::Completed) => "completed",
        Ok(pb::EventStatus::Failed) => "failed",
        _ => "unknown",
    }
}

pub(super) fn event_json(e: &pb::EventInfo, with_payload: bool, inbox: bool) -> Value {
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
        "attempt_history": e.attempt_history.iter().map(|a| json!({
            "attempt": a.attempt, "at": ts(a.at.as_ref()), "error": a.error,
        })).collect::<Vec<_>>(),
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

pub(super) fn event_text(e: &pb::EventInfo, with_payload: bool, inbox: bool) -> String {
    let mut headers: Vec<_> = e.headers.iter().collect();
    headers.sort();
    let mut out = String::new();
    // Every value is producer- or handler-controlled text: escaped, so that none can
    // drive the operator's terminal.
    let mut field = |k: &str, v: String| out.push_str(&format!("{k:<16}{}\n", escape(&v)));
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
    for a in &e.attempt_history {
        field(
            "attempt",
            format!(
                "#{} at {}: {}",
                a.attempt,
                ts(a.at.as_ref()).unwrap_or_default(),
                a.error
            ),
        );
    }
    if with_payload {
        field("payload", String::from_utf8_lossy(&e.payload).into_owned());
    }
    out
}

pub(super) fn events_table(r: &pb::ListEventsResponse, inbox: bool) -> String {
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

pub(super) fn stats_json(r: &pb::GetStatsResponse, inbox: bool) -> String {
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
                "failed": t.failed, "paused": t.paused,
            });
            if inbox {
                v["subscription"] = t.subscription.clone().into();
            }
            v
        }).collect::<Vec<_>>(),
    }))
}

pub(super) fn stats_table(r: &pb::GetStatsResponse, inbox: bool) -> String {
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
                if s.paused {
                    format!("{} (paused)", s.topic)
                } else {
                    s.topic.clone()
                },
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

#[cfg(test)]
mod escape_tests {
    use super::*;

    #[test]
    fn terminal_control_is_shown_not_obeyed() {
        let hostile = "boom\u{1b}]0;pwned\u{7}\r\ncleared\u{202e}txt.exe";
        let shown = escape(hostile);
        assert!(
            !shown.chars().any(|c| c.is_control() || c == '\u{202e}'),
            "{shown}"
        );
        assert!(
            shown.contains("\\u{1b}") && shown.contains("\\u{202e}"),
            "{shown}"
        );
        let mut t = Table::new(&["LAST ERROR"]);
        t.row(vec![hostile.to_string()]);
        assert!(!t.render().contains('\u{1b}'));
        let e = pb::EventInfo {
            last_error: hostile.into(),
            topic: "t\u{1b}[2J".into(),
            ..Default::default()
        };
        let text = event_text(&e, false, false);
        assert!(!text.contains('\u{1b}') && !text.contains('\r'), "{text}");
    }

    #[test]
    fn json_escapes_c1_and_formatting_and_means_the_same() {
        let v = json!({ "reason": "a\u{9b}2J\u{7f}\u{202e}b\u{1b}é", "n": 1 });
        let out = lines(&v);
        assert!(
            !out.chars().any(|c| c != '\n' && steers_terminal(c)),
            "{out}"
        );
        assert!(out.contains("\\u009b") && out.contains("é"), "{out}");
        assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), v);
    }
}

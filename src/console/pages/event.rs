//! One event's page (fields, headers, payload preview, its key's line) and the page
//! an action's dry run or result is shown on.

use super::*;

/// The payload as text, pretty JSON, or hex.
pub(super) fn payload_preview(
    p: &[u8],
    headers: &std::collections::BTreeMap<String, String>,
) -> Markup {
    const MAX: usize = 64 * 1024;
    let shown = &p[..p.len().min(MAX)];
    let cut = p.len() > MAX;
    let json = serde_json::from_slice::<serde_json::Value>(p)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok());
    let text = std::str::from_utf8(shown).ok();
    let hex: String = shown
        .chunks(16)
        .enumerate()
        .map(|(i, c)| {
            let h: Vec<String> = c.iter().map(|b| format!("{b:02x}")).collect();
            let a: String = c
                .iter()
                .map(|&b| {
                    if (0x20..0x7f).contains(&b) {
                        b as char
                    } else {
                        '.'
                    }
                })
                .collect();
            format!("{:08x}  {:<48} {a}\n", i * 16, h.join(" "))
        })
        .collect();
    let content_type = headers
        .get("content-type")
        .or_else(|| headers.get("ce_datacontenttype"));
    html! {
        @if let Some(ct) = content_type { p.muted { "content-type: " code { (ct) } } }
        @if p.is_empty() { p.muted { "(empty payload)" } }
        @else if let Some(j) = json { p.muted { "JSON, " (p.len()) " bytes" } pre #payload-json { code { (j) } } }
        @else if let Some(t) = text { p.muted { "text, " (p.len()) " bytes" } pre #payload-text { (t) } }
        @else { p.muted { "binary, " (p.len()) " bytes" } pre #payload-hex { (hex) } }
        @if cut { p.muted { "(first " (MAX) " bytes shown)" } }
        @if !p.is_empty() && text.is_some() {
            details { summary { "hex" } pre { (hex) } }
        }
    }
}

pub fn event(nav: &Nav, t: &Target, d: &EventDetail, line: &[EventDetail]) -> Markup {
    let base = t.base();
    let e = &d.event;
    layout(
        Some(nav),
        &format!("Event {}", e.id),
        &base,
        None,
        html! {
            h1 { (t.title()) " · event #" (e.id) " " (status_badge(e.status)) }
            (tabs(t, "none"))
            dl.kv #event {
                dt { "topic" } dd { (e.topic) }
                dt { "key" } dd { code { (e.key.as_deref().unwrap_or("(unkeyed)")) } }
                @if let Some(ty) = &e.event_type { dt { "type" } dd { (ty) } }
                @if let Some(m) = &d.message_id { dt { "message id" } dd { code { (m) } } }
                @if let Some(k) = &e.idempotency_key { dt { "idempotency key" } dd { code { (k) } } }
                dt { "attempts" } dd #attempts { (e.attempts) " of " (e.max_attempts) }
                dt { "created" } dd { (time(e.created_at)) " (" (ago(e.created_at)) ")" }
                dt { "updated" } dd { (time(e.updated_at)) }
                @if e.status == Status::Pending { dt { "next attempt" } dd { (time(e.scheduled_at)) " (" (until(e.scheduled_at)) ")" } }
                @if let Some(p) = e.published_at { dt { @if t.box_kind() == crate::domain::BoxKind::Outbox { "published" } @else { "handled" } } dd { (time(p)) } }
                @if let Some(err) = &e.last_error { dt { "last error" } dd.err #last-error { (err) } }
            }
            @if nav.can_write && matches!(e.status, Status::Failed | Status::Pending) {
                form method="post" action={(base) "/events"} {
                    (csrf(nav))
                    input type="hidden" name="id" value=(e.id);
                    input type="hidden" name="status" value=(e.status.as_str());
                    @if e.status == Status::Failed {
                        button.primary type="submit" name="action" value="requeue" id="requeue-one" { "Requeue…" }
                    } @else {
                        input type="text" name="reason" value="cancelled in the console";
                        " "
                        button.danger type="submit" name="action" value="cancel" id="cancel-one" { "Cancel…" }
                    }
                }
            }
            @if nav.can_write && e.status == Status::Completed && t.box_kind() == crate::domain::BoxKind::Outbox {
                form method="post" action={(base) "/events"} {
                    (csrf(nav))
                    input type="hidden" name="id" value=(e.id);
                    input type="hidden" name="status" value="completed";
                    button.primary type="submit" name="action" value="republish" id="republish-one" { "Republish as a new event…" }
                }
            }
            @if !d.attempt_log.is_empty() {
                h2 { "Attempts" }
                p.muted { "The last counted attempts, oldest first (failures that spent no attempt are not listed)." }
                table #attempts-history {
                    thead { tr { th { "attempt" } th { "at" } th { "error" } } }
                    tbody { @for a in &d.attempt_log { tr { td.num { (a.attempt) } td { (time(a.at)) } td.err { (a.error) } } } }
                }
            }
            h2 { "Headers" }
            @if e.headers.is_empty() { p.muted { "none" } } @else {
                table #headers { tbody { @for (k, v) in &e.headers { tr { th { code { (k) } } td { code { (v) } } } } } }
            }
            h2 { "Payload" }
            @if nav.sees_payloads { (payload_preview(&e.payload, &e.headers)) }
            @else { p.muted #payload-hidden { "hidden: this token may read the backlog, not payloads (it needs the payloads scope)" } }
            @if !line.is_empty() {
                h2 { "Its key's line" }
                p.muted { "The key's newest events and those just before this one, newest first." }
                table #line {
                    thead { tr { th { "id" } th { "status" } th { "attempts" } th { "created" } th { "last error" } } }
                    tbody {
                        @for (i, l) in line.iter().enumerate() {
                            @if i > 0 && line[i - 1].event.id > e.id && l.event.id < e.id && line[i - 1].event.id != e.id {
                                tr { td colspan="5" { "…" } }
                            }
                            tr class=[(l.event.id == e.id).then_some("this")] {
                                td { a href={(base) "/events/" (l.event.id)} { "#" (l.event.id) } }
                                td { (status_badge(l.event.status)) }
                                td.num { (l.event.attempts) }
                                td { (ago(l.event.created_at)) }
                                td.err { (l.event.last_error.as_deref().unwrap_or("")) }
                            }
                        }
                    }
                }
            }
        },
    )
}

pub fn action(
    nav: &Nav,
    t: &Target,
    action: &str,
    form: &[(String, String)],
    r: &ActionResult,
) -> Markup {
    let base = t.base();
    let noun = if r.count == 1 { "event" } else { "events" };
    layout(
        Some(nav),
        "Confirm",
        &base,
        None,
        html! {
            h1 { (t.title()) }
            (tabs(t, "/events"))
            @if r.dry_run {
                div.notice.warn #preview {
                    p { "This would " strong { (r.verb) } " " strong #count { (r.count) } " " (noun) "." }
                    @if !r.ids.is_empty() {
                        p { "Events: " @for (i, id) in r.ids.iter().enumerate() { @if i > 0 { ", " } a href={(base) "/events/" (id)} { "#" (id) } } }
                    }
                }
                @if r.count > 0 {
                    form method="post" action={(base) "/events"} {
                        @for (k, v) in form { @if k != "confirm" && k != "csrf" && k != "request_id" { input type="hidden" name=(k) value=(v); } }
                        // One id per confirmation form: a resubmitted form (reload, double
                        // click, back and submit) names the same request and acts once.
                        input type="hidden" name="request_id" value=(super::request_id());
                        (csrf(nav))
                        input type="hidden" name="action" value=(action);
                        input type="hidden" name="confirm" value="yes";
                        button.danger type="submit" id="confirm" { "Yes, " (r.verb) " " (r.count) " " (noun) }
                        " " a href={(base) "/events"} { "No, go back" }
                    }
                } @else {
                    p { a href={(base) "/events"} { "Back" } }
                }
            } @else {
                div.notice #done {
                    p { "Done: " (r.verb) " " strong #count { (r.count) } " " (noun) "."
                        @if let Some(a) = r.audit_id { " Audit entry " a href="/audit" { "#" (a) } "." } }
                }
                p { a href={(base) "/events"} { "Back to the events" } " · " a href={(base) "/backlog"} { "backlog" } }
            }
        },
    )
}

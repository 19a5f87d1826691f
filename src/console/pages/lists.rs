//! The list pages: a box's overview with its rate chart, the backlog by key, the
//! events list with its filter, and the audit log.

use super::*;

pub fn overview(
    nav: &Nav,
    t: &Target,
    s: &Stats,
    paused: &[TopicPause],
    per_minute: &[u64],
    covered: usize,
) -> Markup {
    let outbox = matches!(t, Target::Outbox);
    let base = t.base();
    let what = match t {
        Target::Outbox => "published",
        Target::Inbox(_) => "handled",
    };
    layout(
        Some(nav),
        &t.title(),
        &base,
        Some(30),
        html! {
            h1 { (t.title()) }
            (tabs(t, ""))
            div.cards {
                div.card #pending { div.n { (s.pending) } div.l { "pending" } }
                div.card #failed { div.n { a href={(base) "/events?status=failed"} { (s.failed) } } div.l { "failed" } }
                div.card #completed { div.n { (s.completed) } div.l { "completed (kept)" } }
                div.card #oldest { div.n { @match s.oldest_pending_age { Some(a) => (human(chrono::Duration::from_std(a).unwrap_or_default())), None => "—" } } div.l { "oldest pending" } }
                div.card #blocked { div.n { a href={(base) "/backlog?blocked=1"} { (s.blocked_keys) } } div.l { "blocked keys" } }
            }
            @for p in paused {
                div.notice.warn.paused data-topic=(p.topic) {
                    @if outbox {
                        strong { (p.topic) } " is paused: nothing of it is published until it is resumed. Paused "
                    } @else {
                        "This subscription is paused: nothing is handed to its handler until it is resumed (messages are still stored). Paused "
                    }
                    (ago(p.paused_at)) " by " (p.actor) ": " (p.reason)
                }
            }
            @if !outbox && nav.can_write {
                form.pause #subscription-pause method="post" action=(base) {
                    (csrf(nav))
                    @if paused.is_empty() {
                        input name="reason" placeholder="reason" required maxlength="1000";
                        button.danger type="submit" name="action" value="pause" id="pause-subscription" { "Pause dispatching" }
                    } @else {
                        button type="submit" name="action" value="resume" id="resume-subscription" { "Resume dispatching" }
                    }
                }
                form.pause #subscription-rewind method="post" action=(base) {
                    (csrf(nav))
                    label { "Rewind to (UTC) " input type="datetime-local" step="1" name="to" required; }
                    label { input type="checkbox" name="redeliver" value="yes"; " hand the records read again to the handler" }
                    button type="submit" name="action" value="rewind" id="rewind-subscription" { "Rewind…" }
                }
            }
            h2 { "Rate" }
            (rate_chart(per_minute, covered, what))
            h2 { "By topic" }
            @if s.topics.is_empty() { p.muted { "No events." } } @else {
                table #topics {
                    thead { tr { th { "topic" } th { "pending" } th { "failed" } th { "completed" } @if outbox { th { "publishing" } } } }
                    tbody {
                        @for tp in &s.topics {
                            tr data-topic=(tp.topic) {
                                td { a href={(base) "/backlog?topic=" (url_escape(&tp.topic))} { (tp.topic) } }
                                td.num { (tp.pending) }
                                td.num { a href={(base) "/events?status=failed&topic=" (url_escape(&tp.topic))} { (tp.failed) } }
                                td.num { (tp.completed) }
                                @if outbox { td { (pause_cell(nav, tp)) } }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// A topic's publishing state and, for a caller who may act, the form that flips it.
fn pause_cell(nav: &Nav, tp: &TopicStats) -> Markup {
    html! {
        @if tp.paused { span.badge.blocked { "paused" } " " } @else { span.badge.completed { "on" } " " }
        @if nav.can_write {
            form.pause method="post" action="/outbox" {
                (csrf(nav))
                input type="hidden" name="topic" value=(tp.topic);
                @if tp.paused {
                    button type="submit" name="action" value="resume" { "Resume" }
                } @else {
                    input name="reason" placeholder="reason" required maxlength="1000";
                    button.danger type="submit" name="action" value="pause" { "Pause" }
                }
            }
        }
    }
}

pub(super) fn key_rows(t: &Target, keys: &[KeyBacklog]) -> Markup {
    let base = t.base();
    html! {
        table.backlog {
            thead { tr {
                th { "topic" } th { "key" } th { "pending" } th { "oldest" } th { "head" }
                th { "attempts" } th { "next attempt" } th { "last error" }
            } }
            tbody {
                @for k in keys {
                    tr data-key=(k.key) {
                        td { (k.topic) @if k.paused { " " span.badge.blocked { "paused" } } }
                        td { code { @if k.key.is_empty() { span.muted { "(unkeyed)" } } @else { (k.key) } } @if k.blocked { " " span.badge.blocked { "blocked" } } }
                        td.num { (k.pending) }
                        td { (ago(k.oldest_created_at)) }
                        td { a href={(base) "/events/" (k.head_id)} { "#" (k.head_id) } }
                        td.num { (k.head_attempts) }
                        td { (until(k.head_next_attempt_at)) }
                        td.err { (k.head_last_error.as_deref().unwrap_or("")) }
                    }
                }
            }
        }
    }
}

pub fn backlog(
    nav: &Nav,
    t: &Target,
    f: &BacklogFilter,
    blocked: Option<&PendingPage>,
    page: &PendingPage,
    next: Option<&str>,
) -> Markup {
    let base = t.base();
    let mut q = vec![];
    if !f.topic.is_empty() {
        q.push(format!("topic={}", url_escape(&f.topic)));
    }
    if !f.key_prefix.is_empty() {
        q.push(format!("key_prefix={}", url_escape(&f.key_prefix)));
    }
    if f.only_blocked {
        q.push("blocked=1".into());
    }
    if f.oldest_first {
        q.push("order=oldest".into());
    }
    if let Some(n) = &f.size {
        q.push(format!("size={}", url_escape(n)));
    }
    let keep = q.join("&");
    layout(
        Some(nav),
        &format!("{} backlog", t.title()),
        &base,
        None,
        html! {
            h1 { (t.title()) }
            (tabs(t, "/backlog"))
            form.filters method="get" action={(base) "/backlog"} {
                label { "topic" input name="topic" id="f-topic" value=(f.topic); }
                label { "key prefix" input name="key_prefix" id="f-key" value=(f.key_prefix); }
                label { "order" select name="order" {
                    option value="most" selected[!f.oldest_first] { "most pending first" }
                    option value="oldest" selected[f.oldest_first] { "oldest first" }
                } }
                label { "only blocked" input type="checkbox" name="blocked" value="1" checked[f.only_blocked]; }
                button.primary type="submit" id="f-apply" { "Filter" }
                a href={(base) "/backlog"} { "clear" }
            }
            p #totals {
                strong { (page.total_pending) } " pending in " strong { (page.total_keys) } " keys, "
                strong { (page.total_blocked_keys) } " blocked"
                @if !f.topic.is_empty() || !f.key_prefix.is_empty() { span.muted { " (with these filters)" } }
            }
            @if let Some(b) = blocked {
                @if !b.keys.is_empty() {
                    h2 { "Blocked keys " span.muted { "(head waiting out a retry)" } }
                    (key_rows(t, &b.keys))
                    @if b.next.is_some() { p.pager { a href={(base) "/backlog?blocked=1" @if !keep.is_empty() { "&" (keep) }} { "all blocked keys →" } } }
                    h2 { "All keys" }
                }
            }
            @if page.keys.is_empty() { p.muted #empty { "Nothing pending." } } @else { (key_rows(t, &page.keys)) }
            @if let Some(n) = next {
                p.pager { a #next-page href={(base) "/backlog?" (keep) @if !keep.is_empty() { "&" } "page=" (n)} { "next page →" } }
            }
        },
    )
}

pub(super) fn filter_fields(f: &EventsFilter) -> Markup {
    html! {
        input type="hidden" name="status" value=(f.status.map(|s| s.as_str()).unwrap_or("any"));
        @for (k, v) in [("topic", &f.topic), ("key", &f.key), ("type", &f.event_type), ("error_contains", &f.error_contains),
                        ("idempotency_key", &f.idempotency_key), ("message_id", &f.message_id), ("header", &f.header)] {
            @if !v.is_empty() { input type="hidden" name=(k) value=(v); }
        }
    }
}

pub fn events(nav: &Nav, t: &Target, f: &EventsFilter, page: &EventsPage) -> Markup {
    let base = t.base();
    let status = f.status.map(|s| s.as_str()).unwrap_or("any");
    let failed = f.status == Some(Status::Failed);
    let pending = f.status == Some(Status::Pending);
    let republishable = f.status == Some(Status::Completed) && matches!(t, Target::Outbox);
    layout(
        Some(nav),
        &format!("{} events", t.title()),
        &base,
        None,
        html! {
            h1 { (t.title()) }
            (tabs(t, "/events"))
            form.filters method="get" action={(base) "/events"} {
                label { "status" select name="status" id="e-status" {
                    @for s in ["failed", "pending", "completed", "any"] { option value=(s) selected[s == status] { (s) } }
                } }
                label { "topic" input name="topic" id="e-topic" value=(f.topic); }
                label { "key" input name="key" id="e-key" value=(f.key); }
                label { "type" input name="type" value=(f.event_type); }
                label { "error contains" input name="error_contains" id="e-error" value=(f.error_contains); }
                label { "idempotency key" input name="idempotency_key" id="e-idem" value=(f.idempotency_key); }
                @if !matches!(t, Target::Outbox) { label { "message id" input name="message_id" id="e-message-id" value=(f.message_id); } }
                label { "header" input name="header" id="e-header" placeholder="name=value" value=(f.header); }
                button.primary type="submit" id="e-apply" { "Filter" }
            }
            form method="post" action={(base) "/events"} #select {
                (csrf(nav))
                (filter_fields(f))
                @if page.events.is_empty() { p.muted #empty { "No events match." } } @else {
                    table #events {
                        thead { tr {
                            th { input type="checkbox" data-select-all title="select all" hidden; }
                            th { "id" } th { "status" } th { "topic" } th { "key" } th { "type" } th { "attempts" } th { "updated" } th { "last error" }
                        } }
                        tbody {
                            @for d in &page.events {
                                @let e = &d.event;
                                tr {
                                    td { input type="checkbox" name="id" value=(e.id) id={"sel-" (e.id)}; }
                                    td { a href={(base) "/events/" (e.id)} { "#" (e.id) } }
                                    td { (status_badge(e.status)) }
                                    td { (e.topic) }
                                    td { code { (e.key.as_deref().unwrap_or("")) } }
                                    td { (e.event_type.as_deref().unwrap_or("")) }
                                    td.num { (e.attempts) "/" (e.max_attempts) }
                                    td { (ago(e.updated_at)) }
                                    td.err { (e.last_error.as_deref().unwrap_or("")) }
                                }
                            }
                        }
                    }
                }
                @if nav.can_write {
                    p {
                        @if failed {
                            button.primary type="submit" name="action" value="requeue" id="requeue-selected" { "Requeue selected…" }
                            " "
                            button type="submit" name="action" value="requeue-filter" id="requeue-filter" { "Requeue all matching the filter…" }
                        }
                        @if pending {
                            input type="text" name="reason" placeholder="reason" value="cancelled in the console";
                            " "
                            button.danger type="submit" name="action" value="cancel" id="cancel-selected" { "Cancel selected…" }
                        }
                        @if republishable {
                            button.primary type="submit" name="action" value="republish" id="republish-selected" { "Republish selected…" }
                        }
                        @if failed || pending || republishable { span.muted { " You will see what would happen first." } }
                    }
                }
            }
            @if let Some(n) = page.next_before_id {
                p.pager { a #next-page href={(base) "/events?" (f.query()) "&before=" (n)} { "older →" } }
            }
        },
    )
}

pub fn audit(nav: &Nav, page: &AuditPage) -> Markup {
    layout(
        Some(nav),
        "Audit log",
        "/audit",
        None,
        html! {
            h1 { "Audit log" }
            @if page.entries.is_empty() { p.muted { "No operator actions yet." } } @else {
                table #audit {
                    thead { tr { th { "#" } th { "at" } th { "actor" } th { "principal" } th { "action" } th { "box" } th { "count" } th { "selection" } } }
                    tbody {
                        @for a in &page.entries {
                            tr {
                                td { (a.id) }
                                td { (time(a.at)) }
                                td { (a.actor) }
                                td.principal { (a.principal.as_deref().unwrap_or("—")) }
                                td { (a.action) }
                                td { (a.box_kind.as_str()) }
                                td.num { (a.count) }
                                td { code { (a.selection) } }
                            }
                        }
                    }
                }
            }
            @if let Some(n) = page.next_before_id { p.pager { a href={"/audit?before=" (n)} { "older →" } } }
        },
    )
}

/// The dry run of a subscription rewind, with its confirmation.
pub fn rewind_preview(
    nav: &Nav,
    t: &Target,
    start: &RewindStart,
    fields: &[(String, String)],
) -> Markup {
    let base = t.base();
    layout(
        Some(nav),
        &t.title(),
        &base,
        None,
        html! {
            h1 { (t.title()) }
            (tabs(t, ""))
            section.notice {
                p { "The subscription has " strong { (start.stored_since) } " message(s) stored since then: its consumers would read them again, "
                    @if fields.iter().any(|(k, v)| k == "redeliver" && v == "yes") { "and hand each to the handler again as a new message." }
                    @else { "and drop those still kept as duplicates." } }
                form method="post" action=(base) {
                    @for (k, v) in fields { @if k != "confirm" && k != "csrf" && k != "request_id" { input type="hidden" name=(k) value=(v); } }
                    input type="hidden" name="confirm" value="yes";
                    input type="hidden" name="request_id" value=(request_id());
                    (csrf(nav))
                    button.danger type="submit" { "Rewind" }
                    " " a href=(base) { "cancel" }
                }
            }
        },
    )
}

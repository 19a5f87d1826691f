//! The console's HTML (maud): one function per page, a shared layout, the rate chart
//! as inline SVG. Everything user-supplied is escaped by maud; URLs are built with
//! `url_escape`.

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::{BacklogFilter, EventsFilter, Target};
use crate::domain::Status;
use crate::domain::admin::{AuditPage, EventDetail, EventsPage, KeyBacklog, PendingPage, Stats};

/// What the header shows.
pub struct Nav {
    pub subscriptions: Vec<String>,
    pub who: Option<String>,
    pub can_write: bool,
    pub logout: bool,
    pub csrf: Option<String>,
}

/// The outcome of a requeue or cancel (dry run or done).
pub struct ActionResult {
    pub verb: &'static str,
    pub dry_run: bool,
    pub count: i64,
    pub ids: Vec<i64>,
    pub audit_id: Option<i64>,
}

const CSS: &str = r#"
:root{--fg:#1d232a;--muted:#5d6b79;--line:#d9dee3;--bg:#f6f7f9;--accent:#2357c6;--bad:#b3261e;--warn:#8a5a00;--ok:#1e7b34}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);background:var(--bg)}
header{background:#1d232a;color:#fff;padding:.5rem 1rem;display:flex;gap:1rem;align-items:center;flex-wrap:wrap}
header a{color:#cfe0ff;text-decoration:none}header a.here{color:#fff;font-weight:600}header .brand{font-weight:700;color:#fff;margin-right:1rem}
header .who{margin-left:auto;color:#aab4bf}header form{display:inline}
main{padding:1rem 1.25rem;max-width:1200px}h1{font-size:1.35rem;margin:.2rem 0 .8rem}h2{font-size:1.05rem;margin:1.2rem 0 .5rem}
nav.tabs{display:flex;gap:.25rem;margin-bottom:1rem;border-bottom:1px solid var(--line)}
nav.tabs a{padding:.4rem .8rem;text-decoration:none;color:var(--muted);border-bottom:2px solid transparent}nav.tabs a.here{color:var(--fg);border-color:var(--accent)}
.cards{display:flex;gap:.75rem;flex-wrap:wrap}.card{background:#fff;border:1px solid var(--line);border-radius:6px;padding:.6rem .9rem;min-width:9rem}
.card .n{font-size:1.5rem;font-weight:600}.card .l{color:var(--muted);font-size:.85rem}
table{border-collapse:collapse;background:#fff;width:100%;border:1px solid var(--line)}th,td{text-align:left;padding:.35rem .55rem;border-bottom:1px solid var(--line);vertical-align:top}
th{background:#eef1f4;font-weight:600;font-size:.85rem}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.this td{background:#fff7d6}.err{color:var(--bad);max-width:28rem;overflow-wrap:anywhere}.muted{color:var(--muted)}
.badge{display:inline-block;padding:0 .4rem;border-radius:3px;font-size:.8rem;background:#eef1f4}.badge.failed,.badge.blocked{background:#fde2e0;color:var(--bad)}
.badge.pending{background:#fff1cc;color:var(--warn)}.badge.completed{background:#dcf3e1;color:var(--ok)}
form.filters{display:flex;gap:.5rem;flex-wrap:wrap;align-items:end;margin-bottom:.75rem}form.filters label{display:flex;flex-direction:column;font-size:.8rem;color:var(--muted)}
input,select,button{font:inherit;padding:.25rem .4rem}button{cursor:pointer;border:1px solid var(--line);background:#fff;border-radius:4px}
button.primary{background:var(--accent);color:#fff;border-color:var(--accent)}button.danger{background:var(--bad);color:#fff;border-color:var(--bad)}
pre{background:#fff;border:1px solid var(--line);padding:.6rem;overflow:auto;max-height:28rem}code{font-family:ui-monospace,Menlo,Consolas,monospace}
.notice{background:#fff;border-left:4px solid var(--accent);padding:.6rem .9rem;margin:.5rem 0}.notice.warn{border-color:var(--warn)}
.chart{background:#fff;border:1px solid var(--line);border-radius:6px;padding:.5rem}.pager{margin:.6rem 0}dl.kv{display:grid;grid-template-columns:max-content 1fr;gap:.2rem 1rem}dl.kv dt{color:var(--muted)}dl.kv dd{margin:0}
"#;

/// Progressive enhancement: "select all" boxes, and a refresh of the overview.
const SCRIPT: &str = r#"
document.querySelectorAll('input[data-select-all]').forEach(function(all){
  all.hidden=false;
  all.addEventListener('change',function(){
    document.querySelectorAll('input[name=id]').forEach(function(b){b.checked=all.checked});
  });
});
if(document.body.dataset.refresh){setTimeout(function(){location.reload()},Number(document.body.dataset.refresh)*1000)}
"#;

/// Escapes a string for a URL path segment or query value.
pub fn url_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Reverses `url_escape` (and any percent-encoding); invalid escapes stay as they are.
pub fn url_unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn layout(
    nav: Option<&Nav>,
    title: &str,
    here: &str,
    refresh: Option<u32>,
    body: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · mailroom" }
                style { (PreEscaped(CSS)) }
            }
            body data-refresh=[refresh] {
                header {
                    span.brand { "mailroom" }
                    @if let Some(nav) = nav {
                        a href="/outbox" class=[(here == "/outbox").then_some("here")] { "Outbox" }
                        @for s in &nav.subscriptions {
                            @let base = format!("/inbox/{}", url_escape(s));
                            a href=(base) class=[(here == base).then_some("here")] { "Inbox · " (s) }
                        }
                        a href="/audit" class=[(here == "/audit").then_some("here")] { "Audit log" }
                        span.who {
                            @match &nav.who { Some(w) => { "token " (w) }, None => { "open console" } }
                            @if !nav.can_write { " · " span.badge { "read-only" } }
                        }
                        @if nav.logout {
                            form method="post" action="/logout" { button type="submit" { "Log out" } }
                        }
                    }
                }
                main { (body) }
                script { (PreEscaped(SCRIPT)) }
            }
        }
    }
}

fn tabs(t: &Target, here: &str) -> Markup {
    let base = t.base();
    html! {
        nav.tabs {
            @for (path, label) in [("", "Overview"), ("/backlog", "Backlog by key"), ("/events", "Failed events")] {
                a href={(base) (path)} class=[(here == path).then_some("here")] { (label) }
            }
        }
    }
}

fn csrf(nav: &Nav) -> Markup {
    html! {
        @if let Some(c) = &nav.csrf { input type="hidden" name="csrf" value=(c); }
    }
}

pub fn login(next: &str, problem: Option<&str>) -> Markup {
    layout(
        None,
        "Log in",
        "",
        None,
        html! {
            h1 { "Log in" }
            p.muted { "Use a token with the admin scope (the same one `mailroom admin --token` takes)." }
            @if let Some(p) = problem { p.notice.warn role="alert" { (p) } }
            form method="post" action="/login" {
                input type="hidden" name="next" value=(next);
                label { "Admin token " input type="password" name="token" id="token" autocomplete="current-password" autofocus; }
                " "
                button.primary type="submit" id="login" { "Log in" }
            }
        },
    )
}

pub fn error(nav: Option<&Nav>, message: &str) -> Markup {
    layout(
        nav,
        "Error",
        "",
        None,
        html! {
            h1 { "Something is wrong" }
            p.notice.warn role="alert" { (message) }
            p { a href="javascript:history.back()" { "Back" } }
        },
    )
}

/// "3m 12s", "2h 5m", "4d 1h".
pub fn human(d: chrono::Duration) -> String {
    let s = d.num_seconds().max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

fn ago(t: DateTime<Utc>) -> String {
    format!("{} ago", human(Utc::now() - t))
}

/// "in 30s" or "due" for a time that has passed.
fn until(t: DateTime<Utc>) -> String {
    let d = t - Utc::now();
    if d <= chrono::Duration::zero() {
        "due".into()
    } else {
        format!("in {}", human(d))
    }
}

fn time(t: DateTime<Utc>) -> Markup {
    html! { time datetime=(t.to_rfc3339()) title=(t.to_rfc3339()) { (t.format("%Y-%m-%d %H:%M:%S")) } }
}

fn status_badge(s: Status) -> Markup {
    html! { span class={"badge " (s.as_str())} { (s.as_str()) } }
}

/// Per-minute counts as a bar chart (inline SVG, no script).
pub fn rate_chart(per_minute: &[u64], covered: usize, what: &str) -> Markup {
    let (w, h, pad) = (600.0f64, 90.0f64, 18.0f64);
    let max = per_minute.iter().copied().max().unwrap_or(0).max(1);
    let total: u64 = per_minute.iter().sum();
    let bw = (w - 2.0) / per_minute.len().max(1) as f64;
    let label =
        format!("{what} per minute over the last hour: {total} in all, at most {max} in a minute");
    html! {
        figure.chart {
            svg width="100%" viewBox={"0 0 " (w) " " (h + pad)} role="img" aria-label=(label) preserveAspectRatio="none" {
                line x1="0" y1=(h) x2=(w) y2=(h) stroke="#d9dee3" {}
                @for (i, v) in per_minute.iter().enumerate() {
                    @let bh = (*v as f64 / max as f64) * (h - 4.0);
                    rect x=(format!("{:.1}", 1.0 + i as f64 * bw)) y=(format!("{:.1}", h - bh)) width=(format!("{:.1}", (bw - 1.0).max(1.0))) height=(format!("{:.1}", bh)) fill="#2357c6" {
                        title { (60 - i) " min ago: " (v) }
                    }
                }
                text x="2" y=(h + 14.0) font-size="11" fill="#5d6b79" { "60 min ago" }
                text x=(w - 2.0) y=(h + 14.0) font-size="11" fill="#5d6b79" text-anchor="end" { "now" }
                text x="2" y="11" font-size="11" fill="#5d6b79" { "max " (max) "/min" }
            }
            figcaption.muted {
                (what) ": " strong.rate-total { (total) } " in the last hour"
                @if covered < 60 { " (this process has counted for " (covered) " min)" }
            }
        }
    }
}

pub fn overview(nav: &Nav, t: &Target, s: &Stats, per_minute: &[u64], covered: usize) -> Markup {
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
            h2 { "Rate" }
            (rate_chart(per_minute, covered, what))
            h2 { "By topic" }
            @if s.topics.is_empty() { p.muted { "No events." } } @else {
                table #topics {
                    thead { tr { th { "topic" } th { "pending" } th { "failed" } th { "completed" } } }
                    tbody {
                        @for tp in &s.topics {
                            tr {
                                td { a href={(base) "/backlog?topic=" (url_escape(&tp.topic))} { (tp.topic) } }
                                td.num { (tp.pending) }
                                td.num { a href={(base) "/events?status=failed&topic=" (url_escape(&tp.topic))} { (tp.failed) } }
                                td.num { (tp.completed) }
                            }
                        }
                    }
                }
            }
        },
    )
}

fn key_rows(t: &Target, keys: &[KeyBacklog]) -> Markup {
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
                        td { (k.topic) }
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

fn filter_fields(f: &EventsFilter) -> Markup {
    html! {
        input type="hidden" name="status" value=(f.status.map(|s| s.as_str()).unwrap_or("any"));
        @for (k, v) in [("topic", &f.topic), ("key", &f.key), ("type", &f.event_type), ("error_contains", &f.error_contains)] {
            @if !v.is_empty() { input type="hidden" name=(k) value=(v); }
        }
    }
}

pub fn events(nav: &Nav, t: &Target, f: &EventsFilter, page: &EventsPage) -> Markup {
    let base = t.base();
    let status = f.status.map(|s| s.as_str()).unwrap_or("any");
    let failed = f.status == Some(Status::Failed);
    let pending = f.status == Some(Status::Pending);
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
                        @if failed || pending { span.muted { " You will see what would happen first." } }
                    }
                }
            }
            @if let Some(n) = page.next_before_id {
                p.pager { a #next-page href={(base) "/events?" (f.query()) "&before=" (n)} { "older →" } }
            }
        },
    )
}

/// The payload as text, pretty JSON, or hex.
fn payload_preview(p: &[u8], headers: &std::collections::BTreeMap<String, String>) -> Markup {
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
            h2 { "Headers" }
            @if e.headers.is_empty() { p.muted { "none" } } @else {
                table #headers { tbody { @for (k, v) in &e.headers { tr { th { code { (k) } } td { code { (v) } } } } } }
            }
            h2 { "Payload" }
            (payload_preview(&e.payload, &e.headers))
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
                        @for (k, v) in form { @if k != "confirm" && k != "csrf" { input type="hidden" name=(k) value=(v); } }
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
                    thead { tr { th { "#" } th { "at" } th { "actor" } th { "action" } th { "box" } th { "count" } th { "selection" } } }
                    tbody {
                        @for a in &page.entries {
                            tr {
                                td { (a.id) }
                                td { (time(a.at)) }
                                td { (a.actor) }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_round_trip() {
        for s in ["billing", "a b/c?d&e", "é", ""] {
            assert_eq!(url_unescape(&url_escape(s)), s);
        }
        assert_eq!(url_unescape("%zz"), "%zz");
    }

    #[test]
    fn the_chart_scales_to_its_maximum() {
        let mut v = vec![0u64; 60];
        v[59] = 10;
        v[58] = 5;
        let svg = rate_chart(&v, 60, "published").into_string();
        assert!(svg.contains("<svg"));
        assert!(svg.contains("15</strong> in the last hour"), "{svg}");
        assert!(svg.contains("max 10/min"));
    }

    #[test]
    fn payloads_preview_by_kind() {
        let h = Default::default();
        assert!(
            payload_preview(br#"{"a":1}"#, &h)
                .into_string()
                .contains("payload-json")
        );
        assert!(
            payload_preview(b"hello", &h)
                .into_string()
                .contains("payload-text")
        );
        let bin = payload_preview(&[0, 159, 146, 150], &h).into_string();
        assert!(
            bin.contains("payload-hex") && bin.contains("00 9f 92 96"),
            "{bin}"
        );
    }
}

//! The console's HTML (maud): one function per page, a shared layout, the rate chart
//! as inline SVG. Everything user-supplied is escaped by maud; URLs are built with
//! `url_escape`.

use chrono::{DateTime, Utc};
use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::{BacklogFilter, EventsFilter, Target};
use crate::domain::Status;
use crate::domain::admin::{
    AuditPage, EventDetail, EventsPage, KeyBacklog, PendingPage, RewindStart, Stats, TopicPause,
    TopicStats,
};

mod event;
mod jobs;
mod lists;

pub use event::*;
pub use jobs::*;
pub use lists::*;

/// What the header shows.
pub struct Nav {
    pub subscriptions: Vec<String>,
    pub who: Option<String>,
    pub can_write: bool,
    pub logout: bool,
    pub csrf: Option<String>,
    /// Show payloads (the `payloads` scope, or `admin`, or an open console).
    pub sees_payloads: bool,
}

/// The outcome of a requeue or cancel (dry run or done).
pub struct ActionResult {
    pub verb: &'static str,
    pub dry_run: bool,
    pub count: i64,
    pub ids: Vec<i64>,
    pub audit_id: Option<i64>,
}

pub(super) const CSS: &str = r#"
:root{--fg:#1d232a;--muted:#5d6b79;--line:#d9dee3;--bg:#f6f7f9;--accent:#2357c6;--bad:#b3261e;--warn:#8a5a00;--ok:#1e7b34}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);background:var(--bg)}
header{background:#1d232a;color:#fff;padding:.5rem 1rem;display:flex;gap:1rem;align-items:center;flex-wrap:wrap}
header a{color:#cfe0ff;text-decoration:none}header a.here{color:#fff;font-weight:600}header .brand{font-weight:700;color:#fff;margin-right:1rem}
header .who{margin-left:auto;color:#aab4bf}header form,form.pause{display:inline}
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

/// Progressive enhancement: "select all" boxes, and a refresh of the overview in place
/// (the page fetched again and its `main` swapped in, no reload; skipped while the
/// operator types in a field or the tab is hidden; a redirect, an expired session,
/// reloads the page instead). `mailroomRefresh()` runs one refresh at once.
pub(super) const SCRIPT: &str = r#"
document.querySelectorAll('input[data-select-all]').forEach(function(all){
  all.hidden=false;
  all.addEventListener('change',function(){
    document.querySelectorAll('input[name=id]').forEach(function(b){b.checked=all.checked});
  });
});
function mailroomRefresh(){
  return fetch(location.href,{credentials:'same-origin'}).then(function(r){
    if(r.redirected||!r.ok){location.reload();return}
    return r.text().then(function(t){
      var m=new DOMParser().parseFromString(t,'text/html').querySelector('main');
      if(m){document.querySelector('main').innerHTML=m.innerHTML}
    });
  });
}
if(document.body.dataset.refresh){
  var every=Number(document.body.dataset.refresh)*1000;
  var tick=function(){
    var busy=Array.prototype.some.call(document.querySelectorAll('main input'),function(i){
      return i===document.activeElement||(i.type!=='hidden'&&i.value)});
    var next=function(){setTimeout(tick,every)};
    if(busy||document.hidden){next();return}
    mailroomRefresh().catch(function(){}).then(next);
  };
  setTimeout(tick,every);
}
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
                        a href="/jobs" class=[(here == "/jobs").then_some("here")] { "Jobs" }
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
            p { a href="/outbox" { "Back to the outbox" } }
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
                @if covered < 60 { " (counted for " (covered) " min so far)" }
            }
        }
    }
}

/// A fresh id for a confirmation form (the admin layer acts once per id).
pub(super) fn request_id() -> String {
    use base64::Engine as _;
    let bytes: [u8; 16] = rand::random();
    format!(
        "console-{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
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

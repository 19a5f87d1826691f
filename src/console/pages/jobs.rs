//! The jobs page: every background job with its progress, a cancel button for the
//! running ones, and a form that starts one (a dry run first, then a confirmation).

use super::*;
use crate::domain::jobs::{Job, JobStart};

/// A start form's dry run, shown above the list with its confirmation.
pub struct JobPreview<'a> {
    pub start: &'a JobStart,
    /// The form's fields, sent again with the confirmation.
    pub fields: &'a [(String, String)],
}

pub fn jobs(nav: &Nav, list: &[Job], next: Option<i64>, preview: Option<JobPreview<'_>>) -> Markup {
    let running = list.iter().any(|j| !j.state.ended());
    layout(
        Some(nav),
        "Jobs",
        "/jobs",
        running.then_some(5),
        html! {
            h1 { "Jobs" }
            p.muted { "Requeue, cancel, republish or redeliver every event a filter selects, in pages of 1,000, in the background: a job survives a restart of the process running it and can be cancelled. " a href="/audit" { "The audit log" } " has each job's start and end." }
            @if let Some(p) = preview {
                section.notice {
                    p { "A " strong { (p.fields.iter().find(|(k, _)| k == "kind").map(|(_, v)| v.as_str()).unwrap_or("")) } " job would select " strong { (p.start.count) } " event(s)"
                        @if !p.start.sample_ids.is_empty() { " (the first: " (p.start.sample_ids.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")) ")" } "." }
                    @if p.start.count > 0 {
                        form method="post" action="/jobs" {
                            @for (k, v) in p.fields { @if k != "confirm" && k != "csrf" && k != "request_id" { input type="hidden" name=(k) value=(v); } }
                            input type="hidden" name="confirm" value="yes";
                            input type="hidden" name="request_id" value=(request_id());
                            (csrf(nav))
                            button type="submit" { "Start the job" }
                        }
                    }
                }
            }
            @if list.is_empty() { p.muted { "No jobs yet." } } @else {
                table #jobs {
                    thead { tr { th { "#" } th { "kind" } th { "box" } th { "state" } th { "progress" } th { "started" } th { "by" } th { "selection" } th {} } }
                    tbody {
                        @for j in list {
                            tr {
                                td { (j.id) }
                                td { (j.kind.as_str()) }
                                td { (j.box_kind.as_str()) }
                                td { span class={"badge job-" (j.state.as_str())} { (j.state.as_str()) }
                                     @if let Some(e) = &j.error { br; span.muted { (e) } } }
                                td.num { progress value=(j.done) max=(j.total.max(1)) {} " " span.done { (j.done) } " / " (j.total) }
                                td { (time(j.created_at)) }
                                td { (j.actor) }
                                td { code { (j.selection) } }
                                td {
                                    @if nav.can_write && !j.state.ended() && j.state != crate::domain::jobs::JobState::Cancelling {
                                        form method="post" action="/jobs" {
                                            input type="hidden" name="action" value="cancel";
                                            input type="hidden" name="id" value=(j.id);
                                            (csrf(nav))
                                            button type="submit" { "Cancel" }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            @if let Some(n) = next { p.pager { a href={"/jobs?before=" (n)} { "older →" } } }
            @if nav.can_write {
                h2 { "Start a job" }
                form.filter method="post" action="/jobs" {
                    input type="hidden" name="action" value="start";
                    label { "kind " select name="kind" {
                        option value="requeue" { "requeue failed events" }
                        option value="cancel" { "cancel pending events" }
                        option value="republish" { "republish completed outbox events" }
                        option value="redeliver" { "redeliver handled inbox messages" }
                    } }
                    label { "box " select name="box" { option value="outbox" { "outbox" } option value="inbox" { "inbox" } } }
                    label { "subscription " input name="subscription" size="12"; }
                    label { "topic " input name="topic" size="16"; }
                    label { "key prefix " input name="key_prefix" size="12"; }
                    label { "error contains " input name="error_contains" size="16"; }
                    label { "reason (cancel) " input name="reason" size="20"; }
                    label { input type="checkbox" name="all" value="yes"; " every such event (no filter)" }
                    (csrf(nav))
                    button type="submit" { "Count (dry run)" }
                }
            }
        },
    )
}

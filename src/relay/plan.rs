//! The ordering rules, as pure functions: which events of a key's line a cycle may
//! publish (`plan_line`), and what the deliveries mean for each event and for the key
//! (`LinePlan::settle`). No I/O here, so every rule is unit-tested.
//!
//! Per (topic, key), walking the line in id order:
//! - a never-tried event scheduled for later is not in line: skipped, it holds nothing;
//!   (tried = an attempt spent or an error recorded: an uncounted retry still holds);
//! - a due event joins the run;
//! - an event that has been tried and waits for its retry blocks the key: the walk stops.
//!
//! `failed` events are not pending, so they are not in the line at all.
//!
//! The store's window already leaves never-tried delayed events out (however many stand
//! at the head of a key) and reports the earliest of their schedules (`delayed_at`);
//! the walk still skips any it is given, so the rule holds either way.

use chrono::{DateTime, Utc};
use rand::Rng;

use super::backoff::RetryPolicy;
use crate::domain::{EventId, StoredEvent};
use crate::sink::{Delivery, Failure};
use crate::store::{EventUpdate, KeyWindow, LineKey, Readiness};

/// Why the walk of a line stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The first in-line event waits out a retry until this time.
    Blocked(DateTime<Utc>),
    /// The cycle's budget ran out while due events remained.
    Budget,
    /// The window was walked to its end.
    End {
        /// A limit cut the window: more rows may follow it.
        full: bool,
    },
}

/// What one cycle does with one key's line.
#[derive(Debug, Clone)]
pub struct LinePlan<'a> {
    /// The key's line; `None` for an unkeyed event.
    pub line: Option<&'a LineKey>,
    /// Consecutive due events to publish, in order.
    pub run: Vec<&'a StoredEvent>,
    /// Why the run stops where it does.
    pub stop: Stop,
    /// Earliest schedule of the never-tried delayed events that were skipped.
    pub delayed_min: Option<DateTime<Utc>>,
    /// Highest id read.
    pub seen_up_to: Option<EventId>,
}

/// Plans one key's line: the run this cycle may publish, at most `budget` events.
pub fn plan_line<'a>(w: &'a KeyWindow, now: DateTime<Utc>, budget: usize) -> LinePlan<'a> {
    let mut plan = LinePlan {
        line: Some(&w.line),
        run: Vec::new(),
        stop: Stop::End { full: w.full },
        delayed_min: w.delayed_at,
        // The key's highest pending id when read (delayed events the window skipped
        // included); zero when nothing was pending: any pending event then counts as new.
        seen_up_to: Some(
            w.rows
                .last()
                .map_or(0, |e| e.id)
                .max(w.line_end.unwrap_or(0)),
        ),
    };
    for e in &w.rows {
        if e.scheduled_at > now {
            // Never tried: no attempt spent and no error recorded. (An uncounted retry
            // leaves attempts at 0 but records why, so it still holds the key.)
            if e.attempts == 0 && e.last_error.is_none() {
                plan.delayed_min = Some(
                    plan.delayed_min
                        .map_or(e.scheduled_at, |m| m.min(e.scheduled_at)),
                );
                continue;
            }
            plan.stop = Stop::Blocked(e.scheduled_at);
            break;
        }
        if plan.run.len() >= budget {
            plan.stop = Stop::Budget;
            break;
        }
        plan.run.push(e);
    }
    plan
}

/// A plan for one claimed unkeyed event: a line of its own, with no key to release.
pub fn plan_single(e: &StoredEvent) -> LinePlan<'_> {
    LinePlan {
        line: None,
        run: vec![e],
        stop: Stop::End { full: false },
        delayed_min: None,
        seen_up_to: Some(e.id),
    }
}

/// Kept as the last error of an event published after an earlier event of its key
/// failed in the same run (shown by `GetEvent`).
pub const GAP_NOTE: &str = "published after an earlier event of its key failed in the same \
     run: the destination may hold it ahead of that event (possible reordering)";

/// What settling one line produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LineOutcome {
    /// The rows to write.
    pub updates: Vec<EventUpdate>,
    /// For a keyed line: when the key may next have work.
    pub ready: Readiness,
    /// Events delivered.
    pub delivered: usize,
    /// Events to retry (an attempt spent).
    pub retried: usize,
    /// Events made failed.
    pub failed: usize,
    /// The destination was unreachable.
    pub transient: bool,
    /// Events the sink delivered after an earlier event of the same run had failed
    /// (possible only when a broker rejects one record of an in-flight run).
    pub delivered_after_failure: usize,
}

impl LinePlan<'_> {
    /// Readiness of the key if nothing of the run is published now.
    pub fn readiness_untouched(&self) -> Readiness {
        if !self.run.is_empty() {
            return Readiness::now();
        }
        self.readiness_after_run()
    }

    fn readiness_after_run(&self) -> Readiness {
        match self.stop {
            // More in line than the window held (the store leaves delayed events out,
            // so a full window holds only in-line events): look again at once. A window
            // the claim's byte budget left empty is full too.
            Stop::Budget | Stop::End { full: true } => Readiness::now(),
            Stop::Blocked(until) => Readiness {
                at: Some(self.delayed_min.map_or(until, |d| d.min(until))),
                ..Default::default()
            },
            Stop::End { full: false } => Readiness {
                at: self.delayed_min,
                after: None,
                seen_up_to: self.seen_up_to,
            },
        }
    }

    /// Turns the sink's deliveries for `run` into event updates and the key's readiness.
    /// The events after the first failure of a run are left exactly as they were.
    pub fn settle(
        &self,
        deliveries: &[Delivery],
        policy: &RetryPolicy,
        rng: &mut impl Rng,
    ) -> LineOutcome {
        let mut out = LineOutcome::default();
        let mut halted: Option<Readiness> = None;
        for (e, d) in self.run.iter().zip(deliveries) {
            match (d, &halted) {
                (Delivery::Delivered, None) => {
                    out.updates.push(EventUpdate::Completed { id: e.id });
                    out.delivered += 1;
                }
                // A gap: the sink published this event although an earlier one of its
                // run failed, so the destination may hold it ahead of that one. It is
                // published (nothing is lost), counted and flagged on the event.
                (Delivery::Delivered, Some(_)) => {
                    out.updates.push(EventUpdate::CompletedAfterGap {
                        id: e.id,
                        note: GAP_NOTE.to_string(),
                    });
                    out.delivered += 1;
                    out.delivered_after_failure += 1;
                }
                (Delivery::Failed(f), None) => {
                    let (update, ready) = self.on_failure(e, f, policy, rng, &mut out);
                    if let Some(u) = update {
                        out.updates.push(u);
                    } else if self.line.is_none() {
                        out.updates.push(EventUpdate::Release { id: e.id });
                    }
                    halted = Some(ready);
                }
                (Delivery::NotAttempted, None) => {
                    if self.line.is_none() {
                        out.updates.push(EventUpdate::Release { id: e.id });
                    }
                    halted = Some(Readiness::now());
                }
                // Behind a failure: untouched.
                (Delivery::Failed(_) | Delivery::NotAttempted, Some(_)) => {}
            }
        }
        out.ready = halted.unwrap_or_else(|| self.readiness_after_run());
        out
    }

    fn on_failure(
        &self,
        e: &StoredEvent,
        f: &Failure,
        policy: &RetryPolicy,
        rng: &mut impl Rng,
        out: &mut LineOutcome,
    ) -> (Option<EventUpdate>, Readiness) {
        let with_delayed = |at: DateTime<Utc>| Readiness {
            at: Some(self.delayed_min.map_or(at, |d| d.min(at))),
            ..Default::default()
        };
        let error = f.error().to_string();
        match f {
            Failure::Transient { .. } => {
                out.transient = true;
                (None, Readiness::now())
            }
            Failure::Rejected { .. } => {
                out.failed += 1;
                let u = EventUpdate::Failed {
                    id: e.id,
                    attempts: e.attempts + 1,
                    error,
                };
                (Some(u), Readiness::now())
            }
            Failure::Deferred { retry_at, .. } => {
                out.retried += 1;
                let u = EventUpdate::RetryAt {
                    id: e.id,
                    attempts: e.attempts,
                    at: *retry_at,
                    error,
                };
                (Some(u), with_delayed(*retry_at))
            }
            Failure::Counted { retry_at, .. } => {
                let attempts = e.attempts + 1;
                if attempts >= e.max_attempts {
                    out.failed += 1;
                    // Terminal: the event no longer holds its key back.
                    let u = EventUpdate::Failed {
                        id: e.id,
                        attempts,
                        error,
                    };
                    return (Some(u), Readiness::now());
                }
                out.retried += 1;
                match retry_at {
                    Some(at) => {
                        let u = EventUpdate::RetryAt {
                            id: e.id,
                            attempts,
                            at: *at,
                            error,
                        };
                        (Some(u), with_delayed(*at))
                    }
                    None => {
                        let delay = policy.delay(e.attempts, rng);
                        let u = EventUpdate::Retry {
                            id: e.id,
                            attempts,
                            delay,
                            error,
                        };
                        let ready = Readiness {
                            at: self.delayed_min,
                            after: Some(delay),
                            seen_up_to: None,
                        };
                        (Some(u), ready)
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use rand::SeedableRng;

    use super::*;
    use crate::domain::Status;

    fn ev(id: i64, attempts: u32, sched_offset_s: i64, now: DateTime<Utc>) -> StoredEvent {
        StoredEvent {
            id,
            topic: "t".into(),
            key: Some("k".into()),
            payload: vec![],
            headers: BTreeMap::new(),
            event_type: None,
            idempotency_key: None,
            status: Status::Pending,
            attempts,
            max_attempts: 3,
            scheduled_at: now + chrono::Duration::seconds(sched_offset_s),
            created_at: now,
            updated_at: now,
            published_at: None,
            last_error: None,
        }
    }

    fn window(rows: Vec<StoredEvent>, full: bool) -> KeyWindow {
        KeyWindow {
            line: LineKey {
                topic: "t".into(),
                key: "k".into(),
            },
            rows,
            full,
            delayed_at: None,
            line_end: None,
        }
    }

    fn ids(p: &LinePlan<'_>) -> Vec<i64> {
        p.run.iter().map(|e| e.id).collect()
    }

    #[test]
    fn a_run_takes_consecutive_due_events() {
        let now = Utc::now();
        let w = window((1..=5).map(|i| ev(i, 0, -1, now)).collect(), false);
        let p = plan_line(&w, now, 100);
        assert_eq!(ids(&p), vec![1, 2, 3, 4, 5]);
        assert_eq!(p.stop, Stop::End { full: false });
    }

    #[test]
    fn a_waiting_retry_blocks_everything_behind_it() {
        let now = Utc::now();
        let w = window(
            vec![ev(1, 0, -1, now), ev(2, 1, 30, now), ev(3, 0, -1, now)],
            false,
        );
        let p = plan_line(&w, now, 100);
        assert_eq!(ids(&p), vec![1]);
        assert!(matches!(p.stop, Stop::Blocked(_)));
        let w = window(vec![ev(2, 1, 30, now), ev(3, 0, -1, now)], false);
        assert!(plan_line(&w, now, 100).run.is_empty());
    }

    #[test]
    fn a_delayed_never_tried_event_does_not_block() {
        let now = Utc::now();
        let w = window(vec![ev(1, 0, 3600, now), ev(2, 0, -1, now)], false);
        let p = plan_line(&w, now, 100);
        assert_eq!(ids(&p), vec![2]);
        assert_eq!(p.delayed_min, Some(now + chrono::Duration::seconds(3600)));
        // Idle afterwards: ready when the delayed one is due.
        let out = p.settle(&[Delivery::Delivered], &RetryPolicy::default(), &mut rng());
        assert_eq!(out.ready.at, p.delayed_min);
    }

    #[test]
    fn due_events_behind_delayed_ones_the_window_skipped_go_out() {
        // Ten delayed events (ids 1..=10) stood at the head; the store's window holds
        // the five due ones behind them and the earliest delayed schedule.
        let now = Utc::now();
        let mut w = window((11..=15).map(|i| ev(i, 0, -1, now)).collect(), false);
        let first_delayed = now + chrono::Duration::seconds(3600);
        w.delayed_at = Some(first_delayed);
        w.line_end = Some(15);
        let p = plan_line(&w, now, 100);
        assert_eq!(ids(&p), vec![11, 12, 13, 14, 15]);
        let out = p.settle(
            &std::iter::repeat_n(Delivery::Delivered, 5).collect::<Vec<_>>(),
            &RetryPolicy::default(),
            &mut rng(),
        );
        // Idle afterwards: ready when the first delayed one is due.
        assert_eq!(out.ready.at, Some(first_delayed));
        assert_eq!(out.ready.after, None);
    }

    #[test]
    fn a_key_with_only_delayed_events_sleeps_until_the_first_is_due() {
        // Nothing in line; the delayed events have ids up to 40. The key is released
        // until the earliest of them, and none of them counts as new (no hot loop).
        let now = Utc::now();
        let mut w = window(Vec::new(), false);
        let first_delayed = now + chrono::Duration::seconds(60);
        w.delayed_at = Some(first_delayed);
        w.line_end = Some(40);
        let p = plan_line(&w, now, 100);
        assert!(p.run.is_empty());
        let ready = p.readiness_untouched();
        assert_eq!(ready.at, Some(first_delayed));
        assert_eq!(ready.after, None);
        assert_eq!(ready.seen_up_to, Some(40));
    }

    #[test]
    fn a_window_the_byte_budget_emptied_is_looked_at_again_at_once() {
        let now = Utc::now();
        let mut w = window(Vec::new(), true);
        w.delayed_at = Some(now + chrono::Duration::seconds(60));
        let p = plan_line(&w, now, 100);
        assert!(p.run.is_empty());
        assert_eq!(p.readiness_untouched(), Readiness::now());
    }

    #[test]
    fn a_blocked_head_wakes_the_key_for_an_earlier_delayed_event() {
        let now = Utc::now();
        let mut w = window(vec![ev(3, 1, 600, now), ev(4, 0, -1, now)], false);
        w.delayed_at = Some(now + chrono::Duration::seconds(60));
        let p = plan_line(&w, now, 100);
        assert!(p.run.is_empty());
        assert_eq!(p.readiness_untouched().at, w.delayed_at);
    }

    #[test]
    fn budget_cuts_the_run_and_keeps_the_key_ready() {
        let now = Utc::now();
        let w = window((1..=5).map(|i| ev(i, 0, -1, now)).collect(), false);
        let p = plan_line(&w, now, 2);
        assert_eq!(ids(&p), vec![1, 2]);
        assert_eq!(p.stop, Stop::Budget);
        let out = p.settle(
            &[Delivery::Delivered, Delivery::Delivered],
            &RetryPolicy::default(),
            &mut rng(),
        );
        assert_eq!(out.ready, Readiness::now());
    }

    fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(1)
    }

    #[test]
    fn a_counted_failure_reschedules_and_leaves_the_rest_untouched() {
        let now = Utc::now();
        let w = window((1..=3).map(|i| ev(i, 0, -1, now)).collect(), false);
        let p = plan_line(&w, now, 100);
        let counted = Delivery::Failed(Failure::Counted {
            error: "too large".into(),
            retry_at: None,
        });
        let out = p.settle(
            &[Delivery::Delivered, counted, Delivery::NotAttempted],
            &RetryPolicy::default(),
            &mut rng(),
        );
        assert_eq!(out.updates.len(), 2);
        assert_eq!(out.updates[0], EventUpdate::Completed { id: 1 });
        match &out.updates[1] {
            EventUpdate::Retry {
                id,
                attempts,
                delay,
                ..
            } => {
                assert_eq!((*id, *attempts), (2, 1));
                assert!(*delay >= Duration::from_secs(5) && *delay <= Duration::from_secs(10));
                assert_eq!(out.ready.after, Some(*delay));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn the_last_attempt_fails_the_event_and_frees_the_key() {
        let now = Utc::now();
        let w = window(vec![ev(1, 2, -1, now), ev(2, 0, -1, now)], false);
        let p = plan_line(&w, now, 100);
        let counted = Delivery::Failed(Failure::Counted {
            error: "x".into(),
            retry_at: None,
        });
        let out = p.settle(
            &[counted, Delivery::NotAttempted],
            &RetryPolicy::default(),
            &mut rng(),
        );
        assert!(matches!(
            out.updates[0],
            EventUpdate::Failed {
                id: 1,
                attempts: 3,
                ..
            }
        ));
        assert_eq!(out.ready, Readiness::now());
        assert_eq!(out.failed, 1);
    }

    #[test]
    fn a_transient_failure_spends_nothing() {
        let now = Utc::now();
        let w = window((1..=2).map(|i| ev(i, 0, -1, now)).collect(), false);
        let p = plan_line(&w, now, 100);
        let t = Delivery::Failed(Failure::Transient {
            error: "down".into(),
        });
        let out = p.settle(
            &[t, Delivery::NotAttempted],
            &RetryPolicy::default(),
            &mut rng(),
        );
        assert!(out.updates.is_empty());
        assert!(out.transient);
        assert_eq!(out.ready, Readiness::now());
    }

    #[test]
    fn an_uncounted_retry_still_holds_its_key() {
        let now = Utc::now();
        let mut head = ev(1, 0, 60, now);
        head.last_error = Some("handler asked for later".into());
        let w = window(vec![head, ev(2, 0, -1, now)], false);
        let p = plan_line(&w, now, 100);
        assert!(p.run.is_empty());
        assert!(matches!(p.stop, Stop::Blocked(_)));
    }

    #[test]
    fn a_deferral_spends_no_attempt() {
        let now = Utc::now();
        let w = window(vec![ev(1, 2, -1, now)], false);
        let p = plan_line(&w, now, 100);
        let at = now + chrono::Duration::seconds(30);
        let d = Delivery::Failed(Failure::Deferred {
            error: "later".into(),
            retry_at: at,
        });
        let out = p.settle(&[d], &RetryPolicy::default(), &mut rng());
        assert!(matches!(
            out.updates[0],
            EventUpdate::RetryAt {
                id: 1,
                attempts: 2,
                ..
            }
        ));
        assert_eq!(out.ready.at, Some(at));
    }

    /// The gap librdkafka can produce: a later record acknowledged after an earlier one
    /// failed. It is not lost, but it is counted and flagged, never silently completed.
    #[test]
    fn a_delivery_after_a_failure_is_flagged() {
        let now = Utc::now();
        let w = window((1..=3).map(|i| ev(i, 0, -1, now)).collect(), false);
        let p = plan_line(&w, now, 100);
        let t = Delivery::Failed(Failure::Transient {
            error: "timed out".into(),
        });
        let out = p.settle(
            &[Delivery::Delivered, t, Delivery::Delivered],
            &RetryPolicy::default(),
            &mut rng(),
        );
        assert_eq!(out.delivered_after_failure, 1);
        assert_eq!(out.updates[0], EventUpdate::Completed { id: 1 });
        assert!(matches!(
            &out.updates[1],
            EventUpdate::CompletedAfterGap { id: 3, note } if note.contains("reordering")
        ));
    }

    #[test]
    fn an_unkeyed_event_not_reached_is_released() {
        let now = Utc::now();
        let e = ev(9, 0, -1, now);
        let p = plan_single(&e);
        let out = p.settle(
            &[Delivery::NotAttempted],
            &RetryPolicy::default(),
            &mut rng(),
        );
        assert_eq!(out.updates, vec![EventUpdate::Release { id: 9 }]);
    }
}

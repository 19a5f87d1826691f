//! One cycle from its claim: plan the lines, gate them by their topic's health, give back
//! what goes nowhere, then deliver and settle (`deliver`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::domains::Gate;
use super::plan::{LinePlan, Stop, plan_line, plan_single};
use super::{ActiveSlot, CycleReport, Shared};
use crate::domain::EventId;
use crate::store::{Claim, KeyRelease, Readiness, Renewal, Settlement, StoreError};

/// One line of a cycle that goes to the sink.
pub(super) struct Outgoing<'a> {
    pub(super) plan: LinePlan<'a>,
    /// The sink's fault domain of the line (a topic, or a Kafka partition).
    pub(super) domain: String,
    pub(super) probe: bool,
}

impl Shared {
    /// Plans a claim, delivers its lines and settles each as it finishes.
    /// `honour_probe_pause`: a topic that looks down waits out its pause (the relay's
    /// loop) instead of being probed at once (a cycle run by hand).
    pub(super) async fn run_cycle(
        self: Arc<Self>,
        claim: Claim,
        honour_probe_pause: bool,
        mut slot: ActiveSlot,
    ) -> Result<CycleReport, StoreError> {
        let started = Instant::now();
        let token = claim.token;
        self.stats.cycles.fetch_add(1, Ordering::Relaxed);
        let mut report = CycleReport {
            keys: claim.keyed.len(),
            ..Default::default()
        };
        let (plans, mut idle) = self.plan_claim(&claim);
        let (out, held_unkeyed) = self.gate_lines(plans, honour_probe_pause, &mut idle);
        self.give_back_held(token, &idle, &held_unkeyed).await?;
        if out.is_empty() {
            return Ok(report);
        }
        if out.iter().all(|o| o.probe) {
            // Only probes of domains that look down: a dead partition that never answers
            // would hold the slot until the delivery deadline, and a few of them would
            // stop the relay from claiming for every topic. Probes are bounded anyway
            // (one per domain in flight, and `MAX_PARKED`).
            slot.release();
        }
        report.attempted = out.iter().map(|o| o.plan.run.len()).sum();
        let delivered_at = Instant::now();
        let (failed, continued) = self
            .deliver_and_settle(token, &out, &mut report, slot)
            .await;
        self.stats.publish_latency.observe(delivered_at.elapsed());
        if report.attempted > 0 {
            self.stats.cycle_latency.observe(started.elapsed());
        }
        // Continued lines accounted for each of their runs as it settled.
        self.account(&report);
        report.add(&continued);
        match failed {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// Plans every line of a claim, the event budget shared in claim order; keys with
    /// nothing to publish now come back as releases.
    pub(super) fn plan_claim<'a>(&self, claim: &'a Claim) -> (Vec<LinePlan<'a>>, Vec<KeyRelease>) {
        let mut budget = self.limits().max_events as usize;
        let mut plans: Vec<LinePlan<'_>> = Vec::new();
        let mut idle = Vec::new();
        for w in &claim.keyed {
            let p = plan_line(w, claim.now, budget);
            budget -= p.run.len();
            if p.run.is_empty() {
                idle.push(KeyRelease {
                    line: w.line.clone(),
                    ready: p.readiness_untouched(),
                    completed: Vec::new(),
                    keep: None,
                });
            } else {
                plans.push(p);
            }
        }
        plans.extend(claim.unkeyed.iter().map(plan_single));
        (plans, idle)
    }

    /// Gates each line by its topic's health: open lines go out, a topic due for a
    /// probe sends one event, a topic that is down holds its lines (keys released with
    /// the wait; unkeyed events returned by how long they wait, one entry per wait).
    pub(super) fn gate_lines<'a>(
        &self,
        plans: Vec<LinePlan<'a>>,
        honour_probe_pause: bool,
        idle: &mut Vec<KeyRelease>,
    ) -> (Vec<Outgoing<'a>>, HashMap<Duration, Vec<EventId>>) {
        let mut out: Vec<Outgoing<'_>> = Vec::with_capacity(plans.len());
        let mut held_unkeyed: HashMap<Duration, Vec<EventId>> = HashMap::new();
        let now = Instant::now();
        let mut domains = self.domains.lock().expect("domains lock");
        for mut plan in plans {
            let domain = self.sink.domain(plan.run[0]);
            match domains.gate(&domain, now, honour_probe_pause) {
                Gate::Open => out.push(Outgoing {
                    plan,
                    domain,
                    probe: false,
                }),
                Gate::Probe => {
                    plan.run.truncate(1);
                    plan.stop = Stop::Budget;
                    out.push(Outgoing {
                        plan,
                        domain,
                        probe: true,
                    });
                }
                Gate::Closed { until } => {
                    let wait = until.saturating_duration_since(now);
                    self.stats.held_back.fetch_add(1, Ordering::Relaxed);
                    match plan.line {
                        Some(line) => idle.push(KeyRelease {
                            line: line.clone(),
                            ready: Readiness {
                                after: Some(wait),
                                ..Default::default()
                            },
                            completed: Vec::new(),
                            keep: None,
                        }),
                        None => held_unkeyed.entry(wait).or_default().push(plan.run[0].id),
                    }
                }
            }
        }
        (out, held_unkeyed)
    }

    /// Keys with nothing to publish go back at once, not after the delivery; unkeyed
    /// events of a topic that is down stay claimed until it is due for a probe.
    pub(super) async fn give_back_held(
        &self,
        token: i64,
        idle: &[KeyRelease],
        held_unkeyed: &HashMap<Duration, Vec<EventId>>,
    ) -> Result<(), StoreError> {
        if !idle.is_empty() {
            self.store
                .settle(Settlement::new(&self.queue, token, &[], idle))
                .await?;
        }
        for (wait, ids) in held_unkeyed {
            self.store
                .renew(Renewal {
                    queue: &self.queue,
                    token,
                    lines: &[],
                    unkeyed: ids,
                    lease: *wait,
                })
                .await?;
        }
        Ok(())
    }
}

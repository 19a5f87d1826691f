//! Continued lines: a deep line goes on past its first run with its key still leased,
//! its next window read while a run is in flight.

use std::sync::atomic::Ordering;

use super::cycle::Outgoing;
use super::plan::{LinePlan, Stop, plan_line};
use super::settle::Decided;
use super::{ActiveSlot, CycleReport, Shared, earliest};
use crate::domain::EventId;
use crate::sink::Delivery;
use crate::store::{ClaimLimits, Continued, LineKey, StoreError};

/// A line goes on past its first run when that run held at least this fraction of a full
/// run (`RelayConfig::max_run`).
const CONTINUE_FRACTION: usize = 8;

/// Lines one relay continues at a time at most; the other deep lines are released after
/// their run, as before, and go back in the ready order.
const MAX_CONTINUING: usize = 2;

/// The longest run of a continued line after its first. Shorter than a claim's runs:
/// the next run waits for the whole of this one to be acknowledged, and the time that
/// takes is the pause between the two.
const CONTINUED_RUN: u32 = 1000;

/// Whether a continued line's next window has events to send now.
fn has_run(c: &Continued) -> bool {
    !plan_line(&c.window, c.now, usize::MAX).run.is_empty()
}

impl Shared {
    /// Whether a line goes on past its run in this cycle, with the permit it holds
    /// meanwhile: a keyed line whose window a limit cut while it held a good part of a
    /// full run (deep lines only: every continued run is settled on its own, which a
    /// cycle of many short lines would pay for), while fewer than `MAX_CONTINUING` lines
    /// of this relay go on, unless the relay is stopping. The bound keeps the other keys'
    /// turn: a line that goes on does not go back in the ready order between its runs,
    /// and a continuing cycle no longer counts among the relay's active cycles.
    pub(super) fn continues(&self, o: &Outgoing<'_>) -> Option<ActiveSlot> {
        let deep = o.plan.line.is_some()
            && !o.probe
            && matches!(o.plan.stop, Stop::Budget | Stop::End { full: true })
            && o.plan.run.len() >= (self.config.max_run as usize / CONTINUE_FRACTION).max(1)
            && self.store.continues_lines(self.queue.box_kind())
            && !self.stopping.is_cancelled();
        if !deep {
            return None;
        }
        let permit = ActiveSlot::take(&self.continuing);
        (self.continuing.load(Ordering::Relaxed) <= MAX_CONTINUING).then_some(permit)
    }

    /// Goes on with a deep line after its first run, keeping its key leased: the next
    /// window (runs of `CONTINUED_RUN`) is read while a run is in flight, and sent as
    /// soon as that run is acknowledged whole; the run's settle (which keeps the lease)
    /// commits behind it, in a lane that applies the line's settles one at a time, in
    /// order, at most one waiting. No run is sent before the one ahead of it is
    /// acknowledged, so the order and the failure rules are a single run's. The line is
    /// released, as any other, after a run that was not delivered whole, when nothing
    /// more is due, when the store says the line cannot go on (`Store::continue_line`),
    /// when a settle failed or when the relay stops. Each run is accounted for as it
    /// settles; returns the sum of the line's runs and the first settle error.
    pub(super) async fn continue_line(
        &self,
        token: i64,
        first: &Outgoing<'_>,
        deliveries: tokio::sync::oneshot::Receiver<Vec<Delivery>>,
        _permit: ActiveSlot,
    ) -> (CycleReport, Option<StoreError>) {
        let (lane_tx, mut lane_rx) = tokio::sync::mpsc::channel::<(Decided, CycleReport)>(1);
        let failed = std::sync::atomic::AtomicBool::new(false);
        let lane_failed = &failed;
        let lane = async {
            let mut total = CycleReport::default();
            let mut error = None;
            while let Some((decided, mut this)) = lane_rx.recv().await {
                if let Err(e) = self.commit(token, decided, &mut this).await {
                    lane_failed.store(true, Ordering::Relaxed);
                    error.get_or_insert(e);
                }
                self.account(&this);
                total.add(&this);
            }
            (total, error)
        };
        let line = async move {
            let line = first.plan.line.expect("continued lines are keyed");
            let mut next = self.read_on(token, line, &first.plan, None).await;
            // The sink reports every line it was given; without a report, nothing went out.
            let mut d = deliveries
                .await
                .unwrap_or_else(|_| vec![Delivery::NotAttempted; first.plan.run.len()]);
            // The schedules of never-tried delayed events the line's earlier runs passed:
            // the release must still wake the key for them.
            let mut delayed: Option<chrono::DateTime<chrono::Utc>> = None;
            let mut held: Option<Continued> = None;
            loop {
                let current = Outgoing {
                    plan: match &held {
                        None => first.plan.clone(),
                        Some(c) => plan_line(&c.window, c.now, usize::MAX),
                    },
                    domain: first.domain.clone(),
                    probe: false,
                };
                let whole = d.len() == current.plan.run.len()
                    && d.iter().all(|x| matches!(x, Delivery::Delivered));
                let go_on = next.take().filter(|c| {
                    whole
                        && !self.stopping.is_cancelled()
                        && !lane_failed.load(Ordering::Relaxed)
                        && has_run(c)
                });
                let Some(following) = go_on else {
                    let mut last = CycleReport::default();
                    let decided = self.decide(vec![(&current, d, None, delayed)], &mut last);
                    let _ = lane_tx.send((decided, last)).await;
                    return;
                };
                let plan = plan_line(&following.window, following.now, usize::MAX);
                let run = plan.run.clone();
                self.stats.continued.fetch_add(1, Ordering::Relaxed);
                let mut this = CycleReport {
                    attempted: run.len(),
                    ..Default::default()
                };
                let keep = Some(self.config.lease);
                let decided = self.decide(vec![(&current, d, keep, None)], &mut this);
                delayed = earliest(delayed, current.plan.delayed_min);
                let (_, mut delivered, read) = tokio::join!(
                    lane_tx.send((decided, this)),
                    self.sink.deliver(std::slice::from_ref(&run)),
                    self.read_on(token, line, &plan, following.horizon),
                );
                d = delivered.pop().unwrap_or_default();
                next = read;
                drop((run, plan, current));
                held = Some(following);
            }
        };
        let ((), done) = tokio::join!(line, lane);
        done
    }

    /// The line's next window after `plan`'s run, or `None` (released then); `horizon`
    /// is the one the line's last window came with (`Store::continue_line`).
    pub(super) async fn read_on(
        &self,
        token: i64,
        line: &LineKey,
        plan: &LinePlan<'_>,
        horizon: Option<EventId>,
    ) -> Option<Continued> {
        let after = plan.run.last()?.id;
        let limits = ClaimLimits {
            max_run: self.config.max_run.min(CONTINUED_RUN),
            ..self.limits()
        };
        let read = self
            .store
            .continue_line(&self.queue, token, line, after, horizon, limits);
        match read.await {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e, "could not read a continued line's next run; it is released");
                None
            }
        }
    }
}

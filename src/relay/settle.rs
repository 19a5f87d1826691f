//! Settle: what finished lines come to (event updates, key releases, the topics'
//! health), decided before the transaction that applies it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::cycle::Outgoing;
use super::{CycleReport, Shared, earliest, millis};
use crate::domain::EventId;
use crate::sink::Delivery;
use crate::store::{EventUpdate, KeyRelease, Settlement, StoreError};

/// What a settle writes, decided before its transaction.
pub(super) struct Decided {
    updates: Vec<EventUpdate>,
    releases: Vec<KeyRelease>,
    /// Events the sink published after an earlier event of their run failed.
    out_of_order: usize,
    /// Events that came back transient.
    transient_events: usize,
}

/// A finished line to settle: its deliveries, the lease to keep (`None`: release) and
/// the earliest delayed schedule an earlier run of the line passed.
pub(super) type Finished<'o, 'a> = (
    &'o Outgoing<'a>,
    Vec<Delivery>,
    Option<Duration>,
    Option<chrono::DateTime<chrono::Utc>>,
);

impl Shared {
    /// Settles finished lines of `out` in one transaction (`decide`, then `commit`).
    pub(super) async fn settle_lines(
        &self,
        token: i64,
        out: &[Outgoing<'_>],
        finished: Vec<(usize, Vec<Delivery>)>,
        report: &mut CycleReport,
    ) -> Result<(), StoreError> {
        let finished = finished
            .into_iter()
            .map(|(i, d)| (&out[i], d, None, None))
            .collect();
        let decided = self.decide(finished, report);
        self.commit(token, decided, report).await
    }

    /// What finished lines come to: their event updates and key releases, counted in
    /// `report`; updates the topics' health. Each line comes with its deliveries,
    /// whether its key stays leased (and for how long), and the earliest delayed
    /// schedule an earlier run of the line passed.
    pub(super) fn decide(
        &self,
        finished: Vec<Finished<'_, '_>>,
        report: &mut CycleReport,
    ) -> Decided {
        let mut updates = Vec::new();
        let mut releases = Vec::new();
        let mut out_of_order = 0;
        let mut transient_events = 0;
        {
            let now = Instant::now();
            let mut rng = rand::rng();
            let mut domains = self.domains.lock().expect("domains lock");
            for (o, d, keep, delayed) in &finished {
                let lo = o.plan.settle(d, &self.config.retry, &mut rng);
                report.delivered += lo.delivered;
                report.retried += lo.retried;
                report.failed += lo.failed;
                report.transient |= lo.transient;
                out_of_order += lo.delivered_after_failure;
                let answered = lo.delivered + lo.retried + lo.failed > 0;
                if lo.transient {
                    transient_events += o
                        .plan
                        .run
                        .len()
                        .saturating_sub(lo.delivered + lo.retried + lo.failed);
                }
                if lo.transient && !answered {
                    if let Some(pause) = domains.record(&o.domain, true, now, &mut rng) {
                        tracing::info!(
                            domain = o.domain,
                            pause_ms = millis(pause),
                            "destination unavailable for this domain (topic or partition); probing it again later"
                        );
                    }
                } else if answered {
                    domains.record(&o.domain, false, now, &mut rng);
                } else if o.probe {
                    domains.probe_abandoned(&o.domain);
                }
                if let Some(line) = o.plan.line {
                    let mut ready = lo.ready;
                    ready.at = earliest(ready.at, *delayed);
                    // In run order, which is id order (the store normalises it anyway).
                    let completed: Vec<EventId> = EventUpdate::completed_ids(&lo.updates).collect();
                    releases.push(KeyRelease {
                        line: line.clone(),
                        ready,
                        completed,
                        keep: *keep,
                    });
                }
                updates.extend(lo.updates);
            }
        }
        Decided {
            updates,
            releases,
            out_of_order,
            transient_events,
        }
    }

    /// Applies what `decide` decided, in one transaction.
    pub(super) async fn commit(
        &self,
        token: i64,
        decided: Decided,
        report: &mut CycleReport,
    ) -> Result<(), StoreError> {
        let Decided {
            updates,
            releases,
            out_of_order,
            transient_events,
        } = decided;
        let span = self.db_span("settle", updates.len());
        let settle = self
            .store
            .settle(Settlement::new(&self.queue, token, &updates, &releases));
        let settled = tracing::Instrument::instrument(settle, span).await?;
        report.stale += settled.stale;
        report.delivered_after_failure += out_of_order;
        report.transient_events += transient_events;
        if settled.stale > 0 {
            tracing::warn!(
                stale = settled.stale,
                "another relay took these events over before the settle; it publishes them now"
            );
        }
        if out_of_order > 0 {
            tracing::warn!(
                count = out_of_order,
                "the sink published events after an earlier event of their key failed; \
                 they are flagged (GetEvent shows it in last_error)"
            );
        }
        Ok(())
    }

    pub(super) fn account(&self, report: &CycleReport) {
        let s = &self.stats;
        s.delivered
            .fetch_add(report.delivered as u64, Ordering::Relaxed);
        s.retried
            .fetch_add(report.retried as u64, Ordering::Relaxed);
        s.failed.fetch_add(report.failed as u64, Ordering::Relaxed);
        s.stale.fetch_add(report.stale as u64, Ordering::Relaxed);
        s.delivered_after_failure
            .fetch_add(report.delivered_after_failure as u64, Ordering::Relaxed);
        s.transient_events
            .fetch_add(report.transient_events as u64, Ordering::Relaxed);
        if report.transient {
            s.transient.fetch_add(1, Ordering::Relaxed);
        }
        if report.delivered > 0 {
            s.unreachable_since_ms.store(0, Ordering::Relaxed);
        } else if report.transient {
            let now = chrono::Utc::now().timestamp_millis();
            let _ = s.unreachable_since_ms.compare_exchange(
                0,
                now,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }
}

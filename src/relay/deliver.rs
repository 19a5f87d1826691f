//! Deliver: hand a cycle's lines to the sink, settle each as it finishes (lingering a
//! moment to settle several together), and renew the leases of lines still in flight.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::cycle::Outgoing;
use super::{ActiveSlot, CycleReport, Shared};
use crate::domain::EventId;
use crate::sink::Delivery;
use crate::store::{LineKey, Renewal, StoreError};

impl Shared {
    /// Delivers the lines and settles them as they finish (finished lines linger a
    /// moment to settle together), renewing the leases of those still in flight. The
    /// slot is given back at the first settle. Deep lines go on past their first run
    /// (`continue_line`). Returns the first settle error and what the continued lines
    /// did after their first run.
    pub(super) async fn deliver_and_settle(
        &self,
        token: i64,
        out: &[Outgoing<'_>],
        report: &mut CycleReport,
        mut slot: ActiveSlot,
    ) -> (Option<StoreError>, CycleReport) {
        let lines: Vec<Vec<&_>> = out.iter().map(|o| o.plan.run.clone()).collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let sink = self.sink.clone();
        let deliver = async move {
            let mut done = |i: usize, d: Vec<Delivery>| {
                let _ = tx.send((i, d));
            };
            sink.deliver_each(&lines, &mut done).await;
        };
        // Deep lines hand their first run's deliveries to a continuation of their own.
        let mut handoff: HashMap<usize, tokio::sync::oneshot::Sender<Vec<Delivery>>> =
            HashMap::new();
        let continued = futures::future::join_all(
            out.iter()
                .enumerate()
                .filter_map(|(i, o)| Some((i, o, self.continues(o)?)))
                .map(|(i, o, permit)| {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    handoff.insert(i, tx);
                    self.continue_line(token, o, rx, permit)
                })
                .collect::<Vec<_>>(),
        );
        let settle_as_done = async {
            let mut outstanding: HashSet<usize> = (0..out.len()).collect();
            let mut finished: Vec<(usize, Vec<Delivery>)> = Vec::new();
            let mut linger: Option<tokio::time::Instant> = None;
            let every = (self.config.lease / 3).max(Duration::from_millis(100));
            let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            let mut first_error = None;
            loop {
                tokio::select! {
                    m = rx.recv() => match m {
                        Some((i, d)) => {
                            outstanding.remove(&i);
                            if let Some(next) = handoff.remove(&i) {
                                let _ = next.send(d);
                                continue;
                            }
                            finished.push((i, d));
                            linger.get_or_insert(tokio::time::Instant::now() + self.config.settle_linger);
                        }
                        None => break,
                    },
                    _ = async { tokio::time::sleep_until(linger.expect("set")).await }, if linger.is_some() => {
                        linger = None;
                        let batch = std::mem::take(&mut finished);
                        if let Err(e) = self.settle_lines(token, out, batch, report).await {
                            first_error.get_or_insert(e);
                        }
                        slot.release();
                        self.progress.notify_one();
                    }
                    _ = renew.tick(), if self.config.renew_leases => {
                        self.renew_outstanding(token, out, &outstanding).await;
                    }
                }
            }
            if !finished.is_empty()
                && let Err(e) = self.settle_lines(token, out, finished, report).await
            {
                first_error.get_or_insert(e);
            }
            // Only continued lines remain: the relay may claim beside them.
            slot.release();
            self.progress.notify_one();
            first_error
        };
        let ((), mut failed, continued) = tokio::join!(deliver, settle_as_done, continued);
        let mut more = CycleReport::default();
        for (r, e) in continued {
            more.add(&r);
            if let Some(e) = e {
                failed.get_or_insert(e);
            }
        }
        (failed, more)
    }

    /// Extends the leases of the lines still in flight.
    pub(super) async fn renew_outstanding(
        &self,
        token: i64,
        out: &[Outgoing<'_>],
        outstanding: &HashSet<usize>,
    ) {
        let mut lines: Vec<LineKey> = Vec::new();
        let mut unkeyed: Vec<EventId> = Vec::new();
        for i in outstanding {
            match out[*i].plan.line {
                Some(l) => lines.push(l.clone()),
                None => unkeyed.push(out[*i].plan.run[0].id),
            }
        }
        if lines.is_empty() && unkeyed.is_empty() {
            return;
        }
        let asked = lines.len() + unkeyed.len();
        match self
            .store
            .renew(Renewal {
                queue: &self.queue,
                token,
                lines: &lines,
                unkeyed: &unkeyed,
                lease: self.config.lease,
            })
            .await
        {
            Ok(held) => {
                self.stats.renewals.fetch_add(1, Ordering::Relaxed);
                if held < asked {
                    self.stats
                        .renewals_lost
                        .fetch_add((asked - held) as u64, Ordering::Relaxed);
                    tracing::warn!(
                        lost = asked - held,
                        "leases of lines still in flight were taken by another relay"
                    );
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not renew the leases of lines in flight"),
        }
    }
}

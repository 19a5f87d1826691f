//! A sink wrapper that injects failures before the real sink sees an event: counted and
//! transient failures at given rates, for stand tests of the ordering and retry rules.

use std::sync::Mutex;

use rand::{RngExt, SeedableRng};

use super::{Delivery, Failure, Sink};
use crate::domain::StoredEvent;

/// Fault injection (testing only): fails a share of deliveries, counted or transient, over a real sink.
pub struct FaultySink<S> {
    inner: S,
    counted_rate: f64,
    transient_rate: f64,
    rng: Mutex<rand::rngs::StdRng>,
}

impl<S: Sink> FaultySink<S> {
    /// Over `inner`, failing the given shares, reproducibly from `seed`.
    pub fn new(inner: S, counted_rate: f64, transient_rate: f64, seed: u64) -> Self {
        FaultySink {
            inner,
            counted_rate,
            transient_rate,
            rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
        }
    }
}

#[async_trait::async_trait]
impl<S: Sink> Sink for FaultySink<S> {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        // Decide each event's fate first; pass the surviving prefix of each line on.
        let mut fates: Vec<Vec<Option<Failure>>> = Vec::with_capacity(lines.len());
        let mut transient = false;
        {
            let mut rng = self.rng.lock().expect("rng lock");
            for line in lines {
                let mut f = Vec::with_capacity(line.len());
                for _ in line.iter() {
                    let x: f64 = rng.random();
                    f.push(if transient {
                        None
                    } else if x < self.transient_rate {
                        transient = true;
                        Some(Failure::Transient {
                            error: "injected transient failure".into(),
                        })
                    } else if x < self.transient_rate + self.counted_rate {
                        Some(Failure::Counted {
                            error: "injected counted failure".into(),
                            retry_at: None,
                        })
                    } else {
                        None
                    });
                }
                fates.push(f);
            }
        }
        let pass: Vec<Vec<&StoredEvent>> = lines
            .iter()
            .zip(&fates)
            .map(|(l, f)| {
                l.iter()
                    .zip(f)
                    .take_while(|(_, f)| f.is_none())
                    .map(|(e, _)| *e)
                    .collect()
            })
            .collect();
        let pass_count: Vec<usize> = pass.iter().map(Vec::len).collect();
        let inner = if transient {
            // After a transient failure nothing new goes out this cycle.
            pass.iter()
                .map(|l| vec![Delivery::NotAttempted; l.len()])
                .collect()
        } else {
            self.inner.deliver(&pass).await
        };
        lines
            .iter()
            .zip(fates)
            .zip(inner)
            .zip(pass_count)
            .map(|(((line, fates), mut out), n)| {
                if n < line.len() {
                    out.push(Delivery::Failed(
                        fates[n].clone().expect("stopped at a fault"),
                    ));
                }
                out.resize(line.len(), Delivery::NotAttempted);
                out
            })
            .collect()
    }

    fn domain(&self, e: &StoredEvent) -> String {
        self.inner.domain(e)
    }

    fn topic_limits(&self) -> Option<super::kafka::topic_limits::TopicLimits> {
        self.inner.topic_limits()
    }

    fn follows_pauses(&self) -> bool {
        self.inner.follows_pauses()
    }

    fn paused(&self, topics: &std::collections::HashSet<String>) {
        self.inner.paused(topics)
    }
}

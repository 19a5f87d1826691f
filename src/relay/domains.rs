//! Fault domains: the unit a transient failure takes out of service. For a Kafka sink a
//! domain is a topic (one topic's leader or ACL can fail while others are fine); the
//! relay keeps one probe state per domain, so a dead topic is probed one event at a time
//! while every other topic keeps its pace. Pure state, no I/O.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::backoff::ProbeBackoff;

/// What a cycle may do with a line of a domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// Healthy: publish the run.
    Open,
    /// Believed down and due for a probe: publish one event of this line, and hold the
    /// domain's other lines until the probe answers.
    Probe,
    /// Believed down: do not publish; look again at `until`.
    Closed {
        /// When to look again.
        until: Instant,
    },
}

#[derive(Debug)]
struct Probe {
    backoff: ProbeBackoff,
    due: Instant,
    pause: Duration,
    in_flight: bool,
}

/// Probe state of every domain that looked down recently. Healthy domains have no entry.
#[derive(Debug)]
pub struct Domains {
    map: HashMap<String, Probe>,
    min: Duration,
    max: Duration,
}

impl Domains {
    /// Gates whose pauses run from `min` to `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        Domains {
            map: HashMap::new(),
            min,
            max,
        }
    }

    /// The gate for one line of `domain`. `honour_due`: wait out the probe pause (the
    /// relay's loop); `false` probes at once (a cycle run by hand).
    pub fn gate(&mut self, domain: &str, now: Instant, honour_due: bool) -> Gate {
        let Some(p) = self.map.get_mut(domain) else {
            return Gate::Open;
        };
        if p.in_flight {
            return Gate::Closed {
                until: now + p.pause.max(self.min),
            };
        }
        if !honour_due || now >= p.due {
            p.in_flight = true;
            return Gate::Probe;
        }
        Gate::Closed { until: p.due }
    }

    /// Records what a line of `domain` came back with. Returns the new probe pause when
    /// the domain is (still) down.
    pub fn record(
        &mut self,
        domain: &str,
        transient: bool,
        now: Instant,
        rng: &mut impl rand::Rng,
    ) -> Option<Duration> {
        if !transient {
            // The destination answered (delivered, or refused a record): it is up.
            self.map.remove(domain);
            return None;
        }
        if let Some(p) = self.map.get(domain)
            && !p.in_flight
            && now < p.due
        {
            // Another line of an outage already recorded (lines in flight when it began
            // come back one by one): one outage, one step of backoff.
            return Some(p.pause);
        }
        let (min, max) = (self.min, self.max);
        let p = self.map.entry(domain.to_string()).or_insert_with(|| Probe {
            backoff: ProbeBackoff::new(min, max),
            due: now,
            pause: min,
            in_flight: false,
        });
        let d = p.backoff.failed(rng);
        p.pause = d;
        p.due = now + d;
        p.in_flight = false;
        Some(d)
    }

    /// A probe that was not sent after all (its cycle stopped): the domain may probe again.
    pub fn probe_abandoned(&mut self, domain: &str) {
        if let Some(p) = self.map.get_mut(domain) {
            p.in_flight = false;
        }
    }

    /// Domains currently believed down.
    pub fn down(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(3)
    }

    #[test]
    fn the_lines_of_one_outage_step_the_backoff_once() {
        let mut d = Domains::new(Duration::from_millis(200), Duration::from_secs(5));
        let t0 = Instant::now();
        let mut r = rng();
        let first = d.record("down", true, t0, &mut r).unwrap();
        for _ in 0..20 {
            assert_eq!(d.record("down", true, t0, &mut r), Some(first));
        }
        assert_eq!(d.gate("down", t0 + first, true), Gate::Probe);
        let second = d.record("down", true, t0 + first, &mut r).unwrap();
        assert!(
            second >= Duration::from_millis(200),
            "a failed probe steps it: {second:?}"
        );
    }

    #[test]
    fn a_healthy_domain_is_open() {
        let mut d = Domains::new(Duration::from_millis(200), Duration::from_secs(5));
        assert_eq!(d.gate("orders", Instant::now(), true), Gate::Open);
    }

    #[test]
    fn a_down_domain_waits_then_probes_once_and_the_others_stay_open() {
        let mut d = Domains::new(Duration::from_millis(200), Duration::from_secs(5));
        let t0 = Instant::now();
        let pause = d.record("down", true, t0, &mut rng()).unwrap();
        assert!(pause >= Duration::from_millis(100) && pause <= Duration::from_millis(200));
        assert_eq!(
            d.gate("up", t0, true),
            Gate::Open,
            "other topics keep going"
        );
        assert_eq!(d.gate("down", t0, true), Gate::Closed { until: t0 + pause });
        let later = t0 + pause;
        assert_eq!(d.gate("down", later, true), Gate::Probe);
        // One probe at a time: the domain's other lines wait for its answer.
        assert!(matches!(d.gate("down", later, true), Gate::Closed { .. }));
        // The probe fails: a longer pause; it succeeds: open again.
        let second = d.record("down", true, later, &mut rng()).unwrap();
        assert!(second >= Duration::from_millis(200));
        assert!(d.record("down", false, later, &mut rng()).is_none());
        assert_eq!(d.gate("down", later, true), Gate::Open);
        assert_eq!(d.down(), 0);
    }

    #[test]
    fn a_cycle_run_by_hand_probes_at_once() {
        let mut d = Domains::new(Duration::from_millis(200), Duration::from_secs(5));
        let t0 = Instant::now();
        d.record("down", true, t0, &mut rng());
        assert_eq!(d.gate("down", t0, false), Gate::Probe);
        d.probe_abandoned("down");
        assert_eq!(d.gate("down", t0, false), Gate::Probe);
    }
}

//! Retry timing. Counted failures wait an equal-jitter exponential backoff:
//! `d = min(cap, base · 2^attempts_made)`, the wait drawn uniformly from `[d/2, d]`.
//! Equal jitter (not full jitter) so a retry never comes back almost at once.

use std::time::Duration;

/// Per-box retry settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Base delay; zero means "next cycle".
    pub base: Duration,
    /// Cap on the un-jittered delay.
    pub cap: Duration,
    /// Default attempt budget for events that do not carry their own.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: Duration::from_secs(10),
            cap: Duration::from_secs(3600),
            max_attempts: 6,
        }
    }
}

impl RetryPolicy {
    /// The un-jittered delay `d` after a failure with `attempts_made` attempts spent
    /// before it.
    pub fn ceiling(&self, attempts_made: u32) -> Duration {
        crate::backoff::ceiling(self.base, self.cap, attempts_made)
    }

    /// The wait before the next attempt, drawn from `[d/2, d]`.
    pub fn delay(&self, attempts_made: u32, rng: &mut impl rand::Rng) -> Duration {
        crate::backoff::equal_jitter(self.ceiling(attempts_made), rng)
    }
}

/// The relay's own pause after a transient failure: doubling from `min` to `max`, equal
/// jitter, reset by the next success. It throttles probes of a dead destination.
pub type ProbeBackoff = crate::backoff::Backoff;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn waits_follow_the_reference_schedule() {
        let p = RetryPolicy::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let expected = [(5, 10), (10, 20), (20, 40), (40, 80), (80, 160)];
        for (made, (lo, hi)) in expected.into_iter().enumerate() {
            for _ in 0..200 {
                let d = p.delay(u32::try_from(made).expect("five attempts"), &mut rng);
                assert!(
                    d >= Duration::from_secs(lo) && d <= Duration::from_secs(hi),
                    "attempt {made}: {d:?} outside [{lo}, {hi}]"
                );
            }
        }
    }

    #[test]
    fn cap_and_zero_base() {
        let p = RetryPolicy::default();
        assert_eq!(p.ceiling(40), Duration::from_secs(3600));
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert!(p.delay(40, &mut rng) >= Duration::from_secs(1800));
        let zero = RetryPolicy {
            base: Duration::ZERO,
            ..p
        };
        assert_eq!(zero.delay(3, &mut rng), Duration::ZERO);
    }

    #[test]
    fn jitter_spreads_over_the_window() {
        let p = RetryPolicy::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let v: Vec<Duration> = (0..1000).map(|_| p.delay(0, &mut rng)).collect();
        assert!(v.iter().any(|d| *d < Duration::from_millis(6000)));
        assert!(v.iter().any(|d| *d > Duration::from_millis(9000)));
    }
}

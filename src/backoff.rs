//! Backoff, written once (issue 26, item 1): a capped exponential ceiling `d` and an
//! equal-jitter wait drawn uniformly from `[d/2, d]` (equal, not full, jitter, so a
//! retry never comes back almost at once). The relay's retry schedule
//! (`relay::backoff::RetryPolicy`), its probes of a dead destination and database, the
//! LISTEN connection's reconnects and the store's re-runs of aborted transactions all
//! wait this way.

use std::time::Duration;

use rand::RngExt;

/// `min(cap, base · 2^n)`, saturating.
pub fn ceiling(base: Duration, cap: Duration, n: u32) -> Duration {
    let factor = 2u32.checked_pow(n.min(31)).unwrap_or(u32::MAX);
    base.saturating_mul(factor).min(cap)
}

/// A wait drawn from `[d/2, d]`.
pub fn equal_jitter(d: Duration, rng: &mut impl rand::Rng) -> Duration {
    if d.is_zero() {
        return Duration::ZERO;
    }
    let half = d / 2;
    // Saturates: a span past u64::MAX µs (half a million years) is not a backoff.
    let span = u64::try_from((d - half).as_micros()).unwrap_or(u64::MAX);
    half + Duration::from_micros(rng.random_range(0..=span))
}

/// Failures in a row, and the pause after each: doubling from `min` to `max` with equal
/// jitter, back to `min` after a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    /// A backoff from `min`, doubling up to `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            failures: 0,
        }
    }

    /// One more failure in a row: the pause before the next try.
    pub fn failed(&mut self, rng: &mut impl rand::Rng) -> Duration {
        let d = equal_jitter(ceiling(self.min, self.max, self.failures), rng);
        self.failures = self.failures.saturating_add(1);
        d
    }

    /// A success: the next failure starts from `min` again.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// Whether the last try failed.
    pub fn failing(&self) -> bool {
        self.failures > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn pauses_double_up_to_the_cap_with_equal_jitter() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        for ceiling in [1u64, 2, 4, 8, 16, 30, 30, 30] {
            let p = b.failed(&mut rng);
            let ceiling = Duration::from_secs(ceiling);
            assert!(
                p >= ceiling / 2 && p <= ceiling,
                "{p:?} outside {ceiling:?}"
            );
        }
        assert!(b.failing());
        b.succeeded();
        assert!(!b.failing());
        assert!(b.failed(&mut rng) <= Duration::from_secs(1));
    }
}

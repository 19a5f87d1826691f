//! Claim spacing: when a relay whose last claim took all there was may claim again,
//! alone and beside the other relays of its box (docs/relay.md, "Claim spacing").

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// When the relays of one box in this process last began a claim that took all there
/// was, so that they space such claims between them and not only each its own: with the
/// spacing `s` and `n` relays, a relay's next claim waits until `s` after its own last
/// one and `s / n` after anyone's. Without it the relays' claims fell close together
/// (one relay's claim, then the other's on the next commit), and an event committed
/// after both waited nearly a whole spacing (docs/relay.md, "Claim spacing").
#[derive(Debug)]
pub struct ClaimCadence {
    relays: u32,
    last: Mutex<Option<tokio::time::Instant>>,
}

impl ClaimCadence {
    /// A cadence for `relays` relays (at least one).
    pub fn new(relays: usize) -> Arc<Self> {
        Arc::new(ClaimCadence {
            relays: u32::try_from(relays.max(1)).unwrap_or(u32::MAX),
            last: Mutex::new(None),
        })
    }

    /// A claim that took all there was began at `at`.
    pub(super) fn began(&self, at: tokio::time::Instant) {
        let mut last = self.last.lock().expect("cadence lock");
        *last = Some(last.map_or(at, |l| l.max(at)));
    }

    /// When a relay whose last claim took all there was and began at `own` may claim
    /// again (`None`: at once).
    pub(super) fn next_claim(
        &self,
        own: Option<tokio::time::Instant>,
        spacing: Duration,
    ) -> Option<tokio::time::Instant> {
        let own = own? + spacing;
        let anyone = *self.last.lock().expect("cadence lock");
        Some(anyone.map_or(own, |t| own.max(t + spacing / self.relays)))
    }
}

/// Something asks for a claim: it is wanted at once, or (the last claim took all there
/// was) at `next`, a timer set in `due` (`ClaimCadence::next_claim`).
pub(super) fn spaced(
    want: &mut bool,
    due: &mut Option<tokio::time::Instant>,
    next: Option<tokio::time::Instant>,
) {
    match next {
        Some(at) if tokio::time::Instant::now() < at => {
            due.get_or_insert(at);
        }
        _ => *want = true,
    }
}

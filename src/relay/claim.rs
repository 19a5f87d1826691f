//! Claim: the limits of a cycle's claim, the claim itself behind the schema gate, and
//! whether it hit a limit (a backlog likely remains).

use super::Shared;
use crate::store::{Claim, ClaimLimits, StoreError};

impl Shared {
    pub(super) fn limits(&self) -> ClaimLimits {
        let c = &self.config;
        ClaimLimits {
            max_keys: c.max_keys.clamp(1, c.batch_size),
            max_events: c.batch_size,
            max_run: c.max_run,
            max_unkeyed: c.batch_size,
            max_bytes: c.max_bytes,
            lease: c.lease,
        }
    }

    /// The claim, in a debug-level database span (exported with
    /// `MAILROOM_TRACE_FILTER=mailroom=debug`: relays claim every poll interval).
    pub(super) async fn claim(&self, token: i64) -> Result<Claim, StoreError> {
        let span = self.db_span("claim", 0);
        let claim = self.store.claim(&self.queue, token, self.limits());
        tracing::Instrument::instrument(claim, span).await
    }

    /// A debug-level database span for this relay's `operation` on its box's events
    /// (none, and nothing formatted, unless debug spans are wanted).
    pub(super) fn db_span(&self, operation: &str, batch: usize) -> tracing::Span {
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return tracing::Span::none();
        }
        let table = match self.queue.box_kind() {
            crate::domain::BoxKind::Outbox => "outbox_events",
            crate::domain::BoxKind::Inbox => "inbox_events",
        };
        crate::telemetry::db_span(
            tracing::Level::DEBUG,
            self.store.engine(),
            &format!("{operation} {table}"),
            operation,
            table,
            batch,
        )
    }

    /// A claim, or an empty one while the schema gate says no (the gate logs that once;
    /// the relay looks again after its poll interval).
    pub(super) async fn claim_if_allowed(&self, token: i64) -> Result<Claim, StoreError> {
        match &self.schema {
            Some(gate) if !gate.allows().await => Ok(Claim {
                token,
                now: chrono::Utc::now(),
                keyed: Vec::new(),
                unkeyed: Vec::new(),
            }),
            _ => self.claim(token).await,
        }
    }

    /// Whether a claim hit one of its limits (keys, events, a window cut): a backlog
    /// likely remains, so the next claim is not spaced (`RelayConfig::claim_spacing`).
    pub(super) fn filled(&self, claim: &Claim) -> bool {
        let limits = self.limits();
        let events: usize = claim.keyed.iter().map(|w| w.rows.len()).sum();
        claim.keyed.len() >= limits.max_keys as usize
            || events >= limits.max_events as usize
            || claim.keyed.iter().any(|w| w.full)
            || claim.unkeyed.len() >= limits.max_unkeyed as usize
    }
}

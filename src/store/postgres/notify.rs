//! Cross-process wake-ups on PostgreSQL: after a commit, a coalesced `NOTIFY` (sent by a
//! task of its own, never on the commit path); every process `LISTEN`s and wakes its
//! relays. The relays' poll interval stays as the fallback, so a lost notification costs
//! latency, never an event.
//!
//! A listener that cannot connect or `LISTEN` (a pooler in transaction mode refuses it on
//! every connection), or whose connection keeps dropping, reconnects after a capped
//! exponential backoff with equal jitter, logging each failure once: never a hot loop.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The `LISTEN`/`NOTIFY` channel of the wake-ups after enqueue commits.
pub const CHANNEL: &str = "mailroom_outbox";

/// The first pause after a failure; it doubles with each further failure.
const FIRST_PAUSE: Duration = Duration::from_secs(1);
/// The longest pause.
const MAX_PAUSE: Duration = Duration::from_secs(30);
/// A session that lasted this long was healthy: the next failure starts the backoff over.
const STABLE: Duration = Duration::from_secs(60);

/// Sends at most one NOTIFY per `gap` while commits keep arriving.
pub async fn notifier(
    pool: PgPool,
    trigger: Arc<Notify>,
    gap: Duration,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = trigger.notified() => {}
        }
        if let Err(e) = sqlx::query("SELECT pg_notify($1, '')")
            .bind(CHANNEL)
            .execute(&pool)
            .await
        {
            tracing::debug!(error = %e, "NOTIFY failed; other processes fall back to polling");
        }
        tokio::time::sleep(gap).await;
    }
}

/// Listens for other processes' commits and calls `wake` for each. After each
/// (re)connect `wake` is called once: notifications sent while the listener was away are
/// lost, so the local relays look for work themselves. Failures back off (`Backoff`).
pub async fn listener(pool: PgPool, wake: impl Fn() + Send + Sync, shutdown: CancellationToken) {
    let backoff = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
    reconnecting(
        || session(&pool, &wake),
        tokio::time::sleep,
        &shutdown,
        backoff,
    )
    .await;
}

/// One connection's life: connect, `LISTEN`, wake, then wake on every notification until
/// the connection fails.
async fn session(pool: &PgPool, wake: &(impl Fn() + Sync)) -> Result<Infallible, sqlx::Error> {
    let mut l = PgListener::connect_with(pool).await?;
    l.listen(CHANNEL).await?;
    wake();
    loop {
        l.recv().await?;
        wake();
    }
}

/// Runs `session` until shutdown, again after each failure once the backoff's pause has
/// passed (waited with `sleep`). A session only ends by failing.
async fn reconnecting<F, Fut, S, SFut>(
    mut session: F,
    sleep: S,
    shutdown: &CancellationToken,
    mut backoff: Backoff,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Infallible, sqlx::Error>>,
    S: Fn(Duration) -> SFut,
    SFut: Future<Output = ()>,
{
    loop {
        let started = tokio::time::Instant::now();
        let e = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            r = session() => match r {
                Err(e) => e,
            },
        };
        if started.elapsed() >= STABLE {
            backoff.reset();
        }
        let pause = backoff.next_pause();
        tracing::warn!(error = %e, pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
            "LISTEN failed or its connection was lost; reconnecting after a pause");
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = sleep(pause) => {}
        }
    }
}

/// Capped exponential backoff with equal jitter: the n-th pause in a row is half of
/// `min(cap, first·2ⁿ)` plus a random part of up to the other half.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    failures: u32,
}

impl Backoff {
    /// A backoff whose first ceiling is `first`, doubling per failure up to `cap`.
    pub fn new(first: Duration, cap: Duration) -> Self {
        Backoff {
            first,
            cap,
            failures: 0,
        }
    }

    /// The pause before the next attempt; each call is one more failure in a row.
    pub fn next_pause(&mut self) -> Duration {
        let ceiling = self
            .first
            .saturating_mul(1u32 << self.failures.min(20))
            .min(self.cap);
        self.failures = self.failures.saturating_add(1);
        let half = ceiling / 2;
        // Saturates rather than wraps for a cap beyond u64::MAX ms (no real cap is).
        let half_ms = u64::try_from(half.as_millis()).unwrap_or(u64::MAX);
        let jitter = rand::RngExt::random_range(&mut rand::rng(), 0..=half_ms);
        half + Duration::from_millis(jitter)
    }

    /// After a success: the next pause is the first again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    use super::*;

    #[test]
    fn pauses_double_up_to_the_cap_with_jitter() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        for ceiling in [1u64, 2, 4, 8, 16, 30, 30, 30] {
            let p = b.next_pause();
            let ceiling = Duration::from_secs(ceiling);
            assert!(
                p >= ceiling / 2 && p <= ceiling,
                "{p:?} outside {ceiling:?}"
            );
        }
        b.reset();
        assert!(b.next_pause() <= Duration::from_secs(1));
    }

    /// A listener whose every attempt fails at once (as against a closed port) makes a
    /// bounded number of attempts in a window, not a hot loop. The clock is virtual: the
    /// pauses are added up, not waited for, and shutdown comes when they pass 60 s.
    #[tokio::test]
    async fn failing_sessions_back_off() {
        let attempts = AtomicU32::new(0);
        let waited_ms = AtomicU64::new(0);
        let shutdown = CancellationToken::new();
        let session = || async {
            attempts.fetch_add(1, Ordering::SeqCst);
            Err(sqlx::Error::PoolTimedOut)
        };
        let sleep = |pause: Duration| {
            let ms = u64::try_from(pause.as_millis()).expect("pauses are at most 30 s");
            let total = waited_ms.fetch_add(ms, Ordering::SeqCst) + ms;
            if total > 60_000 {
                shutdown.cancel();
            }
            std::future::ready(())
        };
        let backoff = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
        tokio::time::timeout(
            Duration::from_secs(5),
            reconnecting(session, sleep, &shutdown, backoff),
        )
        .await
        .expect("shutdown ends the listener");
        // In 60 s, at least the pauses' upper bounds 1+2+4+8+16 s (5 pauses, 6 attempts)
        // fit, at most their lower bounds 0.5+1+2+4+8+15+15 s (7 pauses, 8 attempts).
        let n = attempts.load(Ordering::SeqCst);
        assert!((6..=8).contains(&n), "{n} attempts in 60 s");
    }
}

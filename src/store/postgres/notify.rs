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
            backoff.succeeded();
        }
        let pause = backoff.failed(&mut rand::rng());
        tracing::warn!(error = %e, pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
            "LISTEN failed or its connection was lost; reconnecting after a pause");
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = sleep(pause) => {}
        }
    }
}

use crate::backoff::Backoff;

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    use super::*;

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

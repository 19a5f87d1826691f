//! Cross-process wake-ups on PostgreSQL: after a commit, a coalesced `NOTIFY` (sent by a
//! task of its own, never on the commit path); every process `LISTEN`s and wakes its
//! relays. The relays' poll interval stays as the fallback, so a lost notification costs
//! latency, never an event.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::intake::Wakeup;

pub const CHANNEL: &str = "mailroom_outbox";

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

/// Listens for other processes' commits and wakes the local relays. Reconnects on error,
/// backing off from 1 s to 30 s while connecting or `LISTEN` keeps failing (a pooler in
/// transaction mode refuses `LISTEN` on every connection: that must not be a hot loop).
/// After each reconnect the local relays are woken once: notifications sent while the
/// listener was away are lost, so they look for work themselves.
pub async fn listener(pool: PgPool, wakeup: Wakeup, shutdown: CancellationToken) {
    let mut pause = Duration::from_secs(1);
    while !shutdown.is_cancelled() {
        let listening = match PgListener::connect_with(&pool).await {
            Ok(mut l) => match l.listen(CHANNEL).await {
                Ok(()) => Ok(l),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        let mut l = match listening {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, pause_ms = pause.as_millis() as u64, "LISTEN failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(30));
                continue;
            }
        };
        pause = Duration::from_secs(1);
        wakeup.wake_local();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                n = l.recv() => match n {
                    Ok(_) => wakeup.wake_local(),
                    Err(e) => {
                        tracing::debug!(error = %e, "LISTEN connection lost; reconnecting");
                        break;
                    }
                }
            }
        }
    }
}

//! Deliveries per minute, kept in the database (issue 44, item 5), for the console's
//! rate chart: every replica adds its relays' and dispatchers' deliveries to the current
//! minute's row every `FLUSH_EVERY` (one upsert per box and subscription), so every
//! replica's console shows the same history, and a restart loses none of it. Rows older
//! than `KEEP` are deleted by the same task.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::domain::BoxKind;
use crate::domain::admin::RateCount;
use crate::inbox::InboxHandles;
use crate::relay::RelayStats;
use crate::store::{Store, StoreResult};

/// How often a process adds its deliveries to the database.
pub const FLUSH_EVERY: Duration = Duration::from_secs(10);
/// How far back the chart looks, in minutes.
pub const WINDOW_MINUTES: usize = 60;
/// Rows older than this many minutes are deleted.
const KEEP_MINUTES: i64 = 120;

/// This process's delivery counters at the last flush.
#[derive(Default, Clone)]
struct Counts {
    outbox: u64,
    inbox: HashMap<String, u64>,
}

/// Adds this process's deliveries to the database and reads the history back.
pub struct RateRecorder {
    store: Arc<dyn Store>,
    relays: Vec<Arc<RelayStats>>,
    inbox: InboxHandles,
    flushed: Mutex<Counts>,
}

/// The relays' and dispatchers' delivery counters now.
fn counts(relays: &[Arc<RelayStats>], inbox: &InboxHandles) -> Counts {
    use std::sync::atomic::Ordering::Relaxed;
    Counts {
        outbox: relays.iter().map(|r| r.delivered.load(Relaxed)).sum(),
        inbox: inbox
            .dispatch_stats
            .iter()
            .map(|(k, r)| (k.clone(), r.delivered.load(Relaxed)))
            .collect(),
    }
}

/// The minute (since the Unix epoch) of `now`.
fn minute_now() -> i64 {
    chrono::Utc::now().timestamp().div_euclid(60)
}

impl RateRecorder {
    /// A recorder over the outbox relays' and the inbox dispatchers' counters.
    pub fn new(store: Arc<dyn Store>, relays: Vec<Arc<RelayStats>>, inbox: InboxHandles) -> Self {
        // What was delivered before the recorder started is nobody's minute.
        let flushed = Mutex::new(counts(&relays, &inbox));
        RateRecorder {
            store,
            relays,
            inbox,
            flushed,
        }
    }

    fn now(&self) -> Counts {
        counts(&self.relays, &self.inbox)
    }

    /// Deliveries since the last flush, per (box, subscription), and the counters now.
    fn unflushed(&self) -> (Vec<(BoxKind, String, i64)>, Counts) {
        let now = self.now();
        let last = self.flushed.lock().expect("rates lock").clone();
        let mut out = Vec::new();
        let d = now.outbox.saturating_sub(last.outbox);
        if d > 0 {
            out.push((BoxKind::Outbox, String::new(), d as i64));
        }
        for (s, v) in &now.inbox {
            let d = v.saturating_sub(last.inbox.get(s).copied().unwrap_or(0));
            if d > 0 {
                out.push((BoxKind::Inbox, s.clone(), d as i64));
            }
        }
        (out, now)
    }

    /// Adds the deliveries since the last flush to the current minute's rows and deletes
    /// rows past the window; the counters move on only once that is stored.
    pub async fn flush(&self) -> StoreResult<()> {
        let (deltas, now) = self.unflushed();
        if deltas.is_empty() {
            return Ok(());
        }
        let minute = minute_now();
        let counts: Vec<RateCount> = deltas
            .into_iter()
            .map(|(box_kind, subscription, n)| RateCount {
                box_kind,
                subscription,
                minute,
                n,
            })
            .collect();
        self.store.add_rates(&counts, minute - KEEP_MINUTES).await?;
        *self.flushed.lock().expect("rates lock") = now;
        Ok(())
    }

    /// Deliveries per minute over the last hour for the outbox (`subscription` `None`) or
    /// one subscription, oldest minute first (60 values), this process's unflushed ones
    /// in the current minute; and how many of the minutes have a row (the history's
    /// reach, from its oldest row).
    pub async fn per_minute(&self, subscription: Option<&str>) -> StoreResult<(Vec<u64>, usize)> {
        let (b, sub) = match subscription {
            None => (BoxKind::Outbox, ""),
            Some(s) => (BoxKind::Inbox, s),
        };
        let now = minute_now();
        let first = now - WINDOW_MINUTES as i64 + 1;
        let rows = self.store.rates(b, sub, first).await?;
        let mut bins = vec![0u64; WINDOW_MINUTES];
        let mut oldest = None::<i64>;
        for (m, n) in rows {
            if let Ok(i) = usize::try_from(m - first)
                && i < WINDOW_MINUTES
            {
                bins[i] += u64::try_from(n).unwrap_or(0);
                oldest = Some(oldest.map_or(m, |o| o.min(m)));
            }
        }
        let (deltas, _) = self.unflushed();
        for (db, s, n) in deltas {
            if db == b && s == sub {
                bins[WINDOW_MINUTES - 1] += u64::try_from(n).unwrap_or(0);
                oldest.get_or_insert(now);
            }
        }
        let covered = oldest.map_or(0, |o| usize::try_from(now - o + 1).unwrap_or(0));
        Ok((bins, covered))
    }

    /// Flushes every `FLUSH_EVERY` until `shutdown`, and once more then.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(FLUSH_EVERY) => {}
            }
            if let Err(e) = self.flush().await {
                tracing::warn!(error = %e, "recording the delivery rates failed");
            }
        }
        let _ = self.flush().await;
    }
}

//! The relay protocol: what crosses between the relay engine and a store in a cycle.
//! A claim (`ClaimLimits` in, `Claim` out: leased keys with their windows, unkeyed
//! events), the relay's decisions (`EventUpdate`, `KeyRelease` with its `Readiness`),
//! a lease `Renewal` while deliveries are in flight, and the `Settlement` that applies
//! the decisions (`SettleReport` back). The `Store` trait's relay methods take and
//! return these; every engine implements them the same way.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::domain::{EventId, Queue, Status, StoredEvent};

/// The identity of an ordered line: one (topic, key).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LineKey {
    /// The topic.
    pub topic: String,
    /// The key; unkeyed events have no line.
    pub key: String,
}

/// The front of one leased key's line: its pending events in id order that are *in
/// line* (due, or tried and waiting for a retry), at most the claim's per-key limit and
/// within its byte budget. Never-tried events scheduled for later are not in line: the
/// read skips them (so any number of them cannot park the due events behind them) and
/// reports only the earliest schedule among those it passed. `full` says a limit cut
/// the window, so more may follow.
#[derive(Debug, Clone)]
pub struct KeyWindow {
    /// The key whose line this is.
    pub line: LineKey,
    /// The window's events, in id order.
    pub rows: Vec<StoredEvent>,
    /// A limit cut the window: more of the line may follow.
    pub full: bool,
    /// The earliest schedule of the never-tried delayed events before the window's end
    /// (of all of them when the window is not full): when the key must be looked at again.
    pub delayed_at: Option<DateTime<Utc>>,
    /// The highest pending id (delayed events included) before the window's end, i.e.
    /// of the whole key when the window is not full: anything above it arrived later.
    pub line_end: Option<EventId>,
}

/// The next window of a line its relay keeps leased (`Store::continue_line`).
#[derive(Debug, Clone)]
pub struct Continued {
    /// The database's clock when the window was read; planning compares schedules to it.
    pub now: DateTime<Utc>,
    /// The line's events after the run in flight, as a claim's window reads them.
    pub window: KeyWindow,
    /// The line's horizon: the highest id no writer can still change below (the
    /// engine's check under lock found it). The next read passes it back, and reads up
    /// to it need no lock. `None` when the engine has none.
    pub horizon: Option<EventId>,
}

/// How many of the leading items (of the given sizes) fit in `budget` bytes: always at
/// least one, so an event larger than the budget still goes out, alone.
pub fn fit_in_budget(sizes: impl IntoIterator<Item = u64>, budget: u64) -> usize {
    let mut total: u64 = 0;
    let mut n = 0;
    for size in sizes {
        total = total.saturating_add(size);
        if n > 0 && total > budget {
            break;
        }
        n += 1;
    }
    n
}

/// What one claim handed to a relay. `token` identifies this claim: settling with it
/// succeeds only while the claim's lease is still held.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The token passed to `claim`, for `settle` and `renew`.
    pub token: i64,
    /// The database's clock when the claim was made; planning compares schedules to it.
    /// (A claim that leased no key may carry the local clock: nothing plans against it.)
    pub now: DateTime<Utc>,
    /// One window per leased key.
    pub keyed: Vec<KeyWindow>,
    /// Due events without a key, each claimed individually.
    pub unkeyed: Vec<StoredEvent>,
}

impl ClaimLimits {
    /// Rows to read per key when `leased` keys share the budget.
    pub fn per_key(&self, leased: usize) -> u32 {
        // Saturate: past `u32::MAX` keys, each gets one row either way (the clamp).
        let leased = u32::try_from(leased.max(1)).unwrap_or(u32::MAX);
        (self.max_events / leased).clamp(1, self.max_run.max(1))
    }
}

/// Limits of one claim.
#[derive(Debug, Clone, Copy)]
pub struct ClaimLimits {
    /// Keys to lease.
    pub max_keys: u32,
    /// Keyed events to read in all: shared out among the leased keys.
    pub max_events: u32,
    /// Rows to read per key at most (the longest run one cycle may publish).
    pub max_run: u32,
    /// Unkeyed events to claim.
    pub max_unkeyed: u32,
    /// Bytes (payload and headers) of the events read, keyed and unkeyed each; at least
    /// one event is always read, however large.
    pub max_bytes: u64,
    /// How long the claim holds; longer than any publish timeout.
    pub lease: Duration,
}

/// A change to one claimed event, decided by the relay engine.
#[derive(Debug, Clone, PartialEq)]
pub enum EventUpdate {
    /// Delivered (published, or handled in the inbox).
    Completed {
        /// The event.
        id: EventId,
    },
    /// Published, but after an earlier event of its key failed in the same run: the
    /// broker may hold it ahead of that event. `note` is kept as the event's last error,
    /// so `GetEvent` shows it.
    CompletedAfterGap {
        /// The event.
        id: EventId,
        /// Kept as the event's last error.
        note: String,
    },
    /// A counted failure with budget left: `attempts` is the new count, the event is due
    /// again `delay` after the settle.
    Retry {
        /// The event.
        id: EventId,
        /// The new attempt count.
        attempts: u32,
        /// From the settle until the event is due again.
        delay: Duration,
        /// The failure, kept as the event's last error.
        error: String,
    },
    /// A retry at a time the destination named (a sink or inbox handler); it may or may
    /// not spend an attempt.
    RetryAt {
        /// The event.
        id: EventId,
        /// The new attempt count; unchanged when the retry spends no attempt.
        attempts: u32,
        /// When the event is due again.
        at: DateTime<Utc>,
        /// The failure, kept as the event's last error.
        error: String,
    },
    /// Out of attempts (or rejected): terminal until requeued.
    Failed {
        /// The event.
        id: EventId,
        /// The final attempt count.
        attempts: u32,
        /// Why, kept as the event's last error.
        error: String,
    },
    /// Claimed but not reached (unkeyed events only; a keyed line is released with its
    /// key): back in line at once, untouched.
    Release {
        /// The event.
        id: EventId,
    },
}

/// When a retried event is due again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Due {
    /// This long after the settle (the store's clock).
    After(Duration),
    /// At this time, named by the destination.
    At(DateTime<Utc>),
}

/// What an update writes to its event row, the same for every engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct UpdateColumns<'a> {
    /// The new status: `completed`, `failed`, or `pending` (retry, release).
    pub status: Status,
    /// The new attempt count; `None` leaves it.
    pub attempts: Option<u32>,
    /// When it is due again; `None` leaves `scheduled_at`.
    pub due: Option<Due>,
    /// The new last error; `None` leaves it.
    pub error: Option<&'a str>,
    /// A release: the row is untouched apart from its claim (not even `updated_at`).
    pub release: bool,
}

impl EventUpdate {
    /// The ids that `updates` complete, in their order.
    pub fn completed_ids(updates: &[EventUpdate]) -> impl Iterator<Item = EventId> + '_ {
        updates
            .iter()
            .filter(|u| matches!(u, EventUpdate::Completed { .. }))
            .map(EventUpdate::id)
    }

    /// The columns this update writes.
    pub(crate) fn columns(&self) -> UpdateColumns<'_> {
        let c = UpdateColumns {
            status: Status::Pending,
            attempts: None,
            due: None,
            error: None,
            release: false,
        };
        match self {
            EventUpdate::Completed { .. } => UpdateColumns {
                status: Status::Completed,
                ..c
            },
            EventUpdate::CompletedAfterGap { note, .. } => UpdateColumns {
                status: Status::Completed,
                error: Some(note),
                ..c
            },
            EventUpdate::Retry {
                attempts,
                delay,
                error,
                ..
            } => UpdateColumns {
                attempts: Some(*attempts),
                due: Some(Due::After(*delay)),
                error: Some(error),
                ..c
            },
            EventUpdate::RetryAt {
                attempts,
                at,
                error,
                ..
            } => UpdateColumns {
                attempts: Some(*attempts),
                due: Some(Due::At(*at)),
                error: Some(error),
                ..c
            },
            EventUpdate::Failed {
                attempts, error, ..
            } => UpdateColumns {
                status: Status::Failed,
                attempts: Some(*attempts),
                error: Some(error),
                ..c
            },
            EventUpdate::Release { .. } => UpdateColumns { release: true, ..c },
        }
    }

    /// The event this update is for.
    pub fn id(&self) -> EventId {
        match self {
            EventUpdate::Completed { id }
            | EventUpdate::CompletedAfterGap { id, .. }
            | EventUpdate::Retry { id, .. }
            | EventUpdate::RetryAt { id, .. }
            | EventUpdate::Failed { id, .. }
            | EventUpdate::Release { id } => *id,
        }
    }
}

/// When a released key may next have something to publish. The store takes the
/// earliest of the parts that are set; none set means "idle" (no due line left).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Readiness {
    /// An absolute time (a never-tried delayed event's schedule).
    pub at: Option<DateTime<Utc>>,
    /// Relative to the settle (the blocked head's new retry delay; zero for "now").
    pub after: Option<Duration>,
    /// The highest id the relay saw. If the key is otherwise idle and a newer pending
    /// event exists (enqueued during the claim), the key is ready at once.
    pub seen_up_to: Option<EventId>,
}

impl Readiness {
    /// Ready at once.
    pub fn now() -> Self {
        Readiness {
            after: Some(Duration::ZERO),
            ..Default::default()
        }
    }
}

/// The release of one leased key with its next readiness.
#[derive(Debug, Clone)]
pub struct KeyRelease {
    /// The leased key to release.
    pub line: LineKey,
    /// When it may next have something to publish.
    pub ready: Readiness,
    /// The line's events this settle completes (`EventUpdate::Completed`), ascending. The
    /// outbox moves the key's cursor over them instead of writing each row when they are
    /// exactly the pending events above the cursor; empty, every row is written.
    pub completed: Vec<EventId>,
    /// Keep the lease for this long instead of releasing the key: the relay goes on with
    /// the line (its next run is already being delivered). `ready` is then unused.
    pub keep: Option<Duration>,
}

/// What a settle achieved.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SettleReport {
    /// Updates applied.
    pub applied: usize,
    /// Updates dropped because the claim's keys or events moved to another relay (a
    /// late settle that no one raced is still applied: the lease token fences).
    pub stale: usize,
}

impl SettleReport {
    /// `applied` of `updates` updates went through; the rest were stale.
    pub(crate) fn of(applied: usize, updates: usize) -> Self {
        SettleReport {
            applied,
            stale: updates - applied,
        }
    }
}

/// A lease renewal: what one claim still has in flight, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct Renewal<'a> {
    /// The box (and subscription) the claim is in.
    pub queue: &'a Queue,
    /// The claim's lease token.
    pub token: i64,
    /// Keys whose lines are still being delivered.
    pub lines: &'a [LineKey],
    /// Unkeyed events still being delivered.
    pub unkeyed: &'a [EventId],
    /// The new lease, counted from now.
    pub lease: Duration,
}

/// A claim's settlement: the relay's decisions for its events and the keys it gives back.
#[derive(Debug, Clone, Copy)]
pub struct Settlement<'a> {
    /// The box (and subscription) the claim is in.
    pub queue: &'a Queue,
    /// The claim's lease token: updates under another token are stale.
    pub token: i64,
    /// What became of each delivered (or skipped) event.
    pub updates: &'a [EventUpdate],
    /// The keys released, each with when it is next ready.
    pub releases: &'a [KeyRelease],
}

impl<'a> Settlement<'a> {
    /// The settlement of `token`'s claim in `queue`.
    pub fn new(
        queue: &'a Queue,
        token: i64,
        updates: &'a [EventUpdate],
        releases: &'a [KeyRelease],
    ) -> Self {
        Settlement {
            queue,
            token,
            updates,
            releases,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fit_in_budget;

    #[test]
    fn a_budget_takes_leading_items_and_always_one() {
        assert_eq!(fit_in_budget([10, 10, 10], 25), 2);
        assert_eq!(fit_in_budget([10, 10, 10], 30), 3);
        assert_eq!(fit_in_budget([100, 1], 10), 1, "one event even over budget");
        assert_eq!(fit_in_budget([], 10), 0);
        assert_eq!(fit_in_budget([0, 0, 5], 0), 2);
        assert_eq!(fit_in_budget([u64::MAX, 1], u64::MAX - 1), 1, "no overflow");
    }
}

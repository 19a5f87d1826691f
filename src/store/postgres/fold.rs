//! Where the fold of SQL-API events (`sql.rs`, `FOLD`) starts its scan (issue 46).
//!
//! The fold finds uncounted events through a partial index (`WHERE NOT counted`). Each
//! event it folds leaves a dead entry there until VACUUM removes it, and VACUUM cannot
//! while any snapshot older than the fold is open (a REPEATABLE READ reader, a long
//! report): a scan from id 0 then visited every event folded since that snapshot, on
//! every claim (2,909 buffers to find one row beside such a reader). So the scan starts
//! at a *floor* below which every event is known to be counted.
//!
//! The floor cannot simply follow the ids folded: a SQL-API transaction draws its id at
//! the insert and commits later, so an event below one already folded may still become
//! visible. It moves by transaction ids instead:
//! - A keyed SQL-API insert locks its key's slot row first (migration 0020), so its
//!   transaction has an id (xid) before it draws the event's id.
//! - A fold that takes the turn reads the id sequence's last value `seq` first, and only
//!   then gets its own xid `x` (the turn's row lock). An event at or below `seq` was drawn
//!   by a transaction whose xid is below `x`: the pair (`x`, `seq`) is a candidate.
//!   (A snapshot's `xmax` is no such bound: it is the last *completed* xid plus one, and
//!   a transaction that got its xid since runs above it.)
//! - Once a pass of the fold (batches from the floor until one is not full) begins with
//!   a snapshot whose `xmin` is above a candidate's `x`, every transaction that could
//!   hold an event at or below the candidate's `seq` has ended, so the pass sees them
//!   all: when it completes, the floor rises to that `seq` (kept below any event the pass
//!   had to skip because another session held its key row).
//! - Every event a fold folds was visible to its snapshot, so drawn before its `seq` was
//!   read: once the last fold's candidate is reached, nothing folded lies above the
//!   floor, however long the old snapshot stays open.
//! - Other replicas keep floors of their own; one process folds one at a time.
//! - A pass from 0 every `SWEEP_EVERY` catches anything the reasoning above missed (an
//!   uncounted event written by hand): it costs one scan of the dead entries, not one
//!   per claim.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A pass from id 0 this often, whatever the floor.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Candidates kept while the horizon stays behind them (a transaction left open): the
/// newest are kept, older ones only let the floor rise less far.
const MAX_CANDIDATES: usize = 64;

/// What one fold statement reported.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Outcome {
    /// The binary passed the schema gate (else nothing was looked at).
    pub gate: bool,
    /// Uncounted events existed above the scan's start.
    pub present: bool,
    /// This fold held the turn (folded); false with `present` when another one held it.
    pub turned: bool,
    /// Events scanned, and whether that was a full batch.
    pub full: bool,
    /// The last id scanned.
    pub last: Option<i64>,
    /// The lowest id scanned and left uncounted (its key row held elsewhere).
    pub skipped: Option<i64>,
    /// The fold's snapshot's oldest transaction still running.
    pub xmin: i64,
    /// The fold's own transaction id, when it took the turn.
    pub xid: Option<i64>,
    /// The id sequence's last value, read before the fold got its transaction id.
    pub seq: Option<i64>,
}

#[derive(Debug)]
struct Pass {
    /// The first batch's snapshot `xmin`.
    xmin: i64,
    /// The floor the pass started from (0 for a sweep).
    base: i64,
    skipped: Option<i64>,
    /// Where the next batch starts.
    from: i64,
}

/// The fold's scan position: see the module's notes.
#[derive(Debug)]
pub(super) struct FoldFloor {
    floor: i64,
    pass: Option<Pass>,
    /// (xid, seq) pairs, oldest first.
    candidates: VecDeque<(i64, i64)>,
    swept: Instant,
}

impl FoldFloor {
    pub(super) fn new(now: Instant) -> FoldFloor {
        FoldFloor {
            floor: 0,
            pass: None,
            candidates: VecDeque::new(),
            // The first pass is a sweep.
            swept: now.checked_sub(SWEEP_EVERY).unwrap_or(now),
        }
    }

    /// Where the next fold's scan starts (events above it).
    pub(super) fn start(&self, now: Instant) -> i64 {
        match &self.pass {
            Some(p) => p.from,
            None if now.duration_since(self.swept) >= SWEEP_EVERY => 0,
            None => self.floor,
        }
    }

    /// Takes in what the fold that started at `start(now)` reported.
    pub(super) fn record(&mut self, o: Outcome, now: Instant) {
        if !o.gate {
            return;
        }
        if let (Some(xid), Some(seq)) = (o.xid, o.seq)
            && seq > self.floor
        {
            if self.candidates.len() == MAX_CANDIDATES {
                self.candidates.pop_front();
            }
            self.candidates.push_back((xid, seq));
        }
        if o.present && !o.turned {
            // Another fold held the turn: this one saw nothing it may rely on.
            return;
        }
        let start = self.start(now);
        let pass = self.pass.get_or_insert(Pass {
            xmin: o.xmin,
            base: start,
            skipped: None,
            from: start,
        });
        if pass.base == 0 && start == 0 {
            self.swept = now;
        }
        if let Some(s) = o.skipped {
            pass.skipped = Some(pass.skipped.map_or(s, |p| p.min(s)));
        }
        if o.turned && o.full {
            pass.from = o.last.unwrap_or(pass.from);
            return;
        }
        let pass = self.pass.take().expect("a pass");
        let mut reached = None;
        while let Some(&(xid, seq)) = self.candidates.front() {
            if xid >= pass.xmin {
                break;
            }
            reached = Some(seq);
            self.candidates.pop_front();
        }
        let risen = reached.map_or(self.floor, |r| r.max(self.floor));
        self.floor = match pass.skipped {
            Some(s) => risen.min(s - 1),
            None => risen,
        };
    }

    #[cfg(test)]
    fn floor(&self) -> i64 {
        self.floor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fold that took the turn, its snapshot's `xmin`, its xid and the `seq` it read.
    fn done(xmin: i64, xid: i64, seq: i64) -> Outcome {
        Outcome {
            gate: true,
            present: true,
            turned: true,
            xmin,
            xid: Some(xid),
            seq: Some(seq),
            ..Outcome::default()
        }
    }

    /// A fold that found nothing to fold.
    fn idle(xmin: i64) -> Outcome {
        Outcome {
            gate: true,
            xmin,
            ..Outcome::default()
        }
    }

    #[test]
    fn the_floor_rises_only_once_every_writer_below_it_has_ended() {
        let t0 = Instant::now();
        let mut f = FoldFloor::new(t0);
        assert_eq!(f.start(t0), 0, "the first pass is a sweep");
        // A fold with xid 50 read seq 100: writers of ids <= 100 have xids below 50.
        f.record(done(40, 50, 100), t0);
        assert_eq!(f.floor(), 0, "its own pass began before 50 ended");
        f.record(idle(45), t0);
        assert_eq!(f.floor(), 0, "xmin 45: a writer of an id <= 100 may run");
        f.record(idle(50), t0);
        assert_eq!(f.floor(), 0, "xmin 50: the fold itself counts as running");
        f.record(idle(51), t0);
        assert_eq!(f.floor(), 100);
        assert_eq!(f.start(t0), 100);
        // A held key row skipped at 105 keeps the floor below it.
        let mut o = done(52, 60, 140);
        o.skipped = Some(105);
        f.record(o, t0);
        assert_eq!(f.floor(), 100, "nothing reached");
        let mut o = done(61, 62, 150);
        o.skipped = Some(105);
        f.record(o, t0);
        assert_eq!(f.floor(), 104, "140 reached, but 105 still skipped");
        f.record(done(63, 64, 160), t0);
        assert_eq!(f.floor(), 150, "105 folded at last, 150 reached");
    }

    #[test]
    fn full_batches_continue_a_pass_and_its_first_snapshot_decides() {
        let t0 = Instant::now();
        let mut f = FoldFloor::new(t0);
        f.record(done(5, 10, 100), t0);
        let mut o = done(8, 20, 200);
        o.full = true;
        o.last = Some(60);
        f.record(o, t0);
        assert_eq!(f.start(t0), 60, "the pass goes on above its last id");
        // The pass began with xmin 8 <= 10: (10, 100) is not reached even though this
        // batch's snapshot is newer.
        f.record(done(30, 31, 210), t0);
        assert_eq!(f.floor(), 0);
        f.record(idle(31), t0);
        assert_eq!(
            f.floor(),
            200,
            "(10, 100), (20, 200) reached; (31, 210) not yet"
        );
    }

    #[test]
    fn a_fold_that_lost_the_turn_or_the_gate_changes_nothing_but_a_sweep_can_lower_it() {
        let t0 = Instant::now();
        let mut f = FoldFloor::new(t0);
        f.record(done(10, 10, 100), t0);
        f.record(idle(11), t0);
        assert_eq!(f.floor(), 100);
        let mut lost = done(20, 20, 300);
        lost.turned = false;
        lost.xid = None;
        f.record(lost, t0);
        f.record(idle(30), t0);
        assert_eq!(f.floor(), 100, "another fold held the turn: no candidate");
        f.record(Outcome::default(), t0);
        assert_eq!(f.start(t0), 100);
        let later = t0 + SWEEP_EVERY;
        assert_eq!(f.start(later), 0, "a sweep from 0");
        let mut o = done(20, 21, 310);
        o.skipped = Some(7);
        f.record(o, later);
        assert_eq!(
            f.floor(),
            6,
            "the sweep found an uncounted event below the floor"
        );
        assert_eq!(f.start(later), 6, "and the next sweep is due in 30 s");
    }
}

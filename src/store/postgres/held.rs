//! Keys whose order lock SQL-API writers keep held (docs/sql-api.md, "Order locks"): how
//! long this replica's claims have found each one held and by which backend, and the
//! relay's turn in the writers' queue for a key kept busy.
//!
//! A relay only tries a key's order lock (`SKIP LOCKED`): it never waits for a writer
//! while it holds the other keys of its claim. But PostgreSQL hands a released row lock
//! to the next writer in line, so writers whose transactions overlap kept a key held
//! without a gap, and its events waited until they stopped. A key found held for
//! `QUEUE_AFTER` gets a *turn*: one session queues for the slot row in shared mode,
//! behind the writers already waiting and ahead of those that come later, and holds it
//! until a claim has read the key's line (or `TURN_HOLD` passes). A shared lock does not
//! conflict with the claims' own shared tries, so the next claim reads the line while
//! the writers behind the turn wait.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::store::{HeldKey, LineKey};

/// How long a key is found held before a turn queues for it.
const QUEUE_AFTER: Duration = Duration::from_secs(1);

/// How long a turn waits in the writers' queue (its `lock_timeout`).
const QUEUE_WAIT: Duration = Duration::from_secs(5);

/// How long a turn holds the key at most, when no claim of this replica reads it (one
/// of another replica may have).
const TURN_HOLD: Duration = Duration::from_secs(1);

/// Turns queued at once, at most, per this many relay connections (each holds one
/// while it waits; at least one turn).
const CONNECTIONS_PER_TURN: u32 = 4;

/// A key not found held again for this long is forgotten (its writers ended, or
/// other replicas lease it).
const FORGET_AFTER: Duration = Duration::from_secs(3);

/// How soon a claim looks again at a key it found held: at first after `RECHECK_FIRST`,
/// then after half the time it has been held, at most `RECHECK_MAX` (under
/// `FORGET_AFTER`, so the key stays followed between looks). The writer's commit wakes
/// the key at once (the fold pulls `ready_at` to now) and a turn wakes it when it gets
/// the lock, so the backoff costs no latency in either case; it only stops a key held by
/// a transaction left open from being leased and released five times a second.
const RECHECK_FIRST: Duration = Duration::from_millis(200);
const RECHECK_MAX: Duration = Duration::from_secs(2);

/// A key held longer than this is named in a warning, with the holder's pid, and in
/// the metric `mailroom_outbox_key_held_seconds`.
pub(super) const REPORT_AFTER: Duration = Duration::from_secs(5);

/// The slot row of a key, waited for in shared mode (a turn).
const QUEUE: &str = "SELECT 1 FROM mailroom_order_slots
                     WHERE slot = mailroom_order_slot($1, $2) FOR SHARE";

/// Also the transitional advisory lock, which writers take after the slot row.
const QUEUE_LEGACY: &str = "SELECT pg_advisory_xact_lock_shared(mailroom_order_lock($1, $2))
                            FROM mailroom_sql_settings WHERE legacy_order_lock";

/// A turn wakes the key, so a claim looks at it at once (not in the turn's
/// transaction: the key row stays free for the claim).
const WAKE: &str = "WITH w AS (UPDATE outbox_keys SET ready_at = now()
                    WHERE topic = $1 AND event_key = $2 AND ready_at > now())
                    SELECT pg_notify('mailroom_outbox', '')";

/// The backend holding a key's slot row exclusively: the transaction in the row's
/// `xmax`, as `pg_locks` shows it (an exclusive row lock has one holder; row locks
/// themselves are not in `pg_locks`).
const HOLDER: &str = "SELECT l.pid FROM mailroom_order_slots o
                      JOIN pg_locks l ON l.locktype = 'transactionid' AND l.granted
                       AND l.mode = 'ExclusiveLock' AND l.transactionid = o.xmax
                      WHERE o.slot = mailroom_order_slot($1, $2)";

/// The statements above, qualified with the data schema (the sessions' search path
/// holds no schema of mailroom's).
#[derive(Debug)]
pub(super) struct Statements {
    queue: Arc<str>,
    queue_legacy: Arc<str>,
    wake: Arc<str>,
    holder: Arc<str>,
}

impl Statements {
    pub(super) fn new(names: &super::profile::Qualifier) -> Arc<Statements> {
        Arc::new(Statements {
            queue: names.fixed(QUEUE),
            queue_legacy: names.fixed(QUEUE_LEGACY),
            wake: names.fixed(WAKE),
            holder: names.fixed(HOLDER),
        })
    }
}

#[derive(Debug)]
struct Held {
    since: Instant,
    seen: Instant,
    pid: Option<i32>,
    reported: Option<Instant>,
    turn: bool,
    /// A turn that timed out in the queue (a transaction held open, not a busy line) is
    /// not queued again before this.
    next_turn: Option<Instant>,
}

/// The keys this replica's claims found held, shared with the turns it queued.
#[derive(Debug, Default)]
pub(super) struct HeldKeys {
    keys: Mutex<HashMap<LineKey, Held>>,
}

/// What a claim's observation asks of the store: queue turns, look up holders.
#[derive(Debug, Default)]
pub(super) struct Followups {
    pub(super) turns: Vec<LineKey>,
    pub(super) report: Vec<(LineKey, Duration)>,
    /// For each held key, in the order given: how soon a claim looks at it again.
    pub(super) recheck: Vec<Duration>,
}

/// How soon a key held for `age` is looked at again (see `RECHECK_FIRST`).
fn recheck_after(age: Duration) -> Duration {
    (age / 2).clamp(RECHECK_FIRST, RECHECK_MAX)
}

impl HeldKeys {
    /// A claim found `held` held and `free` free at `now`; `connections`: the relay
    /// pool's size, which bounds the turns.
    pub(super) fn observe(
        &self,
        held: &[&LineKey],
        free: &[&LineKey],
        connections: u32,
        now: Instant,
    ) -> Followups {
        let max_turns = (connections / CONNECTIONS_PER_TURN).max(1) as usize;
        let mut keys = self.keys.lock().expect("held keys");
        for k in free {
            keys.remove(*k);
        }
        keys.retain(|_, h| now.duration_since(h.seen) < FORGET_AFTER || h.turn);
        let mut f = Followups::default();
        let mut turns = keys.values().filter(|h| h.turn).count();
        for k in held {
            let h = keys.entry((*k).clone()).or_insert(Held {
                since: now,
                seen: now,
                pid: None,
                reported: None,
                turn: false,
                next_turn: None,
            });
            h.seen = now;
            let age = now.duration_since(h.since);
            f.recheck.push(recheck_after(age));
            let may_queue = h.next_turn.is_none_or(|t| now >= t);
            if age >= QUEUE_AFTER && !h.turn && may_queue && turns < max_turns {
                h.turn = true;
                turns += 1;
                f.turns.push((*k).clone());
            }
            if age >= REPORT_AFTER
                && h.reported
                    .is_none_or(|r| now.duration_since(r) >= REPORT_AFTER)
            {
                h.reported = Some(now);
                f.report.push(((*k).clone(), age));
            }
        }
        f
    }

    fn set_pid(&self, key: &LineKey, pid: Option<i32>) {
        if let Some(h) = self.keys.lock().expect("held keys").get_mut(key) {
            h.pid = pid;
        }
    }

    /// Whether the key is still found held (no claim read it since).
    fn still_held(&self, key: &LineKey) -> bool {
        self.keys.lock().expect("held keys").contains_key(key)
    }

    fn end_turn(&self, key: &LineKey, got: bool) {
        if let Some(h) = self.keys.lock().expect("held keys").get_mut(key) {
            h.turn = false;
            if !got {
                h.next_turn = Some(Instant::now() + QUEUE_WAIT);
            }
        }
    }

    /// The keys held longer than `REPORT_AFTER` at `now`, for the metrics.
    pub(super) fn snapshot(&self, now: Instant) -> Vec<HeldKey> {
        self.keys
            .lock()
            .expect("held keys")
            .iter()
            .filter(|(_, h)| now.duration_since(h.since) >= REPORT_AFTER)
            .map(|(k, h)| HeldKey {
                line: k.clone(),
                held_for: now.duration_since(h.since),
                pid: h.pid,
            })
            .collect()
    }
}

/// Names each key held longer than `REPORT_AFTER` and its holder in a warning (once
/// per `REPORT_AFTER` while it stays held).
pub(super) async fn report(
    pool: &PgPool,
    sql: &Statements,
    held: &Arc<HeldKeys>,
    keys: Vec<(LineKey, Duration)>,
) {
    for (key, age) in keys {
        let pid: Option<i32> = match sqlx::query_scalar(sqlx::AssertSqlSafe(sql.holder.clone()))
            .bind(&key.topic)
            .bind(&key.key)
            .fetch_optional(pool)
            .await
        {
            Ok(pid) => pid,
            Err(e) => {
                tracing::debug!(error = %e, "reading a held key's holder failed");
                None
            }
        };
        held.set_pid(&key, pid);
        tracing::warn!(
            topic = %key.topic,
            key = %key.key,
            pid = pid.map_or_else(|| "unknown".to_string(), |p| p.to_string()),
            held_for_s = age.as_secs(),
            "a SQL-API transaction has held this key's order lock for longer than {} s: its events wait (pg_stat_activity shows the holder by pid)",
            REPORT_AFTER.as_secs()
        );
    }
}

/// Queues for `key`'s order lock behind its writers and holds it until a claim read the
/// line (see the module's notes). Errors only end the turn early: the key is tried again
/// by the next claims as before.
pub(super) async fn take_turn(
    pool: PgPool,
    sql: Arc<Statements>,
    held: Arc<HeldKeys>,
    key: LineKey,
) {
    let got = match turn(&pool, &sql, &held, &key).await {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, topic = %key.topic, key = %key.key, "a turn for a held key ended early");
            false
        }
    };
    held.end_turn(&key, got);
}

async fn turn(
    pool: &PgPool,
    sql: &Statements,
    held: &HeldKeys,
    key: &LineKey,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = {}",
        QUEUE_WAIT.as_millis()
    )))
    .execute(&mut *tx)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(sql.queue.clone()))
        .bind(&key.topic)
        .bind(&key.key)
        .execute(&mut *tx)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(sql.queue_legacy.clone()))
        .bind(&key.topic)
        .bind(&key.key)
        .execute(&mut *tx)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(sql.wake.clone()))
        .bind(&key.topic)
        .bind(&key.key)
        .execute(pool)
        .await?;
    let until = Instant::now() + TURN_HOLD;
    while Instant::now() < until && held.still_held(key) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.commit().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> LineKey {
        LineKey {
            topic: "t".into(),
            key: k.into(),
        }
    }

    #[test]
    fn turns_and_reports_follow_how_long_a_key_is_held() {
        let h = HeldKeys::default();
        let (a, b) = (key("a"), key("b"));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let f = h.observe(&[&a], &[], 8, t0);
        assert!(
            f.turns.is_empty() && f.report.is_empty(),
            "not held long yet"
        );
        let f = h.observe(&[&a, &b], &[], 4, at(1_000));
        assert_eq!(
            f.turns,
            vec![a.clone()],
            "held 1 s: a turn; b only just seen"
        );
        let f = h.observe(&[&a, &b], &[], 4, at(2_100));
        assert!(
            f.turns.is_empty(),
            "one turn per 4 connections, and a has one"
        );
        h.end_turn(&a, false);
        let f = h.observe(&[&a, &b], &[], 4, at(2_200));
        assert_eq!(f.turns, vec![b.clone()], "a timed out: b's turn");
        h.end_turn(&b, true);
        let f = h.observe(&[&a], &[&b], 8, at(5_000));
        assert_eq!(f.report.len(), 1, "a held 5 s is named");
        assert!(f.turns.is_empty(), "a waits 5 s after its timed-out turn");
        assert_eq!(h.snapshot(at(5_000)).len(), 1, "b is free");
        let f = h.observe(&[&a], &[], 8, at(7_300));
        assert_eq!(f.turns, vec![a.clone()]);
        assert!(f.report.is_empty(), "named once per 5 s");
        assert_eq!(h.observe(&[&a], &[], 8, at(10_000)).report.len(), 1);
        h.observe(&[], &[&a], 8, at(10_100));
        assert!(h.snapshot(at(10_100)).is_empty(), "free: forgotten");
    }

    #[test]
    fn a_key_held_longer_is_looked_at_less_often() {
        let h = HeldKeys::default();
        let (a, b) = (key("a"), key("b"));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let ms =
            |f: &Followups| -> Vec<u128> { f.recheck.iter().map(Duration::as_millis).collect() };
        assert_eq!(ms(&h.observe(&[&a], &[], 8, t0)), [200]);
        assert_eq!(ms(&h.observe(&[&a, &b], &[], 8, at(1_000))), [500, 200]);
        assert_eq!(ms(&h.observe(&[&b, &a], &[], 8, at(2_600))), [800, 1_300]);
        assert_eq!(
            ms(&h.observe(&[&a], &[], 8, at(4_600))),
            [2_000],
            "at most 2 s"
        );
        h.observe(&[], &[&a], 8, at(4_700));
        assert_eq!(
            ms(&h.observe(&[&a], &[], 8, at(4_800))),
            [200],
            "held again: from the start"
        );
    }
}

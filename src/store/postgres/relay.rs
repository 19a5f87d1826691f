//! The relay's calls: claim (lease ready keys, read their lines within the budgets,
//! claim due unkeyed events), settle and renew.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Row};

use super::held;
use super::sql::Sql;
use super::{PgStore, decode_event, gated, millis, q, scoped};
use crate::domain::{EventId, Queue, Status, StoredEvent};
use crate::store::Due;
use crate::store::rows::in_due_order;
use crate::store::{
    Claim, ClaimLimits, Continued, EventUpdate, KeyWindow, LineKey, Renewal, SettleReport,
    Settlement, StoreError, StoreResult,
};

/// SQL-API events folded into their keys per claim, at most (the rest in the next).
const FOLD_BATCH: i64 = 1_000;

impl PgStore {
    /// Folds up to a batch of SQL-API events into their keys (see `Sql::fold`), above the
    /// floor of `fold.rs`. A claim's fold is skipped while another of this process runs
    /// (it would only find the turn taken); `wait` waits for it instead.
    pub(super) async fn fold(&self, wait: bool) -> StoreResult<u64> {
        let Some(fold) = &self.outbox.fold else {
            return Ok(0);
        };
        let mut floor = if wait {
            self.fold_floor.lock().await
        } else {
            match self.fold_floor.try_lock() {
                Ok(f) => f,
                Err(_) => return Ok(0),
            }
        };
        let now = std::time::Instant::now();
        let r = q(fold)
            .bind(FOLD_BATCH)
            .bind(floor.start(now))
            .bind(self.known)
            .bind(&self.events_table)
            .fetch_one(&self.relay_pool)
            .await?;
        let scanned: i64 = r.try_get("scanned")?;
        floor.record(
            super::fold::Outcome {
                gate: r.try_get("gate")?,
                present: r.try_get("present")?,
                turned: r.try_get("turned")?,
                full: scanned >= FOLD_BATCH,
                last: r.try_get("last")?,
                skipped: r.try_get("skipped")?,
                xmin: r.try_get("xmin")?,
                xid: r.try_get("xid")?,
                seq: r.try_get("seq")?,
            },
            now,
        );
        let folded: i64 = r.try_get("folded")?;
        Ok(u64::try_from(folded).unwrap_or(0))
    }

    /// Leases ready keys, reads the front of their lines and claims due unkeyed events.
    pub(super) async fn claim_lines(
        &self,
        queue: &Queue,
        token: i64,
        limits: ClaimLimits,
    ) -> StoreResult<Claim> {
        let sql = self.sql(queue.box_kind());
        if sql.fold.is_some() {
            self.fold(false).await?;
        }
        // The outbox leases and reads in one transaction: the order locks the lease
        // takes (see `Sql::lease_keys`) must be held while the windows are read.
        let mut tx = match &sql.fold {
            Some(_) => Some(self.relay_pool.begin().await?),
            None => None,
        };
        let lease = gated(
            q(&sql.lease_keys)
                .bind(limits.max_keys as i64)
                .bind(token)
                .bind(millis(limits.lease))
                .bind(limits.max_run.max(1) as i64)
                .bind(limits.max_events as i64),
            queue,
            self.known,
        );
        let leased = self.fetch_in(&mut tx, lease).await?;
        // The database's time, as the lease statement saw it, until the windows say
        // theirs; without a leased key nothing reads it (it only places keyed windows'
        // delayed events).
        let mut now: DateTime<Utc> = match leased.first() {
            Some(r) => r.try_get(3)?,
            None => Utc::now(),
        };
        let mut keyed = Vec::with_capacity(leased.len());
        if !leased.is_empty() {
            let mut lines = Leased::split(&leased)?;
            self.observe_held(&mut lines, now);
            let per_key = limits.per_key(leased.len());
            if !lines.free.is_empty() {
                let windows = scoped(
                    q(&sql.windows)
                        .bind(std::mem::take(&mut lines.topics))
                        .bind(std::mem::take(&mut lines.names))
                        .bind(per_key as i64)
                        .bind(std::mem::take(&mut lines.cursors))
                        .bind(i64::try_from(limits.max_bytes).unwrap_or(i64::MAX)),
                    queue,
                );
                let rows = self.fetch_in(&mut tx, windows).await?;
                if let Some(t) = fill_windows(&rows, &mut lines.free, per_key)? {
                    now = t;
                }
            }
            keyed = lines.free;
            keyed.extend(lines.held);
        }
        if let Some(tx) = tx {
            tx.commit().await?;
        }
        let unkeyed = self.claim_unkeyed(sql, queue, token, limits).await?;
        Ok(Claim {
            token,
            now,
            keyed,
            unkeyed,
        })
    }

    /// Follows the keys a claim found held by SQL-API writers (`held.rs`): queues turns
    /// for those held long, names those held longer in a warning. Both run beside the
    /// relay, which goes on with its claim.
    fn observe_held(&self, lines: &mut Leased, now: DateTime<Utc>) {
        let held: Vec<&LineKey> = lines.held.iter().map(|w| &w.line).collect();
        let free: Vec<&LineKey> = lines.free.iter().map(|w| &w.line).collect();
        let connections = self.relay_pool.options().get_max_connections();
        let f = self
            .held
            .observe(&held, &free, connections, std::time::Instant::now());
        for (w, after) in lines.held.iter_mut().zip(&f.recheck) {
            // At most `held.rs`'s 2 s, always in chrono's range.
            let after = chrono::Duration::from_std(*after).unwrap_or(chrono::Duration::seconds(2));
            w.delayed_at = Some(now + after);
        }
        for key in f.turns {
            tokio::spawn(held::take_turn(
                self.relay_pool.clone(),
                self.held_sql.clone(),
                self.held.clone(),
                key,
            ));
        }
        if !f.report.is_empty() {
            let (pool, sql, keys) = (
                self.relay_pool.clone(),
                self.held_sql.clone(),
                self.held.clone(),
            );
            tokio::spawn(async move { held::report(&pool, &sql, &keys, f.report).await });
        }
    }

    /// The next window of a line `token` keeps leased, after `after` (`Store::continue_line`),
    /// read under the check's locks; the window comes with the line's horizon.
    pub(super) async fn read_on_line(
        &self,
        queue: &Queue,
        token: i64,
        line: &LineKey,
        after: EventId,
        limits: ClaimLimits,
    ) -> StoreResult<Option<Continued>> {
        let sql = self.sql(queue.box_kind());
        let Some(check) = &sql.continue_line else {
            return Ok(None);
        };
        let mut tx = self.relay_pool.begin().await?;
        let Some(key) = q(check)
            .bind(&line.topic)
            .bind(&line.key)
            .bind(token)
            .bind(self.known)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(None);
        };
        if !key.try_get::<bool, _>("free")? {
            return Ok(None);
        }
        let cursor: i64 = key.try_get(0)?;
        let horizon: Option<i64> = key.try_get("horizon")?;
        let rows = self
            .line_window(&sql.windows, line, cursor.max(after), limits)
            .fetch_all(&mut *tx)
            .await?;
        let continued = continued(&rows, line, limits, horizon)?;
        tx.commit().await?;
        Ok(continued)
    }

    /// The next window of a line `token` keeps leased, after `after` and up to its
    /// horizon, in one statement without a lock (`Sql::windows_within`): `None` when
    /// the key is no longer leased by `token`, its topic is paused, or nothing due is
    /// left up to the horizon (the caller then reads under lock, past it).
    pub(super) async fn read_within(
        &self,
        queue: &Queue,
        token: i64,
        line: &LineKey,
        after: EventId,
        horizon: EventId,
        limits: ClaimLimits,
    ) -> StoreResult<Option<Continued>> {
        let Some(within) = &self.sql(queue.box_kind()).windows_within else {
            return Ok(None);
        };
        let rows = self
            .line_window(within, line, after, limits)
            .bind(token)
            .bind(horizon)
            .bind(self.known)
            .fetch_all(&self.relay_pool)
            .await?;
        let Some(mut c) = continued(&rows, line, limits, Some(horizon))? else {
            return Ok(None);
        };
        if c.window.rows.is_empty() {
            return Ok(None);
        }
        // More may follow the horizon: a line released after this window is looked at
        // again at once, as after a window a limit cut.
        c.window.full = true;
        Ok(Some(c))
    }

    /// The windows statement (`statement`) for one line, after `after`.
    fn line_window(
        &self,
        statement: &Arc<str>,
        line: &LineKey,
        after: EventId,
        limits: ClaimLimits,
    ) -> PgQuery {
        q(statement)
            .bind(vec![line.topic.clone()])
            .bind(vec![line.key.clone()])
            .bind(i64::from(limits.max_run.max(1)))
            .bind(vec![after])
            .bind(i64::try_from(limits.max_bytes).unwrap_or(i64::MAX))
    }

    /// Runs a read in the claim's transaction when it has one, else on the relay pool.
    async fn fetch_in(
        &self,
        tx: &mut Option<sqlx::Transaction<'static, sqlx::Postgres>>,
        query: PgQuery,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        match tx.as_mut() {
            Some(tx) => query.fetch_all(&mut **tx).await,
            None => query.fetch_all(&self.relay_pool).await,
        }
    }

    /// Claims due unkeyed events within the byte budget, in the order they are due.
    async fn claim_unkeyed(
        &self,
        sql: &Sql,
        queue: &Queue,
        token: i64,
        limits: ClaimLimits,
    ) -> StoreResult<Vec<StoredEvent>> {
        if limits.max_unkeyed == 0 {
            return Ok(Vec::new());
        }
        let rows = gated(
            q(&sql.claim_unkeyed)
                .bind(limits.max_unkeyed as i64)
                .bind(token)
                .bind(millis(limits.lease))
                .bind(i64::try_from(limits.max_bytes).unwrap_or(i64::MAX)),
            queue,
            self.known,
        )
        .fetch_all(&self.relay_pool)
        .await?;
        in_due_order(&rows)
    }

    /// One settle transaction; the inner error is the schema gate's refusal (rolled back,
    /// not retried). The requirement is read last, after every write: in READ COMMITTED
    /// each statement sees what committed before it began, so when the last one finds no
    /// requirement above this binary, neither did any write before it. A migration that
    /// raises it after that read commits after the writes' snapshots, as though it had
    /// come after the settle.
    pub(super) async fn settle_once(
        &self,
        s: Settlement<'_>,
    ) -> Result<StoreResult<SettleReport>, sqlx::Error> {
        let sql = self.sql(s.queue.box_kind());
        let mut tx = self.relay_pool.begin().await?;
        if !s.releases.is_empty() {
            lock_released_keys(&mut tx, sql, &s).await?;
        }
        let runs = covered_runs(&mut tx, sql, &s).await?;
        let mut applied = runs.covered.len();
        let updates: Vec<&EventUpdate> = s
            .updates
            .iter()
            .filter(|u| !runs.covered.contains(&u.id()))
            .collect();
        if !updates.is_empty() {
            applied += apply_updates(&mut tx, sql, s.token, &updates).await?;
        }
        if !s.releases.is_empty() {
            release_keys(&mut tx, sql, &s, &runs.per_key).await?;
        }
        let required: i64 =
            sqlx::query_scalar(AssertSqlSafe(self.names.fixed(super::sql::REQUIRED)))
                .fetch_one(&mut *tx)
                .await?;
        if required > self.known {
            tx.rollback().await?;
            return Ok(Err(StoreError::SchemaRefused {
                binary: self.known,
                required,
            }));
        }
        tx.commit().await?;
        Ok(Ok(SettleReport::of(applied, s.updates.len())))
    }

    pub(super) async fn renew_once(&self, r: Renewal<'_>) -> Result<usize, sqlx::Error> {
        let (queue, token, lines, unkeyed, lease) = (r.queue, r.token, r.lines, r.unkeyed, r.lease);
        let sql = self.sql(queue.box_kind());
        let mut held = 0;
        if !lines.is_empty() {
            let topics: Vec<&str> = lines.iter().map(|l| l.topic.as_str()).collect();
            let names: Vec<&str> = lines.iter().map(|l| l.key.as_str()).collect();
            // `as usize` fits: at most one key row per line.
            #[allow(clippy::cast_possible_truncation)]
            let changed = gated(
                q(&sql.renew_keys)
                    .bind(topics)
                    .bind(names)
                    .bind(millis(lease))
                    .bind(token),
                queue,
                self.known,
            )
            .execute(&self.relay_pool)
            .await?
            .rows_affected() as usize;
            held += changed;
        }
        if !unkeyed.is_empty() {
            // `as usize` fits: at most one row per id in `unkeyed`.
            #[allow(clippy::cast_possible_truncation)]
            let changed = gated(
                q(&sql.renew_unkeyed)
                    .bind(unkeyed)
                    .bind(token)
                    .bind(millis(lease)),
                queue,
                self.known,
            )
            .execute(&self.relay_pool)
            .await?
            .rows_affected() as usize;
            held += changed;
        }
        Ok(held)
    }
}

/// A PostgreSQL statement with its parameters bound.
type PgQuery = sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// The leased keys of a claim, split by their order lock: the free ones get windows
/// (their cursors, topics and names are the windows statement's arrays), the held ones
/// come back empty.
struct Leased {
    free: Vec<KeyWindow>,
    topics: Vec<String>,
    names: Vec<String>,
    cursors: Vec<i64>,
    held: Vec<KeyWindow>,
}

impl Leased {
    /// Windows are read for the keys whose order lock was free; the others come back
    /// empty, to be looked at again after the backoff `observe_held` sets (`held.rs`) or
    /// as soon as the writer's commit is folded in (which pulls `ready_at` to now). Their `line_end` covers every
    /// id, so nothing counts as new at the release.
    fn split(leased: &[PgRow]) -> StoreResult<Leased> {
        let mut l = Leased {
            free: Vec::with_capacity(leased.len()),
            topics: Vec::with_capacity(leased.len()),
            names: Vec::with_capacity(leased.len()),
            cursors: Vec::with_capacity(leased.len()),
            held: Vec::new(),
        };
        for r in leased {
            let line = LineKey {
                topic: r.try_get(0)?,
                key: r.try_get(1)?,
            };
            if !r.try_get::<bool, _>("free")? {
                l.held.push(KeyWindow {
                    line,
                    rows: Vec::new(),
                    full: false,
                    delayed_at: None,
                    line_end: Some(i64::MAX),
                });
                continue;
            }
            l.cursors.push(r.try_get(2)?);
            l.topics.push(line.topic.clone());
            l.names.push(line.key.clone());
            l.free.push(KeyWindow {
                line,
                rows: Vec::new(),
                full: false,
                delayed_at: None,
                line_end: None,
            });
        }
        Ok(l)
    }
}

/// A continued line's window from the windows statement's rows (`None` without a row:
/// the statement found the key not leased to the caller).
fn continued(
    rows: &[PgRow],
    line: &LineKey,
    limits: ClaimLimits,
    horizon: Option<EventId>,
) -> StoreResult<Option<Continued>> {
    let mut windows = [KeyWindow {
        line: line.clone(),
        rows: Vec::new(),
        full: false,
        delayed_at: None,
        line_end: None,
    }];
    let now = fill_windows(rows, &mut windows, limits.max_run.max(1))?;
    let [window] = windows;
    Ok(now.map(|now| Continued {
        now,
        window,
        horizon,
    }))
}

/// Fills the windows from the windows statement's rows: in claim order, ids ascending;
/// the rows past the byte budget come back not `taken`, and their keys' windows end
/// before them, marked full (looked at again at once). Returns the clock the windows
/// judged delays by (planning must judge them alike), if any row came back.
fn fill_windows(
    rows: &[PgRow],
    keyed: &mut [KeyWindow],
    per_key: u32,
) -> StoreResult<Option<DateTime<Utc>>> {
    let mut in_line = vec![0usize; keyed.len()];
    let now = match rows.first() {
        Some(r) => Some(r.try_get("now")?),
        None => None,
    };
    for r in rows {
        let i = usize::try_from(r.try_get::<i64, _>("o")? - 1)
            .map_err(|_| StoreError::other("bad ordinality"))?;
        let w = &mut keyed[i];
        w.line_end = r.try_get("line_end")?;
        w.delayed_at = r.try_get("delayed_at")?;
        if r.try_get::<Option<i64>, _>("id")?.is_some() {
            in_line[i] += 1;
            if r.try_get::<bool, _>("taken")? {
                w.rows.push(decode_event(r)?);
            }
        }
    }
    for (w, &n) in keyed.iter_mut().zip(&in_line) {
        w.full = n >= per_key as usize || w.rows.len() < n;
    }
    Ok(now)
}

/// Locks the settlement's still-valid keys in byte order, the order enqueue, receive
/// and the admin flows take them (Rust's sort of `(topic, key)`): the statement locks in
/// the array's order, so the database's collation (ICU, en_US…) plays no part.
async fn lock_released_keys(
    tx: &mut sqlx::PgConnection,
    sql: &Sql,
    s: &Settlement<'_>,
) -> Result<(), sqlx::Error> {
    let mut sorted: Vec<&LineKey> = s.releases.iter().map(|r| &r.line).collect();
    sorted.sort();
    let topics: Vec<String> = sorted.iter().map(|l| l.topic.clone()).collect();
    let names: Vec<String> = sorted.iter().map(|l| l.key.clone()).collect();
    scoped(
        q(&sql.lock_keys).bind(topics).bind(names).bind(s.token),
        s.queue,
    )
    .fetch_all(tx)
    .await?;
    Ok(())
}

/// The completions that move their keys' cursors (the outbox): the events a cursor
/// covers, and per key the new cursor, how many events it covers and how many of them
/// were counted.
#[derive(Default)]
struct Runs {
    covered: HashSet<EventId>,
    per_key: HashMap<LineKey, (i64, i64, i64)>,
}

/// Completions of keyed events move their keys' cursors (the outbox), with the release:
/// what a cursor covers needs no row of its own. Only keys released here can move, since
/// the release is what moves them.
async fn covered_runs(
    tx: &mut sqlx::PgConnection,
    sql: &Sql,
    s: &Settlement<'_>,
) -> Result<Runs, sqlx::Error> {
    let mut runs = Runs::default();
    let Some(check) = &sql.check_runs else {
        return Ok(runs);
    };
    let done: HashSet<EventId> = EventUpdate::completed_ids(s.updates).collect();
    // The released lines with completions, each completion one of this settle's updates.
    let lines: Vec<(&LineKey, Vec<EventId>)> = s
        .releases
        .iter()
        .filter(|r| !r.completed.is_empty() && r.completed.iter().all(|id| done.contains(id)))
        .map(|r| {
            let mut ids = r.completed.clone();
            ids.sort_unstable();
            ids.dedup();
            (&r.line, ids)
        })
        .collect();
    if lines.is_empty() {
        return Ok(runs);
    }
    let topics: Vec<&str> = lines.iter().map(|(l, _)| l.topic.as_str()).collect();
    let names: Vec<&str> = lines.iter().map(|(l, _)| l.key.as_str()).collect();
    let through: Vec<EventId> = lines.iter().map(|(_, ids)| ids[ids.len() - 1]).collect();
    let rows = sqlx::query(AssertSqlSafe(check.clone()))
        .bind(topics)
        .bind(names)
        .bind(through)
        .bind(s.token)
        .fetch_all(tx)
        .await?;
    for r in &rows {
        let o: i64 = r.try_get("o")?;
        let Some((line, completed)) = usize::try_from(o - 1).ok().and_then(|i| lines.get(i)) else {
            continue;
        };
        // Covered only when the pending events above the cursor, up to the last
        // completion, are exactly the completions: none skipped (delayed, late, requeued)
        // and none gone (cancelled while in flight).
        let pending: Option<Vec<i64>> = r.try_get("ids")?;
        if pending.as_deref() != Some(completed.as_slice()) {
            continue;
        }
        runs.covered.extend(completed.iter().copied());
        let n = i64::try_from(completed.len()).unwrap_or(i64::MAX);
        let run = (completed[completed.len() - 1], n, r.try_get("counted")?);
        runs.per_key.insert((*line).clone(), run);
    }
    Ok(runs)
}

/// Applies the updates no cursor covers, in one statement; returns how many it changed.
async fn apply_updates(
    tx: &mut sqlx::PgConnection,
    sql: &Sql,
    token: i64,
    updates: &[&EventUpdate],
) -> Result<usize, sqlx::Error> {
    let n = updates.len();
    let mut ids = Vec::with_capacity(n);
    let mut kind = Vec::with_capacity(n);
    let mut attempts: Vec<Option<i32>> = Vec::with_capacity(n);
    let mut delay: Vec<Option<i64>> = Vec::with_capacity(n);
    let mut at: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(n);
    let mut error: Vec<Option<&str>> = Vec::with_capacity(n);
    for u in updates {
        ids.push(u.id());
        let c = u.columns();
        // The statement's kinds: a pending update is a retry or a release.
        let k = match (c.status, c.release) {
            (_, true) => "release",
            (Status::Pending, false) => "retry",
            (other, false) => other.as_str(),
        };
        let (d, t) = match c.due {
            Some(Due::After(delay)) => (Some(millis(delay)), None),
            Some(Due::At(at)) => (None, Some(at)),
            None => (None, None),
        };
        kind.push(k);
        attempts.push(c.attempts.map(|n| n as i32));
        delay.push(d);
        at.push(t);
        error.push(c.error);
    }
    // `as usize` fits: the statement changes at most one row per update.
    #[allow(clippy::cast_possible_truncation)]
    let changed = q(&sql.settle_events)
        .bind(&ids)
        .bind(&kind)
        .bind(&attempts)
        .bind(&delay)
        .bind(&at)
        .bind(&error)
        .bind(token)
        .execute(tx)
        .await?
        .rows_affected() as usize;
    Ok(changed)
}

/// Releases the settlement's keys with their next ready times, moving the cursors of
/// the keys in `runs` (the outbox's `release_advance`) when there are any.
async fn release_keys(
    tx: &mut sqlx::PgConnection,
    sql: &Sql,
    s: &Settlement<'_>,
    runs: &HashMap<LineKey, (i64, i64, i64)>,
) -> Result<(), sqlx::Error> {
    let n = s.releases.len();
    let mut topics = Vec::with_capacity(n);
    let mut names = Vec::with_capacity(n);
    let mut at = Vec::with_capacity(n);
    let mut after = Vec::with_capacity(n);
    let mut seen = Vec::with_capacity(n);
    let mut keep = Vec::with_capacity(n);
    for r in s.releases {
        topics.push(r.line.topic.clone());
        names.push(r.line.key.clone());
        at.push(r.ready.at);
        // A kept key's `after_ms` is its new lease.
        after.push(r.keep.or(r.ready.after).map(millis));
        seen.push(r.ready.seen_up_to);
        keep.push(r.keep.is_some());
    }
    let (statement, advance) = match &sql.release_advance {
        Some(advance) if !runs.is_empty() => (advance, true),
        _ => (&sql.release_keys, false),
    };
    let release = q(statement)
        .bind(topics)
        .bind(names)
        .bind(at)
        .bind(after)
        .bind(seen)
        .bind(s.token);
    if !advance {
        // The outbox's statement takes the keep flags; the inbox's, its subscription.
        if sql.continue_line.is_some() {
            release.bind(keep).execute(tx).await?;
        } else {
            scoped(release, s.queue).execute(tx).await?;
        }
        return Ok(());
    }
    let mut through: Vec<Option<i64>> = Vec::with_capacity(n);
    let mut covered: Vec<Option<i64>> = Vec::with_capacity(n);
    let mut counted: Vec<Option<i64>> = Vec::with_capacity(n);
    for r in s.releases {
        let run = runs.get(&r.line);
        through.push(run.map(|r| r.0));
        covered.push(run.map(|r| r.1));
        counted.push(run.map(|r| r.2));
    }
    release
        .bind(through)
        .bind(covered)
        .bind(counted)
        .bind(keep)
        .execute(tx)
        .await?;
    Ok(())
}

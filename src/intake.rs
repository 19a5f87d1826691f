//! Group commit for `Enqueue`. Requests that arrive together are written together: one
//! transaction, one multi-row insert, then every waiting caller is answered. Throughput
//! grows with concurrency instead of being capped by one commit per event.
//!
//! Before anything is queued, each event's Kafka record is checked against its topic's
//! `max.message.bytes` as the cluster reports it (`sink::kafka::topic_limits`), when the
//! sink has such limits: an event the broker would refuse is never stored.
//!
//! Groups follow one another: a group starts while another is in flight only once that
//! one has run for `overlap_after` (a lock wait, a large batch). Groups that overlap on
//! one database wait on each other's key rows and split the callers into smaller
//! transactions; measured, one group at a time stored more, with 1 instance or 3
//! (docs/benchmarks.md). The overlap is what keeps one stuck transaction (an
//! idempotency key an open SQL transaction holds) from stopping the intake.
//!
//! The queue in front of the writers is bounded; when it is full the caller is told at
//! once (`Overloaded`) rather than queued without bound. A caller is answered only after
//! the commit of its events.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore, mpsc, oneshot};

use crate::domain::{Enqueued, NewEvent};
use crate::error::{Error, FieldViolation};
use crate::sink::kafka::topic_limits::TopicLimits;
use crate::store::{Admission, Store};

type Reply = oneshot::Sender<Result<Vec<Enqueued>, Error>>;

struct Job {
    events: Vec<NewEvent>,
    /// The request's span (its RPC's), which the group's database span links to.
    caller: tracing::Span,
    /// The job's weight in the queue's byte budget, given back when the job is dropped
    /// (answered).
    bytes: QueuedBytes,
    /// All or nothing, and able to conflict (it carries idempotency keys): the job gets a
    /// transaction of its own. Jobs without idempotency keys cannot conflict, so even an
    /// atomic batch shares the group's single statement, which stores all or nothing.
    solo: bool,
    reply: Reply,
}

/// Tuning for the group committer.
#[derive(Debug, Clone, Copy)]
pub struct IntakeConfig {
    /// Requests waiting for a writer before callers are turned away.
    pub queue_depth: usize,
    /// Transactions in flight at once, at most.
    pub writers: usize,
    /// A group starts while the previous one is still in flight only once that one has
    /// run this long; zero starts groups whenever a writer is free.
    pub overlap_after: Duration,
    /// Events per group transaction at most.
    pub max_group: usize,
    /// Bytes (payload, headers, key, topic) of the requests queued or being written,
    /// at most; one request is always admitted when nothing else is queued.
    pub queue_bytes: usize,
    /// Bytes per group transaction at most (a single request larger than this still
    /// gets a transaction of its own).
    pub max_group_bytes: usize,
}

impl Default for IntakeConfig {
    fn default() -> Self {
        IntakeConfig {
            queue_depth: 10_000,
            writers: 4,
            overlap_after: Duration::from_millis(20),
            max_group: 1_000,
            queue_bytes: 256 * 1024 * 1024,
            max_group_bytes: 16 * 1024 * 1024,
        }
    }
}

/// The handle the API uses to store events.
#[derive(Clone)]
pub struct Intake {
    tx: mpsc::Sender<Job>,
    queued: Arc<AtomicUsize>,
    queue_bytes: usize,
    topic_limits: Option<TopicLimits>,
}

/// Bytes an event weighs in the intake's budgets.
pub fn event_bytes(e: &NewEvent) -> usize {
    e.payload.len()
        + e.topic.len()
        + e.key.as_ref().map_or(0, String::len)
        + e.headers
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
        + e.event_type.as_ref().map_or(0, String::len)
        + e.idempotency_key.as_ref().map_or(0, String::len)
}

/// A share of the queue's byte budget, given back on drop.
struct QueuedBytes {
    n: usize,
    queued: Arc<AtomicUsize>,
}

impl Drop for QueuedBytes {
    fn drop(&mut self) {
        self.queued.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// Wakes whoever should look at freshly committed events: the local relays at once, and
/// (on PostgreSQL) the notifier that tells the other processes.
#[derive(Clone, Default)]
pub struct Wakeup {
    relays: Arc<std::sync::Mutex<Vec<Arc<Notify>>>>,
    remote: Arc<std::sync::Mutex<Option<Arc<Notify>>>>,
}

impl Wakeup {
    /// Adds a local outbox relay's waker.
    pub fn register(&self, n: Arc<Notify>) {
        self.relays.lock().expect("wakeup lock").push(n);
    }
    /// Sets the trigger of the PostgreSQL notifier, which tells other processes.
    pub fn set_remote(&self, n: Arc<Notify>) {
        *self.remote.lock().expect("wakeup lock") = Some(n);
    }
    /// Wakes the local relays only (e.g. on a notification from another process).
    pub fn wake_local(&self) {
        for n in self.relays.lock().expect("wakeup lock").iter() {
            n.notify_one();
        }
    }
    /// Wakes the local relays and, if set, the notifier.
    pub fn wake(&self) {
        self.wake_local();
        if let Some(n) = self.remote.lock().expect("wakeup lock").as_ref() {
            n.notify_one();
        }
    }
}

impl Intake {
    /// Starts the committer. It stops when every `Intake` handle is dropped, after
    /// answering everything already queued.
    pub fn start(store: Arc<dyn Store>, config: IntakeConfig, wakeup: Wakeup) -> Intake {
        let (tx, rx) = mpsc::channel(config.queue_depth);
        tokio::spawn(run_committer(store, config, rx, wakeup));
        Intake {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            queue_bytes: config.queue_bytes,
            topic_limits: None,
        }
    }

    /// Checks each event's record against its topic's limit in `limits` (`check_records`).
    pub fn with_topic_limits(mut self, limits: Option<TopicLimits>) -> Self {
        self.topic_limits = limits;
        self
    }

    /// Refuses (`InvalidArgument`, on the field `field(i)` names) every event whose Kafka
    /// record would be over its topic's `max.message.bytes`, counted as the producer will
    /// send it. Topics whose limit is unknown pass: the configured limits are checked
    /// already.
    pub async fn check_records(
        &self,
        events: &[NewEvent],
        field: impl Fn(usize) -> String,
    ) -> Result<(), Error> {
        let Some(limits) = &self.topic_limits else {
            return Ok(());
        };
        let mut violations = Vec::new();
        for (i, e) in events.iter().enumerate() {
            if let Err(too_large) = limits.check(e).await {
                violations.push(FieldViolation::new(field(i), too_large.to_string()));
            }
        }
        if violations.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(violations))
        }
    }

    /// Reserves `n` bytes of the queue's budget; a request is always admitted into an
    /// empty queue, however large (the gRPC limits bound it).
    fn reserve(&self, n: usize) -> Option<QueuedBytes> {
        let mut cur = self.queued.load(Ordering::Acquire);
        loop {
            if cur > 0 && cur.saturating_add(n) > self.queue_bytes {
                return None;
            }
            match self.queued.compare_exchange_weak(
                cur,
                cur + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Some(QueuedBytes {
                        n,
                        queued: self.queued.clone(),
                    });
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Stores events; `atomic` makes the whole slice one transaction that stores all or
    /// nothing (an idempotency conflict anywhere fails it).
    pub async fn submit(
        &self,
        events: Vec<NewEvent>,
        atomic: bool,
    ) -> Result<Vec<Enqueued>, Error> {
        let (reply, rx) = oneshot::channel();
        let bytes = self
            .reserve(events.iter().map(event_bytes).sum())
            .ok_or_else(|| {
                Error::Overloaded(
                    "enqueue queue is full (MAILROOM_INTAKE_QUEUE_BYTES); retry with backoff"
                        .into(),
                )
            })?;
        self.tx
            .try_send(Job {
                caller: tracing::Span::current(),
                solo: atomic && events.iter().any(|e| e.idempotency_key.is_some()),
                events,
                bytes,
                reply,
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => {
                    Error::Overloaded("enqueue queue is full; retry with backoff".into())
                }
                mpsc::error::TrySendError::Closed(_) => Error::Unavailable("shutting down".into()),
            })?;
        rx.await
            .map_err(|_| Error::Unavailable("writer stopped before answering".into()))?
    }
}

async fn run_committer(
    store: Arc<dyn Store>,
    config: IntakeConfig,
    mut rx: mpsc::Receiver<Job>,
    wakeup: Wakeup,
) {
    // `acquire_many` (at the end) takes a u32: saturate the writer count, for both.
    let n_writers = u32::try_from(config.writers.max(1)).unwrap_or(u32::MAX);
    let writers = Arc::new(Semaphore::new(n_writers as usize));
    let mut carry: Option<Job> = None;
    // The last group started: when, and a receiver that completes when it ends.
    let mut last: Option<(tokio::time::Instant, oneshot::Receiver<()>)> = None;
    loop {
        // Wait for a free writer first: while all are busy, requests pile up in the
        // queue and the next group takes them all.
        let permit = writers
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore open");
        let first = match carry.take() {
            Some(j) => j,
            None => match rx.recv().await {
                Some(j) => j,
                None => break,
            },
        };
        // Every other group in flight had run `overlap_after` when the last one started,
        // so waiting for the last one (or for it to reach that age) is enough. Requests
        // arriving meanwhile join this group.
        if let Some((started, mut ended)) = last.take() {
            tokio::select! {
                _ = &mut ended => {}
                _ = tokio::time::sleep_until(started + config.overlap_after) => {}
            }
        }
        let mut group = vec![first];
        if !group[0].solo {
            let mut size = group[0].events.len();
            let mut bytes = group[0].bytes.n;
            while size < config.max_group && bytes < config.max_group_bytes {
                match rx.try_recv() {
                    Ok(j) if !joins(&config, bytes, j.solo, j.bytes.n) => {
                        carry = Some(j);
                        break;
                    }
                    Ok(j) => {
                        size += j.events.len();
                        bytes += j.bytes.n;
                        group.push(j);
                    }
                    Err(_) => break,
                }
            }
        }
        let store = store.clone();
        let wakeup = wakeup.clone();
        let (end, ended) = oneshot::channel::<()>();
        last = Some((tokio::time::Instant::now(), ended));
        tokio::spawn(async move {
            commit_group(store.as_ref(), group, &wakeup).await;
            drop(permit);
            drop(end);
        });
    }
    // Wait for the last transactions before the committer ends.
    let _ = writers.acquire_many(n_writers).await;
}

/// Whether a queued job joins a group of `bytes` bytes so far: a job with a transaction
/// of its own (`solo`) never does, and one that would take the group over its byte
/// budget starts the next group instead. (The event count is checked before each job,
/// so a group may exceed `max_group` by the events of its last job, as before.)
fn joins(config: &IntakeConfig, bytes: usize, solo: bool, job_bytes: usize) -> bool {
    !solo && bytes.saturating_add(job_bytes) <= config.max_group_bytes
}

async fn commit_group(store: &dyn Store, mut group: Vec<Job>, wakeup: &Wakeup) {
    let atomic = group.len() == 1 && group[0].solo;
    // The events move out of their jobs, each job keeping its count: a payload is never
    // copied (a 64 MiB batch was held twice, beyond what admission charged for it).
    let counts: Vec<usize> = group.iter().map(|j| j.events.len()).collect();
    let events: Vec<NewEvent> = group
        .iter_mut()
        .flat_map(|j| std::mem::take(&mut j.events))
        .collect();
    // One client span per group commit, linked to the RPC of each request it stores.
    let span = crate::telemetry::db_span(
        tracing::Level::INFO,
        store.engine(),
        "INSERT outbox_events",
        "INSERT",
        "outbox_events",
        events.len(),
    );
    for j in &group {
        crate::telemetry::link_span(&span, &j.caller);
    }
    // A deadlock or serialization failure is run again by the store (`retry_aborted`),
    // the one layer that retries aborted transactions.
    let stored = tracing::Instrument::instrument(store.enqueue(&events, atomic), span).await;
    // The payloads are freed before anyone is answered: admission gives a request's
    // bytes back when it has its answer.
    let keys: Vec<Option<String>> = events.into_iter().map(|e| e.idempotency_key).collect();
    match stored {
        Err(e) => {
            let e = Error::from(e);
            tracing::warn!(error = %e, events = keys.len(), "enqueue transaction failed");
            for j in group {
                let _ = j.reply.send(Err(e.clone()));
            }
        }
        Ok(admissions) => {
            if admissions
                .iter()
                .any(|a| matches!(a, Admission::Inserted(_)))
                && !(atomic && admissions.contains(&Admission::Conflict))
            {
                wakeup.wake();
            }
            let mut it = admissions.into_iter().zip(keys);
            for (j, n) in group.into_iter().zip(counts) {
                let mut out = Vec::with_capacity(n);
                let mut conflict = None;
                for _ in 0..n {
                    let (a, key) = it.next().expect("one admission per event");
                    match a {
                        Admission::Inserted(id) => out.push(Enqueued::Inserted(id)),
                        Admission::Duplicate(id) => out.push(Enqueued::Duplicate(id)),
                        Admission::Conflict => {
                            conflict.get_or_insert_with(|| Error::AlreadyExists {
                                key: key.unwrap_or_default(),
                            });
                        }
                    }
                }
                let _ = j.reply.send(match conflict {
                    Some(e) => Err(e),
                    None => Ok(out),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn intake(queue_bytes: usize) -> Intake {
        let (tx, _rx) = mpsc::channel(1);
        Intake {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            queue_bytes,
            topic_limits: None,
        }
    }

    #[test]
    fn the_queue_is_bounded_in_bytes_but_always_admits_one_request() {
        let i = intake(100);
        let big = i.reserve(150).expect("an empty queue admits any request");
        assert!(i.reserve(1).is_none(), "over the budget");
        drop(big);
        let a = i.reserve(60).unwrap();
        let b = i.reserve(40).unwrap();
        assert!(i.reserve(1).is_none());
        drop(a);
        assert!(
            i.reserve(60).is_some(),
            "answered requests give their bytes back"
        );
        drop(b);
        assert_eq!(i.queued.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_group_commit_is_bounded_in_bytes() {
        let c = IntakeConfig {
            max_group_bytes: 100,
            ..IntakeConfig::default()
        };
        assert!(joins(&c, 60, false, 40));
        assert!(!joins(&c, 60, false, 41), "over the budget: next group");
        assert!(
            !joins(&c, 0, true, 1),
            "a solo job has a transaction of its own"
        );
        assert!(!joins(&c, usize::MAX, false, 1));
    }

    #[test]
    fn an_event_weighs_its_payload_and_strings() {
        let mut e = NewEvent {
            topic: "t".into(),
            key: Some("kk".into()),
            payload: vec![0; 10],
            headers: Default::default(),
            event_type: Some("ty".into()),
            idempotency_key: None,
            deliver_after: None,
            max_attempts: 6,
        };
        e.headers.insert("h".into(), "vvv".into());
        assert_eq!(event_bytes(&e), 10 + 1 + 2 + 4 + 2);
    }
}

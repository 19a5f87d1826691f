//! Keeps a subscription's tasks (its Kafka consumer and its dispatcher) running: a task
//! that panics is logged and started again after a pause that doubles up to 5 s. A
//! subscription whose tasks died [`CRASH_LOOP`] times within [`CRASH_WINDOW`] is
//! crash-looping: its readiness (`inbox/<subscription>` and `mailroom.v1.InboxService`
//! in `grpc.health.v1`) is `NOT_SERVING` until its tasks have run [`HEALTHY_AFTER`]
//! without dying. Restarts are counted per task (`mailroom_inbox_task_restarts`).

use std::any::Any;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Deaths within [`CRASH_WINDOW`] that make a subscription crash-looping.
pub const CRASH_LOOP: usize = 3;
/// The window [`CRASH_LOOP`] deaths are counted over.
pub const CRASH_WINDOW: Duration = Duration::from_secs(60);
/// How long restarted tasks must run without dying for the subscription to be ready again.
pub const HEALTHY_AFTER: Duration = Duration::from_secs(10);

const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// The supervised tasks of one subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// The Kafka consumer (intake).
    Consumer,
    /// The dispatcher (relay engine over the handler).
    Dispatcher,
}

impl Task {
    /// The task's name in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Task::Consumer => "consumer",
            Task::Dispatcher => "dispatcher",
        }
    }
}

/// A subscription's task health, read by health checks and metrics.
#[derive(Debug, Default)]
pub struct TaskHealth {
    /// Restarts of the consumer after a panic.
    pub consumer_restarts: AtomicU64,
    /// Restarts of the dispatcher after a panic.
    pub dispatcher_restarts: AtomicU64,
    crash_looping: AtomicBool,
}

impl TaskHealth {
    /// Restarts of `task` so far.
    pub fn restarts(&self, task: Task) -> &AtomicU64 {
        match task {
            Task::Consumer => &self.consumer_restarts,
            Task::Dispatcher => &self.dispatcher_restarts,
        }
    }

    /// Whether the subscription's tasks keep dying.
    pub fn crash_looping(&self) -> bool {
        self.crash_looping.load(Ordering::Relaxed)
    }
}

/// A panic's message.
pub fn panic_text(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Runs the task `start` makes until it returns (shutdown, or a start-up error it
/// logged), starting it again each time it panics.
pub async fn supervise<F, Fut>(
    subscription: String,
    task: Task,
    health: Arc<TaskHealth>,
    shutdown: CancellationToken,
    mut start: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut deaths: VecDeque<Instant> = VecDeque::new();
    let mut pause = FIRST_PAUSE;
    loop {
        let mut handle = tokio::spawn(start());
        let started = Instant::now();
        let outcome = loop {
            let healthy_at = started + HEALTHY_AFTER;
            tokio::select! {
                r = &mut handle => break r,
                _ = tokio::time::sleep_until(healthy_at), if health.crash_looping() || !deaths.is_empty() => {
                    deaths.clear();
                    pause = FIRST_PAUSE;
                    if health.crash_looping.swap(false, Ordering::Relaxed) {
                        tracing::info!(subscription, task = task.as_str(),
                            "restarted task has run without dying: subscription ready again");
                    }
                }
            }
        };
        let panic = match outcome {
            Ok(()) => return,
            Err(e) if e.is_panic() => panic_text(e.into_panic().as_ref()),
            Err(_) => return,
        };
        let restarts = health.restarts(task).fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        deaths.push_back(now);
        while deaths
            .front()
            .is_some_and(|t| now.duration_since(*t) > CRASH_WINDOW)
        {
            deaths.pop_front();
        }
        if deaths.len() >= CRASH_LOOP && !health.crash_looping.swap(true, Ordering::Relaxed) {
            tracing::error!(
                subscription,
                task = task.as_str(),
                deaths = deaths.len(),
                "subscription task keeps dying: inbox readiness NOT_SERVING"
            );
        }
        tracing::error!(subscription, task = task.as_str(), panic = %panic, restarts,
            pause_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
            "subscription task panicked; starting it again");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[tokio::test(start_paused = true)]
    async fn a_task_that_keeps_dying_is_restarted_and_marks_the_subscription() {
        let health = Arc::new(TaskHealth::default());
        let runs = Arc::new(AtomicU32::new(0));
        let shutdown = CancellationToken::new();
        let r = runs.clone();
        let sup = tokio::spawn(supervise(
            "s".into(),
            Task::Consumer,
            health.clone(),
            shutdown.clone(),
            move || {
                let n = r.fetch_add(1, Ordering::Relaxed);
                async move {
                    if n < 3 {
                        panic!("boom {n}");
                    }
                    std::future::pending::<()>().await;
                }
            },
        ));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(runs.load(Ordering::Relaxed), 4, "three deaths, four starts");
        assert_eq!(health.consumer_restarts.load(Ordering::Relaxed), 3);
        assert!(health.crash_looping());
        tokio::time::sleep(HEALTHY_AFTER).await;
        assert!(!health.crash_looping(), "ready again after running quietly");
        shutdown.cancel();
        sup.abort();
    }
}

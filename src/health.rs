//! Health: `grpc.health.v1` statuses for the whole server ("") and each service, driven
//! by a background check of the database (and, optionally, of the broker). SERVING while
//! the database answers, NOT_SERVING while it does not, while the broker has been
//! unreachable longer than `ready_max_broker_down_ms`, or the oldest pending event is older
//! than `ready_max_lag_ms` (each when set), while the database's schema is one this
//! binary must not act on (`crate::schema`), and from the moment shutdown begins. The `liveness` service stays SERVING while the process runs.
//! `mailroom.v1.InboxService` and `inbox/<subscription>` are also NOT_SERVING while a
//! subscription's tasks keep dying (`inbox::supervisor`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::domain::BoxKind;
use crate::inbox::supervisor::TaskHealth;
use crate::relay::RelayStats;
use crate::schema::SchemaGate;
use crate::store::Store;
use crate::store::schema::Compat;

/// Services whose status follows the database.
pub const SERVICES: &[&str] = &[
    "",
    "mailroom.v1.OutboxService",
    "mailroom.v1.AdminService",
    "mailroom.v1.InboxService",
];

/// A service name saying whether the database is at this binary's schema or a newer one
/// that accepts it: `NOT_SERVING` while migrations are pending (`Compat::Behind`), the
/// schema requires a newer binary, or it cannot be read. Informational: readiness (`""`)
/// drops only for the last two (a binary whose migrations are pending still serves
/// what its statements can do).
pub const SCHEMA: &str = "schema";

/// A service name for liveness probes: SERVING from start-up until the process exits,
/// whatever the database does (restarting a process does not bring a database back).
pub const LIVENESS: &str = "liveness";

/// The health service name of one subscription: `NOT_SERVING` while its tasks keep
/// dying (`inbox::supervisor`), or while the process is not ready at all.
pub fn subscription_service(subscription: &str) -> String {
    format!("inbox/{subscription}")
}

/// Each service's readiness: every service follows `ready` (database, broker, lag);
/// `mailroom.v1.InboxService` also needs every subscription's tasks alive, and
/// `inbox/<subscription>` its own. The outbox's services do not depend on the inbox.
fn statuses(ready: bool, inbox: &HashMap<String, Arc<TaskHealth>>) -> Vec<(String, bool)> {
    let any_looping = inbox.values().any(|h| h.crash_looping());
    let mut v: Vec<(String, bool)> = SERVICES
        .iter()
        .map(|s| {
            let up = ready && !(*s == "mailroom.v1.InboxService" && any_looping);
            (s.to_string(), up)
        })
        .collect();
    v.extend(
        inbox
            .iter()
            .map(|(name, h)| (subscription_service(name), ready && !h.crash_looping())),
    );
    v
}

/// What readiness looks at.
pub struct Checks {
    /// The database, pinged.
    pub store: Arc<dyn Store>,
    /// The outbox relays, for how long the destination has been unreachable.
    pub relays: Vec<Arc<RelayStats>>,
    /// Each subscription's tasks.
    pub inbox: Arc<HashMap<String, Arc<TaskHealth>>>,
    /// Readiness drops once the destination has been unreachable this long.
    pub max_broker_down: Option<Duration>,
    /// Readiness drops while the oldest pending event is older than this.
    pub max_lag: Option<Duration>,
    /// How often to check.
    pub interval: Duration,
    /// Readiness drops while the database's schema is one this binary must not act on.
    pub schema: SchemaGate,
}

/// The `grpc.health.v1` statuses of every service.
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
}

impl Health {
    /// Health over tonic-health's reporter.
    pub fn new(reporter: HealthReporter) -> Self {
        Health { reporter }
    }

    /// Marks the process alive (`LIVENESS`).
    pub async fn set_live(&self) {
        self.reporter
            .set_service_status(LIVENESS, ServingStatus::Serving)
            .await;
    }

    /// Sets every service's status (the empty name included).
    pub async fn set_all(&self, status: ServingStatus) {
        for s in SERVICES {
            self.reporter.set_service_status(*s, status).await;
        }
    }

    /// Checks readiness every `interval` until `shutdown`, flipping the status on each
    /// change: the database must answer a ping within the interval, and, when
    /// `max_broker_down` is set, no outbox relay may have found its destination
    /// unreachable for longer than that.
    pub async fn monitor(self, checks: Checks, shutdown: CancellationToken) {
        let Checks {
            store,
            relays,
            inbox,
            max_broker_down,
            max_lag,
            interval,
            schema,
        } = checks;
        let mut serving = true;
        // What each service was last set to (set_all at start-up made them SERVING).
        let mut shown: HashMap<String, bool> =
            SERVICES.iter().map(|s| (s.to_string(), true)).collect();
        let mut lag = LagCheck::default();
        loop {
            if let Some(max) = max_lag {
                lag.update(&*store, max).await;
            }
            let lag_ok = lag.ok;
            let db_ok = matches!(
                tokio::time::timeout(interval.max(Duration::from_millis(500)), store.ping()).await,
                Ok(Ok(()))
            );
            let broker_down_for = relays.iter().filter_map(|r| r.unreachable_for()).max();
            let broker_ok = match (max_broker_down, broker_down_for) {
                (Some(max), Some(down)) => down <= max,
                _ => true,
            };
            // Cached (re-read every `schema::REFRESH`); the gate logs a change itself.
            let schema_ok = schema.allows().await;
            let ok = db_ok && broker_ok && lag_ok && schema_ok;
            if shutdown.is_cancelled() {
                break;
            }
            if ok != serving {
                serving = ok;
                if ok {
                    tracing::info!("database and destination reachable: SERVING");
                } else {
                    tracing::warn!(
                        database_ok = db_ok,
                        destination_down_ms = broker_down_for
                            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                        lag_ok,
                        schema_ok,
                        "not ready: NOT_SERVING"
                    );
                }
            }
            let current = schema
                .last()
                .is_some_and(|v| matches!(v.compat, Compat::Known | Compat::Ahead));
            let mut all = statuses(ok, &inbox);
            all.push((SCHEMA.to_string(), current));
            for (service, up) in all {
                if shown.insert(service.clone(), up) != Some(up) {
                    let status = if up {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    self.reporter.set_service_status(service, status).await;
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}

/// The lag comes from the store's stats query (a few index lookups per key with a
/// backlog plus status counts): checked at most every `LAG_CHECK`, not every tick.
const LAG_CHECK: Duration = Duration::from_secs(5);

/// Readiness's view of the backlog's age.
struct LagCheck {
    /// Whether the oldest pending event is within bounds (false while it cannot be
    /// measured: fails safe).
    ok: bool,
    checked: Option<std::time::Instant>,
    /// Why the lag could not be measured, while it cannot: logged once per change.
    unknown: Option<String>,
}

impl Default for LagCheck {
    fn default() -> Self {
        LagCheck {
            ok: true,
            checked: None,
            unknown: None,
        }
    }
}

impl LagCheck {
    /// Measures again when `LAG_CHECK` has passed since the last measurement.
    async fn update(&mut self, store: &dyn Store, max: Duration) {
        if self.checked.is_some_and(|t| t.elapsed() < LAG_CHECK) {
            return;
        }
        self.checked = Some(std::time::Instant::now());
        // Fails safe: a lag that cannot be measured is not a lag within bounds.
        let failure =
            match tokio::time::timeout(LAG_CHECK, store.stats(BoxKind::Outbox, None)).await {
                Ok(Ok(stats)) => {
                    self.ok = stats.oldest_pending_age.is_none_or(|age| age <= max);
                    None
                }
                Ok(Err(e)) => Some(format!("the stats query failed: {e}")),
                Err(_) => Some(format!(
                    "the stats query did not answer within {} s",
                    LAG_CHECK.as_secs()
                )),
            };
        if let Some(why) = &failure {
            self.ok = false;
            if self.unknown.is_none() {
                tracing::warn!(reason = %why, "readiness: the backlog's age cannot be measured; NOT_SERVING until it can");
            }
        } else if self.unknown.is_some() {
            tracing::info!("readiness: the backlog's age can be measured again");
        }
        self.unknown = failure;
    }
}

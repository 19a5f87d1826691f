//! Health: `grpc.health.v1` statuses for the whole server ("") and each service, driven
//! by a background check of the database. SERVING while the database answers,
//! NOT_SERVING while it does not and from the moment shutdown begins.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::store::Store;

/// Services whose status follows the database.
pub const SERVICES: &[&str] = &[
    "",
    "mailroom.v1.OutboxService",
    "mailroom.v1.AdminService",
    "mailroom.v1.InboxService",
];

/// A service name for liveness probes: SERVING from start-up until the process exits,
/// whatever the database does (restarting a process does not bring a database back).
pub const LIVENESS: &str = "liveness";

#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
}

impl Health {
    pub fn new(reporter: HealthReporter) -> Self {
        Health { reporter }
    }

    /// Marks the process alive (`LIVENESS`).
    pub async fn set_live(&self) {
        self.reporter
            .set_service_status(LIVENESS, ServingStatus::Serving)
            .await;
    }

    pub async fn set_all(&self, status: ServingStatus) {
        for s in SERVICES {
            self.reporter.set_service_status(*s, status).await;
        }
    }

    /// Pings the database every `interval` until `shutdown`, flipping the status on each
    /// change. A ping slower than the interval counts as a failure.
    pub async fn monitor(
        self,
        store: Arc<dyn Store>,
        interval: Duration,
        shutdown: CancellationToken,
    ) {
        let mut serving = true;
        loop {
            let ok = matches!(
                tokio::time::timeout(interval.max(Duration::from_millis(500)), store.ping()).await,
                Ok(Ok(()))
            );
            if shutdown.is_cancelled() {
                break;
            }
            if ok != serving {
                serving = ok;
                if ok {
                    tracing::info!("database reachable again: SERVING");
                    self.set_all(ServingStatus::Serving).await;
                } else {
                    tracing::warn!("database unreachable: NOT_SERVING");
                    self.set_all(ServingStatus::NotServing).await;
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }
}

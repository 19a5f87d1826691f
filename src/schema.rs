//! The schema gate (issue 24, item 1): a binary never acts on a schema it does not know.
//! During a rolling upgrade an older replica may find the database migrated by a newer
//! release. When the migrations declare it compatible (`store::schema`), it carries on;
//! otherwise it stops relaying (outbox relays and inbox dispatchers), retention and
//! admin writes, and readiness turns `NOT_SERVING`, until the database or the binary
//! changes. Enqueues and inbox receives go on: see `docs/storage.md`.
//!
//! The hot path (a relay's claim, a health tick) reads a cached verdict, re-read at most
//! every [`REFRESH`]; admin writes and retention rounds, which are rare, read it afresh.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::store::schema::{Compat, SchemaState, decide};
use crate::store::{Store, StoreError};

/// How old a cached verdict may be: an older replica stops relaying at most this long
/// after a newer one applied an incompatible migration.
pub const REFRESH: Duration = Duration::from_secs(2);

/// A binary's verdict on a database's schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The schema the binary knows.
    pub known: i64,
    /// What the database says.
    pub state: SchemaState,
    /// The decision.
    pub compat: Compat,
}

impl Verdict {
    /// The verdict of a binary knowing `known` on `state`.
    pub fn new(known: i64, state: SchemaState) -> Self {
        Verdict {
            known,
            state,
            compat: decide(known, state),
        }
    }

    /// Whether the binary may act on the database.
    pub fn allows(&self) -> bool {
        self.compat != Compat::Incompatible
    }

    /// `Ok` when allowed, else the typed refusal naming both versions.
    pub fn permit(&self) -> Result<(), Error> {
        if self.allows() {
            return Ok(());
        }
        Err(Error::SchemaIncompatible {
            binary: self.known,
            database: self.state.database,
            required: self.state.required,
        })
    }

    /// One line when the verdict changes (never per cycle).
    fn log(&self) {
        let (known, database, required) = (self.known, self.state.database, self.state.required);
        match self.compat {
            Compat::Known => tracing::info!(
                binary_schema = known,
                database_schema = database,
                "database schema known to this binary"
            ),
            Compat::Ahead => tracing::info!(
                binary_schema = known,
                database_schema = database,
                required_schema = required,
                "database schema {database} is newer than this binary's ({known}) and declares it compatible: running"
            ),
            Compat::Incompatible => tracing::error!(
                binary_schema = known,
                database_schema = database,
                required_schema = required,
                "database schema {database} requires a binary that knows schema {required} or later; this binary knows {known}: relaying, retention and admin writes stopped, readiness NOT_SERVING (finish the upgrade, or roll the database back)"
            ),
        }
    }
}

/// The gate every part that changes rows asks. Clones share the cache.
#[derive(Clone)]
pub struct SchemaGate {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    known: i64,
    /// When the database was last asked, and the last verdict read.
    last: Mutex<(Option<Instant>, Option<Verdict>)>,
}

impl SchemaGate {
    /// The gate of a binary over `store`, knowing the store's embedded migrations.
    pub fn new(store: Arc<dyn Store>) -> Self {
        let known = store.known_schema();
        SchemaGate {
            inner: Arc::new(Inner {
                store,
                known,
                last: Mutex::new((None, None)),
            }),
        }
    }

    /// The cached verdict (re-read when older than [`REFRESH`]); while the schema cannot
    /// be read, the last one (none yet: allowed, the database's own errors stop the work).
    pub async fn allows(&self) -> bool {
        let (asked, last) = *self.inner.last.lock().expect("schema gate lock");
        if asked.is_some_and(|t| t.elapsed() < REFRESH) {
            return last.is_none_or(|v| v.allows());
        }
        match self.read().await {
            Ok(v) => v.allows(),
            Err(e) => {
                tracing::debug!(error = %e, "reading the schema version failed");
                self.inner.last.lock().expect("schema gate lock").0 = Some(Instant::now());
                last.is_none_or(|v| v.allows())
            }
        }
    }

    /// Reads the verdict now: for admin writes and retention rounds, which must not act
    /// on a cached "compatible".
    pub async fn permit(&self) -> Result<(), Error> {
        self.read().await?.permit()
    }

    /// Reads the database's schema, caches the verdict and logs it when it changed.
    pub async fn read(&self) -> Result<Verdict, StoreError> {
        let v = Verdict::new(self.inner.known, self.inner.store.schema_state().await?);
        let previous = std::mem::replace(
            &mut *self.inner.last.lock().expect("schema gate lock"),
            (Some(Instant::now()), Some(v)),
        );
        if previous.1.map(|p| p.compat) != Some(v.compat) {
            v.log();
        }
        Ok(v)
    }
}

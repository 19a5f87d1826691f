//! The schema gate (issue 24, item 1): a binary never acts on a schema it does not know.
//! During a rolling upgrade an older replica may find the database migrated by a newer
//! release. When the migrations declare it compatible (`store::schema`), it carries on;
//! otherwise it stops relaying (outbox relays and inbox dispatchers), retention and
//! admin writes, and readiness turns `NOT_SERVING`, until the database or the binary
//! changes. Enqueues and inbox receives go on: see `docs/storage.md`.
//!
//! The database enforces the gate itself (issue 42, item 2): the relay's lease, continued
//! line, renewal and settle statements carry the binary's schema and refuse to act when
//! a migration requires more (`store::postgres::sql::compatible`; on SQLite a check in
//! each relay transaction). This gate is the process's view of the same rule: for
//! readiness, logs and metrics, and as a cheap pre-check before a claim, it keeps a
//! verdict re-read at most every [`REFRESH`]; admin writes and retention rounds, which
//! are rare, read it afresh. It fails closed: while the schema cannot be read, nothing
//! is claimed and readiness is `NOT_SERVING`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::store::schema::{Compat, SchemaState, decide};
use crate::store::{Store, StoreError};

/// How old a cached verdict may be: readiness and the metrics follow a new migration at
/// most this long after it commits (the relay's statements follow it at once).
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
            Compat::Behind => tracing::warn!(
                binary_schema = known,
                database_schema = database,
                "database schema {database} is behind this binary's ({known}): its migrations {} to {known} are not applied; run `mailroom migrate` (statements that need them fail until then)",
                database + 1
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
    /// When the database was last asked, and what it said.
    last: Mutex<(Option<Instant>, Seen)>,
}

/// What the last read of the schema found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Not asked yet.
    Unread,
    /// The read failed: nothing may act (the gate fails closed).
    Unreadable,
    /// The verdict read.
    Read(Verdict),
}

impl Seen {
    fn allows(self) -> bool {
        matches!(self, Seen::Read(v) if v.allows())
    }
}

impl SchemaGate {
    /// The gate of a binary over `store`, knowing the store's embedded migrations.
    pub fn new(store: Arc<dyn Store>) -> Self {
        let known = store.known_schema();
        SchemaGate {
            inner: Arc::new(Inner {
                store,
                known,
                last: Mutex::new((None, Seen::Unread)),
            }),
        }
    }

    /// The cached verdict (re-read when older than [`REFRESH`]): false while the schema
    /// cannot be read (fails closed; a change to unreadable and back is logged once).
    pub async fn allows(&self) -> bool {
        let (asked, last) = *self.inner.last.lock().expect("schema gate lock");
        if asked.is_some_and(|t| t.elapsed() < REFRESH) {
            return last.allows();
        }
        match self.read().await {
            Ok(v) => v.allows(),
            Err(_) => false,
        }
    }

    /// The state last read, for metrics and health (`None`: not read yet, or the read
    /// failed).
    pub fn last(&self) -> Option<Verdict> {
        match self.inner.last.lock().expect("schema gate lock").1 {
            Seen::Read(v) => Some(v),
            Seen::Unread | Seen::Unreadable => None,
        }
    }

    /// Reads the verdict now: for admin writes and retention rounds, which must not act
    /// on a cached "compatible".
    pub async fn permit(&self) -> Result<(), Error> {
        self.read().await?.permit()
    }

    /// Reads the database's schema, caches the verdict (or that it could not be read)
    /// and logs it when it changed.
    pub async fn read(&self) -> Result<Verdict, StoreError> {
        let read = (self.inner.store.schema_state().await)
            .map(|state| Verdict::new(self.inner.known, state));
        let seen = match &read {
            Ok(v) => Seen::Read(*v),
            Err(_) => Seen::Unreadable,
        };
        let (_, previous) = std::mem::replace(
            &mut *self.inner.last.lock().expect("schema gate lock"),
            (Some(Instant::now()), seen),
        );
        match (&read, previous) {
            (Ok(v), Seen::Read(p)) if p.compat == v.compat => {}
            (Ok(v), _) => v.log(),
            (Err(_), Seen::Unreadable) => {}
            (Err(e), _) => tracing::warn!(
                error = %e,
                "the database's schema cannot be read: relaying stopped, readiness NOT_SERVING until it can"
            ),
        }
        read
    }
}

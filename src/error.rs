//! The service's typed errors. Every layer above the store returns these; `api::status`
//! maps them to `tonic::Status` in one place. Store errors become service errors here,
//! once (`From<StoreError>`): the store knows nothing of this module.

use crate::store::StoreError;

/// One offending field of a request, reported as a google.rpc.BadRequest violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    /// The field's path, e.g. `events[3].topic`.
    pub field: String,
    /// What is wrong with it.
    pub description: String,
}

impl FieldViolation {
    /// A violation of `field`.
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        FieldViolation {
            field: field.into(),
            description: description.into(),
        }
    }
}

/// The service's errors; `api::status` maps each to a gRPC status. `Clone`: a group
/// commit's one failure answers every request of the group, each with its own status.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The request is invalid; every offending field is named (`INVALID_ARGUMENT`).
    #[error("invalid argument: {}", .0.iter().map(|v| format!("{}: {}", v.field, v.description)).collect::<Vec<_>>().join("; "))]
    InvalidArgument(Vec<FieldViolation>),
    /// The idempotency key was already used for other content (`ALREADY_EXISTS`).
    #[error("idempotency key {key:?} was already used for different content")]
    AlreadyExists {
        /// The idempotency key.
        key: String,
    },
    /// What the request names does not exist; the message says what (`NOT_FOUND`).
    #[error("not found: {0}")]
    NotFound(String),
    /// The request does not fit the current state, e.g. events not in the state the action
    /// needs (`FAILED_PRECONDITION`).
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// The database's schema requires a binary that knows a newer schema than this one
    /// (`FAILED_PRECONDITION`, reason `SCHEMA_INCOMPATIBLE`): a newer release migrated
    /// it, so this binary does not act on it (`schema`).
    #[error(
        "the database is at schema version {database} and requires a binary that knows schema {required} or later; this binary knows schema {binary}: nothing was changed"
    )]
    SchemaIncompatible {
        /// The highest schema this binary knows.
        binary: i64,
        /// The database's highest applied migration.
        database: i64,
        /// The lowest schema the database accepts.
        required: i64,
    },
    /// The queue in front of the database is full: the caller should back off.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// Storage cannot be reached, or the service is stopping; the message is logged, not
    /// sent (`UNAVAILABLE`).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The database cancelled the request's statement after its statement timeout;
    /// nothing was changed.
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    /// The token is missing or invalid (`UNAUTHENTICATED`).
    #[error("unauthenticated")]
    Unauthenticated,
    /// The caller's token may not do this: it lacks `required_scope` (e.g. an
    /// `admin_read` token asking for an action), or the topic or subscription is outside
    /// its lists.
    #[error("permission denied: {message}")]
    PermissionDenied {
        /// What the caller is told.
        message: String,
        /// The scope the call needs, sent as `required_scope` metadata; `None` for a topic or
        /// subscription outside the token's lists.
        required_scope: Option<&'static str>,
    },
    /// Anything else; the message is logged, never sent (`INTERNAL`).
    #[error("internal error")]
    Internal(String),
}

impl Error {
    /// `InvalidArgument` with one violation.
    pub fn invalid(field: impl Into<String>, description: impl Into<String>) -> Self {
        Error::InvalidArgument(vec![FieldViolation::new(field, description)])
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) | StoreError::Retryable(m) => {
                Error::Unavailable(m.to_string())
            }
            StoreError::TimedOut(m) => Error::DeadlineExceeded(m.to_string()),
            StoreError::Other(m) | StoreError::Refused(m) => Error::Internal(m.to_string()),
            StoreError::Missing { .. } => Error::NotFound(e.to_string()),
            StoreError::WrongState { .. }
            | StoreError::ChangedMeanwhile
            | StoreError::SchemaRefused { .. } => Error::FailedPrecondition(e.to_string()),
        }
    }
}

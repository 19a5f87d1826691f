//! The service's typed errors. Every layer above the store returns these; `api::status`
//! maps them to `tonic::Status` in one place. Store errors become service errors here,
//! once (`From<StoreError>`): the store knows nothing of this module.

use crate::store::StoreError;

/// One offending field of a request, reported as a google.rpc.BadRequest violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    pub field: String,
    pub description: String,
}

impl FieldViolation {
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        FieldViolation {
            field: field.into(),
            description: description.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid argument: {}", .0.iter().map(|v| format!("{}: {}", v.field, v.description)).collect::<Vec<_>>().join("; "))]
    InvalidArgument(Vec<FieldViolation>),
    #[error("idempotency key {key:?} was already used for different content")]
    AlreadyExists { key: String },
    #[error("not found: {0}")]
    NotFound(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// The queue in front of the database is full: the caller should back off.
    #[error("overloaded: {0}")]
    Overloaded(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The database cancelled the request's statement after its statement timeout;
    /// nothing was changed.
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    #[error("unauthenticated")]
    Unauthenticated,
    /// The caller's token may not do this: it lacks `required_scope` (e.g. an
    /// `admin_read` token asking for an action), or the topic or subscription is outside
    /// its lists.
    #[error("permission denied: {message}")]
    PermissionDenied {
        message: String,
        required_scope: Option<&'static str>,
    },
    #[error("internal error")]
    Internal(String),
}

impl Error {
    pub fn invalid(field: impl Into<String>, description: impl Into<String>) -> Self {
        Error::InvalidArgument(vec![FieldViolation::new(field, description)])
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) | StoreError::Retryable(m) => Error::Unavailable(m),
            StoreError::TimedOut(m) => Error::DeadlineExceeded(m),
            StoreError::Other(m) | StoreError::Refused(m) => Error::Internal(m),
            StoreError::Missing { .. } => Error::NotFound(e.to_string()),
            StoreError::WrongState { .. } | StoreError::ChangedMeanwhile => {
                Error::FailedPrecondition(e.to_string())
            }
        }
    }
}

//! The one place where service errors become gRPC statuses. Internal details are logged
//! here and never sent to clients.
//!
//! Every status a caller may branch on carries the standard details of
//! `google/rpc/error_details.proto`: a `google.rpc.ErrorInfo` with a stable `reason`
//! (UPPER_SNAKE_CASE, listed in [`reason`]) and the domain [`DOMAIN`], and, on
//! `RESOURCE_EXHAUSTED` and `UNAVAILABLE`, a `google.rpc.RetryInfo` saying how long to
//! wait before retrying. `INVALID_ARGUMENT` also carries `google.rpc.BadRequest`.

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

use crate::error::Error;

/// `ErrorInfo.domain` of mailroom's errors.
pub const DOMAIN: &str = "mailroom.v1";

/// The stable `ErrorInfo.reason` values. Renaming one is a breaking API change.
pub mod reason {
    /// A request field is invalid (see the `BadRequest` detail).
    pub const INVALID_ARGUMENT: &str = "INVALID_ARGUMENT";
    /// The idempotency key was already used for different content.
    pub const IDEMPOTENCY_KEY_REUSED: &str = "IDEMPOTENCY_KEY_REUSED";
    /// What the request names does not exist.
    pub const NOT_FOUND: &str = "NOT_FOUND";
    /// The request does not fit the current state (e.g. events not in the state the
    /// action needs).
    pub const FAILED_PRECONDITION: &str = "FAILED_PRECONDITION";
    /// The database was migrated by a newer release whose schema this binary does not
    /// support; the metadata names `binary_schema`, `database_schema` and
    /// `required_schema`. Another replica (of the newer release) can serve the call.
    pub const SCHEMA_INCOMPATIBLE: &str = "SCHEMA_INCOMPATIBLE";
    /// The intake queue in front of the database is full.
    pub const INTAKE_FULL: &str = "INTAKE_FULL";
    /// Too many requests in flight in the server (`MAILROOM_MAX_CONCURRENT_RPCS`).
    pub const SERVER_BUSY: &str = "SERVER_BUSY";
    /// The request took longer than the server's request timeout.
    pub const SERVER_TIMEOUT: &str = "SERVER_TIMEOUT";
    /// A request is over its method's size limit.
    pub const REQUEST_TOO_LARGE: &str = "REQUEST_TOO_LARGE";
    /// The database could not be reached; nothing was stored.
    pub const STORAGE_UNAVAILABLE: &str = "STORAGE_UNAVAILABLE";
    /// The database cancelled the statement after the statement timeout of its query
    /// class; nothing was changed.
    pub const STATEMENT_TIMEOUT: &str = "STATEMENT_TIMEOUT";
    /// The token is missing or invalid.
    pub const UNAUTHENTICATED: &str = "UNAUTHENTICATED";
    /// The token is valid but may not make this call: a scope it lacks (named in the
    /// `required_scope` metadata, e.g. `admin` for an `admin_read` token's requeue), or a
    /// topic or subscription outside its lists.
    pub const PERMISSION_DENIED: &str = "PERMISSION_DENIED";
    /// An unexpected server error; details are in the server's log only.
    pub const INTERNAL: &str = "INTERNAL";
}

/// Suggested wait before retrying an overloaded server.
pub const RETRY_OVERLOADED: Duration = Duration::from_millis(200);
/// Suggested wait before retrying while storage is unavailable.
pub const RETRY_UNAVAILABLE: Duration = Duration::from_secs(1);

/// A status with an `ErrorInfo` (and `RetryInfo` when `retry` is given).
pub fn status(
    code: Code,
    message: impl Into<String>,
    reason: &str,
    metadata: HashMap<String, String>,
    retry: Option<Duration>,
) -> Status {
    let mut d = ErrorDetails::new();
    d.set_error_info(reason, DOMAIN, metadata);
    if let Some(r) = retry {
        d.set_retry_info(Some(r));
    }
    let mut s = Status::with_error_details(code, message, d);
    // gRPC's built-in retries (gRFC A6) read the server's pushback from this trailer and
    // wait exactly that long: the `RetryInfo` delay with equal jitter (between one and
    // one and a half times it), so that callers refused together do not come back
    // together; or a negative value where retrying the same request cannot help (a
    // `RESOURCE_EXHAUSTED` without a delay: the request is too large). The service
    // config in `docs/grpc-service-config.json` retries on these codes.
    let pushback: Option<tonic::metadata::MetadataValue<_>> = match (retry, code) {
        (Some(r), _) => {
            let ms = u64::try_from(r.as_millis()).unwrap_or(u64::MAX);
            let jitter = rand::random_range(0..=ms / 2);
            Some(ms.saturating_add(jitter).into())
        }
        (None, Code::ResourceExhausted) => Some((-1i64).into()),
        (None, _) => None,
    };
    if let Some(v) = pushback {
        s.metadata_mut().insert(PUSHBACK, v);
    }
    s
}

/// The trailer of gRFC A6 that tells a client's built-in retries how long to wait
/// (milliseconds), or, negative, not to retry.
pub const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// `RESOURCE_EXHAUSTED` for a request over its size limit (no `RetryInfo`: retrying the
/// same request cannot succeed).
pub fn too_large(message: String, limit: usize) -> Status {
    status(
        Code::ResourceExhausted,
        message,
        reason::REQUEST_TOO_LARGE,
        HashMap::from([("limit_bytes".to_string(), limit.to_string())]),
        None,
    )
}

/// Longest message a status carries: it travels in the `grpc-message` header, and a
/// header past the peer's limit (often 8 KiB) turns the answer into a protocol error.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// `m` cut to `MAX_MESSAGE_BYTES` at a character boundary, marked with "…".
pub fn short(m: String) -> String {
    if m.len() <= MAX_MESSAGE_BYTES {
        return m;
    }
    let mut end = MAX_MESSAGE_BYTES - 3;
    while !m.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &m[..end])
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let status = status_of(e);
        if status.message().len() > MAX_MESSAGE_BYTES {
            let mut s = Status::with_details(
                status.code(),
                short(status.message().to_string()),
                status.details().to_vec().into(),
            );
            *s.metadata_mut() = status.metadata().clone();
            s
        } else {
            status
        }
    }
}

fn status_of(e: Error) -> Status {
    let none = HashMap::new;
    match e {
        Error::InvalidArgument(v) => invalid_argument(v),
        Error::AlreadyExists { key } => already_exists(key),
        Error::NotFound(m) => status(Code::NotFound, m, reason::NOT_FOUND, none(), None),
        Error::FailedPrecondition(m) => status(
            Code::FailedPrecondition,
            m,
            reason::FAILED_PRECONDITION,
            none(),
            None,
        ),
        Error::SchemaIncompatible {
            binary,
            database,
            required,
        } => schema_incompatible(binary, database, required),
        Error::Overloaded(m) => status(
            Code::ResourceExhausted,
            m,
            reason::INTAKE_FULL,
            none(),
            Some(RETRY_OVERLOADED),
        ),
        Error::Unavailable(m) => {
            tracing::warn!(error = %m, "answering UNAVAILABLE");
            status(
                Code::Unavailable,
                "storage unavailable; retry later",
                reason::STORAGE_UNAVAILABLE,
                none(),
                Some(RETRY_UNAVAILABLE),
            )
        }
        Error::DeadlineExceeded(m) => {
            tracing::warn!(error = %m, "answering DEADLINE_EXCEEDED");
            // Often another transaction holding the event's key (an SQL API caller's
            // open transaction: commit order makes the enqueue wait for it).
            status(
                Code::DeadlineExceeded,
                "the database cancelled the query after its statement timeout; nothing \
                     was changed and the request may be retried (a transaction that holds \
                     the key, such as an open SQL API transaction, delays it until it ends)",
                reason::STATEMENT_TIMEOUT,
                none(),
                Some(RETRY_UNAVAILABLE),
            )
        }
        Error::Unauthenticated => status(
            Code::Unauthenticated,
            "missing or invalid token",
            reason::UNAUTHENTICATED,
            none(),
            None,
        ),
        Error::PermissionDenied {
            message,
            required_scope,
        } => status(
            Code::PermissionDenied,
            message,
            reason::PERMISSION_DENIED,
            required_scope
                .map(|s| HashMap::from([("required_scope".to_string(), s.to_string())]))
                .unwrap_or_default(),
            None,
        ),
        Error::Internal(m) => {
            tracing::error!(error = %m, "internal error");
            status(
                Code::Internal,
                "internal error",
                reason::INTERNAL,
                none(),
                None,
            )
        }
    }
}

/// `INVALID_ARGUMENT` with a `BadRequest` naming every offending field.
fn invalid_argument(v: Vec<crate::error::FieldViolation>) -> Status {
    let message = v
        .iter()
        .map(|f| format!("{}: {}", f.field, f.description))
        .collect::<Vec<_>>()
        .join("; ");
    let mut details = ErrorDetails::with_bad_request(
        v.into_iter()
            .map(|f| FieldViolation::new(f.field, f.description))
            .collect::<Vec<_>>(),
    );
    details.set_error_info(reason::INVALID_ARGUMENT, DOMAIN, HashMap::new());
    Status::with_error_details(Code::InvalidArgument, message, details)
}

/// `ALREADY_EXISTS` for an idempotency key taken by other content, naming the key.
fn already_exists(key: String) -> Status {
    let message = Error::AlreadyExists { key: key.clone() }.to_string();
    let metadata = HashMap::from([("idempotency_key".to_string(), key)]);
    status(
        Code::AlreadyExists,
        message,
        reason::IDEMPOTENCY_KEY_REUSED,
        metadata,
        None,
    )
}

/// `FAILED_PRECONDITION` naming the binary's and the database's schema versions.
fn schema_incompatible(binary: i64, database: i64, required: i64) -> Status {
    let message = e_schema(binary, database, required);
    let metadata = HashMap::from([
        ("binary_schema".to_string(), binary.to_string()),
        ("database_schema".to_string(), database.to_string()),
        ("required_schema".to_string(), required.to_string()),
    ]);
    status(
        Code::FailedPrecondition,
        message,
        reason::SCHEMA_INCOMPATIBLE,
        metadata,
        None,
    )
}

/// The message of `Error::SchemaIncompatible`, which names both versions.
fn e_schema(binary: i64, database: i64, required: i64) -> String {
    Error::SchemaIncompatible {
        binary,
        database,
        required,
    }
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FieldViolation as Violation;

    fn info(s: &Status) -> (String, String) {
        let i = s.get_details_error_info().expect("ErrorInfo");
        (i.reason.clone(), i.domain.clone())
    }

    /// Each error with its code, reason and retry delay.
    fn cases() -> Vec<(Error, Code, &'static str, Option<Duration>)> {
        vec![
            (
                Error::InvalidArgument(vec![Violation::new("event.topic", "bad")]),
                Code::InvalidArgument,
                reason::INVALID_ARGUMENT,
                None,
            ),
            (
                Error::AlreadyExists { key: "k".into() },
                Code::AlreadyExists,
                reason::IDEMPOTENCY_KEY_REUSED,
                None,
            ),
            (
                Error::NotFound("x".into()),
                Code::NotFound,
                reason::NOT_FOUND,
                None,
            ),
            (
                Error::SchemaIncompatible {
                    binary: 14,
                    database: 15,
                    required: 15,
                },
                Code::FailedPrecondition,
                reason::SCHEMA_INCOMPATIBLE,
                None,
            ),
            (
                Error::Overloaded("full".into()),
                Code::ResourceExhausted,
                reason::INTAKE_FULL,
                Some(RETRY_OVERLOADED),
            ),
            (
                Error::Unavailable("db down".into()),
                Code::Unavailable,
                reason::STORAGE_UNAVAILABLE,
                Some(RETRY_UNAVAILABLE),
            ),
            (
                Error::DeadlineExceeded("57014".into()),
                Code::DeadlineExceeded,
                reason::STATEMENT_TIMEOUT,
                Some(RETRY_UNAVAILABLE),
            ),
            (
                Error::Unauthenticated,
                Code::Unauthenticated,
                reason::UNAUTHENTICATED,
                None,
            ),
            (
                Error::PermissionDenied {
                    message: "read-only".into(),
                    required_scope: Some("admin"),
                },
                Code::PermissionDenied,
                reason::PERMISSION_DENIED,
                None,
            ),
            (
                Error::Internal("boom".into()),
                Code::Internal,
                reason::INTERNAL,
                None,
            ),
        ]
    }

    #[test]
    fn every_error_has_a_reason_and_retryable_ones_a_delay() {
        for (e, code, want, retry) in cases() {
            let s = Status::from(e);
            assert_eq!(s.code(), code);
            assert_eq!(info(&s), (want.to_string(), DOMAIN.to_string()));
            assert_eq!(crate::pb::time::retry_delay(&s), retry, "{code:?}");
        }
    }

    #[test]
    fn details_name_the_field_the_scope_and_the_key() {
        let s = Status::from(Error::invalid("f", "d"));
        assert_eq!(
            s.get_details_bad_request().unwrap().field_violations.len(),
            1
        );
        let s = Status::from(Error::PermissionDenied {
            message: "read-only".into(),
            required_scope: Some("admin"),
        });
        assert_eq!(
            s.get_details_error_info().unwrap().metadata["required_scope"],
            "admin"
        );
        let s = Status::from(Error::AlreadyExists { key: "k1".into() });
        assert_eq!(
            s.get_details_error_info().unwrap().metadata["idempotency_key"],
            "k1"
        );
    }
}

//! The one place where service errors become gRPC statuses. Internal details are logged
//! here and never sent to clients.

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

use crate::error::Error;

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
    {
        match e {
            Error::InvalidArgument(v) => {
                let message = v
                    .iter()
                    .map(|f| format!("{}: {}", f.field, f.description))
                    .collect::<Vec<_>>()
                    .join("; ");
                let details = ErrorDetails::with_bad_request(
                    v.into_iter()
                        .map(|f| FieldViolation::new(f.field, f.description))
                        .collect::<Vec<_>>(),
                );
                Status::with_error_details(Code::InvalidArgument, message, details)
            }
            e @ Error::AlreadyExists { .. } => Status::already_exists(e.to_string()),
            Error::NotFound(m) => Status::not_found(m),
            Error::FailedPrecondition(m) => Status::failed_precondition(m),
            Error::Overloaded(m) => Status::resource_exhausted(m),
            Error::Unavailable(m) => {
                tracing::warn!(error = %m, "answering UNAVAILABLE");
                Status::unavailable("storage unavailable; retry later")
            }
            Error::Unauthenticated => Status::unauthenticated("missing or invalid token"),
            Error::Internal(m) => {
                tracing::error!(error = %m, "internal error");
                Status::internal("internal error")
            }
        }
    }
}

//! The one place where service errors become gRPC statuses. Internal details are logged
//! here and never sent to clients.

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, FieldViolation, StatusExt};

use crate::error::Error;

impl From<Error> for Status {
    fn from(e: Error) -> Self {
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

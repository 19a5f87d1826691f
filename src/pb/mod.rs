//! The wire types of `mailroom.v1`: the generated protobuf/gRPC code, kept in one
//! allow-listed module, and the conversions between protobuf's well-known types and
//! Rust's (`time`), shared by the services, the CLI and the inbox's handler client.

pub mod time;

#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::unwrap_used,
    missing_docs,
    rust_2018_idioms
)]
mod generated {
    tonic::include_proto!("mailroom.v1");

    /// Encoded descriptors, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("mailroom_descriptor");
}

pub use generated::*;

/// The gRPC name of a status code (`OK`, `UNAVAILABLE`), as gRPC's own tools and
/// OpenTelemetry's `rpc.grpc.status_code` spell it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

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

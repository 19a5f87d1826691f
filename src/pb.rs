//! Generated protobuf and gRPC code for `mailroom.v1`, kept in one allow-listed module.
#![allow(clippy::all, clippy::pedantic, missing_docs, rust_2018_idioms)]

tonic::include_proto!("mailroom.v1");

/// Encoded descriptors, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("mailroom_descriptor");

//! The gRPC surface: services convert and validate, call the middle, and map errors in
//! `status`. `app::App::start` assembles them with health, reflection and the layers of
//! `layers` (RPC log, token check, overload, byte admission).

pub mod admin;
pub mod connections;
pub mod convert;
pub mod costs;
pub mod inbox;
pub mod layers;
pub mod outbox;
pub mod status;

/// A generated service that accepts gzip, deflate and zstd requests (what grpcio,
/// grpc-java and grpc-go send with compression on) and answers gzip to a client that
/// accepts it.
/// tonic answers `UNIMPLEMENTED` to a compressed request a service was not told to
/// accept.
macro_rules! compressed {
    ($service:expr) => {
        $service
            .accept_compressed(tonic::codec::CompressionEncoding::Gzip)
            .accept_compressed(tonic::codec::CompressionEncoding::Deflate)
            .accept_compressed(tonic::codec::CompressionEncoding::Zstd)
            .send_compressed(tonic::codec::CompressionEncoding::Gzip)
    };
}
pub(crate) use compressed;

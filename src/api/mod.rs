//! The gRPC surface: services convert and validate, call the middle, and map errors in
//! `status`. `serve` assembles them with health, reflection and per-RPC logging.

pub mod admin;
pub mod auth;
pub mod convert;
pub mod inbox;
pub mod layers;
pub mod outbox;
pub mod status;

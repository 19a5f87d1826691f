//! The gRPC surface: services convert and validate, call the middle, and map errors in
//! `status`. `app::App::start` assembles them with health, reflection and the layers of
//! `layers` (RPC log, token check, overload, byte admission).

pub mod admin;
pub mod convert;
pub mod inbox;
pub mod layers;
pub mod outbox;
pub mod status;

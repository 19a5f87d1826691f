//! mailroom: a transactional outbox/inbox service. Producers `Enqueue` events over gRPC;
//! mailroom commits them before it answers, then relays publish them to Kafka in order
//! per key, with retries, equal-jitter backoff and bounded attempts.
//!
//! # Layout
//! - `cli`     — `mailroom admin …`: the operator's gRPC client.
//! - `config`  — typed settings: flags > `MAILROOM_*` env > TOML file > defaults.
//! - `app`     — wires store, intake, sink, relays, health and the gRPC server; owns shutdown.
//! - `admin`   — the operator service: runs the store's admin half, wakes requeued keys,
//!   page tokens.
//! - `api`     — gRPC services: pb conversion and validation in, domain call, `Status` out.
//! - `pb`      — generated protobuf/gRPC code.
//! - `domain`  — events, statuses, boxes, enqueue outcomes, topic rules and request
//!   limits; `domain::admin` the operator's queries and outcomes.
//! - `error`   — the service's typed errors (mapped to `tonic::Status` in `api::status`);
//!   store errors become these once, here.
//! - `intake`  — group commit: concurrent `Enqueue`s share one transaction.
//! - `store`   — the `Store` trait and its engines, one folder each (`store/postgres/`,
//!   `store/sqlite/`); all SQL lives here, including LISTEN/NOTIFY wake-ups between
//!   processes (`store::postgres::notify`). Typed `StoreError`s; the admin flows once
//!   (`store/admin_flow.rs`) over each engine's statements.
//! - `relay`   — the engine both boxes share: claim, per-key ordering, backoff, settle.
//! - `inbox`   — subscriptions: Kafka intake with dedup, dispatch to `HandlerService`.
//! - `sink`    — destinations: Kafka (rdkafka), the local JSON-lines sink, fault injection.
//! - `health`  — `grpc.health.v1` readiness (database, broker, lag) and liveness.
//! - `metrics` — Prometheus metrics on their own HTTP port.
//! - `telemetry` — logs, optional OTLP trace export, joining producers' traces.
//! - `retention` — batched deletion of completed (and expired failed) events, idle keys.

#![warn(clippy::cast_possible_truncation)]

pub mod admin;
pub mod api;
pub mod app;
pub mod cli;
pub mod config;
pub mod console;
pub mod domain;
pub mod error;
pub mod health;
pub mod inbox;
pub mod intake;
pub mod metrics;
pub mod pb;
pub mod relay;
pub mod retention;
pub mod secret;
pub mod sink;
pub mod store;
pub mod telemetry;
pub mod tls;

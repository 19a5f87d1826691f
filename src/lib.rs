//! mailroom: a transactional outbox/inbox service. Producers `Enqueue` events over gRPC;
//! mailroom commits them before it answers, then relays publish them to Kafka in order
//! per key, with retries, equal-jitter backoff and bounded attempts.
//!
//! # Layout
//! Layers, bottom up (`scripts/module-graph.py`, run by `scripts/test.sh`, reads this
//! list and fails when a module imports one that imports it back, or one from a higher
//! line than its own; modules on one line are one layer; `docs/architecture.md` shows
//! the graph):
//! - `backoff` — capped exponential backoff with equal jitter, the one every retry uses.
//! - `domain`  — events, statuses, boxes, enqueue outcomes, topic rules and request
//!   limits; `domain::admin` the operator's queries and outcomes, `domain::jobs` the
//!   background jobs'; `domain::headers`
//!   Kafka record headers as bytes beside their text view.
//! - `pb`      — generated protobuf/gRPC code, and `pb::time` (Timestamp, Duration,
//!   RetryInfo as Rust times).
//! - `secret`, `tls`, `web` — secrets `Debug` never shows; TLS settings as files, and the
//!   tonic client and server configurations built from them; the console's and the
//!   metrics' HTTP servers (header-read timeout, connection cap).
//! - `store`   — the `Store` trait and its engines, one folder each (`store/postgres/`,
//!   `store/sqlite/`); all SQL lives here, including LISTEN/NOTIFY wake-ups
//!   (`store::postgres::notify`). Typed `StoreError`s; the admin flows are written once
//!   (`store/admin_flow.rs`) over each engine's statements.
//! - `error`   — the service's typed errors; store errors become these once, here.
//! - `access`  — the access model: token files, scopes, principals; what each RPC needs.
//! - `schema`  — the schema gate: a binary never acts on a schema it does not know.
//! - `telemetry` — logs (it owns `LogFormat`), OTLP trace export, joining callers' traces.
//! - `sink`    — destinations (it owns `SinkConfig`): Kafka (each partition a fault
//!   domain, `sink::kafka::partitions`), local JSON lines, faults.
//! - `relay`   — the engine both boxes share: claim, per-key ordering, backoff, settle;
//!   its counters and latency histograms (`relay::stats`).
//! - `intake`  — the outbox's middle layer: group commit of concurrent `Enqueue`s.
//! - `inbox`   — the inbox (it owns `SubscriptionConfig`): Kafka intake with dedup
//!   (records copied out as bytes by `inbox::record`, the one `unsafe` module), dispatch
//!   to `HandlerService`, each subscription's tasks restarted by `inbox::supervisor`, and
//!   `inbox::Inbox`, the middle layer of `Receive`.
//! - `admin`   — the operator's middle layer: runs the store's admin half, wakes requeued
//!   keys, page tokens.
//! - `metrics`, `health`, `retention`, `dead_letter`, `rates`, `jobs` — Prometheus on
//!   its own port; `grpc.health.v1`; batched deletion of completed (and expired failed)
//!   events and idle keys; copies of failed events to dead-letter topics; deliveries per
//!   minute kept in the database for the console; the runner of background jobs.
//! - `api`     — gRPC services: pb conversion and validation in, a middle-layer call,
//!   `Status` out (`api::status`, the one place); `api::layers` (RPC log, token check,
//!   overload) in front of them.
//! - `console` — the operator's web console, over `admin`.
//! - `cli`     — `mailroom admin …`: the operator's gRPC client.
//! - `config`  — typed settings (flags > `MAILROOM_*` env > TOML file > defaults),
//!   assembled from each subsystem's own types; nothing imports it but `app`.
//! - `app`     — wires everything; owns the one cancellation token that drives shutdown.

#![warn(clippy::cast_possible_truncation)]

pub mod access;
pub mod admin;
pub mod api;
pub mod app;
pub mod backoff;
pub mod cli;
pub mod config;
pub mod console;
pub mod dead_letter;
pub mod domain;
pub mod error;
pub mod health;
pub mod inbox;
pub mod intake;
pub mod jobs;
pub mod metrics;
pub mod pb;
pub mod rates;
pub mod relay;
pub mod retention;
pub mod schema;
pub mod secret;
pub mod sink;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod web;

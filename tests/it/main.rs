//! mailroom's integration tests, one binary: each module is one capability, driven
//! through the real wire against real PostgreSQL databases and real tansu brokers
//! (`scripts/test.sh` starts them); `support` is the harness they share. Missing
//! infrastructure fails a test, it never skips it.

// A panic is how a test fails.
#![allow(clippy::unwrap_used)]

mod broker_refusal;
mod support;

mod access;
mod admin;
mod admin_inbox;
mod alerts;
mod byte_budgets;
mod connections;
mod console;
mod continued_lines;
mod conventions;
mod dead_letter;
mod deploy;
mod enqueue;
mod faults;
mod foreign_records;
mod handler_failures;
mod hostile;
mod inbox;
mod inbox_identity;
mod inbox_retention;
mod jobs;
mod metrics;
mod migrations;
mod otlp;
mod overload;
mod partitions;
mod pause;
mod polyglot;
mod relay;
mod relay_under_load;
mod republish;
mod retention;
mod rewind;
mod schema_compat;
mod security;
mod shared_database;
mod sql_api;
mod store;
mod tls;
mod topic_limits;

//! What each RPC's request may cost before it is decoded (issue 43, item 1): the rules
//! `layers::ByteAdmissionLayer` applies, per method. A message's bytes are bounded by
//! its method's limit; its repeated fields are counted element by element from the wire
//! (`EnqueueBatch.events` at most `max_batch`, the admin RPCs' `ids` at most what their
//! handlers accept), each element charged what prost builds for it beyond its bytes.
//!
//! The sizes are estimates on the high side: a `Vec` or a map that grew by doubling
//! (twice the element), and the smallest allocation of each string an element holds.

use std::mem::size_of;

use super::layers::walk::{Counted, Field, Kind, Shape};
use super::layers::{DEFAULT_LIMIT, Rule, Rules};
use crate::domain::admin::{MAX_CANCEL, MAX_REQUEUE};
use crate::pb;

/// The smallest heap allocation, which a string of one byte takes.
const ALLOCATION: u64 = 32;
/// One `Event` in a batch's `Vec`, with its five strings.
const EVENT: u64 = 2 * size_of::<pb::Event>() as u64 + 5 * ALLOCATION;
/// One entry of a `headers` map, with its two strings.
const HEADER: u64 = 2 * (size_of::<(String, String)>() as u64 + 1) + 2 * ALLOCATION;
/// One id of a `repeated int64`.
const ID: u64 = 2 * size_of::<i64>() as u64;

const HEADERS: Kind = Kind::Message {
    each: HEADER,
    inner: None,
};
/// `Event`: its `headers` (field 4).
const EVENT_SHAPE: Shape = Shape {
    fields: &[Field {
        number: 4,
        kind: HEADERS,
    }],
};
/// `EnqueueRequest` and `EnqueueBatchRequest`: their event(s), field 1.
const EVENTS: Shape = Shape {
    fields: &[Field {
        number: 1,
        kind: Kind::Message {
            each: EVENT,
            inner: Some(&EVENT_SHAPE),
        },
    }],
};
/// `ReceiveRequest`: its `headers` (field 6).
const RECEIVE: Shape = Shape {
    fields: &[Field {
        number: 6,
        kind: HEADERS,
    }],
};
/// `RequeueFailedRequest` and `CancelEventsRequest`: their `ids` (field 2).
const IDS: Shape = Shape {
    fields: &[Field {
        number: 2,
        kind: Kind::Varints { each: ID },
    }],
};

fn path(service: &str, method: &str) -> String {
    format!("/{service}/{method}")
}

/// The rules of mailroom's methods: `single` is the limit of a one-event request
/// (`Enqueue`, `Receive`), `batch` and `max_batch` those of an `EnqueueBatch`.
pub fn rules(single: usize, batch: usize, max_batch: usize) -> Rules {
    let outbox = pb::outbox_service_server::SERVICE_NAME;
    let admin = pb::admin_service_server::SERVICE_NAME;
    let ids = |max, rule| Rule {
        shape: &IDS,
        counted: Some(Counted {
            number: 2,
            name: "ids",
            max,
            rule,
        }),
        ..Rule::opaque(DEFAULT_LIMIT, "admin request (4 MiB)")
    };
    let reflection = |service| {
        (
            path(service, "ServerReflectionInfo"),
            Rule {
                streaming: true,
                ..Rule::opaque(DEFAULT_LIMIT, "reflection request (4 MiB)")
            },
        )
    };
    let (v1, v1alpha) = (
        reflection("grpc.reflection.v1.ServerReflection"),
        reflection("grpc.reflection.v1alpha.ServerReflection"),
    );
    Rules::new(Rule::opaque(DEFAULT_LIMIT, "request (4 MiB)"))
        .with(
            &path(outbox, "Enqueue"),
            Rule {
                shape: &EVENTS,
                ..Rule::opaque(single, SINGLE)
            },
        )
        .with(
            &path(outbox, "EnqueueBatch"),
            Rule {
                shape: &EVENTS,
                counted: Some(Counted {
                    number: 1,
                    name: "events",
                    max: max_batch,
                    rule: "MAILROOM_MAX_BATCH",
                }),
                ..Rule::opaque(
                    batch,
                    "EnqueueBatch request; the limit is MAILROOM_MAX_BATCH_BYTES",
                )
            },
        )
        .with(
            &path(pb::inbox_service_server::SERVICE_NAME, "Receive"),
            Rule {
                shape: &RECEIVE,
                ..Rule::opaque(
                    single,
                    "Receive request (one message); the limit follows \
                     MAILROOM_MAX_PAYLOAD_BYTES and MAILROOM_MAX_HEADER_BYTES",
                )
            },
        )
        .with(
            &path(admin, "RequeueFailed"),
            ids(MAX_REQUEUE as usize, "the largest requeue"),
        )
        .with(
            &path(admin, "CancelEvents"),
            ids(MAX_CANCEL, "the largest cancel"),
        )
        .with(&v1.0, v1.1)
        .with(&v1alpha.0, v1alpha.1)
}

const SINGLE: &str = "Enqueue request (one event); the limit follows MAILROOM_MAX_PAYLOAD_BYTES \
                      and MAILROOM_MAX_HEADER_BYTES";

//! Scenario 7 of the fault suite: hostile input. Property-based tests (proptest) of
//! request validation and conversion, then bounded property runs against a running
//! service (SQLite for the property runs, PostgreSQL for NUL characters): arbitrary
//! topics, keys, headers, payload sizes, timestamps, page tokens and filters never
//! panic, never store a partial batch, and always answer a defined status; malformed
//! page tokens and filters are INVALID_ARGUMENT naming the field.
//!
//! Cases: 256 per pure property, 64 per gRPC run; `MAILROOM_SOAK` multiplies both.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use crate::support::faults::soak;
use crate::support::*;
use base64::Engine as _;
use mailroom::api::convert::{enqueue_batch_request, new_event};
use mailroom::domain::BoxKind;
use mailroom::domain::{Limits, check_topic};
use mailroom::error::Error;
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::pb::time::timestamp;
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestCaseError, TestRunner};
use tonic::Code;
use tonic_types::StatusExt;

/// Small limits, so that arbitrary input crosses them often.
fn limits() -> Limits {
    Limits {
        max_payload_bytes: 64,
        max_headers: 4,
        max_header_bytes: 64,
        max_key_bytes: 16,
        max_batch: 8,
        max_attempts_cap: 100,
        default_max_attempts: 6,
    }
}

fn cases(n: u32) -> PropConfig {
    PropConfig {
        cases: n * soak(),
        failure_persistence: None,
        ..PropConfig::default()
    }
}

/// Text that is often hostile: anything printable, control and NUL characters, very
/// long runs, or well-formed values.
fn text(max: usize) -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-zA-Z0-9._-]{0,12}".prop_map(|s| s),
        2 => proptest::collection::vec(any::<char>(), 0..max.min(24)).prop_map(|v| v.into_iter().collect()),
        1 => "[\\x00-\\x1f]{1,4}",
        1 => (0usize..max + 4).prop_map(|n| "x".repeat(n)),
        1 => Just(String::new()),
    ]
}

fn topic() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-zA-Z0-9._-]{1,20}",
        1 => Just(".".to_string()),
        1 => Just("..".to_string()),
        1 => (247usize..252).prop_map(|n| "t".repeat(n)),
        2 => text(30),
    ]
}

fn ts() -> impl Strategy<Value = prost_types::Timestamp> {
    let seconds = prop_oneof![
        any::<i64>(),
        -62_135_596_801i64..=-62_135_596_799,
        253_402_300_798i64..=253_402_300_800,
        0i64..4_000_000_000,
    ];
    let nanos = prop_oneof![
        any::<i32>(),
        0i32..1_000_000_000,
        -2i32..2,
        999_999_998i32..1_000_000_002
    ];
    (seconds, nanos).prop_map(|(seconds, nanos)| prost_types::Timestamp { seconds, nanos })
}

fn pb_event() -> impl Strategy<Value = pb::Event> {
    let headers = proptest::collection::hash_map(
        prop_oneof![4 => "[a-z]{1,6}", 1 => Just(String::new()), 1 => "ce_[a-z]{0,3}", 1 => text(8)],
        text(40),
        0..6,
    );
    (
        topic(),
        text(20),
        proptest::collection::vec(any::<u8>(), 0..80),
        headers,
        prop_oneof![4 => text(10), 1 => (255usize..259).prop_map(|n| "y".repeat(n))],
        prop_oneof![
            3 => Just(String::new()),
            3 => "[a-c]",
            1 => (255usize..259).prop_map(|n| "i".repeat(n)),
            1 => text(10)
        ],
        proptest::option::of(ts()),
        prop_oneof![0u32..5, 99u32..102, any::<u32>()],
    )
        .prop_map(|e| pb::Event {
            topic: e.0,
            key: e.1,
            payload: e.2,
            headers: e.3,
            r#type: e.4,
            idempotency_key: e.5,
            deliver_after: e.6,
            max_attempts: e.7,
        })
}

/// The rules, stated independently of the implementation: the fields an event violates.
fn violated(e: &pb::Event, l: &Limits) -> BTreeSet<&'static str> {
    let mut v = BTreeSet::new();
    let topic_ok = !e.topic.is_empty()
        && e.topic.len() <= 249
        && e.topic != "."
        && e.topic != ".."
        && e.topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    if !topic_ok {
        v.insert("topic");
    }
    let nul = |s: &str| s.contains('\0');
    if e.key.len() > l.max_key_bytes || nul(&e.key) {
        v.insert("key");
    }
    if e.payload.len() > l.max_payload_bytes {
        v.insert("payload");
    }
    let header_bytes: usize = e.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    if e.headers.len() > l.max_headers
        || header_bytes > l.max_header_bytes
        || e.headers
            .keys()
            .any(|k| k.is_empty() || k.starts_with("ce_"))
        || e.headers.iter().any(|(k, v)| nul(k) || nul(v))
    {
        v.insert("headers");
    }
    if e.r#type.len() > 256 || nul(&e.r#type) {
        v.insert("type");
    }
    if e.idempotency_key.len() > 256 || nul(&e.idempotency_key) {
        v.insert("idempotency_key");
    }
    if e.max_attempts > l.max_attempts_cap {
        v.insert("max_attempts");
    }
    if let Some(t) = &e.deliver_after
        && !valid_ts(t)
    {
        v.insert("deliver_after");
    }
    v
}

fn valid_ts(t: &prost_types::Timestamp) -> bool {
    (0..1_000_000_000).contains(&t.nanos)
        && (-62_135_596_800..=253_402_300_799).contains(&t.seconds)
}

fn fields(e: &Error) -> Vec<String> {
    match e {
        Error::InvalidArgument(v) => v.iter().map(|f| f.field.clone()).collect(),
        other => panic!("not INVALID_ARGUMENT: {other:?}"),
    }
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn check_topic_follows_kafka_rules(t in topic()) {
        let ok = !t.is_empty() && t.len() <= 249 && t != "." && t != ".."
            && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        prop_assert_eq!(check_topic(&t).is_ok(), ok, "{:?}", t);
    }

    #[test]
    fn timestamps_are_valid_exactly_in_the_rfc3339_range(t in ts()) {
        let got = timestamp(&t);
        prop_assert_eq!(got.is_some(), valid_ts(&t));
        if let Some(d) = got {
            prop_assert_eq!(d.timestamp(), t.seconds);
            prop_assert_eq!(d.timestamp_subsec_nanos() as i32, t.nanos);
        }
    }

    /// An event converts exactly when it breaks no rule; otherwise every broken rule is
    /// named, under the given prefix, and nothing else is.
    #[test]
    fn an_event_converts_or_names_every_bad_field(e in pb_event()) {
        let l = limits();
        let want = violated(&e, &l);
        match new_event(e.clone(), "event", &l) {
            Ok(n) => {
                prop_assert!(want.is_empty(), "accepted despite {:?}", want);
                prop_assert_eq!(&n.topic, &e.topic);
                prop_assert_eq!(n.key.as_deref().unwrap_or(""), e.key.as_str());
                prop_assert_eq!(&n.payload, &e.payload);
                prop_assert_eq!(n.headers.len(), e.headers.len());
                for (k, v) in &e.headers {
                    prop_assert_eq!(n.headers.get(k), Some(v));
                }
                prop_assert_eq!(n.event_type.as_deref().unwrap_or(""), e.r#type.as_str());
                prop_assert_eq!(n.idempotency_key.as_deref().unwrap_or(""), e.idempotency_key.as_str());
                let want_attempts = if e.max_attempts == 0 { l.default_max_attempts } else { e.max_attempts };
                prop_assert_eq!(n.max_attempts, want_attempts);
                prop_assert_eq!(n.deliver_after.is_some(), e.deliver_after.is_some());
            }
            Err(v) => {
                prop_assert!(!v.is_empty());
                let got: BTreeSet<String> = v.iter().map(|f| f.field.clone()).collect();
                let want: BTreeSet<String> = want.iter().map(|f| format!("event.{f}")).collect();
                prop_assert_eq!(got, want);
                prop_assert!(v.iter().all(|f| !f.description.is_empty()));
            }
        }
    }

    /// A batch is all or nothing: it converts whole exactly when its size is allowed and
    /// every event is valid; otherwise each bad event is named by its index.
    #[test]
    fn a_batch_is_all_or_nothing(events in proptest::collection::vec(pb_event(), 0..11)) {
        let l = limits();
        let bad: Vec<(usize, BTreeSet<&str>)> = events
            .iter()
            .enumerate()
            .map(|(i, e)| (i, violated(e, &l)))
            .filter(|(_, v)| !v.is_empty())
            .collect();
        let n = events.len();
        match enqueue_batch_request(pb::EnqueueBatchRequest { events: events.clone() }, &l) {
            Ok(out) => {
                prop_assert!((1..=l.max_batch).contains(&n) && bad.is_empty());
                prop_assert_eq!(out.len(), n);
                for (o, e) in out.iter().zip(&events) {
                    prop_assert_eq!(&o.payload, &e.payload);
                }
            }
            Err(err) => {
                let got: BTreeSet<String> = fields(&err).into_iter().collect();
                if n == 0 || n > l.max_batch {
                    prop_assert_eq!(got, BTreeSet::from(["events".to_string()]));
                } else {
                    let want: BTreeSet<String> = bad
                        .iter()
                        .flat_map(|(i, v)| v.iter().map(move |f| format!("events[{i}].{f}")))
                        .collect();
                    prop_assert!(!want.is_empty(), "refused a valid batch: {:?}", got);
                    prop_assert_eq!(got, want);
                }
            }
        }
    }
}

/// One request of the gRPC property run.
#[derive(Debug, Clone)]
enum Req {
    One(pb::Event),
    Batch(Vec<pb::Event>),
}

/// A mostly well-formed event, with idempotency keys from a small pool so that retries
/// (same content) and conflicts (other content) happen.
fn good_event() -> impl Strategy<Value = pb::Event> {
    (
        "[a-z]{1,3}",
        "[a-z0-9]{0,4}",
        proptest::collection::vec(any::<u8>(), 0..8),
        prop_oneof![Just(String::new()), "[a-d]"],
    )
        .prop_map(|(topic, key, payload, idempotency_key)| pb::Event {
            topic,
            key,
            payload,
            idempotency_key,
            ..Default::default()
        })
}

fn req() -> impl Strategy<Value = Req> {
    prop_oneof![
        2 => pb_event().prop_map(Req::One),
        2 => proptest::collection::vec(pb_event(), 0..11).prop_map(Req::Batch),
        3 => good_event().prop_map(Req::One),
        3 => proptest::collection::vec(good_event(), 1..9).prop_map(Req::Batch),
        // A good batch with one hostile event somewhere: all or nothing.
        2 => (proptest::collection::vec(good_event(), 1..8), pb_event(), any::<prop::sample::Index>())
            .prop_map(|(mut v, bad, at)| {
                let i = at.index(v.len() + 1);
                v.insert(i, bad);
                Req::Batch(v)
            }),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn named_fields(s: &tonic::Status) -> Vec<String> {
    s.get_details_bad_request()
        .map(|b| b.field_violations.into_iter().map(|v| v.field).collect())
        .unwrap_or_default()
}

/// Sends `r` and checks the answer against the rules and the row count.
async fn check_enqueue(
    s: &mut Service,
    r: Req,
    stats: &mut HashMap<&'static str, usize>,
) -> Result<(), TestCaseError> {
    let l = limits();
    let store = s.app.store.clone();
    let before = store.count_events(BoxKind::Outbox, None).await.unwrap();
    let (res, valid, n) = match r {
        Req::One(e) => {
            let valid = violated(&e, &l).is_empty();
            let res = s
                .client
                .enqueue(pb::EnqueueRequest { event: Some(e) })
                .await
                .map(|r| vec![r.into_inner().duplicate]);
            (res, valid, 1)
        }
        Req::Batch(events) => {
            let n = events.len();
            let valid =
                (1..=l.max_batch).contains(&n) && events.iter().all(|e| violated(e, &l).is_empty());
            let res = s
                .client
                .enqueue_batch(pb::EnqueueBatchRequest { events })
                .await
                .map(|r| r.into_inner().results.iter().map(|r| r.duplicate).collect());
            (res, valid, n)
        }
    };
    let after = store.count_events(BoxKind::Outbox, None).await.unwrap();
    match res {
        Ok(dups) => {
            *stats.entry("ok").or_default() += 1;
            prop_assert!(valid, "OK for an invalid request");
            prop_assert_eq!(dups.len(), n, "one result per event");
            let new = dups.iter().filter(|d| !**d).count() as i64;
            prop_assert_eq!(after - before, new, "rows added = new events acknowledged");
        }
        Err(st) => {
            prop_assert_eq!(after, before, "a refused request stores nothing ({:?})", st);
            match st.code() {
                Code::InvalidArgument => {
                    *stats.entry("invalid_argument").or_default() += 1;
                    prop_assert!(!valid, "INVALID_ARGUMENT for a valid request: {:?}", st);
                    prop_assert!(!named_fields(&st).is_empty(), "no field named: {:?}", st);
                }
                Code::AlreadyExists => {
                    *stats.entry("already_exists").or_default() += 1;
                    prop_assert!(valid, "ALREADY_EXISTS for an invalid request: {:?}", st);
                }
                other => prop_assert!(false, "undefined answer {:?}: {:?}", other, st),
            }
        }
    }
    Ok(())
}

/// Arbitrary Enqueue/EnqueueBatch against a running SQLite-backed service: always OK,
/// INVALID_ARGUMENT (naming a field) or ALREADY_EXISTS, and the row count changes by
/// exactly the number of new events acknowledged.
#[test]
fn grpc_enqueue_answers_defined_statuses_and_stores_exactly_what_it_acknowledges() {
    let rt = runtime();
    let (url, _dir) = fresh_sqlite();
    let mut c = quiet_config(&url);
    c.limits = limits();
    let s = rt.block_on(Service::start(c));
    let s = Arc::new(tokio::sync::Mutex::new(s));
    let stats = Arc::new(std::sync::Mutex::new(HashMap::new()));
    let mut runner = TestRunner::new(cases(64));
    runner
        .run(&req(), |r| {
            let (s, stats) = (s.clone(), stats.clone());
            rt.block_on(async move {
                let mut s = s.lock().await;
                let mut local = HashMap::new();
                let out = check_enqueue(&mut s, r, &mut local).await;
                let mut st = stats.lock().unwrap();
                for (k, v) in local {
                    *st.entry(k).or_insert(0usize) += v;
                }
                out
            })
        })
        .unwrap();
    eprintln!("grpc enqueue property run: {:?}", stats.lock().unwrap());
    let s = Arc::try_unwrap(s).ok().unwrap().into_inner();
    rt.block_on(s.app.stop()).unwrap();
}

/// PostgreSQL's text type cannot hold NUL characters (SQLite can): an event carrying
/// them in its key, type, idempotency key or headers is refused as INVALID_ARGUMENT
/// naming the field, or stored; never an internal error.
#[tokio::test]
async fn nul_characters_are_a_defined_answer_on_postgresql() {
    let (_url, mut s) = quiet_pg().await;
    let ok = || event("t", "k", b"p");
    let cases: Vec<(&str, pb::Event)> = vec![
        (
            "event.key",
            pb::Event {
                key: "a\0b".into(),
                ..ok()
            },
        ),
        (
            "event.type",
            pb::Event {
                r#type: "t\0".into(),
                ..ok()
            },
        ),
        (
            "event.idempotency_key",
            pb::Event {
                idempotency_key: "i\0".into(),
                ..ok()
            },
        ),
        (
            "event.headers",
            pb::Event {
                headers: [("h".to_string(), "v\0".to_string())].into(),
                ..ok()
            },
        ),
        (
            "event.headers",
            pb::Event {
                headers: [("h\0".to_string(), "v".to_string())].into(),
                ..ok()
            },
        ),
        (
            "event.payload",
            pb::Event {
                payload: vec![0, 0, 0],
                ..ok()
            },
        ),
    ];
    for (field, e) in cases {
        let before = s.outbox_count(None).await;
        match s
            .client
            .enqueue(pb::EnqueueRequest {
                event: Some(e.clone()),
            })
            .await
        {
            Ok(r) => {
                let got = s
                    .found(BoxKind::Outbox, r.into_inner().id)
                    .await
                    .expect("acknowledged, so stored");
                assert_eq!(got.payload, e.payload, "{field}");
                assert_eq!(got.key.as_deref().unwrap_or(""), e.key, "{field}");
            }
            Err(st) => {
                assert_eq!(st.code(), Code::InvalidArgument, "{field}: {st:?}");
                assert!(
                    named_fields(&st).iter().any(|f| f == field),
                    "{field}: {st:?}"
                );
                let after = s.outbox_count(None).await;
                assert_eq!(after, before);
            }
        }
    }
    s.app.stop().await.unwrap();
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// Page tokens: garbage text, base64 of garbage, base64 of JSON of the wrong shape, and
/// well-formed cursors with extreme values.
fn page_token() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => text(40).prop_filter("non-empty", |s| !s.is_empty()),
        2 => proptest::collection::vec(any::<u8>(), 1..40).prop_map(|b| b64(&b)),
        1 => Just(b64(b"{}")),
        1 => Just(b64(b"[1,2,3]")),
        1 => Just(b64(b"null")),
        1 => any::<i64>().prop_map(|n| b64(format!("{{\"before\":\"{n}\"}}").as_bytes())),
        1 => "[A-Za-z0-9_-]{1,6}={1,2}",
        2 => any::<i64>().prop_map(|n| b64(format!("{{\"before\":{n}}}").as_bytes())),
        2 => (any::<i64>(), any::<i64>(), text(10), text(10), prop_oneof![Just("MostPending"), Just("Oldest"), Just("most_pending"), Just("x")])
            .prop_map(|(p, o, t, k, ord)| b64(
                serde_json::json!({"order": ord, "pending": p, "oldest_us": o, "topic": t, "key": k})
                    .to_string()
                    .as_bytes()
            )),
    ]
}

#[derive(Debug, Clone)]
enum AdminReq {
    Pending(pb::ListPendingRequest),
    // Boxed: the filter makes it several times larger than the others.
    Events(Box<pb::ListEventsRequest>),
    Audit(pb::ListAuditRequest),
}

fn admin_req() -> impl Strategy<Value = AdminReq> {
    let page_size = prop_oneof![0u32..3, 999u32..1002, any::<u32>()];
    let filter = (
        prop_oneof![3 => Just(String::new()), 1 => topic()],
        text(10),
        proptest::option::of(ts()),
        proptest::option::of(ts()),
    )
        .prop_map(
            |(topic, key, updated_after, updated_before)| pb::EventFilter {
                topic,
                key,
                updated_after,
                updated_before,
                ..Default::default()
            },
        );
    let boxes =
        prop_oneof![4 => 0i32..2, 1 => any::<i32>().prop_filter("not the inbox", |b| *b != 2)];
    prop_oneof![
        (
            page_token(),
            page_size.clone(),
            prop_oneof![0i32..3, any::<i32>()],
            boxes.clone()
        )
            .prop_map(|(page_token, page_size, order, b)| AdminReq::Pending(
                pb::ListPendingRequest {
                    page_token,
                    page_size,
                    order,
                    r#box: b,
                    ..Default::default()
                }
            )),
        (
            prop_oneof![1 => Just(String::new()), 3 => page_token()],
            page_size.clone(),
            prop_oneof![0i32..4, any::<i32>()],
            proptest::option::of(filter),
            boxes
        )
            .prop_map(
                |(page_token, page_size, status, filter, b)| AdminReq::Events(Box::new(
                    pb::ListEventsRequest {
                        page_token,
                        page_size,
                        status,
                        filter,
                        r#box: b,
                    }
                ))
            ),
        (page_token(), page_size).prop_map(|(page_token, page_size)| AdminReq::Audit(
            pb::ListAuditRequest {
                page_token,
                page_size
            }
        )),
    ]
}

/// Whether a `before` page token is one the server could have issued.
fn before_token_ok(t: &str) -> bool {
    t.is_empty()
        || base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(t)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v.get("before").and_then(|b| b.as_i64()))
            .is_some()
}

fn pending_token_shape_ok(t: &str) -> bool {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|v| {
            v.get("pending").is_some_and(|x| x.is_i64())
                && v.get("oldest_us").is_some_and(|x| x.is_i64())
                && v.get("topic").is_some_and(|x| x.is_string())
                && v.get("key").is_some_and(|x| x.is_string())
                && v.get("order").is_some_and(|x| x.is_string())
        })
}

/// What the rules say about a request: `true` if it must be refused as
/// INVALID_ARGUMENT, `false` if it must be OK, `None` if either is acceptable.
fn admin_expectation(r: &AdminReq) -> Option<bool> {
    let bad_page = |n: u32| n > 1000;
    let bad_box = |b: i32| !(0..=2).contains(&b);
    match r {
        AdminReq::Pending(p) => {
            if bad_page(p.page_size) || bad_box(p.r#box) || !(0..=2).contains(&p.order) {
                return Some(true);
            }
            if !pending_token_shape_ok(&p.page_token) {
                return Some(true);
            }
            None // a well-formed cursor: OK, or refused for another order / unknown value
        }
        AdminReq::Events(e) => {
            let f = e.filter.clone().unwrap_or_default();
            let bad_ts =
                |t: &Option<prost_types::Timestamp>| t.as_ref().is_some_and(|t| !valid_ts(t));
            let bad_range = match (&f.updated_after, &f.updated_before) {
                (Some(a), Some(b)) if valid_ts(a) && valid_ts(b) => {
                    (a.seconds, a.nanos) >= (b.seconds, b.nanos)
                }
                _ => false,
            };
            Some(
                bad_page(e.page_size)
                    || bad_box(e.r#box)
                    || !(0..=3).contains(&e.status)
                    || !before_token_ok(&e.page_token)
                    || (!f.topic.is_empty() && check_topic(&f.topic).is_err())
                    || bad_ts(&f.updated_after)
                    || bad_ts(&f.updated_before)
                    || bad_range,
            )
        }
        AdminReq::Audit(a) => Some(bad_page(a.page_size) || !before_token_ok(&a.page_token)),
    }
}

/// Malformed page tokens, bad time ranges and out-of-range enums and sizes sent to
/// ListPending, ListEvents and ListAudit: INVALID_ARGUMENT naming a field, or OK where
/// the request is well formed; never anything else.
#[test]
fn admin_garbage_tokens_and_filters_are_invalid_argument() {
    let rt = runtime();
    let (url, _dir) = fresh_sqlite();
    let mut s = rt.block_on(Service::start(quiet_config(&url)));
    // Something to list: a few events, one of them failed, and an audit entry.
    rt.block_on(async {
        for i in 0..5 {
            enqueue(&mut s.client, event("adm", &format!("k{}", i % 2), b"x")).await;
        }
    });
    let admin = rt.block_on(async { AdminServiceClient::new(channel(s.app.addr).await) });
    let stats = Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    let mut runner = TestRunner::new(cases(64));
    runner
        .run(&admin_req(), |r| {
            let mut admin = admin.clone();
            let stats = stats.clone();
            rt.block_on(async move {
                let want = admin_expectation(&r);
                let res: Result<(), tonic::Status> = match r.clone() {
                    AdminReq::Pending(p) => admin.list_pending(p).await.map(|_| ()),
                    AdminReq::Events(e) => admin.list_events(*e).await.map(|_| ()),
                    AdminReq::Audit(a) => admin.list_audit(a).await.map(|_| ()),
                };
                let kind = match &r {
                    AdminReq::Pending(_) => "pending",
                    AdminReq::Events(_) => "events",
                    AdminReq::Audit(_) => "audit",
                };
                let code = res.as_ref().err().map(|s| s.code()).unwrap_or(Code::Ok);
                *stats
                    .lock()
                    .unwrap()
                    .entry(format!("{kind} {code:?}"))
                    .or_default() += 1;
                match res {
                    Ok(()) => {
                        prop_assert!(want != Some(true), "OK for a malformed request {:?}", r)
                    }
                    Err(st) => {
                        prop_assert_eq!(
                            st.code(),
                            Code::InvalidArgument,
                            "undefined answer for {:?}: {:?}",
                            r,
                            st
                        );
                        prop_assert!(
                            want != Some(false),
                            "refused a well-formed request {:?}: {:?}",
                            r,
                            st
                        );
                        prop_assert!(!named_fields(&st).is_empty(), "no field named: {:?}", st);
                    }
                }
                Ok(())
            })
        })
        .unwrap();
    eprintln!("admin property run: {:?}", stats.lock().unwrap());
    rt.block_on(s.app.stop()).unwrap();
}

//! Republishing completed outbox events (issue 44, item 1): through the admin RPC and the
//! CLI, against PostgreSQL and the broker, and on both engines with a local sink.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use crate::support::cli::admin_cli_json;
use crate::support::*;
use mailroom::domain::{BoxKind, Status};
use mailroom::pb;
use mailroom::pb::admin_service_client::AdminServiceClient;
use mailroom::pb::outbox_service_client::OutboxServiceClient;
use mailroom::sink::SinkConfig;
use tonic::Code;
use tonic::transport::Channel;

const PRODUCER: &str = "producer-0123456789abc";
const OPS: &str = "ops-0123456789abcdefgh";
const VIEWER: &str = "viewer-0123456789abcd";
const HEADER: &str = "mailroom-republished-from";

fn tokens(dir: &std::path::Path) -> Vec<mailroom::access::TokenEntry> {
    let p = dir.join("tokens.toml");
    std::fs::write(
        &p,
        format!(
            "[[token]]\nname = \"producer\"\ntoken = \"{PRODUCER}\"\nscopes = [\"enqueue\"]\n\n\
             [[token]]\nname = \"ops\"\ntoken = \"{OPS}\"\nscopes = [\"admin\"]\n\n\
             [[token]]\nname = \"viewer\"\ntoken = \"{VIEWER}\"\nscopes = [\"admin_read\"]\n"
        ),
    )
    .unwrap();
    mailroom::access::load_tokens(&p).unwrap()
}

async fn republish(
    a: &mut AdminServiceClient<Channel>,
    token: &str,
    r: pb::RepublishEventsRequest,
) -> Result<pb::RepublishEventsResponse, tonic::Status> {
    a.republish_events(with_token(r, Some(token)))
        .await
        .map(|r| r.into_inner())
}

/// Enqueues `events` in batches of 100 with the producer token; their ids in order.
async fn enqueue_all(c: &mut OutboxServiceClient<Channel>, events: Vec<pb::Event>) -> Vec<i64> {
    let mut ids = Vec::new();
    for chunk in events.chunks(100) {
        let r = c
            .enqueue_batch(with_token(
                pb::EnqueueBatchRequest {
                    events: chunk.to_vec(),
                },
                Some(PRODUCER),
            ))
            .await
            .unwrap()
            .into_inner();
        ids.extend(r.results.iter().map(|r| r.id));
    }
    ids
}

fn key_of(i: usize) -> String {
    let k = i % 50;
    if k < 25 {
        format!("a-{k:02}")
    } else {
        format!("b-{k:02}")
    }
}

/// 1,000 events over 50 keys completed on the broker, in two halves with a time between
/// them; then, with an admin token: a dry run of "the second half of the keys starting
/// `a-`" counts 250 and stores nothing; a read-only token is refused; the same selection
/// for real stores 250 copies; the same request id again does nothing; three events
/// republished by id. The broker then holds exactly the 1,000 originals and the 253
/// copies once each: every copy with its original's key, payload, type and headers plus
/// `mailroom-republished-from`, each key's copies in the originals' order and after all
/// of that key's earlier events; the audit log names the principal and the filter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_events_are_republished_at_the_end_of_their_keys_lines() {
    let broker = Broker::start();
    let url = fresh_pg().await;
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(&url);
    kafka_sink_config(&mut c, &broker.addr(), Duration::from_secs(5));
    c.tokens = tokens(dir.path());
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let mut s = Service::start(c).await;
    let mut a = AdminServiceClient::new(channel(s.app.addr).await);
    let topic = "orders.republish";

    let batch = |range: std::ops::Range<usize>| -> Vec<pb::Event> {
        range
            .map(|i| {
                let mut e = event(topic, &key_of(i), format!("p{i}").as_bytes());
                e.r#type = "order.placed".into();
                e.headers.insert("trace".into(), format!("t{i}"));
                e
            })
            .collect()
    };
    let first = enqueue_all(&mut s.client, batch(0..500)).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let boundary = chrono::Utc::now();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = enqueue_all(&mut s.client, batch(500..1000)).await;
    wait_completed(&s.app.store, 1000, Duration::from_secs(60)).await;
    let original_of: HashMap<i64, usize> = first
        .iter()
        .chain(&second)
        .enumerate()
        .map(|(i, id)| (*id, i))
        .collect();

    let filter = pb::EventFilter {
        topic: topic.into(),
        key_prefix: "a-".into(),
        created_after: Some(mailroom::pb::time::to_timestamp(boundary)),
        ..Default::default()
    };
    let wanted: Vec<i64> = second
        .iter()
        .enumerate()
        .filter(|(i, _)| key_of(500 + i).starts_with("a-"))
        .map(|(_, id)| *id)
        .collect();
    assert_eq!(wanted.len(), 250);

    // A dry run (no confirm) counts and samples, and stores nothing.
    let dry = republish(
        &mut a,
        OPS,
        pb::RepublishEventsRequest {
            filter: Some(filter.clone()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(dry.dry_run);
    assert_eq!(dry.count, 250);
    assert_eq!(dry.sample_ids, wanted[..20]);
    assert_eq!((dry.audit_id, dry.copies.len()), (0, 0));
    assert_eq!(s.outbox_count(None).await, 1000, "a dry run stores nothing");

    // A read-only token may not republish.
    let confirmed = pb::RepublishEventsRequest {
        filter: Some(filter.clone()),
        confirm: true,
        operator: "dana".into(),
        request_id: "incident-42".into(),
        ..Default::default()
    };
    let e = republish(&mut a, VIEWER, confirmed.clone())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert_eq!(s.outbox_count(None).await, 1000);

    let done = republish(&mut a, OPS, confirmed.clone()).await.unwrap();
    assert!(!done.dry_run && !done.replayed);
    assert_eq!(done.count, 250);
    assert!(done.audit_id > 0);
    let originals: Vec<i64> = done.copies.iter().map(|c| c.original_id).collect();
    assert_eq!(originals, wanted, "every selected event, in id order");
    let max_original = *second.last().unwrap();
    assert!(
        done.copies.windows(2).all(|w| w[0].id < w[1].id) && done.copies[0].id > max_original,
        "copies get new ids after every earlier event"
    );

    // The same request id again: nothing more.
    let again = republish(&mut a, OPS, confirmed).await.unwrap();
    assert!(again.replayed);
    assert_eq!((again.count, again.audit_id), (250, done.audit_id));
    assert!(again.copies.is_empty());
    assert_eq!(
        s.outbox_count(None).await,
        1250,
        "one copy per selected event"
    );

    // By ids (the CLI, without a request id): three events of one key, from the first half.
    let by_id: Vec<i64> = first
        .iter()
        .enumerate()
        .filter(|(i, _)| key_of(*i) == "b-30")
        .map(|(_, id)| *id)
        .take(3)
        .collect();
    let mut args = vec!["republish".to_string()];
    args.extend(by_id.iter().map(|i| i.to_string()));
    args.push("--yes".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = admin_cli_json(s.app.addr, Some(OPS), &args).await;
    assert_eq!(out["count"], 3, "{out}");
    assert_eq!(out["copies"].as_array().unwrap().len(), 3, "{out}");

    // Unknown ids change nothing: NOT_FOUND naming them.
    let e = republish(
        &mut a,
        OPS,
        pb::RepublishEventsRequest {
            ids: vec![by_id[0], 99_999_999],
            confirm: true,
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert!(e.message().contains("99999999"), "{e:?}");
    assert_eq!(s.outbox_count(None).await, 1253);

    wait_completed(&s.app.store, 1253, Duration::from_secs(60)).await;
    let records = consume(&broker.addr(), topic, 1253, Duration::from_secs(60));
    let (per_key, _dups) = first_deliveries(&records);
    let delivered: usize = per_key.values().map(Vec::len).sum();
    assert_eq!(delivered, 1253, "each original and each copy on the broker");

    // Each copy carries its original's content and the header naming it.
    let mut copy_of_original: HashMap<i64, i64> = HashMap::new();
    let mut seen = HashSet::new();
    for r in &records {
        let id = event_id(&r.headers["ce_id"]);
        if !seen.insert(id) {
            continue;
        }
        let Some(from) = r.headers.get(HEADER) else {
            assert!(original_of.contains_key(&id), "record {id} is no event");
            continue;
        };
        let from: i64 = from.parse().unwrap();
        let i = original_of[&from];
        assert_eq!(r.key, key_of(i), "copy {id}");
        assert_eq!(r.payload, format!("p{i}").as_bytes(), "copy {id}");
        assert_eq!(r.headers["trace"], format!("t{i}"), "copy {id}");
        assert_eq!(r.headers["ce_type"], "order.placed", "copy {id}");
        copy_of_original.insert(from, id);
    }
    let mut expected: Vec<i64> = wanted.clone();
    expected.extend(&by_id);
    expected.sort();
    let mut got: Vec<i64> = copy_of_original.keys().copied().collect();
    got.sort();
    assert_eq!(
        got, expected,
        "exactly the selected events were republished"
    );

    // Per key: ids increase (copies after every earlier event of the key), and the
    // copies come in their originals' order.
    for (key, ids) in &per_key {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "key {key}: {ids:?}");
        let originals_seen: Vec<i64> = ids
            .iter()
            .filter_map(|id| {
                copy_of_original
                    .iter()
                    .find(|(_, c)| *c == id)
                    .map(|(o, _)| *o)
            })
            .collect();
        assert!(
            originals_seen.windows(2).all(|w| w[0] < w[1]),
            "key {key}: copies out of their originals' order {originals_seen:?}"
        );
        let last_original = ids.iter().filter(|id| original_of.contains_key(id)).max();
        let first_copy = ids.iter().find(|id| !original_of.contains_key(id));
        if let (Some(o), Some(c)) = (last_original, first_copy) {
            assert!(c > o, "key {key}: a copy before an original");
        }
    }
    for id in by_id.iter().chain(&wanted) {
        let e = s.stored(BoxKind::Outbox, copy_of_original[id]).await;
        assert_eq!((e.status, e.attempts), (Status::Completed, 0));
    }

    let audit = a
        .list_audit(with_token(pb::ListAuditRequest::default(), Some(VIEWER)))
        .await
        .unwrap()
        .into_inner();
    let entries: Vec<&pb::AuditEntry> = audit
        .entries
        .iter()
        .filter(|e| e.action == "republish")
        .collect();
    assert_eq!(entries.len(), 2, "{entries:?}");
    let by_filter = entries.iter().find(|e| e.id == done.audit_id).unwrap();
    assert_eq!(by_filter.count, 250);
    assert_eq!(by_filter.actor, "dana (token ops)");
    assert_eq!(by_filter.request_id, "incident-42");
    let selection: serde_json::Value = serde_json::from_str(&by_filter.selection).unwrap();
    assert_eq!(selection["filter"]["key_prefix"], "a-", "{by_filter:?}");
    assert_eq!(selection["limit"], 1000, "{by_filter:?}");
    // Dry runs, refusals and the replay count nothing.
    let metrics = crate::support::probe::scrape(s.app.metrics_addr.unwrap()).await;
    assert_eq!(
        crate::support::probe::sample(&metrics, "mailroom_outbox_republished_total"),
        253.0
    );
    s.app.stop().await.unwrap();
}

/// On both engines, with a local sink: bad requests are refused naming the field and
/// change nothing; pending and failed events are not republished; a copy of a copy
/// names its immediate original; the copies go out after their key's events.
#[tokio::test]
async fn republish_checks_its_request_and_works_on_both_engines() {
    for engine in &ENGINES {
        let (url, _dir) = fresh_db(engine).await;
        let out = tempfile::tempdir().unwrap();
        let sink = out.path().join("sink.jsonl");
        let mut c = config(&url);
        c.relays = 1;
        c.admin_token = Some(mailroom::secret::Secret(OPS.into()));
        c.sink = SinkConfig::Local {
            path: Some(sink.clone()),
        };
        let mut s = Service::start(c).await;
        let mut a = AdminServiceClient::new(channel(s.app.addr).await);
        let mut ids = Vec::new();
        for i in 0..4 {
            let mut e = event("t", "k", format!("{i}").as_bytes());
            if i % 2 == 0 {
                e.headers.insert("tenant".into(), "a".into());
            }
            e.headers.insert("n".into(), format!("{i}"));
            ids.push(enqueue(&mut s.client, e).await);
        }
        wait_completed(&s.app.store, 4, Duration::from_secs(20)).await;

        // The header match: every pair given must be present with that value.
        for (pairs, want) in [
            (vec![("tenant", "a")], vec![ids[0], ids[2]]),
            (vec![("tenant", "a"), ("n", "2")], vec![ids[2]]),
            (vec![("tenant", "a"), ("n", "1")], vec![]),
            (vec![("tenant", "b")], vec![]),
        ] {
            let dry = republish(
                &mut a,
                OPS,
                pb::RepublishEventsRequest {
                    filter: Some(pb::EventFilter {
                        headers: pairs
                            .iter()
                            .map(|(k, v)| (k.to_string(), v.to_string()))
                            .collect(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
            assert_eq!(dry.sample_ids, want, "{engine:?}: {pairs:?}");
        }

        let bad = [
            (
                pb::RepublishEventsRequest {
                    limit: 1001,
                    ..Default::default()
                },
                "limit",
            ),
            (
                pb::RepublishEventsRequest {
                    ids: vec![ids[0]],
                    filter: Some(pb::EventFilter {
                        topic: "t".into(),
                        ..Default::default()
                    }),
                    confirm: true,
                    ..Default::default()
                },
                "ids",
            ),
            (
                pb::RepublishEventsRequest {
                    confirm: true,
                    ..Default::default()
                },
                "all",
            ),
            (
                pb::RepublishEventsRequest {
                    filter: Some(pb::EventFilter {
                        key: "k".into(),
                        key_prefix: "k".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                "filter.key_prefix",
            ),
            (
                pb::RepublishEventsRequest {
                    filter: Some(pb::EventFilter {
                        created_after: Some(pb::time::to_timestamp(chrono::Utc::now())),
                        created_before: Some(pb::time::to_timestamp(
                            chrono::Utc::now() - chrono::Duration::hours(1),
                        )),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                "filter.created_before",
            ),
        ];
        for (r, field) in bad {
            let e = republish(&mut a, OPS, r).await.unwrap_err();
            assert_eq!(
                (e.code(), field_of(&e)),
                (Code::InvalidArgument, field.to_string()),
                "{engine:?}: {e:?}"
            );
        }
        assert_eq!(s.outbox_count(None).await, 4);

        // The content is read only within the byte limit: sizes first.
        let req = mailroom::domain::admin::RepublishRequest {
            selection: mailroom::domain::admin::Selection::Ids(vec![ids[0], ids[1]]),
            limit: 1000,
            context: mailroom::domain::admin::ActionContext::by("test"),
        };
        for (max, loaded) in [(3, false), (1 << 20, true)] {
            match s
                .app
                .store
                .copy_selection(BoxKind::Outbox, &req, max)
                .await
                .unwrap()
            {
                mailroom::domain::admin::RepublishSelection::Selected {
                    ids: got,
                    copies,
                    bytes,
                } => {
                    assert_eq!(got, ids[..2], "{engine:?}");
                    assert!(bytes > 2 * 3, "{engine:?}: {bytes}");
                    assert_eq!(
                        copies.len(),
                        if loaded { 2 } else { 0 },
                        "{engine:?}: {max}"
                    );
                }
                other => panic!("{other:?}"),
            }
        }

        // Finding an event by its idempotency key (issue 44, item 5), on both engines.
        let mut keyed = event("t", "other", b"i");
        keyed.idempotency_key = "order-7/created".into();
        let keyed = enqueue(&mut s.client, keyed).await;
        let found = a
            .list_events(with_token(
                pb::ListEventsRequest {
                    filter: Some(pb::EventFilter {
                        idempotency_key: "order-7/created".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                Some(OPS),
            ))
            .await
            .unwrap()
            .into_inner();
        let found: Vec<i64> = found.events.iter().map(|e| e.id).collect();
        assert_eq!(found, [keyed], "{engine:?}");
        // GetEvent by the key, with its payload; an unknown key is NOT_FOUND; naming the
        // event twice, or an inbox message id in the outbox, is INVALID_ARGUMENT.
        let get = |r: pb::GetEventRequest| {
            let mut a = a.clone();
            async move {
                a.get_event(with_token(r, Some(OPS)))
                    .await
                    .map(|r| r.into_inner())
            }
        };
        let by_key = pb::GetEventRequest {
            idempotency_key: "order-7/created".into(),
            include_payload: true,
            ..Default::default()
        };
        let got = get(by_key.clone()).await.unwrap().event.unwrap();
        assert_eq!(
            (got.id, got.payload.as_slice()),
            (keyed, b"i".as_slice()),
            "{engine:?}"
        );
        let unknown = get(pb::GetEventRequest {
            idempotency_key: "order-8/created".into(),
            ..Default::default()
        })
        .await;
        assert_eq!(code(unknown), Code::NotFound, "{engine:?}");
        for (bad, field) in [
            (
                pb::GetEventRequest {
                    id: keyed,
                    ..by_key.clone()
                },
                "id",
            ),
            (
                pb::GetEventRequest {
                    message_id: "rpc:x".into(),
                    ..Default::default()
                },
                "message_id",
            ),
        ] {
            let e = get(bad).await.unwrap_err();
            assert_eq!(
                (e.code(), field_of(&e)),
                (Code::InvalidArgument, field.into()),
                "{engine:?}"
            );
        }
        let cli = admin_cli_json(
            s.app.addr,
            Some(OPS),
            &["get", "--idempotency-key", "order-7/created"],
        )
        .await;
        assert_eq!(cli["id"].as_i64(), Some(keyed), "{engine:?}: {cli}");
        let e = a
            .list_events(with_token(
                pb::ListEventsRequest {
                    filter: Some(pb::EventFilter {
                        message_id: "rpc:x".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                Some(OPS),
            ))
            .await
            .unwrap_err();
        assert_eq!(
            (e.code(), field_of(&e)),
            (Code::InvalidArgument, "filter.message_id".into()),
            "{engine:?}"
        );
        wait_completed(&s.app.store, 5, Duration::from_secs(20)).await;

        // A pending (delayed) event is not completed: FAILED_PRECONDITION, nothing stored.
        let delayed = enqueue(&mut s.client, {
            let mut e = event("t", "", b"f");
            e.deliver_after = Some(pb::time::to_timestamp(
                chrono::Utc::now() + chrono::Duration::hours(1),
            ));
            e
        })
        .await;
        let e = republish(
            &mut a,
            OPS,
            pb::RepublishEventsRequest {
                ids: vec![ids[1], delayed],
                confirm: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{engine:?}: {e:?}");
        assert_eq!(s.outbox_count(None).await, 6);

        // By filter (key and a creation range), then a copy of the copy.
        let r = republish(
            &mut a,
            OPS,
            pb::RepublishEventsRequest {
                filter: Some(pb::EventFilter {
                    key: "k".into(),
                    created_before: Some(pb::time::to_timestamp(
                        chrono::Utc::now() + chrono::Duration::minutes(1),
                    )),
                    ..Default::default()
                }),
                limit: 2,
                confirm: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let pairs: Vec<(i64, i64)> = r.copies.iter().map(|c| (c.original_id, c.id)).collect();
        assert_eq!(pairs.len(), 2, "{engine:?}");
        assert_eq!(
            pairs.iter().map(|p| p.0).collect::<Vec<_>>(),
            ids[..2],
            "{engine:?}: the oldest first"
        );
        let copy = pairs[0].1;
        wait_completed(&s.app.store, 7, Duration::from_secs(20)).await;
        let r2 = republish(
            &mut a,
            OPS,
            pb::RepublishEventsRequest {
                ids: vec![copy],
                confirm: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let copy2 = r2.copies[0].id;
        wait_completed(&s.app.store, 8, Duration::from_secs(20)).await;
        let e = s.stored(BoxKind::Outbox, copy2).await;
        let headers: BTreeMap<String, String> = e.headers.into_iter().collect();
        assert_eq!(headers.get(HEADER), Some(&copy.to_string()), "{engine:?}");
        assert_eq!(e.payload, b"0", "{engine:?}");

        let text = std::fs::read_to_string(&sink).unwrap();
        let order: Vec<i64> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["key"] == "k")
            .map(|v| v["id"].as_i64().unwrap())
            .collect();
        let mut expected = ids.clone();
        expected.extend([pairs[0].1, pairs[1].1, copy2]);
        assert_eq!(order, expected, "{engine:?}: the key's line, copies last");
        s.app.stop().await.unwrap();
    }
}

//! Byte budgets (issue 11, item 8): the gRPC decoding limit is per method, and an
//! oversized request is refused before it is buffered, with a status naming the limit.

use std::time::{Duration, Instant};

use crate::support::*;
use mailroom::pb;
use mailroom::pb::outbox_service_client::OutboxServiceClient;

const MIB: usize = 1024 * 1024;

/// Peak resident memory of a process, from /proc/<pid>/status.
fn vm_hwm_bytes(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM line");
    let kb: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmHWM value");
    kb * 1024
}

fn big_event(key: &str, bytes: usize) -> pb::Event {
    event("budget", key, &vec![b'x'; bytes])
}

/// A 300 MiB `EnqueueBatch` and a 200 MiB `Enqueue` are refused with
/// `RESOURCE_EXHAUSTED` naming their setting, while an 8 MiB batch (above the single
/// event limit) is accepted: the limits are per method. The server's peak RSS stays
/// within twice the default batch limit (64 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_are_refused_per_method_without_buffering_them() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, mut client, _) = start_binary(dir.path(), &[]).await;
    let pid = child.id();
    let baseline = vm_hwm_bytes(pid);

    // Per method: a batch of 8 MiB is fine although one Enqueue may carry ~1 MiB (9
    // payloads of 1,000,000 bytes: the default payload limit is 1,015,820 bytes, to fit
    // stock Kafka).
    let ok = client
        .enqueue_batch(pb::EnqueueBatchRequest {
            events: (0..9)
                .map(|i| big_event(&format!("ok{i}"), 1_000_000))
                .collect(),
        })
        .await;
    assert!(ok.is_ok(), "an 8 MiB batch is accepted: {ok:?}");
    let after_batch = vm_hwm_bytes(pid);

    // One Enqueue of 200 MiB: refused before it is buffered.
    let err = client
        .enqueue(pb::EnqueueRequest {
            event: Some(big_event("one", 200 * MIB)),
        })
        .await
        .expect_err("a 200 MiB Enqueue is refused");
    refused_naming(&err, "200 MiB Enqueue", "MAILROOM_MAX_PAYLOAD_BYTES");

    // A 300 MiB batch: over MAILROOM_MAX_BATCH_BYTES (64 MiB by default).
    let err = client
        .enqueue_batch(pb::EnqueueBatchRequest {
            events: (0..300)
                .map(|i| big_event(&format!("b{i}"), MIB - 1024))
                .collect(),
        })
        .await
        .expect_err("a 300 MiB batch is refused");
    refused_naming(&err, "300 MiB EnqueueBatch", "MAILROOM_MAX_BATCH_BYTES");

    // The service still works, and never held anything like the refused requests.
    let ok = client
        .enqueue(pb::EnqueueRequest {
            event: Some(big_event("after", 1024)),
        })
        .await;
    assert!(ok.is_ok(), "{ok:?}");
    let peak = vm_hwm_bytes(pid);
    println!(
        "server VmHWM: {} MiB at start, {} MiB after the 8 MiB batch, {} MiB at the end",
        baseline / MIB,
        after_batch / MIB,
        peak / MIB
    );
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        peak <= 2 * 64 * MIB,
        "peak RSS {} MiB exceeds twice the 64 MiB batch limit",
        peak / MIB
    );
}

/// `err` is RESOURCE_EXHAUSTED and names the `limit` setting (`what`: the request).
pub(crate) fn refused_naming(err: &tonic::Status, what: &str, limit: &str) {
    println!("{what}: {:?} {}", err.code(), err.message());
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains(limit),
        "the status names the limit: {}",
        err.message()
    );
}

/// Starts the binary on SQLite with a local sink and no relays, `envs` added; returns the
/// child, a client without size limits, and its channel.
async fn start_binary(
    dir: &std::path::Path,
    envs: &[(&str, &str)],
) -> (
    std::process::Child,
    OutboxServiceClient<tonic::transport::Channel>,
    tonic::transport::Channel,
) {
    let port = free_port();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_mailroom"));
    cmd.env("MAILROOM_LISTEN", format!("127.0.0.1:{port}"))
        .env(
            "MAILROOM_DATABASE_URL",
            format!("sqlite://{}", dir.join("m.db").display()),
        )
        .env("MAILROOM_LOCAL_SINK", dir.join("sink.jsonl"))
        .env("MAILROOM_RELAYS", "0")
        .env_remove("MAILROOM_MAX_BATCH_BYTES")
        .env_remove("MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let channel = loop {
        match tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
        {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("mailroom did not start: {e}"),
        }
    };
    let client = OutboxServiceClient::new(channel.clone())
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX);
    (child, client, channel)
}

/// Eight producers each send a ~60 MiB `EnqueueBatch` at once; returns how many were
/// stored, how many refused `RESOURCE_EXHAUSTED`, and the server's peak RSS.
async fn eight_large_batches(envs: &[(&str, &str)]) -> (usize, usize, usize) {
    use tonic_types::StatusExt;
    let dir = tempfile::tempdir().unwrap();
    let (mut child, client, _) = start_binary(dir.path(), envs).await;
    let pid = child.id();
    let mut calls = Vec::new();
    for p in 0..8 {
        let mut client = client.clone();
        calls.push(tokio::spawn(async move {
            client
                .enqueue_batch(pb::EnqueueBatchRequest {
                    events: (0..60)
                        .map(|i| big_event(&format!("p{p}-{i}"), 1_000_000))
                        .collect(),
                })
                .await
        }));
    }
    let (mut stored, mut refused) = (0, 0);
    for c in calls {
        match c.await.unwrap() {
            Ok(_) => stored += 1,
            Err(e) => {
                // Off, the intake queue may still refuse, once the request is read.
                let limit = if envs.is_empty() {
                    "MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT"
                } else {
                    "MAILROOM_"
                };
                refused_naming(&e, "a batch over the budget", limit);
                assert!(e.get_details_retry_info().is_some(), "retryable: {e:?}");
                refused += 1;
            }
        }
    }
    let peak = vm_hwm_bytes(pid);
    let _ = child.kill();
    let _ = child.wait();
    (stored, refused, peak)
}

/// Issue 25, item 4: memory under hostile load. Eight producers each send a ~60 MiB
/// `EnqueueBatch` at once. With the default budget of request bytes in flight (twice
/// the batch limit, 128 MiB), read from each request's gRPC length prefix before the
/// message is, at most two are admitted at a time and the rest are refused
/// `RESOURCE_EXHAUSTED` with a retry delay: the server's peak RSS stays within the
/// shipped pod's 512 MiB. The control run, with the budget off (0), is what main did:
/// all eight are read at once (the intake queue refuses some only after that), and the
/// peak goes past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_batches_are_admitted_by_bytes() {
    let (stored, refused, peak) = eight_large_batches(&[]).await;
    println!(
        "budget on: {stored} stored, {refused} refused, peak RSS {} MiB",
        peak / MIB
    );
    assert!(
        stored >= 1 && refused >= 1,
        "{stored} stored, {refused} refused"
    );
    assert!(
        peak < 512 * MIB,
        "peak RSS {} MiB over the shipped 512 MiB limit",
        peak / MIB
    );
    let (stored_off, refused_off, peak_off) =
        eight_large_batches(&[("MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT", "0")]).await;
    println!(
        "budget off: {stored_off} stored, {refused_off} refused, peak RSS {} MiB",
        peak_off / MIB
    );
    assert!(
        peak_off > 512 * MIB,
        "the control run should exceed the limit: {} MiB",
        peak_off / MIB
    );
}

const ENQUEUE_BATCH: &str = "/mailroom.v1.OutboxService/EnqueueBatch";

/// Ordinary Enqueues, one every 20 ms while a test runs: what a producer sees.
struct Ordinary {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<(usize, Vec<tonic::Status>)>,
}

impl Ordinary {
    fn start(mut client: OutboxServiceClient<tonic::transport::Channel>) -> Ordinary {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let (mut ok, mut refused) = (0, Vec::new());
            while !flag.load(Ordering::Relaxed) {
                let e = event("budget", "ordinary", b"an ordinary event");
                match client.enqueue(pb::EnqueueRequest { event: Some(e) }).await {
                    Ok(_) => ok += 1,
                    Err(e) => refused.push(e),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (ok, refused)
        });
        Ordinary { stop, task }
    }

    /// Stops; asserts that every Enqueue was answered OK, and that there were some.
    async fn stop(self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (ok, refused) = self.task.await.unwrap();
        assert!(refused.is_empty(), "ordinary Enqueues refused: {refused:?}");
        assert!(ok > 0, "no ordinary Enqueue was answered");
        ok
    }
}

/// Issue 43, item 1: one `EnqueueBatch` of 16 MiB made of empty events (`0a 00`, two
/// bytes each on the wire, some 200 bytes each once decoded), sent as raw bytes, then
/// the same gzip-compressed (16 KiB on the wire): both are refused `INVALID_ARGUMENT` on
/// `events` at the 1001st event, counted from the wire before prost builds any, while
/// ordinary Enqueues are answered throughout. Peak RSS stays under 300 MiB (main decoded
/// all 8 Mi events first: 1,636 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_events_are_counted_before_they_are_built() {
    use crate::support::raw::*;
    let dir = tempfile::tempdir().unwrap();
    let (mut child, client, channel) = start_binary(dir.path(), &[]).await;
    let pid = child.id();
    let ordinary = Ordinary::start(client);
    let message = [0x0a, 0x00].repeat(8 * MIB);
    let started = Instant::now();
    let plain = raw_call(
        channel.clone(),
        ENQUEUE_BATCH,
        whole_body(frame(false, &message)),
        false,
    )
    .await;
    let packed = gzip(&message);
    let zipped = raw_call(
        channel.clone(),
        ENQUEUE_BATCH,
        whole_body(frame(true, &packed)),
        true,
    )
    .await;
    let took = started.elapsed();
    let answered = ordinary.stop().await;
    let peak = vm_hwm_bytes(pid);
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "16 MiB of empty events ({} bytes gzip): peak RSS {} MiB, {answered} ordinary \
         Enqueues answered, {took:?}",
        packed.len(),
        peak / MIB
    );
    for (what, r) in [("raw", plain), ("gzip", zipped)] {
        let err = r.expect_err(what);
        println!("{what}: {:?} {}", err.code(), err.message());
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{what}: {err:?}");
        assert_eq!(field_of(&err), "events", "{what}");
        assert!(err.message().contains("MAILROOM_MAX_BATCH"), "{err:?}");
    }
    assert!(
        peak < 300 * MIB,
        "peak RSS {} MiB: the events were built before they were counted",
        peak / MIB
    );
}

/// Issue 43, item 1: eight concurrent valid gzip batches of 60 events x 1,000,000 zero
/// bytes (60 MB each once decompressed, ~60 KiB on the wire). The budget of bytes in
/// flight counts them decompressed and decoded (twice 60 MB each), so one is admitted
/// at a time (the one waiting for the budget; main let them all take it piece by piece,
/// and then all eight could be refused) and the others are refused `RESOURCE_EXHAUSTED`
/// with a retry delay, while
/// ordinary Enqueues (kept a share of the budget) are answered throughout. Peak RSS stays
/// under 300 MiB (main counted the compressed bytes and admitted all eight: 599 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_batches_are_charged_decompressed() {
    use crate::support::raw::*;
    use prost::Message as _;
    use tonic_types::StatusExt;
    let batch = pb::EnqueueBatchRequest {
        events: (0..60)
            .map(|i| event("budget", &format!("z{i}"), &vec![0u8; 1_000_000]))
            .collect(),
    };
    let body = frame(true, &gzip(&batch.encode_to_vec()));
    drop(batch);
    let dir = tempfile::tempdir().unwrap();
    let (mut child, client, channel) = start_binary(dir.path(), &[]).await;
    let pid = child.id();
    let ordinary = Ordinary::start(client);
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let (channel, body) = (channel.clone(), body.clone());
            tokio::spawn(
                async move { raw_call(channel, ENQUEUE_BATCH, whole_body(body), true).await },
            )
        })
        .collect();
    let (mut stored, mut refused) = (0, 0);
    for c in calls {
        match c.await.unwrap() {
            Ok(()) => stored += 1,
            Err(e) => {
                refused_naming(&e, "a gzip batch", "MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT");
                assert!(e.get_details_retry_info().is_some(), "retryable: {e:?}");
                refused += 1;
            }
        }
    }
    let answered = ordinary.stop().await;
    let peak = vm_hwm_bytes(pid);
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "8 gzip batches of {} bytes: {stored} stored, {refused} refused, {answered} \
         ordinary Enqueues answered, peak RSS {} MiB",
        body.len(),
        peak / MIB
    );
    assert!(stored >= 1, "{stored} stored, {refused} refused");
    assert!(
        peak < 300 * MIB,
        "peak RSS {} MiB: compressed batches were admitted by their wire size",
        peak / MIB
    );
}

/// Issue 43, item 1: two streams declare 64 MiB batches and send nothing more. A
/// declared length reserves nothing (main reserved it before any byte arrived, until the
/// RPC deadline, and refused every other producer meanwhile): an 8 MiB batch and an
/// ordinary Enqueue are stored at once, and the stalled streams are answered
/// `UNAVAILABLE` at the body deadline (1.5 s here), not at the RPC deadline (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_declarations_do_not_refuse_other_callers() {
    use crate::support::raw::*;
    let dir = tempfile::tempdir().unwrap();
    let envs = [("MAILROOM_REQUEST_BODY_TIMEOUT_MS", "1500")];
    let (mut child, mut client, channel) = start_binary(dir.path(), &envs).await;
    let declared = (64 * MIB - 16) as u32;
    let mut prefix = vec![0u8];
    prefix.extend(declared.to_be_bytes());
    let prefix = bytes::Bytes::from(prefix);
    let stalled: Vec<_> = (0..2)
        .map(|_| {
            let (channel, prefix) = (channel.clone(), prefix.clone());
            tokio::spawn(async move {
                let t = Instant::now();
                let r = raw_call(channel, ENQUEUE_BATCH, stalled_body(prefix), false).await;
                (r, t.elapsed())
            })
        })
        .collect();
    // Nothing the server shows says the two prefixes have arrived: give them a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let batch = client
        .enqueue_batch(pb::EnqueueBatchRequest {
            events: (0..9)
                .map(|i| big_event(&format!("s{i}"), 1_000_000))
                .collect(),
        })
        .await;
    let one = client
        .enqueue(pb::EnqueueRequest {
            event: Some(big_event("one", 1024)),
        })
        .await;
    let mut answers = Vec::new();
    for s in stalled {
        answers.push(
            tokio::time::timeout(Duration::from_secs(10), s)
                .await
                .map(|j| j.unwrap()),
        );
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        batch.is_ok(),
        "an 8 MiB batch beside the stalled streams: {batch:?}"
    );
    assert!(
        one.is_ok(),
        "an Enqueue beside the stalled streams: {one:?}"
    );
    for a in answers {
        let (r, took) = a.expect("a stalled stream is answered");
        let err = r.expect_err("a stalled stream is refused");
        println!(
            "stalled: {:?} after {took:?}: {}",
            err.code(),
            err.message()
        );
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert!(err.message().contains("MAILROOM_REQUEST_BODY_TIMEOUT_MS"));
        assert!(took < Duration::from_secs(5), "answered after {took:?}");
    }
}

/// Issue 43, item 1: one caller's share. Two tokens; with 8 RPC slots and a budget of
/// 16 MiB, tenant A first opens 8 requests that declare a message and stall, then two
/// uploads of a 6 MB batch that stop halfway (about 6 MiB of the budget each, counted
/// decoded). Tenant B's Enqueue and its 3 MB batch are answered at once throughout: A
/// holds at most half of the slots and, beyond one request alone, half of the bytes;
/// A's requests past its share are refused `RESOURCE_EXHAUSTED` naming
/// `MAILROOM_PRINCIPAL_SHARE_PERCENT`. (Main refused B "too many requests in flight",
/// then "server busy" until A's stalled requests ran out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_caller_cannot_take_every_slot_or_the_byte_budget() {
    use crate::support::raw::*;
    use prost::Message as _;
    const A: &str = "tenant-a-secret-0123456789";
    const B: &str = "tenant-b-secret-0123456789";
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(
        &tokens,
        format!(
            "[[token]]\nname = \"tenant-a\"\ntoken = \"{A}\"\nscopes = [\"enqueue\"]\n\n\
             [[token]]\nname = \"tenant-b\"\ntoken = \"{B}\"\nscopes = [\"enqueue\"]\n"
        ),
    )
    .unwrap();
    let budget = (16 * MIB).to_string();
    let envs = [
        ("MAILROOM_TOKENS_FILE", tokens.to_str().unwrap()),
        ("MAILROOM_MAX_CONCURRENT_RPCS", "8"),
        ("MAILROOM_MAX_BATCH_BYTES", "8388608"),
        ("MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT", budget.as_str()),
        ("MAILROOM_REQUEST_BODY_TIMEOUT_MS", "4000"),
    ];
    let (mut child, client, channel) = start_binary(dir.path(), &envs).await;
    let batch = |n: usize, key: &str| pb::EnqueueBatchRequest {
        events: (0..n)
            .map(|i| big_event(&format!("{key}{i}"), 500_000))
            .collect(),
    };
    // B's calls, each timed.
    let b_calls = |client: OutboxServiceClient<tonic::transport::Channel>| async move {
        let mut client = client;
        let t = Instant::now();
        let one = client
            .enqueue(with_token(
                pb::EnqueueRequest {
                    event: Some(big_event("b-one", 100)),
                },
                Some(B),
            ))
            .await;
        let batch = client
            .enqueue_batch(with_token(batch(6, "b-batch"), Some(B)))
            .await;
        (one, batch, t.elapsed())
    };
    let stall = |channel: tonic::transport::Channel, first: bytes::Bytes| {
        tokio::spawn(async move {
            let t = Instant::now();
            let r = raw_call_as(channel, ENQUEUE_BATCH, stalled_body(first), false, Some(A)).await;
            (r, t.elapsed())
        })
    };

    // 1. RPC slots: A stalls 8 requests (a prefix declaring 100 bytes, nothing more).
    let mut prefix = vec![0u8];
    prefix.extend(100u32.to_be_bytes());
    let prefix = bytes::Bytes::from(prefix);
    let slots: Vec<_> = (0..8)
        .map(|_| stall(channel.clone(), prefix.clone()))
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (one, b_batch, took) = b_calls(client.clone()).await;
    println!(
        "slots: B answered in {took:?}: {:?} / {:?}",
        one.as_ref().map(|_| ()),
        b_batch.as_ref().map(|_| ())
    );
    let (mut shed, mut stalled) = (0, 0);
    for s in slots {
        let (r, t) = s.await.unwrap();
        let err = r.expect_err("A's stalled request is refused");
        if err.code() == tonic::Code::ResourceExhausted {
            refused_naming(
                &err,
                "A past its share of the slots",
                "MAILROOM_PRINCIPAL_SHARE_PERCENT",
            );
            assert!(
                t < Duration::from_secs(2),
                "refused at once, not after {t:?}"
            );
            shed += 1;
        } else {
            assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
            stalled += 1;
        }
    }
    println!(
        "slots: A's 8 stalled requests: {shed} refused at once, {stalled} cut at the body deadline"
    );
    assert!(
        one.is_ok(),
        "B's Enqueue beside A's stalled requests: {one:?}"
    );
    assert!(
        b_batch.is_ok(),
        "B's batch beside A's stalled requests: {b_batch:?}"
    );
    assert_eq!(shed, 4, "A holds half of the 8 slots");

    // 2. Bytes: A's two uploads stop halfway through a 6 MB batch (about 6 MiB of the
    //    budget each once decoded, twice 3 MB).
    let message = batch(12, "a").encode_to_vec();
    let half = frame(false, &message).slice(..5 + message.len() / 2);
    let first = stall(channel.clone(), half.clone());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let second = stall(channel.clone(), half);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let (one, b_batch, took) = b_calls(client.clone()).await;
    println!(
        "bytes: B answered in {took:?}: {:?} / {:?}",
        one.as_ref().map(|_| ()),
        b_batch.as_ref().map(|_| ())
    );
    let (second, second_took) = second.await.unwrap();
    let (first, _) = first.await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let second = second.expect_err("A's second upload");
    refused_naming(
        &second,
        "A's second upload",
        "MAILROOM_PRINCIPAL_SHARE_PERCENT",
    );
    assert!(
        second_took < Duration::from_secs(2),
        "refused at once, not after {second_took:?}"
    );
    let first = first.expect_err("A's first upload stalls");
    assert_eq!(first.code(), tonic::Code::Unavailable, "{first:?}");
    assert!(one.is_ok(), "B's Enqueue beside A's uploads: {one:?}");
    assert!(b_batch.is_ok(), "B's batch beside A's uploads: {b_batch:?}");
    assert!(
        took < Duration::from_secs(2),
        "B answered in {took:?}, not after A's stalls"
    );
}

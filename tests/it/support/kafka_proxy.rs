//! A Kafka protocol proxy for faults tansu never produces: it forwards every request and
//! response frame byte for byte, and decodes (with the `kafka-protocol` crate, at the
//! version each request names) only what it is told to change:
//! - `hide_leader`: `Metadata` answers that a partition has no leader
//!   (`LEADER_NOT_AVAILABLE`, leader -1), as a real cluster does while a partition's
//!   leader is down, so clients queue its records and keep asking;
//! - `hide_topic_ids`: `Metadata` answers every topic's id as zeros, as brokers before
//!   Kafka 2.8 do (clients then cannot tell a recreated topic by its id);
//! - `no_leader_for_missing_topics`: a `Fetch` answer for a topic the broker does not
//!   have carries no leader (`CurrentLeader`, `NodeEndpoints`), as Kafka's does. tansu
//!   names one, without the topic's name, and librdkafka 2.12 crashes on it (SIGSEGV in
//!   `rd_kafka_metadata_cache_find`): without this, no client may fetch a topic while it
//!   is deleted and created again;
//! - `refuse_produce`: a `Produce` request's data for a partition is taken out before the
//!   request goes on, and the response answers that partition with a chosen error code
//!   (`NOT_LEADER_OR_FOLLOWER` when its leader just died). Nothing of a refused batch is
//!   appended, so the idempotent producer's sequence stays the broker's;
//! - `refuse_marker`: the same for a partition batch any of whose (uncompressed) records
//!   holds a byte marker, as a broker refuses one record (`INVALID_RECORD`,
//!   `POLICY_VIOLATION`...) and with it its whole batch (KIP-467).
//! - `swallow_list_offsets`: `ListOffsets` requests are neither forwarded nor answered,
//!   as by a partition leader that never answers (`swallowed` counts them).
//!
//! Like a real broker, once a batch of a producer's partition is refused, a later batch
//! of that producer and partition (same epoch, higher base sequence) is not appended but
//! answered `OUT_OF_ORDER_SEQUENCE_NUMBER` until the refused sequence is sent again or
//! the producer's id or epoch changes (`out_of_order` counts those answers).
//!
//! The broker behind it must advertise the proxy's address (`Broker::start_advertising`),
//! so that every connection a client opens goes through the proxy.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::messages::produce_response::{PartitionProduceResponse, TopicProduceResponse};
use kafka_protocol::messages::{
    ApiKey, FetchResponse, MetadataResponse, ProduceRequest, ProduceResponse, RequestHeader,
    ResponseHeader,
};
use kafka_protocol::protocol::{Decodable, Encodable};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Kafka's `LEADER_NOT_AVAILABLE`.
const LEADER_NOT_AVAILABLE: i16 = 5;
/// Kafka's `NOT_LEADER_OR_FOLLOWER`.
pub const NOT_LEADER_OR_FOLLOWER: i16 = 6;

#[derive(Default)]
struct Faults {
    hidden: Mutex<HashSet<(String, i32)>>,
    /// Whether `Metadata` answers zeros for topic ids.
    no_topic_ids: std::sync::atomic::AtomicBool,
    /// Whether `Fetch` answers for missing topics lose their leader tags.
    kafka_missing_topics: std::sync::atomic::AtomicBool,
    /// Whether `ListOffsets` requests are dropped unanswered.
    swallow_list_offsets: std::sync::atomic::AtomicBool,
    /// `ListOffsets` requests dropped: proof that the fault fired.
    swallowed: AtomicU64,
    /// Metadata responses in which a leader was hidden: proof that the fault fired.
    hidden_answers: AtomicU64,
    refused: Mutex<HashMap<(String, i32), i16>>,
    /// Byte markers: a partition batch holding one is refused with its code.
    markers: Mutex<Vec<(Vec<u8>, i16)>>,
    /// Topic -> its `max.message.bytes`: a partition batch over it is refused.
    batch_limits: Mutex<HashMap<String, usize>>,
    /// Partition batches answered with an error instead of being appended.
    refusals: AtomicU64,
    /// (producer id, topic, partition) -> (epoch, base sequence) of its refused batch.
    gaps: Mutex<Gaps>,
    /// Batches answered `OUT_OF_ORDER_SEQUENCE_NUMBER` behind a refused one.
    out_of_order: AtomicU64,
}

/// (producer id, topic, partition) -> (epoch, base sequence) of its refused batch.
type Gaps = HashMap<(i64, String, i32), (i16, i32)>;

/// Kafka's `OUT_OF_ORDER_SEQUENCE_NUMBER`.
pub const OUT_OF_ORDER_SEQUENCE_NUMBER: i16 = 45;
/// Kafka's `INVALID_RECORD`.
pub const INVALID_RECORD: i16 = 87;
/// Kafka's `MESSAGE_TOO_LARGE` (a record batch over `message.max.bytes`).
pub const MESSAGE_TOO_LARGE: i16 = 10;

/// (producer id, epoch, base sequence) of a v2 record batch (fixed offsets of its header).
fn batch_identity(records: &[u8]) -> Option<(i64, i16, i32)> {
    let at = |o: usize, n: usize| records.get(o..o + n);
    let pid = i64::from_be_bytes(at(43, 8)?.try_into().ok()?);
    let epoch = i16::from_be_bytes(at(51, 2)?.try_into().ok()?);
    let seq = i32::from_be_bytes(at(53, 4)?.try_into().ok()?);
    // -1: not an idempotent producer, no sequence to keep.
    (pid >= 0).then_some((pid, epoch, seq))
}

/// Partitions a Produce request had taken out, with the error each is answered.
type Refused = Vec<(kafka_protocol::messages::TopicName, i32, i16)>;

/// Correlation id -> (api key, version, partitions refused) of each request in flight.
type Pending = HashMap<i32, (i16, i16, Refused)>;

/// A running proxy on 127.0.0.1:`port`.
pub struct KafkaProxy {
    pub port: u16,
    upstream: Arc<Mutex<String>>,
    faults: Arc<Faults>,
}

impl KafkaProxy {
    /// Listens on a free port; forwards to `set_upstream`'s address once set.
    pub async fn listen() -> KafkaProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let upstream = Arc::new(Mutex::new(String::new()));
        let faults = Arc::new(Faults::default());
        let (up, f) = (upstream.clone(), faults.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let target = up.lock().unwrap().clone();
                let f = f.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&target).await {
                        connection(client, server, f).await;
                    }
                });
            }
        });
        KafkaProxy {
            port,
            upstream,
            faults,
        }
    }

    /// `host:port` of the proxy.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Where connections go.
    pub fn set_upstream(&self, addr: &str) {
        *self.upstream.lock().unwrap() = addr.to_string();
    }

    /// From now on, `Metadata` says `topic`'s `partition` has no leader.
    pub fn hide_leader(&self, topic: &str, partition: i32) {
        self.faults
            .hidden
            .lock()
            .unwrap()
            .insert((topic.to_string(), partition));
    }

    /// From now on, `Metadata` answers zeros for every topic's id.
    pub fn hide_topic_ids(&self) {
        self.faults.no_topic_ids.store(true, Ordering::Relaxed);
    }

    /// From now on, a `Fetch` answer names no leader for a topic the broker lacks.
    pub fn no_leader_for_missing_topics(&self) {
        self.faults
            .kafka_missing_topics
            .store(true, Ordering::Relaxed);
    }

    /// Every partition's leader is shown again.
    pub fn show_leaders(&self) {
        self.faults.hidden.lock().unwrap().clear();
    }

    /// From now on, `Produce` data for `topic`'s `partition` is answered `error_code`
    /// and never reaches the broker.
    pub fn refuse_produce(&self, topic: &str, partition: i32, error_code: i16) {
        self.faults
            .refused
            .lock()
            .unwrap()
            .insert((topic.to_string(), partition), error_code);
    }

    /// `Produce` goes through whole again.
    pub fn accept_produce(&self) {
        self.faults.refused.lock().unwrap().clear();
    }

    /// From now on, a `Produce` partition batch holding `marker` is answered
    /// `error_code` and never reaches the broker.
    pub fn refuse_marker(&self, marker: &[u8], error_code: i16) {
        self.faults
            .markers
            .lock()
            .unwrap()
            .push((marker.to_vec(), error_code));
    }

    /// From now on, a `Produce` partition batch of `topic` over `max_bytes` (the record
    /// batch as the broker counts it against `max.message.bytes`) is answered
    /// `MESSAGE_TOO_LARGE` and never reaches the broker, as stock Kafka does.
    pub fn limit_batches(&self, topic: &str, max_bytes: usize) {
        self.faults
            .batch_limits
            .lock()
            .unwrap()
            .insert(topic.to_string(), max_bytes);
    }

    /// Batches answered `OUT_OF_ORDER_SEQUENCE_NUMBER` behind a refused one so far.
    pub fn out_of_order(&self) -> u64 {
        self.faults.out_of_order.load(Ordering::Relaxed)
    }

    /// Partition batches refused so far.
    pub fn refusals(&self) -> u64 {
        self.faults.refusals.load(Ordering::Relaxed)
    }

    /// Drops every `ListOffsets` request from now on (`false`: forwards them again).
    pub fn swallow_list_offsets(&self, on: bool) {
        self.faults
            .swallow_list_offsets
            .store(on, Ordering::Relaxed);
    }

    /// `ListOffsets` requests dropped so far.
    pub fn swallowed(&self) -> u64 {
        self.faults.swallowed.load(Ordering::Relaxed)
    }

    /// Metadata responses that hid a leader so far.
    pub fn hidden_answers(&self) -> u64 {
        self.faults.hidden_answers.load(Ordering::Relaxed)
    }
}

/// Reads one size-prefixed frame; `None` at EOF.
async fn frame(r: &mut (impl AsyncReadExt + Unpin)) -> Option<Bytes> {
    let n = r.read_i32().await.ok()?;
    let mut buf = vec![0u8; usize::try_from(n).ok()?];
    r.read_exact(&mut buf).await.ok()?;
    Some(Bytes::from(buf))
}

async fn connection(client: TcpStream, server: TcpStream, faults: Arc<Faults>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    // Both directions answer the client: responses, and Produce requests refused whole.
    let cw = Arc::new(tokio::sync::Mutex::new(cw));
    let pending: Arc<Mutex<Pending>> = Arc::default();
    let (p, f, to_client) = (pending.clone(), faults.clone(), cw.clone());
    let requests = async move {
        while let Some(frame) = frame(&mut cr).await {
            if frame.len() < 8 {
                return;
            }
            let mut h = frame.clone();
            let (key, version, correlation) = (h.get_i16(), h.get_i16(), h.get_i32());
            if key == ApiKey::ListOffsets as i16 && f.swallow_list_offsets.load(Ordering::Relaxed) {
                f.swallowed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let (frame, refused) = if key == ApiKey::Produce as i16 {
                refuse(frame.clone(), version, &f).unwrap_or((Some(frame), Vec::new()))
            } else {
                (Some(frame), Vec::new())
            };
            match frame {
                Some(frame) => {
                    p.lock()
                        .unwrap()
                        .insert(correlation, (key, version, refused));
                    if sw.write_all(&framed(&frame)).await.is_err() {
                        return;
                    }
                }
                // Every partition refused: the proxy answers alone.
                None => {
                    let answer = produce_answer(correlation, version, &refused);
                    if to_client
                        .lock()
                        .await
                        .write_all(&framed(&answer))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    };
    let responses = async move {
        while let Some(frame) = frame(&mut sr).await {
            let correlation = frame.clone().get_i32();
            let api = pending.lock().unwrap().remove(&correlation);
            let frame = match api {
                Some((key, version, _)) if key == ApiKey::Metadata as i16 => {
                    rewrite_metadata(frame.clone(), version, &faults).unwrap_or(frame)
                }
                Some((key, version, _))
                    if key == ApiKey::Fetch as i16
                        && faults.kafka_missing_topics.load(Ordering::Relaxed) =>
                {
                    missing_without_leader(frame.clone(), version).unwrap_or(frame)
                }
                Some((key, version, refused))
                    if key == ApiKey::Produce as i16 && !refused.is_empty() =>
                {
                    add_refusals(frame.clone(), version, &refused).unwrap_or(frame)
                }
                _ => frame,
            };
            if cw.lock().await.write_all(&framed(&frame)).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = requests => {}
        _ = responses => {}
    }
}

/// `payload` with its size prefix.
fn framed(payload: &[u8]) -> BytesMut {
    let mut out = BytesMut::with_capacity(payload.len() + 4);
    out.put_i32(i32::try_from(payload.len()).unwrap());
    out.put_slice(payload);
    out
}

/// A Produce request without the refused partitions' data (`None` if nothing is left),
/// and what was taken out; `None` when nothing is refused.
fn refuse(mut frame: Bytes, version: i16, faults: &Faults) -> Option<(Option<Bytes>, Refused)> {
    let rules = faults.refused.lock().unwrap().clone();
    let markers = faults.markers.lock().unwrap().clone();
    let limits = faults.batch_limits.lock().unwrap().clone();
    // Decoding and re-encoding every Produce request costs the test process as much CPU
    // as the relay under test: only a request that names a refused topic (or one with a
    // gap), or holds a marker, is decoded. Topic names are plain bytes in the request,
    // and records are uncompressed.
    let holds = |needle: &[u8]| frame.windows(needle.len()).any(|w| w == needle);
    let gap_topics: HashSet<String> = faults
        .gaps
        .lock()
        .unwrap()
        .keys()
        .map(|(_, t, _)| t.clone())
        .collect();
    let relevant = rules.keys().any(|(t, _)| holds(t.as_bytes()))
        || limits.keys().any(|t| holds(t.as_bytes()))
        || gap_topics.iter().any(|t| holds(t.as_bytes()))
        || markers.iter().any(|(m, _)| holds(m));
    if !relevant {
        return None;
    }
    let header_version = ApiKey::Produce.request_header_version(version);
    let header = RequestHeader::decode(&mut frame, header_version).ok()?;
    let mut body = ProduceRequest::decode(&mut frame, version).ok()?;
    if body.acks == 0 {
        // No response to add refusals to; not used by mailroom (acks=all).
        return None;
    }
    let mut refused = Refused::new();
    let mut gaps = faults.gaps.lock().unwrap();
    for t in &mut body.topic_data {
        let name = t.name.to_string();
        t.partition_data.retain(|p| {
            let records = p.records.as_deref().unwrap_or_default();
            let id = batch_identity(records);
            let gap_key = id.map(|(pid, _, _)| (pid, name.clone(), p.index));
            // Behind a refused batch of the same producer and epoch: not appended.
            if let (Some((_, epoch, seq)), Some(k)) = (id, &gap_key)
                && let Some(&(e, s)) = gaps.get(k)
            {
                if e == epoch && seq > s {
                    faults.out_of_order.fetch_add(1, Ordering::Relaxed);
                    refused.push((t.name.clone(), p.index, OUT_OF_ORDER_SEQUENCE_NUMBER));
                    return false;
                }
                gaps.remove(k);
            }
            let code = rules.get(&(name.clone(), p.index)).copied().or_else(|| {
                markers
                    .iter()
                    .find(|(m, _)| records.windows(m.len()).any(|w| w == m.as_slice()))
                    .map(|(_, c)| *c)
                    .or_else(|| {
                        limits
                            .get(&name)
                            .filter(|max| records.len() > **max)
                            .map(|_| MESSAGE_TOO_LARGE)
                    })
            });
            match code {
                Some(code) => {
                    faults.refusals.fetch_add(1, Ordering::Relaxed);
                    if let (Some((_, epoch, seq)), Some(k)) = (id, gap_key) {
                        gaps.insert(k, (epoch, seq));
                    }
                    refused.push((t.name.clone(), p.index, code));
                    false
                }
                None => true,
            }
        });
    }
    drop(gaps);
    if refused.is_empty() {
        return None;
    }
    body.topic_data.retain(|t| !t.partition_data.is_empty());
    if body.topic_data.is_empty() {
        return Some((None, refused));
    }
    let mut out = BytesMut::new();
    header.encode(&mut out, header_version).ok()?;
    body.encode(&mut out, version).ok()?;
    Some((Some(out.freeze()), refused))
}

fn refusal(index: i32, code: i16) -> PartitionProduceResponse {
    let mut r = PartitionProduceResponse::default();
    r.index = index;
    r.error_code = code;
    r.base_offset = -1;
    r.log_append_time_ms = -1;
    r.log_start_offset = -1;
    r
}

/// The broker's Produce response with the refused partitions' answers added.
fn add_refusals(mut frame: Bytes, version: i16, refused: &Refused) -> Option<Bytes> {
    let header_version = ApiKey::Produce.response_header_version(version);
    let header = ResponseHeader::decode(&mut frame, header_version).ok()?;
    let mut body = ProduceResponse::decode(&mut frame, version).ok()?;
    for (name, index, code) in refused {
        match body.responses.iter_mut().find(|t| &t.name == name) {
            Some(t) => t.partition_responses.push(refusal(*index, *code)),
            None => {
                let mut t = TopicProduceResponse::default();
                t.name = name.clone();
                t.partition_responses.push(refusal(*index, *code));
                body.responses.push(t);
            }
        }
    }
    let mut out = BytesMut::new();
    header.encode(&mut out, header_version).ok()?;
    body.encode(&mut out, version).ok()?;
    Some(out.freeze())
}

/// The proxy's own Produce response when every partition of a request was refused.
fn produce_answer(correlation: i32, version: i16, refused: &Refused) -> Bytes {
    let header_version = ApiKey::Produce.response_header_version(version);
    let mut header = ResponseHeader::default();
    header.correlation_id = correlation;
    let mut body = ProduceResponse::default();
    for (name, index, code) in refused {
        let mut t = TopicProduceResponse::default();
        t.name = name.clone();
        t.partition_responses.push(refusal(*index, *code));
        body.responses.push(t);
    }
    let mut out = BytesMut::new();
    header.encode(&mut out, header_version).unwrap();
    body.encode(&mut out, version).unwrap();
    out.freeze()
}

/// Kafka's `UNKNOWN_TOPIC_OR_PARTITION` and `UNKNOWN_TOPIC_ID`.
const MISSING_TOPIC: [i16; 2] = [3, 100];

/// The fetch response without leader tags on partitions of missing topics (and without
/// node endpoints once no partition names a leader); `None` when it has none.
fn missing_without_leader(mut f: Bytes, version: i16) -> Option<Bytes> {
    let header_version = ApiKey::Fetch.response_header_version(version);
    let header = ResponseHeader::decode(&mut f, header_version).ok()?;
    let mut body = FetchResponse::decode(&mut f, version).ok()?;
    let mut changed = false;
    for p in body.responses.iter_mut().flat_map(|t| &mut t.partitions) {
        if MISSING_TOPIC.contains(&p.error_code) && p.current_leader.leader_id.0 >= 0 {
            p.current_leader = Default::default();
            changed = true;
        }
    }
    if !changed {
        return None;
    }
    let led = body
        .responses
        .iter()
        .flat_map(|t| &t.partitions)
        .any(|p| p.current_leader.leader_id.0 >= 0);
    if !led {
        body.node_endpoints.clear();
    }
    let mut out = BytesMut::new();
    header.encode(&mut out, header_version).ok()?;
    body.encode(&mut out, version).ok()?;
    Some(out.freeze())
}

/// The metadata response with the hidden partitions' leaders (and topic ids) removed;
/// `None` when nothing is hidden there (the frame goes on untouched).
fn rewrite_metadata(mut f: Bytes, version: i16, faults: &Faults) -> Option<Bytes> {
    let hidden = faults.hidden.lock().unwrap().clone();
    let no_ids = faults.no_topic_ids.load(Ordering::Relaxed);
    if hidden.is_empty() && !no_ids {
        return None;
    }
    let header_version = ApiKey::Metadata.response_header_version(version);
    let header = ResponseHeader::decode(&mut f, header_version).ok()?;
    let mut body = MetadataResponse::decode(&mut f, version).ok()?;
    let mut changed = false;
    for t in &mut body.topics {
        if no_ids && !t.topic_id.is_nil() {
            t.topic_id = Default::default();
            changed = true;
        }
        let Some(name) = t.name.as_ref().map(|n| n.to_string()) else {
            continue;
        };
        for p in &mut t.partitions {
            if hidden.contains(&(name.clone(), p.partition_index)) {
                p.error_code = LEADER_NOT_AVAILABLE;
                p.leader_id = (-1).into();
                changed = true;
            }
        }
    }
    if !changed {
        return None;
    }
    faults.hidden_answers.fetch_add(1, Ordering::Relaxed);
    let mut out = BytesMut::new();
    header.encode(&mut out, header_version).ok()?;
    body.encode(&mut out, version).ok()?;
    Some(out.freeze())
}

/// The latest offset (the high watermark) of each of `topic`'s first `partitions`
/// partitions, asked of the broker at `broker` itself with a `ListOffsets` request (not
/// through the proxy, nor through the metadata, which names the proxy).
pub async fn latest_offsets(broker: &str, topic: &str, partitions: i32) -> Vec<i64> {
    use kafka_protocol::messages::list_offsets_request::{ListOffsetsPartition, ListOffsetsTopic};
    use kafka_protocol::messages::{ListOffsetsRequest, ListOffsetsResponse, TopicName};
    use kafka_protocol::protocol::StrBytes;
    let version = 1;
    let mut header = RequestHeader::default();
    header.request_api_key = ApiKey::ListOffsets as i16;
    header.request_api_version = version;
    header.correlation_id = 1;
    header.client_id = Some(StrBytes::from_static_str("mailroom-test"));
    let mut t = ListOffsetsTopic::default();
    t.name = TopicName(StrBytes::from_string(topic.to_string()));
    t.partitions = (0..partitions)
        .map(|p| {
            let mut lp = ListOffsetsPartition::default();
            lp.partition_index = p;
            lp.timestamp = -1;
            lp
        })
        .collect();
    let mut body = ListOffsetsRequest::default();
    body.replica_id = (-1).into();
    body.topics = vec![t];
    let mut out = BytesMut::new();
    header
        .encode(
            &mut out,
            ApiKey::ListOffsets.request_header_version(version),
        )
        .unwrap();
    body.encode(&mut out, version).unwrap();
    let mut conn = TcpStream::connect(broker).await.unwrap();
    conn.write_all(&framed(&out)).await.unwrap();
    let mut answer = frame(&mut conn).await.expect("a ListOffsets answer");
    ResponseHeader::decode(
        &mut answer,
        ApiKey::ListOffsets.response_header_version(version),
    )
    .unwrap();
    let r = ListOffsetsResponse::decode(&mut answer, version).unwrap();
    let mut offsets = vec![0; usize::try_from(partitions).unwrap()];
    for p in r.topics.iter().flat_map(|t| &t.partitions) {
        assert_eq!(
            p.error_code, 0,
            "ListOffsets of {topic}[{}]",
            p.partition_index
        );
        offsets[usize::try_from(p.partition_index).unwrap()] = p.offset;
    }
    offsets
}

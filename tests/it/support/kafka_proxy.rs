//! A Kafka protocol proxy for faults tansu never produces: it forwards every request and
//! response frame byte for byte, and decodes (with the `kafka-protocol` crate, at the
//! version each request names) only the responses it is told to change. Today that is
//! one fault: `hide_leader` makes `Metadata` answer that a partition has no leader
//! (`LEADER_NOT_AVAILABLE`, leader -1), as a real cluster does while a partition's
//! leader is down, so clients queue its records and keep asking. The broker behind it
//! must advertise the proxy's address (`Broker::start_advertising`), so that every
//! connection a client opens goes through the proxy.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kafka_protocol::messages::{ApiKey, MetadataResponse, ResponseHeader};
use kafka_protocol::protocol::{Decodable, Encodable};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Kafka's `LEADER_NOT_AVAILABLE`.
const LEADER_NOT_AVAILABLE: i16 = 5;

#[derive(Default)]
struct Faults {
    hidden: Mutex<HashSet<(String, i32)>>,
    /// Metadata responses in which a leader was hidden: proof that the fault fired.
    hidden_answers: AtomicU64,
}

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

    /// Every partition's leader is shown again.
    pub fn show_leaders(&self) {
        self.faults.hidden.lock().unwrap().clear();
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
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    // Correlation id -> (api key, version) of each request in flight.
    let pending: Arc<Mutex<HashMap<i32, (i16, i16)>>> = Arc::default();
    let p = pending.clone();
    let requests = async move {
        while let Some(f) = frame(&mut cr).await {
            if f.len() >= 8 {
                let mut h = f.clone();
                let (key, version, correlation) = (h.get_i16(), h.get_i16(), h.get_i32());
                p.lock().unwrap().insert(correlation, (key, version));
            }
            let mut out = BytesMut::with_capacity(f.len() + 4);
            out.put_i32(i32::try_from(f.len()).unwrap());
            out.put_slice(&f);
            if sw.write_all(&out).await.is_err() {
                return;
            }
        }
    };
    let responses = async move {
        while let Some(f) = frame(&mut sr).await {
            let correlation = f.clone().get_i32();
            let api = pending.lock().unwrap().remove(&correlation);
            let f = match api {
                Some((key, version)) if key == ApiKey::Metadata as i16 => {
                    rewrite_metadata(f.clone(), version, &faults).unwrap_or(f)
                }
                _ => f,
            };
            let mut out = BytesMut::with_capacity(f.len() + 4);
            out.put_i32(i32::try_from(f.len()).unwrap());
            out.put_slice(&f);
            if cw.write_all(&out).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = requests => {}
        _ = responses => {}
    }
}

/// The metadata response with the hidden partitions' leaders removed; `None` when
/// nothing is hidden there (the frame goes on untouched).
fn rewrite_metadata(mut f: Bytes, version: i16, faults: &Faults) -> Option<Bytes> {
    let hidden = faults.hidden.lock().unwrap().clone();
    if hidden.is_empty() {
        return None;
    }
    let header_version = ApiKey::Metadata.response_header_version(version);
    let header = ResponseHeader::decode(&mut f, header_version).ok()?;
    let mut body = MetadataResponse::decode(&mut f, version).ok()?;
    let mut changed = false;
    for t in &mut body.topics {
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

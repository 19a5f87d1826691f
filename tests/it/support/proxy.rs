//! A TCP proxy for fault injection: forwards 127.0.0.1:port to a target until `cut`,
//! which drops every open connection and refuses new ones until `restore`.
//!
//! For the fault suite it can also add latency (`set_delay`: every chunk waits that long
//! before it is forwarded, in both directions, order kept), drop the open connections
//! while still accepting new ones (`drop_connections`), and forward to another target
//! (`retarget`), or freeze every open connection without closing it (`stall`: bytes are
//! held, in order, until `unstall`; the peers see a silent network), or silence the open
//! connections for good while new ones work (`freeze_open`: a host that vanished
//! without a reset, its address taken over). By default none of that happens: it
//! forwards as it always did.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    pub port: u16,
    up: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    counter: Arc<AtomicU64>,
    delay_ms: Arc<AtomicU64>,
    target: Arc<Mutex<String>>,
    stalled: watch::Sender<bool>,
    /// `freeze_open` calls so far: a connection opened before the latest goes silent.
    frozen: watch::Sender<u64>,
    /// Chunks the frozen connections swallowed (proof the freeze bit).
    pub swallowed: Arc<AtomicU64>,
    /// Stalls so far, and chunks that a stall held back (proof that a stall bit).
    pub stalls: Arc<AtomicU64>,
    pub held_chunks: Arc<AtomicU64>,
    /// Connections open now, and connections a cut or a drop closed (proof a cut bit).
    open: Arc<AtomicU64>,
    pub dropped: Arc<AtomicU64>,
    /// Connections refused while the proxy was cut (proof the outage was met).
    pub refused: Arc<AtomicU64>,
}

/// A connection's silence: the freezes it was born after, and the swallowed-chunk count.
struct Silence {
    born: u64,
    frozen: watch::Receiver<u64>,
    swallowed: Arc<AtomicU64>,
}

/// Copies one direction, each chunk held back by the current delay, not forwarded while
/// the proxy is stalled, and never again once the connection is frozen.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_ms: Arc<AtomicU64>,
    mut stalled: watch::Receiver<bool>,
    held: Arc<AtomicU64>,
    silence: Silence,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if *silence.frozen.borrow() > silence.born {
            // Read and dropped: the peer's TCP stack acknowledges, nothing answers.
            silence.swallowed.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let d = delay_ms.load(Ordering::Relaxed);
        if d > 0 {
            tokio::time::sleep(Duration::from_millis(d)).await;
        }
        if *stalled.borrow() {
            held.fetch_add(1, Ordering::Relaxed);
            while *stalled.borrow_and_update() {
                if stalled.changed().await.is_err() {
                    return;
                }
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

impl Proxy {
    pub async fn start(target: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let (generation, _) = watch::channel(0u64);
        let (stalled, _) = watch::channel(false);
        let (frozen, _) = watch::channel(0u64);
        let swallowed = Arc::new(AtomicU64::new(0));
        let (frozen_tx, swallowed2) = (frozen.clone(), swallowed.clone());
        let held_chunks = Arc::new(AtomicU64::new(0));
        let open = Arc::new(AtomicU64::new(0));
        let open2 = open.clone();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let target = Arc::new(Mutex::new(target));
        let gen_tx = generation.clone();
        let stall_tx = stalled.clone();
        let held2 = held_chunks.clone();
        let up2 = up.clone();
        let refused = Arc::new(AtomicU64::new(0));
        let refused2 = refused.clone();
        let delay2 = delay_ms.clone();
        let target2 = target.clone();
        tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    break;
                };
                if !up2.load(Ordering::SeqCst) {
                    refused2.fetch_add(1, Ordering::SeqCst);
                    drop(inbound);
                    continue;
                }
                let target = target2.lock().unwrap().clone();
                let mut cut = gen_tx.subscribe();
                let (delay, stall, held) = (delay2.clone(), stall_tx.clone(), held2.clone());
                let silence = |frozen: &watch::Sender<u64>| Silence {
                    born: *frozen.borrow(),
                    frozen: frozen.subscribe(),
                    swallowed: swallowed2.clone(),
                };
                let (up_silence, down_silence) = (silence(&frozen_tx), silence(&frozen_tx));
                let open = open2.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    open.fetch_add(1, Ordering::SeqCst);
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let (ir, iw) = inbound.into_split();
                    let (or, ow) = outbound.into_split();
                    let up = tokio::spawn(pump(
                        ir,
                        ow,
                        delay.clone(),
                        stall.subscribe(),
                        held.clone(),
                        up_silence,
                    ));
                    let down =
                        tokio::spawn(pump(or, iw, delay, stall.subscribe(), held, down_silence));
                    let (a, b) = (up.abort_handle(), down.abort_handle());
                    tokio::select! {
                        _ = async { let _ = up.await; let _ = down.await; } => {}
                        _ = cut.changed() => {}
                    }
                    // Dropping the halves closes both sockets.
                    a.abort();
                    b.abort();
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Proxy {
            port,
            up,
            generation,
            counter: Arc::new(AtomicU64::new(0)),
            delay_ms,
            target,
            stalled,
            frozen,
            swallowed,
            stalls: Arc::new(AtomicU64::new(0)),
            held_chunks,
            open,
            dropped: Arc::new(AtomicU64::new(0)),
            refused,
        }
    }

    /// Freezes every connection, open or new: bytes are held, in order, not dropped.
    pub fn stall(&self) {
        self.stalls.fetch_add(1, Ordering::SeqCst);
        self.stalled.send_replace(true);
    }

    /// Silences every open connection for good, without closing it: what either side
    /// sends is read and dropped. New connections forward as before.
    pub fn freeze_open(&self) {
        self.frozen.send_modify(|n| *n += 1);
    }

    /// Forwards what a stall held, then everything as before.
    pub fn unstall(&self) {
        self.stalled.send_replace(false);
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.drop_connections();
    }

    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }

    /// Drops every open connection; new ones are still accepted (unless cut).
    pub fn drop_connections(&self) {
        self.dropped
            .fetch_add(self.open.load(Ordering::SeqCst), Ordering::SeqCst);
        let n = self.counter.fetch_add(1, Ordering::SeqCst) + 1;
        let _ = self.generation.send(n);
    }

    /// Holds every chunk back by `d` before forwarding it, for connections opened from
    /// now on. Zero (the default) forwards at once.
    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::Relaxed);
    }

    /// Forwards new connections to `target` from now on.
    pub fn retarget(&self, target: String) {
        *self.target.lock().unwrap() = target;
    }
}

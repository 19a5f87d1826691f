//! The gRPC port's connections (issue 43, item 2; docs/security.md, "Connections").
//!
//! tonic accepts every connection and keeps it for as long as the peer likes: a socket
//! that connects and never sends the HTTP/2 preface (or stops in the middle of a TLS
//! handshake, which tonic runs with no deadline) holds a descriptor and a task for good,
//! and 2,000 of them exhausted a 1,024-file limit. And an accept error such as `EMFILE`
//! ends tonic's accept loop, so the server stops. This module is the port's accept loop:
//! - **Handshake deadline.** A connection must speak within the handshake timeout: at
//!   least the 24 bytes of the HTTP/2 preface, and at least one byte after mailroom's
//!   first write (the client's answer to the server's SETTINGS, or its second TLS
//!   flight). Otherwise it is closed. What it says after that is HTTP/2's business
//!   (keep-alive pings find dead peers; `max_concurrent_streams` bounds its streams).
//! - **Connection cap.** At most `max_connections` are open, and never more than half
//!   the process's open-file limit (the rest is for the database, the broker and the
//!   side ports). At the cap, the oldest connection that has not spoken yet is closed to
//!   make room, so silent sockets cannot lock out a client that speaks; with none to
//!   close, the new connection is refused. Both are logged, at most once a second.
//! - **Accept errors** (out of descriptors, of memory) are logged and waited out; the
//!   loop never ends but at shutdown.
//! - **TCP keep-alive** on every accepted socket.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Bytes of the HTTP/2 connection preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`).
const PREFACE: usize = 24;

/// How long an accepted socket may be idle before TCP keep-alive probes it.
pub const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// The port's connection limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once (further bounded by half the open-file limit).
    pub max_connections: usize,
    /// How long a new connection has to speak (see the module's doc).
    pub handshake_timeout: Duration,
    /// HTTP/2 streams at once on one connection.
    pub max_concurrent_streams: u32,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 1000,
            handshake_timeout: Duration::from_secs(5),
            max_concurrent_streams: 100,
        }
    }
}

impl ConnectionLimits {
    /// The cap in force: the setting, and at most half of `open_files` (the soft
    /// open-file limit, when known).
    pub fn effective_cap(&self, open_files: Option<u64>) -> usize {
        match open_files {
            Some(n) => self
                .max_connections
                .min(usize::try_from(n / 2).unwrap_or(usize::MAX))
                .max(1),
            None => self.max_connections.max(1),
        }
    }
}

/// The soft limit on open files of this process (Linux: `/proc/self/limits`).
pub fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// One connection's handshake, as the accept loop sees it.
#[derive(Default)]
struct Handshake {
    spoken: AtomicBool,
    evicted: AtomicBool,
    waker: AtomicWaker,
}

/// What the accept loop keeps between connections.
struct Registry {
    cap: usize,
    open: Arc<AtomicUsize>,
    /// Connections in accept order that may not have spoken yet (pruned lazily).
    unspoken: Mutex<VecDeque<Weak<Handshake>>>,
    last_log: Mutex<Option<Instant>>,
    quiet: AtomicUsize,
}

impl Registry {
    /// Closes the oldest connection that has not spoken; whether there was one.
    fn evict_one(&self) -> bool {
        let mut q = self.unspoken.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(w) = q.pop_front() {
            if let Some(h) = w.upgrade()
                && !h.spoken.load(Ordering::Acquire)
                && !h.evicted.swap(true, Ordering::AcqRel)
            {
                h.waker.wake();
                return true;
            }
        }
        false
    }

    fn remember(&self, h: &Arc<Handshake>) {
        let mut q = self.unspoken.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= 4 * self.cap {
            q.retain(|w| {
                w.upgrade()
                    .is_some_and(|h| !h.spoken.load(Ordering::Acquire))
            });
        }
        q.push_back(Arc::downgrade(h));
    }

    /// Logs `what` at most once a second, with how many were left unsaid.
    fn warn(&self, what: &str, detail: &dyn std::fmt::Display) {
        let mut last = self.last_log.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            self.quiet.fetch_add(1, Ordering::Relaxed);
            return;
        }
        *last = Some(Instant::now());
        let also = self.quiet.swap(0, Ordering::Relaxed);
        tracing::warn!(
            cap = self.cap,
            open = self.open.load(Ordering::Relaxed),
            also_since_last_line = also,
            "{what}: {detail}"
        );
    }
}

/// The accepted connections of `listener`, guarded as the module's doc says, until
/// `shutdown`; for `serve_with_incoming_shutdown`. Never yields an error.
pub fn incoming(
    listener: TcpListener,
    limits: ConnectionLimits,
    shutdown: tokio_util::sync::CancellationToken,
) -> impl Stream<Item = Result<Guarded, io::Error>> {
    let cap = limits.effective_cap(open_file_limit());
    if cap < limits.max_connections {
        tracing::info!(
            cap,
            setting = limits.max_connections,
            "gRPC connections capped at half the open-file limit (raise it with `ulimit -n`)"
        );
    }
    let registry = Arc::new(Registry {
        cap,
        open: Arc::new(AtomicUsize::new(0)),
        unspoken: Mutex::new(VecDeque::new()),
        last_log: Mutex::new(None),
        quiet: AtomicUsize::new(0),
    });
    futures::stream::unfold(
        (listener, registry, limits, shutdown),
        |(listener, registry, limits, shutdown)| async move {
            loop {
                let accepted = tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    a = listener.accept() => a,
                };
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors or memory: wait rather than spin or stop.
                        registry.warn("accepting a gRPC connection failed", &e);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if registry.open.load(Ordering::Acquire) >= registry.cap {
                    if registry.evict_one() {
                        registry.warn(
                            "gRPC connection cap reached: closed the oldest connection that had not spoken",
                            &peer,
                        );
                    } else {
                        registry.warn("gRPC connection refused: connection cap reached", &peer);
                        drop(stream);
                        continue;
                    }
                }
                let _ = stream.set_nodelay(true);
                let keepalive = socket2::TcpKeepalive::new()
                    .with_time(TCP_KEEPALIVE)
                    .with_interval(Duration::from_secs(10));
                let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
                let shake = Arc::new(Handshake::default());
                registry.remember(&shake);
                registry.open.fetch_add(1, Ordering::AcqRel);
                let guarded = Guarded {
                    inner: stream,
                    shake,
                    deadline: Some(Box::pin(tokio::time::sleep(limits.handshake_timeout))),
                    read: 0,
                    read_after_write: 0,
                    wrote: false,
                    open: registry.open.clone(),
                };
                return Some((Ok(guarded), (listener, registry, limits, shutdown)));
            }
        },
    )
}

/// An accepted connection that must speak before its deadline (see the module's doc).
pub struct Guarded {
    inner: TcpStream,
    shake: Arc<Handshake>,
    /// `None` once the connection has spoken.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    read: usize,
    read_after_write: usize,
    wrote: bool,
    open: Arc<AtomicUsize>,
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Guarded {
    /// Whether the handshake is over or must end now (the error to return then).
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let Some(deadline) = self.deadline.as_mut() else {
            return Ok(());
        };
        self.shake.waker.register(cx.waker());
        if self.shake.evicted.load(Ordering::Acquire) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "closed to make room: the connection cap was reached before it spoke",
            ));
        }
        if deadline.as_mut().poll(cx).is_ready() {
            tracing::debug!(
                peer = ?self.inner.peer_addr().ok(),
                read = self.read,
                "closing a gRPC connection that did not complete its handshake in time"
            );
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no HTTP/2 preface or TLS handshake before the handshake timeout",
            ));
        }
        Ok(())
    }

    fn heard(&mut self, n: usize) {
        if self.deadline.is_none() {
            return;
        }
        self.read += n;
        if self.wrote {
            self.read_after_write += n;
        }
        if self.read >= PREFACE && self.read_after_write > 0 {
            self.deadline = None;
            self.shake.spoken.store(true, Ordering::Release);
        }
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Err(e) = this.check(cx) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            this.heard(buf.filled().len() - before);
        }
        r
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.wrote = true;
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.wrote = true;
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_half_the_open_files_to_the_rest() {
        let l = ConnectionLimits::default();
        assert_eq!(l.effective_cap(Some(1024)), 512);
        assert_eq!(l.effective_cap(Some(1_048_576)), 1000);
        assert_eq!(l.effective_cap(None), 1000);
        assert_eq!(l.effective_cap(Some(1)), 1);
        assert!(open_file_limit().is_some_and(|n| n > 0));
    }
}

//! Admission by what a request becomes (issue 25, item 4; issue 43, item 1): the count
//! of RPCs in flight (`overload`) does not bound memory, since one `EnqueueBatch` may
//! carry up to `max_batch_bytes` (64 MiB by default), gzip shrinks that a thousandfold on
//! the wire, and two wire bytes (`0a 00`) decode to an `Event` of some 200 bytes. This
//! layer watches every request body as it arrives, before tonic decodes it:
//!
//! - A compressed message is decompressed here too, piece by piece, and what comes out
//!   is what counts (tonic decompresses the whole message again once it has it all;
//!   this layer refuses before that).
//! - The method's `Rule` gives its byte limit (of the decompressed message, and twice
//!   that for what it decodes to) and the shape of its repeated fields: `walk` counts
//!   their elements (refused at `max + 1`) and what each costs beyond its bytes.
//! - Every request holds a `Charge` on the server's budget of request bytes in flight
//!   (`max_request_bytes_in_flight`), raised as the bytes arrive to what the request
//!   holds in memory at once: what tonic buffers (wire bytes, and the decompressed copy),
//!   plus what prost builds. Nothing is reserved for a length merely declared. When the
//!   budget cannot cover the next bytes, the answer is `RESOURCE_EXHAUSTED` with a retry
//!   delay; the charge returns to the budget when the RPC has answered (the decoded
//!   events live as long), or at once when the request is refused.
//! - A message must arrive whole within `body_timeout` (for a unary request, the body
//!   must end within it): a stream that declares a length and stalls is answered
//!   `UNAVAILABLE` and gives back its charge and its RPC slot.
//!
//! Health checks bypass it.

use std::collections::HashMap;
use std::future::Future;
use std::io::Write as _;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::codegen::http;
use tower::{Layer, Service};

use super::walk::{Counted, OPAQUE, Shape, TooMany, Walker};

/// The gRPC message prefix: a compression flag and a 4-byte big-endian length.
const PREFIX: usize = 5;
/// tonic's decoding limit for a service that sets none.
pub const DEFAULT_LIMIT: usize = 4 * 1024 * 1024;

/// What one method's request may cost.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Largest message, in bytes once decompressed; what it decodes to may take twice
    /// this.
    pub limit: usize,
    /// The request, and the setting of its limit, as a refusal names them ("EnqueueBatch
    /// request; the limit is MAILROOM_MAX_BATCH_BYTES").
    pub what: String,
    /// Its repeated fields, for the walker.
    pub shape: &'static Shape,
    /// The field whose elements are limited in number, if any.
    pub counted: Option<Counted>,
    /// A client stream (several messages): the body deadline applies to each message,
    /// not to the whole body.
    pub streaming: bool,
}

impl Rule {
    /// A rule with nothing to count.
    pub fn opaque(limit: usize, what: impl Into<String>) -> Rule {
        Rule {
            limit,
            what: what.into(),
            shape: &OPAQUE,
            counted: None,
            streaming: false,
        }
    }
}

/// The rule of each method, by path (`/package.Service/Method`), and the one of the
/// others.
#[derive(Debug, Clone)]
pub struct Rules {
    methods: HashMap<String, Arc<Rule>>,
    others: Arc<Rule>,
}

impl Rules {
    /// `others` for every method not given a rule with `with`.
    pub fn new(others: Rule) -> Rules {
        Rules {
            methods: HashMap::new(),
            others: Arc::new(others),
        }
    }

    /// `rule` for the method at `path`.
    pub fn with(mut self, path: &str, rule: Rule) -> Rules {
        self.methods.insert(path.to_string(), Arc::new(rule));
        self
    }

    fn of(&self, path: &str) -> Arc<Rule> {
        self.methods.get(path).unwrap_or(&self.others).clone()
    }
}

/// The budget of request bytes in flight, shared by every connection, and each method's
/// rule.
#[derive(Clone)]
pub struct ByteAdmissionLayer {
    budget: Option<Arc<Semaphore>>,
    total: u32,
    rules: Arc<Rules>,
    body_timeout: Option<Duration>,
}

impl ByteAdmissionLayer {
    /// A budget of `bytes` (0: no limit), messages due within `body_timeout`.
    pub fn new(bytes: usize, body_timeout: Option<Duration>, rules: Rules) -> Self {
        let total = u32::try_from(bytes.min(Semaphore::MAX_PERMITS)).unwrap_or(u32::MAX);
        ByteAdmissionLayer {
            budget: (bytes > 0).then(|| Arc::new(Semaphore::new(total as usize))),
            total,
            rules: Arc::new(rules),
            body_timeout,
        }
    }
}

impl<S> Layer<S> for ByteAdmissionLayer {
    type Service = ByteAdmission<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ByteAdmission {
            inner,
            layer: self.clone(),
        }
    }
}

/// See the module documentation.
#[derive(Clone)]
pub struct ByteAdmission<S> {
    inner: S,
    layer: ByteAdmissionLayer,
}

type Answer<RB, E> = Pin<Box<dyn Future<Output = Result<http::Response<RB>, E>> + Send>>;

impl<S, RB> Service<http::Request<Body>> for ByteAdmission<S>
where
    S: Service<http::Request<Body>, Response = http::Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = Answer<RB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let path = req.uri().path();
        if path.starts_with("/grpc.health.v1.Health/") {
            return Box::pin(self.inner.call(req));
        }
        let l = &self.layer;
        let rule = l.rules.of(path);
        let encoding = Encoding::of(req.headers());
        let charge = Arc::new(Charge {
            budget: l.budget.clone(),
            total: l.total,
            held: Mutex::new(0),
        });
        let (parts, body) = req.into_parts();
        let gate = Gate {
            rule,
            encoding,
            charge: charge.clone(),
            state: State::Prefix {
                head: [0; PREFIX],
                have: 0,
            },
            started: false,
        };
        let body = Body::new(GateBody::new(body, gate, l.body_timeout));
        let answer = self.inner.call(http::Request::from_parts(parts, body));
        Box::pin(async move {
            let answer = answer.await;
            // The decoded request lived until here.
            drop(charge);
            answer
        })
    }
}

/// Why a request is refused while it arrives.
#[derive(Debug)]
enum Refusal {
    /// Too many elements in a counted field.
    TooMany(TooMany),
    /// Over the method's byte limit (`decoded`: what the message decodes to).
    TooLarge {
        limit: usize,
        what: String,
        decoded: bool,
    },
    /// The budget of bytes in flight cannot cover the request.
    Busy { total: u32 },
    /// The message did not arrive within the body deadline.
    Stalled(Duration),
    /// A compressed message that does not decompress.
    Undecodable(String),
}

impl Refusal {
    fn status(self) -> tonic::Status {
        use crate::api::status::{RETRY_OVERLOADED, reason, status, too_large};
        match self {
            Refusal::TooMany(t) => crate::error::Error::invalid(
                t.name,
                format!("at most {} per request ({})", t.max, t.rule),
            )
            .into(),
            Refusal::TooLarge {
                limit,
                what,
                decoded: false,
            } => too_large(
                format!("the request is over the {limit}-byte limit of an {what}"),
                limit,
            ),
            Refusal::TooLarge {
                limit,
                what,
                decoded: true,
            } => too_large(
                format!(
                    "the request would take more than {} bytes once decoded, twice the \
                     {limit}-byte limit of an {what}",
                    limit.saturating_mul(2)
                ),
                limit,
            ),
            Refusal::Busy { total } => status(
                tonic::Code::ResourceExhausted,
                format!(
                    "server busy: the request would take the requests in flight over \
                     MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT ({total} bytes, counted as \
                     decompressed and decoded); retry with backoff"
                ),
                reason::SERVER_BUSY,
                Default::default(),
                Some(RETRY_OVERLOADED),
            ),
            Refusal::Stalled(t) => status(
                tonic::Code::Unavailable,
                format!(
                    "the request body did not arrive within {} ms \
                     (MAILROOM_REQUEST_BODY_TIMEOUT_MS); retry",
                    t.as_millis()
                ),
                reason::SERVER_TIMEOUT,
                Default::default(),
                Some(RETRY_OVERLOADED),
            ),
            Refusal::Undecodable(m) => status(
                tonic::Code::Internal,
                format!("the request does not decompress: {m}"),
                reason::INVALID_ARGUMENT,
                Default::default(),
                None,
            ),
        }
    }
}

/// One request's share of the budget: raised as the request grows, returned whole.
struct Charge {
    budget: Option<Arc<Semaphore>>,
    total: u32,
    held: Mutex<u32>,
}

/// The last eighth of the budget is kept for small requests (those holding at most a
/// quarter of it: an ordinary Enqueue), so that large ones never leave them nothing.
fn reserve(total: u32) -> u32 {
    total / 8
}

impl Charge {
    /// Holds `want` bytes in all. A request larger than the budget less its reserve is
    /// held at that: it is admitted alone.
    fn to(&self, want: u64) -> Result<(), Refusal> {
        let Some(budget) = &self.budget else {
            return Ok(());
        };
        let reserve = reserve(self.total);
        let large = want > u64::from(reserve / 4);
        let cap = if large {
            self.total - reserve
        } else {
            self.total
        };
        let want = u32::try_from(want.min(u64::from(cap))).unwrap_or(cap);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if want <= *held {
            return Ok(());
        }
        // A large request takes its bytes only while the reserve stays free: it takes
        // the reserve too, and gives it back at once.
        let extra = if large { reserve } else { 0 };
        match budget.try_acquire_many(want - *held + extra) {
            Ok(p) => {
                p.forget();
                budget.add_permits(extra as usize);
                *held = want;
                Ok(())
            }
            Err(_) => Err(Refusal::Busy { total: self.total }),
        }
    }

    fn release(&self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = &self.budget {
            b.add_permits(*held as usize);
        }
        *held = 0;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
    }
}

/// The request's `grpc-encoding`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Encoding {
    Identity,
    Gzip,
    Deflate,
    Zstd,
    /// One tonic refuses (`UNIMPLEMENTED`) before reading the body.
    Other,
}

impl Encoding {
    fn of(headers: &http::HeaderMap) -> Encoding {
        match headers.get("grpc-encoding").map(|v| v.as_bytes()) {
            None | Some(b"identity") => Encoding::Identity,
            Some(b"gzip") => Encoding::Gzip,
            Some(b"deflate") => Encoding::Deflate,
            Some(b"zstd") => Encoding::Zstd,
            Some(_) => Encoding::Other,
        }
    }
}

/// What a message costs so far.
struct Meter {
    walker: Walker,
    rule: Arc<Rule>,
    charge: Arc<Charge>,
    compressed: bool,
    wire: u64,
    decoded: u64,
}

impl Meter {
    /// `n` more compressed bytes, which tonic buffers until the message is whole.
    fn wire(&mut self, n: usize) -> Result<(), Refusal> {
        self.wire += n as u64;
        self.charge()
    }

    /// The next bytes of the (decompressed) message.
    fn decoded(&mut self, b: &[u8]) -> Result<(), Refusal> {
        self.decoded += b.len() as u64;
        let limit = self.rule.limit as u64;
        if self.decoded > limit {
            return Err(self.too_large(false));
        }
        self.walker.feed(b).map_err(Refusal::TooMany)?;
        if self.decoded + self.walker.overhead() > limit.saturating_mul(2) {
            return Err(self.too_large(true));
        }
        self.charge()
    }

    fn too_large(&self, decoded: bool) -> Refusal {
        Refusal::TooLarge {
            limit: self.rule.limit,
            what: self.rule.what.clone(),
            decoded,
        }
    }

    /// What the request holds at once: what tonic buffers (the message, and first its
    /// compressed form), and what prost builds from it (each byte again, and the
    /// elements' own size).
    fn charge(&self) -> Result<(), Refusal> {
        let buffered = if self.compressed {
            self.wire + self.decoded
        } else {
            self.decoded
        };
        let built = self.decoded + self.walker.overhead();
        self.charge.to(buffered.saturating_add(built))
    }
}

/// Where a decompressor's output goes: into the meter.
struct Sink {
    meter: Meter,
    refused: Option<Refusal>,
}

impl std::io::Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self.meter.decoded(b) {
            Ok(()) => Ok(b.len()),
            Err(r) => {
                self.refused = Some(r);
                Err(std::io::Error::other("refused"))
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// How a message's bytes reach the meter.
enum Reading {
    Plain(Meter),
    Gzip(flate2::write::GzDecoder<Sink>),
    /// gRPC's `deflate` is zlib's format (tonic reads it with `ZlibDecoder`).
    Deflate(flate2::write::ZlibDecoder<Sink>),
    Zstd(Box<zstd::stream::write::Decoder<'static, Sink>>),
    /// Compressed with no usable encoding: tonic refuses it without decompressing; only
    /// its wire bytes count.
    Opaque(Meter),
}

impl Reading {
    fn new(meter: Meter, encoding: Encoding) -> Result<Reading, Refusal> {
        let sink = |meter| Sink {
            meter,
            refused: None,
        };
        Ok(match encoding {
            Encoding::Gzip => Reading::Gzip(flate2::write::GzDecoder::new(sink(meter))),
            Encoding::Deflate => Reading::Deflate(flate2::write::ZlibDecoder::new(sink(meter))),
            Encoding::Zstd => Reading::Zstd(Box::new(
                zstd::stream::write::Decoder::new(sink(meter))
                    .map_err(|e| Refusal::Undecodable(e.to_string()))?,
            )),
            Encoding::Identity | Encoding::Other => Reading::Opaque(meter),
        })
    }

    fn sink(&mut self) -> Option<&mut Sink> {
        match self {
            Reading::Gzip(d) => Some(d.get_mut()),
            Reading::Deflate(d) => Some(d.get_mut()),
            Reading::Zstd(d) => Some(d.get_mut()),
            Reading::Plain(_) | Reading::Opaque(_) => None,
        }
    }

    /// The next bytes of the message, as they came on the wire.
    fn feed(&mut self, b: &[u8]) -> Result<(), Refusal> {
        let written = match self {
            Reading::Plain(m) => return m.decoded(b),
            Reading::Opaque(m) => return m.wire(b.len()),
            Reading::Gzip(d) => {
                d.get_mut().meter.wire(b.len())?;
                d.write_all(b)
            }
            Reading::Deflate(d) => {
                d.get_mut().meter.wire(b.len())?;
                d.write_all(b)
            }
            Reading::Zstd(d) => {
                d.get_mut().meter.wire(b.len())?;
                d.write_all(b)
            }
        };
        self.settle(written)
    }

    /// The message is complete: what the decompressor still holds comes out.
    fn finish(&mut self) -> Result<(), Refusal> {
        let done = match self {
            Reading::Plain(_) | Reading::Opaque(_) => return Ok(()),
            Reading::Gzip(d) => d.try_finish(),
            Reading::Deflate(d) => d.try_finish(),
            Reading::Zstd(d) => d.flush(),
        };
        self.settle(done)
    }

    fn settle(&mut self, r: std::io::Result<()>) -> Result<(), Refusal> {
        match r {
            Ok(()) => Ok(()),
            Err(e) => Err(self
                .sink()
                .and_then(|s| s.refused.take())
                .unwrap_or_else(|| Refusal::Undecodable(e.to_string()))),
        }
    }
}

enum State {
    /// Reading a message's prefix.
    Prefix { head: [u8; PREFIX], have: usize },
    /// Inside a message, `left` wire bytes to come.
    Message { left: u64, reading: Box<Reading> },
}

/// The inspection of one request body, message by message.
struct Gate {
    rule: Arc<Rule>,
    encoding: Encoding,
    charge: Arc<Charge>,
    state: State,
    /// A message has begun.
    started: bool,
}

impl Gate {
    /// The next bytes of the body.
    fn inspect(&mut self, mut data: &[u8]) -> Result<(), Refusal> {
        while !data.is_empty() {
            match &mut self.state {
                State::Prefix { head, have } => {
                    let n = (PREFIX - *have).min(data.len());
                    head[*have..*have + n].copy_from_slice(&data[..n]);
                    *have += n;
                    data = &data[n..];
                    if *have == PREFIX {
                        let head = *head;
                        self.begin(&head)?;
                    }
                }
                State::Message { left, reading } => {
                    let n = usize::try_from(*left).map_or(data.len(), |l| l.min(data.len()));
                    reading.feed(&data[..n])?;
                    *left -= n as u64;
                    data = &data[n..];
                    if *left == 0 {
                        reading.finish()?;
                        self.between();
                    }
                }
            }
        }
        Ok(())
    }

    fn begin(&mut self, head: &[u8; PREFIX]) -> Result<(), Refusal> {
        // The stream's earlier message was decoded before this one is read: what it
        // charged is given back (a unary request has one message).
        if self.started {
            self.charge.release();
        }
        self.started = true;
        let len = u64::from(u32::from_be_bytes([head[1], head[2], head[3], head[4]]));
        if len > self.rule.limit as u64 {
            return Err(Refusal::TooLarge {
                limit: self.rule.limit,
                what: self.rule.what.clone(),
                decoded: false,
            });
        }
        let compressed = head[0] == 1;
        let meter = Meter {
            walker: Walker::new(self.rule.shape, self.rule.counted),
            rule: self.rule.clone(),
            charge: self.charge.clone(),
            compressed,
            wire: 0,
            decoded: 0,
        };
        let mut reading = if compressed {
            Reading::new(meter, self.encoding)?
        } else {
            Reading::Plain(meter)
        };
        if len == 0 {
            reading.finish()?;
            self.between();
        } else {
            self.state = State::Message {
                left: len,
                reading: Box::new(reading),
            };
        }
        Ok(())
    }

    fn between(&mut self) {
        self.state = State::Prefix {
            head: [0; PREFIX],
            have: 0,
        };
    }

    /// Between two messages: the stream owes nothing yet.
    fn idle(&self) -> bool {
        matches!(self.state, State::Prefix { have: 0, .. })
    }
}

/// The request body, inspected by a `Gate` on its way to tonic, with the body deadline.
struct GateBody {
    inner: Body,
    gate: Gate,
    timeout: Option<Duration>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    done: bool,
}

impl GateBody {
    fn new(inner: Body, gate: Gate, timeout: Option<Duration>) -> Self {
        GateBody {
            inner,
            gate,
            timeout,
            deadline: timeout.map(|t| Box::pin(tokio::time::sleep(t))),
            done: false,
        }
    }

    fn refuse(
        &mut self,
        r: Refusal,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        tracing::debug!(refusal = ?r, "request refused while it arrived");
        self.done = true;
        self.deadline = None;
        self.gate.charge.release();
        Poll::Ready(Some(Err(r.status())))
    }

    /// A stream's deadline runs while a message is incomplete; a unary request's until
    /// its body ends.
    fn rearm(&mut self) {
        if !self.gate.rule.streaming {
            return;
        }
        if self.gate.idle() {
            self.deadline = None;
        } else if self.deadline.is_none() {
            self.deadline = self.timeout.map(|t| Box::pin(tokio::time::sleep(t)));
        }
    }
}

impl http_body::Body for GateBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(d) = &mut this.deadline
            && d.as_mut().poll(cx).is_ready()
        {
            let t = this.timeout.unwrap_or_default();
            return this.refuse(Refusal::Stalled(t));
        }
        match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            None => {
                this.done = true;
                this.deadline = None;
                Poll::Ready(None)
            }
            Some(Err(e)) => Poll::Ready(Some(Err(e))),
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref()
                    && let Err(r) = this.gate.inspect(data)
                {
                    return this.refuse(r);
                }
                this.rearm();
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(rule: Rule, encoding: Encoding, budget: usize) -> Gate {
        Gate {
            rule: Arc::new(rule),
            encoding,
            charge: Arc::new(Charge {
                budget: Some(Arc::new(Semaphore::new(budget))),
                total: u32::try_from(budget).unwrap(),
                held: Mutex::new(0),
            }),
            state: State::Prefix {
                head: [0; PREFIX],
                have: 0,
            },
            started: false,
        }
    }

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut v = vec![flag];
        v.extend(u32::try_from(message.len()).unwrap().to_be_bytes());
        v.extend(message);
        v
    }

    fn gzip(b: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(b).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn compressed_bytes_are_charged_as_decompressed_and_decoded() {
        let message = vec![0u8; 100_000];
        let body = framed(1, &gzip(&message));
        // 100,000 decompressed bytes held twice, plus the compressed bytes: more than
        // 200,000. Alone, it holds the budget less the reserve; beside another request,
        // it is refused.
        let mut g = gate(Rule::opaque(1 << 20, "x"), Encoding::Gzip, 1 << 20);
        g.inspect(&body).unwrap();
        assert!(*g.charge.held.lock().unwrap() > 200_000);
        let mut g = gate(Rule::opaque(1 << 20, "x"), Encoding::Gzip, 160_000);
        g.inspect(&body).unwrap();
        assert_eq!(*g.charge.held.lock().unwrap(), 140_000);
        let mut g = gate(Rule::opaque(1 << 20, "x"), Encoding::Gzip, 160_000);
        let other = g.charge.budget.clone().unwrap().try_acquire_many_owned(1);
        assert!(matches!(g.inspect(&body), Err(Refusal::Busy { .. })));
        drop(other);
    }

    #[test]
    fn large_requests_leave_the_reserve_to_small_ones() {
        let budget = Arc::new(Semaphore::new(800));
        let charge = |_| Charge {
            budget: Some(budget.clone()),
            total: 800,
            held: Mutex::new(0),
        };
        let (large, small) = (charge(()), charge(()));
        large.to(650).unwrap();
        // 150 left: a large request may not take the last 100, a small one may.
        assert!(matches!(charge(()).to(60), Err(Refusal::Busy { .. })));
        small.to(25).unwrap();
        small.to(25).unwrap();
        assert!(matches!(charge(()).to(26), Err(Refusal::Busy { .. })));
        drop(small);
        assert_eq!(budget.available_permits(), 150);
        large.release();
        assert_eq!(budget.available_permits(), 800);
    }

    #[test]
    fn a_declared_length_reserves_nothing() {
        let mut g = gate(Rule::opaque(64 << 20, "x"), Encoding::Identity, 1 << 20);
        g.inspect(&[0, 4, 0, 0, 0, 1, 2, 3]).unwrap();
        assert_eq!(*g.charge.held.lock().unwrap(), 6);
    }

    #[test]
    fn a_compressed_message_is_refused_at_the_limit_while_it_decompresses() {
        let body = framed(1, &gzip(&vec![0u8; 10_000_000]));
        let mut g = gate(Rule::opaque(1_000_000, "x"), Encoding::Gzip, 1 << 30);
        match g.inspect(&body) {
            Err(Refusal::TooLarge { decoded: false, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(*g.charge.held.lock().unwrap() < 3_000_000);
    }

    #[test]
    fn garbage_does_not_decompress() {
        let body = framed(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let mut g = gate(Rule::opaque(1 << 20, "x"), Encoding::Gzip, 1 << 20);
        assert!(matches!(g.inspect(&body), Err(Refusal::Undecodable(_))));
    }
}

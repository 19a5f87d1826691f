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
//! - While a message is incomplete (for a unary request, until its body ends), its
//!   bytes may pause at most `body_timeout`: a stream that declares a length and
//!   stalls is answered `UNAVAILABLE` and gives back its charge and its RPC slot. The
//!   deadline bounds a pause, not the transfer, so a large batch on a slow link passes;
//!   a client that trickles is bounded by the RPC deadline.
//!
//! Health checks bypass it.

use std::collections::HashMap;
use std::future::Future;
use std::io::Write as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Semaphore;
use tonic::body::Body;
use tonic::codegen::http;
use tower::{Layer, Service};

use super::shares::{Shares, principal_of};
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
    budget: Option<Arc<Budget>>,
    rules: Arc<Rules>,
    body_timeout: Option<Duration>,
}

impl ByteAdmissionLayer {
    /// A budget of `bytes` (0: no limit), each principal holding at most its share of
    /// it, messages due within `body_timeout`.
    pub fn new(
        bytes: usize,
        shares: Option<Arc<Shares>>,
        body_timeout: Option<Duration>,
        rules: Rules,
    ) -> Self {
        let total = u32::try_from(bytes.min(Semaphore::MAX_PERMITS)).unwrap_or(u32::MAX);
        ByteAdmissionLayer {
            budget: (bytes > 0).then(|| Arc::new(Budget::new(total, shares))),
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
        let charge = Arc::new(Charge::new(
            l.budget.clone(),
            principal_of(req.extensions()),
        ));
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
    /// The caller's other requests hold its share of the budget.
    Share { percent: u32 },
    /// The message's bytes paused longer than the body deadline.
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
            Refusal::Share { percent } => status(
                tonic::Code::ResourceExhausted,
                format!(
                    "server busy for this caller: its requests in flight hold its share \
                     of MAILROOM_MAX_REQUEST_BYTES_IN_FLIGHT ({percent} %, \
                     MAILROOM_PRINCIPAL_SHARE_PERCENT); retry with backoff"
                ),
                reason::SERVER_BUSY,
                Default::default(),
                Some(RETRY_OVERLOADED),
            ),
            Refusal::Stalled(t) => status(
                tonic::Code::Unavailable,
                format!(
                    "the request body stopped arriving for {} ms before it was whole \
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

/// The server's budget of request bytes in flight, shared by every connection.
pub struct Budget {
    /// What any request may take: the total less the reserve.
    open: Semaphore,
    /// The last eighth of the total, kept for small requests (those holding at most a
    /// quarter of it: an ordinary Enqueue), so that large ones never leave them nothing.
    reserve: Semaphore,
    reserve_total: u32,
    total: u32,
    /// Whether a request waits for bytes. Requests take the budget piece by piece as
    /// they arrive, so two large ones could each hold half and wait for the other: one
    /// waits (first in line for what is given back), the others are refused at once and
    /// give back what they hold.
    waiting: AtomicBool,
    /// Each principal's share.
    shares: Option<Arc<Shares>>,
}

impl Budget {
    /// A budget of `total` bytes, each principal holding at most its share of it.
    pub fn new(total: u32, shares: Option<Arc<Shares>>) -> Budget {
        let reserve_total = total / 8;
        Budget {
            open: Semaphore::new((total - reserve_total) as usize),
            reserve: Semaphore::new(reserve_total as usize),
            reserve_total,
            total,
            waiting: AtomicBool::new(false),
            shares,
        }
    }

    fn busy(&self) -> Refusal {
        Refusal::Busy { total: self.total }
    }
}

/// Gives the waiting place back.
struct WaitingPlace(Arc<Budget>);

impl Drop for WaitingPlace {
    fn drop(&mut self) {
        self.0.waiting.store(false, Ordering::Release);
    }
}

/// One request's share of the budget: what the request has cost so far (`want`), of
/// which `open` and `reserve` are covered; returned whole.
struct Charge {
    budget: Option<Arc<Budget>>,
    /// The principal, when shares apply.
    who: Option<Arc<str>>,
    held: Mutex<Held>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Held {
    want: u32,
    open: u32,
    reserve: u32,
    /// Counted in the principal's share.
    shared: u64,
}

/// What covering a request's cost came to.
enum Cover {
    Covered,
    /// `n` more bytes, waited for in the waiting place.
    Wait(WaitingPlace, u32),
    Refused(Refusal),
}

impl Charge {
    fn new(budget: Option<Arc<Budget>>, who: Option<Arc<str>>) -> Charge {
        Charge {
            budget,
            who,
            held: Mutex::new(Held::default()),
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The request costs `want` bytes in all so far. A request larger than the budget
    /// less its reserve costs that: it is admitted alone.
    fn want(&self, want: u64) {
        let Some(budget) = &self.budget else { return };
        let cap = budget.total - budget.reserve_total;
        let want = u32::try_from(want.min(u64::from(cap))).unwrap_or(cap);
        let mut h = self.held();
        h.want = h.want.max(want);
    }

    /// Takes from the budget what the cost has grown to: at once, else as the one
    /// request waiting (a large one), else refused.
    fn cover(&self) -> Cover {
        let Some(budget) = &self.budget else {
            return Cover::Covered;
        };
        let mut h = self.held();
        let need = h.want.saturating_sub(h.open + h.reserve);
        if need == 0 {
            return Cover::Covered;
        }
        if let (Some(shares), Some(who)) = (&budget.shares, &self.who) {
            let more = u64::from(h.want).saturating_sub(h.shared);
            if more > 0 {
                if !shares.take_bytes(who, h.shared, more, u64::from(budget.total)) {
                    return Cover::Refused(Refusal::Share {
                        percent: shares.percent(),
                    });
                }
                h.shared += more;
            }
        }
        if let Ok(p) = budget.open.try_acquire_many(need) {
            p.forget();
            h.open += need;
            return Cover::Covered;
        }
        let small = h.want <= budget.reserve_total / 4;
        if small {
            return match budget.reserve.try_acquire_many(need) {
                Ok(p) => {
                    p.forget();
                    h.reserve += need;
                    Cover::Covered
                }
                Err(_) => Cover::Refused(budget.busy()),
            };
        }
        match budget
            .waiting
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Cover::Wait(WaitingPlace(budget.clone()), need),
            Err(_) => Cover::Refused(budget.busy()),
        }
    }

    /// Waits up to `patience` for `need` bytes of the open budget.
    async fn wait(
        self: Arc<Self>,
        place: WaitingPlace,
        need: u32,
        patience: Duration,
    ) -> Result<(), Refusal> {
        let budget = place.0.clone();
        match tokio::time::timeout(patience, budget.open.acquire_many(need)).await {
            Ok(Ok(p)) => {
                p.forget();
                self.held().open += need;
                Ok(())
            }
            _ => Err(budget.busy()),
        }
    }

    fn release(&self) {
        let mut h = self.held();
        if let Some(b) = &self.budget {
            b.open.add_permits(h.open as usize);
            b.reserve.add_permits(h.reserve as usize);
            if let (Some(shares), Some(who)) = (&b.shares, &self.who) {
                shares.give_bytes(who, h.shared);
            }
        }
        *h = Held::default();
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
    fn wire(&mut self, n: usize) {
        self.wire += n as u64;
        self.charge();
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
        self.charge();
        Ok(())
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
    /// elements' own size). Covered later, before the bytes go on (`GateBody::cover`).
    fn charge(&self) {
        let buffered = if self.compressed {
            self.wire + self.decoded
        } else {
            self.decoded
        };
        let built = self.decoded + self.walker.overhead();
        self.charge.want(buffered.saturating_add(built));
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
            Reading::Opaque(m) => {
                m.wire(b.len());
                return Ok(());
            }
            Reading::Gzip(d) => {
                d.get_mut().meter.wire(b.len());
                d.write_all(b)
            }
            Reading::Deflate(d) => {
                d.get_mut().meter.wire(b.len());
                d.write_all(b)
            }
            Reading::Zstd(d) => {
                d.get_mut().meter.wire(b.len());
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

/// A frame held back until the budget covers it.
type Covering = Pin<Box<dyn Future<Output = Result<(), Refusal>> + Send>>;

/// The request body, inspected by a `Gate` on its way to tonic, with the body deadline.
struct GateBody {
    inner: Body,
    gate: Gate,
    timeout: Option<Duration>,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// A frame inspected but not yet covered, and the wait for its bytes.
    pending: Option<(http_body::Frame<Bytes>, Covering)>,
    done: bool,
}

/// How long a request waits for the budget when it is the one waiting.
const PATIENCE: Duration = Duration::from_secs(10);

impl GateBody {
    fn new(inner: Body, gate: Gate, timeout: Option<Duration>) -> Self {
        GateBody {
            inner,
            gate,
            timeout,
            deadline: timeout.map(|t| Box::pin(tokio::time::sleep(t))),
            pending: None,
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
        self.pending = None;
        self.gate.charge.release();
        Poll::Ready(Some(Err(r.status())))
    }

    /// After bytes arrived: the deadline starts again from now, so it bounds a pause, not
    /// the whole transfer (a 64 MiB batch over a slow link takes long, but keeps
    /// sending). A stream between two messages owes nothing and has no deadline; a
    /// unary request's runs until its body ends.
    fn rearm(&mut self) {
        let Some(t) = self.timeout else { return };
        if self.gate.rule.streaming && self.gate.idle() {
            self.deadline = None;
            return;
        }
        let at = tokio::time::Instant::now() + t;
        match &mut self.deadline {
            Some(d) => d.as_mut().reset(at),
            None => self.deadline = Some(Box::pin(tokio::time::sleep_until(at))),
        }
    }

    /// Hands `frame` on once the budget covers what the request has cost so far: at
    /// once, or after waiting in the waiting place (nothing more is read meanwhile, so
    /// the client is held back by flow control), or never (refused).
    fn cover(
        &mut self,
        frame: http_body::Frame<Bytes>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        match self.gate.charge.cover() {
            Cover::Covered => {
                self.rearm();
                Poll::Ready(Some(Ok(frame)))
            }
            Cover::Refused(r) => self.refuse(r),
            Cover::Wait(place, need) => {
                let patience = self.timeout.unwrap_or(PATIENCE);
                let wait = self.gate.charge.clone().wait(place, need, patience);
                self.deadline = None;
                self.pending = Some((frame, Box::pin(wait)));
                self.poll_pending(cx)
            }
        }
    }

    fn poll_pending(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        let Some((_, wait)) = &mut self.pending else {
            return Poll::Pending;
        };
        match ready!(wait.as_mut().poll(cx)) {
            Ok(()) => {
                let (frame, _) = self.pending.take().expect("pending");
                self.rearm();
                Poll::Ready(Some(Ok(frame)))
            }
            Err(r) => self.refuse(r),
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
        if this.pending.is_some() {
            return this.poll_pending(cx);
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
                this.cover(frame, cx)
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
            charge: Arc::new(Charge::new(
                Some(Arc::new(Budget::new(u32::try_from(budget).unwrap(), None))),
                None,
            )),
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

    /// A body of `chunks`, each sent after its pause.
    fn paced(chunks: Vec<(Duration, Vec<u8>)>) -> Body {
        let frames = futures::stream::unfold(chunks.into_iter(), |mut it| async move {
            let (pause, bytes) = it.next()?;
            tokio::time::sleep(pause).await;
            let frame = http_body::Frame::data(Bytes::from(bytes));
            Some((Ok::<_, std::convert::Infallible>(frame), it))
        });
        Body::new(http_body_util::StreamBody::new(frames))
    }

    /// Reads `body` to its end: the bytes, or the refusal.
    async fn drain(mut body: GateBody) -> Result<usize, tonic::Status> {
        use http_body_util::BodyExt as _;
        let mut n = 0;
        while let Some(frame) = body.frame().await {
            n += frame?.data_ref().map_or(0, Bytes::len);
        }
        Ok(n)
    }

    #[tokio::test(start_paused = true)]
    async fn the_body_deadline_bounds_a_pause_not_the_transfer() {
        let t = Duration::from_secs(1);
        let body = framed(0, &[7u8; 5000]);
        let each = |pause: u64| -> Vec<(Duration, Vec<u8>)> {
            body.chunks(1000)
                .map(|c| (Duration::from_millis(pause), c.to_vec()))
                .collect()
        };
        let g = || gate(Rule::opaque(1 << 20, "x"), Encoding::Identity, 1 << 20);
        // Six pieces 0.6 s apart: 3.6 s in all, three times the deadline, never a pause
        // of it.
        let slow = GateBody::new(paced(each(600)), g(), Some(t));
        assert_eq!(drain(slow).await.unwrap(), body.len());
        // One pause of 1.5 s in the middle.
        let mut chunks = each(100);
        chunks[3].0 = Duration::from_millis(1500);
        let started = tokio::time::Instant::now();
        let stalled = drain(GateBody::new(paced(chunks), g(), Some(t)))
            .await
            .unwrap_err();
        assert_eq!(stalled.code(), tonic::Code::Unavailable, "{stalled:?}");
        assert!(
            stalled
                .message()
                .contains("MAILROOM_REQUEST_BODY_TIMEOUT_MS")
        );
        assert_eq!(started.elapsed(), Duration::from_millis(300) + t);
    }

    fn covered(c: &Charge) -> u32 {
        let h = c.held();
        h.open + h.reserve
    }

    fn held(g: &Gate) -> u32 {
        covered(&g.charge)
    }

    /// Inspects `body` and covers its cost.
    fn take(g: &mut Gate, body: &[u8]) -> Result<(), Refusal> {
        g.inspect(body)?;
        match g.charge.cover() {
            Cover::Covered => Ok(()),
            Cover::Refused(r) => Err(r),
            Cover::Wait(..) => panic!("waits"),
        }
    }

    #[test]
    fn compressed_bytes_are_charged_as_decompressed_and_decoded() {
        let message = vec![0u8; 100_000];
        let body = framed(1, &gzip(&message));
        // 100,000 decompressed bytes held twice, plus the compressed bytes: more than
        // 200,000. Alone, it holds the budget less the reserve.
        let mut g = gate(Rule::opaque(1 << 20, "x"), Encoding::Gzip, 1 << 20);
        take(&mut g, &body).unwrap();
        assert!(held(&g) > 200_000);
        let mut g = gate(Rule::opaque(1 << 20, "x"), Encoding::Gzip, 160_000);
        take(&mut g, &body).unwrap();
        assert_eq!(held(&g), 140_000);
    }

    #[test]
    fn large_requests_leave_the_reserve_to_small_ones() {
        let budget = Arc::new(Budget::new(800, None));
        let charge = |want| {
            let c = Charge::new(Some(budget.clone()), None);
            c.want(want);
            c
        };
        let covered = |c: &Charge| matches!(c.cover(), Cover::Covered);
        let large = charge(650);
        assert!(covered(&large));
        // 150 left, 100 of them the reserve: a large request may not take the last 100,
        // a small one may.
        let other = charge(60);
        assert!(matches!(other.cover(), Cover::Wait(..)));
        let small = charge(25);
        assert!(covered(&small));
        small.want(50);
        assert!(covered(&small));
        assert!(!covered(&charge(26)));
        drop(small);
        assert_eq!(budget.open.available_permits(), 50);
        assert_eq!(budget.reserve.available_permits(), 100);
        large.release();
        assert_eq!(budget.open.available_permits(), 700);
    }

    /// Eight large requests taking the budget piece by piece: each would hold an eighth
    /// and wait for the others. One waits; the others are refused at once and give back
    /// what they hold, so the one in the waiting place is covered.
    #[tokio::test]
    async fn large_requests_growing_together_leave_one_to_finish() {
        let budget = Arc::new(Budget::new(800, None));
        let charges: Vec<_> = (0..8)
            .map(|_| Arc::new(Charge::new(Some(budget.clone()), None)))
            .collect();
        for c in &charges {
            c.want(80);
            assert!(matches!(c.cover(), Cover::Covered));
        }
        let mut waiting = None;
        let mut refused = 0;
        for c in &charges {
            c.want(600);
            match c.cover() {
                Cover::Wait(place, need) => {
                    let wait = c.clone().wait(place, need, Duration::from_secs(5));
                    waiting = Some(tokio::spawn(wait));
                    // In line for what the others give back (GateBody polls it at once).
                    tokio::task::yield_now().await;
                }
                Cover::Refused(Refusal::Busy { .. }) => {
                    refused += 1;
                    c.release();
                }
                _ => panic!("covered"),
            }
        }
        assert_eq!(refused, 7);
        waiting.unwrap().await.unwrap().unwrap();
        let covered: Vec<_> = charges.iter().map(|c| covered(c)).collect();
        assert_eq!(
            covered.iter().filter(|&&n| n == 600).count(),
            1,
            "{covered:?}"
        );
        assert_eq!(covered.iter().sum::<u32>(), 600, "{covered:?}");
        // The waiting place is free again.
        assert!(!budget.waiting.load(Ordering::Acquire));
    }

    #[test]
    fn a_principal_passes_its_share_with_one_request_alone() {
        let shares = Shares::new(50);
        let budget = Arc::new(Budget::new(800, shares));
        let who: Arc<str> = Arc::from("tenant");
        let charge = |want| {
            let c = Charge::new(Some(budget.clone()), Some(who.clone()));
            c.want(want);
            c
        };
        let alone = charge(600);
        assert!(matches!(alone.cover(), Cover::Covered));
        assert!(matches!(
            charge(10).cover(),
            Cover::Refused(Refusal::Share { percent: 50 })
        ));
        // Another principal, and a caller without an identity, are not refused for it.
        let other = Charge::new(Some(budget.clone()), Some(Arc::from("other")));
        other.want(10);
        assert!(matches!(other.cover(), Cover::Covered));
        drop(alone);
        assert!(matches!(charge(10).cover(), Cover::Covered));
    }

    #[test]
    fn a_declared_length_reserves_nothing() {
        let mut g = gate(Rule::opaque(64 << 20, "x"), Encoding::Identity, 1 << 20);
        take(&mut g, &[0, 4, 0, 0, 0, 1, 2, 3]).unwrap();
        assert_eq!(held(&g), 6);
    }

    #[test]
    fn a_compressed_message_is_refused_at_the_limit_while_it_decompresses() {
        let body = framed(1, &gzip(&vec![0u8; 10_000_000]));
        let mut g = gate(Rule::opaque(1_000_000, "x"), Encoding::Gzip, 1 << 30);
        match g.inspect(&body) {
            Err(Refusal::TooLarge { decoded: false, .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(g.charge.held().want < 3_000_000);
    }

    #[test]
    fn garbage_does_not_decompress() {
        let body = framed(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let mut g = gate(Rule::opaque(1 << 20, "x"), Encoding::Gzip, 1 << 20);
        assert!(matches!(g.inspect(&body), Err(Refusal::Undecodable(_))));
    }
}

//! gRPC calls of raw bytes, as a hand-rolled or hostile client sends them: any message
//! bytes, compressed beforehand or not, and bodies that stop half-way.

use std::io::Write as _;

use bytes::Bytes;
use http_body_util::BodyExt;
use tonic::body::Body;
use tonic::transport::Channel;

/// One gRPC message frame: the compression flag, the length, the bytes.
pub fn frame(compressed: bool, message: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(message.len() + 5);
    v.push(u8::from(compressed));
    v.extend((message.len() as u32).to_be_bytes());
    v.extend(message);
    v.into()
}

/// `b` gzip-compressed (the fastest level: tests compress tens of MB).
pub fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

/// A body that sends `first` and then nothing, never ending.
pub fn stalled_body(first: Bytes) -> Body {
    let frames = futures::StreamExt::chain(
        futures::stream::once(async move {
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(first))
        }),
        futures::stream::pending(),
    );
    Body::new(http_body_util::StreamBody::new(frames))
}

/// Calls `path` with `body` (frames made by `frame`), `grpc-encoding: gzip` when
/// `gzip`; the answer's status (`Ok` for OK) once the server has answered.
pub async fn raw_call(
    channel: Channel,
    path: &str,
    body: Body,
    gzip: bool,
) -> Result<(), tonic::Status> {
    raw_call_as(channel, path, body, gzip, None).await
}

/// `raw_call` with `bearer` as the caller's token.
pub async fn raw_call_as(
    channel: Channel,
    path: &str,
    body: Body,
    gzip: bool,
    bearer: Option<&str>,
) -> Result<(), tonic::Status> {
    let mut req = http::Request::builder()
        .method("POST")
        .uri(format!("http://mailroom{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if gzip {
        req = req.header("grpc-encoding", "gzip");
    }
    if let Some(t) = bearer {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req.body(body).unwrap();
    let mut channel = channel;
    let resp = tower::ServiceExt::ready(&mut channel)
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let resp = tower::Service::call(resp, req)
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let (parts, body) = resp.into_parts();
    // A refusal is often trailers-only: the status is in the headers.
    let status = match tonic::Status::from_header_map(&parts.headers) {
        Some(s) => s,
        None => {
            let collected = body.collect().await?;
            let trailers = collected.trailers().cloned().unwrap_or_default();
            tonic::Status::from_header_map(&trailers)
                .unwrap_or_else(|| tonic::Status::unknown("no grpc-status"))
        }
    };
    match status.code() {
        tonic::Code::Ok => Ok(()),
        _ => Err(status),
    }
}

/// A body of `b`, whole.
pub fn whole_body(b: Bytes) -> Body {
    Body::new(http_body_util::Full::new(b))
}

//! The local sink of the embedded default: each event becomes one JSON line on stdout or
//! appended to a file. Same relay semantics as Kafka; a write error is transient.

use std::path::PathBuf;

use base64::Engine as _;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use super::{Delivery, Failure, Sink};
use crate::domain::StoredEvent;

/// JSON lines, one per event, to stdout or a file: the embedded default.
pub struct LocalSink {
    out: Mutex<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>,
}

impl LocalSink {
    /// JSON lines on stdout.
    pub fn stdout() -> Self {
        LocalSink {
            out: Mutex::new(Box::new(tokio::io::stdout())),
        }
    }

    /// JSON lines appended to `path`.
    pub async fn file(path: PathBuf) -> std::io::Result<Self> {
        let f = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .await?;
        Ok(LocalSink {
            out: Mutex::new(Box::new(f)),
        })
    }
}

/// One event as a JSON line (payload base64, so binary survives).
pub fn json_line(e: &StoredEvent) -> String {
    let mut s = serde_json::json!({
        "id": e.id,
        "topic": e.topic,
        "key": e.key,
        "type": e.event_type,
        "headers": e.headers,
        "payload_base64": base64::engine::general_purpose::STANDARD.encode(&e.payload),
        "created_at": e.created_at.to_rfc3339(),
        "attempt": e.attempts + 1,
    })
    .to_string();
    s.push('\n');
    s
}

#[async_trait::async_trait]
impl Sink for LocalSink {
    async fn deliver(&self, lines: &[Vec<&StoredEvent>]) -> Vec<Vec<Delivery>> {
        let mut buf = String::new();
        for e in lines.iter().flatten() {
            buf.push_str(&json_line(e));
        }
        let mut out = self.out.lock().await;
        let res = match out.write_all(buf.as_bytes()).await {
            Ok(()) => out.flush().await,
            Err(e) => Err(e),
        };
        drop(out);
        let d = match res {
            Ok(()) => Delivery::Delivered,
            Err(e) => Delivery::Failed(Failure::Transient {
                error: format!("local sink write failed: {e}"),
            }),
        };
        lines
            .iter()
            .map(|l| l.iter().map(|_| d.clone()).collect())
            .collect()
    }
}

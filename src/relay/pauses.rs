//! Tells the outbox's sink which topics are paused. Claims skip a paused topic in SQL,
//! but a sink may still hold records of it that it was handed before the pause (the
//! Kafka producer keeps a record past mailroom's delivery deadline, queued behind a
//! partition that does not answer). The pause may come from any process sharing the
//! database, so it is read from the store: every `every`, the paused topics are read
//! and handed to `Sink::paused`, which drops what it still holds of a newly paused topic
//! (docs/relay.md, "Pausing a topic").

use std::collections::HashSet;

use crate::domain::BoxKind;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::sink::Sink;
use crate::store::Store;

/// Reads the paused topics every `every` and hands them to `sink` until `stop`. Does
/// nothing for a sink that does not follow pauses.
pub async fn watch(
    store: Arc<dyn Store>,
    sink: Arc<dyn Sink>,
    every: Duration,
    stop: CancellationToken,
) {
    if !sink.follows_pauses() {
        return;
    }
    // Warned once per run of failures: the store being down is reported elsewhere.
    let mut failing = false;
    loop {
        match store.paused(BoxKind::Outbox, None).await {
            Ok(paused) => {
                failing = false;
                let topics: HashSet<String> = paused.into_iter().map(|p| p.topic).collect();
                let sink = sink.clone();
                // A purge waits for librdkafka's broker threads: not on a runtime thread.
                if let Err(e) = tokio::task::spawn_blocking(move || sink.paused(&topics)).await {
                    tracing::error!(error = %e, "handing the paused topics to the sink failed");
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "reading the paused topics failed");
                }
                failing = true;
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

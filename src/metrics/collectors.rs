//! The collectors read at scrape time: the relays' counters and latency histograms, and
//! the inbox's per subscription. They read the snapshots the engines share; nothing here
//! changes them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;

use crate::inbox::InboxHandles;
use crate::inbox::consumer::IntakeStats;
use crate::inbox::supervisor::Task;
use crate::relay::{Latency, RelayStats};
use crate::schema::SchemaGate;
use crate::store::Store;
use crate::store::schema::Compat;

/// The relays' counters and histograms, read at scrape time.
#[derive(Debug)]
pub(super) struct RelayCollector {
    pub(super) relays: Vec<Arc<RelayStats>>,
}

/// One of the relays' counters.
type RelayCounter = fn(&RelayStats) -> &AtomicU64;

/// The relays' plain counters: name, help, field.
const RELAY_COUNTERS: [(&str, &str, RelayCounter); 9] = [
    (
        "mailroom_outbox_published",
        "Events the relays published (acknowledged by the destination).",
        |r| &r.delivered,
    ),
    (
        "mailroom_outbox_failed",
        "Events that used up their attempts (or were rejected) and became failed.",
        |r| &r.failed,
    ),
    ("mailroom_relay_cycles", "Relay cycles (claims) run.", |r| {
        &r.cycles
    }),
    (
        "mailroom_relay_stale_updates",
        "Settle updates dropped because another relay had taken the key or event over.",
        |r| &r.stale,
    ),
    (
        "mailroom_relay_delivered_after_failure",
        "Events the destination acknowledged after an earlier event of their key failed \
         in the same run (possible reordering; each is flagged in its last_error). \
         Expected to stay 0.",
        |r| &r.delivered_after_failure,
    ),
    (
        "mailroom_relay_held_back_lines",
        "Lines (a key's run, or an unkeyed event) not sent because their topic looked \
         down and was not due for a probe.",
        |r| &r.held_back,
    ),
    (
        "mailroom_relay_continued_runs",
        "Runs a relay sent on a deep key it kept leased, right after the key's previous \
         run was acknowledged (no release and new claim in between).",
        |r| &r.continued,
    ),
    (
        "mailroom_relay_lease_renewals",
        "Lease renewals of lines whose delivery outlasted a third of the lease.",
        |r| &r.renewals,
    ),
    (
        "mailroom_relay_leases_lost",
        "Keys or events whose lease another relay took while their delivery was in flight.",
        |r| &r.renewals_lost,
    ),
];

impl Collector for RelayCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let sum = |f: RelayCounter| -> u64 {
            self.relays
                .iter()
                .map(|r| f(r).load(Ordering::Relaxed))
                .sum()
        };
        for (name, help, field) in RELAY_COUNTERS {
            encoder
                .encode_descriptor(name, help, None, MetricType::Counter)?
                .encode_counter::<NoLabelSet, _, u64>(&sum(field), None)?;
        }
        {
            let mut e = encoder.encode_descriptor(
                "mailroom_outbox_retried",
                "Failed delivery attempts that will be retried, by class: counted spends an \
                 attempt and backs off; transient (destination unreachable) spends none.",
                None,
                MetricType::Counter,
            )?;
            let counted = sum(|r| &r.retried);
            let transient = sum(|r| &r.transient_events);
            e.encode_family(&[("class", "counted")])?
                .encode_counter::<NoLabelSet, _, u64>(&counted, None)?;
            e.encode_family(&[("class", "transient")])?
                .encode_counter::<NoLabelSet, _, u64>(&transient, None)?;
        }
        encode_latencies(
            &mut encoder,
            "mailroom_relay_cycle_seconds",
            "Duration of relay cycles that published something: claim, delivery, settle.",
            &self
                .relays
                .iter()
                .map(|r| &r.cycle_latency)
                .collect::<Vec<_>>(),
        )?;
        encode_latencies(
            &mut encoder,
            "mailroom_relay_publish_seconds",
            "Duration of one cycle's delivery to the destination (all its runs).",
            &self
                .relays
                .iter()
                .map(|r| &r.publish_latency)
                .collect::<Vec<_>>(),
        )?;
        Ok(())
    }
}

/// The inbox's counters per subscription, read at scrape time. The subscription label is
/// bounded by the configuration.
pub(super) struct InboxCollector {
    pub(super) inbox: InboxHandles,
}

impl std::fmt::Debug for InboxCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InboxCollector")
    }
}

/// One of a subscription's intake counters.
type IntakeCounter = fn(&IntakeStats) -> &AtomicU64;

impl Collector for InboxCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut subs: Vec<&String> = self.inbox.dispatch_stats.keys().collect();
        subs.sort();
        self.encode_intake(&mut encoder, &subs)?;
        self.encode_tasks(&mut encoder, &subs)?;
        self.encode_dispatch(&mut encoder, &subs)
    }
}

/// Reads a counter.
fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// The consumers' counters: name, help, field.
const INTAKE_COUNTERS: [(&str, &str, IntakeCounter); 7] = [
    (
        "mailroom_inbox_received",
        "Records the inbox consumers read from Kafka.",
        |i| &i.received,
    ),
    (
        "mailroom_inbox_intake_failed",
        "Records stored as failed at intake: over the inbox limits, or refused by the database and stored stripped.",
        |i| &i.failed,
    ),
    (
        "mailroom_inbox_intake_unstorable",
        "Records the database refused in every form: skipped and logged with their topic, partition and offset.",
        |i| &i.unstorable,
    ),
    (
        "mailroom_inbox_duplicates",
        "Records dropped as duplicates (already in the inbox).",
        |i| &i.duplicates,
    ),
    (
        "mailroom_inbox_topic_recreations",
        "Partitions the consumer read again from their log start because their topic was recreated (a new topic id).",
        |i| &i.recreated,
    ),
    (
        "mailroom_inbox_log_truncations",
        "Partitions the consumer read again from their log start because its position was past the log end (a truncated or recreated log).",
        |i| &i.truncated,
    ),
    (
        "mailroom_inbox_operator_rewinds",
        "Partitions the consumer moved back to a time because an operator rewound the subscription (RewindSubscription).",
        |i| &i.rewound,
    ),
];

/// A metric's label values for one subscription.
fn sub_label(s: &str) -> [(&'static str, &str); 1] {
    [("subscription", s)]
}

impl InboxCollector {
    /// The consumers' counters per subscription.
    fn encode_intake(&self, encoder: &mut DescriptorEncoder<'_>, subs: &[&String]) -> Fmt {
        for (name, help, field) in INTAKE_COUNTERS {
            let mut e = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for s in subs {
                if let Some(i) = self.inbox.intake_stats.get(*s) {
                    e.encode_family(&sub_label(s))?
                        .encode_counter::<NoLabelSet, _, u64>(&load(field(i)), None)?;
                }
            }
        }
        Ok(())
    }

    /// The supervisor's restarts and crash loops per subscription.
    fn encode_tasks(&self, encoder: &mut DescriptorEncoder<'_>, subs: &[&String]) -> Fmt {
        let mut e = encoder.encode_descriptor(
            "mailroom_inbox_task_restarts",
            "Subscription tasks (consumer, dispatcher) started again after a panic.",
            None,
            MetricType::Counter,
        )?;
        for s in subs {
            if let Some(h) = self.inbox.task_health.get(*s) {
                for task in [Task::Consumer, Task::Dispatcher] {
                    e.encode_family(&[("subscription", s.as_str()), ("task", task.as_str())])?
                        .encode_counter::<NoLabelSet, _, u64>(&load(h.restarts(task)), None)?;
                }
            }
        }
        let mut e = encoder.encode_descriptor(
            "mailroom_inbox_subscription_crash_looping",
            "1 while a subscription's tasks keep dying (its readiness is NOT_SERVING).",
            None,
            MetricType::Gauge,
        )?;
        for s in subs {
            if let Some(h) = self.inbox.task_health.get(*s) {
                e.encode_family(&sub_label(s))?
                    .encode_gauge(&i64::from(h.crash_looping()))?;
            }
        }
        Ok(())
    }

    /// The dispatchers' outcomes, refusals and call durations per subscription.
    fn encode_dispatch(&self, encoder: &mut DescriptorEncoder<'_>, subs: &[&String]) -> Fmt {
        let mut e = encoder.encode_descriptor(
            "mailroom_inbox_handled",
            "Handler outcomes: completed, retried (counted or deferred), failed \
             (rejected or out of attempts), transient (handler unreachable).",
            None,
            MetricType::Counter,
        )?;
        for s in subs {
            let r = &self.inbox.dispatch_stats[*s];
            for (outcome, v) in [
                ("completed", load(&r.delivered)),
                ("retried", load(&r.retried)),
                ("failed", load(&r.failed)),
                ("transient", load(&r.transient_events)),
            ] {
                e.encode_family(&[("subscription", s.as_str()), ("outcome", outcome)])?
                    .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
            }
        }
        let mut e = encoder.encode_descriptor(
            "mailroom_inbox_handler_auth_refused",
            "Handle calls the handler refused with UNAUTHENTICATED or PERMISSION_DENIED \
             (no attempt spent).",
            None,
            MetricType::Counter,
        )?;
        for s in subs {
            if let Some(c) = self.inbox.handler_auth_refused.get(*s) {
                e.encode_family(&sub_label(s))?
                    .encode_counter::<NoLabelSet, _, u64>(&load(c), None)?;
            }
        }
        let mut e = encoder.encode_descriptor(
            "mailroom_inbox_handle_seconds",
            "Duration of one HandlerService.Handle call.",
            None,
            MetricType::Histogram,
        )?;
        for s in subs {
            if let Some(l) = self.inbox.handler_latency.get(*s) {
                l.histogram().encode(e.encode_family(&sub_label(s))?)?;
            }
        }
        Ok(())
    }
}

/// What encoding returns.
type Fmt = Result<(), std::fmt::Error>;

/// Encodes the distinct histograms among `hs` as one metric: the shared one as is, or,
/// when relays were built without sharing (tests), one series per histogram under a
/// `relay` label.
fn encode_latencies(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    hs: &[&Latency],
) -> Result<(), std::fmt::Error> {
    let mut distinct: Vec<&Latency> = Vec::new();
    for h in hs {
        if !distinct.iter().any(|d| d.same(h)) {
            distinct.push(h);
        }
    }
    let mut e = encoder.encode_descriptor(name, help, None, MetricType::Histogram)?;
    match distinct.as_slice() {
        [] => Latency::default().histogram().encode(e),
        [one] => one.histogram().encode(e),
        many => {
            for (i, h) in many.iter().enumerate() {
                h.histogram()
                    .encode(e.encode_family(&[("relay", i.to_string())])?)?;
            }
            Ok(())
        }
    }
}

/// Series of `mailroom_outbox_key_held_seconds` at most (the longest held).
const HELD_KEY_SERIES: usize = 20;

/// The store's connection pools and its long-held keys, read at scrape time.
pub(super) struct PoolCollector {
    pub(super) store: Arc<dyn Store>,
}

impl std::fmt::Debug for PoolCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolCollector")
    }
}

impl Collector for PoolCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let pools = self.store.pool_use();
        let mut e = encoder.encode_descriptor(
            "mailroom_db_pool_connections",
            "Database connections open per pool (query class), by state: used or idle.",
            None,
            MetricType::Gauge,
        )?;
        for p in &pools {
            for (state, n) in [("used", p.open.saturating_sub(p.idle)), ("idle", p.idle)] {
                let labels = [("pool", p.pool), ("state", state)];
                e.encode_family(&labels)?.encode_gauge(&i64::from(n))?;
            }
        }
        let mut e = encoder.encode_descriptor(
            "mailroom_db_pool_max_connections",
            "The most connections each pool (query class) opens.",
            None,
            MetricType::Gauge,
        )?;
        for p in &pools {
            e.encode_family(&[("pool", p.pool)])?
                .encode_gauge(&i64::from(p.max))?;
        }
        // Few series: only keys held past the threshold, at most `HELD_KEY_SERIES`.
        let mut held = self.store.held_keys();
        held.sort_by_key(|h| std::cmp::Reverse(h.held_for));
        let mut e = encoder.encode_descriptor(
            "mailroom_outbox_key_held_seconds",
            "Keys whose order lock a SQL-API transaction has held for long (their events wait), by topic, key and the holder's backend pid.",
            None,
            MetricType::Gauge,
        )?;
        for h in held.iter().take(HELD_KEY_SERIES) {
            let pid = h
                .pid
                .map_or_else(|| "unknown".to_string(), |p| p.to_string());
            let labels = [
                ("topic", h.line.topic.as_str()),
                ("key", h.line.key.as_str()),
                ("pid", pid.as_str()),
            ];
            e.encode_family(&labels)?
                .encode_gauge(&h.held_for.as_secs_f64())?;
        }
        Ok(())
    }
}

/// The schema gate's last verdict (`crate::schema`), read at scrape time from its cache.
pub(super) struct SchemaCollector {
    pub(super) schema: SchemaGate,
}

impl std::fmt::Debug for SchemaCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SchemaCollector")
    }
}

impl Collector for SchemaCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let last = self.schema.last();
        let now = last.map_or("unknown", |v| v.compat.as_str());
        let mut e = encoder.encode_descriptor(
            "mailroom_schema_state",
            "How the database's schema relates to this binary's (1 for the current state): \
             known, ahead (newer and compatible), behind (migrations pending), incompatible \
             (relaying stopped), unknown (not readable: relaying stopped).",
            None,
            MetricType::Gauge,
        )?;
        for state in [
            Compat::Known,
            Compat::Ahead,
            Compat::Behind,
            Compat::Incompatible,
        ]
        .map(Compat::as_str)
        .into_iter()
        .chain(["unknown"])
        {
            e.encode_family(&[("state", state)])?
                .encode_gauge(&i64::from(state == now))?;
        }
        encoder
            .encode_descriptor(
                "mailroom_schema_database_version",
                "The database's highest applied migration, as last read (-1: not readable).",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&last.map_or(-1, |v| v.state.database))?;
        Ok(())
    }
}

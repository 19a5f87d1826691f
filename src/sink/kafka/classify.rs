//! One decision per produce error code (issue 43, item 3): whether the event spends an
//! attempt, whether its topic is narrowed (published by a producer of its own, one record
//! at a time: `narrowing`), and whether the shared producer must be replaced. Each row
//! is derived from what librdkafka 2.12 does with the code on mailroom's producer
//! (idempotent, `enable.gapless.guarantee=true`, `message.timeout.ms=0`):
//! `rd_kafka_handle_Produce_error` and `rd_kafka_err_action` in `rdkafka_request.c`.
//!
//! - Codes librdkafka retries (its REFRESH and RETRY actions) never reach mailroom as a
//!   delivery report: with no message timeout it retries them forever. mailroom sees its
//!   own deadline pass instead; the line's partition is held back and probed.
//! - Every other broker code is PERMANENT to librdkafka, and with the gapless guarantee a
//!   permanent error is fatal to the whole idempotent producer (`GAPLESS_GUARANTEE`):
//!   every topic's queue is purged and the producer must be replaced. Each of those
//!   codes narrows the topic it came back on, so that the next record of that topic is
//!   sent by the narrowed producer (not idempotent: a refusal there is the record's own
//!   failure) and cannot reset the shared producer again before the narrowing ends.
//!
//! docs/relay.md's table is [`markdown_table`]'s output, checked by a test.

use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};
use rdkafka::types::RDKafkaRespErr;

use crate::sink::Failure;

/// Whether an error spends the event's attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The record itself was refused: it spends an attempt, once the refusal is known to
    /// be its own (it was alone in its batch, or refused before it was sent).
    Spend,
    /// The environment failed: no attempt is spent.
    Keep,
}

/// What is isolated, beyond the line's own fault domain (which every failure that
/// spends no attempt holds back and probes: the partition for a keyed event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Narrow {
    /// The topic is narrowed: published by the narrowed producer, one record at a time,
    /// until 60 s after its last such error (`narrowing::NARROWED_FOR`).
    Topic,
    /// Only the partition: held back and probed by the relay (`relay::domains`).
    Partition,
    /// Nothing about a topic or partition: the cluster, the client or the producer.
    None,
}

/// What the sink does about one error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the event spends an attempt.
    pub attempt: Attempt,
    /// What is isolated.
    pub narrow: Narrow,
    /// librdkafka leaves the shared (idempotent, gapless) producer fatal: it is replaced.
    pub replace_producer: bool,
}

/// The rows of the table: each a group of codes that librdkafka treats alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Row {
    /// librdkafka retries (REFRESH or RETRY) forever; mailroom's deadline passes.
    Retried,
    /// A broker's refusal of the batch for what a record holds; PERMANENT, so fatal.
    RecordRefused,
    /// A broker's refusal of the topic, the cluster's or the client's set-up, not of a
    /// record; PERMANENT, so fatal.
    TopicRefused,
    /// The producer's identity or sequence (idempotence): fatal when librdkafka cannot
    /// recover; a new producer id is the remedy.
    ProducerState,
    /// librdkafka reports the batch delivered (a retry of a batch already written).
    Delivered,
    /// The record was purged by the producer's own fatal error or replacement.
    Purged,
    /// No connection, no broker, no credentials, the local queue full: before any
    /// request, shared by every record.
    Outage,
    /// The client refused this record before sending it (exact: its own).
    LocalRefusal,
}

impl Row {
    /// The row's decision.
    pub fn decision(self) -> Decision {
        let (attempt, narrow, replace_producer) = match self {
            Row::Retried => (Attempt::Keep, Narrow::Partition, false),
            Row::RecordRefused => (Attempt::Spend, Narrow::Topic, true),
            Row::TopicRefused => (Attempt::Keep, Narrow::Topic, true),
            Row::ProducerState => (Attempt::Keep, Narrow::None, true),
            Row::Delivered | Row::Purged | Row::Outage => (Attempt::Keep, Narrow::None, false),
            Row::LocalRefusal => (Attempt::Spend, Narrow::None, false),
        };
        Decision {
            attempt,
            narrow,
            replace_producer,
        }
    }

    /// What librdkafka does with the row's codes, and why the decision follows.
    fn why(self) -> &'static str {
        match self {
            Row::Retried => {
                "librdkafka retries these itself (REFRESH/RETRY actions), forever with \
                 `message.timeout.ms=0`: no delivery report carries them; mailroom's \
                 deadline passes and the partition is held back and probed"
            }
            Row::RecordRefused => {
                "PERMANENT: the broker refused the batch for a record in it; gapless \
                 makes it fatal (every topic's queue purged). The topic is narrowed; a \
                 record alone in its batch (narrowed) spends its attempt, one in a \
                 shared batch does not. Unlisted broker codes fall here"
            }
            Row::TopicRefused => {
                "PERMANENT: refused for the topic, the credentials or the set-up, not the \
                 record; gapless makes it fatal. The topic is narrowed, so its probes go \
                 through the narrowed producer and cannot reset the shared one again"
            }
            Row::ProducerState => {
                "the producer's id, epoch or sequence: librdkafka recovers by itself when \
                 it can (epoch bump) and reports only what it cannot, fatal; a new \
                 producer id is the remedy, so it is not the topic's"
            }
            Row::Delivered => "librdkafka reports the batch as delivered",
            Row::Purged => {
                "purged by a fatal error or a replacement: the record goes again at once \
                 on the new producer"
            }
            Row::Outage => {
                "the client cannot reach or authenticate to the cluster, or its queue is \
                 full: before any request, shared by every record"
            }
            Row::LocalRefusal => {
                "refused by the client before sending (its own record, so exact); other \
                 client codes that are not produce errors count too, so that nothing \
                 loops forever at no cost"
            }
        }
    }
}

/// The row of a code.
pub fn row(code: C) -> Row {
    match code {
        // rd_kafka_err_action's REFRESH and RETRY for Produce, and its defaults.
        C::InvalidMessage
        | C::UnknownTopicOrPartition
        | C::LeaderNotAvailable
        | C::NotLeaderForPartition
        | C::RequestTimedOut
        | C::BrokerNotAvailable
        | C::ReplicaNotAvailable
        | C::CoordinatorLoadInProgress
        | C::CoordinatorNotAvailable
        | C::NotCoordinator
        | C::NotEnoughReplicas
        | C::NotEnoughReplicasAfterAppend
        | C::KafkaStorageError
        | C::BrokerTransportFailure
        | C::OperationTimedOut
        | C::TimedOutQueue
        | C::SSL
        | C::Retry
        | C::WaitingForCoordinator
        | C::DestroyBroker => Row::Retried,
        // rd_kafka_handle_idempotent_Produce_error.
        C::OutOfOrderSequenceNumber
        | C::InvalidProducerEpoch
        | C::UnknownProducerId
        | C::InvalidProducerIdMapping
        | C::InvalidTransactionalState
        | C::ProducerFenced
        | C::TransactionCoordinatorFenced
        | C::Fenced
        | C::Fatal
        | C::GaplessGuarantee => Row::ProducerState,
        C::DuplicateSequenceNumber | C::NoError => Row::Delivered,
        C::PurgeQueue | C::PurgeInflight => Row::Purged,
        // Permanent, and about the topic, the cluster or the client's set-up.
        C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed
        | C::DelegationTokenAuthorizationFailed
        | C::DelegationTokenExpired
        | C::SaslAuthenticationFailed
        | C::UnsupportedSASLMechanism
        | C::IllegalSASLState
        | C::UnacceptableCredential
        | C::PrincipalDeserializationFailure
        | C::SecurityDisabled
        | C::UnsupportedVersion
        | C::UnsupportedForMessageFormat
        | C::UnsupportedCompressionType
        | C::InvalidRequiredAcks
        | C::InvalidRequest
        | C::NetworkException
        | C::ThrottlingQuotaExceeded
        | C::FencedLeaderEpoch
        | C::UnknownLeaderEpoch
        | C::PreferredLeaderNotAvailable
        | C::EligibleLeadersNotAvailable
        | C::NotController
        | C::ListenerNotFound
        | C::InvalidConfig
        | C::UnknownTopicId
        | C::RebootstrapRequired
        | C::MessageTimedOut => Row::TopicRefused,
        // Client-side, before any request: the environment.
        C::AllBrokersDown
        | C::Resolve
        | C::QueueFull
        | C::Authentication
        | C::CriticalSystemResource
        | C::Interrupted
        | C::WaitCache
        | C::NodeUpdate
        | C::UnknownBroker
        | C::BrokerDestroy
        | C::ISRInsufficient
        | C::UnknownTopic
        | C::UnknownPartition
        | C::NotConfigured
        | C::UnsupportedFeature => Row::Outage,
        c if (c as i32) < 0 => Row::LocalRefusal,
        // Every other broker code: MessageSizeTooLarge, InvalidRecord, PolicyViolation,
        // InvalidTimestamp, MessageBatchTooLarge, InvalidTopic, ... and unknown ones.
        _ => Row::RecordRefused,
    }
}

/// The decision for a code.
pub fn decide(code: C) -> Decision {
    row(code).decision()
}

/// Every code librdkafka 2.12 knows, in numeric order.
pub fn every_code() -> impl Iterator<Item = C> {
    (-200..=200).filter_map(|n| {
        let raw = RDKafkaRespErr::try_from(n).ok()?;
        let code = C::from(raw);
        // The enum's bounds are not codes, and success is not an error.
        (!matches!(code, C::Begin | C::End | C::EndAll | C::NoError)).then_some(code)
    })
}

/// The table as docs/relay.md shows it: one line per row, every code named.
pub fn markdown_table() -> String {
    let mut rows: Vec<(Row, Vec<String>)> = Vec::new();
    for code in every_code() {
        let r = row(code);
        let name = format!("`{code:?}` ({})", code as i32);
        match rows.iter_mut().find(|(x, _)| *x == r) {
            Some((_, names)) => names.push(name),
            None => rows.push((r, vec![name])),
        }
    }
    rows.sort_by_key(|(r, _)| *r);
    let mut out = String::from(
        "| codes | attempt | narrow | replace producer | why (librdkafka 2.12) |\n\
         |---|---|---|---|---|\n",
    );
    for (r, names) in rows {
        let d = r.decision();
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            names.join(", "),
            match d.attempt {
                Attempt::Spend => "spend (when the record's own)",
                Attempt::Keep => "not spent",
            },
            match d.narrow {
                Narrow::Topic => "topic",
                Narrow::Partition => "partition",
                Narrow::None => "none",
            },
            if d.replace_producer { "yes" } else { "no" },
            r.why()
        ));
    }
    out
}

/// The decision for an error; errors without a code (client creation, a canceled
/// delivery) are the environment's.
pub(super) fn decision_of(e: &KafkaError) -> Decision {
    match e.rdkafka_error_code() {
        Some(code) => decide(code),
        None => Row::Outage.decision(),
    }
}

/// Whether `e` is about the producer's own state (only a new producer recovers).
pub(super) fn producer_lost(e: &KafkaError) -> bool {
    e.rdkafka_error_code()
        .is_some_and(|c| row(c) == Row::ProducerState)
}

/// The failure an error is for the event: counted when it spends an attempt and the
/// refusal is the record's own (`exact`), transient otherwise.
pub(super) fn failure(e: &KafkaError, d: Decision, exact: bool) -> Failure {
    let error = format!("kafka: {e}");
    match d.attempt {
        Attempt::Spend if exact => Failure::Counted {
            error,
            retry_at: None,
        },
        _ => Failure::Transient { error },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What librdkafka 2.12 does with a code in a Produce response, transcribed from
    /// `rd_kafka_handle_Produce_error` (its explicit actions) and `rd_kafka_err_action`
    /// (the defaults), for an idempotent producer with the gapless guarantee.
    #[derive(Debug, PartialEq)]
    enum Librdkafka {
        /// Retried (REFRESH or RETRY): never fatal.
        Retries,
        /// PERMANENT: fatal to a gapless idempotent producer.
        Fatal,
        /// Idempotence-specific handling (recover or fatal).
        Idempotence,
        /// Treated as delivered.
        Delivered,
    }

    fn librdkafka(code: i32) -> Librdkafka {
        match code {
            // Explicit Produce actions, then rd_kafka_err_action's defaults.
            -195 | 3 | 56 | 19 | 20 | -166 | -185 | -153 => Librdkafka::Retries,
            5 | 6 | 8 | 9 | 15 | 16 | -180 | -137 | -181 | 7 | 2 | 14 => Librdkafka::Retries,
            45 | 47 | 59 => Librdkafka::Idempotence,
            46 => Librdkafka::Delivered,
            _ => Librdkafka::Fatal,
        }
    }

    /// Every code has a decision, and each follows from librdkafka: a broker code it
    /// retries never replaces the producer nor spends an attempt; one that leaves the
    /// shared producer fatal replaces it and narrows its topic (so it cannot reset the
    /// other topics again while narrowed), unless it is the producer's own state.
    #[test]
    fn every_produce_error_code_has_a_decision_derived_from_librdkafka() {
        let codes: Vec<C> = every_code().collect();
        // librdkafka 2.12 knows 170 codes besides `NoError`.
        assert!(codes.len() >= 169, "{} codes", codes.len());
        for code in codes {
            let n = code as i32;
            let d = decide(code);
            // Client codes (negative) other than a message timeout never come back in a
            // Produce response: nothing to narrow for them.
            let from_broker = n > 0 || code == C::MessageTimedOut;
            if !from_broker {
                assert_ne!(d.narrow, Narrow::Topic, "{code:?}: {d:?}");
            }
            match librdkafka(n) {
                Librdkafka::Retries => {
                    assert_eq!(row(code), Row::Retried, "{code:?}");
                    assert!(
                        !d.replace_producer && d.attempt == Attempt::Keep,
                        "{code:?}"
                    );
                }
                Librdkafka::Fatal if from_broker => {
                    assert!(d.replace_producer, "{code:?} is fatal: {d:?}");
                    assert!(
                        d.narrow == Narrow::Topic || row(code) == Row::ProducerState,
                        "{code:?} resets the shared producer: its topic must narrow"
                    );
                }
                Librdkafka::Fatal => {}
                Librdkafka::Idempotence => assert_eq!(row(code), Row::ProducerState),
                Librdkafka::Delivered => assert_eq!(row(code), Row::Delivered),
            }
        }
    }

    /// The issue's cases, by name.
    #[test]
    fn the_codes_of_the_issue_have_their_decisions() {
        let topic_refused = Decision {
            attempt: Attempt::Keep,
            narrow: Narrow::Topic,
            replace_producer: true,
        };
        for c in [
            C::TopicAuthorizationFailed,
            C::ClusterAuthorizationFailed,
            C::UnsupportedVersion,
            C::UnsupportedForMessageFormat,
            C::UnsupportedCompressionType,
            C::InvalidRequiredAcks,
            C::NetworkException,
        ] {
            assert_eq!(decide(c), topic_refused, "{c:?}");
        }
        for c in [
            C::MessageSizeTooLarge,
            C::InvalidRecord,
            C::PolicyViolation,
            C::InvalidTimestamp,
            C::MessageBatchTooLarge,
            C::InvalidTopic,
        ] {
            assert_eq!(
                decide(c),
                Decision {
                    attempt: Attempt::Spend,
                    narrow: Narrow::Topic,
                    replace_producer: true
                },
                "{c:?}"
            );
        }
        for c in [
            C::NotEnoughReplicas,
            C::NotLeaderForPartition,
            C::LeaderNotAvailable,
            C::KafkaStorageError,
        ] {
            assert_eq!(decide(c).narrow, Narrow::Partition, "{c:?}");
            assert!(!decide(c).replace_producer, "{c:?}");
        }
        for c in [C::AllBrokersDown, C::QueueFull, C::Authentication] {
            assert_eq!(decide(c), Row::Outage.decision(), "{c:?}");
        }
        for c in [C::UnknownProducerId, C::ProducerFenced, C::Fatal] {
            assert!(decide(c).replace_producer, "{c:?}");
        }
        assert_eq!(decide(C::ValueSerialization).attempt, Attempt::Spend);
    }

    /// docs/relay.md shows the table this module decides by, verbatim.
    #[test]
    fn docs_relay_md_shows_this_table() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/relay.md")).unwrap();
        let table = markdown_table();
        assert!(
            doc.contains(&table),
            "docs/relay.md's error table differs from the code's; replace it with:\n{table}"
        );
    }
}

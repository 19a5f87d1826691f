//! librdkafka's error codes sorted into what a relay does about them: spend an attempt
//! (counted), wait without spending one (transient), or replace the producer. The table
//! is in docs/relay.md.

use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};

use crate::sink::Failure;

/// How the relay treats a Kafka error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The broker (or the client, deterministically) refused this record: spend an attempt.
    Counted,
    /// The environment failed: spend nothing, stop the line, probe its topic again later.
    Transient,
    /// Transient, and the producer itself can no longer deliver: replace it.
    ProducerBroken,
}

/// The classification table. An error counts against the event only when it is about
/// the record itself (too large, invalid, refused by a policy); errors about the
/// network, the cluster, the credentials or the client's configuration are transient:
/// every record would get them, and an outage of credentials or of the cluster's state
/// must not burn every event's attempts. Unknown codes count, so nothing loops forever
/// at no cost (docs/relay.md keeps this table in prose).
pub fn classify(code: C) -> ErrorClass {
    if producer_lost(code) {
        ErrorClass::ProducerBroken
    } else if outage(code) || metadata_missing(code) || credentials(code) || setup(code) {
        ErrorClass::Transient
    } else {
        // Everything else (too large, invalid record, bad timestamp, policy violation,
        // invalid topic name, serialization, ...) is the record's fault.
        ErrorClass::Counted
    }
}

/// No broker, no connection, no answer in time, local queue full, leadership moving.
fn outage(code: C) -> bool {
    matches!(
        code,
        C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::Resolve
            | C::MessageTimedOut
            | C::RequestTimedOut
            | C::OperationTimedOut
            | C::TimedOutQueue
            | C::QueueFull
            | C::NetworkException
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::BrokerNotAvailable
            | C::ReplicaNotAvailable
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::KafkaStorageError
            | C::ThrottlingQuotaExceeded
            | C::FencedLeaderEpoch
            | C::UnknownLeaderEpoch
            | C::PreferredLeaderNotAvailable
            | C::EligibleLeadersNotAvailable
            | C::CoordinatorLoadInProgress
            | C::CoordinatorNotAvailable
            | C::NotCoordinator
            | C::NotController
            | C::Retry
            | C::Interrupted
            | C::PurgeQueue
            | C::PurgeInflight
            | C::BrokerDestroy
            | C::DestroyBroker
            | C::WaitCache
            | C::RebootstrapRequired
            | C::NodeUpdate
            | C::UnknownBroker
            | C::CriticalSystemResource
    )
}

/// The cluster lost or has not yet got the topic's metadata (a broker that lost its
/// state, a topic being created): about the cluster, not the record.
fn metadata_missing(code: C) -> bool {
    matches!(
        code,
        C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition | C::UnknownTopicId
    )
}

/// Credentials, authorization and TLS: an operator's fix, shared by every record.
fn credentials(code: C) -> bool {
    matches!(
        code,
        C::Authentication
            | C::SSL
            | C::SaslAuthenticationFailed
            | C::UnsupportedSASLMechanism
            | C::IllegalSASLState
            | C::UnacceptableCredential
            | C::PrincipalDeserializationFailure
            | C::SecurityDisabled
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::TransactionalIdAuthorizationFailed
            | C::DelegationTokenAuthorizationFailed
            | C::DelegationTokenExpired
    )
}

/// The client and the cluster disagree on what they support or how they are set up (an
/// upgrade, a listener change, a compression type the cluster refuses).
fn setup(code: C) -> bool {
    matches!(
        code,
        C::UnsupportedVersion
            | C::UnsupportedFeature
            | C::UnsupportedForMessageFormat
            | C::UnsupportedCompressionType
            | C::InvalidRequiredAcks
            | C::ListenerNotFound
            | C::NotConfigured
            | C::InvalidConfig
    )
}

/// The producer's identity or sequence is lost: only a new producer recovers.
fn producer_lost(code: C) -> bool {
    matches!(
        code,
        C::Fatal
            | C::Fenced
            | C::ProducerFenced
            | C::InvalidProducerEpoch
            | C::UnknownProducerId
            | C::OutOfOrderSequenceNumber
            | C::InvalidProducerIdMapping
            | C::GaplessGuarantee
            | C::InvalidTransactionalState
    )
}

pub(super) fn class_of(e: &KafkaError) -> ErrorClass {
    match e.rdkafka_error_code() {
        Some(code) => classify(code),
        // Errors without a code (client creation, canceled delivery) are the client's.
        None => ErrorClass::Transient,
    }
}

pub(super) fn failure(e: &KafkaError, class: ErrorClass) -> Failure {
    let error = format!("kafka: {e}");
    match class {
        ErrorClass::Counted => Failure::Counted {
            error,
            retry_at: None,
        },
        ErrorClass::Transient | ErrorClass::ProducerBroken => Failure::Transient { error },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each class with the codes that must fall in it.
    const TABLE: &[(ErrorClass, &[C])] = &[
        // A broker outage: the record is fine, no attempt is spent.
        (
            ErrorClass::Transient,
            &[
                C::AllBrokersDown,
                C::BrokerTransportFailure,
                C::MessageTimedOut,
                C::RequestTimedOut,
                C::QueueFull,
                C::NotLeaderForPartition,
            ],
        ),
        // Something about this record: it counts.
        (
            ErrorClass::Counted,
            &[
                C::MessageSizeTooLarge,
                C::InvalidMessage,
                C::InvalidRecord,
                C::InvalidTimestamp,
                C::InvalidTopic,
                C::ValueSerialization,
                C::PolicyViolation,
                C::MessageBatchTooLarge,
            ],
        ),
        // The credentials, the cluster's state or the client's set-up are shared by every
        // record: they must not spend attempts (issue 11, item 7).
        (
            ErrorClass::Transient,
            &[
                C::Authentication,
                C::SSL,
                C::SaslAuthenticationFailed,
                C::UnsupportedSASLMechanism,
                C::TopicAuthorizationFailed,
                C::ClusterAuthorizationFailed,
                C::UnknownTopicOrPartition,
                C::UnknownTopic,
                C::UnknownPartition,
                C::UnsupportedVersion,
                C::UnsupportedCompressionType,
                C::InvalidRequiredAcks,
            ],
        ),
        // Lost producer state: the producer is replaced.
        (
            ErrorClass::ProducerBroken,
            &[
                C::Fatal,
                C::ProducerFenced,
                C::UnknownProducerId,
                C::InvalidProducerEpoch,
                C::OutOfOrderSequenceNumber,
            ],
        ),
    ];

    #[test]
    fn every_listed_code_falls_in_its_class() {
        for (class, codes) in TABLE {
            for c in *codes {
                assert_eq!(classify(*c), *class, "{c:?}");
            }
        }
    }
}

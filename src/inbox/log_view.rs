//! What librdkafka knows of a subscribed log that rdkafka 0.39 does not expose: a topic's
//! id (KIP-516, asked with `DescribeTopics`, a `Metadata` request) and the watermarks
//! the last fetch response of a partition carried. Read through librdkafka's C API on the
//! consumer's own client (so with its brokers, TLS and SASL settings); with `record`,
//! the inbox's only `unsafe` code.
//!
//! librdkafka sees a topic's id change on its own, but only logs it at debug level and
//! keeps fetching at the old position (a `FIXME` in its `rdkafka_topic.c`, 2.12).

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char};
use std::fmt;
use std::time::Duration;

use rdkafka::bindings as rd;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::types::RDKafkaRespErr;

/// A topic's id: a deleted and recreated topic has a new one. Brokers before Kafka 2.8
/// answer zeros, read as no id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TopicId(pub u128);

impl fmt::Display for TopicId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0.to_be_bytes();
        for (i, x) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{x:02x}")?;
        }
        Ok(())
    }
}

/// The ids of those of `topics` the cluster has and names an id for (a missing topic,
/// or a broker without topic ids: left out), or why the cluster could not be asked.
/// Blocks up to `timeout` and a second.
pub fn topic_ids(
    consumer: &StreamConsumer,
    topics: &[String],
    timeout: Duration,
) -> Result<HashMap<String, TopicId>, String> {
    let names: Vec<CString> = topics
        .iter()
        .filter_map(|t| CString::new(t.as_str()).ok())
        .collect();
    if names.is_empty() {
        return Ok(HashMap::new());
    }
    let mut ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX / 2);
    let rk = consumer.client().native_ptr();
    // SAFETY: `rk` is the live client `consumer` owns for this call. The collection copies
    // the names (`rd_strdup`); the options, queue, collection and event are created here,
    // each destroyed exactly once below, after the last use of what they own.
    unsafe {
        let collection = rd::rd_kafka_TopicCollection_of_topic_names(ptrs.as_mut_ptr(), ptrs.len());
        let options = rd::rd_kafka_AdminOptions_new(
            rk,
            rd::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS,
        );
        let mut errstr = [0 as c_char; 256];
        rd::rd_kafka_AdminOptions_set_request_timeout(
            options,
            ms,
            errstr.as_mut_ptr(),
            errstr.len(),
        );
        let queue = rd::rd_kafka_queue_new(rk);
        rd::rd_kafka_DescribeTopics(rk, collection, options, queue);
        let event = rd::rd_kafka_queue_poll(queue, ms.saturating_add(1000));
        let out = if event.is_null() {
            Err("no answer in time".to_string())
        } else {
            let out = described(event);
            rd::rd_kafka_event_destroy(event);
            out
        };
        rd::rd_kafka_queue_destroy(queue);
        rd::rd_kafka_AdminOptions_destroy(options);
        rd::rd_kafka_TopicCollection_destroy(collection);
        out
    }
}

/// The ids in a `DescribeTopics` result event.
///
/// # Safety
/// `event` is a live, non-null event of a `DescribeTopics` call.
unsafe fn described(event: *mut rd::rd_kafka_event_t) -> Result<HashMap<String, TopicId>, String> {
    // SAFETY (whole body): every pointer read here is owned by `event`, alive until the
    // caller destroys it; strings are copied out before.
    unsafe {
        if rd::rd_kafka_event_error(event) != RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR {
            return Err(c_text(rd::rd_kafka_event_error_string(event)));
        }
        let result = rd::rd_kafka_event_DescribeTopics_result(event);
        if result.is_null() {
            return Err("not a DescribeTopics result".to_string());
        }
        let mut n = 0usize;
        let list = rd::rd_kafka_DescribeTopics_result_topics(result, &mut n);
        let mut ids = HashMap::new();
        for i in 0..n {
            let d = *list.add(i);
            let error = rd::rd_kafka_TopicDescription_error(d);
            if !error.is_null()
                && rd::rd_kafka_error_code(error) != RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR
            {
                continue;
            }
            let id = rd::rd_kafka_TopicDescription_topic_id(d);
            if id.is_null() {
                continue;
            }
            let hi = rd::rd_kafka_Uuid_most_significant_bits(id) as u64;
            let lo = rd::rd_kafka_Uuid_least_significant_bits(id) as u64;
            let id = (u128::from(hi) << 64) | u128::from(lo);
            if id != 0 {
                ids.insert(c_text(rd::rd_kafka_TopicDescription_name(d)), TopicId(id));
            }
        }
        Ok(ids)
    }
}

/// A C string librdkafka owns, copied (empty when null).
///
/// # Safety
/// `s` is null or a NUL-terminated string alive for this call.
unsafe fn c_text(s: *const c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

/// The (low, high) watermarks of a partition as its last fetch response gave them, without
/// asking the broker; `None` before the first response.
pub fn cached_watermarks(
    consumer: &StreamConsumer,
    topic: &str,
    partition: i32,
) -> Option<(i64, i64)> {
    let topic = CString::new(topic).ok()?;
    let (mut low, mut high) = (-1i64, -1i64);
    // SAFETY: `rk` is the consumer's live client; librdkafka copies the two offsets out
    // under the partition's lock.
    let err = unsafe {
        rd::rd_kafka_get_watermark_offsets(
            consumer.client().native_ptr(),
            topic.as_ptr(),
            partition,
            &mut low,
            &mut high,
        )
    };
    (err == RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0).then_some((low, high))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_id_reads_as_a_uuid() {
        let id = TopicId(0x01a2_4a80_5e62_7531_8469_5e5d_ae43_4ad2);
        assert_eq!(id.to_string(), "01a24a80-5e62-7531-8469-5e5dae434ad2");
    }
}

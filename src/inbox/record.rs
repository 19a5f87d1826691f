//! A consumed Kafka record as plain bytes, read through a path that cannot panic.
//!
//! rdkafka 0.39 reads a header name with `CStr::to_str().unwrap()` (`Headers::get`,
//! `iter`, and so `OwnedMessage::headers`), so one record whose header name is not UTF-8
//! (Go's Sarama and franz-go write raw bytes) panics the task that looks at it. Headers
//! are therefore read here with librdkafka's C API as bytes, and nothing else in the
//! inbox touches rdkafka's header accessors. This is the crate's one `unsafe` module.
//!
//! librdkafka hands names out as C strings: a name holding a NUL byte arrives cut at it.

#![allow(unsafe_code)]

use std::ffi::CStr;

use rdkafka::Message;
use rdkafka::bindings as rd;
use rdkafka::message::BorrowedMessage;

use super::identity;
use crate::domain::headers::RecordHeader;

/// A record as the inbox stores it: its place in the log and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The offset.
    pub offset: i64,
    /// The record's timestamp in ms since the epoch, when the broker gave one.
    pub timestamp_ms: Option<i64>,
    /// The key; `None` is a null key.
    pub key: Option<Vec<u8>>,
    /// The value; `None` is a null value.
    pub payload: Option<Vec<u8>>,
    /// The headers in record order, as bytes.
    pub headers: Vec<RecordHeader>,
}

impl Record {
    /// Copies `m` out of the consumer.
    pub fn read(m: &BorrowedMessage<'_>) -> Record {
        Record {
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            timestamp_ms: m.timestamp().to_millis(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers: raw_headers(m),
        }
    }

    /// Where the record sits in the log, and when it was written there.
    pub fn place(&self) -> Place {
        Place {
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
            timestamp_ms: self.timestamp_ms,
        }
    }

    /// The value of the last header named `name` (Kafka lets names repeat).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .rev()
            .find(|h| h.name == name.as_bytes())
            .and_then(|h| h.value.as_deref())
    }
}

/// Where a record sits in the log, with its timestamp: its identity when it has no
/// other (`identity::kafka`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The offset.
    pub offset: i64,
    /// The record's timestamp in ms since the epoch, when it has one.
    pub timestamp_ms: Option<i64>,
}

impl Place {
    /// The record's identity by its place in the log (and its timestamp).
    pub fn identity(&self) -> String {
        identity::kafka(&self.topic, self.partition, self.offset, self.timestamp_ms)
    }
}

/// The headers of `m`, through `rd_kafka_message_headers` and `rd_kafka_header_get_all`.
fn raw_headers(m: &BorrowedMessage<'_>) -> Vec<RecordHeader> {
    let mut hdrs: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
    // SAFETY: `m.ptr()` is the live message this borrow keeps alive; librdkafka only
    // writes a pointer to the headers it owns into `hdrs` (or leaves it null).
    let err = unsafe { rd::rd_kafka_message_headers(m.ptr(), &mut hdrs) };
    if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || hdrs.is_null() {
        return Vec::new();
    }
    // SAFETY: `hdrs` is non-null and owned by the message, alive for this borrow.
    let count = unsafe { rd::rd_kafka_header_cnt(hdrs) };
    let mut out = Vec::with_capacity(count);
    for idx in 0..count {
        let mut name: *const std::os::raw::c_char = std::ptr::null();
        let mut value: *const std::os::raw::c_void = std::ptr::null();
        let mut size: usize = 0;
        // SAFETY: `idx < count`; librdkafka writes pointers into the header list it owns.
        let err =
            unsafe { rd::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut value, &mut size) };
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            continue;
        }
        // SAFETY: librdkafka's names are NUL-terminated; copied before the borrow ends.
        let name = unsafe { CStr::from_ptr(name) }.to_bytes().to_vec();
        let value = (!value.is_null()).then(|| {
            // SAFETY: `value` points at `size` bytes owned by the header list.
            unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec()
        });
        out.push(RecordHeader { name, value });
    }
    out
}

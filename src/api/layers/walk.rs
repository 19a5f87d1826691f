//! Walks a protobuf message's wire bytes as they arrive, in pieces of any size, and counts
//! what prost will build from them before prost builds anything (issue 43, item 1): two
//! bytes on the wire (`0a 00`) are one empty `Event` of some 200 bytes in memory, so the
//! bytes alone do not bound what a request costs.
//!
//! A `Shape` names the fields worth counting: message fields (repeated ones, maps, and the
//! singular ones to walk into) and repeated varints (packed or not). Every other field is
//! skipped by its length. The walker stops (and counts nothing more) where the bytes stop
//! being a valid message: prost stops decoding there too, so nothing it builds escapes the
//! count.

/// The fields of one message type the walker counts or walks into.
#[derive(Debug)]
pub struct Shape {
    /// The counted fields; the others are skipped.
    pub fields: &'static [Field],
}

/// One counted field of a `Shape`.
#[derive(Debug)]
pub struct Field {
    /// The field number.
    pub number: u32,
    /// What it holds.
    pub kind: Kind,
}

/// What a counted field holds.
#[derive(Debug)]
pub enum Kind {
    /// A message (a map field is a repeated entry message): each occurrence costs `each`
    /// bytes of memory beyond its wire bytes; `inner`, when given, is walked too.
    Message {
        /// Bytes each occurrence costs beyond its wire bytes.
        each: u64,
        /// The message's own counted fields.
        inner: Option<&'static Shape>,
    },
    /// A repeated varint (`int64`, `uint32`...), packed or not: each element costs `each`.
    Varints {
        /// Bytes each element costs (on the wire, one byte at least).
        each: u64,
    },
}

/// A message with nothing to count.
pub const OPAQUE: Shape = Shape { fields: &[] };

/// A top-level field whose elements are limited in number.
#[derive(Debug, Clone, Copy)]
pub struct Counted {
    /// The field number (in the request message).
    pub number: u32,
    /// The field's name, as a `BadRequest` names it.
    pub name: &'static str,
    /// At most this many elements.
    pub max: usize,
    /// The setting (or the API's rule) that says so.
    pub rule: &'static str,
}

/// The request has more elements in a `Counted` field than it allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooMany {
    /// The field's name.
    pub name: &'static str,
    /// Its limit.
    pub max: usize,
    /// The setting (or rule) that says so.
    pub rule: &'static str,
}

/// Deeper than prost decodes (its recursion limit is 100): the walker stops there too.
const MAX_DEPTH: usize = 100;
/// A field's tag and its length or varint value: 10 bytes each at most.
const MAX_HEADER: usize = 20;

#[derive(Debug)]
struct Frame {
    shape: &'static Shape,
    /// Offset where this message ends (`u64::MAX` for the request itself).
    end: u64,
    /// A (deprecated) group: ends at its end-group tag.
    group: bool,
}

/// The walker of one message; see the module documentation.
#[derive(Debug)]
pub struct Walker {
    counted: Option<Counted>,
    count: usize,
    overhead: u64,
    /// Bytes of the message consumed so far.
    pos: u64,
    stack: Vec<Frame>,
    /// Bytes of a skipped field still to come.
    skip: u64,
    /// A packed run of varints, up to this offset, each costing `.1`, counted when `.2`.
    packed: Option<(u64, u64, bool)>,
    pending: [u8; MAX_HEADER],
    pending_len: usize,
    /// The bytes stopped being a valid message.
    stopped: bool,
}

enum Header {
    Incomplete,
    Malformed,
    Done {
        used: usize,
        number: u32,
        wire: u8,
        value: u64,
    },
}

fn varint(b: &[u8]) -> Option<Result<(u64, usize), ()>> {
    let mut v: u64 = 0;
    for (i, byte) in b.iter().enumerate() {
        if i == 10 {
            return Some(Err(()));
        }
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some(Ok((v, i + 1)));
        }
    }
    if b.len() >= 10 { Some(Err(())) } else { None }
}

fn header(b: &[u8]) -> Header {
    let (key, n) = match varint(b) {
        None => return Header::Incomplete,
        Some(Err(())) => return Header::Malformed,
        Some(Ok(k)) => k,
    };
    let Ok(key) = u32::try_from(key) else {
        return Header::Malformed;
    };
    let (number, wire) = (key >> 3, (key & 7) as u8);
    if number == 0 {
        return Header::Malformed;
    }
    match wire {
        0 | 2 => match varint(&b[n..]) {
            None => Header::Incomplete,
            Some(Err(())) => Header::Malformed,
            Some(Ok((value, m))) => Header::Done {
                used: n + m,
                number,
                wire,
                value,
            },
        },
        1 | 3 | 4 | 5 => Header::Done {
            used: n,
            number,
            wire,
            value: 0,
        },
        _ => Header::Malformed,
    }
}

impl Walker {
    /// A walker of a message of `shape`, limiting `counted` when given.
    pub fn new(shape: &'static Shape, counted: Option<Counted>) -> Self {
        Walker {
            counted,
            count: 0,
            overhead: 0,
            pos: 0,
            stack: vec![Frame {
                shape,
                end: u64::MAX,
                group: false,
            }],
            skip: 0,
            packed: None,
            pending: [0; MAX_HEADER],
            pending_len: 0,
            stopped: false,
        }
    }

    /// Bytes of memory the message costs beyond its wire bytes, so far.
    pub fn overhead(&self) -> u64 {
        self.overhead
    }

    /// Elements of the counted field so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Walks the next bytes of the message.
    pub fn feed(&mut self, mut data: &[u8]) -> Result<(), TooMany> {
        while !data.is_empty() && !self.stopped {
            if self.skip > 0 {
                let n = usize::try_from(self.skip).map_or(data.len(), |s| s.min(data.len()));
                self.skip -= n as u64;
                self.pos += n as u64;
                data = &data[n..];
                continue;
            }
            if let Some((end, each, counted)) = self.packed {
                let n = usize::try_from(end - self.pos).map_or(data.len(), |r| r.min(data.len()));
                // Each varint ends at a byte below 0x80.
                let elements = data[..n].iter().filter(|b| **b < 0x80).count();
                self.add(elements, each, counted)?;
                self.pos += n as u64;
                data = &data[n..];
                if self.pos == end {
                    self.packed = None;
                }
                continue;
            }
            if !self.close_frames() {
                return Ok(());
            }
            let take = (MAX_HEADER - self.pending_len).min(data.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&data[..take]);
            let have = self.pending_len + take;
            match header(&self.pending[..have]) {
                Header::Incomplete => {
                    // Fewer than MAX_HEADER bytes were there: all of `data` is pending.
                    self.pending_len = have;
                    data = &data[take..];
                }
                Header::Malformed => self.stopped = true,
                Header::Done {
                    used,
                    number,
                    wire,
                    value,
                } => {
                    data = &data[used - self.pending_len..];
                    self.pending_len = 0;
                    self.pos += used as u64;
                    self.field(number, wire, value)?;
                }
            }
        }
        Ok(())
    }

    /// Leaves the messages that end here; false when the bytes stopped being valid.
    fn close_frames(&mut self) -> bool {
        while self.stack.len() > 1 {
            let top = &self.stack[self.stack.len() - 1];
            if self.pos < top.end {
                break;
            }
            if top.group || self.pos > top.end {
                self.stopped = true;
                return false;
            }
            self.stack.pop();
        }
        true
    }

    fn add(&mut self, n: usize, each: u64, counted: bool) -> Result<(), TooMany> {
        self.overhead = self.overhead.saturating_add(each.saturating_mul(n as u64));
        if let (true, Some(c)) = (counted, self.counted) {
            self.count = self.count.saturating_add(n);
            if self.count > c.max {
                self.stopped = true;
                return Err(TooMany {
                    name: c.name,
                    max: c.max,
                    rule: c.rule,
                });
            }
        }
        Ok(())
    }

    fn field(&mut self, number: u32, wire: u8, value: u64) -> Result<(), TooMany> {
        let depth = self.stack.len();
        let top = &self.stack[depth - 1];
        let (end, group, shape): (u64, bool, &'static Shape) = (top.end, top.group, top.shape);
        let kind = shape
            .fields
            .iter()
            .find(|f| f.number == number)
            .map(|f| &f.kind);
        let counted = depth == 1 && self.counted.is_some_and(|c| c.number == number);
        match (wire, kind) {
            (0, None) => {}
            (0, Some(Kind::Varints { each })) => self.add(1, *each, counted)?,
            (1, None) => self.skip = 8,
            (5, None) => self.skip = 4,
            (2, kind) => {
                if value > end - self.pos {
                    self.stopped = true;
                    return Ok(());
                }
                match kind {
                    None => self.skip = value,
                    Some(Kind::Varints { each }) => {
                        if value > 0 {
                            self.packed = Some((self.pos + value, *each, counted));
                        }
                    }
                    Some(Kind::Message { each, inner }) => {
                        self.add(1, *each, counted)?;
                        match inner {
                            Some(shape) if depth < MAX_DEPTH => self.stack.push(Frame {
                                shape,
                                end: self.pos + value,
                                group: false,
                            }),
                            Some(_) => self.stopped = true,
                            None => self.skip = value,
                        }
                    }
                }
            }
            (3, None) if depth < MAX_DEPTH => self.stack.push(Frame {
                shape: &OPAQUE,
                end,
                group: true,
            }),
            (4, _) if group => {
                self.stack.pop();
            }
            // A wire type prost refuses for this field, an unmatched end of group, or too
            // deep: prost stops decoding here.
            _ => self.stopped = true,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENTRY: Shape = Shape {
        fields: &[Field {
            number: 4,
            kind: Kind::Message {
                each: 100,
                inner: None,
            },
        }],
    };
    const BATCH: Shape = Shape {
        fields: &[
            Field {
                number: 1,
                kind: Kind::Message {
                    each: 10,
                    inner: Some(&ENTRY),
                },
            },
            Field {
                number: 2,
                kind: Kind::Varints { each: 8 },
            },
        ],
    };

    fn counted(max: usize) -> Option<Counted> {
        Some(Counted {
            number: 1,
            name: "events",
            max,
            rule: "MAILROOM_MAX_BATCH",
        })
    }

    /// The same bytes, fed whole and one byte at a time.
    fn walk(bytes: &[u8], max: usize) -> [(Result<(), TooMany>, usize, u64); 2] {
        let mut whole = Walker::new(&BATCH, counted(max));
        let r1 = whole.feed(bytes);
        let mut bytewise = Walker::new(&BATCH, counted(max));
        let r2 = bytes.iter().try_for_each(|b| bytewise.feed(&[*b]));
        [
            (r1, whole.count(), whole.overhead()),
            (r2, bytewise.count(), bytewise.overhead()),
        ]
    }

    #[test]
    fn empty_elements_are_counted_and_refused_past_the_limit() {
        let bytes = [0x0a, 0x00].repeat(5);
        for (r, count, overhead) in walk(&bytes, 5) {
            assert_eq!((r, count, overhead), (Ok(()), 5, 50));
        }
        for (r, count, _) in walk(&bytes, 4) {
            assert_eq!(r.unwrap_err().max, 4);
            assert_eq!(count, 5);
        }
    }

    #[test]
    fn nested_map_entries_cost_and_other_fields_are_skipped() {
        // events { topic: "ab" (skipped), headers x2, payload of 300 bytes }, then
        // an unknown fixed64 and a packed run of three ids.
        let mut event = vec![
            0x0a, 2, b'a', b'b', 0x22, 0, 0x22, 2, 0x0a, 0, 0x1a, 0xac, 0x02,
        ];
        event.extend([7u8; 300]);
        let mut bytes = vec![0x0a];
        bytes.extend(prost_len(event.len()));
        bytes.extend(&event);
        bytes.extend([0x19, 1, 2, 3, 4, 5, 6, 7, 8]);
        bytes.extend([0x12, 4, 1, 0x80, 0x01, 3]);
        for (r, count, overhead) in walk(&bytes, 1000) {
            assert_eq!((r, count, overhead), (Ok(()), 1, 10 + 2 * 100 + 3 * 8));
        }
    }

    #[test]
    fn unpacked_varints_count_one_each() {
        let bytes = [0x10, 0x96, 0x01, 0x10, 0x01];
        for (r, _, overhead) in walk(&bytes, 1) {
            assert_eq!((r, overhead), (Ok(()), 16));
        }
    }

    #[test]
    fn the_walk_stops_where_the_message_is_invalid() {
        // A wrong wire type for `events`, then elements prost never reaches.
        let mut bytes = vec![0x08, 0x01];
        bytes.extend([0x0a, 0x00].repeat(10));
        for (r, count, _) in walk(&bytes, 1) {
            assert_eq!((r, count), (Ok(()), 0));
        }
        // A length past the end of the enclosing message.
        let bytes = [
            0x0a, 0x02, 0x22, 0x05, 0, 0, 0, 0, 0, 0x0a, 0x00, 0x0a, 0x00,
        ];
        for (r, count, _) in walk(&bytes, 1) {
            assert_eq!((r, count), (Ok(()), 1));
        }
    }

    #[test]
    fn groups_hide_nothing() {
        // An unknown group holding what would be events; prost skips it whole. Then two
        // real events.
        let bytes = [0x1b, 0x0a, 0x00, 0x0a, 0x00, 0x1c, 0x0a, 0x00, 0x0a, 0x00];
        for (r, count, _) in walk(&bytes, 2) {
            assert_eq!((r, count), (Ok(()), 2));
        }
    }

    fn prost_len(n: usize) -> Vec<u8> {
        let mut v = Vec::new();
        prost::encoding::encode_varint(n as u64, &mut v);
        v
    }
}

//! Channel events as a client receives them (PROTOCOL.md §12): a DATA frame whose `msg_id`
//! is [`CHANNEL_EVENT_MSG_ID`] carries one [`ChannelEvent`] — a publication, or a marker
//! (joined, left, history lost) — with the channel's position. The session layer sequences,
//! acks and replays it like any other DATA; this module only owns its bytes.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::FrameError;
use crate::reader::Reader;
use crate::varint::{peek_varint, put_varint, varint_len};

/// `msg_id` of the DATA frames that carry channel events. Message ids from
/// [`RESERVED_MSG_IDS_START`] up belong to the edge: backends cannot push them.
pub const CHANNEL_EVENT_MSG_ID: u32 = 0xFFFF_FF01;

/// First message id reserved for the edge's own downstream messages.
pub const RESERVED_MSG_IDS_START: u32 = 0xFFFF_FF00;

/// Longest channel name, in bytes.
pub const MAX_CHANNEL_NAME_LEN: usize = 256;

/// Most bytes a channel event adds to its body in a client frame: the event header (kind,
/// name, epoch, offset: at most 279) and the DATA frame's own header (at most 27), rounded
/// up. A publication body fits a client frame when `body + MAX_EVENT_OVERHEAD <= max frame`.
pub const MAX_EVENT_OVERHEAD: usize = 320;

/// Where a channel's stream stands: its epoch (changes when the channel's history is
/// recreated) and an offset (the last publication counted; offsets start at 1).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct ChannelPosition {
    /// Identifies one incarnation of the channel's history.
    pub epoch: u64,
    /// Offset of the last publication (0 before the first one).
    pub offset: u64,
}

/// What a channel event says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ChannelEventKind {
    /// A publication (its position is its own offset; best-effort ones carry offset 0).
    Publication = 0,
    /// The session became a member; live publications follow the position given.
    Joined = 1,
    /// The session is no longer a member.
    Left = 2,
    /// What was missed since the requested position cannot be recovered (history trimmed
    /// or the epoch changed): reload state; live publications follow the position given.
    HistoryLost = 3,
}

impl ChannelEventKind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => Self::Publication,
            1 => Self::Joined,
            2 => Self::Left,
            3 => Self::HistoryLost,
            _ => return None,
        })
    }
}

/// A channel event's kind, channel and position, borrowed from its bytes: what a session
/// follows for every event it queues, read without allocating ([`ChannelEvent::peek`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelEventHeader<'a> {
    /// Publication or marker.
    pub kind: ChannelEventKind,
    /// The channel's name.
    pub channel: &'a str,
    /// The position the event stands at.
    pub position: ChannelPosition,
}

/// One channel event: the payload of a DATA frame with [`CHANNEL_EVENT_MSG_ID`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelEvent {
    /// Publication or marker.
    pub kind: ChannelEventKind,
    /// The channel's name (`kind:name`, e.g. `guild:42`, or just `world`).
    pub channel: String,
    /// The channel's position this event stands at.
    pub position: ChannelPosition,
    /// The publication's body (empty for markers).
    pub body: Bytes,
}

impl ChannelEvent {
    /// Exact number of bytes [`ChannelEvent::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        Self::len_at(self.channel.len(), self.position, self.body.len())
    }

    /// The most bytes an event on a channel named in `channel_len` bytes with a body of
    /// `body_len` bytes takes, whatever its position (epoch and offset at their largest):
    /// what a publication will take before its position is known.
    pub fn max_encoded_len(channel_len: usize, body_len: usize) -> usize {
        let top = ChannelPosition {
            epoch: u64::MAX,
            offset: u64::MAX,
        };
        Self::len_at(channel_len, top, body_len)
    }

    fn len_at(channel_len: usize, position: ChannelPosition, body_len: usize) -> usize {
        1 + varint_len(channel_len as u64)
            + channel_len
            + varint_len(position.epoch)
            + varint_len(position.offset)
            + body_len
    }

    /// Appends the event's bytes.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u8(self.kind as u8);
        put_varint(out, self.channel.len() as u64);
        out.put_slice(self.channel.as_bytes());
        put_varint(out, self.position.epoch);
        put_varint(out, self.position.offset);
        out.put_slice(&self.body);
    }

    /// The event as one buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        self.encode(&mut out);
        out.freeze()
    }

    /// The header of an encoded event, without copying it; `None` for bytes
    /// [`ChannelEvent::decode`] would refuse. Never panics on any input.
    pub fn peek(bytes: &[u8]) -> Option<ChannelEventHeader<'_>> {
        let (&kind, rest) = bytes.split_first()?;
        let kind = ChannelEventKind::from_u8(kind)?;
        let (len, n) = peek_varint(rest).ok()?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= MAX_CHANNEL_NAME_LEN)?;
        let rest = rest.get(n..)?;
        let channel = std::str::from_utf8(rest.get(..len)?).ok()?;
        let rest = rest.get(len..)?;
        let (epoch, n) = peek_varint(rest).ok()?;
        let (offset, _) = peek_varint(rest.get(n..)?).ok()?;
        Some(ChannelEventHeader {
            kind,
            channel,
            position: ChannelPosition { epoch, offset },
        })
    }

    /// Decodes a DATA payload of [`CHANNEL_EVENT_MSG_ID`]. Never panics on any input.
    pub fn decode(bytes: Bytes) -> Result<Self, FrameError> {
        let mut r = Reader::new(bytes);
        let kind =
            ChannelEventKind::from_u8(r.u8("channel_event")?).ok_or(FrameError::Malformed {
                field: "channel_event",
                what: "unknown channel event kind",
            })?;
        let name = r.bytes_with_len("channel", MAX_CHANNEL_NAME_LEN)?;
        let channel = String::from_utf8(name.to_vec()).map_err(|_| FrameError::Malformed {
            field: "channel",
            what: "not UTF-8",
        })?;
        let epoch = r.varint("epoch")?;
        let offset = r.varint("offset")?;
        Ok(Self {
            kind,
            channel,
            position: ChannelPosition { epoch, offset },
            body: r.rest(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(kind in 0u8..4, channel in "[a-z:0-9]{0,40}", epoch: u64, offset: u64,
                      body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let e = ChannelEvent {
                kind: ChannelEventKind::from_u8(kind).expect("valid"),
                channel,
                position: ChannelPosition { epoch, offset },
                body: Bytes::from(body),
            };
            let bytes = e.to_bytes();
            prop_assert_eq!(bytes.len(), e.encoded_len());
            let header = ChannelEvent::peek(&bytes).expect("valid");
            prop_assert_eq!((header.kind, header.channel, header.position), (e.kind, e.channel.as_str(), e.position));
            prop_assert_eq!(ChannelEvent::decode(bytes).expect("valid"), e);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            // peek and decode agree on what is valid.
            let peeked = ChannelEvent::peek(&bytes).is_some();
            prop_assert_eq!(peeked, ChannelEvent::decode(Bytes::from(bytes)).is_ok());
        }
    }

    #[test]
    fn overhead_bound_holds_for_the_longest_header() {
        let e = ChannelEvent {
            kind: ChannelEventKind::HistoryLost,
            channel: "x".repeat(MAX_CHANNEL_NAME_LEN),
            position: ChannelPosition {
                epoch: u64::MAX,
                offset: u64::MAX,
            },
            body: Bytes::new(),
        };
        let data = crate::Frame::Data(crate::frame::Data {
            class: crate::TrafficClass::Normal,
            msg_id: CHANNEL_EVENT_MSG_ID,
            seq: u64::MAX,
            ack: Some(u64::MAX),
            payload: e.to_bytes(),
        });
        assert!(data.to_bytes().len() <= MAX_EVENT_OVERHEAD);
    }

    #[test]
    fn worked_example_of_protocol_md() {
        // PROTOCOL.md §12.2: publication at offset 7 of `guild:42` (epoch 300), body "hi".
        let e = ChannelEvent {
            kind: ChannelEventKind::Publication,
            channel: "guild:42".into(),
            position: ChannelPosition {
                epoch: 300,
                offset: 7,
            },
            body: Bytes::from_static(b"hi"),
        };
        let bytes = e.to_bytes();
        assert_eq!(bytes.as_ref(), b"\x00\x08guild:42\xac\x02\x07hi".as_slice());
        let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let doc = include_str!("../../../PROTOCOL.md");
        assert!(
            doc.contains(&hex.join(" ")),
            "PROTOCOL.md §12.2 shows these bytes"
        );
    }
}

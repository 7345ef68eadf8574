//! Typed frames of the client protocol and their byte layout (PROTOCOL.md §3). A frame is
//! the unit every transport carries: a type byte, then fields. Integers marked varint are
//! LEB128; `u16` fields are big-endian. Fields after the last defined one are ignored (the
//! extension point), except in DATA whose payload is the rest of the frame.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::FrameError;
use crate::reader::Reader;
use crate::resume_proof::{ResumeProof, RESUME_PROOF_LEN};
use crate::varint::{put_varint, varint_len};
use crate::wire::{CloseCode, FrameType, TrafficClass, ID_LEN, PROTOCOL_VERSION};

/// Longest human-readable message in REJECT and CLOSE.
pub const MAX_REASON_LEN: usize = 1024;
/// Longest auth token in HELLO.
pub const MAX_TOKEN_LEN: usize = 4096;
/// Longest MIGRATE target.
pub const MAX_TARGET_LEN: usize = 512;

/// A 128-bit session id.
pub type SessionId = [u8; ID_LEN];
/// A 128-bit resume token.
pub type ResumeToken = [u8; ID_LEN];

/// Resume part of a HELLO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeRequest {
    /// The session to restore.
    pub session_id: SessionId,
    /// Proof that the client holds the session's resume token
    /// ([`crate::resume_proof::resume_proof`] over the other fields); the token itself is
    /// never sent.
    pub proof: ResumeProof,
    /// The highest server seq the client received with no gap before it.
    pub last_server_seq: u64,
    /// Above every nonce of an earlier resume of this session the edge accepted (the
    /// reference client counts from 1); a replayed proof is refused.
    pub nonce: u64,
}

impl ResumeRequest {
    /// The resume part a client holding `resume_token` sends (PROTOCOL.md §7.3.1): the
    /// proof over these values, never the token.
    pub fn proving(
        session_id: SessionId,
        resume_token: &ResumeToken,
        last_server_seq: u64,
        nonce: u64,
    ) -> Self {
        use crate::resume_proof::{resume_key, resume_proof};
        Self {
            session_id,
            proof: resume_proof(
                &resume_key(resume_token),
                &session_id,
                last_server_seq,
                nonce,
            ),
            last_server_seq,
            nonce,
        }
    }
}

/// HELLO: the client's first frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version the client speaks.
    pub version: u8,
    /// Auth token from the login service (may be empty when only resuming).
    pub token: Bytes,
    /// Present when the client wants its old session back.
    pub resume: Option<ResumeRequest>,
}

/// How a HELLO was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum WelcomeOutcome {
    /// A fresh session (no resume was asked).
    NewSession = 0,
    /// The old session was restored; missed messages follow.
    Restored = 1,
    /// Restored, but some downstream messages were lost: the client must resync its state.
    RestoredWithGap = 2,
    /// Resume was asked but could not be done; this is a fresh session.
    RestoreFailedNewSession = 3,
}

impl WelcomeOutcome {
    /// The outcome's name, the same in every SDK (Rust, C, JS) and in PROTOCOL.md:
    /// `new_session`, `restored`, `restored_with_gap`, `restore_failed_new_session`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::NewSession => "new_session",
            Self::Restored => "restored",
            Self::RestoredWithGap => "restored_with_gap",
            Self::RestoreFailedNewSession => "restore_failed_new_session",
        }
    }

    fn from_u8(byte: u8) -> Option<Self> {
        Some(match byte {
            0 => Self::NewSession,
            1 => Self::Restored,
            2 => Self::RestoredWithGap,
            3 => Self::RestoreFailedNewSession,
            _ => return None,
        })
    }
}

/// WELCOME: the server accepted a HELLO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    /// The session's id.
    pub session_id: SessionId,
    /// The resume token to present on the next reconnect (single use).
    pub resume_token: ResumeToken,
    /// New, restored, restored with gap, or restore failed.
    pub outcome: WelcomeOutcome,
    /// How often the client should PING when it has nothing else to send.
    pub heartbeat_interval_ms: u32,
    /// The server closes the connection after this long without receiving anything.
    pub idle_timeout_ms: u32,
    /// Largest frame the server accepts.
    pub max_frame_size: u32,
    /// Server DATA continues after this seq: the client sets its last received seq to it.
    pub server_seq_base: u64,
    /// Highest client seq the server has received with no gap: the client resends above it.
    pub client_seq_ack: u64,
}

/// REJECT: the server refuses a HELLO or a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// Why.
    pub code: CloseCode,
    /// Milliseconds the client should wait before retrying (0 = no hint).
    pub retry_after_ms: u32,
    /// Human-readable detail (UTF-8, may be empty).
    pub message: String,
}

/// DATA: one application message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Data {
    /// Traffic class.
    pub class: TrafficClass,
    /// Application message id (routes upstream messages to a service).
    pub msg_id: u32,
    /// Per-direction sequence number; 0 and absent on the wire for best-effort.
    pub seq: u64,
    /// Piggybacked cumulative ack of the other direction's seqs.
    pub ack: Option<u64>,
    /// The message body.
    pub payload: Bytes,
}

/// MIGRATE: reconnect elsewhere and resume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migrate {
    /// The client should be gone within this many milliseconds.
    pub deadline_ms: u32,
    /// Where to reconnect (`tcp://host:port`, `ws://...`), or empty for "any edge".
    pub target: String,
    /// The session to resume there.
    pub session_id: SessionId,
    /// The resume token to present there.
    pub resume_token: ResumeToken,
}

/// ERROR: one upstream message could not be delivered (the connection stays open).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReport {
    /// Why (busy, unavailable, no route...).
    pub code: CloseCode,
    /// The message id of the refused message.
    pub msg_id: u32,
    /// The client seq of the refused message (0 for best-effort).
    pub client_seq: u64,
    /// Milliseconds to wait before sending to that service again (0 = no hint).
    pub retry_after_ms: u32,
}

/// One frame of the client protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Welcome`].
    Welcome(Welcome),
    /// See [`Reject`].
    Reject(Reject),
    /// See [`Data`].
    Data(Data),
    /// Cumulative ack: every seq up to and including this one was received.
    Ack {
        /// The acked seq.
        ack: u64,
    },
    /// Liveness probe carrying an opaque value echoed by PONG.
    Ping {
        /// Opaque (the sender's clock, usually).
        timestamp: u64,
    },
    /// Echo of a PING's value.
    Pong {
        /// The PING's value.
        timestamp: u64,
    },
    /// See [`Migrate`].
    Migrate(Migrate),
    /// Orderly end of the connection.
    Close {
        /// Why.
        code: CloseCode,
        /// Human-readable detail.
        message: String,
    },
    /// See [`ErrorReport`].
    Error(ErrorReport),
}

const DATA_CLASS_MASK: u8 = 0b0000_0011;
const DATA_HAS_ACK: u8 = 0b0000_0100;
const DATA_RESERVED: u8 = !(DATA_CLASS_MASK | DATA_HAS_ACK);

/// The longest CLOSE or REJECT message the edge itself writes, in characters (PROTOCOL.md
/// limits table: "the edge's own messages are at most 200 characters").
pub const CLOSE_MESSAGE_MAX_CHARS: usize = 200;

/// `message` cut to [`CLOSE_MESSAGE_MAX_CHARS`] characters: what the edge's CLOSE and REJECT
/// carry, whatever text (a token's fields, a backend's reason) went into it.
pub fn edge_message(message: &str) -> String {
    message.chars().take(CLOSE_MESSAGE_MAX_CHARS).collect()
}

impl Frame {
    /// A CLOSE frame with `message` cut to [`CLOSE_MESSAGE_MAX_CHARS`] characters.
    pub fn close(code: CloseCode, message: &str) -> Self {
        Self::Close {
            code,
            message: edge_message(message),
        }
    }

    /// The frame's type.
    pub fn frame_type(&self) -> FrameType {
        match self {
            Self::Hello(_) => FrameType::Hello,
            Self::Welcome(_) => FrameType::Welcome,
            Self::Reject(_) => FrameType::Reject,
            Self::Data(_) => FrameType::Data,
            Self::Ack { .. } => FrameType::Ack,
            Self::Ping { .. } => FrameType::Ping,
            Self::Pong { .. } => FrameType::Pong,
            Self::Migrate(_) => FrameType::Migrate,
            Self::Close { .. } => FrameType::Close,
            Self::Error(_) => FrameType::Error,
        }
    }

    /// The traffic class the frame travels in: a DATA frame's own class, and `Critical` for
    /// every control frame.
    pub fn class(&self) -> TrafficClass {
        match self {
            Self::Data(d) => d.class,
            _ => TrafficClass::Critical,
        }
    }

    /// Whether this is a control frame (anything but DATA): on QUIC these travel on the
    /// control stream.
    pub fn is_control(&self) -> bool {
        !matches!(self, Self::Data(_))
    }

    /// Exact number of bytes [`Frame::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        1 + match self {
            Self::Hello(h) => {
                2 + len_prefixed(h.token.len())
                    + h.resume.as_ref().map_or(0, |r| {
                        ID_LEN
                            + RESUME_PROOF_LEN
                            + varint_len(r.last_server_seq)
                            + varint_len(r.nonce)
                    })
            }
            Self::Welcome(w) => {
                2 * ID_LEN
                    + 1
                    + varint_len(w.heartbeat_interval_ms.into())
                    + varint_len(w.idle_timeout_ms.into())
                    + varint_len(w.max_frame_size.into())
                    + varint_len(w.server_seq_base)
                    + varint_len(w.client_seq_ack)
            }
            Self::Reject(r) => {
                2 + varint_len(r.retry_after_ms.into()) + len_prefixed(r.message.len())
            }
            Self::Data(d) => {
                1 + varint_len(d.msg_id.into())
                    + if d.class.is_sequenced() {
                        varint_len(d.seq)
                    } else {
                        0
                    }
                    + d.ack.map_or(0, varint_len)
                    + d.payload.len()
            }
            Self::Ack { ack } => varint_len(*ack),
            Self::Ping { timestamp } | Self::Pong { timestamp } => varint_len(*timestamp),
            Self::Migrate(m) => {
                varint_len(m.deadline_ms.into()) + len_prefixed(m.target.len()) + 2 * ID_LEN
            }
            Self::Close { message, .. } => 2 + len_prefixed(message.len()),
            Self::Error(e) => {
                2 + varint_len(e.msg_id.into())
                    + varint_len(e.client_seq)
                    + varint_len(e.retry_after_ms.into())
            }
        }
    }

    /// Appends the frame's bytes (type byte first, no length prefix) to `out`.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u8(self.frame_type() as u8);
        match self {
            Self::Hello(h) => {
                out.put_u8(h.version);
                out.put_u8(u8::from(h.resume.is_some()));
                put_bytes(out, &h.token);
                if let Some(r) = &h.resume {
                    out.put_slice(&r.session_id);
                    out.put_slice(&r.proof);
                    put_varint(out, r.last_server_seq);
                    put_varint(out, r.nonce);
                }
            }
            Self::Welcome(w) => {
                out.put_slice(&w.session_id);
                out.put_slice(&w.resume_token);
                out.put_u8(w.outcome as u8);
                put_varint(out, w.heartbeat_interval_ms.into());
                put_varint(out, w.idle_timeout_ms.into());
                put_varint(out, w.max_frame_size.into());
                put_varint(out, w.server_seq_base);
                put_varint(out, w.client_seq_ack);
            }
            Self::Reject(r) => {
                out.put_u16(r.code.to_u16());
                put_varint(out, r.retry_after_ms.into());
                put_bytes(out, r.message.as_bytes());
            }
            Self::Data(d) => {
                let mut flags = d.class as u8;
                if d.ack.is_some() {
                    flags |= DATA_HAS_ACK;
                }
                out.put_u8(flags);
                put_varint(out, d.msg_id.into());
                if d.class.is_sequenced() {
                    put_varint(out, d.seq);
                }
                if let Some(ack) = d.ack {
                    put_varint(out, ack);
                }
                out.put_slice(&d.payload);
            }
            Self::Ack { ack } => put_varint(out, *ack),
            Self::Ping { timestamp } | Self::Pong { timestamp } => put_varint(out, *timestamp),
            Self::Migrate(m) => {
                put_varint(out, m.deadline_ms.into());
                put_bytes(out, m.target.as_bytes());
                out.put_slice(&m.session_id);
                out.put_slice(&m.resume_token);
            }
            Self::Close { code, message } => {
                out.put_u16(code.to_u16());
                put_bytes(out, message.as_bytes());
            }
            Self::Error(e) => {
                out.put_u16(e.code.to_u16());
                put_varint(out, e.msg_id.into());
                put_varint(out, e.client_seq);
                put_varint(out, e.retry_after_ms.into());
            }
        }
    }

    /// The frame's bytes as one buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len());
        self.encode(&mut out);
        out.freeze()
    }

    /// Decodes one whole frame (type byte through end). Never panics on any input; payload
    /// bytes share `bytes`' buffer.
    pub fn decode(bytes: Bytes) -> Result<Frame, FrameError> {
        let mut r = Reader::new(bytes);
        let type_byte = r.u8("type").map_err(|_| FrameError::Empty)?;
        let frame_type = FrameType::from_u8(type_byte).ok_or(FrameError::UnknownType(type_byte))?;
        Ok(match frame_type {
            FrameType::Hello => {
                let version = r.u8("version")?;
                if version != PROTOCOL_VERSION {
                    // Only the type and version bytes are stable across versions (PROTOCOL.md
                    // §1.1): a HELLO of another version is not read further, so its sender
                    // gets REJECT `unsupported_version`, never a `protocol_error` for a
                    // layout this version does not know.
                    return Ok(Frame::Hello(Hello {
                        version,
                        token: Bytes::new(),
                        resume: None,
                    }));
                }
                let flags = r.u8("flags")?;
                if flags & !1 != 0 {
                    return Err(malformed("flags", "reserved HELLO flag set"));
                }
                let token = r.bytes_with_len("token", MAX_TOKEN_LEN)?;
                let resume = if flags & 1 == 1 {
                    Some(ResumeRequest {
                        session_id: r.array("session_id")?,
                        proof: r.array("proof")?,
                        last_server_seq: r.varint("last_server_seq")?,
                        nonce: r.varint("nonce")?,
                    })
                } else {
                    None
                };
                Frame::Hello(Hello {
                    version,
                    token,
                    resume,
                })
            }
            FrameType::Welcome => Frame::Welcome(Welcome {
                session_id: r.array("session_id")?,
                resume_token: r.array("resume_token")?,
                outcome: WelcomeOutcome::from_u8(r.u8("outcome")?)
                    .ok_or(malformed("outcome", "unknown outcome"))?,
                heartbeat_interval_ms: r.varint_u32("heartbeat_interval_ms")?,
                idle_timeout_ms: r.varint_u32("idle_timeout_ms")?,
                max_frame_size: r.varint_u32("max_frame_size")?,
                server_seq_base: r.varint("server_seq_base")?,
                client_seq_ack: r.varint("client_seq_ack")?,
            }),
            FrameType::Reject => Frame::Reject(Reject {
                code: CloseCode::from_u16(r.u16("code")?),
                retry_after_ms: r.varint_u32("retry_after_ms")?,
                message: utf8(r.bytes_with_len("message", MAX_REASON_LEN)?, "message")?,
            }),
            FrameType::Data => {
                let flags = r.u8("flags")?;
                if flags & DATA_RESERVED != 0 {
                    return Err(malformed("flags", "reserved DATA flag set"));
                }
                let class = TrafficClass::from_bits(flags & DATA_CLASS_MASK)
                    .ok_or(malformed("flags", "class 3 is reserved"))?;
                let msg_id = r.varint_u32("msg_id")?;
                let seq = if class.is_sequenced() {
                    r.varint("seq")?
                } else {
                    0
                };
                let ack = if flags & DATA_HAS_ACK != 0 {
                    Some(r.varint("ack")?)
                } else {
                    None
                };
                Frame::Data(Data {
                    class,
                    msg_id,
                    seq,
                    ack,
                    payload: r.rest(),
                })
            }
            FrameType::Ack => Frame::Ack {
                ack: r.varint("ack")?,
            },
            FrameType::Ping => Frame::Ping {
                timestamp: r.varint("timestamp")?,
            },
            FrameType::Pong => Frame::Pong {
                timestamp: r.varint("timestamp")?,
            },
            FrameType::Migrate => Frame::Migrate(Migrate {
                deadline_ms: r.varint_u32("deadline_ms")?,
                target: utf8(r.bytes_with_len("target", MAX_TARGET_LEN)?, "target")?,
                session_id: r.array("session_id")?,
                resume_token: r.array("resume_token")?,
            }),
            FrameType::Close => Frame::Close {
                code: CloseCode::from_u16(r.u16("code")?),
                message: utf8(r.bytes_with_len("message", MAX_REASON_LEN)?, "message")?,
            },
            FrameType::Error => Frame::Error(ErrorReport {
                code: CloseCode::from_u16(r.u16("code")?),
                msg_id: r.varint_u32("msg_id")?,
                client_seq: r.varint("client_seq")?,
                retry_after_ms: r.varint_u32("retry_after_ms")?,
            }),
        })
    }
}

fn malformed(field: &'static str, what: &'static str) -> FrameError {
    FrameError::Malformed { field, what }
}

fn len_prefixed(len: usize) -> usize {
    varint_len(len as u64) + len
}

fn put_bytes(out: &mut impl BufMut, bytes: &[u8]) {
    put_varint(out, bytes.len() as u64);
    out.put_slice(bytes);
}

fn utf8(bytes: Bytes, field: &'static str) -> Result<String, FrameError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| malformed(field, "not UTF-8"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn arb_class() -> impl Strategy<Value = TrafficClass> {
        prop_oneof![
            Just(TrafficClass::Critical),
            Just(TrafficClass::Normal),
            Just(TrafficClass::BestEffort)
        ]
    }

    fn arb_code() -> impl Strategy<Value = CloseCode> {
        any::<u16>().prop_map(CloseCode::from_u16)
    }

    fn arb_text() -> impl Strategy<Value = String> {
        "\\PC{0,40}"
    }

    pub(crate) fn arb_frame() -> impl Strategy<Value = Frame> {
        let payload = proptest::collection::vec(any::<u8>(), 0..300).prop_map(Bytes::from);
        prop_oneof![
            (
                Just(PROTOCOL_VERSION),
                proptest::collection::vec(any::<u8>(), 0..64),
                proptest::option::of((
                    any::<[u8; 16]>(),
                    any::<[u8; 32]>(),
                    any::<u64>(),
                    any::<u64>()
                ))
            )
                .prop_map(|(version, token, resume)| Frame::Hello(Hello {
                    version,
                    token: token.into(),
                    resume: resume.map(|(session_id, proof, last_server_seq, nonce)| {
                        ResumeRequest {
                            session_id,
                            proof,
                            last_server_seq,
                            nonce,
                        }
                    }),
                })),
            (
                any::<[u8; 16]>(),
                any::<[u8; 16]>(),
                0u8..4,
                any::<(u32, u32, u32, u64, u64)>()
            )
                .prop_map(|(session_id, resume_token, outcome, (h, i, m, s, c))| {
                    Frame::Welcome(Welcome {
                        session_id,
                        resume_token,
                        outcome: WelcomeOutcome::from_u8(outcome)
                            .unwrap_or(WelcomeOutcome::NewSession),
                        heartbeat_interval_ms: h,
                        idle_timeout_ms: i,
                        max_frame_size: m,
                        server_seq_base: s,
                        client_seq_ack: c,
                    })
                }),
            (arb_code(), any::<u32>(), arb_text()).prop_map(|(code, retry_after_ms, message)| {
                Frame::Reject(Reject {
                    code,
                    retry_after_ms,
                    message,
                })
            }),
            (
                arb_class(),
                any::<u32>(),
                any::<u64>(),
                proptest::option::of(any::<u64>()),
                payload
            )
                .prop_map(|(class, msg_id, seq, ack, payload)| Frame::Data(Data {
                    class,
                    msg_id,
                    seq: if class.is_sequenced() { seq } else { 0 },
                    ack,
                    payload,
                })),
            any::<u64>().prop_map(|ack| Frame::Ack { ack }),
            any::<u64>().prop_map(|timestamp| Frame::Ping { timestamp }),
            any::<u64>().prop_map(|timestamp| Frame::Pong { timestamp }),
            (
                any::<u32>(),
                arb_text(),
                any::<[u8; 16]>(),
                any::<[u8; 16]>()
            )
                .prop_map(|(deadline_ms, target, session_id, resume_token)| {
                    Frame::Migrate(Migrate {
                        deadline_ms,
                        target,
                        session_id,
                        resume_token,
                    })
                }),
            (arb_code(), arb_text()).prop_map(|(code, message)| Frame::Close { code, message }),
            (arb_code(), any::<u32>(), any::<u64>(), any::<u32>()).prop_map(
                |(code, msg_id, client_seq, retry_after_ms)| Frame::Error(ErrorReport {
                    code,
                    msg_id,
                    client_seq,
                    retry_after_ms,
                })
            ),
        ]
    }

    #[test]
    fn the_edges_close_message_is_cut_to_200_characters_not_bytes() {
        let long = "\u{e9}".repeat(300);
        let Frame::Close { code, message } = Frame::close(CloseCode::Kicked, &long) else {
            panic!("not a CLOSE");
        };
        assert_eq!(code, CloseCode::Kicked);
        assert_eq!(message.chars().count(), 200);
        assert_eq!(message.len(), 400);
        let short = Frame::close(CloseCode::Kicked, "bye");
        assert!(matches!(short, Frame::Close { message, .. } if message == "bye"));
    }

    #[test]
    fn data_header_is_a_handful_of_bytes() {
        let frame = Frame::Data(Data {
            class: TrafficClass::Normal,
            msg_id: 1001,
            seq: 5000,
            ack: Some(4000),
            payload: Bytes::from_static(&[0; 32]),
        });
        // type + flags + msg_id(2) + seq(2) + ack(2)
        assert_eq!(frame.encoded_len() - 32, 8);
        assert_eq!(frame.to_bytes().len(), frame.encoded_len());
    }

    #[test]
    fn golden_data_bytes() {
        let frame = Frame::Data(Data {
            class: TrafficClass::Normal,
            msg_id: 300,
            seq: 1,
            ack: Some(2),
            payload: Bytes::from_static(b"hi"),
        });
        assert_eq!(
            &frame.to_bytes()[..],
            &[0x04, 0x05, 0xac, 0x02, 0x01, 0x02, b'h', b'i']
        );
    }

    #[test]
    fn reserved_bits_and_unknown_types_are_refused() {
        assert_eq!(
            Frame::decode(Bytes::from_static(&[0x04, 0x08, 0x01, 0x01])),
            Err(malformed("flags", "reserved DATA flag set"))
        );
        assert_eq!(
            Frame::decode(Bytes::from_static(&[0x04, 0x03, 0x01])),
            Err(malformed("flags", "class 3 is reserved"))
        );
        assert_eq!(
            Frame::decode(Bytes::from_static(&[0x7f])),
            Err(FrameError::UnknownType(0x7f))
        );
        assert_eq!(Frame::decode(Bytes::new()), Err(FrameError::Empty));
    }

    /// Review (2026-12-05, PROTOCOL.md §1.1 against the code): a HELLO of a newer version
    /// was read with this version's rules, so one using a flag this version reserves got
    /// `protocol_error` instead of the promised REJECT `unsupported_version`.
    #[test]
    fn a_hello_of_another_version_is_read_no_further_than_its_version() {
        let newer = Bytes::from_static(&[FrameType::Hello as u8, 2, 0xFF, 0xFF, 0xFF]);
        assert_eq!(
            Frame::decode(newer),
            Ok(Frame::Hello(Hello {
                version: 2,
                token: Bytes::new(),
                resume: None,
            }))
        );
    }

    #[test]
    fn trailing_bytes_after_control_fields_are_ignored() {
        let mut bytes = Frame::Ack { ack: 7 }.to_bytes().to_vec();
        bytes.extend_from_slice(b"future extension");
        assert_eq!(Frame::decode(bytes.into()), Ok(Frame::Ack { ack: 7 }));
    }

    proptest! {
        #[test]
        fn round_trip(frame in arb_frame()) {
            let bytes = frame.to_bytes();
            prop_assert_eq!(bytes.len(), frame.encoded_len());
            prop_assert_eq!(Frame::decode(bytes), Ok(frame));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Frame::decode(bytes.into());
        }

        #[test]
        fn every_prefix_of_a_valid_frame_is_handled(frame in arb_frame()) {
            let bytes = frame.to_bytes();
            for cut in 0..bytes.len() {
                let _ = Frame::decode(bytes.slice(..cut));
            }
        }
    }
}

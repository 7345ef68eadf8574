//! The backend link protocol (PROTOCOL.md §9): the frames an edge and a backend instance
//! exchange over one multiplexed TCP (optionally TLS) link, and their byte layout. Framing is
//! the same varint length prefix as the client protocol on byte streams
//! ([`crate::codec::StreamCodec::split`]); type bytes start at 0x40 so a client frame sent to
//! a backend port (or the reverse) is refused as an unknown type, never misread.
//!
//! Sessions are named on the link by a link-local `handle` (a varint chosen by the edge in
//! SESSION_OPEN) instead of their 16-byte id, so a forwarded message costs a few bytes.

use bytes::{BufMut, Bytes, BytesMut};

use crate::channel::{ChannelPosition, MAX_CHANNEL_NAME_LEN, RESERVED_MSG_IDS_START};
use crate::codec::StreamCodec;
use crate::error::FrameError;
use crate::frame::{SessionId, MAX_REASON_LEN};
pub use crate::link_auth::{LinkNonce, LinkProof, LinkWelcomeAuth, LINK_NONCE_LEN, LINK_PROOF_LEN};
use crate::reader::Reader;
use crate::request::ANSWER_MSG_ID;
use crate::varint::{put_varint, varint_len};
use crate::wire::{CloseCode, TrafficClass, ID_LEN};

/// Link protocol version (LINK_HELLO / LINK_WELCOME).
pub const LINK_VERSION: u8 = 1;
/// Link feature bit (LINK_HELLO / LINK_WELCOME `features`, §9.3): the backend answers every
/// FORWARD it processed with FORWARD_DONE, sent after the PUSH frames its handler sent for
/// it; the edge acknowledges a client's message only once it is answered (§9.6).
pub const LINK_FEATURE_FORWARD_DONE: u64 = 1;
/// Link feature bit (§9.3, §9.6): the edge holds the pushes a handler sent as part of its
/// answer (ANSWER_PUSH) and shows them to the client together with the answer, so a reply
/// is never durable and visible while the message it answers is still unacknowledged.
pub const LINK_FEATURE_HELD_ANSWERS: u64 = 2;
/// Link feature bit (§9.3, §12.6): the edge tells the backend which channels it has
/// (CHANNEL_INTEREST, before its first CREDIT and whenever that changes); the backend acks
/// each notice (CHANNEL_INTEREST_ACK) and publishes a channel on every edge only to the
/// edges that have it. A channel's first members on an edge are answered (and shown their
/// JOINED) only once every such backend acked its notice.
pub const LINK_FEATURE_CHANNEL_INTEREST: u64 = 4;
/// Link feature bit (§9.3, §9.5): the edge answers a PIN or UNPIN that carries a request id
/// with PIN_RESULT (what became of it). A backend sends UNPIN, and PIN's request id, only on
/// a link whose LINK_HELLO has it.
pub const LINK_FEATURE_PIN_RESULT: u64 = 8;
/// Default maximum link frame size.
pub const DEFAULT_MAX_LINK_FRAME: usize = 1024 * 1024;
/// Longest id, service name, key or attribute on the link.
pub const MAX_NAME_LEN: usize = 256;
/// Most attributes in one SESSION_OPEN.
pub const MAX_ATTRS: usize = 32;

/// What a PIN frame pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PinKind {
    /// A player id.
    Player = 0,
    /// A room id (or any other business key of a key-routed service).
    Room = 1,
}

/// What became of a PLAYER_PUSH (PROTOCOL.md §9.7): the `outcome` byte of
/// PLAYER_PUSH_RESULT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum PlayerPushOutcome {
    /// Queued on the player's session, on this edge or the one holding it.
    Delivered = 0,
    /// The player has no session on any edge (or not on the edge its presence named).
    Offline = 1,
    /// The player's session has a full outbound queue: not delivered.
    QueueFull = 2,
    /// Not sent: this edge holds as many player pushes waiting for another edge as it may,
    /// or sheds best-effort traffic (overload). Retry later.
    Busy = 3,
    /// Not delivered: the player's edge could not be asked (shared store unreachable, or
    /// that edge is not listening), or this edge has no shared store for another edge's
    /// players.
    Unreachable = 4,
    /// No answer from the player's edge in time: it may or may not have been delivered.
    Unknown = 5,
}

impl PlayerPushOutcome {
    /// The outcome of an `outcome` byte, if it is one.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => Self::Delivered,
            1 => Self::Offline,
            2 => Self::QueueFull,
            3 => Self::Busy,
            4 => Self::Unreachable,
            5 => Self::Unknown,
            _ => return None,
        })
    }

    /// Its name in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Offline => "offline",
            Self::QueueFull => "queue_full",
            Self::Busy => "busy",
            Self::Unreachable => "unreachable",
            Self::Unknown => "unknown",
        }
    }

    /// Every outcome, in byte order.
    pub const ALL: [Self; 6] = [
        Self::Delivered,
        Self::Offline,
        Self::QueueFull,
        Self::Busy,
        Self::Unreachable,
        Self::Unknown,
    ];
}

/// What became of a PIN or UNPIN that asked for an answer (PROTOCOL.md §9.5): the `outcome`
/// byte of PIN_RESULT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum PinOutcome {
    /// PIN: the key is pinned to the instance on this edge.
    Pinned = 0,
    /// UNPIN: the key's pin was removed.
    Unpinned = 1,
    /// UNPIN: the key had no pin of that kind on this edge (never pinned, removed already,
    /// or dropped when its instance left the route table).
    NotPinned = 2,
    /// PIN: the edge has no route table yet.
    NoTable = 3,
    /// PIN: the instance is not in a service of that key kind in the edge's route table.
    UnknownInstance = 4,
    /// PIN: the edge holds as many pinned keys of that kind as it may (100,000).
    Full = 5,
    /// Not carried out: this link cannot take pins (an edge library embedded without a
    /// router), or the edge failed to.
    Unavailable = 6,
}

impl PinOutcome {
    /// The outcome of an `outcome` byte, if it is one.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => Self::Pinned,
            1 => Self::Unpinned,
            2 => Self::NotPinned,
            3 => Self::NoTable,
            4 => Self::UnknownInstance,
            5 => Self::Full,
            6 => Self::Unavailable,
            _ => return None,
        })
    }

    /// Its name in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pinned => "pinned",
            Self::Unpinned => "unpinned",
            Self::NotPinned => "not_pinned",
            Self::NoTable => "no_table",
            Self::UnknownInstance => "unknown_instance",
            Self::Full => "full",
            Self::Unavailable => "unavailable",
        }
    }

    /// Whether the request was carried out (`pinned`, `unpinned`; `not_pinned` is an
    /// UNPIN with nothing to remove).
    pub fn is_done(self) -> bool {
        matches!(self, Self::Pinned | Self::Unpinned)
    }

    /// Every outcome, in byte order.
    pub const ALL: [Self; 7] = [
        Self::Pinned,
        Self::Unpinned,
        Self::NotPinned,
        Self::NoTable,
        Self::UnknownInstance,
        Self::Full,
        Self::Unavailable,
    ];
}

impl std::fmt::Display for PinOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One frame of the backend link protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkFrame {
    /// 0x40 edge -> backend: first frame on a link.
    Hello {
        /// Link protocol version.
        version: u8,
        /// The edge's id.
        edge_id: String,
        /// The edge's current route epoch.
        epoch: u64,
        /// The edge's challenge for the link handshake (§9.3; absent from an edge that
        /// predates it).
        nonce: Option<LinkNonce>,
        /// Link features the edge supports ([`LINK_FEATURE_FORWARD_DONE`]); after the
        /// nonce, absent (0) from an edge that predates them. Sent only with a nonce.
        features: u64,
    },
    /// 0x41 backend -> edge: answer to HELLO.
    Welcome {
        /// Link protocol version.
        version: u8,
        /// The backend instance's id.
        instance_id: String,
        /// FORWARD frames the edge may send before it needs more credit.
        credits: u32,
        /// The backend expects a link PING at least this often.
        heartbeat_ms: u32,
        /// A backend with a link secret: its challenge and its proof (§9.3).
        auth: Option<LinkWelcomeAuth>,
        /// The features of the edge's LINK_HELLO this backend will use (after `auth`;
        /// absent = 0).
        features: u64,
    },
    /// 0x42 edge -> backend: a session is bound to this instance.
    SessionOpen {
        /// Link-local handle for the session.
        handle: u64,
        /// The session's id.
        session_id: SessionId,
        /// The authenticated player.
        player_id: String,
        /// Fencing token of the player's ownership (grows on every takeover).
        fencing: u64,
        /// Free-form attributes (transport, client version, region...).
        attrs: Vec<(String, String)>,
    },
    /// 0x43 edge -> backend: the session ended (expired, kicked, logged out).
    SessionClose {
        /// The session.
        handle: u64,
        /// Why.
        code: CloseCode,
    },
    /// 0x44 edge -> backend: the client dropped; the session lingers (S5, S8 degrade).
    SessionDetached {
        /// The session.
        handle: u64,
        /// How long the edge keeps it before it expires.
        linger_ms: u32,
    },
    /// 0x45 edge -> backend: the client came back.
    SessionReattached {
        /// The session.
        handle: u64,
        /// Whether the client lost downstream messages and must resync.
        gap: bool,
    },
    /// 0x46 edge -> backend: one upstream message.
    Forward {
        /// The session.
        handle: u64,
        /// Client message id.
        msg_id: u32,
        /// The route epoch the edge used.
        epoch: u64,
        /// The client's seq (0 for best-effort).
        client_seq: u64,
        /// Traffic class.
        class: TrafficClass,
        /// The message body.
        payload: Bytes,
    },
    /// 0x47 backend -> edge: one downstream message for a session.
    Push {
        /// The session.
        handle: u64,
        /// Message id for the client.
        msg_id: u32,
        /// Traffic class.
        class: TrafficClass,
        /// The message body.
        payload: Bytes,
    },
    /// 0x48 backend -> edge: end this session (the client gets CLOSE with `code`).
    Kick {
        /// The session.
        handle: u64,
        /// Close code for the client.
        code: CloseCode,
        /// Human-readable detail.
        message: String,
    },
    /// 0x49 backend -> edge: one forwarded message was refused (busy, stale epoch...).
    Refuse {
        /// The session.
        handle: u64,
        /// The refused message's id.
        msg_id: u32,
        /// The refused message's client seq.
        client_seq: u64,
        /// Why (`busy`, `stale_epoch`, ...).
        code: CloseCode,
        /// Wait before sending to this instance again; 0 = no hint.
        retry_after_ms: u32,
        /// The backend's route epoch (for `stale_epoch`: refresh to at least this).
        epoch: u64,
    },
    /// 0x55 backend -> edge (with [`LINK_FEATURE_FORWARD_DONE`]): the FORWARD of
    /// (`handle`, `client_seq`) was processed; every PUSH its handler sent precedes this.
    ForwardDone {
        /// The session.
        handle: u64,
        /// The processed message's client seq.
        client_seq: u64,
    },
    /// 0x56 backend -> edge (with [`LINK_FEATURE_HELD_ANSWERS`]): a push sent while the
    /// FORWARD of (`handle`, `client_seq`) was being processed, part of its answer: the
    /// edge holds it until that FORWARD's FORWARD_DONE (or REFUSE) and then queues the
    /// held pushes and the answer for the session together.
    AnswerPush {
        /// The session.
        handle: u64,
        /// The client seq of the message being answered.
        client_seq: u64,
        /// Application message id.
        msg_id: u32,
        /// Delivery class.
        class: TrafficClass,
        /// Body.
        payload: Bytes,
    },
    /// 0x4A backend -> edge: route this session's messages for `service` by `key` (e.g.
    /// the room the player joined).
    Bind {
        /// The session.
        handle: u64,
        /// The key-routed service.
        service: String,
        /// The business key.
        key: String,
    },
    /// 0x4B backend -> edge: `key` lives on `instance_id` from now on (a room created here).
    Pin {
        /// Player or room.
        kind: PinKind,
        /// The key.
        key: String,
        /// The instance that holds it.
        instance_id: String,
        /// Names the request in its PIN_RESULT (with [`LINK_FEATURE_PIN_RESULT`]); 0 (sent
        /// as nothing: the field is absent) = no answer wanted.
        request_id: u64,
    },
    /// 0x5B backend -> edge (with [`LINK_FEATURE_PIN_RESULT`]): forget the pin of `key`
    /// (the room ended); answered by PIN_RESULT when `request_id` is not 0.
    Unpin {
        /// Names the request in its PIN_RESULT (0 = no answer wanted).
        request_id: u64,
        /// Player or room.
        kind: PinKind,
        /// The key.
        key: String,
    },
    /// 0x5C edge -> backend: what became of a PIN or UNPIN with a request id.
    PinResult {
        /// The request's id.
        request_id: u64,
        /// What became of it.
        outcome: PinOutcome,
    },
    /// 0x4C either way: the receiver may send `credits` more FORWARD (edge) or PUSH
    /// (backend) frames.
    Credit {
        /// Additional frames allowed.
        credits: u32,
    },
    /// 0x4D either way: liveness probe.
    Ping {
        /// Echoed by PONG.
        timestamp: u64,
    },
    /// 0x4E either way: answer to PING.
    Pong {
        /// The PING's value.
        timestamp: u64,
    },
    /// 0x4F either way: the link ends.
    Close {
        /// Why.
        code: CloseCode,
        /// Human-readable detail.
        message: String,
    },
    /// 0x50 backend -> edge: make a session a member of a channel (answered by
    /// CHANNEL_RESULT).
    ChannelJoin {
        /// Names the request in its CHANNEL_RESULT.
        request_id: u64,
        /// The session.
        handle: u64,
        /// The channel (`kind:name` or `kind`).
        channel: String,
        /// Deliver what the member missed after this position first (recovery), or a
        /// HISTORY_LOST marker when that cannot be done.
        since: Option<ChannelPosition>,
    },
    /// 0x51 backend -> edge: end a session's membership (answered by CHANNEL_RESULT).
    ChannelLeave {
        /// Names the request in its CHANNEL_RESULT.
        request_id: u64,
        /// The session.
        handle: u64,
        /// The channel.
        channel: String,
    },
    /// 0x52 backend -> edge: publish to a channel's members on this edge; uses one PUSH
    /// credit; answered by CHANNEL_RESULT. A retry with the same `request_id` is answered
    /// with the first one's result, never published twice.
    ChannelPublish {
        /// Names the request; also the publication's idempotency key on this channel.
        request_id: u64,
        /// The channel.
        channel: String,
        /// Critical (announcement), normal (reliable) or best-effort.
        class: TrafficClass,
        /// The publication's body.
        payload: Bytes,
    },
    /// 0x54 edge -> backend: the edge's proof of the link secret, right after LINK_WELCOME
    /// (§9.3).
    Auth {
        /// HMAC-SHA256 of the edge's side (see [`crate::link_auth`]).
        proof: LinkProof,
    },
    /// 0x57 edge -> backend (with [`LINK_FEATURE_CHANNEL_INTEREST`]): the edge has the
    /// channel (`present`: it was created here, by a join or a publish) or no longer has it
    /// (reclaimed). `seq` grows by one per notice on the link, from 1.
    ChannelInterest {
        /// This notice's number on the link.
        seq: u64,
        /// Whether the edge has the channel now.
        present: bool,
        /// The channel.
        channel: String,
    },
    /// 0x58 backend -> edge (with [`LINK_FEATURE_CHANNEL_INTEREST`]): every CHANNEL_INTEREST
    /// up to `seq` was taken; every publish the backend decides after this follows them.
    ChannelInterestAck {
        /// The last notice taken.
        seq: u64,
    },
    /// 0x59 backend -> edge: push to a player wherever its session is (this edge, or the
    /// edge its presence names); uses one PUSH credit; answered by PLAYER_PUSH_RESULT.
    PlayerPush {
        /// Names the request in its answer.
        request_id: u64,
        /// The player.
        player: String,
        /// Application message id.
        msg_id: u32,
        /// Traffic class.
        class: TrafficClass,
        /// Body.
        payload: Bytes,
    },
    /// 0x5A edge -> backend: what became of a PLAYER_PUSH.
    PlayerPushResult {
        /// The request's id.
        request_id: u64,
        /// What became of it.
        outcome: PlayerPushOutcome,
    },
    /// 0x53 edge -> backend: how a channel request ended.
    ChannelResult {
        /// The request's id.
        request_id: u64,
        /// `normal` (0) when done, else why not (`queue_full`, `rate_limited`...).
        code: CloseCode,
        /// Wait this long before retrying (0 = no hint).
        retry_after_ms: u32,
        /// A publication's position (epoch, offset), a join's live position.
        position: ChannelPosition,
        /// A publish with this id was already taken: `position` is the first one's.
        duplicate: bool,
    },
}

fn str_len(s: &str) -> usize {
    varint_len(s.len() as u64) + s.len()
}

fn put_str(out: &mut impl BufMut, s: &str) {
    put_varint(out, s.len() as u64);
    out.put_slice(s.as_bytes());
}

fn get_str(r: &mut Reader, field: &'static str, max: usize) -> Result<String, FrameError> {
    let bytes = r.bytes_with_len(field, max)?;
    String::from_utf8(bytes.to_vec()).map_err(|_| FrameError::Malformed {
        field,
        what: "not UTF-8",
    })
}

/// The msg id of a PUSH, ANSWER_PUSH or PLAYER_PUSH: never one of the ids the edge keeps
/// for itself downstream (from [`RESERVED_MSG_IDS_START`] up: channel events, §12.2),
/// except [`ANSWER_MSG_ID`], which a backend pushes to answer a request (§13).
fn get_pushed_msg_id(r: &mut Reader) -> Result<u32, FrameError> {
    let msg_id = r.varint_u32("msg_id")?;
    if msg_id >= RESERVED_MSG_IDS_START && msg_id != ANSWER_MSG_ID {
        return Err(FrameError::Malformed {
            field: "msg_id",
            what: "reserved for the edge's own messages (0xFFFFFF00 and up; only the answer id 0xFFFFFF02 may be pushed)",
        });
    }
    Ok(msg_id)
}

fn get_class(r: &mut Reader) -> Result<TrafficClass, FrameError> {
    TrafficClass::from_bits(r.u8("class")?).ok_or(FrameError::Malformed {
        field: "class",
        what: "unknown traffic class",
    })
}

impl LinkFrame {
    fn type_byte(&self) -> u8 {
        match self {
            Self::Hello { .. } => 0x40,
            Self::Welcome { .. } => 0x41,
            Self::SessionOpen { .. } => 0x42,
            Self::SessionClose { .. } => 0x43,
            Self::SessionDetached { .. } => 0x44,
            Self::SessionReattached { .. } => 0x45,
            Self::Forward { .. } => 0x46,
            Self::Push { .. } => 0x47,
            Self::Kick { .. } => 0x48,
            Self::Refuse { .. } => 0x49,
            Self::Bind { .. } => 0x4A,
            Self::Pin { .. } => 0x4B,
            Self::Credit { .. } => 0x4C,
            Self::Ping { .. } => 0x4D,
            Self::Pong { .. } => 0x4E,
            Self::Close { .. } => 0x4F,
            Self::ChannelJoin { .. } => 0x50,
            Self::ChannelLeave { .. } => 0x51,
            Self::ChannelPublish { .. } => 0x52,
            Self::ChannelResult { .. } => 0x53,
            Self::Auth { .. } => 0x54,
            Self::ForwardDone { .. } => 0x55,
            Self::AnswerPush { .. } => 0x56,
            Self::ChannelInterest { .. } => 0x57,
            Self::ChannelInterestAck { .. } => 0x58,
            Self::PlayerPush { .. } => 0x59,
            Self::PlayerPushResult { .. } => 0x5A,
            Self::Unpin { .. } => 0x5B,
            Self::PinResult { .. } => 0x5C,
        }
    }

    /// The first text field of a frame a backend sends that is longer than the decoder
    /// takes ([`MAX_NAME_LEN`] for names and keys, [`MAX_CHANNEL_NAME_LEN`] for channels,
    /// [`MAX_REASON_LEN`] for reasons), if any: the edge would take such a frame for a
    /// malformed one and close the link (every session on it), so a sender refuses it first.
    pub fn oversized_field(&self) -> Option<&'static str> {
        let over = |s: &str, max: usize| s.len() > max;
        match self {
            Self::Kick { message, .. } if over(message, MAX_REASON_LEN) => Some("message"),
            Self::Close { message, .. } if over(message, MAX_REASON_LEN) => Some("message"),
            Self::Bind { service, .. } if over(service, MAX_NAME_LEN) => Some("service"),
            Self::Bind { key, .. } | Self::Pin { key, .. } | Self::Unpin { key, .. }
                if over(key, MAX_NAME_LEN) =>
            {
                Some("key")
            }
            Self::Pin { instance_id, .. } if over(instance_id, MAX_NAME_LEN) => Some("instance_id"),
            Self::ChannelJoin { channel, .. }
            | Self::ChannelLeave { channel, .. }
            | Self::ChannelPublish { channel, .. }
                if over(channel, MAX_CHANNEL_NAME_LEN) =>
            {
                Some("channel")
            }
            Self::PlayerPush { player, .. } if over(player, MAX_NAME_LEN) => Some("player"),
            _ => None,
        }
    }

    /// Exact number of bytes [`LinkFrame::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        1 + match self {
            Self::Hello {
                edge_id,
                epoch,
                nonce,
                features,
                ..
            } => {
                1 + str_len(edge_id)
                    + varint_len(*epoch)
                    + nonce.map_or(0, |n| n.len() + features_len(*features))
            }
            Self::Welcome {
                instance_id,
                credits,
                heartbeat_ms,
                auth,
                features,
                ..
            } => {
                1 + str_len(instance_id)
                    + varint_len((*credits).into())
                    + varint_len((*heartbeat_ms).into())
                    + auth.map_or(0, |_| LINK_NONCE_LEN + LINK_PROOF_LEN)
                    + features_len(*features)
            }
            Self::Auth { .. } => LINK_PROOF_LEN,
            Self::SessionOpen {
                handle,
                player_id,
                fencing,
                attrs,
                ..
            } => {
                varint_len(*handle)
                    + ID_LEN
                    + str_len(player_id)
                    + varint_len(*fencing)
                    + varint_len(attrs.len() as u64)
                    + attrs
                        .iter()
                        .map(|(k, v)| str_len(k) + str_len(v))
                        .sum::<usize>()
            }
            Self::SessionClose { handle, .. } => varint_len(*handle) + 2,
            Self::SessionDetached { handle, linger_ms } => {
                varint_len(*handle) + varint_len((*linger_ms).into())
            }
            Self::SessionReattached { handle, .. } => varint_len(*handle) + 1,
            Self::Forward {
                handle,
                msg_id,
                epoch,
                client_seq,
                payload,
                ..
            } => {
                varint_len(*handle)
                    + varint_len((*msg_id).into())
                    + varint_len(*epoch)
                    + varint_len(*client_seq)
                    + 1
                    + payload.len()
            }
            Self::Push {
                handle,
                msg_id,
                payload,
                ..
            } => varint_len(*handle) + varint_len((*msg_id).into()) + 1 + payload.len(),
            Self::Kick {
                handle, message, ..
            } => varint_len(*handle) + 2 + str_len(message),
            Self::ForwardDone { handle, client_seq } => {
                varint_len(*handle) + varint_len(*client_seq)
            }
            Self::AnswerPush {
                handle,
                client_seq,
                msg_id,
                payload,
                ..
            } => {
                varint_len(*handle)
                    + varint_len(*client_seq)
                    + varint_len((*msg_id).into())
                    + 1
                    + payload.len()
            }
            Self::Refuse {
                handle,
                msg_id,
                client_seq,
                retry_after_ms,
                epoch,
                ..
            } => {
                varint_len(*handle)
                    + varint_len((*msg_id).into())
                    + varint_len(*client_seq)
                    + 2
                    + varint_len((*retry_after_ms).into())
                    + varint_len(*epoch)
            }
            Self::Bind {
                handle,
                service,
                key,
            } => varint_len(*handle) + str_len(service) + str_len(key),
            Self::Pin {
                key,
                instance_id,
                request_id,
                ..
            } => 1 + str_len(key) + str_len(instance_id) + features_len(*request_id),
            Self::Unpin {
                request_id, key, ..
            } => varint_len(*request_id) + 1 + str_len(key),
            Self::PinResult { request_id, .. } => varint_len(*request_id) + 1,
            Self::Credit { credits } => varint_len((*credits).into()),
            Self::Ping { timestamp } | Self::Pong { timestamp } => varint_len(*timestamp),
            Self::Close { message, .. } => 2 + str_len(message),
            Self::ChannelJoin {
                request_id,
                handle,
                channel,
                since,
            } => {
                varint_len(*request_id)
                    + varint_len(*handle)
                    + str_len(channel)
                    + 1
                    + since.map_or(0, |p| varint_len(p.epoch) + varint_len(p.offset))
            }
            Self::ChannelLeave {
                request_id,
                handle,
                channel,
            } => varint_len(*request_id) + varint_len(*handle) + str_len(channel),
            Self::ChannelPublish {
                request_id,
                channel,
                payload,
                ..
            } => varint_len(*request_id) + str_len(channel) + 1 + payload.len(),
            Self::ChannelInterest { seq, channel, .. } => varint_len(*seq) + 1 + str_len(channel),
            Self::ChannelInterestAck { seq } => varint_len(*seq),
            Self::PlayerPush {
                request_id,
                player,
                msg_id,
                payload,
                ..
            } => {
                varint_len(*request_id)
                    + str_len(player)
                    + varint_len((*msg_id).into())
                    + 1
                    + payload.len()
            }
            Self::PlayerPushResult { request_id, .. } => varint_len(*request_id) + 1,
            Self::ChannelResult {
                request_id,
                retry_after_ms,
                position,
                ..
            } => {
                varint_len(*request_id)
                    + 2
                    + varint_len((*retry_after_ms).into())
                    + varint_len(position.epoch)
                    + varint_len(position.offset)
                    + 1
            }
        }
    }

    /// Appends the frame (type byte first, no length prefix).
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u8(self.type_byte());
        match self {
            Self::Hello {
                version,
                edge_id,
                epoch,
                nonce,
                features,
            } => {
                out.put_u8(*version);
                put_str(out, edge_id);
                put_varint(out, *epoch);
                if let Some(n) = nonce {
                    out.put_slice(n);
                    put_features(out, *features);
                }
            }
            Self::Welcome {
                version,
                instance_id,
                credits,
                heartbeat_ms,
                auth,
                features,
            } => {
                out.put_u8(*version);
                put_str(out, instance_id);
                put_varint(out, (*credits).into());
                put_varint(out, (*heartbeat_ms).into());
                if let Some(a) = auth {
                    out.put_slice(&a.nonce);
                    out.put_slice(&a.proof);
                }
                put_features(out, *features);
            }
            Self::ForwardDone { handle, client_seq } => {
                put_varint(out, *handle);
                put_varint(out, *client_seq);
            }
            Self::AnswerPush {
                handle,
                client_seq,
                msg_id,
                class,
                payload,
            } => {
                put_varint(out, *handle);
                put_varint(out, *client_seq);
                put_varint(out, (*msg_id).into());
                out.put_u8(*class as u8);
                out.put_slice(payload);
            }
            Self::Auth { proof } => out.put_slice(proof),
            Self::SessionOpen {
                handle,
                session_id,
                player_id,
                fencing,
                attrs,
            } => {
                put_varint(out, *handle);
                out.put_slice(session_id);
                put_str(out, player_id);
                put_varint(out, *fencing);
                put_varint(out, attrs.len() as u64);
                for (k, v) in attrs {
                    put_str(out, k);
                    put_str(out, v);
                }
            }
            Self::SessionClose { handle, code } => {
                put_varint(out, *handle);
                out.put_u16(code.to_u16());
            }
            Self::SessionDetached { handle, linger_ms } => {
                put_varint(out, *handle);
                put_varint(out, (*linger_ms).into());
            }
            Self::SessionReattached { handle, gap } => {
                put_varint(out, *handle);
                out.put_u8(u8::from(*gap));
            }
            Self::Forward {
                handle,
                msg_id,
                epoch,
                client_seq,
                class,
                payload,
            } => {
                put_varint(out, *handle);
                put_varint(out, (*msg_id).into());
                put_varint(out, *epoch);
                put_varint(out, *client_seq);
                out.put_u8(*class as u8);
                out.put_slice(payload);
            }
            Self::Push {
                handle,
                msg_id,
                class,
                payload,
            } => {
                put_varint(out, *handle);
                put_varint(out, (*msg_id).into());
                out.put_u8(*class as u8);
                out.put_slice(payload);
            }
            Self::Kick {
                handle,
                code,
                message,
            } => {
                put_varint(out, *handle);
                out.put_u16(code.to_u16());
                put_str(out, message);
            }
            Self::Refuse {
                handle,
                msg_id,
                client_seq,
                code,
                retry_after_ms,
                epoch,
            } => {
                put_varint(out, *handle);
                put_varint(out, (*msg_id).into());
                put_varint(out, *client_seq);
                out.put_u16(code.to_u16());
                put_varint(out, (*retry_after_ms).into());
                put_varint(out, *epoch);
            }
            Self::Bind {
                handle,
                service,
                key,
            } => {
                put_varint(out, *handle);
                put_str(out, service);
                put_str(out, key);
            }
            Self::Pin {
                kind,
                key,
                instance_id,
                request_id,
            } => {
                out.put_u8(*kind as u8);
                put_str(out, key);
                put_str(out, instance_id);
                // Trailing and optional (§1.1): absent when 0, so an edge that predates it
                // reads the PIN it knows.
                put_features(out, *request_id);
            }
            Self::Unpin {
                request_id,
                kind,
                key,
            } => {
                put_varint(out, *request_id);
                out.put_u8(*kind as u8);
                put_str(out, key);
            }
            Self::PinResult {
                request_id,
                outcome,
            } => {
                put_varint(out, *request_id);
                out.put_u8(*outcome as u8);
            }
            Self::Credit { credits } => put_varint(out, (*credits).into()),
            Self::Ping { timestamp } | Self::Pong { timestamp } => put_varint(out, *timestamp),
            Self::Close { code, message } => {
                out.put_u16(code.to_u16());
                put_str(out, message);
            }
            Self::ChannelJoin {
                request_id,
                handle,
                channel,
                since,
            } => {
                put_varint(out, *request_id);
                put_varint(out, *handle);
                put_str(out, channel);
                match since {
                    None => out.put_u8(0),
                    Some(p) => {
                        out.put_u8(1);
                        put_varint(out, p.epoch);
                        put_varint(out, p.offset);
                    }
                }
            }
            Self::ChannelLeave {
                request_id,
                handle,
                channel,
            } => {
                put_varint(out, *request_id);
                put_varint(out, *handle);
                put_str(out, channel);
            }
            Self::ChannelPublish {
                request_id,
                channel,
                class,
                payload,
            } => {
                put_varint(out, *request_id);
                put_str(out, channel);
                out.put_u8(*class as u8);
                out.put_slice(payload);
            }
            Self::ChannelResult {
                request_id,
                code,
                retry_after_ms,
                position,
                duplicate,
            } => {
                put_varint(out, *request_id);
                out.put_u16(code.to_u16());
                put_varint(out, (*retry_after_ms).into());
                put_varint(out, position.epoch);
                put_varint(out, position.offset);
                out.put_u8(u8::from(*duplicate));
            }
            Self::ChannelInterest {
                seq,
                present,
                channel,
            } => {
                put_varint(out, *seq);
                out.put_u8(u8::from(*present));
                put_str(out, channel);
            }
            Self::ChannelInterestAck { seq } => put_varint(out, *seq),
            Self::PlayerPush {
                request_id,
                player,
                msg_id,
                class,
                payload,
            } => {
                put_varint(out, *request_id);
                put_str(out, player);
                put_varint(out, (*msg_id).into());
                out.put_u8(*class as u8);
                out.put_slice(payload);
            }
            Self::PlayerPushResult {
                request_id,
                outcome,
            } => {
                put_varint(out, *request_id);
                out.put_u8(*outcome as u8);
            }
        }
    }

    /// Decodes one whole link frame. Never panics on any input.
    pub fn decode(bytes: Bytes) -> Result<LinkFrame, FrameError> {
        let mut r = Reader::new(bytes);
        let t = r.u8("type").map_err(|_| FrameError::Empty)?;
        Ok(match t {
            0x40 => {
                let version = r.u8("version")?;
                let edge_id = get_str(&mut r, "edge_id", MAX_NAME_LEN)?;
                let epoch = r.varint("epoch")?;
                // Present when the rest holds it; shorter trailing bytes are ignored (§1.1).
                let nonce = (r.remaining() >= LINK_NONCE_LEN)
                    .then(|| r.array("nonce"))
                    .transpose()?;
                let features = match nonce {
                    Some(_) => get_features(&mut r)?,
                    None => 0,
                };
                Self::Hello {
                    version,
                    edge_id,
                    epoch,
                    nonce,
                    features,
                }
            }
            0x41 => Self::Welcome {
                version: r.u8("version")?,
                instance_id: get_str(&mut r, "instance_id", MAX_NAME_LEN)?,
                credits: r.varint_u32("credits")?,
                heartbeat_ms: r.varint_u32("heartbeat_ms")?,
                // A features varint is at most 10 bytes, so 48 bytes or more left are the
                // challenge and proof.
                auth: if r.remaining() >= LINK_NONCE_LEN + LINK_PROOF_LEN {
                    Some(LinkWelcomeAuth {
                        nonce: r.array("nonce")?,
                        proof: r.array("proof")?,
                    })
                } else {
                    None
                },
                features: get_features(&mut r)?,
            },
            0x55 => Self::ForwardDone {
                handle: r.varint("handle")?,
                client_seq: r.varint("client_seq")?,
            },
            0x56 => Self::AnswerPush {
                handle: r.varint("handle")?,
                client_seq: r.varint("client_seq")?,
                msg_id: get_pushed_msg_id(&mut r)?,
                class: get_class(&mut r)?,
                payload: r.rest(),
            },
            0x54 => Self::Auth {
                proof: r.array("proof")?,
            },
            0x42 => {
                let handle = r.varint("handle")?;
                let session_id = r.array("session_id")?;
                let player_id = get_str(&mut r, "player_id", MAX_NAME_LEN)?;
                let fencing = r.varint("fencing")?;
                let n = r.varint("attrs")?;
                if n > MAX_ATTRS as u64 {
                    return Err(FrameError::Malformed {
                        field: "attrs",
                        what: "too many attributes",
                    });
                }
                let mut attrs = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let k = get_str(&mut r, "attr_key", MAX_NAME_LEN)?;
                    let v = get_str(&mut r, "attr_value", MAX_NAME_LEN)?;
                    attrs.push((k, v));
                }
                Self::SessionOpen {
                    handle,
                    session_id,
                    player_id,
                    fencing,
                    attrs,
                }
            }
            0x43 => Self::SessionClose {
                handle: r.varint("handle")?,
                code: CloseCode::from_u16(r.u16("code")?),
            },
            0x44 => Self::SessionDetached {
                handle: r.varint("handle")?,
                linger_ms: r.varint_u32("linger_ms")?,
            },
            0x45 => Self::SessionReattached {
                handle: r.varint("handle")?,
                gap: match r.u8("gap")? {
                    0 => false,
                    1 => true,
                    _ => {
                        return Err(FrameError::Malformed {
                            field: "gap",
                            what: "not 0 or 1",
                        })
                    }
                },
            },
            0x46 => Self::Forward {
                handle: r.varint("handle")?,
                msg_id: r.varint_u32("msg_id")?,
                epoch: r.varint("epoch")?,
                client_seq: r.varint("client_seq")?,
                class: get_class(&mut r)?,
                payload: r.rest(),
            },
            0x47 => Self::Push {
                handle: r.varint("handle")?,
                msg_id: get_pushed_msg_id(&mut r)?,
                class: get_class(&mut r)?,
                payload: r.rest(),
            },
            0x48 => Self::Kick {
                handle: r.varint("handle")?,
                code: CloseCode::from_u16(r.u16("code")?),
                message: get_str(&mut r, "message", MAX_REASON_LEN)?,
            },
            0x49 => Self::Refuse {
                handle: r.varint("handle")?,
                msg_id: r.varint_u32("msg_id")?,
                client_seq: r.varint("client_seq")?,
                code: CloseCode::from_u16(r.u16("code")?),
                retry_after_ms: r.varint_u32("retry_after_ms")?,
                epoch: r.varint("epoch")?,
            },
            0x4A => Self::Bind {
                handle: r.varint("handle")?,
                service: get_str(&mut r, "service", MAX_NAME_LEN)?,
                key: get_str(&mut r, "key", MAX_NAME_LEN)?,
            },
            0x4B => Self::Pin {
                kind: get_pin_kind(&mut r)?,
                key: get_str(&mut r, "key", MAX_NAME_LEN)?,
                instance_id: get_str(&mut r, "instance_id", MAX_NAME_LEN)?,
                // Absent from a backend that predates it: no answer wanted.
                request_id: if r.remaining() == 0 {
                    0
                } else {
                    r.varint("request_id")?
                },
            },
            0x5B => Self::Unpin {
                request_id: r.varint("request_id")?,
                kind: get_pin_kind(&mut r)?,
                key: get_str(&mut r, "key", MAX_NAME_LEN)?,
            },
            0x5C => Self::PinResult {
                request_id: r.varint("request_id")?,
                outcome: PinOutcome::from_u8(r.u8("outcome")?).ok_or(FrameError::Malformed {
                    field: "outcome",
                    what: "unknown pin outcome",
                })?,
            },
            0x4C => Self::Credit {
                credits: r.varint_u32("credits")?,
            },
            0x4D => Self::Ping {
                timestamp: r.varint("timestamp")?,
            },
            0x4E => Self::Pong {
                timestamp: r.varint("timestamp")?,
            },
            0x4F => Self::Close {
                code: CloseCode::from_u16(r.u16("code")?),
                message: get_str(&mut r, "message", MAX_REASON_LEN)?,
            },
            0x50 => Self::ChannelJoin {
                request_id: r.varint("request_id")?,
                handle: r.varint("handle")?,
                channel: get_str(&mut r, "channel", MAX_CHANNEL_NAME_LEN)?,
                since: match r.u8("since")? {
                    0 => None,
                    1 => Some(ChannelPosition {
                        epoch: r.varint("epoch")?,
                        offset: r.varint("offset")?,
                    }),
                    _ => {
                        return Err(FrameError::Malformed {
                            field: "since",
                            what: "not 0 or 1",
                        })
                    }
                },
            },
            0x51 => Self::ChannelLeave {
                request_id: r.varint("request_id")?,
                handle: r.varint("handle")?,
                channel: get_str(&mut r, "channel", MAX_CHANNEL_NAME_LEN)?,
            },
            0x52 => Self::ChannelPublish {
                request_id: r.varint("request_id")?,
                channel: get_str(&mut r, "channel", MAX_CHANNEL_NAME_LEN)?,
                class: get_class(&mut r)?,
                payload: r.rest(),
            },
            0x53 => Self::ChannelResult {
                request_id: r.varint("request_id")?,
                code: CloseCode::from_u16(r.u16("code")?),
                retry_after_ms: r.varint_u32("retry_after_ms")?,
                position: ChannelPosition {
                    epoch: r.varint("epoch")?,
                    offset: r.varint("offset")?,
                },
                duplicate: match r.u8("duplicate")? {
                    0 => false,
                    1 => true,
                    _ => {
                        return Err(FrameError::Malformed {
                            field: "duplicate",
                            what: "not 0 or 1",
                        })
                    }
                },
            },
            0x57 => Self::ChannelInterest {
                seq: r.varint("seq")?,
                present: match r.u8("present")? {
                    0 => false,
                    1 => true,
                    _ => {
                        return Err(FrameError::Malformed {
                            field: "present",
                            what: "not 0 or 1",
                        })
                    }
                },
                channel: get_str(&mut r, "channel", MAX_CHANNEL_NAME_LEN)?,
            },
            0x58 => Self::ChannelInterestAck {
                seq: r.varint("seq")?,
            },
            0x59 => Self::PlayerPush {
                request_id: r.varint("request_id")?,
                player: get_str(&mut r, "player", MAX_NAME_LEN)?,
                msg_id: get_pushed_msg_id(&mut r)?,
                class: get_class(&mut r)?,
                payload: r.rest(),
            },
            0x5A => Self::PlayerPushResult {
                request_id: r.varint("request_id")?,
                outcome: PlayerPushOutcome::from_u8(r.u8("outcome")?).ok_or(
                    FrameError::Malformed {
                        field: "outcome",
                        what: "unknown player push outcome",
                    },
                )?,
            },
            other => return Err(FrameError::UnknownType(other)),
        })
    }
}

/// The `kind` byte of PIN and UNPIN.
fn get_pin_kind(r: &mut Reader) -> Result<PinKind, FrameError> {
    match r.u8("kind")? {
        0 => Ok(PinKind::Player),
        1 => Ok(PinKind::Room),
        _ => Err(FrameError::Malformed {
            field: "kind",
            what: "unknown pin kind",
        }),
    }
}

/// Bytes of an optional trailing varint (`features`, PIN's `request_id`; none when 0).
fn features_len(features: u64) -> usize {
    if features == 0 {
        0
    } else {
        varint_len(features)
    }
}

/// Writes an optional trailing varint (`features`, PIN's `request_id`; nothing when 0).
fn put_features(out: &mut impl BufMut, features: u64) {
    if features != 0 {
        put_varint(out, features);
    }
}

/// Reads an optional trailing `features` varint: 0 when nothing is left.
fn get_features(r: &mut Reader) -> Result<u64, FrameError> {
    if r.remaining() == 0 {
        Ok(0)
    } else {
        r.varint("features")
    }
}

/// Length-delimited link framing: the client protocol's stream framing with link frames.
#[derive(Debug, Clone, Copy)]
pub struct LinkCodec {
    stream: StreamCodec,
}

impl LinkCodec {
    /// A codec accepting link frames of up to `max_frame_size` bytes.
    pub fn new(max_frame_size: usize) -> Self {
        Self {
            stream: StreamCodec::new(max_frame_size),
        }
    }

    /// Appends the length prefix and frame to `out`.
    pub fn encode(&self, frame: &LinkFrame, out: &mut BytesMut) -> Result<(), FrameError> {
        self.stream
            .encode_with(frame.encoded_len(), out, |out| frame.encode(out))
    }

    /// Takes one link frame off the front of `buf` (`Ok(None)` if incomplete).
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<LinkFrame>, FrameError> {
        match self.stream.split(buf)? {
            Some(body) => LinkFrame::decode(body).map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    /// Regression (2026-12-05): the edge took a backend's PUSH of any msg id, so a backend
    /// written from PROTOCOL.md could push `0xFFFFFF01` and its clients would read a
    /// channel event the edge never made. Every push kind refuses the edge's reserved ids
    /// but the answer id, and still takes the ids below them.
    #[test]
    fn pushes_of_the_edges_reserved_msg_ids_do_not_decode() {
        let encoded = |f: &LinkFrame| {
            let mut b = BytesMut::new();
            f.encode(&mut b);
            b.freeze()
        };
        let pushes = |msg_id: u32| {
            [
                LinkFrame::Push {
                    handle: 1,
                    msg_id,
                    class: TrafficClass::Normal,
                    payload: Bytes::from_static(b"x"),
                },
                LinkFrame::AnswerPush {
                    handle: 1,
                    client_seq: 2,
                    msg_id,
                    class: TrafficClass::Critical,
                    payload: Bytes::from_static(b"x"),
                },
                LinkFrame::PlayerPush {
                    request_id: 3,
                    player: "p".into(),
                    msg_id,
                    class: TrafficClass::Normal,
                    payload: Bytes::from_static(b"x"),
                },
            ]
        };
        for msg_id in [0, RESERVED_MSG_IDS_START - 1, ANSWER_MSG_ID] {
            for f in pushes(msg_id) {
                assert_eq!(LinkFrame::decode(encoded(&f)), Ok(f), "msg id {msg_id:#x}");
            }
        }
        for msg_id in [RESERVED_MSG_IDS_START, 0xFFFF_FF01, 0xFFFF_FF03, u32::MAX] {
            for f in pushes(msg_id) {
                assert!(
                    matches!(
                        LinkFrame::decode(encoded(&f)),
                        Err(FrameError::Malformed {
                            field: "msg_id",
                            ..
                        })
                    ),
                    "msg id {msg_id:#x}: {f:?}"
                );
            }
        }
    }

    use super::*;
    use crate::frame::tests::arb_class;
    use proptest::prelude::*;

    /// A msg id a backend may push: below the edge's reserved ids, or the answer id.
    fn pushed_msg_id() -> impl Strategy<Value = u32> {
        prop_oneof![0..RESERVED_MSG_IDS_START, Just(ANSWER_MSG_ID)]
    }

    fn name() -> impl Strategy<Value = String> {
        "[a-z0-9:_-]{0,24}"
    }

    fn code() -> impl Strategy<Value = CloseCode> {
        any::<u16>().prop_map(CloseCode::from_u16)
    }

    fn payload() -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..200).prop_map(Bytes::from)
    }

    fn arb_link_frame() -> impl Strategy<Value = LinkFrame> {
        prop_oneof![
            (
                any::<u8>(),
                name(),
                any::<u64>(),
                proptest::option::of(any::<[u8; 16]>()),
                any::<u64>()
            )
                .prop_map(|(version, edge_id, epoch, nonce, features)| {
                    LinkFrame::Hello {
                        version,
                        edge_id,
                        epoch,
                        nonce,
                        // Features travel only after a nonce.
                        features: if nonce.is_some() { features } else { 0 },
                    }
                }),
            (
                any::<u8>(),
                name(),
                any::<u32>(),
                any::<u32>(),
                proptest::option::of((any::<[u8; 16]>(), any::<[u8; 32]>())),
                any::<u64>()
            )
                .prop_map(
                    |(version, instance_id, credits, heartbeat_ms, auth, features)| {
                        LinkFrame::Welcome {
                            version,
                            instance_id,
                            credits,
                            heartbeat_ms,
                            auth: auth.map(|(nonce, proof)| LinkWelcomeAuth { nonce, proof }),
                            features,
                        }
                    }
                ),
            (any::<u64>(), any::<u64>())
                .prop_map(|(handle, client_seq)| { LinkFrame::ForwardDone { handle, client_seq } }),
            any::<[u8; 32]>().prop_map(|proof| LinkFrame::Auth { proof }),
            (
                any::<u64>(),
                any::<[u8; 16]>(),
                name(),
                any::<u64>(),
                proptest::collection::vec((name(), name()), 0..4)
            )
                .prop_map(|(handle, session_id, player_id, fencing, attrs)| {
                    LinkFrame::SessionOpen {
                        handle,
                        session_id,
                        player_id,
                        fencing,
                        attrs,
                    }
                }),
            (any::<u64>(), code())
                .prop_map(|(handle, code)| LinkFrame::SessionClose { handle, code }),
            (any::<u64>(), any::<u32>())
                .prop_map(|(handle, linger_ms)| LinkFrame::SessionDetached { handle, linger_ms }),
            (any::<u64>(), any::<bool>())
                .prop_map(|(handle, gap)| LinkFrame::SessionReattached { handle, gap }),
            (
                any::<u64>(),
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
                arb_class(),
                payload()
            )
                .prop_map(|(handle, msg_id, epoch, client_seq, class, payload)| {
                    LinkFrame::Forward {
                        handle,
                        msg_id,
                        epoch,
                        client_seq,
                        class,
                        payload,
                    }
                }),
            (
                any::<u64>(),
                any::<u64>(),
                pushed_msg_id(),
                arb_class(),
                payload()
            )
                .prop_map(|(handle, client_seq, msg_id, class, payload)| {
                    LinkFrame::AnswerPush {
                        handle,
                        client_seq,
                        msg_id,
                        class,
                        payload,
                    }
                }),
            (any::<u64>(), pushed_msg_id(), arb_class(), payload()).prop_map(
                |(handle, msg_id, class, payload)| LinkFrame::Push {
                    handle,
                    msg_id,
                    class,
                    payload,
                }
            ),
            (any::<u64>(), code(), name()).prop_map(|(handle, code, message)| LinkFrame::Kick {
                handle,
                code,
                message,
            }),
            (
                any::<u64>(),
                any::<u32>(),
                any::<u64>(),
                code(),
                any::<u32>(),
                any::<u64>()
            )
                .prop_map(
                    |(handle, msg_id, client_seq, code, retry_after_ms, epoch)| {
                        LinkFrame::Refuse {
                            handle,
                            msg_id,
                            client_seq,
                            code,
                            retry_after_ms,
                            epoch,
                        }
                    }
                ),
            (any::<u64>(), name(), name()).prop_map(|(handle, service, key)| LinkFrame::Bind {
                handle,
                service,
                key,
            }),
            (
                any::<bool>(),
                name(),
                name(),
                prop_oneof![Just(0u64), any::<u64>()]
            )
                .prop_map(|(room, key, instance_id, request_id)| LinkFrame::Pin {
                    kind: if room { PinKind::Room } else { PinKind::Player },
                    key,
                    instance_id,
                    request_id,
                }),
            (any::<u64>(), any::<bool>(), name()).prop_map(|(request_id, room, key)| {
                LinkFrame::Unpin {
                    request_id,
                    kind: if room { PinKind::Room } else { PinKind::Player },
                    key,
                }
            }),
            (
                any::<u64>(),
                proptest::sample::select(PinOutcome::ALL.to_vec())
            )
                .prop_map(|(request_id, outcome)| LinkFrame::PinResult {
                    request_id,
                    outcome,
                }),
            any::<u32>().prop_map(|credits| LinkFrame::Credit { credits }),
            any::<u64>().prop_map(|timestamp| LinkFrame::Ping { timestamp }),
            any::<u64>().prop_map(|timestamp| LinkFrame::Pong { timestamp }),
            (code(), name()).prop_map(|(code, message)| LinkFrame::Close { code, message }),
            (
                any::<u64>(),
                any::<u64>(),
                name(),
                proptest::option::of((any::<u64>(), any::<u64>()))
            )
                .prop_map(|(request_id, handle, channel, since)| {
                    LinkFrame::ChannelJoin {
                        request_id,
                        handle,
                        channel,
                        since: since.map(|(epoch, offset)| ChannelPosition { epoch, offset }),
                    }
                }),
            (any::<u64>(), any::<u64>(), name()).prop_map(|(request_id, handle, channel)| {
                LinkFrame::ChannelLeave {
                    request_id,
                    handle,
                    channel,
                }
            }),
            (any::<u64>(), name(), arb_class(), payload()).prop_map(
                |(request_id, channel, class, payload)| LinkFrame::ChannelPublish {
                    request_id,
                    channel,
                    class,
                    payload,
                }
            ),
            (
                any::<u64>(),
                code(),
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
                any::<bool>()
            )
                .prop_map(
                    |(request_id, code, retry_after_ms, epoch, offset, duplicate)| {
                        LinkFrame::ChannelResult {
                            request_id,
                            code,
                            retry_after_ms,
                            position: ChannelPosition { epoch, offset },
                            duplicate,
                        }
                    }
                ),
            (any::<u64>(), any::<bool>(), name()).prop_map(|(seq, present, channel)| {
                LinkFrame::ChannelInterest {
                    seq,
                    present,
                    channel,
                }
            }),
            any::<u64>().prop_map(|seq| LinkFrame::ChannelInterestAck { seq }),
            (
                any::<u64>(),
                name(),
                pushed_msg_id(),
                arb_class(),
                payload()
            )
                .prop_map(|(request_id, player, msg_id, class, payload)| {
                    LinkFrame::PlayerPush {
                        request_id,
                        player,
                        msg_id,
                        class,
                        payload,
                    }
                }),
            (
                any::<u64>(),
                proptest::sample::select(PlayerPushOutcome::ALL.to_vec())
            )
                .prop_map(|(request_id, outcome)| LinkFrame::PlayerPushResult {
                    request_id,
                    outcome,
                }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(frames in proptest::collection::vec(arb_link_frame(), 1..6)) {
            let codec = LinkCodec::new(DEFAULT_MAX_LINK_FRAME);
            let mut buf = BytesMut::new();
            for f in &frames {
                codec.encode(f, &mut buf).expect("fits");
            }
            let mut got = Vec::new();
            while let Some(f) = codec.decode(&mut buf).expect("valid") {
                got.push(f);
            }
            prop_assert_eq!(got, frames);
        }

        /// `oversized_field` names exactly the frames the decoder refuses for a text
        /// field's length (the edge would close the link for them): a backend refuses
        /// those before it sends (found by the PROTOCOL.md audit: a client's 300-byte room
        /// id, passed on in a BIND, closed the link of every session on it).
        #[test]
        fn oversized_field_names_what_the_decoder_refuses(frame in prop_oneof![
            ("[a-z]{0,300}", "[a-z]{0,300}").prop_map(|(service, key)| LinkFrame::Bind {
                handle: 1,
                service,
                key,
            }),
            ("[a-z]{0,300}", "[a-z]{0,300}", any::<u64>()).prop_map(|(key, instance_id, request_id)| LinkFrame::Pin {
                kind: PinKind::Room,
                key,
                instance_id,
                request_id,
            }),
            "[a-z]{0,300}".prop_map(|key| LinkFrame::Unpin {
                request_id: 3,
                kind: PinKind::Player,
                key,
            }),
            "[a-z]{0,300}".prop_map(|channel| LinkFrame::ChannelJoin {
                request_id: 1,
                handle: 2,
                channel,
                since: None,
            }),
            "[a-z]{0,300}".prop_map(|channel| LinkFrame::ChannelLeave {
                request_id: 1,
                handle: 2,
                channel,
            }),
            "[a-z]{0,300}".prop_map(|channel| LinkFrame::ChannelPublish {
                request_id: 1,
                channel,
                class: TrafficClass::Normal,
                payload: Bytes::new(),
            }),
            "[a-z]{0,300}".prop_map(|player| LinkFrame::PlayerPush {
                request_id: 1,
                player,
                msg_id: 5,
                class: TrafficClass::Normal,
                payload: Bytes::new(),
            }),
            "[a-z]{1000,1100}".prop_map(|message| LinkFrame::Kick {
                handle: 1,
                code: CloseCode::Kicked,
                message,
            }),
        ]) {
            let mut bytes = BytesMut::new();
            frame.encode(&mut bytes);
            let decoded = LinkFrame::decode(bytes.freeze());
            prop_assert_eq!(frame.oversized_field().is_none(), decoded.is_ok(), "{:?}", decoded);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = LinkFrame::decode(Bytes::from(bytes.clone()));
            let codec = LinkCodec::new(256);
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(_)) = codec.decode(&mut buf) {}
        }
    }

    /// PIN's request id is trailing and optional: a PIN without it (from a backend that
    /// predates it) reads as request id 0, and one with 0 is sent without it, byte for byte
    /// the PIN an older edge knows.
    #[test]
    fn a_pin_without_a_request_id_is_the_old_pin() {
        let old = LinkFrame::Pin {
            kind: PinKind::Room,
            key: "harbour".into(),
            instance_id: "r1".into(),
            request_id: 0,
        };
        let mut bytes = BytesMut::new();
        old.encode(&mut bytes);
        assert_eq!(&bytes[..], b"\x4b\x01\x07harbour\x02r1");
        assert_eq!(old.encoded_len(), bytes.len());
        assert_eq!(LinkFrame::decode(bytes.freeze()), Ok(old));
        let asked = LinkFrame::Pin {
            kind: PinKind::Player,
            key: "p".into(),
            instance_id: "p1".into(),
            request_id: 300,
        };
        let mut bytes = BytesMut::new();
        asked.encode(&mut bytes);
        assert_eq!(&bytes[..], b"\x4b\x00\x01p\x02p1\xac\x02");
        assert_eq!(LinkFrame::decode(bytes.freeze()), Ok(asked));
        for b in 0..=u8::MAX {
            assert_eq!(
                PinOutcome::from_u8(b).map(|o| o as u8),
                (usize::from(b) < PinOutcome::ALL.len()).then_some(b)
            );
        }
    }

    #[test]
    fn client_frames_are_unknown_on_the_link() {
        let ping = crate::Frame::Ping { timestamp: 1 }.to_bytes();
        assert_eq!(LinkFrame::decode(ping), Err(FrameError::UnknownType(0x06)));
    }

    #[test]
    fn forward_header_is_small() {
        let f = LinkFrame::Forward {
            handle: 1000,
            msg_id: 1001,
            epoch: 7,
            client_seq: 5000,
            class: TrafficClass::Normal,
            payload: Bytes::from_static(&[0; 64]),
        };
        assert_eq!(f.encoded_len() - 64, 9);
    }
}

//! Wire-visible constants of the client protocol, defined once: the protocol version, frame
//! type bytes, traffic classes and the close/error code table. PROTOCOL.md mirrors this file;
//! a change here is a change there.

use std::fmt;

/// The client protocol version this build speaks (HELLO's `version` byte).
pub const PROTOCOL_VERSION: u8 = 1;

/// Default maximum size of one frame (type byte through payload), in bytes.
pub const DEFAULT_MAX_FRAME_SIZE: usize = 64 * 1024;

/// The most bytes a DATA frame adds to its payload: type, flags, msg_id (5), seq (10) and
/// ack (10) varints at their largest. A downstream payload longer than the max frame size
/// less this is not sent (PROTOCOL.md §10.2).
pub const DATA_HEADER_MAX: usize = 1 + 1 + 5 + 10 + 10;

/// Largest frame an edge accepts from a client before its WELCOME (PROTOCOL.md §10.1): room
/// for the largest HELLO (a 4,096-byte token and the resume part) with space for extension
/// fields. Larger pre-auth frames are refused like any oversized frame (CLOSE 101).
pub const MAX_PRE_AUTH_FRAME_SIZE: usize = 8 * 1024;

/// ALPN protocol id for QUIC connections.
pub const QUIC_ALPN: &[u8] = b"waygate/1";

/// WebSocket subprotocol a client may offer; the server echoes it when offered.
pub const WS_SUBPROTOCOL: &str = "waygate.v1";

/// Length of session ids and resume tokens on the wire.
pub const ID_LEN: usize = 16;

/// Frame type byte (first byte of every frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    /// Client opens or resumes a session.
    Hello = 0x01,
    /// Server accepts a HELLO.
    Welcome = 0x02,
    /// Server refuses a HELLO (or admission) with a code and retry-after.
    Reject = 0x03,
    /// An application message, either direction.
    Data = 0x04,
    /// A cumulative acknowledgement of sequenced DATA.
    Ack = 0x05,
    /// Liveness probe and RTT sample.
    Ping = 0x06,
    /// Answer to PING.
    Pong = 0x07,
    /// Server asks the client to reconnect elsewhere and resume.
    Migrate = 0x08,
    /// Either side ends the connection with a code.
    Close = 0x09,
    /// Server reports that one upstream message could not be delivered.
    Error = 0x0A,
}

impl FrameType {
    /// Parses a type byte.
    pub fn from_u8(byte: u8) -> Option<Self> {
        Some(match byte {
            0x01 => Self::Hello,
            0x02 => Self::Welcome,
            0x03 => Self::Reject,
            0x04 => Self::Data,
            0x05 => Self::Ack,
            0x06 => Self::Ping,
            0x07 => Self::Pong,
            0x08 => Self::Migrate,
            0x09 => Self::Close,
            0x0A => Self::Error,
            _ => return None,
        })
    }
}

/// Traffic class of a DATA frame. It chooses the QUIC stream (or datagram), the priority in
/// outbound queues, and whether the message is sequenced and replayed after a resume.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum TrafficClass {
    /// Never dropped; sequenced and replayed.
    Critical = 0,
    /// Sequenced and replayed; may be slowed under overload.
    Normal = 1,
    /// Not sequenced, never replayed, dropped first (QUIC: datagrams when they fit).
    BestEffort = 2,
}

impl TrafficClass {
    /// All classes, highest priority first.
    pub const ALL: [TrafficClass; 3] = [Self::Critical, Self::Normal, Self::BestEffort];

    /// Parses the 2-bit class field.
    pub fn from_bits(bits: u8) -> Option<Self> {
        match bits {
            0 => Some(Self::Critical),
            1 => Some(Self::Normal),
            2 => Some(Self::BestEffort),
            _ => None,
        }
    }

    /// Whether DATA of this class carries a sequence number (and so is acked and replayed).
    pub fn is_sequenced(self) -> bool {
        !matches!(self, Self::BestEffort)
    }

    /// Stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Critical => "critical",
            Self::Normal => "normal",
            Self::BestEffort => "best_effort",
        }
    }
}

macro_rules! close_codes {
    ($( $(#[$doc:meta])* $name:ident = $value:literal, $label:literal; )*) => {
        /// Close, reject and error codes: one table for REJECT, CLOSE and ERROR frames, QUIC
        /// application close codes, KCP BUSY replies, logs and metric labels.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum CloseCode {
            $( $(#[$doc])* $name, )*
            /// A code this build does not know (a newer peer); kept as received.
            Unknown(u16),
        }

        impl CloseCode {
            /// The code's numeric wire value.
            pub fn to_u16(self) -> u16 {
                match self {
                    $( Self::$name => $value, )*
                    Self::Unknown(v) => v,
                }
            }

            /// Parses a wire value; unknown values are kept, never refused.
            pub fn from_u16(value: u16) -> Self {
                match value {
                    $( $value => Self::$name, )*
                    other => Self::Unknown(other),
                }
            }

            /// Stable snake_case label for metrics and logs.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( Self::$name => $label, )*
                    Self::Unknown(_) => "unknown",
                }
            }

            /// Every known code, for documentation tests.
            pub const KNOWN: &'static [CloseCode] = &[$( Self::$name, )*];
        }
    };
}

impl CloseCode {
    /// Whether a CLOSE with this code, sent by the edge after WELCOME, leaves the session
    /// lingering for a resume (PROTOCOL.md §7.8): the codes the edge closes a live
    /// connection with while keeping its session. Every other code after WELCOME means the
    /// session ended (a newer login, an operator's kick or ban, a backend's KICK, the
    /// client's logout): the client must not reconnect on its own.
    pub fn keeps_session(self) -> bool {
        matches!(
            self,
            Self::Normal
                | Self::GoingAway
                | Self::ProtocolError
                | Self::FrameTooLarge
                | Self::IdleTimeout
                | Self::UnexpectedFrame
                | Self::TextMessage
                | Self::SlowConsumer
                | Self::Overloaded
                | Self::RateLimited
                | Self::Unavailable
                | Self::Draining
                | Self::Internal
        )
    }

    /// The code a session ended from the server side is closed with: its own, unless a
    /// client would read that as a session kept for a resume ([`keeps_session`]); then
    /// `kicked` (a backend that KICKs with `normal`, say, still ends the session for the
    /// client too).
    ///
    /// [`keeps_session`]: CloseCode::keeps_session
    pub fn ending_session(self) -> Self {
        if self.keeps_session() {
            Self::Kicked
        } else {
            self
        }
    }
}

close_codes! {
    /// Orderly close, nothing wrong.
    Normal = 0, "normal";
    /// The server is shutting down or the client is leaving.
    GoingAway = 1, "going_away";
    /// The client ends its session for good (its CLOSE): the edge ends the session at once
    /// instead of letting it linger for a resume.
    Logout = 2, "logout";
    /// A frame could not be parsed, or a field had an invalid value.
    ProtocolError = 100, "protocol_error";
    /// A frame exceeded the negotiated maximum size.
    FrameTooLarge = 101, "frame_too_large";
    /// HELLO carried a protocol version this server does not speak.
    UnsupportedVersion = 102, "unsupported_version";
    /// Nothing was received within the idle timeout.
    IdleTimeout = 103, "idle_timeout";
    /// A phase of the handshake (TLS, upgrade, HELLO) did not finish by its deadline.
    HandshakeTimeout = 104, "handshake_timeout";
    /// A well-formed frame arrived in a state where it is not allowed.
    UnexpectedFrame = 105, "unexpected_frame";
    /// A WebSocket text message (only binary messages carry frames).
    TextMessage = 106, "text_message";
    /// The auth token could not be parsed.
    AuthMalformed = 200, "auth_malformed";
    /// The auth token's signature did not verify.
    AuthBadSignature = 201, "auth_bad_signature";
    /// The auth token has expired (or is not valid yet).
    AuthExpired = 202, "auth_expired";
    /// The auth token names a key id the server does not know.
    AuthUnknownKey = 203, "auth_unknown_key";
    /// The auth token's format version is not supported.
    AuthUnsupportedVersion = 204, "auth_unsupported_version";
    /// A custom authenticator refused the player.
    AuthRejected = 205, "auth_rejected";
    /// The resume token or session id is not valid (unknown, used, expired or foreign).
    ResumeRejected = 300, "resume_rejected";
    /// Another login of the same player took over this session.
    Kicked = 301, "kicked";
    /// The client did not read fast enough; its session is kept for resume.
    SlowConsumer = 302, "slow_consumer";
    /// The session's linger time ran out.
    SessionExpired = 303, "session_expired";
    /// The server is overloaded; retry after the hint.
    Overloaded = 400, "overloaded";
    /// The client sent faster than its allowed rate.
    RateLimited = 401, "rate_limited";
    /// The service for this message is saturated; retry after the hint.
    Busy = 402, "busy";
    /// No instance of the service for this message is reachable.
    Unavailable = 403, "unavailable";
    /// No service handles this message id.
    NoRoute = 404, "no_route";
    /// This edge is draining and accepts no new sessions.
    Draining = 405, "draining";
    /// The route epoch of a forwarded message is older than the backend's (link only).
    StaleEpoch = 406, "stale_epoch";
    /// A channel's queue for this class is full: the publication was not taken (retry after
    /// the hint).
    QueueFull = 407, "queue_full";
    /// The channel name's kind (the part before `:`) is not configured on the edge.
    UnknownChannelKind = 408, "unknown_channel_kind";
    /// The session named by a channel request is not on this edge (ended, or never here).
    MemberOffline = 409, "member_offline";
    /// A cap was reached: channels on the edge, channels per session or members per
    /// channel.
    ChannelLimit = 410, "channel_limit";
    /// An internal error on the server.
    Internal = 500, "internal";
}

impl fmt::Display for CloseCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.as_str(), self.to_u16())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_codes_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for code in CloseCode::KNOWN {
            assert!(seen.insert(code.to_u16()), "duplicate {code}");
            assert_eq!(CloseCode::from_u16(code.to_u16()), *code);
        }
        assert_eq!(CloseCode::from_u16(9999), CloseCode::Unknown(9999));
    }

    /// The codes a CLOSE after WELCOME keeps the session with are the ones PROTOCOL.md §7.8
    /// lists (clients are written from that list), and a server-side end never uses one.
    #[test]
    fn protocol_md_lists_the_codes_that_keep_a_session() {
        let doc = include_str!("../../../PROTOCOL.md");
        let start = doc
            .find("only with these codes:")
            .expect("PROTOCOL.md §7.8 lists the codes that keep a session");
        let list = &doc[start..];
        let list = &list[..list.find("With any other code").expect("the list's end")];
        let listed: Vec<&str> = list.split('`').skip(1).step_by(2).collect();
        let keeping: Vec<&str> = CloseCode::KNOWN
            .iter()
            .filter(|c| c.keeps_session())
            .map(|c| c.as_str())
            .collect();
        assert_eq!(listed, keeping);
        for code in CloseCode::KNOWN
            .iter()
            .copied()
            .chain([CloseCode::Unknown(4_003)])
        {
            assert!(!code.ending_session().keeps_session(), "{code}");
        }
    }

    #[test]
    fn protocol_md_lists_every_code() {
        let doc = include_str!("../../../PROTOCOL.md");
        for code in CloseCode::KNOWN {
            let row = format!("| {} | `{}` |", code.to_u16(), code.as_str());
            assert!(doc.contains(&row), "PROTOCOL.md lacks the row `{row}`");
        }
    }
}

//! The transport crate's errors, grouped by who is at fault (rustls' habit): the peer sent
//! something malformed, the peer or network went away, or the local caller misused the API.
//! Every error maps to one wire [`CloseCode`].

use std::io;

use crate::protocol::CloseCode;

/// A frame that could not be decoded or encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The frame ended before the named field.
    #[error("frame truncated in field `{field}`")]
    Truncated {
        /// The field being read.
        field: &'static str,
    },
    /// A field held a value the protocol does not allow.
    #[error("malformed field `{field}`: {what}")]
    Malformed {
        /// The field being read.
        field: &'static str,
        /// What was wrong with it.
        what: &'static str,
    },
    /// The frame type byte is not one this version knows.
    #[error("unknown frame type 0x{0:02x}")]
    UnknownType(u8),
    /// A frame (declared or actual) longer than the maximum frame size.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The declared or actual length.
        len: u64,
        /// The configured maximum.
        max: usize,
    },
    /// A zero-length frame.
    #[error("empty frame")]
    Empty,
}

impl FrameError {
    /// The code a connection closes with when it receives this.
    pub fn close_code(&self) -> CloseCode {
        match self {
            Self::TooLarge { .. } => CloseCode::FrameTooLarge,
            _ => CloseCode::ProtocolError,
        }
    }
}

/// An error on one connection, listener or endpoint. Never affects another connection.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer sent bytes that do not form a valid frame (peer's fault).
    #[error("invalid frame from peer: {0}")]
    Frame(#[from] FrameError),
    /// The peer broke the transport's own rules (a WebSocket text message, a QUIC stream of
    /// an unknown kind, a KCP message on a dead session...).
    #[error("transport protocol violation: {0}")]
    Violation(&'static str),
    /// The peer closed the connection, with its code when it sent one.
    #[error("connection closed by peer: {code}")]
    ClosedByPeer {
        /// The code the peer sent, or `Normal` for a clean EOF without one.
        code: CloseCode,
    },
    /// The connection was closed locally earlier.
    #[error("connection already closed")]
    Closed,
    /// Nothing arrived within the idle timeout (T5).
    #[error("idle timeout: nothing received for {0:?}")]
    IdleTimeout(std::time::Duration),
    /// A handshake phase (TLS, WebSocket upgrade, QUIC, KCP cookie) did not finish in time.
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// The handshake failed (TLS alert, bad upgrade request, refused cookie...).
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The server refused the connection for now (KCP BUSY): over a cap or rate, or
    /// draining. Retry after the hint.
    #[error("refused by server: {code}, retry after {retry_after_ms} ms")]
    Refused {
        /// Why (usually `Overloaded`).
        code: CloseCode,
        /// The server's retry-after hint in ms (0 = none).
        retry_after_ms: u32,
    },
    /// The local caller tried to send a frame larger than the maximum frame size.
    #[error("local frame of {len} bytes exceeds the maximum of {max}")]
    SendTooLarge {
        /// The encoded length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// Invalid local configuration (certificate files, addresses, parameters).
    #[error("configuration: {0}")]
    Config(String),
    /// An I/O error from the socket.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
}

impl TransportError {
    /// The code to close the connection with after this error.
    pub fn close_code(&self) -> CloseCode {
        match self {
            Self::Frame(e) => e.close_code(),
            Self::Violation(_) => CloseCode::ProtocolError,
            Self::ClosedByPeer { code } => *code,
            Self::IdleTimeout(_) => CloseCode::IdleTimeout,
            Self::HandshakeTimeout => CloseCode::HandshakeTimeout,
            Self::Closed | Self::Io(_) => CloseCode::GoingAway,
            Self::Handshake(_) => CloseCode::ProtocolError,
            Self::Refused { code, .. } => *code,
            Self::SendTooLarge { .. } | Self::Config(_) => CloseCode::Internal,
        }
    }

    /// Whether the connection is unusable after this error (always true today except for
    /// `SendTooLarge`, which refuses one frame and leaves the connection open).
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Self::SendTooLarge { .. })
    }
}

//! The transport crate's errors, grouped by who is at fault (rustls' habit): the peer sent
//! something malformed, the peer or network went away, or the local caller misused the API.
//! Every error maps to one wire [`CloseCode`]. Decoding errors ([`FrameError`]) belong to the
//! protocol crate.

use std::io;

use waygate_protocol::{CloseCode, FrameError};

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
        /// The code the peer sent, or `Normal` for a clean EOF without one (a QUIC
        /// application close or KCP RESET carrying `logout` reads as `going_away`:
        /// [`TransportError::transport_close`]).
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
    /// The server refused the connection (KCP BUSY): over a cap or rate, or draining —
    /// retry after the hint — or a 2xx auth code (a sealed CONNECT's token refused), which
    /// ends a client without a session when every endpoint refused (PROTOCOL.md §8.3.1).
    #[error("refused by server: {code}, retry after {retry_after_ms} ms")]
    Refused {
        /// Why (`Overloaded`, or an auth code).
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
    /// The peer's transport-level close (a QUIC application close, a KCP RESET) with
    /// `code`, as a connection's reader reports it. `logout` ends a session only in a CLOSE
    /// frame (PROTOCOL.md §3.8, §7.5): a transport close carrying it reads as `going_away`,
    /// so an off-path RESET(2) forged against a plain KCP session, or a QUIC close racing
    /// ahead of its CLOSE frame, never logs a player out.
    pub fn transport_close(code: CloseCode) -> Self {
        let code = match code {
            CloseCode::Logout => CloseCode::GoingAway,
            other => other,
        };
        Self::ClosedByPeer { code }
    }

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

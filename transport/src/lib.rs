//! # waygate-transport
//!
//! Owns the sockets: the four transports that carry the client protocol — TCP (optionally
//! TLS), KCP over UDP, QUIC and WebSocket (ws/wss) — behind one message-oriented
//! [`Connection`] trait and one [`Listener`] trait (SPEC T1–T6), TLS material, and the
//! listeners' admission shell. The bytes on the wire (frames, codes, framing, the backend
//! link) are the `waygate-protocol` crate's; the types a connection's API carries are
//! re-exported here.
//!
//! What it must never do: know about sessions, players, routes or backends (the backend
//! link's frames are not its business either). A connection
//! yielded by a listener has finished its *transport* handshake (TLS, WebSocket upgrade, KCP
//! cookie exchange, QUIC); authenticating the player is the session layer's job. Nothing
//! above this crate matches on [`TransportKind`]; it exists for logs and metric labels.
//!
//! The KCP endpoint's core ([`kcp`]) is a plain state machine driven by one socket task, the
//! model for every owner of many connections in the workspace.

pub mod conn;
pub mod endpoint;
pub mod error;
pub mod kcp;
pub mod listener;
pub mod mem;
#[cfg(feature = "quic")]
pub mod quic;
pub mod stream;
pub mod tcp;
pub mod tls;
pub mod udp;
#[cfg(feature = "ws")]
pub mod ws;

pub use conn::{
    BoxConnection, BoxListener, ConnConfig, ConnId, ConnInfo, Connection, Listener, PreAuth,
    TransportKind,
};
pub use error::TransportError;
pub use listener::TransportListener;
pub use waygate_protocol::{CloseCode, Frame, FrameError, TrafficClass};

/// The message of a caught panic (`&str` or `String` payload), for the log line of whoever
/// supervises the task or call that panicked.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
}

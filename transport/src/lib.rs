//! # waygate-transport
//!
//! Owns the client wire protocol (frames, codes, framing) and the four transports that carry
//! it — TCP (optionally TLS), KCP over UDP, QUIC and WebSocket (ws/wss) — behind one
//! message-oriented [`Connection`] trait and one [`Listener`] trait (SPEC T1–T6).
//!
//! What it must never do: know about sessions, players, routes or backends. A connection
//! yielded by a listener has finished its *transport* handshake (TLS, WebSocket upgrade, KCP
//! cookie exchange, QUIC); authenticating the player is the session layer's job. Nothing
//! above this crate matches on [`TransportKind`]; it exists for logs and metric labels.
//!
//! The protocol core is sans-IO: [`codec::StreamCodec`] and [`Frame`] encode and decode
//! without sockets, never panic and never index unchecked. The KCP endpoint's core
//! ([`kcp`]) is likewise a plain state machine driven by one socket task.
//!
//! ```
//! use waygate_transport::{Frame, codec::StreamCodec};
//! use bytes::BytesMut;
//!
//! let codec = StreamCodec::new(64 * 1024);
//! let mut wire = BytesMut::new();
//! codec.encode(&Frame::Ping { timestamp: 42 }, &mut wire).unwrap();
//! assert_eq!(codec.decode(&mut wire).unwrap(), Some(Frame::Ping { timestamp: 42 }));
//! ```

pub mod backpressure;
pub mod codec;
pub mod conn;
pub mod endpoint;
pub mod error;
pub mod frame;
pub mod kcp;
pub mod link;
pub mod listener;
pub mod mem;
pub mod protocol;
pub mod quic;
mod reader;
pub mod stream;
pub mod tcp;
pub mod tls;
pub mod udp;
pub mod varint;
pub mod ws;

pub use conn::{
    BoxConnection, BoxListener, ConnConfig, ConnId, ConnInfo, Connection, Listener, TransportKind,
};
pub use error::{FrameError, TransportError};
pub use frame::Frame;
pub use listener::TransportListener;
pub use protocol::{CloseCode, TrafficClass};

//! # waygate-protocol
//!
//! Owns the bytes on the wire, apart from any I/O (the split of quinn-proto and rustls'
//! codec): the client protocol's constants and close-code table ([`wire`]), varints, the
//! bounds-checked [`reader`], [`Frame`] and its byte layout, the stream framing codec
//! ([`codec::StreamCodec`]), and the backend link's frames and codec ([`link`], PROTOCOL.md
//! §9: players, fencing tokens, route epochs and pins are the link's vocabulary, so they live
//! here, not in the transport crate).
//!
//! What it must never do: depend on a runtime (no tokio), open sockets, keep state across
//! calls, or panic on any input. Every decoder reads through [`reader::Reader`], returns
//! `Ok(None)` for a partial frame and a [`FrameError`] for a bad one; property tests and
//! cargo-fuzz targets (`fuzz/`) cover every decoder. A dependency-rule test
//! (`interop-tests/tests/dependency_rules.rs`) keeps tokio out of this crate's tree.
//!
//! ```
//! use waygate_protocol::{Frame, codec::StreamCodec};
//! use bytes::BytesMut;
//!
//! let codec = StreamCodec::new(64 * 1024);
//! let mut wire = BytesMut::new();
//! codec.encode(&Frame::Ping { timestamp: 42 }, &mut wire).unwrap();
//! assert_eq!(codec.decode(&mut wire).unwrap(), Some(Frame::Ping { timestamp: 42 }));
//! ```

pub mod channel;
pub mod codec;
pub mod error;
pub mod frame;
pub mod link;
pub mod link_auth;
pub mod reader;
pub mod request;
pub mod resume_proof;
pub mod varint;
pub mod wire;

pub use error::FrameError;
pub use frame::Frame;
pub use wire::{CloseCode, TrafficClass};

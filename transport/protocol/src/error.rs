//! Errors of decoding and encoding frames: always the peer's fault when decoding (malformed,
//! truncated, unknown or oversized input), the caller's when encoding an oversized frame.
//! Every error maps to one wire [`CloseCode`].

use crate::wire::CloseCode;

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

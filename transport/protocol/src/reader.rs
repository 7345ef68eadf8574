//! A bounds-checked cursor over a received frame. Every read returns `Err` instead of
//! indexing past the end, so no decoder can panic on input (quinn-proto's `coding.rs` and
//! rustls' `codec::Reader` follow the same habit).

use bytes::Bytes;

use crate::error::FrameError;
use crate::varint::{peek_varint, VarintError};

/// Reads fields front to back from one frame's bytes.
#[derive(Debug)]
pub(crate) struct Reader {
    bytes: Bytes,
    pos: usize,
}

impl Reader {
    /// A reader over `bytes`, positioned at its start.
    pub(crate) fn new(bytes: Bytes) -> Self {
        Self { bytes, pos: 0 }
    }

    fn remaining_slice(&self) -> &[u8] {
        self.bytes.get(self.pos..).unwrap_or_default()
    }

    /// Bytes not yet read.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    /// One byte.
    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, FrameError> {
        let byte = *self
            .remaining_slice()
            .first()
            .ok_or(FrameError::Truncated { field })?;
        self.pos += 1;
        Ok(byte)
    }

    /// A big-endian `u16`.
    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, FrameError> {
        Ok(u16::from_be_bytes(self.array::<2>(field)?))
    }

    /// An unsigned LEB128 varint.
    pub(crate) fn varint(&mut self, field: &'static str) -> Result<u64, FrameError> {
        match peek_varint(self.remaining_slice()) {
            Ok((value, len)) => {
                self.pos += len;
                Ok(value)
            }
            Err(VarintError::Incomplete) => Err(FrameError::Truncated { field }),
            Err(VarintError::Overlong) => Err(FrameError::Malformed {
                field,
                what: "varint longer than 64 bits",
            }),
        }
    }

    /// A varint that must fit in `u32`.
    pub(crate) fn varint_u32(&mut self, field: &'static str) -> Result<u32, FrameError> {
        u32::try_from(self.varint(field)?).map_err(|_| FrameError::Malformed {
            field,
            what: "value does not fit in 32 bits",
        })
    }

    /// Exactly `N` bytes.
    pub(crate) fn array<const N: usize>(
        &mut self,
        field: &'static str,
    ) -> Result<[u8; N], FrameError> {
        let slice = self.take(N, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    /// A varint length followed by that many bytes, at most `max` of them.
    pub(crate) fn bytes_with_len(
        &mut self,
        field: &'static str,
        max: usize,
    ) -> Result<Bytes, FrameError> {
        let len = self.varint(field)?;
        if len > max as u64 {
            return Err(FrameError::Malformed {
                field,
                what: "length field exceeds its limit",
            });
        }
        self.bytes(len as usize, field)
    }

    /// Exactly `len` bytes, sharing the frame's buffer.
    pub(crate) fn bytes(&mut self, len: usize, field: &'static str) -> Result<Bytes, FrameError> {
        if self.remaining() < len {
            return Err(FrameError::Truncated { field });
        }
        let out = self.bytes.slice(self.pos..self.pos + len);
        self.pos += len;
        Ok(out)
    }

    /// Everything not yet read, sharing the frame's buffer.
    pub(crate) fn rest(&mut self) -> Bytes {
        let out = self.bytes.slice(self.pos.min(self.bytes.len())..);
        self.pos = self.bytes.len();
        out
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<&[u8], FrameError> {
        let start = self.pos;
        let end = start
            .checked_add(n)
            .ok_or(FrameError::Truncated { field })?;
        if end > self.bytes.len() {
            return Err(FrameError::Truncated { field });
        }
        self.pos = end;
        self.bytes
            .get(start..end)
            .ok_or(FrameError::Truncated { field })
    }
}

//! Unsigned LEB128 varints, as used by every integer field of the wire protocol marked
//! `varint` in PROTOCOL.md: 7 bits per byte, least significant group first, high bit set on
//! every byte but the last. At most 10 bytes encode a `u64`; a longer encoding, or a tenth
//! byte carrying bits beyond 64, is malformed.

use bytes::BufMut;

/// The longest encoding of a `u64`.
pub const MAX_VARINT_LEN: usize = 10;

/// Why a varint could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VarintError {
    /// The input ended before the last byte of the varint.
    Incomplete,
    /// More than 10 bytes, or bits beyond 64.
    Overlong,
}

/// Number of bytes `value` takes on the wire.
pub fn varint_len(value: u64) -> usize {
    let bits = 64 - (value | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// Appends `value` to `out`.
pub fn put_varint(out: &mut impl BufMut, mut value: u64) {
    while value >= 0x80 {
        out.put_u8((value as u8) | 0x80);
        value >>= 7;
    }
    out.put_u8(value as u8);
}

/// Reads a varint from the start of `bytes` without consuming: returns the value and its
/// length in bytes.
pub fn peek_varint(bytes: &[u8]) -> Result<(u64, usize), VarintError> {
    let mut value: u64 = 0;
    for (i, &byte) in bytes.iter().take(MAX_VARINT_LEN).enumerate() {
        let group = u64::from(byte & 0x7f);
        if i == MAX_VARINT_LEN - 1 && byte > 1 {
            return Err(VarintError::Overlong);
        }
        value |= group << (7 * i);
        if byte & 0x80 == 0 {
            return Ok((value, i + 1));
        }
    }
    if bytes.len() >= MAX_VARINT_LEN {
        Err(VarintError::Overlong)
    } else {
        Err(VarintError::Incomplete)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_encodings() {
        let cases: &[(u64, &[u8])] = &[
            (0, &[0]),
            (1, &[1]),
            (127, &[0x7f]),
            (128, &[0x80, 0x01]),
            (300, &[0xac, 0x02]),
            (16_383, &[0xff, 0x7f]),
            (16_384, &[0x80, 0x80, 0x01]),
        ];
        for (value, bytes) in cases {
            let mut out = Vec::new();
            put_varint(&mut out, *value);
            assert_eq!(&out[..], *bytes, "encoding {value}");
            assert_eq!(varint_len(*value), bytes.len());
            assert_eq!(peek_varint(bytes), Ok((*value, bytes.len())));
        }
    }

    #[test]
    fn max_and_overlong() {
        let mut out = Vec::new();
        put_varint(&mut out, u64::MAX);
        assert_eq!(out.len(), MAX_VARINT_LEN);
        assert_eq!(peek_varint(&out), Ok((u64::MAX, 10)));
        let mut too_big = vec![0xff; 9];
        too_big.push(0x02);
        assert_eq!(peek_varint(&too_big), Err(VarintError::Overlong));
        assert_eq!(peek_varint(&[0x80; 11]), Err(VarintError::Overlong));
        assert_eq!(peek_varint(&[0x80, 0x80]), Err(VarintError::Incomplete));
        assert_eq!(peek_varint(&[]), Err(VarintError::Incomplete));
    }

    proptest! {
        #[test]
        fn round_trip(value: u64) {
            let mut out = Vec::new();
            put_varint(&mut out, value);
            prop_assert_eq!(out.len(), varint_len(value));
            prop_assert_eq!(peek_varint(&out), Ok((value, out.len())));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..16)) {
            let _ = peek_varint(&bytes);
        }
    }
}

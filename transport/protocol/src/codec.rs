//! Sans-IO length-delimited framing for byte streams (TCP, TLS): each frame is preceded by
//! its length as a varint. The decoder reads from a caller-owned buffer, returns `Ok(None)`
//! for a partial frame, and rejects an oversized length from the header alone, before any
//! allocation for the body.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::FrameError;
use crate::frame::Frame;
use crate::varint::{peek_varint, put_varint, varint_len, VarintError};

/// The stream codec: a maximum frame size and nothing else.
#[derive(Debug, Clone, Copy)]
pub struct StreamCodec {
    max_frame_size: usize,
}

impl StreamCodec {
    /// A codec that accepts frames of up to `max_frame_size` bytes (type byte to end).
    pub fn new(max_frame_size: usize) -> Self {
        Self { max_frame_size }
    }

    /// The largest frame accepted or sent.
    pub fn max_frame_size(&self) -> usize {
        self.max_frame_size
    }

    /// Checks that `frame` may be sent and returns its encoded length.
    pub fn check_len(&self, frame: &Frame) -> Result<usize, FrameError> {
        let len = frame.encoded_len();
        if len > self.max_frame_size {
            return Err(FrameError::TooLarge {
                len: len as u64,
                max: self.max_frame_size,
            });
        }
        Ok(len)
    }

    /// Appends the length prefix and frame to `out`.
    pub fn encode(&self, frame: &Frame, out: &mut BytesMut) -> Result<(), FrameError> {
        self.encode_with(frame.encoded_len(), out, |out| frame.encode(out))
    }

    /// How many more bytes the buffer needs before the next frame can be decoded (a hint for
    /// sizing reads; 1 when even the length prefix is incomplete).
    pub fn bytes_needed(&self, buf: &[u8]) -> usize {
        match peek_varint(buf) {
            Ok((len, prefix)) => (prefix as u64)
                .saturating_add(len)
                .saturating_sub(buf.len() as u64)
                .min(self.max_frame_size as u64 + 10) as usize,
            Err(_) => 1,
        }
    }

    /// Takes one frame off the front of `buf`: `Ok(None)` if it is not complete yet, an error
    /// if the length prefix or the frame is invalid (the connection must then be closed with
    /// the error's close code).
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        match self.split(buf)? {
            Some(body) => Frame::decode(body).map(Some),
            None => Ok(None),
        }
    }

    /// Takes one length-delimited body off the front of `buf` without parsing it:
    /// `Ok(None)` if it is not complete yet. Shared by the client protocol and the backend
    /// link protocol, which use the same framing.
    pub fn split(&self, buf: &mut BytesMut) -> Result<Option<Bytes>, FrameError> {
        let (len, prefix) = match peek_varint(buf) {
            Ok(v) => v,
            Err(VarintError::Incomplete) => return Ok(None),
            Err(VarintError::Overlong) => {
                return Err(FrameError::Malformed {
                    field: "length",
                    what: "varint longer than 64 bits",
                })
            }
        };
        if len == 0 {
            return Err(FrameError::Empty);
        }
        if len > self.max_frame_size as u64 {
            return Err(FrameError::TooLarge {
                len,
                max: self.max_frame_size,
            });
        }
        let len = len as usize;
        if buf.len() - prefix < len {
            return Ok(None);
        }
        buf.advance(prefix);
        Ok(Some(buf.split_to(len).freeze()))
    }

    /// Appends a length prefix and `len` bytes written by `write` (which must write exactly
    /// `len` bytes) to `out`, after checking the size.
    pub fn encode_with(
        &self,
        len: usize,
        out: &mut BytesMut,
        write: impl FnOnce(&mut BytesMut),
    ) -> Result<(), FrameError> {
        if len > self.max_frame_size {
            return Err(FrameError::TooLarge {
                len: len as u64,
                max: self.max_frame_size,
            });
        }
        out.reserve(varint_len(len as u64) + len);
        put_varint(out, len as u64);
        let before = out.len();
        write(out);
        debug_assert_eq!(out.len() - before, len, "encoded length mismatch");
        Ok(())
    }
}

/// Appends `frame` to `out` unframed, for message transports (one frame per WebSocket
/// message, KCP message or QUIC datagram), after checking its size.
pub fn encode_message(
    frame: &Frame,
    max_frame_size: usize,
    out: &mut impl BufMut,
) -> Result<(), FrameError> {
    let len = frame.encoded_len();
    if len > max_frame_size {
        return Err(FrameError::TooLarge {
            len: len as u64,
            max: max_frame_size,
        });
    }
    frame.encode(out);
    Ok(())
}

/// Decodes one frame carried as a whole message, after checking its size.
pub fn decode_message(message: Bytes, max_frame_size: usize) -> Result<Frame, FrameError> {
    if message.len() > max_frame_size {
        return Err(FrameError::TooLarge {
            len: message.len() as u64,
            max: max_frame_size,
        });
    }
    Frame::decode(message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::tests::arb_frame;
    use crate::frame::Data;
    use crate::wire::TrafficClass;
    use bytes::Bytes;
    use proptest::prelude::*;

    fn encode_all(codec: &StreamCodec, frames: &[Frame]) -> BytesMut {
        let mut out = BytesMut::new();
        for f in frames {
            codec.encode(f, &mut out).expect("fits");
        }
        out
    }

    fn decode_all(codec: &StreamCodec, buf: &mut BytesMut) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Some(f) = codec.decode(buf).expect("valid") {
            frames.push(f);
        }
        frames
    }

    #[test]
    fn oversized_length_is_refused_from_the_header_alone() {
        let codec = StreamCodec::new(1024);
        // A declared length of 100 MiB, and no body at all.
        let mut buf = BytesMut::new();
        put_varint(&mut buf, 100 * 1024 * 1024);
        assert_eq!(
            codec.decode(&mut buf),
            Err(FrameError::TooLarge {
                len: 100 * 1024 * 1024,
                max: 1024
            })
        );
    }

    #[test]
    fn max_size_passes_and_one_more_is_refused() {
        let codec = StreamCodec::new(100);
        let frame_of = |len: usize| {
            Frame::Data(Data {
                class: TrafficClass::BestEffort,
                msg_id: 1,
                seq: 0,
                ack: None,
                payload: Bytes::from(vec![7; len - 3]),
            })
        };
        let mut buf = BytesMut::new();
        codec.encode(&frame_of(100), &mut buf).expect("max fits");
        assert_eq!(codec.decode(&mut buf), Ok(Some(frame_of(100))));
        assert!(matches!(
            codec.encode(&frame_of(101), &mut buf),
            Err(FrameError::TooLarge { len: 101, .. })
        ));
        let mut raw = BytesMut::new();
        put_varint(&mut raw, 101);
        frame_of(101).encode(&mut raw);
        assert!(matches!(
            codec.decode(&mut raw),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn zero_length_and_overlong_prefix_are_errors() {
        let codec = StreamCodec::new(1024);
        assert_eq!(
            codec.decode(&mut BytesMut::from(&[0u8][..])),
            Err(FrameError::Empty)
        );
        assert!(codec
            .decode(&mut BytesMut::from(&[0xffu8; 11][..]))
            .is_err());
        assert_eq!(
            codec.decode(&mut BytesMut::from(&[0x80u8, 0x80][..])),
            Ok(None)
        );
    }

    proptest! {
        #[test]
        fn stream_round_trip(frames in proptest::collection::vec(arb_frame(), 1..8)) {
            let codec = StreamCodec::new(64 * 1024);
            let mut buf = encode_all(&codec, &frames);
            prop_assert_eq!(decode_all(&codec, &mut buf), frames);
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn split_at_every_boundary_decodes_the_same(frames in proptest::collection::vec(arb_frame(), 1..4)) {
            let codec = StreamCodec::new(64 * 1024);
            let bytes = encode_all(&codec, &frames).freeze();
            for cut in 0..=bytes.len() {
                let mut buf = BytesMut::new();
                buf.extend_from_slice(&bytes[..cut]);
                let mut got = decode_all(&codec, &mut buf);
                buf.extend_from_slice(&bytes[cut..]);
                got.extend(decode_all(&codec, &mut buf));
                prop_assert_eq!(&got, &frames);
            }
        }

        #[test]
        fn byte_at_a_time_decodes_the_same(frames in proptest::collection::vec(arb_frame(), 1..4)) {
            let codec = StreamCodec::new(64 * 1024);
            let bytes = encode_all(&codec, &frames).freeze();
            let mut buf = BytesMut::new();
            let mut got = Vec::new();
            for b in bytes.iter() {
                buf.extend_from_slice(&[*b]);
                got.extend(decode_all(&codec, &mut buf));
            }
            prop_assert_eq!(got, frames);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let codec = StreamCodec::new(512);
            let mut buf = BytesMut::from(&bytes[..]);
            for _ in 0..64 {
                match codec.decode(&mut buf) {
                    Ok(Some(_)) => continue,
                    _ => break,
                }
            }
        }
    }
}

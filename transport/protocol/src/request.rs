//! Requests and answers (PROTOCOL.md §13): a convention on DATA frames, not a frame type.
//!
//! A client's request is a sequenced DATA with the application's `msg_id`, whose body starts
//! with a 4-byte request id (big-endian, not 0) chosen by the client. The game server answers
//! with a critical DATA whose `msg_id` is [`ANSWER_MSG_ID`] (a reserved id: only the backend
//! SDK's `answer` sends it) and whose body is `request id (4) | status (2, big-endian) |
//! body`. Status 0 is success; any other value is the game server's own error code. The
//! edge forwards both like any DATA: it never reads them. This module only owns the bytes.

use bytes::{BufMut, Bytes, BytesMut};

/// `msg_id` of the DATA frames that carry answers to requests.
pub const ANSWER_MSG_ID: u32 = 0xFFFF_FF02;

/// Bytes a request adds in front of its body.
pub const REQUEST_HEADER_LEN: usize = 4;

/// Bytes an answer adds in front of its body.
pub const ANSWER_HEADER_LEN: usize = 6;

/// Answer status: success.
pub const STATUS_OK: u16 = 0;

/// A request or answer body that does not follow the convention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestFormatError {
    /// Shorter than its header.
    #[error("{what} shorter than its {need}-byte header ({len} bytes)")]
    TooShort {
        /// A request or an answer.
        what: &'static str,
        /// The header length.
        need: usize,
        /// The body's length.
        len: usize,
    },
    /// Request id 0 is not a request.
    #[error("request id 0")]
    ZeroId,
}

/// A request as the game server receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The client's request id (not 0).
    pub id: u32,
    /// The body after the id.
    pub body: Bytes,
}

/// An answer as the client receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The request it answers.
    pub id: u32,
    /// [`STATUS_OK`], or the game server's error code.
    pub status: u16,
    /// The body after the header.
    pub body: Bytes,
}

/// The DATA body of request `id` (not 0) carrying `body`.
#[must_use]
pub fn encode_request(id: u32, body: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(REQUEST_HEADER_LEN + body.len());
    b.put_u32(id);
    b.put_slice(body);
    b.freeze()
}

/// Reads a request's id and body (no copy).
pub fn decode_request(payload: &Bytes) -> Result<Request, RequestFormatError> {
    if payload.len() < REQUEST_HEADER_LEN {
        return Err(RequestFormatError::TooShort {
            what: "request",
            need: REQUEST_HEADER_LEN,
            len: payload.len(),
        });
    }
    let id = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
    if id == 0 {
        return Err(RequestFormatError::ZeroId);
    }
    Ok(Request {
        id,
        body: payload.slice(REQUEST_HEADER_LEN..),
    })
}

/// The DATA body of the answer to request `id` with `status` and `body`.
#[must_use]
pub fn encode_answer(id: u32, status: u16, body: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(ANSWER_HEADER_LEN + body.len());
    b.put_u32(id);
    b.put_u16(status);
    b.put_slice(body);
    b.freeze()
}

/// Reads an answer (no copy).
pub fn decode_answer(payload: &Bytes) -> Result<Answer, RequestFormatError> {
    if payload.len() < ANSWER_HEADER_LEN {
        return Err(RequestFormatError::TooShort {
            what: "answer",
            need: ANSWER_HEADER_LEN,
            len: payload.len(),
        });
    }
    let id = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
    if id == 0 {
        return Err(RequestFormatError::ZeroId);
    }
    Ok(Answer {
        id,
        status: u16::from_be_bytes([payload[4], payload[5]]),
        body: payload.slice(ANSWER_HEADER_LEN..),
    })
}

/// The body of a clock answer: the game server's clock as Unix time in milliseconds
/// (big-endian u64), what `sync_clock` in the client SDKs reads.
#[must_use]
pub fn encode_clock(unix_ms: u64) -> [u8; 8] {
    unix_ms.to_be_bytes()
}

/// Reads a clock answer's body.
#[must_use]
pub fn decode_clock(body: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(body.get(..8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_worked_example_of_protocol_md() {
        // PROTOCOL.md §13: request 7 with body "hi"; its answer, status 0, body "ok".
        assert_eq!(&encode_request(7, b"hi")[..], [0, 0, 0, 7, b'h', b'i']);
        assert_eq!(
            &encode_answer(7, STATUS_OK, b"ok")[..],
            [0, 0, 0, 7, 0, 0, b'o', b'k']
        );
        let doc = include_str!("../../../PROTOCOL.md");
        for bytes in [encode_request(7, b"hi"), encode_answer(7, STATUS_OK, b"ok")] {
            let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
            assert!(
                doc.contains(&format!("payload {} ", hex.join(" "))),
                "{hex:?}"
            );
        }
    }

    #[test]
    fn short_and_zero_ids_are_refused() {
        assert!(matches!(
            decode_request(&Bytes::from_static(&[0, 1])),
            Err(RequestFormatError::TooShort { .. })
        ));
        assert_eq!(
            decode_request(&Bytes::from_static(&[0, 0, 0, 0, 9])),
            Err(RequestFormatError::ZeroId)
        );
        assert!(matches!(
            decode_answer(&Bytes::from_static(&[0, 0, 0, 1, 0])),
            Err(RequestFormatError::TooShort { .. })
        ));
        assert_eq!(decode_clock(&[1, 2, 3]), None);
    }

    proptest! {
        #[test]
        fn requests_and_answers_round_trip(id in 1u32.., status: u16, body: Vec<u8>) {
            let r = decode_request(&encode_request(id, &body)).unwrap();
            prop_assert_eq!((r.id, &r.body[..]), (id, &body[..]));
            let a = decode_answer(&encode_answer(id, status, &body)).unwrap();
            prop_assert_eq!((a.id, a.status, &a.body[..]), (id, status, &body[..]));
        }

        #[test]
        fn any_bytes_decode_or_fail_cleanly(bytes: Vec<u8>) {
            let b = Bytes::from(bytes);
            let _ = decode_request(&b);
            let _ = decode_answer(&b);
            let _ = decode_clock(&b);
        }

        #[test]
        fn clocks_round_trip(ms: u64) {
            prop_assert_eq!(decode_clock(&encode_clock(ms)), Some(ms));
        }
    }
}

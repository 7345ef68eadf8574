//! The KCP control packets (HELLO, COOKIE, CONNECT, ACCEPT, BUSY, RESET) and the stateless
//! cookie that lets the server keep no state for a peer until it proves it can receive at
//! its claimed address (SPEC T4a; byte tables in PROTOCOL.md §8).
//!
//! Every control packet starts with conv = 0 (4 zero bytes: server-assigned convs are never
//! 0, so a control packet can never be mistaken for a KCP segment), the magic `WGKC`, a
//! version byte and a type byte. All integers are little-endian, as in KCP itself.
//! Decoding never panics and never indexes unchecked: a packet that is too short, has the
//! wrong magic, an unknown version or an unknown type decodes to `None`.

use std::net::{IpAddr, SocketAddr};

use ring::hmac;

use waygate_protocol::wire::CloseCode;

/// Magic after the zero conv of every control packet.
pub const MAGIC: [u8; 4] = *b"WGKC";
/// Version of the control packet format.
pub const VERSION: u8 = 1;
/// conv (4) + magic (4) + version (1) + type (1).
pub const HEADER_LEN: usize = 10;
/// Truncated HMAC-SHA256 length in a cookie.
pub const MAC_LEN: usize = 16;
/// HELLO and CONNECT are padded with zeros to exactly this size; shorter ones are ignored.
/// The padding makes every server reply smaller than the request that caused it.
pub const PADDED_LEN: usize = 64;
/// Size of a COOKIE.
pub const COOKIE_LEN: usize = HEADER_LEN + 8 + 4 + 4 + MAC_LEN;
/// Size of an ACCEPT.
pub const ACCEPT_LEN: usize = HEADER_LEN + 4;
/// Size of a BUSY.
pub const BUSY_LEN: usize = HEADER_LEN + 8 + 2 + 4;
/// Size of a RESET.
pub const RESET_LEN: usize = HEADER_LEN + 4 + 2;

/// The type byte of a control packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PacketType {
    /// Client asks for a cookie.
    Hello = 1,
    /// Server hands out a cookie.
    Cookie = 2,
    /// Client returns the cookie.
    Connect = 3,
    /// Server created (or already has) the session.
    Accept = 4,
    /// Server refuses for now (over a cap or rate).
    Busy = 5,
    /// The session is gone.
    Reset = 6,
}

/// The server's answer to a HELLO, echoed in CONNECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cookie {
    /// The client's random nonce from HELLO.
    pub client_nonce: u64,
    /// The conv the server assigned (random, nonzero).
    pub conv: u32,
    /// Server-relative seconds when the cookie was made.
    pub timestamp: u32,
    /// First 16 bytes of HMAC-SHA256(secret, ip | port | conv | timestamp | nonce).
    pub mac: [u8; MAC_LEN],
}

/// One decoded control packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Client -> server, 64 bytes.
    Hello {
        /// Random, chosen per handshake.
        client_nonce: u64,
    },
    /// Server -> client, 42 bytes.
    Cookie(Cookie),
    /// Client -> server, 64 bytes: the cookie echoed.
    Connect(Cookie),
    /// Server -> client, 14 bytes.
    Accept {
        /// The session's conv.
        conv: u32,
    },
    /// Server -> client, 24 bytes.
    Busy {
        /// The HELLO's or CONNECT's nonce.
        client_nonce: u64,
        /// Why (usually `Overloaded`).
        code: CloseCode,
        /// Wait at least this long before trying again.
        retry_after_ms: u32,
    },
    /// Either direction, 16 bytes.
    Reset {
        /// The session that is gone.
        conv: u32,
        /// Why.
        code: CloseCode,
    },
}

/// Whether a datagram is a control packet (conv field zero) rather than a KCP segment.
pub fn is_control(datagram: &[u8]) -> bool {
    datagram.get(..4) == Some(&[0u8; 4][..])
}

/// Reads little-endian fields front to back; every read is bounds-checked.
struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.bytes.split_first_chunk::<N>()?;
        self.bytes = rest;
        Some(*head)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take::<2>().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
    fn cookie(&mut self) -> Option<Cookie> {
        Some(Cookie {
            client_nonce: self.u64()?,
            conv: self.u32()?,
            timestamp: self.u32()?,
            mac: self.take::<MAC_LEN>()?,
        })
    }
}

impl Control {
    /// The packet's type.
    pub fn packet_type(&self) -> PacketType {
        match self {
            Self::Hello { .. } => PacketType::Hello,
            Self::Cookie(_) => PacketType::Cookie,
            Self::Connect(_) => PacketType::Connect,
            Self::Accept { .. } => PacketType::Accept,
            Self::Busy { .. } => PacketType::Busy,
            Self::Reset { .. } => PacketType::Reset,
        }
    }

    /// Exact size of the encoded packet.
    pub fn encoded_len(&self) -> usize {
        match self {
            Self::Hello { .. } | Self::Connect(_) => PADDED_LEN,
            Self::Cookie(_) => COOKIE_LEN,
            Self::Accept { .. } => ACCEPT_LEN,
            Self::Busy { .. } => BUSY_LEN,
            Self::Reset { .. } => RESET_LEN,
        }
    }

    /// Encodes the packet (padding included).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(self.packet_type() as u8);
        let put_cookie = |out: &mut Vec<u8>, c: &Cookie| {
            out.extend_from_slice(&c.client_nonce.to_le_bytes());
            out.extend_from_slice(&c.conv.to_le_bytes());
            out.extend_from_slice(&c.timestamp.to_le_bytes());
            out.extend_from_slice(&c.mac);
        };
        match self {
            Self::Hello { client_nonce } => out.extend_from_slice(&client_nonce.to_le_bytes()),
            Self::Cookie(c) | Self::Connect(c) => put_cookie(&mut out, c),
            Self::Accept { conv } => out.extend_from_slice(&conv.to_le_bytes()),
            Self::Busy {
                client_nonce,
                code,
                retry_after_ms,
            } => {
                out.extend_from_slice(&client_nonce.to_le_bytes());
                out.extend_from_slice(&code.to_u16().to_le_bytes());
                out.extend_from_slice(&retry_after_ms.to_le_bytes());
            }
            Self::Reset { conv, code } => {
                out.extend_from_slice(&conv.to_le_bytes());
                out.extend_from_slice(&code.to_u16().to_le_bytes());
            }
        }
        out.resize(self.encoded_len(), 0);
        out
    }

    /// Decodes a control packet; `None` for anything else (a KCP segment, a short HELLO or
    /// CONNECT, wrong magic, unknown version or type). Bytes after the fixed fields are
    /// ignored (padding, or extensions of a later version).
    pub fn decode(datagram: &[u8]) -> Option<Control> {
        let mut c = Cursor { bytes: datagram };
        if c.take::<4>()? != [0; 4] || c.take::<4>()? != MAGIC || c.take::<1>()? != [VERSION] {
            return None;
        }
        let [kind] = c.take::<1>()?;
        let padded = datagram.len() >= PADDED_LEN;
        Some(match kind {
            1 if padded => Self::Hello {
                client_nonce: c.u64()?,
            },
            2 => Self::Cookie(c.cookie()?),
            3 if padded => Self::Connect(c.cookie()?),
            4 => Self::Accept { conv: c.u32()? },
            5 => Self::Busy {
                client_nonce: c.u64()?,
                code: CloseCode::from_u16(c.u16()?),
                retry_after_ms: c.u32()?,
            },
            6 => Self::Reset {
                conv: c.u32()?,
                code: CloseCode::from_u16(c.u16()?),
            },
            _ => return None,
        })
    }
}

/// Longest connect token a CONNECT may carry (the HELLO token limit).
pub const MAX_CONNECT_TOKEN_LEN: usize = 4096;

/// The connect token after a CONNECT's 64 bytes (PROTOCOL.md §8.2.4: token length `u16`
/// LE, then the token, nothing after it); `None` for a plain CONNECT or a malformed tail.
pub fn connect_token(datagram: &[u8]) -> Option<&[u8]> {
    let tail = datagram.get(PADDED_LEN..)?;
    let (len, token) = tail.split_first_chunk::<2>()?;
    let len = usize::from(u16::from_le_bytes(*len));
    (len > 0 && len <= MAX_CONNECT_TOKEN_LEN && token.len() == len).then_some(token)
}

/// Appends `token` to an encoded CONNECT (see [`connect_token`]); a token longer than
/// [`MAX_CONNECT_TOKEN_LEN`] is not appended.
pub fn append_connect_token(connect: &mut Vec<u8>, token: &[u8]) {
    if token.is_empty() || token.len() > MAX_CONNECT_TOKEN_LEN {
        return;
    }
    connect.truncate(PADDED_LEN);
    connect.extend_from_slice(&(token.len() as u16).to_le_bytes());
    connect.extend_from_slice(token);
}

/// The endpoint's cookie secret: HMAC-SHA256 over the peer's address and the cookie fields.
/// A cookie proves that its holder received the COOKIE sent to that address; the server
/// stores nothing between HELLO and CONNECT.
pub struct CookieKey {
    key: hmac::Key,
}

impl std::fmt::Debug for CookieKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CookieKey(..)")
    }
}

/// Why a CONNECT's cookie was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CookieError {
    /// The MAC does not match (forged, altered, or from another address).
    BadMac,
    /// The MAC matches but the cookie is older than the lifetime (or from the future).
    Expired,
}

impl CookieKey {
    /// A key from a 32-byte secret (random per endpoint in production).
    pub fn new(secret: &[u8; 32]) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        }
    }

    /// The MAC of a cookie for `peer`.
    pub fn mac(&self, peer: SocketAddr, conv: u32, timestamp: u32, nonce: u64) -> [u8; MAC_LEN] {
        let mut ctx = hmac::Context::with_key(&self.key);
        match peer.ip() {
            IpAddr::V4(ip) => ctx.update(&ip.octets()),
            IpAddr::V6(ip) => ctx.update(&ip.octets()),
        }
        ctx.update(&peer.port().to_le_bytes());
        ctx.update(&conv.to_le_bytes());
        ctx.update(&timestamp.to_le_bytes());
        ctx.update(&nonce.to_le_bytes());
        let tag = ctx.sign();
        let mut mac = [0; MAC_LEN];
        for (out, byte) in mac.iter_mut().zip(tag.as_ref()) {
            *out = *byte;
        }
        mac
    }

    /// Makes a cookie for `peer`.
    pub fn issue(&self, peer: SocketAddr, client_nonce: u64, conv: u32, timestamp: u32) -> Cookie {
        Cookie {
            client_nonce,
            conv,
            timestamp,
            mac: self.mac(peer, conv, timestamp, client_nonce),
        }
    }

    /// Checks a returned cookie: the MAC (constant-time) and then its age in whole seconds
    /// against `lifetime_secs` at `now_secs`.
    pub fn verify(
        &self,
        peer: SocketAddr,
        cookie: &Cookie,
        now_secs: u32,
        lifetime_secs: u32,
    ) -> Result<(), CookieError> {
        let expected = self.mac(peer, cookie.conv, cookie.timestamp, cookie.client_nonce);
        if !ct_eq(&expected, &cookie.mac) {
            return Err(CookieError::BadMac);
        }
        match now_secs.checked_sub(cookie.timestamp) {
            Some(age) if age <= lifetime_secs => Ok(()),
            _ => Err(CookieError::Expired),
        }
    }
}

/// Constant-time equality of two MACs: no early exit, the result is folded from every byte.
/// (ring's own `verify_slices_are_equal` is deprecated for external use, and
/// `hmac::verify` wants the untruncated tag.)
fn ct_eq(a: &[u8; MAC_LEN], b: &[u8; MAC_LEN]) -> bool {
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    fn cookie() -> Cookie {
        Cookie {
            client_nonce: 0x0102_0304_0506_0708,
            conv: 0xDEAD_BEEF,
            timestamp: 77,
            mac: [9; MAC_LEN],
        }
    }

    #[test]
    fn sizes_match_the_byte_tables() {
        let all = [
            Control::Hello { client_nonce: 1 },
            Control::Cookie(cookie()),
            Control::Connect(cookie()),
            Control::Accept { conv: 5 },
            Control::Busy {
                client_nonce: 1,
                code: CloseCode::Overloaded,
                retry_after_ms: 1000,
            },
            Control::Reset {
                conv: 5,
                code: CloseCode::GoingAway,
            },
        ];
        let sizes = [64, 42, 64, 14, 24, 16];
        for (packet, size) in all.iter().zip(sizes) {
            let bytes = packet.encode();
            assert_eq!(bytes.len(), size, "{packet:?}");
            assert_eq!(packet.encoded_len(), size);
            assert!(is_control(&bytes));
            assert_eq!(Control::decode(&bytes), Some(*packet));
        }
    }

    #[test]
    fn golden_hello_and_reset_bytes() {
        let hello = Control::Hello {
            client_nonce: 0x1122_3344_5566_7788,
        }
        .encode();
        assert_eq!(
            &hello[..18],
            &[
                0, 0, 0, 0, b'W', b'G', b'K', b'C', 1, 1, 0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22,
                0x11
            ]
        );
        assert!(hello[18..].iter().all(|b| *b == 0));
        let reset = Control::Reset {
            conv: 0x0A0B_0C0D,
            code: CloseCode::Overloaded,
        }
        .encode();
        assert_eq!(
            reset,
            vec![0, 0, 0, 0, b'W', b'G', b'K', b'C', 1, 6, 0x0D, 0x0C, 0x0B, 0x0A, 0x90, 0x01]
        );
    }

    #[test]
    fn short_hello_and_connect_are_ignored() {
        let hello = Control::Hello { client_nonce: 1 }.encode();
        assert_eq!(Control::decode(&hello[..63]), None);
        let connect = Control::Connect(cookie()).encode();
        assert_eq!(Control::decode(&connect[..63]), None);
        // Wrong magic / version / type.
        let mut bad = hello.clone();
        bad[4] = b'X';
        assert_eq!(Control::decode(&bad), None);
        let mut bad = hello.clone();
        bad[8] = 2;
        assert_eq!(Control::decode(&bad), None);
        let mut bad = hello;
        bad[9] = 99;
        assert_eq!(Control::decode(&bad), None);
    }

    #[test]
    fn cookie_round_trip_and_refusals() {
        let key = CookieKey::new(&[7; 32]);
        let peer = addr("192.0.2.1:4000");
        let c = key.issue(peer, 42, 1234, 100);
        assert_eq!(key.verify(peer, &c, 100, 10), Ok(()));
        assert_eq!(key.verify(peer, &c, 110, 10), Ok(()));
        assert_eq!(key.verify(peer, &c, 111, 10), Err(CookieError::Expired));
        assert_eq!(key.verify(peer, &c, 99, 10), Err(CookieError::Expired));
        // Another address, port, conv, nonce or key.
        assert_eq!(
            key.verify(addr("192.0.2.2:4000"), &c, 100, 10),
            Err(CookieError::BadMac)
        );
        assert_eq!(
            key.verify(addr("192.0.2.1:4001"), &c, 100, 10),
            Err(CookieError::BadMac)
        );
        for tweak in [
            Cookie { conv: 1235, ..c },
            Cookie {
                client_nonce: 43,
                ..c
            },
            Cookie {
                timestamp: 101,
                ..c
            },
        ] {
            assert_eq!(key.verify(peer, &tweak, 101, 10), Err(CookieError::BadMac));
        }
        let other = CookieKey::new(&[8; 32]);
        assert_eq!(other.verify(peer, &c, 100, 10), Err(CookieError::BadMac));
        let v6 = addr("[2001:db8::1]:4000");
        let c6 = key.issue(v6, 1, 2, 3);
        assert_eq!(key.verify(v6, &c6, 3, 10), Ok(()));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = Control::decode(&bytes);
            let mut framed = vec![0, 0, 0, 0, b'W', b'G', b'K', b'C', 1];
            framed.extend_from_slice(&bytes);
            if let Some(packet) = Control::decode(&framed) {
                // Whatever decodes re-encodes to a prefix-equal packet.
                let again = packet.encode();
                prop_assert_eq!(Control::decode(&again), Some(packet));
            }
        }
    }
}

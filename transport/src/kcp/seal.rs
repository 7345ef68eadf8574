//! KCP packet protection (PROTOCOL.md §8.9, SPEC S2a): after the cookie exchange of a
//! session opened with a connect token, every datagram in both directions is sealed with
//! ChaCha20-Poly1305 (ring) under a per-direction key derived from the login's session key,
//! with a per-direction packet number as nonce and a replay window on receipt. A forged,
//! altered, replayed or spoofed datagram — a RESET included — fails [`PacketOpener::open`]
//! and is dropped before the KCP engine sees it. Sans-IO: bytes in, bytes out.
//!
//! ```text
//! datagram = conv (u32 LE) | packet number (u64 LE) | ChaCha20-Poly1305(plaintext) | tag (16)
//! key      = HKDF-SHA256(salt "waygate kcp v1", ikm session key, info "client to server" / "server to client")
//! nonce    = 00 00 00 00 | packet number (u64 LE);  aad = the 12 header bytes
//! ```
//!
//! The plaintext is what an unsealed session would send: KCP segments, or a RESET control
//! packet (which starts with conv 0 and the magic `WGKC`).

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};
use ring::hkdf;

/// Length of a login's session key.
pub const SESSION_KEY_LEN: usize = 32;
/// The sealed header: conv (4) and packet number (8).
pub const SEALED_HEADER_LEN: usize = 12;
/// The AEAD tag.
pub const SEAL_TAG_LEN: usize = 16;
/// Bytes a sealed datagram adds to its plaintext.
pub const SEAL_OVERHEAD: usize = SEALED_HEADER_LEN + SEAL_TAG_LEN;
/// Packet numbers accepted below the highest seen (older ones are dropped as stale).
pub const REPLAY_WINDOW: u64 = 1024;

/// A login's session key (from the connect token; PROTOCOL.md §7.2.2).
pub type SessionKey = [u8; SESSION_KEY_LEN];

/// What a client brings for a sealed session: the connect token its CONNECT carries and the
/// session key the login service handed it beside the token.
#[derive(Clone)]
pub struct KcpCredentials {
    /// The connect token (PROTOCOL.md §7.2.2), as in HELLO.
    pub token: bytes::Bytes,
    /// The session key sealed inside it.
    pub session_key: SessionKey,
}

impl std::fmt::Debug for KcpCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KcpCredentials")
            .field("token_len", &self.token.len())
            .finish_non_exhaustive()
    }
}

/// Server: opens a CONNECT's connect token (the edge implements it with its token keys).
pub trait ConnectKeys: Send + Sync + std::fmt::Debug + 'static {
    /// The session key of a valid, unexpired connect token; otherwise the auth code to
    /// refuse the CONNECT with (`auth_bad_signature`, `auth_expired`, ...).
    fn session_key(&self, token: &[u8]) -> Result<SessionKey, waygate_protocol::wire::CloseCode>;
}

const SALT: &[u8] = b"waygate kcp v1";
const CLIENT_TO_SERVER: &[u8] = b"client to server";
const SERVER_TO_CLIENT: &[u8] = b"server to client";

/// Why a datagram did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// Shorter than a header and a tag, or for another conv.
    #[error("not a sealed datagram of this session")]
    Malformed,
    /// The tag did not verify (forged, altered, or sealed under another key).
    #[error("authentication failed")]
    Forged,
    /// A packet number already received, or too far below the highest one.
    #[error("replayed or stale packet number")]
    Replayed,
}

fn direction_key(session_key: &SessionKey, info: &'static [u8]) -> LessSafeKey {
    struct Len(usize);
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SALT).extract(session_key);
    let mut key = [0u8; 32];
    let info = [info];
    // 32 bytes is far below HKDF-SHA256's 255 x 32 limit: expand and fill cannot fail.
    let filled = prk
        .expand(&info, Len(key.len()))
        .and_then(|okm| okm.fill(&mut key));
    debug_assert!(filled.is_ok());
    // A 32-byte key is exactly ChaCha20-Poly1305's key length.
    let unbound = UnboundKey::new(&CHACHA20_POLY1305, &key)
        .unwrap_or_else(|_| unreachable!("a 32-byte key is a valid ChaCha20-Poly1305 key"));
    LessSafeKey::new(unbound)
}

/// The two directions of a session, for the side that `is_server`.
pub fn session_seals(
    session_key: &SessionKey,
    conv: u32,
    is_server: bool,
) -> (PacketSealer, PacketOpener) {
    let (send, recv) = if is_server {
        (SERVER_TO_CLIENT, CLIENT_TO_SERVER)
    } else {
        (CLIENT_TO_SERVER, SERVER_TO_CLIENT)
    };
    (
        PacketSealer {
            key: direction_key(session_key, send),
            conv,
            next: 1,
        },
        PacketOpener {
            key: direction_key(session_key, recv),
            conv,
            window: ReplayWindow::default(),
        },
    )
}

fn nonce(number: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&number.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

/// Seals outgoing datagrams of one direction of one session.
pub struct PacketSealer {
    key: LessSafeKey,
    conv: u32,
    next: u64,
}

impl std::fmt::Debug for PacketSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketSealer")
            .field("conv", &self.conv)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl PacketSealer {
    /// The sealed datagram of `plaintext` under the next packet number.
    pub fn seal(&mut self, plaintext: &[u8]) -> Vec<u8> {
        let number = self.next;
        // 2^64 datagrams never happen; wrapping would reuse a nonce, so saturate instead
        // (the peer then drops everything as replayed: the session dies, nothing leaks).
        self.next = self.next.saturating_add(1);
        let mut out = Vec::with_capacity(SEAL_OVERHEAD + plaintext.len());
        out.extend_from_slice(&self.conv.to_le_bytes());
        out.extend_from_slice(&number.to_le_bytes());
        out.extend_from_slice(plaintext);
        let (header, body) = out.split_at_mut(SEALED_HEADER_LEN);
        match self
            .key
            .seal_in_place_separate_tag(nonce(number), Aad::from(&*header), body)
        {
            Ok(tag) => out.extend_from_slice(tag.as_ref()),
            // ring fails only for inputs over ~256 GiB.
            Err(_) => out.truncate(0),
        }
        out
    }
}

/// Opens incoming datagrams of one direction of one session.
pub struct PacketOpener {
    key: LessSafeKey,
    conv: u32,
    window: ReplayWindow,
}

impl std::fmt::Debug for PacketOpener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketOpener")
            .field("conv", &self.conv)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

impl PacketOpener {
    /// The plaintext of a sealed datagram, if it verifies and its packet number is new.
    /// The replay window moves only for datagrams that verified.
    pub fn open(&mut self, datagram: &[u8]) -> Result<Vec<u8>, OpenError> {
        if datagram.len() < SEAL_OVERHEAD {
            return Err(OpenError::Malformed);
        }
        let (header, rest) = datagram.split_at(SEALED_HEADER_LEN);
        let mut conv = [0u8; 4];
        conv.copy_from_slice(&header[..4]);
        if u32::from_le_bytes(conv) != self.conv {
            return Err(OpenError::Malformed);
        }
        let mut number = [0u8; 8];
        number.copy_from_slice(&header[4..]);
        let number = u64::from_le_bytes(number);
        if !self.window.may_accept(number) {
            return Err(OpenError::Replayed);
        }
        let mut body = rest.to_vec();
        let plain_len = self
            .key
            .open_in_place(nonce(number), Aad::from(header), &mut body)
            .map_err(|_| OpenError::Forged)?
            .len();
        body.truncate(plain_len);
        self.window.accept(number);
        Ok(body)
    }
}

/// Which packet numbers were received: the highest, and a bitmap of the
/// [`REPLAY_WINDOW`] below it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayWindow {
    highest: u64,
    /// Bit i: packet `highest - i` was received.
    bits: [u64; (REPLAY_WINDOW / 64) as usize],
}

impl ReplayWindow {
    fn bit(&self, back: u64) -> bool {
        let (word, bit) = ((back / 64) as usize, back % 64);
        self.bits.get(word).is_some_and(|w| w & (1 << bit) != 0)
    }

    /// Whether `number` is new and recent enough (0 never is).
    pub fn may_accept(&self, number: u64) -> bool {
        if number == 0 {
            return false;
        }
        if number > self.highest {
            return true;
        }
        let back = self.highest - number;
        back < REPLAY_WINDOW && !self.bit(back)
    }

    /// Records `number` (call only after [`ReplayWindow::may_accept`] and verification).
    pub fn accept(&mut self, number: u64) {
        if number > self.highest {
            let shift = number - self.highest;
            self.shift(shift);
            self.highest = number;
        }
        let back = self.highest - number;
        if back < REPLAY_WINDOW {
            let (word, bit) = ((back / 64) as usize, back % 64);
            if let Some(w) = self.bits.get_mut(word) {
                *w |= 1 << bit;
            }
        }
    }

    /// Moves every bit `by` places further back (older).
    fn shift(&mut self, by: u64) {
        if by >= REPLAY_WINDOW {
            self.bits = Default::default();
            return;
        }
        let words = (by / 64) as usize;
        let bits = (by % 64) as u32;
        let n = self.bits.len();
        for i in (0..n).rev() {
            let src = i.checked_sub(words);
            let hi = src.and_then(|s| self.bits.get(s)).copied().unwrap_or(0);
            let lo = src
                .and_then(|s| s.checked_sub(1))
                .and_then(|s| self.bits.get(s))
                .copied()
                .unwrap_or(0);
            self.bits[i] = if bits == 0 {
                hi
            } else {
                (hi << bits) | (lo >> (64 - bits))
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEY: SessionKey = [7; 32];

    #[test]
    fn seal_then_open_in_both_directions() {
        let (mut client_tx, mut client_rx) = session_seals(&KEY, 0x1234, false);
        let (mut server_tx, mut server_rx) = session_seals(&KEY, 0x1234, true);
        let d = client_tx.seal(b"segments");
        assert_eq!(d.len(), 8 + SEAL_OVERHEAD);
        assert_eq!(&d[..4], &0x1234u32.to_le_bytes());
        assert_eq!(server_rx.open(&d).unwrap(), b"segments");
        let back = server_tx.seal(b"reply");
        assert_eq!(client_rx.open(&back).unwrap(), b"reply");
        // A datagram does not open in its own direction (separate keys).
        let mut other = session_seals(&KEY, 0x1234, false).1;
        assert_eq!(other.open(&client_tx.seal(b"x")), Err(OpenError::Forged));
    }

    #[test]
    fn forged_altered_replayed_and_foreign_datagrams_fail() {
        let (mut tx, _) = session_seals(&KEY, 9, false);
        let (_, mut rx) = session_seals(&KEY, 9, true);
        let d1 = tx.seal(b"one");
        let d2 = tx.seal(b"two");
        assert_eq!(rx.open(&d2).unwrap(), b"two");
        assert_eq!(rx.open(&d2), Err(OpenError::Replayed), "replayed");
        assert_eq!(rx.open(&d1).unwrap(), b"one", "reordered but new");
        assert_eq!(rx.open(&d1), Err(OpenError::Replayed));
        let mut altered = tx.seal(b"three");
        altered[SEALED_HEADER_LEN] ^= 1;
        assert_eq!(rx.open(&altered), Err(OpenError::Forged));
        let mut renumbered = tx.seal(b"four");
        renumbered[4] ^= 0x40;
        assert_eq!(rx.open(&renumbered), Err(OpenError::Forged));
        let (mut wrong_key, _) = session_seals(&[8; 32], 9, false);
        let forged = (0..10).map(|_| wrong_key.seal(b"x")).last().unwrap();
        assert_eq!(rx.open(&forged), Err(OpenError::Forged));
        let (mut wrong_conv, _) = session_seals(&KEY, 10, false);
        assert_eq!(rx.open(&wrong_conv.seal(b"x")), Err(OpenError::Malformed));
        assert_eq!(rx.open(&[0u8; 27]), Err(OpenError::Malformed));
        // Failed datagrams did not move the window: the real next one still opens.
        assert_eq!(rx.open(&tx.seal(b"five")).unwrap(), b"five");
    }

    #[test]
    fn stale_numbers_below_the_window_are_dropped() {
        let mut w = ReplayWindow::default();
        assert!(!w.may_accept(0));
        w.accept(5_000);
        assert!(!w.may_accept(5_000 - REPLAY_WINDOW));
        assert!(w.may_accept(5_000 - REPLAY_WINDOW + 1));
        assert!(w.may_accept(5_001));
    }

    /// PROTOCOL.md §8.9 worked example.
    #[test]
    fn worked_example() {
        let key: SessionKey = core::array::from_fn(|i| i as u8);
        let (mut tx, _) = session_seals(&key, 0x0A0B_0C0D, false);
        let d = tx.seal(b"hi");
        let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
        let doc = include_str!("../../../PROTOCOL.md");
        assert!(doc.contains(&hex), "sealed datagram {hex} in PROTOCOL.md");
    }

    proptest! {
        /// Against a model set: a number is accepted exactly once, and only within the
        /// window below the highest.
        #[test]
        fn window_accepts_each_number_once(numbers in proptest::collection::vec(1u64..3_000, 1..400)) {
            let mut w = ReplayWindow::default();
            let mut seen = std::collections::BTreeSet::new();
            let mut highest = 0u64;
            for n in numbers {
                let expect = !seen.contains(&n) && (n > highest || highest - n < REPLAY_WINDOW);
                prop_assert_eq!(w.may_accept(n), expect, "number {} highest {}", n, highest);
                if expect {
                    w.accept(n);
                    seen.insert(n);
                    highest = highest.max(n);
                }
            }
        }
    }
}

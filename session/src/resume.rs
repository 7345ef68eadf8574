//! Session ids and resume tokens (SPEC S3): random 128-bit values, single use, rotated on
//! every successful restore, stored only as SHA-256 hashes (the resume key a client's proof
//! of possession is made with, PROTOCOL.md §7.3) and compared in constant time.

use ring::digest;
use waygate_protocol::frame::{ResumeToken, SessionId};
use waygate_protocol::resume_proof::{verify_resume_proof, ResumeProof};
use waygate_protocol::wire::ID_LEN;

use crate::rng::SessionRng;

/// SHA-256 of a resume token: the only form the server keeps.
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct ResumeHash(pub [u8; 32]);

impl std::fmt::Debug for ResumeHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Enough to correlate logs, never enough to matter.
        write!(f, "ResumeHash({:02x}{:02x}..)", self.0[0], self.0[1])
    }
}

impl ResumeHash {
    /// Hashes a presented token.
    pub fn of(token: &ResumeToken) -> Self {
        let d = digest::digest(&digest::SHA256, token);
        let mut out = [0u8; 32];
        out.copy_from_slice(d.as_ref());
        Self(out)
    }

    /// Whether `token` hashes to this value, compared in constant time.
    pub fn matches(&self, token: &ResumeToken) -> bool {
        ct_eq(&self.0, &Self::of(token).0)
    }

    /// Constant-time equality of two hashes.
    pub fn ct_eq(&self, other: &ResumeHash) -> bool {
        ct_eq(&self.0, &other.0)
    }

    /// Whether `proof` was made with the token this is the hash of (the hash is the resume
    /// key, PROTOCOL.md §7.3.1) for these values.
    pub fn proves(
        &self,
        session_id: &SessionId,
        last_server_seq: u64,
        nonce: u64,
        proof: &ResumeProof,
    ) -> bool {
        verify_resume_proof(&self.0, session_id, last_server_seq, nonce, proof)
    }
}

/// Constant-time equality of two equal-length byte arrays.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// A fresh random 128-bit session id.
pub fn new_session_id(rng: &mut dyn SessionRng) -> SessionId {
    let mut id = [0u8; ID_LEN];
    rng.fill(&mut id);
    id
}

/// A fresh random 128-bit resume token and its hash.
pub fn new_resume_token(rng: &mut dyn SessionRng) -> (ResumeToken, ResumeHash) {
    let mut token = [0u8; ID_LEN];
    rng.fill(&mut token);
    (token, ResumeHash::of(&token))
}

/// Lower-case hex of an id, for logs and store keys.
pub fn hex_id(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SeededRng;

    #[test]
    fn tokens_are_random_and_hash_matches() {
        let mut rng = SeededRng::new(1);
        let (t1, h1) = new_resume_token(&mut rng);
        let (t2, h2) = new_resume_token(&mut rng);
        assert_ne!(t1, t2);
        assert!(h1.matches(&t1));
        assert!(!h1.matches(&t2));
        assert!(!h2.ct_eq(&h1));
        assert_eq!(hex_id(&[0xab, 0x01]), "ab01");
    }
}

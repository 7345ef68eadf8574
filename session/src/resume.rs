//! Session ids and resume tokens (SPEC S3). A session id is 128 bits: a 32-bit store tag
//! of its player ([`player_store_tag`], so a sharded store such as Redis Cluster can keep a
//! session's snapshot beside its player's owner record) and 96 random bits. Resume tokens
//! are random 128-bit values, single use, rotated on every successful restore, stored only
//! as SHA-256 hashes (the resume key a client's proof of possession is made with,
//! PROTOCOL.md §7.3) and compared in constant time.

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

/// Length of the store tag at the start of every session id.
pub const STORE_TAG_LEN: usize = 4;

/// The store tag of a player: the first 4 bytes of SHA-256 of its id. Every session id of
/// the player starts with it ([`new_session_id`]), so a store sharded by tag (Redis
/// Cluster hash tags) finds a session's records on the shard of its player's.
pub fn player_store_tag(player_id: &str) -> [u8; STORE_TAG_LEN] {
    let d = digest::digest(&digest::SHA256, player_id.as_bytes());
    let mut tag = [0u8; STORE_TAG_LEN];
    tag.copy_from_slice(&d.as_ref()[..STORE_TAG_LEN]);
    tag
}

/// The store tag a session id starts with (its player's [`player_store_tag`]).
pub fn session_store_tag(session_id: &SessionId) -> [u8; STORE_TAG_LEN] {
    let mut tag = [0u8; STORE_TAG_LEN];
    tag.copy_from_slice(&session_id[..STORE_TAG_LEN]);
    tag
}

/// A fresh session id of `player_id`: its store tag, then 96 random bits.
pub fn new_session_id(rng: &mut dyn SessionRng, player_id: &str) -> SessionId {
    let mut id = [0u8; ID_LEN];
    rng.fill(&mut id[STORE_TAG_LEN..]);
    id[..STORE_TAG_LEN].copy_from_slice(&player_store_tag(player_id));
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

    #[test]
    fn session_ids_carry_their_players_store_tag() {
        let mut rng = SeededRng::new(2);
        let (a1, a2) = (
            new_session_id(&mut rng, "alice"),
            new_session_id(&mut rng, "alice"),
        );
        let b = new_session_id(&mut rng, "bob");
        assert_ne!(a1, a2, "96 random bits");
        assert_eq!(session_store_tag(&a1), player_store_tag("alice"));
        assert_eq!(session_store_tag(&a2), player_store_tag("alice"));
        assert_eq!(session_store_tag(&b), player_store_tag("bob"));
        assert_ne!(player_store_tag("alice"), player_store_tag("bob"));
        // SHA-256("alice") starts 2bd806c9: the tag is stable across builds and processes.
        assert_eq!(hex_id(&player_store_tag("alice")), "2bd806c9");
    }
}

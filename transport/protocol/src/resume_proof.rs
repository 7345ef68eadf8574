//! Resume with proof of possession (PROTOCOL.md §7.3): a resuming client never sends its
//! resume token. It proves it holds it with an HMAC over the request, keyed from the token,
//! and a nonce the edge accepts once, so a captured resume HELLO cannot be replayed.
//!
//! ```text
//! resume_key = SHA-256(resume_token)                                  (32 bytes; what the edge keeps)
//! proof      = HMAC-SHA256(resume_key, "waygate resume v1" | session_id (16) | last_server_seq (u64 BE) | nonce (u64 BE))
//! ```
//!
//! The edge accepts a proof made with the session's current key or the one it replaced (until
//! the client confirms the rotation, §7.3.2), and only with a nonce above every nonce it
//! accepted for the session before.

use ring::{digest, hmac};

use crate::frame::{ResumeToken, SessionId};

/// Length of a resume proof (a whole HMAC-SHA256 tag).
pub const RESUME_PROOF_LEN: usize = 32;

/// A resume proof as HELLO carries it.
pub type ResumeProof = [u8; RESUME_PROOF_LEN];

/// The key derived from a resume token: SHA-256 of it. The edge stores only this.
pub type ResumeKey = [u8; 32];

const LABEL: &[u8] = b"waygate resume v1";

/// The key of `token` (SHA-256).
pub fn resume_key(token: &ResumeToken) -> ResumeKey {
    let d = digest::digest(&digest::SHA256, token);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

fn message(session_id: &SessionId, last_server_seq: u64, nonce: u64) -> [u8; 17 + 16 + 16] {
    let mut m = [0u8; 17 + 16 + 16];
    m[..17].copy_from_slice(LABEL);
    m[17..33].copy_from_slice(session_id);
    m[33..41].copy_from_slice(&last_server_seq.to_be_bytes());
    m[41..49].copy_from_slice(&nonce.to_be_bytes());
    m
}

/// The proof a client sends for resuming `session_id` with `last_server_seq` and `nonce`.
pub fn resume_proof(
    key: &ResumeKey,
    session_id: &SessionId,
    last_server_seq: u64,
    nonce: u64,
) -> ResumeProof {
    let key = hmac::Key::new(hmac::HMAC_SHA256, key);
    let tag = hmac::sign(&key, &message(session_id, last_server_seq, nonce));
    let mut out = [0u8; RESUME_PROOF_LEN];
    out.copy_from_slice(tag.as_ref());
    out
}

/// Whether `proof` was made with `key` for these values (constant time).
pub fn verify_resume_proof(
    key: &ResumeKey,
    session_id: &SessionId,
    last_server_seq: u64,
    nonce: u64,
    proof: &ResumeProof,
) -> bool {
    let key = hmac::Key::new(hmac::HMAC_SHA256, key);
    hmac::verify(&key, &message(session_id, last_server_seq, nonce), proof).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// The worked example of PROTOCOL.md §7.3.1, byte for byte.
    #[test]
    fn worked_example() {
        let token: ResumeToken = core::array::from_fn(|i| i as u8);
        let session_id: SessionId = [0xAA; 16];
        let key = resume_key(&token);
        let proof = resume_proof(&key, &session_id, 5, 1);
        let doc = include_str!("../../../PROTOCOL.md");
        assert!(doc.contains(&hex(&key)), "key {} in PROTOCOL.md", hex(&key));
        assert!(
            doc.contains(&hex(&proof)),
            "proof {} in PROTOCOL.md",
            hex(&proof)
        );
        assert!(verify_resume_proof(&key, &session_id, 5, 1, &proof));
    }

    #[test]
    fn any_changed_field_fails() {
        let key = resume_key(&[7; 16]);
        let sid = [1; 16];
        let proof = resume_proof(&key, &sid, 10, 3);
        assert!(verify_resume_proof(&key, &sid, 10, 3, &proof));
        assert!(!verify_resume_proof(&key, &sid, 11, 3, &proof));
        assert!(!verify_resume_proof(&key, &sid, 10, 4, &proof));
        assert!(!verify_resume_proof(&key, &[2; 16], 10, 3, &proof));
        assert!(!verify_resume_proof(
            &resume_key(&[8; 16]),
            &sid,
            10,
            3,
            &proof
        ));
        let mut bad = proof;
        bad[31] ^= 1;
        assert!(!verify_resume_proof(&key, &sid, 10, 3, &bad));
    }
}

//! Resume keys sealed at rest (`cluster.redis_resume_key_file`). A session's resume key (the
//! SHA-256 of its resume token, what a client's proof of possession is made with,
//! PROTOCOL.md §7.3.1) must be known to whichever edge restores the session, so the
//! snapshot carries it; in clear, anyone who can read Redis (a backup, a replica, a
//! monitoring account with the password) could make the proof and take the session over.
//! With a key the edges share, a snapshot keeps instead:
//!
//! - a **match tag** per resume key, HMAC-SHA256 under a key derived from the shared one,
//!   over the session id and the resume key: what the take script compares (the edge
//!   computes it from the key a proof was checked with), useless for making a proof;
//! - the resume key **sealed** with ChaCha20-Poly1305 under a key of the session's own,
//!   derived from a second key derived from the shared one (HMAC over the session id; a
//!   random nonce, the session id as associated data too), which only an edge holding the
//!   shared key opens. A key per session keeps the random nonces of a busy fleet far from
//!   colliding under one key, and a sealed key moved to another session's record does not
//!   open.
//!
//! Both from ring; nothing here is a primitive of its own.

use ring::aead;
use ring::hmac;
use ring::rand::{SecureRandom as _, SystemRandom};
use waygate_protocol::frame::SessionId;
use waygate_session::resume::{hex_id, ResumeHash};

use super::RedisError;

/// What a match tag starts with (a resume key in clear is 64 hex digits, never this).
const MATCH_PREFIX: &str = "m1:";
/// What a sealed resume key starts with.
const SEALED_PREFIX: &str = "s1:";
const MATCH_LABEL: &[u8] = b"waygate redis resume key match v1";
const FINGERPRINT_LABEL: &[u8] = b"waygate redis resume key fingerprint v1";
const SEAL_LABEL: &[u8] = b"waygate redis resume key seal v1";
const NONCE_LEN: usize = 12;

/// The edges' shared key for resume keys at rest (see the module docs). Its `Debug` shows
/// nothing of it.
pub struct ResumeKeySeal {
    matcher: hmac::Key,
    /// Names the secret without revealing it (edges compare theirs in Redis).
    fingerprint: String,
    /// What each session's sealing key is derived from.
    sealer: hmac::Key,
    rng: SystemRandom,
}

impl std::fmt::Debug for ResumeKeySeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResumeKeySeal(<redacted>)")
    }
}

impl ResumeKeySeal {
    /// Both keys derived from `secret` (HMAC-SHA256 of a label each).
    pub fn new(secret: &[u8]) -> Self {
        let root = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let derive = |label| hmac::Key::new(hmac::HMAC_SHA256, hmac::sign(&root, label).as_ref());
        let fingerprint = hex_id(&hmac::sign(&root, FINGERPRINT_LABEL).as_ref()[..16]);
        Self {
            matcher: derive(MATCH_LABEL),
            sealer: derive(SEAL_LABEL),
            fingerprint,
            rng: SystemRandom::new(),
        }
    }

    /// A name of the secret (16 bytes of an HMAC of it, hex) that the edges of a deployment
    /// compare in Redis: equal for the same secret, and nothing about it otherwise.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The sealing key of `session_id`'s resume keys.
    fn session_key(&self, session_id: &SessionId) -> aead::LessSafeKey {
        let derived = hmac::sign(&self.sealer, session_id);
        let unbound = aead::UnboundKey::new(&aead::CHACHA20_POLY1305, derived.as_ref())
            .unwrap_or_else(|_| unreachable!("HMAC-SHA256 output is a 32-byte key"));
        aead::LessSafeKey::new(unbound)
    }

    /// The match tag of `key` for `session_id`: what the store compares a key with.
    pub fn match_tag(&self, session_id: &SessionId, key: &ResumeHash) -> String {
        let mut ctx = hmac::Context::with_key(&self.matcher);
        ctx.update(session_id);
        ctx.update(&key.0);
        format!("{MATCH_PREFIX}{}", hex_id(ctx.sign().as_ref()))
    }

    /// `key` sealed for `session_id`.
    pub fn seal(&self, session_id: &SessionId, key: &ResumeHash) -> Result<String, RedisError> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| RedisError::Invalid("no randomness for a nonce".into()))?;
        let mut sealed = key.0.to_vec();
        self.session_key(session_id)
            .seal_in_place_append_tag(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(&session_id[..]),
                &mut sealed,
            )
            .map_err(|_| RedisError::Invalid("resume key not sealed".into()))?;
        Ok(format!(
            "{SEALED_PREFIX}{}{}",
            hex_id(&nonce),
            hex_id(&sealed)
        ))
    }

    /// Opens what [`ResumeKeySeal::seal`] made for `session_id`; an error if it was made
    /// with another key, for another session, or altered.
    pub fn open(&self, session_id: &SessionId, sealed: &str) -> Result<ResumeHash, RedisError> {
        let corrupt = || {
            RedisError::Corrupt(format!(
                "snapshot {}: a sealed resume key that does not open with this edge's \
                 cluster.redis_resume_key_file (edges must share it)",
                hex_id(session_id)
            ))
        };
        let bytes = sealed
            .strip_prefix(SEALED_PREFIX)
            .and_then(unhex)
            .ok_or_else(corrupt)?;
        if bytes.len() < NONCE_LEN {
            return Err(corrupt());
        }
        let (nonce, rest) = bytes.split_at(NONCE_LEN);
        let nonce = aead::Nonce::try_assume_unique_for_key(nonce).map_err(|_| corrupt())?;
        let mut rest = rest.to_vec();
        let sealer = self.session_key(session_id);
        let plain = sealer
            .open_in_place(nonce, aead::Aad::from(&session_id[..]), &mut rest)
            .map_err(|_| corrupt())?;
        let key: [u8; 32] = plain.try_into().map_err(|_| corrupt())?;
        Ok(ResumeHash(key))
    }
}

/// Bytes from hex digits (an even number of them).
fn unhex(hex: &str) -> Option<Vec<u8>> {
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A sealed key opens to itself, only for its session and only with its secret;
        /// any altered character makes it unreadable; the match tag is the same every time
        /// and differs between sessions and keys; neither shows the key.
        #[test]
        fn sealed_keys_open_only_where_they_belong(
            key in any::<[u8; 32]>(),
            sid in any::<[u8; 16]>(),
            other in any::<[u8; 16]>(),
            at in 3usize..120,
        ) {
            prop_assume!(sid != other);
            let seal = ResumeKeySeal::new(b"a shared secret of the edges, long enough");
            let key = ResumeHash(key);
            let sealed = seal.seal(&sid, &key).unwrap();
            prop_assert_eq!(seal.open(&sid, &sealed).unwrap(), key);
            prop_assert!(seal.open(&other, &sealed).is_err());
            let stranger = ResumeKeySeal::new(b"another secret, of another deployment");
            prop_assert!(stranger.open(&sid, &sealed).is_err());
            let mut altered: Vec<char> = sealed.chars().collect();
            let i = at.min(altered.len() - 1);
            altered[i] = if altered[i] == '0' { '1' } else { '0' };
            let altered: String = altered.into_iter().collect();
            prop_assert!(seal.open(&sid, &altered).is_err());
            let plain = hex_id(&key.0);
            prop_assert!(!sealed.contains(&plain));
            let tag = seal.match_tag(&sid, &key);
            prop_assert_eq!(&tag, &seal.match_tag(&sid, &key));
            prop_assert!(!tag.contains(&plain));
            prop_assert_ne!(&tag, &seal.match_tag(&other, &key));
            prop_assert_ne!(&tag, &stranger.match_tag(&sid, &key));
            prop_assert_ne!(seal.seal(&sid, &key).unwrap(), sealed, "a fresh nonce each time");
        }
    }
}

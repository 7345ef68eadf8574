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

/// The keys derived from one secret.
struct SecretKeys {
    matcher: hmac::Key,
    /// Names the secret without revealing it (edges compare theirs in Redis).
    fingerprint: String,
    /// What each session's sealing key is derived from.
    sealer: hmac::Key,
}

impl SecretKeys {
    /// Both keys derived from `secret` (HMAC-SHA256 of a label each).
    fn new(secret: &[u8]) -> Self {
        let root = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let derive = |label| hmac::Key::new(hmac::HMAC_SHA256, hmac::sign(&root, label).as_ref());
        Self {
            matcher: derive(MATCH_LABEL),
            sealer: derive(SEAL_LABEL),
            fingerprint: hex_id(&hmac::sign(&root, FINGERPRINT_LABEL).as_ref()[..16]),
        }
    }

    /// The sealing key of `session_id`'s resume keys.
    fn session_key(&self, session_id: &SessionId) -> aead::LessSafeKey {
        let derived = hmac::sign(&self.sealer, session_id);
        let unbound = aead::UnboundKey::new(&aead::CHACHA20_POLY1305, derived.as_ref())
            .unwrap_or_else(|_| unreachable!("HMAC-SHA256 output is a 32-byte key"));
        aead::LessSafeKey::new(unbound)
    }

    fn match_tag(&self, session_id: &SessionId, key: &ResumeHash) -> String {
        let mut ctx = hmac::Context::with_key(&self.matcher);
        ctx.update(session_id);
        ctx.update(&key.0);
        format!("{MATCH_PREFIX}{}", hex_id(ctx.sign().as_ref()))
    }

    /// The 32 bytes `sealed` (nonce, then ciphertext and tag) holds for `session_id`.
    fn open(&self, session_id: &SessionId, sealed: &[u8]) -> Option<[u8; 32]> {
        let (nonce, rest) = sealed.split_at_checked(NONCE_LEN)?;
        let nonce = aead::Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut rest = rest.to_vec();
        let plain = self
            .session_key(session_id)
            .open_in_place(nonce, aead::Aad::from(&session_id[..]), &mut rest)
            .ok()?;
        plain.try_into().ok()
    }
}

/// The edges' shared key for resume keys at rest (see the module docs), and during a
/// rotation a second secret whose records it also reads (`accepted`). Its `Debug` shows
/// nothing of them.
///
/// Rotating the secret without a session failing to resume, edge by edge at each step:
/// (1) every edge accepts the new secret and still seals with the old one; (2) every edge
/// seals with the new one and accepts the old; (3) once no record sealed with the old one
/// is left (the linger time after step 2), the old one goes. At every moment each edge
/// reads what any other writes.
pub struct ResumeKeySeal {
    current: SecretKeys,
    accepted: Option<SecretKeys>,
    rng: SystemRandom,
}

impl std::fmt::Debug for ResumeKeySeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResumeKeySeal(<redacted>)")
    }
}

impl ResumeKeySeal {
    /// Sealing and matching with `secret` only.
    pub fn new(secret: &[u8]) -> Self {
        Self {
            current: SecretKeys::new(secret),
            accepted: None,
            rng: SystemRandom::new(),
        }
    }

    /// Sealing with `secret`, and also reading what was sealed with `accepted` (a rotation,
    /// see the type's docs).
    pub fn rotating(secret: &[u8], accepted: &[u8]) -> Self {
        Self {
            accepted: Some(SecretKeys::new(accepted)),
            ..Self::new(secret)
        }
    }

    /// A name of the sealing secret (16 bytes of an HMAC of it, hex) that the edges of a
    /// deployment compare in Redis: equal for the same secret, and nothing about it
    /// otherwise.
    pub fn fingerprint(&self) -> &str {
        &self.current.fingerprint
    }

    /// The name of the accepted secret, during a rotation.
    pub fn accepted_fingerprint(&self) -> Option<&str> {
        self.accepted.as_ref().map(|a| a.fingerprint.as_str())
    }

    /// The match tag of `key` for `session_id`: what the store compares a key with.
    pub fn match_tag(&self, session_id: &SessionId, key: &ResumeHash) -> String {
        self.current.match_tag(session_id, key)
    }

    /// Every tag a record holding `key` for `session_id` may carry: the sealing secret's,
    /// then the accepted one's.
    pub fn match_tags(&self, session_id: &SessionId, key: &ResumeHash) -> Vec<String> {
        self.secrets()
            .map(|s| s.match_tag(session_id, key))
            .collect()
    }

    /// The sealing secret's keys, then the accepted one's.
    fn secrets(&self) -> impl Iterator<Item = &SecretKeys> {
        std::iter::once(&self.current).chain(&self.accepted)
    }

    /// `key` sealed for `session_id`.
    pub fn seal(&self, session_id: &SessionId, key: &ResumeHash) -> Result<String, RedisError> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| RedisError::Invalid("no randomness for a nonce".into()))?;
        let mut sealed = key.0.to_vec();
        self.current
            .session_key(session_id)
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

    /// Opens what [`ResumeKeySeal::seal`] made for `session_id`, with the sealing secret or
    /// the accepted one; an error if it was made with another key, for another session, or
    /// altered.
    pub fn open(&self, session_id: &SessionId, sealed: &str) -> Result<ResumeHash, RedisError> {
        let bytes = sealed.strip_prefix(SEALED_PREFIX).and_then(unhex);
        bytes
            .and_then(|b| self.secrets().find_map(|s| s.open(session_id, &b)))
            .map(ResumeHash)
            .ok_or_else(|| {
                RedisError::Corrupt(format!(
                    "snapshot {}: a sealed resume key that does not open with this edge's \
                     cluster.redis_resume_key_file (edges must share it)",
                    hex_id(session_id)
                ))
            })
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

        /// During a rotation an edge reads what either secret sealed, and a take carries the
        /// tags of both; it seals with its sealing secret only. A third secret still opens
        /// nothing.
        #[test]
        fn a_rotating_edge_reads_both_secrets_and_seals_with_one(
            key in any::<[u8; 32]>(),
            sid in any::<[u8; 16]>(),
        ) {
            let (old, new): (&[u8], &[u8]) =
                (b"the old secret of the edges, long enough", b"the new secret of the edges, long enough");
            let key = ResumeHash(key);
            let (before, after) = (ResumeKeySeal::new(old), ResumeKeySeal::new(new));
            for (seal, accepted) in [(old, new), (new, old)] {
                let rotating = ResumeKeySeal::rotating(seal, accepted);
                for other in [&before, &after] {
                    prop_assert_eq!(rotating.open(&sid, &other.seal(&sid, &key).unwrap()).unwrap(), key);
                    prop_assert!(rotating.match_tags(&sid, &key).contains(&other.match_tag(&sid, &key)));
                }
                let sealer = ResumeKeySeal::new(seal);
                prop_assert_eq!(sealer.open(&sid, &rotating.seal(&sid, &key).unwrap()).unwrap(), key);
                prop_assert_eq!(rotating.match_tag(&sid, &key), sealer.match_tag(&sid, &key));
                prop_assert_eq!(rotating.fingerprint(), sealer.fingerprint());
                let accepting = ResumeKeySeal::new(accepted);
                prop_assert_eq!(rotating.accepted_fingerprint(), Some(accepting.fingerprint()));
                let stranger = ResumeKeySeal::new(b"a third secret, of nobody here, long enough");
                prop_assert!(rotating.open(&sid, &stranger.seal(&sid, &key).unwrap()).is_err());
                prop_assert!(!rotating.match_tags(&sid, &key).contains(&stranger.match_tag(&sid, &key)));
            }
        }
    }
}

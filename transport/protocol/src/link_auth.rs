//! The backend link's shared-secret handshake (PROTOCOL.md §9.3): both ends prove they hold
//! the same secret without sending it, each over both ends' fresh nonces and its own name,
//! so a proof can neither be replayed on another link nor reflected back. HMAC-SHA256 from
//! `ring`; comparisons are constant time.
//!
//! ```text
//! edge    -> backend  LINK_HELLO    ..., nonce_e (16 random bytes)
//! backend -> edge     LINK_WELCOME  ..., nonce_b (16), proof_b = HMAC(secret, "waygate link v1 backend" | nonce_e | nonce_b | instance_id)
//! edge    -> backend  LINK_AUTH     proof_e = HMAC(secret, "waygate link v1 edge" | nonce_e | nonce_b | edge_id)
//! ```

use ring::hmac;

/// Length of a link nonce.
pub const LINK_NONCE_LEN: usize = 16;
/// Length of a link proof (HMAC-SHA256).
pub const LINK_PROOF_LEN: usize = 32;
/// Shortest link secret accepted.
pub const MIN_LINK_SECRET_LEN: usize = 16;

/// A link handshake nonce.
pub type LinkNonce = [u8; LINK_NONCE_LEN];
/// A link handshake proof.
pub type LinkProof = [u8; LINK_PROOF_LEN];

/// What a backend with a secret adds to LINK_WELCOME.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkWelcomeAuth {
    /// The backend's challenge.
    pub nonce: LinkNonce,
    /// The backend's proof ([`backend_proof`]).
    pub proof: LinkProof,
}

const BACKEND_LABEL: &[u8] = b"waygate link v1 backend";
const EDGE_LABEL: &[u8] = b"waygate link v1 edge";

fn message(label: &[u8], edge_nonce: &LinkNonce, backend_nonce: &LinkNonce, name: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(label.len() + 2 * LINK_NONCE_LEN + name.len());
    m.extend_from_slice(label);
    m.extend_from_slice(edge_nonce);
    m.extend_from_slice(backend_nonce);
    m.extend_from_slice(name.as_bytes());
    m
}

fn sign(secret: &[u8], msg: &[u8]) -> LinkProof {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let tag = hmac::sign(&key, msg);
    let mut out = [0u8; LINK_PROOF_LEN];
    out.copy_from_slice(tag.as_ref());
    out
}

fn verify(secret: &[u8], msg: &[u8], proof: &LinkProof) -> bool {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    hmac::verify(&key, msg, proof).is_ok()
}

/// The backend's proof, sent in LINK_WELCOME.
pub fn backend_proof(
    secret: &[u8],
    edge_nonce: &LinkNonce,
    backend_nonce: &LinkNonce,
    instance_id: &str,
) -> LinkProof {
    sign(
        secret,
        &message(BACKEND_LABEL, edge_nonce, backend_nonce, instance_id),
    )
}

/// Whether a LINK_WELCOME's proof shows the backend holds `secret` (constant time).
pub fn verify_backend(
    secret: &[u8],
    edge_nonce: &LinkNonce,
    welcome: &LinkWelcomeAuth,
    instance_id: &str,
) -> bool {
    verify(
        secret,
        &message(BACKEND_LABEL, edge_nonce, &welcome.nonce, instance_id),
        &welcome.proof,
    )
}

/// The edge's proof, sent in LINK_AUTH.
pub fn edge_proof(
    secret: &[u8],
    edge_nonce: &LinkNonce,
    backend_nonce: &LinkNonce,
    edge_id: &str,
) -> LinkProof {
    sign(
        secret,
        &message(EDGE_LABEL, edge_nonce, backend_nonce, edge_id),
    )
}

/// Whether a LINK_AUTH's proof shows the edge holds `secret` (constant time).
pub fn verify_edge(
    secret: &[u8],
    edge_nonce: &LinkNonce,
    backend_nonce: &LinkNonce,
    edge_id: &str,
    proof: &LinkProof,
) -> bool {
    verify(
        secret,
        &message(EDGE_LABEL, edge_nonce, backend_nonce, edge_id),
        proof,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"a link secret of some length";

    #[test]
    fn proofs_verify_only_with_the_same_secret_nonces_and_names() {
        let (ne, nb) = ([1u8; 16], [2u8; 16]);
        let welcome = LinkWelcomeAuth {
            nonce: nb,
            proof: backend_proof(SECRET, &ne, &nb, "b1"),
        };
        assert!(verify_backend(SECRET, &ne, &welcome, "b1"));
        assert!(!verify_backend(
            b"another secret entirely",
            &ne,
            &welcome,
            "b1"
        ));
        assert!(
            !verify_backend(SECRET, &[3; 16], &welcome, "b1"),
            "another edge nonce"
        );
        assert!(
            !verify_backend(SECRET, &ne, &welcome, "b2"),
            "another instance"
        );
        let proof = edge_proof(SECRET, &ne, &nb, "edge-1");
        assert!(verify_edge(SECRET, &ne, &nb, "edge-1", &proof));
        assert!(
            !verify_edge(SECRET, &ne, &[9; 16], "edge-1", &proof),
            "replayed on another link"
        );
        // A backend's proof reflected back is not an edge proof (labels differ).
        assert!(!verify_edge(SECRET, &ne, &nb, "b1", &welcome.proof));
    }

    #[test]
    fn worked_example_of_protocol_md() {
        // PROTOCOL.md §9.3: secret "0123456789abcdef", nonces 00..0f and 10..1f.
        let ne: LinkNonce = std::array::from_fn(|i| i as u8);
        let nb: LinkNonce = std::array::from_fn(|i| 0x10 + i as u8);
        let hex = |p: LinkProof| p.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let b = hex(backend_proof(b"0123456789abcdef", &ne, &nb, "b1"));
        let e = hex(edge_proof(b"0123456789abcdef", &ne, &nb, "edge-1"));
        let doc = include_str!("../../../PROTOCOL.md");
        assert!(doc.contains(&b), "PROTOCOL.md §9.3 shows proof_b {b}");
        assert!(doc.contains(&e), "PROTOCOL.md §9.3 shows proof_e {e}");
    }
}

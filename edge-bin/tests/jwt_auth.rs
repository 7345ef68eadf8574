//! JWT authentication (newcomer issue, item 6) over real sockets: an edge with
//! `auth.kind = "jwt"` verifies EdDSA and HS256 tokens from a JWKS file, checks issuer,
//! audience and expiry on its own clock, refuses a key confusion, and picks up a rotated
//! JWKS file without a restart.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use ring::signature::{Ed25519KeyPair, KeyPair};
use waygate_edge::config::AuthKind;
use waygate_transport::{CloseCode, Frame, TransportKind};

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

struct EdKey {
    pkcs8: Vec<u8>,
    x: String,
}

fn ed_key() -> EdKey {
    let rng = ring::rand::SystemRandom::new();
    let doc = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
    let pair = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
    EdKey {
        pkcs8: doc.as_ref().to_vec(),
        x: b64(pair.public_key().as_ref()),
    }
}

const HS_SECRET: &[u8] = b"a-shared-secret-of-the-login-service-32b";

fn jwks(ed: &[(&str, &EdKey)], with_hs: bool) -> String {
    let mut keys: Vec<serde_json::Value> = ed
        .iter()
        .map(|(kid, k)| {
            serde_json::json!({"kty": "OKP", "crv": "Ed25519", "x": k.x, "kid": kid, "alg": "EdDSA", "use": "sig"})
        })
        .collect();
    if with_hs {
        keys.push(
            serde_json::json!({"kty": "oct", "k": b64(HS_SECRET), "kid": "hs1", "alg": "HS256"}),
        );
    }
    serde_json::json!({ "keys": keys }).to_string()
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn claims(player: &str, aud: &str, exp: u64) -> serde_json::Value {
    serde_json::json!({"sub": player, "iss": "login.example", "aud": aud, "iat": now(), "exp": exp})
}

fn ed_token(kid: &str, key: &EdKey, claims: &serde_json::Value) -> Bytes {
    let mut header = Header::new(Algorithm::EdDSA);
    header.kid = Some(kid.into());
    let t = jsonwebtoken::encode(&header, claims, &EncodingKey::from_ed_der(&key.pkcs8)).unwrap();
    Bytes::from(t)
}

fn hs_token(kid: &str, claims: &serde_json::Value) -> Bytes {
    let mut header = Header::new(Algorithm::HS256);
    header.kid = Some(kid.into());
    let t = jsonwebtoken::encode(&header, claims, &EncodingKey::from_secret(HS_SECRET)).unwrap();
    Bytes::from(t)
}

fn reject_code(f: &Frame) -> Option<CloseCode> {
    match f {
        Frame::Reject(r) => Some(r.code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_verifies_jwts_from_a_jwks_file_and_follows_its_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let ed1 = ed_key();
    let jwks_path = dir.path().join("jwks.json");
    std::fs::write(&jwks_path, jwks(&[("ed1", &ed1)], true)).unwrap();
    let (edge, _backend, _routes) = common::demo_edge(|config| {
        config.auth.kind = AuthKind::Jwt;
        config.auth.jwt.jwks_file = Some(jwks_path.clone());
        config.auth.jwt.audiences = vec!["waygate".into()];
        config.auth.issuers = vec!["login.example".into()];
        config.auth.leeway_secs = 5;
    })
    .await;
    let tcp = edge.addrs[&TransportKind::Tcp];
    let registry = edge.registry();
    let later = now() + 600;

    // EdDSA and HS256 tokens from the JWKS: welcome, as the `sub` player.
    let f = common::raw_hello(
        tcp,
        ed_token("ed1", &ed1, &claims("jwt-alice", "waygate", later)),
    )
    .await;
    assert!(matches!(f, Frame::Welcome(_)), "{f:?}");
    assert!(registry.session_of("jwt-alice").is_some());
    let f = common::raw_hello(tcp, hs_token("hs1", &claims("jwt-bob", "waygate", later))).await;
    assert!(matches!(f, Frame::Welcome(_)), "{f:?}");
    // Checked: audience, issuer, expiry (on the edge's clock, with the leeway), signature,
    // and the key decides the algorithm (an HS256 token naming the EdDSA key is refused).
    let f = common::raw_hello(
        tcp,
        ed_token("ed1", &ed1, &claims("p", "someone-else", later)),
    )
    .await;
    assert_eq!(reject_code(&f), Some(CloseCode::AuthRejected), "{f:?}");
    let mut wrong_iss = claims("p", "waygate", later);
    wrong_iss["iss"] = "mallory".into();
    let f = common::raw_hello(tcp, ed_token("ed1", &ed1, &wrong_iss)).await;
    assert_eq!(reject_code(&f), Some(CloseCode::AuthRejected), "{f:?}");
    let f = common::raw_hello(
        tcp,
        ed_token("ed1", &ed1, &claims("p", "waygate", now() - 60)),
    )
    .await;
    assert_eq!(reject_code(&f), Some(CloseCode::AuthExpired), "{f:?}");
    let forged = ed_key();
    let f = common::raw_hello(
        tcp,
        ed_token("ed1", &forged, &claims("p", "waygate", later)),
    )
    .await;
    assert_eq!(reject_code(&f), Some(CloseCode::AuthBadSignature), "{f:?}");
    let f = common::raw_hello(tcp, hs_token("ed1", &claims("p", "waygate", later))).await;
    assert_eq!(reject_code(&f), Some(CloseCode::AuthBadSignature), "{f:?}");
    let f = common::raw_hello(tcp, Bytes::from_static(b"not a jwt")).await;
    assert_eq!(reject_code(&f), Some(CloseCode::AuthMalformed), "{f:?}");

    // Rotation: the file now holds ed2 only; no restart.
    let ed2 = ed_key();
    std::fs::write(&jwks_path, jwks(&[("ed2", &ed2)], false)).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let f = common::raw_hello(
            tcp,
            ed_token("ed2", &ed2, &claims("jwt-carol", "waygate", later)),
        )
        .await;
        if matches!(f, Frame::Welcome(_)) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "rotated key never accepted: {f:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let f = common::raw_hello(tcp, ed_token("ed1", &ed1, &claims("p", "waygate", later))).await;
    assert_eq!(
        reject_code(&f),
        Some(CloseCode::AuthUnknownKey),
        "retired key: {f:?}"
    );
}

/// Regression (2026-12-05, an audit of examples/edge.toml against the code): with no
/// `auth.jwt.audiences` configured the document says a token must carry no audience, but
/// the edge skipped the audience check, so a JWT minted for another service (naming it in
/// `aud`) logged a player in. Now it is refused `auth_rejected`; one without `aud` passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_configured_audiences_a_token_naming_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ed = ed_key();
    let jwks_path = dir.path().join("jwks.json");
    std::fs::write(&jwks_path, jwks(&[("ed1", &ed)], false)).unwrap();
    let (edge, _backend, _routes) = common::demo_edge(|config| {
        config.auth.kind = AuthKind::Jwt;
        config.auth.jwt.jwks_file = Some(jwks_path.clone());
        config.auth.issuers = vec!["login.example".into()];
    })
    .await;
    let tcp = edge.addrs[&TransportKind::Tcp];
    let later = now() + 600;
    let f = common::raw_hello(
        tcp,
        ed_token("ed1", &ed, &claims("aud-p", "another-service", later)),
    )
    .await;
    assert_eq!(reject_code(&f), Some(CloseCode::AuthRejected), "{f:?}");
    let mut no_aud = claims("aud-q", "", later);
    if let Some(m) = no_aud.as_object_mut() {
        m.remove("aud");
    }
    let f = common::raw_hello(tcp, ed_token("ed1", &ed, &no_aud)).await;
    assert!(matches!(f, Frame::Welcome(_)), "{f:?}");
}

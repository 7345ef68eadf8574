//! The authenticators an edge can be configured with (`[auth] kind`): the built-in HMAC
//! tokens (`waygate_session::HmacAuthenticator`) and JWTs as studios' login services issue
//! them ([`JwtAuthenticator`]: HS256, RS256, EdDSA and the other JWS algorithms of the
//! `jsonwebtoken` crate, keys from a JWKS file reloaded when it changes).
//!
//! What it must never do: accept a token whose algorithm does not match its key (the key's
//! `alg`, or its type's default, decides; the token header cannot choose), use the system
//! clock for expiry (the caller passes `now`, as for every authenticator), or block on I/O
//! longer than one small file read when the JWKS file changed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use waygate_session::auth::{AuthError, AuthedPlayer, Authenticator, TokenClaims};

/// Settings of a [`JwtAuthenticator`] (`[auth.jwt]`, with `auth.issuers` and
/// `auth.leeway_secs`).
#[derive(Debug, Clone)]
pub struct JwtSettings {
    /// The JWKS file (`{"keys": [...]}`); re-read when its modification time changes.
    pub jwks_file: PathBuf,
    /// Accepted `iss` values; empty = any.
    pub issuers: Vec<String>,
    /// Accepted `aud` values; empty = the token must carry none.
    pub audiences: Vec<String>,
    /// The claim that holds the player id (default `sub`).
    pub player_claim: String,
    /// Clock-skew leeway for `exp`, `nbf` and `iat`.
    pub leeway: Duration,
}

/// One verification key.
struct Key {
    algorithm: Algorithm,
    key: DecodingKey,
}

struct Keys {
    by_kid: HashMap<String, Key>,
    /// The key used for tokens without `kid`, when the set has exactly one.
    only: Option<String>,
    modified: Option<SystemTime>,
    checked: Instant,
}

/// Verifies JWTs against a JWKS file (see the module docs).
pub struct JwtAuthenticator {
    settings: JwtSettings,
    keys: Mutex<Keys>,
}

impl std::fmt::Debug for JwtAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtAuthenticator")
            .field("jwks_file", &self.settings.jwks_file)
            .finish_non_exhaustive()
    }
}

/// Why a JWKS file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JwksError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Not a JWKS document, or a key that cannot verify anything.
    #[error("invalid JWKS {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
}

/// How often the JWKS file's modification time is checked.
const RELOAD_CHECK: Duration = Duration::from_millis(500);

fn load(path: &PathBuf) -> Result<(HashMap<String, Key>, Option<SystemTime>), JwksError> {
    let invalid = |message: String| JwksError::Invalid {
        path: path.clone(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|source| JwksError::Read {
        path: path.clone(),
        source,
    })?;
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let set: JwkSet = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    let mut keys = HashMap::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        let kid = jwk.common.key_id.clone().unwrap_or_else(|| format!("#{i}"));
        let algorithm = match &jwk.common.key_algorithm {
            Some(a) => Algorithm::from_str(&a.to_string())
                .map_err(|_| invalid(format!("key {kid}: algorithm {a} cannot sign JWTs")))?,
            None => match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => Algorithm::RS256,
                AlgorithmParameters::OctetKeyPair(_) => Algorithm::EdDSA,
                AlgorithmParameters::OctetKey(_) => Algorithm::HS256,
                AlgorithmParameters::EllipticCurve(_) => Algorithm::ES256,
            },
        };
        let key = DecodingKey::from_jwk(jwk).map_err(|e| invalid(format!("key {kid}: {e}")))?;
        keys.insert(kid, Key { algorithm, key });
    }
    if keys.is_empty() {
        return Err(invalid("no keys".into()));
    }
    Ok((keys, modified))
}

impl JwtAuthenticator {
    /// Loads the JWKS file once (start-up fails on a bad file; later reloads keep the last
    /// good keys when the file is broken).
    pub fn new(settings: JwtSettings) -> Result<Self, JwksError> {
        let (by_kid, modified) = load(&settings.jwks_file)?;
        let only = (by_kid.len() == 1)
            .then(|| by_kid.keys().next().cloned())
            .flatten();
        Ok(Self {
            keys: Mutex::new(Keys {
                by_kid,
                only,
                modified,
                checked: Instant::now(),
            }),
            settings,
        })
    }

    /// Re-reads the JWKS file if its modification time changed (checked at most every
    /// 500 ms); a broken file keeps the keys in force and is logged.
    fn refresh(&self, keys: &mut Keys) {
        if keys.checked.elapsed() < RELOAD_CHECK {
            return;
        }
        keys.checked = Instant::now();
        let modified = std::fs::metadata(&self.settings.jwks_file)
            .and_then(|m| m.modified())
            .ok();
        if modified == keys.modified {
            return;
        }
        match load(&self.settings.jwks_file) {
            Ok((by_kid, modified)) => {
                tracing::info!(keys = by_kid.len(), "JWKS reloaded");
                keys.only = (by_kid.len() == 1)
                    .then(|| by_kid.keys().next().cloned())
                    .flatten();
                keys.by_kid = by_kid;
                keys.modified = modified;
            }
            Err(e) => tracing::warn!(error = %e, "JWKS not reloaded; the keys in force stay"),
        }
    }
}

fn claim_u64(claims: &serde_json::Map<String, serde_json::Value>, name: &str) -> Option<u64> {
    claims.get(name).and_then(|v| v.as_u64())
}

#[async_trait]
impl Authenticator for JwtAuthenticator {
    async fn authenticate(&self, token: &[u8], now_unix: u64) -> Result<AuthedPlayer, AuthError> {
        let token =
            std::str::from_utf8(token).map_err(|_| AuthError::Malformed("JWT not UTF-8"))?;
        let header =
            jsonwebtoken::decode_header(token).map_err(|_| AuthError::Malformed("JWT header"))?;
        let (algorithm, key) = {
            let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
            self.refresh(&mut keys);
            let kid = header.kid.clone().or_else(|| keys.only.clone());
            let Some(k) = kid.as_ref().and_then(|kid| keys.by_kid.get(kid)) else {
                return Err(AuthError::UnknownKey(0));
            };
            (k.algorithm, k.key.clone())
        };
        if header.alg != algorithm {
            return Err(AuthError::BadSignature);
        }
        // Signature, issuer and audience here; times below, on the caller's clock.
        let mut validation = Validation::new(algorithm);
        validation.required_spec_claims.clear();
        validation.validate_exp = false;
        validation.validate_nbf = false;
        if self.settings.issuers.is_empty() {
            validation.iss = None;
        } else {
            validation.set_issuer(&self.settings.issuers);
        }
        // No audiences configured: a token must carry none (one minted for another
        // service names it; the JWT library refuses an `aud` when none is expected).
        if !self.settings.audiences.is_empty() {
            validation.set_audience(&self.settings.audiences);
        }
        let data = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
            token,
            &key,
            &validation,
        )
        .map_err(|e| {
            use jsonwebtoken::errors::ErrorKind;
            match e.kind() {
                ErrorKind::InvalidSignature | ErrorKind::InvalidAlgorithm => {
                    AuthError::BadSignature
                }
                ErrorKind::InvalidIssuer => AuthError::Rejected("issuer not accepted".into()),
                ErrorKind::InvalidAudience => AuthError::Rejected("audience not accepted".into()),
                _ => AuthError::Malformed("JWT"),
            }
        })?;
        let claims = data.claims;
        if !self.settings.issuers.is_empty() && !claims.contains_key("iss") {
            return Err(AuthError::Rejected("issuer missing".into()));
        }
        if !self.settings.audiences.is_empty() && !claims.contains_key("aud") {
            return Err(AuthError::Rejected("audience missing".into()));
        }
        let leeway = self.settings.leeway.as_secs();
        let expires_at =
            claim_u64(&claims, "exp").ok_or(AuthError::Malformed("JWT without exp"))?;
        if now_unix > expires_at.saturating_add(leeway) {
            return Err(AuthError::Expired {
                expires_at,
                now: now_unix,
            });
        }
        let issued_at = claim_u64(&claims, "iat").unwrap_or(0);
        let not_before = claim_u64(&claims, "nbf")
            .unwrap_or(issued_at)
            .max(issued_at);
        if not_before > now_unix.saturating_add(leeway) {
            return Err(AuthError::NotYetValid {
                issued_at: not_before,
                now: now_unix,
            });
        }
        let player_id = claims
            .get(&self.settings.player_claim)
            .and_then(|v| v.as_str())
            .filter(|p| !p.is_empty() && p.len() <= 128)
            .ok_or(AuthError::Malformed("JWT without a player id claim"))?
            .to_owned();
        let issuer = claims
            .get("iss")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_owned();
        Ok(AuthedPlayer {
            claims: TokenClaims {
                player_id,
                issuer,
                issued_at,
                expires_at,
                extensions: Vec::new(),
            },
            key_id: 0,
            session_key: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header};

    /// Secure-by-default audit: a keys file skipped the development-key check that
    /// `auth.keys` has, so an edge beyond loopback could start (or reload) with it.
    #[test]
    fn a_keys_file_with_the_development_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.toml");
        let own = "[[keys]]\nid = 5\nsecret = \"a key of our own, thirty-two byte\"\n";
        std::fs::write(&path, own).unwrap();
        assert!(keys_file_keys(&path).is_ok());
        let dev = format!(
            "{own}[[keys]]\nid = 1\nsecret = \"{}\"\n",
            crate::config::DEV_KEY_SECRET
        );
        std::fs::write(&path, dev).unwrap();
        let refused = keys_file_keys(&path).unwrap_err();
        assert!(refused.contains("development key"), "{refused}");
    }

    fn authenticator(dir: &std::path::Path) -> JwtAuthenticator {
        let jwks = dir.join("jwks.json");
        // "c2VjcmV0" = base64url("secret")
        std::fs::write(
            &jwks,
            r#"{"keys":[{"kty":"oct","k":"c2VjcmV0","kid":"h","alg":"HS256"}]}"#,
        )
        .unwrap();
        JwtAuthenticator::new(JwtSettings {
            jwks_file: jwks,
            issuers: Vec::new(),
            audiences: Vec::new(),
            player_claim: "player".into(),
            leeway: Duration::from_secs(5),
        })
        .unwrap()
    }

    fn token(claims: serde_json::Value) -> Vec<u8> {
        let header = Header::new(Algorithm::HS256); // no kid: the only key
        jsonwebtoken::encode(&header, &claims, &EncodingKey::from_secret(b"secret"))
            .unwrap()
            .into_bytes()
    }

    /// Times are checked on the caller's clock with the leeway, never the system clock.
    #[tokio::test]
    async fn expiry_and_not_before_use_the_callers_clock_and_the_leeway() {
        let dir = tempfile::tempdir().unwrap();
        let a = authenticator(dir.path());
        let t = token(serde_json::json!({"player": "p1", "iat": 1000, "exp": 2000}));
        let ok = a.authenticate(&t, 2005).await.unwrap();
        assert_eq!(ok.claims.player_id, "p1");
        assert_eq!((ok.claims.issued_at, ok.claims.expires_at), (1000, 2000));
        assert!(matches!(
            a.authenticate(&t, 2006).await,
            Err(AuthError::Expired {
                expires_at: 2000,
                now: 2006
            })
        ));
        assert!(matches!(
            a.authenticate(&t, 994).await,
            Err(AuthError::NotYetValid { .. })
        ));
        let no_player = token(serde_json::json!({"sub": "p1", "exp": 2000}));
        assert!(matches!(
            a.authenticate(&no_player, 1500).await,
            Err(AuthError::Malformed(_))
        ));
        let no_exp = token(serde_json::json!({"player": "p1"}));
        assert!(matches!(
            a.authenticate(&no_exp, 1500).await,
            Err(AuthError::Malformed(_))
        ));
    }
}

/// The edge's waygate-token authenticator (`auth.kind = "hmac"`): HMAC keys from
/// `auth.keys`, or from `auth.keys_file`, re-read when the file changes so keys rotate
/// without a restart ([`EdgeHmacAuth::reload_if_changed`], called every second by the edge;
/// a broken file keeps the keys in force). It also opens the connect tokens KCP CONNECTs
/// carry (PROTOCOL.md §7.2.2, §8.9) with the same keys.
#[derive(Debug)]
pub struct EdgeHmacAuth {
    inner: std::sync::RwLock<waygate_session::HmacAuthenticator>,
    keys_file: Option<PathBuf>,
    modified: Mutex<Option<SystemTime>>,
}

/// The keys file: `[[keys]]` tables like `[[auth.keys]]`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    keys: Vec<crate::config::AuthKey>,
}

fn key_ring(keys: &[crate::config::AuthKey]) -> waygate_session::auth::KeyRing {
    let mut ring = waygate_session::auth::KeyRing::new();
    for k in keys {
        ring.insert(k.id, k.secret.as_bytes());
    }
    ring
}

/// The keys of a keys file (`[[keys]]` tables), with its modification time.
fn keys_file_keys(
    path: &std::path::Path,
) -> Result<(Vec<crate::config::AuthKey>, Option<SystemTime>), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let file: KeysFile = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if file.keys.is_empty() {
        return Err(format!("{}: no keys", path.display()));
    }
    // A keys file is what an edge beyond loopback uses: the public development key has no
    // place in it (anyone can mint a token for any player with it). Refused at start, and
    // on a reload the keys in force stay.
    if file
        .keys
        .iter()
        .any(|k| k.secret == crate::config::DEV_KEY_SECRET)
    {
        return Err(format!(
            "{}: holds the public development key (anyone can mint tokens with it): put keys \
             of your own there (`waygate keygen`)",
            path.display()
        ));
    }
    Ok((file.keys, modified))
}

fn read_keys_file(
    path: &std::path::Path,
) -> Result<(waygate_session::auth::KeyRing, Option<SystemTime>), String> {
    let (keys, modified) = keys_file_keys(path)?;
    Ok((key_ring(&keys), modified))
}

/// The HMAC keys an edge with these settings accepts now: `auth.keys_file`'s when set,
/// else `auth.keys` (what `waygate token` signs with: the first).
pub fn configured_keys(
    auth: &crate::config::AuthConfig,
) -> Result<Vec<crate::config::AuthKey>, String> {
    match &auth.keys_file {
        Some(path) => Ok(keys_file_keys(path)?.0),
        None => Ok(auth.keys.clone()),
    }
}

impl EdgeHmacAuth {
    /// From the `[auth]` settings (`None` unless `kind = "hmac"`); a keys file that cannot be
    /// read or parsed is a start-up error.
    pub fn from_config(
        auth: &crate::config::AuthConfig,
    ) -> Result<Option<std::sync::Arc<Self>>, String> {
        if auth.kind != crate::config::AuthKind::Hmac {
            return Ok(None);
        }
        let (ring, modified) = match &auth.keys_file {
            Some(path) => read_keys_file(path)?,
            None => (key_ring(&auth.keys), None),
        };
        let mut hmac = waygate_session::HmacAuthenticator::new(ring)
            .with_leeway(Duration::from_secs(auth.leeway_secs));
        if !auth.issuers.is_empty() {
            hmac = hmac.with_allowed_issuers(auth.issuers.clone());
        }
        if !auth.audiences.is_empty() {
            hmac = hmac.with_allowed_audiences(auth.audiences.clone());
        }
        Ok(Some(std::sync::Arc::new(Self {
            inner: std::sync::RwLock::new(hmac),
            keys_file: auth.keys_file.clone(),
            modified: Mutex::new(modified),
        })))
    }

    /// Verifies a token with the keys in force.
    pub fn verify(&self, token: &[u8], now_unix: u64) -> Result<AuthedPlayer, AuthError> {
        self.inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .verify(token, now_unix)
    }

    /// Re-reads the keys file if its modification time changed; whether keys were
    /// replaced. A broken file keeps the keys in force (logged).
    pub fn reload_if_changed(&self) -> bool {
        let Some(path) = &self.keys_file else {
            return false;
        };
        let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
        let mut last = self.modified.lock().unwrap_or_else(|e| e.into_inner());
        if modified == *last {
            return false;
        }
        match read_keys_file(path) {
            Ok((ring, modified)) => {
                *self
                    .inner
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .keys_mut() = ring;
                *last = modified;
                tracing::info!(file = %path.display(), "auth keys reloaded");
                true
            }
            Err(e) => {
                *last = modified;
                tracing::warn!(error = %e, "auth keys not reloaded; the keys in force stay");
                false
            }
        }
    }
}

#[async_trait]
impl Authenticator for EdgeHmacAuth {
    async fn authenticate(&self, token: &[u8], now_unix: u64) -> Result<AuthedPlayer, AuthError> {
        self.verify(token, now_unix)
    }
}

impl waygate_transport::kcp::seal::ConnectKeys for EdgeHmacAuth {
    fn session_key(
        &self,
        token: &[u8],
    ) -> Result<waygate_transport::kcp::seal::SessionKey, waygate_transport::CloseCode> {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let player = self.verify(token, now).map_err(|e| e.close_code())?;
        // A version-1 token seals nothing.
        player
            .session_key
            .ok_or(waygate_transport::CloseCode::AuthUnsupportedVersion)
    }
}

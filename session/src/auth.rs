//! Player authentication (SPEC S2, S2a): the waygate auth token format, minting, verification
//! with a key ring, and the pluggable [`Authenticator`] trait.
//!
//! # Token format, version 1 (byte-exact; PROTOCOL.md §7.2)
//!
//! All integers big-endian. The token is opaque bytes inside HELLO; a login service hands it
//! to the client over HTTPS, usually as unpadded base64url ([`token_to_base64url`]).
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | format version: `0x01` (`0x02` is reserved for the sealed connect token, S2a) |
//! | 1 | 4 | key id (`u32`): which HMAC key signed it (rotation) |
//! | 5 | 8 | issued-at, unix seconds (`u64`) |
//! | 13 | 8 | expires-at, unix seconds (`u64`), must be >= issued-at |
//! | 21 | 1 | player id length P, 1..=128 |
//! | 22 | P | player id, UTF-8 |
//! | 22+P | 1 | issuer length I, 0..=128 |
//! | 23+P | I | issuer, UTF-8 |
//! | 23+P+I | 2 | extensions length E (`u16`) |
//! | 25+P+I | E | extensions: TLV records `type u8, len u16, value[len]`; unknown types skipped |
//! | 25+P+I+E | 32 | HMAC-SHA256(key, every byte before the tag) |
//!
//! Nothing may follow the tag. Verification order (so each failure has one code): version ->
//! structure -> key id -> tag (constant time) -> time window with the configured leeway.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use bytes::{BufMut, Bytes, BytesMut};
use ring::{aead, hmac};
use waygate_transport::CloseCode;

/// Format version of the HMAC token this build mints and accepts.
pub const TOKEN_VERSION_HMAC: u8 = 0x01;
/// Connect token (PROTOCOL.md §7.2.2): the public part of version 1, then a per-login
/// session key sealed for the edges (ChaCha20-Poly1305 under a key derived from the key id's
/// key), which also authenticates the public part. The login service hands the session key
/// to the client beside the token; KCP seals every packet with it (§8.9).
pub const TOKEN_VERSION_CONNECT: u8 = 0x02;
/// Length of a connect token's nonce.
pub const CONNECT_NONCE_LEN: usize = 12;
/// Length of the per-login session key a connect token carries.
pub const SESSION_KEY_LEN: usize = 32;
/// Length of a connect token's sealed part after the public fields: nonce, sealed session
/// key, AEAD tag.
const CONNECT_SUFFIX_LEN: usize = CONNECT_NONCE_LEN + SESSION_KEY_LEN + 16;
/// The label the connect token's AEAD key is derived with: HMAC-SHA256(key, label).
const CONNECT_KEY_LABEL: &[u8] = b"waygate connect token v2";
/// Length of the HMAC-SHA256 tag.
pub const TAG_LEN: usize = 32;
/// Longest player id or issuer.
pub const MAX_NAME_LEN: usize = 128;
/// Fixed header: version, key id, issued-at, expires-at.
const FIXED_LEN: usize = 1 + 4 + 8 + 8;

/// Extension type reserved for the S2a session-key hint (not interpreted yet).
pub const EXT_RESERVED_SESSION_KEY: u8 = 0x01;

/// Why a token was refused. Each variant maps to one [`CloseCode`] (see [`AuthError::close_code`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The token does not parse (peer's fault).
    #[error("malformed auth token: {0}")]
    Malformed(&'static str),
    /// The format version byte is not one this edge accepts.
    #[error("unsupported auth token version {0}")]
    UnsupportedVersion(u8),
    /// The key id is not in the key ring.
    #[error("unknown auth key id {0}")]
    UnknownKey(u32),
    /// The HMAC tag does not verify.
    #[error("auth token signature does not verify")]
    BadSignature,
    /// `now > expires_at + leeway`.
    #[error("auth token expired at {expires_at} (now {now})")]
    Expired {
        /// Token expiry (unix seconds).
        expires_at: u64,
        /// The verifier's clock (unix seconds).
        now: u64,
    },
    /// `issued_at > now + leeway`: minted in the future (clock skew beyond the leeway).
    #[error("auth token not valid before {issued_at} (now {now})")]
    NotYetValid {
        /// Token issue time (unix seconds).
        issued_at: u64,
        /// The verifier's clock (unix seconds).
        now: u64,
    },
    /// A custom authenticator (or an issuer allow-list) refused the player.
    #[error("auth rejected: {0}")]
    Rejected(String),
}

impl AuthError {
    /// The REJECT code sent to the client.
    pub fn close_code(&self) -> CloseCode {
        match self {
            Self::Malformed(_) => CloseCode::AuthMalformed,
            Self::UnsupportedVersion(_) => CloseCode::AuthUnsupportedVersion,
            Self::UnknownKey(_) => CloseCode::AuthUnknownKey,
            Self::BadSignature => CloseCode::AuthBadSignature,
            Self::Expired { .. } | Self::NotYetValid { .. } => CloseCode::AuthExpired,
            Self::Rejected(_) => CloseCode::AuthRejected,
        }
    }
}

/// The claims of a token, as minted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenClaims {
    /// Stable player id (1..=128 bytes of UTF-8).
    pub player_id: String,
    /// Who minted it (0..=128 bytes of UTF-8).
    pub issuer: String,
    /// Unix seconds.
    pub issued_at: u64,
    /// Unix seconds.
    pub expires_at: u64,
    /// Extension records `(type, value)`, in order.
    pub extensions: Vec<(u8, Bytes)>,
}

/// A player whose token verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthedPlayer {
    /// The verified claims.
    pub claims: TokenClaims,
    /// The key id that signed the token.
    pub key_id: u32,
    /// A connect token's session key (`None` for version 1 and other token kinds).
    pub session_key: Option<[u8; SESSION_KEY_LEN]>,
}

impl AuthedPlayer {
    /// The player id.
    pub fn player_id(&self) -> &str {
        &self.claims.player_id
    }
}

/// Why a token could not be minted (local misuse).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MintError {
    /// Player id empty or longer than [`MAX_NAME_LEN`].
    #[error("player id must be 1..=128 bytes")]
    PlayerId,
    /// Issuer longer than [`MAX_NAME_LEN`].
    #[error("issuer must be at most 128 bytes")]
    Issuer,
    /// `expires_at < issued_at`.
    #[error("expiry before issue time")]
    Window,
    /// Extensions longer than 65,535 bytes in total, or one value over 65,535 bytes.
    #[error("extensions too long")]
    Extensions,
}

/// Mints a version-1 token signed with `key` under `key_id`. For tests, tools
/// (`waygate token`) and login services written in Rust.
pub fn mint_token(key_id: u32, key: &[u8], claims: &TokenClaims) -> Result<Bytes, MintError> {
    let mut out = public_part(TOKEN_VERSION_HMAC, key_id, claims)?;
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), &out);
    out.put_slice(tag.as_ref());
    Ok(out.freeze())
}

/// Mints a connect token (version 2, PROTOCOL.md §7.2.2) carrying `session_key`, sealed
/// under `key`'s derived AEAD key with `nonce` (12 random bytes, never reused with a key).
/// The login service returns `session_key` to the client beside the token.
pub fn mint_connect_token(
    key_id: u32,
    key: &[u8],
    claims: &TokenClaims,
    session_key: &[u8; SESSION_KEY_LEN],
    nonce: [u8; CONNECT_NONCE_LEN],
) -> Result<Bytes, MintError> {
    let mut out = public_part(TOKEN_VERSION_CONNECT, key_id, claims)?;
    out.put_slice(&nonce);
    let aead = connect_aead_key(&hmac::Key::new(hmac::HMAC_SHA256, key));
    let mut sealed = session_key.to_vec();
    let tag = aead
        .seal_in_place_separate_tag(
            aead::Nonce::assume_unique_for_key(nonce),
            aead::Aad::from(&out[..]),
            &mut sealed,
        )
        .map_err(|_| MintError::Extensions)?;
    out.put_slice(&sealed);
    out.put_slice(tag.as_ref());
    Ok(out.freeze())
}

/// The connect token AEAD key of an HMAC key: HMAC-SHA256(key, label) as a
/// ChaCha20-Poly1305 key.
fn connect_aead_key(key: &hmac::Key) -> aead::LessSafeKey {
    let derived = hmac::sign(key, CONNECT_KEY_LABEL);
    let unbound = aead::UnboundKey::new(&aead::CHACHA20_POLY1305, derived.as_ref())
        .unwrap_or_else(|_| unreachable!("HMAC-SHA256 output is a 32-byte key"));
    aead::LessSafeKey::new(unbound)
}

/// Version byte, key id, times, player, issuer and extensions: what both token versions
/// start with.
fn public_part(version: u8, key_id: u32, claims: &TokenClaims) -> Result<BytesMut, MintError> {
    if claims.player_id.is_empty() || claims.player_id.len() > MAX_NAME_LEN {
        return Err(MintError::PlayerId);
    }
    if claims.issuer.len() > MAX_NAME_LEN {
        return Err(MintError::Issuer);
    }
    if claims.expires_at < claims.issued_at {
        return Err(MintError::Window);
    }
    let mut ext = BytesMut::new();
    for (ty, value) in &claims.extensions {
        let len = u16::try_from(value.len()).map_err(|_| MintError::Extensions)?;
        ext.put_u8(*ty);
        ext.put_u16(len);
        ext.put_slice(value);
    }
    let ext_len = u16::try_from(ext.len()).map_err(|_| MintError::Extensions)?;
    let mut out = BytesMut::with_capacity(FIXED_LEN + 4 + claims.player_id.len() + ext.len() + 64);
    out.put_u8(version);
    out.put_u32(key_id);
    out.put_u64(claims.issued_at);
    out.put_u64(claims.expires_at);
    out.put_u8(claims.player_id.len() as u8);
    out.put_slice(claims.player_id.as_bytes());
    out.put_u8(claims.issuer.len() as u8);
    out.put_slice(claims.issuer.as_bytes());
    out.put_u16(ext_len);
    out.put_slice(&ext);
    Ok(out)
}

/// Unpadded base64url text of a token (how login services hand tokens to clients).
pub fn token_to_base64url(token: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(token)
}

/// Parses unpadded base64url text back into token bytes.
pub fn token_from_base64url(text: &str) -> Result<Bytes, AuthError> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(text.trim())
        .map(Bytes::from)
        .map_err(|_| AuthError::Malformed("not base64url"))
}

/// A parsed but not yet verified token.
struct Parsed<'a> {
    version: u8,
    key_id: u32,
    claims: TokenClaims,
    /// Version 1: what the HMAC covers. Version 2: the public part and the nonce (the AAD).
    signed: &'a [u8],
    /// Version 1: the HMAC. Version 2: the sealed session key and its tag.
    tag: &'a [u8],
}

/// A cursor that never panics.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], AuthError> {
        if self.buf.len() < n {
            return Err(AuthError::Malformed(what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, AuthError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, AuthError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, AuthError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_be_bytes(a))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, AuthError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_be_bytes(a))
    }
    fn name(&mut self, what: &'static str, min: usize) -> Result<String, AuthError> {
        let len = usize::from(self.u8(what)?);
        if len < min || len > MAX_NAME_LEN {
            return Err(AuthError::Malformed(what));
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| AuthError::Malformed(what))
    }
}

fn parse(token: &[u8]) -> Result<Parsed<'_>, AuthError> {
    let version = *token.first().ok_or(AuthError::Malformed("empty token"))?;
    let suffix = match version {
        TOKEN_VERSION_HMAC => TAG_LEN,
        TOKEN_VERSION_CONNECT => CONNECT_SUFFIX_LEN,
        other => return Err(AuthError::UnsupportedVersion(other)),
    };
    if token.len() < FIXED_LEN + 4 + suffix {
        return Err(AuthError::Malformed("token too short"));
    }
    let (public, tail) = token.split_at(token.len() - suffix);
    // Version 2: the nonce belongs to the authenticated data, the rest is sealed.
    let (signed, tag) = if version == TOKEN_VERSION_CONNECT {
        token.split_at(public.len() + CONNECT_NONCE_LEN)
    } else {
        (public, tail)
    };
    let mut c = Cursor { buf: &public[1..] };
    let key_id = c.u32("key id")?;
    let issued_at = c.u64("issued_at")?;
    let expires_at = c.u64("expires_at")?;
    let player_id = c.name("player id", 1)?;
    let issuer = c.name("issuer", 0)?;
    let ext_len = usize::from(c.u16("extensions length")?);
    let mut ext = Cursor {
        buf: c.take(ext_len, "extensions")?,
    };
    if !c.buf.is_empty() {
        return Err(AuthError::Malformed("bytes after extensions"));
    }
    let mut extensions = Vec::new();
    while !ext.buf.is_empty() {
        let ty = ext.u8("extension type")?;
        let len = usize::from(ext.u16("extension length")?);
        let value = ext.take(len, "extension value")?;
        extensions.push((ty, Bytes::copy_from_slice(value)));
    }
    if expires_at < issued_at {
        return Err(AuthError::Malformed("expires before issued"));
    }
    Ok(Parsed {
        version,
        key_id,
        claims: TokenClaims {
            player_id,
            issuer,
            issued_at,
            expires_at,
            extensions,
        },
        signed,
        tag,
    })
}

/// Verifies a token against one key ring at `now_unix` with `leeway` (pure function; what
/// [`HmacAuthenticator`] runs).
pub fn verify_token(
    keys: &KeyRing,
    token: &[u8],
    now_unix: u64,
    leeway: Duration,
) -> Result<AuthedPlayer, AuthError> {
    let parsed = parse(token)?;
    let key = keys
        .keys
        .get(&parsed.key_id)
        .ok_or(AuthError::UnknownKey(parsed.key_id))?;
    let session_key = if parsed.version == TOKEN_VERSION_CONNECT {
        let nonce_at = parsed.signed.len() - CONNECT_NONCE_LEN;
        let mut nonce = [0u8; CONNECT_NONCE_LEN];
        nonce.copy_from_slice(&parsed.signed[nonce_at..]);
        let mut sealed = parsed.tag.to_vec();
        let opened = connect_aead_key(key)
            .open_in_place(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(parsed.signed),
                &mut sealed,
            )
            .map_err(|_| AuthError::BadSignature)?;
        let mut session_key = [0u8; SESSION_KEY_LEN];
        session_key.copy_from_slice(opened);
        Some(session_key)
    } else {
        hmac::verify(key, parsed.signed, parsed.tag).map_err(|_| AuthError::BadSignature)?;
        None
    };
    let leeway = leeway.as_secs();
    let claims = parsed.claims;
    if now_unix > claims.expires_at.saturating_add(leeway) {
        return Err(AuthError::Expired {
            expires_at: claims.expires_at,
            now: now_unix,
        });
    }
    if claims.issued_at > now_unix.saturating_add(leeway) {
        return Err(AuthError::NotYetValid {
            issued_at: claims.issued_at,
            now: now_unix,
        });
    }
    Ok(AuthedPlayer {
        claims,
        key_id: parsed.key_id,
        session_key,
    })
}

/// HMAC keys by key id. Rotation: add the new key, have the login service mint with it,
/// remove the old key once its tokens have expired.
#[derive(Clone, Default)]
pub struct KeyRing {
    keys: HashMap<u32, hmac::Key>,
}

impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids: Vec<_> = self.keys.keys().collect();
        ids.sort();
        f.debug_struct("KeyRing").field("key_ids", &ids).finish()
    }
}

impl KeyRing {
    /// An empty ring.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the key for `key_id`. Keys should be at least 32 random bytes.
    pub fn insert(&mut self, key_id: u32, key: &[u8]) -> &mut Self {
        self.keys
            .insert(key_id, hmac::Key::new(hmac::HMAC_SHA256, key));
        self
    }

    /// Removes the key for `key_id`.
    pub fn remove(&mut self, key_id: u32) -> bool {
        self.keys.remove(&key_id).is_some()
    }

    /// Whether `key_id` is known.
    pub fn contains(&self, key_id: u32) -> bool {
        self.keys.contains_key(&key_id)
    }
}

/// Verifies the player's token. Async because a game may call out (its own login service,
/// a ban list); the session machine asks for it with `Action::Authenticate` and the driver
/// feeds the result back.
#[async_trait]
pub trait Authenticator: Send + Sync + 'static {
    /// Verifies `token` at `now_unix` (unix seconds, passed in so tests are deterministic).
    async fn authenticate(&self, token: &[u8], now_unix: u64) -> Result<AuthedPlayer, AuthError>;

    /// Whether `player` may still have a session: asked when a session resumes without an
    /// auth token (PROTOCOL.md §7.1.1), so a ban or a revocation also stops resumes.
    /// Default: yes.
    async fn still_allowed(&self, _player: &str, _now_unix: u64) -> Result<(), AuthError> {
        Ok(())
    }
}

/// Players refused from now on (bans, revoked logins), shared between the authenticator
/// that enforces them ([`AuthPolicy`]) and whoever manages them (the edge's admin API).
/// Holds the players refused at the last `revoke` and those revoked since: each `revoke`
/// forgets the entries whose end time has passed.
#[derive(Debug, Clone, Default)]
pub struct Revocations(Arc<std::sync::RwLock<HashMap<String, u64>>>);

impl Revocations {
    /// Refuses `player` until `until_unix` (unix seconds; `None`: until lifted), and
    /// forgets the revocations that ran out by `now_unix`.
    pub fn revoke(&self, player: &str, until_unix: Option<u64>, now_unix: u64) {
        if let Ok(mut m) = self.0.write() {
            m.retain(|_, until| now_unix < *until);
            m.insert(player.to_owned(), until_unix.unwrap_or(u64::MAX));
        }
    }

    /// Revocations held (some may have run out since the last `revoke`).
    pub fn len(&self) -> usize {
        self.0.read().map(|m| m.len()).unwrap_or(0)
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lifts a revocation; whether there was one.
    pub fn lift(&self, player: &str) -> bool {
        self.0
            .write()
            .map(|mut m| m.remove(player).is_some())
            .unwrap_or(false)
    }

    /// Whether `player` is refused at `now_unix`.
    pub fn is_revoked(&self, player: &str, now_unix: u64) -> bool {
        self.0
            .read()
            .map(|m| m.get(player).is_some_and(|&until| now_unix < until))
            .unwrap_or(false)
    }

    /// `Err(AuthError::Rejected)` for a player refused at `now_unix`.
    pub fn check(&self, player: &str, now_unix: u64) -> Result<(), AuthError> {
        if self.is_revoked(player, now_unix) {
            return Err(AuthError::Rejected(format!("player {player:?} is revoked")));
        }
        Ok(())
    }
}

/// Any authenticator, plus the edge's policy: [`Revocations`] (a revoked player's token is
/// refused `auth_rejected`, and so is its resume without a token) and a maximum token
/// lifetime (a token valid for longer than that from its issue time, or from now when it
/// has none, is refused `auth_rejected`).
#[derive(Debug)]
pub struct AuthPolicy<A> {
    inner: A,
    revocations: Revocations,
    max_lifetime: Option<Duration>,
}

impl<A: Authenticator> AuthPolicy<A> {
    /// `inner`, refusing the players in `revocations`; no lifetime limit.
    pub fn new(inner: A, revocations: Revocations) -> Self {
        Self {
            inner,
            revocations,
            max_lifetime: None,
        }
    }

    /// Refuses tokens valid for longer than `max` (`None`: no limit).
    pub fn with_max_lifetime(mut self, max: Option<Duration>) -> Self {
        self.max_lifetime = max;
        self
    }

    /// The policy on a verified token at `now_unix`.
    pub fn check(&self, player: &AuthedPlayer, now_unix: u64) -> Result<(), AuthError> {
        if let Some(max) = self.max_lifetime {
            let c = &player.claims;
            let from = if c.issued_at > 0 {
                c.issued_at
            } else {
                now_unix
            };
            let lifetime = c.expires_at.saturating_sub(from);
            if lifetime > max.as_secs() {
                return Err(AuthError::Rejected(format!(
                    "token valid for {lifetime} s, over the {} s maximum",
                    max.as_secs()
                )));
            }
        }
        self.revocations.check(player.player_id(), now_unix)
    }
}

#[async_trait]
impl<A: Authenticator> Authenticator for AuthPolicy<A> {
    async fn authenticate(&self, token: &[u8], now_unix: u64) -> Result<AuthedPlayer, AuthError> {
        let player = self.inner.authenticate(token, now_unix).await?;
        self.check(&player, now_unix)?;
        Ok(player)
    }

    async fn still_allowed(&self, player: &str, now_unix: u64) -> Result<(), AuthError> {
        self.revocations.check(player, now_unix)?;
        self.inner.still_allowed(player, now_unix).await
    }
}

#[async_trait]
impl Authenticator for std::sync::Arc<dyn Authenticator> {
    async fn authenticate(&self, token: &[u8], now_unix: u64) -> Result<AuthedPlayer, AuthError> {
        (**self).authenticate(token, now_unix).await
    }

    async fn still_allowed(&self, player: &str, now_unix: u64) -> Result<(), AuthError> {
        (**self).still_allowed(player, now_unix).await
    }
}

/// The default authenticator: waygate tokens signed with HMAC-SHA256 under a key ring.
#[derive(Debug, Clone)]
pub struct HmacAuthenticator {
    keys: KeyRing,
    leeway: Duration,
    issuers: Option<Vec<String>>,
    audiences: Option<Vec<String>>,
}

/// Extension type of a token's audience (UTF-8; PROTOCOL.md §7.2.1).
pub const EXT_AUDIENCE: u8 = 0x02;

/// Default clock-skew leeway applied to both ends of a token's validity window.
pub const DEFAULT_LEEWAY: Duration = Duration::from_secs(30);

impl HmacAuthenticator {
    /// An authenticator over `keys` with [`DEFAULT_LEEWAY`] and any issuer.
    pub fn new(keys: KeyRing) -> Self {
        Self {
            keys,
            leeway: DEFAULT_LEEWAY,
            issuers: None,
            audiences: None,
        }
    }

    /// Sets the clock-skew leeway (whole seconds count).
    pub fn with_leeway(mut self, leeway: Duration) -> Self {
        self.leeway = leeway;
        self
    }

    /// Accepts only tokens whose issuer is in `issuers` (others: [`AuthError::Rejected`]).
    pub fn with_allowed_issuers(mut self, issuers: Vec<String>) -> Self {
        self.issuers = Some(issuers);
        self
    }

    /// Accepts only tokens with an audience extension ([`EXT_AUDIENCE`]) in `audiences`
    /// (others, and tokens without one: [`AuthError::Rejected`]).
    pub fn with_allowed_audiences(mut self, audiences: Vec<String>) -> Self {
        self.audiences = Some(audiences);
        self
    }

    /// The key ring, to rotate keys.
    pub fn keys_mut(&mut self) -> &mut KeyRing {
        &mut self.keys
    }

    /// Synchronous verification (what `authenticate` does).
    pub fn verify(&self, token: &[u8], now_unix: u64) -> Result<AuthedPlayer, AuthError> {
        let player = verify_token(&self.keys, token, now_unix, self.leeway)?;
        if let Some(allowed) = &self.issuers {
            if !allowed.contains(&player.claims.issuer) {
                return Err(AuthError::Rejected(format!(
                    "issuer {:?} not allowed",
                    player.claims.issuer
                )));
            }
        }
        if let Some(allowed) = &self.audiences {
            let audience = player
                .claims
                .extensions
                .iter()
                .find(|(ty, _)| *ty == EXT_AUDIENCE)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned());
            if !audience.as_ref().is_some_and(|a| allowed.contains(a)) {
                return Err(AuthError::Rejected(format!(
                    "audience {audience:?} not accepted here"
                )));
            }
        }
        Ok(player)
    }
}

#[async_trait]
impl Authenticator for HmacAuthenticator {
    async fn authenticate(&self, token: &[u8], now_unix: u64) -> Result<AuthedPlayer, AuthError> {
        self.verify(token, now_unix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn claims() -> TokenClaims {
        TokenClaims {
            player_id: "p1".into(),
            issuer: "login".into(),
            issued_at: 1_000,
            expires_at: 2_000,
            extensions: vec![],
        }
    }

    fn auth() -> HmacAuthenticator {
        let mut ring = KeyRing::new();
        ring.insert(7, KEY);
        HmacAuthenticator::new(ring).with_leeway(Duration::from_secs(30))
    }

    #[test]
    fn an_audience_list_refuses_tokens_for_other_audiences_or_none() {
        let mint = |aud: Option<&str>| {
            let mut c = claims();
            if let Some(a) = aud {
                c.extensions = vec![(EXT_AUDIENCE, Bytes::from(a.to_owned()))];
            }
            mint_token(7, KEY, &c).expect("mint")
        };
        let picky = auth().with_allowed_audiences(vec!["eu-game".into()]);
        assert!(picky.verify(&mint(Some("eu-game")), 1_500).is_ok());
        for other in [Some("us-game"), None] {
            assert_eq!(
                picky
                    .verify(&mint(other), 1_500)
                    .map_err(|e| e.close_code()),
                Err(CloseCode::AuthRejected),
                "{other:?}"
            );
        }
        assert!(auth().verify(&mint(None), 1_500).is_ok(), "no list: any");
    }

    #[test]
    fn the_policy_refuses_revoked_players_and_overlong_tokens() {
        let player = |issued_at, expires_at| AuthedPlayer {
            claims: TokenClaims {
                player_id: "p".into(),
                issuer: String::new(),
                issued_at,
                expires_at,
                extensions: Vec::new(),
            },
            key_id: 1,
            session_key: None,
        };
        let revocations = Revocations::default();
        let policy = AuthPolicy::new(auth(), revocations.clone())
            .with_max_lifetime(Some(Duration::from_secs(3600)));
        assert!(policy.check(&player(1000, 4600), 1000).is_ok());
        assert!(matches!(
            policy.check(&player(1000, 4601), 1000),
            Err(AuthError::Rejected(_))
        ));
        // No issue time: counted from now.
        assert!(policy.check(&player(0, 4600), 1000).is_ok());
        assert!(policy.check(&player(0, 4601), 1000).is_err());
        revocations.revoke("p", Some(2000), 1000);
        assert_eq!(
            policy
                .check(&player(1000, 2000), 1500)
                .map_err(|e| e.close_code()),
            Err(CloseCode::AuthRejected)
        );
        assert!(
            policy.check(&player(1000, 4000), 2000).is_ok(),
            "the ban ran out"
        );
    }

    /// Regression (bounds, 2026-12-04, second stop): bans with an end time stayed in the
    /// list after it, for good. A new ban forgets the ones that ran out.
    #[test]
    fn bans_that_ran_out_are_forgotten() {
        let revocations = Revocations::default();
        for i in 0..1000 {
            revocations.revoke(&format!("p{i}"), Some(2000), 1000);
        }
        revocations.revoke("forever", None, 1500);
        assert_eq!(revocations.len(), 1001, "none ran out yet");
        revocations.revoke("late", Some(5000), 2000);
        assert_eq!(revocations.len(), 2, "the thousand that ran out are gone");
        assert!(revocations.is_revoked("forever", 2000) && revocations.is_revoked("late", 2000));
        assert!(!revocations.is_revoked("p1", 2000));
    }

    /// The worked example of PROTOCOL.md §7.2.3: pinned bytes, so a refactor cannot
    /// silently change the format.
    #[test]
    fn golden_token_bytes() {
        let token = mint_token(
            7,
            KEY,
            &TokenClaims {
                player_id: "p1".into(),
                issuer: "login".into(),
                issued_at: 1_700_000_000,
                expires_at: 1_700_003_600,
                extensions: vec![(0x80, Bytes::from_static(b"eu"))],
            },
        )
        .expect("mint");
        let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
        let body = "01\
                    00000007\
                    000000006553f100\
                    000000006553ff10\
                    02 7031\
                    05 6c6f67696e\
                    0005 80 0002 6575"
            .replace(' ', "");
        assert!(hex.starts_with(&body), "{hex}");
        assert_eq!(token.len(), body.len() / 2 + TAG_LEN);
        assert_eq!(
            &hex[body.len()..],
            include_str!("../tests/golden/token_v1_tag.hex").trim()
        );
        let player = auth().verify(&token, 1_700_000_100).expect("verify");
        assert_eq!(
            player.claims.extensions,
            vec![(0x80, Bytes::from_static(b"eu"))]
        );
    }

    /// Connect tokens (PROTOCOL.md §7.2.2): the session key comes back out; the public part
    /// is authenticated (any change fails); another key or a truncated token fails; the
    /// worked example's bytes are the document's.
    #[test]
    fn connect_tokens_carry_a_session_key_and_authenticate_their_public_part() {
        let session_key: [u8; 32] = core::array::from_fn(|i| 0x40 + i as u8);
        let token = mint_connect_token(7, KEY, &claims(), &session_key, [9; 12]).expect("mint");
        assert_eq!(token[0], TOKEN_VERSION_CONNECT);
        let player = auth().verify(&token, 1_500).expect("verify");
        assert_eq!(player.session_key, Some(session_key));
        assert_eq!(player.claims, claims());
        for at in [
            1,
            6,
            22,
            token.len() - 60,
            token.len() - 20,
            token.len() - 1,
        ] {
            let mut bad = token.to_vec();
            bad[at] ^= 1;
            assert!(auth().verify(&bad, 1_500).is_err(), "byte {at} altered");
        }
        let mut other = KeyRing::new();
        other.insert(7, b"another key, another key, 32 byt");
        assert_eq!(
            HmacAuthenticator::new(other)
                .verify(&token, 1_500)
                .map_err(|e| e.close_code()),
            Err(CloseCode::AuthBadSignature)
        );
        assert_eq!(
            auth()
                .verify(&token[..token.len() - 1], 1_500)
                .map_err(|e| e.close_code()),
            Err(CloseCode::AuthMalformed)
        );
        assert_eq!(
            auth().verify(&token, 3_000).map_err(|e| e.close_code()),
            Err(CloseCode::AuthExpired)
        );
        // Version 1 tokens carry none.
        let v1 = mint_token(7, KEY, &claims()).expect("mint");
        assert_eq!(auth().verify(&v1, 1_500).expect("v1").session_key, None);
        // PROTOCOL.md §7.2.2 worked example.
        let example = mint_connect_token(
            7,
            KEY,
            &TokenClaims {
                player_id: "p1".into(),
                issuer: "login".into(),
                issued_at: 1_700_000_000,
                expires_at: 1_700_003_600,
                extensions: vec![],
            },
            &core::array::from_fn(|i| i as u8),
            core::array::from_fn(|i| 0xA0 + i as u8),
        )
        .expect("mint");
        let hex: String = example.iter().map(|b| format!("{b:02x}")).collect();
        let doc = include_str!("../../PROTOCOL.md").replace([' ', '\n'], "");
        assert!(
            doc.contains(&hex),
            "connect token example {hex} in PROTOCOL.md"
        );
    }

    #[test]
    fn reject_reasons_map_to_codes() {
        let good = mint_token(7, KEY, &claims()).expect("mint");
        let a = auth();
        assert!(a.verify(&good, 1_500).is_ok());
        // malformed
        assert_eq!(
            a.verify(&[], 1_500).unwrap_err().close_code(),
            CloseCode::AuthMalformed
        );
        assert_eq!(
            a.verify(&good[..good.len() - 1], 1_500)
                .unwrap_err()
                .close_code(),
            CloseCode::AuthMalformed
        );
        // unsupported version
        let mut v3 = good.to_vec();
        v3[0] = 3;
        assert_eq!(a.verify(&v3, 1_500), Err(AuthError::UnsupportedVersion(3)));
        assert_eq!(
            AuthError::UnsupportedVersion(3).close_code(),
            CloseCode::AuthUnsupportedVersion
        );
        // a version-1 token relabelled as a connect token does not open
        let mut v2 = good.to_vec();
        v2[0] = TOKEN_VERSION_CONNECT;
        assert!(a.verify(&v2, 1_500).is_err());
        // bad signature: flip a claim byte, and a tag byte
        let mut forged = good.to_vec();
        forged[22] ^= 1;
        assert_eq!(a.verify(&forged, 1_500), Err(AuthError::BadSignature));
        let mut forged = good.to_vec();
        let last = forged.len() - 1;
        forged[last] ^= 0x80;
        assert_eq!(a.verify(&forged, 1_500), Err(AuthError::BadSignature));
        // signed with another key under the right id
        let other = mint_token(7, b"another key, same key id........", &claims()).expect("mint");
        assert_eq!(
            a.verify(&other, 1_500).unwrap_err().close_code(),
            CloseCode::AuthBadSignature
        );
        // unknown key
        let unknown = mint_token(8, KEY, &claims()).expect("mint");
        assert_eq!(a.verify(&unknown, 1_500), Err(AuthError::UnknownKey(8)));
        assert_eq!(
            AuthError::UnknownKey(8).close_code(),
            CloseCode::AuthUnknownKey
        );
        // expired
        assert_eq!(
            a.verify(&good, 5_000).unwrap_err().close_code(),
            CloseCode::AuthExpired
        );
        // issuer allow-list
        let picky = auth().with_allowed_issuers(vec!["other".into()]);
        assert_eq!(
            picky.verify(&good, 1_500).unwrap_err().close_code(),
            CloseCode::AuthRejected
        );
    }

    #[test]
    fn clock_skew_leeway_at_the_edge_of_the_window() {
        let token = mint_token(7, KEY, &claims()).expect("mint");
        let a = auth(); // leeway 30 s; window [1000, 2000]
        assert!(a.verify(&token, 2_030).is_ok(), "last second inside leeway");
        assert_eq!(
            a.verify(&token, 2_031),
            Err(AuthError::Expired {
                expires_at: 2_000,
                now: 2_031
            })
        );
        assert!(a.verify(&token, 970).is_ok(), "issued 30 s in our future");
        assert_eq!(
            a.verify(&token, 969),
            Err(AuthError::NotYetValid {
                issued_at: 1_000,
                now: 969
            })
        );
        let strict = auth().with_leeway(Duration::ZERO);
        assert!(strict.verify(&token, 2_000).is_ok());
        assert!(strict.verify(&token, 2_001).is_err());
        assert!(strict.verify(&token, 1_000).is_ok());
        assert!(strict.verify(&token, 999).is_err());
    }

    #[test]
    fn key_rotation_by_key_id() {
        let mut a = auth();
        a.keys_mut().insert(8, b"new key for rotation, 32 bytes..");
        let old = mint_token(7, KEY, &claims()).expect("mint");
        let new = mint_token(8, b"new key for rotation, 32 bytes..", &claims()).expect("mint");
        assert!(a.verify(&old, 1_500).is_ok());
        assert!(a.verify(&new, 1_500).is_ok());
        a.keys_mut().remove(7);
        assert_eq!(a.verify(&old, 1_500), Err(AuthError::UnknownKey(7)));
    }

    #[test]
    fn unknown_extensions_are_skipped_and_base64_round_trips() {
        let mut c = claims();
        c.extensions = vec![(0xEE, Bytes::from_static(&[1, 2, 3])), (0x01, Bytes::new())];
        let token = mint_token(7, KEY, &c).expect("mint");
        let text = token_to_base64url(&token);
        assert!(!text.contains('=') && !text.contains('+') && !text.contains('/'));
        let back = token_from_base64url(&text).expect("b64");
        let p = auth().verify(&back, 1_500).expect("verify");
        assert_eq!(p.claims, c);
        assert_eq!(p.player_id(), "p1");
    }

    #[test]
    fn mint_refuses_bad_claims() {
        let mut c = claims();
        c.player_id = String::new();
        assert_eq!(mint_token(7, KEY, &c), Err(MintError::PlayerId));
        let mut c = claims();
        c.expires_at = 10;
        assert_eq!(mint_token(7, KEY, &c), Err(MintError::Window));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let _ = auth().verify(&bytes, 1_500);
            let mut b = bytes.clone();
            if !b.is_empty() { b[0] = 1; }
            let _ = auth().verify(&b, 1_500);
        }
    }
}

//! Redis behind the session layer's store traits (SPEC S5-S7) and cross-edge presence (F4).
//!
//! - [`RedisOwnership`] implements [`OwnershipRegistry`]: one owner per player, fencing
//!   tokens from a per-player counter that only grows, owner records that expire with the
//!   session's snapshot once it is detached (linger), release only by the current owner, and a kick published on the previous
//!   owner's per-edge channel when another edge takes over ([`RedisOwnership::subscribe_kicks`]).
//! - [`RedisSnapshotStore`] implements [`SnapshotStore`] (the warm tier): snapshots expire
//!   after the linger time; `take` is one Lua script (compare the resume-token hash, delete),
//!   so a resume token works once across all edges; writes and deletes are fenced.
//! - [`RedisPresence`]: player -> (edge, session) with a TTL, and batched cross-edge push
//!   with a per-message [`DeliveryResult`] over Redis pub/sub (request + correlated reply).
//!
//! Every call is bounded by [`RedisConfig::op_timeout`] and fails with a typed
//! [`RedisError`] (converted to [`StoreError`] for the session layer) instead of hanging
//! when Redis is down; the connection reconnects by itself (redis' `ConnectionManager`).
//!
//! # Wiring an edge
//!
//! ```ignore
//! let redis = RedisStores::connect_with(RedisConfig {
//!     ..RedisConfig::new(url) // owner records of detached sessions expire with the linger

//! })
//! .await?; // or RedisStores::lazy(cfg)? to start while Redis is down
//! edge_sessions.snapshots = redis.snapshots.clone();
//! edge_sessions.ownership = redis.ownership.clone();
//! // Takeovers on other edges kick our sessions:
//! let mut kicks = redis.ownership.subscribe_kicks(&edge_id);
//! let registry = edge_sessions.registry.clone();
//! tokio::spawn(async move {
//!     while let Some(k) = kicks.recv().await {
//!         registry.kick(&k.session_id).await;
//!     }
//! });
//! // Pushes from other edges:
//! let reg = edge_sessions.registry.clone();
//! let _server = redis.presence.serve_pushes(&edge_id, move |player: &str, m: PushMessage| {
//!     match reg.push_to_player(player, m.into()) {
//!         Ok(()) => DeliveryResult::Delivered,
//!         Err(PushError::QueueFull) => DeliveryResult::QueueFull,
//!         Err(_) => DeliveryResult::Offline,
//!     }
//! }); // keep `_server` alive
//! // On SessionEvent::Established: presence.set(player, session, edge);
//! // on Ended: presence.remove(player, session).
//! // Every owner_ttl/3 (and right after Redis recovers), for each live session:
//! //   ownership.reassert(player, session, edge, fencing) -> Superseded => registry.kick
//! //   presence.set_many(edge, live) (presence_ttl/3)
//! ```
//!
//! # Keys (prefix `waygate` by default)
//!
//! | key | type | content | expiry |
//! |---|---|---|---|
//! | `P:fence:<player>` | string | fencing counter | [`RedisConfig::fence_ttl`] |
//! | `P:owner:<player>` | string | `<fencing> <session hex> <edge>` | live: owner TTL; detached: linger |
//! | `P:snap:<session hex>` | hash | `f` fencing, `h`/`p` resume hashes (hex), `d` JSON | linger |
//! | `P:presence:<player>` | string | `<session hex> <edge>` | presence TTL |
//!
//! Channels: `P:edge:<edge>:kick`, `P:edge:<edge>:push`, `P:reply:<random>`.
//!
//! Fencing counters start from Redis' clock in microseconds (`TIME`) when the counter key is
//! missing and then `INCR`, so tokens keep growing even after the counter expires or Redis
//! loses its data (a restart without persistence): a token issued later is always larger.
//! Single Redis primary (or Sentinel); scripts touch keys of one player and one session,
//! which Redis Cluster would need hash tags for (not supported here).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt as _;
use redis::aio::ConnectionManager;
use redis::{AsyncCommands as _, Script};
use tokio::sync::{mpsc, oneshot, watch};
use waygate_protocol::frame::SessionId;
use waygate_session::driver::Downstream;
use waygate_session::resume::{hex_id, ResumeHash};
use waygate_session::store::{
    ClaimGrant, Owner, OwnershipRegistry, Snapshot, SnapshotStore, StoreError, TakeOutcome,
};
use waygate_transport::TrafficClass;

/// Settings of the Redis backends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://host:port/db` (or `rediss://`).
    pub url: String,
    /// Key and channel prefix (several deployments can share one Redis).
    pub prefix: String,
    /// Bound on every call (connect, command, script); exceeded -> [`RedisError::Timeout`].
    pub op_timeout: Duration,
    /// Expiry of a live session's owner record (set by claim and reassert): a safety net
    /// for an edge that died without releasing. A detached session's record expires with
    /// its snapshot instead: [`SnapshotStore::put`] (called on detach with the linger time,
    /// SPEC S5) sets the owner record's expiry to the snapshot's TTL.
    pub owner_ttl: Duration,
    /// Expiry of the per-player fencing counter (refreshed on every claim and reassert);
    /// `None` keeps counters forever. Tokens grow even across expiry (see the module docs).
    pub fence_ttl: Option<Duration>,
    /// How long a presence record lives without a refresh.
    pub presence_ttl: Duration,
    /// How long [`RedisPresence::push_batch`] waits for the target edge's answer.
    pub push_timeout: Duration,
}

impl RedisConfig {
    /// Defaults for `url`: prefix `waygate`, 500 ms per call, 24 h live owner records
    /// (linger-long once detached), 30 day counters, 60 s presence, 1 s push wait.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: "waygate".into(),
            op_timeout: Duration::from_millis(500),
            owner_ttl: Duration::from_secs(24 * 3600),
            fence_ttl: Some(Duration::from_secs(30 * 24 * 3600)),
            presence_ttl: Duration::from_secs(60),
            push_timeout: Duration::from_secs(1),
        }
    }
}

/// A Redis call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// No answer within [`RedisConfig::op_timeout`].
    #[error("redis timed out")]
    Timeout,
    /// Connection refused or dropped, or Redis answered with an error.
    #[error("redis unavailable: {0}")]
    Unavailable(String),
    /// A stored record did not parse.
    #[error("corrupt redis record: {0}")]
    Corrupt(String),
    /// A caller-supplied value cannot be stored (e.g. an edge id with a newline).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A write carried a fencing token older than the player's current one.
    #[error("fenced: a newer owner exists")]
    Fenced,
}

impl From<redis::RedisError> for RedisError {
    fn from(e: redis::RedisError) -> Self {
        if e.is_timeout() {
            Self::Timeout
        } else {
            Self::Unavailable(e.to_string())
        }
    }
}

impl From<RedisError> for StoreError {
    fn from(e: RedisError) -> Self {
        match e {
            RedisError::Timeout => StoreError::Timeout,
            RedisError::Corrupt(m) => StoreError::Corrupt(m),
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}

/// Shared connection, key names and the per-call bound.
#[derive(Clone)]
struct Conn {
    client: redis::Client,
    manager: ConnectionManager,
    config: Arc<RedisConfig>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("url", &self.config.url)
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Conn {
    fn new(config: RedisConfig) -> Result<Self, RedisError> {
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| RedisError::Invalid(format!("redis url: {e}")))?;
        let mc = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.op_timeout))
            .set_response_timeout(Some(config.op_timeout))
            .set_number_of_retries(4)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_lazy_with_config(client.clone(), mc)?;
        Ok(Self {
            client,
            manager,
            config: Arc::new(config),
        })
    }

    /// Runs `f` on a clone of the managed connection, bounded by the op timeout.
    async fn run<T, F, Fut>(&self, f: F) -> Result<T, RedisError>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match tokio::time::timeout(self.config.op_timeout, f(self.manager.clone())).await {
            Ok(r) => r.map_err(RedisError::from),
            Err(_) => Err(RedisError::Timeout),
        }
    }

    fn key(&self, kind: &str, id: &str) -> String {
        format!("{}:{kind}:{id}", self.config.prefix)
    }

    fn edge_channel(&self, edge: &str, what: &str) -> String {
        format!("{}:edge:{edge}:{what}", self.config.prefix)
    }

    fn fence_ttl_ms(&self) -> u64 {
        self.config.fence_ttl.map_or(0, ms)
    }

    async fn ping(&self) -> Result<(), RedisError> {
        self.run(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .map(|_| ())
    }
}

fn check_edge(edge: &str) -> Result<(), RedisError> {
    if edge.is_empty() || edge.contains(['\n', ' ']) {
        return Err(RedisError::Invalid(format!(
            "edge id {edge:?} must be non-empty without spaces or newlines"
        )));
    }
    Ok(())
}

fn parse_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Lua helper shared by the scripts: the next fencing token of a player (seeded from the
/// server clock in microseconds when the counter is missing), with the counter's TTL.
const NEXT_FENCE_LUA: &str = r#"
local function next_fence(key, ttl)
  if redis.call('EXISTS', key) == 0 then
    local t = redis.call('TIME')
    redis.call('SET', key, string.format('%d', tonumber(t[1]) * 1000000 + tonumber(t[2])))
  end
  local f = redis.call('INCR', key)
  if tonumber(ttl) > 0 then redis.call('PEXPIRE', key, ttl) end
  return f
end
"#;

/// KEYS: fence, owner. ARGV: session hex, edge, owner ttl ms, fence ttl ms, kick channel
/// prefix, kick channel suffix, player. Returns {fencing, previous owner record or nil}.
const CLAIM_LUA: &str = r#"
local f = next_fence(KEYS[1], ARGV[4])
local fs = string.format('%d', f)
local prev = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[2], fs .. ' ' .. ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[3])
if prev then
  local pedge = string.match(prev, '^%d+ %x+ (.+)$')
  if pedge and pedge ~= ARGV[2] then
    redis.call('PUBLISH', ARGV[5] .. pedge .. ARGV[6],
      prev .. '\n' .. fs .. '\n' .. ARGV[2] .. '\n' .. ARGV[7])
  end
end
return {f, prev or false}
"#;

/// KEYS: owner. ARGV: "<fencing> <session hex> ". Deletes the owner record if it starts so.
const RELEASE_LUA: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

/// KEYS: fence, owner. ARGV: session hex, edge, fencing, owner ttl ms, fence ttl ms.
/// Returns {1} (owner again, TTL refreshed) or {0, current owner record or nil}.
const REASSERT_LUA: &str = r#"
local f = tonumber(ARGV[3])
local c = redis.call('GET', KEYS[1])
if c and tonumber(c) > f then return {0, redis.call('GET', KEYS[2]) or false} end
local cur = redis.call('GET', KEYS[2])
if cur then
  local csid = string.match(cur, '^%d+ (%x+) ')
  if csid ~= ARGV[1] then return {0, cur} end
end
if not c or tonumber(c) < f then redis.call('SET', KEYS[1], ARGV[3]) end
if tonumber(ARGV[5]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[5]) end
redis.call('SET', KEYS[2], ARGV[3] .. ' ' .. ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[4])
return {1, false}
"#;

/// KEYS: fence, snap, owner. ARGV: fencing, ttl ms, hash hex, prev hash hex or '', json,
/// "<fencing> <session hex> ". Returns 1 (written) or 0 (fenced: the player or the stored
/// snapshot is newer). A written snapshot's session, if it owns the player, gets its owner
/// record's expiry set to the snapshot's (the linger time starts now).
const PUT_LUA: &str = r#"
local f = tonumber(ARGV[1])
local c = redis.call('GET', KEYS[1])
if c and tonumber(c) > f then return 0 end
local sf = redis.call('HGET', KEYS[2], 'f')
if sf and tonumber(sf) > f then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'f', ARGV[1], 'h', ARGV[3], 'p', ARGV[4], 'd', ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
local cur = redis.call('GET', KEYS[3])
if cur and string.sub(cur, 1, #ARGV[6]) == ARGV[6] then
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
return 1
"#;

/// KEYS: snap. ARGV: hash hex. Returns {0} not found, {2} mismatch, {1, json} taken.
const TAKE_LUA: &str = r#"
local v = redis.call('HMGET', KEYS[1], 'h', 'p', 'd')
if not v[3] then return {0, false} end
if v[1] == ARGV[1] or (v[2] and v[2] ~= '' and v[2] == ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return {1, v[3]}
end
return {2, false}
"#;

/// KEYS: snap. ARGV: fencing or ''. Returns 1 if deleted.
const DELETE_LUA: &str = r#"
if ARGV[1] == '' then return redis.call('DEL', KEYS[1]) end
if redis.call('HGET', KEYS[1], 'f') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

/// KEYS: presence. ARGV: "<session hex> ". Deletes the record if it is this session's.
const PRESENCE_REMOVE_LUA: &str = RELEASE_LUA;

/// The three Redis backends of one edge, sharing one connection.
#[derive(Debug, Clone)]
pub struct RedisStores {
    /// Warm-tier snapshots: `EdgeSessions::snapshots`.
    pub snapshots: Arc<RedisSnapshotStore>,
    /// Single-login ownership: `EdgeSessions::ownership`.
    pub ownership: Arc<RedisOwnership>,
    /// Presence and cross-edge push.
    pub presence: Arc<RedisPresence>,
}

impl RedisStores {
    /// Connects with [`RedisConfig::new`] defaults and checks that Redis answers (PING within
    /// the op timeout).
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Self::connect_with(RedisConfig::new(url)).await
    }

    /// Connects with `config` and checks that Redis answers.
    pub async fn connect_with(config: RedisConfig) -> Result<Self, RedisError> {
        let stores = Self::lazy(config)?;
        stores.ownership.conn.ping().await?;
        Ok(stores)
    }

    /// Builds the backends without contacting Redis (the first call connects; an edge can
    /// start while Redis is down and serve logins once it is back). Needs a tokio runtime.
    pub fn lazy(config: RedisConfig) -> Result<Self, RedisError> {
        let conn = Conn::new(config)?;
        Ok(Self {
            snapshots: Arc::new(RedisSnapshotStore { conn: conn.clone() }),
            ownership: Arc::new(RedisOwnership::from_conn(conn.clone())),
            presence: Arc::new(RedisPresence::from_conn(conn)),
        })
    }
}

// ---------------------------------------------------------------------------------------
// Ownership
// ---------------------------------------------------------------------------------------

/// Result of [`RedisOwnership::reassert`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reassert {
    /// The session owns the player (again); the owner record's TTL is refreshed.
    Owner,
    /// Someone newer owns the player (or claimed it since): kick the local session.
    Superseded(Option<Owner>),
}

/// A takeover notice for the edge that held the previous owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KickNotice {
    /// The player.
    pub player_id: String,
    /// The session to kick on the receiving edge.
    pub session_id: SessionId,
    /// That session's fencing token (kick only if the local session is not newer).
    pub fencing: u64,
    /// The new owner's fencing token.
    pub new_fencing: u64,
    /// The edge that took over.
    pub by_edge: String,
}

impl KickNotice {
    fn parse(payload: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(payload).ok()?;
        let mut lines = s.splitn(4, '\n');
        let prev = parse_owner(lines.next()?)?;
        let new_fencing = lines.next()?.parse().ok()?;
        let by_edge = lines.next()?.to_owned();
        let player_id = lines.next()?.to_owned();
        Some(Self {
            player_id,
            session_id: prev.session_id,
            fencing: prev.fencing,
            new_fencing,
            by_edge,
        })
    }
}

fn parse_owner(record: &str) -> Option<Owner> {
    let mut parts = record.splitn(3, ' ');
    let fencing = parts.next()?.parse().ok()?;
    let session_id = parse_hex::<16>(parts.next()?)?;
    let edge = parts.next()?.to_owned();
    Some(Owner {
        session_id,
        edge,
        fencing,
    })
}

fn owner_from(record: Option<String>) -> Result<Option<Owner>, RedisError> {
    record
        .map(|r| parse_owner(&r).ok_or_else(|| RedisError::Corrupt(format!("owner {r:?}"))))
        .transpose()
}

/// Redis [`OwnershipRegistry`] (SPEC S6).
#[derive(Debug)]
pub struct RedisOwnership {
    conn: Conn,
    claim: Script,
    release: Script,
    reassert: Script,
}

impl RedisOwnership {
    fn from_conn(conn: Conn) -> Self {
        Self {
            conn,
            claim: Script::new(&format!("{NEXT_FENCE_LUA}{CLAIM_LUA}")),
            release: Script::new(RELEASE_LUA),
            reassert: Script::new(REASSERT_LUA),
        }
    }

    /// A registry alone (see [`RedisStores`] for all three sharing a connection).
    pub fn lazy(config: RedisConfig) -> Result<Self, RedisError> {
        Ok(Self::from_conn(Conn::new(config)?))
    }

    /// Makes `session_id` on `edge` the owner again if nobody newer claimed the player,
    /// refreshing the owner record's TTL to [`RedisConfig::owner_ttl`]. Call it for every
    /// live (attached, not lingering) session at once after Redis comes back (it restores
    /// records Redis lost and raises the counter to at least `fencing`) and periodically
    /// (e.g. every 30 s, well under `owner_ttl`). On [`Reassert::Superseded`] kick the
    /// local session: this also catches kicks missed while the kick subscription was down.
    pub async fn reassert(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
        fencing: u64,
    ) -> Result<Reassert, RedisError> {
        check_edge(edge)?;
        let c = &self.conn;
        let (fence, owner) = (c.key("fence", player_id), c.key("owner", player_id));
        let mut inv = self.reassert.prepare_invoke();
        inv.key(fence)
            .key(owner)
            .arg(hex_id(session_id))
            .arg(edge)
            .arg(fencing)
            .arg(ms(c.config.owner_ttl))
            .arg(c.fence_ttl_ms());
        let (ok, cur): (u8, Option<String>) = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        if ok == 1 {
            Ok(Reassert::Owner)
        } else {
            Ok(Reassert::Superseded(owner_from(cur)?))
        }
    }

    /// Subscribes to takeover notices for sessions of `edge_id` (published by
    /// [`OwnershipRegistry::claim`] on another edge). The background task reconnects by
    /// itself and ends when the returned receiver is dropped. Pub/sub is at-most-once:
    /// notices published while the subscription is down are lost; the periodic
    /// [`RedisOwnership::reassert`] sweep catches those.
    pub fn subscribe_kicks(&self, edge_id: &str) -> mpsc::Receiver<KickNotice> {
        let (tx, rx) = mpsc::channel(4096);
        let channel = self.conn.edge_channel(edge_id, "kick");
        let conn = self.conn.clone();
        tokio::spawn(async move {
            let sink = tx.clone();
            let run = subscribe_loop(conn, channel, None, move |msg| {
                let tx = sink.clone();
                async move {
                    match KickNotice::parse(msg.get_payload_bytes()) {
                        Some(k) => {
                            let _ = tx.send(k).await;
                        }
                        None => tracing::warn!("malformed kick notice ignored"),
                    }
                }
            });
            tokio::select! {
                _ = run => {}
                _ = tx.closed() => {}
            }
        });
        rx
    }

    /// Like [`subscribe_kicks`](Self::subscribe_kicks), but also reports (through
    /// `subscribed`) whether the subscription is currently up.
    pub fn subscribe_kicks_with_status(
        &self,
        edge_id: &str,
    ) -> (mpsc::Receiver<KickNotice>, watch::Receiver<bool>) {
        let (tx, rx) = mpsc::channel(4096);
        let (up_tx, up_rx) = watch::channel(false);
        let channel = self.conn.edge_channel(edge_id, "kick");
        let conn = self.conn.clone();
        tokio::spawn(async move {
            let sink = tx.clone();
            let run = subscribe_loop(conn, channel, Some(up_tx), move |msg| {
                let tx = sink.clone();
                async move {
                    if let Some(k) = KickNotice::parse(msg.get_payload_bytes()) {
                        let _ = tx.send(k).await;
                    }
                }
            });
            tokio::select! {
                _ = run => {}
                _ = tx.closed() => {}
            }
        });
        (rx, up_rx)
    }
}

#[async_trait]
impl OwnershipRegistry for RedisOwnership {
    async fn claim(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
    ) -> Result<ClaimGrant, StoreError> {
        check_edge(edge)?;
        let c = &self.conn;
        let mut inv = self.claim.prepare_invoke();
        inv.key(c.key("fence", player_id))
            .key(c.key("owner", player_id))
            .arg(hex_id(session_id))
            .arg(edge)
            .arg(ms(c.config.owner_ttl))
            .arg(c.fence_ttl_ms())
            .arg(format!("{}:edge:", c.config.prefix))
            .arg(":kick")
            .arg(player_id);
        let (fencing, prev): (u64, Option<String>) = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        Ok(ClaimGrant {
            fencing,
            previous: owner_from(prev)?,
        })
    }

    async fn release(
        &self,
        player_id: &str,
        session_id: &SessionId,
        fencing: u64,
    ) -> Result<bool, StoreError> {
        let c = &self.conn;
        let mut inv = self.release.prepare_invoke();
        inv.key(c.key("owner", player_id))
            .arg(format!("{fencing} {} ", hex_id(session_id)));
        let n: u8 = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        Ok(n == 1)
    }

    async fn owner(&self, player_id: &str) -> Result<Option<Owner>, StoreError> {
        let key = self.conn.key("owner", player_id);
        let rec: Option<String> = self
            .conn
            .run(|mut m| async move { m.get(key).await })
            .await?;
        Ok(owner_from(rec)?)
    }
}

/// Keeps a pub/sub subscription to `channel` up (reconnecting with backoff) and calls
/// `on_msg` for every message. `up` tracks whether the subscription is live. Never returns.
async fn subscribe_loop<F, Fut>(
    conn: Conn,
    channel: String,
    up: Option<watch::Sender<bool>>,
    on_msg: F,
) where
    F: Fn(redis::Msg) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let set_up = |v: bool| {
        if let Some(up) = &up {
            up.send_replace(v);
        }
    };
    let mut backoff = Duration::from_millis(50);
    loop {
        let subscribed = tokio::time::timeout(conn.config.op_timeout, async {
            let mut ps = conn.client.get_async_pubsub().await?;
            ps.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(ps)
        })
        .await;
        match subscribed {
            Ok(Ok(mut ps)) => {
                backoff = Duration::from_millis(50);
                set_up(true);
                tracing::debug!(%channel, "redis subscription up");
                let mut stream = ps.on_message();
                while let Some(msg) = stream.next().await {
                    on_msg(msg).await;
                }
                set_up(false);
                tracing::warn!(%channel, "redis subscription lost; reconnecting");
            }
            Ok(Err(e)) => tracing::debug!(%channel, error = %e, "redis subscribe failed"),
            Err(_) => tracing::debug!(%channel, "redis subscribe timed out"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

// ---------------------------------------------------------------------------------------
// Snapshots
// ---------------------------------------------------------------------------------------

/// Redis [`SnapshotStore`] (warm tier, SPEC S7).
///
/// `put` is fenced too: a snapshot whose fencing token is older than the player's counter
/// (or than the stored snapshot's) is refused with [`StoreError::Unavailable`] ("fenced"),
/// so a stale owner cannot overwrite what a newer one wrote.
#[derive(Debug)]
pub struct RedisSnapshotStore {
    conn: Conn,
}

fn scripts() -> &'static [Script; 4] {
    static S: std::sync::OnceLock<[Script; 4]> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        [
            Script::new(PUT_LUA),
            Script::new(TAKE_LUA),
            Script::new(DELETE_LUA),
            Script::new(PRESENCE_REMOVE_LUA),
        ]
    })
}

impl RedisSnapshotStore {
    /// A store alone (see [`RedisStores`] for all three sharing a connection).
    pub fn lazy(config: RedisConfig) -> Result<Self, RedisError> {
        Ok(Self {
            conn: Conn::new(config)?,
        })
    }

    /// Writes `snapshot` unless it is fenced; see [`SnapshotStore::put`].
    pub async fn put_fenced(&self, snapshot: &Snapshot, ttl: Duration) -> Result<(), RedisError> {
        let c = &self.conn;
        let json = serde_json::to_string(snapshot)
            .map_err(|e| RedisError::Invalid(format!("snapshot: {e}")))?;
        let mut inv = scripts()[0].prepare_invoke();
        inv.key(c.key("fence", &snapshot.player_id))
            .key(c.key("snap", &hex_id(&snapshot.session_id)))
            .key(c.key("owner", &snapshot.player_id))
            .arg(snapshot.fencing)
            .arg(ms(ttl))
            .arg(hex_id(&snapshot.resume_hash.0))
            .arg(
                snapshot
                    .prev_resume_hash
                    .map_or(String::new(), |h| hex_id(&h.0)),
            )
            .arg(json)
            .arg(format!(
                "{} {} ",
                snapshot.fencing,
                hex_id(&snapshot.session_id)
            ));
        let n: u8 = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        if n == 1 {
            Ok(())
        } else {
            Err(RedisError::Fenced)
        }
    }

    fn decode(session_id: &SessionId, json: &str) -> Result<Snapshot, RedisError> {
        let s: Snapshot = serde_json::from_str(json)
            .map_err(|e| RedisError::Corrupt(format!("snapshot {}: {e}", hex_id(session_id))))?;
        if s.session_id != *session_id {
            return Err(RedisError::Corrupt(format!(
                "snapshot under {} holds {}",
                hex_id(session_id),
                hex_id(&s.session_id)
            )));
        }
        Ok(s)
    }
}

#[async_trait]
impl SnapshotStore for RedisSnapshotStore {
    async fn put(&self, snapshot: &Snapshot, ttl: Duration) -> Result<(), StoreError> {
        Ok(self.put_fenced(snapshot, ttl).await?)
    }

    async fn get(&self, session_id: &SessionId) -> Result<Option<Snapshot>, StoreError> {
        let key = self.conn.key("snap", &hex_id(session_id));
        let json: Option<String> = self
            .conn
            .run(|mut m| async move { m.hget(key, "d").await })
            .await?;
        Ok(json.map(|j| Self::decode(session_id, &j)).transpose()?)
    }

    async fn take(
        &self,
        session_id: &SessionId,
        resume_hash: &ResumeHash,
    ) -> Result<TakeOutcome, StoreError> {
        let c = &self.conn;
        let mut inv = scripts()[1].prepare_invoke();
        inv.key(c.key("snap", &hex_id(session_id)))
            .arg(hex_id(&resume_hash.0));
        let (code, json): (u8, Option<String>) = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        match (code, json) {
            (1, Some(j)) => Ok(TakeOutcome::Taken(Box::new(Self::decode(session_id, &j)?))),
            (2, _) => Ok(TakeOutcome::Mismatch),
            (0, _) => Ok(TakeOutcome::NotFound),
            (other, _) => Err(RedisError::Corrupt(format!("take answered {other}")).into()),
        }
    }

    async fn delete(
        &self,
        session_id: &SessionId,
        fencing: Option<u64>,
    ) -> Result<bool, StoreError> {
        let c = &self.conn;
        let mut inv = scripts()[2].prepare_invoke();
        inv.key(c.key("snap", &hex_id(session_id)))
            .arg(fencing.map_or(String::new(), |f| f.to_string()));
        let n: u8 = c
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        Ok(n == 1)
    }
}

// ---------------------------------------------------------------------------------------
// Presence and cross-edge push
// ---------------------------------------------------------------------------------------

/// Where a player is connected (SPEC F4: edge + session, never the player id alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presence {
    /// The edge holding the session.
    pub edge: String,
    /// The session.
    pub session_id: SessionId,
}

fn parse_presence(record: &str) -> Option<Presence> {
    let (sid, edge) = record.split_once(' ')?;
    Some(Presence {
        edge: edge.to_owned(),
        session_id: parse_hex::<16>(sid)?,
    })
}

/// A message pushed to a player on another edge.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PushMessage {
    /// Traffic class.
    pub class: TrafficClass,
    /// Application message id.
    pub msg_id: u32,
    /// Body (hex on the wire).
    #[serde(with = "hex_bytes")]
    pub payload: Bytes,
}

impl From<PushMessage> for Downstream {
    fn from(m: PushMessage) -> Self {
        Downstream {
            class: m.class,
            msg_id: m.msg_id,
            payload: m.payload,
        }
    }
}

mod hex_bytes {
    use bytes::Bytes;
    use serde::{Deserialize as _, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(b: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&waygate_session::resume::hex_id(b))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        if s.len() % 2 != 0 || !s.is_ascii() {
            return Err(serde::de::Error::custom("odd or non-ascii hex"));
        }
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map(Bytes::from)
            .map_err(serde::de::Error::custom)
    }
}

/// Per-message result of a cross-edge push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum DeliveryResult {
    /// Queued on the player's session.
    Delivered,
    /// The player has no session there (or no presence at all).
    Offline,
    /// The session's outbound queue is full.
    QueueFull,
    /// The target edge is not listening (no subscriber): not delivered.
    EdgeUnreachable,
    /// No answer within [`RedisConfig::push_timeout`]: may or may not have been delivered.
    Timeout,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct PushRequest {
    id: u64,
    reply: String,
    items: Vec<(String, PushMessage)>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct PushReply {
    id: u64,
    results: Vec<DeliveryResult>,
}

/// What an edge does with pushes from other edges (see [`RedisPresence::serve_pushes`]).
/// Called once per message; must not block (queue, do not wait).
pub trait PushHandler: Send + Sync + 'static {
    /// Delivers `msg` to `player_id`'s session on this edge.
    fn deliver(&self, player_id: &str, msg: PushMessage) -> DeliveryResult;
}

impl<F> PushHandler for F
where
    F: Fn(&str, PushMessage) -> DeliveryResult + Send + Sync + 'static,
{
    fn deliver(&self, player_id: &str, msg: PushMessage) -> DeliveryResult {
        self(player_id, msg)
    }
}

/// Messages for one edge, each with its player.
type PushBatch = Vec<(String, PushMessage)>;

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Vec<DeliveryResult>>>>>;

struct ReplyListener {
    channel: String,
    up: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ReplyListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Presence records and batched cross-edge push (SPEC F4).
pub struct RedisPresence {
    conn: Conn,
    pending: Pending,
    next_id: AtomicU64,
    listener: tokio::sync::OnceCell<ReplyListener>,
}

impl std::fmt::Debug for RedisPresence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPresence")
            .field("conn", &self.conn)
            .finish_non_exhaustive()
    }
}

/// The receiving side of cross-edge pushes; stops when dropped.
#[derive(Debug)]
pub struct PushServer {
    task: tokio::task::JoinHandle<()>,
    up: watch::Receiver<bool>,
}

impl PushServer {
    /// Whether the subscription is up.
    pub fn is_up(&self) -> bool {
        *self.up.borrow()
    }

    /// Waits until the subscription is up (or `timeout` passes); returns whether it is.
    pub async fn wait_up(&mut self, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, self.up.wait_for(|u| *u))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

impl Drop for PushServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RedisPresence {
    fn from_conn(conn: Conn) -> Self {
        Self {
            conn,
            pending: Arc::default(),
            next_id: AtomicU64::new(1),
            listener: tokio::sync::OnceCell::new(),
        }
    }

    /// Presence alone (see [`RedisStores`] for all three sharing a connection).
    pub fn lazy(config: RedisConfig) -> Result<Self, RedisError> {
        Ok(Self::from_conn(Conn::new(config)?))
    }

    /// Records (or refreshes) that `player_id` is on `edge` in `session_id`, for
    /// [`RedisConfig::presence_ttl`]. Call on ACTIVE and periodically for live sessions.
    pub async fn set(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
    ) -> Result<(), RedisError> {
        check_edge(edge)?;
        let key = self.conn.key("presence", player_id);
        let val = format!("{} {edge}", hex_id(session_id));
        let ttl = ms(self.conn.config.presence_ttl);
        self.conn
            .run(|mut m| async move { m.pset_ex::<_, _, ()>(key, val, ttl).await })
            .await
    }

    /// Refreshes many presence records in one round trip (the periodic sweep).
    pub async fn set_many(
        &self,
        edge: &str,
        entries: &[(String, SessionId)],
    ) -> Result<(), RedisError> {
        check_edge(edge)?;
        if entries.is_empty() {
            return Ok(());
        }
        let ttl = ms(self.conn.config.presence_ttl);
        let mut pipe = redis::pipe();
        for (player, sid) in entries {
            pipe.cmd("SET")
                .arg(self.conn.key("presence", player))
                .arg(format!("{} {edge}", hex_id(sid)))
                .arg("PX")
                .arg(ttl)
                .ignore();
        }
        self.conn
            .run(|mut m| async move { pipe.query_async::<()>(&mut m).await })
            .await
    }

    /// Removes the presence record if it still names `session_id` (a newer session's
    /// record stays). Returns whether it did.
    pub async fn remove(
        &self,
        player_id: &str,
        session_id: &SessionId,
    ) -> Result<bool, RedisError> {
        let mut inv = scripts()[3].prepare_invoke();
        inv.key(self.conn.key("presence", player_id))
            .arg(format!("{} ", hex_id(session_id)));
        let n: u8 = self
            .conn
            .run(|mut m| async move { inv.invoke_async(&mut m).await })
            .await?;
        Ok(n == 1)
    }

    /// Where `player_id` is.
    pub async fn lookup(&self, player_id: &str) -> Result<Option<Presence>, RedisError> {
        Ok(self.lookup_many(&[player_id]).await?.pop().flatten())
    }

    /// Where each of `players` is, in order (one round trip).
    pub async fn lookup_many(&self, players: &[&str]) -> Result<Vec<Option<Presence>>, RedisError> {
        if players.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = players
            .iter()
            .map(|p| self.conn.key("presence", p))
            .collect();
        let recs: Vec<Option<String>> = self
            .conn
            .run(|mut m| async move { redis::cmd("MGET").arg(keys).query_async(&mut m).await })
            .await?;
        recs.into_iter()
            .map(|r| {
                r.map(|r| {
                    parse_presence(&r).ok_or_else(|| RedisError::Corrupt(format!("presence {r:?}")))
                })
                .transpose()
            })
            .collect()
    }

    async fn listener(&self) -> Result<&ReplyListener, RedisError> {
        let l = self
            .listener
            .get_or_init(|| async {
                let mut rnd = [0u8; 16];
                rand::fill(&mut rnd);
                let channel = format!("{}:reply:{}", self.conn.config.prefix, hex_id(&rnd));
                let (up_tx, up) = watch::channel(false);
                let pending = self.pending.clone();
                let task = tokio::spawn(subscribe_loop(
                    self.conn.clone(),
                    channel.clone(),
                    Some(up_tx),
                    move |msg| {
                        let pending = pending.clone();
                        async move {
                            let Ok(reply) =
                                serde_json::from_slice::<PushReply>(msg.get_payload_bytes())
                            else {
                                tracing::warn!("malformed push reply ignored");
                                return;
                            };
                            let tx = pending
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .remove(&reply.id);
                            if let Some(tx) = tx {
                                let _ = tx.send(reply.results);
                            }
                        }
                    },
                ));
                ReplyListener { channel, up, task }
            })
            .await;
        let mut up = l.up.clone();
        let ready = tokio::time::timeout(self.conn.config.op_timeout, up.wait_for(|u| *u))
            .await
            .is_ok_and(|r| r.is_ok());
        if ready {
            Ok(l)
        } else {
            Err(RedisError::Timeout)
        }
    }

    /// Pushes a batch to players on `edge_id` (one request, one reply). The result has one
    /// entry per message, in order. Fails only when Redis itself cannot be used; a silent
    /// target edge yields per-message [`DeliveryResult::EdgeUnreachable`] or `Timeout`.
    pub async fn push_batch(
        &self,
        edge_id: &str,
        items: Vec<(String, PushMessage)>,
    ) -> Result<Vec<DeliveryResult>, RedisError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let n = items.len();
        let listener = self.listener().await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let req = PushRequest {
            id,
            reply: listener.channel.clone(),
            items,
        };
        let body = serde_json::to_vec(&req).map_err(|e| RedisError::Invalid(e.to_string()))?;
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let forget = || {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        };
        let channel = self.conn.edge_channel(edge_id, "push");
        let receivers: Result<u64, _> = self
            .conn
            .run(|mut m| async move { m.publish(channel, body).await })
            .await;
        match receivers {
            Err(e) => {
                forget();
                return Err(e);
            }
            Ok(0) => {
                forget();
                return Ok(vec![DeliveryResult::EdgeUnreachable; n]);
            }
            Ok(_) => {}
        }
        match tokio::time::timeout(self.conn.config.push_timeout, rx).await {
            Ok(Ok(results)) if results.len() == n => Ok(results),
            Ok(Ok(results)) => Err(RedisError::Corrupt(format!(
                "push reply has {} results for {n} messages",
                results.len()
            ))),
            _ => {
                forget();
                Ok(vec![DeliveryResult::Timeout; n])
            }
        }
    }

    /// Pushes to players wherever they are: looks up presence (one round trip), sends one
    /// batch per edge concurrently, and returns one result per message in order (players
    /// without presence: [`DeliveryResult::Offline`]).
    pub async fn push(
        &self,
        items: Vec<(String, PushMessage)>,
    ) -> Result<Vec<DeliveryResult>, RedisError> {
        let players: Vec<&str> = items.iter().map(|(p, _)| p.as_str()).collect();
        let where_ = self.lookup_many(&players).await?;
        let mut results = vec![DeliveryResult::Offline; items.len()];
        let mut per_edge: HashMap<String, (Vec<usize>, PushBatch)> = HashMap::new();
        for (i, (item, presence)) in items.into_iter().zip(where_).enumerate() {
            if let Some(p) = presence {
                let e = per_edge.entry(p.edge).or_default();
                e.0.push(i);
                e.1.push(item);
            }
        }
        let sends = per_edge
            .into_iter()
            .map(|(edge, (idx, batch))| async move { (idx, self.push_batch(&edge, batch).await) });
        for (idx, r) in futures_util::future::join_all(sends).await {
            let r = r?;
            for (i, res) in idx.into_iter().zip(r) {
                results[i] = res;
            }
        }
        Ok(results)
    }

    /// Serves pushes addressed to `edge_id`: every request's messages go through `handler`
    /// and the per-message results go back to the sender. Reconnects by itself; stops when
    /// the returned [`PushServer`] is dropped.
    pub fn serve_pushes(&self, edge_id: &str, handler: impl PushHandler) -> PushServer {
        let handler = Arc::new(handler);
        let channel = self.conn.edge_channel(edge_id, "push");
        let (up_tx, up) = watch::channel(false);
        let conn = self.conn.clone();
        let task = tokio::spawn(subscribe_loop(
            self.conn.clone(),
            channel,
            Some(up_tx),
            move |msg| {
                let (handler, conn) = (handler.clone(), conn.clone());
                async move {
                    let Ok(req) = serde_json::from_slice::<PushRequest>(msg.get_payload_bytes())
                    else {
                        tracing::warn!("malformed push request ignored");
                        return;
                    };
                    let results = req
                        .items
                        .into_iter()
                        .map(|(player, m)| handler.deliver(&player, m))
                        .collect();
                    let reply = PushReply {
                        id: req.id,
                        results,
                    };
                    let Ok(body) = serde_json::to_vec(&reply) else {
                        return;
                    };
                    let to = req.reply;
                    if let Err(e) = conn
                        .run(|mut m| async move { m.publish::<_, _, u64>(to, body).await })
                        .await
                    {
                        tracing::warn!(error = %e, "could not answer a push batch");
                    }
                }
            },
        ));
        PushServer { task, up }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse() {
        let o = parse_owner(&format!("12 {} edge a", hex_id(&[7; 16]))).expect("owner");
        assert_eq!(
            (o.fencing, o.session_id, o.edge.as_str()),
            (12, [7; 16], "edge a")
        );
        assert!(parse_owner("x y z").is_none());
        let k = KickNotice::parse(
            format!("3 {} e1\n4\ne2\nplayer\nwith newline", hex_id(&[1; 16])).as_bytes(),
        )
        .expect("kick");
        assert_eq!(k.player_id, "player\nwith newline");
        assert_eq!((k.fencing, k.new_fencing, k.by_edge.as_str()), (3, 4, "e2"));
        let p = parse_presence(&format!("{} e9", hex_id(&[2; 16]))).expect("presence");
        assert_eq!(p.edge, "e9");
        assert!(check_edge("a b").is_err() && check_edge("").is_err() && check_edge("e-1").is_ok());
        let m = PushMessage {
            class: TrafficClass::Normal,
            msg_id: 9,
            payload: Bytes::from_static(b"\x00\xffhi"),
        };
        let json = serde_json::to_string(&m).expect("ser");
        assert_eq!(serde_json::from_str::<PushMessage>(&json).expect("de"), m);
    }
}

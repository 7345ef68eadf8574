//! Redis behind the session layer's store traits (SPEC S5-S7) and cross-edge presence (F4).
//!
//! - [`RedisOwnership`] implements [`OwnershipRegistry`]: one owner per player, fencing
//!   tokens from a per-player counter that only grows, owner records that expire with the
//!   session's snapshot once it is detached (linger), release only by the current owner, and
//!   a kick published on the previous owner's per-edge channel when another edge takes over
//!   ([`RedisOwnership::subscribe_kicks`]).
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
//! session_layer.snapshots = redis.snapshots.clone();
//! session_layer.ownership = redis.ownership.clone();
//! // Takeovers on other edges kick our sessions:
//! let mut kicks = redis.ownership.subscribe_kicks(&edge_id);
//! let registry = session_layer.registry.clone();
//! tokio::spawn(async move {
//!     while let Some(k) = kicks.recv().await {
//!         registry.kick(&k.session_id);
//!     }
//! });
//! // Pushes from other edges:
//! let reg = session_layer.registry.clone();
//! let _server = redis.presence.serve_pushes(&edge_id, move |player: &str, m: PushMessage| {
//!     match reg.push_to_player(player, m.into()) {
//!         Ok(()) => DeliveryResult::Delivered,
//!         Err(PushError::QueueFull) => DeliveryResult::QueueFull,
//!         Err(_) => DeliveryResult::Offline,
//!     }
//! }); // keep `_server` alive
//! // On SessionEvent::Established: presence.set(player, session, edge);
//! // on Ended: presence.remove(player, session, edge).
//! // Every owner_ttl/3 (and right after Redis recovers), for each live session:
//! //   ownership.reassert(player, session, edge, fencing) -> Superseded => registry.kick
//! //   presence.set_many(edge, live) (presence_ttl/3)
//! ```
//!
//! # Keys (prefix `waygate` by default)
//!
//! Every key carries a hash tag `{T}`: T is the hex of the player's 4-byte store tag
//! (`waygate_session::resume::player_store_tag`), and a session id starts with its player's
//! tag, so each script touches one Redis Cluster slot (the player's) and one Redis works the
//! same way.
//!
//! | key | type | content | expiry |
//! |---|---|---|---|
//! | `P:{T}:fence:<player>` | string | fencing counter | [`RedisConfig::fence_ttl`] |
//! | `P:{T}:owner:<player>` | string | `<fencing> <session hex> <edge>` | live: owner TTL; detached: linger |
//! | `P:{T}:snap:<session hex>` | hash | `f` fencing, `h`/`p` resume keys (hex, or match tags with the edges' secret), `k`/`q` the keys sealed (with the secret), `n` nonce, `d` the rest (postcard), `c` counters, `r` entry range, `e<seq>` replay entries, `u` push ids (see `snapshots`) | linger |
//! | `P:{T}:presence:<player>` | string | `<session hex> <edge>` | presence TTL |
//! | `P:resume-keys` | hash | edge id -> `<Redis ms> <sealing fingerprint or -> <accepted fingerprint or ->` ([`EdgeSecrets`], [`RedisStores::check_resume_key`]; an entry older than 30 s is dropped) | 300 s after the last announcement |
//!
//! Channels: `P:edge:<edge>:kick`, `P:edge:<edge>:push`, `P:reply:<random>` (classic
//! pub/sub; on a cluster it reaches subscribers on every node).
//!
//! A fencing token is the larger of the player's counter + 1 and Redis' clock in
//! microseconds (`TIME`), so tokens keep growing even after the counter expires, Redis
//! loses its data (a restart without persistence) or a failover promotes a replica that
//! missed the last claims: a token issued later is always larger, as long as the clocks of
//! the primaries agree to within a failover's duration.
//!
//! # Deployments
//!
//! [`RedisServers::Single`] (one primary) or [`RedisServers::Cluster`] (seed nodes; redis'
//! cluster client follows the slot map, redirections and failovers). On a cluster the
//! presence sweep runs one pipeline per slot, and a cross-edge push whose PUBLISH reached
//! no subscriber *on the node that took it* still waits for an answer (the count is the
//! node's, not the cluster's).
//!
//! [`RedisServers::Sentinel`] (sentinel URLs and a master name): one primary as with
//! `Single`, found through the sentinels and found again after a failover (a call that
//! fails because the primary is gone, or answers `READONLY` because it was demoted, makes
//! the next call ask the sentinels (all at once: the first answer wins); calls that certainly did not run are retried on the
//! new primary within the op timeout). Subscriptions connect to the primary of the moment.
//! Credentials for the primary ([`SentinelPrimaryAuth`]) are given apart from the
//! sentinels' own (in their URLs). `rediss://` sentinels mean TLS to them and to the primary
//! they name, verified against [`RedisConfig::tls_root_pem`] (else the system's roots).
//!
//! # Where things are
//!
//! - `conn`: the shared connection (`ConnectionManager`, per-call bound, key and channel
//!   names) and the pub/sub subscription loop every listener uses.
//! - `ownership`: owner records, fencing, claim / release / reassert scripts, kicks
//!   ([`RedisOwnership`], [`Reassert`], [`KickNotice`]).
//! - `snapshots`: the warm snapshot store ([`RedisSnapshotStore`]).
//! - `presence`: presence records ([`RedisPresence`], [`Presence`]).
//! - `announcements`: the channels' announcement log, a stream per channel epoch
//!   ([`RedisAnnouncementLog`]; key `P:{T}:ann:<channel>:<epoch>`, T the channel name's
//!   store tag), and beside it the set of offsets withdrawn, `P:{T}:annw:<channel>:<epoch>`.
//! - `push`: cross-edge push over pub/sub ([`PushMessage`], [`DeliveryResult`],
//!   [`PushHandler`], [`PushServer`]).
//! - this file: [`RedisConfig`], [`RedisError`] and [`RedisStores`], the three backends on
//!   one connection.
//!
//! [`OwnershipRegistry`]: waygate_session::store::OwnershipRegistry
//! [`SnapshotStore`]: waygate_session::store::SnapshotStore
//! [`StoreError`]: waygate_session::store::StoreError

use std::sync::Arc;
use std::time::Duration;

use waygate_session::store::StoreError;

mod announcements;
mod conn;
mod ownership;
mod presence;
mod push;
mod seal;
mod snapshots;

pub use announcements::RedisAnnouncementLog;
use conn::Conn;
pub use ownership::{KickNotice, KickSubscription, Reassert, RedisOwnership};
pub use presence::{Presence, RedisPresence};
pub use push::{DeliveryResult, PushDelivery, PushHandler, PushMessage, PushServer};
pub use seal::ResumeKeySeal;

/// Whether redis reaches `url` over TLS (`rediss://`, `valkeys://`, in any case; `#insecure`
/// included); false for a URL it cannot parse.
pub fn url_uses_tls(url: &str) -> bool {
    conn::tls_of(url).is_ok_and(|t| t.is_some())
}
pub use snapshots::RedisSnapshotStore;

/// Which Redis deployment the backends talk to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisServers {
    /// One primary: `redis://host:port/db` (or `rediss://`).
    Single(String),
    /// Redis Cluster: seed node URLs (`redis://host:port`); the client learns the slot map
    /// from them, follows MOVED/ASK redirections and failovers by itself.
    Cluster(Vec<String>),
    /// One primary with replicas watched by Redis Sentinel: the sentinels' URLs
    /// (`redis://host:26379`) and the master name they monitor. The edge asks them where
    /// the primary is, and again whenever it fails or turns out to be a replica.
    Sentinel {
        /// Sentinel URLs.
        sentinels: Vec<String>,
        /// The master name (`sentinel monitor <name> ...`).
        master: String,
        /// Credentials for the primary and replicas the sentinels name (the sentinels'
        /// own go in their URLs); `None`: no AUTH.
        primary_auth: Option<SentinelPrimaryAuth>,
    },
}

/// How the edge authenticates to the primary the sentinels name (`AUTH [username]
/// password`). Its `Debug` does not show the password.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelPrimaryAuth {
    /// ACL user; `None`: the default user.
    pub username: Option<String>,
    /// Password.
    pub password: String,
}

impl std::fmt::Debug for SentinelPrimaryAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelPrimaryAuth")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl RedisServers {
    /// The URLs, for logs.
    pub fn describe(&self) -> String {
        match self {
            Self::Single(url) => url.clone(),
            Self::Cluster(nodes) => format!("cluster {}", nodes.join(",")),
            Self::Sentinel {
                sentinels, master, ..
            } => {
                format!("sentinel {master} at {}", sentinels.join(","))
            }
        }
    }
}

/// Settings of the Redis backends.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// The server(s).
    pub servers: RedisServers,
    /// Key and channel prefix (several deployments can share one Redis).
    pub prefix: String,
    /// Bound on every call (connect, command, script); exceeded -> [`RedisError::Timeout`].
    pub op_timeout: Duration,
    /// Expiry of a live session's owner record (set by claim and reassert): a safety net
    /// for an edge that died without releasing. A detached session's record expires with
    /// its snapshot instead: [`SnapshotStore::put`] (called on detach with the linger time,
    /// SPEC S5) sets the owner record's expiry to the snapshot's TTL.
    ///
    /// [`SnapshotStore::put`]: waygate_session::store::SnapshotStore::put
    pub owner_ttl: Duration,
    /// Expiry of the per-player fencing counter (refreshed on every claim and reassert);
    /// `None` keeps counters forever. Tokens grow even across expiry (see the module docs).
    pub fence_ttl: Option<Duration>,
    /// How long a presence record lives without a refresh.
    pub presence_ttl: Duration,
    /// How long [`RedisPresence::push_batch`] waits for the target edge's answer.
    pub push_timeout: Duration,
    /// PEM certificates `rediss://` servers must chain to (a private CA); `None`: the
    /// system's trusted roots. Only with `rediss://` URLs (single Redis, Redis Cluster,
    /// sentinels).
    pub tls_root_pem: Option<Vec<u8>>,
    /// The edges' shared key for the resume keys in snapshots: with it they are stored only
    /// sealed and as match tags ([`ResumeKeySeal`]); `None`: in clear.
    pub resume_key_seal: Option<Arc<ResumeKeySeal>>,
}

impl RedisConfig {
    /// Defaults for one Redis at `url`: prefix `waygate`, 500 ms per call, 24 h live owner
    /// records (linger-long once detached), 30 day counters, 60 s presence, 1 s push wait.
    pub fn new(url: impl Into<String>) -> Self {
        Self::with_servers(RedisServers::Single(url.into()))
    }

    /// The same defaults for a Redis Cluster reached through the seed nodes `nodes`.
    pub fn cluster(nodes: Vec<String>) -> Self {
        Self::with_servers(RedisServers::Cluster(nodes))
    }

    /// The defaults of [`RedisConfig::new`] for `servers`.
    pub fn with_servers(servers: RedisServers) -> Self {
        Self {
            servers,
            prefix: "waygate".into(),
            op_timeout: Duration::from_millis(500),
            owner_ttl: Duration::from_secs(24 * 3600),
            fence_ttl: Some(Duration::from_secs(30 * 24 * 3600)),
            presence_ttl: Duration::from_secs(60),
            push_timeout: Duration::from_secs(1),
            tls_root_pem: None,
            resume_key_seal: None,
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
            RedisError::Fenced => StoreError::Fenced,
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}

/// What [`RedisStores::check_resume_key`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeKeyCheck {
    /// This edge reads what every other edge seals, and they read what it seals (or it is
    /// the only edge with a secret).
    Agreed,
    /// Some edge seals with a secret this one does not read, or does not read this one's:
    /// sessions do not resume between them.
    Differs,
    /// No secret here, while other edges seal: their sessions cannot resume here.
    SealedElsewhere,
    /// No secret anywhere.
    NoSecret,
}

/// The resume-key secrets an edge announces in Redis, by fingerprint
/// ([`ResumeKeySeal::fingerprint`]): the one it seals with, and one it also reads during a
/// rotation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EdgeSecrets {
    /// The sealing secret's fingerprint (`None`: keys in clear).
    pub sealing: Option<String>,
    /// The accepted secret's.
    pub accepted: Option<String>,
}

impl EdgeSecrets {
    /// What `seal` announces.
    pub fn of(seal: Option<&ResumeKeySeal>) -> Self {
        Self {
            sealing: seal.map(|s| s.fingerprint().to_owned()),
            accepted: seal.and_then(|s| s.accepted_fingerprint().map(str::to_owned)),
        }
    }

    /// Whether this edge opens what one sealing with `fingerprint` writes.
    fn reads(&self, fingerprint: &str) -> bool {
        [&self.sealing, &self.accepted]
            .into_iter()
            .any(|f| f.as_deref() == Some(fingerprint))
    }

    /// The announcement's text: `<sealing or -> <accepted or ->`.
    fn encode(&self) -> String {
        let show = |f: &Option<String>| f.clone().unwrap_or_else(|| "-".into());
        format!("{} {}", show(&self.sealing), show(&self.accepted))
    }

    /// Reads [`EdgeSecrets::encode`]'s text (after the time stamp); `None` if it is not one.
    fn decode(text: &str) -> Option<Self> {
        let mut words = text.split(' ');
        let mut next = || match words.next()? {
            "-" => Some(None),
            f if f.len() == 32 && f.bytes().all(|b| b.is_ascii_hexdigit()) => {
                Some(Some(f.to_owned()))
            }
            _ => None,
        };
        let (sealing, accepted) = (next()?, next()?);
        words.next().is_none().then_some(Self { sealing, accepted })
    }

    /// How this edge stands with the other edges announcing `others`. Edges without a secret
    /// are told so by their own check ([`ResumeKeyCheck::SealedElsewhere`]).
    pub fn compare<'a>(&self, others: impl IntoIterator<Item = &'a EdgeSecrets>) -> ResumeKeyCheck {
        let mut sealed_elsewhere = false;
        for other in others {
            let Some(theirs) = &other.sealing else {
                continue;
            };
            sealed_elsewhere = true;
            if let Some(ours) = &self.sealing {
                if !self.reads(theirs) || !other.reads(ours) {
                    return ResumeKeyCheck::Differs;
                }
            }
        }
        match (&self.sealing, sealed_elsewhere) {
            (Some(_), _) => ResumeKeyCheck::Agreed,
            (None, true) => ResumeKeyCheck::SealedElsewhere,
            (None, false) => ResumeKeyCheck::NoSecret,
        }
    }
}

/// KEYS: the announcements (a hash: edge id -> "<ms> <sealing> <accepted>"). ARGV: this
/// edge's id, its announcement (without the time), the age in ms after which an
/// announcement is forgotten (its edge is gone), the hash's expiry in ms. Records this
/// edge's at Redis's clock, drops the stale ones and returns the others' (time stripped).
const ANNOUNCE_SECRETS_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
local all = redis.call('HGETALL', KEYS[1])
local others = {}
for i = 1, #all, 2 do
  local at, rest = string.match(all[i + 1], '^(%d+) (.*)$')
  if not at or now - tonumber(at) > tonumber(ARGV[3]) then
    redis.call('HDEL', KEYS[1], all[i])
  elseif all[i] ~= ARGV[1] then
    table.insert(others, rest)
  end
end
return others
"#;

/// The three Redis backends of one edge, sharing one connection.
#[derive(Debug, Clone)]
pub struct RedisStores {
    /// Warm-tier snapshots: `SessionLayer::snapshots`.
    pub snapshots: Arc<RedisSnapshotStore>,
    /// Single-login ownership: `SessionLayer::ownership`.
    pub ownership: Arc<RedisOwnership>,
    /// Presence and cross-edge push.
    pub presence: Arc<RedisPresence>,
    /// The announcement log (channels).
    pub announcements: Arc<RedisAnnouncementLog>,
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
            snapshots: Arc::new(RedisSnapshotStore::from_conn(conn.clone())),
            ownership: Arc::new(RedisOwnership::from_conn(conn.clone())),
            presence: Arc::new(RedisPresence::from_conn(conn.clone())),
            announcements: Arc::new(RedisAnnouncementLog::from_conn(conn)),
        })
    }

    /// Announces this edge's resume-key secrets (by fingerprint, [`EdgeSecrets`]) as
    /// `edge_id` in the hash `P:resume-keys`, and compares them with those the other edges
    /// announced within `fresh` (older announcements are of edges gone, and are dropped):
    /// edges that cannot open each other's sealed keys cannot resume each other's sessions.
    /// The edge repeats it while it runs, so a rotation's steps show as they roll out.
    pub async fn check_resume_key(
        &self,
        edge_id: &str,
        fresh: Duration,
    ) -> Result<ResumeKeyCheck, RedisError> {
        static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
        let conn = &self.ownership.conn;
        let ours = EdgeSecrets::of(conn.config.resume_key_seal.as_deref());
        let mut inv = SCRIPT
            .get_or_init(|| redis::Script::new(ANNOUNCE_SECRETS_LUA))
            .prepare_invoke();
        inv.key(format!("{}:resume-keys", conn.config.prefix))
            .arg(edge_id)
            .arg(ours.encode())
            .arg(conn::ms(fresh))
            .arg(conn::ms(fresh * 10));
        let others: Vec<String> = conn
            .run(|mut c| async move { inv.invoke_async(&mut c).await })
            .await?;
        let others: Vec<EdgeSecrets> = others
            .iter()
            .filter_map(|text| EdgeSecrets::decode(text))
            .collect();
        Ok(ours.compare(&others))
    }

    /// Notices dropped because a subscription's queue was full (kicks, cross-edge push
    /// requests and their replies): the counter behind `waygate_redis_pubsub_dropped_total`.
    pub fn pubsub_dropped(&self) -> prometheus_client::metrics::counter::Counter {
        self.ownership.conn.pubsub_dropped.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edge(sealing: Option<&str>, accepted: Option<&str>) -> EdgeSecrets {
        let fp = |c: &str| c.repeat(32);
        EdgeSecrets {
            sealing: sealing.map(fp),
            accepted: accepted.map(fp),
        }
    }

    /// Edges agree when each reads what the other seals: the same secret, or the steps of a
    /// rotation side by side (accept the new / seal the new and accept the old / the new
    /// only); they differ when one cannot read the other's; an edge without a secret is told
    /// when others seal.
    #[test]
    fn edges_agree_when_each_reads_what_the_other_seals() {
        let old = edge(Some("a"), None);
        let step1 = edge(Some("a"), Some("b"));
        let step2 = edge(Some("b"), Some("a"));
        let new = edge(Some("b"), None);
        let clear = edge(None, None);
        for (ours, others, want) in [
            (&old, vec![&old], ResumeKeyCheck::Agreed),
            (&old, vec![&step1], ResumeKeyCheck::Agreed),
            (&step1, vec![&old, &step2], ResumeKeyCheck::Agreed),
            (&step2, vec![&step1, &new], ResumeKeyCheck::Agreed),
            (&new, vec![&step2], ResumeKeyCheck::Agreed),
            (&old, vec![&step2], ResumeKeyCheck::Differs),
            (&step1, vec![&new], ResumeKeyCheck::Differs),
            (&new, vec![&old], ResumeKeyCheck::Differs),
            (&new, vec![&step2, &step1], ResumeKeyCheck::Differs),
            (&old, vec![], ResumeKeyCheck::Agreed),
            (&old, vec![&clear], ResumeKeyCheck::Agreed),
            (&clear, vec![&clear], ResumeKeyCheck::NoSecret),
            (&clear, vec![], ResumeKeyCheck::NoSecret),
            (&clear, vec![&clear, &new], ResumeKeyCheck::SealedElsewhere),
        ] {
            assert_eq!(
                ours.compare(others.iter().copied()),
                want,
                "{ours:?} {others:?}"
            );
        }
    }

    /// An announcement reads back as written; anything else is ignored, not trusted.
    #[test]
    fn announcements_read_back_and_junk_is_ignored() {
        for secrets in [
            edge(Some("a"), Some("b")),
            edge(Some("c"), None),
            edge(None, None),
        ] {
            assert_eq!(EdgeSecrets::decode(&secrets.encode()), Some(secrets));
        }
        for junk in ["", "-", "abc -", "- - ", &"g".repeat(32), "x y z"] {
            assert_eq!(EdgeSecrets::decode(junk), None, "{junk:?}");
        }
    }
}

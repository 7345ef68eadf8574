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
    /// This edge has the deployment's secret (or is the first with one).
    Agreed,
    /// Another secret than the deployment's: neither side resumes the other's sessions.
    Differs,
    /// No secret here, while the deployment seals: sealed sessions cannot resume here.
    SealedElsewhere,
    /// No secret anywhere yet.
    NoSecret,
}

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

    /// Compares this edge's resume-key secret with the deployment's, by fingerprint
    /// ([`ResumeKeySeal::fingerprint`], key `P:resume-key`, set by the first edge with a
    /// secret): edges with different secrets cannot resume each other's sessions, and one
    /// without cannot resume sealed sessions.
    pub async fn check_resume_key(&self) -> Result<ResumeKeyCheck, RedisError> {
        let conn = &self.ownership.conn;
        let key = format!("{}:resume-key", conn.config.prefix);
        let ours = conn
            .config
            .resume_key_seal
            .as_ref()
            .map(|s| s.fingerprint().to_owned());
        if let Some(fp) = &ours {
            // SET NX, then GET (SET NX GET needs Redis 7).
            let (key, fp) = (key.clone(), fp.clone());
            conn.run(|mut c| async move {
                redis::cmd("SET")
                    .arg(key)
                    .arg(fp)
                    .arg("NX")
                    .query_async::<Option<String>>(&mut c)
                    .await
            })
            .await?;
        }
        let stored: Option<String> = conn
            .run(|mut c| async move { redis::cmd("GET").arg(key).query_async(&mut c).await })
            .await?;
        Ok(match (ours, stored) {
            (None, None) => ResumeKeyCheck::NoSecret,
            (None, Some(_)) => ResumeKeyCheck::SealedElsewhere,
            (Some(a), Some(b)) if a == b => ResumeKeyCheck::Agreed,
            // Gone again meanwhile (flushed): nothing to disagree with.
            (Some(_), None) => ResumeKeyCheck::Agreed,
            (Some(_), Some(_)) => ResumeKeyCheck::Differs,
        })
    }

    /// Notices dropped because a subscription's queue was full (kicks, cross-edge push
    /// requests and their replies): the counter behind `waygate_redis_pubsub_dropped_total`.
    pub fn pubsub_dropped(&self) -> prometheus_client::metrics::counter::Counter {
        self.ownership.conn.pubsub_dropped.clone()
    }
}

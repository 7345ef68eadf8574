//! The edge's configuration: serde structs whose `Default` values are the embedded
//! defaults (loopback ports, generated dev certificate, in-memory stores, the built-in demo
//! route table), loaded from TOML with unknown keys refused by name, then validated.
//! `examples/edge.toml` documents every key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The largest client frame the edge accepts: a client's DATA travels to its backend in one
/// link FORWARD, whose frame limit is `DEFAULT_MAX_LINK_FRAME` (1 MiB); 1 KiB is left for the
/// FORWARD's own fields, so no accepted message can fail to reach its backend.
pub const MAX_CLIENT_FRAME: usize = waygate_protocol::link::DEFAULT_MAX_LINK_FRAME - 1024;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// TOML syntax, a wrong type or an unknown key (the message names it).
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong, with the key.
        message: String,
    },
    /// A value out of range or inconsistent with another.
    #[error("invalid config value `{key}`: {message}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// Why.
        message: String,
    },
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)))
}

/// One listener.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Whether the listener runs.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Address to bind (port 0 = any free port, reported at start).
    pub addr: SocketAddr,
}

fn yes() -> bool {
    true
}

impl ListenerConfig {
    fn on(a: &str) -> Self {
        Self {
            enabled: true,
            addr: addr(a),
        }
    }
}

/// The client listeners.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ListenersConfig {
    /// Plain TCP.
    pub tcp: ListenerConfig,
    /// TCP inside TLS.
    pub tls: ListenerConfig,
    /// WebSocket (ws).
    pub ws: ListenerConfig,
    /// WebSocket over TLS (wss).
    pub wss: ListenerConfig,
    /// QUIC.
    pub quic: ListenerConfig,
    /// KCP over UDP.
    pub kcp: ListenerConfig,
    /// ws and wss: the `Origin` values a browser's upgrade may carry, e.g.
    /// `["https://play.example.com"]` (exact, case-insensitive; HTTP 403 otherwise). A
    /// request without `Origin` (a native client) is always accepted. Empty: any origin.
    pub ws_allowed_origins: Vec<String>,
}

impl Default for ListenersConfig {
    fn default() -> Self {
        Self {
            tcp: ListenerConfig::on("127.0.0.1:7000"),
            tls: ListenerConfig::on("127.0.0.1:7001"),
            ws: ListenerConfig::on("127.0.0.1:7080"),
            wss: ListenerConfig::on("127.0.0.1:7443"),
            quic: ListenerConfig::on("127.0.0.1:7444"),
            kcp: ListenerConfig::on("127.0.0.1:7100"),
            ws_allowed_origins: Vec::new(),
        }
    }
}

/// TLS certificate for tls, wss and QUIC.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain. Unset (with `key`): a development CA and certificate are
    /// generated at start.
    pub cert: Option<PathBuf>,
    /// PEM private key.
    pub key: Option<PathBuf>,
    /// Extra names (DNS or IP) for the generated development certificate.
    pub dev_names: Vec<String>,
    /// Where to write the generated development CA's PEM for clients to trust.
    pub dev_ca_out: Option<PathBuf>,
}

/// Limits shared by all transports.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest client frame, bytes.
    pub max_frame_size: usize,
    /// Close a connection after this long without receiving anything, ms.
    pub idle_timeout_ms: u64,
    /// Deadline for TLS, upgrade, QUIC and KCP handshakes, ms.
    pub handshake_timeout_ms: u64,
    /// TLS (tls, wss) and the QUIC handshake must be done this long after the accept, ms
    /// (capped by `handshake_timeout_ms`).
    pub tls_timeout_ms: u64,
    /// The WebSocket upgrade (after TLS on wss) must be done this long after the accept,
    /// ms (capped by `handshake_timeout_ms`).
    pub upgrade_timeout_ms: u64,
    /// Kernel send buffer of each TCP, TLS and WebSocket connection (SO_SNDBUF, bytes;
    /// Linux doubles it): what a client that stops reading can hold in the kernel before the
    /// session's own queue and slow-consumer rule decide. 0: the kernel's autotuning.
    pub send_buffer_bytes: usize,
    /// WebSocket (ws, wss) connections: the most bytes one read takes from the socket,
    /// which an idle connection keeps allocated; larger messages take several reads.
    pub ws_read_buffer_bytes: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_frame_size: waygate_protocol::wire::DEFAULT_MAX_FRAME_SIZE,
            idle_timeout_ms: 30_000,
            handshake_timeout_ms: 10_000,
            tls_timeout_ms: 5_000,
            upgrade_timeout_ms: 7_000,
            send_buffer_bytes: 32 * 1024,
            ws_read_buffer_bytes: waygate_transport::ws::DEFAULT_READ_BUFFER,
        }
    }
}

/// Backend links.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LinksConfig {
    /// PUSH frames a backend may have in flight to this edge.
    pub push_credits: u32,
    /// Link heartbeat, ms.
    pub heartbeat_ms: u64,
    /// Retry-after given to clients when a backend is saturated, ms.
    pub busy_retry_after_ms: u32,
    /// A file holding the link secret shared with the backends (its first line, at least 16
    /// bytes; PROTOCOL.md §9.3). Also from the environment variable `WAYGATE_LINK_SECRET`.
    /// Required when a client listener is beyond loopback.
    pub secret_file: Option<PathBuf>,
    /// Link to backends without a secret although the edge listens beyond loopback (only
    /// on a closed network).
    pub insecure_no_secret: bool,
    /// Mutual TLS on backend links (PROTOCOL.md §9.3): the PEM CA the backends'
    /// certificates chain to (and this edge's). With `tls_cert_file` and `tls_key_file`,
    /// links are TLS and the edge presents its certificate; unset: plain TCP.
    pub tls_ca_file: Option<PathBuf>,
    /// This edge's PEM certificate chain for link TLS (leaf first).
    pub tls_cert_file: Option<PathBuf>,
    /// This edge's PEM private key for link TLS.
    pub tls_key_file: Option<PathBuf>,
    /// The name backends' certificates are verified against; unset: the backend's IP
    /// address (its certificate then needs that IP address as a subject alternative name).
    pub tls_server_name: Option<String>,
}

impl Default for LinksConfig {
    fn default() -> Self {
        Self {
            push_credits: 1024,
            heartbeat_ms: 2_000,
            busy_retry_after_ms: 200,
            secret_file: None,
            insecure_no_secret: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_server_name: None,
        }
    }
}

impl LinksConfig {
    /// The mutual-TLS files of the links, when all three are set (some but not all: an
    /// error naming the missing one).
    pub fn tls_files(&self) -> Result<Option<waygate_link::tls::LinkTlsFiles>, ConfigError> {
        match (&self.tls_ca_file, &self.tls_cert_file, &self.tls_key_file) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => Ok(Some(waygate_link::tls::LinkTlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            })),
            (ca, cert, _) => Err(ConfigError::Invalid {
                key: if ca.is_none() {
                    "links.tls_ca_file"
                } else if cert.is_none() {
                    "links.tls_cert_file"
                } else {
                    "links.tls_key_file"
                },
                message: "link TLS needs tls_ca_file, tls_cert_file and tls_key_file together"
                    .into(),
            }),
        }
    }

    /// The link secret: `WAYGATE_LINK_SECRET`, else the first line of `secret_file`.
    pub fn secret(&self) -> Result<Option<std::sync::Arc<[u8]>>, ConfigError> {
        waygate_link::load_link_secret(self.secret_file.as_deref()).map_err(|message| {
            ConfigError::Invalid {
                key: "links.secret_file",
                message,
            }
        })
    }
}

/// Session layer settings (S3–S5).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SessionSettings {
    /// How long a dropped session is kept for resume, seconds (S5).
    pub linger_secs: u64,
    /// PING interval advertised to clients, ms.
    pub heartbeat_ms: u64,
    /// Deadline from connection to WELCOME, ms.
    pub hello_timeout_ms: u64,
    /// Replay buffer: most unacknowledged downstream messages kept per session.
    pub replay_max_messages: usize,
    /// Replay buffer: most unacknowledged downstream bytes kept per session.
    pub replay_max_bytes: usize,
    /// Capacity of each session's downstream queue (messages).
    pub outbound_capacity: usize,
    /// Share of sessions whose debug and trace events are logged (0.0 to 1.0; a session's
    /// info, warnings and errors always are), O2.
    pub trace_sample_rate: f64,
}

impl Default for SessionSettings {
    fn default() -> Self {
        Self {
            linger_secs: 15 * 60,
            heartbeat_ms: 10_000,
            hello_timeout_ms: 10_000,
            replay_max_messages: 1024,
            replay_max_bytes: 1024 * 1024,
            outbound_capacity: 1024,
            trace_sample_rate: 1.0,
        }
    }
}

/// One HMAC key of the login service (S2).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AuthKey {
    /// Key id carried in tokens (rotation: add the new id, then remove the old one).
    pub id: u32,
    /// The shared secret (UTF-8; use 32+ random bytes in production).
    pub secret: String,
}

/// Which tokens the edge accepts.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AuthKind {
    /// waygate's own HMAC tokens (PROTOCOL.md 7.2), keys in `auth.keys`.
    #[default]
    Hmac,
    /// JWTs (HS256, RS256, EdDSA, ...) verified with the keys of `auth.jwt.jwks_file`.
    Jwt,
}

/// JWT verification (`auth.kind = "jwt"`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct JwtConfig {
    /// The JWKS file with the verification keys; re-read when it changes (key rotation
    /// without a restart).
    pub jwks_file: Option<PathBuf>,
    /// Accepted `aud` values; empty = tokens must carry none.
    pub audiences: Vec<String>,
    /// The claim holding the player id.
    pub player_claim: String,
}

impl Default for JwtConfig {
    fn default() -> Self {
        Self {
            jwks_file: None,
            audiences: Vec::new(),
            player_claim: "sub".into(),
        }
    }
}

/// Token authentication (S2).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// `hmac` (waygate tokens, `keys`) or `jwt` (`jwt.jwks_file`).
    pub kind: AuthKind,
    /// JWT settings (with `issuers` and `leeway_secs`).
    pub jwt: JwtConfig,
    /// Accepted keys. The embedded default is a development key: replace it.
    pub keys: Vec<AuthKey>,
    /// A TOML file of `[[keys]]` (`id`, `secret`, as `auth.keys`) used instead of `keys` and
    /// re-read when it changes, so keys rotate without a restart (a broken file keeps the
    /// keys in force). Unset: `keys`.
    pub keys_file: Option<PathBuf>,
    /// Accepted issuers; empty = any.
    pub issuers: Vec<String>,
    /// HMAC tokens: accepted audiences (the token's extension 0x02); empty = any, tokens
    /// with no audience included. JWTs use `jwt.audiences`.
    pub audiences: Vec<String>,
    /// Clock-skew leeway for issued-at and expiry, seconds.
    pub leeway_secs: u64,
    /// Longest validity a token may have, seconds: from its issue time (or from now when it
    /// has none) to its expiry; a longer one is refused `auth_rejected`. 0 = no limit.
    pub max_token_lifetime_secs: u64,
    /// Accept the public development key although a client listener is not on loopback.
    /// Only for a closed test network: anyone who reads the repository can mint tokens for
    /// any player with it. Default false: such an edge refuses to start.
    pub insecure_dev_key: bool,
}

impl AuthConfig {
    /// Whether a configured key is the public development key.
    pub fn uses_dev_key(&self) -> bool {
        self.kind == AuthKind::Hmac
            && self.keys_file.is_none()
            && self.keys.iter().any(|k| k.secret == DEV_KEY_SECRET)
    }
}

/// The environment variable holding the edges' shared resume-key secret
/// (`cluster.redis_resume_key_file`).
pub const REDIS_RESUME_KEY_ENV: &str = "WAYGATE_REDIS_RESUME_KEY";

/// The environment variable holding a second resume-key secret the edge also reads during
/// a rotation (`cluster.redis_resume_key_accepted_file`).
pub const REDIS_RESUME_KEY_ACCEPTED_ENV: &str = "WAYGATE_REDIS_RESUME_KEY_ACCEPTED";

/// The shortest resume-key secret accepted, bytes.
pub const MIN_REDIS_RESUME_KEY_LEN: usize = 32;

/// The development key id and secret of the embedded default (`waygate token` uses them).
pub const DEV_KEY_ID: u32 = 1;
/// See [`DEV_KEY_ID`].
pub const DEV_KEY_SECRET: &str = "waygate-development-key-change-me";

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            kind: AuthKind::Hmac,
            jwt: JwtConfig::default(),
            keys: vec![AuthKey {
                id: DEV_KEY_ID,
                secret: DEV_KEY_SECRET.into(),
            }],
            issuers: Vec::new(),
            audiences: Vec::new(),
            leeway_secs: 30,
            max_token_lifetime_secs: 86_400,
            insecure_dev_key: false,
            keys_file: None,
        }
    }
}

/// Where the route table comes from (R9).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingConfig {
    /// A TOML or JSON route table file, hot-reloaded. Unset: the built-in demo table
    /// (player and room services on three local demo backends).
    pub table: Option<PathBuf>,
    /// Where the last good table is persisted (used at start if `table` is broken).
    pub persist: Option<PathBuf>,
    /// How often the table file is checked, ms.
    pub poll_ms: u64,
    /// Players per second released from removed or drained instances (R4).
    pub migration_rate: f64,
    /// Backend heartbeats missed before an instance counts as down (R7).
    pub missed_heartbeats: u32,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            table: None,
            persist: None,
            poll_ms: 1_000,
            migration_rate: 100.0,
            missed_heartbeats: 3,
        }
    }
}

/// Drain (O4).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DrainConfig {
    /// Where MIGRATE sends clients (`tcp://host:port` ...); empty = any edge.
    pub target: String,
    /// Clients have this long to leave, ms; the edge exits at the latest then.
    pub deadline_ms: u64,
    /// Retry-after given to new connections while draining, ms.
    pub retry_after_ms: u32,
}

impl Default for DrainConfig {
    fn default() -> Self {
        Self {
            target: String::new(),
            deadline_ms: 30_000,
            retry_after_ms: 1_000,
        }
    }
}

/// Backpressure stages (SPEC B1–B5).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct BackpressureConfig {
    /// New connections per second accepted by the whole edge (B1).
    pub accept_per_sec: u64,
    /// Burst of the edge's accept bucket.
    pub accept_burst: u64,
    /// New connections per second per source address (IPv6: per /64).
    pub accept_per_source_per_sec: u64,
    /// Burst of each source's bucket.
    pub accept_per_source_burst: u64,
    /// Most connections not yet past WELCOME at once (every transport: from the accept to the
    /// WELCOME; KCP from its CONNECT).
    pub max_handshakes: u64,
    /// Frames per second read from one player (B2; from one connection before WELCOME). Over
    /// it the edge stops reading the connection until tokens return (the client is slowed,
    /// nothing is dropped); the player's buckets are kept across reconnects and logins.
    pub inbound_msgs_per_sec: u64,
    /// Burst of the message bucket.
    pub inbound_msg_burst: u64,
    /// Upstream bytes per second per player (per connection before WELCOME).
    pub inbound_bytes_per_sec: u64,
    /// Burst of the byte bucket.
    pub inbound_byte_burst: u64,
    /// A downstream frame not written within this time closes the client as SLOW_CONSUMER
    /// (the session lingers for resume), ms (B3).
    pub send_deadline_ms: u64,
    /// Hard cap on sessions (B5); 0 = half the process's file-descriptor limit.
    pub max_sessions: u64,
    /// Memory budget for the overload levels, MiB (B5); 0 = no memory signal.
    pub memory_budget_mb: u64,
    /// Event-loop lag at which the edge refuses new connections (overload level 3), ms: a
    /// loop this late on every timer tick for a second is saturated. Half of it refuses new
    /// sessions (level 2), a quarter sheds best-effort pushes (level 1). 0 = no lag signal
    /// (B5).
    pub refuse_at_loop_lag_ms: u64,
}

impl Default for BackpressureConfig {
    fn default() -> Self {
        Self {
            accept_per_sec: 2_000,
            accept_burst: 500,
            accept_per_source_per_sec: 200,
            accept_per_source_burst: 400,
            max_handshakes: 4_096,
            inbound_msgs_per_sec: 100,
            inbound_msg_burst: 200,
            inbound_bytes_per_sec: 256 * 1024,
            inbound_byte_burst: 512 * 1024,
            send_deadline_ms: 5_000,
            max_sessions: 0,
            memory_budget_mb: 0,
            refuse_at_loop_lag_ms: waygate_backpressure::DEFAULT_REFUSE_LAG_MS,
        }
    }
}

/// Admin HTTP (health, metrics, routes, sessions, drain, kick).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Whether the admin server runs.
    pub enabled: bool,
    /// Address to bind.
    pub addr: SocketAddr,
    /// A file holding the admin bearer token (its first line). Also from the environment
    /// variable `WAYGATE_ADMIN_TOKEN`. Without a token the admin server may only listen on
    /// loopback.
    pub token_file: Option<PathBuf>,
    /// Whether reads (`/metrics`, `/routes`, `/sessions`...) need the token too (always
    /// when `addr` is not loopback; `/healthz` and `/readyz` never do).
    pub protect_reads: bool,
    /// Host names accepted in requests besides the loopback ones and the bound address
    /// (DNS-rebinding defence), e.g. the name Prometheus scrapes the edge by.
    pub allowed_hosts: Vec<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            addr: addr("127.0.0.1:9100"),
            token_file: None,
            protect_reads: false,
            allowed_hosts: Vec::new(),
        }
    }
}

impl AdminConfig {
    /// The admin token: `WAYGATE_ADMIN_TOKEN`, else the first line of `token_file`; at least
    /// 16 characters either way.
    pub fn token(&self) -> Result<Option<String>, ConfigError> {
        let placeholder = || ConfigError::Invalid {
            key: "admin.token_file",
            message: "the token is the deploy kit's placeholder: put a random one there".into(),
        };
        if let Ok(t) = std::env::var("WAYGATE_ADMIN_TOKEN") {
            let t = t.trim();
            if waygate_link::is_placeholder_secret(t) {
                return Err(placeholder());
            }
            if t.len() >= 16 {
                return Ok(Some(t.to_owned()));
            }
            if !t.is_empty() {
                return Err(ConfigError::Invalid {
                    key: "WAYGATE_ADMIN_TOKEN",
                    message: "the token must be at least 16 characters".into(),
                });
            }
        }
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        let token = text.lines().next().unwrap_or("").trim().to_owned();
        if waygate_link::is_placeholder_secret(&token) {
            return Err(placeholder());
        }
        if token.len() < 16 {
            return Err(ConfigError::Invalid {
                key: "admin.token_file",
                message: "the token must be at least 16 characters".into(),
            });
        }
        Ok(Some(token))
    }
}

/// Several edges (issue 9): etcd as the control plane, Redis for ownership, warm snapshots
/// and presence. Both empty: one edge with the file/embedded table and in-memory stores.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// etcd client URLs (`http://host:2379`); empty: the route table comes from
    /// `routing.table` (or the embedded default). `routing.persist` keeps the last good table.
    pub etcd_endpoints: Vec<String>,
    /// The etcd user the edge signs in as (etcd's authentication); empty: none. Required
    /// when an endpoint is beyond loopback (see `insecure_no_auth`).
    pub etcd_username: String,
    /// A file whose first line is that user's password. Also from the environment variable
    /// `WAYGATE_ETCD_PASSWORD`.
    pub etcd_password_file: Option<PathBuf>,
    /// PEM certificates `https://` etcd endpoints must chain to (a private CA); unset: the
    /// system's trusted roots. TLS is chosen by the endpoints' scheme (all `https://`, or
    /// none).
    pub etcd_tls_ca_file: Option<PathBuf>,
    /// PEM certificate the edge presents to etcd (etcd's `--client-cert-auth`), with
    /// `etcd_tls_key_file`; unset: none.
    pub etcd_tls_cert_file: Option<PathBuf>,
    /// PEM private key of `etcd_tls_cert_file`.
    pub etcd_tls_key_file: Option<PathBuf>,
    /// Use an etcd endpoint or a Redis server beyond loopback without authentication (only on
    /// a closed network). By default the edge refuses to start that way: anyone reaching
    /// Redis could read the sessions' resume keys and take over players' sessions, anyone
    /// reaching etcd could rewrite the route table.
    pub insecure_no_auth: bool,
    /// etcd key prefix (tables, instances, switches, edges).
    pub etcd_prefix: String,
    /// How long a vanished registration stays in the table (flap damping, R7), ms.
    pub damping_ms: u64,
    /// Lease TTL of this edge's registration, ms.
    pub lease_ttl_ms: u64,
    /// How often this edge reports its load (and renews its lease), ms.
    pub report_ms: u64,
    /// Address clients use to reach this edge (`tcp://host:port`); registered in etcd and
    /// used as the MIGRATE target by other edges. Empty: the bound TCP listener.
    pub advertise: String,
    /// `redis://host:port/db`; empty: in-memory stores (one edge), unless `redis_cluster`.
    pub redis_url: String,
    /// Redis Cluster seed nodes (`redis://host:port`), instead of `redis_url`; the edge
    /// learns the slot map from them and follows failovers.
    pub redis_cluster: Vec<String>,
    /// Redis Sentinel URLs (`redis://host:26379`), instead of `redis_url`: the edge asks
    /// them where the primary of `redis_sentinel_master` is, and again after a failover.
    /// `rediss://` sentinels (all or none) are reached over TLS, and so is the primary
    /// they name (its certificate must name the address they announce).
    pub redis_sentinels: Vec<String>,
    /// The master name the sentinels monitor (with `redis_sentinels`).
    pub redis_sentinel_master: String,
    /// ACL user for the primary the sentinels name; empty: the default user.
    pub redis_sentinel_master_username: String,
    /// Password for the primary the sentinels name (`requirepass`); empty: no AUTH. The
    /// sentinels' own credentials go in their URLs.
    pub redis_sentinel_master_password: String,
    /// PEM certificates `rediss://` servers must chain to (a private CA); unset: the
    /// system's trusted roots. TLS is chosen by the URL scheme (`rediss://`: single Redis,
    /// Redis Cluster, or sentinels with the primary they name).
    pub redis_tls_ca_file: Option<PathBuf>,
    /// A secret every edge of the deployment shares (first line, at least 32 bytes; or env
    /// `WAYGATE_REDIS_RESUME_KEY`): the resume keys in Redis snapshots are stored sealed
    /// with it, so a Redis reader cannot take sessions over. Required when Redis is beyond
    /// loopback (unless `insecure_no_auth`).
    pub redis_resume_key_file: Option<PathBuf>,
    /// During a rotation of that secret, a second one whose sealed keys this edge also
    /// reads (first line, at least 32 bytes; or env `WAYGATE_REDIS_RESUME_KEY_ACCEPTED`).
    /// Steps, each rolled out to every edge: accept the new secret (sealing with the old);
    /// seal with the new one and accept the old; after the linger time, drop the old. Only
    /// with `redis_resume_key_file`.
    pub redis_resume_key_accepted_file: Option<PathBuf>,
    /// Redis key and channel prefix.
    pub redis_prefix: String,
    /// Write every session's snapshot through to Redis before the client sees new state
    /// (durability against kill -9; see ARCHITECTURE.md). Only with Redis.
    pub write_through: bool,
    /// Hard migration on drain: upstream is held this long before MIGRATE so replies in
    /// flight land (and become durable) here first, ms.
    pub quiesce_ms: u64,
    /// Ownership and presence re-assert sweep, ms (also right after Redis recovers).
    pub reassert_ms: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            etcd_endpoints: Vec::new(),
            etcd_username: String::new(),
            etcd_password_file: None,
            etcd_tls_ca_file: None,
            etcd_tls_cert_file: None,
            etcd_tls_key_file: None,
            insecure_no_auth: false,
            etcd_prefix: "/waygate".into(),
            damping_ms: 10_000,
            lease_ttl_ms: 6_000,
            report_ms: 2_000,
            advertise: String::new(),
            redis_url: String::new(),
            redis_cluster: Vec::new(),
            redis_sentinels: Vec::new(),
            redis_sentinel_master: "mymaster".into(),
            redis_sentinel_master_username: String::new(),
            redis_sentinel_master_password: String::new(),
            redis_tls_ca_file: None,
            redis_resume_key_file: None,
            redis_resume_key_accepted_file: None,
            redis_prefix: "waygate".into(),
            write_through: true,
            quiesce_ms: 300,
            reassert_ms: 30_000,
        }
    }
}

impl ClusterConfig {
    /// The etcd user and password the edge signs in with (`etcd_username`, with
    /// `etcd_password_file` or `WAYGATE_ETCD_PASSWORD`); `None` without a user.
    pub fn etcd_credentials(
        &self,
    ) -> Result<Option<waygate_routing_etcd::EtcdCredentials>, ConfigError> {
        self.etcd_credentials_with(
            std::env::var(waygate_routing_etcd::ETCD_PASSWORD_ENV)
                .ok()
                .as_deref(),
        )
    }

    /// [`etcd_credentials`](Self::etcd_credentials) with the environment's password given.
    fn etcd_credentials_with(
        &self,
        env_password: Option<&str>,
    ) -> Result<Option<waygate_routing_etcd::EtcdCredentials>, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            key: "cluster.etcd_password_file",
            message,
        };
        let credentials = waygate_routing_etcd::EtcdCredentials::load_with(
            &self.etcd_username,
            self.etcd_password_file.as_deref(),
            env_password,
        )
        .map_err(|e| invalid(e.to_string()))?;
        if credentials
            .as_ref()
            .is_some_and(|c| waygate_link::is_placeholder_secret(&c.password))
        {
            return Err(invalid(
                "the etcd password is still the deploy kit's placeholder".into(),
            ));
        }
        Ok(credentials)
    }

    /// How the edge reaches etcd: its user (`etcd_credentials`) and TLS (`etcd_tls_*`,
    /// read now) for `https://` endpoints.
    pub fn etcd_access(&self) -> Result<waygate_routing_etcd::EtcdAccess, ConfigError> {
        let ca_pem = read_file("cluster.etcd_tls_ca_file", &self.etcd_tls_ca_file)?;
        let cert = read_file("cluster.etcd_tls_cert_file", &self.etcd_tls_cert_file)?;
        let key = read_file("cluster.etcd_tls_key_file", &self.etcd_tls_key_file)?;
        Ok(waygate_routing_etcd::EtcdAccess {
            credentials: self.etcd_credentials()?,
            // Both or neither: `check_etcd_tls`.
            tls: waygate_routing_etcd::EtcdTls {
                ca_pem,
                identity: cert.zip(key),
            },
        })
    }

    /// The etcd endpoints' TLS settings agree: all `https://` or none, certificates only
    /// with `https://`, a client certificate with its key.
    fn check_etcd_tls(&self) -> Result<(), ConfigError> {
        let tls = waygate_routing_etcd::endpoints_use_tls(&self.etcd_endpoints).map_err(|e| {
            ConfigError::Invalid {
                key: "cluster.etcd_endpoints",
                message: e.to_string(),
            }
        })?;
        let files = [
            ("cluster.etcd_tls_ca_file", &self.etcd_tls_ca_file),
            ("cluster.etcd_tls_cert_file", &self.etcd_tls_cert_file),
            ("cluster.etcd_tls_key_file", &self.etcd_tls_key_file),
        ];
        if let Some((key, _)) = files.iter().find(|(_, f)| f.is_some()).filter(|_| !tls) {
            return Err(ConfigError::Invalid {
                key,
                message: "etcd TLS settings need https:// etcd endpoints".into(),
            });
        }
        if self.etcd_tls_cert_file.is_some() != self.etcd_tls_key_file.is_some() {
            return Err(ConfigError::Invalid {
                key: "cluster.etcd_tls_key_file",
                message: "a client certificate needs both etcd_tls_cert_file and \
                          etcd_tls_key_file"
                    .into(),
            });
        }
        Ok(())
    }

    /// The sentinels are all `rediss://` or none: the primary they name is reached over
    /// TLS with them, so a mix would leave it unclear (and one sentinel in clear could
    /// name a primary to an eavesdropper).
    fn check_sentinel_tls(&self) -> Result<(), ConfigError> {
        let tls = self
            .redis_sentinels
            .iter()
            .filter(|u| crate::cluster::redis::url_uses_tls(u))
            .count();
        if tls != 0 && tls != self.redis_sentinels.len() {
            return Err(ConfigError::Invalid {
                key: "cluster.redis_sentinels",
                message: "mixed redis:// and rediss:// sentinels: all use TLS (and with \
                          them the primary they name) or none"
                    .into(),
            });
        }
        Ok(())
    }

    /// The edges' shared resume-key secret: [`REDIS_RESUME_KEY_ENV`] when set, else the
    /// first line of `redis_resume_key_file`, else none.
    pub fn redis_resume_key(&self) -> Result<Option<std::sync::Arc<[u8]>>, ConfigError> {
        waygate_link::load_secret(
            "Redis resume-key secret",
            REDIS_RESUME_KEY_ENV,
            self.redis_resume_key_file.as_deref(),
            MIN_REDIS_RESUME_KEY_LEN,
        )
        .map_err(|message| ConfigError::Invalid {
            key: "cluster.redis_resume_key_file",
            message,
        })
    }

    /// The second secret read during a rotation: [`REDIS_RESUME_KEY_ACCEPTED_ENV`] when set,
    /// else the first line of `redis_resume_key_accepted_file`, else none. An error without
    /// a sealing secret (`sealing`, as [`redis_resume_key`](Self::redis_resume_key) read
    /// it), or when it is the sealing secret.
    fn redis_resume_key_accepted(
        &self,
        sealing: Option<&[u8]>,
    ) -> Result<Option<std::sync::Arc<[u8]>>, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            key: "cluster.redis_resume_key_accepted_file",
            message,
        };
        let Some(accepted) = waygate_link::load_secret(
            "Redis resume-key secret accepted during a rotation",
            REDIS_RESUME_KEY_ACCEPTED_ENV,
            self.redis_resume_key_accepted_file.as_deref(),
            MIN_REDIS_RESUME_KEY_LEN,
        )
        .map_err(invalid)?
        else {
            return Ok(None);
        };
        match sealing {
            None => Err(invalid(
                "an accepted resume-key secret is for a rotation of the sealing one: set \
                 cluster.redis_resume_key_file (or WAYGATE_REDIS_RESUME_KEY) too"
                    .into(),
            )),
            Some(sealing) if sealing == &accepted[..] => Err(invalid(
                "the accepted resume-key secret is the sealing one (cluster.redis_resume_key_file): \
                 during a rotation one of them is the new secret, the other the old"
                    .into(),
            )),
            Some(_) => Ok(Some(accepted)),
        }
    }

    /// The resume-key seal of this edge's Redis records: the sealing secret, with the
    /// accepted one during a rotation (`None` without a secret). Each secret is read once.
    pub fn redis_resume_key_seal(
        &self,
    ) -> Result<Option<crate::cluster::redis::ResumeKeySeal>, ConfigError> {
        use crate::cluster::redis::ResumeKeySeal;
        let sealing = self.redis_resume_key()?;
        Ok(
            match (
                sealing.as_deref(),
                self.redis_resume_key_accepted(sealing.as_deref())?,
            ) {
                (Some(sealing), Some(accepted)) => {
                    Some(ResumeKeySeal::rotating(sealing, &accepted))
                }
                (Some(sealing), None) => Some(ResumeKeySeal::new(sealing)),
                (None, _) => None,
            },
        )
    }

    /// The PEM of `redis_tls_ca_file`, read now (`None` when unset).
    pub fn redis_tls_roots(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        read_file("cluster.redis_tls_ca_file", &self.redis_tls_ca_file)
    }

    /// Redis URLs beyond loopback that are not TLS (`redis://`): their traffic (snapshots
    /// with what resume proofs are checked against, the AUTH password) crosses the network
    /// in clear. The edge warns of them at start.
    pub fn plaintext_redis_beyond_loopback(&self) -> Vec<String> {
        self.redis_urls()
            .chain(self.redis_sentinel_urls())
            .filter(|(key, url)| {
                !crate::cluster::redis::url_uses_tls(url)
                    && redis_target(key, url).is_ok_and(|(local, _)| !local)
            })
            .map(|(_, url)| redact_redis_url(url))
            .collect()
    }

    /// The Redis URLs the edge stores in (`redis_url`, `redis_cluster`), each with its key.
    fn redis_urls(&self) -> impl Iterator<Item = (&'static str, &String)> + Clone {
        std::iter::once(("cluster.redis_url", &self.redis_url))
            .filter(|(_, u)| !u.is_empty())
            .chain(
                self.redis_cluster
                    .iter()
                    .map(|u| ("cluster.redis_cluster", u)),
            )
    }

    /// The Redis Sentinel URLs, each with its key.
    fn redis_sentinel_urls(&self) -> impl Iterator<Item = (&'static str, &String)> + Clone {
        self.redis_sentinels
            .iter()
            .map(|u| ("cluster.redis_sentinels", u))
    }

    /// Refuses etcd or Redis beyond loopback without authentication (unless
    /// `insecure_no_auth`), and Redis passwords left at the deploy kit's placeholder.
    fn check_authentication(&self) -> Result<(), ConfigError> {
        let closed_network = "Only on a closed network: cluster.insecure_no_auth = true";
        let (redis_urls, sentinels) = (self.redis_urls(), self.redis_sentinel_urls());
        let redis_urls_all = redis_urls.clone().chain(sentinels.clone());
        let placeholder = |key| ConfigError::Invalid {
            key,
            message: "a Redis password is still the deploy kit's placeholder".into(),
        };
        for (key, url) in redis_urls_all.clone() {
            if redis_target(key, url)?
                .1
                .is_some_and(|p| waygate_link::is_placeholder_secret(&p))
            {
                return Err(placeholder(key));
            }
        }
        if waygate_link::is_placeholder_secret(&self.redis_sentinel_master_password) {
            return Err(placeholder("cluster.redis_sentinel_master_password"));
        }
        if self.insecure_no_auth {
            return Ok(());
        }
        for (key, url) in redis_urls {
            let (local, password) = redis_target(key, url)?;
            if !local && password.is_none() {
                return Err(ConfigError::Invalid {
                    key,
                    message: format!(
                        "Redis at {} is beyond loopback and has no password: anyone reaching \
                         it could read the sessions' resume keys and take players' sessions \
                         over. Put the password in the URL (redis://:PASSWORD@host:6379, or \
                         redis://USER:PASSWORD@host:6379 with an ACL user). {closed_network}",
                        redact_redis_url(url)
                    ),
                });
            }
        }
        let resume_key = self.redis_resume_key_seal()?;
        let beyond = redis_urls_all
            .clone()
            .find(|(key, url)| redis_target(key, url).is_ok_and(|(local, _)| !local));
        if let (Some((key, url)), None) = (beyond, &resume_key) {
            return Err(ConfigError::Invalid {
                key: "cluster.redis_resume_key_file",
                message: format!(
                    "Redis ({key} {}) is beyond loopback and the edges share no resume-key \
                     secret: anyone who can read Redis could take sessions over with the \
                     resume keys in their snapshots. Give every edge the same secret \
                     (cluster.redis_resume_key_file, or WAYGATE_REDIS_RESUME_KEY; e.g. \
                     `openssl rand -hex 32`). {closed_network}",
                    redact_redis_url(url)
                ),
            });
        }
        if self.redis_sentinel_master_password.is_empty() {
            for (key, url) in sentinels {
                if !redis_target(key, url)?.0 {
                    return Err(ConfigError::Invalid {
                        key: "cluster.redis_sentinel_master_password",
                        message: format!(
                            "the sentinel {} is beyond loopback and the primary it names has \
                             no password. {closed_network}",
                            redact_redis_url(url)
                        ),
                    });
                }
            }
        }
        if self.etcd_username.trim().is_empty() {
            if let Some(open) = self.etcd_endpoints.iter().find(|e| !etcd_on_loopback(e)) {
                return Err(ConfigError::Invalid {
                    key: "cluster.etcd_username",
                    message: format!(
                        "etcd at {open} is beyond loopback and the edge signs in as no user: \
                         anyone reaching it could rewrite the route table. Enable etcd's \
                         authentication and set cluster.etcd_username with \
                         cluster.etcd_password_file (or WAYGATE_ETCD_PASSWORD). \
                         {closed_network}"
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The contents of the file a setting names (`None` when unset); an unreadable one is an
/// error naming the setting and the file.
fn read_file(key: &'static str, path: &Option<PathBuf>) -> Result<Option<Vec<u8>>, ConfigError> {
    path.as_deref()
        .map(|p| {
            std::fs::read(p).map_err(|e| ConfigError::Invalid {
                key,
                message: format!("{}: {e}", p.display()),
            })
        })
        .transpose()
}

/// The etcd `endpoints` beyond loopback that are not TLS (`http://`, or no scheme): what
/// crosses the network to them, the etcd password included, is in clear. The edge, `waygate
/// backend` and `waygate login` warn of them at start.
pub fn plaintext_etcd_beyond_loopback(endpoints: &[String]) -> Vec<String> {
    endpoints
        .iter()
        .filter(|e| !waygate_routing_etcd::is_https_endpoint(e))
        .filter(|e| !etcd_on_loopback(e))
        .cloned()
        .collect()
}

/// Whether a Redis URL's server is on loopback (or a Unix socket), and its password; an
/// unreadable URL is an error naming `key`.
fn redis_target(key: &'static str, url: &str) -> Result<(bool, Option<String>), ConfigError> {
    use redis::{ConnectionAddr, IntoConnectionInfo};
    let info = url
        .into_connection_info()
        .map_err(|e| ConfigError::Invalid {
            key,
            message: format!("{}: {e}", redact_redis_url(url)),
        })?;
    let local = match info.addr() {
        ConnectionAddr::Tcp(host, _) | ConnectionAddr::TcpTls { host, .. } => {
            host_is_loopback(host)
        }
        _ => true,
    };
    let password = info
        .redis_settings()
        .password()
        .filter(|p| !p.is_empty())
        .map(str::to_owned);
    Ok((local, password))
}

/// A Redis URL without its password, for messages.
fn redact_redis_url(url: &str) -> String {
    match url.split_once("://").and_then(|(scheme, rest)| {
        // The authority ends at the first `/`; its user info at its last `@`.
        let authority = rest.split('/').next().unwrap_or(rest);
        authority
            .rsplit_once('@')
            .map(|(_, host)| format!("{scheme}://***@{host}{}", &rest[authority.len()..]))
    }) {
        Some(redacted) => redacted,
        None => url.to_owned(),
    }
}

/// Whether an etcd endpoint (`http://host:port`, `host:port`, `[v6]:port`) is on this
/// machine's loopback, read as the etcd client reads it (`http::Uri`): an endpoint with
/// user info (`http://localhost@10.0.0.5`) or one that does not parse is not.
fn etcd_on_loopback(endpoint: &str) -> bool {
    let uri = if endpoint.contains("://") {
        endpoint.parse::<axum::http::Uri>()
    } else {
        format!("http://{endpoint}").parse::<axum::http::Uri>()
    };
    match uri {
        Ok(uri) => uri
            .authority()
            .is_some_and(|a| !a.as_str().contains('@') && host_is_loopback(a.host())),
        Err(_) => false,
    }
}

/// Whether `host` (a name, or an IP literal with or without brackets) is this machine's
/// loopback.
fn host_is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// The whole edge configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct EdgeConfig {
    /// This edge's id (logs, backend links, ownership records).
    pub edge_id: String,
    /// Client listeners.
    pub listeners: ListenersConfig,
    /// TLS material.
    pub tls: TlsConfig,
    /// Transport limits.
    pub limits: LimitsConfig,
    /// KCP engine parameters and endpoint limits (preset "fast" by default).
    pub kcp: waygate_transport::kcp::KcpConfig,
    /// QUIC windows and keep-alive.
    pub quic: waygate_transport::quic::QuicConfig,
    /// Session layer.
    pub session: SessionSettings,
    /// Token authentication.
    pub auth: AuthConfig,
    /// Route table source.
    pub routing: RoutingConfig,
    /// Backend links.
    pub links: LinksConfig,
    /// Drain behaviour.
    pub drain: DrainConfig,
    /// Backpressure stages.
    pub backpressure: BackpressureConfig,
    /// Admin HTTP.
    pub admin: AdminConfig,
    /// Several edges: etcd and Redis.
    pub cluster: ClusterConfig,
    /// Channels: kinds, history, queues, caps (PROTOCOL.md §12).
    pub channels: waygate_channels::ChannelsConfig,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            edge_id: "edge-1".into(),
            listeners: ListenersConfig::default(),
            tls: TlsConfig::default(),
            limits: LimitsConfig::default(),
            kcp: waygate_transport::kcp::KcpConfig::default(),
            quic: waygate_transport::quic::QuicConfig::default(),
            session: SessionSettings::default(),
            auth: AuthConfig::default(),
            routing: RoutingConfig::default(),
            links: LinksConfig::default(),
            drain: DrainConfig::default(),
            backpressure: BackpressureConfig::default(),
            admin: AdminConfig::default(),
            cluster: ClusterConfig::default(),
            channels: waygate_channels::ChannelsConfig::default(),
        }
    }
}

impl EdgeConfig {
    /// Transport limits as the transports take them.
    pub fn conn_config(&self) -> waygate_transport::ConnConfig {
        waygate_transport::ConnConfig {
            max_frame_size: self.limits.max_frame_size,
            idle_timeout: Some(std::time::Duration::from_millis(
                self.limits.idle_timeout_ms,
            )),
            handshake_timeout: std::time::Duration::from_millis(self.limits.handshake_timeout_ms),
            allowed_origins: self.listeners.ws_allowed_origins.clone().into(),
            send_buffer: (self.limits.send_buffer_bytes > 0)
                .then_some(self.limits.send_buffer_bytes),
            ws_read_buffer: self.limits.ws_read_buffer_bytes,
            ..Default::default()
        }
    }

    /// Moves every listener and the admin server to port 0 on its configured IP (tests,
    /// several edges on one host).
    pub fn use_ephemeral_ports(&mut self) {
        let l = &mut self.listeners;
        for listener in [
            &mut l.tcp,
            &mut l.tls,
            &mut l.ws,
            &mut l.wss,
            &mut l.quic,
            &mut l.kcp,
        ] {
            listener.addr.set_port(0);
        }
        self.admin.addr.set_port(0);
    }

    /// Parses TOML text (unknown keys are errors naming the key) and validates it.
    pub fn from_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let config = Self::parse_toml(text, path)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses without [`EdgeConfig::validate`] (for a caller that applies overrides, e.g.
    /// command-line flags, and validates after them). Unknown keys are still refused.
    pub fn parse_toml(text: &str, path: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Reads and parses a TOML file without validating it (see [`EdgeConfig::parse_toml`]).
    pub fn load_unvalidated(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse_toml(&text, path)
    }

    /// Reads and parses a TOML file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// The first enabled client listener bound beyond loopback, as `kind (addr)`.
    pub fn exposed_listener(&self) -> Option<String> {
        self.exposed_among(&["tcp", "tls", "ws", "wss", "quic", "kcp"])
            .map(|(kind, c)| format!("{kind} ({})", c.addr))
    }

    /// Settings that are fine for a demo on loopback and weak beyond it, but that an
    /// operator may have chosen (warned of at start, not refused): the generated
    /// development certificate (a new CA at every start, known to no client), Redis without
    /// TLS, and plain KCP sessions (`kcp.packet_auth = "optional"`).
    pub fn loopback_only_warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if let (Some((kind, listener)), None) =
            (self.exposed_among(&["tls", "wss", "quic"]), &self.tls.cert)
        {
            warnings.push(format!(
                "the {kind} listener ({}) is beyond loopback with the development TLS \
                 certificate generated at start (a new CA at every start, trusted by no client \
                 unless given tls.dev_ca_out): set tls.cert and tls.key",
                listener.addr
            ));
        }
        for etcd in plaintext_etcd_beyond_loopback(&self.cluster.etcd_endpoints) {
            warnings.push(format!(
                "etcd at {etcd} is beyond loopback without TLS: the route table, the \
                 registrations and the etcd password cross the network in clear. Use \
                 https:// endpoints (cluster.etcd_tls_ca_file for a private CA)"
            ));
        }
        for redis in self.cluster.plaintext_redis_beyond_loopback() {
            warnings.push(format!(
                "Redis at {redis} is beyond loopback without TLS: session snapshots and the \
                 AUTH password cross the network in clear. Use rediss:// \
                 (cluster.redis_tls_ca_file for a private CA)"
            ));
        }
        if let Some((_, kcp)) = self
            .exposed_among(&["kcp"])
            .filter(|(_, c)| !self.kcp.packet_auth.required_at(c.addr))
        {
            warnings.push(format!(
                "the kcp listener ({}) is beyond loopback with kcp.packet_auth = \"optional\": \
                 KCP sessions without a connect token are plain (datagrams neither \
                 authenticated nor encrypted)",
                kcp.addr
            ));
        }
        warnings
    }

    /// The first enabled listener of `kinds` bound beyond loopback, with its kind.
    pub fn exposed_among(&self, kinds: &[&str]) -> Option<(&'static str, &ListenerConfig)> {
        let l = &self.listeners;
        [
            ("tcp", &l.tcp),
            ("tls", &l.tls),
            ("ws", &l.ws),
            ("wss", &l.wss),
            ("quic", &l.quic),
            ("kcp", &l.kcp),
        ]
        .into_iter()
        .find(|(kind, c)| kinds.contains(kind) && c.enabled && !c.addr.ip().is_loopback())
    }

    /// Checks ranges and consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let deployments = [
            !self.cluster.redis_url.is_empty(),
            !self.cluster.redis_cluster.is_empty(),
            !self.cluster.redis_sentinels.is_empty(),
        ];
        if deployments.iter().filter(|named| **named).count() > 1 {
            return Err(ConfigError::Invalid {
                key: if self.cluster.redis_sentinels.is_empty() {
                    "cluster.redis_cluster"
                } else {
                    "cluster.redis_sentinels"
                },
                message: "name one Redis (redis_url), a Redis Cluster (redis_cluster) or the \
                          sentinels of one (redis_sentinels), not several"
                    .into(),
            });
        }
        if !self.cluster.redis_sentinels.is_empty() && self.cluster.redis_sentinel_master.is_empty()
        {
            return Err(ConfigError::Invalid {
                key: "cluster.redis_sentinel_master",
                message: "the master name the sentinels monitor is needed with redis_sentinels"
                    .into(),
            });
        }
        if self.edge_id.is_empty() || self.edge_id.len() > 64 {
            return Err(ConfigError::Invalid {
                key: "edge_id",
                message: "must be 1 to 64 bytes".into(),
            });
        }
        if !(64..=MAX_CLIENT_FRAME).contains(&self.limits.max_frame_size) {
            return Err(ConfigError::Invalid {
                key: "limits.max_frame_size",
                message: format!(
                    "must be between 64 and {MAX_CLIENT_FRAME} bytes (a client frame must fit \
                     one backend link frame of {} bytes)",
                    waygate_protocol::link::DEFAULT_MAX_LINK_FRAME
                ),
            });
        }
        if !(64..=MAX_CLIENT_FRAME).contains(&self.limits.ws_read_buffer_bytes) {
            return Err(ConfigError::Invalid {
                key: "limits.ws_read_buffer_bytes",
                message: format!("must be between 64 and {MAX_CLIENT_FRAME} bytes"),
            });
        }
        if self.tls.cert.is_some() != self.tls.key.is_some() {
            return Err(ConfigError::Invalid {
                key: "tls.cert",
                message: "tls.cert and tls.key go together".into(),
            });
        }
        let l = &self.limits;
        if l.tls_timeout_ms == 0 || l.upgrade_timeout_ms < l.tls_timeout_ms {
            return Err(ConfigError::Invalid {
                key: "limits.tls_timeout_ms",
                message: "need 0 < tls_timeout_ms <= upgrade_timeout_ms (both are capped by \
                          handshake_timeout_ms)"
                    .into(),
            });
        }
        self.channels
            .validate()
            .map_err(|message| ConfigError::Invalid {
                key: "channels",
                message,
            })?;
        // Durations a clock must be able to add (a year: far beyond any sensible value).
        const YEAR_SECS: u64 = 365 * 24 * 3600;
        for (key, secs) in [
            ("session.linger_secs", self.session.linger_secs),
            (
                "channels.dedup_window_secs",
                self.channels.dedup_window_secs,
            ),
        ] {
            if secs > YEAR_SECS {
                return Err(ConfigError::Invalid {
                    key,
                    message: format!("must be at most {YEAR_SECS} s (a year)"),
                });
            }
        }
        if self.links.heartbeat_ms < 100 {
            // A link is declared dead after three missed heartbeats: 0 killed every link
            // at once while its writer spun on PINGs.
            return Err(ConfigError::Invalid {
                key: "links.heartbeat_ms",
                message: "must be at least 100 ms".into(),
            });
        }
        if self.channels.dedup_window_secs < self.session.linger_secs {
            // A client resends what the edge had not acknowledged when it resumes, up to
            // the linger after its link dropped; a backend publishes it again with the same
            // id (PROTOCOL.md §12.5). A window shorter than that publishes it twice.
            return Err(ConfigError::Invalid {
                key: "channels.dedup_window_secs",
                message: format!(
                    "{} s is shorter than session.linger_secs ({} s): a message resent on a \
                     resume would be published twice",
                    self.channels.dedup_window_secs, self.session.linger_secs
                ),
            });
        }
        for (kind, policy) in &self.channels.kinds {
            // A publication is one DATA frame: its body plus the event header must fit.
            let header = waygate_protocol::channel::MAX_EVENT_OVERHEAD;
            if policy.max_body.saturating_add(header) > self.limits.max_frame_size {
                return Err(ConfigError::Invalid {
                    key: "channels.kinds",
                    message: format!(
                        "{kind}: max_body {} does not fit a client frame of limits.max_frame_size \
                         {} with its {header}-byte header",
                        policy.max_body, self.limits.max_frame_size
                    ),
                });
            }
        }
        self.kcp
            .validate(self.limits.max_frame_size)
            .map_err(|e| ConfigError::Invalid {
                key: "kcp",
                message: e.to_string(),
            })?;
        if self.auth.kind == AuthKind::Hmac && self.auth.keys.is_empty() {
            return Err(ConfigError::Invalid {
                key: "auth.keys",
                message: "at least one key is needed".into(),
            });
        }
        let kcp = &self.listeners.kcp;
        if kcp.enabled
            && self.auth.kind == AuthKind::Jwt
            && self.kcp.packet_auth.required_at(kcp.addr)
        {
            // Sealed sessions open with connect tokens signed with `auth.keys` (PROTOCOL.md
            // §7.2.2, §8.9); a JWT edge has none, so it would refuse every CONNECT.
            return Err(ConfigError::Invalid {
                key: "kcp.packet_auth",
                message: format!(
                    "the kcp listener ({}) requires sealed sessions ({:?}; `auto` requires \
                     them beyond loopback), which open with connect tokens signed with \
                     auth.keys, and auth.kind = \"jwt\" has none: every CONNECT would be \
                     refused. Disable listeners.kcp, or set kcp.packet_auth = \"optional\" \
                     (plain KCP: datagrams neither authenticated nor encrypted)",
                    kcp.addr, self.kcp.packet_auth
                ),
            });
        }
        if self.auth.kind == AuthKind::Jwt && self.auth.jwt.jwks_file.is_none() {
            return Err(ConfigError::Invalid {
                key: "auth.jwt.jwks_file",
                message: "auth.kind = \"jwt\" needs a JWKS file".into(),
            });
        }
        if self.admin.enabled
            && !self.admin.addr.ip().is_loopback()
            && self.admin.token_file.is_none()
            && std::env::var("WAYGATE_ADMIN_TOKEN").map_or(true, |t| t.trim().is_empty())
        {
            return Err(ConfigError::Invalid {
                key: "admin.addr",
                message: format!(
                    "the admin server (drain, kick) would listen on {} without a token: set \
                     admin.token_file or WAYGATE_ADMIN_TOKEN, or bind it to loopback",
                    self.admin.addr
                ),
            });
        }
        if self
            .auth
            .keys
            .iter()
            .any(|k| waygate_link::is_placeholder_secret(&k.secret))
        {
            return Err(ConfigError::Invalid {
                key: "auth.keys",
                message: "a key is still the deploy kit's placeholder (anyone who read the \
                          repository knows it): put the output of `waygate keygen` there"
                    .into(),
            });
        }
        if self.auth.uses_dev_key() && !self.auth.insecure_dev_key {
            if let Some(exposed) = self.exposed_listener() {
                return Err(ConfigError::Invalid {
                    key: "auth.keys",
                    message: format!(
                        "the development key is public (it is printed in examples/edge.toml: \
                         anyone can mint a token for any player with it) and the {exposed} \
                         listener is not on loopback. Set your own key: `waygate keygen` \
                         prints an [[auth.keys]] entry to put in the config. Only on a closed \
                         test network: auth.insecure_dev_key = true (or --insecure-dev-key)"
                    ),
                });
            }
        }
        self.links.tls_files()?;
        if !self.links.insecure_no_secret
            && self.links.secret_file.is_none()
            && self.links.tls_ca_file.is_none()
            && std::env::var(waygate_link::LINK_SECRET_ENV).map_or(true, |t| t.trim().is_empty())
        {
            if let Some(exposed) = self.exposed_listener() {
                return Err(ConfigError::Invalid {
                    key: "links.secret_file",
                    message: format!(
                        "the {exposed} listener is not on loopback and backend links have no \
                         secret: anything that reaches a backend port could act as an edge. \
                         Share a secret of at least 16 bytes with the backends: \
                         links.secret_file (or WAYGATE_LINK_SECRET) here, --link-secret-file \
                         (or WAYGATE_LINK_SECRET) on `waygate backend`. Only on a closed \
                         network: links.insecure_no_secret = true"
                    ),
                });
            }
        }
        self.cluster.check_authentication()?;
        self.cluster.check_etcd_tls()?;
        self.cluster.check_sentinel_tls()?;
        if !(self.routing.migration_rate > 0.0 && self.routing.migration_rate.is_finite()) {
            return Err(ConfigError::Invalid {
                key: "routing.migration_rate",
                message: "must be a positive number".into(),
            });
        }
        if !(0.0..=1.0).contains(&self.session.trace_sample_rate) {
            return Err(ConfigError::Invalid {
                key: "session.trace_sample_rate",
                message: "must be between 0.0 and 1.0".into(),
            });
        }
        if self.session.replay_max_messages == 0 || self.session.outbound_capacity == 0 {
            return Err(ConfigError::Invalid {
                key: "session.replay_max_messages",
                message: "replay and outbound capacities must be at least 1".into(),
            });
        }
        let b = &self.backpressure;
        if b.accept_per_sec == 0
            || b.accept_burst == 0
            || b.accept_per_source_per_sec == 0
            || b.accept_per_source_burst == 0
            || b.inbound_msgs_per_sec == 0
            || b.inbound_bytes_per_sec == 0
            || b.max_handshakes == 0
        {
            return Err(ConfigError::Invalid {
                key: "backpressure",
                message: "rates, bursts and max_handshakes must be at least 1".into(),
            });
        }
        if (b.inbound_byte_burst as usize) < self.limits.max_frame_size {
            return Err(ConfigError::Invalid {
                key: "backpressure.inbound_byte_burst",
                message: "must be at least limits.max_frame_size (one largest frame)".into(),
            });
        }
        if self.links.push_credits == 0 {
            return Err(ConfigError::Invalid {
                key: "links.push_credits",
                message: "must be at least 1".into(),
            });
        }
        if self.cluster.report_ms == 0 || self.cluster.lease_ttl_ms <= self.cluster.report_ms {
            return Err(ConfigError::Invalid {
                key: "cluster.lease_ttl_ms",
                message: "must be longer than cluster.report_ms (> 0)".into(),
            });
        }
        if self.cluster.reassert_ms == 0 {
            return Err(ConfigError::Invalid {
                key: "cluster.reassert_ms",
                message: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_redis_or_a_redis_cluster_not_both() {
        let mut c = EdgeConfig::default();
        c.cluster.redis_cluster = vec!["redis://127.0.0.1:7000".into()];
        c.validate().expect("a cluster alone");
        c.cluster.redis_url = "redis://127.0.0.1:6379".into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cluster.redis_cluster"), "{err}");
    }

    #[test]
    fn sentinels_alone_and_with_a_master_name() {
        let mut c = EdgeConfig::default();
        c.cluster.redis_sentinels = vec!["redis://127.0.0.1:26379".into()];
        c.validate().expect("sentinels alone, default master name");
        c.cluster.redis_sentinel_master = String::new();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cluster.redis_sentinel_master"), "{err}");
        c.cluster.redis_sentinel_master = "games".into();
        c.cluster.redis_url = "redis://127.0.0.1:6379".into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cluster.redis_sentinels"), "{err}");
    }

    /// The public development key works on loopback only; beyond it the edge refuses to
    /// start and says how to set a key, unless the operator explicitly asks for it.
    #[test]
    fn the_dev_key_is_refused_beyond_loopback() {
        let mut c = EdgeConfig::default();
        c.links.secret_file = Some("/etc/waygate/link-secret".into());
        assert!(c.auth.uses_dev_key());
        c.validate().expect("loopback: fine");
        c.listeners.ws.addr = "0.0.0.0:7080".parse().unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("auth.keys"), "{err}");
        assert!(err.contains("ws (0.0.0.0:7080)"), "{err}");
        assert!(err.contains("waygate keygen"), "{err}");
        // A disabled listener does not count; an enabled one on a public address does.
        c.listeners.ws.enabled = false;
        c.validate().expect("nothing exposed");
        c.listeners.kcp.addr = "[::]:7100".parse().unwrap();
        assert!(c.validate().is_err());
        c.auth.insecure_dev_key = true;
        c.validate().expect("explicitly insecure");
        c.auth.insecure_dev_key = false;
        c.auth.keys = vec![AuthKey {
            id: 2,
            secret: "0123456789abcdef0123456789abcdef".into(),
        }];
        c.validate().expect("own key");
    }

    /// Backend links without a secret are refused when a client listener is beyond
    /// loopback (PROTOCOL.md §9.3), unless the operator explicitly asks for it.
    #[test]
    fn links_without_a_secret_are_refused_beyond_loopback() {
        let mut c = EdgeConfig::default();
        c.auth.keys = vec![AuthKey {
            id: 2,
            secret: "0123456789abcdef0123456789abcdef".into(),
        }];
        c.validate().expect("loopback: fine");
        c.listeners.quic.addr = "0.0.0.0:7444".parse().unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("links.secret_file"), "{err}");
        assert!(err.contains("quic (0.0.0.0:7444)"), "{err}");
        c.links.insecure_no_secret = true;
        c.validate().expect("explicitly insecure");
        c.links.insecure_no_secret = false;
        c.links.secret_file = Some("/etc/waygate/link-secret".into());
        c.validate().expect("with a secret");
    }

    /// etcd and Redis beyond loopback need authentication (secure-by-default audit: a Redis
    /// reader could resume lingering sessions with the resume keys in their snapshots),
    /// unless the operator explicitly asks otherwise; loopback ones do not.
    #[test]
    fn etcd_and_redis_beyond_loopback_need_authentication() {
        let mut c = EdgeConfig::default();
        c.cluster.redis_url = "redis://127.0.0.1:6379/0".into();
        c.cluster.etcd_endpoints = vec!["http://localhost:2379".into(), "[::1]:2379".into()];
        c.validate().expect("loopback: fine");

        c.cluster.redis_url = "redis://10.0.0.3:6379/0".into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cluster.redis_url"), "{err}");
        assert!(err.contains("redis://:PASSWORD@"), "{err}");
        c.cluster.redis_url = "redis://:s3cret-password@10.0.0.3:6379/0".into();
        // A password is not enough: the resume keys in snapshots need the edges' secret.
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cluster.redis_resume_key_file"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("redis-resume-key");
        c.cluster.redis_resume_key_file = Some(key.clone());
        for (secret, refused) in [
            ("too-short-a-secret\n", "at least 32 bytes"),
            (
                "replace-with-a-long-random-secret-all-edges-share\n",
                "placeholder",
            ),
        ] {
            std::fs::write(&key, secret).unwrap();
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(refused), "{err}");
        }
        std::fs::write(&key, "a-secret-every-edge-shares-0123456789abcdef\n").unwrap();
        c.validate().expect("with a password and the edges' secret");
        // A rotation's second secret: a different one, and only beside the sealing one.
        let accepted = dir.path().join("redis-resume-key-old");
        c.cluster.redis_resume_key_accepted_file = Some(accepted.clone());
        std::fs::write(&accepted, "a-secret-every-edge-shares-0123456789abcdef\n").unwrap();
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("redis_resume_key_accepted_file") && err.contains("is the sealing one"),
            "{err}"
        );
        std::fs::write(&accepted, "the-old-secret-every-edge-shared-0123456789\n").unwrap();
        c.validate().expect("rotating");
        assert!(c
            .cluster
            .redis_resume_key_seal()
            .unwrap()
            .unwrap()
            .accepted_fingerprint()
            .is_some());
        c.cluster.redis_resume_key_file = None;
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("redis_resume_key_accepted_file")
                && err.contains("set cluster.redis_resume_key_file"),
            "{err}"
        );
        c.cluster.redis_resume_key_file = Some(key.clone());
        c.cluster.redis_resume_key_accepted_file = None;
        c.cluster.redis_url = "redis://:replace-with-the-redis-password@redis:6379".into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("placeholder"), "{err}");
        assert!(
            !err.contains("replace-with"),
            "the password is not echoed: {err}"
        );
        c.cluster.redis_url = String::new();
        c.cluster.redis_cluster = vec![
            "redis://:pw-one-for-the-test@10.0.0.3:7000".into(),
            "redis://10.0.0.4:7000".into(),
        ];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("10.0.0.4"), "{err}");
        assert!(err.contains("cluster.redis_cluster"), "{err}");
        c.cluster.redis_cluster.clear();
        c.cluster.redis_sentinels = vec!["redis://sentinel-1:26379".into()];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("redis_sentinel_master_password"), "{err}");
        c.cluster.redis_sentinel_master_password = "primary-password".into();
        c.validate().expect("the primary has a password");

        c.cluster.etcd_endpoints = vec!["http://etcd:2379".into()];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("cluster.etcd_username"), "{err}");
        assert!(err.contains("http://etcd:2379"), "{err}");
        c.cluster.etcd_username = "edge".into();
        c.validate().expect("a user");

        c.cluster.etcd_username = String::new();
        c.cluster.redis_sentinel_master_password = String::new();
        c.cluster.insecure_no_auth = true;
        c.validate().expect("explicitly insecure");
    }

    /// Review: endpoints are judged as the clients read them (user info before `@` is not
    /// the host), and a password never reaches a message.
    #[test]
    fn loopback_is_judged_as_the_clients_read_the_url() {
        for local in [
            "http://127.0.0.1:2379",
            "http://localhost:2379",
            "[::1]:2379",
            "http://[::ffff:127.0.0.1]:2379",
            "127.0.0.1:2379",
        ] {
            assert!(etcd_on_loopback(local), "{local}");
        }
        for remote in [
            "http://10.0.0.5:2379",
            "http://localhost:2379@10.0.0.5",
            "http://[::1]@10.0.0.5:2379",
            "etcd:2379",
            "not a url",
        ] {
            assert!(!etcd_on_loopback(remote), "{remote}");
        }
        assert_eq!(
            redact_redis_url("redis://:p@ss@host:6379/0"),
            "redis://***@host:6379/0"
        );
        assert_eq!(redact_redis_url("redis://host:6379"), "redis://host:6379");
    }

    /// What a loopback demo may do and an exposed edge should not is warned of at start,
    /// each naming its setting; on loopback, nothing.
    #[test]
    fn settings_weak_beyond_loopback_are_warned_of() {
        let mut c = EdgeConfig::default();
        c.cluster.redis_url = "redis://127.0.0.1:6379".into();
        c.cluster.etcd_endpoints = vec!["http://127.0.0.1:2379".into()];
        assert!(c.loopback_only_warnings().is_empty());
        c.cluster.etcd_endpoints = vec!["http://10.0.0.4:2379".into()];
        c.listeners.quic.addr = "0.0.0.0:7444".parse().unwrap();
        c.listeners.kcp.addr = "0.0.0.0:7100".parse().unwrap();
        c.kcp.packet_auth = waygate_transport::kcp::config::PacketAuth::Optional;
        c.cluster.redis_url = "redis://:pw-for-the-test@10.0.0.3:6379".into();
        let warnings = c.loopback_only_warnings().join("\n");
        for named in [
            "tls.cert",
            "rediss://",
            "10.0.0.3",
            "kcp.packet_auth",
            "10.0.0.4",
            "https://",
        ] {
            assert!(warnings.contains(named), "{named}: {warnings}");
        }
        assert!(!warnings.contains("pw-for-the-test"), "{warnings}");
        c.tls.cert = Some("/etc/waygate/edge.crt".into());
        c.tls.key = Some("/etc/waygate/edge.key".into());
        c.cluster.redis_url = "rediss://:pw-for-the-test@10.0.0.3:6379".into();
        c.kcp.packet_auth = waygate_transport::kcp::config::PacketAuth::Auto;
        c.cluster.etcd_endpoints = vec!["https://10.0.0.4:2379".into()];
        assert!(c.loopback_only_warnings().is_empty());
    }

    /// TLS to etcd is chosen by the endpoints' scheme: all `https://` or none; certificates
    /// without `https://` endpoints, or a client certificate without its key, are refused
    /// by name.
    #[test]
    fn etcd_tls_settings_must_agree_with_the_endpoints() {
        let refused = |c: &ClusterConfig| match c.check_etcd_tls() {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => panic!("{other:?}"),
        };
        let mut c = ClusterConfig {
            etcd_endpoints: vec!["https://a:2379".into(), "http://b:2379".into()],
            ..ClusterConfig::default()
        };
        assert_eq!(refused(&c), "cluster.etcd_endpoints");
        c.etcd_endpoints = vec!["http://a:2379".into()];
        c.etcd_tls_ca_file = Some("/etc/waygate/etcd-ca.pem".into());
        assert_eq!(refused(&c), "cluster.etcd_tls_ca_file");
        // The etcd client takes only `https://` as TLS (case-sensitive): a mix for it.
        c.etcd_endpoints = vec!["https://a:2379".into(), "HTTPS://b:2379".into()];
        assert_eq!(refused(&c), "cluster.etcd_endpoints");
        c.etcd_endpoints = vec!["https://a:2379".into(), "https://b:2379".into()];
        assert!(c.check_etcd_tls().is_ok());
        c.etcd_tls_cert_file = Some("/etc/waygate/etcd-client.pem".into());
        assert_eq!(refused(&c), "cluster.etcd_tls_key_file");
        c.etcd_tls_key_file = Some("/etc/waygate/etcd-client.key".into());
        assert!(c.check_etcd_tls().is_ok());
    }

    /// Sentinels are all `rediss://` or none (the primary they name follows them); a mix
    /// is refused by name.
    #[test]
    fn sentinels_use_tls_all_or_none() {
        let mut c = ClusterConfig {
            redis_sentinels: vec!["rediss://a:26379".into(), "redis://b:26379".into()],
            ..ClusterConfig::default()
        };
        match c.check_sentinel_tls() {
            Err(ConfigError::Invalid { key, .. }) => assert_eq!(key, "cluster.redis_sentinels"),
            other => panic!("{other:?}"),
        }
        // As redis parses them: `valkeys://` and any case are TLS too.
        c.redis_sentinels = vec!["VALKEYS://a:26379".into(), "redis://b:26379".into()];
        assert!(c.check_sentinel_tls().is_err());
        c.redis_sentinels = vec!["rediss://a:26379".into(), "valkeys://b:26379".into()];
        assert!(c.check_sentinel_tls().is_ok());
        c.redis_sentinels = vec!["redis://a:26379".into()];
        assert!(c.check_sentinel_tls().is_ok());
    }

    /// A JWT edge has no keys to open KCP connect tokens with: a KCP listener that requires
    /// sealed sessions would refuse every CONNECT, so the edge says so at start instead.
    #[test]
    fn jwt_auth_with_a_kcp_listener_requiring_sealed_sessions_is_refused() {
        let mut c = EdgeConfig::default();
        c.auth.kind = AuthKind::Jwt;
        c.auth.jwt.jwks_file = Some("/etc/waygate/jwks.json".into());
        c.validate().expect("loopback: plain KCP, fine");
        c.kcp.packet_auth = waygate_transport::kcp::config::PacketAuth::Required;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("kcp.packet_auth"), "{err}");
        assert!(err.contains("every CONNECT would be refused"), "{err}");
        c.listeners.kcp.enabled = false;
        c.validate().expect("no kcp listener");
        c.listeners.kcp.enabled = true;
        c.kcp.packet_auth = waygate_transport::kcp::config::PacketAuth::Optional;
        c.validate().expect("plain KCP, explicitly");
    }

    /// Panic audit: durations a clock adds, and the link heartbeat, are bounded at load
    /// (a huge linger or dedup window overflowed `Instant`; heartbeat 0 killed every link).
    #[test]
    fn durations_and_the_link_heartbeat_are_bounded() {
        let mut c = EdgeConfig::default();
        c.session.linger_secs = 400 * 24 * 3600;
        c.channels.dedup_window_secs = c.session.linger_secs;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("session.linger_secs"), "{err}");
        c = EdgeConfig::default();
        c.links.heartbeat_ms = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("links.heartbeat_ms"), "{err}");
    }

    #[test]
    fn an_etcd_password_comes_from_its_file_and_is_never_a_placeholder() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("etcd-password");
        let mut c = ClusterConfig::default();
        assert_eq!(
            c.etcd_credentials_with(None).unwrap(),
            None,
            "no user, no sign-in"
        );
        c.etcd_username = "edge".into();
        let err = c.etcd_credentials_with(None).unwrap_err().to_string();
        assert!(err.contains("no password"), "{err}");
        c.etcd_password_file = Some(file.clone());
        std::fs::write(&file, "replace-with-the-etcd-password\n").unwrap();
        let err = c.etcd_credentials_with(None).unwrap_err().to_string();
        assert!(err.contains("placeholder"), "{err}");
        std::fs::write(&file, "the-password\nignored\n").unwrap();
        let credentials = c.etcd_credentials_with(None).unwrap().unwrap();
        assert_eq!(
            (credentials.user.as_str(), credentials.password.as_str()),
            ("edge", "the-password")
        );
        assert!(!format!("{credentials:?}").contains("the-password"));
        // The environment's password wins over the file.
        let from_env = c.etcd_credentials_with(Some("from-env")).unwrap().unwrap();
        assert_eq!(from_env.password, "from-env");
    }

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = EdgeConfig::default();
        c.validate().unwrap();
        let text = toml::to_string(&c).unwrap();
        assert_eq!(EdgeConfig::from_toml(&text, Path::new("x")).unwrap(), c);
    }

    #[test]
    fn a_typo_names_the_key() {
        let err = EdgeConfig::from_toml("[limits]\nmax_frame_sise = 10\n", Path::new("edge.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_frame_sise"), "{err}");
        assert!(err.contains("edge.toml"), "{err}");
    }

    #[test]
    fn out_of_range_values_are_refused() {
        let err = EdgeConfig::from_toml("[limits]\nmax_frame_size = 1\n", Path::new("e"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("limits.max_frame_size"), "{err}");
        // A frame that would not fit one backend link frame (its message could be acked and
        // never forwarded): refused, with a KCP mtu large enough that KCP's own bound (127 x
        // (mtu - 24)) does not decide.
        let too_big = format!(
            "[limits]\nmax_frame_size = {}\n[kcp]\nmtu = 9000\n",
            MAX_CLIENT_FRAME + 1
        );
        let err = EdgeConfig::from_toml(&too_big, Path::new("e"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("limits.max_frame_size"), "{err}");
        let fits = format!(
            "[limits]\nmax_frame_size = {MAX_CLIENT_FRAME}\n[kcp]\nmtu = 9000\n\
             [backpressure]\ninbound_byte_burst = {MAX_CLIENT_FRAME}\n"
        );
        let fits = EdgeConfig::from_toml(&fits, Path::new("e"));
        assert!(fits.is_ok(), "{fits:?}");
    }

    /// Issue 15: the publish-id window is sized to the client's retry horizon (a resume
    /// within the session linger resends what was not acknowledged); a shorter one is
    /// refused at load, naming both keys.
    #[test]
    fn the_websocket_read_buffer_is_checked_and_reaches_the_transport() {
        let tiny = "[limits]\nws_read_buffer_bytes = 32\n";
        let err = EdgeConfig::from_toml(tiny, Path::new("e"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("limits.ws_read_buffer_bytes"), "{err}");
        let big = "[limits]\nws_read_buffer_bytes = 4096\n";
        let config = EdgeConfig::from_toml(big, Path::new("e")).unwrap();
        assert_eq!(config.conn_config().ws_read_buffer, 4096);
    }

    #[test]
    fn a_publish_id_window_shorter_than_the_linger_is_refused() {
        let short = "[session]\nlinger_secs = 120\n[channels]\ndedup_window_secs = 60\n";
        let err = EdgeConfig::from_toml(short, Path::new("e"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("channels.dedup_window_secs"), "{err}");
        assert!(err.contains("session.linger_secs"), "{err}");
        let covered = "[session]\nlinger_secs = 120\n[channels]\ndedup_window_secs = 120\n";
        let ok = EdgeConfig::from_toml(covered, Path::new("e"));
        assert!(ok.is_ok(), "{ok:?}");
        let longer_linger = "[session]\nlinger_secs = 3600\n";
        let err = EdgeConfig::from_toml(longer_linger, Path::new("e"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("channels.dedup_window_secs"), "{err}");
    }
}

#[cfg(test)]
mod example_file {
    use super::*;

    /// The documented example must parse, validate and equal the embedded defaults, so it
    /// can never drift from the code.
    #[test]
    fn examples_edge_toml_is_the_defaults() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/edge.toml"
        ));
        let config = EdgeConfig::load(path).expect("examples/edge.toml loads");
        assert_eq!(config, EdgeConfig::default());
    }

    /// Every key the configuration has is in the example, set or in a comment (`key =` or
    /// `# key =`) under its section's header (2026-12-05: six `[kcp]` keys were only in
    /// the code, while the file and PROTOCOL.md §10 said it documents every key).
    #[test]
    fn examples_edge_toml_documents_every_key() {
        fn paths(prefix: &str, table: &toml::Table, out: &mut Vec<String>) {
            for (k, v) in table {
                match v {
                    toml::Value::Table(t) => paths(&format!("{prefix}{k}."), t, out),
                    _ => out.push(format!("{prefix}{k}")),
                }
            }
        }
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/edge.toml"
        ))
        .expect("examples/edge.toml");
        // The example's keys, as `section.key`, set or commented out.
        let mut documented = std::collections::BTreeSet::new();
        let mut section = String::new();
        let is_name = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        };
        for line in text.lines() {
            let line = line.trim_start_matches(['#', ' ']);
            let header = line
                .split('#')
                .next()
                .map(str::trim_end)
                .filter(|h| h.starts_with('[') && h.ends_with(']'))
                .map(|h| h.trim_matches(['[', ']']))
                .filter(|h| is_name(h));
            if let Some(h) = header {
                // An array of tables or a map is documented by its header.
                documented.insert(h.to_owned());
                section = format!("{h}.");
            } else if let Some((key, _)) = line.split_once('=') {
                let key = key.trim_end();
                if is_name(key) {
                    documented.insert(format!("{section}{key}"));
                }
            }
        }
        let defaults = toml::Table::try_from(EdgeConfig::default()).expect("defaults serialize");
        let mut all = Vec::new();
        paths("", &defaults, &mut all);
        let missing: Vec<&String> = all.iter().filter(|p| !documented.contains(*p)).collect();
        assert!(
            missing.is_empty(),
            "keys not in examples/edge.toml: {missing:?}"
        );
    }
}

//! The connection the Redis backends share: one Redis through a `ConnectionManager`, a
//! Redis Cluster through redis' cluster client (slot map, redirections, failover), or the
//! primary that Redis Sentinel names ([`SentinelLink`]), all reconnecting by themselves;
//! every call bounded by [`RedisConfig::op_timeout`]; key names hash-tagged by player so
//! every script touches one slot; and the pub/sub subscription loop (kicks, pushes, push
//! replies) kept up with backoff.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use prometheus_client::metrics::counter::Counter;
use redis::aio::{ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use tokio::sync::watch;
use waygate_protocol::frame::SessionId;
use waygate_session::resume::{hex_id, player_store_tag, session_store_tag};

use super::{RedisConfig, RedisError, RedisServers};

/// The managed connection: one Redis or a cluster. Both are cheap to clone (one multiplexed
/// connection per node underneath).
#[derive(Clone)]
pub(super) enum Link {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(SentinelLink),
}

impl redis::aio::ConnectionLike for Link {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Sentinel(c) => {
                Box::pin(c.run(move |mut conn| async move { conn.req_packed_command(cmd).await }))
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Sentinel(c) => Box::pin(c.run(move |mut conn| async move {
                conn.req_packed_commands(pipeline, offset, count).await
            })),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(_) => 0,
        }
    }
}

/// The primary that Redis Sentinel names for a master name, over one multiplexed
/// connection. The connection is opened on first use (asking the sentinels where the
/// primary is; redis checks that the node says it is one) and dropped when a call fails
/// for a reason that says it is gone or no longer the primary (I/O error, dropped
/// connection, timeout, `READONLY` after a failover demoted it, `MASTERDOWN`); the next
/// call asks the sentinels again. A call that failed before it could have run (no
/// connection, refused, `READONLY`, `MASTERDOWN`) is retried on the new primary up to 4
/// times, 50 ms to 500 ms apart; one that may have run is not (the caller sees the
/// error, as with the other links). [`Conn::run`] bounds the whole.
#[derive(Clone)]
pub(super) struct SentinelLink {
    inner: Arc<SentinelInner>,
}

struct SentinelInner {
    /// One client per sentinel, asked at once: the first answer wins, so a sentinel that
    /// is down or hung (its port takes connections, nothing answers) holds nothing up.
    sentinels: Vec<tokio::sync::Mutex<SentinelClient>>,
    /// Held while a connection is being opened, so a failure seen by many calls at once
    /// reconnects once.
    connecting: tokio::sync::Mutex<()>,
    /// The open connection and its generation.
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    generation: AtomicU64,
    config: redis::AsyncConnectionConfig,
}

impl SentinelLink {
    /// Sentinels named by `rediss://` URLs are reached over TLS, and so is the primary
    /// they name (all or none: the configuration refuses a mix), both verified against
    /// `certs` when given (else the system's roots); the primary's certificate must name
    /// the address the sentinels announce (an IP address unless they announce host names).
    fn new(
        sentinels: &[String],
        master: &str,
        auth: Option<&super::SentinelPrimaryAuth>,
        certs: Option<redis::TlsCertificates>,
        op_timeout: Duration,
    ) -> redis::RedisResult<Self> {
        // The primary is reached as the sentinels are: TLS (verified, or not when their
        // URLs say `#insecure`) or in clear; the configuration refuses a mix.
        let primary_tls = sentinels.iter().find_map(|url| tls_of(url).ok().flatten());
        let clients = sentinels
            .iter()
            .map(|url| {
                let sentinel = redis::IntoConnectionInfo::into_connection_info(url.as_str())?;
                let mut builder = redis::sentinel::SentinelClientBuilder::new(
                    [sentinel.addr().clone()],
                    master,
                    SentinelServerType::Master,
                )?;
                let own = sentinel.redis_settings();
                builder = builder.set_client_to_sentinel_protocol(own.protocol());
                if let Some(user) = own.username() {
                    builder = builder.set_client_to_sentinel_username(user);
                }
                if let Some(password) = own.password() {
                    builder = builder.set_client_to_sentinel_password(password);
                }
                if let Some(a) = auth {
                    builder = builder.set_client_to_redis_password(&a.password);
                    if let Some(user) = &a.username {
                        builder = builder.set_client_to_redis_username(user);
                    }
                }
                if let Some(mode) = primary_tls {
                    builder = builder.set_client_to_redis_tls_mode(mode);
                    if let Some(certs) = &certs {
                        builder = builder
                            .set_client_to_sentinel_certificates(certs.clone())
                            .set_client_to_redis_certificates(certs.clone());
                    }
                }
                builder.build().map(tokio::sync::Mutex::new)
            })
            .collect::<redis::RedisResult<Vec<_>>>()?;
        Ok(Self {
            inner: Arc::new(SentinelInner {
                sentinels: clients,
                connecting: tokio::sync::Mutex::new(()),
                current: Mutex::new(None),
                generation: AtomicU64::new(0),
                config: redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(op_timeout))
                    .set_response_timeout(Some(op_timeout)),
            }),
        })
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        self.inner
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The open connection, or a new one to the primary the sentinels name now.
    async fn connection(&self) -> redis::RedisResult<(u64, MultiplexedConnection)> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let _connecting = self.inner.connecting.lock().await;
        if let Some(c) = self.current() {
            return Ok(c); // opened by another call meanwhile
        }
        let conn = self
            .primary_client()
            .await?
            .get_multiplexed_async_connection_with_config(&self.inner.config)
            .await?;
        let generation = self.inner.generation.fetch_add(1, Ordering::Relaxed) + 1;
        *self
            .inner
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((generation, conn.clone()));
        Ok((generation, conn))
    }

    /// A client for the primary the sentinels name now (redis checks that the node says it
    /// is one): the first sentinel to answer wins; an error only when every one failed.
    pub(super) async fn primary_client(&self) -> redis::RedisResult<redis::Client> {
        let asks = self
            .inner
            .sentinels
            .iter()
            .map(|s| Box::pin(async move { s.lock().await.async_get_client().await }));
        futures_util::future::select_ok(asks)
            .await
            .map(|(client, _)| client)
    }

    /// Forgets connection `generation` (a newer one stays).
    fn failed(&self, generation: u64) {
        let mut current = self
            .inner
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.as_ref().map(|(g, _)| *g) == Some(generation) {
            *current = None;
        }
    }

    async fn run<T, F, Fut>(&self, call: F) -> redis::RedisResult<T>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let mut backoff = Duration::from_millis(50);
        let mut attempt = 0;
        loop {
            attempt += 1;
            // (the error, whether the command certainly did not run)
            let (e, retry) = match self.connection().await {
                Ok((generation, conn)) => match call(conn).await {
                    Err(e) if primary_gone(&e) => {
                        self.failed(generation);
                        let retry = not_run(&e);
                        (e, retry)
                    }
                    other => return other,
                },
                // No primary to send it to (the sentinels' lookup or the connect failed).
                Err(e) => (e, true),
            };
            match e {
                e if attempt < 5 && retry => {
                    tracing::debug!(error = %e, attempt, "redis primary unavailable; asking the sentinels again");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                e => return Err(e),
            }
        }
    }
}

/// How a Redis URL is reached, as redis parses it (`rediss://`, `valkeys://`, any case):
/// TLS, verified or (`#insecure`) not, or `None` in clear.
pub(super) fn tls_of(url: &str) -> redis::RedisResult<Option<redis::TlsMode>> {
    let info = redis::IntoConnectionInfo::into_connection_info(url)?;
    Ok(match info.addr() {
        redis::ConnectionAddr::TcpTls { insecure, .. } => Some(if *insecure {
            redis::TlsMode::Insecure
        } else {
            redis::TlsMode::Secure
        }),
        _ => None,
    })
}

/// The error says the connection is gone or its node is not the primary any more.
fn primary_gone(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || not_run(e)
}

/// The error says the command did not run: no connection could be opened, or the node
/// refused it as a replica or a primary without its replicas.
fn not_run(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
        || e.to_string().contains("READONLY")
}

/// Shared connection, key names and the per-call bound.
#[derive(Clone)]
pub(super) struct Conn {
    /// Where subscriptions connect: the one Redis, or every cluster seed in turn (classic
    /// pub/sub in a cluster reaches subscribers on any node); empty behind Sentinel, where
    /// each subscription asks for the primary of the moment.
    pubsub: Arc<[redis::Client]>,
    link: Link,
    pub(super) config: Arc<RedisConfig>,
    /// Notices dropped because a subscription's queue was full (`SUBSCRIPTION_QUEUE`).
    pub(super) pubsub_dropped: Counter,
    /// On a cluster: which master serves each slot, as last read (see [`Conn::node_groups`]).
    slot_owners: Arc<Mutex<SlotOwnersState>>,
}

/// The masters of a Redis Cluster's slots as `CLUSTER SLOTS` last told them: which keys one
/// script call may name itself (a script without flags may touch keys of any slots the node
/// it runs on serves). Only a grouping: a command of the script on a key the node does not
/// serve fails, so a stale map costs a retry, never a wrong write.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct SlotOwners {
    /// (first slot, last slot, master index), by first slot.
    ranges: Vec<(u16, u16, usize)>,
}

/// How many slots a Redis Cluster has.
const CLUSTER_SLOTS: u16 = 16_384;

/// How long a slot map is used before it is read again (slots move only when an operator
/// reshards; a failover moves a master's slots together, so grouping stays right).
const SLOT_OWNERS_MAX_AGE: Duration = Duration::from_secs(10);

/// After a failed read of the slot map, the next one waits this long.
const SLOT_OWNERS_RETRY: Duration = Duration::from_secs(1);

#[derive(Default)]
struct SlotOwnersState {
    owners: Option<Arc<SlotOwners>>,
    /// When `owners` was read (None: read again at the next use).
    read_at: Option<std::time::Instant>,
    /// A read is out (reset by its guard, also if its task is dropped).
    reading: bool,
    /// No read before this (the last one failed).
    not_before: Option<std::time::Instant>,
    /// Bumped when a grouped call failed: a read that started before it is not fresh.
    generation: u64,
}

/// Ends a slot map read: whatever happens to its task, the next use may read again.
struct SlotOwnersRead(Arc<Mutex<SlotOwnersState>>);

impl Drop for SlotOwnersRead {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).reading = false;
    }
}

impl SlotOwners {
    /// From a `CLUSTER SLOTS` reply: `[first, last, [master ip, port, ...], replicas...]`
    /// per range. None if it is not one.
    pub(super) fn from_reply(reply: &redis::Value) -> Option<Self> {
        use redis::Value;
        let Value::Array(ranges) = reply else {
            return None;
        };
        let int = |v: &Value| match v {
            Value::Int(n) => u16::try_from(*n).ok().filter(|n| *n < CLUSTER_SLOTS),
            _ => None,
        };
        let text = |v: &Value| match v {
            Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        };
        let mut masters: Vec<String> = Vec::new();
        let mut out = Vec::with_capacity(ranges.len());
        for range in ranges {
            let Value::Array(r) = range else {
                return None;
            };
            let (first, last) = (int(r.first()?)?, int(r.get(1)?)?);
            let Value::Array(master) = r.get(2)? else {
                return None;
            };
            // A master is named by its node id (an endpoint may be "?" or NULL).
            let name = match master.get(2).and_then(text) {
                Some(id) if !id.is_empty() => id,
                _ => match (master.first().and_then(text), master.get(1)) {
                    (Some(host), Some(Value::Int(port))) => format!("{host}:{port}"),
                    _ => return None,
                },
            };
            let index = match masters.iter().position(|m| *m == name) {
                Some(i) => i,
                None => {
                    masters.push(name);
                    masters.len() - 1
                }
            };
            if first > last {
                return None;
            }
            out.push((first, last, index));
        }
        out.sort_unstable();
        Some(Self { ranges: out })
    }

    /// The index of the master serving `slot`, if the map has it.
    pub(super) fn master_of(&self, slot: u16) -> Option<usize> {
        let i = self.ranges.partition_point(|&(first, ..)| first <= slot);
        let &(_, last, master) = self.ranges.get(i.checked_sub(1)?)?;
        (slot <= last).then_some(master)
    }
}

/// The slot Redis Cluster gives `key`: CRC16 (XMODEM) of its hash tag, modulo 16,384.
pub(super) fn key_slot(key: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(hash_tag(key).as_bytes()) % CLUSTER_SLOTS
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("servers", &self.config.servers.describe())
            .finish_non_exhaustive()
    }
}

pub(super) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Conn {
    pub(super) fn new(config: RedisConfig) -> Result<Self, RedisError> {
        let certs = || redis::TlsCertificates {
            client_tls: None,
            root_cert: config.tls_root_pem.clone(),
        };
        let open = |url: &str| {
            if config.tls_root_pem.is_some() && super::url_uses_tls(url) {
                // Verified against the configured roots, not the system's.
                redis::Client::build_with_tls(url, certs())
            } else {
                redis::Client::open(url)
            }
            .map_err(|e| RedisError::Invalid(format!("redis url: {e}")))
        };
        let (pubsub, link) = match &config.servers {
            RedisServers::Single(url) => {
                let client = open(url)?;
                let mc = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(config.op_timeout))
                    .set_response_timeout(Some(config.op_timeout))
                    .set_number_of_retries(4)
                    .set_min_delay(Duration::from_millis(50))
                    .set_max_delay(Duration::from_millis(500));
                let manager = ConnectionManager::new_lazy_with_config(client.clone(), mc)?;
                (vec![client], Link::Single(manager))
            }
            RedisServers::Cluster(nodes) => {
                if nodes.is_empty() {
                    return Err(RedisError::Invalid(
                        "a redis cluster needs seed nodes".into(),
                    ));
                }
                let seeds = nodes
                    .iter()
                    .map(|n| open(n))
                    .collect::<Result<Vec<_>, _>>()?;
                // Retries follow MOVED/ASK and ride out a failover; the op timeout bounds
                // the whole call either way.
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                    .retries(4)
                    .min_retry_wait(50)
                    .max_retry_wait(500);
                if config.tls_root_pem.is_some() && nodes.iter().any(|n| super::url_uses_tls(n)) {
                    builder = builder.certs(certs());
                }
                let client = builder
                    .build()
                    .map_err(|e| RedisError::Invalid(format!("redis cluster: {e}")))?;
                let cc = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(config.op_timeout)
                    .set_response_timeout(config.op_timeout);
                (
                    seeds,
                    Link::Cluster(client.get_pending_async_connection_with_config(cc)),
                )
            }
            RedisServers::Sentinel {
                sentinels,
                master,
                primary_auth,
            } => {
                if sentinels.is_empty() || master.is_empty() {
                    return Err(RedisError::Invalid(
                        "redis sentinel needs sentinel URLs and a master name".into(),
                    ));
                }
                let roots = config.tls_root_pem.is_some().then(certs);
                let link = SentinelLink::new(
                    sentinels,
                    master,
                    primary_auth.as_ref(),
                    roots,
                    config.op_timeout,
                )
                .map_err(|e| RedisError::Invalid(format!("redis sentinel: {e}")))?;
                (Vec::new(), Link::Sentinel(link))
            }
        };
        Ok(Self {
            pubsub: pubsub.into(),
            link,
            config: Arc::new(config),
            pubsub_dropped: Counter::default(),
            slot_owners: Arc::default(),
        })
    }

    /// Whether this is a Redis Cluster (pipelines must stay within one slot, and PUBLISH
    /// counts only the receiving node's subscribers).
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.link, Link::Cluster(_))
    }

    /// On a cluster, the slot map by which calls may group the keys of many slots of one
    /// master; None elsewhere, or until the map was read (then group by hash tag). Reads
    /// the map in the background when it has none, or one older than
    /// [`SLOT_OWNERS_MAX_AGE`], or one marked stale.
    pub(super) fn node_groups(&self) -> Option<Arc<SlotOwners>> {
        let Link::Cluster(cluster) = &self.link else {
            return None;
        };
        let mut state = self.slot_owners.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        let fresh = state
            .read_at
            .is_some_and(|at| now.duration_since(at) < SLOT_OWNERS_MAX_AGE);
        let waiting = state.not_before.is_some_and(|at| now < at);
        if !fresh && !waiting && !state.reading {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                state.reading = true;
                let guard = SlotOwnersRead(self.slot_owners.clone());
                let (mut cluster, bound, generation) =
                    (cluster.clone(), self.config.op_timeout, state.generation);
                runtime.spawn(async move {
                    let ask = cluster.route_command(
                        redis::cmd("CLUSTER").arg("SLOTS").clone(),
                        redis::cluster_routing::RoutingInfo::SingleNode(
                            redis::cluster_routing::SingleNodeRoutingInfo::Random,
                        ),
                    );
                    let owners = match tokio::time::timeout(bound, ask).await {
                        Ok(Ok(reply)) => SlotOwners::from_reply(&reply),
                        _ => None,
                    };
                    let mut state = guard.0.lock().unwrap_or_else(|e| e.into_inner());
                    let now = std::time::Instant::now();
                    if let Some(owners) = owners {
                        state.owners = Some(Arc::new(owners));
                        // Fresh only if no grouped call failed while it was read.
                        state.read_at = (state.generation == generation).then_some(now);
                        state.not_before = None;
                    } else {
                        tracing::debug!("redis cluster: the slot map could not be read");
                        state.not_before = Some(now + SLOT_OWNERS_RETRY);
                    }
                });
            }
        }
        state.owners.clone()
    }

    /// A call grouped by [`Conn::node_groups`] failed, or found a key its node does not
    /// serve: read the slot map again before the next grouping (meanwhile the old one is
    /// still used: a failover moves a master's slots together, so it stays right).
    pub(super) fn node_group_failed(&self) {
        let mut state = self.slot_owners.lock().unwrap_or_else(|e| e.into_inner());
        state.read_at = None;
        state.generation = state.generation.wrapping_add(1);
    }

    /// Runs `f` on a clone of the managed connection, bounded by the op timeout.
    pub(super) async fn run<T, F, Fut>(&self, f: F) -> Result<T, RedisError>
    where
        F: FnOnce(Link) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match tokio::time::timeout(self.config.op_timeout, f(self.link.clone())).await {
            Ok(r) => r.map_err(RedisError::from),
            Err(_) => Err(RedisError::Timeout),
        }
    }

    /// Runs the one command `each` adds for every item: as one pipeline on one Redis; on a
    /// cluster as one pipeline per hash tag of the key `key_of` gives (concurrently), or a
    /// pipeline of its own for an item it marks alone, each sent to the master of its key's
    /// slot whatever the commands declare (so a script call that names its keys itself goes
    /// where its keys are). The whole is bounded by the op timeout; the answer has one
    /// result per item, in order (a command Redis refused, or every command of a pipeline
    /// that failed as a whole, is an `Err` in its place; the others stand).
    pub(super) async fn pipeline_each<T>(
        &self,
        items: &[T],
        key_of: impl Fn(&T) -> (String, bool),
        each: impl Fn(&mut redis::Pipeline, &T),
    ) -> Result<Vec<redis::RedisResult<redis::Value>>, RedisError> {
        // (a key of the group, the items, their pipeline); by hash tag on a cluster.
        let mut groups: Vec<(String, Vec<usize>, redis::Pipeline)> = Vec::new();
        let mut by_tag: HashMap<String, usize> = HashMap::new();
        for (i, item) in items.iter().enumerate() {
            let (key, alone) = if self.is_cluster() {
                key_of(item)
            } else {
                (String::new(), false)
            };
            let group = match (alone, by_tag.get(hash_tag(&key))) {
                (false, Some(&g)) => g,
                _ => {
                    if !alone {
                        by_tag.insert(hash_tag(&key).to_owned(), groups.len());
                    }
                    let mut p = redis::pipe();
                    p.ignore_errors();
                    groups.push((key, Vec::new(), p));
                    groups.len() - 1
                }
            };
            let (_, indices, pipe) = &mut groups[group];
            indices.push(i);
            each(pipe, item);
        }
        let link = self.link.clone();
        let all = futures_util::future::join_all(groups.into_iter().map(|(key, indices, pipe)| {
            let mut link = link.clone();
            async move {
                debug_assert!(!pipe.is_transaction(), "pipeline_each sends no transaction");
                let replies: redis::RedisResult<Vec<redis::RedisResult<redis::Value>>> =
                    match &mut link {
                        // To the master of the key's slot, whatever the commands declare
                        // (a script that names its keys itself declares none).
                        Link::Cluster(cluster) => {
                            use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
                            let n = pipe.len();
                            let route = Route::with_key(&key, SlotAddr::Master);
                            cluster
                                .route_pipeline(
                                    pipe,
                                    0,
                                    n,
                                    SingleNodeRoutingInfo::SpecificNode(route),
                                )
                                .await
                                .map(|values| {
                                    values
                                        .into_iter()
                                        .map(|v| match v {
                                            redis::Value::ServerError(e) => Err(e.into()),
                                            v => Ok(v),
                                        })
                                        .collect()
                                })
                        }
                        link => pipe.query_async(link).await,
                    };
                (indices, replies)
            }
        }));
        let Ok(done) = tokio::time::timeout(self.config.op_timeout, all).await else {
            return Err(RedisError::Timeout);
        };
        let mut out: Vec<Option<redis::RedisResult<redis::Value>>> =
            std::iter::repeat_with(|| None).take(items.len()).collect();
        for (indices, replies) in done {
            let replies = match replies {
                Ok(r) if r.len() == indices.len() => r,
                Ok(r) => {
                    return Err(RedisError::Corrupt(format!(
                        "{} replies to a pipeline of {}",
                        r.len(),
                        indices.len()
                    )))
                }
                Err(e) => vec![Err(e); indices.len()],
            };
            for (i, r) in indices.into_iter().zip(replies) {
                out[i] = Some(r);
            }
        }
        out.into_iter()
            .map(|r| r.ok_or_else(|| RedisError::Corrupt("a pipeline reply is missing".into())))
            .collect()
    }

    /// `P:{tag}:kind:player`: the player's records, hash-tagged by its store tag.
    pub(super) fn player_key(&self, kind: &str, player_id: &str) -> String {
        format!(
            "{}:{{{}}}:{kind}:{player_id}",
            self.config.prefix,
            hex_id(&player_store_tag(player_id))
        )
    }

    /// `P:{tag}:kind:<session hex>`: a session's records, in its player's slot (a session
    /// id starts with its player's store tag).
    pub(super) fn session_key(&self, kind: &str, session_id: &SessionId) -> String {
        format!(
            "{}:{{{}}}:{kind}:{}",
            self.config.prefix,
            hex_id(&session_store_tag(session_id)),
            hex_id(session_id)
        )
    }

    pub(super) fn edge_channel(&self, edge: &str, what: &str) -> String {
        format!("{}:edge:{edge}:{what}", self.config.prefix)
    }

    pub(super) fn fence_ttl_ms(&self) -> u64 {
        self.config.fence_ttl.map_or(0, ms)
    }

    pub(super) async fn ping(&self) -> Result<(), RedisError> {
        self.run(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .map(|_| ())
    }
}

/// The part of `key` Redis Cluster hashes: the text between the first `{` and the next
/// `}` when it is not empty, else the whole key.
pub(super) fn hash_tag(key: &str) -> &str {
    key.split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map(|(tag, _)| tag)
        .filter(|tag| !tag.is_empty())
        .unwrap_or(key)
}

pub(super) fn check_edge(edge: &str) -> Result<(), RedisError> {
    if edge.is_empty() || edge.contains(['\n', ' ']) {
        return Err(RedisError::Invalid(format!(
            "edge id {edge:?} must be non-empty without spaces or newlines"
        )));
    }
    Ok(())
}

pub(super) fn parse_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Notices a subscription holds for its handler. The redis crate buffers what a
/// subscription receives without a bound, so the receiving loop only moves each notice into
/// this queue; a notice that finds it full is dropped, logged and counted
/// (`waygate_redis_pubsub_dropped_total`). Pub/sub is at-most-once anyway: a dropped kick
/// is caught by the ownership sweep, a dropped push request or reply is its sender's
/// `timeout` for each message.
pub(super) const SUBSCRIPTION_QUEUE: usize = 4096;

/// Keeps a pub/sub subscription to `channel` up (reconnecting with backoff) and calls
/// `on_msg` for every message, one at a time, through a queue of [`SUBSCRIPTION_QUEUE`].
/// `up` tracks whether the subscription is live; `missed` counts the times messages may
/// have been missed (subscribed again after the first time: what was published meanwhile
/// went nowhere; or a message dropped by the full queue). Never returns.
pub(super) async fn subscribe_loop<F, Fut>(
    conn: Conn,
    channel: String,
    up: Option<watch::Sender<bool>>,
    missed: Option<watch::Sender<u64>>,
    on_msg: F,
) where
    F: Fn(redis::Msg) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (queue, mut taken) = tokio::sync::mpsc::channel::<redis::Msg>(SUBSCRIPTION_QUEUE);
    let handle = async move {
        while let Some(msg) = taken.recv().await {
            on_msg(msg).await;
        }
    };
    let receive = async move {
        let set_up = |v: bool| {
            if let Some(up) = &up {
                up.send_replace(v);
            }
        };
        let mut dropped_here = 0u64;
        let mut backoff = Duration::from_millis(50);
        let mut subscribed_before = false;
        let count_missed = || {
            if let Some(m) = &missed {
                m.send_modify(|n| *n += 1);
            }
        };
        // On a cluster, a seed that fails gives its turn to the next one.
        for turn in 0usize.. {
            let subscribed = tokio::time::timeout(conn.config.op_timeout, async {
                let client = match &conn.link {
                    Link::Sentinel(s) => s.primary_client().await?,
                    _ => conn.pubsub[turn % conn.pubsub.len()].clone(),
                };
                let mut ps = client.get_async_pubsub().await?;
                ps.subscribe(&channel).await?;
                Ok::<_, redis::RedisError>(ps)
            })
            .await;
            match subscribed {
                Ok(Ok(mut ps)) => {
                    backoff = Duration::from_millis(50);
                    if subscribed_before {
                        count_missed();
                    }
                    subscribed_before = true;
                    set_up(true);
                    tracing::debug!(%channel, "redis subscription up");
                    let mut stream = ps.on_message();
                    while let Some(msg) = stream.next().await {
                        match queue.try_send(msg) {
                            Ok(()) if dropped_here > 0 => {
                                tracing::warn!(%channel, dropped = dropped_here, "redis subscription queue has room again");
                                dropped_here = 0;
                            }
                            Ok(()) => {}
                            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                                if dropped_here == 0 {
                                    tracing::warn!(%channel, capacity = SUBSCRIPTION_QUEUE, "redis subscription queue full; dropping notices");
                                }
                                dropped_here += 1;
                                conn.pubsub_dropped.inc();
                                count_missed();
                            }
                            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return,
                        }
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
    };
    // One task: the receiving loop keeps draining the connection while a notice is handled.
    tokio::join!(receive, handle);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_tags_are_read_as_redis_cluster_does() {
        assert_eq!(hash_tag("w:{ab12}:owner:p"), "ab12");
        assert_eq!(hash_tag("w:{}:x"), "w:{}:x");
        assert_eq!(hash_tag("plain"), "plain");
        assert_eq!(hash_tag("a{b}{c}"), "b");
    }

    #[test]
    fn slots_are_computed_as_redis_cluster_does() {
        // Values from Redis' cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(key_slot("foo"), 12_182);
        assert_eq!(key_slot("{foo}bar"), 12_182);
        assert_eq!(key_slot("123456789"), 0x31c3);
    }

    #[test]
    fn a_slot_map_is_read_from_cluster_slots() {
        use redis::Value;
        let node = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(format!("id-{port}").into_bytes()),
            ])
        };
        let range = |first: i64, last: i64, port: i64| {
            Value::Array(vec![
                Value::Int(first),
                Value::Int(last),
                node(port),
                node(port + 3),
            ])
        };
        let reply = Value::Array(vec![
            range(10_923, 16_383, 7002),
            range(0, 5_460, 7000),
            range(5_461, 10_922, 7001),
        ]);
        let owners = SlotOwners::from_reply(&reply).expect("a slot map");
        let at = |slot| owners.master_of(slot);
        assert_eq!(at(0), at(5_460));
        assert_eq!(at(100), at(0));
        assert_ne!(at(5_460), at(5_461));
        assert_eq!(at(5_461), at(10_922));
        assert_ne!(at(10_922), at(10_923));
        assert_eq!(at(16_383), at(10_923));
        assert!(at(0).is_some() && at(16_384).is_none());
        // Masters are told apart by node id, whatever their endpoint says.
        let unknown = |first: i64, last: i64, id: &[u8]| {
            Value::Array(vec![
                Value::Int(first),
                Value::Int(last),
                Value::Array(vec![
                    Value::Nil,
                    Value::Int(7000),
                    Value::BulkString(id.to_vec()),
                ]),
            ])
        };
        let owners = SlotOwners::from_reply(&Value::Array(vec![
            unknown(0, 99, b"a"),
            unknown(100, 199, b"b"),
            unknown(200, 299, b"a"),
        ]))
        .expect("a slot map");
        assert_ne!(owners.master_of(0), owners.master_of(100));
        assert_eq!(owners.master_of(0), owners.master_of(250));
        let gap = Value::Array(vec![range(0, 99, 7000), range(200, 300, 7001)]);
        let owners = SlotOwners::from_reply(&gap).expect("a slot map");
        assert_eq!(owners.master_of(150), None);
        assert_eq!(owners.master_of(99), owners.master_of(0));
        for bad in [
            Value::Nil,
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(5),
                Value::Int(4),
                node(7000),
            ])]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(16_384),
                node(7000),
            ])]),
        ] {
            assert_eq!(SlotOwners::from_reply(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn edge_ids_are_checked() {
        assert!(check_edge("a b").is_err() && check_edge("").is_err() && check_edge("e-1").is_ok());
    }
}

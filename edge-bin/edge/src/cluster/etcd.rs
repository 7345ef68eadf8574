//! etcd as the control plane (SPEC R6, R7, R9, R10): a [`RouteSource`] that composes the
//! route table from etcd, an [`InstanceRegistry`] with leases and load reports, and the
//! least-loaded edge pick a login service uses.
//!
//! # Key layout (etcd v3, all values UTF-8)
//!
//! Everything lives under one prefix `P` (e.g. `/waygate`, no trailing slash):
//!
//! | key | value | lease | written by |
//! |---|---|---|---|
//! | `P/table` | the base [`RouteTable`], TOML or JSON (JSON if it starts with `{`) | none | operator |
//! | `P/instances/<service>/<instance id>` | [`InstanceRecord`] JSON | yes | the backend instance ([`EtcdRegistry`]) |
//! | `P/switches/<instance id>` | [`Switch`] JSON | none | operator |
//! | `P/edges/<edge id>` | [`EdgeInfo`] JSON | yes | the edge ([`EtcdRegistry::register_edge`]) |
//!
//! Example values:
//!
//! ```text
//! P/instances/game/g7  {"address":"10.0.0.7:7000","weight":1.0,"state":"active",
//!                       "capacity":5000,"load":{"players":1234,"msg_rate":810.5}}
//! P/switches/g3        {"state":"disabled"}          (also "capacity": n, "weight": w)
//! P/edges/edge-2       {"id":"edge-2","address":"203.0.113.2:443","state":"active",
//!                       "capacity":20000,"sessions":4120,"msg_rate":0.0}
//! ```
//!
//! # The effective table
//!
//! The published table is the base table plus the registered instances: a registration for a
//! service the base table defines joins that service at once (or overrides the base entry
//! with the same id), then every switch overrides state, capacity or weight of its instance
//! (base or registered). A registration of an unknown service, or whose id another service
//! already uses, or with an invalid address or weight, is ignored (logged).
//!
//! A registration that disappears (lease expired after missed keep-alives, or revoked) stays
//! in the table for the damping window (SPEC R7; K missed reports = K x report interval), so
//! a flapping instance does not churn routes; if it registers again within the window
//! nothing changes. Load reports alone never produce a new table: they are published on
//! [`EtcdRouteSource::loads`] for the router's least-loaded policy (SPEC R10).
//!
//! Epochs: every published table gets `epoch = max(previous epoch + 1, etcd revision,
//! base epoch)`, so edges that saw the same etcd history publish the same epochs, and epochs
//! only grow (also across restarts: the persisted table's epoch is the floor). The
//! [`SourceUpdate::revision`] equals the epoch.
//!
//! # Watch and failures
//!
//! The source lists the prefix once, then watches it from revision + 1. A watch that fails
//! (etcd down, connection lost, no answer to a progress request within the request timeout)
//! is re-created with exponential backoff from the last revision seen; if etcd has compacted
//! that revision the source lists the prefix again ("re-list") and continues from there.
//! Until then the last good table stays published (and persisted as JSON when configured);
//! the source never publishes an empty table because etcd is unreachable, and
//! [`SourceStatus::staleness`] is the time since etcd last answered (a watch event, a
//! progress notification or a list).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions, WatchStream,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use waygate_routing::source::{
    InstanceRegistry, LeaseId, RouteSource, SourceStatus, SourceUpdate, TableOrigin,
};
use waygate_routing::{
    InstanceSpec, InstanceState, LoadReport, RouteTable, RoutingError, TableFormat,
};

/// Errors of the etcd control plane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// The etcd client reported an error (transport, gRPC status, lease not found, ...).
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd did not answer within the request timeout.
    #[error("etcd did not answer within {0:?} ({1})")]
    Timeout(Duration, &'static str),
    /// A setting is unusable.
    #[error("invalid etcd configuration: {0}")]
    Config(String),
    /// A record could not be encoded.
    #[error("record could not be encoded: {0}")]
    Json(#[from] serde_json::Error),
    /// The lease is not (or no longer) registered with this registry.
    #[error("lease {0} is not registered here")]
    NotRegistered(i64),
    /// The watch was cancelled by etcd for another reason than compaction.
    #[error("watch cancelled by etcd: {0}")]
    WatchCancelled(String),
}

impl EtcdError {
    /// As the routing crate's error (for the [`RouteSource`] / [`InstanceRegistry`] traits):
    /// an I/O error on the etcd key concerned.
    #[must_use]
    pub fn into_routing(self, key: &str) -> RoutingError {
        RoutingError::Io {
            path: PathBuf::from(format!("etcd:{key}")),
            source: std::io::Error::other(self.to_string()),
        }
    }
}

// ---- records ------------------------------------------------------------------------------

/// Load reported by an instance or an edge (SPEC R10).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Load {
    /// Players (sessions) held.
    #[serde(default)]
    pub players: u32,
    /// Messages per second handled (informational).
    #[serde(default)]
    pub msg_rate: f64,
}

/// What a backend instance registers under `P/instances/<service>/<id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceRecord {
    /// `host:port` of its backend link listener.
    pub address: String,
    /// Relative share of new keys.
    #[serde(default = "one")]
    pub weight: f64,
    /// Administrative state (a [`Switch`] overrides it).
    #[serde(default)]
    pub state: InstanceState,
    /// Player cap (a [`Switch`] overrides it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
    /// Last load report.
    #[serde(default)]
    pub load: Load,
}

fn one() -> f64 {
    1.0
}

impl InstanceRecord {
    /// The record of `spec` with no load yet.
    #[must_use]
    pub fn from_spec(spec: &InstanceSpec) -> Self {
        Self {
            address: spec.address.clone(),
            weight: spec.weight,
            state: spec.state,
            capacity: spec.capacity,
            load: Load::default(),
        }
    }

    fn to_spec(&self, id: &str) -> InstanceSpec {
        InstanceSpec {
            id: id.to_owned(),
            address: self.address.clone(),
            weight: self.weight,
            state: self.state,
            capacity: self.capacity,
        }
    }
}

/// Operator overrides for one instance under `P/switches/<instance id>` (SPEC R6).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Switch {
    /// Forces the state (e.g. `disabled` to take an instance out, `draining`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<InstanceState>,
    /// Forces the player cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
    /// Forces the weight (0 takes no new keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// An edge as registered under `P/edges/<edge id>` (login -> least-loaded edge, SPEC R10).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EdgeInfo {
    /// Edge id (the key's last segment is authoritative when reading).
    #[serde(default)]
    pub id: String,
    /// Public address clients connect to.
    pub address: String,
    /// `active` takes new players; `draining` / `disabled` take none.
    #[serde(default)]
    pub state: InstanceState,
    /// Session cap; at the cap the edge gets no new players.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
    /// Live sessions (last report).
    #[serde(default)]
    pub sessions: u32,
    /// Messages per second (last report, informational).
    #[serde(default)]
    pub msg_rate: f64,
}

/// The least-loaded edge that takes new players: active, under its cap, fewest sessions
/// (ties by id). `None`: no edge qualifies.
#[must_use]
pub fn pick_least_loaded(edges: &[EdgeInfo]) -> Option<&EdgeInfo> {
    edges
        .iter()
        .filter(|e| e.state == InstanceState::Active && e.capacity.is_none_or(|c| e.sessions < c))
        .min_by(|a, b| a.sessions.cmp(&b.sessions).then_with(|| a.id.cmp(&b.id)))
}

/// Every edge registered under `prefix`.
pub async fn list_edges(client: &Client, prefix: &str) -> Result<Vec<EdgeInfo>, EtcdError> {
    let keys = Keys::new(prefix);
    let mut c = client.clone();
    let resp = c
        .get(keys.edges.as_str(), Some(GetOptions::new().with_prefix()))
        .await?;
    let mut edges = Vec::new();
    for kv in resp.kvs() {
        let Some(id) = kv.key().strip_prefix(keys.edges.as_bytes()) else {
            continue;
        };
        match serde_json::from_slice::<EdgeInfo>(kv.value()) {
            Ok(mut e) => {
                e.id = String::from_utf8_lossy(id).into_owned();
                edges.push(e);
            }
            Err(e) => {
                tracing::warn!(key = %String::from_utf8_lossy(kv.key()), error = %e, "ignoring unreadable edge record")
            }
        }
    }
    Ok(edges)
}

/// The edge a login service should send a new client to (see [`pick_least_loaded`]).
/// `Ok(None)`: no edge is registered, enabled and under its cap.
pub async fn least_loaded_edge(
    client: &Client,
    prefix: &str,
) -> Result<Option<EdgeInfo>, EtcdError> {
    let edges = list_edges(client, prefix).await?;
    Ok(pick_least_loaded(&edges).cloned())
}

/// The etcd client with a `Debug` impl (the client has none).
#[derive(Clone)]
struct Etcd(Client);

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("etcd_client::Client")
    }
}

/// A tiny HTTP endpoint for a login service (SPEC R10): `GET /edge` answers the
/// least-loaded edge as [`EdgeInfo`] JSON, `503` with `Retry-After: 1` when no edge qualifies
/// or etcd is unreachable. Serve it with `axum::serve`.
pub fn login_router(client: Client, prefix: String) -> axum::Router {
    use axum::extract::State;
    use axum::http::{header, StatusCode};
    use axum::response::{IntoResponse, Response};

    async fn pick(State(s): State<Arc<(Etcd, String)>>) -> Response {
        let unavailable = |msg: String| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "1")],
                axum::Json(serde_json::json!({ "error": msg })),
            )
                .into_response()
        };
        match least_loaded_edge(&s.0 .0, &s.1).await {
            Ok(Some(e)) => axum::Json(e).into_response(),
            Ok(None) => unavailable("no edge is enabled and under its cap".into()),
            Err(e) => unavailable(e.to_string()),
        }
    }
    axum::Router::new()
        .route("/edge", axum::routing::get(pick))
        .with_state(Arc::new((Etcd(client), prefix)))
}

// ---- keys ---------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Keys {
    /// `P/`
    root: String,
    table: String,
    instances: String,
    switches: String,
    edges: String,
}

impl Keys {
    fn new(prefix: &str) -> Self {
        let p = prefix.trim_end_matches('/');
        Self {
            root: format!("{p}/"),
            table: format!("{p}/table"),
            instances: format!("{p}/instances/"),
            switches: format!("{p}/switches/"),
            edges: format!("{p}/edges/"),
        }
    }
}

enum KeyKind<'a> {
    Table,
    Instance { service: &'a str, id: &'a str },
    Switch(&'a str),
    Edge(&'a str),
    Other,
}

impl Keys {
    fn classify<'a>(&self, key: &'a str) -> KeyKind<'a> {
        if key == self.table {
            KeyKind::Table
        } else if let Some(rest) = key.strip_prefix(&self.instances) {
            match rest.split_once('/') {
                Some((service, id)) if !service.is_empty() && !id.is_empty() => {
                    KeyKind::Instance { service, id }
                }
                _ => KeyKind::Other,
            }
        } else if let Some(id) = key.strip_prefix(&self.switches) {
            if id.is_empty() {
                KeyKind::Other
            } else {
                KeyKind::Switch(id)
            }
        } else if let Some(id) = key.strip_prefix(&self.edges) {
            if id.is_empty() {
                KeyKind::Other
            } else {
                KeyKind::Edge(id)
            }
        } else {
            KeyKind::Other
        }
    }
}

// ---- the sans-IO composer -----------------------------------------------------------------

/// The state of the control plane as last read from etcd and the table it implies; sans-IO
/// (events and time passed in), driven by [`EtcdRouteSource`].
#[derive(Debug)]
pub struct Composer {
    keys: Keys,
    damping: Duration,
    base: Option<RouteTable>,
    base_error: Option<String>,
    instances: BTreeMap<(String, String), InstanceRecord>,
    /// Registrations that disappeared: kept until `since + damping`.
    gone: BTreeMap<(String, String), (InstanceRecord, Instant)>,
    switches: BTreeMap<String, Switch>,
    edges: BTreeMap<String, EdgeInfo>,
    revision: i64,
    published: Option<RouteTable>,
    loads_changed: bool,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn same_routes(a: &RouteTable, b: &RouteTable) -> bool {
    a.services == b.services && a.assignments == b.assignments
}

impl Composer {
    /// An empty view of the keys under `prefix`; vanished registrations are kept for
    /// `damping`.
    #[must_use]
    pub fn new(prefix: &str, damping: Duration) -> Self {
        Self {
            keys: Keys::new(prefix),
            damping,
            base: None,
            base_error: None,
            instances: BTreeMap::new(),
            gone: BTreeMap::new(),
            switches: BTreeMap::new(),
            edges: BTreeMap::new(),
            revision: 0,
            published: None,
            loads_changed: false,
        }
    }

    /// The etcd revision everything up to which has been applied.
    #[must_use]
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The table published last (its epoch is the floor of the next one).
    #[must_use]
    pub fn published(&self) -> Option<&RouteTable> {
        self.published.as_ref()
    }

    /// Starts from a table published earlier (the persisted last good one).
    pub fn set_published(&mut self, table: RouteTable) {
        self.published = Some(table);
    }

    /// Why the base table key is unusable, if it is.
    #[must_use]
    pub fn base_error(&self) -> Option<&str> {
        self.base_error.as_deref()
    }

    /// Last load report of every registered instance (including damped ones).
    #[must_use]
    pub fn loads(&self) -> BTreeMap<String, Load> {
        self.instances
            .iter()
            .map(|((_, id), r)| (id.clone(), r.load))
            .collect()
    }

    /// The registered edges.
    #[must_use]
    pub fn edges(&self) -> Vec<EdgeInfo> {
        self.edges.values().cloned().collect()
    }

    /// Records that every change up to `revision` has been applied (a watch progress
    /// notification).
    pub fn advance(&mut self, revision: i64) {
        self.revision = self.revision.max(revision);
    }

    /// Applies a put of `key` at `revision`.
    pub fn put(&mut self, key: &[u8], value: &[u8], revision: i64, now: Instant) {
        self.revision = self.revision.max(revision);
        let Ok(key) = std::str::from_utf8(key) else {
            return;
        };
        match self.keys.classify(key) {
            KeyKind::Table => {
                let format = match value.iter().find(|b| !b.is_ascii_whitespace()) {
                    Some(b'{') => TableFormat::Json,
                    _ => TableFormat::Toml,
                };
                match RouteTable::from_slice(value, format) {
                    Ok(t) => {
                        self.base = Some(t);
                        self.base_error = None;
                    }
                    Err(e) => {
                        tracing::warn!(key, error = %e, "etcd route table rejected; keeping the last good one");
                        self.base_error = Some(format!("{key}: {e}"));
                    }
                }
            }
            KeyKind::Instance { service, id } => {
                match serde_json::from_slice::<InstanceRecord>(value) {
                    Ok(r) => {
                        let k = (service.to_owned(), id.to_owned());
                        self.gone.remove(&k);
                        self.instances.insert(k, r);
                        self.loads_changed = true;
                    }
                    Err(e) => {
                        tracing::warn!(key, error = %e, "ignoring unreadable instance record")
                    }
                }
            }
            KeyKind::Switch(id) => match serde_json::from_slice::<Switch>(value) {
                Ok(s) => {
                    self.switches.insert(id.to_owned(), s);
                }
                Err(e) => tracing::warn!(key, error = %e, "ignoring unreadable switch"),
            },
            KeyKind::Edge(id) => match serde_json::from_slice::<EdgeInfo>(value) {
                Ok(mut e) => {
                    e.id = id.to_owned();
                    self.edges.insert(id.to_owned(), e);
                }
                Err(e) => tracing::warn!(key, error = %e, "ignoring unreadable edge record"),
            },
            KeyKind::Other => {}
        }
        let _ = now;
    }

    /// Applies a delete of `key` at `revision`.
    pub fn delete(&mut self, key: &[u8], revision: i64, now: Instant) {
        self.revision = self.revision.max(revision);
        let Ok(key) = std::str::from_utf8(key) else {
            return;
        };
        match self.keys.classify(key) {
            KeyKind::Table => {
                tracing::warn!(key, "etcd route table deleted; keeping the last good one");
                self.base_error = Some(format!("{key} was deleted"));
            }
            KeyKind::Instance { service, id } => {
                let k = (service.to_owned(), id.to_owned());
                if let Some(r) = self.instances.remove(&k) {
                    tracing::info!(service, instance = id, damping = ?self.damping, "instance registration gone; removal damped");
                    self.gone.insert(k, (r, now));
                    self.loads_changed = true;
                }
            }
            KeyKind::Switch(id) => {
                self.switches.remove(id);
            }
            KeyKind::Edge(id) => {
                self.edges.remove(id);
            }
            KeyKind::Other => {}
        }
    }

    /// Replaces everything with a full listing at `revision` (start, re-list after a
    /// compaction). Registrations missing from it start their damping window now.
    pub fn reset<'a>(
        &mut self,
        kvs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
        revision: i64,
        now: Instant,
    ) {
        let old = std::mem::take(&mut self.instances);
        let had_table = self.base.is_some();
        self.switches.clear();
        self.edges.clear();
        let mut saw_table = false;
        for (k, v) in kvs {
            saw_table |= k == self.keys.table.as_bytes();
            self.put(k, v, revision, now);
        }
        if !saw_table && had_table {
            tracing::warn!(key = %self.keys.table, "etcd route table missing; keeping the last good one");
            self.base_error = Some(format!("{} is missing", self.keys.table));
        } else if !saw_table {
            self.base_error = Some(format!("{} is missing", self.keys.table));
        }
        for (k, r) in old {
            if !self.instances.contains_key(&k) {
                self.gone.entry(k).or_insert((r, now));
            }
        }
        self.revision = revision;
        self.loads_changed = true;
    }

    /// When the next damped removal falls due.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Instant> {
        self.gone.values().map(|(_, t)| *t + self.damping).min()
    }

    /// Takes the "load reports changed" flag.
    pub fn take_loads_changed(&mut self) -> bool {
        std::mem::take(&mut self.loads_changed)
    }

    /// The effective table at `now` if it differs from the one published last (which it then
    /// becomes); `Ok(None)`: nothing to publish. Errors leave the published table in force.
    pub fn compose(&mut self, now: Instant) -> Result<Option<RouteTable>, RoutingError> {
        let damping = self.damping;
        self.gone.retain(|(service, id), (_, since)| {
            let keep = now.saturating_duration_since(*since) < damping;
            if !keep {
                tracing::info!(service, instance = %id, "damping window over: instance removed");
            }
            keep
        });
        let Some(base) = &self.base else {
            return Err(RoutingError::NoTable);
        };
        let mut t = base.clone();
        let regs = self
            .instances
            .iter()
            .chain(self.gone.iter().map(|(k, (r, _))| (k, r)));
        for ((service, id), rec) in regs {
            let spec = rec.to_spec(id);
            if let Some((owner, _)) = t.instance(id) {
                if owner.name != *service {
                    tracing::warn!(service, instance = %id, other = %owner.name, "registration ignored: the id belongs to another service");
                    continue;
                }
            }
            let probe = RouteTable {
                services: vec![waygate_routing::ServiceSpec {
                    name: service.clone(),
                    messages: Vec::new(),
                    key: waygate_routing::KeyKind::RoundRobin,
                    canary: None,
                    instances: vec![spec.clone()],
                }],
                ..RouteTable::new(0)
            };
            if let Err(e) = probe.validate() {
                tracing::warn!(service, instance = %id, error = %e, "registration ignored: invalid record");
                continue;
            }
            let Some(svc) = t.services.iter_mut().find(|s| s.name == *service) else {
                tracing::debug!(service, instance = %id, "registration of a service the table does not define");
                continue;
            };
            match svc.instances.iter_mut().find(|i| i.id == *id) {
                Some(i) => *i = spec,
                None => svc.instances.push(spec),
            }
        }
        for svc in &mut t.services {
            for i in &mut svc.instances {
                if let Some(s) = self.switches.get(&i.id) {
                    if let Some(st) = s.state {
                        i.state = st;
                    }
                    if let Some(c) = s.capacity {
                        i.capacity = Some(c);
                    }
                    if let Some(w) = s.weight.filter(|w| w.is_finite() && *w >= 0.0) {
                        i.weight = w;
                    }
                }
            }
        }
        if let Some(p) = &self.published {
            if same_routes(p, &t) {
                return Ok(None);
            }
        }
        let floor = self.published.as_ref().map_or(0, |p| p.epoch + 1);
        t.epoch = floor
            .max(u64::try_from(self.revision).unwrap_or(0))
            .max(base.epoch);
        t.updated_at = unix_ms();
        t.validate()?;
        self.published = Some(t.clone());
        Ok(Some(t))
    }
}

// ---- the route source ---------------------------------------------------------------------

/// Settings of an [`EtcdRouteSource`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdSourceConfig {
    /// etcd client URLs, e.g. `http://10.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Key prefix, e.g. `/waygate`.
    pub prefix: String,
    /// Where the last good table is persisted (JSON); `None`: not persisted.
    pub persist_path: Option<PathBuf>,
    /// How long a vanished registration stays in the table (SPEC R7).
    pub damping: Duration,
    /// Timeout of one etcd request (list, watch creation, progress answer).
    pub request_timeout: Duration,
    /// How often the live watch is checked with a progress request (staleness resolution).
    pub progress_interval: Duration,
    /// First reconnect delay; doubles up to `backoff_max` (with jitter).
    pub backoff_min: Duration,
    /// Largest reconnect delay.
    pub backoff_max: Duration,
}

impl EtcdSourceConfig {
    /// Defaults: damping 10 s, request timeout 2 s, progress every 1 s, backoff 100 ms..5 s.
    #[must_use]
    pub fn new(endpoints: Vec<String>, prefix: impl Into<String>) -> Self {
        Self {
            endpoints,
            prefix: prefix.into(),
            persist_path: None,
            damping: Duration::from_secs(10),
            request_timeout: Duration::from_secs(2),
            progress_interval: Duration::from_secs(1),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
        }
    }
}

#[derive(Debug)]
struct SrcState {
    status: SourceStatus,
    composer: Composer,
}

#[derive(Debug)]
struct SrcInner {
    cfg: EtcdSourceConfig,
    keys: Keys,
    client: Etcd,
    tx: watch::Sender<SourceUpdate>,
    loads: watch::Sender<Arc<BTreeMap<String, Load>>>,
    state: Mutex<SrcState>,
    relists: AtomicU64,
    compactions: AtomicU64,
    watch_failures: AtomicU64,
}

/// Route tables from etcd (see the module docs): watch with resume, re-list after a
/// compaction, damped removal of vanished registrations, last good table persisted.
#[derive(Debug, Clone)]
pub struct EtcdRouteSource {
    inner: Arc<SrcInner>,
}

/// Counters of an [`EtcdRouteSource`] (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EtcdSourceStats {
    /// Full listings of the prefix (start, refresh, after a compaction).
    pub relists: u64,
    /// Watches found compacted (each followed by a re-list).
    pub compactions: u64,
    /// Watches that failed (connection lost, timeout) and were re-created.
    pub watch_failures: u64,
}

fn connect_options(cfg: &EtcdSourceConfig) -> ConnectOptions {
    ConnectOptions::new()
        .with_connect_timeout(cfg.request_timeout)
        .with_keep_alive(cfg.request_timeout, cfg.request_timeout)
        .with_keep_alive_while_idle(true)
}

async fn timed<T>(
    d: Duration,
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(d, f).await {
        Ok(r) => r.map_err(EtcdError::from),
        Err(_) => Err(EtcdError::Timeout(d, what)),
    }
}

impl EtcdRouteSource {
    /// Wiring hook for the edge: [`EtcdSourceConfig::new`] with `persist` and `damping`,
    /// then [`EtcdRouteSource::open`].
    pub async fn connect(
        endpoints: Vec<String>,
        prefix: String,
        persist: Option<PathBuf>,
        damping: Duration,
    ) -> Result<Arc<Self>, EtcdError> {
        let mut cfg = EtcdSourceConfig::new(endpoints, prefix);
        cfg.persist_path = persist;
        cfg.damping = damping;
        Self::open(cfg).await.map(Arc::new)
    }

    /// Publishes the persisted last good table (if any), then lists etcd once (bounded by
    /// the request timeout). etcd being unreachable is not an error here (the table then
    /// comes later, from [`EtcdRouteSource::spawn`]'s task); only an unusable configuration
    /// is.
    pub async fn open(cfg: EtcdSourceConfig) -> Result<Self, EtcdError> {
        if cfg.endpoints.is_empty() {
            return Err(EtcdError::Config("no etcd endpoints".into()));
        }
        if !cfg.prefix.starts_with('/') || cfg.prefix.trim_end_matches('/').is_empty() {
            return Err(EtcdError::Config(format!(
                "prefix {:?} must start with '/' and not be '/' alone",
                cfg.prefix
            )));
        }
        let client = Client::connect(&cfg.endpoints, Some(connect_options(&cfg))).await?;
        let (tx, _) = watch::channel(SourceUpdate {
            table: None,
            revision: 0,
            origin: TableOrigin::None,
        });
        let (loads, _) = watch::channel(Arc::new(BTreeMap::new()));
        let status = SourceStatus {
            revision: 0,
            epoch: None,
            origin: TableOrigin::None,
            last_success: None,
            last_error: None,
            consecutive_errors: 0,
            mtime: None,
        };
        let inner = Arc::new(SrcInner {
            keys: Keys::new(&cfg.prefix),
            state: Mutex::new(SrcState {
                status,
                composer: Composer::new(&cfg.prefix, cfg.damping),
            }),
            cfg,
            client: Etcd(client),
            tx,
            loads,
            relists: AtomicU64::new(0),
            compactions: AtomicU64::new(0),
            watch_failures: AtomicU64::new(0),
        });
        inner.load_persisted();
        if let Err(e) = inner.relist().await {
            tracing::warn!(error = %e, "etcd unreachable at start; serving the persisted table if any");
        }
        Ok(Self { inner })
    }

    /// Starts the watch task (re-created with backoff on failure); it ends when the last
    /// handle of this source is dropped.
    pub fn spawn(&self) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(watch_loop(weak))
    }

    /// Load reports of the registered instances (instance id -> load); changes whenever a
    /// report arrives. Feed them to `Router::report_load` when changed.
    #[must_use]
    pub fn loads(&self) -> watch::Receiver<Arc<BTreeMap<String, Load>>> {
        self.inner.loads.subscribe()
    }

    /// The registered edges as last seen.
    #[must_use]
    pub fn edges(&self) -> Vec<EdgeInfo> {
        self.inner.lock().composer.edges()
    }

    /// The etcd client (shared; cheap to clone), e.g. for an [`EtcdRegistry`].
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.inner.client.0
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &EtcdSourceConfig {
        &self.inner.cfg
    }

    /// Counters.
    #[must_use]
    pub fn stats(&self) -> EtcdSourceStats {
        EtcdSourceStats {
            relists: self.inner.relists.load(Ordering::Relaxed),
            compactions: self.inner.compactions.load(Ordering::Relaxed),
            watch_failures: self.inner.watch_failures.load(Ordering::Relaxed),
        }
    }
}

#[async_trait]
impl RouteSource for EtcdRouteSource {
    fn watch(&self) -> watch::Receiver<SourceUpdate> {
        self.inner.tx.subscribe()
    }

    async fn refresh(&self) -> Result<SourceUpdate, RoutingError> {
        self.inner
            .relist()
            .await
            .map_err(|e| e.into_routing(&self.inner.keys.root))?;
        Ok(self.inner.tx.borrow().clone())
    }

    fn status(&self) -> SourceStatus {
        self.inner.lock().status.clone()
    }
}

impl SrcInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, SrcState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn load_persisted(&self) {
        let Some(p) = &self.cfg.persist_path else {
            return;
        };
        let loaded = std::fs::read(p)
            .map_err(|e| e.to_string())
            .and_then(|b| RouteTable::from_slice(&b, TableFormat::Json).map_err(|e| e.to_string()));
        match loaded {
            Ok(t) => {
                let mut st = self.lock();
                let epoch = t.epoch;
                st.composer.set_published(t.clone());
                st.status.revision = epoch;
                st.status.epoch = Some(epoch);
                st.status.origin = TableOrigin::Persisted;
                self.tx.send_replace(SourceUpdate {
                    table: Some(Arc::new(t)),
                    revision: epoch,
                    origin: TableOrigin::Persisted,
                });
                tracing::warn!(path = %p.display(), epoch, "serving the persisted last good route table until etcd answers");
            }
            Err(e) => {
                tracing::info!(path = %p.display(), error = %e, "no usable persisted route table")
            }
        }
    }

    fn success(st: &mut SrcState) {
        st.status.last_success = Some(Instant::now());
        st.status.consecutive_errors = 0;
        st.status.last_error = st.composer.base_error().map(str::to_owned);
    }

    fn failure(&self, e: &EtcdError) {
        let mut st = self.lock();
        st.status.consecutive_errors = st.status.consecutive_errors.saturating_add(1);
        st.status.last_error = Some(e.to_string());
    }

    /// Composes and publishes if the effective table changed; also publishes load reports.
    fn publish(&self, st: &mut SrcState, now: Instant) {
        if st.composer.take_loads_changed() {
            self.loads.send_replace(Arc::new(st.composer.loads()));
        }
        let table = match st.composer.compose(now) {
            Ok(Some(t)) => t,
            Ok(None) => {
                if st.status.origin == TableOrigin::Persisted && st.composer.base_error().is_none()
                {
                    // The persisted table is what etcd holds: it now comes from the source.
                    st.status.origin = TableOrigin::Source;
                    self.tx.send_modify(|u| u.origin = TableOrigin::Source);
                }
                return;
            }
            Err(RoutingError::NoTable) => return,
            Err(e) => {
                tracing::warn!(error = %e, "composed route table invalid; keeping the last good one");
                st.status.last_error = Some(e.to_string());
                return;
            }
        };
        if let Some(p) = &self.cfg.persist_path {
            if let Err(e) = persist(p, &table) {
                tracing::warn!(path = %p.display(), error = %e, "could not persist the last good route table");
            }
        }
        let epoch = table.epoch;
        st.status.revision = epoch;
        st.status.epoch = Some(epoch);
        st.status.origin = TableOrigin::Source;
        tracing::info!(
            epoch,
            etcd_revision = st.composer.revision(),
            "route table from etcd published"
        );
        self.tx.send_replace(SourceUpdate {
            table: Some(Arc::new(table)),
            revision: epoch,
            origin: TableOrigin::Source,
        });
    }

    async fn relist(&self) -> Result<(), EtcdError> {
        let mut c = self.client.0.clone();
        let res = timed(
            self.cfg.request_timeout,
            "list",
            c.get(
                self.keys.root.as_str(),
                Some(GetOptions::new().with_prefix()),
            ),
        )
        .await;
        let resp = match res {
            Ok(r) => r,
            Err(e) => {
                self.failure(&e);
                return Err(e);
            }
        };
        self.relists.fetch_add(1, Ordering::Relaxed);
        let revision = resp.header().map_or(0, |h| h.revision());
        let now = Instant::now();
        let mut st = self.lock();
        st.composer.reset(
            resp.kvs().iter().map(|kv| (kv.key(), kv.value())),
            revision,
            now,
        );
        Self::success(&mut st);
        self.publish(&mut st, now);
        Ok(())
    }

    /// One watch from the last revision seen: returns when it fails (`Err`) or after a
    /// compaction re-list (`Ok`: create the next watch at once). Holds only `weak` while
    /// waiting, so dropping the source ends it.
    async fn watch_once(weak: &Weak<Self>) -> Result<(), EtcdError> {
        let (mut stream, timeout, every): (WatchStream, Duration, Duration) = {
            let Some(inner) = weak.upgrade() else {
                return Ok(());
            };
            if inner.lock().composer.revision() == 0 {
                inner.relist().await?;
            }
            let start = inner.lock().composer.revision() + 1;
            let mut c = inner.client.0.clone();
            let opts = WatchOptions::new()
                .with_prefix()
                .with_start_revision(start)
                .with_progress_notify();
            let stream = timed(
                inner.cfg.request_timeout,
                "watch",
                c.watch(inner.keys.root.as_str(), Some(opts)),
            )
            .await?;
            (
                stream,
                inner.cfg.request_timeout,
                inner.cfg.progress_interval,
            )
        };
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_heard = tokio::time::Instant::now();
        loop {
            let deadline = {
                let Some(inner) = weak.upgrade() else {
                    return Ok(());
                };
                let next = inner.lock().composer.next_deadline();
                next.map(|d| tokio::time::Instant::from_std(d) + Duration::from_millis(1))
            };
            let damped = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                msg = stream.message() => {
                    let Some(resp) = msg? else {
                        return Err(EtcdError::WatchCancelled("stream ended".into()));
                    };
                    last_heard = tokio::time::Instant::now();
                    let Some(inner) = weak.upgrade() else { return Ok(()) };
                    if resp.compact_revision() > 0 {
                        tracing::warn!(compacted = resp.compact_revision(), "etcd watch compacted; re-listing");
                        inner.compactions.fetch_add(1, Ordering::Relaxed);
                        inner.relist().await?;
                        return Ok(());
                    }
                    if resp.canceled() {
                        return Err(EtcdError::WatchCancelled(resp.cancel_reason().to_owned()));
                    }
                    let now = Instant::now();
                    let mut st = inner.lock();
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        match ev.event_type() {
                            EventType::Put => st.composer.put(kv.key(), kv.value(), kv.mod_revision(), now),
                            EventType::Delete => st.composer.delete(kv.key(), kv.mod_revision(), now),
                        }
                    }
                    if resp.events().is_empty() && !resp.created() {
                        // A progress notification: everything up to its revision was sent.
                        if let Some(h) = resp.header() {
                            st.composer.advance(h.revision());
                        }
                    }
                    Self::success(&mut st);
                    inner.publish(&mut st, now);
                }
                _ = tick.tick() => {
                    if last_heard.elapsed() > every + timeout {
                        return Err(EtcdError::Timeout(timeout, "watch progress"));
                    }
                    stream.request_progress().await?;
                }
                () = damped => {
                    let Some(inner) = weak.upgrade() else { return Ok(()) };
                    let mut st = inner.lock();
                    inner.publish(&mut st, Instant::now());
                }
            }
        }
    }
}

async fn watch_loop(weak: Weak<SrcInner>) {
    let mut backoff: Option<Duration> = None;
    loop {
        let started = Instant::now();
        let res = SrcInner::watch_once(&weak).await;
        let Some(inner) = weak.upgrade() else { return };
        match res {
            Ok(()) => {
                backoff = None;
                continue;
            }
            Err(e) => {
                inner.watch_failures.fetch_add(1, Ordering::Relaxed);
                inner.failure(&e);
                // Damped removals fall due while etcd is away, too.
                {
                    let mut st = inner.lock();
                    inner.publish(&mut st, Instant::now());
                }
                let (min, max) = (inner.cfg.backoff_min, inner.cfg.backoff_max);
                // A watch that ran for a while resets the backoff.
                let b = match backoff {
                    Some(b) if started.elapsed() < max => (b * 2).min(max),
                    _ => min,
                };
                backoff = Some(b);
                let jitter = rand::random_range(0.5..=1.0);
                tracing::warn!(error = %e, retry_in = ?b, "etcd watch failed; serving the last good table");
                drop(inner);
                tokio::time::sleep(b.mul_f64(jitter)).await;
            }
        }
    }
}

/// Writes `table` as JSON next to `path` and renames it into place.
fn persist(path: &Path, table: &RouteTable) -> Result<(), std::io::Error> {
    let json = table.to_json_string().map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, path)
}

// ---- the registry -------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Record {
    Instance(InstanceRecord),
    Edge(EdgeInfo),
}

impl Record {
    fn set_load(&mut self, load: Load) {
        match self {
            Self::Instance(r) => r.load = load,
            Self::Edge(e) => {
                e.sessions = load.players;
                e.msg_rate = load.msg_rate;
            }
        }
    }

    fn load(&self) -> Load {
        match self {
            Self::Instance(r) => r.load,
            Self::Edge(e) => Load {
                players: e.sessions,
                msg_rate: e.msg_rate,
            },
        }
    }

    fn encode(&self) -> Result<Vec<u8>, EtcdError> {
        Ok(match self {
            Self::Instance(r) => serde_json::to_vec(r)?,
            Self::Edge(e) => serde_json::to_vec(e)?,
        })
    }
}

#[derive(Debug, Clone)]
struct Registration {
    key: String,
    record: Record,
    ttl: i64,
    /// The etcd lease currently holding the key (changes when a lost lease is replaced).
    lease: i64,
}

/// Registers backend instances and edges in etcd with leases and reports their load
/// (SPEC R9, R10). A registration is identified by the [`LeaseId`] `register` returned, even
/// after a lost lease (etcd restarted without it, or a partition longer than the TTL) was
/// replaced by a new one on the next report.
#[derive(Debug)]
pub struct EtcdRegistry {
    client: Etcd,
    keys: Keys,
    timeout: Duration,
    regs: Mutex<BTreeMap<i64, Registration>>,
}

fn ttl_secs(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

impl EtcdRegistry {
    /// A registry writing under `prefix` with `client`.
    #[must_use]
    pub fn new(client: Client, prefix: &str) -> Self {
        Self {
            client: Etcd(client),
            keys: Keys::new(prefix),
            timeout: Duration::from_secs(2),
            regs: Mutex::new(BTreeMap::new()),
        }
    }

    /// Connects to `endpoints` (lazily: etcd may be down) and writes under `prefix`.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self, EtcdError> {
        let cfg = EtcdSourceConfig::new(endpoints.to_vec(), prefix);
        let client = Client::connect(endpoints, Some(connect_options(&cfg))).await?;
        Ok(Self::new(client, prefix))
    }

    /// The etcd client.
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.client.0
    }

    fn regs(&self) -> std::sync::MutexGuard<'_, BTreeMap<i64, Registration>> {
        self.regs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn grant_and_put(&self, key: &str, record: &Record, ttl: i64) -> Result<i64, EtcdError> {
        let mut c = self.client.0.clone();
        let lease = timed(self.timeout, "lease grant", c.lease_grant(ttl, None))
            .await?
            .id();
        let value = record.encode()?;
        timed(
            self.timeout,
            "put",
            c.put(key, value, Some(PutOptions::new().with_lease(lease))),
        )
        .await?;
        Ok(lease)
    }

    async fn add(&self, key: String, record: Record, ttl: Duration) -> Result<LeaseId, EtcdError> {
        let ttl = ttl_secs(ttl);
        let lease = self.grant_and_put(&key, &record, ttl).await?;
        tracing::info!(key, lease, ttl, "registered in etcd");
        self.regs().insert(
            lease,
            Registration {
                key,
                record,
                ttl,
                lease,
            },
        );
        Ok(LeaseId(lease))
    }

    /// Registers edge `edge.id` under `P/edges/<id>` with a lease of `ttl`.
    pub async fn register_edge(
        &self,
        edge: &EdgeInfo,
        ttl: Duration,
    ) -> Result<LeaseId, EtcdError> {
        if edge.id.is_empty() || edge.id.contains('/') {
            return Err(EtcdError::Config(format!("invalid edge id {:?}", edge.id)));
        }
        let key = format!("{}{}", self.keys.edges, edge.id);
        self.add(key, Record::Edge(edge.clone()), ttl).await
    }

    /// Registers `instance` of `service` under `P/instances/<service>/<id>`.
    pub async fn register_instance(
        &self,
        service: &str,
        instance: &InstanceSpec,
        ttl: Duration,
    ) -> Result<LeaseId, EtcdError> {
        if service.is_empty() || service.contains('/') || instance.id.is_empty() {
            return Err(EtcdError::Config(format!(
                "invalid service {service:?} or instance id {:?}",
                instance.id
            )));
        }
        let key = format!("{}{}/{}", self.keys.instances, service, instance.id);
        self.add(
            key,
            Record::Instance(InstanceRecord::from_spec(instance)),
            ttl,
        )
        .await
    }

    /// Renews the lease of registration `lease` and writes `load` into its record. A lease
    /// etcd no longer knows is replaced by a new one (same key).
    pub async fn report(&self, lease: LeaseId, load: Load) -> Result<(), EtcdError> {
        let reg = {
            let mut regs = self.regs();
            let r = regs
                .get_mut(&lease.0)
                .ok_or(EtcdError::NotRegistered(lease.0))?;
            r.record.set_load(load);
            r.clone()
        };
        let mut c = self.client.0.clone();
        let renewed = timed(
            self.timeout,
            "lease keep-alive",
            c.lease_keep_alive(reg.lease),
        )
        .await;
        let current = match renewed {
            Ok(_) => {
                let value = reg.record.encode()?;
                timed(
                    self.timeout,
                    "put",
                    c.put(
                        reg.key.as_str(),
                        value,
                        Some(PutOptions::new().with_lease(reg.lease)),
                    ),
                )
                .await?;
                reg.lease
            }
            Err(EtcdError::Etcd(etcd_client::Error::LeaseKeepAliveError(msg))) => {
                tracing::warn!(key = %reg.key, lease = reg.lease, msg, "lease lost; registering again");
                self.grant_and_put(&reg.key, &reg.record, reg.ttl).await?
            }
            Err(e) => return Err(e),
        };
        if let Some(r) = self.regs().get_mut(&lease.0) {
            r.lease = current;
        }
        Ok(())
    }

    /// Reports `load` of registration `lease` every `every` (renewing the lease) until the
    /// registration is revoked or the registry dropped. `load` is read at each report.
    pub fn spawn_reporter(
        self: &Arc<Self>,
        lease: LeaseId,
        every: Duration,
        load: watch::Receiver<Load>,
    ) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(reg) = weak.upgrade() else { return };
                let l = *load.borrow();
                match reg.report(lease, l).await {
                    Ok(()) => {}
                    Err(EtcdError::NotRegistered(_)) => return,
                    Err(e) => tracing::warn!(lease = lease.0, error = %e, "load report failed"),
                }
            }
        })
    }

    /// Removes registration `lease`: marks it `disabled` (no new players from now on), then
    /// revokes its current etcd lease, which deletes the key at once.
    pub async fn revoke_lease(&self, lease: LeaseId) -> Result<(), EtcdError> {
        let reg = self
            .regs()
            .remove(&lease.0)
            .ok_or(EtcdError::NotRegistered(lease.0))?;
        let mut c = self.client.0.clone();
        // Disabled first, so edges stop placing players on it at once; the key itself then
        // goes with the lease (and leaves their tables after the damping window).
        let mut record = reg.record.clone();
        match &mut record {
            Record::Instance(r) => r.state = InstanceState::Disabled,
            Record::Edge(e) => e.state = InstanceState::Disabled,
        }
        let disabled = timed(
            self.timeout,
            "put",
            c.put(
                reg.key.as_str(),
                record.encode()?,
                Some(PutOptions::new().with_lease(reg.lease)),
            ),
        )
        .await;
        if let Err(e) = disabled {
            tracing::debug!(key = %reg.key, error = %e, "could not mark the registration disabled");
        }
        timed(self.timeout, "lease revoke", c.lease_revoke(reg.lease)).await?;
        tracing::info!(key = %reg.key, "registration revoked");
        Ok(())
    }

    /// Revokes every registration (graceful shutdown); returns the first error.
    pub async fn shutdown(&self) -> Result<(), EtcdError> {
        let ids: Vec<i64> = self.regs().keys().copied().collect();
        let mut first = Ok(());
        for id in ids {
            if let Err(e) = self.revoke_lease(LeaseId(id)).await {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    fn key_of(&self, lease: LeaseId) -> String {
        self.regs()
            .get(&lease.0)
            .map_or_else(|| self.keys.root.clone(), |r| r.key.clone())
    }
}

#[async_trait]
impl InstanceRegistry for EtcdRegistry {
    async fn register(
        &self,
        service: &str,
        instance: &InstanceSpec,
        ttl: Duration,
    ) -> Result<LeaseId, RoutingError> {
        self.register_instance(service, instance, ttl)
            .await
            .map_err(|e| {
                e.into_routing(&format!("{}{service}/{}", self.keys.instances, instance.id))
            })
    }

    async fn keep_alive(&self, lease: LeaseId, load: LoadReport) -> Result<(), RoutingError> {
        let key = self.key_of(lease);
        let msg_rate = self
            .regs()
            .get(&lease.0)
            .map_or(0.0, |r| r.record.load().msg_rate);
        self.report(
            lease,
            Load {
                players: load.players,
                msg_rate,
            },
        )
        .await
        .map_err(|e| e.into_routing(&key))
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), RoutingError> {
        let key = self.key_of(lease);
        self.revoke_lease(lease)
            .await
            .map_err(|e| e.into_routing(&key))
    }
}

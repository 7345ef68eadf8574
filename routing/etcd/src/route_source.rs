//! Route tables from etcd (SPEC R6, R7, R9): [`EtcdRouteSource`] lists the prefix, watches
//! it with resume and re-lists after a compaction; the sans-IO [`Composer`] turns what it
//! read (base table, registrations, [`Switch`] overrides) into the effective table, with
//! damped removal of vanished registrations. The last good table is published and
//! persisted through the routing crate's [`LastGoodTable`] (as the file source does).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use etcd_client::{Client, EventType, GetOptions, WatchOptions, WatchStream};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use waygate_routing::source::{
    LastGoodTable, RouteSource, SourceStatus, SourceUpdate, TableOrigin,
};
use waygate_routing::{InstanceState, RouteTable, RoutingError, TableFormat};

use crate::{
    connect_client, timed, EdgeInfo, Etcd, EtcdAccess, EtcdError, EtcdKey, InstanceRecord, Keys,
    Load,
};

// ---- records ------------------------------------------------------------------------------

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
            EtcdKey::Table => {
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
            EtcdKey::Instance { service, id } => {
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
            EtcdKey::Switch(id) => match serde_json::from_slice::<Switch>(value) {
                Ok(s) => {
                    self.switches.insert(id.to_owned(), s);
                }
                Err(e) => tracing::warn!(key, error = %e, "ignoring unreadable switch"),
            },
            EtcdKey::Edge(id) => match serde_json::from_slice::<EdgeInfo>(value) {
                Ok(mut e) => {
                    e.id = id.to_owned();
                    self.edges.insert(id.to_owned(), e);
                }
                Err(e) => tracing::warn!(key, error = %e, "ignoring unreadable edge record"),
            },
            EtcdKey::Other => {}
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
            EtcdKey::Table => {
                tracing::warn!(key, "etcd route table deleted; keeping the last good one");
                self.base_error = Some(format!("{key} was deleted"));
            }
            EtcdKey::Instance { service, id } => {
                let k = (service.to_owned(), id.to_owned());
                if let Some(r) = self.instances.remove(&k) {
                    tracing::info!(service, instance = id, damping = ?self.damping, "instance registration gone; removal damped");
                    self.gone.insert(k, (r, now));
                    self.loads_changed = true;
                }
            }
            EtcdKey::Switch(id) => {
                self.switches.remove(id);
            }
            EtcdKey::Edge(id) => {
                self.edges.remove(id);
            }
            EtcdKey::Other => {}
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
        let floor = self
            .published
            .as_ref()
            .map_or(0, |p| p.epoch.saturating_add(1));
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
    /// The etcd user to sign in as, and TLS for `https://` endpoints.
    pub access: EtcdAccess,
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
            access: EtcdAccess::default(),
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
    last_good: LastGoodTable,
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

impl EtcdRouteSource {
    /// Wiring hook for the edge: [`EtcdSourceConfig::new`] with `persist`, `damping` and
    /// `access` (user, TLS), then [`EtcdRouteSource::open`].
    pub async fn connect(
        endpoints: Vec<String>,
        prefix: String,
        persist: Option<PathBuf>,
        damping: Duration,
        access: EtcdAccess,
    ) -> Result<Arc<Self>, EtcdError> {
        let mut cfg = EtcdSourceConfig::new(endpoints, prefix);
        cfg.persist_path = persist;
        cfg.damping = damping;
        cfg.access = access;
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
        let client = connect_client(&cfg).await?;
        let last_good = LastGoodTable::new(cfg.persist_path.clone());
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
            last_good,
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

    /// The etcd client (shared; cheap to clone), e.g. for an
    /// [`EtcdRegistry`](super::EtcdRegistry).
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
        self.inner.last_good.subscribe()
    }

    async fn refresh(&self) -> Result<SourceUpdate, RoutingError> {
        self.inner
            .relist()
            .await
            .map_err(|e| e.into_routing(&self.inner.keys.root))?;
        Ok(self.inner.last_good.current())
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
        let (Some(p), Some(loaded)) = (self.last_good.persist_path(), self.last_good.load()) else {
            return;
        };
        match loaded {
            Ok(t) => {
                let mut st = self.lock();
                let epoch = t.epoch;
                st.composer.set_published(t.clone());
                self.last_good.restore(&mut st.status, t, epoch);
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
                    self.last_good.confirm_source(&mut st.status);
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
        let epoch = table.epoch;
        self.last_good.apply(&mut st.status, table, epoch);
        tracing::info!(
            epoch,
            etcd_revision = st.composer.revision(),
            "route table from etcd published"
        );
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

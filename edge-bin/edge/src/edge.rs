//! The running edge: listeners -> sessions -> router -> backend links, and back.
//!
//! [`Edge::start`] binds every listener, loads the route table, and spawns:
//! - one accept loop per listener (new connections become session tasks, or get REJECT
//!   `draining` while the edge drains);
//! - the link event loop (pushes, kicks, refusals, binds from backends -> sessions);
//! - the route loop (table updates from the source, router ticks, migrations, health).
//!
//! The session layer talks to the edge through [`UpstreamSink`] (implemented here by
//! `EdgeUpstream`), the admin server through [`AdminApi`]. The router is a sans-IO struct
//! behind a std mutex that is never held across an await.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;
use waygate_protocol::frame::{Reject, SessionId};
use waygate_protocol::link::LinkFrame;
use waygate_routing::source::{FileRouteSource, FileSourceConfig, RouteSource};
use waygate_routing::{
    HealthConfig, KeyKind, MigrationRate, RouteRequest, RouteTable, Router, RouterConfig,
    RoutingError,
};
use waygate_session::driver::{
    DeliverError, Downstream, EdgeSessions, PushError, SessionEvent, SessionRegistry, UpstreamSink,
    WriteThrough,
};
use waygate_session::machine::{SessionConfig, Upstream};
use waygate_session::{HmacAuthenticator, KeyRing};
use waygate_transport::{BoxConnection, BoxListener, CloseCode, Frame, TransportKind};

use crate::admin::AdminApi;
use crate::cluster::etcd::{EdgeInfo, EtcdRegistry, EtcdRouteSource, Load};
use crate::cluster::redis::{DeliveryResult, PushMessage, Reassert, RedisConfig, RedisStores};
use crate::config::EdgeConfig;
use crate::link::{ForwardError, InFlight, LinkClient, LinkConfig, LinkEvent, SessionMeta};
use crate::listeners::bind_all;
use crate::metrics::{BackendLabel, ClassLabel, CodeLabel, EdgeMetrics, RouteLabels};
use crate::overload::{inbound_limits, EdgeAdmission, Governor};
use waygate_transport::listener::AdmissionGate;

/// The built-in demo route table.
pub const DEFAULT_ROUTES: &str = include_str!("default_routes.toml");

/// Why the edge could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EdgeError {
    /// A listener could not be bound or TLS material loaded.
    #[error("transport: {0}")]
    Transport(#[from] waygate_transport::TransportError),
    /// The route table could not be loaded.
    #[error("route table: {0}")]
    Routing(#[from] RoutingError),
    /// Admin server or other I/O.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// etcd or Redis settings unusable.
    #[error("cluster: {0}")]
    Cluster(String),
}

/// Per-session state the edge keeps beside the session layer. Cloned for every upstream
/// message (the lock is not held while routing), so its parts are shared: a clone is three
/// reference counts, and writers copy on write (`Arc::make_mut`).
#[derive(Debug, Clone)]
struct SessionEntry {
    meta: Arc<SessionMeta>,
    /// service -> business key, set by backends with BIND.
    keys: Arc<HashMap<String, String>>,
    /// Backend addresses this session was opened on.
    links: Arc<HashSet<SocketAddr>>,
}

#[derive(Debug, Default)]
struct Sessions {
    by_id: HashMap<SessionId, SessionEntry>,
    by_handle: HashMap<u64, SessionId>,
    next_handle: u64,
}

struct Shared {
    config: EdgeConfig,
    metrics: EdgeMetrics,
    sessions: OnceLock<Arc<EdgeSessions>>,
    router: Mutex<Router>,
    source: Option<Arc<dyn RouteSource>>,
    /// Where the table comes from: "etcd", "file" or "embedded".
    source_kind: &'static str,
    /// The etcd source (load reports, registered edges), when configured.
    etcd: Option<Arc<EtcdRouteSource>>,
    /// This edge's etcd registration (revoked on drain).
    etcd_registry: Option<Arc<EtcdRegistry>>,
    /// Redis stores, when configured.
    redis: Option<RedisStores>,
    epoch: Arc<AtomicU64>,
    links: Mutex<HashMap<SocketAddr, LinkClient>>,
    link_events: mpsc::Sender<LinkEvent>,
    entries: Mutex<Sessions>,
    draining: AtomicBool,
    started: Instant,
    addrs: BTreeMap<TransportKind, SocketAddr>,
    /// Instance id -> address, from every table seen (to find the link of a moved binding).
    instance_addrs: Mutex<HashMap<String, SocketAddr>>,
    /// Admission control of every listener (B1).
    admission: Arc<EdgeAdmission>,
    /// Overload levels (B5).
    governor: Arc<Governor>,
}

/// A running edge.
pub struct Edge {
    shared: Arc<Shared>,
    /// Bound address per transport.
    pub addrs: BTreeMap<TransportKind, SocketAddr>,
    /// Bound admin address, when enabled.
    pub admin_addr: Option<SocketAddr>,
    /// PEM of the generated development CA (None with configured certificates).
    pub dev_ca_pem: Option<String>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge").field("addrs", &self.addrs).finish()
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn now_std() -> std::time::Instant {
    Instant::now().into_std()
}

impl Edge {
    /// Starts an edge with `config`.
    pub async fn start(config: EdgeConfig) -> Result<Edge, EdgeError> {
        let admission = Arc::new(EdgeAdmission::new(
            &config.backpressure,
            Duration::from_millis(config.limits.handshake_timeout_ms),
        ));
        let governor = Arc::new(Governor::new(&config.backpressure));
        let bound = bind_all(&config, Some(admission.clone() as Arc<dyn AdmissionGate>)).await?;
        let mut router = Router::new(
            RouterConfig {
                migration_rate: MigrationRate {
                    per_second: config.routing.migration_rate,
                    burst: (config.routing.migration_rate.ceil() as u32).max(1),
                },
                health: Some(HealthConfig {
                    heartbeat_interval: Duration::from_millis(config.links.heartbeat_ms),
                    missed_heartbeats: config.routing.missed_heartbeats.max(1),
                    min_rebuild_interval: Duration::from_millis(config.links.heartbeat_ms),
                }),
                ..RouterConfig::default()
            },
            now_std(),
        );
        let mut etcd: Option<Arc<EtcdRouteSource>> = None;
        let mut tasks = Vec::new();
        let mut source_kind = "embedded";
        let source: Option<Arc<dyn RouteSource>> = match &config.routing.table {
            _ if !config.cluster.etcd_endpoints.is_empty() => {
                let c = &config.cluster;
                let src = EtcdRouteSource::connect(
                    c.etcd_endpoints.clone(),
                    c.etcd_prefix.clone(),
                    config.routing.persist.clone(),
                    Duration::from_millis(c.damping_ms),
                )
                .await
                .map_err(|e| EdgeError::Cluster(e.to_string()))?;
                // The first table: listed at open, or persisted; give a slow etcd a moment.
                let mut w = src.watch();
                let first =
                    tokio::time::timeout(Duration::from_secs(5), w.wait_for(|u| u.table.is_some()))
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .and_then(|u| u.table.clone());
                match first {
                    Some(table) => {
                        router.apply_table((*table).clone(), now_std())?;
                    }
                    None => return Err(EdgeError::Routing(RoutingError::NoTable)),
                }
                source_kind = "etcd";
                tasks.push(src.spawn());
                etcd = Some(src.clone());
                Some(src)
            }
            Some(path) => {
                let mut cfg = FileSourceConfig::new(path.clone())
                    .poll_every(Duration::from_millis(config.routing.poll_ms.max(10)));
                if let Some(p) = &config.routing.persist {
                    cfg = cfg.persist_to(p.clone());
                }
                let source = Arc::new(FileRouteSource::open(cfg));
                source_kind = "file";
                let update = source.watch().borrow().clone();
                match update.table {
                    Some(table) => {
                        router.apply_table((*table).clone(), now_std())?;
                    }
                    None => {
                        return Err(EdgeError::Routing(
                            source
                                .refresh()
                                .await
                                .err()
                                .unwrap_or(RoutingError::NoTable),
                        ))
                    }
                }
                tasks.push(source.spawn());
                Some(source)
            }
            None => {
                router.apply_table(RouteTable::from_toml_str(DEFAULT_ROUTES)?, now_std())?;
                None
            }
        };
        let redis = if config.cluster.redis_url.is_empty() {
            None
        } else {
            // Lazy: an edge may start while Redis is down (logins get UNAVAILABLE until
            // it is back; live sessions are unaffected).
            let rc = RedisConfig {
                prefix: config.cluster.redis_prefix.clone(),
                ..RedisConfig::new(config.cluster.redis_url.clone())
            };
            Some(RedisStores::lazy(rc).map_err(|e| EdgeError::Cluster(e.to_string()))?)
        };
        let etcd_registry = etcd.as_ref().map(|src| {
            Arc::new(EtcdRegistry::new(
                src.client().clone(),
                &config.cluster.etcd_prefix,
            ))
        });
        let epoch = Arc::new(AtomicU64::new(router.epoch().unwrap_or(0)));
        let (link_tx, link_rx) = mpsc::channel(4096);
        let shared = Arc::new(Shared {
            metrics: EdgeMetrics::new(),
            sessions: OnceLock::new(),
            router: Mutex::new(router),
            source,
            source_kind,
            etcd,
            etcd_registry,
            redis,
            epoch,
            links: Mutex::new(HashMap::new()),
            link_events: link_tx,
            entries: Mutex::new(Sessions::default()),
            draining: AtomicBool::new(false),
            started: Instant::now(),
            addrs: bound.addrs.clone(),
            instance_addrs: Mutex::new(HashMap::new()),
            admission,
            governor,
            config,
        });
        shared.learn_instances();
        shared
            .metrics
            .route_epoch
            .set(shared.epoch.load(Ordering::Relaxed) as i64);

        let mut keys = KeyRing::new();
        for k in &shared.config.auth.keys {
            keys.insert(k.id, k.secret.as_bytes());
        }
        let mut auth = HmacAuthenticator::new(keys)
            .with_leeway(Duration::from_secs(shared.config.auth.leeway_secs));
        if !shared.config.auth.issuers.is_empty() {
            auth = auth.with_allowed_issuers(shared.config.auth.issuers.clone());
        }
        let s = &shared.config.session;
        let session_config = SessionConfig {
            handshake_timeout: Duration::from_millis(s.hello_timeout_ms),
            idle_timeout: Duration::from_millis(shared.config.limits.idle_timeout_ms),
            heartbeat_interval: Duration::from_millis(s.heartbeat_ms),
            linger: Duration::from_secs(s.linger_secs),
            max_frame_size: shared.config.limits.max_frame_size as u32,
            replay: waygate_session::replay::ReplayLimits {
                max_messages: s.replay_max_messages,
                max_bytes: s.replay_max_bytes,
            },
            ..SessionConfig::default()
        };
        let mut edge_sessions = EdgeSessions::new(
            shared.config.edge_id.clone(),
            session_config,
            Arc::new(auth),
            Arc::new(EdgeUpstream(Arc::downgrade(&shared))),
        );
        edge_sessions.outbound_capacity = s.outbound_capacity;
        edge_sessions.inbound = Some(inbound_limits(&shared.config.backpressure));
        edge_sessions.send_deadline =
            Duration::from_millis(shared.config.backpressure.send_deadline_ms);
        if let Some(r) = &shared.redis {
            edge_sessions.snapshots = r.snapshots.clone();
            edge_sessions.ownership = r.ownership.clone();
            if shared.config.cluster.write_through {
                edge_sessions.write_through =
                    Some(Arc::new(WriteThrough::new(Duration::from_secs(1))));
            }
        }
        let _ = shared.sessions.set(Arc::new(edge_sessions));

        // Give the backend links a moment to come up before the first client arrives (an
        // edge that accepted players before its links were up would answer UNAVAILABLE).
        let links_up = tokio::time::timeout(Duration::from_secs(3), async {
            loop {
                let all_up = shared
                    .links
                    .lock()
                    .map(|l| l.values().all(LinkClient::is_up))
                    .unwrap_or(true);
                if all_up {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        if links_up.is_err() {
            tracing::warn!("starting with some backend links still down");
        }

        tasks.extend(start_cluster_tasks(&shared).await);
        for listener in bound.listeners {
            tasks.push(tokio::spawn(accept_loop(shared.clone(), listener)));
        }
        tasks.push(tokio::spawn(link_event_loop(
            Arc::downgrade(&shared),
            link_rx,
        )));
        tasks.push(tokio::spawn(route_loop(Arc::downgrade(&shared))));
        tasks.push(tokio::spawn(overload_loop(Arc::downgrade(&shared))));
        let admin_addr = if shared.config.admin.enabled {
            let api: Arc<dyn AdminApi> = Arc::new(EdgeAdmin(shared.clone()));
            let (addr, task) = crate::admin::serve(shared.config.admin.addr, api).await?;
            tasks.push(task);
            Some(addr)
        } else {
            None
        };
        tracing::info!(edge = %shared.config.edge_id, addrs = ?bound.addrs, admin = ?admin_addr, "edge started");
        Ok(Edge {
            addrs: bound.addrs,
            admin_addr,
            dev_ca_pem: bound.tls.dev_ca_pem.clone(),
            shared,
            tasks,
        })
    }

    /// The admin API of this edge (for in-process use and tests).
    pub fn admin(&self) -> Arc<dyn AdminApi> {
        Arc::new(EdgeAdmin(self.shared.clone()))
    }

    /// This edge's id.
    pub fn edge_id(&self) -> &str {
        &self.shared.config.edge_id
    }

    /// The session registry.
    pub fn registry(&self) -> SessionRegistry {
        self.shared.edge_sessions().registry.clone()
    }

    /// Whether a drain was started.
    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::Acquire)
    }

    /// Waits until a drain finished: every session left, or the drain deadline passed.
    pub async fn drained(&self) {
        let deadline = Duration::from_millis(self.shared.config.drain.deadline_ms);
        let _ = tokio::time::timeout(deadline, async {
            loop {
                if self.is_draining() && self.registry().is_empty() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
    }
}

impl Shared {
    fn edge_sessions(&self) -> &Arc<EdgeSessions> {
        // Set right after construction in `Edge::start`, before any task runs.
        self.sessions
            .get()
            .unwrap_or_else(|| unreachable!("sessions set at start"))
    }

    /// Records the instances of the current table and opens a link to every backend
    /// address (an edge keeps one link per backend, up before the first message).
    fn learn_instances(&self) {
        let table = match self.router.lock() {
            Ok(router) => router.table().cloned(),
            Err(_) => None,
        };
        let Some(table) = table else { return };
        let mut addrs = Vec::new();
        if let Ok(mut map) = self.instance_addrs.lock() {
            for service in &table.services {
                for i in &service.instances {
                    if let Ok(addr) = i.address.parse::<SocketAddr>() {
                        map.insert(i.id.clone(), addr);
                        addrs.push(addr);
                    }
                }
            }
        }
        for addr in addrs {
            self.link(addr);
        }
    }

    fn link(&self, addr: SocketAddr) -> LinkClient {
        let mut links = match self.links.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        links
            .entry(addr)
            .or_insert_with(|| {
                let config = LinkConfig {
                    edge_id: self.config.edge_id.clone(),
                    push_credits: self.config.links.push_credits,
                    heartbeat: Duration::from_millis(self.config.links.heartbeat_ms),
                    busy_retry_after_ms: self.config.links.busy_retry_after_ms,
                    ..LinkConfig::default()
                };
                let (client, _task) =
                    LinkClient::spawn(addr, config, self.epoch.clone(), self.link_events.clone());
                client
            })
            .clone()
    }

    fn entry(&self, session_id: &SessionId, player: &str) -> SessionEntry {
        let mut e = match self.entries.lock() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(entry) = e.by_id.get(session_id) {
            return entry.clone();
        }
        e.next_handle += 1;
        let handle = e.next_handle;
        let entry = SessionEntry {
            meta: Arc::new(SessionMeta {
                handle,
                session_id: *session_id,
                player_id: player.to_string(),
                fencing: 0,
                attrs: vec![("edge".into(), self.config.edge_id.clone())],
            }),
            keys: Arc::new(HashMap::new()),
            links: Arc::new(HashSet::new()),
        };
        e.by_handle.insert(handle, *session_id);
        e.by_id.insert(*session_id, entry.clone());
        entry
    }

    /// Routes and forwards one upstream message.
    fn route_and_forward(
        &self,
        entry: &SessionEntry,
        msg_id: u32,
        client_seq: u64,
        class: waygate_transport::TrafficClass,
        payload: bytes::Bytes,
    ) -> Result<(), DeliverError> {
        let refuse = |code: CloseCode, retry_after_ms: u32| {
            self.metrics
                .upstream_refused
                .get_or_create(&CodeLabel {
                    code: code.as_str().into(),
                })
                .inc();
            DeliverError {
                code,
                retry_after_ms,
            }
        };
        let decision = {
            let mut router = self
                .router
                .lock()
                .map_err(|_| refuse(CloseCode::Internal, 0))?;
            let mut req = RouteRequest::player(&entry.meta.player_id);
            if let Some(table) = router.table().cloned() {
                for (service, key) in entry.keys.iter() {
                    if let Some(spec) = table.services.iter().find(|s| &s.name == service) {
                        req = match spec.key {
                            KeyKind::Room => req.room(key),
                            KeyKind::Guild => req.guild(key),
                            KeyKind::Order => req.order(key),
                            _ => req,
                        };
                    }
                }
            }
            router.route(msg_id, &req)
        };
        let decision = match decision {
            Ok(d) => d,
            Err(RoutingError::NoServiceForMessage { .. }) => {
                return Err(refuse(CloseCode::NoRoute, 0))
            }
            Err(e) => {
                tracing::debug!(msg_id, error = %e, "no route");
                return Err(refuse(CloseCode::Unavailable, 1000));
            }
        };
        let addr: SocketAddr = decision
            .address
            .parse()
            .map_err(|_| refuse(CloseCode::Unavailable, 1000))?;
        let link = self.link(addr);
        match link.forward(
            &entry.meta,
            msg_id,
            decision.epoch,
            client_seq,
            class,
            payload,
        ) {
            Ok(()) => {
                if let Ok(mut e) = self.entries.lock() {
                    if let Some(en) = e.by_id.get_mut(&entry.meta.session_id) {
                        Arc::make_mut(&mut en.links).insert(addr);
                    }
                }
                self.metrics
                    .forwarded
                    .get_or_create(&RouteLabels {
                        service: decision.service,
                        instance: decision.instance_id,
                    })
                    .inc();
                Ok(())
            }
            Err(ForwardError::Unavailable) => Err(refuse(CloseCode::Unavailable, 1000)),
            Err(ForwardError::Busy { retry_after_ms }) => {
                Err(refuse(CloseCode::Busy, retry_after_ms))
            }
        }
    }

    fn session_of_handle(&self, handle: u64) -> Option<SessionId> {
        self.entries.lock().ok()?.by_handle.get(&handle).copied()
    }

    async fn report_error(
        &self,
        session_id: &SessionId,
        code: CloseCode,
        msg_id: u32,
        client_seq: u64,
        retry_after_ms: u32,
    ) {
        let registry = &self.edge_sessions().registry;
        if !registry
            .report_error(session_id, code, msg_id, client_seq, retry_after_ms)
            .await
        {
            tracing::debug!(%code, msg_id, "refusal for a session that is gone");
        }
    }

    async fn close_on_links(
        &self,
        entry: &SessionEntry,
        code: CloseCode,
        only: Option<SocketAddr>,
    ) {
        let links: Vec<LinkClient> = match self.links.lock() {
            Ok(l) => entry
                .links
                .iter()
                .filter(|a| only.is_none_or(|o| o == **a))
                .filter_map(|a| l.get(a).cloned())
                .collect(),
            Err(_) => Vec::new(),
        };
        for link in links {
            link.session_event(LinkFrame::SessionClose {
                handle: entry.meta.handle,
                code,
            })
            .await;
        }
    }

    async fn lifecycle_on_links(&self, entry: &SessionEntry, frame: LinkFrame) {
        let links: Vec<LinkClient> = match self.links.lock() {
            Ok(l) => entry
                .links
                .iter()
                .filter_map(|a| l.get(a).cloned())
                .collect(),
            Err(_) => Vec::new(),
        };
        for link in links {
            link.session_event(frame.clone()).await;
        }
    }
}

/// The session layer's view of the edge.
struct EdgeUpstream(Weak<Shared>);

#[async_trait]
impl UpstreamSink for EdgeUpstream {
    async fn deliver(&self, message: Upstream) -> Result<(), DeliverError> {
        let shared = self.0.upgrade().ok_or(DeliverError {
            code: CloseCode::GoingAway,
            retry_after_ms: 0,
        })?;
        let entry = shared.entry(&message.session_id, &message.player_id);
        shared.route_and_forward(
            &entry,
            message.msg_id,
            message.seq,
            message.class,
            message.payload,
        )
    }

    async fn session_event(&self, event: SessionEvent) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        match event {
            SessionEvent::Established {
                session_id,
                player_id,
                fencing,
                outcome,
                transport,
                setup,
            } => {
                shared
                    .metrics
                    .session_setup_seconds
                    .get_or_create(&EdgeMetrics::transport(transport))
                    .observe(setup.as_secs_f64());
                if let Some(r) = &shared.redis {
                    let (presence, edge) = (r.presence.clone(), shared.config.edge_id.clone());
                    let player = player_id.to_string();
                    tokio::spawn(async move {
                        if let Err(e) = presence.set(&player, &session_id, &edge).await {
                            tracing::debug!(error = %e, "presence not recorded");
                        }
                    });
                }
                let mut entry = shared.entry(&session_id, &player_id);
                if let Ok(mut e) = shared.entries.lock() {
                    if let Some(en) = e.by_id.get_mut(&session_id) {
                        Arc::make_mut(&mut en.meta).fencing = fencing;
                        entry = en.clone();
                    }
                }
                use waygate_protocol::frame::WelcomeOutcome;
                if matches!(
                    outcome,
                    WelcomeOutcome::Restored | WelcomeOutcome::RestoredWithGap
                ) {
                    shared
                        .lifecycle_on_links(
                            &entry,
                            LinkFrame::SessionReattached {
                                handle: entry.meta.handle,
                                gap: outcome == WelcomeOutcome::RestoredWithGap,
                            },
                        )
                        .await;
                }
            }
            SessionEvent::Detached { session_id, linger } => {
                let entry = shared
                    .entries
                    .lock()
                    .ok()
                    .and_then(|e| e.by_id.get(&session_id).cloned());
                if let Some(entry) = entry {
                    shared
                        .lifecycle_on_links(
                            &entry,
                            LinkFrame::SessionDetached {
                                handle: entry.meta.handle,
                                linger_ms: u32::try_from(linger.as_millis()).unwrap_or(u32::MAX),
                            },
                        )
                        .await;
                }
            }
            SessionEvent::Ended {
                session_id,
                player_id,
                reason,
                released,
                ..
            } => {
                let entry = shared.entries.lock().ok().and_then(|mut e| {
                    let entry = e.by_id.remove(&session_id)?;
                    e.by_handle.remove(&entry.meta.handle);
                    Some(entry)
                });
                if let Some(entry) = entry {
                    let code = match reason {
                        waygate_session::EndReason::Kicked => CloseCode::Kicked,
                        waygate_session::EndReason::LingerExpired => CloseCode::SessionExpired,
                        waygate_session::EndReason::ClosedByServer(c) => c,
                        _ => CloseCode::Normal,
                    };
                    shared.close_on_links(&entry, code, None).await;
                }
                if let Some(r) = &shared.redis {
                    let presence = r.presence.clone();
                    let player = player_id.to_string();
                    tokio::spawn(async move {
                        let _ = presence.remove(&player, &session_id).await;
                    });
                }
                if released {
                    if let Ok(mut router) = shared.router.lock() {
                        router.release_key(&player_id);
                    }
                }
            }
            _ => {}
        }
    }
}

async fn accept_loop(shared: Arc<Shared>, mut listener: BoxListener) {
    let kind = listener.kind();
    let label = EdgeMetrics::transport(kind);
    while let Some(mut conn) = listener.accept().await {
        shared
            .metrics
            .connections_accepted
            .get_or_create(&label)
            .inc();
        if shared.draining.load(Ordering::Acquire) {
            let retry = shared.config.drain.retry_after_ms;
            tokio::spawn(async move { refuse(&mut conn, CloseCode::Draining, retry).await });
            continue;
        }
        let gauge = shared
            .metrics
            .connections_open
            .get_or_create(&label)
            .clone();
        gauge.inc();
        let task = shared.edge_sessions().spawn(conn);
        tokio::spawn(async move {
            let _ = task.await;
            gauge.dec();
        });
    }
}

/// Answers a connection with REJECT and closes it.
async fn refuse(conn: &mut BoxConnection, code: CloseCode, retry_after_ms: u32) {
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = conn
            .send(&Frame::Reject(Reject {
                code,
                retry_after_ms,
                message: code.as_str().into(),
            }))
            .await;
        conn.close(code, code.as_str()).await;
    })
    .await;
}

async fn link_event_loop(shared: Weak<Shared>, mut rx: mpsc::Receiver<LinkEvent>) {
    while let Some(event) = rx.recv().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match event {
            LinkEvent::Push {
                handle,
                msg_id,
                class,
                payload,
            } => {
                let label = ClassLabel {
                    class: class.as_str().into(),
                };
                if class == waygate_transport::TrafficClass::BestEffort
                    && shared.governor.shed_best_effort.load(Ordering::Acquire)
                {
                    shared.metrics.overload_shed.inc();
                    continue;
                }
                let pushed = shared.session_of_handle(handle).map(|sid| {
                    shared.edge_sessions().registry.push(
                        &sid,
                        Downstream {
                            class,
                            msg_id,
                            payload,
                        },
                    )
                });
                match pushed {
                    Some(Ok(())) => shared.metrics.pushed.get_or_create(&label).inc(),
                    _ => shared.metrics.push_dropped.get_or_create(&label).inc(),
                };
            }
            LinkEvent::Kick { handle, code, .. } => {
                if let Some(sid) = shared.session_of_handle(handle) {
                    shared.edge_sessions().registry.close(&sid, code).await;
                }
            }
            LinkEvent::Refuse {
                handle,
                msg_id,
                client_seq,
                code,
                retry_after_ms,
                epoch,
                message,
            } => {
                let Some(sid) = shared.session_of_handle(handle) else {
                    continue;
                };
                if code == CloseCode::StaleEpoch {
                    if let (Some(m), Some(result)) = (message, reroute(&shared, sid, epoch).await) {
                        shared.metrics.stale_epoch_reroutes.inc();
                        let InFlight {
                            msg_id,
                            client_seq,
                            class,
                            payload,
                            ..
                        } = m;
                        let outcome = result.and_then(|entry| {
                            shared.route_and_forward(&entry, msg_id, client_seq, class, payload)
                        });
                        if let Err(e) = outcome {
                            shared
                                .report_error(&sid, e.code, msg_id, client_seq, e.retry_after_ms)
                                .await;
                        }
                        continue;
                    }
                }
                shared
                    .report_error(&sid, code, msg_id, client_seq, retry_after_ms)
                    .await;
            }
            LinkEvent::Bind {
                handle,
                service,
                key,
            } => {
                if let Ok(mut e) = shared.entries.lock() {
                    if let Some(sid) = e.by_handle.get(&handle).copied() {
                        if let Some(entry) = e.by_id.get_mut(&sid) {
                            Arc::make_mut(&mut entry.keys).insert(service, key);
                        }
                    }
                }
            }
            LinkEvent::Pin {
                kind,
                key,
                instance_id,
            } => {
                tracing::info!(?kind, %key, %instance_id, "backend PIN received (dynamic pins are not applied yet; use table assignments)");
            }
            LinkEvent::Up { addr, .. } => {
                shared
                    .metrics
                    .backend_up
                    .get_or_create(&BackendLabel {
                        backend: addr.to_string(),
                    })
                    .set(1);
            }
            LinkEvent::Down { addr } => {
                shared
                    .metrics
                    .backend_up
                    .get_or_create(&BackendLabel {
                        backend: addr.to_string(),
                    })
                    .set(0);
            }
        }
    }
}

/// After a stale-epoch refusal: refresh the table (file source) if the backend is ahead,
/// then hand back the session's entry for a second routing attempt.
async fn reroute(
    shared: &Arc<Shared>,
    sid: SessionId,
    backend_epoch: u64,
) -> Option<Result<SessionEntry, DeliverError>> {
    if shared.epoch.load(Ordering::Relaxed) < backend_epoch {
        if let Some(source) = &shared.source {
            let _ = source.refresh().await;
            apply_latest(shared);
        }
    }
    if shared.epoch.load(Ordering::Relaxed) < backend_epoch {
        return Some(Err(DeliverError {
            code: CloseCode::Unavailable,
            retry_after_ms: 1000,
        }));
    }
    let entry = shared.entries.lock().ok()?.by_id.get(&sid).cloned()?;
    Some(Ok(entry))
}

fn apply_latest(shared: &Shared) {
    let Some(source) = &shared.source else { return };
    let update = source.watch().borrow().clone();
    let Some(table) = update.table else { return };
    let applied = match shared.router.lock() {
        Ok(mut router) => {
            if router.epoch().is_some_and(|e| table.epoch <= e) {
                return;
            }
            router.apply_table((*table).clone(), now_std())
        }
        Err(_) => return,
    };
    match applied {
        Ok(report) => {
            shared.epoch.store(table.epoch, Ordering::Release);
            shared.metrics.route_epoch.set(table.epoch as i64);
            shared.learn_instances();
            tracing::info!(epoch = table.epoch, ?report, "route table applied");
        }
        Err(e) => tracing::warn!(error = %e, "route table refused"),
    }
}

async fn route_loop(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch = shared
        .upgrade()
        .and_then(|s| s.source.as_ref().map(|src| src.watch()));
    loop {
        match watch.as_mut() {
            Some(w) => {
                tokio::select! {
                    _ = tick.tick() => {}
                    changed = w.changed() => if changed.is_err() { watch = None; },
                }
            }
            None => {
                tick.tick().await;
            }
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        apply_latest(&shared);
        if let Some(source) = &shared.source {
            let staleness = source
                .status()
                .staleness(now_std())
                .map_or(f64::INFINITY, |d| d.as_secs_f64());
            shared.metrics.route_staleness_seconds.set(staleness);
        }
        // Health: an instance whose link is up is alive; the router declares the others
        // down after K missed heartbeats and migrates their players (R7).
        let up: Vec<SocketAddr> = shared
            .links
            .lock()
            .map(|l| l.values().filter(|c| c.is_up()).map(|c| c.addr()).collect())
            .unwrap_or_default();
        let alive: Vec<String> = shared
            .instance_addrs
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, a)| {
                        up.contains(a)
                            || !shared
                                .links
                                .lock()
                                .map(|l| l.contains_key(a))
                                .unwrap_or(false)
                    })
                    .map(|(id, _)| id.clone())
                    .collect()
            })
            .unwrap_or_default();
        let mut moved = Vec::new();
        if let Ok(mut router) = shared.router.lock() {
            let now = now_std();
            for id in &alive {
                router.heartbeat(id, now);
            }
            router.tick(now);
            while let Some(m) = router.poll_migration(now) {
                moved.push(m);
            }
        }
        for m in moved {
            shared.metrics.migrations.inc();
            tracing::info!(key = %m.key, from = %m.from, to = ?m.to, "binding migrated");
            let from_addr = shared
                .instance_addrs
                .lock()
                .ok()
                .and_then(|a| a.get(&m.from).copied());
            let entries: Vec<SessionEntry> = shared
                .entries
                .lock()
                .map(|e| {
                    e.by_id
                        .values()
                        .filter(|en| {
                            en.meta.player_id == m.key || en.keys.values().any(|k| k == &m.key)
                        })
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            if let Some(from) = from_addr {
                for entry in entries {
                    shared
                        .close_on_links(&entry, CloseCode::GoingAway, Some(from))
                        .await;
                    if let Ok(mut e) = shared.entries.lock() {
                        if let Some(en) = e.by_id.get_mut(&entry.meta.session_id) {
                            Arc::make_mut(&mut en.links).remove(&from);
                        }
                    }
                }
            }
        }
    }
}

/// Feeds the overload governor (B5) and applies its decisions: level 1 sheds best-effort
/// pushes, level 3 makes admission refuse every new connection with a retry-after.
async fn overload_loop(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweeps = 0u32;
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let sessions = shared.edge_sessions().registry.len() as u64;
        let memory = waygate_transport::backpressure::process_rss_bytes().unwrap_or(0);
        let refuse = shared.governor.observe(sessions, memory);
        shared.admission.refuse_all(refuse);
        let level = shared.governor.level.load(Ordering::Acquire);
        shared.metrics.overload_level.set(i64::from(level));
        let refused = shared.admission.refused.load(Ordering::Relaxed);
        let counted = shared.metrics.admission_refused.get();
        if refused > counted {
            shared.metrics.admission_refused.inc_by(refused - counted);
        }
        sweeps += 1;
        if sweeps % 50 == 0 {
            shared.admission.sweep();
        }
    }
}

/// The admin API over a running edge.
struct EdgeAdmin(Arc<Shared>);

#[async_trait]
impl AdminApi for EdgeAdmin {
    fn health(&self) -> Value {
        let s = &self.0;
        json!({
            "status": "ok",
            "edge_id": s.config.edge_id,
            "uptime_secs": s.started.elapsed().as_secs(),
            "sessions": s.edge_sessions().registry.len(),
            "draining": s.draining.load(Ordering::Acquire),
            "route_epoch": s.epoch.load(Ordering::Relaxed),
            "overload_level": s.governor.level.load(Ordering::Acquire),
            "session_cap": s.governor.session_cap,
            "listeners": s.addrs.iter().map(|(k, a)| (k.as_str().to_string(), a.to_string())).collect::<BTreeMap<_, _>>(),
        })
    }

    fn ready(&self) -> Result<(), String> {
        if self.0.draining.load(Ordering::Acquire) {
            return Err("draining".into());
        }
        match self.0.router.lock() {
            Ok(r) if r.epoch().is_some() => Ok(()),
            _ => Err("no route table".into()),
        }
    }

    fn metrics_text(&self) -> String {
        let s = &self.0;
        s.metrics
            .draining
            .set(i64::from(s.draining.load(Ordering::Acquire)));
        let mut text = s.metrics.encode();
        // The session layer keeps plain counters; expose them in the same exposition.
        let body = text.trim_end().trim_end_matches("# EOF").to_string();
        let mut extra = String::new();
        extra.push_str("# TYPE waygate_sessions_live gauge\n");
        extra.push_str(&format!(
            "waygate_sessions_live {}\n",
            s.edge_sessions().registry.len()
        ));
        if let Some(wt) = &s.edge_sessions().write_through {
            extra.push_str("# TYPE waygate_write_through_writes counter\n");
            extra.push_str(&format!(
                "waygate_write_through_writes_total {}\n",
                wt.writes.load(Ordering::Relaxed)
            ));
            extra.push_str("# TYPE waygate_write_through_failures counter\n");
            extra.push_str(&format!(
                "waygate_write_through_failures_total {}\n",
                wt.failures.load(Ordering::Relaxed)
            ));
        }
        for (name, value) in s.edge_sessions().counters.export() {
            let (metric, labels) = match name.split_once('{') {
                Some((m, rest)) => (m.to_string(), format!("{{{rest}")),
                None => (name.clone(), String::new()),
            };
            extra.push_str(&format!("# TYPE waygate_session_{metric} counter\n"));
            extra.push_str(&format!("waygate_session_{metric}_total{labels} {value}\n"));
        }
        text = format!("{body}{extra}# EOF\n");
        text
    }

    fn routes(&self) -> Value {
        let s = &self.0;
        let table = s.router.lock().ok().and_then(|r| {
            r.table()
                .map(|t| serde_json::to_value(t.as_ref()).unwrap_or(Value::Null))
        });
        let staleness = s
            .source
            .as_ref()
            .and_then(|src| src.status().staleness(now_std()))
            .map(|d| d.as_secs_f64());
        json!({
            "epoch": s.epoch.load(Ordering::Relaxed),
            "source": s.source_kind,
            "staleness_secs": staleness,
            "table": table,
        })
    }

    async fn session(&self, player: &str) -> Option<Value> {
        let s = &self.0;
        let sid = s.edge_sessions().registry.session_of(player)?;
        let entry = s
            .entries
            .lock()
            .ok()
            .and_then(|e| e.by_id.get(&sid).cloned());
        Some(json!({
            "player_id": player,
            "session_id": waygate_session::resume::hex_id(&sid),
            "handle": entry.as_ref().map(|e| e.meta.handle),
            "fencing": entry.as_ref().map(|e| e.meta.fencing),
            "keys": entry.as_ref().map(|e| (*e.keys).clone()),
            "backends": entry.as_ref().map(|e| e.links.iter().map(|a| a.to_string()).collect::<Vec<_>>()),
        }))
    }

    async fn drain(&self) -> Value {
        let s = &self.0;
        let already = s.draining.swap(true, Ordering::AcqRel);
        let deadline = Duration::from_millis(s.config.drain.deadline_ms);
        let mut migrated = 0usize;
        let mut target = s.config.drain.target.clone();
        if !already {
            // No new players from etcd's least-loaded pick any more.
            if let Some(reg) = &s.etcd_registry {
                if let Err(e) = reg.shutdown().await {
                    tracing::warn!(error = %e, "etcd registration not revoked");
                }
            }
            target = s.drain_target();
            let registry = s.edge_sessions().registry.clone();
            let ids = registry.session_ids();
            if s.redis.is_some() {
                // Hard migration (S8): hold upstream, let replies in flight land here and be
                // written through, then MIGRATE (its rotated token is written first), so
                // the client restores on the target from the warm tier with nothing lost.
                for sid in &ids {
                    registry.quiesce(sid).await;
                }
                tokio::time::sleep(Duration::from_millis(s.config.cluster.quiesce_ms)).await;
            }
            for sid in ids {
                if registry.migrate(&sid, &target, deadline).await {
                    migrated += 1;
                }
            }
            tracing::warn!(migrated, "drain started");
        }
        json!({
            "draining": true,
            "already_draining": already,
            "migrated": migrated,
            "target": target,
            "sessions": s.edge_sessions().registry.len(),
            "deadline_ms": s.config.drain.deadline_ms,
        })
    }

    async fn drop_link(&self, player: &str) -> bool {
        let registry = &self.0.edge_sessions().registry;
        match registry.session_of(player) {
            Some(sid) => registry.drop_link(&sid).await,
            None => false,
        }
    }

    async fn kick(&self, player: &str) -> bool {
        let registry = &self.0.edge_sessions().registry;
        match registry.session_of(player) {
            Some(sid) => registry.close(&sid, CloseCode::Kicked).await,
            None => false,
        }
    }
}

// ---- many edges: etcd registration and load feed, Redis kicks, pushes, re-assert -------

impl Shared {
    /// The address clients use to reach this edge (etcd registration, MIGRATE target).
    fn advertise(&self) -> String {
        if !self.config.cluster.advertise.is_empty() {
            return self.config.cluster.advertise.clone();
        }
        self.addrs
            .get(&TransportKind::Tcp)
            .or_else(|| self.addrs.values().next())
            .map(|a| {
                let kind = self
                    .addrs
                    .iter()
                    .find(|(_, x)| *x == a)
                    .map_or("tcp", |(k, _)| k.as_str());
                format!("{kind}://{a}")
            })
            .unwrap_or_default()
    }

    /// Live sessions with their ownership: (player, session, fencing).
    fn owned_sessions(&self) -> Vec<(String, SessionId, u64)> {
        self.entries
            .lock()
            .map(|e| {
                e.by_id
                    .values()
                    .filter(|en| en.meta.fencing > 0)
                    .map(|en| {
                        (
                            en.meta.player_id.clone(),
                            en.meta.session_id,
                            en.meta.fencing,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Where a drained edge sends its clients: the configured target, else the least-loaded
    /// other active edge registered in etcd.
    fn drain_target(&self) -> String {
        if !self.config.drain.target.is_empty() {
            return self.config.drain.target.clone();
        }
        let Some(etcd) = &self.etcd else {
            return String::new();
        };
        let others: Vec<EdgeInfo> = etcd
            .edges()
            .into_iter()
            .filter(|e| e.id != self.config.edge_id)
            .collect();
        crate::cluster::etcd::pick_least_loaded(&others)
            .map(|e| e.address.clone())
            .unwrap_or_default()
    }
}

/// Starts the etcd registration and load feed and the Redis tasks (kicks from other edges,
/// cross-edge pushes, the ownership/presence re-assert sweep). Returns their handles.
async fn start_cluster_tasks(shared: &Arc<Shared>) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    let c = &shared.config.cluster;
    let edge_id = shared.config.edge_id.clone();
    if let Some(etcd) = &shared.etcd {
        // Load reports of backend instances -> the router's least-loaded policy (R10).
        let mut loads = etcd.loads();
        let weak = Arc::downgrade(shared);
        tasks.push(tokio::spawn(async move {
            loop {
                {
                    let Some(shared) = weak.upgrade() else { return };
                    let map = loads.borrow_and_update().clone();
                    let locked = shared.router.lock();
                    if let Ok(mut router) = locked {
                        for (id, l) in map.iter() {
                            router.report_load(
                                id,
                                waygate_routing::LoadReport { players: l.players },
                            );
                        }
                    };
                }
                if loads.changed().await.is_err() {
                    return;
                }
            }
        }));
    }
    if let Some(reg) = &shared.etcd_registry {
        let info = EdgeInfo {
            id: edge_id.clone(),
            address: shared.advertise(),
            state: waygate_routing::InstanceState::Active,
            capacity: None,
            sessions: 0,
            msg_rate: 0.0,
        };
        let every = Duration::from_millis(c.report_ms);
        match reg
            .register_edge(&info, Duration::from_millis(c.lease_ttl_ms))
            .await
        {
            Ok(lease) => {
                let (load_tx, load_rx) = tokio::sync::watch::channel(Load::default());
                tasks.push(reg.spawn_reporter(lease, every, load_rx));
                let weak = Arc::downgrade(shared);
                tasks.push(tokio::spawn(async move {
                    let mut tick = tokio::time::interval(every);
                    loop {
                        tick.tick().await;
                        let Some(shared) = weak.upgrade() else { return };
                        let players = u32::try_from(shared.edge_sessions().registry.len())
                            .unwrap_or(u32::MAX);
                        let _ = load_tx.send(Load {
                            players,
                            msg_rate: 0.0,
                        });
                    }
                }));
            }
            Err(e) => {
                tracing::warn!(error = %e, "edge not registered in etcd (logins will not pick it)")
            }
        }
    }
    let Some(redis) = shared.redis.clone() else {
        return tasks;
    };
    // Takeovers on other edges kick our (older) sessions.
    let mut kicks = redis.ownership.subscribe_kicks(&edge_id);
    let weak = Arc::downgrade(shared);
    tasks.push(tokio::spawn(async move {
        while let Some(k) = kicks.recv().await {
            let Some(shared) = weak.upgrade() else { return };
            let local = shared
                .entries
                .lock()
                .ok()
                .and_then(|e| e.by_id.get(&k.session_id).map(|en| en.meta.fencing));
            // Kick only a copy that is not newer than the one taken over.
            if local.is_none_or(|f| f <= k.fencing) {
                let registry = shared.edge_sessions().registry.clone();
                tokio::spawn(async move { registry.kick(&k.session_id).await });
            }
        }
    }));
    // Pushes from other edges (F4).
    let registry = shared.edge_sessions().registry.clone();
    let server = redis
        .presence
        .serve_pushes(&edge_id, move |player: &str, m: PushMessage| match registry
            .push_to_player(player, m.into())
        {
            Ok(()) => DeliveryResult::Delivered,
            Err(PushError::QueueFull) => DeliveryResult::QueueFull,
            Err(_) => DeliveryResult::Offline,
        });
    tasks.push(tokio::spawn(async move {
        let _server = server;
        std::future::pending::<()>().await;
    }));
    // Re-assert ownership and presence every `reassert_ms`, and at once after Redis was
    // unreachable (it may have lost records; kicks published meanwhile were missed).
    let weak = Arc::downgrade(shared);
    let every = Duration::from_millis(c.reassert_ms);
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sweep = Instant::now();
        let mut was_down = false;
        loop {
            tick.tick().await;
            let Some(shared) = weak.upgrade() else { return };
            let probe = redis.presence.lookup(&edge_id).await;
            if probe.is_err() {
                if !was_down {
                    tracing::warn!("redis unreachable; ownership re-assert after it recovers");
                }
                was_down = true;
                continue;
            }
            if !was_down && last_sweep.elapsed() < every {
                continue;
            }
            let live = shared.owned_sessions();
            let mut superseded = 0usize;
            let mut ok = true;
            for (player, sid, fencing) in &live {
                match redis
                    .ownership
                    .reassert(player, sid, &edge_id, *fencing)
                    .await
                {
                    Ok(Reassert::Owner) => {}
                    Ok(Reassert::Superseded(_)) => {
                        superseded += 1;
                        let registry = shared.edge_sessions().registry.clone();
                        let sid = *sid;
                        tokio::spawn(async move { registry.kick(&sid).await });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "re-assert failed");
                        ok = false;
                        break;
                    }
                }
            }
            let entries: Vec<(String, SessionId)> =
                live.into_iter().map(|(p, s, _)| (p, s)).collect();
            if ok && redis.presence.set_many(&edge_id, &entries).await.is_ok() {
                if was_down {
                    tracing::info!(
                        sessions = entries.len(),
                        superseded,
                        "redis back; ownership re-asserted"
                    );
                }
                was_down = false;
                last_sweep = Instant::now();
            }
        }
    }));
    tasks
}

//! The running edge: listeners -> sessions -> router -> backend links, and back.
//!
//! [`Edge::start`] binds every listener, loads the route table, and spawns:
//! - one accept loop per listener (new connections become session tasks, or get REJECT
//!   `draining` while the edge drains);
//! - the link event loop (pushes, kicks, refusals, binds from backends -> sessions);
//! - the route loop (table updates from the source, router ticks, migrations, health).
//!
//! The session layer talks to the edge through [`UpstreamSink`](waygate_session::driver::UpstreamSink) (implemented here by
//! `EdgeUpstream`), the admin server through [`AdminApi`]. The router is a sans-IO struct
//! behind a std mutex that is never held across an await.
//!
//! The folder follows the data flow (pingora's and linkerd2-proxy's habit):
//! - `startup`: `Edge::start`, which builds everything below and spawns the tasks;
//! - `table`: the edge's per-session entries (backend handle, bound keys, links used);
//! - `accept`: listeners -> session tasks (or REJECT while draining);
//! - `upstream`: session layer -> router -> backend link (`EdgeUpstream`);
//! - `links`: one `LinkClient` per backend address;
//! - `downstream`: backend link events -> sessions (push, kick, refuse, bind);
//! - `channels`: backend channel requests -> the channel hub -> one consumer per active
//!   channel -> members' session queues;
//! - `player_push`: a backend's push to a player anywhere -> the player's session here, or
//!   a batch to the player's edge over Redis (PLAYER_PUSH);
//! - `route_loop`: route table updates, health, migrations; `overload_loop`: the governor;
//! - `cluster`: etcd registration and load feed, Redis kicks, cross-edge pushes, re-assert;
//! - `admin`: the admin API over a running edge.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use waygate_routing::source::RouteSource;
use waygate_routing::{Router, RoutingError};
use waygate_session::driver::{SessionLayer, SessionRegistry};
use waygate_transport::TransportKind;

use crate::admin::AdminApi;
use crate::cluster::etcd::{EtcdRegistry, EtcdRouteSource};
use crate::cluster::redis::RedisStores;
use crate::config::EdgeConfig;
use crate::link::LinkClient;
use crate::metrics::EdgeMetrics;
use crate::overload::{EdgeAdmission, Governor};
use accept::accept_loop;
use admin::EdgeAdmin;
use cluster::start_cluster_tasks;
use downstream::{link_event_loop, EdgeLinkSink};
use overload_loop::overload_loop;
use route_loop::{apply_latest, route_loop};
use table::{SessionEntry, Sessions};
use upstream::EdgeUpstream;

mod accept;
mod admin;
mod channels;
mod cluster;
mod downstream;
mod forward_order;
mod links;
mod overload_loop;
mod player_push;
mod route_loop;
mod startup;
mod table;
mod upstream;

/// The built-in demo route table.
pub const DEFAULT_ROUTES: &str = include_str!("../default_routes.toml");

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
    /// The configuration is inconsistent or unsafe (e.g. the public development key on a
    /// listener beyond loopback).
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
}

/// Everything the edge's tasks share; each concern adds its methods in its own file.
struct Shared {
    config: EdgeConfig,
    metrics: EdgeMetrics,
    sessions: crate::metrics::SessionLayerSlot,
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
    link_events: crate::link::LinkEvents,
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
    /// Chaos drill: the next accepted connection panics its accept loop (supervision test).
    chaos_accept_panic: AtomicBool,
    /// Players banned on this edge (admin `POST /ban/{player}`), enforced by the
    /// authenticator on tokens and on resumes.
    revocations: waygate_session::auth::Revocations,
    /// The secret backend links prove (PROTOCOL.md §9.3), when configured.
    link_secret: Option<Arc<[u8]>>,
    /// Mutual TLS of backend links, when configured (client config, server name).
    link_tls: Option<(Arc<rustls::ClientConfig>, Option<String>)>,
    /// The channels of this edge (sans-IO; never locked across an await or a push).
    channels: Mutex<waygate_channels::ChannelHub>,
    /// The links told which channels this edge has (locked after `channels`).
    interest_links: Mutex<channels::InterestLinks>,
    /// The announcement log and its writer's queue, when announcements are persisted.
    announcements: Option<channels::Announcements>,
    /// Backends' pushes to players on other edges, waiting for their batch.
    player_pushes: player_push::PlayerPushes,
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
        self.shared.session_layer().registry.clone()
    }

    /// Chaos drill: the next connection any listener accepts panics that listener's accept
    /// loop (the connection is lost), to show the loop is supervised and restarted.
    pub fn chaos_panic_next_accept(&self) {
        self.shared
            .chaos_accept_panic
            .store(true, Ordering::Release);
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
    pub(super) fn session_layer(&self) -> &Arc<SessionLayer> {
        // Set right after construction in `Edge::start`, before any task runs.
        self.sessions
            .get()
            .unwrap_or_else(|| unreachable!("sessions set at start"))
    }
}

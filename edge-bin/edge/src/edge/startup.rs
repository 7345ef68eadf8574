//! `Edge::start`: binds the listeners, loads the route table (etcd, file or embedded),
//! connects the cluster stores, builds the session layer and spawns every task of the edge.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use waygate_routing::source::{FileRouteSource, FileSourceConfig, RouteSource};
use waygate_routing::{
    HealthConfig, MigrationRate, RouteTable, Router, RouterConfig, RoutingError,
};
use waygate_session::driver::{SessionLayer, SessionRegistry, WriteThrough};
use waygate_session::host::SessionHost;
use waygate_session::machine::SessionConfig;

use super::{
    accept_loop, link_event_loop, now_std, overload_loop, route_loop, start_cluster_tasks, Edge,
    EdgeAdmin, EdgeError, EdgeLinkSink, EdgeUpstream, Sessions, Shared, DEFAULT_ROUTES,
};
use crate::admin::AdminApi;
use crate::cluster::etcd::{EtcdRegistry, EtcdRouteSource};
use crate::cluster::redis::{RedisConfig, RedisServers, RedisStores, SentinelPrimaryAuth};
use crate::config::EdgeConfig;
use crate::link::LinkClient;
use crate::listeners::bind_all;
use crate::metrics::EdgeMetrics;
use crate::overload::{inbound_limits, EdgeAdmission, Governor};
use waygate_transport::listener::AdmissionGate;

impl Edge {
    /// Starts an edge with `config`.
    pub async fn start(config: EdgeConfig) -> Result<Edge, EdgeError> {
        // Checked here too, not only when a file is loaded: an edge built in code must not
        // start with the public development key beyond loopback either.
        config.validate()?;
        let link_secret = config.links.secret()?;
        let link_tls = match config.links.tls_files()? {
            None => None,
            Some(files) => Some((
                waygate_link::tls::client_config(&files).map_err(|message| {
                    EdgeError::Config(crate::config::ConfigError::Invalid {
                        key: "links.tls_cert_file",
                        message,
                    })
                })?,
                config.links.tls_server_name.clone(),
            )),
        };
        if link_secret.is_none() && link_tls.is_none() && config.exposed_listener().is_some() {
            tracing::warn!(
                "backend links have no secret on an edge listening beyond loopback \
                 (links.insecure_no_secret): anything reaching a backend port can act as an edge"
            );
        }
        if config.auth.uses_dev_key() {
            if config.exposed_listener().is_some() {
                tracing::warn!(
                    "auth uses the PUBLIC development key on a listener beyond loopback \
                     (auth.insecure_dev_key): anyone can mint tokens"
                );
            } else {
                tracing::info!(
                    "auth uses the public development key (loopback only; `waygate keygen` \
                     prints a key of your own)"
                );
            }
        }
        for warning in config.loopback_only_warnings() {
            tracing::warn!("{warning}");
        }
        let l = &config.limits;
        let admission = Arc::new(EdgeAdmission::new(
            &config.backpressure,
            waygate_backpressure::PhaseDeadlines {
                tls: Duration::from_millis(l.tls_timeout_ms.min(l.handshake_timeout_ms)),
                upgrade: Duration::from_millis(l.upgrade_timeout_ms.min(l.handshake_timeout_ms)),
                hello: Duration::from_millis(config.session.hello_timeout_ms),
            },
        ));
        let governor = Arc::new(Governor::new(&config.backpressure));
        // HMAC keys (reloaded from `auth.keys_file` when it changes): the session layer's
        // authenticator and the KCP listener's connect-token opener share them.
        let hmac_auth =
            crate::auth::EdgeHmacAuth::from_config(&config.auth).map_err(|message| {
                EdgeError::Config(crate::config::ConfigError::Invalid {
                    key: "auth.keys_file",
                    message,
                })
            })?;
        let bound = bind_all(
            &config,
            Some(admission.clone() as Arc<dyn AdmissionGate>),
            hmac_auth
                .clone()
                .map(|a| a as Arc<dyn waygate_transport::kcp::seal::ConnectKeys>),
        )
        .await?;
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
        let mut tasks = StartTasks(Vec::new());
        let mut source_kind = "embedded";
        let source: Option<Arc<dyn RouteSource>> = match &config.routing.table {
            _ if !config.cluster.etcd_endpoints.is_empty() => {
                let c = &config.cluster;
                let src = EtcdRouteSource::connect(
                    c.etcd_endpoints.clone(),
                    c.etcd_prefix.clone(),
                    config.routing.persist.clone(),
                    Duration::from_millis(c.damping_ms),
                    c.etcd_access()?,
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
        let servers = if !config.cluster.redis_cluster.is_empty() {
            Some(RedisServers::Cluster(config.cluster.redis_cluster.clone()))
        } else if !config.cluster.redis_sentinels.is_empty() {
            let c = &config.cluster;
            Some(RedisServers::Sentinel {
                sentinels: c.redis_sentinels.clone(),
                master: c.redis_sentinel_master.clone(),
                primary_auth: (!c.redis_sentinel_master_password.is_empty()).then(|| {
                    SentinelPrimaryAuth {
                        username: (!c.redis_sentinel_master_username.is_empty())
                            .then(|| c.redis_sentinel_master_username.clone()),
                        password: c.redis_sentinel_master_password.clone(),
                    }
                }),
            })
        } else if !config.cluster.redis_url.is_empty() {
            Some(RedisServers::Single(config.cluster.redis_url.clone()))
        } else {
            None
        };
        let redis = match servers {
            None => None,
            Some(servers) => {
                // Lazy: an edge may start while Redis is down (logins get UNAVAILABLE until
                // it is back; live sessions are unaffected).
                let rc = RedisConfig {
                    prefix: config.cluster.redis_prefix.clone(),
                    tls_root_pem: config.cluster.redis_tls_roots()?,
                    resume_key_seal: config.cluster.redis_resume_key_seal()?.map(Arc::new),
                    ..RedisConfig::with_servers(servers)
                };
                Some(RedisStores::lazy(rc).map_err(|e| EdgeError::Cluster(e.to_string()))?)
            }
        };
        let etcd_registry = etcd.as_ref().map(|src| {
            Arc::new(EtcdRegistry::new(
                src.client().clone(),
                &config.cluster.etcd_prefix,
            ))
        });
        let epoch = Arc::new(AtomicU64::new(router.epoch().unwrap_or(0)));
        let (link_tx, link_rx) = mpsc::channel(4096);
        let sessions = crate::metrics::SessionLayerSlot::default();
        let mut metrics = EdgeMetrics::with_session_layer(sessions.clone());
        metrics.register_listeners(crate::metrics::ListenerCollector {
            listeners: bound.stats.clone(),
            kcp: bound.kcp_stats.clone(),
        });
        if let Some(r) = &redis {
            metrics.registry.register(
                "redis_pubsub_dropped",
                "Redis pub/sub notices (kicks, cross-edge push requests and replies) dropped because a subscription's queue of 4,096 was full; a kick is caught by the ownership sweep, a push by its sender's timeout",
                r.pubsub_dropped(),
            );
        }
        // The announcement log (PROTOCOL.md §12.5): its writer starts once the edge exists.
        let announcement_log: Option<Arc<dyn crate::announcements::AnnouncementLog>> =
            match config.channels.announcement_log.as_str() {
                "off" => None,
                "auto" => redis.as_ref().map(|r| {
                    r.announcements.clone() as Arc<dyn crate::announcements::AnnouncementLog>
                }),
                "redis" => Some(
                    redis
                        .as_ref()
                        .ok_or_else(|| {
                            EdgeError::Config(crate::config::ConfigError::Invalid {
                                key: "channels.announcement_log",
                                message: "`redis` needs cluster.redis_url or cluster.redis_cluster"
                                    .into(),
                            })
                        })?
                        .announcements
                        .clone(),
                ),
                path => Some(Arc::new(
                    crate::announcements::FileAnnouncementLog::open(
                        std::path::Path::new(path),
                        config.channels.announcement_fsync,
                        config.channels.announcement_log_max_bytes,
                    )
                    .map_err(|e| {
                        EdgeError::Config(crate::config::ConfigError::Invalid {
                            key: "channels.announcement_log",
                            message: format!("{path}: {e}"),
                        })
                    })?,
                )),
            };
        let (announcement_jobs, announcement_rx) =
            mpsc::channel(super::channels::ANNOUNCEMENT_QUEUE);
        let announcements = announcement_log.map(|log| super::channels::Announcements {
            log,
            jobs: announcement_jobs,
            reads: Arc::new(tokio::sync::Semaphore::new(super::channels::LOG_READS)),
        });
        let mut hub = waygate_channels::ChannelHub::new(config.channels.clone(), rand::random());
        hub.set_announcement_log(announcements.is_some());
        let shared = Arc::new_cyclic(|weak| {
            // One sink carries out the links' events and tells them the edge's channels.
            let sink = Arc::new(EdgeLinkSink(weak.clone()));
            Shared {
                metrics,
                sessions,
                router: Mutex::new(router),
                source,
                source_kind,
                etcd,
                etcd_registry,
                redis,
                epoch,
                links: Mutex::new(HashMap::new()),
                link_events: crate::link::LinkEvents {
                    fast: Some(sink.clone()),
                    slow: link_tx,
                    interest: Some(sink),
                },
                entries: Mutex::new(Sessions::default()),
                draining: AtomicBool::new(false),
                started: Instant::now(),
                addrs: bound.addrs.clone(),
                instance_addrs: Mutex::new(HashMap::new()),
                admission,
                governor,
                chaos_accept_panic: AtomicBool::new(false),
                link_secret,
                link_tls,
                revocations: waygate_session::auth::Revocations::default(),
                channels: Mutex::new(hub),
                interest_links: Mutex::new(Default::default()),
                announcements,
                player_pushes: super::player_push::PlayerPushes::new(),
                config,
            }
        });
        if let Some(a) = &shared.announcements {
            tasks.push(tokio::spawn(super::channels::announcement_writer(
                Arc::downgrade(&shared),
                a.log.clone(),
                announcement_rx,
            )));
        }
        shared.metrics.preset(shared.addrs.keys().copied());
        shared
            .metrics
            .preset_channels(shared.config.channels.kinds.keys().map(String::as_str));
        shared.learn_instances();
        shared
            .metrics
            .route_epoch
            .set(shared.epoch.load(Ordering::Relaxed) as i64);

        let a = &shared.config.auth;
        // `hmac_auth` is there exactly when `auth.kind = "hmac"`.
        let auth: Arc<dyn waygate_session::Authenticator> = match &hmac_auth {
            Some(hmac) => {
                if a.keys_file.is_some() {
                    tokio::spawn(reload_auth_keys(Arc::downgrade(hmac)));
                }
                hmac.clone()
            }
            None => {
                let settings = crate::auth::JwtSettings {
                    jwks_file: a.jwt.jwks_file.clone().unwrap_or_default(),
                    issuers: a.issuers.clone(),
                    audiences: a.jwt.audiences.clone(),
                    player_claim: a.jwt.player_claim.clone(),
                    leeway: Duration::from_secs(a.leeway_secs),
                };
                let jwt = crate::auth::JwtAuthenticator::new(settings).map_err(|e| {
                    EdgeError::Config(crate::config::ConfigError::Invalid {
                        key: "auth.jwt.jwks_file",
                        message: e.to_string(),
                    })
                })?;
                Arc::new(jwt)
            }
        };
        // Bans (admin POST /ban) and the maximum token lifetime apply to tokens and (bans)
        // to resumes, whatever the token kind.
        let max_lifetime =
            (a.max_token_lifetime_secs > 0).then(|| Duration::from_secs(a.max_token_lifetime_secs));
        let auth: Arc<dyn waygate_session::Authenticator> = Arc::new(
            waygate_session::auth::AuthPolicy::new(auth, shared.revocations.clone())
                .with_max_lifetime(max_lifetime),
        );
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
        let mut session_layer = SessionLayer::new(
            shared.config.edge_id.clone(),
            session_config,
            auth,
            Arc::new(EdgeUpstream(Arc::downgrade(&shared))),
        );
        session_layer.registry =
            SessionRegistry::with_outbound(SessionHost::outbound_for_capacity(s.outbound_capacity));
        session_layer.trace_sample_rate = s.trace_sample_rate;
        session_layer.inbound = Some(inbound_limits(&shared.config.backpressure));
        session_layer.send_deadline =
            Duration::from_millis(shared.config.backpressure.send_deadline_ms);
        if let Some(r) = &shared.redis {
            session_layer.snapshots = r.snapshots.clone();
            session_layer.ownership = r.ownership.clone();
            if shared.config.cluster.write_through {
                session_layer.write_through = Some(WriteThrough::start(
                    r.snapshots.clone(),
                    session_layer.config.linger,
                    Duration::from_secs(1),
                ));
            }
        }
        let _ = shared.sessions.set(Arc::new(session_layer));

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

        // The admin server's access is settled before anything serves clients: a token that
        // cannot be read (or is missing beyond loopback) stops the start here.
        let admin_access = if shared.config.admin.enabled {
            let a = &shared.config.admin;
            let access = crate::admin::AdminAccess {
                token: a.token()?,
                // Beyond loopback, reads (routes, sessions, metrics) need the token too.
                protect_reads: a.protect_reads || !a.addr.ip().is_loopback(),
                allowed_hosts: a.allowed_hosts.clone(),
            };
            if access.token.is_none() && !a.addr.ip().is_loopback() {
                return Err(EdgeError::Config(crate::config::ConfigError::Invalid {
                    key: "admin.addr",
                    message: format!(
                        "the admin server would listen on {} without a token: set \
                         admin.token_file or WAYGATE_ADMIN_TOKEN, or bind it to loopback",
                        a.addr
                    ),
                }));
            }
            Some(access)
        } else {
            None
        };
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
        tasks.push(tokio::spawn(super::channels::channel_sweep_loop(
            Arc::downgrade(&shared),
        )));
        if shared.redis.is_some() {
            tasks.push(tokio::spawn(super::player_push::player_push_loop(
                Arc::downgrade(&shared),
            )));
        }
        let admin_addr = match admin_access {
            Some(access) => {
                let api: Arc<dyn AdminApi> = Arc::new(EdgeAdmin(shared.clone()));
                match crate::admin::serve(shared.config.admin.addr, api, access).await {
                    Ok((addr, task)) => {
                        tasks.push(task);
                        Some(addr)
                    }
                    // What the start spawned ends with it (`StartTasks`).
                    Err(e) => return Err(e.into()),
                }
            }
            None => None,
        };
        tracing::info!(edge = %shared.config.edge_id, addrs = ?bound.addrs, admin = ?admin_addr, "edge started");
        Ok(Edge {
            addrs: bound.addrs,
            admin_addr,
            dev_ca_pem: bound.tls.dev_ca_pem.clone(),
            shared,
            tasks: std::mem::take(&mut tasks.0),
        })
    }
}

/// Re-reads `auth.keys_file` every second while the edge lives (key rotation without a
/// restart).
async fn reload_auth_keys(auth: std::sync::Weak<crate::auth::EdgeHmacAuth>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(auth) = auth.upgrade() else {
            return;
        };
        auth.reload_if_changed();
    }
}

/// The tasks a start spawned: aborted when the start fails on the way (nothing it started
/// may go on serving without the rest), handed to the [`Edge`] when it succeeds.
struct StartTasks(Vec<tokio::task::JoinHandle<()>>);

impl Drop for StartTasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

impl std::ops::Deref for StartTasks {
    type Target = Vec<tokio::task::JoinHandle<()>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for StartTasks {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

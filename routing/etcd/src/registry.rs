//! Registrations in etcd (SPEC R9, R10): [`EtcdRegistry`] puts a backend instance's
//! [`InstanceRecord`] or an edge's [`EdgeInfo`] under a lease, renews the lease with every
//! [`Load`] report (replacing a lease etcd lost), and revokes it on shutdown. It also
//! implements the routing crate's [`InstanceRegistry`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, PutOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use waygate_routing::source::{InstanceRegistry, LeaseId};
use waygate_routing::{InstanceSpec, InstanceState, LoadReport, RoutingError};

use crate::{connect_client, timed, Etcd, EtcdAccess, EtcdError, EtcdSourceConfig, Keys};

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
    /// Administrative state (a [`Switch`](crate::Switch) overrides it).
    #[serde(default)]
    pub state: InstanceState,
    /// Player cap (a [`Switch`](crate::Switch) overrides it).
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

    pub(super) fn to_spec(&self, id: &str) -> InstanceSpec {
        InstanceSpec {
            id: id.to_owned(),
            address: self.address.clone(),
            weight: self.weight,
            state: self.state,
            capacity: self.capacity,
        }
    }
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

    /// Connects to `endpoints` (lazily: etcd may be down) with `access` (user, TLS; the
    /// default: no user, and the system's roots for `https://`) and writes under `prefix`.
    pub async fn connect(
        endpoints: &[String],
        prefix: &str,
        access: EtcdAccess,
    ) -> Result<Self, EtcdError> {
        let mut cfg = EtcdSourceConfig::new(endpoints.to_vec(), prefix);
        cfg.access = access;
        Ok(Self::new(connect_client(&cfg).await?, prefix))
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

    /// Registers a backend instance for each of `services` under leases of `ttl` and
    /// reports its load every `every` (SPEC R9, R10): what `waygate backend --etcd` does,
    /// and what a Rust game server built on the backend SDK calls to register itself.
    /// `sample` returns the players hosted and the growing message total (the backend SDK's
    /// `Backend::load`), or `None` once the instance is gone: the reports then stop and the
    /// leases expire. Revoke with [`Self::shutdown`] for a graceful exit.
    pub async fn register_backend_instance(
        self: &Arc<Self>,
        services: &[String],
        instance: &InstanceSpec,
        ttl: Duration,
        every: Duration,
        sample: impl FnMut() -> Option<(usize, u64)> + Send + 'static,
    ) -> Result<Vec<LeaseId>, EtcdError> {
        let (load_tx, load_rx) = watch::channel(Load::default());
        let mut leases = Vec::with_capacity(services.len());
        for service in services {
            let lease = self.register_instance(service, instance, ttl).await?;
            // The reporter ends by itself when the registration is revoked or the registry
            // dropped.
            let _reporter = self.spawn_reporter(lease, every, load_rx.clone());
            leases.push(lease);
        }
        let _meter = crate::spawn_load_meter(every, load_tx, sample);
        Ok(leases)
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

//! The edge's routing state machine (SPEC R1–R8, R10): the table in force (epoch), sticky
//! bindings, the migration planner, health, weight ramps, canaries and load reports.
//! Sans-IO: every input carries the time, nothing here sleeps or touches a socket.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bindings::{binding_cause, Binding, Bindings};
use crate::hash::canary_bucket;
use crate::health::{HealthConfig, HealthTracker};
use crate::migration::{
    rebalance, Migration, MigrationCause, MigrationPlanner, MigrationRate, PendingMigration,
};
use crate::table::{InstanceSpec, InstanceState, KeyKind, RouteTable};
use crate::{Rendezvous, RoutingError};

/// Settings of a [`Router`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    /// Rate at which bindings forced off their instance are released (SPEC R4).
    pub migration_rate: MigrationRate,
    /// An instance that appears in a new table (not the first one) starts at weight 0 and
    /// ramps linearly to its weight over this time (SPEC R6). Zero: joins at full weight.
    pub weight_ramp: Duration,
    /// Minimum time between two ring rebuilds caused by ramp steps (SPEC R7).
    pub min_rebuild_interval: Duration,
    /// Heartbeat-based health tracking; `None`: every instance counts as up.
    pub health: Option<HealthConfig>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            migration_rate: MigrationRate::default(),
            weight_ramp: Duration::ZERO,
            min_rebuild_interval: Duration::from_secs(1),
            health: None,
        }
    }
}

/// The business keys a message carries; the service's [`KeyKind`] picks one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteRequest<'a> {
    /// The session's player id (player-keyed and any-instance services; canary bucket).
    pub player: &'a str,
    /// Room id for room-keyed services.
    pub room: Option<&'a str>,
    /// Guild id for guild-keyed services.
    pub guild: Option<&'a str>,
    /// Order id for order-keyed services.
    pub order: Option<&'a str>,
}

impl<'a> RouteRequest<'a> {
    /// A request carrying only the player id.
    #[must_use]
    pub fn player(player: &'a str) -> Self {
        Self {
            player,
            ..Self::default()
        }
    }

    /// Adds a room id.
    #[must_use]
    pub fn room(mut self, room: &'a str) -> Self {
        self.room = Some(room);
        self
    }

    /// Adds a guild id.
    #[must_use]
    pub fn guild(mut self, guild: &'a str) -> Self {
        self.guild = Some(guild);
        self
    }

    /// Adds an order id.
    #[must_use]
    pub fn order(mut self, order: &'a str) -> Self {
        self.order = Some(order);
        self
    }
}

/// How a decision was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RouteReason {
    /// An existing sticky binding.
    Bound,
    /// A pinned player (explicit assignment).
    Pinned,
    /// A room created on this instance (explicit assignment).
    RoomAssigned,
    /// Weighted rendezvous hash of the business key.
    Hashed,
    /// Least loaded eligible instance.
    LeastLoaded,
    /// Next eligible instance in turn.
    RoundRobin,
}

/// Where one message goes, and under which epoch (to be carried with the message, SPEC R5).
#[derive(Debug, Clone, PartialEq)]
pub struct RouteDecision {
    /// The service serving it (the canary alternate when `canary`).
    pub service: String,
    /// The instance.
    pub instance_id: String,
    /// Its address.
    pub address: String,
    /// Epoch of the table in force when deciding.
    pub epoch: u64,
    /// How it was decided.
    pub reason: RouteReason,
    /// Whether the canary redirected it.
    pub canary: bool,
}

/// An instance as the compiled table holds it: shared, so a routing decision that names it
/// allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TargetInstance {
    /// The service it serves.
    pub service: Arc<str>,
    /// Its id.
    pub instance_id: Arc<str>,
    /// Its address as the table gives it.
    pub address: Arc<str>,
    /// The address parsed, when it is an IP literal and port.
    pub socket: Option<std::net::SocketAddr>,
}

impl TargetInstance {
    fn new(service: &str, instance_id: &str, address: &str) -> Self {
        Self {
            service: service.into(),
            instance_id: instance_id.into(),
            address: address.into(),
            socket: address.parse().ok(),
        }
    }
}

/// A routing decision without allocation ([`Router::route_target`]); [`RouteDecision`] is
/// the same with owned strings.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteTarget {
    /// Where the message goes.
    pub target: Arc<TargetInstance>,
    /// The service the message id names (the canary may serve it from another:
    /// `target.service`).
    pub requested: Arc<str>,
    /// Epoch of the table in force when deciding.
    pub epoch: u64,
    /// How it was decided.
    pub reason: RouteReason,
    /// Whether the canary redirected it.
    pub canary: bool,
}

impl From<RouteTarget> for RouteDecision {
    fn from(t: RouteTarget) -> Self {
        Self {
            service: t.target.service.to_string(),
            instance_id: t.target.instance_id.to_string(),
            address: t.target.address.to_string(),
            epoch: t.epoch,
            reason: t.reason,
            canary: t.canary,
        }
    }
}

/// Most keys of one kind (players, rooms) backends may pin on one edge.
pub const MAX_DYNAMIC_PINS: usize = 100_000;

/// Why [`Router::pin`] or [`Router::restore_binding`] did not take a placement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// No table yet.
    #[error("no route table")]
    NoTable,
    /// The instance is not in the table for a service of that key kind.
    #[error("instance {instance:?} serves no {kind} service of the table")]
    UnknownInstance {
        /// Instance id.
        instance: String,
        /// Key kind asked for.
        kind: KeyKind,
    },
    /// The instance is down, disabled or draining: it takes no new keys.
    #[error("instance {instance:?} takes no new keys")]
    NotEligible {
        /// Instance id.
        instance: String,
    },
    /// [`MAX_DYNAMIC_PINS`] keys of this kind are pinned already.
    #[error("too many pinned keys (at most {MAX_DYNAMIC_PINS} per kind)")]
    Full,
    /// Only player and room keys can be pinned.
    #[error("{0} keys cannot be pinned")]
    KindNotPinnable(KeyKind),
}

/// A load report from the control plane (SPEC R10).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Players (keys) the instance holds, over all edges.
    pub players: u32,
}

/// What the edge should do after a backend refused a message for its epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleEpochAction {
    /// The backend knows a newer table: fetch at least this epoch from the route source,
    /// [`Router::apply_table`] it, then route again.
    Refresh {
        /// The epoch the backend reported.
        at_least: u64,
    },
    /// A newer table is already in force: route again.
    Reroute,
    /// The backend is behind the edge; it must catch up (retry later or route elsewhere).
    BackendBehind {
        /// The epoch the backend reported.
        backend_epoch: u64,
    },
}

/// Result of [`Router::apply_table`].
#[derive(Debug, Clone, PartialEq)]
pub struct ApplyReport {
    /// Epoch now in force.
    pub epoch: u64,
    /// Epoch replaced, if any.
    pub previous_epoch: Option<u64>,
    /// Moves implied by the explicit assignments ([`rebalance`] of old and new table).
    pub assignment_migrations: Vec<Migration>,
    /// Bindings newly queued in the migration planner.
    pub queued_migrations: usize,
    /// Backend pins dropped because their instance is no longer in a service of the pin's
    /// key kind ([`Router::pin`]): a pin never outlives its instance.
    pub pins_dropped: usize,
}

/// Result of [`Router::tick`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Whether the rings were rebuilt (health view or ramp step).
    pub rebuilt: bool,
    /// Bindings newly queued for migration.
    pub queued_migrations: usize,
}

#[derive(Debug, Clone)]
struct CompiledService {
    /// The service's name, shared by the decisions that name it as requested.
    name: Arc<str>,
    kind: KeyKind,
    /// Each instance as routing decisions name it (same order as the table's).
    targets: Vec<Arc<TargetInstance>>,
    canary: Option<(u32, usize)>,
    ring: Rendezvous,
    weights: Vec<f64>,
    eligible: Vec<bool>,
    by_id: HashMap<String, usize>,
    rr_order: Vec<usize>,
    rr_next: usize,
}

#[derive(Debug, Clone)]
struct Compiled {
    table: Arc<RouteTable>,
    ranges: Vec<(u32, u32, usize)>,
    by_name: HashMap<String, usize>,
    services: Vec<CompiledService>,
}

#[derive(Debug, Clone, Copy, Default)]
struct LoadState {
    reported: u32,
    placed_since: u32,
}

/// The routing state of one edge. See the crate docs for an example.
#[derive(Debug)]
pub struct Router {
    cfg: RouterConfig,
    current: Option<Compiled>,
    bindings: Bindings,
    /// Placements backends announced with PIN (R3), beside the table's assignments (which
    /// win): at most [`MAX_DYNAMIC_PINS`] keys of each kind.
    pins: crate::table::Assignments,
    planner: MigrationPlanner,
    health: Option<HealthTracker>,
    down: BTreeSet<String>,
    ramps: HashMap<String, Instant>,
    loads: HashMap<String, LoadState>,
    last_rebuild: Option<Instant>,
}

fn ramp_factor(start: Option<&Instant>, ramp: Duration, now: Instant) -> f64 {
    match start {
        Some(s) if !ramp.is_zero() => {
            (now.saturating_duration_since(*s).as_secs_f64() / ramp.as_secs_f64()).min(1.0)
        }
        _ => 1.0,
    }
}

impl Router {
    /// A router with no table yet; its clocks start at `now`.
    #[must_use]
    pub fn new(cfg: RouterConfig, now: Instant) -> Self {
        Self {
            cfg,
            current: None,
            bindings: Bindings::new(),
            pins: crate::table::Assignments::default(),
            planner: MigrationPlanner::new(cfg.migration_rate, now),
            health: cfg.health.map(HealthTracker::new),
            down: BTreeSet::new(),
            ramps: HashMap::new(),
            loads: HashMap::new(),
            last_rebuild: None,
        }
    }

    /// Epoch in force.
    #[must_use]
    pub fn epoch(&self) -> Option<u64> {
        self.current.as_ref().map(|c| c.table.epoch)
    }

    /// Table in force.
    #[must_use]
    pub fn table(&self) -> Option<&Arc<RouteTable>> {
        self.current.as_ref().map(|c| &c.table)
    }

    /// The sticky bindings.
    #[must_use]
    pub fn bindings(&self) -> &Bindings {
        &self.bindings
    }

    /// Forgets every binding of `key` (its session is gone for good); returns how many.
    pub fn release_key(&mut self, key: &str) -> usize {
        let instances: Vec<String> = self
            .bindings
            .of_key(key)
            .map(|(_, b)| b.instance_id.clone())
            .collect();
        for i in &instances {
            self.unplaced(i);
        }
        self.bindings.unbind_key(key)
    }

    /// Forgets the binding of `key` for `service`.
    pub fn release(&mut self, key: &str, service: &str) -> Option<Binding> {
        let b = self.bindings.unbind(key, service)?;
        self.unplaced(&b.instance_id);
        Some(b)
    }

    /// A key left `instance`: the local count since its last load report goes down.
    fn unplaced(&mut self, instance: &str) {
        if let Some(l) = self.loads.get_mut(instance) {
            l.placed_since = l.placed_since.saturating_sub(1);
        }
    }

    /// Moves queued in the planner.
    #[must_use]
    pub fn pending_migrations(&self) -> usize {
        self.planner.len()
    }

    /// Instances health tracking currently declares down.
    #[must_use]
    pub fn down_instances(&self) -> &BTreeSet<String> {
        &self.down
    }

    /// Applies a newer table (SPEC R5): an equal or older epoch is refused with
    /// [`RoutingError::StaleEpoch`] and changes nothing.
    pub fn apply_table(
        &mut self,
        table: RouteTable,
        now: Instant,
    ) -> Result<ApplyReport, RoutingError> {
        table.validate()?;
        let previous = self.current.as_ref().map(|c| Arc::clone(&c.table));
        if let Some(p) = &previous {
            if table.epoch <= p.epoch {
                return Err(RoutingError::StaleEpoch {
                    current: p.epoch,
                    offered: table.epoch,
                });
            }
        }
        let table = Arc::new(table);
        let ids = || {
            table
                .services
                .iter()
                .flat_map(|s| s.instances.iter().map(|i| i.id.as_str()))
        };
        if let Some(old) = &previous {
            if !self.cfg.weight_ramp.is_zero() {
                for id in ids() {
                    if old.instance(id).is_none() {
                        self.ramps.insert(id.to_owned(), now);
                    }
                }
            }
        }
        let known: BTreeSet<&str> = ids().collect();
        let pins_dropped = self.prune_pins(&table);
        self.ramps.retain(|k, _| known.contains(k.as_str()));
        self.loads.retain(|k, _| known.contains(k.as_str()));
        if let Some(h) = &mut self.health {
            h.sync(ids(), now);
            if let Some(v) = h.poll_rebuild(now) {
                self.down = v.down.clone();
            }
        }
        self.down.retain(|k| known.contains(k.as_str()));
        let assignment_migrations = previous
            .as_ref()
            .map(|old| rebalance(old, &table))
            .unwrap_or_default();
        self.current = Some(self.compile(table, now));
        self.last_rebuild = Some(now);
        let queued_migrations = self.plan_migrations();
        let epoch = self.epoch().unwrap_or_default();
        tracing::info!(epoch, previous = ?previous.as_ref().map(|p| p.epoch), queued_migrations, pins_dropped, "route table applied");
        Ok(ApplyReport {
            epoch,
            previous_epoch: previous.map(|p| p.epoch),
            assignment_migrations,
            queued_migrations,
            pins_dropped,
        })
    }

    /// Forgets the pins whose instance `table` no longer has in a service of the pin's key
    /// kind (players: player or least-loaded services; rooms: room services). A disabled or
    /// draining instance keeps its pins (routing skips them while it is); one removed from
    /// the table loses them, so they neither count toward the cap for ever nor come back
    /// with a later instance of that id. Returns how many were dropped.
    fn prune_pins(&mut self, table: &RouteTable) -> usize {
        let ids_of = |kinds: &[KeyKind]| -> BTreeSet<&str> {
            table
                .services
                .iter()
                .filter(|s| kinds.contains(&s.key))
                .flat_map(|s| s.instances.iter().map(|i| i.id.as_str()))
                .collect()
        };
        let players = ids_of(&[KeyKind::Player, KeyKind::LeastLoaded]);
        let rooms = ids_of(&[KeyKind::Room]);
        let before = self.pins.players.len() + self.pins.rooms.len();
        self.pins
            .players
            .retain(|_, instance| players.contains(instance.as_str()));
        self.pins
            .rooms
            .retain(|_, instance| rooms.contains(instance.as_str()));
        before - (self.pins.players.len() + self.pins.rooms.len())
    }

    fn compile(&self, table: Arc<RouteTable>, now: Instant) -> Compiled {
        let mut ranges = Vec::new();
        let by_name: HashMap<String, usize> = table
            .services
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.clone(), i))
            .collect();
        let mut services = Vec::with_capacity(table.services.len());
        for (si, s) in table.services.iter().enumerate() {
            for &[lo, hi] in &s.messages {
                ranges.push((lo, hi, si));
            }
            let weights: Vec<f64> = s
                .instances
                .iter()
                .map(|i| i.weight * ramp_factor(self.ramps.get(&i.id), self.cfg.weight_ramp, now))
                .collect();
            let eligible: Vec<bool> = s
                .instances
                .iter()
                .zip(&weights)
                .map(|(i, w)| {
                    i.state == InstanceState::Active && *w > 0.0 && !self.down.contains(&i.id)
                })
                .collect();
            let ring = Rendezvous::new(
                s.instances
                    .iter()
                    .zip(&weights)
                    .zip(&eligible)
                    .map(|((i, w), e)| (i.id.clone(), if *e { *w } else { 0.0 })),
            );
            let mut rr_order: Vec<usize> = (0..s.instances.len()).collect();
            rr_order.sort_by(|a, b| s.instances[*a].id.cmp(&s.instances[*b].id));
            let rr_next = self
                .current
                .as_ref()
                .and_then(|c| c.by_name.get(&s.name).map(|&i| c.services[i].rr_next))
                .unwrap_or(0);
            services.push(CompiledService {
                name: Arc::from(s.name.as_str()),
                kind: s.key,
                targets: s
                    .instances
                    .iter()
                    .map(|i| Arc::new(TargetInstance::new(&s.name, &i.id, &i.address)))
                    .collect(),
                canary: s.canary.as_ref().and_then(|c| {
                    let bp = (c.percent * 100.0).round().clamp(0.0, 10_000.0) as u32;
                    by_name.get(&c.service).map(|&alt| (bp, alt))
                }),
                ring,
                weights,
                eligible,
                by_id: s
                    .instances
                    .iter()
                    .enumerate()
                    .map(|(i, x)| (x.id.clone(), i))
                    .collect(),
                rr_order,
                rr_next,
            });
        }
        ranges.sort_unstable();
        Compiled {
            table,
            ranges,
            by_name,
            services,
        }
    }

    fn rebuild(&mut self, now: Instant) {
        if let Some(c) = self.current.take() {
            self.current = Some(self.compile(c.table, now));
        }
        self.last_rebuild = Some(now);
    }

    /// Queues every binding the table in force (and health view) forces to move and drops
    /// queued moves that are no longer needed. Returns how many were newly queued.
    fn plan_migrations(&mut self) -> usize {
        let Some(c) = &self.current else { return 0 };
        let down = &self.down;
        let is_down = |id: &str| down.contains(id);
        let bindings = &self.bindings;
        let table = &c.table;
        self.planner.retain(|p| {
            bindings.get(&p.key, &p.service).is_some_and(|b| {
                b.instance_id == p.from && binding_cause(table, &is_down, &p.key, b).is_some()
            })
        });
        let mut n = 0;
        for p in bindings.affected_by(table, &is_down) {
            if self.planner.enqueue(p) {
                n += 1;
            }
        }
        n
    }

    /// Records a heartbeat from an instance (health tracking on).
    pub fn heartbeat(&mut self, instance_id: &str, now: Instant) {
        if let Some(h) = &mut self.health {
            h.heartbeat(instance_id, now);
        }
    }

    /// Records a load report (SPEC R10): resets the count of keys placed there since.
    pub fn report_load(&mut self, instance_id: &str, report: LoadReport) {
        self.loads.insert(
            instance_id.to_owned(),
            LoadState {
                reported: report.players,
                placed_since: 0,
            },
        );
    }

    /// Advances time: publishes damped health changes and weight-ramp steps (at most one
    /// ring rebuild per interval) and queues the bindings they force to move.
    pub fn tick(&mut self, now: Instant) -> TickReport {
        let mut rebuilt = false;
        if let Some(h) = &mut self.health {
            if let Some(v) = h.poll_rebuild(now) {
                self.down = v.down.clone();
                rebuilt = true;
            }
        }
        let ramp_due = !self.ramps.is_empty()
            && self
                .last_rebuild
                .is_none_or(|l| now.saturating_duration_since(l) >= self.cfg.min_rebuild_interval);
        if ramp_due {
            rebuilt = true;
        }
        if !rebuilt {
            return TickReport::default();
        }
        self.rebuild(now);
        let ramp = self.cfg.weight_ramp;
        self.ramps
            .retain(|_, start| ramp_factor(Some(start), ramp, now) < 1.0);
        let queued_migrations = self.plan_migrations();
        TickReport {
            rebuilt,
            queued_migrations,
        }
    }

    /// The next instant [`Router::tick`] or [`Router::poll_migration`] has work.
    #[must_use]
    pub fn poll_timeout(&self, now: Instant) -> Option<Instant> {
        let ramp = (!self.ramps.is_empty()).then(|| {
            self.last_rebuild
                .map_or(now, |l| (l + self.cfg.min_rebuild_interval).max(now))
        });
        [
            self.planner.poll_timeout(now),
            self.health.as_ref().and_then(|h| h.poll_timeout(now)),
            ramp,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// What to do when a backend refused a message routed under `decision_epoch` because it
    /// holds `backend_epoch` (SPEC R5).
    #[must_use]
    pub fn on_stale_epoch(&self, decision_epoch: u64, backend_epoch: u64) -> StaleEpochAction {
        let current = self.epoch().unwrap_or(0);
        if backend_epoch > current {
            StaleEpochAction::Refresh {
                at_least: backend_epoch,
            }
        } else if decision_epoch < current {
            StaleEpochAction::Reroute
        } else {
            StaleEpochAction::BackendBehind { backend_epoch }
        }
    }

    /// Layer 1 then layer 2: routes message `message_id` carrying `req`.
    pub fn route(
        &mut self,
        message_id: u32,
        req: &RouteRequest<'_>,
    ) -> Result<RouteDecision, RoutingError> {
        let c = self.current.as_ref().ok_or(RoutingError::NoTable)?;
        let pos = c.ranges.partition_point(|r| r.0 <= message_id);
        let si = match pos.checked_sub(1).map(|p| c.ranges[p]) {
            Some((_, hi, si)) if message_id <= hi => si,
            _ => return Err(RoutingError::NoServiceForMessage { message_id }),
        };
        self.route_index(si, req).map(RouteDecision::from)
    }

    /// [`route`](Self::route) without allocating (the hot path of the edge).
    pub fn route_target(
        &mut self,
        message_id: u32,
        req: &RouteRequest<'_>,
    ) -> Result<RouteTarget, RoutingError> {
        let c = self.current.as_ref().ok_or(RoutingError::NoTable)?;
        let pos = c.ranges.partition_point(|r| r.0 <= message_id);
        let si = match pos.checked_sub(1).map(|p| c.ranges[p]) {
            Some((_, hi, si)) if message_id <= hi => si,
            _ => return Err(RoutingError::NoServiceForMessage { message_id }),
        };
        self.route_index(si, req)
    }

    /// Layer 2 only: routes `req` within the named service.
    pub fn route_service(
        &mut self,
        service: &str,
        req: &RouteRequest<'_>,
    ) -> Result<RouteDecision, RoutingError> {
        let c = self.current.as_ref().ok_or(RoutingError::NoTable)?;
        let si = *c
            .by_name
            .get(service)
            .ok_or_else(|| RoutingError::NoSuchService {
                service: service.to_owned(),
            })?;
        self.route_index(si, req).map(RouteDecision::from)
    }

    fn route_index(
        &mut self,
        requested: usize,
        req: &RouteRequest<'_>,
    ) -> Result<RouteTarget, RoutingError> {
        let Some(c) = self.current.as_ref() else {
            return Err(RoutingError::NoTable);
        };
        let table = Arc::clone(&c.table);
        let req_name = table.services[requested].name.as_str();
        let kind = c.services[requested].kind;
        let requested_name = Arc::clone(&c.services[requested].name);
        let key = match kind {
            KeyKind::Player | KeyKind::LeastLoaded | KeyKind::RoundRobin => Some(req.player),
            KeyKind::Room => req.room,
            KeyKind::Guild => req.guild,
            KeyKind::Order => req.order,
        }
        .filter(|k| !k.is_empty());
        let Some(key) = key else {
            return Err(RoutingError::MissingKey {
                service: req_name.to_owned(),
                kind,
            });
        };
        if kind != KeyKind::RoundRobin {
            if let Some(b) = self.bindings.get(key, req_name) {
                // The compiled table's handle for the bound instance, unless the binding
                // names what the table no longer has (then its own strings, once).
                let compiled = c
                    .by_name
                    .get(&b.service)
                    .and_then(|&bs| {
                        let cs = &c.services[bs];
                        cs.by_id.get(&b.instance_id).map(|&i| &cs.targets[i])
                    })
                    .filter(|t| *t.address == *b.address)
                    .cloned();
                let target = compiled.unwrap_or_else(|| {
                    Arc::new(TargetInstance::new(&b.service, &b.instance_id, &b.address))
                });
                return Ok(RouteTarget {
                    target,
                    requested: requested_name,
                    epoch: table.epoch,
                    reason: RouteReason::Bound,
                    canary: b.canary,
                });
            }
        }
        // Canary (SPEC R8): by hash of the service's key (the player id for player-keyed and
        // any-instance services), salted with the requested service's name.
        let (si, canary) = match c.services[requested].canary {
            Some((bp, alt)) if canary_bucket(key, req_name) < bp => (alt, true),
            _ => (requested, false),
        };
        let (idx, reason) = self.choose(si, key)?;
        let target = match self.current.as_ref() {
            Some(c) => Arc::clone(&c.services[si].targets[idx]),
            None => return Err(RoutingError::NoTable),
        };
        let decision = RouteTarget {
            target,
            requested: requested_name,
            epoch: table.epoch,
            reason,
            canary,
        };
        if kind != KeyKind::RoundRobin {
            self.bind(key, req_name, &RouteDecision::from(decision.clone()));
        }
        Ok(decision)
    }

    /// A backend's PIN (R3): `key` lives on `instance_id` from now on. The table's own
    /// assignments still win; a binding of `key` to another instance of a service that
    /// instance serves is dropped, so the next message goes to the pinned instance.
    pub fn pin(
        &mut self,
        kind: KeyKind,
        key: &str,
        instance_id: &str,
    ) -> Result<(), PlacementError> {
        let c = self.current.as_ref().ok_or(PlacementError::NoTable)?;
        let kinds: &[KeyKind] = match kind {
            KeyKind::Player => &[KeyKind::Player, KeyKind::LeastLoaded],
            KeyKind::Room => &[KeyKind::Room],
            other => return Err(PlacementError::KindNotPinnable(other)),
        };
        let services: Vec<String> = c
            .table
            .services
            .iter()
            .zip(&c.services)
            .filter(|(spec, cs)| kinds.contains(&spec.key) && cs.by_id.contains_key(instance_id))
            .map(|(spec, _)| spec.name.clone())
            .collect();
        if services.is_empty() {
            return Err(PlacementError::UnknownInstance {
                instance: instance_id.to_owned(),
                kind,
            });
        }
        let map = if kind == KeyKind::Room {
            &mut self.pins.rooms
        } else {
            &mut self.pins.players
        };
        if map.len() >= MAX_DYNAMIC_PINS && !map.contains_key(key) {
            return Err(PlacementError::Full);
        }
        map.insert(key.to_owned(), instance_id.to_owned());
        for service in services {
            if self
                .bindings
                .get(key, &service)
                .is_some_and(|b| b.instance_id != instance_id)
            {
                self.release(key, &service);
            }
        }
        Ok(())
    }

    /// Forgets a backend's pin of `key` (the room ended; a backend's UNPIN); true when there
    /// was one. The key's current binding, if any, stays where it is (nothing moves
    /// silently); its next placement is decided by the table (its assignments, else the
    /// service's policy), as for a key never pinned.
    pub fn unpin(&mut self, kind: KeyKind, key: &str) -> bool {
        match kind {
            KeyKind::Room => self.pins.rooms.remove(key).is_some(),
            _ => self.pins.players.remove(key).is_some(),
        }
    }

    /// Keys pinned by backends: (players, rooms).
    #[must_use]
    pub fn pinned(&self) -> (usize, usize) {
        (self.pins.players.len(), self.pins.rooms.len())
    }

    /// Re-establishes a placement a session carried from another edge (its snapshot's
    /// bindings): `key` for the requested `service` on `instance_id`, if the table still has
    /// that instance and it takes keys. A binding this edge already has for `key` stays (it
    /// is the same decision or a newer one). Returns whether `key` is now bound there.
    pub fn restore_binding(
        &mut self,
        key: &str,
        service: &str,
        instance_id: &str,
    ) -> Result<bool, PlacementError> {
        if let Some(b) = self.bindings.get(key, service) {
            return Ok(b.instance_id == instance_id);
        }
        let c = self.current.as_ref().ok_or(PlacementError::NoTable)?;
        let unknown = || PlacementError::UnknownInstance {
            instance: instance_id.to_owned(),
            kind: c
                .by_name
                .get(service)
                .map_or(KeyKind::Player, |&si| c.services[si].kind),
        };
        let si = *c.by_name.get(service).ok_or_else(unknown)?;
        if c.services[si].kind == KeyKind::RoundRobin {
            return Ok(false);
        }
        // The instance may be the canary alternate's.
        let alternate = c.services[si].canary.map(|(_, alt)| alt);
        let (owner, idx) = [Some(si), alternate]
            .into_iter()
            .flatten()
            .find_map(|s| c.services[s].by_id.get(instance_id).map(|&i| (s, i)))
            .ok_or_else(unknown)?;
        let spec = &c.table.services[owner];
        let inst = &spec.instances[idx];
        let takes_keys = !self.down.contains(&inst.id)
            && match spec.key {
                KeyKind::Room => inst.state != InstanceState::Disabled,
                _ => inst.state == InstanceState::Active,
            };
        if !takes_keys {
            return Err(PlacementError::NotEligible {
                instance: instance_id.to_owned(),
            });
        }
        let decision = RouteDecision {
            service: spec.name.clone(),
            instance_id: inst.id.clone(),
            address: inst.address.clone(),
            epoch: c.table.epoch,
            reason: RouteReason::Bound,
            canary: owner != si,
        };
        self.bind(key, service, &decision);
        Ok(true)
    }

    fn bind(&mut self, key: &str, requested: &str, d: &RouteDecision) {
        self.loads
            .entry(d.instance_id.clone())
            .or_default()
            .placed_since += 1;
        self.bindings.bind(
            key,
            requested,
            Binding {
                service: d.service.clone(),
                instance_id: d.instance_id.clone(),
                address: d.address.clone(),
                canary: d.canary,
                epoch: d.epoch,
            },
        );
    }

    /// Picks an instance of service `si` for a new placement of `key`: explicit assignment,
    /// else the service's policy over eligible instances (active, positive weight, up, below
    /// capacity).
    fn choose(&mut self, si: usize, key: &str) -> Result<(usize, RouteReason), RoutingError> {
        let Some(c) = self.current.as_mut() else {
            return Err(RoutingError::NoTable);
        };
        let table = &c.table;
        let svc_spec = &table.services[si];
        let kind = svc_spec.key;
        let bindings = &self.bindings;
        let loads = &self.loads;
        let down = &self.down;
        let cs = &mut c.services[si];
        let no_instance = || RoutingError::NoEligibleInstance {
            service: svc_spec.name.clone(),
        };
        let occupancy = |i: &InstanceSpec| {
            let l = loads.get(&i.id).copied().unwrap_or_default();
            bindings
                .count_on(&i.id)
                .max(l.reported.saturating_add(l.placed_since))
        };
        let pins = &self.pins;
        let assigned = match kind {
            KeyKind::Player | KeyKind::LeastLoaded => table
                .assignments
                .players
                .get(key)
                .or_else(|| pins.players.get(key)),
            KeyKind::Room => table
                .assignments
                .rooms
                .get(key)
                .or_else(|| pins.rooms.get(key)),
            _ => None,
        };
        // Explicit assignments override the hash and ignore capacity (operator's choice).
        let pinned = assigned
            .and_then(|id| cs.by_id.get(id).copied())
            .filter(|&idx| {
                let i = &svc_spec.instances[idx];
                !down.contains(&i.id)
                    && match kind {
                        KeyKind::Room => i.state != InstanceState::Disabled,
                        _ => i.state == InstanceState::Active,
                    }
            });
        if let Some(idx) = pinned {
            let reason = if kind == KeyKind::Room {
                RouteReason::RoomAssigned
            } else {
                RouteReason::Pinned
            };
            return Ok((idx, reason));
        }
        let static_ok = &cs.eligible;
        let eligible = |idx: usize| {
            let i = &svc_spec.instances[idx];
            static_ok[idx] && i.capacity.is_none_or(|cap| occupancy(i) < cap)
        };
        match kind {
            KeyKind::RoundRobin => {
                let n = cs.rr_order.len();
                let start = cs.rr_next;
                let pos = (0..n)
                    .map(|k| (start + k) % n)
                    .find(|&p| eligible(cs.rr_order[p]))
                    .ok_or_else(no_instance)?;
                let idx = cs.rr_order[pos];
                cs.rr_next = (pos + 1) % n;
                Ok((idx, RouteReason::RoundRobin))
            }
            KeyKind::LeastLoaded => {
                let weights = &cs.weights;
                let load = |i: usize| f64::from(occupancy(&svc_spec.instances[i])) / weights[i];
                (0..svc_spec.instances.len())
                    .filter(|&i| eligible(i))
                    .min_by(|&a, &b| {
                        load(a)
                            .total_cmp(&load(b))
                            .then_with(|| svc_spec.instances[a].id.cmp(&svc_spec.instances[b].id))
                    })
                    .map(|idx| (idx, RouteReason::LeastLoaded))
                    .ok_or_else(no_instance)
            }
            _ => cs
                .ring
                .pick_index_where(key, eligible)
                .map(|idx| (idx, RouteReason::Hashed))
                .ok_or_else(no_instance),
        }
    }

    /// Releases the next forced binding move if the migration rate allows at `now`
    /// (SPEC R4). The binding is updated to the target before returning, so the returned
    /// [`Migration`] is the only notice: the caller must carry it out (tell the old backend
    /// to hand over, or the new one to rebuild a lost room). `None`: nothing can move now
    /// (see [`Router::poll_timeout`]).
    pub fn poll_migration(&mut self, now: Instant) -> Option<Migration> {
        loop {
            let p = self.planner.poll(now)?;
            match self.carry_out(&p) {
                Carry::Done(m) => {
                    tracing::info!(key = %m.key, service = %m.service, from = %m.from, to = ?m.to, cause = %m.cause, "migration released");
                    return Some(*m);
                }
                Carry::Obsolete => self.planner.refund(),
                Carry::Blocked => {
                    self.planner.requeue_front(p);
                    return None;
                }
            }
        }
    }

    fn carry_out(&mut self, p: &PendingMigration) -> Carry {
        let Some(c) = &self.current else {
            return Carry::Blocked;
        };
        let table = Arc::clone(&c.table);
        let Some(b) = self.bindings.get(&p.key, &p.service).cloned() else {
            return Carry::Obsolete;
        };
        if b.instance_id != p.from {
            return Carry::Obsolete;
        }
        let down = &self.down;
        let Some(cause) = binding_cause(&table, &|id: &str| down.contains(id), &p.key, &b) else {
            return Carry::Obsolete;
        };
        // Normally the key moves within the service serving it (keeping canary membership);
        // if that service is gone (a canary alternate removed), within the requested one.
        let serving = c
            .by_name
            .get(&b.service)
            .or_else(|| c.by_name.get(&p.service))
            .copied();
        let kind = serving.map_or(KeyKind::Player, |si| table.services[si].key);
        let mut m = Migration {
            kind,
            key: p.key.clone(),
            service: b.service.clone(),
            from: b.instance_id.clone(),
            to: None,
            to_address: None,
            cause,
            epoch: table.epoch,
        };
        let Some(si) = serving else {
            // No service left for it: nothing can take the state over.
            self.release(&p.key, &p.service);
            return Carry::Done(Box::new(m));
        };
        let canary = b.canary && table.services[si].name == b.service;
        if kind == KeyKind::Room && cause != MigrationCause::Reassigned {
            // A room cannot move: it is lost and must be rebuilt where it is next routed.
            self.release(&p.key, &p.service);
            return Carry::Done(Box::new(m));
        }
        // Choose without the old binding counting against capacity; keep it if nothing fits.
        self.release(&p.key, &p.service);
        match self.choose(si, &p.key) {
            Ok((idx, _)) => {
                let inst = &table.services[si].instances[idx];
                let d = RouteDecision {
                    service: table.services[si].name.clone(),
                    instance_id: inst.id.clone(),
                    address: inst.address.clone(),
                    epoch: table.epoch,
                    reason: RouteReason::Hashed,
                    canary,
                };
                self.bind(&p.key, &p.service, &d);
                m.service = d.service;
                m.to = Some(d.instance_id);
                m.to_address = Some(d.address);
                Carry::Done(Box::new(m))
            }
            Err(_) => {
                self.loads
                    .entry(b.instance_id.clone())
                    .or_default()
                    .placed_since += 1;
                self.bindings.bind(&p.key, &p.service, b);
                Carry::Blocked
            }
        }
    }
}

enum Carry {
    Done(Box<Migration>),
    Obsolete,
    Blocked,
}

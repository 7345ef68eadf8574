//! Explicit migrations (SPEC R3, R4): nothing moves without one of these being handed to the
//! caller. [`rebalance`] compares two tables' explicit assignments; [`MigrationPlanner`]
//! releases binding moves at a configured rate on an injected clock.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use crate::table::{InstanceState, KeyKind, RouteTable, ServiceSpec};
use crate::Rendezvous;
use waygate_backpressure::{Rate, TokenBucket};

/// Why something has to move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MigrationCause {
    /// The instance is no longer in the table.
    InstanceRemoved,
    /// The whole service is no longer in the table.
    ServiceRemoved,
    /// The instance is draining.
    InstanceDraining,
    /// The instance is disabled.
    InstanceDisabled,
    /// Health tracking declared the instance down (K missed heartbeats).
    InstanceUnhealthy,
    /// An explicit assignment now names another instance.
    Reassigned,
    /// An explicit assignment was dropped and the hash places the key elsewhere.
    Unpinned,
}

impl MigrationCause {
    /// Urgent causes (the old instance is gone or dead) are released before gentle ones.
    #[must_use]
    pub fn is_urgent(self) -> bool {
        matches!(
            self,
            Self::InstanceRemoved
                | Self::ServiceRemoved
                | Self::InstanceDisabled
                | Self::InstanceUnhealthy
        )
    }

    /// Stable metric / log label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InstanceRemoved => "instance_removed",
            Self::ServiceRemoved => "service_removed",
            Self::InstanceDraining => "instance_draining",
            Self::InstanceDisabled => "instance_disabled",
            Self::InstanceUnhealthy => "instance_unhealthy",
            Self::Reassigned => "reassigned",
            Self::Unpinned => "unpinned",
        }
    }
}

impl fmt::Display for MigrationCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One explicit move of a key's state from one instance to another. `to == None` means the
/// state is lost and must be rebuilt (a room whose instance went away) or that no instance
/// could take it.
#[derive(Debug, Clone, PartialEq)]
pub struct Migration {
    /// Kind of the key (player, room, ...).
    pub kind: KeyKind,
    /// The player / room / guild / order id.
    pub key: String,
    /// The service serving the key: the target's service when `to` is set (a player whose
    /// canary alternate was removed moves back to the main service), else the old one.
    pub service: String,
    /// Instance that held the key.
    pub from: String,
    /// Instance that takes it over, if any.
    pub to: Option<String>,
    /// Address of `to`.
    pub to_address: Option<String>,
    /// Why.
    pub cause: MigrationCause,
    /// Epoch of the table the target was computed from.
    pub epoch: u64,
}

impl Migration {
    /// The state is lost (nowhere to move it): the backend must rebuild it.
    #[must_use]
    pub fn is_lost(&self) -> bool {
        self.to.is_none()
    }
}

fn state_cause(svc: Option<&ServiceSpec>, instance: &str) -> Option<MigrationCause> {
    let Some(svc) = svc else {
        return Some(MigrationCause::ServiceRemoved);
    };
    match svc.instances.iter().find(|i| i.id == instance) {
        None => Some(MigrationCause::InstanceRemoved),
        Some(i) => match i.state {
            InstanceState::Active => None,
            InstanceState::Draining => Some(MigrationCause::InstanceDraining),
            InstanceState::Disabled => Some(MigrationCause::InstanceDisabled),
        },
    }
}

/// Rendezvous over a service's active, positive-weight instances (no health or capacity:
/// [`rebalance`] is a pure function of two tables).
fn hash_target<'a>(svc: &'a ServiceSpec, key: &str) -> Option<&'a crate::InstanceSpec> {
    let ring = Rendezvous::new(svc.instances.iter().map(|i| {
        let w = if i.state == InstanceState::Active {
            i.weight
        } else {
            0.0
        };
        (i.id.as_str(), w)
    }));
    ring.pick_index_where(key, |_| true)
        .map(|i| &svc.instances[i])
}

fn active_instance<'a>(
    t: &'a RouteTable,
    id: &str,
) -> Option<(&'a ServiceSpec, &'a crate::InstanceSpec)> {
    t.instance(id)
        .filter(|(_, i)| i.state == InstanceState::Active)
}

/// Compares the explicit assignments of two tables and lists every move they imply
/// (SPEC R3). Pinned players whose instance is removed, draining or disabled are re-hashed to
/// an active instance of the same service (`to` set); rooms whose instance is removed or
/// disabled are reported lost (`to == None`); rooms on a draining instance stay; reassigned
/// players and rooms move to their new instance. Newly pinned players move from where the
/// old table's hash placed them. The result is sorted by (service, key).
///
/// Keys placed by the hash alone are not enumerable from tables; the edge's [`crate::Bindings`]
/// cover those.
#[must_use]
pub fn rebalance(old: &RouteTable, new: &RouteTable) -> Vec<Migration> {
    let mut out = Vec::new();
    let mk =
        |kind, key: &str, service: &str, from: &str, to: Option<&crate::InstanceSpec>, cause| {
            Migration {
                kind,
                key: key.to_owned(),
                service: service.to_owned(),
                from: from.to_owned(),
                to: to.map(|i| i.id.clone()),
                to_address: to.map(|i| i.address.clone()),
                cause,
                epoch: new.epoch,
            }
        };
    // Pinned players.
    for (player, inst) in &old.assignments.players {
        let Some((old_svc, _)) = old.instance(inst) else {
            continue;
        };
        let kind = old_svc.key;
        let new_svc = new.service(&old_svc.name);
        match new.assignments.players.get(player) {
            Some(p) if p == inst && active_instance(new, p).is_some() => {}
            Some(p) if active_instance(new, p).is_some() => {
                let to = active_instance(new, p).map(|(_, i)| i);
                out.push(mk(
                    kind,
                    player,
                    &old_svc.name,
                    inst,
                    to,
                    MigrationCause::Reassigned,
                ));
            }
            _ => {
                let cause = state_cause(new_svc, inst).unwrap_or(MigrationCause::Unpinned);
                let to = new_svc.and_then(|s| hash_target(s, player));
                if to.is_some_and(|t| &t.id == inst) {
                    continue;
                }
                out.push(mk(kind, player, &old_svc.name, inst, to, cause));
            }
        }
    }
    // Newly pinned players move from their old hashed placement.
    for (player, inst) in &new.assignments.players {
        if old.assignments.players.contains_key(player) {
            continue;
        }
        let Some((new_svc, target)) = active_instance(new, inst) else {
            continue;
        };
        let Some(old_svc) = old.service(&new_svc.name) else {
            continue;
        };
        if let Some(from) = hash_target(old_svc, player) {
            if from.id != target.id {
                out.push(mk(
                    new_svc.key,
                    player,
                    &new_svc.name,
                    &from.id,
                    Some(target),
                    MigrationCause::Reassigned,
                ));
            }
        }
    }
    // Rooms.
    for (room, inst) in &old.assignments.rooms {
        let Some((old_svc, _)) = old.instance(inst) else {
            continue;
        };
        let new_svc = new.service(&old_svc.name);
        match new.assignments.rooms.get(room) {
            Some(r) if r != inst => {
                let to = new.instance(r).map(|(_, i)| i);
                out.push(mk(
                    KeyKind::Room,
                    room,
                    &old_svc.name,
                    inst,
                    to,
                    MigrationCause::Reassigned,
                ));
            }
            _ => match state_cause(new_svc, inst) {
                None | Some(MigrationCause::InstanceDraining) => {}
                Some(cause) => out.push(mk(KeyKind::Room, room, &old_svc.name, inst, None, cause)),
            },
        }
    }
    out.sort_by(|a, b| (&a.service, &a.key).cmp(&(&b.service, &b.key)));
    out
}

/// A binding that has to move, waiting for the planner to release it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingMigration {
    /// The bound key.
    pub key: String,
    /// The service the binding is for (as requested, before any canary redirection).
    pub service: String,
    /// The instance it is bound to now.
    pub from: String,
    /// Why it must move.
    pub cause: MigrationCause,
}

/// Rate settings of the [`MigrationPlanner`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MigrationRate {
    /// Sustained releases per second (players per second).
    pub per_second: f64,
    /// Releases allowed at once after a quiet period.
    pub burst: u32,
}

impl MigrationRate {
    /// The exact bucket that paces releases: `per_second` kept to the millisecond (a
    /// negative or NaN rate never refills), `burst` at least 1.
    fn bucket(self, now: Instant) -> TokenBucket {
        let rate = if self.per_second.is_finite() && self.per_second > 0.0 {
            // Tokens per 1,000 s: exact for any rate given to the millisecond.
            let per_kilosecond = (self.per_second * 1000.0).round().min(u64::MAX as f64) as u64;
            Rate::new(per_kilosecond, Duration::from_secs(1000))
        } else {
            Rate::never()
        };
        TokenBucket::new(rate, u64::from(self.burst.max(1)), now)
    }
}

impl Default for MigrationRate {
    fn default() -> Self {
        Self {
            per_second: 100.0,
            burst: 100,
        }
    }
}

/// Queue of binding moves released at a configured rate (SPEC R4). Urgent moves (instance
/// gone, disabled or dead) go before gentle ones (draining, reassigned); each key and
/// service is queued once.
#[derive(Debug, Clone)]
pub struct MigrationPlanner {
    urgent: VecDeque<PendingMigration>,
    gentle: VecDeque<PendingMigration>,
    queued: HashSet<(String, String)>,
    bucket: TokenBucket,
}

impl MigrationPlanner {
    /// An empty planner releasing at `rate`, its clock starting at `now`.
    #[must_use]
    pub fn new(rate: MigrationRate, now: Instant) -> Self {
        Self {
            urgent: VecDeque::new(),
            gentle: VecDeque::new(),
            queued: HashSet::new(),
            bucket: rate.bucket(now),
        }
    }

    /// Queues a move; returns false if this key and service are already queued.
    pub fn enqueue(&mut self, m: PendingMigration) -> bool {
        if !self.queued.insert((m.key.clone(), m.service.clone())) {
            return false;
        }
        if m.cause.is_urgent() {
            self.urgent.push_back(m);
        } else {
            self.gentle.push_back(m);
        }
        true
    }

    /// Keeps only the queued moves for which `keep` holds (used when a newer table or a
    /// health change makes some moves unnecessary).
    pub fn retain(&mut self, mut keep: impl FnMut(&PendingMigration) -> bool) {
        let queued = &mut self.queued;
        for q in [&mut self.urgent, &mut self.gentle] {
            q.retain(|m| {
                let k = keep(m);
                if !k {
                    queued.remove(&(m.key.clone(), m.service.clone()));
                }
                k
            });
        }
    }

    /// Releases the next move if the rate allows at `now`.
    pub fn poll(&mut self, now: Instant) -> Option<PendingMigration> {
        if self.is_empty() || self.bucket.try_take(now, 1).is_err() {
            return None;
        }
        let m = self
            .urgent
            .pop_front()
            .or_else(|| self.gentle.pop_front())?;
        self.queued.remove(&(m.key.clone(), m.service.clone()));
        Some(m)
    }

    /// Returns the token of a released move that turned out to be unnecessary.
    pub fn refund(&mut self) {
        self.bucket.refund(1);
    }

    /// Puts a released move back at the head of its queue and refunds its token (the caller
    /// could not carry it out, e.g. no instance can take the key yet).
    pub fn requeue_front(&mut self, m: PendingMigration) {
        if self.queued.insert((m.key.clone(), m.service.clone())) {
            self.bucket.refund(1);
            if m.cause.is_urgent() {
                self.urgent.push_front(m);
            } else {
                self.gentle.push_front(m);
            }
        }
    }

    /// When [`MigrationPlanner::poll`] can next release something (`None`: nothing queued).
    #[must_use]
    pub fn poll_timeout(&self, now: Instant) -> Option<Instant> {
        if self.is_empty() {
            None
        } else {
            // `check` refills a copy; the planner's own bucket is untouched.
            match self.bucket.clone().check(now, 1) {
                Ok(()) => Some(now),
                Err(wait) if wait.is_never() => None,
                Err(wait) => Some(now + wait.0),
            }
        }
    }

    /// Number of queued moves.
    #[must_use]
    pub fn len(&self) -> usize {
        self.urgent.len() + self.gentle.len()
    }

    /// Whether nothing is queued.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pm(key: &str, cause: MigrationCause) -> PendingMigration {
        PendingMigration {
            key: key.into(),
            service: "s".into(),
            from: "a".into(),
            cause,
        }
    }

    #[test]
    fn planner_rate_and_priority() {
        let t0 = Instant::now();
        let mut p = MigrationPlanner::new(
            MigrationRate {
                per_second: 10.0,
                burst: 2,
            },
            t0,
        );
        assert!(p.enqueue(pm("g1", MigrationCause::InstanceDraining)));
        assert!(p.enqueue(pm("u1", MigrationCause::InstanceRemoved)));
        assert!(!p.enqueue(pm("u1", MigrationCause::InstanceRemoved)));
        assert!(p.enqueue(pm("g2", MigrationCause::InstanceDraining)));
        assert_eq!(p.poll(t0).map(|m| m.key), Some("u1".into()));
        assert_eq!(p.poll(t0).map(|m| m.key), Some("g1".into()));
        assert_eq!(p.poll(t0), None, "burst spent");
        let at = p.poll_timeout(t0).expect("queued");
        assert_eq!(at, t0 + Duration::from_millis(100));
        assert_eq!(p.poll(t0 + Duration::from_millis(99)), None);
        assert_eq!(
            p.poll(t0 + Duration::from_millis(100)).map(|m| m.key),
            Some("g2".into())
        );
        assert!(p.is_empty());
        assert_eq!(p.poll_timeout(t0), None);
    }
}

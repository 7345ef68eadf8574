//! Sticky bindings (SPEC R4): binding key -> service -> instance.

use std::collections::HashMap;

use crate::migration::{MigrationCause, PendingMigration};
use crate::table::{InstanceState, KeyKind, RouteTable};

/// Where one key is bound for one service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The service actually serving it (differs from the requested one under a canary).
    pub service: String,
    /// The instance.
    pub instance_id: String,
    /// The instance's address when bound (kept so a binding survives its instance leaving
    /// the table until the migration is released).
    pub address: String,
    /// Whether the canary redirected it.
    pub canary: bool,
    /// Epoch of the table it was bound under.
    pub epoch: u64,
}

/// The bindings of one key, one per requested service, sorted by service. Almost every key
/// has one or two, so a vector sized to its contents: a `BTreeMap`'s first leaf node holds
/// room for 11 and made a session's binding cost ~1.4 KB (`tests/route_plane_memory.rs`).
type PerService = Vec<(String, Binding)>;

/// All bindings held by one edge. A binding stays until [`Bindings::unbind`] or an explicit
/// migration replaces it, whatever tables are applied meanwhile.
#[derive(Debug, Clone, Default)]
pub struct Bindings {
    by_key: HashMap<String, PerService>,
    per_instance: HashMap<String, u32>,
    len: usize,
}

impl Bindings {
    /// No bindings.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The binding of `key` for the requested `service`.
    #[must_use]
    pub fn get(&self, key: &str, service: &str) -> Option<&Binding> {
        let per = self.by_key.get(key)?;
        let at = per
            .binary_search_by(|(s, _)| s.as_str().cmp(service))
            .ok()?;
        Some(&per[at].1)
    }

    /// Binds (or rebinds) `key` for `service`; returns the previous binding.
    pub fn bind(&mut self, key: &str, service: &str, binding: Binding) -> Option<Binding> {
        *self
            .per_instance
            .entry(binding.instance_id.clone())
            .or_default() += 1;
        let per = self
            .by_key
            .entry(key.to_owned())
            .or_insert_with(|| Vec::with_capacity(1));
        let prev = match per.binary_search_by(|(s, _)| s.as_str().cmp(service)) {
            Ok(at) => Some(std::mem::replace(&mut per[at].1, binding)),
            Err(at) => {
                per.insert(at, (service.to_owned(), binding));
                None
            }
        };
        match &prev {
            Some(p) => self.dec(&p.instance_id.clone()),
            None => self.len += 1,
        }
        prev
    }

    fn dec(&mut self, instance: &str) {
        if let Some(c) = self.per_instance.get_mut(instance) {
            *c = c.saturating_sub(1);
            if *c == 0 {
                self.per_instance.remove(instance);
            }
        }
    }

    /// Removes the binding of `key` for `service`.
    pub fn unbind(&mut self, key: &str, service: &str) -> Option<Binding> {
        let per = self.by_key.get_mut(key)?;
        let at = per
            .binary_search_by(|(s, _)| s.as_str().cmp(service))
            .ok()?;
        let (_, b) = per.remove(at);
        if per.is_empty() {
            self.by_key.remove(key);
        }
        self.len -= 1;
        self.dec(&b.instance_id);
        Some(b)
    }

    /// The bindings of `key` as (requested service, binding).
    pub fn of_key(&self, key: &str) -> impl Iterator<Item = (&str, &Binding)> {
        self.by_key
            .get(key)
            .into_iter()
            .flat_map(|per| per.iter().map(|(s, b)| (s.as_str(), b)))
    }

    /// Removes every binding of `key` (the session ended and its linger expired); returns
    /// how many were removed.
    pub fn unbind_key(&mut self, key: &str) -> usize {
        let Some(per) = self.by_key.remove(key) else {
            return 0;
        };
        for (_, b) in &per {
            self.dec(&b.instance_id);
        }
        self.len -= per.len();
        per.len()
    }

    /// Number of keys bound to `instance` (all services).
    #[must_use]
    pub fn count_on(&self, instance: &str) -> u32 {
        self.per_instance.get(instance).copied().unwrap_or(0)
    }

    /// Number of bindings.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every binding as (key, requested service, binding), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str, &Binding)> {
        self.by_key
            .iter()
            .flat_map(|(k, per)| per.iter().map(move |(s, b)| (k.as_str(), s.as_str(), b)))
    }

    /// The bindings that `table` (plus the set of instances health tracking declared down)
    /// forces to move, sorted by (key, service): bound instance removed, disabled, draining
    /// or down, or an explicit assignment now naming another active instance. Room bindings
    /// on a draining instance stay (a room ends where it started).
    #[must_use]
    pub fn affected_by(
        &self,
        table: &RouteTable,
        is_down: &dyn Fn(&str) -> bool,
    ) -> Vec<PendingMigration> {
        let mut out = Vec::new();
        for (key, service, b) in self.iter() {
            if let Some(cause) = binding_cause(table, is_down, key, b) {
                out.push(PendingMigration {
                    key: key.to_owned(),
                    service: service.to_owned(),
                    from: b.instance_id.clone(),
                    cause,
                });
            }
        }
        out.sort_by(|a, b| (&a.key, &a.service).cmp(&(&b.key, &b.service)));
        out
    }
}

/// Why binding `b` of `key` must move under `table`, if it must.
pub(crate) fn binding_cause(
    table: &RouteTable,
    is_down: &dyn Fn(&str) -> bool,
    key: &str,
    b: &Binding,
) -> Option<MigrationCause> {
    let Some(svc) = table.service(&b.service) else {
        return Some(MigrationCause::ServiceRemoved);
    };
    let Some(inst) = svc.instances.iter().find(|i| i.id == b.instance_id) else {
        return Some(MigrationCause::InstanceRemoved);
    };
    match inst.state {
        InstanceState::Disabled => return Some(MigrationCause::InstanceDisabled),
        InstanceState::Draining if svc.key != KeyKind::Room => {
            return Some(MigrationCause::InstanceDraining)
        }
        _ => {}
    }
    if is_down(&inst.id) {
        return Some(MigrationCause::InstanceUnhealthy);
    }
    let assigned = match svc.key {
        KeyKind::Player | KeyKind::LeastLoaded => table.assignments.players.get(key),
        KeyKind::Room => table.assignments.rooms.get(key),
        _ => None,
    };
    if let Some(target) = assigned {
        let usable = svc
            .instances
            .iter()
            .any(|i| &i.id == target && i.state == InstanceState::Active && !is_down(&i.id));
        if usable && target != &b.instance_id {
            return Some(MigrationCause::Reassigned);
        }
    }
    None
}

//! The versioned route table (SPEC R1, R5, R6): data only, with serde and validation.
//!
//! The TOML form is documented field by field in `examples/routes.toml`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::RoutingError;

/// The largest epoch a table may carry (`i64::MAX`: etcd revisions and every source's
/// epochs stay far below). Above it no later table could be newer, and routing would
/// freeze on the first one applied ([`RoutingError::EpochTooLarge`]).
pub const MAX_EPOCH: u64 = i64::MAX as u64;

/// A complete route table as published by the control plane.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteTable {
    /// Monotonic version; an edge accepts only a table with a larger epoch.
    pub epoch: u64,
    /// When the table was written, unix time in milliseconds (informational).
    #[serde(default)]
    pub updated_at: u64,
    /// Layer 1 and layer 2 definitions, one per service.
    #[serde(default)]
    pub services: Vec<ServiceSpec>,
    /// Explicit placements that override the hash (SPEC R3).
    #[serde(default)]
    pub assignments: Assignments,
}

/// One service: the message ids it handles and how keys map to its instances.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    /// Unique service name.
    pub name: String,
    /// Inclusive message id ranges `[lo, hi]` routed to this service (layer 1). May be empty
    /// for a service reached only as a canary alternate.
    #[serde(default)]
    pub messages: Vec<[u32; 2]>,
    /// Which business key picks the instance, or an any-instance policy (layer 2).
    pub key: KeyKind,
    /// Optional canary: a share of players routed to an alternate service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
    /// The instances of this service.
    #[serde(default)]
    pub instances: Vec<InstanceSpec>,
}

/// How a service chooses an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum KeyKind {
    /// Rendezvous hash of the player id.
    Player,
    /// Room assignment, else rendezvous hash of the room id.
    Room,
    /// Rendezvous hash of the guild id.
    Guild,
    /// Rendezvous hash of the order id.
    Order,
    /// Any instance, cycling through the eligible ones (nothing is bound).
    RoundRobin,
    /// Any instance, the least loaded by reported players per unit of weight; the player's
    /// session is then bound to it.
    LeastLoaded,
}

impl KeyKind {
    /// Whether this policy hashes a business key.
    #[must_use]
    pub fn is_keyed(self) -> bool {
        matches!(self, Self::Player | Self::Room | Self::Guild | Self::Order)
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Player => "player",
            Self::Room => "room",
            Self::Guild => "guild",
            Self::Order => "order",
            Self::RoundRobin => "round_robin",
            Self::LeastLoaded => "least_loaded",
        })
    }
}

/// Canary (SPEC R8): players whose id hashes below `percent` go to `service` instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Canary {
    /// Share of players, 0.0 ..= 100.0, chosen by a stable hash of the player id.
    pub percent: f64,
    /// The alternate service (must exist, use the same key kind and have no canary itself).
    pub service: String,
}

/// One backend instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceSpec {
    /// Stable id, unique across the table; it is hashed, so renaming moves keys.
    pub id: String,
    /// Where the edge's backend link connects, `host:port`.
    pub address: String,
    /// Relative share of new keys (finite, >= 0; 0 takes no new keys).
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// Administrative state.
    #[serde(default)]
    pub state: InstanceState,
    /// Maximum number of bound keys (players); at the cap it takes no new ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
}

fn default_weight() -> f64 {
    1.0
}

/// Administrative state of an instance (SPEC R6).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InstanceState {
    /// Takes new keys.
    #[default]
    Active,
    /// Takes no new keys; bound players are migrated away at the planner's rate; rooms stay
    /// until they end.
    Draining,
    /// Out of service: no new keys, bound players migrated, rooms on it are lost.
    Disabled,
}

/// Explicit placements (SPEC R3). Instance ids are global, so each names its service.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Assignments {
    /// Pinned players: player id -> instance id (of a player- or least-loaded-keyed service).
    #[serde(default)]
    pub players: BTreeMap<String, String>,
    /// Rooms created on an instance: room id -> instance id (of a room-keyed service).
    #[serde(default)]
    pub rooms: BTreeMap<String, String>,
}

/// Text format of a table file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// TOML (the documented, commented format).
    Toml,
    /// JSON (what the control plane and the persisted last good table use).
    Json,
}

impl TableFormat {
    /// `.json` is JSON; anything else is TOML.
    #[must_use]
    pub fn from_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("json") => Self::Json,
            _ => Self::Toml,
        }
    }
}

impl RouteTable {
    /// An empty table at `epoch` (useful for building tables in code).
    #[must_use]
    pub fn new(epoch: u64) -> Self {
        Self {
            epoch,
            updated_at: 0,
            services: Vec::new(),
            assignments: Assignments::default(),
        }
    }

    /// Parses TOML and validates.
    pub fn from_toml_str(text: &str) -> Result<Self, RoutingError> {
        let t: Self = toml::from_str(text)?;
        t.validate()?;
        Ok(t)
    }

    /// Parses JSON and validates.
    pub fn from_json_str(text: &str) -> Result<Self, RoutingError> {
        let t: Self = serde_json::from_str(text)?;
        t.validate()?;
        Ok(t)
    }

    /// Parses arbitrary bytes in `format` and validates; never panics.
    pub fn from_slice(bytes: &[u8], format: TableFormat) -> Result<Self, RoutingError> {
        match format {
            TableFormat::Json => {
                let t: Self = serde_json::from_slice(bytes)?;
                t.validate()?;
                Ok(t)
            }
            TableFormat::Toml => {
                Self::from_toml_str(std::str::from_utf8(bytes).map_err(|_| RoutingError::NotUtf8)?)
            }
        }
    }

    /// Serializes as pretty TOML.
    pub fn to_toml_string(&self) -> Result<String, RoutingError> {
        Ok(toml::to_string_pretty(self)?)
    }

    /// Serializes as pretty JSON.
    pub fn to_json_string(&self) -> Result<String, RoutingError> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// The service named `name`.
    #[must_use]
    pub fn service(&self, name: &str) -> Option<&ServiceSpec> {
        self.services.iter().find(|s| s.name == name)
    }

    /// The instance `id` and the service it belongs to.
    #[must_use]
    pub fn instance(&self, id: &str) -> Option<(&ServiceSpec, &InstanceSpec)> {
        self.services
            .iter()
            .find_map(|s| s.instances.iter().find(|i| i.id == id).map(|i| (s, i)))
    }

    /// Layer 1 by linear scan (the [`crate::Router`] uses a compiled, sorted index).
    #[must_use]
    pub fn service_for_message(&self, message_id: u32) -> Option<&ServiceSpec> {
        self.services.iter().find(|s| {
            s.messages
                .iter()
                .any(|[lo, hi]| (*lo..=*hi).contains(&message_id))
        })
    }

    /// Checks every invariant; the first violation found (in a deterministic order) is
    /// returned.
    pub fn validate(&self) -> Result<(), RoutingError> {
        if self.epoch > MAX_EPOCH {
            return Err(RoutingError::EpochTooLarge {
                epoch: self.epoch,
                max: MAX_EPOCH,
            });
        }
        let mut services: HashMap<&str, &ServiceSpec> = HashMap::new();
        let mut instances: HashMap<&str, &str> = HashMap::new();
        let mut ranges: Vec<(u32, u32, &str)> = Vec::new();
        for s in &self.services {
            if s.name.is_empty() {
                return Err(RoutingError::EmptyId { what: "service" });
            }
            if services.insert(&s.name, s).is_some() {
                return Err(RoutingError::DuplicateService {
                    service: s.name.clone(),
                });
            }
            for &[lo, hi] in &s.messages {
                if lo > hi {
                    return Err(RoutingError::InvalidRange {
                        service: s.name.clone(),
                        lo,
                        hi,
                    });
                }
                ranges.push((lo, hi, &s.name));
            }
            for i in &s.instances {
                if i.id.is_empty() {
                    return Err(RoutingError::EmptyId { what: "instance" });
                }
                if let Some(first) = instances.insert(&i.id, &s.name) {
                    return Err(RoutingError::DuplicateInstance {
                        instance: i.id.clone(),
                        first: first.to_owned(),
                        second: s.name.clone(),
                    });
                }
                if !i.weight.is_finite() || i.weight < 0.0 {
                    return Err(RoutingError::InvalidWeight {
                        instance: i.id.clone(),
                        weight: i.weight,
                    });
                }
                if !valid_address(&i.address) {
                    return Err(RoutingError::InvalidAddress {
                        instance: i.id.clone(),
                        address: i.address.clone(),
                    });
                }
            }
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            let (a, b) = (w[0], w[1]);
            if b.0 <= a.1 {
                return Err(RoutingError::OverlappingRanges {
                    a_service: a.2.to_owned(),
                    a_lo: a.0,
                    a_hi: a.1,
                    b_service: b.2.to_owned(),
                    b_lo: b.0,
                    b_hi: b.1,
                });
            }
        }
        for s in &self.services {
            if let Some(c) = &s.canary {
                let invalid = |reason| RoutingError::InvalidCanary {
                    service: s.name.clone(),
                    reason,
                };
                if !c.percent.is_finite() || !(0.0..=100.0).contains(&c.percent) {
                    return Err(invalid("percent must be within 0..=100"));
                }
                let Some(alt) = services.get(c.service.as_str()) else {
                    return Err(RoutingError::UnknownService {
                        context: format!("canary of service {:?}", s.name),
                        service: c.service.clone(),
                    });
                };
                if alt.name == s.name {
                    return Err(invalid("the alternate is the service itself"));
                }
                if alt.key != s.key {
                    return Err(invalid("the alternate service uses a different key kind"));
                }
                if alt.canary.is_some() {
                    return Err(invalid("the alternate service has a canary itself"));
                }
            }
        }
        let check = |what: &'static str,
                     map: &BTreeMap<String, String>,
                     fits: fn(KeyKind) -> bool|
         -> Result<(), RoutingError> {
            for (key, inst) in map {
                if key.is_empty() {
                    return Err(RoutingError::EmptyId { what });
                }
                let Some(svc) = instances.get(inst.as_str()) else {
                    return Err(RoutingError::UnknownInstance {
                        what,
                        key: key.clone(),
                        instance: inst.clone(),
                    });
                };
                let kind = services[svc].key;
                if !fits(kind) {
                    return Err(RoutingError::AssignmentKindMismatch {
                        what,
                        key: key.clone(),
                        instance: inst.clone(),
                        service: (*svc).to_owned(),
                        kind,
                    });
                }
            }
            Ok(())
        };
        check("pinned player", &self.assignments.players, |k| {
            matches!(k, KeyKind::Player | KeyKind::LeastLoaded)
        })?;
        check("room", &self.assignments.rooms, |k| k == KeyKind::Room)?;
        Ok(())
    }
}

/// `host:port` with a non-empty host and a numeric port (IPv6 as `[::1]:port`).
fn valid_address(a: &str) -> bool {
    match a.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok(),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(id: &str) -> InstanceSpec {
        InstanceSpec {
            id: id.into(),
            address: "127.0.0.1:1".into(),
            weight: 1.0,
            state: InstanceState::Active,
            capacity: None,
        }
    }

    fn svc(name: &str, lo: u32, hi: u32, ids: &[&str]) -> ServiceSpec {
        ServiceSpec {
            name: name.into(),
            messages: vec![[lo, hi]],
            key: KeyKind::Player,
            canary: None,
            instances: ids.iter().map(|i| inst(i)).collect(),
        }
    }

    fn table() -> RouteTable {
        let mut t = RouteTable::new(1);
        t.services.push(svc("a", 0, 9, &["a1", "a2"]));
        t.services.push(svc("b", 10, 19, &["b1"]));
        t
    }

    #[test]
    fn valid_table_passes() {
        table().validate().expect("valid");
    }

    #[test]
    fn duplicate_instance() {
        let mut t = table();
        t.services[1].instances.push(inst("a1"));
        assert!(matches!(
            t.validate(),
            Err(RoutingError::DuplicateInstance { .. })
        ));
    }

    #[test]
    fn overlapping_ranges() {
        let mut t = table();
        t.services[1].messages = vec![[9, 12]];
        assert!(matches!(
            t.validate(),
            Err(RoutingError::OverlappingRanges { .. })
        ));
    }

    #[test]
    fn bad_weights() {
        for w in [-1.0, f64::NAN, f64::INFINITY] {
            let mut t = table();
            t.services[0].instances[0].weight = w;
            assert!(
                matches!(t.validate(), Err(RoutingError::InvalidWeight { .. })),
                "{w}"
            );
        }
    }

    #[test]
    fn unknown_canary_service_and_instance() {
        let mut t = table();
        t.services[0].canary = Some(Canary {
            percent: 5.0,
            service: "nope".into(),
        });
        assert!(matches!(
            t.validate(),
            Err(RoutingError::UnknownService { .. })
        ));
        let mut t = table();
        t.assignments.players.insert("p".into(), "zz".into());
        assert!(matches!(
            t.validate(),
            Err(RoutingError::UnknownInstance { .. })
        ));
        let mut t = table();
        t.assignments.rooms.insert("r".into(), "a1".into());
        assert!(matches!(
            t.validate(),
            Err(RoutingError::AssignmentKindMismatch { .. })
        ));
    }

    #[test]
    fn bad_address_and_range() {
        let mut t = table();
        t.services[0].instances[0].address = "nohost".into();
        assert!(matches!(
            t.validate(),
            Err(RoutingError::InvalidAddress { .. })
        ));
        let mut t = table();
        t.services[0].messages = vec![[5, 4]];
        assert!(matches!(
            t.validate(),
            Err(RoutingError::InvalidRange { .. })
        ));
    }

    #[test]
    fn toml_json_round_trip() {
        let t = table();
        let back = RouteTable::from_toml_str(&t.to_toml_string().expect("toml")).expect("parse");
        assert_eq!(t, back);
        let back = RouteTable::from_json_str(&t.to_json_string().expect("json")).expect("parse");
        assert_eq!(t, back);
    }
}

//! Helpers shared by the integration tests.
#![allow(dead_code, unreachable_pub, missing_docs)]

use waygate_routing::{InstanceSpec, InstanceState, KeyKind, RouteTable, ServiceSpec};

pub fn inst(id: &str, weight: f64) -> InstanceSpec {
    InstanceSpec {
        id: id.into(),
        address: format!("10.0.0.{}:7000", id.len()),
        weight,
        state: InstanceState::Active,
        capacity: None,
    }
}

pub fn service(
    name: &str,
    key: KeyKind,
    lo: u32,
    hi: u32,
    instances: Vec<InstanceSpec>,
) -> ServiceSpec {
    ServiceSpec {
        name: name.into(),
        messages: vec![[lo, hi]],
        key,
        canary: None,
        instances,
    }
}

/// Epoch `epoch`: "player" (ids 1000..=1999) on p1..p3, "room" (2000..=2999) on r1..r2.
pub fn base_table(epoch: u64) -> RouteTable {
    let mut t = RouteTable::new(epoch);
    t.services.push(service(
        "player",
        KeyKind::Player,
        1000,
        1999,
        vec![inst("p1", 1.0), inst("p2", 1.0), inst("p3", 1.0)],
    ));
    t.services.push(service(
        "room",
        KeyKind::Room,
        2000,
        2999,
        vec![inst("r1", 1.0), inst("r2", 1.0)],
    ));
    t
}

pub fn players(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("player-{i}")).collect()
}

pub fn instance_mut<'a>(t: &'a mut RouteTable, id: &str) -> &'a mut InstanceSpec {
    t.services
        .iter_mut()
        .flat_map(|s| s.instances.iter_mut())
        .find(|i| i.id == id)
        .expect("instance exists")
}

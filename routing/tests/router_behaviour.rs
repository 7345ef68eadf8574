//! Router behaviour (SPEC R1, R3–R6, R8, R10) on fixed id sets and a virtual clock.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{base_table, inst, instance_mut, players, service};
use waygate_routing::{
    rebalance, Canary, InstanceState, KeyKind, LoadReport, MigrationCause, MigrationRate,
    PlacementError, RouteReason, RouteRequest, RouteTable, Router, RouterConfig, RoutingError,
    StaleEpochAction,
};

fn router(table: RouteTable, now: Instant) -> Router {
    let mut r = Router::new(RouterConfig::default(), now);
    r.apply_table(table, now).expect("valid table");
    r
}

#[test]
fn layer_one_maps_message_ids_to_services() {
    let now = Instant::now();
    let mut r = router(base_table(1), now);
    assert_eq!(
        r.route(1000, &RouteRequest::player("a"))
            .expect("route")
            .service,
        "player"
    );
    assert_eq!(
        r.route(1999, &RouteRequest::player("a"))
            .expect("route")
            .service,
        "player"
    );
    let d = r
        .route(2500, &RouteRequest::player("a").room("room-1"))
        .expect("route");
    assert_eq!(d.service, "room");
    assert!(matches!(
        r.route(999, &RouteRequest::player("a")),
        Err(RoutingError::NoServiceForMessage { .. })
    ));
    assert!(matches!(
        r.route(3000, &RouteRequest::player("a")),
        Err(RoutingError::NoServiceForMessage { .. })
    ));
    assert!(matches!(
        r.route(2000, &RouteRequest::player("a")),
        Err(RoutingError::MissingKey { .. })
    ));
}

#[test]
fn decisions_match_pure_rendezvous_and_carry_epoch() {
    let now = Instant::now();
    let mut r = router(base_table(7), now);
    let ring = waygate_routing::Rendezvous::new([("p1", 1.0), ("p2", 1.0), ("p3", 1.0)]);
    for p in players(2000) {
        let d = r.route(1000, &RouteRequest::player(&p)).expect("route");
        assert_eq!(d.epoch, 7);
        assert_eq!(d.reason, RouteReason::Hashed);
        assert_eq!(Some(d.instance_id.as_str()), ring.pick(&p));
    }
}

#[test]
fn pins_and_rooms_override_the_hash() {
    let now = Instant::now();
    let mut t = base_table(1);
    let ring = waygate_routing::Rendezvous::new([("p1", 1.0), ("p2", 1.0), ("p3", 1.0)]);
    // Pin every player to an instance the hash would NOT choose.
    let ps = players(300);
    for p in &ps {
        let hashed = ring.pick(p).expect("some");
        let other = ["p1", "p2", "p3"]
            .into_iter()
            .find(|i| *i != hashed)
            .expect("other");
        t.assignments.players.insert(p.clone(), other.to_owned());
    }
    let room_ring = waygate_routing::Rendezvous::new([("r1", 1.0), ("r2", 1.0)]);
    for i in 0..100 {
        let room = format!("room-{i}");
        let other = if room_ring.pick(&room) == Some("r1") {
            "r2"
        } else {
            "r1"
        };
        t.assignments.rooms.insert(room, other.to_owned());
    }
    let mut r = router(t.clone(), now);
    for p in &ps {
        let d = r.route(1000, &RouteRequest::player(p)).expect("route");
        assert_eq!(d.reason, RouteReason::Pinned);
        assert_eq!(&d.instance_id, &t.assignments.players[p]);
    }
    for (room, inst) in &t.assignments.rooms {
        let d = r
            .route(2000, &RouteRequest::player("x").room(room))
            .expect("route");
        assert_eq!(d.reason, RouteReason::RoomAssigned);
        assert_eq!(&d.instance_id, inst);
    }
}

#[test]
fn rebalance_lists_explicit_migrations() {
    let mut old = base_table(1);
    old.assignments
        .players
        .insert("player-7".into(), "p2".into());
    old.assignments
        .players
        .insert("player-8".into(), "p1".into());
    old.assignments.rooms.insert("room-1".into(), "r2".into());
    old.assignments.rooms.insert("room-2".into(), "r1".into());
    let mut new = old.clone();
    new.epoch = 2;
    // p2 and r2 are removed from the table.
    new.services[0].instances.retain(|i| i.id != "p2");
    new.services[1].instances.retain(|i| i.id != "r2");
    new.assignments.players.remove("player-7");
    new.assignments.rooms.remove("room-1");
    let ms = rebalance(&old, &new);
    assert_eq!(ms.len(), 2, "{ms:#?}");
    let p = ms
        .iter()
        .find(|m| m.key == "player-7")
        .expect("player migration");
    assert_eq!(
        (p.kind, p.from.as_str(), p.cause),
        (KeyKind::Player, "p2", MigrationCause::InstanceRemoved)
    );
    let target = p.to.as_deref().expect("a player has a target");
    assert!(["p1", "p3"].contains(&target));
    assert_eq!(
        p.to_address.as_deref(),
        Some(new.instance(target).expect("exists").1.address.as_str())
    );
    let room = ms
        .iter()
        .find(|m| m.key == "room-1")
        .expect("room migration");
    assert_eq!((room.kind, room.from.as_str()), (KeyKind::Room, "r2"));
    assert!(
        room.is_lost(),
        "a room on a removed instance is lost, not moved"
    );
    // Nothing changed -> nothing to do.
    assert!(rebalance(&old, &old).is_empty());
    // A draining instance keeps its room but not its pinned players.
    let mut drain = old.clone();
    drain.epoch = 3;
    instance_mut(&mut drain, "r2").state = InstanceState::Draining;
    instance_mut(&mut drain, "p2").state = InstanceState::Draining;
    drain.assignments.players.remove("player-7");
    let ms = rebalance(&old, &drain);
    assert_eq!(ms.len(), 1, "{ms:#?}");
    assert_eq!(ms[0].cause, MigrationCause::InstanceDraining);
    assert!(ms[0].to.is_some());
}

#[test]
fn sticky_bindings_survive_table_changes_and_move_only_by_migration() {
    let t0 = Instant::now();
    let cfg = RouterConfig {
        migration_rate: MigrationRate {
            per_second: 100.0,
            burst: 10,
        },
        ..RouterConfig::default()
    };
    let mut r = Router::new(cfg, t0);
    r.apply_table(base_table(1), t0).expect("apply");
    let ps = players(1000);
    let before: HashMap<String, String> = ps
        .iter()
        .map(|p| {
            (
                p.clone(),
                r.route(1000, &RouteRequest::player(p))
                    .expect("route")
                    .instance_id,
            )
        })
        .collect();
    // New table: p4 added (the hash would now place some players there) and p1 draining.
    let mut t2 = base_table(2);
    t2.services[0].instances.push(inst("p4", 5.0));
    instance_mut(&mut t2, "p1").state = InstanceState::Draining;
    let report = r.apply_table(t2, t0).expect("apply");
    let on_p1 = before.values().filter(|i| *i == "p1").count();
    assert_eq!(
        report.queued_migrations, on_p1,
        "only the drained instance's bindings move"
    );
    // Routing is unchanged for everyone until a migration is released.
    for p in &ps {
        let d = r.route(1000, &RouteRequest::player(p)).expect("route");
        assert_eq!(
            (&d.instance_id, d.reason, d.epoch),
            (&before[p], RouteReason::Bound, 2)
        );
    }
    // Migrations come out at the configured rate: a burst of 10, then 100/s (the bucket
    // holds at most the burst, so a late poll does not release more than 10 at once).
    let mut released = Vec::new();
    while let Some(m) = r.poll_migration(t0) {
        released.push(m);
    }
    assert_eq!(released.len(), 10);
    let t1 = t0 + Duration::from_millis(50);
    while let Some(m) = r.poll_migration(t1) {
        released.push(m);
    }
    assert_eq!(released.len(), 10 + 5);
    let t2 = t0 + Duration::from_secs(10);
    while let Some(m) = r.poll_migration(t2) {
        released.push(m);
    }
    assert_eq!(released.len(), 10 + 5 + 10);
    let mut t = t2;
    while r.pending_migrations() > 0 {
        t = r.poll_timeout(t).expect("work pending");
        while let Some(m) = r.poll_migration(t) {
            released.push(m);
        }
    }
    assert_eq!(released.len(), on_p1);
    for m in &released {
        assert_eq!(
            (m.from.as_str(), m.cause),
            ("p1", MigrationCause::InstanceDraining)
        );
        let to = m.to.as_deref().expect("target");
        assert_ne!(to, "p1");
        let d = r.route(1000, &RouteRequest::player(&m.key)).expect("route");
        assert_eq!((d.instance_id.as_str(), d.reason), (to, RouteReason::Bound));
    }
    // Everyone not on p1 never moved.
    for p in &ps {
        if before[p] != "p1" {
            assert_eq!(
                r.route(1000, &RouteRequest::player(p))
                    .expect("route")
                    .instance_id,
                before[p]
            );
        }
    }
}

#[test]
fn removed_room_is_reported_lost_through_the_planner() {
    let t0 = Instant::now();
    let mut r = router(base_table(1), t0);
    let d = r
        .route(2000, &RouteRequest::player("x").room("room-9"))
        .expect("route");
    let mut t2 = base_table(2);
    t2.services[1].instances.retain(|i| i.id != d.instance_id);
    assert_eq!(r.apply_table(t2, t0).expect("apply").queued_migrations, 1);
    let m = r.poll_migration(t0).expect("released");
    assert_eq!(
        (m.kind, m.key.as_str(), m.cause),
        (KeyKind::Room, "room-9", MigrationCause::InstanceRemoved)
    );
    assert!(m.is_lost());
    // The room is rebuilt where it is routed next.
    let again = r
        .route(2000, &RouteRequest::player("x").room("room-9"))
        .expect("route");
    assert_ne!(again.instance_id, d.instance_id);
    assert_eq!(again.reason, RouteReason::Hashed);
}

#[test]
fn an_epoch_no_later_table_could_follow_is_refused() {
    // Panic audit: a table with epoch u64::MAX (a hostile or broken etcd value) was
    // applied, then every later table was refused as stale: routing froze until restart.
    let t0 = Instant::now();
    let mut r = router(base_table(5), t0);
    for epoch in [u64::MAX, waygate_routing::MAX_EPOCH + 1] {
        match r.apply_table(base_table(epoch), t0) {
            Err(RoutingError::EpochTooLarge { epoch: e, .. }) => assert_eq!(e, epoch),
            other => panic!("expected EpochTooLarge, got {other:?}"),
        }
    }
    assert_eq!(r.epoch(), Some(5));
    r.apply_table(base_table(waygate_routing::MAX_EPOCH), t0)
        .expect("the largest allowed");
}

#[test]
fn stale_epochs_are_refused_and_backend_staleness_resolves() {
    let t0 = Instant::now();
    let mut r = router(base_table(5), t0);
    for stale in [4, 5] {
        match r.apply_table(base_table(stale), t0) {
            Err(RoutingError::StaleEpoch {
                current: 5,
                offered,
            }) => assert_eq!(offered, stale),
            other => panic!("expected StaleEpoch, got {other:?}"),
        }
    }
    assert_eq!(r.epoch(), Some(5));
    let d = r
        .route(1000, &RouteRequest::player("player-1"))
        .expect("route");
    assert_eq!(d.epoch, 5);
    // The backend already has epoch 6: refresh, apply, re-route.
    assert_eq!(
        r.on_stale_epoch(d.epoch, 6),
        StaleEpochAction::Refresh { at_least: 6 }
    );
    r.apply_table(base_table(6), t0).expect("newer epoch");
    assert_eq!(r.on_stale_epoch(d.epoch, 6), StaleEpochAction::Reroute);
    let d2 = r
        .route(1000, &RouteRequest::player("player-1"))
        .expect("route");
    assert_eq!((d2.epoch, d2.instance_id), (6, d.instance_id));
    assert_eq!(
        r.on_stale_epoch(6, 3),
        StaleEpochAction::BackendBehind { backend_epoch: 3 }
    );
}

#[test]
fn canary_share_within_tolerance_and_sticky() {
    let t0 = Instant::now();
    let mut t = base_table(1);
    t.services.push(service(
        "player-v2",
        KeyKind::Player,
        9000,
        9000,
        vec![inst("c1", 1.0)],
    ));
    t.services[0].canary = Some(Canary {
        percent: 10.0,
        service: "player-v2".into(),
    });
    let mut r = router(t, t0);
    let ps = players(20_000);
    let mut canary = 0;
    for p in &ps {
        let d = r.route(1000, &RouteRequest::player(p)).expect("route");
        if d.canary {
            assert_eq!(
                (d.service.as_str(), d.instance_id.as_str()),
                ("player-v2", "c1")
            );
            canary += 1;
        } else {
            assert_eq!(d.service, "player");
        }
    }
    let share = f64::from(canary) / ps.len() as f64;
    assert!((0.085..=0.115).contains(&share), "canary share {share}");
    // Both paths keep working side by side, and membership is sticky for bound players.
    let d = r.route(1000, &RouteRequest::player(&ps[0])).expect("route");
    assert_eq!(d.reason, RouteReason::Bound);
    // The decision names the service the message id asked for, canary or not (the edge
    // keeps a session's messages to it in order across a canary change).
    for p in &ps[..200] {
        let t = r
            .route_target(1000, &RouteRequest::player(p))
            .expect("route");
        assert_eq!(&*t.requested, "player", "canary {}", t.canary);
    }
}

#[test]
fn removing_the_canary_alternate_moves_its_players_back_explicitly() {
    let t0 = Instant::now();
    let mut t = base_table(1);
    t.services.push(service(
        "player-v2",
        KeyKind::Player,
        9000,
        9000,
        vec![inst("c1", 1.0)],
    ));
    t.services[0].canary = Some(Canary {
        percent: 10.0,
        service: "player-v2".into(),
    });
    let mut r = router(t, t0);
    let ps = players(500);
    let canaried: Vec<&String> = ps
        .iter()
        .filter(|p| {
            r.route(1000, &RouteRequest::player(p))
                .expect("route")
                .canary
        })
        .collect();
    assert!(!canaried.is_empty());
    let report = r.apply_table(base_table(2), t0).expect("apply");
    assert_eq!(report.queued_migrations, canaried.len());
    let mut t = t0;
    let mut n = 0;
    while r.pending_migrations() > 0 {
        t = r.poll_timeout(t).expect("pending");
        while let Some(m) = r.poll_migration(t) {
            assert_eq!(
                (m.from.as_str(), m.cause, m.service.as_str()),
                ("c1", MigrationCause::ServiceRemoved, "player")
            );
            assert!(m.to.is_some());
            n += 1;
        }
    }
    assert_eq!(n, canaried.len());
    for p in canaried {
        let d = r.route(1000, &RouteRequest::player(p)).expect("route");
        assert_eq!(
            (d.service.as_str(), d.canary, d.reason),
            ("player", false, RouteReason::Bound)
        );
    }
}

#[test]
fn capacity_cap_is_respected() {
    let t0 = Instant::now();
    let mut t = base_table(1);
    for id in ["p1", "p2", "p3"] {
        instance_mut(&mut t, id).capacity = Some(100);
    }
    let mut r = router(t, t0);
    let mut count: HashMap<String, u32> = HashMap::new();
    for p in players(300) {
        *count
            .entry(
                r.route(1000, &RouteRequest::player(&p))
                    .expect("route")
                    .instance_id,
            )
            .or_default() += 1;
    }
    assert!(count.values().all(|c| *c == 100), "{count:?}");
    assert!(matches!(
        r.route(1000, &RouteRequest::player("one-too-many")),
        Err(RoutingError::NoEligibleInstance { .. })
    ));
    // Releasing a session frees a slot.
    r.release_key("player-0");
    assert!(r.route(1000, &RouteRequest::player("one-too-many")).is_ok());
    // Reported load (all edges) counts too: p1 reports itself full, so a slot freed locally
    // on p1 is not used; three slots freed elsewhere are.
    r.report_load("p1", LoadReport { players: 1_000 });
    let (mut freed, mut freed_p1) = (0, 0);
    for p in players(300).iter().skip(1) {
        let on = r
            .route(1000, &RouteRequest::player(p))
            .expect("bound")
            .instance_id;
        if on == "p1" && freed_p1 == 0 {
            r.release_key(p);
            freed_p1 += 1;
        } else if on != "p1" && freed < 3 {
            r.release_key(p);
            freed += 1;
        }
    }
    for i in 0..3 {
        let d = r
            .route(1000, &RouteRequest::player(&format!("late-{i}")))
            .expect("route");
        assert_ne!(d.instance_id, "p1");
    }
    assert!(matches!(
        r.route(1000, &RouteRequest::player("late-3")),
        Err(RoutingError::NoEligibleInstance { .. })
    ));
}

#[test]
fn least_loaded_picks_the_least_loaded_eligible_instance() {
    let t0 = Instant::now();
    let mut t = RouteTable::new(1);
    t.services.push(service(
        "lobby",
        KeyKind::LeastLoaded,
        0,
        99,
        vec![
            inst("l1", 1.0),
            inst("l2", 1.0),
            inst("l3", 1.0),
            inst("l4", 1.0),
        ],
    ));
    instance_mut(&mut t, "l4").state = InstanceState::Draining;
    let mut r = router(t, t0);
    r.report_load("l1", LoadReport { players: 50 });
    r.report_load("l2", LoadReport { players: 10 });
    r.report_load("l3", LoadReport { players: 30 });
    r.report_load("l4", LoadReport { players: 0 }); // least loaded but draining
    let d = r.route(0, &RouteRequest::player("a")).expect("route");
    assert_eq!(
        (d.instance_id.as_str(), d.reason),
        ("l2", RouteReason::LeastLoaded)
    );
    // Local placements count until the next report: 20 more go to l2, then l2/l3 alternate.
    let mut n: HashMap<String, u32> = HashMap::new();
    for i in 0..40 {
        *n.entry(
            r.route(0, &RouteRequest::player(&format!("b{i}")))
                .expect("route")
                .instance_id,
        )
        .or_default() += 1;
    }
    assert_eq!(n.get("l1"), None);
    assert_eq!(n.get("l4"), None);
    assert_eq!(n["l2"] + 11, n["l3"] + 30 + 1, "{n:?}");
}

#[test]
fn round_robin_cycles_eligible_instances() {
    let t0 = Instant::now();
    let mut t = RouteTable::new(1);
    t.services.push(service(
        "mm",
        KeyKind::RoundRobin,
        0,
        99,
        vec![
            inst("m3", 1.0),
            inst("m1", 1.0),
            inst("m2", 1.0),
            inst("m4", 0.0),
        ],
    ));
    instance_mut(&mut t, "m2").state = InstanceState::Disabled;
    let mut r = router(t, t0);
    let seq: Vec<String> = (0..6)
        .map(|_| {
            r.route(0, &RouteRequest::player("p"))
                .expect("route")
                .instance_id
        })
        .collect();
    assert_eq!(seq, ["m1", "m3", "m1", "m3", "m1", "m3"]);
    assert!(r.bindings().is_empty(), "round-robin binds nothing");
}

#[test]
fn weight_zero_and_draining_take_no_new_players() {
    let t0 = Instant::now();
    let mut t = base_table(1);
    instance_mut(&mut t, "p1").weight = 0.0;
    instance_mut(&mut t, "p2").state = InstanceState::Draining;
    let mut r = router(t, t0);
    for p in players(2000) {
        assert_eq!(
            r.route(1000, &RouteRequest::player(&p))
                .expect("route")
                .instance_id,
            "p3"
        );
    }
}

#[test]
fn new_instance_ramps_from_zero() {
    let t0 = Instant::now();
    let cfg = RouterConfig {
        weight_ramp: Duration::from_secs(60),
        min_rebuild_interval: Duration::from_secs(5),
        ..RouterConfig::default()
    };
    let mut r = Router::new(cfg, t0);
    r.apply_table(base_table(1), t0).expect("apply");
    let mut t2 = base_table(2);
    t2.services[0].instances.push(inst("p4", 1.0));
    r.apply_table(t2, t0).expect("apply");
    let share_p4 = |r: &mut Router, round: usize| {
        let n = 3000;
        let on = (0..n)
            .filter(|i| {
                let k = format!("ramp-{round}-{i}");
                r.route(1000, &RouteRequest::player(&k))
                    .expect("route")
                    .instance_id
                    == "p4"
            })
            .count();
        on as f64 / n as f64
    };
    assert_eq!(share_p4(&mut r, 0), 0.0, "weight 0 at join");
    assert!(
        !r.tick(t0 + Duration::from_secs(4)).rebuilt,
        "at most one rebuild per interval"
    );
    assert!(r.tick(t0 + Duration::from_secs(30)).rebuilt);
    let half = share_p4(&mut r, 1);
    assert!((0.08..0.16).contains(&half), "half-way share {half}");
    assert!(r.tick(t0 + Duration::from_secs(61)).rebuilt);
    let full = share_p4(&mut r, 2);
    assert!((0.21..0.29).contains(&full), "full share {full}");
    assert!(
        !r.tick(t0 + Duration::from_secs(200)).rebuilt,
        "ramp finished"
    );
}

#[test]
fn example_routes_toml_loads_and_validates() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/routes.toml");
    let text = std::fs::read_to_string(path).expect("examples/routes.toml");
    let t = RouteTable::from_toml_str(&text).expect("the example table is valid");
    let names: Vec<&str> = t.services.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"player") && names.contains(&"room"));
    let ids: Vec<&str> = t
        .service("player")
        .expect("player")
        .instances
        .iter()
        .map(|i| i.id.as_str())
        .collect();
    assert_eq!(ids, ["p1", "p2", "p3"]);
    assert!(t.service("player").expect("player").canary.is_some());
    let now = Instant::now();
    let mut r = router(t, now);
    let d = r
        .route(1000, &RouteRequest::player("player-7"))
        .expect("route");
    assert_eq!(
        (d.instance_id.as_str(), d.reason),
        ("p3", RouteReason::Pinned)
    );
    let d = r
        .route(2000, &RouteRequest::player("x").room("room-42"))
        .expect("route");
    assert_eq!(
        (d.instance_id.as_str(), d.reason),
        ("r1", RouteReason::RoomAssigned)
    );
}

/// R3 dynamic: a backend's PIN places a room on its instance (the table's own assignments
/// still win), moves an existing binding of that room, and is refused for an instance the
/// table does not have for that kind of key.
#[test]
fn a_backend_pin_places_the_room_and_moves_its_binding() {
    let now = Instant::now();
    let mut r = router(base_table(1), now);
    let room = "harbour";
    let req = RouteRequest::player("a").room(room);
    let hashed = r.route(2000, &req).expect("route").instance_id;
    let other = if hashed == "r1" { "r2" } else { "r1" };
    r.pin(KeyKind::Room, room, other).expect("pin");
    let d = r.route(2000, &req).expect("route");
    assert_eq!(d.instance_id, other, "the pin moves the room's binding");
    assert_eq!(
        r.route(2000, &req).expect("route").reason,
        RouteReason::Bound
    );
    assert_eq!(r.pinned(), (0, 1));
    // Unknown for rooms: a player instance, or no instance at all.
    assert!(matches!(
        r.pin(KeyKind::Room, "x", "p1"),
        Err(PlacementError::UnknownInstance { .. })
    ));
    assert!(matches!(
        r.pin(KeyKind::Guild, "x", "r1"),
        Err(PlacementError::KindNotPinnable(KeyKind::Guild))
    ));
    // A player pin places a player that has no binding yet.
    let fresh = "player-never-routed";
    let ring = waygate_routing::Rendezvous::new([("p1", 1.0), ("p2", 1.0), ("p3", 1.0)]);
    let hashed_player = ring.pick(fresh).expect("an instance").to_string();
    let target = if hashed_player == "p3" { "p1" } else { "p3" }.to_string();
    r.pin(KeyKind::Player, fresh, &target).expect("pin player");
    let d = r.route(1000, &RouteRequest::player(fresh)).expect("route");
    assert_eq!(
        (d.instance_id.as_str(), d.reason),
        (target.as_str(), RouteReason::Pinned)
    );
    // The table's assignment wins over a pin.
    let mut t = base_table(2);
    t.assignments.rooms.insert("fort".into(), "r1".into());
    r.apply_table(t, now).expect("newer table");
    r.pin(KeyKind::Room, "fort", "r2").expect("pin");
    let d = r
        .route(2000, &RouteRequest::player("b").room("fort"))
        .expect("route");
    assert_eq!(d.instance_id, "r1");
}

/// A backend's UNPIN: the pin is forgotten (true once, then false); the key's binding made
/// by the pin stays until released, and its next placement goes by the hash again.
#[test]
fn an_unpinned_key_is_placed_by_the_hash_again() {
    let now = Instant::now();
    let mut r = router(base_table(1), now);
    let room = "harbour";
    let req = RouteRequest::player("a").room(room);
    let hashed = r.route(2000, &req).expect("route").instance_id;
    r.release_key(room);
    let other = if hashed == "r1" { "r2" } else { "r1" };
    r.pin(KeyKind::Room, room, other).expect("pin");
    let d = r.route(2000, &req).expect("route");
    assert_eq!(
        (d.instance_id.as_str(), d.reason),
        (other, RouteReason::RoomAssigned)
    );
    assert!(r.unpin(KeyKind::Room, room), "the pin was there");
    assert!(!r.unpin(KeyKind::Room, room), "and is gone");
    assert_eq!(r.pinned(), (0, 0));
    // Nothing moves silently: the binding the pin made holds until it is released.
    let d = r.route(2000, &req).expect("route");
    assert_eq!(
        (d.instance_id.as_str(), d.reason),
        (other, RouteReason::Bound)
    );
    r.release_key(room);
    let d = r.route(2000, &req).expect("route");
    assert_eq!(
        (d.instance_id.as_str(), d.reason),
        (hashed.as_str(), RouteReason::Hashed)
    );
    // Players the same way; an unpin of a key of the other kind removes nothing.
    let player = "player-pinned";
    r.pin(KeyKind::Player, player, "p2").expect("pin player");
    assert!(!r.unpin(KeyKind::Room, player));
    assert!(r.unpin(KeyKind::Player, player));
}

/// At most `MAX_DYNAMIC_PINS` keys of each kind are pinned: one more is refused `Full` (a
/// key already pinned may still be moved), and an unpin makes room again.
#[test]
fn pins_past_the_cap_are_refused_until_one_is_removed() {
    let now = Instant::now();
    let mut r = router(base_table(1), now);
    for i in 0..waygate_routing::MAX_DYNAMIC_PINS {
        r.pin(KeyKind::Room, &format!("room-{i}"), "r1")
            .expect("below the cap");
    }
    assert_eq!(r.pinned(), (0, waygate_routing::MAX_DYNAMIC_PINS));
    assert_eq!(
        r.pin(KeyKind::Room, "one-more", "r1"),
        Err(PlacementError::Full)
    );
    // Re-pinning a pinned key is no new key; the other kind has its own cap.
    r.pin(KeyKind::Room, "room-7", "r2")
        .expect("a pinned key moves");
    r.pin(KeyKind::Player, "one-more", "p1")
        .expect("players apart");
    assert!(r.unpin(KeyKind::Room, "room-7"));
    r.pin(KeyKind::Room, "one-more", "r1").expect("room again");
    assert_eq!(r.pinned(), (1, waygate_routing::MAX_DYNAMIC_PINS));
}

/// A table without a pin's instance (for the pin's key kind) drops the pin: it no longer
/// counts toward the cap and does not come back with a later instance of that id. A
/// disabled instance keeps its pins (routing skips them while it is disabled).
#[test]
fn pins_of_an_instance_removed_from_the_table_are_dropped() {
    let now = Instant::now();
    let mut r = router(base_table(1), now);
    r.pin(KeyKind::Room, "fort", "r2").expect("pin");
    r.pin(KeyKind::Room, "keep", "r1").expect("pin");
    r.pin(KeyKind::Player, "hero", "p3").expect("pin");
    // Disabled: kept.
    let mut t = base_table(2);
    instance_mut(&mut t, "r2").state = InstanceState::Disabled;
    let report = r.apply_table(t, now).expect("newer table");
    assert_eq!((report.pins_dropped, r.pinned()), (0, (1, 2)));
    // r2 removed, and p3 now serves rooms only: both pins go, r1's stays.
    let mut t = base_table(3);
    t.services[1].instances.retain(|i| i.id != "r2");
    t.services[0].instances.retain(|i| i.id != "p3");
    t.services[1].instances.push(inst("p3", 1.0));
    let report = r.apply_table(t, now).expect("newer table");
    assert_eq!((report.pins_dropped, r.pinned()), (2, (0, 1)));
    assert!(!r.unpin(KeyKind::Room, "fort"));
    assert!(!r.unpin(KeyKind::Player, "hero"));
    // r2 back: "fort" is placed by the hash, not by the old pin.
    r.apply_table(base_table(4), now).expect("newer table");
    let d = r
        .route(2000, &RouteRequest::player("b").room("fort"))
        .expect("route");
    assert_eq!(d.reason, RouteReason::Hashed);
    assert!(r.unpin(KeyKind::Room, "keep"));
}

/// A placement carried in a session's snapshot is re-established on another edge's router
/// (session-host issue, defect 6), unless that edge already decided, or the instance no
/// longer takes keys.
#[test]
fn a_carried_placement_is_restored_on_another_router() {
    let now = Instant::now();
    let mut a = router(base_table(1), now);
    let mut b = router(base_table(1), now);
    let req = RouteRequest::player("a").room("harbour");
    let hashed = a.route(2000, &req).expect("route").instance_id;
    let other = if hashed == "r1" { "r2" } else { "r1" };
    a.pin(KeyKind::Room, "harbour", other).expect("pin");
    assert_eq!(a.route(2000, &req).expect("route").instance_id, other);
    // Edge B never saw the PIN: by hash it would pick the other instance.
    assert_eq!(b.restore_binding("harbour", "room", other), Ok(true));
    let d = b.route(2000, &req).expect("route");
    assert_eq!(
        (d.instance_id.as_str(), d.reason),
        (other, RouteReason::Bound)
    );
    // Already bound here: kept, and the answer says whether it matches.
    assert_eq!(b.restore_binding("harbour", "room", &hashed), Ok(false));
    // Unknown service or instance, round-robin services, instances that take no keys.
    assert!(b.restore_binding("x", "nope", "r1").is_err());
    assert!(b.restore_binding("x", "room", "p1").is_err());
    let mut t = base_table(2);
    instance_mut(&mut t, "r2").state = InstanceState::Disabled;
    b.apply_table(t, now).expect("newer table");
    assert_eq!(
        b.restore_binding("y", "room", "r2"),
        Err(PlacementError::NotEligible {
            instance: "r2".into()
        })
    );
}

/// The edge's hot path (`route_target`) decides exactly as `route` and names instances by
/// the compiled table's shared handles (no allocation per message), bound or not.
#[test]
fn route_target_decides_like_route_with_shared_handles() {
    let now = Instant::now();
    let mut a = router(base_table(1), now);
    let mut b = router(base_table(1), now);
    for p in players(300) {
        for (msg, req) in [
            (1000, RouteRequest::player(&p)),
            (2000, RouteRequest::player(&p).room("harbour")),
        ] {
            let t = a.route_target(msg, &req).expect("target");
            let d = b.route(msg, &req).expect("decision");
            assert_eq!(waygate_routing::RouteDecision::from(t.clone()), d);
            // Bound the second time: the same handle as the first.
            let again = a.route_target(msg, &req).expect("target");
            assert_eq!(again.reason, RouteReason::Bound);
            assert!(std::sync::Arc::ptr_eq(&again.target, &t.target));
            assert_eq!(t.target.socket, t.target.address.parse().ok());
        }
    }
}

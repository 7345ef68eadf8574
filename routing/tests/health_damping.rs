//! SPEC R7: new instances join at once, removal only after K consecutive missed heartbeats,
//! at most one rebuild per interval. Virtual clock only.

mod common;

use std::time::{Duration, Instant};

use common::{base_table, players};
use waygate_routing::{
    HealthConfig, HealthTracker, MigrationCause, RouteReason, RouteRequest, Router, RouterConfig,
};

const HB: Duration = Duration::from_secs(1);

fn cfg() -> HealthConfig {
    HealthConfig {
        heartbeat_interval: HB,
        missed_heartbeats: 3,
        min_rebuild_interval: Duration::from_secs(5),
    }
}

#[test]
fn removal_only_after_k_missed_heartbeats() {
    let t0 = Instant::now();
    let mut h = HealthTracker::new(cfg());
    h.sync(["a", "b"], t0);
    for s in 1..=10u64 {
        let now = t0 + HB * s as u32;
        h.heartbeat("a", now);
        if s <= 2 {
            h.heartbeat("b", now); // b's last heartbeat is at t0+2s
        }
        let missed = h.missed("b", now).expect("tracked");
        assert_eq!(
            h.is_down_now("b", now),
            missed >= 3,
            "at {s}s: {missed} missed"
        );
    }
    // b: last heartbeat t0+2s; 2.999 intervals later it is still up.
    assert!(!h.is_down_now("b", t0 + Duration::from_millis(4_999)));
    assert!(h.is_down_now("b", t0 + Duration::from_secs(5)));
    assert!(!h.is_down_now("a", t0 + Duration::from_secs(10)));
    let v = h
        .poll_rebuild(t0 + Duration::from_secs(10))
        .expect("b went down")
        .clone();
    assert_eq!(v.down.into_iter().collect::<Vec<_>>(), ["b"]);
}

#[test]
fn additions_count_at_once() {
    let t0 = Instant::now();
    let mut h = HealthTracker::new(cfg());
    h.heartbeat("new", t0);
    assert!(!h.is_down_now("new", t0));
    assert_eq!(h.poll_rebuild(t0), None, "nothing down, nothing to publish");
    // A down instance that heartbeats is up again immediately (first slot).
    let t1 = t0 + Duration::from_secs(10);
    assert!(h.poll_rebuild(t1).is_some_and(|v| v.down.contains("new")));
    let t2 = t1 + Duration::from_secs(5);
    h.heartbeat("new", t2);
    assert!(!h.is_down_now("new", t2));
    assert!(h.poll_rebuild(t2).is_some_and(|v| v.down.is_empty()));
}

#[test]
fn flapping_instance_rebuilds_at_most_once_per_interval() {
    let t0 = Instant::now();
    let mut h = HealthTracker::new(cfg());
    h.sync(["flappy", "steady"], t0);
    let mut rebuilds = Vec::new();
    // 120 s: flappy is silent for 3.5 s, then heartbeats once, and so on; the edge ticks
    // every 100 ms.
    let mut t = t0;
    let end = t0 + Duration::from_secs(120);
    let mut next_beat = t0 + Duration::from_millis(3_500);
    while t < end {
        h.heartbeat("steady", t);
        if t >= next_beat {
            h.heartbeat("flappy", t);
            next_beat = t + Duration::from_millis(3_500);
        }
        if h.poll_rebuild(t).is_some() {
            rebuilds.push(t);
        }
        t += Duration::from_millis(100);
    }
    assert!(rebuilds.len() >= 2, "the flap was seen: {}", rebuilds.len());
    for w in rebuilds.windows(2) {
        assert!(
            w[1] - w[0] >= Duration::from_secs(5),
            "two rebuilds within one interval"
        );
    }
    assert!(rebuilds.len() <= 120 / 5 + 1);
    assert!(!h.view().down.contains("steady"));
}

#[test]
fn router_moves_bindings_off_a_dead_instance_only() {
    let t0 = Instant::now();
    let rc = RouterConfig {
        health: Some(cfg()),
        ..RouterConfig::default()
    };
    let mut r = Router::new(rc, t0);
    r.apply_table(base_table(1), t0).expect("apply");
    let ps = players(600);
    let before: Vec<String> = ps
        .iter()
        .map(|p| {
            r.route(1000, &RouteRequest::player(p))
                .expect("route")
                .instance_id
        })
        .collect();
    // Everyone but p2 keeps heartbeating.
    let mut t = t0;
    let mut queued = 0;
    let mut rebuilt_at = Vec::new();
    for _ in 0..100 {
        t += Duration::from_millis(100);
        for id in ["p1", "p3", "r1", "r2"] {
            r.heartbeat(id, t);
        }
        let tick = r.tick(t);
        if tick.rebuilt {
            rebuilt_at.push(t);
        }
        queued += tick.queued_migrations;
    }
    assert_eq!(
        rebuilt_at,
        [t0 + Duration::from_secs(3)],
        "down after K=3 missed heartbeats, once"
    );
    assert!(r.down_instances().contains("p2"));
    let on_p2 = before.iter().filter(|i| *i == "p2").count();
    assert_eq!(queued, on_p2);
    let mut moved = 0;
    while r.pending_migrations() > 0 {
        t = r.poll_timeout(t).expect("pending");
        while let Some(m) = r.poll_migration(t) {
            assert_eq!(
                (m.from.as_str(), m.cause),
                ("p2", MigrationCause::InstanceUnhealthy)
            );
            assert_ne!(m.to.as_deref(), Some("p2"));
            moved += 1;
        }
    }
    assert_eq!(moved, on_p2);
    for (p, b) in ps.iter().zip(&before) {
        let d = r.route(1000, &RouteRequest::player(p)).expect("route");
        assert_eq!(d.reason, RouteReason::Bound);
        if b != "p2" {
            assert_eq!(&d.instance_id, b, "a player on a healthy instance moved");
        }
    }
    // New players avoid the dead instance.
    for i in 0..300 {
        let d = r
            .route(1000, &RouteRequest::player(&format!("new-{i}")))
            .expect("route");
        assert_ne!(d.instance_id, "p2");
    }
}

//! Property tests: arbitrary tables and keys never panic; minimal disruption; decoding
//! arbitrary bytes never panics.

mod common;

use std::time::{Duration, Instant};

use proptest::prelude::*;
use waygate_routing::{
    Assignments, InstanceSpec, InstanceState, KeyKind, Rendezvous, RouteRequest, RouteTable,
    Router, RouterConfig, ServiceSpec, TableFormat,
};

fn arb_state() -> impl Strategy<Value = InstanceState> {
    prop_oneof![
        Just(InstanceState::Active),
        Just(InstanceState::Draining),
        Just(InstanceState::Disabled)
    ]
}

fn arb_kind() -> impl Strategy<Value = KeyKind> {
    prop_oneof![
        Just(KeyKind::Player),
        Just(KeyKind::Room),
        Just(KeyKind::Guild),
        Just(KeyKind::Order),
        Just(KeyKind::RoundRobin),
        Just(KeyKind::LeastLoaded),
    ]
}

fn arb_weight() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 0.0f64..10.0,
        1 => Just(0.0),
        1 => Just(-1.0),
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::MIN_POSITIVE),
        1 => Just(1e300),
    ]
}

fn arb_instance(svc: usize) -> impl Strategy<Value = InstanceSpec> {
    (
        0..6usize,
        arb_weight(),
        arb_state(),
        proptest::option::of(0u32..4),
        any::<bool>(),
    )
        .prop_map(
            move |(id, weight, state, capacity, bad_addr)| InstanceSpec {
                id: format!("s{svc}-i{id}"),
                address: if bad_addr {
                    "nope".into()
                } else {
                    format!("10.0.{svc}.{id}:7000")
                },
                weight,
                state,
                capacity,
            },
        )
}

fn arb_table() -> impl Strategy<Value = RouteTable> {
    let svc = |n: usize| {
        (
            arb_kind(),
            prop::collection::vec(arb_instance(n), 0..5),
            prop::collection::vec((0u32..50, 0u32..50), 0..3),
        )
            .prop_map(move |(key, instances, ranges)| ServiceSpec {
                name: format!("svc{n}"),
                messages: ranges
                    .into_iter()
                    .map(|(a, b)| [a.min(b) + 100 * n as u32, a.max(b) + 100 * n as u32])
                    .collect(),
                key,
                canary: None,
                instances,
            })
    };
    (
        1u64..100,
        svc(0),
        svc(1),
        svc(2),
        prop::collection::btree_map("[a-z]{1,3}", "s[0-2]-i[0-5]", 0..4),
    )
        .prop_map(|(epoch, a, b, c, pins)| {
            let mut t = RouteTable::new(epoch);
            t.services = vec![a, b, c];
            t.assignments = Assignments {
                players: pins.clone(),
                rooms: pins,
            };
            t
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_tables_and_keys_never_panic(
        table in arb_table(),
        keys in prop::collection::vec((".{0,8}", 0u32..400), 1..40),
        steps in prop::collection::vec(0u64..5_000, 1..10),
    ) {
        let _ = table.validate();
        let t0 = Instant::now();
        let mut r = Router::new(RouterConfig {
            weight_ramp: Duration::from_secs(3),
            health: Some(waygate_routing::HealthConfig::default()),
            ..RouterConfig::default()
        }, t0);
        // Invalid tables are refused, never half-applied.
        let valid = table.validate().is_ok();
        prop_assert_eq!(r.apply_table(table.clone(), t0).is_ok(), valid);
        let mut now = t0;
        for (k, msg) in &keys {
            let req = RouteRequest::player(k).room(k).guild(k).order(k);
            if let Ok(d) = r.route(*msg, &req) {
                prop_assert_eq!(Some(d.epoch), r.epoch());
            }
        }
        let mut t2 = table;
        t2.epoch += 1;
        if let Some(s) = t2.services.first_mut() { s.instances.pop(); }
        let _ = r.apply_table(t2, now);
        for ms in steps {
            now += Duration::from_millis(ms);
            r.tick(now);
            while r.poll_migration(now).is_some() {}
            for (k, msg) in &keys {
                let _ = r.route(*msg, &RouteRequest::player(k));
            }
        }
    }

    #[test]
    fn removing_an_instance_moves_only_its_keys(
        weights in prop::collection::vec(0.0f64..5.0, 2..12),
        victim in any::<prop::sample::Index>(),
        keys in prop::collection::vec("[a-z0-9-]{0,12}", 1..200),
    ) {
        let ids: Vec<String> = (0..weights.len()).map(|i| format!("inst-{i}")).collect();
        let all: Vec<(String, f64)> = ids.iter().cloned().zip(weights.iter().copied()).collect();
        let v = victim.index(all.len());
        let without: Vec<(String, f64)> = all.iter().enumerate().filter(|(i, _)| *i != v).map(|(_, x)| x.clone()).collect();
        let before = Rendezvous::new(all.clone());
        let after = Rendezvous::new(without);
        for k in &keys {
            let b = before.pick(k);
            let a = after.pick(k);
            if b != Some(ids[v].as_str()) {
                prop_assert_eq!(a, b, "key {:?} moved although its owner stayed", k);
            }
        }
        // Order independence.
        let mut rev = all;
        rev.reverse();
        let rev = Rendezvous::new(rev);
        for k in &keys {
            prop_assert_eq!(rev.pick(k), before.pick(k));
        }
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = RouteTable::from_slice(&bytes, TableFormat::Toml);
        let _ = RouteTable::from_slice(&bytes, TableFormat::Json);
    }

    #[test]
    fn decoding_table_like_text_never_panics(text in r#"(epoch = [0-9]{1,20}\n|\[\[services\]\]\n|name = "[a-z]{0,3}"\n|key = "[a-z_]{0,12}"\n|messages = \[\[[0-9]{1,10}, ?[0-9]{1,10}\]\]\n|\[\[services\.instances\]\]\n|id = "[a-z0-9]{0,3}"\n|address = "[a-z0-9.:]{0,12}"\n|weight = -?[0-9.e]{1,6}\n|state = "[a-z]{0,9}"\n){0,24}"#) {
        if let Ok(t) = RouteTable::from_toml_str(&text) {
            let mut r = Router::new(RouterConfig::default(), Instant::now());
            prop_assert!(r.apply_table(t, Instant::now()).is_ok());
        }
        let json = serde_json::to_string(&text).unwrap_or_default();
        let _ = RouteTable::from_json_str(&json);
    }
}

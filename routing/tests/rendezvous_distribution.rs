//! SPEC R2 on 20,000 fixed player ids ("player-0".."player-19999"): deterministic, order
//! independent, minimal disruption, weighted shares, weight 0.

use std::collections::HashMap;

use waygate_routing::Rendezvous;

const N: usize = 20_000;

fn ids() -> Vec<String> {
    (0..N).map(|i| format!("player-{i}")).collect()
}

fn assign(r: &Rendezvous, keys: &[String]) -> Vec<String> {
    keys.iter()
        .map(|k| r.pick(k).expect("an instance").to_owned())
        .collect()
}

fn shares(owners: &[String]) -> HashMap<String, f64> {
    let mut m: HashMap<String, f64> = HashMap::new();
    for o in owners {
        *m.entry(o.clone()).or_default() += 1.0 / owners.len() as f64;
    }
    m
}

#[test]
fn stable_across_calls_and_instance_order() {
    let keys = ids();
    let a = Rendezvous::new([("p1", 1.0), ("p2", 1.0), ("p3", 1.0)]);
    let b = Rendezvous::new([("p3", 1.0), ("p1", 1.0), ("p2", 1.0)]);
    let first = assign(&a, &keys);
    assert_eq!(first, assign(&a, &keys), "same ring, same answers");
    assert_eq!(first, assign(&b, &keys), "instance order must not matter");
    let s = shares(&first);
    for id in ["p1", "p2", "p3"] {
        let share = s[id];
        assert!((0.30..=0.37).contains(&share), "{id}: {share}");
    }
}

#[test]
fn removing_an_instance_moves_only_its_keys() {
    let keys = ids();
    let before = assign(
        &Rendezvous::new([("p1", 1.0), ("p2", 1.0), ("p3", 1.0)]),
        &keys,
    );
    let after = assign(&Rendezvous::new([("p1", 1.0), ("p3", 1.0)]), &keys);
    let mut moved = 0;
    for (b, a) in before.iter().zip(&after) {
        if b == "p2" {
            assert_ne!(a, "p2");
            moved += 1;
        } else {
            assert_eq!(a, b, "a key not owned by p2 moved");
        }
    }
    assert_eq!(moved, before.iter().filter(|o| *o == "p2").count());
    assert!(moved > 0);
}

#[test]
fn adding_an_instance_moves_keys_only_to_it() {
    let keys = ids();
    let before = assign(&Rendezvous::new([("p1", 1.0), ("p2", 1.0)]), &keys);
    let after = assign(
        &Rendezvous::new([("p1", 1.0), ("p2", 1.0), ("p3", 1.0)]),
        &keys,
    );
    for (b, a) in before.iter().zip(&after) {
        assert!(a == b || a == "p3", "{b} -> {a}");
    }
}

#[test]
fn weights_one_one_two() {
    let owners = assign(
        &Rendezvous::new([("p1", 1.0), ("p2", 1.0), ("p3", 2.0)]),
        &ids(),
    );
    let s = shares(&owners);
    for id in ["p1", "p2"] {
        assert!((0.18..=0.32).contains(&s[id]), "{id}: {}", s[id]);
    }
    assert!((0.43..=0.57).contains(&s["p3"]), "p3: {}", s["p3"]);
}

#[test]
fn weight_zero_gets_none() {
    let owners = assign(
        &Rendezvous::new([("p1", 1.0), ("p2", 0.0), ("p3", 1.0)]),
        &ids(),
    );
    assert!(owners.iter().all(|o| o != "p2"));
}

#[test]
fn fast_pick_equals_textbook_argmax() {
    let cands: [(&str, f64); 5] = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 0.5), ("e", 3.25)];
    let ring = Rendezvous::new(cands);
    for k in ids() {
        assert_eq!(ring.pick(&k), Rendezvous::pick_naive(&k, &cands), "{k}");
    }
}

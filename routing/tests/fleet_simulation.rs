//! A sans-IO simulation of a large fleet (SPEC R2, R9; many-edges issue): many edges each
//! hold their own route plane, a table change is a local update on every edge, all edges
//! agree on every placement without talking to each other, and the fraction of keys a change
//! moves matches theory (1/N for one instance out of N). Scaled to run in the test suite:
//! 100 edges x 200,000 keys here; `WAYGATE_SIM_KEYS=1000000` runs the full 1M.

#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Instant;

use waygate_routing::{RouteRequest, RouteTable, Router, RouterConfig};

fn table(epoch: u64, instances: usize, skip: Option<usize>) -> RouteTable {
    let mut t = format!("epoch = {epoch}\nupdated_at = 0\n[[services]]\nname = \"player\"\nmessages = [[1000, 1999]]\nkey = \"player\"\n");
    for i in 0..instances {
        if Some(i) == skip {
            continue;
        }
        t.push_str(&format!(
            "  [[services.instances]]\n  id = \"g{i}\"\n  address = \"10.0.{}.{}:7000\"\n",
            i / 250,
            i % 250 + 1
        ));
    }
    RouteTable::from_toml_str(&t).unwrap()
}

fn place(router: &mut Router, key: &str) -> String {
    router
        .route(1000, &RouteRequest::player(key))
        .unwrap()
        .instance_id
}

#[test]
fn a_hundred_edges_agree_and_one_removal_moves_one_nth_of_the_keys() {
    let keys: usize = std::env::var("WAYGATE_SIM_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let n = 50;
    let now = Instant::now();
    // 100 edges, each with its own router: a table push is a local apply on each.
    let mut edges: Vec<Router> = (0..100)
        .map(|_| {
            let mut r = Router::new(RouterConfig::default(), now);
            r.apply_table(table(1, n, None), now).unwrap();
            r
        })
        .collect();
    // Placement of every key on edge 0 (fresh routers: the hash decides).
    let mut reference = Router::new(RouterConfig::default(), now);
    reference.apply_table(table(1, n, None), now).unwrap();
    let before: Vec<String> = (0..keys)
        .map(|k| place(&mut reference, &format!("p{k}")))
        .collect();
    // Every edge agrees on a sample of keys, with no coordination.
    for (e, edge) in edges.iter_mut().enumerate() {
        for k in (e..keys).step_by(997) {
            assert_eq!(place(edge, &format!("p{k}")), before[k], "edge {e} key {k}");
        }
    }
    // Remove one instance: a fresh placement moves exactly that instance's keys.
    let removed = "g17";
    let mut after_router = Router::new(RouterConfig::default(), now);
    after_router
        .apply_table(table(2, n, Some(17)), now)
        .unwrap();
    let mut moved = 0usize;
    for (k, was) in before.iter().enumerate() {
        let now_on = place(&mut after_router, &format!("p{k}"));
        if was == removed {
            assert_ne!(now_on, removed);
            moved += 1;
        } else {
            assert_eq!(&now_on, was, "key p{k} moved although its instance stayed");
        }
    }
    let fraction = moved as f64 / keys as f64;
    let theory = 1.0 / n as f64;
    assert!(
        (fraction - theory).abs() < theory * 0.1,
        "moved {fraction:.4} of the keys, theory {theory:.4}"
    );
    // Every edge applies the new table locally (newer epoch only).
    for edge in &mut edges {
        edge.apply_table(table(2, n, Some(17)), now).unwrap();
        assert!(
            edge.apply_table(table(2, n, Some(17)), now).is_err(),
            "same epoch refused"
        );
    }
    // Route-plane memory per edge: the table is shared per process; report its size.
    let json = serde_json::to_vec(&table(2, n, Some(17))).unwrap();
    println!(
        "{} edges, {keys} keys, {n} instances: one removal moved {:.3}% (theory {:.3}%); table {} bytes as JSON",
        edges.len(),
        fraction * 100.0,
        theory * 100.0,
        json.len()
    );
}

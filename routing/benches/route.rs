//! Routing decisions per second with 10, 100 and 1,000 instances.
//!
//! * `pick_naive`: textbook weighted rendezvous (hash each (key, id) pair, one logarithm per
//!   instance): the baseline.
//! * `pick`: the compiled ring (per-instance hash state precomputed, one `splitmix64` per
//!   instance and one logarithm per distinct weight).
//! * `router_place`: a full `Router::route` of a new key (layer 1, canary check, capacity,
//!   hash, binding) followed by releasing it.
//! * `router_bound`: `Router::route` of a key that is already bound (steady state: every
//!   message after a session's first one per service).
//!
//! Run: `cargo bench -p waygate-routing -- --warm-up-time 1 --measurement-time 3`
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use waygate_routing::{
    InstanceSpec, InstanceState, KeyKind, Rendezvous, RouteRequest, RouteTable, Router,
    RouterConfig, ServiceSpec,
};

const SIZES: [usize; 3] = [10, 100, 1_000];
const KEYS: usize = 4_096;

fn instances(n: usize) -> Vec<(String, f64)> {
    // Two weight classes, as in a fleet with old and new machine types.
    (0..n)
        .map(|i| {
            (
                format!("instance-{i:04}"),
                if i % 4 == 0 { 2.0 } else { 1.0 },
            )
        })
        .collect()
}

fn table(n: usize) -> RouteTable {
    let mut t = RouteTable::new(1);
    t.services.push(ServiceSpec {
        name: "player".into(),
        messages: vec![[1000, 1999]],
        key: KeyKind::Player,
        canary: None,
        instances: instances(n)
            .into_iter()
            .enumerate()
            .map(|(i, (id, weight))| InstanceSpec {
                id,
                address: format!("10.0.{}.{}:7000", i / 256, i % 256),
                weight,
                state: InstanceState::Active,
                capacity: Some(1_000_000),
            })
            .collect(),
    });
    t
}

fn keys() -> Vec<String> {
    (0..KEYS).map(|i| format!("player-{i}")).collect()
}

fn bench(c: &mut Criterion) {
    let keys = keys();
    let mut g = c.benchmark_group("route");
    g.throughput(Throughput::Elements(1));
    for n in SIZES {
        let inst = instances(n);
        let borrowed: Vec<(&str, f64)> = inst.iter().map(|(i, w)| (i.as_str(), *w)).collect();
        g.bench_with_input(BenchmarkId::new("pick_naive", n), &n, |b, _| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % KEYS;
                black_box(Rendezvous::pick_naive(&keys[i], &borrowed))
            });
        });
        let ring = Rendezvous::new(inst.clone());
        g.bench_with_input(BenchmarkId::new("pick", n), &n, |b, _| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % KEYS;
                black_box(ring.pick(&keys[i]))
            });
        });
        let now = Instant::now();
        let mut router = Router::new(RouterConfig::default(), now);
        router.apply_table(table(n), now).expect("valid");
        g.bench_with_input(BenchmarkId::new("router_place", n), &n, |b, _| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % KEYS;
                let d = router
                    .route(1000, &RouteRequest::player(&keys[i]))
                    .expect("route");
                router.release_key(&keys[i]);
                black_box(d)
            });
        });
        for k in &keys {
            router.route(1000, &RouteRequest::player(k)).expect("route");
        }
        g.bench_with_input(BenchmarkId::new("router_bound", n), &n, |b, _| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % KEYS;
                black_box(
                    router
                        .route(1000, &RouteRequest::player(&keys[i]))
                        .expect("route"),
                )
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! Fleet simulation, memory (scale-out issue, item 5): what one edge's route plane holds for
//! its share of 1M sessions over 100 edges — the compiled route table and one sticky binding
//! per session's player key (10,000 per edge). Counted by a counting global allocator in a
//! test binary of its own, so nothing else allocates while it measures.

#![allow(unsafe_code)] // the counting allocator only: `GlobalAlloc` is an unsafe trait
#![allow(clippy::unwrap_used, missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use waygate_routing::{RouteRequest, RouteTable, Router, RouterConfig};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only the byte count
// of live allocations is kept on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn table(instances: usize) -> RouteTable {
    let mut t = String::from(
        "epoch = 1\nupdated_at = 0\n[[services]]\nname = \"player\"\nmessages = [[1000, 1999]]\nkey = \"player\"\n",
    );
    for i in 0..instances {
        t.push_str(&format!(
            "  [[services.instances]]\n  id = \"g{i}\"\n  address = \"10.0.{}.{}:7000\"\n",
            i / 250,
            i % 250 + 1
        ));
    }
    RouteTable::from_toml_str(&t).unwrap()
}

#[test]
fn one_edges_route_plane_for_its_ten_thousand_sessions() {
    const SESSIONS: usize = 10_000; // 1M sessions over 100 edges
    let now = Instant::now();
    let t = table(50);
    let players: Vec<String> = (0..SESSIONS).map(|i| format!("player-{i:07}")).collect();

    let start = live();
    let mut router = Router::new(RouterConfig::default(), now);
    router.apply_table(t, now).unwrap();
    let table_bytes = live() - start;

    let before = live();
    for p in &players {
        router.route(1000, &RouteRequest::player(p)).unwrap();
    }
    let bindings_bytes = live() - before;
    assert_eq!(router.bindings().len(), SESSIONS);
    let per_session = bindings_bytes as f64 / SESSIONS as f64;
    println!(
        "route plane of one edge: table of 50 instances {table_bytes} B, {SESSIONS} sticky \
         bindings {bindings_bytes} B ({per_session:.0} B per session); 100 edges x 10,000 \
         sessions: {:.1} MiB per edge",
        (table_bytes + bindings_bytes) as f64 / (1024.0 * 1024.0)
    );
    // A binding is a key, a service, an instance and an address; a regression that made
    // them fat (a copy of the table per binding, a map per session) shows here.
    assert!(per_session < 512.0, "{per_session} B per session");

    // Sessions ending release their bindings: what is left is the table and the maps'
    // spare capacity, not the bindings themselves.
    for p in &players {
        router.release_key(p);
    }
    assert!(router.bindings().is_empty());
    let after_release = live() - start;
    println!("after every session ended: {after_release} B held (table + map capacity)");
    assert!(
        after_release < table_bytes + bindings_bytes / 2,
        "{after_release} B still held after releasing {bindings_bytes} B of bindings"
    );
}

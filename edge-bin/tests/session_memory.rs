//! Performance issue, W4: what one idle session costs the edge's heap, and where it goes.
//!
//! The edge runs in this process on a runtime of its own whose threads are marked; a
//! counting global allocator keeps the live bytes allocated on marked threads, by size, so
//! the clients and the backend (on another runtime) are not counted. Sessions are opened
//! in phases over real sockets, TCP then WebSocket — connected but silent (transport and
//! pre-auth, before the upgrade on WebSocket), logged in, then after one echo each (open on
//! the backend link) — and each phase's cost per session is the difference between two
//! populations (the first sessions' one-off growth of shared maps is left out). The biggest allocation sizes are printed: the per-component
//! breakdown BENCHMARKS.md quotes.

#![allow(unsafe_code)] // the counting allocator only: `GlobalAlloc` is an unsafe trait
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use waygate_client::{Client, ClientOptions, Event};
use waygate_transport::endpoint::{ConnectOptions, Endpoint};
use waygate_transport::tls::ClientTls;
use waygate_transport::TransportKind;

struct Counting;

thread_local! {
    static EDGE_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Bound of an idle WebSocket session's heap on the edge (bytes): 10.1 KiB measured when
/// tungstenite's read buffer was 4 KiB, 7.5 KiB with 1 KiB, 6.2 KiB since the session task
/// and the connection's receive future are sized for what an idle session awaits.
const WS_BOUND: f64 = 7.0 * 1024.0;
/// Edge heap of an idle QUIC session after one echo (a regression guard: quinn holds most;
/// 46.0 KB measured while quinn kept a 10-packet send buffer per connection for segmentation
/// offload, 35.2 KB since it is off by default).
const QUIC_BOUND: f64 = 35.5 * 1024.0;
/// Bound of a WebSocket connection whose upgrade has not arrived: 48.5 KiB before its
/// handshake future was boxed (held twice, sized for wss), 12.6 KiB after (tungstenite's
/// handshake buffers are 8 KiB of it).
const WS_PENDING_BOUND: f64 = 16.0 * 1024.0;

/// Size classes of 16 bytes up to 64 KiB; the last one holds everything larger.
const CLASSES: usize = 4097;
static LIVE: AtomicI64 = AtomicI64::new(0);
static BY_CLASS_BYTES: [AtomicI64; CLASSES] = [const { AtomicI64::new(0) }; CLASSES];
static BY_CLASS_COUNT: [AtomicI64; CLASSES] = [const { AtomicI64::new(0) }; CLASSES];

fn on_edge_thread() -> bool {
    EDGE_THREAD.try_with(Cell::get).unwrap_or(false)
}

fn count(size: usize, sign: i64) {
    if !on_edge_thread() {
        return;
    }
    let class = (size / 16).min(CLASSES - 1);
    LIVE.fetch_add(sign * size as i64, Ordering::Relaxed);
    BY_CLASS_BYTES[class].fetch_add(sign * size as i64, Ordering::Relaxed);
    BY_CLASS_COUNT[class].fetch_add(sign, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counts of live
// allocations made on the edge's threads are kept on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size(), 1);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) };
        count(layout.size(), -1);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(layout.size(), -1);
            count(new_size, 1);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The edge heap at one moment: live bytes, and live bytes and allocations per size class.
struct Heap {
    live: i64,
    bytes: Vec<i64>,
    count: Vec<i64>,
}

fn heap() -> Heap {
    Heap {
        live: LIVE.load(Ordering::Relaxed),
        bytes: BY_CLASS_BYTES
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect(),
        count: BY_CLASS_COUNT
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect(),
    }
}

/// Bytes per session between two moments `n` sessions apart, printed with the largest
/// size classes (allocations per session, bytes per session).
fn per_session(phase: &str, before: &Heap, after: &Heap, n: usize) -> f64 {
    let per = (after.live - before.live) as f64 / n as f64;
    let mut classes: Vec<(usize, f64, f64)> = (0..CLASSES)
        .map(|c| {
            (
                c,
                (after.count[c] - before.count[c]) as f64 / n as f64,
                (after.bytes[c] - before.bytes[c]) as f64 / n as f64,
            )
        })
        .filter(|(_, _, b)| b.abs() >= 8.0)
        .collect();
    classes.sort_by(|a, b| b.2.total_cmp(&a.2));
    println!("{phase}: {per:.0} B of edge heap per session");
    for (c, count, bytes) in classes.iter().take(12) {
        let range = if *c == CLASSES - 1 {
            "64 KiB+".to_string()
        } else {
            format!("{}..{} B", c * 16, c * 16 + 15)
        };
        println!("  {range:>14}: {count:5.2} allocations, {bytes:7.0} B per session");
    }
    per
}

/// Waits until the edge has been quiet (its heap unchanged) for a moment, bounded.
fn settle() {
    let mut last = LIVE.load(Ordering::Relaxed);
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(200));
        let now = LIVE.load(Ordering::Relaxed);
        if now == last {
            return;
        }
        last = now;
    }
}

/// Raises this process's open-file soft limit to its hard limit: the test holds a few
/// thousand sockets (both ends in this process).
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit with a valid, initialized struct.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

async fn logged_in(
    kind: TransportKind,
    addr: std::net::SocketAddr,
    player: String,
    tls: ClientTls,
) -> Client {
    let mut options = ClientOptions::new(vec![Endpoint::new(kind, addr)], common::token(&player));
    options.connect = ConnectOptions {
        tls: Some(tls),
        ..ConnectOptions::default()
    };
    let mut client = Client::start(options);
    common::wait_for(&mut client, Duration::from_secs(30), |e| {
        matches!(e, Event::Connected { .. })
    })
    .await;
    client
}

/// One transport's idle session: its cost in the edge's heap (bytes) connected with nothing
/// sent, and after one echo; the cost per phase printed. The clients are closed before it
/// returns (their sessions linger on the edge; the next measurement counts differences
/// only).
fn idle_session_heap(
    client_rt: &tokio::runtime::Runtime,
    kind: TransportKind,
    addr: std::net::SocketAddr,
    tls: &ClientTls,
    player: &mut usize,
) -> (f64, f64) {
    const WARM: usize = 100;
    const N: usize = 1_000;
    let mut silent = Vec::new();
    let mut clients = Vec::new();
    let mut login = |clients: &mut Vec<Client>, n: usize| {
        client_rt.block_on(async {
            for chunk in 0..n.div_ceil(100) {
                let mut set = tokio::task::JoinSet::new();
                for _ in 0..100.min(n - chunk * 100) {
                    *player += 1;
                    set.spawn(logged_in(kind, addr, format!("mem-{player}"), tls.clone()));
                }
                while let Some(c) = set.join_next().await {
                    clients.push(c.unwrap());
                }
            }
        });
    };

    // Transport and pre-auth: connected, no HELLO (inside the hello deadline). Over TCP
    // only (the stream transports share that state); a QUIC connection's is measured with
    // its login.
    settle();
    let base = heap();
    client_rt.block_on(async {
        for _ in 0..N {
            if kind == TransportKind::Quic {
                break;
            }
            silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
    });
    settle();
    let connected = per_session(
        &format!("{kind}: connected, nothing sent"),
        &base,
        &heap(),
        N,
    );
    drop(silent);
    settle();

    // Logged in (WELCOME), never sent anything.
    login(&mut clients, WARM);
    settle();
    let warm = heap();
    login(&mut clients, N);
    settle();
    let idle = per_session(&format!("{kind}: logged in"), &warm, &heap(), N);

    // One echo each: the session is open on the backend link.
    let before_echo = heap();
    client_rt.block_on(async {
        for (i, c) in clients.iter_mut().enumerate() {
            common::echo(c, &format!("e{i}")).await.unwrap();
        }
    });
    settle();
    let echoed = per_session(
        &format!("{kind}: after one echo"),
        &before_echo,
        &heap(),
        N + WARM,
    );
    let total = idle + echoed;
    println!(
        "idle {kind} session after one echo: {total:.0} B of edge heap (connected: {connected:.0} B)"
    );

    client_rt.block_on(async {
        for c in &clients {
            c.close().await;
        }
    });
    drop(clients);
    settle();
    (connected, total)
}

#[test]
fn an_idle_session_costs_the_edge_a_bounded_heap() {
    raise_fd_limit();
    let edge_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .on_thread_start(|| EDGE_THREAD.with(|m| m.set(true)))
        .build()
        .unwrap();
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();

    let backend = client_rt
        .block_on(waygate_backend::Backend::bind(
            "127.0.0.1:0".parse().unwrap(),
            waygate_backend::BackendConfig::new("b1"),
            Arc::new(waygate_backend::demo::DemoService::new()),
        ))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, common::table(&[backend.local_addr()], 1, None)).unwrap();
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(routes);
    let ca = dir.path().join("ca.pem");
    config.tls.dev_ca_out = Some(ca.clone());
    // Every client comes from one address at once: admission is not what is measured.
    let bp = &mut config.backpressure;
    bp.accept_per_sec = 1_000_000;
    bp.accept_burst = 100_000;
    bp.accept_per_source_per_sec = 1_000_000;
    bp.accept_per_source_burst = 100_000;
    bp.max_handshakes = 100_000;
    let edge = edge_rt
        .block_on(async { tokio::spawn(waygate_edge::edge::Edge::start(config)).await })
        .unwrap()
        .unwrap();
    let tls = ClientTls::from_ca_file(&ca).unwrap();
    let mut player = 0usize;
    let mut measure = |kind: TransportKind| {
        idle_session_heap(&client_rt, kind, edge.addrs[&kind], &tls, &mut player)
    };
    let (_, tcp) = measure(TransportKind::Tcp);
    let (ws_pending, ws) = measure(TransportKind::Ws);
    let (_, quic) = measure(TransportKind::Quic);
    client_rt.block_on(async { drop(backend) });
    edge_rt.block_on(async { drop(edge) });
    // 14.0 KiB before the W4 work (a 4 KiB read buffer held while idle, a 4.1 KiB task
    // sized for its rarest await, queues keeping their capacity); 5.4 KiB after it; 4.5 KiB
    // since the task is sized for the idle wait (2,176 -> 1,536 B: the held frame's release
    // on the machine's timer, the inbound step without an await, the setup timings and the
    // config out of the task), the outbound queue keeps no counters nobody reads, and new
    // edge entries share their constant parts.
    assert!(
        tcp <= 5.0 * 1024.0,
        "an idle TCP session costs {tcp:.0} B of the edge's heap (bound 5 KiB)"
    );
    assert!(
        ws_pending <= WS_PENDING_BOUND,
        "a WebSocket connection waiting for its upgrade costs {ws_pending:.0} B of the edge's \
         heap (bound {WS_PENDING_BOUND} B)"
    );
    // QUIC: ~48.2 KB with three reader tasks and one per stream, ~46.4 KB with one reader
    // task per connection; most of it is quinn's connection state (13.2 KB, 6.8 KB and
    // 6.7 KB allocations, the breakdown printed above).
    assert!(
        quic <= QUIC_BOUND,
        "an idle QUIC session costs {quic:.0} B of the edge's heap (bound {QUIC_BOUND} B)"
    );
    assert!(
        ws <= WS_BOUND,
        "an idle WebSocket session costs {ws:.0} B of the edge's heap (bound {WS_BOUND} B)"
    );
}

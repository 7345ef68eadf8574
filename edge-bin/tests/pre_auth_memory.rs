//! Hardening item 13: pre-auth state is small and goes back to the operating system when the
//! connections close. A real edge process; 3,000 plain TCP connections and 500 WebSocket
//! upgrades that never send HELLO; the edge's resident memory (VmRSS) is read from /proc
//! before, while they are open and after they closed.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use waygate_transport::TransportKind;

/// Resident memory of `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

async fn open_idle(edge: &common::EdgeProc, tcp: usize, ws: usize) -> Vec<tokio::net::TcpStream> {
    let mut conns = Vec::with_capacity(tcp + ws);
    for _ in 0..tcp {
        conns.push(
            tokio::net::TcpStream::connect(edge.addr(TransportKind::Tcp))
                .await
                .unwrap(),
        );
    }
    let request = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                   Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";
    for _ in 0..ws {
        let mut s = tokio::net::TcpStream::connect(edge.addr(TransportKind::Ws))
            .await
            .unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("upgrade answered in time")
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 101"), "upgraded");
        conns.push(s);
    }
    conns
}

/// Raises this process's open-file soft limit to its hard limit (inherited by the edge
/// process it spawns): the test holds 3,750 sockets, more than a default soft limit of 1,024.
#[allow(unsafe_code)]
fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the plain struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    lim.rlim_cur
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_auth_connections_cost_little_and_give_their_memory_back() {
    let fds = raise_fd_limit();
    assert!(fds >= 8_000, "open-file limit {fds}: the test needs 8,000");
    let backend = common::backend("b1", &[]).await;
    let edge = common::EdgeProc::start(
        &common::table(&[backend.1], 1, None),
        "[backpressure]\naccept_per_sec = 100000\naccept_burst = 100000\n\
         accept_per_source_per_sec = 100000\naccept_per_source_burst = 100000\n\
         [session]\nhello_timeout_ms = 60000\n[limits]\nhandshake_timeout_ms = 60000\n",
    )
    .await;
    let pid = edge.proc.child.id().unwrap();
    // Warm up (first connections allocate the runtime's per-thread state), then settle.
    drop(open_idle(&edge, 200, 50).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let base = rss_kib(pid);
    let conns = open_idle(&edge, 3_000, 500).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let peak = rss_kib(pid);
    drop(conns);
    // The edge notices the closes (EOF) and frees each connection; the allocator returns
    // the memory within a couple of seconds.
    let mut after = rss_kib(pid);
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = rss_kib(pid);
        if after <= base + (peak.saturating_sub(base)) / 4 {
            break;
        }
    }
    let per_conn = peak.saturating_sub(base) as f64 * 1024.0 / 3_500.0;
    eprintln!("rss KiB: base {base}, with 3,500 pre-auth connections {peak} ({per_conn:.0} B each), after close {after}");
    assert!(
        per_conn < 12.0 * 1024.0,
        "a pre-auth connection costs {per_conn:.0} bytes"
    );
    assert!(
        after <= base + (peak.saturating_sub(base)) / 4,
        "memory not given back: base {base} KiB, peak {peak} KiB, after {after} KiB"
    );
}

//! Failure drills against the real `waygate` binary: a backend killed with SIGKILL, and a
//! drain of the edge.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use waygate_client::Event;
use waygate_transport::{CloseCode, TransportKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_backend_gives_unavailable_then_its_players_are_rebound_and_others_are_untouched()
{
    let mut procs = Vec::new();
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for i in 1..=3 {
        let (p, a) = backend(&format!("b{i}"), &[]).await;
        procs.push(p);
        addrs.push(a);
    }
    let edge = EdgeProc::start(&table(&addrs, 1, None), "[links]\nheartbeat_ms = 200\n").await;
    let mut clients = Vec::new();
    let mut before = HashMap::new();
    for i in 0..30 {
        let player = format!("victim-{i}");
        let mut c = edge.client(TransportKind::Tcp, &player);
        before.insert(player.clone(), echo(&mut c, "a").await.unwrap());
        clients.push((player, c));
    }
    assert!(before.values().any(|b| b == "b2"), "someone is on b2");

    procs[1].kill9();
    let killed_at = tokio::time::Instant::now();

    let mut saw_unavailable = 0;
    for (player, c) in clients.iter_mut() {
        let was = before[player].clone();
        if was == "b2" {
            // First an explicit UNAVAILABLE (never silence), then, once the instance is
            // declared down (K missed heartbeats), a new instance answers.
            let mut got = echo(c, "b").await;
            let until = tokio::time::Instant::now() + Duration::from_secs(20);
            while got.is_err() && tokio::time::Instant::now() < until {
                assert_eq!(got, Err(CloseCode::Unavailable), "{player}");
                saw_unavailable += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
                got = echo(c, "c").await;
            }
            let now_on = got.expect("re-bound to a live instance");
            assert_ne!(now_on, "b2");
        } else {
            assert_eq!(
                echo(c, "b").await,
                Ok(was.clone()),
                "{player} must be untouched"
            );
        }
    }
    assert!(
        saw_unavailable > 0,
        "players of the dead backend were told UNAVAILABLE"
    );
    assert!(killed_at.elapsed() < Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_sends_migrate_refuses_new_sessions_and_exits_by_its_deadline() {
    let (_b, addr) = backend("b1", &[]).await;
    let mut edge = EdgeProc::start(
        &table(&[addr], 1, None),
        "[drain]\ntarget = \"tcp://127.0.0.1:7999\"\ndeadline_ms = 3000\nretry_after_ms = 1500\n",
    )
    .await;
    let mut clients = Vec::new();
    for (i, kind) in [
        TransportKind::Tcp,
        TransportKind::Ws,
        TransportKind::Quic,
        TransportKind::Kcp,
    ]
    .into_iter()
    .cycle()
    .take(12)
    .enumerate()
    {
        let mut c = edge.client(kind, &format!("drainee-{i}"));
        echo(&mut c, "a").await.unwrap();
        clients.push(c);
    }
    let (status, body) = http(edge.admin(), "POST", "/drain").await;
    assert_eq!(status, 200, "{body}");
    for c in clients.iter_mut() {
        let ev = wait_for(c, Duration::from_secs(10), |e| {
            matches!(e, Event::Migrating { .. })
        })
        .await;
        let Event::Migrating { target } = ev else {
            unreachable!()
        };
        assert_eq!(target, "tcp://127.0.0.1:7999");
    }
    // New sessions are refused with a retry-after hint.
    let mut late = edge.client(TransportKind::Tcp, "latecomer");
    let ev = wait_for(&mut late, Duration::from_secs(10), |e| {
        matches!(e, Event::Rejected { .. })
    })
    .await;
    assert_eq!(
        ev,
        Event::Rejected {
            code: CloseCode::Draining,
            retry_after_ms: 1500
        }
    );
    let (status, _) = http(edge.admin(), "GET", "/readyz").await;
    assert_eq!(status, 503);
    // The process exits by its deadline.
    let status = edge.proc.wait_exit(Duration::from_secs(15)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "edge exits cleanly after the drain: {status:?}"
    );
}

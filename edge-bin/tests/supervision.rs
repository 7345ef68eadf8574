//! Supervision (hardening issue, item 10): a panic in a listener's accept loop is caught,
//! counted and the loop restarted on the same listener, so the transport keeps working.
//! The panic is injected with the edge's chaos drill, on every transport, over real sockets.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::time::Duration;

use common::cluster::cluster;
use waygate_protocol::frame::Hello;
use waygate_protocol::wire::PROTOCOL_VERSION;
use waygate_transport::endpoint::{connect, ConnectOptions};
use waygate_transport::{Frame, TransportKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_accept_loop_is_restarted_and_its_listener_keeps_working() {
    let c = cluster().await;
    let options = ConnectOptions {
        tls: Some(c.tls.clone()),
        ..ConnectOptions::default()
    };
    for kind in TransportKind::ALL {
        c.edge.chaos_panic_next_accept();
        // This connection is the one the panic takes down (its handshake completed).
        let victim = connect(&c.endpoint(kind), &options).await;
        // Until the drill fired (the victim was accepted), bounded.
        let counter = format!("waygate_accept_loop_restarts_total{{transport=\"{kind}\"}} 1");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !c.edge.admin().metrics_text().contains(&counter) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{kind}: drill never fired"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(victim);
        // The same listener serves the next client.
        let mut conn = connect(&c.endpoint(kind), &options).await.unwrap();
        conn.send(&Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: common::token(&format!("after-panic-{kind}")),
            resume: None,
        }))
        .await
        .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), conn.recv())
            .await
            .expect("an answer in time")
            .unwrap();
        assert!(matches!(answer, Frame::Welcome(_)), "{kind}: {answer:?}");
    }
}

//! A client that stops reading (performance issue: "memory held for stalled readers"): the
//! edge bounds the kernel send buffer of each stream connection (`limits.send_buffer_bytes`,
//! SO_SNDBUF), so such a client holds tens of KiB in the kernel, not megabytes, and the
//! session's own bounded queue and slow-consumer rule decide (B3): the session is closed as
//! a slow consumer. Before, the kernel's autotuning let one stalled reader hold ~1.6 MiB and
//! none reached the slow-consumer rule.
//!
//! The edge's side of the connection is read with `ss` (iproute2): `tb` is the socket's send
//! buffer as the kernel accounts it (twice the SO_SNDBUF set), `w` what its write queue holds
//! now.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use waygate_backend::demo::ECHO;
use waygate_protocol::codec::StreamCodec;
use waygate_protocol::frame::{Data, Hello};
use waygate_protocol::wire::PROTOCOL_VERSION;
use waygate_transport::{Frame, TrafficClass, TransportKind};

/// The edge's socket of the connection from `client`: (send buffer `tb`, bytes queued `w`).
fn edge_socket_memory(edge: SocketAddr, client: SocketAddr) -> Option<(u64, u64)> {
    let out = Command::new("ss")
        .args(["-tmnH", "state", "established"])
        .arg(format!(
            "( sport = :{} and dport = :{} )",
            edge.port(),
            client.port()
        ))
        .output()
        .expect("ss runs (iproute2; scripts/test.sh installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    let skmem = text.split("skmem:(").nth(1)?.split(')').next()?;
    let field = |name: &str| {
        skmem
            .split(',')
            .find_map(|f| f.strip_prefix(name))
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("tb")?, field("w")?))
}

fn counter(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_holds_little_kernel_memory_and_is_closed_as_slow() {
    let (edge, _backend, _dir) = common::demo_edge(|_| {}).await;
    let addr = edge.addrs[&TransportKind::Tcp];
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let client = sock.local_addr().unwrap();
    let codec = StreamCodec::new(65536);
    let mut out = BytesMut::new();
    let hello = Frame::Hello(Hello {
        version: PROTOCOL_VERSION,
        token: common::token("stalled"),
        resume: None,
    });
    codec.encode(&hello, &mut out).unwrap();
    sock.write_all(&out).await.unwrap();
    assert!(matches!(
        common::read_frame(&mut sock).await,
        Frame::Welcome(_)
    ));

    let (tb, _) = edge_socket_memory(addr, client).expect("the edge's socket in ss");
    assert_eq!(
        tb,
        2 * 32 * 1024,
        "SO_SNDBUF 32 KiB (the kernel accounts twice)"
    );

    // Ask for 3 MiB of echoes and never read them.
    let before = counter(
        &edge.admin().metrics_text(),
        "waygate_session_slow_consumer_total",
    );
    let body = Bytes::from(vec![b'x'; 1024]);
    let mut seq = 0u64;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut slow = false;
    let mut held_max = 0;
    while !slow && tokio::time::Instant::now() < deadline {
        if seq < 3072 {
            let mut out = BytesMut::new();
            for _ in 0..64 {
                seq += 1;
                let data = Frame::Data(Data {
                    class: TrafficClass::Normal,
                    msg_id: ECHO,
                    seq,
                    ack: None,
                    payload: body.clone(),
                });
                codec.encode(&data, &mut out).unwrap();
            }
            // The edge may stop reading us (it closes the session): a write error ends it.
            if tokio::time::timeout(Duration::from_secs(1), sock.write_all(&out))
                .await
                .map_or(true, |r| r.is_err())
            {
                break;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if let Some((_, held)) = edge_socket_memory(addr, client) {
            held_max = held_max.max(held);
        }
        slow = counter(
            &edge.admin().metrics_text(),
            "waygate_session_slow_consumer_total",
        ) > before;
    }
    while !slow && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        slow = counter(
            &edge.admin().metrics_text(),
            "waygate_session_slow_consumer_total",
        ) > before;
    }
    eprintln!("sent {seq} echoes of 1 KiB; the edge's socket held at most {held_max} bytes");
    assert!(slow, "the session was closed as a slow consumer");
    assert!(
        held_max <= tb + 64 * 1024,
        "kernel memory of a stalled reader bounded: {held_max} > {tb}"
    );
}

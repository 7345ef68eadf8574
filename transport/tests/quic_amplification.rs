//! QUIC anti-amplification over a real socket (RFC 9000 §8.1, RFC 9002 §6.2.2.1): before a
//! client's address is validated the edge must not send more than three times the bytes it
//! received. One genuine 1,200-byte client Initial is sent from a plain UDP socket that never
//! answers; every byte the edge sends back to that socket within a few PTO periods is counted.
//!
//! The Initial is produced by the crate's own `connect_quic`, aimed at a UDP "tap".
//!
//! Why the default is always-Retry: quinn-proto (0.11) checks its anti-amplification budget
//! once per datagram with one byte of room, so a first flight coalescing Initial and
//! Handshake plus two 1,200-byte PTO probes reaches ~3.3x before the limit stops it.
//!
//! Timing: with no RTT sample the server's PTO is 333 ms + 4 × 166.5 ms ≈ 1 s, doubled per
//! PTO, so probes go out at ≈ 1 s and ≈ 3 s after the first flight; a 5 s window sees both.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::UdpSocket;
use waygate_transport::conn::ConnConfig;
use waygate_transport::quic::{self, connect_quic, QuicConfig};
use waygate_transport::tls::{ClientTls, TlsIdentity};
use waygate_transport::Listener;

/// How long the silent "client" listens after sending its Initial.
const WINDOW: Duration = Duration::from_secs(5);

fn conn_config() -> ConnConfig {
    ConnConfig {
        // Longer than WINDOW: the edge must not give up (and send a CONNECTION_CLOSE) while
        // we count; the amplification limit has to hold on its own.
        handshake_timeout: Duration::from_secs(60),
        idle_timeout: None,
        ..ConnConfig::default()
    }
}

/// What the edge sent back to the silent address.
#[derive(Debug)]
struct Reply {
    /// UDP payload bytes sent by the client (the one Initial datagram).
    sent: usize,
    /// (time since the Initial went out, UDP payload size, first byte) per datagram received.
    datagrams: Vec<(Duration, usize, u8)>,
}

impl Reply {
    fn total(&self) -> usize {
        self.datagrams.iter().map(|d| d.1).sum()
    }
    fn ratio(&self) -> f64 {
        self.total() as f64 / self.sent as f64
    }
}

/// A genuine client Initial: starts the crate's own client against a UDP socket that only
/// records the first datagram, then stops the client. The datagram is a complete, valid
/// Initial (ClientHello, padded to 1,200 bytes); nothing in it binds it to the client's
/// address, so it can be replayed from another socket.
async fn capture_client_initial(tls: &ClientTls) -> Vec<u8> {
    let tap = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let tap_addr = tap.local_addr().unwrap();
    let tls = tls.clone();
    let client = tokio::spawn(async move {
        let _ = connect_quic(
            tap_addr,
            "localhost",
            &tls,
            &QuicConfig::default(),
            &conn_config(),
        )
        .await;
    });
    let mut buf = vec![0u8; 65_535];
    let (n, _) = tokio::time::timeout(Duration::from_secs(30), tap.recv_from(&mut buf))
        .await
        .expect("the client sends its Initial")
        .unwrap();
    client.abort();
    buf.truncate(n);
    // Long header, fixed bit, type Initial (0b00); version 1.
    assert_eq!(buf[0] & 0xf0, 0xc0, "first datagram is an Initial");
    assert_eq!(&buf[1..5], &[0, 0, 0, 1], "QUIC v1");
    assert!(
        n >= 1200,
        "client Initial datagrams are padded to 1200 (got {n})"
    );
    buf
}

/// Sends `initial` to `edge` from a fresh socket that never answers and records everything
/// the edge sends back to it during [`WINDOW`].
async fn answer_to_one_initial(edge: SocketAddr, initial: &[u8]) -> Reply {
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    sock.send_to(initial, edge).await.unwrap();
    let start = tokio::time::Instant::now();
    let deadline = start + WINDOW;
    let mut buf = vec![0u8; 65_535];
    let mut datagrams = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, sock.recv_from(&mut buf)).await {
            Err(_) => break,
            Ok(Ok((n, from))) => {
                if from == edge && n > 0 {
                    datagrams.push((start.elapsed(), n, buf[0]));
                }
            }
            // A stray ICMP error surfaces as a recv error on Linux; it is not edge traffic.
            Ok(Err(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
                ) => {}
            Ok(Err(e)) => panic!("recv: {e}"),
        }
    }
    Reply {
        sent: initial.len(),
        datagrams,
    }
}

/// Starts a QUIC listener with `quic` and the dev identity; returns it (keep it alive), the
/// address and the CA clients trust.
fn edge(quic: &QuicConfig) -> (waygate_transport::TransportListener, SocketAddr, ClientTls) {
    let id = TlsIdentity::generate_dev(&[]).unwrap();
    let listener = quic::listen("127.0.0.1:0".parse().unwrap(), &id, quic, conn_config()).unwrap();
    let addr = listener.local_addr();
    let tls = ClientTls::from_ca_pem(id.dev_ca_pem.as_deref().unwrap()).unwrap();
    (listener, addr, tls)
}

fn describe(reply: &Reply) -> String {
    let list: Vec<String> = reply
        .datagrams
        .iter()
        .map(|(t, n, b)| format!("{n} B (first byte {b:#04x}) at {} ms", t.as_millis()))
        .collect();
    format!(
        "received {} B in {} datagrams for {} B sent ({:.2}x): [{}]",
        reply.total(),
        reply.datagrams.len(),
        reply.sent,
        reply.ratio(),
        list.join(", ")
    )
}

/// Hardening item 12: with the default listener an unanswered Initial must not draw more
/// than 3x its size. With Retry only under load (the former default, 64 handshakes in
/// flight) quinn-proto 0.11 answered ≈ 3.3x (first flight ≈ 1.4-1.6 kB + two 1,200 B PTO
/// probes); the default is now always-Retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_initial_draws_at_most_three_times_its_size() {
    let (_listener, addr, tls) = edge(&QuicConfig::default());
    let initial = capture_client_initial(&tls).await;
    let reply = answer_to_one_initial(addr, &initial).await;
    eprintln!("default config: {}", describe(&reply));
    assert!(
        !reply.datagrams.is_empty(),
        "the edge answers an Initial (handshake or Retry)"
    );
    assert!(
        reply.total() <= 3 * reply.sent,
        "anti-amplification limit exceeded: {}",
        describe(&reply)
    );
}

/// Always-Retry (`retry_above_handshakes = 0`): the only answer is one stateless Retry, far
/// below 3x, and it is never retransmitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_always_retry_an_unanswered_initial_draws_one_small_retry() {
    let quic_config = QuicConfig {
        retry_above_handshakes: 0,
        ..QuicConfig::default()
    };
    let (listener, addr, tls) = edge(&quic_config);
    let stats = listener.stats();
    let initial = capture_client_initial(&tls).await;
    let reply = answer_to_one_initial(addr, &initial).await;
    eprintln!("always retry: {}", describe(&reply));
    assert_eq!(
        reply.datagrams.len(),
        1,
        "exactly one Retry: {}",
        describe(&reply)
    );
    // Long header, fixed bit, type Retry (0b11).
    assert_eq!(reply.datagrams[0].2 & 0xf0, 0xf0, "{}", describe(&reply));
    assert!(reply.total() <= 3 * reply.sent, "{}", describe(&reply));
    assert!(
        reply.total() < 300,
        "a Retry is small: {}",
        describe(&reply)
    );
    assert_eq!(
        stats
            .quic_retries
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

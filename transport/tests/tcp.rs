//! TCP and TLS transport conformance over loopback.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use waygate_protocol::varint::put_varint;
use waygate_transport::conn::ConnConfig;
use waygate_transport::tcp::{self, connect_tcp, connect_tls};
use waygate_transport::tls::{ClientTls, TlsIdentity};
use waygate_transport::{BoxListener, CloseCode, Frame, Listener, TransportError};

const MAX: usize = 16 * 1024;

fn config() -> ConnConfig {
    ConnConfig {
        max_frame_size: MAX,
        // Generous: 100 simultaneous handshakes on a loaded 2-core machine can lose
        // loopback UDP packets and wait out retransmission timers.
        handshake_timeout: Duration::from_secs(60),
        ..ConnConfig::default()
    }
}

async fn tcp_echo() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tcp::listen("127.0.0.1:0".parse().unwrap(), None, config())
        .await
        .unwrap();
    let addr = listener.local_addr();
    (
        addr,
        common::spawn_echo_server(Box::new(listener) as BoxListener),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_100_connections_1000_frames_each() {
    let (addr, _server) = tcp_echo().await;
    common::many_connections(
        move || async move { connect_tcp(addr, &config()).await },
        100,
        1000,
        MAX,
    )
    .await;
}

/// A TLS echo listener with a fresh dev identity: its address, the task, and the client
/// trust for it.
async fn tls_echo() -> (SocketAddr, tokio::task::JoinHandle<()>, ClientTls) {
    let id = TlsIdentity::generate_dev(&[]).unwrap();
    let listener = tcp::listen("127.0.0.1:0".parse().unwrap(), Some(&id), config())
        .await
        .unwrap();
    let addr = listener.local_addr();
    let server = common::spawn_echo_server(Box::new(listener));
    let client = ClientTls::from_ca_pem(id.dev_ca_pem.as_deref().unwrap()).unwrap();
    (addr, server, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_100_connections_1000_frames_each() {
    let (addr, _server, client) = tls_echo().await;
    common::many_connections(
        move || {
            let client = client.clone();
            async move { connect_tls(addr, "localhost", &client, &config()).await }
        },
        100,
        1000,
        MAX,
    )
    .await;
}

#[tokio::test]
async fn tcp_max_frame_passes_and_max_plus_one_is_refused() {
    let (addr, _server) = tcp_echo().await;
    let mut conn = connect_tcp(addr, &config()).await.unwrap();
    common::max_frame_checks(&mut conn, MAX).await;
}

/// Raw bytes on a socket: returns the CLOSE code the server answered with, if any.
async fn send_raw_and_read_close(addr: SocketAddr, bytes: &[u8]) -> Option<CloseCode> {
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = sock.write_all(bytes).await;
    let _ = sock.shutdown().await;
    let mut buf = Vec::new();
    let _ = common::timeout(sock.read_to_end(&mut buf)).await;
    let mut bytes = bytes::BytesMut::from(&buf[..]);
    match waygate_protocol::codec::StreamCodec::new(MAX).decode(&mut bytes) {
        Ok(Some(Frame::Close { code, .. })) => Some(code),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_closes_only_that_connection() {
    let (addr, _server) = tcp_echo().await;
    // 99 well-behaved connections are open and mid-exchange while garbage arrives.
    let good = tokio::spawn(common::many_connections(
        move || async move { connect_tcp(addr, &config()).await },
        99,
        300,
        MAX,
    ));

    // Raw garbage: an unknown frame type.
    assert_eq!(
        send_raw_and_read_close(addr, &[0x03, 0x7f, 0x00, 0x00]).await,
        Some(CloseCode::ProtocolError)
    );
    // A declared 100 MiB frame: refused from the header alone.
    let mut huge = Vec::new();
    put_varint(&mut huge, 100 * 1024 * 1024);
    assert_eq!(
        send_raw_and_read_close(addr, &huge).await,
        Some(CloseCode::FrameTooLarge)
    );
    // max+1 declared with a body.
    let mut over = Vec::new();
    put_varint(&mut over, (MAX + 1) as u64);
    over.extend(std::iter::repeat_n(0x04, MAX + 1));
    assert_eq!(
        send_raw_and_read_close(addr, &over).await,
        Some(CloseCode::FrameTooLarge)
    );
    // Random bytes.
    let noise: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let _ = send_raw_and_read_close(addr, &noise).await;
    // A truncated frame followed by EOF.
    let _ = send_raw_and_read_close(addr, &[0x10, 0x04, 0x01]).await;

    // `many_connections` bounds itself (PHASE_LIMIT); no tighter limit on a loaded machine.
    good.await.expect("control group");
    // The listener still accepts.
    let mut conn = connect_tcp(addr, &config()).await.unwrap();
    common::exchange(&mut conn, 0, 10, MAX).await;
}

#[tokio::test]
async fn idle_timeout_fires_and_close_reaches_the_peer() {
    let listener = tcp::listen(
        "127.0.0.1:0".parse().unwrap(),
        None,
        ConnConfig {
            idle_timeout: Some(Duration::from_millis(200)),
            ..config()
        },
    )
    .await
    .unwrap();
    let addr = listener.local_addr();
    let mut listener: BoxListener = Box::new(listener);
    let mut client = connect_tcp(addr, &config()).await.unwrap();
    let mut server = common::timeout(listener.accept()).await.unwrap();
    match common::timeout(server.recv()).await {
        Err(TransportError::IdleTimeout(_)) => {}
        other => panic!("expected idle timeout, got {other:?}"),
    }
    server.close(CloseCode::IdleTimeout, "idle").await;
    match common::timeout(client.recv()).await {
        Err(TransportError::ClosedByPeer { code }) => assert_eq!(code, CloseCode::IdleTimeout),
        other => panic!("expected CLOSE, got {other:?}"),
    }
}

#[tokio::test]
async fn tls_handshake_with_garbage_is_dropped_and_counted() {
    let id = TlsIdentity::generate_dev(&[]).unwrap();
    let listener = tcp::listen("127.0.0.1:0".parse().unwrap(), Some(&id), config())
        .await
        .unwrap();
    let stats = listener.stats();
    let addr = listener.local_addr();
    let _server = common::spawn_echo_server(Box::new(listener));
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let _ = common::timeout(sock.read_to_end(&mut buf)).await;
    common::timeout(async {
        while stats
            .handshake_failed
            .load(std::sync::atomic::Ordering::Relaxed)
            == 0
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let client = ClientTls::from_ca_pem(id.dev_ca_pem.as_deref().unwrap()).unwrap();
    let mut conn = connect_tls(addr, "localhost", &client, &config())
        .await
        .unwrap();
    common::exchange(&mut conn, 1, 20, MAX).await;
}

/// SDK issue item 1: hosts are names, resolved at each connect, and every address is tried.
/// `localhost` reaches a TLS listener through the resolver (verified as `localhost` against
/// the dev CA); an endpoint whose first address refuses falls through to the next; without
/// a CA the system's roots are used, so the dev certificate is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_resolve_every_address_is_tried_and_tls_defaults_to_system_roots() {
    use waygate_transport::endpoint::{connect, connect_any, ConnectOptions, Endpoint};
    let (addr, _server, dev_ca) = tls_echo().await;
    let endpoint = Endpoint::parse(&format!("tls://localhost:{}", addr.port())).unwrap();
    assert!(endpoint.is_name());
    let resolved = endpoint.resolve(Duration::from_secs(5)).await.unwrap();
    assert!(
        resolved.iter().any(|a| a.ip().is_loopback()),
        "{resolved:?}"
    );
    let options = ConnectOptions {
        conn: config(),
        tls: Some(dev_ca.clone()),
        ..ConnectOptions::default()
    };
    let mut conn = common::timeout(connect(&endpoint, &options)).await.unwrap();
    conn.send(&Frame::Ping { timestamp: 9 }).await.unwrap();
    assert_eq!(
        common::timeout(conn.recv()).await.unwrap(),
        Frame::Ping { timestamp: 9 }
    );
    // The first address refuses (nothing listens there): the next one is tried.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let conn = common::timeout(connect_any(
        &endpoint,
        &[dead_addr, addr],
        Some(&dev_ca),
        &options,
    ))
    .await;
    assert!(conn.is_ok(), "fell through to the second address");
    // No CA given: the system's roots, which do not include the dev CA.
    let system = ConnectOptions {
        conn: config(),
        ..ConnectOptions::default()
    };
    assert!(
        common::timeout(connect(&endpoint, &system)).await.is_err(),
        "the dev certificate is not trusted by the system roots"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_peer_closed_takes_no_frame_and_sees_the_close() {
    let listener = tcp::listen("127.0.0.1:0".parse().unwrap(), None, config())
        .await
        .unwrap();
    let addr = listener.local_addr();
    common::peer_closed_checks(
        Box::new(listener),
        move || async move { connect_tcp(addr, &config()).await },
        MAX,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_peer_closed_takes_no_frame_and_sees_the_close() {
    let id = TlsIdentity::generate_dev(&[]).unwrap();
    let listener = tcp::listen("127.0.0.1:0".parse().unwrap(), Some(&id), config())
        .await
        .unwrap();
    let addr = listener.local_addr();
    let client = ClientTls::from_ca_pem(id.dev_ca_pem.as_deref().unwrap()).unwrap();
    common::peer_closed_checks(
        Box::new(listener),
        move || async move { connect_tls(addr, "localhost", &client, &config()).await },
        MAX,
    )
    .await;
}

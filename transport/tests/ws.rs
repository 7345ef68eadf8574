//! WebSocket (ws and wss) transport conformance over loopback.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;
use waygate_transport::conn::ConnConfig;
use waygate_transport::tls::{ClientTls, TlsIdentity};
use waygate_transport::ws::{self, connect_ws};
use waygate_transport::{CloseCode, Frame, Listener};

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

/// A WebSocket listener on an ephemeral loopback port (`tls`: wss), and its address.
async fn loopback_listener(
    tls: Option<&TlsIdentity>,
    cfg: ConnConfig,
) -> (waygate_transport::BoxListener, SocketAddr) {
    let listener = ws::listen("127.0.0.1:0".parse().unwrap(), tls, cfg)
        .await
        .unwrap();
    let addr = listener.local_addr();
    (Box::new(listener), addr)
}

async fn ws_echo() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let (listener, addr) = loopback_listener(None, config()).await;
    (addr, common::spawn_echo_server(listener))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ws_100_connections_1000_frames_each() {
    let (addr, _server) = ws_echo().await;
    common::many_connections(
        move || async move { connect_ws(addr, "127.0.0.1", "/", None, &config()).await },
        100,
        1000,
        MAX,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wss_100_connections_1000_frames_each() {
    let id = TlsIdentity::generate_dev(&[]).unwrap();
    let (listener, addr) = loopback_listener(Some(&id), config()).await;
    let _server = common::spawn_echo_server(listener);
    let client = ClientTls::from_ca_pem(id.dev_ca_pem.as_deref().unwrap()).unwrap();
    common::many_connections(
        move || {
            let client = client.clone();
            async move { connect_ws(addr, "localhost", "/game", Some(&client), &config()).await }
        },
        100,
        1000,
        MAX,
    )
    .await;
}

#[tokio::test]
async fn ws_max_frame_passes_and_max_plus_one_is_refused() {
    let (addr, _server) = ws_echo().await;
    let mut conn = connect_ws(addr, "127.0.0.1", "/", None, &config())
        .await
        .unwrap();
    common::max_frame_checks(&mut conn, MAX).await;
}

/// A read buffer far below the frame size (`ConnConfig::ws_read_buffer`) only splits a
/// message into more reads: the largest frame still passes both ways, and the one above it
/// is still refused.
#[tokio::test]
async fn a_small_read_buffer_still_carries_the_largest_frame() {
    let small = || ConnConfig {
        ws_read_buffer: 64,
        ..config()
    };
    let (listener, addr) = loopback_listener(None, small()).await;
    let _server = common::spawn_echo_server(listener);
    let mut conn = connect_ws(addr, "127.0.0.1", "/", None, &small())
        .await
        .unwrap();
    common::max_frame_checks(&mut conn, MAX).await;
}

/// Opens a raw tungstenite client, sends `msg`, and returns the waygate CLOSE code the
/// server answered with (from the binary CLOSE frame it sends before the WebSocket close).
async fn raw_send_and_read_close(addr: SocketAddr, msg: Message) -> Option<CloseCode> {
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/"))
        .await
        .unwrap();
    let _ = ws.send(msg).await;
    let mut code = None;
    let _ = common::timeout(async {
        while let Some(Ok(m)) = ws.next().await {
            if let Message::Binary(b) = m {
                if let Ok(Frame::Close { code: c, .. }) = Frame::decode(b) {
                    code = Some(c);
                }
            }
        }
    })
    .await;
    code
}

/// A raw TCP connection upgraded to WebSocket by hand (no client library in the way).
async fn raw_upgrade(addr: SocketAddr) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "GET / HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut head = vec![0u8; 1024];
    let n = common::timeout(sock.read(&mut head)).await.unwrap();
    assert!(String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 101"));
    sock
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_closes_only_that_connection() {
    let (addr, _server) = ws_echo().await;
    let good = tokio::spawn(common::many_connections(
        move || async move { connect_ws(addr, "127.0.0.1", "/", None, &config()).await },
        99,
        300,
        MAX,
    ));

    assert_eq!(
        raw_send_and_read_close(addr, Message::text("hello")).await,
        Some(CloseCode::TextMessage)
    );
    assert_eq!(
        raw_send_and_read_close(addr, Message::binary(vec![0x7f, 1, 2])).await,
        Some(CloseCode::ProtocolError)
    );
    assert_eq!(
        raw_send_and_read_close(addr, Message::binary(vec![0x04; MAX + 1])).await,
        Some(CloseCode::FrameTooLarge)
    );

    // A WebSocket frame header declaring a 100 MiB binary message, and no body: refused
    // from the header, before any allocation.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut sock = raw_upgrade(addr).await;
        // FIN + binary, MASK + 127 (64-bit length), length 100 MiB, mask key.
        let mut hdr = vec![0x82, 0xFF];
        hdr.extend_from_slice(&(100u64 * 1024 * 1024).to_be_bytes());
        hdr.extend_from_slice(&[1, 2, 3, 4]);
        sock.write_all(&hdr).await.unwrap();
        let mut rest = Vec::new();
        let _ = common::timeout(sock.read_to_end(&mut rest)).await;
        // The server closed the connection (EOF reached within the timeout).
    }

    // A text message that is not UTF-8: the WebSocket close says 1007 (RFC 6455 7.4.1).
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut sock = raw_upgrade(addr).await;
        // FIN + text, MASK + length 2, mask key 0, payload C3 28 (an invalid UTF-8 pair).
        sock.write_all(&[0x81, 0x82, 0, 0, 0, 0, 0xC3, 0x28])
            .await
            .unwrap();
        let mut rest = Vec::new();
        let _ = common::timeout(sock.read_to_end(&mut rest)).await;
        // Walk the server's (unmasked) frames to its close frame.
        let mut status = None;
        let mut i = 0;
        while i + 2 <= rest.len() {
            let (opcode, len) = (rest[i] & 0x0f, usize::from(rest[i + 1] & 0x7f));
            let (start, len) = match len {
                126 if i + 4 <= rest.len() => (
                    i + 4,
                    usize::from(u16::from_be_bytes([rest[i + 2], rest[i + 3]])),
                ),
                126 | 127 => break,
                n => (i + 2, n),
            };
            if opcode == 0x8 && len >= 2 && start + 2 <= rest.len() {
                status = Some(u16::from_be_bytes([rest[start], rest[start + 1]]));
            }
            i = start + len;
        }
        assert_eq!(status, Some(1007), "server frames: {rest:?}");
    }

    // A broken upgrade request.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        sock.write_all(b"\x16\x03\x01garbage\r\n\r\n")
            .await
            .unwrap();
        let mut rest = Vec::new();
        let _ = common::timeout(sock.read_to_end(&mut rest)).await;
    }

    // `many_connections` bounds itself (PHASE_LIMIT); no tighter limit on a loaded machine.
    good.await.expect("control group");
    let mut conn = connect_ws(addr, "127.0.0.1", "/", None, &config())
        .await
        .unwrap();
    common::exchange(&mut conn, 0, 10, MAX).await;
}

/// Origin allow-list (hardening issue, item 9): a browser page from another site cannot
/// open a session; the listed origin and native clients (no Origin) can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_origin_is_refused_at_the_upgrade() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut cfg = config();
    cfg.allowed_origins = vec!["https://play.example.com".to_string()].into();
    let (listener, addr) = loopback_listener(None, cfg).await;
    let _server = common::spawn_echo_server(listener);
    let attempt = |origin: Option<&'static str>| async move {
        let mut request = format!("ws://{addr}/").into_client_request().unwrap();
        if let Some(o) = origin {
            request.headers_mut().insert("origin", o.parse().unwrap());
        }
        match tokio_tungstenite::connect_async(request).await {
            Ok(_) => Ok(()),
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => Err(resp.status().as_u16()),
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(attempt(Some("https://evil.example")).await, Err(403));
    assert_eq!(attempt(Some("https://PLAY.example.com")).await, Ok(()));
    assert_eq!(attempt(None).await, Ok(()), "native clients send no Origin");
}

/// A frame that arrived while the receiving side could not run (its runtime stalled past the
/// idle timeout) is read, not answered with an idle timeout: input comes before the idle
/// verdict (before, `recv` chose between the expired timer and the ready frame at random).
#[tokio::test]
async fn a_frame_waiting_after_a_stall_wins_over_the_idle_timeout() {
    let idle = Duration::from_millis(200);
    let listener = ws::listen(
        "127.0.0.1:0".parse().unwrap(),
        None,
        ConnConfig {
            idle_timeout: Some(idle),
            ..config()
        },
    )
    .await
    .unwrap();
    let addr = listener.local_addr();
    let mut listener = listener;
    let mut client = connect_ws(addr, "127.0.0.1", "/", None, &config())
        .await
        .unwrap();
    let mut server = common::timeout(listener.accept()).await.unwrap();
    for i in 0..12u64 {
        client.send(&Frame::Ping { timestamp: i }).await.unwrap();
        // This (current-thread) runtime stalls past the idle timeout with the frame in the
        // socket.
        std::thread::sleep(idle * 2);
        match common::timeout(server.recv()).await {
            Ok(Frame::Ping { timestamp }) => assert_eq!(timestamp, i),
            other => panic!("stall {i}: expected the PING, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ws_peer_closed_takes_no_frame_and_sees_the_close() {
    let (listener, addr) = loopback_listener(None, config()).await;
    common::peer_closed_checks(
        listener,
        move || async move { connect_ws(addr, "127.0.0.1", "/", None, &config()).await },
        MAX,
    )
    .await;
}

/// Regression (5,000-client demo: a reconnect storm logged ~900 ws links as
/// `protocol_error`): a client whose TCP connection ends without a closing handshake (killed,
/// its path dropped, an SDK dropping a link it found dead) is gone, not a protocol violator:
/// the server's `recv` fails `going_away`, as a reset TCP connection does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_gone_without_a_closing_handshake_is_going_away_not_a_protocol_error() {
    let (mut listener, addr) = loopback_listener(None, config()).await;
    let sock = raw_upgrade(addr).await;
    let mut server = common::timeout(listener.accept()).await.unwrap();
    drop(sock);
    let err = common::timeout(server.recv()).await.unwrap_err();
    assert_eq!(err.close_code(), CloseCode::GoingAway, "{err}");
}

//! KCP over real UDP sockets on 127.0.0.1: many connections in order with no loss, the
//! maximum frame size, hostile datagrams, close flushing, BUSY, and a raw KCP peer that does
//! the documented cookie exchange by hand (what a client in another language does).
//! Every loop is bounded in count and time; no test asserts a duration.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::UdpSocket;
use waygate_protocol::frame::Data;
use waygate_transport::kcp::cookie::{Control, PADDED_LEN};
use waygate_transport::kcp::{self, connect_kcp, KcpConfig, KcpListener, KcpStats};
use waygate_transport::{
    BoxListener, CloseCode, ConnConfig, Frame, Listener, TrafficClass, TransportError,
};

const MAX_FRAME: usize = 16 * 1024;
const LIMIT: Duration = common::PHASE_LIMIT;

fn conn_config() -> ConnConfig {
    ConnConfig {
        max_frame_size: MAX_FRAME,
        // Liveness is not what most of these tests check; phases are bounded by PHASE_LIMIT.
        idle_timeout: None,
        // Generous: 100 simultaneous handshakes on a loaded 2-core machine can lose
        // loopback UDP packets and wait out retransmission timers.
        handshake_timeout: Duration::from_secs(60),
        ..Default::default()
    }
}

async fn listener(config: KcpConfig) -> KcpListener {
    kcp::listen("127.0.0.1:0".parse().unwrap(), &config, conn_config())
        .await
        .unwrap()
}

async fn connect(
    addr: SocketAddr,
    config: KcpConfig,
    conn: ConnConfig,
) -> Result<waygate_transport::BoxConnection, TransportError> {
    connect_kcp(addr, &config, &conn).await
}

/// Echoes every frame back until the connection ends (the shared conformance server).
fn spawn_echo(listener: KcpListener) -> tokio::task::JoinHandle<()> {
    common::spawn_echo_server(Box::new(listener) as BoxListener)
}

fn data(seq: u64, payload_len: usize) -> Frame {
    Frame::Data(Data {
        class: TrafficClass::Normal,
        msg_id: 9,
        seq,
        ack: None,
        payload: Bytes::from(vec![(seq % 251) as u8; payload_len]),
    })
}

/// Payload length that makes `data(seq, _)` exactly `frame_len` bytes.
fn payload_for(frame_len: usize, seq: u64) -> usize {
    frame_len - data(seq, 0).encoded_len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kcp_100_connections_1000_frames_each() {
    let listener = listener(KcpConfig::fast()).await;
    let addr = listener.local_addr();
    let stats = listener.stats();
    let _server = spawn_echo(listener);
    common::many_connections(
        move || async move { connect(addr, KcpConfig::fast(), conn_config()).await },
        100,
        1000,
        MAX_FRAME,
    )
    .await;
    assert_eq!(KcpStats::get(&stats.sessions_opened), 100);
    assert_eq!(KcpStats::get(&stats.panics), 0);
}

#[tokio::test]
async fn kcp_max_frame_passes_and_max_plus_one_is_refused() {
    let listener = listener(KcpConfig::fast()).await;
    let addr = listener.local_addr();
    let _server = spawn_echo(listener);
    let mut conn = connect(addr, KcpConfig::fast(), conn_config())
        .await
        .unwrap();
    common::max_frame_checks(&mut conn, MAX_FRAME).await;
}

#[tokio::test]
async fn kcp_oversized_frame_from_the_peer_closes_with_frame_too_large() {
    let mut listener = listener(KcpConfig::fast()).await;
    let addr = listener.local_addr();
    // A client allowed twice the server's maximum, to inject an oversized frame.
    let big = ConnConfig {
        max_frame_size: 2 * MAX_FRAME,
        ..conn_config()
    };
    let (server, client) = tokio::join!(listener.accept(), connect(addr, KcpConfig::fast(), big));
    let mut server = server.expect("accepted");
    server.handshake_done();
    let mut client = client.expect("connected");
    let exact = data(1, payload_for(MAX_FRAME, 1));
    client.send(&exact).await.expect("max size sends");
    assert_eq!(server.recv().await.expect("max size arrives"), exact);
    // Locally refused on the server's side; the connection stays usable.
    let over = data(2, payload_for(MAX_FRAME + 1, 2));
    assert!(matches!(
        server.send(&over).await,
        Err(TransportError::SendTooLarge { len, max: MAX_FRAME }) if len == MAX_FRAME + 1
    ));
    server.send(&exact).await.expect("still usable");
    assert_eq!(client.recv().await.expect("echo"), exact);
    // Injected by the peer: closes that connection with FRAME_TOO_LARGE.
    client.send(&over).await.expect("client may send it");
    let err = tokio::time::timeout(LIMIT, server.recv())
        .await
        .expect("in time")
        .expect_err("oversized frame refused");
    assert_eq!(err.close_code(), CloseCode::FrameTooLarge, "{err}");
    let err = tokio::time::timeout(LIMIT, client.recv())
        .await
        .expect("in time")
        .expect_err("closed");
    assert!(
        matches!(
            err,
            TransportError::ClosedByPeer {
                code: CloseCode::FrameTooLarge
            }
        ),
        "{err}"
    );
    assert_eq!(KcpStats::get(&listener.stats().oversized), 1);
}

#[tokio::test]
async fn kcp_close_flushes_queued_frames_and_the_close_frame() {
    let mut listener = listener(KcpConfig::normal()).await;
    let addr = listener.local_addr();
    let (server, client) = tokio::join!(
        listener.accept(),
        connect(addr, KcpConfig::normal(), conn_config())
    );
    let mut server = server.expect("accepted");
    server.handshake_done();
    let mut client = client.expect("connected");
    for i in 0..200 {
        client.send(&data(i, 1000)).await.expect("send");
    }
    // close() returns once everything, the CLOSE frame last, was acknowledged (the reader
    // keeps reading meanwhile; a stalled reader would hold it up to the linger time).
    let reader = async {
        for i in 0..200 {
            let got = server.recv().await.expect("frame");
            assert_eq!(got, data(i, 1000));
        }
        server.recv().await
    };
    let (end, ()) = tokio::time::timeout(LIMIT, async {
        tokio::join!(reader, client.close(CloseCode::GoingAway, "bye"))
    })
    .await
    .expect("in time");
    assert!(matches!(
        end,
        Err(TransportError::ClosedByPeer {
            code: CloseCode::GoingAway
        })
    ));
    // And the other direction: a server-side close reaches the client.
    let (server2, client2) = tokio::join!(
        listener.accept(),
        connect(addr, KcpConfig::normal(), conn_config())
    );
    let mut server2 = server2.expect("accepted");
    let mut client2 = client2.expect("connected");
    server2.send(&data(7, 10)).await.expect("send");
    server2.close(CloseCode::Kicked, "kicked").await;
    assert_eq!(client2.recv().await.expect("frame"), data(7, 10));
    assert!(matches!(
        client2.recv().await,
        Err(TransportError::ClosedByPeer {
            code: CloseCode::Kicked
        })
    ));
    drop(server);
    let stats = listener.stats();
    tokio::time::timeout(LIMIT, async {
        while KcpStats::get(&stats.sessions) > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("sessions released after close");
}

#[tokio::test]
async fn kcp_busy_when_the_session_cap_is_reached() {
    let mut config = KcpConfig::fast();
    config.max_sessions = 1;
    config.busy_retry_after_ms = 1234;
    let mut listener = listener(config).await;
    let addr = listener.local_addr();
    let (_server, first) = tokio::join!(
        listener.accept(),
        connect(addr, KcpConfig::fast(), conn_config())
    );
    let _first = first.expect("first connects");
    let second = connect(addr, KcpConfig::fast(), conn_config()).await;
    assert!(
        matches!(
            second,
            Err(TransportError::Refused {
                code: CloseCode::Overloaded,
                retry_after_ms: 1234
            })
        ),
        "{:?}",
        second.err()
    );
}

#[tokio::test]
async fn kcp_idle_connections_are_closed_by_the_idle_timeout() {
    let mut listener = KcpListener::bind(
        "127.0.0.1:0".parse().expect("addr"),
        KcpConfig::fast(),
        ConnConfig {
            idle_timeout: Some(Duration::from_millis(300)),
            ..conn_config()
        },
    )
    .await
    .expect("bind");
    let addr = listener.local_addr();
    let (server, client) = tokio::join!(
        listener.accept(),
        connect(addr, KcpConfig::fast(), conn_config())
    );
    let mut server = server.expect("accepted");
    server.handshake_done();
    let mut client = client.expect("connected");
    let err = tokio::time::timeout(LIMIT, server.recv())
        .await
        .expect("in time")
        .expect_err("idle");
    assert!(matches!(err, TransportError::IdleTimeout(_)), "{err}");
    let err = tokio::time::timeout(LIMIT, client.recv())
        .await
        .expect("in time")
        .expect_err("closed");
    assert!(
        matches!(
            err,
            TransportError::ClosedByPeer {
                code: CloseCode::IdleTimeout
            }
        ),
        "{err}"
    );
}

/// A client built from the documented packets and the plain `kcp` engine, as a client in
/// another language would be: HELLO, COOKIE, CONNECT, ACCEPT by hand, then ikcp segments.
struct RawClient {
    socket: Arc<UdpSocket>,
    kcp: ::kcp::Kcp<SocketOut>,
    start: std::time::Instant,
}

struct SocketOut(Arc<UdpSocket>);

impl std::io::Write for SocketOut {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Best effort, like UDP itself: KCP retransmits what is lost.
        let _ = self.0.try_send(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

async fn recv_control(socket: &UdpSocket) -> Control {
    let mut buf = [0u8; 2048];
    for _ in 0..100 {
        let n = tokio::time::timeout(Duration::from_secs(5), socket.recv(&mut buf))
            .await
            .expect("reply in time")
            .expect("recv");
        if let Some(packet) = Control::decode(&buf[..n]) {
            return packet;
        }
    }
    panic!("no control packet");
}

impl RawClient {
    async fn connect(server: SocketAddr) -> Self {
        let socket = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        socket.connect(server).await.expect("connect");
        let hello = Control::Hello {
            client_nonce: 0x5EED,
        }
        .encode();
        assert_eq!(hello.len(), PADDED_LEN);
        socket.send(&hello).await.expect("hello");
        let cookie = match recv_control(&socket).await {
            Control::Cookie(c) => c,
            other => panic!("expected COOKIE, got {other:?}"),
        };
        assert_eq!(cookie.client_nonce, 0x5EED);
        socket
            .send(&Control::Connect(cookie).encode())
            .await
            .expect("connect");
        assert_eq!(
            recv_control(&socket).await,
            Control::Accept { conv: cookie.conv }
        );
        let socket = Arc::new(socket);
        let mut kcp = ::kcp::Kcp::new(cookie.conv, SocketOut(socket.clone()));
        kcp.set_nodelay(true, 10, 2, true);
        kcp.set_wndsize(256, 256);
        kcp.set_mtu(1200).expect("mtu");
        let start = std::time::Instant::now();
        kcp.update(0).expect("update");
        Self { socket, kcp, start }
    }

    fn now(&self) -> u32 {
        self.start.elapsed().as_millis() as u32
    }

    async fn send(&mut self, frame: &Frame) {
        self.kcp.send(&frame.to_bytes()).expect("kcp send");
        self.kcp.update(self.now()).expect("update");
        self.kcp.flush().expect("flush");
    }

    /// The next message, driving the engine with the clock; bounded.
    async fn recv(&mut self) -> Bytes {
        let mut buf = vec![0u8; 65536];
        for _ in 0..10_000 {
            if let Ok(size) = self.kcp.peeksize() {
                let mut msg = vec![0u8; size];
                let n = self.kcp.recv(&mut msg).expect("recv");
                msg.truncate(n);
                return Bytes::from(msg);
            }
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(10), self.socket.recv(&mut buf)).await
            {
                let _ = self.kcp.input(&buf[..n]);
            }
            let now = self.now();
            self.kcp.update(now).expect("update");
            self.kcp.flush().expect("flush");
        }
        panic!("no message from the server");
    }
}

#[tokio::test]
async fn kcp_hostile_datagrams_create_no_session_and_disturb_no_connection() {
    let mut config = KcpConfig::fast();
    config.reject_rate_per_sec = 100;
    let listener = listener(config).await;
    let addr = listener.local_addr();
    let stats = listener.stats();
    let server = spawn_echo(listener);

    // Two honest connections: a waygate client and a raw ikcp client.
    let mut honest = connect(addr, KcpConfig::fast(), conn_config())
        .await
        .expect("connect");
    let mut raw = RawClient::connect(addr).await;
    raw.send(&data(1, 100)).await;
    assert_eq!(Frame::decode(raw.recv().await), Ok(data(1, 100)));
    let conv = raw.kcp.conv();
    assert_eq!(KcpStats::get(&stats.sessions_opened), 2);

    let attacker = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    attacker.connect(addr).await.expect("connect");
    let mut sent_bytes = 0usize;
    // 1. Random datagrams of every size, including control-looking and segment-looking ones.
    let mut x: u64 = 0x1234_5678;
    for i in 0..2000usize {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % 300) as usize;
        let mut d: Vec<u8> = (0..len)
            .map(|j| (x.rotate_left(j as u32 % 64) >> 3) as u8)
            .collect();
        if i % 3 == 0 && d.len() >= 10 {
            d[..9].copy_from_slice(&[0, 0, 0, 0, b'W', b'G', b'K', b'C', 1]);
        }
        sent_bytes += d.len();
        let _ = attacker.send(&d).await;
    }
    // 2. The raw client's real conv, from another socket (valid-looking segments).
    let mut spoofed = Vec::new();
    for sn in 0..50u32 {
        let mut seg = conv.to_le_bytes().to_vec();
        seg.extend_from_slice(&[81, 0]);
        seg.extend_from_slice(&256u16.to_le_bytes());
        seg.extend_from_slice(&0u32.to_le_bytes());
        seg.extend_from_slice(&(sn * 0x0100_0000).to_le_bytes());
        seg.extend_from_slice(&0u32.to_le_bytes());
        seg.extend_from_slice(&4u32.to_le_bytes());
        seg.extend_from_slice(&[4, 0, 0, 0]); // a PING frame would not parse; any bytes do
        spoofed.push(seg);
    }
    for seg in &spoofed {
        let _ = attacker.send(seg).await;
    }
    // 3. A valid-looking first segment for a conv nobody was given (no cookie).
    let mut fresh = 0x00C0_FFEE_u32.to_le_bytes().to_vec();
    fresh.extend_from_slice(&spoofed[0][4..]);
    let _ = attacker.send(&fresh).await;

    // Every reply the attacker got is small and is never a session.
    let mut buf = [0u8; 2048];
    let mut replies = 0;
    while let Ok(Ok(n)) =
        tokio::time::timeout(Duration::from_millis(300), attacker.recv(&mut buf)).await
    {
        replies += 1;
        assert!(n <= 42, "reply of {n} bytes");
        assert!(
            Control::decode(&buf[..n]).is_some(),
            "attacker got a KCP segment"
        );
        assert!(replies < 10_000);
    }
    assert!(sent_bytes > 0);

    // No session was created, and both honest connections still work.
    assert_eq!(KcpStats::get(&stats.sessions_opened), 2);
    assert_eq!(KcpStats::get(&stats.sessions), 2);
    assert!(KcpStats::get(&stats.foreign_segments) >= 50);
    assert_eq!(KcpStats::get(&stats.panics), 0);
    common::exchange(&mut honest, 3, 200, MAX_FRAME).await;
    for i in 2..20 {
        raw.send(&data(i, 500)).await;
        assert_eq!(Frame::decode(raw.recv().await), Ok(data(i, 500)));
    }
    honest.close(CloseCode::Normal, "done").await;
    server.abort();
}

/// Hardening issue, item 10: a panic in the KCP driver task (outside the per-session guard,
/// i.e. a bug) used to kill the transport for good. Now supervision restarts the driver on
/// the same socket: the sessions it carried end at once (their `recv` returns an error
/// instead of waiting forever), the restart is counted, and a new client connects and
/// exchanges frames.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_driver_is_restarted_and_the_listener_keeps_working() {
    let config = KcpConfig::default();
    let mut listener = listener(config.clone()).await;
    let addr = listener.local_addr();
    let stats = listener.stats();
    let (mut client, mut server) = tokio::join!(
        async { connect(addr, config.clone(), conn_config()).await.unwrap() },
        async { listener.accept().await.unwrap() },
    );
    client.send(&data(1, 10)).await.unwrap();
    assert_eq!(server.recv().await.unwrap(), data(1, 10));

    listener.chaos_panic_driver();
    // The driver turns at once on the next datagram.
    client.send(&data(2, 10)).await.unwrap();
    let ended = tokio::time::timeout(LIMIT, server.recv()).await;
    assert!(
        matches!(ended, Ok(Err(_))),
        "the session the driver carried ends with it: {ended:?}"
    );
    let restarted = tokio::time::timeout(LIMIT, async {
        while KcpStats::get(&stats.driver_restarts) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(restarted.is_ok(), "restart counted");

    let (mut fresh, mut accepted) = tokio::join!(
        async { connect(addr, config.clone(), conn_config()).await.unwrap() },
        async {
            tokio::time::timeout(LIMIT, listener.accept())
                .await
                .unwrap()
                .unwrap()
        },
    );
    fresh.send(&data(3, 10)).await.unwrap();
    assert_eq!(
        tokio::time::timeout(LIMIT, accepted.recv())
            .await
            .unwrap()
            .unwrap(),
        data(3, 10)
    );
    assert_eq!(KcpStats::get(&stats.driver_restarts), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kcp_peer_closed_takes_no_frame_and_sees_the_close() {
    let listener = listener(KcpConfig::default()).await;
    let addr = listener.local_addr();
    common::peer_closed_checks(
        Box::new(listener),
        move || async move { connect(addr, KcpConfig::default(), conn_config()).await },
        MAX_FRAME,
    )
    .await;
}

/// A client socket bound to a loopback address of its own (`connect_kcp_from`; the W9 load
/// generators use one address each, as one address has only ~28,000 ephemeral ports): the
/// listener sees the connection from that address, and frames flow.
#[tokio::test]
async fn kcp_connect_from_a_chosen_loopback_address() {
    let mut l = listener(KcpConfig::fast()).await;
    let addr = l.local_addr();
    let source: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let connect = kcp::connect_kcp_from(Some(source), addr, &KcpConfig::fast(), &conn_config());
    let (client, server) = tokio::time::timeout(LIMIT, async { tokio::join!(connect, l.accept()) })
        .await
        .unwrap();
    let mut client = client.unwrap();
    let mut server = server.unwrap();
    assert_eq!(server.info().peer.ip(), source);
    assert_eq!(client.info().local.ip(), source);
    client.send(&data(1, 32)).await.unwrap();
    let got = tokio::time::timeout(LIMIT, server.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, data(1, 32));
}

/// Review (2026-12-05, PROTOCOL.md §3.8/§7.5 against the code): a RESET with code 2
/// `logout` reached the session as the client's logout, so anyone who could send a datagram
/// from the client's address with its conv (a plain session's RESET carries no proof) ended
/// the player's session for good instead of dropping the link. Only a CLOSE frame logs
/// out: a transport close with code 2 reads as `going_away`.
#[tokio::test]
async fn a_reset_with_the_logout_code_reads_as_going_away() {
    let mut l = listener(KcpConfig::fast()).await;
    let addr = l.local_addr();
    let (mut raw, accepted) = tokio::join!(RawClient::connect(addr), l.accept());
    let mut server = accepted.expect("accept");
    raw.send(&data(1, 10)).await;
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), server.recv())
            .await
            .expect("frame in time")
            .expect("frame"),
        data(1, 10)
    );
    let reset = Control::Reset {
        conv: raw.kcp.conv(),
        code: CloseCode::Logout,
    }
    .encode();
    raw.socket.send(&reset).await.expect("reset");
    let end = tokio::time::timeout(Duration::from_secs(5), server.recv())
        .await
        .expect("the session ends in time");
    match end {
        Err(TransportError::ClosedByPeer { code }) => assert_eq!(code, CloseCode::GoingAway),
        other => panic!("{other:?}"),
    }
}

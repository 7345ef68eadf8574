//! Transport conformance harness shared by the per-transport tests: an echo server over any
//! `Listener`, a many-connections exchange check and max-frame-size checks. Every loop is
//! bounded in count and time.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;
use waygate_protocol::frame::Data;
use waygate_transport::{BoxConnection, BoxListener, Frame, TrafficClass, TransportError};

/// Upper bound for any single test phase.
pub const PHASE_LIMIT: Duration = Duration::from_secs(120);

/// Spawns a server that echoes every frame back on the connection it came from, until the
/// connection ends. Returns the task; abort it to stop.
pub fn spawn_echo_server(mut listener: BoxListener) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(mut conn) = listener.accept().await {
            // The echo plays a session past its WELCOME: full-size frames from the start.
            conn.handshake_done();
            tokio::spawn(async move {
                loop {
                    match conn.recv().await {
                        Ok(frame) => {
                            if conn.send(&frame).await.is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            if std::env::var_os("WAYGATE_TEST_DEBUG").is_some() {
                                eprintln!("echo server: {} ended: {e}", conn.info().id);
                            }
                            break;
                        }
                    }
                }
            });
        }
    })
}

/// Deterministic mixed payload sizes: mostly small, some medium, a few near `max_payload`.
pub fn mixed_size(conn: usize, i: usize, max_payload: usize) -> usize {
    let x = (conn as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    let x = (x ^ (x >> 31)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let x = x ^ (x >> 29);
    match x % 100 {
        0 => max_payload,
        1 => max_payload.saturating_sub((x >> 8) as usize % 64),
        2..=10 => 1 + (x >> 8) as usize % 4096.min(max_payload),
        _ => 1 + (x >> 8) as usize % 200.min(max_payload),
    }
}

/// The test frame number `i` of connection `conn`: a reliable DATA frame whose seq is `i`
/// and whose payload is a pattern derived from both.
pub fn test_frame(conn: usize, i: usize, max_payload: usize) -> Frame {
    let len = mixed_size(conn, i, max_payload).max(1);
    let byte = (conn as u8).wrapping_mul(31).wrapping_add(i as u8);
    Frame::Data(Data {
        class: if i % 3 == 0 {
            TrafficClass::Critical
        } else {
            TrafficClass::Normal
        },
        msg_id: (conn * 100_000 + i) as u32,
        seq: i as u64,
        ack: None,
        payload: Bytes::from(vec![byte; len]),
    })
}

/// Payload size that makes a test DATA frame exactly `frame_len` bytes long for `i`.
pub fn payload_for_frame_len(frame_len: usize, conn: usize, i: usize) -> usize {
    let probe = |payload: usize| {
        Frame::Data(Data {
            class: TrafficClass::Critical,
            msg_id: (conn * 100_000 + i) as u32,
            seq: i as u64,
            ack: None,
            payload: Bytes::from(vec![0; payload]),
        })
        .encoded_len()
    };
    frame_len - (probe(0))
}

/// Sends `frames` test frames over `conn` with a window of outstanding echoes and checks
/// that every one comes back intact and, within each traffic class, in order.
pub async fn exchange(conn: &mut BoxConnection, conn_no: usize, frames: usize, max_frame: usize) {
    const WINDOW: usize = 16;
    let max_payload = payload_for_frame_len(max_frame, conn_no, frames);
    let mut expected: HashMap<TrafficClass, std::collections::VecDeque<Frame>> = HashMap::new();
    let mut sent = 0;
    let mut received = 0;
    while received < frames {
        while sent < frames && sent - received < WINDOW {
            let frame = test_frame(conn_no, sent, max_payload);
            expected
                .entry(frame.class())
                .or_default()
                .push_back(frame.clone());
            conn.send(&frame)
                .await
                .unwrap_or_else(|e| panic!("conn {conn_no} send {sent}: {e}"));
            sent += 1;
        }
        let got = conn
            .recv()
            .await
            .unwrap_or_else(|e| panic!("conn {conn_no} recv after {received}: {e}"));
        let want = expected
            .get_mut(&got.class())
            .and_then(|q| q.pop_front())
            .unwrap_or_else(|| panic!("conn {conn_no}: unexpected frame {got:?}"));
        assert_eq!(got, want, "conn {conn_no}: frame {received} differs");
        received += 1;
    }
}

/// Opens `conns` connections with `connect` and runs [`exchange`] on all of them at once.
pub async fn many_connections<F, Fut>(connect: F, conns: usize, frames: usize, max_frame: usize)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<BoxConnection, TransportError>> + Send + 'static,
{
    let mut tasks = Vec::new();
    for n in 0..conns {
        let fut = connect();
        tasks.push(tokio::spawn(async move {
            let mut conn = fut.await.unwrap_or_else(|e| panic!("connect {n}: {e}"));
            exchange(&mut conn, n, frames, max_frame).await;
            conn.close(waygate_transport::CloseCode::Normal, "done")
                .await;
        }));
    }
    tokio::time::timeout(PHASE_LIMIT, async {
        for t in tasks {
            t.await.expect("connection task");
        }
    })
    .await
    .expect("all connections finished in time");
}

/// A frame of exactly `max_frame` bytes passes; one byte more is refused locally with
/// `SendTooLarge` and the connection stays usable.
pub async fn max_frame_checks(conn: &mut BoxConnection, max_frame: usize) {
    let payload = payload_for_frame_len(max_frame, 0, 1);
    let exact = Frame::Data(Data {
        class: TrafficClass::Critical,
        msg_id: 1,
        seq: 1,
        ack: None,
        payload: Bytes::from(vec![0xAB; payload]),
    });
    assert_eq!(exact.encoded_len(), max_frame);
    conn.send(&exact).await.expect("max-size frame is sent");
    assert_eq!(
        timeout(conn.recv()).await.expect("echo of max frame"),
        exact
    );

    let over = Frame::Data(Data {
        class: TrafficClass::Critical,
        msg_id: 1,
        seq: 2,
        ack: None,
        payload: Bytes::from(vec![0xAB; payload + 1]),
    });
    match conn.send(&over).await {
        Err(TransportError::SendTooLarge { len, max }) => {
            assert_eq!((len, max), (max_frame + 1, max_frame));
        }
        other => panic!("max+1 must be refused locally, got {other:?}"),
    }
    let ping = Frame::Ping { timestamp: 7 };
    conn.send(&ping).await.expect("still usable");
    assert_eq!(timeout(conn.recv()).await.expect("ping echo"), ping);
}

/// Awaits `fut` for at most 30 s (a bound, not a speed check).
pub async fn timeout<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("operation finished in time")
}

/// [`waygate_transport::Connection::peer_closed`] on a connection accepted by `listener`,
/// before its WELCOME: a PING and a DATA larger than the pre-auth limit (`max_frame` must
/// allow it) that arrive meanwhile are not taken and not refused (both are read by `recv`
/// once the handshake is done), and the client's close is seen without a read.
pub async fn peer_closed_checks<F, Fut>(mut listener: BoxListener, connect: F, max_frame: usize)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<BoxConnection, TransportError>>,
{
    let accept = tokio::spawn(async move {
        let conn = listener.accept().await;
        (conn, listener)
    });
    let mut client = timeout(connect()).await.expect("connect");
    let ping = Frame::Ping { timestamp: 7 };
    client.send(&ping).await.expect("ping sent");
    let (server, _listener) = timeout(accept).await.expect("accept task");
    let mut server = server.expect("accepted");
    let big_len = (waygate_protocol::wire::MAX_PRE_AUTH_FRAME_SIZE + 4096).min(max_frame);
    assert!(big_len > waygate_protocol::wire::MAX_PRE_AUTH_FRAME_SIZE);
    let big = Frame::Data(Data {
        class: TrafficClass::Normal,
        msg_id: 9,
        seq: 1,
        ack: None,
        payload: Bytes::from(vec![0x5A; payload_for_frame_len(big_len, 0, 1)]),
    });
    client.send(&big).await.expect("big frame sent");
    // Looked at again and again while both arrive: never closed, nothing refused.
    for _ in 0..30 {
        assert!(!server.peer_closed(), "an open connection looked closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.handshake_done();
    assert_eq!(timeout(server.recv()).await.expect("the ping"), ping);
    assert_eq!(timeout(server.recv()).await.expect("the big frame"), big);

    // The client closes: seen without a read.
    let _ = client
        .close(waygate_transport::CloseCode::Normal, "bye")
        .await;
    drop(client);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !server.peer_closed() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the client's close was never seen"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        timeout(server.recv()).await.is_err(),
        "recv fails after a close"
    );
}

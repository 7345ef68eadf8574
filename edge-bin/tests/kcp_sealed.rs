//! Hardening item 4: KCP packets authenticated and encrypted with the connect token's session
//! key (PROTOCOL.md §7.2.2, §8.9), over real sockets. A UDP relay between the client SDK and
//! the edge plays the attacker on the path: it forges a RESET, sends a datagram with a wrong
//! tag and replays a valid datagram. On a plain session the forged RESET ends the session (the
//! attack); on a sealed one all three change nothing and are counted.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::UdpSocket;
use waygate_backend::demo::{ECHO, ECHO_REPLY};
use waygate_client::{Client, ClientOptions, Event};
use waygate_transport::endpoint::Endpoint;
use waygate_transport::kcp::config::PacketAuth;
use waygate_transport::kcp::cookie::Control;
use waygate_transport::{CloseCode, TrafficClass, TransportKind};

fn connect_token(player: &str, session_key: &[u8; 32]) -> Bytes {
    common::connect_token_for_secs(player, session_key, 3600)
}

/// A UDP relay: the client talks to `addr`, the relay to the edge from one socket of its
/// own (so the edge sees the relay as the client). Remembers the client's datagrams.
struct Relay {
    addr: SocketAddr,
    upstream: Arc<UdpSocket>,
    edge: SocketAddr,
    /// Client -> edge datagrams forwarded so far (session datagrams only: conv != 0).
    seen: Arc<Mutex<Vec<Vec<u8>>>>,
    /// Datagrams the relay could not forward (loopback never refuses: checked to be 0, so
    /// what the test injects is the only interference).
    unforwarded: Arc<AtomicU64>,
}

/// Counts a datagram the relay could not forward.
fn count_failure(failed: &AtomicU64, sent: std::io::Result<usize>) {
    if sent.is_err() {
        failed.fetch_add(1, Ordering::Relaxed);
    }
}

async fn relay(edge: SocketAddr) -> Relay {
    let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let upstream = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    upstream.connect(edge).await.unwrap();
    let addr = front.local_addr().unwrap();
    let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    let seen: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let unforwarded: Arc<AtomicU64> = Arc::default();
    {
        let (front, upstream, client, seen, failed) = (
            front.clone(),
            upstream.clone(),
            client.clone(),
            seen.clone(),
            unforwarded.clone(),
        );
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65_536];
            while let Ok((n, from)) = front.recv_from(&mut buf).await {
                *client.lock().unwrap() = Some(from);
                if buf[..4] != [0; 4] {
                    seen.lock().unwrap().push(buf[..n].to_vec());
                }
                count_failure(&failed, upstream.send(&buf[..n]).await);
            }
        });
    }
    {
        let (front, upstream, failed) = (front.clone(), upstream.clone(), unforwarded.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65_536];
            while let Ok(n) = upstream.recv(&mut buf).await {
                let to = *client.lock().unwrap();
                if let Some(to) = to {
                    count_failure(&failed, front.send_to(&buf[..n], to).await);
                }
            }
        });
    }
    Relay {
        addr,
        upstream,
        edge,
        seen,
        unforwarded,
    }
}

impl Relay {
    /// The session's conv (from the client's datagrams).
    fn conv(&self) -> u32 {
        let seen = self.seen.lock().unwrap();
        let first = seen.first().expect("session datagrams seen");
        u32::from_le_bytes([first[0], first[1], first[2], first[3]])
    }

    /// Datagrams the relay failed to forward.
    fn unforwarded(&self) -> u64 {
        self.unforwarded.load(Ordering::Relaxed)
    }

    /// Sends raw bytes to the edge as if from the client.
    async fn inject(&self, datagram: &[u8]) {
        self.upstream.send(datagram).await.unwrap();
        let _ = self.edge;
    }
}

async fn echo(c: &mut Client, tag: &str) -> bool {
    c.send(TrafficClass::Normal, ECHO, Bytes::from(tag.to_owned()))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match c.next_event().await {
                Some(Event::Message {
                    msg_id: ECHO_REPLY, ..
                }) => return true,
                Some(Event::Disconnected { .. } | Event::Closed { .. }) | None => return false,
                Some(_) => {}
            }
        }
    })
    .await
    .unwrap_or(false)
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn client(relay: &Relay, token: Bytes, session_key: Option<[u8; 32]>) -> Client {
    let mut options =
        ClientOptions::new(vec![Endpoint::new(TransportKind::Kcp, relay.addr)], token);
    options.session_key = session_key;
    Client::start(options)
}

async fn until_connected(c: &mut Client) {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match c.next_event().await {
                Some(Event::Connected { .. }) => return,
                Some(_) => {}
                None => panic!("client ended"),
            }
        }
    })
    .await
    .expect("connected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_reset_wrong_tag_and_replay_change_nothing_on_a_sealed_session() {
    let (edge, _b, _d) = common::demo_edge(|_| {}).await;
    let kcp = edge.addrs[&TransportKind::Kcp];
    let admin = edge.admin_addr.unwrap();

    // The attack on a plain session: a RESET with the session's conv from its address ends
    // it.
    let plain_relay = relay(kcp).await;
    let mut plain = client(&plain_relay, common::token("plain"), None);
    until_connected(&mut plain).await;
    assert!(echo(&mut plain, "before").await);
    let reset = Control::Reset {
        conv: plain_relay.conv(),
        code: CloseCode::GoingAway,
    }
    .encode();
    plain_relay.inject(&reset).await;
    assert!(
        !echo(&mut plain, "after").await,
        "a plain session dies of a forged RESET"
    );

    // A sealed session.
    let key: [u8; 32] = rand::random();
    let sealed_relay = relay(kcp).await;
    let mut sealed = client(&sealed_relay, connect_token("sealed", &key), Some(key));
    until_connected(&mut sealed).await;
    assert!(echo(&mut sealed, "one").await);
    let conv = sealed_relay.conv();
    // 1. A forged RESET, plain and as a sealed datagram under another key.
    sealed_relay
        .inject(
            &Control::Reset {
                conv,
                code: CloseCode::GoingAway,
            }
            .encode(),
        )
        .await;
    let (mut wrong, _) = waygate_transport::kcp::seal::session_seals(&[9; 32], conv, false);
    for _ in 0..50 {
        let forged = wrong.seal(
            &Control::Reset {
                conv,
                code: CloseCode::GoingAway,
            }
            .encode(),
        );
        sealed_relay.inject(&forged).await;
    }
    // 2. A real datagram with one bit of its tag flipped.
    let mut altered = sealed_relay.seen.lock().unwrap().last().unwrap().clone();
    let last = altered.len() - 1;
    altered[last] ^= 1;
    sealed_relay.inject(&altered).await;
    // 3. Every datagram the client sent so far, replayed.
    let replays: Vec<Vec<u8>> = sealed_relay.seen.lock().unwrap().clone();
    for d in &replays {
        sealed_relay.inject(d).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        echo(&mut sealed, "two").await,
        "the sealed session lives on"
    );
    assert_eq!(
        sealed_relay.unforwarded(),
        0,
        "the relay lost nothing itself"
    );

    let (_, metrics) = common::http(admin, "GET", "/metrics").await;
    assert!(metric(&metrics, "waygate_kcp_sealed_sessions_total") >= 1.0);
    assert!(
        metric(&metrics, "waygate_kcp_unauthenticated_total") >= 2.0,
        "the unsealed RESET and the altered datagram counted"
    );
    assert!(
        metric(&metrics, "waygate_kcp_replayed_total") >= replays.len() as f64,
        "every replay counted: {}",
        metrics
            .lines()
            .filter(|l| l.starts_with("waygate_kcp_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// With `kcp.packet_auth = "required"` (the default beyond loopback) a CONNECT without a
/// connect token is refused with BUSY 205, and a sealed session still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_requiring_sealed_sessions_refuses_plain_connects() {
    let (edge, _b, _d) = common::demo_edge(|c| c.kcp.packet_auth = PacketAuth::Required).await;
    let kcp = edge.addrs[&TransportKind::Kcp];
    let options = waygate_transport::endpoint::ConnectOptions::default();
    match waygate_transport::kcp::connect_kcp(kcp, &options.kcp, &options.conn).await {
        Err(waygate_transport::TransportError::Refused { code, .. }) => {
            assert_eq!(code, CloseCode::AuthRejected)
        }
        Err(e) => panic!("a plain CONNECT got {e:?}"),
        Ok(_) => panic!("a plain CONNECT was accepted"),
    }
    // A version-1 token is no connect token.
    let mut conn = options.conn.clone();
    conn.kcp_credentials = Some(waygate_transport::kcp::seal::KcpCredentials {
        token: common::token("v1"),
        session_key: [1; 32],
    });
    match waygate_transport::kcp::connect_kcp(kcp, &options.kcp, &conn).await {
        Err(waygate_transport::TransportError::Refused { code, .. }) => {
            assert_eq!(code, CloseCode::AuthUnsupportedVersion)
        }
        Err(e) => panic!("a v1 token got {e:?}"),
        Ok(_) => panic!("a v1 token was accepted"),
    }
    let key: [u8; 32] = rand::random();
    let r = relay(kcp).await;
    let mut c = client(&r, connect_token("sealed-required", &key), Some(key));
    until_connected(&mut c).await;
    assert!(echo(&mut c, "sealed").await);
    assert_eq!(r.unforwarded(), 0, "the relay lost nothing itself");
}

/// Regression (2026-12-05, a review of the SDKs against PROTOCOL.md §8.2.4): a KCP BUSY
/// with an auth code was retried for ever, where the same refusal as a REJECT after HELLO
/// ends the client. A client with no session whose every endpoint refuses its login that
/// way now ends with that code (`Closed`, no further attempt); with a session it keeps
/// trying (a sealed listener checks the token before the resume), which
/// `sdk_client::a_sealed_kcp_session_resumes_over_tcp_after_its_token_expired` covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auth_refusal_in_busy_ends_a_client_without_a_session() {
    let (edge, _b, _d) = common::demo_edge(|c| c.kcp.packet_auth = PacketAuth::Required).await;
    let kcp = edge.addrs[&TransportKind::Kcp];
    // No session key: a plain CONNECT, which this listener refuses with BUSY 205.
    let mut c = Client::start(ClientOptions::new(
        vec![Endpoint::new(TransportKind::Kcp, kcp)],
        common::token("plain"),
    ));
    let mut rejected = 0;
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match c.next_event().await {
                Some(Event::Closed { code }) => return code,
                Some(Event::Rejected { .. }) => rejected += 1,
                Some(_) => {}
                None => panic!("ended without Closed"),
            }
        }
    })
    .await
    .expect("the client ends within 10 s");
    assert_eq!(end, CloseCode::AuthRejected);
    assert_eq!(rejected, 0, "not retried");
    let after = tokio::time::timeout(Duration::from_secs(5), c.next_event())
        .await
        .expect("the client task ends");
    assert!(after.is_none());
}

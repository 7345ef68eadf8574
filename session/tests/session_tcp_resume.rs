//! Real sockets: the session driver over the TCP transport. A client streams messages, its
//! socket is killed mid-stream, it reconnects with its resume token, and every message
//! arrives exactly once, in order, on both sides.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use waygate_protocol::frame::WelcomeOutcome;
use waygate_session::client::{ClientConfig, ClientEvent, ClientSession, ClientState};
use waygate_session::driver::SessionLayer;
use waygate_session::testkit::{echo_edge, test_token, EchoSink};
use waygate_session::SessionConfig;
use waygate_transport::tcp::{self, connect_tcp};
use waygate_transport::{BoxConnection, CloseCode, ConnConfig, Listener, TrafficClass};

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn token(player: &str) -> Bytes {
    test_token(player, unix_now(), 600)
}

async fn start_edge() -> (SocketAddr, Arc<SessionLayer>, Arc<EchoSink>) {
    let listener = tcp::listen(
        "127.0.0.1:0".parse().expect("addr"),
        None,
        ConnConfig::default(),
    )
    .await
    .expect("bind");
    let addr = listener.local_addr();
    let (edge, sink) = echo_edge("edge-1", SessionConfig::default());
    let edge = Arc::new(edge);
    let accept_edge = edge.clone();
    tokio::spawn(async move {
        let mut listener = listener;
        while let Some(conn) = listener.accept().await {
            accept_edge.spawn(conn);
        }
    });
    (addr, edge, sink)
}

/// A minimal client driver around the sans-IO [`ClientSession`].
struct TestClient {
    addr: SocketAddr,
    session: ClientSession,
    conn: Option<BoxConnection>,
    received: Vec<(u64, Bytes)>,
    welcomes: Vec<WelcomeOutcome>,
    closes: Vec<CloseCode>,
}

impl TestClient {
    fn new(addr: SocketAddr, player: &str) -> Self {
        Self {
            addr,
            session: ClientSession::new(token(player), ClientConfig::default()),
            conn: None,
            received: Vec::new(),
            welcomes: Vec::new(),
            closes: Vec::new(),
        }
    }

    async fn connect(&mut self) {
        let conn = connect_tcp(self.addr, &ConnConfig::default())
            .await
            .expect("connect");
        self.conn = Some(conn);
        self.session.connect(Instant::now()).expect("hello");
        self.flush().await;
    }

    /// Drops the socket without a CLOSE frame (what a dying mobile link looks like).
    fn kill(&mut self) {
        self.conn = None;
        self.session
            .handle_link_down(Instant::now(), CloseCode::GoingAway);
        self.drain_events();
    }

    async fn flush(&mut self) {
        while let Some(frame) = self.session.poll_transmit() {
            match self.conn.as_mut() {
                Some(conn) => {
                    if conn.send(&frame).await.is_err() {
                        self.kill();
                        return;
                    }
                }
                None => return,
            }
        }
    }

    fn drain_events(&mut self) {
        while let Some(e) = self.session.poll_event() {
            match e {
                ClientEvent::Message { seq, payload, .. } if seq > 0 => {
                    self.received.push((seq, payload))
                }
                ClientEvent::Welcomed { outcome, .. } => self.welcomes.push(outcome),
                ClientEvent::Disconnected { code } => self.closes.push(code),
                _ => {}
            }
        }
    }

    async fn send(&mut self, class: TrafficClass, body: Bytes) {
        self.session
            .send(Instant::now(), class, 10, body)
            .expect("send");
        self.flush().await;
    }

    /// Receives for up to `dur` (or until `done`), handling timers (acks, pings).
    async fn pump(&mut self, dur: Duration, done: impl Fn(&Self) -> bool) {
        let end = tokio::time::Instant::now() + dur;
        while tokio::time::Instant::now() < end && !done(self) {
            let Some(conn) = self.conn.as_mut() else {
                return;
            };
            let tick = tokio::time::sleep(Duration::from_millis(5));
            tokio::select! {
                r = conn.recv() => match r {
                    Ok(frame) => {
                        let _ = self.session.handle_frame(Instant::now(), frame);
                    }
                    Err(e) => {
                        self.conn = None;
                        self.session.handle_link_down(Instant::now(), e.close_code());
                    }
                },
                _ = tick => {}
            }
            self.session.handle_timeout(Instant::now());
            self.drain_events();
            self.flush().await;
        }
    }
}

fn body(i: usize) -> Bytes {
    Bytes::from(format!("msg-{i:04}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_socket_resumes_with_every_message_exactly_once_in_order() {
    let (addr, edge, sink) = start_edge().await;
    let mut client = TestClient::new(addr, "alice");
    client.connect().await;
    client
        .pump(Duration::from_secs(5), |c| !c.welcomes.is_empty())
        .await;
    assert_eq!(client.welcomes, vec![WelcomeOutcome::NewSession]);
    let total = 300;
    for i in 0..total {
        let class = if i % 3 == 0 {
            TrafficClass::Critical
        } else {
            TrafficClass::Normal
        };
        client.send(class, body(i)).await;
        if i % 7 == 0 {
            client.pump(Duration::from_millis(1), |_| false).await;
        }
        if i == 150 {
            // Mid-stream: echoes and sends are in flight. Kill the socket, keep sending
            // (buffered), then reconnect and resume.
            client.kill();
        }
        if i == 180 {
            assert_eq!(client.session.state(), ClientState::Disconnected);
            client.connect().await;
            client
                .pump(Duration::from_secs(5), |c| c.welcomes.len() == 2)
                .await;
            assert_eq!(client.welcomes[1], WelcomeOutcome::Restored);
        }
    }
    client
        .pump(Duration::from_secs(10), |c| c.received.len() >= total)
        .await;
    // Let the last acks settle, then check both sides.
    client.pump(Duration::from_millis(100), |_| false).await;

    let upstream: Vec<Bytes> = sink
        .received()
        .into_iter()
        .filter(|u| u.class.is_sequenced())
        .map(|u| u.payload)
        .collect();
    let expected: Vec<Bytes> = (0..total).map(body).collect();
    assert_eq!(upstream.len(), total, "upstream count");
    assert_eq!(upstream, expected, "upstream exactly once, in order");
    let downstream: Vec<Bytes> = client.received.iter().map(|(_, b)| b.clone()).collect();
    assert_eq!(downstream, expected, "downstream exactly once, in order");
    let seqs: Vec<u64> = client.received.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (1..=total as u64).collect::<Vec<_>>());
    assert_eq!(client.session.unacked_len(), 0);
    assert_eq!(edge.registry.len(), 1, "one live session");
    let restored = edge
        .counters
        .restored
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(restored, 1);
    eprintln!(
        "counters: {:?}",
        edge.counters
            .export()
            .into_iter()
            .filter(|(_, v)| *v > 0)
            .collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_login_over_tcp_kicks_the_first() {
    let (addr, edge, _sink) = start_edge().await;
    let mut first = TestClient::new(addr, "bob");
    first.connect().await;
    first
        .pump(Duration::from_secs(5), |c| !c.welcomes.is_empty())
        .await;
    let sid1 = edge.registry.session_of("bob").expect("registered");
    assert!(edge.registry.bind(&sid1, "world", "w-9"));
    let mut second = TestClient::new(addr, "bob");
    second.connect().await;
    second
        .pump(Duration::from_secs(5), |c| !c.welcomes.is_empty())
        .await;
    assert_eq!(second.welcomes, vec![WelcomeOutcome::NewSession]);
    first
        .pump(Duration::from_secs(5), |c| !c.closes.is_empty())
        .await;
    assert_eq!(first.closes, vec![CloseCode::Kicked]);
    assert_eq!(first.session.state(), ClientState::Closed);
    let sid2 = edge.registry.session_of("bob").expect("registered");
    assert_ne!(sid1, sid2);
    let owner = edge
        .ownership
        .owner("bob")
        .await
        .expect("owner")
        .expect("some");
    assert_eq!(owner.fencing, 2);
    assert_eq!(owner.session_id, sid2);
}

//! The Rust client SDK against a real edge (C1–C3): random socket kills on every transport
//! lose and duplicate nothing; UDP blocked falls back to TCP/WS; retry-after is honoured;
//! kicked is terminal; reconnects of many clients are spread by full jitter.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::cluster::*;
use common::token;
use rand::{RngExt, SeedableRng};
use tokio::io::AsyncWriteExt;
use waygate_backend::demo::{ECHO, ECHO_REPLY};
use waygate_client::{
    Client, ClientError, ClientOptions, ConnectionState, Event, RequestError, SdkError,
};
use waygate_protocol::frame::Reject;
use waygate_transport::endpoint::{ConnectOptions, Endpoint};
use waygate_transport::{CloseCode, Frame, TrafficClass, TransportKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_socket_kills_on_every_transport_lose_and_duplicate_nothing() {
    let c = cluster().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for kind in TransportKind::ALL {
        let player = format!("chaos-{kind}");
        let mut client = c.client(&[kind], &player);
        let total = 120u64;
        let kills: Vec<u64> = (0..3).map(|_| rng.random_range(1..total)).collect();
        let mut got = Vec::new();
        let mut sent = 0;
        while got.len() < total as usize {
            if sent < total {
                client
                    .send(TrafficClass::Normal, ECHO, Bytes::from(sent.to_string()))
                    .await
                    .unwrap();
                sent += 1;
                if kills.contains(&sent) {
                    client.drop_link().await.expect("client running");
                }
            }
            let wait = if sent < total { 1 } else { 20_000 };
            match tokio::time::timeout(Duration::from_millis(wait), client.next_event()).await {
                Ok(Some(Event::Message {
                    msg_id: ECHO_REPLY,
                    payload,
                    ..
                })) => {
                    let text = String::from_utf8(payload.to_vec()).unwrap();
                    got.push(text.rsplit('|').next().unwrap().parse::<u64>().unwrap());
                }
                Ok(Some(Event::Closed { code })) => panic!("{kind}: closed {code}"),
                Ok(Some(Event::Error(e))) => panic!("{kind}: {e:?}"),
                Ok(Some(_)) => {}
                Ok(None) => panic!("{kind}: client ended"),
                Err(_) => assert!(sent < total, "{kind}: replies stopped at {}", got.len()),
            }
        }
        assert_eq!(
            got,
            (0..total).collect::<Vec<_>>(),
            "{kind}: kills at {kills:?}"
        );
        client.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_blocked_falls_back_to_tcp_then_websocket() {
    let c = cluster().await;
    // KCP: a UDP port that swallows every datagram (packets dropped). QUIC: a closed port.
    let sink = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let closed = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let endpoints = vec![
        Endpoint::new(TransportKind::Kcp, sink.local_addr().unwrap()),
        {
            let mut e = Endpoint::new(TransportKind::Quic, closed);
            e.host = "localhost".into();
            e
        },
        c.endpoint(TransportKind::Tcp),
        c.endpoint(TransportKind::Ws),
    ];
    let mut options = ClientOptions::new(endpoints, token("fallback-player"));
    options.connect = ConnectOptions {
        tls: Some(c.tls.clone()),
        ..ConnectOptions::default()
    };
    options.udp_timeout = Duration::from_millis(400);
    let mut client = Client::start(options);
    let mut failed = Vec::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(20), client.next_event())
            .await
            .unwrap()
            .unwrap();
        match ev {
            Event::ConnectFailed { endpoint, .. } => failed.push(endpoint),
            Event::Connected { endpoint, .. } => {
                assert!(endpoint.starts_with("tcp://"), "{endpoint}");
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    // The UDP attempts are visible, each with its endpoint.
    assert_eq!(failed.len(), 2, "{failed:?}");
    assert!(
        failed[0].starts_with("kcp://") && failed[1].starts_with("quic://"),
        "{failed:?}"
    );
    assert!(echo_ok(&mut client).await);
}

/// A fake edge's WELCOME of a new session (`id`: the session id's bytes, `token`: the
/// resume token's), with the default heartbeat, idle timeout and max frame size.
fn new_session_welcome(id: u8, token: u8) -> Frame {
    Frame::Welcome(waygate_protocol::frame::Welcome {
        session_id: [id; 16],
        resume_token: [token; 16],
        outcome: waygate_protocol::frame::WelcomeOutcome::NewSession,
        heartbeat_interval_ms: 10_000,
        idle_timeout_ms: 30_000,
        max_frame_size: 65_536,
        server_seq_base: 0,
        client_seq_ack: 0,
    })
}

/// Options for `player` over the edge's TCP listener.
fn tcp_options(edge: &waygate_edge::edge::Edge, player: &str) -> ClientOptions {
    ClientOptions::new(
        vec![Endpoint::new(
            TransportKind::Tcp,
            edge.addrs[&TransportKind::Tcp],
        )],
        token(player),
    )
}

async fn echo_ok(client: &mut Client) -> bool {
    client
        .send(TrafficClass::Normal, ECHO, Bytes::from_static(b"x"))
        .await
        .unwrap();
    next_message(client, ECHO_REPLY).await.ends_with(b"x")
}

/// A fake edge that answers every HELLO with REJECT overloaded + retry-after, recording when
/// each connection arrived.
async fn rejecting_server(
    retry_after_ms: u32,
) -> (
    std::net::SocketAddr,
    tokio::sync::mpsc::UnboundedReceiver<tokio::time::Instant>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let _ = tx.send(tokio::time::Instant::now());
            let mut out = bytes::BytesMut::new();
            waygate_protocol::codec::StreamCodec::new(65536)
                .encode(
                    &Frame::Reject(Reject {
                        code: CloseCode::Overloaded,
                        retry_after_ms,
                        message: "busy".into(),
                    }),
                    &mut out,
                )
                .unwrap();
            let _ = sock.write_all(&out).await;
            let _ = sock.shutdown().await;
        }
    });
    (addr, rx)
}

/// Regression (2026-12-05, an audit of the SDKs against PROTOCOL.md): a link that had its
/// WELCOME reconnected at once when it died, so an edge that closes every link right after
/// its WELCOME (a message it refuses, resent on each resume) had the client spin: hundreds of
/// connections a second. Links that die within 1 s of their WELCOME now back off like failed
/// attempts (100 ms doubling, full jitter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_that_die_right_after_their_welcome_back_off() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, mut arrivals) = tokio::sync::mpsc::unbounded_channel();
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            // The test counts arrivals; once it stopped counting, the fake edge stops.
            if tx.send(()).is_err() {
                return;
            }
            let mut hello = [0u8; 4096];
            let _ = tokio::io::AsyncReadExt::read(&mut sock, &mut hello).await;
            let mut out = bytes::BytesMut::new();
            waygate_protocol::codec::StreamCodec::new(65536)
                .encode(&new_session_welcome(7, 8), &mut out)
                .unwrap();
            let _ = sock.write_all(&out).await;
            let _ = sock.shutdown().await;
        }
    });
    let client = Client::start(ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, addr)],
        token("spinning"),
    ));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut connections = 0;
    while arrivals.try_recv().is_ok() {
        connections += 1;
    }
    assert!(
        (2..=20).contains(&connections),
        "{connections} connections in 1.5 s to an edge that closes each link after WELCOME"
    );
    drop(client);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured() {
    let (addr, mut arrivals) = rejecting_server(700).await;
    let mut client = Client::start(ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, addr)],
        token("patient"),
    ));
    let first = arrivals.recv().await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(5), client.next_event())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        ev,
        Event::Rejected {
            code: CloseCode::Overloaded,
            retry_after_ms: 700
        }
    );
    let second = tokio::time::timeout(Duration::from_secs(10), arrivals.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        second.duration_since(first) >= Duration::from_millis(700),
        "reconnected after {:?}, before the 700 ms retry-after",
        second.duration_since(first)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kicked_is_terminal_without_a_reconnect_loop() {
    let c = cluster().await;
    let mut first = c.client(&[TransportKind::Tcp], "twice");
    assert!(echo_ok(&mut first).await);
    let mut second = c.client(&[TransportKind::Ws], "twice");
    assert!(echo_ok(&mut second).await);
    let ev = loop {
        match tokio::time::timeout(Duration::from_secs(10), first.next_event())
            .await
            .unwrap()
        {
            Some(Event::Closed { code }) => break code,
            Some(_) => {}
            None => panic!("ended without Closed"),
        }
    };
    assert_eq!(ev, CloseCode::Kicked);
    // The client task ends: no reconnect.
    let end = tokio::time::timeout(Duration::from_secs(5), first.next_event())
        .await
        .unwrap();
    assert_eq!(end, None);
    assert!(echo_ok(&mut second).await, "the new login keeps working");
}

/// Regression (2026-12-05): a backend's KICK with a code of its own ("game over" as
/// `normal`, or an application code) reached the client as that code, which the SDK read
/// as a lost link: it resumed, was refused, and — holding a valid token — logged in again,
/// so a kicked player came straight back. Now the code after WELCOME says whether the
/// session lingers (PROTOCOL.md §7.8): the client ends for good, with no new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_s_kick_ends_the_client_whatever_its_code() {
    let sessions = std::sync::Arc::new(common::keeper::SessionKeeper::default());
    let (edge, _backend, _dir) = common::edge_over(sessions.clone(), |_| {}).await;
    for (i, (given, seen)) in [
        (CloseCode::Normal, CloseCode::Kicked),
        (CloseCode::Unknown(4_003), CloseCode::Unknown(4_003)),
    ]
    .into_iter()
    .enumerate()
    {
        let player = format!("kicked-{i}");
        let mut client = Client::start(tcp_options(&edge, &player));
        client
            .send(TrafficClass::Normal, 1000, Bytes::from_static(b"hello"))
            .await
            .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let session = loop {
            if let Some(s) = sessions.get(&player) {
                break s;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no session reached the backend"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        session.kick(given, "game over").await.unwrap();
        let mut connects = 0;
        let end = loop {
            match tokio::time::timeout(Duration::from_secs(10), client.next_event())
                .await
                .expect("an event within 10 s")
            {
                Some(Event::Closed { code }) => break code,
                Some(Event::Connected { .. }) => connects += 1,
                Some(_) => {}
                None => panic!("ended without Closed"),
            }
        };
        assert_eq!(end, seen, "{given:?} reaches the client as {seen:?}");
        assert_eq!(connects, 1, "{given:?}: no connection after the kick");
        let after = tokio::time::timeout(Duration::from_secs(5), client.next_event())
            .await
            .expect("the client task ends");
        assert_eq!(after, None, "{given:?}: nothing after Closed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_jitter_spreads_the_reconnects_of_200_clients() {
    // A server that accepts and immediately closes: every attempt fails before WELCOME.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((sock, peer)) = listener.accept().await else {
                return;
            };
            let _ = tx.send((peer.port(), tokio::time::Instant::now()));
            drop(sock);
        }
    });
    let start = tokio::time::Instant::now();
    let mut clients = Vec::new();
    for i in 0..200 {
        let mut o = ClientOptions::new(
            vec![Endpoint::new(TransportKind::Tcp, addr)],
            token(&format!("j{i}")),
        );
        o.backoff_min = Duration::from_millis(200);
        o.backoff_max = Duration::from_millis(400);
        clients.push(Client::start(o));
    }
    // Collect arrivals for 1.2 s; the first wave arrives at once, retries are spread.
    let mut times = Vec::new();
    let deadline = start + Duration::from_millis(1200);
    while let Ok(Some((_, t))) = tokio::time::timeout_at(deadline, rx.recv()).await {
        times.push(t.duration_since(start));
    }
    drop(clients);
    let retries: Vec<Duration> = times
        .into_iter()
        .filter(|t| *t > Duration::from_millis(150))
        .collect();
    assert!(
        retries.len() >= 200,
        "clients retried ({} retries)",
        retries.len()
    );
    // Buckets of 100 ms between 150 ms and 1150 ms: with full jitter no bucket holds most of
    // the retries and most buckets hold some.
    let mut buckets = [0usize; 10];
    for t in &retries {
        let i = ((t.as_millis() as usize).saturating_sub(150) / 100).min(9);
        buckets[i] += 1;
    }
    let max = *buckets.iter().max().unwrap();
    let busy = buckets.iter().filter(|b| **b >= 10).count();
    assert!(max * 2 < retries.len(), "retries bunched: {buckets:?}");
    assert!(busy >= 6, "retries not spread: {buckets:?}");
}

/// SDK issue item 2: an auth token that expires while the client is away used to end the
/// Rust (and C) client for good (`auth_expired` was terminal), although the session could
/// still be resumed with its resume token. Now the SDK drops the expired token and resumes
/// with the resume token alone: restored, nothing lost; `set_token` gives a fresh token for
/// a later new login.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_does_not_end_a_resumable_session() {
    let (edge, _backend, _dir) = common::demo_edge(|c| c.auth.leeway_secs = 0).await;
    let endpoint = Endpoint::new(TransportKind::Tcp, edge.addrs[&TransportKind::Tcp]);
    let mut client = Client::start(ClientOptions::new(
        vec![endpoint],
        common::token_for_secs("short-lived", 1),
    ));
    assert!(echo_ok(&mut client).await, "first echo");
    // The token runs out (expires-at is whole seconds: wait past the next one) while the
    // link is down.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    client.drop_link().await.expect("client running");
    let mut outcomes = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(20), client.next_event())
            .await
            .expect("an event in time")
            .expect("client running");
        match event {
            Event::Connected { outcome, .. } => {
                outcomes.push(outcome);
                break;
            }
            Event::Closed { code } => panic!("ended for good: {code}"),
            // On the way: the expired token's refusal, not an end.
            Event::Rejected { code, .. } => assert_eq!(code, CloseCode::AuthExpired),
            _ => {}
        }
    }
    assert_eq!(
        outcomes.last(),
        Some(&waygate_protocol::frame::WelcomeOutcome::Restored)
    );
    assert!(echo_ok(&mut client).await, "the restored session works");
    client
        .set_token(common::token("short-lived"))
        .await
        .expect("a running client takes a fresh token");
}

/// SDK issue item 3: connection failures are visible. A client whose first endpoint is a
/// TLS listener with a certificate it does not trust (no CA given: the system's roots)
/// gets `ConnectFailed` naming the endpoint and the certificate problem, then connects over
/// its next endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connect_attempt_is_an_event_with_its_reason() {
    let (edge, _b, _d) = common::demo_edge(|_| {}).await;
    let tls = Endpoint::parse(&format!(
        "tls://localhost:{}",
        edge.addrs[&TransportKind::Tls].port()
    ))
    .unwrap();
    let tcp = Endpoint::new(TransportKind::Tcp, edge.addrs[&TransportKind::Tcp]);
    let mut c = Client::start(ClientOptions::new(
        vec![tls.clone(), tcp.clone()],
        token("visible-failure"),
    ));
    let mut failures = Vec::new();
    let connected = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match c.next_event().await {
                Some(Event::ConnectFailed {
                    endpoint,
                    reason,
                    attempt,
                }) => failures.push((endpoint, reason, attempt)),
                Some(Event::Connected { endpoint, .. }) => return endpoint,
                Some(_) => {}
                None => panic!("client ended"),
            }
        }
    })
    .await
    .expect("connected over the next endpoint");
    assert_eq!(connected, tcp.to_string());
    let (endpoint, reason, attempt) = failures.first().expect("a ConnectFailed event");
    assert_eq!(endpoint, &tls.to_string());
    assert_eq!(*attempt, 1);
    assert!(
        reason.to_lowercase().contains("certificate") || reason.contains("trust roots"),
        "the reason names the certificate problem: {reason}"
    );
}

/// SDK issue items 6 and 7: the transport that worked is tried first on the next connect
/// (sticky fallback: a UDP-blocked network waits out the UDP timeout once, not on every
/// resume); `reconnect_now` drops a link that looks alive and resumes at once; with
/// `give_up_after` a client that cannot get a session ends with `Closed(unavailable)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sticky_fallback_reconnect_now_and_giving_up() {
    let c = cluster().await;
    let sink = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut options = ClientOptions::new(
        vec![
            Endpoint::new(TransportKind::Kcp, sink.local_addr().unwrap()),
            c.endpoint(TransportKind::Tcp),
        ],
        token("sticky-player"),
    );
    options.udp_timeout = Duration::from_millis(400);
    let mut client = Client::start(options);
    let mut failed = 0;
    loop {
        match next(&mut client).await {
            Event::ConnectFailed { .. } => failed += 1,
            Event::Connected { endpoint, .. } => {
                assert!(endpoint.starts_with("tcp://"), "{endpoint}");
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(failed, 1, "the KCP attempt failed once");
    // reconnect_now on a live link: dropped and resumed at once, over TCP first (sticky).
    let t = tokio::time::Instant::now();
    client.reconnect_now().await.expect("client running");
    loop {
        match next(&mut client).await {
            Event::ConnectFailed { endpoint, .. } => {
                panic!("{endpoint} tried again: the fallback did not stick")
            }
            Event::Connected {
                endpoint, outcome, ..
            } => {
                assert!(endpoint.starts_with("tcp://"), "{endpoint}");
                assert_eq!(outcome, waygate_protocol::frame::WelcomeOutcome::Restored);
                break;
            }
            Event::Disconnected { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "resumed in {:?}",
        t.elapsed()
    );
    assert!(echo_ok(&mut client).await);
    client.close().await;

    // Nothing answers: give up after 1 s.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let mut options = ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, dead_addr)],
        token("hopeless"),
    );
    options.give_up_after = Some(Duration::from_secs(1));
    let mut hopeless = Client::start(options);
    let t = tokio::time::Instant::now();
    loop {
        match next(&mut hopeless).await {
            Event::ConnectFailed { .. } => {}
            Event::Closed { code } => {
                assert_eq!(code, CloseCode::Unavailable);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "gave up after {took:?}"
    );

    // Or after 3 failed rounds: exactly 3 ConnectFailed, then Closed(unavailable).
    let mut options = ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, dead_addr)],
        token("hopeless-too"),
    );
    options.give_up_after_attempts = Some(3);
    options.backoff_min = Duration::from_millis(10);
    options.backoff_max = Duration::from_millis(50);
    let mut capped = Client::start(options);
    let mut attempts = Vec::new();
    loop {
        match next(&mut capped).await {
            Event::ConnectFailed { attempt, .. } => attempts.push(attempt),
            Event::Closed { code } => {
                assert_eq!(code, CloseCode::Unavailable);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(attempts, [1, 2, 3]);
}

/// A client that keeps failing to connect while the application takes no events holds a
/// bounded backlog: past the event channel (4,096) and 256 more waiting in the client task
/// (`STATUS_BACKLOG`), connect failures are counted, not kept, and one `EventsDropped`
/// stands where they were lost (also before the final `Closed`). Before the fix every
/// failure was kept: one per endpoint per backoff step, for as long as nobody read them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_nobody_takes_are_bounded_and_counted() {
    const CHANNEL: usize = 4096;
    const STATUS_BACKLOG: usize = 256;
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    // The dead port several times per round: the backlog fills within a second or two.
    let mut options = ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, dead_addr); 8],
        token("nobody-reads"),
    );
    options.backoff_min = Duration::from_millis(1);
    options.backoff_max = Duration::from_millis(1);
    let mut client = Client::start(options);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while client.stats().events_dropped == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing dropped within 10 s: the backlog grows without bound ({:?})",
            client.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // More rounds fail meanwhile, still taken by nobody.
    tokio::time::sleep(Duration::from_millis(200)).await;

    // What waited before the first marker: at most the channel and the status backlog.
    let mut waiting = 0usize;
    let mut dropped = 0u64;
    loop {
        match next(&mut client).await {
            Event::ConnectFailed { .. } => {
                waiting += 1;
                assert!(
                    waiting <= CHANNEL + STATUS_BACKLOG,
                    "more than {} events waited",
                    CHANNEL + STATUS_BACKLOG
                );
            }
            Event::EventsDropped { count } => {
                assert!(count > 0);
                dropped += count;
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    // One marker, then the failures kept again.
    match next(&mut client).await {
        Event::ConnectFailed { .. } => {}
        other => panic!("a ConnectFailed after the marker, got {other:?}"),
    }

    // Closing still ends with `Closed`; every drop is in some marker, never two in a row.
    client.close().await;
    let mut after_marker = false;
    let mut taken = 0usize;
    loop {
        taken += 1;
        assert!(
            taken <= 2 * (CHANNEL + STATUS_BACKLOG),
            "no Closed after {taken} events"
        );
        match next(&mut client).await {
            Event::ConnectFailed { .. } => after_marker = false,
            Event::EventsDropped { count } => {
                assert!(count > 0 && !after_marker, "an empty or repeated marker");
                dropped += count;
                after_marker = true;
            }
            Event::Closed { code } => {
                assert_eq!(code, CloseCode::Normal);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let end = tokio::time::timeout(Duration::from_secs(10), client.next_event())
        .await
        .expect("the event stream ends");
    assert!(end.is_none(), "{end:?} after Closed");
    assert_eq!(
        dropped,
        client.stats().events_dropped,
        "the markers count every dropped event"
    );
}

/// A TCP forwarder to the edge that the test can close (its connections cut, new ones
/// accepted and dropped at once, as a network that went away) and open again.
struct TcpGate {
    addr: std::net::SocketAddr,
    open: tokio::sync::watch::Sender<bool>,
}

impl TcpGate {
    async fn start(target: std::net::SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (open, watch) = tokio::sync::watch::channel(true);
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !*watch.borrow() {
                    continue;
                }
                let mut closed = watch.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = closed.wait_for(|open| !*open) => {}
                    }
                });
            }
        });
        Self { addr, open }
    }

    fn set_open(&self, open: bool) {
        self.open.send_replace(open);
    }
}

/// SDK issue items 3 and 7 over a real socket: the queryable state follows the link
/// (connecting, connected, reconnecting, closed), and messages sent while the network is
/// gone that wait longer than `max_offline_age` are dropped with an `Expired` event each,
/// never sent; the fresh one sent after them is delivered, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_names_and_messages_queued_offline_expire_past_their_bound() {
    let (edge, _b, _d) = common::demo_edge(|_| {}).await;
    let gate = TcpGate::start(edge.addrs[&TransportKind::Tcp]).await;
    let mut options = ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, gate.addr)],
        token("offline-player"),
    );
    options.session.max_offline_age = Some(Duration::from_millis(300));
    options.backoff_max = Duration::from_millis(200);
    let mut client = Client::start(options);
    assert_eq!(client.state(), ConnectionState::Connecting);
    assert!(echo_ok(&mut client).await);
    assert_eq!(client.state(), ConnectionState::Connected);
    assert_eq!(client.state().as_str(), "connected");

    gate.set_open(false);
    loop {
        if let Event::Disconnected { .. } = next(&mut client).await {
            break;
        }
    }
    assert_eq!(client.state(), ConnectionState::Reconnecting);
    let mut stale = Vec::new();
    for body in ["stale-1", "stale-2"] {
        let seq = client
            .send(TrafficClass::Normal, ECHO, Bytes::from(body))
            .await
            .unwrap();
        stale.push(seq.expect("sequenced"));
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    let fresh = client
        .send(TrafficClass::Normal, ECHO, Bytes::from_static(b"fresh"))
        .await
        .unwrap()
        .expect("sequenced");
    gate.set_open(true);
    let mut expired = Vec::new();
    let mut replies = Vec::new();
    while replies.is_empty() {
        match next(&mut client).await {
            Event::Expired { msg_id, seq, age } => {
                assert_eq!(msg_id, ECHO);
                assert!(age > Duration::from_millis(300), "{age:?}");
                expired.push(seq);
            }
            Event::Message {
                msg_id: ECHO_REPLY,
                payload,
                ..
            } => replies.push(payload),
            _ => {}
        }
    }
    assert_eq!(expired, stale, "both stale messages expired, in order");
    assert_eq!(fresh, stale[1] + 1);
    assert!(replies[0].ends_with(b"|fresh"), "{:?}", replies[0]);
    assert!(echo_ok(&mut client).await, "the session goes on");
    client.close().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while client.state() != ConnectionState::Closed {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            client.state()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SDK issue item 9 over real sockets: requests with correlation and timeouts (PROTOCOL.md
/// §13), answered by the demo game server: an answer, the server's own error status, a
/// refusal by the edge, a timeout, one that survives a dropped link, one started without
/// waiting (its outcome an event); and the server clock offset from TIME samples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_answered_refused_or_timed_out_and_the_clock_is_synced() {
    use waygate_backend::demo::{ASK, ASK_EMPTY, TIME};
    let (edge, _b, _d) = common::demo_edge(|_| {}).await;
    let mut client = Client::start(tcp_options(&edge, "asker"));
    let second = Duration::from_secs(10);
    let a = client
        .request(
            TrafficClass::Normal,
            ASK,
            Bytes::from_static(b"why"),
            second,
        )
        .await
        .expect("answered");
    assert_eq!((a.status, &a.body[..]), (0, &b"b1|asker|why"[..]));
    let a = client
        .request(TrafficClass::Critical, ASK, Bytes::new(), second)
        .await
        .expect("answered");
    assert_eq!((a.status, &a.body[..]), (ASK_EMPTY, &b"empty question"[..]));
    // A message id no service takes: the edge refuses it (ERROR no_route for its seq).
    assert_eq!(
        client
            .request(TrafficClass::Normal, 9_999_999, Bytes::new(), second)
            .await,
        Err(RequestError::Refused {
            code: CloseCode::NoRoute,
            retry_after_ms: 0
        })
    );
    // ECHO is not answered as a request (its reply is an ordinary message): timeout.
    assert_eq!(
        client
            .request(
                TrafficClass::Normal,
                ECHO,
                Bytes::from_static(b"x"),
                Duration::from_millis(300)
            )
            .await,
        Err(RequestError::Timeout(Duration::from_millis(300)))
    );
    assert_eq!(
        client
            .request(TrafficClass::BestEffort, ASK, Bytes::new(), second)
            .await,
        Err(RequestError::NotSequenced)
    );
    // Started without waiting, the link dropped right after: answered after the resume,
    // once, as an event.
    let id = client
        .start_request(
            TrafficClass::Normal,
            ASK,
            Bytes::from_static(b"later"),
            second,
        )
        .await
        .expect("started");
    client.drop_link().await.unwrap();
    let mut answers = Vec::new();
    while answers.is_empty() {
        if let Event::Answered { request_id, result } = next(&mut client).await {
            answers.push((request_id, result));
        }
    }
    let (request_id, result) = answers.remove(0);
    assert_eq!(request_id, id);
    assert_eq!(&result.expect("answered").body[..], b"b1|asker|later");
    assert_eq!(client.stats().requests_pending, 0);
    // Clock: the demo answers TIME with its clock; same machine, so the offset is within
    // half a round trip (plus the millisecond rounding of both clocks).
    assert_eq!(client.stats().clock, None);
    let mut estimate = None;
    for _ in 0..3 {
        estimate = Some(client.sync_clock(TIME, second).await.expect("clock sample"));
    }
    let e = estimate.unwrap();
    assert_eq!(e.samples, 3);
    let bound = i64::try_from(e.rtt.as_millis()).unwrap() / 2 + 2;
    assert!(e.offset_ms.abs() <= bound, "{e:?}");
    assert_eq!(client.stats().clock, Some(e));
    client.close().await;
}

/// SDK issue item 9: the network simulator drives a resume test at 10% loss, on every
/// transport: with latency, jitter and 10% of frames lost (best-effort dropped, the rest
/// delayed as retransmitted) and the link dropped half way, every echo is answered exactly
/// once and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_at_ten_percent_simulated_loss_loses_and_duplicates_nothing() {
    use waygate_client::netsim::NetSimConfig;
    let (edge, _b, _d) = common::demo_edge(|_| {}).await;
    let ca = edge.dev_ca_pem.clone();
    for kind in TransportKind::ALL {
        let addr = edge.addrs[&kind];
        let endpoint = if matches!(
            kind,
            TransportKind::Tls | TransportKind::Wss | TransportKind::Quic
        ) {
            Endpoint::parse(&format!("{}://localhost:{}", kind.as_str(), addr.port())).unwrap()
        } else {
            Endpoint::new(kind, addr)
        };
        let mut options = ClientOptions::new(vec![endpoint], token(&format!("lossy-{kind}")));
        if let Some(ca) = &ca {
            options.connect.tls = Some(waygate_transport::tls::ClientTls::from_ca_pem(ca).unwrap());
        }
        options.net_sim = Some(NetSimConfig {
            latency: Duration::from_millis(15),
            jitter: Duration::from_millis(10),
            loss: 0.10,
            seed: 42,
            ..NetSimConfig::default()
        });
        let mut client = Client::start(options);
        loop {
            if let Event::Connected { .. } = next(&mut client).await {
                break;
            }
        }
        let total = 60u32;
        let mut got = Vec::new();
        for i in 0..total {
            client
                .send(TrafficClass::Normal, ECHO, Bytes::from(i.to_string()))
                .await
                .unwrap();
            // Best-effort traffic beside it: the simulator drops some of it.
            let _ = client
                .send(TrafficClass::BestEffort, ECHO, Bytes::from_static(b"be"))
                .await;
            if i == total / 2 {
                client.drop_link().await.unwrap();
            }
        }
        let mut restored = false;
        while got.len() < total as usize {
            match next(&mut client).await {
                Event::Message {
                    msg_id: ECHO_REPLY,
                    class: TrafficClass::Normal,
                    payload,
                    ..
                } => {
                    let text = String::from_utf8(payload.to_vec()).unwrap();
                    got.push(text.rsplit('|').next().unwrap().parse::<u32>().unwrap());
                }
                Event::Connected { outcome, .. } => {
                    restored |= outcome == waygate_protocol::frame::WelcomeOutcome::Restored;
                }
                Event::Error(e) => panic!("{kind}: {e:?}"),
                _ => {}
            }
        }
        assert_eq!(
            got,
            (0..total).collect::<Vec<_>>(),
            "{kind}: exactly once, in order"
        );
        assert!(restored, "{kind}: the session was restored");
        let stats = client.stats();
        assert!(
            stats.sim_retransmitted > 0 && stats.sim_dropped > 0,
            "{kind}: the simulator lost frames: {stats:?}"
        );
        client.close().await;
    }
}

/// SDK issue item 6: pause (the app goes to the background) drops the link and makes no
/// connect attempt; a message sent meanwhile waits; `reconnect_now` resumes the session and
/// the message is answered, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_off_reconnects_until_reconnect_now_resumes() {
    let (edge, _b, _d) = common::demo_edge(|_| {}).await;
    let mut options = tcp_options(&edge, "pausing");
    options.give_up_after = Some(Duration::from_millis(500));
    let mut client = Client::start(options);
    assert!(echo_ok(&mut client).await);
    client.pause().await.unwrap();
    client
        .send(
            TrafficClass::Normal,
            ECHO,
            Bytes::from_static(b"while-paused"),
        )
        .await
        .unwrap();
    // Longer than the give-up deadline: paused, not given up, and no connect attempt.
    let quiet = tokio::time::timeout(Duration::from_millis(1200), async {
        loop {
            match client.next_event().await {
                Some(
                    Event::Connected { .. } | Event::ConnectFailed { .. } | Event::Closed { .. },
                ) => return true,
                Some(_) => {}
                None => return true,
            }
        }
    })
    .await;
    assert!(
        quiet.is_err(),
        "no connect attempt and no give-up while paused"
    );
    assert_eq!(client.state(), ConnectionState::Paused);
    assert_eq!(client.state().as_str(), "paused");
    client.reconnect_now().await.unwrap();
    let mut restored = false;
    loop {
        match next(&mut client).await {
            Event::Connected { outcome, .. } => {
                restored = outcome == waygate_protocol::frame::WelcomeOutcome::Restored;
            }
            Event::Message {
                msg_id: ECHO_REPLY,
                payload,
                ..
            } => {
                assert!(payload.ends_with(b"|while-paused"), "{payload:?}");
                break;
            }
            _ => {}
        }
    }
    assert!(restored);
    assert_eq!(client.state(), ConnectionState::Connected);
    client.close().await;
}

/// The next event within 20 s (the client still running).
async fn next(client: &mut Client) -> Event {
    tokio::time::timeout(Duration::from_secs(20), client.next_event())
        .await
        .expect("an event in time")
        .expect("client running")
}

/// A client whose own runtime stalls past the liveness timeout (1 s) while its message is
/// outstanding finds the edge's answer in its socket when it runs again: it must read it
/// before its timers, not call the live link dead. Before the fix the worker picked the
/// expired timer or the ready socket at random, so about half of these stalls ended the
/// link (`idle_timeout`) and resumed — under a busy host, restore storms of healthy
/// sessions (`scripts/demo-under-load.sh`: 70–190 extra restores in a third of the runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_client_reads_what_arrived_before_calling_the_link_dead() {
    let c = cluster().await;
    let options = {
        let mut o = ClientOptions::new(vec![c.endpoint(TransportKind::Tcp)], token("stall"));
        o.connect = ConnectOptions {
            tls: Some(c.tls.clone()),
            ..ConnectOptions::default()
        };
        o
    };
    // The client on a runtime of its own, on one thread that this test blocks.
    let (stalls, connects, disconnects) = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut client = Client::start(options);
            common::wait_for(&mut client, Duration::from_secs(10), |e| {
                matches!(e, Event::Connected { .. })
            })
            .await;
            let mut disconnects = Vec::new();
            let stalls = 8;
            for i in 0..stalls {
                client
                    .send(TrafficClass::Normal, ECHO, Bytes::from(format!("s{i}")))
                    .await
                    .unwrap();
                // Let the worker write it, then stall the thread past the liveness timeout
                // while the edge acks and answers.
                for _ in 0..10 {
                    tokio::task::yield_now().await;
                }
                std::thread::sleep(Duration::from_millis(1_500));
                // Running again: the reply comes, and no reconnect.
                loop {
                    match tokio::time::timeout(Duration::from_secs(10), client.next_event())
                        .await
                        .expect("an event in time")
                        .expect("client running")
                    {
                        Event::Message {
                            msg_id: ECHO_REPLY, ..
                        } => break,
                        Event::Disconnected { code } => disconnects.push(code),
                        _ => {}
                    }
                }
            }
            (stalls, client.stats().connects, disconnects)
        })
    })
    .join()
    .unwrap();
    assert_eq!(
        (connects, disconnects),
        (1, Vec::new()),
        "{stalls} stalls of a client with its answer waiting in the socket"
    );
}

/// Regression (a channels test hung in a CI rehearsal, every task parked): the SDK's task
/// awaited its writes to the link without a deadline, so a link whose writes stopped
/// completing (a peer that stops reading, a transport whose flow control never reopens)
/// froze the whole client: no liveness timer, no command — a `logout()` or `send()` waited
/// forever. A write now has 5 s; past it the link is dropped (`slow_consumer`) and the
/// client goes on (reconnects, answers its commands).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_never_completes_does_not_freeze_the_client() {
    use tokio::io::AsyncReadExt as _;
    // A fake edge: WELCOMEs every connection, then never reads again.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let mut hello = [0u8; 512];
            let _ = sock.read(&mut hello).await;
            let welcome = new_session_welcome(1, 2);
            let mut out = bytes::BytesMut::new();
            waygate_protocol::codec::StreamCodec::new(65_536)
                .encode(&welcome, &mut out)
                .unwrap();
            let _ = sock.write_all(&out).await;
            held.push(sock);
        }
    });
    let mut client = Client::start(ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, addr)],
        token("writer"),
    ));
    common::wait_for(&mut client, Duration::from_secs(10), |e| {
        matches!(e, Event::Connected { .. })
    })
    .await;
    // Far more than the socket buffers hold: the writes stop completing. (Bounded: before
    // the fix the client stopped taking commands, and these sends waited forever.)
    let sent = tokio::time::timeout(Duration::from_secs(30), async {
        for _ in 0..300 {
            client
                .send(TrafficClass::Normal, ECHO, Bytes::from(vec![7u8; 60_000]))
                .await
                .unwrap();
        }
    })
    .await;
    assert!(
        sent.is_ok(),
        "the client takes commands while its link is stuck"
    );
    let down = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            match client.next_event().await {
                Some(Event::Disconnected { code }) => return Some(code),
                Some(_) => {}
                None => return None,
            }
        }
    })
    .await;
    assert_eq!(
        down,
        Ok(Some(CloseCode::SlowConsumer)),
        "the stuck link was dropped"
    );
    // And the client still answers its commands.
    let logout = tokio::time::timeout(Duration::from_secs(10), client.logout()).await;
    assert!(logout.is_ok(), "logout answered");
}

/// Regression (2026-12-04, second stop, an audit of the client SDK): a message whose frame
/// was above the max frame size was taken (`Ok(seq)`), then closed the link (the edge's
/// CLOSE `frame_too_large`, or the transport refusing the batch) and was resent with every
/// resume: a reconnect loop, and no answer for the message. The SDK refuses it now
/// (`TooLarge`, no seq taken), and the session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_above_the_max_frame_size_is_refused_not_sent() {
    let (edge, _b, _d) = common::demo_edge(|_| {}).await;
    let mut client = Client::start(tcp_options(&edge, "bigmouth"));
    assert!(echo_ok(&mut client).await);
    let huge = Bytes::from(vec![b'x'; 70_000]);
    let refused = client
        .send(TrafficClass::Critical, ECHO, huge.clone())
        .await;
    assert!(
        matches!(
            refused,
            Err(SdkError::Session(ClientError::TooLarge { max: 65_536, .. }))
        ),
        "{refused:?}"
    );
    let refused = client
        .request(TrafficClass::Normal, ECHO, huge, Duration::from_secs(1))
        .await;
    assert!(
        matches!(refused, Err(RequestError::TooLarge { max: 65_536, .. })),
        "{refused:?}"
    );
    // The link was never dropped: what follows is answered, and no reconnect happened.
    assert!(echo_ok(&mut client).await);
    let reconnects = tokio::time::timeout(Duration::from_millis(500), async {
        loop {
            if let Some(Event::Connected { .. }) = client.next_event().await {
                return;
            }
        }
    })
    .await;
    assert!(reconnects.is_err(), "the client reconnected");
}

/// Regression (2026-12-04, second stop, an audit of the client SDK): a session begun over
/// sealed KCP could not resume once its connect token expired. The KCP CONNECT carries the
/// token, the edge refused it there (BUSY `auth_expired`, then BUSY 205 for the plain
/// CONNECT without a token), and the SDK ended each round at that first refusal: TCP,
/// which takes a resume with the resume token alone, was never tried, and the session
/// lingered out. An auth refusal of one endpoint now lets the round go on to the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_kcp_session_resumes_over_tcp_after_its_token_expired() {
    let (edge, _backend, _dir) = common::demo_edge(|c| {
        c.auth.leeway_secs = 0;
        c.kcp.packet_auth = waygate_transport::kcp::config::PacketAuth::Required;
    })
    .await;
    let key: [u8; 32] = rand::random();
    let token = common::connect_token_for_secs("sealed-short", &key, 1);
    let mut options = ClientOptions::new(
        vec![
            Endpoint::new(TransportKind::Kcp, edge.addrs[&TransportKind::Kcp]),
            Endpoint::new(TransportKind::Tcp, edge.addrs[&TransportKind::Tcp]),
        ],
        token,
    );
    options.session_key = Some(key);
    let mut client = Client::start(options);
    async fn connected(client: &mut Client) -> (waygate_protocol::frame::WelcomeOutcome, String) {
        let next = async {
            loop {
                match client.next_event().await.expect("client running") {
                    Event::Connected {
                        outcome, endpoint, ..
                    } => return (outcome, endpoint),
                    Event::Closed { code } => panic!("ended for good: {code}"),
                    _ => {}
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(20), next)
            .await
            .expect("connected within 20 s")
    }
    let (_, first) = connected(&mut client).await;
    assert!(first.starts_with("kcp://"), "{first}");
    assert!(echo_ok(&mut client).await, "first echo");
    // The token runs out while the link is down.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    client.drop_link().await.expect("client running");
    let (outcome, endpoint) = connected(&mut client).await;
    assert_eq!(outcome, waygate_protocol::frame::WelcomeOutcome::Restored);
    assert!(endpoint.starts_with("tcp://"), "{endpoint}");
    assert!(echo_ok(&mut client).await, "the restored session works");
}

/// A client whose only endpoint is a listener that requires sealed KCP: once its token has
/// expired, no CONNECT of its can pass (the token is checked before any resume, PROTOCOL.md
/// §8.2.4), and `set_token` alone cannot help (the sealing key must match the token).
/// `set_credentials` gives a fresh token with its key, and the session resumes over KCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_credentials_resume_a_sealed_kcp_session_after_its_token_expired() {
    let (edge, _backend, _dir) = common::demo_edge(|c| {
        c.auth.leeway_secs = 0;
        c.kcp.packet_auth = waygate_transport::kcp::config::PacketAuth::Required;
    })
    .await;
    let mint = |key: &[u8; 32], lifetime: u64| {
        common::connect_token_for_secs("sealed-renewed", key, lifetime)
    };
    let first_key: [u8; 32] = rand::random();
    let mut options = ClientOptions::new(
        vec![Endpoint::new(
            TransportKind::Kcp,
            edge.addrs[&TransportKind::Kcp],
        )],
        mint(&first_key, 1),
    );
    options.session_key = Some(first_key);
    let mut client = Client::start(options);
    async fn connected(client: &mut Client) -> waygate_protocol::frame::WelcomeOutcome {
        let next = async {
            loop {
                match client.next_event().await.expect("client running") {
                    Event::Connected { outcome, .. } => return outcome,
                    Event::Closed { code } => panic!("ended for good: {code}"),
                    _ => {}
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(20), next)
            .await
            .expect("connected within 20 s")
    }
    connected(&mut client).await;
    assert!(echo_ok(&mut client).await, "first echo");
    // The token runs out; the login service hands out a new one with a new key.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let second_key: [u8; 32] = rand::random();
    client
        .set_credentials(mint(&second_key, 3_600), Some(second_key))
        .await
        .expect("client running");
    client.drop_link().await.expect("client running");
    assert_eq!(
        connected(&mut client).await,
        waygate_protocol::frame::WelcomeOutcome::Restored
    );
    assert!(echo_ok(&mut client).await, "the restored session works");
}

/// Regression (2026-12-04, second stop, an audit of the client SDK): a logout while the
/// handshake was still going was answered `NotConnected` (the session lingers out) but the
/// SDK sent CLOSE `logout` anyway, which an edge whose WELCOME was on its way takes as the
/// end of the session: the caller was told the opposite of what happened. Before the
/// WELCOME it closes with `normal`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logout_before_the_welcome_does_not_log_the_session_out() {
    use tokio::io::AsyncReadExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // A fake edge that reads the HELLO, never answers it, and reports the CLOSE it gets.
    let (hello_tx, hello_rx) = tokio::sync::oneshot::channel();
    let edge = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let codec = waygate_protocol::codec::StreamCodec::new(65536);
        let mut buf = bytes::BytesMut::new();
        let mut hello_tx = Some(hello_tx);
        loop {
            while let Some(frame) = codec.decode(&mut buf).unwrap() {
                match frame {
                    Frame::Hello(_) => {
                        if let Some(tx) = hello_tx.take() {
                            let _ = tx.send(());
                        }
                    }
                    Frame::Close { code, .. } => return Some(code),
                    _ => {}
                }
            }
            if sock.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                return None;
            }
        }
    });
    let client = Client::start(ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, addr)],
        token("early-leaver"),
    ));
    // The HELLO is out: the link is up, no WELCOME yet.
    tokio::time::timeout(Duration::from_secs(5), hello_rx)
        .await
        .expect("a HELLO in time")
        .unwrap();
    assert!(matches!(client.logout().await, Err(SdkError::NotConnected)));
    let code = tokio::time::timeout(Duration::from_secs(5), edge)
        .await
        .expect("the fake edge saw the end")
        .unwrap();
    assert_eq!(code, Some(CloseCode::Normal));
}

/// Regression (2026-12-04, second stop, an audit of the client SDK): DATA from the edge
/// with a seq beyond the window (PROTOCOL.md §7.4.1: a protocol violation) was only logged;
/// the link stayed up and the DATA was lost until some later resume. The client now closes
/// the link with `protocol_error` and resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_seq_beyond_the_window_closes_the_link_and_resumes() {
    use tokio::io::AsyncReadExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // A faulty edge: WELCOME, then DATA seq 10,000; reports the CLOSE code it gets and
    // whether the client came back with a resume.
    let edge = tokio::spawn(async move {
        let codec = waygate_protocol::codec::StreamCodec::new(65536);
        async fn read_frame(
            sock: &mut tokio::net::TcpStream,
            buf: &mut bytes::BytesMut,
        ) -> Option<Frame> {
            let codec = waygate_protocol::codec::StreamCodec::new(65536);
            loop {
                if let Some(frame) = codec.decode(buf).unwrap() {
                    return Some(frame);
                }
                if sock.read_buf(buf).await.unwrap_or(0) == 0 {
                    return None;
                }
            }
        }
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = bytes::BytesMut::new();
        assert!(matches!(
            read_frame(&mut sock, &mut buf).await,
            Some(Frame::Hello(_))
        ));
        let mut out = bytes::BytesMut::new();
        for frame in [
            new_session_welcome(7, 8),
            Frame::Data(waygate_protocol::frame::Data {
                class: TrafficClass::Normal,
                msg_id: 7,
                seq: 10_000,
                ack: None,
                payload: Bytes::from_static(b"far ahead"),
            }),
        ] {
            codec.encode(&frame, &mut out).unwrap();
        }
        sock.write_all(&out).await.unwrap();
        let mut close = None;
        while let Some(frame) = read_frame(&mut sock, &mut buf).await {
            if let Frame::Close { code, .. } = frame {
                close = Some(code);
                break;
            }
        }
        let (mut again, _) = listener.accept().await.unwrap();
        let mut buf = bytes::BytesMut::new();
        let resumed = matches!(
            read_frame(&mut again, &mut buf).await,
            Some(Frame::Hello(h)) if h.resume.is_some()
        );
        (close, resumed)
    });
    let _client = Client::start(ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, addr)],
        token("strict"),
    ));
    let (close, resumed) = tokio::time::timeout(Duration::from_secs(10), edge)
        .await
        .expect("the client closed the link and came back")
        .unwrap();
    assert_eq!(close, Some(CloseCode::ProtocolError));
    assert!(resumed, "the client resumes after closing");
}

/// A call racing the client task's end is answered. Its command could land in the task's
/// channel after the task's receiver had closed and drained it, and the call then waited
/// for a reply for as long as the `Client` lived (seen as a second `logout()` over KCP that
/// never returned, in the channels tests). Many races of `close()` against `logout()` and
/// `pause()`: every call returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_racing_the_client_task_s_end_are_answered() {
    let nowhere = Endpoint::new(TransportKind::Tcp, "127.0.0.1:9".parse().unwrap());
    for _ in 0..2_000 {
        let client = std::sync::Arc::new(Client::start(ClientOptions::new(
            vec![nowhere.clone()],
            token("racer"),
        )));
        let closer = client.clone();
        let close = tokio::spawn(async move { closer.close().await });
        let (logout, pause) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(5), client.logout()),
            tokio::time::timeout(Duration::from_secs(5), client.pause()),
        );
        assert!(logout.is_ok(), "a logout racing the end was never answered");
        assert!(pause.is_ok(), "a pause racing the end was never answered");
        close.await.unwrap();
    }
}

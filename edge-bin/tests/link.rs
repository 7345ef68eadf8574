//! The backend link end to end over loopback: edge-side `LinkClient` against the backend
//! library.

#![allow(clippy::unwrap_used)]

mod common;
#[path = "support_redis/mod.rs"]
mod support_redis;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;
use waygate_backend::demo::{
    DemoService, CHANNEL_JOIN, ECHO, ECHO_REPLY, JOIN_ROOM, ROOM_EVENT, ROOM_SAY, WHISPER,
};
use waygate_backend::{
    Backend, BackendConfig, BackendError, BackendSession, Incoming, PinKind, PinOutcome, Refusal,
    Service,
};
use waygate_edge::link::{
    AnswerEnd, ForwardError, LinkClient, LinkConfig, LinkEvent, LinkRefusal, SessionMeta,
};
use waygate_protocol::link::{
    LinkFrame, LINK_FEATURE_FORWARD_DONE, LINK_FEATURE_HELD_ANSWERS, LINK_FEATURE_PIN_RESULT,
    LINK_VERSION,
};
use waygate_session::driver::Delivered;
use waygate_transport::{CloseCode, TrafficClass};

fn meta(handle: u64, player: &str) -> std::sync::Arc<SessionMeta> {
    std::sync::Arc::new(SessionMeta {
        handle,
        session_id: [handle as u8; 16],
        player_id: player.into(),
        fencing: 1,
        attrs: std::sync::Arc::new([("transport".into(), "tcp".into())]),
    })
}

fn fast_config() -> LinkConfig {
    LinkConfig {
        edge_id: "edge-test".into(),
        heartbeat: Duration::from_millis(200),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..LinkConfig::default()
    }
}

async fn next_event(rx: &mut mpsc::Receiver<LinkEvent>) -> LinkEvent {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("event in time")
        .expect("events open")
}

async fn wait_up(rx: &mut mpsc::Receiver<LinkEvent>) -> String {
    loop {
        if let LinkEvent::Up { instance_id, .. } = next_event(rx).await {
            return instance_id;
        }
    }
}

/// The first push an event carries to the session: a PUSH, or the pushes held for an
/// answer (ANSWER_PUSH, which the backend SDK sends from a handler): (handle, msg id, body).
fn first_push(event: &LinkEvent) -> Option<(u64, u32, Bytes)> {
    match event {
        LinkEvent::Backend(LinkFrame::Push {
            handle,
            msg_id,
            payload,
            ..
        }) => Some((*handle, *msg_id, payload.clone())),
        LinkEvent::Answer { handle, pushes, .. } => pushes
            .first()
            .map(|p| (*handle, p.msg_id, p.payload.clone())),
        _ => None,
    }
}

/// A normal ECHO of `session` (epoch 1) with `client_seq`, which the link must take.
fn forward_echo(link: &LinkClient, session: &Arc<SessionMeta>, client_seq: u64, payload: Bytes) {
    link.forward(session, ECHO, 1, client_seq, TrafficClass::Normal, payload)
        .unwrap();
}

/// A backend running `service` and an edge link to it, up.
async fn linked(service: Arc<dyn Service>) -> (Backend, LinkClient, mpsc::Receiver<LinkEvent>) {
    linked_with(BackendConfig::new("b1"), service).await
}

/// As [`linked`], with the backend's settings.
async fn linked_with(
    config: BackendConfig,
    service: Arc<dyn Service>,
) -> (Backend, LinkClient, mpsc::Receiver<LinkEvent>) {
    let backend = Backend::bind("127.0.0.1:0".parse().unwrap(), config, service)
        .await
        .unwrap();
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(
        backend.local_addr(),
        fast_config(),
        Arc::new(AtomicU64::new(1)),
        tx,
    );
    wait_up(&mut rx).await;
    (backend, link, rx)
}

async fn demo_backend(addr: SocketAddr, id: &str) -> Backend {
    Backend::bind(addr, BackendConfig::new(id), Arc::new(DemoService::new()))
        .await
        .unwrap()
}

#[tokio::test]
async fn echo_over_the_link_and_reconnect_reopens_sessions() {
    let backend = demo_backend("127.0.0.1:0".parse().unwrap(), "b1").await;
    let addr = backend.local_addr();
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    assert_eq!(wait_up(&mut rx).await, "b1");

    let m = meta(7, "alice");
    forward_echo(&link, &m, 1, Bytes::from_static(b"hi"));
    let event = next_event(&mut rx).await;
    match first_push(&event) {
        Some((handle, msg_id, payload)) => {
            assert_eq!((handle, msg_id), (7, ECHO_REPLY));
            assert_eq!(&payload[..], b"b1|alice|hi");
        }
        None => panic!("unexpected {event:?}"),
    }

    // The backend dies: the link goes down and forwards fail fast with Unavailable.
    drop(backend);
    loop {
        if let LinkEvent::Down { .. } = next_event(&mut rx).await {
            break;
        }
    }
    assert_eq!(
        link.forward(&m, ECHO, 1, 2, TrafficClass::Normal, Bytes::new()),
        Err(ForwardError::Unavailable)
    );

    // It comes back on the same address: the link reconnects and re-opens the session, so a
    // forward without a new open reaches it.
    let backend = demo_backend(addr, "b1").await;
    assert_eq!(wait_up(&mut rx).await, "b1");
    forward_echo(&link, &m, 3, Bytes::from_static(b"again"));
    let event = next_event(&mut rx).await;
    match first_push(&event) {
        Some((_, _, payload)) => assert_eq!(&payload[..], b"b1|alice|again"),
        None => panic!("unexpected {event:?}"),
    }
    drop(backend);
}

#[tokio::test]
async fn stale_epoch_is_refused_with_the_backend_epoch() {
    let backend = demo_backend("127.0.0.1:0".parse().unwrap(), "b1").await;
    backend.set_epoch(5);
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(
        backend.local_addr(),
        fast_config(),
        Arc::new(AtomicU64::new(4)),
        tx,
    );
    wait_up(&mut rx).await;
    link.forward(
        &meta(1, "bob"),
        ECHO,
        4,
        1,
        TrafficClass::Critical,
        Bytes::new(),
    )
    .unwrap();
    match next_event(&mut rx).await {
        LinkEvent::Refuse {
            refusal:
                LinkRefusal {
                    code,
                    epoch,
                    msg_id,
                    client_seq,
                    ..
                },
            ..
        } => {
            assert_eq!(
                (code, epoch, msg_id, client_seq),
                (CloseCode::StaleEpoch, 5, ECHO, 1)
            );
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// A service that never finishes handling a message until released.
struct Stuck(tokio::sync::Semaphore);

#[async_trait]
impl Service for Stuck {
    async fn message(&self, _s: &BackendSession, _m: Incoming) -> Result<(), Refusal> {
        let _ = self.0.acquire().await;
        Ok(())
    }
}

#[tokio::test]
async fn a_backend_that_stops_handling_runs_out_of_credit_and_the_edge_answers_busy() {
    let mut config = BackendConfig::new("slow");
    config.forward_credits = 8;
    let (_backend, link, _rx) =
        linked_with(config, Arc::new(Stuck(tokio::sync::Semaphore::new(0)))).await;
    let m = meta(3, "carol");
    let mut sent = 0;
    let mut busy = 0;
    for seq in 1..=100 {
        match link.forward(
            &m,
            1,
            0,
            seq,
            TrafficClass::Normal,
            Bytes::from_static(b"x"),
        ) {
            Ok(_) => sent += 1,
            Err(ForwardError::Busy { retry_after_ms }) => {
                assert!(retry_after_ms > 0);
                busy += 1;
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    assert_eq!(sent, 8, "exactly the granted credit is used");
    assert_eq!(busy, 92);
    assert_eq!(link.credit(), 0);
}

#[tokio::test]
async fn messages_in_flight_when_a_backend_dies_come_back_as_unavailable() {
    let (backend, link, mut rx) = linked_with(
        BackendConfig::new("doomed"),
        Arc::new(Stuck(tokio::sync::Semaphore::new(0))),
    )
    .await;
    let m = meta(9, "dave");
    for seq in 1..=5 {
        link.forward(
            &m,
            1,
            0,
            seq,
            TrafficClass::Normal,
            Bytes::from(vec![seq as u8]),
        )
        .unwrap();
    }
    drop(backend);
    let mut lost = Vec::new();
    while lost.len() < 5 {
        if let LinkEvent::Refuse {
            refusal: LinkRefusal {
                code, client_seq, ..
            },
            message,
        } = next_event(&mut rx).await
        {
            assert_eq!(code, CloseCode::Unavailable);
            assert_eq!(message.unwrap().payload[0], client_seq as u8);
            lost.push(client_seq);
        }
    }
    assert_eq!(
        lost,
        vec![1, 2, 3, 4, 5],
        "every in-flight message is reported, in order"
    );
}

/// Found by the benchmarks: a backend granting more FORWARD credit than its reader queue
/// while waiting for PUSH credit used to deadlock (the edge's CREDIT frame stuck behind
/// FORWARDs nobody read). The reader now applies CREDIT itself and holds a full credit's
/// worth of FORWARDs, so every reply arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_forward_credit_and_small_push_credit_do_not_deadlock() {
    let mut config = BackendConfig::new("b1");
    config.forward_credits = 4096;
    // One session with thousands in flight: no per-session bound here.
    config.session_queue = u32::MAX;
    let backend = Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        config,
        Arc::new(DemoService::new()),
    )
    .await
    .unwrap();
    let (tx, mut rx) = mpsc::channel(8192);
    let link_config = LinkConfig {
        push_credits: 16,
        ..fast_config()
    };
    let (link, _task) = LinkClient::spawn(
        backend.local_addr(),
        link_config,
        Arc::new(AtomicU64::new(1)),
        tx,
    );
    wait_up(&mut rx).await;
    let m = meta(5, "many");
    let total = 3000u64;
    let mut sent = 0u64;
    let mut replies = 0u64;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while replies < total {
        assert!(
            tokio::time::Instant::now() < deadline,
            "stalled: {replies}/{total} replies, {sent} sent"
        );
        while sent < total {
            match link.forward(
                &m,
                ECHO,
                1,
                sent + 1,
                TrafficClass::Normal,
                Bytes::from_static(b"q"),
            ) {
                Ok(_) => sent += 1,
                Err(ForwardError::Busy { .. }) => break,
                Err(e) => panic!("{e:?}"),
            }
        }
        match tokio::time::timeout(Duration::from_millis(50), rx.recv()).await {
            Ok(Some(e)) if first_push(&e).is_some_and(|p| p.1 == ECHO_REPLY) => replies += 1,
            Ok(Some(LinkEvent::Refuse { refusal, .. })) => panic!("refused: {}", refusal.code),
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => panic!("events closed"),
        }
    }
}

/// The backend SDK counts its load (what `waygate backend --etcd` reports): sessions open
/// over the link and messages handled; a closed link takes its sessions off.
/// Regression (2026-12-05): the demo's room instance ended a session's room membership
/// whenever an edge told it the session closed there, also an edge the session had left: a
/// session that resumed on another edge and spoke there again (as PROTOCOL.md §11.4 asks)
/// lost its membership when the old edge's close came in later, and got no more ROOM_EVENTs.
/// Now only the close of the opening that is the member ends it.
#[tokio::test]
async fn a_room_member_that_moved_edges_stays_one_when_its_old_edge_closes_it() {
    let demo = Arc::new(DemoService::new());
    let backend = Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::new("r1"),
        demo.clone(),
    )
    .await
    .unwrap();
    let edge = |id: &str| {
        let (tx, rx) = mpsc::channel(64);
        let config = LinkConfig {
            edge_id: id.into(),
            ..fast_config()
        };
        let (link, _task) = LinkClient::spawn(
            backend.local_addr(),
            config,
            Arc::new(AtomicU64::new(1)),
            tx,
        );
        (link, rx)
    };
    let (a, mut a_rx) = edge("edge-a");
    let (b, mut b_rx) = edge("edge-b");
    wait_up(&mut a_rx).await;
    wait_up(&mut b_rx).await;
    let say = |link: &LinkClient, m: &Arc<SessionMeta>, seq: u64, text: &'static str| {
        link.forward(
            m,
            ROOM_SAY,
            1,
            seq,
            TrafficClass::Normal,
            Bytes::from_static(text.as_bytes()),
        )
        .unwrap();
    };
    // The ROOM_EVENT that reaches `handle` on a link, with `text` in it.
    async fn event_for(rx: &mut mpsc::Receiver<LinkEvent>, handle: u64, text: &str) {
        loop {
            let event = next_event(rx).await;
            if let Some((h, ROOM_EVENT, body)) = first_push(&event) {
                if h == handle && String::from_utf8_lossy(&body).ends_with(text) {
                    return;
                }
            }
        }
    }
    // ann speaks in the lobby through edge a, then resumes on edge b and speaks there.
    let ann = meta(1, "ann");
    say(&a, &ann, 1, "lobby|hi");
    event_for(&mut a_rx, 1, "|ann|hi").await;
    say(&b, &ann, 2, "lobby|back");
    event_for(&mut b_rx, 1, "|ann|back").await;
    assert_eq!(demo.room_members("lobby"), 1);
    // Edge a learns the session left and closes its copy.
    a.session_event(LinkFrame::SessionClose {
        handle: 1,
        code: CloseCode::GoingAway,
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while backend.load().sessions() != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the close was not taken"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its handler runs on the session's worker right after: give it time to.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        demo.room_members("lobby"),
        1,
        "ann is still a member through edge b"
    );
    // bob speaks in the lobby: ann hears it on edge b.
    let bob = meta(2, "bob");
    say(&b, &bob, 1, "lobby|yo");
    event_for(&mut b_rx, 1, "|bob|yo").await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn the_backend_counts_its_sessions_and_messages() {
    let backend = demo_backend("127.0.0.1:0".parse().unwrap(), "b1").await;
    let (tx, mut rx) = mpsc::channel(64);
    let (link, task) = LinkClient::spawn(
        backend.local_addr(),
        fast_config(),
        Arc::new(AtomicU64::new(1)),
        tx,
    );
    wait_up(&mut rx).await;
    for (handle, player) in [(1, "ann"), (2, "ben")] {
        let m = meta(handle, player);
        forward_echo(&link, &m, 1, Bytes::from_static(b"x"));
        let _ = next_event(&mut rx).await; // the echo with its FORWARD_DONE
    }
    assert_eq!(backend.load().sessions(), 2);
    assert_eq!(backend.load().messages(), 2);
    task.abort();
    drop(link);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while backend.load().sessions() != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "sessions outlived their link"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ----- link secret (PROTOCOL.md §9.3) -------------------------------------------------

fn secret(s: &str) -> Option<Arc<[u8]>> {
    Some(s.as_bytes().into())
}

async fn backend_with_secret(s: Option<Arc<[u8]>>) -> Backend {
    let mut config = BackendConfig::new("b1");
    config.link_secret = s;
    Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        config,
        Arc::new(DemoService::new()),
    )
    .await
    .unwrap()
}

/// Whether a link from an edge holding `edge_secret` comes up and carries an ECHO.
async fn link_works(edge_secret: Option<Arc<[u8]>>, backend: &Backend) -> bool {
    let (tx, mut rx) = mpsc::channel(64);
    let config = LinkConfig {
        secret: edge_secret,
        ..fast_config()
    };
    let (link, task) = LinkClient::spawn(
        backend.local_addr(),
        config,
        Arc::new(AtomicU64::new(1)),
        tx,
    );
    let up = tokio::time::timeout(Duration::from_millis(1500), async {
        loop {
            match rx.recv().await {
                Some(LinkEvent::Up { .. }) => return true,
                Some(_) => {}
                None => return false,
            }
        }
    })
    .await
    .unwrap_or(false);
    let echoed = up
        && link
            .forward(
                &meta(1, "alice"),
                ECHO,
                1,
                1,
                TrafficClass::Normal,
                Bytes::from_static(b"hi"),
            )
            .is_ok()
        && first_push(&next_event(&mut rx).await).is_some_and(|p| p.1 == ECHO_REPLY);
    task.abort();
    echoed
}

#[tokio::test]
async fn links_come_up_only_when_both_ends_hold_the_same_secret() {
    let shared = "a shared link secret";
    let b = backend_with_secret(secret(shared)).await;
    assert!(link_works(secret(shared), &b).await, "same secret");
    assert!(
        !link_works(secret("another link secret"), &b).await,
        "wrong secret"
    );
    assert!(!link_works(None, &b).await, "edge without the secret");
    let open = backend_with_secret(None).await;
    assert!(
        !link_works(secret(shared), &open).await,
        "backend without the secret"
    );
    assert!(link_works(None, &open).await, "neither (loopback demo)");
}

/// Something that connects to a backend and does not prove the secret never reaches the
/// game: SESSION_OPEN and FORWARD without LINK_AUTH, or with a wrong proof, are answered
/// LINK_CLOSE and nothing is handled.
#[tokio::test]
async fn an_impostor_edge_is_closed_before_anything_reaches_the_game() {
    let b = backend_with_secret(secret("a shared link secret")).await;
    for auth in [None, Some([7u8; 32])] {
        let mut io = raw_edge_link(b.local_addr(), "mallory").await;
        let welcome = next_frame(&mut io.rx).await;
        assert!(
            matches!(welcome, Some(LinkFrame::Welcome { auth: Some(_), .. })),
            "{welcome:?}"
        );
        if let Some(proof) = auth {
            io.tx.send(LinkFrame::Auth { proof }).await.unwrap();
        }
        let m = meta(5, "victim");
        open_session(&io.tx, &m).await;
        forward_raw_echo(&io.tx, 5, 1, Bytes::from_static(b"steal")).await;
        let want = if auth.is_some() {
            CloseCode::AuthBadSignature
        } else {
            CloseCode::AuthRejected
        };
        loop {
            match next_frame(&mut io.rx).await {
                Some(LinkFrame::Close { code, .. }) => {
                    assert_eq!(code, want);
                    break;
                }
                Some(LinkFrame::Push { .. }) => panic!("the impostor's message was handled"),
                Some(_) => {}
                None => break,
            }
        }
    }
    assert_eq!(b.load().sessions(), 0);
    assert_eq!(b.load().messages(), 0);
}

/// A hand-made backend end of a link: takes one edge's connection on `listener`, reads its
/// LINK_HELLO (returned) and answers LINK_WELCOME with `features`, without a secret.
async fn raw_backend_link(
    listener: &tokio::net::TcpListener,
    instance_id: &str,
    features: u64,
) -> (Option<LinkFrame>, waygate_link::LinkIo) {
    raw_backend_link_with_credits(listener, instance_id, features, 16).await
}

/// [`raw_backend_link`] granting `credits` FORWARD credits.
async fn raw_backend_link_with_credits(
    listener: &tokio::net::TcpListener,
    instance_id: &str,
    features: u64,
    credits: u32,
) -> (Option<LinkFrame>, waygate_link::LinkIo) {
    let (stream, _) = listener.accept().await.unwrap();
    let mut io = waygate_link::spawn_link_io(
        stream,
        1 << 20,
        Duration::from_secs(5),
        waygate_link::LinkIoOptions::default(),
    );
    let hello = next_frame(&mut io.rx).await;
    io.tx
        .send(LinkFrame::Welcome {
            version: LINK_VERSION,
            instance_id: instance_id.into(),
            credits,
            heartbeat_ms: 5000,
            auth: None,
            features,
        })
        .await
        .unwrap();
    (hello, io)
}

/// A hand-made edge end of a link to `backend`, LINK_HELLO sent (with a nonce, no
/// features: an edge that predates them).
async fn raw_edge_link(backend: SocketAddr, edge_id: &str) -> waygate_link::LinkIo {
    let stream = tokio::net::TcpStream::connect(backend).await.unwrap();
    let io = waygate_link::spawn_link_io(
        stream,
        1 << 20,
        Duration::from_secs(5),
        waygate_link::LinkIoOptions::default(),
    );
    io.tx
        .send(LinkFrame::Hello {
            version: LINK_VERSION,
            edge_id: edge_id.into(),
            epoch: 1,
            nonce: Some([1; 16]),
            features: 0,
        })
        .await
        .unwrap();
    io
}

/// A hand-made edge opens `m`'s session on its link (fencing 1, no attributes).
async fn open_session(tx: &mpsc::Sender<LinkFrame>, m: &SessionMeta) {
    tx.send(LinkFrame::SessionOpen {
        handle: m.handle,
        session_id: m.session_id,
        player_id: m.player_id.clone(),
        fencing: 1,
        attrs: Vec::new(),
    })
    .await
    .unwrap();
}

/// A hand-made edge forwards a normal ECHO of session `handle` (epoch 1).
async fn forward_raw_echo(
    tx: &mpsc::Sender<LinkFrame>,
    handle: u64,
    client_seq: u64,
    payload: Bytes,
) {
    tx.send(LinkFrame::Forward {
        handle,
        msg_id: ECHO,
        epoch: 1,
        client_seq,
        class: TrafficClass::Normal,
        payload,
    })
    .await
    .unwrap();
}

/// A hand-made backend waits for the edge's first FORWARD; false when the link ended first.
async fn until_forward(rx: &mut mpsc::Receiver<LinkFrame>) -> bool {
    loop {
        match next_frame(rx).await {
            Some(LinkFrame::Forward { .. }) => return true,
            Some(_) => continue,
            None => return false,
        }
    }
}

async fn next_frame(rx: &mut mpsc::Receiver<LinkFrame>) -> Option<LinkFrame> {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a frame or the end in time")
}

#[tokio::test]
async fn a_backend_beyond_loopback_needs_a_link_secret() {
    // Refused before binding anything.
    let err = Backend::bind(
        "0.0.0.0:0".parse().unwrap(),
        BackendConfig::new("b1"),
        Arc::new(DemoService::new()),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("link secret"), "{err}");
    assert!(err.contains("WAYGATE_LINK_SECRET"), "{err}");
}

/// PROTOCOL.md §9.6: a backend that answers says FORWARD_DONE after the pushes its handler
/// sent; the edge waits for it before the client's ack. A forward it answered is not
/// refused when the link dies before the backend returned its credit (it was processed);
/// best-effort forwards are never awaited.
#[tokio::test]
async fn a_processed_forward_is_answered_after_its_pushes_and_not_refused_when_the_link_dies() {
    let (backend, link, mut rx) = linked(Arc::new(DemoService::new())).await;
    let m = meta(9, "carol");
    let delivered = link
        .forward(
            &m,
            ECHO,
            1,
            1,
            TrafficClass::Normal,
            Bytes::from_static(b"a"),
        )
        .unwrap();
    assert_eq!(delivered, Delivered::AwaitingAnswer);
    // The handler's push comes with its answer, held by the edge until then (ANSWER_PUSH).
    match next_event(&mut rx).await {
        LinkEvent::Answer {
            handle: 9,
            pushes,
            end: AnswerEnd::Done(1),
        } => assert_eq!(pushes.len(), 1),
        other => panic!("expected the answer with its push, got {other:?}"),
    }
    let best_effort = link
        .forward(&m, ECHO, 1, 0, TrafficClass::BestEffort, Bytes::new())
        .unwrap();
    assert_eq!(best_effort, Delivered::Answered);
    assert!(matches!(
        next_event(&mut rx).await,
        LinkEvent::Backend(LinkFrame::Push { handle: 9, .. })
    ));
    // Two forwards are far below the backend's credit return (a quarter of its 1,024): both are
    // still held when the backend dies. Only the unanswered one comes back refused.
    drop(backend);
    let mut refused = Vec::new();
    loop {
        match next_event(&mut rx).await {
            LinkEvent::Down { .. } => break,
            LinkEvent::Refuse { refusal, .. } => refused.push(refusal.client_seq),
            _ => {}
        }
    }
    assert_eq!(refused, vec![0], "only the best-effort forward is refused");
}

/// Links with a backend or an edge that predates FORWARD_DONE still work: the edge then
/// acknowledges at forward time, and the backend sends no FORWARD_DONE to an edge that did
/// not ask for it.
#[tokio::test]
async fn forward_done_is_used_only_when_both_ends_have_it() {
    // An older backend: LINK_WELCOME without features.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let old_backend = tokio::spawn(async move {
        let (hello, mut io) = raw_backend_link(&listener, "old", 0).await;
        assert!(
            matches!(
                hello,
                Some(LinkFrame::Hello { features, .. })
                    if features == LINK_FEATURE_FORWARD_DONE
                        | LINK_FEATURE_HELD_ANSWERS
                        | LINK_FEATURE_PIN_RESULT
            ),
            "{hello:?}"
        );
        // Keep the link open until the edge side is done.
        while next_frame(&mut io.rx).await.is_some() {}
    });
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    wait_up(&mut rx).await;
    let delivered = link
        .forward(
            &meta(3, "dave"),
            ECHO,
            1,
            1,
            TrafficClass::Normal,
            Bytes::new(),
        )
        .unwrap();
    assert_eq!(delivered, Delivered::Answered);
    link.shutdown().await;
    let _ = tokio::time::timeout(Duration::from_secs(10), old_backend).await;

    // An older edge: LINK_HELLO without features gets no FORWARD_DONE. Two echoes come
    // back as two pushes with nothing between them.
    let backend = demo_backend("127.0.0.1:0".parse().unwrap(), "b1").await;
    let mut io = raw_edge_link(backend.local_addr(), "old-edge").await;
    assert!(matches!(
        next_frame(&mut io.rx).await,
        Some(LinkFrame::Welcome { features: 0, .. })
    ));
    io.tx.send(LinkFrame::Credit { credits: 16 }).await.unwrap();
    let m = meta(4, "erin");
    open_session(&io.tx, &m).await;
    for client_seq in 1..=2 {
        forward_raw_echo(&io.tx, 4, client_seq, Bytes::new()).await;
    }
    for _ in 0..2 {
        let frame = next_frame(&mut io.rx).await;
        assert!(
            matches!(frame, Some(LinkFrame::Push { handle: 4, .. })),
            "{frame:?}"
        );
    }
    drop(backend);
}

/// A backend's FORWARD_DONE counts only for a forward its link holds unanswered: one for a
/// message never sent on it (another backend's, or a second answer) is ignored, so the
/// client is never told to forget a message whose reply is not on the edge.
#[tokio::test]
async fn a_forward_done_for_a_message_the_link_does_not_hold_is_ignored() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let rogue = tokio::spawn(async move {
        let (_hello, mut io) =
            raw_backend_link(&listener, "rogue", LINK_FEATURE_FORWARD_DONE).await;
        // Wait for the edge's one FORWARD (client seq 1), then answer seq 2 (never sent),
        // seq 1, seq 1 again, and push once: only the first answer of seq 1 may count.
        if !until_forward(&mut io.rx).await {
            return;
        }
        for client_seq in [2, 1, 1] {
            io.tx
                .send(LinkFrame::ForwardDone {
                    handle: 6,
                    client_seq,
                })
                .await
                .unwrap();
        }
        io.tx
            .send(LinkFrame::Push {
                handle: 6,
                msg_id: ECHO_REPLY,
                class: TrafficClass::Normal,
                payload: Bytes::new(),
            })
            .await
            .unwrap();
        while next_frame(&mut io.rx).await.is_some() {}
    });
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    wait_up(&mut rx).await;
    let delivered = link
        .forward(
            &meta(6, "frank"),
            ECHO,
            1,
            1,
            TrafficClass::Normal,
            Bytes::new(),
        )
        .unwrap();
    assert_eq!(delivered, Delivered::AwaitingAnswer);
    let mut seen = Vec::new();
    loop {
        match next_event(&mut rx).await {
            LinkEvent::Backend(LinkFrame::ForwardDone { client_seq, .. }) => seen.push(client_seq),
            LinkEvent::Backend(LinkFrame::Push { .. }) => break,
            _ => {}
        }
    }
    assert_eq!(seen, vec![1], "only the held forward's first answer counts");
    link.shutdown().await;
    let _ = tokio::time::timeout(Duration::from_secs(10), rogue).await;
}

/// A backend's ANSWER_PUSH `reply` for (`handle`, client seq 1), then the CREDIT that
/// covers the message, without its FORWARD_DONE.
async fn answer_push_then_credit(tx: &mpsc::Sender<LinkFrame>, handle: u64) {
    tx.send(LinkFrame::AnswerPush {
        handle,
        client_seq: 1,
        msg_id: ECHO_REPLY,
        class: TrafficClass::Normal,
        payload: Bytes::from_static(b"reply"),
    })
    .await
    .unwrap();
    tx.send(LinkFrame::Credit { credits: 1 }).await.unwrap();
}

/// Regression (2026-12-04, second stop): a CREDIT covering a message before its answer
/// (against §9.6's order) dropped the pushes held for it with a warning and left the
/// message unacknowledged for good: the client never saw its reply nor an error. The link
/// now closes with `protocol_error`, and the message is answered like on any link loss:
/// its held pushes, then `unavailable`.
#[tokio::test]
async fn a_credit_before_the_answer_closes_the_link_and_loses_nothing() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let rogue = tokio::spawn(async move {
        let features = LINK_FEATURE_FORWARD_DONE | LINK_FEATURE_HELD_ANSWERS;
        let (_hello, mut io) = raw_backend_link(&listener, "rogue", features).await;
        if !until_forward(&mut io.rx).await {
            return None;
        }
        answer_push_then_credit(&io.tx, 7).await;
        // The edge closes the link (its LINK_CLOSE ends the reader, which keeps it).
        while next_frame(&mut io.rx).await.is_some() {}
        Some(())
    });
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    wait_up(&mut rx).await;
    forward_echo(&link, &meta(7, "gina"), 1, Bytes::new());
    let answered = loop {
        match next_event(&mut rx).await {
            LinkEvent::Answer {
                handle: 7,
                pushes,
                end: AnswerEnd::Refused(refusal),
            } => break (pushes, refusal),
            LinkEvent::Refuse { refusal, .. } => panic!("refused without its push: {refusal:?}"),
            _ => {}
        }
    };
    let (pushes, refusal) = answered;
    assert_eq!(pushes.len(), 1);
    assert_eq!(pushes[0].payload, Bytes::from_static(b"reply"));
    assert_eq!(
        (refusal.client_seq, refusal.code),
        (1, CloseCode::Unavailable)
    );
    let closed = tokio::time::timeout(Duration::from_secs(10), rogue)
        .await
        .expect("the edge closed the rogue backend's link")
        .unwrap();
    assert_eq!(closed, Some(()), "the link closed after the credit");
    link.shutdown().await;
}

/// What a hand-made backend does on its end of the link (borrowed: the link lives as long
/// as the whole `LinkIo`, which a future capturing only its fields would drop).
type BackendScript =
    Box<dyn for<'a> FnOnce(&'a mut waygate_link::LinkIo) -> BoxFuture<'a, ()> + Send>;
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// A hand-made backend (LINK_WELCOME `features`) on a fresh listener, and an edge's link to
/// it that forwards session 7 ("gina") one ECHO (client seq 1): `script` runs on the
/// backend's end once that FORWARD arrived. The edge's link, its events, and the backend's
/// task (false when the link ended before the FORWARD).
async fn edge_and_scripted_backend(
    features: u64,
    script: BackendScript,
) -> (
    LinkClient,
    mpsc::Receiver<LinkEvent>,
    tokio::task::JoinHandle<bool>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let backend = tokio::spawn(async move {
        let (_hello, mut io) = raw_backend_link(&listener, "scripted", features).await;
        if !until_forward(&mut io.rx).await {
            return false;
        }
        script(&mut io).await;
        true
    });
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    wait_up(&mut rx).await;
    forward_echo(&link, &meta(7, "gina"), 1, Bytes::new());
    (link, rx, backend)
}

/// Regression (2026-12-05, a review of PROTOCOL.md against the code): the edge took a
/// backend's PUSH of any msg id, so a backend written from the document could push
/// `0xFFFFFF01` and its clients would read a channel event the edge never made (only the
/// Rust SDK refused it before sending). Now such a PUSH is an invalid frame: the edge closes
/// the link and nothing of it reaches a session; a push of the answer id (0xFFFFFF02) and
/// of ordinary ids before it still arrive.
#[tokio::test]
async fn a_backend_cannot_push_the_edges_reserved_msg_ids() {
    use waygate_protocol::channel::CHANNEL_EVENT_MSG_ID;
    use waygate_protocol::request::ANSWER_MSG_ID;
    let (link, mut rx, rogue) = edge_and_scripted_backend(
        0,
        Box::new(|io| {
            Box::pin(async move {
                for (msg_id, body) in [
                    (ECHO_REPLY, &b"before"[..]),
                    (ANSWER_MSG_ID, b"an answer"),
                    (CHANNEL_EVENT_MSG_ID, b"a forged channel event"),
                    (ECHO_REPLY, b"after"),
                ] {
                    let push = LinkFrame::Push {
                        handle: 7,
                        msg_id,
                        class: TrafficClass::Normal,
                        payload: Bytes::from_static(body),
                    };
                    if io.tx.send(push).await.is_err() {
                        break;
                    }
                }
                // The edge closes the link (its LINK_CLOSE ends the reader).
                while next_frame(&mut io.rx).await.is_some() {}
            })
        }),
    )
    .await;
    let mut pushed = Vec::new();
    loop {
        let event = next_event(&mut rx).await;
        if matches!(event, LinkEvent::Down { .. }) {
            break;
        }
        if let Some((7, msg_id, body)) = first_push(&event) {
            pushed.push((msg_id, body));
        }
    }
    assert_eq!(
        pushed,
        vec![
            (ECHO_REPLY, Bytes::from_static(b"before")),
            (ANSWER_MSG_ID, Bytes::from_static(b"an answer")),
        ],
        "the pushes before the forged one, and nothing after it"
    );
    tokio::time::timeout(Duration::from_secs(10), rogue)
        .await
        .expect("the edge closed the rogue backend's link")
        .unwrap();
    link.shutdown().await;
}

/// When a session's binding moves, the edge closes it on the old instance's link
/// (SESSION_CLOSE `going_away`) while that instance may still be handling one of its
/// messages, which it finishes (§9.5): the reply (ANSWER_PUSH) crossing the close is
/// delivered with the answer, never dropped while the FORWARD_DONE acknowledges the
/// message (2026-12-05: a rule dropping frames for handles a link had closed did that; it
/// was withdrawn).
#[tokio::test]
async fn a_reply_crossing_the_sessions_close_on_its_link_is_delivered() {
    let features = LINK_FEATURE_FORWARD_DONE | LINK_FEATURE_HELD_ANSWERS;
    let (link, mut rx, rogue) = edge_and_scripted_backend(
        features,
        Box::new(|io| {
            Box::pin(async move {
                // The close crosses the handler's work: its reply and answer come after it.
                loop {
                    match next_frame(&mut io.rx).await {
                        Some(LinkFrame::SessionClose { handle: 7, .. }) => break,
                        Some(_) => continue,
                        None => return,
                    }
                }
                let reply = LinkFrame::AnswerPush {
                    handle: 7,
                    client_seq: 1,
                    msg_id: ECHO_REPLY,
                    class: TrafficClass::Normal,
                    payload: Bytes::from_static(b"reply"),
                };
                let done = LinkFrame::ForwardDone {
                    handle: 7,
                    client_seq: 1,
                };
                for frame in [reply, done] {
                    if io.tx.send(frame).await.is_err() {
                        return;
                    }
                }
                while next_frame(&mut io.rx).await.is_some() {}
            })
        }),
    )
    .await;
    link.session_event(LinkFrame::SessionClose {
        handle: 7,
        code: CloseCode::GoingAway,
    })
    .await;
    let answered = loop {
        match next_event(&mut rx).await {
            LinkEvent::Answer {
                handle: 7,
                pushes,
                end,
            } => break (pushes, end),
            LinkEvent::Backend(LinkFrame::ForwardDone { .. }) => {
                panic!("acknowledged without its reply")
            }
            LinkEvent::Down { .. } => panic!("the link went down"),
            _ => {}
        }
    };
    assert_eq!(answered.0.len(), 1);
    assert_eq!(answered.0[0].payload, Bytes::from_static(b"reply"));
    assert!(matches!(answered.1, AnswerEnd::Done(1)));
    link.shutdown().await;
    rogue.abort();
}

/// Regression (2026-12-05, the same audit): the edge held a message's ANSWER_PUSH frames up
/// to 64 KiB of payload, so empty ones (a few bytes on the wire each) piled up without
/// bound until the answer. Each held push now counts 128 bytes besides its payload: 1,100
/// empty pushes are released 513 at a time, before the answer (and within the backend's
/// 1,024 PUSH credits, which come back with each release).
#[tokio::test]
async fn held_answer_pushes_are_bounded_in_number_too() {
    let features = LINK_FEATURE_FORWARD_DONE | LINK_FEATURE_HELD_ANSWERS;
    let (link, mut rx, rogue) = edge_and_scripted_backend(
        features,
        Box::new(|io| {
            Box::pin(async move {
                for _ in 0..1_100 {
                    let push = LinkFrame::AnswerPush {
                        handle: 7,
                        client_seq: 1,
                        msg_id: ECHO_REPLY,
                        class: TrafficClass::Normal,
                        payload: Bytes::new(),
                    };
                    if io.tx.send(push).await.is_err() {
                        return;
                    }
                }
                let done = LinkFrame::ForwardDone {
                    handle: 7,
                    client_seq: 1,
                };
                if io.tx.send(done).await.is_err() {
                    return;
                }
                while next_frame(&mut io.rx).await.is_some() {}
            })
        }),
    )
    .await;
    let mut batches = Vec::new();
    loop {
        match next_event(&mut rx).await {
            LinkEvent::Answer { pushes, end, .. } => {
                let done = matches!(end, AnswerEnd::Done(1));
                batches.push((pushes.len(), done));
                if done {
                    break;
                }
            }
            LinkEvent::Down { .. } => panic!("the link went down: {batches:?}"),
            _ => {}
        }
    }
    assert_eq!(batches, vec![(513, false), (513, false), (74, true)]);
    link.shutdown().await;
    rogue.abort();
}

/// Silent-drop audit: an ANSWER_PUSH from a backend that does not answer (no FORWARD_DONE
/// feature), or for a best-effort message (no client seq), was held for an answer that
/// never comes, then dropped with the message's CREDIT: no push, no counter. Such a frame
/// is a push at once now.
#[tokio::test]
async fn an_answer_push_no_answer_will_release_is_a_push_at_once() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let rogue = tokio::spawn(async move {
        let (_hello, mut io) = raw_backend_link(&listener, "no-answers", 0).await;
        if !until_forward(&mut io.rx).await {
            return;
        }
        answer_push_then_credit(&io.tx, 8).await;
        while next_frame(&mut io.rx).await.is_some() {}
    });
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    wait_up(&mut rx).await;
    forward_echo(&link, &meta(8, "hugo"), 1, Bytes::new());
    loop {
        match next_event(&mut rx).await {
            LinkEvent::Backend(LinkFrame::Push {
                handle: 8, payload, ..
            }) => {
                assert_eq!(payload, Bytes::from_static(b"reply"));
                break;
            }
            LinkEvent::Answer { .. } => panic!("held for an answer that never comes"),
            _ => {}
        }
    }
    link.shutdown().await;
    let _ = tokio::time::timeout(Duration::from_secs(10), rogue).await;
}

/// Regression (2026-12-04, second stop): a refused message stayed unanswered in the
/// link's in-flight queue until CREDIT covered it, so a link lost before that credit
/// refused it a second time (`unavailable`): two ERRORs for one client seq.
#[tokio::test]
async fn a_refused_message_is_not_refused_again_when_its_link_dies() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let backend = tokio::spawn(async move {
        let (_hello, mut io) =
            raw_backend_link(&listener, "refuser", LINK_FEATURE_FORWARD_DONE).await;
        if !until_forward(&mut io.rx).await {
            return;
        }
        io.tx
            .send(LinkFrame::Refuse {
                handle: 8,
                msg_id: ECHO,
                client_seq: 1,
                code: CloseCode::RateLimited,
                retry_after_ms: 50,
                epoch: 1,
            })
            .await
            .unwrap();
        // Gone before its CREDIT.
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(io);
    });
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    wait_up(&mut rx).await;
    forward_echo(&link, &meta(8, "hal"), 1, Bytes::new());
    let mut refusals = Vec::new();
    loop {
        match next_event(&mut rx).await {
            LinkEvent::Refuse { refusal, .. } => refusals.push(refusal.code),
            LinkEvent::Down { .. } => break,
            _ => {}
        }
    }
    assert_eq!(
        refusals,
        vec![CloseCode::RateLimited],
        "one answer per message"
    );
    backend.await.unwrap();
    link.shutdown().await;
}

/// Regression (2026-12-04, second stop): after a reconnect the edge re-opened every open
/// session with SESSION_OPEN alone, so the backend believed a session whose client was
/// away attached again until its linger ended. A session that is away is told so again
/// (SESSION_DETACHED, with what is left of its linger) right after its SESSION_OPEN.
#[tokio::test]
async fn a_session_away_is_told_away_again_after_a_reconnect() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let backend = tokio::spawn(async move {
        // First link: the session opens and detaches; then the link is lost.
        let (_hello, mut io) = raw_backend_link(&listener, "b", 0).await;
        loop {
            match next_frame(&mut io.rx).await {
                Some(LinkFrame::SessionDetached { handle: 9, .. }) => break,
                Some(_) => continue,
                None => panic!("first link ended early"),
            }
        }
        drop(io);
        // Second link: what the edge tells about its sessions first.
        let (_hello, mut io) = raw_backend_link(&listener, "b", 0).await;
        let mut told = Vec::new();
        while told.len() < 2 {
            match next_frame(&mut io.rx).await {
                Some(LinkFrame::SessionOpen { handle, .. }) => told.push((handle, None)),
                Some(LinkFrame::SessionDetached { handle, linger_ms }) => {
                    told.push((handle, Some(linger_ms)));
                }
                Some(_) => continue,
                None => break,
            }
        }
        told
    });
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    wait_up(&mut rx).await;
    link.ensure_open(&meta(9, "ivy")).unwrap();
    link.session_event(LinkFrame::SessionDetached {
        handle: 9,
        linger_ms: 30_000,
    })
    .await;
    let told = tokio::time::timeout(Duration::from_secs(10), backend)
        .await
        .expect("the edge reconnected")
        .unwrap();
    assert_eq!(told.len(), 2, "{told:?}");
    assert_eq!(told[0], (9, None), "re-opened first");
    assert!(
        matches!(told[1], (9, Some(ms)) if ms > 25_000 && ms <= 30_000),
        "then told away, with what is left of its linger: {told:?}"
    );
    link.shutdown().await;
}

/// A handler that pushes `reply`, then refuses the message or never returns.
struct PushThen {
    hang: bool,
}

#[async_trait]
impl Service for PushThen {
    async fn message(&self, session: &BackendSession, msg: Incoming) -> Result<(), Refusal> {
        session
            .push(ECHO_REPLY, TrafficClass::Critical, msg.payload)
            .await
            .unwrap();
        if self.hang {
            std::future::pending::<()>().await;
        }
        Err(Refusal {
            code: CloseCode::RateLimited,
            retry_after_ms: 0,
        })
    }
}

/// PROTOCOL.md §9.6: what a handler pushed before it refused its message, or before its
/// link died under it, still reaches the session, with the refusal and in one event (the
/// client sees the pushes and the ERROR together).
#[tokio::test]
async fn pushes_held_for_an_answer_come_with_a_refusal_or_the_links_loss() {
    for hang in [false, true] {
        let (backend, link, mut rx) = linked(Arc::new(PushThen { hang })).await;
        let m = meta(4, "dave");
        forward_echo(&link, &m, 1, Bytes::from_static(b"x"));
        if hang {
            // The handler is stuck after its push: the edge holds the push.
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(rx.try_recv().is_err(), "a push shown before its answer");
            drop(backend);
        }
        let (pushes, refusal) = loop {
            match next_event(&mut rx).await {
                LinkEvent::Answer {
                    handle: 4,
                    pushes,
                    end: AnswerEnd::Refused(r),
                } => break (pushes, r),
                LinkEvent::Down { .. } => panic!("hang {hang}: the held push was dropped"),
                _ => {}
            }
        };
        assert_eq!(pushes.len(), 1, "hang {hang}");
        assert_eq!(pushes[0].payload, Bytes::from_static(b"x"));
        let code = if hang {
            CloseCode::Unavailable
        } else {
            CloseCode::RateLimited
        };
        assert_eq!((refusal.client_seq, refusal.code), (1, code), "hang {hang}");
    }
}

/// Pushes `payload` back to `session` as an echo reply.
async fn echo(session: &BackendSession, payload: Bytes) -> Result<(), Refusal> {
    session
        .push(ECHO_REPLY, TrafficClass::Normal, payload)
        .await
        .unwrap();
    Ok(())
}

/// Holds the handler of player `slow` until the test opens the gate; echoes otherwise.
struct SlowPlayer {
    gate: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl Service for SlowPlayer {
    async fn message(&self, session: &BackendSession, msg: Incoming) -> Result<(), Refusal> {
        if session.player_id() == "slow" {
            self.gate.notified().await;
        }
        echo(session, msg.payload).await
    }
}

/// A handler that waits (a publish, a database) holds up only its own session: before,
/// the backend SDK handled a link's FORWARDs one at a time, so every session on the link
/// waited behind it (the demo's chat publishes, awaiting every edge, ran the edge out of
/// FORWARD credit: `busy`). A session's own messages still run one at a time, in order.
#[tokio::test]
async fn a_waiting_handler_holds_up_only_its_own_session() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let (_backend, link, mut rx) = linked(Arc::new(SlowPlayer { gate: gate.clone() })).await;
    let (slow, fast) = (meta(1, "slow"), meta(2, "fast"));
    for seq in 1..=2 {
        forward_echo(&link, &slow, seq, Bytes::from(format!("s{seq}")));
    }
    forward_echo(&link, &fast, 1, Bytes::from_static(b"f1"));
    let event = next_event(&mut rx).await;
    assert_eq!(
        first_push(&event).map(|p| (p.0, p.2)),
        Some((2, Bytes::from_static(b"f1"))),
        "the fast session waited behind the slow one: {event:?}"
    );
    // The slow session's messages, in order, once its handler goes on.
    assert_eq!(
        release_slow(&gate, &mut rx, 2).await,
        [Bytes::from_static(b"s1"), Bytes::from_static(b"s2")]
    );
}

/// Lets [`SlowPlayer`]'s handler go on until `n` replies to the slow session (handle 1)
/// came back; returns their bodies in arrival order.
async fn release_slow(
    gate: &tokio::sync::Notify,
    rx: &mut mpsc::Receiver<LinkEvent>,
    n: usize,
) -> Vec<Bytes> {
    let mut replies = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while replies.len() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "replies so far: {replies:?}"
        );
        gate.notify_one();
        if let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await {
            if let Some((1, _, body)) = first_push(&e) {
                replies.push(body);
            }
        }
    }
    replies
}

/// The messages waiting behind a session's running handler are bounded
/// (`BackendConfig::session_queue`): beyond, the backend refuses them `busy` at once, so
/// the client gets an answer instead of a reply seconds late.
#[tokio::test]
async fn a_session_queue_past_its_bound_is_refused_busy_at_once() {
    let gate = Arc::new(tokio::sync::Notify::new());
    let mut config = BackendConfig::new("b1");
    config.session_queue = 2;
    let (_backend, link, mut rx) =
        linked_with(config, Arc::new(SlowPlayer { gate: gate.clone() })).await;
    let slow = meta(1, "slow");
    for seq in 1..=4 {
        forward_echo(&link, &slow, seq, Bytes::from(format!("s{seq}")));
    }
    // One running, one waiting: the third and fourth are refused while the first still runs.
    let mut refused = Vec::new();
    while refused.len() < 2 {
        match next_event(&mut rx).await {
            LinkEvent::Refuse { refusal, .. } => {
                assert_eq!(refusal.code, CloseCode::Busy);
                assert_eq!(
                    refusal.retry_after_ms,
                    waygate_backend::SESSION_BUSY_RETRY_MS
                );
                refused.push(refusal.client_seq);
            }
            other => panic!("expected the refusals first, got {other:?}"),
        }
    }
    assert_eq!(refused, [3, 4]);
    assert_eq!(
        release_slow(&gate, &mut rx, 2).await,
        [Bytes::from_static(b"s1"), Bytes::from_static(b"s2")]
    );
}

/// Panics on the payload `boom`, echoes anything else.
struct PanicsOnBoom;

#[async_trait]
impl Service for PanicsOnBoom {
    async fn message(&self, session: &BackendSession, msg: Incoming) -> Result<(), Refusal> {
        assert_ne!(&msg.payload[..], b"boom", "the game's bug");
        echo(session, msg.payload).await
    }
}

/// A handler that panics answers its message `internal` and its session goes on: with one
/// worker per session, a panic used to end the worker silently, leaving the message
/// unanswered and its FORWARD credit never returned (the link's credit stuck behind it).
#[tokio::test]
async fn a_panicking_handler_refuses_its_message_and_the_session_goes_on() {
    let (_backend, link, mut rx) = linked(Arc::new(PanicsOnBoom)).await;
    let m = meta(3, "erin");
    forward_echo(&link, &m, 1, Bytes::from_static(b"boom"));
    match next_event(&mut rx).await {
        LinkEvent::Refuse { refusal, .. } => {
            assert_eq!((refusal.client_seq, refusal.code), (1, CloseCode::Internal))
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
    forward_echo(&link, &m, 2, Bytes::from_static(b"ok"));
    let event = next_event(&mut rx).await;
    assert_eq!(
        first_push(&event).map(|p| p.2),
        Some(Bytes::from_static(b"ok")),
        "{event:?}"
    );
}

/// A name longer than the link carries — a client's 300-byte room id, channel or whisper
/// recipient, which the demo backend passes on in a BIND, a CHANNEL_JOIN or a PLAYER_PUSH —
/// is refused `protocol_error` by the backend SDK before it is sent, and the link stays up
/// for every session on it. Found by the PROTOCOL.md audit: the edge took such a frame for
/// a malformed one and closed the link.
#[tokio::test]
async fn a_name_too_long_for_the_link_is_refused_and_the_link_stays_up() {
    let (_backend, link, mut rx) = linked(Arc::new(DemoService::new())).await;
    let m = meta(3, "erin");
    let long = "x".repeat(300);
    let requests = [
        (1, JOIN_ROOM, long.clone()),
        (2, CHANNEL_JOIN, format!("room:{long}")),
        (3, WHISPER, format!("{long}|hi")),
    ];
    for (seq, msg_id, payload) in requests {
        link.forward(
            &m,
            msg_id,
            1,
            seq,
            TrafficClass::Normal,
            Bytes::from(payload),
        )
        .unwrap();
        match next_event(&mut rx).await {
            LinkEvent::Refuse { refusal, .. } => {
                assert_eq!(
                    (refusal.client_seq, refusal.code),
                    (seq, CloseCode::ProtocolError)
                )
            }
            other => panic!("expected the refusal of {msg_id}, got {other:?}"),
        }
    }
    forward_echo(&link, &m, 4, Bytes::from_static(b"still up"));
    let event = next_event(&mut rx).await;
    assert!(
        first_push(&event).is_some_and(|p| p.2.ends_with(b"still up")),
        "{event:?}"
    );
}

/// Never answers the payload `hang` (a handler stuck on a dependency), echoes anything else.
struct HangsOnHang;

#[async_trait]
impl Service for HangsOnHang {
    async fn message(&self, session: &BackendSession, msg: Incoming) -> Result<(), Refusal> {
        if &msg.payload[..] == b"hang" {
            std::future::pending::<()>().await;
        }
        echo(session, msg.payload).await
    }
}

/// A handler that runs past the backend's `handler_timeout` is cancelled and its message
/// refused `internal`, and the session's next message is handled: before, one stuck
/// handler held its session's messages (and their FORWARD credit) for ever.
#[tokio::test]
async fn a_handler_past_its_deadline_refuses_its_message_and_the_session_goes_on() {
    let mut config = BackendConfig::new("b1");
    config.handler_timeout = Some(Duration::from_millis(200));
    let (_backend, link, mut rx) = linked_with(config, Arc::new(HangsOnHang)).await;
    let m = meta(3, "erin");
    forward_echo(&link, &m, 1, Bytes::from_static(b"hang"));
    forward_echo(&link, &m, 2, Bytes::from_static(b"ok"));
    match next_event(&mut rx).await {
        LinkEvent::Refuse { refusal, .. } => {
            assert_eq!((refusal.client_seq, refusal.code), (1, CloseCode::Internal))
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
    let event = next_event(&mut rx).await;
    assert_eq!(
        first_push(&event).map(|p| p.2),
        Some(Bytes::from_static(b"ok")),
        "{event:?}"
    );
}

/// A handler that pushes `oversized` messages too large for a link frame, recording each
/// result, then one ordinary push.
struct OversizedPusher {
    oversized: usize,
    results: std::sync::Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl Service for OversizedPusher {
    async fn message(
        &self,
        session: &waygate_backend::BackendSession,
        _msg: waygate_backend::Incoming,
    ) -> Result<(), waygate_backend::Refusal> {
        let huge = Bytes::from(vec![0u8; waygate_protocol::link::DEFAULT_MAX_LINK_FRAME]);
        for _ in 0..self.oversized {
            let r = session.push(7, TrafficClass::Normal, huge.clone()).await;
            self.results
                .lock()
                .unwrap()
                .push(format!("{:?}", r.map_err(|e| e.to_string())));
        }
        let r = session
            .push(8, TrafficClass::Normal, Bytes::from_static(b"after"))
            .await;
        self.results
            .lock()
            .unwrap()
            .push(format!("{:?}", r.map_err(|e| e.to_string())));
        Ok(())
    }
}

/// Regression (bounds audit, 2026-12-04): a push larger than a link frame was taken by the
/// backend SDK (`Ok`), then dropped by the link's writer with a log line, and the PUSH credit
/// it took was never returned; after as many such pushes as the edge granted credits, every
/// push of that link waited 5 s and failed `NoCredit`. Now it is refused `TooLarge` before it
/// takes credit, and the link goes on.
#[tokio::test]
async fn a_push_too_large_for_a_link_frame_is_refused_and_costs_no_credit() {
    let service = Arc::new(OversizedPusher {
        oversized: 6,
        results: std::sync::Mutex::new(Vec::new()),
    });
    let backend = Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::new("b1"),
        service.clone(),
    )
    .await
    .unwrap();
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(
        backend.local_addr(),
        LinkConfig {
            push_credits: 4,
            ..fast_config()
        },
        Arc::new(AtomicU64::new(1)),
        tx,
    );
    wait_up(&mut rx).await;
    let m = meta(9, "big");
    forward_echo(&link, &m, 1, Bytes::from_static(b"go"));
    let after = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let event = next_event(&mut rx).await;
            if let Some((_, 8, body)) = first_push(&event) {
                return body;
            }
        }
    })
    .await;
    let results = service.results.lock().unwrap().clone();
    assert_eq!(
        after.ok(),
        Some(Bytes::from_static(b"after")),
        "{results:?}"
    );
    assert_eq!(results.len(), 7, "{results:?}");
    assert!(
        results[..6].iter().all(|r| r.contains("does not fit")),
        "{results:?}"
    );
    assert_eq!(results[6], "Ok(())");
}

/// Regression (bounds audit): a backend took any number of connections, each with its
/// task and read queue for up to 10 s before the link handshake. At most 1,024 links are
/// served at once now; a connection beyond is closed at once.
#[tokio::test]
async fn a_backend_serves_a_bounded_number_of_links() {
    use tokio::io::AsyncReadExt as _;
    let backend = demo_backend("127.0.0.1:0".parse().unwrap(), "b-cap").await;
    let mut open = Vec::new();
    for _ in 0..1_024 {
        open.push(
            tokio::net::TcpStream::connect(backend.local_addr())
                .await
                .unwrap(),
        );
    }
    let mut extra = tokio::net::TcpStream::connect(backend.local_addr())
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), extra.read(&mut byte)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "the connection beyond the cap is closed at once: {read:?}"
    );
    // The ones within the cap wait for their LINK_HELLO (nothing read yet).
    let mut first = open.swap_remove(0);
    let waiting = tokio::time::timeout(Duration::from_millis(200), first.read(&mut byte)).await;
    assert!(waiting.is_err(), "{waiting:?}");
}

/// Regression (bounds audit, 2026-12-04): a session's lifecycle frames (its close, detach,
/// reattach) waited without a bound for room in the link's write queue, so a backend that
/// stopped reading its link stalled whoever sent them — the route loop (every table update,
/// health beat and migration of the edge) and every session ending there. They wait at
/// most `LIFECYCLE_SEND_WAIT` now. And then (second stop the same day) the link is reset:
/// dropping the frame alone left the backend believing the session open for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_stops_reading_does_not_stall_session_closes() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // A hand-made backend: grants plenty of credit, then stays alive (a LINK_PING every
    // 100 ms, so the edge never finds the link dead) but reads a byte at a time.
    let backend = tokio::spawn(async move {
        use bytes::BytesMut;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut stream, _) = listener.accept().await.unwrap();
        let codec = waygate_protocol::link::LinkCodec::new(1 << 20);
        let mut buf = BytesMut::new();
        while codec.decode(&mut buf).unwrap().is_none() {
            assert!(stream.read_buf(&mut buf).await.unwrap() > 0, "LINK_HELLO");
        }
        let mut out = BytesMut::new();
        let welcome = LinkFrame::Welcome {
            version: LINK_VERSION,
            instance_id: "stuck".into(),
            credits: 1_000_000,
            heartbeat_ms: 5000,
            auth: None,
            features: 0,
        };
        codec.encode(&welcome, &mut out).unwrap();
        stream.write_all(&out).await.unwrap();
        let mut byte = [0u8; 1];
        for timestamp in 0..1200u64 {
            out.clear();
            codec
                .encode(&LinkFrame::Ping { timestamp }, &mut out)
                .unwrap();
            if stream.write_all(&out).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let read = tokio::time::timeout(Duration::from_millis(1), stream.read(&mut byte)).await;
            if let Ok(Ok(0) | Err(_)) = read {
                return;
            }
        }
    });
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    wait_up(&mut rx).await;
    let m = meta(3, "stuck");
    // Forward until the link takes no more (its write queue and the socket are full).
    let mut taken = 0u64;
    for seq in 1..=100_000u64 {
        let r = link.forward(
            &m,
            ECHO,
            1,
            seq,
            TrafficClass::Normal,
            Bytes::from(vec![1u8; 60_000]),
        );
        if r.is_err() {
            break;
        }
        taken += 1;
        if seq % 64 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    assert!(taken > 0);
    let closed = tokio::time::timeout(
        Duration::from_secs(15),
        link.session_event(LinkFrame::SessionClose {
            handle: 3,
            code: CloseCode::Normal,
        }),
    )
    .await;
    assert!(
        closed.is_ok(),
        "the close waited on the stuck backend ({taken} forwards taken)"
    );
    // The close could not be queued: the link is reset (what was in flight is refused,
    // then the link is down), not left open with the backend believing the session open.
    let down = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match rx.recv().await {
                Some(LinkEvent::Down { .. }) => return,
                Some(_) => {}
                None => panic!("link events ended"),
            }
        }
    })
    .await;
    assert!(down.is_ok(), "the link to the stuck backend stayed up");
    backend.abort();
}

/// A service whose handler waits for `release`, recording the detaches (`true`) and
/// reattaches (`false`, with their gap) it hears.
struct Bouncing {
    release: Arc<tokio::sync::Notify>,
    heard: Arc<std::sync::Mutex<Vec<(bool, bool)>>>,
}

#[async_trait]
impl Service for Bouncing {
    async fn message(&self, _session: &BackendSession, _msg: Incoming) -> Result<(), Refusal> {
        self.release.notified().await;
        Ok(())
    }
    async fn session_detached(&self, _session: &BackendSession, _linger: Duration) {
        self.heard.lock().unwrap().push((true, false));
    }
    async fn session_reattached(&self, _session: &BackendSession, gap: bool) {
        self.heard.lock().unwrap().push((false, gap));
    }
}

/// Regression (bounds, 2026-12-04, second stop): the backend SDK queued every
/// SESSION_DETACHED and SESSION_REATTACHED for a session's worker without a bound, so a
/// client bouncing on and off while the session's handler was busy grew the queue with
/// every bounce. Past 64 of them, a stretch is folded into one job: the service hears its
/// first change and its last (the state the session ends in), and any gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detaches_and_reattaches_behind_a_busy_handler_are_folded() {
    let release = Arc::new(tokio::sync::Notify::new());
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let backend = Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::new("b"),
        Arc::new(Bouncing {
            release: release.clone(),
            heard: heard.clone(),
        }),
    )
    .await
    .unwrap();
    let mut io = raw_edge_link(backend.local_addr(), "bouncer-edge").await;
    assert!(matches!(
        next_frame(&mut io.rx).await,
        Some(LinkFrame::Welcome { .. })
    ));
    let m = meta(5, "bouncer");
    open_session(&io.tx, &m).await;
    forward_raw_echo(&io.tx, 5, 1, Bytes::new()).await;
    // 1,000 bounces while the handler waits; one reattach reports a gap.
    for i in 0..1000 {
        io.tx
            .send(LinkFrame::SessionDetached {
                handle: 5,
                linger_ms: 30_000,
            })
            .await
            .unwrap();
        io.tx
            .send(LinkFrame::SessionReattached {
                handle: 5,
                gap: i == 700,
            })
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    release.notify_one();
    let done = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if heard.lock().unwrap().last() == Some(&(false, true)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let heard = heard.lock().unwrap().clone();
    assert!(
        done.is_ok(),
        "{} heard, last {:?}",
        heard.len(),
        heard.last()
    );
    assert!(
        heard.len() <= 100,
        "{} calls for 2,000 frames: not folded",
        heard.len()
    );
    assert_eq!(
        heard.last(),
        Some(&(false, true)),
        "ends attached, with the gap"
    );
}

/// A session's SESSION_OPEN that the link's full write queue did not take is sent again
/// with its next forward. Before, the session counted as open anyway, and its later
/// FORWARDs went to a backend that never heard of it (refused `unavailable` until the link
/// reconnected). Helper audit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_open_a_full_write_queue_refused_is_sent_again() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, mut rx) = mpsc::channel(64);
    let (link, _task) = LinkClient::spawn(addr, fast_config(), Arc::new(AtomicU64::new(1)), tx);
    // A hand-made backend with plenty of credit that does not read for now (its reader's
    // queue fills, then the socket, then the edge's write queue).
    let (hello, mut io) = raw_backend_link_with_credits(&listener, "slow", 0, 1_000_000).await;
    assert!(matches!(hello, Some(LinkFrame::Hello { .. })));
    wait_up(&mut rx).await;
    let a = meta(1, "a");
    let big = Bytes::from(vec![1u8; 60_000]);
    let mut a_seq = 0u64;
    // Fill the write queue, then offer a new session's first message. The writer may free a
    // slot in between (the kernel took one more frame), letting that message in: then that
    // session is set aside and the queue filled again for the next one (a CI run on a
    // loaded machine met this).
    let mut refused_b = None;
    for attempt in 0..100u64 {
        let mut full = false;
        for _ in 0..100_000 {
            a_seq += 1;
            if let Err(e) = link.forward(&a, ECHO, 1, a_seq, TrafficClass::Normal, big.clone()) {
                assert!(matches!(e, ForwardError::Busy { .. }), "{e:?}");
                full = true;
                break;
            }
        }
        assert!(full, "the write queue filled");
        let b = meta(2 + attempt, &format!("b{attempt}"));
        match link.forward(
            &b,
            ECHO,
            1,
            1,
            TrafficClass::Normal,
            Bytes::from_static(b"b1"),
        ) {
            Err(ForwardError::Busy { .. }) => {
                refused_b = Some(b);
                break;
            }
            Ok(_) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
    let b = refused_b.expect("a session's first message refused by the full write queue");
    let b_handle = b.handle;
    // The backend reads again; b's message is forwarded again once there is room.
    let reader = tokio::spawn(async move {
        let mut opened_b = false;
        loop {
            match next_frame(&mut io.rx).await {
                Some(LinkFrame::SessionOpen { handle, .. }) if handle == b_handle => {
                    opened_b = true
                }
                Some(LinkFrame::Forward { handle, .. }) if handle == b_handle => return opened_b,
                Some(_) => {}
                None => panic!("the link ended"),
            }
        }
    });
    let mut sent = false;
    for _ in 0..500 {
        match link.forward(
            &b,
            ECHO,
            1,
            1,
            TrafficClass::Normal,
            Bytes::from_static(b"b1"),
        ) {
            Ok(_) => {
                sent = true;
                break;
            }
            Err(ForwardError::Busy { .. }) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(sent, "b's message taken once the queue drained");
    let opened_b = tokio::time::timeout(Duration::from_secs(20), reader)
        .await
        .expect("b's FORWARD in time")
        .unwrap();
    assert!(opened_b, "SESSION_OPEN of b came before its FORWARD");
}

/// An in-process edge routing by the table file `table` (polled every 100 ms), and a TCP
/// client of `player` on it; keep the directory (which holds the file) as long as the edge.
async fn edge_on_routes(
    table: &str,
    player: &str,
) -> (
    waygate_edge::edge::Edge,
    waygate_client::Client,
    tempfile::TempDir,
    std::path::PathBuf,
) {
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, table).unwrap();
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(routes.clone());
    config.routing.poll_ms = 100;
    let edge = waygate_edge::edge::Edge::start(config).await.unwrap();
    let endpoint = waygate_transport::endpoint::Endpoint::new(
        waygate_transport::TransportKind::Tcp,
        edge.addrs[&waygate_transport::TransportKind::Tcp],
    );
    let client = waygate_client::Client::start(waygate_client::ClientOptions::new(
        vec![endpoint],
        common::token(player),
    ));
    (edge, client, dir, routes)
}

/// A route table over one backend at `addr`: player service (p1), room service (r1, and r2
/// when `with_r2`, at the same address).
fn pin_table(addr: SocketAddr, epoch: u64, with_r2: bool) -> String {
    let mut t = format!(
        "epoch = {epoch}\nupdated_at = 0\n\
         [[services]]\nname = \"player\"\nmessages = [[1000, 1999]]\nkey = \"player\"\n\
         [[services.instances]]\nid = \"p1\"\naddress = \"{addr}\"\n\
         [[services]]\nname = \"room\"\nmessages = [[2000, 2999]]\nkey = \"room\"\n\
         [[services.instances]]\nid = \"r1\"\naddress = \"{addr}\"\n"
    );
    if with_r2 {
        t.push_str(&format!(
            "[[services.instances]]\nid = \"r2\"\naddress = \"{addr}\"\n"
        ));
    }
    t
}

/// Waits (at most 10 s) for a line of the edge's /metrics equal to `line`.
async fn expect_metric(edge: &waygate_edge::edge::Edge, line: &str) {
    let admin = edge.admin_addr.unwrap();
    let mut last = String::new();
    for _ in 0..100 {
        let (_, body) = common::http(admin, "GET", "/metrics").await;
        if body.lines().any(|l| l == line) {
            return;
        }
        last = body;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no `{line}` in /metrics:\n{last}");
}

/// Backend `b1` on a free loopback port, keeping its sessions.
async fn keeper_backend() -> (Arc<common::keeper::SessionKeeper>, Backend) {
    let keeper = Arc::new(common::keeper::SessionKeeper::default());
    let backend = Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::new("b1"),
        keeper.clone(),
    )
    .await
    .unwrap();
    (keeper, backend)
}

/// PIN and UNPIN are answered (PIN_RESULT, PROTOCOL.md §9.5) by a real edge over real
/// sockets: a pin to an instance the edge's table does not have is refused with its reason
/// (it used to be `Ok` while the edge dropped it), an unpin removes the pin once, and the
/// pins of an instance the route table loses are dropped when the edge applies that table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_are_confirmed_refused_removed_and_dropped_with_their_instance() {
    let (keeper, backend) = keeper_backend().await;
    let addr = backend.local_addr();
    let (edge, client, _dir, routes) = edge_on_routes(&pin_table(addr, 1, true), "pinner").await;
    // SESSION_OPEN reaches the backend with the session's first upstream message.
    client
        .send(TrafficClass::Normal, 1000, Bytes::from_static(b"hi"))
        .await
        .unwrap();
    let session = keeper.session("pinner").await;
    assert!(session.edge_confirms_pins(), "the edge offers PIN_RESULT");

    // Refusals, typed: no such instance, or not one of a service of that key kind.
    for (kind, instance) in [(PinKind::Room, "nope"), (PinKind::Player, "r1")] {
        let refused = session.pin_to(kind, "harbour", instance).await;
        assert!(
            matches!(
                refused,
                Err(BackendError::PinRefused(PinOutcome::UnknownInstance))
            ),
            "{kind:?} on {instance}: {refused:?}"
        );
    }
    // A pin, then its removal: once.
    session
        .pin_to(PinKind::Room, "harbour", "r1")
        .await
        .unwrap();
    assert!(session.unpin(PinKind::Room, "harbour").await.unwrap());
    assert!(!session.unpin(PinKind::Room, "harbour").await.unwrap());
    expect_metric(&edge, "waygate_pins_refused_total 2").await;

    // Pins of r2 go when a table without r2 is applied; r1's stay.
    session.pin_to(PinKind::Room, "fort", "r2").await.unwrap();
    session.pin_to(PinKind::Room, "keep", "r1").await.unwrap();
    expect_metric(&edge, "waygate_pinned_keys{kind=\"room\"} 2").await;
    common::write_atomically(&routes, &pin_table(addr, 2, false));
    expect_metric(&edge, "waygate_route_epoch 2").await;
    assert!(
        !session.unpin(PinKind::Room, "fort").await.unwrap(),
        "the pin went with its instance"
    );
    expect_metric(&edge, "waygate_pinned_keys{kind=\"room\"} 1").await;
    assert!(session.unpin(PinKind::Room, "keep").await.unwrap());
    // One UNPIN of "harbour", r2's pin dropped, one UNPIN of "keep".
    expect_metric(&edge, "waygate_pins_removed_total 3").await;
    drop(client);
}

/// Without a fast sink (an edge library whose links only feed a channel) nothing on the
/// link can answer a PIN: it is answered `unavailable`, never left without an answer.
#[tokio::test]
async fn a_pin_on_a_link_without_a_sink_is_answered_unavailable() {
    let keeper = Arc::new(common::keeper::SessionKeeper::default());
    let (_backend, link, _rx) = linked(keeper.clone()).await;
    let m = meta(1, "ann");
    forward_echo(&link, &m, 1, Bytes::new());
    let session = keeper.session("ann").await;
    let refused = session.pin(PinKind::Room, "harbour").await;
    assert!(
        matches!(
            refused,
            Err(BackendError::PinRefused(PinOutcome::Unavailable))
        ),
        "{refused:?}"
    );
}

/// Against an edge that predates PIN_RESULT (no feature bit in its LINK_HELLO) a pin is
/// sent as before — no request id, `Ok` once queued, unconfirmed — and an unpin is refused
/// before anything is sent (an unknown frame would close that edge's link).
#[tokio::test]
async fn an_edge_without_pin_results_gets_the_old_pin_and_no_unpin() {
    let (keeper, backend) = keeper_backend().await;
    let mut io = raw_edge_link(backend.local_addr(), "old-edge").await;
    assert!(matches!(
        next_frame(&mut io.rx).await,
        Some(LinkFrame::Welcome { features: 0, .. })
    ));
    open_session(&io.tx, &meta(5, "old")).await;
    let session = keeper.session("old").await;
    assert!(!session.edge_confirms_pins());
    session.pin(PinKind::Room, "harbour").await.unwrap();
    let unpin = session.unpin(PinKind::Room, "harbour").await;
    assert!(
        matches!(unpin, Err(BackendError::NotSupportedByEdge(_))),
        "{unpin:?}"
    );
    assert_eq!(
        next_frame(&mut io.rx).await,
        Some(LinkFrame::Pin {
            kind: PinKind::Room,
            key: "harbour".into(),
            instance_id: "b1".into(),
            request_id: 0,
        })
    );
}

/// Records the payloads of the messages it handles, in order; one whose payload is `slow`
/// (by default `b"slow"`) holds its session until `release` gets a permit.
struct Recorder {
    slow: &'static [u8],
    seen: std::sync::Mutex<Vec<String>>,
    slow_started: tokio::sync::Notify,
    release: tokio::sync::Semaphore,
    /// The latest session opened here.
    session: std::sync::Mutex<Option<BackendSession>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self {
            slow: b"slow",
            seen: Default::default(),
            slow_started: Default::default(),
            release: tokio::sync::Semaphore::new(0),
            session: Default::default(),
        }
    }
}

impl Recorder {
    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }

    fn session(&self) -> BackendSession {
        self.session
            .lock()
            .unwrap()
            .clone()
            .expect("a session opened here")
    }
}

#[async_trait]
impl Service for Recorder {
    async fn session_open(&self, session: &BackendSession) {
        *self.session.lock().unwrap() = Some(session.clone());
    }

    async fn message(&self, _s: &BackendSession, m: Incoming) -> Result<(), Refusal> {
        if &m.payload[..] == self.slow {
            self.slow_started.notify_one();
            let _ = self.release.acquire().await;
        }
        self.seen
            .lock()
            .unwrap()
            .push(String::from_utf8_lossy(&m.payload).into_owned());
        Ok(())
    }
}

/// The player service on instance x (at `x`), and from epoch 2 on y (x disabled: its
/// players move; its link stays).
fn moving_table(x: SocketAddr, y: SocketAddr, epoch: u64) -> String {
    let x_state = if epoch >= 2 { "disabled" } else { "active" };
    format!(
        "epoch = {epoch}\nupdated_at = 0\n\
         [[services]]\nname = \"player\"\nmessages = [[1000, 1999]]\nkey = \"player\"\n\
         [[services.instances]]\nid = \"x\"\naddress = \"{x}\"\nstate = \"{x_state}\"\n\
         [[services.instances]]\nid = \"y\"\naddress = \"{y}\"\nstate = \"{}\"\n",
        if epoch >= 2 { "active" } else { "disabled" }
    )
}

/// Two real backends x and y behind a real edge, and a client whose message `a` waits on x
/// behind a slow one (under epoch 1) while the table moves the player to y (epoch 2, which
/// x knows too: it will refuse `a` as stale). Returns once the move is applied, with `b`
/// sent after it.
struct RouteChange {
    x_service: Arc<Recorder>,
    y_service: Arc<Recorder>,
    b_seq: u64,
    client: waygate_client::Client,
    edge: waygate_edge::edge::Edge,
    _backends: (Backend, Backend),
    _dir: tempfile::TempDir,
}

/// Backends x and y (bound on free loopback ports), recording what they handle; y's
/// recorder holds every message whose payload is `y_slow`.
async fn x_and_y(y_slow: &'static [u8]) -> (Arc<Recorder>, Arc<Recorder>, Backend, Backend) {
    let x_service = Arc::new(Recorder::default());
    let y_service = Arc::new(Recorder {
        slow: y_slow,
        ..Recorder::default()
    });
    let bind = |id: &str, service: Arc<Recorder>| {
        Backend::bind(
            "127.0.0.1:0".parse().unwrap(),
            BackendConfig::new(id),
            service,
        )
    };
    let x = bind("x", x_service.clone()).await.unwrap();
    let y = bind("y", y_service.clone()).await.unwrap();
    (x_service, y_service, x, y)
}

/// The route change every held-line test starts with: through `edges[0]`, `slow` reaches x
/// (which holds it) and `a` waits behind it there; the table moves the player to y (epoch
/// 2, which x and y know too: x will refuse `a` as stale) and every edge in `edges`
/// applies it; then `b` is sent. Returns `b`'s client seq.
async fn move_the_player(
    client: &waygate_client::Client,
    x_service: &Recorder,
    (x, y): (&Backend, &Backend),
    routes: &std::path::Path,
    edges: &[&waygate_edge::edge::Edge],
) -> u64 {
    let send =
        |body: &'static [u8]| client.send(TrafficClass::Critical, 1000, Bytes::from_static(body));
    send(b"slow").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), x_service.slow_started.notified())
        .await
        .expect("x handles the slow message");
    send(b"a").await.unwrap();
    expect_metric(
        edges[0],
        "waygate_forwarded_total{service=\"player\",instance=\"x\"} 2",
    )
    .await;
    x.set_epoch(2);
    y.set_epoch(2);
    common::write_atomically(routes, &moving_table(x.local_addr(), y.local_addr(), 2));
    for edge in edges {
        expect_metric(edge, "waygate_route_epoch 2").await;
    }
    expect_metric(edges[0], "waygate_migrations_total 1").await;
    send(b"b").await.unwrap().unwrap()
}

impl RouteChange {
    async fn start() -> Self {
        let (x_service, y_service, x, y) = x_and_y(b"slow").await;
        let (edge, client, dir, routes) =
            edge_on_routes(&moving_table(x.local_addr(), y.local_addr(), 1), "mover").await;
        let b_seq = move_the_player(&client, &x_service, (&x, &y), &routes, &[&edge]).await;
        Self {
            x_service,
            y_service,
            b_seq,
            client,
            edge,
            _backends: (x, y),
            _dir: dir,
        }
    }

    /// What y handled once it handled `n` messages (at most 10 s).
    async fn y_seen(&self, n: usize) -> Vec<String> {
        let mut seen = Vec::new();
        for _ in 0..100 {
            seen = self.y_service.seen();
            if seen.len() >= n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        seen
    }
}

/// PROTOCOL.md §9.5, found by the silent-drop audit and left documented until now: a
/// message forwarded under the newer route table reached the new instance before an older
/// one, refused `stale_epoch` by the old instance, was routed there again. Now `b` waits
/// until `a` is answered or routed again: y gets `a`, then `b` (it used to get `b` first);
/// and the session's pushes keep reaching the client while `b` waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_after_a_route_change_does_not_overtake_one_routed_again() {
    let mut run = RouteChange::start().await;
    // Time for `b` to overtake, were it sent at once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // While `b` waits, the session goes on: a push reaches the client (review: the wait
    // used to block the session's task, its pushes included, for up to 2 s).
    let outcome = run
        .x_service
        .session()
        .push_to_player(
            "mover",
            7001,
            TrafficClass::Critical,
            Bytes::from_static(b"meanwhile"),
        )
        .await;
    assert!(outcome.is_ok(), "{outcome:?}");
    let ev = common::wait_for(&mut run.client, Duration::from_secs(1), |e| {
        matches!(e, waygate_client::Event::Message { payload, .. } if &payload[..] == b"meanwhile")
    })
    .await;
    assert!(matches!(ev, waygate_client::Event::Message { .. }));
    assert!(run.y_service.seen().is_empty(), "b is still waiting");
    // A later best-effort message waits behind `b` too.
    run.client
        .send(TrafficClass::BestEffort, 1000, Bytes::from_static(b"c"))
        .await
        .unwrap();
    run.x_service.release.add_permits(1);
    assert_eq!(
        run.y_seen(3).await,
        ["a", "b", "c"],
        "y got them in the order the client sent them"
    );
    assert_eq!(run.x_service.seen(), ["slow"]);
    expect_metric(&run.edge, "waygate_stale_epoch_reroutes_total 1").await;
    expect_metric(&run.edge, "waygate_forwards_held_total 2").await;
    expect_metric(&run.edge, "waygate_forwards_hold_expired_total 0").await;
}

/// The wait is bounded: while x holds `a` past 2 s, `b` is refused `busy` (an ERROR the
/// client gets for it), never sent ahead of `a`; `a` still reaches y once x lets go. The
/// client keeps its link all along (the edge's answer keep-alive ACKs, PROTOCOL.md §7.5:
/// before them, the client called the link dead after 1 s without a frame and resumed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_held_past_the_bound_is_refused_busy() {
    let mut run = RouteChange::start().await;
    let b_seq = run.b_seq;
    let mut link_lost = Vec::new();
    let ev = common::wait_for(&mut run.client, Duration::from_secs(10), |e| {
        if let waygate_client::Event::Disconnected { code } = e {
            link_lost.push(*code);
        }
        matches!(e, waygate_client::Event::Error(r) if r.client_seq == b_seq)
    })
    .await;
    assert_eq!(link_lost, [], "the client kept its link");
    match ev {
        waygate_client::Event::Error(r) => assert_eq!(r.code, CloseCode::Busy),
        other => panic!("unexpected {other:?}"),
    }
    expect_metric(&run.edge, "waygate_forwards_hold_expired_total 1").await;
    run.x_service.release.add_permits(1);
    assert_eq!(run.y_seen(1).await, ["a"]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(run.y_service.seen(), ["a"], "b was refused, not sent");
}

/// The held line belongs to the session, not its connection: while `b` waits in it, the
/// client's connection drops and the client resumes on the same edge; y still gets `a`,
/// then `b`, and the client is refused nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_held_line_goes_on_through_a_resume_on_the_same_edge() {
    let mut run = RouteChange::start().await;
    let registry = run.edge.registry();
    let sid = registry.session_of("mover").expect("the session");
    assert!(
        registry.drop_link(&sid),
        "the drop reaches the session's task"
    );
    let ev = common::wait_for(&mut run.client, Duration::from_secs(10), |e| {
        matches!(e, waygate_client::Event::Connected { outcome, .. } if *outcome == waygate_protocol::frame::WelcomeOutcome::Restored)
    })
    .await;
    assert!(matches!(ev, waygate_client::Event::Connected { .. }));
    assert!(run.y_service.seen().is_empty(), "b is still waiting");
    run.x_service.release.add_permits(1);
    assert_eq!(run.y_seen(2).await, ["a", "b"]);
    let refused = tokio::time::timeout(Duration::from_secs(1), async {
        loop {
            match run.client.next_event().await {
                Some(waygate_client::Event::Error(r)) => return Some(r),
                Some(_) => {}
                None => return None,
            }
        }
    })
    .await;
    assert!(!matches!(refused, Ok(Some(_))), "refused: {refused:?}");
}

/// Hard migration during a hold (PROTOCOL.md §9.5, S8; found by the last stop's review):
/// while `b` waits on edge A behind `a` (refused `stale_epoch` by x), A is drained and the
/// client moves to edge B (Redis). A forwards nothing of the session any more once it is
/// quiesced: `a`, routed again meanwhile, and `b` are withdrawn, unacknowledged, and the
/// client resends both to B, so y handles each once. Before, A sent `a` to y during the
/// quiesce, y answered it after the client had left, and the client's resend through B
/// made y handle `a` twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_line_is_withdrawn_when_its_session_moves_to_another_edge() {
    let redis = support_redis::RedisServer::start();
    // y holds every `a` until released: an answer that comes after the client left.
    let (x_service, y_service, x, y) = x_and_y(b"a").await;
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, moving_table(x.local_addr(), y.local_addr(), 1)).unwrap();
    let start = |id: &str, drain_target: String| {
        let mut config = waygate_edge::config::EdgeConfig::default();
        config.use_ephemeral_ports();
        config.edge_id = id.into();
        config.routing.table = Some(routes.clone());
        config.routing.poll_ms = 100;
        config.cluster.redis_url = redis.url();
        config.drain.target = drain_target;
        // Time enough for x's refusal of `a` to reach A within the quiesce, even on a
        // slow machine (the answer keep-alive holds the client meanwhile).
        config.cluster.quiesce_ms = 3_000;
        waygate_edge::edge::Edge::start(config)
    };
    let edge_b = start("edge-b", String::new()).await.unwrap();
    let b_addr = edge_b.addrs[&waygate_transport::TransportKind::Tcp];
    let edge_a = start("edge-a", format!("tcp://{b_addr}")).await.unwrap();
    let mut client = waygate_client::Client::start(waygate_client::ClientOptions::new(
        vec![waygate_transport::endpoint::Endpoint::new(
            waygate_transport::TransportKind::Tcp,
            edge_a.addrs[&waygate_transport::TransportKind::Tcp],
        )],
        common::token("mover"),
    ));
    move_the_player(&client, &x_service, (&x, &y), &routes, &[&edge_a, &edge_b]).await;
    expect_metric(&edge_a, "waygate_forwards_held_total 1").await;
    // The drain quiesces the session (`b`, waiting, is withdrawn), waits `quiesce_ms` and
    // sends MIGRATE; meanwhile x refuses `a` as stale and A routes it again.
    let admin = edge_a.admin();
    let drain = tokio::spawn(async move { admin.drain().await });
    expect_metric(&edge_a, "waygate_forwards_withdrawn_total 1").await;
    x_service.release.add_permits(1);
    expect_metric(&edge_a, "waygate_stale_epoch_reroutes_total 1").await;
    let ev = common::wait_for(&mut client, Duration::from_secs(10), |e| {
        matches!(e, waygate_client::Event::Connected { outcome, .. } if *outcome == waygate_protocol::frame::WelcomeOutcome::Restored)
    })
    .await;
    assert!(matches!(ev, waygate_client::Event::Connected { .. }));
    drain.await.unwrap();
    // Every `a` y was given may finish now.
    y_service.release.add_permits(2);
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = y_service.seen();
        if seen.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Time for a second copy to arrive, were one on its way.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(seen, ["a", "b"]);
    assert_eq!(y_service.seen(), ["a", "b"], "each handled once");
    assert_eq!(x_service.seen(), ["slow"]);
    expect_metric(&edge_a, "waygate_forwards_withdrawn_total 2").await;
}

/// A backend that refuses every message `stale_epoch` with the epoch it knows, which is not
/// newer than the edge's; counts the messages it saw.
#[derive(Default)]
struct StaleRefuser(std::sync::atomic::AtomicUsize);

#[async_trait]
impl Service for StaleRefuser {
    async fn message(&self, _session: &BackendSession, _msg: Incoming) -> Result<(), Refusal> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Err(Refusal {
            code: CloseCode::StaleEpoch,
            retry_after_ms: 0,
        })
    }
}

/// Regression (2026-12-05, an audit of PROTOCOL.md §9 against the code): a `stale_epoch`
/// REFUSE whose epoch is not newer than the one the message was forwarded with was routed
/// again, to the same instance, which refused it again: the message went back and forth
/// without end and its client was never answered. Such a refusal is no reason to route
/// again: it reaches the client as ERROR 406 (§9.5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_refused_stale_again_after_its_reroute_is_answered() {
    let service = Arc::new(StaleRefuser::default());
    let (edge, _backend, _dir) = common::edge_over(service.clone(), |_| {}).await;
    let mut client = waygate_client::Client::start(waygate_client::ClientOptions::new(
        vec![waygate_transport::endpoint::Endpoint::new(
            waygate_transport::TransportKind::Tcp,
            edge.addrs[&waygate_transport::TransportKind::Tcp],
        )],
        common::token("stale"),
    ));
    client
        .send(TrafficClass::Normal, 1000, Bytes::from_static(b"x"))
        .await
        .unwrap();
    let ev = common::wait_for(&mut client, Duration::from_secs(5), |e| {
        matches!(e, waygate_client::Event::Error(_))
    })
    .await;
    match ev {
        waygate_client::Event::Error(e) => assert_eq!(e.code, CloseCode::StaleEpoch),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        service.0.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "forwarded once, not routed again"
    );
    expect_metric(&edge, "waygate_stale_epoch_reroutes_total 0").await;
}

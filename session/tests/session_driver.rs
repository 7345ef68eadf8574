//! The async driver over an in-memory connection, on tokio's paused clock: linger expiry
//! releases ownership and bindings, a reconnect before the server noticed the drop hands the
//! live session over without losing pushes, and registry pushes are typed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use waygate_protocol::frame::WelcomeOutcome;
use waygate_session::client::{ClientConfig, ClientEvent, ClientSession};
use waygate_session::driver::{Downstream, PushError, SessionEvent, SessionLayer};
use waygate_session::machine::EndReason;
use waygate_session::testkit::{echo_edge, test_client, EchoSink};
use waygate_session::SessionConfig;
use waygate_transport::mem::{mem_pair, MemConnection as MemConn};
use waygate_transport::{CloseCode, Connection, TrafficClass, TransportError};

const UNIX: u64 = 1_800_000_000;

fn edge() -> (Arc<SessionLayer>, Arc<EchoSink>) {
    let config = SessionConfig {
        linger: Duration::from_secs(60),
        ..SessionConfig::default()
    };
    let (mut e, sink) = echo_edge("edge-t", config);
    e.unix_now = Arc::new(|| UNIX);
    (Arc::new(e), sink)
}

fn client() -> ClientSession {
    test_client("p", UNIX, 60)
}

async fn exchange(
    c: &mut ClientSession,
    conn: &mut MemConn,
    events: &mut Vec<ClientEvent>,
    want: impl Fn(&[ClientEvent]) -> bool,
) {
    waygate_session::testkit::drive_client(c, conn, events, Duration::from_secs(1), want).await;
}

use waygate_session::testkit::welcomes;

/// Player `p`'s client logged in on `edge` over an in-memory link: the session's task, the
/// client, its end of the link and its events so far (the WELCOME included).
async fn logged_in(
    edge: &Arc<SessionLayer>,
) -> (
    tokio::task::JoinHandle<EndReason>,
    ClientSession,
    MemConn,
    Vec<ClientEvent>,
) {
    waygate_session::testkit::log_in(edge, client(), Duration::from_secs(1)).await
}

/// A session layer with write-through to `store` (linger 60 s).
fn write_through_layer(
    name: &str,
    store: Arc<dyn waygate_session::store::SnapshotStore>,
) -> (SessionLayer, Arc<EchoSink>) {
    let config = SessionConfig {
        linger: Duration::from_secs(60),
        ..SessionConfig::default()
    };
    let (mut e, sink) = echo_edge(name, config);
    e.unix_now = Arc::new(|| UNIX);
    e.write_through = Some(waygate_session::write_through::WriteThrough::start(
        store.clone(),
        Duration::from_secs(60),
        Duration::from_secs(1),
    ));
    e.snapshots = store;
    (e, sink)
}

#[tokio::test(start_paused = true)]
async fn linger_expiry_releases_ownership_bindings_and_snapshot() {
    let (edge, sink) = edge();
    let (task, _c, conn, _events) = logged_in(&edge).await;
    let sid = edge.registry.session_of("p").expect("registered");
    assert!(edge.registry.bind(&sid, "world", "w-1"));
    drop(conn); // the link dies without a CLOSE
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        edge.snapshots.get(&sid).await.expect("store").is_some(),
        "persisted"
    );
    assert_eq!(edge.registry.len(), 1, "lingering sessions stay registered");
    // Pushed while lingering: buffered, not an error.
    edge.registry
        .push(
            &sid,
            Downstream {
                class: TrafficClass::Normal,
                msg_id: 1,
                payload: Bytes::from_static(b"later"),
            },
        )
        .expect("push");
    tokio::time::sleep(Duration::from_secs(61)).await;
    let reason = task.await.expect("task");
    assert_eq!(reason, EndReason::LingerExpired);
    assert!(edge.registry.is_empty());
    assert!(edge.snapshots.get(&sid).await.expect("store").is_none());
    assert!(edge.ownership.owner("p").await.expect("owner").is_none());
    let ended = sink.events().into_iter().find_map(|e| match e {
        SessionEvent::Ended {
            released,
            bindings,
            reason,
            ..
        } => Some((released, bindings, reason)),
        _ => None,
    });
    let (released, bindings, reason) = ended.expect("ended event");
    assert!(released);
    assert_eq!(bindings.get("world").map(String::as_str), Some("w-1"));
    assert_eq!(reason, EndReason::LingerExpired);
}

#[tokio::test(start_paused = true)]
async fn reconnect_before_the_drop_is_noticed_hands_over_without_loss() {
    let (edge, _sink) = edge();
    let (server_end, mut old_conn) = mem_pair();
    let old_task = edge.spawn(Box::new(server_end));
    let mut c = client();
    let mut events = Vec::new();
    c.connect(Instant::now()).expect("hello");
    exchange(&mut c, &mut old_conn, &mut events, |e| {
        !welcomes(e).is_empty()
    })
    .await;
    let sid = edge.registry.session_of("p").expect("registered");
    // The client's link dies, but the server side is still open (no EOF yet).
    c.handle_link_down(Instant::now(), CloseCode::GoingAway);
    let push = |n: u8| Downstream {
        class: TrafficClass::Critical,
        msg_id: 9,
        payload: Bytes::from(vec![n]),
    };
    for n in 0..3 {
        edge.registry.push(&sid, push(n)).expect("push");
    }
    let (server_end, mut new_conn) = mem_pair();
    let _new_task = edge.spawn(Box::new(server_end));
    c.connect(Instant::now()).expect("hello");
    for n in 3..5 {
        // Pushed while the hand-over may be in progress.
        edge.registry.push(&sid, push(n)).expect("push");
        tokio::task::yield_now().await;
    }
    exchange(&mut c, &mut new_conn, &mut events, |e| {
        e.iter()
            .filter(|e| matches!(e, ClientEvent::Message { .. }))
            .count()
            >= 5
    })
    .await;
    assert_eq!(
        welcomes(&events),
        vec![WelcomeOutcome::NewSession, WelcomeOutcome::Restored]
    );
    let got: Vec<u8> = events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Message { payload, .. } => Some(payload[0]),
            _ => None,
        })
        .collect();
    assert_eq!(got, vec![0, 1, 2, 3, 4]);
    assert_eq!(old_task.await.expect("task"), EndReason::Superseded);
    // The old connection was told why.
    let mut old_close = None;
    while let Ok(r) = tokio::time::timeout(Duration::from_millis(10), old_conn.recv()).await {
        if let Err(TransportError::ClosedByPeer { code }) = r {
            old_close = Some(code);
            break;
        }
    }
    assert_eq!(old_close, Some(CloseCode::GoingAway));
    assert_eq!(edge.registry.session_of("p"), Some(sid));
}

#[tokio::test(start_paused = true)]
async fn registry_push_errors_are_typed() {
    let (edge, _sink) = edge();
    let nobody = Downstream {
        class: TrafficClass::Normal,
        msg_id: 1,
        payload: Bytes::new(),
    };
    assert_eq!(
        edge.registry.push_to_player("ghost", nobody.clone()),
        Err(PushError::NotFound)
    );
    assert_eq!(
        edge.registry.push(&[0; 16], nobody),
        Err(PushError::NotFound)
    );
}

#[tokio::test(start_paused = true)]
async fn bad_token_over_the_driver_is_rejected_with_its_code() {
    let (edge, _sink) = edge();
    let (server_end, mut conn) = mem_pair();
    let task = edge.spawn(Box::new(server_end));
    let mut c = ClientSession::new(Bytes::from_static(b"\x01bad"), ClientConfig::default());
    let mut events = Vec::new();
    c.connect(Instant::now()).expect("hello");
    exchange(&mut c, &mut conn, &mut events, |e| !e.is_empty()).await;
    assert!(matches!(
        events.first(),
        Some(ClientEvent::Rejected {
            code: CloseCode::AuthMalformed,
            ..
        })
    ));
    assert_eq!(
        task.await.expect("task"),
        EndReason::Rejected(CloseCode::AuthMalformed)
    );
}

/// S7: a session that drops on one edge resumes on another from the shared (warm) store;
/// the old edge's lingering copy then expires without releasing the new owner's claim.
#[tokio::test(start_paused = true)]
async fn resume_on_another_edge_from_the_shared_store() {
    let (edge1, sink1) = edge();
    let (edge2, _sink2) = {
        let (mut e, sink) = echo_edge("edge-2", (*edge1.config).clone());
        e.unix_now = Arc::new(|| UNIX);
        // The warm tier: both edges share the snapshot store and the ownership registry.
        e.snapshots = edge1.snapshots.clone();
        e.ownership = edge1.ownership.clone();
        (Arc::new(e), sink)
    };
    let (task1, mut c, conn, mut events) = logged_in(&edge1).await;
    let sid = edge1.registry.session_of("p").expect("registered");
    edge1
        .registry
        .push(
            &sid,
            Downstream {
                class: TrafficClass::Normal,
                msg_id: 1,
                payload: Bytes::from_static(b"before"),
            },
        )
        .expect("push");
    tokio::task::yield_now().await;
    drop(conn);
    c.handle_link_down(Instant::now(), CloseCode::GoingAway);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (server_end, mut conn2) = mem_pair();
    let _task2 = edge2.spawn(Box::new(server_end));
    c.connect(Instant::now()).expect("hello");
    exchange(&mut c, &mut conn2, &mut events, |e| welcomes(e).len() == 2).await;
    assert_eq!(welcomes(&events)[1], WelcomeOutcome::Restored);
    let owner = edge2
        .ownership
        .owner("p")
        .await
        .expect("owner")
        .expect("some");
    assert_eq!((owner.edge.as_str(), owner.fencing), ("edge-2", 2));
    // Edge 1's lingering copy expires; it must not release edge 2's ownership.
    tokio::time::sleep(Duration::from_secs(61)).await;
    assert_eq!(task1.await.expect("task"), EndReason::LingerExpired);
    assert!(sink1.events().iter().any(|e| matches!(
        e,
        SessionEvent::Ended {
            released: false,
            ..
        }
    )));
    let owner = edge2
        .ownership
        .owner("p")
        .await
        .expect("owner")
        .expect("some");
    assert_eq!(owner.edge, "edge-2");
}

/// An authenticator that takes `delay` before it answers once `slow` is set (a busy edge).
struct SlowAuth {
    inner: Arc<dyn waygate_session::Authenticator>,
    slow: Arc<std::sync::atomic::AtomicBool>,
    delay: Duration,
}

#[async_trait::async_trait]
impl waygate_session::Authenticator for SlowAuth {
    async fn authenticate(
        &self,
        token: &[u8],
        now_unix: u64,
    ) -> Result<waygate_session::auth::AuthedPlayer, waygate_session::auth::AuthError> {
        if self.slow.load(std::sync::atomic::Ordering::Relaxed) {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.authenticate(token, now_unix).await
    }
}

/// Regression (channels-at-scale run: sessions ended `kicked` although their player logged
/// in once): a client that gives up on a slow handshake and goes elsewhere leaves that
/// handshake behind; it went on to claim the player (single login) and kick the session
/// the client uses. A handshake whose connection closed while it waited now ends before it
/// takes a snapshot or the ownership.
#[tokio::test(start_paused = true)]
async fn a_handshake_whose_client_left_takes_nothing_from_the_live_session() {
    let config = SessionConfig {
        linger: Duration::from_secs(60),
        ..SessionConfig::default()
    };
    let (mut layer, _sink) = echo_edge("edge-t", config);
    layer.unix_now = Arc::new(|| UNIX);
    let slow = Arc::new(std::sync::atomic::AtomicBool::new(false));
    layer.authenticator = Arc::new(SlowAuth {
        inner: layer.authenticator.clone(),
        slow: slow.clone(),
        delay: Duration::from_millis(500),
    });
    let edge = Arc::new(layer);
    let (server_end, mut conn) = mem_pair();
    edge.spawn(Box::new(server_end));
    let mut c = client();
    let mut events = Vec::new();
    c.connect(Instant::now()).expect("hello");
    exchange(&mut c, &mut conn, &mut events, |e| !welcomes(e).is_empty()).await;
    let live = edge.registry.session_of("p").expect("registered");

    // The same player's second handshake, now that the edge is busy: the client sends
    // HELLO, waits, and leaves before the authenticator answers.
    slow.store(true, std::sync::atomic::Ordering::Relaxed);
    let (server_end, mut ghost) = mem_pair();
    let ghost_task = edge.spawn(Box::new(server_end));
    let mut g = client();
    g.connect(Instant::now()).expect("hello");
    while let Some(f) = g.poll_transmit() {
        ghost.send(&f).await.expect("hello sent");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(ghost);
    let end = ghost_task.await.expect("task");
    assert!(
        matches!(end, EndReason::HandshakeFailed(_)),
        "the abandoned handshake ended: {end:?}"
    );
    assert_eq!(
        edge.registry.session_of("p"),
        Some(live),
        "the live session still holds the player"
    );
    // And it still works.
    slow.store(false, std::sync::atomic::Ordering::Relaxed);
    let before = events.len();
    c.send(
        Instant::now(),
        TrafficClass::Normal,
        1,
        Bytes::from_static(b"still here"),
    )
    .expect("send");
    exchange(&mut c, &mut conn, &mut events, |e| {
        e.iter().any(|e| matches!(e, ClientEvent::Message { .. }))
    })
    .await;
    assert!(
        !events[before..]
            .iter()
            .any(|e| matches!(e, ClientEvent::Disconnected { .. })),
        "{events:?}"
    );
}

/// A session layer with write-through to an in-memory store whose every commit takes
/// 100 ms (a Redis slowed down by a busy machine).
fn write_through_layer_slow(name: &str) -> (SessionLayer, Arc<EchoSink>) {
    write_through_layer(
        name,
        Arc::new(SlowStore {
            inner: waygate_session::store::MemorySnapshotStore::new(),
            delay: Duration::from_millis(100),
        }),
    )
}

/// A snapshot store whose every group commit takes `delay` (a Redis slowed down by a busy
/// machine).
struct SlowStore {
    inner: waygate_session::store::MemorySnapshotStore,
    delay: Duration,
}

#[async_trait::async_trait]
impl waygate_session::store::SnapshotStore for SlowStore {
    async fn put(
        &self,
        snapshot: &waygate_session::store::Snapshot,
        ttl: Duration,
    ) -> Result<(), waygate_session::store::StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.put(snapshot, ttl).await
    }
    async fn get(
        &self,
        session_id: &waygate_protocol::frame::SessionId,
    ) -> Result<Option<waygate_session::store::Snapshot>, waygate_session::store::StoreError> {
        self.inner.get(session_id).await
    }
    async fn take(
        &self,
        session_id: &waygate_protocol::frame::SessionId,
        resume_hash: &waygate_session::resume::ResumeHash,
    ) -> Result<waygate_session::store::TakeOutcome, waygate_session::store::StoreError> {
        self.inner.take(session_id, resume_hash).await
    }
    async fn delete(
        &self,
        session_id: &waygate_protocol::frame::SessionId,
        fencing: Option<u64>,
    ) -> Result<bool, waygate_session::store::StoreError> {
        self.inner.delete(session_id, fencing).await
    }
}

/// Regression (scale-out issue: replies over 15 s late in `demo --edges 3` beside a flood):
/// with write-through, a session read one frame per commit, so when commits slowed down
/// (80–120 ms on a busy machine) its client's frames piled up in the transport and every
/// reply waited behind them. Now the frames ready when a turn starts are taken in that
/// turn and one commit covers them all: a burst of 40 messages costs a few writes of the
/// session's snapshot, not one per message.
#[tokio::test(start_paused = true)]
async fn a_burst_of_messages_shares_the_write_through_commits() {
    let (e, sink) = write_through_layer_slow("edge-wt");
    let wt = e.write_through.clone().expect("write-through on");
    let edge = Arc::new(e);
    let (_task, mut c, mut conn, mut events) = logged_in(&edge).await;
    let before = wt.writes.load(std::sync::atomic::Ordering::Relaxed);
    const BURST: usize = 40;
    for n in 0..BURST {
        c.send(
            Instant::now(),
            TrafficClass::Normal,
            7,
            Bytes::from(n.to_string()),
        )
        .expect("send");
    }
    let echoes = |e: &[ClientEvent]| {
        e.iter()
            .filter(|e| matches!(e, ClientEvent::Message { msg_id: 7, .. }))
            .count()
    };
    waygate_session::testkit::drive_client(
        &mut c,
        &mut conn,
        &mut events,
        Duration::from_secs(30),
        |e| echoes(e) == BURST,
    )
    .await;
    assert_eq!(echoes(&events), BURST, "every echo came back");
    assert_eq!(sink.received().len(), BURST);
    let writes = wt.writes.load(std::sync::atomic::Ordering::Relaxed) - before;
    eprintln!("{BURST} messages: {writes} snapshot writes");
    assert!(
        writes <= 6,
        "{writes} snapshot writes for a burst of {BURST} messages"
    );
}

/// Regression (found reading the write-through, 2026-12-04): pushes taken for a session
/// whose client was away (lingering) went into its replay buffer in memory only — nothing
/// is shown while detached, and write-through wrote only before showing — so an edge that
/// died before the client came back lost them without a word: the client restored on
/// another edge from the snapshot of its detach, `Restored` and no gap, and the seqs of the
/// lost pushes were given to later ones. A lingering session's pushes are now written
/// through as they are taken.
#[tokio::test(start_paused = true)]
async fn pushes_to_a_lingering_session_outlive_its_edge() {
    let store = Arc::new(waygate_session::store::MemorySnapshotStore::new());
    let (edge1, _sink1) = write_through_layer("edge-1", store.clone());
    let edge1 = Arc::new(edge1);
    let (mut edge2, _sink2) = write_through_layer("edge-2", store);
    edge2.ownership = edge1.ownership.clone();
    let edge2 = Arc::new(edge2);

    let (task1, mut c, conn, mut events) = logged_in(&edge1).await;
    let sid = edge1.registry.session_of("p").expect("registered");
    // The client goes away; its session lingers on edge 1 and takes three pushes.
    drop(conn);
    c.handle_link_down(Instant::now(), CloseCode::GoingAway);
    tokio::time::sleep(Duration::from_millis(10)).await;
    for n in 1..=3u8 {
        edge1
            .registry
            .push(
                &sid,
                Downstream {
                    class: TrafficClass::Normal,
                    msg_id: 5,
                    payload: Bytes::from(vec![n]),
                },
            )
            .expect("push to the lingering session");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Edge 1 dies (kill -9: its tasks stop, nothing more is written); the client comes
    // back on edge 2.
    task1.abort();
    let _ = task1.await;
    let (server_end, mut conn2) = mem_pair();
    let _task2 = edge2.spawn(Box::new(server_end));
    c.connect(Instant::now()).expect("hello");
    let pushed = |e: &[ClientEvent]| {
        e.iter()
            .filter_map(|e| match e {
                ClientEvent::Message {
                    msg_id: 5, payload, ..
                } => Some(payload.to_vec()),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    exchange(&mut c, &mut conn2, &mut events, |e| {
        welcomes(e).len() == 2 && pushed(e).len() == 3
    })
    .await;
    assert_eq!(welcomes(&events)[1], WelcomeOutcome::Restored, "{events:?}");
    assert_eq!(
        pushed(&events),
        vec![vec![1], vec![2], vec![3]],
        "every push taken while the client was away, once and in order"
    );
}

/// A push queued with a receipt is reported once the session's stored copy holds it, not
/// before (SPEC F4: a backend's PLAYER_PUSH is answered `delivered` only then, so an edge
/// killed in between cannot have answered `delivered` for a push it lost).
#[tokio::test(start_paused = true)]
async fn a_push_receipt_is_reported_after_the_write_through() {
    let (e, sink) = write_through_layer_slow("edge-r");
    let edge = Arc::new(e);
    let (_task, mut c, mut conn, mut events) = logged_in(&edge).await;
    let written = |sink: &EchoSink| {
        sink.events()
            .into_iter()
            .filter_map(|e| match e {
                SessionEvent::PushesWritten { receipts, stored } => Some((receipts, stored)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let pushed = edge.registry.push_to_player_with_receipt(
        "p",
        Downstream {
            class: TrafficClass::Normal,
            msg_id: 5,
            payload: Bytes::from_static(b"for the record"),
        },
        7,
        70,
    );
    assert_eq!(pushed, Ok(true));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(written(&sink).is_empty(), "not before the commit ends");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(written(&sink), vec![(vec![7], true)]);
    exchange(&mut c, &mut conn, &mut events, |e| {
        e.iter()
            .any(|e| matches!(e, ClientEvent::Message { msg_id: 5, .. }))
    })
    .await;
    // No session for the player: nothing queued, no receipt.
    assert_eq!(
        edge.registry.push_to_player_with_receipt(
            "nobody",
            Downstream {
                class: TrafficClass::Normal,
                msg_id: 5,
                payload: Bytes::new(),
            },
            8,
            0,
        ),
        Err(PushError::NotFound)
    );
}

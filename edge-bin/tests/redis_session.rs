//! The session driver (`SessionLayer`) on the Redis stores, with real time and a real
//! redis-server 7: a client resumes on another edge from the warm tier, the old edge's
//! lingering copy is kicked across edges (kick subscription wired to `SessionRegistry::kick`),
//! and with Redis down a new login ends with UNAVAILABLE within 1 s while a live session is
//! untouched.

mod support_redis;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use support_redis::RedisServer;
use waygate_edge::cluster::redis::RedisStores;
use waygate_protocol::frame::WelcomeOutcome;
use waygate_session::client::{ClientEvent, ClientSession};
use waygate_session::driver::{Downstream, SessionLayer};
use waygate_session::machine::EndReason;
use waygate_session::store::{OwnershipRegistry as _, SnapshotStore as _};
use waygate_session::testkit::{echo_edge, test_client};
use waygate_session::SessionConfig;
use waygate_transport::mem::{mem_pair, MemConnection as MemConn};
use waygate_transport::{CloseCode, TrafficClass};

fn unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// An edge whose session layer runs on the Redis stores, with the kick subscription wired
/// to its registry (what the lead wires in edge.rs).
fn edge(id: &str, stores: &RedisStores) -> Arc<SessionLayer> {
    let config = SessionConfig {
        linger: Duration::from_secs(30),
        ..SessionConfig::default()
    };
    let (mut e, _sink) = echo_edge(id, config);
    e.snapshots = stores.snapshots.clone();
    e.ownership = stores.ownership.clone();
    let registry = e.registry.clone();
    let mut kicks = stores.ownership.subscribe_kicks(id);
    tokio::spawn(async move {
        while let Some(k) = kicks.recv().await {
            registry.kick(&k.session_id);
        }
    });
    Arc::new(e)
}

fn client(player: &str) -> ClientSession {
    test_client(player, unix(), 600)
}

async fn exchange(
    c: &mut ClientSession,
    conn: &mut MemConn,
    events: &mut Vec<ClientEvent>,
    within: Duration,
    want: impl Fn(&[ClientEvent]) -> bool,
) {
    waygate_session::testkit::drive_client(c, conn, events, within, want).await;
}

use waygate_session::testkit::{log_in, welcomes};

/// Pushes `payload` (msg id `msg_id`, class normal) to session `sid` on `edge`.
fn push(
    edge: &SessionLayer,
    sid: &waygate_protocol::frame::SessionId,
    msg_id: u32,
    payload: &'static [u8],
) {
    edge.registry
        .push(
            sid,
            Downstream {
                class: TrafficClass::Normal,
                msg_id,
                payload: Bytes::from_static(payload),
            },
        )
        .expect("push");
}

fn payloads(events: &[ClientEvent]) -> Vec<Bytes> {
    events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Message { payload, .. } => Some(payload.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_on_another_edge_from_redis_and_the_old_copy_is_kicked() {
    let server = RedisServer::start();
    let s1 = RedisStores::connect(&server.url()).await.expect("connect");
    let s2 = RedisStores::connect(&server.url()).await.expect("connect");
    let edge1 = edge("edge-1", &s1);
    let edge2 = edge("edge-2", &s2);
    tokio::time::sleep(Duration::from_millis(200)).await; // kick subscriptions up

    let (task1, mut c, conn, mut events) =
        log_in(&edge1, client("p"), Duration::from_secs(2)).await;
    assert_eq!(welcomes(&events), vec![WelcomeOutcome::NewSession]);
    let sid = edge1.registry.session_of("p").expect("registered");
    let first = s1.ownership.owner("p").await.expect("owner").expect("some");
    assert_eq!((first.session_id, first.edge.as_str()), (sid, "edge-1"));
    // A message the client never receives: the link drops first.
    drop(conn);
    c.handle_link_down(Instant::now(), CloseCode::GoingAway);
    tokio::time::sleep(Duration::from_millis(100)).await;
    push(&edge1, &sid, 1, b"while away");
    // The detached session's snapshot reaches Redis (written on detach, then updated).
    let deadline = Instant::now() + Duration::from_secs(2);
    while s2.snapshots.get(&sid).await.expect("get").is_none() {
        assert!(
            Instant::now() < deadline,
            "snapshot not persisted on detach"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Resume on edge 2 from the warm tier.
    let (server_end, mut conn2) = mem_pair();
    let _task2 = edge2.spawn(Box::new(server_end));
    c.connect(Instant::now()).expect("hello");
    exchange(
        &mut c,
        &mut conn2,
        &mut events,
        Duration::from_secs(2),
        |e| welcomes(e).len() == 2,
    )
    .await;
    let outcome = welcomes(&events)[1];
    assert!(
        matches!(
            outcome,
            WelcomeOutcome::Restored | WelcomeOutcome::RestoredWithGap
        ),
        "{outcome:?}"
    );
    let owner = s2.ownership.owner("p").await.expect("owner").expect("some");
    assert_eq!((owner.session_id, owner.edge.as_str()), (sid, "edge-2"));
    assert!(owner.fencing > first.fencing);
    // The snapshot was taken (single use).
    assert_eq!(s1.snapshots.get(&sid).await, Ok(None));
    // Edge 1's lingering copy is kicked across edges at once, not after the 30 s linger,
    // and it does not release edge 2's ownership.
    let end = tokio::time::timeout(Duration::from_secs(3), task1)
        .await
        .expect("old copy kicked within 3 s")
        .expect("join");
    assert_eq!(end, EndReason::Kicked);
    assert_eq!(edge1.registry.session_of("p"), None);
    let owner = s1.ownership.owner("p").await.expect("owner").expect("some");
    assert_eq!(owner.edge, "edge-2");
    // The session works on edge 2.
    push(&edge2, &sid, 2, b"on edge 2");
    exchange(
        &mut c,
        &mut conn2,
        &mut events,
        Duration::from_secs(2),
        |e| payloads(e).contains(&Bytes::from_static(b"on edge 2")),
    )
    .await;
    assert!(payloads(&events).contains(&Bytes::from_static(b"on edge 2")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_login_on_another_edge_kicks_the_first() {
    let server = RedisServer::start();
    let s1 = RedisStores::connect(&server.url()).await.expect("connect");
    let s2 = RedisStores::connect(&server.url()).await.expect("connect");
    let edge1 = edge("edge-1", &s1);
    let edge2 = edge("edge-2", &s2);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (a_end, mut a_conn) = mem_pair();
    let task1 = edge1.spawn(Box::new(a_end));
    let mut a = client("p");
    let mut a_events = Vec::new();
    a.connect(Instant::now()).expect("hello");
    exchange(
        &mut a,
        &mut a_conn,
        &mut a_events,
        Duration::from_secs(2),
        |e| !welcomes(e).is_empty(),
    )
    .await;
    let (b_end, mut b_conn) = mem_pair();
    let _task2 = edge2.spawn(Box::new(b_end));
    let mut b = client("p");
    let mut b_events = Vec::new();
    b.connect(Instant::now()).expect("hello");
    exchange(
        &mut b,
        &mut b_conn,
        &mut b_events,
        Duration::from_secs(2),
        |e| !welcomes(e).is_empty(),
    )
    .await;
    assert_eq!(welcomes(&b_events), vec![WelcomeOutcome::NewSession]);
    exchange(
        &mut a,
        &mut a_conn,
        &mut a_events,
        Duration::from_secs(3),
        |e| {
            e.iter()
                .any(|x| matches!(x, ClientEvent::Disconnected { .. }))
        },
    )
    .await;
    assert!(
        a_events.iter().any(|x| matches!(
            x,
            ClientEvent::Disconnected {
                code: CloseCode::Kicked
            }
        )),
        "{a_events:?}"
    );
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(2), task1)
            .await
            .expect("ended")
            .expect("join"),
        EndReason::Kicked
    );
    assert_eq!(
        s1.ownership
            .owner("p")
            .await
            .expect("owner")
            .map(|o| o.edge),
        Some("edge-2".into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_new_logins_end_unavailable_within_a_second_live_sessions_stay() {
    let mut server = RedisServer::start();
    let s1 = RedisStores::connect(&server.url()).await.expect("connect");
    let edge1 = edge("edge-1", &s1);
    let (a_end, mut a_conn) = mem_pair();
    let _live = edge1.spawn(Box::new(a_end));
    let mut a = client("alive");
    let mut a_events = Vec::new();
    a.connect(Instant::now()).expect("hello");
    exchange(
        &mut a,
        &mut a_conn,
        &mut a_events,
        Duration::from_secs(2),
        |e| !welcomes(e).is_empty(),
    )
    .await;
    let live_sid = edge1.registry.session_of("alive").expect("live");

    server.stop();
    let (b_end, mut b_conn) = mem_pair();
    let _task = edge1.spawn(Box::new(b_end));
    let mut b = client("newcomer");
    let mut b_events = Vec::new();
    let t = Instant::now();
    b.connect(Instant::now()).expect("hello");
    exchange(
        &mut b,
        &mut b_conn,
        &mut b_events,
        Duration::from_secs(3),
        |e| {
            e.iter().any(|x| {
                matches!(
                    x,
                    ClientEvent::Rejected { .. } | ClientEvent::Disconnected { .. }
                )
            })
        },
    )
    .await;
    let took = t.elapsed();
    let refused = b_events.iter().find_map(|x| match x {
        ClientEvent::Rejected {
            code,
            retry_after_ms,
            ..
        } => Some((*code, Some(*retry_after_ms))),
        ClientEvent::Disconnected { code } => Some((*code, None)),
        _ => None,
    });
    let (code, retry_after) = refused.unwrap_or_else(|| panic!("no answer: {b_events:?}"));
    assert_eq!(code, CloseCode::Unavailable, "{b_events:?}");
    assert!(took < Duration::from_secs(1), "answered after {took:?}");
    eprintln!("login with Redis down: {code:?}, retry-after {retry_after:?}, after {took:?}");

    // The live session is untouched: messages still flow both ways.
    push(&edge1, &live_sid, 5, b"still here");
    exchange(
        &mut a,
        &mut a_conn,
        &mut a_events,
        Duration::from_secs(2),
        |e| payloads(e).contains(&Bytes::from_static(b"still here")),
    )
    .await;
    assert!(payloads(&a_events).contains(&Bytes::from_static(b"still here")));
    assert!(!a_events
        .iter()
        .any(|x| matches!(x, ClientEvent::Disconnected { .. })));
}

/// Silent-drop audit: a session copy superseded by a newer claim (here: the player claimed
/// again on the same edge, so no kick notice is published — as when a notice is lost) kept
/// taking pushes its client would never see until the ownership sweep, its write-through
/// refused `Fenced` and only counted. The first fenced write now ends the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_whose_write_through_is_fenced_ends_at_once() {
    let server = RedisServer::start();
    let stores = RedisStores::connect(&server.url()).await.expect("connect");
    let config = SessionConfig {
        linger: Duration::from_secs(30),
        ..SessionConfig::default()
    };
    // No kick subscription: the copy can only learn of the newer claim by writing.
    let (mut e, _sink) = echo_edge("edge-1", config);
    e.snapshots = stores.snapshots.clone();
    e.ownership = stores.ownership.clone();
    e.write_through = Some(waygate_session::write_through::WriteThrough::start(
        stores.snapshots.clone(),
        Duration::from_secs(30),
        Duration::from_secs(1),
    ));
    let edge1 = Arc::new(e);
    let (task, mut c, mut conn, mut events) =
        log_in(&edge1, client("p"), Duration::from_secs(2)).await;
    let sid = edge1.registry.session_of("p").expect("registered");
    // A newer claim of the player the copy is not told of.
    stores
        .ownership
        .claim("p", &sid, "edge-1")
        .await
        .expect("claim");
    push(&edge1, &sid, 1, b"after the newer claim");
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            // Keep the client reading so the session's turns go on.
            exchange(
                &mut c,
                &mut conn,
                &mut events,
                Duration::from_millis(100),
                |_| false,
            )
            .await;
            if task.is_finished() {
                return;
            }
        }
    })
    .await;
    assert!(end.is_ok(), "the fenced copy still runs after 5 s");
    assert_eq!(task.await.expect("join"), EndReason::Kicked);
}

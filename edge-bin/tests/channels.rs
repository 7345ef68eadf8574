//! Channels over real sockets (PROTOCOL.md §12; SPEC F1, F2, F4, F5), and pushes to a player
//! anywhere (PLAYER_PUSH, §9.7): a backend joins sessions
//! on every transport and publishes; every member sees every recoverable publication once,
//! in offset order, through link drops; a new session recovers what it missed from the
//! history, or is told the history is lost; refusals reach the publisher as typed codes.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::timeout;
use waygate_backend::{BackendError, BackendSession};
use waygate_client::{ChannelPosition, ChannelUpdate, Client, ClientOptions, Event};
use waygate_transport::endpoint::{ConnectOptions, Endpoint};
use waygate_transport::tls::ClientTls;
use waygate_transport::{CloseCode, TrafficClass, TransportKind};

use common::keeper::SessionKeeper as Sessions;

struct Setup {
    edge: waygate_edge::edge::Edge,
    sessions: Arc<Sessions>,
    tls: ClientTls,
    _backend: waygate_backend::Backend,
    _dir: tempfile::TempDir,
}

async fn setup(tune: impl FnOnce(&mut waygate_edge::config::EdgeConfig)) -> Setup {
    let sessions = Arc::new(Sessions::default());
    let (edge, backend, dir) = common::edge_over(sessions.clone(), tune).await;
    let tls = ClientTls::from_ca_pem(edge.dev_ca_pem.as_deref().unwrap()).unwrap();
    Setup {
        edge,
        sessions,
        tls,
        _backend: backend,
        _dir: dir,
    }
}

impl Setup {
    /// A client of `player` over `kind`, whose session has reached the backend.
    async fn member(&self, kind: TransportKind, player: &str) -> (Client, BackendSession) {
        let mut endpoint = Endpoint::new(kind, self.edge.addrs[&kind]);
        endpoint.host = "localhost".into();
        let mut options = ClientOptions::new(vec![endpoint], common::token(player));
        options.connect = ConnectOptions {
            tls: Some(self.tls.clone()),
            ..ConnectOptions::default()
        };
        let client = Client::start(options);
        let before = self.sessions.get(player).map(|s| *s.session_id());
        // SESSION_OPEN reaches the backend with the session's first upstream message.
        client
            .send(TrafficClass::Normal, 1000, Bytes::from_static(b"hello"))
            .await
            .unwrap();
        let session = poll_until(Duration::from_secs(10), || async {
            self.sessions
                .get(player)
                .filter(|s| Some(*s.session_id()) != before)
        })
        .await
        .expect("session reached the backend");
        (client, session)
    }
}

/// Polls `f` until it gives a value (every 20 ms, at most `limit`).
async fn poll_until<T, F: std::future::Future<Output = Option<T>>>(
    limit: Duration,
    mut f: impl FnMut() -> F,
) -> Option<T> {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if let Some(v) = f().await {
            return Some(v);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Publishes `p<i>` (normal) to `channel` for every `i` of `range`, in order.
async fn publish_range(
    publisher: &BackendSession,
    channel: &str,
    range: std::ops::RangeInclusive<u64>,
) {
    for i in range {
        publisher
            .publish(channel, TrafficClass::Normal, Bytes::from(format!("p{i}")))
            .await
            .unwrap();
    }
}

/// The next channel update of `client` (other events skipped).
/// Waits (at most 5 s: the channel gauges and counters are updated once a second) for a
/// line of the edge's /metrics that starts with `line`.
async fn expect_metric_line(edge: &waygate_edge::edge::Edge, line: &str) {
    let admin = edge.admin_addr.unwrap();
    let found = poll_until(Duration::from_secs(5), || async {
        let (_, m) = common::http(admin, "GET", "/metrics").await;
        m.lines().find(|l| l.starts_with(line)).map(drop)
    })
    .await;
    assert!(found.is_some(), "{line}");
}

async fn next_update(client: &mut Client) -> ChannelUpdate {
    loop {
        let event = timeout(Duration::from_secs(10), client.next_event())
            .await
            .expect("a channel event in time")
            .expect("client running");
        if let Event::Channel(u) = event {
            return u;
        }
    }
}

fn body_of(u: &ChannelUpdate) -> (u64, String) {
    match u {
        ChannelUpdate::Publication { position, body, .. } => {
            (position.offset, String::from_utf8(body.to_vec()).unwrap())
        }
        other => panic!("expected a publication, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_on_every_transport_see_every_publication_once_in_order_through_drops() {
    let s = setup(|_| {}).await;
    let kinds = [
        TransportKind::Tcp,
        TransportKind::Ws,
        TransportKind::Quic,
        TransportKind::Kcp,
    ];
    let mut members = Vec::new();
    for kind in kinds {
        let (client, session) = s.member(kind, &format!("m-{kind}")).await;
        let live = session.join_channel("room:hall", None).await.unwrap();
        members.push((kind, client, session));
        assert_eq!(live.offset, 0);
    }
    let publisher = members[0].2.clone();
    let total = 120u64;
    let mut expected_epoch = None;
    for i in 1..=total {
        let class = if i % 10 == 0 {
            TrafficClass::Critical
        } else {
            TrafficClass::Normal
        };
        let r = publisher
            .publish("room:hall", class, Bytes::from(format!("msg-{i}")))
            .await
            .unwrap();
        assert_eq!(r.position.offset, i);
        assert!(!r.duplicate);
        expected_epoch.get_or_insert(r.position.epoch);
        if i == total / 3 || i == 2 * total / 3 {
            // The network drops every member's link; each resumes by itself.
            for (_, client, _) in &members {
                client.drop_link().await.expect("client running");
            }
        }
    }
    for (kind, client, _) in &mut members {
        match next_update(client).await {
            ChannelUpdate::Joined { channel, position } => {
                assert_eq!(channel, "room:hall");
                assert_eq!(Some(position.epoch), expected_epoch);
            }
            other => panic!("{kind}: expected JOINED first, got {other:?}"),
        }
        for i in 1..=total {
            let (offset, body) = body_of(&next_update(client).await);
            assert_eq!(
                (offset, body.as_str()),
                (i, format!("msg-{i}").as_str()),
                "{kind}"
            );
        }
        assert_eq!(
            client.channel_positions()["room:hall"],
            ChannelPosition {
                epoch: expected_epoch.unwrap(),
                offset: total
            }
        );
    }
    // LEAVE: what came before, then LEFT; nothing after.
    members[1].2.leave_channel("room:hall").await.unwrap();
    publisher
        .publish(
            "room:hall",
            TrafficClass::Normal,
            Bytes::from_static(b"after"),
        )
        .await
        .unwrap();
    let (offset, body) = body_of(&next_update(&mut members[0].1).await);
    assert_eq!((offset, body.as_str()), (total + 1, "after"));
    let (kind, client, _) = &mut members[1];
    assert!(
        matches!(next_update(client).await, ChannelUpdate::Left { ref channel, .. } if channel == "room:hall"),
        "{kind}"
    );
    assert!(client.channel_positions().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_session_recovers_what_it_missed_or_is_told_the_history_is_lost() {
    let s = setup(|c| {
        let guild = c.channels.kinds.get_mut("guild").unwrap();
        guild.history_len = 4;
    })
    .await;
    let (_pub_client, publisher) = s.member(TransportKind::Tcp, "publisher").await;
    let (mut client, session) = s.member(TransportKind::Tcp, "returning").await;
    session.join_channel("guild:g", None).await.unwrap();
    publish_range(&publisher, "guild:g", 1..=3).await;
    next_update(&mut client).await; // JOINED
    for _ in 1..=3 {
        next_update(&mut client).await;
    }
    let last = client.channel_positions()["guild:g"];
    assert_eq!(last.offset, 3);
    client.close().await;
    drop(client);
    // Published while the player is away.
    publish_range(&publisher, "guild:g", 4..=6).await;
    // A new login: the game hands its backend the last position; the join recovers. Over
    // QUIC: the recovered publications and the JOINED after them share one lane (they used
    // to travel as normal and critical DATA on different QUIC streams, so JOINED could
    // overtake them and the client dropped them as already seen).
    let (mut client, session) = s.member(TransportKind::Quic, "returning").await;
    let live = session.join_channel("guild:g", Some(last)).await.unwrap();
    assert_eq!(live.offset, 6);
    for i in 4..=6 {
        let (offset, body) = body_of(&next_update(&mut client).await);
        assert_eq!((offset, body), (i, format!("p{i}")));
    }
    assert!(matches!(
        next_update(&mut client).await,
        ChannelUpdate::Joined { position, .. } if position.offset == 6
    ));
    // Trimmed: 4 kept (7..=10 after four more), so recovering after 3 is impossible.
    publish_range(&publisher, "guild:g", 7..=10).await;
    let (mut late, late_session) = s.member(TransportKind::Quic, "late").await;
    late_session
        .join_channel("guild:g", Some(last))
        .await
        .unwrap();
    match next_update(&mut late).await {
        ChannelUpdate::HistoryLost { channel, position } => {
            assert_eq!(channel, "guild:g");
            assert_eq!(position.offset, 10);
        }
        other => panic!("expected HISTORY_LOST, got {other:?}"),
    }
    // Another epoch (e.g. a position from before a restart) is lost history too.
    let (mut other, other_session) = s.member(TransportKind::Kcp, "other-epoch").await;
    let foreign = ChannelPosition {
        epoch: last.epoch ^ 1,
        offset: 9,
    };
    other_session
        .join_channel("guild:g", Some(foreign))
        .await
        .unwrap();
    assert!(matches!(
        next_update(&mut other).await,
        ChannelUpdate::HistoryLost { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_reach_the_publisher_as_typed_codes_and_a_retry_is_not_published_twice() {
    let s = setup(|c| {
        let room = c.channels.kinds.get_mut("room").unwrap();
        room.publish_rate = 1;
        room.publish_burst = 3;
        // The edge remembers 4 publish ids, each for the (15 min) window.
        c.channels.dedup_max_ids = 4;
    })
    .await;
    let (mut client, session) = s.member(TransportKind::Tcp, "p").await;
    session.join_channel("room:r", None).await.unwrap();
    fn refused<T: std::fmt::Debug>(r: Result<T, BackendError>) -> (CloseCode, u32) {
        match r {
            Err(BackendError::ChannelRefused {
                code,
                retry_after_ms,
            }) => (code, retry_after_ms),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
    let (code, _) = refused(
        session
            .publish("nosuch:1", TrafficClass::Normal, Bytes::new())
            .await,
    );
    assert_eq!(code, CloseCode::UnknownChannelKind);
    // Regression (bounds audit): the refused kind became a metric label, so a backend
    // naming ever new kinds made ever new series; they are all `unknown` now.
    for kind in ["nosuch2", "nosuch3"] {
        let (code, _) = refused(
            session
                .publish(&format!("{kind}:1"), TrafficClass::Normal, Bytes::new())
                .await,
        );
        assert_eq!(code, CloseCode::UnknownChannelKind);
    }
    expect_metric_line(
        &s.edge,
        "waygate_channel_publishes_total{kind=\"unknown\",class=\"normal\",result=\"unknown_channel_kind\"} 3",
    )
    .await;
    let (_, metrics) = common::http(s.edge.admin_addr.unwrap(), "GET", "/metrics").await;
    assert!(!metrics.contains("nosuch"), "a backend's kind as a label");
    let (code, _) = refused(session.join_channel("bad name", None).await);
    assert_eq!(code, CloseCode::ProtocolError);
    // A retried publish (same id) is answered with the first result, published once.
    let id = waygate_backend::next_request_id();
    let first = session
        .publish_with_id(id, "room:r", TrafficClass::Normal, Bytes::from_static(b"x"))
        .await
        .unwrap();
    let again = session
        .publish_with_id(id, "room:r", TrafficClass::Normal, Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert!(!first.duplicate && again.duplicate);
    assert_eq!(first.position, again.position);
    // The channel's rate: burst 3, one taken; the third publish from now is refused.
    let say = |body: &'static [u8]| {
        session.publish("room:r", TrafficClass::Normal, Bytes::from_static(body))
    };
    say(b"y").await.unwrap();
    say(b"z").await.unwrap();
    let (code, retry) = refused(say(b"").await);
    assert_eq!(code, CloseCode::RateLimited);
    assert!(
        retry > 0 && retry <= 1_000,
        "a rate refusal says when to retry: {retry}"
    );
    // The fourth id fills the edge's publish-id window; a fifth is refused until the
    // oldest id expires (never forgotten early), while a retry of a remembered id is
    // still answered.
    tokio::time::sleep(Duration::from_millis(u64::from(retry))).await;
    say(b"w").await.unwrap();
    let (code, retry) = refused(say(b"").await);
    assert_eq!(code, CloseCode::RateLimited);
    assert!(
        retry > 800_000,
        "retry when the oldest id expires: {retry} ms"
    );
    let again = session
        .publish_with_id(id, "room:r", TrafficClass::Normal, Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert!(again.duplicate);
    expect_metric_line(&s.edge, "waygate_channel_publish_ids 4").await;
    next_update(&mut client).await; // JOINED
    let got: Vec<_> = [
        next_update(&mut client).await,
        next_update(&mut client).await,
        next_update(&mut client).await,
    ]
    .iter()
    .map(body_of)
    .collect();
    assert_eq!(
        got,
        [
            (1, "x".to_owned()),
            (2, "y".to_owned()),
            (3, "z".to_owned())
        ]
    );
    // A session that ended (here: ended by the game) is not a member of anything, and
    // cannot be joined.
    session.kick(CloseCode::Normal, "game over").await.unwrap();
    poll_until(Duration::from_secs(10), || async {
        match session.join_channel("room:r", None).await {
            Err(BackendError::ChannelRefused {
                code: CloseCode::MemberOffline,
                ..
            }) => Some(()),
            _ => None,
        }
    })
    .await
    .expect("member_offline for an ended session");
}

#[path = "support_redis/mod.rs"]
mod support_redis;

/// Two in-process edges over one backend keeping its sessions (sharing Redis when given).
struct TwoEdges {
    sessions: Arc<Sessions>,
    edges: Vec<waygate_edge::edge::Edge>,
    _backend: waygate_backend::Backend,
    _dir: tempfile::TempDir,
}

/// A backend instance `id` on loopback whose service is `sessions`.
async fn sessions_backend(id: &str, sessions: &Arc<Sessions>) -> waygate_backend::Backend {
    waygate_backend::Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        waygate_backend::BackendConfig::new(id),
        sessions.clone(),
    )
    .await
    .unwrap()
}

async fn two_edges(ids: [&str; 2], redis_url: Option<String>) -> TwoEdges {
    two_edges_tuned(ids, redis_url, |_, _| {}).await
}

async fn two_edges_tuned(
    ids: [&str; 2],
    redis_url: Option<String>,
    tune: impl Fn(&mut waygate_edge::config::EdgeConfig, std::net::SocketAddr),
) -> TwoEdges {
    let sessions = Arc::new(Sessions::default());
    let backend = sessions_backend("b1", &sessions).await;
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, common::table(&[backend.local_addr()], 1, None)).unwrap();
    let mut edges = Vec::new();
    for id in ids {
        let mut config = waygate_edge::config::EdgeConfig::default();
        config.use_ephemeral_ports();
        config.edge_id = id.into();
        config.routing.table = Some(routes.clone());
        if let Some(url) = &redis_url {
            config.cluster.redis_url = url.clone();
        }
        tune(&mut config, backend.local_addr());
        edges.push(waygate_edge::edge::Edge::start(config).await.unwrap());
    }
    TwoEdges {
        sessions,
        edges,
        _backend: backend,
        _dir: dir,
    }
}

impl TwoEdges {
    /// Player "mover"'s client over TCP (edge 1 first, then edge 2) and its session at the
    /// backend, on edge 1.
    async fn mover(&self) -> (Client, BackendSession) {
        let endpoints: Vec<Endpoint> = self
            .edges
            .iter()
            .map(|e| Endpoint::new(TransportKind::Tcp, e.addrs[&TransportKind::Tcp]))
            .collect();
        let client = Client::start(ClientOptions::new(endpoints, common::token("mover")));
        client
            .send(TrafficClass::Normal, 1000, Bytes::from_static(b"hi"))
            .await
            .unwrap();
        let sessions = &self.sessions;
        let on_edge1 = poll_until(Duration::from_secs(10), || async { sessions.get("mover") })
            .await
            .unwrap();
        assert_eq!(on_edge1.edge_id(), "edge-1");
        (client, on_edge1)
    }

    /// Moves `client` to edge 2 (its link to edge 1 drops; it resumes from Redis there) and
    /// returns its session there, once a message of it reached the backend through edge 2.
    async fn move_to_edge2(&self, client: &mut Client) -> BackendSession {
        client.prefer_endpoint(1).await;
        client.drop_link().await.expect("client running");
        client
            .send(TrafficClass::Normal, 1000, Bytes::from_static(b"again"))
            .await
            .unwrap();
        let sessions = &self.sessions;
        poll_until(Duration::from_secs(10), || async {
            sessions.get("mover").filter(|s| s.edge_id() == "edge-2")
        })
        .await
        .unwrap()
    }
}

/// A session's channel memberships travel in its snapshot: resumed on another edge (through
/// Redis), it is a member there too. That edge's channel is another epoch, so the client is
/// told HISTORY_LOST (never a silent loss of its membership or of what it missed), then
/// receives that edge's publications.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memberships_travel_with_a_session_resumed_on_another_edge() {
    let redis = support_redis::RedisServer::start();
    let two = two_edges(["edge-1", "edge-2"], Some(redis.url())).await;
    let (mut client, on_edge1) = two.mover().await;
    on_edge1.join_channel("guild:g", None).await.unwrap();
    let r = on_edge1
        .publish("guild:g", TrafficClass::Normal, Bytes::from_static(b"one"))
        .await
        .unwrap();
    assert!(matches!(
        next_update(&mut client).await,
        ChannelUpdate::Joined { .. }
    ));
    assert_eq!(body_of(&next_update(&mut client).await), (1, "one".into()));
    let on_edge2 = two.move_to_edge2(&mut client).await;
    match next_update(&mut client).await {
        ChannelUpdate::HistoryLost { channel, position } => {
            assert_eq!(channel, "guild:g");
            assert_ne!(
                position.epoch, r.position.epoch,
                "edge 2's channel is its own epoch"
            );
        }
        other => panic!("expected HISTORY_LOST on edge 2, got {other:?}"),
    }
    on_edge2
        .publish("guild:g", TrafficClass::Normal, Bytes::from_static(b"two"))
        .await
        .unwrap();
    assert_eq!(body_of(&next_update(&mut client).await), (1, "two".into()));
    drop(two);
}

/// A backend's join is in its session's snapshot from the moment the edge takes it, not
/// only once its JOINED reaches the session: a session restored on another edge while its
/// first join of a new channel still waits for the backends' acknowledgements (PROTOCOL.md
/// §12.6) is a member there (HISTORY_LOST: another edge's epoch), then gets that edge's
/// publications. Channels audit: before, the membership was lost on the way (no JOINED, no
/// LEFT, nothing more), while the backend had it joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_still_waiting_travels_with_a_session_resumed_on_another_edge() {
    let redis = support_redis::RedisServer::start();
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let silent = tokio::spawn(silent_interest_backend(silent));
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes-edge-1.toml");
    // Edge 1 also links to a backend that never acknowledges a channel notice (an instance
    // of the room service no player is routed to), so its new channels wait.
    let two = two_edges_tuned(["edge-1", "edge-2"], Some(redis.url()), |c, b1| {
        if c.edge_id == "edge-1" {
            std::fs::write(&routes, common::table(&[b1, silent_addr], 1, Some(1))).unwrap();
            c.routing.table = Some(routes.clone());
        }
    })
    .await;
    let (_silent_io, _notices) = silent.await.unwrap();
    let (mut client, on_edge1) = two.mover().await;
    let joining = tokio::spawn({
        let member = on_edge1.clone();
        async move { member.join_channel("guild:g", None).await }
    });
    expect_metric_line(&two.edges[0], "waygate_channels_awaiting_backends 1").await;
    let on_edge2 = two.move_to_edge2(&mut client).await;
    match next_update(&mut client).await {
        ChannelUpdate::HistoryLost { channel, .. } => assert_eq!(channel, "guild:g"),
        other => panic!("expected HISTORY_LOST for guild:g on edge 2, got {other:?}"),
    }
    on_edge2
        .publish("guild:g", TrafficClass::Normal, Bytes::from_static(b"two"))
        .await
        .unwrap();
    assert_eq!(body_of(&next_update(&mut client).await), (1, "two".into()));
    joining.abort();
    drop(two);
}

/// A publish on every edge: one result per edge, members of both edges receive it; retried
/// with the same id after the fact, every edge answers `duplicate` and nobody receives it
/// twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_on_every_edge_has_a_result_per_edge_and_retries_publish_nothing_twice() {
    let two = two_edges(["edge-a", "edge-b"], None).await;
    let (sessions, edges) = (two.sessions.clone(), &two.edges);
    let mut clients = Vec::new();
    for (i, edge) in edges.iter().enumerate() {
        let player = format!("member-{i}");
        let endpoint = Endpoint::new(TransportKind::Tcp, edge.addrs[&TransportKind::Tcp]);
        let client = Client::start(ClientOptions::new(vec![endpoint], common::token(&player)));
        client
            .send(TrafficClass::Normal, 1000, Bytes::from_static(b"hi"))
            .await
            .unwrap();
        let session = poll_until(Duration::from_secs(10), || async { sessions.get(&player) })
            .await
            .unwrap();
        session.join_channel("world", None).await.unwrap();
        clients.push((client, session));
    }
    let id = waygate_backend::next_request_id();
    let results = clients[0]
        .1
        .publish_on_every_edge_with_id(id, "world", TrafficClass::Normal, Bytes::from_static(b"x"))
        .await;
    let edges_answered: Vec<_> = results.iter().map(|r| r.edge_id.as_str()).collect();
    assert_eq!(edges_answered, ["edge-a", "edge-b"]);
    for r in &results {
        let receipt = r.result.as_ref().unwrap();
        assert_eq!((receipt.position.offset, receipt.duplicate), (1, false));
    }
    let again = clients[1]
        .1
        .publish_on_every_edge_with_id(id, "world", TrafficClass::Normal, Bytes::from_static(b"x"))
        .await;
    assert!(again.iter().all(|r| r.result.as_ref().unwrap().duplicate));
    clients[0]
        .1
        .publish_on_every_edge("world", TrafficClass::Normal, Bytes::from_static(b"y"))
        .await;
    for (client, _) in &mut clients {
        assert!(matches!(
            next_update(client).await,
            ChannelUpdate::Joined { .. }
        ));
        assert_eq!(body_of(&next_update(client).await), (1, "x".into()));
        assert_eq!(
            body_of(&next_update(client).await),
            (2, "y".into()),
            "x only once"
        );
    }
    drop(two);
}

/// A kind with backlog (guild by default): the edge remembers the position a departed
/// member's client acknowledged; the player's next session, joined without a position,
/// receives what it missed, in order. A kind without backlog (room) starts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returning_member_of_a_kind_with_backlog_gets_what_it_missed_without_a_position() {
    let s = setup(|_| {}).await;
    let (_pub_client, publisher) = s.member(TransportKind::Tcp, "guild-publisher").await;
    let (mut client, session) = s.member(TransportKind::Tcp, "guild-member").await;
    session.join_channel("guild:backlog", None).await.unwrap();
    session.join_channel("room:nobacklog", None).await.unwrap();
    for i in 1..=3 {
        publisher
            .publish(
                "guild:backlog",
                TrafficClass::Normal,
                Bytes::from(format!("g{i}")),
            )
            .await
            .unwrap();
    }
    let mut got = 0;
    while got < 3 {
        if let ChannelUpdate::Publication { channel, .. } = next_update(&mut client).await {
            assert_eq!(channel, "guild:backlog");
            got += 1;
        }
    }
    // Give the client's delayed ack time to reach the edge, then it goes away for good.
    tokio::time::sleep(Duration::from_millis(300)).await;
    client.close().await;
    drop(client);
    for i in 4..=5 {
        publisher
            .publish(
                "guild:backlog",
                TrafficClass::Normal,
                Bytes::from(format!("g{i}")),
            )
            .await
            .unwrap();
        publisher
            .publish(
                "room:nobacklog",
                TrafficClass::Normal,
                Bytes::from(format!("r{i}")),
            )
            .await
            .unwrap();
    }
    // A new login (it takes over the lingering session, which ends): joined without a
    // position, the guild delivers 4 and 5 first; the room only goes live.
    let (mut client, session) = s.member(TransportKind::Ws, "guild-member").await;
    let live = session.join_channel("guild:backlog", None).await.unwrap();
    assert_eq!(live.offset, 5);
    for i in 4..=5 {
        let (offset, body) = body_of(&next_update(&mut client).await);
        assert_eq!((offset, body), (i, format!("g{i}")));
    }
    assert!(matches!(
        next_update(&mut client).await,
        ChannelUpdate::Joined { position, .. } if position.offset == 5
    ));
    session.join_channel("room:nobacklog", None).await.unwrap();
    assert!(matches!(
        next_update(&mut client).await,
        ChannelUpdate::Joined { channel, position } if channel == "room:nobacklog" && position.offset == 2
    ));
}

/// One edge for the announcement tests: the backend keeping sessions, the edge configured
/// by `tune` (its announcement log), a client of `player` whose session reached the backend.
async fn announcement_edge(
    tune: impl FnOnce(&mut waygate_edge::config::EdgeConfig),
    player: &str,
) -> (Setup, Client, BackendSession) {
    let s = setup(tune).await;
    let (client, session) = s.member(TransportKind::Tcp, player).await;
    (s, client, session)
}

/// [`announcement_edge`] with id `edge_id`, its announcement log in the Redis at `url`.
async fn redis_announcement_edge(
    url: &str,
    edge_id: &str,
    player: &str,
) -> (Setup, Client, BackendSession) {
    announcement_edge(
        |c| {
            c.edge_id = edge_id.into();
            c.cluster.redis_url = url.to_owned();
        },
        player,
    )
    .await
}

/// Publishes, on `session`'s edge, announcements a2 and a4 around a normal n3, after the
/// member saw a1 (returned: its position), then closes the member.
async fn announcements_while_away(mut client: Client, session: &BackendSession) -> ChannelPosition {
    session.join_channel("system:news", None).await.unwrap();
    let a1 = session
        .publish(
            "system:news",
            TrafficClass::Critical,
            Bytes::from_static(b"a1"),
        )
        .await
        .unwrap();
    assert_eq!(a1.position.offset, 1);
    next_update(&mut client).await; // JOINED
    assert_eq!(body_of(&next_update(&mut client).await), (1, "a1".into()));
    let seen = client.channel_positions()["system:news"];
    client.close().await;
    drop(client);
    for (class, body) in [
        (TrafficClass::Critical, "a2"),
        (TrafficClass::Normal, "n3"),
        (TrafficClass::Critical, "a4"),
    ] {
        session
            .publish("system:news", class, Bytes::from(body))
            .await
            .unwrap();
    }
    seen
}

/// What a new session joined with `since` receives: the logged announcements after it, in
/// order, then HISTORY_LOST (the normal publication n3 died with the channel's epoch).
async fn expect_announcements_then_history_lost(client: &mut Client, since: ChannelPosition) {
    for (offset, body) in [(2, "a2"), (4, "a4")] {
        match next_update(client).await {
            ChannelUpdate::Publication {
                position, body: b, ..
            } => {
                assert_eq!(
                    position,
                    ChannelPosition {
                        epoch: since.epoch,
                        offset
                    }
                );
                assert_eq!(b, Bytes::from(body));
            }
            other => panic!("expected announcement {body} from the log, got {other:?}"),
        }
    }
    match next_update(client).await {
        ChannelUpdate::HistoryLost { position, .. } => {
            assert_ne!(
                position.epoch, since.epoch,
                "the channel here is a new epoch"
            );
        }
        other => panic!("expected HISTORY_LOST after the logged announcements, got {other:?}"),
    }
}

/// SPEC F2 with one edge (the file log): an announcement is taken once it is in the file;
/// the edge restarts (its channels come back as new epochs) and a returning player joined
/// from its last position receives the announcements it missed from the file, then
/// HISTORY_LOST for the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcements_outlive_an_edge_restart_in_the_file_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("announcements.log");
    let file = path.to_str().unwrap().to_owned();
    let (s, client, session) =
        announcement_edge(|c| c.channels.announcement_log = file.clone(), "reader").await;
    let seen = announcements_while_away(client, &session).await;
    assert!(std::fs::metadata(&path).unwrap().len() > 0);
    drop(session);
    drop(s);
    // The restarted edge (same file).
    let (s, mut client, session) =
        announcement_edge(|c| c.channels.announcement_log = file.clone(), "reader").await;
    session
        .join_channel("system:news", Some(seen))
        .await
        .unwrap();
    expect_announcements_then_history_lost(&mut client, seen).await;
    // Counted (the gauges and counters are updated once a second).
    expect_metric_line(&s.edge, "waygate_announcements_recovered_total 2").await;
}

/// A LEAVE sent right after a JOIN that reads the announcement log first (a position of
/// another epoch) is carried out after that join, as the backend sent them: the member sees
/// HISTORY_LOST, then LEFT, and nothing published later. Channels audit: the LEAVE found no
/// member yet (the join was still reading the log), was answered as taken, and the join then
/// made the session a member the backend had left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_sent_after_a_join_reading_the_log_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("announcements.log");
    let file = path.to_str().unwrap().to_owned();
    let (_s, mut client, session) =
        announcement_edge(|c| c.channels.announcement_log = file.clone(), "leaver").await;
    let elsewhere = ChannelPosition {
        epoch: 12_345,
        offset: 7,
    };
    let (joined, left) = tokio::join!(
        session.join_channel("room:x", Some(elsewhere)),
        session.leave_channel("room:x")
    );
    joined.unwrap();
    left.unwrap();
    match next_update(&mut client).await {
        ChannelUpdate::HistoryLost { channel, .. } => assert_eq!(channel, "room:x"),
        other => panic!("expected HISTORY_LOST, got {other:?}"),
    }
    match next_update(&mut client).await {
        ChannelUpdate::Left { channel, .. } => assert_eq!(channel, "room:x"),
        other => panic!("expected LEFT after the join, got {other:?}"),
    }
    session
        .publish("room:x", TrafficClass::Normal, Bytes::from_static(b"after"))
        .await
        .unwrap();
    assert!(
        timeout(Duration::from_millis(300), next_update(&mut client))
            .await
            .is_err(),
        "a member after its LEAVE"
    );
}

/// SPEC F2 with Redis: an announcement is answered only once it is in Redis, a Redis that
/// cannot take it refuses it (`unavailable`, delivered to nobody), and a member joined on
/// another edge from a position of the first edge's epoch receives the announcements it
/// missed from Redis, then HISTORY_LOST.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcements_are_durable_in_redis_refused_without_it_and_recovered_on_another_edge() {
    let mut redis = support_redis::RedisServer::start();
    let url = redis.url();
    let (s1, client, session) = redis_announcement_edge(&url, "edge-1", "reader").await;
    let seen = announcements_while_away(client, &session).await;
    // In Redis: one stream for the channel's epoch, a1, a2 and a4 (not n3).
    let c = redis::Client::open(url.as_str()).unwrap();
    let mut raw = c.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:ann:system:news:*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].ends_with(&format!(":{}", seen.epoch)));
    let len: u64 = redis::cmd("XLEN")
        .arg(&keys[0])
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(len, 3);

    // Another edge on the same Redis: a new session joined from the old position.
    let (_s2, mut client, session2) = redis_announcement_edge(&url, "edge-2", "reader").await;
    session2
        .join_channel("system:news", Some(seen))
        .await
        .unwrap();
    expect_announcements_then_history_lost(&mut client, seen).await;

    // Redis gone: an announcement is refused, a normal publication still goes out, and the
    // member never sees the refused one.
    let (mut member, m) = s1.member(TransportKind::Tcp, "witness").await;
    m.join_channel("system:news", None).await.unwrap();
    assert!(matches!(
        next_update(&mut member).await,
        ChannelUpdate::Joined { .. }
    ));
    redis.stop();
    // The refusal names the offset the members will see skipped (PROTOCOL.md §12.5).
    let withdrawn = match session
        .publish(
            "system:news",
            TrafficClass::Critical,
            Bytes::from_static(b"lost"),
        )
        .await
    {
        Err(BackendError::AnnouncementWithdrawn {
            position,
            retry_after_ms,
        }) => {
            assert_eq!(retry_after_ms, 1_000);
            position
        }
        other => {
            panic!("expected `unavailable` for an announcement Redis cannot take, got {other:?}")
        }
    };
    let n = session
        .publish(
            "system:news",
            TrafficClass::Normal,
            Bytes::from_static(b"n6"),
        )
        .await
        .unwrap();
    match next_update(&mut member).await {
        ChannelUpdate::Publication { position, body, .. } => {
            assert_eq!(
                body,
                Bytes::from_static(b"n6"),
                "the refused announcement reached a member"
            );
            assert_eq!(position, n.position);
            assert_eq!(
                (withdrawn.epoch, withdrawn.offset + 1),
                (position.epoch, position.offset),
                "the next publication skips exactly the withdrawn offset"
            );
        }
        other => panic!("{other:?}"),
    }
}

/// The same request id again while the edge is still writing that announcement to its log
/// (a retry after a lost answer, or a client's message handled twice after its edge died,
/// PROTOCOL.md §12.5) is answered `busy` by the edge; the backend SDK asks again until the
/// write is done and returns the first copy's position as a duplicate. Before, the second
/// copy failed with `busy`: its handler refused a message whose announcement was taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_copy_of_an_announcement_being_written_is_its_duplicate() {
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    let (_s, _client, session) = redis_announcement_edge(&url, "edge-1", "writer").await;
    let publish = |id: u64| {
        let s = session.clone();
        tokio::spawn(async move {
            s.publish_with_id(
                id,
                "system:news",
                TrafficClass::Critical,
                Bytes::from_static(b"once"),
            )
            .await
        })
    };
    // One announcement through the log first (the stream and the writer are warm).
    publish(waygate_backend::next_request_id())
        .await
        .unwrap()
        .unwrap();
    redis.pause();
    let id = waygate_backend::next_request_id();
    let first = publish(id);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = publish(id);
    // Inside the 500 ms a Redis call may take before the write is given up.
    tokio::time::sleep(Duration::from_millis(150)).await;
    redis.resume();
    // Answers to one id go to its longest waiting request (both copies are the same
    // publication): one of them is the publication, the other its duplicate.
    let first = first.await.unwrap().expect("the first copy is answered");
    let second = second
        .await
        .unwrap()
        .expect("the second copy is answered, not refused");
    assert_eq!(
        [first.duplicate, second.duplicate]
            .iter()
            .filter(|d| **d)
            .count(),
        1,
        "{first:?} {second:?}"
    );
    assert_eq!(first.position, second.position);
}

/// An announcement refused because Redis did not answer its append in time is withdrawn
/// from the log: the append, which Redis carries out once it answers again, leaves no entry
/// behind, so the log holds only the retry's copy (PROTOCOL.md §12.5). Channels audit:
/// before, the log kept both copies, and a member recovering from it received the
/// announcement twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_announcement_refused_while_its_append_was_under_way_is_withdrawn_from_the_log() {
    let redis = support_redis::RedisServer::start();
    let url = redis.url();
    let (_s, _client, session) = redis_announcement_edge(&url, "edge-1", "writer").await;
    let publish = |id: u64| {
        let s = session.clone();
        async move {
            s.publish_with_id(
                id,
                "system:news",
                TrafficClass::Critical,
                Bytes::from_static(b"twice?"),
            )
            .await
        }
    };
    // One announcement through the log first (the stream and the writer are warm).
    publish(waygate_backend::next_request_id()).await.unwrap();
    redis.pause();
    let id = waygate_backend::next_request_id();
    let refused = publish(id).await;
    assert!(refused.is_err(), "{refused:?}");
    redis.resume();
    let retried = publish(id).await.expect("the retry is taken");
    assert!(!retried.duplicate);
    let c = redis::Client::open(url.as_str()).unwrap();
    let mut c = c.get_multiplexed_async_connection().await.unwrap();
    let stream = format!("*:ann:system:news:{}", retried.position.epoch);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(&stream)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    // The withdrawal is told to the log in the background (within a few seconds).
    let expected = vec!["1-1".to_owned(), format!("{}-1", retried.position.offset)];
    let mut held = Vec::new();
    for _ in 0..100 {
        let entries: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
            .arg(&keys[0])
            .arg("-")
            .arg("+")
            .query_async(&mut c)
            .await
            .unwrap();
        held = entries.into_iter().map(|(id, _)| id).collect();
        if held == expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        held, expected,
        "the warm-up and the retry, not the refused copy"
    );
}

/// A client of `player` on `edge` over TCP and its session at the backend.
async fn tcp_member(
    sessions: &Sessions,
    edge: &waygate_edge::edge::Edge,
    player: &str,
) -> (Client, BackendSession) {
    let endpoint = Endpoint::new(TransportKind::Tcp, edge.addrs[&TransportKind::Tcp]);
    let client = Client::start(ClientOptions::new(vec![endpoint], common::token(player)));
    client
        .send(TrafficClass::Normal, 1000, Bytes::from_static(b"hi"))
        .await
        .unwrap();
    let session = poll_until(Duration::from_secs(10), || async { sessions.get(player) })
        .await
        .expect("session reached the backend");
    (client, session)
}

/// Each edge tells its backends which channels it has (PROTOCOL.md §12.6): a publish on
/// every edge reaches only the edges that have the channel (the other is `skipped`: sent
/// nothing, and it creates no channel there); once a member joins on the other edge, the
/// next publish reaches it; once that edge reclaims the channel, it is skipped again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_on_every_edge_goes_only_to_the_edges_that_have_the_channel() {
    let two = two_edges_tuned(["edge-a", "edge-b"], None, |c, _| {
        c.channels.idle_reclaim_ms = 100;
        if let Some(room) = c.channels.kinds.get_mut("room") {
            room.history_ttl_ms = 200;
        }
    })
    .await;
    let (sessions, edges) = (two.sessions.clone(), &two.edges);
    let (mut client_a, member_a) = tcp_member(&sessions, &edges[0], "member-a").await;
    member_a.join_channel("room:r", None).await.unwrap();
    let results = member_a
        .publish_on_every_edge("room:r", TrafficClass::Normal, Bytes::from_static(b"1"))
        .await;
    let by_edge: Vec<(&str, bool, u64)> = results
        .iter()
        .map(|r| {
            let a = r.result.as_ref().unwrap();
            (r.edge_id.as_str(), a.skipped, a.position.offset)
        })
        .collect();
    assert_eq!(by_edge, [("edge-a", false, 1), ("edge-b", true, 0)]);
    assert!(matches!(
        next_update(&mut client_a).await,
        ChannelUpdate::Joined { .. }
    ));
    assert_eq!(body_of(&next_update(&mut client_a).await), (1, "1".into()));

    // A member on edge-b: its join is answered once the backend knows edge-b has the
    // channel, so a publish made right after it reaches edge-b.
    let (mut client_b, member_b) = tcp_member(&sessions, &edges[1], "member-b").await;
    member_b.join_channel("room:r", None).await.unwrap();
    let results = member_a
        .publish_on_every_edge("room:r", TrafficClass::Normal, Bytes::from_static(b"2"))
        .await;
    assert!(results.iter().all(|r| !r.result.as_ref().unwrap().skipped));
    assert_eq!(body_of(&next_update(&mut client_a).await), (2, "2".into()));
    assert!(matches!(
        next_update(&mut client_b).await,
        ChannelUpdate::Joined { .. }
    ));
    assert_eq!(body_of(&next_update(&mut client_b).await), (1, "2".into()));

    // edge-b's member leaves; once its history expired, edge-b reclaims the channel and
    // says so: skipped again.
    member_b.leave_channel("room:r").await.unwrap();
    // A publish uses the channel: spaced wider than the idle time, so it can be reclaimed.
    let mut skipped = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let results = member_a
            .publish_on_every_edge("room:r", TrafficClass::BestEffort, Bytes::new())
            .await;
        skipped = results
            .iter()
            .any(|r| r.edge_id == "edge-b" && r.result.as_ref().unwrap().skipped);
        if skipped {
            break;
        }
    }
    assert!(skipped, "edge-b never told it reclaimed the channel");
    drop(two);
}

/// A backend link that takes channel notices and acknowledges them only when told to: a
/// hand-made backend end (PROTOCOL.md §9.3) that welcomes the edge with
/// `LINK_FEATURE_CHANNEL_INTEREST` and hands over what it receives.
async fn silent_interest_backend(
    listener: tokio::net::TcpListener,
) -> (
    waygate_link::LinkIo,
    tokio::sync::mpsc::UnboundedReceiver<waygate_protocol::link::LinkFrame>,
) {
    use waygate_protocol::link::{LinkFrame, LINK_FEATURE_CHANNEL_INTEREST, LINK_VERSION};
    let (stream, _) = timeout(Duration::from_secs(10), listener.accept())
        .await
        .expect("the edge links to every instance")
        .unwrap();
    let mut io = waygate_link::spawn_link_io(
        stream,
        1 << 20,
        Duration::from_secs(5),
        waygate_link::LinkIoOptions::default(),
    );
    let hello = timeout(Duration::from_secs(10), io.rx.recv())
        .await
        .unwrap();
    let Some(LinkFrame::Hello { features, .. }) = hello else {
        panic!("expected LINK_HELLO, got {hello:?}");
    };
    assert_ne!(
        features & LINK_FEATURE_CHANNEL_INTEREST,
        0,
        "the edge offers notices"
    );
    io.tx
        .send(LinkFrame::Welcome {
            version: LINK_VERSION,
            instance_id: "silent".into(),
            credits: 16,
            heartbeat_ms: 5000,
            auth: None,
            features: LINK_FEATURE_CHANNEL_INTEREST,
        })
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let mut frames = std::mem::replace(&mut io.rx, tokio::sync::mpsc::channel(1).1);
    tokio::spawn(async move {
        while let Some(f) = frames.recv().await {
            if tx.send(f).is_err() {
                return;
            }
        }
    });
    (io, rx)
}

/// The first join of a channel on an edge is answered, and its member shown JOINED, only
/// once every backend linked with notices acknowledged that the edge has the channel — a
/// publish decided after the answer can then never skip this edge; a backend whose link
/// dies owes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_channels_first_join_waits_until_every_backend_knows_the_edge_has_it() {
    use waygate_protocol::link::LinkFrame;
    let sessions = Arc::new(Sessions::default());
    let backend = sessions_backend("b1", &sessions).await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    // Players go to b1 only; the silent backend is an instance of the room service, so the
    // edge links to it.
    let table = common::table(
        &[backend.local_addr(), silent.local_addr().unwrap()],
        1,
        Some(1),
    );
    std::fs::write(&routes, table).unwrap();
    // The edge starts once its links are up (or after its connect timeout).
    let silent = tokio::spawn(silent_interest_backend(silent));
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(routes.clone());
    let edge = waygate_edge::edge::Edge::start(config).await.unwrap();
    let (silent_io, mut notices) = silent.await.unwrap();
    let (mut client, member) = tcp_member(&sessions, &edge, "joiner").await;

    let joining = tokio::spawn({
        let member = member.clone();
        async move { member.join_channel("room:x", None).await }
    });
    let seq = loop {
        let f = timeout(Duration::from_secs(10), notices.recv())
            .await
            .expect("a notice in time")
            .unwrap();
        if let LinkFrame::ChannelInterest {
            seq,
            present,
            channel,
        } = f
        {
            assert_eq!((present, channel.as_str()), (true, "room:x"));
            break seq;
        }
    };
    // Not acknowledged: neither shown nor answered.
    assert!(
        timeout(Duration::from_millis(300), next_update(&mut client))
            .await
            .is_err(),
        "JOINED shown before the silent backend acknowledged"
    );
    assert!(
        !joining.is_finished(),
        "answered before the silent backend acknowledged"
    );
    // Operators see it waiting.
    expect_metric_line(&edge, "waygate_channels_awaiting_backends 1").await;
    assert!(
        !joining.is_finished(),
        "answered before the silent backend acknowledged"
    );
    silent_io
        .tx
        .send(LinkFrame::ChannelInterestAck { seq })
        .await
        .unwrap();
    timeout(Duration::from_secs(10), joining)
        .await
        .expect("answered once acknowledged")
        .unwrap()
        .unwrap();
    assert!(matches!(
        next_update(&mut client).await,
        ChannelUpdate::Joined { .. }
    ));
    expect_metric_line(&edge, "waygate_channels_awaiting_backends 0").await;

    // Another new channel, which the silent backend never acknowledges while it keeps its
    // link alive: past the deadline the edge closes that link, which then owes nothing.
    let joining = tokio::spawn({
        let member = member.clone();
        async move { member.join_channel("room:y", None).await }
    });
    let mut told = false;
    let closed = loop {
        let f = timeout(Duration::from_secs(20), notices.recv())
            .await
            .expect("the edge closes the link in time");
        match f {
            Some(LinkFrame::ChannelInterest { ref channel, .. }) if channel == "room:y" => {
                told = true;
            }
            Some(LinkFrame::Close { code, .. }) => break Some(code),
            Some(_) => {}
            None => break None,
        }
    };
    assert!(told, "room:y was told before the link closed");
    assert!(
        matches!(closed, None | Some(CloseCode::ProtocolError)),
        "{closed:?}"
    );
    // The member is shown its JOINED; the join's answer came once the link was closed
    // (after the 5 s deadline: the SDK may have stopped waiting for it).
    assert!(matches!(
        next_update(&mut client).await,
        ChannelUpdate::Joined { .. }
    ));
    match timeout(Duration::from_secs(10), joining)
        .await
        .unwrap()
        .unwrap()
    {
        Ok(_) | Err(BackendError::NoAnswer) => {}
        Err(e) => panic!("join refused: {e}"),
    }
    drop((edge, backend, dir, silent_io));
}

/// Announcements of one channel published at the same time by two backends (two links, two
/// reader tasks) reach the Redis log in offset order: none is refused. Found by `waygate
/// demo --edges 3` (4 announcements refused `unavailable`: "The ID specified in XADD is
/// equal or smaller than the target stream top item"): the edge gave offsets under the
/// hub's lock but queued them for the log writer after it, so two links could queue them
/// out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announcements_from_two_backends_at_once_reach_the_log_in_order() {
    let redis = support_redis::RedisServer::start();
    let sessions = Arc::new(Sessions::default());
    let mut backends = Vec::new();
    for id in ["b1", "b2"] {
        backends.push(sessions_backend(id, &sessions).await);
    }
    let addrs: Vec<_> = backends.iter().map(|b| b.local_addr()).collect();
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, common::table(&addrs, 1, None)).unwrap();
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(routes);
    config.cluster.redis_url = redis.url();
    let edge = waygate_edge::edge::Edge::start(config).await.unwrap();
    // Players until one session is on each backend.
    let mut publishers: HashMap<String, BackendSession> = HashMap::new();
    let mut clients = Vec::new();
    for i in 0..64 {
        let (client, session) = tcp_member(&sessions, &edge, &format!("publisher-{i}")).await;
        clients.push(client);
        publishers
            .entry(session.instance_id().to_owned())
            .or_insert(session);
        if publishers.len() == 2 {
            break;
        }
    }
    assert_eq!(publishers.len(), 2, "sessions on both backends");
    let mut tasks = tokio::task::JoinSet::new();
    for session in publishers.into_values() {
        for t in 0..8 {
            let session = session.clone();
            tasks.spawn(async move {
                let mut withdrawn = 0;
                for i in 0..150 {
                    let body = Bytes::from(format!("a{t}.{i}"));
                    let id = waygate_backend::next_request_id();
                    // A publisher waits out the channel's rate and queue answers.
                    for _ in 0..1000 {
                        match session
                            .publish_with_id(
                                id,
                                "system:news",
                                TrafficClass::Critical,
                                body.clone(),
                            )
                            .await
                        {
                            Ok(_) => break,
                            Err(BackendError::AnnouncementWithdrawn { .. }) => {
                                withdrawn += 1;
                                break;
                            }
                            Err(BackendError::ChannelRefused { retry_after_ms, .. })
                                if retry_after_ms > 0 =>
                            {
                                let wait = Duration::from_millis(retry_after_ms.into());
                                tokio::time::sleep(wait).await;
                            }
                            Err(e) => panic!("announcement {i} refused: {e}"),
                        }
                    }
                }
                withdrawn
            });
        }
    }
    let mut withdrawn = 0;
    while let Some(done) = tasks.join_next().await {
        withdrawn += done.unwrap();
    }
    assert_eq!(withdrawn, 0, "announcements refused by the log");
    drop((edge, backends, dir, clients));
}

/// The next message `msg_id` `client` receives, within 10 s.
async fn next_message(client: &mut Client, msg_id: u32) -> Bytes {
    match common::wait_for(
        client,
        Duration::from_secs(10),
        |e| matches!(e, Event::Message { msg_id: m, .. } if *m == msg_id),
    )
    .await
    {
        Event::Message { payload, .. } => payload,
        _ => unreachable!(),
    }
}

/// No message `msg_id` reaches `client` within 300 ms (none delivered twice).
async fn no_message(client: &mut Client, msg_id: u32) {
    let twice = timeout(Duration::from_millis(300), async {
        loop {
            match client.next_event().await {
                Some(Event::Message {
                    msg_id: m, payload, ..
                }) if m == msg_id => return payload,
                Some(_) => {}
                None => std::future::pending::<()>().await,
            }
        }
    })
    .await;
    assert!(
        twice.is_err(),
        "message {msg_id} delivered twice: {twice:?}"
    );
}

/// A backend pushes to a player wherever it is (PLAYER_PUSH, PROTOCOL.md §9.7; SPEC F4)
/// through the edge of the session it is handling: a player on that edge gets it at once,
/// one on the other edge through Redis presence, and every push has its own result — one
/// batch holding pushes to a connected player, to a player whose session just ended and
/// to an unknown one answers each on its own (`delivered`, `offline`, `offline`), and
/// nothing delivered is sent again. `delivered` comes once the player's session is written
/// through (its stored copy holds the push). With Redis down, a push to another edge's
/// player is answered `unreachable`, one to a player here `unknown` (it still arrives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_to_a_player_reaches_it_on_any_edge_with_a_result_per_message() {
    use waygate_backend::PlayerPushOutcome as Outcome;
    let mut redis = support_redis::RedisServer::start();
    let two = two_edges(["edge-1", "edge-2"], Some(redis.url())).await;
    let (sessions, edges) = (two.sessions.clone(), &two.edges);
    let (mut alice, from) = tcp_member(&sessions, &edges[0], "alice").await;
    let (mut bob, _) = tcp_member(&sessions, &edges[1], "bob").await;
    let (carol, carol_session) = tcp_member(&sessions, &edges[1], "carol").await;
    let push = |player: &'static str, body: &'static str| {
        let from = from.clone();
        async move {
            from.push_to_player(
                player,
                42,
                TrafficClass::Normal,
                Bytes::from_static(body.as_bytes()),
            )
            .await
            .unwrap()
        }
    };

    // On the same edge: at once.
    assert_eq!(push("alice", "to self").await, Outcome::Delivered);
    assert_eq!(next_message(&mut alice, 42).await, "to self");
    // On the other edge: once its presence is in Redis (set as the session is established).
    let first = poll_until(Duration::from_secs(10), || async {
        match push("bob", "hello bob").await {
            Outcome::Offline => None,
            other => Some(other),
        }
    })
    .await;
    assert_eq!(first, Some(Outcome::Delivered));
    assert_eq!(next_message(&mut bob, 42).await, "hello bob");
    // In order, one after another.
    for i in 0..5 {
        let body: &'static str = Box::leak(format!("in order {i}").into_boxed_str());
        assert_eq!(push("bob", body).await, Outcome::Delivered);
    }
    for i in 0..5 {
        assert_eq!(next_message(&mut bob, 42).await, format!("in order {i}"));
    }

    // A push sent again with its id (its first answer lost, say) is delivered once, on
    // either edge: the second copy is answered `delivered` and not queued again.
    let id = waygate_backend::next_request_id();
    for player in ["bob", "alice"] {
        for _ in 0..2 {
            let outcome = from
                .push_to_player_with_id(
                    id,
                    player,
                    43,
                    TrafficClass::Normal,
                    Bytes::from_static(b"once"),
                )
                .await
                .unwrap();
            assert_eq!(outcome, Outcome::Delivered, "{player}");
        }
    }
    assert_eq!(next_message(&mut bob, 43).await, "once");
    assert_eq!(next_message(&mut alice, 43).await, "once");
    no_message(&mut bob, 43).await;
    no_message(&mut alice, 43).await;

    // Carol's session ends (the backend kicks her): her presence goes with it.
    carol_session.kick(CloseCode::Kicked, "bye").await.unwrap();
    drop(carol);
    poll_until(Duration::from_secs(10), || async {
        (push("carol", "probe").await == Outcome::Offline).then_some(())
    })
    .await
    .expect("carol's presence removed with her session");
    // One batch to the other edge: a result per message.
    let (b, c, n) = tokio::join!(
        push("bob", "batched"),
        push("carol", "to nobody"),
        push("nobody", "to nobody")
    );
    assert_eq!(
        (b, c, n),
        (Outcome::Delivered, Outcome::Offline, Outcome::Offline)
    );
    assert_eq!(next_message(&mut bob, 42).await, "batched");
    // Many at once: every one delivered exactly once.
    let many: Vec<_> = (0..50)
        .map(|i| {
            let body: &'static str = Box::leak(format!("many {i}").into_boxed_str());
            push("bob", body)
        })
        .collect();
    let outcomes = futures_util::future::join_all(many).await;
    assert!(
        outcomes.iter().all(|o| *o == Outcome::Delivered),
        "{outcomes:?}"
    );
    let mut got = std::collections::BTreeSet::new();
    for _ in 0..50 {
        let body = next_message(&mut bob, 42).await;
        assert!(got.insert(body.clone()), "{body:?} twice");
    }
    no_message(&mut bob, 42).await;
    expect_metric_line(
        &edges[0],
        "waygate_player_pushes_total{outcome=\"delivered\"} ",
    )
    .await;

    // Redis down: the other edge cannot be asked; a player here still gets the push, but
    // its session cannot be written through, so `delivered` cannot be promised: `unknown`.
    redis.stop();
    assert_eq!(push("bob", "no redis").await, Outcome::Unreachable);
    assert_eq!(push("alice", "still here").await, Outcome::Unknown);
    assert_eq!(next_message(&mut alice, 42).await, "still here");
    // Regression (2026-12-04, second stop): a copy sent again after `unknown` was answered
    // `delivered` (its id was remembered as delivered when queued), though nothing made
    // it durable. A copy is answered what its first copy is, and queued once.
    let id = waygate_backend::next_request_id();
    for _ in 0..2 {
        let outcome = from
            .push_to_player_with_id(
                id,
                "alice",
                44,
                TrafficClass::Normal,
                Bytes::from_static(b"unsure"),
            )
            .await
            .unwrap();
        assert_eq!(outcome, Outcome::Unknown);
    }
    assert_eq!(next_message(&mut alice, 44).await, "unsure");
    no_message(&mut alice, 44).await;
}

/// A push sent again after its player's session moved to another edge is delivered once
/// (PROTOCOL.md §9.7): the session's stored copy carries the ids of its last pushes, so the
/// edge it is restored on answers the copy `delivered` and queues nothing, as does the edge
/// that delivered the first copy; a new push still arrives. Before the ids travelled with
/// the session, the copy through the session's new edge was delivered a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_sent_again_after_its_player_moved_to_another_edge_is_delivered_once() {
    use waygate_backend::PlayerPushOutcome as Outcome;
    let redis = support_redis::RedisServer::start();
    let two = two_edges(["edge-1", "edge-2"], Some(redis.url())).await;
    let (mut client, on_edge1) = two.mover().await;
    let id = waygate_backend::next_request_id();
    let push_copy = |via: &BackendSession| {
        let via = via.clone();
        async move {
            via.push_to_player_with_id(
                id,
                "mover",
                45,
                TrafficClass::Normal,
                Bytes::from_static(b"once"),
            )
            .await
            .unwrap()
        }
    };
    assert_eq!(push_copy(&on_edge1).await, Outcome::Delivered);
    assert_eq!(next_message(&mut client, 45).await, "once");
    let on_edge2 = two.move_to_edge2(&mut client).await;
    for via in [&on_edge2, &on_edge1] {
        assert_eq!(
            push_copy(via).await,
            Outcome::Delivered,
            "{}",
            via.edge_id()
        );
    }
    no_message(&mut client, 45).await;
    let fresh = on_edge2
        .push_to_player(
            "mover",
            45,
            TrafficClass::Normal,
            Bytes::from_static(b"new"),
        )
        .await
        .unwrap();
    assert_eq!(fresh, Outcome::Delivered);
    assert_eq!(next_message(&mut client, 45).await, "new");
    drop(two);
}

/// One edge without Redis: a player without a session on it is offline everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_to_a_player_on_one_edge_without_redis_is_delivered_or_offline() {
    use waygate_backend::PlayerPushOutcome as Outcome;
    let s = setup(|_| {}).await;
    let (mut alice, from) = s.member(TransportKind::Ws, "alice").await;
    let outcome = from
        .push_to_player(
            "alice",
            7,
            TrafficClass::Critical,
            Bytes::from_static(b"hi"),
        )
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Delivered);
    assert_eq!(next_message(&mut alice, 7).await, "hi");
    let outcome = from
        .push_to_player("nobody", 7, TrafficClass::Normal, Bytes::from_static(b"?"))
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Offline);
    assert!(matches!(
        from.push_to_player("alice", 0xFFFF_FF01, TrafficClass::Normal, Bytes::new())
            .await,
        Err(BackendError::ReservedMsgId(_))
    ));
}

/// A client's logout ends its session at once on every transport (PROTOCOL.md §7.5): the
/// backend gets SESSION_CLOSE `logout` within seconds, not after the 15 min linger; a
/// client's close() leaves it lingering (SESSION_DETACHED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logout_ends_the_session_on_every_transport_and_a_close_lingers() {
    let s = setup(|_| {}).await;
    let kinds = [
        TransportKind::Tcp,
        TransportKind::Tls,
        TransportKind::Ws,
        TransportKind::Wss,
        TransportKind::Quic,
        TransportKind::Kcp,
    ];
    // Every step bounded: a step that never ends fails with its name (one run hung here
    // with every task parked; see the SDK's write deadline).
    async fn step<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
        timeout(Duration::from_secs(20), f)
            .await
            .unwrap_or_else(|_| panic!("{what} did not finish within 20 s"))
    }
    for kind in kinds {
        let player = format!("leaving-{kind:?}");
        let (client, _) = step(&format!("member {kind:?}"), s.member(kind, &player)).await;
        step(&format!("logout {kind:?}"), client.logout())
            .await
            .expect("logged out on a live link");
        assert!(
            matches!(
                step(&format!("second logout {kind:?}"), client.logout()).await,
                Err(waygate_client::SdkError::Closed)
            ),
            "a second logout is answered: the client has ended"
        );
        let end = poll_until(Duration::from_secs(10), || async {
            s.sessions.end_of(&player)
        })
        .await;
        assert_eq!(end, Some(("closed", CloseCode::Logout)), "{kind:?}");

        let player = format!("staying-{kind:?}");
        let (client, _) = step(&format!("member {kind:?}"), s.member(kind, &player)).await;
        step(&format!("close {kind:?}"), client.close()).await;
        let end = poll_until(Duration::from_secs(10), || async {
            s.sessions.end_of(&player)
        })
        .await;
        assert_eq!(end, Some(("detached", CloseCode::Normal)), "{kind:?}");
    }
    // No session up on a link (nothing listens there): the logout says it did not go out.
    let nowhere = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let client = Client::start(ClientOptions::new(
        vec![Endpoint::new(TransportKind::Tcp, nowhere)],
        common::token("nowhere"),
    ));
    assert!(matches!(
        step("logout with nothing listening", client.logout()).await,
        Err(waygate_client::SdkError::NotConnected)
    ));
}

/// A backend's push too large for the client's max frame size (regression: it took a seq,
/// its send failed, the client went on with the next seq and the message was lost without
/// a word to anyone): the session declares it lost — the connection closes with
/// `frame_too_large`, the resume reports `RestoredWithGap`, the backend learns the gap from
/// SESSION_REATTACHED — and what follows arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_too_large_for_the_client_is_a_declared_gap_not_a_silent_loss() {
    use waygate_protocol::frame::WelcomeOutcome;
    let s = setup(|_| {}).await;
    let (mut client, session) = s.member(TransportKind::Tcp, "big").await;
    session
        .push(7, TrafficClass::Normal, Bytes::from(vec![b'x'; 70_000]))
        .await
        .unwrap();
    session
        .push(8, TrafficClass::Normal, Bytes::from_static(b"after"))
        .await
        .unwrap();
    let mut outcomes = Vec::new();
    let after = timeout(Duration::from_secs(10), async {
        loop {
            match client.next_event().await.expect("client running") {
                Event::Connected { outcome, .. } => outcomes.push(outcome),
                Event::Message { msg_id: 7, .. } => panic!("a frame above the max was sent"),
                Event::Message {
                    msg_id: 8, payload, ..
                } => return payload,
                _ => {}
            }
        }
    })
    .await
    .expect("the next push arrives");
    assert_eq!(after, "after");
    assert!(
        outcomes.contains(&WelcomeOutcome::RestoredWithGap),
        "the client was told of the gap: {outcomes:?}"
    );
}

/// Regression (bounds audit, 2026-12-04): a backend's BIND was recorded for any service
/// name, so a session's routing keys (kept in its entry and in every snapshot) grew with
/// whatever a backend named. A service the route table does not have is refused now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_for_a_service_the_table_does_not_have_is_refused() {
    let s = setup(|_| {}).await;
    let (_client, session) = s.member(TransportKind::Tcp, "binder").await;
    for n in 0..3 {
        session.bind(&format!("nosuch{n}"), "k").await.unwrap();
    }
    session.bind("room", "lobby").await.unwrap();
    expect_metric_line(&s.edge, "waygate_binds_refused_total 3").await;
}

/// Sends a room message (2000) until the edge's router holds `bindings` (a BIND reaches
/// the edge on the backend's link, unordered with the client's messages).
async fn route_room(admin: std::net::SocketAddr, client: &Client, bindings: usize) {
    let line = format!("waygate_route_bindings {bindings}");
    let bound = poll_until(Duration::from_secs(10), || async {
        let _ = client
            .send(
                TrafficClass::Normal,
                2000,
                Bytes::from_static(b"in the room"),
            )
            .await;
        let (_, m) = common::http(admin, "GET", "/metrics").await;
        m.lines().find(|l| l.starts_with(&line)).map(drop)
    })
    .await;
    assert!(bound.is_some(), "{line}");
}

/// Regression (bounds, 2026-12-04, second stop): a room, guild or order key that a
/// backend BINDs a session to was bound in the edge's router by the first message routed
/// with it and stayed there for good, one binding per room ever played on the edge. Now a
/// key no session on the edge holds any more (its sessions ended or were bound elsewhere)
/// is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_nobody_here_is_in_any_more_leaves_no_binding_behind() {
    let s = setup(|_| {}).await;
    let admin = s.edge.admin_addr.unwrap();
    let mut members = Vec::new();
    for (n, room) in ["match-0", "match-1", "match-0"].into_iter().enumerate() {
        let (client, session) = s.member(TransportKind::Tcp, &format!("roomer{n}")).await;
        session.bind("room", room).await.unwrap();
        members.push((client, session));
    }
    // Three players and two rooms.
    route_room(admin, &members[0].0, 4).await;
    route_room(admin, &members[1].0, 5).await;
    route_room(admin, &members[2].0, 5).await;
    // roomer1 moves to match-2: match-1 has nobody here any more.
    members[1].1.bind("room", "match-2").await.unwrap();
    expect_metric_line(&s.edge, "waygate_route_bindings 4").await;
    route_room(admin, &members[1].0, 5).await;
    // roomer0 leaves: match-0 still holds roomer2 (4: two players, match-0, match-2).
    members[0].1.kick(CloseCode::Kicked, "").await.unwrap();
    expect_metric_line(&s.edge, "waygate_route_bindings 4").await;
    for (_, session) in &members[1..] {
        session.kick(CloseCode::Kicked, "").await.unwrap();
    }
    expect_metric_line(&s.edge, "waygate_route_bindings 0").await;
}

/// Whether the edge's `/metrics` has a line starting with `prefix`.
async fn has_metric_line(edge: &waygate_edge::edge::Edge, prefix: &str) -> bool {
    let (_, m) = common::http(edge.admin_addr.unwrap(), "GET", "/metrics").await;
    m.lines().any(|l| l.starts_with(prefix))
}

/// Regression (bounds, 2026-12-04, second stop): every backend address a route table ever
/// named kept its link for good (a task reconnecting to a gone backend, and its metric
/// series), so an edge in front of autoscaled backends grew with every instance ever
/// started. A link to an address the table no longer names is retired once no session
/// and no binding uses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_left_the_table_has_its_link_retired() {
    let sessions = Arc::new(Sessions::default());
    let b1 = sessions_backend("b1", &sessions).await;
    let b2 = sessions_backend("b2", &sessions).await;
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(
        &routes,
        common::table(&[b1.local_addr(), b2.local_addr()], 1, None),
    )
    .unwrap();
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(routes.clone());
    config.routing.poll_ms = 100;
    let edge = waygate_edge::edge::Edge::start(config).await.unwrap();
    // Players until one is on b2.
    let mut on_b2 = 0;
    let mut clients = Vec::new();
    for i in 0..64 {
        let (client, session) = tcp_member(&sessions, &edge, &format!("retiree-{i}")).await;
        clients.push(client);
        if session.instance_id() == "b2" {
            on_b2 += 1;
            break;
        }
    }
    assert_eq!(on_b2, 1, "a session on b2");
    let b2_up = format!("waygate_backend_up{{backend=\"{}\"}}", b2.local_addr());
    expect_metric_line(&edge, &format!("{b2_up} 1")).await;
    // b2 leaves the table: its session's binding migrates to b1 (the edge closes it on
    // b2's link), after which nothing here uses b2: the link is retired, its series go.
    std::fs::write(&routes, common::table(&[b1.local_addr()], 2, None)).unwrap();
    expect_metric_line(&edge, "waygate_route_epoch 2").await;
    let gone = poll_until(Duration::from_secs(10), || async {
        (!has_metric_line(&edge, &b2_up).await).then_some(())
    })
    .await;
    assert!(gone.is_some(), "{b2_up} still exported");
    let b2_sessions = format!(
        "waygate_backend_sessions{{backend=\"{}\"}}",
        b2.local_addr()
    );
    assert!(!has_metric_line(&edge, &b2_sessions).await);
    // b1's link is untouched.
    let b1_up = format!("waygate_backend_up{{backend=\"{}\"}} 1", b1.local_addr());
    assert!(has_metric_line(&edge, &b1_up).await);
}

/// Regression (bounds audit, 2026-12-04): a player taken over by a login on another edge
/// left its routing binding on the first edge for good (the key was released only when the
/// ending session still owned the player), so an edge's router grew with every player that
/// moved away, and the leaked bindings counted against instance capacity. Now the key is
/// released unless another session of the player lives on that edge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_player_that_moves_to_another_edge_leaves_no_binding_behind() {
    let redis = support_redis::RedisServer::start();
    let two = two_edges(["edge-1", "edge-2"], Some(redis.url())).await;
    let (first, _) = tcp_member(&two.sessions, &two.edges[0], "mover").await;
    expect_metric_line(&two.edges[0], "waygate_route_bindings 1").await;
    // The client goes away (its session lingers on edge 1), then logs in on edge 2: the
    // login takes the player over and edge 1's session ends, no longer its owner.
    first.close().await;
    let endpoint = Endpoint::new(TransportKind::Tcp, two.edges[1].addrs[&TransportKind::Tcp]);
    let second = Client::start(ClientOptions::new(vec![endpoint], common::token("mover")));
    second
        .send(TrafficClass::Normal, 1000, Bytes::from_static(b"hi"))
        .await
        .unwrap();
    expect_metric_line(&two.edges[1], "waygate_route_bindings 1").await;
    expect_metric_line(&two.edges[0], "waygate_route_bindings 0").await;
}

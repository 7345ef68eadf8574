//! The edge end to end, in process: three demo backends, a route table file, the edge with
//! every listener, and SDK clients on every transport. Checks that each message reaches
//! the instance the route table chooses, by player id and by room id.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use waygate::backend::demo::{
    DemoService, ECHO, ECHO_REPLY, JOINED, JOIN_ROOM, ROOM_EVENT, ROOM_SAY,
};
use waygate::backend::{Backend, BackendConfig};
use waygate::config::{EdgeConfig, DEV_KEY_ID, DEV_KEY_SECRET};
use waygate::edge::Edge;
use waygate_client::{Client, ClientOptions, Event};
use waygate_routing::{RouteRequest, RouteTable, Router, RouterConfig};
use waygate_session::auth::TokenClaims;
use waygate_transport::endpoint::{ConnectOptions, Endpoint};
use waygate_transport::tls::ClientTls;
use waygate_transport::{TrafficClass, TransportKind};

pub struct Cluster {
    pub edge: Edge,
    pub backends: Vec<Backend>,
    pub table: RouteTable,
    /// backend address -> backend id
    pub ids: HashMap<SocketAddr, String>,
    pub tls: ClientTls,
    _dir: tempfile::TempDir,
}

fn table_text(addrs: &[SocketAddr]) -> String {
    let mut t = String::from("epoch = 1\nupdated_at = 0\n");
    for (service, prefix, range) in [
        ("player", "p", "[[1000, 1999]]"),
        ("room", "r", "[[2000, 2999]]"),
    ] {
        t.push_str(&format!(
            "[[services]]\nname = \"{service}\"\nmessages = {range}\nkey = \"{service}\"\n"
        ));
        for (i, a) in addrs.iter().enumerate() {
            t.push_str(&format!(
                "  [[services.instances]]\n  id = \"{prefix}{}\"\n  address = \"{a}\"\n",
                i + 1
            ));
        }
    }
    t
}

pub async fn cluster() -> Cluster {
    let mut backends = Vec::new();
    let mut ids = HashMap::new();
    for i in 1..=3 {
        let id = format!("b{i}");
        let b = Backend::bind(
            "127.0.0.1:0".parse().unwrap(),
            BackendConfig::new(id.clone()),
            Arc::new(DemoService::new()),
        )
        .await
        .unwrap();
        ids.insert(b.local_addr(), id);
        backends.push(b);
    }
    let addrs: Vec<SocketAddr> = backends.iter().map(|b| b.local_addr()).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.toml");
    let text = table_text(&addrs);
    std::fs::write(&path, &text).unwrap();
    let mut config = EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(path);
    config.routing.poll_ms = 100;
    let edge = Edge::start(config).await.unwrap();
    let tls = ClientTls::from_ca_pem(edge.dev_ca_pem.as_deref().unwrap()).unwrap();
    Cluster {
        edge,
        backends,
        table: RouteTable::from_toml_str(&text).unwrap(),
        ids,
        tls,
        _dir: dir,
    }
}

pub fn token(player: &str) -> Bytes {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    waygate_session::mint_token(
        DEV_KEY_ID,
        DEV_KEY_SECRET.as_bytes(),
        &TokenClaims {
            player_id: player.into(),
            issuer: "test".into(),
            issued_at: now,
            expires_at: now + 3600,
            extensions: Vec::new(),
        },
    )
    .unwrap()
}

impl Cluster {
    pub fn endpoint(&self, kind: TransportKind) -> Endpoint {
        let mut e = Endpoint::new(kind, self.edge.addrs[&kind]);
        if matches!(
            kind,
            TransportKind::Tls | TransportKind::Wss | TransportKind::Quic
        ) {
            e.host = "localhost".into();
        }
        e
    }

    pub fn client(&self, kinds: &[TransportKind], player: &str) -> Client {
        let mut options = ClientOptions::new(
            kinds.iter().map(|k| self.endpoint(*k)).collect(),
            token(player),
        );
        options.connect = ConnectOptions {
            tls: Some(self.tls.clone()),
            ..ConnectOptions::default()
        };
        Client::start(options)
    }

    /// The backend id the route table sends `player` (service player) or `room` to.
    pub fn expected(&self, msg_id: u32, player: &str, room: Option<&str>) -> String {
        let mut router = Router::new(RouterConfig::default(), std::time::Instant::now());
        router
            .apply_table(self.table.clone(), std::time::Instant::now())
            .unwrap();
        let mut req = RouteRequest::player(player);
        if let Some(r) = room {
            req = req.room(r);
        }
        let d = router.route(msg_id, &req).unwrap();
        self.ids[&d.address.parse::<SocketAddr>().unwrap()].clone()
    }
}

pub async fn next_message(client: &mut Client, want: u32) -> Bytes {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let ev = tokio::time::timeout_at(deadline, client.next_event())
            .await
            .expect("event in time")
            .expect("client running");
        match ev {
            Event::Message {
                msg_id, payload, ..
            } if msg_id == want => return payload,
            Event::Closed { code } => panic!("client closed: {code}"),
            other => {
                if std::env::var_os("WAYGATE_TEST_DEBUG").is_some() {
                    eprintln!("event: {other:?}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transport_reaches_the_instance_of_its_player_and_room() {
    let c = cluster().await;
    let kinds = [
        TransportKind::Tcp,
        TransportKind::Tls,
        TransportKind::Ws,
        TransportKind::Wss,
        TransportKind::Quic,
        TransportKind::Kcp,
    ];
    for kind in kinds {
        for n in 0..4 {
            let player = format!("{kind}-player-{n}");
            let mut client = c.client(&[kind], &player);
            client
                .send(TrafficClass::Normal, ECHO, Bytes::from_static(b"ping"))
                .await
                .unwrap();
            let reply = next_message(&mut client, ECHO_REPLY).await;
            let text = String::from_utf8(reply.to_vec()).unwrap();
            let expected = c.expected(ECHO, &player, None);
            assert_eq!(text, format!("{expected}|{player}|ping"), "{kind}");

            let room = format!("room-{n}");
            client
                .send(TrafficClass::Critical, JOIN_ROOM, Bytes::from(room.clone()))
                .await
                .unwrap();
            assert_eq!(
                next_message(&mut client, JOINED).await,
                Bytes::from(room.clone())
            );
            client
                .send(
                    TrafficClass::Normal,
                    ROOM_SAY,
                    Bytes::from(format!("{room}|hello")),
                )
                .await
                .unwrap();
            let event =
                String::from_utf8(next_message(&mut client, ROOM_EVENT).await.to_vec()).unwrap();
            let room_backend = c.expected(ROOM_SAY, &player, Some(&room));
            assert!(
                event.starts_with(&format!("{room_backend}|{room}|")),
                "{kind}: room event {event} not from {room_backend}"
            );
            client.close().await;
        }
    }
}

/// S4/S4a over real sockets: a stream of echoes while the socket is killed mid-stream and
/// the session resumes over another transport (KCP -> WebSocket, QUIC -> TCP, ...); every
/// request reaches the backend exactly once and every reply arrives exactly once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_over_another_transport_loses_and_duplicates_nothing() {
    let c = cluster().await;
    for (from, to) in [
        (TransportKind::Kcp, TransportKind::Ws),
        (TransportKind::Quic, TransportKind::Tcp),
        (TransportKind::Wss, TransportKind::Kcp),
        (TransportKind::Tls, TransportKind::Quic),
    ] {
        let player = format!("switcher-{from}-{to}");
        let mut client = c.client(&[from, to], &player);
        let total = 150u64;
        let mut got = Vec::new();
        let mut restored = 0;
        let mut sent = 0u64;
        while got.len() < total as usize {
            if sent < total {
                client
                    .send(TrafficClass::Normal, ECHO, Bytes::from(sent.to_string()))
                    .await
                    .unwrap();
                sent += 1;
                if sent == 50 || sent == 100 {
                    // Kill the socket mid-stream (no CLOSE) and resume over the other one.
                    let other = if sent == 50 { 1 } else { 0 };
                    client.prefer_endpoint(other).await;
                    client.drop_link().await;
                }
            }
            let ev = tokio::time::timeout(
                Duration::from_millis(if sent < total { 1 } else { 20_000 }),
                client.next_event(),
            )
            .await;
            match ev {
                Ok(Some(Event::Message {
                    msg_id: ECHO_REPLY,
                    payload,
                    ..
                })) => {
                    let text = String::from_utf8(payload.to_vec()).unwrap();
                    got.push(text.rsplit('|').next().unwrap().parse::<u64>().unwrap());
                }
                Ok(Some(Event::Connected { outcome, .. })) => {
                    if outcome == waygate_transport::frame::WelcomeOutcome::Restored {
                        restored += 1;
                    }
                }
                Ok(Some(Event::Closed { code })) => panic!("closed: {code}"),
                Ok(Some(Event::Error(e))) => panic!("error: {e:?}"),
                Ok(Some(_)) => {}
                Ok(None) => panic!("client ended"),
                Err(_) => assert!(
                    sent < total,
                    "{from}->{to}: replies stopped after {}",
                    got.len()
                ),
            }
        }
        assert_eq!(
            got,
            (0..total).collect::<Vec<_>>(),
            "{from}->{to}: exactly once, in order"
        );
        assert_eq!(restored, 2, "{from}->{to}: two resumes");
        client.close().await;
    }
}

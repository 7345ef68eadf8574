//! An in-process cluster for SDK and edge tests: three demo backends, a route table
//! file, the edge with every listener.
#![allow(
    dead_code,
    unreachable_pub,
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use waygate_backend::demo::DemoService;
use waygate_backend::{Backend, BackendConfig};
use waygate_client::{Client, ClientOptions, Event};
use waygate_edge::config::EdgeConfig;
use waygate_edge::edge::Edge;
use waygate_routing::{RouteRequest, RouteTable, Router, RouterConfig};
use waygate_transport::endpoint::{ConnectOptions, Endpoint};
use waygate_transport::tls::ClientTls;
use waygate_transport::TransportKind;

use super::token;

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
    waygate_backend::demo::route_table(addrs, 1, |_| Some("active"))
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

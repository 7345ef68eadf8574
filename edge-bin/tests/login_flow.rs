//! The login flow studios run (newcomer issue, item 7): login service -> least-loaded edge ->
//! least-loaded game server. `waygate login` answers "which edge?" from the edges'
//! registrations in a real etcd; `waygate backend --etcd` registers the instance under a
//! lease for its services and reports its load, and its record goes when the process dies;
//! a Rust game server built on the backend SDK registers itself the same way
//! (`EtcdRegistry::register_backend_instance`) and the edges route players to it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;
mod support_etcd;
mod support_redis;

use std::time::Duration;

use common::Proc;
use etcd_client::GetOptions;
use support_etcd::EtcdServer;
use waygate_edge::cluster::etcd::{EdgeInfo, EtcdRegistry, InstanceRecord};
use waygate_routing::InstanceState;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waygate_login_answers_the_least_loaded_edge_from_etcd() {
    let etcd = EtcdServer::start();
    let registry = EtcdRegistry::connect(&etcd.endpoints(), "/waygate", Default::default())
        .await
        .unwrap();
    for (id, sessions) in [("edge-busy", 900), ("edge-calm", 20), ("edge-full", 5)] {
        let info = EdgeInfo {
            id: id.into(),
            address: format!("tcp://{id}.example:7000"),
            state: InstanceState::Active,
            capacity: (id == "edge-full").then_some(5),
            sessions,
            msg_rate: 0.0,
        };
        registry
            .register_edge(&info, Duration::from_secs(30))
            .await
            .unwrap();
    }
    let login = Proc::spawn(&["login", "--etcd", &etcd.endpoint(), "--addr", "127.0.0.1:0"]).await;
    let addr = login.ready["login"].as_str().unwrap().parse().unwrap();
    let (status, body) = common::http(addr, "GET", "/edge").await;
    assert_eq!(status, 200, "{body}");
    let picked: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(picked["id"], "edge-calm", "{body}");
    assert_eq!(picked["address"], "tcp://edge-calm.example:7000");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waygate_backend_registers_itself_with_its_load_and_goes_with_its_lease() {
    let etcd = EtcdServer::start();
    let mut backend = Proc::spawn(&[
        "backend",
        "--addr",
        "127.0.0.1:0",
        "--id",
        "g1",
        "--etcd",
        &etcd.endpoint(),
    ])
    .await;
    let bound = backend.ready["backend"].as_str().unwrap().to_string();
    let mut client = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .unwrap();
    let records = |c: &mut etcd_client::Client| {
        let mut c = c.clone();
        async move {
            let resp = c
                .get("/waygate/instances/", Some(GetOptions::new().with_prefix()))
                .await
                .unwrap();
            resp.kvs()
                .iter()
                .map(|kv| {
                    let key = String::from_utf8_lossy(kv.key()).into_owned();
                    let record: InstanceRecord = serde_json::from_slice(kv.value()).unwrap();
                    (key, record)
                })
                .collect::<Vec<_>>()
        }
    };
    let found = records(&mut client).await;
    let keys: Vec<&str> = found.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ["/waygate/instances/player/g1", "/waygate/instances/room/g1"]
    );
    for (_, r) in &found {
        assert_eq!(r.address, bound);
        assert_eq!(r.state, InstanceState::Active);
    }
    // The process dies: its leases expire (TTL 3 s) and the records go.
    backend.kill9();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !records(&mut client).await.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "records outlived the process"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Item 7's last part: a game server written on the backend SDK (in this process) registers
/// itself in etcd with `register_backend_instance` and `Backend::load_sampler`; an edge that
/// knows only the service (the base table names no instance) routes a player to it, and the
/// instance's load report counts that player.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_game_server_on_the_backend_sdk_registers_itself_and_gets_players() {
    use bytes::Bytes;
    use waygate_backend::demo::{ECHO, ECHO_REPLY};
    use waygate_transport::{TrafficClass, TransportKind};

    let etcd = EtcdServer::start();
    let redis = support_redis::RedisServer::start();
    let client = etcd_client::Client::connect(etcd.endpoints(), None)
        .await
        .unwrap();
    client
        .clone()
        .put(
            "/waygate/table",
            "epoch = 1\nupdated_at = 0\n[[services]]\nname = \"player\"\n\
             messages = [[1000, 1999]]\nkey = \"player\"\n",
            None,
        )
        .await
        .unwrap();
    let backend = std::sync::Arc::new(
        waygate_backend::Backend::bind(
            "127.0.0.1:0".parse().unwrap(),
            waygate_backend::BackendConfig::new("sdk-1"),
            std::sync::Arc::new(waygate_backend::demo::DemoService::new()),
        )
        .await
        .unwrap(),
    );
    let registry = std::sync::Arc::new(
        EtcdRegistry::connect(&etcd.endpoints(), "/waygate", Default::default())
            .await
            .unwrap(),
    );
    let spec = waygate_routing::InstanceSpec {
        id: "sdk-1".into(),
        address: backend.local_addr().to_string(),
        weight: 1.0,
        state: InstanceState::Active,
        capacity: None,
    };
    let leases = registry
        .register_backend_instance(
            &["player".to_string()],
            &spec,
            Duration::from_secs(3),
            Duration::from_millis(200),
            backend.load_sampler(),
        )
        .await
        .unwrap();
    assert_eq!(leases.len(), 1);

    let edge = common::EdgeProc::start_cluster(
        "edge-1",
        &etcd.endpoint(),
        &redis.url(),
        "[cluster]\nreport_ms = 200\n",
        &[],
    )
    .await;
    let mut player = waygate_client::Client::start(waygate_client::ClientOptions::new(
        vec![waygate_transport::endpoint::Endpoint::new(
            TransportKind::Tcp,
            edge.addr(TransportKind::Tcp),
        )],
        common::token("sdk-player"),
    ));
    player
        .send(TrafficClass::Normal, ECHO, Bytes::from_static(b"hi"))
        .await
        .unwrap();
    let reply = common::cluster::next_message(&mut player, ECHO_REPLY).await;
    assert_eq!(reply, Bytes::from_static(b"sdk-1|sdk-player|hi"));

    // The SDK instance's load report counts the player.
    let key = "/waygate/instances/player/sdk-1";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let resp = client.clone().get(key, None).await.unwrap();
        let record: Option<InstanceRecord> = resp
            .kvs()
            .first()
            .map(|kv| serde_json::from_slice(kv.value()).unwrap());
        if record.as_ref().is_some_and(|r| r.load.players >= 1) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no load report with the player: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    player.close().await;
    // A graceful exit revokes the registration at once.
    registry.shutdown().await.unwrap();
    let resp = client.clone().get(key, None).await.unwrap();
    assert!(resp.kvs().is_empty(), "the record outlived shutdown");
}

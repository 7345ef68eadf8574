//! The login flow studios run (newcomer issue, item 7): login service -> least-loaded edge ->
//! least-loaded game server. `waygate login` answers "which edge?" from the edges'
//! registrations in a real etcd; `waygate backend --etcd` registers the instance under a
//! lease for its services and reports its load, and its record goes when the process dies.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;
mod support_etcd;

use std::time::Duration;

use common::Proc;
use etcd_client::GetOptions;
use support_etcd::EtcdServer;
use waygate_edge::cluster::etcd::{EdgeInfo, EtcdRegistry, InstanceRecord};
use waygate_routing::InstanceState;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waygate_login_answers_the_least_loaded_edge_from_etcd() {
    let etcd = EtcdServer::start();
    let registry = EtcdRegistry::connect(&etcd.endpoints(), "/waygate")
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

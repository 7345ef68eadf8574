//! Registrations and load reports in a real etcd 3.4 (SPEC R9, R10): the least-loaded edge a
//! login service picks, instance load reports, revoke on shutdown.
#![allow(clippy::unwrap_used, missing_docs)]

mod support_etcd;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support_etcd::EtcdServer;
use tokio::sync::watch;
use waygate_edge::cluster::etcd::{
    least_loaded_edge, list_edges, pick_least_loaded, EdgeInfo, EtcdRegistry, Load,
};
use waygate_edge::cluster::login::login_router;
use waygate_routing::source::InstanceRegistry;
use waygate_routing::{InstanceSpec, InstanceState, LoadReport};

const PREFIX: &str = "/wg";

fn edge(id: &str, state: InstanceState, capacity: Option<u32>, sessions: u32) -> EdgeInfo {
    EdgeInfo {
        id: id.into(),
        address: format!("127.0.0.1:{}", 9000 + sessions),
        state,
        capacity,
        sessions,
        msg_rate: 0.0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_picks_the_least_loaded_enabled_edge_under_its_cap() {
    let etcd = EtcdServer::start();
    let reg = Arc::new(
        EtcdRegistry::connect(&etcd.endpoints(), PREFIX, Default::default())
            .await
            .unwrap(),
    );
    let client = reg.client().clone();
    assert_eq!(least_loaded_edge(&client, PREFIX).await.unwrap(), None);

    let ttl = Duration::from_secs(5);
    let e1 = reg
        .register_edge(&edge("e1", InstanceState::Active, None, 10), ttl)
        .await
        .unwrap();
    reg.register_edge(&edge("e2", InstanceState::Draining, None, 2), ttl)
        .await
        .unwrap();
    reg.register_edge(&edge("e3", InstanceState::Active, Some(7), 7), ttl)
        .await
        .unwrap();
    let e4 = reg
        .register_edge(&edge("e4", InstanceState::Active, Some(100), 8), ttl)
        .await
        .unwrap();
    assert_eq!(list_edges(&client, PREFIX).await.unwrap().len(), 4);
    let pick = least_loaded_edge(&client, PREFIX).await.unwrap().unwrap();
    assert_eq!(
        pick.id, "e4",
        "e2 draining, e3 full, e4 has fewer sessions than e1"
    );

    // Load reports move the choice.
    reg.report(
        e4,
        Load {
            players: 20,
            msg_rate: 5.0,
        },
    )
    .await
    .unwrap();
    assert_eq!(
        least_loaded_edge(&client, PREFIX)
            .await
            .unwrap()
            .unwrap()
            .id,
        "e1"
    );
    // A reporter task keeps the lease and publishes the load it is given.
    let (tx, rx) = watch::channel(Load {
        players: 1,
        msg_rate: 0.0,
    });
    let task = reg.spawn_reporter(e4, Duration::from_millis(200), rx);
    let deadline = Instant::now() + Duration::from_secs(5);
    while least_loaded_edge(&client, PREFIX)
        .await
        .unwrap()
        .unwrap()
        .id
        != "e4"
    {
        assert!(Instant::now() < deadline, "reporter did not publish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tx.send_replace(Load {
        players: 99,
        msg_rate: 0.0,
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while least_loaded_edge(&client, PREFIX)
        .await
        .unwrap()
        .unwrap()
        .id
        != "e1"
    {
        assert!(
            Instant::now() < deadline,
            "reporter did not publish the new load"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Revoke: the edge is gone at once; the reporter stops.
    reg.revoke_lease(e1).await.unwrap();
    let pick = least_loaded_edge(&client, PREFIX).await.unwrap().unwrap();
    assert_eq!(pick.id, "e4");
    reg.shutdown().await.unwrap();
    assert!(list_edges(&client, PREFIX).await.unwrap().is_empty());
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("reporter ends after revoke")
        .unwrap();
    assert_eq!(least_loaded_edge(&client, PREFIX).await.unwrap(), None);
    assert_eq!(http_get_edge(&client).await.0, 503);
}

async fn http_get_edge(client: &etcd_client::Client) -> (u16, Vec<u8>) {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let app = login_router(client.clone(), PREFIX.into());
    let req = axum::http::Request::get("/edge")
        .body(axum::body::Body::empty())
        .unwrap();
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_registry_trait_registers_reports_and_revokes() {
    let etcd = EtcdServer::start();
    let reg = EtcdRegistry::connect(&etcd.endpoints(), PREFIX, Default::default())
        .await
        .unwrap();
    let mut c = reg.client().clone();
    let spec = InstanceSpec {
        id: "b1".into(),
        address: "127.0.0.1:7100".into(),
        weight: 2.0,
        state: InstanceState::Active,
        capacity: Some(500),
    };
    let reg: &dyn InstanceRegistry = &reg;
    let lease = reg
        .register("game", &spec, Duration::from_secs(2))
        .await
        .unwrap();
    let key = format!("{PREFIX}/instances/game/b1");
    // Renewed past its TTL by keep-alives carrying load reports.
    for players in 1..=6 {
        reg.keep_alive(lease, LoadReport { players }).await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    let r = c.get(key.as_str(), None).await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(r.kvs()[0].value()).unwrap();
    assert_eq!(v["load"]["players"], 6);
    assert_eq!(v["capacity"], 500);
    assert_eq!(v["weight"], 2.0);
    reg.revoke(lease).await.unwrap();
    assert!(c.get(key.as_str(), None).await.unwrap().kvs().is_empty());
    assert!(reg
        .keep_alive(lease, LoadReport { players: 1 })
        .await
        .is_err());
}

#[test]
fn pick_prefers_active_edges_under_their_cap() {
    let edges = vec![
        edge("b", InstanceState::Active, None, 5),
        edge("a", InstanceState::Active, None, 5),
        edge("c", InstanceState::Disabled, None, 0),
        edge("d", InstanceState::Active, Some(3), 3),
    ];
    assert_eq!(pick_least_loaded(&edges).unwrap().id, "a", "ties by id");
    assert!(pick_least_loaded(&edges[2..]).is_none());
}

//! The real `waygate` binary with real demo backend processes: every transport reaches the
//! right instance; a table change moves only the removed instance's players; a backend
//! that is ahead on the route epoch makes the edge refresh and re-route.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use waygate_backend::demo::{JOINED, JOIN_ROOM, ROOM_EVENT, ROOM_SAY};
use waygate_client::Event;
use waygate_routing::{RouteRequest, RouteTable, Router, RouterConfig};
use waygate_transport::{TrafficClass, TransportKind};

fn expected(
    table: &str,
    ids: &HashMap<SocketAddr, String>,
    msg_id: u32,
    player: &str,
    room: Option<&str>,
) -> String {
    let mut router = Router::new(RouterConfig::default(), std::time::Instant::now());
    router
        .apply_table(
            RouteTable::from_toml_str(table).unwrap(),
            std::time::Instant::now(),
        )
        .unwrap();
    let mut req = RouteRequest::player(player);
    if let Some(r) = room {
        req = req.room(r);
    }
    let d = router.route(msg_id, &req).unwrap();
    ids[&d.address.parse::<SocketAddr>().unwrap()].clone()
}

async fn three_backends() -> (Vec<Proc>, Vec<SocketAddr>, HashMap<SocketAddr, String>) {
    let mut procs = Vec::new();
    let mut addrs = Vec::new();
    let mut ids = HashMap::new();
    for i in 1..=3 {
        let id = format!("b{i}");
        let (p, a) = backend(&id, &[]).await;
        procs.push(p);
        addrs.push(a);
        ids.insert(a, id);
    }
    (procs, addrs, ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transport_reaches_the_right_instance_and_a_table_change_moves_only_the_removed_ones()
{
    let (_backends, addrs, ids) = three_backends().await;
    let t1 = table(&addrs, 1, None);
    let edge = EdgeProc::start(&t1, "").await;

    // Every transport, by player id and by room id.
    for (n, kind) in TransportKind::ALL.into_iter().enumerate() {
        let player = format!("proc-{kind}");
        let mut c = edge.client(kind, &player);
        assert_eq!(
            echo(&mut c, "x").await.unwrap(),
            expected(&t1, &ids, 1000, &player, None),
            "{kind}"
        );
        let room = format!("room-{n}");
        c.send(TrafficClass::Critical, JOIN_ROOM, Bytes::from(room.clone()))
            .await
            .unwrap();
        wait_for(
            &mut c,
            Duration::from_secs(10),
            |e| matches!(e, Event::Message { msg_id, .. } if *msg_id == JOINED),
        )
        .await;
        c.send(
            TrafficClass::Normal,
            ROOM_SAY,
            Bytes::from(format!("{room}|hi")),
        )
        .await
        .unwrap();
        let ev = wait_for(
            &mut c,
            Duration::from_secs(10),
            |e| matches!(e, Event::Message { msg_id, .. } if *msg_id == ROOM_EVENT),
        )
        .await;
        let Event::Message { payload, .. } = ev else {
            unreachable!()
        };
        let text = String::from_utf8(payload.to_vec()).unwrap();
        let want = expected(&t1, &ids, 2000, &player, Some(&room));
        assert!(
            text.starts_with(&format!("{want}|{room}|")),
            "{kind}: {text} not from {want}"
        );
        c.close().await;
    }

    // 40 players bind to their instances.
    let mut clients = Vec::new();
    let mut before = HashMap::new();
    for i in 0..40 {
        let player = format!("mover-{i}");
        let mut c = edge.client(TransportKind::Tcp, &player);
        let b = echo(&mut c, "a").await.unwrap();
        before.insert(player.clone(), b);
        clients.push((player, c));
    }
    // Remove p3 from the player service (epoch 2).
    edge.write_routes(&table(&addrs, 2, Some(2)));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = http(edge.admin(), "GET", "/routes").await;
        if body.contains("\"epoch\":2") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "table 2 not applied: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let removed = ids[&addrs[2]].clone();
    let mut moved = 0;
    for (player, c) in clients.iter_mut() {
        // Bindings on the removed instance are released at the migration rate; retry
        // briefly until the move shows.
        let mut now_on = echo(c, "b").await.unwrap();
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while now_on == removed && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
            now_on = echo(c, "c").await.unwrap();
        }
        let was = &before[player];
        if *was == removed {
            assert_ne!(now_on, removed, "{player} must leave the removed instance");
            moved += 1;
        } else {
            assert_eq!(
                &now_on, was,
                "{player} was not on the removed instance and must stay"
            );
        }
    }
    assert!(moved > 0, "some players were on the removed instance");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_ahead_on_the_epoch_makes_the_edge_refresh_and_reroute() {
    let (_b, addr) = backend("b1", &["--epoch", "2"]).await;
    let addrs = vec![addr];
    // The edge starts on epoch 1 and would not poll the file again for ten minutes.
    let edge = EdgeProc::start_polling(&table(&addrs, 1, None), 600_000, "").await;
    edge.write_routes(&table(&addrs, 2, None));
    // The backend refuses the epoch-1 forward with stale_epoch(2); the edge refreshes its
    // source, applies epoch 2 and routes the same message again: it is answered.
    let mut c = edge.client(TransportKind::Tcp, "epoch-player");
    assert_eq!(echo(&mut c, "e").await.unwrap(), "b1");
    let (_, body) = http(edge.admin(), "GET", "/routes").await;
    assert!(body.contains("\"epoch\":2"), "{body}");
    let (_, metrics) = http(edge.admin(), "GET", "/metrics").await;
    let reroutes = metrics
        .lines()
        .find(|l| l.starts_with("waygate_stale_epoch_reroutes_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(reroutes >= 1.0, "{metrics}");
}

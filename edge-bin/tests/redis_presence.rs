//! Presence (player -> edge + session, with a TTL) and batched cross-edge push with
//! per-message results, against a real redis-server 7.

mod support_redis;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use support_redis::RedisServer;
use waygate_edge::cluster::redis::{
    DeliveryResult, Presence, PushMessage, RedisConfig, RedisStores,
};
use waygate_transport::TrafficClass;

fn msg(i: u32) -> PushMessage {
    PushMessage {
        class: TrafficClass::Normal,
        msg_id: i,
        payload: Bytes::from(format!("m{i}\x00\u{ff}")),
        id: 0,
    }
}

#[tokio::test]
async fn presence_records_expire_refresh_and_are_removed_only_by_their_session() {
    let server = RedisServer::start();
    let mut cfg = RedisConfig::new(server.url());
    cfg.presence_ttl = Duration::from_millis(300);
    let s = RedisStores::connect_with(cfg).await.expect("connect");
    let p = &s.presence;
    assert_eq!(p.lookup("a").await, Ok(None));
    p.set("a", &[1; 16], "e1").await.expect("set");
    p.set_many("e2", &[("b".into(), [2; 16]), ("c".into(), [3; 16])])
        .await
        .expect("set many");
    assert_eq!(
        p.lookup_many(&["a", "b", "zzz", "c"])
            .await
            .expect("lookup"),
        vec![
            Some(Presence {
                edge: "e1".into(),
                session_id: [1; 16]
            }),
            Some(Presence {
                edge: "e2".into(),
                session_id: [2; 16]
            }),
            None,
            Some(Presence {
                edge: "e2".into(),
                session_id: [3; 16]
            }),
        ]
    );
    // A newer session of "a" elsewhere: the old session's removal leaves it.
    p.set("a", &[9; 16], "e3").await.expect("set");
    assert_eq!(p.remove("a", &[1; 16], "e1").await, Ok(false));
    assert_eq!(
        p.lookup("a").await.expect("lookup").map(|x| x.edge),
        Some("e3".into())
    );
    // The same session moved to e3: its superseded copy ending on e1 (or on an edge whose
    // id is a prefix of e3's) leaves the record where it lives now.
    assert_eq!(p.remove("a", &[9; 16], "e1").await, Ok(false));
    assert_eq!(p.remove("a", &[9; 16], "e").await, Ok(false));
    assert!(p.lookup("a").await.expect("lookup").is_some());
    assert_eq!(p.remove("a", &[9; 16], "e3").await, Ok(true));
    assert_eq!(p.lookup("a").await, Ok(None));
    // TTL: refreshed records stay, others expire.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        p.set("b", &[2; 16], "e2").await.expect("refresh");
    }
    assert!(p.lookup("b").await.expect("lookup").is_some(), "refreshed");
    assert_eq!(p.lookup("c").await, Ok(None), "expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_push_returns_a_result_per_message() {
    let server = RedisServer::start();
    let sender = RedisStores::connect(&server.url()).await.expect("connect");
    let edge1 = RedisStores::connect(&server.url()).await.expect("connect");
    let edge2 = RedisStores::connect(&server.url()).await.expect("connect");
    // Edge 1 holds "alice" (queue has room) and "bob" (queue full).
    let got1: Arc<Mutex<Vec<(String, PushMessage)>>> = Arc::default();
    let g = got1.clone();
    let mut server1 = edge1
        .presence
        .serve_pushes("e1", move |player: &str, m: PushMessage| match player {
            "alice" => {
                g.lock().expect("lock").push((player.to_owned(), m));
                DeliveryResult::Delivered
            }
            "bob" => DeliveryResult::QueueFull,
            _ => DeliveryResult::Offline,
        });
    // Edge 2 holds "carol".
    let got2: Arc<Mutex<Vec<u32>>> = Arc::default();
    let g2 = got2.clone();
    let mut server2 = edge2
        .presence
        .serve_pushes("e2", move |player: &str, m: PushMessage| {
            if player == "carol" {
                g2.lock().expect("lock").push(m.msg_id);
                DeliveryResult::Delivered
            } else {
                DeliveryResult::Offline
            }
        });
    assert!(server1.wait_up(Duration::from_secs(5)).await);
    assert!(server2.wait_up(Duration::from_secs(5)).await);

    // One batch to one edge.
    let r = sender
        .presence
        .push_batch(
            "e1",
            vec![
                ("alice".into(), msg(1)),
                ("bob".into(), msg(2)),
                ("dave".into(), msg(3)),
                ("alice".into(), msg(4)),
            ],
        )
        .await
        .expect("push");
    use DeliveryResult::*;
    assert_eq!(r, vec![Delivered, QueueFull, Offline, Delivered]);
    let got = got1.lock().expect("lock").clone();
    assert_eq!(
        got,
        vec![("alice".into(), msg(1)), ("alice".into(), msg(4))],
        "in order, intact"
    );
    // An edge nobody serves.
    let r = sender
        .presence
        .push_batch("e-gone", vec![("x".into(), msg(5))])
        .await
        .expect("push");
    assert_eq!(r, vec![EdgeUnreachable]);

    // Presence-routed push across edges, results in the caller's order.
    let p = &sender.presence;
    p.set("alice", &[1; 16], "e1").await.expect("set");
    p.set("bob", &[2; 16], "e1").await.expect("set");
    p.set("carol", &[3; 16], "e2").await.expect("set");
    p.set("erin", &[4; 16], "e-gone").await.expect("set");
    let r = p
        .push(vec![
            ("carol".into(), msg(10)),
            ("nobody".into(), msg(11)),
            ("alice".into(), msg(12)),
            ("erin".into(), msg(13)),
            ("bob".into(), msg(14)),
            ("carol".into(), msg(15)),
        ])
        .await
        .expect("push");
    assert_eq!(
        r,
        vec![
            Delivered,
            Offline,
            Delivered,
            EdgeUnreachable,
            QueueFull,
            Delivered
        ]
    );
    assert_eq!(*got2.lock().expect("lock"), vec![10, 15]);

    // Many concurrent batches: every reply reaches its own caller.
    let mut tasks = Vec::new();
    for i in 0..50u32 {
        let presence = sender.presence.clone();
        tasks.push(tokio::spawn(async move {
            let batch = (0..20).map(|j| {
                let who = if (i + j) % 3 == 0 { "bob" } else { "alice" };
                (who.to_owned(), msg(i * 100 + j))
            });
            let want: Vec<_> = (0..20)
                .map(|j| {
                    if (i + j) % 3 == 0 {
                        QueueFull
                    } else {
                        Delivered
                    }
                })
                .collect();
            let got = presence
                .push_batch("e1", batch.collect())
                .await
                .expect("push");
            assert_eq!(got, want, "batch {i}");
        }));
    }
    for t in tasks {
        t.await.expect("join");
    }

    // The receiving side stops when its server is dropped; a silent edge times out.
    drop(server1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = sender
        .presence
        .push_batch("e1", vec![("alice".into(), msg(99))])
        .await
        .expect("push");
    assert_eq!(r, vec![EdgeUnreachable]);
}

#[tokio::test]
async fn a_listening_edge_that_does_not_answer_yields_timeout_results() {
    let server = RedisServer::start();
    let mut cfg = RedisConfig::new(server.url());
    cfg.push_timeout = Duration::from_millis(300);
    let sender = RedisStores::connect_with(cfg).await.expect("connect");
    // A raw subscriber that never answers.
    let client = redis::Client::open(server.url()).expect("client");
    let mut ps = client.get_async_pubsub().await.expect("pubsub");
    ps.subscribe("waygate:edge:mute:push")
        .await
        .expect("subscribe");
    let t0 = std::time::Instant::now();
    let r = sender
        .presence
        .push_batch("mute", vec![("a".into(), msg(1)), ("b".into(), msg(2))])
        .await
        .expect("push");
    assert_eq!(r, vec![DeliveryResult::Timeout; 2]);
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(2), "bounded wait: {took:?}");
    drop(ps);
}

//! Redis down: every call fails fast (bounded, typed error) instead of hanging; Redis back:
//! the same clients work again, subscriptions come back, and edges re-assert ownership of
//! their live sessions (Redis lost its data: no persistence in the harness).

mod support_redis;

use std::time::{Duration, Instant};

use support_redis::RedisServer;
use waygate_edge::cluster::redis::{
    DeliveryResult, PushMessage, Reassert, RedisError, RedisStores,
};
use waygate_session::resume::ResumeHash;
use waygate_session::store::{OwnershipRegistry, SnapshotStore, StoreError};
use waygate_transport::TrafficClass;

const FAST: Duration = Duration::from_secs(1);

fn is_down(e: &StoreError) -> bool {
    matches!(e, StoreError::Timeout | StoreError::Unavailable(_))
}

async fn wait_up(w: &mut tokio::sync::watch::Receiver<bool>) {
    tokio::time::timeout(Duration::from_secs(10), w.wait_for(|u| *u))
        .await
        .expect("subscription up within 10 s")
        .expect("watch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_fast_and_recovery_needs_no_new_client() {
    let mut server = RedisServer::start();
    let edge_a = RedisStores::connect(&server.url()).await.expect("connect");
    let edge_b = RedisStores::connect(&server.url()).await.expect("connect");
    let (mut kicks_a, mut kicks_up) = edge_a.ownership.subscribe_kicks_with_status("ea");
    wait_up(&mut kicks_up).await;
    let live = edge_a
        .ownership
        .claim("p", &[1; 16], "ea")
        .await
        .expect("claim");

    server.stop();
    // Several rounds of every kind of call: each returns a typed error within 1 s.
    for round in 0..3 {
        let t = Instant::now();
        let e = edge_b
            .ownership
            .claim("q", &[2; 16], "eb")
            .await
            .expect_err("down");
        assert!(
            is_down(&e) && t.elapsed() < FAST,
            "round {round}: {e:?} {:?}",
            t.elapsed()
        );
        let t = Instant::now();
        let e = edge_b.ownership.owner("p").await.expect_err("down");
        assert!(is_down(&e) && t.elapsed() < FAST, "{e:?} {:?}", t.elapsed());
        let t = Instant::now();
        let e = edge_b
            .snapshots
            .take(&[1; 16], &ResumeHash::of(&[0; 16]))
            .await
            .expect_err("down");
        assert!(is_down(&e) && t.elapsed() < FAST, "{e:?} {:?}", t.elapsed());
        let t = Instant::now();
        let e = edge_b.presence.lookup("p").await.expect_err("down");
        assert!(
            matches!(e, RedisError::Timeout | RedisError::Unavailable(_)) && t.elapsed() < FAST,
            "{e:?} {:?}",
            t.elapsed()
        );
        let t = Instant::now();
        let r = edge_b
            .presence
            .push_batch(
                "ea",
                vec![(
                    "p".into(),
                    PushMessage {
                        class: TrafficClass::Normal,
                        msg_id: 1,
                        payload: bytes::Bytes::from_static(b"x"),
                        id: 0,
                    },
                )],
            )
            .await;
        assert!(r.is_err() && t.elapsed() < FAST, "{r:?} {:?}", t.elapsed());
        let t = Instant::now();
        let r = edge_a
            .ownership
            .reassert("p", &[1; 16], "ea", live.fencing)
            .await;
        assert!(r.is_err() && t.elapsed() < FAST, "{r:?} {:?}", t.elapsed());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !*kicks_up.borrow(),
        "the kick subscription noticed the outage"
    );

    server.restart();
    // The same clients work again (reconnect in the background).
    let back = Instant::now();
    let deadline = back + Duration::from_secs(10);
    loop {
        if edge_b.ownership.owner("p").await.is_ok() {
            eprintln!("calls work again {:?} after the restart", back.elapsed());
            break;
        }
        assert!(Instant::now() < deadline, "no recovery within 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Redis lost everything; edge A re-asserts its live session.
    assert_eq!(edge_b.ownership.owner("p").await, Ok(None), "data lost");
    // Edge A's own connection may still be reconnecting (each call is bounded): retry while
    // it times out, as the edge's reassert sweep does.
    let until = Instant::now() + Duration::from_secs(10);
    let reasserted = loop {
        let r = edge_a
            .ownership
            .reassert("p", &[1; 16], "ea", live.fencing)
            .await;
        if r.is_ok() || Instant::now() > until {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(reasserted, Ok(Reassert::Owner));
    let owner = edge_b
        .ownership
        .owner("p")
        .await
        .expect("owner")
        .expect("some");
    assert_eq!(
        (owner.session_id, owner.edge.as_str(), owner.fencing),
        ([1; 16], "ea", live.fencing)
    );
    // The kick subscription is back: a takeover from edge B reaches edge A, with a larger
    // fencing token than the re-asserted one.
    wait_up(&mut kicks_up).await;
    let g = edge_b
        .ownership
        .claim("p", &[3; 16], "eb")
        .await
        .expect("claim");
    assert!(g.fencing > live.fencing);
    assert_eq!(g.previous.map(|o| o.session_id), Some([1; 16]));
    let k = tokio::time::timeout(Duration::from_secs(2), kicks_a.recv())
        .await
        .expect("kick in time")
        .expect("open");
    assert_eq!(
        (k.session_id, k.fencing, k.new_fencing),
        ([1; 16], live.fencing, g.fencing)
    );
    // And the stale session can no longer re-assert.
    assert!(matches!(
        edge_a
            .ownership
            .reassert("p", &[1; 16], "ea", live.fencing)
            .await,
        Ok(Reassert::Superseded(Some(_)))
    ));
    // Push works again too.
    let mut srv = edge_a
        .presence
        .serve_pushes("ea", |_: &str, _: PushMessage| DeliveryResult::Delivered);
    assert!(srv.wait_up(Duration::from_secs(5)).await);
    let r = edge_b
        .presence
        .push_batch(
            "ea",
            vec![(
                "p".into(),
                PushMessage {
                    class: TrafficClass::Critical,
                    msg_id: 2,
                    payload: bytes::Bytes::from_static(b"y"),
                    id: 0,
                },
            )],
        )
        .await
        .expect("push");
    assert_eq!(r, vec![DeliveryResult::Delivered]);
}

#[tokio::test]
async fn connect_fails_fast_when_redis_is_not_there_and_lazy_stores_start_anyway() {
    let mut server = RedisServer::start();
    let url = server.url();
    server.stop();
    let t = Instant::now();
    let e = RedisStores::connect(&url)
        .await
        .expect_err("nothing listening");
    assert!(t.elapsed() < FAST, "{e:?} after {:?}", t.elapsed());
    // An edge can start without Redis and serve once it appears.
    let lazy =
        RedisStores::lazy(waygate_edge::cluster::redis::RedisConfig::new(url)).expect("lazy");
    assert!(lazy.ownership.owner("p").await.is_err());
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while lazy.ownership.claim("p", &[1; 16], "e").await.is_err() {
        assert!(Instant::now() < deadline, "no recovery within 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

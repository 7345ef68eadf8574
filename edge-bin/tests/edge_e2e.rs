//! The edge end to end, in process: three demo backends, a route table file, the edge with
//! every listener, and SDK clients on every transport. Checks that each message reaches
//! the instance the route table chooses, by player id and by room id.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::cluster::*;
use waygate_backend::demo::{ECHO, ECHO_REPLY, JOINED, JOIN_ROOM, ROOM_EVENT, ROOM_SAY};
use waygate_client::Event;
use waygate_transport::{TrafficClass, TransportKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transport_reaches_the_instance_of_its_player_and_room() {
    let c = cluster().await;
    let kinds = TransportKind::ALL;
    let mut kept = Vec::new();
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
            if n == 3 {
                // The last client of each transport stays: its session is held at the scrape.
                kept.push(client);
            } else {
                client.close().await;
            }
        }
    }
    // Phase timing (O1): session setup per transport is observed.
    let metrics = c.edge.admin().metrics_text();
    for kind in kinds {
        assert!(
            metrics.contains(&format!(
                "waygate_session_setup_seconds_count{{transport=\"{kind}\"}} 4"
            )),
            "{kind}: {metrics}"
        );
    }
    // The setup's phases (O1), observed for every session: the transport's own handshake
    // (TLS, upgrade, QUIC), HELLO, auth, restore, claim.
    for kind in kinds {
        for phase in ["transport", "hello", "auth", "restore", "claim"] {
            let count = format!(
                "waygate_session_phase_seconds_count{{transport=\"{kind}\",phase=\"{phase}\"}} 4"
            );
            assert!(metrics.contains(&count), "{count}: {metrics}");
        }
    }
    // Routing time (O1): one observation per routed upstream message (ECHO, JOIN_ROOM and
    // ROOM_SAY of every client).
    let routed = kinds.len() * 4 * 3;
    assert!(
        metrics.contains(&format!("waygate_route_seconds_count {routed}")),
        "{routed} routings: {metrics}"
    );
    // Queue-length distribution (O1): one observation per session held, at scrape time.
    let held = sample(&metrics, "waygate_sessions_live");
    assert!(held >= kinds.len() as f64, "{metrics}");
    assert_eq!(
        sample(&metrics, "waygate_session_queue_length_count"),
        held,
        "{metrics}"
    );
    assert!(
        metrics.contains("waygate_session_queue_length_bucket{le=\"0.0\"}"),
        "{metrics}"
    );
    // Strict exposition (regression: the session counters were hand-formatted beside the
    // registry, with one `# TYPE waygate_session_transition` line per label pair, which
    // strict OpenMetrics parsers reject): one TYPE line per family, and the transitions
    // these sessions made are in it.
    let mut families = std::collections::HashSet::new();
    for line in metrics.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line
            .split_whitespace()
            .nth(2)
            .unwrap_or_default()
            .to_string();
        assert!(
            families.insert(name.clone()),
            "second TYPE line for {name}:\n{metrics}"
        );
    }
    assert!(families.contains("waygate_session_transition"), "{metrics}");
    assert!(
        metrics.contains("waygate_session_transition_total{from=\"authenticated\",to=\"active\"}"),
        "{metrics}"
    );
    assert_eq!(metrics.matches("# EOF").count(), 1, "{metrics}");
    for client in kept {
        client.close().await;
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
                    client.drop_link().await.expect("client running");
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
                    if outcome == waygate_protocol::frame::WelcomeOutcome::Restored {
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

/// The value of an unlabelled sample in an exposition.
fn sample(metrics: &str, name: &str) -> f64 {
    let prefix = format!("{name} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
}

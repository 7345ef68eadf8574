//! Live sessions that must ride out a failover of the edge's Redis (a Redis Cluster master
//! or a Sentinel primary killed under them): logged in on TCP, echoing, never disturbed.
#![allow(
    dead_code,
    unreachable_pub,
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used
)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use waygate_client::{Client, ClientOptions, Event};
use waygate_edge::cluster::redis::RedisOwnership;
use waygate_session::store::OwnershipRegistry as _;
use waygate_transport::endpoint::Endpoint;
use waygate_transport::{TrafficClass, TransportKind};

/// `n` SDK clients on the edge's TCP listener, each with one echo answered.
pub struct LiveSessions {
    /// (player, client)
    pub clients: Vec<(String, Client)>,
    /// Each client's session id, in the same order.
    pub sessions: Vec<[u8; 16]>,
}

impl LiveSessions {
    /// Logs `n` players (`live-0`, ...) in on `tcp` and has one echo of each answered.
    pub async fn start(tcp: SocketAddr, n: usize) -> Self {
        let mut clients = Vec::new();
        let mut sessions = Vec::new();
        for i in 0..n {
            let player = format!("live-{i}");
            let mut c = Client::start(ClientOptions::new(
                vec![Endpoint::new(TransportKind::Tcp, tcp)],
                super::token(&player),
            ));
            match super::wait_for(&mut c, Duration::from_secs(10), |e| {
                matches!(e, Event::Connected { .. })
            })
            .await
            {
                Event::Connected { session_id, .. } => sessions.push(session_id),
                _ => unreachable!(),
            }
            assert_eq!(super::echo(&mut c, "hello").await, Ok("b1".into()));
            clients.push((player, c));
        }
        Self { clients, sessions }
    }

    /// Echo rounds over every session, one at a time, until `for_at_least` has passed: every
    /// echo answered within 10 s, none refused, no session disconnected or restored.
    /// Returns the number of rounds.
    pub async fn echo_rounds(&mut self, for_at_least: Duration) -> usize {
        let started = Instant::now();
        let mut round = 0;
        while started.elapsed() < for_at_least {
            for (player, c) in self.clients.iter_mut() {
                let tag = format!("r{round}");
                let seq = c
                    .send(
                        TrafficClass::Normal,
                        waygate_backend::demo::ECHO,
                        tag.clone().into(),
                    )
                    .await
                    .unwrap()
                    .unwrap();
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                loop {
                    let ev = tokio::time::timeout_at(deadline, c.next_event())
                        .await
                        .unwrap_or_else(|_| panic!("{player}: no reply to {tag} in 10 s"))
                        .expect("client running");
                    match ev {
                        Event::Message {
                            msg_id, payload, ..
                        } if msg_id == waygate_backend::demo::ECHO_REPLY
                            && payload.ends_with(tag.as_bytes()) =>
                        {
                            break
                        }
                        Event::Error(r) if r.client_seq == seq => {
                            panic!("{player}: {tag} refused {:?}", r.code)
                        }
                        Event::Connected { .. }
                        | Event::Disconnected { .. }
                        | Event::Closed { .. } => {
                            panic!("{player}: the session was disturbed: {ev:?}")
                        }
                        _ => {}
                    }
                }
            }
            round += 1;
        }
        round
    }

    /// Every client connected once, and within `within` every player's owner record names
    /// its live session (the re-assert sweep restores what a failover lost).
    pub async fn assert_owners(&self, ownership: &RedisOwnership, within: Duration) {
        let deadline = Instant::now() + within;
        for ((player, c), sid) in self.clients.iter().zip(&self.sessions) {
            assert_eq!(c.stats().connects, 1, "{player} reconnected");
            loop {
                let owner = ownership.owner(player).await.ok().flatten();
                if owner.as_ref().map(|o| o.session_id) == Some(*sid) {
                    break;
                }
                assert!(Instant::now() < deadline, "{player}: owner {owner:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// `n` new logins (`after-0`, ...) on `tcp` are welcomed, each retried every 200 ms until
/// `within` has passed.
pub async fn new_logins_welcomed(tcp: SocketAddr, n: usize, within: Duration) {
    let deadline = Instant::now() + within;
    for i in 0..n {
        loop {
            match super::raw_hello(tcp, super::token(&format!("after-{i}"))).await {
                waygate_transport::Frame::Welcome(_) => break,
                other => assert!(Instant::now() < deadline, "login after failover: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

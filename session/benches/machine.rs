//! The session layer per message, sans-IO: one established pair of [`SessionMachine`]
//! (edge side) and [`ClientSession`] (client side) in memory, no sockets, no runtime.
//!
//! - `upstream`: client `send` -> DATA -> machine `handle_frame` -> `Deliver`;
//! - `downstream`: machine `send_downstream` -> DATA -> client `handle_frame` -> event;
//! - `round_trip`: both, as the edge does for one ECHO and its reply (acks ride along or go
//!   out when the ack policy says so).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use waygate_session::auth::TokenClaims;
use waygate_session::client::{ClientConfig, ClientEvent, ClientSession};
use waygate_session::store::ClaimGrant;
use waygate_session::{
    mint_token, Action, HmacAuthenticator, KeyRing, SeededRng, SessionConfig, SessionCounters,
    SessionMachine,
};
use waygate_transport::TrafficClass;

const KEY: &[u8] = b"bench key, 32 bytes long........";
const UNIX: u64 = 1_800_000_000;

struct Pair {
    m: SessionMachine,
    c: ClientSession,
    auth: HmacAuthenticator,
    now: Instant,
    delivered: u64,
    events: u64,
}

impl Pair {
    fn new() -> Self {
        let mut ring = KeyRing::new();
        ring.insert(1, KEY);
        let token = mint_token(
            1,
            KEY,
            &TokenClaims {
                player_id: "bench-player".into(),
                issuer: "bench".into(),
                issued_at: UNIX - 5,
                expires_at: UNIX + 3600,
                extensions: vec![],
            },
        )
        .expect("token");
        let now = Instant::now();
        let mut p = Pair {
            m: SessionMachine::new(
                SessionConfig {
                    heartbeat_interval: Duration::from_secs(3600),
                    idle_timeout: Duration::from_secs(7200),
                    ..SessionConfig::default()
                },
                Arc::new(SessionCounters::new()),
                Box::new(SeededRng::new(7)),
            ),
            c: ClientSession::new(token, ClientConfig::default()),
            auth: HmacAuthenticator::new(ring),
            now,
            delivered: 0,
            events: 0,
        };
        p.m.handle_link_up(now).expect("link up");
        p.c.connect(now).expect("connect");
        p.pump();
        assert_eq!(p.m.state(), waygate_session::State::Active);
        p
    }

    /// Moves frames both ways and answers the machine's requests until quiet.
    fn pump(&mut self) {
        loop {
            let mut moved = false;
            while let Some(f) = self.c.poll_transmit() {
                let _ = self.m.handle_frame(self.now, f);
                moved = true;
            }
            while let Some(a) = self.m.poll_action() {
                moved = true;
                match a {
                    Action::Send(f) => {
                        let _ = self.c.handle_frame(self.now, f);
                    }
                    Action::Authenticate { token } => {
                        let r = self.auth.verify(&token, UNIX);
                        let _ = self.m.handle_auth_result(self.now, r);
                    }
                    Action::Claim { .. } => {
                        let grant = ClaimGrant {
                            fencing: 1,
                            previous: None,
                        };
                        let _ = self
                            .m
                            .handle_claimed(self.now, Ok((grant, None::<BTreeMap<_, _>>)));
                    }
                    Action::Deliver(u) => {
                        self.delivered += 1;
                        // The backend's answer (FORWARD_DONE) arrives with its reply.
                        let _ = self.m.answer_upstream(self.now, u.seq);
                        black_box(u);
                    }
                    other => {
                        black_box(other);
                    }
                }
            }
            while let Some(ev) = self.c.poll_event() {
                if matches!(ev, ClientEvent::Message { .. }) {
                    self.events += 1;
                }
                black_box(ev);
            }
            if !moved {
                break;
            }
        }
    }

    /// Fires due timers (delayed acks) so buffers stay bounded.
    fn tick(&mut self, step: Duration) {
        self.now += step;
        self.c.handle_timeout(self.now);
        self.m.handle_timeout(self.now);
        self.pump();
    }
}

fn machine(c: &mut Criterion) {
    let mut group = c.benchmark_group("session");
    group.throughput(Throughput::Elements(1));
    for size in [64usize, 1024] {
        let payload = Bytes::from(vec![0x5a; size]);
        group.bench_with_input(BenchmarkId::new("upstream", size), &payload, |b, p| {
            let mut pair = Pair::new();
            let mut n = 0u64;
            b.iter(|| {
                pair.c
                    .send(pair.now, TrafficClass::Normal, 1000, p.clone())
                    .expect("send");
                pair.pump();
                n += 1;
                if n % 64 == 0 {
                    pair.tick(Duration::from_millis(25));
                }
            });
            black_box(pair.delivered);
        });
        group.bench_with_input(BenchmarkId::new("downstream", size), &payload, |b, p| {
            let mut pair = Pair::new();
            let mut n = 0u64;
            b.iter(|| {
                pair.m
                    .send_downstream(pair.now, TrafficClass::Normal, 1001, p.clone())
                    .expect("push");
                pair.pump();
                n += 1;
                if n % 64 == 0 {
                    pair.tick(Duration::from_millis(25));
                }
            });
            black_box(pair.events);
        });
        group.bench_with_input(BenchmarkId::new("round_trip", size), &payload, |b, p| {
            let mut pair = Pair::new();
            let mut n = 0u64;
            b.iter(|| {
                pair.c
                    .send(pair.now, TrafficClass::Normal, 1000, p.clone())
                    .expect("send");
                pair.pump();
                pair.m
                    .send_downstream(pair.now, TrafficClass::Normal, 1001, p.clone())
                    .expect("reply");
                pair.pump();
                n += 1;
                if n % 64 == 0 {
                    pair.tick(Duration::from_millis(25));
                }
            });
            black_box((pair.delivered, pair.events));
        });
    }
    group.finish();
}

criterion_group!(benches, machine);
criterion_main!(benches);

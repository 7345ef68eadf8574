//! The session host's property test: random interleavings of logins, drops, resumes
//! (valid, stale, foreign, beyond the sent seq), second logins that kick, backend pushes in
//! every class, stuck connection drivers (a full outbound queue: slow consumer; hand-overs
//! and kicks that time out), bursts over the inbound limit (the link is not read meanwhile),
//! the shared store failing or timing out, and time passing beyond the linger — all through the real [`SessionHost`](crate::host::SessionHost)
//! in the pair harness, on a virtual clock. Invariants are checked after every step.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use waygate_protocol::frame::{Hello, ResumeRequest, SessionId, WelcomeOutcome};
use waygate_protocol::wire::PROTOCOL_VERSION;
use waygate_transport::{Frame, TrafficClass};

use super::pair::{token_for, Pair};
use crate::client::{ClientEvent, ClientState};
use crate::machine::{SessionConfig, State};
use crate::replay::ReplayLimits;

/// Clients 0 and 1 log in as player "p0" (a second device: each login kicks the other),
/// client 2 as "p1".
const CLIENTS: usize = 3;
const PLAYERS: [&str; 2] = ["p0", "p1"];

fn player_of(c: usize) -> &'static str {
    if c < 2 {
        PLAYERS[0]
    } else {
        PLAYERS[1]
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Client connects (resuming its session if it has one).
    Connect(usize),
    /// Client's link dies now.
    Cut(usize),
    /// Move frames along a client's link.
    Step(usize, u8),
    /// The backend pushes `n` messages of a class to a player's session.
    Push(usize, u8, u8),
    /// The client sends `n` messages of a class.
    Send(usize, u8, u8),
    /// A forged resume of a client's session on a new connection: 0 beyond the sent seq
    /// (valid token), 1 a stale resume token, 2 another player's auth token.
    Forged(usize, u8),
    /// The driver of a client's server connection gets stuck / recovers.
    Stall(usize),
    Release(usize),
    /// Time passes (ms); large values pass the linger.
    Advance(u32),
    /// The shared store and ownership registry go down (unavailable or timing out) or
    /// come back.
    Store(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let c = 0..CLIENTS;
    prop_oneof![
        3 => c.clone().prop_map(Op::Connect),
        1 => c.clone().prop_map(Op::Cut),
        6 => (c.clone(), 1u8..16).prop_map(|(c, n)| Op::Step(c, n)),
        4 => (0..PLAYERS.len(), 0u8..3, 1u8..8).prop_map(|(p, cl, n)| Op::Push(p, cl, n)),
        3 => (c.clone(), 0u8..3, 1u8..5).prop_map(|(c, cl, n)| Op::Send(c, cl, n)),
        1 => (c.clone(), 0u8..3).prop_map(|(c, k)| Op::Forged(c, k)),
        1 => c.clone().prop_map(Op::Stall),
        1 => c.clone().prop_map(Op::Release),
        2 => prop_oneof![9 => 1u32..300, 1 => 1_000u32..70_000].prop_map(Op::Advance),
        1 => prop_oneof![2 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)].prop_map(Op::Store),
    ]
}

fn class(bits: u8) -> TrafficClass {
    TrafficClass::from_bits(bits % 3).unwrap_or(TrafficClass::Normal)
}

/// What the backend pushed to each session (accepted by the host), and what each client
/// sent, in order.
#[derive(Default)]
struct Ledger {
    pushed: HashMap<SessionId, Vec<Bytes>>,
    sent: HashMap<SessionId, Vec<Bytes>>,
    n: u32,
}

impl Ledger {
    fn body(&mut self, prefix: &str) -> Bytes {
        self.n += 1;
        Bytes::from(format!("{prefix}{}", self.n))
    }
}

/// Whether `got` is `want` with some elements left out, in order, none twice.
fn is_subsequence(got: &[Bytes], want: &[Bytes]) -> bool {
    let mut it = want.iter();
    got.iter().all(|g| it.any(|w| w == g))
}

/// One session as a client saw it: its id, the (seq, payload) of its sequenced messages, and
/// whether a restore reported a gap.
type SessionReceived = (SessionId, Vec<(u64, Bytes)>, bool);

/// The client's sequenced messages, per session it was welcomed into, and whether that
/// session's restores ever reported a gap.
fn received_by_session(p: &Pair, c: usize) -> Vec<SessionReceived> {
    let mut out: Vec<SessionReceived> = Vec::new();
    for e in &p.peers[c].events {
        match e {
            ClientEvent::Welcomed {
                session_id,
                outcome,
            } => {
                let gap = *outcome == WelcomeOutcome::RestoredWithGap;
                match out.last_mut() {
                    Some(last) if last.0 == *session_id => last.2 |= gap,
                    _ => out.push((*session_id, Vec::new(), gap)),
                }
            }
            ClientEvent::Message { seq, payload, .. } if *seq > 0 => {
                if let Some(last) = out.last_mut() {
                    last.1.push((*seq, payload.clone()));
                }
            }
            _ => {}
        }
    }
    out
}

/// The server connection whose driver `Op::Stall(c)` sticks: the holder of client `c`'s
/// session if one holds it (lingering after a cut too), else `c`'s connection.
fn stall_target(p: &Pair, c: usize) -> Option<usize> {
    p.peers[c]
        .client
        .session()
        .and_then(|(sid, _)| p.edge.host.holder_of(&sid))
        .map(|m| m as usize)
        .or(p.peers[c].conn)
}

fn check_invariants(p: &Pair, ledger: &Ledger) -> Result<(), TestCaseError> {
    let host = &p.edge.host;
    host.check_invariants().map_err(TestCaseError::fail)?;
    // At most one live (ACTIVE or DETACHED) session per player, and the host holds exactly
    // the live ones.
    let mut live: HashMap<String, Vec<SessionId>> = HashMap::new();
    let mut ending_here = 0;
    for (i, m) in p.edge.machines.iter().enumerate() {
        // A stuck driver's machine whose session was restored elsewhere or taken over
        // meanwhile is told to end; it does when its driver runs again.
        let superseded = m
            .session_id()
            .is_some_and(|id| host.holder_of(&id) != Some(i as u64) || host.is_ending(&id));
        if p.edge.stalled.contains(&i) && superseded {
            if m.session_id().and_then(|id| host.holder_of(&id)) == Some(i as u64) {
                ending_here += 1;
            }
            continue;
        }
        if matches!(m.state(), State::Active | State::Detached) {
            let (Some(pl), Some(id)) = (m.player_id(), m.session_id()) else {
                return Err(TestCaseError::fail("live machine without a session"));
            };
            live.entry(pl.to_string()).or_default().push(id);
        }
    }
    for (player, ids) in &live {
        prop_assert!(
            ids.len() <= 1,
            "player {} has {} live sessions",
            player,
            ids.len()
        );
    }
    let live_count: usize = live.values().map(Vec::len).sum();
    prop_assert_eq!(
        host.len(),
        live_count + ending_here,
        "host holds exactly the live sessions"
    );
    // Downstream: per session, seqs strictly increasing, payloads in push order, none twice;
    // without a reported gap, no seq skipped.
    for c in 0..CLIENTS {
        for (sid, msgs, gap) in received_by_session(p, c) {
            let seqs: Vec<u64> = msgs.iter().map(|m| m.0).collect();
            prop_assert!(seqs.windows(2).all(|w| w[0] < w[1]), "seqs {:?}", seqs);
            if !gap {
                prop_assert!(
                    seqs.windows(2).all(|w| w[1] == w[0] + 1),
                    "gap not reported: {:?}",
                    seqs
                );
            }
            let got: Vec<Bytes> = msgs.into_iter().map(|m| m.1).collect();
            let want = ledger
                .pushed
                .get(&sid)
                .map(Vec::as_slice)
                .unwrap_or_default();
            prop_assert!(is_subsequence(&got, want), "downstream order/duplicates");
        }
    }
    // Upstream: per session, what reached the backend is what the client sent, in order,
    // none twice.
    let mut up: HashMap<SessionId, Vec<Bytes>> = HashMap::new();
    for u in p.edge.delivered.iter().filter(|u| u.class.is_sequenced()) {
        up.entry(u.session_id).or_default().push(u.payload.clone());
    }
    for (sid, got) in &up {
        let want = ledger.sent.get(sid).map(Vec::as_slice).unwrap_or_default();
        prop_assert!(is_subsequence(got, want), "upstream order/duplicates");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn session_host_keeps_every_guarantee(
        ops in proptest::collection::vec(op(), 1..80),
        limited in any::<bool>(),
    ) {
        let cfg = SessionConfig {
            replay: ReplayLimits { max_messages: 64, max_bytes: 1 << 20 },
            ..SessionConfig::default()
        };
        let linger = cfg.linger;
        let mut p = Pair::with_outbound(cfg, 8);
        if limited {
            // Small inbound limits (B2), so bursts of sends are held back.
            p.inbound = Some(waygate_backpressure::InboundLimits {
                messages_per_sec: 50,
                message_burst: 4,
                bytes_per_sec: 1 << 20,
                byte_burst: 1 << 20,
            });
        }
        for c in 0..CLIENTS {
            p.add_client(token_for(player_of(c)));
        }
        let mut ledger = Ledger::default();
        for op in ops {
            match op {
                Op::Connect(c) => match p.peers[c].client.state() {
                    ClientState::Disconnected => {
                        if p.peers[c].conn.is_some() { p.cut(c); }
                        p.connect(c);
                    }
                    ClientState::Closed => {
                        p.relogin(c, token_for(player_of(c)));
                        p.connect(c);
                    }
                    _ => {}
                },
                Op::Cut(c) => if p.peers[c].conn.is_some() { p.cut(c) },
                Op::Step(c, n) => { p.step(c, n.into()); }
                Op::Push(pl, cl, n) => {
                    let Some(sid) = p.edge.host.session_of(PLAYERS[pl]) else { continue };
                    for _ in 0..n {
                        let class = class(cl);
                        let body = ledger.body("d");
                        let accepted = p.edge.push_any(&sid, p.now, class, &body);
                        if accepted && class.is_sequenced() {
                            ledger.pushed.entry(sid).or_default().push(body);
                        }
                    }
                }
                Op::Send(c, cl, n) => {
                    let Some((sid, _)) = p.peers[c].client.session() else { continue };
                    for _ in 0..n {
                        let class = class(cl);
                        let body = ledger.body("u");
                        let now = p.now;
                        if p.peers[c].client.send(now, class, 3, body.clone()).is_ok()
                            && class.is_sequenced()
                        {
                            ledger.sent.entry(sid).or_default().push(body);
                        }
                    }
                }
                Op::Forged(c, kind) => {
                    let Some((sid, token)) = p.peers[c].client.session() else { continue };
                    let (auth, resume_token, last) = match kind {
                        0 => (token_for(player_of(c)), token, 1_000_000),
                        1 => (token_for(player_of(c)), [7u8; 16], 0),
                        _ => (token_for("intruder"), token, 0),
                    };
                    let m = p.edge.new_machine(p.now);
                    let _ = p.edge.machines[m].handle_frame(p.now, Frame::Hello(Hello {
                        version: PROTOCOL_VERSION,
                        token: auth,
                        resume: Some(ResumeRequest::proving(sid, &resume_token, last, 1 << 40)),
                    }));
                    let mut out = std::collections::VecDeque::new();
                    p.edge.run(m, p.now, &mut out);
                }
                // The driver holding the client's session (a lingering one too, after a
                // cut), else the client's connection's.
                Op::Stall(c) => if let Some(m) = stall_target(&p, c) { p.edge.stalled.insert(m); },
                Op::Release(c) => if let Some(m) = stall_target(&p, c) { p.edge.release(m, p.now); },
                Op::Advance(ms) => p.advance(Duration::from_millis(ms.into())),
                Op::Store(state) => p.edge.store_down = state,
            }
            check_invariants(&p, &ledger)?;
        }
        // Settle: the store is back, every driver recovers, every client reconnects, everything
        // moves.
        p.edge.store_down = 0;
        for m in p.edge.stalled.clone() {
            p.edge.release(m, p.now);
        }
        for c in 0..CLIENTS {
            match p.peers[c].client.state() {
                ClientState::Active => {}
                ClientState::Closed => {
                    p.relogin(c, token_for(player_of(c)));
                    p.connect(c);
                }
                _ => {
                    // Whatever is in flight is lost with the link (an unanswered HELLO too).
                    p.cut(c);
                    if p.peers[c].client.state() == ClientState::Closed {
                        p.relogin(c, token_for(player_of(c)));
                    }
                    p.connect(c);
                }
            }
            p.drive_all();
        }
        p.advance(Duration::from_millis(200));
        check_invariants(&p, &ledger)?;
        // A session whose client never saw a gap got everything pushed to it.
        for c in 0..CLIENTS {
            let Some((current, _)) = p.peers[c].client.session() else { continue };
            if p.peers[c].client.state() != ClientState::Active {
                continue;
            }
            for (sid, msgs, gap) in received_by_session(&p, c) {
                if sid != current || gap {
                    continue;
                }
                let got: Vec<Bytes> = msgs.into_iter().map(|m| m.1).collect();
                let want = ledger.pushed.get(&sid).cloned().unwrap_or_default();
                prop_assert_eq!(got, want, "client {} missed pushes without a gap", c);
            }
        }
        // Every session gone after the linger: the host returns to empty.
        for c in 0..CLIENTS {
            if p.peers[c].conn.is_some() { p.cut(c); }
        }
        p.advance(linger + Duration::from_secs(120));
        check_invariants(&p, &ledger)?;
        prop_assert_eq!(p.edge.host.len(), 0, "host back to baseline");
        prop_assert!(p.edge.host.connections() <= p.edge.machines.len());
    }
}

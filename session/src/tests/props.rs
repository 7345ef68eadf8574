//! Property tests: exactly-once in-order delivery across random drops and reconnects, and
//! arbitrary event sequences into the machine.

use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use waygate_transport::TrafficClass;

use super::pair::{token_for, Pair};
use crate::client::ClientState;
use crate::machine::{SessionConfig, State};
use crate::replay::ReplayLimits;
use crate::sim::{self, SimOp};

#[derive(Debug, Clone)]
enum Op {
    /// The backend pushes n messages (class by bits).
    Push(u8, u8),
    /// The client sends n messages.
    Send(u8, u8),
    /// Move up to n frames along the link.
    Step(u8),
    /// The link dies now (everything in flight is lost).
    Cut,
    /// The link dies after the next n frames are lost in flight.
    DropThenCut(u8),
    /// Reconnect (if disconnected) with the resume token.
    Reconnect,
    /// Time passes (ms) — acks and heartbeats fire; never near the linger time.
    Advance(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 1u8..6).prop_map(|(c, n)| Op::Push(c, n)),
        3 => (0u8..3, 1u8..6).prop_map(|(c, n)| Op::Send(c, n)),
        4 => (1u8..12).prop_map(Op::Step),
        1 => Just(Op::Cut),
        1 => (1u8..6).prop_map(Op::DropThenCut),
        2 => Just(Op::Reconnect),
        1 => (1u16..200).prop_map(Op::Advance),
    ]
}

fn class(bits: u8) -> TrafficClass {
    TrafficClass::from_bits(bits % 3).unwrap_or(TrafficClass::Normal)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    /// Whatever the drop points, after a final reconnect every sequenced message has
    /// arrived exactly once, in order, in both directions, and no restore reported a gap.
    #[test]
    fn resume_after_any_drop_delivers_exactly_once_in_order(ops in proptest::collection::vec(op(), 1..60)) {
        let cfg = SessionConfig {
            replay: ReplayLimits { max_messages: 100_000, max_bytes: 1 << 30 },
            ..SessionConfig::default()
        };
        let mut p = Pair::new(cfg);
        let c = p.add_client(token_for("p"));
        p.connect(c);
        p.drive(c);
        let sid = p.session(c);
        let mut pushed: Vec<Bytes> = Vec::new();
        let mut sent: Vec<Bytes> = Vec::new();
        let mut n = 0u32;
        for op in ops {
            match op {
                Op::Push(cl, k) => for _ in 0..k {
                    n += 1;
                    let body = Bytes::from(format!("d{n}"));
                    let class = class(cl);
                    let seq = p.edge.push(&sid, p.now, class, &body);
                    prop_assert!(seq.is_some() || !class.is_sequenced());
                    if class.is_sequenced() { pushed.push(body); }
                },
                Op::Send(cl, k) => for _ in 0..k {
                    n += 1;
                    let body = Bytes::from(format!("u{n}"));
                    let class = class(cl);
                    let now = p.now;
                    p.peers[c].client.send(now, class, 3, body.clone()).expect("send");
                    if class.is_sequenced() { sent.push(body); }
                },
                Op::Step(k) => { p.step(c, k.into()); }
                Op::Cut => if p.peers[c].conn.is_some() { p.cut(c) },
                Op::DropThenCut(k) => if p.peers[c].conn.is_some() { p.drop_next(c, k.into()) },
                Op::Reconnect => if p.peers[c].client.state() == ClientState::Disconnected {
                    if p.peers[c].conn.is_some() { p.cut(c); }
                    p.connect(c);
                },
                Op::Advance(ms) => p.advance(Duration::from_millis(ms.into())),
            }
        }
        // Final: no more loss; make sure the link is up, then let everything settle.
        p.drive(c);
        p.peers[c].drop_next = 0;
        if p.peers[c].client.state() != ClientState::Active {
            if p.peers[c].conn.is_some() { p.cut(c); }
            p.connect(c);
            p.drive(c);
        }
        p.advance(Duration::from_millis(100));
        prop_assert_eq!(p.peers[c].client.state(), ClientState::Active);
        prop_assert_eq!(p.session(c), sid, "always the same session");
        let got: Vec<Bytes> = p.received(c).into_iter().map(|(_, b)| b).collect();
        prop_assert_eq!(&got, &pushed, "downstream exactly once, in order");
        let seqs: Vec<u64> = p.received(c).into_iter().map(|(s, _)| s).collect();
        prop_assert_eq!(seqs, (1..=pushed.len() as u64).collect::<Vec<_>>());
        let up: Vec<Bytes> = p.edge.delivered.iter()
            .filter(|u| u.class.is_sequenced())
            .map(|u| u.payload.clone()).collect();
        prop_assert_eq!(&up, &sent, "upstream exactly once, in order");
        prop_assert_eq!(p.edge.counters.restored_with_gap.load(std::sync::atomic::Ordering::Relaxed), 0);
        // Acks drained both buffers.
        prop_assert_eq!(p.server(c).core().map(|c| c.replay().len()), Some(0));
        prop_assert_eq!(p.peers[c].client.unacked_len(), 0);
    }

    /// Arbitrary frames and events never panic the machine, and it always ends ACTIVE,
    /// EXPIRED or CLOSED with a reason.
    #[test]
    fn arbitrary_event_sequences_end_well(
        hello in proptest::option::of((0u8..5, 0u8..4, 0u64..4)),
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        let mut ops = Vec::new();
        if let Some((token, resume, last_seq)) = hello {
            ops.push(SimOp::Hello { token, resume, last_seq, version: 0 });
        }
        ops.extend(SimOp::decode_all(&bytes));
        let out = sim::run(&ops);
        prop_assert!(out.state == State::Active || out.has_reason);
    }
}

#[test]
fn simulation_reaches_every_end() {
    let active = sim::run(&[SimOp::Hello {
        token: 1,
        resume: 0,
        last_seq: 0,
        version: 0,
    }]);
    // Idle timeout then linger: the valid session expires.
    assert_eq!(active.state, State::Expired);
    let restored = sim::run(&[
        SimOp::Hello {
            token: 0,
            resume: 1,
            last_seq: 1,
            version: 0,
        },
        SimOp::CloseSession(0),
    ]);
    assert_eq!(restored.state, State::Closed);
    let rejected = sim::run(&[SimOp::Hello {
        token: 3,
        resume: 0,
        last_seq: 0,
        version: 0,
    }]);
    assert_eq!(rejected.state, State::Closed);
}

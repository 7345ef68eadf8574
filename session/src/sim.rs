//! A deterministic simulation of one [`SessionMachine`] driven by arbitrary operations, with
//! synchronous stand-ins for the authenticator, the snapshot store and the ownership
//! registry. Shared by the property tests and the cargo-fuzz target (`session/fuzz`):
//! whatever the operations, the machine must never panic and must end ACTIVE, EXPIRED or
//! CLOSED with a reason. Not part of the stable API.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use waygate_protocol::frame::{Data, Hello, ResumeRequest, SessionId};
use waygate_protocol::wire::PROTOCOL_VERSION;
use waygate_transport::{CloseCode, Frame, TrafficClass};

use crate::auth::{mint_token, HmacAuthenticator, KeyRing, TokenClaims};
use crate::counters::SessionCounters;
use crate::machine::{Action, ResumeAttempt, SessionConfig, SessionMachine, State};
use crate::replay::{ReplayBuffer, ReplayLimits};
use crate::resume::ResumeHash;
use crate::rng::SeededRng;
use crate::seq::RecvWindow;
use crate::store::{ClaimGrant, Owner, Snapshot, TakeOutcome, SNAPSHOT_VERSION};

const KEY: &[u8] = b"simulation key, 32 bytes long...";
const UNIX: u64 = 1_800_000_000;
const LINGERING: SessionId = [7; 16];
const LINGERING_TOKEN: [u8; 16] = [9; 16];

/// One input to the simulated machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimOp {
    /// A HELLO. `token`: 0 none, 1 valid, 2 expired, 3 forged, 4 garbage; `resume`:
    /// 0 none, 1 the lingering session with its token, 2 with a wrong token, 3 an unknown
    /// session; `last_seq` is the claimed last server seq; `version` 0 means the current.
    Hello {
        /// Token choice.
        token: u8,
        /// Resume choice.
        resume: u8,
        /// Claimed last server seq.
        last_seq: u64,
        /// Protocol version (0 = current).
        version: u8,
    },
    /// A DATA frame from the client.
    Data {
        /// Class bits (mod 3).
        class: u8,
        /// Seq.
        seq: u64,
        /// Piggybacked ack.
        ack: Option<u64>,
        /// Payload length.
        len: u8,
    },
    /// An ACK frame.
    Ack(u64),
    /// A PING frame.
    Ping(u64),
    /// Any frame decoded from raw bytes (ignored if it does not decode).
    Raw(Vec<u8>),
    /// A CLOSE frame from the client.
    Close(u16),
    /// The transport dropped.
    LinkDown(u16),
    /// Time passes (milliseconds), firing due timers.
    Advance(u32),
    /// A downstream message from a backend.
    Push {
        /// Class bits (mod 3).
        class: u8,
        /// Payload length.
        len: u8,
    },
    /// A newer login kicks this session.
    Kick,
    /// A resuming connection asks for a hand-over (right or wrong token).
    HandOver(bool),
    /// A backend binding.
    Bind(u8),
    /// Soft migration.
    Migrate,
    /// The server ends the session.
    CloseSession(u16),
}

impl SimOp {
    /// Decodes a byte string into operations (the fuzz target's input format). Never fails:
    /// every byte string is some sequence of operations.
    pub fn decode_all(mut bytes: &[u8]) -> Vec<SimOp> {
        fn take<const N: usize>(b: &mut &[u8]) -> [u8; N] {
            let mut out = [0u8; N];
            let n = N.min(b.len());
            out[..n].copy_from_slice(&b[..n]);
            *b = &b[n..];
            out
        }
        let mut ops = Vec::new();
        while let Some((&tag, rest)) = bytes.split_first() {
            bytes = rest;
            let [a, b, c] = take::<3>(&mut bytes);
            let wide = u64::from(u16::from_le_bytes([b, c]));
            ops.push(match tag % 15 {
                0 => SimOp::Hello {
                    token: a % 5,
                    resume: b % 4,
                    last_seq: u64::from(c % 8),
                    version: a / 64,
                },
                1 => SimOp::Data {
                    class: a,
                    seq: u64::from(b % 40),
                    ack: (c & 1 == 1).then_some(u64::from(c >> 1)),
                    len: c,
                },
                2 => SimOp::Ack(u64::from(a % 40)),
                3 => SimOp::Ping(wide),
                4 => {
                    let n = usize::from(a % 16).min(bytes.len());
                    let (raw, rest) = bytes.split_at(n);
                    bytes = rest;
                    SimOp::Raw(raw.to_vec())
                }
                5 => SimOp::Close(u16::from_le_bytes([a, b])),
                6 => SimOp::LinkDown(u16::from_le_bytes([a, b])),
                7 => SimOp::Advance(u32::from(u16::from_le_bytes([a, b])) * 16),
                8 => SimOp::Push { class: a, len: b },
                9 => SimOp::Kick,
                10 => SimOp::HandOver(a & 1 == 1),
                11 => SimOp::Bind(a),
                12 => SimOp::Migrate,
                13 => SimOp::CloseSession(u16::from_le_bytes([a, b])),
                _ => SimOp::Data {
                    class: 1,
                    seq: u64::from(a % 8) + 1,
                    ack: None,
                    len: 4,
                },
            });
        }
        ops
    }
}

/// What a simulation ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimOutcome {
    /// The final state.
    pub state: State,
    /// Whether the final state carries an end reason.
    pub has_reason: bool,
}

fn class(bits: u8) -> TrafficClass {
    TrafficClass::from_bits(bits % 3).unwrap_or(TrafficClass::Normal)
}

fn token(choice: u8) -> Bytes {
    let claims = |player: &str, iat: u64, exp: u64| TokenClaims {
        player_id: player.into(),
        issuer: "sim".into(),
        issued_at: iat,
        expires_at: exp,
        extensions: vec![],
    };
    let mint = |key: &[u8], c: TokenClaims| mint_token(1, key, &c).unwrap_or_default();
    match choice {
        0 => Bytes::new(),
        1 => mint(KEY, claims("p", UNIX - 5, UNIX + 60)),
        2 => mint(KEY, claims("p", UNIX - 500, UNIX - 400)),
        3 => mint(b"wrong key", claims("p", UNIX - 5, UNIX + 60)),
        _ => Bytes::from_static(b"\x01garbage"),
    }
}

struct Env {
    auth: HmacAuthenticator,
    store: HashMap<SessionId, Snapshot>,
    fencing: u64,
}

impl Env {
    fn process(&mut self, m: &mut SessionMachine, now: Instant) {
        while let Some(action) = m.poll_action() {
            match action {
                Action::Authenticate { token } => {
                    let r = self.auth.verify(&token, UNIX);
                    let _ = m.handle_auth_result(now, r);
                }
                Action::CheckAllowed { .. } => {
                    let _ = m.handle_allowed(now, Ok(()));
                }
                Action::TakeSnapshot {
                    session_id,
                    attempt,
                } => {
                    let outcome = match self.store.get(&session_id) {
                        None => TakeOutcome::NotFound,
                        Some(s) if s.key_used(&attempt).is_some() => self
                            .store
                            .remove(&session_id)
                            .map_or(TakeOutcome::NotFound, |s| TakeOutcome::Taken(Box::new(s))),
                        Some(_) => TakeOutcome::Mismatch,
                    };
                    let _ = m.handle_snapshot(now, Ok(outcome));
                }
                Action::Claim { session_id, .. } => {
                    self.fencing += 1;
                    let grant = ClaimGrant {
                        fencing: self.fencing,
                        previous: Some(Owner {
                            session_id,
                            edge: "sim".into(),
                            fencing: self.fencing - 1,
                        }),
                    };
                    let _ = m.handle_claimed(now, Ok((grant, None)));
                }
                Action::PutBack(s) | Action::Persist(s) => {
                    self.store.insert(s.session_id, *s);
                }
                // A sink that answers at once.
                Action::Deliver(u) => {
                    let _ = m.answer_upstream(now, u.seq);
                }
                _ => {}
            }
        }
    }
}

/// Runs `ops` against a fresh machine (starting HANDSHAKING), then lets every timer fire.
pub fn run(ops: &[SimOp]) -> SimOutcome {
    let config = SessionConfig {
        linger: Duration::from_secs(60),
        replay: ReplayLimits {
            max_messages: 8,
            max_bytes: 512,
        },
        ..SessionConfig::default()
    };
    let mut ring = KeyRing::new();
    ring.insert(1, KEY);
    let auth = HmacAuthenticator::new(ring);
    let mut store: HashMap<SessionId, Snapshot> = HashMap::new();
    let mut replay = ReplayBuffer::new(config.replay);
    replay.push(TrafficClass::Normal, 1, Bytes::from_static(b"old"));
    store.insert(
        LINGERING,
        Snapshot {
            version: SNAPSHOT_VERSION,
            session_id: LINGERING,
            player_id: "p".into(),
            fencing: 1,
            resume_hash: ResumeHash::of(&LINGERING_TOKEN),
            prev_resume_hash: None,
            last_resume_nonce: 0,
            bindings: BTreeMap::new(),
            replay,
            upstream: RecvWindow::new(),
            awaiting: Default::default(),
            keys: BTreeMap::new(),
            channels: BTreeMap::new(),
            channels_acked: BTreeMap::new(),
            pending_errors: Vec::new(),
            push_ids: Vec::new(),
        },
    );
    let start = Instant::now();
    let mut now = start;
    let mut m = SessionMachine::new(
        config,
        Arc::new(SessionCounters::new()),
        Box::new(SeededRng::new(3)),
    );
    let _ = m.handle_link_up(now);

    let mut env = Env {
        auth,
        store,
        fencing: 1,
    };
    let mut nonce = 0u64;
    for op in ops {
        match op {
            SimOp::Hello {
                token: t,
                resume,
                last_seq,
                version,
            } => {
                let resume = match resume {
                    1 => Some((LINGERING, LINGERING_TOKEN)),
                    2 => Some((LINGERING, [1; 16])),
                    3 => Some(([2; 16], LINGERING_TOKEN)),
                    _ => None,
                }
                .map(|(session_id, resume_token)| {
                    // A fresh nonce per HELLO, as a client counts them.
                    nonce += 1;
                    ResumeRequest::proving(session_id, &resume_token, *last_seq, nonce)
                });
                let version = if *version == 0 {
                    PROTOCOL_VERSION
                } else {
                    *version
                };
                let _ = m.handle_frame(
                    now,
                    Frame::Hello(Hello {
                        version,
                        token: token(*t),
                        resume,
                    }),
                );
            }
            SimOp::Data {
                class: c,
                seq,
                ack,
                len,
            } => {
                let class = class(*c);
                let _ = m.handle_frame(
                    now,
                    Frame::Data(Data {
                        class,
                        msg_id: 1,
                        seq: if class.is_sequenced() { *seq } else { 0 },
                        ack: *ack,
                        payload: Bytes::from(vec![0u8; usize::from(*len)]),
                    }),
                );
            }
            SimOp::Ack(ack) => {
                let _ = m.handle_frame(now, Frame::Ack { ack: *ack });
            }
            SimOp::Ping(t) => {
                let _ = m.handle_frame(now, Frame::Ping { timestamp: *t });
            }
            SimOp::Raw(bytes) => {
                if let Ok(frame) = Frame::decode(Bytes::copy_from_slice(bytes)) {
                    let _ = m.handle_frame(now, frame);
                }
            }
            SimOp::Close(code) => {
                let _ = m.handle_frame(
                    now,
                    Frame::Close {
                        code: CloseCode::from_u16(*code),
                        message: String::new(),
                    },
                );
            }
            SimOp::LinkDown(code) => {
                let _ = m.handle_link_down(now, CloseCode::from_u16(*code));
            }
            SimOp::Advance(ms) => {
                let end = now + Duration::from_millis(u64::from(*ms));
                while let Some(t) = m.poll_timeout().filter(|t| *t <= end) {
                    now = now.max(t);
                    m.handle_timeout(now);
                    env.process(&mut m, now);
                }
                now = end;
            }
            SimOp::Push { class: c, len } => {
                let _ =
                    m.send_downstream(now, class(*c), 2, Bytes::from(vec![1u8; usize::from(*len)]));
            }
            SimOp::Kick => {
                let _ = m.kick(now);
            }
            SimOp::HandOver(right) => {
                // The right token is only known to the harness for the lingering session.
                let token = if *right { LINGERING_TOKEN } else { [5; 16] };
                nonce += 1;
                if let Ok(TakeOutcome::Taken(s)) =
                    m.hand_over(now, &ResumeAttempt::proving(&token, &LINGERING, nonce))
                {
                    env.store.insert(s.session_id, *s);
                }
            }
            SimOp::Bind(n) => {
                let _ = m.bind(&format!("svc{}", n % 4), &format!("inst{n}"));
            }
            SimOp::Migrate => {
                let _ = m.migrate("tcp://elsewhere:1", Duration::from_secs(5));
            }
            SimOp::CloseSession(code) => {
                let _ = m.close_session(now, CloseCode::from_u16(*code));
            }
        }
        env.process(&mut m, now);
        if m.state().is_terminal() {
            assert!(m.end_reason().is_some(), "terminal without a reason");
        }
    }
    // Let every timer fire: handshake deadline, idle, linger.
    for _ in 0..16 {
        let Some(t) = m.poll_timeout() else { break };
        now = now.max(t);
        m.handle_timeout(now);
        env.process(&mut m, now);
    }
    let state = m.state();
    assert!(
        matches!(state, State::Active | State::Closed | State::Expired),
        "ended in {state:?}"
    );
    SimOutcome {
        state,
        has_reason: m.end_reason().is_some(),
    }
}

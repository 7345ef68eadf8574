//! Deterministic tests of the session machine and its client counterpart on a virtual clock
//! (see [`pair`]).

mod host_props;
mod pair;
mod props;

use std::time::Duration;

use bytes::Bytes;
use waygate_protocol::frame::{Hello, ResumeRequest, SessionId, WelcomeOutcome};
use waygate_protocol::wire::PROTOCOL_VERSION;
use waygate_transport::{CloseCode, Frame, TrafficClass};

use crate::client::{ClientConfig, ClientError, ClientEvent, ClientState};
use crate::machine::{
    Action, EndReason, SessionConfig, SessionCore, SessionError, SessionMachine, State,
    MAX_PENDING_ERRORS,
};
use crate::replay::ReplayLimits;
use crate::seq::AckPolicy;
use crate::store::TakeOutcome;
use pair::{token_for, Pair};

fn welcomed(p: &Pair, c: usize) -> Vec<WelcomeOutcome> {
    p.peers[c]
        .events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Welcomed { outcome, .. } => Some(*outcome),
            _ => None,
        })
        .collect()
}

fn rejected(p: &Pair, c: usize) -> Vec<CloseCode> {
    p.peers[c]
        .events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Rejected { code, .. } => Some(*code),
            _ => None,
        })
        .collect()
}

/// Client `c`'s `Expired` events: (msg id, seq, age).
fn expired_of(p: &Pair, c: usize) -> Vec<(u32, u64, Duration)> {
    p.peers[c]
        .events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Expired { msg_id, seq, age } => Some((*msg_id, *seq, *age)),
            _ => None,
        })
        .collect()
}

/// One of the edge's session counters, now.
fn counted(
    p: &Pair,
    pick: impl Fn(&crate::counters::SessionCounters) -> &std::sync::atomic::AtomicU64,
) -> u64 {
    pick(&p.edge.counters).load(std::sync::atomic::Ordering::Relaxed)
}

fn login(p: &mut Pair, player: &str) -> usize {
    let c = p.add_client(token_for(player));
    p.connect(c);
    p.drive(c);
    c
}

fn send_up(p: &mut Pair, c: usize, n: usize, tag: &str) {
    for i in 0..n {
        let now = p.now;
        p.peers[c]
            .client
            .send(
                now,
                TrafficClass::Normal,
                1,
                Bytes::from(format!("{tag}{i}")),
            )
            .expect("send");
    }
}

#[test]
fn new_session_walks_every_handshake_state_and_counts() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    assert_eq!(welcomed(&p, c), vec![WelcomeOutcome::NewSession]);
    assert_eq!(p.server(c).state(), State::Active);
    assert_eq!(p.server(c).fencing(), 1);
    let k = &p.edge.counters;
    for (from, to) in [
        (State::Disconnected, State::Handshaking),
        (State::Handshaking, State::Authenticating),
        (State::Authenticating, State::Authenticated),
        (State::Authenticated, State::Active),
    ] {
        assert_eq!(k.transition_count(from, to), 1, "{from:?} -> {to:?}");
    }
    assert_eq!(k.new_sessions.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert!(k
        .export()
        .iter()
        .any(|(l, v)| l == "transition{from=\"authenticated\",to=\"active\"}" && *v == 1));
}

#[test]
fn messages_flow_both_ways_and_acks_free_the_replay_buffer() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    for i in 0..5u8 {
        p.edge.push(&sid, p.now, TrafficClass::Normal, &[i]);
    }
    send_up(&mut p, c, 3, "u");
    p.drive(c);
    assert_eq!(p.received(c).len(), 5);
    assert_eq!(p.edge.delivered.len(), 3);
    assert_eq!(
        p.edge.delivered.iter().map(|u| u.seq).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    // Acks are delayed (20 ms): after that both buffers are empty.
    p.advance(Duration::from_millis(25));
    assert_eq!(p.server(c).core().expect("core").replay().len(), 0);
    assert_eq!(p.peers[c].client.unacked_len(), 0);
}

#[test]
fn standalone_ack_after_n_messages_and_piggybacked_ack() {
    let cfg = SessionConfig {
        ack: AckPolicy {
            delay: Duration::from_secs(5),
            max_unacked: 4,
        },
        ..SessionConfig::default()
    };
    let mut p = Pair::new(cfg);
    let c = login(&mut p, "alice");
    send_up(&mut p, c, 4, "u");
    p.drive(c);
    assert_eq!(
        p.peers[c].client.unacked_len(),
        0,
        "4th message triggers an ACK"
    );
    send_up(&mut p, c, 2, "v");
    p.drive(c);
    assert_eq!(p.peers[c].client.unacked_len(), 2);
    let sid = p.session(c);
    p.edge.push(&sid, p.now, TrafficClass::Normal, b"x");
    p.drive(c);
    assert_eq!(p.peers[c].client.unacked_len(), 0, "ack rode on DATA");
}

#[test]
fn ping_pong_and_idle_timeout_detaches() {
    let cfg = SessionConfig {
        idle_timeout: Duration::from_secs(3),
        heartbeat_interval: Duration::ZERO, // client sends no pings
        ..SessionConfig::default()
    };
    let mut p = Pair::new(cfg);
    let c = login(&mut p, "alice");
    let m = p.peers[c].conn.expect("conn");
    p.edge.machines[m]
        .handle_frame(p.now, Frame::Ping { timestamp: 9 })
        .expect("ping");
    assert_eq!(
        p.edge.machines[m].poll_action(),
        Some(Action::Send(Frame::Pong { timestamp: 9 }))
    );
    p.advance(Duration::from_secs(4));
    assert_eq!(p.edge.machines[m].state(), State::Detached);
    assert!(p.edge.closes.contains(&(m, CloseCode::IdleTimeout)));
    assert_eq!(p.peers[c].client.state(), ClientState::Disconnected);
}

/// The client's liveness rule (PROTOCOL.md §7.5): something outstanding for 1 s with no
/// frame received means a dead link (an edge killed without a word, a UDP path gone): the
/// client goes Disconnected at once instead of waiting for an idle timeout. Any frame in
/// time keeps it up.
/// A WELCOME from the edge as a client's tests receive it: session `session` (its resume
/// token the next byte value), `outcome`, the default heartbeat, idle timeout and frame size.
fn welcome_frame(session: u8, outcome: WelcomeOutcome) -> Frame {
    Frame::Welcome(waygate_protocol::frame::Welcome {
        session_id: [session; 16],
        resume_token: [session.wrapping_add(1); 16],
        outcome,
        heartbeat_interval_ms: 10_000,
        idle_timeout_ms: 30_000,
        max_frame_size: 65_536,
        server_seq_base: 0,
        client_seq_ack: 0,
    })
}

/// A client of alice past its first WELCOME ([`welcome_frame`] 1, a new session) at `now`:
/// the client tests' starting point.
fn welcomed_client(now: std::time::Instant) -> crate::client::ClientSession {
    let mut client = crate::client::ClientSession::new(
        token_for("alice"),
        crate::client::ClientConfig::default(),
    );
    client.connect(now).expect("connect");
    client
        .handle_frame(now, welcome_frame(1, WelcomeOutcome::NewSession))
        .expect("welcome");
    client
}

/// Regression (2026-12-05, an audit of the SDKs against PROTOCOL.md §7.5): the heartbeat
/// counted every frame sent, so a client sending only best-effort DATA (a game streaming
/// inputs) never sent PING, had nothing outstanding, and a link that went dead was noticed
/// only by the idle timeout (30 s), not by the liveness rule (~1 s). Only frames the edge
/// answers (PING, sequenced DATA) count now.
#[test]
fn a_client_sending_only_best_effort_still_pings() {
    let t0 = std::time::Instant::now();
    let mut client = welcomed_client(t0);
    while client.poll_transmit().is_some() {}
    let mut pings = 0;
    for step in 1..=300u64 {
        // 30 s of best-effort DATA every 100 ms.
        let now = t0 + Duration::from_millis(100 * step);
        client
            .send(
                now,
                TrafficClass::BestEffort,
                7,
                Bytes::from_static(b"input"),
            )
            .expect("send");
        if client.poll_timeout().is_some_and(|t| t <= now) {
            client.handle_timeout(now);
        }
        while let Some(f) = client.poll_transmit() {
            if matches!(f, Frame::Ping { .. }) {
                pings += 1;
                // The edge answers.
                client
                    .handle_frame(now, Frame::Pong { timestamp: 0 })
                    .expect("pong");
            }
        }
    }
    // One per 10 s heartbeat interval, not one per message.
    assert!(
        (2..=4).contains(&pings),
        "{pings} PINGs in 30 s of best-effort DATA"
    );
}

/// Regression (2026-12-05, a review of the SDKs against PROTOCOL.md §7.5): the SDK stops
/// reading its link while its event backlog is full (the application does not take its
/// events), but the liveness rule went on judging the link, so a healthy one was called
/// dead a second after the next send. While reading is held (`not_reading`) the wait
/// starts again; once reading resumes, silence is judged as before.
#[test]
fn the_liveness_rule_waits_while_the_client_is_not_reading() {
    let t0 = std::time::Instant::now();
    let mut client = welcomed_client(t0);
    client
        .send(t0, TrafficClass::Normal, 7, Bytes::from_static(b"x"))
        .expect("send");
    let ms = Duration::from_millis;
    for held in [900, 1_800, 2_700] {
        client.not_reading(t0 + ms(held));
        client.handle_timeout(t0 + ms(held));
        assert_eq!(client.state(), ClientState::Active, "held at {held} ms");
    }
    // Reading again: one second after the last hold with nothing heard, dead.
    client.handle_timeout(t0 + ms(3_699));
    assert_eq!(client.state(), ClientState::Active);
    client.handle_timeout(t0 + ms(3_700));
    assert_eq!(client.state(), ClientState::Disconnected);
}

#[test]
fn a_client_declares_a_silent_link_dead_after_its_liveness_timeout() {
    let t0 = std::time::Instant::now();
    let mut client = welcomed_client(t0);
    while client.poll_transmit().is_some() {}
    let sent = t0 + Duration::from_millis(100);
    client
        .send(sent, TrafficClass::Normal, 7, Bytes::from_static(b"x"))
        .expect("send");
    assert_eq!(client.poll_timeout(), Some(sent + Duration::from_secs(1)));
    // An ACK in time: alive, nothing outstanding any more.
    client
        .handle_frame(sent + Duration::from_millis(30), Frame::Ack { ack: 1 })
        .expect("ack");
    client.handle_timeout(sent + Duration::from_secs(1));
    assert_eq!(client.state(), ClientState::Active);
    // Another message, then silence: dead at exactly one second.
    let later = t0 + Duration::from_secs(2);
    client
        .send(later, TrafficClass::Normal, 7, Bytes::from_static(b"y"))
        .expect("send");
    client.handle_timeout(later + Duration::from_millis(999));
    assert_eq!(client.state(), ClientState::Active);
    client.handle_timeout(later + Duration::from_secs(1));
    assert_eq!(client.state(), ClientState::Disconnected);
    let events: Vec<ClientEvent> = std::iter::from_fn(|| client.poll_event()).collect();
    assert!(events.contains(&ClientEvent::Disconnected {
        code: CloseCode::IdleTimeout
    }));
    assert_eq!(client.unacked_len(), 1, "kept for the resume");
}

/// A reconnect storm must not feed itself (5,000-client demo: an overloaded machine
/// answered later than 1 s, every client called its link dead and reconnected, and the
/// reconnects' handshakes overloaded it further: 18,042 restores in 60 s). Each link the
/// liveness rule calls dead doubles the timeout for the next ones, up to 8x; every 30 s of a
/// link on which it did not fire halves it again. The first silence is still found in 1 s.
#[test]
fn the_liveness_timeout_backs_off_after_links_it_called_dead_and_calms_down() {
    use crate::client::LIVENESS_CALM;
    let welcome = |outcome| welcome_frame(1, outcome);
    let mut now = std::time::Instant::now();
    let mut client = welcomed_client(now);
    client
        .send(now, TrafficClass::Normal, 7, Bytes::from_static(b"x"))
        .expect("send");
    // Called dead at 1 s, then 2, 4, 8 and 8 s on the links after it.
    for want_secs in [1u64, 2, 4, 8, 8] {
        while client.poll_transmit().is_some() {}
        assert_eq!(
            client.poll_timeout(),
            Some(now + Duration::from_secs(want_secs))
        );
        now += Duration::from_secs(want_secs);
        client.handle_timeout(now);
        assert_eq!(client.state(), ClientState::Disconnected);
        client.connect(now).expect("reconnect");
        client
            .handle_frame(now, welcome(WelcomeOutcome::Restored))
            .expect("welcome");
    }
    assert_eq!(client.liveness_timeout(), Duration::from_secs(8));
    // A link that answers: the timeout halves after each calm period, back to 1 s.
    client
        .handle_frame(now, Frame::Ack { ack: 1 })
        .expect("ack");
    for want_secs in [4u64, 2, 1, 1] {
        now += LIVENESS_CALM;
        client
            .handle_frame(now, Frame::Pong { timestamp: 0 })
            .expect("pong");
        assert_eq!(client.liveness_timeout(), Duration::from_secs(want_secs));
    }
    assert_eq!(client.state(), ClientState::Active);
}

#[test]
fn heartbeats_keep_an_idle_session_alive() {
    let cfg = SessionConfig {
        idle_timeout: Duration::from_secs(3),
        heartbeat_interval: Duration::from_secs(1),
        ..SessionConfig::default()
    };
    let mut p = Pair::new(cfg);
    let c = login(&mut p, "alice");
    p.advance(Duration::from_secs(60));
    assert_eq!(p.server(c).state(), State::Active);
}

#[test]
fn handshake_timeout_closes() {
    let mut p = Pair::new(SessionConfig::default());
    let m = p.edge.new_machine(p.now);
    assert_eq!(p.edge.machines[m].state(), State::Handshaking);
    p.advance(Duration::from_secs(11));
    assert_eq!(p.edge.machines[m].state(), State::Closed);
    assert_eq!(
        p.edge.machines[m].end_reason(),
        Some(&EndReason::HandshakeFailed(CloseCode::HandshakeTimeout))
    );
}

#[test]
fn resume_after_cut_replays_missed_and_dedups_resent() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    let first_token = p.peers[c].client.session().expect("s").1;
    for i in 0..3u8 {
        p.edge.push(&sid, p.now, TrafficClass::Critical, &[i]);
    }
    send_up(&mut p, c, 3, "a");
    p.drive(c);
    // 2 more each way are in flight when the link dies.
    for i in 3..5u8 {
        p.edge.push(&sid, p.now, TrafficClass::Normal, &[i]);
    }
    send_up(&mut p, c, 2, "b");
    p.drop_next(c, 3);
    p.drive(c);
    assert_eq!(p.peers[c].conn, None);
    assert_eq!(p.edge.machines[0].state(), State::Detached);
    // Pushed while detached: buffered for replay.
    p.edge.push(&sid, p.now, TrafficClass::Normal, &[5]);
    p.edge.push(&sid, p.now, TrafficClass::BestEffort, &[99]);
    p.advance(Duration::from_secs(60));
    p.connect(c);
    p.drive(c);
    assert_eq!(
        welcomed(&p, c),
        vec![WelcomeOutcome::NewSession, WelcomeOutcome::Restored]
    );
    assert_eq!(p.session(c), sid);
    assert_ne!(
        p.peers[c].client.session().expect("s").1,
        first_token,
        "rotated"
    );
    let got: Vec<u8> = p.received(c).iter().map(|(_, b)| b[0]).collect();
    assert_eq!(
        got,
        vec![0, 1, 2, 3, 4, 5],
        "exactly once, in order, no best-effort"
    );
    let up: Vec<Bytes> = p.edge.delivered.iter().map(|u| u.payload.clone()).collect();
    assert_eq!(
        up,
        ["a0", "a1", "a2", "b0", "b1"]
            .iter()
            .map(|s| Bytes::from(*s))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        p.edge.machines[0].end_reason(),
        Some(&EndReason::Superseded)
    );
    let k = &p.edge.counters;
    assert_eq!(
        k.transition_count(State::Handshaking, State::Authenticating),
        2
    );
    assert_eq!(
        k.transition_count(State::Authenticated, State::Restoring),
        1
    );
    assert_eq!(k.transition_count(State::Restoring, State::Active), 1);
    assert_eq!(k.transition_count(State::Active, State::Detached), 1);
    assert_eq!(k.transition_count(State::Detached, State::Closed), 1);
}

/// The staleness bound for messages queued offline: on the resume, the never-sent messages
/// older than the bound are dropped with an `Expired` event each, the fresh one queued after
/// them takes the first free seq, and the server sees contiguous seqs; without a bound every
/// queued message goes out.
#[test]
fn messages_queued_offline_past_their_bound_expire_and_the_rest_are_renumbered() {
    for bound in [Some(Duration::from_secs(5)), None] {
        let mut p = Pair::new(SessionConfig::default());
        let config = ClientConfig {
            max_offline_age: bound,
            ..ClientConfig::default()
        };
        let c = p.add_client_with(token_for("alice"), config);
        p.connect(c);
        p.drive(c);
        send_up(&mut p, c, 2, "a");
        p.drive(c);
        p.cut(c);
        p.advance(Duration::from_secs(1));
        send_up(&mut p, c, 2, "old");
        p.advance(Duration::from_secs(10));
        send_up(&mut p, c, 1, "new");
        p.advance(Duration::from_secs(1));
        p.connect(c);
        p.drive(c);
        send_up(&mut p, c, 1, "after");
        p.drive(c);
        let expired: Vec<(u64, Duration)> = expired_of(&p, c)
            .into_iter()
            .map(|(_, seq, age)| (seq, age))
            .collect();
        let up: Vec<(u64, Bytes)> = p
            .edge
            .delivered
            .iter()
            .map(|u| (u.seq, u.payload.clone()))
            .collect();
        let want: Vec<(u64, &str)> = if bound.is_some() {
            assert_eq!(
                expired,
                vec![(3, Duration::from_secs(11)), (4, Duration::from_secs(11))]
            );
            vec![(1, "a0"), (2, "a1"), (3, "new0"), (4, "after0")]
        } else {
            assert!(expired.is_empty(), "{expired:?}");
            vec![
                (1, "a0"),
                (2, "a1"),
                (3, "old0"),
                (4, "old1"),
                (5, "new0"),
                (6, "after0"),
            ]
        };
        let want: Vec<(u64, Bytes)> = want.into_iter().map(|(s, b)| (s, Bytes::from(b))).collect();
        assert_eq!(up, want, "bound {bound:?}");
        assert_eq!(
            welcomed(&p, c),
            vec![WelcomeOutcome::NewSession, WelcomeOutcome::Restored]
        );
    }
}

fn errors_of(p: &Pair, c: usize) -> Vec<u64> {
    p.peers[c]
        .events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Error(r) => Some(r.client_seq),
            _ => None,
        })
        .collect()
}

/// Regression (found by `waygate demo` under CPU contention: a reply lost in the reconnect
/// wave): an ERROR sent while the link dies reached nobody, and the message it answered was
/// already acknowledged, so nothing ever answered it. Now the session keeps every ERROR the
/// client may not have and sends it again after the resume; the client reports it once; one
/// known to have arrived (a critical DATA sent after it was acknowledged) is not sent again.
#[test]
fn an_error_in_flight_when_the_link_dies_arrives_after_the_resume_exactly_once() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    send_up(&mut p, c, 3, "m");
    p.drive(c);
    // Message 1 refused, and the ERROR is lost with the link.
    p.edge.refuse(&sid, p.now, 1);
    p.drop_next(c, 1);
    p.drive(c);
    assert_eq!(p.peers[c].conn, None, "the link died");
    assert!(errors_of(&p, c).is_empty(), "the ERROR was lost in flight");
    // Message 2 refused while away.
    p.edge.refuse(&sid, p.now, 2);
    p.connect(c);
    p.drive(c);
    assert_eq!(
        errors_of(&p, c),
        vec![1, 2],
        "both answers after the resume"
    );
    // No critical DATA since: the edge cannot know they arrived, so the next resume sends
    // them again, and the client drops the repeats.
    p.cut(c);
    p.connect(c);
    p.drive(c);
    assert_eq!(
        errors_of(&p, c),
        vec![1, 2],
        "repeats dropped by the client"
    );
    // Message 3 refused, then a critical DATA acknowledged: all three known to have
    // arrived; the next resume sends no ERROR at all.
    p.edge.refuse(&sid, p.now, 3);
    p.edge.push(&sid, p.now, TrafficClass::Critical, b"fence");
    p.drive(c);
    p.advance(Duration::from_secs(1));
    p.drive(c);
    assert_eq!(errors_of(&p, c), vec![1, 2, 3]);
    let kept = p.server(c).core().map(SessionCore::errors_kept);
    assert_eq!(kept, Some(0), "forgotten once known to have arrived");
    p.cut(c);
    p.connect(c);
    p.drive(c);
    assert_eq!(errors_of(&p, c), vec![1, 2, 3]);
    assert_eq!(
        welcomed(&p, c),
        vec![
            WelcomeOutcome::NewSession,
            WelcomeOutcome::Restored,
            WelcomeOutcome::Restored,
            WelcomeOutcome::Restored
        ]
    );
}

/// Regression (found by an audit of PROTOCOL.md, 2026-12-04): ERRORs for best-effort
/// messages all carry client_seq 0, and the client reported one ERROR per client_seq, so
/// every best-effort refusal after the first in a session was swallowed; the edge also
/// kept them for resending after a resume, which with the dedup fixed would report one
/// twice. A best-effort message may be lost, and so may its ERROR: it is sent once (not
/// kept while the client is away), and the client reports each one it receives.
#[test]
fn every_best_effort_refusal_is_reported_once() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    p.edge.refuse(&sid, p.now, 0);
    p.edge.refuse(&sid, p.now, 0);
    p.drive(c);
    assert_eq!(errors_of(&p, c), vec![0, 0], "both refusals reported");
    let kept = p.server(c).core().map(SessionCore::errors_kept);
    assert_eq!(kept, Some(0), "not kept for a resume");
    // Refused while away: nobody to tell.
    p.cut(c);
    p.edge.refuse(&sid, p.now, 0);
    p.connect(c);
    p.drive(c);
    assert_eq!(
        errors_of(&p, c),
        vec![0, 0],
        "none sent again after the resume"
    );
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
}

#[test]
fn resume_only_hello_restores_without_auth_token() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    p.cut(c);
    p.peers[c].client.set_token(Bytes::new());
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    assert_eq!(
        p.edge
            .counters
            .transition_count(State::Handshaking, State::Restoring),
        1
    );
}

/// Overload level 2 (B5): an edge taking no new session refuses a fresh login `overloaded`
/// with the retry-after, before any auth work, while a resume of an existing session is
/// taken, so the players already on the edge get back first.
#[test]
fn an_edge_refusing_new_sessions_still_takes_resumes() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    p.cut(c);
    p.edge.refuse_new_sessions = Some(Duration::from_secs(5));
    let (_, frames) = raw_hello(&mut p, token_for("bob"), None);
    match frames.iter().find(|f| matches!(f, Frame::Reject(_))) {
        Some(Frame::Reject(r)) => {
            assert_eq!(r.code, CloseCode::Overloaded);
            assert_eq!(r.retry_after_ms, 5_000);
        }
        other => panic!("expected REJECT overloaded, got {other:?} in {frames:?}"),
    }
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    assert_eq!(p.session(c), sid);
    // Taking new sessions again: a login goes through.
    p.edge.refuse_new_sessions = None;
    let (_, frames) = raw_hello(&mut p, token_for("bob"), None);
    assert_eq!(welcome_outcome(&frames), Some(WelcomeOutcome::NewSession));
}

/// Sends a raw HELLO on a fresh machine; returns the machine index and its frames.
fn raw_hello(p: &mut Pair, token: Bytes, resume: Option<ResumeRequest>) -> (usize, Vec<Frame>) {
    let m = p.edge.new_machine(p.now);
    let _ = p.edge.machines[m].handle_frame(
        p.now,
        Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token,
            resume,
        }),
    );
    let mut out = std::collections::VecDeque::new();
    p.edge.run(m, p.now, &mut out);
    (m, out.into_iter().collect())
}

fn reject_code(frames: &[Frame]) -> Option<CloseCode> {
    frames.iter().find_map(|f| match f {
        Frame::Reject(r) => Some(r.code),
        _ => None,
    })
}

/// A nonce above any a test client uses (they count from 1): what a forged or replayed
/// HELLO built by a test carries, so only the proof decides.
const FORGED_NONCE: u64 = 1 << 40;

fn welcome_outcome(frames: &[Frame]) -> Option<WelcomeOutcome> {
    frames.iter().find_map(|f| match f {
        Frame::Welcome(w) => Some(w.outcome),
        _ => None,
    })
}

/// Regression (2026-12-05, a review of the SDKs against PROTOCOL.md §7.4.4): the client
/// took a new session for its first one whenever it held no session and had received no
/// server DATA, so after a REJECT 300 (which forgets the session) a session that had only
/// sent messages was not replaced: the next new session resent the old messages with their
/// old seqs. A new session after any earlier one now starts both directions at seq 1 and
/// drops what was buffered for the old one.
#[test]
fn a_new_session_after_a_rejected_resume_drops_the_old_sessions_messages() {
    use waygate_protocol::frame::Reject;
    let t0 = std::time::Instant::now();
    let welcome = |id: u8| welcome_frame(id, WelcomeOutcome::NewSession);
    let sent_data = |c: &mut crate::client::ClientSession| -> Vec<u64> {
        std::iter::from_fn(|| c.poll_transmit())
            .filter_map(|f| match f {
                Frame::Data(d) => Some(d.seq),
                _ => None,
            })
            .collect()
    };
    let mut c = crate::client::ClientSession::new(token_for("alice"), ClientConfig::default());
    c.connect(t0).expect("connect");
    c.handle_frame(t0, welcome(1)).expect("welcome");
    for _ in 0..2 {
        c.send(t0, TrafficClass::Normal, 1000, Bytes::from_static(b"old"))
            .expect("send");
    }
    assert_eq!(sent_data(&mut c), [1, 2]);
    c.handle_link_down(t0, CloseCode::GoingAway);
    c.connect(t0).expect("reconnect");
    c.handle_frame(
        t0,
        Frame::Reject(Reject {
            code: CloseCode::ResumeRejected,
            retry_after_ms: 0,
            message: String::new(),
        }),
    )
    .expect("reject");
    c.connect(t0).expect("login again");
    let _ = sent_data(&mut c);
    c.handle_frame(t0, welcome(2)).expect("welcome");
    assert_eq!(
        sent_data(&mut c),
        Vec::<u64>::new(),
        "the old messages are void"
    );
    assert_eq!(c.unacked_len(), 0);
    c.send(t0, TrafficClass::Normal, 1000, Bytes::from_static(b"new"))
        .expect("send");
    assert_eq!(sent_data(&mut c), [1], "seqs restart at 1");
}

#[test]
fn replayed_resume_token_is_rejected_and_the_session_untouched() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let (sid, old_token) = p.peers[c].client.session().expect("s");
    p.cut(c);
    p.connect(c);
    p.drive(c); // restored: token rotated
    p.cut(c);
    let resume = ResumeRequest::proving(sid, &old_token, 0, FORGED_NONCE);
    // Resume-only with the spent token: REJECT ResumeRejected.
    let (m, frames) = raw_hello(&mut p, Bytes::new(), Some(resume.clone()));
    assert_eq!(reject_code(&frames), Some(CloseCode::ResumeRejected));
    assert_eq!(p.edge.machines[m].state(), State::Closed);
    assert_eq!(
        p.edge.machines[m].end_reason(),
        Some(&EndReason::Rejected(CloseCode::ResumeRejected))
    );
    // The real session is still resumable.
    assert!(p.edge.store.contains_key(&sid));
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    p.cut(c);
    // With a valid auth token too: still refused, and the session it names is left as it
    // was (a captured HELLO must not end it through the fallback to a new login).
    let (_, frames) = raw_hello(&mut p, token_for("alice"), Some(resume));
    assert_eq!(reject_code(&frames), Some(CloseCode::ResumeRejected));
    assert!(p.edge.store.contains_key(&sid), "still resumable");
    // A session that no longer exists with a valid auth token: a fresh session (outcome 3).
    let gone = ResumeRequest::proving([0xEE; 16], &old_token, 0, FORGED_NONCE);
    let (_, frames) = raw_hello(&mut p, token_for("alice"), Some(gone));
    assert_eq!(
        welcome_outcome(&frames),
        Some(WelcomeOutcome::RestoreFailedNewSession)
    );
    assert_eq!(counted(&p, |c| &c.restore_failed_new_session), 1);
}

#[test]
fn token_of_another_session_is_rejected() {
    let mut p = Pair::new(SessionConfig::default());
    let a = login(&mut p, "alice");
    let b = login(&mut p, "bob");
    let (sid_a, _) = p.peers[a].client.session().expect("a");
    let (_, tok_b) = p.peers[b].client.session().expect("b");
    p.cut(a);
    let resume = ResumeRequest::proving(sid_a, &tok_b, 0, FORGED_NONCE);
    let (_, frames) = raw_hello(&mut p, Bytes::new(), Some(resume));
    assert_eq!(reject_code(&frames), Some(CloseCode::ResumeRejected));
    // Bob's live session and Alice's lingering one are untouched.
    assert_eq!(p.server(b).state(), State::Active);
    p.connect(a);
    p.drive(a);
    assert_eq!(welcomed(&p, a).last(), Some(&WelcomeOutcome::Restored));
    // Bob's token presented for Bob's session id but with Alice's auth token: foreign
    // player; refused, Bob is untouched.
    let (sid_b, tok_b) = p.peers[b].client.session().expect("b");
    p.cut(b);
    let (_, frames) = raw_hello(
        &mut p,
        token_for("alice"),
        Some(ResumeRequest::proving(sid_b, &tok_b, 0, FORGED_NONCE)),
    );
    assert_eq!(reject_code(&frames), Some(CloseCode::ResumeRejected));
    p.connect(b);
    p.drive(b);
    assert_eq!(welcomed(&p, b).last(), Some(&WelcomeOutcome::Restored));
}

#[test]
fn last_server_seq_beyond_sent_is_rejected_and_snapshot_kept() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let (sid, tok) = p.peers[c].client.session().expect("s");
    p.cut(c);
    let (_, frames) = raw_hello(
        &mut p,
        Bytes::new(),
        Some(ResumeRequest::proving(sid, &tok, 5, FORGED_NONCE)),
    );
    assert_eq!(reject_code(&frames), Some(CloseCode::ResumeRejected));
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
}

/// A resume of a *live* session that would fail (here: a last received seq beyond what was
/// sent) is refused by the holder before it lets go: REJECT 300, with or without a valid
/// auth token, and the live session keeps its connection — never a silent supersede
/// (regression: the old entry leaked for good, one per such HELLO), never a kick.
#[test]
fn a_failing_resume_of_a_live_session_leaves_it_untouched() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    let live = p.peers[c].conn.expect("conn");
    let (_, tok) = p.peers[c].client.session().expect("s");
    let beyond = ResumeRequest::proving(sid, &tok, 5, FORGED_NONCE);
    let (_, frames) = raw_hello(&mut p, Bytes::new(), Some(beyond.clone()));
    assert_eq!(reject_code(&frames), Some(CloseCode::ResumeRejected));
    assert_eq!(p.edge.machines[live].state(), State::Active, "untouched");
    p.edge
        .push(&sid, p.now, TrafficClass::Normal, b"still here");
    p.drive(c);
    assert_eq!(p.received(c).len(), 1, "its connection still delivers");

    let (m, frames) = raw_hello(&mut p, token_for("alice"), Some(beyond));
    assert_eq!(reject_code(&frames), Some(CloseCode::ResumeRejected));
    assert_eq!(p.edge.machines[m].state(), State::Closed);
    assert_eq!(p.edge.machines[live].state(), State::Active, "untouched");
}

/// Hardening item 15: the resume token is never sent; a captured resume HELLO (its proof
/// and nonce) replayed from another connection is refused and the session stays with its
/// client — even right after the restore, while the presented key is still accepted
/// (before the client confirmed the rotation), which a bearer token allowed.
#[test]
fn a_captured_resume_hello_replayed_is_refused() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let (sid, tok) = p.peers[c].client.session().expect("s");
    p.cut(c);
    // The client's resume, as captured on the path; it restores.
    let captured = ResumeRequest::proving(sid, &tok, 0, 1);
    let (first, frames) = raw_hello(&mut p, Bytes::new(), Some(captured.clone()));
    assert_eq!(welcome_outcome(&frames), Some(WelcomeOutcome::Restored));
    // Replayed at once (the new token unconfirmed, so the old key is still accepted):
    // refused, with or without an auth token, and the restored connection keeps it.
    for auth in [Bytes::new(), token_for("alice")] {
        let (m, frames) = raw_hello(&mut p, auth, Some(captured.clone()));
        assert_eq!(reject_code(&frames), Some(CloseCode::ResumeRejected));
        assert_eq!(p.edge.machines[m].state(), State::Closed);
        assert_eq!(p.edge.machines[first].state(), State::Active, "kept");
    }
    // The same key with a fresh nonce (a client whose WELCOME was lost) still restores.
    let retry = ResumeRequest::proving(sid, &tok, 0, 2);
    let (_, frames) = raw_hello(&mut p, Bytes::new(), Some(retry));
    assert_eq!(welcome_outcome(&frames), Some(WelcomeOutcome::Restored));
}

/// Queues a channel event of `channel` (epoch 5, `offset`) to machine `m`, as the edge's
/// channels do (a DATA of `CHANNEL_EVENT_MSG_ID`).
fn show_channel_event(
    p: &mut Pair,
    m: usize,
    kind: waygate_protocol::channel::ChannelEventKind,
    channel: &str,
    offset: u64,
) {
    use waygate_protocol::channel::{ChannelEvent, ChannelPosition, CHANNEL_EVENT_MSG_ID};
    let event = ChannelEvent {
        kind,
        channel: channel.into(),
        position: ChannelPosition { epoch: 5, offset },
        body: Bytes::new(),
    };
    let now = p.now;
    p.edge.machines[m]
        .send_downstream(
            now,
            TrafficClass::Normal,
            CHANNEL_EVENT_MSG_ID,
            event.to_bytes(),
        )
        .expect("queued");
}

/// A new machine restoring client `c`'s session from `snap` (a resume-only HELLO proving
/// the client's resume token; the store answers with `snap`): where a restore on another
/// connection or edge starts.
fn restoring_from(p: &Pair, c: usize, snap: crate::store::Snapshot) -> SessionMachine {
    let (sid, tok) = p.peers[c].client.session().expect("s");
    let mut fresh = SessionMachine::new(
        SessionConfig::default(),
        std::sync::Arc::new(crate::SessionCounters::new()),
        Box::new(crate::SeededRng::new(7)),
    );
    fresh.handle_link_up(p.now).expect("up");
    fresh
        .handle_frame(
            p.now,
            Frame::Hello(Hello {
                version: PROTOCOL_VERSION,
                token: Bytes::new(),
                resume: Some(ResumeRequest::proving(sid, &tok, 0, FORGED_NONCE)),
            }),
        )
        .expect("hello");
    let Some(Action::TakeSnapshot { .. }) = fresh.poll_action() else {
        panic!("expected TakeSnapshot");
    };
    fresh
        .handle_snapshot(p.now, Ok(TakeOutcome::Taken(Box::new(snap))))
        .expect("snapshot");
    fresh
}

/// Routing keys a backend bound (BIND) are part of the session: in its snapshot, and
/// announced (`RoutingKeys`) when a restore re-establishes it, wherever that happens.
#[test]
fn routing_keys_and_channel_memberships_travel_with_the_session() {
    use waygate_protocol::channel::{ChannelEventKind, ChannelPosition};
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let m = p.peers[c].conn.expect("conn");
    p.edge.machines[m]
        .bind_key("room", "harbour")
        .expect("bind key");
    // Channel events queued to the client move each channel's position; LEFT ends one.
    for (kind, channel, offset) in [
        (ChannelEventKind::Joined, "guild:1", 0),
        (ChannelEventKind::Publication, "guild:1", 1),
        (ChannelEventKind::Joined, "room:x", 3),
        (ChannelEventKind::Publication, "guild:1", 0), // best-effort: no position
        (ChannelEventKind::Left, "room:x", 3),
    ] {
        show_channel_event(&mut p, m, kind, channel, offset);
    }
    // So do the ids of the pushes queued on it (PLAYER_PUSH; 0 is no id), each once.
    for id in [0, 9, 9, 10] {
        p.edge.machines[m].remember_push(id).expect("remembered");
    }
    let snap = p.server(c).checkpoint().expect("snapshot");
    assert_eq!(snap.keys.get("room").map(String::as_str), Some("harbour"));
    assert_eq!(snap.push_ids, [9, 10]);
    let expected_channels: std::collections::BTreeMap<_, _> = [(
        "guild:1".to_owned(),
        ChannelPosition {
            epoch: 5,
            offset: 1,
        },
    )]
    .into();
    assert_eq!(snap.channels, expected_channels);
    // A new machine restoring from that snapshot announces the keys before WELCOME.
    let mut fresh = restoring_from(&p, c, snap);
    // A resume without an auth token: the player is checked first (bans), then claimed.
    let Some(Action::CheckAllowed { player_id }) = fresh.poll_action() else {
        panic!("expected CheckAllowed");
    };
    assert_eq!(&*player_id, "alice");
    fresh.handle_allowed(p.now, Ok(())).expect("allowed");
    let Some(Action::Claim { .. }) = fresh.poll_action() else {
        panic!("expected Claim");
    };
    fresh
        .handle_claimed(
            p.now,
            Ok((
                crate::store::ClaimGrant {
                    fencing: 2,
                    previous: None,
                },
                None,
            )),
        )
        .expect("claimed");
    let actions: Vec<Action> = std::iter::from_fn(|| fresh.poll_action()).collect();
    let keys = actions.iter().find_map(|a| match a {
        Action::RoutingKeys(k) => Some(k.clone()),
        _ => None,
    });
    assert_eq!(
        keys.and_then(|k| k.get("room").cloned()).as_deref(),
        Some("harbour")
    );
    let channels = actions.iter().find_map(|a| match a {
        Action::Channels(c) => Some(c.clone()),
        _ => None,
    });
    assert_eq!(channels, Some(expected_channels));
    assert_eq!(fresh.push_ids(), [9, 10]);
    // The last MAX_PUSH_IDS are kept, oldest first.
    for id in 100..100 + crate::store::MAX_PUSH_IDS as u64 {
        fresh.remember_push(id).expect("remembered");
    }
    assert_eq!(fresh.push_ids().len(), crate::store::MAX_PUSH_IDS);
    assert_eq!(fresh.push_ids()[0], 100);
}

/// Regression (2026-12-05, an audit of what stores hand back): a restored session kept every
/// pending ERROR its snapshot held, so a corrupt or foreign record with thousands had them
/// all re-sent after WELCOME and kept over the cap for good. A restore keeps the last
/// `MAX_PENDING_ERRORS`, as it keeps the last push ids, and declares the dropped ones a gap
/// (their messages were acknowledged: the ERROR was their only answer).
#[test]
fn a_restore_keeps_at_most_the_cap_of_pending_errors() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let mut snap = p.server(c).checkpoint().expect("snapshot");
    snap.pending_errors = (0..MAX_PENDING_ERRORS as u64 + 300)
        .map(|i| crate::store::PendingError {
            code: 402,
            msg_id: 7,
            client_seq: i + 1,
            retry_after_ms: 0,
        })
        .collect();
    let fresh = restoring_from(&p, c, snap);
    assert_eq!(
        fresh.core().map(SessionCore::errors_kept),
        Some(MAX_PENDING_ERRORS)
    );
    // The dropped ones are a declared gap: the resume reports it.
    let core = fresh.core().expect("core");
    assert_eq!(
        core.replay().evicted_through(),
        core.replay().highest_sent(),
        "a gap"
    );
    assert!(core.replay().highest_sent() >= 300);
}

/// A backend's join or leave reaches the session's snapshot when the edge takes it
/// (`OutboundItem::Membership`), ahead of its JOINED or LEFT: a leaving channel's last
/// publications do not make it a member again, and a join before its LEFT does, at the
/// position it had.
#[test]
fn channel_joins_and_leaves_reach_the_snapshot_before_their_events() {
    use waygate_protocol::channel::{ChannelEventKind, ChannelPosition};
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let m = p.peers[c].conn.expect("conn");
    let pos = |offset| ChannelPosition { epoch: 5, offset };
    let show = |p: &mut Pair, kind, offset| show_channel_event(p, m, kind, "guild:1", offset);
    let track = |p: &mut Pair, joined: Option<u64>| {
        p.edge.machines[m]
            .track_membership("guild:1", joined.map(pos))
            .expect("tracked");
    };
    let stored = |p: &mut Pair| {
        let snap = p.server(c).checkpoint().expect("snapshot");
        snap.channels.get("guild:1").copied()
    };
    track(&mut p, Some(3));
    assert_eq!(stored(&mut p), Some(pos(3)), "a member before its JOINED");
    show(&mut p, ChannelEventKind::Joined, 3);
    show(&mut p, ChannelEventKind::Publication, 4);
    assert_eq!(stored(&mut p), Some(pos(4)));
    track(&mut p, Some(9));
    assert_eq!(
        stored(&mut p),
        Some(pos(4)),
        "a second join keeps its position"
    );
    track(&mut p, None);
    assert_eq!(stored(&mut p), None, "left before its LEFT");
    show(&mut p, ChannelEventKind::Publication, 5);
    assert_eq!(stored(&mut p), None, "its last publications");
    track(&mut p, Some(9));
    assert_eq!(stored(&mut p), Some(pos(5)), "joined again: where it was");
    track(&mut p, None);
    show(&mut p, ChannelEventKind::Left, 5);
    track(&mut p, Some(7));
    assert_eq!(stored(&mut p), Some(pos(7)), "a new membership");
}

/// What the client acknowledged of each channel ends up in the session's end (for a kind
/// with backlog, PROTOCOL.md §12.4): events sent but never acked do not count.
#[test]
fn a_session_ends_with_the_channel_positions_its_client_acknowledged() {
    use waygate_protocol::channel::{ChannelEventKind, ChannelPosition};
    let cfg = SessionConfig {
        linger: Duration::from_secs(60),
        ..SessionConfig::default()
    };
    let mut p = Pair::new(cfg);
    let c = login(&mut p, "alice");
    let m = p.peers[c].conn.expect("conn");
    let queue = |p: &mut Pair, kind, offset| show_channel_event(p, m, kind, "guild:1", offset);
    queue(&mut p, ChannelEventKind::Joined, 0);
    queue(&mut p, ChannelEventKind::Publication, 1);
    queue(&mut p, ChannelEventKind::Publication, 2);
    p.drive(c);
    p.advance(Duration::from_millis(25)); // the client's delayed ack arrives
                                          // Sent while the client is gone: never acknowledged.
    p.cut(c);
    queue(&mut p, ChannelEventKind::Publication, 3);
    p.advance(Duration::from_secs(61));
    assert_eq!(p.edge.ended.len(), 1);
    let acked = &p.edge.ended[0].channels_acked;
    assert_eq!(
        acked.get("guild:1"),
        Some(&ChannelPosition {
            epoch: 5,
            offset: 2
        })
    );
}

/// Hardening item 7: a resume without an auth token used to skip every check of the player;
/// a banned (revoked) player kept resuming. It is now asked of the authenticator: refused
/// with `auth_rejected`, the session kept as it was (its snapshot put back).
#[test]
fn a_revoked_player_cannot_resume_without_or_with_a_token() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "mallory");
    let sid = p.session(c);
    p.cut(c);
    p.edge.revocations.revoke("mallory", None, 0);
    p.peers[c].client.set_token(Bytes::new());
    p.connect(c);
    p.drive(c);
    assert_eq!(rejected(&p, c).last(), Some(&CloseCode::AuthRejected));
    assert!(
        p.edge.store.contains_key(&sid),
        "the session is kept, not resumed"
    );
    // With a token too (verified, then refused).
    p.peers[c].client.set_token(token_for("mallory"));
    p.connect(c);
    p.drive(c);
    assert_eq!(rejected(&p, c).last(), Some(&CloseCode::AuthRejected));
    // Lifted: the resume works again.
    assert!(p.edge.revocations.lift("mallory"));
    p.peers[c].client.set_token(Bytes::new());
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    assert_eq!(p.session(c), sid);
}

/// The client core: an auth token that expired while the session can still be resumed is
/// dropped (not terminal), and the next HELLO resumes with the resume token alone.
#[test]
fn an_expired_token_is_dropped_and_the_session_resumed_without_it() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    p.cut(c);
    p.edge.unix_now += 7_200; // the token (1 h) has expired
    p.connect(c);
    p.drive(c);
    let refusal = p.peers[c].events.iter().find_map(|e| match e {
        ClientEvent::Rejected { code, terminal, .. } => Some((*code, *terminal)),
        _ => None,
    });
    assert_eq!(refusal, Some((CloseCode::AuthExpired, false)));
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    assert_eq!(p.session(c), sid);
}

#[test]
fn linger_expiry_ends_the_session_and_resume_gets_a_new_one() {
    let cfg = SessionConfig {
        linger: Duration::from_secs(60),
        ..SessionConfig::default()
    };
    let mut p = Pair::new(cfg);
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    p.edge.machines[0].bind("world", "w-3").expect("bind");
    p.cut(c);
    p.advance(Duration::from_secs(59));
    assert_eq!(p.edge.machines[0].state(), State::Detached);
    p.advance(Duration::from_secs(2));
    assert_eq!(p.edge.machines[0].state(), State::Expired);
    assert_eq!(
        p.edge.machines[0].end_reason(),
        Some(&EndReason::LingerExpired)
    );
    assert_eq!(p.edge.ended.len(), 1);
    assert_eq!(
        p.edge.ended[0].bindings.get("world").map(String::as_str),
        Some("w-3")
    );
    assert!(!p.edge.store.contains_key(&sid));
    assert!(p.edge.owners["alice"].1.is_none(), "ownership released");
    p.connect(c);
    p.drive(c);
    assert_eq!(
        welcomed(&p, c).last(),
        Some(&WelcomeOutcome::RestoreFailedNewSession)
    );
    assert_ne!(p.session(c), sid);
    // The same with a resume-only HELLO: REJECT.
    let sid2 = p.session(c);
    p.cut(c);
    p.advance(Duration::from_secs(61));
    p.peers[c].client.set_token(Bytes::new());
    p.connect(c);
    p.drive(c);
    assert_eq!(rejected(&p, c), vec![CloseCode::ResumeRejected]);
    assert!(p.peers[c].client.session().is_none());
    assert!(p.edge.holder(&sid2).is_none());
}

/// A client's CLOSE `logout` ends its session at once (PROTOCOL.md §7.5): no linger, the
/// bindings handed to the end, the stored copy and the ownership released, and the next
/// connect is a new session; a CLOSE with another code still lingers. Both ways a CLOSE
/// reaches the machine: as a frame, and as the link going down with its code.
#[test]
fn a_logout_ends_the_session_at_once_and_other_closes_linger() {
    for as_frame in [false, true] {
        let mut p = Pair::new(SessionConfig::default());
        let c = login(&mut p, "alice");
        let sid = p.session(c);
        let m = p.peers[c].conn.expect("linked");
        p.edge.machines[m].bind("world", "w-3").expect("bind");
        if as_frame {
            let close = Frame::Close {
                code: CloseCode::Logout,
                message: "bye".into(),
            };
            p.edge.machines[m]
                .handle_frame(p.now, close)
                .expect("close");
            let mut out = std::collections::VecDeque::new();
            p.edge.run(m, p.now, &mut out);
            p.cut(c);
        } else {
            p.cut_with(c, CloseCode::Logout);
        }
        assert_eq!(
            p.edge.machines[m].state(),
            State::Closed,
            "as frame: {as_frame}"
        );
        assert_eq!(p.edge.machines[m].end_reason(), Some(&EndReason::LoggedOut));
        assert_eq!(p.edge.ended.len(), 1);
        assert_eq!(
            p.edge.ended[0].bindings.get("world").map(String::as_str),
            Some("w-3")
        );
        assert!(!p.edge.store.contains_key(&sid), "stored copy deleted");
        assert!(p.edge.owners["alice"].1.is_none(), "ownership released");
        p.connect(c);
        p.drive(c);
        assert_eq!(
            welcomed(&p, c).last(),
            Some(&WelcomeOutcome::RestoreFailedNewSession)
        );
        assert_ne!(p.session(c), sid);
    }
    // Any other close: the session lingers and resumes.
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "bob");
    let sid = p.session(c);
    p.cut_with(c, CloseCode::Normal);
    assert_eq!(p.edge.machines[0].state(), State::Detached);
    assert!(p.edge.ended.is_empty());
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    assert_eq!(p.session(c), sid);
}

/// An edge whose max frame size is 1,024, and client "alice" (not connected).
fn pair_with_max_frame_1024() -> (Pair, usize) {
    let cfg = SessionConfig {
        max_frame_size: 1024,
        ..SessionConfig::default()
    };
    let mut p = Pair::new(cfg);
    let c = p.add_client(token_for("alice"));
    (p, c)
}

/// Regression (2026-12-04, second stop): the client took a message whose DATA frame was
/// above the max frame size, which then closed its link at every resume. It is refused
/// (`TooLarge`, no seq taken) against its own limit before WELCOME and the smaller of its
/// own and the WELCOME's after; what fits goes out.
#[test]
fn a_client_refuses_a_message_above_the_max_frame_size() {
    let (mut p, c) = pair_with_max_frame_1024();
    let now = p.now;
    let big = Bytes::from(vec![1u8; 2000]);
    assert_eq!(
        p.peers[c].client.max_frame_size(),
        65_536,
        "its own before WELCOME"
    );
    let huge = Bytes::from(vec![1u8; 70_000]);
    assert!(p.peers[c]
        .client
        .send(now, TrafficClass::Normal, 1, huge)
        .is_err());
    p.connect(c);
    p.drive(c);
    assert_eq!(
        p.peers[c].client.max_frame_size(),
        1024,
        "the WELCOME's, smaller"
    );
    for class in [TrafficClass::Critical, TrafficClass::BestEffort] {
        let refused = p.peers[c].client.send(now, class, 1, big.clone());
        assert!(
            matches!(refused, Err(ClientError::TooLarge { max: 1024, .. })),
            "{refused:?}"
        );
    }
    // The largest that fits: its seq, and the largest ack it could carry (10 bytes).
    let fits = Bytes::from(vec![1u8; 1024 - 1 - 1 - 1 - 1 - 10]);
    assert_eq!(
        p.peers[c]
            .client
            .send(now, TrafficClass::Normal, 1, fits.clone()),
        Ok(Some(1)),
        "no seq was taken by the refusals"
    );
    let one_more = Bytes::from(vec![1u8; fits.len() + 1]);
    assert!(p.peers[c]
        .client
        .send(now, TrafficClass::Normal, 1, one_more)
        .is_err());
}

/// A message queued before the first WELCOME fits the client's own limit only; above the
/// max frame size that WELCOME announces it is dropped unsent (`Expired`), the later ones
/// renumbered. Before, it was sent and the edge closed the link for it at every resume.
#[test]
fn a_message_queued_before_the_welcome_above_its_max_frame_size_is_dropped_unsent() {
    let (mut p, c) = pair_with_max_frame_1024();
    let now = p.now;
    for (i, body) in [vec![1u8; 10], vec![2u8; 2000], vec![3u8; 10]]
        .into_iter()
        .enumerate()
    {
        assert_eq!(
            p.peers[c]
                .client
                .send(now, TrafficClass::Normal, 7 + i as u32, Bytes::from(body)),
            Ok(Some(i as u64 + 1))
        );
    }
    p.connect(c);
    p.drive(c);
    let expired: Vec<(u32, u64)> = expired_of(&p, c)
        .into_iter()
        .map(|(msg_id, seq, _)| (msg_id, seq))
        .collect();
    assert_eq!(expired, vec![(8, 2)]);
    let delivered: Vec<(u64, Bytes)> = p
        .edge
        .delivered
        .iter()
        .map(|u| (u.seq, u.payload.clone()))
        .collect();
    assert_eq!(
        delivered,
        vec![
            (1, Bytes::from(vec![1u8; 10])),
            (2, Bytes::from(vec![3u8; 10]))
        ]
    );
    assert_eq!(p.edge.closes, vec![], "no link closed");
    assert_eq!(
        p.peers[c]
            .client
            .send(now, TrafficClass::Normal, 1, Bytes::from_static(b"next")),
        Ok(Some(3))
    );
}

/// A downstream message whose DATA could exceed the max frame size is never sent: a
/// sequenced one is declared lost (CLOSE frame_too_large, RestoredWithGap on resume), a
/// best-effort one dropped, and either is counted.
#[test]
fn a_downstream_message_above_the_max_frame_size_is_a_declared_gap() {
    let cfg = SessionConfig {
        max_frame_size: 1024,
        ..SessionConfig::default()
    };
    let mut p = Pair::new(cfg);
    let c = login(&mut p, "alice");
    let m = p.peers[c].conn.expect("linked");
    let fits = Bytes::from(vec![1u8; 1024 - waygate_protocol::wire::DATA_HEADER_MAX]);
    let too_big = Bytes::from(vec![
        1u8;
        1024 - waygate_protocol::wire::DATA_HEADER_MAX + 1
    ]);
    let now = p.now;
    let best_effort = p.edge.machines[m]
        .send_downstream(now, TrafficClass::BestEffort, 5, too_big.clone())
        .expect("taken");
    assert_eq!(best_effort, None, "dropped");
    assert_eq!(
        p.edge.machines[m].state(),
        State::Active,
        "best-effort: no close"
    );
    let seq = p.edge.machines[m]
        .send_downstream(now, TrafficClass::Normal, 5, fits)
        .expect("taken");
    assert_eq!(seq, Some(1));
    let big = p.edge.machines[m]
        .send_downstream(now, TrafficClass::Normal, 6, too_big)
        .expect("taken");
    assert_eq!(big, None);
    let mut out = std::collections::VecDeque::new();
    p.edge.run(m, now, &mut out);
    assert!(
        out.iter().any(|f| matches!(
            f,
            Frame::Close {
                code: CloseCode::FrameTooLarge,
                ..
            }
        )),
        "{out:?}"
    );
    assert_eq!(p.edge.machines[m].state(), State::Detached);
    assert_eq!(
        crate::counters::SessionCounters::get(&p.edge.counters.downstream_too_large),
        2
    );
    p.cut(c);
    p.connect(c);
    p.drive(c);
    assert_eq!(
        welcomed(&p, c).last(),
        Some(&WelcomeOutcome::RestoredWithGap)
    );
}

#[test]
fn replay_overflow_restores_with_gap() {
    let cfg = SessionConfig {
        replay: ReplayLimits {
            max_messages: 4,
            max_bytes: 1 << 20,
        },
        ..SessionConfig::default()
    };
    let mut p = Pair::new(cfg);
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    p.edge.push(&sid, p.now, TrafficClass::Normal, b"1");
    p.drive(c);
    p.advance(Duration::from_millis(30)); // acked 1
    p.cut(c);
    for i in 2..=10u8 {
        p.edge.push(&sid, p.now, TrafficClass::Normal, &[b'0' + i]);
    }
    p.connect(c);
    p.drive(c);
    assert_eq!(
        welcomed(&p, c).last(),
        Some(&WelcomeOutcome::RestoredWithGap)
    );
    let seqs: Vec<u64> = p.received(c).iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, vec![1, 7, 8, 9, 10], "2..=6 evicted; base = 6");
    assert_eq!(p.peers[c].client.last_server_seq(), 10);
    // Next restore without new loss is clean again.
    p.cut(c);
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
}

#[test]
fn second_login_kicks_the_first_and_takes_over_bindings() {
    let mut p = Pair::new(SessionConfig::default());
    let first = login(&mut p, "alice");
    let sid1 = p.session(first);
    let m1 = p.peers[first].conn.expect("conn");
    p.edge.machines[m1].bind("world", "w-1").expect("bind");
    p.edge.machines[m1].bind("guild", "g-2").expect("bind");
    assert_eq!(p.server(first).fencing(), 1);
    let second = login(&mut p, "alice");
    p.drive_all();
    assert_eq!(p.edge.machines[m1].state(), State::Closed);
    assert_eq!(p.edge.machines[m1].end_reason(), Some(&EndReason::Kicked));
    assert!(p.peers[first].events.contains(&ClientEvent::Disconnected {
        code: CloseCode::Kicked
    }));
    assert_eq!(p.peers[first].client.state(), ClientState::Closed);
    assert_ne!(p.session(second), sid1);
    assert_eq!(
        p.server(second).fencing(),
        2,
        "fencing increases on takeover"
    );
    assert_eq!(
        p.bindings(second).get("world").map(String::as_str),
        Some("w-1")
    );
    assert_eq!(p.bindings(second).len(), 2);
    // A third login while the second lingers: kicks the lingering one too.
    p.cut(second);
    let third = login(&mut p, "alice");
    assert_eq!(p.server(third).fencing(), 3);
    assert_eq!(p.bindings(third).len(), 2);
    assert!(
        p.edge.store.is_empty(),
        "kicked snapshot no longer resumable"
    );
    assert_eq!(counted(&p, |c| &c.kicked), 2);
}

#[test]
fn reconnect_before_the_server_noticed_hands_the_live_session_over() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    let old = p.peers[c].conn.expect("conn");
    p.edge.push(&sid, p.now, TrafficClass::Normal, b"x");
    // The client's side of the link dies; the server's side is still ACTIVE.
    p.peers[c].to_client.clear();
    p.peers[c]
        .client
        .handle_link_down(p.now, CloseCode::GoingAway);
    p.peers[c].conn = None;
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    assert_eq!(
        p.edge.machines[old].end_reason(),
        Some(&EndReason::Superseded)
    );
    assert_eq!(p.received(c).len(), 1);
}

#[test]
fn auth_rejects_through_the_machine() {
    let mut p = Pair::new(SessionConfig::default());
    let good = token_for("alice");
    let mut forged = good.to_vec();
    forged[30] ^= 1;
    let mut v9 = good.to_vec();
    v9[0] = 9;
    let cases = [
        (Bytes::from_static(b"\x01junk"), CloseCode::AuthMalformed),
        (Bytes::from(forged), CloseCode::AuthBadSignature),
        (Bytes::from(v9), CloseCode::AuthUnsupportedVersion),
    ];
    for (token, code) in cases {
        let (m, frames) = raw_hello(&mut p, token, None);
        assert_eq!(reject_code(&frames), Some(code));
        assert_eq!(p.edge.machines[m].state(), State::Closed);
    }
    p.edge.unix_now += 10_000;
    let (_, frames) = raw_hello(&mut p, good.clone(), None);
    assert_eq!(reject_code(&frames), Some(CloseCode::AuthExpired));
    p.edge.unix_now -= 10_000;
    p.edge.auth.keys_mut().remove(1);
    let (_, frames) = raw_hello(&mut p, good, None);
    assert_eq!(reject_code(&frames), Some(CloseCode::AuthUnknownKey));
    let (_, frames) = raw_hello(&mut p, Bytes::new(), None);
    assert_eq!(reject_code(&frames), Some(CloseCode::AuthMalformed));
    let k = &p.edge.counters;
    assert_eq!(
        k.transition_count(State::Authenticating, State::Rejected),
        5
    );
    assert_eq!(k.transition_count(State::Rejected, State::Closed), 6);
}

#[test]
fn unsupported_protocol_version_and_unexpected_frames() {
    let mut p = Pair::new(SessionConfig::default());
    let m = p.edge.new_machine(p.now);
    let r = p.edge.machines[m].handle_frame(
        p.now,
        Frame::Hello(Hello {
            version: 99,
            token: token_for("a"),
            resume: None,
        }),
    );
    assert_eq!(r, Err(SessionError::UnsupportedVersion(99)));
    assert_eq!(
        p.edge.machines[m].end_reason(),
        Some(&EndReason::Rejected(CloseCode::UnsupportedVersion))
    );
    let m = p.edge.new_machine(p.now);
    let r = p.edge.machines[m].handle_frame(p.now, Frame::Ack { ack: 1 });
    assert!(matches!(r, Err(SessionError::UnexpectedFrame { .. })));
    assert_eq!(p.edge.machines[m].state(), State::Closed);
    // ACTIVE: a HELLO is unexpected -> connection closed, session detached.
    let c = login(&mut p, "alice");
    let m = p.peers[c].conn.expect("conn");
    let r = p.edge.machines[m].handle_frame(
        p.now,
        Frame::Hello(Hello {
            version: 1,
            token: Bytes::new(),
            resume: None,
        }),
    );
    assert!(matches!(r, Err(SessionError::UnexpectedFrame { .. })));
    assert_eq!(p.edge.machines[m].state(), State::Detached);
    // An ack beyond what was sent is a protocol error.
    let c = login(&mut p, "bob");
    let m = p.peers[c].conn.expect("conn");
    let r = p.edge.machines[m].handle_frame(p.now, Frame::Ack { ack: 3 });
    assert!(matches!(r, Err(SessionError::AckBeyondSent(_))));
    assert_eq!(p.edge.machines[m].state(), State::Detached);
}

#[test]
fn invalid_local_inputs_are_typed_errors() {
    let mut p = Pair::new(SessionConfig::default());
    let m = p.edge.new_machine(p.now);
    let mach = &mut p.edge.machines[m];
    let now = p.now;
    assert!(matches!(
        mach.handle_link_up(now),
        Err(SessionError::InvalidTransition { .. })
    ));
    assert!(mach
        .handle_auth_result(now, Err(crate::AuthError::BadSignature))
        .is_err());
    assert!(mach
        .handle_snapshot(now, Ok(crate::store::TakeOutcome::NotFound))
        .is_err());
    assert!(mach
        .send_downstream(now, TrafficClass::Normal, 1, Bytes::new())
        .is_err());
    assert!(mach.kick(now).is_err());
    assert!(mach.bind("a", "b").is_err());
    assert!(mach.migrate("x", Duration::from_secs(1)).is_err());
    assert!(mach.close_session(now, CloseCode::Normal).is_err());
    assert_eq!(mach.state(), State::Handshaking, "nothing changed");
}

#[test]
fn close_session_by_server_and_soft_migrate() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let m = p.peers[c].conn.expect("conn");
    p.edge.machines[m]
        .migrate("ws://edge-2:7000", Duration::from_secs(5))
        .expect("migrate");
    p.drive(c);
    assert!(p.peers[c].events.iter().any(|e| matches!(e,
        ClientEvent::Migrate { target, .. } if target == "ws://edge-2:7000")));
    // The client resumes with the token from MIGRATE.
    p.cut(c);
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    let m = p.peers[c].conn.expect("conn");
    p.edge.machines[m]
        .close_session(p.now, CloseCode::GoingAway)
        .expect("close");
    p.drive(c);
    assert_eq!(
        p.edge.machines[m].end_reason(),
        Some(&EndReason::ClosedByServer(CloseCode::GoingAway))
    );
    assert_eq!(p.edge.ended.len(), 1);
}

/// Regression (2026-12-05, a review of the SDKs against PROTOCOL.md): a backend's KICK with
/// a code of its own (say `normal`, "game over") reached the client as that code, which the
/// client read as a link lost: it resumed, was refused (`resume_rejected`) and, holding a
/// valid token, logged in again — a kicked or banned player came straight back. After
/// WELCOME the CLOSE code alone says whether the session lingers (§7.8): a server-side end
/// with a code that reads as "kept" is sent as `kicked`, any other code ends the session on
/// the client too, and the edge's lingering closes (here `slow_consumer`) still resume.
#[test]
fn a_server_side_end_is_final_for_the_client_whatever_its_code() {
    for (given, sent) in [
        (CloseCode::Normal, CloseCode::Kicked),
        (CloseCode::GoingAway, CloseCode::Kicked),
        (CloseCode::AuthRejected, CloseCode::AuthRejected),
        (CloseCode::Unknown(4_003), CloseCode::Unknown(4_003)),
    ] {
        let mut p = Pair::new(SessionConfig::default());
        let c = login(&mut p, "alice");
        let m = p.peers[c].conn.expect("conn");
        p.edge.machines[m]
            .close_session(p.now, given)
            .expect("close");
        p.drive(c);
        assert!(
            p.edge.closes.contains(&(m, sent)),
            "{given:?} sent as {sent:?}"
        );
        assert_eq!(
            p.edge.machines[m].end_reason(),
            Some(&EndReason::ClosedByServer(given)),
            "the backend's SESSION_CLOSE keeps its code"
        );
        assert!(p.peers[c]
            .events
            .contains(&ClientEvent::Disconnected { code: sent }));
        assert_eq!(
            p.peers[c].client.state(),
            ClientState::Closed,
            "{given:?}: the client ends too"
        );
        assert!(
            p.peers[c].client.connect(p.now).is_err(),
            "{given:?}: nothing to reconnect"
        );
    }
    // The edge's own lingering closes keep the session for the client.
    let t0 = std::time::Instant::now();
    for code in [
        CloseCode::SlowConsumer,
        CloseCode::Normal,
        CloseCode::IdleTimeout,
    ] {
        let mut client = welcomed_client(t0);
        client
            .handle_frame(t0, Frame::close(code, "x"))
            .expect("close");
        assert_eq!(
            client.state(),
            ClientState::Disconnected,
            "{code:?} keeps it"
        );
        client.connect(t0).expect("resumes");
    }
}

/// A refusal before HELLO (KCP BUSY, PROTOCOL.md §8.3.1 rule 5) reads as a REJECT for a
/// client with no session (an auth code ends it), never ends one with a session.
#[test]
fn a_refusal_before_hello_ends_only_a_client_without_a_session() {
    use crate::client::{ClientConfig, ClientSession};
    let t0 = std::time::Instant::now();
    let rejected = |c: &mut ClientSession| loop {
        match c.poll_event() {
            Some(ClientEvent::Rejected { terminal, .. }) => break terminal,
            Some(_) => {}
            None => panic!("no Rejected event"),
        }
    };
    let mut fresh = ClientSession::new(token_for("alice"), ClientConfig::default());
    fresh.handle_refused(t0, CloseCode::Overloaded, 100, true);
    assert!(!rejected(&mut fresh), "a load refusal is retried");
    fresh.handle_refused(t0, CloseCode::AuthRejected, 0, false);
    assert!(
        !rejected(&mut fresh),
        "not while another endpoint failed for another reason"
    );
    fresh.handle_refused(t0, CloseCode::AuthRejected, 0, true);
    assert!(rejected(&mut fresh), "an auth refusal ends a login");
    let mut unknown = ClientSession::new(token_for("alice"), ClientConfig::default());
    unknown.handle_refused(t0, CloseCode::Unknown(299), 0, true);
    assert!(
        rejected(&mut unknown),
        "an auth code this build does not know is an auth refusal (§1.1)"
    );
    let mut resuming = welcomed_client(t0);
    resuming.handle_link_down(t0, CloseCode::GoingAway);
    resuming.handle_refused(t0, CloseCode::AuthExpired, 0, true);
    assert!(
        !rejected(&mut resuming),
        "a session is never ended by a refusal"
    );
    assert!(resuming.token().is_empty(), "the expired token is dropped");
    assert!(resuming.session().is_some());
}

/// Review (2026-12-05): a token refused for a key since rotated (203) ended a session a
/// resume alone keeps (§7.1.1), and a token set while an attempt was in flight was dropped
/// with the refused one (then a sealed CONNECT went out with the new key and no token).
#[test]
fn a_refused_token_is_dropped_only_if_no_fresh_one_came_since() {
    use crate::client::ClientSession;
    let t0 = std::time::Instant::now();
    let reject = |code| {
        Frame::Reject(waygate_protocol::frame::Reject {
            code,
            retry_after_ms: 0,
            message: String::new(),
        })
    };
    let terminal = |c: &mut ClientSession| loop {
        match c.poll_event() {
            Some(ClientEvent::Rejected { terminal, .. }) => break terminal,
            Some(_) => {}
            None => panic!("no Rejected event"),
        }
    };
    let mut client = welcomed_client(t0);
    client.handle_link_down(t0, CloseCode::GoingAway);
    client.connect(t0).expect("resume");
    client
        .handle_frame(t0, reject(CloseCode::AuthUnknownKey))
        .expect("reject");
    assert!(!terminal(&mut client), "203 with a session resumes alone");
    assert!(client.token().is_empty());
    // A fresh token arrives while the next attempt is out; that attempt's refusal keeps it.
    client.connect(t0).expect("resume");
    client.set_token(Bytes::from_static(b"fresh"));
    client
        .handle_frame(t0, reject(CloseCode::AuthExpired))
        .expect("reject");
    assert!(!terminal(&mut client));
    assert_eq!(client.token(), &Bytes::from_static(b"fresh"));
    // The same for a refusal before HELLO (KCP BUSY) of an attempt that took the token.
    let taken = client.token_for_attempt();
    client.set_token(Bytes::from_static(b"fresher"));
    client.handle_refused(t0, CloseCode::AuthExpired, 0, true);
    assert!(!terminal(&mut client));
    assert_eq!(taken, Bytes::from_static(b"fresh"));
    assert_eq!(client.token(), &Bytes::from_static(b"fresher"));
    // A ban ends it.
    client.connect(t0).expect("resume");
    client
        .handle_frame(t0, reject(CloseCode::AuthRejected))
        .expect("reject");
    assert!(terminal(&mut client), "205 ends the session");
}

#[test]
fn best_effort_is_never_sequenced_or_replayed() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    assert_eq!(
        p.edge.push(&sid, p.now, TrafficClass::BestEffort, b"pos"),
        Some(0)
    );
    p.drive(c);
    assert_eq!(p.server(c).core().expect("core").replay().len(), 0);
    let now = p.now;
    let r = p.peers[c].client.send(
        now,
        TrafficClass::BestEffort,
        2,
        Bytes::from_static(b"move"),
    );
    assert_eq!(r, Ok(Some(0)));
    p.drive(c);
    assert_eq!(p.edge.delivered.last().map(|u| u.seq), Some(0));
    assert_eq!(p.peers[c].client.unacked_len(), 0);
}

#[test]
fn lost_welcome_keeps_the_presented_token_valid_until_confirmed() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    p.cut(c);
    p.connect(c);
    // Deliver only the HELLO; the WELCOME is lost with the link.
    p.step(c, 1);
    p.cut(c);
    p.connect(c);
    p.drive(c);
    assert_eq!(welcomed(&p, c).last(), Some(&WelcomeOutcome::Restored));
    assert_eq!(p.session(c), sid);
    assert_eq!(
        p.edge.machines[1].end_reason(),
        Some(&EndReason::Superseded)
    );
    assert_eq!(p.server(c).core().expect("core").id(), &sid);
}

/// Review (2026-12-05, PROTOCOL.md §7.3.3 against the code): any frame after WELCOME
/// spends the previous resume token, but a PING was answered before that rule ran, so a
/// client whose only frame after a resume was a PING left its old token usable.
#[test]
fn a_ping_after_welcome_spends_the_previous_resume_token() {
    use crate::machine::ResumeAttempt;
    use crate::store::TakeOutcome;
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let (sid, old_token) = p.peers[c].client.session().expect("session");
    p.cut(c);
    p.connect(c);
    // Only the HELLO reaches the edge: the machine restores the session and sends WELCOME
    // with a new token; the client has sent nothing since.
    p.step(c, 1);
    let m = p.peers[c].conn.expect("conn");
    assert_eq!(p.edge.machines[m].state(), State::Active);
    let now = p.now;
    p.edge.machines[m]
        .handle_frame(now, Frame::Ping { timestamp: 1 })
        .expect("ping");
    let replayed = ResumeAttempt::proving(&old_token, &sid, 1_000);
    let outcome = p.edge.machines[m]
        .hand_over(now, &replayed)
        .expect("hand over");
    assert!(
        matches!(outcome, TakeOutcome::Mismatch),
        "the old token is spent: {outcome:?}"
    );
}

/// Review (2026-12-05, PROTOCOL.md §7.4.2 against the code): the Rust client core took an
/// ack of a seq it never sent (the JS SDK refused it): it is a protocol error.
#[test]
fn an_ack_beyond_what_the_client_sent_is_refused() {
    use crate::client::ClientError;
    let t0 = std::time::Instant::now();
    let mut client = welcomed_client(t0);
    client
        .send(t0, TrafficClass::Normal, 7, Bytes::from_static(b"x"))
        .expect("send");
    assert_eq!(client.handle_frame(t0, Frame::Ack { ack: 1 }), Ok(()));
    assert_eq!(
        client.handle_frame(t0, Frame::Ack { ack: 2 }),
        Err(ClientError::AckBeyondSent(2))
    );
}

/// Drives one machine by hand up to its ownership claim (the store will fail it).
fn machine_at_claim(p: &mut Pair, resume: Option<ResumeRequest>) -> usize {
    let m = p.edge.new_machine(p.now);
    let now = p.now;
    let mach = &mut p.edge.machines[m];
    mach.handle_frame(
        now,
        Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            token: token_for("carol"),
            resume,
        }),
    )
    .expect("hello");
    let Some(Action::Authenticate { token }) = mach.poll_action() else {
        panic!("authenticate expected")
    };
    let authed = p.edge.auth.verify(&token, pair::UNIX_NOW);
    mach.handle_auth_result(now, authed).expect("auth");
    m
}

/// A machine resuming peer `c`'s session (its resume token proven with a fresh nonce),
/// authenticated and past its [`Action::TakeSnapshot`]: the store's answer is next.
fn resume_at_take(p: &mut Pair, c: usize) -> usize {
    let (session_id, resume_token) = p.peers[c].client.session().expect("resume token");
    let resume = ResumeRequest::proving(
        session_id,
        &resume_token,
        p.peers[c].client.last_server_seq(),
        FORGED_NONCE,
    );
    let m = machine_at_claim(p, Some(resume));
    let Some(Action::TakeSnapshot { .. }) = p.edge.machines[m].poll_action() else {
        panic!("take expected")
    };
    m
}

#[test]
fn ownership_store_down_rejects_unavailable_with_retry_after_and_puts_the_snapshot_back() {
    let mut p = Pair::new(SessionConfig::default());
    // A new login: REJECT unavailable with a retry-after, never a bare CLOSE.
    let m = machine_at_claim(&mut p, None);
    let mach = &mut p.edge.machines[m];
    assert!(matches!(mach.poll_action(), Some(Action::Claim { .. })));
    mach.handle_claimed(p.now, Err(crate::store::StoreError::Timeout))
        .expect("claim result");
    let actions: Vec<Action> = std::iter::from_fn(|| mach.poll_action()).collect();
    let reject = actions.iter().find_map(|a| match a {
        Action::Send(Frame::Reject(r)) => Some(r.clone()),
        _ => None,
    });
    let reject = reject.unwrap_or_else(|| panic!("REJECT expected: {actions:?}"));
    assert_eq!(reject.code, CloseCode::Unavailable);
    assert!(reject.retry_after_ms > 0, "{reject:?}");
    assert_eq!(
        mach.end_reason(),
        Some(&EndReason::Rejected(CloseCode::Unavailable))
    );

    // A restore whose claim fails: the taken snapshot goes back to the store unchanged.
    let c = login(&mut p, "carol");
    let sid = p.session(c);
    p.cut(c);
    p.drive_all();
    let snapshot = p
        .edge
        .store
        .get(&sid)
        .cloned()
        .expect("persisted on detach");
    let m = resume_at_take(&mut p, c);
    let now = p.now;
    let mach = &mut p.edge.machines[m];
    mach.handle_snapshot(
        now,
        Ok(crate::store::TakeOutcome::Taken(Box::new(snapshot.clone()))),
    )
    .expect("snapshot");
    assert!(matches!(mach.poll_action(), Some(Action::Claim { .. })));
    mach.handle_claimed(
        now,
        Err(crate::store::StoreError::Unavailable("down".into())),
    )
    .expect("claim result");
    let actions: Vec<Action> = std::iter::from_fn(|| mach.poll_action()).collect();
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::PutBack(s) if **s == snapshot)),
        "{actions:?}"
    );
    assert!(actions.iter().any(|a| matches!(a,
        Action::Send(Frame::Reject(r)) if r.code == CloseCode::Unavailable && r.retry_after_ms > 0)));
}

/// Regression (channels-at-scale overload run: players ended `kicked` and acknowledged
/// replies were lost): a resume whose snapshot lookup timed out went on, with a valid auth
/// token, to a fresh session, whose claim then took the player from the session the
/// client was resuming (single login). Now such a resume is refused with `unavailable` and
/// a retry-after, token or not, and claims nothing.
#[test]
fn a_resume_the_store_could_not_answer_is_refused_and_claims_nothing() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "carol");
    p.cut(c);
    p.drive_all();
    let m = resume_at_take(&mut p, c);
    let now = p.now;
    let mach = &mut p.edge.machines[m];
    mach.handle_snapshot(now, Err(crate::store::StoreError::Timeout))
        .expect("snapshot");
    let actions: Vec<Action> = std::iter::from_fn(|| mach.poll_action()).collect();
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Claim { .. })),
        "{actions:?}"
    );
    assert!(
        actions.iter().any(|a| matches!(a,
            Action::Send(Frame::Reject(r)) if r.code == CloseCode::Unavailable && r.retry_after_ms > 0)),
        "{actions:?}"
    );
    assert_eq!(
        mach.end_reason(),
        Some(&EndReason::Rejected(CloseCode::Unavailable))
    );
}

/// Alice logged in on an edge whose backend answers only when told (`forward_done`,
/// `refuse`), with `n` messages sent and delivered: (the pair, her peer, her session).
fn awaiting_answers(n: usize, tag: &str) -> (Pair, usize, SessionId) {
    let mut p = Pair::new(SessionConfig::default());
    p.edge.backend_answers = true;
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    send_up(&mut p, c, n, tag);
    p.drive(c);
    assert_eq!(p.edge.delivered.len(), n);
    (p, c, sid)
}

/// PROTOCOL.md §9.6: with a backend that answers (FORWARD_DONE), a client's message is
/// acknowledged only once answered, and the ack rides on the reply queued before the
/// answer; a store copy counts only answered messages (so after the edge dies the client
/// resends the others: delivered again, never lost); a resume on this edge keeps waiting
/// for the answer instead of delivering the resent message twice; an ERROR answers too.
#[test]
fn a_message_is_acknowledged_only_once_its_backend_answered_it() {
    let (mut p, c, sid) = awaiting_answers(2, "u");
    p.advance(Duration::from_millis(50)); // well past the ack delay
    assert_eq!(
        p.peers[c].client.unacked_len(),
        2,
        "nothing answered, nothing acked"
    );
    let stored = p.server(c).checkpoint().expect("snapshot");
    assert_eq!(
        stored.upstream.cumulative(),
        0,
        "a store copy counts answers only"
    );
    assert!(stored.awaiting.is_empty());
    assert_eq!(p.server(c).core().expect("core").awaiting().len(), 2);

    // The backend's reply to the first, then its FORWARD_DONE, taken together: the ack
    // rides on the reply (no ack delay).
    let now = p.now;
    let reply = crate::host::Downstream {
        class: TrafficClass::Normal,
        msg_id: 7,
        payload: Bytes::from_static(b"r0"),
    };
    p.edge.host.push(&sid, reply).expect("queued");
    p.edge.host.answered(&sid, 1).expect("queued");
    p.edge.serve(now);
    p.drive(c);
    assert_eq!(p.received(c).len(), 1);
    assert_eq!(p.peers[c].client.unacked_len(), 1, "ack rode on the reply");
    let stored = p.server(c).checkpoint().expect("snapshot");
    assert_eq!(stored.upstream.cumulative(), 1);

    // The link drops with the second still unanswered; the client comes back here and
    // resends it: it is not delivered again, and its answer acknowledges it.
    p.cut(c);
    p.advance(Duration::from_millis(100));
    p.connect(c);
    p.drive(c);
    assert_eq!(
        welcomed(&p, c),
        vec![WelcomeOutcome::NewSession, WelcomeOutcome::Restored]
    );
    assert_eq!(p.peers[c].client.unacked_len(), 1);
    assert_eq!(
        p.edge.delivered.len(),
        2,
        "the resent message waits for its answer"
    );
    let now = p.now;
    p.edge.forward_done(&sid, now, 2);
    p.drive(c);
    p.advance(Duration::from_millis(50));
    assert_eq!(p.peers[c].client.unacked_len(), 0);

    // A refusal answers as well: the ERROR, then the ack.
    send_up(&mut p, c, 1, "v");
    p.drive(c);
    let now = p.now;
    p.edge.refuse(&sid, now, 3);
    p.drive(c);
    p.advance(Duration::from_millis(50));
    assert_eq!(p.peers[c].client.unacked_len(), 0);
    assert_eq!(errors_of(&p, c), vec![3]);
}

/// A lingering session's holder takes pushes after its detach copy was stored, then gets
/// stuck; a resume must not be served from that stale copy while the live session (with
/// those pushes sequenced in its replay buffer) is held here: they would be lost without a
/// gap (the restored copy numbers new pushes with the lost ones' seqs). Found by the C echo
/// example's link drill under load (replies sent before the drop never arrived).
#[test]
fn a_resume_is_never_served_a_stale_copy_while_the_live_session_is_held_here() {
    let mut p = Pair::new(SessionConfig::default());
    let c = login(&mut p, "alice");
    let sid = p.session(c);
    let old = p.peers[c].conn.expect("conn");
    p.edge.push(&sid, p.now, TrafficClass::Normal, b"before");
    p.drive(c);
    p.cut(c);
    // Lingering: replies arrive and the holder sequences them (no link to send them on).
    p.edge.push(&sid, p.now, TrafficClass::Normal, b"away-1");
    p.edge.push(&sid, p.now, TrafficClass::Normal, b"away-2");
    p.edge.stalled.insert(old);
    p.connect(c);
    p.drive(c);
    p.edge.release(old, p.now);
    for _ in 0..5 {
        if p.peers[c].client.state() != crate::client::ClientState::Active {
            p.connect(c);
        }
        p.drive(c);
        p.advance(Duration::from_millis(500));
    }
    p.edge.push(&sid, p.now, TrafficClass::Normal, b"after");
    p.drive(c);
    let got: Vec<Bytes> = p.received(c).into_iter().map(|m| m.1).collect();
    assert_eq!(
        got,
        vec![
            Bytes::from_static(b"before"),
            Bytes::from_static(b"away-1"),
            Bytes::from_static(b"away-2"),
            Bytes::from_static(b"after")
        ],
        "welcomes {:?}",
        welcomed(&p, c)
    );
    assert_eq!(
        welcomed(&p, c),
        vec![WelcomeOutcome::NewSession, WelcomeOutcome::Restored]
    );
    // The resume the stuck holder could not answer was refused for now, not served.
    assert_eq!(rejected(&p, c), vec![CloseCode::Unavailable]);
}

/// A backend slower than the client's 1 s liveness rule (PROTOCOL.md §7.5) does not make
/// the client call a live link dead: while its message waits for the answer, the edge sends
/// an ACK every `answer_keepalive` (its value unmoved), and none once it is answered.
/// Before, the edge sent one ACK after the ack delay and nothing more, and the client
/// dropped the link 1 s later and resumed (seen behind a held message in `tests/link.rs`).
#[test]
fn a_slow_answer_keeps_the_client_link_alive_with_acks() {
    let (mut p, c, sid) = awaiting_answers(1, "slow");
    let acks_before = counted(&p, |c| &c.acks_sent);
    for _ in 0..30 {
        p.advance(Duration::from_millis(100));
    }
    assert_eq!(
        p.peers[c].client.state(),
        ClientState::Active,
        "3 s without an answer, the link lives"
    );
    assert_eq!(welcomed(&p, c), vec![WelcomeOutcome::NewSession]);
    let keepalives = counted(&p, |c| &c.answer_keepalives);
    assert_eq!(keepalives, 6, "one keep-alive ACK per 500 ms for 3 s");
    assert_eq!(p.peers[c].client.unacked_len(), 1, "still unanswered");
    let now = p.now;
    p.edge.forward_done(&sid, now, 1);
    p.drive(c);
    p.advance(Duration::from_millis(50));
    assert_eq!(p.peers[c].client.unacked_len(), 0);
    let acks = counted(&p, |c| &c.acks_sent);
    for _ in 0..30 {
        p.advance(Duration::from_millis(100));
    }
    assert_eq!(
        counted(&p, |c| &c.acks_sent),
        acks,
        "nothing waits: no keep-alive"
    );
    assert!(acks >= acks_before + 6);
}

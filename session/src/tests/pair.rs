//! A quinn-`Pair`-style harness: server machines (one per connection) and client
//! counterparts on a virtual clock, joined by scripted in-memory links. It plays the
//! driver's part synchronously — auth, an in-memory snapshot store, the ownership registry —
//! around the real [`SessionHost`], which decides kicks, hand-overs and takeovers.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use waygate_protocol::frame::SessionId;
use waygate_transport::{CloseCode, Frame, TrafficClass};

use crate::auth::{mint_token, HmacAuthenticator, KeyRing, TokenClaims};
use crate::client::{ClientConfig, ClientEvent, ClientSession};
use crate::counters::SessionCounters;
use crate::host::{
    apply_work, resume_from_store, ConnTaskId, Downstream, EstablishOutcome, HandOverStart,
    HostAnswer, Reply, ResumeFromStore, SessionHost,
};
use crate::machine::{Action, SessionConfig, SessionEnd, SessionMachine, State, Upstream};
use crate::rng::SeededRng;
use crate::store::{ClaimGrant, Owner, Snapshot, StoreError, TakeOutcome};

pub(crate) const KEY: &[u8] = b"test key: 32 bytes of secret....";
pub(crate) const UNIX_NOW: u64 = 1_800_000_000;

pub(crate) fn token_for(player: &str) -> Bytes {
    mint_token(
        1,
        KEY,
        &TokenClaims {
            player_id: player.into(),
            issuer: "test".into(),
            issued_at: UNIX_NOW - 10,
            expires_at: UNIX_NOW + 3600,
            extensions: vec![],
        },
    )
    .expect("mint")
}

/// The edge side: every server machine (one per connection), the real [`SessionHost`]
/// holding the cross-session rules, the stores, and the log of side effects.
pub(crate) struct Edge {
    pub(crate) config: SessionConfig,
    pub(crate) counters: Arc<SessionCounters>,
    pub(crate) auth: HmacAuthenticator,
    /// Revoked players (as `AuthPolicy` wraps the edge's authenticator).
    pub(crate) revocations: crate::auth::Revocations,
    pub(crate) unix_now: u64,
    pub(crate) machines: Vec<SessionMachine>,
    pub(crate) host: SessionHost,
    /// Connections whose driver is stuck (their host work waits until released).
    pub(crate) stalled: HashSet<usize>,
    /// Connections the host was told are gone.
    closed: HashSet<usize>,
    /// Connections with a client link (the others' actions run as soon as they appear).
    pub(crate) linked: HashSet<usize>,
    /// Stalled connections woken meanwhile.
    stalled_wakes: HashSet<usize>,
    /// Sessions restored while their previous copy cleaned up after its end
    /// ([`EstablishOutcome::PreviousEnding`]): registered again once that copy has closed.
    registering: Vec<(usize, SessionId, Arc<str>, u64)>,
    /// Work a connection took while waiting for an answer, not yet done.
    backlogs: HashMap<usize, crate::host::Work>,
    /// Answers to requests, by the connection that asked.
    answers: HashMap<usize, HostAnswer>,
    pub(crate) store: HashMap<SessionId, Snapshot>,
    /// The shared store and ownership registry fail every call (0: up; 1: unavailable;
    /// 2: timing out).
    pub(crate) store_down: u8,
    pub(crate) owners: HashMap<String, (u64, Option<Owner>)>,
    pub(crate) delivered: Vec<Upstream>,
    /// Delivered messages wait for [`Edge::forward_done`] (a backend with FORWARD_DONE); else
    /// each is answered as it is delivered.
    pub(crate) backend_answers: bool,
    pub(crate) ended: Vec<SessionEnd>,
    pub(crate) closes: Vec<(usize, CloseCode)>,
    /// New connections' machines refuse new sessions with this retry-after (the edge's
    /// overload level 2).
    pub(crate) refuse_new_sessions: Option<Duration>,
    seed: u64,
}

impl Edge {
    pub(crate) fn with_outbound(config: SessionConfig, capacity: usize) -> Self {
        let mut ring = KeyRing::new();
        ring.insert(1, KEY);
        Self {
            config,
            counters: Arc::new(SessionCounters::new()),
            auth: HmacAuthenticator::new(ring),
            revocations: crate::auth::Revocations::default(),
            unix_now: UNIX_NOW,
            machines: Vec::new(),
            host: SessionHost::new(SessionHost::outbound_for_capacity(capacity)),
            stalled: HashSet::new(),
            closed: HashSet::new(),
            stalled_wakes: HashSet::new(),
            registering: Vec::new(),
            linked: HashSet::new(),
            backlogs: HashMap::new(),
            answers: HashMap::new(),
            store: HashMap::new(),
            store_down: 0,
            owners: HashMap::new(),
            delivered: Vec::new(),
            backend_answers: false,
            ended: Vec::new(),
            closes: Vec::new(),
            refuse_new_sessions: None,
            seed: 1,
        }
    }

    pub(crate) fn new_machine(&mut self, now: Instant) -> usize {
        self.seed += 1;
        let mut m = SessionMachine::new(
            self.config.clone(),
            self.counters.clone(),
            Box::new(SeededRng::new(self.seed)),
        );
        m.handle_link_up(now).expect("link up");
        if let Some(retry_after) = self.refuse_new_sessions {
            m.refuse_new_sessions(retry_after);
        }
        self.machines.push(m);
        let i = self.machines.len() - 1;
        self.host.open(i as ConnTaskId);
        i
    }

    /// The machine the host says holds a session.
    pub(crate) fn holder(&self, session: &SessionId) -> Option<usize> {
        let i = self.host.holder_of(session)? as usize;
        matches!(self.machines[i].state(), State::Active | State::Detached).then_some(i)
    }

    /// Does the host's work for every woken connection that is not stalled (as each
    /// connection's driver would), feeding the machines' replies back; tells the host about
    /// connections whose machine ended.
    pub(crate) fn serve(&mut self, now: Instant) {
        loop {
            let mut progressed = false;
            let mut woken = Vec::new();
            while let Some(c) = self.host.poll_wake() {
                woken.push(c as usize);
            }
            for j in woken {
                if self.stalled.contains(&j) {
                    // Its driver is stuck: the work stays in the host for later.
                    self.stalled_wakes.insert(j);
                    continue;
                }
                progressed = true;
                self.work(j, now);
            }
            for j in 0..self.machines.len() {
                if self.machines[j].state().is_terminal() && self.closed.insert(j) {
                    self.host.close(j as ConnTaskId);
                    progressed = true;
                }
            }
            for (j, session_id, player_id, fencing) in std::mem::take(&mut self.registering) {
                if !self.machines[j].state().is_terminal() {
                    progressed |= self.register(j, session_id, player_id, fencing, now);
                }
            }
            if !progressed {
                break;
            }
        }
        self.host.check_invariants().expect("host invariants");
    }

    /// Registers `j`'s established session as the driver does; false when it has to wait
    /// for the previous copy's end (kept in `registering`).
    fn register(
        &mut self,
        j: usize,
        session_id: SessionId,
        player_id: Arc<str>,
        fencing: u64,
        now: Instant,
    ) -> bool {
        match self
            .host
            .established(j as ConnTaskId, session_id, player_id.clone(), fencing)
        {
            EstablishOutcome::PreviousEnding => {
                self.registering.push((j, session_id, player_id, fencing));
                false
            }
            EstablishOutcome::LostRace => {
                let _ = self.machines[j].kick(now);
                true
            }
            EstablishOutcome::Registered => true,
        }
    }

    fn work(&mut self, j: usize, now: Instant) {
        let mut work = self.host.take_work(j as ConnTaskId);
        if let Some(mut backlog) = self.backlogs.remove(&j) {
            backlog.items.append(&mut work.items);
            backlog.commands.append(&mut work.commands);
            backlog.lost += work.lost;
            backlog.answer = work.answer.take();
            work = backlog;
        }
        let mut replies = Vec::new();
        apply_work(&mut self.machines[j], &mut work, now, &mut replies);
        for reply in replies {
            if reply == Reply::DropLink {
                let _ = self.machines[j].handle_link_down(now, CloseCode::GoingAway);
                continue;
            }
            if let Some(s) = self.host.reply(j as ConnTaskId, reply) {
                self.store.insert(s.session_id, *s);
            }
        }
        if let Some(answer) = work.answer {
            self.answers.insert(j, answer);
        }
        if !self.linked.contains(&j) {
            // No link: like its driver, it carries out what the work caused right away.
            let mut sink = VecDeque::new();
            self.run(j, now, &mut sink);
        }
    }

    /// As `SnapshotStore::delete`: with `fencing`, only the copy of that fencing.
    fn store_delete(&mut self, session_id: &SessionId, fencing: Option<u64>) {
        if self
            .store
            .get(session_id)
            .is_some_and(|s| s.deleted_by(fencing))
        {
            self.store.remove(session_id);
        }
    }

    fn store_error(&self) -> StoreError {
        if self.store_down == 2 {
            StoreError::Timeout
        } else {
            StoreError::Unavailable("store down (test)".into())
        }
    }

    /// Un-sticks connection `j`: its waiting work is done now.
    pub(crate) fn release(&mut self, j: usize, now: Instant) {
        self.stalled.remove(&j);
        if self.stalled_wakes.remove(&j) {
            self.work(j, now);
        }
        self.serve(now);
    }

    /// The answer to connection `i`'s request: served at once, or — its holder stuck —
    /// after the host's deadline.
    fn answer(&mut self, i: usize, now: Instant) -> Option<HostAnswer> {
        self.serve(now);
        if let Some(a) = self.own_answer(i) {
            return Some(a);
        }
        let deadline = self.host.waiting_deadline(i as ConnTaskId)?;
        self.host.handle_timeout(deadline);
        self.serve(now);
        self.own_answer(i)
    }

    /// Like the driver's `answer`: the asking connection takes its own work from the host
    /// (it is running, so never stuck); the rest of that work waits in its backlog until its
    /// actions are done.
    fn own_answer(&mut self, i: usize) -> Option<HostAnswer> {
        if let Some(a) = self.answers.remove(&i) {
            return Some(a);
        }
        let mut work = self.host.take_work(i as ConnTaskId);
        let answer = work.answer.take();
        let backlog = self.backlogs.entry(i).or_default();
        backlog.items.append(&mut work.items);
        backlog.commands.append(&mut work.commands);
        backlog.lost += work.lost;
        answer
    }

    /// Runs machine `i`'s actions; frames for its connection go to `out`. Returns whether
    /// the machine asked to close its connection.
    pub(crate) fn run(&mut self, i: usize, now: Instant, out: &mut VecDeque<Frame>) -> bool {
        let mut closed = false;
        while let Some(action) = self.machines[i].poll_action() {
            match action {
                Action::Send(frame) => {
                    if !closed {
                        out.push_back(frame);
                    }
                }
                Action::Close { code, .. } => {
                    if !closed {
                        out.push_back(Frame::Close {
                            code,
                            message: String::new(),
                        });
                    }
                    self.closes.push((i, code));
                    closed = true;
                }
                Action::Authenticate { token } => {
                    let r = self.auth.verify(&token, self.unix_now).and_then(|p| {
                        self.revocations.check(p.player_id(), self.unix_now)?;
                        Ok(p)
                    });
                    self.machines[i].handle_auth_result(now, r).expect("auth");
                }
                Action::CheckAllowed { player_id } => {
                    let r = self.revocations.check(&player_id, self.unix_now);
                    self.machines[i].handle_allowed(now, r).expect("allowed");
                }
                Action::TakeSnapshot {
                    session_id,
                    attempt,
                } => {
                    let start = self.host.request_hand_over(
                        i as ConnTaskId,
                        session_id,
                        attempt.clone(),
                        now,
                    );
                    let answer = match start {
                        HandOverStart::Pending => self.answer(i, now),
                        HandOverStart::NotLocal | HandOverStart::Ended | HandOverStart::Busy => {
                            None
                        }
                    };
                    let outcome = match resume_from_store(start, answer) {
                        ResumeFromStore::Busy => {
                            self.machines[i].handle_hand_over_busy(now).expect("busy");
                            continue;
                        }
                        ResumeFromStore::TakeProven if self.store_down > 0 => {
                            let err = self.store_error();
                            self.machines[i]
                                .handle_snapshot(now, Err(err))
                                .expect("snapshot");
                            continue;
                        }
                        ResumeFromStore::TakeProven => match self.store.get(&session_id) {
                            None => TakeOutcome::NotFound,
                            Some(s) if s.key_used(&attempt).is_some() => self
                                .store
                                .remove(&session_id)
                                .map_or(TakeOutcome::NotFound, |s| TakeOutcome::Taken(Box::new(s))),
                            Some(_) => TakeOutcome::Mismatch,
                        },
                        ResumeFromStore::Decided { outcome, delete } => {
                            if let Some(fencing) = delete {
                                self.store_delete(&session_id, fencing);
                            }
                            outcome
                        }
                    };
                    self.machines[i]
                        .handle_snapshot(now, Ok(outcome))
                        .expect("snapshot");
                }
                Action::Persist(s) if self.host.held_elsewhere(&s.session_id, i as ConnTaskId) => {
                    // A stale copy (restored elsewhere while its driver was stuck): as the
                    // driver, never overwrite the live session's store copy.
                }
                Action::PutBack(s) | Action::Persist(s) => {
                    self.store.insert(s.session_id, *s);
                }
                Action::Claim {
                    player_id,
                    session_id,
                } => {
                    if self.store_down > 0 {
                        let err = self.store_error();
                        self.machines[i]
                            .handle_claimed(now, Err(err))
                            .expect("claim");
                        continue;
                    }
                    let entry = self
                        .owners
                        .entry(player_id.to_string())
                        .or_insert((0, None));
                    entry.0 += 1;
                    let fencing = entry.0;
                    let previous = entry.1.replace(Owner {
                        session_id,
                        edge: "e1".into(),
                        fencing,
                    });
                    let plan =
                        self.host
                            .take_over(i as ConnTaskId, session_id, previous.as_ref(), now);
                    let mut inherited = None;
                    if plan.kick_pending {
                        if let Some(HostAnswer::Kicked(b)) = self.answer(i, now) {
                            inherited = b;
                        }
                    }
                    if let Some(prev) = plan.previous {
                        if let Some(s) = self.store.remove(&prev) {
                            inherited.get_or_insert(s.bindings);
                        }
                    }
                    self.machines[i]
                        .handle_claimed(now, Ok((ClaimGrant { fencing, previous }, inherited)))
                        .expect("claim");
                }
                Action::Established {
                    session_id,
                    player_id,
                    fencing,
                    ..
                } => {
                    self.register(i, session_id, player_id, fencing, now);
                }
                Action::Bind(_) | Action::RoutingKeys(_) | Action::Channels(_) => {}
                Action::Deliver(u) => {
                    if !self.backend_answers {
                        let _ = self.machines[i].answer_upstream(now, u.seq);
                    }
                    self.delivered.push(u);
                }
                Action::Ended(end) if !self.host.end_started(&end.session_id, i as ConnTaskId) => {
                    // A stale copy: the session lives on in another connection.
                    self.ended.push(end);
                }
                Action::Ended(end) => {
                    if let Some(e) = self.owners.get_mut(end.player_id.as_ref()) {
                        if e.1.as_ref().is_some_and(|o| {
                            o.session_id == end.session_id && o.fencing == end.fencing
                        }) {
                            e.1 = None;
                        }
                    }
                    self.store_delete(&end.session_id, Some(end.fencing));
                    self.ended.push(end);
                }
            }
        }
        if self.backlogs.contains_key(&i) && !self.stalled.contains(&i) {
            // Work taken while waiting for an answer, done after the actions (as the driver).
            self.work(i, now);
        }
        self.serve(now);
        closed
    }

    /// A backend push through the host; whether the host accepted it (its holder may be
    /// stuck: then it waits in the host's queue).
    pub(crate) fn push_any(
        &mut self,
        session: &SessionId,
        now: Instant,
        class: TrafficClass,
        payload: &[u8],
    ) -> bool {
        let message = Downstream {
            class,
            msg_id: 7,
            payload: Bytes::copy_from_slice(payload),
        };
        let accepted = self.host.push(session, message).is_ok();
        self.serve(now);
        accepted
    }

    /// A backend's FORWARD_DONE for the client's message `client_seq`, through the host.
    pub(crate) fn forward_done(&mut self, session: &SessionId, now: Instant, client_seq: u64) {
        self.host.answered(session, client_seq).expect("queued");
        self.serve(now);
    }

    /// A backend refusal of the client's message `client_seq` (an ERROR, through the host).
    pub(crate) fn refuse(&mut self, session: &SessionId, now: Instant, client_seq: u64) {
        let report = waygate_protocol::frame::ErrorReport {
            code: CloseCode::Busy,
            msg_id: 1,
            client_seq,
            retry_after_ms: 0,
        };
        self.host.report_error(session, report).expect("queued");
        self.serve(now);
    }

    /// A backend push through the host; returns the seq it got (0: best-effort), or `None`
    /// when the host refused it or the holder is stuck.
    pub(crate) fn push(
        &mut self,
        session: &SessionId,
        now: Instant,
        class: TrafficClass,
        payload: &[u8],
    ) -> Option<u64> {
        if !self.push_any(session, now, class, payload) {
            return None;
        }
        let i = self.host.holder_of(session)? as usize;
        if self.stalled.contains(&i) {
            return None;
        }
        if !class.is_sequenced() {
            return Some(0);
        }
        self.machines[i].core().map(|c| c.replay().highest_sent())
    }
}

/// One client and its current link to a server machine.
pub(crate) struct Peer {
    pub(crate) client: ClientSession,
    /// Server machine of the current link.
    pub(crate) conn: Option<usize>,
    pub(crate) to_server: VecDeque<Frame>,
    pub(crate) to_client: VecDeque<Frame>,
    /// Drop the next N frames in each direction, then cut the link (they were in flight).
    pub(crate) drop_next: usize,
    pub(crate) events: Vec<ClientEvent>,
    /// The edge's inbound limiter of the current link (B2), when the pair has limits.
    limiter: Option<waygate_backpressure::InboundLimiter>,
    /// Over the limit: the edge does not read this link until then (as the driver).
    held_until: Option<Instant>,
}

/// The harness: an edge, any number of clients, a virtual clock.
pub(crate) struct Pair {
    pub(crate) now: Instant,
    pub(crate) edge: Edge,
    /// Inbound limits per link (B2), as the driver applies them.
    pub(crate) inbound: Option<waygate_backpressure::InboundLimits>,
    pub(crate) peers: Vec<Peer>,
}

impl Pair {
    pub(crate) fn new(config: SessionConfig) -> Self {
        Self::with_outbound(config, 1024)
    }

    /// A pair whose host queues at most `capacity` items per session.
    pub(crate) fn with_outbound(config: SessionConfig, capacity: usize) -> Self {
        Self {
            now: Instant::now(),
            edge: Edge::with_outbound(config, capacity),
            inbound: None,
            peers: Vec::new(),
        }
    }

    pub(crate) fn add_client(&mut self, token: Bytes) -> usize {
        self.add_client_with(token, ClientConfig::default())
    }

    /// A client with its own settings.
    pub(crate) fn add_client_with(&mut self, token: Bytes, config: ClientConfig) -> usize {
        self.peers.push(Peer {
            client: ClientSession::new(token, config),
            conn: None,
            to_server: VecDeque::new(),
            to_client: VecDeque::new(),
            drop_next: 0,
            events: Vec::new(),
            limiter: None,
            held_until: None,
        });
        self.peers.len() - 1
    }

    /// Replaces client `c`'s ended session (kicked, rejected) with a fresh login: the app
    /// starting over. Its event log is kept.
    pub(crate) fn relogin(&mut self, c: usize, token: Bytes) {
        if let Some(m) = self.peers[c].conn.take() {
            self.edge.linked.remove(&m);
            let now = self.now;
            let _ = self.edge.machines[m].handle_link_down(now, CloseCode::GoingAway);
            let mut sink = VecDeque::new();
            self.edge.run(m, now, &mut sink);
        }
        let p = &mut self.peers[c];
        p.client = ClientSession::new(token, ClientConfig::default());
        p.to_server.clear();
        p.to_client.clear();
        p.drop_next = 0;
    }

    /// Opens a new link for client `c` and sends its HELLO (not yet delivered).
    pub(crate) fn connect(&mut self, c: usize) {
        let m = self.edge.new_machine(self.now);
        let p = &mut self.peers[c];
        p.conn = Some(m);
        p.limiter = self
            .inbound
            .map(|l| waygate_backpressure::InboundLimiter::new(l, self.now));
        p.held_until = None;
        self.edge.linked.insert(m);
        p.to_server.clear();
        p.to_client.clear();
        p.client.connect(self.now).expect("connect");
    }

    /// Cuts client `c`'s link: frames in flight are lost, both ends learn.
    pub(crate) fn cut(&mut self, c: usize) {
        self.cut_with(c, CloseCode::GoingAway);
    }

    /// Cuts client `c`'s link as a peer's close with `code` would (the transports report a
    /// received CLOSE as the link going down with its code).
    pub(crate) fn cut_with(&mut self, c: usize, code: CloseCode) {
        let now = self.now;
        let p = &mut self.peers[c];
        p.to_server.clear();
        p.to_client.clear();
        if let Some(m) = p.conn.take() {
            self.edge.linked.remove(&m);
            let _ = self.edge.machines[m].handle_link_down(now, code);
            let mut sink = VecDeque::new();
            self.edge.run(m, now, &mut sink);
        }
        p.client.handle_link_down(now, CloseCode::GoingAway);
        p.drop_next = 0;
        p.held_until = None;
    }

    /// Drops the next `n` frames of client `c`'s link, then cuts it.
    pub(crate) fn drop_next(&mut self, c: usize, n: usize) {
        self.peers[c].drop_next = n;
    }

    /// Moves at most `budget` frames along client `c`'s link (both directions, alternating).
    /// Returns how many moved.
    pub(crate) fn step(&mut self, c: usize, budget: usize) -> usize {
        let now = self.now;
        let mut moved = 0;
        while moved < budget {
            // Collect outputs first.
            let p = &mut self.peers[c];
            while let Some(f) = p.client.poll_transmit() {
                p.to_server.push_back(f);
            }
            if let Some(m) = p.conn {
                let mut out = VecDeque::new();
                let closed = self.edge.run(m, now, &mut out);
                let p = &mut self.peers[c];
                p.to_client.extend(out);
                if closed {
                    // The server closed: deliver what it sent (incl. CLOSE), then the link is gone.
                    if let Some(m) = p.conn.take() {
                        self.edge.linked.remove(&m);
                    }
                }
            }
            let p = &mut self.peers[c];
            while let Some(e) = p.client.poll_event() {
                p.events.push(e);
            }
            // Over the inbound limit the edge does not read the link until the tokens return
            // (B2): nothing later overtakes the held frame.
            let readable = p.held_until.is_none_or(|t| now >= t);
            let next_to_server = if readable {
                p.to_server.pop_front()
            } else {
                None
            };
            let Some((to_server, frame)) = (if let Some(f) = next_to_server {
                Some((true, f))
            } else {
                p.to_client.pop_front().map(|f| (false, f))
            }) else {
                break;
            };
            if to_server && p.drop_next == 0 && p.conn.is_some() {
                if let Some(limiter) = p.limiter.as_mut() {
                    use waygate_backpressure::InboundVerdict;
                    if let InboundVerdict::Wait(wait) = limiter.check(now, frame.encoded_len()) {
                        p.held_until = Some(now + wait.0);
                        p.to_server.push_front(frame);
                        continue;
                    }
                    p.held_until = None;
                }
            }
            moved += 1;
            if p.drop_next > 0 {
                // Lost in flight. A reliable transport loses frames only when it dies, so
                // the link is cut after the last of them (or when nothing else is queued).
                p.drop_next -= 1;
                if p.drop_next == 0 || (p.to_server.is_empty() && p.to_client.is_empty()) {
                    self.cut(c);
                }
                continue;
            }
            if to_server {
                if let Some(m) = self.peers[c].conn {
                    let _ = self.edge.machines[m].handle_frame(now, frame);
                    // Like the driver: the machine's actions run before the next input.
                    let mut out = VecDeque::new();
                    let closed = self.edge.run(m, now, &mut out);
                    let p = &mut self.peers[c];
                    p.to_client.extend(out);
                    if closed {
                        if let Some(m) = p.conn.take() {
                            self.edge.linked.remove(&m);
                        }
                    }
                }
            } else {
                let p = &mut self.peers[c];
                match frame {
                    f @ Frame::Close { .. } => {
                        // Through the client's own handling of CLOSE (PROTOCOL.md §7.8).
                        let _ = p.client.handle_frame(now, f);
                        p.to_client.clear();
                        p.to_server.clear();
                    }
                    f => {
                        let _ = p.client.handle_frame(now, f);
                    }
                }
            }
        }
        let p = &mut self.peers[c];
        while let Some(e) = p.client.poll_event() {
            p.events.push(e);
        }
        moved
    }

    /// Runs client `c`'s link until nothing moves.
    pub(crate) fn drive(&mut self, c: usize) {
        while self.step(c, 64) > 0 {}
    }

    /// Runs every link until quiet.
    pub(crate) fn drive_all(&mut self) {
        loop {
            let mut moved = 0;
            for c in 0..self.peers.len() {
                moved += self.step(c, 64);
            }
            if moved == 0 {
                break;
            }
        }
    }

    /// Advances the virtual clock by `d`, firing every timer on the way (in order).
    pub(crate) fn advance(&mut self, d: Duration) {
        // What is in flight now arrives before time passes.
        self.drive_all();
        let end = self.now + d;
        loop {
            let next = self
                .edge
                .machines
                .iter()
                .filter_map(|m| m.poll_timeout())
                .chain(self.peers.iter().filter_map(|p| p.client.poll_timeout()))
                .chain(
                    self.peers
                        .iter()
                        .filter_map(|p| p.held_until.filter(|t| *t > self.now)),
                )
                .filter(|t| *t <= end)
                .min();
            let Some(t) = next else { break };
            self.now = t.max(self.now);
            for i in 0..self.edge.machines.len() {
                if self.edge.machines[i]
                    .poll_timeout()
                    .is_some_and(|d| d <= self.now)
                {
                    self.edge.machines[i].handle_timeout(self.now);
                    if !self.peers.iter().any(|p| p.conn == Some(i)) {
                        let mut sink = VecDeque::new();
                        self.edge.run(i, self.now, &mut sink);
                    }
                }
            }
            for p in &mut self.peers {
                if p.client.poll_timeout().is_some_and(|d| d <= self.now) {
                    p.client.handle_timeout(self.now);
                }
            }
            self.drive_all();
        }
        self.now = end;
        self.drive_all();
    }

    pub(crate) fn session(&self, c: usize) -> SessionId {
        self.peers[c].client.session().expect("session").0
    }

    pub(crate) fn server(&self, c: usize) -> &SessionMachine {
        &self.edge.machines[self.peers[c].conn.expect("conn")]
    }

    /// Payloads of sequenced messages client `c` received, in order.
    pub(crate) fn received(&self, c: usize) -> Vec<(u64, Bytes)> {
        self.peers[c]
            .events
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Message { seq, payload, .. } if *seq > 0 => {
                    Some((*seq, payload.clone()))
                }
                _ => None,
            })
            .collect()
    }

    /// Bindings of the machine holding client `c`'s session.
    pub(crate) fn bindings(&self, c: usize) -> BTreeMap<String, String> {
        self.edge
            .holder(&self.session(c))
            .and_then(|i| self.edge.machines[i].bindings().cloned())
            .unwrap_or_default()
    }
}

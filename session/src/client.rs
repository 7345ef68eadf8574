//! The client side of a session, sans-IO, for the SDK (and the tests' harness).
//!
//! It builds HELLO (auth token, plus the resume part once it has a session), tracks the
//! server seqs it received (cumulative + dedup), acknowledges them (piggybacked on its own
//! DATA, or a standalone ACK after a delay or N messages), keeps every sequenced message it
//! sent until the server acks it, and after a restore resends those above WELCOME's
//! `client_seq_ack`. It sends PING every heartbeat interval without a PING or sequenced
//! DATA sent (frames the edge answers; best-effort DATA and ACKs do not count).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use waygate_protocol::frame::{
    Data, ErrorReport, Hello, ResumeRequest, ResumeToken, SessionId, WelcomeOutcome,
};
use waygate_protocol::wire::{FrameType, PROTOCOL_VERSION};
use waygate_transport::{CloseCode, Frame, TrafficClass};

use crate::seq::{AckPolicy, AckState, Received, RecvWindow};

/// ERROR answers remembered to drop a repeat (more than the server keeps to repeat:
/// `machine::MAX_PENDING_ERRORS`).
const ERRORED_SEQS_KEPT: usize = 1024;

/// Most doublings of the liveness timeout after links it called dead (8x: 8 s by default).
pub const LIVENESS_BACKOFF_MAX: u32 = 3;

/// How long a link must go without the liveness rule firing before the timeout halves
/// again (one step per period, back to [`ClientConfig::liveness`]).
pub const LIVENESS_CALM: Duration = Duration::from_secs(30);

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// When to acknowledge downstream messages.
    pub ack: AckPolicy,
    /// Most unacked upstream messages kept for resending; beyond it `send` refuses. At most
    /// 4,096, the edge's window (a larger value counts as 4,096).
    pub max_unacked: usize,
    /// A connection is dead when something has been outstanding this long with no frame
    /// received: a sequenced message (the edge acks within its ack delay, 20 ms by default)
    /// or a PING (answered at once). Then the session drops the link and resumes
    /// (PROTOCOL.md §7.5). Zero: only the transport's own errors end a connection. Each
    /// link the rule calls dead doubles the timeout for the next ones (at most
    /// [`LIVENESS_BACKOFF_MAX`] times); it halves again after every [`LIVENESS_CALM`] of a
    /// link on which it did not fire.
    pub liveness: Duration,
    /// A sequenced message sent while no session is up waits for the next one; when that
    /// session comes up, each such message never sent on any link and older than this is
    /// dropped instead of sent ([`ClientEvent::Expired`]), and the later ones take its seq
    /// (the server never saw them). `None`: no bound (the session's linger bounds it).
    pub max_offline_age: Option<Duration>,
    /// The largest frame this client's transports send (type byte to end). `send` refuses
    /// a message whose DATA frame would exceed it, or the max frame size of the last
    /// WELCOME ([`ClientError::TooLarge`]): sent, it would close the link and come back
    /// with every resume.
    pub max_frame_size: usize,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            ack: AckPolicy::default(),
            max_unacked: 4096,
            liveness: Duration::from_secs(1),
            max_offline_age: None,
            max_frame_size: waygate_protocol::wire::DEFAULT_MAX_FRAME_SIZE,
        }
    }
}

/// Where the client is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientState {
    /// Not connected (initially, and after a link drop: reconnect with `connect`).
    Disconnected,
    /// HELLO sent, waiting for WELCOME or REJECT.
    Handshaking,
    /// WELCOME received.
    Active,
    /// The session ended for good (kicked, expired, banned, a backend's KICK: any CLOSE
    /// after WELCOME whose code does not keep the session, PROTOCOL.md §7.8; or a terminal
    /// refusal); do not reconnect.
    Closed,
}

/// Something the application should know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// WELCOME: new session, restored, restored with gap (resync!), or restore failed.
    Welcomed {
        /// The session id.
        session_id: SessionId,
        /// How the HELLO was answered.
        outcome: WelcomeOutcome,
    },
    /// A downstream message (each sequenced one exactly once).
    Message {
        /// Traffic class.
        class: TrafficClass,
        /// Application message id.
        msg_id: u32,
        /// Server seq (0 for best-effort).
        seq: u64,
        /// Body.
        payload: Bytes,
    },
    /// The server refused the HELLO, or the connection before it (KCP BUSY:
    /// [`ClientSession::handle_refused`]).
    Rejected {
        /// Why.
        code: CloseCode,
        /// Retry hint in milliseconds.
        retry_after_ms: u32,
        /// Nothing can log in or resume any more (a refused token with no session to
        /// resume, a ban (`auth_rejected`) even with one, an unsupported version; a BUSY
        /// auth refusal from every endpoint with no session): stop. Otherwise connect again
        /// after the hint.
        terminal: bool,
    },
    /// The link dropped (the session may still be resumed unless the code says otherwise).
    Disconnected {
        /// The close code (from the server, or the local transport error's code).
        code: CloseCode,
    },
    /// The server asks the client to reconnect elsewhere and resume.
    Migrate {
        /// Target address, or empty for any edge.
        target: String,
        /// Deadline in milliseconds.
        deadline_ms: u32,
    },
    /// One upstream message was not delivered.
    Error(ErrorReport),
    /// A message queued while no session was up waited longer than
    /// [`ClientConfig::max_offline_age`], or its DATA frame is above the max frame size the
    /// session's WELCOME announced: it was dropped, never sent. The messages queued after
    /// it moved down one seq each.
    Expired {
        /// Its message id.
        msg_id: u32,
        /// The seq [`ClientSession::send`] returned for it.
        seq: u64,
        /// How long it had waited.
        age: Duration,
    },
}

/// A client-side protocol violation or misuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server sent a frame not allowed in this state.
    #[error("unexpected {frame:?} frame in state {state:?}")]
    UnexpectedFrame {
        /// State.
        state: ClientState,
        /// Frame type.
        frame: FrameType,
    },
    /// A downstream seq of 0 or too far ahead.
    #[error("server seq {0} out of window")]
    SeqOutOfWindow(u64),
    /// The server acknowledged a seq this client never sent (PROTOCOL.md §7.4.2): a
    /// protocol error, answered like [`ClientError::SeqOutOfWindow`].
    #[error("ack {0} beyond the highest seq sent")]
    AckBeyondSent(u64),
    /// The unacked upstream buffer is full.
    #[error("upstream send buffer full ({0} unacked messages)")]
    SendBufferFull(usize),
    /// The message's DATA frame would exceed the max frame size: not sent, no seq taken.
    #[error("a frame of {size} bytes is above the max frame size {max}")]
    TooLarge {
        /// The frame's size (type byte to end).
        size: usize,
        /// The max frame size in force.
        max: usize,
    },
    /// The call is not valid in this state.
    #[error("{input} is not valid in state {state:?}")]
    InvalidState {
        /// State.
        state: ClientState,
        /// The call.
        input: &'static str,
    },
}

/// The encoded size of a DATA frame carrying `payload` as `seq`, with the largest ack it
/// could carry when resent.
fn data_frame_len(class: TrafficClass, msg_id: u32, seq: u64, payload: &Bytes) -> usize {
    Frame::Data(Data {
        class,
        msg_id,
        seq,
        ack: Some(u64::MAX),
        payload: payload.clone(),
    })
    .encoded_len()
}

#[derive(Debug, Clone)]
struct Unacked {
    seq: u64,
    class: TrafficClass,
    msg_id: u32,
    payload: Bytes,
    /// When `send` took it.
    queued_at: Instant,
    /// Handed to a link at least once (the server may have it): never expired.
    sent: bool,
}

/// Round-trip time statistics (C2), from the client's PINGs answered by PONG.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RttStats {
    /// The latest sample.
    pub latest: Option<std::time::Duration>,
    /// Smoothed RTT (RFC 6298 weights: 7/8 old, 1/8 new).
    pub smoothed: Option<std::time::Duration>,
    /// The smallest sample seen.
    pub min: Option<std::time::Duration>,
    /// Number of samples.
    pub samples: u64,
}

impl RttStats {
    fn sample(&mut self, rtt: std::time::Duration) {
        self.latest = Some(rtt);
        self.min = Some(self.min.map_or(rtt, |m| m.min(rtt)));
        self.smoothed = Some(match self.smoothed {
            Some(s) => (s * 7 + rtt) / 8,
            None => rtt,
        });
        self.samples += 1;
    }
}

/// The client side of a session. See the module docs.
#[derive(Debug)]
pub struct ClientSession {
    config: ClientConfig,
    token: Bytes,
    /// Bumped by every `set_token`; `attempt_token` is its value when the current attempt
    /// took the token: a refusal of that attempt drops the token only if no fresh one has
    /// been set since.
    token_epoch: u64,
    attempt_token: u64,
    state: ClientState,
    session: Option<(SessionId, ResumeToken)>,
    /// The nonce of the last resume attempt for the current session (PROTOCOL.md §7.3.1).
    resume_nonce: u64,
    down: RecvWindow,
    down_ack: AckState,
    next_up_seq: u64,
    unacked: VecDeque<Unacked>,
    /// Client seqs already answered by an ERROR (the latest [`ERRORED_SEQS_KEPT`]).
    errored: std::collections::BTreeSet<u64>,
    heartbeat: Option<Duration>,
    /// The max frame size of the last WELCOME (0: none yet).
    server_max_frame: usize,
    last_tx: Option<Instant>,
    /// Since when something has been outstanding with no frame received (liveness).
    waiting_since: Option<Instant>,
    /// Origin of PING timestamps (milliseconds since the first connect).
    epoch: Option<Instant>,
    transmit: VecDeque<Frame>,
    events: VecDeque<ClientEvent>,
    rtt: RttStats,
    /// Doublings of the liveness timeout in force (links called dead lately).
    liveness_backoff: u32,
    /// Since when the liveness rule has not fired on the current link (set at WELCOME and
    /// at each step down of the backoff).
    calm_since: Option<Instant>,
    /// A WELCOME was ever taken: a later new session replaces one (its messages are void),
    /// never the first (whose messages queued before it go out).
    had_session: bool,
}

impl ClientSession {
    /// A client that logs in with `token` (from the login service).
    pub fn new(token: Bytes, config: ClientConfig) -> Self {
        Self {
            config,
            token,
            token_epoch: 0,
            attempt_token: 0,
            state: ClientState::Disconnected,
            session: None,
            resume_nonce: 0,
            down: RecvWindow::new(),
            down_ack: AckState::default(),
            next_up_seq: 1,
            unacked: VecDeque::new(),
            errored: std::collections::BTreeSet::new(),
            heartbeat: None,
            server_max_frame: 0,
            last_tx: None,
            waiting_since: None,
            epoch: None,
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            rtt: RttStats::default(),
            liveness_backoff: 0,
            calm_since: None,
            had_session: false,
        }
    }

    /// The liveness timeout in force: [`ClientConfig::liveness`], doubled for each recent
    /// link the rule called dead (an overloaded edge, or a stalled client, meets a calmer
    /// reconnect wave instead of one that grows with every round; PROTOCOL.md §7.5).
    pub fn liveness_timeout(&self) -> Duration {
        self.config.liveness * (1u32 << self.liveness_backoff)
    }

    /// Halves the liveness timeout after [`LIVENESS_CALM`] of the link without it firing.
    fn calm_down(&mut self, now: Instant) {
        if self.liveness_backoff == 0 || self.state != ClientState::Active {
            return;
        }
        if let Some(since) = self.calm_since {
            if now.saturating_duration_since(since) >= LIVENESS_CALM {
                self.liveness_backoff -= 1;
                self.calm_since = Some(now);
            }
        }
    }

    /// Round-trip statistics from PING/PONG.
    pub fn rtt(&self) -> RttStats {
        self.rtt
    }

    /// Current state.
    pub fn state(&self) -> ClientState {
        self.state
    }

    /// The session id and current resume token, once welcomed.
    pub fn session(&self) -> Option<(SessionId, ResumeToken)> {
        self.session
    }

    /// The auth token HELLO carries (empty once dropped as expired).
    pub fn token(&self) -> &Bytes {
        &self.token
    }

    /// Replaces the auth token (e.g. refreshed from the login service).
    pub fn set_token(&mut self, token: Bytes) {
        self.token = token;
        self.token_epoch += 1;
    }

    /// The token an attempt that starts now sends before HELLO (a sealed KCP CONNECT's):
    /// a refusal of that attempt ([`handle_refused`](Self::handle_refused)) drops this
    /// token, never one set after it.
    pub fn token_for_attempt(&mut self) -> Bytes {
        self.attempt_token = self.token_epoch;
        self.token.clone()
    }

    /// Drops the token an attempt was refused for (resume alone next), unless a fresh one
    /// was set since that attempt took it.
    fn drop_refused_token(&mut self) {
        if self.attempt_token == self.token_epoch {
            self.token = Bytes::new();
        }
    }

    /// Forgets the session: the next `connect` logs in fresh.
    pub fn forget_session(&mut self) {
        self.session = None;
    }

    /// Highest server seq received with nothing missing below it.
    pub fn last_server_seq(&self) -> u64 {
        self.down.cumulative()
    }

    /// Upstream messages sent but not yet acked by the server.
    pub fn unacked_len(&self) -> usize {
        self.unacked.len()
    }

    /// A new link is up: queues HELLO (with resume when there is a session).
    pub fn connect(&mut self, now: Instant) -> Result<(), ClientError> {
        if !matches!(self.state, ClientState::Disconnected) {
            return Err(self.invalid("connect"));
        }
        // The resume token never leaves the client: a proof of holding it, over a nonce
        // above every earlier attempt's, so a captured HELLO cannot be replayed.
        let resume = match self.session {
            Some((session_id, resume_token)) => {
                self.resume_nonce += 1;
                Some(ResumeRequest::proving(
                    session_id,
                    &resume_token,
                    self.down.cumulative(),
                    self.resume_nonce,
                ))
            }
            None => None,
        };
        self.attempt_token = self.token_epoch;
        self.push(
            now,
            Frame::Hello(Hello {
                version: PROTOCOL_VERSION,
                token: self.token.clone(),
                resume,
            }),
        );
        self.state = ClientState::Handshaking;
        Ok(())
    }

    fn invalid(&self, input: &'static str) -> ClientError {
        ClientError::InvalidState {
            state: self.state,
            input,
        }
    }

    fn push(&mut self, now: Instant, frame: Frame) {
        let expects_answer = match &frame {
            Frame::Data(d) => d.seq > 0,
            Frame::Ping { .. } => true,
            _ => false,
        };
        if expects_answer {
            // The heartbeat counts only frames the edge answers: a client sending nothing
            // but best-effort DATA and ACKs still PINGs, or it would never learn its link
            // died (PROTOCOL.md §7.5).
            self.last_tx = Some(now);
        }
        if expects_answer && self.state == ClientState::Active && self.waiting_since.is_none() {
            self.waiting_since = Some(now);
        }
        self.transmit.push_back(frame);
    }

    /// When the liveness rule declares the link dead (`None`: nothing outstanding).
    fn dead_at(&self) -> Option<Instant> {
        if self.state != ClientState::Active || self.config.liveness.is_zero() {
            return None;
        }
        self.waiting_since.map(|t| t + self.liveness_timeout())
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.transmit.pop_front()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// When `handle_timeout` must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state != ClientState::Active {
            return None;
        }
        let ping = match (self.heartbeat, self.last_tx) {
            (Some(h), Some(t)) if !h.is_zero() => Some(t + h),
            _ => None,
        };
        [ping, self.down_ack.deadline(), self.dead_at()]
            .into_iter()
            .flatten()
            .min()
    }

    /// The caller is not reading the link now (its own backlog of events is full): what
    /// may be waiting on the link cannot count against it, so the liveness rule's wait
    /// starts again from `now` (PROTOCOL.md §7.5: the SDKs read what is waiting before they
    /// call a link dead). Call it each time a timer fires while reading is held.
    pub fn not_reading(&mut self, now: Instant) {
        if self.waiting_since.is_some() {
            self.waiting_since = Some(now);
        }
    }

    /// Timers: delayed ack, heartbeat, and liveness (a dead link goes down here: the
    /// session turns `Disconnected` with `idle_timeout`; drop the connection and resume).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state != ClientState::Active {
            return;
        }
        if self.dead_at().is_some_and(|t| now >= t) {
            self.liveness_backoff = (self.liveness_backoff + 1).min(LIVENESS_BACKOFF_MAX);
            self.calm_since = None;
            self.handle_link_down(now, CloseCode::IdleTimeout);
            return;
        }
        self.calm_down(now);
        if self.down_ack.due(now, &self.config.ack) {
            self.send_ack(now);
        }
        if let (Some(h), Some(t)) = (self.heartbeat, self.last_tx) {
            if !h.is_zero() && now >= t + h {
                let epoch = *self.epoch.get_or_insert(now);
                let ts = u64::try_from(now.duration_since(epoch).as_millis()).unwrap_or(0);
                self.push(now, Frame::Ping { timestamp: ts });
            }
        }
    }

    fn send_ack(&mut self, now: Instant) {
        let cum = self.down.cumulative();
        self.down_ack.on_sent(cum);
        self.push(now, Frame::Ack { ack: cum });
    }

    /// Sends an application message. Sequenced messages are kept until acked (and queued
    /// for after the reconnect when not connected); best-effort is sent only when active.
    /// Returns the client seq (0 for best-effort) or `None` when a best-effort message was
    /// dropped.
    pub fn send(
        &mut self,
        now: Instant,
        class: TrafficClass,
        msg_id: u32,
        payload: Bytes,
    ) -> Result<Option<u64>, ClientError> {
        if self.state == ClientState::Closed {
            return Err(self.invalid("send"));
        }
        self.check_fits(class, msg_id, &payload)?;
        let active = self.state == ClientState::Active;
        if !class.is_sequenced() {
            if !active {
                return Ok(None);
            }
            let ack = self.piggyback();
            self.push(
                now,
                Frame::Data(Data {
                    class,
                    msg_id,
                    seq: 0,
                    ack,
                    payload,
                }),
            );
            return Ok(Some(0));
        }
        // Never beyond the edge's window (PROTOCOL.md §7.4.1): a seq past it closes the link.
        let most = self
            .config
            .max_unacked
            .min(usize::try_from(crate::seq::DEFAULT_RECV_WINDOW).unwrap_or(usize::MAX));
        if self.unacked.len() >= most {
            return Err(ClientError::SendBufferFull(self.unacked.len()));
        }
        let seq = self.next_up_seq;
        self.next_up_seq += 1;
        self.unacked.push_back(Unacked {
            seq,
            class,
            msg_id,
            payload: payload.clone(),
            queued_at: now,
            sent: active,
        });
        if active {
            let ack = self.piggyback();
            self.push(
                now,
                Frame::Data(Data {
                    class,
                    msg_id,
                    seq,
                    ack,
                    payload,
                }),
            );
        }
        Ok(Some(seq))
    }

    /// The max frame size in force: the client's own, and the last WELCOME's.
    pub fn max_frame_size(&self) -> usize {
        match self.server_max_frame {
            0 => self.config.max_frame_size,
            server => self.config.max_frame_size.min(server),
        }
    }

    /// `Err(TooLarge)` when the message's DATA frame (with its seq and the largest ack it
    /// could carry when resent) would exceed the max frame size.
    fn check_fits(
        &self,
        class: TrafficClass,
        msg_id: u32,
        payload: &Bytes,
    ) -> Result<(), ClientError> {
        let seq = if class.is_sequenced() {
            self.next_up_seq
        } else {
            0
        };
        let (size, max) = (
            data_frame_len(class, msg_id, seq, payload),
            self.max_frame_size(),
        );
        if size > max {
            return Err(ClientError::TooLarge { size, max });
        }
        Ok(())
    }

    /// Drops the messages queued while no session was up (never sent: the server has not
    /// seen their seqs) that waited longer than `max_offline_age`, or whose DATA frame is
    /// above the max frame size the WELCOME just announced (checked when sent against the
    /// client's own limit only: sent, it would close the link at every resume), and
    /// renumbers the ones left, so the seqs on the wire stay contiguous. Each dropped one
    /// is reported as [`ClientEvent::Expired`].
    fn expire_offline(&mut self, now: Instant) {
        let Some(first_unsent) = self.unacked.iter().position(|u| !u.sent) else {
            return;
        };
        let max_frame = self.max_frame_size();
        let max_age = self.config.max_offline_age;
        let base = self.unacked[first_unsent].seq;
        let mut expired = 0u64;
        let mut i = first_unsent;
        while let Some(u) = self.unacked.get(i) {
            let age = now.saturating_duration_since(u.queued_at);
            let too_old = max_age.is_some_and(|max| age > max);
            let too_large = data_frame_len(u.class, u.msg_id, u.seq, &u.payload) > max_frame;
            if !(too_old || too_large) {
                i += 1;
                continue;
            }
            self.events.push_back(ClientEvent::Expired {
                msg_id: u.msg_id,
                seq: u.seq,
                age,
            });
            self.unacked.remove(i);
            expired += 1;
        }
        if expired == 0 {
            return;
        }
        for (i, u) in self.unacked.iter_mut().skip(first_unsent).enumerate() {
            u.seq = base + i as u64;
        }
        self.next_up_seq -= expired;
    }

    fn piggyback(&mut self) -> Option<u64> {
        let cum = self.down.cumulative();
        if self.down_ack.pending(cum) {
            self.down_ack.piggyback(cum)
        } else {
            None
        }
    }

    /// An ack from DATA or ACK: refused beyond the highest seq this client assigned.
    fn checked_ack(&mut self, ack: u64) -> Result<(), ClientError> {
        if ack >= self.next_up_seq {
            return Err(ClientError::AckBeyondSent(ack));
        }
        self.on_ack(ack);
        Ok(())
    }

    fn on_ack(&mut self, ack: u64) {
        while self.unacked.front().is_some_and(|u| u.seq <= ack) {
            self.unacked.pop_front();
        }
    }

    /// The link dropped (its transport ended, or the server's CLOSE before WELCOME). The
    /// session is kept (reconnect with `connect`) unless `code` is `kicked` or
    /// `session_expired` (a transport's own close code, PROTOCOL.md §7.8).
    pub fn handle_link_down(&mut self, _now: Instant, code: CloseCode) {
        if self.state == ClientState::Closed {
            return;
        }
        match code {
            CloseCode::Kicked | CloseCode::SessionExpired => self.end_session(code),
            _ => {
                self.state = ClientState::Disconnected;
                self.transmit.clear();
                self.waiting_since = None;
                self.events.push_back(ClientEvent::Disconnected { code });
            }
        }
    }

    /// The server refused the connection before any HELLO (KCP's BUSY, PROTOCOL.md §8.2.6).
    /// `conclusive`: every endpoint tried answered with a refusal (none failed for a reason
    /// that might pass). Then, without a session, this reads as a REJECT with the same
    /// code, so an auth refusal (a sealed CONNECT's token refused, a plain CONNECT to a
    /// listener that requires sealing) ends the client as it would after HELLO instead of
    /// being retried for ever. With a session it never ends it: a sealed listener checks
    /// the token before the resume could be, so the client keeps trying (dropping a token
    /// refused with any auth code but 205, unless a fresh one was set since the attempt took
    /// it) until a fresh token — for sealed KCP with its key, the SDK's `set_credentials` —
    /// is set or its give-up time runs out. Ignored while a link is up.
    pub fn handle_refused(
        &mut self,
        _now: Instant,
        code: CloseCode,
        retry_after_ms: u32,
        conclusive: bool,
    ) {
        if !matches!(
            self.state,
            ClientState::Disconnected | ClientState::Handshaking
        ) {
            return;
        }
        let may_end = self.session.is_none() && conclusive;
        self.rejected(code, retry_after_ms, may_end);
    }

    /// Whether a refusal with `code` is of the token alone, which a resume without it may
    /// pass: every auth code but `auth_rejected` (a ban).
    fn token_refusal_resumable(code: CloseCode) -> bool {
        code.to_u16() / 100 == 2 && code != CloseCode::AuthRejected
    }

    /// A REJECT (or a refusal before HELLO) with `code`: terminal for auth and version
    /// refusals, except a refused token while the session can still be resumed.
    /// `may_end`: the refusal may end the client (a REJECT; a refusal before HELLO only
    /// as [`handle_refused`](Self::handle_refused) says).
    fn rejected(&mut self, code: CloseCode, retry_after_ms: u32, may_end: bool) {
        if code == CloseCode::ResumeRejected {
            self.session = None;
        }
        // A refused token (expired, or signed with a key since rotated) never ends a session
        // that can still be resumed: the token is dropped and the next HELLO resumes with
        // the resume token alone (PROTOCOL.md §7.1.1; `set_token` gives a fresh one for a
        // new login). A ban (`auth_rejected`) ends it: the edge checks bans on a resume too.
        let resumable = self.session.is_some() && Self::token_refusal_resumable(code);
        if resumable {
            self.drop_refused_token();
        }
        // Every 2xx is an auth refusal, a code this build does not know included
        // (PROTOCOL.md §1.1: unknown codes are treated like their class).
        let terminal = may_end
            && !resumable
            && (code.to_u16() / 100 == 2 || code == CloseCode::UnsupportedVersion);
        self.state = ClientState::Disconnected;
        self.transmit.clear();
        self.events.push_back(ClientEvent::Rejected {
            code,
            retry_after_ms,
            terminal,
        });
    }

    /// The server closed the link with `code`: its CLOSE frame, or the code QUIC's
    /// application close or KCP's RESET carries (the same code). After WELCOME the code
    /// alone says whether the session lingers (PROTOCOL.md §7.8): any code but those that
    /// keep it means the session ended, and nothing is resumed.
    pub fn handle_peer_close(&mut self, now: Instant, code: CloseCode) {
        if self.state == ClientState::Active && !code.keeps_session() {
            self.end_session(code);
        } else {
            self.handle_link_down(now, code);
        }
    }

    /// The session ended on the server's side (kicked, expired, banned, a backend's KICK):
    /// nothing is resumed; the state is terminal.
    fn end_session(&mut self, code: CloseCode) {
        self.session = None;
        self.state = ClientState::Closed;
        self.transmit.clear();
        self.waiting_since = None;
        self.events.push_back(ClientEvent::Disconnected { code });
    }

    /// A frame arrived from the server.
    pub fn handle_frame(&mut self, now: Instant, frame: Frame) -> Result<(), ClientError> {
        let r = self.on_frame(now, frame);
        self.calm_down(now);
        // Any frame proves the link alive; what is still unacked is outstanding from now.
        self.waiting_since =
            (self.state == ClientState::Active && !self.unacked.is_empty()).then_some(now);
        r
    }

    fn on_frame(&mut self, now: Instant, frame: Frame) -> Result<(), ClientError> {
        let unexpected = |state, f: &Frame| ClientError::UnexpectedFrame {
            state,
            frame: f.frame_type(),
        };
        match (self.state, frame) {
            (ClientState::Handshaking, Frame::Welcome(w)) => {
                // Not "no session now": a session forgotten after REJECT 300 (or by
                // `forget_session`) that never received server DATA is still replaced.
                let first = !self.had_session;
                self.had_session = true;
                if self.session.map(|(id, _)| id) != Some(w.session_id) {
                    // Nonces count per session.
                    self.resume_nonce = 0;
                }
                self.session = Some((w.session_id, w.resume_token));
                self.heartbeat = Some(Duration::from_millis(w.heartbeat_interval_ms.into()));
                // The heartbeat interval runs from the WELCOME.
                self.last_tx = Some(now);
                self.server_max_frame = usize::try_from(w.max_frame_size).unwrap_or(usize::MAX);
                // Events of this WELCOME (expiries) follow the Welcomed event.
                let welcome_events_at = self.events.len();
                match w.outcome {
                    // The very first session: messages queued before it (seqs from 1) go out.
                    WelcomeOutcome::NewSession if first => self.expire_offline(now),
                    WelcomeOutcome::NewSession | WelcomeOutcome::RestoreFailedNewSession => {
                        // A fresh session replacing an old one: seqs restart; the old
                        // session's unsent messages are void (the application resyncs).
                        self.down = RecvWindow::new();
                        self.next_up_seq = 1;
                        self.unacked.clear();
                        self.errored.clear();
                    }
                    WelcomeOutcome::Restored | WelcomeOutcome::RestoredWithGap => {
                        self.down.skip_to(w.server_seq_base);
                        self.on_ack(w.client_seq_ack);
                        self.expire_offline(now);
                    }
                }
                self.state = ClientState::Active;
                self.calm_since = Some(now);
                // Confirms the WELCOME (and so the new resume token) at once.
                self.send_ack(now);
                self.events.insert(
                    welcome_events_at,
                    ClientEvent::Welcomed {
                        session_id: w.session_id,
                        outcome: w.outcome,
                    },
                );
                for u in &mut self.unacked {
                    u.sent = true;
                }
                let resend: Vec<Unacked> = self.unacked.iter().cloned().collect();
                for u in resend {
                    self.push(
                        now,
                        Frame::Data(Data {
                            class: u.class,
                            msg_id: u.msg_id,
                            seq: u.seq,
                            ack: None,
                            payload: u.payload,
                        }),
                    );
                }
                Ok(())
            }
            (ClientState::Handshaking, Frame::Reject(r)) => {
                self.rejected(r.code, r.retry_after_ms, true);
                Ok(())
            }
            (ClientState::Active, Frame::Data(d)) => {
                if let Some(ack) = d.ack {
                    self.checked_ack(ack)?;
                }
                if d.class.is_sequenced() {
                    match self.down.receive(d.seq) {
                        Received::OutOfWindow => return Err(ClientError::SeqOutOfWindow(d.seq)),
                        Received::Duplicate => {
                            if self.down_ack.on_receive(now, &self.config.ack) {
                                self.send_ack(now);
                            }
                            return Ok(());
                        }
                        Received::New => {
                            if self.down_ack.on_receive(now, &self.config.ack) {
                                self.send_ack(now);
                            }
                        }
                    }
                }
                self.events.push_back(ClientEvent::Message {
                    class: d.class,
                    msg_id: d.msg_id,
                    seq: d.seq,
                    payload: d.payload,
                });
                Ok(())
            }
            (ClientState::Active, Frame::Ack { ack }) => self.checked_ack(ack),
            (ClientState::Active | ClientState::Handshaking, Frame::Ping { timestamp }) => {
                self.push(now, Frame::Pong { timestamp });
                Ok(())
            }
            (ClientState::Active | ClientState::Handshaking, Frame::Pong { timestamp }) => {
                if let Some(epoch) = self.epoch {
                    let sent = epoch + std::time::Duration::from_millis(timestamp);
                    if now >= sent {
                        self.rtt.sample(now - sent);
                    }
                }
                Ok(())
            }
            (ClientState::Active, Frame::Migrate(m)) => {
                self.session = Some((m.session_id, m.resume_token));
                self.events.push_back(ClientEvent::Migrate {
                    target: m.target,
                    deadline_ms: m.deadline_ms,
                });
                Ok(())
            }
            (ClientState::Active, Frame::Error(e)) => {
                // The server sends an ERROR again after a resume when it cannot know the
                // first one arrived (PROTOCOL.md §3.9): one answer per message. Every
                // best-effort refusal carries client_seq 0 and is sent once: each reported.
                if e.client_seq == 0 || self.errored.insert(e.client_seq) {
                    if self.errored.len() > ERRORED_SEQS_KEPT {
                        self.errored.pop_first();
                    }
                    self.events.push_back(ClientEvent::Error(e));
                }
                Ok(())
            }
            (_, Frame::Close { code, .. }) => {
                self.handle_peer_close(now, code);
                Ok(())
            }
            (state, f) => Err(unexpected(state, &f)),
        }
    }
}

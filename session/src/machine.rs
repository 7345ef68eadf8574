//! The server side of one session, sans-IO (SPEC S1, S3–S6).
//!
//! One [`SessionMachine`] runs per *connection*. It starts DISCONNECTED, goes HANDSHAKING
//! when the link is up, and after the HELLO either builds a fresh [`SessionCore`] or takes
//! one over from a snapshot (restore). The core — ids, seqs, replay buffer, upstream dedup,
//! bindings, fencing token — is what crosses connections: when the link drops the machine
//! goes DETACHED and persists a [`Snapshot`]; a later connection's machine takes that
//! snapshot (by resume-token hash) and the old machine ends as CLOSED (superseded) or, if
//! nobody comes back within the linger time, EXPIRED.
//!
//! Shape (quinn-proto style): inputs are `handle_*(now, ..)` calls; outputs are drained with
//! [`SessionMachine::poll_action`]; the next timer is [`SessionMachine::poll_timeout`].
//! Work that needs I/O (verifying a token, taking a snapshot from the store, claiming
//! ownership) is requested with an [`Action`] and its result fed back with
//! `handle_auth_result`, `handle_snapshot` and `handle_claimed`.
//!
//! ```text
//! DISCONNECTED -link up-> HANDSHAKING -HELLO(token)-> AUTHENTICATING -ok-> AUTHENTICATED
//!                              |                            `-bad-> REJECTED -> CLOSED
//!                              `-HELLO(resume only)-> RESTORING
//! AUTHENTICATED -(HELLO had resume)-> RESTORING -taken-> (claim) -> ACTIVE [restored | gap]
//!                                         `-failed, token ok-> AUTHENTICATED -> ACTIVE [restore failed, new]
//!                                         `-failed, resume only-> REJECTED -> CLOSED
//! AUTHENTICATED -(no resume)-> (claim) -> ACTIVE [new session]
//! ACTIVE -link down / idle-> DETACHED -linger elapsed-> EXPIRED
//! ACTIVE | DETACHED -kicked / resumed elsewhere / closed by server-> CLOSED
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use waygate_protocol::channel::{
    ChannelEvent, ChannelEventKind, ChannelPosition, CHANNEL_EVENT_MSG_ID,
};
use waygate_protocol::frame::{
    edge_message, Data, ErrorReport, Hello, Migrate, Reject, ResumeRequest, ResumeToken, SessionId,
    Welcome, WelcomeOutcome,
};
use waygate_protocol::wire::{FrameType, PROTOCOL_VERSION};
use waygate_transport::{CloseCode, Frame, TrafficClass};

use crate::auth::{AuthError, AuthedPlayer};
use crate::counters::SessionCounters;
use crate::replay::{AckBeyondSent, ReplayBuffer, ReplayLimits};
use crate::resume::{hex_id, new_resume_token, new_session_id, ResumeHash};
use crate::rng::SessionRng;
use crate::seq::{AckPolicy, AckState, Received, RecvWindow};
use crate::store::{
    ClaimGrant, PendingError, Snapshot, StoreError, TakeOutcome, MAX_PUSH_IDS, SNAPSHOT_VERSION,
};
use waygate_protocol::resume_proof::{resume_key, resume_proof, ResumeProof};

/// ERROR answers a detached session keeps for its client (see
/// [`SessionMachine::report_error`]).
pub const MAX_PENDING_ERRORS: usize = 256;

/// Session-layer settings of one edge.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Time from link up to a finished handshake (WELCOME sent).
    pub handshake_timeout: Duration,
    /// Close the connection (and detach) after this long without receiving anything.
    pub idle_timeout: Duration,
    /// PING interval advertised to the client in WELCOME.
    pub heartbeat_interval: Duration,
    /// How long a detached session is kept for resume (S5).
    pub linger: Duration,
    /// Largest frame advertised in WELCOME.
    pub max_frame_size: u32,
    /// Replay buffer bounds.
    pub replay: ReplayLimits,
    /// When to acknowledge upstream messages.
    pub ack: AckPolicy,
    /// While a client's message waits for its answer, an ACK at least this often (its
    /// value may not move): a client judges its link dead after 1 s without a frame while
    /// something is unacknowledged (PROTOCOL.md §7.5), and a backend may take longer than
    /// that to answer.
    pub answer_keepalive: Duration,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(10),
            linger: Duration::from_secs(15 * 60),
            max_frame_size: waygate_protocol::wire::DEFAULT_MAX_FRAME_SIZE as u32,
            replay: ReplayLimits::default(),
            ack: AckPolicy::default(),
            answer_keepalive: Duration::from_millis(500),
        }
    }
}

/// States of [`SessionMachine`] (S1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// No link yet.
    Disconnected,
    /// Link up, waiting for HELLO.
    Handshaking,
    /// HELLO carried an auth token; waiting for the authenticator.
    Authenticating,
    /// The player is known; a fresh session is being established (ownership claim).
    Authenticated,
    /// The HELLO was refused (passes on to CLOSED at once).
    Rejected,
    /// Taking the snapshot of the session to resume, then claiming ownership.
    Restoring,
    /// WELCOME sent; messages flow.
    Active,
    /// The link dropped; the session lingers for resume.
    Detached,
    /// Ended; see [`SessionMachine::end_reason`].
    Closed,
    /// The linger time ran out.
    Expired,
}

impl State {
    /// Every state.
    pub const ALL: [State; 10] = [
        Self::Disconnected,
        Self::Handshaking,
        Self::Authenticating,
        Self::Authenticated,
        Self::Rejected,
        Self::Restoring,
        Self::Active,
        Self::Detached,
        Self::Closed,
        Self::Expired,
    ];

    /// Stable label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disconnected => "disconnected",
            Self::Handshaking => "handshaking",
            Self::Authenticating => "authenticating",
            Self::Authenticated => "authenticated",
            Self::Rejected => "rejected",
            Self::Restoring => "restoring",
            Self::Active => "active",
            Self::Detached => "detached",
            Self::Closed => "closed",
            Self::Expired => "expired",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Whether the machine will never do anything again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Closed | Self::Expired)
    }
}

/// Why a machine ended (CLOSED or EXPIRED).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndReason {
    /// The HELLO was refused with this code.
    Rejected(CloseCode),
    /// The handshake did not complete (timeout, protocol error, link lost).
    HandshakeFailed(CloseCode),
    /// A newer login of the same player took over.
    Kicked,
    /// The session was resumed on another connection.
    Superseded,
    /// The edge ended the session (admin, shutdown, logout).
    ClosedByServer(CloseCode),
    /// Nobody resumed it within the linger time.
    LingerExpired,
    /// The client logged out (CLOSE `logout`): ended at once, no linger.
    LoggedOut,
}

/// A delivered upstream message, for the router.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// The session it came from.
    pub session_id: SessionId,
    /// Its player.
    pub player_id: Arc<str>,
    /// Traffic class.
    pub class: TrafficClass,
    /// Application message id (routing key for layer 1).
    pub msg_id: u32,
    /// Client seq (0 for best-effort).
    pub seq: u64,
    /// Body.
    pub payload: Bytes,
}

/// A session that ended for good: release its ownership and bindings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionEnd {
    /// The session.
    pub session_id: SessionId,
    /// Its player.
    pub player_id: Arc<str>,
    /// Its fencing token: release ownership / delete the snapshot only with it.
    pub fencing: u64,
    /// Bindings to unbind if the release succeeds.
    pub bindings: BTreeMap<String, String>,
    /// Why.
    pub reason: EndReason,
    /// The channels it was a member of, at the last position its client acknowledged
    /// (PROTOCOL.md §12.4: a kind with backlog resumes a later login from there).
    pub channels_acked: BTreeMap<String, ChannelPosition>,
}

/// What a snapshot lookup found, for answering a failed restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RestoreLookup {
    /// The named session exists (taken or refused).
    Exists,
    /// No such session.
    NotFound,
    /// The store could not say.
    StoreDown,
}

/// What a resuming connection presents: its proof of holding the resume token (over the
/// session id, the last server seq it received and a nonce), and the player of its auth
/// token when the HELLO carried one. A live local holder of the session checks all of it in
/// [`SessionMachine::hand_over`] before it lets go, so a resume that would fail leaves the
/// session untouched (PROTOCOL.md §7.1.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeAttempt {
    /// HMAC proof of possession of the resume token (PROTOCOL.md §7.3.1).
    pub proof: ResumeProof,
    /// The nonce the proof covers: accepted only above the session's last accepted one.
    pub nonce: u64,
    /// The highest server seq the client says it received.
    pub last_server_seq: u64,
    /// The player of the HELLO's valid auth token (`None`: a resume-only HELLO).
    pub player_id: Option<Arc<str>>,
}

impl ResumeAttempt {
    /// The attempt of a HELLO's resume part.
    pub fn of(resume: &ResumeRequest, player_id: Option<Arc<str>>) -> Self {
        Self {
            proof: resume.proof,
            nonce: resume.nonce,
            last_server_seq: resume.last_server_seq,
            player_id,
        }
    }

    /// An attempt by a client holding `token` for `session_id`, having received nothing,
    /// with `nonce` (tests and simulations: what a client computes).
    pub fn proving(token: &ResumeToken, session_id: &SessionId, nonce: u64) -> Self {
        let key = resume_key(token);
        Self {
            proof: resume_proof(&key, session_id, 0, nonce),
            nonce,
            last_server_seq: 0,
            player_id: None,
        }
    }

    /// The key (current, else the unconfirmed previous one) this attempt proves possession
    /// of for `session_id`, if its nonce is above `last_nonce`; `None` otherwise.
    pub fn key_used(
        &self,
        session_id: &SessionId,
        current: &ResumeHash,
        previous: Option<&ResumeHash>,
        last_nonce: u64,
    ) -> Option<ResumeHash> {
        if self.nonce <= last_nonce {
            return None;
        }
        let proves =
            |h: &ResumeHash| h.proves(session_id, self.last_server_seq, self.nonce, &self.proof);
        if proves(current) {
            return Some(*current);
        }
        previous.filter(|p| proves(p)).copied()
    }
}

/// What the driver must do next.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Action {
    /// Send this frame on the connection.
    Send(Frame),
    /// Close the connection with this code (sends CLOSE). The session may live on.
    Close {
        /// Close code.
        code: CloseCode,
        /// Detail for the CLOSE frame.
        message: String,
    },
    /// Verify this auth token, then call [`SessionMachine::handle_auth_result`].
    Authenticate {
        /// The HELLO's token.
        token: Bytes,
    },
    /// Take the snapshot of `session_id` if its resume hash matches (from a live local
    /// session via [`SessionMachine::hand_over`], else the store), then call
    /// [`SessionMachine::handle_snapshot`].
    TakeSnapshot {
        /// The session to resume.
        session_id: SessionId,
        /// What the resuming connection presents (checked by a live local holder before it
        /// lets go).
        attempt: ResumeAttempt,
    },
    /// A resume without an auth token restored `player_id`'s session: ask the
    /// authenticator whether the player may still have one (bans, revocations), then call
    /// [`SessionMachine::handle_allowed`].
    CheckAllowed {
        /// The restored session's player.
        player_id: Arc<str>,
    },
    /// A snapshot was taken but cannot be used here: put it back unchanged.
    PutBack(Box<Snapshot>),
    /// Claim ownership of the player for this session (kicking any previous owner and
    /// collecting its bindings), then call [`SessionMachine::handle_claimed`].
    Claim {
        /// The player.
        player_id: Arc<str>,
        /// This session.
        session_id: SessionId,
    },
    /// The session is ACTIVE on this connection: register it.
    Established {
        /// The session.
        session_id: SessionId,
        /// Its player.
        player_id: Arc<str>,
        /// Fencing token of this ownership.
        fencing: u64,
        /// How the HELLO was answered.
        outcome: WelcomeOutcome,
    },
    /// The session holds these bindings now (restored or taken over): tell the router.
    Bind(BTreeMap<String, String>),
    /// The session holds these routing keys now (restored with it): route its messages
    /// by them (service -> business key, from backends' BIND).
    RoutingKeys(BTreeMap<String, String>),
    /// The session was restored as a member of these channels, at these positions: make it
    /// a member here again (recovering from the position, or HISTORY_LOST).
    Channels(BTreeMap<String, ChannelPosition>),
    /// Route an upstream message.
    Deliver(Upstream),
    /// Store this snapshot for the linger time (the link dropped).
    Persist(Box<Snapshot>),
    /// The session ended for good (linger expired, closed by the server).
    Ended(SessionEnd),
}

/// Moves a channel's acknowledged position for one acknowledged channel event.
fn acked_channel_event(
    acked: &mut BTreeMap<String, ChannelPosition>,
    entry: &crate::replay::ReplayEntry,
) {
    if entry.msg_id == CHANNEL_EVENT_MSG_ID {
        follow_channel_event(acked, &entry.payload);
    }
}

/// Follows one channel event in `positions` (queued or acknowledged ones): a marker or
/// publication moves its channel's position, LEFT removes it, best-effort (offset 0) moves
/// nothing. Reads the header in place: no allocation for a channel already known (this runs
/// for every event of every member).
fn follow_channel_event(positions: &mut BTreeMap<String, ChannelPosition>, payload: &[u8]) {
    if let Some(e) = ChannelEvent::peek(payload) {
        follow_peeked_channel_event(positions, &e);
    }
}

/// [`follow_channel_event`] of an event whose header was read.
fn follow_peeked_channel_event(
    positions: &mut BTreeMap<String, ChannelPosition>,
    e: &waygate_protocol::channel::ChannelEventHeader<'_>,
) {
    match e.kind {
        ChannelEventKind::Left => {
            positions.remove(e.channel);
        }
        ChannelEventKind::Publication if e.position.offset == 0 => {}
        _ => match positions.get_mut(e.channel) {
            Some(p) => *p = e.position,
            None => {
                positions.insert(e.channel.to_owned(), e.position);
            }
        },
    }
}

/// An input that is not valid in the machine's state. Peer faults are also answered on the
/// wire (REJECT/CLOSE) before being returned; local misuse changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    /// The peer sent a frame not allowed in this state (peer's fault; connection closed).
    #[error("unexpected {frame:?} frame in state {state:?}")]
    UnexpectedFrame {
        /// The state.
        state: State,
        /// The frame's type.
        frame: FrameType,
    },
    /// The peer's HELLO carried an unsupported protocol version (peer's fault).
    #[error("unsupported protocol version {0}")]
    UnsupportedVersion(u8),
    /// A sequenced DATA frame had seq 0 or one far beyond the window (peer's fault).
    #[error("sequence number {0} out of window")]
    SeqOutOfWindow(u64),
    /// The peer acked a seq the server never sent (peer's fault).
    #[error(transparent)]
    AckBeyondSent(#[from] AckBeyondSent),
    /// The caller fed an input the state does not expect (local misuse; nothing changed).
    #[error("{input} is not valid in state {state:?}")]
    InvalidTransition {
        /// The state.
        state: State,
        /// The input.
        input: &'static str,
    },
}

/// Where an ERROR answer is on its way to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrorDelivery {
    /// Waiting for the client's resume (sent after its WELCOME).
    Waiting,
    /// Sent on the live link; known to have arrived once the client acknowledges the
    /// critical DATA with seq `fence` sent after it (`None`: none sent yet).
    Sent { fence: Option<u64> },
}

/// The per-session state that survives connections (see the module docs).
#[derive(Debug, Clone)]
pub struct SessionCore {
    id: SessionId,
    player_id: Arc<str>,
    fencing: u64,
    resume_hash: ResumeHash,
    prev_resume_hash: Option<ResumeHash>,
    /// The nonce of the last resume accepted (a proof is accepted only above it).
    last_resume_nonce: u64,
    bindings: BTreeMap<String, String>,
    /// Routing keys bound by backends (service -> business key).
    keys: BTreeMap<String, String>,
    /// Channel memberships and the last position queued for each (PROTOCOL.md §12).
    channels: BTreeMap<String, ChannelPosition>,
    /// Memberships a backend ended whose LEFT has not been queued yet (their last
    /// publications still come): followed like `channels`, but not in the snapshot — a
    /// restore elsewhere does not join them again.
    leaving: BTreeMap<String, ChannelPosition>,
    /// The last position of each channel the client acknowledged (what a departed member
    /// is known to have; PROTOCOL.md §12.4 backlog).
    channels_acked: BTreeMap<String, ChannelPosition>,
    /// ERROR answers the client may not have: waiting for its resume (it was away when
    /// they came, or its link died), or sent on the current link and not yet known to have
    /// arrived. Resent after every resume's WELCOME until known to have arrived; the client
    /// drops a second answer for the same seq.
    errors: Vec<(PendingError, ErrorDelivery)>,
    replay: ReplayBuffer,
    /// Upstream seqs answered (the acked state; see [`Snapshot::upstream`]).
    upstream: RecvWindow,
    /// Upstream seqs delivered, not answered yet (see [`Snapshot::awaiting`]).
    awaiting: BTreeSet<u64>,
    /// The ids of the session's last pushes with an id (see [`Snapshot::push_ids`]).
    push_ids: Vec<u64>,
}

impl SessionCore {
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            version: SNAPSHOT_VERSION,
            session_id: self.id,
            player_id: self.player_id.to_string(),
            fencing: self.fencing,
            resume_hash: self.resume_hash,
            prev_resume_hash: self.prev_resume_hash,
            last_resume_nonce: self.last_resume_nonce,
            bindings: self.bindings.clone(),
            replay: self.replay.clone(),
            upstream: self.upstream.clone(),
            awaiting: self.awaiting.clone(),
            keys: self.keys.clone(),
            channels: self.channels.clone(),
            channels_acked: self.channels_acked.clone(),
            pending_errors: self.errors.iter().map(|(e, _)| *e).collect(),
            push_ids: self.push_ids.clone(),
        }
    }

    /// Applies a cumulative ack to the replay buffer, moving the acknowledged position of
    /// every channel whose events it frees.
    fn ack_replay(&mut self, ack: u64) -> Result<usize, crate::replay::AckBeyondSent> {
        let Self {
            replay,
            channels_acked,
            ..
        } = self;
        let freed = replay.ack_visit(ack, |e| acked_channel_event(channels_acked, e))?;
        // An ERROR sent before a critical DATA the client now acknowledges has arrived: the
        // two travel in order (one stream on every transport, PROTOCOL.md §2.2).
        self.errors
            .retain(|(_, d)| !matches!(d, ErrorDelivery::Sent { fence: Some(f) } if *f <= ack));
        Ok(freed)
    }

    /// Moves a delivered upstream seq to the answered ones; whether it was awaiting.
    fn answer(&mut self, client_seq: u64) -> bool {
        let awaiting = self.awaiting.remove(&client_seq);
        if awaiting {
            self.upstream.receive(client_seq);
        }
        awaiting
    }

    /// Upstream seqs delivered and not answered yet.
    pub fn awaiting(&self) -> &BTreeSet<u64> {
        &self.awaiting
    }

    /// Records an ERROR answer: sent on the live link (`sent`), or waiting for the resume.
    /// At most [`MAX_PENDING_ERRORS`] are kept; past that the oldest goes: one waiting for
    /// a resume becomes a declared downstream gap (the resume reports `RestoredWithGap`),
    /// one sent on the live link is assumed to have arrived.
    fn record_error(&mut self, error: PendingError, sent: bool) {
        if self.errors.len() >= MAX_PENDING_ERRORS {
            let (_, delivery) = self.errors.remove(0);
            if delivery == ErrorDelivery::Waiting {
                self.replay.declare_lost(1);
            }
        }
        let delivery = if sent {
            ErrorDelivery::Sent { fence: None }
        } else {
            ErrorDelivery::Waiting
        };
        self.errors.push((error, delivery));
    }

    /// ERROR answers kept because the client may not have them.
    #[cfg(test)]
    pub(crate) fn errors_kept(&self) -> usize {
        self.errors.len()
    }

    /// A critical DATA with `seq` goes out on the live link: the ERRORs sent before it are
    /// known to have arrived once the client acknowledges it.
    fn fence_errors(&mut self, seq: u64) {
        for (_, d) in &mut self.errors {
            if *d == (ErrorDelivery::Sent { fence: None }) {
                *d = ErrorDelivery::Sent { fence: Some(seq) };
            }
        }
    }

    /// The restore point of a client that received up to `client_last` (also an ack).
    fn restore_point(
        &mut self,
        client_last: u64,
    ) -> Result<crate::replay::RestorePoint, crate::replay::AckBeyondSent> {
        let Self {
            replay,
            channels_acked,
            ..
        } = self;
        replay.restore_point_visit(client_last, |e| acked_channel_event(channels_acked, e))
    }

    /// The acknowledged positions of the channels the session is a member of.
    fn acked_memberships(&self) -> BTreeMap<String, ChannelPosition> {
        self.channels_acked
            .iter()
            .filter(|(c, _)| self.channels.contains_key(*c))
            .map(|(c, p)| (c.clone(), *p))
            .collect()
    }

    /// Follows the channel events queued to the client: a marker or publication moves the
    /// channel's position, LEFT ends the membership.
    fn track_channel_event(&mut self, payload: &Bytes) {
        let Some(e) = ChannelEvent::peek(payload) else {
            return;
        };
        let positions = if self.leaving.contains_key(e.channel) {
            &mut self.leaving
        } else if e.kind == ChannelEventKind::Publication && !self.channels.contains_key(e.channel)
        {
            // Not a member (a join makes it one before its first event, `track_membership`):
            // the last publications of a channel it left, which a hand-over to another
            // connection forgot it was leaving. They make it no member again.
            return;
        } else {
            &mut self.channels
        };
        follow_peeked_channel_event(positions, &e);
    }

    /// A backend's join (`Some`: the position the member starts from) or leave (`None`) of
    /// `channel` was taken, before its events reach the session: the membership is in the
    /// snapshot from now on (a channel already followed keeps its own position; one being
    /// left is a member again), or leaves it.
    fn track_membership(&mut self, channel: &str, joined: Option<ChannelPosition>) {
        match joined {
            Some(position) => {
                if !self.channels.contains_key(channel) {
                    let p = self.leaving.remove(channel).unwrap_or(position);
                    self.channels.insert(channel.to_owned(), p);
                }
            }
            None => {
                if let Some(p) = self.channels.remove(channel) {
                    self.leaving.insert(channel.to_owned(), p);
                }
            }
        }
    }

    fn from_snapshot(mut s: Snapshot) -> Self {
        // At most the last MAX_PENDING_ERRORS, whatever a store handed back (a corrupt or
        // foreign record would otherwise have them all re-sent after WELCOME); the ones
        // dropped are a declared gap, as when `record_error` drops a waiting one.
        let excess = s.pending_errors.len().saturating_sub(MAX_PENDING_ERRORS);
        if excess > 0 {
            s.pending_errors.drain(..excess);
            s.replay.declare_lost(excess as u64);
        }
        Self {
            id: s.session_id,
            player_id: s.player_id.into(),
            fencing: s.fencing,
            resume_hash: s.resume_hash,
            prev_resume_hash: s.prev_resume_hash,
            last_resume_nonce: s.last_resume_nonce,
            bindings: s.bindings,
            replay: s.replay,
            upstream: s.upstream,
            awaiting: s.awaiting,
            keys: s.keys,
            channels: s.channels,
            leaving: BTreeMap::new(),
            channels_acked: s.channels_acked,
            errors: s
                .pending_errors
                .into_iter()
                .map(|e| (e, ErrorDelivery::Waiting))
                .collect(),
            // At most the last MAX_PUSH_IDS, whatever a store handed back.
            push_ids: {
                let mut ids = s.push_ids;
                ids.drain(..ids.len().saturating_sub(MAX_PUSH_IDS));
                ids
            },
        }
    }

    /// The session id.
    pub fn id(&self) -> &SessionId {
        &self.id
    }

    /// The replay buffer.
    pub fn replay(&self) -> &ReplayBuffer {
        &self.replay
    }

    /// Upstream receive window.
    pub fn upstream(&self) -> &RecvWindow {
        &self.upstream
    }
}

/// What is being established between HELLO and WELCOME.
#[derive(Debug, Clone, Default)]
struct Pending {
    resume: Option<ResumeRequest>,
    authed: Option<AuthedPlayer>,
    /// Restore point when a snapshot was taken.
    restore: Option<(WelcomeOutcome, u64)>,
    /// Set when a resume was asked and failed (answer is RestoreFailedNewSession).
    restore_failed: bool,
    /// A fresh resume token to send in WELCOME.
    resume_token: Option<[u8; 16]>,
    /// The snapshot as taken, to put back unchanged if the handshake fails after it.
    taken: Option<Box<Snapshot>>,
    /// The edge takes no new session now ([`SessionMachine::refuse_new_sessions`]): a
    /// HELLO without a resume request is answered REJECT `overloaded` with this retry-after.
    refuse_new: Option<Duration>,
}

/// [`Pending`], allocated only while a handshake is under way: an established session
/// carries a pointer, not the handshake's state (performance issue, W4). Reads of an empty
/// slot see the default.
#[derive(Debug, Clone, Default)]
struct PendingSlot(Option<Box<Pending>>);

impl std::ops::Deref for PendingSlot {
    type Target = Pending;
    fn deref(&self) -> &Pending {
        static EMPTY: std::sync::OnceLock<Pending> = std::sync::OnceLock::new();
        self.0
            .as_deref()
            .unwrap_or_else(|| EMPTY.get_or_init(Pending::default))
    }
}

impl std::ops::DerefMut for PendingSlot {
    fn deref_mut(&mut self) -> &mut Pending {
        self.0.get_or_insert_with(Box::default)
    }
}

/// The server side of one session on one connection. See the module docs.
pub struct SessionMachine {
    /// Shared by every session of the edge (one allocation, not one per session).
    config: Arc<SessionConfig>,
    counters: Arc<SessionCounters>,
    rng: Box<dyn SessionRng>,
    state: State,
    end: Option<EndReason>,
    core: Option<SessionCore>,
    pending: PendingSlot,
    handshake_deadline: Option<Instant>,
    last_rx: Option<Instant>,
    /// When the idle timeout is checked next: set on ACTIVE and moved only when it fires
    /// (to `last_rx + idle_timeout`), so a frame received never re-arms a timer.
    idle_check: Option<Instant>,
    linger_deadline: Option<Instant>,
    up_ack: AckState,
    /// When the answer keep-alive is checked next ([`SessionConfig::answer_keepalive`]):
    /// set when a client's message starts waiting for its answer and moved only when it
    /// fires (to `answer_activity + answer_keepalive`), like `idle_check`, so the messages
    /// and answers in between do not move the session's timer; `None` while none waits.
    answer_keepalive: Option<Instant>,
    /// The last client message taken or answered (each owes the client a frame within the
    /// ack delay), or the last keep-alive ACK.
    answer_activity: Option<Instant>,
    actions: VecDeque<Action>,
    /// Set by [`SessionMachine::quiesce`]: sequenced upstream DATA is no longer taken.
    quiesced: bool,
}

impl std::fmt::Debug for SessionMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionMachine")
            .field("state", &self.state)
            .field("session", &self.core.as_ref().map(|c| hex_id(&c.id)))
            .field("end", &self.end)
            .finish_non_exhaustive()
    }
}

fn err_unexpected(state: State, frame: &Frame) -> SessionError {
    SessionError::UnexpectedFrame {
        state,
        frame: frame.frame_type(),
    }
}

impl SessionMachine {
    /// A machine in DISCONNECTED.
    pub fn new(
        config: impl Into<Arc<SessionConfig>>,
        counters: Arc<SessionCounters>,
        rng: Box<dyn SessionRng>,
    ) -> Self {
        Self {
            config: config.into(),
            counters,
            rng,
            state: State::Disconnected,
            end: None,
            core: None,
            pending: PendingSlot::default(),
            handshake_deadline: None,
            last_rx: None,
            idle_check: None,
            linger_deadline: None,
            up_ack: AckState::default(),
            answer_keepalive: None,
            answer_activity: None,
            actions: VecDeque::new(),
            quiesced: false,
        }
    }

    /// Current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Why the machine ended (set in CLOSED and EXPIRED).
    pub fn end_reason(&self) -> Option<&EndReason> {
        self.end.as_ref()
    }

    /// The session core once established.
    pub fn core(&self) -> Option<&SessionCore> {
        self.core.as_ref()
    }

    /// The session id once known.
    pub fn session_id(&self) -> Option<SessionId> {
        self.core.as_ref().map(|c| c.id)
    }

    /// The player id once known.
    pub fn player_id(&self) -> Option<Arc<str>> {
        self.core.as_ref().map(|c| c.player_id.clone())
    }

    /// The fencing token of the current ownership (0 before the claim).
    pub fn fencing(&self) -> u64 {
        self.core.as_ref().map_or(0, |c| c.fencing)
    }

    /// The session's bindings.
    pub fn bindings(&self) -> Option<&BTreeMap<String, String>> {
        self.core.as_ref().map(|c| &c.bindings)
    }

    /// The config.
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Whether an action waits for [`SessionMachine::poll_action`].
    pub fn has_actions(&self) -> bool {
        !self.actions.is_empty()
    }

    /// The next action for the driver.
    pub fn poll_action(&mut self) -> Option<Action> {
        let action = self.actions.pop_front();
        if self.actions.is_empty() {
            // Drained: an idle session holds no buffer (performance issue, W4).
            self.actions = VecDeque::new();
        }
        action
    }

    /// When [`SessionMachine::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Handshaking
            | State::Authenticating
            | State::Authenticated
            | State::Restoring => self.handshake_deadline,
            State::Active => [
                self.idle_check,
                self.up_ack.deadline(),
                self.answer_keepalive,
            ]
            .into_iter()
            .flatten()
            .min(),
            State::Detached => self.linger_deadline,
            _ => None,
        }
    }

    fn transition(&mut self, to: State) {
        let from = self.state;
        self.state = to;
        self.counters.transition(from, to);
        let session = self
            .core
            .as_ref()
            .map(|c| hex_id(&c.id))
            .unwrap_or_default();
        let player = self
            .core
            .as_ref()
            .map(|c| c.player_id.to_string())
            .or_else(|| {
                self.pending
                    .authed
                    .as_ref()
                    .map(|a| a.claims.player_id.clone())
            })
            .unwrap_or_default();
        // O2: reconnects, rejections, drops and expiries always at info; the normal path
        // (handshake -> active) at debug, so a login storm does not flood the log.
        if matches!(
            to,
            State::Restoring | State::Rejected | State::Detached | State::Expired
        ) {
            tracing::info!(
                session = %session,
                player = %player,
                from = from.as_str(),
                to = to.as_str(),
                "session transition"
            );
        } else {
            tracing::debug!(
                session = %session,
                player = %player,
                from = from.as_str(),
                to = to.as_str(),
                "session transition"
            );
        }
    }

    fn end_with(&mut self, to: State, reason: EndReason) {
        self.end = Some(reason);
        self.transition(to);
    }

    /// An established session ends for good: the driver is told (`Ended`, with the
    /// bindings the session still holds, its acknowledged channel positions) so it releases
    /// ownership, the stored copy and the router entry; then the machine stops.
    fn end_session(&mut self, to: State, reason: EndReason) {
        if let Some(core) = &self.core {
            self.actions.push_back(Action::Ended(SessionEnd {
                session_id: core.id,
                player_id: core.player_id.clone(),
                fencing: core.fencing,
                bindings: core.bindings.clone(),
                reason: reason.clone(),
                channels_acked: core.acked_memberships(),
            }));
        }
        self.end_with(to, reason);
    }

    /// The transport finished its handshake: DISCONNECTED -> HANDSHAKING.
    pub fn handle_link_up(&mut self, now: Instant) -> Result<(), SessionError> {
        self.handle_link_up_since(now, now)
    }

    /// [`handle_link_up`](Self::handle_link_up) for a connection accepted at `accepted_at`
    /// (before its TLS, upgrade or QUIC handshake): the handshake deadline counts from
    /// there, so the time from accept to WELCOME is bounded once, whatever each phase took.
    pub fn handle_link_up_since(
        &mut self,
        now: Instant,
        accepted_at: Instant,
    ) -> Result<(), SessionError> {
        if self.state != State::Disconnected {
            return Err(self.misuse("link up"));
        }
        self.handshake_deadline = Some(accepted_at.min(now) + self.config.handshake_timeout);
        self.last_rx = Some(now);
        self.transition(State::Handshaking);
        Ok(())
    }

    fn misuse(&self, input: &'static str) -> SessionError {
        SessionError::InvalidTransition {
            state: self.state,
            input,
        }
    }

    /// The edge is taking no new session now (its overload level, B5): a HELLO that comes
    /// without a resume request is refused `overloaded` with `retry_after`; a resume (and a
    /// new session after a resume that failed) goes on. Call before the HELLO is handled.
    pub fn refuse_new_sessions(&mut self, retry_after: Duration) {
        self.pending.refuse_new = Some(retry_after);
    }

    fn reject(&mut self, code: CloseCode, message: String) {
        let retry_after = if code == CloseCode::Unavailable {
            Duration::from_secs(1)
        } else {
            Duration::ZERO
        };
        self.reject_after(code, message, retry_after);
    }

    fn reject_after(&mut self, code: CloseCode, message: String, retry_after: Duration) {
        match code {
            CloseCode::AuthMalformed
            | CloseCode::AuthBadSignature
            | CloseCode::AuthExpired
            | CloseCode::AuthUnknownKey
            | CloseCode::AuthUnsupportedVersion
            | CloseCode::AuthRejected => SessionCounters::bump(&self.counters.rejected_auth),
            CloseCode::ResumeRejected => SessionCounters::bump(&self.counters.rejected_resume),
            _ => SessionCounters::bump(&self.counters.rejected_other),
        }
        let retry_after_ms = u32::try_from(retry_after.as_millis()).unwrap_or(u32::MAX);
        // The edge's own messages are cut like a CLOSE's (§1.3), so the REJECT fits its
        // 1,024-byte field whatever the token it quotes, and the CLOSE after it carries the
        // same message.
        let message = edge_message(&message);
        self.actions.push_back(Action::Send(Frame::Reject(Reject {
            code,
            retry_after_ms,
            message: message.clone(),
        })));
        self.actions.push_back(Action::Close { code, message });
        self.transition(State::Rejected);
        self.end_with(State::Closed, EndReason::Rejected(code));
    }

    fn fail_handshake(&mut self, code: CloseCode, message: &str) {
        self.actions.push_back(Action::Close {
            code,
            message: message.to_owned(),
        });
        self.end_with(State::Closed, EndReason::HandshakeFailed(code));
    }

    /// A frame arrived from the client.
    pub fn handle_frame(&mut self, now: Instant, frame: Frame) -> Result<(), SessionError> {
        if matches!(self.state, State::Disconnected | State::Detached) || self.state.is_terminal() {
            return Err(self.misuse("frame"));
        }
        self.last_rx = Some(now);
        if let Frame::Ping { timestamp } = frame {
            // After WELCOME a PING, like any frame, proves the client holds the new resume
            // token (PROTOCOL.md §7.3.3): the previous one is spent.
            if self.state == State::Active {
                if let Some(core) = self.core.as_mut() {
                    core.prev_resume_hash = None;
                }
            }
            self.actions
                .push_back(Action::Send(Frame::Pong { timestamp }));
            return Ok(());
        }
        match self.state {
            State::Handshaking => match frame {
                Frame::Hello(hello) => self.on_hello(hello),
                other => {
                    let e = err_unexpected(self.state, &other);
                    SessionCounters::bump(&self.counters.protocol_errors);
                    self.fail_handshake(CloseCode::UnexpectedFrame, "expected HELLO");
                    Err(e)
                }
            },
            State::Authenticating | State::Authenticated | State::Restoring => {
                // The client must wait for WELCOME. PONGs are harmless.
                if matches!(frame, Frame::Pong { .. }) {
                    return Ok(());
                }
                let e = err_unexpected(self.state, &frame);
                SessionCounters::bump(&self.counters.protocol_errors);
                self.abort_handshake(CloseCode::UnexpectedFrame, "frame before WELCOME");
                Err(e)
            }
            State::Active => self.on_active_frame(now, frame),
            _ => Err(self.misuse("frame")),
        }
    }

    /// Ends a handshake that may hold a taken snapshot (put it back first).
    fn abort_handshake(&mut self, code: CloseCode, message: &str) {
        self.put_back_taken();
        self.fail_handshake(code, message);
    }

    /// Returns a snapshot taken for this handshake to the store, unchanged.
    fn put_back_taken(&mut self) {
        // Through the slot's box, so a machine with no handshake state allocates none.
        if let Some(taken) = self.pending.0.as_mut().and_then(|p| p.taken.take()) {
            self.core = None;
            self.actions.push_back(Action::PutBack(taken));
        }
    }

    fn on_hello(&mut self, hello: Hello) -> Result<(), SessionError> {
        if hello.version != PROTOCOL_VERSION {
            self.reject(
                CloseCode::UnsupportedVersion,
                format!("protocol version {} not supported", hello.version),
            );
            return Err(SessionError::UnsupportedVersion(hello.version));
        }
        if hello.resume.is_none() {
            if let Some(retry_after) = self.pending.refuse_new.take() {
                self.reject_after(
                    CloseCode::Overloaded,
                    "overloaded: no new session now (a resume is taken)".into(),
                    retry_after,
                );
                return Ok(());
            }
        }
        self.pending.resume = hello.resume;
        if !hello.token.is_empty() {
            self.actions
                .push_back(Action::Authenticate { token: hello.token });
            self.transition(State::Authenticating);
        } else if let Some(resume) = self.pending.resume.clone() {
            // Resume-only HELLO: the resume token is the credential.
            self.start_restore(&resume);
        } else {
            self.reject(
                CloseCode::AuthMalformed,
                "HELLO without token or resume".into(),
            );
        }
        Ok(())
    }

    fn start_restore(&mut self, resume: &ResumeRequest) {
        let player_id = self
            .pending
            .authed
            .as_ref()
            .map(|a| Arc::<str>::from(a.claims.player_id.as_str()));
        self.actions.push_back(Action::TakeSnapshot {
            session_id: resume.session_id,
            attempt: ResumeAttempt::of(resume, player_id),
        });
        self.transition(State::Restoring);
    }

    /// The authenticator answered (after [`Action::Authenticate`]).
    pub fn handle_auth_result(
        &mut self,
        _now: Instant,
        result: Result<AuthedPlayer, AuthError>,
    ) -> Result<(), SessionError> {
        if self.state != State::Authenticating {
            return Err(self.misuse("auth result"));
        }
        match result {
            Err(e) => {
                tracing::info!(error = %e, "auth rejected");
                self.reject(e.close_code(), e.to_string());
            }
            Ok(player) => {
                self.pending.authed = Some(player);
                self.transition(State::Authenticated);
                if let Some(resume) = self.pending.resume.clone() {
                    self.start_restore(&resume);
                } else {
                    self.new_core_and_claim();
                }
            }
        }
        Ok(())
    }

    fn new_core_and_claim(&mut self) {
        let Some(authed) = &self.pending.authed else {
            return;
        };
        let player_id: Arc<str> = authed.claims.player_id.as_str().into();
        let id = new_session_id(self.rng.as_mut(), &player_id);
        let (token, hash) = new_resume_token(self.rng.as_mut());
        self.pending.resume_token = Some(token);
        self.core = Some(SessionCore {
            id,
            player_id: player_id.clone(),
            fencing: 0,
            resume_hash: hash,
            prev_resume_hash: None,
            last_resume_nonce: 0,
            bindings: BTreeMap::new(),
            replay: ReplayBuffer::new(self.config.replay),
            upstream: RecvWindow::new(),
            awaiting: BTreeSet::new(),
            keys: BTreeMap::new(),
            channels: BTreeMap::new(),
            leaving: BTreeMap::new(),
            channels_acked: BTreeMap::new(),
            errors: Vec::new(),
            push_ids: Vec::new(),
        });
        self.actions.push_back(Action::Claim {
            player_id,
            session_id: id,
        });
    }

    /// The session to resume lives on this edge but could not be handed over now (after
    /// [`Action::TakeSnapshot`]; `host::ResumeFromStore::Busy`): another resume of it is
    /// under way, or its holder did not answer in time. Refused `unavailable` with a
    /// retry-after, with or without an auth token — the session is left as it was (a fresh
    /// session would take the player from it, and the store's copy may be older than it).
    pub fn handle_hand_over_busy(&mut self, _now: Instant) -> Result<(), SessionError> {
        if self.state != State::Restoring || self.core.is_some() {
            return Err(self.misuse("hand-over busy"));
        }
        tracing::info!("resume refused: the session is busy on this edge (a hand-over under way or not answered in time)");
        self.reject(
            CloseCode::Unavailable,
            "session busy on this edge (being handed over); resume again".into(),
        );
        Ok(())
    }

    /// The snapshot lookup answered (after [`Action::TakeSnapshot`]).
    pub fn handle_snapshot(
        &mut self,
        _now: Instant,
        result: Result<TakeOutcome, StoreError>,
    ) -> Result<(), SessionError> {
        if self.state != State::Restoring || self.core.is_some() {
            if let Ok(TakeOutcome::Taken(s)) = result {
                // Never lose a taken snapshot, even on misuse.
                self.actions.push_back(Action::PutBack(s));
            }
            return Err(self.misuse("snapshot"));
        }
        let Some(resume) = self.pending.resume.clone() else {
            return Err(self.misuse("snapshot"));
        };
        let result_kind = match &result {
            Ok(TakeOutcome::NotFound) => RestoreLookup::NotFound,
            Err(_) => RestoreLookup::StoreDown,
            Ok(_) => RestoreLookup::Exists,
        };
        let failure = match result {
            Ok(TakeOutcome::Taken(snapshot)) => {
                let foreign_player = self
                    .pending
                    .authed
                    .as_ref()
                    .is_some_and(|a| a.claims.player_id != snapshot.player_id);
                let key_used = (snapshot.session_id == resume.session_id)
                    .then(|| snapshot.key_used(&ResumeAttempt::of(&resume, None)))
                    .flatten();
                let used = match (foreign_player, key_used) {
                    (false, Some(used)) => Some(used),
                    _ => None,
                };
                if let Some(used) = used {
                    let original = snapshot.clone();
                    let mut core = SessionCore::from_snapshot(*snapshot);
                    match core.restore_point(resume.last_server_seq) {
                        Err(_) => {
                            self.actions.push_back(Action::PutBack(original));
                            "last_server_seq beyond what the server sent"
                        }
                        Ok(point) => {
                            // Rotate. The presented token stays valid until the client
                            // confirms the new one (any frame after WELCOME).
                            let (token, hash) = new_resume_token(self.rng.as_mut());
                            core.resume_hash = hash;
                            core.prev_resume_hash = Some(used);
                            // This proof (and any with a lower nonce) is spent.
                            core.last_resume_nonce = resume.nonce;
                            self.pending.resume_token = Some(token);
                            let outcome = if point.gap {
                                WelcomeOutcome::RestoredWithGap
                            } else {
                                WelcomeOutcome::Restored
                            };
                            self.pending.restore = Some((outcome, point.base));
                            self.pending.taken = Some(original);
                            // A token was checked with the HELLO; without one, the player
                            // is checked now (a ban also stops resumes).
                            self.actions.push_back(if self.pending.authed.is_some() {
                                Action::Claim {
                                    player_id: core.player_id.clone(),
                                    session_id: core.id,
                                }
                            } else {
                                Action::CheckAllowed {
                                    player_id: core.player_id.clone(),
                                }
                            });
                            self.core = Some(core);
                            return Ok(());
                        }
                    }
                } else {
                    self.actions.push_back(Action::PutBack(snapshot));
                    "resume proof does not match the session, its player or a fresh nonce"
                }
            }
            Ok(TakeOutcome::Mismatch) => "resume proof does not match",
            Ok(TakeOutcome::NotFound) => "no such session (expired, used or unknown)",
            Err(e) => {
                // The store could not say whether the named session exists (down, or slow
                // past its timeout under load): refused with a retry-after, with or without
                // an auth token. A fresh session would take the player from that session if
                // it lives on (single login) and lose what it held, acknowledged replies
                // included; found by the channels-at-scale overload run.
                tracing::warn!(error = %e, "snapshot store failed during restore");
                self.reject(CloseCode::Unavailable, "session store unavailable".into());
                return Ok(());
            }
        };
        tracing::info!(session = %hex_id(&resume.session_id), why = failure, "restore failed");
        let session_exists = result_kind == RestoreLookup::Exists;
        if session_exists {
            // The named session exists and the resume part failed (a wrong or replayed
            // proof, another player's session, a seq it never sent): refused whatever the
            // auth token, and the session is left as it was — a captured resume HELLO
            // must not end it by falling back to a new login (PROTOCOL.md §7.1.1).
            self.reject(CloseCode::ResumeRejected, failure.into());
        } else if self.pending.authed.is_some() {
            // Restore failed, but the HELLO's auth token is valid: a fresh session.
            self.pending.restore_failed = true;
            self.transition(State::Authenticated);
            self.new_core_and_claim();
        } else {
            self.reject(CloseCode::ResumeRejected, failure.into());
        }
        Ok(())
    }

    /// The authenticator's answer to [`Action::CheckAllowed`]: the restore goes on to the
    /// claim, or is refused with the authenticator's code (the snapshot goes back
    /// unchanged).
    pub fn handle_allowed(
        &mut self,
        _now: Instant,
        result: Result<(), AuthError>,
    ) -> Result<(), SessionError> {
        if self.state != State::Restoring || self.pending.taken.is_none() {
            return Err(self.misuse("allowed"));
        }
        let Some(core) = self.core.as_ref() else {
            return Err(self.misuse("allowed"));
        };
        match result {
            Ok(()) => {
                self.actions.push_back(Action::Claim {
                    player_id: core.player_id.clone(),
                    session_id: core.id,
                });
            }
            Err(e) => {
                tracing::info!(player = %core.player_id, error = %e, "resume refused by the authenticator");
                self.put_back_taken();
                self.reject(e.close_code(), e.to_string());
            }
        }
        Ok(())
    }

    /// Ownership was claimed (after [`Action::Claim`]); `inherited` are the bindings taken
    /// over from a kicked previous session of the player.
    pub fn handle_claimed(
        &mut self,
        now: Instant,
        result: Result<(ClaimGrant, Option<BTreeMap<String, String>>), StoreError>,
    ) -> Result<(), SessionError> {
        let claiming = matches!(self.state, State::Authenticated | State::Restoring);
        if !claiming || self.core.is_none() {
            return Err(self.misuse("claim result"));
        }
        let (grant, inherited) = match result {
            Ok(v) => v,
            Err(e) => {
                // The store is down (or timed out): answer at once with REJECT unavailable
                // and a retry-after hint, so clients back off instead of hanging or
                // retrying at once; a taken snapshot goes back for a later restore.
                tracing::warn!(error = %e, "ownership claim failed");
                self.put_back_taken();
                self.reject(
                    CloseCode::Unavailable,
                    "ownership registry unavailable".into(),
                );
                return Ok(());
            }
        };
        let outcome = match (self.pending.restore, self.pending.restore_failed) {
            (Some((outcome, _)), _) => outcome,
            (None, true) => WelcomeOutcome::RestoreFailedNewSession,
            (None, false) => WelcomeOutcome::NewSession,
        };
        let base = self.pending.restore.map_or(0, |(_, b)| b);
        let Some(core) = self.core.as_mut() else {
            return Err(self.misuse("claim result"));
        };
        core.fencing = grant.fencing;
        if let Some(inherited) = inherited {
            for (service, instance) in inherited {
                core.bindings.entry(service).or_insert(instance);
            }
        }
        let cum = core.upstream.cumulative();
        let welcome = Welcome {
            session_id: core.id,
            resume_token: self.pending.resume_token.unwrap_or_default(),
            outcome,
            heartbeat_interval_ms: duration_ms(self.config.heartbeat_interval),
            idle_timeout_ms: duration_ms(self.config.idle_timeout),
            max_frame_size: self.config.max_frame_size,
            server_seq_base: base,
            client_seq_ack: cum,
        };
        self.actions.push_back(Action::Established {
            session_id: core.id,
            player_id: core.player_id.clone(),
            fencing: core.fencing,
            outcome,
        });
        // Keys first: the edge resolves a carried placement of a key-routed service by the
        // session's key for it.
        if !core.keys.is_empty() {
            self.actions
                .push_back(Action::RoutingKeys(core.keys.clone()));
        }
        if !core.bindings.is_empty() {
            self.actions.push_back(Action::Bind(core.bindings.clone()));
        }
        if !core.channels.is_empty() {
            self.actions
                .push_back(Action::Channels(core.channels.clone()));
        }
        self.actions
            .push_back(Action::Send(Frame::Welcome(welcome)));
        let mut replayed = 0;
        for e in core.replay.entries_after(base) {
            self.actions.push_back(Action::Send(Frame::Data(Data {
                class: e.class,
                msg_id: e.msg_id,
                seq: e.seq,
                ack: None,
                payload: e.payload.clone(),
            })));
            replayed += 1;
        }
        SessionCounters::add(&self.counters.replayed, replayed);
        // Every ERROR answer the client may not have, again: it drops one it already got.
        for (e, delivery) in &mut core.errors {
            *delivery = ErrorDelivery::Sent { fence: None };
            self.actions
                .push_back(Action::Send(Frame::Error(ErrorReport {
                    code: CloseCode::from_u16(e.code),
                    msg_id: e.msg_id,
                    client_seq: e.client_seq,
                    retry_after_ms: e.retry_after_ms,
                })));
        }
        let counter = match outcome {
            WelcomeOutcome::NewSession => &self.counters.new_sessions,
            WelcomeOutcome::Restored => &self.counters.restored,
            WelcomeOutcome::RestoredWithGap => &self.counters.restored_with_gap,
            WelcomeOutcome::RestoreFailedNewSession => &self.counters.restore_failed_new_session,
        };
        SessionCounters::bump(counter);
        self.up_ack.reset(cum);
        self.answer_keepalive = None;
        self.note_answer_activity(now);
        self.handshake_deadline = None;
        self.last_rx = Some(now);
        self.idle_check = Some(now + self.config.idle_timeout);
        self.pending = PendingSlot::default();
        self.transition(State::Active);
        Ok(())
    }

    fn on_active_frame(&mut self, now: Instant, frame: Frame) -> Result<(), SessionError> {
        // Any frame after WELCOME proves the client holds the new resume token.
        if let Some(core) = self.core.as_mut() {
            core.prev_resume_hash = None;
        }
        match frame {
            Frame::Data(d) => {
                if let Some(ack) = d.ack {
                    self.on_ack(now, ack)?;
                }
                let Some(core) = self.core.as_mut() else {
                    return Err(self.misuse("data"));
                };
                if self.quiesced {
                    // Hard migration in progress: neither received nor acked, so the
                    // client keeps a sequenced message and resends it to the edge it moves
                    // to; a best-effort one is dropped (PROTOCOL.md §3.9: it may be lost).
                    SessionCounters::bump(if d.class.is_sequenced() {
                        &self.counters.upstream_duplicates
                    } else {
                        &self.counters.upstream_best_effort_dropped
                    });
                    return Ok(());
                }
                if d.class.is_sequenced() {
                    // Acknowledged once answered ([`SessionMachine::answer_upstream`] or an
                    // ERROR), not on delivery: until then the client keeps it.
                    match core.upstream.check(d.seq) {
                        Received::OutOfWindow => {
                            SessionCounters::bump(&self.counters.protocol_errors);
                            self.link_lost(now, CloseCode::ProtocolError, "seq out of window");
                            return Err(SessionError::SeqOutOfWindow(d.seq));
                        }
                        Received::New if core.awaiting.insert(d.seq) => {}
                        // Answered, or delivered and waiting for its answer.
                        Received::Duplicate | Received::New => {
                            SessionCounters::bump(&self.counters.upstream_duplicates);
                            self.owe_ack(now);
                            return Ok(());
                        }
                    }
                }
                self.actions.push_back(Action::Deliver(Upstream {
                    session_id: core.id,
                    player_id: core.player_id.clone(),
                    class: d.class,
                    msg_id: d.msg_id,
                    seq: d.seq,
                    payload: d.payload,
                }));
                SessionCounters::bump(&self.counters.upstream_delivered);
                if d.class.is_sequenced() {
                    // An ACK within the ack delay even if this message is not answered by
                    // then (carrying what is), and then every `answer_keepalive` until it
                    // is: clients judge the link alive by them (§7.5).
                    self.up_ack.on_receive_unanswered(now, &self.config.ack);
                    self.note_answer_activity(now);
                }
                Ok(())
            }
            Frame::Ack { ack } => self.on_ack(now, ack),
            Frame::Pong { .. } => Ok(()),
            Frame::Close {
                code: CloseCode::Logout,
                ..
            } => {
                self.log_out();
                Ok(())
            }
            Frame::Close { code, .. } => {
                self.link_lost(now, code, "");
                Ok(())
            }
            other => {
                let e = err_unexpected(self.state, &other);
                SessionCounters::bump(&self.counters.protocol_errors);
                self.link_lost(now, CloseCode::UnexpectedFrame, "unexpected frame");
                Err(e)
            }
        }
    }

    fn on_ack(&mut self, now: Instant, ack: u64) -> Result<(), SessionError> {
        let Some(core) = self.core.as_mut() else {
            return Err(self.misuse("ack"));
        };
        if let Err(e) = core.ack_replay(ack) {
            SessionCounters::bump(&self.counters.protocol_errors);
            self.link_lost(now, CloseCode::ProtocolError, "ack beyond sent");
            return Err(e.into());
        }
        Ok(())
    }

    fn owe_ack(&mut self, now: Instant) {
        if self.up_ack.on_receive(now, &self.config.ack) {
            self.send_standalone_ack();
        }
    }

    /// Something was just sent or owed to the client (an ACK within the ack delay of a
    /// message or an answer, a WELCOME): the answer keep-alive counts from `now`, armed
    /// while a client's message waits for its answer and off when none does.
    fn note_answer_activity(&mut self, now: Instant) {
        self.answer_activity = Some(now);
        let waiting = self.core.as_ref().is_some_and(|c| !c.awaiting.is_empty());
        if !waiting {
            self.answer_keepalive = None;
        } else if self.answer_keepalive.is_none() {
            self.answer_keepalive = Some(now + self.config.answer_keepalive);
        }
    }

    /// The answer keep-alive fired: whether an ACK is owed now (a message still waits and
    /// nothing was owed the client for the interval); the check is moved to when one
    /// could be owed next, or off when none waits.
    fn answer_keepalive_due(&mut self, now: Instant) -> bool {
        let waiting = self.core.as_ref().is_some_and(|c| !c.awaiting.is_empty());
        let quiet_since = self.answer_activity.unwrap_or(now);
        let due = waiting && now >= quiet_since + self.config.answer_keepalive;
        if due {
            self.answer_activity = Some(now);
        }
        let from = self.answer_activity.unwrap_or(now);
        self.answer_keepalive = waiting.then(|| from + self.config.answer_keepalive);
        due
    }

    /// A client's message was answered (FORWARD_DONE or an ERROR): acknowledged within the
    /// ack delay, or at once past the count.
    fn on_answered(&mut self, now: Instant) {
        if self.up_ack.on_answer(now, &self.config.ack) {
            self.send_standalone_ack();
        }
        self.note_answer_activity(now);
    }

    fn send_standalone_ack(&mut self) {
        if let Some(core) = &self.core {
            let cum = core.upstream.cumulative();
            self.up_ack.on_sent(cum);
            self.actions
                .push_back(Action::Send(Frame::Ack { ack: cum }));
            SessionCounters::bump(&self.counters.acks_sent);
        }
    }

    /// Closes the connection (if `code` needs a CLOSE sent) and detaches.
    fn link_lost(&mut self, now: Instant, code: CloseCode, message: &str) {
        if !message.is_empty() {
            self.actions.push_back(Action::Close {
                code,
                message: message.to_owned(),
            });
        }
        self.detach(now, code);
    }

    fn detach(&mut self, now: Instant, code: CloseCode) {
        if let Some(core) = &mut self.core {
            // What the dead link may not have delivered waits for the resume.
            for (_, delivery) in &mut core.errors {
                *delivery = ErrorDelivery::Waiting;
            }
            tracing::info!(session = %hex_id(&core.id), reason = %code, "link down, session lingers");
            self.actions
                .push_back(Action::Persist(Box::new(core.snapshot())));
        }
        SessionCounters::bump(&self.counters.detached);
        self.linger_deadline = Some(now + self.config.linger);
        self.transition(State::Detached);
    }

    /// The connection is gone (peer closed, transport error, slow consumer). An ACTIVE
    /// session detaches and lingers — unless the client closed with `logout`: it then
    /// ends; a handshake in progress ends.
    pub fn handle_link_down(&mut self, now: Instant, code: CloseCode) -> Result<(), SessionError> {
        match self.state {
            // The client's CLOSE `logout` (the transports report a peer's CLOSE this way).
            State::Active if code == CloseCode::Logout => {
                self.log_out();
                Ok(())
            }
            State::Active => {
                self.detach(now, code);
                Ok(())
            }
            State::Disconnected
            | State::Handshaking
            | State::Authenticating
            | State::Authenticated
            | State::Restoring => {
                self.put_back_taken();
                self.end_with(State::Closed, EndReason::HandshakeFailed(code));
                Ok(())
            }
            _ => Err(self.misuse("link down")),
        }
    }

    /// Timers: handshake deadline, idle timeout, delayed ack, linger.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.state {
            State::Handshaking
            | State::Authenticating
            | State::Authenticated
            | State::Restoring
                if self.handshake_deadline.is_some_and(|d| now >= d) =>
            {
                self.abort_handshake(CloseCode::HandshakeTimeout, "handshake timed out");
            }
            State::Active => {
                // Fired: armed again while a message waits (off otherwise); its ACK unless
                // one is due anyway.
                if self.answer_keepalive.is_some_and(|d| now >= d)
                    && self.answer_keepalive_due(now)
                    && !self.up_ack.due(now, &self.config.ack)
                {
                    SessionCounters::bump(&self.counters.answer_keepalives);
                    self.send_standalone_ack();
                }
                if self.up_ack.due(now, &self.config.ack) {
                    self.send_standalone_ack();
                }
                if self.idle_check.is_some_and(|d| now >= d) {
                    let idle_at = self.last_rx.map(|t| t + self.config.idle_timeout);
                    match idle_at {
                        Some(at) if now < at => self.idle_check = Some(at),
                        _ => self.link_lost(now, CloseCode::IdleTimeout, "nothing received"),
                    }
                }
            }
            State::Detached if self.linger_deadline.is_some_and(|d| now >= d) => {
                SessionCounters::bump(&self.counters.expired);
                self.end_session(State::Expired, EndReason::LingerExpired);
            }
            _ => {}
        }
    }

    /// Queues a downstream message. Sequenced classes get the next seq and enter the replay
    /// buffer (also while DETACHED, for replay after resume); best-effort is sent only when
    /// ACTIVE and dropped otherwise. Returns the seq (0 for best-effort), or `None` when
    /// dropped.
    pub fn send_downstream(
        &mut self,
        now: Instant,
        class: TrafficClass,
        msg_id: u32,
        payload: Bytes,
    ) -> Result<Option<u64>, SessionError> {
        let active = match self.state {
            State::Active => true,
            State::Detached => false,
            _ => return Err(self.misuse("downstream message")),
        };
        if payload.len() + waygate_protocol::wire::DATA_HEADER_MAX
            > self.config.max_frame_size as usize
        {
            // Too large for any DATA frame the client takes: never sent half way, never
            // dropped silently — a sequenced one is declared lost like an overflow (the
            // resume reports the gap; the backend learns it from SESSION_REATTACHED).
            SessionCounters::bump(&self.counters.downstream_too_large);
            tracing::warn!(
                msg_id,
                len = payload.len(),
                max_frame = self.config.max_frame_size,
                "downstream message larger than the max frame size"
            );
            if class.is_sequenced() {
                self.declare_lost(
                    now,
                    1,
                    CloseCode::FrameTooLarge,
                    "downstream message too large",
                )?;
            }
            return Ok(None);
        }
        let Some(core) = self.core.as_mut() else {
            return Err(self.misuse("downstream message"));
        };
        let ack = if active && self.up_ack.pending(core.upstream.cumulative()) {
            self.up_ack.piggyback(core.upstream.cumulative())
        } else {
            None
        };
        if !class.is_sequenced() {
            if !active {
                SessionCounters::bump(&self.counters.best_effort_dropped);
                return Ok(None);
            }
            self.actions.push_back(Action::Send(Frame::Data(Data {
                class,
                msg_id,
                seq: 0,
                ack,
                payload,
            })));
            SessionCounters::bump(&self.counters.downstream_sent);
            return Ok(Some(0));
        }
        if msg_id == CHANNEL_EVENT_MSG_ID {
            core.track_channel_event(&payload);
        }
        let (seq, evicted) = core.replay.push(class, msg_id, payload.clone());
        if evicted > 0 {
            SessionCounters::add(&self.counters.replay_evicted, evicted as u64);
        }
        if active {
            if class == TrafficClass::Critical {
                core.fence_errors(seq);
            }
            self.actions.push_back(Action::Send(Frame::Data(Data {
                class,
                msg_id,
                seq,
                ack,
                payload,
            })));
            SessionCounters::bump(&self.counters.downstream_sent);
        }
        Ok(Some(seq))
    }

    /// A delivered upstream message was answered: its backend processed it (FORWARD_DONE,
    /// after every push its handler sent, which are in this session already), or the sink
    /// that took it will give no answer. Only now is it acknowledged to the client (and in
    /// the snapshot's `upstream`), so the client keeps it until what answers it is durable
    /// here; an edge that dies before leaves it to be resent elsewhere (PROTOCOL.md §9.6).
    /// An unknown or already answered seq changes nothing.
    pub fn answer_upstream(&mut self, now: Instant, client_seq: u64) -> Result<(), SessionError> {
        let active = match self.state {
            State::Active => true,
            State::Detached => false,
            _ => return Err(self.misuse("upstream answer")),
        };
        let Some(core) = self.core.as_mut() else {
            return Err(self.misuse("upstream answer"));
        };
        if core.answer(client_seq) && active {
            self.on_answered(now);
        }
        Ok(())
    }

    /// Tells the client that one of its upstream messages could not be delivered (an ERROR
    /// frame: a backend refused it after it was acked, or its link died). While the session
    /// is detached the answer waits in the session (and its snapshot, so on any edge) and
    /// is sent right after the WELCOME of its resume: an acked message never goes
    /// unanswered. At most [`MAX_PENDING_ERRORS`] wait; past that the oldest waiting answer
    /// is replaced by a declared gap (the resume reports `RestoredWithGap`).
    pub fn report_error(
        &mut self,
        now: Instant,
        code: CloseCode,
        msg_id: u32,
        client_seq: u64,
        retry_after_ms: u32,
    ) -> Result<(), SessionError> {
        let report = ErrorReport {
            code,
            msg_id,
            client_seq,
            retry_after_ms,
        };
        let pending = PendingError {
            code: code.to_u16(),
            msg_id,
            client_seq,
            retry_after_ms,
        };
        if client_seq == 0 {
            // A best-effort message's refusal: sent once, like the message (which may be
            // lost), never kept for a resume — every one carries client_seq 0, so a client
            // could not tell a repeat from the next (PROTOCOL.md §3.9).
            return match self.state {
                State::Active => {
                    self.actions.push_back(Action::Send(Frame::Error(report)));
                    Ok(())
                }
                State::Detached => {
                    SessionCounters::bump(&self.counters.best_effort_dropped);
                    Ok(())
                }
                _ => Err(self.misuse("error report")),
            };
        }
        match (self.state, self.core.as_mut()) {
            (State::Active, Some(core)) => {
                // Kept until known to have arrived: the link may die with it in flight.
                core.record_error(pending, true);
                // The ERROR answers it: acknowledged after the ERROR (same batch).
                let answered = core.answer(client_seq);
                self.actions.push_back(Action::Send(Frame::Error(report)));
                if answered {
                    self.on_answered(now);
                }
                Ok(())
            }
            (State::Detached, Some(core)) => {
                core.record_error(pending, false);
                core.answer(client_seq);
                Ok(())
            }
            _ => Err(self.misuse("error report")),
        }
    }

    /// `count` sequenced downstream messages for this session could not be queued (its
    /// queue was full: the client does not keep up). They are never dropped silently: the
    /// replay buffer declares them lost (a gap the next resume reports as
    /// `RestoredWithGap`), and a live connection is closed as `slow_consumer` before any
    /// later message could arrive with a seq jump. The session lingers.
    pub fn lose_downstream(&mut self, now: Instant, count: u64) -> Result<(), SessionError> {
        self.declare_lost(
            now,
            count,
            CloseCode::SlowConsumer,
            "downstream queue overflow",
        )
    }

    /// `count` downstream messages are lost: each takes a seq the resume reports as a gap,
    /// and a live connection closes with `code` before any later DATA.
    fn declare_lost(
        &mut self,
        now: Instant,
        count: u64,
        code: CloseCode,
        why: &str,
    ) -> Result<(), SessionError> {
        let state = self.state;
        let Some(core) = self.core.as_mut() else {
            return Err(self.misuse("lose downstream"));
        };
        match state {
            State::Active | State::Detached => {
                core.replay.declare_lost(count);
                SessionCounters::add(&self.counters.replay_evicted, count);
                if state == State::Active {
                    if code == CloseCode::SlowConsumer {
                        SessionCounters::bump(&self.counters.slow_consumer);
                    }
                    self.link_lost(now, code, why);
                }
                Ok(())
            }
            _ => Err(self.misuse("lose downstream")),
        }
    }

    /// Records a routing key a backend bound (service -> business key, e.g. the room the
    /// player joined), kept across reconnects and edges (it is in the snapshot).
    pub fn bind_key(&mut self, service: &str, key: &str) -> Result<(), SessionError> {
        self.with_held_core("bind key", |core| {
            let previous = core.keys.insert(service.to_owned(), key.to_owned());
            if previous.as_deref() != Some(key) {
                // The placement recorded for the old key is not this key's.
                core.bindings.remove(service);
            }
        })
    }

    /// Applies `change` to the session's state while a connection holds it (active or
    /// detached); otherwise `input` is a misuse and nothing changes.
    fn with_held_core(
        &mut self,
        input: &'static str,
        change: impl FnOnce(&mut SessionCore),
    ) -> Result<(), SessionError> {
        match (self.state, self.core.as_mut()) {
            (State::Active | State::Detached, Some(core)) => {
                change(core);
                Ok(())
            }
            _ => Err(self.misuse(input)),
        }
    }

    /// Records the id of a push queued on the session (PLAYER_PUSH, PROTOCOL.md §9.7), kept
    /// in its snapshot among its last [`MAX_PUSH_IDS`], so a copy sent again after the session
    /// moved to another edge is recognised there. 0 (no id) is not recorded.
    pub fn remember_push(&mut self, id: u64) -> Result<(), SessionError> {
        self.with_held_core("remember push", |core| {
            if id != 0 && !core.push_ids.contains(&id) {
                if core.push_ids.len() >= MAX_PUSH_IDS {
                    core.push_ids.remove(0);
                }
                core.push_ids.push(id);
            }
        })
    }

    /// A backend's join (`Some`: the position the member starts from) or leave (`None`) of
    /// `channel` was taken by the edge's channels, ahead of its events: the snapshot holds
    /// the membership from now on (or no longer), so a restore on another edge meanwhile
    /// joins it there (or does not).
    pub fn track_membership(
        &mut self,
        channel: &str,
        joined: Option<ChannelPosition>,
    ) -> Result<(), SessionError> {
        self.with_held_core("track membership", |core| {
            core.track_membership(channel, joined)
        })
    }

    /// The ids of the session's last pushes with an id, oldest first (restored with it).
    pub fn push_ids(&self) -> &[u64] {
        self.core.as_ref().map_or(&[], |c| &c.push_ids)
    }

    /// Records a placement (service -> instance), kept across reconnects and carried in the
    /// snapshot; a new routing key for the service forgets it.
    pub fn bind(&mut self, service: &str, instance: &str) -> Result<(), SessionError> {
        self.with_held_core("bind", |core| {
            core.bindings
                .insert(service.to_owned(), instance.to_owned());
        })
    }

    /// Soft migration (S8): tells the client to reconnect to `target` within `deadline` and
    /// resume with a fresh resume token (rotated now; the old one stops working).
    pub fn migrate(&mut self, target: &str, deadline: Duration) -> Result<(), SessionError> {
        if self.state != State::Active {
            return Err(self.misuse("migrate"));
        }
        let (token, hash) = new_resume_token(self.rng.as_mut());
        let Some(core) = self.core.as_mut() else {
            return Err(self.misuse("migrate"));
        };
        // MIGRATE may be lost: the current token stays valid for one more restore.
        core.prev_resume_hash = Some(core.resume_hash);
        core.resume_hash = hash;
        self.actions.push_back(Action::Send(Frame::Migrate(Migrate {
            deadline_ms: duration_ms(deadline),
            target: target.to_owned(),
            session_id: core.id,
            resume_token: token,
        })));
        Ok(())
    }

    /// Hard migration, step 1 (S8): stop taking upstream DATA (neither delivered nor acked,
    /// so the client resends it after it moved), while downstream still flows. Replies
    /// to what was already delivered can land here and become durable before MIGRATE.
    pub fn quiesce(&mut self) -> Result<(), SessionError> {
        if !matches!(self.state, State::Active | State::Detached) {
            return Err(self.misuse("quiesce"));
        }
        self.quiesced = true;
        Ok(())
    }

    /// The session's current snapshot (ACTIVE or DETACHED) as a store keeps it, e.g. to
    /// write it through to the warm tier before the client sees state that depends on it:
    /// without the seqs awaiting their answer, which no store keeps ([`Snapshot::awaiting`]).
    pub fn checkpoint(&self) -> Option<Snapshot> {
        match self.state {
            State::Active | State::Detached => self.core.as_ref().map(|c| {
                let mut s = c.snapshot();
                s.awaiting.clear();
                s
            }),
            _ => None,
        }
    }

    /// A newer login of the same player took over (S6): the connection (if any) is closed
    /// with KICKED and the machine ends. Returns the bindings for the new session.
    pub fn kick(&mut self, _now: Instant) -> Result<BTreeMap<String, String>, SessionError> {
        if !matches!(self.state, State::Active | State::Detached) {
            return Err(self.misuse("kick"));
        }
        if self.state == State::Active {
            self.actions.push_back(Action::Close {
                code: CloseCode::Kicked,
                message: "another login took over this player".into(),
            });
        }
        SessionCounters::bump(&self.counters.kicked);
        let bindings = self
            .core
            .as_mut()
            .map(|c| std::mem::take(&mut c.bindings))
            .unwrap_or_default();
        // Ended: its ownership is not released (a newer owner holds the player; the fencing
        // token tells), a copy of it in the store is deleted (it must not be resumable), and
        // the router and backends learn it is gone. Its bindings pass to the new session
        // (taken above: the end carries none).
        self.end_session(State::Closed, EndReason::Kicked);
        Ok(bindings)
    }

    /// A resuming connection asks for this live (ACTIVE or DETACHED) session. The attempt
    /// is checked here first — resume token (current or unconfirmed previous), the player of
    /// its auth token if any, and a last received seq no higher than what was sent — so a
    /// resume that would fail answers `Mismatch` and leaves this session as it was (its
    /// connection, its queue, its ownership). Otherwise the session ends here as
    /// `Superseded` (closing its connection, if any, with `going_away`) and its snapshot is
    /// handed to the new connection.
    pub fn hand_over(
        &mut self,
        _now: Instant,
        attempt: &ResumeAttempt,
    ) -> Result<TakeOutcome, SessionError> {
        if !matches!(self.state, State::Active | State::Detached) {
            return Ok(TakeOutcome::NotFound);
        }
        let Some(core) = self.core.as_ref() else {
            return Ok(TakeOutcome::NotFound);
        };
        let token_ok = attempt
            .key_used(
                &core.id,
                &core.resume_hash,
                core.prev_resume_hash.as_ref(),
                core.last_resume_nonce,
            )
            .is_some();
        let player_ok = attempt
            .player_id
            .as_deref()
            .is_none_or(|p| p == &*core.player_id);
        let seq_ok = attempt.last_server_seq <= core.replay.highest_sent();
        if !(token_ok && player_ok && seq_ok) {
            return Ok(TakeOutcome::Mismatch);
        }
        let snapshot = core.snapshot();
        if self.state == State::Active {
            self.actions.push_back(Action::Close {
                code: CloseCode::GoingAway,
                message: "session resumed on another connection".into(),
            });
        }
        self.end_with(State::Closed, EndReason::Superseded);
        Ok(TakeOutcome::Taken(Box::new(snapshot)))
    }

    /// The client logged out (CLOSE `logout`, PROTOCOL.md §7.5): the session ends now, as if
    /// its linger had run out — ownership, stored copy and backend bindings released — and
    /// the connection closes without a CLOSE back (the client sent one).
    fn log_out(&mut self) {
        if let Some(core) = &self.core {
            tracing::info!(session = %hex_id(&core.id), "client logged out, session ends");
        }
        self.end_session(State::Closed, EndReason::LoggedOut);
    }

    /// Ends the session for good from the server side (an operator's kick or ban, a
    /// backend's KICK): closes the connection with `code` — or `kicked` when a client would
    /// read `code` as a session kept for a resume ([`CloseCode::ending_session`], PROTOCOL.md
    /// §7.8) — and releases the session. The end reason keeps `code` as given (the
    /// backend's SESSION_CLOSE carries it).
    pub fn close_session(&mut self, _now: Instant, code: CloseCode) -> Result<(), SessionError> {
        if !matches!(self.state, State::Active | State::Detached) {
            return Err(self.misuse("close session"));
        }
        if self.state == State::Active {
            self.actions.push_back(Action::Close {
                code: code.ending_session(),
                message: "session closed by server".into(),
            });
        }
        self.end_session(State::Closed, EndReason::ClosedByServer(code));
        Ok(())
    }
}

fn duration_ms(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

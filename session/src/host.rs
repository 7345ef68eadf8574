//! [`SessionHost`] — sans-IO: every session of one edge, and every rule that spans sessions
//! and connections.
//!
//! Shaped like quinn-proto's `Endpoint` (and our KCP endpoint): a plain struct fed events
//! with `now`, polled for outputs, never touching a socket, a task or the clock. It owns:
//!
//! - the table of live and lingering sessions, by session id and by player, and which
//!   connection ([`ConnTaskId`]) holds each one (one [`SessionMachine`](crate::SessionMachine)
//!   per connection, owned by that connection's driver);
//! - each session's **outbound queue** (an [`OutboundQueue`], SPEC B3): backend pushes,
//!   routing keys and refusals wait here, in order, until the holder takes them into its
//!   machine (which sequences them into the replay buffer). The queue belongs to the
//!   *session*, not the connection, so it survives a hand-over untouched. A full queue never
//!   drops a sequenced item silently: the item is counted as lost for the holder, which then
//!   closes as `slow_consumer` and reports the gap on resume;
//! - **hand-over** (a resume finding its session live here): one request at a time per
//!   session, answered by the holder, with a deadline (once extended when the holder has
//!   taken the request; taken back from its mailbox when it has not); a resume meanwhile,
//!   or after the deadline, is `Busy` (refused with a retry-after, never served the store's
//!   older copy); a snapshot handed over after its requester closed comes back as
//!   [`HandedOver::Orphaned`] for the store, never lost, and the session stays busy until
//!   its old holder has written it;
//! - **takeover** (single login): after a claim names a previous owner, whom to kick and
//!   whether the new login must wait for the kicked session's bindings;
//! - **login races** between two local sessions of one player (the older fencing yields);
//! - **commands** for a session (close, bind, migrate, quiesce, drop link), each a bounded
//!   mailbox entry of its holder: nobody ever waits for a session to read them.
//!
//! Outputs: [`SessionHost::poll_wake`] names each connection that has work (mail, queued
//! items, an answer); the connection's driver then calls [`SessionHost::take_work`]. The
//! tokio driver ([`crate::driver`]) keeps the host behind one mutex (like quinn's endpoint)
//! and only moves bytes and timers; the deterministic pair harness drives the same host.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rustc_hash::FxHashMap;
use waygate_backpressure::{
    InboundLimiter, InboundLimits, InboundVerdict, OutboundConfig, OutboundQueue, PushOutcome,
};
use waygate_protocol::frame::{ErrorReport, SessionId};
use waygate_transport::{CloseCode, TrafficClass};

use crate::machine::{ResumeAttempt, SessionMachine};
use crate::store::{Owner, Snapshot, TakeOutcome};

/// One connection (its driver and session machine) as the host names it.
pub type ConnTaskId = u64;

/// How long a resume waits for a live local session to hand itself over, and a takeover for
/// the kicked session's bindings.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// Items other than messages a session keeps beside its full outbound queue (answers are
/// at most one per client message in flight, 4,096; keys, memberships and receipts fill
/// the rest): past it they are lost like messages, and the session reports the gap.
const MAX_KEPT_OVER: usize = 8_192;

/// Commands queued for one connection before [`MailboxError::Full`].
pub const MAILBOX_CAPACITY: usize = 32;

/// A downstream message for a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Downstream {
    /// Traffic class.
    pub class: TrafficClass,
    /// Application message id.
    pub msg_id: u32,
    /// Body.
    pub payload: Bytes,
}

/// What waits in a session's outbound queue, in the order its pusher gave it: messages, the
/// routing keys backends bind between them (so a key bound before a push is in the
/// session's snapshot before that push is shown), and refusals of the client's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutboundItem {
    /// A backend push.
    Message(Downstream),
    /// A routing key bound by a backend (service -> business key).
    RoutingKey {
        /// Service.
        service: String,
        /// Key.
        key: String,
    },
    /// A placement the edge chose for the session that another edge could not recompute
    /// (least loaded, pinned, assigned: service -> instance), for its snapshot. A queue
    /// item, not a mailbox command: a full mailbox dropped it, and with the router's
    /// binding already made nothing ever sent it again (the session was placed afresh
    /// after a move).
    Placement {
        /// Service.
        service: String,
        /// Instance id.
        instance: String,
    },
    /// An ERROR for one of the client's messages.
    Error(ErrorReport),
    /// One of the client's messages (its client seq) was processed by its backend
    /// (FORWARD_DONE): it may be acknowledged now, after the pushes queued before it.
    Answered(u64),
    /// A backend's join or leave of a channel the edge's channels took, queued at once
    /// (its JOINED or LEFT comes later, in the channel's order): the session's snapshot
    /// holds the membership from here on ([`SessionMachine::track_membership`]), so a
    /// restore elsewhere before that event still joins it there (or, left, does not).
    Membership {
        /// The channel.
        channel: String,
        /// The position the member starts from (`None`: the backend left it).
        joined: Option<waygate_protocol::channel::ChannelPosition>,
    },
    /// A receipt the pusher waits for: everything queued before it is in the session, and
    /// the session's connection reports it ([`SessionEvent::PushesWritten`]) once that state
    /// is written through (or could not be).
    ///
    /// [`SessionEvent::PushesWritten`]: crate::driver::SessionEvent::PushesWritten
    Receipt {
        /// The receipt.
        receipt: u64,
        /// The id of the push before it (PLAYER_PUSH, PROTOCOL.md §9.7; 0: none), which the
        /// session remembers in its snapshot ([`SessionMachine::remember_push`]).
        push_id: u64,
    },
}

impl OutboundItem {
    /// Class in the queue's bounds: keys and refusals are never shed (critical).
    fn class(&self) -> TrafficClass {
        match self {
            Self::Message(m) => m.class,
            Self::RoutingKey { .. }
            | Self::Placement { .. }
            | Self::Membership { .. }
            | Self::Error(_)
            | Self::Answered(_)
            | Self::Receipt { .. } => TrafficClass::Critical,
        }
    }

    /// Whether a full queue keeps it beside itself rather than dropping it: every item but
    /// a message. An answer (FORWARD_DONE, ERROR) is the one way its message is ever
    /// answered; a routing key or a membership is the session's state after a move; a
    /// receipt answers its pusher. Each is small, and [`MAX_KEPT_OVER`] bounds them.
    fn kept_when_full(&self) -> bool {
        !matches!(self, Self::Message(_))
    }

    /// Bytes it occupies in the queue's byte bound.
    fn len(&self) -> usize {
        match self {
            Self::Message(m) => m.payload.len() + 16,
            Self::RoutingKey { service, key } => service.len() + key.len() + 16,
            Self::Placement { service, instance } => service.len() + instance.len() + 16,
            Self::Membership { channel, .. } => channel.len() + 32,
            Self::Error(_) => 32,
            Self::Answered(_) | Self::Receipt { .. } => 16,
        }
    }
}

/// Why [`SessionHost::push`] did not queue a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PushError {
    /// No live or lingering session with that id (or player) on this edge.
    #[error("no such session on this edge")]
    NotFound,
    /// The session's outbound queue is full: a sequenced item is declared lost (the
    /// session closes as `slow_consumer` and its resume reports the gap).
    #[error("session outbound queue full")]
    QueueFull,
    /// A best-effort message shed because the session's queue is congested (B3).
    #[error("best-effort message shed (queue congested)")]
    Shed,
    /// A push with this id was queued on the session before it came to this edge (its
    /// stored copy holds it): nothing was queued again.
    #[error("push already queued on this session")]
    Duplicate,
}

/// Why a command could not be queued for a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MailboxError {
    /// No live or lingering session with that id on this edge.
    #[error("no such session on this edge")]
    NotFound,
    /// The holder's mailbox is full ([`MAILBOX_CAPACITY`] commands not yet taken).
    #[error("session mailbox full")]
    Full,
}

/// A command for the connection holding a session.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// A newer login took over: end as KICKED, then answer [`SessionHost::kicked`].
    Kick,
    /// A resume wants this session: try `hand_over`, then answer
    /// [`SessionHost::handed_over`].
    HandOver(ResumeAttempt),
    /// End the session from the server side.
    Close(CloseCode),
    /// Soft migration: MIGRATE to `target` within the deadline.
    Migrate(String, Duration),
    /// Hard migration step 1: stop taking upstream DATA.
    Quiesce,
    /// Drop the connection without a CLOSE (a chaos drill); the session lingers.
    DropLink,
}

/// The answer to a request a connection made ([`SessionHost::request_hand_over`],
/// [`SessionHost::take_over`]).
#[derive(Debug, PartialEq, Eq)]
pub enum HostAnswer {
    /// The live session's answer to a resume; `None`: it did not answer in time (ask the
    /// shared store).
    HandOver(Option<TakeOutcome>),
    /// The kicked previous session's bindings; `None`: it had none to give or did not
    /// answer in time.
    Kicked(Option<BTreeMap<String, String>>),
}

/// What a connection's driver takes from the host when woken.
#[derive(Debug, Default)]
pub struct Work {
    /// Commands, in the order they were given.
    pub commands: Vec<Command>,
    /// The held session's queued items, in the order they were pushed (no class overtakes
    /// another: they share one sequence).
    pub items: Vec<OutboundItem>,
    /// Sequenced items the full queue could not take since the last call: declare them lost
    /// after `items` (they were pushed after every one of those).
    pub lost: u64,
    /// The answer to this connection's pending request.
    pub answer: Option<HostAnswer>,
    /// Output of [`apply_work`]: the receipts of the items it applied, in order.
    pub receipts: Vec<u64>,
}

impl Work {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty() && self.items.is_empty() && self.lost == 0 && self.answer.is_none()
    }
}

/// How [`SessionHost::request_hand_over`] went.
#[derive(Debug, PartialEq, Eq)]
pub enum HandOverStart {
    /// Ask the shared store: the session is not held on this edge, or its copy here is
    /// ending because a newer claim of the same session superseded it (the newer owner's
    /// snapshot is in the store).
    NotLocal,
    /// The session lives on this edge but cannot be handed over now: another resume of it
    /// is under way, or the connection it was handed to has not established it yet, or its
    /// holder's mailbox is full. The store's copy may be older than the live session (a
    /// lingering holder sequences replies it never persists), so the resume is refused
    /// with a retry-after, never served from the store.
    Busy,
    /// The session ended here, or was told to end because another session replaced it (a
    /// newer login took the player over): it must not be resumed, not even from a copy in
    /// the store.
    Ended,
    /// The holder was asked; the answer comes as [`HostAnswer::HandOver`] in [`Work`].
    Pending,
}

/// What a resume does with the shared store once the host has had its say
/// ([`resume_from_store`]).
#[derive(Debug, PartialEq, Eq)]
pub enum ResumeFromStore {
    /// Not decided on this edge: take the snapshot from the store, proving the attempt
    /// (`SnapshotStore::take_proven`).
    TakeProven,
    /// The session lives on this edge and could not be handed over now (another resume
    /// under way, or its holder did not answer in time): refuse the resume with a
    /// retry-after (`SessionMachine::handle_hand_over_busy`). The store's copy is not the
    /// session: serving it would lose, without a gap, what the live holder sequenced since
    /// it was written.
    Busy,
    /// Decided here: delete the store's copy of the session first (`Some(Some(fencing))`:
    /// only the copy of that fencing; `Some(None)`: whatever copy), then answer `outcome`.
    Decided {
        /// The resume's outcome.
        outcome: TakeOutcome,
        /// Which store copy to delete, if any.
        delete: Option<Option<u64>>,
    },
}

/// The one rule for a resume's store step, after [`SessionHost::request_hand_over`]
/// returned `start` (and, when that was [`HandOverStart::Pending`], the holder's `answer`):
///
/// - a session taken over by a newer login is not resumable, not even from a copy its old
///   task may have stored (delete any copy; `NotFound`);
/// - a live holder's snapshot (`Taken`) is the session: a copy it persisted on detach is
///   spent (delete that fencing's copy); a `Mismatch` is final;
/// - a session live here that cannot be handed over now ([`HandOverStart::Busy`]), or
///   whose holder did not answer in time, is busy: the resume is refused with a
///   retry-after (the store's copy may be older than the live session);
/// - anything else (not held here, the holder had nothing to give) is the store's to
///   decide.
pub fn resume_from_store(start: HandOverStart, answer: Option<HostAnswer>) -> ResumeFromStore {
    match (start, answer) {
        (HandOverStart::Busy, _)
        | (HandOverStart::Pending, None | Some(HostAnswer::HandOver(None))) => {
            ResumeFromStore::Busy
        }
        (HandOverStart::Ended, _) => ResumeFromStore::Decided {
            outcome: TakeOutcome::NotFound,
            delete: Some(None),
        },
        (HandOverStart::Pending, Some(HostAnswer::HandOver(Some(TakeOutcome::Taken(s))))) => {
            ResumeFromStore::Decided {
                delete: Some(Some(s.fencing)),
                outcome: TakeOutcome::Taken(s),
            }
        }
        (HandOverStart::Pending, Some(HostAnswer::HandOver(Some(TakeOutcome::Mismatch)))) => {
            ResumeFromStore::Decided {
                outcome: TakeOutcome::Mismatch,
                delete: None,
            }
        }
        _ => ResumeFromStore::TakeProven,
    }
}

/// What to do with a hand-over's outcome ([`SessionHost::handed_over`]).
#[derive(Debug, PartialEq, Eq)]
pub enum HandedOver {
    /// Delivered to the requester.
    Delivered,
    /// The requester is gone (it gave up or closed): put this snapshot back in the store so
    /// a later resume finds it.
    Orphaned(Box<Snapshot>),
}

/// The plan after an ownership claim ([`SessionHost::take_over`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Takeover {
    /// The previous session to end: its lingering snapshot must be deleted from the store
    /// and (if the kick gave none) its bindings taken from it.
    pub previous: Option<SessionId>,
    /// Whether the previous session is held here and was told to end: its bindings come as
    /// [`HostAnswer::Kicked`].
    pub kick_pending: bool,
}

/// How [`SessionHost::established`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EstablishOutcome {
    /// Registered; the player's older local session (if any) was told to end.
    Registered,
    /// The player has a newer local session (higher fencing): this one must end KICKED.
    LostRace,
    /// Nothing registered: the session's previous copy here is cleaning up after its end
    /// ([`SessionHost::end_started`]: releasing the player, deleting the store's copy,
    /// closing it on the backend links). Ask again once that connection has closed; this
    /// copy registered meanwhile would have that clean-up undo its own state.
    PreviousEnding,
}

/// How [`SessionHost::kick_superseded`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SupersededKick {
    /// The copy held here was the superseded one (or older): told to end KICKED.
    Kicked,
    /// Not held here (or already ending).
    NotHeld,
    /// The copy held here was claimed again since (a newer fencing token): it stays.
    KeptNewer,
    /// The copy is being restored here right now: it stays, and its own claim is checked
    /// against the owner when it is established.
    KeptRestoring,
}

/// Counters of the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Sequenced items a full queue could not take (declared lost, reported as gaps).
    pub lost: u64,
    /// Best-effort messages shed or evicted.
    pub shed: u64,
    /// Hand-overs and kicks whose holder did not answer in time.
    pub answer_timeouts: u64,
    /// Snapshots handed over after their requester left (put back in the store).
    pub orphaned: u64,
    /// Commands refused because a mailbox was full.
    pub mailbox_full: u64,
}

#[derive(Debug)]
struct SessionEntry {
    player: Arc<str>,
    fencing: u64,
    /// The connection holding the session (or about to: set when a hand-over succeeds).
    holder: ConnTaskId,
    /// Whether `holder` reached ACTIVE with it ([`SessionHost::established`]).
    established: bool,
    queue: OutboundQueue<OutboundItem>,
    lost: u64,
    /// Items other than messages (answers, routing keys, memberships, receipts) that found
    /// the queue full, taken after it in the next turn, at most [`MAX_KEPT_OVER`]. Before,
    /// they were dropped: a lost answer left its message unanswered for good (the client's
    /// resend of it is a duplicate of a message in flight), a lost key or membership was
    /// missing from the snapshot after a move.
    kept_over: Vec<OutboundItem>,
    /// A resume waiting for this session's hand-over: the requester.
    handing_to: Option<ConnTaskId>,
    /// Told to end (kicked or lost a race), or its end is being cleaned up
    /// ([`SessionHost::end_started`]): no more hand-overs or player lookups.
    ending: bool,
    /// Ending because a newer claim of this same session superseded it (it lives on
    /// elsewhere, [`SessionHost::kick_superseded`]), not because another session replaced it.
    superseded: bool,
    /// Handed over to nobody (its requester had gone): the snapshot is on its way to the
    /// store ([`HandedOver::Orphaned`]); until the old holder's connection closes (after
    /// that write) a resume is `Busy` — the store's copy is not yet the session — and pushes
    /// are refused `NotFound`.
    storing: bool,
    /// The ids of the pushes its stored copy held when it was restored here
    /// ([`SessionHost::restored_pushes`]): a copy of one is not queued again.
    restored_push_ids: Vec<u64>,
    /// Its holder is cleaning up after the session's end ([`SessionHost::end_started`], or
    /// it answered a kick): another copy of it is not registered until that connection
    /// closes, and nothing more is queued for it.
    ended: bool,
    /// A copy of it restored on this connection waits for that
    /// ([`EstablishOutcome::PreviousEnding`]): a resume asking meanwhile is busy, not told
    /// the session ended.
    restoring: Option<ConnTaskId>,
}

/// A player's inbound limiter and how many of its sessions are held here.
#[derive(Debug, Default)]
struct PlayerInbound {
    limiter: Option<InboundLimiter>,
    held: usize,
    /// In `SessionHost::drained` already (listed once, however often its sessions drain
    /// between two sweeps).
    listed: bool,
}

#[derive(Debug, Default)]
struct ConnSlot {
    /// The session this connection holds (at most one).
    session: Option<SessionId>,
    mailbox: VecDeque<Command>,
    answer: Option<HostAnswer>,
    /// A request waiting for an answer: what, about which session, until when.
    waiting: Option<(Waiting, SessionId, Instant)>,
    /// The waiting hand-over's deadline was extended once (its holder had taken the
    /// request: it answers after the actions it is doing).
    extended: bool,
    woken: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    HandOver,
    Kick,
}

/// Every session of one edge and the rules across them. See the module docs.
#[derive(Debug)]
pub struct SessionHost {
    outbound: OutboundConfig,
    /// Boxed entries: a map slot is a pointer, so the map's spare capacity costs little
    /// per session (performance issue, W4).
    /// Keyed by session ids (random, made by an edge; a resume is inserted only once its
    /// record was found) and connection task ids (a counter): no client picks a key, so a
    /// fast unkeyed hash (SipHash was ~4% of the edge's CPU per echo). Players' maps keep
    /// SipHash: player ids come from tokens.
    sessions: FxHashMap<SessionId, Box<SessionEntry>>,
    players: HashMap<Arc<str>, SessionId>,
    conns: FxHashMap<ConnTaskId, ConnSlot>,
    /// Inbound limiters per player (B2), shared by the player's sessions and kept while one
    /// of them is held here: a reconnect or a new login does not start a fresh bucket. The
    /// count is the player's sessions held.
    limiters: HashMap<Arc<str>, Box<PlayerInbound>>,
    /// Players whose last session here ended while their limiter was not full (the only
    /// limiters `sweep_limiters` has to look at; a player may be listed more than once).
    drained: Vec<Arc<str>>,
    /// Inbound checks made (the limiter sweep runs every 1,024).
    inbound_checks: u64,
    wakes: VecDeque<ConnTaskId>,
    stats: HostStats,
}

impl SessionHost {
    /// A host whose sessions' outbound queues have `outbound` bounds (validate it first).
    pub fn new(outbound: OutboundConfig) -> Self {
        Self {
            outbound,
            sessions: FxHashMap::default(),
            players: HashMap::new(),
            conns: FxHashMap::default(),
            limiters: HashMap::new(),
            drained: Vec::new(),
            inbound_checks: 0,
            wakes: VecDeque::new(),
            stats: HostStats::default(),
        }
    }

    /// Outbound bounds for a queue of `capacity` messages: 1/8 reserved for critical items,
    /// congested (best-effort shed) above 3/4, at most 64 KiB per message on average.
    pub fn outbound_for_capacity(capacity: usize) -> OutboundConfig {
        let max_messages = capacity.max(2);
        let max_bytes = max_messages.saturating_mul(64 * 1024).max(1 << 20);
        OutboundConfig {
            max_messages,
            max_bytes,
            reserve_messages: (max_messages / 8).max(1),
            reserve_bytes: max_bytes / 8,
            high_watermark_permille: 750,
            low_watermark_permille: 250,
        }
    }

    // ----- connections -----------------------------------------------------------------

    /// A connection's driver starts.
    pub fn open(&mut self, conn: ConnTaskId) {
        self.conns.entry(conn).or_default();
    }

    /// A connection's driver ended (its machine is terminal). Sessions it still holds end
    /// with it (their queues go: the machine already persisted what it had); a request it
    /// was waiting for is abandoned.
    pub fn close(&mut self, conn: ConnTaskId) {
        let Some(slot) = self.conns.remove(&conn) else {
            return;
        };
        if let Some(id) = slot.session {
            if self.sessions.get(&id).is_some_and(|e| e.holder == conn) {
                self.remove_session(&id);
            }
        }
        if let Some((Waiting::HandOver, id, _)) = slot.waiting {
            self.withdraw_hand_over(conn, &id);
        }
    }

    /// `requester`'s hand-over request of `id` ends unanswered (it timed out, or the
    /// requester closed): the session is no longer being handed, and a request its holder
    /// has not taken yet is taken back, so the holder never hands the session to nobody.
    /// (A request the holder took already is answered when it gets to it: to nobody, then
    /// [`HandedOver::Orphaned`].)
    fn withdraw_hand_over(&mut self, requester: ConnTaskId, id: &SessionId) {
        let Some(e) = self.sessions.get_mut(id) else {
            return;
        };
        if e.handing_to != Some(requester) {
            return;
        }
        e.handing_to = None;
        let holder = e.holder;
        if let Some(slot) = self.conns.get_mut(&holder) {
            slot.mailbox.retain(|c| !matches!(c, Command::HandOver(_)));
        }
    }

    /// Whether `requester`'s hand-over request of `id` is with its holder already (taken
    /// from the mailbox, not yet answered).
    fn hand_over_taken(&self, requester: ConnTaskId, id: &SessionId) -> bool {
        let Some(e) = self.sessions.get(id) else {
            return false;
        };
        e.handing_to == Some(requester)
            && self.conns.get(&e.holder).is_some_and(|slot| {
                !slot
                    .mailbox
                    .iter()
                    .any(|c| matches!(c, Command::HandOver(_)))
            })
    }

    /// Makes `conn` the holder of `id` (whose entry exists).
    fn set_holder(&mut self, id: SessionId, conn: ConnTaskId) {
        let Some(e) = self.sessions.get_mut(&id) else {
            return;
        };
        let old = std::mem::replace(&mut e.holder, conn);
        if old != conn {
            if let Some(slot) = self.conns.get_mut(&old) {
                if slot.session == Some(id) {
                    slot.session = None;
                }
            }
        }
        if let Some(slot) = self.conns.get_mut(&conn) {
            slot.session = Some(id);
        }
    }

    /// `player` no longer finds session `id` here (a newer session of it keeps its name).
    fn unname(&mut self, player: &str, id: &SessionId) {
        if self.players.get(player) == Some(id) {
            self.players.remove(player);
        }
    }

    fn remove_session(&mut self, id: &SessionId) {
        if let Some(e) = self.sessions.remove(id) {
            self.unname(&e.player, id);
            if let Some(p) = self.limiters.get_mut(&e.player) {
                p.held = p.held.saturating_sub(1);
                // A drained limiter outlives the player's last session (a new login must not
                // get a fresh bucket); it goes once full again (`sweep_limiters`).
                if p.held == 0 {
                    if p.limiter.is_none() {
                        self.limiters.remove(&e.player);
                    } else if !p.listed {
                        p.listed = true;
                        self.drained.push(e.player.clone());
                    }
                }
            }
        }
    }

    /// Forgets the limiters of players with no session held here whose buckets are full again
    /// (they carry no information any more). Runs every 1,024 inbound checks; it looks only
    /// at the players drained since (not at every player held), so an edge full of idle
    /// sessions pays nothing for it.
    pub fn sweep_limiters(&mut self, now: Instant) {
        let limiters = &mut self.limiters;
        self.drained.retain(|player| {
            let Some(p) = limiters.get_mut(player) else {
                return false; // swept already (a player listed twice), or gone
            };
            if p.held > 0 {
                p.listed = false;
                return false; // back: listed again when its sessions drain
            }
            if p.limiter.as_mut().is_some_and(|l| !l.is_idle(now)) {
                return true;
            }
            limiters.remove(player);
            false
        });
        if self.drained.is_empty() {
            self.drained = Vec::new();
        }
    }

    /// Inbound limiters held (players with a session here, or recently drained).
    pub fn limiters(&self) -> usize {
        self.limiters.len()
    }

    /// Checks one inbound frame of an established session against its player's limiter
    /// (created with `limits` on first use). `None` when the session is not held here.
    pub fn check_inbound(
        &mut self,
        session_id: &SessionId,
        limits: InboundLimits,
        now: Instant,
        len: usize,
    ) -> Option<InboundVerdict> {
        self.inbound_checks = self.inbound_checks.wrapping_add(1);
        if self.inbound_checks % 1024 == 0 {
            self.sweep_limiters(now);
        }
        let player = &self.sessions.get(session_id)?.player;
        let p = self.limiters.get_mut(player)?;
        let limiter = p
            .limiter
            .get_or_insert_with(|| InboundLimiter::new(limits, now));
        Some(limiter.check(now, len))
    }

    fn wake(&mut self, conn: ConnTaskId) {
        if let Some(slot) = self.conns.get_mut(&conn) {
            if !slot.woken {
                slot.woken = true;
                self.wakes.push_back(conn);
            }
        }
    }

    /// The next connection with work to take ([`take_work`](Self::take_work)).
    pub fn poll_wake(&mut self) -> Option<ConnTaskId> {
        self.wakes.pop_front()
    }

    /// Everything waiting for `conn`: commands, its session's queued items and losses, the
    /// answer to its request.
    pub fn take_work(&mut self, conn: ConnTaskId) -> Work {
        let mut work = Work::default();
        self.take_work_into(conn, &mut work);
        work
    }

    /// [`take_work`](Self::take_work) into a reused `work` (cleared first).
    pub fn take_work_into(&mut self, conn: ConnTaskId, work: &mut Work) {
        work.commands.clear();
        work.items.clear();
        work.lost = 0;
        work.answer = None;
        let Some(slot) = self.conns.get_mut(&conn) else {
            return;
        };
        slot.woken = false;
        work.commands.extend(slot.mailbox.drain(..));
        work.answer = slot.answer.take();
        let Some(id) = slot.session else {
            return;
        };
        if let Some(e) = self.sessions.get_mut(&id) {
            if e.holder == conn && e.established {
                work.items.extend(e.queue.drain_in_order().map(|p| p.item));
                work.items.append(&mut e.kept_over);
                work.lost = std::mem::take(&mut e.lost);
            }
        }
    }

    fn mail(&mut self, conn: ConnTaskId, command: Command) -> Result<(), MailboxError> {
        let slot = self.conns.get_mut(&conn).ok_or(MailboxError::NotFound)?;
        if slot.mailbox.len() >= MAILBOX_CAPACITY && matches!(command, Command::Close(_)) {
            // An end is never refused: it replaces what the ending session would no longer
            // act on (a hand-over request keeps its place: it needs its answer).
            slot.mailbox.retain(|c| matches!(c, Command::HandOver(_)));
        }
        if slot.mailbox.len() >= MAILBOX_CAPACITY {
            self.stats.mailbox_full += 1;
            return Err(MailboxError::Full);
        }
        slot.mailbox.push_back(command);
        self.wake(conn);
        Ok(())
    }

    // ----- sessions ----------------------------------------------------------------------

    /// `conn`'s machine reached ACTIVE with `session_id` (new, restored or handed over). A
    /// hand-over's queue is kept; the player's other local session, if older, is told to end.
    pub fn established(
        &mut self,
        conn: ConnTaskId,
        session_id: SessionId,
        player: Arc<str>,
        fencing: u64,
    ) -> EstablishOutcome {
        if let Some(e) = self
            .sessions
            .get_mut(&session_id)
            .filter(|e| e.ended && e.holder != conn)
        {
            e.restoring = Some(conn);
            return EstablishOutcome::PreviousEnding;
        }
        if let Some(&other) = self.players.get(&player) {
            if other != session_id {
                let other_fencing = self.sessions.get(&other).map_or(0, |e| e.fencing);
                if other_fencing > fencing {
                    return EstablishOutcome::LostRace;
                }
                self.end_session(&other);
            }
        }
        let outbound = self.outbound;
        if !self.sessions.contains_key(&session_id) {
            self.limiters.entry(player.clone()).or_default().held += 1;
        }
        let entry = self.sessions.entry(session_id).or_insert_with(|| {
            Box::new(SessionEntry {
                player: player.clone(),
                fencing,
                holder: conn,
                established: false,
                queue: OutboundQueue::new(outbound),
                lost: 0,
                kept_over: Vec::new(),
                handing_to: None,
                ending: false,
                superseded: false,
                storing: false,
                restored_push_ids: Vec::new(),
                ended: false,
                restoring: None,
            })
        });
        entry.player = player.clone();
        entry.fencing = fencing;
        entry.established = true;
        entry.ending = false;
        entry.superseded = false;
        entry.storing = false;
        entry.restoring = None;
        let pending = !entry.queue.is_empty() || !entry.kept_over.is_empty() || entry.lost > 0;
        let previous = std::mem::replace(&mut entry.holder, conn);
        if previous != conn {
            // Restored from the store while a superseded copy of it still ends here (its
            // holder not yet done): that copy must end, or two machines would hold one
            // session. (A live copy here is never bypassed: its resume is `Busy`.)
            let _ = self.mail(previous, Command::Close(CloseCode::GoingAway));
            if let Some(slot) = self.conns.get_mut(&previous) {
                if slot.session == Some(session_id) {
                    slot.session = None;
                }
            }
        }
        self.set_holder(session_id, conn);
        self.players.insert(player, session_id);
        if pending {
            self.wake(conn);
        }
        EstablishOutcome::Registered
    }

    /// `session_id` was established holding the pushes with `ids` (its restored copy's
    /// [`SessionMachine::push_ids`]): a push with one of them is not queued again
    /// ([`push_to_player_with_receipt`](Self::push_to_player_with_receipt)). Call it in the
    /// same host turn as [`established`](Self::established), before any push can find it.
    pub fn restored_pushes(&mut self, session_id: &SessionId, ids: &[u64]) {
        if let Some(e) = self.sessions.get_mut(session_id) {
            e.restored_push_ids = ids.to_vec();
        }
    }

    /// `conn`'s copy of `session_id` ended and starts cleaning up after it (releasing the
    /// player, deleting the store's copy, the edge's end of it): true unless another
    /// connection holds the session (`conn`'s copy is stale: the session lives on there, and
    /// none of that clean-up may touch it). From now on the session is ending (a resume is
    /// answered that it ended, a push finds no session) and a copy restored here meanwhile
    /// (from the store, having taken it before the clean-up deleted it) waits for the clean-up
    /// to finish ([`EstablishOutcome::PreviousEnding`]) instead of having its state undone by
    /// it.
    pub fn end_started(&mut self, session_id: &SessionId, conn: ConnTaskId) -> bool {
        let Some(e) = self.sessions.get_mut(session_id) else {
            return true;
        };
        if e.holder != conn {
            return false;
        }
        e.ending = true;
        e.ended = true;
        let player = e.player.clone();
        self.unname(&player, session_id);
        true
    }

    /// A copy restored here waited too long for the previous copy's end
    /// ([`EstablishOutcome::PreviousEnding`]): that copy is taken as stuck, and the next
    /// [`established`](Self::established) registers over it (and tells it to close), as
    /// before the rule; its clean-up, if it ever runs, may then undo part of the live
    /// copy's state. Logged by the driver.
    pub fn abandon_end(&mut self, session_id: &SessionId) {
        if let Some(e) = self.sessions.get_mut(session_id) {
            e.ended = false;
        }
    }

    /// Tells a session's holder to end (kick). False when not held here or already ending.
    fn end_session(&mut self, id: &SessionId) -> bool {
        let Some(e) = self.sessions.get_mut(id) else {
            return false;
        };
        if e.ending {
            return false;
        }
        e.ending = true;
        let (holder, player) = (e.holder, e.player.clone());
        self.unname(&player, id);
        // A kick is never refused for a full mailbox: it replaces what is queued that the
        // ending session would no longer act on.
        if let Some(slot) = self.conns.get_mut(&holder) {
            slot.mailbox
                .retain(|c| matches!(c, Command::HandOver(_) | Command::Kick));
            slot.mailbox.push_back(Command::Kick);
            self.wake(holder);
        }
        true
    }

    /// A resume on `conn` wants `session_id` (`deadline`: when to give up waiting).
    pub fn request_hand_over(
        &mut self,
        conn: ConnTaskId,
        session_id: SessionId,
        attempt: ResumeAttempt,
        now: Instant,
    ) -> HandOverStart {
        let Some(e) = self.sessions.get_mut(&session_id) else {
            return HandOverStart::NotLocal;
        };
        if e.restoring.is_some_and(|r| r != conn) {
            // Restored on another connection, which waits for this copy's end to finish:
            // the session lives on there in a moment.
            return HandOverStart::Busy;
        }
        if e.ending {
            // A copy superseded by a newer claim of the session: the newer owner's snapshot
            // is in the store (this copy's own writes were refused by fencing).
            return if e.superseded {
                HandOverStart::NotLocal
            } else {
                HandOverStart::Ended
            };
        }
        if e.holder == conn {
            return HandOverStart::NotLocal;
        }
        if e.handing_to.is_some() || !e.established || e.storing {
            return HandOverStart::Busy;
        }
        e.handing_to = Some(conn);
        let holder = e.holder;
        if let Some(slot) = self.conns.get_mut(&conn) {
            slot.waiting = Some((Waiting::HandOver, session_id, now + ANSWER_TIMEOUT));
            slot.extended = false;
            slot.answer = None;
        }
        match self.mail(holder, Command::HandOver(attempt)) {
            Ok(()) => HandOverStart::Pending,
            Err(_) => {
                self.clear_waiting(conn);
                if let Some(e) = self.sessions.get_mut(&session_id) {
                    e.handing_to = None;
                }
                HandOverStart::Busy
            }
        }
    }

    fn clear_waiting(&mut self, conn: ConnTaskId) {
        if let Some(slot) = self.conns.get_mut(&conn) {
            slot.waiting = None;
        }
    }

    fn answer(&mut self, conn: ConnTaskId, answer: HostAnswer) -> bool {
        let Some(slot) = self.conns.get_mut(&conn) else {
            return false;
        };
        if slot.waiting.is_none() {
            return false;
        }
        slot.waiting = None;
        slot.answer = Some(answer);
        self.wake(conn);
        true
    }

    /// The holder's answer to [`Command::HandOver`]. On `Taken` the session (and its queue)
    /// passes to the requester at once.
    pub fn handed_over(
        &mut self,
        holder: ConnTaskId,
        session_id: SessionId,
        outcome: TakeOutcome,
    ) -> HandedOver {
        let Some(e) = self.sessions.get_mut(&session_id) else {
            // The session ended meanwhile (kicked, expired): nothing to hand.
            return HandedOver::Delivered;
        };
        if e.holder != holder {
            // A stale answer: the session was restored elsewhere meanwhile (from the store,
            // its copy here superseded); that connection holds it now.
            return HandedOver::Delivered;
        }
        let requester = e.handing_to.take();
        let waiting = requester.filter(|r| {
            self.conns
                .get(r)
                .and_then(|s| s.waiting.as_ref())
                .map(|w| (w.0, w.1))
                == Some((Waiting::HandOver, session_id))
        });
        match (waiting, outcome) {
            (Some(r), TakeOutcome::Taken(s)) => {
                if let Some(e) = self.sessions.get_mut(&session_id) {
                    e.established = false;
                }
                self.set_holder(session_id, r);
                self.answer(r, HostAnswer::HandOver(Some(TakeOutcome::Taken(s))));
                HandedOver::Delivered
            }
            (None, TakeOutcome::Taken(mut s)) => {
                // Nobody to take it: the session lives on in the store only, once the old
                // holder has written it there (the entry goes when that connection closes;
                // meanwhile a resume is busy, never served the store's older copy).
                self.stats.orphaned += 1;
                if let Some(e) = self.sessions.get_mut(&session_id) {
                    // Messages queued after the holder took its snapshot (or lost to a full
                    // queue) are not in it: the stored copy declares them lost, so its
                    // restore reports a gap (silent-drop audit: it was `Restored`).
                    let missing = e.lost
                        + e.queue
                            .drain_in_order()
                            .filter(|p| matches!(p.item, OutboundItem::Message(_)))
                            .count() as u64;
                    e.lost = 0;
                    e.kept_over.clear();
                    s.replay.declare_lost(missing);
                    // The answers of the messages it awaited (queued, or still to come) go
                    // nowhere now: the stored copy awaits nothing, so the client's resends
                    // are delivered again (at least once towards backends, as from a copy
                    // another edge stored; PROTOCOL.md §9.6). Kept, a resend was taken for
                    // a duplicate of a message whose answer never comes.
                    s.awaiting.clear();
                    e.storing = true;
                    let player = e.player.clone();
                    self.unname(&player, &session_id);
                }
                HandedOver::Orphaned(s)
            }
            (Some(r), other) => {
                self.answer(r, HostAnswer::HandOver(Some(other)));
                HandedOver::Delivered
            }
            (None, _) => HandedOver::Delivered,
        }
    }

    /// Feeds back one of `conn`'s [`Reply`]s; a snapshot nobody waits for any more comes back
    /// for the store.
    pub fn reply(&mut self, conn: ConnTaskId, reply: Reply) -> Option<Box<Snapshot>> {
        match reply {
            Reply::Kicked(sid, bindings) => {
                self.kicked(conn, sid, bindings);
                None
            }
            Reply::HandedOver(sid, outcome) => match self.handed_over(conn, sid, outcome) {
                HandedOver::Delivered => None,
                HandedOver::Orphaned(s) => Some(s),
            },
            Reply::DropLink => None,
        }
    }

    /// After `conn`'s ownership claim named `previous` as the player's owner before it:
    /// ends that session if it is another one (kicked here if held here).
    pub fn take_over(
        &mut self,
        conn: ConnTaskId,
        session_id: SessionId,
        previous: Option<&Owner>,
        now: Instant,
    ) -> Takeover {
        let Some(prev) = previous.filter(|p| p.session_id != session_id) else {
            return Takeover {
                previous: None,
                kick_pending: false,
            };
        };
        let prev_id = prev.session_id;
        let kick_pending = self.end_session(&prev_id);
        if kick_pending {
            if let Some(slot) = self.conns.get_mut(&conn) {
                slot.waiting = Some((Waiting::Kick, prev_id, now + ANSWER_TIMEOUT));
                slot.answer = None;
            }
        }
        Takeover {
            previous: Some(prev_id),
            kick_pending,
        }
    }

    /// Ends a session held here as KICKED (e.g. a newer login on another edge). False when
    /// it is not held here (or already ending).
    pub fn kick(&mut self, session_id: &SessionId) -> bool {
        self.end_session(session_id)
    }

    /// Ends a session held here as KICKED because a newer claim superseded its copy with
    /// fencing token `fencing` (a takeover notice from another edge, or the ownership sweep
    /// finding a newer owner) — unless the copy held here is newer than that (the session
    /// came back and was claimed again here since the notice was sent or the sweep looked)
    /// or is being restored here right now (its own claim is checked when it is
    /// established). Found by the channels-at-scale overload run: the sweep, seconds behind
    /// under load, kicked sessions that had moved away and back.
    pub fn kick_superseded(&mut self, session_id: &SessionId, fencing: u64) -> SupersededKick {
        let Some(e) = self.sessions.get(session_id) else {
            return SupersededKick::NotHeld;
        };
        if e.ending {
            return SupersededKick::NotHeld;
        }
        if !e.established {
            return SupersededKick::KeptRestoring;
        }
        if e.fencing > fencing {
            return SupersededKick::KeptNewer;
        }
        if self.end_session(session_id) {
            if let Some(e) = self.sessions.get_mut(session_id) {
                e.superseded = true;
            }
        }
        SupersededKick::Kicked
    }

    /// The holder's answer to [`Command::Kick`]: the bindings it gave up (`None` when its
    /// machine had already ended).
    pub fn kicked(
        &mut self,
        holder: ConnTaskId,
        session_id: SessionId,
        bindings: Option<BTreeMap<String, String>>,
    ) {
        if let Some(e) = self
            .sessions
            .get_mut(&session_id)
            .filter(|e| e.holder == holder)
        {
            // Kept, ending, until its connection closes (`close`): its end's clean-up runs
            // after this, and a copy restored here meanwhile must wait for it
            // ([`EstablishOutcome::PreviousEnding`]).
            e.ending = true;
            e.ended = true;
        }
        let waiter = self.conns.iter().find_map(|(c, s)| {
            s.waiting
                .as_ref()
                .filter(|w| w.0 == Waiting::Kick && w.1 == session_id)
                .map(|_| *c)
        });
        if let Some(w) = waiter {
            self.answer(w, HostAnswer::Kicked(bindings));
        }
    }

    /// When `conn`'s pending request times out (`None`: it waits for nothing).
    pub fn waiting_deadline(&self, conn: ConnTaskId) -> Option<Instant> {
        self.conns.get(&conn)?.waiting.as_ref().map(|w| w.2)
    }

    /// The earliest deadline of a pending request.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.conns
            .values()
            .filter_map(|s| s.waiting.as_ref().map(|w| w.2))
            .min()
    }

    /// Answers every request past its deadline with "no answer".
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<(ConnTaskId, Waiting, SessionId)> = self
            .conns
            .iter()
            .filter_map(|(c, s)| {
                s.waiting
                    .as_ref()
                    .filter(|w| w.2 <= now)
                    .map(|w| (*c, w.0, w.1))
            })
            .collect();
        for (conn, what, session) in expired {
            let answer = match what {
                Waiting::HandOver => {
                    // A holder that took the request answers once the actions it is doing
                    // are done: it gets one more deadline (an answer then reaches the
                    // requester instead of orphaning the session). A request still in its
                    // mailbox is taken back.
                    if self.hand_over_taken(conn, &session) {
                        if let Some(slot) = self.conns.get_mut(&conn) {
                            if !slot.extended {
                                slot.extended = true;
                                if let Some(w) = slot.waiting.as_mut() {
                                    w.2 = now + ANSWER_TIMEOUT;
                                }
                                continue;
                            }
                        }
                    }
                    self.withdraw_hand_over(conn, &session);
                    HostAnswer::HandOver(None)
                }
                Waiting::Kick => HostAnswer::Kicked(None),
            };
            self.stats.answer_timeouts += 1;
            self.answer(conn, answer);
        }
    }

    // ----- downstream --------------------------------------------------------------------

    /// Queues a downstream message for a session. Never waits; see [`PushError`].
    pub fn push(&mut self, session_id: &SessionId, message: Downstream) -> Result<(), PushError> {
        let e = self
            .sessions
            .get_mut(session_id)
            .filter(|e| !e.storing && !e.ended)
            .ok_or(PushError::NotFound)?;
        if message.class == TrafficClass::BestEffort && e.queue.is_congested() {
            self.stats.shed += 1;
            return Err(PushError::Shed);
        }
        self.queue(session_id, OutboundItem::Message(message))
    }

    /// Queues a downstream message for a player's session.
    pub fn push_to_player(&mut self, player: &str, message: Downstream) -> Result<(), PushError> {
        let id = *self.players.get(player).ok_or(PushError::NotFound)?;
        self.push(&id, message)
    }

    /// Queues a downstream message for a player's session followed by `receipt`
    /// ([`OutboundItem::Receipt`], carrying `push_id`, 0 for none), which is queued only if
    /// the message was. A full queue declares the message lost as [`push`](Self::push)
    /// does; a push whose id the session's restored copy holds is not queued
    /// ([`PushError::Duplicate`]). `Ok(false)`: the message was queued but the queue had no
    /// room left for its receipt (nothing is declared lost for a receipt): no report will
    /// come.
    pub fn push_to_player_with_receipt(
        &mut self,
        player: &str,
        message: Downstream,
        receipt: u64,
        push_id: u64,
    ) -> Result<bool, PushError> {
        let id = *self.players.get(player).ok_or(PushError::NotFound)?;
        if push_id != 0
            && self
                .sessions
                .get(&id)
                .is_some_and(|e| e.restored_push_ids.contains(&push_id))
        {
            return Err(PushError::Duplicate);
        }
        self.push(&id, message)?;
        let e = self.sessions.get_mut(&id).ok_or(PushError::NotFound)?;
        let item = OutboundItem::Receipt { receipt, push_id };
        let (class, len) = (item.class(), item.len());
        Ok(matches!(
            e.queue.push(class, item, len, None),
            PushOutcome::Queued | PushOutcome::Coalesced
        ))
    }

    /// Records a routing key a backend bound (in order with the session's pushes).
    pub fn bind_key(
        &mut self,
        session_id: &SessionId,
        service: &str,
        key: &str,
    ) -> Result<(), PushError> {
        let item = OutboundItem::RoutingKey {
            service: service.to_owned(),
            key: key.to_owned(),
        };
        self.queue(session_id, item)
    }

    /// Records a placement the edge chose for a session (service -> instance) in its
    /// snapshot, in order with its pushes; kept beside a full queue like a routing key.
    pub fn bind_placement(
        &mut self,
        session_id: &SessionId,
        service: &str,
        instance: &str,
    ) -> Result<(), PushError> {
        let item = OutboundItem::Placement {
            service: service.to_owned(),
            instance: instance.to_owned(),
        };
        self.queue(session_id, item)
    }

    /// Queues an ERROR for one of the client's messages (in order with the pushes).
    pub fn report_error(
        &mut self,
        session_id: &SessionId,
        report: ErrorReport,
    ) -> Result<(), PushError> {
        self.queue(session_id, OutboundItem::Error(report))
    }

    /// Records that a backend processed one of the client's messages (FORWARD_DONE), in
    /// order with the pushes its handler sent before ([`SessionMachine::answer_upstream`]).
    pub fn answered(&mut self, session_id: &SessionId, client_seq: u64) -> Result<(), PushError> {
        self.queue(session_id, OutboundItem::Answered(client_seq))
    }

    /// Queues `item` as its own method would ([`push`](Self::push) for a message, with its
    /// best-effort shedding; [`answered`](Self::answered), [`report_error`](Self::report_error),
    /// [`bind_key`](Self::bind_key) otherwise). Items queued one after the other without
    /// releasing the host are taken by the session's connection in one [`Work`]: a
    /// backend's answer and the replies its handler sent are made durable and shown
    /// together (PROTOCOL.md §9.6).
    pub fn queue_item(
        &mut self,
        session_id: &SessionId,
        item: OutboundItem,
    ) -> Result<(), PushError> {
        match item {
            OutboundItem::Message(message) => self.push(session_id, message),
            other => self.queue(session_id, other),
        }
    }

    fn queue(&mut self, session_id: &SessionId, item: OutboundItem) -> Result<(), PushError> {
        // A session being stored (handed over to nobody) takes nothing more: its snapshot
        // is written already (what was queued after it is declared lost there). Nor does
        // one whose end is being cleaned up: what it took would go with it unsaid.
        let e = self
            .sessions
            .get_mut(session_id)
            .filter(|e| !e.storing && !e.ended)
            .ok_or(PushError::NotFound)?;
        let (class, len) = (item.class(), item.len());
        let holder = e.holder;
        // While items wait beside a full queue nothing overtakes them: later ones join
        // them, messages are refused as by the full queue.
        let outcome = if e.kept_over.is_empty() {
            e.queue.push(class, item, len, None)
        } else if class == TrafficClass::BestEffort {
            PushOutcome::Refused { item }
        } else {
            PushOutcome::SlowConsumer { item }
        };
        let result = match outcome {
            PushOutcome::Queued | PushOutcome::Coalesced => Ok(()),
            PushOutcome::DroppedBestEffort { evicted } => {
                self.stats.shed += evicted as u64;
                Ok(())
            }
            PushOutcome::Refused { .. } if class == TrafficClass::BestEffort => {
                self.stats.shed += 1;
                Err(PushError::Shed)
            }
            PushOutcome::Refused { item } | PushOutcome::SlowConsumer { item }
                if item.kept_when_full() && e.kept_over.len() < MAX_KEPT_OVER =>
            {
                e.kept_over.push(item);
                Ok(())
            }
            PushOutcome::Refused { .. } | PushOutcome::SlowConsumer { .. } => {
                e.lost += 1;
                self.stats.lost += 1;
                Err(PushError::QueueFull)
            }
        };
        if e.established {
            self.wake(holder);
        }
        result
    }

    // ----- commands ----------------------------------------------------------------------

    /// Queues `command` for the connection holding `session_id`.
    pub fn command(
        &mut self,
        session_id: &SessionId,
        command: Command,
    ) -> Result<(), MailboxError> {
        let e = self
            .sessions
            .get(session_id)
            .filter(|e| !e.ending)
            .ok_or(MailboxError::NotFound)?;
        let holder = e.holder;
        self.mail(holder, command)
    }

    // ----- queries -----------------------------------------------------------------------

    /// Sessions held (live or lingering, including one being handed over).
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// The session of a player on this edge.
    pub fn session_of(&self, player: &str) -> Option<SessionId> {
        self.players.get(player).copied()
    }

    /// The player of a session on this edge.
    pub fn player_of(&self, session_id: &SessionId) -> Option<Arc<str>> {
        self.sessions.get(session_id).map(|e| e.player.clone())
    }

    /// Whether `session_id` is held by another connection than `conn`: `conn`'s copy is
    /// stale (the session was restored elsewhere while `conn` was stuck) and must not
    /// write the store, end the session or touch its router entry.
    pub fn held_elsewhere(&self, session_id: &SessionId, conn: ConnTaskId) -> bool {
        self.holder_of(session_id)
            .is_some_and(|holder| holder != conn)
    }

    /// The connection holding `session_id`, if any.
    pub fn holder_of(&self, session_id: &SessionId) -> Option<ConnTaskId> {
        self.sessions.get(session_id).map(|e| e.holder)
    }

    /// Whether a session held here was told to end (its holder has not yet done so).
    pub fn is_ending(&self, session_id: &SessionId) -> bool {
        self.sessions.get(session_id).is_some_and(|e| e.ending)
    }

    /// Every session id held.
    pub fn session_ids(&self) -> Vec<SessionId> {
        self.sessions.keys().copied().collect()
    }

    /// Connections the host knows.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Items waiting in a session's outbound queue.
    pub fn queued(&self, session_id: &SessionId) -> usize {
        self.sessions.get(session_id).map_or(0, |e| e.queue.len())
    }

    /// The outbound queue length of every session held (for a distribution at scrape time).
    pub fn queue_lengths(&self) -> impl Iterator<Item = usize> + '_ {
        self.sessions.values().map(|e| e.queue.len())
    }

    /// The host's counters.
    pub fn stats(&self) -> HostStats {
        self.stats
    }

    /// Checks the host's own invariants (tests): every player entry names a held session of
    /// that player, every holder is a known connection.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (player, id) in &self.players {
            let e = self
                .sessions
                .get(id)
                .ok_or_else(|| format!("player {player} names a session not held"))?;
            // (So no session is named by two players: an entry has one player.)
            if &e.player != player {
                return Err(format!("player {player} names a session of {}", e.player));
            }
        }
        for e in self.sessions.values() {
            if !self.conns.contains_key(&e.holder) {
                return Err(format!("a session of {} has no connection", e.player));
            }
        }
        Ok(())
    }
}

/// What a connection's machine tells the host after [`apply_work`]: answers to its
/// commands, and the one effect that is the driver's to carry out.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// It ended KICKED, giving up these bindings (`None`: it had already ended).
    Kicked(SessionId, Option<BTreeMap<String, String>>),
    /// Its answer to a hand-over request.
    HandedOver(SessionId, TakeOutcome),
    /// Drop the connection without a CLOSE (the machine already detached): the driver's.
    DropLink,
}

/// Applies `work` taken from the host to a connection's machine, in the one order that
/// keeps every guarantee: queued items enter the machine first (sequenced into the replay
/// buffer, in push order), then items the full queue could not take are declared lost (the
/// connection closes as `slow_consumer`, the resume reports the gap), then the commands —
/// so a hand-over's snapshot holds everything pushed before it. Answers go to `replies`,
/// to be fed back with [`SessionHost::reply`]. Returns how many items were declared lost.
pub fn apply_work(
    machine: &mut SessionMachine,
    work: &mut Work,
    now: Instant,
    replies: &mut Vec<Reply>,
) -> u64 {
    // Answers first: they follow the pushes of their handler in the queue, and everything
    // taken here is made durable in one write before any of it is shown, so the client's
    // ack can ride on the reply's DATA instead of a standalone ACK later.
    for item in &work.items {
        if let OutboundItem::Answered(client_seq) = item {
            if let Err(e) = machine.answer_upstream(now, *client_seq) {
                tracing::debug!(error = %e, "answer for an ended session");
            }
        }
    }
    let mut receipts = std::mem::take(&mut work.receipts);
    for item in work.items.drain(..) {
        let refused = match item {
            OutboundItem::Answered(_) => Ok(()),
            OutboundItem::Receipt { receipt, push_id } => {
                receipts.push(receipt);
                machine.remember_push(push_id)
            }
            OutboundItem::Message(msg) => machine
                .send_downstream(now, msg.class, msg.msg_id, msg.payload)
                .map(|_| ()),
            OutboundItem::RoutingKey { service, key } => machine.bind_key(&service, &key),
            OutboundItem::Placement { service, instance } => machine.bind(&service, &instance),
            OutboundItem::Membership { channel, joined } => {
                machine.track_membership(&channel, joined)
            }
            OutboundItem::Error(e) => {
                machine.report_error(now, e.code, e.msg_id, e.client_seq, e.retry_after_ms)
            }
        };
        if let Err(e) = refused {
            tracing::debug!(error = %e, "downstream item refused");
        }
    }
    work.receipts = receipts;
    let lost = std::mem::take(&mut work.lost);
    if lost > 0 {
        if let Err(e) = machine.lose_downstream(now, lost) {
            tracing::debug!(error = %e, "overflow on an ended session");
        }
    }
    for command in work.commands.drain(..) {
        match command {
            Command::Kick => {
                let session = machine.session_id();
                let bindings = machine.kick(now).ok();
                if let Some(sid) = session {
                    replies.push(Reply::Kicked(sid, bindings));
                }
            }
            Command::HandOver(attempt) => {
                if let Some(sid) = machine.session_id() {
                    let outcome = machine
                        .hand_over(now, &attempt)
                        .unwrap_or(TakeOutcome::NotFound);
                    replies.push(Reply::HandedOver(sid, outcome));
                }
            }
            Command::Close(code) => {
                let _ = machine.close_session(now, code);
            }
            Command::Migrate(target, deadline) => {
                let _ = machine.migrate(&target, deadline);
            }
            Command::Quiesce => {
                let _ = machine.quiesce();
            }
            Command::DropLink => replies.push(Reply::DropLink),
        }
    }
    lost
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one rule both the tokio driver and the pair harness follow for a resume's store
    /// step: a takeover ends resumability, a live holder's answer decides (its detach copy
    /// spent), a session live here but busy refuses the resume for now, anything else is the
    /// store's.
    #[test]
    fn a_resume_asks_the_store_unless_this_edge_decided() {
        let taken = crate::testkit::store_contract::snapshot(1, "p", 7);
        assert_eq!(
            resume_from_store(
                HandOverStart::Pending,
                Some(HostAnswer::HandOver(Some(TakeOutcome::Taken(Box::new(
                    taken.clone()
                )))))
            ),
            ResumeFromStore::Decided {
                outcome: TakeOutcome::Taken(Box::new(taken)),
                delete: Some(Some(7)),
            }
        );
        assert_eq!(
            resume_from_store(
                HandOverStart::Pending,
                Some(HostAnswer::HandOver(Some(TakeOutcome::Mismatch)))
            ),
            ResumeFromStore::Decided {
                outcome: TakeOutcome::Mismatch,
                delete: None,
            }
        );
        assert_eq!(
            resume_from_store(HandOverStart::Ended, None),
            ResumeFromStore::Decided {
                outcome: TakeOutcome::NotFound,
                delete: Some(None),
            }
        );
        for (start, answer) in [
            (HandOverStart::Busy, None),
            (HandOverStart::Pending, None),
            (HandOverStart::Pending, Some(HostAnswer::HandOver(None))),
        ] {
            assert_eq!(resume_from_store(start, answer), ResumeFromStore::Busy);
        }
        for (start, answer) in [
            (HandOverStart::NotLocal, None),
            (
                HandOverStart::Pending,
                Some(HostAnswer::HandOver(Some(TakeOutcome::NotFound))),
            ),
        ] {
            assert_eq!(
                resume_from_store(start, answer),
                ResumeFromStore::TakeProven
            );
        }
    }

    fn limits() -> InboundLimits {
        InboundLimits {
            messages_per_sec: 10,
            message_burst: 5,
            bytes_per_sec: 1 << 20,
            byte_burst: 1 << 20,
        }
    }

    /// A superseded copy is kicked; a copy claimed again here since (newer fencing token:
    /// the session moved away and came back while a takeover notice or the ownership sweep
    /// was on its way) stays.
    #[test]
    fn a_superseded_kick_spares_a_copy_claimed_again_since() {
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        let player: Arc<str> = "p".into();
        assert_eq!(host.kick_superseded(&[1; 16], 3), SupersededKick::NotHeld);
        host.open(1);
        host.established(1, [1; 16], player.clone(), 3);
        // Away and back: restored on connection 2 with a newer claim.
        host.open(2);
        host.established(2, [1; 16], player.clone(), 7);
        assert_eq!(host.kick_superseded(&[1; 16], 3), SupersededKick::KeptNewer);
        assert_eq!(host.session_of(&player), Some([1; 16]));
        assert_eq!(host.kick_superseded(&[1; 16], 7), SupersededKick::Kicked);
        assert_eq!(host.session_of(&player), None);
        assert_eq!(
            host.kick_superseded(&[1; 16], 9),
            SupersededKick::NotHeld,
            "ending"
        );
    }

    /// A push whose id the session's restored copy held (it was queued on the session on
    /// another edge) is not queued again; any other id is, with its receipt carrying the id
    /// for the machine to remember.
    #[test]
    fn a_push_the_restored_copy_held_is_not_queued_again() {
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        host.open(1);
        host.established(1, [1; 16], "p".into(), 3);
        host.restored_pushes(&[1; 16], &[41, 42]);
        let message = |n: u32| Downstream {
            class: TrafficClass::Normal,
            msg_id: n,
            payload: Bytes::new(),
        };
        assert_eq!(
            host.push_to_player_with_receipt("p", message(1), 7, 42),
            Err(PushError::Duplicate)
        );
        assert_eq!(host.queued(&[1; 16]), 0, "nothing queued");
        assert_eq!(
            host.push_to_player_with_receipt("p", message(2), 8, 43),
            Ok(true)
        );
        assert_eq!(
            host.push_to_player_with_receipt("p", message(3), 9, 0),
            Ok(true)
        );
        let work = host.take_work(1);
        assert_eq!(
            work.items,
            vec![
                OutboundItem::Message(message(2)),
                OutboundItem::Receipt {
                    receipt: 8,
                    push_id: 43
                },
                OutboundItem::Message(message(3)),
                OutboundItem::Receipt {
                    receipt: 9,
                    push_id: 0
                },
            ]
        );
    }

    /// Session [1; 16] of player "p" held by connection 1; connection 2 asked for its
    /// hand-over at the returned instant with the returned attempt.
    fn hand_over_asked() -> (SessionHost, ResumeAttempt, Instant) {
        let t0 = Instant::now();
        let attempt = ResumeAttempt::proving(&[9; 16], &[1; 16], 1);
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        host.open(1);
        host.established(1, [1; 16], "p".into(), 3);
        host.open(2);
        assert_eq!(
            host.request_hand_over(2, [1; 16], attempt.clone(), t0),
            HandOverStart::Pending
        );
        (host, attempt, t0)
    }

    /// A hand-over request that times out before its holder took it is taken back, so the
    /// holder never hands the session to nobody (before, it did when it woke up: the entry
    /// and its queue were dropped and a retried resume read the store's older copy while
    /// the orphaned snapshot was still being written). One the holder took gets one more
    /// deadline, and its answer reaches the requester.
    #[test]
    fn a_timed_out_hand_over_is_taken_back_or_waited_for_once() {
        let (mut host, attempt, t0) = hand_over_asked();
        // The holder is stuck: the request times out in its mailbox.
        host.handle_timeout(t0 + ANSWER_TIMEOUT);
        assert_eq!(host.take_work(2).answer, Some(HostAnswer::HandOver(None)));
        assert!(
            host.take_work(1).commands.is_empty(),
            "the request was taken back"
        );
        assert_eq!(host.holder_of(&[1; 16]), Some(1), "still the holder's");

        // Taken by the holder, answered late: within the one extension it reaches the
        // requester.
        host.open(3);
        assert_eq!(
            host.request_hand_over(3, [1; 16], attempt, t0),
            HandOverStart::Pending
        );
        assert_eq!(host.take_work(1).commands.len(), 1, "the holder takes it");
        host.handle_timeout(t0 + ANSWER_TIMEOUT);
        assert_eq!(host.take_work(3).answer, None, "extended, not answered");
        assert_eq!(host.stats().answer_timeouts, 1);
        let snapshot = crate::testkit::store_contract::snapshot(1, "p", 3);
        assert_eq!(
            host.reply(
                1,
                Reply::HandedOver([1; 16], TakeOutcome::Taken(Box::new(snapshot)))
            ),
            None,
            "delivered, not orphaned"
        );
        assert!(matches!(
            host.take_work(3).answer,
            Some(HostAnswer::HandOver(Some(TakeOutcome::Taken(_))))
        ));
        assert_eq!(host.holder_of(&[1; 16]), Some(3));
    }

    /// A snapshot handed over after its requester gave up goes to the store by its old
    /// holder; until that connection closes (after the write), a resume is busy and a push
    /// is refused, never served the store's older copy or queued to be dropped.
    #[test]
    fn an_orphaned_session_is_busy_until_its_snapshot_is_stored() {
        let (mut host, attempt, t0) = hand_over_asked();
        assert_eq!(host.take_work(1).commands.len(), 1);
        // The requester's client went away after the holder took the request.
        host.close(2);
        // A push queued after the holder took its snapshot is not in it: the stored copy
        // declares it lost (silent-drop audit: restored without a gap before).
        let late = Downstream {
            class: TrafficClass::Normal,
            msg_id: 2,
            payload: bytes::Bytes::from_static(b"late"),
        };
        assert_eq!(host.push(&[1; 16], late), Ok(()));
        let mut snapshot = crate::testkit::store_contract::snapshot(1, "p", 3);
        // Client seq 5 was delivered and its answer not queued yet.
        snapshot.awaiting.insert(5);
        let sent = snapshot.replay.highest_sent();
        let stored = host
            .reply(
                1,
                Reply::HandedOver([1; 16], TakeOutcome::Taken(Box::new(snapshot))),
            )
            .expect("orphaned: back for the store");
        assert_eq!(stored.replay.highest_sent(), sent + 1);
        assert_eq!(
            stored.replay.evicted_through(),
            sent + 1,
            "a gap on restore"
        );
        // Regression (2026-12-05, a silent-loss audit): the stored copy kept `awaiting`
        // (the memory store keeps it), so after the restore the client's resend of seq 5
        // was taken for a duplicate of a message whose answer went nowhere: never answered.
        assert!(stored.awaiting.is_empty(), "{:?}", stored.awaiting);
        host.open(3);
        assert_eq!(
            host.request_hand_over(3, [1; 16], attempt.clone(), t0),
            HandOverStart::Busy
        );
        let message = Downstream {
            class: TrafficClass::Normal,
            msg_id: 1,
            payload: bytes::Bytes::from_static(b"x"),
        };
        assert_eq!(host.push(&[1; 16], message), Err(PushError::NotFound));
        assert_eq!(host.session_of("p"), None);
        // Written; its old holder's connection closes.
        host.close(1);
        assert_eq!(
            host.request_hand_over(3, [1; 16], attempt, t0),
            HandOverStart::NotLocal
        );
        assert_eq!(host.len(), 0);
        host.check_invariants().unwrap();
    }

    /// A session restored here from the store while its previous copy cleans up after the
    /// session's end (the linger expired as the resume came: the restore took the store's
    /// copy before the clean-up deleted it) is registered only once that copy's connection
    /// has closed. Before, it was registered at once, and the clean-up that followed (the
    /// edge's end of the session: its router entry, channel memberships and presence, the
    /// backends told it closed) undid the live copy's state.
    #[test]
    fn a_copy_restored_while_the_previous_one_ends_waits_for_that_end() {
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        let player: Arc<str> = "p".into();
        host.open(1);
        host.established(1, [1; 16], player.clone(), 3);
        assert!(host.end_started(&[1; 16], 1));
        assert!(host.is_ending(&[1; 16]));
        assert_eq!(host.session_of(&player), None, "no push finds it");
        let message = || Downstream {
            class: TrafficClass::Normal,
            msg_id: 1,
            payload: bytes::Bytes::from_static(b"x"),
        };
        assert_eq!(
            host.push(&[1; 16], message()),
            Err(PushError::NotFound),
            "nor by its id: it would go with the session unsaid"
        );
        // A resume asking now is told the session ended.
        host.open(2);
        let attempt = ResumeAttempt::proving(&[9; 16], &[1; 16], 1);
        assert_eq!(
            host.request_hand_over(2, [1; 16], attempt.clone(), Instant::now()),
            HandOverStart::Ended
        );
        // One that took the store's copy already waits for the clean-up; a resume asking
        // meanwhile is busy (the session lives on there in a moment), not told it ended.
        host.open(3);
        assert_eq!(
            host.established(3, [1; 16], player.clone(), 4),
            EstablishOutcome::PreviousEnding
        );
        assert_eq!(host.holder_of(&[1; 16]), Some(1));
        host.open(4);
        assert_eq!(
            host.request_hand_over(4, [1; 16], attempt.clone(), Instant::now()),
            HandOverStart::Busy
        );
        host.close(1);
        assert_eq!(
            host.established(3, [1; 16], player.clone(), 4),
            EstablishOutcome::Registered
        );
        assert_eq!(host.holder_of(&[1; 16]), Some(3));
        assert_eq!(host.session_of(&player), Some([1; 16]));
        // The old copy's end, had it come only now, is a stale copy's: it cleans up nothing.
        assert!(!host.end_started(&[1; 16], 1));
        assert!(!host.is_ending(&[1; 16]));
        assert_eq!(host.push(&[1; 16], message()), Ok(()));
        host.check_invariants().expect("invariants");

        // A copy that answered a kick (superseded: the session moved away and came back
        // here) stays, ending, until its connection closes: its end's clean-up runs after
        // the answer, so a copy restored here meanwhile waits too. Before, the answer
        // removed the entry and the restore registered at once.
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        host.open(1);
        host.established(1, [2; 16], player.clone(), 3);
        assert_eq!(host.kick_superseded(&[2; 16], 3), SupersededKick::Kicked);
        host.kicked(1, [2; 16], None);
        assert_eq!(host.holder_of(&[2; 16]), Some(1));
        assert!(host.end_started(&[2; 16], 1), "its end cleans up");
        host.open(2);
        assert_eq!(
            host.established(2, [2; 16], player.clone(), 5),
            EstablishOutcome::PreviousEnding
        );
        host.close(1);
        assert_eq!(
            host.established(2, [2; 16], player.clone(), 5),
            EstablishOutcome::Registered
        );
        // A previous copy stuck in its end is registered over once the wait is given up.
        host.open(3);
        host.end_started(&[2; 16], 2);
        assert_eq!(
            host.established(3, [2; 16], player.clone(), 6),
            EstablishOutcome::PreviousEnding
        );
        host.abandon_end(&[2; 16]);
        assert_eq!(
            host.established(3, [2; 16], player.clone(), 6),
            EstablishOutcome::Registered
        );
        assert_eq!(host.holder_of(&[2; 16]), Some(3));
        // Registered: a resume of it is a hand-over again, not busy for the wait that was.
        host.open(4);
        assert_eq!(
            host.request_hand_over(
                4,
                [2; 16],
                ResumeAttempt::proving(&[9; 16], &[2; 16], 1),
                Instant::now()
            ),
            HandOverStart::Pending
        );
        host.check_invariants().expect("invariants");
    }

    /// A resume of a session whose copy here was superseded by a newer claim of the same
    /// session (it moved to another edge; the kick has not ended the copy yet) asks the
    /// store, which holds the newer owner's snapshot. Before, the host answered `Ended` and
    /// the driver deleted the stored snapshot unfenced — the live owner's — and refused the
    /// resume. Only a copy another session replaced (a newer login) refuses it.
    #[test]
    fn a_resume_of_a_superseded_copy_asks_the_store() {
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        let attempt = ResumeAttempt::proving(&[9; 16], &[1; 16], 1);
        host.open(1);
        host.established(1, [1; 16], "p".into(), 3);
        assert_eq!(host.kick_superseded(&[1; 16], 5), SupersededKick::Kicked);
        host.open(2);
        assert_eq!(
            host.request_hand_over(2, [1; 16], attempt.clone(), Instant::now()),
            HandOverStart::NotLocal
        );
        // Restored from the store on connection 2: the entry is its, no longer ending.
        host.established(2, [1; 16], "p".into(), 6);
        assert_eq!(host.holder_of(&[1; 16]), Some(2));
        assert!(!host.is_ending(&[1; 16]));

        // Replaced by a newer login: the old session is not resumable.
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        host.open(1);
        host.established(1, [1; 16], "q".into(), 3);
        host.open(3);
        host.established(3, [2; 16], "q".into(), 4);
        host.open(2);
        assert_eq!(
            host.request_hand_over(2, [1; 16], attempt, Instant::now()),
            HandOverStart::Ended
        );
    }

    /// A backend's held pushes and its answer, queued together, are taken by the session's
    /// connection in one `Work`, in the order given (PROTOCOL.md §9.6; that the ack then
    /// rides on the reply is checked over real sockets in edge-bin/tests/session_guarantees.rs).
    #[test]
    fn items_queued_together_are_taken_in_one_turn_in_order() {
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        host.open(1);
        host.established(1, [1; 16], "p".into(), 1);
        let reply = |n: u8| {
            OutboundItem::Message(Downstream {
                class: TrafficClass::Normal,
                msg_id: 7,
                payload: Bytes::from(vec![n]),
            })
        };
        for item in [reply(1), reply(2), OutboundItem::Answered(4)] {
            assert_eq!(host.queue_item(&[1; 16], item), Ok(()));
        }
        let work = host.take_work(1);
        assert_eq!(
            work.items,
            vec![reply(1), reply(2), OutboundItem::Answered(4)]
        );
        assert!(host.take_work(1).items.is_empty());
        assert_eq!(
            host.queue_item(&[9; 16], OutboundItem::Answered(1)),
            Err(PushError::NotFound)
        );
    }

    #[test]
    fn a_placement_is_kept_with_a_full_mailbox_and_a_full_queue() {
        // A placement (least loaded, pinned, assigned) went through the holder's mailbox:
        // with 32 commands waiting it was dropped, and as the router's binding was made
        // already nothing sent it again: after a move the session was placed afresh. It is
        // a queue item now, taken with the mailbox full and kept beside a full queue.
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        host.open(1);
        host.established(1, [1; 16], "p".into(), 1);
        for _ in 0..MAILBOX_CAPACITY {
            assert_eq!(host.command(&[1; 16], Command::Quiesce), Ok(()));
        }
        assert_eq!(
            host.command(&[1; 16], Command::Quiesce),
            Err(MailboxError::Full),
            "the mailbox is full"
        );
        let message = || {
            OutboundItem::Message(Downstream {
                class: TrafficClass::Critical,
                msg_id: 7,
                payload: Bytes::from_static(b"m"),
            })
        };
        let mut queued = 0;
        while host.queue_item(&[1; 16], message()).is_ok() {
            queued += 1;
            assert!(queued < 10_000, "the queue never fills");
        }
        assert_eq!(host.bind_placement(&[1; 16], "world", "w-1"), Ok(()));
        let work = host.take_work(1);
        assert_eq!(
            work.items.last(),
            Some(&OutboundItem::Placement {
                service: "world".into(),
                instance: "w-1".into()
            })
        );
        assert_eq!(work.items.len(), queued + 1);
    }

    /// Silent-drop audit: a FORWARD_DONE or an ERROR for a client message that found the
    /// session's queue full was dropped (counted as a lost push): the message stayed in
    /// flight for good, and the client's resend of it after the resume was taken for a
    /// duplicate. Answers are never dropped now: they come after the queue in the next
    /// turn, and nothing counts as lost for them.
    #[test]
    fn an_answer_that_finds_the_queue_full_is_kept() {
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        host.open(1);
        host.established(1, [1; 16], "p".into(), 1);
        let reply = |n: u8| {
            OutboundItem::Message(Downstream {
                class: TrafficClass::Critical,
                msg_id: 7,
                payload: Bytes::from(vec![n]),
            })
        };
        let mut queued = Vec::new();
        for n in 0..=255u8 {
            if host.queue_item(&[1; 16], reply(n)) == Ok(()) {
                queued.push(reply(n));
            } else {
                break;
            }
        }
        assert_eq!(
            host.queue_item(&[1; 16], reply(0)),
            Err(PushError::QueueFull),
            "the queue is full"
        );
        let refused = ErrorReport {
            code: CloseCode::Busy,
            msg_id: 9,
            client_seq: 5,
            retry_after_ms: 0,
        };
        assert_eq!(host.queue_item(&[1; 16], OutboundItem::Answered(4)), Ok(()));
        assert_eq!(
            host.queue_item(&[1; 16], OutboundItem::Error(refused.clone())),
            Ok(())
        );
        // A routing key is kept too (the session's state after a move), behind them; a
        // message is refused as by the full queue (nothing overtakes what waits).
        let key = OutboundItem::RoutingKey {
            service: "s".into(),
            key: "k".into(),
        };
        assert_eq!(host.queue_item(&[1; 16], key.clone()), Ok(()));
        assert_eq!(
            host.queue_item(&[1; 16], reply(9)),
            Err(PushError::QueueFull)
        );
        let work = host.take_work(1);
        assert_eq!(work.lost, 3, "the three messages refused above");
        queued.extend([OutboundItem::Answered(4), OutboundItem::Error(refused), key]);
        assert_eq!(work.items, queued);
        assert!(host.take_work(1).items.is_empty());
    }

    /// The player's limiter outlives its sessions while it is drained (a new login gets the
    /// same bucket) and is swept once it is full again.
    #[test]
    fn a_players_inbound_limiter_survives_its_sessions_until_full_again() {
        let t0 = Instant::now();
        let mut host = SessionHost::new(SessionHost::outbound_for_capacity(8));
        let player: Arc<str> = "p".into();
        host.open(1);
        assert_eq!(
            host.established(1, [1; 16], player.clone(), 1),
            EstablishOutcome::Registered
        );
        for _ in 0..5 {
            assert_eq!(
                host.check_inbound(&[1; 16], limits(), t0, 10),
                Some(InboundVerdict::Accept)
            );
        }
        assert!(matches!(
            host.check_inbound(&[1; 16], limits(), t0, 10),
            Some(InboundVerdict::Wait(_))
        ));
        host.close(1);
        assert_eq!(host.len(), 0);
        assert_eq!(host.limiters(), 1, "drained: kept");
        // A new login of the player finds the drained bucket.
        host.open(2);
        host.established(2, [2; 16], player.clone(), 2);
        assert!(matches!(
            host.check_inbound(&[2; 16], limits(), t0, 10),
            Some(InboundVerdict::Wait(_))
        ));
        host.close(2);
        assert_eq!(
            host.drained.len(),
            1,
            "listed once, however often it drains"
        );
        // Full again after burst / rate: swept.
        host.sweep_limiters(t0 + Duration::from_millis(400));
        assert_eq!(host.limiters(), 1, "not full yet");
        host.sweep_limiters(t0 + Duration::from_secs(1));
        assert_eq!(host.limiters(), 0);
        assert!(host.drained.is_empty(), "the sweep's list empties with it");
    }
}

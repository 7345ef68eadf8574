//! The async driver (tokio): one thin task per connection runs a [`SessionMachine`] over a
//! `Box<dyn Connection>`, plus the edge's [`SessionRegistry`] and the [`UpstreamSink`] the
//! router will implement.
//!
//! The task selects over `conn.recv()` (cancel-safe), its bounded downstream channel, its
//! command channel (kick, hand-over, close, bind, migrate) and the machine's timer, and
//! carries out the machine's [`Action`]s. After the link drops it stays alive without a
//! connection while the session lingers, buffering downstream messages for replay, until the
//! session is resumed on another connection (hand-over), kicked, or expires.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tracing::Instrument as _;
use waygate_protocol::frame::{ErrorReport, SessionId, WelcomeOutcome};
use waygate_transport::{BoxConnection, CloseCode, TrafficClass};

use crate::auth::Authenticator;
use crate::counters::SessionCounters;
use crate::host::{
    apply_work, resume_from_store, Command as HostCommand, ConnTaskId, EstablishOutcome,
    HandOverStart, HostAnswer, Reply, ResumeFromStore, SessionHost, SupersededKick, Work,
};
use crate::machine::{Action, EndReason, SessionConfig, SessionEnd, SessionMachine, Upstream};
use crate::resume::hex_id;
use crate::rng::{SessionRng, SystemRng};
use crate::store::{OwnershipRegistry, Snapshot, SnapshotStore, SnapshotWrite};
pub use crate::write_through::WriteThrough;

/// Why the router could not take an upstream message (answered with an ERROR frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("upstream message refused: {code}")]
pub struct DeliverError {
    /// ERROR frame code (Busy, Unavailable, NoRoute...).
    pub code: CloseCode,
    /// Retry hint in milliseconds.
    pub retry_after_ms: u32,
}

/// Lifecycle news for the edge (router bindings, presence, metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionEvent {
    /// A session became ACTIVE on a connection.
    Established {
        /// Session.
        session_id: SessionId,
        /// Player.
        player_id: Arc<str>,
        /// Ownership fencing token.
        fencing: u64,
        /// How the HELLO was answered.
        outcome: WelcomeOutcome,
        /// The transport (a metric label only).
        transport: waygate_transport::TransportKind,
        /// Time from the connection's hand-over by the listener to ACTIVE (HELLO, auth,
        /// restore): the session-setup phase timing (O1).
        setup: Duration,
        /// Where that time went, phase by phase.
        phases: SetupPhases,
    },
    /// The client's link dropped; the session lingers for `linger` (the backend may keep
    /// the character under server control meanwhile, S8 "degrade").
    Detached {
        /// Session.
        session_id: SessionId,
        /// How long it is kept for resume.
        linger: Duration,
    },
    /// The session holds these bindings (restored or taken over from a kicked session).
    Bound {
        /// Session.
        session_id: SessionId,
        /// service -> instance.
        bindings: BTreeMap<String, String>,
    },
    /// The session holds these routing keys (restored with it): service -> business key.
    RoutingKeys {
        /// Session.
        session_id: SessionId,
        /// service -> key (e.g. `room` -> the room joined).
        keys: BTreeMap<String, String>,
    },
    /// The session was restored as a member of these channels (at these positions): make
    /// it a member here again.
    Channels {
        /// Session.
        session_id: SessionId,
        /// channel -> the last position queued to the client.
        channels: BTreeMap<String, waygate_protocol::channel::ChannelPosition>,
    },
    /// Receipts queued after pushes ([`OutboundItem::Receipt`]) reached the session, and its
    /// state with those pushes was written through (`stored`), or could not be (`false`:
    /// write-through off, paused or failed, or the session ended or moved meanwhile; the
    /// pushes may still reach the client).
    ///
    /// [`OutboundItem::Receipt`]: crate::host::OutboundItem::Receipt
    PushesWritten {
        /// The receipts, in the order they were queued.
        receipts: Vec<u64>,
        /// Whether the session's stored copy holds the pushes before them.
        stored: bool,
    },
    /// The session ended for good; when `released`, unbind `bindings`.
    Ended {
        /// Session.
        session_id: SessionId,
        /// Player.
        player_id: Arc<str>,
        /// Bindings it held.
        bindings: BTreeMap<String, String>,
        /// Why.
        reason: EndReason,
        /// Whether this session still owned the player (false: a newer owner exists and the
        /// bindings are not this session's to release).
        released: bool,
        /// The channels it was a member of, at the position its client acknowledged.
        channels_acked: BTreeMap<String, waygate_protocol::channel::ChannelPosition>,
    },
}

/// The phases of a session's setup (O1), each measured by the driver: the wait for the
/// client's HELLO, the authenticator, the snapshot lookup of a restore (local hand-over or
/// the shared store), and the ownership claim (with the kick of a previous owner).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetupPhases {
    /// The transport's own handshake: from the accept to the listener's hand-over (TLS,
    /// WebSocket upgrade, QUIC handshake and control stream; ~0 for plain TCP; KCP: from
    /// its CONNECT).
    pub transport: Duration,
    /// From the listener's hand-over to the first frame (HELLO).
    pub hello: Duration,
    /// Token verification.
    pub auth: Duration,
    /// Taking the snapshot of the session to restore (zero for a new session).
    pub restore: Duration,
    /// Claiming the player (and kicking a previous owner).
    pub claim: Duration,
}

/// When a delivered upstream message is answered (and so acknowledged to the client:
/// [`SessionMachine::answer_upstream`], PROTOCOL.md §9.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivered {
    /// Now: nothing will say when it was processed (a backend link without FORWARD_DONE).
    Answered,
    /// Later: its processor answers it ([`SessionRegistry::answered`], after the pushes it
    /// sent for it) or refuses it ([`SessionRegistry::report_error`]).
    AwaitingAnswer,
}

/// Where delivered upstream messages go (the router implements it).
#[async_trait]
pub trait UpstreamSink: Send + Sync + 'static {
    /// Routes one upstream message. Returning an error sends an ERROR frame to the client.
    async fn deliver(&self, message: Upstream) -> Result<Delivered, DeliverError>;

    /// Session lifecycle news. Default: ignored.
    async fn session_event(&self, _event: SessionEvent) {}
}

pub use crate::host::{Downstream, OutboundItem, PushError};

struct RegistryInner {
    host: SessionHost,
    /// Each connection task's wake-up (the host names connections, the driver wakes them).
    wakers: HashMap<ConnTaskId, Arc<Notify>>,
}

/// The edge's [`SessionHost`] behind one mutex (never held across an await), with the
/// connection tasks' wake-ups: every call runs the host, then wakes the connections it
/// names. Cheap to clone.
#[derive(Clone)]
pub struct SessionRegistry {
    inner: Arc<Mutex<RegistryInner>>,
}

impl Default for SessionRegistry {
    fn default() -> Self {
        Self::with_outbound(SessionHost::outbound_for_capacity(1024))
    }
}

impl std::fmt::Debug for SessionRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionRegistry")
            .field("sessions", &self.len())
            .finish()
    }
}

impl SessionRegistry {
    /// An empty registry with 1,024-message outbound queues.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty registry whose sessions' outbound queues have `outbound` bounds.
    pub fn with_outbound(outbound: waygate_backpressure::OutboundConfig) -> Self {
        Self {
            inner: Arc::new(Mutex::new(RegistryInner {
                host: SessionHost::new(outbound),
                wakers: HashMap::new(),
            })),
        }
    }

    /// Runs `f` on the host, then wakes every connection it named.
    fn host<R>(&self, f: impl FnOnce(&mut SessionHost) -> R) -> R {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let RegistryInner { host, wakers } = &mut *inner;
        let r = f(host);
        while let Some(conn) = host.poll_wake() {
            if let Some(w) = wakers.get(&conn) {
                w.notify_one();
            }
        }
        r
    }

    fn open(&self, conn: ConnTaskId) -> Arc<Notify> {
        let notify = Arc::new(Notify::new());
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.wakers.insert(conn, notify.clone());
        inner.host.open(conn);
        notify
    }

    fn close_conn(&self, conn: ConnTaskId) {
        self.host(|h| h.close(conn));
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.wakers.remove(&conn);
    }

    /// Observes the outbound queue length of every session held into `observe` (under the
    /// host's lock: keep `observe` cheap).
    pub fn each_queue_length(&self, mut observe: impl FnMut(usize)) {
        self.host(|h| h.queue_lengths().for_each(&mut observe));
    }

    /// Sessions held (live or lingering).
    pub fn len(&self) -> usize {
        self.host(|h| h.len())
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.host(|h| h.is_empty())
    }

    /// The session of a player on this edge.
    pub fn session_of(&self, player_id: &str) -> Option<SessionId> {
        self.host(|h| h.session_of(player_id))
    }

    /// The player of a session on this edge.
    pub fn player_of(&self, session_id: &SessionId) -> Option<Arc<str>> {
        self.host(|h| h.player_of(session_id))
    }

    /// Every session id held (live or lingering).
    pub fn session_ids(&self) -> Vec<SessionId> {
        self.host(|h| h.session_ids())
    }

    /// The host's counters.
    pub fn stats(&self) -> crate::host::HostStats {
        self.host(|h| h.stats())
    }

    /// Queues a downstream message for a session (never waits; see [`PushError`]).
    pub fn push(&self, session_id: &SessionId, message: Downstream) -> Result<(), PushError> {
        self.host(|h| h.push(session_id, message))
    }

    /// Queues the same message for each of `sessions` under one lock (a channel's fan-out),
    /// telling `result` how each went. Never waits.
    pub fn push_each(
        &self,
        sessions: &[SessionId],
        message: &Downstream,
        mut result: impl FnMut(&SessionId, Result<(), PushError>),
    ) {
        self.host(|h| {
            for sid in sessions {
                result(sid, h.push(sid, message.clone()));
            }
        })
    }

    /// Queues a channel membership change the edge's channels took for a session
    /// ([`OutboundItem::Membership`]: `Some` the position a join starts from, `None` a
    /// leave), ahead of its JOINED or LEFT. Never waits.
    pub fn track_membership(
        &self,
        session_id: &SessionId,
        channel: &str,
        joined: Option<waygate_protocol::channel::ChannelPosition>,
    ) -> Result<(), PushError> {
        let item = OutboundItem::Membership {
            channel: channel.to_owned(),
            joined,
        };
        self.host(|h| h.queue_item(session_id, item))
    }

    /// Queues a downstream message for a player's session.
    pub fn push_to_player(&self, player_id: &str, message: Downstream) -> Result<(), PushError> {
        self.host(|h| h.push_to_player(player_id, message))
    }

    /// Queues a downstream message for a player's session, followed by `receipt`: the
    /// session reports it ([`SessionEvent::PushesWritten`]) once its stored copy holds the
    /// message (or could not), and remembers `push_id` (0: none) in its snapshot.
    /// `Ok(false)`: queued, but no report will come (no room for the receipt). Never waits.
    pub fn push_to_player_with_receipt(
        &self,
        player_id: &str,
        message: Downstream,
        receipt: u64,
        push_id: u64,
    ) -> Result<bool, PushError> {
        self.host(|h| h.push_to_player_with_receipt(player_id, message, receipt, push_id))
    }

    /// Records a routing key a backend bound for a session (service -> business key, e.g.
    /// the room joined), in order with the session's pushes; it travels in the session's
    /// snapshot, so a restore on any edge routes by it. Never waits.
    pub fn bind_key(
        &self,
        session_id: &SessionId,
        service: &str,
        key: &str,
    ) -> Result<(), PushError> {
        self.host(|h| h.bind_key(session_id, service, key))
    }

    /// Records that a backend processed one of a session's upstream messages (FORWARD_DONE),
    /// in order with the pushes it sent before: from then on the message is acknowledged to
    /// the client. Never waits.
    pub fn answered(&self, session_id: &SessionId, client_seq: u64) -> Result<(), PushError> {
        self.host(|h| h.answered(session_id, client_seq))
    }

    /// Queues `items` for a session under one lock, so its connection takes them in one
    /// turn: the pushes a backend's handler sent as part of its answer, then the answer
    /// (FORWARD_DONE or the refusal), reach the client in one durable write — never the
    /// reply without the acknowledgement of the message it answers (PROTOCOL.md §9.6).
    /// `result` hears how each item went, with the class of each message. Never waits.
    pub fn queue_together(
        &self,
        session_id: &SessionId,
        items: impl IntoIterator<Item = OutboundItem>,
        mut result: impl FnMut(Option<TrafficClass>, Result<(), PushError>),
    ) {
        self.host(|h| {
            for item in items {
                let class = match &item {
                    OutboundItem::Message(m) => Some(m.class),
                    _ => None,
                };
                result(class, h.queue_item(session_id, item));
            }
        })
    }

    /// Tells a session's client that one of its upstream messages could not be delivered
    /// (an ERROR frame; e.g. a backend refused it after it was forwarded), in order with the
    /// session's pushes. Never waits. A detached session keeps it for its resume; a full
    /// queue counts it as lost, so the session closes with a gap (see [`PushError`]).
    pub fn report_error(
        &self,
        session_id: &SessionId,
        code: CloseCode,
        msg_id: u32,
        client_seq: u64,
        retry_after_ms: u32,
    ) -> Result<(), PushError> {
        let report = ErrorReport {
            code,
            msg_id,
            client_seq,
            retry_after_ms,
        };
        self.host(|h| h.report_error(session_id, report))
    }

    /// Kicks a session held here (KICKED; e.g. a newer login on another edge). Never waits.
    pub fn kick(&self, session_id: &SessionId) -> bool {
        self.host(|h| h.kick(session_id))
    }

    /// Kicks a session held here whose copy with fencing token `fencing` a newer claim
    /// superseded, unless the copy held here is newer or being restored
    /// ([`SessionHost::kick_superseded`]). Never waits.
    pub fn kick_superseded(&self, session_id: &SessionId, fencing: u64) -> SupersededKick {
        self.host(|h| h.kick_superseded(session_id, fencing))
    }

    fn command(&self, session_id: &SessionId, command: HostCommand) -> bool {
        match self.host(|h| h.command(session_id, command)) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, "session command not queued");
                false
            }
        }
    }

    /// Ends a session from the server side with `code`. Never waits; false when the
    /// session is not held here (or its mailbox is full).
    pub fn close(&self, session_id: &SessionId, code: CloseCode) -> bool {
        self.command(session_id, HostCommand::Close(code))
    }

    /// Records a placement for a session (service -> instance; kept across reconnects and
    /// in its snapshot), queued like a routing key: never dropped for a full mailbox or a
    /// full queue. False when the session is not held here.
    pub fn bind(&self, session_id: &SessionId, service: &str, instance: &str) -> bool {
        match self.host(|h| h.bind_placement(session_id, service, instance)) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(%service, %instance, error = %e, "placement not recorded");
                false
            }
        }
    }

    /// Drops a session's connection without a CLOSE (as a network failure would); the
    /// session lingers and the client resumes. For tests and chaos drills.
    pub fn drop_link(&self, session_id: &SessionId) -> bool {
        self.command(session_id, HostCommand::DropLink)
    }

    /// Soft-migrates a session (MIGRATE to `target`).
    pub fn migrate(&self, session_id: &SessionId, target: &str, deadline: Duration) -> bool {
        self.command(
            session_id,
            HostCommand::Migrate(target.to_owned(), deadline),
        )
    }

    /// Hard migration, step 1 (S8): the session stops taking upstream DATA (the client
    /// keeps it unacked and resends it where it moves) while downstream still flows.
    pub fn quiesce(&self, session_id: &SessionId) -> bool {
        self.command(session_id, HostCommand::Quiesce)
    }
}

/// The session layer of one process: everything a session task needs (settings, auth,
/// stores, the registry, the upstream sink, counters), shared by all its sessions; `spawn`
/// runs one task per connection.
pub struct SessionLayer {
    /// This edge's id (ownership records, presence).
    pub edge_id: String,
    /// Session-layer settings.
    pub config: Arc<SessionConfig>,
    /// Token verification.
    pub authenticator: Arc<dyn Authenticator>,
    /// Lingering snapshots (hot or warm tier).
    pub snapshots: Arc<dyn SnapshotStore>,
    /// Single-login ownership.
    pub ownership: Arc<dyn OwnershipRegistry>,
    /// Sessions of this edge.
    pub registry: SessionRegistry,
    /// Where upstream messages and lifecycle events go.
    pub upstream: Arc<dyn UpstreamSink>,
    /// Metrics.
    pub counters: Arc<SessionCounters>,
    /// Per-connection inbound rate limits (B2); `None`: unlimited.
    pub inbound: Option<waygate_backpressure::InboundLimits>,
    /// A frame that cannot be written within this time closes the connection as
    /// SLOW_CONSUMER (B3); the session lingers with everything in its replay buffer.
    pub send_deadline: Duration,
    /// RNG per session machine (default: the OS CSPRNG).
    pub rng: Arc<dyn Fn() -> Box<dyn SessionRng> + Send + Sync>,
    /// Unix seconds for token verification (default: the system clock).
    pub unix_now: Arc<dyn Fn() -> u64 + Send + Sync>,
    /// Write-through to the warm tier (kill -9 durability, see [`WriteThrough`]); `None`
    /// (default): snapshots are written on detach only.
    pub write_through: Option<Arc<WriteThrough>>,
    /// Share of sessions traced at debug level (their span's `sampled` field; the binary's
    /// log filter drops debug and trace events of unsampled sessions). Default 1.0.
    pub trace_sample_rate: f64,
    /// Connections seen, for the sampling decision (an even spread, no RNG).
    traced: AtomicU64,
    /// While not 0: new sessions are refused with this retry-after, ms
    /// ([`SessionLayer::set_new_sessions_refused`]).
    new_sessions_refused_ms: AtomicU64,
}

/// Whether the client sees state from this action (see [`WriteThrough`]).
fn visible(action: &Action) -> bool {
    use waygate_transport::Frame;
    match action {
        Action::Send(Frame::Data(d)) => d.seq > 0 || d.ack.is_some(),
        Action::Send(Frame::Ack { .. } | Frame::Welcome(_) | Frame::Migrate(_)) => true,
        _ => false,
    }
}

impl std::fmt::Debug for SessionLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionLayer")
            .field("edge_id", &self.edge_id)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl SessionLayer {
    /// Embedded defaults: in-memory stores, OS RNG, system clock.
    pub fn new(
        edge_id: impl Into<String>,
        config: SessionConfig,
        authenticator: Arc<dyn Authenticator>,
        upstream: Arc<dyn UpstreamSink>,
    ) -> Self {
        Self {
            edge_id: edge_id.into(),
            config: Arc::new(config),
            authenticator,
            snapshots: Arc::new(crate::store::MemorySnapshotStore::new()),
            ownership: Arc::new(crate::store::MemoryOwnership::new()),
            registry: SessionRegistry::new(),
            upstream,
            counters: Arc::new(SessionCounters::new()),
            inbound: None,
            send_deadline: Duration::from_secs(5),
            rng: Arc::new(|| Box::new(SystemRng::new())),
            unix_now: Arc::new(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0)
            }),
            write_through: None,
            trace_sample_rate: 1.0,
            traced: AtomicU64::new(0),
            new_sessions_refused_ms: AtomicU64::new(0),
        }
    }

    /// From now on, a HELLO without a resume request is refused `overloaded` with
    /// `retry_after` (`None`: new sessions are taken again). The edge's overload level 2
    /// sets it: the players already on the edge get back first.
    pub fn set_new_sessions_refused(&self, retry_after: Option<Duration>) {
        let ms = retry_after.map_or(0, |d| {
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
        });
        self.new_sessions_refused_ms.store(ms, Ordering::Relaxed);
    }

    /// The retry-after new sessions are refused with now, if they are.
    pub fn new_sessions_refused(&self) -> Option<Duration> {
        match self.new_sessions_refused_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Whether the next session is traced at debug level: an even spread at
    /// `trace_sample_rate` (Fibonacci hashing of a counter).
    fn sample_next(&self) -> bool {
        if self.trace_sample_rate >= 1.0 {
            return true;
        }
        let n = self.traced.fetch_add(1, Ordering::Relaxed);
        let spread = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
        (spread as f64) < self.trace_sample_rate * (1u64 << 53) as f64
    }

    /// Spawns the task for one accepted connection.
    pub fn spawn(self: &Arc<Self>, conn: BoxConnection) -> tokio::task::JoinHandle<EndReason> {
        tokio::spawn(run_session(self.clone(), conn))
    }
}

fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

static NEXT_TASK: AtomicU64 = AtomicU64::new(1);

struct Task {
    edge: Arc<SessionLayer>,
    machine: SessionMachine,
    conn: Option<BoxConnection>,
    /// This connection as the host names it.
    id: ConnTaskId,
    /// Woken by the host when there is work for this connection.
    wake: Arc<Notify>,
    /// Work taken from the host and not yet done (taken while waiting for an answer);
    /// boxed, and only while there is some (performance issue, W4).
    backlog: Option<Box<Work>>,
    /// This connection's own inbound limiter, until its player's limiter in the host
    /// governs (then freed: an established session does not carry it).
    inbound: Option<Box<waygate_backpressure::InboundLimiter>>,
    /// A frame over the inbound limit, held until the instant its tokens return; the
    /// connection is not read meanwhile, so nothing later overtakes it (B2).
    held: Option<Box<(waygate_transport::Frame, tokio::time::Instant)>>,
    transport: waygate_transport::TransportKind,
    /// Last snapshot written by write-through (skip identical writes); boxed, as only
    /// sessions with write-through have one.
    durable: Option<Box<Snapshot>>,
    /// The set-up's timings until the session is established (then reported and gone).
    setup: Option<Box<SetupClock>>,
    /// A snapshot this connection handed over after its requester gave up: back to the
    /// store, so a later resume finds it.
    orphaned: Option<Box<Snapshot>>,
    /// Work entered the machine while the session was detached (write-through): nothing
    /// is shown then, so no send triggers the write; it is made durable on its own.
    unsaved: bool,
    /// Receipts of pushes that entered the machine, reported after the next write-through.
    receipts: Vec<u64>,
}

/// A session's set-up timings (O1), kept until it is established: boxed and then dropped,
/// as an established session has no use for them (performance issue, W4).
#[derive(Debug)]
struct SetupClock {
    started: tokio::time::Instant,
    phases: SetupPhases,
    /// Whether the first frame arrived (the HELLO phase ends there).
    heard: bool,
}

/// Most frames a session takes in one turn beyond the one that woke it (write-through:
/// one commit covers them; see `Task::take_ready`).
const MAX_READY_FRAMES: usize = 64;

/// How long a session restored here waits for its previous copy's end to finish
/// ([`EstablishOutcome::PreviousEnding`]: the store and ownership calls, each bounded by its
/// deadline, and the edge's end of the session), and how often it looks.
const PREVIOUS_END_WAIT: Duration = Duration::from_secs(10);
const PREVIOUS_END_POLL: Duration = Duration::from_millis(10);

enum Event {
    Frame(Result<waygate_transport::Frame, CloseCode>),
    /// The host has work for this connection.
    Work,
    /// The machine's deadline, or the held frame's release (its tokens are back).
    Timer,
}

/// Runs one connection's session to its end; returns why it ended.
///
/// Runs inside a `session` span with the connection id, transport, and — once known — the
/// session and player ids.
pub async fn run_session(edge: Arc<SessionLayer>, conn: BoxConnection) -> EndReason {
    let span = tracing::info_span!(
        "session",
        conn = %conn.info().id,
        transport = %conn.info().kind,
        sampled = edge.sample_next(),
        session = tracing::field::Empty,
        player = tracing::field::Empty,
    );
    run_session_inner(edge, conn).instrument(span).await
}

async fn run_session_inner(edge: Arc<SessionLayer>, conn: BoxConnection) -> EndReason {
    let conn_kind = conn.info().kind;
    let accepted_at = conn.info().accepted_at;
    let machine = SessionMachine::new(edge.config.clone(), edge.counters.clone(), (edge.rng)());
    let id = NEXT_TASK.fetch_add(1, Ordering::Relaxed);
    let wake = edge.registry.open(id);
    let mut t = Task {
        edge,
        machine,
        conn: Some(conn),
        id,
        wake,
        backlog: None,
        inbound: None,
        held: None,
        transport: conn_kind,
        durable: None,
        setup: Some(Box::new(SetupClock {
            started: tokio::time::Instant::now(),
            phases: SetupPhases {
                transport: accepted_at.elapsed(),
                ..SetupPhases::default()
            },
            heard: false,
        })),
        orphaned: None,
        unsaved: false,
        receipts: Vec::new(),
    };
    t.inbound = t
        .edge
        .inbound
        .map(|limits| Box::new(waygate_backpressure::InboundLimiter::new(limits, now())));
    // The pre-auth deadline counts from the accept, not from here (hardening item 11).
    let _ = t.machine.handle_link_up_since(now(), accepted_at);
    // One timer for the machine, reset only when its deadline moves (the idle check does not
    // move per frame: see `SessionMachine::poll_timeout`).
    let timer = tokio::time::sleep_until(tokio::time::Instant::now());
    tokio::pin!(timer);
    let mut armed: Option<tokio::time::Instant> = None;
    loop {
        if t.machine.has_actions() || t.orphaned.is_some() {
            // Boxed: the state of sending and of the rare actions lives only while they
            // run, not in every idle session's task (performance issue, W4).
            Box::pin(t.run_actions()).await;
        }
        if std::mem::take(&mut t.unsaved) || !t.receipts.is_empty() {
            // Pushes taken while the client is away are written through too: its edge may
            // die before the client comes back, and the copy it resumes from must hold them.
            // So are pushes whose pusher waits for a receipt and that nothing showed yet.
            Box::pin(t.write_through()).await;
        }
        if t.backlog.is_some() {
            t.do_work();
            continue;
        }
        if t.machine.state().is_terminal() {
            break;
        }
        if t.conn.is_none() {
            t.held = None;
        }
        // The machine's deadline and a held frame's release share the one timer (a second
        // one would sit in every idle session's task: performance issue, W4).
        let machine_deadline = t.machine.poll_timeout().map(tokio::time::Instant::from_std);
        let held_until = t.held.as_ref().map(|held| held.1);
        let deadline = match (machine_deadline, held_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if deadline != armed {
            if let Some(d) = deadline {
                timer.as_mut().reset(d);
            }
            armed = deadline;
        }
        let wake = t.wake.clone();
        // (A block: the event is gone before the awaits below, so the task is not sized
        // to keep a frame beside them.)
        {
            let event = tokio::select! {
                r = recv(&mut t.conn), if held_until.is_none() => Event::Frame(r),
                _ = wake.notified() => Event::Work,
                _ = &mut timer, if armed.is_some() => Event::Timer,
            };
            match event {
                Event::Frame(Ok(frame)) => t.inbound_frame(frame),
                Event::Frame(Err(code)) => {
                    t.conn = None;
                    let _ = t.machine.handle_link_down(now(), code);
                }
                Event::Work => t.take_work(),
                Event::Timer => {
                    // Fired: the next deadline re-arms it, even if equal to this one.
                    armed = None;
                    let fired = tokio::time::Instant::now();
                    if held_until.is_some_and(|at| at <= fired) {
                        // The held frame's tokens are back.
                        if let Some(held) = t.held.take() {
                            t.inbound_frame(held.0);
                        }
                    }
                    if machine_deadline.is_some_and(|at| at <= fired) {
                        t.machine.handle_timeout(now());
                    }
                }
            }
        }
        if t.edge.write_through.is_some() {
            t.take_ready().await;
        }
    }
    Box::pin(t.run_actions()).await;
    t.report_receipts(false).await;
    if let Some(conn) = t.conn.as_mut() {
        conn.close(CloseCode::Normal, "").await;
    }
    // Whatever this connection still holds ends with it (`Drop for Task`, which also runs
    // if the task panics or is aborted); a session it handed over is the new holder's
    // already.
    t.machine
        .end_reason()
        .cloned()
        .unwrap_or(EndReason::HandshakeFailed(CloseCode::Internal))
}

async fn recv(conn: &mut Option<BoxConnection>) -> Result<waygate_transport::Frame, CloseCode> {
    match conn {
        Some(c) => c.recv().await.map_err(|e| e.close_code()),
        None => std::future::pending().await,
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        // An entry left behind would hold its session for good (a restore of an ending
        // one would wait on it, `EstablishOutcome::PreviousEnding`).
        self.edge.registry.close_conn(self.id);
    }
}

impl Task {
    /// One frame read from the connection: through the inbound limiter (B2), then to the
    /// machine. Over the limit the frame is held and the connection is not read until its
    /// tokens return, so the client is slowed by its transport's flow control and nothing
    /// is dropped or reordered; only a frame that can never pass (larger than the byte
    /// burst, which config validation rules out) closes the connection as `rate_limited`.
    fn inbound_frame(&mut self, frame: waygate_transport::Frame) {
        if let Some(setup) = self.setup.as_mut().filter(|s| !s.heard) {
            setup.heard = true;
            setup.phases.hello = setup.started.elapsed();
        }
        let now_t = tokio::time::Instant::now();
        // Once the session is ACTIVE its player's limiter (in the host, kept across
        // reconnects and logins) applies; before, this connection's own.
        let player_verdict = match (self.edge.inbound, self.machine.state()) {
            (Some(limits), crate::machine::State::Active) => {
                let sid = self.machine.session_id();
                let len = frame.encoded_len();
                sid.and_then(|sid| {
                    self.edge
                        .registry
                        .host(|h| h.check_inbound(&sid, limits, now_t.into_std(), len))
                })
            }
            _ => None,
        };
        if player_verdict.is_some() {
            self.inbound = None;
        }
        let verdict = player_verdict.or_else(|| {
            self.inbound
                .as_mut()
                .map(|l| l.check(now_t.into_std(), frame.encoded_len()))
        });
        if let Some(verdict) = verdict {
            use waygate_backpressure::InboundVerdict;
            match verdict {
                InboundVerdict::Accept => {}
                InboundVerdict::Wait(wait) if wait.is_never() => {
                    SessionCounters::bump(&self.edge.counters.rate_limited);
                    tracing::info!("closing a connection whose frame exceeds the byte burst");
                    if let Some(mut conn) = self.conn.take() {
                        // Closed on a task of its own: this path is rare, and an await here
                        // would size every session's task for it (performance issue, W4).
                        tokio::spawn(
                            async move {
                                conn.close(
                                    CloseCode::RateLimited,
                                    "frame over the inbound byte burst",
                                )
                                .await;
                            }
                            .instrument(tracing::Span::current()),
                        );
                    }
                    let _ = self.machine.handle_link_down(now(), CloseCode::RateLimited);
                    return;
                }
                InboundVerdict::Wait(wait) => {
                    SessionCounters::bump(&self.edge.counters.inbound_paused);
                    self.held = Some(Box::new((frame, now_t + wait.0)));
                    return;
                }
            }
        }
        // Only a HELLO asks whether new sessions are taken (not every frame of the hot path).
        if matches!(frame, waygate_transport::Frame::Hello(_)) {
            if let Some(retry_after) = self.edge.new_sessions_refused() {
                self.machine.refuse_new_sessions(retry_after);
            }
        }
        if let Err(e) = self.machine.handle_frame(now(), frame) {
            tracing::debug!(error = %e, "session input refused");
        }
    }

    /// With write-through, whatever else is ready now — frames the connection holds (at
    /// most [`MAX_READY_FRAMES`]) and work the host woke it for — is taken before the actions run,
    /// so one commit covers it all. Without this a session read one frame per commit: with
    /// a store slowed down by a busy machine (80–120 ms a commit) its client's frames piled
    /// up in the transport faster than they were read, and replies came seconds late.
    async fn take_ready(&mut self) {
        let active = |t: &Self| t.machine.state() == crate::machine::State::Active;
        for _ in 0..MAX_READY_FRAMES {
            if !active(self) || self.held.is_some() {
                break;
            }
            // Polled once: `recv` is cancel-safe, so a frame not complete yet stays in
            // the connection for the next turn.
            let ready = tokio::select! {
                biased;
                r = recv(&mut self.conn) => Some(r),
                () = std::future::ready(()) => None,
            };
            match ready {
                Some(Ok(frame)) => self.inbound_frame(frame),
                Some(Err(code)) => {
                    self.conn = None;
                    let _ = self.machine.handle_link_down(now(), code);
                }
                None => break,
            }
        }
        if !active(self) {
            return;
        }
        // Work waits only if the host woke this connection since its last take (the wake's
        // permit, consumed here): no host lock for a turn with nothing to take.
        let woken = tokio::select! {
            biased;
            () = self.wake.notified() => true,
            () = std::future::ready(()) => false,
        };
        if woken {
            self.take_work();
        }
    }

    /// Takes this connection's work from the host and does it.
    fn take_work(&mut self) {
        let registry = self.edge.registry.clone();
        let mut work = Work::default();
        registry.host(|h| h.take_work_into(self.id, &mut work));
        if work.is_empty() {
            return;
        }
        if self.backlog.is_some() {
            self.stash(work);
            self.do_work();
        } else {
            // Nothing waits before it: done as taken (no backlog box to fill and empty).
            work.answer = None;
            self.do_work_on(work);
        }
    }

    /// Adds work taken from the host to the backlog (the answer is the caller's).
    fn stash(&mut self, work: Work) -> Option<HostAnswer> {
        let Work {
            commands,
            items,
            lost,
            answer,
            receipts: _,
        } = work;
        if !items.is_empty() || lost > 0 || !commands.is_empty() {
            let backlog = self.backlog.get_or_insert_with(Box::default);
            backlog.items.extend(items);
            backlog.lost += lost;
            backlog.commands.extend(commands);
        }
        answer
    }

    /// Does the backlog ([`apply_work`]: items, then losses, then commands) and feeds the
    /// machine's replies back to the host.
    fn do_work(&mut self) {
        if let Some(work) = self.backlog.take() {
            self.do_work_on(*work);
        }
    }

    /// Does `work` as [`Task::do_work`] does the backlog; what is left of it is the backlog.
    fn do_work_on(&mut self, mut work: Work) {
        let mut replies = Vec::new();
        let lost = apply_work(&mut self.machine, &mut work, now(), &mut replies);
        self.receipts.append(&mut work.receipts);
        if self.edge.write_through.is_some()
            && self.machine.state() == crate::machine::State::Detached
        {
            self.unsaved = true;
        }
        if lost > 0 {
            SessionCounters::add(&self.edge.counters.downstream_overflowed, lost);
            tracing::info!(
                lost,
                "session queue overflowed: closing as a slow consumer with a gap"
            );
        }
        for reply in replies {
            if reply == Reply::DropLink {
                if self.conn.take().is_some() {
                    let _ = self.machine.handle_link_down(now(), CloseCode::GoingAway);
                }
                continue;
            }
            let registry = self.edge.registry.clone();
            if let Some(snapshot) = registry.host(|h| h.reply(self.id, reply)) {
                // The resume gave up waiting: the session lives on in the store.
                self.orphaned = Some(snapshot);
            }
        }
        if !work.is_empty() {
            // Kept only while it holds work: an idle session keeps no buffers, nor the box.
            self.backlog = Some(Box::new(work));
        }
    }

    /// Waits for the answer to this connection's request (the host answers it or times it
    /// out); work arriving meanwhile goes to the backlog.
    async fn answer(&mut self) -> Option<HostAnswer> {
        let registry = self.edge.registry.clone();
        loop {
            let mut work = Work::default();
            // One turn of the host: an answer that arrived after taking the work but before
            // reading the deadline would be left behind (found by the C echo example under
            // load: the live session's snapshot was dropped and the resume read the store).
            let deadline = registry.host(|h| {
                h.take_work_into(self.id, &mut work);
                h.waiting_deadline(self.id)
            });
            if let Some(answer) = self.stash(work) {
                return Some(answer);
            }
            let deadline = deadline?;
            let deadline = tokio::time::Instant::from_std(deadline);
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    registry.host(|h| h.handle_timeout(now()));
                }
            }
        }
    }

    async fn run_actions(&mut self) {
        if let Some(snapshot) = self.orphaned.take() {
            if let Err(e) = self
                .edge
                .snapshots
                .put(&snapshot, self.edge.config.linger)
                .await
            {
                tracing::warn!(error = %e, "could not store a session nobody resumed");
            }
        }
        if self.edge.write_through.is_none() {
            while let Some(action) = self.machine.poll_action() {
                self.action(action).await;
            }
            return;
        }
        loop {
            let batch: Vec<Action> = std::iter::from_fn(|| self.machine.poll_action()).collect();
            if batch.is_empty() {
                return;
            }
            if batch.iter().any(visible) {
                // Boxed: its state (a snapshot and the commit) is large and lives only
                // while the write is in flight, not in every idle session's task.
                Box::pin(self.write_through()).await;
            }
            for action in batch {
                self.action(action).await;
            }
        }
    }

    /// Whether another connection holds `session_id` now (this machine is a stale copy: the
    /// session was restored elsewhere while this task was stuck, and this copy was told to
    /// end). Its store writes and end must not touch the live session's state.
    fn held_elsewhere(&self, session_id: &SessionId) -> bool {
        self.edge
            .registry
            .host(|h| h.held_elsewhere(session_id, self.id))
    }

    /// Adds to a set-up phase's time (nothing once the session is established).
    fn phase(&mut self, add: impl FnOnce(&mut SetupPhases)) {
        if let Some(setup) = self.setup.as_mut() {
            add(&mut setup.phases);
        }
    }

    /// Writes the session's snapshot to the store unless identical to the last one written,
    /// then reports the receipts waiting for it.
    async fn write_through(&mut self) {
        let stored = self.write_snapshot().await;
        self.report_receipts(stored).await;
    }

    /// Tells the edge the receipts taken so far ([`SessionEvent::PushesWritten`]).
    async fn report_receipts(&mut self, stored: bool) {
        if self.receipts.is_empty() {
            return;
        }
        let receipts = std::mem::take(&mut self.receipts);
        self.edge
            .upstream
            .session_event(SessionEvent::PushesWritten { receipts, stored })
            .await;
    }

    /// A write of `snapshot` was fenced: a newer claim of the session exists (it was
    /// restored on another edge, or its player logged in again), so this copy is stale and
    /// ends now, as the kick notice would end it (a notice can be lost; then the ownership
    /// sweep takes up to `reassert_ms`). Meanwhile it took pushes its client, elsewhere,
    /// never sees (silent-drop audit). A copy claimed here again since is kept.
    fn end_stale_copy(&self, snapshot: &crate::store::Snapshot, write: &str) {
        let kicked = self
            .edge
            .registry
            .kick_superseded(&snapshot.session_id, snapshot.fencing);
        tracing::info!(
            ?kicked,
            write,
            "fenced: a newer owner holds the session; this copy ends"
        );
    }

    /// The write of [`Self::write_through`]: whether the store holds the session's state now.
    async fn write_snapshot(&mut self) -> bool {
        let Some(wt) = self.edge.write_through.clone() else {
            return false;
        };
        let Some(snapshot) = self.machine.checkpoint() else {
            return false;
        };
        // Identical first: it needs no host lock (the hot path of a busy session).
        if self.durable.as_deref() == Some(&snapshot) {
            return true;
        }
        if self.held_elsewhere(&snapshot.session_id) {
            return false;
        }
        if wt.paused() {
            wt.skipped();
            return false;
        }
        // The store may write only what changed since the last acknowledged write; after
        // a failure it is not known what the store holds, so the next write is whole.
        let write = SnapshotWrite {
            snapshot: snapshot.clone(),
            since: self.durable.take(),
        };
        match wt.commit(write).await {
            Ok(()) => {
                self.durable = Some(Box::new(snapshot));
                true
            }
            Err(crate::store::StoreError::Fenced) => {
                self.end_stale_copy(&snapshot, "write-through");
                false
            }
            Err(e) => {
                tracing::debug!(error = %e, "write-through failed");
                false
            }
        }
    }

    /// One action of the machine: sending and delivering inline (every message), the
    /// rest boxed.
    async fn action(&mut self, action: Action) {
        match action {
            Action::Send(frame) => self.send_frame(frame).await,
            Action::Deliver(message) => self.deliver(message).await,
            // The rest (set-up, store, end) is rare and its state is large: boxed, so an
            // idle session's task does not carry room for it (performance issue, W4).
            other => Box::pin(self.rare_action(other)).await,
        }
    }

    /// One DATA, ACK or other frame to the client, within the send deadline.
    async fn send_frame(&mut self, frame: waygate_transport::Frame) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if matches!(frame, waygate_transport::Frame::Welcome(_)) {
            // Past the handshake: the connection's admission slot is freed and full-size
            // frames are accepted from here on.
            conn.handshake_done();
        }
        match tokio::time::timeout(self.edge.send_deadline, conn.send(&frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "send failed");
                if e.is_fatal() {
                    self.conn = None;
                    let _ = self.machine.handle_link_down(now(), e.close_code());
                }
            }
            Err(_) => {
                // The client does not read: close it as a slow consumer; the session
                // lingers with its replay buffer for the resume (B3).
                SessionCounters::bump(&self.edge.counters.slow_consumer);
                tracing::info!("closing a slow consumer");
                if let Some(mut conn) = self.conn.take() {
                    conn.close(CloseCode::SlowConsumer, "too slow").await;
                }
                let _ = self
                    .machine
                    .handle_link_down(now(), CloseCode::SlowConsumer);
            }
        }
    }

    /// One client message to its backend; answered at once, later (FORWARD_DONE), or
    /// refused with an ERROR for the client.
    async fn deliver(&mut self, message: Upstream) {
        let (msg_id, seq) = (message.msg_id, message.seq);
        // Errors: the session ended meanwhile, nobody is left to answer.
        let _ = match self.edge.upstream.deliver(message).await {
            Ok(Delivered::Answered) => self.machine.answer_upstream(now(), seq),
            Ok(Delivered::AwaitingAnswer) => Ok(()),
            Err(e) => self
                .machine
                .report_error(now(), e.code, msg_id, seq, e.retry_after_ms),
        };
    }

    /// Whether the client closed its connection while the handshake waited (a client that
    /// gave up on a slow edge and resumed elsewhere): then the handshake ends here as a
    /// link loss (a snapshot already taken is put back) before it takes the session's
    /// snapshot or the player's ownership from the copy the client uses now. Looks without
    /// waiting and without reading a frame ([`waygate_transport::Connection::peer_closed`]: what arrived stays
    /// for the loop and is read under the limits in force then), after one yield so the
    /// runtime has taken in what the sockets reported.
    async fn client_gone(&mut self) -> bool {
        tokio::task::yield_now().await;
        let Some(conn) = self.conn.as_mut() else {
            return false;
        };
        if !conn.peer_closed() {
            return false;
        }
        tracing::debug!(conn = %conn.info().id, "client gone during the handshake");
        self.conn = None;
        let _ = self.machine.handle_link_down(now(), CloseCode::Normal);
        true
    }

    /// The actions other than [`Action::Send`] and [`Action::Deliver`] (those two are
    /// passed on to the same handlers [`Task::action`] uses, so the match stays whole).
    async fn rare_action(&mut self, action: Action) {
        let edge = self.edge.clone();
        match action {
            Action::Send(frame) => self.send_frame(frame).await,
            Action::Deliver(message) => self.deliver(message).await,
            Action::Close { code, message } => {
                if let Some(mut conn) = self.conn.take() {
                    conn.close(code, &message).await;
                }
            }
            Action::Authenticate { token } => {
                let t0 = tokio::time::Instant::now();
                let result = edge
                    .authenticator
                    .authenticate(&token, (edge.unix_now)())
                    .await;
                self.phase(|p| p.auth += t0.elapsed());
                let _ = self.machine.handle_auth_result(now(), result);
            }
            Action::CheckAllowed { player_id } => {
                let t0 = tokio::time::Instant::now();
                let result = edge
                    .authenticator
                    .still_allowed(&player_id, (edge.unix_now)())
                    .await;
                self.phase(|p| p.auth += t0.elapsed());
                let _ = self.machine.handle_allowed(now(), result);
            }
            Action::TakeSnapshot {
                session_id,
                attempt,
            } => {
                if self.client_gone().await {
                    return;
                }
                let t0 = tokio::time::Instant::now();
                let start = edge
                    .registry
                    .host(|h| h.request_hand_over(self.id, session_id, attempt.clone(), now()));
                let answer = match start {
                    HandOverStart::Pending => self.answer().await,
                    HandOverStart::NotLocal | HandOverStart::Ended | HandOverStart::Busy => None,
                };
                // Decided here (taken, mismatch, ended by a takeover, or busy), or ask the
                // store.
                let result = match resume_from_store(start, answer) {
                    ResumeFromStore::Busy => {
                        self.phase(|p| p.restore += t0.elapsed());
                        let _ = self.machine.handle_hand_over_busy(now());
                        return;
                    }
                    ResumeFromStore::TakeProven => {
                        edge.snapshots.take_proven(&session_id, &attempt).await
                    }
                    ResumeFromStore::Decided { outcome, delete } => {
                        if let Some(fencing) = delete {
                            let _ = edge.snapshots.delete(&session_id, fencing).await;
                        }
                        Ok(outcome)
                    }
                };
                self.phase(|p| p.restore += t0.elapsed());
                let _ = self.machine.handle_snapshot(now(), result);
            }
            Action::PutBack(snapshot) => {
                if let Err(e) = edge.snapshots.put(&snapshot, edge.config.linger).await {
                    tracing::warn!(error = %e, "could not put a snapshot back");
                }
            }
            Action::Claim {
                player_id,
                session_id,
            } => {
                if self.client_gone().await {
                    return;
                }
                let t0 = tokio::time::Instant::now();
                let result = match edge
                    .ownership
                    .claim(&player_id, &session_id, &edge.edge_id)
                    .await
                {
                    Err(e) => Err(e),
                    Ok(grant) => {
                        let plan = edge.registry.host(|h| {
                            h.take_over(self.id, session_id, grant.previous.as_ref(), now())
                        });
                        let mut inherited = None;
                        if plan.kick_pending {
                            if let Some(HostAnswer::Kicked(bindings)) = self.answer().await {
                                inherited = bindings;
                            }
                        }
                        if let Some(prev) = plan.previous {
                            // A lingering snapshot of the kicked session must not be
                            // resumable any more (deleted even when it cannot be read,
                            // e.g. sealed with a secret this edge lacks); its bindings
                            // pass to us.
                            let stored = edge.snapshots.get(&prev).await;
                            let _ = edge.snapshots.delete(&prev, None).await;
                            if let (Ok(Some(s)), None) = (stored, &inherited) {
                                inherited = Some(s.bindings);
                            }
                            tracing::info!(
                                player = %player_id,
                                kicked = %hex_id(&prev),
                                edge = ?grant.previous.as_ref().map(|p| &p.edge),
                                "single login: previous session taken over"
                            );
                        }
                        Ok((grant, inherited))
                    }
                };
                self.phase(|p| p.claim += t0.elapsed());
                let _ = self.machine.handle_claimed(now(), result);
            }
            Action::Established {
                session_id,
                player_id,
                fencing,
                outcome,
            } => {
                let setup = self.setup.take();
                let pushes = self.machine.push_ids();
                let register = |h: &mut SessionHost| {
                    let outcome = h.established(self.id, session_id, player_id.clone(), fencing);
                    if outcome != EstablishOutcome::PreviousEnding {
                        h.restored_pushes(&session_id, pushes);
                    }
                    outcome
                };
                let mut outcome_here = edge.registry.host(register);
                let waiting_since = tokio::time::Instant::now();
                while outcome_here == EstablishOutcome::PreviousEnding
                    && waiting_since.elapsed() < PREVIOUS_END_WAIT
                {
                    // Restored here while this session's previous copy cleans up after
                    // its end (it took the store's copy before that clean-up deleted it):
                    // registered once that copy's connection has closed.
                    tokio::time::sleep(PREVIOUS_END_POLL).await;
                    outcome_here = edge.registry.host(register);
                }
                if outcome_here == EstablishOutcome::PreviousEnding {
                    // That copy is stuck: registered over it, as before the rule (it is told
                    // to close; its clean-up, if it ever runs, may undo part of this copy's
                    // state).
                    tracing::warn!(
                        session = %hex_id(&session_id),
                        "the session's previous copy here did not finish its end within {:?}; \
                         registered over it",
                        PREVIOUS_END_WAIT
                    );
                    outcome_here = edge.registry.host(|h| {
                        h.abandon_end(&session_id);
                        register(h)
                    });
                }
                if outcome_here == EstablishOutcome::LostRace {
                    tracing::info!(player = %player_id, "a newer local login holds the player; kicked");
                    let _ = self.machine.kick(now());
                }
                let span = tracing::Span::current();
                span.record("session", tracing::field::display(hex_id(&session_id)));
                span.record("player", tracing::field::display(&player_id));
                // Two logins of one player racing between claim and registration: the
                // one with the older fencing token yields.
                let registered = outcome_here == EstablishOutcome::Registered;
                if let Ok(Some(owner)) = edge.ownership.owner(&player_id).await {
                    if registered && owner.fencing > fencing {
                        tracing::info!(player = %player_id, "lost a login race; kicked");
                        let _ = self.machine.kick(now());
                    }
                }
                edge.upstream
                    .session_event(SessionEvent::Established {
                        session_id,
                        player_id,
                        fencing,
                        outcome,
                        transport: self.transport,
                        setup: setup
                            .as_ref()
                            .map_or(Duration::ZERO, |s| s.started.elapsed()),
                        phases: setup.map_or_else(SetupPhases::default, |s| s.phases),
                    })
                    .await;
            }
            Action::RoutingKeys(keys) => {
                if let Some(session_id) = self.machine.session_id() {
                    edge.upstream
                        .session_event(SessionEvent::RoutingKeys { session_id, keys })
                        .await;
                }
            }
            Action::Channels(channels) => {
                if let Some(session_id) = self.machine.session_id() {
                    edge.upstream
                        .session_event(SessionEvent::Channels {
                            session_id,
                            channels,
                        })
                        .await;
                }
            }
            Action::Bind(bindings) => {
                if let Some(session_id) = self.machine.session_id() {
                    edge.upstream
                        .session_event(SessionEvent::Bound {
                            session_id,
                            bindings,
                        })
                        .await;
                }
            }
            Action::Persist(snapshot) if self.held_elsewhere(&snapshot.session_id) => {
                // Never overwrite the store copy of the connection that holds it now.
                tracing::info!(session = %hex_id(&snapshot.session_id), "stale copy not persisted");
            }
            Action::Persist(snapshot) => {
                let session_id = snapshot.session_id;
                // Already written through unchanged: writing again could re-create a copy
                // another edge has taken meanwhile (a migrated client restores at once).
                if self.durable.as_deref() != Some(&*snapshot) {
                    match edge.snapshots.put(&snapshot, edge.config.linger).await {
                        // What the store holds now: the base of the next write-through's
                        // delta (pushes taken while the session lingers).
                        Ok(()) if edge.write_through.is_some() => self.durable = Some(snapshot),
                        Ok(()) => {}
                        // The session was claimed elsewhere since (it moved on): fencing
                        // kept this stale copy out of the store, as it should.
                        Err(crate::store::StoreError::Fenced) => {
                            self.end_stale_copy(&snapshot, "persist on detach");
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "could not persist a session snapshot")
                        }
                    }
                }
                edge.upstream
                    .session_event(SessionEvent::Detached {
                        session_id,
                        linger: edge.config.linger,
                    })
                    .await;
            }
            Action::Ended(SessionEnd {
                session_id,
                player_id,
                fencing,
                bindings,
                reason,
                channels_acked,
            }) => {
                if !edge.registry.host(|h| h.end_started(&session_id, self.id)) {
                    // A stale copy (restored elsewhere while this task was stuck) ends: the
                    // session itself lives on there, with its ownership, store copy and
                    // router entry.
                    tracing::info!(session = %hex_id(&session_id), "stale copy of a session ended");
                    return;
                }
                // From here a copy restored on this edge waits until this connection has
                // closed (`EstablishOutcome::PreviousEnding`): none of what follows can undo
                // its state (router entry, channel memberships, presence).
                let released = edge
                    .ownership
                    .release(&player_id, &session_id, fencing)
                    .await
                    .unwrap_or(false);
                let _ = edge.snapshots.delete(&session_id, Some(fencing)).await;
                edge.upstream
                    .session_event(SessionEvent::Ended {
                        session_id,
                        player_id,
                        bindings,
                        reason,
                        released,
                        channels_acked,
                    })
                    .await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `trace_sample_rate` picks an even share of sessions (deterministically, no RNG).
    #[test]
    fn trace_sampling_picks_its_share_of_sessions() {
        let (mut layer, _) = crate::testkit::echo_edge("e", SessionConfig::default());
        assert!((0..100).all(|_| layer.sample_next()), "1.0: every session");
        for rate in [0.0, 0.01, 0.25, 0.5] {
            layer.trace_sample_rate = rate;
            let picked = (0..100_000).filter(|_| layer.sample_next()).count() as f64;
            let want = rate * 100_000.0;
            assert!(
                (picked - want).abs() <= 100_000.0 * 0.005,
                "rate {rate}: {picked}"
            );
        }
    }
}

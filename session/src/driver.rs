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
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument as _;
use waygate_protocol::frame::{ErrorReport, SessionId, WelcomeOutcome};
use waygate_transport::{BoxConnection, CloseCode, TrafficClass};

use crate::auth::Authenticator;
use crate::counters::SessionCounters;
use crate::machine::{
    Action, EndReason, ResumeAttempt, SessionConfig, SessionEnd, SessionMachine, Upstream,
};
use crate::resume::hex_id;
use crate::rng::{SessionRng, SystemRng};
use crate::store::{OwnershipRegistry, Snapshot, SnapshotStore, TakeOutcome};

/// How long a new connection waits for a live local session to hand itself over.
const HAND_OVER_TIMEOUT: Duration = Duration::from_secs(2);

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
    },
}

/// The phases of a session's setup (O1), each measured by the driver: the wait for the
/// client's HELLO, the authenticator, the snapshot lookup of a restore (local hand-over or
/// the shared store), and the ownership claim (with the kick of a previous owner).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetupPhases {
    /// From the listener's hand-over to the first frame (HELLO).
    pub hello: Duration,
    /// Token verification.
    pub auth: Duration,
    /// Taking the snapshot of the session to restore (zero for a new session).
    pub restore: Duration,
    /// Claiming the player (and kicking a previous owner).
    pub claim: Duration,
}

/// Where delivered upstream messages go (the router implements it).
#[async_trait]
pub trait UpstreamSink: Send + Sync + 'static {
    /// Routes one upstream message. Returning an error sends an ERROR frame to the client.
    async fn deliver(&self, message: Upstream) -> Result<(), DeliverError>;

    /// Session lifecycle news. Default: ignored.
    async fn session_event(&self, _event: SessionEvent) {}
}

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

/// What travels down a session's queue, in the order its link delivered it: messages, and
/// the routing keys backends bind between them (so a key bound before a push is in the
/// session's snapshot before that push is shown to the client).
#[derive(Debug, Clone, PartialEq, Eq)]
enum DownstreamItem {
    Message(Downstream),
    RoutingKey { service: String, key: String },
    Error(ErrorReport),
}

/// Why [`SessionRegistry::push`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PushError {
    /// No live or lingering session with that id (or player) on this edge.
    #[error("no such session on this edge")]
    NotFound,
    /// The session's bounded outbound queue is full.
    #[error("session outbound queue full")]
    QueueFull,
    /// A best-effort message shed because the session's queue is congested (B3).
    #[error("best-effort message shed (queue congested)")]
    Shed,
}

/// A hand-over answer: on success the session's downstream channel moves with it, so a
/// message pushed during the switch is not lost.
struct HandOver {
    outcome: TakeOutcome,
    channel: Option<(DownstreamTx, mpsc::Receiver<DownstreamItem>)>,
}

enum Command {
    Kick(oneshot::Sender<Option<BTreeMap<String, String>>>),
    HandOver(ResumeAttempt, oneshot::Sender<HandOver>),
    Close(CloseCode),
    Bind(String, String),
    Migrate(String, Duration),
    Quiesce,
    DropLink,
}

#[derive(Clone)]
struct Handle {
    task: u64,
    player_id: Arc<str>,
    commands: mpsc::Sender<Command>,
    downstream: DownstreamTx,
}

/// A session's downstream queue as pushers see it: the bounded channel, and how many
/// sequenced messages it refused because it was full. Those are never dropped silently:
/// the session's task declares them lost in its replay buffer and closes the connection as
/// `slow_consumer`, so the client's resume reports `RestoredWithGap` (B3). Moves with the
/// channel on a hand-over.
#[derive(Clone)]
struct DownstreamTx {
    tx: mpsc::Sender<DownstreamItem>,
    overflowed: Arc<AtomicU64>,
}

#[derive(Default)]
struct RegistryInner {
    sessions: HashMap<SessionId, Handle>,
    players: HashMap<Arc<str>, SessionId>,
}

/// Live and lingering sessions of this edge, by session id and by player id. Cheap to clone.
/// Never holds its lock across an await.
#[derive(Clone, Default)]
pub struct SessionRegistry {
    inner: Arc<Mutex<RegistryInner>>,
}

impl std::fmt::Debug for SessionRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionRegistry")
            .field("sessions", &self.len())
            .finish()
    }
}

/// Queues an item on a session's downstream channel without waiting.
fn try_queue(handle: &Handle, item: DownstreamItem) -> Result<(), PushError> {
    let sequenced = match &item {
        DownstreamItem::Message(m) => m.class != TrafficClass::BestEffort,
        DownstreamItem::RoutingKey { .. } | DownstreamItem::Error(_) => true,
    };
    handle.downstream.tx.try_send(item).map_err(|e| match e {
        mpsc::error::TrySendError::Full(_) => {
            if sequenced {
                handle.downstream.overflowed.fetch_add(1, Ordering::AcqRel);
            }
            PushError::QueueFull
        }
        mpsc::error::TrySendError::Closed(_) => PushError::NotFound,
    })
}

impl SessionRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RegistryInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn insert(&self, session_id: SessionId, handle: Handle) {
        let mut inner = self.lock();
        inner.players.insert(handle.player_id.clone(), session_id);
        inner.sessions.insert(session_id, handle);
    }

    fn remove_if(&self, session_id: &SessionId, pred: impl Fn(&Handle) -> bool) {
        let mut inner = self.lock();
        if inner.sessions.get(session_id).is_some_and(pred) {
            if let Some(h) = inner.sessions.remove(session_id) {
                if inner.players.get(&h.player_id) == Some(session_id) {
                    inner.players.remove(&h.player_id);
                }
            }
        }
    }

    fn handle(&self, session_id: &SessionId) -> Option<Handle> {
        self.lock().sessions.get(session_id).cloned()
    }

    /// Sends `command` to a session's task; false when the session is not held here.
    async fn command(&self, session_id: &SessionId, command: Command) -> bool {
        match self.handle(session_id) {
            Some(h) => h.commands.send(command).await.is_ok(),
            None => false,
        }
    }

    /// Sessions held (live or lingering).
    pub fn len(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.lock().sessions.is_empty()
    }

    /// The session of a player on this edge.
    pub fn session_of(&self, player_id: &str) -> Option<SessionId> {
        self.lock().players.get(player_id).copied()
    }

    /// The player of a session on this edge.
    pub fn player_of(&self, session_id: &SessionId) -> Option<Arc<str>> {
        self.lock()
            .sessions
            .get(session_id)
            .map(|h| h.player_id.clone())
    }

    /// Queues a downstream message for a session (never waits: a full queue is an error).
    pub fn push(&self, session_id: &SessionId, message: Downstream) -> Result<(), PushError> {
        let handle = self.handle(session_id).ok_or(PushError::NotFound)?;
        // Best-effort goes first when the queue is congested (above 3/4 full), so the room
        // left is kept for sequenced messages (B3).
        if message.class == TrafficClass::BestEffort
            && handle.downstream.tx.capacity() * 4 < handle.downstream.tx.max_capacity()
        {
            return Err(PushError::Shed);
        }
        try_queue(&handle, DownstreamItem::Message(message))
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
        let handle = self.handle(session_id).ok_or(PushError::NotFound)?;
        let item = DownstreamItem::RoutingKey {
            service: service.to_owned(),
            key: key.to_owned(),
        };
        try_queue(&handle, item)
    }

    /// Queues a downstream message for a player's session.
    pub fn push_to_player(&self, player_id: &str, message: Downstream) -> Result<(), PushError> {
        let session = self.session_of(player_id).ok_or(PushError::NotFound)?;
        self.push(&session, message)
    }

    /// Kicks a session (KICKED); returns its bindings for the session taking over.
    pub async fn kick(&self, session_id: &SessionId) -> Option<BTreeMap<String, String>> {
        let handle = self.handle(session_id)?;
        let (tx, rx) = oneshot::channel();
        handle.commands.send(Command::Kick(tx)).await.ok()?;
        tokio::time::timeout(HAND_OVER_TIMEOUT, rx)
            .await
            .ok()?
            .ok()
            .flatten()
    }

    /// Ends a session from the server side with `code`.
    pub async fn close(&self, session_id: &SessionId, code: CloseCode) -> bool {
        self.command(session_id, Command::Close(code)).await
    }

    /// Records a backend binding for a session (kept across reconnects).
    pub async fn bind(&self, session_id: &SessionId, service: &str, instance: &str) -> bool {
        let bind = Command::Bind(service.to_owned(), instance.to_owned());
        self.command(session_id, bind).await
    }

    /// Drops a session's connection without a CLOSE (as a network failure would); the
    /// session lingers and the client resumes. For tests and chaos drills.
    pub async fn drop_link(&self, session_id: &SessionId) -> bool {
        self.command(session_id, Command::DropLink).await
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
        let handle = self.handle(session_id).ok_or(PushError::NotFound)?;
        let report = ErrorReport {
            code,
            msg_id,
            client_seq,
            retry_after_ms,
        };
        try_queue(&handle, DownstreamItem::Error(report))
    }

    /// Ends a session from the server side with `code` without waiting: the command is
    /// queued at once, or (its command queue full) handed to a task that waits for room.
    /// False when the session is not held here.
    pub fn close_soon(&self, session_id: &SessionId, code: CloseCode) -> bool {
        let Some(handle) = self.handle(session_id) else {
            return false;
        };
        match handle.commands.try_send(Command::Close(code)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(cmd)) => {
                tokio::spawn(async move {
                    let _ = handle.commands.send(cmd).await;
                });
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Soft-migrates a session (MIGRATE to `target`).
    pub async fn migrate(&self, session_id: &SessionId, target: &str, deadline: Duration) -> bool {
        let migrate = Command::Migrate(target.to_owned(), deadline);
        self.command(session_id, migrate).await
    }

    /// Hard migration, step 1 (S8): the session stops taking upstream DATA (the client
    /// keeps it unacked and resends it where it moves) while downstream still flows.
    pub async fn quiesce(&self, session_id: &SessionId) -> bool {
        self.command(session_id, Command::Quiesce).await
    }

    /// Every session id held (live or lingering).
    pub fn session_ids(&self) -> Vec<SessionId> {
        self.lock().sessions.keys().copied().collect()
    }

    /// Asks a local session to hand itself over to a resuming connection. `None` when the
    /// session is not held here (or did not answer in time).
    async fn hand_over(&self, session_id: &SessionId, attempt: ResumeAttempt) -> Option<HandOver> {
        let handle = self.handle(session_id)?;
        let (tx, rx) = oneshot::channel();
        handle
            .commands
            .send(Command::HandOver(attempt, tx))
            .await
            .ok()?;
        tokio::time::timeout(HAND_OVER_TIMEOUT, rx).await.ok()?.ok()
    }
}

/// The session layer of one process: everything a session task needs (settings, auth,
/// stores, the registry, the upstream sink, counters), shared by all its sessions; `spawn`
/// runs one task per connection.
pub struct SessionLayer {
    /// This edge's id (ownership records, presence).
    pub edge_id: String,
    /// Session-layer settings.
    pub config: SessionConfig,
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
    /// Capacity of each session's downstream channel.
    pub outbound_capacity: usize,
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
}

/// Durable before visible: with a shared snapshot store, every batch of actions that
/// shows the client new state (DATA with a seq, ACK, WELCOME, MIGRATE) is preceded by one
/// write of the session's snapshot, so a client can never hold a sequence number, an ack
/// or a resume token the warm tier does not know; after the edge dies it restores on any
/// edge. A failed write does not hold the session back: writes pause for
/// [`WriteThrough::pause`] (store down) and traffic flows undurably meanwhile (counted).
#[derive(Debug)]
pub struct WriteThrough {
    /// How long writes pause after a failure.
    pub pause: Duration,
    paused_until: Mutex<Option<std::time::Instant>>,
    /// Snapshots written.
    pub writes: AtomicU64,
    /// Writes that failed (or were skipped while paused).
    pub failures: AtomicU64,
}

impl WriteThrough {
    /// Write-through pausing `pause` after a failure.
    pub fn new(pause: Duration) -> Self {
        Self {
            pause,
            paused_until: Mutex::new(None),
            writes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }
    }

    fn paused(&self) -> bool {
        let p = self.paused_until.lock().unwrap_or_else(|e| e.into_inner());
        p.is_some_and(|t| now() < t)
    }

    fn failed(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        *self.paused_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(now() + self.pause);
    }
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
            config,
            authenticator,
            snapshots: Arc::new(crate::store::MemorySnapshotStore::new()),
            ownership: Arc::new(crate::store::MemoryOwnership::new()),
            registry: SessionRegistry::new(),
            upstream,
            counters: Arc::new(SessionCounters::new()),
            outbound_capacity: 1024,
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
    task: u64,
    registered: Option<SessionId>,
    commands_tx: mpsc::Sender<Command>,
    downstream_tx: DownstreamTx,
    downstream_rx: Option<mpsc::Receiver<DownstreamItem>>,
    adopted: Option<SessionId>,
    inbound: Option<waygate_backpressure::InboundLimiter>,
    /// A frame over the inbound limit, held until the instant its tokens return; the
    /// connection is not read meanwhile, so nothing later overtakes it (B2).
    held: Option<(waygate_transport::Frame, tokio::time::Instant)>,
    transport: waygate_transport::TransportKind,
    started: tokio::time::Instant,
    /// Last snapshot written by write-through (skip identical writes).
    durable: Option<Snapshot>,
    /// Setup phase timings, reported with `Established`.
    phases: SetupPhases,
    /// Whether the first frame arrived (the HELLO phase ends there).
    heard: bool,
}

enum Event {
    Frame(Result<waygate_transport::Frame, CloseCode>),
    /// The held frame's tokens are back.
    Release,
    Command(Command),
    Downstream(DownstreamItem),
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
    let (commands_tx, mut commands) = mpsc::channel(8);
    let (downstream_tx, downstream_rx) = mpsc::channel(edge.outbound_capacity.max(1));
    let machine = SessionMachine::new(edge.config.clone(), edge.counters.clone(), (edge.rng)());
    let mut t = Task {
        edge,
        machine,
        conn: Some(conn),
        task: NEXT_TASK.fetch_add(1, Ordering::Relaxed),
        registered: None,
        commands_tx,
        downstream_tx: DownstreamTx {
            tx: downstream_tx,
            overflowed: Arc::new(AtomicU64::new(0)),
        },
        downstream_rx: Some(downstream_rx),
        adopted: None,
        inbound: None,
        held: None,
        transport: conn_kind,
        started: tokio::time::Instant::now(),
        durable: None,
        phases: SetupPhases::default(),
        heard: false,
    };
    t.inbound = t
        .edge
        .inbound
        .map(|limits| waygate_backpressure::InboundLimiter::new(limits, now()));
    let _ = t.machine.handle_link_up(now());
    loop {
        t.run_actions().await;
        if t.machine.state().is_terminal() {
            break;
        }
        let deadline = t.machine.poll_timeout().map(tokio::time::Instant::from_std);
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let registered = t.registered.is_some();
        if registered {
            t.take_overflow();
        }
        if t.conn.is_none() {
            t.held = None;
        }
        let held_until = t.held.as_ref().map(|(_, at)| *at);
        let release = async {
            match held_until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            r = recv(&mut t.conn), if held_until.is_none() => Event::Frame(r),
            _ = release => Event::Release,
            Some(cmd) = commands.recv() => Event::Command(cmd),
            Some(msg) = recv_down(&mut t.downstream_rx), if registered => Event::Downstream(msg),
            _ = sleep => Event::Timer,
        };
        match event {
            Event::Frame(Ok(frame)) => t.inbound_frame(frame).await,
            Event::Release => {
                if let Some((frame, _)) = t.held.take() {
                    t.inbound_frame(frame).await;
                }
            }
            Event::Frame(Err(code)) => {
                t.conn = None;
                let _ = t.machine.handle_link_down(now(), code);
            }
            Event::Command(cmd) => t.command(cmd),
            Event::Downstream(msg) => t.downstream(msg),
            Event::Timer => t.machine.handle_timeout(now()),
        }
    }
    t.run_actions().await;
    if let Some(conn) = t.conn.as_mut() {
        conn.close(CloseCode::Normal, "").await;
    }
    let superseded = t.machine.end_reason() == Some(&EndReason::Superseded);
    match (t.registered, t.adopted) {
        // Superseded: the entry stays until the new connection registers, so pushes keep
        // landing in the (handed-over) downstream channel meanwhile.
        (Some(_), _) if superseded => {}
        (Some(id), _) => t
            .edge
            .registry
            .remove_if(&id, |h: &Handle| h.task == t.task),
        // Adopted a channel but never got ACTIVE: drop the stale entry of the old task.
        (None, Some(id)) => t.edge.registry.remove_if(&id, |h: &Handle| {
            h.downstream.tx.same_channel(&t.downstream_tx.tx)
        }),
        (None, None) => {}
    }
    t.machine
        .end_reason()
        .cloned()
        .unwrap_or(EndReason::HandshakeFailed(CloseCode::Internal))
}

async fn recv_down(rx: &mut Option<mpsc::Receiver<DownstreamItem>>) -> Option<DownstreamItem> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn recv(conn: &mut Option<BoxConnection>) -> Result<waygate_transport::Frame, CloseCode> {
    match conn {
        Some(c) => c.recv().await.map_err(|e| e.close_code()),
        None => std::future::pending().await,
    }
}

impl Task {
    /// One frame read from the connection: through the inbound limiter (B2), then to the
    /// machine. Over the limit the frame is held and the connection is not read until its
    /// tokens return, so the client is slowed by its transport's flow control and nothing
    /// is dropped or reordered; only a frame that can never pass (larger than the byte
    /// burst, which config validation rules out) closes the connection as `rate_limited`.
    async fn inbound_frame(&mut self, frame: waygate_transport::Frame) {
        if !self.heard {
            self.heard = true;
            self.phases.hello = self.started.elapsed();
        }
        if let Some(limiter) = self.inbound.as_mut() {
            use waygate_backpressure::InboundVerdict;
            let now_t = tokio::time::Instant::now();
            match limiter.check(now_t.into_std(), frame.encoded_len()) {
                InboundVerdict::Accept => {}
                InboundVerdict::Wait(wait) if wait.is_never() => {
                    SessionCounters::bump(&self.edge.counters.rate_limited);
                    tracing::info!("closing a connection whose frame exceeds the byte burst");
                    if let Some(mut conn) = self.conn.take() {
                        conn.close(CloseCode::RateLimited, "frame over the inbound byte burst")
                            .await;
                    }
                    let _ = self.machine.handle_link_down(now(), CloseCode::RateLimited);
                    return;
                }
                InboundVerdict::Wait(wait) => {
                    SessionCounters::bump(&self.edge.counters.inbound_paused);
                    self.held = Some((frame, now_t + wait.0));
                    return;
                }
            }
        }
        if let Err(e) = self.machine.handle_frame(now(), frame) {
            tracing::debug!(error = %e, "session input refused");
        }
    }

    /// Sequenced messages the queue refused while it was full: everything still queued goes
    /// into the machine first (it was pushed before them), then the machine declares them
    /// lost — the connection closes as `slow_consumer` and the resume reports the gap.
    fn take_overflow(&mut self) {
        let lost = self.downstream_tx.overflowed.swap(0, Ordering::AcqRel);
        if lost == 0 {
            return;
        }
        if let Some(rx) = self.downstream_rx.as_mut() {
            let mut queued = Vec::new();
            while let Ok(item) = rx.try_recv() {
                queued.push(item);
            }
            for item in queued {
                self.downstream(item);
            }
        }
        SessionCounters::add(&self.edge.counters.downstream_overflowed, lost);
        tracing::info!(
            lost,
            "session queue overflowed: closing as a slow consumer with a gap"
        );
        if let Err(e) = self.machine.lose_downstream(now(), lost) {
            tracing::debug!(error = %e, "overflow on an ended session");
        }
    }

    fn command(&mut self, cmd: Command) {
        let now = now();
        match cmd {
            Command::Kick(reply) => {
                let _ = reply.send(self.machine.kick(now).ok());
            }
            Command::HandOver(attempt, reply) => {
                // Everything already pushed enters the replay buffer before the snapshot.
                if let Some(rx) = self.downstream_rx.as_mut() {
                    let mut queued = Vec::new();
                    while let Ok(msg) = rx.try_recv() {
                        queued.push(msg);
                    }
                    for msg in queued {
                        self.downstream(msg);
                    }
                }
                let outcome = self
                    .machine
                    .hand_over(now, &attempt)
                    .unwrap_or(TakeOutcome::NotFound);
                let channel = match (&outcome, self.downstream_rx.take()) {
                    (TakeOutcome::Taken(_), Some(rx)) => Some((self.downstream_tx.clone(), rx)),
                    (_, rx) => {
                        self.downstream_rx = rx;
                        None
                    }
                };
                let _ = reply.send(HandOver { outcome, channel });
            }
            Command::Close(code) => {
                let _ = self.machine.close_session(now, code);
            }
            Command::Bind(service, instance) => {
                let _ = self.machine.bind(&service, &instance);
            }
            Command::Migrate(target, deadline) => {
                let _ = self.machine.migrate(&target, deadline);
            }
            Command::Quiesce => {
                let _ = self.machine.quiesce();
            }
            Command::DropLink => {
                if self.conn.take().is_some() {
                    let _ = self.machine.handle_link_down(now, CloseCode::GoingAway);
                }
            }
        }
    }

    fn downstream(&mut self, item: DownstreamItem) {
        let refused = match item {
            DownstreamItem::Message(msg) => self
                .machine
                .send_downstream(now(), msg.class, msg.msg_id, msg.payload)
                .map(|_| ()),
            DownstreamItem::RoutingKey { service, key } => self.machine.bind_key(&service, &key),
            DownstreamItem::Error(e) => {
                self.machine
                    .report_error(e.code, e.msg_id, e.client_seq, e.retry_after_ms)
            }
        };
        if let Err(e) = refused {
            tracing::debug!(error = %e, "downstream item refused");
        }
    }

    async fn run_actions(&mut self) {
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
                self.write_through().await;
            }
            for action in batch {
                self.action(action).await;
            }
        }
    }

    /// Writes the session's snapshot to the store unless identical to the last one written.
    async fn write_through(&mut self) {
        let Some(wt) = self.edge.write_through.clone() else {
            return;
        };
        let Some(snapshot) = self.machine.checkpoint() else {
            return;
        };
        if self.durable.as_ref() == Some(&snapshot) {
            return;
        }
        if wt.paused() {
            wt.failures.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match self
            .edge
            .snapshots
            .put(&snapshot, self.edge.config.linger)
            .await
        {
            Ok(()) => {
                wt.writes.fetch_add(1, Ordering::Relaxed);
                self.durable = Some(snapshot);
            }
            Err(e) => {
                tracing::debug!(error = %e, "write-through failed; writes paused");
                wt.failed();
            }
        }
    }

    async fn action(&mut self, action: Action) {
        let edge = self.edge.clone();
        match action {
            Action::Send(frame) => {
                if let Some(conn) = self.conn.as_mut() {
                    match tokio::time::timeout(edge.send_deadline, conn.send(&frame)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "send failed");
                            if e.is_fatal() {
                                self.conn = None;
                                let _ = self.machine.handle_link_down(now(), e.close_code());
                            }
                        }
                        Err(_) => {
                            // The client does not read: close it as a slow consumer; the
                            // session lingers with its replay buffer for the resume (B3).
                            SessionCounters::bump(&edge.counters.slow_consumer);
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
            }
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
                self.phases.auth += t0.elapsed();
                let _ = self.machine.handle_auth_result(now(), result);
            }
            Action::TakeSnapshot {
                session_id,
                attempt,
            } => {
                let t0 = tokio::time::Instant::now();
                let resume_hash = attempt.resume_hash;
                let local = edge.registry.hand_over(&session_id, attempt).await;
                let result = match local {
                    Some(HandOver {
                        outcome: TakeOutcome::Taken(s),
                        channel,
                    }) => {
                        // The old task may have persisted it on detach: that copy is spent.
                        let _ = edge.snapshots.delete(&session_id, Some(s.fencing)).await;
                        if let Some((tx, rx)) = channel {
                            // Adopt the session's downstream channel (see `HandOver`).
                            self.downstream_tx = tx;
                            self.downstream_rx = Some(rx);
                            self.adopted = Some(session_id);
                        }
                        Ok(TakeOutcome::Taken(s))
                    }
                    Some(HandOver {
                        outcome: TakeOutcome::Mismatch,
                        ..
                    }) => Ok(TakeOutcome::Mismatch),
                    _ => edge.snapshots.take(&session_id, &resume_hash).await,
                };
                self.phases.restore += t0.elapsed();
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
                let t0 = tokio::time::Instant::now();
                let result = match edge
                    .ownership
                    .claim(&player_id, &session_id, &edge.edge_id)
                    .await
                {
                    Err(e) => Err(e),
                    Ok(grant) => {
                        let mut inherited = None;
                        if let Some(prev) = grant.previous.as_ref() {
                            if prev.session_id != session_id {
                                inherited = edge.registry.kick(&prev.session_id).await;
                                // A lingering snapshot of the kicked session must not be
                                // resumable any more; its bindings pass to us.
                                if let Ok(Some(s)) = edge.snapshots.get(&prev.session_id).await {
                                    let _ = edge.snapshots.delete(&prev.session_id, None).await;
                                    if inherited.is_none() {
                                        inherited = Some(s.bindings);
                                    }
                                }
                                tracing::info!(
                                    player = %player_id,
                                    kicked = %hex_id(&prev.session_id),
                                    edge = %prev.edge,
                                    "single login: previous session taken over"
                                );
                            }
                        }
                        Ok((grant, inherited))
                    }
                };
                self.phases.claim += t0.elapsed();
                let _ = self.machine.handle_claimed(now(), result);
            }
            Action::Established {
                session_id,
                player_id,
                fencing,
                outcome,
            } => {
                edge.registry.insert(
                    session_id,
                    Handle {
                        task: self.task,
                        player_id: player_id.clone(),
                        commands: self.commands_tx.clone(),
                        downstream: self.downstream_tx.clone(),
                    },
                );
                self.registered = Some(session_id);
                let span = tracing::Span::current();
                span.record("session", tracing::field::display(hex_id(&session_id)));
                span.record("player", tracing::field::display(&player_id));
                // Two logins of one player racing between claim and registration: the
                // one with the older fencing token yields.
                if let Ok(Some(owner)) = edge.ownership.owner(&player_id).await {
                    if owner.fencing > fencing {
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
                        setup: self.started.elapsed(),
                        phases: self.phases,
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
            Action::Deliver(message) => {
                let (msg_id, seq) = (message.msg_id, message.seq);
                if let Err(e) = edge.upstream.deliver(message).await {
                    let _ = self
                        .machine
                        .report_error(e.code, msg_id, seq, e.retry_after_ms);
                }
            }
            Action::Persist(snapshot) => {
                // Already written through unchanged: writing again could re-create a copy
                // another edge has taken meanwhile (a migrated client restores at once).
                if self.durable.as_ref() != Some(&*snapshot) {
                    if let Err(e) = edge.snapshots.put(&snapshot, edge.config.linger).await {
                        tracing::warn!(error = %e, "could not persist a session snapshot");
                    }
                }
                edge.upstream
                    .session_event(SessionEvent::Detached {
                        session_id: snapshot.session_id,
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
            }) => {
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

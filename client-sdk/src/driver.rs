//! The async client: one task drives a [`ClientSession`] over whichever connection is up.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rand::RngExt;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use waygate_protocol::channel::{
    ChannelEvent, ChannelPosition, CHANNEL_EVENT_MSG_ID, RESERVED_MSG_IDS_START,
};
use waygate_protocol::frame::{ErrorReport, SessionId, WelcomeOutcome};

use crate::channels::ChannelTracker;
use crate::clock::{ClockEstimate, ClockSync};
use crate::requests::{PendingRequest, RequestAnswer, RequestError, RequestKind, RequestTable};
use waygate_protocol::request::{decode_answer, decode_clock, encode_request, ANSWER_MSG_ID};
use waygate_session::client::{
    ClientConfig, ClientError, ClientEvent, ClientSession, ClientState, RttStats,
};
use waygate_transport::endpoint::{connect, ConnectOptions, Endpoint};
use waygate_transport::{BoxConnection, CloseCode, TrafficClass, TransportError};

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Endpoints in order of preference (e.g. kcp, quic, tcp, ws): each connect attempt
    /// starts at the first and falls back down the list (C1).
    pub endpoints: Vec<Endpoint>,
    /// Transport options (trusted CAs for tls/wss/quic, limits, QUIC and KCP settings).
    pub connect: ConnectOptions,
    /// Auth token from the login service.
    pub token: Bytes,
    /// Session-layer settings (ack policy, send buffer size).
    pub session: ClientConfig,
    /// How long a UDP endpoint (KCP, QUIC) may take to connect before the next endpoint is
    /// tried.
    pub udp_timeout: Duration,
    /// First reconnect delay cap; doubles per failed round up to `backoff_max` (full jitter).
    pub backoff_min: Duration,
    /// Largest reconnect delay.
    pub backoff_max: Duration,
    /// The session key the login service handed out beside a connect token (`token` of
    /// format version 2, PROTOCOL.md §7.2.2): KCP sessions are then sealed with it (every
    /// datagram authenticated and encrypted, §8.9). `None`: KCP sessions are plain, which
    /// an edge listening beyond loopback refuses by default.
    pub session_key: Option<[u8; 32]>,
    /// Give up when no session has been up for this long (every round failing, or refused):
    /// the client ends with `Closed { code: Unavailable }`. `None`: retry for ever.
    pub give_up_after: Option<Duration>,
    /// Give up after this many failed rounds over the endpoint list in a row (failed to
    /// connect, or refused) with no session in between: `Closed { code: Unavailable }`.
    /// `None`: no cap (`give_up_after` may still apply).
    pub give_up_after_attempts: Option<u32>,
    /// Simulate a bad network on every connection (latency, jitter, loss; [`crate::netsim`]):
    /// for testing a game, never in production. `None`: the real network only.
    pub net_sim: Option<crate::netsim::NetSimConfig>,
}

impl ClientOptions {
    /// Options with defaults for `endpoints` and `token`.
    pub fn new(endpoints: Vec<Endpoint>, token: Bytes) -> Self {
        Self {
            endpoints,
            connect: ConnectOptions::default(),
            token,
            session: ClientConfig::default(),
            udp_timeout: Duration::from_secs(2),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            session_key: None,
            give_up_after: None,
            give_up_after_attempts: None,
            net_sim: None,
        }
    }
}

/// What the application sees (C3).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A session is up over `endpoint`: new, restored, restored with a gap (resync your
    /// state), or a new session after a failed restore.
    Connected {
        /// The endpoint in use.
        endpoint: String,
        /// The session.
        session_id: SessionId,
        /// How it was established.
        outcome: WelcomeOutcome,
    },
    /// A downstream message (each sequenced one exactly once, in order per class).
    Message {
        /// Class.
        class: TrafficClass,
        /// Message id.
        msg_id: u32,
        /// Server seq (0 for best-effort).
        seq: u64,
        /// Body.
        payload: Bytes,
    },
    /// The link dropped; the client reconnects and resumes by itself.
    Disconnected {
        /// Why.
        code: CloseCode,
    },
    /// The server refused a connect (e.g. overloaded): the next attempt waits at least
    /// `retry_after_ms`.
    Rejected {
        /// Why.
        code: CloseCode,
        /// The server's hint.
        retry_after_ms: u32,
    },
    /// One connect attempt to `endpoint` failed (resolution, refused, timed out, TLS
    /// certificate, KCP connect token...): the client goes on with the next endpoint, or
    /// waits its backoff. `attempt` counts the rounds over the endpoint list since the last
    /// session was up (1 = the first).
    ConnectFailed {
        /// The endpoint tried.
        endpoint: String,
        /// Why it failed, for people (logs, a "reconnecting" screen).
        reason: String,
        /// The round.
        attempt: u32,
    },
    /// The server asks us to move; the client reconnects to `target` and resumes.
    Migrating {
        /// Target endpoint (empty: the configured list).
        target: String,
    },
    /// `count` status events (`ConnectFailed`, `Rejected`, `Disconnected`, `Migrating`) were
    /// dropped here because the application was not taking events: past 256 events waiting
    /// in the client task (beside the 4,096 the event channel holds), status events are
    /// counted instead of kept, so a client that fails to connect for hours while nobody
    /// reads its events holds a bounded backlog. It stands where they were lost, before
    /// the next event kept. Every other event (messages, channel events, `Connected`,
    /// answers, `Expired`, `Error`, `Closed`) is always kept. Also in
    /// [`ClientStats::events_dropped`].
    EventsDropped {
        /// How many were dropped since the previous `EventsDropped`.
        count: u64,
    },
    /// One upstream message was not delivered (busy, unavailable, no route...).
    Error(ErrorReport),
    /// The outcome of a request started with [`Client::start_request`] or
    /// [`Client::start_sync_clock`]: its answer, or why there is none. Exactly one per
    /// request.
    Answered {
        /// The id `start_request` returned.
        request_id: u32,
        /// The answer, or why there is none.
        result: Result<RequestAnswer, RequestError>,
    },
    /// A message sent while no session was up waited longer than
    /// `session.max_offline_age` for one, or is above the max frame size that session's
    /// WELCOME announced: dropped, never sent (the messages queued after it moved down one
    /// seq each).
    Expired {
        /// Its message id.
        msg_id: u32,
        /// The seq `send` returned for it.
        seq: u64,
        /// How long it had waited.
        age: Duration,
    },
    /// A channel event (PROTOCOL.md §12): a publication, or joined / left / history lost.
    /// Publications already shown are dropped; [`Client::channel_positions`] has the last
    /// position of each channel.
    Channel(crate::channels::ChannelUpdate),
    /// Terminal: the session ended on the server (kicked by another login, an operator or
    /// a backend — with the backend's own code —, banned, expired: any CLOSE code after
    /// WELCOME but those that keep the session, PROTOCOL.md §7.8), or closed locally. No
    /// reconnect follows.
    Closed {
        /// Why.
        code: CloseCode,
    },
}

/// SDK errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SdkError {
    /// The session layer refused the call (e.g. the send buffer is full).
    #[error("{0}")]
    Session(#[from] ClientError),
    /// The client task has ended (closed or kicked).
    #[error("client is closed")]
    Closed,
    /// No link was up to carry it (a logout while reconnecting): the client ended, and the
    /// edge keeps the session until its linger runs out.
    #[error("no link is up")]
    NotConnected,
}

enum Cmd {
    Send(
        TrafficClass,
        u32,
        Bytes,
        oneshot::Sender<Result<Option<u64>, ClientError>>,
    ),
    Request(RequestCmd),
    DropLink,
    ReconnectNow,
    /// Answered once paused (the state reads `paused` from then on).
    Pause(oneshot::Sender<()>),
    Prefer(usize),
    SetToken(Bytes),
    SetCredentials(Bytes, Option<[u8; 32]>),
    /// Send CLOSE with this code (`normal`, or `logout`) and end; answered with whether a
    /// link was up to carry it.
    Close(CloseCode, Option<oneshot::Sender<bool>>),
}

/// A request to send: its outcome goes to a waiting caller or to the event stream.
struct RequestCmd {
    class: TrafficClass,
    msg_id: u32,
    body: Bytes,
    timeout: Duration,
    clock: bool,
    reply: RequestReply,
    /// The request id, or why it could not be sent.
    started: oneshot::Sender<Result<u32, RequestError>>,
}

/// Where a request's outcome goes.
enum RequestReply {
    Caller(oneshot::Sender<Result<RequestAnswer, RequestError>>),
    Event,
}

impl std::fmt::Debug for RequestReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Caller(_) => "Caller",
            Self::Event => "Event",
        })
    }
}

/// Where a client is, with the same names in every SDK (Rust, C `WAYGATE_STATE_*`, JS
/// `client.state`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConnectionState {
    /// Created, not connecting yet (the C ABI before `waygate_client_connect`).
    #[default]
    Idle,
    /// Connecting; no session has been up yet.
    Connecting,
    /// A session is up.
    Connected,
    /// The link dropped; connecting again to resume the session.
    Reconnecting,
    /// Paused by the application ([`Client::pause`]): no link, no reconnect until
    /// [`Client::reconnect_now`]; the session lingers on the server meanwhile.
    Paused,
    /// Ended for good (closed, kicked, expired, refused, gave up).
    Closed,
}

impl ConnectionState {
    /// `idle`, `connecting`, `connected`, `reconnecting`, `paused` or `closed`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Connecting => "connecting",
            Self::Connected => "connected",
            Self::Reconnecting => "reconnecting",
            Self::Paused => "paused",
            Self::Closed => "closed",
        }
    }
}

impl std::fmt::Display for ConnectionState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Live numbers of a client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Where the client is.
    pub state: ConnectionState,
    /// RTT from PING/PONG.
    pub rtt: RttStats,
    /// Upstream messages not yet acked by the server.
    pub unacked: usize,
    /// Highest server seq received without a gap.
    pub last_server_seq: u64,
    /// Successful (re)connects.
    pub connects: u64,
    /// The game server's clock offset, once a clock sample was taken
    /// ([`Client::sync_clock`]).
    pub clock: Option<ClockEstimate>,
    /// Requests waiting for their answer.
    pub requests_pending: usize,
    /// The network simulator ([`ClientOptions::net_sim`]): frames it dropped (best-effort)
    /// and frames it delayed as retransmitted (the others).
    pub sim_dropped: u64,
    /// See `sim_dropped`.
    pub sim_retransmitted: u64,
    /// Status events dropped because the application was not taking events (the sum of
    /// every [`Event::EventsDropped`] count so far, including those not yet taken).
    pub events_dropped: u64,
}

/// A running client. Dropping it does what [`Client::close`] does (CLOSE, the task ends).
#[derive(Debug)]
pub struct Client {
    channels: Arc<Mutex<ChannelTracker>>,
    cmd: mpsc::Sender<Cmd>,
    events: mpsc::Receiver<Event>,
    stats: watch::Receiver<ClientStats>,
}

impl Client {
    /// Starts the client task; it connects at once.
    pub fn start(options: ClientOptions) -> Client {
        let (cmd_tx, cmd_rx) = mpsc::channel(256);
        let (ev_tx, ev_rx) = mpsc::channel(4096);
        let (stats_tx, stats_rx) = watch::channel(ClientStats {
            state: ConnectionState::Connecting,
            ..ClientStats::default()
        });
        let channels = Arc::new(Mutex::new(ChannelTracker::default()));
        tokio::spawn(run(options, cmd_rx, ev_tx, stats_tx, channels.clone()));
        Client {
            channels,
            cmd: cmd_tx,
            events: ev_rx,
            stats: stats_rx,
        }
    }

    /// Sends a message; returns its client seq (0 for best-effort) or `None` when a
    /// best-effort message was dropped because no link is up. Sequenced messages are kept
    /// until the server acks them and resent after a resume.
    pub async fn send(
        &self,
        class: TrafficClass,
        msg_id: u32,
        payload: Bytes,
    ) -> Result<Option<u64>, SdkError> {
        let (tx, rx) = oneshot::channel();
        self.cmd
            .send(Cmd::Send(class, msg_id, payload, tx))
            .await
            .map_err(|_| SdkError::Closed)?;
        Ok(self.reply(rx).await.ok_or(SdkError::Closed)??)
    }

    /// Sends a request (PROTOCOL.md §13) to message id `msg_id` and waits for its answer, at
    /// most `timeout`: the game server's answer (status 0 or its own error code), or why
    /// there is none (timeout, refused by the edge or the game server, expired offline, a
    /// new session, the client closed). The request is a sequenced DATA: resent after a
    /// resume like any other, answered once.
    pub async fn request(
        &self,
        class: TrafficClass,
        msg_id: u32,
        body: Bytes,
        timeout: Duration,
    ) -> Result<RequestAnswer, RequestError> {
        let (tx, rx) = oneshot::channel();
        self.send_request(
            class,
            msg_id,
            body,
            timeout,
            false,
            RequestReply::Caller(tx),
        )
        .await?;
        self.reply(rx).await.unwrap_or(Err(RequestError::Closed))
    }

    /// Sends a request without waiting: returns its id at once; its outcome comes as
    /// [`Event::Answered`] with that id (a game loop that polls events, the C ABI).
    pub async fn start_request(
        &self,
        class: TrafficClass,
        msg_id: u32,
        body: Bytes,
        timeout: Duration,
    ) -> Result<u32, RequestError> {
        self.send_request(class, msg_id, body, timeout, false, RequestReply::Event)
            .await
    }

    /// Takes a sample of the game server's clock: a request to `msg_id` whose answer body
    /// is the server's Unix time in ms (big-endian u64; the demo's `TIME`). Returns the
    /// estimate with this sample ([`crate::clock`]: the fastest of the recent exchanges),
    /// also in [`ClientStats::clock`]. Call it a few times at start, then now and then.
    pub async fn sync_clock(
        &self,
        msg_id: u32,
        timeout: Duration,
    ) -> Result<ClockEstimate, RequestError> {
        let (tx, rx) = oneshot::channel();
        self.send_request(
            TrafficClass::Critical,
            msg_id,
            Bytes::new(),
            timeout,
            true,
            RequestReply::Caller(tx),
        )
        .await?;
        self.reply(rx).await.unwrap_or(Err(RequestError::Closed))?;
        self.stats().clock.ok_or(RequestError::Closed)
    }

    /// [`Self::sync_clock`] without waiting: the outcome comes as [`Event::Answered`]; the
    /// estimate is then in [`ClientStats::clock`].
    pub async fn start_sync_clock(
        &self,
        msg_id: u32,
        timeout: Duration,
    ) -> Result<u32, RequestError> {
        self.send_request(
            TrafficClass::Critical,
            msg_id,
            Bytes::new(),
            timeout,
            true,
            RequestReply::Event,
        )
        .await
    }

    async fn send_request(
        &self,
        class: TrafficClass,
        msg_id: u32,
        body: Bytes,
        timeout: Duration,
        clock: bool,
        reply: RequestReply,
    ) -> Result<u32, RequestError> {
        let (started, rx) = oneshot::channel();
        let cmd = RequestCmd {
            class,
            msg_id,
            body,
            timeout,
            clock,
            reply,
            started,
        };
        self.cmd
            .send(Cmd::Request(cmd))
            .await
            .map_err(|_| RequestError::Closed)?;
        self.reply(rx).await.unwrap_or(Err(RequestError::Closed))
    }

    /// The next event; `None` once the client task has ended.
    pub async fn next_event(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// The last position of every channel this session is a member of (hand them to the
    /// backend after a new login, for it to join with recovery).
    pub fn channel_positions(&self) -> BTreeMap<String, ChannelPosition> {
        self.channels
            .lock()
            .map(|t| t.positions().clone())
            .unwrap_or_default()
    }

    /// Live statistics.
    pub fn stats(&self) -> ClientStats {
        *self.stats.borrow()
    }

    /// Where the client is now (connecting, connected, reconnecting, closed).
    pub fn state(&self) -> ConnectionState {
        self.stats.borrow().state
    }

    /// Drops the current connection without a CLOSE, as a network failure would; the
    /// client reconnects and resumes. [`SdkError::Closed`] once the client has ended.
    pub async fn drop_link(&self) -> Result<(), SdkError> {
        self.command(Cmd::DropLink).await
    }

    async fn command(&self, cmd: Cmd) -> Result<(), SdkError> {
        self.cmd.send(cmd).await.map_err(|_| SdkError::Closed)
    }

    /// The client task's reply on `rx`, or `None` when the task ended without one. Not
    /// `rx.await` alone: a command whose send raced the task's end (tokio's bounded send
    /// takes its permit, the receiver closes and drains, then the command lands) stays in
    /// the channel with its reply sender for as long as this client lives, and a wait on
    /// it never ended (found as a second `logout()` over KCP hanging in the channels tests,
    /// every runtime thread idle). The task's end is its command receiver's drop.
    async fn reply<T>(&self, mut rx: oneshot::Receiver<T>) -> Option<T> {
        tokio::select! {
            biased;
            r = &mut rx => r.ok(),
            () = self.cmd.closed() => rx.try_recv().ok(),
        }
    }

    /// Replaces the auth token (refreshed from the login service): used by the next HELLO.
    /// An expired token never ends a session that can still be resumed (the SDK resumes
    /// with the resume token alone); a fresh one is needed only for a new login. With a
    /// `session_key` (sealed KCP), whose key must match the token, use
    /// [`set_credentials`](Self::set_credentials) instead.
    pub async fn set_token(&self, token: Bytes) -> Result<(), SdkError> {
        self.command(Cmd::SetToken(token)).await
    }

    /// Replaces the connect token and the session key handed out beside it
    /// ([`ClientOptions::session_key`]; `None`: plain KCP sessions from now on). Sealed KCP
    /// needs both to match: a listener that requires sealing checks the token in its
    /// CONNECT before any resume (PROTOCOL.md §8.2.4), so a KCP-only client whose token
    /// expired reconnects only with a fresh token and its key. Used from the next connect.
    pub async fn set_credentials(
        &self,
        token: Bytes,
        session_key: Option<[u8; 32]>,
    ) -> Result<(), SdkError> {
        self.command(Cmd::SetCredentials(token, session_key)).await
    }

    /// Reconnects now: drops the current link even if it looks alive (an app back from
    /// the background often holds a socket the OS never reported dead), forgets the backoff
    /// and connects at once; the session resumes. Lifecycle hook for mobile and browsers.
    /// [`SdkError::Closed`] once the client has ended.
    pub async fn reconnect_now(&self) -> Result<(), SdkError> {
        self.command(Cmd::ReconnectNow).await
    }

    /// Pauses the client (the app goes to the background, where a mobile OS would cut the
    /// socket anyway): drops the link without a CLOSE, so the session lingers on the server
    /// (`session.linger`), and makes no connect attempt until [`Self::reconnect_now`], which
    /// resumes it. Messages sent meanwhile wait (subject to `max_offline_age`); the
    /// give-up deadline does not run while paused. [`SdkError::Closed`] once ended.
    pub async fn pause(&self) -> Result<(), SdkError> {
        let (tx, rx) = oneshot::channel();
        self.command(Cmd::Pause(tx)).await?;
        self.reply(rx).await.ok_or(SdkError::Closed)
    }

    /// Makes endpoint `index` the first one tried on the next connect.
    pub async fn prefer_endpoint(&self, index: usize) {
        let _ = self.cmd.send(Cmd::Prefer(index)).await;
    }

    /// Sends CLOSE (normal) and ends the task. The edge keeps the session for its linger
    /// (PROTOCOL.md §7.5), so the player can come back to it; use [`Client::logout`] to end
    /// it.
    pub async fn close(&self) {
        // Refused only when the task has already ended: the client is closed either way,
        // which is all this asks (the session lingers on the edge in both cases).
        let _ = self.cmd.send(Cmd::Close(CloseCode::Normal, None)).await;
    }

    /// Ends the session for good: sends CLOSE `logout` and ends the task; the edge ends the
    /// session at once (its player is offline, its ownership and stored copy released)
    /// instead of letting it linger (PROTOCOL.md §7.5). Messages not yet acknowledged may
    /// or may not have been handled. [`SdkError::NotConnected`]: no session was up on a link
    /// (reconnecting, or its handshake not done: the client ended, the session lingers out);
    /// [`SdkError::Closed`]: the client had already ended.
    pub async fn logout(&self) -> Result<(), SdkError> {
        let (tx, rx) = oneshot::channel();
        self.command(Cmd::Close(CloseCode::Logout, Some(tx)))
            .await?;
        match self.reply(rx).await {
            Some(true) => Ok(()),
            Some(false) => Err(SdkError::NotConnected),
            None => Err(SdkError::Closed),
        }
    }
}

struct Driver {
    channels: Arc<Mutex<ChannelTracker>>,
    options: ClientOptions,
    session: ClientSession,
    conn: Option<BoxConnection>,
    endpoint: Option<String>,
    preferred: usize,
    migrate_to: Option<Endpoint>,
    next_connect: Instant,
    failures: u32,
    /// When the last WELCOME came, and how many links in a row died within [`QUICK_LOSS`]
    /// of theirs (each such loss backs the reconnect off).
    welcomed_at: Instant,
    quick_losses: u32,
    events: mpsc::Sender<Event>,
    /// Events not yet taken by the application. The worker never waits for the
    /// application: it hands these over as the channel has room, and stops reading the
    /// link while [`EVENT_BACKLOG`] of them wait (the server then sees a slow consumer, a
    /// typed outcome the session resumes from), but always serves commands. Events are
    /// added by [`Driver::queue`] only, which bounds the status events (connect failures
    /// keep coming without any frame read).
    pending: std::collections::VecDeque<Event>,
    /// Status events dropped since the last [`Event::EventsDropped`] queued.
    dropped: u64,
    /// Status events dropped in all ([`ClientStats::events_dropped`]).
    dropped_total: u64,
    /// Since when no session has been up (`None` while one is).
    down_since: Option<Instant>,
    stats: watch::Sender<ClientStats>,
    connects: u64,
    closed: bool,
    requests: RequestTable<RequestReply>,
    clock: ClockSync,
    /// A session was up once (a later new session voids the requests of the old one).
    had_session: bool,
    /// Paused by the application: no connect attempt until `reconnect_now`.
    paused: bool,
    /// What the network simulator did, over every connection.
    sim: Arc<crate::netsim::NetSimStats>,
}

/// Events waiting for the application beyond which the link is not read.
const EVENT_BACKLOG: usize = 4096;
/// Events waiting in the driver (beyond the event channel's 4,096) from which status events
/// ([`is_status`]) are dropped and counted, not queued: they need no frame (a connect
/// failure every backoff step, for hours), so the link's backlog bound does not hold them.
/// The application learns of the loss by [`Event::EventsDropped`].
const STATUS_BACKLOG: usize = 256;

/// A status notice the application can afford to lose (counted in
/// [`Event::EventsDropped`] instead): the client acts on it by itself. Never a message, a
/// channel event, `Connected`, an answer, `Expired`, `Error` or `Closed`.
fn is_status(event: &Event) -> bool {
    matches!(
        event,
        Event::ConnectFailed { .. }
            | Event::Rejected { .. }
            | Event::Disconnected { .. }
            | Event::Migrating { .. }
    )
}

/// The longest a write to the link may take; past it the link is dropped and the session
/// resumes on a new one (as the edge does with a client that does not read, §10.2).
const SEND_DEADLINE: Duration = Duration::from_secs(5);
/// Most frames read without waiting before the timers run.
const READY_BATCH: usize = 256;

/// A link that dies within this long of its WELCOME backs the next reconnect off (PROTOCOL.md
/// §5: a client must not spin against an edge that closes every link it resumes).
const QUICK_LOSS: Duration = Duration::from_secs(1);

async fn run(
    options: ClientOptions,
    mut cmds: mpsc::Receiver<Cmd>,
    events: mpsc::Sender<Event>,
    stats: watch::Sender<ClientStats>,
    channels: Arc<Mutex<ChannelTracker>>,
) {
    let session = ClientSession::new(options.token.clone(), options.session.clone());
    let mut d = Driver {
        channels,
        options,
        session,
        conn: None,
        endpoint: None,
        preferred: 0,
        migrate_to: None,
        next_connect: Instant::now(),
        failures: 0,
        welcomed_at: Instant::now(),
        quick_losses: 0,
        events,
        pending: std::collections::VecDeque::new(),
        dropped: 0,
        dropped_total: 0,
        down_since: Some(Instant::now()),
        stats,
        connects: 0,
        closed: false,
        requests: RequestTable::default(),
        clock: ClockSync::default(),
        had_session: false,
        paused: false,
        sim: Arc::default(),
    };
    let mut connecting: Option<Connecting> = None;
    // A sender of its own for handing events over: the other select branches mutate the
    // driver while this one waits for room.
    let handover = d.events.clone();
    while !d.closed {
        if d.session.state() != ClientState::Active && !d.paused {
            d.down_since.get_or_insert_with(Instant::now);
        }
        let out_of_attempts = d
            .options
            .give_up_after_attempts
            .is_some_and(|max| d.failures >= max.max(1));
        if out_of_attempts && d.conn.is_none() && connecting.is_none() {
            tracing::info!(failures = d.failures, "every attempt failed: giving up");
            d.closed = true;
            d.queue(Event::Closed {
                code: CloseCode::Unavailable,
            });
            break;
        }
        if let (Some(since), Some(limit)) = (d.down_since, d.options.give_up_after) {
            if since.elapsed() >= limit && d.conn.is_none() {
                tracing::info!(?limit, "no session for too long: giving up");
                d.closed = true;
                d.queue(Event::Closed {
                    code: CloseCode::Unavailable,
                });
                break;
            }
        }
        if !d.paused && d.conn.is_none() && connecting.is_none() && Instant::now() >= d.next_connect
        {
            let mut connect = d.options.connect.clone();
            let token = d.session.token_for_attempt();
            connect.conn.kcp_credentials = d.options.session_key.map(|session_key| {
                waygate_transport::kcp::seal::KcpCredentials { token, session_key }
            });
            connecting = Some(Box::pin(connect_round(
                d.order(),
                connect,
                d.options.udp_timeout,
            )));
        }
        let timer = {
            let mut t = d.session.poll_timeout().map(Instant::from_std);
            if !d.paused && d.conn.is_none() && connecting.is_none() {
                t = Some(t.map_or(d.next_connect, |x| x.min(d.next_connect)));
            }
            if let (Some(since), Some(limit)) = (d.down_since, d.options.give_up_after) {
                let at = since + limit;
                t = Some(t.map_or(at, |x| x.min(at)));
            }
            if let Some(at) = d.requests.poll_timeout().map(Instant::from_std) {
                t = Some(t.map_or(at, |x| x.min(at)));
            }
            t
        };
        let sleep = async {
            match timer {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            (outcome, failures) = async { connecting.as_mut().map_or_else(|| unreachable!(), |c| c.as_mut()).await }, if connecting.is_some() => {
                connecting = None;
                let attempt = d.failures.saturating_add(1);
                for (endpoint, reason) in failures {
                    d.queue(Event::ConnectFailed { endpoint, reason, attempt });
                }
                d.connected(outcome).await;
            }
            permit = handover.reserve(), if !d.pending.is_empty() => {
                if let (Ok(permit), Some(event)) = (permit, d.pending.pop_front()) {
                    permit.send(event);
                }
            }
            frame = recv(&mut d.conn), if d.pending.len() < EVENT_BACKLOG => d.received(frame),
            cmd = cmds.recv() => match cmd {
                Some(Cmd::Send(class, msg_id, payload, reply)) => {
                    let r = d.session.send(Instant::now().into_std(), class, msg_id, payload);
                    let _ = reply.send(r);
                }
                Some(Cmd::Request(r)) => d.start_request(r),
                Some(Cmd::DropLink) => {
                    if d.conn.take().is_some() {
                        d.session.handle_link_down(Instant::now().into_std(), CloseCode::GoingAway);
                        d.link_ended();
                        d.next_connect = Instant::now();
                    }
                }
                Some(Cmd::ReconnectNow) => {
                    if d.conn.take().is_some() {
                        d.session.handle_link_down(Instant::now().into_std(), CloseCode::GoingAway);
                    }
                    d.paused = false;
                    d.failures = 0;
                    d.quick_losses = 0;
                    d.next_connect = Instant::now();
                }
                Some(Cmd::Pause(done)) => {
                    if d.conn.take().is_some() {
                        d.session.handle_link_down(Instant::now().into_std(), CloseCode::GoingAway);
                    }
                    connecting = None;
                    d.paused = true;
                    d.down_since = None;
                    d.publish_stats();
                    // The pause is done either way; a caller that stopped waiting (its
                    // future dropped) has nobody to tell.
                    let _ = done.send(());
                }
                Some(Cmd::Prefer(i)) => d.preferred = i.min(d.options.endpoints.len().saturating_sub(1)),
                Some(Cmd::SetToken(token)) => d.session.set_token(token),
                Some(Cmd::SetCredentials(token, session_key)) => {
                    d.session.set_token(token);
                    d.options.session_key = session_key;
                }
                cmd @ (Some(Cmd::Close(..)) | None) => {
                    let (code, answer) = match cmd {
                        Some(Cmd::Close(code, answer)) => (code, answer),
                        _ => (CloseCode::Normal, None),
                    };
                    // A session the edge holds on this link (past its WELCOME).
                    let linked = d.conn.is_some() && d.session.state() == ClientState::Active;
                    if let Some(mut c) = d.conn.take() {
                        // A logout before the WELCOME is answered `NotConnected` (the session
                        // lingers out): the edge, whose WELCOME may be on its way, must not
                        // end the session on a CLOSE `logout` the caller was told failed.
                        let (code, why) = match code {
                            CloseCode::Logout if linked => (code, "logged out"),
                            CloseCode::Logout => (CloseCode::Normal, "client closed"),
                            _ => (code, "client closed"),
                        };
                        c.close(code, why).await;
                    }
                    if let Some(answer) = answer {
                        // The caller may have stopped waiting: the outcome stands anyway.
                        let _ = answer.send(linked);
                    }
                    d.end_requests();
                    d.queue(Event::Closed { code });
                    d.closed = true;
                    d.publish_stats();
                    d.hand_over_pending().await;
                    return;
                }
            },
            () = sleep => {
                // Frames that arrived while this task could not run (a busy or stalled
                // runtime: its timer and its socket become ready together) count before
                // the timers: the liveness rule must never call a link dead whose answer
                // is already here.
                d.read_ready();
                let now = Instant::now().into_std();
                for (p, e) in d.requests.expire(now) {
                    d.finish_request(p, Err(e));
                }
                if d.pending.len() >= EVENT_BACKLOG {
                    // Reading is held (the application does not take its events): the
                    // link's answers may be waiting unread, so it is not judged meanwhile.
                    d.session.not_reading(now);
                }
                d.session.handle_timeout(now);
                // The liveness rule found the link dead (nothing heard while waiting for an
                // answer): drop it and resume at once, as for any lost link.
                if d.conn.is_some() && d.session.state() == ClientState::Disconnected {
                    d.conn = None;
                    d.link_ended();
                    d.next_connect = Instant::now();
                    // The endpoint that went silent is tried last: a dead edge or a blocked
                    // UDP path would only cost the next attempt its timeout.
                    let n = d.options.endpoints.len();
                    let current = d.endpoint.as_deref();
                    if let Some(i) = d.options.endpoints.iter().position(|e| Some(e.to_string().as_str()) == current) {
                        d.preferred = (i + 1) % n.max(1);
                    }
                }
            }
        }
        d.flush().await;
        d.drain_events().await;
    }
    // Ended (kicked, expired, refused for good): the terminal event and what came before it.
    d.end_requests();
    d.publish_stats();
    d.hand_over_pending().await;
}

enum ConnectOutcome {
    Up(BoxConnection, String),
    /// Refused before HELLO (KCP BUSY): the code, the retry-after hint, and whether every
    /// endpoint tried answered with a refusal (none failed for another reason, which might
    /// have taken the connection).
    Refused(CloseCode, u32, bool),
    Failed,
}

type Connecting = std::pin::Pin<
    Box<dyn std::future::Future<Output = (ConnectOutcome, Vec<(String, String)>)> + Send>,
>;

/// One connect round: each endpoint in order, UDP ones with the shorter timeout, until one
/// answers (C1). Runs beside the command loop, so `send` never waits for a connect.
/// Tries each endpoint in turn; the outcome, and every endpoint that failed before it
/// (with its reason).
async fn connect_round(
    list: Vec<Endpoint>,
    options: ConnectOptions,
    udp_timeout: Duration,
) -> (ConnectOutcome, Vec<(String, String)>) {
    let mut failures = Vec::new();
    let mut auth_refusal = None;
    let mut only_refusals = true;
    for endpoint in list {
        let limit = if endpoint.kind.is_udp() {
            udp_timeout
        } else {
            options.conn.handshake_timeout
        };
        let reason = match tokio::time::timeout(limit, connect(&endpoint, &options)).await {
            Ok(Ok(conn)) => return (ConnectOutcome::Up(conn, endpoint.to_string()), failures),
            // An endpoint that refuses the token (sealed KCP checks it in CONNECT, and an
            // expired or dropped token is refused there) may still take the resume on the
            // next one, which asks only for the resume token (PROTOCOL.md §7.1.1).
            Ok(Err(TransportError::Refused {
                code,
                retry_after_ms,
            })) if code.to_u16() / 100 == 2 => {
                auth_refusal.get_or_insert((code, retry_after_ms));
                format!("refused: {code}")
            }
            Ok(Err(TransportError::Refused {
                code,
                retry_after_ms,
            })) => {
                return (
                    ConnectOutcome::Refused(code, retry_after_ms, true),
                    failures,
                )
            }
            Ok(Err(e)) => {
                only_refusals = false;
                e.to_string()
            }
            Err(_) => {
                only_refusals = false;
                format!("no connection within {} ms", limit.as_millis())
            }
        };
        tracing::debug!(%endpoint, %reason, "connect failed; trying the next endpoint");
        failures.push((endpoint.to_string(), reason));
    }
    match auth_refusal {
        Some((code, retry_after_ms)) => (
            ConnectOutcome::Refused(code, retry_after_ms, only_refusals),
            failures,
        ),
        None => (ConnectOutcome::Failed, failures),
    }
}

async fn recv(
    conn: &mut Option<BoxConnection>,
) -> Result<waygate_transport::Frame, TransportError> {
    match conn {
        Some(c) => c.recv().await,
        None => std::future::pending().await,
    }
}

impl Driver {
    fn order(&self) -> Vec<Endpoint> {
        let mut list = Vec::new();
        if let Some(target) = &self.migrate_to {
            list.push(target.clone());
        }
        let n = self.options.endpoints.len();
        for i in 0..n {
            list.push(self.options.endpoints[(self.preferred + i) % n].clone());
        }
        list
    }

    /// Applies the outcome of one connect round.
    async fn connected(&mut self, outcome: ConnectOutcome) {
        match outcome {
            ConnectOutcome::Up(conn, endpoint) => {
                // Sticky fallback: the endpoint that worked is tried first next time (a
                // UDP-blocked network does not wait out the UDP timeout on every resume).
                if let Some(i) = self
                    .options
                    .endpoints
                    .iter()
                    .position(|e| e.to_string() == endpoint)
                {
                    self.preferred = i;
                }
                let conn = match self.options.net_sim {
                    Some(config) => {
                        crate::netsim::SimConnection::wrap(conn, config, self.sim.clone())
                    }
                    None => conn,
                };
                self.conn = Some(conn);
                self.endpoint = Some(endpoint);
                self.migrate_to = None;
                let _ = self.session.connect(Instant::now().into_std());
            }
            ConnectOutcome::Refused(code, retry_after_ms, conclusive) => {
                self.session.handle_refused(
                    Instant::now().into_std(),
                    code,
                    retry_after_ms,
                    conclusive,
                );
            }
            ConnectOutcome::Failed => {
                self.failures = self.failures.saturating_add(1);
                self.schedule_backoff(0);
            }
        }
    }

    fn schedule_backoff(&mut self, at_least_ms: u32) {
        self.schedule_backoff_after(self.failures, at_least_ms);
    }

    /// The next connect after `failures` failures: the hint, plus a full jitter under a
    /// cap that doubles per failure.
    fn schedule_backoff_after(&mut self, failures: u32, at_least_ms: u32) {
        let cap = self
            .options
            .backoff_min
            .saturating_mul(1u32 << failures.min(16))
            .min(self.options.backoff_max);
        // The hint plus the jitter (clients refused together must not come back together),
        // the jitter at most half the hint when there is one.
        let mut cap = cap.as_millis() as u64;
        if at_least_ms > 0 {
            cap = cap.min(u64::from(at_least_ms / 2).max(1));
        }
        let jitter = rand::rng().random_range(0..=cap);
        let delay = Duration::from_millis(u64::from(at_least_ms) + jitter);
        self.next_connect = Instant::now() + delay;
    }

    /// Queues an event for the application (the only way into `pending`). A status event
    /// ([`is_status`]) while [`STATUS_BACKLOG`] events wait is dropped and counted; the
    /// next event kept is preceded by [`Event::EventsDropped`] with that count, so the
    /// marker stands where the events were lost (before `Closed` at the end too).
    fn queue(&mut self, event: Event) {
        if is_status(&event) && self.pending.len() >= STATUS_BACKLOG {
            self.dropped += 1;
            self.dropped_total += 1;
            return;
        }
        if self.dropped > 0 {
            let count = std::mem::take(&mut self.dropped);
            tracing::debug!(
                count,
                "status events dropped: the application takes no events"
            );
            self.pending.push_back(Event::EventsDropped { count });
        }
        self.pending.push_back(event);
    }

    /// Takes every frame the connection already holds, without waiting (at most
    /// [`READY_BATCH`], and not past the event backlog).
    fn read_ready(&mut self) {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for _ in 0..READY_BATCH {
            if self.pending.len() >= EVENT_BACKLOG {
                return;
            }
            let Some(conn) = self.conn.as_mut() else {
                return;
            };
            // `recv` is cancel-safe (the select loop drops it whenever another branch
            // wins): a poll that finds nothing loses nothing.
            let std::task::Poll::Ready(frame) = conn.recv().as_mut().poll(&mut cx) else {
                return;
            };
            self.received(frame);
        }
    }

    /// One frame from the connection, or its end.
    fn received(&mut self, frame: Result<waygate_transport::Frame, TransportError>) {
        match frame {
            Ok(frame) => match self.session.handle_frame(Instant::now().into_std(), frame) {
                Ok(()) => {}
                // A server seq of 0 or beyond the window, or an ack of a seq never sent:
                // the edge broke §7.4, and the frame cannot be taken; the rule is CLOSE
                // `protocol_error` and a resume, after which the edge replays from what
                // this client acknowledged.
                Err(e @ (ClientError::SeqOutOfWindow(_) | ClientError::AckBeyondSent(_))) => {
                    tracing::warn!(error = %e, "the edge broke the protocol: link closed");
                    let why = if matches!(e, ClientError::AckBeyondSent(_)) {
                        "ack beyond the highest seq sent"
                    } else {
                        "server seq out of window"
                    };
                    if let Some(mut c) = self.conn.take() {
                        tokio::spawn(async move {
                            c.close(CloseCode::ProtocolError, why).await;
                        });
                    }
                    self.link_down(CloseCode::ProtocolError);
                }
                Err(e) => tracing::debug!(error = %e, "frame refused by the client session"),
            },
            Err(e) => self.link_failed(&e),
        }
    }

    /// The link failed with `e`, found by a read or a write. The server's CLOSE (or the
    /// code its QUIC close or KCP RESET carries) says by its code, after WELCOME, whether
    /// the session lingers (PROTOCOL.md §7.8); any other failure keeps it.
    fn link_failed(&mut self, e: &TransportError) {
        match e {
            TransportError::ClosedByPeer { code } => {
                let welcomed = self.session.state() == ClientState::Active;
                self.session
                    .handle_peer_close(Instant::now().into_std(), *code);
                self.after_link_down(*code, welcomed);
            }
            e => self.link_down(e.close_code()),
        }
    }

    fn link_down(&mut self, code: CloseCode) {
        let welcomed = self.session.state() == ClientState::Active;
        self.session
            .handle_link_down(Instant::now().into_std(), code);
        self.after_link_down(code, welcomed);
    }

    /// A link that had its WELCOME ended: whether it died within [`QUICK_LOSS`] of it. One
    /// that lived longer ends a run of quick losses.
    fn link_ended(&mut self) -> bool {
        if self.welcomed_at.elapsed() < QUICK_LOSS {
            return true;
        }
        self.quick_losses = 0;
        false
    }

    /// What follows the link's end whatever ended it: a reconnect's timing.
    fn after_link_down(&mut self, code: CloseCode, welcomed: bool) {
        tracing::debug!(?code, welcomed, "link down (transport)");
        self.conn = None;
        if welcomed && !self.link_ended() {
            // A session that was up reconnects at once (resume quickly).
            self.next_connect = Instant::now();
        } else if welcomed {
            // Dead within QUICK_LOSS of its WELCOME (and so the ones before it): something
            // the edge does to every link at once (a message it closes on, resent on each
            // resume). Back off as after failed attempts, so the client does not spin.
            self.quick_losses = self.quick_losses.saturating_add(1);
            self.schedule_backoff_after(self.quick_losses - 1, 0);
        } else {
            // Dropped before WELCOME: a failure like a refused connect, so a server that
            // accepts and closes cannot make the client spin (full-jitter backoff).
            self.failures = self.failures.saturating_add(1);
            self.schedule_backoff(0);
        }
    }

    async fn flush(&mut self) {
        let Some(conn) = self.conn.as_mut() else {
            while self.session.poll_transmit().is_some() {}
            return;
        };
        let mut frames = Vec::new();
        while let Some(f) = self.session.poll_transmit() {
            frames.push(f);
        }
        if frames.is_empty() {
            return;
        }
        match tokio::time::timeout(SEND_DEADLINE, conn.send_batch(&frames)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.link_failed(&e),
            Err(_) => {
                // A link that takes no more (a transport's flow control never reopening)
                // must not freeze the client: every command waits behind this write.
                tracing::info!("a write did not complete within {SEND_DEADLINE:?}: link down");
                self.link_down(CloseCode::SlowConsumer);
            }
        }
    }

    /// Sends a request: its id goes in front of the body; the table waits for its outcome.
    fn start_request(&mut self, r: RequestCmd) {
        // Refusals below go to the caller; one that stopped waiting has nobody to tell,
        // and nothing was sent.
        if !r.class.is_sequenced() {
            let _ = r.started.send(Err(RequestError::NotSequenced));
            return;
        }
        let now = Instant::now().into_std();
        let id = self.requests.next_id();
        let payload = encode_request(id, &r.body);
        let kind = if r.clock {
            RequestKind::Clock {
                sent_unix_ms: unix_ms(),
                sent: now,
            }
        } else {
            RequestKind::Plain
        };
        match self.session.send(now, r.class, r.msg_id, payload) {
            Ok(Some(seq)) if seq > 0 => {
                self.requests.insert(id, seq, now, r.timeout, kind, r.reply);
                if r.started.send(Ok(id)).is_err() {
                    // The caller stopped waiting before it learnt the id: nobody can match
                    // an outcome to it, so the table forgets it (a late answer is dropped as
                    // unknown) instead of keeping it until its timeout.
                    self.requests.cancel(id);
                }
            }
            Ok(_) => {
                let _ = r.started.send(Err(RequestError::NotSequenced));
            }
            Err(ClientError::SendBufferFull(_)) => {
                let _ = r.started.send(Err(RequestError::SendBufferFull));
            }
            Err(ClientError::TooLarge { size, max }) => {
                let _ = r.started.send(Err(RequestError::TooLarge { size, max }));
            }
            Err(_) => {
                let _ = r.started.send(Err(RequestError::Closed));
            }
        }
    }

    /// Hands a request's outcome to whoever waits for it (a caller or the event stream);
    /// a clock sample updates the estimate first.
    fn finish_request(
        &mut self,
        p: PendingRequest<RequestReply>,
        mut result: Result<RequestAnswer, RequestError>,
    ) {
        if let (RequestKind::Clock { sent_unix_ms, sent }, Ok(answer)) = (p.kind, &result) {
            match decode_clock(&answer.body) {
                Some(server) if answer.status == 0 => {
                    self.clock.observe(sent_unix_ms, sent.elapsed(), server);
                    // Published before the caller hears of it: `sync_clock` reads it then.
                    self.publish_stats();
                }
                _ => {
                    result = Err(RequestError::BadAnswer(format!(
                        "not a clock answer (status {}, {} bytes)",
                        answer.status,
                        answer.body.len()
                    )))
                }
            }
        }
        match p.reply {
            RequestReply::Caller(tx) => {
                // A caller that stopped waiting gave up on the outcome.
                let _ = tx.send(result);
            }
            RequestReply::Event => self.queue(Event::Answered {
                request_id: p.id,
                result,
            }),
        }
    }

    /// The client ends: every request still waiting fails with `Closed`, its event before
    /// the terminal one.
    fn end_requests(&mut self) {
        let closed = match self.pending.back() {
            Some(Event::Closed { .. }) => self.pending.pop_back(),
            _ => None,
        };
        for (p, e) in self.requests.fail_all(&RequestError::Closed) {
            self.finish_request(p, Err(e));
        }
        if let Some(closed) = closed {
            self.queue(closed);
        }
    }

    fn state(&self) -> ConnectionState {
        match self.session.state() {
            _ if self.closed => ConnectionState::Closed,
            ClientState::Closed => ConnectionState::Closed,
            ClientState::Active => ConnectionState::Connected,
            _ if self.paused => ConnectionState::Paused,
            _ if self.connects == 0 => ConnectionState::Connecting,
            _ => ConnectionState::Reconnecting,
        }
    }

    fn publish_stats(&self) {
        let _ = self.stats.send(ClientStats {
            state: self.state(),
            rtt: self.session.rtt(),
            unacked: self.session.unacked_len(),
            last_server_seq: self.session.last_server_seq(),
            connects: self.connects,
            clock: self.clock.estimate(),
            requests_pending: self.requests.len(),
            sim_dropped: self.sim.dropped.load(std::sync::atomic::Ordering::Relaxed),
            sim_retransmitted: self
                .sim
                .retransmitted
                .load(std::sync::atomic::Ordering::Relaxed),
            events_dropped: self.dropped_total,
        });
    }

    /// Hands the session's events over until it has none: handling one may queue another
    /// (a MIGRATE drops the link, which queues its `Disconnected`), and one left for the
    /// next turn would act on whatever link is up by then (a `Disconnected` taken after the
    /// migration's new link came up dropped that link).
    async fn drain_events(&mut self) {
        for _ in 0..8 {
            if !self.drain_events_once().await {
                return;
            }
        }
    }

    /// One pass of [`drain_events`](Self::drain_events); whether there was any event.
    async fn drain_events_once(&mut self) -> bool {
        // Stats first: an application that reads them after an event sees at least the
        // state that produced the event.
        let pending: Vec<ClientEvent> = std::iter::from_fn(|| self.session.poll_event()).collect();
        self.connects += pending
            .iter()
            .filter(|e| matches!(e, ClientEvent::Welcomed { .. }))
            .count() as u64;
        self.publish_stats();
        if pending.is_empty() {
            return false;
        }
        // Messages dropped before they were sent (`max_offline_age`): the requests among them
        // fail, and the requests queued after them follow their new seqs.
        let expired: Vec<u64> = pending
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Expired { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect();
        let mut expired_requests = std::collections::HashSet::new();
        for (p, e) in self.requests.on_expired(&expired) {
            expired_requests.insert(p.seq);
            self.finish_request(p, Err(e));
        }
        for ev in pending {
            let event = match ev {
                ClientEvent::Welcomed {
                    session_id,
                    outcome,
                } => {
                    self.failures = 0;
                    self.welcomed_at = Instant::now();
                    self.down_since = None;
                    if outcome == WelcomeOutcome::RestoreFailedNewSession
                        || (outcome == WelcomeOutcome::NewSession && self.had_session)
                    {
                        // Sent in a session that is gone: no answer will come.
                        for (p, e) in self.requests.fail_all(&RequestError::SessionLost) {
                            self.finish_request(p, Err(e));
                        }
                    }
                    self.had_session = true;
                    Event::Connected {
                        endpoint: self.endpoint.clone().unwrap_or_default(),
                        session_id,
                        outcome,
                    }
                }
                ClientEvent::Message {
                    msg_id: ANSWER_MSG_ID,
                    payload,
                    ..
                } => {
                    match decode_answer(&payload) {
                        Ok(answer) => match self.requests.on_answer(answer) {
                            Some((p, a)) => self.finish_request(p, Ok(a)),
                            None => {
                                tracing::debug!("answer to no waiting request dropped (timed out)")
                            }
                        },
                        Err(e) => tracing::warn!(error = %e, "undecodable answer dropped"),
                    }
                    continue;
                }
                ClientEvent::Message {
                    msg_id: CHANNEL_EVENT_MSG_ID,
                    payload,
                    ..
                } => {
                    let update = match ChannelEvent::decode(payload) {
                        Ok(e) => self.channels.lock().ok().and_then(|mut t| t.accept(e)),
                        Err(e) => {
                            tracing::warn!(error = %e, "undecodable channel event dropped");
                            None
                        }
                    };
                    match update {
                        Some(u) => Event::Channel(u),
                        None => continue,
                    }
                }
                // Another id of the edge's own range (PROTOCOL.md §3.4): a later version's,
                // acknowledged like any DATA (the session did) and not a message.
                ClientEvent::Message { msg_id, .. } if msg_id >= RESERVED_MSG_IDS_START => {
                    tracing::debug!(msg_id, "DATA of a reserved msg id ignored");
                    continue;
                }
                ClientEvent::Message {
                    class,
                    msg_id,
                    seq,
                    payload,
                } => Event::Message {
                    class,
                    msg_id,
                    seq,
                    payload,
                },
                ClientEvent::Rejected {
                    code,
                    retry_after_ms,
                    terminal,
                } => {
                    self.conn = None;
                    self.failures = self.failures.saturating_add(1);
                    self.schedule_backoff(retry_after_ms);
                    if terminal {
                        self.closed = true;
                        Event::Closed { code }
                    } else {
                        Event::Rejected {
                            code,
                            retry_after_ms,
                        }
                    }
                }
                ClientEvent::Disconnected { code } => {
                    tracing::debug!(?code, "link down (session)");
                    self.conn = None;
                    if self.session.state() == ClientState::Closed {
                        self.closed = true;
                        Event::Closed { code }
                    } else {
                        Event::Disconnected { code }
                    }
                }
                ClientEvent::Migrate { target, .. } => {
                    self.migrate_to = Endpoint::parse(&target).ok();
                    self.link_ended();
                    if let Some(mut c) = self.conn.take() {
                        c.close(CloseCode::GoingAway, "migrating").await;
                        self.session
                            .handle_link_down(Instant::now().into_std(), CloseCode::GoingAway);
                    }
                    self.next_connect = Instant::now();
                    Event::Migrating { target }
                }
                ClientEvent::Error(report) => {
                    match self.requests.on_refused(
                        report.client_seq,
                        report.code,
                        report.retry_after_ms,
                    ) {
                        Some((p, e)) => {
                            self.finish_request(p, Err(e));
                            continue;
                        }
                        None => Event::Error(report),
                    }
                }
                // A request's expiry is its outcome (above).
                ClientEvent::Expired { seq, .. } if expired_requests.contains(&seq) => continue,
                ClientEvent::Expired { msg_id, seq, age } => Event::Expired { msg_id, seq, age },
            };
            self.queue(event);
        }
        self.publish_stats();
        true
    }

    /// At the end: what the application has not taken yet, while it takes it (bounded: a
    /// closed or gone application does not hold the worker).
    async fn hand_over_pending(&mut self) {
        let events = self.events.clone();
        let pending = std::mem::take(&mut self.pending);
        let _ = tokio::time::timeout(Duration::from_secs(5), async move {
            for event in pending {
                if events.send(event).await.is_err() {
                    return;
                }
            }
        })
        .await;
    }
}

/// The local wall clock, Unix ms (0 before 1970).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

//! The sans-IO KCP endpoint: every session of one UDP socket, the cookie handshake, one
//! shared timer, backpressure and panic isolation. No tokio, no sockets, no clock: time comes
//! in as an `Instant`, datagrams come in through [`KcpEndpoint::handle_datagram`] and leave
//! through [`KcpEndpoint::poll_transmit`]; what the application must learn comes out of
//! [`KcpEndpoint::poll_event`] (quinn-proto's shape).
//!
//! Architecture invariants (SPEC T4a):
//! - Sessions are keyed by (peer address, conv). A segment whose conv is known but whose
//!   address is not that session's is dropped and counted; it never moves or touches the
//!   session. Convs are random, nonzero, and unique within the endpoint.
//! - No state exists for a peer before it returns a valid cookie: HELLO is answered
//!   statelessly (COOKIE replies are rate-limited per endpoint), and no reply is larger than
//!   the packet that caused it.
//! - One timer heap of `(deadline, key)` entries fed by the engine's `check()`: a session
//!   with nothing in flight has no engine deadline at all, only its idle deadline, so an idle
//!   session costs no CPU.
//! - Every call into the engine for one session runs inside `catch_unwind`: a panic closes
//!   that session (RESET, counted) and nothing else.
//! - Writes and incoming segments are flushed at once (acks and data never wait an interval),
//!   except that the ACK owed for a message just delivered waits up to `ack_delay_ms` for a
//!   send on the session to carry it (a request and its reply: one datagram each way).
//! - Every queue is bounded: inbound messages by per-session credit (the engine's receive
//!   window pushes back on the peer when a reader stalls), outbound by `send_queue_segments`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kcp::Kcp;
use rand::rngs::StdRng;
use rand::RngExt;

use super::config::{KcpConfig, KCP_OVERHEAD};
use super::cookie::{connect_token, is_control, Control, Cookie, CookieError, CookieKey};
use super::seal::{
    session_seals, ConnectKeys, KcpCredentials, OpenError, PacketOpener, PacketSealer,
    SEAL_OVERHEAD,
};
use crate::conn::ConnConfig;
use crate::error::TransportError;
use waygate_backpressure::{Rate, RetrySlots, TokenBucket};
use waygate_protocol::frame::Frame;
use waygate_protocol::wire::CloseCode;

/// A session's identity: the peer's address and the conv.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConvKey {
    /// The peer's address as the socket reports it.
    pub addr: SocketAddr,
    /// The KCP conversation id (nonzero).
    pub conv: u32,
}

/// One datagram to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// Where to.
    pub dest: SocketAddr,
    /// The datagram.
    pub payload: Vec<u8>,
}

/// Why a session ended, as its connection reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// This side closed it (close or drop).
    Local,
    /// The peer sent RESET with this code.
    Reset(CloseCode),
    /// Nothing arrived within the idle timeout.
    IdleTimeout(Duration),
    /// The peer sent a message larger than the maximum frame size.
    FrameTooLarge {
        /// Its size.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// The engine gave up retransmitting (dead link).
    Unreachable,
    /// The engine panicked on this session's input; the session was dropped.
    Failed,
    /// The endpoint was shut down.
    Shutdown,
}

impl CloseReason {
    /// The error a connection's `recv` returns after this.
    pub fn to_error(self) -> TransportError {
        match self {
            Self::Local | Self::Shutdown => TransportError::Closed,
            Self::Reset(code) => TransportError::transport_close(code),
            Self::IdleTimeout(d) => TransportError::IdleTimeout(d),
            Self::FrameTooLarge { len, max } => waygate_protocol::FrameError::TooLarge {
                len: len as u64,
                max,
            }
            .into(),
            Self::Unreachable => TransportError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                "kcp: peer stopped acknowledging",
            )),
            Self::Failed => TransportError::Violation("kcp session failed on a peer's packet"),
        }
    }
}

/// Why a client handshake failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeError {
    /// No ACCEPT (or session data) before the handshake timeout.
    TimedOut,
    /// The server answered BUSY.
    Refused {
        /// Its code (usually `Overloaded`).
        code: CloseCode,
        /// Its retry-after hint in ms.
        retry_after_ms: u32,
    },
}

impl HandshakeError {
    /// As a transport error.
    pub fn to_error(self) -> TransportError {
        match self {
            Self::TimedOut => TransportError::HandshakeTimeout,
            Self::Refused {
                code,
                retry_after_ms,
            } => TransportError::Refused {
                code,
                retry_after_ms,
            },
        }
    }
}

/// What the endpoint tells its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KcpEvent {
    /// A session exists (server: a valid CONNECT; client: the handshake completed).
    Connected(ConvKey),
    /// One whole message (one frame) for the session's reader.
    Message(ConvKey, Bytes),
    /// The session's send queue dropped below its cap: `send` may go on.
    Writable(ConvKey),
    /// The session ended for its reader (at most once per session). The endpoint may keep it
    /// a little longer to flush; `Released` follows.
    Closed(ConvKey, CloseReason),
    /// The endpoint forgot the session.
    Released(ConvKey),
    /// Client role: the handshake failed; no session was created.
    HandshakeFailed(HandshakeError),
}

/// Why `send` refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    /// No such open session.
    Closed,
    /// Larger than the maximum frame size.
    TooLarge,
}

/// Counters for metrics. Shared (`Arc`) so metrics can read while the driver writes.
#[derive(Debug, Default)]
pub struct KcpStats {
    /// Sessions alive now (gauge).
    pub sessions: AtomicU64,
    /// Sessions created.
    pub sessions_opened: AtomicU64,
    /// Sessions forgotten.
    pub sessions_closed: AtomicU64,
    /// Valid HELLOs received.
    pub hellos: AtomicU64,
    /// COOKIE replies sent.
    pub cookies_sent: AtomicU64,
    /// CONNECTs whose MAC did not verify.
    pub bad_macs: AtomicU64,
    /// CONNECTs whose cookie had expired.
    pub expired_cookies: AtomicU64,
    /// BUSY replies sent.
    pub busy_sent: AtomicU64,
    /// Replies not sent because a rate limit was exhausted.
    pub rate_limited: AtomicU64,
    /// Segments for a known conv from another address (spoofed or rebound), dropped.
    pub foreign_segments: AtomicU64,
    /// Segments for no session, dropped (maybe answered RESET).
    pub unknown_segments: AtomicU64,
    /// Datagrams too short or malformed, dropped.
    pub malformed: AtomicU64,
    /// RESETs sent.
    pub resets_sent: AtomicU64,
    /// Panics caught in a session's packet handling (each closed that session).
    pub panics: AtomicU64,
    /// Segments the engine refused (bad size, unknown command, ...).
    pub kcp_errors: AtomicU64,
    /// Sessions closed because the peer sent an oversized message.
    pub oversized: AtomicU64,
    /// Sessions closed by the idle timeout.
    pub idle_timeouts: AtomicU64,
    /// Times the listener's driver task panicked and was restarted (its sessions ended).
    pub driver_restarts: AtomicU64,
    /// Datagrams longer than this endpoint's mtu, dropped unread.
    pub oversized_datagrams: AtomicU64,
    /// HELLOs refused by the edge's admission gate (per-source and global rates, overload):
    /// answered BUSY before any cookie work.
    pub admission_refused: AtomicU64,
    /// Sessions opened sealed (a CONNECT with a connect token, PROTOCOL.md §8.9).
    pub sealed_sessions: AtomicU64,
    /// Datagrams for a sealed session that did not authenticate (forged, altered, spoofed,
    /// or an unsealed RESET), dropped before the engine.
    pub unauthenticated: AtomicU64,
    /// Sealed datagrams whose packet number was already received (or too old), dropped.
    pub replayed: AtomicU64,
    /// CONNECTs refused for their connect token (invalid, or none where required).
    pub connect_refused: AtomicU64,
}

impl KcpStats {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

type OutQueue = Arc<Mutex<VecDeque<Transmit>>>;

fn push_out(queue: &OutQueue, transmit: Transmit) {
    queue
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push_back(transmit);
}

/// A sealed session's sender, shared by its engine's output and its RESET.
type SharedSealer = Arc<Mutex<PacketSealer>>;

fn seal_with(sealer: &SharedSealer, plaintext: &[u8]) -> Vec<u8> {
    sealer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .seal(plaintext)
}

/// The engine's output: each `write` is one datagram to the session's peer (sealed in a
/// sealed session).
struct Output {
    dest: SocketAddr,
    queue: OutQueue,
    sealer: Option<SharedSealer>,
}

impl io::Write for Output {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let payload = match &self.sealer {
            Some(sealer) => seal_with(sealer, buf),
            None => buf.to_vec(),
        };
        push_out(
            &self.queue,
            Transmit {
                dest: self.dest,
                payload,
            },
        );
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    /// Waiting for the last data to be acked; RESET with `code` afterwards.
    Closing {
        deadline: Instant,
        code: CloseCode,
    },
}

struct Session {
    kcp: Kcp<Output>,
    state: State,
    last_rx: Instant,
    /// Messages the reader can still take before the endpoint stops draining the engine.
    credit: usize,
    /// Bytes of messages the reader can still take (`inbound_queue_bytes`).
    credit_bytes: usize,
    send_blocked: bool,
    /// The session's one live timer entry: its next deadline (other heap entries of the
    /// session are stale).
    scheduled: Option<Instant>,
    /// An ACK is owed for a delivered message and waits (at most until then) for a send
    /// to carry it.
    ack_due: Option<Instant>,
    /// `Closed` was emitted.
    ended: bool,
    /// A sealed session's receiver and sender (PROTOCOL.md §8.9).
    opener: Option<PacketOpener>,
    sealer: Option<SharedSealer>,
}

/// Client handshake progress.
#[derive(Debug, Clone, Copy)]
enum Handshake {
    Hello { nonce: u64 },
    Connect { cookie: Cookie },
    Done,
}

#[derive(Debug)]
struct ClientRole {
    server: SocketAddr,
    /// Connect token and session key: the CONNECT carries the token, the session is sealed.
    credentials: Option<KcpCredentials>,
    state: Handshake,
    deadline: Instant,
    next_resend: Instant,
    attempts: u32,
}

#[derive(Debug, Default)]
struct Pump {
    too_large: Option<usize>,
}

/// The sans-IO endpoint (server or client role). See the module docs.
pub struct KcpEndpoint {
    config: KcpConfig,
    max_frame_size: usize,
    idle_timeout: Option<Duration>,
    epoch: Instant,
    cookie_key: CookieKey,
    rng: StdRng,
    sessions: HashMap<ConvKey, Session>,
    convs: HashMap<u32, SocketAddr>,
    timers: BinaryHeap<Reverse<(Instant, ConvKey)>>,
    out: OutQueue,
    events: VecDeque<KcpEvent>,
    cookie_bucket: TokenBucket,
    /// Retry-after hints of cookie-rate refusals, spread one token apart (a storm of
    /// resumes comes back over the bucket's rate, not all at once).
    cookie_slots: RetrySlots,
    reject_bucket: TokenBucket,
    accepting: bool,
    client: Option<ClientRole>,
    /// Server: opens connect tokens (None: no token is accepted).
    connect_keys: Option<Arc<dyn ConnectKeys>>,
    /// Server: a CONNECT without a connect token is refused.
    require_sealed: bool,
    stats: Arc<KcpStats>,
    #[cfg(test)]
    inject_panic: Option<ConvKey>,
}

impl std::fmt::Debug for KcpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KcpEndpoint")
            .field("sessions", &self.sessions.len())
            .field("client", &self.client)
            .finish()
    }
}

impl KcpEndpoint {
    /// A server endpoint. `rng` supplies convs and the cookie secret.
    pub fn server(
        config: KcpConfig,
        conn: &ConnConfig,
        now: Instant,
        rng: StdRng,
    ) -> Result<Self, TransportError> {
        Self::new(config, conn, now, rng, None)
    }

    /// This endpoint counting into `stats` (a restarted listener keeps its counters).
    #[must_use]
    pub fn with_stats(mut self, stats: Arc<KcpStats>) -> Self {
        stats
            .sessions
            .store(self.session_count() as u64, Ordering::Relaxed);
        self.stats = stats;
        self
    }

    /// A client endpoint that starts the handshake with `server` at once (HELLO is queued).
    pub fn client(
        config: KcpConfig,
        conn: &ConnConfig,
        now: Instant,
        rng: StdRng,
        server: SocketAddr,
    ) -> Result<Self, TransportError> {
        let mut ep = Self::new(config, conn, now, rng, Some(server))?;
        let nonce = ep.rng.random();
        let resend = ep.resend_interval(0);
        ep.client = Some(ClientRole {
            server,
            credentials: None,
            state: Handshake::Hello { nonce },
            deadline: now + conn.handshake_timeout,
            next_resend: now + resend,
            attempts: 0,
        });
        ep.send_control(
            server,
            Control::Hello {
                client_nonce: nonce,
            },
        );
        Ok(ep)
    }

    fn new(
        config: KcpConfig,
        conn: &ConnConfig,
        now: Instant,
        mut rng: StdRng,
        _server: Option<SocketAddr>,
    ) -> Result<Self, TransportError> {
        config.validate(conn.max_frame_size)?;
        let secret: [u8; 32] = rng.random();
        Ok(Self {
            max_frame_size: conn.max_frame_size,
            idle_timeout: conn.idle_timeout,
            epoch: now,
            cookie_key: CookieKey::new(&secret),
            rng,
            sessions: HashMap::new(),
            convs: HashMap::new(),
            timers: BinaryHeap::new(),
            out: Arc::new(Mutex::new(VecDeque::new())),
            events: VecDeque::new(),
            cookie_bucket: TokenBucket::new(
                Rate::per_second(config.cookie_rate_per_sec.into()),
                config.cookie_burst.into(),
                now,
            ),
            cookie_slots: RetrySlots::new(Rate::per_second(config.cookie_rate_per_sec.into())),
            reject_bucket: TokenBucket::new(
                Rate::per_second(config.reject_rate_per_sec.into()),
                config.reject_rate_per_sec.max(1).into(),
                now,
            ),
            accepting: true,
            client: None,
            connect_keys: conn.connect_keys.clone(),
            require_sealed: false,
            stats: Arc::new(KcpStats::default()),
            config,
            #[cfg(test)]
            inject_panic: None,
        })
    }

    /// Server: whether a CONNECT must carry a connect token (sealed sessions only).
    #[must_use]
    pub fn requiring_sealed(mut self, required: bool) -> Self {
        self.require_sealed = required;
        self
    }

    /// Client: the connect token the CONNECT carries and the session key every datagram is
    /// sealed with (PROTOCOL.md §8.9). Set before the cookie comes back.
    #[must_use]
    pub fn with_credentials(mut self, credentials: Option<KcpCredentials>) -> Self {
        if let Some(c) = self.client.as_mut() {
            c.credentials = credentials;
        }
        self
    }

    /// The counters.
    pub fn stats(&self) -> Arc<KcpStats> {
        self.stats.clone()
    }

    /// Sessions held now (open or lingering).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Whether `key` is a session of this endpoint.
    pub fn has_session(&self, key: ConvKey) -> bool {
        self.sessions.contains_key(&key)
    }

    /// Server: stop (or resume) creating sessions; HELLO and CONNECT get BUSY(GoingAway).
    pub fn set_accepting(&mut self, accepting: bool) {
        self.accepting = accepting;
    }

    fn now_ms(&self, now: Instant) -> u32 {
        // The engine's clock is u32 ms and wraps; it does wrapping arithmetic inside.
        now.saturating_duration_since(self.epoch).as_millis() as u32
    }

    fn now_secs(&self, now: Instant) -> u32 {
        now.saturating_duration_since(self.epoch).as_secs() as u32
    }

    fn resend_interval(&self, attempts: u32) -> Duration {
        Duration::from_millis(self.config.handshake_resend_ms << attempts.min(3))
    }

    fn send_control(&mut self, dest: SocketAddr, packet: Control) {
        push_out(
            &self.out,
            Transmit {
                dest,
                payload: packet.encode(),
            },
        );
    }

    /// Sends a BUSY or RESET if the reject bucket allows.
    fn send_reject(&mut self, now: Instant, dest: SocketAddr, packet: Control) {
        if self.reject_bucket.try_take(now, 1).is_ok() {
            match packet {
                Control::Busy { .. } => KcpStats::bump(&self.stats.busy_sent),
                _ => KcpStats::bump(&self.stats.resets_sent),
            }
            self.send_control(dest, packet);
        } else {
            KcpStats::bump(&self.stats.rate_limited);
        }
    }

    /// The next datagram to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .pop_front()
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<KcpEvent> {
        self.events.pop_front()
    }

    /// When [`KcpEndpoint::handle_timeout`] must be called next (`None`: nothing scheduled).
    ///
    /// Entries a session no longer waits for (its deadline moved, or it ended) are dropped
    /// here rather than woken for: a driver sleeping until one would wake for nothing.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        while let Some(&Reverse((t, key))) = self.timers.peek() {
            if self.is_live_timer(t, key) {
                break;
            }
            self.timers.pop();
        }
        let session = self.timers.peek().map(|Reverse((t, _))| *t);
        let handshake = self.client.as_ref().and_then(|c| match c.state {
            Handshake::Done => None,
            _ => Some(c.next_resend.min(c.deadline)),
        });
        match (session, handshake) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// One datagram arrived from `from`.
    pub fn handle_datagram(&mut self, now: Instant, from: SocketAddr, datagram: &[u8]) {
        if is_control(datagram) {
            match Control::decode(datagram) {
                Some(packet) => self.on_control(now, from, packet, datagram),
                None => KcpStats::bump(&self.stats.malformed),
            }
        } else {
            self.on_segment(now, from, datagram);
        }
    }

    /// Whether `key` is a session whose datagrams must be sealed.
    fn is_sealed(&self, key: &ConvKey) -> bool {
        self.sessions.get(key).is_some_and(|s| s.opener.is_some())
    }

    /// A RESET that came as a plain control packet: honoured for a plain session only (a
    /// sealed session's RESET comes sealed, §8.9).
    fn plain_reset(&mut self, now: Instant, key: ConvKey, code: CloseCode) {
        if !self.sessions.contains_key(&key) {
            return;
        }
        if self.is_sealed(&key) {
            KcpStats::bump(&self.stats.unauthenticated);
            return;
        }
        self.peer_reset(now, key, code);
    }

    fn on_control(&mut self, now: Instant, from: SocketAddr, packet: Control, datagram: &[u8]) {
        if self.client.is_some() {
            self.on_client_control(now, from, packet);
            return;
        }
        match packet {
            Control::Hello { client_nonce } => {
                KcpStats::bump(&self.stats.hellos);
                if !self.accepting || self.sessions.len() >= self.config.max_sessions {
                    self.busy(now, from, client_nonce);
                    return;
                }
                self.send_cookie(now, from, client_nonce);
            }
            Control::Connect(cookie) => {
                self.on_connect(now, from, cookie, connect_token(datagram));
            }
            Control::Reset { conv, code } => {
                self.plain_reset(now, ConvKey { addr: from, conv }, code);
            }
            // Server-to-client packets sent to a server: ignored.
            Control::Cookie(_) | Control::Accept { .. } | Control::Busy { .. } => {
                KcpStats::bump(&self.stats.malformed);
            }
        }
    }

    /// Server: answers the HELLO (`client_nonce`) the shell's admission gate refused with
    /// BUSY(`code`, `retry_after_ms`) — rate-limited like every refusal, never a cookie.
    pub fn refuse_hello(
        &mut self,
        now: Instant,
        from: SocketAddr,
        client_nonce: u64,
        code: CloseCode,
        retry_after_ms: u32,
    ) {
        KcpStats::bump(&self.stats.admission_refused);
        self.send_busy(now, from, client_nonce, code, retry_after_ms);
    }

    fn busy(&mut self, now: Instant, to: SocketAddr, client_nonce: u64) {
        let code = if self.accepting {
            CloseCode::Overloaded
        } else {
            CloseCode::GoingAway
        };
        self.send_busy(now, to, client_nonce, code, self.config.busy_retry_after_ms);
    }

    fn fresh_conv(&mut self) -> u32 {
        loop {
            let conv: u32 = self.rng.random();
            if conv != 0 && !self.convs.contains_key(&conv) {
                return conv;
            }
        }
    }

    fn send_cookie(&mut self, now: Instant, to: SocketAddr, client_nonce: u64) {
        if let Err(wait) = self.cookie_bucket.try_take(now, 1) {
            // Over the cookie rate: say so (rate-limited too), never amplify. The hint is a
            // slot of its own, so clients refused together come back one token apart.
            KcpStats::bump(&self.stats.rate_limited);
            if !self.accepting {
                self.busy(now, to, client_nonce);
                return;
            }
            let hint = self.cookie_slots.hint(now, wait.0);
            let ms = u32::try_from(hint.as_millis()).unwrap_or(u32::MAX).max(1);
            self.send_busy(now, to, client_nonce, CloseCode::Overloaded, ms);
            return;
        }
        let conv = self.fresh_conv();
        let cookie = self
            .cookie_key
            .issue(to, client_nonce, conv, self.now_secs(now));
        KcpStats::bump(&self.stats.cookies_sent);
        self.send_control(to, Control::Cookie(cookie));
    }

    /// Refuses a CONNECT for its connect token: BUSY with the auth code, no retry hint.
    fn refuse_connect(
        &mut self,
        now: Instant,
        from: SocketAddr,
        client_nonce: u64,
        code: CloseCode,
    ) {
        KcpStats::bump(&self.stats.connect_refused);
        self.send_busy(now, from, client_nonce, code, 0);
    }

    /// A rate-limited BUSY (`code`, `retry_after_ms`) for the handshake of `client_nonce`.
    fn send_busy(
        &mut self,
        now: Instant,
        to: SocketAddr,
        client_nonce: u64,
        code: CloseCode,
        retry_after_ms: u32,
    ) {
        let packet = Control::Busy {
            client_nonce,
            code,
            retry_after_ms,
        };
        self.send_reject(now, to, packet);
    }

    fn on_connect(&mut self, now: Instant, from: SocketAddr, cookie: Cookie, token: Option<&[u8]>) {
        match self.cookie_key.verify(
            from,
            &cookie,
            self.now_secs(now),
            self.config.cookie_lifetime_secs,
        ) {
            Ok(()) => {}
            Err(CookieError::BadMac) => {
                KcpStats::bump(&self.stats.bad_macs);
                return;
            }
            Err(CookieError::Expired) => {
                // Genuine but old: hand out a fresh one (smaller than the CONNECT).
                KcpStats::bump(&self.stats.expired_cookies);
                if self.accepting {
                    self.send_cookie(now, from, cookie.client_nonce);
                }
                return;
            }
        }
        let key = ConvKey {
            addr: from,
            conv: cookie.conv,
        };
        if self.sessions.contains_key(&key) {
            // Idempotent: the ACCEPT was lost.
            self.send_control(from, Control::Accept { conv: key.conv });
            return;
        }
        if !self.accepting || self.sessions.len() >= self.config.max_sessions {
            self.busy(now, from, cookie.client_nonce);
            return;
        }
        if self.convs.contains_key(&cookie.conv) {
            // The random conv collided with a session made since: a new cookie.
            self.send_cookie(now, from, cookie.client_nonce);
            return;
        }
        // The connect token (after the cookie: only a return-routable peer costs a check).
        let session_key = match (token, self.connect_keys.as_ref()) {
            (Some(token), Some(keys)) => match keys.session_key(token) {
                Ok(k) => Some(k),
                Err(code) => {
                    self.refuse_connect(now, from, cookie.client_nonce, code);
                    return;
                }
            },
            (Some(_), None) => {
                self.refuse_connect(
                    now,
                    from,
                    cookie.client_nonce,
                    CloseCode::AuthUnsupportedVersion,
                );
                return;
            }
            (None, _) if self.require_sealed => {
                self.refuse_connect(now, from, cookie.client_nonce, CloseCode::AuthRejected);
                return;
            }
            (None, _) => None,
        };
        self.create_session(now, key, session_key);
        self.send_control(from, Control::Accept { conv: key.conv });
    }

    fn create_session(
        &mut self,
        now: Instant,
        key: ConvKey,
        session_key: Option<super::seal::SessionKey>,
    ) {
        let (sealer, opener) = match session_key {
            Some(k) => {
                let (sealer, opener) = session_seals(&k, key.conv, self.client.is_none());
                KcpStats::bump(&self.stats.sealed_sessions);
                (Some(Arc::new(Mutex::new(sealer))), Some(opener))
            }
            None => (None, None),
        };
        let mut kcp = Kcp::new(
            key.conv,
            Output {
                dest: key.addr,
                queue: self.out.clone(),
                sealer: sealer.clone(),
            },
        );
        let c = &self.config;
        // Validated: mtu >= 128, so a sealed session's engine mtu stays >= 100.
        let engine_mtu = if sealer.is_some() {
            c.mtu - SEAL_OVERHEAD
        } else {
            c.mtu
        };
        let _ = kcp.set_mtu(engine_mtu);
        kcp.set_nodelay(
            c.nodelay,
            c.interval_ms as i32,
            c.resend as i32,
            c.no_congestion_control,
        );
        kcp.set_wndsize(c.send_window, c.recv_window);
        let _ = kcp.update(self.now_ms(now));
        self.sessions.insert(
            key,
            Session {
                kcp,
                state: State::Open,
                last_rx: now,
                credit: self.config.inbound_queue_messages,
                credit_bytes: self.config.inbound_queue_bytes,
                send_blocked: false,
                scheduled: None,
                ack_due: None,
                ended: false,
                opener,
                sealer,
            },
        );
        self.convs.insert(key.conv, key.addr);
        KcpStats::bump(&self.stats.sessions_opened);
        self.stats.sessions.fetch_add(1, Ordering::Relaxed);
        self.events.push_back(KcpEvent::Connected(key));
        self.reschedule(now, key);
    }

    fn on_client_control(&mut self, now: Instant, from: SocketAddr, packet: Control) {
        let first_resend = self.resend_interval(0);
        let Some(client) = self.client.as_mut() else {
            return;
        };
        if from != client.server {
            KcpStats::bump(&self.stats.foreign_segments);
            return;
        }
        let server = client.server;
        match (client.state, packet) {
            (Handshake::Hello { nonce }, Control::Cookie(cookie))
            | (
                Handshake::Connect {
                    cookie:
                        Cookie {
                            client_nonce: nonce,
                            ..
                        },
                },
                Control::Cookie(cookie),
            ) if cookie.client_nonce == nonce => {
                client.state = Handshake::Connect { cookie };
                client.attempts = 0;
                client.next_resend = now + first_resend;
                let packet = connect_packet(cookie, client.credentials.as_ref());
                push_out(
                    &self.out,
                    Transmit {
                        dest: server,
                        payload: packet,
                    },
                );
            }
            (Handshake::Connect { cookie }, Control::Accept { conv }) if conv == cookie.conv => {
                self.establish(now, conv);
            }
            (
                Handshake::Hello { nonce },
                Control::Busy {
                    client_nonce,
                    code,
                    retry_after_ms,
                },
            )
            | (
                Handshake::Connect {
                    cookie:
                        Cookie {
                            client_nonce: nonce,
                            ..
                        },
                },
                Control::Busy {
                    client_nonce,
                    code,
                    retry_after_ms,
                },
            ) if client_nonce == nonce => {
                client.state = Handshake::Done;
                self.events
                    .push_back(KcpEvent::HandshakeFailed(HandshakeError::Refused {
                        code,
                        retry_after_ms,
                    }));
            }
            (Handshake::Done, Control::Reset { conv, code }) => {
                self.plain_reset(now, ConvKey { addr: from, conv }, code);
            }
            // Late duplicates of an exchange already done.
            (Handshake::Done, Control::Accept { .. } | Control::Cookie(_)) => {}
            _ => KcpStats::bump(&self.stats.malformed),
        }
    }

    fn establish(&mut self, now: Instant, conv: u32) {
        let Some(client) = self.client.as_mut() else {
            return;
        };
        client.state = Handshake::Done;
        let key = ConvKey {
            addr: client.server,
            conv,
        };
        let session_key = client.credentials.as_ref().map(|c| c.session_key);
        self.create_session(now, key, session_key);
    }

    fn on_segment(&mut self, now: Instant, from: SocketAddr, datagram: &[u8]) {
        // A peer's mtu must not exceed ours (PROTOCOL.md §8.4): a longer datagram never
        // reaches the engine (it would size the out-of-order buffer by the sender's choice).
        if datagram.len() > self.config.mtu {
            KcpStats::bump(&self.stats.oversized_datagrams);
            return;
        }
        // Read conv ourselves: kcp::get_conv panics on input shorter than 4 bytes.
        let conv = match datagram.first_chunk::<4>() {
            Some(conv) if datagram.len() >= KCP_OVERHEAD => u32::from_le_bytes(*conv),
            _ => {
                KcpStats::bump(&self.stats.malformed);
                return;
            }
        };
        let key = ConvKey { addr: from, conv };
        if !self.sessions.contains_key(&key) {
            // Client: session data before ACCEPT means the ACCEPT was lost.
            let pending = self.client.as_ref().and_then(|c| match c.state {
                Handshake::Connect { cookie } if c.server == from && cookie.conv == conv => {
                    Some(conv)
                }
                _ => None,
            });
            if let Some(conv) = pending {
                self.establish(now, conv);
            }
        }
        if let Some(s) = self.sessions.get_mut(&key) {
            let Some(opener) = s.opener.as_mut() else {
                self.session_input(now, key, datagram);
                return;
            };
            // Sealed: nothing reaches the engine (or ends the session) unless it opens.
            match opener.open(datagram) {
                Ok(plain) if is_control(&plain) => match Control::decode(&plain) {
                    Some(Control::Reset { conv: c, code }) if c == conv => {
                        self.peer_reset(now, key, code);
                    }
                    _ => KcpStats::bump(&self.stats.malformed),
                },
                Ok(plain) if plain.len() >= KCP_OVERHEAD => self.session_input(now, key, &plain),
                Ok(_) => KcpStats::bump(&self.stats.malformed),
                Err(OpenError::Replayed) => KcpStats::bump(&self.stats.replayed),
                Err(OpenError::Forged | OpenError::Malformed) => {
                    KcpStats::bump(&self.stats.unauthenticated);
                }
            }
        } else if self.convs.contains_key(&conv) {
            KcpStats::bump(&self.stats.foreign_segments);
        } else {
            KcpStats::bump(&self.stats.unknown_segments);
            if self.client.is_none() {
                // RESET (16 bytes) is smaller than any segment (>= 24 bytes).
                self.send_reject(
                    now,
                    from,
                    Control::Reset {
                        conv,
                        code: CloseCode::GoingAway,
                    },
                );
            }
        }
    }

    /// Runs `f` on one session inside `catch_unwind`. A panic drops the session (RESET with
    /// `Internal`, counted) and returns `None`; nothing else is touched.
    fn guarded<R>(
        &mut self,
        now: Instant,
        key: ConvKey,
        f: impl FnOnce(&mut Session, &mut VecDeque<KcpEvent>, &KcpStats) -> R,
    ) -> Option<R> {
        #[cfg(test)]
        let inject = self.inject_panic.take_if(|k| *k == key).is_some();
        let session = self.sessions.get_mut(&key)?;
        let events = &mut self.events;
        let stats = &*self.stats;
        let result = catch_unwind(AssertUnwindSafe(|| {
            #[cfg(test)]
            if inject {
                panic!("injected panic for {key:?}");
            }
            f(session, events, stats)
        }));
        match result {
            Ok(r) => Some(r),
            Err(_) => {
                KcpStats::bump(&self.stats.panics);
                tracing::warn!(peer = %key.addr, conv = key.conv, ?now, "kcp session panicked; closed");
                self.forget(key, CloseReason::Failed, Some(CloseCode::Internal));
                None
            }
        }
    }

    fn session_input(&mut self, now: Instant, key: ConvKey, datagram: &[u8]) {
        let now_ms = self.now_ms(now);
        let ok = self.guarded(now, key, |s, _, stats| {
            let _ = s.kcp.update(now_ms);
            match s.kcp.input(datagram) {
                Ok(_) => true,
                Err(e) => {
                    KcpStats::bump(&stats.kcp_errors);
                    tracing::trace!(conv = key.conv, error = %e, "kcp input refused");
                    false
                }
            }
        });
        match ok {
            None => {}
            Some(valid) => {
                if valid {
                    if let Some(s) = self.sessions.get_mut(&key) {
                        s.last_rx = now;
                    }
                }
                self.pump(now, key, valid);
            }
        }
    }

    /// Drains deliverable messages (within credit), flushes, and applies what follows:
    /// oversized messages, the end of a linger, writability, a dead link; then reschedules.
    ///
    /// After an input (`after_input`) that delivered a message to an open session, the flush
    /// waits up to `ack_delay_ms` for a send to carry the ACK (one datagram instead of two
    /// for a request and its reply).
    fn pump(&mut self, now: Instant, key: ConvKey, after_input: bool) {
        let max = self.max_frame_size;
        let all_bytes = self.config.inbound_queue_bytes;
        // Servers only: a client's ACK held back measured as W1 p99 +1 ms (a server's did not).
        let ack_delay = match self.client {
            None => Duration::from_millis(self.config.ack_delay_ms),
            Some(_) => Duration::ZERO,
        };
        let outcome = self.guarded(now, key, |s, events, _| {
            let mut out = Pump::default();
            let mut delivered = false;
            while let Ok(size) = s.kcp.peeksize() {
                let closing = matches!(s.state, State::Closing { .. });
                if !closing {
                    if s.credit == 0 {
                        break;
                    }
                    if size > max {
                        out.too_large = Some(size);
                        break;
                    }
                    // What is left of the byte credit, unless nothing is outstanding: one
                    // message of any allowed size always goes.
                    if size > s.credit_bytes && s.credit_bytes < all_bytes {
                        break;
                    }
                }
                let mut buf = vec![0u8; size];
                match s.kcp.recv(&mut buf) {
                    Ok(n) => {
                        // While closing, what arrives is discarded (nobody reads any more).
                        if !closing {
                            buf.truncate(n);
                            s.credit -= 1;
                            s.credit_bytes = s.credit_bytes.saturating_sub(n);
                            delivered = true;
                            events.push_back(KcpEvent::Message(key, Bytes::from(buf)));
                        }
                    }
                    Err(_) => break,
                }
            }
            let due = s.ack_due.unwrap_or(now + ack_delay);
            if after_input && delivered && s.state == State::Open && now < due {
                s.ack_due = Some(due);
            } else {
                s.ack_due = None;
                let _ = s.kcp.flush();
            }
            out
        });
        let Some(outcome) = outcome else { return };
        if let Some(len) = outcome.too_large {
            KcpStats::bump(&self.stats.oversized);
            self.begin_close(
                now,
                key,
                CloseCode::FrameTooLarge,
                "frame too large",
                CloseReason::FrameTooLarge { len, max },
            );
            return;
        }
        self.after(now, key);
    }

    /// Post-processing after any engine activity.
    fn after(&mut self, now: Instant, key: ConvKey) {
        let cap = self.config.send_queue_segments;
        let Some(s) = self.sessions.get_mut(&key) else {
            return;
        };
        let waiting = s.kcp.wait_snd();
        if s.send_blocked && waiting < cap {
            s.send_blocked = false;
            self.events.push_back(KcpEvent::Writable(key));
        }
        if s.kcp.is_dead_link() {
            self.forget(key, CloseReason::Unreachable, Some(CloseCode::GoingAway));
            return;
        }
        if let State::Closing { deadline, code } = s.state {
            if waiting == 0 || now >= deadline {
                self.forget(key, CloseReason::Local, Some(code));
                return;
            }
        }
        self.reschedule(now, key);
    }

    fn reschedule(&mut self, now: Instant, key: ConvKey) {
        let now_ms = self.now_ms(now);
        let idle = self.idle_timeout;
        let Some(s) = self.sessions.get_mut(&key) else {
            return;
        };
        let mut next: Option<Instant> = None;
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        if s.kcp.wait_snd() > 0 {
            // Something in flight: the engine's next resend/flush time.
            let delay = s.kcp.check(now_ms).max(1);
            consider(now + Duration::from_millis(delay.into()));
        } else if s.ack_due.is_none() {
            // Nothing to send, resend or acknowledge: an idle session keeps no buffers
            // (the engine's output staging buffer is ~3 MTUs; the next flush takes it back).
            s.kcp.release_idle_memory();
        }
        if let Some(due) = s.ack_due {
            consider(due);
        }
        match s.state {
            State::Open => {
                if let Some(idle) = idle {
                    consider(s.last_rx + idle);
                }
            }
            State::Closing { deadline, .. } => consider(deadline),
        }
        // The session's deadline is exactly `next`, later ones included: an ACK that left
        // with a reply, or a send acknowledged, must not leave the driver a wake-up for
        // nothing (W5: two per PING/PONG exchange); the superseded entry goes stale.
        if s.scheduled != next {
            s.scheduled = next;
            if let Some(next) = next {
                self.timers.push(Reverse((next, key)));
            }
        }
        // Drop stale heap entries now and then, so the heap stays O(sessions).
        if self.timers.len() > 4 * self.sessions.len() + 1024 {
            self.timers = self
                .sessions
                .iter()
                .filter_map(|(k, s)| s.scheduled.map(|t| Reverse((t, *k))))
                .collect();
        }
    }

    /// Whether the heap entry (`t`, `key`) is its session's live deadline (a session has one;
    /// entries it superseded, and those of ended sessions, are stale; `handle_timeout` makes
    /// the same test as it takes the entry).
    fn is_live_timer(&self, t: Instant, key: ConvKey) -> bool {
        self.sessions
            .get(&key)
            .is_some_and(|s| s.scheduled == Some(t))
    }

    /// Timers due at `now` fire.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.client_timer(now);
        let mut budget = self.timers.len();
        while budget > 0 {
            budget -= 1;
            let Some(Reverse((t, key))) = self.timers.peek().copied() else {
                break;
            };
            if t > now {
                break;
            }
            self.timers.pop();
            match self.sessions.get_mut(&key) {
                Some(s) if s.scheduled == Some(t) => s.scheduled = None,
                _ => continue, // stale
            }
            self.service(now, key);
        }
    }

    fn client_timer(&mut self, now: Instant) {
        let resend = self
            .client
            .as_ref()
            .map(|c| self.resend_interval(c.attempts + 1));
        let Some(client) = self.client.as_mut() else {
            return;
        };
        let packet = match client.state {
            Handshake::Done => return,
            _ if now >= client.deadline => {
                client.state = Handshake::Done;
                self.events
                    .push_back(KcpEvent::HandshakeFailed(HandshakeError::TimedOut));
                return;
            }
            _ if now < client.next_resend => return,
            Handshake::Hello { nonce } => Control::Hello {
                client_nonce: nonce,
            },
            Handshake::Connect { cookie } => {
                client.attempts += 1;
                client.next_resend = now + resend.unwrap_or_default();
                let payload = connect_packet(cookie, client.credentials.as_ref());
                let dest = client.server;
                push_out(&self.out, Transmit { dest, payload });
                return;
            }
        };
        client.attempts += 1;
        client.next_resend = now + resend.unwrap_or_default();
        let server = client.server;
        self.send_control(server, packet);
    }

    fn service(&mut self, now: Instant, key: ConvKey) {
        let now_ms = self.now_ms(now);
        if self
            .guarded(now, key, |s, _, _| {
                let _ = s.kcp.update(now_ms);
            })
            .is_none()
        {
            return;
        }
        let Some(s) = self.sessions.get(&key) else {
            return;
        };
        if let (State::Open, Some(idle)) = (s.state, self.idle_timeout) {
            if now >= s.last_rx + idle {
                KcpStats::bump(&self.stats.idle_timeouts);
                self.begin_close(
                    now,
                    key,
                    CloseCode::IdleTimeout,
                    "idle timeout",
                    CloseReason::IdleTimeout(idle),
                );
                return;
            }
        }
        self.pump(now, key, false);
    }

    /// Queues one message (one encoded frame) on a session and flushes at once.
    pub fn send(&mut self, now: Instant, key: ConvKey, message: &[u8]) -> Result<(), SendError> {
        if message.len() > self.max_frame_size {
            return Err(SendError::TooLarge);
        }
        match self.sessions.get(&key) {
            Some(s) if s.state == State::Open => {}
            _ => return Err(SendError::Closed),
        }
        let now_ms = self.now_ms(now);
        let cap = self.config.send_queue_segments;
        let result = self.guarded(now, key, |s, _, _| {
            let _ = s.kcp.update(now_ms);
            let sent = s.kcp.send(message);
            // The ACKs owed leave with the message.
            let _ = s.kcp.flush();
            s.ack_due = None;
            if s.kcp.wait_snd() >= cap {
                s.send_blocked = true;
            }
            sent
        });
        let result = match result {
            None => Err(SendError::Closed),
            Some(Ok(_)) => Ok(()),
            Some(Err(kcp::Error::UserBufTooBig)) => Err(SendError::TooLarge),
            Some(Err(_)) => Err(SendError::Closed),
        };
        self.after(now, key);
        result
    }

    /// Whether `send` should go on (the session's send queue is below its cap).
    pub fn can_send(&self, key: ConvKey) -> bool {
        self.sessions
            .get(&key)
            .is_some_and(|s| s.state == State::Open && !s.send_blocked)
    }

    /// The reader took `n` messages of `bytes` in all: give the credit back and deliver
    /// what waits.
    pub fn consumed(&mut self, now: Instant, key: ConvKey, n: usize, bytes: usize) {
        let cap = self.config.inbound_queue_messages;
        let cap_bytes = self.config.inbound_queue_bytes;
        let Some(s) = self.sessions.get_mut(&key) else {
            return;
        };
        s.credit = (s.credit + n).min(cap);
        s.credit_bytes = s.credit_bytes.saturating_add(bytes).min(cap_bytes);
        self.pump(now, key, false);
    }

    /// Closes a session: sends a CLOSE frame with `code` through KCP (unless `quiet`, used
    /// when the peer closed first), keeps the session until everything is acked or the linger
    /// deadline passes, then sends RESET and forgets it. Idempotent.
    pub fn close(
        &mut self,
        now: Instant,
        key: ConvKey,
        code: CloseCode,
        message: &str,
        quiet: bool,
    ) {
        if quiet {
            self.begin_close_inner(now, key, code, None, CloseReason::Local);
        } else {
            self.begin_close(now, key, code, message, CloseReason::Local);
        }
    }

    fn begin_close(
        &mut self,
        now: Instant,
        key: ConvKey,
        code: CloseCode,
        message: &str,
        reason: CloseReason,
    ) {
        let frame = Frame::close(code, message).to_bytes();
        self.begin_close_inner(now, key, code, Some(frame), reason);
    }

    fn begin_close_inner(
        &mut self,
        now: Instant,
        key: ConvKey,
        code: CloseCode,
        frame: Option<Bytes>,
        reason: CloseReason,
    ) {
        let linger = Duration::from_millis(self.config.linger_ms);
        let now_ms = self.now_ms(now);
        let Some(s) = self.sessions.get_mut(&key) else {
            return;
        };
        if s.state != State::Open {
            return;
        }
        s.state = State::Closing {
            deadline: now + linger,
            code,
        };
        if !s.ended {
            s.ended = true;
            self.events.push_back(KcpEvent::Closed(key, reason));
        }
        if let Some(frame) = frame {
            let sent = self.guarded(now, key, |s, _, _| {
                let _ = s.kcp.update(now_ms);
                let _ = s.kcp.send(&frame);
                let _ = s.kcp.flush();
            });
            if sent.is_none() {
                return;
            }
        }
        self.after(now, key);
    }

    /// The peer sent RESET: what the engine already received in order (and acknowledged, so
    /// the peer counts it as delivered) still goes to the reader, ignoring the credit (bounded
    /// by the receive window); then the session ends.
    fn peer_reset(&mut self, now: Instant, key: ConvKey, code: CloseCode) {
        let max = self.max_frame_size;
        let _ = self.guarded(now, key, |s, events, _| {
            if s.state != State::Open {
                return;
            }
            while let Ok(size) = s.kcp.peeksize() {
                if size > max {
                    break;
                }
                let mut buf = vec![0u8; size];
                match s.kcp.recv(&mut buf) {
                    Ok(n) => {
                        buf.truncate(n);
                        events.push_back(KcpEvent::Message(key, Bytes::from(buf)));
                    }
                    Err(_) => break,
                }
            }
        });
        self.forget(key, CloseReason::Reset(code), None);
    }

    /// Forgets a session at once, sending RESET with `reset` if given.
    fn forget(&mut self, key: ConvKey, reason: CloseReason, reset: Option<CloseCode>) {
        let Some(s) = self.sessions.remove(&key) else {
            return;
        };
        if self.convs.get(&key.conv) == Some(&key.addr) {
            self.convs.remove(&key.conv);
        }
        if let Some(code) = reset {
            KcpStats::bump(&self.stats.resets_sent);
            let reset = Control::Reset {
                conv: key.conv,
                code,
            };
            match &s.sealer {
                // A sealed session's RESET is sealed like its segments (§8.9).
                Some(sealer) => push_out(
                    &self.out,
                    Transmit {
                        dest: key.addr,
                        payload: seal_with(sealer, &reset.encode()),
                    },
                ),
                None => self.send_control(key.addr, reset),
            }
        }
        if !s.ended {
            self.events.push_back(KcpEvent::Closed(key, reason));
        }
        self.events.push_back(KcpEvent::Released(key));
        KcpStats::bump(&self.stats.sessions_closed);
        self.stats.sessions.fetch_sub(1, Ordering::Relaxed);
        // Keep `s` (and its engine buffers) alive until here only.
        drop(s);
    }

    /// Ends every session at once (RESET with `GoingAway`), e.g. at shutdown.
    pub fn shutdown(&mut self) {
        self.accepting = false;
        let keys: Vec<ConvKey> = self.sessions.keys().copied().collect();
        for key in keys {
            self.forget(key, CloseReason::Shutdown, Some(CloseCode::GoingAway));
        }
        self.timers.clear();
    }

    #[cfg(test)]
    fn inject_panic(&mut self, key: ConvKey) {
        self.inject_panic = Some(key);
    }
}

/// A CONNECT for `cookie`, with the connect token appended when there are credentials
/// (PROTOCOL.md §8.2.4).
fn connect_packet(cookie: Cookie, credentials: Option<&KcpCredentials>) -> Vec<u8> {
    let mut packet = Control::Connect(cookie).encode();
    if let Some(c) = credentials {
        super::cookie::append_connect_token(&mut packet, &c.token);
    }
    packet
}

#[cfg(test)]
mod tests;

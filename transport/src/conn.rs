//! The one connection trait every transport implements, and the listener trait that yields
//! connections after their transport handshake.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::error::TransportError;
use waygate_protocol::frame::Frame;
use waygate_protocol::wire::{CloseCode, DEFAULT_MAX_FRAME_SIZE, MAX_PRE_AUTH_FRAME_SIZE};

/// Which transport carries a connection. For logs and metric labels only: code above the
/// transport crate must not branch on it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// Plain TCP with length-delimited frames.
    Tcp,
    /// TCP inside TLS.
    Tls,
    /// KCP over UDP, after the cookie exchange.
    Kcp,
    /// QUIC.
    Quic,
    /// WebSocket over plain TCP (ws).
    Ws,
    /// WebSocket over TLS (wss).
    Wss,
}

impl TransportKind {
    /// Every kind.
    pub const ALL: [TransportKind; 6] = [
        Self::Tcp,
        Self::Tls,
        Self::Kcp,
        Self::Quic,
        Self::Ws,
        Self::Wss,
    ];

    /// Stable label (also the URL scheme of [`crate::endpoint::Endpoint`]).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Tls => "tls",
            Self::Kcp => "kcp",
            Self::Quic => "quic",
            Self::Ws => "ws",
            Self::Wss => "wss",
        }
    }

    /// Whether the transport runs over UDP (KCP, QUIC): what a client falls back from when
    /// UDP is blocked.
    pub fn is_udp(self) -> bool {
        matches!(self, Self::Kcp | Self::Quic)
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Process-unique connection id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

impl ConnId {
    /// The next id of this process.
    pub fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "c{}", self.0)
    }
}

/// What is known about a connection without reading from it.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// Process-unique id.
    pub id: ConnId,
    /// The transport (labels only).
    pub kind: TransportKind,
    /// The remote address.
    pub peer: SocketAddr,
    /// The local address.
    pub local: SocketAddr,
    /// When the listener accepted the connection (before any TLS, upgrade or QUIC
    /// handshake; KCP: its CONNECT), or when a client started connecting: the start of the
    /// one pre-auth deadline (`session.hello_timeout_ms` from here to WELCOME).
    pub accepted_at: std::time::Instant,
}

/// Per-connection limits shared by all transports.
#[derive(Debug, Clone)]
pub struct ConnConfig {
    /// Largest frame accepted or sent (type byte to end).
    pub max_frame_size: usize,
    /// `recv` fails with [`TransportError::IdleTimeout`] after this long without receiving
    /// anything (T5); the peer keeps the link alive with PING frames.
    pub idle_timeout: Option<Duration>,
    /// Deadline for the transport handshake (TLS, WebSocket upgrade, QUIC, KCP cookie).
    pub handshake_timeout: Duration,
    /// Admission control for listeners (B1); `None` admits everything.
    pub admission: Option<std::sync::Arc<dyn crate::listener::AdmissionGate>>,
    /// WebSocket listeners: the `Origin` values a browser's upgrade may carry (exact,
    /// case-insensitive); a request without `Origin` (a native client) is always accepted.
    /// Empty: any origin.
    pub allowed_origins: std::sync::Arc<[String]>,
    /// KCP listeners: opens the connect tokens CONNECTs carry (sealed sessions, PROTOCOL.md
    /// §8.9); `None`: a CONNECT with a token is refused.
    pub connect_keys: Option<std::sync::Arc<dyn crate::kcp::seal::ConnectKeys>>,
    /// KCP clients: the connect token and session key that seal the session (PROTOCOL.md
    /// §8.9); `None`: a plain session.
    pub kcp_credentials: Option<crate::kcp::seal::KcpCredentials>,
    /// Stream listeners (TCP, TLS, WebSocket): the kernel send buffer of each accepted
    /// socket (SO_SNDBUF; Linux doubles it for bookkeeping). A client that stops reading
    /// then holds at most this much in the kernel, and the session's own bounded queue and
    /// slow-consumer rule decide (B3). `None`: the kernel's autotuning (megabytes).
    pub send_buffer: Option<usize>,
    /// WebSocket connections: the most bytes one read takes from the socket, and what the
    /// connection's read buffer keeps allocated while it is idle (tungstenite's
    /// `read_buffer_size`). A larger message is read in several reads of this size.
    pub ws_read_buffer: usize,
}

/// Default of [`ConnConfig::ws_read_buffer`]: 1 KiB. An idle connection keeps it allocated
/// (4 KiB cost 3 KiB more per idle session, BENCHMARKS.md W4); a message above it takes
/// several reads (512 B cost ~10% more CPU per 8 KiB message; 1 KiB nothing measurable).
pub const DEFAULT_WS_READ_BUFFER: usize = 1024;

impl Default for ConnConfig {
    fn default() -> Self {
        Self {
            max_frame_size: DEFAULT_MAX_FRAME_SIZE,
            idle_timeout: Some(Duration::from_secs(30)),
            handshake_timeout: Duration::from_secs(10),
            admission: None,
            allowed_origins: std::sync::Arc::new([]),
            connect_keys: None,
            kcp_credentials: None,
            send_buffer: None,
            ws_read_buffer: DEFAULT_WS_READ_BUFFER,
        }
    }
}

/// A framed, message-oriented connection: one trait for TCP, TLS, KCP, QUIC and WebSocket.
///
/// One task drives a connection: `recv` is cancel-safe (it can lose a `select!` race without
/// losing data), `send` is not (drop it mid-way and the connection must be closed).
#[async_trait]
pub trait Connection: Send + 'static {
    /// Id, kind and addresses.
    fn info(&self) -> &ConnInfo;

    /// Sends one frame. Its [`Frame::class`] picks the stream or priority where the
    /// transport has several (QUIC: a stream per class, best-effort as datagrams).
    async fn send(&mut self, frame: &Frame) -> Result<(), TransportError>;

    /// Sends several frames, coalescing writes where the transport allows.
    async fn send_batch(&mut self, frames: &[Frame]) -> Result<(), TransportError> {
        for frame in frames {
            self.send(frame).await?;
        }
        Ok(())
    }

    /// Receives the next frame. Cancel-safe. A CLOSE frame from the peer is returned as
    /// `Err(ClosedByPeer { code })`; a malformed or oversized frame as `Err(Frame(..))`,
    /// after which the connection is closed with that error's code.
    async fn recv(&mut self) -> Result<Frame, TransportError>;

    /// Sends a CLOSE frame with `code`, flushes what is queued (bounded by a short deadline)
    /// and closes the transport. Idempotent.
    async fn close(&mut self, code: CloseCode, message: &str);

    /// Whether the peer is known to have closed the connection, found without waiting and
    /// without taking a frame: whatever the socket holds now is taken into the connection's
    /// own bounded buffer and left there for [`Connection::recv`], which checks it against
    /// the frame limit in force when it is read. `false` when it cannot tell (nothing
    /// arrived, or more than a pre-auth frame is buffered already). Once `true`, `recv`
    /// fails. For a handshake to see, before it takes anything, that its client gave up on
    /// it; cheap enough to call once per handshake step, not meant for a loop.
    fn peer_closed(&mut self) -> bool {
        false
    }

    /// The session on this connection is past its handshake (WELCOME sent): a server-side
    /// connection frees its admission slot (one of `max_handshakes`, held from the accept to
    /// here on every transport) and accepts frames up to the configured maximum instead of
    /// [`MAX_PRE_AUTH_FRAME_SIZE`]. Idempotent; nothing for client-side connections.
    fn handshake_done(&mut self);
}

/// What a server-side connection holds until its session's WELCOME: the admission slot its
/// listener took for it, and the pre-auth frame limit. Client-side connections use
/// [`PreAuth::none`].
#[derive(Debug, Default)]
pub struct PreAuth {
    slot: Option<waygate_backpressure::HandshakePermit>,
    limited: bool,
}

impl PreAuth {
    /// No limit and no slot (client side, or after WELCOME).
    pub fn none() -> Self {
        Self::default()
    }

    /// A connection accepted by a listener: frames limited to [`MAX_PRE_AUTH_FRAME_SIZE`]
    /// and `slot` held until [`PreAuth::done`].
    pub fn accepted(slot: Option<waygate_backpressure::HandshakePermit>) -> Self {
        Self {
            slot,
            limited: true,
        }
    }

    /// The largest frame accepted now, given the configured maximum.
    pub fn frame_limit(&self, configured: usize) -> usize {
        if self.limited {
            configured.min(MAX_PRE_AUTH_FRAME_SIZE)
        } else {
            configured
        }
    }

    /// Refuses a received frame above the current limit, as an oversized frame is refused.
    pub fn check(&self, frame: &Frame, configured: usize) -> Result<(), TransportError> {
        if !self.limited {
            // Past WELCOME the transport's own limit applies; nothing to measure.
            return Ok(());
        }
        let max = self.frame_limit(configured);
        let len = frame.encoded_len();
        if len > max {
            return Err(TransportError::Frame(
                waygate_protocol::error::FrameError::TooLarge {
                    len: len as u64,
                    max,
                },
            ));
        }
        Ok(())
    }

    /// WELCOME was sent: the slot is freed and the limit lifted.
    pub fn done(&mut self) {
        self.slot = None;
        self.limited = false;
    }
}

/// Whether a message of a message transport (one frame per message: WebSocket, KCP)
/// carries a CLOSE frame, judged by its type byte without decoding it.
pub(crate) fn is_close_message(message: &[u8]) -> bool {
    message
        .first()
        .copied()
        .and_then(waygate_protocol::wire::FrameType::from_u8)
        == Some(waygate_protocol::wire::FrameType::Close)
}

/// A boxed connection, as listeners yield them.
pub type BoxConnection = Box<dyn Connection>;

/// A listener yields connections whose transport handshake is complete. Handshakes run
/// concurrently in the background, each under `handshake_timeout`; failures are logged and
/// counted there and never returned from `accept`.
#[async_trait]
pub trait Listener: Send + 'static {
    /// The bound address (useful after binding port 0).
    fn local_addr(&self) -> SocketAddr;

    /// The transport (labels only).
    fn kind(&self) -> TransportKind;

    /// The next ready connection; `None` once the listener is shut down.
    async fn accept(&mut self) -> Option<BoxConnection>;
}

/// A boxed listener.
pub type BoxListener = Box<dyn Listener>;

/// Tracks the idle deadline of a connection: `recv` implementations reset it on every
/// received byte and race their read against [`IdleTimer::expired`].
#[derive(Debug, Clone)]
pub struct IdleTimer {
    timeout: Option<Duration>,
    last_rx: Instant,
}

impl IdleTimer {
    /// Starts the timer now.
    pub fn new(timeout: Option<Duration>) -> Self {
        Self {
            timeout,
            last_rx: Instant::now(),
        }
    }

    /// Something arrived.
    pub fn touch(&mut self) {
        self.last_rx = Instant::now();
    }

    /// Resolves when the idle deadline passes (never, without a timeout). Cancel-safe.
    pub async fn expired(&self) -> TransportError {
        match self.timeout {
            Some(timeout) => {
                tokio::time::sleep_until(self.last_rx + timeout).await;
                TransportError::IdleTimeout(timeout)
            }
            None => std::future::pending().await,
        }
    }
}

/// Counters every transport keeps, for the edge's metrics.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections that completed the transport handshake.
    pub accepted: AtomicU64,
    /// Handshakes that failed or timed out.
    pub handshake_failed: AtomicU64,
    /// Connections closed because the peer sent an invalid frame.
    pub bad_frames: AtomicU64,
    /// Connections refused by admission control (B1).
    pub refused: AtomicU64,
    /// QUIC: connection attempts answered with a Retry (address validation).
    pub quic_retries: AtomicU64,
}

impl ListenerStats {
    /// Adds one to a counter.
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

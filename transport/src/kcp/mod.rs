//! KCP over UDP, safe on the open internet (SPEC T4, T4a): a server endpoint keyed by
//! (address, conv) behind a stateless cookie exchange, and the client side of it.
//!
//! Layers, bottom up:
//! - [`cookie`]: the control packets (HELLO, COOKIE, CONNECT, ACCEPT, BUSY, RESET) and the
//!   HMAC cookie. Byte tables: PROTOCOL.md §8.
//! - [`endpoint`]: the sans-IO core. Every session of one socket, the handshake (both
//!   roles), one shared timer heap fed by the engine's `check()`, bounded queues, monotonic
//!   time passed in, and `catch_unwind` around each session's engine calls.
//! - `driver`: one tokio task per UDP socket owns the core; connections reach it through a
//!   bounded command channel and per-session shared state.
//! - this module: [`KcpConfig`] with the [`KcpConfig::fast`] / [`KcpConfig::normal`]
//!   presets, [`KcpListener`] ([`listen`]), [`connect_kcp`] and [`KcpConnection`].
//!
//! After ACCEPT the session carries plain reference-ikcp segments with the assigned conv in
//! message mode: one KCP message = one client-protocol frame, no length prefix. Any KCP
//! library can talk to waygate after the cookie exchange.
//!
//! ```no_run
//! # async fn demo() -> Result<(), waygate_transport::TransportError> {
//! use waygate_transport::kcp::{connect_kcp, KcpConfig, KcpListener};
//! use waygate_transport::{ConnConfig, Listener};
//!
//! let mut listener =
//!     KcpListener::bind("127.0.0.1:0".parse().unwrap(), KcpConfig::fast(), ConnConfig::default())
//!         .await?;
//! let client = connect_kcp(listener.local_addr(), &KcpConfig::fast(), &ConnConfig::default());
//! let (server_side, client_side) = tokio::join!(listener.accept(), client);
//! # let _ = (server_side, client_side?);
//! # Ok(())
//! # }
//! ```

pub mod config;
pub mod cookie;
mod driver;
pub mod endpoint;
pub mod seal;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::BytesMut;
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot};

pub use config::{KcpConfig, KcpPreset};
pub use endpoint::KcpStats;

use crate::conn::{BoxConnection, ConnConfig, ConnInfo, Connection, Listener, TransportKind};
use crate::error::TransportError;
use driver::{Channels, Cmd, ConnParams, Driver, Role, Shared};
use endpoint::KcpEndpoint;
use waygate_protocol::codec::{decode_message, encode_message};
use waygate_protocol::frame::Frame;
use waygate_protocol::wire::CloseCode;

/// Ready connections waiting for `accept`.
const ACCEPT_BACKLOG: usize = 1024;
/// Capacity of a server driver's command channel (shared by its connections).
const SERVER_CMD_CAPACITY: usize = 4096;
/// Capacity of a client driver's command channel.
const CLIENT_CMD_CAPACITY: usize = 256;
/// Send commands of one connection in the driver's channel at most; beyond, `send` waits.
const MAX_IN_CHANNEL: usize = 32;

fn fresh_rng() -> StdRng {
    StdRng::from_rng(&mut rand::rng())
}

fn conn_params(kcp: &KcpConfig, conn: &ConnConfig) -> ConnParams {
    ConnParams {
        max_frame_size: conn.max_frame_size,
        inbound_queue: kcp.inbound_queue_messages,
        inbound_queue_bytes: kcp.inbound_queue_bytes,
        close_wait: Duration::from_millis(kcp.linger_ms) + Duration::from_millis(500),
        admission: conn.admission.clone(),
    }
}

/// Binds a KCP listener on `addr` (the same as [`KcpListener::bind`]; named like the other
/// transports' `listen`).
pub async fn listen(
    addr: SocketAddr,
    kcp: &KcpConfig,
    conn: ConnConfig,
) -> Result<KcpListener, TransportError> {
    KcpListener::bind(addr, kcp.clone(), conn).await
}

/// A KCP listener: one UDP socket, one driver task, sessions after the cookie exchange.
///
/// Dropping the listener stops new sessions (HELLO/CONNECT get BUSY with `GoingAway`);
/// connections already accepted keep working, and the driver task ends with the last one.
pub struct KcpListener {
    local: SocketAddr,
    ready: mpsc::Receiver<BoxConnection>,
    stats: Arc<KcpStats>,
    chaos: Arc<AtomicBool>,
}

/// What a restarted listener driver needs.
struct Restart {
    socket: Arc<UdpSocket>,
    local: SocketAddr,
    kcp: KcpConfig,
    conn: ConnConfig,
    params: ConnParams,
    accept_tx: mpsc::Sender<BoxConnection>,
    stats: Arc<KcpStats>,
    chaos: Arc<AtomicBool>,
}

/// Runs the listener's driver; a panic in it (outside the per-session guard: a bug) is
/// caught, logged and counted, and a fresh endpoint is driven on the same socket (SPEC X,
/// hardening issue item 10). Ends when the driver ends normally (the listener is gone).
async fn supervise(first: KcpEndpoint, restart: Restart) {
    use futures_util::FutureExt as _;
    let mut endpoint = Some(first);
    loop {
        // The first endpoint was made by `bind` (its config checked there); later ones
        // start afresh on the same socket and count into the same stats.
        let ep = match endpoint.take() {
            Some(ep) => ep,
            None => match KcpEndpoint::server(
                restart.kcp.clone(),
                &restart.conn,
                Instant::now(),
                fresh_rng(),
            ) {
                Ok(ep) => ep
                    .with_stats(restart.stats.clone())
                    .requiring_sealed(restart.kcp.packet_auth.required_at(restart.local)),
                Err(e) => {
                    tracing::error!(local = %restart.local, error = %e, "kcp driver cannot restart");
                    return;
                }
            },
        };
        let mut driver = Driver::new(
            restart.socket.clone(),
            restart.local,
            ep,
            Role::Server {
                accept_tx: restart.accept_tx.clone(),
            },
            Channels::new(SERVER_CMD_CAPACITY),
            restart.params.clone(),
        );
        driver.chaos = Some(restart.chaos.clone());
        match std::panic::AssertUnwindSafe(driver.run())
            .catch_unwind()
            .await
        {
            Ok(()) => return,
            Err(panic) => {
                let what = crate::panic_message(&*panic).unwrap_or_default();
                restart
                    .stats
                    .driver_restarts
                    .fetch_add(1, Ordering::Relaxed);
                tracing::error!(local = %restart.local, panic = %what, "kcp driver panicked; restarted (its sessions ended)");
            }
        }
        if restart.accept_tx.is_closed() {
            return;
        }
    }
}

impl std::fmt::Debug for KcpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KcpListener")
            .field("local", &self.local)
            .finish()
    }
}

impl KcpListener {
    /// Binds `addr` and starts the driver task. Fails on invalid configuration (see
    /// [`KcpConfig::validate`]) or when the socket cannot be bound.
    pub async fn bind(
        addr: SocketAddr,
        kcp: KcpConfig,
        conn: ConnConfig,
    ) -> Result<Self, TransportError> {
        let params = conn_params(&kcp, &conn);
        let ep = KcpEndpoint::server(kcp.clone(), &conn, Instant::now(), fresh_rng())?;
        let stats = ep.stats();
        let socket = Arc::new(UdpSocket::from_std(crate::udp::bind_udp(addr)?)?);
        let local = socket.local_addr()?;
        let ep = ep.requiring_sealed(kcp.packet_auth.required_at(local));
        let (accept_tx, ready) = mpsc::channel(ACCEPT_BACKLOG);
        let chaos = Arc::new(AtomicBool::new(false));
        let restart = Restart {
            socket,
            local,
            kcp,
            conn,
            params,
            accept_tx,
            stats: stats.clone(),
            chaos: chaos.clone(),
        };
        tokio::spawn(supervise(ep, restart));
        Ok(Self {
            local,
            ready,
            stats,
            chaos,
        })
    }

    /// A chaos drill for tests and game days: the driver task panics at its next turn, as a
    /// bug would. Supervision restarts it on the same socket (counted in
    /// `driver_restarts`); the sessions it carried end (their clients resume).
    pub fn chaos_panic_driver(&self) {
        self.chaos.store(true, Ordering::SeqCst);
    }

    /// The endpoint's counters (sessions, cookies, bad MACs, spoofed segments, panics...).
    pub fn stats(&self) -> Arc<KcpStats> {
        self.stats.clone()
    }
}

#[async_trait]
impl Listener for KcpListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Kcp
    }

    async fn accept(&mut self) -> Option<BoxConnection> {
        self.ready.recv().await
    }
}

/// Connects to a KCP listener: a UDP socket of its own, HELLO/COOKIE/CONNECT/ACCEPT with
/// retransmission, all under `conn.handshake_timeout`. A BUSY answer fails with
/// [`TransportError::Refused`] carrying the server's code and retry-after hint.
///
/// The configs are copied at once: the returned future borrows nothing.
pub fn connect_kcp(
    addr: SocketAddr,
    kcp: &KcpConfig,
    conn: &ConnConfig,
) -> impl std::future::Future<Output = Result<BoxConnection, TransportError>> + Send + 'static {
    connect_kcp_from(None, addr, kcp, conn)
}

/// [`connect_kcp`] from a socket bound to `local_ip` (`None`: the unspecified address, the
/// kernel picks). A load generator spreads its sockets over several loopback addresses so
/// they are not bounded by one address's ephemeral ports (~28,000 by default).
pub fn connect_kcp_from(
    local_ip: Option<std::net::IpAddr>,
    addr: SocketAddr,
    kcp: &KcpConfig,
    conn: &ConnConfig,
) -> impl std::future::Future<Output = Result<BoxConnection, TransportError>> + Send + 'static {
    let (kcp, conn) = (kcp.clone(), conn.clone());
    async move { connect_owned(local_ip, addr, kcp, conn).await }
}

async fn connect_owned(
    local_ip: Option<std::net::IpAddr>,
    addr: SocketAddr,
    kcp: KcpConfig,
    conn: ConnConfig,
) -> Result<BoxConnection, TransportError> {
    let params = conn_params(&kcp, &conn);
    let ep = KcpEndpoint::client(kcp, &conn, Instant::now(), fresh_rng(), addr)?
        .with_credentials(conn.kcp_credentials.clone());
    let bind: SocketAddr = match local_ip {
        Some(ip) => (ip, 0).into(),
        None if addr.is_ipv4() => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        None => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(bind).await?;
    // A connected socket: the kernel drops datagrams from any other source.
    socket.connect(addr).await?;
    let local = socket.local_addr()?;
    let (tx, rx) = oneshot::channel();
    let driver = Driver::new(
        Arc::new(socket),
        local,
        ep,
        Role::Client { ready: Some(tx) },
        Channels::new(CLIENT_CMD_CAPACITY),
        params,
    );
    tokio::spawn(driver.run());
    match tokio::time::timeout(conn.handshake_timeout + Duration::from_secs(1), rx).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err(TransportError::Closed),
        Err(_) => Err(TransportError::HandshakeTimeout),
    }
}

/// One KCP session as a [`Connection`]. Frames travel one per KCP message.
///
/// `recv` is cancel-safe (it only takes from the session's inbox). `send` waits while the
/// session's engine holds more than `send_queue_segments` segments. Dropping without
/// `close` closes with `Normal` in the background.
pub struct KcpConnection {
    info: ConnInfo,
    shared: Arc<Shared>,
    cmd_tx: mpsc::Sender<Cmd>,
    params: ConnParams,
    /// Server side: the handshake slot and pre-auth frame limit until WELCOME.
    pub(crate) pre_auth: crate::conn::PreAuth,
    closed: bool,
    peer_close: Option<CloseCode>,
}

impl std::fmt::Debug for KcpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KcpConnection")
            .field("info", &self.info)
            .field("conv", &self.shared.key.conv)
            .finish()
    }
}

impl KcpConnection {
    fn new(
        info: ConnInfo,
        shared: Arc<Shared>,
        cmd_tx: mpsc::Sender<Cmd>,
        params: ConnParams,
    ) -> Self {
        Self {
            info,
            shared,
            cmd_tx,
            params,
            pre_auth: crate::conn::PreAuth::none(),
            closed: false,
            peer_close: None,
        }
    }

    /// The session's KCP conv.
    pub fn conv(&self) -> u32 {
        self.shared.key.conv
    }

    fn gone(&self) -> Option<TransportError> {
        if self.closed {
            return Some(TransportError::Closed);
        }
        if let Some(code) = self.peer_close {
            return Some(TransportError::ClosedByPeer { code });
        }
        None
    }

    /// Waits until the session may take another frame.
    async fn writable(&self) -> Result<(), TransportError> {
        loop {
            if let Some(end) = self.shared.end() {
                return Err(end.to_error());
            }
            if !self.shared.send_blocked.load(Ordering::SeqCst)
                && self.shared.in_channel.load(Ordering::SeqCst) < MAX_IN_CHANNEL
            {
                return Ok(());
            }
            self.shared.writable.notified().await;
        }
    }

    fn returned_credit(&self, inbox_empty: bool, bytes: usize) {
        let consumed = self.shared.consumed.fetch_add(1, Ordering::SeqCst) + 1;
        let consumed_bytes = self
            .shared
            .consumed_bytes
            .fetch_add(bytes, Ordering::SeqCst)
            + bytes;
        if inbox_empty
            || consumed >= (self.params.inbound_queue / 4).max(1)
            || consumed_bytes >= (self.params.inbound_queue_bytes / 4).max(1)
        {
            self.shared.request_attention();
        }
    }
}

#[async_trait]
impl Connection for KcpConnection {
    fn info(&self) -> &ConnInfo {
        &self.info
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), TransportError> {
        if let Some(e) = self.gone() {
            return Err(e);
        }
        let len = frame.encoded_len();
        let max = self.params.max_frame_size;
        if len > max {
            return Err(TransportError::SendTooLarge { len, max });
        }
        self.writable().await?;
        let mut buf = BytesMut::with_capacity(len);
        encode_message(frame, max, &mut buf)?;
        self.shared.in_channel.fetch_add(1, Ordering::SeqCst);
        let cmd = Cmd::Send {
            key: self.shared.key,
            data: buf.freeze(),
        };
        if self.cmd_tx.send(cmd).await.is_err() {
            return Err(TransportError::Closed);
        }
        Ok(())
    }

    async fn recv(&mut self) -> Result<Frame, TransportError> {
        loop {
            if let Some(e) = self.gone() {
                return Err(e);
            }
            let next = {
                let mut inbox = self.shared.inbox();
                match inbox.messages.pop_front() {
                    Some(message) => Ok((message, inbox.messages.is_empty())),
                    None => Err(inbox.end),
                }
            };
            match next {
                Ok((message, empty)) => {
                    self.returned_credit(empty, message.len());
                    let limit = self.pre_auth.frame_limit(self.params.max_frame_size);
                    return match decode_message(message, limit) {
                        Ok(Frame::Close { code, .. }) => {
                            self.peer_close = Some(code);
                            self.shared.peer_closed.store(true, Ordering::SeqCst);
                            Err(TransportError::ClosedByPeer { code })
                        }
                        Ok(frame) => Ok(frame),
                        Err(e) => {
                            tracing::debug!(conn = %self.info.id, error = %e, "closing after invalid frame");
                            self.close(e.close_code(), "invalid frame").await;
                            Err(e.into())
                        }
                    };
                }
                Err(Some(end)) => return Err(end.to_error()),
                Err(None) => self.shared.readable.notified().await,
            }
        }
    }

    /// The driver has ended the session, or a CLOSE frame waits in the inbox (nothing is
    /// taken off it).
    fn peer_closed(&mut self) -> bool {
        if self.peer_close.is_some() {
            return true;
        }
        if self.closed {
            return false;
        }
        let inbox = self.shared.inbox();
        inbox.end.is_some()
            || inbox
                .messages
                .iter()
                .any(|m| crate::conn::is_close_message(m))
    }

    async fn close(&mut self, code: CloseCode, message: &str) {
        if self.closed {
            return;
        }
        self.closed = true;
        if self.shared.released.load(Ordering::SeqCst) {
            return;
        }
        let cmd = Cmd::Close {
            key: self.shared.key,
            code,
            message: message.to_owned(),
            quiet: self.peer_close.is_some(),
        };
        let shared = self.shared.clone();
        let cmd_tx = self.cmd_tx.clone();
        let _ = tokio::time::timeout(self.params.close_wait, async move {
            if cmd_tx.send(cmd).await.is_err() {
                return;
            }
            while !shared.released.load(Ordering::SeqCst) {
                shared.released_notify.notified().await;
            }
        })
        .await;
    }

    fn handshake_done(&mut self) {
        self.pre_auth.done();
    }
}

impl Drop for KcpConnection {
    fn drop(&mut self) {
        self.shared.dropped.store(true, Ordering::SeqCst);
        self.shared.request_attention();
    }
}

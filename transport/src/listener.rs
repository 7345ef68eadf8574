//! The listener shell every transport shares: a background accept task pushes connections
//! whose transport handshake is complete into a bounded queue that `accept` drains.
//! Handshakes run concurrently, each under its deadline; failures are logged and counted,
//! never returned from `accept`.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::conn::{BoxConnection, Listener, ListenerStats, TransportKind};
use crate::error::TransportError;
use waygate_protocol::wire::CloseCode;

/// Ready connections waiting for `accept`.
const ACCEPT_BACKLOG: usize = 1024;

/// A bound listener of any transport.
pub struct TransportListener {
    local: SocketAddr,
    kind: TransportKind,
    ready: mpsc::Receiver<BoxConnection>,
    stats: Arc<ListenerStats>,
    task: tokio::task::JoinHandle<()>,
    on_drop: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for TransportListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportListener")
            .field("local", &self.local)
            .field("kind", &self.kind)
            .finish()
    }
}

/// What an accept task gets to hand connections over.
#[derive(Clone)]
pub(crate) struct Handoff {
    tx: mpsc::Sender<BoxConnection>,
    pub(crate) stats: Arc<ListenerStats>,
    kind: TransportKind,
}

impl Handoff {
    /// Whether the listener was dropped (the accept task should end).
    pub(crate) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Hands over a connection that needed no handshake.
    pub(crate) async fn ready(&self, conn: BoxConnection) -> bool {
        ListenerStats::bump(&self.stats.accepted);
        self.tx.send(conn).await.is_ok()
    }

    /// Runs `handshake` in its own task under `deadline`, then hands the connection over.
    pub(crate) fn spawn_handshake<F>(&self, peer: SocketAddr, deadline: Duration, handshake: F)
    where
        F: Future<Output = Result<BoxConnection, TransportError>> + Send + 'static,
    {
        let this = self.clone();
        // Boxed: an async block holds what it captures beside what it awaits, and a TLS or
        // WebSocket handshake future is several KiB (20 KiB for wss); a pointer is copied
        // instead, so a pending handshake costs its future once (performance issue, W4).
        let handshake = Box::pin(handshake);
        tokio::spawn(async move {
            match tokio::time::timeout(deadline, handshake).await {
                Ok(Ok(conn)) => {
                    this.ready(conn).await;
                }
                Ok(Err(e)) => {
                    ListenerStats::bump(&this.stats.handshake_failed);
                    tracing::debug!(%peer, kind = %this.kind, error = %e, "handshake failed");
                }
                Err(_) => {
                    ListenerStats::bump(&this.stats.handshake_failed);
                    tracing::debug!(%peer, kind = %this.kind, "handshake timed out");
                }
            }
        });
    }
}

impl TransportListener {
    /// Starts the accept task built by `spawn` and returns the listener.
    pub(crate) fn start<F, Fut>(local: SocketAddr, kind: TransportKind, spawn: F) -> Self
    where
        F: FnOnce(Handoff) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, ready) = mpsc::channel(ACCEPT_BACKLOG);
        let stats = Arc::new(ListenerStats::default());
        let handoff = Handoff {
            tx,
            stats: stats.clone(),
            kind,
        };
        let task = tokio::spawn(spawn(handoff));
        Self {
            local,
            kind,
            ready,
            stats,
            task,
            on_drop: None,
        }
    }

    /// Runs `f` when the listener is dropped (e.g. to close a QUIC endpoint).
    #[cfg_attr(not(feature = "quic"), allow(dead_code))]
    pub(crate) fn with_on_drop(mut self, f: impl FnOnce() + Send + 'static) -> Self {
        self.on_drop = Some(Box::new(f));
        self
    }

    /// Counters of this listener.
    pub fn stats(&self) -> Arc<ListenerStats> {
        self.stats.clone()
    }
}

impl Drop for TransportListener {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

#[async_trait]
impl Listener for TransportListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn kind(&self) -> TransportKind {
        self.kind
    }

    async fn accept(&mut self) -> Option<BoxConnection> {
        self.ready.recv().await
    }
}

/// Listen backlog of TCP listeners: a reconnect storm (every client of a dead edge at
/// once) must not overflow the accept queue, or each overflowed SYN waits out the kernel's
/// 1 s retransmission (the kernel caps it at `net.core.somaxconn`).
pub const TCP_BACKLOG: u32 = 4096;

/// Binds a TCP listener with [`TCP_BACKLOG`] and SO_REUSEADDR (restarts on the same port).
pub(crate) fn bind_tcp(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(TCP_BACKLOG)
}

/// Accepts the next TCP connection, backing off briefly on errors such as EMFILE instead of
/// spinning, with TCP_NODELAY set and the kernel send buffer bounded to `send_buffer`.
pub(crate) async fn accept_tcp(
    listener: &tokio::net::TcpListener,
    send_buffer: Option<usize>,
) -> (tokio::net::TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                if let Some(bytes) = send_buffer {
                    if let Err(e) = socket2::SockRef::from(&stream).set_send_buffer_size(bytes) {
                        tracing::debug!(error = %e, bytes, "SO_SNDBUF not set");
                    }
                }
                return (stream, peer);
            }
            Err(e) => {
                tracing::warn!(error = %e, "tcp accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// What an [`AdmissionGate`] decided for one new connection.
#[derive(Debug)]
pub enum Admit {
    /// Go ahead; the permit (if any) is held until the session's WELCOME
    /// ([`Connection::handshake_done`](crate::Connection::handshake_done)).
    Go(Option<waygate_backpressure::HandshakePermit>),
    /// Refuse with `code` and a retry-after hint: TCP gets a REJECT frame, WebSocket an HTTP
    /// 503 with `Retry-After`, QUIC a CONNECTION_REFUSED; TLS and wss cannot answer before
    /// their handshake and are closed at once (counted).
    Refuse {
        /// The code (`overloaded`, `draining`).
        code: CloseCode,
        /// Milliseconds the client should wait.
        retry_after_ms: u32,
    },
}

/// Runs one phase of a transport handshake (TLS, the WebSocket upgrade, QUIC's) within the
/// permit's deadline for it, counted from the accept (hardening item 6); without a permit
/// only the listener's overall handshake deadline applies.
pub(crate) async fn within_phase<T>(
    permit: Option<&waygate_backpressure::HandshakePermit>,
    phase: waygate_backpressure::Phase,
    work: impl Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    match permit {
        None => work.await,
        Some(p) => tokio::time::timeout_at(p.deadline(phase).into(), work)
            .await
            .map_err(|_| TransportError::HandshakeTimeout)?,
    }
}

/// Decides, before any expensive work (TLS, upgrade, QUIC handshake), whether a new
/// connection may proceed (SPEC B1). The edge implements it over
/// [`waygate_backpressure::AdmissionControl`] and its overload level.
pub trait AdmissionGate: Send + Sync + std::fmt::Debug + 'static {
    /// Called once per accepted socket / QUIC `Incoming`, with the peer address.
    fn admit(&self, peer: SocketAddr) -> Admit;

    /// A handshake slot for a connection admitted earlier without one (a KCP session at its
    /// CONNECT: the HELLO was admitted, the handshake in between is stateless). Counted
    /// against the cap without any check; `None` when the gate keeps no slots.
    fn hold_slot(&self) -> Option<waygate_backpressure::HandshakePermit> {
        None
    }
}

/// A REJECT frame with its stream length prefix, for refusing plain TCP connections.
pub(crate) fn reject_bytes(code: CloseCode, retry_after_ms: u32) -> bytes::BytesMut {
    let mut out = bytes::BytesMut::new();
    let frame = crate::Frame::Reject(waygate_protocol::frame::Reject {
        code,
        retry_after_ms,
        message: code.as_str().into(),
    });
    let _ =
        waygate_protocol::codec::StreamCodec::new(waygate_protocol::wire::DEFAULT_MAX_FRAME_SIZE)
            .encode(&frame, &mut out);
    out
}

/// Asks the configured gate (if any) about `peer`, counting refusals.
pub(crate) fn admit(
    gate: Option<&Arc<dyn AdmissionGate>>,
    peer: SocketAddr,
    stats: &ListenerStats,
) -> Admit {
    match gate {
        None => Admit::Go(None),
        Some(g) => {
            let verdict = g.admit(peer);
            if matches!(verdict, Admit::Refuse { .. }) {
                ListenerStats::bump(&stats.refused);
            }
            verdict
        }
    }
}

//! The tokio driver: one task per UDP socket owns the sans-IO [`KcpEndpoint`] and moves bytes
//! between it, the socket and the connections. Connections talk to it through one bounded
//! command channel (send, close) and an "attention" list (credit returned, dropped), and it
//! talks to them through per-session shared state (a bounded inbox, flags, notifiers).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot, Notify};

use super::endpoint::{CloseReason, ConvKey, KcpEndpoint, KcpEvent};
use super::KcpConnection;
use crate::conn::{BoxConnection, ConnId, ConnInfo, TransportKind};
use crate::error::TransportError;
use waygate_protocol::wire::CloseCode;

/// Largest datagram read from the socket.
const RECV_BUF: usize = 64 * 1024;
/// Datagrams read per wake-up before the driver looks at its other inputs.
const RECV_BATCH: usize = 64;

/// A request from a connection.
#[derive(Debug)]
pub(crate) enum Cmd {
    /// Queue one encoded frame.
    Send { key: ConvKey, data: Bytes },
    /// Close the session (see [`KcpEndpoint::close`]).
    Close {
        key: ConvKey,
        code: CloseCode,
        message: String,
        quiet: bool,
    },
}

/// Sessions whose connection wants the driver to look at its shared state. Each session is
/// in the list at most once (`Shared::wake_pending`), so the list is bounded by the sessions.
#[derive(Debug, Default)]
pub(crate) struct Attention {
    list: Mutex<Vec<ConvKey>>,
    notify: Notify,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What the reader has not taken yet: at most `inbound_queue_messages` messages (the
/// endpoint's credit), then the end.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    pub(crate) messages: VecDeque<Bytes>,
    pub(crate) end: Option<CloseReason>,
}

/// State shared by one session's connection and the driver.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) key: ConvKey,
    pub(crate) inbox: Mutex<Inbox>,
    pub(crate) readable: Notify,
    /// Messages read since the driver last returned credit.
    pub(crate) consumed: AtomicUsize,
    /// Their bytes.
    pub(crate) consumed_bytes: AtomicUsize,
    wake_pending: AtomicBool,
    pub(crate) dropped: AtomicBool,
    pub(crate) peer_closed: AtomicBool,
    pub(crate) send_blocked: AtomicBool,
    /// Send commands in the channel, not yet handed to the endpoint.
    pub(crate) in_channel: AtomicUsize,
    pub(crate) writable: Notify,
    pub(crate) released: AtomicBool,
    pub(crate) released_notify: Notify,
    attention: Arc<Attention>,
}

impl Shared {
    fn new(key: ConvKey, attention: Arc<Attention>) -> Self {
        Self {
            key,
            inbox: Mutex::new(Inbox::default()),
            readable: Notify::new(),
            consumed: AtomicUsize::new(0),
            consumed_bytes: AtomicUsize::new(0),
            wake_pending: AtomicBool::new(false),
            dropped: AtomicBool::new(false),
            peer_closed: AtomicBool::new(false),
            send_blocked: AtomicBool::new(false),
            in_channel: AtomicUsize::new(0),
            writable: Notify::new(),
            released: AtomicBool::new(false),
            released_notify: Notify::new(),
            attention,
        }
    }

    pub(crate) fn inbox(&self) -> MutexGuard<'_, Inbox> {
        lock(&self.inbox)
    }

    /// How the session ended, if it did.
    pub(crate) fn end(&self) -> Option<CloseReason> {
        self.inbox().end
    }

    /// Asks the driver to look at this session (credit, dropped). Never blocks.
    pub(crate) fn request_attention(&self) {
        if !self.wake_pending.swap(true, Ordering::SeqCst) {
            lock(&self.attention.list).push(self.key);
            self.attention.notify.notify_one();
        }
    }

    fn set_end(&self, reason: CloseReason) {
        let mut inbox = self.inbox();
        if inbox.end.is_none() {
            inbox.end = Some(reason);
        }
        drop(inbox);
        self.readable.notify_one();
        self.writable.notify_one();
    }
}

/// What the driver does with new sessions.
pub(crate) enum Role {
    /// Hand them to the listener.
    Server {
        accept_tx: mpsc::Sender<BoxConnection>,
    },
    /// Hand the one session to `connect_kcp`, then run until it is released.
    Client {
        ready: Option<oneshot::Sender<Result<BoxConnection, TransportError>>>,
    },
}

/// Everything the connections need to reach the driver.
pub(crate) struct Channels {
    pub(crate) cmd_tx: mpsc::Sender<Cmd>,
    pub(crate) cmd_rx: mpsc::Receiver<Cmd>,
    pub(crate) attention: Arc<Attention>,
}

impl Channels {
    pub(crate) fn new(capacity: usize) -> Self {
        let (cmd_tx, cmd_rx) = mpsc::channel(capacity);
        Self {
            cmd_tx,
            cmd_rx,
            attention: Arc::new(Attention::default()),
        }
    }
}

/// Per-connection settings the driver passes on to each connection it creates.
#[derive(Debug, Clone)]
pub(crate) struct ConnParams {
    pub(crate) max_frame_size: usize,
    pub(crate) inbound_queue: usize,
    pub(crate) inbound_queue_bytes: usize,
    pub(crate) close_wait: Duration,
    /// The edge's admission gate (B1): asked for every HELLO before the endpoint sees it.
    pub(crate) admission: Option<Arc<dyn crate::listener::AdmissionGate>>,
}

pub(crate) struct Driver {
    socket: Arc<UdpSocket>,
    local: SocketAddr,
    ep: KcpEndpoint,
    role: Role,
    cmd_tx: mpsc::Sender<Cmd>,
    cmd_rx: mpsc::Receiver<Cmd>,
    attention: Arc<Attention>,
    sessions: HashMap<ConvKey, Arc<Shared>>,
    params: ConnParams,
    done: bool,
    /// A chaos drill: panic at the top of the next loop turn (see
    /// [`KcpListener::chaos_panic_driver`](super::KcpListener::chaos_panic_driver)).
    pub(crate) chaos: Option<Arc<AtomicBool>>,
}

impl Driver {
    /// One received datagram: a server's HELLO goes through the admission gate first (a
    /// refused one is answered BUSY without any cookie work), everything to the endpoint.
    fn take_datagram(&mut self, now: Instant, from: SocketAddr, datagram: &[u8]) {
        if let (Role::Server { .. }, Some(gate)) = (&self.role, &self.params.admission) {
            if let Some(client_nonce) = hello_nonce(datagram) {
                if let crate::listener::Admit::Refuse {
                    code,
                    retry_after_ms,
                } = gate.admit(from)
                {
                    self.ep
                        .refuse_hello(now, from, client_nonce, code, retry_after_ms);
                    return;
                }
                // Admitted: KCP's handshake is stateless until CONNECT, so this permit is
                // released at once; the session takes a slot of its own at CONNECT.
            }
        }
        self.ep.handle_datagram(now, from, datagram);
    }
}

/// The client nonce of a KCP HELLO control packet (PROTOCOL.md §8.2.2); `None` for any
/// other datagram.
fn hello_nonce(datagram: &[u8]) -> Option<u64> {
    if !super::cookie::is_control(datagram) {
        return None;
    }
    match super::cookie::Control::decode(datagram) {
        Some(super::cookie::Control::Hello { client_nonce }) => Some(client_nonce),
        _ => None,
    }
}

impl Drop for Driver {
    /// However the driver ends (a panic included), every session it still carries ends with
    /// it: their connections' `recv` and `send` return at once instead of waiting forever.
    fn drop(&mut self) {
        for shared in self.sessions.values() {
            shared.set_end(CloseReason::Shutdown);
            // Released too: a `close` waiting for the driver returns now, not at its
            // `close_wait` bound.
            shared.released.store(true, Ordering::SeqCst);
            shared.released_notify.notify_waiters();
        }
    }
}

impl Driver {
    pub(crate) fn new(
        socket: Arc<UdpSocket>,
        local: SocketAddr,
        ep: KcpEndpoint,
        role: Role,
        channels: Channels,
        params: ConnParams,
    ) -> Self {
        Self {
            socket,
            local,
            ep,
            role,
            cmd_tx: channels.cmd_tx,
            cmd_rx: channels.cmd_rx,
            attention: channels.attention,
            sessions: HashMap::new(),
            params,
            done: false,
            chaos: None,
        }
    }

    /// Runs until the listener is gone and no session is left (server), or the session is
    /// released or the handshake failed (client).
    pub(crate) async fn run(mut self) {
        let mut buf = vec![0u8; RECV_BUF];
        let mut accepting = true;
        loop {
            if self
                .chaos
                .as_ref()
                .is_some_and(|c| c.swap(false, Ordering::SeqCst))
            {
                panic!("chaos drill: KCP driver panic");
            }
            let now = Instant::now();
            if self.ep.poll_timeout().is_some_and(|t| t <= now) {
                self.ep.handle_timeout(now);
            }
            self.process_events(now);
            self.transmit().await;
            if self.done {
                break;
            }
            if let Role::Server { accept_tx } = &self.role {
                if accepting && accept_tx.is_closed() {
                    accepting = false;
                    self.ep.set_accepting(false);
                }
                if !accepting && self.ep.session_count() == 0 {
                    break;
                }
            }
            if let Role::Client { ready: Some(tx) } = &self.role {
                if tx.is_closed() {
                    // connect_kcp was cancelled before the handshake finished.
                    break;
                }
            }
            let deadline = self
                .ep
                .poll_timeout()
                .unwrap_or(now + Duration::from_secs(3600));
            let accept_watch = match &self.role {
                Role::Server { accept_tx } if accepting => Some(accept_tx.clone()),
                _ => None,
            };
            let closed_accept = async move {
                match accept_watch {
                    Some(tx) => tx.closed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                received = self.socket.recv_from(&mut buf) => {
                    let now = Instant::now();
                    match received {
                        Ok((n, from)) => {
                            self.take_datagram(now, from, buf.get(..n).unwrap_or_default());
                            for _ in 1..RECV_BATCH {
                                match self.socket.try_recv_from(&mut buf) {
                                    Ok((n, from)) => self.take_datagram(
                                        now, from, buf.get(..n).unwrap_or_default()),
                                    Err(_) => break,
                                }
                            }
                        }
                        Err(e) => {
                            // ICMP errors (connection refused) on connected client sockets,
                            // or transient errors: never spin on them.
                            tracing::trace!(local = %self.local, error = %e, "kcp recv error");
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                }
                cmd = self.cmd_rx.recv() => {
                    if let Some(cmd) = cmd {
                        self.handle_cmd(Instant::now(), cmd);
                        self.drain_cmds();
                    }
                }
                () = self.attention.notify.notified() => {
                    // Commands a connection queued before asking for attention go first
                    // (e.g. its last sends before it was dropped).
                    self.drain_cmds();
                    self.handle_attention(Instant::now());
                }
                () = tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)) => {
                    self.ep.handle_timeout(Instant::now());
                }
                () = closed_accept => {}
            }
        }
        // Whatever is left (client after a handshake failure, server shutdown).
        self.ep.shutdown();
        self.process_events(Instant::now());
        self.transmit().await;
    }

    async fn transmit(&mut self) {
        while let Some(t) = self.ep.poll_transmit() {
            if let Err(e) = self.socket.send_to(&t.payload, t.dest).await {
                tracing::trace!(dest = %t.dest, error = %e, "kcp send failed");
            }
        }
    }

    fn drain_cmds(&mut self) {
        let now = Instant::now();
        for _ in 0..self.cmd_rx.max_capacity() {
            match self.cmd_rx.try_recv() {
                Ok(cmd) => self.handle_cmd(now, cmd),
                Err(_) => break,
            }
        }
    }

    fn handle_cmd(&mut self, now: Instant, cmd: Cmd) {
        match cmd {
            Cmd::Send { key, data } => {
                let Some(shared) = self.sessions.get(&key) else {
                    return;
                };
                shared.in_channel.fetch_sub(1, Ordering::SeqCst);
                // Refusals surface through the session's end; the connection checked size.
                let _ = self.ep.send(now, key, &data);
                if !self.ep.can_send(key) {
                    shared.send_blocked.store(true, Ordering::SeqCst);
                }
                shared.writable.notify_one();
            }
            Cmd::Close {
                key,
                code,
                message,
                quiet,
            } => self.ep.close(now, key, code, &message, quiet),
        }
    }

    fn handle_attention(&mut self, now: Instant) {
        let keys = std::mem::take(&mut *lock(&self.attention.list));
        for key in keys {
            let Some(shared) = self.sessions.get(&key).cloned() else {
                continue;
            };
            // Clear the flag before reading the counter: a read racing with this either is
            // counted now or raises a new request.
            shared.wake_pending.store(false, Ordering::SeqCst);
            let n = shared.consumed.swap(0, Ordering::SeqCst);
            let bytes = shared.consumed_bytes.swap(0, Ordering::SeqCst);
            if n > 0 || bytes > 0 {
                self.ep.consumed(now, key, n, bytes);
            }
            if shared.dropped.load(Ordering::SeqCst) {
                let quiet = shared.peer_closed.load(Ordering::SeqCst);
                self.ep.close(now, key, CloseCode::Normal, "", quiet);
            }
        }
    }

    fn process_events(&mut self, now: Instant) {
        while let Some(event) = self.ep.poll_event() {
            match event {
                KcpEvent::Connected(key) => self.on_connected(now, key),
                KcpEvent::Message(key, bytes) => {
                    if let Some(shared) = self.sessions.get(&key) {
                        shared.inbox().messages.push_back(bytes);
                        shared.readable.notify_one();
                    }
                }
                KcpEvent::Writable(key) => {
                    if let Some(shared) = self.sessions.get(&key) {
                        shared
                            .send_blocked
                            .store(!self.ep.can_send(key), Ordering::SeqCst);
                        shared.writable.notify_one();
                    }
                }
                KcpEvent::Closed(key, reason) => {
                    if let Some(shared) = self.sessions.get(&key) {
                        shared.set_end(reason);
                    }
                }
                KcpEvent::Released(key) => {
                    if let Some(shared) = self.sessions.remove(&key) {
                        shared.set_end(CloseReason::Local);
                        shared.released.store(true, Ordering::SeqCst);
                        shared.released_notify.notify_one();
                    }
                    if matches!(self.role, Role::Client { .. }) {
                        self.done = true;
                    }
                }
                KcpEvent::HandshakeFailed(e) => {
                    if let Role::Client { ready } = &mut self.role {
                        if let Some(tx) = ready.take() {
                            let _ = tx.send(Err(e.to_error()));
                        }
                    }
                    self.done = true;
                }
            }
        }
    }

    fn on_connected(&mut self, now: Instant, key: ConvKey) {
        let shared = Arc::new(Shared::new(key, self.attention.clone()));
        self.sessions.insert(key, shared.clone());
        let mut conn = KcpConnection::new(
            ConnInfo {
                id: ConnId::next(),
                kind: TransportKind::Kcp,
                peer: key.addr,
                local: self.local,
                accepted_at: std::time::Instant::now(),
            },
            shared,
            self.cmd_tx.clone(),
            self.params.clone(),
        );
        if let Role::Server { .. } = self.role {
            // From the valid CONNECT to WELCOME the session holds a handshake slot like a
            // connection of any other transport (the HELLO was admitted against the cap).
            let slot = self.params.admission.as_ref().and_then(|g| g.hold_slot());
            conn.pre_auth = crate::conn::PreAuth::accepted(slot);
        }
        let conn: BoxConnection = Box::new(conn);
        match &mut self.role {
            Role::Server { accept_tx } => {
                if let Err(e) = accept_tx.try_send(conn) {
                    let code = match e {
                        mpsc::error::TrySendError::Full(_) => CloseCode::Overloaded,
                        mpsc::error::TrySendError::Closed(_) => CloseCode::GoingAway,
                    };
                    tracing::debug!(peer = %key.addr, %code, "kcp accept backlog refused a session");
                    self.ep.close(now, key, code, "accept backlog full", false);
                }
            }
            Role::Client { ready } => match ready.take() {
                Some(tx) => {
                    let _ = tx.send(Ok(conn));
                }
                None => self.ep.close(now, key, CloseCode::Internal, "", false),
            },
        }
    }
}

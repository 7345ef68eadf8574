//! QUIC (quinn): one connection per client, traffic classes on separate streams so a lost
//! packet of one class never blocks another (T3).
//!
//! Stream layout (PROTOCOL.md §2.4): every stream starts with one stream-kind byte.
//! - kind 0, the *control stream*: the first bidirectional stream, opened by the client at
//!   connect; it carries every control frame and critical DATA, length-delimited.
//! - kind 1, a unidirectional stream per direction for normal DATA, opened lazily.
//! - kind 2, a unidirectional stream for best-effort DATA too large for a datagram.
//! - best-effort DATA that fits travels as one QUIC datagram per frame, unframed.
//!
//! Nothing is delivered before the first control-stream frame, so a WELCOME always precedes
//! the DATA that follows it even when they travel on different streams.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::BytesMut;
use futures_channel::mpsc;
use futures_util::{SinkExt, StreamExt};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{RecvStream, SendStream, VarInt};

use crate::conn::{
    BoxConnection, ConnConfig, ConnId, ConnInfo, Connection, IdleTimer, PreAuth, TransportKind,
};
use crate::error::TransportError;
use crate::listener::{admit, within_phase, Admit, TransportListener};
use crate::tls::{ClientTls, TlsIdentity};
use waygate_protocol::codec::{decode_message, StreamCodec};
use waygate_protocol::frame::Frame;
use waygate_protocol::wire::{CloseCode, TrafficClass, QUIC_ALPN};

/// Stream-kind byte of the control stream.
pub const STREAM_CONTROL: u8 = 0;
/// Stream-kind byte of the normal-class stream.
pub const STREAM_NORMAL: u8 = 1;
/// Stream-kind byte of the best-effort stream (frames too large for a datagram).
pub const STREAM_BEST_EFFORT: u8 = 2;

/// Frames read ahead of the connection's reader (plus one per stream reader). The queue
/// allocates per frame queued, not up front: a tokio channel would hold a 3.6 KiB block per
/// idle connection (W4).
const RX_QUEUE: usize = 64;
/// Bytes of frames read ahead: at least this, and two frames of the maximum size. Beyond it
/// the reader waits (QUIC flow control then holds the peer): without it a peer sending
/// maximum-size frames faster than the session took them had 64 of them held here.
const RX_QUEUE_BYTES: usize = 128 * 1024;

/// A frame read ahead, with its share of the read-ahead bytes (released when taken).
type ReadAhead = (
    Result<Frame, TransportError>,
    Option<tokio::sync::OwnedSemaphorePermit>,
);
const CLOSE_FLUSH: Duration = Duration::from_millis(500);

/// QUIC knobs sized for game sessions rather than bulk transfer (quinn's defaults allow
/// megabytes per connection).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuicConfig {
    /// Per-stream receive window, bytes.
    pub stream_receive_window: u32,
    /// Connection receive window, bytes.
    pub receive_window: u32,
    /// Connection send window, bytes.
    pub send_window: u64,
    /// Datagram receive and send buffers, bytes.
    pub datagram_buffer: usize,
    /// QUIC keep-alive interval, milliseconds (0 = off, the default: the session layer's
    /// PING frames keep a connection alive, and a keep-alive would add a packet each way
    /// per interval and connection: W5 in BENCHMARKS.md).
    pub keep_alive_ms: u64,
    /// Address validation: with this many QUIC handshakes in flight on the listener, a new
    /// connection attempt from an address not yet validated gets a Retry first (the client
    /// proves it receives at its address before any handshake work or reply beyond the
    /// Retry). 0 = always (the default: the only answer to an unvalidated address within
    /// RFC 9000's 3x limit; costs new connections one round trip).
    pub retry_above_handshakes: usize,
    /// Connection attempts quinn holds before the listener takes them (more are refused at
    /// once).
    pub max_incoming: usize,
    /// Hand the kernel up to 10 packets of a connection in one send (UDP segmentation
    /// offload). quinn then keeps a send buffer of 10 packets (~13 KiB) for the connection's
    /// whole life; game traffic seldom has more than one packet ready at a time, so it is off
    /// by default (W4: a quarter of an idle QUIC session's heap).
    pub segmentation_offload: bool,
}

impl Default for QuicConfig {
    fn default() -> Self {
        Self {
            stream_receive_window: 64 * 1024,
            receive_window: 256 * 1024,
            send_window: 256 * 1024,
            datagram_buffer: 64 * 1024,
            keep_alive_ms: 0,
            // Always: quinn-proto's per-datagram budget check lets an unanswered Initial draw
            // ~3.3x its size (tests/quic_amplification.rs); a Retry is ~110 bytes.
            retry_above_handshakes: 0,
            max_incoming: 4_096,
            segmentation_offload: false,
        }
    }
}

impl QuicConfig {
    fn transport(&self, conn: &ConnConfig) -> Result<quinn::TransportConfig, TransportError> {
        let mut t = quinn::TransportConfig::default();
        t.stream_receive_window(VarInt::from_u32(
            self.stream_receive_window.max(conn.max_frame_size as u32),
        ))
        .receive_window(VarInt::from_u32(
            self.receive_window.max(conn.max_frame_size as u32 * 2),
        ))
        .send_window(self.send_window)
        .datagram_receive_buffer_size(Some(self.datagram_buffer))
        .datagram_send_buffer_size(self.datagram_buffer)
        // The client opens one control stream; each side opens at most two uni streams.
        .max_concurrent_bidi_streams(VarInt::from_u32(1))
        .max_concurrent_uni_streams(VarInt::from_u32(4))
        .enable_segmentation_offload(self.segmentation_offload);
        if self.keep_alive_ms > 0 {
            t.keep_alive_interval(Some(Duration::from_millis(self.keep_alive_ms)));
        }
        // `None` turns QUIC's idle timeout off too (quinn's own default would be 30 s).
        let idle = conn
            .idle_timeout
            .map(quinn::IdleTimeout::try_from)
            .transpose()
            .map_err(|e| TransportError::Config(format!("quic idle timeout: {e}")))?;
        t.max_idle_timeout(idle);
        Ok(t)
    }
}

/// A QUIC connection adapted to the [`Connection`] trait.
pub struct QuicConnection {
    conn: quinn::Connection,
    info: ConnInfo,
    control: SendStream,
    normal: Option<SendStream>,
    best_effort: Option<SendStream>,
    rx: mpsc::Receiver<ReadAhead>,
    reader: tokio::task::JoinHandle<()>,
    codec: StreamCodec,
    pre_auth: PreAuth,
    buf: BytesMut,
    idle: IdleTimer,
    closed: bool,
}

impl std::fmt::Debug for QuicConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicConnection")
            .field("info", &self.info)
            .finish()
    }
}

fn quic_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Io(std::io::Error::other(e.to_string()))
}

fn conn_err(e: quinn::ConnectionError) -> TransportError {
    match e {
        quinn::ConnectionError::ApplicationClosed(close) => TransportError::transport_close(
            CloseCode::from_u16(u16::try_from(close.error_code.into_inner()).unwrap_or(u16::MAX)),
        ),
        quinn::ConnectionError::TimedOut => TransportError::IdleTimeout(Duration::ZERO),
        quinn::ConnectionError::LocallyClosed => TransportError::Closed,
        other => quic_err(other),
    }
}

impl QuicConnection {
    fn new(
        conn: quinn::Connection,
        info: ConnInfo,
        control: (SendStream, RecvStream),
        config: &ConnConfig,
    ) -> Self {
        let (tx, rx) = mpsc::channel(RX_QUEUE);
        let reader = tokio::spawn(read_all(conn.clone(), control.1, config.max_frame_size, tx));
        Self {
            conn,
            info,
            control: control.0,
            normal: None,
            best_effort: None,
            rx,
            reader,
            codec: StreamCodec::new(config.max_frame_size),
            pre_auth: PreAuth::none(),
            buf: BytesMut::new(),
            idle: IdleTimer::new(config.idle_timeout),
            closed: false,
        }
    }

    async fn uni(&mut self, kind: u8) -> Result<&mut SendStream, TransportError> {
        let slot = if kind == STREAM_NORMAL {
            &mut self.normal
        } else {
            &mut self.best_effort
        };
        if slot.is_none() {
            let mut s = self.conn.open_uni().await.map_err(conn_err)?;
            s.write_all(&[kind]).await.map_err(quic_err)?;
            *slot = Some(s);
        }
        slot.as_mut().ok_or(TransportError::Closed)
    }

    async fn write_framed(&mut self, frame: &Frame) -> Result<(), TransportError> {
        self.buf.clear();
        self.codec.encode(frame, &mut self.buf)?;
        let bytes = self.buf.split().freeze();
        let stream = match (frame.is_control(), frame.class()) {
            (true, _) | (false, TrafficClass::Critical) => &mut self.control,
            (false, TrafficClass::Normal) => self.uni(STREAM_NORMAL).await?,
            (false, TrafficClass::BestEffort) => self.uni(STREAM_BEST_EFFORT).await?,
        };
        stream.write_chunk(bytes).await.map_err(quic_err)
    }
}

impl Drop for QuicConnection {
    fn drop(&mut self) {
        self.reader.abort();
        if !self.closed {
            self.conn.close(
                VarInt::from_u32(CloseCode::GoingAway.to_u16().into()),
                b"dropped",
            );
        }
    }
}

#[async_trait]
impl Connection for QuicConnection {
    fn info(&self) -> &ConnInfo {
        &self.info
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), TransportError> {
        if self.closed {
            return Err(TransportError::Closed);
        }
        let len = self
            .codec
            .check_len(frame)
            .map_err(|_| TransportError::SendTooLarge {
                len: frame.encoded_len(),
                max: self.codec.max_frame_size(),
            })?;
        if frame.class() == TrafficClass::BestEffort && !frame.is_control() {
            if let Some(max) = self.conn.max_datagram_size() {
                // Only while quinn's datagram buffer has room: past it quinn would discard
                // older unsent datagrams to make room, without a word (silent-drop audit).
                // The frame takes the best-effort stream instead, bounded by the caller's
                // send deadline like every stream write.
                if len <= max
                    && self.conn.datagram_send_buffer_space() >= len
                    && self.conn.send_datagram(frame.to_bytes()).is_ok()
                {
                    return Ok(());
                }
            }
        }
        self.write_framed(frame).await
    }

    async fn recv(&mut self) -> Result<Frame, TransportError> {
        if self.closed {
            return Err(TransportError::Closed);
        }
        let next = tokio::select! {
            // Input first: after a stall, a frame that is already here beats the idle timer.
            biased;
            next = self.rx.next() => next.map(|(item, _bytes)| item),
            err = self.idle.expired() => return Err(err),
        };
        self.idle.touch();
        match next {
            Some(Ok(Frame::Close { code, .. })) => {
                self.closed = true;
                self.conn.close(VarInt::from_u32(code.to_u16().into()), b"");
                Err(TransportError::ClosedByPeer { code })
            }
            Some(Ok(frame)) => match self.pre_auth.check(&frame, self.codec.max_frame_size()) {
                Ok(()) => Ok(frame),
                Err(e) => {
                    tracing::debug!(conn = %self.info.id, error = %e, "closing quic connection after bad input");
                    self.close(e.close_code(), "invalid frame").await;
                    Err(e)
                }
            },
            Some(Err(e)) => {
                if matches!(e, TransportError::Frame(_) | TransportError::Violation(_)) {
                    tracing::debug!(conn = %self.info.id, error = %e, "closing quic connection after bad input");
                    self.close(e.close_code(), "invalid frame").await;
                } else {
                    self.closed = true;
                }
                Err(e)
            }
            None => {
                self.closed = true;
                Err(self
                    .conn
                    .close_reason()
                    .map(conn_err)
                    .unwrap_or(TransportError::Closed))
            }
        }
    }

    async fn close(&mut self, code: CloseCode, message: &str) {
        if self.closed {
            return;
        }
        self.closed = true;
        let frame = Frame::close(code, message);
        let _ = tokio::time::timeout(CLOSE_FLUSH, async {
            if self.write_framed(&frame).await.is_ok() {
                let _ = self.control.finish();
                let _ = self.control.stopped().await;
            }
        })
        .await;
        self.conn.close(
            VarInt::from_u32(code.to_u16().into()),
            code.as_str().as_bytes(),
        );
    }

    /// The connection is closed (by the peer, or timed out), as quinn knows without
    /// reading a stream.
    fn peer_closed(&mut self) -> bool {
        !self.closed && self.conn.close_reason().is_some()
    }

    fn handshake_done(&mut self) {
        self.pre_auth.done();
    }
}

/// One receive stream of a connection: the control stream, or a uni stream the peer
/// opened, with its partial frame.
struct InboundStream {
    stream: RecvStream,
    buf: BytesMut,
    /// A uni stream whose kind byte has not arrived yet.
    needs_kind: bool,
    /// The control stream.
    control: bool,
}

/// Reads into `buf` of the first stream with data (or an end, or an error): which one, and
/// what `poll_read` gave (0 bytes = finished).
fn poll_streams(
    cx: &mut std::task::Context<'_>,
    streams: &mut [InboundStream],
) -> std::task::Poll<(usize, Result<usize, quinn::ReadError>)> {
    let mut scratch = [0u8; 4096];
    for (i, s) in streams.iter_mut().enumerate() {
        match s.stream.poll_read(cx, &mut scratch) {
            std::task::Poll::Ready(r) => {
                if let Ok(n) = r {
                    s.buf.extend_from_slice(&scratch[..n]);
                }
                return std::task::Poll::Ready((i, r));
            }
            // Nothing to read and no partial frame: an idle stream holds no buffer.
            std::task::Poll::Pending if s.buf.is_empty() && s.buf.capacity() > 0 => {
                s.buf = BytesMut::new();
            }
            std::task::Poll::Pending => {}
        }
    }
    std::task::Poll::Pending
}

/// Reads the control stream, then every uni stream and datagram, into `tx`: one task per
/// connection whatever the number of streams (an idle session holds one small future, not
/// a task per stream: W4 in BENCHMARKS.md). Nothing from other streams or datagrams is
/// forwarded before the control stream's first frame.
async fn read_all(
    conn: quinn::Connection,
    control: RecvStream,
    max_frame_size: usize,
    tx: mpsc::Sender<ReadAhead>,
) {
    let codec = StreamCodec::new(max_frame_size);
    let budget = RX_QUEUE_BYTES.max(2 * max_frame_size);
    let mut tx = ReadAheadSender {
        tx,
        bytes: Arc::new(tokio::sync::Semaphore::new(budget)),
        budget,
    };
    // The peer may open at most `max_concurrent_uni_streams` (4) at a time, plus control.
    let mut streams = vec![InboundStream {
        stream: control,
        buf: BytesMut::new(),
        needs_kind: false,
        control: true,
    }];
    let mut started = false;
    loop {
        tokio::select! {
            (i, read) = std::future::poll_fn(|cx| poll_streams(cx, &mut streams)),
                if !streams.is_empty() =>
            {
                let s = &mut streams[i];
                let mut done = false;
                match read {
                    Ok(0) => {
                        if !s.buf.is_empty() {
                            let e = TransportError::Violation("stream ended inside a frame");
                            if tx.send(Err(e)).await.is_err() {
                                return;
                            }
                        }
                        done = true;
                    }
                    Ok(_) => {
                        if s.needs_kind {
                            let kind = s.buf.split_to(1)[0];
                            s.needs_kind = false;
                            if kind != STREAM_NORMAL && kind != STREAM_BEST_EFFORT {
                                let e = TransportError::Violation("unknown quic stream kind");
                                if tx.send(Err(e)).await.is_err() {
                                    return;
                                }
                                done = true;
                            }
                        }
                        while !done {
                            let item = match codec.decode(&mut s.buf) {
                                Ok(Some(frame)) => Ok(frame),
                                Ok(None) => break,
                                Err(e) => Err(e.into()),
                            };
                            done = item.is_err();
                            started |= item.is_ok();
                            if tx.send(item).await.is_err() {
                                return;
                            }
                        }
                    }
                    Err(_) => done = true,
                }
                // A control stream that ends before its first frame ends the reading.
                if done && streams.swap_remove(i).control && !started {
                    return;
                }
            }
            uni = conn.accept_uni(), if started => match uni {
                Ok(stream) => streams.push(InboundStream {
                    stream,
                    buf: BytesMut::new(),
                    needs_kind: true,
                    control: false,
                }),
                Err(_) => return,
            },
            datagram = conn.read_datagram(), if started => match datagram {
                Ok(bytes) => {
                    let item = decode_message(bytes, max_frame_size).map_err(TransportError::from);
                    let stop = item.is_err();
                    if tx.send(item).await.is_err() || stop {
                        return;
                    }
                }
                Err(_) => return,
            },
            else => return,
        }
    }
}

/// The reader's end of the read-ahead queue: at most [`RX_QUEUE`] frames and their bytes.
struct ReadAheadSender {
    tx: mpsc::Sender<ReadAhead>,
    bytes: Arc<tokio::sync::Semaphore>,
    budget: usize,
}

impl ReadAheadSender {
    /// Queues `item` once its bytes fit the budget (a frame larger than the whole budget
    /// waits until nothing is read ahead). Err: the connection's owner is gone.
    async fn send(&mut self, item: Result<Frame, TransportError>) -> Result<(), ()> {
        let cost = item
            .as_ref()
            .map_or(0, |f| f.encoded_len().min(self.budget));
        let permit = match u32::try_from(cost) {
            Ok(0) | Err(_) => None,
            Ok(n) => Some(
                self.bytes
                    .clone()
                    .acquire_many_owned(n)
                    .await
                    .map_err(drop)?,
            ),
        };
        self.tx.send((item, permit)).await.map_err(drop)
    }
}

/// One QUIC handshake in flight on a listener, for as long as it lives.
struct HandshakeCount(Arc<std::sync::atomic::AtomicUsize>);

impl HandshakeCount {
    fn new(count: Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for HandshakeCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Binds a UDP socket at `addr` and serves QUIC with `tls`.
pub fn listen(
    addr: SocketAddr,
    tls: &TlsIdentity,
    quic: &QuicConfig,
    config: ConnConfig,
) -> Result<TransportListener, TransportError> {
    let crypto = QuicServerConfig::try_from(tls.server_config(&[QUIC_ALPN])?)
        .map_err(|e| TransportError::Config(format!("quic tls: {e}")))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(Arc::new(quic.transport(&config)?));
    server.max_incoming(quic.max_incoming.max(1));
    let endpoint = endpoint_on(addr, Some(server))?;
    let local = endpoint.local_addr()?;
    let accepting = endpoint.clone();
    let retry_above = quic.retry_above_handshakes;
    let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listener =
        TransportListener::start(local, TransportKind::Quic, move |handoff| async move {
            while let Some(incoming) = accepting.accept().await {
                if handoff.is_closed() {
                    incoming.refuse();
                    return;
                }
                if !incoming.remote_address_validated()
                    && in_flight.load(std::sync::atomic::Ordering::Relaxed) >= retry_above
                {
                    // Under load (or always, at 0): a stateless Retry, so a spoofed address
                    // costs no handshake slot and draws one small packet.
                    match incoming.retry() {
                        Ok(()) => {
                            crate::conn::ListenerStats::bump(&handoff.stats.quic_retries);
                            continue;
                        }
                        Err(e) => {
                            e.into_incoming().refuse();
                            continue;
                        }
                    }
                }
                let peer = incoming.remote_address();
                let accepted_at = std::time::Instant::now();
                let permit = match admit(config.admission.as_ref(), peer, &handoff.stats) {
                    Admit::Go(permit) => permit,
                    Admit::Refuse { .. } => {
                        // An explicit CONNECTION_REFUSED, before any handshake work.
                        incoming.refuse();
                        continue;
                    }
                };
                let config = config.clone();
                let counted = HandshakeCount::new(in_flight.clone());
                handoff.spawn_handshake(peer, config.handshake_timeout, async move {
                    let _counted = counted;
                    let conn =
                        within_phase(permit.as_ref(), waygate_backpressure::Phase::Tls, async {
                            incoming
                                .await
                                .map_err(|e| TransportError::Handshake(e.to_string()))
                        })
                        .await?;
                    let (send, mut recv) = conn.accept_bi().await.map_err(conn_err)?;
                    let mut kind = [0u8; 1];
                    recv.read_exact(&mut kind)
                        .await
                        .map_err(|e| TransportError::Handshake(e.to_string()))?;
                    if kind[0] != STREAM_CONTROL {
                        conn.close(
                            VarInt::from_u32(CloseCode::ProtocolError.to_u16().into()),
                            b"first stream must be the control stream",
                        );
                        return Err(TransportError::Violation(
                            "first stream is not the control stream",
                        ));
                    }
                    let info = ConnInfo {
                        id: ConnId::next(),
                        kind: TransportKind::Quic,
                        peer,
                        local,
                        accepted_at,
                    };
                    let mut conn = QuicConnection::new(conn, info, (send, recv), &config);
                    conn.pre_auth = PreAuth::accepted(permit);
                    Ok(Box::new(conn) as BoxConnection)
                });
            }
        });
    Ok(listener.with_on_drop(move || {
        endpoint.close(
            VarInt::from_u32(CloseCode::GoingAway.to_u16().into()),
            b"listener closed",
        );
    }))
}

/// Connects to a QUIC listener at `addr`, verifying it as `host`, and opens the control
/// stream. Each call uses its own UDP socket (see [`QuicClientSockets`] to share them).
pub async fn connect_quic(
    addr: SocketAddr,
    host: &str,
    tls: &ClientTls,
    quic: &QuicConfig,
    config: &ConnConfig,
) -> Result<BoxConnection, TransportError> {
    let endpoint = quinn::Endpoint::client(unspecified_for(addr)?)?;
    connect_quic_on(&endpoint, addr, host, tls, quic, config).await
}

/// Connection ids of 8 random bytes, for the listeners and the shared client sockets (a
/// single client connection's endpoint keeps quinn's default: the ids that matter here are
/// those of the side that sends the Retry). quinn's default generator puts 3 random bytes
/// in its 8 (the rest is a keyed hash, to drop stray packets cheaply), so an endpoint with tens of
/// thousands of live ids hands out one already in use about once in a thousand: the
/// source id of a Retry that collides routes the client's next Initials to the connection
/// holding that id, which discards them, and the connect hangs until its timeout (W6: 1 to
/// 3 of 3,000 connects over 10 s; quinn issue 2883). 64 random bits make that negligible.
fn connection_ids() -> Box<dyn quinn::ConnectionIdGenerator> {
    Box::new(quinn_proto::RandomConnectionIdGenerator::new(8))
}

/// A quinn endpoint on a socket from [`crate::udp::bind_udp`] (kernel buffers sized for
/// handshake bursts) with [`connection_ids`]; a server when `server` is given.
fn endpoint_on(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, TransportError> {
    let mut config = quinn::EndpointConfig::default();
    config.cid_generator(connection_ids);
    let socket = crate::udp::bind_udp(addr)?;
    Ok(quinn::Endpoint::new(
        config,
        server,
        socket,
        Arc::new(quinn::TokioRuntime),
    )?)
}

fn unspecified_for(addr: SocketAddr) -> Result<SocketAddr, TransportError> {
    if addr.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    }
    .parse()
    .map_err(|_| TransportError::Config("bind address".into()))
}

/// Client UDP sockets shared by many QUIC connections: a connect uses a socket of the
/// address's family with fewer than `per_socket` connections open, or binds a new one.
///
/// A quinn endpoint's receive path allocates ~2 MB per socket, so a process with thousands
/// of client connections (a load generator) shares sockets; QUIC tells the connections
/// apart by connection id, so the server serves them as it serves any client. Shared
/// sockets get the listeners' kernel buffers ([`crate::udp::bind_udp`]).
#[derive(Clone)]
pub struct QuicClientSockets {
    sockets: Arc<std::sync::Mutex<Vec<quinn::Endpoint>>>,
    per_socket: usize,
}

impl std::fmt::Debug for QuicClientSockets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicClientSockets")
            .field("per_socket", &self.per_socket)
            .field("sockets", &self.socket_count())
            .finish()
    }
}

impl QuicClientSockets {
    /// Sockets holding at most `per_socket` connections each (at least 1).
    pub fn new(per_socket: usize) -> Self {
        Self {
            sockets: Arc::default(),
            per_socket: per_socket.max(1),
        }
    }

    /// Sockets bound so far.
    pub fn socket_count(&self) -> usize {
        self.sockets.lock().map_or(0, |s| s.len())
    }

    fn pick(&self, addr: SocketAddr) -> Result<quinn::Endpoint, TransportError> {
        let mut sockets = self
            .sockets
            .lock()
            .map_err(|_| TransportError::Config("quic client sockets poisoned".into()))?;
        let fits = |e: &quinn::Endpoint| {
            e.open_connections() < self.per_socket
                && e.local_addr().is_ok_and(|l| l.is_ipv6() == addr.is_ipv6())
        };
        if let Some(e) = sockets.iter().find(|e| fits(e)) {
            return Ok(e.clone());
        }
        // The listeners' kernel buffers: a socket shared by hundreds of handshakes receives
        // their server flights in bursts, which overflowed the default ~200 KiB buffer
        // (W6: ~1,300 datagrams dropped per 3,000 connects).
        let endpoint = endpoint_on(unspecified_for(addr)?, None)?;
        sockets.push(endpoint.clone());
        Ok(endpoint)
    }

    /// [`connect_quic`] over one of the shared sockets.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        host: &str,
        tls: &ClientTls,
        quic: &QuicConfig,
        config: &ConnConfig,
    ) -> Result<BoxConnection, TransportError> {
        // An IPv4-mapped address goes over an IPv4 socket: the shared sockets are bound
        // v6-only (`bind_udp`).
        let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        let endpoint = self.pick(addr)?;
        connect_quic_on(&endpoint, addr, host, tls, quic, config).await
    }
}

async fn connect_quic_on(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    host: &str,
    tls: &ClientTls,
    quic: &QuicConfig,
    config: &ConnConfig,
) -> Result<BoxConnection, TransportError> {
    let crypto = QuicClientConfig::try_from(tls.client_config(&[QUIC_ALPN])?)
        .map_err(|e| TransportError::Config(format!("quic tls: {e}")))?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(quic.transport(config)?));
    let connect = async {
        let conn = endpoint
            .connect_with(client, addr, host)
            .map_err(|e| TransportError::Handshake(e.to_string()))?
            .await
            .map_err(|e| TransportError::Handshake(e.to_string()))?;
        let (mut send, recv) = conn.open_bi().await.map_err(conn_err)?;
        send.write_all(&[STREAM_CONTROL]).await.map_err(quic_err)?;
        Ok::<_, TransportError>((conn, send, recv))
    };
    let (conn, send, recv) = tokio::time::timeout(config.handshake_timeout, connect)
        .await
        .map_err(|_| TransportError::HandshakeTimeout)??;
    let info = ConnInfo {
        id: ConnId::next(),
        kind: TransportKind::Quic,
        peer: addr,
        local: endpoint.local_addr()?,
        accepted_at: std::time::Instant::now(),
    };
    Ok(Box::new(QuicConnection::new(
        conn,
        info,
        (send, recv),
        config,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize) -> Frame {
        Frame::Data(waygate_protocol::frame::Data {
            class: TrafficClass::Normal,
            msg_id: 1,
            seq: 1,
            ack: None,
            payload: bytes::Bytes::from(vec![0u8; len]),
        })
    }

    /// Regression (2026-12-04, second stop, a transport audit): frames read ahead were
    /// bounded by count only (64), so a peer sending maximum-size frames faster than the
    /// session took them had 64 of them held per connection. The read-ahead holds at most
    /// its byte budget; a frame larger than the budget goes alone; taking frames makes room.
    #[tokio::test]
    async fn the_read_ahead_holds_at_most_its_byte_budget() {
        let (tx, mut rx) = mpsc::channel(RX_QUEUE);
        let budget = 32 * 1024;
        let mut sender = ReadAheadSender {
            tx,
            bytes: Arc::new(tokio::sync::Semaphore::new(budget)),
            budget,
        };
        let size = data(10_000).encoded_len();
        let mut queued = 0;
        while tokio::time::timeout(Duration::from_millis(50), sender.send(Ok(data(10_000))))
            .await
            .is_ok()
        {
            queued += 1;
            assert!(queued <= RX_QUEUE, "never blocked");
        }
        assert_eq!(queued, budget / size, "{} bytes read ahead at most", budget);
        // Taking one frame makes room for the next.
        let (_frame, permit) = rx.next().await.expect("queued");
        drop(permit);
        let next = tokio::time::timeout(Duration::from_millis(500), sender.send(Ok(data(10_000))));
        assert!(next.await.is_ok(), "room after a frame was taken");
        // A frame larger than the whole budget waits until nothing is read ahead, then goes.
        let big = tokio::spawn(async move { sender.send(Ok(data(40_000))).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!big.is_finished());
        for _ in 0..queued {
            drop(rx.next().await.expect("queued"));
        }
        tokio::time::timeout(Duration::from_secs(1), big)
            .await
            .expect("the big frame went once the rest was taken")
            .expect("task")
            .expect("sent");
    }

    fn idle_of(conn: &ConnConfig) -> String {
        let t = QuicConfig::default()
            .transport(conn)
            .expect("transport config");
        let debug = format!("{t:?}");
        let start = debug.find("max_idle_timeout").expect("field in Debug");
        debug[start..]
            .split(',')
            .next()
            .unwrap_or_default()
            .to_string()
    }

    /// The endpoints' connection ids do not repeat among as many as an edge with 10,000
    /// QUIC sessions holds (five per connection plus Retries in flight): quinn's default
    /// generator, 3 random bytes, repeats ~300 times in 100,000 (birthday bound), and a Retry
    /// with a repeated id hung that connect until its timeout.
    #[test]
    fn connection_ids_do_not_repeat_at_edge_scale() {
        let mut ids = connection_ids();
        let mut seen = std::collections::HashSet::new();
        let repeats = (0..100_000)
            .filter(|_| !seen.insert(ids.generate_cid()))
            .count();
        assert_eq!(repeats, 0);
        assert_eq!(ids.cid_len(), 8, "the wire size stays quinn's default");
    }

    /// No idle timeout in the connection's config means none announced in QUIC either
    /// (quinn's default would close an idle connection after 30 s).
    #[test]
    fn no_idle_timeout_announces_none() {
        let off = ConnConfig {
            idle_timeout: None,
            ..ConnConfig::default()
        };
        assert_eq!(idle_of(&off), "max_idle_timeout: None");
        let on = ConnConfig {
            idle_timeout: Some(Duration::from_secs(45)),
            ..ConnConfig::default()
        };
        assert!(idle_of(&on).contains("45000"), "{}", idle_of(&on));
    }
}

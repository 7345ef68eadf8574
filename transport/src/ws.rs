//! WebSocket (ws and wss): one client-protocol frame per binary message. Text messages are a
//! protocol violation. Buffers are sized for many idle connections (tungstenite's 128 KiB
//! default read buffer would cost ~134 KiB per connection) and the message size limit is the
//! frame size limit, so a 100 MiB declared message is refused from its header.

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_tungstenite::tungstenite::error::ProtocolError;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode as WsCloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use crate::conn::{
    BoxConnection, ConnConfig, ConnId, ConnInfo, Connection, IdleTimer, PreAuth, TransportKind,
};
use crate::error::TransportError;
use crate::listener::{accept_tcp, admit, within_phase, Admit, TransportListener};
use crate::tls::{server_name, ClientTls, TlsIdentity};
use waygate_protocol::codec::{decode_message, encode_message};
use waygate_protocol::frame::Frame;
use waygate_protocol::wire::{CloseCode, WS_SUBPROTOCOL};
use waygate_protocol::FrameError;

/// Default of [`ConnConfig::ws_read_buffer`] (defined beside it, so the config builds
/// without the `ws` feature).
pub const DEFAULT_READ_BUFFER: usize = crate::conn::DEFAULT_WS_READ_BUFFER;
const CLOSE_FLUSH: std::time::Duration = std::time::Duration::from_millis(500);

/// The tungstenite configuration for a connection's limits.
pub fn ws_config(config: &ConnConfig) -> WebSocketConfig {
    let max_frame_size = config.max_frame_size;
    WebSocketConfig::default()
        .read_buffer_size(config.ws_read_buffer)
        // 0: every message is written through at once (no batching delay).
        .write_buffer_size(0)
        .max_write_buffer_size(max_frame_size.saturating_mul(4).max(64 * 1024))
        .max_message_size(Some(max_frame_size))
        .max_frame_size(Some(max_frame_size))
}

/// A WebSocket connection carrying frames in binary messages.
pub struct WsConnection<S> {
    ws: WebSocketStream<S>,
    info: ConnInfo,
    max_frame_size: usize,
    pre_auth: PreAuth,
    idle: IdleTimer,
    closed: bool,
    /// What [`Connection::peer_closed`] took off the stream, for `recv` to read first.
    peeked: Option<Option<Result<Message, WsError>>>,
}

impl<S> std::fmt::Debug for WsConnection<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WsConnection")
            .field("info", &self.info)
            .finish()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> WsConnection<S> {
    /// Wraps an upgraded WebSocket.
    pub fn new(ws: WebSocketStream<S>, info: ConnInfo, config: &ConnConfig) -> Self {
        Self {
            ws,
            info,
            max_frame_size: config.max_frame_size,
            pre_auth: PreAuth::none(),
            idle: IdleTimer::new(config.idle_timeout),
            closed: false,
            peeked: None,
        }
    }

    /// A connection a listener accepted: frames limited to the pre-auth size and `pre_auth`'s
    /// admission slot held until [`Connection::handshake_done`].
    pub fn accepted(mut self, pre_auth: PreAuth) -> Self {
        self.pre_auth = pre_auth;
        self
    }

    fn encode(&self, frame: &Frame) -> Result<Message, TransportError> {
        let mut out = bytes::BytesMut::with_capacity(frame.encoded_len());
        encode_message(frame, self.max_frame_size, &mut out).map_err(|_| {
            TransportError::SendTooLarge {
                len: frame.encoded_len(),
                max: self.max_frame_size,
            }
        })?;
        Ok(Message::Binary(out.freeze()))
    }

    async fn fail(&mut self, err: TransportError, message: &str) -> TransportError {
        tracing::debug!(conn = %self.info.id, error = %err, "closing websocket after bad input");
        self.close(err.close_code(), message).await;
        err
    }
}

fn ws_err(e: WsError) -> TransportError {
    match e {
        WsError::Io(io) => TransportError::Io(io),
        WsError::Capacity(_) => TransportError::Violation("websocket capacity exceeded"),
        WsError::ConnectionClosed | WsError::AlreadyClosed => TransportError::ClosedByPeer {
            code: CloseCode::Normal,
        },
        // The peer's TCP connection ended without a closing handshake (a client killed, a
        // path dropped, an SDK dropping a link it found dead): gone, like a reset on TCP,
        // not a protocol violation.
        WsError::Protocol(ProtocolError::ResetWithoutClosingHandshake) => {
            TransportError::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "websocket ended without a closing handshake",
            ))
        }
        other => TransportError::Handshake(other.to_string()),
    }
}

#[async_trait]
impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> Connection for WsConnection<S> {
    fn info(&self) -> &ConnInfo {
        &self.info
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), TransportError> {
        if self.closed {
            return Err(TransportError::Closed);
        }
        let msg = self.encode(frame)?;
        self.ws.send(msg).await.map_err(ws_err)
    }

    async fn send_batch(&mut self, frames: &[Frame]) -> Result<(), TransportError> {
        if self.closed {
            return Err(TransportError::Closed);
        }
        let msgs = frames
            .iter()
            .map(|f| self.encode(f))
            .collect::<Result<Vec<_>, _>>()?;
        for msg in msgs {
            self.ws.feed(msg).await.map_err(ws_err)?;
        }
        self.ws.flush().await.map_err(ws_err)
    }

    async fn recv(&mut self) -> Result<Frame, TransportError> {
        // The rare closing paths are boxed: this future is alive in every idle connection,
        // sized for its largest await (performance issue, W4).
        loop {
            if self.closed {
                return Err(TransportError::Closed);
            }
            let next = match self.peeked.take() {
                Some(next) => next,
                None => tokio::select! {
                    // Input first: after a stall, a frame that is already here beats the idle timer.
                    biased;
                    next = self.ws.next() => next,
                    err = self.idle.expired() => return Err(err),
                },
            };
            self.idle.touch();
            match next {
                None => {
                    return Err(TransportError::ClosedByPeer {
                        code: CloseCode::Normal,
                    })
                }
                Some(Ok(Message::Binary(bytes))) => {
                    let limit = self.pre_auth.frame_limit(self.max_frame_size);
                    match decode_message(bytes, limit) {
                        Ok(Frame::Close { code, .. }) => {
                            self.closed = true;
                            let _ =
                                Box::pin(tokio::time::timeout(CLOSE_FLUSH, self.ws.close(None)))
                                    .await;
                            return Err(TransportError::ClosedByPeer { code });
                        }
                        Ok(frame) => return Ok(frame),
                        Err(e) => return Err(Box::pin(self.fail(e.into(), "invalid frame")).await),
                    }
                }
                Some(Ok(Message::Text(_))) => {
                    let err = TransportError::Violation("text message");
                    Box::pin(
                        self.close(CloseCode::TextMessage, "only binary messages carry frames"),
                    )
                    .await;
                    return Err(err);
                }
                Some(Ok(Message::Close(_))) => {
                    self.closed = true;
                    return Err(TransportError::ClosedByPeer {
                        code: CloseCode::Normal,
                    });
                }
                // Pings are answered by tungstenite itself; pongs and raw frames carry nothing.
                Some(Ok(_)) => continue,
                Some(Err(WsError::Capacity(_))) => {
                    let err = TransportError::Frame(FrameError::TooLarge {
                        len: self.max_frame_size as u64 + 1,
                        max: self.max_frame_size,
                    });
                    return Err(
                        Box::pin(self.fail(err, "message exceeds the maximum frame size")).await,
                    );
                }
                Some(Err(WsError::Utf8(_))) => {
                    // A text message that is not even UTF-8: WebSocket's own answer is 1007
                    // (RFC 6455 7.4.1), after the waygate CLOSE for a text message.
                    let err = TransportError::Violation("text message with invalid UTF-8");
                    Box::pin(self.close_as(
                        CloseCode::TextMessage,
                        WsCloseCode::Invalid,
                        "invalid UTF-8 in a text message",
                    ))
                    .await;
                    return Err(err);
                }
                Some(Err(WsError::Protocol(p)))
                    if p != ProtocolError::ResetWithoutClosingHandshake =>
                {
                    tracing::debug!(conn = %self.info.id, error = %p, "websocket protocol error");
                    let err = TransportError::Violation("websocket protocol error");
                    return Err(Box::pin(self.fail(err, "websocket protocol error")).await);
                }
                Some(Err(e)) => {
                    self.closed = true;
                    return Err(ws_err(e));
                }
            }
        }
    }

    async fn close(&mut self, code: CloseCode, message: &str) {
        let ws_code = match code {
            CloseCode::Normal => WsCloseCode::Normal,
            CloseCode::GoingAway => WsCloseCode::Away,
            CloseCode::TextMessage => WsCloseCode::Unsupported,
            CloseCode::FrameTooLarge => WsCloseCode::Size,
            CloseCode::ProtocolError => WsCloseCode::Protocol,
            // 4000-4999 are for applications: 4000 + the waygate code's last three digits.
            other => WsCloseCode::from(4000 + other.to_u16() % 1000),
        };
        self.close_as(code, ws_code, message).await;
    }

    /// Takes at most one message off the stream (kept for `recv`, which checks its size
    /// then), skipping pings and pongs; the end of the stream, a close or an error is the
    /// answer.
    fn peer_closed(&mut self) -> bool {
        if self.closed {
            return false;
        }
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Bounded: a peer sending pings only is looked at again on the next call.
        for _ in 0..8 {
            if self.peeked.is_none() {
                match self.ws.poll_next_unpin(&mut cx) {
                    std::task::Poll::Pending => return false,
                    std::task::Poll::Ready(next) => {
                        self.idle.touch();
                        self.peeked = Some(next);
                    }
                }
            }
            match &self.peeked {
                Some(None) | Some(Some(Ok(Message::Close(_)))) | Some(Some(Err(_))) => return true,
                Some(Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)))) => {
                    self.peeked = None;
                }
                Some(Some(Ok(Message::Binary(bytes)))) => {
                    return crate::conn::is_close_message(bytes)
                }
                Some(Some(Ok(Message::Text(_)))) | None => return false,
            }
        }
        false
    }

    fn handshake_done(&mut self) {
        self.pre_auth.done();
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> WsConnection<S> {
    /// Sends the waygate CLOSE with `code`, then the WebSocket close with `ws_code`.
    async fn close_as(&mut self, code: CloseCode, ws_code: WsCloseCode, message: &str) {
        if self.closed {
            return;
        }
        self.closed = true;
        let frame = Frame::close(code, message);
        let _ = tokio::time::timeout(CLOSE_FLUSH, async {
            let _ = self.ws.send(Message::Binary(frame.to_bytes())).await;
            let _ = self
                .ws
                .close(Some(CloseFrame {
                    code: ws_code,
                    reason: code.as_str().into(),
                }))
                .await;
        })
        .await;
    }
}

/// Binds a WebSocket listener at `addr`; with `tls`, serves wss.
pub async fn listen(
    addr: SocketAddr,
    tls: Option<&TlsIdentity>,
    config: ConnConfig,
) -> Result<TransportListener, TransportError> {
    let listener = crate::listener::bind_tcp(addr)?;
    let local = listener.local_addr()?;
    let acceptor = tls
        .map(|id| {
            id.server_config(&[b"http/1.1"])
                .map(|c| TlsAcceptor::from(Arc::new(c)))
        })
        .transpose()?;
    let kind = if acceptor.is_some() {
        TransportKind::Wss
    } else {
        TransportKind::Ws
    };
    Ok(TransportListener::start(
        local,
        kind,
        move |handoff| async move {
            loop {
                let (stream, peer) = accept_tcp(&listener, config.send_buffer).await;
                if handoff.is_closed() {
                    return;
                }
                let permit = match admit(config.admission.as_ref(), peer, &handoff.stats) {
                    Admit::Go(permit) => permit,
                    Admit::Refuse { retry_after_ms, .. } => {
                        // ws answers with HTTP 503 before the upgrade; wss cannot answer
                        // before TLS and is closed (counted).
                        if acceptor.is_none() {
                            let secs = retry_after_ms.div_ceil(1000).max(1);
                            let resp = format!(
                                "HTTP/1.1 503 Service Unavailable\r\nRetry-After: {secs}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            );
                            let _ = stream.try_write(resp.as_bytes());
                        }
                        continue;
                    }
                };
                let info = ConnInfo {
                    id: ConnId::next(),
                    kind,
                    peer,
                    local,
                    accepted_at: std::time::Instant::now(),
                };
                let acceptor = acceptor.clone();
                let config = config.clone();
                handoff.spawn_handshake(peer, config.handshake_timeout, async move {
                    use waygate_backpressure::Phase;
                    let p = permit.as_ref();
                    // Each phase boxed: this task holds only the phase under way, not
                    // room for the largest (a wss upgrade's future is ~20 KiB).
                    let conn: BoxConnection = match acceptor {
                        None => {
                            let ws = Box::pin(within_phase(
                                p,
                                Phase::Upgrade,
                                upgrade(stream, info, &config),
                            ))
                            .await?;
                            Box::new(ws.accepted(PreAuth::accepted(permit)))
                        }
                        Some(acceptor) => {
                            let tls = Box::pin(within_phase(p, Phase::Tls, async {
                                acceptor
                                    .accept(stream)
                                    .await
                                    .map_err(|e| TransportError::Handshake(e.to_string()))
                            }))
                            .await?;
                            let ws = Box::pin(within_phase(
                                p,
                                Phase::Upgrade,
                                upgrade(tls, info, &config),
                            ))
                            .await?;
                            Box::new(ws.accepted(PreAuth::accepted(permit)))
                        }
                    };
                    Ok(conn)
                });
            }
        },
    ))
}

/// Refuses (HTTP 403) an upgrade whose `Origin` is not allowed (a page on another site);
/// no `Origin` (a native client) or an empty list passes.
#[allow(clippy::result_large_err)]
fn check_origin(allowed: &[String], request: &Request) -> Result<(), ErrorResponse> {
    if allowed.is_empty() {
        return Ok(());
    }
    let Some(origin) = request.headers().get("origin") else {
        return Ok(());
    };
    let origin = origin.to_str().unwrap_or("");
    if allowed.iter().any(|a| a.eq_ignore_ascii_case(origin)) {
        return Ok(());
    }
    let mut refusal = ErrorResponse::new(Some("origin not allowed".into()));
    *refusal.status_mut() = tokio_tungstenite::tungstenite::http::StatusCode::FORBIDDEN;
    Err(refusal)
}

/// Echoes our subprotocol when the client offers it.
#[allow(clippy::result_large_err)]
fn negotiate(request: &Request, mut response: Response) -> Result<Response, ErrorResponse> {
    let offered = request
        .headers()
        .get_all("sec-websocket-protocol")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == WS_SUBPROTOCOL);
    if offered {
        if let Ok(value) = WS_SUBPROTOCOL.parse() {
            response
                .headers_mut()
                .insert("sec-websocket-protocol", value);
        }
    }
    Ok(response)
}

async fn upgrade<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    info: ConnInfo,
    config: &ConnConfig,
) -> Result<WsConnection<S>, TransportError> {
    let origins = config.allowed_origins.clone();
    // tungstenite's callback type fixes the error type (an HTTP response).
    #[allow(clippy::result_large_err)]
    let callback = move |request: &Request, response: Response| {
        check_origin(&origins, request)?;
        negotiate(request, response)
    };
    let ws =
        tokio_tungstenite::accept_hdr_async_with_config(stream, callback, Some(ws_config(config)))
            .await
            .map_err(|e| TransportError::Handshake(e.to_string()))?;
    Ok(WsConnection::new(ws, info, config))
}

/// Connects to `ws://addr/` (or `wss://host:port/` with `tls`), offering the waygate
/// subprotocol. `host` is the name sent in the Host header and verified by TLS.
pub async fn connect_ws(
    addr: SocketAddr,
    host: &str,
    path: &str,
    tls: Option<&ClientTls>,
    config: &ConnConfig,
) -> Result<BoxConnection, TransportError> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;

    let scheme = if tls.is_some() { "wss" } else { "ws" };
    let host_port = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", addr.port())
    } else {
        format!("{host}:{}", addr.port())
    };
    let url = format!("{scheme}://{host_port}{path}");
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|e| TransportError::Config(format!("websocket url {url}: {e}")))?;
    if let Ok(v) = WS_SUBPROTOCOL.parse() {
        request.headers_mut().insert("sec-websocket-protocol", v);
    }
    let cfg = Some(ws_config(config));
    let connect = async {
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        let local = tcp.local_addr()?;
        let kind = if tls.is_some() {
            TransportKind::Wss
        } else {
            TransportKind::Ws
        };
        let info = ConnInfo {
            id: ConnId::next(),
            kind,
            peer: addr,
            local,
            accepted_at: std::time::Instant::now(),
        };
        let conn: BoxConnection = match tls {
            None => {
                let (ws, _) = tokio_tungstenite::client_async_with_config(request, tcp, cfg)
                    .await
                    .map_err(|e| TransportError::Handshake(e.to_string()))?;
                Box::new(WsConnection::new(ws, info, config))
            }
            Some(tls) => {
                let connector = TlsConnector::from(Arc::new(tls.client_config(&[b"http/1.1"])?));
                let stream = connector
                    .connect(server_name(host)?, tcp)
                    .await
                    .map_err(|e| TransportError::Handshake(e.to_string()))?;
                let (ws, _) = tokio_tungstenite::client_async_with_config(request, stream, cfg)
                    .await
                    .map_err(|e| TransportError::Handshake(e.to_string()))?;
                Box::new(WsConnection::new(ws, info, config))
            }
        };
        Ok::<_, TransportError>(conn)
    };
    tokio::time::timeout(config.handshake_timeout, connect)
        .await
        .map_err(|_| TransportError::HandshakeTimeout)?
}

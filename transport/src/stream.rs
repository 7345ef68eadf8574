//! A [`Connection`] over any byte stream (TCP, TLS over TCP): varint length-delimited frames
//! through [`StreamCodec`]. The read buffer exists only while bytes are arriving: a
//! connection with nothing to read gives it back and waits for the socket to become
//! readable without one ([`ReadReady`]), so an idle connection costs little more than its
//! socket.

use std::future::Future as _;
use std::task::{Context, Poll};

use async_trait::async_trait;
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::conn::{ConnConfig, ConnInfo, Connection, IdleTimer, PreAuth};
use crate::error::TransportError;
use waygate_protocol::codec::StreamCodec;
use waygate_protocol::frame::Frame;
use waygate_protocol::wire::{CloseCode, MAX_PRE_AUTH_FRAME_SIZE};

/// Size of each read from the socket.
const READ_CHUNK: usize = 4096;
/// A read buffer larger than this is released once empty.
const KEEP_READ_CAPACITY: usize = 16 * 1024;
/// How long `close` waits for the CLOSE frame to be written.
const CLOSE_FLUSH: std::time::Duration = std::time::Duration::from_millis(500);

/// A byte stream that can wait until it has something to read without a buffer to read it
/// into, so an idle connection holds no read buffer.
pub trait ReadReady {
    /// Ready once a read would find bytes (or the end of the stream, or an error); may be
    /// ready early (the read then waits with a buffer), never late.
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>>;
}

impl ReadReady for TcpStream {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        TcpStream::poll_read_ready(self, cx)
    }
}

/// TLS: ready when rustls holds plaintext (or anything else than a wish for more TLS bytes),
/// else when the socket is.
fn tls_read_ready(
    tcp: &TcpStream,
    wants_read: bool,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<()>> {
    if wants_read {
        tcp.poll_read_ready(cx)
    } else {
        Poll::Ready(Ok(()))
    }
}

impl ReadReady for tokio_rustls::server::TlsStream<TcpStream> {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let (tcp, tls) = self.get_ref();
        tls_read_ready(tcp, tls.wants_read(), cx)
    }
}

impl ReadReady for tokio_rustls::client::TlsStream<TcpStream> {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let (tcp, tls) = self.get_ref();
        tls_read_ready(tcp, tls.wants_read(), cx)
    }
}

/// A framed byte-stream connection.
#[derive(Debug)]
pub struct StreamConnection<S> {
    io: S,
    info: ConnInfo,
    codec: StreamCodec,
    /// The configured maximum frame size (the codec's limit is lower before WELCOME).
    max_frame_size: usize,
    pre_auth: PreAuth,
    read_buf: BytesMut,
    write_buf: BytesMut,
    idle: IdleTimer,
    closed: bool,
    eof: bool,
}

impl<S: AsyncRead + AsyncWrite + ReadReady + Unpin + Send + 'static> StreamConnection<S> {
    /// Wraps an established stream.
    pub fn new(io: S, info: ConnInfo, config: &ConnConfig) -> Self {
        Self {
            io,
            info,
            codec: StreamCodec::new(config.max_frame_size),
            max_frame_size: config.max_frame_size,
            pre_auth: PreAuth::none(),
            read_buf: BytesMut::new(),
            write_buf: BytesMut::new(),
            idle: IdleTimer::new(config.idle_timeout),
            closed: false,
            eof: false,
        }
    }

    /// A connection a listener accepted: frames limited to the pre-auth size and `pre_auth`'s
    /// admission slot held until [`Connection::handshake_done`].
    pub fn accepted(mut self, pre_auth: PreAuth) -> Self {
        self.codec = StreamCodec::new(pre_auth.frame_limit(self.max_frame_size));
        self.pre_auth = pre_auth;
        self
    }

    async fn write_out(&mut self) -> Result<(), TransportError> {
        // Flush too: TLS accepts plaintext into its session buffer even when the socket
        // would block (a peer that stopped reading), and only a flush guarantees the records
        // leave. Without it the last frame before a pause could wait for a later write
        // forever (seen: a TLS client's final DATA never reached a paused edge).
        let result = async {
            self.io.write_all(&self.write_buf).await?;
            self.io.flush().await
        }
        .await;
        self.write_buf.clear();
        if self.write_buf.capacity() > KEEP_READ_CAPACITY {
            self.write_buf = BytesMut::new();
        }
        result?;
        Ok(())
    }

    fn try_decode(&mut self) -> Result<Option<Frame>, TransportError> {
        let frame = self.codec.decode(&mut self.read_buf)?;
        if self.read_buf.is_empty() && self.read_buf.capacity() > KEEP_READ_CAPACITY {
            self.read_buf = BytesMut::new();
        }
        Ok(frame)
    }

    /// Reads more bytes into the buffer; cancel-safe because `read_buf` only ever gains
    /// bytes that were read.
    ///
    /// With no partial frame buffered, it reads only what is there now; with nothing there,
    /// it gives the buffer back and waits for the socket without one ([`ReadReady`]): an
    /// idle connection, or one that connected and stays silent, holds no read buffer
    /// (performance issue, W4). A busy one finds bytes at once and keeps its buffer.
    async fn fill(&mut self) -> Result<(), TransportError> {
        let n = loop {
            let need = self.codec.bytes_needed(&self.read_buf).max(READ_CHUNK);
            self.read_buf.reserve(need);
            if !self.read_buf.is_empty() {
                break tokio::select! {
                    // Input first: after a stall, a frame that is already here beats the idle timer.
                    biased;
                    n = self.io.read_buf(&mut self.read_buf) => n?,
                    err = self.idle.expired() => return Err(err),
                };
            }
            let mut read = std::pin::pin!(self.io.read_buf(&mut self.read_buf));
            let now = std::future::poll_fn(|cx| {
                Poll::Ready(match read.as_mut().poll(cx) {
                    Poll::Ready(r) => Some(r),
                    Poll::Pending => None,
                })
            })
            .await;
            if let Some(n) = now {
                break n?;
            }
            self.read_buf = BytesMut::new();
            let io = &self.io;
            tokio::select! {
                // Input first: after a stall, a frame that is already here beats the idle timer.
                biased;
                r = std::future::poll_fn(|cx| io.poll_read_ready(cx)) => r?,
                err = self.idle.expired() => return Err(err),
            }
        };
        if n == 0 {
            self.eof = true;
            return Err(if self.read_buf.is_empty() {
                TransportError::ClosedByPeer {
                    code: CloseCode::Normal,
                }
            } else {
                TransportError::Violation("stream ended inside a frame")
            });
        }
        self.idle.touch();
        Ok(())
    }
}

#[async_trait]
impl<S: AsyncRead + AsyncWrite + ReadReady + Unpin + Send + Sync + 'static> Connection
    for StreamConnection<S>
{
    fn info(&self) -> &ConnInfo {
        &self.info
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), TransportError> {
        if self.closed {
            return Err(TransportError::Closed);
        }
        self.codec
            .check_len(frame)
            .map_err(|_| TransportError::SendTooLarge {
                len: frame.encoded_len(),
                max: self.codec.max_frame_size(),
            })?;
        self.codec.encode(frame, &mut self.write_buf)?;
        self.write_out().await
    }

    async fn send_batch(&mut self, frames: &[Frame]) -> Result<(), TransportError> {
        if self.closed {
            return Err(TransportError::Closed);
        }
        for frame in frames {
            self.codec
                .check_len(frame)
                .map_err(|_| TransportError::SendTooLarge {
                    len: frame.encoded_len(),
                    max: self.codec.max_frame_size(),
                })?;
        }
        for frame in frames {
            self.codec.encode(frame, &mut self.write_buf)?;
        }
        self.write_out().await
    }

    async fn recv(&mut self) -> Result<Frame, TransportError> {
        loop {
            if self.closed {
                return Err(TransportError::Closed);
            }
            if self.eof {
                return Err(TransportError::ClosedByPeer {
                    code: CloseCode::Normal,
                });
            }
            match self.try_decode() {
                Ok(Some(Frame::Close { code, .. })) => {
                    self.eof = true;
                    return Err(TransportError::ClosedByPeer { code });
                }
                Ok(Some(frame)) => return Ok(frame),
                Ok(None) => {
                    if let Err(e) = self.fill().await {
                        if matches!(e, TransportError::Violation(_)) {
                            Box::pin(self.close(e.close_code(), "stream ended inside a frame"))
                                .await;
                        }
                        return Err(e);
                    }
                }
                Err(e) => {
                    let code = e.close_code();
                    tracing::debug!(conn = %self.info.id, error = %e, "closing after invalid frame");
                    // Boxed, as the close above: this future is alive in every idle
                    // connection, sized for its largest await (performance issue, W4).
                    Box::pin(self.close(code, "invalid frame")).await;
                    return Err(e);
                }
            }
        }
    }

    /// Reads what the socket holds now into the read buffer (frames stay undecoded, for
    /// `recv` and the limit in force then) until a pre-auth frame's worth is buffered; the
    /// end of the stream, or a reset, is the answer.
    fn peer_closed(&mut self) -> bool {
        if self.eof || self.closed {
            return self.eof;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        while self.read_buf.len() < MAX_PRE_AUTH_FRAME_SIZE {
            self.read_buf.reserve(READ_CHUNK);
            let read = std::pin::pin!(self.io.read_buf(&mut self.read_buf)).poll(&mut cx);
            match read {
                Poll::Pending => return false,
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => {
                    self.eof = true;
                    return true;
                }
                Poll::Ready(Ok(_)) => self.idle.touch(),
            }
        }
        false
    }

    async fn close(&mut self, code: CloseCode, message: &str) {
        if self.closed {
            return;
        }
        self.closed = true;
        self.write_buf.clear();
        let frame = Frame::close(code, message);
        let _ = self.codec.encode(&frame, &mut self.write_buf);
        let _ = tokio::time::timeout(CLOSE_FLUSH, async {
            let _ = self.io.write_all(&self.write_buf).await;
            let _ = self.io.shutdown().await;
        })
        .await;
        self.write_buf = BytesMut::new();
        self.read_buf = BytesMut::new();
    }

    fn handshake_done(&mut self) {
        self.pre_auth.done();
        self.codec = StreamCodec::new(self.max_frame_size);
    }
}

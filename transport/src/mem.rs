//! An in-memory [`Connection`] pair: two ends joined by bounded channels, for tests and
//! simulations of the layers above (no sockets, no transport framing). A CLOSE frame ends
//! the other side's `recv` with `ClosedByPeer`, as on a real transport.

use std::net::SocketAddr;

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::conn::{ConnId, ConnInfo, Connection, TransportKind};
use crate::error::TransportError;
use waygate_protocol::frame::Frame;
use waygate_protocol::wire::CloseCode;

/// Frames in flight per direction before `send` waits.
const CAPACITY: usize = 1024;

/// One end of an in-memory connection.
#[derive(Debug)]
pub struct MemConnection {
    info: ConnInfo,
    tx: Option<mpsc::Sender<Frame>>,
    rx: mpsc::Receiver<Frame>,
}

/// Two connected ends (labelled TCP on 127.0.0.1:1, for logs only).
pub fn mem_pair() -> (MemConnection, MemConnection) {
    let (a_tx, b_rx) = mpsc::channel(CAPACITY);
    let (b_tx, a_rx) = mpsc::channel(CAPACITY);
    let addr = SocketAddr::from(([127, 0, 0, 1], 1));
    let info = || ConnInfo {
        id: ConnId::next(),
        kind: TransportKind::Tcp,
        peer: addr,
        local: addr,
        accepted_at: std::time::Instant::now(),
    };
    (
        MemConnection {
            info: info(),
            tx: Some(a_tx),
            rx: a_rx,
        },
        MemConnection {
            info: info(),
            tx: Some(b_tx),
            rx: b_rx,
        },
    )
}

#[async_trait]
impl Connection for MemConnection {
    fn info(&self) -> &ConnInfo {
        &self.info
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), TransportError> {
        match &self.tx {
            Some(tx) => tx
                .send(frame.clone())
                .await
                .map_err(|_| TransportError::Closed),
            None => Err(TransportError::Closed),
        }
    }

    async fn recv(&mut self) -> Result<Frame, TransportError> {
        match self.rx.recv().await {
            Some(Frame::Close { code, .. }) => Err(TransportError::ClosedByPeer { code }),
            Some(frame) => Ok(frame),
            None => Err(TransportError::ClosedByPeer {
                code: CloseCode::Normal,
            }),
        }
    }

    async fn close(&mut self, code: CloseCode, message: &str) {
        if let Some(tx) = self.tx.take() {
            let _ = tx
                .send(Frame::Close {
                    code,
                    message: message.to_owned(),
                })
                .await;
        }
    }

    /// The other end is dropped or has closed (frames it sent before stay readable).
    fn peer_closed(&mut self) -> bool {
        self.rx.is_closed()
    }

    /// In-memory pairs have no listener slot and no pre-auth limit.
    fn handshake_done(&mut self) {}
}

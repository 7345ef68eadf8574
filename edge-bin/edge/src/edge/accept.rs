//! Listeners -> sessions: one accept loop per listener; a draining edge answers REJECT.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use prometheus_client::metrics::gauge::Gauge;
use waygate_protocol::frame::Reject;
use waygate_transport::{
    BoxConnection, BoxListener, CloseCode, ConnInfo, Connection, Frame, TransportError,
};

use super::Shared;
use crate::metrics::EdgeMetrics;

/// Runs a listener's accept loop under supervision: a panic inside it (a bug) is caught,
/// logged and counted (`waygate_accept_loop_restarts_total`), and the loop starts again on
/// the same listener, so one bad moment never silently takes a transport down.
pub(super) async fn accept_loop(shared: Arc<Shared>, mut listener: BoxListener) {
    use futures_util::FutureExt as _;
    let kind = listener.kind();
    loop {
        let run = std::panic::AssertUnwindSafe(accept_connections(&shared, &mut listener));
        match run.catch_unwind().await {
            Ok(()) => return, // the listener shut down
            Err(panic) => {
                let what = waygate_transport::panic_message(&*panic).unwrap_or_default();
                shared
                    .metrics
                    .accept_loop_restarts
                    .get_or_create(&EdgeMetrics::transport(kind))
                    .inc();
                tracing::error!(transport = %kind, panic = %what, "accept loop panicked; restarted");
            }
        }
    }
}

async fn accept_connections(shared: &Arc<Shared>, listener: &mut BoxListener) {
    let kind = listener.kind();
    let label = EdgeMetrics::transport(kind);
    while let Some(mut conn) = listener.accept().await {
        if shared
            .chaos_accept_panic
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            // A drill (`Edge::chaos_panic_next_accept`): exactly the kind of bug supervision
            // exists for. The connection is dropped with the panic.
            panic!("chaos drill: accept loop panic");
        }
        shared
            .metrics
            .connections_accepted
            .get_or_create(&label)
            .inc();
        if shared.draining.load(Ordering::Acquire) {
            let retry = shared.config.drain.retry_after_ms;
            tokio::spawn(async move { refuse(&mut conn, CloseCode::Draining, retry).await });
            continue;
        }
        let gauge = shared
            .metrics
            .connections_open
            .get_or_create(&label)
            .clone();
        gauge.inc();
        // The gauge falls when the connection goes, not when its session ends: a session
        // may linger long after (its own gauge is `sessions_lingering`).
        let _task = shared
            .session_layer()
            .spawn(Box::new(CountedConnection { inner: conn, gauge }));
    }
}

/// A client connection that keeps the `connections_open` gauge: one up while it exists.
struct CountedConnection {
    inner: BoxConnection,
    gauge: Gauge,
}

impl Drop for CountedConnection {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

#[async_trait]
impl Connection for CountedConnection {
    fn info(&self) -> &ConnInfo {
        self.inner.info()
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), TransportError> {
        self.inner.send(frame).await
    }

    async fn send_batch(&mut self, frames: &[Frame]) -> Result<(), TransportError> {
        self.inner.send_batch(frames).await
    }

    async fn recv(&mut self) -> Result<Frame, TransportError> {
        self.inner.recv().await
    }

    async fn close(&mut self, code: CloseCode, message: &str) {
        self.inner.close(code, message).await;
    }

    fn peer_closed(&mut self) -> bool {
        self.inner.peer_closed()
    }

    fn handshake_done(&mut self) {
        self.inner.handshake_done();
    }
}

/// Answers a connection with REJECT and closes it.
pub(super) async fn refuse(conn: &mut BoxConnection, code: CloseCode, retry_after_ms: u32) {
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = conn
            .send(&Frame::Reject(Reject {
                code,
                retry_after_ms,
                message: code.as_str().into(),
            }))
            .await;
        conn.close(code, code.as_str()).await;
    })
    .await;
}

//! Listeners -> sessions: one accept loop per listener; a draining edge answers REJECT.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use waygate_protocol::frame::Reject;
use waygate_transport::{BoxConnection, BoxListener, CloseCode, Frame};

use super::Shared;
use crate::metrics::EdgeMetrics;

pub(super) async fn accept_loop(shared: Arc<Shared>, mut listener: BoxListener) {
    let kind = listener.kind();
    let label = EdgeMetrics::transport(kind);
    while let Some(mut conn) = listener.accept().await {
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
        let task = shared.session_layer().spawn(conn);
        tokio::spawn(async move {
            let _ = task.await;
            gauge.dec();
        });
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

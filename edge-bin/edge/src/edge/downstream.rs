//! Backend -> client: one loop takes every link's events (PUSH, KICK, REFUSE, BIND, PIN,
//! link up/down) and hands them to the sessions; a stale-epoch refusal is routed again.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use tokio::sync::mpsc;
use waygate_protocol::frame::SessionId;
use waygate_protocol::link::LinkFrame;
use waygate_session::driver::{DeliverError, Downstream};
use waygate_transport::CloseCode;

use super::{apply_latest, SessionEntry, Shared};
use crate::link::{InFlight, LinkEvent};
use crate::metrics::{BackendLabel, ClassLabel};

impl Shared {
    /// Answers a client's refused message with ERROR, in order with its pushes, never
    /// waiting (a full queue makes the session report a gap; see `registry.report_error`).
    pub(super) fn report_error(
        &self,
        session_id: &SessionId,
        code: CloseCode,
        msg_id: u32,
        client_seq: u64,
        retry_after_ms: u32,
    ) {
        let registry = &self.session_layer().registry;
        if let Err(e) = registry.report_error(session_id, code, msg_id, client_seq, retry_after_ms)
        {
            tracing::debug!(%code, msg_id, error = %e, "refusal not queued for its session");
        }
    }
}

pub(super) async fn link_event_loop(shared: Weak<Shared>, mut rx: mpsc::Receiver<LinkEvent>) {
    while let Some(event) = rx.recv().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match event {
            LinkEvent::Backend(LinkFrame::Push {
                handle,
                msg_id,
                class,
                payload,
            }) => {
                let label = ClassLabel {
                    class: class.as_str().into(),
                };
                if class == waygate_transport::TrafficClass::BestEffort
                    && shared.governor.shed_best_effort.load(Ordering::Acquire)
                {
                    shared.metrics.overload_shed.inc();
                    continue;
                }
                let pushed = shared.session_of_handle(handle).map(|sid| {
                    shared.session_layer().registry.push(
                        &sid,
                        Downstream {
                            class,
                            msg_id,
                            payload,
                        },
                    )
                });
                match pushed {
                    Some(Ok(())) => shared.metrics.pushed.get_or_create(&label).inc(),
                    _ => shared.metrics.push_dropped.get_or_create(&label).inc(),
                };
            }
            LinkEvent::Backend(LinkFrame::Kick { handle, code, .. }) => {
                if let Some(sid) = shared.session_of_handle(handle) {
                    shared.session_layer().registry.close(&sid, code);
                }
            }
            LinkEvent::Refuse {
                handle,
                msg_id,
                client_seq,
                code,
                retry_after_ms,
                epoch,
                message,
            } => {
                let Some(sid) = shared.session_of_handle(handle) else {
                    continue;
                };
                if code == CloseCode::StaleEpoch {
                    if let (Some(m), Some(result)) = (message, reroute(&shared, sid, epoch).await) {
                        shared.metrics.stale_epoch_reroutes.inc();
                        let InFlight {
                            msg_id,
                            client_seq,
                            class,
                            payload,
                            ..
                        } = m;
                        let outcome = result.and_then(|entry| {
                            shared.route_and_forward(&entry, msg_id, client_seq, class, payload)
                        });
                        if let Err(e) = outcome {
                            shared.report_error(&sid, e.code, msg_id, client_seq, e.retry_after_ms);
                        }
                        continue;
                    }
                }
                shared.report_error(&sid, code, msg_id, client_seq, retry_after_ms);
            }
            LinkEvent::Backend(LinkFrame::Bind {
                handle,
                service,
                key,
            }) => {
                let Some(sid) = shared.session_of_handle(handle) else {
                    continue;
                };
                // In order with the session's pushes, into its snapshot: the key travels
                // with the session to whichever edge restores it.
                if let Err(e) = shared
                    .session_layer()
                    .registry
                    .bind_key(&sid, &service, &key)
                {
                    tracing::warn!(%service, error = %e, "routing key not recorded in the session");
                }
                if let Ok(mut e) = shared.entries.lock() {
                    if let Some(entry) = e.by_id.get_mut(&sid) {
                        Arc::make_mut(&mut entry.keys).insert(service, key);
                    }
                }
            }
            LinkEvent::Backend(LinkFrame::Pin {
                kind,
                key,
                instance_id,
            }) => {
                tracing::info!(?kind, %key, %instance_id, "backend PIN received (dynamic pins are not applied yet; use table assignments)");
            }
            LinkEvent::Backend(other) => {
                // The link passes only the four frames above (it closes on anything else).
                tracing::warn!(frame = ?other, "backend frame not handled by the edge");
            }
            LinkEvent::Up { addr, .. } => {
                shared
                    .metrics
                    .backend_up
                    .get_or_create(&BackendLabel {
                        backend: addr.to_string(),
                    })
                    .set(1);
            }
            LinkEvent::Down { addr } => {
                shared
                    .metrics
                    .backend_up
                    .get_or_create(&BackendLabel {
                        backend: addr.to_string(),
                    })
                    .set(0);
            }
        }
    }
}

/// After a stale-epoch refusal: refresh the table (file source) if the backend is ahead,
/// then hand back the session's entry for a second routing attempt.
pub(super) async fn reroute(
    shared: &Arc<Shared>,
    sid: SessionId,
    backend_epoch: u64,
) -> Option<Result<SessionEntry, DeliverError>> {
    if shared.epoch.load(Ordering::Relaxed) < backend_epoch {
        if let Some(source) = &shared.source {
            let _ = source.refresh().await;
            apply_latest(shared);
        }
    }
    if shared.epoch.load(Ordering::Relaxed) < backend_epoch {
        return Some(Err(DeliverError {
            code: CloseCode::Unavailable,
            retry_after_ms: 1000,
        }));
    }
    let entry = shared.entries.lock().ok()?.by_id.get(&sid).cloned()?;
    Some(Ok(entry))
}

//! Backend -> client: every link event (PUSH, KICK, REFUSE, BIND, PIN, UNPIN, link up/down) is
//! carried out on the link's own task without waiting ([`EdgeLinkSink`]); only a stale-epoch
//! refusal goes through one async loop, which refreshes the table and routes it again.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use tokio::sync::mpsc;
use waygate_protocol::frame::{ErrorReport, SessionId};
use waygate_protocol::link::{LinkFrame, PinKind, PinOutcome};
use waygate_routing::{KeyKind, PlacementError};
use waygate_session::driver::{DeliverError, Delivered, Downstream, OutboundItem};
use waygate_transport::{CloseCode, TrafficClass};

use super::upstream::{Forwarded, Forwarding};
use super::{apply_latest, SessionEntry, Shared};
use crate::link::{AnswerEnd, InFlight, LinkEvent, LinkEventSink, LinkRefusal};
use crate::metrics::BackendLabel;

impl Shared {
    /// Answers a backend's refusal to its client (ERROR with the refusal's code, message id,
    /// client seq and retry hint), if the session is still held.
    fn answer_refusal(&self, r: &LinkRefusal) {
        if let Some(sid) = self.session_of_handle(r.handle) {
            self.report_error(&sid, r.code, r.msg_id, r.client_seq, r.retry_after_ms);
        }
    }

    /// A backend processed a client's message (FORWARD_DONE): it is acknowledged to the
    /// client after the pushes its handler sent, never waiting.
    pub(super) fn answered(&self, session_id: &SessionId, client_seq: u64) {
        let registry = &self.session_layer().registry;
        if let Err(e) = registry.answered(session_id, client_seq) {
            tracing::debug!(client_seq, error = %e, "answer not queued for its session");
        }
        self.wake_behind(session_id, client_seq);
    }

    /// A forward answered or refused for good: the session's message waiting behind it
    /// (PROTOCOL.md §9.5) may go.
    fn wake_behind(&self, session_id: &SessionId, client_seq: u64) {
        if let Some(wake) = self.settle_forward(session_id, client_seq) {
            wake.notify_one();
        }
    }

    /// Whether the overload governor sheds a push of `class` (best-effort at level 1 and
    /// above); counted when it does.
    pub(super) fn shed_by_governor(&self, class: TrafficClass) -> bool {
        let shed = class == TrafficClass::BestEffort
            && self.governor.shed_best_effort.load(Ordering::Acquire);
        if shed {
            self.metrics.overload_shed.inc();
        }
        shed
    }

    /// Counts a backend push queued for its session (`ok`) or dropped.
    fn count_push(&self, class: TrafficClass, ok: bool) {
        let (queued, dropped) = &self.metrics.push_counters[class as usize];
        if ok { queued } else { dropped }.inc();
    }

    /// A handler's held pushes and what ends them (its answer, a refusal, or nothing when
    /// they were released at their byte cap), queued for the session under one lock so its
    /// connection shows them in one turn (PROTOCOL.md §9.6). Never waits.
    fn answer_with_pushes(&self, handle: u64, pushes: Vec<Downstream>, end: AnswerEnd) {
        let Some(sid) = self.session_of_handle(handle) else {
            pushes.iter().for_each(|p| self.count_push(p.class, false));
            return;
        };
        // The item that ends them, and the message it answers.
        let (end, settles) = match end {
            AnswerEnd::Done(client_seq) => {
                (Some(OutboundItem::Answered(client_seq)), Some(client_seq))
            }
            AnswerEnd::Refused(r) => (
                Some(OutboundItem::Error(ErrorReport {
                    code: r.code,
                    msg_id: r.msg_id,
                    client_seq: r.client_seq,
                    retry_after_ms: r.retry_after_ms,
                })),
                Some(r.client_seq),
            ),
            AnswerEnd::Released => (None, None),
        };
        let items = pushes
            .into_iter()
            .filter(|p| !self.shed_by_governor(p.class))
            .map(OutboundItem::Message)
            .chain(end);
        self.session_layer()
            .registry
            .queue_together(&sid, items, |class, result| match class {
                Some(class) => self.count_push(class, result.is_ok()),
                None => {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "answer not queued for its session");
                    }
                }
            });
        if let Some(client_seq) = settles {
            self.wake_behind(&sid, client_seq);
        }
    }

    /// A backend's PIN or UNPIN (PROTOCOL.md §9.5), carried out on the router at once; its
    /// PIN_RESULT when the backend asked for one (a request id other than 0).
    pub(super) fn pin_request(&self, frame: LinkFrame) -> Option<LinkFrame> {
        let (request_id, outcome) = match frame {
            LinkFrame::Pin {
                kind,
                key,
                instance_id,
                request_id,
            } => (request_id, self.pin(kind, &key, &instance_id)),
            LinkFrame::Unpin {
                request_id,
                kind,
                key,
            } => (request_id, self.unpin(kind, &key)),
            _ => return None,
        };
        (request_id != 0).then_some(LinkFrame::PinResult {
            request_id,
            outcome,
        })
    }

    /// PIN: `key` on `instance_id` from now on (counted, a refusal logged).
    fn pin(&self, kind: PinKind, key: &str, instance_id: &str) -> PinOutcome {
        let kind = key_kind(kind);
        let pinned = match self.router.lock() {
            Ok(mut router) => router.pin(kind, key, instance_id),
            Err(_) => return PinOutcome::Unavailable,
        };
        match pinned {
            Ok(()) => {
                self.metrics.pins_applied.inc();
                tracing::debug!(%kind, %key, %instance_id, "backend PIN applied");
                PinOutcome::Pinned
            }
            Err(e) => {
                self.metrics.pins_refused.inc();
                tracing::warn!(%kind, %key, %instance_id, error = %e, "backend PIN refused");
                match e {
                    PlacementError::NoTable => PinOutcome::NoTable,
                    PlacementError::UnknownInstance { .. } => PinOutcome::UnknownInstance,
                    PlacementError::Full => PinOutcome::Full,
                    // Not refusals of `pin` for the kinds a PIN carries (player, room).
                    _ => PinOutcome::Unavailable,
                }
            }
        }
    }

    /// UNPIN: forget the pin of `key` (counted when there was one).
    fn unpin(&self, kind: PinKind, key: &str) -> PinOutcome {
        let kind = key_kind(kind);
        let removed = match self.router.lock() {
            Ok(mut router) => router.unpin(kind, key),
            Err(_) => return PinOutcome::Unavailable,
        };
        if removed {
            self.metrics.pins_removed.inc();
            tracing::debug!(%kind, %key, "backend UNPIN applied");
            PinOutcome::Unpinned
        } else {
            PinOutcome::NotPinned
        }
    }

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
        self.wake_behind(session_id, client_seq);
    }
}

/// The edge's [`LinkEventSink`]: every link event it can carry out without waiting is
/// handled on the link's own task (no hop through the async loop).
#[derive(Debug)]
pub(super) struct EdgeLinkSink(pub(super) Weak<Shared>);

impl LinkEventSink for EdgeLinkSink {
    fn handle(&self, event: LinkEvent, later: &crate::link::LinkWriter<'_>) -> Option<LinkFrame> {
        let shared = self.0.upgrade()?;
        if let LinkEvent::Backend(
            frame @ (LinkFrame::ChannelJoin { .. }
            | LinkFrame::ChannelLeave { .. }
            | LinkFrame::ChannelPublish { .. }),
        ) = event
        {
            return shared.channel_request(frame, later);
        }
        if let LinkEvent::Backend(frame @ LinkFrame::PlayerPush { .. }) = event {
            return shared.player_push(frame, later);
        }
        if let LinkEvent::Backend(frame @ (LinkFrame::Pin { .. } | LinkFrame::Unpin { .. })) = event
        {
            return shared.pin_request(frame);
        }
        if let Some(LinkEvent::Refuse { refusal, .. }) = handle_now(&shared, event) {
            // The link gives stale-epoch refusals to the async loop; should one arrive here,
            // the client still gets its answer.
            shared.answer_refusal(&refusal);
        }
        None
    }
}

/// The router's key kind of a PIN's kind.
fn key_kind(kind: PinKind) -> KeyKind {
    match kind {
        PinKind::Player => KeyKind::Player,
        PinKind::Room => KeyKind::Room,
    }
}

/// Carries a link event out at once; hands back a stale-epoch refusal with its message (the
/// table may need a refresh first: [`link_event_loop`]).
fn handle_now(shared: &Arc<Shared>, event: LinkEvent) -> Option<LinkEvent> {
    match event {
        LinkEvent::Backend(LinkFrame::Push {
            handle,
            msg_id,
            class,
            payload,
        }) => {
            if shared.shed_by_governor(class) {
                return None;
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
            shared.count_push(class, matches!(pushed, Some(Ok(()))));
        }
        LinkEvent::Backend(LinkFrame::ForwardDone { handle, client_seq }) => {
            if let Some(sid) = shared.session_of_handle(handle) {
                shared.answered(&sid, client_seq);
            }
        }
        LinkEvent::Answer {
            handle,
            pushes,
            end,
        } => shared.answer_with_pushes(handle, pushes, end),
        LinkEvent::Backend(LinkFrame::Kick { handle, code, .. }) => {
            if let Some(sid) = shared.session_of_handle(handle) {
                shared.session_layer().registry.close(&sid, code);
            }
        }
        LinkEvent::Refuse {
            refusal,
            message: Some(_),
        } if refusal.code == CloseCode::StaleEpoch
            && shared.session_of_handle(refusal.handle).is_some() =>
        {
            return Some(event);
        }
        LinkEvent::Refuse { refusal, .. } => shared.answer_refusal(&refusal),
        LinkEvent::Backend(LinkFrame::Bind {
            handle,
            service,
            key,
        }) => {
            let sid = shared.session_of_handle(handle)?;
            // Only a service of the route table: the session's keys (kept in its entry and
            // every snapshot) are bounded by the table, never by what a backend names.
            let known = shared
                .router
                .lock()
                .ok()
                .and_then(|r| r.table().map(|t| t.service(&service).is_some()))
                .unwrap_or(false);
            if !known {
                shared.metrics.binds_refused.inc();
                tracing::warn!(%service, "backend BIND refused: no such service in the route table");
                return None;
            }
            // In order with the session's pushes, into its snapshot: the key travels
            // with the session to whichever edge restores it.
            if let Err(e) = shared
                .session_layer()
                .registry
                .bind_key(&sid, &service, &key)
            {
                tracing::warn!(%service, error = %e, "routing key not recorded in the session");
            }
            let released = match shared.entries.lock() {
                Ok(mut e) => e.set_keys(&sid, [(service, key)]),
                Err(_) => Vec::new(),
            };
            shared.release_keys(released);
        }
        LinkEvent::Backend(frame @ (LinkFrame::Pin { .. } | LinkFrame::Unpin { .. })) => {
            // Without a fast sink only those that want no answer come here (the link
            // answers the others `unavailable`): nothing to send back.
            let _ = shared.pin_request(frame);
        }
        LinkEvent::Backend(other) => {
            // The link passes only the frames above and the channel requests, which the
            // sink answers (it closes on anything else).
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
            let label = BackendLabel {
                backend: addr.to_string(),
            };
            // A retired link's last word: its series is gone, not down.
            let retired = shared
                .links
                .lock()
                .map(|l| !l.contains_key(&addr))
                .unwrap_or(false);
            if retired {
                shared.metrics.backend_up.remove(&label);
            } else {
                shared.metrics.backend_up.get_or_create(&label).set(0);
            }
        }
    }
    None
}

/// The async part of link events: a stale-epoch refusal refreshes the table if the backend
/// is ahead and routes the held message again — only when the backend's epoch is above the
/// one its FORWARD carried; otherwise its client gets ERROR 406. Everything else was handled on the link's
/// task ([`EdgeLinkSink`]); an event arriving here anyway is handled the same way.
pub(super) async fn link_event_loop(shared: Weak<Shared>, mut rx: mpsc::Receiver<LinkEvent>) {
    while let Some(event) = rx.recv().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let Some(LinkEvent::Refuse {
            refusal,
            message: Some(m),
        }) = handle_now(&shared, event)
        else {
            continue;
        };
        let Some(sid) = shared.session_of_handle(refusal.handle) else {
            continue;
        };
        // A backend that is not ahead of the epoch the message was forwarded with: routing
        // it again would reach the same instance, which would refuse it again without end
        // (a backend's bug). Its client gets the refusal (ERROR 406), as when the re-route
        // is impossible.
        if refusal.epoch <= m.epoch {
            tracing::warn!(
                backend_epoch = refusal.epoch,
                forwarded_epoch = m.epoch,
                "stale_epoch refusal from a backend not ahead of the forward: passed to the client"
            );
            shared.answer_refusal(&refusal);
            continue;
        }
        if let Some(result) = reroute(&shared, sid, refusal.epoch).await {
            shared.metrics.stale_epoch_reroutes.inc();
            let InFlight {
                msg_id,
                client_seq,
                class,
                payload,
                ..
            } = m;
            let outcome = result.and_then(|entry| {
                shared.route_and_forward(
                    &entry,
                    msg_id,
                    client_seq,
                    class,
                    payload,
                    Forwarding::Rerouted,
                )
            });
            match outcome {
                // Withdrawn: the session moves; its client resends it to the next edge.
                Ok(Forwarded::Sent(Delivered::AwaitingAnswer) | Forwarded::Withdrawn) => {}
                Ok(Forwarded::Sent(Delivered::Answered)) => shared.answered(&sid, client_seq),
                // A re-routed message is never told to wait; were it, the client is answered.
                Ok(Forwarded::Wait { .. }) => shared.report_error(
                    &sid,
                    CloseCode::Busy,
                    msg_id,
                    client_seq,
                    shared.config.links.busy_retry_after_ms,
                ),
                Err(e) => shared.report_error(&sid, e.code, msg_id, client_seq, e.retry_after_ms),
            }
            continue;
        }
        shared.answer_refusal(&refusal);
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

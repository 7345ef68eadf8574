//! Client -> backend: the session layer hands each upstream message to `EdgeUpstream`, which
//! routes it (service, then instance) and forwards it on that instance's link without
//! waiting; session lifecycle events go to the links the session was opened on.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use waygate_protocol::link::LinkFrame;
use waygate_routing::{KeyKind, RouteReason, RouteRequest, RoutingError};
use waygate_session::driver::{DeliverError, Delivered, SessionEvent, UpstreamSink};
use waygate_session::machine::Upstream;
use waygate_transport::CloseCode;

use super::forward_order::ForwardTarget;
use super::table::{Admitted, ForwardWake, Held, Stopped};
use super::{SessionEntry, Shared};
use crate::link::{ForwardError, LinkClient};
use crate::metrics::{CodeLabel, EdgeMetrics};
use waygate_protocol::frame::SessionId;

/// How long a client's message waits for the session's older messages to its service
/// (PROTOCOL.md §9.5) before it is refused `busy`.
pub(super) const ORDER_HOLD_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// Which message is forwarded: a client's, which keeps its place behind the session's
/// older messages to the same service (it may have to wait), or one refused `stale_epoch`
/// and routed again, which never waits (every later one waits for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Forwarding {
    New,
    Rerouted,
}

/// What became of a message offered to [`Shared::route_and_forward`].
pub(super) enum Forwarded {
    /// On the backend's link.
    Sent(Delivered),
    /// Not sent: an older message of the session to its service is unanswered (§9.5).
    /// Offer it again when woken.
    Wait { wake: ForwardWake },
    /// Not sent and not to be answered here: the session moves to another edge (hard
    /// migration), where its client resends it.
    Withdrawn,
}

impl Shared {
    /// Routes and forwards one upstream message.
    pub(super) fn route_and_forward(
        &self,
        entry: &SessionEntry,
        msg_id: u32,
        client_seq: u64,
        class: waygate_transport::TrafficClass,
        payload: bytes::Bytes,
        forwarding: Forwarding,
    ) -> Result<Forwarded, DeliverError> {
        let refuse = |code, retry_after_ms| self.refused(code, retry_after_ms);
        let started = std::time::Instant::now();
        let decision = {
            let mut router = self
                .router
                .lock()
                .map_err(|_| refuse(CloseCode::Internal, 0))?;
            let mut req = RouteRequest::player(&entry.meta.player_id);
            if let Some(table) = router.table().cloned() {
                for (service, key) in entry.keys.iter() {
                    if let Some(spec) = table.services.iter().find(|s| &s.name == service) {
                        req = match spec.key {
                            KeyKind::Room => req.room(key),
                            KeyKind::Guild => req.guild(key),
                            KeyKind::Order => req.order(key),
                            _ => req,
                        };
                    }
                }
            }
            router.route_target(msg_id, &req)
        };
        self.metrics
            .route_seconds
            .observe(started.elapsed().as_secs_f64());
        let decision = match decision {
            Ok(d) => d,
            Err(RoutingError::NoServiceForMessage { .. }) => {
                return Err(refuse(CloseCode::NoRoute, 0))
            }
            Err(e) => {
                tracing::debug!(msg_id, error = %e, "no route");
                return Err(refuse(CloseCode::Unavailable, 1000));
            }
        };
        let target = &decision.target;
        let addr: SocketAddr = match target.socket {
            Some(a) => a,
            None => target
                .address
                .parse()
                .map_err(|_| refuse(CloseCode::Unavailable, 1000))?,
        };
        let link = self.link(addr);
        let sid = &entry.meta.session_id;
        // The order rule (§9.5), by the service the message id names (the canary may serve
        // it from another): every sequenced message waits behind the session's unanswered
        // older ones; only those that will be answered are tracked (any instance of a
        // round-robin service takes any message: nothing behind them to keep in order).
        let tracked = decision.reason != RouteReason::RoundRobin && link.awaits_answer(client_seq);
        let to = ForwardTarget {
            service: decision.requested.clone(),
            instance: addr,
            epoch: decision.epoch,
        };
        let forward = |payload| {
            link.forward(
                &entry.meta,
                msg_id,
                decision.epoch,
                client_seq,
                class,
                payload,
            )
        };
        let (sent, wake) = match forwarding {
            Forwarding::New if client_seq == 0 => (forward(payload), None),
            Forwarding::New => {
                let admitted = self
                    .entries
                    .lock()
                    .map_err(|_| refuse(CloseCode::Internal, 0))?
                    .admit_forward(sid, client_seq, &to, tracked);
                match admitted {
                    Admitted::Go => {}
                    Admitted::Wait(wake) => return Ok(Forwarded::Wait { wake }),
                    Admitted::Stopped(stopped) => return self.not_sent(stopped),
                }
                // Tracked before it is sent: its answer can never come first.
                let sent = forward(payload);
                let settled = tracked && !matches!(sent, Ok(Delivered::AwaitingAnswer));
                (
                    sent,
                    settled
                        .then(|| self.settle_forward(sid, client_seq))
                        .flatten(),
                )
            }
            Forwarding::Rerouted => {
                // Moved and sent under one lock: a message waiting for it (woken by any
                // other answer meanwhile) cannot see it moved and go first.
                let mut e = self
                    .entries
                    .lock()
                    .map_err(|_| refuse(CloseCode::Internal, 0))?;
                let mut wake = match e.rerouted_forward(sid, client_seq, &to, tracked) {
                    Ok(wake) => wake,
                    Err(stopped) => return self.not_sent(stopped),
                };
                let sent = forward(payload);
                if tracked && !matches!(sent, Ok(Delivered::AwaitingAnswer)) {
                    wake = e.settle_forward(sid, client_seq).or(wake);
                }
                (sent, wake)
            }
        };
        // After the send: a message woken now is queued behind this one.
        if let Some(wake) = wake {
            wake.notify_one();
        }
        match sent {
            Ok(delivered) => {
                // A placement another edge could not recompute (least loaded, pinned by a
                // backend or assigned) travels in the session's snapshot (R3, S7).
                if !decision.canary
                    && matches!(
                        decision.reason,
                        RouteReason::LeastLoaded | RouteReason::Pinned | RouteReason::RoomAssigned
                    )
                {
                    self.session_layer()
                        .registry
                        .bind(sid, &target.service, &target.instance_id);
                }
                // Recorded under the table's lock whatever this message's copy of the entry
                // says: a migration may have closed the session on this link since the copy
                // was taken, and the forward just opened it there again (`ensure_open`);
                // left out, its end would never close it there.
                if let Ok(mut e) = self.entries.lock() {
                    e.add_link(sid, addr);
                }
                self.metrics.forwarded_to(target).inc();
                Ok(Forwarded::Sent(delivered))
            }
            Err(ForwardError::Unavailable) => Err(refuse(CloseCode::Unavailable, 1000)),
            Err(ForwardError::Busy { retry_after_ms }) => {
                Err(refuse(CloseCode::Busy, retry_after_ms))
            }
        }
    }

    /// A message of a session that ended (refused `going_away`: nobody gets it) or moves
    /// (withdrawn, counted) is not sent (PROTOCOL.md §9.5).
    fn not_sent(&self, stopped: Stopped) -> Result<Forwarded, DeliverError> {
        match stopped {
            Stopped::Gone => Err(self.refused(CloseCode::GoingAway, 0)),
            Stopped::Moving => {
                self.metrics.forwards_withdrawn.inc();
                Ok(Forwarded::Withdrawn)
            }
        }
    }

    /// A client's message refused by the edge (counted by code).
    fn refused(&self, code: CloseCode, retry_after_ms: u32) -> DeliverError {
        self.metrics
            .upstream_refused
            .get_or_create(&CodeLabel {
                code: code.as_str().into(),
            })
            .inc();
        DeliverError {
            code,
            retry_after_ms,
        }
    }

    /// A tracked forward of the session is answered, refused or was not sent: the
    /// wake-up of a message waiting behind it, if one may go now.
    pub(super) fn settle_forward(
        &self,
        session_id: &SessionId,
        client_seq: u64,
    ) -> Option<ForwardWake> {
        if client_seq == 0 {
            return None;
        }
        self.entries
            .lock()
            .ok()?
            .settle_forward(session_id, client_seq)
    }

    pub(super) async fn close_on_links(
        &self,
        entry: &SessionEntry,
        code: CloseCode,
        only: Option<SocketAddr>,
    ) {
        let links: Vec<LinkClient> = match self.links.lock() {
            Ok(l) => entry
                .links
                .iter()
                .filter(|a| only.is_none_or(|o| o == **a))
                .filter_map(|a| l.get(a).cloned())
                .collect(),
            Err(_) => Vec::new(),
        };
        for link in links {
            link.session_event(LinkFrame::SessionClose {
                handle: entry.meta.handle,
                code,
            })
            .await;
        }
    }

    pub(super) async fn lifecycle_on_links(&self, entry: &SessionEntry, frame: LinkFrame) {
        let links: Vec<LinkClient> = match self.links.lock() {
            Ok(l) => entry
                .links
                .iter()
                .filter_map(|a| l.get(a).cloned())
                .collect(),
            Err(_) => Vec::new(),
        };
        for link in links {
            link.session_event(frame.clone()).await;
        }
    }
}

/// The session layer's view of the edge.
pub(super) struct EdgeUpstream(pub(super) Weak<Shared>);

#[async_trait]
impl UpstreamSink for EdgeUpstream {
    async fn deliver(&self, message: Upstream) -> Result<Delivered, DeliverError> {
        let shared = self.0.upgrade().ok_or(DeliverError {
            code: CloseCode::GoingAway,
            retry_after_ms: 0,
        })?;
        // The session's entry, and its place behind the session's messages waiting on the
        // order rule (§9.5) if any wait: one lock.
        let (entry, held) = {
            let mut e = shared
                .entries
                .lock()
                .map_err(|_| shared.refused(CloseCode::Internal, 0))?;
            let entry = e.open(
                &message.session_id,
                &message.player_id,
                &shared.config.edge_id,
            );
            (entry, e.hold_behind(message, tokio::time::Instant::now()))
        };
        let message = match held {
            Held::Free(m) => m,
            Held::Queued => {
                shared.metrics.forwards_held.inc();
                // Answered once forwarded and answered, or refused: by `forward_held`.
                return Ok(Delivered::AwaitingAnswer);
            }
            Held::Full => {
                return Err(shared.refused(CloseCode::Busy, shared.config.links.busy_retry_after_ms))
            }
        };
        let (msg_id, seq, class) = (message.msg_id, message.seq, message.class);
        let payload = message.payload.clone();
        match shared.route_and_forward(&entry, msg_id, seq, class, payload, Forwarding::New)? {
            Forwarded::Sent(delivered) => Ok(delivered),
            // Unanswered here: the client resends it to the edge the session moves to.
            Forwarded::Withdrawn => Ok(Delivered::AwaitingAnswer),
            Forwarded::Wait { .. } => {
                // An older message of the session to the same service is unanswered
                // (§9.5): this one, and the session's later ones behind it, wait on a task
                // of their own; the session's task goes on (its pushes keep flowing).
                shared.metrics.forwards_held.inc();
                let session_id = message.session_id;
                let start = shared
                    .entries
                    .lock()
                    .map(|mut e| e.start_holding(message, tokio::time::Instant::now()))
                    .unwrap_or(false);
                if start {
                    tokio::spawn(forward_held(Arc::downgrade(&shared), session_id));
                }
                // Answered once forwarded and answered, or refused: by `forward_held`.
                Ok(Delivered::AwaitingAnswer)
            }
        }
    }

    async fn session_event(&self, event: SessionEvent) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        match event {
            SessionEvent::Established {
                session_id,
                player_id,
                fencing,
                outcome,
                transport,
                setup,
                phases,
                ..
            } => {
                shared
                    .metrics
                    .session_setup_seconds
                    .get_or_create(&EdgeMetrics::transport(transport))
                    .observe(setup.as_secs_f64());
                for (phase, took) in [
                    ("transport", phases.transport),
                    ("hello", phases.hello),
                    ("auth", phases.auth),
                    ("restore", phases.restore),
                    ("claim", phases.claim),
                ] {
                    let labels = crate::metrics::PhaseLabels {
                        transport: transport.as_str().into(),
                        phase: phase.into(),
                    };
                    shared
                        .metrics
                        .session_phase_seconds
                        .get_or_create(&labels)
                        .observe(took.as_secs_f64());
                }
                if let Some(r) = &shared.redis {
                    let (presence, edge) = (r.presence.clone(), shared.config.edge_id.clone());
                    let player = player_id.to_string();
                    tokio::spawn(async move {
                        if let Err(e) = presence.set(&player, &session_id, &edge).await {
                            tracing::debug!(error = %e, "presence not recorded");
                        }
                    });
                }
                let mut entry = shared.entry(&session_id, &player_id);
                if let Ok(mut e) = shared.entries.lock() {
                    if let Some(en) = e.by_id.get_mut(&session_id) {
                        Arc::make_mut(&mut en.meta).fencing = fencing;
                        entry = en.clone();
                    }
                }
                use waygate_protocol::frame::WelcomeOutcome;
                if matches!(
                    outcome,
                    WelcomeOutcome::Restored | WelcomeOutcome::RestoredWithGap
                ) {
                    shared
                        .lifecycle_on_links(
                            &entry,
                            LinkFrame::SessionReattached {
                                handle: entry.meta.handle,
                                gap: outcome == WelcomeOutcome::RestoredWithGap,
                            },
                        )
                        .await;
                }
                if shared.draining.load(std::sync::atomic::Ordering::Acquire) {
                    // Established after a drain listed this edge's sessions (its handshake
                    // was under way then): it moves too, rather than being cut at the
                    // drain's end.
                    let deadline =
                        std::time::Duration::from_millis(shared.config.drain.deadline_ms);
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        let target = shared.drain_target();
                        shared.migrate_away(&[session_id], &target, deadline).await;
                    });
                }
            }
            SessionEvent::Bound {
                session_id,
                bindings,
            } => {
                // Placements the session carried (restored, or inherited from the session
                // it took over): bound again here, by the player id for player-keyed
                // services and by the session's key for key-routed ones.
                let entry = shared
                    .entries
                    .lock()
                    .ok()
                    .and_then(|e| e.by_id.get(&session_id).cloned());
                let Some(entry) = entry else { return };
                let Ok(mut router) = shared.router.lock() else {
                    return;
                };
                let Some(table) = router.table().cloned() else {
                    return;
                };
                for (service, instance) in &bindings {
                    let Some(spec) = table.services.iter().find(|s| &s.name == service) else {
                        continue;
                    };
                    let key = match spec.key {
                        KeyKind::Player | KeyKind::LeastLoaded => Some(&*entry.meta.player_id),
                        KeyKind::RoundRobin => None,
                        _ => entry.keys.get(service).map(String::as_str),
                    };
                    let Some(key) = key else { continue };
                    if let Err(e) = router.restore_binding(key, service, instance) {
                        tracing::info!(%service, %instance, error = %e, "carried placement not restored; routing afresh");
                    }
                }
            }
            SessionEvent::RoutingKeys { session_id, keys } => {
                // A restored session's keys (BIND from backends, possibly on another edge).
                let released = match shared.entries.lock() {
                    Ok(mut e) => e.set_keys(&session_id, keys),
                    Err(_) => Vec::new(),
                };
                shared.release_keys(released);
            }
            SessionEvent::Channels {
                session_id,
                channels,
            } => shared.rejoin_channels(session_id, channels),
            SessionEvent::PushesWritten { receipts, stored } => {
                shared.player_pushes.written(&receipts, stored);
            }
            SessionEvent::Detached { session_id, linger } => {
                let entry = shared
                    .entries
                    .lock()
                    .ok()
                    .and_then(|e| e.by_id.get(&session_id).cloned());
                if let Some(entry) = entry {
                    shared
                        .lifecycle_on_links(
                            &entry,
                            LinkFrame::SessionDetached {
                                handle: entry.meta.handle,
                                linger_ms: u32::try_from(linger.as_millis()).unwrap_or(u32::MAX),
                            },
                        )
                        .await;
                }
            }
            SessionEvent::Ended {
                session_id,
                player_id,
                reason,
                released: _,
                channels_acked,
                ..
            } => {
                tracing::debug!(
                    edge = %shared.config.edge_id,
                    session = %waygate_session::resume::hex_id(&session_id),
                    ?reason,
                    "session ended: a member of no channel here"
                );
                shared.channels_session_departed(&session_id, &player_id, &channels_acked);
                let removed = shared
                    .entries
                    .lock()
                    .ok()
                    .and_then(|mut e| e.remove(&session_id));
                if let Some((entry, released)) = removed {
                    shared.release_keys(released);
                    let code = match reason {
                        waygate_session::EndReason::Kicked => CloseCode::Kicked,
                        waygate_session::EndReason::LingerExpired => CloseCode::SessionExpired,
                        waygate_session::EndReason::LoggedOut => CloseCode::Logout,
                        waygate_session::EndReason::ClosedByServer(c) => c,
                        _ => CloseCode::Normal,
                    };
                    shared.close_on_links(&entry, code, None).await;
                }
                if let Some(r) = &shared.redis {
                    let presence = r.presence.clone();
                    let player = player_id.to_string();
                    let edge = shared.config.edge_id.clone();
                    tokio::spawn(async move {
                        let _ = presence.remove(&player, &session_id, &edge).await;
                    });
                }
                // The player's key is this edge's to release unless another session of
                // the player lives here (a newer login on this edge inherits it). Whether
                // this session still owned the player (`released`) does not decide it: a
                // player taken over by another edge left its binding here for good.
                let other_here = shared
                    .session_layer()
                    .registry
                    .session_of(&player_id)
                    .is_some_and(|s| s != session_id);
                if !other_here {
                    if let Ok(mut router) = shared.router.lock() {
                        router.release_key(&player_id);
                    }
                }
            }
            _ => {}
        }
    }
}

/// Forwards a session's messages that wait on the order rule (§9.5), in order and off the
/// session's task: each once the rule lets it go, or refused `busy` once it has waited
/// [`ORDER_HOLD_MAX`] since it arrived and still may not go (then the next one's turn).
/// Ends when none waits, or with the session or the edge (what still waits, and the one in
/// hand, are then answered `unavailable`, also if the task panics). Holds no reference to
/// the edge while it waits.
async fn forward_held(edge: Weak<Shared>, session_id: SessionId) {
    let mut line = HeldLine {
        edge: edge.clone(),
        session_id,
        armed: true,
        in_hand: None,
    };
    loop {
        let Some(shared) = edge.upgrade() else { return };
        let next = match shared.entries.lock() {
            Ok(mut e) => e.next_held(&session_id),
            Err(_) => return,
        };
        let Some((held, entry)) = next else {
            // The line ended in `next_held` (a new one may start at once: not ours).
            line.armed = false;
            return;
        };
        drop(shared);
        let m = held.message;
        line.in_hand = Some((m.msg_id, m.seq));
        let until = held.arrived + ORDER_HOLD_MAX;
        loop {
            let Some(shared) = edge.upgrade() else { return };
            let payload = m.payload.clone();
            let wake = match shared.route_and_forward(
                &entry,
                m.msg_id,
                m.seq,
                m.class,
                payload,
                Forwarding::New,
            ) {
                Ok(Forwarded::Sent(Delivered::AwaitingAnswer) | Forwarded::Withdrawn) => break,
                Ok(Forwarded::Sent(Delivered::Answered)) => {
                    if m.seq != 0 {
                        shared.answered(&session_id, m.seq);
                    }
                    break;
                }
                Err(e) => {
                    shared.report_error(&session_id, e.code, m.msg_id, m.seq, e.retry_after_ms);
                    break;
                }
                Ok(Forwarded::Wait { wake }) => wake,
            };
            drop(shared);
            // Still behind an unanswered one: woken by an answer, or refused at its deadline.
            if tokio::time::timeout_at(until, wake.notified())
                .await
                .is_err()
            {
                let Some(shared) = edge.upgrade() else { return };
                shared.metrics.forwards_hold_expired.inc();
                tracing::debug!(
                    msg_id = m.msg_id,
                    seq = m.seq,
                    "older messages of the session unanswered for 2 s: refused busy"
                );
                let e = shared.refused(CloseCode::Busy, shared.config.links.busy_retry_after_ms);
                shared.report_error(&session_id, e.code, m.msg_id, m.seq, e.retry_after_ms);
                break;
            }
        }
        line.in_hand = None;
    }
}

/// A session's held line while its task runs: however the task ends (the edge gone, a
/// panic), the line stops and what still waits in it, with the message in hand, is answered
/// `unavailable`, so the session's later messages are routed again and none stays
/// unanswered.
struct HeldLine {
    edge: Weak<Shared>,
    session_id: SessionId,
    /// Cleared when the line ended normally.
    armed: bool,
    /// The message being forwarded (msg_id, client seq), out of the line.
    in_hand: Option<(u32, u64)>,
}

impl Drop for HeldLine {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Some(shared) = self.edge.upgrade() else {
            return;
        };
        let left = match shared.entries.lock() {
            Ok(mut e) => e.stop_holding(&self.session_id),
            Err(poisoned) => poisoned.into_inner().stop_holding(&self.session_id),
        };
        let left = left.into_iter().map(|m| (m.msg_id, m.seq));
        for (msg_id, seq) in self.in_hand.take().into_iter().chain(left) {
            shared.report_error(&self.session_id, CloseCode::Unavailable, msg_id, seq, 1000);
        }
    }
}

//! Channels (PROTOCOL.md §12): a backend's CHANNEL_JOIN / CHANNEL_LEAVE / CHANNEL_PUBLISH
//! enters on its link's task, is checked and ordered by the edge's sans-IO
//! [`ChannelHub`](waygate_channels::ChannelHub) and answered at once with CHANNEL_RESULT;
//! each active channel gets one consumer task that takes the hub's deliveries in order and
//! pushes them into the members' session outbound queues (which the session layer delivers,
//! acks and replays like any DATA). The hub's lock is never held while pushing, and no
//! lock is held across an await.

use std::sync::{Arc, Weak};
use std::time::Duration;

use waygate_channels::{channel_kind, ChannelError, Delivery, JoinOutcome};
use waygate_protocol::channel::{ChannelPosition, CHANNEL_EVENT_MSG_ID};
use waygate_protocol::link::LinkFrame;
use waygate_session::driver::{Downstream, PushError};
use waygate_transport::{CloseCode, TrafficClass};

use super::{now_std, Shared};
use crate::metrics::{ChannelClassLabels, ChannelLabels};

/// Members pushed per lock of the session registry (a big channel's fan-out lets other
/// work in between).
const PUSH_CHUNK: usize = 256;

fn result(request_id: u64, outcome: Result<ChannelPosition, ChannelError>) -> LinkFrame {
    let (code, retry_after_ms, position) = match outcome {
        Ok(p) => (CloseCode::Normal, 0, p),
        Err(e) => (e.code(), e.retry_after_ms(), ChannelPosition::default()),
    };
    LinkFrame::ChannelResult {
        request_id,
        code,
        retry_after_ms,
        position,
        duplicate: false,
    }
}

/// The CHANNEL_RESULT for a session that is not on this edge.
fn member_offline(request_id: u64) -> LinkFrame {
    LinkFrame::ChannelResult {
        request_id,
        code: CloseCode::MemberOffline,
        retry_after_ms: 0,
        position: ChannelPosition::default(),
        duplicate: false,
    }
}

/// A metrics label for a join's outcome.
fn join_label(outcome: &JoinOutcome) -> &'static str {
    match outcome {
        JoinOutcome::Joined => "joined",
        JoinOutcome::AlreadyMember => "already_member",
        JoinOutcome::Recovered { .. } => "recovered",
        JoinOutcome::HistoryLost => "history_lost",
    }
}

fn labels(channel: &str, class: TrafficClass, result: &str) -> ChannelLabels {
    ChannelLabels {
        kind: channel_kind(channel).unwrap_or("invalid").to_owned(),
        class: class.as_str().to_owned(),
        result: result.to_owned(),
    }
}

impl Shared {
    /// The channel hub. A panic while it was held leaves its state consistent (every
    /// method checks before it changes anything), so a poisoned lock is taken over.
    fn hub(&self) -> std::sync::MutexGuard<'_, waygate_channels::ChannelHub> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Carries out one channel request from a backend and returns its CHANNEL_RESULT;
    /// `None` for a frame that is not a channel request.
    pub(super) fn channel_request(self: &Arc<Self>, frame: LinkFrame) -> Option<LinkFrame> {
        let now = now_std();
        let reply = match frame {
            LinkFrame::ChannelPublish {
                request_id,
                channel,
                class,
                payload,
            } => {
                let outcome = self
                    .hub()
                    .publish(now, &channel, request_id, class, payload);
                let label = match &outcome {
                    Ok(r) if r.duplicate => "duplicate",
                    Ok(_) => "accepted",
                    Err(e) => e.code().as_str(),
                };
                self.metrics
                    .channel_publishes
                    .get_or_create(&labels(&channel, class, label))
                    .inc();
                match outcome {
                    Ok(receipt) => LinkFrame::ChannelResult {
                        request_id,
                        code: CloseCode::Normal,
                        retry_after_ms: 0,
                        position: receipt.position,
                        duplicate: receipt.duplicate,
                    },
                    Err(e) => {
                        tracing::debug!(%channel, error = %e, "publish refused");
                        result(request_id, Err(e))
                    }
                }
            }
            LinkFrame::ChannelJoin {
                request_id,
                handle,
                channel,
                since,
            } => {
                let Some(sid) = self.session_of_handle(handle) else {
                    return Some(member_offline(request_id));
                };
                let player = self.session_layer().registry.player_of(&sid);
                let player = player.as_deref().unwrap_or_default();
                let outcome = self.hub().join(now, sid, player, &channel, since);
                let label = match &outcome {
                    Ok((_, o)) => join_label(o),
                    Err(e) => e.code().as_str(),
                };
                self.metrics
                    .channel_joins
                    .get_or_create(&labels(&channel, TrafficClass::Critical, label))
                    .inc();
                if let Ok((_, JoinOutcome::Recovered { publications })) = &outcome {
                    self.metrics.channel_recovered.inc_by(*publications as u64);
                }
                result(request_id, outcome.map(|(p, _)| p))
            }
            LinkFrame::ChannelLeave {
                request_id,
                handle,
                channel,
            } => {
                let Some(sid) = self.session_of_handle(handle) else {
                    return Some(member_offline(request_id));
                };
                let outcome = {
                    let mut hub = self.hub();
                    hub.leave(now, sid, &channel)
                        .map(|_| hub.position(&channel).unwrap_or_default())
                };
                result(request_id, outcome)
            }
            _ => return None,
        };
        self.start_channel_consumers();
        Some(reply)
    }

    /// Starts a consumer for every channel that has work and none.
    pub(super) fn start_channel_consumers(self: &Arc<Self>) {
        let ready: Vec<Arc<str>> = {
            let mut hub = self.hub();
            std::iter::from_fn(|| hub.poll_ready()).collect()
        };
        for name in ready {
            tokio::spawn(channel_consumer(Arc::downgrade(self), name));
        }
    }

    /// A restored session was a member of `channels` (its snapshot says so, with the last
    /// position it was given): it becomes a member here again, recovering from there (on
    /// the same edge, where it still is a member, nothing changes; elsewhere the history is
    /// another epoch's: HISTORY_LOST). A channel this edge refuses (unknown kind, a cap) is
    /// ended for the client with a LEFT event, never dropped silently.
    pub(super) fn rejoin_channels(
        self: &Arc<Self>,
        session_id: waygate_protocol::frame::SessionId,
        channels: std::collections::BTreeMap<String, ChannelPosition>,
    ) {
        let now = now_std();
        let mut refused = Vec::new();
        let player = self.session_layer().registry.player_of(&session_id);
        let player = player.as_deref().unwrap_or_default();
        {
            let mut hub = self.hub();
            for (name, position) in channels {
                match hub.join(now, session_id, player, &name, Some(position)) {
                    Ok((_, outcome)) => {
                        self.metrics
                            .channel_joins
                            .get_or_create(&labels(
                                &name,
                                TrafficClass::Critical,
                                join_label(&outcome),
                            ))
                            .inc();
                    }
                    Err(e) => {
                        tracing::info!(channel = %name, error = %e, "restored membership refused here");
                        refused.push((name, position));
                    }
                }
            }
        }
        for (channel, position) in refused {
            let left = waygate_protocol::channel::ChannelEvent {
                kind: waygate_protocol::channel::ChannelEventKind::Left,
                channel,
                position,
                body: bytes::Bytes::new(),
            };
            let pushed = self.session_layer().registry.push(
                &session_id,
                Downstream {
                    // The channel's one lane (see `Delivery::wire_class`).
                    class: TrafficClass::Normal,
                    msg_id: CHANNEL_EVENT_MSG_ID,
                    payload: left.to_bytes(),
                },
            );

            // Not found: the session ended meanwhile (nobody left to tell). Queue full: the
            // session declares the loss itself (slow_consumer, RestoredWithGap).
            if let Err(e) = pushed {
                tracing::info!(error = %e, "LEFT for a refused membership not queued");
            }
        }
        self.start_channel_consumers();
    }

    /// A session ended for good: it is a member of no channel here any more; channels of a
    /// kind with backlog remember the position its client acknowledged, for the player's
    /// next join (PROTOCOL.md §12.4).
    pub(super) fn channels_session_departed(
        &self,
        session_id: &waygate_protocol::frame::SessionId,
        player: &str,
        acked: &std::collections::BTreeMap<String, ChannelPosition>,
    ) {
        self.hub()
            .session_departed(now_std(), session_id, player, acked);
    }

    /// Pushes one delivery into its members' session queues; a member whose session is
    /// gone stops being a member.
    fn fan_out(&self, d: &Delivery) {
        let message = Downstream {
            class: d.wire_class(),
            msg_id: CHANNEL_EVENT_MSG_ID,
            payload: d.event.clone(),
        };
        let registry = &self.session_layer().registry;
        let (mut delivered, mut offline, mut full, mut shed) = (0u64, 0u64, 0u64, 0u64);
        let mut gone = Vec::new();
        for chunk in d.to.chunks(PUSH_CHUNK) {
            registry.push_each(chunk, &message, |sid, r| match r {
                Ok(()) => delivered += 1,
                Err(PushError::NotFound) => {
                    offline += 1;
                    gone.push(*sid);
                }
                Err(PushError::Shed) => shed += 1,
                Err(_) => full += 1,
            });
        }
        if !gone.is_empty() {
            let mut hub = self.hub();
            for sid in &gone {
                hub.member_gone(&d.channel, sid);
            }
        }
        for (result, n) in [
            ("delivered", delivered),
            ("offline", offline),
            ("queue_full", full),
            ("shed", shed),
        ] {
            if n > 0 {
                self.metrics
                    .channel_deliveries
                    .get_or_create(&labels(&d.channel, d.class, result))
                    .inc_by(n);
            }
        }
        if let Some(at) = d.published_at {
            self.metrics
                .channel_delivery_seconds
                .get_or_create(&ChannelClassLabels {
                    kind: channel_kind(&d.channel).unwrap_or("invalid").to_owned(),
                    class: d.class.as_str().to_owned(),
                })
                .observe(now_std().saturating_duration_since(at).as_secs_f64());
        }
    }
}

/// One channel's consumer: takes its deliveries in order until none is pending (the hub
/// then asks for a new consumer with the next piece of work).
async fn channel_consumer(shared: Weak<Shared>, name: Arc<str>) {
    loop {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let next = shared.hub().next_delivery(&name);
        let Some(delivery) = next else {
            return;
        };
        shared.fan_out(&delivery);
        // A channel with a long queue yields between deliveries, so others run too.
        tokio::task::yield_now().await;
    }
}

/// Trims histories, reclaims idle channels and updates the channel gauges, once a second.
pub(super) async fn channel_sweep_loop(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Every configured kind is reported from the start, and a kind whose channels are all
    // gone reads 0, not its last depth.
    let mut kinds_seen: std::collections::BTreeSet<String> = match shared.upgrade() {
        Some(s) => s.config.channels.kinds.keys().cloned().collect(),
        None => return,
    };
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let mut hub = shared.hub();
        hub.sweep(now_std());
        shared.metrics.channels_active.set(hub.channels() as i64);
        shared.metrics.channel_pending.set(hub.pending() as i64);
        let mut by_kind = hub.pending_by_kind();
        for kind in &kinds_seen {
            by_kind.entry(kind.clone()).or_default();
        }
        for (kind, by_class) in by_kind {
            kinds_seen.insert(kind.clone());
            for class in waygate_transport::TrafficClass::ALL {
                let labels = crate::metrics::ChannelClassLabels {
                    kind: kind.clone(),
                    class: class.as_str().into(),
                };
                let n = i64::try_from(by_class[class as usize]).unwrap_or(i64::MAX);
                shared
                    .metrics
                    .channel_pending_by_class
                    .get_or_create(&labels)
                    .set(n);
            }
        }
    }
}

//! Channels (PROTOCOL.md §12): a backend's CHANNEL_JOIN / CHANNEL_LEAVE / CHANNEL_PUBLISH
//! enters on its link's task, is checked and ordered by the edge's sans-IO
//! [`ChannelHub`](waygate_channels::ChannelHub) and answered at once with CHANNEL_RESULT;
//! each active channel gets one consumer task that takes the hub's deliveries in order and
//! pushes them into the members' session outbound queues (which the session layer delivers,
//! acks and replays like any DATA). The hub's lock is never held while pushing, and no
//! lock is held across an await.
//!
//! With an announcement log (PROTOCOL.md §12.5), an announcement is answered later: the
//! hub holds it, one writer task appends what is held to the log in order (a batch per
//! write), tells the hub, and answers each publisher on its link. A join from another
//! epoch's position first reads the log (a task), then joins with what it found.
//!
//! Backends that publish a channel only to the edges that have it (PROTOCOL.md §12.6) are
//! told which channels this edge has: the hub decides what each link is told and when a new
//! channel may deliver; each link's task sends its notices ([`ChannelInterestSink`]); a join
//! that made a channel, or joined one still waiting for the backends' acknowledgements, is
//! answered once it stops waiting.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use waygate_channels::{channel_kind, AnnouncementRecord, ChannelError, Delivery, JoinOutcome};
use waygate_protocol::channel::{ChannelPosition, CHANNEL_EVENT_MSG_ID};
use waygate_protocol::link::LinkFrame;
use waygate_session::driver::{Downstream, PushError};
use waygate_transport::{CloseCode, TrafficClass};

use super::{now_std, Shared};
use crate::link::ChannelInterestSink;
use crate::metrics::{ChannelClassLabels, ChannelLabels};

/// The links' side of channel interest (PROTOCOL.md §12.6): whom to wake when notices are
/// due, and the join answers held until their channel stops waiting. Locked after the hub,
/// never across an await.
#[derive(Debug, Default)]
pub(super) struct InterestLinks {
    wakers: HashMap<u64, Arc<tokio::sync::Notify>>,
    held_joins: HashMap<Arc<str>, Vec<HeldJoin>>,
    /// Links to close: their backends kept a new channel waiting past
    /// [`INTEREST_ACK_DEADLINE`].
    overdue: std::collections::HashSet<u64>,
}

/// How long a backend may keep a new channel waiting for its acknowledgement before the
/// edge closes its link (PROTOCOL.md §12.6): a link that goes down owes nothing.
/// As long as a link's liveness allows a silent backend (three 2 s heartbeats, about): a
/// healthy backend acknowledges within a round trip, and closing a link costs every session
/// on it an `unavailable` answer for what was in flight.
pub(super) const INTEREST_ACK_DEADLINE: Duration = Duration::from_secs(5);

/// A join's answer and the link it goes to (`None`: the link was down when it came).
type HeldJoin = (Option<mpsc::Sender<LinkFrame>>, LinkFrame);

/// Members pushed per lock of the session registry (a big channel's fan-out lets other
/// work in between).
const PUSH_CHUNK: usize = 256;

/// Announcements the writer appends in one batch.
const ANNOUNCEMENT_BATCH: usize = 256;
/// Announcements waiting for the log writer, over all channels (each channel's own cap is
/// its `queue_critical`); beyond, a publish is answered `queue_full`. One batch: a job
/// waits at most for the batch being written and then its own, so its publisher is
/// answered within twice [`ANNOUNCEMENT_APPEND_DEADLINE`] (PROTOCOL.md §12.5's 4 s). With
/// 4,096 a slow log could make an answer wait ~34 s (channels audit).
pub(super) const ANNOUNCEMENT_QUEUE: usize = ANNOUNCEMENT_BATCH;
/// How long one append may take before its announcements are refused (`unavailable`): a
/// job waits for the batch before its own, so a publisher is answered within twice this,
/// inside the backend SDK's 5 s wait for a channel answer.
const ANNOUNCEMENT_APPEND_DEADLINE: Duration = Duration::from_secs(2);
/// Logged announcements read for one join (the log keeps a kind's history length).
const LOGGED_READ_LIMIT: usize = 100_000;

/// The edge's announcement log and its writer's queue.
#[derive(Debug)]
pub(super) struct Announcements {
    pub(super) log: Arc<dyn crate::announcements::AnnouncementLog>,
    pub(super) jobs: mpsc::Sender<AnnouncementJob>,
    /// Reads of the log for joins at once ([`LOG_READS`]): a backend's join beyond them is
    /// refused `unavailable` (retry), a restored membership waits its turn.
    pub(super) reads: Arc<tokio::sync::Semaphore>,
}

/// Reads of the announcement log for joins in flight at once. A restored membership holds
/// its read's result (and so its slot) until it has joined, so at most this many results
/// are in memory at once.
pub(super) const LOG_READS: usize = 64;
/// How long one read of the announcement log may take; past it the join goes on as when
/// the log cannot be read (a backend's join answered `unavailable`, a restored membership
/// joined with HISTORY_LOST only). Inside the backend SDK's 5 s wait for an answer.
const LOG_READ_DEADLINE: Duration = Duration::from_secs(2);
/// How long a restored membership waits for a read slot ([`LOG_READS`]) before it joins
/// without the log's announcements (HISTORY_LOST only): a restore storm on a slow log is
/// over within this, not after every read in turn.
const RESTORED_READ_WAIT: Duration = Duration::from_secs(10);

/// A held announcement and whom to answer once the log has it.
#[derive(Debug)]
pub(super) struct AnnouncementJob {
    record: AnnouncementRecord,
    request_id: u64,
    reply: Option<mpsc::Sender<LinkFrame>>,
}

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

/// Sends a CHANNEL_RESULT decided after its request was taken (an announcement once
/// logged, a join once the log was read) on the link the request came on. A full link
/// writer is waited for in a task of its own, so one slow backend holds up no other
/// answer. A link that is gone cannot be told: its backend's SDK has answered the request
/// itself (link closed, or its 5 s wait), and a retry with the same id is answered from the
/// channel's dedup window; logged here.
pub(super) fn answer_later(reply: Option<mpsc::Sender<LinkFrame>>, answer: LinkFrame) {
    use mpsc::error::TrySendError;
    let gone =
        || tracing::info!("an answer's link is gone; its backend's SDK answered the request");
    let Some(reply) = reply else {
        return gone();
    };
    match reply.try_send(answer) {
        Ok(()) => {}
        Err(TrySendError::Full(answer)) => {
            // Bounded as every wait for room in a link's writer: past it the backend SDK
            // has stopped waiting for the answer (5 s), and a link that stopped reading
            // would otherwise keep the task.
            tokio::spawn(async move {
                let wait = crate::link::LIFECYCLE_SEND_WAIT;
                match tokio::time::timeout(wait, reply.send(answer)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => gone(),
                    Err(_) => tracing::info!(
                        "an answer's link took nothing for 5 s; its backend's SDK answered the request"
                    ),
                }
            });
        }
        Err(TrySendError::Closed(_)) => gone(),
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

impl Shared {
    /// Metric labels of a channel request. The kind label is a configured kind, `unknown`
    /// or `invalid`: never a string a backend chose (each would be a new series, forever).
    fn channel_labels(&self, channel: &str, class: TrafficClass, result: &str) -> ChannelLabels {
        let kind = match channel_kind(channel) {
            Ok(k) if self.config.channels.kinds.contains_key(k) => k,
            Ok(_) => "unknown",
            Err(_) => "invalid",
        };
        ChannelLabels {
            kind: kind.to_owned(),
            class: class.as_str().to_owned(),
            result: result.to_owned(),
        }
    }

    /// The channel hub. A panic while it was held leaves its state consistent (every
    /// method checks before it changes anything), so a poisoned lock is taken over.
    fn hub(&self) -> std::sync::MutexGuard<'_, waygate_channels::ChannelHub> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Carries out one channel request from a backend and returns its CHANNEL_RESULT;
    /// `None` for a frame that is not a channel request.
    pub(super) fn channel_request(
        self: &Arc<Self>,
        frame: LinkFrame,
        later: &crate::link::LinkWriter<'_>,
    ) -> Option<LinkFrame> {
        let now = now_std();
        let reply = match frame {
            LinkFrame::ChannelPublish {
                request_id,
                channel,
                class,
                payload,
            } => {
                let (outcome, held) = {
                    let mut hub = self.hub();
                    // An announcement the log writer's full queue could not take would be
                    // given an offset and withdrawn at once, its members seeing it skipped
                    // and its publisher not told which: refused before it takes one. (Jobs
                    // are queued only under the hub's lock, so the room seen here stays.)
                    let writer_full = class == TrafficClass::Critical
                        && self
                            .announcements
                            .as_ref()
                            .is_some_and(|a| a.jobs.capacity() == 0);
                    let outcome = if writer_full {
                        Err(ChannelError::QueueFull)
                    } else {
                        hub.publish(now, &channel, request_id, class, payload)
                    };
                    // Queued for the log writer under the hub's lock, so the log gets a
                    // channel's announcements in offset order whatever link they came on.
                    let held = match &outcome {
                        Ok(receipt) => receipt.persist.clone().map(|record| {
                            self.hold_announcement(&mut hub, record, request_id, later())
                        }),
                        Err(_) => None,
                    };
                    (outcome, held)
                };
                if let Some(refused) = held {
                    // Answered by the log writer once the log has it, or refused now.
                    if refused.is_some() {
                        self.count_publish(&channel, Err(ChannelError::QueueFull));
                    }
                    self.start_channel_consumers();
                    return refused;
                }
                let label = match &outcome {
                    Ok(r) if r.duplicate => "duplicate",
                    Ok(_) => "accepted",
                    Err(e) => e.code().as_str(),
                };
                self.metrics
                    .channel_publishes
                    .get_or_create(&self.channel_labels(&channel, class, label))
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
                if let Some(since) = since {
                    let mut hub = self.hub();
                    if hub.needs_logged(sid, &channel, Some(since)) {
                        // Answered once the log was read.
                        let answer = Some((request_id, later()));
                        self.join_from_log(&mut hub, sid, channel, since, answer);
                        return None;
                    }
                }
                let player = self.session_layer().registry.player_of(&sid);
                let player = player.as_deref().unwrap_or_default();
                let (outcome, held) = {
                    let mut hub = self.hub();
                    let outcome = hub.join(now, sid, player, &channel, since);
                    if let Ok((position, _)) = &outcome {
                        self.track_membership(sid, &channel, Some(since.unwrap_or(*position)));
                    }
                    let answer = result(request_id, outcome.map(|(p, _)| p));
                    let held = self.hold_join(&hub, &channel, later(), answer);
                    (outcome, held)
                };
                self.count_join(&channel, &outcome);
                if let Ok((_, JoinOutcome::Recovered { publications })) = &outcome {
                    self.metrics.channel_recovered.inc_by(*publications as u64);
                }
                match held {
                    Some(answer) => answer,
                    None => {
                        self.start_channel_consumers();
                        return None;
                    }
                }
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
                    hub.leave(now, sid, &channel).map(|member| {
                        if member {
                            self.track_membership(sid, &channel, None);
                        }
                        hub.position(&channel).unwrap_or_default()
                    })
                };
                result(request_id, outcome)
            }
            _ => return None,
        };
        self.start_channel_consumers();
        Some(reply)
    }

    /// The answer to a join, unless its channel still waits for backends to acknowledge
    /// that this edge has it: then it is held (and `None` returned) until the channel stops
    /// waiting ([`Shared::interest_settled`]). Called with the hub locked, so the channel
    /// cannot settle in between.
    fn hold_join(
        &self,
        hub: &waygate_channels::ChannelHub,
        channel: &str,
        reply: Option<mpsc::Sender<LinkFrame>>,
        answer: LinkFrame,
    ) -> Option<LinkFrame> {
        let waits = matches!(
            answer,
            LinkFrame::ChannelResult {
                code: CloseCode::Normal,
                ..
            }
        ) && hub.awaiting_interest(channel);
        if !waits {
            return Some(answer);
        }
        self.interest_links()
            .held_joins
            .entry(channel.into())
            .or_default()
            .push((reply, answer));
        None
    }

    fn interest_links(&self) -> std::sync::MutexGuard<'_, InterestLinks> {
        self.interest_links
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the links that have interest notices due (call with the hub locked, after
    /// anything that may create or reclaim a channel).
    fn wake_interest_links(&self, hub: &mut waygate_channels::ChannelHub) {
        let mut links = None;
        while let Some(link) = hub.poll_interest_wakeup() {
            let links = links.get_or_insert_with(|| self.interest_links());
            if let Some(wake) = links.wakers.get(&link) {
                wake.notify_one();
            }
        }
    }

    /// Answers the joins held for channels that stopped waiting, and starts their
    /// consumers.
    fn interest_settled(
        self: &Arc<Self>,
        mut hub: std::sync::MutexGuard<'_, waygate_channels::ChannelHub>,
    ) {
        let mut answers = Vec::new();
        {
            let mut links = self.interest_links();
            while let Some(name) = hub.poll_interest_settled() {
                answers.extend(links.held_joins.remove(&name).unwrap_or_default());
            }
        }
        drop(hub);
        for (reply, answer) in answers {
            answer_later(reply, answer);
        }
        self.start_channel_consumers();
    }

    /// Joins `session` from `since` (another epoch's position) once the announcement log
    /// was read, in a task (see [`join_from_log`]). Only called when the hub has a log
    /// (`needs_logged`), which it has exactly when the edge has one. At most [`LOG_READS`]
    /// reads run at once: a backend's join beyond them is refused `unavailable` at once (it
    /// retries), a restored membership waits for a read. Called with the hub locked: the
    /// hub learns of the join before any later LEAVE ([`ChannelHub::deferred_join_started`]),
    /// which then follows it.
    ///
    /// [`ChannelHub::deferred_join_started`]: waygate_channels::ChannelHub::deferred_join_started
    fn join_from_log(
        self: &Arc<Self>,
        hub: &mut waygate_channels::ChannelHub,
        session: waygate_protocol::frame::SessionId,
        channel: String,
        since: ChannelPosition,
        answer: Option<(u64, Option<mpsc::Sender<LinkFrame>>)>,
    ) {
        let Some(a) = &self.announcements else {
            return;
        };
        let permit = a.reads.clone().try_acquire_owned().ok();
        let answer = match (&permit, answer) {
            // A backend's join: refused at once, it retries after the hint.
            (None, Some((request_id, reply))) => {
                self.metrics
                    .channel_joins
                    .get_or_create(&self.channel_labels(
                        &channel,
                        TrafficClass::Critical,
                        "log_busy",
                    ))
                    .inc();
                answer_later(reply, result(request_id, Err(ChannelError::LogUnavailable)));
                return;
            }
            // Otherwise it reads now, or (a restored membership) waits for a read in its
            // task.
            (_, answer) => answer,
        };
        let reads = a.reads.clone();
        let (weak, log) = (Arc::downgrade(self), a.log.clone());
        // A LEAVE the backend sends after this join waits for it.
        hub.deferred_join_started(session, &channel);
        tokio::spawn(async move {
            let permit = match permit {
                Some(p) => Some(p),
                None => match read_slot(&reads, RESTORED_READ_WAIT).await {
                    Ok(p) => p,
                    Err(_) => {
                        if let Some(shared) = weak.upgrade() {
                            shared.deferred_join_dropped(session, &channel);
                        }
                        return;
                    }
                },
            };
            join_from_log(weak, log, permit, session, channel, since, answer).await;
        });
    }

    /// Hands a held announcement to the log writer (with the hub locked: the writer's queue
    /// is in offset order); a full writer queue withdraws it at once (`queue_full`, the
    /// answer returned).
    fn hold_announcement(
        &self,
        hub: &mut waygate_channels::ChannelHub,
        record: AnnouncementRecord,
        request_id: u64,
        reply: Option<mpsc::Sender<LinkFrame>>,
    ) -> Option<LinkFrame> {
        let job = AnnouncementJob {
            record,
            request_id,
            reply,
        };
        let refused = match &self.announcements {
            Some(a) => match a.jobs.try_send(job) {
                Ok(()) => return None,
                Err(e) => e.into_inner(),
            },
            None => job,
        };
        hub.persisted(&refused.record.channel, refused.record.position, false);
        Some(result(refused.request_id, Err(ChannelError::QueueFull)))
    }

    fn count_join(
        &self,
        channel: &str,
        outcome: &Result<(ChannelPosition, JoinOutcome), ChannelError>,
    ) {
        let label = match outcome {
            Ok((_, o)) => join_label(o),
            Err(e) => e.code().as_str(),
        };
        self.metrics
            .channel_joins
            .get_or_create(&self.channel_labels(channel, TrafficClass::Critical, label))
            .inc();
    }

    fn count_publish(&self, channel: &str, outcome: Result<(), ChannelError>) {
        let label = match outcome {
            Ok(()) => "accepted",
            Err(e) => e.code().as_str(),
        };
        self.metrics
            .channel_publishes
            .get_or_create(&self.channel_labels(channel, TrafficClass::Critical, label))
            .inc();
    }

    /// Starts a consumer for every channel that has work and none.
    pub(super) fn start_channel_consumers(self: &Arc<Self>) {
        let ready: Vec<Arc<str>> = {
            let mut hub = self.hub();
            self.wake_interest_links(&mut hub);
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
                if hub.needs_logged(session_id, &name, Some(position)) {
                    // Another epoch's position: what the log holds after it comes first.
                    self.join_from_log(&mut hub, session_id, name, position, None);
                    continue;
                }
                match hub.join(now, session_id, player, &name, Some(position)) {
                    Ok(joined) => {
                        tracing::debug!(edge = %self.config.edge_id, channel = %name, session = %waygate_session::resume::hex_id(&session_id), ?position, ?joined, "restored membership joined");
                        self.count_join(&name, &Ok(joined))
                    }
                    Err(ChannelError::QueueFull) => {
                        // Recoveries of many members at once fill the channel's queue for
                        // them: transient, so the membership is joined again shortly (a
                        // LEAVE meanwhile follows that join).
                        hub.deferred_join_started(session_id, &name);
                        tokio::spawn(join_retrying(
                            Arc::downgrade(self),
                            session_id,
                            name,
                            position,
                            Vec::new(),
                            None,
                        ));
                    }
                    Err(e) => {
                        tracing::info!(channel = %name, error = %e, "restored membership refused here");
                        refused.push((name, position));
                    }
                }
            }
        }
        self.end_refused_memberships(session_id, refused);
        self.start_channel_consumers();
    }

    /// Queues a membership change the hub took for a backend's join (`Some`: the position
    /// the member starts from) or leave (`None`) in the session's queue, ahead of its
    /// JOINED or LEFT, so its snapshot holds it at once (a restore elsewhere meanwhile
    /// joins it there, or does not). Called with the hub locked: the session gets its
    /// joins and leaves in the hub's order.
    fn track_membership(
        &self,
        session: waygate_protocol::frame::SessionId,
        channel: &str,
        joined: Option<ChannelPosition>,
    ) {
        let tracked = self
            .session_layer()
            .registry
            .track_membership(&session, channel, joined);
        // Not found: the session ended meanwhile (its membership goes with it). Queue
        // full: the session declares the loss itself (slow_consumer, RestoredWithGap).
        if let Err(e) = tracked {
            tracing::debug!(%channel, error = %e, "a membership change not queued for its session");
        }
    }

    /// A deferred join (it read the log, or waited for room in the channel's queue) is
    /// over, `joined` from that position (`None`: refused, dropped, or a restored
    /// membership the session's snapshot holds already). A LEAVE taken after it is
    /// carried out now; the session's snapshot learns the one outcome (with the hub
    /// locked, as every join and leave, so it follows the hub's order).
    fn deferred_join_over(
        &self,
        hub: &mut waygate_channels::ChannelHub,
        session: waygate_protocol::frame::SessionId,
        channel: &str,
        joined: Option<ChannelPosition>,
    ) {
        if hub.deferred_join_done(now_std(), session, channel) {
            self.track_membership(session, channel, None);
        } else if joined.is_some() {
            self.track_membership(session, channel, joined);
        }
    }

    /// A deferred join was dropped (refused, or its session ended): a LEAVE taken after it
    /// is carried out now.
    fn deferred_join_dropped(&self, session: waygate_protocol::frame::SessionId, channel: &str) {
        self.deferred_join_over(&mut self.hub(), session, channel, None);
    }

    /// Restored memberships this edge refused end for the client with a LEFT event.
    fn end_refused_memberships(
        &self,
        session_id: waygate_protocol::frame::SessionId,
        refused: Vec<(String, ChannelPosition)>,
    ) {
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
                Err(e) => {
                    full += 1;
                    tracing::debug!(
                        edge = %self.config.edge_id,
                        channel = %d.channel,
                        session = %waygate_session::resume::hex_id(sid),
                        error = %e,
                        "a channel event not queued for a member"
                    );
                }
            });
        }
        if !gone.is_empty() {
            let mut hub = self.hub();
            for sid in &gone {
                tracing::debug!(
                    edge = %self.config.edge_id,
                    channel = %d.channel,
                    session = %waygate_session::resume::hex_id(sid),
                    "a member's session is not held here: no longer a member"
                );
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
                    .get_or_create(&self.channel_labels(&d.channel, d.class, result))
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

/// Reads what the announcement log holds after `since` (another epoch's position), then
/// joins `session` with it: the logged announcements, then HISTORY_LOST. `answer`: the
/// backend's CHANNEL_JOIN to answer (a log that cannot be read answers it `unavailable`,
/// nothing joined, so the game server retries); without, a restored membership (joined
/// without the log's announcements if it cannot be read: the member still gets
/// HISTORY_LOST, and the loss is logged and counted).
async fn join_from_log(
    shared: Weak<Shared>,
    log: Arc<dyn crate::announcements::AnnouncementLog>,
    read: Option<tokio::sync::OwnedSemaphorePermit>,
    session: waygate_protocol::frame::SessionId,
    channel: String,
    since: ChannelPosition,
    answer: Option<(u64, Option<mpsc::Sender<LinkFrame>>)>,
) {
    let (logged, read) = read_logged(log, read, &channel, since).await;
    // The slot stays with results only (their memory is what it bounds from here on).
    let read = read.filter(|_| logged.as_ref().is_ok_and(|l| !l.is_empty()));
    let weak = shared;
    let Some(shared) = weak.upgrade() else {
        return;
    };
    let logged = match logged {
        Ok(l) => l,
        Err(e) => {
            shared
                .metrics
                .channel_joins
                .get_or_create(&shared.channel_labels(
                    &channel,
                    TrafficClass::Critical,
                    "log_unavailable",
                ))
                .inc();
            if let Some((request_id, reply)) = answer {
                tracing::info!(%channel, error = %e, "join refused: the announcement log cannot be read");
                answer_later(reply, result(request_id, Err(ChannelError::LogUnavailable)));
                shared.deferred_join_dropped(session, &channel);
                return;
            }
            tracing::warn!(%channel, error = %e, "restored membership joined without the announcements it missed: the log cannot be read");
            Vec::new()
        }
    };
    let Some((request_id, reply)) = answer else {
        drop(shared);
        // The read's slot is held until the membership has joined: the results of at most
        // LOG_READS reads wait in memory, however many memberships a storm restores.
        return join_retrying(weak, session, channel, since, logged, read).await;
    };
    drop(read);
    // The session may have ended during the read: then it is a member of nothing here
    // (a membership added now would be a dead session's, the join answered as taken).
    let Some(player) = shared.session_layer().registry.player_of(&session) else {
        answer_later(reply, member_offline(request_id));
        shared.deferred_join_dropped(session, &channel);
        return;
    };
    let (outcome, answer) = {
        let mut hub = shared.hub();
        let outcome =
            hub.join_with_logged(now_std(), session, &player, &channel, Some(since), &logged);
        let joined = outcome.is_ok().then_some(since);
        shared.deferred_join_over(&mut hub, session, &channel, joined);
        let answer = result(request_id, outcome.map(|(p, _)| p));
        (
            outcome,
            shared.hold_join(&hub, &channel, reply.clone(), answer),
        )
    };
    shared.count_join(&channel, &outcome);
    if let Some(answer) = answer {
        answer_later(reply, answer);
    }
    shared.start_channel_consumers();
}

/// A read slot of `reads`, waiting at most `wait`: `Ok(None)` when none came free in time
/// (the membership then joins without the log's announcements); `Err` when the edge is
/// shutting down (the semaphore closed).
async fn read_slot(
    reads: &Arc<tokio::sync::Semaphore>,
    wait: Duration,
) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, tokio::sync::AcquireError> {
    match tokio::time::timeout(wait, reads.clone().acquire_owned()).await {
        Ok(permit) => permit.map(Some),
        Err(_) => Ok(None),
    }
}

/// What `log` holds for `channel` after `since`, within [`LOG_READ_DEADLINE`], and the
/// read's slot back when the read ended in time. The read runs in a task that holds the slot
/// until the read really ends (a file log's read on a blocking thread goes on after the
/// deadline): the [`LOG_READS`] bound counts every read in flight, answered or not. Without
/// a slot (none came free within [`RESTORED_READ_WAIT`]) nothing is read and the log counts
/// as unavailable.
async fn read_logged(
    log: Arc<dyn crate::announcements::AnnouncementLog>,
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    channel: &str,
    since: ChannelPosition,
) -> (
    Result<Vec<AnnouncementRecord>, crate::announcements::AnnouncementLogError>,
    Option<tokio::sync::OwnedSemaphorePermit>,
) {
    use crate::announcements::AnnouncementLogError;
    let Some(slot) = slot else {
        return (
            Err(AnnouncementLogError::Unavailable(format!(
                "no read of the log free within {RESTORED_READ_WAIT:?}"
            ))),
            None,
        );
    };
    let channel = channel.to_owned();
    let read = tokio::spawn(async move {
        let logged = log.after(&channel, since, LOGGED_READ_LIMIT).await;
        (logged, slot)
    });
    match tokio::time::timeout(LOG_READ_DEADLINE, read).await {
        Ok(Ok((logged, slot))) => (logged, Some(slot)),
        Ok(Err(e)) => (
            Err(AnnouncementLogError::Unavailable(format!(
                "the read failed: {e}"
            ))),
            None,
        ),
        Err(_) => (
            Err(AnnouncementLogError::Unavailable(format!(
                "no answer within {LOG_READ_DEADLINE:?}"
            ))),
            None,
        ),
    }
}

/// Rejoins a restored session's membership from `since` (with `logged`, the announcements
/// the log holds after it): a channel queue full of other members' recoveries is retried
/// every 100 ms for up to 10 s; any other refusal, or a queue still full, ends the
/// membership for the client with LEFT (never silently). The join was announced to the
/// hub as deferred (a LEAVE taken meanwhile follows it).
async fn join_retrying(
    weak: Weak<Shared>,
    session: waygate_protocol::frame::SessionId,
    channel: String,
    since: ChannelPosition,
    logged: Vec<AnnouncementRecord>,
    _read: Option<tokio::sync::OwnedSemaphorePermit>,
) {
    for attempt in 0..=100u32 {
        let Some(shared) = weak.upgrade() else {
            return;
        };
        let Some(player) = shared.session_layer().registry.player_of(&session) else {
            // The session ended: nothing to rejoin.
            shared.deferred_join_dropped(session, &channel);
            return;
        };
        let outcome = {
            let mut hub = shared.hub();
            let outcome =
                hub.join_with_logged(now_std(), session, &player, &channel, Some(since), &logged);
            if !matches!(outcome, Err(ChannelError::QueueFull) if attempt < 100) {
                // The snapshot holds the restored membership already.
                shared.deferred_join_over(&mut hub, session, &channel, None);
            }
            outcome
        };
        match outcome {
            Err(ChannelError::QueueFull) if attempt < 100 => {}
            Err(e) => {
                shared.count_join(&channel, &Err(e));
                tracing::info!(%channel, error = %e, "restored membership refused here");
                shared.end_refused_memberships(session, vec![(channel, since)]);
                return;
            }
            Ok(o) => {
                tracing::debug!(edge = %shared.config.edge_id, %channel, session = %waygate_session::resume::hex_id(&session), ?since, joined = ?o, attempt, "restored membership joined");
                shared.count_join(&channel, &Ok(o));
                shared.start_channel_consumers();
                return;
            }
        }
        drop(shared);
        tokio::time::sleep(Duration::from_millis(u64::from(
            waygate_channels::QUEUE_FULL_RETRY_MS,
        )))
        .await;
    }
}

/// The announcement log's writer: appends what the hub holds, in order, a batch at a time,
/// then releases (or withdraws) each announcement in the hub and answers its publisher.
pub(super) async fn announcement_writer(
    shared: Weak<Shared>,
    log: Arc<dyn crate::announcements::AnnouncementLog>,
    mut jobs: mpsc::Receiver<AnnouncementJob>,
) {
    let mut batch = Vec::with_capacity(ANNOUNCEMENT_BATCH);
    while jobs.recv_many(&mut batch, ANNOUNCEMENT_BATCH).await > 0 {
        let records: Vec<AnnouncementRecord> = batch.iter().map(|j| j.record.clone()).collect();
        let written =
            match tokio::time::timeout(ANNOUNCEMENT_APPEND_DEADLINE, log.append(&records)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer within the deadline".to_owned()),
            };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if let Err(e) = &written {
            tracing::warn!(error = %e, announcements = batch.len(), "announcement log append failed: refused");
            // The append may still land (a write that did not answer in time is not
            // undone): the log is told they are withdrawn, so no recovery reads them.
            tokio::spawn(withdraw_refused(
                log.clone(),
                records,
                shared.metrics.announcement_withdrawals_failed.clone(),
            ));
        }
        {
            let mut hub = shared.hub();
            for j in &batch {
                hub.persisted(&j.record.channel, j.record.position, written.is_ok());
            }
        }
        shared.start_channel_consumers();
        for j in batch.drain(..) {
            let outcome = match written {
                Ok(()) => Ok(j.record.position),
                Err(_) => Err(ChannelError::LogUnavailable),
            };
            shared.count_publish(&j.record.channel, outcome.map(|_| ()));
            let mut answer = result(j.request_id, outcome);
            if written.is_err() {
                // The offset it had been given, which its members will see skipped
                // (PROTOCOL.md §12.5): the publisher can tell a skip from a loss.
                if let LinkFrame::ChannelResult { position, .. } = &mut answer {
                    *position = j.record.position;
                }
            }
            answer_later(j.reply, answer);
        }
    }
}

/// Attempts to tell the log a refused batch is withdrawn.
const WITHDRAW_ATTEMPTS: u32 = 3;

/// Tells the log that `records`, refused because their append failed or did not answer in
/// time, are withdrawn (up to [`WITHDRAW_ATTEMPTS`] tries, each bounded by
/// [`ANNOUNCEMENT_APPEND_DEADLINE`]); a log that cannot be told is logged and counted: a
/// member recovering from it may then receive them (PROTOCOL.md §12.5).
async fn withdraw_refused(
    log: Arc<dyn crate::announcements::AnnouncementLog>,
    records: Vec<AnnouncementRecord>,
    failed: prometheus_client::metrics::counter::Counter,
) {
    for attempt in 1..=WITHDRAW_ATTEMPTS {
        match tokio::time::timeout(ANNOUNCEMENT_APPEND_DEADLINE, log.withdraw(&records)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => {
                tracing::info!(error = %e, attempt, "refused announcements not withdrawn yet");
            }
            Err(_) => {
                tracing::info!(
                    attempt,
                    "refused announcements not withdrawn yet: no answer"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tracing::warn!(
        announcements = records.len(),
        "refused announcements could not be withdrawn from the log: a recovery may read them"
    );
    failed.inc_by(records.len() as u64);
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
        // Reclaimed channels are told to the links that take notices.
        shared.wake_interest_links(&mut hub);
        // Links whose backends keep a new channel waiting are closed by their task.
        let overdue = hub.interest_overdue(now_std(), INTEREST_ACK_DEADLINE);
        if !overdue.is_empty() {
            let mut links = shared.interest_links();
            for link in overdue {
                if let Some(wake) = links.wakers.get(&link).cloned() {
                    links.overdue.insert(link);
                    wake.notify_one();
                }
            }
        }
        shared.metrics.channels_active.set(hub.channels() as i64);
        shared
            .metrics
            .channels_awaiting_backends
            .set(hub.awaiting_channels() as i64);
        shared.metrics.channel_pending.set(hub.pending() as i64);
        shared.metrics.announcements_held.set(hub.held() as i64);
        shared
            .metrics
            .channel_publish_ids
            .set(hub.publish_ids() as i64);
        let stats = hub.stats();
        let counted = shared.metrics.announcements_recovered.get();
        shared
            .metrics
            .announcements_recovered
            .inc_by(stats.logged_recovered.saturating_sub(counted));
        let counted = shared.metrics.channel_history_evicted.get();
        shared
            .metrics
            .channel_history_evicted
            .inc_by(stats.history_evicted.saturating_sub(counted));
        let bytes = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        shared
            .metrics
            .channel_history_bytes
            .set(bytes(hub.history_bytes()));
        shared
            .metrics
            .channel_pending_bytes
            .set(bytes(hub.pending_bytes()));
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

/// The edge's side of channel interest (PROTOCOL.md §12.6) for its links.
impl ChannelInterestSink for super::downstream::EdgeLinkSink {
    fn link_up(&self, wake: Arc<tokio::sync::Notify>) -> u64 {
        let Some(shared) = self.0.upgrade() else {
            return u64::MAX;
        };
        let mut hub = shared.hub();
        let link = hub.interest_link_up();
        shared.interest_links().wakers.insert(link, wake);
        link
    }

    fn due(&self, link: u64, max: usize) -> Vec<LinkFrame> {
        let Some(shared) = self.0.upgrade() else {
            return Vec::new();
        };
        let due = shared.hub().interest_due(link, max);
        due.into_iter()
            .map(|n| LinkFrame::ChannelInterest {
                seq: n.seq,
                present: n.present,
                channel: n.channel.to_string(),
            })
            .collect()
    }

    fn acked(&self, link: u64, seq: u64) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        let mut hub = shared.hub();
        hub.interest_acked(link, seq);
        shared.interest_settled(hub);
    }

    fn link_down(&self, link: u64) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        let mut hub = shared.hub();
        hub.interest_link_down(link);
        {
            let mut links = shared.interest_links();
            links.wakers.remove(&link);
            links.overdue.remove(&link);
        }
        shared.interest_settled(hub);
    }

    fn overdue(&self, link: u64) -> bool {
        self.0
            .upgrade()
            .is_some_and(|shared| shared.interest_links().overdue.contains(&link))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::announcements::{AnnouncementLog, AnnouncementLogError};

    /// A log whose reads never answer (a hung Redis, a file log behind a stuck fsync).
    #[derive(Debug)]
    struct HungLog;

    #[async_trait::async_trait]
    impl AnnouncementLog for HungLog {
        async fn append(&self, _: &[AnnouncementRecord]) -> Result<(), AnnouncementLogError> {
            std::future::pending().await
        }
        async fn withdraw(&self, _: &[AnnouncementRecord]) -> Result<(), AnnouncementLogError> {
            std::future::pending().await
        }
        async fn after(
            &self,
            _: &str,
            _: ChannelPosition,
            _: usize,
        ) -> Result<Vec<AnnouncementRecord>, AnnouncementLogError> {
            std::future::pending().await
        }
    }

    /// Audit: a restored membership's read of the log had no deadline, so a hung log held
    /// its join (and any LEAVE behind it) for ever. It now ends at LOG_READ_DEADLINE as a
    /// log that cannot be read (HISTORY_LOST only for a restored membership).
    #[tokio::test(start_paused = true)]
    async fn a_log_read_that_never_answers_ends_at_its_deadline() {
        let start = tokio::time::Instant::now();
        let reads = Arc::new(tokio::sync::Semaphore::new(1));
        let slot = reads.clone().try_acquire_owned().ok();
        let (read, slot) = tokio::time::timeout(
            Duration::from_secs(600),
            read_logged(
                Arc::new(HungLog),
                slot,
                "system:all",
                ChannelPosition::default(),
            ),
        )
        .await
        .expect("the read ends by itself");
        assert!(
            matches!(read, Err(AnnouncementLogError::Unavailable(_))),
            "{read:?}"
        );
        assert!(slot.is_none());
        assert_eq!(start.elapsed(), LOG_READ_DEADLINE);
        // The read goes on, and keeps its slot: the bound counts every read in flight.
        assert_eq!(reads.available_permits(), 0);
        // Without a read slot nothing is read at all.
        let (read, _) = read_logged(
            Arc::new(HungLog),
            None,
            "system:all",
            ChannelPosition::default(),
        )
        .await;
        assert!(matches!(read, Err(AnnouncementLogError::Unavailable(_))));
    }

    /// Audit: a restored membership waited for a read slot with no deadline, behind every
    /// other read of a restore storm. It now waits RESTORED_READ_WAIT at most; a slot
    /// that comes free in time is taken.
    #[tokio::test(start_paused = true)]
    async fn a_restored_membership_waits_for_a_read_slot_only_so_long() {
        let reads = Arc::new(tokio::sync::Semaphore::new(0));
        let start = tokio::time::Instant::now();
        let slot = tokio::time::timeout(
            Duration::from_secs(600),
            read_slot(&reads, RESTORED_READ_WAIT),
        )
        .await
        .expect("the wait ends by itself");
        assert!(matches!(slot, Ok(None)), "no slot came free");
        assert_eq!(start.elapsed(), RESTORED_READ_WAIT);
        let freed = reads.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            freed.add_permits(1);
        });
        assert!(matches!(
            read_slot(&reads, RESTORED_READ_WAIT).await,
            Ok(Some(_))
        ));
        reads.close();
        assert!(read_slot(&reads, RESTORED_READ_WAIT).await.is_err());
    }
}

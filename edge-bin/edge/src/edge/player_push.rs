//! Backend -> a player anywhere (PLAYER_PUSH, PROTOCOL.md §9.7; SPEC F4). A push for a
//! player with a session on this edge is queued on that session at once, on the link's own
//! task; one for a player elsewhere waits in the sans-IO
//! [`PlayerPushQueue`](crate::cluster::player_push::PlayerPushQueue) and goes to the
//! player's edge over Redis (presence lookup, one request per edge) in the next batch, on
//! one task of its own ([`player_push_loop`]). Every push is answered once with
//! PLAYER_PUSH_RESULT, on the link it came on.

use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{mpsc, Notify};
use waygate_protocol::link::{LinkFrame, PlayerPushOutcome};
use waygate_session::driver::{Downstream, PushError};

use super::channels::answer_later;
use super::Shared;
use crate::cluster::player_push::{DeliveredPushIds, PlayerPushQueue, PushIdCheck};
use crate::cluster::redis::PushMessage;
use crate::link::LinkWriter;

/// Pushes that may wait for other edges at once (beyond: `busy`).
const MAX_WAITING: usize = 4_096;
/// Pushes sent in one batch.
const MAX_BATCH: usize = 512;
/// How long an edge remembers the id of a push it delivered (PROTOCOL.md §9.7).
pub(super) const DELIVERED_ID_WINDOW: std::time::Duration = std::time::Duration::from_secs(120);
/// Most ids of delivered pushes remembered at once (beyond: `busy`).
const MAX_DELIVERED_IDS: usize = 1_048_576;

/// How a waiting push is answered: the link it came on and its request id.
type PushReply = (Option<mpsc::Sender<LinkFrame>>, u64);

/// The pushes waiting for other edges and the wake-up of their task; the ids of the pushes
/// delivered here.
#[derive(Debug)]
pub(super) struct PlayerPushes {
    queue: Mutex<PlayerPushQueue<PushReply>>,
    wake: Arc<Notify>,
    delivered: Mutex<DeliveredPushIds>,
}

impl PlayerPushes {
    pub(super) fn new() -> Self {
        Self {
            queue: Mutex::new(PlayerPushQueue::new(MAX_WAITING, MAX_BATCH)),
            wake: Arc::new(Notify::new()),
            delivered: Mutex::new(DeliveredPushIds::new(
                DELIVERED_ID_WINDOW,
                MAX_DELIVERED_IDS,
            )),
        }
    }
}

/// The outcome of a push into a session's queue on this edge (`None`: no session here).
fn local_outcome(result: Result<(), PushError>) -> Option<PlayerPushOutcome> {
    match result {
        Ok(()) => Some(PlayerPushOutcome::Delivered),
        Err(PushError::QueueFull | PushError::Shed) => Some(PlayerPushOutcome::QueueFull),
        Err(_) => None,
    }
}

impl Shared {
    /// Delivers a push to `player`'s session on this edge, unless a push with the same
    /// `id` was delivered here within the window (then `delivered`, nothing queued) or the
    /// edge remembers as many ids as it may (`busy`). `None`: the player has no session
    /// here.
    pub(super) fn deliver_push_here(
        &self,
        player: &str,
        id: u64,
        message: Downstream,
    ) -> Option<PlayerPushOutcome> {
        let now = std::time::Instant::now();
        let Ok(mut ids) = self.player_pushes.delivered.lock() else {
            return Some(PlayerPushOutcome::Busy);
        };
        match ids.check(now, id) {
            PushIdCheck::Duplicate => return Some(PlayerPushOutcome::Delivered),
            PushIdCheck::Full => return Some(PlayerPushOutcome::Busy),
            PushIdCheck::New => {}
        }
        let outcome = local_outcome(
            self.session_layer()
                .registry
                .push_to_player(player, message),
        );
        if outcome == Some(PlayerPushOutcome::Delivered) {
            ids.delivered(now, id);
        }
        outcome
    }

    /// A backend's PLAYER_PUSH: answered now when the player is on this edge (or there is
    /// no other edge to ask), else queued for the player's edge and answered later.
    pub(super) fn player_push(
        &self,
        frame: LinkFrame,
        later: &LinkWriter<'_>,
    ) -> Option<LinkFrame> {
        let LinkFrame::PlayerPush {
            request_id,
            player,
            msg_id,
            class,
            payload,
        } = frame
        else {
            return None;
        };
        let answer = |outcome: PlayerPushOutcome| {
            self.metrics.player_push_outcomes[outcome as usize].inc();
            Some(LinkFrame::PlayerPushResult {
                request_id,
                outcome,
            })
        };
        if self.shed_by_governor(class) {
            return answer(PlayerPushOutcome::Busy);
        }
        let message = Downstream {
            class,
            msg_id,
            payload,
        };
        if let Some(outcome) = self.deliver_push_here(&player, request_id, message.clone()) {
            return answer(outcome);
        }
        if self.redis.is_none() {
            // One edge: a player without a session here has none anywhere.
            return answer(PlayerPushOutcome::Offline);
        }
        let submitted = self
            .player_pushes
            .queue
            .lock()
            .map(|mut q| {
                let r = q.submit((later(), request_id), player, request_id, message);
                self.metrics.player_pushes_waiting.set(q.waiting() as i64);
                r
            })
            .is_ok_and(|r| r.is_ok());
        if !submitted {
            return answer(PlayerPushOutcome::Busy);
        }
        self.player_pushes.wake.notify_one();
        None
    }
}

/// Sends the waiting pushes to their players' edges, one batch at a time, and answers each
/// on the link it came on. Runs while the edge does (with Redis).
pub(super) async fn player_push_loop(weak: Weak<Shared>) {
    let Some(wake) = weak.upgrade().map(|s| s.player_pushes.wake.clone()) else {
        return;
    };
    loop {
        wake.notified().await;
        loop {
            let Some(shared) = weak.upgrade() else { return };
            let Some(redis) = shared.redis.clone() else {
                return;
            };
            let batch = shared
                .player_pushes
                .queue
                .lock()
                .ok()
                .and_then(|mut q| q.poll_batch());
            let Some(batch) = batch else { break };
            let items = batch
                .items
                .into_iter()
                .map(|(player, id, m)| {
                    let message = PushMessage {
                        class: m.class,
                        msg_id: m.msg_id,
                        payload: m.payload,
                        id,
                    };
                    (player, message)
                })
                .collect();
            let results = match redis.presence.push(items).await {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::debug!(error = %e, "players' edges not looked up: the batch is answered unreachable");
                    None
                }
            };
            let answers = match shared.player_pushes.queue.lock() {
                Ok(mut q) => {
                    let a = q.batch_done(batch.id, results);
                    shared.metrics.player_pushes_waiting.set(q.waiting() as i64);
                    a
                }
                Err(_) => return,
            };
            for ((reply, request_id), outcome) in answers {
                shared.metrics.player_push_outcomes[outcome as usize].inc();
                answer_later(
                    reply,
                    LinkFrame::PlayerPushResult {
                        request_id,
                        outcome,
                    },
                );
            }
        }
    }
}

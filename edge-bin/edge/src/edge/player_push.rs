//! Backend -> a player anywhere (PLAYER_PUSH, PROTOCOL.md §9.7; SPEC F4). A push for a
//! player with a session on this edge is queued on that session at once, on the link's own
//! task; one for a player elsewhere waits in the sans-IO
//! [`PlayerPushQueue`](crate::cluster::player_push::PlayerPushQueue) and goes to the
//! player's edge over Redis (presence lookup, one request per edge) in the next batch, on
//! one task of its own ([`player_push_loop`]). Every push is answered once with
//! PLAYER_PUSH_RESULT, on the link it came on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};
use waygate_protocol::link::{LinkFrame, PlayerPushOutcome};
use waygate_session::driver::{Downstream, PushError};

use super::channels::answer_later;
use super::Shared;
use crate::cluster::player_push::{DeliveredPushIds, PlayerPushQueue, PushIdCheck};
use crate::cluster::redis::{PushDelivery, PushMessage};
use crate::link::LinkWriter;

/// Pushes that may wait for other edges at once (beyond: `busy`).
const MAX_WAITING: usize = 4_096;
/// Pushes sent in one batch.
const MAX_BATCH: usize = 512;
/// How long an edge remembers the id of a push it delivered (PROTOCOL.md §9.7).
pub(super) const DELIVERED_ID_WINDOW: std::time::Duration = std::time::Duration::from_secs(120);
/// Most ids of delivered pushes remembered at once (beyond: `busy`).
const MAX_DELIVERED_IDS: usize = 1_048_576;
/// Pushes waiting for their session's write-through at once (beyond: `busy`).
const MAX_RECEIPTS_WAITING: usize = 4_096;
/// Copies of one push (its id sent again) waiting with it for its write-through (beyond:
/// `busy`).
const MAX_COPIES_WAITING: usize = 16;
/// How long a push waits for its session's write-through before it is answered `unknown`
/// (below the sending edge's 1 s wait for a batch's answer, PROTOCOL.md §9.7).
const RECEIPT_WAIT: Duration = Duration::from_millis(600);

/// How a waiting push is answered: the link it came on and its request id.
type PushReply = (Option<mpsc::Sender<LinkFrame>>, u64);

/// The pushes waiting for other edges and the wake-up of their task; the pushes taken
/// here.
#[derive(Debug)]
pub(super) struct PlayerPushes {
    queue: Mutex<PlayerPushQueue<PushReply>>,
    wake: Arc<Notify>,
    taken: Arc<PushLedger>,
}

/// The pushes taken here: their ids (what became of each, for copies sent again) and those
/// queued on a session that wait until its stored copy holds them (with write-through):
/// receipt -> (push id, whom to tell). One lock, so a copy never finds an id waiting for a
/// receipt that was already reported.
#[derive(Debug)]
pub(super) struct PushLedger {
    next: AtomicU64,
    state: Mutex<Ledger>,
}

#[derive(Debug)]
struct Ledger {
    ids: DeliveredPushIds,
    waiting: HashMap<u64, (u64, Vec<oneshot::Sender<bool>>)>,
}

impl PushLedger {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The receipt is over without being reported (its push was not queued after all, or
    /// its first waiter gave up): the push is `unknown`, and so is every copy waiting.
    fn forget(&self, receipt: u64) {
        let mut ledger = self.lock();
        if let Some((id, _waiters)) = ledger.waiting.remove(&receipt) {
            ledger.ids.resolved(id, false);
        }
    }

    /// The session reported `receipts` (`stored`: its stored copy holds their pushes).
    pub(super) fn written(&self, receipts: &[u64], stored: bool) {
        let mut ledger = self.lock();
        for receipt in receipts {
            let Some((id, waiters)) = ledger.waiting.remove(receipt) else {
                continue;
            };
            ledger.ids.resolved(id, stored);
            for tx in waiters {
                // Fails only when the waiter is gone: it gave up at RECEIPT_WAIT and
                // answered `unknown` itself, so the push is answered either way.
                if tx.send(stored).is_err() {
                    tracing::debug!(receipt, "push receipt after its waiter answered unknown");
                }
            }
        }
    }

    /// What became of a push queued with `receipt`: `delivered` once the session's stored
    /// copy holds it, else (not written through within [`RECEIPT_WAIT`], or could not be)
    /// `unknown`: it may still reach the client.
    async fn outcome(
        self: Arc<Self>,
        receipt: u64,
        rx: oneshot::Receiver<bool>,
    ) -> PlayerPushOutcome {
        match tokio::time::timeout(RECEIPT_WAIT, rx).await {
            Ok(Ok(true)) => PlayerPushOutcome::Delivered,
            Ok(Ok(false)) => PlayerPushOutcome::Unknown,
            Ok(Err(_)) | Err(_) => {
                self.forget(receipt);
                PlayerPushOutcome::Unknown
            }
        }
    }
}

/// How a push for a player with a session here went: answered now, or (queued with a
/// receipt) once the session's stored copy holds it.
type LocalPush = PushDelivery<PlayerPushOutcome>;

impl PlayerPushes {
    pub(super) fn new() -> Self {
        Self {
            queue: Mutex::new(PlayerPushQueue::new(MAX_WAITING, MAX_BATCH)),
            wake: Arc::new(Notify::new()),
            taken: Arc::new(PushLedger {
                next: AtomicU64::new(1),
                state: Mutex::new(Ledger {
                    ids: DeliveredPushIds::new(DELIVERED_ID_WINDOW, MAX_DELIVERED_IDS),
                    waiting: HashMap::new(),
                }),
            }),
        }
    }

    /// The session reported receipts (`SessionEvent::PushesWritten`).
    pub(super) fn written(&self, receipts: &[u64], stored: bool) {
        self.taken.written(receipts, stored);
    }
}

/// The outcome of a push into a session's queue on this edge (`None`: no session here).
fn local_outcome(result: Result<(), PushError>) -> Option<PlayerPushOutcome> {
    match result {
        // A copy of a push the session's stored copy held when it came to this edge.
        Ok(()) | Err(PushError::Duplicate) => Some(PlayerPushOutcome::Delivered),
        Err(PushError::QueueFull | PushError::Shed) => Some(PlayerPushOutcome::QueueFull),
        Err(_) => None,
    }
}

impl Shared {
    /// Delivers a push to `player`'s session on this edge, unless a push with the same
    /// `id` was taken here within the window (then nothing is queued and it is answered
    /// what that push is: `delivered`, `unknown`, or — still waiting for its session's
    /// write-through — whatever that brings) or the edge remembers as many ids as it may
    /// (`busy`). `None`: the player has no session here. With write-through a sequenced
    /// push is `delivered` only once the session's stored copy holds it
    /// ([`PushDelivery::Later`]): an edge killed before that could not answer `delivered`
    /// for a push it then lost.
    pub(super) fn deliver_push_here(
        &self,
        player: &str,
        id: u64,
        message: Downstream,
    ) -> Option<LocalPush> {
        let now = std::time::Instant::now();
        let ledger = self.player_pushes.taken.clone();
        let mut state = ledger.lock();
        match state.ids.check(now, id) {
            PushIdCheck::Duplicate => return Some(LocalPush::Now(PlayerPushOutcome::Delivered)),
            PushIdCheck::Unknown => return Some(LocalPush::Now(PlayerPushOutcome::Unknown)),
            PushIdCheck::Full => return Some(LocalPush::Now(PlayerPushOutcome::Busy)),
            PushIdCheck::Pending(receipt) => {
                let Some((_, waiters)) = state.waiting.get_mut(&receipt) else {
                    return Some(LocalPush::Now(PlayerPushOutcome::Unknown));
                };
                if waiters.len() >= MAX_COPIES_WAITING {
                    // Copies of one push resent faster than its write-through: `busy`.
                    return Some(LocalPush::Now(PlayerPushOutcome::Busy));
                }
                let (tx, rx) = oneshot::channel();
                waiters.push(tx);
                drop(state);
                return Some(LocalPush::Later(Box::pin(ledger.outcome(receipt, rx))));
            }
            PushIdCheck::New => {}
        }
        let layer = self.session_layer();
        if layer.write_through.is_none() || !message.class.is_sequenced() {
            let outcome = local_outcome(layer.registry.push_to_player(player, message))?;
            if outcome == PlayerPushOutcome::Delivered {
                state.ids.delivered(now, id);
            }
            return Some(LocalPush::Now(outcome));
        }
        if state.waiting.len() >= MAX_RECEIPTS_WAITING {
            return Some(LocalPush::Now(PlayerPushOutcome::Busy));
        }
        // Registered before the push: the session reports the receipt under this lock.
        let receipt = ledger.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        state.waiting.insert(receipt, (id, vec![tx]));
        match layer
            .registry
            .push_to_player_with_receipt(player, message, receipt, id)
        {
            Ok(true) => {
                state.ids.pending(now, id, receipt);
                drop(state);
                Some(LocalPush::Later(Box::pin(ledger.outcome(receipt, rx))))
            }
            Ok(false) => {
                // Queued, but its queue had no room left for the receipt.
                state.waiting.remove(&receipt);
                state.ids.unknown(now, id);
                Some(LocalPush::Now(PlayerPushOutcome::Unknown))
            }
            Err(e) => {
                state.waiting.remove(&receipt);
                if e == PushError::Duplicate {
                    state.ids.delivered(now, id);
                }
                local_outcome(Err(e)).map(LocalPush::Now)
            }
        }
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
        match self.deliver_push_here(&player, request_id, message.clone()) {
            Some(LocalPush::Now(outcome)) => return answer(outcome),
            Some(queued) => {
                let (reply, outcomes) = (later(), self.metrics.player_push_outcomes.clone());
                tokio::spawn(async move {
                    let outcome = queued.resolve().await;
                    outcomes[outcome as usize].inc();
                    answer_later(
                        reply,
                        LinkFrame::PlayerPushResult {
                            request_id,
                            outcome,
                        },
                    );
                });
                return None;
            }
            None => {}
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

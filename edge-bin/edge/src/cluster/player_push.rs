//! Pushes to players on other edges (PLAYER_PUSH, PROTOCOL.md §9.7; SPEC F4), sans-IO: the
//! queue of pushes a backend asked for whose player is not on this edge, sent to the
//! players' edges one batch at a time, and the answer each one gets.
//!
//! The shell (`edge/player_push.rs`) submits what it could not deliver locally, polls a
//! batch, sends it with [`RedisPresence::push`](super::redis::RedisPresence::push) (one
//! presence lookup, one request per edge) and hands the per-message results back; every
//! push is answered exactly once. While a batch is out, new pushes wait and go together in
//! the next one (one batch per edge per turn, as a group commit), so two pushes from one
//! backend to one player leave in the order they came. What waits is bounded: past
//! `max_waiting` a push is handed back at once to be answered `busy`.
//!
//! It never does I/O, never waits, and never answers a push it did not get an outcome for.

use std::collections::VecDeque;

use waygate_protocol::link::PlayerPushOutcome;
use waygate_session::driver::Downstream;

use super::redis::DeliveryResult;

/// One push waiting for its player's edge.
#[derive(Debug)]
struct WaitingPush<R> {
    reply: R,
    player: String,
    message: Downstream,
}

/// A batch to send: every push with its player, in the order they came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlayerPushBatch {
    /// Names the batch in [`PlayerPushQueue::batch_done`].
    pub id: u64,
    /// (player, message), in order.
    pub items: Vec<(String, Downstream)>,
}

/// The pushes waiting for other edges; `R` is how a push is answered (the requesting
/// link's writer and request id, in the shell).
#[derive(Debug)]
pub struct PlayerPushQueue<R> {
    waiting: VecDeque<WaitingPush<R>>,
    /// The batch out, with the answers owed for it in order.
    in_flight: Option<(u64, Vec<R>)>,
    max_waiting: usize,
    max_batch: usize,
    next_batch: u64,
}

impl<R> PlayerPushQueue<R> {
    /// At most `max_waiting` pushes wait (besides the batch out), at most `max_batch` go
    /// in one batch (both at least 1).
    pub fn new(max_waiting: usize, max_batch: usize) -> Self {
        Self {
            waiting: VecDeque::new(),
            in_flight: None,
            max_waiting: max_waiting.max(1),
            max_batch: max_batch.max(1),
            next_batch: 1,
        }
    }

    /// Queues a push; hands `reply` back when the queue is full (answer it `busy`).
    pub fn submit(&mut self, reply: R, player: String, message: Downstream) -> Result<(), R> {
        if self.waiting.len() >= self.max_waiting {
            return Err(reply);
        }
        self.waiting.push_back(WaitingPush {
            reply,
            player,
            message,
        });
        Ok(())
    }

    /// The next batch to send: none while one is out or nothing waits.
    pub fn poll_batch(&mut self) -> Option<PlayerPushBatch> {
        if self.in_flight.is_some() || self.waiting.is_empty() {
            return None;
        }
        let n = self.waiting.len().min(self.max_batch);
        let mut replies = Vec::with_capacity(n);
        let mut items = Vec::with_capacity(n);
        for w in self.waiting.drain(..n) {
            replies.push(w.reply);
            items.push((w.player, w.message));
        }
        let id = self.next_batch;
        self.next_batch += 1;
        self.in_flight = Some((id, replies));
        Some(PlayerPushBatch { id, items })
    }

    /// The batch `id` came back: `results` has one result per push in order, or is `None`
    /// when nothing could be sent (the presence lookup failed). Returns every push of the
    /// batch with its answer; nothing for a batch that is not out. A result list of the
    /// wrong length answers every push `unknown` (some may have been delivered).
    pub fn batch_done(
        &mut self,
        id: u64,
        results: Option<Vec<DeliveryResult>>,
    ) -> Vec<(R, PlayerPushOutcome)> {
        let replies = match self.in_flight.take() {
            Some((out, replies)) if out == id => replies,
            other => {
                self.in_flight = other;
                return Vec::new();
            }
        };
        let n = replies.len();
        let outcomes: Vec<PlayerPushOutcome> = match results {
            None => vec![PlayerPushOutcome::Unreachable; n],
            Some(r) if r.len() == n => r.into_iter().map(outcome_of).collect(),
            Some(_) => vec![PlayerPushOutcome::Unknown; n],
        };
        replies.into_iter().zip(outcomes).collect()
    }

    /// Pushes waiting (not counting the batch out).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether a batch is out.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }
}

/// The link's outcome for a cross-edge delivery result.
pub fn outcome_of(result: DeliveryResult) -> PlayerPushOutcome {
    match result {
        DeliveryResult::Delivered => PlayerPushOutcome::Delivered,
        DeliveryResult::Offline => PlayerPushOutcome::Offline,
        DeliveryResult::QueueFull => PlayerPushOutcome::QueueFull,
        DeliveryResult::EdgeUnreachable => PlayerPushOutcome::Unreachable,
        DeliveryResult::Timeout => PlayerPushOutcome::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use proptest::prelude::*;
    use waygate_transport::TrafficClass;

    fn msg(n: u32) -> Downstream {
        Downstream {
            class: TrafficClass::Normal,
            msg_id: n,
            payload: Bytes::from(n.to_string()),
        }
    }

    #[test]
    fn one_batch_out_at_a_time_and_what_came_meanwhile_goes_next() {
        let mut q = PlayerPushQueue::new(8, 3);
        for i in 0..5 {
            q.submit(i, format!("p{i}"), msg(i)).unwrap();
        }
        let b1 = q.poll_batch().unwrap();
        assert_eq!(b1.items.len(), 3, "capped at max_batch");
        assert_eq!(q.poll_batch(), None, "one batch out at a time");
        q.submit(5, "p5".into(), msg(5)).unwrap();
        let answers = q.batch_done(
            b1.id,
            Some(vec![
                DeliveryResult::Delivered,
                DeliveryResult::Offline,
                DeliveryResult::QueueFull,
            ]),
        );
        assert_eq!(
            answers,
            vec![
                (0, PlayerPushOutcome::Delivered),
                (1, PlayerPushOutcome::Offline),
                (2, PlayerPushOutcome::QueueFull)
            ]
        );
        let b2 = q.poll_batch().unwrap();
        let players: Vec<&str> = b2.items.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(players, ["p3", "p4", "p5"], "in the order they came");
        assert!(
            q.batch_done(b1.id, None).is_empty(),
            "an old batch is not out"
        );
        assert_eq!(
            q.batch_done(b2.id, None),
            vec![
                (3, PlayerPushOutcome::Unreachable),
                (4, PlayerPushOutcome::Unreachable),
                (5, PlayerPushOutcome::Unreachable)
            ],
            "a lookup that failed sent nothing"
        );
        assert!(!q.in_flight() && q.poll_batch().is_none());
    }

    #[test]
    fn a_full_queue_hands_the_push_back_and_a_short_answer_is_unknown() {
        let mut q = PlayerPushQueue::new(2, 10);
        q.submit(1, "a".into(), msg(1)).unwrap();
        q.submit(2, "b".into(), msg(2)).unwrap();
        assert_eq!(q.submit(3, "c".into(), msg(3)), Err(3));
        let b = q.poll_batch().unwrap();
        q.submit(3, "c".into(), msg(3)).unwrap();
        assert_eq!(
            q.batch_done(b.id, Some(vec![DeliveryResult::Delivered])),
            vec![
                (1, PlayerPushOutcome::Unknown),
                (2, PlayerPushOutcome::Unknown)
            ]
        );
        assert_eq!(q.waiting(), 1);
    }

    proptest! {
        /// Whatever the interleaving of submits, batches and results: every accepted push
        /// is answered exactly once, batches keep the submission order, and no more than
        /// the bound waits.
        #[test]
        fn every_accepted_push_is_answered_once_in_order(
            ops in proptest::collection::vec((0u8..3, 0usize..5), 1..200),
            max_waiting in 1usize..8,
            max_batch in 1usize..5,
        ) {
            let mut q = PlayerPushQueue::new(max_waiting, max_batch);
            let mut next = 0u32;
            let (mut accepted, mut answered, mut sent) = (Vec::new(), Vec::new(), Vec::new());
            let mut out: Option<PlayerPushBatch> = None;
            for (op, k) in ops {
                match op {
                    0 => {
                        if q.submit(next, format!("p{next}"), msg(next)).is_ok() {
                            accepted.push(next);
                        }
                        next += 1;
                        prop_assert!(q.waiting() <= max_waiting);
                    }
                    1 => {
                        if let Some(b) = q.poll_batch() {
                            prop_assert!(out.is_none() && b.items.len() <= max_batch);
                            sent.extend(b.items.iter().map(|(_, m)| m.msg_id));
                            out = Some(b);
                        }
                    }
                    _ => {
                        if let Some(b) = out.take() {
                            let results = (k > 0).then(|| {
                                vec![DeliveryResult::Delivered; b.items.len()]
                            });
                            for (r, _) in q.batch_done(b.id, results) {
                                answered.push(r);
                            }
                        }
                    }
                }
            }
            if let Some(b) = out.take() {
                answered.extend(q.batch_done(b.id, None).into_iter().map(|(r, _)| r));
            }
            while let Some(b) = q.poll_batch() {
                sent.extend(b.items.iter().map(|(_, m)| m.msg_id));
                answered.extend(q.batch_done(b.id, None).into_iter().map(|(r, _)| r));
            }
            prop_assert_eq!(&sent, &accepted, "sent in submission order, each once");
            prop_assert_eq!(&answered, &accepted, "answered in order, each once");
        }
    }
}

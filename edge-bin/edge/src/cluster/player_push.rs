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
//! [`DeliveredPushIds`] is the receiving side's memory: the ids of the pushes an edge
//! queued on its sessions, kept for a window, with what became of each (delivered, waiting
//! for its session's write-through, or unknown), so a push sent again with its id (a
//! backend that got `unknown` or no answer, or a batch that was applied although its answer
//! was lost) is never queued twice and is answered what the first copy was: `delivered`
//! only once that is true.
//!
//! It never does I/O, never waits, and never answers a push it did not get an outcome for.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use waygate_protocol::link::PlayerPushOutcome;
use waygate_session::driver::Downstream;

use super::redis::DeliveryResult;

/// One push waiting for its player's edge.
#[derive(Debug)]
struct WaitingPush<R> {
    reply: R,
    player: String,
    id: u64,
    message: Downstream,
}

/// A batch to send: every push with its player, in the order they came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlayerPushBatch {
    /// Names the batch in [`PlayerPushQueue::batch_done`].
    pub id: u64,
    /// (player, push id, message), in order.
    pub items: Vec<(String, u64, Downstream)>,
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
    pub fn submit(
        &mut self,
        reply: R,
        player: String,
        id: u64,
        message: Downstream,
    ) -> Result<(), R> {
        if self.waiting.len() >= self.max_waiting {
            return Err(reply);
        }
        self.waiting.push_back(WaitingPush {
            reply,
            player,
            id,
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
            items.push((w.player, w.id, w.message));
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
            Some(r) if r.len() == n => r.into_iter().map(PlayerPushOutcome::from).collect(),
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

/// The ids of pushes delivered on this edge, each remembered for `window`, at most `cap` at
/// once (an id is never forgotten early: when full, a new id is refused until the oldest
/// expires).
#[derive(Debug)]
pub struct DeliveredPushIds {
    window: Duration,
    cap: usize,
    ids: HashMap<u64, TakenPush>,
    /// (expiry, id), oldest first.
    expiry: VecDeque<(Instant, u64)>,
}

/// What became of a push an edge queued on one of its sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TakenPush {
    Delivered,
    /// Waiting for its session's write-through (the shell's receipt).
    Pending(u64),
    /// Queued, but not known to be stored: it may reach the client (unless its edge dies).
    Unknown,
}

/// What [`DeliveredPushIds::check`] says about a push's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushIdCheck {
    /// Not taken here within the window (or no id): deliver it, then
    /// [`DeliveredPushIds::delivered`] or [`DeliveredPushIds::pending`].
    New,
    /// Delivered here already: answer `delivered`, deliver nothing.
    Duplicate,
    /// Its first copy waits for receipt `.0`: answer what that copy is answered, deliver
    /// nothing.
    Pending(u64),
    /// Its first copy was answered `unknown`: answer `unknown` again, deliver nothing.
    Unknown,
    /// As many ids remembered as allowed: answer `busy`.
    Full,
}

impl DeliveredPushIds {
    /// Remembers each id for `window`, at most `cap` (at least 1) at once.
    pub fn new(window: Duration, cap: usize) -> Self {
        Self {
            window,
            cap: cap.max(1),
            ids: HashMap::new(),
            expiry: VecDeque::new(),
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some(&(at, id)) = self.expiry.front() {
            if at > now {
                break;
            }
            self.expiry.pop_front();
            self.ids.remove(&id);
        }
    }

    /// Whether a push with `id` (0: none) may be delivered at `now`.
    pub fn check(&mut self, now: Instant, id: u64) -> PushIdCheck {
        self.expire(now);
        if id == 0 {
            return PushIdCheck::New;
        }
        match self.ids.get(&id) {
            Some(TakenPush::Delivered) => PushIdCheck::Duplicate,
            Some(TakenPush::Pending(receipt)) => PushIdCheck::Pending(*receipt),
            Some(TakenPush::Unknown) => PushIdCheck::Unknown,
            None if self.ids.len() >= self.cap => PushIdCheck::Full,
            None => PushIdCheck::New,
        }
    }

    fn take(&mut self, now: Instant, id: u64, what: TakenPush) {
        if id == 0 || self.ids.len() >= self.cap || self.ids.contains_key(&id) {
            return;
        }
        self.ids.insert(id, what);
        self.expiry.push_back((now + self.window, id));
    }

    /// The push with `id` was delivered at `now` (after [`PushIdCheck::New`]).
    pub fn delivered(&mut self, now: Instant, id: u64) {
        self.take(now, id, TakenPush::Delivered);
    }

    /// The push with `id` was queued at `now` and waits for `receipt` (after
    /// [`PushIdCheck::New`]).
    pub fn pending(&mut self, now: Instant, id: u64, receipt: u64) {
        self.take(now, id, TakenPush::Pending(receipt));
    }

    /// The push with `id` was queued at `now`, not known to be stored (after
    /// [`PushIdCheck::New`]).
    pub fn unknown(&mut self, now: Instant, id: u64) {
        self.take(now, id, TakenPush::Unknown);
    }

    /// The receipt of the pending push `id` came: `stored` (delivered) or not (unknown).
    pub fn resolved(&mut self, id: u64, stored: bool) {
        if let Some(t @ TakenPush::Pending(_)) = self.ids.get_mut(&id) {
            *t = if stored {
                TakenPush::Delivered
            } else {
                TakenPush::Unknown
            };
        }
    }

    /// Ids remembered.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
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
            q.submit(i, format!("p{i}"), u64::from(i), msg(i)).unwrap();
        }
        let b1 = q.poll_batch().unwrap();
        assert_eq!(b1.items.len(), 3, "capped at max_batch");
        assert_eq!(q.poll_batch(), None, "one batch out at a time");
        q.submit(5, "p5".into(), 5, msg(5)).unwrap();
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
        let players: Vec<&str> = b2.items.iter().map(|(p, _, _)| p.as_str()).collect();
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
        q.submit(1, "a".into(), 1, msg(1)).unwrap();
        q.submit(2, "b".into(), 2, msg(2)).unwrap();
        assert_eq!(q.submit(3, "c".into(), 3, msg(3)), Err(3));
        let b = q.poll_batch().unwrap();
        q.submit(3, "c".into(), 3, msg(3)).unwrap();
        assert_eq!(
            q.batch_done(b.id, Some(vec![DeliveryResult::Delivered])),
            vec![
                (1, PlayerPushOutcome::Unknown),
                (2, PlayerPushOutcome::Unknown)
            ]
        );
        assert_eq!(q.waiting(), 1);
    }

    #[test]
    fn a_delivered_id_is_a_duplicate_for_its_window_and_never_forgotten_early() {
        let t0 = Instant::now();
        let mut ids = DeliveredPushIds::new(Duration::from_secs(10), 2);
        assert_eq!(ids.check(t0, 7), PushIdCheck::New);
        ids.delivered(t0, 7);
        assert_eq!(
            ids.check(t0 + Duration::from_secs(9), 7),
            PushIdCheck::Duplicate
        );
        assert_eq!(
            ids.check(t0, 0),
            PushIdCheck::New,
            "no id: never a duplicate"
        );
        ids.delivered(t0, 0);
        ids.delivered(t0 + Duration::from_secs(1), 8);
        assert_eq!(
            ids.check(t0 + Duration::from_secs(2), 9),
            PushIdCheck::Full,
            "full: refused, nothing forgotten"
        );
        assert_eq!(
            ids.check(t0 + Duration::from_secs(2), 7),
            PushIdCheck::Duplicate
        );
        assert_eq!(ids.check(t0 + Duration::from_secs(10), 7), PushIdCheck::New);
        assert_eq!(ids.check(t0 + Duration::from_secs(10), 9), PushIdCheck::New);
        assert_eq!(ids.len(), 1, "8 is still remembered");
    }

    /// Regression (2026-12-04, second stop): a copy of a push whose first copy was still
    /// waiting for its session's write-through, or had been answered `unknown` (the write
    /// failed), was answered `delivered`. A copy is answered what the first copy is.
    #[test]
    fn a_copy_is_answered_what_its_first_copy_is() {
        let t0 = Instant::now();
        let mut ids = DeliveredPushIds::new(Duration::from_secs(10), 8);
        ids.pending(t0, 7, 70);
        ids.pending(t0, 8, 80);
        assert_eq!(ids.check(t0, 7), PushIdCheck::Pending(70));
        ids.resolved(7, true);
        ids.resolved(8, false);
        assert_eq!(ids.check(t0, 7), PushIdCheck::Duplicate);
        assert_eq!(ids.check(t0, 8), PushIdCheck::Unknown);
        ids.resolved(8, true);
        assert_eq!(ids.check(t0, 8), PushIdCheck::Unknown, "resolved once");
        ids.unknown(t0, 9);
        assert_eq!(ids.check(t0, 9), PushIdCheck::Unknown);
        ids.delivered(t0, 9);
        assert_eq!(ids.check(t0, 9), PushIdCheck::Unknown, "taken once");
        assert_eq!(
            ids.check(t0 + Duration::from_secs(10), 7),
            PushIdCheck::New,
            "forgotten after the window, whatever became of it"
        );
    }

    proptest! {
        /// Any sequence of pushes with repeated ids, receipts and advancing time: an id is
        /// taken at most once within any window after it was taken, a copy is answered
        /// what its first copy is (delivered, pending, unknown: a model follows it), and
        /// never more than `cap` are remembered.
        #[test]
        fn an_id_is_taken_at_most_once_per_window_and_copies_follow_it(
            steps in proptest::collection::vec((0u64..6, 0u64..4_000, 0u8..5), 1..300),
            cap in 1usize..6,
        ) {
            #[derive(Debug, Clone, Copy, PartialEq)]
            enum Model { Delivered, Pending, Unknown }
            let window = Duration::from_secs(5);
            let t0 = Instant::now();
            let mut now = t0;
            let mut ids = DeliveredPushIds::new(window, cap);
            let mut model: std::collections::HashMap<u64, (Instant, Model)> = Default::default();
            for (id, advance_ms, action) in steps {
                now += Duration::from_millis(advance_ms);
                model.retain(|_, (at, _)| now < *at + window);
                if action >= 3 {
                    // A receipt comes (stored or not) for whatever is pending.
                    ids.resolved(id, action == 3);
                    if let Some((_, m @ Model::Pending)) = model.get_mut(&id) {
                        *m = if action == 3 { Model::Delivered } else { Model::Unknown };
                    }
                    continue;
                }
                let check = ids.check(now, id);
                match (check, model.get(&id).map(|(_, m)| *m)) {
                    (PushIdCheck::New, None) => {
                        if id != 0 {
                            let m = [Model::Delivered, Model::Pending, Model::Unknown][action as usize];
                            model.insert(id, (now, m));
                        }
                        match action {
                            0 => ids.delivered(now, id),
                            1 => ids.pending(now, id, id * 100),
                            _ => ids.unknown(now, id),
                        }
                    }
                    (PushIdCheck::Duplicate, Some(Model::Delivered))
                    | (PushIdCheck::Unknown, Some(Model::Unknown)) => {}
                    (PushIdCheck::Pending(receipt), Some(Model::Pending)) => {
                        prop_assert_eq!(receipt, id * 100);
                    }
                    (PushIdCheck::Full, None) => prop_assert_eq!(ids.len(), cap),
                    (c, m) => prop_assert!(false, "id {} checked {:?}, model {:?}", id, c, m),
                }
                prop_assert!(ids.len() <= cap);
            }
        }

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
                        if q.submit(next, format!("p{next}"), u64::from(next), msg(next)).is_ok() {
                            accepted.push(next);
                        }
                        next += 1;
                        prop_assert!(q.waiting() <= max_waiting);
                    }
                    1 => {
                        if let Some(b) = q.poll_batch() {
                            prop_assert!(out.is_none() && b.items.len() <= max_batch);
                            sent.extend(b.items.iter().map(|(_, _, m)| m.msg_id));
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
                sent.extend(b.items.iter().map(|(_, _, m)| m.msg_id));
                answered.extend(q.batch_done(b.id, None).into_iter().map(|(r, _)| r));
            }
            prop_assert_eq!(&sent, &accepted, "sent in submission order, each once");
            prop_assert_eq!(&answered, &accepted, "answered in order, each once");
        }
    }
}

//! Requests waiting for their answer (PROTOCOL.md §13), sans-IO: the time comes in, the
//! outcomes go out. The driver sends each request as a sequenced DATA and tells this table
//! what happened to it: an answer, an ERROR for its seq, an expiry before it was sent, a
//! new session that voided it, the deadline, the end of the client. Every request leaves the
//! table exactly once, with one outcome.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use bytes::Bytes;
use waygate_protocol::request::Answer;
use waygate_transport::CloseCode;

/// A game server's answer to a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestAnswer {
    /// 0 for success, else the game server's own error code.
    pub status: u16,
    /// The answer's body.
    pub body: Bytes,
}

/// Why a request has no answer. Every request gets either a [`RequestAnswer`] or one of
/// these, exactly once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// No answer within the request's timeout (an answer arriving later is dropped).
    #[error("no answer within {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The edge or the game server refused the request (ERROR: busy, no route...).
    #[error("refused: {code}")]
    Refused {
        /// Why.
        code: CloseCode,
        /// The retry hint.
        retry_after_ms: u32,
    },
    /// Queued while no session was up for longer than `max_offline_age`: never sent.
    #[error("expired before it could be sent")]
    Expired,
    /// The session it was sent in is gone (its resume failed, a new session started):
    /// it may or may not have reached the game server.
    #[error("the session was replaced by a new one")]
    SessionLost,
    /// The client ended (closed, kicked, refused for good) first.
    #[error("the client is closed")]
    Closed,
    /// Not sent: too many messages are unacknowledged (the send buffer is full): retry
    /// later.
    #[error("not sent: the send buffer is full")]
    SendBufferFull,
    /// Not sent: its DATA frame (request id and body) would exceed the max frame size.
    #[error("not sent: a frame of {size} bytes is above the max frame size {max}")]
    TooLarge {
        /// The frame's size.
        size: usize,
        /// The max frame size in force.
        max: usize,
    },
    /// Not sent: a request must be sequenced (critical or normal class).
    #[error("not sent: a request must be critical or normal, not best-effort")]
    NotSequenced,
    /// The answer does not have the expected form (a clock answer that is not 8 bytes of
    /// Unix ms with status 0).
    #[error("unexpected answer: {0}")]
    BadAnswer(String),
}

/// What a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestKind {
    /// The application's own.
    Plain,
    /// A clock sample: sent at this local time (Unix ms) and instant.
    Clock {
        /// Local wall clock when sent, Unix ms.
        sent_unix_ms: u64,
        /// Local monotonic time when sent.
        sent: Instant,
    },
}

/// One request on its way.
#[derive(Debug)]
pub(crate) struct PendingRequest<R> {
    pub(crate) id: u32,
    pub(crate) seq: u64,
    pub(crate) deadline: Instant,
    pub(crate) timeout: Duration,
    pub(crate) kind: RequestKind,
    /// Where the outcome goes (the driver's choice: a waiting caller or an event).
    pub(crate) reply: R,
}

/// The requests waiting for their answer, by id, by seq and by deadline.
#[derive(Debug)]
pub(crate) struct RequestTable<R> {
    by_id: HashMap<u32, PendingRequest<R>>,
    id_by_seq: BTreeMap<u64, u32>,
    deadlines: BTreeMap<(Instant, u32), ()>,
    next_id: u32,
}

impl<R> Default for RequestTable<R> {
    fn default() -> Self {
        Self {
            by_id: HashMap::new(),
            id_by_seq: BTreeMap::new(),
            deadlines: BTreeMap::new(),
            next_id: 1,
        }
    }
}

impl<R> RequestTable<R> {
    /// A request id not in use (never 0), for the next request's header.
    pub(crate) fn next_id(&mut self) -> u32 {
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.checked_add(1).unwrap_or(1);
            if !self.by_id.contains_key(&id) {
                return id;
            }
        }
    }

    /// Tracks request `id`, sent as client seq `seq`, due by `now + timeout`.
    pub(crate) fn insert(
        &mut self,
        id: u32,
        seq: u64,
        now: Instant,
        timeout: Duration,
        kind: RequestKind,
        reply: R,
    ) {
        let deadline = now + timeout;
        self.deadlines.insert((deadline, id), ());
        self.id_by_seq.insert(seq, id);
        self.by_id.insert(
            id,
            PendingRequest {
                id,
                seq,
                deadline,
                timeout,
                kind,
                reply,
            },
        );
    }

    fn remove(&mut self, id: u32) -> Option<PendingRequest<R>> {
        let p = self.by_id.remove(&id)?;
        self.deadlines.remove(&(p.deadline, id));
        self.id_by_seq.remove(&p.seq);
        Some(p)
    }

    /// Forgets request `id` (its caller is gone): no outcome will be delivered for it.
    pub(crate) fn cancel(&mut self, id: u32) -> bool {
        self.remove(id).is_some()
    }

    /// An answer arrived: the request it answers (`None`: unknown or already over, e.g.
    /// timed out: the answer is dropped).
    pub(crate) fn on_answer(
        &mut self,
        answer: Answer,
    ) -> Option<(PendingRequest<R>, RequestAnswer)> {
        let p = self.remove(answer.id)?;
        Some((
            p,
            RequestAnswer {
                status: answer.status,
                body: answer.body,
            },
        ))
    }

    /// An ERROR for client seq `seq`: the request sent with it, if any, is refused.
    pub(crate) fn on_refused(
        &mut self,
        seq: u64,
        code: CloseCode,
        retry_after_ms: u32,
    ) -> Option<(PendingRequest<R>, RequestError)> {
        let id = *self.id_by_seq.get(&seq)?;
        let p = self.remove(id)?;
        Some((
            p,
            RequestError::Refused {
                code,
                retry_after_ms,
            },
        ))
    }

    /// The client session dropped the never-sent messages with these seqs (as they were
    /// numbered before) and moved every later one down by the number dropped before it.
    /// Returns the requests among them; the others keep their seq mapping right.
    pub(crate) fn on_expired(&mut self, expired: &[u64]) -> Vec<(PendingRequest<R>, RequestError)> {
        if expired.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for seq in expired {
            if let Some(&id) = self.id_by_seq.get(seq) {
                if let Some(p) = self.remove(id) {
                    out.push((p, RequestError::Expired));
                }
            }
        }
        let mut sorted = expired.to_vec();
        sorted.sort_unstable();
        let moved: Vec<(u64, u32)> = self
            .id_by_seq
            .range(sorted[0]..)
            .map(|(s, id)| (*s, *id))
            .collect();
        for (seq, _) in &moved {
            self.id_by_seq.remove(seq);
        }
        for (seq, id) in moved {
            let below = sorted.partition_point(|e| *e < seq) as u64;
            let new_seq = seq - below;
            self.id_by_seq.insert(new_seq, id);
            if let Some(p) = self.by_id.get_mut(&id) {
                p.seq = new_seq;
            }
        }
        out
    }

    /// Every request fails with `error` (a new session voided them, or the client ended).
    pub(crate) fn fail_all(
        &mut self,
        error: &RequestError,
    ) -> Vec<(PendingRequest<R>, RequestError)> {
        let ids: Vec<u32> = self.by_id.keys().copied().collect();
        let mut out: Vec<_> = ids
            .into_iter()
            .filter_map(|id| self.remove(id))
            .map(|p| (p, error.clone()))
            .collect();
        out.sort_by_key(|(p, _)| p.seq);
        out
    }

    /// The earliest deadline.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.deadlines.keys().next().map(|(t, _)| *t)
    }

    /// The requests whose deadline is at or before `now`.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<(PendingRequest<R>, RequestError)> {
        let due: Vec<u32> = self
            .deadlines
            .range(..=(now, u32::MAX))
            .map(|((_, id), ())| *id)
            .collect();
        due.into_iter()
            .filter_map(|id| self.remove(id))
            .map(|p| {
                let timeout = p.timeout;
                (p, RequestError::Timeout(timeout))
            })
            .collect()
    }

    /// Requests waiting.
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn answer(id: u32) -> Answer {
        Answer {
            id,
            status: 0,
            body: Bytes::from_static(b"ok"),
        }
    }

    #[test]
    fn each_request_leaves_once_with_its_outcome() {
        let t0 = Instant::now();
        let mut t: RequestTable<&str> = RequestTable::default();
        let (a, b, c, d) = (t.next_id(), t.next_id(), t.next_id(), t.next_id());
        assert_eq!((a, b, c, d), (1, 2, 3, 4));
        let s = Duration::from_secs(1);
        t.insert(a, 10, t0, s, RequestKind::Plain, "a");
        t.insert(b, 11, t0, s * 2, RequestKind::Plain, "b");
        t.insert(c, 12, t0, s * 3, RequestKind::Plain, "c");
        t.insert(d, 13, t0, s * 4, RequestKind::Plain, "d");
        assert_eq!(t.poll_timeout(), Some(t0 + s));
        let (p, ans) = t.on_answer(answer(a)).unwrap();
        assert_eq!((p.reply, ans.status), ("a", 0));
        assert!(t.on_answer(answer(a)).is_none(), "answered once");
        let (p, e) = t.on_refused(11, CloseCode::Busy, 200).unwrap();
        assert_eq!(p.reply, "b");
        assert_eq!(
            e,
            RequestError::Refused {
                code: CloseCode::Busy,
                retry_after_ms: 200
            }
        );
        assert!(
            t.on_refused(99, CloseCode::Busy, 0).is_none(),
            "not a request"
        );
        let timed_out = t.expire(t0 + s * 3);
        assert_eq!(timed_out.len(), 1);
        assert_eq!(timed_out[0].0.reply, "c");
        assert_eq!(timed_out[0].1, RequestError::Timeout(s * 3));
        assert!(t.on_answer(answer(c)).is_none(), "a late answer is dropped");
        // A cancelled request leaves without an outcome; its answer is then unknown.
        let e = t.next_id();
        t.insert(e, 14, t0, s, RequestKind::Plain, "e");
        assert!(t.cancel(e));
        assert!(!t.cancel(e));
        assert!(t.on_answer(answer(e)).is_none());
        let rest = t.fail_all(&RequestError::Closed);
        assert_eq!(rest.len(), 1);
        assert_eq!(t.len(), 0);
        assert_eq!(t.poll_timeout(), None);
    }

    #[test]
    fn expiry_fails_the_expired_and_renumbers_the_rest() {
        let t0 = Instant::now();
        let mut t: RequestTable<u32> = RequestTable::default();
        for (id, seq) in [(1, 3), (2, 5), (3, 6), (4, 8)] {
            t.insert(id, seq, t0, Duration::from_secs(9), RequestKind::Plain, id);
        }
        // Seqs 4, 5 and 6 expired (5 and 6 were requests); 8 becomes 5.
        let failed = t.on_expired(&[4, 5, 6]);
        let ids: Vec<u32> = failed.iter().map(|(p, _)| p.reply).collect();
        assert_eq!(ids, vec![2, 3]);
        assert!(failed.iter().all(|(_, e)| *e == RequestError::Expired));
        assert!(t.on_refused(8, CloseCode::Busy, 0).is_none());
        assert_eq!(t.on_refused(5, CloseCode::Busy, 0).unwrap().0.reply, 4);
        assert_eq!(t.on_refused(3, CloseCode::Busy, 0).unwrap().0.reply, 1);
    }

    proptest! {
        /// Whatever happens, in whatever order, each request leaves exactly once.
        #[test]
        fn every_request_gets_exactly_one_outcome(ops in proptest::collection::vec((0u8..5, 0u32..20), 1..80)) {
            let t0 = Instant::now();
            let mut t: RequestTable<u32> = RequestTable::default();
            let mut outcomes: HashMap<u32, u32> = HashMap::new();
            let mut started = Vec::new();
            let mut seq = 0u64;
            let mut now = t0;
            for (op, x) in ops {
                match op {
                    0 => {
                        seq += 1;
                        let id = t.next_id();
                        t.insert(id, seq, now, Duration::from_millis(u64::from(x) * 10), RequestKind::Plain, id);
                        started.push(id);
                    }
                    1 => if let Some((p, _)) = t.on_answer(answer(x)) { *outcomes.entry(p.reply).or_default() += 1 },
                    2 => if let Some((p, _)) = t.on_refused(u64::from(x), CloseCode::Busy, 0) { *outcomes.entry(p.reply).or_default() += 1 },
                    3 => {
                        now += Duration::from_millis(u64::from(x) * 7);
                        for (p, _) in t.expire(now) { *outcomes.entry(p.reply).or_default() += 1 }
                    }
                    // The newest message expires (as the session does it: the seqs after
                    // it, none here, move down and the next send reuses its seq).
                    _ => if seq > 0 {
                        for (p, _) in t.on_expired(&[seq]) { *outcomes.entry(p.reply).or_default() += 1 }
                        seq -= 1;
                    },
                }
            }
            for (p, _) in t.fail_all(&RequestError::Closed) { *outcomes.entry(p.reply).or_default() += 1 }
            prop_assert_eq!(t.len(), 0);
            for id in started {
                prop_assert_eq!(outcomes.get(&id).copied(), Some(1), "request {}", id);
            }
        }
    }
}

//! The downstream replay buffer (SPEC S4): sequenced server->client messages kept until the
//! client's cumulative ack covers them, bounded by count and bytes. Overflow evicts the
//! oldest entries and remembers how far it evicted, so a restore that would need them is
//! reported as a gap instead of pretending nothing was lost.

use std::collections::VecDeque;

use bytes::Bytes;
use waygate_transport::TrafficClass;

/// Bounds of one session's replay buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplayLimits {
    /// Most messages kept.
    pub max_messages: usize,
    /// Most payload bytes kept.
    pub max_bytes: usize,
}

impl Default for ReplayLimits {
    fn default() -> Self {
        Self {
            max_messages: 1024,
            max_bytes: 1024 * 1024,
        }
    }
}

/// One sequenced downstream message.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplayEntry {
    /// Its per-session seq.
    pub seq: u64,
    /// Critical or normal (best-effort is never buffered).
    pub class: TrafficClass,
    /// Application message id.
    pub msg_id: u32,
    /// Body.
    pub payload: Bytes,
}

/// The client acked a seq the server never sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("ack {ack} is beyond the highest sent seq {highest}")]
pub struct AckBeyondSent {
    /// The ack received.
    pub ack: u64,
    /// The highest seq assigned so far.
    pub highest: u64,
}

/// What changed in a replay buffer between two snapshots ([`ReplayBuffer::delta_since`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayDelta<'a> {
    /// Seqs the earlier buffer held and the later one does not, in order.
    pub dropped: Vec<u64>,
    /// Entries the later buffer holds and the earlier one did not, in order.
    pub added: Vec<&'a ReplayEntry>,
}

/// A replay buffer's counters: what changes with every message besides its entries (a
/// store that keeps the rest of a snapshot apart writes these on every write).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplayCounters {
    /// The next seq to assign.
    pub next_seq: u64,
    /// Highest cumulative ack received.
    pub acked: u64,
    /// Highest seq evicted before it was acked.
    pub evicted_through: u64,
    /// Payload bytes held.
    pub bytes: usize,
}

/// Entries a store kept apart do not fit the rest of its record ([`ReplayBuffer::attach_entries`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{entries} replay entries ({bytes} bytes) do not match the buffer they were kept for")]
pub struct ReplayMismatch {
    /// Entries offered.
    pub entries: usize,
    /// Their payload bytes.
    pub bytes: usize,
}

/// Where replay resumes after a restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestorePoint {
    /// WELCOME's `server_seq_base`: replay starts at `base + 1`.
    pub base: u64,
    /// Messages the client never received were evicted: it must resync.
    pub gap: bool,
}

/// Sequenced downstream messages awaiting the client's ack.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplayBuffer {
    limits: ReplayLimits,
    entries: VecDeque<ReplayEntry>,
    bytes: usize,
    next_seq: u64,
    acked: u64,
    evicted_through: u64,
}

impl ReplayBuffer {
    /// An empty buffer; the first seq assigned is 1.
    pub fn new(limits: ReplayLimits) -> Self {
        Self {
            limits,
            entries: VecDeque::new(),
            bytes: 0,
            next_seq: 1,
            acked: 0,
            evicted_through: 0,
        }
    }

    /// Assigns the next seq to a message and keeps it. Returns the seq and how many older
    /// unacked messages were evicted to stay within bounds.
    pub fn push(&mut self, class: TrafficClass, msg_id: u32, payload: Bytes) -> (u64, usize) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.bytes += payload.len();
        self.entries.push_back(ReplayEntry {
            seq,
            class,
            msg_id,
            payload,
        });
        let mut evicted = 0;
        while self.entries.len() > self.limits.max_messages || self.bytes > self.limits.max_bytes {
            let Some(old) = self.entries.pop_front() else {
                break;
            };
            self.bytes -= old.payload.len();
            self.evicted_through = self.evicted_through.max(old.seq);
            evicted += 1;
        }
        (seq, evicted)
    }

    /// Declares `count` messages that never got here lost: they take the next seqs, and
    /// everything unacknowledged is dropped with them (`evicted_through` = the last of
    /// them), so any restore from below that seq reports a gap.
    pub fn declare_lost(&mut self, count: u64) {
        if count == 0 {
            return;
        }
        self.next_seq += count;
        self.evicted_through = self.next_seq - 1;
        self.entries.clear();
        self.bytes = 0;
    }

    /// Applies a cumulative ack: frees every entry `<= ack`. Lower acks than before are
    /// ignored; an ack beyond what was sent is an error (the buffer is unchanged).
    pub fn ack(&mut self, ack: u64) -> Result<usize, AckBeyondSent> {
        self.ack_visit(ack, |_| {})
    }

    /// [`ack`](Self::ack), showing `freed` every entry it frees, in seq order.
    pub fn ack_visit(
        &mut self,
        ack: u64,
        mut freed_entry: impl FnMut(&ReplayEntry),
    ) -> Result<usize, AckBeyondSent> {
        if ack > self.highest_sent() {
            return Err(AckBeyondSent {
                ack,
                highest: self.highest_sent(),
            });
        }
        if ack <= self.acked {
            return Ok(0);
        }
        self.acked = ack;
        let mut freed = 0;
        while self.entries.front().is_some_and(|e| e.seq <= ack) {
            if let Some(e) = self.entries.pop_front() {
                self.bytes -= e.payload.len();
                freed += 1;
                freed_entry(&e);
            }
        }
        if self.entries.is_empty() {
            // All acknowledged: an idle session holds no buffer (performance issue, W4).
            self.entries = VecDeque::new();
        }
        Ok(freed)
    }

    /// Computes the restore point for a client whose last received seq is `client_last`
    /// (also applied as an ack).
    pub fn restore_point(&mut self, client_last: u64) -> Result<RestorePoint, AckBeyondSent> {
        self.restore_point_visit(client_last, |_| {})
    }

    /// [`restore_point`](Self::restore_point), showing `freed_entry` what its ack frees.
    pub fn restore_point_visit(
        &mut self,
        client_last: u64,
        freed_entry: impl FnMut(&ReplayEntry),
    ) -> Result<RestorePoint, AckBeyondSent> {
        self.ack_visit(client_last, freed_entry)?;
        let client_last = client_last.max(self.acked);
        Ok(if client_last < self.evicted_through {
            RestorePoint {
                base: self.evicted_through,
                gap: true,
            }
        } else {
            RestorePoint {
                base: client_last,
                gap: false,
            }
        })
    }

    /// Every buffered entry, in seq order.
    pub fn entries(&self) -> impl DoubleEndedIterator<Item = &ReplayEntry> + ExactSizeIterator {
        self.entries.iter()
    }

    /// What changed since `earlier`, a copy of this buffer taken before (an older snapshot
    /// of the same session): the seqs it held that this one no longer holds (acked,
    /// evicted or declared lost) and the entries this one added. A store that holds
    /// `earlier`'s entries holds this buffer's after dropping and adding those
    /// (write-through deltas): the cost of a write is what changed, never the whole buffer.
    pub fn delta_since<'a>(&'a self, earlier: &ReplayBuffer) -> ReplayDelta<'a> {
        // Both hold contiguous seqs (pushes take the next seq; acks and evictions pop
        // the front; a declared loss empties the buffer first).
        let held = |b: &ReplayBuffer, seq: u64| {
            b.entries
                .front()
                .zip(b.entries.back())
                .is_some_and(|(first, last)| first.seq <= seq && seq <= last.seq)
        };
        ReplayDelta {
            dropped: earlier
                .entries
                .iter()
                .map(|e| e.seq)
                .filter(|&seq| !held(self, seq))
                .collect(),
            added: self
                .entries
                .iter()
                .filter(|e| !held(earlier, e.seq))
                .collect(),
        }
    }

    /// The counters (see [`ReplayCounters`]).
    pub fn counters(&self) -> ReplayCounters {
        ReplayCounters {
            next_seq: self.next_seq,
            acked: self.acked,
            evicted_through: self.evicted_through,
            bytes: self.bytes,
        }
    }

    /// Sets counters a store kept apart; [`attach_entries`](Self::attach_entries) then
    /// checks the entries against them.
    pub fn set_counters(&mut self, c: ReplayCounters) {
        self.next_seq = c.next_seq;
        self.acked = c.acked;
        self.evicted_through = c.evicted_through;
        self.bytes = c.bytes;
    }

    /// Takes the entries out (what a store keeps apart from the rest of the snapshot);
    /// [`attach_entries`](Self::attach_entries) puts them back.
    pub fn detach_entries(&mut self) -> VecDeque<ReplayEntry> {
        std::mem::take(&mut self.entries)
    }

    /// Puts back entries a store kept apart, in any order. They must be exactly what the
    /// buffer held when they were detached — every seq above both the ack and the last
    /// eviction up to the highest sent (a buffer always holds exactly those), and the byte
    /// count it recorded; otherwise the buffer is unchanged and the store's record is
    /// corrupt.
    pub fn attach_entries(
        &mut self,
        entries: impl IntoIterator<Item = ReplayEntry>,
    ) -> Result<(), ReplayMismatch> {
        let mut entries: Vec<ReplayEntry> = entries.into_iter().collect();
        entries.sort_unstable_by_key(|e| e.seq);
        let bytes: usize = entries.iter().map(|e| e.payload.len()).sum();
        if !self.entries.is_empty() || !self.holds_exactly(&entries) || bytes != self.bytes {
            return Err(ReplayMismatch {
                entries: entries.len(),
                bytes,
            });
        }
        self.entries = entries.into();
        Ok(())
    }

    /// Buffered entries with seq above `after`, in order (what a restore replays).
    pub fn entries_after(&self, after: u64) -> impl Iterator<Item = &ReplayEntry> {
        self.entries.iter().filter(move |e| e.seq > after)
    }

    /// Highest seq assigned so far (0 before the first).
    pub fn highest_sent(&self) -> u64 {
        self.next_seq.saturating_sub(1)
    }

    /// Whether the buffer holds what a buffer always holds (a record read from a store may
    /// not: corrupt, or written by something else): seqs in range, every seq above both the
    /// ack and the last eviction up to the highest sent, the byte count theirs, limits
    /// not zero. A restore of a buffer that does not would overflow its seqs or byte count.
    pub fn check(&self) -> Result<(), ReplayMismatch> {
        let bytes: usize = self.entries.iter().map(|e| e.payload.len()).sum();
        let mismatch = ReplayMismatch {
            entries: self.entries.len(),
            bytes,
        };
        // Seqs far below the top, so `+ 1` never overflows anywhere.
        const TOP: u64 = u64::MAX / 2;
        if self.next_seq == 0
            || self.next_seq > TOP
            || self.acked >= self.next_seq
            || self.evicted_through >= self.next_seq
            || bytes != self.bytes
            || self.limits.max_messages == 0
            || self.limits.max_bytes == 0
        {
            return Err(mismatch);
        }
        if self.holds_exactly(&self.entries) {
            Ok(())
        } else {
            Err(mismatch)
        }
    }

    /// Whether `entries` (in seq order) are exactly what the counters say a buffer holds:
    /// every seq above both the ack and the last eviction up to the highest sent. Any
    /// counters (a record read from a store) are taken without overflow.
    fn holds_exactly<'a>(&self, entries: impl IntoIterator<Item = &'a ReplayEntry>) -> bool {
        let Some(first) = self.acked.max(self.evicted_through).checked_add(1) else {
            return false;
        };
        let mut count = 0u64;
        for (e, seq) in entries.into_iter().zip(first..) {
            if e.seq != seq {
                return false;
            }
            count += 1;
        }
        count == self.next_seq.saturating_sub(first)
    }

    /// Highest cumulative ack received.
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// Highest seq evicted before it was acked (0 = never overflowed).
    pub fn evicted_through(&self) -> u64 {
        self.evicted_through
    }

    /// Messages held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Payload bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(n: usize) -> Bytes {
        Bytes::from(vec![0u8; n])
    }

    /// Messages that never reached the buffer take seqs and make every restore from below
    /// them a gap; later messages continue after them.
    #[test]
    fn declared_losses_take_seqs_and_report_a_gap() {
        let mut r = ReplayBuffer::new(ReplayLimits::default());
        r.push(TrafficClass::Normal, 1, p(3));
        r.push(TrafficClass::Normal, 1, p(3));
        r.declare_lost(3);
        assert_eq!(r.highest_sent(), 5);
        assert_eq!(r.entries_after(0).count(), 0);
        assert_eq!(r.push(TrafficClass::Normal, 1, p(3)).0, 6);
        let point = r.restore_point(1).expect("within sent");
        assert!(point.gap);
        assert_eq!(point.base, 5);
        assert_eq!(
            r.entries_after(point.base)
                .map(|e| e.seq)
                .collect::<Vec<_>>(),
            [6]
        );
        r.declare_lost(0);
        assert_eq!(r.highest_sent(), 6, "nothing lost, nothing changes");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(usize),
        Ack(u64),
        Lose(u64),
        /// Keep a copy here: deltas are checked between every two copies.
        Copy,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0usize..40).prop_map(Op::Push),
            2 => (0u64..6).prop_map(Op::Ack),
            1 => (0u64..3).prop_map(Op::Lose),
            2 => Just(Op::Copy),
        ]
    }

    proptest::proptest! {
        /// A store that holds an earlier copy's entries and applies the delta holds the
        /// later copy's entries exactly, whatever happened in between (pushes, acks,
        /// evictions by count and bytes, declared losses); detached entries attach back.
        #[test]
        fn a_delta_turns_an_earlier_copy_into_a_later_one(
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let mut r = ReplayBuffer::new(ReplayLimits { max_messages: 5, max_bytes: 100 });
            let mut copies = vec![r.clone()];
            for op in ops {
                match op {
                    Op::Push(n) => {
                        r.push(TrafficClass::Normal, n as u32, Bytes::from(vec![n as u8; n]));
                    }
                    Op::Ack(back) => {
                        let _ = r.ack(r.highest_sent().saturating_sub(back));
                    }
                    Op::Lose(n) => r.declare_lost(n),
                    Op::Copy => copies.push(r.clone()),
                }
            }
            copies.push(r);
            for (i, earlier) in copies.iter().enumerate() {
                for later in &copies[i..] {
                    let delta = later.delta_since(earlier);
                    let mut held: std::collections::BTreeMap<u64, ReplayEntry> =
                        earlier.entries().map(|e| (e.seq, e.clone())).collect();
                    for seq in &delta.dropped {
                        proptest::prop_assert!(held.remove(seq).is_some(), "dropped {} not held", seq);
                    }
                    for e in &delta.added {
                        proptest::prop_assert!(held.insert(e.seq, (*e).clone()).is_none());
                    }
                    let want: Vec<ReplayEntry> = later.entries().cloned().collect();
                    proptest::prop_assert_eq!(held.into_values().collect::<Vec<_>>(), want.clone());
                    let mut bare = later.clone();
                    let detached: Vec<ReplayEntry> = bare.detach_entries().into_iter().collect();
                    if !detached.is_empty() {
                        // One entry short, at either end, never attaches.
                        let mut short = bare.clone();
                        proptest::prop_assert!(short.attach_entries(detached[1..].iter().cloned()).is_err());
                        let n = detached.len() - 1;
                        proptest::prop_assert!(short.attach_entries(detached[..n].iter().cloned()).is_err());
                    }
                    proptest::prop_assert!(bare.attach_entries(detached.into_iter().rev()).is_ok());
                    proptest::prop_assert_eq!(&bare, later);
                    proptest::prop_assert!(later.check().is_ok(), "a real buffer checks");
                }
            }
        }
    }

    /// Panic audit: a record read from a store with counters no buffer could have (next
    /// seq 0 or at the top of the range, an ack beyond it, a byte count not its entries')
    /// overflowed seqs or byte counts on restore. `check` refuses it before.
    #[test]
    fn counters_no_buffer_could_have_are_refused() {
        let mut r = ReplayBuffer::new(ReplayLimits::default());
        r.push(TrafficClass::Normal, 1, Bytes::from_static(b"abc"));
        assert!(r.check().is_ok());
        let good = r.counters();
        for bad in [
            ReplayCounters {
                next_seq: 0,
                ..good
            },
            ReplayCounters {
                next_seq: u64::MAX,
                ..good
            },
            ReplayCounters {
                acked: u64::MAX,
                ..good
            },
            ReplayCounters {
                evicted_through: 2,
                ..good
            },
            ReplayCounters { bytes: 1, ..good },
        ] {
            let mut corrupt = r.clone();
            corrupt.set_counters(bad);
            assert!(corrupt.check().is_err(), "{bad:?}");
            // The way a store reads it back: counters first, then the entries attached
            // (review: `attach_entries` overflowed on such counters before `check` ran).
            let entries = corrupt.detach_entries();
            let _ = corrupt.attach_entries(entries);
        }
    }

    #[test]
    fn seqs_start_at_one_and_acks_free() {
        let mut r = ReplayBuffer::new(ReplayLimits::default());
        assert_eq!(r.push(TrafficClass::Normal, 1, p(3)).0, 1);
        assert_eq!(r.push(TrafficClass::Critical, 1, p(3)).0, 2);
        assert_eq!(r.push(TrafficClass::Normal, 1, p(3)).0, 3);
        assert_eq!(r.bytes(), 9);
        assert_eq!(r.ack(2), Ok(2));
        assert_eq!(r.ack(1), Ok(0));
        assert_eq!(r.len(), 1);
        assert_eq!(r.ack(4), Err(AckBeyondSent { ack: 4, highest: 3 }));
        assert_eq!(
            r.entries_after(0).map(|e| e.seq).collect::<Vec<_>>(),
            vec![3]
        );
    }

    #[test]
    fn overflow_by_count_and_bytes_marks_a_gap() {
        let mut r = ReplayBuffer::new(ReplayLimits {
            max_messages: 3,
            max_bytes: 100,
        });
        for _ in 0..5 {
            r.push(TrafficClass::Normal, 1, p(10));
        }
        assert_eq!(r.len(), 3);
        assert_eq!(r.evicted_through(), 2);
        assert_eq!(
            r.clone().restore_point(1),
            Ok(RestorePoint { base: 2, gap: true })
        );
        assert_eq!(
            r.clone().restore_point(2),
            Ok(RestorePoint {
                base: 2,
                gap: false
            })
        );
        let (_, evicted) = r.push(TrafficClass::Normal, 1, p(95));
        assert_eq!(evicted, 3, "bytes bound evicts until under 100");
        assert_eq!(r.evicted_through(), 5);
        assert!(r.restore_point(7).is_err());
    }
}

//! Sequence bookkeeping shared by the server machine and the client counterpart (SPEC S4,
//! S4a): a receive window that de-duplicates by sequence number and reports the cumulative
//! ack, and the ack policy (piggyback, or a standalone ACK after a delay or N messages).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// How far above the cumulative ack a sequence number may arrive (out of order across
/// traffic classes, e.g. QUIC streams). Beyond it the peer is misbehaving.
pub const DEFAULT_RECV_WINDOW: u64 = 4096;

/// What [`RecvWindow::receive`] decided about one sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// First time seen: deliver it.
    New,
    /// Seen before (a resend after a reconnect): drop it.
    Duplicate,
    /// Zero, or too far ahead of the cumulative ack: a protocol violation.
    OutOfWindow,
}

/// Received sequence numbers of one direction: everything `<= cumulative` arrived, plus a
/// sparse set above it (classes travel on separate streams and may interleave).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RecvWindow {
    cumulative: u64,
    above: BTreeSet<u64>,
}

impl RecvWindow {
    /// A window that has received nothing yet (the first seq is 1).
    pub fn new() -> Self {
        Self::default()
    }

    /// A window whose first `base` seqs count as received.
    pub fn starting_at(base: u64) -> Self {
        Self {
            cumulative: base,
            above: BTreeSet::new(),
        }
    }

    /// Highest seq with every seq up to it received.
    pub fn cumulative(&self) -> u64 {
        self.cumulative
    }

    /// Number of seqs held above the cumulative ack.
    pub fn pending_above(&self) -> usize {
        self.above.len()
    }

    /// Whether the window is one a receiver could have built (a record read from a store
    /// may not be): the cumulative ack far below the top of the range, and every seq held
    /// above it within the window.
    pub fn is_consistent(&self) -> bool {
        self.cumulative <= u64::MAX / 2
            && self.above.first().is_none_or(|&s| s > self.cumulative + 1)
            && self
                .above
                .last()
                .is_none_or(|&s| s <= self.cumulative + DEFAULT_RECV_WINDOW)
    }

    /// Whether `seq` was received.
    pub fn contains(&self, seq: u64) -> bool {
        seq <= self.cumulative || self.above.contains(&seq)
    }

    /// What [`RecvWindow::receive`] would decide about `seq`, without recording it.
    pub fn check(&self, seq: u64) -> Received {
        if seq == 0 || seq > self.cumulative.saturating_add(DEFAULT_RECV_WINDOW) {
            Received::OutOfWindow
        } else if self.contains(seq) {
            Received::Duplicate
        } else {
            Received::New
        }
    }

    /// Records `seq` arriving.
    pub fn receive(&mut self, seq: u64) -> Received {
        if seq == 0 || seq > self.cumulative.saturating_add(DEFAULT_RECV_WINDOW) {
            return Received::OutOfWindow;
        }
        if seq <= self.cumulative || !self.above.insert(seq) {
            return Received::Duplicate;
        }
        self.advance();
        Received::New
    }

    /// Declares everything up to `base` received (after a gap: the server skipped seqs).
    /// Any `base` a peer sends is taken without overflow (one at `u64::MAX` makes every
    /// later seq a duplicate: the peer's fault, never a panic).
    pub fn skip_to(&mut self, base: u64) {
        if base > self.cumulative {
            self.cumulative = base;
            self.above.retain(|&seq| seq > base);
            self.advance();
        }
    }

    /// Moves the cumulative ack over the seqs held just above it.
    fn advance(&mut self) {
        while let Some(next) = self.cumulative.checked_add(1) {
            if !self.above.remove(&next) {
                break;
            }
            self.cumulative = next;
        }
    }
}

/// When to acknowledge: piggyback the cumulative ack on outgoing DATA; otherwise send a
/// standalone ACK once `max_unacked` messages are unacknowledged or `delay` has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckPolicy {
    /// Longest an ack may wait for a DATA frame to ride on.
    pub delay: Duration,
    /// Send an ACK at once after this many unacknowledged messages.
    pub max_unacked: u32,
}

impl Default for AckPolicy {
    fn default() -> Self {
        Self {
            delay: Duration::from_millis(20),
            max_unacked: 16,
        }
    }
}

/// The pending-ack state of one direction.
#[derive(Debug, Clone, Default)]
pub struct AckState {
    /// The last cumulative value we told the peer.
    sent: u64,
    /// Messages counted towards an ACK at once: received ones (the client), answered ones
    /// (the edge, PROTOCOL.md §7.4.2).
    unacked: u32,
    /// Something arrived since the last ack (an ack is owed within the delay).
    owed: bool,
    deadline: Option<Instant>,
}

impl AckState {
    /// A message (new or duplicate) arrived: an ack is owed. Returns whether one is due now.
    pub fn on_receive(&mut self, now: Instant, policy: &AckPolicy) -> bool {
        self.unacked = self.unacked.saturating_add(1);
        if self.deadline.is_none() {
            self.deadline = Some(now + policy.delay);
        }
        self.unacked >= policy.max_unacked
    }

    /// A message arrived that counts only once answered (the edge's upstream, PROTOCOL.md
    /// §7.4.2): an ack is owed within the delay all the same — it tells the client the
    /// link is alive — but it counts towards an ack at once when answered.
    pub fn on_receive_unanswered(&mut self, now: Instant, policy: &AckPolicy) {
        self.owed = true;
        if self.deadline.is_none() {
            self.deadline = Some(now + policy.delay);
        }
    }

    /// A message received earlier was answered: owed within the delay, and counted towards
    /// an ack at once. Returns whether one is due now.
    pub fn on_answer(&mut self, now: Instant, policy: &AckPolicy) -> bool {
        self.on_receive(now, policy)
    }

    /// The ack to piggyback on an outgoing DATA frame (always the cumulative value; clears
    /// the pending ack).
    pub fn piggyback(&mut self, cumulative: u64) -> Option<u64> {
        self.on_sent(cumulative);
        Some(cumulative)
    }

    /// Records that `cumulative` was sent to the peer.
    pub fn on_sent(&mut self, cumulative: u64) {
        self.sent = self.sent.max(cumulative);
        self.unacked = 0;
        self.owed = false;
        self.deadline = None;
    }

    /// Whether the peer is owed an ack (something arrived since the last one we sent).
    pub fn pending(&self, cumulative: u64) -> bool {
        self.unacked > 0 || self.owed || cumulative > self.sent
    }

    /// When a standalone ACK is due.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether a standalone ACK is due at `now`.
    pub fn due(&self, now: Instant, policy: &AckPolicy) -> bool {
        self.unacked >= policy.max_unacked || self.deadline.is_some_and(|d| now >= d)
    }

    /// Forgets the pending ack (a new connection starts clean; WELCOME carries the value).
    pub fn reset(&mut self, cumulative: u64) {
        self.on_sent(cumulative);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_dedups_out_of_order_and_advances() {
        let mut w = RecvWindow::new();
        assert_eq!(w.receive(0), Received::OutOfWindow);
        assert_eq!(w.receive(2), Received::New);
        assert_eq!(w.cumulative(), 0);
        assert_eq!(w.receive(2), Received::Duplicate);
        assert_eq!(w.receive(1), Received::New);
        assert_eq!(w.cumulative(), 2);
        assert_eq!(w.receive(1), Received::Duplicate);
        assert_eq!(
            w.receive(2 + DEFAULT_RECV_WINDOW + 1),
            Received::OutOfWindow
        );
        assert_eq!(w.receive(5), Received::New);
        w.skip_to(4);
        assert_eq!(w.cumulative(), 5);
        assert_eq!(w.pending_above(), 0);
    }

    /// Panic audit: a WELCOME whose `server_seq_base` is at the top of the range (a
    /// hostile edge) overflowed `base + 1` (a panic in debug builds, the client's task
    /// gone); seqs near the top the same. Taken without overflow now.
    #[test]
    fn seqs_at_the_top_of_the_range_never_overflow() {
        let mut w = RecvWindow::new();
        w.skip_to(u64::MAX);
        assert_eq!(w.cumulative(), u64::MAX);
        assert_eq!(w.receive(u64::MAX), Received::Duplicate);
        let mut w = RecvWindow::starting_at(u64::MAX - 2);
        assert_eq!(w.receive(u64::MAX), Received::New);
        assert_eq!(w.receive(u64::MAX - 1), Received::New);
        assert_eq!(w.cumulative(), u64::MAX);
        let mut w = RecvWindow::starting_at(u64::MAX - 3);
        assert_eq!(w.receive(u64::MAX), Received::New);
        w.skip_to(u64::MAX - 1);
        assert_eq!(w.cumulative(), u64::MAX);
        assert_eq!(w.pending_above(), 0);
        assert!(!w.is_consistent(), "not a window a store may hand back");
        let mut w = RecvWindow::starting_at(10);
        assert!(w.is_consistent());
        w.receive(12);
        assert!(w.is_consistent());
    }

    #[test]
    fn ack_policy_by_count_and_delay() {
        let p = AckPolicy {
            delay: Duration::from_millis(20),
            max_unacked: 3,
        };
        let t0 = Instant::now();
        let mut a = AckState::default();
        assert!(!a.on_receive(t0, &p));
        assert!(!a.due(t0 + Duration::from_millis(19), &p));
        assert!(a.due(t0 + Duration::from_millis(20), &p));
        assert!(!a.on_receive(t0, &p));
        assert!(a.on_receive(t0, &p));
        assert_eq!(a.piggyback(3), Some(3));
        assert_eq!(a.deadline(), None);
        assert!(!a.due(t0 + Duration::from_secs(1), &p));
    }
}

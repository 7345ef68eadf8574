//! The order of one session's messages to one service across a route change or a moved
//! binding (PROTOCOL.md §9.5): a plain rule, driven by the forwarding path (`upstream`) and
//! the backends' answers (`downstream`), with no clock and no I/O.
//!
//! A message forwarded under an older route table can still be refused `stale_epoch` and
//! routed again; one forwarded to another instance of the service can still be running
//! there. A newer message of the session to that service, sent at once under the newer
//! table or to the new instance, would overtake it. So a sequenced message waits while the
//! session has an unanswered message to the same service forwarded under an older epoch or
//! to another instance; it goes once those are answered (FORWARD_DONE, a refusal) or routed
//! again to where it goes. Messages to one instance under one epoch are pipelined as
//! before: the backend handles a session's messages one at a time, in order.
//!
//! Services are named as the message id names them (the canary may serve one from another
//! service). Every sequenced message is checked; only answered forwards are tracked (a
//! sequenced message on a link whose backend sends FORWARD_DONE): nothing would say when
//! any other one is done. Round-robin services are not tracked either (any instance takes
//! any message: there is no order between them to keep). What waits, and for how long, is
//! the shell's business.

use std::net::SocketAddr;
use std::sync::Arc;

/// Unanswered forwards one session may have tracked; a message that would be one more
/// waits for an answer (the shell's hold bound turns a long wait into `busy`).
pub(super) const MAX_UNANSWERED: usize = 4096;

/// Where one forward goes: the service, the instance's address and the table's epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ForwardTarget {
    /// The service (the canary alternate when the canary redirected it).
    pub(super) service: Arc<str>,
    /// The instance's link address.
    pub(super) instance: SocketAddr,
    /// The route table's epoch the forward carries.
    pub(super) epoch: u64,
}

/// What the rule says of a new message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admission {
    /// Forward it now (it is tracked until answered).
    Forward,
    /// An older message of the session to the same service may still be refused and routed
    /// again, or is still running on another instance: wait for an answer.
    Wait,
}

/// One session's unanswered forwards, oldest first.
#[derive(Debug, Default)]
pub(super) struct ForwardOrder {
    unanswered: Vec<(u64, ForwardTarget)>,
}

impl ForwardOrder {
    /// A new message (`client_seq` > 0) about to be forwarded to `to`: forwarded now and
    /// tracked, or told to wait. Admitting a message already tracked moves it.
    pub(super) fn admit(&mut self, client_seq: u64, to: &ForwardTarget) -> Admission {
        if self.check(client_seq, to) == Admission::Wait || !self.track(client_seq, to) {
            return Admission::Wait;
        }
        Admission::Forward
    }

    /// What [`admit`](Self::admit) says of a message that will not be tracked (nothing will
    /// answer it): it still waits behind the unanswered ones, it is not recorded.
    pub(super) fn check(&self, client_seq: u64, to: &ForwardTarget) -> Admission {
        let behind = self.unanswered.iter().any(|(seq, t)| {
            *seq != client_seq
                && t.service == to.service
                && (t.epoch < to.epoch || t.instance != to.instance)
        });
        if behind {
            Admission::Wait
        } else {
            Admission::Forward
        }
    }

    /// A refused message routed again to `to`: it never waits (every message that could
    /// overtake it waits for it), it is tracked where it goes now.
    pub(super) fn rerouted(&mut self, client_seq: u64, to: &ForwardTarget) {
        if !self.track(client_seq, to) {
            // Past the bound (it was answered and forgotten meanwhile): forwarded as a
            // message with nothing tracked behind it, as after a restart.
            tracing::debug!(client_seq, "re-routed message not tracked: bound reached");
        }
    }

    /// The message was answered, refused for good, or not forwarded after all. Whether it
    /// was tracked (a message waiting may now go).
    pub(super) fn settled(&mut self, client_seq: u64) -> bool {
        match self
            .unanswered
            .iter()
            .position(|(seq, _)| *seq == client_seq)
        {
            Some(i) => {
                self.unanswered.remove(i);
                true
            }
            None => false,
        }
    }

    /// Whether nothing is tracked.
    pub(super) fn is_empty(&self) -> bool {
        self.unanswered.is_empty()
    }

    /// Records (or moves) a forward; false when the bound is reached.
    fn track(&mut self, client_seq: u64, to: &ForwardTarget) -> bool {
        if let Some((_, t)) = self.unanswered.iter_mut().find(|(s, _)| *s == client_seq) {
            *t = to.clone();
            return true;
        }
        if self.unanswered.len() >= MAX_UNANSWERED {
            return false;
        }
        self.unanswered.push((client_seq, to.clone()));
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use proptest::prelude::*;

    fn to(service: &str, port: u16, epoch: u64) -> ForwardTarget {
        ForwardTarget {
            service: service.into(),
            instance: SocketAddr::from(([127, 0, 0, 1], port)),
            epoch,
        }
    }

    #[test]
    fn one_instance_under_one_epoch_is_pipelined() {
        let mut o = ForwardOrder::default();
        for seq in 1..=10 {
            assert_eq!(o.admit(seq, &to("player", 1, 1)), Admission::Forward);
        }
        for seq in 1..=10 {
            assert!(o.settled(seq));
        }
        assert!(o.is_empty());
    }

    #[test]
    fn a_newer_epoch_waits_for_the_older_forwards_of_its_service_only() {
        let mut o = ForwardOrder::default();
        assert_eq!(o.admit(1, &to("player", 1, 1)), Admission::Forward);
        assert_eq!(o.admit(2, &to("room", 3, 1)), Admission::Forward);
        // Epoch 2, same instance: seq 1 may still be refused stale and routed again.
        assert_eq!(o.admit(3, &to("player", 1, 2)), Admission::Wait);
        // Another service is not held by the player service's forwards.
        assert_eq!(o.admit(3, &to("chat", 1, 2)), Admission::Forward);
        assert!(o.settled(3));
        // Seq 1 refused stale and routed again under epoch 2: seq 3 may go behind it.
        o.rerouted(1, &to("player", 2, 2));
        assert_eq!(o.admit(3, &to("player", 2, 2)), Admission::Forward);
    }

    #[test]
    fn another_instance_waits_until_the_old_one_answered() {
        let mut o = ForwardOrder::default();
        assert_eq!(o.admit(1, &to("player", 1, 5)), Admission::Forward);
        assert_eq!(o.admit(2, &to("player", 2, 5)), Admission::Wait);
        assert!(o.settled(1));
        assert_eq!(o.admit(2, &to("player", 2, 5)), Admission::Forward);
        assert!(!o.settled(1), "settled once");
    }

    #[test]
    fn an_untracked_message_waits_too_and_is_not_recorded() {
        let mut o = ForwardOrder::default();
        assert_eq!(o.admit(1, &to("player", 1, 1)), Admission::Forward);
        // To a backend that does not answer, under the newer table: it waits all the same.
        assert_eq!(o.check(2, &to("player", 2, 2)), Admission::Wait);
        assert!(o.settled(1));
        assert_eq!(o.check(2, &to("player", 2, 2)), Admission::Forward);
        assert!(o.is_empty(), "nothing recorded for it");
    }

    #[test]
    fn the_bound_makes_a_message_wait() {
        let mut o = ForwardOrder::default();
        for seq in 1..=MAX_UNANSWERED as u64 {
            assert_eq!(o.admit(seq, &to("player", 1, 1)), Admission::Forward);
        }
        let next = MAX_UNANSWERED as u64 + 1;
        assert_eq!(o.admit(next, &to("player", 1, 1)), Admission::Wait);
        assert!(o.settled(1));
        assert_eq!(o.admit(next, &to("player", 1, 1)), Admission::Forward);
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// Admit the next message to (service, instance) under the current epoch.
        Send(u8, u8),
        /// The table moves on.
        NewEpoch,
        /// The oldest unanswered message is answered (or refused for good).
        Answer,
        /// The oldest unanswered message is refused stale and routed again now.
        Reroute(u8),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u8..2, 0u8..3).prop_map(|(s, i)| Step::Send(s, i)),
            1 => Just(Step::NewEpoch),
            3 => Just(Step::Answer),
            1 => (0u8..3).prop_map(Step::Reroute),
        ]
    }

    proptest! {
        /// Whatever the answers, reroutes and table changes: a message is forwarded only
        /// when every unanswered message of its service went to the same instance under an
        /// epoch no newer (safety), and always when its service has nothing unanswered
        /// (it never waits for nothing).
        #[test]
        fn a_forward_never_overtakes_an_unanswered_one(steps in prop::collection::vec(step(), 1..200)) {
            let mut o = ForwardOrder::default();
            let mut epoch = 1u64;
            let mut next_seq = 1u64;
            // What was forwarded and not yet answered, oldest first.
            let mut unanswered: Vec<(u64, ForwardTarget)> = Vec::new();
            for s in steps {
                match s {
                    Step::Send(svc, inst) => {
                        let t = to(["player", "room"][svc as usize], 10 + inst as u16, epoch);
                        let forwarded = o.admit(next_seq, &t) == Admission::Forward;
                        let same_service = unanswered.iter().filter(|(_, m)| m.service == t.service);
                        if forwarded {
                            for (_, m) in same_service {
                                prop_assert!(m.epoch <= t.epoch && m.instance == t.instance,
                                    "{:?} overtakes {:?}", t, m);
                            }
                            unanswered.push((next_seq, t));
                            next_seq += 1;
                        } else {
                            prop_assert!(same_service.count() > 0, "waits for nothing");
                        }
                    }
                    Step::NewEpoch => epoch += 1,
                    Step::Answer => {
                        if !unanswered.is_empty() {
                            let (seq, _) = unanswered.remove(0);
                            prop_assert!(o.settled(seq));
                        }
                    }
                    Step::Reroute(inst) => {
                        if let Some((seq, t)) = unanswered.first_mut() {
                            let moved = to(&t.service, 10 + inst as u16, epoch);
                            o.rerouted(*seq, &moved);
                            *t = moved;
                        }
                    }
                }
            }
            for (seq, _) in unanswered {
                prop_assert!(o.settled(seq));
            }
            prop_assert!(o.is_empty());
        }
    }
}

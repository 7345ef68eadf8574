//! Counters of the session layer, exported by the edge as metrics (O1). Plain atomics; the
//! edge reads them with [`SessionCounters::export`].

use std::sync::atomic::{AtomicU64, Ordering};

use crate::machine::State;

const N: usize = State::ALL.len();

macro_rules! named_counters {
    ($( $(#[doc = $doc:literal])* $name:ident ),* $(,)?) => {
        /// Session-layer counters (one instance per edge, shared by every machine).
        #[derive(Debug, Default)]
        pub struct SessionCounters {
            transitions: [[AtomicU64; N]; N],
            $( $(#[doc = $doc])* pub $name: AtomicU64, )*
        }

        impl SessionCounters {
            /// The named counters as `(field name, help, value)`, in declaration order.
            pub fn named(&self) -> Vec<(&'static str, &'static str, u64)> {
                vec![$( (stringify!($name), concat!($($doc),*).trim_ascii(), self.$name.load(Ordering::Relaxed)), )*]
            }

            /// Every counter as `(metric label, value)`: transitions as
            /// `transition{from,to}` and the named counters by field name.
            pub fn export(&self) -> Vec<(String, u64)> {
                let mut out: Vec<(String, u64)> = self
                    .transitions()
                    .into_iter()
                    .map(|(from, to, v)| (format!("transition{{from=\"{}\",to=\"{}\"}}", from.as_str(), to.as_str()), v))
                    .collect();
                out.extend(self.named().into_iter().map(|(name, _, v)| (name.to_owned(), v)));
                out
            }

            /// Every state transition that happened at least once, as `(from, to, count)`.
            pub fn transitions(&self) -> Vec<(State, State, u64)> {
                let mut out = Vec::new();
                for from in State::ALL {
                    for to in State::ALL {
                        let v = self.transition_count(from, to);
                        if v > 0 {
                            out.push((from, to, v));
                        }
                    }
                }
                out
            }
        }
    };
}

named_counters! {
    /// Fresh sessions (no resume asked).
    new_sessions,
    /// Restores without loss.
    restored,
    /// Restores where the replay buffer had overflowed.
    restored_with_gap,
    /// Resume asked, failed, and a new session was created from the auth token.
    restore_failed_new_session,
    /// HELLOs rejected for auth reasons.
    rejected_auth,
    /// HELLOs rejected because the resume token/session was not valid.
    rejected_resume,
    /// HELLOs rejected for other reasons (version, storage).
    rejected_other,
    /// Sessions kicked by a newer login.
    kicked,
    /// Sessions whose linger ran out.
    expired,
    /// Connections detached from a live session (link down).
    detached,
    /// Upstream messages delivered to the router.
    upstream_delivered,
    /// Upstream duplicates dropped (client resends).
    upstream_duplicates,
    /// Best-effort upstream messages dropped while a hard migration held upstream (sequenced
    /// ones are kept by the client and resent to its next edge; best-effort ones are not).
    upstream_best_effort_dropped,
    /// Downstream messages sent live.
    downstream_sent,
    /// Downstream messages replayed after a restore.
    replayed,
    /// Downstream messages evicted from a full replay buffer.
    replay_evicted,
    /// Best-effort downstream messages dropped while detached.
    best_effort_dropped,
    /// Standalone ACK frames sent.
    acks_sent,
    /// Of those, ACKs sent only because a client's message had waited for its answer for
    /// the answer keep-alive (500 ms) with nothing else sent: they keep the client's liveness
    /// rule from calling a live link dead behind a slow backend.
    answer_keepalives,
    /// Frames that violated the protocol.
    protocol_errors,
    /// Frames held back by the per-connection inbound limiter: the connection was not read
    /// until tokens returned (B2; nothing is dropped).
    inbound_paused,
    /// Connections closed with RATE_LIMITED: a frame larger than the inbound byte burst (B2).
    rate_limited,
    /// Connections closed because the client did not read in time (SLOW_CONSUMER, B3).
    slow_consumer,
    /// Best-effort downstream messages shed while a session's queue was congested (B3).
    best_effort_shed,
    /// Sequenced downstream messages a full session queue refused: declared lost in the
    /// session (slow_consumer close, RestoredWithGap on resume), never dropped silently (B3).
    downstream_overflowed,
    /// Downstream messages whose DATA frame could exceed the max frame size (a backend's
    /// push too large for the client): sequenced ones declared lost in the session (CLOSE
    /// frame_too_large, RestoredWithGap on resume), best-effort ones dropped.
    downstream_too_large,
}

impl SessionCounters {
    /// A fresh set of counters.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one transition.
    pub(crate) fn transition(&self, from: State, to: State) {
        self.transitions[from.index()][to.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// How many times `from -> to` happened.
    pub fn transition_count(&self, from: State, to: State) -> u64 {
        self.transitions[from.index()][to.index()].load(Ordering::Relaxed)
    }

    /// Messages through the session layer so far: upstream delivered plus downstream sent
    /// (the load an edge reports).
    pub fn messages(&self) -> u64 {
        Self::get(&self.upstream_delivered).saturating_add(Self::get(&self.downstream_sent))
    }

    /// Sessions in DETACHED right now (entered minus left, from the transition counts).
    pub fn detached_now(&self) -> u64 {
        let entered: u64 = State::ALL
            .iter()
            .map(|&from| self.transition_count(from, State::Detached))
            .sum();
        let left: u64 = State::ALL
            .iter()
            .map(|&to| self.transition_count(State::Detached, to))
            .sum();
        entered.saturating_sub(left)
    }

    /// Adds one to a named counter.
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n` to a named counter.
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads a named counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

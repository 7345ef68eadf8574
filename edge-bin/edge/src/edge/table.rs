//! The edge's table of per-session entries: the backend-side handle and metadata of each
//! session, the keys backends bound with BIND, and the backend links it was opened on.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use rustc_hash::{FxHashMap, FxHashSet};

use waygate_protocol::frame::SessionId;

use waygate_session::machine::Upstream;

use super::forward_order::{Admission, ForwardOrder, ForwardTarget};
use super::Shared;
use crate::link::SessionMeta;

/// Wakes a session's message waiting for its older forwards to be answered.
pub(super) type ForwardWake = Arc<tokio::sync::Notify>;

/// Per-session state the edge keeps beside the session layer. Cloned for every upstream
/// message (the lock is not held while routing), so its parts are shared: a clone is three
/// reference counts, and writers copy on write (`Arc::make_mut`).
#[derive(Debug, Clone)]
pub(super) struct SessionEntry {
    pub(super) meta: Arc<SessionMeta>,
    /// service -> business key, set by backends with BIND.
    pub(super) keys: Arc<HashMap<String, String>>,
    /// Backend addresses this session was opened on.
    pub(super) links: Arc<HashSet<SocketAddr>>,
}

#[derive(Debug, Default)]
pub(super) struct Sessions {
    /// Keyed by session ids (random, made by an edge) and handles (a counter): no client
    /// picks a key, so a fast unkeyed hash (SipHash was ~4% of the edge's CPU per echo).
    pub(super) by_id: FxHashMap<SessionId, SessionEntry>,
    pub(super) by_handle: FxHashMap<u64, SessionId>,
    pub(super) next_handle: u64,
    /// Sessions opened on each backend link (the `backend_sessions` gauge), kept with the
    /// entries' `links` so the gauge never scans the table.
    per_link: HashMap<SocketAddr, i64>,
    /// Sessions here holding each BIND key, (service, key): a room, guild or order nobody
    /// here is in any more is released from the router (its binding stayed for good, one
    /// per room ever played on this edge).
    key_holders: HashMap<(String, String), u32>,
    /// Sessions with answered forwards not yet answered (PROTOCOL.md §9.5): the order rule,
    /// and the wake-up of the message waiting on it. An entry lives only while it tracks
    /// something or someone waits.
    forwards: FxHashMap<SessionId, SessionForwards>,
    /// Sessions quiesced for a hard migration (S8): none of their messages is forwarded
    /// here any more (the client resends what is unanswered to the edge it moves to).
    moving: FxHashSet<SessionId>,
    /// What every new entry starts with, shared (made by the first `open`).
    blank: Option<BlankEntry>,
}

/// The parts every new session's entry starts with, one allocation each for the whole
/// edge rather than per session (performance issue, W4): the attributes sent with
/// SESSION_OPEN (the edge's id), and empty key and link sets, which a session's first
/// write to them copies (`Arc::make_mut`).
#[derive(Debug, Clone)]
struct BlankEntry {
    attrs: Arc<[(String, String)]>,
    keys: Arc<HashMap<String, String>>,
    links: Arc<HashSet<SocketAddr>>,
}

#[derive(Debug, Default)]
struct SessionForwards {
    order: ForwardOrder,
    wake: Option<ForwardWake>,
    /// The session's messages waiting their turn (the first waits on the rule, the others
    /// behind it), oldest first; a task of their own forwards them (`forward_held`), so
    /// the session's task goes on.
    held: std::collections::VecDeque<HeldMessage>,
    /// That task runs: a new message of the session joins `held`.
    holding: bool,
}

/// A message in a session's held line, with when it arrived (it is refused `busy` once it
/// has waited [`ORDER_HOLD_MAX`](super::upstream::ORDER_HOLD_MAX) since then and still may
/// not go).
#[derive(Debug)]
pub(super) struct HeldMessage {
    pub(super) message: Upstream,
    pub(super) arrived: tokio::time::Instant,
}

impl SessionForwards {
    /// Payload bytes waiting in `held` (at most [`MAX_HELD_BYTES`]; summed when a message
    /// joins a line, which exists only while a route change holds one back).
    fn held_bytes(&self) -> usize {
        self.held.iter().map(|h| h.message.payload.len()).sum()
    }

    /// Whether nothing is kept here any more.
    fn is_idle(&self) -> bool {
        self.order.is_empty() && !self.holding && self.held.is_empty()
    }
}

/// Messages one session may have waiting behind the order rule; one more is refused
/// `busy` at once.
pub(super) const MAX_HELD: usize = 1024;

/// Payload bytes one session may have waiting behind the order rule; a message that would
/// pass them is refused `busy` at once (the line keeps whole messages the client already
/// sent: without it a session's line could hold 1,024 full frames).
pub(super) const MAX_HELD_BYTES: usize = 256 * 1024;

/// What the order rule says of a message about to be forwarded ([`Sessions::admit_forward`]).
pub(super) enum Admitted {
    /// Forward it.
    Go,
    /// Wait for the wake-up.
    Wait(ForwardWake),
    /// Send nothing.
    Stopped(Stopped),
}

/// Why no message of a session is forwarded any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stopped {
    /// The session ended here: sent, a message would open it again on the link, for good.
    Gone,
    /// The session moves to another edge (hard migration, S8): a message not forwarded yet
    /// is withdrawn, neither sent nor answered (so not acknowledged): its client resends it
    /// there, where it is forwarded once.
    Moving,
}

/// What became of a message offered to [`Sessions::hold_behind`].
pub(super) enum Held {
    /// Nothing of the session waits: route it now.
    Free(Upstream),
    /// It waits behind the session's waiting messages.
    Queued,
    /// [`MAX_HELD`] wait already: refuse it.
    Full,
}

/// A BIND key (service, key) that no session here holds any more.
pub(super) type ReleasedKey = (String, String);

impl Sessions {
    /// The session's entry, created on first use.
    pub(super) fn open(
        &mut self,
        session_id: &SessionId,
        player: &str,
        edge_id: &str,
    ) -> SessionEntry {
        if let Some(entry) = self.by_id.get(session_id) {
            return entry.clone();
        }
        self.next_handle += 1;
        let handle = self.next_handle;
        let blank = match &self.blank {
            Some(b) if b.attrs.first().is_some_and(|(_, id)| id == edge_id) => b,
            _ => self.blank.insert(BlankEntry {
                attrs: Arc::new([("edge".into(), edge_id.to_string())]),
                keys: Arc::default(),
                links: Arc::default(),
            }),
        };
        let entry = SessionEntry {
            meta: Arc::new(SessionMeta {
                handle,
                session_id: *session_id,
                player_id: player.to_string(),
                fencing: 0,
                attrs: blank.attrs.clone(),
            }),
            keys: blank.keys.clone(),
            links: blank.links.clone(),
        };
        self.by_handle.insert(handle, *session_id);
        self.by_id.insert(*session_id, entry.clone());
        entry
    }

    /// Records that the session was opened on the link at `addr`.
    pub(super) fn add_link(&mut self, session_id: &SessionId, addr: SocketAddr) {
        let Some(en) = self.by_id.get_mut(session_id) else {
            return;
        };
        // Copied only when a session first uses a link, not per message.
        if !en.links.contains(&addr) {
            Arc::make_mut(&mut en.links).insert(addr);
            *self.per_link.entry(addr).or_default() += 1;
        }
    }

    /// Records that the session was closed on the link at `addr`.
    pub(super) fn remove_link(&mut self, session_id: &SessionId, addr: SocketAddr) {
        let Some(en) = self.by_id.get_mut(session_id) else {
            return;
        };
        if en.links.contains(&addr) {
            Arc::make_mut(&mut en.links).remove(&addr);
            self.uncount(addr);
        }
    }

    /// Whether, and why, no message of the session is forwarded any more.
    fn stopped(&self, session_id: &SessionId) -> Option<Stopped> {
        if !self.by_id.contains_key(session_id) {
            Some(Stopped::Gone)
        } else if self.moving.contains(session_id) {
            Some(Stopped::Moving)
        } else {
            None
        }
    }

    /// The session was quiesced for a hard migration: from now on none of its messages is
    /// forwarded here. What waits in its held line is withdrawn at once (returned: the
    /// client resends those messages to the edge it moves to); the message its line's task
    /// holds is withdrawn when that task wakes, which this does.
    pub(super) fn start_moving(&mut self, session_id: &SessionId) -> Vec<Upstream> {
        if !self.by_id.contains_key(session_id) || !self.moving.insert(*session_id) {
            return Vec::new();
        }
        let Some(f) = self.forwards.get_mut(session_id) else {
            return Vec::new();
        };
        if let Some(wake) = &f.wake {
            wake.notify_one();
        }
        f.held.drain(..).map(|h| h.message).collect()
    }

    /// Records the session's BIND keys (service -> key; a service's previous key is
    /// replaced). Returns the keys no session here holds any more.
    pub(super) fn set_keys(
        &mut self,
        session_id: &SessionId,
        keys: impl IntoIterator<Item = (String, String)>,
    ) -> Vec<ReleasedKey> {
        let mut released = Vec::new();
        let Some(en) = self.by_id.get_mut(session_id) else {
            return released;
        };
        for (service, key) in keys {
            if en.keys.get(&service) == Some(&key) {
                continue;
            }
            *self
                .key_holders
                .entry((service.clone(), key.clone()))
                .or_default() += 1;
            if let Some(old) = Arc::make_mut(&mut en.keys).insert(service.clone(), key) {
                unhold(&mut self.key_holders, (service, old), &mut released);
            }
        }
        released
    }

    /// A new message of the session about to be forwarded to `to` (tracked from now on when
    /// `track`: it will be answered), or the wake-up to wait on; nothing is sent for a
    /// session that ended or moves ([`Stopped`]).
    pub(super) fn admit_forward(
        &mut self,
        session_id: &SessionId,
        client_seq: u64,
        to: &ForwardTarget,
        track: bool,
    ) -> Admitted {
        if let Some(stopped) = self.stopped(session_id) {
            return Admitted::Stopped(stopped);
        }
        let f = match (self.forwards.get_mut(session_id), track) {
            (Some(f), _) => f,
            // Nothing unanswered to wait for, nothing to track.
            (None, false) => return Admitted::Go,
            (None, true) => self.forwards.entry(*session_id).or_default(),
        };
        let admission = if track {
            f.order.admit(client_seq, to)
        } else {
            f.order.check(client_seq, to)
        };
        match admission {
            Admission::Forward => Admitted::Go,
            Admission::Wait => Admitted::Wait(f.wake.get_or_insert_with(Default::default).clone()),
        }
    }

    /// A refused message of the session about to be routed again to `to` (tracked there
    /// when `track`); the wake-up of a message that may go now. Nothing is sent for a
    /// session that ended or moves ([`Stopped`]).
    pub(super) fn rerouted_forward(
        &mut self,
        session_id: &SessionId,
        client_seq: u64,
        to: &ForwardTarget,
        track: bool,
    ) -> Result<Option<ForwardWake>, Stopped> {
        if let Some(stopped) = self.stopped(session_id) {
            return Err(stopped);
        }
        if !track {
            return Ok(self.settle_forward(session_id, client_seq));
        }
        let f = self.forwards.entry(*session_id).or_default();
        f.order.rerouted(client_seq, to);
        Ok(f.wake.clone())
    }

    /// A forward of the session answered (or refused, or not sent after all); the wake-up
    /// of a message that may go now.
    pub(super) fn settle_forward(
        &mut self,
        session_id: &SessionId,
        client_seq: u64,
    ) -> Option<ForwardWake> {
        let f = self.forwards.get_mut(session_id)?;
        if !f.order.settled(client_seq) {
            return None;
        }
        let wake = f.wake.clone();
        if f.is_idle() {
            self.forwards.remove(session_id);
        }
        wake
    }

    /// A new message of the session: in line behind its waiting messages if any wait.
    pub(super) fn hold_behind(&mut self, message: Upstream, now: tokio::time::Instant) -> Held {
        match self.forwards.get_mut(&message.session_id) {
            Some(f) if f.holding => {
                let bytes = message.payload.len();
                if f.held.len() >= MAX_HELD || f.held_bytes() + bytes > MAX_HELD_BYTES {
                    return Held::Full;
                }
                f.held.push_back(HeldMessage {
                    message,
                    arrived: now,
                });
                Held::Queued
            }
            _ => Held::Free(message),
        }
    }

    /// `message` (arrived at `now`) waits on the rule (`admit_forward` said so): the
    /// session's messages wait behind it from now on. True when the caller must start the
    /// task that forwards them (none runs yet); false when the session is gone.
    pub(super) fn start_holding(&mut self, message: Upstream, now: tokio::time::Instant) -> bool {
        if !self.by_id.contains_key(&message.session_id) {
            return false;
        }
        let f = self.forwards.entry(message.session_id).or_default();
        let held = HeldMessage {
            message,
            arrived: now,
        };
        if f.holding {
            // A line with its task already: in line behind it (never ahead of older ones).
            f.held.push_back(held);
            return false;
        }
        f.held.push_front(held);
        f.holding = true;
        true
    }

    /// The session's next waiting message, for its task to forward; `None` when none waits
    /// (the session's messages are routed at once again) or the session is gone.
    pub(super) fn next_held(
        &mut self,
        session_id: &SessionId,
    ) -> Option<(HeldMessage, SessionEntry)> {
        let entry = self.by_id.get(session_id).cloned();
        let f = self.forwards.get_mut(session_id)?;
        let next = f.held.pop_front().zip(entry);
        if next.is_none() {
            self.stop_holding(session_id);
        }
        next
    }

    /// Ends the session's held line (its task ends); what still waits in it is returned,
    /// for the caller to answer.
    pub(super) fn stop_holding(&mut self, session_id: &SessionId) -> Vec<Upstream> {
        let Some(f) = self.forwards.get_mut(session_id) else {
            return Vec::new();
        };
        f.holding = false;
        let left = f.held.drain(..).map(|h| h.message).collect();
        if f.is_idle() {
            self.forwards.remove(session_id);
        }
        left
    }

    /// Removes the session's entry; with it, the keys no session here holds any more.
    pub(super) fn remove(
        &mut self,
        session_id: &SessionId,
    ) -> Option<(SessionEntry, Vec<ReleasedKey>)> {
        if let Some(wake) = self.forwards.remove(session_id).and_then(|f| f.wake) {
            wake.notify_one();
        }
        self.moving.remove(session_id);
        let entry = self.by_id.remove(session_id)?;
        self.by_handle.remove(&entry.meta.handle);
        for addr in entry.links.iter() {
            self.uncount(*addr);
        }
        let mut released = Vec::new();
        for (service, key) in entry.keys.iter() {
            unhold(
                &mut self.key_holders,
                (service.clone(), key.clone()),
                &mut released,
            );
        }
        Some((entry, released))
    }

    fn uncount(&mut self, addr: SocketAddr) {
        if let Some(n) = self.per_link.get_mut(&addr) {
            *n -= 1;
            if *n <= 0 {
                self.per_link.remove(&addr);
            }
        }
    }

    /// Sessions opened on the link at `addr`.
    pub(super) fn sessions_on_link(&self, addr: &SocketAddr) -> i64 {
        self.per_link.get(addr).copied().unwrap_or(0)
    }
}

fn unhold(
    holders: &mut HashMap<(String, String), u32>,
    held: (String, String),
    released: &mut Vec<ReleasedKey>,
) {
    if let Some(n) = holders.get_mut(&held) {
        *n -= 1;
        if *n == 0 {
            holders.remove(&held);
            released.push(held);
        }
    }
}

impl Shared {
    /// Releases the router's bindings of BIND keys no session here holds any more: only
    /// for services keyed by room, guild or order (a player's binding is released with its
    /// last session here, `EdgeUpstream`).
    pub(super) fn release_keys(&self, released: Vec<ReleasedKey>) {
        if released.is_empty() {
            return;
        }
        let Ok(mut router) = self.router.lock() else {
            return;
        };
        for (service, key) in released {
            let keyed = router
                .table()
                .and_then(|t| t.service(&service))
                .is_some_and(|s| {
                    matches!(
                        s.key,
                        waygate_routing::KeyKind::Room
                            | waygate_routing::KeyKind::Guild
                            | waygate_routing::KeyKind::Order
                    )
                });
            if keyed {
                router.release(&key, &service);
            }
        }
    }

    pub(super) fn entry(&self, session_id: &SessionId, player: &str) -> SessionEntry {
        let mut e = match self.entries.lock() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        e.open(session_id, player, &self.config.edge_id)
    }

    pub(super) fn session_of_handle(&self, handle: u64) -> Option<SessionId> {
        self.entries.lock().ok()?.by_handle.get(&handle).copied()
    }

    /// Live sessions with their ownership: (player, session, fencing).
    pub(super) fn owned_sessions(&self) -> Vec<(String, SessionId, u64)> {
        self.entries
            .lock()
            .map(|e| {
                e.by_id
                    .values()
                    .filter(|en| en.meta.fencing > 0)
                    .map(|en| {
                        (
                            en.meta.player_id.clone(),
                            en.meta.session_id,
                            en.meta.fencing,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn upstream(sid: SessionId, seq: u64, bytes: usize) -> Upstream {
        Upstream {
            session_id: sid,
            player_id: "p".into(),
            class: waygate_transport::TrafficClass::Normal,
            msg_id: 1000,
            seq,
            payload: bytes::Bytes::from(vec![0u8; bytes]),
        }
    }

    /// The held line keeps the client's order (a second `start_holding` joins behind), is
    /// bounded in messages and bytes, ends when empty, and a session that ended holds
    /// nothing and admits nothing.
    #[test]
    fn the_held_line_keeps_order_and_its_bounds() {
        let now = tokio::time::Instant::now();
        let mut t = Sessions::default();
        let sid = [1; 16];
        t.open(&sid, "p", "e");
        assert!(
            t.start_holding(upstream(sid, 1, 10), now),
            "starts its task"
        );
        assert!(matches!(
            t.hold_behind(upstream(sid, 2, 10), now),
            Held::Queued
        ));
        assert!(
            !t.start_holding(upstream(sid, 3, 10), now),
            "a task runs already"
        );
        assert!(matches!(
            t.hold_behind(upstream(sid, 4, MAX_HELD_BYTES), now),
            Held::Full
        ));
        let seqs: Vec<u64> = std::iter::from_fn(|| t.next_held(&sid))
            .map(|(h, _)| h.message.seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3]);
        assert!(
            matches!(t.hold_behind(upstream(sid, 5, 10), now), Held::Free(_)),
            "the line ended"
        );
        for seq in 10..10 + MAX_HELD as u64 {
            let queued = if seq == 10 {
                t.start_holding(upstream(sid, seq, 0), now)
            } else {
                matches!(t.hold_behind(upstream(sid, seq, 0), now), Held::Queued)
            };
            assert!(queued, "{seq}");
        }
        assert!(matches!(
            t.hold_behind(upstream(sid, 9_999, 0), now),
            Held::Full
        ));
        t.remove(&sid);
        assert!(t.next_held(&sid).is_none());
        assert!(matches!(
            t.admit_forward(&sid, 1, &target(1), true),
            Admitted::Stopped(Stopped::Gone)
        ));
    }

    fn target(epoch: u64) -> ForwardTarget {
        ForwardTarget {
            service: "player".into(),
            instance: "127.0.0.1:1".parse().unwrap(),
            epoch,
        }
    }

    /// A table holding session `sid` with its message 1 forwarded (and not yet answered).
    fn forwarding(sid: SessionId) -> Sessions {
        let mut t = Sessions::default();
        t.open(&sid, "p", "e");
        assert!(matches!(
            t.admit_forward(&sid, 1, &target(1), true),
            Admitted::Go
        ));
        t
    }

    /// A message refused `stale_epoch` and routed again after its session ended here is not
    /// sent (it would open the session on the new instance again, for good): before, the
    /// re-route checked nothing and forwarded it.
    #[test]
    fn a_message_routed_again_after_its_session_ended_is_not_sent() {
        let sid = [2; 16];
        let mut t = forwarding(sid);
        t.remove(&sid);
        for track in [true, false] {
            assert_eq!(
                t.rerouted_forward(&sid, 1, &target(2), track).err(),
                Some(Stopped::Gone)
            );
        }
        assert!(t.forwards.is_empty(), "nothing kept for it");
    }

    /// Quiesced for a hard migration, a session forwards nothing more here: its held line
    /// is withdrawn (handed back, the message in hand woken to be withdrawn too), a new
    /// message and a re-routed one are not sent; its end forgets it.
    #[test]
    fn a_moving_session_forwards_nothing_more() {
        let now = tokio::time::Instant::now();
        let sid = [3; 16];
        let mut t = forwarding(sid);
        let Admitted::Wait(wake) = t.admit_forward(&sid, 2, &target(2), true) else {
            panic!("2 waits for 1 (another epoch)");
        };
        assert!(t.start_holding(upstream(sid, 2, 10), now));
        let (in_hand, _) = t.next_held(&sid).expect("2 in the task's hand");
        assert_eq!(in_hand.message.seq, 2);
        assert!(matches!(
            t.hold_behind(upstream(sid, 3, 10), now),
            Held::Queued
        ));
        let withdrawn: Vec<u64> = t.start_moving(&sid).iter().map(|m| m.seq).collect();
        assert_eq!(withdrawn, [3]);
        assert!(
            futures_util::FutureExt::now_or_never(wake.notified()).is_some(),
            "the task holding 2 is woken"
        );
        assert!(matches!(
            t.admit_forward(&sid, 2, &target(2), true),
            Admitted::Stopped(Stopped::Moving)
        ));
        assert_eq!(
            t.rerouted_forward(&sid, 1, &target(2), true).err(),
            Some(Stopped::Moving)
        );
        assert!(t.start_moving(&sid).is_empty(), "once");
        t.remove(&sid);
        assert!(t.moving.is_empty(), "forgotten with the session");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Open(u8),
        AddLink(u8, u8),
        RemoveLink(u8, u8),
        Bind(u8, u8, u8),
        Remove(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6).prop_map(Op::Open),
            (0u8..6, 0u8..3).prop_map(|(s, l)| Op::AddLink(s, l)),
            (0u8..6, 0u8..3).prop_map(|(s, l)| Op::RemoveLink(s, l)),
            (0u8..6, 0u8..2, 0u8..3).prop_map(|(s, v, k)| Op::Bind(s, v, k)),
            (0u8..6).prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// The per-link counts always equal a scan of the entries' links; the key holders
        /// a scan of the entries' keys, and a key is reported released exactly when its
        /// last holder lets it go.
        #[test]
        fn link_and_key_counts_match_the_entries(ops in proptest::collection::vec(op(), 0..64)) {
            let mut t = Sessions::default();
            let addr = |l: u8| SocketAddr::from(([127, 0, 0, 1], 9000 + u16::from(l)));
            for op in ops {
                let before = t.key_holders.clone();
                let released = match op {
                    Op::Open(s) => { t.open(&[s; 16], "p", "e"); Vec::new() }
                    Op::AddLink(s, l) => { t.add_link(&[s; 16], addr(l)); Vec::new() }
                    Op::RemoveLink(s, l) => { t.remove_link(&[s; 16], addr(l)); Vec::new() }
                    Op::Bind(s, v, k) => t.set_keys(
                        &[s; 16],
                        [(format!("svc{v}"), format!("key{k}"))],
                    ),
                    Op::Remove(s) => t.remove(&[s; 16]).map(|(_, r)| r).unwrap_or_default(),
                };
                for l in 0..3 {
                    let scanned = t.by_id.values().filter(|e| e.links.contains(&addr(l))).count();
                    prop_assert_eq!(t.sessions_on_link(&addr(l)), scanned as i64);
                }
                prop_assert_eq!(t.by_handle.len(), t.by_id.len());
                let mut scanned: HashMap<(String, String), u32> = HashMap::new();
                for e in t.by_id.values() {
                    for (service, key) in e.keys.iter() {
                        *scanned.entry((service.clone(), key.clone())).or_default() += 1;
                    }
                }
                prop_assert_eq!(&t.key_holders, &scanned);
                let gone: Vec<_> = before
                    .keys()
                    .filter(|k| !t.key_holders.contains_key(*k))
                    .cloned()
                    .collect();
                let mut released = released;
                released.sort();
                let mut gone = gone;
                gone.sort();
                prop_assert_eq!(released, gone);
            }
        }
    }
}

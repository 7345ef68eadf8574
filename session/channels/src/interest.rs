//! Which backends know that this edge has a channel (PROTOCOL.md §12.6, link feature
//! `CHANNEL_INTEREST`): the rule that lets a backend publish only to the edges that have a
//! channel without a member ever missing a publication made after its join was answered.
//!
//! A channel is *present* on the edge from its creation (a join or a publish) until it is
//! reclaimed. Every link that takes notices ([`ChannelHub::interest_link_up`]) is told each
//! change, in order, numbered per link; the backend acknowledges them. A channel created
//! while links are registered waits for each of them to acknowledge its notice: until then
//! nothing of it is delivered ([`Channel::blocked`](super::Channel)), so a member's JOINED
//! is shown, and the edge's shell answers the join, only once every backend that could
//! publish to it publishes to this edge. A link that goes down owes nothing.
//!
//! Sans-IO like the rest of the hub: the shell sends what [`ChannelHub::interest_due`]
//! returns on the link's own task (so a link's notices keep their order) and is told which
//! links have notices due ([`ChannelHub::poll_interest_wakeup`]) and which channels stopped
//! waiting ([`ChannelHub::poll_interest_settled`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ChannelHub;

/// A backend link registered for channel interest notices, named by the hub.
pub type InterestLink = u64;

/// One CHANNEL_INTEREST to send on a link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterestNotice {
    /// Its number on the link (from 1, one more per notice).
    pub seq: u64,
    /// Whether the edge has the channel now.
    pub present: bool,
    /// The channel.
    pub channel: Arc<str>,
}

/// One registered link's notices.
#[derive(Debug, Default)]
pub(crate) struct LinkNotices {
    /// Channels whose state is to be sent, oldest change first, each once (the state sent
    /// is the one at sending time).
    due: VecDeque<Arc<str>>,
    due_set: HashSet<Arc<str>>,
    /// The last seq given.
    last_seq: u64,
    /// Notices sent that a channel waits on, in seq order.
    owed: VecDeque<(u64, Arc<str>)>,
}

/// The hub's interest state.
#[derive(Debug, Default)]
pub(crate) struct Interest {
    links: HashMap<InterestLink, LinkNotices>,
    next_link: InterestLink,
    /// Links whose `due` became non-empty since the shell last asked.
    wake: VecDeque<InterestLink>,
    /// Channels that stopped waiting for acknowledgements.
    settled: VecDeque<Arc<str>>,
}

impl Interest {
    /// Queues the state of `channel` for every registered link (and wakes the ones that had
    /// nothing due).
    pub(crate) fn changed(&mut self, channel: &Arc<str>) {
        for (id, link) in &mut self.links {
            if link.due_set.insert(channel.clone()) {
                if link.due.is_empty() {
                    self.wake.push_back(*id);
                }
                link.due.push_back(channel.clone());
            }
        }
    }

    /// Whether `link` is registered.
    pub(crate) fn is_registered(&self, link: InterestLink) -> bool {
        self.links.contains_key(&link)
    }

    /// The links a new channel waits for.
    pub(crate) fn registered(&self) -> Vec<InterestLink> {
        self.links.keys().copied().collect()
    }
}

impl ChannelHub {
    /// Registers a backend link that takes channel interest notices; every channel the edge
    /// has is due on it at once (the shell sends them before the link's first CREDIT, so
    /// the backend knows them before it can publish). Channels that exist now do not wait
    /// for this link.
    pub fn interest_link_up(&mut self) -> InterestLink {
        let id = self.interest.next_link;
        self.interest.next_link += 1;
        let mut link = LinkNotices::default();
        for name in self.channels.keys() {
            link.due_set.insert(name.clone());
            link.due.push_back(name.clone());
        }
        if !link.due.is_empty() {
            self.interest.wake.push_back(id);
        }
        self.interest.links.insert(id, link);
        id
    }

    /// The link is gone: nothing waits for it any more.
    pub fn interest_link_down(&mut self, link: InterestLink) {
        let Some(notices) = self.interest.links.remove(&link) else {
            return;
        };
        self.interest.wake.retain(|l| *l != link);
        let waiting = notices.owed.into_iter().map(|(_, c)| c).chain(notices.due);
        for name in waiting {
            self.stop_waiting(&name, link);
        }
    }

    /// Up to `max` notices to send on `link` now, in order (empty: nothing due).
    pub fn interest_due(&mut self, link: InterestLink, max: usize) -> Vec<InterestNotice> {
        let mut out = Vec::new();
        let Some(notices) = self.interest.links.get_mut(&link) else {
            return out;
        };
        while out.len() < max {
            let Some(name) = notices.due.pop_front() else {
                break;
            };
            notices.due_set.remove(&name);
            notices.last_seq += 1;
            let seq = notices.last_seq;
            let ch = self.channels.get(&name);
            if ch.is_some_and(|c| c.awaiting.contains(&link)) {
                notices.owed.push_back((seq, name.clone()));
            }
            out.push(InterestNotice {
                seq,
                present: ch.is_some(),
                channel: name,
            });
        }
        out
    }

    /// The backend on `link` took every notice up to `seq`.
    pub fn interest_acked(&mut self, link: InterestLink, seq: u64) {
        let mut done = Vec::new();
        if let Some(notices) = self.interest.links.get_mut(&link) {
            while notices.owed.front().is_some_and(|(s, _)| *s <= seq) {
                if let Some((_, name)) = notices.owed.pop_front() {
                    done.push(name);
                }
            }
        }
        for name in done {
            self.stop_waiting(&name, link);
        }
    }

    /// A link that has notices due and was not named since (the shell wakes its task).
    pub fn poll_interest_wakeup(&mut self) -> Option<InterestLink> {
        self.interest.wake.pop_front()
    }

    /// A channel that stopped waiting for acknowledgements: the joins it held can be
    /// answered (its deliveries are scheduled already).
    pub fn poll_interest_settled(&mut self) -> Option<Arc<str>> {
        self.interest.settled.pop_front()
    }

    /// Whether `channel` still waits for a backend to acknowledge that this edge has it.
    pub fn awaiting_interest(&self, channel: &str) -> bool {
        self.channels
            .get(channel)
            .is_some_and(|c| !c.awaiting.is_empty())
    }

    /// The links that have kept a channel waiting `deadline` or longer since its creation:
    /// their backends take frames but do not acknowledge notices (the shell closes those
    /// links; a link that goes down owes nothing). Call it about once a second.
    pub fn interest_overdue(&self, now: Instant, deadline: Duration) -> Vec<InterestLink> {
        let mut out: Vec<InterestLink> = self
            .channels
            .values()
            .filter(|c| {
                !c.awaiting.is_empty() && now.saturating_duration_since(c.created) >= deadline
            })
            .flat_map(|c| c.awaiting.iter().copied())
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Channels that wait for a backend's acknowledgement now (for metrics).
    pub fn awaiting_channels(&self) -> usize {
        self.channels
            .values()
            .filter(|c| !c.awaiting.is_empty())
            .count()
    }

    fn stop_waiting(&mut self, name: &Arc<str>, link: InterestLink) {
        let Some(ch) = self.channels.get_mut(name) else {
            return;
        };
        let before = ch.awaiting.len();
        ch.awaiting.retain(|l| *l != link);
        if before > 0 && ch.awaiting.is_empty() {
            self.interest.settled.push_back(name.clone());
            Self::schedule(&mut self.ready, ch);
        }
    }
}

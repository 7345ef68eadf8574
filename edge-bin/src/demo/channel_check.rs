//! The demo's per-member channel check (PROTOCOL.md §12.3, §12.4): a plain struct fed the
//! channel events one member's client receives, in the order it receives them. It judges
//! order on the spot; skipped offsets it cannot judge alone are kept for the end of the run,
//! where they are checked against what the edges answered the backends (an announcement
//! withdrawn, or a normal publication in the announcement log's stretch).

use std::collections::{HashMap, HashSet, VecDeque};

use waygate_protocol::channel::ChannelPosition;
use waygate_protocol::frame::WelcomeOutcome;

/// Out-of-order samples a report keeps.
pub(super) const ORDER_SAMPLES: usize = 8;

/// Skipped offsets one member keeps for the end of the run (beyond: out of order).
const SKIPS_KEPT: usize = 10_000;

/// Events kept per channel for a report.
const TRAIL_LEN: usize = 16;

/// A channel event a member saw (kept cheaply per event; formatted only for a report).
#[derive(Debug, Clone, Copy)]
enum Seen {
    Joined(ChannelPosition),
    HistoryLost(ChannelPosition),
    Announcement(u64),
    Publication(u64),
    Left,
    Connected(WelcomeOutcome),
}

impl std::fmt::Display for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Seen::Joined(p) => write!(f, "JOINED({},{})", p.epoch, p.offset),
            Seen::HistoryLost(p) => write!(f, "HISTORY_LOST({},{})", p.epoch, p.offset),
            Seen::Announcement(offset) => write!(f, "A{offset}"),
            Seen::Publication(offset) => write!(f, "P{offset}"),
            Seen::Left => f.write_str("LEFT"),
            Seen::Connected(outcome) => write!(f, "[{outcome:?}]"),
        }
    }
}

/// One member's channel check; see the module docs.
#[derive(Debug, Default)]
pub(super) struct ChannelCheck {
    player: String,
    /// Per channel: the (epoch, offset) the next publication must have.
    next_offset: HashMap<String, (u64, u64)>,
    /// Per channel: the last events seen (and connections), for a report.
    trail: HashMap<String, VecDeque<Seen>>,
    /// Channels whose join is recovering publications (no JOINED yet).
    recovering: HashSet<String>,
    /// Channels joined whose JOINED or HISTORY_LOST has not come yet.
    awaiting_joined: HashSet<String>,
    /// Offsets skipped by an announcement, per channel, not yet judged: the announcement
    /// log's stretch after a move to another edge (old-epoch announcements with holes where
    /// normal publications were, PROTOCOL.md §12.4) if the channel's HISTORY_LOST or JOINED
    /// comes next; otherwise (normal traffic of the epoch first, LEFT, the end) skipped
    /// offsets to account for. A move alone does not say where the stretch begins: the
    /// session's replay may hold an earlier move's HISTORY_LOST and what followed it.
    unjudged: HashMap<String, Vec<ChannelPosition>>,
    /// Per channel: the epoch followed and a hash of each publication body seen in it.
    bodies: HashMap<String, (u64, HashSet<u64>)>,
    /// Publications whose body this member had already received in the same epoch (a
    /// message its sender resent after an edge died was published again: backends see a
    /// message at least once, PROTOCOL.md §9.6).
    pub duplicates: u64,
    /// Publications received (every channel).
    pub publications: u64,
    /// HISTORY_LOST markers received.
    pub history_lost: u64,
    /// Announcements received.
    pub announcements: u64,
    /// Order violations found on the spot.
    pub order_violations: u64,
    /// The first few violations, described.
    pub order_samples: Vec<String>,
    /// Offsets skipped outside a log stretch: each must be an announcement its edge
    /// withdrew (PROTOCOL.md §12.5), checked at the end of the run.
    pub skipped: Vec<(String, ChannelPosition)>,
    /// Skipped offsets not kept (beyond [`SKIPS_KEPT`]): counted as out of order.
    pub skipped_beyond: u64,
    /// Announcement log stretches received (each ended by a HISTORY_LOST or JOINED).
    pub log_stretches: u64,
    /// Offsets skipped inside those stretches: each must be no announcement an edge took,
    /// checked at the end of the run.
    pub log_holes: Vec<(String, ChannelPosition)>,
}

impl ChannelCheck {
    /// A member that asked to join `channels`.
    pub(super) fn new(player: &str, channels: impl IntoIterator<Item = String>) -> Self {
        Self {
            player: player.to_owned(),
            awaiting_joined: channels.into_iter().collect(),
            ..Self::default()
        }
    }

    /// The member's recent events in `channel`.
    pub(super) fn trail_text(&self, channel: &str) -> String {
        self.trail
            .get(channel)
            .map(|t| t.iter().map(Seen::to_string).collect::<Vec<_>>().join(" "))
            .unwrap_or_default()
    }

    fn remember(&mut self, channel: &str, entry: Seen) {
        let t = match self.trail.get_mut(channel) {
            Some(t) => t,
            None => self.trail.entry(channel.to_owned()).or_default(),
        };
        push_capped(t, entry);
    }

    fn violation(&mut self, sample: impl FnOnce(&Self) -> String) {
        self.order_violations += 1;
        if self.order_samples.len() < ORDER_SAMPLES {
            let s = sample(self);
            tracing::warn!(player = %self.player, "{s}");
            self.order_samples.push(s);
        }
    }

    /// The client connected (`outcome`): noted in every channel's trail.
    pub(super) fn connected(&mut self, outcome: WelcomeOutcome) {
        for t in self.trail.values_mut() {
            push_capped(t, Seen::Connected(outcome));
        }
    }

    /// JOINED at `position`.
    pub(super) fn joined(&mut self, channel: String, position: ChannelPosition) {
        self.remember(&channel, Seen::Joined(position));
        self.awaiting_joined.remove(&channel);
        self.log_stretch_ended(&channel);
        // After recovered publications, JOINED is the last of them.
        let reached = self.next_offset.get(&channel).copied();
        if self.recovering.remove(&channel)
            && reached != Some((position.epoch, position.offset + 1))
        {
            self.violation(|c| {
                format!(
                    "{} {channel}: JOINED {position:?} after a recovery that reached {reached:?}",
                    c.player
                )
            });
        }
        self.next_offset
            .insert(channel, (position.epoch, position.offset + 1));
    }

    /// HISTORY_LOST at `position`.
    pub(super) fn history_lost(&mut self, channel: String, position: ChannelPosition) {
        self.remember(&channel, Seen::HistoryLost(position));
        self.awaiting_joined.remove(&channel);
        self.recovering.remove(&channel);
        self.history_lost += 1;
        self.log_stretch_ended(&channel);
        self.next_offset
            .insert(channel, (position.epoch, position.offset + 1));
    }

    /// LEFT.
    pub(super) fn left(&mut self, channel: String) {
        self.remember(&channel, Seen::Left);
        self.judged_skipped(&channel);
        self.next_offset.remove(&channel);
    }

    /// A publication at `position` (`announcement`: sent as one).
    pub(super) fn publication(
        &mut self,
        channel: String,
        position: ChannelPosition,
        body: &[u8],
        announcement: bool,
    ) {
        self.publications += 1;
        self.announcements += u64::from(announcement);
        let hash = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            body.hash(&mut h);
            h.finish()
        };
        let seen = match self.bodies.get_mut(&channel) {
            Some(seen) => seen,
            None => self.bodies.entry(channel.clone()).or_default(),
        };
        if seen.0 != position.epoch {
            *seen = (position.epoch, HashSet::new());
        }
        if !seen.1.insert(hash) {
            self.duplicates += 1;
            tracing::debug!(player = %self.player, %channel, ?position, "publication body received twice");
        }
        if position.offset == 0 {
            // Best-effort: no offset, nothing to follow.
            return;
        }
        let expected = self.next_offset.get(&channel).copied();
        if expected.is_none() && self.awaiting_joined.contains(&channel) {
            // Before this join's JOINED: publications recovered for a returning player (a
            // kind with backlog, PROTOCOL.md §12.4: "recovered publications then JOINED").
            // Followed from here; the JOINED must end at the last of them.
            self.recovering.insert(channel.clone());
            self.next_offset
                .insert(channel, (position.epoch, position.offset + 1));
            return;
        }
        let skipped = expected.filter(|&(e, o)| e == position.epoch && position.offset > o);
        if let Some((epoch, from)) = skipped {
            tracing::debug!(
                player = %self.player, %channel, ?expected, ?position, announcement,
                trail = %self.trail_text(&channel),
                "channel offsets skipped"
            );
            let holes = (from..position.offset).map(|offset| ChannelPosition { epoch, offset });
            if announcement {
                self.unjudged
                    .entry(channel.clone())
                    .or_default()
                    .extend(holes);
            } else {
                self.judged_skipped(&channel);
                self.keep_skipped(&channel, holes);
            }
        } else if expected != Some((position.epoch, position.offset)) {
            self.violation(|c| {
                format!(
                    "{} {channel}: expected {expected:?}, got {position:?}; seen since its join: {}",
                    c.player,
                    c.trail_text(&channel)
                )
            });
        } else if !announcement {
            // Normal traffic of the epoch, in order: what an announcement skipped before it
            // was no log stretch.
            self.judged_skipped(&channel);
        }
        let seen = if announcement {
            Seen::Announcement(position.offset)
        } else {
            Seen::Publication(position.offset)
        };
        self.remember(&channel, seen);
        self.next_offset
            .insert(channel, (position.epoch, position.offset + 1));
    }

    /// The member's events are over: skips no HISTORY_LOST explained are kept as skipped.
    pub(super) fn finish(&mut self) {
        for (channel, holes) in std::mem::take(&mut self.unjudged) {
            self.keep_skipped(&channel, holes.into_iter());
        }
    }

    fn keep_skipped(&mut self, channel: &str, holes: impl Iterator<Item = ChannelPosition>) {
        for position in holes {
            if self.skipped.len() < SKIPS_KEPT {
                self.skipped.push((channel.to_owned(), position));
            } else {
                self.skipped_beyond += 1;
            }
        }
    }

    fn judged_skipped(&mut self, channel: &str) {
        if let Some(holes) = self.unjudged.remove(channel) {
            self.keep_skipped(channel, holes.into_iter());
        }
    }

    fn log_stretch_ended(&mut self, channel: &str) {
        if let Some(holes) = self.unjudged.remove(channel) {
            self.log_stretches += 1;
            for position in holes {
                if self.log_holes.len() < SKIPS_KEPT {
                    self.log_holes.push((channel.to_owned(), position));
                } else {
                    self.skipped_beyond += 1;
                }
            }
        }
    }
}

/// Appends `entry` to a trail, keeping the last [`TRAIL_LEN`].
fn push_capped(t: &mut VecDeque<Seen>, entry: Seen) {
    if t.len() >= TRAIL_LEN {
        t.pop_front();
    }
    t.push_back(entry);
}

#[cfg(test)]
mod tests {
    use super::*;

    const E1: u64 = 2025452349711636;
    const E2: u64 = 4495664333274235;

    fn at(epoch: u64, offset: u64) -> ChannelPosition {
        ChannelPosition { epoch, offset }
    }

    /// A member in `world` of epoch `epoch`, at `offset`.
    fn member_at(epoch: u64, offset: u64) -> ChannelCheck {
        let mut c = ChannelCheck::new("p", ["world".to_owned()]);
        c.joined("world".into(), at(epoch, offset));
        c
    }

    fn feed(c: &mut ChannelCheck, events: &[(u64, u64, bool)]) {
        for &(epoch, offset, announcement) in events {
            let body = format!("p|{epoch} {offset}");
            c.publication(
                "world".into(),
                at(epoch, offset),
                body.as_bytes(),
                announcement,
            );
        }
    }

    fn holes(list: &[(String, ChannelPosition)]) -> Vec<u64> {
        list.iter().map(|(_, p)| p.offset).collect()
    }

    /// Found by `demo --edges 3 --clients 5000` (1 run in 3 flagged 4–51 publications "out
    /// of order"): a session moved edge 1 -> edge 2 -> edge 1 before its client received
    /// edge 2's events. Back on edge 1 the replay brought edge 2's HISTORY_LOST and the
    /// publications after it, then edge 2's announcement log stretch (A92, skipping normal
    /// publications 88–91), then edge 1's HISTORY_LOST. The check took the replayed
    /// HISTORY_LOST for the end of the stretch and called 88–91 lost.
    #[test]
    fn a_log_stretch_after_a_replayed_history_lost_is_no_loss() {
        let mut c = member_at(E1, 68);
        feed(&mut c, &[(E1, 69, false), (E1, 70, false), (E1, 71, true)]);
        for o in 72..=77 {
            feed(&mut c, &[(E1, o, false)]);
        }
        c.connected(WelcomeOutcome::Restored);
        // Edge 2's join, replayed: edge 1's log after 77, then edge 2's HISTORY_LOST.
        feed(&mut c, &[(E1, 78, true), (E1, 79, true), (E1, 82, true)]);
        c.history_lost("world".into(), at(E2, 85));
        feed(&mut c, &[(E2, 86, true), (E2, 87, false)]);
        // Edge 1's join: edge 2's log after 87, then edge 1's HISTORY_LOST.
        feed(&mut c, &[(E2, 92, true)]);
        c.history_lost("world".into(), at(E1, 92));
        feed(&mut c, &[(E1, 93, false)]);
        c.finish();
        assert_eq!(c.order_violations, 0, "{:?}", c.order_samples);
        assert!(c.skipped.is_empty(), "{:?}", c.skipped);
        assert_eq!(c.log_stretches, 2);
        assert_eq!(holes(&c.log_holes), [80, 81, 88, 89, 90, 91]);
    }

    /// Live normal publications lost between an announcement and the traffic after it are
    /// skipped offsets to account for (only a withdrawn announcement explains one).
    #[test]
    fn a_hole_followed_by_normal_traffic_is_kept_as_skipped() {
        let mut c = member_at(E1, 49);
        feed(&mut c, &[(E1, 50, false), (E1, 53, true), (E1, 54, false)]);
        c.finish();
        assert_eq!(holes(&c.skipped), [51, 52]);
        assert!(c.log_holes.is_empty());
        assert_eq!(c.log_stretches, 0);
    }

    /// A hole no HISTORY_LOST closes before the end (or before LEFT) is kept as skipped.
    #[test]
    fn a_hole_left_open_is_kept_as_skipped() {
        let mut c = member_at(E1, 9);
        feed(&mut c, &[(E1, 12, true)]);
        c.finish();
        assert_eq!(holes(&c.skipped), [10, 11]);
        let mut c = member_at(E1, 9);
        feed(&mut c, &[(E1, 12, true)]);
        c.left("world".into());
        assert_eq!(holes(&c.skipped), [10, 11]);
    }

    /// A skip landing on a normal publication is kept as skipped at once (a withdrawn
    /// announcement, or a loss), and so is what an announcement skipped before it.
    #[test]
    fn a_skip_landing_on_normal_traffic_is_kept_as_skipped() {
        let mut c = member_at(E1, 1);
        feed(&mut c, &[(E1, 4, true), (E1, 6, false)]);
        c.finish();
        assert_eq!(holes(&c.skipped), [2, 3, 5]);
    }

    /// Backwards, repeated or another epoch without a marker: out of order at once.
    #[test]
    fn publications_out_of_order_are_violations() {
        let mut c = member_at(E1, 5);
        feed(
            &mut c,
            &[
                (E1, 6, false),
                (E1, 6, false),
                (E1, 5, true),
                (E2, 7, false),
            ],
        );
        assert_eq!(c.order_violations, 3);
        assert_eq!(c.order_samples.len(), 3);
    }

    /// The same body twice in one epoch is a duplicate publication; in another epoch (the
    /// same chat published on another edge) it is not.
    #[test]
    fn a_body_received_twice_in_an_epoch_is_a_duplicate() {
        let mut c = member_at(E1, 0);
        c.publication("world".into(), at(E1, 1), b"p|hi 7", false);
        c.publication("world".into(), at(E1, 2), b"p|hi 8", false);
        c.publication("world".into(), at(E1, 3), b"p|hi 7", false);
        assert_eq!(c.duplicates, 1);
        c.history_lost("world".into(), at(E2, 40));
        c.publication("world".into(), at(E2, 41), b"p|hi 7", false);
        assert_eq!(c.duplicates, 1);
        assert_eq!(c.order_violations, 0);
    }

    /// Recovered publications come before JOINED, which must be at the last of them.
    #[test]
    fn a_recovery_ends_with_joined_at_its_last_publication() {
        let mut c = ChannelCheck::new("p", ["guild:1".to_owned()]);
        c.publication("guild:1".into(), at(E1, 4), b"a", false);
        c.publication("guild:1".into(), at(E1, 5), b"b", false);
        c.joined("guild:1".into(), at(E1, 5));
        assert_eq!(c.order_violations, 0);
        let mut c = ChannelCheck::new("p", ["guild:1".to_owned()]);
        c.publication("guild:1".into(), at(E1, 4), b"a", false);
        c.joined("guild:1".into(), at(E1, 6));
        assert_eq!(c.order_violations, 1);
    }
}

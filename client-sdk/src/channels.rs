//! Channel events on the client (PROTOCOL.md §12): [`ChannelTracker`] turns the DATA frames
//! of `CHANNEL_EVENT_MSG_ID` into [`ChannelUpdate`]s, keeps each channel's last position
//! (what the game hands its backend to recover after a new login), and drops a publication
//! it has already shown (same epoch, offset not above the last one): the downstream dedup
//! by server message id, where the id is (channel, epoch, offset).

use std::collections::BTreeMap;

use bytes::Bytes;
use waygate_protocol::channel::{ChannelEvent, ChannelEventKind, ChannelPosition};

/// One channel event for the game.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChannelUpdate {
    /// A publication (best-effort ones have offset 0 and are never recovered).
    Publication {
        /// The channel.
        channel: String,
        /// Its position.
        position: ChannelPosition,
        /// Its body.
        body: Bytes,
    },
    /// The session became a member; live publications follow `position`.
    Joined {
        /// The channel.
        channel: String,
        /// The position live publications follow.
        position: ChannelPosition,
    },
    /// The session is no longer a member; the last position it got is `position`.
    Left {
        /// The channel.
        channel: String,
        /// Where it stopped.
        position: ChannelPosition,
    },
    /// What was missed could not be recovered: reload the state this channel carries from
    /// the game's database; live publications follow `position`.
    HistoryLost {
        /// The channel.
        channel: String,
        /// The position live publications follow.
        position: ChannelPosition,
    },
}

/// Positions per channel and the duplicate filter. Sans-IO: feed it every channel event.
#[derive(Debug, Default, Clone)]
pub struct ChannelTracker {
    positions: BTreeMap<String, ChannelPosition>,
    duplicates: u64,
}

impl ChannelTracker {
    /// Takes one channel event; `None` when it is a publication already shown.
    pub fn accept(&mut self, event: ChannelEvent) -> Option<ChannelUpdate> {
        let ChannelEvent {
            kind,
            channel,
            position,
            body,
        } = event;
        match kind {
            ChannelEventKind::Publication => {
                if position.offset > 0 {
                    let last = self.positions.get(&channel).copied();
                    if last
                        .is_some_and(|l| l.epoch == position.epoch && position.offset <= l.offset)
                    {
                        self.duplicates += 1;
                        return None;
                    }
                    self.positions.insert(channel.clone(), position);
                }
                Some(ChannelUpdate::Publication {
                    channel,
                    position,
                    body,
                })
            }
            ChannelEventKind::Joined => {
                self.positions.insert(channel.clone(), position);
                Some(ChannelUpdate::Joined { channel, position })
            }
            ChannelEventKind::HistoryLost => {
                self.positions.insert(channel.clone(), position);
                Some(ChannelUpdate::HistoryLost { channel, position })
            }
            ChannelEventKind::Left => {
                self.positions.remove(&channel);
                Some(ChannelUpdate::Left { channel, position })
            }
        }
    }

    /// The last position of every channel the session is a member of.
    pub fn positions(&self) -> &BTreeMap<String, ChannelPosition> {
        &self.positions
    }

    /// Publications dropped as already shown.
    pub fn duplicates(&self) -> u64 {
        self.duplicates
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: ChannelEventKind, epoch: u64, offset: u64) -> ChannelEvent {
        ChannelEvent {
            kind,
            channel: "guild:1".into(),
            position: ChannelPosition { epoch, offset },
            body: Bytes::new(),
        }
    }

    #[test]
    fn positions_follow_events_and_repeats_are_dropped() {
        use ChannelEventKind::*;
        let mut t = ChannelTracker::default();
        assert!(t.accept(event(Joined, 9, 4)).is_some());
        assert!(t.accept(event(Publication, 9, 5)).is_some());
        assert!(t.accept(event(Publication, 9, 5)).is_none(), "repeat");
        assert!(t.accept(event(Publication, 9, 3)).is_none(), "older");
        assert!(t.accept(event(Publication, 9, 0)).is_some(), "best-effort");
        assert_eq!(
            t.positions()["guild:1"],
            ChannelPosition {
                epoch: 9,
                offset: 5
            }
        );
        assert!(t.accept(event(HistoryLost, 11, 2)).is_some());
        assert!(t.accept(event(Publication, 11, 3)).is_some(), "new epoch");
        assert_eq!(t.duplicates(), 2);
        assert!(t.accept(event(Left, 11, 3)).is_some());
        assert!(t.positions().is_empty());
    }
}

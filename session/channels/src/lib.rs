//! # waygate-channels
//!
//! Owns the channels of one edge (PROTOCOL.md §12, SPEC F1, F2, F5): which sessions are
//! members of which channel, each channel's epoch, offsets and bounded history, its pending
//! queue (bounded per class), its publish rate limit and publish-id dedup window, recovery
//! of what a joining member missed (or an explicit "history lost"), and reclaiming idle
//! channels, and which backend links know that this edge has a channel (a new channel
//! delivers nothing until they acknowledged it, PROTOCOL.md §12.6).
//!
//! [`ChannelHub`] is sans-IO, like the session host and the KCP endpoint: a plain struct
//! driven by calls with `now` passed in, polled for work. A publish is checked and given its
//! offset at once (a refusal is a typed [`ChannelError`] for the publisher, never a silent
//! drop); deliveries come out of [`ChannelHub::next_delivery`] one at a time per channel, in
//! offset order, each with the exact members it goes to. The edge runs one consumer per
//! *active* channel ([`ChannelHub::poll_ready`]) that pushes each delivery into the members'
//! session outbound queues: serial per channel, parallel across channels, no task per
//! message and no socket write under any lock.
//!
//! What it must never do: read a clock, touch a socket or a runtime, reorder a channel's
//! publications, or grow without bound (channels, members, pending items, history and dedup
//! ids are all capped by [`ChannelsConfig`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use waygate_backpressure::{Rate, TokenBucket};
use waygate_protocol::channel::{
    ChannelEvent, ChannelEventKind, ChannelPosition, MAX_CHANNEL_NAME_LEN,
};
use waygate_protocol::frame::SessionId;
use waygate_protocol::{CloseCode, TrafficClass};

mod interest;
#[cfg(test)]
mod tests;

pub use interest::{InterestLink, InterestNotice};

/// Retry hint of a `queue_full` refusal: a channel's queue drains within milliseconds.
pub const QUEUE_FULL_RETRY_MS: u32 = 100;
/// Retry hint of an announcement the log did not take.
pub const LOG_UNAVAILABLE_RETRY_MS: u32 = 1_000;

/// How one kind of channel behaves (`[channels.kinds.<kind>]` in the edge configuration).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KindPolicy {
    /// Publications (critical and normal) kept for recovery; 0 keeps none.
    pub history_len: usize,
    /// A kept publication is dropped from the history after this long.
    pub history_ttl_ms: u64,
    /// Members of one channel of this kind on one edge.
    pub max_members: usize,
    /// Largest publication body, in bytes.
    pub max_body: usize,
    /// Publications per second one channel takes (sustained).
    pub publish_rate: u64,
    /// Publications one channel takes in a burst.
    pub publish_burst: u64,
    /// Critical (announcement) publications waiting for delivery in one channel.
    pub queue_critical: usize,
    /// Normal (reliable) publications waiting for delivery in one channel.
    pub queue_normal: usize,
    /// Best-effort publications waiting for delivery in one channel (shed first: keep it
    /// the smallest).
    pub queue_best_effort: usize,
    /// Offline members get a backlog: when a member's session ends, the edge remembers the
    /// last position its client acknowledged, and a later join of the same player without
    /// a position recovers from there; the memory is used once, by the next join taken
    /// (PROTOCOL.md §12.4).
    pub backlog: bool,
}

impl Default for KindPolicy {
    fn default() -> Self {
        Self {
            history_len: 100,
            history_ttl_ms: 300_000,
            max_members: 100_000,
            max_body: 16 * 1024,
            publish_rate: 1_000,
            publish_burst: 2_000,
            queue_critical: 256,
            queue_normal: 1_024,
            queue_best_effort: 256,
            backlog: false,
        }
    }
}

impl KindPolicy {
    fn queue_cap(&self, class: TrafficClass) -> usize {
        match class {
            TrafficClass::Critical => self.queue_critical,
            TrafficClass::Normal => self.queue_normal,
            TrafficClass::BestEffort => self.queue_best_effort,
        }
    }

    /// Recovery items one channel may hold for joining members at once.
    fn direct_cap(&self) -> usize {
        self.history_len.saturating_mul(4).saturating_add(1_024)
    }
}

/// The channels of one edge (`[channels]` in the edge configuration).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChannelsConfig {
    /// Channels that exist on the edge at once (with members, history or pending work).
    pub max_channels: usize,
    /// Channels one session may be a member of.
    pub max_channels_per_session: usize,
    /// A channel with no members, nothing pending and no live history is dropped after
    /// being idle this long (its next use starts a new epoch).
    pub idle_reclaim_ms: u64,
    /// How long a channel remembers a publish id, to answer a retried publish with its
    /// first result, in seconds. A client resends an unacknowledged message when it
    /// resumes, up to the session linger after its link dropped, and a backend handles it
    /// again with the same id (PROTOCOL.md §12.5): the edge refuses a window shorter than
    /// `session.linger_secs` at load.
    pub dedup_window_secs: u64,
    /// Publish ids the edge remembers at once, over all channels (up to ~170 bytes each): a
    /// publish that would remember one more is refused `rate_limited` until the oldest
    /// expires (an id is never forgotten early, which would publish a resend twice).
    pub dedup_max_ids: usize,
    /// Departed members remembered per channel of a kind with `backlog` (the oldest is
    /// forgotten first; an entry also goes when its kind's history TTL has passed).
    pub backlog_players: usize,
    /// Where announcements are made durable before they are taken (PROTOCOL.md §12.5):
    /// `auto` (the Redis stream when the edge uses Redis, else none), `off`, `redis`, or
    /// the path of a file (the one-edge log).
    pub announcement_log: String,
    /// When the file log syncs to disk.
    pub announcement_fsync: FsyncPolicy,
    /// The file log's size cap in bytes: compacted when it reaches it; new announcements
    /// are refused while the unexpired ones need more than half of it.
    pub announcement_log_max_bytes: u64,
    /// Bytes of publications kept for recovery over all channels (each kind's
    /// `history_len` and `history_ttl_ms` bound one channel; this bounds them all): past
    /// it the oldest kept publications are forgotten first (a member recovering from
    /// before them gets HISTORY_LOST).
    pub history_budget_bytes: u64,
    /// Bytes of publications waiting for their channel's consumer over all channels (each
    /// kind's queue caps bound one channel): a publish that would need more is refused
    /// `queue_full`.
    pub pending_budget_bytes: u64,
    /// The channel kinds, by the part of a channel name before `:` (`guild` for
    /// `guild:42`, `world` for `world`). Setting this replaces the default kinds.
    pub kinds: BTreeMap<String, KindPolicy>,
}

/// When the file announcement log syncs to disk (`channels.announcement_fsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsyncPolicy {
    /// After every batch, before any of it is answered: durable across a power loss.
    Always,
    /// Never explicitly: durable across a crash of the edge process, not of the machine.
    Never,
}

impl Default for ChannelsConfig {
    fn default() -> Self {
        let kind = |history_len, history_ttl_ms, backlog| KindPolicy {
            history_len,
            history_ttl_ms,
            backlog,
            ..KindPolicy::default()
        };
        Self {
            max_channels: 10_000,
            max_channels_per_session: 64,
            idle_reclaim_ms: 60_000,
            dedup_window_secs: 15 * 60,
            dedup_max_ids: 1_048_576,
            backlog_players: 10_000,
            announcement_log: "auto".to_owned(),
            announcement_fsync: FsyncPolicy::Always,
            announcement_log_max_bytes: 64 * 1024 * 1024,
            history_budget_bytes: 256 * 1024 * 1024,
            pending_budget_bytes: 64 * 1024 * 1024,
            kinds: BTreeMap::from([
                ("world".to_owned(), kind(100, 60_000, false)),
                ("guild".to_owned(), kind(500, 3_600_000, true)),
                ("room".to_owned(), kind(100, 300_000, false)),
                ("system".to_owned(), kind(100, 3_600_000, false)),
            ]),
        }
    }
}

impl ChannelsConfig {
    /// Checks the values; the error names the key.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_channels == 0 {
            return Err("channels.max_channels must be at least 1".into());
        }
        if self.max_channels_per_session == 0 {
            return Err("channels.max_channels_per_session must be at least 1".into());
        }
        if self.dedup_window_secs == 0 || self.dedup_max_ids == 0 {
            return Err("channels.dedup_window_secs and dedup_max_ids must be at least 1".into());
        }
        if self.announcement_log.is_empty() {
            return Err("channels.announcement_log: `auto`, `off`, `redis` or a file path".into());
        }
        if self.announcement_log_max_bytes < 64 * 1024 {
            return Err("channels.announcement_log_max_bytes must be at least 65536".into());
        }
        // One publication of the largest body (with its event header) must fit each budget.
        let largest = self.kinds.values().map(|k| k.max_body).max().unwrap_or(0) as u64
            + waygate_protocol::channel::MAX_EVENT_OVERHEAD as u64;
        if self.history_budget_bytes < largest || self.pending_budget_bytes < largest {
            return Err(format!(
                "channels.history_budget_bytes and pending_budget_bytes must be at least \
                 {largest} (the largest max_body with its event header)"
            ));
        }
        for (name, k) in &self.kinds {
            if name.is_empty() || name.contains(':') || name.len() > MAX_CHANNEL_NAME_LEN {
                return Err(format!(
                    "channels.kinds: `{name}` is not a kind name (non-empty, no `:`)"
                ));
            }
            if k.publish_rate == 0 || k.publish_burst == 0 {
                return Err(format!(
                    "channels.kinds.{name}: publish_rate and publish_burst must be at least 1"
                ));
            }
            if k.max_members == 0 || k.max_body == 0 {
                return Err(format!(
                    "channels.kinds.{name}: max_members and max_body must be at least 1"
                ));
            }
            if k.queue_critical == 0 || k.queue_normal == 0 {
                return Err(format!(
                    "channels.kinds.{name}: queue_critical and queue_normal must be at least 1"
                ));
            }
        }
        Ok(())
    }
}

/// Why a channel request was not carried out. Grouped by who is at fault; each has one wire
/// code ([`ChannelError::code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    // ----- the requester's fault
    /// Empty, longer than 256 bytes, or containing control characters.
    #[error("invalid channel name")]
    InvalidName,
    /// The name's kind is not configured.
    #[error("channel kind not configured")]
    UnknownKind,
    /// The body is larger than the kind's `max_body`.
    #[error("publication body too large")]
    TooLarge,
    // ----- pressure: retry later
    /// The channel's publish rate is exceeded.
    #[error("channel publish rate exceeded")]
    RateLimited {
        /// When a retry can succeed.
        retry_after_ms: u32,
    },
    /// The channel's queue for this class (or for recovery items) is full.
    #[error("channel queue full")]
    QueueFull,
    /// Channels on the edge, channels of the session or members of the channel are at
    /// their cap.
    #[error("channel cap reached")]
    Limit,
    /// A retry of an announcement whose first publish is still being persisted.
    #[error("announcement still being persisted")]
    Persisting,
    // ----- the edge's dependencies
    /// The announcement log did not take the announcement: nothing was published.
    #[error("announcement log unavailable")]
    LogUnavailable,
}

impl ChannelError {
    /// The wire code (CHANNEL_RESULT, metrics labels).
    pub fn code(self) -> CloseCode {
        match self {
            Self::InvalidName => CloseCode::ProtocolError,
            Self::UnknownKind => CloseCode::UnknownChannelKind,
            Self::TooLarge => CloseCode::FrameTooLarge,
            Self::RateLimited { .. } => CloseCode::RateLimited,
            Self::QueueFull => CloseCode::QueueFull,
            Self::Limit => CloseCode::ChannelLimit,
            Self::Persisting => CloseCode::Busy,
            Self::LogUnavailable => CloseCode::Unavailable,
        }
    }

    /// The retry hint for the requester (0 = none).
    pub fn retry_after_ms(self) -> u32 {
        match self {
            Self::RateLimited { retry_after_ms } => retry_after_ms,
            Self::QueueFull | Self::Persisting => QUEUE_FULL_RETRY_MS,
            Self::LogUnavailable => LOG_UNAVAILABLE_RETRY_MS,
            _ => 0,
        }
    }
}

/// A publish that was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishReceipt {
    /// Its position (offset 0 for best-effort: never recoverable).
    pub position: ChannelPosition,
    /// A publish with the same id was taken before: this is that one's position, and
    /// nothing was published now.
    pub duplicate: bool,
    /// An announcement held until the announcement log has it (hubs with
    /// [`ChannelHub::set_announcement_log`]): write this record, then tell the hub with
    /// [`ChannelHub::persisted`], and answer the publisher only then. Nothing of the
    /// channel is delivered past it meanwhile.
    pub persist: Option<AnnouncementRecord>,
}

/// An announcement for the announcement log: what a member that missed it needs to
/// receive it from the log on any edge, later (PROTOCOL.md §12.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnouncementRecord {
    /// The channel.
    pub channel: Arc<str>,
    /// Its position in the channel.
    pub position: ChannelPosition,
    /// The encoded PUBLICATION event, as members receive it.
    pub event: Bytes,
    /// How long the log keeps it (the kind's history TTL).
    pub ttl: Duration,
    /// How many of the channel's announcements the log keeps (the kind's history length).
    pub keep: usize,
}

/// One channel event to push into some sessions' outbound queues (the DATA payload of
/// `CHANNEL_EVENT_MSG_ID`, encoded once for every member).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The channel.
    pub channel: Arc<str>,
    /// The publication's class (markers: critical), for the counters; the DATA that
    /// carries it uses [`Delivery::wire_class`].
    pub class: TrafficClass,
    /// The encoded [`ChannelEvent`].
    pub event: Bytes,
    /// The sessions it goes to.
    pub to: Vec<SessionId>,
    /// When the publication was taken (for a publication; `None` for a marker or a
    /// recovered one).
    pub published_at: Option<Instant>,
}

impl Delivery {
    /// The class of the DATA that carries it to a client: normal for every marker and every
    /// recoverable publication (announcements included), best-effort for best-effort ones.
    /// One sequenced lane keeps a channel's events in order on every transport (QUIC
    /// carries critical and normal DATA on different streams, so mixing them would let
    /// JOINED overtake the publications recovered before it).
    pub fn wire_class(&self) -> TrafficClass {
        match self.class {
            TrafficClass::BestEffort => TrafficClass::BestEffort,
            _ => TrafficClass::Normal,
        }
    }
}

/// What a join delivers before the member's live publications.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinOutcome {
    /// A new member; nothing recovered (no position was asked).
    Joined,
    /// Already a member: nothing changes.
    AlreadyMember,
    /// The publications after the asked position follow, then live ones.
    Recovered {
        /// How many publications are recovered.
        publications: usize,
    },
    /// The asked position cannot be recovered: a HISTORY_LOST marker follows.
    HistoryLost,
}

/// Counters of a hub since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HubStats {
    /// Channels created (a reclaimed channel that comes back counts again).
    pub channels_created: u64,
    /// Channels reclaimed when idle.
    pub channels_reclaimed: u64,
    /// Retried publishes answered from the dedup window.
    pub duplicates: u64,
    /// Recovered publications queued for joining members.
    pub recovered: u64,
    /// HISTORY_LOST markers queued.
    pub history_lost: u64,
    /// Announcements of another epoch queued for joining members from the announcement
    /// log (before their HISTORY_LOST).
    pub logged_recovered: u64,
    /// Kept publications forgotten early because every channel's history together reached
    /// `history_budget_bytes`.
    pub history_evicted: u64,
}

#[derive(Debug)]
struct Member {
    /// Pending items with a lower ticket were queued before the member joined.
    live_from: u64,
    /// The ticket of its pending LEFT marker: it still gets what was queued before it.
    leaving_at: Option<u64>,
}

#[derive(Debug)]
enum PendingItem {
    /// For every member live at its ticket.
    Publication {
        class: TrafficClass,
        event: Bytes,
        at: Instant,
        /// Its offset (0: best-effort).
        offset: u64,
        /// An announcement the log has not confirmed yet: the channel's deliveries stop
        /// here until it does.
        held: bool,
    },
    /// For one member only (recovery, markers), while it is the membership `joined` names.
    Direct {
        member: SessionId,
        /// The membership's `live_from` (a membership that ended and began again does not
        /// get the old one's items).
        joined: u64,
        class: TrafficClass,
        event: Bytes,
        /// A LEFT marker: delivering it ends the membership.
        leave: bool,
    },
}

#[derive(Debug)]
struct Pending {
    ticket: u64,
    item: PendingItem,
}

#[derive(Debug)]
struct Stored {
    offset: u64,
    at: Instant,
    class: TrafficClass,
    event: Bytes,
}

#[derive(Debug)]
struct Channel {
    name: Arc<str>,
    policy: Arc<KindPolicy>,
    epoch: u64,
    last_offset: u64,
    history: VecDeque<Stored>,
    pending: VecDeque<Pending>,
    /// Pending publications per class (index: class as usize); direct items apart.
    pending_by_class: [usize; 3],
    pending_direct: usize,
    next_ticket: u64,
    members: HashMap<SessionId, Member>,
    /// A consumer has been asked for (in `ready`) or is running.
    scheduled: bool,
    limiter: TokenBucket,
    /// Publish ids remembered (the dedup window): the position each got and when it
    /// expires (the hub's `dedup_order` forgets it then).
    recent: HashMap<u64, (ChannelPosition, Instant)>,
    last_used: Instant,
    /// Kinds with backlog: departed players' last acknowledged positions.
    departed: HashMap<Arc<str>, (ChannelPosition, Instant)>,
    departed_order: VecDeque<Arc<str>>,
    /// Links that have not yet acknowledged that this edge has the channel (see the
    /// `interest` module): nothing of it is delivered until none is left.
    awaiting: Vec<InterestLink>,
    /// When the channel was created (how long `awaiting` has waited).
    created: Instant,
}

impl Channel {
    /// Where the held announcement at `offset` waits in the queue.
    fn held_at(&self, offset: u64) -> Option<usize> {
        self.pending.iter().position(|p| {
            matches!(p.item, PendingItem::Publication { held: true, offset: o, .. } if o == offset)
        })
    }

    /// Whether the next pending item waits: for the announcement log, or the channel for
    /// backends to acknowledge that this edge has it.
    fn blocked(&self) -> bool {
        !self.awaiting.is_empty()
            || matches!(
                self.pending.front(),
                Some(Pending {
                    item: PendingItem::Publication { held: true, .. },
                    ..
                })
            )
    }

    fn position(&self) -> ChannelPosition {
        ChannelPosition {
            epoch: self.epoch,
            offset: self.last_offset,
        }
    }

    fn marker(&self, kind: ChannelEventKind) -> Bytes {
        ChannelEvent {
            kind,
            channel: self.name.to_string(),
            position: self.position(),
            body: Bytes::new(),
        }
        .to_bytes()
    }

    fn enqueue(&mut self, item: PendingItem) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        match &item {
            PendingItem::Publication { class, .. } => self.pending_by_class[*class as usize] += 1,
            PendingItem::Direct { .. } => self.pending_direct += 1,
        }
        self.pending.push_back(Pending { ticket, item });
        ticket
    }

    /// When its oldest kept publication was published.
    fn history_front(&self) -> Option<Instant> {
        self.history.front().map(|s| s.at)
    }

    /// Drops what is past the kind's history length and TTL; returns the bytes freed.
    fn trim_history(&mut self, now: Instant) -> u64 {
        let ttl = Duration::from_millis(self.policy.history_ttl_ms);
        let mut freed = 0;
        while self.history.len() > self.policy.history_len
            || self
                .history
                .front()
                .is_some_and(|s| now.saturating_duration_since(s.at) >= ttl)
        {
            freed += self.history.pop_front().map_or(0, |s| s.event.len() as u64);
        }
        freed
    }

    /// Forgets departed players whose entries are older than the history TTL.
    fn trim_departed(&mut self, now: Instant) {
        let ttl = Duration::from_millis(self.policy.history_ttl_ms);
        while let Some(p) = self.departed_order.front() {
            match self.departed.get(p) {
                Some((_, at)) if now.saturating_duration_since(*at) < ttl => break,
                _ => {
                    if let Some(p) = self.departed_order.pop_front() {
                        if self
                            .departed
                            .get(&p)
                            .is_some_and(|(_, at)| now.saturating_duration_since(*at) >= ttl)
                        {
                            self.departed.remove(&p);
                        }
                    }
                }
            }
        }
    }

    fn is_idle(&self, now: Instant, idle: Duration) -> bool {
        self.members.is_empty()
            && self.awaiting.is_empty()
            && self.pending.is_empty()
            && !self.scheduled
            && self.history.is_empty()
            // A departed member's backlog position (kinds with backlog) is kept until it
            // expires: reclaimed, the channel's next epoch would answer its return JOINED
            // instead of HISTORY_LOST.
            && self.departed.is_empty()
            && now.saturating_duration_since(self.last_used) >= idle
    }
}

/// Keeps `fronts` (each channel's oldest kept publication) right for `ch`, whose history
/// just changed; `before`: its oldest publication's time before the change.
fn refront(fronts: &mut BTreeSet<(Instant, Arc<str>)>, ch: &Channel, before: Option<Instant>) {
    let after = ch.history_front();
    if before == after {
        return;
    }
    if let Some(at) = before {
        fronts.remove(&(at, ch.name.clone()));
    }
    if let Some(at) = after {
        fronts.insert((at, ch.name.clone()));
    }
}

/// The channels of one edge. See the crate docs.
#[derive(Debug)]
pub struct ChannelHub {
    config: ChannelsConfig,
    kinds: HashMap<String, Arc<KindPolicy>>,
    channels: HashMap<Arc<str>, Channel>,
    /// Channels each session is a member of (leaving ones included until their LEFT).
    memberships: HashMap<SessionId, Vec<Arc<str>>>,
    ready: VecDeque<Arc<str>>,
    epoch_state: u64,
    stats: HubStats,
    /// Announcements are held until the announcement log has them.
    announcement_log: bool,
    /// Announcements held now, over all channels.
    held: usize,
    /// Bytes of the publications in every channel's history (`history_budget_bytes`).
    history_bytes: u64,
    /// Each channel's oldest kept publication: (when, channel), oldest first, so the
    /// budget's "oldest of any channel" is found without a scan of every channel.
    history_fronts: BTreeSet<(Instant, Arc<str>)>,
    /// Bytes of the publications waiting in every channel's queue
    /// (`pending_budget_bytes`).
    pending_bytes: u64,
    /// Every publish id remembered, in publish order: when it expires, its channel and the
    /// id (capped by `dedup_max_ids`; an entry whose channel was reclaimed or whose id was
    /// withdrawn stays until it expires, and counts).
    dedup_order: VecDeque<(Instant, Arc<str>, u64)>,
    /// Backend links told which channels this edge has.
    interest: interest::Interest,
    /// Joins taken but carried out later (they read the announcement log first, or wait
    /// for room in the channel's queue), per session, so a LEAVE taken meanwhile follows
    /// them ([`ChannelHub::deferred_join_started`]).
    deferred_joins: HashMap<SessionId, Vec<DeferredJoin>>,
}

/// A session's joins of one channel taken and not carried out yet.
#[derive(Debug)]
struct DeferredJoin {
    channel: Arc<str>,
    /// How many.
    joins: u32,
    /// A LEAVE taken after the last of them: carried out once they all are.
    leave_after: bool,
}

/// The most bytes the publication event of `body` on `channel` takes, counted against
/// `pending_budget_bytes` before its position is known.
fn publication_len_bound(channel: &str, body: usize) -> u64 {
    ChannelEvent::max_encoded_len(channel.len(), body) as u64
}

/// Splits a channel name into its kind, after checking it.
pub fn channel_kind(name: &str) -> Result<&str, ChannelError> {
    if name.is_empty()
        || name.len() > MAX_CHANNEL_NAME_LEN
        || name.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(ChannelError::InvalidName);
    }
    let kind = name.split(':').next().unwrap_or(name);
    if kind.is_empty() {
        return Err(ChannelError::InvalidName);
    }
    Ok(kind)
}

impl ChannelHub {
    /// A hub with no channels. `seed` makes channel epochs (give it randomness: an epoch
    /// must not repeat across restarts of the edge).
    pub fn new(config: ChannelsConfig, seed: u64) -> Self {
        let kinds = config
            .kinds
            .iter()
            .map(|(k, v)| (k.clone(), Arc::new(v.clone())))
            .collect();
        Self {
            config,
            kinds,
            channels: HashMap::new(),
            memberships: HashMap::new(),
            ready: VecDeque::new(),
            epoch_state: seed,
            stats: HubStats::default(),
            announcement_log: false,
            held: 0,
            history_bytes: 0,
            history_fronts: BTreeSet::new(),
            pending_bytes: 0,
            dedup_order: VecDeque::new(),
            interest: interest::Interest::default(),
            deferred_joins: HashMap::new(),
        }
    }

    /// The session's deferred joins of `channel`, if any.
    fn deferred_join(&mut self, session: &SessionId, channel: &str) -> Option<&mut DeferredJoin> {
        self.deferred_joins
            .get_mut(session)?
            .iter_mut()
            .find(|j| &*j.channel == channel)
    }

    /// A join of `session` to `channel` was taken and is carried out later (it reads the
    /// announcement log first, [`needs_logged`](Self::needs_logged), or waits for room in
    /// the channel's queue): until it is ([`deferred_join_done`](Self::deferred_join_done)),
    /// a LEAVE of that membership is taken and carried out after it, so joins and leaves
    /// keep the order the backend sent them in. A join cancels a LEAVE taken before it.
    pub fn deferred_join_started(&mut self, session: SessionId, channel: &str) {
        if let Some(j) = self.deferred_join(&session, channel) {
            j.joins += 1;
            j.leave_after = false;
            return;
        }
        self.deferred_joins
            .entry(session)
            .or_default()
            .push(DeferredJoin {
                channel: channel.into(),
                joins: 1,
                leave_after: false,
            });
    }

    /// A join [`deferred_join_started`](Self::deferred_join_started) announced was carried
    /// out (or refused, or dropped: the session ended). Once the last of them is, a LEAVE
    /// taken after them is carried out; returns whether it was now (the session was a
    /// member, and leaves).
    pub fn deferred_join_done(&mut self, now: Instant, session: SessionId, channel: &str) -> bool {
        let Some(joins) = self.deferred_joins.get_mut(&session) else {
            return false;
        };
        let Some(i) = joins.iter().position(|j| &*j.channel == channel) else {
            return false;
        };
        let j = &mut joins[i];
        j.joins = j.joins.saturating_sub(1);
        if j.joins > 0 {
            return false;
        }
        let leave = j.leave_after;
        joins.swap_remove(i);
        if joins.is_empty() {
            self.deferred_joins.remove(&session);
        }
        leave && self.leave_now(now, session, channel).unwrap_or(false)
    }

    /// Forgets the publish ids whose window has passed (an id is forgotten only by the
    /// entry that remembered it: the channel may have been reclaimed since, or the id
    /// withdrawn and taken again).
    fn expire_publish_ids(&mut self, now: Instant) {
        while let Some((until, channel, id)) =
            self.dedup_order.front().filter(|(until, ..)| *until <= now)
        {
            if let Some(ch) = self.channels.get_mut(channel) {
                if ch.recent.get(id).is_some_and(|(_, u)| u == until) {
                    ch.recent.remove(id);
                }
            }
            self.dedup_order.pop_front();
        }
    }

    /// With an announcement log: every critical publication is held (not delivered, and
    /// nothing of its channel after it) until [`ChannelHub::persisted`] says the log has it
    /// (PROTOCOL.md §12.5). Without (the default), announcements are kept in memory only.
    pub fn set_announcement_log(&mut self, on: bool) {
        self.announcement_log = on;
    }

    /// The announcement log answered for the held announcement at `position` of `channel`:
    /// with `written`, it is released for delivery; otherwise it is withdrawn as if never
    /// published (out of the queue, the history and the dedup window: a retry publishes it
    /// anew; its offset stays unused). Returns whether such an announcement was held.
    pub fn persisted(&mut self, channel: &str, position: ChannelPosition, written: bool) -> bool {
        let Some(ch) = self.channels.get_mut(channel) else {
            return false;
        };
        if ch.epoch != position.epoch {
            return false;
        }
        let Some(i) = ch.held_at(position.offset) else {
            return false;
        };
        self.held -= 1;
        if written {
            if let Some(Pending {
                item: PendingItem::Publication { held, .. },
                ..
            }) = ch.pending.get_mut(i)
            {
                *held = false;
            }
        } else {
            // Withdrawn everywhere: also from a joining member's recovery queued behind it.
            if let Some(Pending {
                item: PendingItem::Publication { class, event, .. },
                ..
            }) = ch.pending.remove(i)
            {
                ch.pending_by_class[class as usize] -= 1;
                self.pending_bytes -= event.len() as u64;
                let before = ch.pending.len();
                ch.pending.retain(
                    |p| !matches!(&p.item, PendingItem::Direct { event: e, .. } if *e == event),
                );
                ch.pending_direct -= before - ch.pending.len();
            }
            if let Some(i) = ch.history.iter().position(|s| s.offset == position.offset) {
                let before = ch.history_front();
                self.history_bytes -= ch.history.remove(i).map_or(0, |s| s.event.len() as u64);
                refront(&mut self.history_fronts, ch, before);
            }
            ch.recent.retain(|_, (p, _)| *p != position);
        }
        if !ch.scheduled && !ch.pending.is_empty() && !ch.blocked() {
            ch.scheduled = true;
            self.ready.push_back(ch.name.clone());
        }
        true
    }

    /// The configuration.
    pub fn config(&self) -> &ChannelsConfig {
        &self.config
    }

    fn next_epoch(&mut self) -> u64 {
        // splitmix64: distinct, well-spread values from one seed; never 0.
        loop {
            self.epoch_state = self.epoch_state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.epoch_state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            // Small enough to be exact in a JavaScript number (SDK), large enough to differ.
            let epoch = z >> 11;
            if epoch != 0 {
                return epoch;
            }
        }
    }

    /// Creates the channel named `name` if it does not exist, and marks it used.
    fn ensure_channel(&mut self, now: Instant, name: &str) -> Result<(), ChannelError> {
        let kind = channel_kind(name)?;
        if !self.channels.contains_key(name) {
            let policy = self
                .kinds
                .get(kind)
                .cloned()
                .ok_or(ChannelError::UnknownKind)?;
            if self.channels.len() >= self.config.max_channels {
                return Err(ChannelError::Limit);
            }
            let epoch = self.next_epoch();
            let name: Arc<str> = name.into();
            let limiter = TokenBucket::new(
                Rate::per_second(policy.publish_rate),
                policy.publish_burst,
                now,
            );
            self.stats.channels_created += 1;
            self.interest.changed(&name);
            self.channels.insert(
                name.clone(),
                Channel {
                    name,
                    policy,
                    epoch,
                    last_offset: 0,
                    history: VecDeque::new(),
                    pending: VecDeque::new(),
                    pending_by_class: [0; 3],
                    pending_direct: 0,
                    next_ticket: 0,
                    members: HashMap::new(),
                    scheduled: false,
                    limiter,
                    recent: HashMap::new(),
                    last_used: now,
                    departed: HashMap::new(),
                    departed_order: VecDeque::new(),
                    awaiting: self.interest.registered(),
                    created: now,
                },
            );
        }
        if let Some(ch) = self.channels.get_mut(name) {
            ch.last_used = now;
        }
        Ok(())
    }

    fn schedule(ready: &mut VecDeque<Arc<str>>, ch: &mut Channel) {
        if !ch.scheduled && !ch.pending.is_empty() && !ch.blocked() {
            ch.scheduled = true;
            ready.push_back(ch.name.clone());
        }
    }

    /// Publishes `body` to `channel`: checks it (size, rate, the class's queue), gives it
    /// the next offset (critical and normal: kept in the history) and queues it for every
    /// member live now. `request_id` (non-zero) makes a retry of the same publish answer
    /// with the first result instead of publishing twice.
    pub fn publish(
        &mut self,
        now: Instant,
        channel: &str,
        request_id: u64,
        class: TrafficClass,
        body: Bytes,
    ) -> Result<PublishReceipt, ChannelError> {
        self.expire_publish_ids(now);
        if let Some(ch) = self.channels.get(channel) {
            if let Some((position, _)) = ch.recent.get(&request_id).filter(|_| request_id != 0) {
                if ch.held_at(position.offset).is_some() {
                    return Err(ChannelError::Persisting);
                }
                self.stats.duplicates += 1;
                return Ok(PublishReceipt {
                    position: *position,
                    duplicate: true,
                    persist: None,
                });
            }
        }
        let dedup_until = now + Duration::from_secs(self.config.dedup_window_secs);
        // Checked before the channel is created: a publish refused for its size creates
        // none (each creation uses up one of `max_channels` and is told to every backend
        // link).
        let kind = channel_kind(channel)?;
        let max_body = match self.channels.get(channel) {
            Some(ch) => Some(ch.policy.max_body),
            None => self.kinds.get(kind).map(|policy| policy.max_body),
        };
        if max_body.is_some_and(|max| body.len() > max) {
            return Err(ChannelError::TooLarge);
        }
        self.ensure_channel(now, channel)?;
        let ch = self
            .channels
            .get_mut(channel)
            .ok_or(ChannelError::InvalidName)?;
        if ch.pending_by_class[class as usize] >= ch.policy.queue_cap(class)
            || self.pending_bytes + publication_len_bound(channel, body.len())
                > self.config.pending_budget_bytes
        {
            return Err(ChannelError::QueueFull);
        }
        if request_id != 0 && self.dedup_order.len() >= self.config.dedup_max_ids {
            // The edge remembers as many ids as it may, all younger than the window: one
            // more would forget one early (a resend of it published twice). Retry when the
            // oldest expires.
            let until = self.dedup_order.front().map_or(now, |(until, ..)| *until);
            return Err(ChannelError::RateLimited {
                retry_after_ms: waygate_backpressure::RetryAfter(
                    until.saturating_duration_since(now),
                )
                .as_millis_ceil_u32(),
            });
        }
        if let Err(wait) = ch.limiter.try_take(now, 1) {
            return Err(ChannelError::RateLimited {
                retry_after_ms: wait.as_millis_ceil_u32(),
            });
        }
        let recoverable = class != TrafficClass::BestEffort;
        let held = self.announcement_log && class == TrafficClass::Critical;
        let position = ChannelPosition {
            epoch: ch.epoch,
            offset: if recoverable { ch.last_offset + 1 } else { 0 },
        };
        let event = ChannelEvent {
            kind: ChannelEventKind::Publication,
            channel: ch.name.to_string(),
            position,
            body,
        }
        .to_bytes();
        if recoverable {
            ch.last_offset += 1;
            if ch.policy.history_len > 0 {
                let before = ch.history_front();
                self.history_bytes += event.len() as u64;
                ch.history.push_back(Stored {
                    offset: ch.last_offset,
                    at: now,
                    class,
                    event: event.clone(),
                });
                self.history_bytes -= ch.trim_history(now);
                refront(&mut self.history_fronts, ch, before);
            }
        }
        self.pending_bytes += event.len() as u64;
        let persist = held.then(|| AnnouncementRecord {
            channel: ch.name.clone(),
            position,
            event: event.clone(),
            ttl: Duration::from_millis(ch.policy.history_ttl_ms),
            keep: ch.policy.history_len,
        });
        ch.enqueue(PendingItem::Publication {
            class,
            event,
            at: now,
            offset: position.offset,
            held,
        });
        self.held += usize::from(held);
        if request_id != 0 {
            ch.recent.insert(request_id, (position, dedup_until));
            self.dedup_order
                .push_back((dedup_until, ch.name.clone(), request_id));
        }
        Self::schedule(&mut self.ready, ch);
        self.keep_history_budget(channel);
        Ok(PublishReceipt {
            position,
            duplicate: false,
            persist,
        })
    }

    /// Forgets kept publications until every channel's history fits
    /// `history_budget_bytes`: the oldest of `publishing` first (one that publishes past
    /// the budget recycles its own history), then the oldest of any channel. Its newest
    /// publication stays (the budget holds at least one of the largest).
    fn keep_history_budget(&mut self, publishing: &str) {
        while self.history_bytes > self.config.history_budget_bytes {
            let own = self
                .channels
                .get(publishing)
                .filter(|ch| ch.history.len() > 1)
                .map(|ch| ch.name.clone());
            let victim = own.or_else(|| {
                self.history_fronts
                    .iter()
                    .find(|(_, name)| &**name != publishing)
                    .map(|(_, name)| name.clone())
            });
            let Some(ch) = victim.and_then(|name| self.channels.get_mut(&name)) else {
                return;
            };
            let before = ch.history_front();
            let Some(stored) = ch.history.pop_front() else {
                return;
            };
            refront(&mut self.history_fronts, ch, before);
            self.history_bytes -= stored.event.len() as u64;
            self.stats.history_evicted += 1;
        }
    }

    /// Makes `session` a member of `channel`. With `since`, what it missed after that
    /// position is queued for it first (in offset order), or a HISTORY_LOST marker when the
    /// history no longer holds it (trimmed, or another epoch); without, a JOINED marker.
    /// Publications queued before the join and not recovered are not its to receive. A
    /// session already a member (or leaving: that cancels the leave) stays as it is.
    /// Returns the live position: the member receives every publication after it.
    pub fn join(
        &mut self,
        now: Instant,
        session: SessionId,
        player: &str,
        channel: &str,
        since: Option<ChannelPosition>,
    ) -> Result<(ChannelPosition, JoinOutcome), ChannelError> {
        // A join cancels a LEAVE taken (and deferred) before it.
        if let Some(j) = self.deferred_join(&session, channel) {
            j.leave_after = false;
        }
        self.join_with_logged(now, session, player, channel, since, &[])
    }

    /// Whether a join of `session` from `since` would need the announcement log: the
    /// position is of another epoch than the channel's here (another edge's, or before this
    /// edge restarted), so only the log can still hold the announcements after it. Never
    /// for a session already a member: its join ignores `since` (PROTOCOL.md §12.3).
    pub fn needs_logged(
        &self,
        session: SessionId,
        channel: &str,
        since: Option<ChannelPosition>,
    ) -> bool {
        let Some(since) = since else {
            return false;
        };
        if self
            .channels
            .get(channel)
            .is_some_and(|ch| ch.members.contains_key(&session))
        {
            return false;
        }
        // A name or kind the join will refuse reads nothing (the join answers the refusal).
        let known_kind = channel_kind(channel).is_ok_and(|k| self.config.kinds.contains_key(k));
        known_kind
            && self.announcement_log
            && since.epoch != 0
            && self
                .channels
                .get(channel)
                .is_none_or(|ch| ch.epoch != since.epoch)
    }

    /// As [`join`](Self::join), with `logged`: the announcements the announcement log holds
    /// after `since` in `since`'s epoch (encoded PUBLICATION events in offset order, as
    /// recorded; see [`needs_logged`](Self::needs_logged)). When `since` cannot be
    /// recovered from the history, those are queued for the member before its
    /// HISTORY_LOST: announcements are never lost with an edge, the rest is (PROTOCOL.md
    /// §12.4). Anything else in `logged` is ignored.
    pub fn join_with_logged(
        &mut self,
        now: Instant,
        session: SessionId,
        player: &str,
        channel: &str,
        since: Option<ChannelPosition>,
        logged: &[AnnouncementRecord],
    ) -> Result<(ChannelPosition, JoinOutcome), ChannelError> {
        let per_session = self.config.max_channels_per_session;
        let already = self
            .memberships
            .get(&session)
            .is_some_and(|chs| chs.iter().any(|c| &**c == channel));
        if !already
            && self
                .memberships
                .get(&session)
                .is_some_and(|chs| chs.len() >= per_session)
        {
            return Err(ChannelError::Limit);
        }
        self.ensure_channel(now, channel)?;
        let ch = self
            .channels
            .get_mut(channel)
            .ok_or(ChannelError::InvalidName)?;
        let before = ch.history_front();
        self.history_bytes -= ch.trim_history(now);
        refront(&mut self.history_fronts, ch, before);
        if let Some(m) = ch.members.get_mut(&session) {
            m.leaving_at = None;
            return Ok((ch.position(), JoinOutcome::AlreadyMember));
        }
        if ch.members.len() >= ch.policy.max_members {
            return Err(ChannelError::Limit);
        }
        // A returning member of a kind with backlog recovers from where it left. (Its
        // departed entry goes only once the join is taken: a join refused `queue_full`
        // below is retried, and must recover then too. It goes with any join taken, with
        // a `since` too: the memory is used once, PROTOCOL.md §12.4.)
        let from_backlog = since.is_none() && ch.policy.backlog;
        let since = match since {
            Some(p) => Some(p),
            None if from_backlog => ch.departed.get(player).map(|(p, _)| *p),
            None => None,
        };
        // What this join queues for the member alone, before its live publications.
        let mut direct: Vec<(TrafficClass, Bytes)> = Vec::new();
        let outcome = match since {
            None => {
                direct.push((TrafficClass::Critical, ch.marker(ChannelEventKind::Joined)));
                JoinOutcome::Joined
            }
            Some(p) if p.epoch == ch.epoch && p.offset == ch.last_offset => {
                direct.push((TrafficClass::Critical, ch.marker(ChannelEventKind::Joined)));
                JoinOutcome::Recovered { publications: 0 }
            }
            Some(p)
                if p.epoch == ch.epoch
                    && p.offset < ch.last_offset
                    && ch.history.front().is_some_and(|s| s.offset <= p.offset + 1) =>
            {
                for s in ch.history.iter().filter(|s| s.offset > p.offset) {
                    direct.push((s.class, s.event.clone()));
                }
                let publications = direct.len();
                direct.push((TrafficClass::Critical, ch.marker(ChannelEventKind::Joined)));
                JoinOutcome::Recovered { publications }
            }
            Some(p) => {
                let mut last = p.offset;
                for r in logged {
                    if &*r.channel == channel
                        && r.position.epoch == p.epoch
                        && p.epoch != ch.epoch
                        && r.position.offset > last
                    {
                        last = r.position.offset;
                        direct.push((TrafficClass::Critical, r.event.clone()));
                    }
                }
                self.stats.logged_recovered += direct.len() as u64;
                direct.push((
                    TrafficClass::Critical,
                    ch.marker(ChannelEventKind::HistoryLost),
                ));
                JoinOutcome::HistoryLost
            }
        };
        if ch.pending_direct + direct.len() > ch.policy.direct_cap() {
            return Err(ChannelError::QueueFull);
        }
        ch.departed.remove(player);
        let joined = ch.next_ticket + direct.len() as u64;
        for (class, event) in direct {
            ch.enqueue(PendingItem::Direct {
                member: session,
                joined,
                class,
                event,
                leave: false,
            });
        }
        debug_assert_eq!(joined, ch.next_ticket);
        ch.members.insert(
            session,
            Member {
                live_from: joined,
                leaving_at: None,
            },
        );
        let position = ch.position();
        let name = ch.name.clone();
        Self::schedule(&mut self.ready, ch);
        self.memberships.entry(session).or_default().push(name);
        match outcome {
            JoinOutcome::Recovered { publications } => {
                self.stats.recovered += publications as u64;
            }
            JoinOutcome::HistoryLost => self.stats.history_lost += 1,
            _ => {}
        }
        Ok((position, outcome))
    }

    /// Ends `session`'s membership of `channel`: it still receives what was queued before,
    /// then a LEFT marker. Not a member: nothing happens (`Ok(false)`); a kind this edge
    /// does not have is [`ChannelError::UnknownKind`], as for a join. While a join of that
    /// membership is deferred, the leave is taken (`Ok(true)`) and carried out right after
    /// it ([`deferred_join_done`](Self::deferred_join_done)).
    pub fn leave(
        &mut self,
        now: Instant,
        session: SessionId,
        channel: &str,
    ) -> Result<bool, ChannelError> {
        if !self.kinds.contains_key(channel_kind(channel)?) {
            return Err(ChannelError::UnknownKind);
        }
        if let Some(j) = self.deferred_join(&session, channel) {
            // A join carried out later came first: this leave follows it.
            j.leave_after = true;
            return Ok(true);
        }
        self.leave_now(now, session, channel)
    }

    /// [`leave`](Self::leave), not deferred.
    fn leave_now(
        &mut self,
        now: Instant,
        session: SessionId,
        channel: &str,
    ) -> Result<bool, ChannelError> {
        let Some(ch) = self.channels.get_mut(channel) else {
            return Ok(false);
        };
        let event = ch.marker(ChannelEventKind::Left);
        let Some(m) = ch.members.get(&session) else {
            return Ok(false);
        };
        if m.leaving_at.is_some() {
            return Ok(true);
        }
        let joined = m.live_from;
        ch.last_used = now;
        let ticket = ch.enqueue(PendingItem::Direct {
            member: session,
            joined,
            class: TrafficClass::Critical,
            event,
            leave: true,
        });
        if let Some(m) = ch.members.get_mut(&session) {
            m.leaving_at = Some(ticket);
        }
        Self::schedule(&mut self.ready, ch);
        Ok(true)
    }

    /// `player`'s session `session` ended for good: it is a member of nothing any more, and
    /// each channel of a kind with backlog remembers the position its client acknowledged
    /// (`acked`, per channel) for the player's next join.
    pub fn session_departed(
        &mut self,
        now: Instant,
        session: &SessionId,
        player: &str,
        acked: &BTreeMap<String, ChannelPosition>,
    ) {
        let cap = self.config.backlog_players;
        for name in self.memberships.get(session).cloned().unwrap_or_default() {
            let Some(ch) = self.channels.get_mut(&name) else {
                continue;
            };
            let Some(position) = acked.get(&*name).filter(|_| ch.policy.backlog && cap > 0) else {
                continue;
            };
            ch.trim_departed(now);
            let player: Arc<str> = player.into();
            if ch
                .departed
                .insert(player.clone(), (*position, now))
                .is_none()
            {
                ch.departed_order.push_back(player);
            }
            while ch.departed.len() > cap {
                match ch.departed_order.pop_front() {
                    Some(p) => {
                        ch.departed.remove(&p);
                    }
                    None => break,
                }
            }
            if ch.departed_order.len() > cap.saturating_mul(2) {
                // Names that joined again (or were listed twice) leave the order.
                let mut seen = std::collections::HashSet::new();
                let map = &ch.departed;
                ch.departed_order
                    .retain(|p| map.contains_key(p) && seen.insert(p.clone()));
            }
        }
        self.session_ended(session);
    }

    /// `session` ended (or left this edge): it is a member of nothing any more, at once.
    pub fn session_ended(&mut self, session: &SessionId) {
        for name in self.memberships.remove(session).unwrap_or_default() {
            if let Some(ch) = self.channels.get_mut(&name) {
                ch.members.remove(session);
            }
        }
    }

    fn forget_membership(&mut self, session: &SessionId, channel: &str) {
        if let Some(chs) = self.memberships.get_mut(session) {
            chs.retain(|c| &**c != channel);
            if chs.is_empty() {
                self.memberships.remove(session);
            }
        }
    }

    /// A session a delivery went to was not found: it is no longer a member of `channel`.
    pub fn member_gone(&mut self, channel: &str, session: &SessionId) {
        if let Some(ch) = self.channels.get_mut(channel) {
            ch.members.remove(session);
        }
        self.forget_membership(session, channel);
    }

    /// A channel that has work and no consumer yet: run one for it (it calls
    /// [`next_delivery`](Self::next_delivery) until that says `None`).
    pub fn poll_ready(&mut self) -> Option<Arc<str>> {
        self.ready.pop_front()
    }

    /// The channel's next delivery, in order. `None` when nothing is pending: its consumer
    /// ends, and the next publish asks for a new one through [`poll_ready`](Self::poll_ready).
    pub fn next_delivery(&mut self, channel: &str) -> Option<Delivery> {
        loop {
            let ch = self.channels.get_mut(channel)?;
            if ch.blocked() {
                // The announcement log has not confirmed the next one: `persisted` asks
                // for a consumer again.
                ch.scheduled = false;
                return None;
            }
            let Some(Pending { ticket, item }) = ch.pending.pop_front() else {
                ch.scheduled = false;
                return None;
            };
            match item {
                PendingItem::Publication {
                    class, event, at, ..
                } => {
                    ch.pending_by_class[class as usize] -= 1;
                    self.pending_bytes -= event.len() as u64;
                    let to = ch
                        .members
                        .iter()
                        .filter(|(_, m)| {
                            m.live_from <= ticket && m.leaving_at.is_none_or(|l| ticket < l)
                        })
                        .map(|(s, _)| *s)
                        .collect();
                    return Some(Delivery {
                        channel: ch.name.clone(),
                        class,
                        event,
                        to,
                        published_at: Some(at),
                    });
                }
                PendingItem::Direct {
                    member,
                    joined,
                    class,
                    event,
                    leave,
                } => {
                    ch.pending_direct -= 1;
                    let Some(m) = ch.members.get(&member).filter(|m| m.live_from == joined) else {
                        continue;
                    };
                    if leave {
                        if m.leaving_at != Some(ticket) {
                            // A join after the leave cancelled it.
                            continue;
                        }
                        ch.members.remove(&member);
                        let name = ch.name.clone();
                        self.forget_membership(&member, &name);
                        return Some(Delivery {
                            channel: name,
                            class,
                            event,
                            to: vec![member],
                            published_at: None,
                        });
                    }
                    return Some(Delivery {
                        channel: ch.name.clone(),
                        class,
                        event,
                        to: vec![member],
                        published_at: None,
                    });
                }
            }
        }
    }

    /// Trims histories by their TTL and drops channels idle for `idle_reclaim_ms` (no
    /// members, nothing pending, no live history). Returns how many were dropped. Call it
    /// about once a second.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let idle = Duration::from_millis(self.config.idle_reclaim_ms);
        for ch in self.channels.values_mut() {
            let before = ch.history_front();
            self.history_bytes -= ch.trim_history(now);
            refront(&mut self.history_fronts, ch, before);
            ch.trim_departed(now);
        }
        self.expire_publish_ids(now);
        let idle_names: Vec<Arc<str>> = self
            .channels
            .values()
            .filter(|ch| ch.is_idle(now, idle))
            .map(|ch| ch.name.clone())
            .collect();
        for name in &idle_names {
            if let Some(ch) = self.channels.remove(name) {
                if let Some(at) = ch.history_front() {
                    self.history_fronts.remove(&(at, ch.name.clone()));
                }
            }
            self.interest.changed(name);
        }
        let dropped = idle_names.len();
        self.stats.channels_reclaimed += dropped as u64;
        dropped
    }

    /// The channel's position, if it exists on this edge.
    pub fn position(&self, channel: &str) -> Option<ChannelPosition> {
        self.channels.get(channel).map(Channel::position)
    }

    /// Members of `channel` on this edge (leaving ones included until their LEFT).
    pub fn members(&self, channel: &str) -> usize {
        self.channels.get(channel).map_or(0, |c| c.members.len())
    }

    /// Channels that exist on this edge.
    pub fn channels(&self) -> usize {
        self.channels.len()
    }

    /// Announcements held until the announcement log has them, over all channels.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Publish ids remembered for dedup, over all channels (at most `dedup_max_ids`).
    pub fn publish_ids(&self) -> usize {
        self.dedup_order.len()
    }

    /// Items waiting for delivery, over all channels.
    pub fn pending(&self) -> usize {
        self.channels.values().map(|c| c.pending.len()).sum()
    }

    /// Publications waiting for delivery by channel kind and class (index: the class as
    /// `usize`), over every channel of that kind (markers for one member apart).
    pub fn pending_by_kind(&self) -> std::collections::BTreeMap<String, [usize; 3]> {
        let mut out = std::collections::BTreeMap::<String, [usize; 3]>::new();
        for (name, ch) in &self.channels {
            let kind = name.split(':').next().unwrap_or(name);
            let entry = out.entry(kind.to_owned()).or_default();
            for (sum, n) in entry.iter_mut().zip(ch.pending_by_class) {
                *sum += n;
            }
        }
        out
    }

    /// Bytes of the publications kept for recovery over all channels (at most
    /// `history_budget_bytes`).
    pub fn history_bytes(&self) -> u64 {
        self.history_bytes
    }

    /// Bytes of the publications waiting for their channels' consumers (at most
    /// `pending_budget_bytes`).
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes
    }

    /// Counters since the hub started.
    pub fn stats(&self) -> HubStats {
        self.stats
    }

    /// Checks the hub's internal consistency (tests call it after every step).
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.dedup_order.len() > self.config.dedup_max_ids {
            return Err("publish ids remembered over dedup_max_ids".into());
        }
        let (mut history, mut pending) = (0u64, 0u64);
        for ch in self.channels.values() {
            history += ch.history.iter().map(|s| s.event.len() as u64).sum::<u64>();
            pending += ch
                .pending
                .iter()
                .map(|p| match &p.item {
                    PendingItem::Publication { event, .. } => event.len() as u64,
                    PendingItem::Direct { .. } => 0,
                })
                .sum::<u64>();
        }
        let fronts: BTreeSet<(Instant, Arc<str>)> = self
            .channels
            .values()
            .filter_map(|ch| ch.history_front().map(|at| (at, ch.name.clone())))
            .collect();
        if fronts != self.history_fronts {
            return Err("the index of each channel's oldest kept publication drifted".into());
        }
        if history != self.history_bytes || pending != self.pending_bytes {
            return Err(format!(
                "byte counts drifted: history {history} counted {}, pending {pending} \
                 counted {}",
                self.history_bytes, self.pending_bytes
            ));
        }
        if self.history_bytes > self.config.history_budget_bytes
            || self.pending_bytes > self.config.pending_budget_bytes
        {
            return Err("channel bytes over their budget".into());
        }
        for (name, ch) in &self.channels {
            let mut by_class = [0usize; 3];
            let mut direct = 0;
            for p in &ch.pending {
                match &p.item {
                    PendingItem::Publication { class, .. } => by_class[*class as usize] += 1,
                    PendingItem::Direct { .. } => direct += 1,
                }
            }
            if by_class != ch.pending_by_class || direct != ch.pending_direct {
                return Err(format!("{name}: pending counts drifted"));
            }
            if ch.history.len() > ch.policy.history_len {
                return Err(format!("{name}: history over its cap"));
            }
            // Increasing up to the last offset (an announcement the log refused leaves its
            // offset unused: a hole).
            let offsets: Vec<u64> = ch.history.iter().map(|s| s.offset).collect();
            if offsets.windows(2).any(|w| w[1] <= w[0])
                || offsets.last().is_some_and(|&o| o > ch.last_offset)
            {
                return Err(format!("{name}: history out of order"));
            }
            if ch.members.len() > ch.policy.max_members {
                return Err(format!("{name}: members over the cap"));
            }
            // Every id remembered is forgotten by an entry of the hub's queue.
            if ch.recent.iter().any(|(id, (_, until))| {
                !self
                    .dedup_order
                    .iter()
                    .any(|(u, c, i)| u == until && c == name && i == id)
            }) {
                return Err(format!("{name}: a publish id no expiry will forget"));
            }
            if ch.departed.len() > self.config.backlog_players
                || ch.departed_order.len() > 2 * self.config.backlog_players.max(1) + 1
            {
                return Err(format!("{name}: departed players over the cap"));
            }
            if !ch.pending.is_empty() && !ch.scheduled && !ch.blocked() {
                return Err(format!("{name}: pending work without a consumer"));
            }
            if ch.awaiting.iter().any(|l| !self.interest.is_registered(*l)) {
                return Err(format!("{name}: waits for a link that is gone"));
            }
            for s in ch.members.keys() {
                let listed = self
                    .memberships
                    .get(s)
                    .is_some_and(|chs| chs.iter().any(|c| c == name));
                if !listed {
                    return Err(format!("{name}: member not in the membership index"));
                }
            }
        }
        for (s, chs) in &self.memberships {
            if chs.len() > self.config.max_channels_per_session {
                return Err("a session over its channel cap".into());
            }
            for c in chs {
                let member = self
                    .channels
                    .get(c)
                    .is_some_and(|ch| ch.members.contains_key(s));
                if !member {
                    return Err(format!("{c}: membership index lists a non-member"));
                }
            }
        }
        let held = self
            .channels
            .values()
            .flat_map(|c| &c.pending)
            .filter(|p| matches!(p.item, PendingItem::Publication { held: true, .. }))
            .count();
        if held != self.held {
            return Err(format!("{held} announcements held, {} counted", self.held));
        }
        if self.channels.len() > self.config.max_channels {
            return Err("channels over the cap".into());
        }
        Ok(())
    }
}

//! [`OutboundQueue`] (SPEC B3): a per-session outbound queue bounded by message count and
//! bytes, with three classes. Critical is never dropped (when it cannot be queued the session
//! must close as [`CloseCode::SlowConsumer`](waygate_protocol::CloseCode::SlowConsumer) and is kept for
//! resume), normal is refused when full, best-effort is dropped first and may coalesce
//! newest-wins by a caller-given key.

use std::collections::{HashMap, VecDeque};

use waygate_protocol::wire::TrafficClass;

/// Configuration of an [`OutboundQueue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboundConfig {
    /// Most messages queued, all classes together.
    pub max_messages: usize,
    /// Most bytes queued, all classes together. Must be at least the largest message.
    pub max_bytes: usize,
    /// Messages only critical may use: normal and best-effort see
    /// `max_messages - reserve_messages`.
    pub reserve_messages: usize,
    /// Bytes only critical may use (as `reserve_messages`).
    pub reserve_bytes: usize,
    /// Congested above this fill, in per-mille of the count or the byte bound (whichever is
    /// fuller).
    pub high_watermark_permille: u16,
    /// No longer congested once both count and bytes are below this fill (< high).
    pub low_watermark_permille: u16,
}

impl Default for OutboundConfig {
    fn default() -> Self {
        Self {
            max_messages: 1_024,
            max_bytes: 1024 * 1024,
            reserve_messages: 128,
            reserve_bytes: 128 * 1024,
            high_watermark_permille: 750,
            low_watermark_permille: 250,
        }
    }
}

impl OutboundConfig {
    /// Checks the values against the largest message the session sends.
    pub fn validate(&self, max_message_len: usize) -> Result<(), String> {
        if self.max_messages == 0 || self.reserve_messages >= self.max_messages {
            return Err("outbound: need max_messages > reserve_messages".into());
        }
        if self.reserve_bytes >= self.max_bytes
            || self.max_bytes - self.reserve_bytes < max_message_len
        {
            return Err(format!(
                "outbound: max_bytes - reserve_bytes must be >= the max frame size ({max_message_len})"
            ));
        }
        if self.low_watermark_permille >= self.high_watermark_permille
            || self.high_watermark_permille > 1000
        {
            return Err("outbound: need low_watermark < high_watermark <= 1000".into());
        }
        Ok(())
    }
}

/// The outcome of [`OutboundQueue::push`]. Items not queued are handed back.
#[derive(Debug, PartialEq, Eq)]
#[must_use]
pub enum PushOutcome<T> {
    /// Queued; nothing else was affected.
    Queued,
    /// A best-effort message replaced an older queued one with the same key (in its place
    /// when it fits there; otherwise the old one was removed and the new one queued last).
    Coalesced,
    /// Queued after evicting `evicted` older best-effort messages to make room.
    DroppedBestEffort {
        /// How many best-effort messages were evicted.
        evicted: usize,
    },
    /// Not queued (normal or best-effort, no room even after evicting all best-effort).
    /// A best-effort item refused is counted as dropped; a normal one as refused. (A
    /// best-effort item that replaced a same-key one which did not fit in place and then does
    /// not fit at all loses both: newest-wins, and the newest cannot be held.)
    Refused {
        /// The message, handed back.
        item: T,
    },
    /// A critical message could not be queued: close the session as
    /// [`CloseCode::SlowConsumer`](waygate_protocol::CloseCode::SlowConsumer) and keep it (with this
    /// item and the queued sequenced messages) for resume.
    SlowConsumer {
        /// The message, handed back.
        item: T,
    },
}

/// A message taken from the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Popped<T> {
    /// The message.
    pub item: T,
    /// Its class.
    pub class: TrafficClass,
    /// Its size as given to `push`.
    pub len: usize,
}

/// Counters of one class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassStats {
    /// Messages accepted into the queue (coalesced replacements included).
    pub queued: u64,
    /// Messages dropped (best-effort only: evicted or refused; critical and normal never).
    pub dropped: u64,
    /// Queued messages replaced by a newer one with the same key (best-effort only).
    pub coalesced: u64,
    /// Pushes refused (normal) or that made the session a slow consumer (critical).
    pub refused: u64,
    /// Messages popped.
    pub popped: u64,
}

/// Counters of an [`OutboundQueue`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboundStats {
    /// Per class, indexed by `TrafficClass as usize` (see [`OutboundStats::class`]).
    pub classes: [ClassStats; 3],
    /// Times the queue went above its high watermark.
    pub congested_episodes: u64,
    /// Most bytes ever queued.
    pub peak_bytes: u64,
    /// Most messages ever queued.
    pub peak_messages: u64,
}

impl OutboundStats {
    /// The counters of `class`.
    pub fn class(&self, class: TrafficClass) -> &ClassStats {
        &self.classes[class as usize]
    }
}

#[derive(Debug)]
struct Entry<T> {
    item: T,
    len: usize,
    /// Coalescing key (best-effort only).
    key: Option<u64>,
    /// Push sequence within the class (strictly increasing along the deque).
    seq: u64,
}

/// A per-session bounded priority queue (sans-IO; the session's writer owns it).
///
/// Pops go critical, then normal, then best-effort; FIFO within a class. Bounds
/// (`max_messages`, `max_bytes`) hold after every call.
#[derive(Debug)]
pub struct OutboundQueue<T> {
    config: OutboundConfig,
    classes: [VecDeque<Entry<T>>; 3],
    class_bytes: [usize; 3],
    /// Best-effort key -> seq of the queued entry with that key (made by the first keyed
    /// push: most sessions never have one, performance issue W4; boxed, as an empty map
    /// is 48 bytes inline).
    #[allow(clippy::box_collection)]
    keys: Option<Box<HashMap<u64, u64>>>,
    next_seq: u64,
    messages: usize,
    bytes: usize,
    high_messages: usize,
    high_bytes: usize,
    low_messages: usize,
    low_bytes: usize,
    congested: bool,
    stats: StatsSlot,
}

/// A queue's counters ([`OutboundStats`]): kept in this crate's tests, which check the
/// queue's promises through them. Nothing in the edge reads a session's own counters (its
/// drops and losses are counted by the session host), so its queues keep none: 144 bytes
/// less per session (performance issue, W4).
#[derive(Debug, Default)]
struct StatsSlot {
    #[cfg(test)]
    stats: OutboundStats,
}

impl StatsSlot {
    /// Applies `count` to the counters, if kept.
    #[inline]
    fn count(&mut self, count: impl FnOnce(&mut OutboundStats)) {
        #[cfg(test)]
        count(&mut self.stats);
        #[cfg(not(test))]
        let _ = count;
    }
}

const CRIT: usize = TrafficClass::Critical as usize;
const NORM: usize = TrafficClass::Normal as usize;
const BEST: usize = TrafficClass::BestEffort as usize;

fn permille(total: usize, p: u16) -> usize {
    (total as u128 * u128::from(p) / 1000) as usize
}

impl<T> OutboundQueue<T> {
    /// An empty queue (validate the config first).
    pub fn new(config: OutboundConfig) -> Self {
        Self {
            classes: [VecDeque::new(), VecDeque::new(), VecDeque::new()],
            class_bytes: [0; 3],
            keys: None,
            next_seq: 0,
            messages: 0,
            bytes: 0,
            high_messages: permille(config.max_messages, config.high_watermark_permille),
            high_bytes: permille(config.max_bytes, config.high_watermark_permille),
            low_messages: permille(config.max_messages, config.low_watermark_permille),
            low_bytes: permille(config.max_bytes, config.low_watermark_permille),
            congested: false,
            stats: StatsSlot::default(),
            config,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &OutboundConfig {
        &self.config
    }

    /// Messages queued.
    pub fn len(&self) -> usize {
        self.messages
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.messages == 0
    }

    /// Bytes queued.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Messages queued in `class`.
    pub fn class_len(&self, class: TrafficClass) -> usize {
        self.classes[class as usize].len()
    }

    /// Bytes queued in `class`.
    pub fn class_bytes(&self, class: TrafficClass) -> usize {
        self.class_bytes[class as usize]
    }

    /// The counters (kept in this crate's tests only: see `StatsSlot`).
    #[cfg(test)]
    pub(crate) fn stats(&self) -> &OutboundStats {
        &self.stats.stats
    }

    /// Above the high watermark, and not yet back below the low one.
    pub fn is_congested(&self) -> bool {
        self.congested
    }

    /// Queues `item` of `len` bytes in `class`. `coalesce_key` applies to best-effort only
    /// (ignored otherwise): a queued best-effort message with the same key is replaced.
    pub fn push(
        &mut self,
        class: TrafficClass,
        item: T,
        len: usize,
        coalesce_key: Option<u64>,
    ) -> PushOutcome<T> {
        let outcome = match class {
            TrafficClass::BestEffort => self.push_best_effort(item, len, coalesce_key),
            TrafficClass::Normal => self.push_sequenced(NORM, item, len),
            TrafficClass::Critical => self.push_sequenced(CRIT, item, len),
        };
        self.update_watermarks();
        outcome
    }

    /// Limits for `class`: (messages, bytes).
    fn limits(&self, class: usize) -> (usize, usize) {
        if class == CRIT {
            (self.config.max_messages, self.config.max_bytes)
        } else {
            (
                self.config
                    .max_messages
                    .saturating_sub(self.config.reserve_messages),
                self.config
                    .max_bytes
                    .saturating_sub(self.config.reserve_bytes),
            )
        }
    }

    /// Whether one more message of `len` bytes fits in `class` once all best-effort is gone.
    fn fits_after_evicting_best_effort(&self, class: usize, len: usize) -> bool {
        let (max_m, max_b) = self.limits(class);
        let m = self.messages - self.classes[BEST].len();
        let b = self.bytes - self.class_bytes[BEST];
        m < max_m && b.saturating_add(len) <= max_b
    }

    fn fits(&self, class: usize, len: usize) -> bool {
        let (max_m, max_b) = self.limits(class);
        self.messages < max_m && self.bytes.saturating_add(len) <= max_b
    }

    /// Evicts oldest best-effort until `len` fits in `class` (caller checked it can).
    fn evict_for(&mut self, class: usize, len: usize) -> usize {
        let mut evicted = 0;
        while !self.fits(class, len) {
            if self.pop_class(BEST).is_none() {
                break;
            }
            self.stats.count(|s| s.classes[BEST].dropped += 1);
            evicted += 1;
        }
        evicted
    }

    fn enqueue(&mut self, class: usize, item: T, len: usize, key: Option<u64>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(k) = key {
            self.keys.get_or_insert_with(Box::default).insert(k, seq);
        }
        self.classes[class].push_back(Entry {
            item,
            len,
            key,
            seq,
        });
        self.class_bytes[class] += len;
        self.messages += 1;
        self.bytes += len;
        let (bytes, messages) = (self.bytes as u64, self.messages as u64);
        self.stats.count(|s| {
            s.classes[class].queued += 1;
            s.peak_bytes = s.peak_bytes.max(bytes);
            s.peak_messages = s.peak_messages.max(messages);
        });
    }

    fn push_sequenced(&mut self, class: usize, item: T, len: usize) -> PushOutcome<T> {
        if !self.fits_after_evicting_best_effort(class, len) {
            self.stats.count(|s| s.classes[class].refused += 1);
            return if class == CRIT {
                PushOutcome::SlowConsumer { item }
            } else {
                PushOutcome::Refused { item }
            };
        }
        let evicted = self.evict_for(class, len);
        self.enqueue(class, item, len, None);
        if evicted == 0 {
            PushOutcome::Queued
        } else {
            PushOutcome::DroppedBestEffort { evicted }
        }
    }

    fn push_best_effort(&mut self, item: T, len: usize, key: Option<u64>) -> PushOutcome<T> {
        let mut coalesced = false;
        if let Some(k) = key {
            if let Some(&seq) = self.keys.as_ref().and_then(|keys| keys.get(&k)) {
                if let Ok(idx) = self.classes[BEST].binary_search_by_key(&seq, |e| e.seq) {
                    let old_len = self.classes[BEST][idx].len;
                    let (_, max_b) = self.limits(BEST);
                    let others = self.bytes - old_len;
                    if others.saturating_add(len) <= max_b {
                        // In place: keeps its position, count unchanged.
                        let entry = &mut self.classes[BEST][idx];
                        entry.item = item;
                        entry.len = len;
                        self.class_bytes[BEST] = self.class_bytes[BEST] - old_len + len;
                        self.bytes = others + len;
                        let bytes = self.bytes as u64;
                        self.stats.count(|s| {
                            s.classes[BEST].coalesced += 1;
                            s.classes[BEST].queued += 1;
                            s.peak_bytes = s.peak_bytes.max(bytes);
                        });
                        return PushOutcome::Coalesced;
                    }
                    // Does not fit in place: the old value goes, the new one is queued anew.
                    if let Some(old) = self.classes[BEST].remove(idx) {
                        self.forget(BEST, &old);
                    }
                    self.stats.count(|s| s.classes[BEST].coalesced += 1);
                    coalesced = true;
                }
            }
        }
        if !self.fits_after_evicting_best_effort(BEST, len) {
            self.stats.count(|s| s.classes[BEST].dropped += 1);
            return PushOutcome::Refused { item };
        }
        let evicted = self.evict_for(BEST, len);
        self.enqueue(BEST, item, len, key);
        match (evicted, coalesced) {
            (0, true) => PushOutcome::Coalesced,
            (0, false) => PushOutcome::Queued,
            (evicted, _) => PushOutcome::DroppedBestEffort { evicted },
        }
    }

    /// Accounting for an entry that left `class`.
    fn forget(&mut self, class: usize, entry: &Entry<T>) {
        self.class_bytes[class] -= entry.len;
        self.messages -= 1;
        self.bytes -= entry.len;
        if let (Some(k), Some(keys)) = (entry.key, self.keys.as_mut()) {
            if keys.get(&k) == Some(&entry.seq) {
                keys.remove(&k);
            }
        }
    }

    fn pop_class(&mut self, class: usize) -> Option<Popped<T>> {
        let entry = self.classes[class].pop_front()?;
        if self.classes[class].is_empty() {
            // Emptied: an idle session's queue holds no buffer.
            self.classes[class] = VecDeque::new();
        }
        self.forget(class, &entry);
        Some(Popped {
            item: entry.item,
            class: TrafficClass::ALL[class],
            len: entry.len,
        })
    }

    /// Takes the next message: critical first, then normal, then best-effort; FIFO within
    /// a class.
    pub fn pop(&mut self) -> Option<Popped<T>> {
        let class = (0..3).find(|&c| !self.classes[c].is_empty())?;
        let popped = self.pop_class(class);
        self.stats.count(|s| s.classes[class].popped += 1);
        self.update_watermarks();
        popped
    }

    /// Takes the oldest message of any class (push order; a best-effort message coalesced
    /// in place keeps its place): for a consumer that must not let a later message overtake
    /// an earlier one, while the bounds still treat the classes apart.
    pub fn pop_in_order(&mut self) -> Option<Popped<T>> {
        let class = (0..3)
            .filter_map(|c| self.classes[c].front().map(|e| (e.seq, c)))
            .min()?
            .1;
        let popped = self.pop_class(class);
        self.stats.count(|s| s.classes[class].popped += 1);
        self.update_watermarks();
        popped
    }

    /// Removes everything in push order (see [`pop_in_order`](Self::pop_in_order)).
    pub fn drain_in_order(&mut self) -> impl Iterator<Item = Popped<T>> + '_ {
        std::iter::from_fn(move || self.pop_in_order())
    }

    /// The class [`pop`](Self::pop) would take from next.
    pub fn peek_class(&self) -> Option<TrafficClass> {
        (0..3)
            .find(|&c| !self.classes[c].is_empty())
            .map(|c| TrafficClass::ALL[c])
    }

    /// Drops every queued best-effort message (overload level 1); returns how many.
    pub fn shed_best_effort(&mut self) -> usize {
        let n = self.classes[BEST].len();
        while self.pop_class(BEST).is_some() {}
        self.stats.count(|s| s.classes[BEST].dropped += n as u64);
        self.update_watermarks();
        n
    }

    /// Removes everything, in pop order (for handing sequenced messages to the replay
    /// buffer when the session closes); best-effort is included for the caller to discard.
    pub fn drain(&mut self) -> impl Iterator<Item = Popped<T>> + '_ {
        std::iter::from_fn(move || self.pop())
    }

    fn update_watermarks(&mut self) {
        if self.congested {
            if self.messages < self.low_messages.max(1) && self.bytes < self.low_bytes.max(1) {
                self.congested = false;
            }
        } else if self.messages > self.high_messages || self.bytes > self.high_bytes {
            self.congested = true;
            self.stats.count(|s| s.congested_episodes += 1);
        }
    }
}

#[cfg(test)]
mod tests;

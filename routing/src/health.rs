//! Instance health with flap damping (SPEC R7).
//!
//! * An instance is up as soon as it is tracked or heartbeats: joining needs no confirmation.
//! * It is down only after `missed_heartbeats` consecutive heartbeat intervals without one.
//! * The view the router uses (the set of down instances) is republished at most once per
//!   `min_rebuild_interval`; changes in between wait for the next slot, so a flapping
//!   instance cannot make the table rebuild more often than that.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Settings of a [`HealthTracker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthConfig {
    /// Expected time between an instance's heartbeats.
    pub heartbeat_interval: Duration,
    /// Consecutive missed heartbeats before an instance is declared down (K, at least 1).
    pub missed_heartbeats: u32,
    /// Minimum time between two published health views (table rebuilds).
    pub min_rebuild_interval: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(2),
            missed_heartbeats: 3,
            min_rebuild_interval: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    last_seen: Instant,
}

/// A published health view: which tracked instances are down.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealthView {
    /// Instances declared down.
    pub down: BTreeSet<String>,
    /// Increases by one on every publication.
    pub generation: u64,
}

/// Tracks heartbeats and publishes damped health views; sans-IO, time passed in.
#[derive(Debug, Clone)]
pub struct HealthTracker {
    cfg: HealthConfig,
    entries: BTreeMap<String, Entry>,
    published: HealthView,
    last_publish: Option<Instant>,
}

impl HealthTracker {
    /// A tracker with no instances.
    #[must_use]
    pub fn new(cfg: HealthConfig) -> Self {
        Self {
            cfg,
            entries: BTreeMap::new(),
            published: HealthView::default(),
            last_publish: None,
        }
    }

    /// Settings in force.
    #[must_use]
    pub fn config(&self) -> &HealthConfig {
        &self.cfg
    }

    /// Starts tracking `id` as if it had just heartbeated (a grace period of K intervals);
    /// an already tracked instance is left as it is.
    pub fn track(&mut self, id: &str, now: Instant) {
        self.entries
            .entry(id.to_owned())
            .or_insert(Entry { last_seen: now });
    }

    /// Tracks exactly `ids` (the instances of the table in force): new ones start up,
    /// vanished ones are forgotten.
    pub fn sync<'a>(&mut self, ids: impl IntoIterator<Item = &'a str>, now: Instant) {
        let keep: BTreeSet<&str> = ids.into_iter().collect();
        self.entries.retain(|k, _| keep.contains(k.as_str()));
        for id in keep {
            self.track(id, now);
        }
    }

    /// Records a heartbeat; an unknown or down instance is up again at once.
    pub fn heartbeat(&mut self, id: &str, now: Instant) {
        let e = self
            .entries
            .entry(id.to_owned())
            .or_insert(Entry { last_seen: now });
        e.last_seen = e.last_seen.max(now);
    }

    /// Consecutive heartbeat intervals `id` has missed at `now`.
    #[must_use]
    pub fn missed(&self, id: &str, now: Instant) -> Option<u32> {
        let e = self.entries.get(id)?;
        let gap = now.saturating_duration_since(e.last_seen);
        let iv = self.cfg.heartbeat_interval.as_nanos().max(1);
        Some(u32::try_from(gap.as_nanos() / iv).unwrap_or(u32::MAX))
    }

    /// The raw (undamped by the rebuild interval) state: down after K missed heartbeats.
    #[must_use]
    pub fn is_down_now(&self, id: &str, now: Instant) -> bool {
        self.missed(id, now)
            .is_some_and(|m| m >= self.cfg.missed_heartbeats.max(1))
    }

    /// The currently published view.
    #[must_use]
    pub fn view(&self) -> &HealthView {
        &self.published
    }

    /// Publishes a new view if the down set changed and the rebuild interval allows;
    /// returns it. Call on every tick.
    pub fn poll_rebuild(&mut self, now: Instant) -> Option<&HealthView> {
        let down: BTreeSet<String> = self
            .entries
            .keys()
            .filter(|id| self.is_down_now(id, now))
            .cloned()
            .collect();
        if down == self.published.down {
            return None;
        }
        if let Some(last) = self.last_publish {
            if now.saturating_duration_since(last) < self.cfg.min_rebuild_interval {
                return None;
            }
        }
        self.last_publish = Some(now);
        self.published.down = down;
        self.published.generation += 1;
        Some(&self.published)
    }

    /// The next instant at which [`HealthTracker::poll_rebuild`] may publish something
    /// (a pending change at the next rebuild slot, else the next missed-heartbeat deadline).
    #[must_use]
    pub fn poll_timeout(&self, now: Instant) -> Option<Instant> {
        let slot = self
            .last_publish
            .map_or(now, |l| (l + self.cfg.min_rebuild_interval).max(now));
        let pending = self
            .entries
            .keys()
            .any(|id| self.is_down_now(id, now) != self.published.down.contains(id));
        if pending {
            return Some(slot);
        }
        let k = self.cfg.missed_heartbeats.max(1);
        self.entries
            .iter()
            .filter(|(id, _)| !self.published.down.contains(*id))
            .map(|(_, e)| e.last_seen + self.cfg.heartbeat_interval * k)
            .min()
            .map(|d| d.max(slot))
    }
}

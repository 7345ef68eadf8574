//! [`OverloadGovernor`] (SPEC B5): global overload levels 0..=3 from the event loop's lag,
//! session count and process memory, with per-level enter/exit thresholds (hysteresis) and a
//! minimum dwell before falling. Level 1 sheds best-effort, level 2 also refuses new sessions
//! (resumes of existing ones are still taken), level 3 also refuses every new connection.
//! Plus the default session cap (B5): half the file-descriptor soft limit, read by a separate
//! non-sans-IO helper.

use std::time::{Duration, Instant};

/// An overload level. Levels are cumulative: each does what the ones below do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(u8)]
pub enum OverloadLevel {
    /// Normal operation.
    #[default]
    Normal = 0,
    /// Shed best-effort traffic.
    ShedBestEffort = 1,
    /// Also refuse new sessions (logins); resumes of existing sessions are taken.
    RefuseNewSessions = 2,
    /// Also refuse new connections.
    RefuseConnections = 3,
}

impl OverloadLevel {
    /// All levels, lowest first.
    pub const ALL: [OverloadLevel; 4] = [
        Self::Normal,
        Self::ShedBestEffort,
        Self::RefuseNewSessions,
        Self::RefuseConnections,
    ];

    /// The numeric level (the metric value).
    pub fn as_u8(self) -> u8 {
        self as u8
    }

    /// Stable label for logs and /healthz.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "normal",
            Self::ShedBestEffort => "shed_best_effort",
            Self::RefuseNewSessions => "refuse_new_sessions",
            Self::RefuseConnections => "refuse_connections",
        }
    }
}

/// Enter/exit thresholds of one input for one level: the level is entered when the input is
/// `>= enter` and left only once it is `< exit` (with `exit <= enter`). `u64::MAX` as
/// `enter` disables the input for that level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Threshold {
    /// Enter at or above.
    pub enter: u64,
    /// Leave below.
    pub exit: u64,
}

impl Threshold {
    /// Never triggers.
    pub const DISABLED: Threshold = Threshold {
        enter: u64::MAX,
        exit: u64::MAX,
    };

    /// Enter at `enter`, leave below `exit`.
    pub fn new(enter: u64, exit: u64) -> Self {
        Self { enter, exit }
    }
}

/// Thresholds of one level (any input at or above its `enter` raises the level).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LevelThresholds {
    /// How late the edge's event loop runs a timer, milliseconds (sustained: the shell
    /// passes the least lag of its recent samples).
    pub loop_lag_ms: Threshold,
    /// Sessions on the edge.
    pub sessions: Threshold,
    /// Process resident memory, bytes.
    pub memory_bytes: Threshold,
}

impl LevelThresholds {
    /// No input triggers this level.
    pub const DISABLED: LevelThresholds = LevelThresholds {
        loop_lag_ms: Threshold::DISABLED,
        sessions: Threshold::DISABLED,
        memory_bytes: Threshold::DISABLED,
    };

    fn pairs(&self, inputs: &OverloadInputs) -> [(u64, Threshold); 3] {
        [
            (inputs.loop_lag_ms, self.loop_lag_ms),
            (inputs.sessions, self.sessions),
            (inputs.memory_bytes, self.memory_bytes),
        ]
    }

    fn entered(&self, inputs: &OverloadInputs) -> bool {
        self.pairs(inputs)
            .iter()
            .any(|&(v, t)| t.enter != u64::MAX && v >= t.enter)
    }

    fn held(&self, inputs: &OverloadInputs) -> bool {
        self.pairs(inputs)
            .iter()
            .any(|&(v, t)| t.enter != u64::MAX && v >= t.exit)
    }
}

/// The event-loop lag at which [`GovernorConfig::default`] refuses new connections (level
/// 3), milliseconds: a loop a second late on every timer for a while is saturated, and new
/// sessions would only add to what its live sessions wait for.
pub const DEFAULT_REFUSE_LAG_MS: u64 = 1_000;

/// Configuration of the [`OverloadGovernor`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GovernorConfig {
    /// Thresholds for levels 1, 2 and 3 (index 0 is level 1).
    pub levels: [LevelThresholds; 3],
    /// Least time at a level before falling (rising is immediate).
    pub min_dwell: Duration,
    /// Retry-after hint for new sessions refused at level 2 and connections at level 3.
    pub refuse_retry_after: Duration,
}

impl Default for GovernorConfig {
    fn default() -> Self {
        Self::for_limits(
            default_session_cap(),
            1024 * 1024 * 1024,
            DEFAULT_REFUSE_LAG_MS,
        )
    }
}

impl GovernorConfig {
    /// Thresholds derived from a session cap, a memory budget and an event-loop lag: sessions
    /// at 70/85/95 % of the cap and memory at 60/75/90 % of the budget, each exiting 10
    /// points lower; loop lag at a quarter, half and all of `refuse_lag_ms`, each exiting
    /// below half its enter (0 turns the lag input off).
    pub fn for_limits(session_cap: u64, memory_budget: u64, refuse_lag_ms: u64) -> Self {
        let pct = |total: u64, p: u64| (u128::from(total) * u128::from(p) / 100) as u64;
        let t =
            |total: u64, p: u64| Threshold::new(pct(total, p), pct(total, p.saturating_sub(10)));
        let lag = |part: u64| match refuse_lag_ms / part {
            0 => Threshold::DISABLED,
            enter => Threshold::new(enter, enter / 2),
        };
        let level = |s: u64, m: u64, l: u64| LevelThresholds {
            loop_lag_ms: lag(l),
            sessions: t(session_cap, s),
            memory_bytes: t(memory_budget, m),
        };
        Self {
            levels: [level(70, 60, 4), level(85, 75, 2), level(95, 90, 1)],
            min_dwell: Duration::from_secs(5),
            refuse_retry_after: Duration::from_secs(5),
        }
    }

    /// Checks exit <= enter and that each level's enter is not below the previous level's.
    pub fn validate(&self) -> Result<(), String> {
        for (i, l) in self.levels.iter().enumerate() {
            for (name, t) in [
                ("loop_lag_ms", l.loop_lag_ms),
                ("sessions", l.sessions),
                ("memory_bytes", l.memory_bytes),
            ] {
                if t.exit > t.enter {
                    return Err(format!("governor: level {} {name}: exit > enter", i + 1));
                }
            }
        }
        for w in self.levels.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            if b.loop_lag_ms.enter < a.loop_lag_ms.enter
                || b.sessions.enter < a.sessions.enter
                || b.memory_bytes.enter < a.memory_bytes.enter
            {
                return Err("governor: thresholds must not decrease with the level".into());
            }
        }
        Ok(())
    }
}

/// One observation of the governor's inputs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OverloadInputs {
    /// How late the event loop runs a timer, milliseconds (sustained).
    pub loop_lag_ms: u64,
    /// Sessions on the edge.
    pub sessions: u64,
    /// Process resident memory, bytes (0 if unknown).
    pub memory_bytes: u64,
}

/// Samples one sustained lag is taken over ([`LoopLag`]).
pub const LOOP_LAG_SAMPLES: usize = 5;

/// The event loop's sustained lag, for [`OverloadInputs::loop_lag_ms`]: the shell ticks a
/// timer and tells each tick when it was due and when it ran; the sustained lag is the
/// *least* lag of the last [`LOOP_LAG_SAMPLES`] ticks, so one slow turn (a burst, a page
/// fault) raises nothing, while a loop late on every tick for that long does.
#[derive(Debug, Clone, Default)]
pub struct LoopLag {
    /// The last samples, ms (a slot not sampled yet holds 0: no sustained lag before the
    /// window is full).
    samples: [u64; LOOP_LAG_SAMPLES],
    next: usize,
}

impl LoopLag {
    /// A tick due at `due` ran at `now`.
    pub fn sample(&mut self, due: Instant, now: Instant) {
        let lag = now.saturating_duration_since(due).as_millis();
        self.samples[self.next] = u64::try_from(lag).unwrap_or(u64::MAX);
        self.next = (self.next + 1) % LOOP_LAG_SAMPLES;
    }

    /// The sustained lag in milliseconds (0 until the window is full).
    pub fn sustained_ms(&self) -> u64 {
        self.samples.iter().copied().min().unwrap_or(0)
    }
}

/// Counters of the [`OverloadGovernor`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GovernorStats {
    /// Times each level was entered (index = level).
    pub entered: [u64; 4],
    /// Level changes, up or down.
    pub changes: u64,
    /// Falls held back by the dwell time.
    pub falls_deferred: u64,
}

/// The global overload governor (sans-IO; observe it from a periodic tick).
#[derive(Debug, Clone)]
pub struct OverloadGovernor {
    config: GovernorConfig,
    level: OverloadLevel,
    since: Instant,
    last_inputs: OverloadInputs,
    stats: GovernorStats,
}

impl OverloadGovernor {
    /// A governor at level 0 at `now`.
    pub fn new(config: GovernorConfig, now: Instant) -> Self {
        Self {
            config,
            level: OverloadLevel::Normal,
            since: now,
            last_inputs: OverloadInputs::default(),
            stats: GovernorStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &GovernorConfig {
        &self.config
    }

    /// Feeds the current inputs and returns the (possibly new) level. Rises at once to the
    /// highest level whose `enter` any input reaches; falls only after `min_dwell` at the
    /// current level, to the highest level still held (some input `>= exit`).
    pub fn observe(&mut self, now: Instant, inputs: OverloadInputs) -> OverloadLevel {
        self.last_inputs = inputs;
        let entered = (1..=3)
            .rev()
            .find(|&l| self.config.levels[l - 1].entered(&inputs))
            .unwrap_or(0);
        let held = (1..=3)
            .rev()
            .find(|&l| self.config.levels[l - 1].held(&inputs))
            .unwrap_or(0);
        let current = self.level as usize;
        let target = if entered > current {
            entered
        } else if held < current {
            if now.saturating_duration_since(self.since) >= self.config.min_dwell {
                held.max(entered)
            } else {
                self.stats.falls_deferred += 1;
                current
            }
        } else {
            current
        };
        if target != current {
            self.level = OverloadLevel::ALL[target];
            self.since = now;
            self.stats.changes += 1;
            self.stats.entered[target] += 1;
        }
        self.level
    }

    /// The current level.
    pub fn level(&self) -> OverloadLevel {
        self.level
    }

    /// When the current level was entered.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// The inputs last observed.
    pub fn last_inputs(&self) -> OverloadInputs {
        self.last_inputs
    }

    /// The counters.
    pub fn stats(&self) -> GovernorStats {
        self.stats
    }

    /// Level >= 1: do not queue best-effort (and shed what is queued).
    pub fn shed_best_effort(&self) -> bool {
        self.level >= OverloadLevel::ShedBestEffort
    }

    /// Level 2 and above: refuse a new session (a login) with OVERLOADED and this
    /// retry-after; a resume of an existing session is still taken, so the players already
    /// on the edge get back first.
    pub fn refuse_new_sessions(&self) -> Option<Duration> {
        (self.level >= OverloadLevel::RefuseNewSessions).then_some(self.config.refuse_retry_after)
    }

    /// Level 3: refuse new connections with OVERLOADED and this retry-after.
    pub fn refuse_new_connections(&self) -> Option<Duration> {
        (self.level >= OverloadLevel::RefuseConnections).then_some(self.config.refuse_retry_after)
    }
}

// ---- the B5 session cap; not sans-IO (reads /proc) ----

/// Session cap when the file-descriptor limit cannot be read: half of the common default
/// soft limit of 1024.
pub const FALLBACK_SESSION_CAP: u64 = 512;

/// The fd count assumed when the soft limit is "unlimited" (Linux's default `nr_open`).
pub const UNLIMITED_FDS_ASSUMED: u64 = 1_048_576;

/// The "Max open files" soft limit from the text of `/proc/self/limits`; `Some(None)` when
/// it says "unlimited", `None` when the line is missing or malformed.
pub fn parse_fd_soft_limit(limits: &str) -> Option<Option<u64>> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line
        .strip_prefix("Max open files")?
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        return Some(None);
    }
    soft.parse().ok().map(Some)
}

/// The B5 default session cap for a soft fd limit: half of it (the rest is headroom for
/// bursts, backend links and files), at least 1.
pub fn session_cap_for_fd_limit(soft_limit: Option<u64>) -> u64 {
    (soft_limit.unwrap_or(UNLIMITED_FDS_ASSUMED) / 2).max(1)
}

/// The process's file-descriptor soft limit, read from `/proc/self/limits` (Linux); `None`
/// if unknown. Blocking file I/O: call at start-up, not on a hot path.
pub fn fd_soft_limit() -> Option<Option<u64>> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    parse_fd_soft_limit(&text)
}

/// The B5 default session cap: half the fd soft limit, or [`FALLBACK_SESSION_CAP`] when
/// it cannot be read. Reads `/proc`: call at start-up.
pub fn default_session_cap() -> u64 {
    fd_soft_limit().map_or(FALLBACK_SESSION_CAP, session_cap_for_fd_limit)
}

/// Resident memory in bytes from the text of `/proc/self/status` (`VmRSS: <n> kB`).
pub fn parse_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line.strip_prefix("VmRSS:")?.split_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => n.checked_mul(1024),
        _ => None,
    }
}

/// The process's resident memory in bytes (Linux `/proc/self/status`); `None` elsewhere.
/// Blocking file I/O (small, in-memory procfs): call from a periodic tick.
pub fn process_rss_bytes() -> Option<u64> {
    parse_rss_bytes(&std::fs::read_to_string("/proc/self/status").ok()?)
}

#[cfg(test)]
mod tests;

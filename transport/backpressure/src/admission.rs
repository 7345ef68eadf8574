//! [`AdmissionControl`] (SPEC B1): may a new connection attempt proceed to the expensive part
//! of its handshake? A global bucket per edge, a bucket per source address in a bounded map,
//! and a cap on connections that have not authenticated yet, each with phase deadlines.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::bucket::{Rate, TokenBucket};
use waygate_protocol::wire::CloseCode;

/// Absolute deadlines for the phases of a handshake, each counted **from the accept**
/// (not from the end of the previous phase), so a peer dribbling bytes cannot stretch the
/// whole handshake by using each phase's budget in turn. A transport skips phases it lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhaseDeadlines {
    /// TLS (or QUIC crypto, or the KCP cookie exchange) must be done by accept + `tls`.
    pub tls: Duration,
    /// The WebSocket upgrade must be done by accept + `upgrade`.
    pub upgrade: Duration,
    /// HELLO (authentication) must be done by accept + `hello`.
    pub hello: Duration,
}

impl Default for PhaseDeadlines {
    fn default() -> Self {
        Self {
            tls: Duration::from_secs(5),
            upgrade: Duration::from_secs(7),
            hello: Duration::from_secs(10),
        }
    }
}

/// A phase of the handshake, see [`PhaseDeadlines`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// TLS / transport crypto.
    Tls,
    /// WebSocket upgrade.
    Upgrade,
    /// HELLO and authentication.
    Hello,
}

impl PhaseDeadlines {
    /// The budget of `phase`, from the accept.
    pub fn get(&self, phase: Phase) -> Duration {
        match phase {
            Phase::Tls => self.tls,
            Phase::Upgrade => self.upgrade,
            Phase::Hello => self.hello,
        }
    }
}

/// Configuration of [`AdmissionControl`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// New connections per edge (all sources together).
    pub global_rate: Rate,
    /// Burst of the global bucket.
    pub global_burst: u64,
    /// New connections per source (an IPv4 address or an IPv6 prefix).
    pub per_source_rate: Rate,
    /// Burst of each per-source bucket.
    pub per_source_burst: u64,
    /// Most sources tracked at once. When full, the least recently seen source is forgotten
    /// (its bucket restarts full if it comes back; the global bucket still bounds the total).
    pub max_tracked_sources: usize,
    /// IPv6 sources are grouped by this prefix length (one host usually owns a /64).
    pub ipv6_prefix_len: u8,
    /// Most connections admitted but not yet authenticated (live [`HandshakePermit`]s).
    pub max_handshakes: u64,
    /// Retry-after hint when refused because of `max_handshakes` (no bucket says when a slot
    /// frees up).
    pub handshakes_full_retry_after: Duration,
    /// Phase deadlines handed to each admitted handshake.
    pub deadlines: PhaseDeadlines,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            global_rate: Rate::per_second(2_000),
            global_burst: 500,
            per_source_rate: Rate::per_second(20),
            per_source_burst: 40,
            max_tracked_sources: 65_536,
            ipv6_prefix_len: 64,
            max_handshakes: 4_096,
            handshakes_full_retry_after: Duration::from_secs(1),
            deadlines: PhaseDeadlines::default(),
        }
    }
}

impl AdmissionConfig {
    /// Checks the values; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.global_burst == 0 || self.per_source_burst == 0 {
            return Err("admission: global_burst and per_source_burst must be > 0".into());
        }
        if self.max_tracked_sources == 0 {
            return Err("admission: max_tracked_sources must be > 0".into());
        }
        if self.ipv6_prefix_len > 128 {
            return Err("admission: ipv6_prefix_len must be <= 128".into());
        }
        if self.max_handshakes == 0 {
            return Err("admission: max_handshakes must be > 0".into());
        }
        Ok(())
    }
}

/// Why an attempt was refused (a metric label; the client only sees OVERLOADED).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefuseReason {
    /// Too many not-yet-authenticated connections.
    Handshakes,
    /// This source is over its rate.
    Source,
    /// The edge is over its global rate.
    Global,
}

impl RefuseReason {
    /// Stable label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Handshakes => "handshakes",
            Self::Source => "source",
            Self::Global => "global",
        }
    }
}

/// The outcome of [`AdmissionControl::admit`].
#[derive(Debug)]
#[must_use]
pub enum Admission {
    /// Go ahead; hold the permit until the connection authenticates or fails.
    Admit(HandshakePermit),
    /// Reply OVERLOADED with `retry_after` (never a silent drop).
    Refuse {
        /// Always [`CloseCode::Overloaded`].
        code: CloseCode,
        /// How long the client should wait: for a rate refusal, the start of a slot of its
        /// own (refusals at the same moment are spread one token interval apart, at most
        /// [`MAX_RETRY_SPREAD`]), never before the bucket has a token.
        retry_after: Duration,
        /// Which limit refused (metrics only).
        reason: RefuseReason,
    },
}

/// A slot among the not-yet-authenticated connections. Dropping it (or calling
/// [`authenticated`](Self::authenticated)) frees the slot; it is `Send` and can move into
/// the handshake task, so every exit path — success, error, deadline, panic — frees it.
#[derive(Debug)]
pub struct HandshakePermit {
    in_flight: Arc<AtomicU64>,
    started: Instant,
    deadlines: PhaseDeadlines,
}

impl HandshakePermit {
    /// When the connection was admitted.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The absolute deadline of `phase`.
    pub fn deadline(&self, phase: Phase) -> Instant {
        self.started + self.deadlines.get(phase)
    }

    /// Whether `phase` is past its deadline at `now` (close with
    /// [`CloseCode::HandshakeTimeout`]).
    pub fn expired(&self, now: Instant, phase: Phase) -> bool {
        now >= self.deadline(phase)
    }

    /// The handshake finished; frees the slot (same as dropping the permit).
    pub fn authenticated(self) {}
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Counters of [`AdmissionControl`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionStats {
    /// Attempts admitted.
    pub admitted: u64,
    /// Refused: too many unauthenticated connections.
    pub refused_handshakes: u64,
    /// Refused: the source was over its rate.
    pub refused_source: u64,
    /// Refused: the edge was over its global rate.
    pub refused_global: u64,
    /// Sources forgotten to stay within `max_tracked_sources` while their bucket was not full.
    pub sources_evicted: u64,
    /// Sources forgotten because their bucket was full again (no information lost).
    pub sources_expired: u64,
}

/// Longest retry-after hint a rate refusal gives (a flood saturates here).
pub const MAX_RETRY_SPREAD: Duration = Duration::from_secs(5);

/// Spreads the retry-after hints of a storm (performance issue, W6/W7): a bucket's exact
/// wait sends every client refused at the same moment back at the same moment, to be
/// refused again. Each refusal instead gets a slot of its own, one token interval after the
/// previous refusal's, so N clients refused together come back over N intervals and are
/// admitted one by one. Hints never exceed [`MAX_RETRY_SPREAD`].
#[derive(Debug, Clone, Copy)]
pub struct RetrySlots {
    /// One token of the bucket's rate.
    interval: Duration,
    /// The next free slot.
    next: Option<Instant>,
}

impl RetrySlots {
    /// Slots one token of `rate` apart.
    pub fn new(rate: Rate) -> Self {
        let interval = if rate.tokens() == 0 {
            MAX_RETRY_SPREAD
        } else {
            let ns = rate.period().as_nanos() / u128::from(rate.tokens());
            Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
        };
        Self {
            interval,
            next: None,
        }
    }

    /// The hint for a refusal at `now` whose bucket has a token after `wait`.
    pub fn hint(&mut self, now: Instant, wait: Duration) -> Duration {
        // A wait beyond the spread (a bucket that never refills: `Duration::MAX`) is the
        // spread's end: `now + wait` would overflow the clock.
        let wait = wait.min(MAX_RETRY_SPREAD);
        let earliest = now + wait;
        let slot = match self.next {
            Some(next) if next > earliest => next,
            _ => earliest,
        };
        let last = now + MAX_RETRY_SPREAD;
        self.next = Some((slot + self.interval).min(last));
        slot.min(last).saturating_duration_since(now).max(wait)
    }
}

#[derive(Debug)]
struct Source {
    bucket: TokenBucket,
    /// Retry-after slots of this source's refusals.
    slots: RetrySlots,
    /// Key in the recency index.
    tick: u64,
}

/// Admission control for new connections (sans-IO; the accept loop owns it).
#[derive(Debug)]
pub struct AdmissionControl {
    config: AdmissionConfig,
    global: TokenBucket,
    /// Retry-after slots of the global bucket's refusals.
    global_slots: RetrySlots,
    sources: HashMap<IpAddr, Source>,
    /// Recency index: tick -> source, oldest first.
    recency: BTreeMap<u64, IpAddr>,
    next_tick: u64,
    in_flight: Arc<AtomicU64>,
    stats: AdmissionStats,
}

impl AdmissionControl {
    /// A new admission stage (validate the config first; zero caps are raised to 1).
    pub fn new(config: AdmissionConfig, now: Instant) -> Self {
        let global = TokenBucket::new(config.global_rate, config.global_burst, now);
        Self {
            global,
            global_slots: RetrySlots::new(config.global_rate),
            sources: HashMap::new(),
            recency: BTreeMap::new(),
            next_tick: 0,
            in_flight: Arc::new(AtomicU64::new(0)),
            stats: AdmissionStats::default(),
            config,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// The counters.
    pub fn stats(&self) -> AdmissionStats {
        self.stats
    }

    /// Connections admitted and not yet authenticated (live permits).
    pub fn handshakes_in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Sources currently tracked (never above `max_tracked_sources`).
    pub fn tracked_sources(&self) -> usize {
        self.sources.len()
    }

    /// The map key of a peer address: IPv4 as is, IPv6 masked to its prefix.
    /// IPv4-mapped IPv6 addresses count as their IPv4 address.
    pub fn source_key(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(_) => ip,
            IpAddr::V6(v6) => {
                if let Some(v4) = v6.to_ipv4_mapped() {
                    return IpAddr::V4(v4);
                }
                let bits = u128::from(v6);
                let len = u32::from(self.config.ipv6_prefix_len.min(128));
                let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
                IpAddr::V6((bits & mask).into())
            }
        }
    }

    /// Decides on one new connection attempt from `peer` at `now`. Checks, cheapest first,
    /// the handshake cap, the source's bucket, then the global bucket; tokens are taken only
    /// when all pass (a refused attempt costs its source nothing).
    pub fn admit(&mut self, now: Instant, peer: IpAddr) -> Admission {
        let max = self.config.max_handshakes.max(1);
        if self.in_flight.load(Ordering::Acquire) >= max {
            self.stats.refused_handshakes += 1;
            return Self::refuse(
                self.config.handshakes_full_retry_after,
                RefuseReason::Handshakes,
            );
        }
        let key = self.source_key(peer);
        let tick = self.touch(now, key);
        let Some(source) = self.sources.get_mut(&key) else {
            // `touch` always leaves the key present.
            return Self::refuse(Duration::from_secs(1), RefuseReason::Source);
        };
        debug_assert_eq!(source.tick, tick);
        if let Err(wait) = source.bucket.check(now, 1) {
            self.stats.refused_source += 1;
            let hint = source.slots.hint(now, wait.0);
            return Self::refuse(hint, RefuseReason::Source);
        }
        if let Err(wait) = self.global.check(now, 1) {
            self.stats.refused_global += 1;
            let hint = self.global_slots.hint(now, wait.0);
            return Self::refuse(hint, RefuseReason::Global);
        }
        source.bucket.take_checked(1);
        self.global.take_checked(1);
        self.stats.admitted += 1;
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Admission::Admit(HandshakePermit {
            in_flight: Arc::clone(&self.in_flight),
            started: now,
            deadlines: self.config.deadlines,
        })
    }

    /// A slot for a connection admitted earlier (a KCP session at its CONNECT, whose HELLO
    /// was admitted): counted against `max_handshakes` without any check or token.
    pub fn hold_slot(&mut self, now: Instant) -> HandshakePermit {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        HandshakePermit {
            in_flight: Arc::clone(&self.in_flight),
            started: now,
            deadlines: self.config.deadlines,
        }
    }

    fn refuse(retry_after: Duration, reason: RefuseReason) -> Admission {
        Admission::Refuse {
            code: CloseCode::Overloaded,
            retry_after,
            reason,
        }
    }

    /// Marks `key` most recently seen, creating it (and evicting to stay bounded) if new.
    fn touch(&mut self, now: Instant, key: IpAddr) -> u64 {
        let tick = self.next_tick;
        self.next_tick += 1;
        if let Some(source) = self.sources.get_mut(&key) {
            self.recency.remove(&source.tick);
            source.tick = tick;
            self.recency.insert(tick, key);
            return tick;
        }
        self.sweep(now);
        while self.sources.len() >= self.config.max_tracked_sources.max(1) {
            let Some((_, oldest)) = self.recency.pop_first() else {
                break;
            };
            self.sources.remove(&oldest);
            self.stats.sources_evicted += 1;
        }
        let bucket = TokenBucket::new(
            self.config.per_source_rate,
            self.config.per_source_burst,
            now,
        );
        let slots = RetrySlots::new(self.config.per_source_rate);
        self.sources.insert(
            key,
            Source {
                bucket,
                slots,
                tick,
            },
        );
        self.recency.insert(tick, key);
        tick
    }

    /// Forgets sources whose bucket is full again, oldest first (they carry no information).
    /// Called on every new source; call it from a periodic tick to shrink the map when idle.
    /// Returns how many were forgotten.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let mut removed = 0;
        // All per-source buckets share one config, so "full" is monotone in last use: stop at
        // the first source that is not full.
        while let Some((&tick, &ip)) = self.recency.first_key_value() {
            let full = self
                .sources
                .get_mut(&ip)
                .is_none_or(|s| s.bucket.is_full(now));
            if !full {
                break;
            }
            self.recency.remove(&tick);
            self.sources.remove(&ip);
            self.stats.sources_expired += 1;
            removed += 1;
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn v4(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    /// Panic audit: a refusal by a bucket that never refills (zero rate: the wait is
    /// `Duration::MAX`) overflowed `now + wait` in the shared accept path. The hint is the
    /// spread's end.
    #[test]
    fn a_wait_that_never_ends_hints_the_end_of_the_spread() {
        let mut slots = RetrySlots::new(Rate::per_second(0));
        let now = Instant::now();
        assert_eq!(slots.hint(now, Duration::MAX), MAX_RETRY_SPREAD);
        assert_eq!(slots.hint(now, Duration::MAX), MAX_RETRY_SPREAD);
    }

    fn config() -> AdmissionConfig {
        AdmissionConfig {
            global_rate: Rate::per_second(100),
            global_burst: 10,
            per_source_rate: Rate::per_second(1),
            per_source_burst: 2,
            max_tracked_sources: 4,
            ipv6_prefix_len: 64,
            max_handshakes: 1_000,
            handshakes_full_retry_after: Duration::from_millis(750),
            deadlines: PhaseDeadlines::default(),
        }
    }

    fn refused(a: &Admission) -> Option<(Duration, RefuseReason)> {
        match a {
            Admission::Admit(_) => None,
            Admission::Refuse {
                code,
                retry_after,
                reason,
            } => {
                assert_eq!(*code, CloseCode::Overloaded);
                Some((*retry_after, *reason))
            }
        }
    }

    /// Regression (performance issue, W6/W7): 1,000 clients refused at the same moment
    /// were all told the bucket's exact wait (half a millisecond) and came back together, to
    /// be refused again and again. With a slot each, the storm is admitted on the second
    /// attempt of every client, the hints spaced one token apart and never above the cap.
    #[test]
    fn a_storm_refused_together_is_spread_and_admitted_on_the_next_try() {
        let t0 = Instant::now();
        let cfg = AdmissionConfig {
            global_rate: Rate::per_second(2_000),
            global_burst: 500,
            per_source_rate: Rate::per_second(20),
            per_source_burst: 40,
            max_tracked_sources: 65_536,
            max_handshakes: 1_000_000,
            ..AdmissionConfig::default()
        };
        let mut ac = AdmissionControl::new(cfg, t0);
        let ip = |i: u32| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
        let mut retries: Vec<(Instant, u32)> = Vec::new();
        let mut permits = Vec::new();
        let mut hints = Vec::new();
        for i in 0..1_000 {
            match ac.admit(t0, ip(i)) {
                Admission::Admit(p) => permits.push(p),
                Admission::Refuse { retry_after, .. } => {
                    hints.push(retry_after);
                    retries.push((t0 + retry_after, i));
                }
            }
        }
        assert_eq!((permits.len(), hints.len()), (500, 500));
        for pair in hints.windows(2) {
            assert!(pair[1] >= pair[0] + Duration::from_micros(499), "{pair:?}");
        }
        assert!(hints.iter().all(|h| *h <= MAX_RETRY_SPREAD));
        // Every refused client comes back at its hint: all admitted, none refused again.
        retries.sort();
        let mut refused_again = 0;
        for (at, i) in retries {
            match ac.admit(at, ip(i)) {
                Admission::Admit(p) => permits.push(p),
                Admission::Refuse { .. } => refused_again += 1,
            }
        }
        assert_eq!(refused_again, 0);
        assert_eq!(permits.len(), 1_000);
        // A flood saturates at the cap, and a quiet bucket answers its exact wait again.
        let mut flood = AdmissionControl::new(
            AdmissionConfig {
                global_rate: Rate::per_second(1),
                global_burst: 1,
                max_tracked_sources: 65_536,
                max_handshakes: 1_000_000,
                ..AdmissionConfig::default()
            },
            t0,
        );
        let _admitted = flood.admit(t0, ip(0));
        let last = (1..100)
            .filter_map(|i| refused(&flood.admit(t0, ip(i))))
            .last()
            .unwrap();
        assert_eq!(last.0, MAX_RETRY_SPREAD);
        let later = t0 + Duration::from_secs(60);
        let _admitted = flood.admit(later, ip(200));
        let exact = refused(&flood.admit(later, ip(201))).unwrap();
        assert_eq!(exact.0, Duration::from_secs(1));
    }

    #[test]
    fn per_source_isolation() {
        let t0 = Instant::now();
        let mut ac = AdmissionControl::new(config(), t0);
        let mut permits = Vec::new();
        for _ in 0..2 {
            match ac.admit(t0, v4(1)) {
                Admission::Admit(p) => permits.push(p),
                other => panic!("{other:?}"),
            }
        }
        // Source 1 is out of tokens: refused with the exact wait, 1 s.
        assert_eq!(
            refused(&ac.admit(t0, v4(1))),
            Some((Duration::from_secs(1), RefuseReason::Source))
        );
        // Another source is unaffected.
        assert!(refused(&ac.admit(t0, v4(2))).is_none());
        // After the hinted wait source 1 gets in again.
        assert!(refused(&ac.admit(t0 + Duration::from_secs(1), v4(1))).is_none());
        let s = ac.stats();
        assert_eq!((s.admitted, s.refused_source), (4, 1));
    }

    #[test]
    fn global_bucket_bounds_all_sources_and_refusals_cost_the_source_nothing() {
        let t0 = Instant::now();
        let mut cfg = config();
        cfg.max_tracked_sources = 100;
        let mut ac = AdmissionControl::new(cfg, t0);
        for i in 0..10 {
            assert!(refused(&ac.admit(t0, v4(i))).is_none());
        }
        let (wait, reason) = refused(&ac.admit(t0, v4(50))).unwrap();
        assert_eq!(reason, RefuseReason::Global);
        assert_eq!(wait, Duration::from_millis(10));
        // Source 50 was refused by the global bucket, so it still has its full burst.
        let later = t0 + Duration::from_millis(20);
        assert!(refused(&ac.admit(later, v4(50))).is_none());
        assert!(refused(&ac.admit(later, v4(50))).is_none());
    }

    #[test]
    fn handshake_cap_and_permits() {
        let t0 = Instant::now();
        let mut cfg = config();
        cfg.max_handshakes = 2;
        cfg.max_tracked_sources = 100;
        let mut ac = AdmissionControl::new(cfg, t0);
        let Admission::Admit(a) = ac.admit(t0, v4(1)) else {
            panic!()
        };
        let Admission::Admit(b) = ac.admit(t0, v4(2)) else {
            panic!()
        };
        assert_eq!(ac.handshakes_in_flight(), 2);
        assert_eq!(
            refused(&ac.admit(t0, v4(3))),
            Some((Duration::from_millis(750), RefuseReason::Handshakes))
        );
        a.authenticated();
        drop(b);
        assert_eq!(ac.handshakes_in_flight(), 0);
        let Admission::Admit(c) = ac.admit(t0, v4(3)) else {
            panic!()
        };
        assert_eq!(c.deadline(Phase::Tls), t0 + Duration::from_secs(5));
        assert!(!c.expired(t0 + Duration::from_secs(9), Phase::Hello));
        assert!(c.expired(t0 + Duration::from_secs(10), Phase::Hello));
        assert_eq!(ac.stats().refused_handshakes, 1);
    }

    #[test]
    fn permits_free_their_slot_from_another_thread() {
        let t0 = Instant::now();
        let mut ac = AdmissionControl::new(config(), t0);
        let Admission::Admit(p) = ac.admit(t0, v4(1)) else {
            panic!()
        };
        std::thread::spawn(move || drop(p)).join().unwrap();
        assert_eq!(ac.handshakes_in_flight(), 0);
    }

    #[test]
    fn source_map_is_bounded_and_forgets_the_oldest() {
        let t0 = Instant::now();
        let mut ac = AdmissionControl::new(config(), t0);
        for i in 0..4 {
            let _ = ac.admit(t0, v4(i));
        }
        assert_eq!(ac.tracked_sources(), 4);
        let _ = ac.admit(t0, v4(0)); // refresh 0: 1 is now the oldest
        let _ = ac.admit(t0, v4(9));
        assert_eq!(ac.tracked_sources(), 4);
        assert_eq!(ac.stats().sources_evicted, 1);
        assert!(!ac.sources.contains_key(&v4(1)));
        assert!(ac.sources.contains_key(&v4(0)));
        // Two seconds later every bucket is full again: the sweep forgets them all.
        assert_eq!(ac.sweep(t0 + Duration::from_secs(2)), 4);
        assert_eq!(ac.tracked_sources(), 0);
        assert_eq!(ac.recency.len(), 0);
    }

    #[test]
    fn ipv6_sources_are_grouped_by_prefix() {
        let t0 = Instant::now();
        let mut ac = AdmissionControl::new(config(), t0);
        let a: Ipv6Addr = "2001:db8:1:2::1".parse().unwrap();
        let b: Ipv6Addr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: Ipv6Addr = "2001:db8:1:3::1".parse().unwrap();
        assert!(refused(&ac.admit(t0, a.into())).is_none());
        assert!(refused(&ac.admit(t0, b.into())).is_none());
        assert_eq!(
            refused(&ac.admit(t0, a.into())).unwrap().1,
            RefuseReason::Source
        );
        assert!(refused(&ac.admit(t0, c.into())).is_none());
        let mapped: Ipv6Addr = Ipv4Addr::new(10, 0, 0, 7).to_ipv6_mapped();
        assert_eq!(ac.source_key(mapped.into()), v4(7));
        let mut cfg = config();
        cfg.ipv6_prefix_len = 0;
        let ac0 = AdmissionControl::new(cfg, t0);
        assert_eq!(ac0.source_key(a.into()), IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    }

    #[test]
    fn config_validation() {
        assert!(AdmissionConfig::default().validate().is_ok());
        let c = AdmissionConfig {
            max_tracked_sources: 0,
            ..AdmissionConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("max_tracked_sources"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever the traffic, the map stays within its cap, the index matches the map,
        /// and no source is ever admitted more than its bucket allows.
        #[test]
        fn bounded_and_never_over_rate(
            steps in proptest::collection::vec((0u8..12, 0u64..400_000_000, any::<bool>()), 1..400),
        ) {
            let t0 = Instant::now();
            let mut cfg = config();
            cfg.global_burst = 1_000;
            cfg.global_rate = Rate::per_second(1_000_000);
            let cap = cfg.max_tracked_sources;
            let mut ac = AdmissionControl::new(cfg, t0);
            let mut now = t0;
            let mut admitted: HashMap<u8, Vec<Instant>> = HashMap::new();
            let mut held = Vec::new();
            for (src, dt, keep) in steps {
                now += Duration::from_nanos(dt);
                match ac.admit(now, v4(src)) {
                    Admission::Admit(p) => {
                        admitted.entry(src).or_default().push(now);
                        if keep { held.push(p) }
                    }
                    Admission::Refuse { retry_after, .. } => prop_assert!(retry_after > Duration::ZERO),
                }
                prop_assert!(ac.tracked_sources() <= cap);
                prop_assert_eq!(ac.sources.len(), ac.recency.len());
                prop_assert_eq!(ac.handshakes_in_flight(), held.len() as u64);
            }
            // Eviction resets a source's bucket, so the rate is checked strictly only when
            // nothing was evicted: no 1 s window holds more than burst (2) admissions, since
            // less than one token refills within it.
            if ac.stats().sources_evicted == 0 {
                for times in admitted.values() {
                    for (i, &t) in times.iter().enumerate() {
                        let in_window = times[i..].iter().take_while(|&&u| u < t + Duration::from_secs(1)).count();
                        prop_assert!(in_window <= 2, "{} admissions within 1 s", in_window);
                    }
                }
            }
        }
    }
}

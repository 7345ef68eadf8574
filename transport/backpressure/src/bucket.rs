//! [`TokenBucket`]: exact integer token bucket on a caller-supplied clock.
//!
//! The level is kept in *token-nanoseconds*: one token is `period_ns` units and every elapsed
//! nanosecond adds `tokens_per_period` units. Refill is therefore one integer multiply with
//! no remainder to lose — no float, no drift, exact over days of idle time and over
//! sub-microsecond steps alike.

use std::time::{Duration, Instant};

/// A refill rate: `tokens` every `per`. Exact for any pair (no rounding), e.g. 3 per 2 s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    tokens: u64,
    period_ns: u64,
}

impl Rate {
    /// `tokens` every `per`, kept in lowest terms (so equal rates compare equal). A zero
    /// `per` is taken as 1 ns; `per` beyond ~584 years saturates.
    pub fn new(tokens: u64, per: Duration) -> Self {
        let period_ns = u64::try_from(per.as_nanos()).unwrap_or(u64::MAX).max(1);
        Self::reduced(tokens.into(), period_ns.into())
    }

    /// `tokens` per second.
    pub fn per_second(tokens: u64) -> Self {
        Self::new(tokens, Duration::from_secs(1))
    }

    /// A rate that never refills (the bucket only ever holds its initial burst).
    pub fn never() -> Self {
        Self::per_second(0)
    }

    fn reduced(mut t: u128, mut p: u128) -> Self {
        let g = gcd(t, p);
        if g > 1 {
            t /= g;
            p /= g;
        }
        while t > u128::from(u64::MAX) || p > u128::from(u64::MAX) {
            // Only reached for absurd inputs; halving both keeps the ratio within 1 part in 2^63.
            t = (t / 2).max(1);
            p = (p / 2).max(1);
        }
        Self {
            tokens: t as u64,
            period_ns: p as u64,
        }
    }

    /// Tokens added per period.
    pub fn tokens(self) -> u64 {
        self.tokens
    }

    /// The period.
    pub fn period(self) -> Duration {
        Duration::from_nanos(self.period_ns)
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// How long to wait until a refused request would succeed. [`RetryAfter::NEVER`] when it
/// never can (more tokens asked than the burst holds, or a rate of zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RetryAfter(pub Duration);

impl RetryAfter {
    /// The request can never succeed with this bucket's configuration.
    pub const NEVER: RetryAfter = RetryAfter(Duration::MAX);

    /// Whether waiting can never help.
    pub fn is_never(self) -> bool {
        self.0 == Duration::MAX
    }

    /// The wait as whole milliseconds for a wire hint, rounded **up** (a client that obeys it
    /// never retries early) and saturated at `u32::MAX`.
    pub fn as_millis_ceil_u32(self) -> u32 {
        let ms = self.0.as_nanos().div_ceil(1_000_000);
        u32::try_from(ms).unwrap_or(u32::MAX)
    }
}

/// A token bucket: holds at most `burst` tokens, refills at a [`Rate`], starts full.
///
/// Time is passed in; the bucket never reads a clock. A `now` earlier than one seen before
/// is treated as no elapsed time (the bucket never refills backwards or twice).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: Rate,
    burst: u64,
    /// Current level in token-ns (`tokens * period_ns`).
    level: u128,
    /// `burst * period_ns`.
    cap: u128,
    /// Time of the last refill.
    last: Instant,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens refilling at `rate`.
    pub fn new(rate: Rate, burst: u64, now: Instant) -> Self {
        let cap = u128::from(burst) * u128::from(rate.period_ns);
        Self {
            rate,
            burst,
            level: cap,
            cap,
            last: now,
        }
    }

    /// An empty bucket (it fills at `rate` up to `burst`).
    pub fn new_empty(rate: Rate, burst: u64, now: Instant) -> Self {
        let mut bucket = Self::new(rate, burst, now);
        bucket.level = 0;
        bucket
    }

    /// The refill rate.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    /// The most tokens the bucket holds.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Changes rate and burst, keeping the current token count (capped at the new burst).
    pub fn reconfigure(&mut self, now: Instant, rate: Rate, burst: u64) {
        self.refill(now);
        let tokens = self.level / u128::from(self.rate.period_ns);
        let frac = self.level % u128::from(self.rate.period_ns);
        // Carry the fractional token over proportionally (rounded down: never gains).
        let frac_new = frac * u128::from(rate.period_ns) / u128::from(self.rate.period_ns);
        self.rate = rate;
        self.burst = burst;
        self.cap = u128::from(burst) * u128::from(rate.period_ns);
        self.level = (tokens * u128::from(rate.period_ns) + frac_new).min(self.cap);
    }

    fn refill(&mut self, now: Instant) {
        if now <= self.last {
            return;
        }
        if self.level < self.cap {
            let elapsed = (now - self.last).as_nanos();
            let add = elapsed.saturating_mul(u128::from(self.rate.tokens));
            self.level = self.level.saturating_add(add).min(self.cap);
        }
        self.last = now;
    }

    fn need(&self, n: u64) -> u128 {
        u128::from(n) * u128::from(self.rate.period_ns)
    }

    /// Wait until `need` units exist, given the current level (refilled already).
    fn wait_for(&self, need: u128) -> RetryAfter {
        if need > self.cap || (self.rate.tokens == 0 && need > self.level) {
            return RetryAfter::NEVER;
        }
        let deficit = need.saturating_sub(self.level);
        let ns = deficit.div_ceil(u128::from(self.rate.tokens.max(1)));
        match u64::try_from(ns) {
            Ok(ns) => RetryAfter(Duration::from_nanos(ns)),
            Err(_) => RetryAfter::NEVER,
        }
    }

    /// Takes `n` tokens if they are all there; otherwise takes nothing and says exactly how
    /// long until they would be (to the nanosecond, rounded up).
    pub fn try_take(&mut self, now: Instant, n: u64) -> Result<(), RetryAfter> {
        self.refill(now);
        let need = self.need(n);
        if need <= self.level {
            self.level -= need;
            Ok(())
        } else {
            Err(self.wait_for(need))
        }
    }

    /// Like [`try_take`](Self::try_take) without taking: `Ok` if `n` tokens exist now.
    pub fn check(&mut self, now: Instant, n: u64) -> Result<(), RetryAfter> {
        self.refill(now);
        let need = self.need(n);
        if need <= self.level {
            Ok(())
        } else {
            Err(self.wait_for(need))
        }
    }

    /// Takes `n` tokens after a successful [`check`](Self::check) at the same `now`
    /// (saturating at empty otherwise).
    pub fn take_checked(&mut self, n: u64) {
        self.level = self.level.saturating_sub(self.need(n));
    }

    /// Gives `n` tokens back (capped at the burst).
    pub fn refund(&mut self, n: u64) {
        self.level = self.level.saturating_add(self.need(n)).min(self.cap);
    }

    /// Whole tokens available at `now`.
    pub fn available(&mut self, now: Instant) -> u64 {
        self.refill(now);
        u64::try_from(self.level / u128::from(self.rate.period_ns)).unwrap_or(u64::MAX)
    }

    /// Whether the bucket is full at `now` (it then carries no information: dropping it and
    /// creating a fresh one later is equivalent).
    pub fn is_full(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.level >= self.cap
    }

    /// The exact level in units of 1/`period_ns` token (for tests and metrics).
    pub fn level_units(&self) -> u128 {
        self.level
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn starts_full_and_caps_at_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(Rate::per_second(10), 5, t0);
        assert_eq!(b.available(t0), 5);
        assert_eq!(b.available(t0 + Duration::from_secs(3600)), 5);
        for _ in 0..5 {
            b.try_take(t0, 1).unwrap();
        }
        assert!(b.try_take(t0, 1).is_err());
    }

    #[test]
    fn retry_after_is_exact_to_the_nanosecond() {
        let t0 = Instant::now();
        // 3 tokens per second: one token every 333_333_333.33 ns.
        let mut b = TokenBucket::new(Rate::per_second(3), 3, t0);
        b.try_take(t0, 3).unwrap();
        let wait = b.try_take(t0, 1).unwrap_err();
        assert_eq!(wait, RetryAfter(Duration::from_nanos(333_333_334)));
        assert!(b
            .try_take(t0 + wait.0 - Duration::from_nanos(1), 1)
            .is_err());
        b.try_take(t0 + wait.0, 1).unwrap();
        // Two more tokens: from t0 a total of 3 tokens takes exactly one second.
        let wait = b.try_take(t0 + wait.0, 2).unwrap_err();
        assert_eq!(t0 + 333_333_334 * Duration::from_nanos(1) + wait.0, t0 + S);
        b.try_take(t0 + S, 2).unwrap();
        assert_eq!(b.available(t0 + S), 0);
    }

    #[test]
    fn asking_more_than_the_burst_is_never() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(Rate::per_second(100), 10, t0);
        let err = b.try_take(t0, 11).unwrap_err();
        assert!(err.is_never());
        assert_eq!(err.as_millis_ceil_u32(), u32::MAX);
        assert_eq!(b.available(t0), 10, "a refused take takes nothing");
        let mut z = TokenBucket::new(Rate::never(), 2, t0);
        z.try_take(t0, 2).unwrap();
        assert!(z.try_take(t0 + S * 1000, 1).unwrap_err().is_never());
    }

    #[test]
    fn fractional_rates_are_exact() {
        let t0 = Instant::now();
        // One token every 2 s.
        let mut b = TokenBucket::new_empty(Rate::new(1, 2 * S), 1, t0);
        assert_eq!(b.try_take(t0, 1), Err(RetryAfter(2 * S)));
        assert!(b.try_take(t0 + 2 * S - Duration::from_nanos(1), 1).is_err());
        b.try_take(t0 + 2 * S, 1).unwrap();
    }

    #[test]
    fn clock_going_backwards_adds_nothing() {
        let t0 = Instant::now() + S;
        let mut b = TokenBucket::new_empty(Rate::per_second(1), 10, t0);
        assert_eq!(b.available(t0 + S), 1);
        assert_eq!(b.available(t0), 1);
        assert_eq!(
            b.available(t0 + S),
            1,
            "the same second is not counted twice"
        );
        assert_eq!(b.available(t0 + 2 * S), 2);
    }

    #[test]
    fn long_idle_and_huge_rates_do_not_overflow() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new_empty(Rate::per_second(u64::MAX), u64::MAX, t0);
        let later = t0 + Duration::from_secs(10 * 365 * 24 * 3600);
        assert_eq!(b.available(later), u64::MAX);
        b.try_take(later, u64::MAX).unwrap();
        assert_eq!(b.available(later), 0);
    }

    #[test]
    fn millis_hint_rounds_up() {
        assert_eq!(RetryAfter(Duration::from_nanos(1)).as_millis_ceil_u32(), 1);
        assert_eq!(RetryAfter(Duration::from_millis(7)).as_millis_ceil_u32(), 7);
        assert_eq!(RetryAfter(Duration::ZERO).as_millis_ceil_u32(), 0);
    }

    #[test]
    fn reconfigure_keeps_tokens_up_to_the_new_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(Rate::per_second(10), 10, t0);
        b.try_take(t0, 4).unwrap();
        b.reconfigure(t0, Rate::per_second(5), 100);
        assert_eq!(b.available(t0), 6);
        b.reconfigure(t0, Rate::per_second(5), 2);
        assert_eq!(b.available(t0), 2);
        assert_eq!(b.available(t0 + S), 2);
    }

    #[test]
    fn rates_are_exact() {
        // 3 tokens per 2 s: no rounding to 1 or 2 per second.
        let r = Rate::new(3, 2 * S);
        let t0 = Instant::now();
        let mut b = TokenBucket::new_empty(r, 10, t0);
        assert_eq!(b.available(t0 + 2 * S), 3);
        assert_eq!(Rate::new(2, 2 * S), Rate::per_second(1));
        assert_eq!(Rate::per_second(1).period(), S);
    }

    /// The reference: GCRA (theoretical arrival time), an independent formulation of the same
    /// bucket, in u128 "scaled time" where one token costs `period_ns` units and one ns of wall
    /// time is `tokens_per_period` units.
    struct Gcra {
        tokens: u128,
        period: u128,
        tau: u128,
        tat: u128,
    }

    impl Gcra {
        fn take(&mut self, t_ns: u128, n: u64) -> Result<(), u128> {
            let t = t_ns * self.tokens;
            let new_tat = self.tat.max(t) + u128::from(n) * self.period;
            if new_tat - t <= self.tau {
                self.tat = new_tat;
                Ok(())
            } else {
                let excess = new_tat - t - self.tau;
                Err(excess.div_ceil(self.tokens))
            }
        }
    }

    fn check_against_reference(seed: u64, steps: usize, tokens: u64, period_ns: u64, burst: u64) {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let t0 = Instant::now();
        let rate = Rate::new(tokens, Duration::from_nanos(period_ns));
        let mut bucket = TokenBucket::new(rate, burst, t0);
        let mut reference = Gcra {
            tokens: tokens.into(),
            period: period_ns.into(),
            tau: u128::from(burst) * u128::from(period_ns),
            tat: 0,
        };
        let mut t_ns: u128 = 0;
        let mut granted = 0u64;
        for _ in 0..steps {
            // Mostly sub-microsecond steps, sometimes milliseconds, rarely hours of idle.
            let dt: u64 = match rng.random_range(0..100u32) {
                0 => rng.random_range(0..10 * 3_600_000_000_000u64),
                1..=20 => rng.random_range(0..5_000_000),
                _ => rng.random_range(0..1_000),
            };
            t_ns += u128::from(dt);
            let n = rng.random_range(1..=burst.min(4));
            let now = t0 + Duration::from_nanos(t_ns as u64);
            let got = bucket.try_take(now, n);
            let want = reference.take(t_ns, n);
            match (got, want) {
                (Ok(()), Ok(())) => granted += 1,
                (Err(RetryAfter(d)), Err(ns)) => assert_eq!(d.as_nanos(), ns, "at t={t_ns}"),
                (got, want) => panic!("at t={t_ns} n={n}: bucket {got:?}, reference {want:?}"),
            }
        }
        assert!(granted > 0);
    }

    #[test]
    fn matches_reference_over_a_million_random_steps() {
        check_against_reference(1, 1_000_000, 1_000, 1_000_000_000, 50);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn matches_reference_for_any_rate(
            seed in any::<u64>(),
            tokens in 1u64..1_000_000,
            period_ns in 1u64..10_000_000_000,
            burst in 1u64..1_000,
        ) {
            check_against_reference(seed, 5_000, tokens, period_ns, burst);
        }

        #[test]
        fn waiting_the_retry_after_always_suffices(
            tokens in 1u64..10_000,
            period_ms in 1u64..10_000,
            burst in 1u64..100,
            drain in 0u64..100,
            n in 1u64..100,
        ) {
            let t0 = Instant::now();
            let mut b = TokenBucket::new(Rate::new(tokens, Duration::from_millis(period_ms)), burst, t0);
            let _ = b.try_take(t0, drain.min(burst));
            match b.try_take(t0, n) {
                Ok(()) => {}
                Err(w) if w.is_never() => prop_assert!(n > burst),
                Err(w) => {
                    prop_assert!(w.0 > Duration::ZERO);
                    let mut early = b.clone();
                    prop_assert!(early.try_take(t0 + w.0 - Duration::from_nanos(1), n).is_err());
                    prop_assert!(b.try_take(t0 + w.0, n).is_ok());
                }
            }
        }
    }
}

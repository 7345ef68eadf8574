//! [`InboundLimiter`] (SPEC B2): per-connection inbound rate, messages/s and bytes/s.
//! A frame over a limit is not dropped: the connection's reader holds it and stops reading
//! until the limiter's wait has passed, then checks it again (PROTOCOL.md §10). The client
//! is slowed by its transport's own flow control (TCP window, QUIC stream credit, KCP
//! window); nothing it sent is lost and nothing later overtakes it. One limiter per
//! connection: others never see it.

use std::time::Instant;

use super::bucket::{Rate, RetryAfter, TokenBucket};

/// Configuration of an [`InboundLimiter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundLimits {
    /// Frames per second.
    pub messages_per_sec: u64,
    /// Frame burst.
    pub message_burst: u64,
    /// Bytes per second (frames as the caller measures them).
    pub bytes_per_sec: u64,
    /// Byte burst; must be at least the largest frame, or that frame could never pass.
    pub byte_burst: u64,
}

impl Default for InboundLimits {
    fn default() -> Self {
        Self {
            messages_per_sec: 100,
            message_burst: 200,
            bytes_per_sec: 256 * 1024,
            byte_burst: 512 * 1024,
        }
    }
}

impl InboundLimits {
    /// Checks the values against the largest frame the connection accepts.
    pub fn validate(&self, max_message_len: usize) -> Result<(), String> {
        if self.messages_per_sec == 0 || self.message_burst == 0 {
            return Err("inbound: messages_per_sec and message_burst must be > 0".into());
        }
        if self.bytes_per_sec == 0 || self.byte_burst < max_message_len as u64 {
            return Err(format!(
                "inbound: bytes_per_sec must be > 0 and byte_burst >= the max frame size ({max_message_len})"
            ));
        }
        Ok(())
    }
}

/// The verdict on one inbound frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum InboundVerdict {
    /// Within the limits: process it now (its tokens are taken).
    Accept,
    /// Over a limit: hold it, read nothing else, and check it again after the wait (no
    /// tokens taken). [`RetryAfter::NEVER`] only for a frame larger than the byte burst,
    /// which [`InboundLimits::validate`] rules out.
    Wait(RetryAfter),
}

/// Counters of an [`InboundLimiter`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboundStats {
    /// Frames accepted.
    pub accepted_messages: u64,
    /// Bytes accepted.
    pub accepted_bytes: u64,
    /// Times the reader was told to wait.
    pub waits: u64,
}

/// Per-connection inbound rate limiter (sans-IO; the connection's reader owns it).
#[derive(Debug, Clone)]
pub struct InboundLimiter {
    messages: TokenBucket,
    bytes: TokenBucket,
    stats: InboundStats,
}

impl InboundLimiter {
    /// A limiter with full buckets at `now`.
    pub fn new(limits: InboundLimits, now: Instant) -> Self {
        Self {
            messages: TokenBucket::new(
                Rate::per_second(limits.messages_per_sec),
                limits.message_burst,
                now,
            ),
            bytes: TokenBucket::new(
                Rate::per_second(limits.bytes_per_sec),
                limits.byte_burst,
                now,
            ),
            stats: InboundStats::default(),
        }
    }

    /// Decides on one frame of `len` bytes received at `now`. It passes only if both
    /// buckets hold enough, and then takes from both; otherwise the wait is the longer of
    /// the two buckets' exact waits, and nothing is taken.
    pub fn check(&mut self, now: Instant, len: usize) -> InboundVerdict {
        let len = len as u64;
        let messages = self.messages.check(now, 1);
        let bytes = self.bytes.check(now, len);
        match (messages, bytes) {
            (Ok(()), Ok(())) => {
                self.messages.take_checked(1);
                self.bytes.take_checked(len);
                self.stats.accepted_messages += 1;
                self.stats.accepted_bytes += len;
                InboundVerdict::Accept
            }
            (m, b) => {
                self.stats.waits += 1;
                let wait = m
                    .err()
                    .max(b.err())
                    .unwrap_or(RetryAfter(std::time::Duration::ZERO));
                InboundVerdict::Wait(wait)
            }
        }
    }

    /// Whether both buckets are full at `now`: the limiter then carries no information
    /// (dropping it and creating a fresh one later is equivalent).
    pub fn is_idle(&mut self, now: Instant) -> bool {
        self.messages.is_full(now) && self.bytes.is_full(now)
    }

    /// The counters.
    pub fn stats(&self) -> InboundStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    const MS: Duration = Duration::from_millis(1);

    fn limits() -> InboundLimits {
        InboundLimits {
            messages_per_sec: 10,
            message_burst: 5,
            bytes_per_sec: 1_000,
            byte_burst: 1_000,
        }
    }

    #[test]
    fn message_rate_makes_the_excess_wait_exactly_and_counts() {
        let t0 = Instant::now();
        let mut l = InboundLimiter::new(limits(), t0);
        for _ in 0..5 {
            assert_eq!(l.check(t0, 10), InboundVerdict::Accept);
        }
        // One token every 100 ms: the sixth frame waits exactly that long.
        assert_eq!(l.check(t0, 10), InboundVerdict::Wait(RetryAfter(100 * MS)));
        assert_eq!(
            l.check(t0 + 40 * MS, 10),
            InboundVerdict::Wait(RetryAfter(60 * MS))
        );
        assert_eq!(l.check(t0 + 100 * MS, 10), InboundVerdict::Accept);
        let s = l.stats();
        assert_eq!((s.accepted_messages, s.waits), (6, 2));
        assert_eq!(s.accepted_bytes, 60);
    }

    #[test]
    fn byte_rate_waits_without_taking_message_tokens() {
        let t0 = Instant::now();
        let mut l = InboundLimiter::new(limits(), t0);
        assert_eq!(l.check(t0, 900), InboundVerdict::Accept);
        // 100 bytes left: 200 need 100 more, at 1,000/s.
        assert_eq!(l.check(t0, 200), InboundVerdict::Wait(RetryAfter(100 * MS)));
        // Small frames still pass: the wait took no message token.
        for _ in 0..4 {
            assert_eq!(l.check(t0, 25), InboundVerdict::Accept);
        }
        // Larger than the byte burst: never passes (validate() rules it out).
        assert_eq!(
            l.check(t0 + Duration::from_secs(60), 1_001),
            InboundVerdict::Wait(RetryAfter::NEVER)
        );
    }

    #[test]
    fn the_longer_of_the_two_waits_wins() {
        let t0 = Instant::now();
        let mut l = InboundLimiter::new(limits(), t0);
        for _ in 0..5 {
            assert_eq!(l.check(t0, 200), InboundVerdict::Accept);
        }
        // Messages: 100 ms; bytes: 200 bytes at 1,000/s = 200 ms.
        assert_eq!(l.check(t0, 200), InboundVerdict::Wait(RetryAfter(200 * MS)));
    }

    #[test]
    fn validation_names_the_problem() {
        assert!(InboundLimits::default().validate(64 * 1024).is_ok());
        assert!(limits().validate(2_000).unwrap_err().contains("byte_burst"));
    }

    proptest! {
        /// A reader that always waits as told, whatever the client sends, lets through
        /// every frame in order at no more than the burst plus the rate; a client within the
        /// rate never waits.
        #[test]
        fn a_reader_that_waits_as_told_admits_everything_at_the_rate(
            n in 1usize..400,
            gap_us in 100_000u64..1_000_000,
        ) {
            let t0 = Instant::now();
            let mut flood = InboundLimiter::new(limits(), t0);
            let mut now = t0;
            for _ in 0..n {
                loop {
                    match flood.check(now, 10) {
                        InboundVerdict::Accept => break,
                        InboundVerdict::Wait(w) => {
                            prop_assert!(!w.is_never());
                            now += w.0;
                        }
                    }
                }
            }
            prop_assert_eq!(flood.stats().accepted_messages, n as u64);
            // n frames took at least (n - burst) / rate, never less.
            let floor = Duration::from_millis(100) * (n.saturating_sub(5) as u32);
            prop_assert!(now - t0 >= floor);
            prop_assert!(now - t0 <= floor + MS);
            let mut polite = InboundLimiter::new(limits(), t0);
            let mut t = t0;
            for _ in 0..500 {
                prop_assert_eq!(polite.check(t, 100), InboundVerdict::Accept);
                t += Duration::from_micros(gap_us);
            }
        }
    }
}

//! [`InboundLimiter`] (SPEC B2): per-connection inbound rate, messages/s and bytes/s.
//! Excess messages are dropped and counted; a connection that keeps flooding is disconnected
//! with [`CloseCode::RateLimited`]. One limiter per connection: others never see it.

use std::time::{Duration, Instant};

use super::bucket::{Rate, TokenBucket};
use waygate_protocol::wire::CloseCode;

/// Configuration of an [`InboundLimiter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundLimits {
    /// Messages per second.
    pub messages_per_sec: u64,
    /// Message burst.
    pub message_burst: u64,
    /// Bytes per second (payload as the caller measures it).
    pub bytes_per_sec: u64,
    /// Byte burst; must be at least the largest message, or that message is always dropped.
    pub byte_burst: u64,
    /// Drops tolerated within `strike_window` before the connection is closed.
    pub strikes: u32,
    /// The window over which `strikes` drops are tolerated: strikes form a bucket of
    /// `strikes` refilling `strikes` per window, so a burst of more than `strikes` drops, or
    /// a sustained drop rate above `strikes / strike_window`, disconnects.
    pub strike_window: Duration,
}

impl Default for InboundLimits {
    fn default() -> Self {
        Self {
            messages_per_sec: 100,
            message_burst: 200,
            bytes_per_sec: 256 * 1024,
            byte_burst: 512 * 1024,
            strikes: 50,
            strike_window: Duration::from_secs(10),
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
        if self.strike_window.is_zero() {
            return Err("inbound: strike_window must be > 0".into());
        }
        Ok(())
    }
}

/// The verdict on one inbound message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum InboundVerdict {
    /// Within the limits: process it.
    Accept,
    /// Over a limit: discard it (counted; a strike).
    Drop,
    /// Too many strikes: close the connection with `code` (sticky: every later call says so).
    Disconnect {
        /// Always [`CloseCode::RateLimited`].
        code: CloseCode,
    },
}

/// Counters of an [`InboundLimiter`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboundStats {
    /// Messages accepted.
    pub accepted_messages: u64,
    /// Bytes accepted.
    pub accepted_bytes: u64,
    /// Messages dropped.
    pub dropped_messages: u64,
    /// Bytes dropped.
    pub dropped_bytes: u64,
}

/// Per-connection inbound rate limiter (sans-IO; the connection's reader owns it).
#[derive(Debug, Clone)]
pub struct InboundLimiter {
    messages: TokenBucket,
    bytes: TokenBucket,
    strikes: TokenBucket,
    disconnected: bool,
    stats: InboundStats,
}

impl InboundLimiter {
    /// A limiter with full buckets at `now`.
    pub fn new(limits: InboundLimits, now: Instant) -> Self {
        let strikes = u64::from(limits.strikes);
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
            strikes: TokenBucket::new(Rate::new(strikes, limits.strike_window), strikes, now),
            disconnected: false,
            stats: InboundStats::default(),
        }
    }

    /// Decides on one message of `len` bytes received at `now`. A message passes only if
    /// both buckets hold enough; a dropped message takes no tokens.
    pub fn check(&mut self, now: Instant, len: usize) -> InboundVerdict {
        if self.disconnected {
            return Self::disconnect();
        }
        let len = len as u64;
        if self.messages.check(now, 1).is_ok() && self.bytes.check(now, len).is_ok() {
            self.messages.take_checked(1);
            self.bytes.take_checked(len);
            self.stats.accepted_messages += 1;
            self.stats.accepted_bytes += len;
            return InboundVerdict::Accept;
        }
        self.stats.dropped_messages += 1;
        self.stats.dropped_bytes += len;
        if self.strikes.try_take(now, 1).is_err() {
            self.disconnected = true;
            return Self::disconnect();
        }
        InboundVerdict::Drop
    }

    fn disconnect() -> InboundVerdict {
        InboundVerdict::Disconnect {
            code: CloseCode::RateLimited,
        }
    }

    /// Whether the limiter has decided to disconnect.
    pub fn is_disconnected(&self) -> bool {
        self.disconnected
    }

    /// The counters.
    pub fn stats(&self) -> InboundStats {
        self.stats
    }

    /// Strikes left at `now` before a disconnect.
    pub fn strikes_left(&mut self, now: Instant) -> u64 {
        self.strikes.available(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    fn limits() -> InboundLimits {
        InboundLimits {
            messages_per_sec: 10,
            message_burst: 5,
            bytes_per_sec: 1_000,
            byte_burst: 1_000,
            strikes: 3,
            strike_window: Duration::from_secs(1),
        }
    }

    #[test]
    fn message_rate_drops_excess_and_counts() {
        let t0 = Instant::now();
        let mut l = InboundLimiter::new(limits(), t0);
        for _ in 0..5 {
            assert_eq!(l.check(t0, 10), InboundVerdict::Accept);
        }
        assert_eq!(l.check(t0, 10), InboundVerdict::Drop);
        // 100 ms later one more token exists.
        assert_eq!(l.check(t0 + 100 * MS, 10), InboundVerdict::Accept);
        let s = l.stats();
        assert_eq!((s.accepted_messages, s.dropped_messages), (6, 1));
        assert_eq!((s.accepted_bytes, s.dropped_bytes), (60, 10));
    }

    #[test]
    fn byte_rate_drops_large_messages_without_taking_message_tokens() {
        let t0 = Instant::now();
        let mut l = InboundLimiter::new(limits(), t0);
        assert_eq!(l.check(t0, 900), InboundVerdict::Accept);
        assert_eq!(l.check(t0, 200), InboundVerdict::Drop);
        // Small messages still pass: the drop took no message token.
        for _ in 0..4 {
            assert_eq!(l.check(t0, 25), InboundVerdict::Accept);
        }
        // Larger than the byte burst: never passes.
        assert_eq!(
            l.check(t0 + Duration::from_secs(60), 1_001),
            InboundVerdict::Drop
        );
    }

    #[test]
    fn repeated_violation_disconnects_and_stays_disconnected() {
        let t0 = Instant::now();
        let mut l = InboundLimiter::new(limits(), t0);
        for _ in 0..5 {
            assert_eq!(l.check(t0, 1), InboundVerdict::Accept);
        }
        for _ in 0..3 {
            assert_eq!(l.check(t0, 1), InboundVerdict::Drop);
        }
        let d = InboundVerdict::Disconnect {
            code: CloseCode::RateLimited,
        };
        assert_eq!(l.check(t0, 1), d);
        assert!(l.is_disconnected());
        assert_eq!(l.check(t0 + Duration::from_secs(100), 1), d);
    }

    #[test]
    fn occasional_violations_are_forgiven() {
        let t0 = Instant::now();
        let mut l = InboundLimiter::new(limits(), t0);
        let mut now = t0;
        // Burst over the limit by 2 every second, for a minute: 2 strikes per 1 s window,
        // below the 3 tolerated.
        for _ in 0..60 {
            for _ in 0..7 {
                let v = l.check(now, 1);
                assert_ne!(
                    v,
                    InboundVerdict::Disconnect {
                        code: CloseCode::RateLimited
                    }
                );
            }
            now += Duration::from_secs(1);
        }
        assert_eq!(l.stats().dropped_messages, 120);
    }

    #[test]
    fn validation_names_the_problem() {
        assert!(InboundLimits::default().validate(64 * 1024).is_ok());
        assert!(limits().validate(2_000).unwrap_err().contains("byte_burst"));
    }

    proptest! {
        /// A client at 10x its allowed rate is throttled to the rate, then disconnected
        /// quickly; a client within the rate never loses a message.
        #[test]
        fn flooder_is_disconnected_and_a_polite_client_is_not(gap_us in 100_000u64..1_000_000) {
            let t0 = Instant::now();
            let mut flood = InboundLimiter::new(limits(), t0);
            let mut polite = InboundLimiter::new(limits(), t0);
            let mut now = t0;
            let mut flood_end = None;
            for i in 0..2_000u32 {
                // 100 msgs/s against a limit of 10.
                now = t0 + Duration::from_millis(10) * i;
                if let InboundVerdict::Disconnect { .. } = flood.check(now, 10) {
                    flood_end = Some(now);
                    break;
                }
            }
            let end = flood_end.expect("flooder disconnected");
            prop_assert!(end - t0 < Duration::from_secs(1));
            prop_assert!(flood.stats().accepted_messages <= 5 + 1);
            let _ = now;
            let mut t = t0;
            for _ in 0..500 {
                prop_assert_eq!(polite.check(t, 100), InboundVerdict::Accept);
                t += Duration::from_micros(gap_us);
            }
        }
    }
}

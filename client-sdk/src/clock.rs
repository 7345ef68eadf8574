//! The game server's clock as seen from the client (SDK issue item 9), sans-IO.
//!
//! A clock sample is a request answered with the server's Unix time in ms (PROTOCOL.md §13,
//! the demo's `TIME`): sent at local time `t0`, answered `T`, received after `rtt`. Assuming
//! the answer was read half way, the offset is `T - (t0 + rtt / 2)`, off by at most `rtt / 2`
//! when the two directions are not symmetric. Like NTP's clock filter, the estimate is the
//! sample with the smallest round trip among the last [`SAMPLES_KEPT`]: queueing only ever
//! adds delay, so the fastest exchange is the least distorted.

use std::collections::VecDeque;
use std::time::Duration;

/// Samples the estimate is chosen from.
pub const SAMPLES_KEPT: usize = 8;

/// The server clock offset estimate: server time = local Unix time + `offset_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClockEstimate {
    /// Server clock minus local clock, in milliseconds.
    pub offset_ms: i64,
    /// Round trip of the sample chosen (the estimate is within half of it).
    pub rtt: Duration,
    /// Samples taken so far.
    pub samples: u32,
}

impl ClockEstimate {
    /// The server's time now, Unix ms, given the local time now.
    #[must_use]
    pub fn server_time_ms(&self, local_unix_ms: u64) -> i64 {
        i64::try_from(local_unix_ms)
            .unwrap_or(i64::MAX)
            .saturating_add(self.offset_ms)
    }
}

/// Keeps the recent samples and chooses the estimate.
#[derive(Debug, Default, Clone)]
pub struct ClockSync {
    recent: VecDeque<(Duration, i64)>,
    samples: u32,
}

impl ClockSync {
    /// Adds a sample: sent at local Unix ms `sent_unix_ms`, answered with `server_unix_ms`,
    /// after a round trip of `rtt`. Returns the new estimate.
    pub fn observe(
        &mut self,
        sent_unix_ms: u64,
        rtt: Duration,
        server_unix_ms: u64,
    ) -> ClockEstimate {
        let half = i128::try_from(rtt.as_millis() / 2).unwrap_or(i128::MAX);
        let offset = i128::from(server_unix_ms) - (i128::from(sent_unix_ms) + half);
        let offset = i64::try_from(offset).unwrap_or(if offset < 0 { i64::MIN } else { i64::MAX });
        if self.recent.len() == SAMPLES_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back((rtt, offset));
        self.samples = self.samples.saturating_add(1);
        self.estimate().unwrap_or(ClockEstimate {
            offset_ms: offset,
            rtt,
            samples: self.samples,
        })
    }

    /// The current estimate (`None` before the first sample).
    #[must_use]
    pub fn estimate(&self) -> Option<ClockEstimate> {
        let (rtt, offset) = self.recent.iter().min_by_key(|(rtt, _)| *rtt)?;
        Some(ClockEstimate {
            offset_ms: *offset,
            rtt: *rtt,
            samples: self.samples,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_fastest_recent_exchange_wins() {
        let mut c = ClockSync::default();
        assert_eq!(c.estimate(), None);
        // Server 5 s ahead; 100 ms round trip, symmetric.
        let e = c.observe(1_000_000, Duration::from_millis(100), 1_005_050);
        assert_eq!((e.offset_ms, e.samples), (5_000, 1));
        // A slow exchange (the answer queued 400 ms on the way back) does not move it.
        let e = c.observe(1_001_000, Duration::from_millis(500), 1_006_050);
        assert_eq!((e.offset_ms, e.rtt), (5_000, Duration::from_millis(100)));
        // A faster one does.
        let e = c.observe(1_002_000, Duration::from_millis(20), 1_007_011);
        assert_eq!((e.offset_ms, e.rtt), (5_001, Duration::from_millis(20)));
        // Old samples age out.
        for i in 0..SAMPLES_KEPT as u64 {
            c.observe(
                1_003_000 + i,
                Duration::from_millis(60),
                1_003_030 + i - 250,
            );
        }
        assert_eq!(c.estimate().unwrap().offset_ms, -250);
        assert_eq!(c.estimate().unwrap().samples, 3 + SAMPLES_KEPT as u32);
        assert_eq!(c.estimate().unwrap().server_time_ms(10_000), 9_750);
    }

    proptest! {
        /// With any true offset and any split of each round trip between the two
        /// directions, the estimate is within half of its chosen round trip of the truth.
        #[test]
        fn the_estimate_is_within_half_a_round_trip(
            truth in -86_400_000i64..86_400_000,
            exchanges in proptest::collection::vec((0u64..2_000, 0u64..2_000), 1..20),
        ) {
            let mut c = ClockSync::default();
            let mut local = 1_700_000_000_000u64;
            for (up, down) in exchanges {
                let server = (i128::from(local) + i128::from(truth) + i128::from(up)) as u64;
                let e = c.observe(local, Duration::from_millis(up + down), server);
                let error = (e.offset_ms - truth).unsigned_abs();
                prop_assert!(error <= (e.rtt.as_millis() as u64).div_ceil(2), "error {} rtt {:?}", error, e.rtt);
                local += up + down + 1_000;
            }
        }
    }
}

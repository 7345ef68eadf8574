//! Load reports (SPEC R10): a process samples its players and message total now and then;
//! [`RateMeter`] turns the total into a rate, [`spawn_load_meter`] publishes [`Load`] for the
//! registry's reporters.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::Load;

/// Samples the load of this process every `every` and publishes it on `load` (what
/// [`crate::EtcdRegistry::spawn_reporter`] reads). `sample` returns the players now hosted
/// and the growing message total, or `None` once its owner is gone; the task also ends when
/// every reporter has stopped reading.
pub fn spawn_load_meter(
    every: Duration,
    load: watch::Sender<Load>,
    mut sample: impl FnMut() -> Option<(usize, u64)> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        let mut meter = RateMeter::default();
        loop {
            tick.tick().await;
            let Some((players, messages)) = sample() else {
                return;
            };
            let msg_rate = meter.observe(Instant::now(), messages);
            let players = u32::try_from(players).unwrap_or(u32::MAX);
            if load.send(Load { players, msg_rate }).is_err() {
                return;
            }
        }
    })
}

/// Messages per second from a growing total sampled now and then (sans-IO: the time comes
/// in). The first sample gives 0; a total that went down (a restart) counts from there.
#[derive(Debug, Default)]
pub struct RateMeter {
    last: Option<(Instant, u64)>,
}

impl RateMeter {
    /// The rate since the previous sample (0 for the first).
    pub fn observe(&mut self, now: Instant, total: u64) -> f64 {
        let rate = match self.last {
            Some((then, before)) if now > then => {
                total.saturating_sub(before) as f64 / now.duration_since(then).as_secs_f64()
            }
            _ => 0.0,
        };
        self.last = Some((now, total));
        rate
    }
}

#[cfg(test)]
mod tests {
    use super::RateMeter;
    use std::time::Duration;
    use tokio::time::Instant;

    #[test]
    fn the_rate_is_the_growth_over_the_time_between_samples() {
        let t0 = Instant::now();
        let mut m = RateMeter::default();
        assert_eq!(m.observe(t0, 100), 0.0);
        assert_eq!(m.observe(t0 + Duration::from_millis(500), 400), 600.0);
        assert_eq!(
            m.observe(t0 + Duration::from_millis(500), 900),
            0.0,
            "no time passed"
        );
        assert_eq!(
            m.observe(t0 + Duration::from_secs(2), 50),
            0.0,
            "a reset counts from there"
        );
        assert_eq!(m.observe(t0 + Duration::from_secs(4), 250), 100.0);
    }
}

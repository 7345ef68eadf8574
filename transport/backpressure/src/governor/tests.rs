use super::*;
use proptest::prelude::*;
use OverloadLevel::*;

const S: Duration = Duration::from_secs(1);

/// Loop-lag thresholds only: level n enters at n*100 and exits below n*100 - 30.
fn config() -> GovernorConfig {
    let level = |n: u64| LevelThresholds {
        loop_lag_ms: Threshold::new(n * 100, n * 100 - 30),
        ..LevelThresholds::DISABLED
    };
    GovernorConfig {
        levels: [level(1), level(2), level(3)],
        min_dwell: 5 * S,
        refuse_retry_after: 2 * S,
    }
}

fn q(bytes: u64) -> OverloadInputs {
    OverloadInputs {
        loop_lag_ms: bytes,
        ..OverloadInputs::default()
    }
}

#[test]
fn rises_at_once_and_falls_after_dwell_below_exit() {
    let t0 = Instant::now();
    let mut g = OverloadGovernor::new(config(), t0);
    assert_eq!(g.observe(t0, q(99)), Normal);
    assert_eq!(g.observe(t0, q(100)), ShedBestEffort);
    assert!(g.shed_best_effort());
    assert_eq!(g.refuse_new_sessions(), None);
    // Straight to 3.
    assert_eq!(g.observe(t0 + S, q(350)), RefuseConnections);
    assert_eq!(g.refuse_new_connections(), Some(2 * S));
    assert_eq!(g.refuse_new_sessions(), Some(2 * S));
    // Below enter(3) but above exit(3) = 270: stays, whatever the time.
    assert_eq!(g.observe(t0 + 100 * S, q(280)), RefuseConnections);
    // Below exit: falls only once 5 s have passed since the level was entered.
    let entered3 = t0 + S;
    assert_eq!(g.observe(entered3 + 4 * S, q(0)), RefuseConnections);
    // (It has been at level 3 long enough by now.)
    assert_eq!(g.observe(t0 + 101 * S, q(180)), RefuseNewSessions);
    assert_eq!(g.refuse_new_connections(), None);
    assert_eq!(g.refuse_new_sessions(), Some(2 * S));
    assert_eq!(
        g.observe(t0 + 102 * S, q(0)),
        RefuseNewSessions,
        "dwell at 2"
    );
    assert_eq!(g.observe(t0 + 106 * S, q(0)), Normal);
    assert!(!g.shed_best_effort());
    assert_eq!(g.refuse_new_sessions(), None);
    let s = g.stats();
    assert_eq!(s.entered, [1, 1, 1, 1]);
    assert_eq!(s.changes, 4);
    assert!(s.falls_deferred >= 2);
}

#[test]
fn any_input_raises_the_level() {
    let t0 = Instant::now();
    let cfg = GovernorConfig::for_limits(1_000, 10_000, 1_000);
    cfg.validate().unwrap();
    let mut g = OverloadGovernor::new(cfg, t0);
    let sessions = |n| OverloadInputs {
        sessions: n,
        ..OverloadInputs::default()
    };
    assert_eq!(g.observe(t0, sessions(699)), Normal);
    assert_eq!(g.observe(t0, sessions(700)), ShedBestEffort);
    assert_eq!(g.observe(t0, sessions(950)), RefuseConnections);
    let mem = OverloadInputs {
        memory_bytes: 7_500,
        ..OverloadInputs::default()
    };
    let mut g = OverloadGovernor::new(cfg, t0);
    assert_eq!(g.observe(t0, mem), RefuseNewSessions);
    assert_eq!(g.observe(t0, q(1_000)), RefuseConnections);
}

#[test]
fn disabled_thresholds_never_trigger() {
    let t0 = Instant::now();
    let cfg = GovernorConfig {
        levels: [LevelThresholds::DISABLED; 3],
        ..config()
    };
    let mut g = OverloadGovernor::new(cfg, t0);
    let max = OverloadInputs {
        loop_lag_ms: u64::MAX,
        sessions: u64::MAX,
        memory_bytes: u64::MAX,
    };
    assert_eq!(g.observe(t0, max), Normal);
}

#[test]
fn validation() {
    assert!(config().validate().is_ok());
    let mut c = config();
    c.levels[0].loop_lag_ms = Threshold::new(10, 20);
    assert!(c.validate().unwrap_err().contains("exit > enter"));
    let mut c = config();
    c.levels[2].loop_lag_ms = Threshold::new(50, 10);
    assert!(c.validate().unwrap_err().contains("decrease"));
}

#[test]
fn parses_proc_limits() {
    let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
                Max cpu time              unlimited            unlimited            seconds   \n\
                Max open files            1024                 524288               files     \n";
    assert_eq!(parse_fd_soft_limit(text), Some(Some(1024)));
    assert_eq!(session_cap_for_fd_limit(Some(1024)), 512);
    let unlimited = "Max open files            unlimited            unlimited            files\n";
    assert_eq!(parse_fd_soft_limit(unlimited), Some(None));
    assert_eq!(session_cap_for_fd_limit(None), UNLIMITED_FDS_ASSUMED / 2);
    assert_eq!(parse_fd_soft_limit("Max open files   lots"), None);
    assert_eq!(parse_fd_soft_limit(""), None);
    assert_eq!(session_cap_for_fd_limit(Some(1)), 1);
    // The real one (Linux CI): some positive cap either way.
    assert!(default_session_cap() >= 1);
}

#[test]
fn parses_rss() {
    assert_eq!(
        parse_rss_bytes("Name:\tx\nVmRSS:\t  2048 kB\n"),
        Some(2048 * 1024)
    );
    assert_eq!(parse_rss_bytes("VmRSS: x kB"), None);
    assert_eq!(parse_rss_bytes("VmRSS: 1 MB"), None);
    assert_eq!(parse_rss_bytes(""), None);
    if cfg!(target_os = "linux") {
        assert!(process_rss_bytes().unwrap() > 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Over any input trace: a fall happens only >= dwell after the previous change, the
    /// level never exceeds what the inputs reached (entered), never stays above what they
    /// hold once the dwell has passed, and rises are immediate.
    #[test]
    fn never_oscillates_faster_than_the_dwell(
        steps in proptest::collection::vec((0u64..2_000, 0u64..400), 1..300),
    ) {
        let cfg = config();
        let t0 = Instant::now();
        let mut g = OverloadGovernor::new(cfg, t0);
        let mut now = t0;
        let mut last_change = t0;
        let mut prev = Normal;
        for (dt_ms, bytes) in steps {
            now += Duration::from_millis(dt_ms);
            let level = g.observe(now, q(bytes));
            let entered = (1..=3u64).rev().find(|&l| bytes >= l * 100).unwrap_or(0) as u8;
            let held = (1..=3u64).rev().find(|&l| bytes >= l * 100 - 30).unwrap_or(0) as u8;
            if level < prev {
                prop_assert!(now - last_change >= cfg.min_dwell, "fell after {:?}", now - last_change);
                prop_assert_eq!(level.as_u8(), held);
            }
            if level > prev {
                prop_assert_eq!(level.as_u8(), entered);
            }
            if entered > prev.as_u8() {
                prop_assert_eq!(level.as_u8(), entered, "rises are immediate");
            }
            if level != prev {
                last_change = now;
            }
            prop_assert!(level.as_u8() >= entered);
            if now - last_change >= cfg.min_dwell || level == prev {
                prop_assert!(level.as_u8() <= held.max(prev.as_u8()));
            }
            prev = level;
            prop_assert_eq!(g.since(), last_change);
        }
    }
}

/// One slow tick raises nothing; a loop late on every tick of the window does, and one
/// tick on time brings the sustained lag down again.
#[test]
fn the_sustained_loop_lag_is_the_least_of_the_window() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let mut lag = LoopLag::default();
    let tick = |lag: &mut LoopLag, i: u64, late: u64| {
        let due = t0 + ms(200 * i);
        lag.sample(due, due + ms(late));
    };
    for i in 0..4 {
        tick(&mut lag, i, 2_000);
    }
    assert_eq!(lag.sustained_ms(), 0, "not a full window yet");
    tick(&mut lag, 4, 1_500);
    assert_eq!(lag.sustained_ms(), 1_500);
    tick(&mut lag, 5, 3);
    assert_eq!(lag.sustained_ms(), 3);
    for i in 6..10 {
        tick(&mut lag, i, 900);
    }
    assert_eq!(
        lag.sustained_ms(),
        3,
        "the on-time tick is still in the window"
    );
    tick(&mut lag, 10, 950);
    assert_eq!(lag.sustained_ms(), 900);
    // A clock that went backwards is no lag.
    lag.sample(t0 + ms(5_000), t0);
    assert_eq!(lag.sustained_ms(), 0);
}

/// The default thresholds: a loop a quarter of `refuse_lag_ms` late sheds best-effort, all
/// of it refuses connections; 0 turns the input off.
#[test]
fn loop_lag_thresholds_follow_the_refusal_lag() {
    let c = GovernorConfig::for_limits(1_000, 1 << 30, 1_000);
    assert!(c.validate().is_ok());
    let t0 = Instant::now();
    let mut g = OverloadGovernor::new(c, t0);
    let lag = |ms: u64| OverloadInputs {
        loop_lag_ms: ms,
        ..OverloadInputs::default()
    };
    assert_eq!(g.observe(t0, lag(249)), Normal);
    assert_eq!(g.observe(t0, lag(250)), ShedBestEffort);
    assert_eq!(g.observe(t0, lag(1_000)), RefuseConnections);
    // Held until below half the enter (500), after the dwell.
    assert_eq!(g.observe(t0 + 10 * S, lag(500)), RefuseConnections);
    assert_eq!(g.observe(t0 + 10 * S, lag(499)), RefuseNewSessions);
    let off = GovernorConfig::for_limits(1_000, 1 << 30, 0);
    let mut g = OverloadGovernor::new(off, t0);
    assert_eq!(g.observe(t0, lag(u64::MAX)), Normal);
}

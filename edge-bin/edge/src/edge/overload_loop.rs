//! The overload loop: feeds the governor (B5) and applies its level to admission; gives
//! freed memory back to the system after many connections went away.

use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use super::Shared;

/// Feeds the overload governor (B5) and applies its decisions: level 1 sheds best-effort
/// pushes, level 2 refuses new sessions (a resume is still taken), level 3 makes admission
/// refuse every new connection with a retry-after.
pub(super) async fn overload_loop(shared: Weak<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweeps = 0u32;
    // After 512 connections or sessions went away, freed memory goes back to the system.
    let mut trim = crate::memory::TrimPolicy::new(512);
    // How late this tick runs is the event loop's lag (what every session's task waits
    // for a worker too).
    let mut lag = waygate_backpressure::LoopLag::default();
    loop {
        let due = tick.tick().await;
        lag.sample(due.into_std(), std::time::Instant::now());
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let sessions = shared.session_layer().registry.len() as u64;
        let memory = waygate_backpressure::process_rss_bytes().unwrap_or(0);
        let loop_lag_ms = lag.sustained_ms();
        shared
            .metrics
            .event_loop_lag_seconds
            .set(loop_lag_ms as f64 / 1_000.0);
        let before = shared.governor.level.load(Ordering::Acquire);
        let refuse = shared.governor.observe(sessions, memory, loop_lag_ms);
        shared.admission.refuse_all(refuse.connections);
        shared
            .session_layer()
            .set_new_sessions_refused(refuse.new_sessions);
        let level = shared.governor.level.load(Ordering::Acquire);
        if level != before {
            tracing::warn!(
                from = before,
                to = level,
                sessions,
                memory,
                loop_lag_ms,
                "overload level changed"
            );
        }
        shared.metrics.overload_level.set(i64::from(level));
        let refused = shared.admission.refused.load(Ordering::Relaxed);
        let counted = shared.metrics.admission_refused.get();
        if refused > counted {
            shared.metrics.admission_refused.inc_by(refused - counted);
        }
        if trim.observe(sessions + shared.admission.handshakes_in_flight()) || trim.follow_up() {
            let returned = crate::memory::give_back();
            tracing::debug!(
                returned,
                "freed memory handed back after connections closed"
            );
        }
        sweeps += 1;
        if sweeps % 50 == 0 {
            shared.admission.sweep();
        }
    }
}

//! The edge's backpressure shell (SPEC B1, B5): the admission gate every listener asks
//! before any expensive work, and the overload governor fed from a periodic tick. The
//! decisions themselves are the sans-IO stages of `waygate_backpressure`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use waygate_backpressure::{
    Admission, AdmissionConfig, AdmissionControl, GovernorConfig, InboundLimits, OverloadGovernor,
    OverloadInputs, PhaseDeadlines, Rate,
};
use waygate_transport::listener::{AdmissionGate, Admit};
use waygate_transport::CloseCode;

use crate::config::BackpressureConfig;

/// Admission for all of an edge's listeners: per-edge and per-source token buckets, a cap
/// on handshakes in flight, and a switch the governor flips at overload level 3.
#[derive(Debug)]
pub struct EdgeAdmission {
    control: Mutex<AdmissionControl>,
    /// Non-zero: refuse every new connection with this retry-after (ms).
    refuse_all_ms: AtomicU32,
    /// Connections refused so far.
    pub refused: AtomicU64,
}

impl EdgeAdmission {
    /// From the edge's settings.
    pub fn new(config: &BackpressureConfig, deadlines: PhaseDeadlines) -> Self {
        let admission = AdmissionConfig {
            global_rate: Rate::per_second(config.accept_per_sec),
            global_burst: config.accept_burst,
            per_source_rate: Rate::per_second(config.accept_per_source_per_sec),
            per_source_burst: config.accept_per_source_burst,
            max_handshakes: config.max_handshakes,
            deadlines,
            ..AdmissionConfig::default()
        };
        Self {
            control: Mutex::new(AdmissionControl::new(admission, std::time::Instant::now())),
            refuse_all_ms: AtomicU32::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// Refuse every new connection with `retry_after` (None: admit normally again).
    pub fn refuse_all(&self, retry_after: Option<Duration>) {
        let ms = retry_after.map_or(0, |d| {
            u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
        });
        self.refuse_all_ms.store(ms, Ordering::Release);
    }

    /// Connections admitted and not yet past WELCOME.
    pub fn handshakes_in_flight(&self) -> u64 {
        self.control.lock().map_or(0, |c| c.handshakes_in_flight())
    }

    /// Forgets idle sources (call from a periodic tick).
    pub fn sweep(&self) {
        if let Ok(mut c) = self.control.lock() {
            c.sweep(std::time::Instant::now());
        }
    }
}

impl AdmissionGate for EdgeAdmission {
    fn admit(&self, peer: SocketAddr) -> Admit {
        let refuse_all = self.refuse_all_ms.load(Ordering::Acquire);
        if refuse_all > 0 {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Admit::Refuse {
                code: CloseCode::Overloaded,
                retry_after_ms: refuse_all,
            };
        }
        let verdict = match self.control.lock() {
            Ok(mut c) => c.admit(std::time::Instant::now(), peer.ip()),
            Err(_) => return Admit::Go(None),
        };
        match verdict {
            Admission::Admit(permit) => Admit::Go(Some(permit)),
            Admission::Refuse {
                code, retry_after, ..
            } => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Admit::Refuse {
                    code,
                    retry_after_ms: u32::try_from(retry_after.as_millis())
                        .unwrap_or(u32::MAX)
                        .max(1),
                }
            }
        }
    }

    fn hold_slot(&self) -> Option<waygate_backpressure::HandshakePermit> {
        let mut c = self.control.lock().ok()?;
        Some(c.hold_slot(std::time::Instant::now()))
    }
}

/// The per-connection inbound limits (B2) from the edge's settings.
pub fn inbound_limits(config: &BackpressureConfig) -> InboundLimits {
    InboundLimits {
        messages_per_sec: config.inbound_msgs_per_sec,
        message_burst: config.inbound_msg_burst.max(1),
        bytes_per_sec: config.inbound_bytes_per_sec,
        byte_burst: config.inbound_byte_burst.max(1),
    }
}

/// What the overload level refuses now, each with its retry-after.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OverloadRefusals {
    /// Every new connection, at accept (level 3).
    pub connections: Option<Duration>,
    /// New sessions: a HELLO without a resume request (level 2 and above).
    pub new_sessions: Option<Duration>,
}

/// The overload governor (B5) with the edge's session cap, memory budget and loop-lag limit.
#[derive(Debug)]
pub struct Governor {
    governor: Mutex<OverloadGovernor>,
    /// The session cap in force.
    pub session_cap: u64,
    /// Level 1 and above: shed best-effort pushes.
    pub shed_best_effort: AtomicBool,
    /// The current level (0..=3), for metrics and /healthz.
    pub level: AtomicU32,
}

impl Governor {
    /// From the edge's settings.
    pub fn new(config: &BackpressureConfig) -> Self {
        let session_cap = if config.max_sessions == 0 {
            waygate_backpressure::default_session_cap()
        } else {
            config.max_sessions
        };
        let memory = if config.memory_budget_mb == 0 {
            u64::MAX
        } else {
            config.memory_budget_mb.saturating_mul(1024 * 1024)
        };
        Self {
            governor: Mutex::new(OverloadGovernor::new(
                GovernorConfig::for_limits(session_cap, memory, config.refuse_at_loop_lag_ms),
                std::time::Instant::now(),
            )),
            session_cap,
            shed_best_effort: AtomicBool::new(false),
            level: AtomicU32::new(0),
        }
    }

    /// Feeds the current load (`loop_lag_ms`: the event loop's sustained lag, from a
    /// [`LoopLag`](waygate_backpressure::LoopLag)); returns what the level refuses.
    pub fn observe(&self, sessions: u64, memory_bytes: u64, loop_lag_ms: u64) -> OverloadRefusals {
        let Ok(mut g) = self.governor.lock() else {
            return OverloadRefusals::default();
        };
        let level = g.observe(
            std::time::Instant::now(),
            OverloadInputs {
                loop_lag_ms,
                sessions,
                memory_bytes,
            },
        );
        self.level.store(level as u32, Ordering::Release);
        self.shed_best_effort
            .store(g.shed_best_effort(), Ordering::Release);
        OverloadRefusals {
            connections: g.refuse_new_connections(),
            new_sessions: g.refuse_new_sessions(),
        }
    }

    /// The event loop's sustained lag the governor last observed, ms (for /healthz).
    pub fn last_loop_lag_ms(&self) -> u64 {
        self.governor
            .lock()
            .map_or(0, |g| g.last_inputs().loop_lag_ms)
    }
}

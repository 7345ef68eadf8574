//! # waygate-backpressure
//!
//! Backpressure stages (SPEC B1–B3, B5) as sans-IO types: each is a plain struct that never
//! reads a clock (time comes in as [`std::time::Instant`]), never does I/O, holds bounded
//! state, and answers with a typed outcome. The edge drives them from its async tasks.
//!
//! | Stage | SPEC | Owner (one per) | Call | Outcome |
//! |---|---|---|---|---|
//! | [`TokenBucket`] | — | anything | `try_take(now, n)` | `Ok` / [`RetryAfter`] |
//! | [`AdmissionControl`] | B1 | listener / accept loop | `admit(now, ip)` | [`Admission`] |
//! | [`InboundLimiter`] | B2 | connection reader | `check(now, len)` | [`InboundVerdict`] |
//! | [`OutboundQueue`] | B3 | session writer | `push(class, item, len, key)` / `pop()` | [`PushOutcome`] |
//! | [`OverloadGovernor`] | B5 | edge (periodic tick) | `observe(now, inputs)` | [`OverloadLevel`] |
//!
//! B4 (backend link credits) lives with the links.
//!
//! A leaf crate (it depends on the protocol crate's codes and classes only) because every
//! layer uses a stage: the listeners admission, the KCP endpoint the cookie bucket, the
//! session layer the inbound limiter and outbound queue, the edge the governor, and routing
//! the [`TokenBucket`] that paces migrations: one token bucket for the whole workspace. What
//! it must never do: read a clock, do I/O, or depend on a runtime or a higher layer.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use waygate_backpressure::{OutboundConfig, OutboundQueue, PushOutcome};
//! use waygate_protocol::TrafficClass;
//!
//! let mut q = OutboundQueue::new(OutboundConfig::default());
//! assert_eq!(q.push(TrafficClass::BestEffort, "pos", 16, Some(7)), PushOutcome::Queued);
//! assert_eq!(q.push(TrafficClass::BestEffort, "pos'", 16, Some(7)), PushOutcome::Coalesced);
//! assert_eq!(q.push(TrafficClass::Critical, "trade", 64, None), PushOutcome::Queued);
//! assert_eq!(q.pop().unwrap().item, "trade");
//! assert_eq!(q.pop().unwrap().item, "pos'");
//! ```

mod admission;
mod bucket;
mod governor;
mod inbound;
mod outbound;

pub use admission::{
    Admission, AdmissionConfig, AdmissionControl, AdmissionStats, HandshakePermit, Phase,
    PhaseDeadlines, RefuseReason, RetrySlots, MAX_RETRY_SPREAD,
};
pub use bucket::{Rate, RetryAfter, TokenBucket};
pub use governor::{
    default_session_cap, fd_soft_limit, parse_fd_soft_limit, parse_rss_bytes, process_rss_bytes,
    session_cap_for_fd_limit, GovernorConfig, GovernorStats, LevelThresholds, LoopLag,
    OverloadGovernor, OverloadInputs, OverloadLevel, Threshold, DEFAULT_REFUSE_LAG_MS,
    FALLBACK_SESSION_CAP, LOOP_LAG_SAMPLES, UNLIMITED_FDS_ASSUMED,
};
pub use inbound::{InboundLimiter, InboundLimits, InboundStats, InboundVerdict};
pub use outbound::{ClassStats, OutboundConfig, OutboundQueue, OutboundStats, Popped, PushOutcome};

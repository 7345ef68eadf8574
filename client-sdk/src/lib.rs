//! # waygate-client
//!
//! The game-side SDK: connects over an ordered list of transports with fallback, resumes
//! sessions with nothing lost, acks, de-duplicates and reports events (SPEC C1–C4).
//!
//! It depends on `waygate-transport` and the session machine only, never on routing or the
//! edge binary.
//!
//! Nothing is implemented here yet; see the client SDK issue.

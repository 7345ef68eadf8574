//! # waygate (the binary's library)
//!
//! What the `waygate` command runs besides the edge itself: the newcomer's [`demo`] (an edge,
//! demo backends and simulated clients on every transport) and the load generator and
//! benchmark driver [`bench`]. Both drive real clients through the client SDK, which is why
//! they live here and not in the edge library (`waygate-edge`, which never depends on the
//! client SDK). `main.rs` is the CLI over `waygate-edge`, `waygate-backend` and these.

pub mod bench;
pub mod demo;
pub mod logging;

//! # waygate-session
//!
//! Owns each player's session across transport drops (SPEC S1–S8): the explicit reconnect
//! state machine, token authentication, resume tokens, the downstream replay buffer with
//! cumulative acks, upstream de-duplication, linger, single login with fencing tokens, and
//! the snapshot/ownership store traits.
//!
//! It must never know which transport carries a session (it sees `waygate_transport`'s
//! [`Connection`](waygate_transport::Connection) trait only), never route messages (that is
//! `waygate-routing`), and never read the clock, a socket or a global RNG inside its state
//! machines: time comes in as an argument and randomness from a [`rng::SessionRng`].
//!
//! ## How it is split
//!
//! - [`machine::SessionMachine`] — sans-IO, the server side of one session **on one
//!   connection**. It owns a [`machine::SessionCore`] (session id, player, fencing token,
//!   resume-token hash, bindings, [`replay::ReplayBuffer`], upstream
//!   [`seq::RecvWindow`]) once established. The core crosses connections as a
//!   [`store::Snapshot`]: when a link drops the machine DETACHES and persists it; a new
//!   connection's machine takes it over by resume-token hash (atomically, single use) and
//!   the old machine ends superseded, or EXPIRES when the linger time runs out.
//!   I/O it needs (auth, store, ownership) is requested as [`machine::Action`]s and fed
//!   back with `handle_*` calls.
//! - [`client::ClientSession`] — sans-IO client counterpart for the SDK: HELLO, downstream
//!   dedup and acks, an upstream resend buffer.
//! - [`auth`] — the token format, [`auth::mint_token`], [`auth::Authenticator`] and
//!   [`auth::HmacAuthenticator`].
//! - [`store`] — [`store::SnapshotStore`] and [`store::OwnershipRegistry`] (async,
//!   fallible, remote-ready) with in-memory defaults.
//! - [`driver`] — the tokio driver: one task per connection running a machine over a
//!   `Box<dyn Connection>`, the [`driver::SessionRegistry`] and the [`driver::UpstreamSink`].
//! - [`write_through`] — durable before visible: the per-edge group committer that writes
//!   the snapshots of many sessions in one store round trip.
//!
//! - [`sim`] (hidden) — a deterministic single-machine simulation shared by the property
//!   tests and the cargo-fuzz targets in `session/fuzz`.
//!
//! ## How the edge drives it
//!
//! Build one [`driver::SessionLayer`] (config, authenticator, stores, registry, upstream
//! sink), call [`driver::SessionLayer::spawn`] for every connection a transport listener
//! yields, and talk to sessions through [`driver::SessionRegistry`] (`push`,
//! `push_to_player`, `kick`, `bind`, `migrate`, `close`). The router implements
//! [`driver::UpstreamSink`]: it receives every delivered upstream message and the session
//! lifecycle events (established, bound, ended — unbind only when `released`).
//!
//! Resume tokens are single use and rotate on every restore; the token a client presented
//! stays valid until the client's first frame after WELCOME confirms it got the new one, so
//! a WELCOME lost with the link cannot strand it.
//!
//! The byte-level protocol is PROTOCOL.md §7 (repository root).

pub mod auth;
pub mod client;
pub mod counters;
pub mod driver;
pub mod host;
pub mod machine;
pub mod replay;
pub mod resume;
pub mod rng;
pub mod seq;
#[doc(hidden)]
pub mod sim;
pub mod store;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod write_through;

#[cfg(test)]
mod tests;

pub use auth::{mint_token, AuthError, AuthedPlayer, Authenticator, HmacAuthenticator, KeyRing};
pub use client::ClientSession;
pub use counters::SessionCounters;
pub use machine::{
    Action, EndReason, ResumeAttempt, SessionConfig, SessionError, SessionMachine, State,
};
pub use rng::{SeededRng, SessionRng, SystemRng};
pub use store::{
    MemoryOwnership, MemorySnapshotStore, OwnershipRegistry, Snapshot, SnapshotStore, SnapshotWrite,
};

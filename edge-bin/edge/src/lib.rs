//! # waygate-edge
//!
//! The edge as a library: wires listeners from `waygate-transport`, sessions from
//! `waygate-session`, routing from `waygate-routing` and backend links (`waygate-link`) into
//! a running [`edge::Edge`], with admin HTTP, metrics and the cluster adapters (etcd, Redis).
//! The `waygate` binary (`edge-bin/`) is a thin CLI over it, so tests start the real edge
//! in-process or as a process and read back its bound addresses.
//!
//! What it must never do: depend on the client SDK (the demo and bench, which drive clients,
//! live beside the binary), host game logic (the backend SDK is `waygate-backend`), or be
//! depended on by the transport, protocol, session or routing crates.

pub mod admin;
pub mod announcements;
pub mod auth;
pub mod cluster;
pub mod config;
pub mod edge;
pub mod link;
pub mod listeners;
pub mod memory;
pub mod metrics;
pub mod overload;

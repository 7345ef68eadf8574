//! # waygate (the edge)
//!
//! Wires the crates into the edge: listeners from `waygate-transport`, sessions from
//! `waygate-session`, routing from `waygate-routing`, the backend links, admin HTTP and
//! metrics. Also home of the backend library ([`backend`]) that Rust game servers use to
//! accept links from edges, and the demo backend built on it.
//!
//! `main.rs` is a thin shell over this library, so tests start the real edge in-process or
//! as a process and read back its bound addresses.

pub mod admin;
pub mod backend;
pub mod bench;
pub mod cluster;
pub mod config;
pub mod demo;
pub mod edge;
pub mod link;
pub mod listeners;
pub mod metrics;
pub mod overload;

//! The distributed setup (SPEC R9, R10, S5-S7, F4): etcd for routes and registrations
//! (the `waygate-routing-etcd` crate, re-exported as [`etcd`]), Redis for session ownership,
//! warm snapshots and presence, and the login service's HTTP endpoint.

pub use waygate_routing_etcd as etcd;
pub use waygate_routing_etcd::{spawn_load_meter, RateMeter};

pub mod login;
pub mod player_push;
pub mod redis;

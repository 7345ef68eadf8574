//! The distributed setup (SPEC R9, R10, S5-S7, F4): etcd for routes and registrations,
//! Redis for session ownership, warm snapshots and presence.

pub mod etcd;
pub mod redis;

//! Shared backends for running many edges (SPEC S5-S7, F4, R9).

pub mod redis;

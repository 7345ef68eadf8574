//! Deterministic tests of the session machine.

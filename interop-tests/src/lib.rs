//! # waygate-interop-tests
//!
//! Cross-crate and multi-process tests over real loopback sockets: waygate's own clients and
//! independent peers (Python's `websockets`, `aioquic`, the C-ikcp `kcp` package) against
//! waygate's listeners. The library part holds the shared test harness.

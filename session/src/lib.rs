//! # waygate-session
//!
//! Owns each player's session across transport drops: the explicit reconnect state machine
//! (DISCONNECTED -> HANDSHAKING -> AUTHENTICATED/REJECTED -> RESTORING -> ACTIVE), token
//! authentication, resume tokens, the downstream replay buffer with cumulative acks, upstream
//! de-duplication, linger, single login with fencing tokens, and the snapshot/ownership store
//! traits (SPEC S1–S8).
//!
//! It must never know which transport carries a session (it sees `waygate_transport`'s
//! connection trait only), never route messages (that is `waygate-routing`), and never read
//! the clock or sockets inside its state machines: time comes in as an argument.
//!
//! Nothing is implemented here yet; see the session issue.

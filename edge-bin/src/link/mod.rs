//! The backend link (PROTOCOL.md §9) as both ends use it: the shared I/O shell
//! ([`io::spawn_link_io`]) and the edge's client side ([`client`]).

pub mod client;
pub mod io;

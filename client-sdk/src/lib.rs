//! # waygate-client
//!
//! The game-side SDK (SPEC C1–C3): connects over an ordered list of endpoints and falls
//! back when one fails (UDP blocked -> TCP -> WebSocket), resumes its session after every
//! drop with nothing lost (the sans-IO [`ClientSession`] of `waygate-session` does the
//! seqs, acks, dedup and resend buffer), reconnects with exponential backoff and full
//! jitter, honours retry-after and MIGRATE, and reports [`Event`]s.
//!
//! It depends on `waygate-transport` (endpoints, connections) and `waygate-session` (the
//! client machine) only — never on routing or the edge.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use waygate_client::{Client, ClientOptions, Event};
//! use waygate_transport::endpoint::Endpoint;
//! use waygate_transport::TrafficClass;
//!
//! let token = bytes::Bytes::from_static(b"token from the login service");
//! let options = ClientOptions::new(vec![Endpoint::parse("tcp://127.0.0.1:7000")?], token);
//! let mut client = Client::start(options);
//! client.send(TrafficClass::Normal, 1000, bytes::Bytes::from_static(b"hi")).await?;
//! while let Some(event) = client.next_event().await {
//!     if let Event::Message { msg_id, payload, .. } = event {
//!         println!("{msg_id}: {payload:?}");
//!     }
//! }
//! # Ok(()) }
//! ```

pub mod channels;
pub mod clock;
mod driver;
pub mod netsim;
mod requests;

pub use channels::{ChannelTracker, ChannelUpdate};
pub use clock::ClockEstimate;
pub use driver::{Client, ClientOptions, ClientStats, ConnectionState, Event, SdkError};
pub use requests::{RequestAnswer, RequestError};
pub use waygate_protocol::channel::ChannelPosition;
pub use waygate_session::client::{ClientError, ClientSession, RttStats};

//! Test support shared by this crate's tests and the edge's: drive a sans-IO
//! [`ClientSession`] over a real [`Connection`] until a condition on the collected events
//! holds or a bound passes. Not part of the stable API.

use std::time::{Duration, Instant};

use waygate_protocol::frame::WelcomeOutcome;
use waygate_transport::Connection;

use crate::client::{ClientEvent, ClientSession};

/// Sends what `client` has to send, feeds it what `conn` receives and appends its events to
/// `events`, until `want(events)` or `within` passes.
pub async fn drive_client(
    client: &mut ClientSession,
    conn: &mut dyn Connection,
    events: &mut Vec<ClientEvent>,
    within: Duration,
    want: impl Fn(&[ClientEvent]) -> bool,
) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        while let Some(f) = client.poll_transmit() {
            let _ = conn.send(&f).await;
        }
        while let Some(e) = client.poll_event() {
            events.push(e);
        }
        if want(events) || tokio::time::Instant::now() >= deadline {
            return;
        }
        tokio::select! {
            r = conn.recv() => match r {
                Ok(f) => { let _ = client.handle_frame(Instant::now(), f); }
                Err(e) => client.handle_link_down(Instant::now(), e.close_code()),
            },
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
}

/// The WELCOME outcomes among `events`, in order.
pub fn welcomes(events: &[ClientEvent]) -> Vec<WelcomeOutcome> {
    events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::Welcomed { outcome, .. } => Some(*outcome),
            _ => None,
        })
        .collect()
}

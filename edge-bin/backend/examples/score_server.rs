//! A minimal game server built on the backend SDK alone (no edge, no client SDK in its
//! dependency tree): each player keeps a score; message 500 (`ADD`, payload: a decimal
//! number) adds to it and answers 501 (`SCORE`, payload: the new total as decimal text).
//! Anything else is refused with `unavailable`, which the edge sends to the client as ERROR.
//!
//!     cargo run -p waygate-backend --example score_server -- 127.0.0.1:7601 b1
//!
//! Point an edge's route table at it (service with `msg_ids = [500]`, instance `b1` at that
//! address) and send ADD from any client.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use waygate_backend::{Backend, BackendConfig, BackendSession, Incoming, Refusal, Service};
use waygate_protocol::CloseCode;

const ADD: u32 = 500;
const SCORE: u32 = 501;

#[derive(Default)]
struct Scores {
    by_player: Mutex<HashMap<String, i64>>,
}

#[async_trait]
impl Service for Scores {
    async fn message(&self, session: &BackendSession, msg: Incoming) -> Result<(), Refusal> {
        let refuse = Refusal {
            code: CloseCode::Unavailable,
            retry_after_ms: 0,
        };
        if msg.msg_id != ADD {
            return Err(refuse);
        }
        let delta: i64 = std::str::from_utf8(&msg.payload)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or(refuse)?;
        let total = {
            let mut map = self.by_player.lock().map_err(|_| refuse)?;
            let score = map.entry(session.player_id().to_string()).or_insert(0);
            *score = score.saturating_add(delta);
            *score
        };
        session
            .push(SCORE, msg.class, Bytes::from(total.to_string()))
            .await
            .map_err(|_| refuse)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr: SocketAddr = args.next().as_deref().unwrap_or("127.0.0.1:7601").parse()?;
    let id = args.next().unwrap_or_else(|| "b1".to_string());
    let backend = Backend::bind(addr, BackendConfig::new(id), Arc::new(Scores::default())).await?;
    println!("score server listening on {}", backend.local_addr());
    tokio::signal::ctrl_c().await?;
    Ok(())
}

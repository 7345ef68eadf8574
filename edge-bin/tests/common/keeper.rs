//! A backend `Service` that keeps each player's latest session, so a test can act through
//! it (join, publish, pin), and records how each player's sessions ended or detached.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use waygate_backend::{BackendSession, Incoming, Refusal, Service};
use waygate_transport::CloseCode;

/// See the module docs.
#[derive(Default)]
pub struct SessionKeeper(
    Mutex<HashMap<String, BackendSession>>,
    Mutex<Vec<(String, &'static str, CloseCode)>>,
);

#[async_trait]
impl Service for SessionKeeper {
    async fn session_open(&self, session: &BackendSession) {
        self.0
            .lock()
            .unwrap()
            .insert(session.player_id().to_owned(), session.clone());
    }

    async fn message(&self, _session: &BackendSession, _msg: Incoming) -> Result<(), Refusal> {
        Ok(())
    }

    async fn session_detached(&self, session: &BackendSession, _linger: Duration) {
        let player = session.player_id().to_owned();
        self.1
            .lock()
            .unwrap()
            .push((player, "detached", CloseCode::Normal));
    }

    async fn session_closed(&self, session: &BackendSession, code: CloseCode) {
        let player = session.player_id().to_owned();
        self.1.lock().unwrap().push((player, "closed", code));
    }
}

impl SessionKeeper {
    /// `player`'s latest session, if it reached the backend.
    pub fn get(&self, player: &str) -> Option<BackendSession> {
        self.0.lock().unwrap().get(player).cloned()
    }

    /// `player`'s session, once it reached the backend (at most 10 s).
    pub async fn session(&self, player: &str) -> BackendSession {
        for _ in 0..500 {
            if let Some(s) = self.get(player) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{player}'s session never reached the backend");
    }

    /// How `player`'s session ended or detached, when it did.
    pub fn end_of(&self, player: &str) -> Option<(&'static str, CloseCode)> {
        self.1
            .lock()
            .unwrap()
            .iter()
            .find(|(p, ..)| p == player)
            .map(|(_, what, code)| (*what, *code))
    }
}

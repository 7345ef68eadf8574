//! The edge's table of per-session entries: the backend-side handle and metadata of each
//! session, the keys backends bound with BIND, and the backend links it was opened on.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use waygate_protocol::frame::SessionId;

use super::Shared;
use crate::link::SessionMeta;

/// Per-session state the edge keeps beside the session layer. Cloned for every upstream
/// message (the lock is not held while routing), so its parts are shared: a clone is three
/// reference counts, and writers copy on write (`Arc::make_mut`).
#[derive(Debug, Clone)]
pub(super) struct SessionEntry {
    pub(super) meta: Arc<SessionMeta>,
    /// service -> business key, set by backends with BIND.
    pub(super) keys: Arc<HashMap<String, String>>,
    /// Backend addresses this session was opened on.
    pub(super) links: Arc<HashSet<SocketAddr>>,
}

#[derive(Debug, Default)]
pub(super) struct Sessions {
    pub(super) by_id: HashMap<SessionId, SessionEntry>,
    pub(super) by_handle: HashMap<u64, SessionId>,
    pub(super) next_handle: u64,
}

impl Shared {
    pub(super) fn entry(&self, session_id: &SessionId, player: &str) -> SessionEntry {
        let mut e = match self.entries.lock() {
            Ok(e) => e,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(entry) = e.by_id.get(session_id) {
            return entry.clone();
        }
        e.next_handle += 1;
        let handle = e.next_handle;
        let entry = SessionEntry {
            meta: Arc::new(SessionMeta {
                handle,
                session_id: *session_id,
                player_id: player.to_string(),
                fencing: 0,
                attrs: vec![("edge".into(), self.config.edge_id.clone())],
            }),
            keys: Arc::new(HashMap::new()),
            links: Arc::new(HashSet::new()),
        };
        e.by_handle.insert(handle, *session_id);
        e.by_id.insert(*session_id, entry.clone());
        entry
    }

    pub(super) fn session_of_handle(&self, handle: u64) -> Option<SessionId> {
        self.entries.lock().ok()?.by_handle.get(&handle).copied()
    }

    /// Live sessions with their ownership: (player, session, fencing).
    pub(super) fn owned_sessions(&self) -> Vec<(String, SessionId, u64)> {
        self.entries
            .lock()
            .map(|e| {
                e.by_id
                    .values()
                    .filter(|en| en.meta.fencing > 0)
                    .map(|en| {
                        (
                            en.meta.player_id.clone(),
                            en.meta.session_id,
                            en.meta.fencing,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

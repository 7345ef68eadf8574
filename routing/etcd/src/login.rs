//! The login side of the edge registry (SPEC R10): which edge a new client should connect
//! to, read from the edge records under `P/edges/` that [`EtcdRegistry::register_edge`]
//! keeps up to date (the edge library serves it over HTTP: `waygate login`).
//!
//! [`EtcdRegistry::register_edge`]: crate::EtcdRegistry::register_edge

use etcd_client::{Client, GetOptions};
use waygate_routing::InstanceState;

use crate::{EdgeInfo, EtcdError, Keys};

/// The least-loaded edge that takes new players: active, under its cap, fewest sessions
/// (ties by id). `None`: no edge qualifies.
#[must_use]
pub fn pick_least_loaded(edges: &[EdgeInfo]) -> Option<&EdgeInfo> {
    edges
        .iter()
        .filter(|e| e.state == InstanceState::Active && e.capacity.is_none_or(|c| e.sessions < c))
        .min_by(|a, b| a.sessions.cmp(&b.sessions).then_with(|| a.id.cmp(&b.id)))
}

/// Every edge registered under `prefix`.
pub async fn list_edges(client: &Client, prefix: &str) -> Result<Vec<EdgeInfo>, EtcdError> {
    let keys = Keys::new(prefix);
    let mut c = client.clone();
    let resp = c
        .get(keys.edges.as_str(), Some(GetOptions::new().with_prefix()))
        .await?;
    let mut edges = Vec::new();
    for kv in resp.kvs() {
        let Some(id) = kv.key().strip_prefix(keys.edges.as_bytes()) else {
            continue;
        };
        match serde_json::from_slice::<EdgeInfo>(kv.value()) {
            Ok(mut e) => {
                e.id = String::from_utf8_lossy(id).into_owned();
                edges.push(e);
            }
            Err(e) => {
                tracing::warn!(key = %String::from_utf8_lossy(kv.key()), error = %e, "ignoring unreadable edge record")
            }
        }
    }
    Ok(edges)
}

/// The edge a login service should send a new client to (see [`pick_least_loaded`]).
/// `Ok(None)`: no edge is registered, enabled and under its cap.
pub async fn least_loaded_edge(
    client: &Client,
    prefix: &str,
) -> Result<Option<EdgeInfo>, EtcdError> {
    let edges = list_edges(client, prefix).await?;
    Ok(pick_least_loaded(&edges).cloned())
}

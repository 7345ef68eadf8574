//! The login side of the edge registry (SPEC R10): which edge a new client should connect
//! to, read from the edge records under `P/edges/` that [`EtcdRegistry::register_edge`]
//! keeps up to date, and a tiny HTTP endpoint answering it.
//!
//! [`EtcdRegistry::register_edge`]: super::EtcdRegistry::register_edge

use std::sync::Arc;

use etcd_client::{Client, GetOptions};
use waygate_routing::InstanceState;

use super::{EdgeInfo, Etcd, EtcdError, Keys};

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

/// A tiny HTTP endpoint for a login service (SPEC R10): `GET /edge` answers the
/// least-loaded edge as [`EdgeInfo`] JSON, `503` with `Retry-After: 1` when no edge qualifies
/// or etcd is unreachable. Serve it with `axum::serve`.
pub fn login_router(client: Client, prefix: String) -> axum::Router {
    use axum::extract::State;
    use axum::http::{header, StatusCode};
    use axum::response::{IntoResponse, Response};

    async fn pick(State(s): State<Arc<(Etcd, String)>>) -> Response {
        let unavailable = |msg: String| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "1")],
                axum::Json(serde_json::json!({ "error": msg })),
            )
                .into_response()
        };
        match least_loaded_edge(&s.0 .0, &s.1).await {
            Ok(Some(e)) => axum::Json(e).into_response(),
            Ok(None) => unavailable("no edge is enabled and under its cap".into()),
            Err(e) => unavailable(e.to_string()),
        }
    }
    axum::Router::new()
        .route("/edge", axum::routing::get(pick))
        .with_state(Arc::new((Etcd(client), prefix)))
}

//! The login service's HTTP endpoint (SPEC R10, `waygate login`): which edge a new client
//! should connect to, from the edge registrations in etcd.

use std::sync::Arc;

use etcd_client::Client;

use super::etcd::least_loaded_edge;

/// A tiny HTTP endpoint for a login service (SPEC R10): `GET /edge` answers the
/// least-loaded edge as [`EdgeInfo`](super::etcd::EdgeInfo) JSON, `503` with `Retry-After: 1` when no edge qualifies
/// or etcd is unreachable. Serve it with `axum::serve`.
pub fn login_router(client: Client, prefix: String) -> axum::Router {
    use axum::extract::State;
    use axum::http::{header, StatusCode};
    use axum::response::{IntoResponse, Response};

    async fn pick(State(s): State<Arc<(Client, String)>>) -> Response {
        let unavailable = |msg: String| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "1")],
                axum::Json(serde_json::json!({ "error": msg })),
            )
                .into_response()
        };
        match least_loaded_edge(&s.0, &s.1).await {
            Ok(Some(e)) => axum::Json(e).into_response(),
            Ok(None) => unavailable("no edge is enabled and under its cap".into()),
            Err(e) => unavailable(e.to_string()),
        }
    }
    axum::Router::new()
        .route("/edge", axum::routing::get(pick))
        .with_state(Arc::new((client, prefix)))
}

//! Admin HTTP (O3) on its own port: `/healthz`, `/readyz`, `/metrics` (OpenMetrics to a
//! scraper that asks for it, as Prometheus does; the Prometheus text format 0.0.4 otherwise),
//! `/routes`, `/sessions/{player}`, `POST /drain`, `POST /kick/{player}`, and
//! `POST /drop/{player}` (drops the connection while the session lingers: a chaos drill).
//! The handlers talk to the edge only through [`AdminApi`], so the router is tested without
//! sockets.

use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

/// What the admin server needs from the edge.
#[async_trait]
pub trait AdminApi: Send + Sync + 'static {
    /// Liveness details (always answered while the process runs).
    fn health(&self) -> Value;
    /// `Ok` when the edge accepts new sessions, `Err(reason)` otherwise.
    fn ready(&self) -> Result<(), String>;
    /// Prometheus text exposition.
    fn metrics_text(&self) -> String;
    /// The current route table, epoch and staleness.
    fn routes(&self) -> Value;
    /// The session of `player` on this edge.
    async fn session(&self, player: &str) -> Option<Value>;
    /// Starts a drain (soft migration of every session); returns its status.
    async fn drain(&self) -> Value;
    /// Kicks `player`'s session; whether one was found.
    async fn kick(&self, player: &str) -> bool;
    /// Drops `player`'s connection without ending the session (it lingers; the client
    /// resumes). A chaos/test drill; whether a session was found.
    async fn drop_link(&self, player: &str) -> bool;
}

type Api = Arc<dyn AdminApi>;

/// The admin routes over `api`.
pub fn router(api: Api) -> Router {
    Router::new()
        .route("/healthz", get(health))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .route("/routes", get(routes))
        .route("/sessions/{player}", get(session))
        .route("/drain", post(drain))
        .route("/kick/{player}", post(kick))
        .route("/drop/{player}", post(drop_link))
        .with_state(api)
}

async fn health(State(api): State<Api>) -> Json<Value> {
    Json(api.health())
}

async fn ready(State(api): State<Api>) -> Response {
    match api.ready() {
        Ok(()) => (StatusCode::OK, Json(json!({"ready": true}))).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"ready": false, "reason": reason})),
        )
            .into_response(),
    }
}

async fn metrics(State(api): State<Api>, headers: HeaderMap) -> Response {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let text = api.metrics_text();
    if openmetrics {
        let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
        ([(header::CONTENT_TYPE, kind)], text).into_response()
    } else {
        let kind = "text/plain; version=0.0.4; charset=utf-8";
        let body = crate::metrics::openmetrics_to_prometheus_text(&text);
        ([(header::CONTENT_TYPE, kind)], body).into_response()
    }
}

async fn routes(State(api): State<Api>) -> Json<Value> {
    Json(api.routes())
}

async fn session(State(api): State<Api>, Path(player): Path<String>) -> Response {
    match api.session(&player).await {
        Some(v) => Json(v).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no session for this player on this edge"})),
        )
            .into_response(),
    }
}

async fn drain(State(api): State<Api>) -> Json<Value> {
    Json(api.drain().await)
}

async fn kick(State(api): State<Api>, Path(player): Path<String>) -> Response {
    if api.kick(&player).await {
        Json(json!({"kicked": player})).into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no session for this player on this edge"})),
        )
            .into_response()
    }
}

async fn drop_link(State(api): State<Api>, Path(player): Path<String>) -> Response {
    if api.drop_link(&player).await {
        Json(json!({"dropped": player})).into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no session for this player on this edge"})),
        )
            .into_response()
    }
}

/// Serves the admin routes on `addr`; returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    api: Api,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = router(api);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "admin server stopped");
        }
    });
    Ok((local, task))
}

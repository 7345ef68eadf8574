//! Admin HTTP (O3) on its own port: `/healthz`, `/readyz`, `/metrics` (OpenMetrics to a
//! scraper that asks for it, as Prometheus does; the Prometheus text format 0.0.4 otherwise),
//! `/routes`, `/sessions/{player}`, `POST /drain`, `POST /kick/{player}`, and
//! `POST /drop/{player}` (drops the connection while the session lingers: a chaos drill).
//! The handlers talk to the edge only through [`AdminApi`], so the router is tested without
//! sockets.
//!
//! Access ([`AdminAccess`], O3): every request must name an allowed `Host` (loopback names,
//! the bound address, `admin.allowed_hosts`), so a DNS-rebinding page cannot reach it. With
//! an admin token (`admin.token_file` or `WAYGATE_ADMIN_TOKEN`), the mutating endpoints need
//! `Authorization: Bearer <token>` (and reads too with `admin.protect_reads`). Without one
//! the admin server may only listen on loopback, and mutations need the header
//! `X-Waygate-Admin` (any value): a cross-site form or image cannot set it. Refusals: 403
//! for a foreign Host or a missing header, 401 for a missing or wrong token.

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
    /// Bans `player` on this edge (for `for_secs`, or until lifted): its tokens and its
    /// resumes are refused `auth_rejected`, and its session here ends (whether one did).
    async fn ban(&self, player: &str, for_secs: Option<u64>) -> bool;
    /// Lifts a ban; whether there was one.
    fn unban(&self, player: &str) -> bool;
}

type Api = Arc<dyn AdminApi>;

/// Who may use the admin server (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct AdminAccess {
    /// The bearer token; `None`: loopback only, mutations need `X-Waygate-Admin`.
    pub token: Option<String>,
    /// Whether reads need the token too.
    pub protect_reads: bool,
    /// Host names or addresses (without port) accepted besides the loopback ones.
    pub allowed_hosts: Vec<String>,
}

impl AdminAccess {
    fn host_allowed(&self, host: &str) -> bool {
        let name = match host.rsplit_once(':') {
            // `[::1]:9100`, `127.0.0.1:9100`, `name:9100`; a bare IPv6 literal has no brackets.
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !h.ends_with(':') => h,
            _ => host,
        };
        let name = name.trim_start_matches('[').trim_end_matches(']');
        matches!(name, "localhost" | "127.0.0.1" | "::1")
            || self
                .allowed_hosts
                .iter()
                .any(|h| h.eq_ignore_ascii_case(name))
    }

    fn token_ok(&self, headers: &HeaderMap) -> bool {
        let Some(token) = &self.token else {
            return false;
        };
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        // Constant time in the token's content.
        let (a, b) = (presented.as_bytes(), token.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    /// The refusal for a request, if any.
    fn check(
        &self,
        method: &axum::http::Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Option<(StatusCode, &'static str)> {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !self.host_allowed(host) {
            return Some((
                StatusCode::FORBIDDEN,
                "host not allowed (admin.allowed_hosts)",
            ));
        }
        let mutating = method != axum::http::Method::GET && method != axum::http::Method::HEAD;
        // Health probes (an orchestrator's, which carry no token) stay open.
        let probe = matches!(path, "/healthz" | "/readyz");
        let protected = mutating || (self.protect_reads && !probe);
        match &self.token {
            Some(_) if protected && !self.token_ok(headers) => Some((
                StatusCode::UNAUTHORIZED,
                "admin token required (Authorization: Bearer)",
            )),
            None if mutating && !headers.contains_key("x-waygate-admin") => Some((
                StatusCode::FORBIDDEN,
                "mutating admin requests need the X-Waygate-Admin header",
            )),
            _ => None,
        }
    }
}

async fn guard(
    State(access): State<Arc<AdminAccess>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match access.check(request.method(), request.uri().path(), request.headers()) {
        Some((status, why)) => {
            tracing::info!(path = %request.uri().path(), %status, why, "admin request refused");
            (status, Json(json!({"error": why}))).into_response()
        }
        None => next.run(request).await,
    }
}

/// The admin routes over `api`, behind `access`.
pub fn router(api: Api, access: AdminAccess) -> Router {
    routes(api).layer(axum::middleware::from_fn_with_state(
        Arc::new(access),
        guard,
    ))
}

fn routes(api: Api) -> Router {
    Router::new()
        .route("/healthz", get(health))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .route("/routes", get(route_table))
        .route("/sessions/{player}", get(session))
        .route("/drain", post(drain))
        .route("/kick/{player}", post(kick))
        .route("/drop/{player}", post(drop_link))
        .route("/ban/{player}", post(ban).delete(unban))
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

async fn route_table(State(api): State<Api>) -> Json<Value> {
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

/// `POST /ban/{player}?for_secs=N` query.
#[derive(Debug, serde::Deserialize)]
struct BanQuery {
    for_secs: Option<u64>,
}

async fn ban(
    State(api): State<Api>,
    Path(player): Path<String>,
    axum::extract::Query(q): axum::extract::Query<BanQuery>,
) -> Json<Value> {
    let kicked = api.ban(&player, q.for_secs).await;
    Json(json!({"banned": player, "for_secs": q.for_secs, "kicked": kicked}))
}

async fn unban(State(api): State<Api>, Path(player): Path<String>) -> Response {
    if api.unban(&player) {
        Json(json!({"lifted": player})).into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no ban for this player on this edge"})),
        )
            .into_response()
    }
}

/// Serves the admin routes on `addr`; returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    api: Api,
    mut access: AdminAccess,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    if !local.ip().is_unspecified() {
        access.allowed_hosts.push(local.ip().to_string());
    }
    let app = router(api, access);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "admin server stopped");
        }
    });
    Ok((local, task))
}

//! Admin HTTP: routes tested without sockets (tower `oneshot`) against a real in-process
//! edge, and once over HTTP; `/metrics` parsed by a Prometheus text parser.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use waygate_edge::config::EdgeConfig;
use waygate_edge::edge::Edge;

async fn edge() -> Edge {
    let mut config = EdgeConfig::default();
    config.use_ephemeral_ports();
    Edge::start(config).await.unwrap()
}

async fn call(app: axum::Router, method: &str, uri: &str) -> (StatusCode, String) {
    let resp = app
        .oneshot(
            Request::builder()
                .method(method)
                .uri(uri)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

fn parse_metrics(text: &str) -> prometheus_parse::Scrape {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text")
}

#[tokio::test]
async fn admin_routes_without_sockets() {
    let edge = edge().await;
    let app = waygate_edge::admin::router(edge.admin());

    let (status, body) = call(app.clone(), "GET", "/healthz").await;
    assert_eq!(status, StatusCode::OK);
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["route_epoch"], 1);
    assert!(health["listeners"]["kcp"].is_string());

    let (status, _) = call(app.clone(), "GET", "/readyz").await;
    assert_eq!(status, StatusCode::OK);

    let (status, body) = call(app.clone(), "GET", "/routes").await;
    assert_eq!(status, StatusCode::OK);
    let routes: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(routes["epoch"], 1);
    assert_eq!(routes["source"], "embedded");
    assert_eq!(routes["table"]["services"][0]["name"], "player");

    let (status, _) = call(app.clone(), "GET", "/sessions/nobody").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = call(app.clone(), "POST", "/kick/nobody").await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, body) = call(app.clone(), "GET", "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    let scrape = parse_metrics(&body);
    let names: Vec<&str> = scrape.samples.iter().map(|s| s.metric.as_str()).collect();
    assert!(names.contains(&"waygate_route_epoch"), "{names:?}");
    assert!(names.contains(&"waygate_sessions_live"), "{names:?}");

    // Drain: readiness flips, the edge reports it.
    let (status, body) = call(app.clone(), "POST", "/drain").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("\"draining\":true"));
    let (status, body) = call(app.clone(), "GET", "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("draining"));
    let (_, body) = call(app, "GET", "/metrics").await;
    let scrape = parse_metrics(&body);
    let draining = scrape
        .samples
        .iter()
        .find(|s| s.metric == "waygate_draining")
        .expect("draining gauge");
    assert!(matches!(draining.value, prometheus_parse::Value::Gauge(v) if v == 1.0));
}

#[tokio::test]
async fn admin_over_http() {
    let edge = edge().await;
    let addr = edge.admin_addr.expect("admin enabled");
    // A minimal HTTP/1.1 GET over a raw socket (no HTTP client dependency needed).
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut resp = String::new();
    sock.read_to_string(&mut resp).await.unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let body = resp.split("\r\n\r\n").nth(1).unwrap();
    let scrape = parse_metrics(body);
    assert!(scrape
        .samples
        .iter()
        .any(|s| s.metric == "waygate_route_epoch"));
}

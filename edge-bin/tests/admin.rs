//! Admin HTTP: routes tested without sockets (tower `oneshot`) against a real in-process
//! edge, and once over HTTP; `/metrics` parsed by a Prometheus text parser.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use waygate_edge::admin::AdminAccess;
use waygate_edge::config::EdgeConfig;
use waygate_edge::edge::Edge;

async fn edge() -> Edge {
    let mut config = EdgeConfig::default();
    config.use_ephemeral_ports();
    Edge::start(config).await.unwrap()
}

async fn call(app: axum::Router, method: &str, uri: &str) -> (StatusCode, String) {
    call_with(
        app,
        method,
        uri,
        &[("host", "127.0.0.1:9100"), ("x-waygate-admin", "1")],
    )
    .await
}

async fn call_with(
    app: axum::Router,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, String) {
    let mut request = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let resp = app
        .oneshot(request.body(Body::empty()).unwrap())
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
    let app = waygate_edge::admin::router(edge.admin(), AdminAccess::default());

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
    sock.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
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

/// Admin access (O3): a foreign Host is refused (DNS rebinding), a mutation without the
/// admin header is refused (a cross-site form cannot set it), and with a token every
/// mutation needs it — and reads too when asked.
#[tokio::test]
async fn admin_mutations_need_the_header_or_the_token_and_a_known_host() {
    let edge = edge().await;
    let open = waygate_edge::admin::router(edge.admin(), AdminAccess::default());
    let local = ("host", "127.0.0.1:9100");
    let (status, _) = call_with(
        open.clone(),
        "GET",
        "/healthz",
        &[("host", "evil.example:9100")],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "foreign Host");
    let (status, _) = call_with(open.clone(), "GET", "/healthz", &[]).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "no Host");
    let (status, _) = call_with(open.clone(), "GET", "/healthz", &[("host", "[::1]:9100")]).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = call_with(open.clone(), "POST", "/kick/nobody", &[local]).await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "a form POST without the header"
    );
    let (status, _) = call_with(open.clone(), "POST", "/drain", &[local]).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(!edge.is_draining(), "nothing happened");

    let token = "s3cret-admin-token-0123456789";
    let guarded = waygate_edge::admin::router(
        edge.admin(),
        AdminAccess {
            token: Some(token.into()),
            protect_reads: true,
            allowed_hosts: vec!["edge-1.internal".into()],
        },
    );
    let bearer = format!("Bearer {token}");
    let (status, _) = call_with(
        guarded.clone(),
        "POST",
        "/kick/nobody",
        &[local, ("x-waygate-admin", "1")],
    )
    .await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "the header is not enough with a token"
    );
    let (status, _) = call_with(
        guarded.clone(),
        "POST",
        "/kick/nobody",
        &[local, ("authorization", "Bearer wrong-token-0000000000000")],
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = call_with(
        guarded.clone(),
        "GET",
        "/metrics",
        &[("host", "edge-1.internal")],
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "reads protected");
    for probe in ["/healthz", "/readyz"] {
        let (status, _) = call_with(guarded.clone(), "GET", probe, &[local]).await;
        assert_ne!(
            status,
            StatusCode::UNAUTHORIZED,
            "{probe}: an orchestrator's probe carries no token"
        );
    }
    let (status, _) = call_with(
        guarded.clone(),
        "GET",
        "/metrics",
        &[("host", "edge-1.internal"), ("authorization", &bearer)],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = call_with(
        guarded,
        "POST",
        "/kick/nobody",
        &[local, ("authorization", &bearer)],
    )
    .await;
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "authorized: the kick ran (no such player)"
    );
}

/// An admin server beyond loopback without a token refuses to start.
#[tokio::test]
async fn an_admin_server_beyond_loopback_needs_a_token() {
    let mut config = EdgeConfig::default();
    config.use_ephemeral_ports();
    config.admin.addr = "0.0.0.0:0".parse().unwrap();
    let err = Edge::start(config).await.unwrap_err().to_string();
    assert!(err.contains("admin.addr"), "{err}");
    assert!(err.contains("WAYGATE_ADMIN_TOKEN"), "{err}");
}

/// A ban (hardening item 7): `POST /ban/{player}` ends the player's session here, and its
/// new logins and resumes are refused `auth_rejected` until `DELETE /ban/{player}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_banned_player_is_ended_and_refused_until_the_ban_is_lifted() {
    use waygate_protocol::frame::{Frame, Hello, ResumeRequest};
    use waygate_transport::{CloseCode, TransportKind};
    let (edge, _backend, _dir) = common::demo_edge(|_| {}).await;
    let tcp = edge.addrs[&TransportKind::Tcp];
    let welcome = match common::raw_hello(tcp, common::token("cheater")).await {
        Frame::Welcome(w) => w,
        other => panic!("{other:?}"),
    };
    let app = waygate_edge::admin::router(edge.admin(), AdminAccess::default());
    let (status, body) = call(app.clone(), "POST", "/ban/cheater").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("\"kicked\":true"), "{body}");
    // A new login: refused.
    match common::raw_hello(tcp, common::token("cheater")).await {
        Frame::Reject(r) => assert_eq!(r.code, CloseCode::AuthRejected, "{r:?}"),
        other => panic!("login of a banned player: {other:?}"),
    }
    // Its resume (no token): refused too.
    let resume = Hello {
        version: waygate_protocol::wire::PROTOCOL_VERSION,
        token: bytes::Bytes::new(),
        resume: Some(ResumeRequest::proving(
            welcome.session_id,
            &welcome.resume_token,
            0,
            1,
        )),
    };
    match common::raw_frame(tcp, Frame::Hello(resume)).await {
        Frame::Reject(r) => assert!(
            matches!(r.code, CloseCode::AuthRejected | CloseCode::ResumeRejected),
            "{r:?}"
        ),
        other => panic!("resume of a banned player: {other:?}"),
    }
    // Lifted: the player logs in again.
    let (status, _) = call(app.clone(), "DELETE", "/ban/cheater").await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = call(app.clone(), "DELETE", "/ban/cheater").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "nothing left to lift");
    assert!(matches!(
        common::raw_hello(tcp, common::token("cheater")).await,
        Frame::Welcome(_)
    ));
}

/// A connection whose handshake was under way when a drain started is migrated once its
/// session is established. Before, the drain listed only the sessions established then, and
/// such a session was left to be cut at the drain's end (helper audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_established_after_a_drain_started_is_migrated_too() {
    use bytes::BytesMut;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use waygate_protocol::codec::StreamCodec;
    use waygate_transport::{Frame, TransportKind};
    let edge = edge().await;
    let app = waygate_edge::admin::router(edge.admin(), AdminAccess::default());
    let mut sock = tokio::net::TcpStream::connect(edge.addrs[&TransportKind::Tcp])
        .await
        .unwrap();
    // Accepted before the drain: the edge counts the connection open.
    let mut accepted = false;
    for _ in 0..200 {
        let (_, body) = call(app.clone(), "GET", "/metrics").await;
        accepted = parse_metrics(&body).samples.iter().any(|s| {
            s.metric == "waygate_connections_open"
                && matches!(s.value, prometheus_parse::Value::Gauge(v) if v >= 1.0)
        });
        if accepted {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(accepted, "the connection was accepted");
    let (status, _) = call(app.clone(), "POST", "/drain").await;
    assert_eq!(status, StatusCode::OK);
    let codec = StreamCodec::new(65536);
    let mut out = BytesMut::new();
    let hello = Frame::Hello(waygate_protocol::frame::Hello {
        version: waygate_protocol::wire::PROTOCOL_VERSION,
        token: common::token("late-handshake"),
        resume: None,
    });
    codec.encode(&hello, &mut out).unwrap();
    sock.write_all(&out).await.unwrap();
    let mut buf = BytesMut::new();
    let mut seen = Vec::new();
    let migrated = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            while let Some(f) = codec.decode(&mut buf).unwrap() {
                seen.push(format!("{:?}", f.frame_type()));
                if matches!(f, Frame::Migrate(_)) {
                    return true;
                }
            }
            if sock.read_buf(&mut buf).await.unwrap() == 0 {
                return false;
            }
        }
    })
    .await;
    assert_eq!(migrated, Ok(true), "frames seen: {seen:?}");
    assert_eq!(seen.first().map(String::as_str), Some("Welcome"));
}

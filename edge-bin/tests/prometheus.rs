//! The edge's `/metrics` against real Prometheus tools (newcomer issue, item 3): the
//! exposition of a busy edge passes `promtool check metrics`, and a real Prometheus server
//! started here on loopback scrapes the edge and answers PromQL queries for waygate series.
//! Needs Debian's `prometheus` package (`scripts/test.sh` installs it).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::cluster::{cluster, Cluster};
use tokio::io::AsyncWriteExt;
use waygate_transport::TransportKind;

/// Sessions on every transport, echoes, one dropped link and its resume: every family of
/// the exposition has samples.
async fn busy(c: &Cluster) -> Vec<waygate_client::Client> {
    let mut clients = Vec::new();
    for kind in TransportKind::ALL {
        let mut client = c.client(&[kind], &format!("prom-{kind}"));
        for n in 0..3 {
            common::echo(&mut client, &format!("{kind}-{n}"))
                .await
                .unwrap();
        }
        clients.push(client);
    }
    let registry = c.edge.registry();
    let sid = registry.session_of("prom-tcp").unwrap();
    assert!(registry.drop_link(&sid));
    common::echo(&mut clients[0], "after-drop").await.unwrap();
    clients
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_edge_passes_promtool_check_metrics() {
    let c = cluster().await;
    let _clients = busy(&c).await;
    let admin = c.edge.admin_addr.unwrap();
    let (status, body) = common::http(admin, "GET", "/metrics").await;
    assert_eq!(status, 200);
    assert!(body.contains("waygate_session_transition_total{"), "{body}");
    // Listener statistics (O1): TLS handshakes and the KCP endpoint's cookie exchange.
    assert!(
        body.contains("waygate_listener_handshake_failed_total{transport=\"tls\"} "),
        "{body}"
    );
    let cookies = body
        .lines()
        .find_map(|l| l.strip_prefix("waygate_kcp_cookies_sent_total "))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(cookies >= Some(1), "the KCP client got a cookie: {body}");
    let mut promtool = tokio::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("promtool (Debian package prometheus; scripts/test.sh installs it)");
    let mut stdin = promtool.stdin.take().unwrap();
    stdin.write_all(body.as_bytes()).await.unwrap();
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(30), promtool.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}\n--- exposition ---\n{body}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A PromQL instant query; the JSON answer.
async fn query(prom: std::net::SocketAddr, promql: &str) -> serde_json::Value {
    let encoded: String = promql
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    // Prometheus answers 503 until it is ready (TSDB opened, CI rehearsal under load):
    // asked again for at most 30 s.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let (status, body) = loop {
        let (status, body) =
            common::http(prom, "GET", &format!("/api/v1/query?query={encoded}")).await;
        if status != 503 || tokio::time::Instant::now() >= deadline {
            break (status, body);
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The first sample's value of a query answer, if any.
fn first_value(answer: &serde_json::Value) -> Option<f64> {
    answer["data"]["result"][0]["value"][1]
        .as_str()?
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_edge_and_answers_promql() {
    let c = cluster().await;
    let _clients = busy(&c).await;
    let admin = c.edge.admin_addr.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: waygate\n    static_configs:\n      - targets: ['{admin}']\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let _prometheus = tokio::process::Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={listen}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("prometheus (Debian package prometheus; scripts/test.sh installs it)");
    let prom: std::net::SocketAddr = listen.parse().unwrap();
    // Until Prometheus is up and has scraped the edge at least once (bounded).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut live = None;
    while tokio::time::Instant::now() < deadline {
        if tokio::net::TcpStream::connect(prom).await.is_ok() {
            let answer = query(prom, "waygate_sessions_live").await;
            if let Some(v) = first_value(&answer) {
                live = Some(v);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let live = live.expect("Prometheus answered waygate_sessions_live");
    assert_eq!(live, 6.0, "one session per transport");
    let up = query(prom, "up{job=\"waygate\"}").await;
    assert_eq!(first_value(&up), Some(1.0), "{up}");
    let sessions = query(prom, "sum(waygate_session_new_sessions_total)").await;
    assert_eq!(first_value(&sessions), Some(6.0), "{sessions}");
    let restored = query(prom, "sum(waygate_session_restored_total)").await;
    assert_eq!(first_value(&restored), Some(1.0), "{restored}");
    // Route-plane gauges (O1): every session is open on a backend instance; no move queued.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let per_backend = query(prom, "sum(waygate_backend_sessions)").await;
        if first_value(&per_backend) == Some(6.0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{per_backend}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let pending = query(prom, "sum(waygate_migrations_pending)").await;
    assert_eq!(first_value(&pending), Some(0.0), "{pending}");
}

//! Interop with an independent client: `python/waygate_peer.py`, written from PROTOCOL.md and
//! built on Python's own socket/ssl, `websockets`,
//! `aioquic` and the C reference ikcp (`kcp` on PyPI), runs against each waygate
//! listener serving an echo server in this process. It checks every frame type and class
//! round trip byte for byte (up to the max frame size), the CLOSE handshake, and that
//! malformed input draws CLOSE with the right code. See the lib docs for the interpreter.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use waygate_interop_tests::{python, run_peer, spawn_echo_server};
use waygate_transport::kcp::{self, KcpConfig};
use waygate_transport::quic::{self, QuicConfig};
use waygate_transport::tls::TlsIdentity;
use waygate_transport::{tcp, ws};
use waygate_transport::{BoxListener, ConnConfig};

/// Upper bound for one peer run (it bounds each of its own waits at 10 s).
const PEER_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy)]
enum Kind {
    Tcp,
    Tls,
    Ws,
    Wss,
    Quic,
    Kcp,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Tcp => "tcp",
            Kind::Tls => "tls",
            Kind::Ws => "ws",
            Kind::Wss => "wss",
            Kind::Quic => "quic",
            Kind::Kcp => "kcp",
        }
    }
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Starts the listener of `kind` with an echo server, runs the Python peer against it and
/// returns the peer's JSON result.
fn interop(kind: Kind) -> serde_json::Value {
    // Resolve (or build) the interpreter before the runtime starts: it may take a while.
    python();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let config = ConnConfig::default();
        let max_frame = config.max_frame_size;
        let identity = TlsIdentity::generate_dev(&[]).expect("dev identity");
        let mut ca = tempfile::NamedTempFile::new().expect("temp file");
        ca.write_all(identity.dev_ca_pem.as_deref().expect("dev CA").as_bytes())
            .expect("write CA");
        let listener: BoxListener = match kind {
            Kind::Tcp => Box::new(tcp::listen(loopback(), None, config).await.expect("bind")),
            Kind::Tls => Box::new(
                tcp::listen(loopback(), Some(&identity), config)
                    .await
                    .expect("bind"),
            ),
            Kind::Ws => Box::new(ws::listen(loopback(), None, config).await.expect("bind")),
            Kind::Wss => Box::new(
                ws::listen(loopback(), Some(&identity), config)
                    .await
                    .expect("bind"),
            ),
            Kind::Quic => Box::new(
                quic::listen(loopback(), &identity, &QuicConfig::default(), config).expect("bind"),
            ),
            Kind::Kcp => Box::new(
                kcp::listen(loopback(), &KcpConfig::fast(), config)
                    .await
                    .expect("bind"),
            ),
        };
        let addr = listener.local_addr();
        let server = spawn_echo_server(listener);
        let args = vec![
            "--transport".to_string(),
            kind.name().to_string(),
            "--addr".to_string(),
            addr.to_string(),
            "--ca".to_string(),
            ca.path().display().to_string(),
            "--server-name".to_string(),
            "localhost".to_string(),
            "--max-frame".to_string(),
            max_frame.to_string(),
        ];
        let result = run_peer("waygate_peer.py", &args, PEER_TIMEOUT).await;
        server.abort();
        eprintln!("{}: {result}", kind.name());
        check_result(kind, &result);
        result
    })
}

/// Guards against a peer that "passes" without doing the work.
fn check_result(kind: Kind, result: &serde_json::Value) {
    let echo = &result["echo"];
    let sent = echo["sent"].as_u64().unwrap_or(0);
    assert!(
        sent >= 25,
        "{}: only {sent} frames sent: {result}",
        kind.name()
    );
    assert_eq!(
        echo["received"].as_u64(),
        Some(sent),
        "{}: echoes: {result}",
        kind.name()
    );
    assert!(
        echo["bytes_sent"].as_u64().unwrap_or(0) > 3 * 65_000,
        "{}: the max-size frames were not sent: {result}",
        kind.name()
    );
    assert!(
        result["close"].is_object(),
        "{}: CLOSE not checked: {result}",
        kind.name()
    );
    let malformed = result["malformed"].as_array().cloned().unwrap_or_default();
    assert!(
        malformed.len() >= 3,
        "{}: malformed cases missing: {result}",
        kind.name()
    );
    for case in &malformed {
        assert_eq!(case["ok"], true, "{}: {case}", kind.name());
        assert_eq!(case["got"], case["expected"], "{}: {case}", kind.name());
    }
}

#[test]
fn python_codec_matches_the_spec_examples() {
    python();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let result = runtime.block_on(run_peer("waygate_peer.py", &["--selftest"], PEER_TIMEOUT));
    assert_eq!(result["selftest"], true, "{result}");
}

#[test]
fn python_tcp_peer() {
    interop(Kind::Tcp);
}

#[test]
fn python_tls_peer() {
    let result = interop(Kind::Tls);
    assert!(
        result["connect"]["tls_version"]
            .as_str()
            .is_some_and(|v| v.starts_with("TLSv1.")),
        "{result}"
    );
}

#[test]
fn python_websocket_peer() {
    let result = interop(Kind::Ws);
    assert_eq!(result["connect"]["subprotocol"], "waygate.v1", "{result}");
}

#[test]
fn python_websocket_tls_peer() {
    let result = interop(Kind::Wss);
    assert_eq!(result["connect"]["subprotocol"], "waygate.v1", "{result}");
}

#[test]
fn python_quic_peer() {
    let result = interop(Kind::Quic);
    assert_eq!(result["connect"]["alpn"], "waygate/1", "{result}");
    let channels = &result["echo"]["channels"];
    for channel in ["control", "normal", "best_effort", "datagram"] {
        assert!(
            channels[channel].as_u64().unwrap_or(0) > 0,
            "no echo came back on the {channel} channel: {result}"
        );
    }
}

#[test]
fn python_kcp_peer() {
    let result = interop(Kind::Kcp);
    let connect = &result["connect"];
    assert!(connect["conv"].as_u64().unwrap_or(0) > 0, "{result}");
    // No amplification: COOKIE (42) and ACCEPT (14) are smaller than HELLO/CONNECT (64).
    assert_eq!(connect["cookie_len"], 42, "{result}");
    let endpoint = result["endpoint"].as_array().cloned().unwrap_or_default();
    assert!(endpoint.len() >= 4, "endpoint checks missing: {result}");
    assert!(endpoint.iter().all(|c| c["ok"] == true), "{result}");
}

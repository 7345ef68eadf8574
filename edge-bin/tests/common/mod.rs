//! Shared harness of the edge's process tests: the real `waygate` binary as child
//! processes (edge and demo backends on port 0, addresses read back from their ready
//! line), route tables, tokens, SDK clients. Children are killed on drop.
#![allow(
    dead_code,
    unreachable_pub,
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used
)]

pub mod cluster;
pub mod failover;
pub mod keeper;
pub mod write_through;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use waygate_client::{Client, ClientOptions, Event};
use waygate_edge::config::{DEV_KEY_ID, DEV_KEY_SECRET};
use waygate_session::auth::TokenClaims;
use waygate_transport::endpoint::{ConnectOptions, Endpoint};
use waygate_transport::tls::ClientTls;
use waygate_transport::TransportKind;

pub const BIN: &str = env!("CARGO_BIN_EXE_waygate");

/// A child process that printed its ready line.
pub struct Proc {
    pub child: Child,
    pub ready: serde_json::Value,
}

impl Proc {
    pub async fn spawn(args: &[&str]) -> Proc {
        Self::spawn_with_env(args, &[]).await
    }

    /// As [`Proc::spawn`], with environment variables.
    pub async fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut child = Command::new(BIN)
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn waygate");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("ready line in time")
            .expect("read stdout")
            .expect("a ready line");
        let ready: serde_json::Value = serde_json::from_str(&line).expect("ready JSON");
        assert_eq!(ready["event"], "ready", "{line}");
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Proc { child, ready }
    }

    pub fn kill9(&mut self) {
        self.child.start_kill().expect("SIGKILL");
    }

    pub async fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        tokio::time::timeout(limit, self.child.wait())
            .await
            .ok()
            .and_then(Result::ok)
    }
}

pub async fn backend(id: &str, extra: &[&str]) -> (Proc, SocketAddr) {
    let mut args = vec!["backend", "--addr", "127.0.0.1:0", "--id", id];
    args.extend_from_slice(extra);
    let p = Proc::spawn(&args).await;
    let addr = p.ready["backend"].as_str().unwrap().parse().unwrap();
    (p, addr)
}

/// A route table: services player (1000-1999) and room (2000-2999) over `addrs`, skipping
/// `removed` (index) for the player service.
pub fn table(addrs: &[SocketAddr], epoch: u64, removed: Option<usize>) -> String {
    waygate_backend::demo::route_table(addrs, epoch, |i| (removed != Some(i)).then_some("active"))
}

pub struct EdgeProc {
    pub proc: Proc,
    pub dir: tempfile::TempDir,
    pub routes: PathBuf,
    pub tls: ClientTls,
}

impl EdgeProc {
    /// Starts `waygate run` with a route table file and `extra_toml` appended to the config.
    pub async fn start(table_text: &str, extra_toml: &str) -> EdgeProc {
        Self::start_polling(table_text, 100, extra_toml).await
    }

    /// As `start`, with the table file polled every `poll_ms`.
    pub async fn start_polling(table_text: &str, poll_ms: u64, extra_toml: &str) -> EdgeProc {
        let dir = tempfile::tempdir().unwrap();
        let routes = dir.path().join("routes.toml");
        std::fs::write(&routes, table_text).unwrap();
        let ca = dir.path().join("ca.pem");
        let config = dir.path().join("edge.toml");
        std::fs::write(
            &config,
            format!(
                "edge_id = \"edge-test\"\n[tls]\ndev_ca_out = {ca:?}\n[routing]\ntable = {routes:?}\npoll_ms = {poll_ms}\n{extra_toml}\n"
            ),
        )
        .unwrap();
        let proc = Proc::spawn(&[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--ephemeral-ports",
        ])
        .await;
        let tls = ClientTls::from_ca_file(&ca).unwrap();
        EdgeProc {
            proc,
            dir,
            routes,
            tls,
        }
    }

    /// Starts `waygate run --etcd .. --redis ..` as edge `edge_id` (the table comes from
    /// etcd), with `extra_toml` appended to the config and `extra_args` on the command line.
    pub async fn start_cluster(
        edge_id: &str,
        etcd: &str,
        redis: &str,
        extra_toml: &str,
        extra_args: &[&str],
    ) -> EdgeProc {
        let dir = tempfile::tempdir().unwrap();
        let routes = dir.path().join("routes.toml");
        let ca = dir.path().join("ca.pem");
        let config = dir.path().join("edge.toml");
        std::fs::write(
            &config,
            format!("edge_id = \"{edge_id}\"\n[tls]\ndev_ca_out = {ca:?}\n{extra_toml}\n"),
        )
        .unwrap();
        let mut args = vec![
            "run",
            "--config",
            config.to_str().unwrap(),
            "--ephemeral-ports",
            "--etcd",
            etcd,
            "--redis",
            redis,
        ];
        args.extend_from_slice(extra_args);
        // The edges of a test share a resume-key secret, as a deployment does: their
        // snapshots hold the resume keys sealed.
        let proc = Proc::spawn_with_env(
            &args,
            &[(
                "WAYGATE_REDIS_RESUME_KEY",
                "the-test-cluster-resume-key-secret-0123456789",
            )],
        )
        .await;
        let tls = ClientTls::from_ca_file(&ca).unwrap();
        EdgeProc {
            proc,
            dir,
            routes,
            tls,
        }
    }

    pub fn addr(&self, kind: TransportKind) -> SocketAddr {
        self.proc.ready["listeners"][kind.as_str()]
            .as_str()
            .unwrap()
            .parse()
            .unwrap()
    }

    pub fn admin(&self) -> SocketAddr {
        self.proc.ready["admin"].as_str().unwrap().parse().unwrap()
    }

    pub fn endpoint(&self, kind: TransportKind) -> Endpoint {
        let mut e = Endpoint::new(kind, self.addr(kind));
        e.host = "localhost".into();
        e
    }

    pub fn client(&self, kind: TransportKind, player: &str) -> Client {
        let mut options = ClientOptions::new(vec![self.endpoint(kind)], token(player));
        options.connect = ConnectOptions {
            tls: Some(self.tls.clone()),
            ..ConnectOptions::default()
        };
        Client::start(options)
    }

    pub fn write_routes(&self, text: &str) {
        write_atomically(&self.routes, text);
    }
}

pub fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

pub fn token(player: &str) -> Bytes {
    token_for_secs(player, 3600)
}

/// A development-key token for `player` valid for `ttl` seconds from now.
pub fn token_for_secs(player: &str, ttl: u64) -> Bytes {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    waygate_session::mint_token(
        DEV_KEY_ID,
        DEV_KEY_SECRET.as_bytes(),
        &TokenClaims {
            player_id: player.into(),
            issuer: "test".into(),
            issued_at: now,
            expires_at: now + ttl,
            extensions: Vec::new(),
        },
    )
    .unwrap()
}

/// A development-key connect token (format version 2, PROTOCOL.md §7.2.2) for `player`
/// sealing KCP with `session_key`, valid for `ttl` seconds from now.
pub fn connect_token_for_secs(player: &str, session_key: &[u8; 32], ttl: u64) -> Bytes {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    waygate_session::auth::mint_connect_token(
        DEV_KEY_ID,
        DEV_KEY_SECRET.as_bytes(),
        &TokenClaims {
            player_id: player.into(),
            issuer: "test".into(),
            issued_at: now,
            expires_at: now + ttl,
            extensions: Vec::new(),
        },
        session_key,
        rand::random(),
    )
    .unwrap()
}

/// A minimal HTTP/1.1 request to the admin server; returns (status, body).
pub async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nX-Waygate-Admin: test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut resp = String::new();
    sock.read_to_string(&mut resp).await.unwrap();
    let status = resp.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Waits for the next event matching `pred` (bounded).
pub async fn wait_for(
    client: &mut Client,
    limit: Duration,
    mut pred: impl FnMut(&Event) -> bool,
) -> Event {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let ev = tokio::time::timeout_at(deadline, client.next_event())
            .await
            .expect("event in time")
            .expect("client running");
        if pred(&ev) {
            return ev;
        }
    }
}

/// Sends ECHO and returns the backend id of the reply, or the ERROR code.
pub async fn echo(client: &mut Client, tag: &str) -> Result<String, waygate_transport::CloseCode> {
    use waygate_backend::demo::{ECHO, ECHO_REPLY};
    let seq = client
        .send(
            waygate_transport::TrafficClass::Normal,
            ECHO,
            Bytes::from(tag.to_string()),
        )
        .await
        .unwrap()
        .unwrap();
    let ev = wait_for(client, Duration::from_secs(20), |e| match e {
        Event::Message {
            msg_id, payload, ..
        } => *msg_id == ECHO_REPLY && payload.ends_with(tag.as_bytes()),
        Event::Error(r) => r.client_seq == seq,
        _ => false,
    })
    .await;
    match ev {
        Event::Message { payload, .. } => {
            let text = String::from_utf8(payload.to_vec()).unwrap();
            Ok(text.split('|').next().unwrap().to_string())
        }
        Event::Error(r) => Err(r.code),
        _ => unreachable!(),
    }
}

/// An in-process edge with one backend running `service` (the demo route table over it)
/// and `tune`d settings; keep the directory alive as long as the edge.
pub async fn edge_over(
    service: std::sync::Arc<dyn waygate_backend::Service>,
    tune: impl FnOnce(&mut waygate_edge::config::EdgeConfig),
) -> (
    waygate_edge::edge::Edge,
    waygate_backend::Backend,
    tempfile::TempDir,
) {
    let backend = waygate_backend::Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        waygate_backend::BackendConfig::new("b1"),
        service,
    )
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, table(&[backend.local_addr()], 1, None)).unwrap();
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(routes);
    tune(&mut config);
    let edge = waygate_edge::edge::Edge::start(config).await.unwrap();
    (edge, backend, dir)
}

/// As [`edge_over`] with the demo game.
pub async fn demo_edge(
    tune: impl FnOnce(&mut waygate_edge::config::EdgeConfig),
) -> (
    waygate_edge::edge::Edge,
    waygate_backend::Backend,
    tempfile::TempDir,
) {
    edge_over(
        std::sync::Arc::new(waygate_backend::demo::DemoService::new()),
        tune,
    )
    .await
}

/// Raw TCP: HELLO with `token` (no resume); the first frame the edge answers with.
pub async fn raw_hello(addr: SocketAddr, token: Bytes) -> waygate_transport::Frame {
    let hello = waygate_transport::Frame::Hello(waygate_protocol::frame::Hello {
        version: waygate_protocol::wire::PROTOCOL_VERSION,
        token,
        resume: None,
    });
    raw_frame(addr, hello).await
}

/// Raw TCP: sends `frame` on a new connection; the first frame the edge answers with.
pub async fn raw_frame(
    addr: SocketAddr,
    frame: waygate_transport::Frame,
) -> waygate_transport::Frame {
    use bytes::BytesMut;
    use tokio::io::AsyncWriteExt;
    use waygate_protocol::codec::StreamCodec;
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let codec = StreamCodec::new(65536);
    let mut out = BytesMut::new();
    codec.encode(&frame, &mut out).unwrap();
    sock.write_all(&out).await.unwrap();
    read_frame(&mut sock).await
}

/// Raw TCP: the next frame the edge sends on `sock` (within 10 s; the stream must not end
/// before it).
pub async fn read_frame(sock: &mut tokio::net::TcpStream) -> waygate_transport::Frame {
    use bytes::BytesMut;
    use tokio::io::AsyncReadExt;
    use waygate_protocol::codec::StreamCodec;
    let codec = StreamCodec::new(65536);
    let mut buf = BytesMut::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(f) = codec.decode(&mut buf).unwrap() {
                return f;
            }
            assert!(sock.read_buf(&mut buf).await.unwrap() > 0, "an answer");
        }
    })
    .await
    .expect("an answer in time")
}

//! Shared by the integration tests: an in-process edge with one demo backend, and tokens.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use waygate_backend::demo::DemoService;
use waygate_backend::{Backend, BackendConfig};
use waygate_edge::config::{EdgeConfig, DEV_KEY_ID, DEV_KEY_SECRET};
use waygate_edge::edge::Edge;
use waygate_session::auth::{token_to_base64url, TokenClaims};

/// An edge (every listener on an ephemeral loopback port) routing the demo player service
/// (msg ids 1000-1999) to one demo backend with id `b1`; the dev CA is in `ca_file`.
pub struct Cluster {
    pub edge: Edge,
    pub backend: Backend,
    pub ca_file: PathBuf,
}

pub async fn cluster(dir: &Path) -> Cluster {
    cluster_with(dir, |_| {}).await
}

/// As [`cluster`] with `tune`d edge settings.
pub async fn cluster_with(dir: &Path, tune: impl FnOnce(&mut EdgeConfig)) -> Cluster {
    let backend = Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::new("b1"),
        Arc::new(DemoService::new()),
    )
    .await
    .unwrap();
    let addr: SocketAddr = backend.local_addr();
    let table = format!(
        "epoch = 1\nupdated_at = 0\n\
         [[services]]\nname = \"player\"\nmessages = [[1000, 1999]]\nkey = \"player\"\n\
         \x20 [[services.instances]]\n  id = \"p1\"\n  address = \"{addr}\"\n"
    );
    let path = dir.join("routes.toml");
    std::fs::write(&path, table).unwrap();
    let mut config = EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(path);
    tune(&mut config);
    let edge = Edge::start(config).await.unwrap();
    let ca_file = dir.join("dev-ca.pem");
    std::fs::write(&ca_file, edge.dev_ca_pem.as_deref().unwrap()).unwrap();
    Cluster {
        edge,
        backend,
        ca_file,
    }
}

/// The claims of a test token for `player`: issued now, valid for an hour.
fn claims(player: &str) -> TokenClaims {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    TokenClaims {
        player_id: player.into(),
        issuer: "c-example-test".into(),
        issued_at: now,
        expires_at: now + 3600,
        extensions: Vec::new(),
    }
}

/// The raw token bytes for `player`, signed with the dev key, valid for an hour.
pub fn token_bytes(player: &str) -> Vec<u8> {
    waygate_session::mint_token(DEV_KEY_ID, DEV_KEY_SECRET.as_bytes(), &claims(player))
        .unwrap()
        .to_vec()
}

/// [`token_bytes`] as base64url text (what `waygate token` prints).
pub fn token(player: &str) -> String {
    token_to_base64url(&token_bytes(player))
}

/// A connect token (format version 2, PROTOCOL.md §7.2.2) for `player` carrying
/// `session_key`, signed with the dev key, valid for an hour.
pub fn connect_token_bytes(player: &str, session_key: &[u8; 32]) -> Vec<u8> {
    waygate_session::auth::mint_connect_token(
        DEV_KEY_ID,
        DEV_KEY_SECRET.as_bytes(),
        &claims(player),
        session_key,
        [3; 12],
    )
    .unwrap()
    .to_vec()
}

/// Where cargo wrote this crate's library `file` (`libwaygate_client_capi.a` or `.so`) for
/// this test run: `target/<profile>/deps/`, where the test itself runs from (`cargo build`
/// also copies it up to `target/<profile>/`, which `cargo test` does not do).
pub fn built_library(file: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let candidates = [deps.join(file), deps.parent().unwrap().join(file)];
    candidates
        .iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!("no {file} in {candidates:?}: cargo builds it with this crate's lib (crate-type staticlib and cdylib)")
        })
        .clone()
}

/// Runs `cmd` (program and arguments set) with its output in `dir/<name>.out|err`, killed
/// after `limit`; returns (success, stdout, stderr).
pub fn run_limited(
    cmd: &mut std::process::Command,
    dir: &Path,
    name: &str,
    limit: std::time::Duration,
) -> (bool, String, String) {
    use std::process::Stdio;
    let out_path = dir.join(format!("{name}.out"));
    let err_path = dir.join(format!("{name}.err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let mut stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    if status.is_none() {
        stderr.push_str(&format!("\n(killed after {limit:?})"));
    }
    (status.is_some_and(|s| s.success()), stdout, stderr)
}

/// The URL of the cluster's listener of `kind` (TLS kinds by the name `localhost`, which
/// the development certificate covers).
pub fn endpoint_url(c: &Cluster, kind: waygate_transport::TransportKind) -> String {
    use waygate_transport::TransportKind;
    let addr = c.edge.addrs[&kind];
    let host = if matches!(
        kind,
        TransportKind::Tls | TransportKind::Wss | TransportKind::Quic
    ) {
        "localhost".to_string()
    } else {
        addr.ip().to_string()
    };
    format!("{}://{host}:{}", kind.as_str(), addr.port())
}

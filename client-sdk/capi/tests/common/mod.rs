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

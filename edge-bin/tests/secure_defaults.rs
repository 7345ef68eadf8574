//! Secure by default (hardening issue, items 1 and 8): the public development key works on
//! loopback only. An edge with it and a client listener beyond loopback refuses to start and
//! says how to set a key; `waygate keygen` prints one, and an edge with its own key refuses
//! tokens signed with the development key. Backend links beyond loopback need a shared
//! secret on both ends. The real `waygate` binary, real sockets on loopback.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{EdgeProc, BIN};
use waygate_transport::{CloseCode, Frame, TransportKind};

async fn output(args: &[&str]) -> std::process::Output {
    let child = tokio::process::Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("the command ends by itself")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dev_key_beyond_loopback_refuses_to_start_and_says_how_to_fix_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("edge.toml");
    // Nothing is bound: the refusal comes before any listener.
    std::fs::write(&config, "[listeners.tcp]\naddr = \"0.0.0.0:0\"\n").unwrap();
    let out = output(&["run", "--config", config.to_str().unwrap()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("auth.keys"), "{stderr}");
    assert!(stderr.contains("tcp (0.0.0.0:0)"), "{stderr}");
    assert!(stderr.contains("waygate keygen"), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("\"ready\""),
        "never ready"
    );
}

/// A JWT edge has no keys to open KCP connect tokens with: `waygate run` with a KCP listener
/// that requires sealed sessions refuses to start, naming the setting (it would refuse
/// every CONNECT), and is never ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwt_edge_whose_kcp_listener_requires_sealed_sessions_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("edge.toml");
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, r#"{"keys": []}"#).unwrap();
    std::fs::write(
        &config,
        format!(
            "[auth]\nkind = \"jwt\"\n[auth.jwt]\njwks_file = {jwks:?}\n\
             [kcp]\npacket_auth = \"required\"\n"
        ),
    )
    .unwrap();
    let out = output(&["run", "--config", config.to_str().unwrap()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("kcp.packet_auth"), "{stderr}");
    assert!(
        stderr.contains("every CONNECT would be refused"),
        "{stderr}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("\"ready\""),
        "never ready"
    );
}

/// What works on loopback but is open beyond it is said at start: an etcd endpoint beyond
/// loopback without TLS (allowed with `cluster.insecure_no_auth`) draws a warning naming
/// it. The endpoint is a documentation address (192.0.2.1, never reached: the edge is
/// stopped once the warning is read); every listener stays on loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_etcd_beyond_loopback_is_warned_about_at_start() {
    use tokio::io::AsyncBufReadExt as _;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("edge.toml");
    std::fs::write(
        &config,
        "[cluster]\netcd_endpoints = [\"http://192.0.2.1:2379\"]\ninsecure_no_auth = true\n",
    )
    .unwrap();
    let mut child = tokio::process::Command::new(BIN)
        .args(["run", "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(Some(line)) = lines.next_line().await {
            let hit = line.contains("etcd at http://192.0.2.1:2379 is beyond loopback without TLS");
            seen.push(line);
            if hit {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    let _ = child.kill().await;
    assert!(found, "no warning at start; stderr: {seen:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_with_its_own_key_refuses_dev_key_tokens_and_accepts_its_own() {
    let keygen = output(&["keygen", "--id", "7"]).await;
    assert!(keygen.status.success());
    let key_toml = String::from_utf8(keygen.stdout).unwrap();
    assert!(
        key_toml.starts_with("[[auth.keys]]\nid = 7\nsecret = \""),
        "{key_toml}"
    );
    let secret = key_toml.split('"').nth(1).unwrap();
    assert_eq!(secret.len(), 64, "32 random bytes, hex");

    let (_b, backend) = common::backend("b1", &[]).await;
    let table = common::table(&[backend], 1, None);
    let edge = EdgeProc::start(&table, &format!("[auth]\n{key_toml}")).await;
    let tcp = edge.addr(TransportKind::Tcp);

    // A token signed with the public development key: refused.
    match common::raw_hello(tcp, common::token("mallory")).await {
        Frame::Reject(r) => assert_eq!(r.code, CloseCode::AuthUnknownKey, "{r:?}"),
        other => panic!("dev-key token not refused: {other:?}"),
    }
    // A token from the operator's key (what the login service mints): welcome.
    let config = edge.dir.path().join("edge.toml");
    let minted = output(&[
        "token",
        "--player",
        "alice",
        "--config",
        config.to_str().unwrap(),
    ])
    .await;
    assert!(minted.status.success());
    let token = String::from_utf8(minted.stdout).unwrap();
    let raw = waygate_session::auth::token_from_base64url(token.trim()).unwrap();
    assert!(matches!(
        common::raw_hello(tcp, raw).await,
        Frame::Welcome(_)
    ));
}

/// Backend links (hardening item 8): `waygate backend` beyond loopback without a link secret
/// refuses to start and says how; `waygate run` with a client listener beyond loopback and
/// no link secret too; processes sharing the secret file link and serve the game.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_need_a_secret_beyond_loopback_and_work_with_one() {
    let out = output(&["backend", "--addr", "0.0.0.0:0", "--id", "b1"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("link secret"), "{stderr}");
    assert!(stderr.contains("--link-secret-file"), "{stderr}");

    let dir = tempfile::tempdir().unwrap();
    let keygen = output(&["keygen", "--id", "7"]).await;
    let config = dir.path().join("edge.toml");
    std::fs::write(
        &config,
        format!(
            "[listeners.tcp]\naddr = \"0.0.0.0:0\"\n{}",
            String::from_utf8(keygen.stdout).unwrap()
        ),
    )
    .unwrap();
    let out = output(&["run", "--config", config.to_str().unwrap()]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("links.secret_file"), "{stderr}");

    // Both ends with the same secret file (on loopback here): the game works.
    let secret = dir.path().join("link-secret");
    std::fs::write(&secret, "a shared link secret for the test\n").unwrap();
    let secret = secret.to_str().unwrap();
    let (_b, backend) = common::backend("b1", &["--link-secret-file", secret]).await;
    let edge = EdgeProc::start(
        &common::table(&[backend], 1, None),
        &format!("[links]\nsecret_file = {secret:?}\n"),
    )
    .await;
    let mut client = edge.client(TransportKind::Tcp, "linked");
    assert_eq!(common::echo(&mut client, "x").await, Ok("b1".to_string()));
    // An edge without the secret is refused by that backend: its clients are told.
    let open = EdgeProc::start(&common::table(&[backend], 1, None), "").await;
    let mut client = open.client(TransportKind::Tcp, "refused");
    assert_eq!(
        common::echo(&mut client, "x").await,
        Err(CloseCode::Unavailable)
    );
}

/// Token audiences (hardening item 7): an edge with `auth.audiences` accepts tokens minted
/// for one of them (`waygate token --audience`) and refuses others and tokens without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_with_audiences_refuses_tokens_for_others() {
    let (_b, backend) = common::backend("b1", &[]).await;
    let edge = EdgeProc::start(
        &common::table(&[backend], 1, None),
        "[auth]\naudiences = [\"eu-game\"]\n",
    )
    .await;
    let tcp = edge.addr(TransportKind::Tcp);
    let config = edge.dir.path().join("edge.toml");
    let mint = |audience: Option<&'static str>| {
        let config = config.clone();
        async move {
            let mut args = vec![
                "token".to_string(),
                "--player".into(),
                "aud".into(),
                "--config".into(),
                config.to_str().unwrap().into(),
            ];
            if let Some(a) = audience {
                args.extend(["--audience".into(), a.into()]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = output(&args).await;
            assert!(out.status.success());
            waygate_session::auth::token_from_base64url(
                String::from_utf8(out.stdout).unwrap().trim(),
            )
            .unwrap()
        }
    };
    assert!(matches!(
        common::raw_hello(tcp, mint(Some("eu-game")).await).await,
        Frame::Welcome(_)
    ));
    for other in [Some("us-game"), None] {
        match common::raw_hello(tcp, mint(other).await).await {
            Frame::Reject(r) => assert_eq!(r.code, CloseCode::AuthRejected, "{other:?}"),
            f => panic!("{other:?}: {f:?}"),
        }
    }
    // Regression (2026-12-05, a review of PROTOCOL.md against the code): the REJECT quoted
    // the token's audience whole, so a long one made a REJECT over the 1,024-byte message
    // field that no client could decode (§1.3: the edge's own messages are at most 200
    // characters, as its CLOSE already was).
    let long: &'static str = Box::leak("a".repeat(2_000).into_boxed_str());
    match common::raw_hello(tcp, mint(Some(long)).await).await {
        Frame::Reject(r) => {
            assert_eq!(r.code, CloseCode::AuthRejected);
            assert!(
                r.message.chars().count() <= 200,
                "{} characters",
                r.message.chars().count()
            );
        }
        f => panic!("a long audience: {f:?}"),
    }
}

/// Hardening issue ("keys reload without a restart"): with `auth.keys_file` the edge re-reads
/// its HMAC keys when the file changes. A token under a key id the file does not have is
/// refused (203); the file gains that key and, with no restart, the same token is welcomed;
/// the old key leaves the file and its tokens are refused; a broken file keeps the keys in
/// force. Connect tokens (KCP) use the same keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hmac_keys_rotate_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("auth-keys.toml");
    let write = |text: &str| common::write_atomically(&keys, text);
    let old = "[[keys]]\nid = 5\nsecret = \"the old key, thirty-two bytes lon\"\n";
    let new = "[[keys]]\nid = 6\nsecret = \"the new key, thirty-two bytes lon\"\n";
    write(old);
    let keys_path = keys.clone();
    let (edge, _b, _d) = common::demo_edge(move |c| c.auth.keys_file = Some(keys_path)).await;
    let tcp = edge.addrs[&TransportKind::Tcp];
    let mint = |id: u32, secret: &str, player: &str| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        waygate_session::mint_token(
            id,
            secret.as_bytes(),
            &waygate_session::auth::TokenClaims {
                player_id: player.into(),
                issuer: "login".into(),
                issued_at: now,
                expires_at: now + 600,
                extensions: Vec::new(),
            },
        )
        .unwrap()
    };
    let old_token = mint(5, "the old key, thirty-two bytes lon", "ann");
    let new_token = mint(6, "the new key, thirty-two bytes lon", "bob");
    assert!(matches!(
        common::raw_hello(tcp, old_token.clone()).await,
        Frame::Welcome(_)
    ));
    match common::raw_hello(tcp, new_token.clone()).await {
        Frame::Reject(r) => assert_eq!(r.code, CloseCode::AuthUnknownKey),
        other => panic!("an unknown key id was accepted: {other:?}"),
    }
    // Rotation step 1: both keys. No restart.
    write(&format!("{old}{new}"));
    let welcomed = eventually(|| {
        let t = new_token.clone();
        async move { matches!(common::raw_hello(tcp, t).await, Frame::Welcome(_)) }
    })
    .await;
    assert!(welcomed, "the new key was picked up without a restart");
    // The KCP listener opens connect tokens with the same, reloaded keys.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let connect_token = waygate_session::auth::mint_connect_token(
        6,
        b"the new key, thirty-two bytes lon",
        &waygate_session::auth::TokenClaims {
            player_id: "kcp".into(),
            issuer: "login".into(),
            issued_at: now,
            expires_at: now + 600,
            extensions: Vec::new(),
        },
        &[4; 32],
        [1; 12],
    )
    .unwrap();
    let options = waygate_transport::endpoint::ConnectOptions::default();
    let mut conn = options.conn.clone();
    conn.kcp_credentials = Some(waygate_transport::kcp::seal::KcpCredentials {
        token: connect_token,
        session_key: [4; 32],
    });
    assert!(
        waygate_transport::kcp::connect_kcp(edge.addrs[&TransportKind::Kcp], &options.kcp, &conn)
            .await
            .is_ok(),
        "a sealed KCP session under the reloaded key"
    );
    // A broken file changes nothing.
    write("[[keys]]\nid = \"not a number\"\n");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(matches!(
        common::raw_hello(tcp, new_token.clone()).await,
        Frame::Welcome(_)
    ));
    // Step 2: the old key leaves.
    write(new);
    let refused = eventually(|| {
        let t = old_token.clone();
        async move { matches!(common::raw_hello(tcp, t).await, Frame::Reject(_)) }
    })
    .await;
    assert!(
        refused,
        "the old key's tokens are refused once it left the file"
    );
}

/// Polls `check` every 200 ms for up to 10 s; whether it held.
async fn eventually<F, Fut>(mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..50 {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

/// PEM files of a small PKI for link TLS: a CA, a backend certificate for 127.0.0.1, an
/// edge client certificate; and an edge certificate from another CA.
struct LinkPki {
    dir: tempfile::TempDir,
}

impl LinkPki {
    fn new() -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
        };
        let dir = tempfile::tempdir().unwrap();
        let make_ca = |name: &str| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.distinguished_name
                .push(rcgen::DnType::CommonName, name.to_owned());
            let key = KeyPair::generate().unwrap();
            let cert = p.self_signed(&key).unwrap();
            (cert.pem(), Issuer::new(p, key))
        };
        let leaf = |issuer: &Issuer<'_, KeyPair>, sans: Vec<String>, usage| {
            let mut p = CertificateParams::new(sans).unwrap();
            p.extended_key_usages = vec![usage];
            let key = KeyPair::generate().unwrap();
            let cert = p.signed_by(&key, issuer).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (ca_pem, ca) = make_ca("link CA");
        let (other_pem, other) = make_ca("another CA");
        let backend = leaf(
            &ca,
            vec!["127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let edge = leaf(
            &ca,
            vec!["edge".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let impostor = leaf(
            &other,
            vec!["edge".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write("ca.pem", &ca_pem);
        write("other-ca.pem", &other_pem);
        write("backend.pem", &backend.0);
        write("backend.key", &backend.1);
        write("edge.pem", &edge.0);
        write("edge.key", &edge.1);
        write("impostor.pem", &impostor.0);
        write("impostor.key", &impostor.1);
        Self { dir }
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(name)
    }
}

/// An in-process edge linked to `backend` with link TLS from `pki` (`cert`/`key` the edge's).
async fn tls_edge(
    pki: &LinkPki,
    backend: std::net::SocketAddr,
    cert: &str,
    key: &str,
) -> (waygate_edge::edge::Edge, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, common::table(&[backend], 1, None)).unwrap();
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(routes);
    config.links.tls_ca_file = Some(pki.path("ca.pem"));
    config.links.tls_cert_file = Some(pki.path(cert));
    config.links.tls_key_file = Some(pki.path(key));
    let edge = waygate_edge::edge::Edge::start(config).await.unwrap();
    (edge, dir)
}

/// Hardening item 8: backend links over mutual TLS. A backend requiring client certificates
/// of its CA serves an edge presenting one (a game message goes through); an edge with a
/// certificate of another CA, and an edge on plain TCP, never get a link (their players get
/// `unavailable`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_links_over_mutual_tls_admit_only_edges_of_their_ca() {
    use waygate_backend::link_tls::{server_config, LinkTlsFiles};
    let pki = LinkPki::new();
    let mut config = waygate_backend::BackendConfig::new("b1");
    config.tls = Some(
        server_config(&LinkTlsFiles {
            ca: pki.path("ca.pem"),
            cert: pki.path("backend.pem"),
            key: pki.path("backend.key"),
        })
        .unwrap(),
    );
    let backend = waygate_backend::Backend::bind(
        "127.0.0.1:0".parse().unwrap(),
        config,
        std::sync::Arc::new(waygate_backend::demo::DemoService::new()),
    )
    .await
    .unwrap();
    let addr = backend.local_addr();
    let echo = |edge: &waygate_edge::edge::Edge, player: &str| {
        let c = waygate_client::Client::start(waygate_client::ClientOptions::new(
            vec![waygate_transport::endpoint::Endpoint::new(
                TransportKind::Tcp,
                edge.addrs[&TransportKind::Tcp],
            )],
            common::token(player),
        ));
        async move {
            let mut c = c;
            let mut last = None;
            for _ in 0..20 {
                match common::echo(&mut c, "hi").await {
                    Ok(reply) => return Ok(reply),
                    Err(code) => last = Some(code),
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(last)
        }
    };

    let (good, _d1) = tls_edge(&pki, addr, "edge.pem", "edge.key").await;
    let reply = echo(&good, "tls-player")
        .await
        .expect("echo through a TLS link");
    assert_eq!(reply, "b1", "answered by the TLS backend");

    let (impostor, _d2) = tls_edge(&pki, addr, "impostor.pem", "impostor.key").await;
    assert_eq!(
        echo(&impostor, "impostor-player").await,
        Err(Some(CloseCode::Unavailable)),
        "an edge whose certificate is of another CA gets no link"
    );
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, common::table(&[addr], 1, None)).unwrap();
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.routing.table = Some(routes);
    let plain = waygate_edge::edge::Edge::start(config).await.unwrap();
    assert_eq!(
        echo(&plain, "plain-player").await,
        Err(Some(CloseCode::Unavailable)),
        "a plain TCP link to a TLS backend never comes up"
    );
}

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
}

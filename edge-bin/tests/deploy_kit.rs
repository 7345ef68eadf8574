//! The operator's kit in `edge-bin/deploy/` (newcomer issue, item 4), checked against the
//! real thing: the alert rules pass `promtool check rules`; every waygate metric the rules
//! and the Grafana dashboard query exists in a busy edge's `/metrics`; the Kubernetes
//! manifests' ports, protocols and probes match the configuration they embed, which the
//! edge accepts (own key, admin token) and would refuse with the public development key;
//! `waygate drain`, which systemd's ExecStop and the preStop hook run, drains a real edge.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::cluster::cluster;
use waygate_edge::config::EdgeConfig;
use waygate_transport::TransportKind;

fn deploy(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(file)
}

fn read(file: &str) -> String {
    std::fs::read_to_string(deploy(file)).unwrap()
}

/// Every `waygate_...` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(pos) = text[i..].find("waygate_") {
        let start = i + pos;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        names.insert(text[start..end].to_string());
        i = end;
    }
    names
}

#[test]
fn the_alert_rules_pass_promtool() {
    let out = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(deploy("prometheus/waygate-alerts.yml"))
        .output()
        .expect("promtool (Debian package prometheus; scripts/test.sh installs it)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_query_exists() {
    let c = cluster().await;
    let mut client = c.client(&[TransportKind::Tcp], "kit");
    common::echo(&mut client, "x").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // a route-loop tick (link credits)
    let (status, exposition) = common::http(c.edge.admin_addr.unwrap(), "GET", "/metrics").await;
    assert_eq!(status, 200);
    // Names as Prometheus stores them: samples, and families declared without samples yet.
    let mut exposed = BTreeSet::new();
    for line in exposition.lines() {
        let name = match line.strip_prefix("# TYPE ") {
            Some(rest) => rest.split(' ').next(),
            None if !line.starts_with('#') => line.split(['{', ' ']).next(),
            None => None,
        };
        if let Some(n) = name.filter(|n| !n.is_empty()) {
            exposed.insert(n.to_string());
        }
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("grafana/waygate-dashboard.json")).unwrap();
    let mut exprs = String::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            exprs.push_str(target["expr"].as_str().unwrap());
            exprs.push('\n');
        }
    }
    assert!(
        exprs.contains("waygate_link_forward_credits"),
        "link credits panel"
    );
    let rules = read("prometheus/waygate-alerts.yml");
    let mut queried = metric_names(&exprs);
    queried.extend(metric_names(&rules));
    let missing: Vec<&String> = queried.iter().filter(|n| !exposed.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "queried but not exposed: {missing:?}\n--- exposition ---\n{exposition}"
    );
}

/// The `edge.toml` block embedded in the edge manifest's Secret.
fn embedded_config(manifest: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in manifest.lines() {
        if line.trim_end() == "  edge.toml: |" {
            inside = true;
            continue;
        }
        if inside {
            match line.strip_prefix("    ") {
                Some(l) => {
                    out.push_str(l);
                    out.push('\n');
                }
                None => break,
            }
        }
    }
    out
}

#[test]
fn the_kubernetes_manifests_match_the_config_they_embed() {
    let manifest = read("kubernetes/edge.yaml");
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("admin-token");
    std::fs::write(&token, "a-long-enough-admin-token-for-the-test\n").unwrap();
    let link_secret = dir.path().join("link-secret");
    std::fs::write(&link_secret, "a-long-enough-link-secret-for-the-test\n").unwrap();
    let etcd_password = dir.path().join("etcd-password");
    std::fs::write(&etcd_password, "an-etcd-password-for-the-test\n").unwrap();
    let resume_key = dir.path().join("redis-resume-key");
    std::fs::write(
        &resume_key,
        "a-secret-every-edge-shares-for-the-test-0123456789\n",
    )
    .unwrap();
    let placeholder = embedded_config(&manifest)
        .replace("/etc/waygate/admin-token", token.to_str().unwrap())
        .replace("/etc/waygate/link-secret", link_secret.to_str().unwrap())
        .replace(
            "/etc/waygate/etcd-password",
            etcd_password.to_str().unwrap(),
        )
        .replace(
            "/etc/waygate/redis-resume-key",
            resume_key.to_str().unwrap(),
        );
    assert!(!placeholder.is_empty(), "edge.toml block found");
    // As shipped, the key and the Redis password are placeholders anyone can read here:
    // refused (secure-by-default audits: they used to be accepted). With values of the
    // operator's own, accepted.
    let placeholder_path = dir.path().join("placeholder.toml");
    std::fs::write(&placeholder_path, &placeholder).unwrap();
    let err = EdgeConfig::load(&placeholder_path).unwrap_err().to_string();
    assert!(err.contains("placeholder"), "{err}");
    let own_key = placeholder.replace(
        "replace-with-the-output-of-waygate-keygen",
        "an-operator-key-of-their-own-32-bytes",
    );
    std::fs::write(&placeholder_path, &own_key).unwrap();
    let err = EdgeConfig::load(&placeholder_path).unwrap_err().to_string();
    assert!(
        err.contains("Redis password") && err.contains("placeholder"),
        "{err}"
    );
    let text = own_key.replace("replace-with-the-redis-password", "a-redis-password");
    // etcd and Redis are beyond loopback: without their credentials, or without the
    // edges' resume-key secret, the edge refuses too.
    for (open, key) in [
        (
            text.replace("etcd_username = \"waygate\"", ""),
            "cluster.etcd_username",
        ),
        (text.replace(":a-redis-password@", ""), "cluster.redis_url"),
        (
            text.replace(
                &format!("redis_resume_key_file = {:?}", resume_key.to_str().unwrap()),
                "",
            ),
            "cluster.redis_resume_key_file",
        ),
    ] {
        std::fs::write(&placeholder_path, open).unwrap();
        let err = EdgeConfig::load(&placeholder_path).unwrap_err().to_string();
        assert!(err.contains(key), "{err}");
    }
    let path = dir.path().join("edge.toml");
    std::fs::write(&path, &text).unwrap();
    let config = EdgeConfig::load(&path).expect("the embedded config is accepted");
    assert!(
        config.exposed_listener().is_some(),
        "it listens beyond loopback"
    );
    // The same with the public development key is refused.
    let dev = text.replace(
        "secret = \"an-operator-key-of-their-own-32-bytes\"",
        &format!("secret = {:?}", waygate_edge::config::DEV_KEY_SECRET),
    );
    let dev_path = dir.path().join("dev.toml");
    std::fs::write(&dev_path, dev).unwrap();
    let err = EdgeConfig::load(&dev_path).unwrap_err().to_string();
    assert!(err.contains("auth.keys"), "{err}");
    // And without the link secret.
    let open = text.replace(
        &format!("secret_file = {:?}", link_secret.to_str().unwrap()),
        "",
    );
    let open_path = dir.path().join("open.toml");
    std::fs::write(&open_path, open).unwrap();
    let err = EdgeConfig::load(&open_path).unwrap_err().to_string();
    assert!(err.contains("links.secret_file"), "{err}");
    assert!(
        config.links.secret().unwrap().is_some(),
        "the secret file is read"
    );
    assert!(
        config.cluster.redis_resume_key().unwrap().is_some(),
        "the resume-key secret file is read"
    );
    assert_eq!(
        config
            .cluster
            .etcd_credentials()
            .unwrap()
            .map(|c| (c.user, c.password)),
        Some(("waygate".into(), "an-etcd-password-for-the-test".into())),
        "the etcd password file is read"
    );

    // Every listener's port with its protocol, and the admin port, in the Deployment and
    // (clients' ports) in the Service.
    let l = &config.listeners;
    for (name, listener, proto) in [
        ("tcp", &l.tcp, "TCP"),
        ("tls", &l.tls, "TCP"),
        ("ws", &l.ws, "TCP"),
        ("wss", &l.wss, "TCP"),
        ("quic", &l.quic, "UDP"),
        ("kcp", &l.kcp, "UDP"),
    ] {
        let port = listener.addr.port();
        let container = format!("{{name: {name}, containerPort: {port}, protocol: {proto}}}");
        let service = format!("{{name: {name}, port: {port}, protocol: {proto}}}");
        assert!(manifest.contains(&container), "missing {container}");
        assert!(manifest.contains(&service), "missing {service}");
    }
    let admin = config.admin.addr.port();
    assert!(manifest.contains(&format!(
        "{{name: admin, containerPort: {admin}, protocol: TCP}}"
    )));
    assert!(manifest.contains(&format!("httpGet: {{path: /readyz, port: {admin}")));
    assert!(manifest.contains(&format!("httpGet: {{path: /healthz, port: {admin}")));
    assert!(manifest.contains(&format!(
        "command: [\"waygate\", \"drain\", \"--admin\", \"127.0.0.1:{admin}\""
    )));

    let backend = read("kubernetes/backend.yaml");
    assert!(backend.contains("args: [\"backend\", \"--addr\", \"0.0.0.0:7601\""));
    assert!(backend.contains(
        "- name: WAYGATE_LINK_SECRET\n              valueFrom: {secretKeyRef: {name: waygate-edge, key: link-secret}}"
    ));
    assert!(backend.contains("{name: link, containerPort: 7601, protocol: TCP}"));
    let unit = read("systemd/waygate.service");
    assert!(unit.contains("ExecStart=/usr/local/bin/waygate run --config /etc/waygate/edge.toml"));
    assert!(unit.contains("ExecStop=/usr/local/bin/waygate drain --admin 127.0.0.1:9100"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waygate_drain_drains_a_real_edge() {
    let (_b, backend) = common::backend("b1", &[]).await;
    let mut edge = common::EdgeProc::start(&common::table(&[backend], 1, None), "").await;
    let out = tokio::process::Command::new(common::BIN)
        .args(["drain", "--admin", &edge.admin().to_string()])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"draining\":true"));
    // With no session left, the edge exits by itself.
    let status = edge.proc.wait_exit(Duration::from_secs(30)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
}

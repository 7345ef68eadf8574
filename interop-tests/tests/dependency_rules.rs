//! The workspace's dependency rules (ARCHITECTURE.md, "Crates"), checked on the resolved
//! graph that `cargo metadata` reports, so a forbidden dependency fails the suite the day it
//! is added, directly or through another crate:
//!
//! - the protocol crate's tree has no tokio (bytes on the wire, no runtime);
//! - routing depends on no workspace crate but the sans-IO leaf `waygate-backpressure` (the
//!   one token bucket of the workspace, which paces migrations);
//! - the protocol and backpressure crates' trees have no tokio;
//! - transport and protocol never depend on session, routing, the link, the backend SDK or
//!   the edge;
//! - the backend SDK's tree holds none of etcd-client, redis, axum, clap, quinn,
//!   tokio-tungstenite, kcp, the client SDK, transport or the edge (a game server depends on
//!   it alone);
//! - the client SDK (Rust and C ABI) never depends on the edge, the backend SDK or routing;
//! - the edge library never depends on the client SDK (demo and bench live beside the
//!   binary);
//! - session never depends on routing, the link or the edge;
//! - the channels core is sans-IO: no tokio, no transport, session, routing or edge;
//! - the etcd control plane (`waygate-routing-etcd`) depends on routing and etcd-client
//!   only: no session, transport, link, backend SDK, edge or Redis.
//!
//! Only normal and build dependencies count (a test may use anything).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Package name -> names of its normal and build dependencies (direct).
type Graph = BTreeMap<String, BTreeSet<String>>;

/// One rule: the tree of `package` must not contain any of `forbidden`.
struct Rule {
    package: &'static str,
    forbidden: &'static [&'static str],
    why: &'static str,
}

const EDGE_CRATES: &[&str] = &["waygate-edge", "waygate"];

/// Everything above the transport: what the protocol and transport crates never reach.
const ABOVE_TRANSPORT: &[&str] = &[
    "waygate-session",
    "waygate-channels",
    "waygate-routing",
    "waygate-link",
    "waygate-backend",
    "waygate-edge",
    "waygate",
];

/// What a client build never contains.
const NOT_IN_CLIENTS: &[&str] = &[
    "waygate-edge",
    "waygate",
    "waygate-backend",
    "waygate-routing",
    "waygate-link",
];

const RULES: &[Rule] = &[
    Rule {
        package: "waygate-protocol",
        forbidden: &["tokio", "waygate-transport"],
        why: "the protocol crate is bytes on the wire: no runtime, no higher layer",
    },
    Rule {
        package: "waygate-protocol",
        forbidden: ABOVE_TRANSPORT,
        why: "the protocol crate is bytes on the wire: no runtime, no higher layer",
    },
    Rule {
        package: "waygate-routing",
        forbidden: &[
            "waygate-transport",
            "waygate-session",
            "waygate-link",
            "waygate-backend",
            "waygate-edge",
            "waygate",
            "waygate-client",
        ],
        why: "routing is a pure core: no workspace crate but the sans-IO backpressure leaf",
    },
    Rule {
        package: "waygate-backpressure",
        forbidden: &["tokio", "waygate-transport"],
        why: "backpressure stages are sans-IO leaves every layer may use",
    },
    Rule {
        package: "waygate-backpressure",
        forbidden: ABOVE_TRANSPORT,
        why: "backpressure stages are sans-IO leaves every layer may use",
    },
    Rule {
        package: "waygate-transport",
        forbidden: ABOVE_TRANSPORT,
        why: "transport owns sockets; it never knows sessions, routes or backends",
    },
    Rule {
        package: "waygate-backend",
        forbidden: &[
            "etcd-client",
            "redis",
            "axum",
            "clap",
            "quinn",
            "tokio-tungstenite",
            "kcp",
            "waygate-client",
            "waygate-transport",
            "waygate-session",
            "waygate-routing",
            "waygate-edge",
            "waygate",
        ],
        why: "a game server depends on the backend SDK alone",
    },
    Rule {
        package: "waygate-client",
        forbidden: NOT_IN_CLIENTS,
        why: "the client SDK never depends on the edge or routing",
    },
    Rule {
        package: "waygate-client-capi",
        forbidden: NOT_IN_CLIENTS,
        why: "the C ABI is the client SDK: no edge, no routing",
    },
    Rule {
        package: "waygate-edge",
        forbidden: &[
            "waygate-client",
            "waygate-client-capi",
            "waygate-backend",
            "waygate",
        ],
        why: "the edge library never drives clients (demo and bench live beside the binary)",
    },
    Rule {
        package: "waygate-session",
        forbidden: &[
            "waygate-routing",
            "waygate-link",
            "waygate-backend",
            "waygate-edge",
            "waygate",
            "waygate-client",
        ],
        why: "the session layer never routes and never knows the edge",
    },
    Rule {
        package: "waygate-channels",
        forbidden: &[
            "tokio",
            "waygate-transport",
            "waygate-session",
            "waygate-routing",
            "waygate-link",
            "waygate-backend",
            "waygate-edge",
            "waygate",
            "waygate-client",
        ],
        why: "the channels core is sans-IO: it hands deliveries to whoever drives it",
    },
    Rule {
        package: "waygate-routing-etcd",
        forbidden: &[
            "waygate-transport",
            "waygate-session",
            "waygate-channels",
            "waygate-link",
            "waygate-backend",
            "waygate-edge",
            "waygate",
            "waygate-client",
            "redis",
        ],
        why: "the etcd control plane is routing's: a game server may add it beside the backend SDK",
    },
];

/// Builds the graph from `cargo metadata` JSON (the `resolve` section).
fn graph(metadata: &Value) -> Graph {
    let mut names = BTreeMap::new();
    for p in metadata["packages"].as_array().into_iter().flatten() {
        if let (Some(id), Some(name)) = (p["id"].as_str(), p["name"].as_str()) {
            names.insert(id.to_string(), name.to_string());
        }
    }
    let mut g = Graph::new();
    for node in metadata["resolve"]["nodes"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(name) = node["id"].as_str().and_then(|id| names.get(id)) else {
            continue;
        };
        let deps = g.entry(name.clone()).or_default();
        for d in node["deps"].as_array().into_iter().flatten() {
            let counts = d["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k["kind"].is_null() || k["kind"] == "build");
            if let (true, Some(dep)) = (counts, d["pkg"].as_str().and_then(|id| names.get(id))) {
                deps.insert(dep.clone());
            }
        }
    }
    g
}

/// Every package reachable from `root`, with one path to it (for the message).
fn tree(g: &Graph, root: &str) -> BTreeMap<String, Vec<String>> {
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut stack = vec![(root.to_string(), vec![root.to_string()])];
    while let Some((pkg, path)) = stack.pop() {
        for dep in g.get(&pkg).into_iter().flatten() {
            if !seen.contains_key(dep) {
                let mut p = path.clone();
                p.push(dep.clone());
                seen.insert(dep.clone(), p.clone());
                stack.push((dep.clone(), p));
            }
        }
    }
    seen
}

/// Every broken rule, as a readable line; empty when the graph follows the rules.
fn violations(g: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for rule in RULES {
        if !g.contains_key(rule.package) {
            out.push(format!("{}: not in the workspace graph", rule.package));
            continue;
        }
        let t = tree(g, rule.package);
        for f in rule.forbidden {
            if let Some(path) = t.get(*f) {
                out.push(format!(
                    "{} must not depend on {f} ({}): {}",
                    rule.package,
                    rule.why,
                    path.join(" -> ")
                ));
            }
        }
    }
    out
}

/// The stdout of `cargo <args>` run at the workspace root (it must succeed).
fn cargo_stdout(args: &[&str]) -> Vec<u8> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(&root)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cargo {args:?} runs: {e}"));
    assert!(
        out.status.success(),
        "cargo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn workspace_metadata() -> Value {
    let out = cargo_stdout(&["metadata", "--format-version", "1", "--locked"]);
    serde_json::from_slice(&out).expect("cargo metadata prints JSON")
}

#[test]
fn the_workspace_follows_its_dependency_rules() {
    let g = graph(&workspace_metadata());
    let broken = violations(&g);
    assert!(
        broken.is_empty(),
        "dependency rules broken:\n{}",
        broken.join("\n")
    );
    // Every edge crate exists (a rename must update the rules, not silently skip them).
    for c in EDGE_CRATES {
        assert!(g.contains_key(*c), "{c} missing from the workspace");
    }
}

/// The checker itself catches a forbidden edge, direct or transitive: the real graph with
/// one dependency added must fail.
#[test]
fn an_added_forbidden_dependency_is_caught() {
    let real = graph(&workspace_metadata());
    let mut direct = real.clone();
    direct
        .get_mut("waygate-protocol")
        .unwrap()
        .insert("tokio".into());
    let found = violations(&direct);
    assert!(
        found
            .iter()
            .any(|v| v.starts_with("waygate-protocol must not depend on tokio")),
        "{found:?}"
    );
    // Transitive: the backend SDK reaches the edge through the link crate.
    let mut transitive = real;
    transitive
        .get_mut("waygate-link")
        .unwrap()
        .insert("waygate-edge".into());
    let found = violations(&transitive);
    assert!(
        found.iter().any(
            |v| v.starts_with("waygate-backend must not depend on waygate-edge")
                && v.ends_with("waygate-backend -> waygate-link -> waygate-edge")
        ),
        "{found:?}"
    );
}

/// The crates of one package's normal-dependency tree built with `features` (cargo tree
/// resolves the features as that build would).
fn build_tree(package: &str, features: &[&str]) -> BTreeSet<String> {
    let mut args = vec![
        "tree", "--locked", "-e", "normal", "--prefix", "none", "-p", package,
    ];
    args.extend_from_slice(features);
    String::from_utf8_lossy(&cargo_stdout(&args))
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// SDK issue item 8: a game client builds without server-only dependencies (certificate
/// generation, the edge, Redis, etcd, axum), and without QUIC and WebSocket when it leaves
/// out their features: a TCP/TLS/KCP client has neither quinn nor tungstenite.
#[test]
fn client_builds_leave_out_server_code_and_unwanted_transports() {
    let server_only = [
        "rcgen",
        "waygate-edge",
        "redis",
        "etcd-client",
        "axum",
        "clap",
    ];
    for (package, features, also_absent) in [
        ("waygate-client", &[][..], &[][..]),
        ("waygate-client-capi", &[][..], &[][..]),
        (
            "waygate-client",
            &["--no-default-features"][..],
            &["quinn", "tokio-tungstenite", "tungstenite"][..],
        ),
        (
            "waygate-client-capi",
            &["--no-default-features", "--features", "ws"][..],
            &["quinn"][..],
        ),
    ] {
        let tree = build_tree(package, features);
        assert!(tree.contains("waygate-transport"), "{package}: {tree:?}");
        for name in server_only.iter().chain(also_absent) {
            assert!(
                !tree.contains(*name),
                "{package} {features:?} pulls in {name}"
            );
        }
    }
    // And the defaults have every client transport.
    let full = build_tree("waygate-client", &[]);
    assert!(
        full.contains("quinn") && full.contains("tokio-tungstenite"),
        "{full:?}"
    );
}

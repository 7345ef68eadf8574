//! The TypeScript WebSocket client (`client-sdk/js`, written from PROTOCOL.md) in headless
//! Chromium against a real edge: a demo backend process and `waygate run`, both spawned here
//! on loopback ports. The page connects over ws, joins a room, streams 200 ECHO requests and
//! 100 ROOM_SAY messages (whose ROOM_EVENT pushes come back); meanwhile this test drops the
//! player's connection twice from the server side (admin `POST /drop/{player}`: the session
//! lingers) and the client resumes. Then it kicks the player (`POST /kick/{player}`): the
//! client must stop for good. Asserted on the client side: every reply and push exactly once
//! and in order, server seqs 1..N without a hole or a repeat, one new session then restores
//! only, no reconnect after the kick, an RTT sample from PING/PONG. Finally the demo page
//! (`client-sdk/js/demo/`) is clicked through: connect, echo, join a room, say something.
//!
//! A second test runs the package's node unit tests (`node --test test/`: codec against the
//! PROTOCOL.md examples, and the client state machine over a scripted WebSocket).
//!
//! What it needs (it fails with the reason, never skips):
//! - `node` (20+) and `npm` on PATH; `npm ci` runs here when `client-sdk/js/node_modules` is
//!   missing (scripts/test.sh runs it beforehand), then `npm run build` (tsc) every time;
//! - Debian's `/usr/bin/chromium` (or `CHROMIUM=/path`), driven through npm `playwright-core`
//!   (never a browser downloaded by a tool);
//! - the `waygate` binary. Cargo only builds a package's own binaries for its tests, and
//!   this crate does not depend on the edge, so the test runs
//!   `cargo build -p waygate --bin waygate` into its own target directory (a no-op when up to
//!   date, so the binary is never stale) and uses `<target>/<profile>/waygate`.
//!   `WAYGATE_BIN=/path/to/waygate` skips the build and uses that binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdout};
use waygate_interop_tests::run_blocking;

/// Upper bound for the whole browser scenario (the driver bounds itself at 90 s).
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(150);
/// Upper bound for a process to print its ready line.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Echo requests and room messages the page sends.
const ECHOES: u64 = 200;
const SAYS: u64 = 100;
/// Replies received when the test drops the link (mid-stream).
const DROP_AT: [u64; 2] = [50, 130];

fn js_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../client-sdk/js")
}

/// The Cargo target directory holding this test binary (`CACHEDIR.TAG`) and the profile
/// directory (`debug`, `release`) under it.
fn target_and_profile() -> (PathBuf, PathBuf) {
    let exe = std::env::current_exe().expect("current_exe");
    // <target>/<profile>/deps/browser_sdk-<hash>
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary under <target>/<profile>/deps")
        .to_path_buf();
    let target = exe
        .ancestors()
        .skip(1)
        .find(|d| d.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| {
            profile
                .parent()
                .expect("profile directory has a parent")
                .to_path_buf()
        });
    (target, profile)
}

/// The `waygate` binary (see the module docs).
fn waygate_bin() -> &'static Path {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BIN.get_or_init(resolve_waygate) {
        Ok(p) => p,
        Err(e) => panic!("the waygate binary is not available: {e}"),
    }
}

fn resolve_waygate() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("WAYGATE_BIN").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("WAYGATE_BIN={} is not a file", p.display()))
        };
    }
    let (target, profile) = target_and_profile();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
        .args(["build", "-p", "waygate", "--bin", "waygate"])
        .env("CARGO_TARGET_DIR", &target);
    // `cargo test` gives this process the variables Cargo sets for a crate (CARGO_PKG_NAME,
    // CARGO_MANIFEST_DIR, OUT_DIR...). Build scripts (ring's, via cc) rerun when those
    // change, so passing them on would rebuild half the tree here and again in the next
    // outer `cargo test`: the nested build gets a plain environment.
    for (key, _) in std::env::vars_os() {
        let Some(k) = key.to_str() else { continue };
        let crate_var = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
            "CARGO_CFG_",
        ]
        .iter()
        .any(|p| k.starts_with(p))
            || matches!(
                k,
                "OUT_DIR"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "CARGO_RUSTC_CURRENT_DIR"
                    | "CARGO_SBOM_PATH"
            );
        if crate_var {
            cmd.env_remove(&key);
        }
    }
    if profile.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    let out = run_blocking(&mut cmd, Duration::from_secs(900))?;
    if !out.success() {
        return Err(format!(
            "`cargo build -p waygate --bin waygate` failed\n{}",
            out.describe()
        ));
    }
    let bin = profile.join(format!("waygate{}", std::env::consts::EXE_SUFFIX));
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("{} missing after the build", bin.display()))
    }
}

/// Checks node, npm and chromium; installs the npm dev dependencies if missing; builds the
/// package. Once per process.
fn prepare_js() {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    if let Err(e) = READY.get_or_init(build_js) {
        panic!("the JS SDK cannot be tested: {e}");
    }
}

fn build_js() -> Result<(), String> {
    let dir = js_dir();
    let node = run_blocking(
        Command::new("node").arg("--version"),
        Duration::from_secs(30),
    )
    .map_err(|e| {
        format!("node is required (Node.js 20+; Debian: apt-get install nodejs npm): {e}")
    })?;
    if !node.success() {
        return Err(format!("`node --version` failed\n{}", node.describe()));
    }
    let modules = dir.join("node_modules");
    if !modules.join("playwright-core").is_dir() || !modules.join("typescript").is_dir() {
        eprintln!("browser_sdk: npm ci in {}", dir.display());
        let ci = run_blocking(
            Command::new("npm")
                .args(["ci", "--no-audit", "--no-fund"])
                .current_dir(&dir),
            Duration::from_secs(600),
        )
        .map_err(|e| format!("npm is required (Debian: apt-get install npm): {e}"))?;
        if !ci.success() {
            return Err(format!(
                "`npm ci` in {} failed (is the npm registry reachable?)\n{}",
                dir.display(),
                ci.describe()
            ));
        }
    }
    let build = run_blocking(
        Command::new("npm")
            .args(["run", "--silent", "build"])
            .current_dir(&dir),
        Duration::from_secs(300),
    )
    .map_err(|e| format!("npm run build: {e}"))?;
    if !build.success() {
        return Err(format!(
            "`npm run build` (tsc) failed\n{}",
            build.describe()
        ));
    }
    Ok(())
}

fn chromium() -> PathBuf {
    let path = std::env::var_os("CHROMIUM")
        .filter(|p| !p.is_empty())
        .map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from);
    assert!(
        path.is_file(),
        "{} not found: install Debian's chromium (apt-get install chromium; scripts/test.sh \
         does) or set CHROMIUM to a Chromium binary",
        path.display()
    );
    path
}

/// A child process killed when the test ends, with its stderr in a file for failure
/// messages.
struct Proc {
    name: &'static str,
    child: Child,
    stdout: Option<tokio::io::Lines<BufReader<ChildStdout>>>,
    stderr: tempfile::NamedTempFile,
}

impl Proc {
    fn spawn(name: &'static str, cmd: &mut tokio::process::Command) -> Self {
        let stderr = tempfile::NamedTempFile::new().expect("temp file");
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr.reopen().expect("reopen temp file"))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        let stdout = child.stdout.take().map(|s| BufReader::new(s).lines());
        Self {
            name,
            child,
            stdout,
            stderr,
        }
    }

    fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(self.stderr.path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The next stdout line, or a panic with the process's stderr at EOF or the deadline.
    async fn line(&mut self, deadline: Instant) -> String {
        let lines = self.stdout.as_mut().expect("stdout piped");
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) => {
                let status = self.child.wait().await.ok();
                panic!(
                    "{} ended early ({status:?})\n--- stderr ---\n{}",
                    self.name,
                    self.stderr_tail()
                )
            }
            Ok(Err(e)) => panic!("reading {} stdout: {e}", self.name),
            Err(_) => panic!(
                "{} printed nothing expected before its deadline\n--- stderr ---\n{}",
                self.name,
                self.stderr_tail()
            ),
        }
    }
}

/// `POST http://{admin}{path}` with an empty body; returns (status, body).
async fn admin_post(admin: &str, path: &str) -> (u16, String) {
    let io = async {
        let mut s = tokio::net::TcpStream::connect(admin).await?;
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {admin}\r\nX-Waygate-Admin: test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&resp).into_owned())
    };
    let resp = tokio::time::timeout(Duration::from_secs(10), io)
        .await
        .unwrap_or_else(|_| panic!("admin {path} timed out"))
        .unwrap_or_else(|e| panic!("admin {path}: {e}"));
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

/// A demo backend and an edge routing both demo services to it.
struct System {
    _backend: Proc,
    edge: Proc,
    _dir: tempfile::TempDir,
    ws: String,
    admin: String,
}

async fn start_system() -> System {
    let bin = waygate_bin();
    let deadline = Instant::now() + START_TIMEOUT;
    let mut backend = Proc::spawn(
        "waygate backend",
        tokio::process::Command::new(bin).args(["backend", "--addr", "127.0.0.1:0", "--id", "b1"]),
    );
    // {"event":"ready","backend":"127.0.0.1:PORT","id":"b1"}
    let line = backend.line(deadline).await;
    let ready: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|_| panic!("unexpected backend line: {line}"));
    let backend_addr = ready["backend"]
        .as_str()
        .filter(|a| a.starts_with("127.0.0.1:"))
        .unwrap_or_else(|| panic!("unexpected backend line: {line}"))
        .to_string();

    let dir = tempfile::tempdir().expect("temp dir");
    let routes = dir.path().join("routes.toml");
    std::fs::write(
        &routes,
        format!(
            r#"epoch = 1
updated_at = 0

[[services]]
name = "player"
messages = [[1000, 1999]]
key = "player"
  [[services.instances]]
  id = "p1"
  address = "{backend_addr}"

[[services]]
name = "room"
messages = [[2000, 2999]]
key = "room"
  [[services.instances]]
  id = "r1"
  address = "{backend_addr}"
"#
        ),
    )
    .expect("write routes.toml");
    let config = dir.path().join("edge.toml");
    // A short heartbeat so the page gets PING/PONG RTT samples while the test runs.
    std::fs::write(
        &config,
        format!(
            "edge_id = \"edge-browser\"\n\n[routing]\ntable = {:?}\n\n[session]\nheartbeat_ms = 500\n",
            routes.display().to_string()
        ),
    )
    .expect("write edge.toml");
    let mut edge = Proc::spawn(
        "waygate run",
        tokio::process::Command::new(bin)
            .arg("run")
            .arg("--config")
            .arg(&config)
            .arg("--ephemeral-ports"),
    );
    let ready: Value = loop {
        let line = edge.line(deadline).await;
        if line.starts_with("{\"") {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v["event"] == "ready" {
                    break v;
                }
            }
        }
    };
    let ws = ready["listeners"]["ws"]
        .as_str()
        .unwrap_or_else(|| panic!("no ws listener: {ready}"))
        .to_string();
    let admin = ready["admin"]
        .as_str()
        .unwrap_or_else(|| panic!("no admin address: {ready}"))
        .to_string();
    System {
        _backend: backend,
        edge,
        _dir: dir,
        ws,
        admin,
    }
}

fn mint_token(player: &str) -> String {
    let out = run_blocking(
        Command::new(waygate_bin()).args(["token", "--player", player]),
        Duration::from_secs(30),
    )
    .expect("waygate token");
    assert!(out.success(), "waygate token failed\n{}", out.describe());
    out.stdout.trim().to_string()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chromium_client_resumes_after_server_side_drops_with_nothing_lost() {
    let chromium = chromium();
    prepare_js();
    let system = start_system().await;
    let player = format!("js-{:08x}", rand::random::<u32>());
    let token = mint_token(&player);
    let demo_player = format!("{player}-demo");
    let demo_token = mint_token(&demo_player);

    let mut driver = Proc::spawn(
        "node browser-test/run.mjs",
        tokio::process::Command::new("node")
            .current_dir(js_dir())
            .arg("browser-test/run.mjs")
            .args(["--ws", &format!("ws://{}/", system.ws)])
            .args(["--token", &token, "--player", &player])
            .args(["--demo-token", &demo_token])
            .args(["--echo-count", &ECHOES.to_string()])
            .args(["--say-count", &SAYS.to_string()])
            .args(["--interval-ms", "20", "--timeout-ms", "90000"])
            .env("CHROMIUM", &chromium),
    );

    let deadline = Instant::now() + SCENARIO_TIMEOUT;
    let mut dropped_at: Vec<u64> = Vec::new();
    let mut kicked = false;
    let mut last_progress = Value::Null;
    let result: Value = loop {
        let line = driver.line(deadline).await;
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            eprintln!("driver: {line}");
            continue;
        };
        match msg["event"].as_str() {
            Some("progress") => {
                let echo = msg["echo"].as_u64().unwrap_or(0);
                let restored = msg["events"]["restored"].as_u64().unwrap_or(0);
                let n = dropped_at.len();
                // Drop mid-stream; the second drop only once the first one was resumed.
                if n < DROP_AT.len() && echo >= DROP_AT[n] && restored as usize >= n {
                    let (status, body) =
                        admin_post(&system.admin, &format!("/drop/{player}")).await;
                    assert_eq!(status, 200, "drop failed: {body}");
                    eprintln!("browser_sdk: dropped the link at {echo} replies");
                    dropped_at.push(echo);
                }
                last_progress = msg;
            }
            Some("stream_done") => {
                let (status, body) = admin_post(&system.admin, &format!("/kick/{player}")).await;
                assert_eq!(status, 200, "kick failed: {body}");
                kicked = true;
            }
            Some("result") => break msg,
            _ => eprintln!("driver: {line}"),
        }
    };
    let status = tokio::time::timeout(Duration::from_secs(20), driver.child.wait()).await;
    let context = format!(
        "--- driver stderr ---\n{}\n--- edge stderr ---\n{}\n--- last progress ---\n{last_progress}",
        driver.stderr_tail(),
        system.edge.stderr_tail()
    );
    assert_eq!(result["ok"], true, "driver failed: {result}\n{context}");
    assert!(
        matches!(status, Ok(Ok(s)) if s.success()),
        "driver exit: {status:?}\n{context}"
    );
    // Print the record without the long arrays.
    let mut summary = result.clone();
    for k in ["echoReceived", "roomReceived", "serverSeqs", "log", "demo"] {
        summary.as_object_mut().map(|o| o.remove(k));
    }
    eprintln!("browser_sdk: dropped at {dropped_at:?} replies; {summary}");

    // Both drops happened mid-stream and were resumed.
    assert_eq!(
        dropped_at.len(),
        DROP_AT.len(),
        "not every drop happened: {result}\n{context}"
    );
    assert!(
        dropped_at.iter().all(|&e| e < ECHOES),
        "a drop came after the stream: {dropped_at:?}"
    );
    assert!(kicked, "the stream never completed");

    // 0 lost, 0 duplicated, in order: replies to echo-0..echo-199 and room events 1..=100.
    let echo = u64s(&result["echoReceived"]);
    assert_eq!(
        echo,
        (0..ECHOES).collect::<Vec<_>>(),
        "echo replies lost, duplicated or out of order\n{context}"
    );
    let room = u64s(&result["roomReceived"]);
    assert_eq!(
        room,
        (1..=SAYS).collect::<Vec<_>>(),
        "room events lost, duplicated or out of order\n{context}"
    );
    // Every sequenced message exactly once: JOINED + replies + room events.
    let seqs = u64s(&result["serverSeqs"]);
    assert_eq!(
        seqs,
        (1..=1 + ECHOES + SAYS).collect::<Vec<_>>(),
        "server seqs delivered with a hole or a repeat\n{context}"
    );
    assert_eq!(result["echoBadPayload"], serde_json::json!([]), "{result}");
    assert_eq!(result["roomBadPayload"], serde_json::json!([]), "{result}");
    // Channels (PROTOCOL.md §12): CHANNEL_JOIN "world" gives JOINED, then the browser's CHAT
    // comes back as the publication right after it, with its body.
    let channel = &result["channel"];
    assert_eq!(channel["ok"], true, "channel step: {channel}");
    assert_eq!(channel["problems"], serde_json::json!([]), "{channel}");
    assert_eq!(
        channel["publication"]["body"],
        format!("{player}|hello from the browser"),
        "{channel}"
    );
    assert_eq!(
        channel["publication"]["offset"].as_u64(),
        channel["joined"]["offset"].as_u64().map(|o| o + 1),
        "{channel}"
    );
    assert_eq!(channel["duplicates"], 0, "{channel}");
    assert_eq!(
        result["errors"],
        serde_json::json!([]),
        "client errors\n{context}"
    );

    // One new session, then restores only (no gap), and the kick ends it for good.
    let events = &result["events"];
    assert_eq!(events["newSession"], 1, "{result}");
    assert_eq!(events["restoredWithGap"], 0, "{result}");
    let restored = events["restored"].as_u64().unwrap_or(0);
    assert!(
        restored >= DROP_AT.len() as u64,
        "expected a restore per drop: {result}"
    );
    assert_eq!(events["kicked"], 1, "kicked event missing: {result}");
    assert_eq!(events["closed"], 1, "{result}");
    assert_eq!(result["state"], "closed", "{result}");
    let connects = result["connects"].as_u64().unwrap_or(0);
    assert_eq!(connects, 1 + restored, "{result}");
    assert_eq!(
        result["connectsAtClose"].as_u64(),
        Some(connects),
        "the client reconnected after the kick: {result}"
    );
    assert!(
        result["msSinceClosed"].as_f64().unwrap_or(0.0) >= 1000.0,
        "{result}"
    );
    assert_eq!(result["unacked"], 0, "{result}");
    assert!(
        result["rtt"]["samples"].as_u64().unwrap_or(0) >= 1,
        "no RTT sample from PING/PONG: {result}"
    );

    // The demo page: connect, echo, join a room, say something.
    let demo = result["demo"].as_str().unwrap_or_default();
    for needle in [
        "connected to",
        &format!("<- ECHO_REPLY #1: b1|{demo_player}|hello"),
        "<- JOINED #2: lobby",
        &format!("<- ROOM_EVENT #3: b1|lobby|1|{demo_player}|hi all"),
    ] {
        assert!(
            demo.contains(needle),
            "demo page log lacks {needle:?}:\n{demo}"
        );
    }
}

#[test]
fn js_unit_tests_pass_in_node() {
    prepare_js();
    let out = run_blocking(
        Command::new("node")
            .args(["--test", "test/"])
            .current_dir(js_dir()),
        Duration::from_secs(120),
    )
    .expect("node --test");
    assert!(
        out.success(),
        "node --test failed in client-sdk/js\n{}",
        out.describe()
    );
    let pass = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("# pass "))
        .and_then(|n| n.trim().parse::<u32>().ok())
        .unwrap_or(0);
    assert!(pass >= 10, "too few node tests ran:\n{}", out.stdout);
}

/// The Unity WebGL bridge (`client-sdk/unity-webgl/Plugins/WaygateWebGL.jslib`) in headless
/// Chromium (SDK issue item 8): the SDK loaded through its browser global, the bridge's
/// poll model, a resume proof computed with the browser's WebCrypto (no edge, no Unity).
#[test]
fn unity_webgl_bridge_works_in_chromium() {
    let chromium = chromium();
    prepare_js();
    let out = run_blocking(
        Command::new("node")
            .arg("browser-test/webgl-bridge.mjs")
            .env("CHROMIUM", &chromium)
            .current_dir(js_dir()),
        Duration::from_secs(120),
    )
    .expect("node browser-test/webgl-bridge.mjs");
    assert!(
        out.success(),
        "the WebGL bridge failed in Chromium\n{}",
        out.describe()
    );
}

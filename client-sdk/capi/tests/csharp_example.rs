//! The C# binding for real: compiles `client-sdk/csharp/Waygate.cs` and
//! `client-sdk/csharp/examples/Echo.cs` with Mono's `mcs`, then runs the program with `mono`
//! against the cdylib cargo built for this test run and an in-process edge and demo backend
//! on every transport (loopback only). The program connects, sends echo requests, drops its
//! link half way, and checks that every reply arrives exactly once and in order after the
//! resume: the same checks as `examples/echo.c` (`tests/c_example.rs`), through P/Invoke.
//! Then it sends one request (ASK, 1011) and takes one clock sample (TIME, 1010) through
//! `waygate_client_request` / `waygate_client_sync_clock` / `waygate_client_clock_offset`,
//! and prints the answer and the offset.
//!
//! Needs `mcs` and `mono` on PATH (Debian: `apt-get install --no-install-recommends
//! mono-mcs`, which pulls in the runtime; scripts/test.sh installs it).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{cluster, token};
use waygate_transport::TransportKind;

/// How long one run of the C# program may take.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// The directory holding the cdylib cargo built with this crate's lib for this test run.
fn cdylib_dir() -> PathBuf {
    common::built_library("libwaygate_client_capi.so")
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Panics with what to install unless `tool` runs (`mcs --version`, `mono --version`).
fn require(tool: &str) {
    let found = Command::new(tool)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "`{tool}` is not on PATH: this test compiles and runs the C# binding with Mono; \
         install Debian's mono-mcs (`apt-get install --no-install-recommends mono-mcs`, \
         which pulls in the mono runtime; scripts/test.sh does)"
    );
}

/// Compiles the binding and Echo.cs into `out_dir/Echo.exe`.
fn compile_echo(out_dir: &Path) -> PathBuf {
    require("mcs");
    require("mono");
    let csharp = Path::new(env!("CARGO_MANIFEST_DIR")).join("../csharp");
    let exe = out_dir.join("Echo.exe");
    let output = Command::new("mcs")
        .args(["-warn:4", "-warnaserror+", "-optimize+"])
        .arg(format!("-out:{}", exe.display()))
        .arg(csharp.join("Waygate.cs"))
        .arg(csharp.join("examples/Echo.cs"))
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run mcs: {e}"));
    assert!(
        output.status.success(),
        "compiling Waygate.cs + Echo.cs with mcs failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

/// Runs `mono exe args` with `lib_dir` first on `LD_LIBRARY_PATH` (where P/Invoke's
/// `DllImport("waygate_client_capi")` finds `libwaygate_client_capi.so`), with a time limit
/// (killed past it); returns (success, stdout, stderr).
fn run(
    exe: &Path,
    args: &[String],
    lib_dir: &Path,
    dir: &Path,
    name: &str,
) -> (bool, String, String) {
    let mut paths = vec![lib_dir.to_path_buf()];
    if let Some(existing) = std::env::var_os("LD_LIBRARY_PATH") {
        paths.extend(std::env::split_paths(&existing));
    }
    let mut cmd = Command::new("mono");
    cmd.arg(exe)
        .args(args)
        .env("LD_LIBRARY_PATH", std::env::join_paths(paths).unwrap());
    common::run_limited(&mut cmd, dir, name, RUN_LIMIT)
}

#[test]
fn csharp_echo_example_resumes_without_loss_on_every_transport() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_echo(dir.path());
    let lib_dir = cdylib_dir();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let c = rt.block_on(cluster(dir.path()));

    for kind in TransportKind::ALL {
        let endpoint = common::endpoint_url(&c, kind);
        let player = format!("cs-player-{}", kind.as_str());
        let args = vec![
            endpoint.clone(),
            token(&player),
            player.clone(),
            c.ca_file.display().to_string(),
            "40".into(),
        ];
        let (ok, stdout, stderr) = run(&exe, &args, &lib_dir, dir.path(), kind.as_str());
        assert!(
            ok,
            "Echo.cs failed on {endpoint}\n--- stdout\n{stdout}--- stderr\n{stderr}"
        );
        assert!(
            stdout.contains("echo: OK: 40 replies exactly once and in order from b1"),
            "{endpoint}: {stdout}"
        );
        assert!(
            stdout.contains("session restored over"),
            "{endpoint}: {stdout}"
        );
        assert!(
            stdout.contains(&format!("echo: request answered: b1|{player}|why")),
            "{endpoint}: {stdout}"
        );
        assert!(
            stdout.contains("echo: clock offset "),
            "{endpoint}: {stdout}"
        );
    }

    // A bad token ends the client with a clear event, and the program reports it.
    let tcp = c.edge.addrs[&TransportKind::Tcp];
    let args = vec![
        format!("tcp://{tcp}"),
        "AAAA".into(),
        "nobody".into(),
        "-".into(),
    ];
    let (ok, stdout, stderr) = run(&exe, &args, &lib_dir, dir.path(), "bad-token");
    assert!(!ok, "a bad token must fail: {stdout}");
    assert!(
        stderr.contains("client closed while waiting for connected"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("auth_"),
        "the close code is named: {stdout}"
    );
}

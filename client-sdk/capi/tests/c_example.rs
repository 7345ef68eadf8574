//! The C example for real: compiles `examples/echo.c` with the system C compiler against
//! `include/waygate.h` and the staticlib cargo built for this test run, then runs it
//! against an in-process edge and demo backend on every transport (loopback only). The
//! program connects, sends echo requests, drops its link half way, and checks that every
//! reply arrives exactly once and in order after the resume.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{cluster, token};
use waygate_transport::TransportKind;

/// How long one run of the C program may take.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// Native libraries a Rust staticlib needs on Linux (`cargo rustc -p waygate-client-capi
/// --crate-type staticlib -- --print native-static-libs`).
const NATIVE_LIBS: &[&str] = &[
    "-lgcc_s",
    "-lutil",
    "-lrt",
    "-lpthread",
    "-lm",
    "-ldl",
    "-lc",
];

fn staticlib() -> PathBuf {
    common::built_library("libwaygate_client_capi.a")
}

/// Compiles echo.c: statically linked against the staticlib, or (`dynamic`) against the
/// cdylib next to it, found at run time through an rpath.
fn compile_echo(out_dir: &Path, dynamic: bool) -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = staticlib();
    let exe = out_dir.join(if dynamic { "echo-dyn" } else { "echo" });
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut cmd = Command::new(&cc);
    cmd.args([
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-pedantic",
        "-O1",
    ])
    .arg("-I")
    .arg(crate_dir.join("include"))
    .arg(crate_dir.join("examples/echo.c"));
    if dynamic {
        let dir = lib.parent().unwrap();
        assert!(
            dir.join("libwaygate_client_capi.so").exists(),
            "no cdylib in {dir:?}"
        );
        cmd.arg(format!("-L{}", dir.display()))
            .arg(format!("-Wl,-rpath,{}", dir.display()))
            .arg("-lwaygate_client_capi");
    } else {
        cmd.arg(&lib).args(NATIVE_LIBS);
    }
    let output = cmd
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(
        output.status.success(),
        "compiling echo.c failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

/// Runs the program with a time limit (killed past it); returns (success, stdout, stderr).
fn run(exe: &Path, args: &[String], dir: &Path, name: &str) -> (bool, String, String) {
    common::run_limited(Command::new(exe).args(args), dir, name, RUN_LIMIT)
}

#[test]
fn c_echo_example_resumes_without_loss_on_every_transport() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_echo(dir.path(), false);
    let exe_dyn = compile_echo(dir.path(), true);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let c = rt.block_on(cluster(dir.path()));

    for kind in TransportKind::ALL {
        let endpoint = common::endpoint_url(&c, kind);
        let player = format!("c-player-{}", kind.as_str());
        let args = vec![
            endpoint.clone(),
            token(&player),
            player.clone(),
            c.ca_file.display().to_string(),
            "40".into(),
        ];
        let (ok, stdout, stderr) = run(&exe, &args, dir.path(), kind.as_str());
        assert!(
            ok,
            "echo.c failed on {endpoint}\n--- stdout\n{stdout}--- stderr\n{stderr}"
        );
        assert!(
            stdout.contains("echo: OK: 40 replies exactly once and in order from b1"),
            "{endpoint}: {stdout}"
        );
        assert!(
            stdout.contains("session restored over"),
            "{endpoint}: {stdout}"
        );
    }

    // The same program linked against the cdylib.
    let tcp = c.edge.addrs[&TransportKind::Tcp];
    let args = vec![
        format!("tcp://{tcp}"),
        token("c-player-dyn"),
        "c-player-dyn".into(),
        "-".into(),
        "10".into(),
    ];
    let (ok, stdout, stderr) = run(&exe_dyn, &args, dir.path(), "dynamic");
    assert!(
        ok,
        "echo-dyn failed\n--- stdout\n{stdout}--- stderr\n{stderr}"
    );
    assert!(stdout.contains("echo: OK: 10 replies"), "{stdout}");

    // A bad token ends the client with a clear event, and the program reports it.
    let args = vec![
        format!("tcp://{tcp}"),
        "AAAA".into(),
        "nobody".into(),
        "-".into(),
    ];
    let (ok, stdout, stderr) = run(&exe, &args, dir.path(), "bad-token");
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

//! # waygate-interop-tests
//!
//! Cross-crate and multi-process tests over real loopback sockets: waygate's own clients and
//! independent peers (Python's `websockets`, `aioquic`, the C-ikcp `kcp` package) against
//! waygate's listeners. The library part holds the shared test harness.
//!
//! ## The Python peers
//!
//! `python/waygate_peer.py` is a client written from PROTOCOL.md alone. It needs an
//! interpreter with the pinned packages of `python/requirements.txt`:
//!
//! - if `WAYGATE_PYTHON` is set, that interpreter is used as it is (nothing is created);
//! - otherwise a venv is created once under the Cargo target directory
//!   (`target/waygate-interop-venv`), guarded by a lock directory so concurrent test
//!   processes build it once, and rebuilt when `requirements.txt` changes.
//!
//! Either way the packages are imported once before any test runs; if Python, venv or pip
//! cannot work the tests fail with the reason. They never skip.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

use tokio::task::JoinHandle;
use waygate_transport::BoxListener;

/// Environment variable naming a ready interpreter (with the pinned packages installed).
pub const PYTHON_ENV: &str = "WAYGATE_PYTHON";
/// Interpreter used to create the venv when [`PYTHON_ENV`] is not set.
pub const BOOTSTRAP_PYTHON: &str = "python3";
/// The modules every peer needs.
const REQUIRED_MODULES: &str = "import aioquic, websockets, kcp";
/// Longest time creating the venv and installing the packages may take.
const VENV_TIMEOUT: Duration = Duration::from_secs(600);
/// A lock directory older than this is left over from a killed process.
const STALE_LOCK: Duration = Duration::from_secs(900);

/// The folder holding the Python peers and `requirements.txt`.
pub fn python_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python")
}

/// The interpreter to run peers with: `WAYGATE_PYTHON`, or the venv this harness creates
/// (once per process; other processes wait on a lock). Panics with the reason if neither
/// works.
pub fn python() -> &'static Path {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match PYTHON.get_or_init(resolve_python) {
        Ok(p) => p,
        Err(e) => panic!("the Python interop peers cannot run: {e}"),
    }
}

fn resolve_python() -> Result<PathBuf, String> {
    let python = match std::env::var_os(PYTHON_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => ensure_venv(&target_dir().join("waygate-interop-venv"))?,
    };
    let check = run_blocking(
        Command::new(&python).args(["-c", REQUIRED_MODULES]),
        Duration::from_secs(60),
    )
    .map_err(|e| format!("{}: {e}", python.display()))?;
    if !check.success() {
        return Err(format!(
            "{} cannot import the peers' packages ({REQUIRED_MODULES}); install {}\n{}",
            python.display(),
            python_dir().join("requirements.txt").display(),
            check.describe()
        ));
    }
    Ok(python)
}

/// The Cargo target directory of this test binary: the nearest ancestor of the executable
/// holding Cargo's `CACHEDIR.TAG`, else `<workspace>/target`.
fn target_dir() -> PathBuf {
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe
            .ancestors()
            .skip(1)
            .find(|d| d.join("CACHEDIR.TAG").is_file())
        {
            return dir.to_path_buf();
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target")
}

fn venv_python(venv: &Path) -> PathBuf {
    if cfg!(windows) {
        venv.join("Scripts").join("python.exe")
    } else {
        venv.join("bin").join("python")
    }
}

/// Creates `venv` with the pinned requirements unless it already holds exactly them.
fn ensure_venv(venv: &Path) -> Result<PathBuf, String> {
    let req_path = python_dir().join("requirements.txt");
    let requirements = fs::read_to_string(&req_path)
        .map_err(|e| format!("reading {}: {e}", req_path.display()))?;
    let stamp = venv.join("waygate-requirements.txt");
    let python = venv_python(venv);
    let ready = || python.is_file() && fs::read_to_string(&stamp).is_ok_and(|s| s == requirements);
    if ready() {
        return Ok(python);
    }
    let parent = venv
        .parent()
        .ok_or_else(|| format!("{} has no parent", venv.display()))?;
    fs::create_dir_all(parent).map_err(|e| format!("creating {}: {e}", parent.display()))?;
    let _lock = DirLock::acquire(&venv.with_extension("lock"))?;
    if ready() {
        return Ok(python);
    }
    if venv.exists() {
        fs::remove_dir_all(venv).map_err(|e| format!("removing {}: {e}", venv.display()))?;
    }
    eprintln!(
        "interop: creating the Python venv {} from {}",
        venv.display(),
        req_path.display()
    );
    let made = run_blocking(
        Command::new(BOOTSTRAP_PYTHON)
            .args(["-m", "venv"])
            .arg(venv),
        VENV_TIMEOUT,
    )
    .map_err(|e| {
        format!("`{BOOTSTRAP_PYTHON} -m venv` could not run ({e}); install Python 3 with venv, or set {PYTHON_ENV}")
    })?;
    if !made.success() {
        return Err(format!(
            "`{BOOTSTRAP_PYTHON} -m venv {}` failed (Debian: apt-get install python3-venv)\n{}",
            venv.display(),
            made.describe()
        ));
    }
    let pip = run_blocking(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--no-input",
                "-r",
            ])
            .arg(&req_path),
        VENV_TIMEOUT,
    )
    .map_err(|e| format!("pip could not run: {e}"))?;
    if !pip.success() {
        return Err(format!(
            "pip install -r {} failed (is PyPI reachable?)\n{}",
            req_path.display(),
            pip.describe()
        ));
    }
    fs::write(&stamp, &requirements).map_err(|e| format!("writing {}: {e}", stamp.display()))?;
    Ok(python)
}

/// A lock held by creating a directory (atomic on every platform); removed on drop.
struct DirLock(PathBuf);

impl DirLock {
    fn acquire(path: &Path) -> Result<Self, String> {
        let deadline = Instant::now() + VENV_TIMEOUT + Duration::from_secs(60);
        loop {
            match fs::create_dir(path) {
                Ok(()) => return Ok(Self(path.to_path_buf())),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let stale = fs::metadata(path)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| SystemTime::now().duration_since(t).ok())
                        .is_some_and(|age| age > STALE_LOCK);
                    if stale {
                        let _ = fs::remove_dir(path);
                        continue;
                    }
                    if Instant::now() > deadline {
                        return Err(format!(
                            "gave up waiting for the lock {} (remove it if no test is running)",
                            path.display()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => return Err(format!("creating lock {}: {e}", path.display())),
            }
        }
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.0);
    }
}

/// What a finished (or killed) child process left.
#[derive(Debug)]
pub struct ProcessOutput {
    /// Exit status; `None` when it was killed at its deadline.
    pub status: Option<ExitStatus>,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
}

impl ProcessOutput {
    /// Whether the process exited with status 0.
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// Status, stdout and stderr, for a failure message.
    pub fn describe(&self) -> String {
        let status = match self.status {
            Some(s) => s.to_string(),
            None => "killed at its deadline".to_string(),
        };
        format!(
            "status: {status}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.stdout.trim_end(),
            self.stderr.trim_end()
        )
    }

    /// The last stdout line that parses as a JSON object (the peers' result line).
    pub fn json_result(&self) -> Option<serde_json::Value> {
        self.stdout
            .lines()
            .rev()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok())
            .find(|v| v.is_object())
    }
}

/// Output files a child writes to (pipes could fill up and block it).
struct Capture {
    dir: tempfile::TempDir,
}

impl Capture {
    fn new() -> Result<Self, String> {
        Ok(Self {
            dir: tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?,
        })
    }

    fn stdio(&self) -> Result<(Stdio, Stdio), String> {
        let open = |name: &str| {
            fs::File::create(self.dir.path().join(name))
                .map(Stdio::from)
                .map_err(|e| format!("capture file: {e}"))
        };
        Ok((open("stdout")?, open("stderr")?))
    }

    fn finish(&self, status: Option<ExitStatus>) -> ProcessOutput {
        let read = |name: &str| {
            let bytes = fs::read(self.dir.path().join(name)).unwrap_or_default();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        ProcessOutput {
            status,
            stdout: read("stdout"),
            stderr: read("stderr"),
        }
    }
}

/// Runs `cmd` to completion or until `timeout` (then kills it), capturing its output.
pub fn run_blocking(cmd: &mut Command, timeout: Duration) -> Result<ProcessOutput, String> {
    let capture = Capture::new()?;
    let (out, err) = capture.stdio()?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("spawning {:?}: {e}", cmd.get_program()))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for {:?}: {e}", cmd.get_program())),
        }
    };
    Ok(capture.finish(status))
}

/// Runs the Python script `script` (a file of [`python_dir`]) with `args` under
/// [`python()`], for at most `timeout`; the child is killed at the deadline.
pub async fn run_python<S: AsRef<OsStr>>(
    script: &str,
    args: &[S],
    timeout: Duration,
) -> ProcessOutput {
    let python = python();
    let capture = Capture::new().unwrap_or_else(|e| panic!("{e}"));
    let (out, err) = capture.stdio().unwrap_or_else(|e| panic!("{e}"));
    let mut child = tokio::process::Command::new(python)
        .arg(python_dir().join(script))
        .args(args)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {} {script}: {e}", python.display()));
    let status = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => Some(status),
        Ok(Err(e)) => panic!("waiting for {script}: {e}"),
        Err(_) => {
            let _ = child.kill().await;
            None
        }
    };
    capture.finish(status)
}

/// Runs a peer script and returns its JSON result line; panics with the whole output unless
/// it exited 0 and printed a result whose `ok` is true.
pub async fn run_peer<S: AsRef<OsStr>>(
    script: &str,
    args: &[S],
    timeout: Duration,
) -> serde_json::Value {
    let output = run_python(script, args, timeout).await;
    let result = output.json_result();
    let ok = result
        .as_ref()
        .and_then(|v| v.get("ok"))
        .and_then(serde_json::Value::as_bool)
        == Some(true);
    if !output.success() || !ok {
        panic!("peer {script} failed\n{}", output.describe());
    }
    if !output.stderr.trim().is_empty() {
        eprintln!("peer {script} stderr:\n{}", output.stderr.trim_end());
    }
    result.unwrap_or_default()
}

/// Spawns a server that echoes every frame back on the connection it came from, until that
/// connection ends (a CLOSE from the peer ends it; a bad frame makes the transport answer
/// CLOSE with its code). Abort the task to stop.
pub fn spawn_echo_server(mut listener: BoxListener) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(mut conn) = listener.accept().await {
            // An echo plays a session past its WELCOME: full-size frames from the start.
            conn.handshake_done();
            tokio::spawn(async move {
                loop {
                    match conn.recv().await {
                        Ok(frame) => {
                            if conn.send(&frame).await.is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            tracing::debug!(conn = %conn.info().id, error = %e, "echo connection ended");
                            break;
                        }
                    }
                }
            });
        }
    })
}

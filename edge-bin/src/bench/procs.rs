//! Child processes of a bench run (edge, backends, echo servers, HAProxy, busy loops), CPU
//! pinning with `taskset`, and the per-process figures read from `/proc`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process, killed (by its own pid) when dropped.
#[derive(Debug)]
pub struct Proc {
    /// What it is (logs).
    pub name: String,
    child: Child,
}

impl Proc {
    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the child is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGTERM-like stop by pid only; the child is ours.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Builds `taskset -c CPU program args...` (or the plain command without a CPU).
pub fn pinned(cpu: Option<usize>, program: &Path, args: &[String]) -> Command {
    match cpu {
        Some(c) => {
            let mut cmd = Command::new("taskset");
            cmd.arg("-c").arg(c.to_string()).arg(program).args(args);
            cmd
        }
        None => {
            let mut cmd = Command::new(program);
            cmd.args(args);
            cmd
        }
    }
}

/// Starts `cmd` and waits (up to 20 s) for a stdout line holding `"event":"ready"`;
/// returns the process and the parsed line. Stderr goes to `log`.
pub fn spawn_ready(
    name: &str,
    mut cmd: Command,
    log: &Path,
) -> Result<(Proc, serde_json::Value), String> {
    let err = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    cmd.stdout(Stdio::piped()).stderr(err).stdin(Stdio::null());
    let mut child = cmd.spawn().map_err(|e| format!("starting {name}: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap_or(0) > 0 {
            if line.contains("\"event\":\"ready\"") {
                let _ = tx.send(line.clone());
            }
            line.clear();
        }
    });
    let proc = Proc {
        name: name.to_string(),
        child,
    };
    let line = rx
        .recv_timeout(Duration::from_secs(20))
        .map_err(|_| format!("{name} did not get ready (see {})", log.display()))?;
    let value = serde_json::from_str(&line).map_err(|e| format!("{name} ready line: {e}"))?;
    Ok((proc, value))
}

/// Starts a process that prints nothing (HAProxy, busy loops) and gives it `settle` to start.
pub fn spawn_quiet(
    name: &str,
    mut cmd: Command,
    log: &Path,
    settle: Duration,
) -> Result<Proc, String> {
    let err = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    cmd.stdout(Stdio::null()).stderr(err).stdin(Stdio::null());
    let child = cmd.spawn().map_err(|e| format!("starting {name}: {e}"))?;
    let mut proc = Proc {
        name: name.to_string(),
        child,
    };
    std::thread::sleep(settle);
    if !proc.alive() {
        return Err(format!("{name} exited at start (see {})", log.display()));
    }
    Ok(proc)
}

/// A SCHED_IDLE busy loop on `cpu` (keeps the VM's vCPU from sleeping during latency runs).
pub fn busy_loop(cpu: usize, dir: &Path) -> Result<Proc, String> {
    let mut cmd = Command::new("chrt");
    cmd.args(["-i", "0", "taskset", "-c", &cpu.to_string()])
        .args(["sh", "-c", "while :; do :; done"]);
    spawn_quiet(
        &format!("busy{cpu}"),
        cmd,
        &dir.join(format!("busy{cpu}.log")),
        Duration::from_millis(50),
    )
}

/// Writes an HAProxy `mode tcp` config forwarding `listen` to `server` and starts it
/// (foreground, one thread) pinned to `cpu`.
pub fn haproxy(
    cpu: Option<usize>,
    listen_port: u16,
    server: std::net::SocketAddr,
    dir: &Path,
) -> Result<Proc, String> {
    let cfg = dir.join("haproxy.cfg");
    let text = format!(
        "global\n  nbthread 1\n  maxconn 9000\n\
         defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 120s\n  timeout server 120s\n\
         frontend fe\n  bind 127.0.0.1:{listen_port}\n  default_backend be\n\
         backend be\n  server echo {server}\n"
    );
    std::fs::write(&cfg, text).map_err(|e| e.to_string())?;
    let program = which("haproxy").ok_or("haproxy not installed (scripts/bench.sh installs it)")?;
    let args = vec!["-db".to_string(), "-f".into(), cfg.display().to_string()];
    spawn_quiet(
        "haproxy",
        pinned(cpu, &program, &args),
        &dir.join("haproxy.log"),
        Duration::from_millis(300),
    )
}

/// Finds `name` on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A free loopback TCP port (bound and released at once).
pub fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// CPU time (user + system) of a process, in microseconds.
pub fn cpu_us(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state): utime is field 14, stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    let hz = clock_ticks();
    Some((utime + stime) * 1_000_000 / hz)
}

fn clock_ticks() -> u64 {
    static HZ: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *HZ.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .filter(|&h| h > 0)
            .unwrap_or(100)
    })
}

/// Resident set size of a process, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The 1-minute load average.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// A stopwatch of a process's CPU.
#[derive(Debug, Clone, Copy)]
pub struct CpuMark {
    at: Instant,
    sut: Option<u64>,
    own: Option<u64>,
}

impl CpuMark {
    /// Reads the CPU of `sut` (if any) and of this process now.
    pub fn now(sut: Option<u32>) -> Self {
        Self {
            at: Instant::now(),
            sut: sut.and_then(cpu_us),
            own: cpu_us(std::process::id()),
        }
    }

    /// (elapsed, SUT CPU us, own CPU us) since `self`.
    pub fn since(&self, later: &CpuMark) -> (Duration, Option<u64>, Option<u64>) {
        (
            later.at.duration_since(self.at),
            later.sut.zip(self.sut).map(|(b, a)| b.saturating_sub(a)),
            later.own.zip(self.own).map(|(b, a)| b.saturating_sub(a)),
        )
    }
}

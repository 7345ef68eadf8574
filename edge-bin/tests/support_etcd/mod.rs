//! Test harness: a real `etcd` process (3.4, Debian `etcd-server`) on free loopback ports
//! in a temporary data dir, killed on drop. It can be stopped and started again on the same
//! ports and data dir ("etcd down" tests). A missing binary FAILS the test with a clear
//! message; it never skips.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running (or stopped) etcd member.
pub struct EtcdServer {
    bin: PathBuf,
    client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// Extra command-line arguments, on every (re)start.
    extra: Vec<String>,
    /// `https` when clients speak TLS (then `/health` is read from the plain metrics port).
    scheme: &'static str,
    metrics_port: u16,
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port");
    l.local_addr().expect("local addr").port()
}

fn find_etcd() -> PathBuf {
    if let Some(p) = std::env::var_os("WAYGATE_ETCD_BIN") {
        return PathBuf::from(p);
    }
    for dir in std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/bin", "/usr/local/bin"])
    {
        let p = PathBuf::from(dir).join("etcd");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "the `etcd` binary was not found (PATH, /usr/bin, or $WAYGATE_ETCD_BIN). These tests need a \
         real etcd 3.4: `apt-get install etcd-server etcd-client` (scripts/test.sh installs it)."
    );
}

impl EtcdServer {
    /// Starts etcd and waits until it answers `/health`.
    pub fn start() -> Self {
        Self::start_with_args(&[])
    }

    /// [`EtcdServer::start`] with extra command-line arguments (kept for restarts).
    pub fn start_with_args(extra: &[&str]) -> Self {
        let bin = find_etcd();
        let mut s = Self {
            bin,
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
            child: None,
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            scheme: "http",
            metrics_port: free_port(),
        };
        s.spawn();
        s
    }

    /// etcd serving its clients over TLS with the PEM `cert` and `key` (the name in `cert`
    /// must be `localhost` or 127.0.0.1); with `client_ca`, it also requires a client
    /// certificate issued by it (`--client-cert-auth`).
    pub fn start_tls(
        cert: &std::path::Path,
        key: &std::path::Path,
        client_ca: Option<&std::path::Path>,
    ) -> Self {
        let mut extra = vec![
            "--cert-file".to_owned(),
            cert.display().to_string(),
            "--key-file".to_owned(),
            key.display().to_string(),
        ];
        if let Some(ca) = client_ca {
            extra.extend([
                "--client-cert-auth".to_owned(),
                "--trusted-ca-file".to_owned(),
                ca.display().to_string(),
            ]);
        }
        let mut s = Self {
            bin: find_etcd(),
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::tempdir().expect("temp dir"),
            child: None,
            extra,
            scheme: "https",
            metrics_port: free_port(),
        };
        s.spawn();
        s
    }

    /// `http://127.0.0.1:PORT` (`https://localhost:PORT` with TLS).
    pub fn endpoint(&self) -> String {
        match self.scheme {
            "https" => format!("https://localhost:{}", self.client_port),
            _ => format!("http://127.0.0.1:{}", self.client_port),
        }
    }

    /// The endpoints list for clients.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint()]
    }

    /// A scratch dir that lives as long as the server (for persisted tables).
    pub fn scratch(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    fn spawn(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let client = format!("{}://127.0.0.1:{}", self.scheme, self.client_port);
        let metrics = format!("http://127.0.0.1:{}", self.metrics_port);
        let log = std::fs::File::create(self.dir.path().join("etcd.log")).expect("etcd log file");
        let child = Command::new(&self.bin)
            .args(["--name", "t"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("t={peer}")])
            .args(["--listen-metrics-urls", &metrics])
            .args(["--log-level", "warn", "--logger", "zap"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {}: {e}", self.bin.display()));
        self.child = Some(child);
        self.wait_healthy(Duration::from_secs(20));
    }

    fn healthy(&self) -> bool {
        let Ok(mut s) = TcpStream::connect_timeout(
            &([127, 0, 0, 1], self.metrics_port).into(),
            Duration::from_millis(200),
        ) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .is_err()
        {
            return false;
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.contains("\"health\":\"true\"")
    }

    fn wait_healthy(&mut self, limit: Duration) {
        let t0 = Instant::now();
        while !self.healthy() {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    let log = std::fs::read_to_string(self.dir.path().join("etcd.log"))
                        .unwrap_or_default();
                    panic!("etcd exited at start ({status}); log:\n{log}");
                }
            }
            assert!(
                t0.elapsed() < limit,
                "etcd did not become healthy within {limit:?} on port {}",
                self.client_port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills etcd (SIGKILL) and waits for it to exit; ports and data dir are kept.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes etcd (SIGSTOP): its connections stay open and unanswered, a hung etcd.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused etcd (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill {sig} {pid}");
    }

    /// Starts etcd again on the same ports and data dir.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Whether the process is running.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

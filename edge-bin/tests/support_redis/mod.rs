//! Test harness: a real `redis-server` on a free loopback port, killed on drop, able to stop
//! and restart on the same port. Fails (never skips) when the binary is missing.

#![allow(dead_code, unreachable_pub)]

pub mod cluster;
pub mod sentinel;

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running (or stopped) redis-server owned by a test.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    /// Its working directory: a replica's full sync writes an RDB file there (it wrote
    /// `dump.rdb` into the test's directory, which is the repository).
    dir: tempfile::TempDir,
}

fn binary() -> String {
    std::env::var("WAYGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn ping(port: u16) -> bool {
    let Ok(mut s) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200))
    else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl RedisServer {
    /// A server on `port` that is not running yet ([`RedisServer::start_with`]).
    pub fn unstarted(port: u16) -> Self {
        Self {
            port,
            child: None,
            dir: tempfile::tempdir().expect("a temp dir"),
        }
    }

    /// Starts it with extra arguments; false when it exited (port taken?) or never
    /// answered PING within 10 s.
    pub fn start_with(&mut self, extra: &[String]) -> bool {
        self.try_start_with(extra)
    }

    /// Whether the process is running (not killed by [`RedisServer::stop`]).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts redis-server on a free port and waits until it answers PING.
    pub fn start() -> Self {
        for _ in 0..5 {
            let mut s = Self::unstarted(free_port());
            if s.try_start() {
                return s;
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    /// Starts redis-server with extra arguments on a free port and waits until it
    /// answers PING.
    pub fn start_with_args(extra: &[String]) -> Self {
        for _ in 0..5 {
            let mut s = Self::unstarted(free_port());
            if s.try_start_with(extra) {
                return s;
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    fn try_start(&mut self) -> bool {
        self.try_start_with(&[])
    }

    fn try_start_with(&mut self, extra: &[String]) -> bool {
        let child = Command::new(binary())
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--logfile", ""])
            .arg("--dir")
            .arg(self.dir.path())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "redis-server not found ({}): install it (Debian: apt-get install \
                 redis-server redis-tools; scripts/test.sh does) or set WAYGATE_REDIS_SERVER",
                binary()
            ),
            Err(e) => panic!("could not run redis-server: {e}"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return false; // exited: port taken?
            }
            if ping(self.port) {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Kills the server (SIGKILL, as a crash) and waits for it to exit. Data is lost.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // A paused server dies of SIGKILL as well; no thaw needed.
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered — a hung
    /// Redis, not a dead one.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let ok = Command::new("kill")
            .args([sig, &pid])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill {sig} {pid}");
    }

    /// Starts the server again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.try_start() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not restart on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

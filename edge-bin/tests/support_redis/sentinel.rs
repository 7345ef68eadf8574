//! Test harness: one Redis primary, one replica and three Redis Sentinels on loopback
//! (`redis-server <conf> --sentinel`, quorum 2, a primary unreachable for 1 s is down), each
//! process killable by port. Fails (never skips) when the binaries are missing.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::cluster::port_cli;
use super::{free_port, RedisServer};

/// The master name the sentinels monitor.
pub const MASTER: &str = "mymaster";

/// TLS for the servers and sentinels ([`RedisSentinels::start_tls`]): a certificate that
/// names 127.0.0.1 (the address the sentinels announce), its key, and the CA.
pub struct TlsFiles {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub ca: std::path::PathBuf,
}

impl TlsFiles {
    /// The redis-server arguments of a TLS port (replication over TLS too; clients need no
    /// certificate).
    fn server_args(&self, tls_port: u16) -> Vec<String> {
        let path = |p: &std::path::Path| p.display().to_string();
        vec![
            "--tls-port".into(),
            tls_port.to_string(),
            "--tls-cert-file".into(),
            path(&self.cert),
            "--tls-key-file".into(),
            path(&self.key),
            "--tls-ca-cert-file".into(),
            path(&self.ca),
            "--tls-auth-clients".into(),
            "no".into(),
            "--tls-replication".into(),
            "yes".into(),
        ]
    }
}

/// One sentinel process (killed on drop).
pub struct SentinelProcess {
    /// Its plain port (the harness's own checks use it).
    pub port: u16,
    /// Its TLS port, when the harness runs TLS (the URLs name it).
    pub tls_port: Option<u16>,
    child: Option<Child>,
    /// Frozen by [`SentinelProcess::pause`] (the harness's waits skip it).
    paused: std::cell::Cell<bool>,
}

impl SentinelProcess {
    /// Freezes the sentinel (SIGSTOP): its port accepts connections, nothing is answered.
    pub fn pause(&self) {
        self.signal("-STOP");
        self.paused.set(true);
    }

    /// Thaws it (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
        self.paused.set(false);
    }

    fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let ok = Command::new("kill")
            .args([sig, &pid])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid}");
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A primary, a replica and three sentinels owned by a test.
pub struct RedisSentinels {
    /// `servers[0]` starts as the primary, `servers[1]` as its replica.
    pub servers: Vec<RedisServer>,
    pub sentinels: Vec<SentinelProcess>,
    /// The servers' password (`requirepass`), when they have one.
    pub password: Option<String>,
    _dir: tempfile::TempDir,
}

/// A sentinel monitoring the primary at `primary` (its TLS port with `tls`: the sentinel
/// then talks TLS to the servers and serves TLS too).
fn start_sentinel(
    dir: &std::path::Path,
    primary: u16,
    tls: Option<&TlsFiles>,
) -> Option<SentinelProcess> {
    let port = free_port();
    let tls_port = tls.map(|_| free_port());
    let conf = dir.join(format!("sentinel-{port}.conf"));
    let tls_conf = match (tls, tls_port) {
        (Some(t), Some(tls_port)) => format!(
            "tls-port {tls_port}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
             tls-auth-clients no\ntls-replication yes\n",
            t.cert.display(),
            t.key.display(),
            t.ca.display()
        ),
        _ => String::new(),
    };
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\ndaemonize no\nlogfile \"\"\ndir {dir}\n{tls_conf}\
             sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
             sentinel down-after-milliseconds {MASTER} 1000\n\
             sentinel failover-timeout {MASTER} 5000\n\
             sentinel parallel-syncs {MASTER} 1\n",
            dir = dir.display()
        ),
    )
    .expect("write the sentinel config");
    let binary = std::env::var("WAYGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
    let mut child = Command::new(&binary)
        .arg(&conf)
        .arg("--sentinel")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("could not run {binary} --sentinel: {e}"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return None; // port taken?
        }
        if super::ping(port) {
            return Some(SentinelProcess {
                port,
                tls_port,
                child: Some(child),
                paused: std::cell::Cell::new(false),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// The `SENTINEL MASTER` fields as a sentinel reports them (name, value pairs).
fn master_fields(sentinel: u16) -> Option<Vec<(String, String)>> {
    let text = port_cli(sentinel, &["sentinel", "master", MASTER])?;
    let lines: Vec<&str> = text.lines().collect();
    Some(
        lines
            .chunks(2)
            .filter(|c| c.len() == 2)
            .map(|c| (c[0].to_owned(), c[1].to_owned()))
            .collect(),
    )
}

impl RedisSentinels {
    /// Starts the primary, its replica (synced) and three sentinels, and waits until every
    /// sentinel sees the replica and the two other sentinels.
    pub fn start() -> Self {
        Self::start_with_password(None)
    }

    /// As [`RedisSentinels::start`]; with a password, the servers then require it
    /// (`requirepass`, and `masterauth` for their replication) and the sentinels use it
    /// (`auth-pass`).
    pub fn start_with_password(password: Option<&str>) -> Self {
        Self::start_with(password, None)
    }

    /// As [`RedisSentinels::start`], every server and sentinel also on a TLS port: the
    /// servers replicate over TLS and the sentinels monitor them over TLS, so the primary
    /// they announce is its TLS port ([`RedisSentinels::urls`] are `rediss://`).
    pub fn start_tls(tls: &TlsFiles) -> Self {
        Self::start_with(None, Some(tls))
    }

    fn start_with(password: Option<&str>, tls: Option<&TlsFiles>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let no_delay = ["--repl-diskless-sync-delay".to_owned(), "0".to_owned()];
        let with_tls = |mut args: Vec<String>| -> (Vec<String>, Option<u16>) {
            let Some(t) = tls else { return (args, None) };
            let port = free_port();
            args.extend(t.server_args(port));
            (args, Some(port))
        };
        let (primary_args, primary_tls) = with_tls(no_delay.to_vec());
        let primary = RedisServer::start_with_args(&primary_args);
        // What the replica and the sentinels connect to.
        let primary_port = primary_tls.unwrap_or_else(|| primary.port());
        let mut replica_args = no_delay.to_vec();
        replica_args.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary_port.to_string(),
        ]);
        let (replica_args, _) = with_tls(replica_args);
        let replica = RedisServer::start_with_args(&replica_args);
        let sentinels = (0..3)
            .map(|_| {
                (0..5)
                    .find_map(|_| start_sentinel(dir.path(), primary_port, tls))
                    .expect("a sentinel started on one of 5 ports")
            })
            .collect();
        let mut all = Self {
            servers: vec![primary, replica],
            sentinels,
            password: None,
            _dir: dir,
        };
        all.wait_sentinels(Duration::from_secs(30), "replica and peers known", |f| {
            let get = |k: &str| f.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
            get("num-slaves") == Some("1") && get("num-other-sentinels") == Some("2")
        });
        all.wait_replica_synced(all.servers[1].port(), Duration::from_secs(30));
        if let Some(pw) = password {
            for s in &all.servers {
                for (key, value) in [("masterauth", pw), ("requirepass", pw)] {
                    port_cli(s.port(), &["config", "set", key, value]).expect("config set");
                }
            }
            for s in &all.sentinels {
                port_cli(s.port, &["sentinel", "set", MASTER, "auth-pass", pw])
                    .expect("sentinel set auth-pass");
            }
            all.password = Some(pw.to_owned());
        }
        all
    }

    /// redis-cli on a server (with the password, when there is one).
    fn server_cli(&self, port: u16, args: &[&str]) -> Option<String> {
        match &self.password {
            Some(pw) => {
                let mut all = vec!["--no-auth-warning", "-a", pw.as_str()];
                all.extend_from_slice(args);
                port_cli(port, &all)
            }
            None => port_cli(port, args),
        }
    }

    /// The sentinels' URLs (`rediss://` to their TLS ports when they have them).
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| match s.tls_port {
                Some(p) => format!("rediss://127.0.0.1:{p}"),
                None => format!("redis://127.0.0.1:{}", s.port),
            })
            .collect()
    }

    /// Waits until `ok` holds for every sentinel's view of the master.
    fn wait_sentinels(
        &self,
        within: Duration,
        what: &str,
        ok: impl Fn(&[(String, String)]) -> bool,
    ) {
        let deadline = Instant::now() + within;
        loop {
            if self
                .sentinels
                .iter()
                .filter(|s| !s.paused.get())
                .all(|s| master_fields(s.port).is_some_and(|f| ok(&f)))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sentinels: not {what} in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_replica_synced(&self, port: u16, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if self
                .server_cli(port, &["info", "replication"])
                .is_some_and(|i| {
                    i.contains("master_link_status:up") && i.contains("master_sync_in_progress:0")
                })
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replica {port} not synced in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the node on `port` is a synced replica of the primary on `primary`.
    pub fn wait_replica_of(&self, port: u16, primary: u16, within: Duration) {
        let deadline = Instant::now() + within;
        let of = format!("master_port:{primary}");
        loop {
            if self
                .server_cli(port, &["info", "replication"])
                .is_some_and(|i| {
                    i.contains("role:slave")
                        && i.contains(&of)
                        && i.contains("master_link_status:up")
                })
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{port} did not become a replica of {primary} in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every sentinel names `port` as the primary and the node says it is one.
    pub fn wait_primary(&self, port: u16, within: Duration) {
        let p = port.to_string();
        self.wait_sentinels(within, "agreed on the new primary", |f| {
            f.iter().any(|(n, v)| n == "port" && *v == p)
        });
        let deadline = Instant::now() + within;
        while !self
            .server_cli(port, &["role"])
            .is_some_and(|r| r.starts_with("master"))
        {
            assert!(
                Instant::now() < deadline,
                "{port} is not a primary in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

//! `waygate bench`: the load generator and benchmark driver (issue 8).
//!
//! The driver starts the processes under test as children, pinned as the issue found
//! necessary on a 2-vCPU machine: the process under test (the edge, the direct echo server,
//! or HAProxy) on CPU 1; the load generator and what sits behind the process under test (the
//! edge's backend, HAProxy's echo server) on CPU 0. It then runs the same load against every
//! target, interleaved (A B A B ...), for every repetition, and reports medians and ratios
//! measured in the same run. The primary efficiency figure is the CPU of the process under
//! test per message, from `/proc/PID/stat` before and after the measurement window.
//!
//! Roles (`--role`): `driver` (default), `echo` (the direct echo server on every transport)
//! and `backend` (the bench backend behind the edge); the driver starts the latter two as
//! `waygate bench --role ...` children. See BENCHMARKS.md for the method and the workloads.

pub mod echo;
pub mod load;
pub mod procs;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use waygate_transport::conn::ConnConfig;
use waygate_transport::endpoint::{ConnectOptions, Endpoint};
use waygate_transport::quic::QuicClientSockets;
use waygate_transport::tls::ClientTls;
use waygate_transport::TransportKind;

use load::{ClientImpl, LoadResult, LoadSpec, Mode};
use procs::Proc;

/// What this process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Start the targets, run the load, report.
    Driver,
    /// The direct echo server (client protocol on every transport).
    Echo,
    /// The bench backend (behind the edge).
    Backend,
}

/// A process under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// The waygate edge in front of the bench backend.
    Edge,
    /// The direct echo server (the floor).
    Direct,
    /// HAProxy `mode tcp` in front of the TCP echo server (TCP only).
    Haproxy,
    /// The edge with write-through to a Redis the bench starts (`redis-server` on the PATH):
    /// compared with `edge`, and its Redis cost per echo (snapshot writes, group commits,
    /// commands and bytes into Redis) read in the window.
    EdgeRedis,
    /// The same with write-through to a Redis Cluster the bench starts (3 masters, 3
    /// replicas: `redis-server --cluster-enabled yes`, joined by `redis-cli --cluster
    /// create`); its cost per echo is the masters' (commands and bytes they read, summed).
    EdgeRedisCluster,
}

impl Target {
    fn as_str(self) -> &'static str {
        match self {
            Self::Edge => "edge",
            Self::Direct => "direct",
            Self::Haproxy => "haproxy",
            Self::EdgeRedis => "edge-redis",
            Self::EdgeRedisCluster => "edge-redis-cluster",
        }
    }

    /// The edge writing through to Redis (compared with the edge without it).
    fn writes_through(self) -> bool {
        matches!(self, Self::EdgeRedis | Self::EdgeRedisCluster)
    }
}

/// What an edge target writes through to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteThrough {
    Off,
    OneRedis,
    RedisCluster,
}

/// Preset workloads of issue 8.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// One connection ping-pong per transport: added p50/p99 over direct.
    W1,
    /// 1,000 sessions x 20 msg/s x 64 B per transport: edge CPU/msg, tax, p99.
    W2,
    /// W2's push variant: the backend pushes 20 msg/s to every session.
    W2push,
    /// 50 sessions closed loop over TCP: msgs/s vs direct and HAProxy.
    W3,
    /// 5,000 and 10,000 idle sessions per transport: RSS per session.
    W4,
    /// 10,000 idle sessions with heartbeats: idle CPU.
    W5,
    /// Connection setup rate including auth, per transport.
    W6,
    /// Drop 1,000 connections at once: time to restore, loss, duplicates.
    W7,
    /// Channel fan-out: one publication to N members on one edge (N = 10, 100, 1,000; 20,000
    /// deliveries/s), edge CPU per delivery against the direct server writing the same
    /// bytes to N sockets.
    Fanout,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "s"), |i| (&s[..i], &s[i..]));
    let n: f64 = num.parse().map_err(|_| format!("invalid duration `{s}`"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        _ => return Err(format!("invalid duration unit in `{s}` (ms, s, m)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

/// `waygate bench` options. Options left unset take the workload's preset (or the default
/// shown).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// driver (default), or a child role started by the driver.
    #[arg(long, value_enum, default_value = "driver")]
    pub role: Role,
    /// A preset workload of issue 8 (w1..w7, w2push).
    #[arg(long, value_enum)]
    pub workload: Option<Workload>,
    /// Targets, interleaved in this order each repetition [default: edge,direct].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub targets: Option<Vec<Target>>,
    /// Transports: tcp, tls, ws, wss, quic, kcp [default: tcp].
    #[arg(long, value_delimiter = ',')]
    pub transports: Option<Vec<String>>,
    /// Sessions [default: 1].
    #[arg(long)]
    pub sessions: Option<usize>,
    /// ECHO messages per second per session; 0 = closed loop [default: 0].
    #[arg(long)]
    pub rate: Option<f64>,
    /// Payload bytes of ECHO and pushes.
    #[arg(long, default_value_t = 64)]
    pub payload: usize,
    /// Pushes per second per session from the backend (or the direct server) [default: 0].
    #[arg(long)]
    pub push_rate: Option<f64>,
    /// Measurement window [default: 5s].
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Warm-up before the window [default: 1s].
    #[arg(long, value_parser = parse_duration)]
    pub warmup: Option<Duration>,
    /// What sessions do [default: echo].
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// Client implementation.
    #[arg(long, value_enum, default_value = "lean")]
    pub client: ClientImpl,
    /// Connects in flight at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Repetitions (each runs every target once, interleaved) [default: 1].
    #[arg(long)]
    pub reps: Option<usize>,
    /// Keep the target processes across runs and repetitions instead of starting fresh ones
    /// for every run. Sessions a client closes linger on the edge (PROTOCOL.md §7.5, 15 min),
    /// so reused edges carry every earlier run's sessions.
    #[arg(long)]
    pub reuse: bool,
    /// Do not pin processes to CPUs.
    #[arg(long)]
    pub no_pin: bool,
    /// Run a SCHED_IDLE busy loop on each CPU (latency runs; default for W1, W2).
    #[arg(long)]
    pub busy_loops: bool,
    /// Use an edge already running at this URL (e.g. tcp://127.0.0.1:7000) instead of a
    /// child; only the edge target runs.
    #[arg(long)]
    pub edge: Option<String>,
    /// The PING interval the edge announces in WELCOME, ms (default: the edge's 10,000). Its
    /// idle timeout becomes three intervals, and the clients' transport idle timeouts are
    /// turned off: a W5 run with a long interval measures what idle sessions cost without
    /// their heartbeat traffic.
    #[arg(long)]
    pub heartbeat_ms: Option<u64>,
    /// The loopback address the KCP client sockets bind to (default: the kernel picks).
    /// One address has ~28,000 ephemeral ports: W9's generators take one each
    /// (`scripts/w9.sh`).
    #[arg(long)]
    pub kcp_source_ip: Option<std::net::IpAddr>,
    /// Pid of the edge given with --edge (for CPU and RSS).
    #[arg(long)]
    pub edge_pid: Option<u32>,
    /// CA PEM to trust for tls/wss/quic with --edge.
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Bench backend: FORWARD credits it grants the edge (the backend library's default is
    /// 1,024).
    #[arg(long)]
    pub forward_credits: Option<u32>,
    /// Child roles: address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Echo role: where to write the generated CA.
    #[arg(long)]
    pub ca_out: Option<PathBuf>,
    /// Backend role: sessions join one channel and `--push-rate` publications per second go
    /// to all of them (the fan-out workload) instead of per-session pushes.
    #[arg(long)]
    pub fanout: bool,
}

/// One planned series: a load shape over some transports and targets.
#[derive(Debug, Clone, Serialize)]
struct Plan {
    label: String,
    transports: Vec<String>,
    targets: Vec<Target>,
    sessions: usize,
    rate: f64,
    push_rate: f64,
    payload: usize,
    mode: Mode,
    duration_s: f64,
    warmup_s: f64,
    reps: usize,
    fresh: bool,
    busy_loops: bool,
    /// The backend publishes to one channel all sessions joined (the direct server pushes
    /// the same bytes to each session).
    fanout: bool,
}

/// Bytes a channel event adds to a publication's body in the fan-out workload: kind (1),
/// name length (1), `world` (5), an epoch below 2^53 (8), an offset below 2^21 (3).
const FANOUT_EVENT_HEADER: usize = 18;

/// QUIC client connections of the load generator per UDP socket.
const QUIC_SESSIONS_PER_SOCKET: usize = 256;

const ALL: [&str; 6] = ["tcp", "tls", "ws", "wss", "quic", "kcp"];

fn plans(a: &BenchArgs) -> Vec<Plan> {
    let all = || ALL.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let base = |label: &str,
                transports: Vec<String>,
                targets: Vec<Target>,
                sessions: usize,
                rate: f64,
                push: f64,
                mode: Mode,
                duration: f64,
                reps: usize| Plan {
        label: label.into(),
        transports: a.transports.clone().unwrap_or(transports),
        targets: a.targets.clone().unwrap_or(targets),
        sessions: a.sessions.unwrap_or(sessions),
        rate: a.rate.unwrap_or(rate),
        push_rate: a.push_rate.unwrap_or(push),
        payload: a.payload,
        mode: a.mode.unwrap_or(mode),
        duration_s: a.duration.map_or(duration, |d| d.as_secs_f64()),
        warmup_s: a.warmup.map_or(1.0, |d| d.as_secs_f64()),
        reps: a.reps.unwrap_or(reps),
        fresh: !a.reuse,
        busy_loops: a.busy_loops,
        fanout: a.fanout,
    };
    use Target::{Direct, Edge, Haproxy};
    match a.workload {
        None => vec![base(
            "custom",
            vec!["tcp".into()],
            vec![Edge, Direct],
            1,
            0.0,
            0.0,
            Mode::Echo,
            5.0,
            1,
        )],
        Some(Workload::W1) => vec![Plan {
            busy_loops: true,
            ..base(
                "w1",
                all(),
                vec![Edge, Direct, Haproxy],
                1,
                0.0,
                0.0,
                Mode::Echo,
                3.0,
                5,
            )
        }],
        Some(Workload::W2) => vec![Plan {
            busy_loops: true,
            ..base(
                "w2",
                all(),
                vec![Edge, Direct, Haproxy],
                1000,
                20.0,
                0.0,
                Mode::Echo,
                5.0,
                5,
            )
        }],
        Some(Workload::W2push) => vec![Plan {
            busy_loops: true,
            ..base(
                "w2push",
                all(),
                vec![Edge, Direct],
                1000,
                0.0,
                20.0,
                Mode::Idle,
                5.0,
                5,
            )
        }],
        Some(Workload::W3) => vec![base(
            "w3",
            vec!["tcp".into()],
            vec![Edge, Direct, Haproxy],
            50,
            0.0,
            0.0,
            Mode::Echo,
            5.0,
            5,
        )],
        Some(Workload::W4) => [5000usize, 10_000]
            .into_iter()
            .map(|n| Plan {
                fresh: true,
                ..base(
                    &format!("w4-{n}"),
                    all(),
                    vec![Edge, Direct],
                    n,
                    0.0,
                    0.0,
                    Mode::Idle,
                    10.0,
                    1,
                )
            })
            .collect(),
        Some(Workload::W5) => vec![Plan {
            fresh: true,
            // One heartbeat interval after the last connect: the window sees idle sessions,
            // not the tail of 10,000 handshakes (QUIC's is seconds long).
            warmup_s: a.warmup.map_or(10.0, |d| d.as_secs_f64()),
            ..base(
                "w5",
                all(),
                vec![Edge],
                10_000,
                0.0,
                0.0,
                Mode::Idle,
                20.0,
                1,
            )
        }],
        Some(Workload::W6) => vec![base(
            "w6",
            all(),
            vec![Edge, Direct],
            3000,
            0.0,
            0.0,
            Mode::Connect,
            0.0,
            3,
        )],
        Some(Workload::Fanout) => [10usize, 100, 1000]
            .into_iter()
            .map(|n| Plan {
                fresh: true,
                fanout: true,
                ..base(
                    &format!("fanout-{n}"),
                    vec!["tcp".into()],
                    vec![Edge, Direct],
                    n,
                    0.0,
                    20_000.0 / n as f64,
                    Mode::Idle,
                    5.0,
                    3,
                )
            })
            .collect(),
        Some(Workload::W7) => vec![Plan {
            fresh: true,
            warmup_s: a.warmup.map_or(2.0, |d| d.as_secs_f64()),
            ..base(
                "w7",
                all(),
                vec![Edge],
                1000,
                0.0,
                10.0,
                Mode::Restore,
                5.0,
                3,
            )
        }],
    }
}

/// One measured run.
#[derive(Debug, Clone, Serialize)]
struct Run {
    plan: String,
    transport: String,
    target: Target,
    rep: usize,
    load_avg: String,
    result: LoadResult,
}

/// The processes of the targets for one plan.
struct Targets {
    _procs: Vec<Proc>,
    suts: BTreeMap<Target, Sut>,
}

#[derive(Debug, Clone)]
struct Sut {
    pid: Option<u32>,
    addrs: BTreeMap<String, SocketAddr>,
    tls: Option<ClientTls>,
    /// The edge's admin server (its /metrics are read in the window).
    admin: Option<SocketAddr>,
    /// The Redis nodes the edge writes through to (one, or a cluster's six; the masters'
    /// counters are read).
    redis_ports: Vec<u16>,
}

fn listeners_of(v: &serde_json::Value) -> BTreeMap<String, SocketAddr> {
    v.get("listeners")
        .and_then(|l| l.as_object())
        .map(|m| {
            m.iter()
                .filter_map(|(k, a)| Some((k.clone(), a.as_str()?.parse().ok()?)))
                .collect()
        })
        .unwrap_or_default()
}

fn ca(path: &Path) -> Option<ClientTls> {
    let pem = std::fs::read_to_string(path).ok()?;
    ClientTls::from_ca_pem(&pem).ok()
}

struct Env {
    exe: PathBuf,
    dir: PathBuf,
    pin: bool,
    seq: std::cell::Cell<u32>,
    forward_credits: Option<u32>,
    heartbeat_ms: Option<u64>,
}

impl Env {
    fn cpu(&self, c: usize) -> Option<usize> {
        self.pin.then_some(c)
    }

    fn next(&self) -> u32 {
        let n = self.seq.get() + 1;
        self.seq.set(n);
        n
    }

    fn child_args(&self, role: &str, plan: &Plan, extra: &[String]) -> Vec<String> {
        // Fan-out: the direct server writes what the edge writes, the channel event header
        // (kind, name "world", epoch, offset) included.
        let payload = if plan.fanout && role == "echo" {
            plan.payload + FANOUT_EVENT_HEADER
        } else {
            plan.payload
        };
        let mut v = vec![
            "bench".to_string(),
            "--role".into(),
            role.into(),
            "--push-rate".into(),
            plan.push_rate.to_string(),
            "--payload".into(),
            payload.to_string(),
        ];
        if plan.fanout && role == "backend" {
            v.push("--fanout".into());
        }
        v.extend_from_slice(extra);
        v
    }

    fn echo(&self, plan: &Plan, cpu: usize) -> Result<(Proc, Sut), String> {
        let n = self.next();
        let ca_path = self.dir.join(format!("echo{n}-ca.pem"));
        let args = self.child_args(
            "echo",
            plan,
            &["--ca-out".into(), ca_path.display().to_string()],
        );
        let (p, ready) = procs::spawn_ready(
            "echo",
            procs::pinned(self.cpu(cpu), &self.exe, &args),
            &self.dir.join(format!("echo{n}.log")),
        )?;
        let sut = Sut {
            pid: Some(p.pid()),
            addrs: listeners_of(&ready),
            tls: ca(&ca_path),
            admin: None,
            redis_ports: Vec::new(),
        };
        Ok((p, sut))
    }

    /// A `redis-server` on a free loopback port, on CPU 0 beside the backend, with no
    /// persistence, and `extra` arguments (cluster mode); its process and port.
    fn redis_server(&self, name: &str, extra: &[String]) -> Result<(Proc, u16), String> {
        let port = procs::free_port()?;
        let mut args = vec![
            "--port".into(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--save".into(),
            String::new(),
            "--appendonly".into(),
            "no".into(),
        ];
        args.extend_from_slice(extra);
        let r = procs::spawn_quiet(
            "redis-server",
            procs::pinned(
                self.cpu(0),
                &procs::which("redis-server").ok_or("redis-server is not on the PATH")?,
                &args,
            ),
            &self.dir.join(format!("{name}.log")),
            Duration::from_millis(300),
        )?;
        Ok((r, port))
    }

    /// A Redis Cluster of 3 masters and 3 replicas (as the test suite's), once every node
    /// reports `cluster_state:ok`: its processes and ports.
    fn redis_cluster(&self, n: u32) -> Result<(Vec<Proc>, Vec<u16>), String> {
        let (mut nodes, mut ports) = (Vec::new(), Vec::new());
        for i in 0..6 {
            let bus = procs::free_port()?;
            // A directory of its own, empty: a node reads its cluster view (`nodes.conf`)
            // and a replica's synced data (`dump.rdb`) from it, and what an earlier
            // repetition's cluster left there would make it join that one.
            let home = self.dir.join(format!("cluster{n}-node{i}"));
            let _ = std::fs::remove_dir_all(&home);
            std::fs::create_dir_all(&home).map_err(|e| format!("{}: {e}", home.display()))?;
            let conf = home.join("nodes.conf");
            let (p, port) = self.redis_server(
                &format!("cluster{n}-redis{i}"),
                &[
                    "--cluster-enabled".into(),
                    "yes".into(),
                    "--cluster-config-file".into(),
                    conf.display().to_string(),
                    "--cluster-port".into(),
                    bus.to_string(),
                    "--dir".into(),
                    home.display().to_string(),
                    // A replica's first sync starts at once (not after Redis' 5 s wait),
                    // so it is over before the measured window.
                    "--repl-diskless-sync-delay".into(),
                    "0".into(),
                ],
            )?;
            nodes.push(p);
            ports.push(port);
        }
        let cli = procs::which("redis-cli").ok_or("redis-cli is not on the PATH")?;
        let mut create = std::process::Command::new(cli);
        create.args(["--cluster", "create"]);
        create.args(ports.iter().map(|p| format!("127.0.0.1:{p}")));
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let log = self.dir.join(format!("cluster{n}-create.log"));
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let mut child = create
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("redis-cli --cluster create: {e}"))?;
        // redis-cli waits for the nodes to agree with no limit of its own.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "redis-cli --cluster create did not finish within 30 s (see {})",
                    log.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if !status.success() {
            return Err(format!(
                "redis-cli --cluster create failed (see {})",
                log.display()
            ));
        }
        // Every node agrees, and every replica has finished its first sync.
        let ready = |p: &u16| {
            let replication = redis_info(*p, "INFO replication");
            redis_info(*p, "cluster info").contains("cluster_state:ok")
                && (replication.contains("role:master")
                    || (replication.contains("master_link_status:up")
                        && replication.contains("master_sync_in_progress:0")))
        };
        while !ports.iter().all(ready) {
            if std::time::Instant::now() > deadline {
                return Err("the bench's Redis Cluster was not ready within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok((nodes, ports))
    }

    fn edge(&self, plan: &Plan, redis: WriteThrough) -> Result<(Vec<Proc>, Sut), String> {
        let n = self.next();
        let mut procs_ = Vec::new();
        let redis_ports = match redis {
            WriteThrough::Off => Vec::new(),
            WriteThrough::OneRedis => {
                let (r, port) = self.redis_server(&format!("redis{n}"), &[])?;
                procs_.push(r);
                vec![port]
            }
            WriteThrough::RedisCluster => {
                let (nodes, ports) = self.redis_cluster(n)?;
                procs_.extend(nodes);
                ports
            }
        };
        let extra: Vec<String> = self
            .forward_credits
            .map(|c| vec!["--forward-credits".to_string(), c.to_string()])
            .unwrap_or_default();
        let args = self.child_args("backend", plan, &extra);
        let (backend, ready) = procs::spawn_ready(
            "backend",
            procs::pinned(self.cpu(0), &self.exe, &args),
            &self.dir.join(format!("backend{n}.log")),
        )?;
        let baddr = ready
            .get("backend")
            .and_then(|b| b.as_str())
            .ok_or("backend ready line without address")?
            .to_string();
        let routes = self.dir.join(format!("routes{n}.toml"));
        std::fs::write(
            &routes,
            format!(
                "epoch = 1\nupdated_at = 0\n[[services]]\nname = \"player\"\nmessages = [[1000, 1999]]\nkey = \"player\"\n  [[services.instances]]\n  id = \"b1\"\n  address = \"{baddr}\"\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        let ca_path = self.dir.join(format!("edge{n}-ca.pem"));
        let config = self.dir.join(format!("edge{n}.toml"));
        // Only what the bench needs differs from the defaults: the route table, where the
        // dev CA goes, KCP's session cap raised to the W4/W5 session counts, and the
        // admission and inbound limits opened up (every bench client comes from one source
        // address and closed-loop sessions send far above a game client's rate: the bench
        // measures the data path, not the limiters), and the fan-out channel's publish rate.
        std::fs::write(
            &config,
            format!(
                "edge_id = \"bench-edge\"\n[routing]\ntable = \"{}\"\n[tls]\ndev_ca_out = \"{}\"\n[kcp]\nmax_sessions = 20000\n\
                 [backpressure]\naccept_per_sec = 1000000\naccept_burst = 100000\naccept_per_source_per_sec = 1000000\n\
                 accept_per_source_burst = 100000\nmax_handshakes = 100000\ninbound_msgs_per_sec = 10000000\n\
                 inbound_msg_burst = 10000000\ninbound_bytes_per_sec = 10000000000\ninbound_byte_burst = 10000000000\nmax_sessions = 1000000\n\
                 [channels.kinds.world]\npublish_rate = 1000000\npublish_burst = 1000000\n{}{}",
                routes.display(),
                ca_path.display(),
                if redis == WriteThrough::RedisCluster {
                    format!(
                        "[cluster]\nredis_cluster = [{}]\n",
                        redis_ports
                            .iter()
                            .map(|p| format!("\"redis://127.0.0.1:{p}/\""))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                } else {
                    String::new()
                },
                self.heartbeat_ms.map_or(String::new(), |ms| format!(
                    "[session]\nheartbeat_ms = {ms}\n[limits]\nidle_timeout_ms = {}\n",
                    ms.saturating_mul(3)
                )),
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut args = vec![
            "run".to_string(),
            "--config".into(),
            config.display().to_string(),
            "--ephemeral-ports".into(),
        ];
        if let (WriteThrough::OneRedis, Some(port)) = (redis, redis_ports.first()) {
            args.extend(["--redis".into(), format!("redis://127.0.0.1:{port}/")]);
        }
        let (edge, ready) = procs::spawn_ready(
            "edge",
            procs::pinned(self.cpu(1), &self.exe, &args),
            &self.dir.join(format!("edge{n}.log")),
        )?;
        let sut = Sut {
            pid: Some(edge.pid()),
            addrs: listeners_of(&ready),
            tls: ca(&ca_path),
            admin: ready
                .get("admin")
                .and_then(|a| a.as_str())
                .and_then(|a| a.parse().ok()),
            redis_ports,
        };
        procs_.extend([backend, edge]);
        Ok((procs_, sut))
    }

    fn haproxy(&self, plan: &Plan) -> Result<(Vec<Proc>, Sut), String> {
        let (echo, esut) = self.echo(plan, 0)?;
        let tcp = *esut.addrs.get("tcp").ok_or("echo without tcp")?;
        let port = procs::free_port()?;
        let h = procs::haproxy(self.cpu(1), port, tcp, &self.dir)?;
        let sut = Sut {
            pid: Some(h.pid()),
            addrs: BTreeMap::from([("tcp".to_string(), SocketAddr::from(([127, 0, 0, 1], port)))]),
            tls: None,
            admin: None,
            redis_ports: Vec::new(),
        };
        Ok((vec![echo, h], sut))
    }

    fn start(&self, plan: &Plan, args: &BenchArgs) -> Result<Targets, String> {
        let mut procs_ = Vec::new();
        let mut suts = BTreeMap::new();
        if let Some(url) = &args.edge {
            let e = Endpoint::parse(url).map_err(|e| e.to_string())?;
            let addr = if e.is_name() {
                use std::net::ToSocketAddrs as _;
                (e.host.as_str(), e.addr.port())
                    .to_socket_addrs()
                    .map_err(|err| format!("{url}: {err}"))?
                    .next()
                    .ok_or_else(|| format!("{url}: resolves to no address"))?
            } else {
                e.addr
            };
            suts.insert(
                Target::Edge,
                Sut {
                    pid: args.edge_pid,
                    addrs: BTreeMap::from([(e.kind.as_str().to_string(), addr)]),
                    tls: args.ca.as_deref().and_then(ca),
                    admin: None,
                    redis_ports: Vec::new(),
                },
            );
            return Ok(Targets {
                _procs: procs_,
                suts,
            });
        }
        for t in &plan.targets {
            let (p, s) = match t {
                Target::Edge => self.edge(plan, WriteThrough::Off)?,
                Target::EdgeRedis => self.edge(plan, WriteThrough::OneRedis)?,
                Target::EdgeRedisCluster => self.edge(plan, WriteThrough::RedisCluster)?,
                Target::Direct => {
                    let (p, s) = self.echo(plan, 1)?;
                    (vec![p], s)
                }
                Target::Haproxy => self.haproxy(plan)?,
            };
            procs_.extend(p);
            suts.insert(*t, s);
        }
        // Let links come up and start-up work settle.
        std::thread::sleep(Duration::from_millis(500));
        Ok(Targets {
            _procs: procs_,
            suts,
        })
    }
}

/// The counters an edge-redis run reads at the window's start and end: the edge's
/// write-through series (its admin /metrics) and Redis' own (`INFO`: of the one Redis, or
/// summed over a cluster's masters). Plain TCP, a few hundred microseconds, outside the
/// measured processes.
fn counters(admin: Option<SocketAddr>, redis: &[u16]) -> BTreeMap<String, u64> {
    use std::io::{Read as _, Write as _};
    let mut out = BTreeMap::new();
    let mut add = |text: &str, sep: char, names: &[(&str, &str)]| {
        for line in text.lines() {
            for (name, key) in names {
                if let Some(v) = line.strip_prefix(name).and_then(|r| r.strip_prefix(sep)) {
                    if let Ok(v) = v.trim().parse::<f64>() {
                        *out.entry((*key).to_string()).or_insert(0) += v as u64;
                    }
                }
            }
        }
    };
    if let Some(a) = admin {
        let mut text = String::new();
        if let Ok(mut s) = std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let get = format!("GET /metrics HTTP/1.0\r\nHost: {a}\r\n\r\n");
            if s.write_all(get.as_bytes()).is_ok() {
                // HTTP/1.0: the body ends with the connection.
                let _ = s.read_to_string(&mut text);
            }
        }
        add(
            &text,
            ' ',
            &[
                ("waygate_write_through_writes_total", "snapshot_writes"),
                ("waygate_write_through_commits_total", "group_commits"),
            ],
        );
    }
    for port in redis {
        let info = redis_info(*port, "INFO");
        // A cluster's replicas read what their masters replicate: only masters count.
        if redis.len() > 1 && !info.contains("role:master") {
            continue;
        }
        add(
            &info,
            ':',
            &[
                ("total_commands_processed", "redis_commands"),
                ("total_net_input_bytes", "redis_in_bytes"),
            ],
        );
    }
    out
}

/// The bulk-string reply of an inline Redis `command` (`INFO`, `CLUSTER INFO`) on a
/// loopback port; empty when the node does not answer within 2 s.
fn redis_info(port: u16, command: &str) -> String {
    use std::io::{Read as _, Write as _};
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(format!("{command}\r\n").as_bytes()).is_err() {
        return String::new();
    }
    // `$<length>\r\n<length bytes>\r\n`: read until the whole reply is in. Anything else
    // (an error reply, a nil, more than 1 MiB) reads as nothing.
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        if let Some(eol) = buf.iter().position(|b| *b == b'\n') {
            let len = buf
                .get(1..eol)
                .filter(|_| buf.first() == Some(&b'$'))
                .and_then(|l| std::str::from_utf8(l).ok())
                .and_then(|l| l.trim().parse::<usize>().ok())
                .filter(|len| *len <= 1 << 20);
            let Some(len) = len else {
                return String::new();
            };
            if buf.len() >= eol + 1 + len {
                return String::from_utf8_lossy(&buf[eol + 1..eol + 1 + len]).into_owned();
            }
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return String::new(),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn kind(s: &str) -> Option<TransportKind> {
    TransportKind::ALL.into_iter().find(|k| k.as_str() == s)
}

/// Pins the driver (the load generator: all its threads) to CPU 0, beside the backends,
/// unless `--no-pin`. Call it before the driver's runtime exists: the runtime then sizes
/// itself to that one CPU (one worker thread). Pinned after the runtime was built, the load
/// generator ran two worker threads time-sharing CPU 0 with the backend, and W1 over QUIC
/// measured that as a 1–2 ms p99 through the edge (BENCHMARKS.md, W1).
pub fn pin_driver(args: &BenchArgs) {
    if matches!(args.role, Role::Driver) && !args.no_pin {
        let pinned = std::process::Command::new("taskset")
            .args(["-a", "-p", "-c", "0", &std::process::id().to_string()])
            .stdout(std::process::Stdio::null())
            .status();
        if !pinned.is_ok_and(|s| s.success()) {
            eprintln!("waygate bench: could not pin the load generator to CPU 0 (taskset)");
        }
    }
}

/// Runs `waygate bench` with `args` (the driver pinned first: [`pin_driver`]).
pub async fn run(args: BenchArgs) -> Result<(), String> {
    match args.role {
        Role::Echo => {
            let ca_out = args
                .ca_out
                .clone()
                .unwrap_or_else(|| std::env::temp_dir().join("waygate-bench-echo-ca.pem"));
            return echo::run_echo(args.push_rate.unwrap_or(0.0), args.payload, ca_out).await;
        }
        Role::Backend => {
            return echo::run_backend(
                args.listen,
                args.push_rate.unwrap_or(0.0),
                args.payload,
                args.forward_credits,
                args.fanout,
            )
            .await
        }
        Role::Driver => {}
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("waygate-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let env = Env {
        exe,
        dir: dir.clone(),
        pin: !args.no_pin,
        seq: std::cell::Cell::new(0),
        forward_credits: args.forward_credits,
        heartbeat_ms: args.heartbeat_ms,
    };
    let mut runs: Vec<Run> = Vec::new();
    let plans = plans(&args);
    for plan in &plans {
        let _busy: Vec<Proc> = if plan.busy_loops {
            [0, 1]
                .into_iter()
                .map(|c| procs::busy_loop(c, &dir))
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let mut shared: Option<Targets> = None;
        for rep in 0..plan.reps {
            for transport in &plan.transports {
                let Some(k) = kind(transport) else {
                    return Err(format!("unknown transport `{transport}`"));
                };
                for target in &plan.targets {
                    if *target == Target::Haproxy && k != TransportKind::Tcp {
                        continue;
                    }
                    let single_plan = Plan {
                        targets: vec![*target],
                        ..plan.clone()
                    };
                    let mut fresh_targets = None;
                    let targets = if plan.fresh {
                        fresh_targets = Some(env.start(&single_plan, &args)?);
                        fresh_targets.as_ref()
                    } else {
                        if shared.is_none() {
                            shared = Some(env.start(plan, &args)?);
                        }
                        shared.as_ref()
                    };
                    let Some(sut) = targets.and_then(|t| t.suts.get(target)).cloned() else {
                        continue;
                    };
                    let Some(addr) = sut.addrs.get(transport.as_str()).copied() else {
                        continue;
                    };
                    let mut endpoint = Endpoint::new(k, addr);
                    endpoint.host = "localhost".into();
                    let spec = LoadSpec {
                        endpoint,
                        connect: ConnectOptions {
                            tls: sut.tls.clone(),
                            // ~2 MB of receive buffers per client socket: 10,000 QUIC
                            // sessions on one socket each would not fit (W4, W5).
                            quic_sockets: Some(QuicClientSockets::new(QUIC_SESSIONS_PER_SOCKET)),
                            kcp_local_ip: args.kcp_source_ip,
                            conn: ConnConfig {
                                idle_timeout: ConnConfig::default()
                                    .idle_timeout
                                    .filter(|_| args.heartbeat_ms.is_none()),
                                ..ConnConfig::default()
                            },
                            ..ConnectOptions::default()
                        },
                        sessions: plan.sessions,
                        rate: plan.rate,
                        payload: plan.payload,
                        warmup: Duration::from_secs_f64(plan.warmup_s),
                        duration: Duration::from_secs_f64(plan.duration_s),
                        mode: plan.mode,
                        client: args.client,
                        concurrency: args.concurrency,
                        player_prefix: format!(
                            "bench-{}-{}-{transport}-{}-{rep}",
                            std::process::id(),
                            plan.label,
                            target.as_str()
                        ),
                        sut_pid: sut.pid,
                        counters: (sut.admin.is_some() || !sut.redis_ports.is_empty()).then(|| {
                            let (admin, redis) = (sut.admin, sut.redis_ports.clone());
                            std::sync::Arc::new(move || counters(admin, &redis))
                                as load::SutCounters
                        }),
                    };
                    let load_avg = procs::loadavg();
                    let result = load::run(spec).await;
                    if !args.json {
                        eprintln!(
                            "[{} rep {rep} {transport} {}] {}",
                            plan.label,
                            target.as_str(),
                            brief(&result)
                        );
                    }
                    runs.push(Run {
                        plan: plan.label.clone(),
                        transport: transport.clone(),
                        target: *target,
                        rep,
                        load_avg,
                        result,
                    });
                    drop(fresh_targets);
                    if args.edge.is_some() {
                        break;
                    }
                }
            }
        }
    }
    let summary = summarize(&runs);
    let report = serde_json::json!({
        "machine": machine(),
        "plans": plans,
        "summary": summary,
        "runs": runs,
    });
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    if let Some(out) = &args.out {
        std::fs::write(out, &text).map_err(|e| e.to_string())?;
    }
    if args.json {
        println!("{text}");
    } else {
        print!("{}", table(&summary));
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn brief(r: &LoadResult) -> String {
    format!(
        "conn {}/{} msgs/s {:.0} rtt p50 {} p99 {} us, push p99 {} us, sut {:.2} us/msg ({:.1}% core), client {:.2} us/msg, rss {:?} KiB ({:.2} KiB/session), setups/s {:.0}, us/session {:.0}, restore p99 {} ms (restored {}, failed {}, retries {}), lost {} dup {} refused {} {:?}",
        r.connected,
        r.connected + r.connect_failed,
        r.msgs_per_s,
        r.rtt_us.p50,
        r.rtt_us.p99,
        r.push_us.p99,
        r.sut_cpu_us_per_msg.unwrap_or(f64::NAN),
        r.sut_cpu_pct.unwrap_or(f64::NAN),
        r.client_cpu_us_per_msg.unwrap_or(f64::NAN),
        r.sut_rss_kib,
        r.rss_per_session_kib.unwrap_or(f64::NAN),
        r.setups_per_s.unwrap_or(f64::NAN),
        r.sut_cpu_us_per_session.unwrap_or(f64::NAN),
        r.restore_us.p99 / 1000,
        r.restored,
        r.restore_failed,
        r.resume_retries,
        r.lost,
        r.duplicated,
        r.refused,
        r.refused_by_code,
    )
}

fn machine() -> serde_json::Value {
    let sh = |c: &str| {
        std::process::Command::new("sh")
            .args(["-c", c])
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    serde_json::json!({
        "nproc": sh("nproc --all"),
        "cpu": sh("lscpu | grep 'Model name' | sed 's/.*: *//'"),
        "kernel": sh("uname -r"),
        "loadavg": procs::loadavg(),
    })
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Medians per (plan, transport, target) and per-repetition ratios against the references.
#[derive(Debug, Clone, Serialize)]
struct Row {
    plan: String,
    transport: String,
    target: Target,
    reps: usize,
    msgs_per_s: Option<f64>,
    rtt_p50_us: Option<f64>,
    rtt_p99_us: Option<f64>,
    rtt_p999_us: Option<f64>,
    push_p99_us: Option<f64>,
    sut_cpu_us_per_msg: Option<f64>,
    sut_cpu_pct: Option<f64>,
    client_cpu_us_per_msg: Option<f64>,
    rss_per_session_kib: Option<f64>,
    setups_per_s: Option<f64>,
    sut_cpu_us_per_session: Option<f64>,
    restore_p99_ms: Option<f64>,
    replayed_p99_ms: Option<f64>,
    restore_failed: u64,
    lost: u64,
    duplicated: u64,
    refused: u64,
    connect_failed: u64,
    /// Median over repetitions of (this - direct) and (this / direct), same repetition.
    vs_direct: Option<Compare>,
    /// The same against HAProxy.
    vs_haproxy: Option<Compare>,
    /// edge-redis, edge-redis-cluster: the same against the edge without Redis.
    vs_edge: Option<Compare>,
    /// edge-redis, edge-redis-cluster: the medians of its window counters per echo round trip (per session set
    /// up in a setup run): snapshot writes, group commits, Redis commands and bytes.
    redis_per_echo: Option<BTreeMap<String, f64>>,
}

#[derive(Debug, Clone, Serialize)]
struct Compare {
    msgs_per_s_ratio: Option<f64>,
    added_p50_us: Option<f64>,
    added_p99_us: Option<f64>,
    cpu_per_msg_ratio: Option<f64>,
    cpu_tax_us_per_msg: Option<f64>,
    setups_ratio: Option<f64>,
}

fn compare(runs: &[&Run], refs: &[&Run]) -> Option<Compare> {
    let pairs: Vec<(&LoadResult, &LoadResult)> = runs
        .iter()
        .filter_map(|r| {
            refs.iter()
                .find(|x| x.rep == r.rep)
                .map(|x| (&r.result, &x.result))
        })
        .collect();
    if pairs.is_empty() {
        return None;
    }
    let m = |f: &dyn Fn(&LoadResult, &LoadResult) -> Option<f64>| {
        median(pairs.iter().filter_map(|(a, b)| f(a, b)).collect())
    };
    let nz = |x: f64| (x > 0.0).then_some(x);
    Some(Compare {
        msgs_per_s_ratio: m(&|a, b| Some(a.msgs_per_s / nz(b.msgs_per_s)?)),
        added_p50_us: m(&|a, b| {
            (a.rtt_us.n > 0 && b.rtt_us.n > 0).then_some(a.rtt_us.p50 as f64 - b.rtt_us.p50 as f64)
        }),
        added_p99_us: m(&|a, b| {
            (a.rtt_us.n > 0 && b.rtt_us.n > 0).then_some(a.rtt_us.p99 as f64 - b.rtt_us.p99 as f64)
        }),
        cpu_per_msg_ratio: m(&|a, b| Some(a.sut_cpu_us_per_msg? / nz(b.sut_cpu_us_per_msg?)?)),
        cpu_tax_us_per_msg: m(&|a, b| Some(a.sut_cpu_us_per_msg? - b.sut_cpu_us_per_msg?)),
        setups_ratio: m(&|a, b| Some(a.setups_per_s? / nz(b.setups_per_s?)?)),
    })
}

fn summarize(runs: &[Run]) -> Vec<Row> {
    let mut keys: Vec<(String, String, Target)> = runs
        .iter()
        .map(|r| (r.plan.clone(), r.transport.clone(), r.target))
        .collect();
    keys.dedup();
    keys.sort();
    keys.dedup();
    let mut rows = Vec::new();
    for (plan, transport, target) in keys {
        let sel = |t: Target| -> Vec<&Run> {
            runs.iter()
                .filter(|r| r.plan == plan && r.transport == transport && r.target == t)
                .collect()
        };
        let mine = sel(target);
        let med = |f: &dyn Fn(&LoadResult) -> Option<f64>| {
            median(mine.iter().filter_map(|r| f(&r.result)).collect())
        };
        let lat = |n: u64, v: u64| (n > 0).then_some(v as f64);
        let sum = |f: &dyn Fn(&LoadResult) -> u64| mine.iter().map(|r| f(&r.result)).sum();
        let direct = sel(Target::Direct);
        let haproxy = sel(Target::Haproxy);
        rows.push(Row {
            reps: mine.len(),
            msgs_per_s: med(&|r| (r.msgs_per_s > 0.0).then_some(r.msgs_per_s)),
            rtt_p50_us: med(&|r| lat(r.rtt_us.n, r.rtt_us.p50)),
            rtt_p99_us: med(&|r| lat(r.rtt_us.n, r.rtt_us.p99)),
            rtt_p999_us: med(&|r| lat(r.rtt_us.n, r.rtt_us.p999)),
            push_p99_us: med(&|r| lat(r.push_us.n, r.push_us.p99)),
            sut_cpu_us_per_msg: med(&|r| r.sut_cpu_us_per_msg),
            sut_cpu_pct: med(&|r| r.sut_cpu_pct),
            client_cpu_us_per_msg: med(&|r| r.client_cpu_us_per_msg),
            rss_per_session_kib: med(&|r| r.rss_per_session_kib),
            setups_per_s: med(&|r| r.setups_per_s),
            sut_cpu_us_per_session: med(&|r| r.sut_cpu_us_per_session),
            restore_p99_ms: med(&|r| lat(r.restore_us.n, r.restore_us.p99).map(|v| v / 1000.0)),
            replayed_p99_ms: med(&|r| lat(r.replayed_us.n, r.replayed_us.p99).map(|v| v / 1000.0)),
            restore_failed: sum(&|r| r.restore_failed),
            lost: sum(&|r| r.lost),
            duplicated: sum(&|r| r.duplicated),
            refused: sum(&|r| r.refused),
            connect_failed: sum(&|r| r.connect_failed),
            vs_direct: (target != Target::Direct)
                .then(|| compare(&mine, &direct))
                .flatten(),
            vs_haproxy: (target != Target::Haproxy)
                .then(|| compare(&mine, &haproxy))
                .flatten(),
            vs_edge: target
                .writes_through()
                .then(|| compare(&mine, &sel(Target::Edge)))
                .flatten(),
            redis_per_echo: target.writes_through().then(|| {
                let mut per = BTreeMap::new();
                // Per echo round trip; in a setup run (no echoes), per session set up.
                let unit = |r: &LoadResult| {
                    if r.echoes > 0 {
                        r.echoes
                    } else if r.setups_per_s.is_some() {
                        r.connected
                    } else {
                        0
                    }
                };
                for key in [
                    "snapshot_writes",
                    "group_commits",
                    "redis_commands",
                    "redis_in_bytes",
                ] {
                    let v = median(
                        mine.iter()
                            .filter(|r| unit(&r.result) > 0)
                            .filter_map(|r| {
                                Some(
                                    *r.result.sut_counters.get(key)? as f64
                                        / unit(&r.result) as f64,
                                )
                            })
                            .collect(),
                    );
                    if let Some(v) = v {
                        per.insert(key.to_string(), v);
                    }
                }
                per
            }),
            plan,
            transport,
            target,
        });
    }
    rows
}

fn f(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

fn table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<8} {:<5} {:<8} {:>4} {:>9} {:>7} {:>7} {:>8} {:>8} {:>8} {:>7} {:>7} {:>8} {:>8} {:>8} {:>9} {:>6}\n",
        "plan", "tr", "target", "reps", "msgs/s", "p50us", "p99us", "p999us", "push99", "sut us/m", "core%",
        "cli us", "KiB/ses", "setup/s", "us/setup", "restore99", "lost"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<8} {:<5} {:<8} {:>4} {:>9} {:>7} {:>7} {:>8} {:>8} {:>8} {:>7} {:>7} {:>8} {:>8} {:>8} {:>9} {:>6}\n",
            r.plan,
            r.transport,
            r.target.as_str(),
            r.reps,
            f(r.msgs_per_s, 0),
            f(r.rtt_p50_us, 0),
            f(r.rtt_p99_us, 0),
            f(r.rtt_p999_us, 0),
            f(r.push_p99_us, 0),
            f(r.sut_cpu_us_per_msg, 2),
            f(r.sut_cpu_pct, 1),
            f(r.client_cpu_us_per_msg, 2),
            f(r.rss_per_session_kib, 2),
            f(r.setups_per_s, 0),
            f(r.sut_cpu_us_per_session, 0),
            f(r.restore_p99_ms, 1),
            r.lost + r.duplicated,
        ));
        if let Some(per) = &r.redis_per_echo {
            let unit = if r.setups_per_s.is_some() {
                "session set up"
            } else {
                "echo round trip"
            };
            out.push_str(&format!(
                "    per {unit}: {} snapshot writes, {} group commits, {} Redis commands, {} bytes into Redis\n",
                f(per.get("snapshot_writes").copied(), 3),
                f(per.get("group_commits").copied(), 3),
                f(per.get("redis_commands").copied(), 3),
                f(per.get("redis_in_bytes").copied(), 0),
            ));
        }
        for (name, c) in [
            ("direct", &r.vs_direct),
            ("haproxy", &r.vs_haproxy),
            ("edge", &r.vs_edge),
        ] {
            if let Some(c) = c {
                out.push_str(&format!(
                    "    vs {name:<7} msgs/s x{}  added p50 {} us  p99 {} us  cpu/msg x{}  tax {} us/msg  setups x{}\n",
                    f(c.msgs_per_s_ratio, 2),
                    f(c.added_p50_us, 0),
                    f(c.added_p99_us, 0),
                    f(c.cpu_per_msg_ratio, 2),
                    f(c.cpu_tax_us_per_msg, 2),
                    f(c.setups_ratio, 2),
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redis_info;
    use std::io::{Read as _, Write as _};

    /// A one-shot server on loopback answering the first command with `reply`.
    fn answering(reply: &'static [u8]) -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let mut b = [0u8; 64];
                let _ = s.read(&mut b);
                // In two writes: the reader must wait for the whole bulk string.
                let (a, rest) = reply.split_at(reply.len() / 2);
                let _ = s.write_all(a);
                std::thread::sleep(std::time::Duration::from_millis(20));
                let _ = s.write_all(rest);
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        });
        port
    }

    #[test]
    fn redis_info_reads_a_whole_bulk_reply_and_nothing_else() {
        let text = "# Replication\r\nrole:master\r\n\r\n# Stats\r\ntotal_net_input_bytes:7\r\n";
        let reply: &'static [u8] = Box::leak(
            format!("${}\r\n{text}\r\n", text.len())
                .into_bytes()
                .into_boxed_slice(),
        );
        assert_eq!(redis_info(answering(reply), "INFO"), text);
        assert_eq!(
            redis_info(answering(b"-ERR unknown command\r\n"), "NOPE"),
            ""
        );
        assert_eq!(redis_info(answering(b"$-1\r\n"), "INFO"), "");
        assert_eq!(redis_info(answering(b"$99999999\r\n"), "INFO"), "");
    }
}

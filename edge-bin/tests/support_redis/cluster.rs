//! Test harness: a real Redis Cluster of 3 masters and 3 replicas on loopback
//! (`redis-server --cluster-enabled yes`, joined with `redis-cli --cluster create`), each
//! node killable, pausable and observable by port. Fails (never skips) when the binaries
//! are missing.

use std::process::Command;
use std::time::{Duration, Instant};

use super::{free_port, RedisServer};

/// One node of the cluster.
pub struct ClusterNode {
    /// The server (killed on drop).
    pub server: RedisServer,
    /// Its cluster bus port.
    pub bus_port: u16,
}

/// A running Redis Cluster owned by a test; every node is killed on drop.
pub struct RedisCluster {
    pub nodes: Vec<ClusterNode>,
    _dir: tempfile::TempDir,
}

fn cli() -> String {
    std::env::var("WAYGATE_REDIS_CLI").unwrap_or_else(|_| "redis-cli".into())
}

/// Runs redis-cli with `args`; its stdout, or None when it failed or timed out (10 s).
pub fn redis_cli(args: &[&str]) -> Option<String> {
    let out = Command::new("timeout")
        .arg("10")
        .arg(cli())
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn port_cli(port: u16, args: &[&str]) -> Option<String> {
    let p = port.to_string();
    let mut all = vec!["-h", "127.0.0.1", "-p", &p];
    all.extend_from_slice(args);
    redis_cli(&all)
}

/// A line of `CLUSTER NODES`: (port, is master and not failed, master id for replicas, id).
struct NodeLine {
    id: String,
    port: u16,
    master: bool,
    failed: bool,
    master_id: String,
    slots: Vec<(u16, u16)>,
}

fn parse_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let port = f[1].split(['@', ':']).nth(1)?.parse().ok()?;
            let slots = f[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|a| (a, a)),
                })
                .collect();
            Some(NodeLine {
                id: f[0].to_owned(),
                port,
                master: f[2].contains("master"),
                failed: f[2].contains("fail") && !f[2].contains("fail?"),
                master_id: f[3].to_owned(),
                slots,
            })
        })
        .collect()
}

/// A slot being moved between two masters ([`RedisCluster::begin_slot_move`]).
pub struct SlotMove {
    slot: String,
    from: u16,
    to: u16,
    from_id: String,
    to_id: String,
    masters: Vec<u16>,
}

impl SlotMove {
    /// MIGRATEs `keys` (of the slot) to the importing master.
    pub fn migrate(&self, keys: &[&str]) {
        let port = self.to.to_string();
        let mut args = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "keys"];
        args.extend(keys);
        port_cli(self.from, &args).expect("migrate");
    }

    /// MIGRATEs every key the slot has left on its old master.
    fn migrate_all(&self) {
        for _ in 0..100 {
            let keys = port_cli(self.from, &["cluster", "getkeysinslot", &self.slot, "100"])
                .expect("keys");
            let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                return;
            }
            self.migrate(&keys);
        }
        panic!("slot {}: keys left after 100 migrations", self.slot);
    }
}

impl RedisCluster {
    /// Starts 6 nodes (3 masters, 3 replicas; node timeout 1 s, replicas always eligible
    /// for failover) and waits until every node reports `cluster_state:ok`.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let mut tries = 0;
            loop {
                tries += 1;
                let bus_port = free_port();
                let mut server = RedisServer::unstarted(free_port());
                let conf = dir.path().join(format!("nodes-{}.conf", server.port()));
                let extra: Vec<String> = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    conf.to_str().expect("utf-8 path"),
                    "--cluster-port",
                    &bus_port.to_string(),
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-replica-validity-factor",
                    "0",
                    // A replica's first sync starts at once (Redis waits 5 s by default to
                    // batch replicas), so tests that read replicas need not race it.
                    "--repl-diskless-sync-delay",
                    "0",
                    "--dir",
                    dir.path().to_str().expect("utf-8 path"),
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                if server.start_with(&extra) {
                    nodes.push(ClusterNode { server, bus_port });
                    break;
                }
                assert!(tries < 5, "a cluster node did not start on 5 port pairs");
            }
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.server.port()))
            .collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "1", "--cluster-yes"]);
        redis_cli(&args).expect("redis-cli --cluster create");
        let cluster = Self { nodes, _dir: dir };
        cluster.wait_ok(Duration::from_secs(30));
        cluster.wait_replicas_synced(Duration::from_secs(30));
        cluster
    }

    /// Waits until every running replica has finished its sync with its master
    /// (`master_link_status:up`, no sync in progress).
    pub fn wait_replicas_synced(&self, within: Duration) {
        self.wait_every_node(within, "replicas synced", &["info", "replication"], |i| {
            i.contains("role:master")
                || (i.contains("master_link_status:up") && i.contains("master_sync_in_progress:0"))
        });
    }

    /// Waits until every running node reports `cluster_state:ok` and agrees on the masters.
    pub fn wait_ok(&self, within: Duration) {
        self.wait_every_node(within, "cluster ok", &["cluster", "info"], |i| {
            i.contains("cluster_state:ok")
        });
    }

    /// Waits until `ok` holds for the answer of every running node to `command`.
    fn wait_every_node(
        &self,
        within: Duration,
        what: &str,
        command: &[&str],
        ok: impl Fn(&str) -> bool,
    ) {
        let deadline = Instant::now() + within;
        loop {
            let all = self
                .nodes
                .iter()
                .filter(|n| n.server.is_running())
                .all(|n| port_cli(n.server.port(), command).is_some_and(|i| ok(&i)));
            if all {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis cluster: not {what} in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Bytes the running masters have read from their clients (`total_net_input_bytes`,
    /// summed): what writes cost the cluster, plus a little noise (the replicas'
    /// once-a-second acknowledgements, and the `INFO` commands this sends).
    pub fn masters_input_bytes(&self) -> u64 {
        self.nodes
            .iter()
            .filter(|n| n.server.is_running())
            .filter_map(|n| port_cli(n.server.port(), &["info"]))
            .filter(|info| info.contains("role:master"))
            .filter_map(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("total_net_input_bytes:"))
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
            .sum()
    }

    /// Calls of `command` (lower case, e.g. `evalsha`) the running masters have served
    /// (`INFO commandstats`, summed).
    pub fn masters_calls(&self, command: &str) -> u64 {
        let prefix = format!("cmdstat_{command}:calls=");
        self.nodes
            .iter()
            .filter(|n| n.server.is_running())
            .filter_map(|n| port_cli(n.server.port(), &["info", "all"]))
            .filter(|info| info.contains("role:master"))
            .filter_map(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix(prefix.as_str()))
                    .and_then(|v| v.split(',').next())
                    .and_then(|v| v.trim().parse::<u64>().ok())
            })
            .sum()
    }

    /// The port of a master that does not serve `slot` (the three masters split the slots
    /// in thirds).
    pub fn another_master(&self, slot: u16) -> u16 {
        let (from, _) = self.serving(slot);
        [0, 8_000, 16_000]
            .into_iter()
            .map(|s| self.serving(s).0)
            .find(|&p| p != from)
            .expect("another master")
    }

    /// Moves `slot`, with its keys, to the master on `to` (as `redis-cli --cluster
    /// reshard` does: IMPORTING / MIGRATING, MIGRATE, then SETSLOT NODE on every master),
    /// and waits until every node agrees.
    pub fn move_slot(&self, slot: u16, to: u16) {
        let moving = self.begin_slot_move(slot, to);
        moving.migrate_all();
        self.finish_slot_move(&moving);
    }

    /// Starts moving `slot` to the master on `to`: the slot is MIGRATING on its master and
    /// IMPORTING on `to`, no key moved yet.
    pub fn begin_slot_move(&self, slot: u16, to: u16) -> SlotMove {
        let (from, _) = self.serving(slot);
        assert_ne!(from, to, "slot {slot} is on {to} already");
        let text = port_cli(from, &["cluster", "nodes"]).expect("nodes");
        let lines = parse_nodes(&text);
        let id = |port: u16| {
            lines
                .iter()
                .find(|l| l.port == port)
                .expect("a node on that port")
                .id
                .clone()
        };
        let moving = SlotMove {
            slot: slot.to_string(),
            from,
            to,
            from_id: id(from),
            to_id: id(to),
            masters: lines
                .iter()
                .filter(|l| l.master && !l.failed)
                .map(|l| l.port)
                .collect(),
        };
        let s = &moving.slot;
        port_cli(to, &["cluster", "setslot", s, "importing", &moving.from_id]).expect("importing");
        port_cli(from, &["cluster", "setslot", s, "migrating", &moving.to_id]).expect("migrating");
        moving
    }

    /// Ends a slot move begun with [`RedisCluster::begin_slot_move`]: the keys left move,
    /// every master is told the slot's new node, and every node agrees.
    pub fn finish_slot_move(&self, moving: &SlotMove) {
        moving.migrate_all();
        for &port in &moving.masters {
            port_cli(
                port,
                &["cluster", "setslot", &moving.slot, "node", &moving.to_id],
            )
            .expect("setslot node");
        }
        let slot = moving.slot.parse().expect("a slot");
        self.wait_master(slot, moving.to, Duration::from_secs(10));
    }

    /// Seed URLs of every node (`redis://127.0.0.1:PORT`).
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.server.port()))
            .collect()
    }

    fn any_running_port(&self) -> u16 {
        self.nodes
            .iter()
            .find(|n| n.server.is_running())
            .expect("a running node")
            .server
            .port()
    }

    /// The slot of `key`.
    pub fn slot(&self, key: &str) -> u16 {
        port_cli(self.any_running_port(), &["cluster", "keyslot", key])
            .and_then(|s| s.trim().parse().ok())
            .expect("cluster keyslot")
    }

    /// (master port, replica ports) serving `slot`, as a running node sees it now.
    ///
    /// A node that has just started may not list the master's replica yet (seen once in a
    /// full-suite run: no replica right after `cluster create`), so the view is read again
    /// for up to 15 s until the master has one.
    pub fn serving(&self, slot: u16) -> (u16, Vec<u16>) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let text = port_cli(self.any_running_port(), &["cluster", "nodes"]).expect("nodes");
            let lines = parse_nodes(&text);
            let master = lines
                .iter()
                .find(|l| {
                    l.master && !l.failed && l.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
                })
                .expect("a master serves the slot");
            let replicas: Vec<u16> = lines
                .iter()
                .filter(|l| !l.master && l.master_id == master.id)
                .map(|l| l.port)
                .collect();
            if !replicas.is_empty() || Instant::now() >= deadline {
                return (master.port, replicas);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node on `port`.
    pub fn node(&mut self, port: u16) -> &mut RedisServer {
        &mut self
            .nodes
            .iter_mut()
            .find(|n| n.server.port() == port)
            .expect("a node on that port")
            .server
    }

    /// Waits until `port` is a master serving `slot` (after a failover), as seen by every
    /// running node.
    pub fn wait_master(&self, slot: u16, port: u16, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let agreed = self
                .nodes
                .iter()
                .filter(|n| n.server.is_running())
                .all(|n| {
                    port_cli(n.server.port(), &["cluster", "nodes"]).is_some_and(|t| {
                        parse_nodes(&t).iter().any(|l| {
                            l.port == port
                                && l.master
                                && l.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
                        })
                    })
                });
            if agreed {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {port} did not take over slot {slot} in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

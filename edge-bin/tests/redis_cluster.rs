//! Scale-out issue item 1: the Redis backends on a real Redis Cluster (3 masters, 3
//! replicas, on loopback). The stores behave as on one Redis (the same generic checks);
//! every script touches one slot (keys hash-tagged by the player's store tag, session ids
//! carry it); player records spread over every master; kicks and pushes cross the cluster
//! over pub/sub; fencing tokens keep growing across a failover to a replica that missed
//! the last claim; and a kill -9 of a master under a live edge with write-through drops no
//! session.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;
mod support_redis;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::failover::{new_logins_welcomed, LiveSessions};
use support_redis::cluster::RedisCluster;
use waygate_edge::cluster::redis::{DeliveryResult, PushMessage, RedisConfig, RedisStores};
use waygate_session::resume::{hex_id, player_store_tag};
use waygate_session::store::{MemoryOwnership, OwnershipRegistry as _, SnapshotStore as _};
use waygate_session::testkit::store_contract::{
    ownership_semantics, session_id_of, snapshot_store_semantics,
    snapshot_store_write_through_semantics,
};
use waygate_transport::{TrafficClass, TransportKind};

async fn cluster_stores(cluster: &RedisCluster) -> RedisStores {
    RedisStores::connect_with(RedisConfig::cluster(cluster.urls()))
        .await
        .expect("connect to the cluster")
}

fn player_key(kind: &str, player: &str) -> String {
    format!(
        "waygate:{{{}}}:{kind}:{player}",
        hex_id(&player_store_tag(player))
    )
}

/// GET on a replica (READONLY on the same connection).
fn replica_get(port: u16, key: &str) -> Option<String> {
    let mut child = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .ok()?;
    child
        .stdin
        .take()?
        .write_all(format!("READONLY\nGET {key}\n").as_bytes())
        .ok()?;
    let out = child.wait_with_output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines().nth(1).map(str::to_owned)
}

/// What a group commit of 64 B messages costs a cluster (scale-out issue, item 2): once
/// the edge has read the slot map, the deltas of one master's slots go in one PUT_DELTAS
/// call that names their keys itself (none declared), so a commit of 48 players' deltas
/// (each player a hash tag of its own, as in a game) is one call per master, not 48.
/// Measured, and bounded so a regression to whole writes (~600 B each) or to a call per
/// tag shows; on one Redis the same delta costs ~111 B (`redis_store.rs`). Then a slot
/// moves under the edge's map: the delta whose keys the old master no longer serves fails
/// inside the script and is written whole (EVAL of PUT, keys declared), and every write
/// lands. Then, in the middle of a slot's migration with only its player's fence moved (and
/// that player claimed meanwhile by another edge, so the delta must be fenced), the write
/// is refused or fenced, never taken.
async fn deltas_cost_the_cluster_their_calls(cluster: &RedisCluster, s: &RedisStores) {
    use common::write_through::{one_entry_more, written_sessions};
    let ttl = Duration::from_secs(60);
    let mut written = written_sessions(s, "bytes", 48, ttl).await;
    let commit = |written: &[waygate_session::store::Snapshot], msg_id: u32| {
        let next = one_entry_more(written, msg_id, &[0xa5; 64]);
        async move {
            let (calls, bytes) = (
                cluster.masters_calls("evalsha"),
                cluster.masters_input_bytes(),
            );
            let results = s.snapshots.put_many(&next, ttl).await;
            assert!(results.iter().all(Result::is_ok), "{results:?}");
            let calls = cluster.masters_calls("evalsha") - calls;
            let bytes = cluster.masters_input_bytes() - bytes;
            let written: Vec<_> = next.into_iter().map(|w| w.snapshot).collect();
            (written, calls, bytes)
        }
    };
    // The first commits load the script on every master (EVAL) and read the slot map (in
    // the background: meanwhile a commit goes one call per tag).
    let mut per_master = None;
    for msg_id in 9..40 {
        let (next, calls, _) = commit(&written, msg_id).await;
        written = next;
        if calls <= 3 {
            per_master = Some(msg_id);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let msg_id = per_master.expect("a group commit in one call per master within 3 s");
    // Measured on the next commit (the first may have loaded the script: EVAL).
    let (next, calls, bytes) = commit(&written, msg_id + 1).await;
    written = next;
    assert!(calls <= 3, "{calls} calls for a commit on 3 masters");
    let per_delta = bytes / written.len() as u64;
    eprintln!(
        "{} deltas of one 64 B entry on the cluster: {calls} calls, {bytes} bytes into its \
         masters, {per_delta} per delta",
        written.len()
    );
    assert!(
        per_delta < 200,
        "{per_delta} bytes per 64 B delta on a cluster"
    );
    // A slot moves to another master: the edge's map still has the old one.
    let moved = written[0].player_id.clone();
    let slot = cluster.slot(&player_key("owner", &moved));
    let to = cluster.another_master(slot);
    cluster.move_slot(slot, to);
    let evals = cluster.masters_calls("eval");
    let (next, calls, _) = commit(&written, 50).await;
    let evals = cluster.masters_calls("eval") - evals;
    eprintln!("the commit after slot {slot} moved to {to}: {calls} calls, {evals} EVAL");
    assert!(evals >= 1, "the moved player's delta was not written whole");
    for snap in &next {
        let stored = s
            .snapshots
            .get(&snap.session_id)
            .await
            .expect("get")
            .expect("stored");
        assert_eq!(
            stored.replay.entries().last().map(|e| e.seq),
            snap.replay.entries().last().map(|e| e.seq),
            "{}'s last entry",
            snap.player_id
        );
    }
    // Mid-migration: another edge claims a player (its fence grows past the snapshot's
    // token), then only that fence moves to the importing master. The delta, whose keys
    // the old master now serves only in part, must not be taken.
    let player = next[1].player_id.clone();
    s.ownership
        .claim(&player, &session_id_of(&player, 200), "e2")
        .await
        .expect("claim on another edge");
    let slot = cluster.slot(&player_key("fence", &player));
    let moving = cluster.begin_slot_move(slot, cluster.another_master(slot));
    moving.migrate(&[&player_key("fence", &player)]);
    let after = one_entry_more(&next, 60, &[0x3c; 64]);
    let results = s.snapshots.put_many(&after, ttl).await;
    cluster.finish_slot_move(&moving);
    for (w, r) in after.iter().zip(&results) {
        if w.snapshot.player_id == player {
            eprintln!("mid-migration, {player}'s fenced delta: {r:?}");
            assert!(r.is_err(), "a fenced delta mid-migration was taken: {r:?}");
        } else if cluster.slot(&player_key("fence", &w.snapshot.player_id)) != slot {
            assert!(r.is_ok(), "{}: {r:?}", w.snapshot.player_id);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stores_work_on_a_redis_cluster_as_on_one_redis() {
    ownership_semantics(&MemoryOwnership::new()).await;
    let cluster = RedisCluster::start();
    let s = cluster_stores(&cluster).await;
    snapshot_store_semantics(s.snapshots.as_ref()).await;
    snapshot_store_write_through_semantics(s.snapshots.as_ref()).await;
    ownership_semantics(s.ownership.as_ref()).await;
    deltas_cost_the_cluster_their_calls(&cluster, &s).await;

    // Presence of 300 players: one pipeline per slot, read back with one (split) MGET; the
    // players' records are spread over all three masters.
    let players: Vec<(String, [u8; 16])> = (0..300u32)
        .map(|i| {
            let p = format!("player-{i}");
            let sid = session_id_of(&p, (i % 251) as u8);
            (p, sid)
        })
        .collect();
    s.presence.set_many("e1", &players).await.expect("set_many");
    let names: Vec<&str> = players.iter().map(|(p, _)| p.as_str()).collect();
    let found = s.presence.lookup_many(&names).await.expect("lookup_many");
    for ((p, sid), f) in players.iter().zip(&found) {
        let f = f.as_ref().unwrap_or_else(|| panic!("{p} not found"));
        assert_eq!((f.edge.as_str(), &f.session_id), ("e1", sid));
    }
    let masters: BTreeSet<u16> = players
        .iter()
        .take(30)
        .map(|(p, _)| cluster.serving(cluster.slot(&player_key("presence", p))).0)
        .collect();
    assert_eq!(masters.len(), 3, "30 players on masters {masters:?}");
    // A player's owner record, fence counter, presence and snapshot share one slot.
    let snap_key = format!(
        "waygate:{{{}}}:snap:{}",
        hex_id(&player_store_tag("player-7")),
        hex_id(&session_id_of("player-7", 1))
    );
    let slot = cluster.slot(&player_key("owner", "player-7"));
    assert_eq!(cluster.slot(&player_key("fence", "player-7")), slot);
    assert_eq!(cluster.slot(&snap_key), slot);

    // A takeover on another edge kicks over the cluster's pub/sub, whichever node each
    // edge's subscription and the claim's master are on.
    let other = cluster_stores(&cluster).await;
    let (mut kicks, mut up) = s.ownership.subscribe_kicks_with_status("e1");
    tokio::time::timeout(Duration::from_secs(5), up.wait_for(|u| *u))
        .await
        .expect("subscribed")
        .expect("watch");
    for i in 0..20u8 {
        let p = format!("kicked-{i}");
        let first = s
            .ownership
            .claim(&p, &session_id_of(&p, 1), "e1")
            .await
            .expect("claim");
        let second = other
            .ownership
            .claim(&p, &session_id_of(&p, 2), "e2")
            .await
            .expect("claim");
        let k = tokio::time::timeout(Duration::from_secs(3), kicks.recv())
            .await
            .expect("kick within 3 s")
            .expect("open");
        assert_eq!(
            (k.player_id.as_str(), k.session_id, k.fencing, k.new_fencing),
            (
                p.as_str(),
                session_id_of(&p, 1),
                first.fencing,
                second.fencing
            )
        );
    }

    // A batch pushed to another edge: one result per message.
    let mut server = other
        .presence
        .serve_pushes("e2", |player: &str, _m: PushMessage| {
            if player == "here" {
                DeliveryResult::Delivered
            } else {
                DeliveryResult::Offline
            }
        });
    assert!(server.wait_up(Duration::from_secs(5)).await);
    let m = PushMessage {
        class: TrafficClass::Normal,
        msg_id: 1,
        payload: bytes::Bytes::from_static(b"hi"),
        id: 0,
    };
    let r = s
        .presence
        .push_batch("e2", vec![("here".into(), m.clone()), ("gone".into(), m)])
        .await
        .expect("push");
    assert_eq!(r, vec![DeliveryResult::Delivered, DeliveryResult::Offline]);
}

/// The claim that makes a new owner reached the master but not its replica; the master is
/// killed and the replica takes over. The next claim must still get a larger fencing token
/// than every token issued before, or two owners hold the same token. (With the counter
/// alone — INCR of what the replica had — the new owner got the lost claim's token again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_growing_across_a_failover_that_lost_the_last_claim() {
    let mut cluster = RedisCluster::start();
    let s = cluster_stores(&cluster).await;
    let player = "fenced";
    let fence_key = player_key("fence", player);
    let slot = cluster.slot(&fence_key);
    let (master, replicas) = cluster.serving(slot);
    let replica = replicas[0];

    let first = s
        .ownership
        .claim(player, &session_id_of(player, 1), "e1")
        .await
        .expect("claim");
    // The replica has the first claim...
    let deadline = Instant::now() + Duration::from_secs(5);
    while replica_get(replica, &fence_key) != Some(first.fencing.to_string()) {
        assert!(
            Instant::now() < deadline,
            "the replica never got the first claim"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // ...but not the second: it is frozen and its replication link cut (bytes already in
    // its socket would still arrive after a thaw) while the master takes it.
    cluster.node(replica).pause();
    support_redis::cluster::redis_cli(&[
        "-h",
        "127.0.0.1",
        "-p",
        &master.to_string(),
        "CLIENT",
        "KILL",
        "TYPE",
        "replica",
    ])
    .expect("cut the replication link");
    let second = s
        .ownership
        .claim(player, &session_id_of(player, 2), "e2")
        .await
        .expect("claim");
    assert!(second.fencing > first.fencing);
    cluster.node(master).stop(); // kill -9: the second claim dies with it
    cluster.node(replica).resume();
    cluster.wait_master(slot, replica, Duration::from_secs(30));
    cluster.wait_ok(Duration::from_secs(30));
    assert_eq!(
        replica_get(replica, &fence_key),
        Some(first.fencing.to_string()),
        "the promoted replica lost the second claim (the case under test)"
    );

    let deadline = Instant::now() + Duration::from_secs(15);
    let third = loop {
        match s
            .ownership
            .claim(player, &session_id_of(player, 3), "e3")
            .await
        {
            Ok(g) => break g,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "no claim after the failover: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(
        third.fencing > second.fencing,
        "token {} after the failover is not above the lost claim's {}: two owners share it",
        third.fencing,
        second.fencing
    );
}

/// An edge on the cluster with write-through on, 24 live sessions echoing; the master that
/// holds the first player's slot is killed (-9). Every session keeps its session (no new
/// WELCOME, no close), every echo gets its reply, and once the replica took over, new
/// logins work and every player's owner record still names its live session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_drops_no_session_of_a_live_edge() {
    let mut cluster = RedisCluster::start();
    let urls = cluster.urls();
    let (edge, _b, _d) = common::demo_edge(move |c| {
        c.cluster.redis_cluster = urls;
        c.cluster.reassert_ms = 1_000;
    })
    .await;
    let tcp = edge.addrs[&TransportKind::Tcp];
    let mut live = LiveSessions::start(tcp, 24).await;
    let slot = cluster.slot(&player_key("owner", &live.clients[0].0));
    let (master, replicas) = cluster.serving(slot);
    let on_master = live
        .clients
        .iter()
        .filter(|(p, _)| cluster.serving(cluster.slot(&player_key("owner", p))).0 == master)
        .count();
    eprintln!("{on_master} of 24 players have their records on the master to be killed");

    cluster.node(master).stop();
    // Traffic through the failover (and a little after it).
    let rounds = live.echo_rounds(Duration::from_secs(8)).await;
    eprintln!("{rounds} echo rounds of 24 sessions through the failover");
    cluster.wait_master(slot, replicas[0], Duration::from_secs(30));

    // New logins (some on the failed-over slots) are welcomed again.
    new_logins_welcomed(tcp, 12, Duration::from_secs(15)).await;
    // One owner each, the live session (the re-assert sweep restores what the failover lost).
    let s = cluster_stores(&cluster).await;
    live.assert_owners(&s.ownership, Duration::from_secs(10))
        .await;
}

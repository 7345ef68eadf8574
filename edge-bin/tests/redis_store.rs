//! The Redis snapshot store and ownership registry against a real redis-server 7: the
//! in-memory implementations' behaviour (the same generic checks run on both), fencing
//! under takeover, single-use resume tokens under a race of two edges, and one owner per
//! player when two edges log the same player in at once (1,000 trials).

mod common;
mod support_pki;
mod support_redis;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::write_through::{one_entry_more, written_sessions};
use support_redis::RedisServer;
use waygate_edge::cluster::redis::{KickNotice, Reassert, RedisConfig, RedisStores, ResumeKeySeal};
use waygate_session::resume::ResumeHash;
use waygate_session::store::{
    MemoryOwnership, MemorySnapshotStore, OwnershipRegistry, Snapshot, SnapshotStore,
    SnapshotWrite, StoreError, TakeOutcome,
};
use waygate_transport::TrafficClass;

use waygate_session::testkit::store_contract::{
    ownership_semantics, session_id_of, snapshot, snapshot_store_semantics,
    snapshot_store_write_through_semantics,
};

/// A plain connection to `server`, for looking at what the stores wrote.
async fn raw_connection(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

async fn stores(server: &RedisServer) -> RedisStores {
    RedisStores::connect(&server.url()).await.expect("connect")
}

#[tokio::test]
async fn snapshot_store_behaves_like_the_memory_store() {
    snapshot_store_semantics(&MemorySnapshotStore::new()).await;
    let server = RedisServer::start();
    let s = stores(&server).await;
    snapshot_store_semantics(s.snapshots.as_ref()).await;
    snapshot_store_write_through_semantics(s.snapshots.as_ref()).await;
}

#[tokio::test]
async fn ownership_behaves_like_the_memory_registry() {
    ownership_semantics(&MemoryOwnership::new()).await;
    let server = RedisServer::start();
    let s = stores(&server).await;
    ownership_semantics(s.ownership.as_ref()).await;
}

#[tokio::test]
async fn owner_record_expires_after_the_linger_ttl_but_fencing_keeps_growing() {
    let server = RedisServer::start();
    let mut cfg = RedisConfig::new(server.url());
    cfg.owner_ttl = Duration::from_millis(200);
    cfg.fence_ttl = Some(Duration::from_millis(200));
    let s = RedisStores::connect_with(cfg).await.expect("connect");
    let a = s.ownership.claim("p", &[1; 16], "e1").await.expect("claim");
    assert!(s.ownership.owner("p").await.expect("owner").is_some());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        s.ownership.owner("p").await,
        Ok(None),
        "owner record expired"
    );
    // The counter expired too; the next token is still larger (seeded from the clock).
    let b = s.ownership.claim("p", &[2; 16], "e1").await.expect("claim");
    assert_eq!(b.previous, None);
    assert!(b.fencing > a.fencing);
}

#[tokio::test]
async fn a_live_owner_record_stays_and_a_detached_one_expires_with_its_snapshot() {
    let server = RedisServer::start();
    let s = stores(&server).await;
    let live = s
        .ownership
        .claim("live", &session_id_of("live", 1), "e1")
        .await
        .expect("claim");
    let gone = s
        .ownership
        .claim("gone", &session_id_of("gone", 2), "e1")
        .await
        .expect("claim");
    // "gone" detaches: its snapshot is written with the linger time.
    s.snapshots
        .put(
            &snapshot(2, "gone", gone.fencing),
            Duration::from_millis(200),
        )
        .await
        .expect("put");
    // A stale snapshot of "live" (older token) neither writes nor shortens the record.
    assert!(s
        .snapshots
        .put(
            &snapshot(1, "live", live.fencing - 1),
            Duration::from_millis(200)
        )
        .await
        .is_err());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(s.ownership.owner("gone").await, Ok(None), "lingered out");
    assert_eq!(s.snapshots.get(&session_id_of("gone", 2)).await, Ok(None));
    let owner = s
        .ownership
        .owner("live")
        .await
        .expect("owner")
        .expect("live record stays");
    assert_eq!(owner.fencing, live.fencing);
    // A restore claims again: the record is a live one again.
    let again = s
        .ownership
        .claim("gone", &session_id_of("gone", 2), "e2")
        .await
        .expect("claim");
    assert!(again.fencing > gone.fencing);
}

#[tokio::test]
async fn a_stale_owner_is_fenced_out_of_writes_releases_and_deletes() {
    let server = RedisServer::start();
    let edge_a = stores(&server).await;
    let edge_b = stores(&server).await;
    let sid = session_id_of("p", 7);
    // Edge A owns the session and persists it on detach.
    let a = edge_a
        .ownership
        .claim("p", &sid, "ea")
        .await
        .expect("claim");
    let mut snap = snapshot(7, "p", a.fencing);
    edge_a
        .snapshots
        .put(&snap, Duration::from_secs(60))
        .await
        .expect("put");
    // The client resumes on edge B: take, claim, persist with the new token.
    let taken = edge_b
        .snapshots
        .take(&sid, &ResumeHash::of(&[2; 16]))
        .await
        .expect("take");
    assert!(matches!(taken, TakeOutcome::Taken(_)));
    let b = edge_b
        .ownership
        .claim("p", &sid, "eb")
        .await
        .expect("claim");
    assert!(b.fencing > a.fencing);
    snap.fencing = b.fencing;
    snap.resume_hash = ResumeHash::of(&[5; 16]);
    edge_b
        .snapshots
        .put(&snap, Duration::from_secs(60))
        .await
        .expect("put");
    // Edge A wakes up (e.g. after SIGSTOP) and writes with its old token: refused.
    let mut stale = snapshot(7, "p", a.fencing);
    stale.bindings.insert("world".into(), "stale".into());
    let err = edge_a
        .snapshots
        .put(&stale, Duration::from_secs(60))
        .await
        .expect_err("fenced");
    assert!(matches!(err, StoreError::Fenced), "{err:?}");
    assert_eq!(
        edge_a.snapshots.delete(&sid, Some(a.fencing)).await,
        Ok(false)
    );
    assert_eq!(
        edge_a.ownership.release("p", &sid, a.fencing).await,
        Ok(false)
    );
    assert_eq!(
        edge_a.ownership.reassert("p", &sid, "ea", a.fencing).await,
        Ok(Reassert::Superseded(Some(waygate_session::store::Owner {
            session_id: sid,
            edge: "eb".into(),
            fencing: b.fencing,
        })))
    );
    // A different, stale session of the player is fenced too.
    let other = snapshot(8, "p", a.fencing);
    assert!(edge_a
        .snapshots
        .put(&other, Duration::from_secs(60))
        .await
        .is_err());
    // Edge B's state is intact.
    assert_eq!(edge_b.snapshots.get(&sid).await, Ok(Some(snap.clone())));
    assert_eq!(
        edge_b
            .ownership
            .owner("p")
            .await
            .expect("owner")
            .map(|o| o.edge),
        Some("eb".into())
    );
    assert_eq!(
        edge_b.ownership.reassert("p", &sid, "eb", b.fencing).await,
        Ok(Reassert::Owner)
    );
    assert_eq!(
        edge_b.snapshots.delete(&sid, Some(b.fencing)).await,
        Ok(true)
    );
    assert_eq!(
        edge_b.ownership.release("p", &sid, b.fencing).await,
        Ok(true)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_is_single_use_under_a_race_of_two_edges() {
    let server = RedisServer::start();
    let edge_a = Arc::new(stores(&server).await);
    let edge_b = Arc::new(stores(&server).await);
    let hash = ResumeHash::of(&[2; 16]);
    for trial in 0..300u32 {
        let s = snapshot((trial % 251) as u8, &format!("p{trial}"), 1);
        let sid = s.session_id;
        edge_a
            .snapshots
            .put(&s, Duration::from_secs(60))
            .await
            .expect("put");
        let (a, b) = (edge_a.clone(), edge_b.clone());
        let ta = tokio::spawn(async move { a.snapshots.take(&sid, &hash).await });
        let tb = tokio::spawn(async move { b.snapshots.take(&sid, &hash).await });
        let ra = ta.await.expect("join").expect("take a");
        let rb = tb.await.expect("join").expect("take b");
        let taken = [&ra, &rb]
            .iter()
            .filter(|r| matches!(r, TakeOutcome::Taken(_)))
            .count();
        assert_eq!(taken, 1, "trial {trial}: {ra:?} / {rb:?}");
        assert!(
            matches!(ra, TakeOutcome::NotFound) || matches!(rb, TakeOutcome::NotFound),
            "the loser sees NotFound"
        );
    }
}

async fn next_kick(rx: &mut tokio::sync::mpsc::Receiver<KickNotice>) -> KickNotice {
    tokio::time::timeout(Duration::from_secs(2), rx.recv())
        .await
        .expect("kick within 2 s")
        .expect("subscription open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_logging_in_the_same_player_1000_times_yield_one_owner_each_time() {
    let server = RedisServer::start();
    let edge_a = Arc::new(stores(&server).await);
    let edge_b = Arc::new(stores(&server).await);
    let (mut kicks_a, mut up_a) = edge_a.ownership.subscribe_kicks_with_status("ea");
    let (mut kicks_b, mut up_b) = edge_b.ownership.subscribe_kicks_with_status("eb");
    for up in [&mut up_a, &mut up_b] {
        tokio::time::timeout(Duration::from_secs(5), up.wait_for(|u| *u))
            .await
            .expect("subscribed")
            .expect("watch");
    }
    let mut last = 0u64;
    let (mut wins_a, mut wins_b) = (0, 0);
    for trial in 0..1000u32 {
        let sa = [
            (trial % 200) as u8,
            0xa,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            1,
        ];
        let sb = [
            (trial % 200) as u8,
            0xb,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            2,
        ];
        let (a, b) = (edge_a.clone(), edge_b.clone());
        let ta = tokio::spawn(async move { a.ownership.claim("p", &sa, "ea").await });
        let tb = tokio::spawn(async move { b.ownership.claim("p", &sb, "eb").await });
        let ga = ta.await.expect("join").expect("claim a");
        let gb = tb.await.expect("join").expect("claim b");
        assert_ne!(ga.fencing, gb.fencing);
        assert!(
            ga.fencing.min(gb.fencing) > last,
            "fencing strictly increasing"
        );
        last = ga.fencing.max(gb.fencing);
        // The later claim took over from the earlier; the earlier saw nobody.
        let (winner, loser_sid, loser_fencing, loser_kicks, win_edge) = if gb.fencing > ga.fencing {
            wins_b += 1;
            assert_eq!(ga.previous, None, "trial {trial}");
            assert_eq!(gb.previous.as_ref().map(|o| o.session_id), Some(sa));
            (sb, sa, ga.fencing, &mut kicks_a, "eb")
        } else {
            wins_a += 1;
            assert_eq!(gb.previous, None, "trial {trial}");
            assert_eq!(ga.previous.as_ref().map(|o| o.session_id), Some(sb));
            (sa, sb, gb.fencing, &mut kicks_b, "ea")
        };
        let owner = edge_a
            .ownership
            .owner("p")
            .await
            .expect("owner")
            .expect("some");
        assert_eq!(
            (owner.session_id, owner.fencing),
            (winner, last),
            "trial {trial}"
        );
        // The loser's edge is told to kick exactly the loser.
        let k = next_kick(loser_kicks).await;
        assert_eq!(
            (
                k.player_id.as_str(),
                k.session_id,
                k.fencing,
                k.new_fencing,
                k.by_edge.as_str()
            ),
            ("p", loser_sid, loser_fencing, last, win_edge),
            "trial {trial}"
        );
        // The loser cannot release; the winner logs out.
        assert_eq!(
            edge_a
                .ownership
                .release("p", &loser_sid, loser_fencing)
                .await,
            Ok(false)
        );
        assert_eq!(edge_b.ownership.release("p", &winner, last).await, Ok(true));
    }
    // No stray kicks.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(kicks_a.try_recv().is_err() && kicks_b.try_recv().is_err());
    assert_eq!(wins_a + wins_b, 1000);
    eprintln!("winners: edge a {wins_a}, edge b {wins_b}");
}

#[tokio::test]
async fn no_kick_is_published_for_a_takeover_on_the_same_edge() {
    let server = RedisServer::start();
    let s = stores(&server).await;
    let (mut kicks, mut up) = s.ownership.subscribe_kicks_with_status("e1");
    tokio::time::timeout(Duration::from_secs(5), up.wait_for(|u| *u))
        .await
        .expect("subscribed")
        .expect("watch");
    s.ownership.claim("p", &[1; 16], "e1").await.expect("claim");
    s.ownership.claim("p", &[2; 16], "e1").await.expect("claim");
    // The driver kicks same-edge sessions itself; another edge's claim publishes.
    let c = s.ownership.claim("p", &[3; 16], "e2").await.expect("claim");
    let k = next_kick(&mut kicks).await;
    assert_eq!((k.session_id, k.new_fencing), ([2; 16], c.fencing));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(kicks.try_recv().is_err());
    // Edge ids with spaces cannot be stored.
    assert!(s.ownership.claim("p", &[4; 16], "bad edge").await.is_err());
}

#[tokio::test]
async fn many_snapshots_are_written_in_one_pipeline_with_a_result_each() {
    let server = RedisServer::start();
    let s = stores(&server).await;
    let mut batch = Vec::new();
    for i in 0..20u8 {
        let p = format!("g{i}");
        let g = s
            .ownership
            .claim(&p, &session_id_of(&p, i), "e1")
            .await
            .expect("claim");
        batch.push(snapshot(i, &p, g.fencing));
    }
    // A stale copy (older token than its player's), and one whose id lacks its tag.
    batch[5].fencing -= 1;
    batch[9].session_id = [9; 16];
    // Redis lost its scripts (a restart, a failover): the pipeline loads them again.
    let mut c = raw_connection(&server).await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut c)
        .await
        .expect("flush");
    let writes: Vec<SnapshotWrite> = batch.iter().cloned().map(SnapshotWrite::whole).collect();
    let results = s.snapshots.put_many(&writes, Duration::from_secs(60)).await;
    assert_eq!(results.len(), 20);
    for (i, r) in results.iter().enumerate() {
        match i {
            5 => assert_eq!(r, &Err(StoreError::Fenced)),
            9 => assert!(matches!(r, Err(StoreError::Unavailable(m)) if m.contains("store tag"))),
            _ => {
                assert_eq!(r, &Ok(()), "snapshot {i}");
                assert_eq!(
                    s.snapshots.get(&batch[i].session_id).await,
                    Ok(Some(batch[i].clone()))
                );
            }
        }
    }
}

#[tokio::test]
async fn snapshots_are_stored_compactly_and_an_older_edges_json_is_still_read() {
    use waygate_session::resume::{hex_id, player_store_tag};
    let server = RedisServer::start();
    let s = stores(&server).await;
    let snap = snapshot(3, "old", 1);
    s.snapshots
        .put(&snap, Duration::from_secs(60))
        .await
        .expect("put");
    let key = format!(
        "waygate:{{{}}}:snap:{}",
        hex_id(&player_store_tag("old")),
        hex_id(&snap.session_id)
    );
    let mut c = raw_connection(&server).await;
    let stored: Vec<u8> = redis::cmd("HGET")
        .arg(&key)
        .arg("d")
        .query_async(&mut c)
        .await
        .expect("hget");
    let json = serde_json::to_vec(&snap).expect("json");
    eprintln!(
        "snapshot: {} bytes stored, {} as JSON",
        stored.len(),
        json.len()
    );
    assert!(
        stored.len() < json.len(),
        "{} vs {}",
        stored.len(),
        json.len()
    );
    // An edge of the previous release wrote JSON there: read during a rolling upgrade.
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("d")
        .arg(&json)
        .query_async(&mut c)
        .await
        .expect("hset");
    assert_eq!(s.snapshots.get(&snap.session_id).await, Ok(Some(snap)));
}

/// A counter of Redis' `INFO stats`: `total_net_input_bytes` (bytes read from clients) or
/// `total_reads_processed` (read events: one per client round trip, a small pipeline being
/// read at once).
async fn redis_stat(c: &mut redis::aio::MultiplexedConnection, name: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(c)
        .await
        .expect("info");
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .expect(name)
}

/// Redis' `INFO commandstats`, read with [`calls`].
async fn command_stats(c: &mut redis::aio::MultiplexedConnection) -> String {
    redis::cmd("INFO")
        .arg("commandstats")
        .query_async(c)
        .await
        .expect("info")
}

/// How many times `cmd` (lower case) ran, in an `INFO commandstats` text.
fn calls(info: &str, cmd: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
        .and_then(|v| v.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

async fn redis_input_bytes(c: &mut redis::aio::MultiplexedConnection) -> u64 {
    redis_stat(c, "total_net_input_bytes").await
}

async fn redis_reads(c: &mut redis::aio::MultiplexedConnection) -> u64 {
    redis_stat(c, "total_reads_processed").await
}

/// Regression (CI: every session of an edge called its link dead around a Redis restart):
/// a Redis that comes back empty (no scripts, no records) costs a group commit of deltas a
/// few round trips, not two per session. Before the fix each write whose script was lost
/// was sent again alone, and each delta whose base was gone was written whole alone: a
/// group of 50 cost ~100 sequential round trips while every session in it held its output.
#[tokio::test]
async fn a_redis_that_came_back_empty_costs_a_group_commit_a_few_round_trips() {
    let server = RedisServer::start();
    let s = stores(&server).await;
    let mut c = raw_connection(&server).await;
    let ttl = Duration::from_secs(60);
    let snaps = written_sessions(&s, "back", 50, ttl).await;
    // The restart: records and scripts gone.
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut c)
        .await
        .expect("flushall");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut c)
        .await
        .expect("flush");
    let deltas = one_entry_more(&snaps, 7, b"after the restart");
    let before = redis_reads(&mut c).await;
    let results = s.snapshots.put_many(&deltas, ttl).await;
    let reads = redis_reads(&mut c).await - before;
    assert_eq!(results, vec![Ok(()); 50]);
    for w in &deltas {
        assert_eq!(
            s.snapshots.get(&w.snapshot.session_id).await,
            Ok(Some(w.snapshot.clone()))
        );
    }
    eprintln!("50 deltas into an emptied Redis: {reads} reads (one of them the INFO)");
    // EVALSHA (scripts lost), EVAL (bases lost), EVAL of the whole records (~75 KiB of
    // script text: a few reads), the INFO.
    assert!(reads <= 25, "{reads} reads for one group commit");
}

/// On one Redis a group commit's deltas are one script call for all of them, its
/// arguments packed (scale-out issue, item 2): before, each session's delta was a call of
/// its own with its three keys and a dozen arguments (~300 bytes beside a 64 B entry; the
/// W2 bench measured 485 bytes into Redis per echo). Each delta still gets its own answer:
/// a session fenced by a newer claim is refused, one whose stored record is gone is
/// written whole, and the owner record of a session that owns its player expires with the
/// snapshot, as when each was a call of its own.
#[tokio::test]
async fn a_group_commit_on_one_redis_sends_its_deltas_in_one_packed_call() {
    const N: u8 = 50;
    let server = RedisServer::start();
    let s = stores(&server).await;
    let mut c = raw_connection(&server).await;
    let ttl = Duration::from_secs(60);
    let snaps = written_sessions(&s, "group", N, ttl).await;
    // Player 7 claimed by a newer session since; session 13's record is gone; player 0's
    // owner record made persistent, so the write's expiry shows.
    s.ownership
        .claim("group-7", &session_id_of("group-7", 200), "e2")
        .await
        .expect("newer claim");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut c)
        .await
        .expect("keys");
    let snap_key = |i: usize| {
        let hex = waygate_session::resume::hex_id(&snaps[i].session_id);
        keys.iter()
            .find(|k| k.ends_with(&hex))
            .expect("the session's key")
            .clone()
    };
    let owner0 = keys
        .iter()
        .find(|k| k.contains(":owner:") && k.ends_with(":group-0"))
        .expect("player 0's owner record");
    // Session 13's record gone; session 21's as an edge before PUT_DELTAS wrote it (no
    // player id in `l`); session 33's key holding something else than a record (Redis
    // refuses the delta's commands, and only that delta fails).
    let mut setup = redis::pipe();
    setup
        .cmd("DEL")
        .arg(snap_key(13))
        .cmd("HDEL")
        .arg(snap_key(21))
        .arg("l")
        .cmd("SET")
        .arg(snap_key(33))
        .arg("not a hash");
    let _: () = setup.query_async(&mut c).await.expect("setup");
    let _: () = redis::cmd("PERSIST")
        .arg(owner0)
        .query_async(&mut c)
        .await
        .expect("persist");
    let deltas = one_entry_more(&snaps, 9, &[0x5a; 64]);
    // The scripts are loaded already: the whole writes above, and one delta.
    let warm = [deltas[1].clone()];
    assert_eq!(s.snapshots.put_many(&warm, ttl).await, vec![Ok(())]);
    let mut deltas = deltas;
    deltas[1] = SnapshotWrite {
        snapshot: deltas[1].snapshot.clone(),
        since: Some(Box::new(deltas[1].snapshot.clone())),
    };
    let before_info = command_stats(&mut c).await;
    let results = s.snapshots.put_many(&deltas, ttl).await;
    let after_info = command_stats(&mut c).await;
    for (i, r) in results.iter().enumerate() {
        if i == 33 {
            assert!(matches!(r, Err(StoreError::Corrupt(_))), "write {i}: {r:?}");
        } else if i == 7 {
            assert_eq!(r, &Err(StoreError::Fenced), "write {i}");
            assert_eq!(
                s.snapshots.get(&snaps[7].session_id).await,
                Ok(Some(snaps[7].clone())),
                "a fenced delta leaves the record as it was"
            );
        } else {
            assert_eq!(r, &Ok(()), "write {i}");
            assert_eq!(
                s.snapshots.get(&deltas[i].snapshot.session_id).await,
                Ok(Some(deltas[i].snapshot.clone())),
                "write {i}"
            );
        }
    }
    let owner_ttl: i64 = redis::cmd("PTTL")
        .arg(owner0)
        .query_async(&mut c)
        .await
        .expect("pttl");
    assert!(
        owner_ttl > 0 && owner_ttl <= 60_000,
        "player 0's owner record expires with its snapshot: pttl {owner_ttl}"
    );
    // One EVALSHA for the 50 deltas; sessions 13 and 21 again, whole (EVAL, as every write
    // made whole after its base was found missing).
    assert_eq!(
        calls(&after_info, "evalsha") - calls(&before_info, "evalsha"),
        1
    );
    assert_eq!(calls(&after_info, "eval") - calls(&before_info, "eval"), 2);
    // What a group commit of 64 B messages costs Redis now: the next message of each.
    let written: Vec<Snapshot> = deltas
        .into_iter()
        .enumerate()
        .filter(|&(i, _)| i != 7 && i != 33)
        .map(|(_, w)| w.snapshot)
        .collect();
    let next = one_entry_more(&written, 10, &[0xa5; 64]);
    let before = redis_input_bytes(&mut c).await;
    let results = s.snapshots.put_many(&next, ttl).await;
    let bytes = redis_input_bytes(&mut c).await - before;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let per_delta = bytes / next.len() as u64;
    eprintln!(
        "{} deltas of one 64 B entry: {bytes} bytes into Redis (and one INFO), {per_delta} per delta",
        next.len()
    );
    // The entry is the 64 B payload and its ~5 B header; the session's own fields (its id,
    // fencing token, entry spans and counters) ~40 B (143 B a delta before they were packed
    // as varints and the entries named by their spans).
    assert!(
        per_delta <= 128,
        "{per_delta} bytes per 64 B delta: more than twice the payload"
    );
}

/// A delta names no replay entry (2026-12-05): PUT_DELTAS derives the entries to drop and
/// to add from the record's entry span before and after (first seq, count), and takes the
/// new entries' values in seq order. Every shape a replay buffer goes through — an entry
/// added to a held one, some or all acknowledged, added to an empty one, a declared loss
/// (a gap of seqs between the spans), evictions, new push ids — goes as a delta (the
/// script's one HMGET, never a whole write's DEL) and reads back equal to the session.
#[tokio::test]
async fn every_replay_change_goes_as_a_delta_and_reads_back_equal() {
    let server = RedisServer::start();
    let s = stores(&server).await;
    let mut c = raw_connection(&server).await;
    let ttl = Duration::from_secs(60);
    let mut snap = written_sessions(&s, "spans", 1, ttl).await.remove(0);
    let push = |s: &mut Snapshot, n: u32| {
        for i in 0..n {
            s.replay.push(
                TrafficClass::Normal,
                100 + i,
                Bytes::from(vec![i as u8; 64]),
            );
        }
    };
    let ack = |s: &mut Snapshot, seq: u64| {
        s.replay.ack(seq).expect("ack of a sent seq");
    };
    type Step<'a> = (&'a str, Box<dyn Fn(&mut Snapshot) + 'a>);
    let steps: Vec<Step<'_>> = vec![
        ("one added to two held", Box::new(|s| push(s, 1))),
        ("two of three acknowledged", Box::new(|s| ack(s, 2))),
        (
            "the rest acknowledged, two added",
            Box::new(|s| {
                ack(s, 3);
                push(s, 2);
            }),
        ),
        ("all acknowledged", Box::new(|s| ack(s, 5))),
        ("two added to none", Box::new(|s| push(s, 2))),
        (
            "a declared loss, then one added",
            Box::new(|s| {
                s.replay.declare_lost(5);
                push(s, 1);
            }),
        ),
        (
            "new push ids, one added",
            Box::new(|s| {
                s.push_ids = vec![42, 43];
                push(s, 1);
            }),
        ),
        ("nothing new", Box::new(|_| {})),
        // The default replay limit is 1,024 messages: the oldest are evicted.
        ("1,030 added: evictions", Box::new(|s| push(s, 1030))),
        (
            "some acknowledged, some added",
            Box::new(|s| {
                let mid = s.replay.acked() + 500;
                ack(s, mid);
                push(s, 3);
            }),
        ),
    ];
    for (what, step) in &steps {
        let since = snap.clone();
        step(&mut snap);
        let before = command_stats(&mut c).await;
        let write = SnapshotWrite {
            snapshot: snap.clone(),
            since: Some(Box::new(since)),
        };
        assert_eq!(
            s.snapshots.put_many(&[write], ttl).await,
            vec![Ok(())],
            "{what}"
        );
        let after = command_stats(&mut c).await;
        assert_eq!(
            (
                calls(&after, "hmget") - calls(&before, "hmget"),
                calls(&after, "del") - calls(&before, "del")
            ),
            (1, 0),
            "{what}: one delta, not a whole write"
        );
        assert_eq!(
            s.snapshots.get(&snap.session_id).await,
            Ok(Some(snap.clone())),
            "{what}"
        );
        // An entry's value holds its seq, so the read above would not see a value stored
        // under another entry's name: the names themselves.
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*:snap:*")
            .query_async(&mut c)
            .await
            .expect("keys");
        let [key] = &keys[..] else {
            panic!("one snapshot record: {keys:?}")
        };
        let fields: Vec<String> = redis::cmd("HKEYS")
            .arg(key)
            .query_async(&mut c)
            .await
            .expect("hkeys");
        let mut named: Vec<u64> = fields
            .iter()
            .filter_map(|f| f.strip_prefix('e')?.parse().ok())
            .collect();
        named.sort_unstable();
        let held: Vec<u64> = snap.replay.entries().map(|e| e.seq).collect();
        assert_eq!(named, held, "{what}: the entry fields");
    }
    assert!(
        snap.replay.evicted_through() > 13,
        "the steps evicted entries"
    );
}

/// Write-through cost is bounded by what changed (scale-out issue, item 2): a session whose
/// client holds 200 unacknowledged messages of 1 KiB costs one whole write of them, and
/// then each new message costs Redis its own bytes plus the session's header, not the
/// 200 KiB again (before deltas, every write sent the whole replay buffer).
#[tokio::test]
async fn a_write_through_sends_what_changed_not_the_whole_replay_buffer() {
    let server = RedisServer::start();
    let s = stores(&server).await;
    let mut c = raw_connection(&server).await;
    let g = s
        .ownership
        .claim("reader", &session_id_of("reader", 1), "e1")
        .await
        .expect("claim");
    let mut snap = snapshot(1, "reader", g.fencing);
    for i in 0..200u32 {
        snap.replay
            .push(TrafficClass::Normal, i, Bytes::from(vec![7u8; 1024]));
    }
    let ttl = Duration::from_secs(60);
    // The first writes load the two scripts into Redis (and send their arguments again):
    // the figures are taken after that.
    let whole_write = || [SnapshotWrite::whole(snap.clone())];
    assert_eq!(
        s.snapshots.put_many(&whole_write(), ttl).await,
        vec![Ok(())]
    );
    let before = redis_input_bytes(&mut c).await;
    assert_eq!(
        s.snapshots.put_many(&whole_write(), ttl).await,
        vec![Ok(())]
    );
    let whole = redis_input_bytes(&mut c).await - before;
    let mut since = snap.clone();
    let mut per_message = Vec::new();
    for i in 0..11u32 {
        snap.replay
            .push(TrafficClass::Normal, 1000 + i, Bytes::from(vec![9u8; 64]));
        let before = redis_input_bytes(&mut c).await;
        let write = SnapshotWrite {
            snapshot: snap.clone(),
            since: Some(Box::new(since)),
        };
        assert_eq!(s.snapshots.put_many(&[write], ttl).await, vec![Ok(())]);
        if i > 0 {
            per_message.push(redis_input_bytes(&mut c).await - before);
        }
        since = snap.clone();
    }
    assert_eq!(
        s.snapshots.get(&snap.session_id).await,
        Ok(Some(snap.clone()))
    );
    eprintln!("whole write {whole} B; a 64 B message after it: {per_message:?} B (each including one INFO command)");
    assert!(whole > 200 * 1024, "{whole}");
    for b in &per_message {
        assert!(*b < 1024, "a 64 B message cost Redis {b} bytes");
    }
}

/// Bounds (2026-12-04, second stop): the redis crate buffers what a subscription receives
/// without a bound, so a subscriber that did not keep up (here: kicks nobody takes) made the
/// edge's memory grow with every notice published to it. A subscription now holds at most
/// its queue (4,096) plus what its handler holds; beyond that a notice is dropped and
/// counted, and every notice is either delivered, in order, or counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_does_not_keep_up_holds_a_bounded_queue() {
    const QUEUE: u64 = 4096;
    let server = RedisServer::start();
    let s = stores(&server).await;
    let dropped = s.pubsub_dropped();
    let (mut kicks, mut up) = s.ownership.subscribe_kicks_with_status("e1");
    tokio::time::timeout(Duration::from_secs(5), up.wait_for(|u| *u))
        .await
        .expect("subscribed")
        .expect("watch");
    // Nobody reads `kicks` (a channel of 4,096) while 3 x 4,096 + 500 notices arrive.
    let n: u64 = 3 * QUEUE + 500;
    let mut raw = raw_connection(&server).await;
    for chunk in (1..=n).collect::<Vec<_>>().chunks(1000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            let notice = format!("{i} {} e1\n{}\ne2\nplayer{i}", "ab".repeat(16), i + 1);
            pipe.publish("waygate:edge:e1:kick", notice).ignore();
        }
        let () = pipe.query_async(&mut raw).await.expect("publish");
    }
    // Held: the kicks channel, the one notice its handler waits to hand over, the queue.
    let held = QUEUE + 1 + QUEUE;
    tokio::time::timeout(Duration::from_secs(10), async {
        while dropped.get() < n - held {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("what the queues cannot hold is dropped and counted");
    // Everything else arrives, in order.
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while received.len() as u64 + dropped.get() < n {
            if let Ok(Some(k)) =
                tokio::time::timeout(Duration::from_millis(200), kicks.recv()).await
            {
                received.push(k.fencing);
            }
        }
    })
    .await
    .expect("every notice is delivered or counted");
    assert_eq!(received.len() as u64 + dropped.get(), n);
    assert!(
        received.windows(2).all(|w| w[0] < w[1]),
        "delivered in order"
    );
}

/// The Redis announcement log's withdrawals (PROTOCOL.md §12.5): an announcement refused
/// because its append failed or did not answer in time is withdrawn, and a withdrawn offset
/// is never read back — whether its append landed before the withdrawal or lands after it.
#[tokio::test]
async fn a_withdrawn_announcement_is_never_read_back_from_redis() {
    use waygate_edge::announcements::{AnnouncementLog, AnnouncementRecord};
    use waygate_protocol::channel::ChannelPosition;
    let server = RedisServer::start();
    let s = stores(&server).await;
    let log = s.announcements.clone();
    let record = |offset: u64| AnnouncementRecord {
        channel: "room:a".into(),
        position: ChannelPosition { epoch: 1, offset },
        event: Bytes::from(format!("event {offset}")),
        ttl: Duration::from_secs(60),
        keep: 10,
    };
    log.append(&[record(1), record(2)]).await.unwrap();
    // Offset 2's append landed although it was refused; offset 3's lands later.
    log.withdraw(&[record(2), record(3)]).await.unwrap();
    log.append(&[record(3)]).await.unwrap();
    log.append(&[record(4)]).await.unwrap();
    let got = log
        .after(
            "room:a",
            ChannelPosition {
                epoch: 1,
                offset: 0,
            },
            10,
        )
        .await
        .unwrap();
    let offsets: Vec<u64> = got.iter().map(|r| r.position.offset).collect();
    assert_eq!(offsets, [1, 4]);
    assert_eq!(got[1].event, Bytes::from("event 4"));
}

/// Redis over TLS (`rediss://`, secure-by-default audit: snapshots, with what resume proofs
/// are checked against, and the AUTH password crossed the network in clear): a server
/// whose certificate chains to the configured CA is used; without that CA (the system's
/// roots) the connection is refused and nothing is written.
#[tokio::test]
async fn redis_over_tls_is_verified_against_the_configured_ca() {
    let ca = support_pki::TestCa::new();
    let ca_pem = ca.pem.clone();
    ca.issue(&["localhost"], "redis");
    let path = |name: &str| ca.path(name).to_str().unwrap().to_owned();
    let tls_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _server = RedisServer::start_with_args(&[
        "--tls-port".into(),
        tls_port.to_string(),
        "--tls-cert-file".into(),
        path("redis.pem"),
        "--tls-key-file".into(),
        path("redis.key"),
        "--tls-ca-cert-file".into(),
        path("ca.pem"),
        "--tls-auth-clients".into(),
        "no".into(),
    ]);
    let url = format!("rediss://localhost:{tls_port}/");
    let config = |roots: Option<Vec<u8>>| RedisConfig {
        op_timeout: Duration::from_secs(2),
        tls_root_pem: roots,
        ..RedisConfig::new(url.clone())
    };
    let sid = session_id_of("p", 7);
    let trusted = RedisStores::connect_with(config(Some(ca_pem.into_bytes())))
        .await
        .expect("connects over TLS");
    trusted
        .snapshots
        .put(&snapshot(7, "p", 1), Duration::from_secs(60))
        .await
        .expect("written over TLS");
    assert!(trusted.snapshots.get(&sid).await.expect("read").is_some());
    // The system's roots do not know this CA: refused, nothing read.
    let untrusted = match RedisStores::connect_with(config(None)).await {
        Ok(stores) => stores.snapshots.get(&sid).await.map(|_| ()),
        Err(e) => Err(StoreError::Unavailable(e.to_string())),
    };
    assert!(
        untrusted.is_err(),
        "a certificate of an unknown CA was accepted"
    );
}

/// Resume keys at rest (secure-by-default audit: a Redis reader with the password had every
/// lingering session's resume keys, in fields `h`, `p` and inside `d`, and could make a
/// resume proof and take the session over). With the edges' shared secret
/// (`cluster.redis_resume_key_file`) no record holds either key, in hex or raw, after a
/// whole write or a delta; no command the edge sends carries one (watched with MONITOR: a
/// take used to send the key in hex beside its match tag, review); the stores still behave
/// as before (the generic checks); an edge with the same secret resumes the session, one
/// without it or with another gets an error (never a match); and a record holding its keys
/// in clear (an edge without the secret, or a writer of Redis) is not restorable by an
/// edge with the secret.
#[tokio::test]
async fn resume_keys_are_stored_sealed_with_the_edges_secret() {
    let server = RedisServer::start();
    let with = |seal: Option<&[u8]>| sealing_config(&server, seal.map(ResumeKeySeal::new));
    let secret: &[u8] = b"a secret every edge of the deployment shares, 32+ bytes";
    let sealed = RedisStores::connect_with(with(Some(secret))).await.unwrap();
    snapshot_store_semantics(sealed.snapshots.as_ref()).await;
    snapshot_store_write_through_semantics(sealed.snapshots.as_ref()).await;

    // Everything the edge sends Redis from here on, as MONITOR shows it (read on a thread
    // of its own; watching once redis-cli says OK).
    let mut monitor = std::process::Command::new("redis-cli")
        .args(["-p", &server.port().to_string(), "monitor"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli monitor");
    let lines = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let out = monitor.stdout.take().unwrap();
    let reader = {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(out)) {
                let Ok(line) = line else { return };
                lines.lock().unwrap().push(line);
            }
        })
    };
    let seen_line = |what: &'static str| {
        let lines = lines.clone();
        async move {
            for _ in 0..100 {
                if lines.lock().unwrap().iter().any(|l| l.contains(what)) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("MONITOR never showed {what}");
        }
    };
    seen_line("OK").await;

    let snap = snapshot(9, "sealed", 1);
    let sid = snap.session_id;
    let (current, previous) = (snap.resume_hash, snap.prev_resume_hash.unwrap());
    sealed
        .snapshots
        .put(&snap, Duration::from_secs(60))
        .await
        .unwrap();
    // A delta on top (a new replay entry), as the write-through makes.
    let mut next = snap.clone();
    next.replay
        .push(TrafficClass::Normal, 8, bytes::Bytes::from_static(b"more"));
    let delta = SnapshotWrite {
        snapshot: next.clone(),
        since: Some(Box::new(snap.clone())),
    };
    assert_eq!(
        sealed
            .snapshots
            .put_many(&[delta], Duration::from_secs(60))
            .await,
        vec![Ok(())]
    );
    let key = format!("waygate:{{{}}}:snap:{}", hex(&sid[..4]), hex(&sid));
    let mut raw = raw_connection(&server).await;
    let record: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
        .arg(&key)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(!record.is_empty(), "the record is under {key}");
    let holds_a_key = |bytes: &[u8]| {
        [current, previous].iter().any(|k| {
            let (in_hex, raw_bytes) = (hex(&k.0).into_bytes(), k.0.to_vec());
            [in_hex, raw_bytes]
                .iter()
                .any(|needle| bytes.windows(needle.len()).any(|w| w == &needle[..]))
        })
    };
    for (field, value) in &record {
        assert!(
            !holds_a_key(value),
            "field {} holds a resume key",
            String::from_utf8_lossy(field)
        );
    }
    let keys = sealed.snapshots.resume_keys(&sid).await.unwrap().unwrap();
    assert_eq!((keys.current, keys.previous), (current, Some(previous)));
    match sealed.snapshots.take(&sid, &previous).await.unwrap() {
        TakeOutcome::Taken(s) => {
            assert_eq!(s.resume_hash, current);
            assert_eq!(s.prev_resume_hash, Some(previous));
            assert_eq!(*s, next, "restored whole");
        }
        other => panic!("{other:?}"),
    }
    // Written again for the strangers below (whose commands MONITOR is not to judge).
    sealed
        .snapshots
        .put(&snap, Duration::from_secs(60))
        .await
        .unwrap();
    // A marker after the last command watched: once MONITOR shows it, it showed them all.
    let _: String = redis::cmd("ECHO")
        .arg("end-of-watch")
        .query_async(&mut raw)
        .await
        .unwrap();
    seen_line("end-of-watch").await;
    let _ = monitor.kill();
    let _ = monitor.wait();
    let _ = reader.join();
    let seen = lines.lock().unwrap().clone();
    assert!(
        seen.iter().any(|l| l.contains("EVALSHA")),
        "MONITOR saw the edge's commands"
    );
    let carried: Vec<String> = seen
        .iter()
        .filter(|l| holds_a_key(l.as_bytes()))
        .map(|l| l.chars().take(300).collect())
        .collect();
    assert!(
        carried.is_empty(),
        "commands carried a resume key: {carried:?}"
    );
    // Without the secret, or with another: its keys are an error, and a take never matches.
    for other in [
        None,
        Some(&b"the secret of another deployment, 32+ bytes"[..]),
    ] {
        let stranger = RedisStores::connect_with(with(other)).await.unwrap();
        assert!(stranger.snapshots.resume_keys(&sid).await.is_err());
        assert!(!matches!(
            stranger.snapshots.take(&sid, &current).await,
            Ok(TakeOutcome::Taken(_))
        ));
    }

    // A record holding its keys in clear is not restorable by an edge with the secret.
    let plain = RedisStores::connect_with(with(None)).await.unwrap();
    let old = snapshot(10, "sealed", 2);
    plain
        .snapshots
        .put(&old, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        sealed.snapshots.resume_keys(&old.session_id).await,
        Ok(None)
    );
    assert_eq!(
        sealed
            .snapshots
            .take(&old.session_id, &old.resume_hash)
            .await,
        Ok(TakeOutcome::Mismatch)
    );
}

/// Edges announce their resume-key secrets by fingerprint in Redis and compare them with
/// the others': the same secret agrees, another differs, none while the others seal is told
/// so; an announcement older than the freshness window is an edge gone, and counts no
/// more. An edge started with another secret than the deployment's says so in its metrics
/// (and logs an error): its sessions and theirs would not resume on each other.
#[tokio::test]
async fn edges_compare_their_resume_key_secrets() {
    use waygate_edge::cluster::redis::ResumeKeyCheck;
    let server = RedisServer::start();
    let ours: &[u8] = b"the deployment's secret, long enough: 0123456789";
    let theirs: &[u8] = b"another deployment's secret, long enough: 98765";
    let fresh = Duration::from_secs(30);
    let check = |edge: &'static str, seal: Option<ResumeKeySeal>, fresh: Duration| {
        let config = sealing_config(&server, seal);
        async move {
            RedisStores::connect_with(config)
                .await
                .unwrap()
                .check_resume_key(edge, fresh)
                .await
                .unwrap()
        }
    };
    let seal = |s: &[u8]| Some(ResumeKeySeal::new(s));
    assert_eq!(check("a", None, fresh).await, ResumeKeyCheck::NoSecret);
    assert_eq!(check("b", seal(ours), fresh).await, ResumeKeyCheck::Agreed);
    assert_eq!(check("c", seal(ours), fresh).await, ResumeKeyCheck::Agreed);
    assert_eq!(
        check("d", seal(theirs), fresh).await,
        ResumeKeyCheck::Differs
    );
    assert_eq!(
        check("a", None, fresh).await,
        ResumeKeyCheck::SealedElsewhere
    );
    // An edge in the middle of a rotation to `theirs` (sealing with it, accepting ours)
    // reads both kinds; those sealing with ours alone do not read its records.
    let step2 = || Some(ResumeKeySeal::rotating(theirs, ours));
    assert_eq!(
        check("d", step2(), fresh).await,
        ResumeKeyCheck::Differs,
        "b, c"
    );
    let step1 = || Some(ResumeKeySeal::rotating(ours, theirs));
    assert_eq!(check("b", step1(), fresh).await, ResumeKeyCheck::Agreed);
    assert_eq!(check("c", step1(), fresh).await, ResumeKeyCheck::Agreed);
    assert_eq!(
        check("d", step2(), fresh).await,
        ResumeKeyCheck::Agreed,
        "step 1 and 2"
    );
    // Announcements older than the window are of edges gone: "d" alone has announced in
    // the last moment, so an edge sealing with ours alone agrees with nobody but itself.
    tokio::time::sleep(Duration::from_millis(300)).await;
    check("d", step2(), fresh).await;
    let short = Duration::from_millis(200);
    assert_eq!(
        check("e", seal(ours), short).await,
        ResumeKeyCheck::Differs,
        "d is fresh"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        check("e", seal(ours), short).await,
        ResumeKeyCheck::Agreed,
        "d is gone"
    );
    let mut raw = raw_connection(&server).await;
    let left: Vec<String> = redis::cmd("HKEYS")
        .arg("waygate:resume-keys")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        left,
        vec!["e".to_owned()],
        "the stale announcements were dropped"
    );

    // "e" (ours alone) announces again (the short window also made the hash expire soon):
    // an edge started with `theirs` alone differs.
    assert_eq!(check("e", seal(ours), fresh).await, ResumeKeyCheck::Agreed);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("redis-resume-key");
    std::fs::write(&file, theirs).unwrap();
    let mut config = waygate_edge::config::EdgeConfig::default();
    config.use_ephemeral_ports();
    config.cluster.redis_url = server.url();
    config.cluster.redis_resume_key_file = Some(file);
    let edge = waygate_edge::edge::Edge::start(config).await.unwrap();
    let admin = edge.admin_addr.unwrap();
    let mut last = String::new();
    for _ in 0..100 {
        last = common::http(admin, "GET", "/metrics").await.1;
        if last.lines().any(|l| l == "waygate_resume_key_mismatch 1") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no mismatch in /metrics:\n{last}");
}

/// Rotating the resume-key secret loses no session: at each step, an edge restores what
/// the edges of the step before and after it wrote (records are taken with the tags of both
/// secrets, sealed keys opened with either); an edge past the rotation does not read what
/// was sealed with the old secret alone (why step 3 waits for the linger time).
#[tokio::test]
async fn a_rotation_of_the_resume_key_secret_keeps_every_session_resumable() {
    let server = RedisServer::start();
    let (old, new): (&[u8], &[u8]) = (
        b"the old secret of these edges, long enough: 0123",
        b"the new secret of these edges, long enough: 4567",
    );
    let edge = |seal: ResumeKeySeal| {
        let config = sealing_config(&server, Some(seal));
        async move { RedisStores::connect_with(config).await.unwrap() }
    };
    let steps = [
        edge(ResumeKeySeal::new(old)).await,
        edge(ResumeKeySeal::rotating(old, new)).await,
        edge(ResumeKeySeal::rotating(new, old)).await,
        edge(ResumeKeySeal::new(new)).await,
    ];
    let mut n = 0u8;
    for (writer, reader) in [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2), (0, 2)] {
        n += 1;
        let mut snap = snapshot(n, "rotating", 3);
        snap.prev_resume_hash = Some(ResumeHash([n; 32]));
        steps[writer]
            .snapshots
            .put(&snap, Duration::from_secs(60))
            .await
            .unwrap();
        let keys = steps[reader]
            .snapshots
            .resume_keys(&snap.session_id)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("step {reader} reads step {writer}'s record"));
        assert_eq!(
            (keys.current, keys.previous),
            (snap.resume_hash, snap.prev_resume_hash)
        );
        for key in [snap.resume_hash, ResumeHash([n; 32])] {
            // The previous key takes it too (a resume racing a key rotation, §7.3.1); put
            // back for the second take.
            match steps[reader]
                .snapshots
                .take(&snap.session_id, &key)
                .await
                .unwrap()
            {
                TakeOutcome::Taken(s) => {
                    assert_eq!(*s, snap, "step {reader} takes step {writer}'s")
                }
                other => panic!("step {reader} on step {writer}'s record: {other:?}"),
            }
            steps[writer]
                .snapshots
                .put(&snap, Duration::from_secs(60))
                .await
                .unwrap();
        }
    }
    // Past the rotation, the old secret's records are not restorable (and the reverse).
    for (writer, reader) in [(0, 3), (3, 0)] {
        n += 1;
        let snap = snapshot(n, "rotating", 3);
        steps[writer]
            .snapshots
            .put(&snap, Duration::from_secs(60))
            .await
            .unwrap();
        assert!(steps[reader]
            .snapshots
            .resume_keys(&snap.session_id)
            .await
            .is_err());
        assert_eq!(
            steps[reader]
                .snapshots
                .take(&snap.session_id, &snap.resume_hash)
                .await,
            Ok(TakeOutcome::Mismatch)
        );
    }
}

/// The defaults for `server`, sealing resume keys with `seal` when given.
fn sealing_config(server: &RedisServer, seal: Option<ResumeKeySeal>) -> RedisConfig {
    RedisConfig {
        resume_key_seal: seal.map(Arc::new),
        ..RedisConfig::new(server.url())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

//! Write-through fixtures shared by the Redis store tests (one Redis and a cluster):
//! sessions claimed and written whole, and the next delta of each.

use std::time::Duration;

use bytes::Bytes;
use waygate_edge::cluster::redis::RedisStores;
use waygate_session::store::{OwnershipRegistry as _, Snapshot, SnapshotStore as _, SnapshotWrite};
use waygate_session::testkit::store_contract::{session_id_of, snapshot};
use waygate_transport::TrafficClass;

/// `n` players `prefix-<i>`, each claimed on edge e1, and their sessions' snapshots
/// written whole.
pub async fn written_sessions(
    s: &RedisStores,
    prefix: &str,
    n: u8,
    ttl: Duration,
) -> Vec<Snapshot> {
    let mut snaps = Vec::new();
    for i in 0..n {
        let p = format!("{prefix}-{i}");
        let g = s
            .ownership
            .claim(&p, &session_id_of(&p, i), "e1")
            .await
            .expect("claim");
        snaps.push(snapshot(i, &p, g.fencing));
    }
    let whole: Vec<SnapshotWrite> = snaps.iter().cloned().map(SnapshotWrite::whole).collect();
    assert!(s
        .snapshots
        .put_many(&whole, ttl)
        .await
        .iter()
        .all(Result::is_ok));
    snaps
}

/// A delta write of each snapshot: it with one more replay entry (`msg_id`, `payload`).
pub fn one_entry_more(snaps: &[Snapshot], msg_id: u32, payload: &[u8]) -> Vec<SnapshotWrite> {
    snaps
        .iter()
        .map(|since| {
            let mut now = since.clone();
            now.replay.push(
                TrafficClass::Normal,
                msg_id,
                Bytes::copy_from_slice(payload),
            );
            SnapshotWrite {
                snapshot: now,
                since: Some(Box::new(since.clone())),
            }
        })
        .collect()
}

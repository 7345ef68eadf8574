//! Storage behind traits (SPEC S5, S6, S7): the session [`Snapshot`], the [`SnapshotStore`]
//! that keeps it while a session lingers, and the [`OwnershipRegistry`] that enforces one
//! live session per player with fencing tokens. Both traits are async and fallible because
//! the warm tier is remote (Redis); the in-memory implementations are the embedded default
//! (hot tier) and the reference semantics a remote backend must match:
//!
//! - `SnapshotStore::take` is an atomic compare-and-delete on the resume-token hash (Redis:
//!   a Lua script), so a resume token works once even when two edges race.
//! - `SnapshotStore::delete` with a fencing token deletes only that generation, so a stale
//!   owner's linger expiry cannot delete a snapshot a newer owner wrote.
//! - `OwnershipRegistry::claim` increments a per-player fencing counter that never goes
//!   back (Redis: `INCR` on a key that outlives the session), and returns the previous owner
//!   so the caller can kick it and take over its bindings.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use waygate_protocol::frame::SessionId;

use crate::replay::ReplayBuffer;
use crate::resume::ResumeHash;
use crate::seq::RecvWindow;

/// Version of the serialized snapshot layout.
pub const SNAPSHOT_VERSION: u32 = 1;

/// Everything needed to restore a session on any edge: serde-serializable for the warm tier.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Snapshot {
    /// [`SNAPSHOT_VERSION`] when written.
    pub version: u32,
    /// The session.
    pub session_id: SessionId,
    /// Its player.
    pub player_id: String,
    /// Ownership generation (S6); increases on every claim.
    pub fencing: u64,
    /// SHA-256 of the current resume token.
    pub resume_hash: ResumeHash,
    /// SHA-256 of the token the client presented on its last restore, while the client has
    /// not yet confirmed receipt of its replacement (a lost WELCOME must not strand it).
    #[serde(default)]
    pub prev_resume_hash: Option<ResumeHash>,
    /// The nonce of the last resume accepted: a proof is accepted only with a higher one
    /// (PROTOCOL.md §7.3.2), so a captured resume HELLO cannot be replayed.
    #[serde(default)]
    pub last_resume_nonce: u64,
    /// Backend bindings: service -> instance (S5).
    pub bindings: BTreeMap<String, String>,
    /// Routing keys backends bound with BIND: service -> business key (the room a player
    /// joined, R3). They travel with the session, so a restore on any edge routes the same.
    #[serde(default)]
    pub keys: BTreeMap<String, String>,
    /// Channels the session is a member of, with the last position queued to it (the
    /// joined / history-lost marker or publication; PROTOCOL.md §12). A restore on another
    /// edge re-joins them from there: recovered, or HISTORY_LOST.
    #[serde(default)]
    pub channels: BTreeMap<String, waygate_protocol::channel::ChannelPosition>,
    /// The last position of each channel the client acknowledged (PROTOCOL.md §12.4).
    #[serde(default)]
    pub channels_acked: BTreeMap<String, waygate_protocol::channel::ChannelPosition>,
    /// ERROR answers for the client's messages that arrived while it was away, sent right
    /// after WELCOME on its resume (so an acked message never goes unanswered).
    #[serde(default)]
    pub pending_errors: Vec<PendingError>,
    /// Unacked downstream messages and the downstream seq counter.
    pub replay: ReplayBuffer,
    /// Upstream client seqs answered: processed by their backend (FORWARD_DONE), refused
    /// (an ERROR for them), or handed to a sink that gives no answer. What the client is
    /// told it may forget (acks, WELCOME's `client_seq_ack`), and the dedup state.
    pub upstream: RecvWindow,
    /// Upstream client seqs delivered and not answered yet. In memory only: a hand-over on
    /// this edge keeps it (the answers still come here), a stored copy never has it, so on
    /// another edge the client resends them and they are delivered again (at least once
    /// towards backends; PROTOCOL.md §9.6).
    #[serde(skip)]
    pub awaiting: BTreeSet<u64>,
    /// The ids of the last [`MAX_PUSH_IDS`] pushes with an id (PLAYER_PUSH, PROTOCOL.md
    /// §9.7) queued on the session, oldest first: a copy sent again after the session moved
    /// to another edge is recognised there and not delivered twice. Kept out of the serde
    /// layout (a store writes it as a field of its own, so older records still decode).
    #[serde(skip)]
    pub push_ids: Vec<u64>,
}

/// Most push ids a session remembers ([`Snapshot::push_ids`]).
pub const MAX_PUSH_IDS: usize = 64;

/// One write of the write-through's group commit ([`SnapshotStore::put_many`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotWrite {
    /// What the store must hold after the write.
    pub snapshot: Snapshot,
    /// The last snapshot of the same session this writer had acknowledged by the store,
    /// if it knows one: a store that writes deltas sends only the difference (changed
    /// fields, replay entries added and dropped), which bounds what one message costs the
    /// store whatever the replay buffer holds. `None` after a failed write: the next one is
    /// whole.
    pub since: Option<Box<Snapshot>>,
}

impl SnapshotWrite {
    /// A write of the whole snapshot.
    pub fn whole(snapshot: Snapshot) -> Self {
        Self {
            snapshot,
            since: None,
        }
    }
}

/// An ERROR frame (PROTOCOL.md §3.9) waiting for the client to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PendingError {
    /// The close/error code (§4), as its number.
    pub code: u16,
    /// The refused message's id.
    pub msg_id: u32,
    /// The refused message's client seq.
    pub client_seq: u64,
    /// Retry hint, ms.
    pub retry_after_ms: u32,
}

impl Snapshot {
    /// Whether [`SnapshotStore::delete`] with `fencing` removes this copy: any copy without
    /// one, only the copy of that fencing token with one.
    pub fn deleted_by(&self, fencing: Option<u64>) -> bool {
        fencing.is_none_or(|f| self.fencing == f)
    }

    /// Whether a presented token's hash may resume this snapshot: the current token, or the
    /// previous one while its replacement is unconfirmed. Constant time in both compares.
    /// (The store's compare-and-take; the proof itself is checked with
    /// [`Snapshot::key_used`].)
    pub fn accepts(&self, hash: &ResumeHash) -> bool {
        let current = self.resume_hash.ct_eq(hash);
        let prev = self.prev_resume_hash.is_some_and(|p| p.ct_eq(hash));
        current | prev
    }

    /// The resume key (current, else the unconfirmed previous) `attempt` proves possession
    /// of, with a nonce above the last accepted one; `None` if it proves none.
    pub fn key_used(&self, attempt: &crate::machine::ResumeAttempt) -> Option<ResumeHash> {
        attempt.key_used(
            &self.session_id,
            &self.resume_hash,
            self.prev_resume_hash.as_ref(),
            self.last_resume_nonce,
        )
    }
}

/// A storage backend failed (remote store down, timeout, corrupt record).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend could not be reached or refused the operation.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The backend did not answer in time.
    #[error("store timed out")]
    Timeout,
    /// A record did not deserialize.
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// A fenced write was refused: a newer owner of the player exists (this copy is stale).
    #[error("fenced: a newer owner exists")]
    Fenced,
}

/// Result of [`SnapshotStore::take`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TakeOutcome {
    /// The hash matched; the snapshot is removed from the store and returned.
    Taken(Box<Snapshot>),
    /// A snapshot exists but the presented token's hash does not match: nothing changed.
    Mismatch,
    /// No snapshot (never existed, expired, already taken or deleted).
    NotFound,
}

/// Where lingering sessions live.
#[async_trait]
pub trait SnapshotStore: Send + Sync + 'static {
    /// Writes (or overwrites) a snapshot that expires after `ttl`.
    async fn put(&self, snapshot: &Snapshot, ttl: Duration) -> Result<(), StoreError>;
    /// Writes many snapshots that expire after `ttl`, one result each in order (the
    /// write-through's group commit). The default writes each whole, one by one; a
    /// networked store overrides it with one round trip, and may write only what changed
    /// since [`SnapshotWrite::since`] (it must check that its copy is still that one).
    async fn put_many(
        &self,
        writes: &[SnapshotWrite],
        ttl: Duration,
    ) -> Vec<Result<(), StoreError>> {
        let mut out = Vec::with_capacity(writes.len());
        for w in writes {
            out.push(self.put(&w.snapshot, ttl).await);
        }
        out
    }
    /// Reads a snapshot without removing it.
    async fn get(&self, session_id: &SessionId) -> Result<Option<Snapshot>, StoreError>;
    /// Atomically removes and returns the snapshot if [`Snapshot::accepts`] `resume_hash`.
    async fn take(
        &self,
        session_id: &SessionId,
        resume_hash: &ResumeHash,
    ) -> Result<TakeOutcome, StoreError>;
    /// Removes a snapshot; with `fencing`, only if the stored one has that fencing token.
    /// Returns whether something was removed.
    async fn delete(
        &self,
        session_id: &SessionId,
        fencing: Option<u64>,
    ) -> Result<bool, StoreError>;

    /// The resume keys of a stored snapshot (what a proof is checked against), without
    /// taking it. The default reads the whole snapshot; stores override it with a cheaper
    /// read.
    async fn resume_keys(&self, session_id: &SessionId) -> Result<Option<ResumeKeys>, StoreError> {
        Ok(self.get(session_id).await?.map(|s| ResumeKeys {
            current: s.resume_hash,
            previous: s.prev_resume_hash,
            last_nonce: s.last_resume_nonce,
        }))
    }

    /// Removes and returns the snapshot if `attempt` proves possession of one of its resume
    /// keys with a fresh nonce: the keys are read and checked here, then taken with
    /// [`SnapshotStore::take`]'s compare-and-take on the key used (a snapshot rewritten in
    /// between no longer matches). A proof that fails takes nothing, so a replayed HELLO
    /// never takes a session away from its client even for a moment.
    async fn take_proven(
        &self,
        session_id: &SessionId,
        attempt: &crate::machine::ResumeAttempt,
    ) -> Result<TakeOutcome, StoreError> {
        let Some(keys) = self.resume_keys(session_id).await? else {
            return Ok(TakeOutcome::NotFound);
        };
        match attempt.key_used(
            session_id,
            &keys.current,
            keys.previous.as_ref(),
            keys.last_nonce,
        ) {
            Some(used) => self.take(session_id, &used).await,
            None => Ok(TakeOutcome::Mismatch),
        }
    }
}

/// What a resume proof is checked against (see [`SnapshotStore::resume_keys`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumeKeys {
    /// The current resume key.
    pub current: ResumeHash,
    /// The previous one, while its replacement is unconfirmed.
    pub previous: Option<ResumeHash>,
    /// The nonce of the last accepted resume.
    pub last_nonce: u64,
}

/// The owner of a player.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Owner {
    /// The owning session.
    pub session_id: SessionId,
    /// The edge holding it.
    pub edge: String,
    /// Its fencing token.
    pub fencing: u64,
}

/// Result of [`OwnershipRegistry::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimGrant {
    /// The new fencing token (greater than every earlier one of this player).
    pub fencing: u64,
    /// Who owned the player before, if anyone (possibly this same session, on a restore).
    pub previous: Option<Owner>,
}

/// One live session per player (S6).
#[async_trait]
pub trait OwnershipRegistry: Send + Sync + 'static {
    /// Makes `session_id` on `edge` the owner of `player_id`, taking over from any previous
    /// owner. Always succeeds unless the backend fails.
    async fn claim(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
    ) -> Result<ClaimGrant, StoreError>;
    /// Gives up ownership if `session_id` still owns the player with `fencing`. Returns
    /// whether it did (false: someone newer owns it; the caller must not touch bindings).
    async fn release(
        &self,
        player_id: &str,
        session_id: &SessionId,
        fencing: u64,
    ) -> Result<bool, StoreError>;
    /// The current owner.
    async fn owner(&self, player_id: &str) -> Result<Option<Owner>, StoreError>;
}

type Clock = Box<dyn Fn() -> Instant + Send + Sync>;

/// In-memory [`SnapshotStore`] (hot tier, embedded default). Expired entries are dropped on
/// access, by [`MemorySnapshotStore::purge_expired`], and by a `put` that finds the store
/// twice as full as after the last purge (so expired entries nobody asks for again never
/// outnumber the live ones by much: amortized O(1) per put).
pub struct MemorySnapshotStore {
    map: Mutex<Entries>,
    clock: Clock,
}

#[derive(Default)]
struct Entries {
    map: HashMap<SessionId, (Snapshot, Instant)>,
    /// A `put` that finds this many entries purges the expired ones first.
    purge_at: usize,
}

/// The smallest store a `put` purges.
const PURGE_FLOOR: usize = 1024;

impl std::fmt::Debug for MemorySnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemorySnapshotStore")
            .finish_non_exhaustive()
    }
}

impl Default for MemorySnapshotStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemorySnapshotStore {
    /// A store on tokio's clock (virtual under paused test time).
    pub fn new() -> Self {
        Self::with_clock(|| tokio::time::Instant::now().into_std())
    }

    /// A store on a caller-supplied clock.
    pub fn with_clock(clock: impl Fn() -> Instant + Send + Sync + 'static) -> Self {
        Self {
            map: Mutex::new(Entries {
                map: HashMap::new(),
                purge_at: PURGE_FLOOR,
            }),
            clock: Box::new(clock),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops expired entries; returns how many.
    pub fn purge_expired(&self) -> usize {
        let now = (self.clock)();
        Self::purge(&mut self.entries(), now)
    }

    fn purge(entries: &mut Entries, now: Instant) -> usize {
        let before = entries.map.len();
        entries.map.retain(|_, (_, exp)| *exp > now);
        entries.purge_at = (entries.map.len() * 2).max(PURGE_FLOOR);
        before - entries.map.len()
    }

    /// Entries held (expired ones included until purged).
    pub fn len(&self) -> usize {
        self.entries().map.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries().map.is_empty()
    }

    fn live<'a>(
        map: &'a mut HashMap<SessionId, (Snapshot, Instant)>,
        id: &SessionId,
        now: Instant,
    ) -> Option<&'a Snapshot> {
        if map.get(id).is_some_and(|(_, exp)| *exp <= now) {
            map.remove(id);
        }
        map.get(id).map(|(s, _)| s)
    }
}

#[async_trait]
impl SnapshotStore for MemorySnapshotStore {
    async fn put(&self, snapshot: &Snapshot, ttl: Duration) -> Result<(), StoreError> {
        let now = (self.clock)();
        let mut entries = self.entries();
        if entries.map.len() >= entries.purge_at {
            Self::purge(&mut entries, now);
        }
        entries
            .map
            .insert(snapshot.session_id, (snapshot.clone(), now + ttl));
        Ok(())
    }

    async fn get(&self, session_id: &SessionId) -> Result<Option<Snapshot>, StoreError> {
        let now = (self.clock)();
        Ok(Self::live(&mut self.entries().map, session_id, now).cloned())
    }

    /// Checked and taken under one lock: no copy of the snapshot to read its keys.
    async fn take_proven(
        &self,
        session_id: &SessionId,
        attempt: &crate::machine::ResumeAttempt,
    ) -> Result<TakeOutcome, StoreError> {
        let now = (self.clock)();
        let mut entries = self.entries();
        let map = &mut entries.map;
        let proven = match Self::live(map, session_id, now) {
            None => return Ok(TakeOutcome::NotFound),
            Some(s) => s.key_used(attempt).is_some(),
        };
        if !proven {
            return Ok(TakeOutcome::Mismatch);
        }
        Ok(map
            .remove(session_id)
            .map_or(TakeOutcome::NotFound, |(s, _)| {
                TakeOutcome::Taken(Box::new(s))
            }))
    }

    async fn take(
        &self,
        session_id: &SessionId,
        resume_hash: &ResumeHash,
    ) -> Result<TakeOutcome, StoreError> {
        let now = (self.clock)();
        let mut entries = self.entries();
        let map = &mut entries.map;
        let matches = match Self::live(map, session_id, now) {
            None => return Ok(TakeOutcome::NotFound),
            Some(s) => s.accepts(resume_hash),
        };
        if !matches {
            return Ok(TakeOutcome::Mismatch);
        }
        Ok(match map.remove(session_id) {
            Some((s, _)) => TakeOutcome::Taken(Box::new(s)),
            None => TakeOutcome::NotFound,
        })
    }

    async fn delete(
        &self,
        session_id: &SessionId,
        fencing: Option<u64>,
    ) -> Result<bool, StoreError> {
        let mut entries = self.entries();
        let map = &mut entries.map;
        let hit = map
            .get(session_id)
            .is_some_and(|(s, _)| s.deleted_by(fencing));
        if hit {
            map.remove(session_id);
        }
        Ok(hit)
    }
}

/// In-memory [`OwnershipRegistry`] (embedded default, one edge).
#[derive(Debug, Default)]
pub struct MemoryOwnership {
    inner: Mutex<HashMap<String, (u64, Option<Owner>)>>,
}

impl MemoryOwnership {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl OwnershipRegistry for MemoryOwnership {
    async fn claim(
        &self,
        player_id: &str,
        session_id: &SessionId,
        edge: &str,
    ) -> Result<ClaimGrant, StoreError> {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let entry = map.entry(player_id.to_owned()).or_insert((0, None));
        entry.0 += 1;
        let fencing = entry.0;
        let previous = entry.1.replace(Owner {
            session_id: *session_id,
            edge: edge.to_owned(),
            fencing,
        });
        Ok(ClaimGrant { fencing, previous })
    }

    async fn release(
        &self,
        player_id: &str,
        session_id: &SessionId,
        fencing: u64,
    ) -> Result<bool, StoreError> {
        let mut map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = map.get_mut(player_id) else {
            return Ok(false);
        };
        let owns = entry
            .1
            .as_ref()
            .is_some_and(|o| o.session_id == *session_id && o.fencing == fencing);
        if owns {
            entry.1 = None; // the counter stays: fencing never goes back
        }
        Ok(owns)
    }

    async fn owner(&self, player_id: &str) -> Result<Option<Owner>, StoreError> {
        let map = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        Ok(map.get(player_id).and_then(|(_, o)| o.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::ReplayLimits;
    use bytes::Bytes;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use waygate_transport::TrafficClass;

    fn snapshot(fencing: u64) -> Snapshot {
        let mut replay = ReplayBuffer::new(ReplayLimits::default());
        replay.push(TrafficClass::Critical, 5, Bytes::from_static(b"hi"));
        Snapshot {
            version: SNAPSHOT_VERSION,
            session_id: [1; 16],
            player_id: "p".into(),
            fencing,
            resume_hash: ResumeHash::of(&[2; 16]),
            prev_resume_hash: Some(ResumeHash::of(&[3; 16])),
            last_resume_nonce: 0,
            bindings: [("world".to_owned(), "w-1".to_owned())].into(),
            replay,
            upstream: RecvWindow::starting_at(4),
            awaiting: Default::default(),
            keys: BTreeMap::new(),
            channels: [(
                "guild:7".to_owned(),
                waygate_protocol::channel::ChannelPosition {
                    epoch: 99,
                    offset: 12,
                },
            )]
            .into(),
            channels_acked: BTreeMap::new(),
            pending_errors: Vec::new(),
            push_ids: Vec::new(),
        }
    }

    #[test]
    fn snapshot_serde_round_trips() {
        let s = snapshot(3);
        let json = serde_json::to_string(&s).expect("ser");
        let back: Snapshot = serde_json::from_str(&json).expect("de");
        assert_eq!(back, s);
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt")
            .block_on(f)
    }

    /// The store contract (compare-and-delete `take`, previous token, fenced delete,
    /// overwrite, TTL) on the in-memory implementations; Redis runs the same suite.
    #[tokio::test]
    async fn memory_stores_meet_the_store_contract() {
        use crate::testkit::store_contract::{
            ownership_semantics, snapshot_store_semantics, snapshot_store_write_through_semantics,
        };
        snapshot_store_semantics(&MemorySnapshotStore::new()).await;
        snapshot_store_write_through_semantics(&MemorySnapshotStore::new()).await;
        ownership_semantics(&MemoryOwnership::new()).await;
    }

    /// A memory store on a clock that moves when the returned seconds are set.
    fn store_on_a_clock() -> (MemorySnapshotStore, Arc<AtomicU64>) {
        let t0 = Instant::now();
        let offset = Arc::new(AtomicU64::new(0));
        let o = offset.clone();
        let store = MemorySnapshotStore::with_clock(move || {
            t0 + Duration::from_secs(o.load(Ordering::Relaxed))
        });
        (store, offset)
    }

    /// What the contract cannot check with a real clock: expiry on a virtual clock and
    /// `purge_expired`.
    #[test]
    fn memory_store_ttl_expires_on_its_clock() {
        let (store, offset) = store_on_a_clock();
        block_on(async {
            let s = snapshot(1);
            // TTL.
            store.put(&s, Duration::from_secs(10)).await.expect("put");
            offset.store(11, Ordering::Relaxed);
            assert_eq!(store.get(&s.session_id).await, Ok(None));
            store.put(&s, Duration::from_secs(10)).await.expect("put");
            offset.store(30, Ordering::Relaxed);
            assert_eq!(store.purge_expired(), 1);
            assert!(store.is_empty());
        });
    }

    /// Regression (bounds, 2026-12-04, second stop): `purge_expired` had no caller, so
    /// snapshots nobody asked for again (their session gone elsewhere or never back) stayed
    /// after their TTL for good. A `put` that finds the store twice as full as after the
    /// last purge purges it: expired entries never outnumber the live ones by much.
    #[test]
    fn expired_snapshots_nobody_asks_for_do_not_pile_up() {
        let (store, offset) = store_on_a_clock();
        block_on(async {
            let mut most = 0;
            for round in 0..50u64 {
                // 500 sessions detach with a 10 s TTL, and are never asked for again.
                for i in 0..500u32 {
                    let mut s = snapshot(1);
                    s.session_id[..8].copy_from_slice(&round.to_be_bytes());
                    s.session_id[8..12].copy_from_slice(&i.to_be_bytes());
                    store.put(&s, Duration::from_secs(10)).await.expect("put");
                    most = most.max(store.len());
                }
                offset.fetch_add(60, Ordering::Relaxed);
            }
            // 25,000 puts; at most 500 live at a time.
            assert!(most <= 2 * PURGE_FLOOR, "{most} entries held at once");
        });
    }

    #[test]
    fn ownership_fencing_only_grows_and_release_is_fenced() {
        let reg = MemoryOwnership::new();
        block_on(async {
            let a = reg.claim("p", &[1; 16], "e1").await.expect("claim");
            assert_eq!((a.fencing, a.previous.clone()), (1, None));
            let b = reg.claim("p", &[2; 16], "e2").await.expect("claim");
            assert_eq!(b.fencing, 2);
            assert_eq!(b.previous.map(|o| o.session_id), Some([1; 16]));
            assert_eq!(
                reg.release("p", &[1; 16], 1).await,
                Ok(false),
                "stale owner"
            );
            assert_eq!(reg.release("p", &[2; 16], 2).await, Ok(true));
            assert_eq!(reg.owner("p").await, Ok(None));
            let c = reg.claim("p", &[3; 16], "e1").await.expect("claim");
            assert_eq!(c.fencing, 3, "never goes back after a release");
        });
    }
}

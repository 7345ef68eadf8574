//! Write-through to the warm tier with group commit (durable before visible, SPEC S7).
//!
//! Every session task hands the snapshot it must make durable to one per-edge committer
//! ([`WriteThrough::commit`]) and waits for its answer. The committer takes whatever is
//! queued — everything that arrived while the previous commit was in flight, up to
//! [`MAX_GROUP`] snapshots — and writes it with one [`SnapshotStore::put_many`] (one Redis
//! round trip per group), then answers each session. Under load the groups grow on their
//! own; an idle edge commits a lone snapshot at once. The queue is bounded
//! ([`QUEUE_CAPACITY`]): a session waits for room, which is the backpressure durability
//! costs.
//!
//! It owns no policy beyond that: what is visible (and so needs a write), what is skipped
//! as unchanged, and what a failure means for the session stay in the session driver.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::store::{SnapshotStore, SnapshotWrite, StoreError};

/// Most snapshots one commit writes.
pub const MAX_GROUP: usize = 256;
/// Snapshots waiting for a commit, beyond which sessions wait for room.
pub const QUEUE_CAPACITY: usize = 4 * MAX_GROUP;

type Job = (SnapshotWrite, oneshot::Sender<Result<(), StoreError>>);

/// Durable before visible: with a shared snapshot store, every batch of actions that
/// shows the client new state (DATA with a seq, ACK, WELCOME, MIGRATE) is preceded by one
/// write of the session's snapshot, so a client can never hold a sequence number, an ack
/// or a resume token the warm tier does not know; after the edge dies it restores on any
/// edge. Writes of many sessions share one store round trip (group commit, module docs).
/// A failed write does not hold the session back: writes pause for
/// [`WriteThrough::pause`] (store down) and traffic flows undurably meanwhile (counted).
/// So a store in trouble holds a session's output for at most one store timeout: the
/// group in flight when the session asked; the groups after it are answered at once.
#[derive(Debug)]
pub struct WriteThrough {
    /// How long writes pause after a failure.
    pub pause: Duration,
    paused_until: Mutex<Option<std::time::Instant>>,
    /// Snapshots written.
    pub writes: AtomicU64,
    /// Writes that failed (or were skipped while paused).
    pub failures: AtomicU64,
    /// Group commits made (store round trips).
    pub commits: AtomicU64,
    /// Writes refused because a newer owner exists (a stale copy; never pauses writes).
    pub fenced: AtomicU64,
    jobs: mpsc::Sender<Job>,
}

impl WriteThrough {
    /// Write-through into `store` with snapshots expiring after `ttl` (the linger time),
    /// pausing `pause` after a failure. Spawns the committer on the current tokio runtime;
    /// it ends when the returned value is dropped.
    pub fn start(store: Arc<dyn SnapshotStore>, ttl: Duration, pause: Duration) -> Arc<Self> {
        let (jobs, rx) = mpsc::channel(QUEUE_CAPACITY);
        let wt = Arc::new(Self {
            pause,
            paused_until: Mutex::new(None),
            writes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            fenced: AtomicU64::new(0),
            jobs,
        });
        tokio::spawn(committer(Arc::downgrade(&wt), store, ttl, rx));
        wt
    }

    /// Whether writes are paused after a failure (the caller skips the write, counted).
    pub fn paused(&self) -> bool {
        let p = self.paused_until.lock().unwrap_or_else(|e| e.into_inner());
        p.is_some_and(|t| std::time::Instant::now() < t)
    }

    /// Counts a write skipped while paused.
    pub fn skipped(&self) {
        self.failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Makes `write` with the next group commit and waits for its outcome. A failed
    /// commit (other than [`StoreError::Fenced`]) pauses writes for [`WriteThrough::pause`].
    pub async fn commit(&self, write: SnapshotWrite) -> Result<(), StoreError> {
        let (tx, rx) = oneshot::channel();
        let gone = || StoreError::Unavailable("write-through committer stopped".into());
        self.jobs.send((write, tx)).await.map_err(|_| gone())?;
        // Also watched: the committer's end (a panic in a store). A job that landed in
        // the queue after the committer drained it would keep its answer for ever, the
        // queue living on in `jobs` (the client SDK's `Client::reply` race).
        let result = tokio::select! {
            r = rx => r.map_err(|_| gone())?,
            () = self.jobs.closed() => return Err(gone()),
        };
        match &result {
            Ok(()) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
            }
            Err(StoreError::Fenced) => {
                self.fenced.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    /// Starts the pause after a failed commit, unless one is running: writes answered
    /// during it (queued before it, or skipped) do not extend it.
    /// Returns whether a new pause started.
    fn pause_after_failure(&self) -> bool {
        let mut until = self.paused_until.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        let starts = until.is_none_or(|t| t <= now);
        if starts {
            *until = Some(now + self.pause);
        }
        starts
    }
}

async fn committer(
    owner: std::sync::Weak<WriteThrough>,
    store: Arc<dyn SnapshotStore>,
    ttl: Duration,
    mut rx: mpsc::Receiver<Job>,
) {
    let mut group: Vec<Job> = Vec::with_capacity(MAX_GROUP);
    // Ends when every sender is gone (the WriteThrough was dropped).
    while rx.recv_many(&mut group, MAX_GROUP).await > 0 {
        let (writes, answers): (Vec<SnapshotWrite>, Vec<_>) = group.drain(..).unzip();
        // Groups queued before a failure paused the writes are not sent into the same
        // trouble (each would wait out the store's timeout): answered at once.
        if owner.upgrade().is_some_and(|wt| wt.paused()) {
            for answer in answers {
                // Err only for a session whose task stopped waiting: nobody left to tell.
                let _ = answer.send(Err(StoreError::Unavailable("write-through paused".into())));
            }
            continue;
        }
        let results = store.put_many(&writes, ttl).await;
        if let Some(wt) = owner.upgrade() {
            wt.commits.fetch_add(1, Ordering::Relaxed);
            // The pause starts here, before the next group is taken: were it left to the
            // sessions answered below, the next group (queued meanwhile) would be sent into
            // the same trouble before any of them ran, and its sessions' output held for a
            // second store timeout (past a client's 1 s liveness, PROTOCOL.md §7.5).
            let failed =
                |r: &Result<(), StoreError>| matches!(r, Err(e) if *e != StoreError::Fenced);
            if let Some(Err(error)) = results.iter().find(|r| failed(r)) {
                if wt.pause_after_failure() {
                    tracing::warn!(
                        %error,
                        failed = results.iter().filter(|r| failed(r)).count(),
                        of = writes.len(),
                        pause_ms = wt.pause.as_millis() as u64,
                        "write-through paused: sessions' output is shown undurably until it \
                         resumes (a session its edge loses meanwhile may not restore)"
                    );
                }
            }
        }
        let mut results = results.into_iter();
        for answer in answers {
            let result = results.next().unwrap_or_else(|| {
                Err(StoreError::Corrupt(
                    "the store answered fewer writes than asked".into(),
                ))
            });
            // A session that stopped waiting (its task ended) needs no answer.
            let _ = answer.send(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemorySnapshotStore, Snapshot, TakeOutcome};
    use crate::testkit::store_contract::snapshot;
    use async_trait::async_trait;
    use waygate_protocol::frame::SessionId;

    use crate::resume::ResumeHash;

    /// A store that counts `put_many` calls and holds each until released, so a group can
    /// form behind it.
    struct Gate {
        inner: MemorySnapshotStore,
        groups: Mutex<Vec<usize>>,
        release: tokio::sync::Semaphore,
    }

    #[async_trait]
    impl SnapshotStore for Gate {
        async fn put(&self, s: &Snapshot, ttl: Duration) -> Result<(), StoreError> {
            self.inner.put(s, ttl).await
        }
        async fn put_many(
            &self,
            s: &[SnapshotWrite],
            ttl: Duration,
        ) -> Vec<Result<(), StoreError>> {
            self.groups
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(s.len());
            if let Ok(p) = self.release.acquire().await {
                p.forget();
            }
            let mut out = Vec::new();
            for x in s.iter().map(|w| &w.snapshot) {
                out.push(if x.fencing == 0 {
                    Err(StoreError::Fenced)
                } else if x.fencing == 99 {
                    Err(StoreError::Timeout)
                } else {
                    self.inner.put(x, ttl).await
                });
            }
            out
        }
        async fn get(&self, id: &SessionId) -> Result<Option<Snapshot>, StoreError> {
            self.inner.get(id).await
        }
        async fn take(&self, id: &SessionId, h: &ResumeHash) -> Result<TakeOutcome, StoreError> {
            self.inner.take(id, h).await
        }
        async fn delete(&self, id: &SessionId, f: Option<u64>) -> Result<bool, StoreError> {
            self.inner.delete(id, f).await
        }
    }

    type Answer = tokio::task::JoinHandle<Result<(), StoreError>>;

    /// A write-through into a [`Gate`].
    fn gated() -> (Arc<Gate>, Arc<WriteThrough>) {
        let gate = Arc::new(Gate {
            inner: MemorySnapshotStore::new(),
            groups: Mutex::new(Vec::new()),
            release: tokio::sync::Semaphore::new(0),
        });
        let wt = WriteThrough::start(
            gate.clone(),
            Duration::from_secs(60),
            Duration::from_secs(1),
        );
        (gate, wt)
    }

    /// Commits `s` and returns once its group is in the store (held at the gate).
    async fn in_flight(gate: &Gate, wt: &Arc<WriteThrough>, s: Snapshot) -> Answer {
        let first = tokio::spawn({
            let wt = wt.clone();
            async move { wt.commit(SnapshotWrite::whole(s)).await }
        });
        while gate
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
        {
            tokio::task::yield_now().await;
        }
        first
    }

    /// Commits one snapshot per id of `ids` (fencing 1) and lets them queue.
    async fn queued(wt: &Arc<WriteThrough>, ids: std::ops::RangeInclusive<u8>) -> Vec<Answer> {
        let tasks = ids
            .map(|i| {
                let wt = wt.clone();
                tokio::spawn(async move {
                    wt.commit(SnapshotWrite::whole(snapshot(i, &format!("p{i}"), 1)))
                        .await
                })
            })
            .collect();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        tasks
    }

    #[tokio::test]
    async fn writes_queued_behind_a_commit_share_the_next_one() {
        let (gate, wt) = gated();
        // The first write is alone; 50 more arrive while it is in flight.
        let first = in_flight(&gate, &wt, snapshot(1, "p0", 1)).await;
        let rest = queued(&wt, 2..=51).await;
        gate.release.add_permits(2);
        assert_eq!(first.await.expect("join"), Ok(()));
        for r in rest {
            assert_eq!(r.await.expect("join"), Ok(()));
        }
        assert_eq!(
            *gate.groups.lock().unwrap_or_else(|e| e.into_inner()),
            vec![1, 50]
        );
        assert_eq!(wt.commits.load(Ordering::Relaxed), 2);
        assert_eq!(wt.writes.load(Ordering::Relaxed), 51);
        assert!(gate
            .inner
            .get(&snapshot(30, "p30", 1).session_id)
            .await
            .expect("get")
            .is_some());

        // A fenced write is answered as such and pauses nobody; a timeout pauses writes.
        gate.release.add_permits(2);
        assert_eq!(
            wt.commit(SnapshotWrite::whole(snapshot(60, "stale", 0)))
                .await,
            Err(StoreError::Fenced)
        );
        assert!(!wt.paused());
        assert_eq!(wt.fenced.load(Ordering::Relaxed), 1);
        assert_eq!(
            wt.commit(SnapshotWrite::whole(snapshot(61, "slow", 99)))
                .await,
            Err(StoreError::Timeout)
        );
        assert!(wt.paused());
        assert_eq!(wt.failures.load(Ordering::Relaxed), 1);
        // While paused, a queued write is answered at once, without the store.
        let groups = gate.groups.lock().unwrap_or_else(|e| e.into_inner()).len();
        assert!(matches!(
            wt.commit(SnapshotWrite::whole(snapshot(62, "queued", 1)))
                .await,
            Err(StoreError::Unavailable(_))
        ));
        assert_eq!(
            gate.groups.lock().unwrap_or_else(|e| e.into_inner()).len(),
            groups
        );
    }

    /// Regression (CI: every session of a busy edge called its link dead while Redis was
    /// down): the writes queued behind a commit that failed are answered at once, not sent
    /// into the same trouble. Before the fix the pause started only when an answered
    /// session's task ran, after the committer had taken the next group and sent it.
    #[tokio::test(flavor = "current_thread")]
    async fn writes_queued_behind_a_failed_commit_are_not_sent_into_the_same_failure() {
        let (gate, wt) = gated();
        // The first write times out in the store; ten more queue while it is in flight.
        let first = in_flight(&gate, &wt, snapshot(1, "slow", 99)).await;
        let queued = queued(&wt, 2..=11).await;
        // Room for every group the committer might send: only the failing one is.
        gate.release.add_permits(16);
        assert_eq!(first.await.expect("join"), Err(StoreError::Timeout));
        for q in queued {
            assert!(matches!(
                q.await.expect("join"),
                Err(StoreError::Unavailable(_))
            ));
        }
        assert_eq!(
            *gate.groups.lock().unwrap_or_else(|e| e.into_inner()),
            vec![1],
            "only the failing group reached the store"
        );
        assert!(wt.paused());
        assert_eq!(wt.failures.load(Ordering::Relaxed), 11);
    }
}

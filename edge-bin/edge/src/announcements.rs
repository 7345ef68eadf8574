//! The announcement log (PROTOCOL.md §12.5, SPEC F2): where an announcement (a critical
//! channel publication) is made durable before its publisher is told it was taken, and
//! where a member whose channel's epoch is gone (its edge died or restarted) finds the
//! announcements it missed.
//!
//! [`AnnouncementLog`] is the interface; [`FileAnnouncementLog`] is the one-edge log (an
//! append-only file with an fsync policy, compacted when it reaches its size cap); the Redis
//! one (a stream per channel epoch, readable from every edge) is
//! `cluster::redis::RedisAnnouncementLog`. The hold-until-logged rule is the channel hub's
//! (`waygate_channels::ChannelHub::persisted`); the edge's writer task
//! (`edge/channels.rs`) feeds the log in order and answers the publishers.
//!
//! What it must never do: reorder a channel's announcements, grow without bound (each
//! channel epoch keeps its kind's history length for its history TTL; the file is compacted
//! at its cap, and when what is unexpired needs more than half of it, new announcements are
//! refused: an accepted announcement is never dropped before its TTL), or block a tokio
//! worker on file I/O.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
pub use waygate_channels::{AnnouncementRecord, FsyncPolicy};
use waygate_protocol::channel::ChannelPosition;

/// Why the log did not take or give announcements.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AnnouncementLogError {
    // ----- the log's medium
    /// The file could not be written, synced or read.
    #[error("announcement log I/O: {0}")]
    Io(String),
    /// The remote log (Redis) did not answer or refused.
    #[error("announcement log unavailable: {0}")]
    Unavailable(String),
    // ----- the log's capacity
    /// The file log's unexpired announcements need more than half its size cap: new ones
    /// are refused until some expire (the accepted ones are never dropped early).
    #[error("announcement log full: {live} bytes of unexpired announcements, cap {cap}")]
    Full {
        /// Bytes the unexpired announcements take, with the refused batch.
        live: u64,
        /// The size cap.
        cap: u64,
    },
    // ----- the log's content
    /// A record could not be decoded.
    #[error("announcement log record corrupt: {0}")]
    Corrupt(String),
}

/// Where announcements are made durable, in order, and read back (module docs).
#[async_trait]
pub trait AnnouncementLog: Send + Sync + std::fmt::Debug + 'static {
    /// Appends `records` in this order (one batch: one fsync or one round trip). `Ok`: all
    /// of them are durable; `Err`: none may be counted on.
    async fn append(&self, records: &[AnnouncementRecord]) -> Result<(), AnnouncementLogError>;

    /// Withdraws `records`, whose append failed or did not answer in time (so it may still
    /// land): [`after`](Self::after) never returns them, whether their append landed before
    /// the withdrawal or lands after it. `Ok`: the withdrawal is durable.
    async fn withdraw(&self, records: &[AnnouncementRecord]) -> Result<(), AnnouncementLogError>;

    /// The announcements of `channel` after `since`, in `since`'s epoch, in offset order,
    /// at most `limit`.
    async fn after(
        &self,
        channel: &str,
        since: ChannelPosition,
        limit: usize,
    ) -> Result<Vec<AnnouncementRecord>, AnnouncementLogError>;
}

/// One record in the file: its length (u32 LE) before it. A record with an empty event
/// withdraws that offset (an event is never empty: it has its header).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct FileRecord {
    channel: String,
    epoch: u64,
    offset: u64,
    /// Unix milliseconds after which the record is dropped.
    expires_ms: u64,
    keep: u64,
    event: Vec<u8>,
}

#[derive(Debug)]
struct Kept {
    offset: u64,
    expires_ms: u64,
    event: Bytes,
    /// Its record's size in the file.
    bytes: u64,
}

#[derive(Debug)]
struct Epoch {
    keep: usize,
    entries: VecDeque<Kept>,
    /// Offsets withdrawn (their append failed or timed out), kept until they expire: never
    /// read back, also when their append landed before the withdrawal in the file or lands
    /// after it.
    withdrawn: std::collections::BTreeMap<u64, Withdrawn>,
}

/// A withdrawal's record in the file.
#[derive(Debug)]
struct Withdrawn {
    expires_ms: u64,
    bytes: u64,
}

/// How much longer a withdrawal lives than the announcement it withdraws: an append that
/// did not answer in time may start after its withdrawal, and its record must expire first.
const WITHDRAWAL_MARGIN_MS: u64 = 60_000;

#[derive(Debug)]
struct FileState {
    path: PathBuf,
    file: std::fs::File,
    len: u64,
    /// Bytes of the records the index holds (what a compaction keeps).
    live: u64,
    index: HashMap<(Arc<str>, u64), Epoch>,
}

/// The one-edge announcement log: an append-only file (module docs).
#[derive(Debug, Clone)]
pub struct FileAnnouncementLog {
    state: Arc<Mutex<FileState>>,
    fsync: FsyncPolicy,
    max_bytes: u64,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn io(e: std::io::Error) -> AnnouncementLogError {
    AnnouncementLogError::Io(e.to_string())
}

fn encode(r: &FileRecord) -> Result<Vec<u8>, AnnouncementLogError> {
    let body = postcard::to_allocvec(r)
        .map_err(|e| AnnouncementLogError::Corrupt(format!("encode: {e}")))?;
    let len = u32::try_from(body.len())
        .map_err(|_| AnnouncementLogError::Corrupt("record above 4 GiB".into()))?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

impl FileState {
    /// Indexes a record of `bytes` in the file.
    fn remember(&mut self, r: FileRecord, bytes: u64, now_ms: u64) {
        if r.expires_ms <= now_ms {
            return;
        }
        let e = self
            .index
            .entry((r.channel.as_str().into(), r.epoch))
            .or_insert_with(|| Epoch {
                keep: 1,
                entries: VecDeque::new(),
                withdrawn: std::collections::BTreeMap::new(),
            });
        e.keep = usize::try_from(r.keep).unwrap_or(usize::MAX).max(1);
        if r.event.is_empty() {
            if let Some(i) = e.entries.iter().position(|k| k.offset == r.offset) {
                if let Some(k) = e.entries.remove(i) {
                    self.live -= k.bytes;
                }
            }
            if let std::collections::btree_map::Entry::Vacant(v) = e.withdrawn.entry(r.offset) {
                v.insert(Withdrawn {
                    expires_ms: r.expires_ms,
                    bytes,
                });
                self.live += bytes;
            }
            return;
        }
        if e.withdrawn.contains_key(&r.offset)
            || e.entries.back().is_some_and(|k| k.offset >= r.offset)
        {
            return;
        }
        e.entries.push_back(Kept {
            offset: r.offset,
            expires_ms: r.expires_ms,
            event: r.event.into(),
            bytes,
        });
        self.live += bytes;
        while e.entries.len() > e.keep {
            if let Some(k) = e.entries.pop_front() {
                self.live -= k.bytes;
            }
        }
    }

    fn trim(&mut self, now_ms: u64) {
        let mut freed = 0;
        for e in self.index.values_mut() {
            while e.entries.front().is_some_and(|k| k.expires_ms <= now_ms) {
                if let Some(k) = e.entries.pop_front() {
                    freed += k.bytes;
                }
            }
            e.withdrawn.retain(|_, w| {
                let keep = w.expires_ms > now_ms;
                if !keep {
                    freed += w.bytes;
                }
                keep
            });
        }
        self.live -= freed;
        self.index
            .retain(|_, e| !e.entries.is_empty() || !e.withdrawn.is_empty());
    }

    /// Rewrites the file with what the index holds (a temporary file renamed over it).
    fn compact(&mut self) -> Result<(), AnnouncementLogError> {
        let mut records: Vec<Vec<u8>> = Vec::new();
        for ((channel, epoch), e) in &self.index {
            // The kept announcements, then the withdrawals (an empty event).
            let kept = e
                .entries
                .iter()
                .map(|k| (k.offset, k.expires_ms, &k.event[..]));
            let withdrawn = e.withdrawn.iter().map(|(o, w)| (*o, w.expires_ms, &[][..]));
            for (offset, expires_ms, event) in kept.chain(withdrawn) {
                records.push(encode(&FileRecord {
                    channel: channel.to_string(),
                    epoch: *epoch,
                    offset,
                    expires_ms,
                    keep: e.keep as u64,
                    event: event.to_vec(),
                })?);
            }
        }
        let tmp = self.path.with_extension("compact");
        {
            let mut f = std::fs::File::create(&tmp).map_err(io)?;
            for b in &records {
                f.write_all(b).map_err(io)?;
            }
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, &self.path).map_err(io)?;
        self.file = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(io)?;
        self.len = records.iter().map(|b| b.len() as u64).sum();
        Ok(())
    }

    /// Makes room for `need` more bytes under `max_bytes`: compacts when the file would
    /// pass the cap, and refuses when the unexpired announcements and `need` take more
    /// than half of it (so a compaction always halves the file: no rewrite per append) —
    /// unless nothing is unexpired: a batch larger than half a small cap still goes in.
    fn make_room(
        &mut self,
        need: u64,
        max_bytes: u64,
        now_ms: u64,
    ) -> Result<(), AnnouncementLogError> {
        if self.len + need <= max_bytes {
            return Ok(());
        }
        self.trim(now_ms);
        if self.live > 0 && self.live + need > max_bytes / 2 {
            return Err(AnnouncementLogError::Full {
                live: self.live + need,
                cap: max_bytes,
            });
        }
        self.compact()
    }
}

impl FileAnnouncementLog {
    /// Opens (or creates) the log at `path` and reads what it holds. A record cut short
    /// by a crash ends the file there (it was never answered).
    pub fn open(
        path: &Path,
        fsync: FsyncPolicy,
        max_bytes: u64,
    ) -> Result<Self, AnnouncementLogError> {
        let now = unix_ms();
        let mut data = Vec::new();
        match std::fs::File::open(path) {
            Ok(mut f) => {
                f.read_to_end(&mut data).map_err(io)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        let mut state = FileState {
            path: path.to_owned(),
            file: std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(io)?,
            len: 0,
            live: 0,
            index: HashMap::new(),
        };
        let mut at = 0usize;
        while let Some(len) = data.get(at..at + 4) {
            let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
            let Some(body) = data.get(at + 4..at + 4 + len) else {
                break;
            };
            let Ok(r) = postcard::from_bytes::<FileRecord>(body) else {
                break;
            };
            state.remember(r, 4 + len as u64, now);
            at += 4 + len;
        }
        if at < data.len() {
            tracing::warn!(
                path = %path.display(),
                cut = data.len() - at,
                "announcement log ends in a partial record (a crash while writing): cut"
            );
            state.file.set_len(at as u64).map_err(io)?;
        }
        state.len = at as u64;
        let log = Self {
            state: Arc::new(Mutex::new(state)),
            fsync,
            max_bytes: max_bytes.max(4096),
        };
        Ok(log)
    }

    /// Writes `records` (`withdraw`: their withdrawals instead) in one write and fsync.
    fn write_now(
        &self,
        records: &[AnnouncementRecord],
        withdraw: bool,
    ) -> Result<(), AnnouncementLogError> {
        let now = unix_ms();
        let mut out = Vec::new();
        let mut file_records = Vec::with_capacity(records.len());
        for r in records {
            let ttl = u64::try_from(r.ttl.as_millis()).unwrap_or(u64::MAX);
            let ttl = if withdraw {
                ttl.saturating_add(WITHDRAWAL_MARGIN_MS)
            } else {
                ttl
            };
            let fr = FileRecord {
                channel: r.channel.to_string(),
                epoch: r.position.epoch,
                offset: r.position.offset,
                expires_ms: now.saturating_add(ttl),
                keep: r.keep.max(1) as u64,
                event: if withdraw {
                    Vec::new()
                } else {
                    r.event.to_vec()
                },
            };
            let bytes = encode(&fr)?;
            file_records.push((fr, bytes.len() as u64));
            out.extend(bytes);
        }
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.make_room(out.len() as u64, self.max_bytes, now)?;
        let at = s.len;
        let written = s.file.write_all(&out).and_then(|()| match self.fsync {
            FsyncPolicy::Always => s.file.sync_data(),
            FsyncPolicy::Never => Ok(()),
        });
        if let Err(e) = written {
            // Nothing of a failed batch may stay to be read back at the next start.
            let _ = s.file.set_len(at);
            return Err(io(e));
        }
        s.len += out.len() as u64;
        for (fr, bytes) in file_records {
            s.remember(fr, bytes, now);
        }
        Ok(())
    }

    /// Bytes in the file now.
    pub fn len_bytes(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).len
    }
}

#[async_trait]
impl AnnouncementLog for FileAnnouncementLog {
    async fn append(&self, records: &[AnnouncementRecord]) -> Result<(), AnnouncementLogError> {
        let log = self.clone();
        let records = records.to_vec();
        tokio::task::spawn_blocking(move || log.write_now(&records, false))
            .await
            .map_err(|e| AnnouncementLogError::Io(format!("writer task: {e}")))?
    }

    async fn withdraw(&self, records: &[AnnouncementRecord]) -> Result<(), AnnouncementLogError> {
        let log = self.clone();
        let records = records.to_vec();
        tokio::task::spawn_blocking(move || log.write_now(&records, true))
            .await
            .map_err(|e| AnnouncementLogError::Io(format!("writer task: {e}")))?
    }

    async fn after(
        &self,
        channel: &str,
        since: ChannelPosition,
        limit: usize,
    ) -> Result<Vec<AnnouncementRecord>, AnnouncementLogError> {
        // The index's lock is held by an append during its write and fsync: waited for
        // off the tokio workers.
        let log = self.clone();
        let channel: Arc<str> = channel.into();
        tokio::task::spawn_blocking(move || log.after_now(channel, since, limit))
            .await
            .map_err(|e| AnnouncementLogError::Io(format!("reader task: {e}")))
    }
}

impl FileAnnouncementLog {
    fn after_now(
        &self,
        channel: Arc<str>,
        since: ChannelPosition,
        limit: usize,
    ) -> Vec<AnnouncementRecord> {
        let now = unix_ms();
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(e) = s.index.get(&(channel.clone(), since.epoch)) else {
            return Vec::new();
        };
        e.entries
            .iter()
            .filter(|k| k.offset > since.offset && k.expires_ms > now)
            .take(limit)
            .map(|k| AnnouncementRecord {
                channel: channel.clone(),
                position: ChannelPosition {
                    epoch: since.epoch,
                    offset: k.offset,
                },
                event: k.event.clone(),
                ttl: Duration::from_millis(k.expires_ms.saturating_sub(now)),
                keep: e.keep,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(channel: &str, epoch: u64, offset: u64, keep: usize) -> AnnouncementRecord {
        AnnouncementRecord {
            channel: channel.into(),
            position: ChannelPosition { epoch, offset },
            event: Bytes::from(format!("{channel}/{epoch}/{offset}")),
            ttl: Duration::from_secs(60),
            keep,
        }
    }

    fn since(epoch: u64, offset: u64) -> ChannelPosition {
        ChannelPosition { epoch, offset }
    }

    #[tokio::test]
    async fn announcements_survive_a_reopen_in_order_and_within_their_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ann.log");
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Always, 1 << 20).unwrap();
        log.append(&[record("guild:1", 7, 1, 3), record("world", 9, 2, 3)])
            .await
            .unwrap();
        log.append(&[
            record("guild:1", 7, 3, 3),
            record("guild:1", 7, 4, 3),
            record("guild:1", 7, 6, 3),
        ])
        .await
        .unwrap();
        drop(log);
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Always, 1 << 20).unwrap();
        let got = log.after("guild:1", since(7, 3), 10).await.unwrap();
        let offsets: Vec<u64> = got.iter().map(|r| r.position.offset).collect();
        assert_eq!(offsets, [4, 6]);
        assert_eq!(got[0].event, Bytes::from("guild:1/7/4"));
        // keep 3: offset 1 was dropped.
        let all = log.after("guild:1", since(7, 0), 10).await.unwrap();
        assert_eq!(all.len(), 3);
        assert!(log
            .after("guild:1", since(8, 0), 10)
            .await
            .unwrap()
            .is_empty());
        assert_eq!(log.after("world", since(9, 0), 10).await.unwrap().len(), 1);
        assert_eq!(log.after("guild:1", since(7, 0), 1).await.unwrap().len(), 1);
    }

    /// A withdrawn announcement is never read back: not when its append landed before the
    /// withdrawal, not when it lands after it, not after a reopen or a compaction.
    #[tokio::test]
    async fn a_withdrawn_announcement_is_never_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ann.log");
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, 1 << 20).unwrap();
        let offsets = |got: Vec<AnnouncementRecord>| -> Vec<u64> {
            got.iter().map(|r| r.position.offset).collect()
        };
        log.append(&[record("room:a", 1, 1, 10), record("room:a", 1, 2, 10)])
            .await
            .unwrap();
        // Offset 2's append landed although it was refused; offset 3's lands later.
        log.withdraw(&[record("room:a", 1, 2, 10), record("room:a", 1, 3, 10)])
            .await
            .unwrap();
        log.append(&[record("room:a", 1, 3, 10)]).await.unwrap();
        log.append(&[record("room:a", 1, 4, 10)]).await.unwrap();
        let read = |log: FileAnnouncementLog| async move {
            log.after("room:a", since(1, 0), 10).await.unwrap()
        };
        assert_eq!(offsets(read(log.clone()).await), [1, 4]);
        drop(log);
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, 1 << 20).unwrap();
        assert_eq!(offsets(read(log.clone()).await), [1, 4], "after a reopen");
        log.state.lock().unwrap().compact().unwrap();
        drop(log);
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, 1 << 20).unwrap();
        assert_eq!(offsets(read(log).await), [1, 4], "after a compaction");
    }

    #[tokio::test]
    async fn a_record_cut_short_by_a_crash_is_dropped_and_the_log_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ann.log");
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, 1 << 20).unwrap();
        log.append(&[record("room:a", 1, 1, 10)]).await.unwrap();
        let good = log.len_bytes();
        drop(log);
        // A crash in the middle of the next record.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(&200u32.to_le_bytes()).unwrap();
        f.write_all(b"half a record").unwrap();
        drop(f);
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, 1 << 20).unwrap();
        assert_eq!(log.len_bytes(), good);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), good);
        log.append(&[record("room:a", 1, 2, 10)]).await.unwrap();
        drop(log);
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, 1 << 20).unwrap();
        let offsets: Vec<u64> = log
            .after("room:a", since(1, 0), 10)
            .await
            .unwrap()
            .iter()
            .map(|r| r.position.offset)
            .collect();
        assert_eq!(offsets, [1, 2]);
    }

    #[tokio::test]
    async fn the_file_stays_under_its_cap_and_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ann.log");
        let cap = 8 * 1024;
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, cap).unwrap();
        for i in 1..=2_000u64 {
            log.append(&[record("system", 1, i, 100)]).await.unwrap();
            assert!(log.len_bytes() <= cap, "{} bytes", log.len_bytes());
        }
        let kept = log.after("system", since(1, 0), 1_000).await.unwrap();
        let offsets: Vec<u64> = kept.iter().map(|r| r.position.offset).collect();
        assert_eq!(offsets.last(), Some(&2_000));
        assert!(offsets.windows(2).all(|w| w[1] == w[0] + 1), "{offsets:?}");
        drop(log);
        assert!(std::fs::metadata(&path).unwrap().len() <= cap);
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, cap).unwrap();
        assert_eq!(
            log.after("system", since(1, 0), 1_000).await.unwrap().len(),
            kept.len()
        );
    }

    /// Regression (2026-12-04, second stop): at its cap the file dropped the announcements
    /// that expired first, accepted ones included, long before their TTL. Now new ones are
    /// refused while the unexpired ones need more than half the cap; every accepted one
    /// stays readable until it expires, and once they expire the log takes new ones again.
    #[tokio::test]
    async fn a_full_log_refuses_new_announcements_and_keeps_every_accepted_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ann.log");
        let cap = 8 * 1024;
        let log = FileAnnouncementLog::open(&path, FsyncPolicy::Never, cap).unwrap();
        let short = |offset| AnnouncementRecord {
            ttl: Duration::from_millis(400),
            ..record("system", 1, offset, 100_000)
        };
        let mut accepted = 0;
        for i in 1..=2_000u64 {
            match log.append(&[short(i)]).await {
                Ok(()) => accepted = i,
                Err(AnnouncementLogError::Full { live, cap: c }) => {
                    assert!(live > c / 2 && c == cap);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
            assert!(log.len_bytes() <= cap, "{} bytes", log.len_bytes());
        }
        assert!(accepted > 0 && accepted < 2_000, "{accepted}");
        let kept = log.after("system", since(1, 0), 10_000).await.unwrap();
        let offsets: Vec<u64> = kept.iter().map(|r| r.position.offset).collect();
        assert_eq!(offsets, (1..=accepted).collect::<Vec<_>>(), "none dropped");
        tokio::time::sleep(Duration::from_millis(500)).await;
        log.append(&[short(accepted + 1)]).await.unwrap();
        let after = log.after("system", since(1, 0), 10_000).await.unwrap();
        assert_eq!(
            after.len(),
            1,
            "the expired ones are gone, the new one is in"
        );
    }
}

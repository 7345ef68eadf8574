//! Control-plane sources of route tables (SPEC R9). The only module that uses tokio.
//!
//! A [`RouteSource`] publishes the latest *good* table through a `tokio::sync::watch`
//! channel with a revision; it never publishes a table that failed to parse or validate and
//! never retracts a good one because the control plane is unreachable. The edge keeps
//! serving from the last good table and reports [`SourceStatus::staleness`].
//!
//! [`FileRouteSource`] is the embedded default: a TOML or JSON file polled every interval
//! (mtime and content hash; no `notify` dependency), with the last good table persisted so a
//! restart works while the file is broken. An etcd source fits the same trait: `revision`
//! becomes the etcd mod revision to resume the watch from, and instances register and report
//! load through [`InstanceRegistry`] with leases.
//!
//! [`LastGoodTable`] is what every source shares: the watch channel holding the last good
//! table and its persisted JSON copy (load at start, persist on every new table).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use tokio::sync::watch;

use crate::hash::fnv1a64_prefixed;
use crate::table::{InstanceSpec, RouteTable, TableFormat};
use crate::{LoadReport, RoutingError};

/// Where the published table came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableOrigin {
    /// No good table yet.
    None,
    /// The control plane (file, etcd).
    Source,
    /// The locally persisted last good table (the source was broken or unreachable at start).
    Persisted,
}

/// What a [`RouteSource`] publishes.
#[derive(Debug, Clone)]
pub struct SourceUpdate {
    /// The latest good table, if any.
    pub table: Option<Arc<RouteTable>>,
    /// Increases with every published table (for etcd: the mod revision).
    pub revision: u64,
    /// Where the table came from.
    pub origin: TableOrigin,
}

/// Health of a source, for metrics and the admin API.
#[derive(Debug, Clone)]
pub struct SourceStatus {
    /// Revision of the table published last.
    pub revision: u64,
    /// Its epoch.
    pub epoch: Option<u64>,
    /// Where it came from.
    pub origin: TableOrigin,
    /// Last time the source was read successfully (changed or not).
    pub last_success: Option<Instant>,
    /// Message of the last error (the typed error went to the caller of the poll),
    /// cleared by the next success.
    pub last_error: Option<String>,
    /// Errors since the last success.
    pub consecutive_errors: u32,
    /// Modification time of the source file at the last read (file sources).
    pub mtime: Option<SystemTime>,
}

impl SourceStatus {
    fn empty() -> Self {
        Self {
            revision: 0,
            epoch: None,
            origin: TableOrigin::None,
            last_success: None,
            last_error: None,
            consecutive_errors: 0,
            mtime: None,
        }
    }

    /// Time since the source was last read successfully (`None`: never).
    #[must_use]
    pub fn staleness(&self, now: Instant) -> Option<Duration> {
        self.last_success.map(|t| now.saturating_duration_since(t))
    }
}

/// A control plane that publishes route tables.
#[async_trait]
pub trait RouteSource: Send + Sync {
    /// A receiver that always holds the latest good table and is notified on each new one.
    fn watch(&self) -> watch::Receiver<SourceUpdate>;

    /// Reads the source now (outside the regular polling / watch); returns the update in
    /// force afterwards, or the error (the last good table then stays published).
    async fn refresh(&self) -> Result<SourceUpdate, RoutingError>;

    /// Current health of the source.
    fn status(&self) -> SourceStatus;
}

/// Id of a registration lease (etcd lease id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub i64);

/// Instances (and edges) register themselves with a lease and report load (SPEC R9, R10).
/// Implemented by the etcd control plane; the file source has no registry.
#[async_trait]
pub trait InstanceRegistry: Send + Sync {
    /// Registers `instance` of `service`; it disappears when the lease is not renewed
    /// within `ttl`.
    async fn register(
        &self,
        service: &str,
        instance: &InstanceSpec,
        ttl: Duration,
    ) -> Result<LeaseId, RoutingError>;

    /// Renews the lease and publishes a load report.
    async fn keep_alive(&self, lease: LeaseId, load: LoadReport) -> Result<(), RoutingError>;

    /// Removes the registration at once.
    async fn revoke(&self, lease: LeaseId) -> Result<(), RoutingError>;
}

/// Settings of a [`FileRouteSource`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSourceConfig {
    /// The table file (`.json` is JSON, anything else TOML, unless `format` says).
    pub path: PathBuf,
    /// Forces the format instead of guessing from the extension.
    pub format: Option<TableFormat>,
    /// Where the last good table is persisted (JSON); `None`: not persisted.
    pub persist_path: Option<PathBuf>,
    /// How often [`FileRouteSource::spawn`]'s task polls the file.
    pub poll_interval: Duration,
}

impl FileSourceConfig {
    /// Polls `path` every second, no persistence.
    #[must_use]
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            format: None,
            persist_path: None,
            poll_interval: Duration::from_secs(1),
        }
    }

    /// Persists the last good table to `path`.
    #[must_use]
    pub fn persist_to(mut self, path: impl Into<PathBuf>) -> Self {
        self.persist_path = Some(path.into());
        self
    }

    /// Sets the polling interval.
    #[must_use]
    pub fn poll_every(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }
}

/// Result of one [`FileRouteSource::poll_once`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollOutcome {
    /// The file holds the table already published.
    Unchanged,
    /// A new table was published.
    Updated {
        /// Its epoch.
        epoch: u64,
        /// Its revision.
        revision: u64,
    },
}

#[derive(Debug)]
struct State {
    status: SourceStatus,
    last_good_hash: Option<u64>,
    last_bad_hash: Option<u64>,
}

#[derive(Debug)]
struct Inner {
    cfg: FileSourceConfig,
    last_good: LastGoodTable,
    state: Mutex<State>,
}

/// The embedded file control plane: hot reload by polling, last good table kept and
/// persisted.
#[derive(Debug, Clone)]
pub struct FileRouteSource {
    inner: Arc<Inner>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RoutingError + '_ {
    move |source| RoutingError::Io {
        path: path.to_owned(),
        source,
    }
}

impl FileRouteSource {
    /// Reads the file once (synchronously). If it is missing or invalid, the persisted last
    /// good table (if any) is published instead and the error is kept in the status.
    #[must_use]
    pub fn open(cfg: FileSourceConfig) -> Self {
        let last_good = LastGoodTable::new(cfg.persist_path.clone());
        let inner = Arc::new(Inner {
            cfg,
            last_good,
            state: Mutex::new(State {
                status: SourceStatus::empty(),
                last_good_hash: None,
                last_bad_hash: None,
            }),
        });
        if let Err(e) = inner.poll_once() {
            tracing::warn!(path = %inner.cfg.path.display(), error = %e, "route table file unusable at start");
            inner.load_persisted();
        }
        Self { inner }
    }

    /// Checks the file once (synchronously) and publishes its table if it changed and is
    /// valid and newer. An error leaves the last good table published; it is returned on
    /// every poll while the file stays broken, but logged only when the content changes.
    pub fn poll_once(&self) -> Result<PollOutcome, RoutingError> {
        self.inner.poll_once()
    }

    /// Starts a task polling every `poll_interval`; it ends when the last handle of this
    /// source is dropped.
    pub fn spawn(&self) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let every = self.inner.cfg.poll_interval.max(Duration::from_millis(1));
        tokio::spawn(async move {
            // `open` has just read the file: the first poll is one interval later.
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                let _ = inner.poll_once();
            }
        })
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &FileSourceConfig {
        &self.inner.cfg
    }
}

#[async_trait]
impl RouteSource for FileRouteSource {
    fn watch(&self) -> watch::Receiver<SourceUpdate> {
        self.inner.last_good.subscribe()
    }

    async fn refresh(&self) -> Result<SourceUpdate, RoutingError> {
        self.inner.poll_once()?;
        Ok(self.inner.last_good.current())
    }

    fn status(&self) -> SourceStatus {
        self.inner.lock().status.clone()
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn format(&self) -> TableFormat {
        self.cfg
            .format
            .unwrap_or_else(|| TableFormat::from_path(&self.cfg.path))
    }

    fn fail(&self, st: &mut State, e: RoutingError, hash: Option<u64>) -> RoutingError {
        if hash.is_none() || hash != st.last_bad_hash {
            tracing::warn!(path = %self.cfg.path.display(), error = %e, "route table rejected; keeping the last good table");
        }
        st.last_bad_hash = hash;
        st.status.consecutive_errors = st.status.consecutive_errors.saturating_add(1);
        st.status.last_error = Some(e.to_string());
        e
    }

    fn poll_once(&self) -> Result<PollOutcome, RoutingError> {
        let path = &self.cfg.path;
        let mut st = self.lock();
        let read = std::fs::metadata(path)
            .and_then(|m| Ok((m.modified().ok(), std::fs::read(path)?)))
            .map_err(io_err(path));
        let (mtime, bytes) = match read {
            Ok(x) => x,
            Err(e) => {
                return Err(self.fail(&mut st, e, None));
            }
        };
        st.status.mtime = mtime;
        let hash = fnv1a64_prefixed(&bytes);
        if Some(hash) == st.last_good_hash {
            st.status.last_success = Some(Instant::now());
            return Ok(PollOutcome::Unchanged);
        }
        let current = self.last_good.table();
        let parsed = RouteTable::from_slice(&bytes, self.format()).and_then(|t| match &current {
            Some(c) if **c == t => Ok(None),
            Some(c) if t.epoch <= c.epoch => Err(RoutingError::StaleEpoch {
                current: c.epoch,
                offered: t.epoch,
            }),
            _ => Ok(Some(t)),
        });
        let table = match parsed {
            Ok(t) => t,
            Err(e) => {
                return Err(self.fail(&mut st, e, Some(hash)));
            }
        };
        st.last_good_hash = Some(hash);
        st.last_bad_hash = None;
        st.status.last_success = Some(Instant::now());
        st.status.last_error = None;
        st.status.consecutive_errors = 0;
        let Some(table) = table else {
            // Same table as the persisted one we started from: it now comes from the source.
            self.last_good.confirm_source(&mut st.status);
            return Ok(PollOutcome::Unchanged);
        };
        let epoch = table.epoch;
        let revision = st.status.revision + 1;
        self.last_good.apply(&mut st.status, table, revision);
        tracing::info!(path = %path.display(), epoch, revision, "route table loaded");
        Ok(PollOutcome::Updated { epoch, revision })
    }

    fn load_persisted(&self) {
        let (Some(p), Some(loaded)) = (self.last_good.persist_path(), self.last_good.load()) else {
            return;
        };
        match loaded {
            Ok(t) => {
                let mut st = self.lock();
                let epoch = t.epoch;
                let revision = st.status.revision + 1;
                self.last_good.restore(&mut st.status, t, revision);
                tracing::warn!(path = %p.display(), epoch, "serving the persisted last good route table");
            }
            Err(e) => {
                tracing::warn!(path = %p.display(), error = %e, "no usable persisted route table")
            }
        }
    }
}

/// The last good table of a [`RouteSource`]: the `watch` channel that publishes it, and its
/// JSON copy on disk (when a persist path is set) so a restart works while the control plane
/// is broken or unreachable.
///
/// A source checks a new table first (parse, validate, epoch) and hands only a good one to
/// [`LastGoodTable::apply`]; on any error it leaves this alone, so the last good table stays
/// published (and persisted) and is never retracted. Shared by [`FileRouteSource`] and the
/// etcd source of the edge.
#[derive(Debug)]
pub struct LastGoodTable {
    tx: watch::Sender<SourceUpdate>,
    persist_path: Option<PathBuf>,
}

impl LastGoodTable {
    /// Nothing published yet (origin [`TableOrigin::None`], revision 0); new tables are
    /// persisted to `persist_path` as JSON when it is set.
    #[must_use]
    pub fn new(persist_path: Option<PathBuf>) -> Self {
        let (tx, _) = watch::channel(SourceUpdate {
            table: None,
            revision: 0,
            origin: TableOrigin::None,
        });
        Self { tx, persist_path }
    }

    /// Where the last good table is persisted, if anywhere.
    #[must_use]
    pub fn persist_path(&self) -> Option<&Path> {
        self.persist_path.as_deref()
    }

    /// A receiver of every update (for [`RouteSource::watch`]).
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<SourceUpdate> {
        self.tx.subscribe()
    }

    /// The update in force.
    #[must_use]
    pub fn current(&self) -> SourceUpdate {
        self.tx.borrow().clone()
    }

    /// The table in force, if any.
    #[must_use]
    pub fn table(&self) -> Option<Arc<RouteTable>> {
        self.tx.borrow().table.clone()
    }

    /// Reads the persisted table back (JSON, validated): `None` when there is no persist
    /// path, else the table or why it is unusable (missing or unreadable file, invalid
    /// table).
    #[must_use]
    pub fn load(&self) -> Option<Result<RouteTable, RoutingError>> {
        let p = self.persist_path.as_deref()?;
        Some(
            std::fs::read(p)
                .map_err(io_err(p))
                .and_then(|b| RouteTable::from_slice(&b, TableFormat::Json)),
        )
    }

    /// Publishes `table`, read back with [`LastGoodTable::load`], as `revision` with origin
    /// [`TableOrigin::Persisted`] and records it in `status`.
    pub fn restore(&self, status: &mut SourceStatus, table: RouteTable, revision: u64) {
        status.revision = revision;
        status.epoch = Some(table.epoch);
        status.origin = TableOrigin::Persisted;
        self.tx.send_replace(SourceUpdate {
            table: Some(Arc::new(table)),
            revision,
            origin: TableOrigin::Persisted,
        });
    }

    /// A new good table from the source: persists it (a failure is logged and the table is
    /// published all the same), publishes it as `revision` with origin
    /// [`TableOrigin::Source`] and records it in `status`.
    pub fn apply(&self, status: &mut SourceStatus, table: RouteTable, revision: u64) {
        if let Some(p) = &self.persist_path {
            if let Err(e) = persist(p, &table) {
                tracing::warn!(path = %p.display(), error = %e, "could not persist the last good route table");
            }
        }
        status.revision = revision;
        status.epoch = Some(table.epoch);
        status.origin = TableOrigin::Source;
        self.tx.send_replace(SourceUpdate {
            table: Some(Arc::new(table)),
            revision,
            origin: TableOrigin::Source,
        });
    }

    /// The source holds the table already published (the persisted one it started from): it
    /// now comes from the source. Nothing else changes (same table, same revision).
    pub fn confirm_source(&self, status: &mut SourceStatus) {
        status.origin = TableOrigin::Source;
        self.tx.send_modify(|u| u.origin = TableOrigin::Source);
    }
}

/// Writes `table` as JSON next to `path` and renames it into place (atomic on one
/// filesystem).
fn persist(path: &Path, table: &RouteTable) -> Result<(), RoutingError> {
    let json = table.to_json_string()?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, json).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(epoch: u64) -> RouteTable {
        let mut t = RouteTable::from_toml_str(
            r#"
            epoch = 1
            [[services]]
            name = "player"
            messages = [[1000, 1999]]
            key = "player"
            instances = [{ id = "p1", address = "10.0.0.1:7000" }]
            "#,
        )
        .expect("table");
        t.epoch = epoch;
        t
    }

    #[test]
    fn last_good_table_persists_restores_and_confirms() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("last-good.json");
        assert!(LastGoodTable::new(None).load().is_none());

        let a = LastGoodTable::new(Some(path.clone()));
        let rx = a.subscribe();
        assert!(matches!(a.load(), Some(Err(RoutingError::Io { .. }))));
        let mut st = SourceStatus::empty();
        a.apply(&mut st, table(3), 7);
        assert_eq!(
            (st.revision, st.epoch, st.origin),
            (7, Some(3), TableOrigin::Source)
        );
        assert_eq!(
            (rx.borrow().revision, rx.borrow().origin),
            (7, TableOrigin::Source)
        );
        assert!(!path.with_extension("json.tmp").exists());

        // A restart: the persisted copy is the same table, as JSON.
        let b = LastGoodTable::new(Some(path.clone()));
        let persisted = b.load().expect("configured").expect("usable");
        assert_eq!(persisted, table(3));
        let mut st = SourceStatus::empty();
        b.restore(&mut st, persisted, 1);
        assert_eq!(b.current().origin, TableOrigin::Persisted);
        assert_eq!(st.origin, TableOrigin::Persisted);
        b.confirm_source(&mut st);
        let u = b.current();
        assert_eq!(
            (u.revision, u.origin, st.origin),
            (1, TableOrigin::Source, TableOrigin::Source)
        );
        assert_eq!(b.table().map(|t| t.epoch), Some(3));

        // A broken copy is reported, not served.
        std::fs::write(&path, b"{").expect("write");
        assert!(matches!(b.load(), Some(Err(RoutingError::Json(_)))));
    }
}

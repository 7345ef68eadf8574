//! # waygate-backend
//!
//! The backend SDK: what a game server written in Rust uses to accept links from
//! waygate edges and handle the sessions routed to it (PROTOCOL.md §9). Implement
//! [`Service`], call [`serve`] (or [`Backend::bind`]), and push to sessions through
//! [`BackendSession`] — or to any player, on whichever edge its session is, with
//! [`BackendSession::push_to_player`] (a result per push; PROTOCOL.md §9.7).
//!
//! Ordering: each session has its own worker, so the messages and lifecycle calls of one
//! session reach the [`Service`] one at a time, in the order the client sent them; handlers
//! of different sessions run concurrently (your `Service` is shared: guard its state).
//! Flow control:
//! FORWARD credit is returned only after `message` returns, so a backend that is slow to
//! handle messages makes the edge answer `busy` for it instead of queueing (B4); pushes wait
//! for PUSH credit from the edge.
//!
//! What it must never do: pull in the edge or its dependencies. A game server depends on
//! this crate alone; its tree holds the protocol crate, the link I/O shell and tokio, never
//! etcd, Redis, axum, clap, quinn, tungstenite, kcp, the client SDK or the edge (checked by
//! `interop-tests/tests/dependency_rules.rs`). `examples/score_server.rs` is a complete
//! game server on it; [`demo`] is the demo game the `waygate backend` command runs.

pub mod demo;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, Semaphore};
use waygate_protocol::channel::{ChannelPosition, RESERVED_MSG_IDS_START};
use waygate_protocol::frame::SessionId;
use waygate_protocol::link::{LinkFrame, DEFAULT_MAX_LINK_FRAME, LINK_VERSION};
pub use waygate_protocol::link::{PinKind, PinOutcome, PlayerPushOutcome};
use waygate_protocol::{CloseCode, TrafficClass};

use waygate_link::spawn_link_io;
pub use waygate_link::tls as link_tls;
pub use waygate_link::{load_link_secret, LINK_SECRET_ENV};

/// Backend settings.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    /// This instance's id (must match the route table).
    pub instance_id: String,
    /// FORWARD frames an edge may have in flight to this instance. Default 1,024: at
    /// 20,000 messages/s that is 51 ms of work, so a backend that is not behind but was
    /// held up for a few milliseconds (a shared core) does not make the edge refuse its
    /// clients `busy` (W2 at 1,000 x 20/s: 0.5–5% `busy` with 256, none with 1,024;
    /// BENCHMARKS.md, W2).
    pub forward_credits: u32,
    /// Messages one session may have waiting or running; more are refused `busy` (retry
    /// after [`SESSION_BUSY_RETRY_MS`]) at once, so a session whose handler waits (a
    /// publish to a slow edge, a database) gets an answer, not a growing delay. Default:
    /// 256, a quarter of the link's FORWARD credit, since a client legitimately sends
    /// bursts (a resume resends everything unacknowledged, up to its send buffer); lower
    /// it for handlers that may wait long.
    pub session_queue: u32,
    /// How long one call into the game's [`Service`] may run (`None`: no bound). A message
    /// whose handler runs past it is cancelled and refused `internal`, as one that panics,
    /// and the session's next messages go on; a lifecycle call past it is cancelled and
    /// logged. Without a bound, one stuck handler would hold its session's messages (and
    /// the client's acknowledgements) for ever. Default: 30 s.
    pub handler_timeout: Option<Duration>,
    /// Link heartbeat interval.
    pub heartbeat: Duration,
    /// Largest link frame accepted.
    pub max_link_frame: usize,
    /// The link secret shared with the edges (PROTOCOL.md §9.3): with it, every edge must
    /// prove it holds it (LINK_AUTH) before anything else on its link. Load it with
    /// [`load_link_secret`].
    pub link_secret: Option<Arc<[u8]>>,
    /// Listen beyond loopback without a link secret (anything that reaches the port can act
    /// as an edge). Only on a closed network.
    pub insecure_open_links: bool,
    /// Mutual TLS (PROTOCOL.md §9.3): links are TLS and an edge must present a certificate
    /// that chains to the configured CA. Build it with
    /// [`link_tls::server_config`].
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl BackendConfig {
    /// Defaults for an instance named `instance_id`.
    pub fn new(instance_id: impl Into<String>) -> Self {
        Self {
            instance_id: instance_id.into(),
            forward_credits: 1024,
            session_queue: 256,
            handler_timeout: Some(Duration::from_secs(30)),
            heartbeat: Duration::from_secs(2),
            max_link_frame: DEFAULT_MAX_LINK_FRAME,
            link_secret: None,
            insecure_open_links: false,
            tls: None,
        }
    }

    /// Refuses an address beyond loopback without a link secret (secure by default).
    fn check_exposure(&self, addr: SocketAddr) -> std::io::Result<()> {
        if addr.ip().is_loopback()
            || self.link_secret.is_some()
            || self.tls.is_some()
            || self.insecure_open_links
        {
            return Ok(());
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a backend listening on {addr} (beyond loopback) needs a link secret, or anything \
                 that reaches the port can act as an edge: set {} (or --link-secret-file), the \
                 same as the edges' links.secret_file. Only on a closed network: \
                 --insecure-open-links",
                waygate_link::LINK_SECRET_ENV
            ),
        ))
    }
}

/// One upstream message.
#[derive(Debug, Clone)]
pub struct Incoming {
    /// The client's message id.
    pub msg_id: u32,
    /// The client's seq (0 for best-effort).
    pub client_seq: u64,
    /// Traffic class.
    pub class: TrafficClass,
    /// The route epoch the edge used.
    pub epoch: u64,
    /// The body.
    pub payload: Bytes,
}

/// A client's request (PROTOCOL.md §13): answer it with [`BackendSession::answer`].
pub type Request = waygate_protocol::request::Request;

impl Incoming {
    /// This message as a request (its body starts with the client's request id), or `None`
    /// when it does not follow the convention (refuse it, e.g. with `bad_request`).
    pub fn request(&self) -> Option<Request> {
        waygate_protocol::request::decode_request(&self.payload).ok()
    }
}

/// A refusal of one message, sent back to the client as ERROR.
#[derive(Debug, Clone, Copy)]
pub struct Refusal {
    /// Why (`busy`, `unavailable`, `stale_epoch`...).
    pub code: CloseCode,
    /// Retry hint in milliseconds.
    pub retry_after_ms: u32,
}

/// Errors of the backend library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The link to the session's edge is gone.
    #[error("link to the edge is closed")]
    LinkClosed,
    /// The message does not fit one link frame (`BackendConfig::max_link_frame`): nothing
    /// was sent and no credit taken.
    #[error("a frame of {len} bytes does not fit the link's {max}-byte frames")]
    TooLarge {
        /// Encoded size of the frame.
        len: usize,
        /// The link's largest frame.
        max: usize,
    },
    /// A name in the request (a channel, a player, a routing key...) is longer than the
    /// link carries (256 bytes; 1,024 for a reason): nothing was sent (the edge would take
    /// the frame for a malformed one and close the link, every session on it).
    #[error("{0} longer than the link carries: nothing was sent")]
    FieldTooLong(&'static str),
    /// No PUSH credit from the edge within the wait.
    #[error("edge granted no push credit in time")]
    NoCredit,
    /// The message id is reserved for the edge (from `0xFFFFFF00`: channel events).
    #[error("msg_id {0:#x} is reserved for the edge")]
    ReservedMsgId(u32),
    /// The edge refused a channel request (`queue_full`, `rate_limited`,
    /// `unknown_channel_kind`, `member_offline`, `channel_limit`...).
    #[error("channel request refused: {code} (retry after {retry_after_ms} ms)")]
    ChannelRefused {
        /// Why.
        code: CloseCode,
        /// Retry hint (0 = none).
        retry_after_ms: u32,
    },
    /// An announcement the edge's announcement log did not take (`unavailable`, 403):
    /// published to nobody, and its offset `position` is never used — the channel's members
    /// see their offsets skip it (PROTOCOL.md §12.5). Publish it again after
    /// `retry_after_ms` (with the same request id: it gets a new offset).
    #[error("announcement withdrawn: the announcement log did not take it (offset {} skipped; retry after {retry_after_ms} ms)", position.offset)]
    AnnouncementWithdrawn {
        /// The offset it had been given (and its channel's epoch on that edge).
        position: ChannelPosition,
        /// Retry hint.
        retry_after_ms: u32,
    },
    /// The edge did not answer a channel request (or a pin) in time; a publish may be
    /// retried with the same request id ([`BackendSession::publish_with_id`]) without being
    /// published twice.
    #[error("no answer from the edge in time")]
    NoAnswer,
    /// The edge did not carry out a PIN or UNPIN ([`BackendSession::pin`],
    /// [`BackendSession::unpin`]): its PIN_RESULT says why (`unknown_instance`, `full`,
    /// `no_table`, `unavailable`).
    #[error("pin refused by the edge: {0}")]
    PinRefused(PinOutcome),
    /// The session's edge predates this request (its LINK_HELLO lacks the feature, e.g.
    /// UNPIN): nothing was sent (an unknown frame would close the link).
    #[error("the edge does not support {0}: nothing was sent")]
    NotSupportedByEdge(&'static str),
    /// Socket error.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// How the edge took a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishAnswer {
    /// The publication's position (offset 0 for best-effort).
    pub position: ChannelPosition,
    /// A publish with this request id was already taken: nothing was published now.
    pub duplicate: bool,
    /// Only in [`BackendSession::publish_on_every_edge`]'s results: the edge told this
    /// backend it has no channel of that name (no members, no history: PROTOCOL.md §12.6),
    /// so nothing was sent to it; `position` is then the default.
    pub skipped: bool,
}

/// The retry-after of a `busy` refusal for a session whose queue is full
/// ([`BackendConfig::session_queue`]).
pub const SESSION_BUSY_RETRY_MS: u32 = 100;

/// How long a channel request waits for the edge's CHANNEL_RESULT.
const CHANNEL_ANSWER_WAIT: Duration = Duration::from_secs(5);

/// How long a publish answered `busy` (its announcement still being written to the edge's
/// log) is asked again: the edge answers an announcement within 4 s (PROTOCOL.md §12.5).
const PERSISTING_WAIT: Duration = Duration::from_secs(5);

/// A fresh channel request id, unique in this process and unlikely to repeat across
/// processes (the edge remembers publish ids per channel to answer retries).
pub fn next_request_id() -> u64 {
    static NEXT: OnceLock<AtomicU64> = OnceLock::new();
    NEXT.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        AtomicU64::new((nanos ^ (u64::from(std::process::id()) << 40)) | 1)
    })
    .fetch_add(1, Ordering::Relaxed)
    .max(1)
}

/// The publish request id of publication `part` made for `session`'s message `client_seq`
/// (see [`BackendSession::publish_id_for`]): the first 8 bytes (little-endian) of SHA-256
/// over the session id, `client_seq` (u64 little-endian) and `part` (u32 little-endian) —
/// the same in every process and release — and never 0.
pub fn message_publish_id(session: &SessionId, client_seq: u64, part: u32) -> u64 {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(session);
    ctx.update(&client_seq.to_le_bytes());
    ctx.update(&part.to_le_bytes());
    let mut id = [0u8; 8];
    id.copy_from_slice(&ctx.finish().as_ref()[..8]);
    u64::from_le_bytes(id).max(1)
}

/// Channel requests waiting for their CHANNEL_RESULT (pushes to players for their
/// PLAYER_PUSH_RESULT, pins for their PIN_RESULT), by request id. One id can have
/// several waiters (two copies of one client message publishing with its id,
/// [`BackendSession::publish_id_for`]); every answer to an id concerns the same publication,
/// so each answer goes to the longest waiting (each waiter is tagged to leave on its own).
type ChannelAnswers = Arc<Mutex<HashMap<u64, VecDeque<(u64, oneshot::Sender<LinkFrame>)>>>>;

/// The link reader's hook: a CHANNEL_RESULT completes its request on the reader's own task,
/// so a handler waiting for one (a publish inside [`Service::message`]) never waits for the
/// frame loop it is blocking. A CHANNEL_INTEREST is taken and acknowledged there too, in
/// the order it came with the CREDIT frames (which the reader applies as well).
fn answer_hook(answers: ChannelAnswers, channels: Arc<EdgeChannels>) -> waygate_link::OnFrame {
    Arc::new(move |frame| match frame {
        LinkFrame::ChannelInterest {
            seq,
            present,
            channel,
        } => {
            channels.take(present, channel);
            // Taken: every publish decided from now on sees it.
            waygate_link::FrameHandled::Reply(vec![LinkFrame::ChannelInterestAck { seq }])
        }
        LinkFrame::ChannelResult { request_id, .. }
        | LinkFrame::PlayerPushResult { request_id, .. }
        | LinkFrame::PinResult { request_id, .. } => {
            let waiting = answers.lock().ok().and_then(|mut a| {
                let queue = a.get_mut(&request_id)?;
                let first = queue.pop_front().map(|(_, tx)| tx);
                if queue.is_empty() {
                    a.remove(&request_id);
                }
                first
            });
            if let Some(tx) = waiting {
                // Err only when the requester's future was dropped (it stopped waiting);
                // a publish it retries with the same id is answered `duplicate`.
                let _ = tx.send(frame);
            }
            waygate_link::FrameHandled::Taken
        }
        other => waygate_link::FrameHandled::Queue(other),
    })
}

/// The game logic of a backend instance.
#[async_trait]
pub trait Service: Send + Sync + 'static {
    /// A session was routed here (SESSION_OPEN).
    async fn session_open(&self, _session: &BackendSession) {}
    /// One message of a session. When it returns `Ok`, the edge is told the message was
    /// processed (FORWARD_DONE, PROTOCOL.md §9.6) after every push sent from here, and only
    /// then acknowledges it to the client: reply from within this call (not from a task it
    /// spawns) for the reply to be covered. A message may arrive a second time (same session
    /// id and client seq) if the edge that forwarded it died before it learnt the answer.
    /// `Err` refuses it (the client gets an ERROR with its code).
    async fn message(&self, session: &BackendSession, msg: Incoming) -> Result<(), Refusal>;
    /// The client dropped; the session lingers for `linger`.
    async fn session_detached(&self, _session: &BackendSession, _linger: Duration) {}
    /// The client came back (`gap`: it lost messages and must resync).
    async fn session_reattached(&self, _session: &BackendSession, _gap: bool) {}
    /// The session ended here.
    async fn session_closed(&self, _session: &BackendSession, _code: CloseCode) {}
}

#[derive(Debug)]
struct LinkSender {
    /// Every link of this backend process (this one included).
    all: Arc<EdgeLinks>,
    tx: mpsc::Sender<LinkFrame>,
    push_credit: Arc<Semaphore>,
    edge_id: String,
    /// Channel requests waiting for their CHANNEL_RESULT.
    answers: ChannelAnswers,
    /// The edge holds a handler's pushes until its answer (ANSWER_PUSH, §9.6).
    held_answers: bool,
    /// The channels the edge has, when it tells them (CHANNEL_INTEREST, §12.6).
    channels: Option<Arc<EdgeChannels>>,
    /// The edge answers PIN and UNPIN with PIN_RESULT (§9.5): pins are confirmed.
    pin_results: bool,
    /// The link's largest frame.
    max_frame: usize,
}

/// The channels one edge has, as its CHANNEL_INTEREST notices say (PROTOCOL.md §12.6).
#[derive(Debug, Default)]
struct EdgeChannels {
    /// The edge's first CREDIT came: every channel it had at link-up was told before it.
    synced: std::sync::atomic::AtomicBool,
    present: Mutex<std::collections::HashSet<String>>,
    /// More notices than [`MAX_EDGE_CHANNELS`] came: the set is no longer trusted.
    overflowed: std::sync::atomic::AtomicBool,
}

/// Channels remembered per edge link from its notices (an edge has at most
/// `channels.max_channels`, 10,000 by default): the set is bounded whatever a peer sends.
const MAX_EDGE_CHANNELS: usize = 1_048_576;

impl EdgeChannels {
    /// Whether a publish to `channel` is sent to this edge: unless the edge told (and is
    /// synced) that it does not have it.
    fn has(&self, channel: &str) -> bool {
        if !self.synced.load(Ordering::Acquire) || self.overflowed.load(Ordering::Acquire) {
            return true;
        }
        self.present
            .lock()
            .map(|p| p.contains(channel))
            .unwrap_or(true)
    }

    fn take(&self, present: bool, channel: String) {
        if let Ok(mut p) = self.present.lock() {
            if !present {
                p.remove(&channel);
            } else if p.len() < MAX_EDGE_CHANNELS {
                p.insert(channel);
            } else {
                // Far above any edge's channel cap (`channels.max_channels`): not an edge
                // this link should believe. Publishes to it are then sent (never skipped).
                self.overflowed.store(true, Ordering::Release);
            }
        }
    }
}

/// The edge links of one backend process, for a publish on every edge.
#[derive(Debug, Default)]
struct EdgeLinks(Mutex<Vec<std::sync::Weak<LinkSender>>>);

impl EdgeLinks {
    fn add(&self, link: &Arc<LinkSender>) {
        if let Ok(mut links) = self.0.lock() {
            links.retain(|l| l.strong_count() > 0);
            links.push(Arc::downgrade(link));
        }
    }

    fn remove(&self, link: &Arc<LinkSender>) {
        if let Ok(mut links) = self.0.lock() {
            links.retain(|l| l.strong_count() > 0 && !std::ptr::eq(l.as_ptr(), Arc::as_ptr(link)));
        }
    }

    fn live(&self) -> Vec<Arc<LinkSender>> {
        self.0
            .lock()
            .map(|links| links.iter().filter_map(std::sync::Weak::upgrade).collect())
            .unwrap_or_default()
    }
}

/// One edge's answer to [`BackendSession::publish_on_every_edge`].
#[derive(Debug)]
pub struct EdgePublish {
    /// The edge (its LINK_HELLO id).
    pub edge_id: String,
    /// What it answered.
    pub result: Result<PublishAnswer, BackendError>,
}

impl LinkSender {
    /// Refuses a frame the link could not carry (too large, or a name too long for its
    /// field), before it takes credit or a queue slot.
    fn check_fits(&self, frame: &LinkFrame) -> Result<(), BackendError> {
        if let Some(field) = frame.oversized_field() {
            return Err(BackendError::FieldTooLong(field));
        }
        let len = frame.encoded_len();
        if len > self.max_frame {
            return Err(BackendError::TooLarge {
                len,
                max: self.max_frame,
            });
        }
        Ok(())
    }

    /// Sends a message frame that uses PUSH credit (PUSH, ANSWER_PUSH), waiting (bounded)
    /// for the credit.
    async fn send_with_credit(&self, frame: LinkFrame) -> Result<(), BackendError> {
        self.check_fits(&frame)?;
        self.take_push_credit().await?;
        self.tx
            .send(frame)
            .await
            .map_err(|_| BackendError::LinkClosed)
    }

    async fn take_push_credit(&self) -> Result<(), BackendError> {
        let permit = tokio::time::timeout(PUSH_CREDIT_WAIT, self.push_credit.acquire())
            .await
            .map_err(|_| BackendError::NoCredit)?
            .map_err(|_| BackendError::LinkClosed)?;
        permit.forget();
        Ok(())
    }

    /// Sends a channel request and waits for its answer. A CHANNEL_PUBLISH answered `busy`
    /// — the edge is still writing an announcement with this request id to its log (a
    /// retry of one whose answer was lost, or a client's message handled twice,
    /// PROTOCOL.md §12.5) — is asked again after the retry-after until the write is done
    /// (at most [`PERSISTING_WAIT`]): the answer is then that publication's (`duplicate`),
    /// or its withdrawal.
    async fn channel_request(
        &self,
        request_id: u64,
        frame: LinkFrame,
        uses_credit: bool,
    ) -> Result<PublishAnswer, BackendError> {
        let publish = matches!(frame, LinkFrame::ChannelPublish { .. });
        let until = tokio::time::Instant::now() + PERSISTING_WAIT;
        loop {
            let result = self
                .channel_request_once(request_id, frame.clone(), uses_credit)
                .await;
            match result {
                Err(BackendError::ChannelRefused {
                    code: CloseCode::Busy,
                    retry_after_ms,
                }) if publish && tokio::time::Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(u64::from(retry_after_ms.max(10))))
                        .await;
                }
                other => return other,
            }
        }
    }

    async fn channel_request_once(
        &self,
        request_id: u64,
        frame: LinkFrame,
        uses_credit: bool,
    ) -> Result<PublishAnswer, BackendError> {
        match self.request(request_id, frame, uses_credit).await? {
            LinkFrame::ChannelResult {
                code: CloseCode::Normal,
                position,
                duplicate,
                ..
            } => Ok(PublishAnswer {
                position,
                duplicate,
                skipped: false,
            }),
            LinkFrame::ChannelResult {
                code: CloseCode::Unavailable,
                retry_after_ms,
                position,
                ..
            } if position.offset != 0 => Err(BackendError::AnnouncementWithdrawn {
                position,
                retry_after_ms,
            }),
            LinkFrame::ChannelResult {
                code,
                retry_after_ms,
                ..
            } => Err(BackendError::ChannelRefused {
                code,
                retry_after_ms,
            }),
            _ => Err(BackendError::LinkClosed),
        }
    }

    /// Sends `frame` (after one PUSH credit when `uses_credit`) and waits up to
    /// [`CHANNEL_ANSWER_WAIT`] for the frame answering `request_id`.
    async fn request(
        &self,
        request_id: u64,
        frame: LinkFrame,
        uses_credit: bool,
    ) -> Result<LinkFrame, BackendError> {
        static WAITER: AtomicU64 = AtomicU64::new(0);
        self.check_fits(&frame)?;
        let waiter = WAITER.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut answers = self.answers.lock().map_err(|_| BackendError::LinkClosed)?;
            answers
                .entry(request_id)
                .or_default()
                .push_back((waiter, tx));
        }
        // Whatever ends this call — an error, the timeout, or the caller dropping it (a
        // handler cancelled at its deadline) — its waiter goes, so it can neither linger
        // until the link closes nor take the answer of a later request with the same id.
        let _forget = ForgetWaiter {
            answers: &self.answers,
            request_id,
            waiter,
        };
        if uses_credit {
            self.take_push_credit().await?;
        }
        if self.tx.send(frame).await.is_err() {
            return Err(BackendError::LinkClosed);
        }
        match tokio::time::timeout(CHANNEL_ANSWER_WAIT, rx).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(_)) => Err(BackendError::LinkClosed),
            Err(_) => Err(BackendError::NoAnswer),
        }
    }
}

/// Removes one request's waiter from the answers map when dropped (see
/// [`LinkSender::request`]); a waiter already answered is gone, and nothing happens.
struct ForgetWaiter<'a> {
    answers: &'a ChannelAnswers,
    request_id: u64,
    waiter: u64,
}

impl Drop for ForgetWaiter<'_> {
    fn drop(&mut self) {
        if let Ok(mut a) = self.answers.lock() {
            if let Some(queue) = a.get_mut(&self.request_id) {
                queue.retain(|(w, _)| *w != self.waiter);
                if queue.is_empty() {
                    a.remove(&self.request_id);
                }
            }
        }
    }
}

#[derive(Debug)]
struct SessionInner {
    /// The client seq of the message whose handler is running (0: none): pushes meanwhile
    /// go as ANSWER_PUSH of it when the edge holds answers (PROTOCOL.md §9.6).
    answering: AtomicU64,
    handle: u64,
    session_id: SessionId,
    player_id: String,
    fencing: u64,
    attrs: Vec<(String, String)>,
    instance_id: Arc<str>,
    link: Arc<LinkSender>,
}

/// A session routed to this instance, as seen through one edge's link. Cheap to clone; keep
/// clones (e.g. a room's members) to push to them later.
#[derive(Debug, Clone)]
pub struct BackendSession {
    inner: Arc<SessionInner>,
}

/// How long a push waits for credit from the edge.
const PUSH_CREDIT_WAIT: Duration = Duration::from_secs(5);

impl BackendSession {
    /// The session's id.
    pub fn session_id(&self) -> &SessionId {
        &self.inner.session_id
    }

    /// The player.
    pub fn player_id(&self) -> &str {
        &self.inner.player_id
    }

    /// The ownership fencing token (higher = newer owner).
    pub fn fencing(&self) -> u64 {
        self.inner.fencing
    }

    /// Whether `other` is this very opening of the session: the same edge link's SESSION_OPEN
    /// (a session resumed on another edge, or opened again after its link reconnected, is
    /// another opening with the same session id). A service that keeps sessions can tell
    /// with it whether a `session_closed` is about the opening it holds.
    pub fn same_opening(&self, other: &BackendSession) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The edge this session is connected through.
    pub fn edge_id(&self) -> &str {
        &self.inner.link.edge_id
    }

    /// This instance's id.
    pub fn instance_id(&self) -> &str {
        &self.inner.instance_id
    }

    /// An attribute of SESSION_OPEN.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.inner
            .attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Sends a message to the client, waiting (bounded) for PUSH credit.
    pub async fn push(
        &self,
        msg_id: u32,
        class: TrafficClass,
        payload: Bytes,
    ) -> Result<(), BackendError> {
        if msg_id >= RESERVED_MSG_IDS_START {
            return Err(BackendError::ReservedMsgId(msg_id));
        }
        self.inner
            .link
            .send_with_credit(self.push_frame(msg_id, class, payload))
            .await
    }

    /// Sends a message to `player` wherever its session is: through this session's edge,
    /// which delivers it to the player's session there or, with Redis, on the edge the
    /// player's presence names (PLAYER_PUSH, PROTOCOL.md §9.7). Waits (bounded) for PUSH
    /// credit and for the answer: [`PlayerPushOutcome::Delivered`] when it was queued on the
    /// player's session (with Redis, a critical or normal one once the session's stored
    /// copy holds it, so it survives the death of that edge), or why not (`Offline`,
    /// `QueueFull`, `Busy`, `Unreachable`; and `Unknown` when the player's edge did not
    /// answer in time or could not store it: it may have been delivered). [`BackendError::NoAnswer`] after 5 s without an answer (it may have been
    /// delivered too: retry with [`BackendSession::push_to_player_with_id`] and the same
    /// id). Two pushes to one player through one edge arrive in the order they were sent.
    pub async fn push_to_player(
        &self,
        player: &str,
        msg_id: u32,
        class: TrafficClass,
        payload: Bytes,
    ) -> Result<PlayerPushOutcome, BackendError> {
        self.push_to_player_with_id(next_request_id(), player, msg_id, class, payload)
            .await
    }

    /// [`BackendSession::push_to_player`] with the push's id (non-zero; e.g. from
    /// [`next_request_id`], kept to retry): an edge that delivered a push with this id within
    /// the last 120 s answers `delivered` again without delivering it twice (PROTOCOL.md
    /// §9.7), so a push answered `Unknown` or [`BackendError::NoAnswer`] can be retried.
    pub async fn push_to_player_with_id(
        &self,
        request_id: u64,
        player: &str,
        msg_id: u32,
        class: TrafficClass,
        payload: Bytes,
    ) -> Result<PlayerPushOutcome, BackendError> {
        if msg_id >= RESERVED_MSG_IDS_START {
            return Err(BackendError::ReservedMsgId(msg_id));
        }
        let frame = LinkFrame::PlayerPush {
            request_id,
            player: player.to_owned(),
            msg_id,
            class,
            payload,
        };
        match self.inner.link.request(request_id, frame, true).await? {
            LinkFrame::PlayerPushResult { outcome, .. } => Ok(outcome),
            _ => Err(BackendError::LinkClosed),
        }
    }

    /// A PUSH, or an ANSWER_PUSH while this session's handler runs on a link whose edge
    /// holds answers: a sequenced reply is then shown to the client with the
    /// acknowledgement of the message it answers, never before it (PROTOCOL.md §9.6).
    fn push_frame(&self, msg_id: u32, class: TrafficClass, payload: Bytes) -> LinkFrame {
        let answering = self.inner.answering.load(Ordering::Acquire);
        let handle = self.inner.handle;
        if answering != 0 && self.inner.link.held_answers && class != TrafficClass::BestEffort {
            LinkFrame::AnswerPush {
                handle,
                client_seq: answering,
                msg_id,
                class,
                payload,
            }
        } else {
            LinkFrame::Push {
                handle,
                msg_id,
                class,
                payload,
            }
        }
    }

    /// Answers the client's `request` (PROTOCOL.md §13) with `status` ([`STATUS_OK`] or
    /// your own error code) and `body`: a critical DATA the client SDK hands to the caller
    /// waiting on that request. Get requests with [`Incoming::request`].
    ///
    /// [`STATUS_OK`]: waygate_protocol::request::STATUS_OK
    pub async fn answer(
        &self,
        request: &Request,
        status: u16,
        body: &[u8],
    ) -> Result<(), BackendError> {
        self.inner
            .link
            .send_with_credit(self.push_frame(
                waygate_protocol::request::ANSWER_MSG_ID,
                TrafficClass::Critical,
                waygate_protocol::request::encode_answer(request.id, status, body),
            ))
            .await
    }

    /// Routes this session's messages for `service` by `key` from now on (e.g. a room).
    pub async fn bind(&self, service: &str, key: &str) -> Result<(), BackendError> {
        self.send(LinkFrame::Bind {
            handle: self.inner.handle,
            service: service.into(),
            key: key.into(),
        })
        .await
    }

    /// Pins `key` to this instance (a room created here) on this session's edge (PIN,
    /// PROTOCOL.md §9.5): the edge routes the key here from now on, until [`unpin`] or until
    /// the instance leaves its route table. Waits for the edge's answer: `Ok` once the pin
    /// is in force there, [`BackendError::PinRefused`] with why not (`unknown_instance`: the
    /// edge's table has no such instance for that kind of key; `full`: the edge holds
    /// 100,000 pins of that kind; `no_table`), [`BackendError::NoAnswer`] after 5 s.
    ///
    /// Against an edge that predates the answer ([`edge_confirms_pins`] false) the PIN is
    /// only sent: `Ok` then means queued on the link, unconfirmed — the edge may have
    /// refused it (it logs and counts that).
    ///
    /// [`unpin`]: BackendSession::unpin
    /// [`edge_confirms_pins`]: BackendSession::edge_confirms_pins
    pub async fn pin(&self, kind: PinKind, key: &str) -> Result<(), BackendError> {
        self.pin_to(kind, key, &self.inner.instance_id).await
    }

    /// [`pin`](BackendSession::pin) to `instance_id`, an instance of this process in another
    /// service (an instance id names one service: a process serving a lobby and the rooms it
    /// creates has one id for each). The same answer and the same caveat.
    pub async fn pin_to(
        &self,
        kind: PinKind,
        key: &str,
        instance_id: &str,
    ) -> Result<(), BackendError> {
        let link = &self.inner.link;
        if !link.pin_results {
            return self
                .send(LinkFrame::Pin {
                    kind,
                    key: key.into(),
                    instance_id: instance_id.into(),
                    request_id: 0,
                })
                .await;
        }
        let request_id = next_request_id();
        let frame = LinkFrame::Pin {
            kind,
            key: key.into(),
            instance_id: instance_id.into(),
            request_id,
        };
        match link.request(request_id, frame, false).await? {
            LinkFrame::PinResult {
                outcome: PinOutcome::Pinned,
                ..
            } => Ok(()),
            LinkFrame::PinResult { outcome, .. } => Err(BackendError::PinRefused(outcome)),
            _ => Err(BackendError::LinkClosed),
        }
    }

    /// Forgets the pin of `key` on this session's edge (UNPIN, PROTOCOL.md §9.5; the room
    /// ended): `true` when the edge had one, `false` when not (never pinned there, removed
    /// already, or dropped when its instance left the route table). Sessions the pin placed
    /// stay where they are; the key's next placement goes by the route table. Waits for the
    /// answer like [`pin`](BackendSession::pin);
    /// [`BackendError::NotSupportedByEdge`] from an edge that predates UNPIN (nothing sent;
    /// its pins last as long as it runs).
    pub async fn unpin(&self, kind: PinKind, key: &str) -> Result<bool, BackendError> {
        let link = &self.inner.link;
        if !link.pin_results {
            return Err(BackendError::NotSupportedByEdge("UNPIN"));
        }
        let request_id = next_request_id();
        let frame = LinkFrame::Unpin {
            request_id,
            kind,
            key: key.into(),
        };
        match link.request(request_id, frame, false).await? {
            LinkFrame::PinResult {
                outcome: PinOutcome::Unpinned,
                ..
            } => Ok(true),
            LinkFrame::PinResult {
                outcome: PinOutcome::NotPinned,
                ..
            } => Ok(false),
            LinkFrame::PinResult { outcome, .. } => Err(BackendError::PinRefused(outcome)),
            _ => Err(BackendError::LinkClosed),
        }
    }

    /// Whether this session's edge answers pins (link feature PIN_RESULT, PROTOCOL.md
    /// §9.5): [`pin`](BackendSession::pin) is then confirmed and
    /// [`unpin`](BackendSession::unpin) available.
    pub fn edge_confirms_pins(&self) -> bool {
        self.inner.link.pin_results
    }

    /// Ends the session; the client gets CLOSE with `code`.
    pub async fn kick(&self, code: CloseCode, message: &str) -> Result<(), BackendError> {
        self.send(LinkFrame::Kick {
            handle: self.inner.handle,
            code,
            message: message.into(),
        })
        .await
    }

    /// Makes this session a member of `channel` on its edge (PROTOCOL.md §12). With
    /// `since` (the last position the client reported for it), what it missed after it is
    /// delivered first, or a HISTORY_LOST event when that is no longer possible. Returns the
    /// position live publications follow.
    pub async fn join_channel(
        &self,
        channel: &str,
        since: Option<ChannelPosition>,
    ) -> Result<ChannelPosition, BackendError> {
        let request_id = next_request_id();
        let frame = LinkFrame::ChannelJoin {
            request_id,
            handle: self.inner.handle,
            channel: channel.into(),
            since,
        };
        self.inner
            .link
            .channel_request(request_id, frame, false)
            .await
            .map(|r| r.position)
    }

    /// Ends this session's membership of `channel` (it still gets what was published
    /// before, then a LEFT event).
    pub async fn leave_channel(&self, channel: &str) -> Result<ChannelPosition, BackendError> {
        let request_id = next_request_id();
        let frame = LinkFrame::ChannelLeave {
            request_id,
            handle: self.inner.handle,
            channel: channel.into(),
        };
        self.inner
            .link
            .channel_request(request_id, frame, false)
            .await
            .map(|r| r.position)
    }

    /// The request id for publication `part` (0, 1, ... for several in one channel) made
    /// while handling this session's message `client_seq`: the same for every copy of the
    /// message, in every backend process. A client resends a message its edge had not
    /// acknowledged when it died, and the resend is handled again (PROTOCOL.md §9.6);
    /// publishing with this id, the edges that took the first copy's publication answer
    /// `duplicate` and publish nothing twice (§12.5). `client_seq` 0 (a best-effort
    /// message, never resent) gets a fresh id.
    pub fn publish_id_for(&self, client_seq: u64, part: u32) -> u64 {
        if client_seq == 0 {
            return next_request_id();
        }
        message_publish_id(&self.inner.session_id, client_seq, part)
    }

    /// Publishes to `channel` through this session's edge, to its members there; waits for
    /// PUSH credit, then for the edge's answer. Critical publications are announcements,
    /// normal ones reliable (both kept for recovery), best-effort ones never recovered.
    pub async fn publish(
        &self,
        channel: &str,
        class: TrafficClass,
        payload: Bytes,
    ) -> Result<PublishAnswer, BackendError> {
        self.publish_with_id(next_request_id(), channel, class, payload)
            .await
    }

    /// Publishes to `channel` on every edge linked to this backend process that has the
    /// channel, each edge delivering to its own members (channels are per edge, PROTOCOL.md
    /// §12.6), with one result per edge. An edge that told this backend it has no such
    /// channel (no members, no history) is sent nothing: its result is `skipped`. An edge
    /// whose first members join is answered only once this backend knows it has the
    /// channel, so a publish made after a join was answered reaches the member. The same request id goes to every edge: retrying the whole call
    /// with [`publish_on_every_edge_with_id`](Self::publish_on_every_edge_with_id) after a
    /// partial failure publishes nothing twice (edges that took it answer `duplicate`).
    pub async fn publish_on_every_edge(
        &self,
        channel: &str,
        class: TrafficClass,
        payload: Bytes,
    ) -> Vec<EdgePublish> {
        self.publish_on_every_edge_with_id(next_request_id(), channel, class, payload)
            .await
    }

    /// [`publish_on_every_edge`](Self::publish_on_every_edge) with a chosen request id.
    pub async fn publish_on_every_edge_with_id(
        &self,
        request_id: u64,
        channel: &str,
        class: TrafficClass,
        payload: Bytes,
    ) -> Vec<EdgePublish> {
        let mut tasks = tokio::task::JoinSet::new();
        let mut out = Vec::new();
        for link in self.inner.link.all.live() {
            if link.channels.as_ref().is_some_and(|c| !c.has(channel)) {
                out.push(EdgePublish {
                    edge_id: link.edge_id.clone(),
                    result: Ok(PublishAnswer {
                        position: ChannelPosition::default(),
                        duplicate: false,
                        skipped: true,
                    }),
                });
                continue;
            }
            let frame = LinkFrame::ChannelPublish {
                request_id,
                channel: channel.into(),
                class,
                payload: payload.clone(),
            };
            tasks.spawn(async move {
                let result = link.channel_request(request_id, frame, true).await;
                EdgePublish {
                    edge_id: link.edge_id.clone(),
                    result,
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            if let Ok(answer) = done {
                out.push(answer);
            }
        }
        out.sort_by(|a, b| a.edge_id.cmp(&b.edge_id));
        out
    }

    /// [`publish`](Self::publish) with a chosen request id: a retry after
    /// [`BackendError::NoAnswer`] or a lost link with the same id is answered with the
    /// first publish's position (`duplicate`), never published twice.
    pub async fn publish_with_id(
        &self,
        request_id: u64,
        channel: &str,
        class: TrafficClass,
        payload: Bytes,
    ) -> Result<PublishAnswer, BackendError> {
        let frame = LinkFrame::ChannelPublish {
            request_id,
            channel: channel.into(),
            class,
            payload,
        };
        self.inner
            .link
            .channel_request(request_id, frame, true)
            .await
    }

    async fn send(&self, frame: LinkFrame) -> Result<(), BackendError> {
        self.inner.link.check_fits(&frame)?;
        self.inner
            .link
            .tx
            .send(frame)
            .await
            .map_err(|_| BackendError::LinkClosed)
    }
}

/// The load of a running instance, as its links see it: what it reports to the control
/// plane (`waygate backend --etcd`) for the least-loaded policy (SPEC R10).
#[derive(Debug, Default)]
pub struct BackendLoad {
    sessions: AtomicU64,
    messages: AtomicU64,
}

impl BackendLoad {
    /// Sessions open on this instance, over every edge's link.
    pub fn sessions(&self) -> u64 {
        self.sessions.load(Ordering::Relaxed)
    }

    /// Messages handled so far (each FORWARD once, refused or not).
    pub fn messages(&self) -> u64 {
        self.messages.load(Ordering::Relaxed)
    }
}

/// A running backend instance.
#[derive(Debug)]
pub struct Backend {
    local: SocketAddr,
    epoch: Arc<AtomicU64>,
    load: Arc<BackendLoad>,
    task: tokio::task::JoinHandle<()>,
}

impl Backend {
    /// Binds `addr` and serves links with `service`.
    pub async fn bind(
        addr: SocketAddr,
        config: BackendConfig,
        service: Arc<dyn Service>,
    ) -> Result<Self, BackendError> {
        config.check_exposure(addr)?;
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let epoch = Arc::new(AtomicU64::new(0));
        let load = Arc::new(BackendLoad::default());
        let task = tokio::spawn(serve(
            listener,
            config,
            service,
            epoch.clone(),
            load.clone(),
        ));
        Ok(Self {
            local,
            epoch,
            load,
            task,
        })
    }

    /// This instance's load (sessions open, messages handled).
    pub fn load(&self) -> &BackendLoad {
        &self.load
    }

    /// A load sampler for a control-plane registration (`waygate-routing-etcd`'s
    /// `EtcdRegistry::register_backend_instance`): the sessions open on this instance and its
    /// growing message total, `None` once the backend is dropped (the reports then stop).
    pub fn load_sampler(self: &Arc<Self>) -> impl FnMut() -> Option<(usize, u64)> + Send + 'static {
        let weak = Arc::downgrade(self);
        move || {
            let backend = weak.upgrade()?;
            let load = backend.load();
            Some((
                usize::try_from(load.sessions()).unwrap_or(usize::MAX),
                load.messages(),
            ))
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Sets the route epoch this instance knows: FORWARDs with an older epoch are refused
    /// with `stale_epoch` (R5).
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Links a backend process serves at once (one per edge: a fleet of 100 edges needs 100);
/// a connection beyond is closed at once (logged).
const MAX_LINKS: usize = 1_024;

/// Accepts links on `listener` forever, counting the instance's load into `load`. At most
/// [`MAX_LINKS`] at once.
pub async fn serve(
    listener: TcpListener,
    config: BackendConfig,
    service: Arc<dyn Service>,
    epoch: Arc<AtomicU64>,
    load: Arc<BackendLoad>,
) {
    if let Err(e) = listener
        .local_addr()
        .and_then(|addr| config.check_exposure(addr))
    {
        tracing::error!(error = %e, "backend not serving");
        return;
    }
    let instance: Arc<str> = config.instance_id.as_str().into();
    let all_links = Arc::new(EdgeLinks::default());
    // Dropping (aborting) `serve` aborts every link it runs.
    let mut links = tokio::task::JoinSet::new();
    loop {
        while links.try_join_next().is_some() {}
        let (stream, peer) = match listener.accept().await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "backend accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        if links.len() >= MAX_LINKS {
            // Edges are few (one link each); a flood of connections is not an edge.
            tracing::warn!(%peer, "link refused: {MAX_LINKS} links open");
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        let service = service.clone();
        let config = config.clone();
        let instance = instance.clone();
        let epoch = epoch.clone();
        let load = load.clone();
        let all = all_links.clone();
        links.spawn(async move {
            let ended = match config.tls.clone() {
                None => run_link(stream, &config, instance, service, epoch, load, all).await,
                Some(tls) => {
                    // The edge must present a certificate of the configured CA before any
                    // link frame is read.
                    let accepted = tokio::time::timeout(
                        Duration::from_secs(10),
                        tokio_rustls::TlsAcceptor::from(tls).accept(stream),
                    )
                    .await;
                    match accepted {
                        Ok(Ok(tls)) => {
                            run_link(tls, &config, instance, service, epoch, load, all).await
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(%peer, error = %e, "link TLS refused");
                            Err("link TLS handshake failed")
                        }
                        Err(_) => Err("link TLS handshake timed out"),
                    }
                }
            };
            if let Err(reason) = ended {
                tracing::info!(%peer, reason, "backend link ended");
            }
        });
    }
}

async fn run_link<S>(
    stream: S,
    config: &BackendConfig,
    instance: Arc<str>,
    service: Arc<dyn Service>,
    epoch: Arc<AtomicU64>,
    load: Arc<BackendLoad>,
    all: Arc<EdgeLinks>,
) -> Result<(), &'static str>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    // PUSH credit from the edge is applied by the link's reader itself, so a message handler
    // waiting for push credit never blocks the credit it waits for; and the reader's queue
    // holds every FORWARD the edge may have in flight (its credit), so it never stops reading.
    let push_credit = Arc::new(Semaphore::new(0));
    let credit_sink = push_credit.clone();
    let answers: ChannelAnswers = Arc::default();
    // The channels the edge has (PROTOCOL.md §12.6): its notices are taken on the reader
    // too, in the order they came, so the first CREDIT finds every one before it.
    let edge_channels = Arc::new(EdgeChannels::default());
    let synced = edge_channels.clone();
    let mut io = spawn_link_io(
        stream,
        config.max_link_frame,
        config.heartbeat,
        waygate_link::LinkIoOptions {
            read_queue: config.forward_credits as usize + 1024,
            on_credit: Some(Arc::new(move |n| {
                synced.synced.store(true, Ordering::Release);
                grant_credit(&credit_sink, n)
            })),
            on_frame: Some(answer_hook(answers.clone(), edge_channels.clone())),
        },
    );
    let hello = tokio::time::timeout(Duration::from_secs(10), io.rx.recv())
        .await
        .map_err(|_| "no LINK_HELLO in time")?
        .ok_or("link closed before LINK_HELLO")?;
    let (edge_id, edge_nonce, edge_features) = match hello {
        LinkFrame::Hello {
            version,
            edge_id,
            nonce,
            features,
            ..
        } if version == LINK_VERSION => (edge_id, nonce, features),
        LinkFrame::Hello { .. } => {
            let _ = io
                .tx
                .send(LinkFrame::Close {
                    code: CloseCode::UnsupportedVersion,
                    message: format!("link version {LINK_VERSION} only"),
                })
                .await;
            return Err("unsupported link version");
        }
        _ => return Err("first frame is not LINK_HELLO"),
    };
    // The link secret (PROTOCOL.md §9.3): this backend proves it holds it, then the edge
    // must, before anything else is taken from it.
    let challenge = match (&config.link_secret, edge_nonce) {
        (None, _) => None,
        (Some(secret), Some(edge_nonce)) => {
            let mut nonce = [0u8; waygate_protocol::link::LINK_NONCE_LEN];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut nonce)
                .map_err(|_| "no randomness for the link nonce")?;
            let proof =
                waygate_protocol::link_auth::backend_proof(secret, &edge_nonce, &nonce, &instance);
            Some((secret.clone(), edge_nonce, nonce, proof))
        }
        (Some(_), None) => {
            let _ = io
                .tx
                .send(LinkFrame::Close {
                    code: CloseCode::AuthRejected,
                    message: "this backend needs the link secret (LINK_HELLO without a nonce)"
                        .into(),
                })
                .await;
            return Err("edge without the link handshake refused");
        }
    };
    // FORWARD_DONE after every message processed, when the edge can use it (PROTOCOL.md
    // §9.6): the edge then acknowledges a client's message only once its handler returned,
    // so what the handler pushed is on the edge before the client stops keeping it.
    // And the handler's pushes as ANSWER_PUSH frames the edge holds until that answer, so
    // the client is shown a reply and the acknowledgement of its message together.
    use waygate_protocol::link::{LINK_FEATURE_FORWARD_DONE, LINK_FEATURE_HELD_ANSWERS};
    let mut features = edge_features & LINK_FEATURE_FORWARD_DONE;
    if features != 0 {
        features |= edge_features & LINK_FEATURE_HELD_ANSWERS;
    }
    let answers_done = features != 0;
    let held_answers = features & LINK_FEATURE_HELD_ANSWERS != 0;
    // Which channels the edge has, so a publish on every edge skips the edges without it.
    let channels = edge_features & waygate_protocol::link::LINK_FEATURE_CHANNEL_INTEREST != 0;
    features |= edge_features & waygate_protocol::link::LINK_FEATURE_CHANNEL_INTEREST;
    // Pins confirmed by PIN_RESULT, and UNPIN, when the edge has them (§9.5).
    let pin_results = edge_features & waygate_protocol::link::LINK_FEATURE_PIN_RESULT != 0;
    features |= edge_features & waygate_protocol::link::LINK_FEATURE_PIN_RESULT;
    io.tx
        .send(LinkFrame::Welcome {
            version: LINK_VERSION,
            instance_id: instance.to_string(),
            credits: config.forward_credits,
            heartbeat_ms: config.heartbeat.as_millis() as u32,
            auth: challenge.as_ref().map(|(_, _, nonce, proof)| {
                waygate_protocol::link::LinkWelcomeAuth {
                    nonce: *nonce,
                    proof: *proof,
                }
            }),
            features,
        })
        .await
        .map_err(|_| "link closed")?;
    if let Some((secret, edge_nonce, nonce, _)) = challenge {
        let first = tokio::time::timeout(Duration::from_secs(10), io.rx.recv())
            .await
            .map_err(|_| "no LINK_AUTH in time")?
            .ok_or("link closed before LINK_AUTH")?;
        let refusal = match first {
            LinkFrame::Auth { proof }
                if waygate_protocol::link_auth::verify_edge(
                    &secret,
                    &edge_nonce,
                    &nonce,
                    &edge_id,
                    &proof,
                ) =>
            {
                None
            }
            LinkFrame::Auth { .. } => Some((CloseCode::AuthBadSignature, "wrong link proof")),
            _ => Some((CloseCode::AuthRejected, "LINK_AUTH expected")),
        };
        if let Some((code, message)) = refusal {
            tracing::warn!(%edge_id, %code, "edge link refused: {message}");
            let _ = io
                .tx
                .send(LinkFrame::Close {
                    code,
                    message: message.into(),
                })
                .await;
            return Err("edge failed the link handshake");
        }
    }
    tracing::info!(%edge_id, instance = %instance, "backend link up");
    let link = Arc::new(LinkSender {
        all: all.clone(),
        tx: io.tx.clone(),
        push_credit,
        edge_id,
        answers,
        held_answers,
        channels: channels.then(|| edge_channels.clone()),
        pin_results,
        max_frame: config.max_link_frame,
    });
    all.add(&link);
    let work = Arc::new(LinkWork {
        service,
        tx: io.tx.clone(),
        epoch,
        load: load.clone(),
        answers_done,
        credit: Mutex::new(CreditReturn::default()),
        return_every: (config.forward_credits / 4).max(1),
        handler_timeout: config.handler_timeout,
    });
    // One worker per session: a session's messages and lifecycle events are handled one at
    // a time, in order; different sessions' handlers run concurrently, so one that waits
    // (a publish, a database) holds up no other session on this link.
    let session_queue = config.session_queue.max(1);
    let mut sessions: HashMap<u64, SessionWorker> = HashMap::new();
    let result = loop {
        let Some(frame) = io.rx.recv().await else {
            break Ok(());
        };
        match frame {
            LinkFrame::SessionOpen {
                handle,
                session_id,
                player_id,
                fencing,
                attrs,
            } => {
                let session = BackendSession {
                    inner: Arc::new(SessionInner {
                        answering: AtomicU64::new(0),
                        handle,
                        session_id,
                        player_id,
                        fencing,
                        attrs,
                        instance_id: instance.clone(),
                        link: link.clone(),
                    }),
                };
                // Opened again (the edge re-opens its sessions after a reconnect): the
                // same worker opens the new one and closes the old, after its messages.
                let session = match sessions.get_mut(&handle) {
                    Some(worker) => match worker.jobs.send(SessionJob::Reopened(session)) {
                        Ok(()) => {
                            worker.folding = None;
                            continue;
                        }
                        Err(e) => match e.0 {
                            SessionJob::Reopened(s) => s,
                            _ => continue,
                        },
                    },
                    None => {
                        load.sessions.fetch_add(1, Ordering::Relaxed);
                        session
                    }
                };
                let (jobs, rx) = mpsc::unbounded_channel();
                let queued = Arc::new(AtomicU32::new(0));
                let away_jobs = Arc::new(AtomicU32::new(0));
                tokio::spawn(session_worker(
                    work.clone(),
                    session,
                    rx,
                    queued.clone(),
                    away_jobs.clone(),
                ));
                sessions.insert(
                    handle,
                    SessionWorker {
                        jobs,
                        queued,
                        away_jobs,
                        folding: None,
                    },
                );
            }
            LinkFrame::Forward {
                handle,
                msg_id,
                epoch: msg_epoch,
                client_seq,
                class,
                payload,
            } => {
                let id = work.arrive();
                let job = SessionJob::Forward {
                    id,
                    incoming: Incoming {
                        msg_id,
                        client_seq,
                        class,
                        epoch: msg_epoch,
                        payload,
                    },
                };
                // At most `session_queue` per session (and the link's FORWARD credit in
                // all); beyond, `busy` at once.
                let refused = match sessions.get_mut(&handle) {
                    Some(w) if w.queued.load(Ordering::Acquire) >= session_queue => {
                        Some((CloseCode::Busy, SESSION_BUSY_RETRY_MS))
                    }
                    Some(w) => {
                        // A detach or reattach after this is not folded into one before.
                        w.folding = None;
                        w.queued.fetch_add(1, Ordering::AcqRel);
                        w.jobs.send(job).err().map(|_| {
                            w.queued.fetch_sub(1, Ordering::AcqRel);
                            (CloseCode::Unavailable, 0)
                        })
                    }
                    None => Some((CloseCode::Unavailable, 0)),
                };
                if let Some((code, retry_after_ms)) = refused {
                    let refusal = LinkFrame::Refuse {
                        handle,
                        msg_id,
                        client_seq,
                        code,
                        retry_after_ms,
                        epoch: work.epoch.load(Ordering::Relaxed),
                    };
                    // Fails only when the link is gone: the edge then answers every FORWARD
                    // it holds unanswered with ERROR `unavailable` (PROTOCOL.md §9.3).
                    let _ = io.tx.send(refusal).await;
                    work.completed(id).await;
                }
            }
            LinkFrame::SessionDetached { handle, linger_ms } => {
                if let Some(worker) = sessions.get_mut(&handle) {
                    let linger = Duration::from_millis(linger_ms.into());
                    worker.tell_away(Some(linger), false);
                }
            }
            LinkFrame::SessionReattached { handle, gap } => {
                if let Some(worker) = sessions.get_mut(&handle) {
                    worker.tell_away(None, gap);
                }
            }
            LinkFrame::SessionClose { handle, code } => {
                if let Some(mut worker) = sessions.remove(&handle) {
                    load.sessions.fetch_sub(1, Ordering::Relaxed);
                    worker.tell(SessionJob::Closed(code));
                }
            }
            LinkFrame::Credit { credits } => grant_credit(&link.push_credit, credits),
            _ => {
                let _ = io
                    .tx
                    .send(LinkFrame::Close {
                        code: CloseCode::UnexpectedFrame,
                        message: "frame not allowed from an edge".into(),
                    })
                    .await;
                break Err("unexpected frame from edge");
            }
        }
    };
    link.push_credit.close();
    all.remove(&link);
    if let Ok(mut answers) = link.answers.lock() {
        // Their requesters learn the link is gone (LinkClosed).
        answers.clear();
    }
    load.sessions
        .fetch_sub(sessions.len() as u64, Ordering::Relaxed);
    for (_, mut worker) in sessions.drain() {
        worker.tell(SessionJob::Closed(CloseCode::GoingAway));
    }
    result
}

/// SESSION_DETACHED / SESSION_REATTACHED frames queued one by one for a session's worker;
/// beyond, while its handler is busy, they are folded into one [`SessionJob::AwayChanges`]
/// per stretch of them (a client bouncing on and off while the handler waits).
const AWAY_JOBS_QUEUED: u32 = 64;

/// A session's worker, as the link's reader sees it.
struct SessionWorker {
    /// Unbounded, but what is queued is bounded: FORWARDs by `session_queue` (and the
    /// link's credit), SESSION_DETACHED / SESSION_REATTACHED by [`AWAY_JOBS_QUEUED`] plus
    /// one folded job per stretch of them between FORWARDs, the rest by the session's
    /// lifecycle (one close; a re-open per reconnect of the edge's link).
    jobs: mpsc::UnboundedSender<SessionJob>,
    /// FORWARDs queued or running.
    queued: Arc<AtomicU32>,
    /// Detach and reattach jobs queued one by one, not yet taken.
    away_jobs: Arc<AtomicU32>,
    /// The folded job queued last, while nothing was queued after it.
    folding: Option<Arc<Mutex<Option<AwayChanges>>>>,
}

/// Detaches and reattaches folded together: the first and the last change, whether any
/// reattach had a gap, and the last linger. The service hears the first, then the last
/// when it differs: the state it ends in, and the gap, are kept.
#[derive(Debug, Clone, Copy)]
struct AwayChanges {
    first_detached: bool,
    last_detached: bool,
    gap: bool,
    linger: Duration,
}

impl AwayChanges {
    fn new(detached: Option<Duration>, gap: bool) -> Self {
        Self {
            first_detached: detached.is_some(),
            last_detached: detached.is_some(),
            gap,
            linger: detached.unwrap_or_default(),
        }
    }

    fn and_then(&mut self, detached: Option<Duration>, gap: bool) {
        self.last_detached = detached.is_some();
        self.gap |= gap;
        if let Some(linger) = detached {
            self.linger = linger;
        }
    }
}

impl SessionWorker {
    /// Hands a lifecycle frame to the worker. These ask for no answer; the worker takes
    /// jobs until its session's `Closed` (service panics are caught: [`guarded`]), so a
    /// send fails only when the runtime is shutting down: logged, nothing waits for it.
    fn tell(&mut self, job: SessionJob) {
        self.folding = None;
        self.send(job);
    }

    fn send(&self, job: SessionJob) {
        if self.jobs.send(job).is_err() {
            tracing::debug!("session worker gone: lifecycle frame not delivered");
        }
    }

    /// A SESSION_DETACHED (`detached`: its linger) or SESSION_REATTACHED (`gap`): queued
    /// as it is while fewer than [`AWAY_JOBS_QUEUED`] wait, else folded into the last
    /// folded job when nothing was queued after it (and the worker has not taken it), else
    /// into a new one.
    fn tell_away(&mut self, detached: Option<Duration>, gap: bool) {
        if self.away_jobs.load(Ordering::Acquire) < AWAY_JOBS_QUEUED {
            self.away_jobs.fetch_add(1, Ordering::AcqRel);
            let job = match detached {
                Some(linger) => SessionJob::Detached(linger),
                None => SessionJob::Reattached(gap),
            };
            self.tell(job);
            return;
        }
        if let Some(folding) = &self.folding {
            let mut changes = folding.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(changes) = changes.as_mut() {
                changes.and_then(detached, gap);
                return;
            }
        }
        let folding = Arc::new(Mutex::new(Some(AwayChanges::new(detached, gap))));
        self.send(SessionJob::AwayChanges(folding.clone()));
        self.folding = Some(folding);
    }
}

/// What a session's worker does next, in the order the link delivered it.
enum SessionJob {
    /// A FORWARD (`id`: its place in the link's credit order).
    Forward {
        id: u64,
        incoming: Incoming,
    },
    Detached(Duration),
    Reattached(bool),
    /// Detaches and reattaches folded together while the handler was busy (the worker
    /// takes them out: `None` afterwards).
    AwayChanges(Arc<Mutex<Option<AwayChanges>>>),
    /// SESSION_OPEN again for the same handle: open this one, close the old one.
    Reopened(BackendSession),
    Closed(CloseCode),
}

/// What a link's session workers share.
struct LinkWork {
    service: Arc<dyn Service>,
    tx: mpsc::Sender<LinkFrame>,
    epoch: Arc<AtomicU64>,
    load: Arc<BackendLoad>,
    /// The edge asked for FORWARD_DONE (PROTOCOL.md §9.6).
    answers_done: bool,
    credit: Mutex<CreditReturn>,
    /// FORWARD credit is returned in batches of this many.
    return_every: u32,
    /// [`BackendConfig::handler_timeout`].
    handler_timeout: Option<Duration>,
}

impl LinkWork {
    fn arrive(&self) -> u64 {
        self.credit.lock().map_or(0, |mut c| c.arrive())
    }

    /// Forward `id` is answered: return the credit now due, after that answer.
    async fn completed(&self, id: u64) {
        let due = self.credit.lock().ok().and_then(|mut c| {
            c.complete(id);
            c.take(self.return_every)
        });
        if let Some(credits) = due {
            // Fails only when the link is gone (its credit starts anew with the next one).
            let _ = self.tx.send(LinkFrame::Credit { credits }).await;
        }
    }
}

/// Runs one call into the game's [`Service`]; a panic in it is caught and logged (`None`),
/// and so is a call that runs past `deadline` (cancelled), so a session's worker lives
/// until its session closes: its messages are always answered and their credit returned
/// (a dead or stuck worker would hold the link's credit).
async fn guarded<T>(
    handle: u64,
    deadline: Option<Duration>,
    call: &'static str,
    fut: impl Future<Output = T>,
) -> Option<T> {
    use futures_util::FutureExt as _;
    let caught = std::panic::AssertUnwindSafe(fut).catch_unwind();
    let caught = match deadline {
        Some(d) => match tokio::time::timeout(d, caught).await {
            Ok(c) => c,
            Err(_) => {
                tracing::error!(handle, call, deadline = ?d, "the game's handler ran past its deadline: cancelled");
                return None;
            }
        },
        None => caught.await,
    };
    if caught.is_err() {
        tracing::error!(handle, call, "the game's handler panicked");
    }
    caught.ok()
}

/// Handles one session's jobs in order until it closes.
async fn session_worker(
    work: Arc<LinkWork>,
    mut session: BackendSession,
    mut jobs: mpsc::UnboundedReceiver<SessionJob>,
    queued: Arc<AtomicU32>,
    away_jobs: Arc<AtomicU32>,
) {
    let handle = session.inner.handle;
    guarded(
        handle,
        work.handler_timeout,
        "session_open",
        work.service.session_open(&session),
    )
    .await;
    while let Some(job) = jobs.recv().await {
        match job {
            SessionJob::Forward { id, incoming } => {
                let (msg_id, client_seq) = (incoming.msg_id, incoming.client_seq);
                let refusal = if incoming.epoch < work.epoch.load(Ordering::Relaxed) {
                    Some(Refusal {
                        code: CloseCode::StaleEpoch,
                        retry_after_ms: 0,
                    })
                } else {
                    // Its pushes until the answer are part of it (ANSWER_PUSH).
                    if work.answers_done {
                        session.inner.answering.store(client_seq, Ordering::Release);
                    }
                    let result = guarded(
                        handle,
                        work.handler_timeout,
                        "message",
                        work.service.message(&session, incoming),
                    )
                    .await;
                    // `answering` stays set until the answer is queued (below): a push
                    // another task makes meanwhile still goes as ANSWER_PUSH, so it cannot
                    // be shown before the handler's held pushes (after the answer the edge
                    // takes an ANSWER_PUSH as a PUSH, in order).
                    // A handler that panicked or ran past its deadline refuses its message
                    // `internal`: the client is answered, the credit returns and the
                    // session's worker goes on.
                    result
                        .unwrap_or(Err(Refusal {
                            code: CloseCode::Internal,
                            retry_after_ms: 0,
                        }))
                        .err()
                };
                // The answer goes on the same queue as the handler's pushes, after them.
                let answer = match refusal {
                    Some(r) => Some(LinkFrame::Refuse {
                        handle,
                        msg_id,
                        client_seq,
                        code: r.code,
                        retry_after_ms: r.retry_after_ms,
                        epoch: work.epoch.load(Ordering::Relaxed),
                    }),
                    // Best-effort messages (client seq 0) are never acknowledged.
                    None if work.answers_done && client_seq != 0 => {
                        Some(LinkFrame::ForwardDone { handle, client_seq })
                    }
                    None => None,
                };
                work.load.messages.fetch_add(1, Ordering::Relaxed);
                if let Some(answer) = answer {
                    // Fails only when the link is gone: the edge then answers every FORWARD
                    // it holds unanswered with ERROR `unavailable` (PROTOCOL.md §9.3).
                    let _ = work.tx.send(answer).await;
                }
                session.inner.answering.store(0, Ordering::Release);
                queued.fetch_sub(1, Ordering::AcqRel);
                work.completed(id).await;
            }
            SessionJob::Detached(linger) => {
                away_jobs.fetch_sub(1, Ordering::AcqRel);
                let call = work.service.session_detached(&session, linger);
                guarded(handle, work.handler_timeout, "session_detached", call).await;
            }
            SessionJob::Reattached(gap) => {
                away_jobs.fetch_sub(1, Ordering::AcqRel);
                let call = work.service.session_reattached(&session, gap);
                guarded(handle, work.handler_timeout, "session_reattached", call).await;
            }
            SessionJob::AwayChanges(folded) => {
                let changes = folded.lock().unwrap_or_else(|e| e.into_inner()).take();
                let Some(c) = changes else { continue };
                let mut calls = vec![c.first_detached];
                if c.last_detached != c.first_detached {
                    calls.push(c.last_detached);
                }
                for detached in calls {
                    if detached {
                        let call = work.service.session_detached(&session, c.linger);
                        guarded(handle, work.handler_timeout, "session_detached", call).await;
                    } else {
                        let call = work.service.session_reattached(&session, c.gap);
                        guarded(handle, work.handler_timeout, "session_reattached", call).await;
                    }
                }
            }
            SessionJob::Reopened(new) => {
                guarded(
                    handle,
                    work.handler_timeout,
                    "session_open",
                    work.service.session_open(&new),
                )
                .await;
                let old = std::mem::replace(&mut session, new);
                let call = work.service.session_closed(&old, CloseCode::Normal);
                guarded(handle, work.handler_timeout, "session_closed", call).await;
            }
            SessionJob::Closed(code) => {
                let call = work.service.session_closed(&session, code);
                guarded(handle, work.handler_timeout, "session_closed", call).await;
                return;
            }
        }
    }
}

/// FORWARD credit going back to the edge (PROTOCOL.md §9.4). Sessions' forwards complete
/// out of order, but a CREDIT frees the edge's *oldest* forwards (it keeps them, in order,
/// to refuse them if the link dies), so credit is returned only for the answered forwards
/// at the head of the arrival order: never for a forward still being handled.
#[derive(Debug, Default)]
struct CreditReturn {
    /// Id of the oldest forward whose credit is not returnable yet.
    base: u64,
    /// Whether each forward from `base` on, in arrival order, is answered.
    answered: std::collections::VecDeque<bool>,
    /// Answered forwards at the head, not returned yet.
    returnable: u32,
}

impl CreditReturn {
    /// A forward arrived: its id.
    fn arrive(&mut self) -> u64 {
        let id = self.base + self.answered.len() as u64;
        self.answered.push_back(false);
        id
    }

    /// Forward `id` was answered.
    fn complete(&mut self, id: u64) {
        let slot = id
            .checked_sub(self.base)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.answered.get_mut(i));
        if let Some(slot) = slot {
            *slot = true;
        }
        while self.answered.front() == Some(&true) {
            self.answered.pop_front();
            self.base += 1;
            self.returnable += 1;
        }
    }

    /// The credit to return now, once at least `batch` is due.
    fn take(&mut self, batch: u32) -> Option<u32> {
        (self.returnable >= batch).then(|| std::mem::take(&mut self.returnable))
    }
}

/// Adds `credits` an edge granted to `semaphore`, up to what a semaphore can hold: an edge
/// that grants without bound (billions of credits) must not panic the link's reader
/// (`Semaphore::add_permits` panics past `MAX_PERMITS`), which would drop every session on
/// the link.
fn grant_credit(semaphore: &tokio::sync::Semaphore, credits: u32) {
    let room = tokio::sync::Semaphore::MAX_PERMITS.saturating_sub(semaphore.available_permits());
    semaphore.add_permits((credits as usize).min(room));
}

#[cfg(test)]
mod tests {
    use super::{grant_credit, message_publish_id, CreditReturn, EdgeChannels, MAX_EDGE_CHANNELS};
    use proptest::prelude::*;

    /// Panic audit: an edge granting credit without bound panicked the link's reader once
    /// the semaphore's total passed `MAX_PERMITS` (every session on the link dropped). The
    /// grant now stops at what a semaphore holds.
    #[test]
    fn credit_granted_without_bound_stops_at_what_a_semaphore_holds() {
        let credit = tokio::sync::Semaphore::new(tokio::sync::Semaphore::MAX_PERMITS - 10);
        grant_credit(&credit, u32::MAX);
        grant_credit(&credit, u32::MAX);
        assert_eq!(
            credit.available_permits(),
            tokio::sync::Semaphore::MAX_PERMITS
        );
    }

    /// Regression (bounds audit): the channels an edge link told were kept without a bound
    /// (notices are taken on the reader, before the handshake completes too). Past
    /// [`MAX_EDGE_CHANNELS`] nothing more is kept and no publish is skipped for that link.
    #[test]
    fn the_channels_an_edge_tells_are_bounded() {
        let c = EdgeChannels::default();
        c.synced.store(true, std::sync::atomic::Ordering::Release);
        c.take(true, "world".into());
        assert!(c.has("world") && !c.has("guild:1"));
        for n in 0..MAX_EDGE_CHANNELS {
            c.take(true, format!("room:{n}"));
        }
        assert!(c.present.lock().unwrap().len() <= MAX_EDGE_CHANNELS);
        assert!(c.has("guild:1"), "an overflowed set skips nothing");
    }

    /// A message's publish id is the same for every copy of it (a resend after its edge
    /// died; the reference answer is fixed so it stays the same across processes and
    /// releases), and differs between messages, parts and sessions.
    #[test]
    fn a_message_publish_id_is_its_identity() {
        let s = [7u8; 16];
        assert_eq!(message_publish_id(&s, 12, 0), message_publish_id(&s, 12, 0));
        // Python: int.from_bytes(hashlib.sha256(bytes([7] * 16) + (12).to_bytes(8, "little")
        //   + (0).to_bytes(4, "little")).digest()[:8], "little")
        assert_eq!(message_publish_id(&s, 12, 0), 0xb728_44fb_d6c6_7a03);
        let mut ids = std::collections::HashSet::new();
        for session in [[7u8; 16], [8u8; 16]] {
            for seq in 1..200 {
                for part in 0..3 {
                    assert!(ids.insert(message_publish_id(&session, seq, part)));
                }
            }
        }
        assert!(!ids.contains(&0));
    }

    proptest! {
        /// Whatever order forwards are answered in, the credit returned never covers a
        /// forward not answered yet, covers exactly the answered prefix of the arrival
        /// order, and in total every forward once all are answered.
        #[test]
        fn credit_covers_only_the_answered_head(
            order in Just((0..64u64).collect::<Vec<_>>()).prop_shuffle(),
            batch in 1u32..20,
        ) {
            let mut c = CreditReturn::default();
            for expected in 0..64u64 {
                prop_assert_eq!(c.arrive(), expected);
            }
            let mut answered = [false; 64];
            let mut returned = 0u64;
            for id in order {
                c.complete(id);
                answered[id as usize] = true;
                if let Some(n) = c.take(batch) {
                    prop_assert!(n >= batch);
                    returned += u64::from(n);
                }
                let head = answered.iter().take_while(|a| **a).count() as u64;
                prop_assert!(returned <= head, "returned {} with {} answered at the head", returned, head);
                prop_assert_eq!(returned + u64::from(c.returnable), head);
            }
            returned += u64::from(c.take(1).unwrap_or(0));
            prop_assert_eq!(returned, 64);
        }
    }

    #[test]
    fn an_unknown_or_repeated_completion_changes_nothing() {
        let mut c = CreditReturn::default();
        let a = c.arrive();
        let b = c.arrive();
        c.complete(b);
        c.complete(b);
        c.complete(99);
        assert_eq!(c.take(1), None);
        c.complete(a);
        assert_eq!(c.take(1), Some(2));
        c.complete(a);
        assert_eq!(c.take(1), None);
    }
}

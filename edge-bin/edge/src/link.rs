//! The edge's side of a backend link: one [`LinkClient`] per backend address, which
//! connects, says LINK_HELLO, keeps FORWARD credit, re-opens its sessions after a reconnect
//! (exponential backoff with full jitter), and reports what the backend sends as
//! [`LinkEvent`]s. `forward` never waits: without a link or credit it fails at once with
//! `Unavailable` or `Busy`, so the caller can answer the client (B4).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rand::RngExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use waygate_protocol::frame::SessionId;
use waygate_protocol::link::{
    LinkFrame, DEFAULT_MAX_LINK_FRAME, LINK_FEATURE_CHANNEL_INTEREST, LINK_FEATURE_FORWARD_DONE,
    LINK_FEATURE_HELD_ANSWERS, LINK_FEATURE_PIN_RESULT, LINK_VERSION,
};
use waygate_session::driver::{Delivered, Downstream};
use waygate_transport::{CloseCode, TrafficClass};

use waygate_link::spawn_link_io;

/// The longest [`LinkClient::session_event`] waits for room in a link's write queue: a
/// backend that has not read its link that long has its connection reset (PROTOCOL.md
/// §9.3).
pub const LIFECYCLE_SEND_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Settings of the edge's links.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// This edge's id (LINK_HELLO).
    pub edge_id: String,
    /// PUSH frames a backend may have in flight to this edge.
    pub push_credits: u32,
    /// Heartbeat interval.
    pub heartbeat: Duration,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Reconnect backoff: first delay and cap.
    pub backoff_min: Duration,
    /// Reconnect backoff cap.
    pub backoff_max: Duration,
    /// Retry-after hint given to clients when a backend has no credit.
    pub busy_retry_after_ms: u32,
    /// The link secret (PROTOCOL.md §9.3): with it, the backend must prove it holds it and
    /// this edge proves it too; without it, a backend asking for a proof is not linked.
    pub secret: Option<Arc<[u8]>>,
    /// Mutual TLS (PROTOCOL.md §9.3): the client config (with this edge's certificate) and
    /// the name to verify backends as (`None`: the backend's IP address).
    pub tls: Option<(Arc<rustls::ClientConfig>, Option<String>)>,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            edge_id: "edge".into(),
            push_credits: 1024,
            heartbeat: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(3),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            secret: None,
            tls: None,
            busy_retry_after_ms: 200,
        }
    }
}

/// What the edge needs to open a session on a link.
#[derive(Debug, Clone)]
pub struct SessionMeta {
    /// Edge-wide session handle (also the link handle).
    pub handle: u64,
    /// The session's id.
    pub session_id: SessionId,
    /// The player.
    pub player_id: String,
    /// Ownership fencing token.
    pub fencing: u64,
    /// Attributes for the backend.
    pub attrs: Arc<[(String, String)]>,
}

/// Something a backend sent, or a change of the link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkEvent {
    /// A frame the backend sent for the edge to carry out, as it arrived: PUSH (a message
    /// for a session), KICK (end a session), BIND (route a session's service by a key),
    /// PIN (pin a key to an instance) or UNPIN (forget a pin). Credits and refusals are
    /// handled by the link itself.
    Backend(LinkFrame),
    /// A forwarded message was refused by the backend, or lost with its link (then `code`
    /// is `Unavailable`). The message comes back so it can be routed again (stale epoch)
    /// or reported to the client, never dropped silently.
    Refuse {
        /// What was refused and why.
        refusal: LinkRefusal,
        /// The message, when the edge still held it (always, unless the backend refused a
        /// message that was not in flight).
        message: Option<InFlight>,
    },
    /// The pushes a backend's handler sent as part of its answer to one client message
    /// (ANSWER_PUSH, PROTOCOL.md §9.6), released with that answer: the edge queues them and
    /// `end` for the session together, so the client is shown the replies and the
    /// acknowledgement of the message they answer in one turn (one durable write), never
    /// the replies alone. Only when the handler sent any; an answer without pushes is a
    /// plain FORWARD_DONE or [`LinkEvent::Refuse`].
    Answer {
        /// The session.
        handle: u64,
        /// The held pushes, in the order the backend sent them.
        pushes: Vec<Downstream>,
        /// What follows them.
        end: AnswerEnd,
    },
    /// The link to `addr` is up (instance id from LINK_WELCOME).
    Up {
        /// Backend address.
        addr: SocketAddr,
        /// Its instance id.
        instance_id: String,
    },
    /// The link to `addr` went down.
    Down {
        /// Backend address.
        addr: SocketAddr,
    },
}

/// What ends a [`LinkEvent::Answer`]'s pushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerEnd {
    /// FORWARD_DONE: the message with this client seq is answered.
    Done(u64),
    /// The message was refused (REFUSE), or lost with its link (`unavailable`).
    Refused(LinkRefusal),
    /// Nothing yet: the held pushes reached [`HELD_ANSWER_MAX_BYTES`] and go on their own.
    Released,
}

/// Bytes of ANSWER_PUSH payloads the edge holds for one forwarded message; past them the
/// held pushes are released without waiting for the answer (PROTOCOL.md §9.6). Each held
/// push counts [`HELD_PUSH_OVERHEAD`] bytes besides its payload, so empty ones are bounded
/// too (at most 512: fewer than the default 1,024 PUSH credits, whose return for held
/// pushes waits for their release).
pub const HELD_ANSWER_MAX_BYTES: usize = 64 * 1024;

/// What one held ANSWER_PUSH counts against [`HELD_ANSWER_MAX_BYTES`] besides its payload:
/// somewhat more than what the edge keeps for it.
pub const HELD_PUSH_OVERHEAD: usize = 128;

/// A REFUSE as the edge handles it: the frame's fields, or a message lost with its link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkRefusal {
    /// The session.
    pub handle: u64,
    /// Refused message id.
    pub msg_id: u32,
    /// Its client seq.
    pub client_seq: u64,
    /// Why.
    pub code: CloseCode,
    /// Retry hint.
    pub retry_after_ms: u32,
    /// The backend's epoch (0 when the link was lost).
    pub epoch: u64,
}

/// Where a link's events go when they can be carried out at once: on the link's own reader
/// task, in the order the backend sent them, never waiting (a push into a session's queue, a
/// kick, a key, a pin). One channel hop fewer for every push.
pub trait LinkEventSink: Send + Sync + std::fmt::Debug + 'static {
    /// Carries `event` out without waiting; returns the frame to answer the backend with
    /// (a channel request's CHANNEL_RESULT). An answer that must wait (an announcement
    /// until the announcement log has it) is sent later on the link's writer, which
    /// `later` gives (`None`: the link is down). Never given a stale-epoch refusal (that
    /// one may need the table refreshed first: it goes to the async loop).
    fn handle(&self, event: LinkEvent, later: &LinkWriter<'_>) -> Option<LinkFrame>;
}

/// Where a link learns which channels the edge has, for a backend that publishes a channel
/// only to the edges that have it (PROTOCOL.md §12.6, link feature bit 2). The link sends
/// the notices on its own task, so they keep their order; everything due at `link_up` goes
/// out before the link's first CREDIT.
pub trait ChannelInterestSink: Send + Sync + std::fmt::Debug + 'static {
    /// Registers a link whose backend takes notices; `wake` is notified when notices are
    /// due on it. Returns the link's name for the calls below.
    fn link_up(&self, wake: Arc<tokio::sync::Notify>) -> u64;
    /// Up to `max` notices due on `link` (CHANNEL_INTEREST frames), in order.
    fn due(&self, link: u64, max: usize) -> Vec<LinkFrame>;
    /// The backend took every notice up to `seq` (CHANNEL_INTEREST_ACK).
    fn acked(&self, link: u64, seq: u64);
    /// The link is gone.
    fn link_down(&self, link: u64);
    /// Whether the backend on `link` has kept a new channel waiting past the deadline (it
    /// takes frames but does not acknowledge notices): the link is then closed.
    fn overdue(&self, link: u64) -> bool;
}

/// Notices sent per turn of a link's task.
const INTEREST_BATCH: usize = 256;

/// Gives the link's writer, for an answer sent after the event was handled.
pub type LinkWriter<'a> = dyn Fn() -> Option<mpsc::Sender<LinkFrame>> + Send + Sync + 'a;

/// The ways out of a link: the non-blocking sink for what can be done at once, the bounded
/// channel to the edge's async loop for the rest (and for everything without a sink).
#[derive(Debug, Clone)]
pub struct LinkEvents {
    /// Takes events on the link's task (`None`: everything goes down `slow`).
    pub fast: Option<Arc<dyn LinkEventSink>>,
    /// The async loop's channel.
    pub slow: mpsc::Sender<LinkEvent>,
    /// Which channels the edge has, for backends that ask (`None`: never offered).
    pub interest: Option<Arc<dyn ChannelInterestSink>>,
}

impl From<mpsc::Sender<LinkEvent>> for LinkEvents {
    /// Every event through the channel (no fast path).
    fn from(slow: mpsc::Sender<LinkEvent>) -> Self {
        Self {
            fast: None,
            slow,
            interest: None,
        }
    }
}

/// Whether an event needs the async loop: a stale-epoch refusal (the table may have to be
/// refreshed before the held message is routed again).
fn needs_async(event: &LinkEvent) -> bool {
    matches!(
        event,
        LinkEvent::Refuse {
            refusal: LinkRefusal {
                code: CloseCode::StaleEpoch,
                ..
            },
            ..
        }
    )
}

/// What became of a link event.
enum Sent {
    /// Carried out or queued; answer the backend with this frame, if any.
    Done(Option<LinkFrame>),
    /// The edge is gone.
    EdgeGone,
}

impl LinkEvents {
    /// Delivers `event`. Without a fast sink, a channel request (and a PIN or UNPIN that
    /// asks for an answer) is answered `unavailable` here: the async loop has no way back
    /// to the link.
    async fn send(&self, event: LinkEvent, later: &LinkWriter<'_>) -> Sent {
        match &self.fast {
            Some(fast) if !needs_async(&event) => return Sent::Done(fast.handle(event, later)),
            None => {
                if let Some(answer) = channel_unavailable(&event) {
                    return Sent::Done(Some(answer));
                }
            }
            Some(_) => {}
        }
        match self.slow.send(event).await {
            Ok(()) => Sent::Done(None),
            Err(_) => Sent::EdgeGone,
        }
    }
}

/// The CHANNEL_RESULT `unavailable` for a channel request nobody on this edge can carry out
/// (PLAYER_PUSH_RESULT `unreachable` for a push to a player; PIN_RESULT `unavailable` for a
/// PIN or UNPIN that asks for an answer: without a fast sink nothing here can give one).
fn channel_unavailable(event: &LinkEvent) -> Option<LinkFrame> {
    if let LinkEvent::Backend(
        LinkFrame::Pin { request_id, .. } | LinkFrame::Unpin { request_id, .. },
    ) = event
    {
        return (*request_id != 0).then_some(LinkFrame::PinResult {
            request_id: *request_id,
            outcome: waygate_protocol::link::PinOutcome::Unavailable,
        });
    }
    if let LinkEvent::Backend(LinkFrame::PlayerPush { request_id, .. }) = event {
        return Some(LinkFrame::PlayerPushResult {
            request_id: *request_id,
            outcome: waygate_protocol::link::PlayerPushOutcome::Unreachable,
        });
    }
    let request_id = match event {
        LinkEvent::Backend(
            LinkFrame::ChannelJoin { request_id, .. }
            | LinkFrame::ChannelLeave { request_id, .. }
            | LinkFrame::ChannelPublish { request_id, .. },
        ) => *request_id,
        _ => return None,
    };
    Some(LinkFrame::ChannelResult {
        request_id,
        code: CloseCode::Unavailable,
        retry_after_ms: 0,
        position: Default::default(),
        duplicate: false,
    })
}

/// A forwarded message the backend has not finished handling yet. At most the link's
/// FORWARD credit of them are held per link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlight {
    /// The session.
    pub handle: u64,
    /// Message id.
    pub msg_id: u32,
    /// Client seq.
    pub client_seq: u64,
    /// Class.
    pub class: TrafficClass,
    /// Body.
    pub payload: Bytes,
    /// The route epoch its FORWARD carried: a `stale_epoch` REFUSE whose epoch is not newer
    /// is no reason to route it again (PROTOCOL.md §9.5).
    pub epoch: u64,
}

/// A forward in the link's in-flight queue.
#[derive(Debug)]
struct Held {
    message: InFlight,
    /// Its FORWARD_DONE arrived (it stays queued until CREDIT covers it, which keeps the
    /// count right, but is not refused when the link dies: it was processed).
    answered: bool,
    /// ANSWER_PUSH frames for it, held until its answer.
    answer: Vec<Downstream>,
    /// Their payload bytes plus [`HELD_PUSH_OVERHEAD`] each (at most [`HELD_ANSWER_MAX_BYTES`]).
    answer_bytes: usize,
}

/// Why a forward was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// No link to the backend right now.
    #[error("backend unavailable")]
    Unavailable,
    /// The backend has no credit left (it is slow): retry after the hint.
    #[error("backend busy")]
    Busy {
        /// Retry hint for the client.
        retry_after_ms: u32,
    },
}

#[derive(Debug)]
struct LinkShared {
    addr: SocketAddr,
    config: LinkConfig,
    tx: Mutex<Option<mpsc::Sender<LinkFrame>>>,
    credit: AtomicU64,
    /// Forwards sent and not yet covered by returned credit, oldest first.
    inflight: Mutex<VecDeque<Held>>,
    up: AtomicBool,
    /// The backend answers every FORWARD with FORWARD_DONE or REFUSE (LINK_WELCOME's
    /// features, PROTOCOL.md §9.6).
    answers: AtomicBool,
    /// Sessions opened on this link (re-opened after a reconnect): the edge's own entry,
    /// shared, not a copy per link.
    open: Mutex<HashMap<u64, Arc<SessionMeta>>>,
    /// Sessions of `open` whose client is away (SESSION_DETACHED sent), with the end of
    /// their linger: told again after a reconnect's SESSION_OPEN.
    away: Mutex<HashMap<u64, tokio::time::Instant>>,
    epoch: Arc<AtomicU64>,
    events: LinkEvents,
    /// PUSH frames received since PUSH credit was last returned.
    pushes: std::sync::atomic::AtomicU32,
    /// This connection's name at the interest sink, while its backend takes notices.
    interest_link: Mutex<Option<u64>>,
    /// Set by [`LinkClient::retire`]: the task ends (LINK_CLOSE `going_away` on a live
    /// connection) instead of reconnecting.
    retired: AtomicBool,
    retire: tokio::sync::Notify,
    /// Wakes the live connection to end it (a lifecycle frame could not be queued: the
    /// backend would otherwise go on believing what the frame was to change). One per
    /// connection, so a wake-up meant for a connection never ends the next one.
    reset: Mutex<Option<Arc<tokio::sync::Notify>>>,
}

impl LinkShared {
    /// Whether a forward of `client_seq` waits for its answer (FORWARD_DONE, REFUSE) on
    /// this link: a sequenced message on a link whose backend answers (§9.6). Only such a
    /// forward holds ANSWER_PUSH frames and acknowledges its message once answered;
    /// best-effort messages (client seq 0) are never acknowledged.
    fn awaits_answer(&self, client_seq: u64) -> bool {
        client_seq != 0 && self.answers.load(Ordering::Acquire)
    }
}

/// The edge's link to one backend address.
#[derive(Debug, Clone)]
pub struct LinkClient {
    shared: Arc<LinkShared>,
}

impl LinkClient {
    /// Starts connecting to `addr` in the background. Events go to `events`; `epoch` is the
    /// edge's current route epoch (sent in LINK_HELLO).
    pub fn spawn(
        addr: SocketAddr,
        config: LinkConfig,
        epoch: Arc<AtomicU64>,
        events: impl Into<LinkEvents>,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let events = events.into();
        let shared = Arc::new(LinkShared {
            addr,
            config,
            tx: Mutex::new(None),
            credit: AtomicU64::new(0),
            inflight: Mutex::new(VecDeque::new()),
            up: AtomicBool::new(false),
            answers: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
            away: Mutex::new(HashMap::new()),
            epoch,
            events,
            pushes: std::sync::atomic::AtomicU32::new(0),
            interest_link: Mutex::new(None),
            retired: AtomicBool::new(false),
            retire: tokio::sync::Notify::new(),
            reset: Mutex::new(None),
        });
        let task = tokio::spawn(run(shared.clone()));
        (Self { shared }, task)
    }

    /// Ends the link for good: a live connection is closed (LINK_CLOSE `going_away`, what
    /// was in flight reported like any link loss) and no reconnection follows. For a
    /// backend that left the route table and that nothing uses any more.
    pub fn retire(&self) {
        self.shared.retired.store(true, Ordering::Release);
        self.shared.retire.notify_one();
    }

    /// The backend address.
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Whether the link is up.
    pub fn is_up(&self) -> bool {
        self.shared.up.load(Ordering::Acquire)
    }

    /// Whether a forward of `client_seq` on this link is answered (FORWARD_DONE or REFUSE)
    /// once its backend is done with it: a sequenced message, on a live connection whose
    /// backend answers (PROTOCOL.md §9.6).
    pub fn awaits_answer(&self, client_seq: u64) -> bool {
        self.shared.awaits_answer(client_seq)
    }

    /// FORWARD credit left.
    pub fn credit(&self) -> u64 {
        self.shared.credit.load(Ordering::Relaxed)
    }

    fn sender(&self) -> Option<mpsc::Sender<LinkFrame>> {
        self.shared.tx.lock().ok().and_then(|g| g.clone())
    }

    fn take_credit(&self) -> bool {
        self.shared
            .credit
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| c.checked_sub(1))
            .is_ok()
    }

    /// Sends SESSION_OPEN unless the session is already open on this link. The session
    /// counts as open only once its SESSION_OPEN is queued (under the same lock): a full
    /// write queue answers `Busy` and the next forward sends it again. (Before, it counted
    /// as open at once, and after a full queue every later FORWARD of the session went to a
    /// backend that never heard of it, refused `unavailable` until the link reconnected.)
    pub fn ensure_open(&self, meta: &Arc<SessionMeta>) -> Result<(), ForwardError> {
        let mut open = self
            .shared
            .open
            .lock()
            .map_err(|_| ForwardError::Unavailable)?;
        // Only a new session is inserted: nothing is copied per forwarded message.
        if open.contains_key(&meta.handle) {
            return Ok(());
        }
        let tx = self.sender().ok_or(ForwardError::Unavailable)?;
        tx.try_send(open_frame(meta))
            .map_err(|_| ForwardError::Busy {
                retry_after_ms: self.shared.config.busy_retry_after_ms,
            })?;
        open.insert(meta.handle, meta.clone());
        Ok(())
    }

    /// Forwards one upstream message. Never waits. Says whether the backend will answer it
    /// (FORWARD_DONE or REFUSE, as a [`LinkEvent`]) or nothing will.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        meta: &Arc<SessionMeta>,
        msg_id: u32,
        epoch: u64,
        client_seq: u64,
        class: TrafficClass,
        payload: Bytes,
    ) -> Result<Delivered, ForwardError> {
        if !self.is_up() {
            return Err(ForwardError::Unavailable);
        }
        let busy = ForwardError::Busy {
            retry_after_ms: self.shared.config.busy_retry_after_ms,
        };
        if !self.take_credit() {
            return Err(busy);
        }
        let result = self.ensure_open(meta).and_then(|()| {
            // The in-flight queue and the link's write queue must see forwards in the same
            // order: hold the queue's lock across the (non-blocking) send. The sender is
            // read under it too: the link going down clears the sender and drains the queue
            // under this lock, so a forward is either refused here or drained (answered
            // `unavailable`), never queued after the drain on a dead link's sender.
            let mut inflight = self
                .shared
                .inflight
                .lock()
                .map_err(|_| ForwardError::Unavailable)?;
            let tx = self.sender().ok_or(ForwardError::Unavailable)?;
            tx.try_send(LinkFrame::Forward {
                handle: meta.handle,
                msg_id,
                epoch,
                client_seq,
                class,
                payload: payload.clone(),
            })
            .map_err(|_| busy)?;
            inflight.push_back(Held {
                message: InFlight {
                    handle: meta.handle,
                    msg_id,
                    client_seq,
                    class,
                    payload,
                    epoch,
                },
                answered: false,
                answer: Vec::new(),
                answer_bytes: 0,
            });
            // Best-effort messages (client seq 0) are never acknowledged.
            Ok(if self.shared.awaits_answer(client_seq) {
                Delivered::AwaitingAnswer
            } else {
                Delivered::Answered
            })
        });
        if result.is_err() {
            self.shared.credit.fetch_add(1, Ordering::AcqRel);
        }
        result
    }

    /// Sends a session lifecycle frame (DETACHED, REATTACHED, CLOSE) if the session is open
    /// on this link; CLOSE also forgets it. Waits at most [`LIFECYCLE_SEND_WAIT`] for room
    /// in the link's write queue; then the connection is reset (the backend forgets every
    /// session of it, the edge re-opens those still open once it reconnects).
    pub async fn session_event(&self, frame: LinkFrame) {
        let handle = match &frame {
            LinkFrame::SessionClose { handle, .. }
            | LinkFrame::SessionDetached { handle, .. }
            | LinkFrame::SessionReattached { handle, .. } => *handle,
            _ => return,
        };
        let known = match self.shared.open.lock() {
            Ok(mut open) => {
                if matches!(frame, LinkFrame::SessionClose { .. }) {
                    open.remove(&handle).is_some()
                } else {
                    open.contains_key(&handle)
                }
            }
            Err(_) => false,
        };
        if let Ok(mut away) = self.shared.away.lock() {
            match &frame {
                LinkFrame::SessionDetached { linger_ms, .. } if known => {
                    let linger = Duration::from_millis(u64::from(*linger_ms));
                    away.insert(handle, tokio::time::Instant::now() + linger);
                }
                _ => {
                    away.remove(&handle);
                }
            }
        }
        if known {
            if let Some(tx) = self.sender() {
                // Bounded: the route loop and session ends call this, and a backend that
                // stopped reading its link must not stall them (its write queue full).
                if tokio::time::timeout(LIFECYCLE_SEND_WAIT, tx.send(frame))
                    .await
                    .is_err()
                {
                    // The backend would go on believing what the frame was to change (a
                    // session open that ended here): the connection is reset, and the
                    // backend forgets its sessions with it; the edge re-opens those still
                    // open after it reconnects (PROTOCOL.md §9.3).
                    tracing::warn!(
                        backend = %self.addr(),
                        handle,
                        "session lifecycle frame not taken: the backend has not read its link for {LIFECYCLE_SEND_WAIT:?}; link reset"
                    );
                    let reset = self.shared.reset.lock().ok().and_then(|r| r.clone());
                    if let Some(reset) = reset {
                        reset.notify_one();
                    }
                }
            }
        }
    }

    /// Closes the link (LINK_CLOSE) and stops reconnecting.
    pub async fn shutdown(&self) {
        if let Some(tx) = self.sender() {
            let _ = tx
                .send(LinkFrame::Close {
                    code: CloseCode::GoingAway,
                    message: "edge shutting down".into(),
                })
                .await;
        }
    }
}

/// A frame from the backend, as the edge sees it.
enum Incoming {
    /// Carried out already (CREDIT).
    Done,
    /// For the edge.
    Event(LinkEvent),
    /// Not allowed from a backend: the link closes.
    Unexpected(LinkFrame),
    /// Allowed, but breaks the link's rules here (nothing of it was applied): the link
    /// closes with `protocol_error`.
    Violation(LinkFrame, &'static str),
}

/// Applies a CREDIT, counts a PUSH, finds the held message of a REFUSE.
fn take_frame(shared: &LinkShared, frame: LinkFrame) -> Incoming {
    match frame {
        LinkFrame::Push { .. } => {
            shared.pushes.fetch_add(1, Ordering::AcqRel);
            Incoming::Event(LinkEvent::Backend(frame))
        }
        LinkFrame::AnswerPush {
            handle,
            client_seq,
            msg_id,
            class,
            payload,
        } => {
            shared.pushes.fetch_add(1, Ordering::AcqRel);
            let push = Downstream {
                class,
                msg_id,
                payload,
            };
            // Only a sequenced message on a link whose backend answers (FORWARD_DONE) ever
            // gets the answer that releases held pushes: anything else is a push at once
            // (held, it was dropped with the message's CREDIT, silently).
            if !shared.awaits_answer(client_seq) {
                return Incoming::Event(plain_push(handle, push));
            }
            let Ok(mut q) = shared.inflight.lock() else {
                return Incoming::Event(plain_push(handle, push));
            };
            let Some(h) = unanswered(&mut q, handle, client_seq) else {
                // Its answer came first (a push from another task of the backend that
                // raced the handler's end), or it answers nothing held here: a push.
                return Incoming::Event(plain_push(handle, push));
            };
            h.answer_bytes += push.payload.len() + HELD_PUSH_OVERHEAD;
            h.answer.push(push);
            if h.answer_bytes <= HELD_ANSWER_MAX_BYTES {
                return Incoming::Done;
            }
            h.answer_bytes = 0;
            Incoming::Event(LinkEvent::Answer {
                handle,
                pushes: std::mem::take(&mut h.answer),
                end: AnswerEnd::Released,
            })
        }
        LinkFrame::ForwardDone { handle, client_seq } => {
            // Only a forward this link holds unanswered can be answered here (the SDK sends
            // FORWARD_DONE before the CREDIT that covers it): a backend answering another
            // link's message, or one twice, would let the client forget a message whose
            // reply is not here.
            let held = shared.inflight.lock().ok().and_then(|mut q| {
                unanswered(&mut q, handle, client_seq).map(|h| {
                    h.answered = true;
                    std::mem::take(&mut h.answer)
                })
            });
            if let Some(pushes) = held {
                Incoming::Event(if pushes.is_empty() {
                    LinkEvent::Backend(frame)
                } else {
                    LinkEvent::Answer {
                        handle,
                        pushes,
                        end: AnswerEnd::Done(client_seq),
                    }
                })
            } else {
                tracing::debug!(
                    addr = %shared.addr,
                    handle,
                    client_seq,
                    "FORWARD_DONE for a message this link does not hold: ignored"
                );
                Incoming::Done
            }
        }
        LinkFrame::Credit { credits } => {
            if let Ok(mut q) = shared.inflight.lock() {
                let n = (credits as usize).min(q.len());
                // CREDIT before the answer it covers breaks §9.6's order: taking it would
                // drop the message's held pushes and leave it unacknowledged for good. The
                // link closes instead; its unanswered messages are refused `unavailable`,
                // after their held pushes, like on any link loss.
                let early = q
                    .iter()
                    .take(n)
                    .any(|h| !h.answered && shared.awaits_answer(h.message.client_seq));
                if early {
                    return Incoming::Violation(
                        frame,
                        "CREDIT covered a message before its answer",
                    );
                }
                q.drain(..n);
            }
            shared.credit.fetch_add(credits.into(), Ordering::AcqRel);
            Incoming::Done
        }
        LinkFrame::ChannelInterestAck { seq } => {
            let link = shared.interest_link.lock().ok().and_then(|l| *l);
            match (&shared.events.interest, link) {
                (Some(sink), Some(link)) => sink.acked(link, seq),
                _ => {
                    tracing::debug!(addr = %shared.addr, seq, "CHANNEL_INTEREST_ACK on a link without notices: ignored")
                }
            }
            Incoming::Done
        }
        LinkFrame::ChannelPublish { .. } | LinkFrame::PlayerPush { .. } => {
            // A publish or a push to a player uses one PUSH credit, returned as it is
            // taken (like a PUSH).
            shared.pushes.fetch_add(1, Ordering::AcqRel);
            Incoming::Event(LinkEvent::Backend(frame))
        }
        LinkFrame::Kick { .. }
        | LinkFrame::Bind { .. }
        | LinkFrame::Pin { .. }
        | LinkFrame::Unpin { .. }
        | LinkFrame::ChannelJoin { .. }
        | LinkFrame::ChannelLeave { .. } => Incoming::Event(LinkEvent::Backend(frame)),
        LinkFrame::Refuse {
            handle,
            msg_id,
            client_seq,
            code,
            retry_after_ms,
            epoch,
        } => {
            let (message, pushes) = shared
                .inflight
                .lock()
                .ok()
                .and_then(|mut q| {
                    q.iter_mut()
                        .find(|h| {
                            let m = &h.message;
                            !h.answered
                                && m.handle == handle
                                && m.client_seq == client_seq
                                && m.msg_id == msg_id
                        })
                        .map(|h| {
                            // Answered (refused): not refused again if the link dies.
                            h.answered = true;
                            (Some(h.message.clone()), std::mem::take(&mut h.answer))
                        })
                })
                .unwrap_or_default();
            let refusal = LinkRefusal {
                handle,
                msg_id,
                client_seq,
                code,
                retry_after_ms,
                epoch,
            };
            Incoming::Event(refusal_event(refusal, message, pushes))
        }
        other => Incoming::Unexpected(other),
    }
}

/// The unanswered forward of (`handle`, `client_seq`) in the link's in-flight queue.
fn unanswered(q: &mut VecDeque<Held>, handle: u64, client_seq: u64) -> Option<&mut Held> {
    q.iter_mut()
        .find(|h| !h.answered && h.message.handle == handle && h.message.client_seq == client_seq)
}

/// An ANSWER_PUSH the edge does not hold, carried out as a PUSH.
fn plain_push(handle: u64, push: Downstream) -> LinkEvent {
    LinkEvent::Backend(LinkFrame::Push {
        handle,
        msg_id: push.msg_id,
        class: push.class,
        payload: push.payload,
    })
}

/// A refusal, after the pushes held for the refused message if there are any.
fn refusal_event(
    refusal: LinkRefusal,
    message: Option<InFlight>,
    pushes: Vec<Downstream>,
) -> LinkEvent {
    if pushes.is_empty() {
        LinkEvent::Refuse { refusal, message }
    } else {
        LinkEvent::Answer {
            handle: refusal.handle,
            pushes,
            end: AnswerEnd::Refused(refusal),
        }
    }
}

/// PUSH credit to return now (every `return_every` pushes), if any.
fn push_credit_due(shared: &LinkShared, return_every: u32) -> Option<u32> {
    let n = shared.pushes.load(Ordering::Acquire);
    if n < return_every {
        return None;
    }
    let n = shared.pushes.swap(0, Ordering::AcqRel);
    (n > 0).then_some(n)
}

/// The reader's hook (with a fast sink): everything that needs no waiting is carried out on
/// the reader's task; a stale-epoch refusal, the handshake and anything unexpected are
/// queued for `connect_once`.
fn take_now(
    shared: &LinkShared,
    frame: LinkFrame,
    return_every: u32,
) -> waygate_link::FrameHandled {
    use waygate_link::FrameHandled;
    let Some(fast) = shared.events.fast.as_ref() else {
        return FrameHandled::Queue(frame);
    };
    if matches!(
        frame,
        LinkFrame::Refuse {
            code: CloseCode::StaleEpoch,
            ..
        }
    ) {
        // The table may have to be refreshed first: connect_once's async path.
        return FrameHandled::Queue(frame);
    }
    match take_frame(shared, frame) {
        Incoming::Done => FrameHandled::Taken,
        Incoming::Unexpected(other) | Incoming::Violation(other, _) => FrameHandled::Queue(other),
        Incoming::Event(event) => {
            let answer = fast.handle(event, &|| shared.tx.lock().ok().and_then(|g| g.clone()));
            let credit =
                push_credit_due(shared, return_every).map(|credits| LinkFrame::Credit { credits });
            match (answer, credit) {
                (None, None) => FrameHandled::Taken,
                (a, c) => FrameHandled::Reply(a.into_iter().chain(c).collect()),
            }
        }
    }
}

fn open_frame(meta: &SessionMeta) -> LinkFrame {
    LinkFrame::SessionOpen {
        handle: meta.handle,
        session_id: meta.session_id,
        player_id: meta.player_id.clone(),
        fencing: meta.fencing,
        attrs: meta.attrs.to_vec(),
    }
}

async fn run(shared: Arc<LinkShared>) {
    let mut failures = 0u32;
    // The events sent while the link is down carry no request to answer later.
    let link_down = || None;
    loop {
        if shared.retired.load(Ordering::Acquire) {
            tracing::info!(addr = %shared.addr, "backend link retired");
            return;
        }
        match connect_once(&shared).await {
            Ok(()) => failures = 0,
            Err(e) => {
                failures = failures.saturating_add(1);
                tracing::debug!(addr = %shared.addr, error = e, "backend link attempt failed");
            }
        }
        shared.up.store(false, Ordering::Release);
        shared.credit.store(0, Ordering::Release);
        let interest_link = shared.interest_link.lock().ok().and_then(|mut l| l.take());
        if let (Some(sink), Some(link)) = (&shared.events.interest, interest_link) {
            sink.link_down(link);
        }
        // Whatever the backend had not finished is reported, never dropped silently. The
        // sender goes under the in-flight queue's lock (see `forward`).
        let lost: Vec<Held> = shared
            .inflight
            .lock()
            .map(|mut q| {
                if let Ok(mut tx) = shared.tx.lock() {
                    *tx = None;
                }
                q.drain(..).filter(|h| !h.answered).collect()
            })
            .unwrap_or_default();
        for h in lost {
            let m = h.message;
            let refusal = LinkRefusal {
                handle: m.handle,
                msg_id: m.msg_id,
                client_seq: m.client_seq,
                code: CloseCode::Unavailable,
                retry_after_ms: 0,
                epoch: 0,
            };
            // The pushes its handler sent before the link died still reach the client,
            // before the refusal.
            let event = refusal_event(refusal, Some(m), h.answer);
            if let Sent::EdgeGone = shared.events.send(event, &link_down).await {
                return;
            }
        }
        if let Sent::EdgeGone = shared
            .events
            .send(LinkEvent::Down { addr: shared.addr }, &link_down)
            .await
        {
            return;
        }
        // Exponential backoff with full jitter.
        let cap = shared
            .config
            .backoff_min
            .saturating_mul(1u32 << failures.min(16))
            .min(shared.config.backoff_max);
        let delay = rand::rng().random_range(
            shared.config.backoff_min.as_millis() as u64..=cap.as_millis().max(1) as u64,
        );
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(delay)) => {}
            () = shared.retire.notified() => {}
        }
    }
}

/// Sends every channel interest notice due on `link`, in order.
async fn send_interest(
    sink: &dyn ChannelInterestSink,
    link: u64,
    tx: &mpsc::Sender<LinkFrame>,
) -> Result<(), &'static str> {
    loop {
        let due = sink.due(link, INTEREST_BATCH);
        if due.is_empty() {
            return Ok(());
        }
        for frame in due {
            send_bounded(tx, frame).await?;
        }
    }
}

/// Why [`send_bounded`] failed on a backend that stopped reading.
const NOT_READING: &str = "the backend has not read its link for 5 s: link reset";

/// Queues `frame` on the link's writer, waiting at most [`LIFECYCLE_SEND_WAIT`] for room: a
/// backend that stopped reading its link fails the link (it is reset) instead of holding
/// its task — and every new channel waiting for its acknowledgement — for ever.
async fn send_bounded(tx: &mpsc::Sender<LinkFrame>, frame: LinkFrame) -> Result<(), &'static str> {
    match tokio::time::timeout(LIFECYCLE_SEND_WAIT, tx.send(frame)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err("link closed"),
        Err(_) => Err(NOT_READING),
    }
}

/// Closes the link with LINK_CLOSE `code` (if its writer has room: the link ends either
/// way) and fails the connection with `message`.
async fn refuse(
    tx: &mpsc::Sender<LinkFrame>,
    code: CloseCode,
    message: &'static str,
) -> Result<(), &'static str> {
    let close = LinkFrame::Close {
        code,
        message: message.into(),
    };
    if tx.try_send(close).is_err() {
        // The backend learns it from the connection closing (the caller drops it).
        tracing::info!(
            message,
            "link closed without LINK_CLOSE: its writer is full or gone"
        );
    }
    Err(message)
}

/// The edge's half of the link secret handshake (PROTOCOL.md §9.3): checks the backend's
/// proof and sends LINK_AUTH, or refuses the link.
async fn link_handshake(
    tx: &mpsc::Sender<LinkFrame>,
    config: &LinkConfig,
    edge_nonce: &waygate_protocol::link::LinkNonce,
    instance_id: &str,
    auth: Option<waygate_protocol::link::LinkWelcomeAuth>,
) -> Result<(), &'static str> {
    use waygate_protocol::link_auth::{edge_proof, verify_backend};
    match (&config.secret, auth) {
        (None, None) => Ok(()),
        (None, Some(_)) => Err(
            "the backend asks for the link secret: set links.secret_file or WAYGATE_LINK_SECRET",
        ),
        (Some(_), None) => {
            refuse(
                tx,
                CloseCode::AuthRejected,
                "backend without the link secret refused (no proof in LINK_WELCOME)",
            )
            .await
        }
        (Some(secret), Some(a)) if !verify_backend(secret, edge_nonce, &a, instance_id) => {
            refuse(
                tx,
                CloseCode::AuthBadSignature,
                "backend's link proof is wrong",
            )
            .await
        }
        (Some(secret), Some(a)) => tx
            .send(LinkFrame::Auth {
                proof: edge_proof(secret, edge_nonce, &a.nonce, &config.edge_id),
            })
            .await
            .map_err(|_| "link closed"),
    }
}

async fn connect_once(shared: &Arc<LinkShared>) -> Result<(), &'static str> {
    let config = &shared.config;
    let stream = tokio::time::timeout(config.connect_timeout, TcpStream::connect(shared.addr))
        .await
        .map_err(|_| "connect timed out")?
        .map_err(|_| "connect failed")?;
    let _ = stream.set_nodelay(true);
    let options = |on_frame| waygate_link::LinkIoOptions {
        read_queue: config.push_credits as usize + 1024,
        on_credit: None,
        on_frame,
    };
    // The reader's queue holds every PUSH the backend may have in flight (our credit).
    // With a fast sink, the reader itself carries out what needs no waiting (`take_now`).
    let return_every = (config.push_credits / 4).max(1);
    let on_frame: Option<waygate_link::OnFrame> = shared.events.fast.as_ref().map(|_| {
        let shared = shared.clone();
        Arc::new(move |frame| take_now(&shared, frame, return_every)) as waygate_link::OnFrame
    });
    let mut io = match &config.tls {
        None => spawn_link_io(
            stream,
            DEFAULT_MAX_LINK_FRAME,
            config.heartbeat,
            options(on_frame),
        ),
        Some((tls, name)) => {
            let name = match name {
                Some(n) => rustls_pki_types::ServerName::try_from(n.clone())
                    .map_err(|_| "link tls_server_name is not a valid name")?,
                None => rustls_pki_types::ServerName::IpAddress(shared.addr.ip().into()),
            };
            let tls = tokio::time::timeout(
                config.connect_timeout,
                tokio_rustls::TlsConnector::from(tls.clone()).connect(name, stream),
            )
            .await
            .map_err(|_| "link TLS handshake timed out")?
            .map_err(|_| "link TLS handshake failed (certificate?)")?;
            spawn_link_io(
                tls,
                DEFAULT_MAX_LINK_FRAME,
                config.heartbeat,
                options(on_frame),
            )
        }
    };
    let edge_nonce: [u8; waygate_protocol::link::LINK_NONCE_LEN] = rand::random();
    io.tx
        .send(LinkFrame::Hello {
            version: LINK_VERSION,
            edge_id: config.edge_id.clone(),
            epoch: shared.epoch.load(Ordering::Relaxed),
            nonce: Some(edge_nonce),
            features: LINK_FEATURE_FORWARD_DONE
                | LINK_FEATURE_HELD_ANSWERS
                | LINK_FEATURE_PIN_RESULT
                | if shared.events.interest.is_some() {
                    LINK_FEATURE_CHANNEL_INTEREST
                } else {
                    0
                },
        })
        .await
        .map_err(|_| "link closed")?;
    let welcome = tokio::time::timeout(config.connect_timeout, io.rx.recv())
        .await
        .map_err(|_| "no LINK_WELCOME in time")?
        .ok_or("link closed before LINK_WELCOME")?;
    let (instance_id, credits, auth, features) = match welcome {
        LinkFrame::Welcome {
            version,
            instance_id,
            credits,
            auth,
            features,
            ..
        } if version == LINK_VERSION => (instance_id, credits, auth, features),
        _ => return Err("unexpected answer to LINK_HELLO"),
    };
    link_handshake(&io.tx, config, &edge_nonce, &instance_id, auth).await?;
    // Every channel the edge has, before the CREDIT that lets the backend publish.
    let interest = match &shared.events.interest {
        Some(sink) if features & LINK_FEATURE_CHANNEL_INTEREST != 0 => {
            let wake = Arc::new(tokio::sync::Notify::new());
            let link = sink.link_up(wake.clone());
            if let Ok(mut l) = shared.interest_link.lock() {
                *l = Some(link);
            }
            send_interest(sink.as_ref(), link, &io.tx).await?;
            Some((sink.clone(), link, wake))
        }
        _ => None,
    };
    io.tx
        .send(LinkFrame::Credit {
            credits: config.push_credits,
        })
        .await
        .map_err(|_| "link closed")?;
    // Re-open every session still bound here, before any new FORWARD.
    let reopen: Vec<Arc<SessionMeta>> = shared
        .open
        .lock()
        .map(|o| o.values().cloned().collect())
        .unwrap_or_default();
    for meta in &reopen {
        io.tx
            .send(open_frame(meta))
            .await
            .map_err(|_| "link closed")?;
    }
    // Those whose client is away are told so again, with what is left of their linger.
    let away: Vec<(u64, tokio::time::Instant)> = shared
        .away
        .lock()
        .map(|a| a.iter().map(|(h, until)| (*h, *until)).collect())
        .unwrap_or_default();
    let now = tokio::time::Instant::now();
    for (handle, until) in away {
        let left = until.saturating_duration_since(now).as_millis();
        let frame = LinkFrame::SessionDetached {
            handle,
            linger_ms: u32::try_from(left).unwrap_or(u32::MAX).max(1),
        };
        io.tx.send(frame).await.map_err(|_| "link closed")?;
    }
    if let Ok(mut tx) = shared.tx.lock() {
        *tx = Some(io.tx.clone());
    }
    let reset = Arc::new(tokio::sync::Notify::new());
    if let Ok(mut r) = shared.reset.lock() {
        *r = Some(reset.clone());
    }
    shared
        .answers
        .store(features & LINK_FEATURE_FORWARD_DONE != 0, Ordering::Release);
    shared.credit.store(credits.into(), Ordering::Release);
    shared.up.store(true, Ordering::Release);
    tracing::info!(addr = %shared.addr, %instance_id, "backend link up");
    let _ = shared
        .events
        .send(
            LinkEvent::Up {
                addr: shared.addr,
                instance_id,
            },
            &|| None,
        )
        .await;

    // Answers that wait (announcements until logged) go out on the writer later.
    let writer = io.tx.clone();
    loop {
        let frame = tokio::select! {
            frame = io.rx.recv() => match frame {
                Some(frame) => frame,
                None => break,
            },
            () = reset.notified() => {
                tracing::warn!(addr = %shared.addr, "backend link reset: it stopped reading");
                break;
            }
            () = shared.retire.notified() => {
                let _ = io
                    .tx
                    .send(LinkFrame::Close {
                        code: CloseCode::GoingAway,
                        message: "backend left the route table".into(),
                    })
                    .await;
                break;
            }
            () = async {
                match &interest {
                    Some((_, _, wake)) => wake.notified().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Some((sink, link, _)) = &interest {
                    if sink.overdue(*link) {
                        tracing::warn!(addr = %shared.addr, "backend does not acknowledge channel notices: link closed");
                        return refuse(
                            &io.tx,
                            CloseCode::ProtocolError,
                            "CHANNEL_INTEREST not acknowledged in time",
                        )
                        .await;
                    }
                    match send_interest(sink.as_ref(), *link, &io.tx).await {
                        Ok(()) => {}
                        Err(NOT_READING) => return Err(NOT_READING),
                        Err(_) => break,
                    }
                }
                continue;
            }
        };
        let event = match take_frame(shared, frame) {
            Incoming::Done => continue,
            Incoming::Event(event) => event,
            Incoming::Unexpected(other) => {
                tracing::warn!(addr = %shared.addr, frame = ?other, "unexpected frame from backend");
                return refuse(
                    &io.tx,
                    CloseCode::UnexpectedFrame,
                    "frame not allowed from a backend",
                )
                .await;
            }
            Incoming::Violation(frame, why) => {
                tracing::warn!(addr = %shared.addr, ?frame, why, "backend broke the link's rules: link closed");
                return refuse(&io.tx, CloseCode::ProtocolError, why).await;
            }
        };
        match shared.events.send(event, &|| Some(writer.clone())).await {
            Sent::EdgeGone => return Ok(()),
            Sent::Done(Some(answer)) => match send_bounded(&io.tx, answer).await {
                Ok(()) => {}
                Err(NOT_READING) => return Err(NOT_READING),
                Err(_) => break,
            },
            Sent::Done(None) => {}
        }
        if let Some(credits) = push_credit_due(shared, return_every) {
            match send_bounded(&io.tx, LinkFrame::Credit { credits }).await {
                Ok(()) => {}
                Err(NOT_READING) => return Err(NOT_READING),
                // The writer is gone: the link is down (the backend's credit starts anew
                // with the next LINK_WELCOME), so end it here and reconnect.
                Err(_) => break,
            }
        }
    }
    tracing::warn!(addr = %shared.addr, "backend link down");
    Ok(())
}

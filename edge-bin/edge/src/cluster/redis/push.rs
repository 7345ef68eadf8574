//! Cross-edge push (SPEC F4): a batch of [`PushMessage`]s goes to the edge holding each
//! player as one pub/sub request, and a correlated reply brings back one [`DeliveryResult`]
//! per message; [`RedisPresence::serve_pushes`] is the receiving side (a [`PushServer`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use redis::AsyncCommands as _;
use tokio::sync::{oneshot, watch};
use waygate_session::driver::Downstream;
use waygate_session::resume::hex_id;
use waygate_transport::TrafficClass;

use super::conn::subscribe_loop;
use super::{RedisError, RedisPresence};

/// A message pushed to a player on another edge.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PushMessage {
    /// Traffic class.
    pub class: TrafficClass,
    /// Application message id.
    pub msg_id: u32,
    /// Body (hex on the wire).
    #[serde(with = "hex_bytes")]
    pub payload: Bytes,
    /// The push's id (a backend's PLAYER_PUSH request id): the receiving edge delivers one
    /// id once within its window (PROTOCOL.md §9.7); 0 = none (absent from older edges).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub id: u64,
}

fn is_zero(id: &u64) -> bool {
    *id == 0
}

impl From<PushMessage> for Downstream {
    fn from(m: PushMessage) -> Self {
        Downstream {
            class: m.class,
            msg_id: m.msg_id,
            payload: m.payload,
        }
    }
}

mod hex_bytes {
    use bytes::Bytes;
    use serde::{Deserialize as _, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(b: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&waygate_session::resume::hex_id(b))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        if s.len() % 2 != 0 || !s.is_ascii() {
            return Err(serde::de::Error::custom("odd or non-ascii hex"));
        }
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map(Bytes::from)
            .map_err(serde::de::Error::custom)
    }
}

/// Per-message result of a cross-edge push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum DeliveryResult {
    /// Queued on the player's session.
    Delivered,
    /// The player has no session there (or no presence at all).
    Offline,
    /// The session's outbound queue is full.
    QueueFull,
    /// The target edge is not listening (no subscriber): not delivered.
    EdgeUnreachable,
    /// No answer within [`RedisConfig::push_timeout`](super::RedisConfig::push_timeout): may
    /// or may not have been delivered.
    Timeout,
    /// The receiving edge remembers as many delivered push ids as it may: not delivered,
    /// retry later.
    Busy,
}

/// A delivery result as a backend's PLAYER_PUSH is answered (PROTOCOL.md §9.7).
impl From<DeliveryResult> for waygate_protocol::link::PlayerPushOutcome {
    fn from(result: DeliveryResult) -> Self {
        match result {
            DeliveryResult::Delivered => Self::Delivered,
            DeliveryResult::Offline => Self::Offline,
            DeliveryResult::QueueFull => Self::QueueFull,
            DeliveryResult::EdgeUnreachable => Self::Unreachable,
            DeliveryResult::Timeout => Self::Unknown,
            DeliveryResult::Busy => Self::Busy,
        }
    }
}

/// The result a receiving edge sends back for its own outcome of a push.
impl From<waygate_protocol::link::PlayerPushOutcome> for DeliveryResult {
    fn from(outcome: waygate_protocol::link::PlayerPushOutcome) -> Self {
        use waygate_protocol::link::PlayerPushOutcome as O;
        match outcome {
            O::Delivered => Self::Delivered,
            O::Offline => Self::Offline,
            O::QueueFull => Self::QueueFull,
            O::Busy => Self::Busy,
            O::Unreachable => Self::EdgeUnreachable,
            // Not an outcome a receiving edge reaches; answered as what it means.
            _ => Self::Timeout,
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct PushRequest {
    id: u64,
    reply: String,
    items: Vec<(String, PushMessage)>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct PushReply {
    id: u64,
    results: Vec<DeliveryResult>,
}

/// What an edge does with pushes from other edges (see [`RedisPresence::serve_pushes`]).
/// Called once per message, in the order they came; must not block (queue, do not wait):
/// a result known only later is a [`PushDelivery::Later`].
pub trait PushHandler: Send + Sync + 'static {
    /// Delivers `msg` to `player_id`'s session on this edge.
    fn deliver(&self, player_id: &str, msg: PushMessage) -> PushDelivery;
}

impl<F, R> PushHandler for F
where
    F: Fn(&str, PushMessage) -> R + Send + Sync + 'static,
    R: Into<PushDelivery>,
{
    fn deliver(&self, player_id: &str, msg: PushMessage) -> PushDelivery {
        self(player_id, msg).into()
    }
}

/// What became of a pushed message: known now, or once the message is written through
/// (a future that must end by itself; for a [`PushHandler`], within the sender's
/// [`push_timeout`](super::RedisConfig::push_timeout)). `T` is the answer's type: a
/// [`DeliveryResult`] between edges, a PLAYER_PUSH outcome on a backend's link.
pub enum PushDelivery<T = DeliveryResult> {
    /// Decided when the message was handled.
    Now(T),
    /// Decided later (the message is queued; the future says what became of it).
    Later(std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>),
}

impl<T: Send + 'static> PushDelivery<T> {
    /// The same delivery with its answer converted.
    pub fn map<U>(self, f: impl FnOnce(T) -> U + Send + 'static) -> PushDelivery<U> {
        match self {
            Self::Now(t) => PushDelivery::Now(f(t)),
            Self::Later(later) => PushDelivery::Later(Box::pin(async move { f(later.await) })),
        }
    }

    /// The answer, once known.
    pub async fn resolve(self) -> T {
        match self {
            Self::Now(t) => t,
            Self::Later(later) => later.await,
        }
    }
}

impl From<DeliveryResult> for PushDelivery {
    fn from(result: DeliveryResult) -> Self {
        Self::Now(result)
    }
}

/// Messages for one edge, each with its player.
type PushBatch = Vec<(String, PushMessage)>;

/// A batch that failed, and whether its request may have reached the edge anyway.
struct BatchFailure {
    error: RedisError,
    maybe_sent: bool,
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Vec<DeliveryResult>>>>>;

/// The sending side's state in [`RedisPresence`]: replies awaited by request id, the next
/// request id, and the listener on this edge's reply channel (started on the first push).
pub(super) struct PushState {
    pending: Pending,
    next_id: AtomicU64,
    listener: tokio::sync::OnceCell<ReplyListener>,
}

impl PushState {
    pub(super) fn new() -> Self {
        Self {
            pending: Arc::default(),
            next_id: AtomicU64::new(1),
            listener: tokio::sync::OnceCell::new(),
        }
    }
}

struct ReplyListener {
    channel: String,
    up: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ReplyListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The receiving side of cross-edge pushes; stops when dropped.
#[derive(Debug)]
pub struct PushServer {
    task: tokio::task::JoinHandle<()>,
    up: watch::Receiver<bool>,
}

impl PushServer {
    /// Whether the subscription is up.
    pub fn is_up(&self) -> bool {
        *self.up.borrow()
    }

    /// Waits until the subscription is up (or `timeout` passes); returns whether it is.
    pub async fn wait_up(&mut self, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, self.up.wait_for(|u| *u))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

impl Drop for PushServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RedisPresence {
    async fn listener(&self) -> Result<&ReplyListener, RedisError> {
        let l = self
            .push
            .listener
            .get_or_init(|| async {
                let mut rnd = [0u8; 16];
                rand::fill(&mut rnd);
                let channel = format!("{}:reply:{}", self.conn.config.prefix, hex_id(&rnd));
                let (up_tx, up) = watch::channel(false);
                let pending = self.push.pending.clone();
                let task = tokio::spawn(subscribe_loop(
                    self.conn.clone(),
                    channel.clone(),
                    Some(up_tx),
                    None,
                    move |msg| {
                        let pending = pending.clone();
                        async move {
                            let Ok(reply) =
                                serde_json::from_slice::<PushReply>(msg.get_payload_bytes())
                            else {
                                tracing::warn!("malformed push reply ignored");
                                return;
                            };
                            let tx = pending
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .remove(&reply.id);
                            // A send fails only when the requester stopped waiting: it has
                            // already returned its own timeout error to its caller.
                            if let Some(tx) = tx {
                                let _ = tx.send(reply.results);
                            }
                        }
                    },
                ));
                ReplyListener { channel, up, task }
            })
            .await;
        let mut up = l.up.clone();
        let ready = tokio::time::timeout(self.conn.config.op_timeout, up.wait_for(|u| *u))
            .await
            .is_ok_and(|r| r.is_ok());
        if ready {
            Ok(l)
        } else {
            Err(RedisError::Timeout)
        }
    }

    /// Pushes a batch to players on `edge_id` (one request, one reply). The result has one
    /// entry per message, in order. Fails only when Redis itself cannot be used; a silent
    /// target edge yields per-message [`DeliveryResult::EdgeUnreachable`] or `Timeout`.
    pub async fn push_batch(
        &self,
        edge_id: &str,
        items: Vec<(String, PushMessage)>,
    ) -> Result<Vec<DeliveryResult>, RedisError> {
        self.send_batch(edge_id, items).await.map_err(|f| f.error)
    }

    /// [`RedisPresence::push_batch`], telling on failure whether the request may have
    /// reached the edge (the PUBLISH was attempted).
    async fn send_batch(
        &self,
        edge_id: &str,
        items: Vec<(String, PushMessage)>,
    ) -> Result<Vec<DeliveryResult>, BatchFailure> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let n = items.len();
        let not_sent = |error| BatchFailure {
            error,
            maybe_sent: false,
        };
        let maybe_sent = |error| BatchFailure {
            error,
            maybe_sent: true,
        };
        let listener = self.listener().await.map_err(not_sent)?;
        let id = self.push.next_id.fetch_add(1, Ordering::Relaxed);
        let req = PushRequest {
            id,
            reply: listener.channel.clone(),
            items,
        };
        let body =
            serde_json::to_vec(&req).map_err(|e| not_sent(RedisError::Invalid(e.to_string())))?;
        let (tx, rx) = oneshot::channel();
        self.push
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let forget = || {
            self.push
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
        };
        let channel = self.conn.edge_channel(edge_id, "push");
        let receivers: Result<u64, _> = self
            .conn
            .run(|mut m| async move { m.publish(channel, body).await })
            .await;
        match receivers {
            Err(e) => {
                forget();
                return Err(maybe_sent(e));
            }
            // On one Redis, no subscriber means the edge is not there. A cluster counts
            // only the receiving node's subscribers: the target may listen elsewhere.
            Ok(0) if !self.conn.is_cluster() => {
                forget();
                return Ok(vec![DeliveryResult::EdgeUnreachable; n]);
            }
            Ok(_) => {}
        }
        match tokio::time::timeout(self.conn.config.push_timeout, rx).await {
            Ok(Ok(results)) if results.len() == n => Ok(results),
            Ok(Ok(results)) => Err(maybe_sent(RedisError::Corrupt(format!(
                "push reply has {} results for {n} messages",
                results.len()
            )))),
            _ => {
                forget();
                Ok(vec![DeliveryResult::Timeout; n])
            }
        }
    }

    /// Pushes to players wherever they are: looks up presence (one round trip), sends one
    /// batch per edge concurrently, and returns one result per message in order (players
    /// without presence: [`DeliveryResult::Offline`]). Fails only when the lookup does
    /// (nothing was sent); a batch that failed has its own messages answered
    /// [`DeliveryResult::EdgeUnreachable`] (not sent) or [`DeliveryResult::Timeout`] (its
    /// request may have arrived), and the other batches' results stand.
    pub async fn push(
        &self,
        items: Vec<(String, PushMessage)>,
    ) -> Result<Vec<DeliveryResult>, RedisError> {
        let players: Vec<&str> = items.iter().map(|(p, _)| p.as_str()).collect();
        let where_ = self.lookup_many(&players).await?;
        let mut results = vec![DeliveryResult::Offline; items.len()];
        let mut per_edge: HashMap<String, (Vec<usize>, PushBatch)> = HashMap::new();
        for (i, (item, presence)) in items.into_iter().zip(where_).enumerate() {
            if let Some(p) = presence {
                let e = per_edge.entry(p.edge).or_default();
                e.0.push(i);
                e.1.push(item);
            }
        }
        let sends = per_edge
            .into_iter()
            .map(|(edge, (idx, batch))| async move { (idx, self.send_batch(&edge, batch).await) });
        for (idx, r) in futures_util::future::join_all(sends).await {
            let r = r.unwrap_or_else(|f| {
                tracing::debug!(error = %f.error, maybe_sent = f.maybe_sent, "a cross-edge push batch failed");
                let each = if f.maybe_sent {
                    DeliveryResult::Timeout
                } else {
                    DeliveryResult::EdgeUnreachable
                };
                vec![each; idx.len()]
            });
            for (i, res) in idx.into_iter().zip(r) {
                results[i] = res;
            }
        }
        Ok(results)
    }

    /// Serves pushes addressed to `edge_id`: every request's messages go through `handler`
    /// and the per-message results go back to the sender. Reconnects by itself; stops when
    /// the returned [`PushServer`] is dropped.
    pub fn serve_pushes(&self, edge_id: &str, handler: impl PushHandler) -> PushServer {
        let handler = Arc::new(handler);
        let channel = self.conn.edge_channel(edge_id, "push");
        let (up_tx, up) = watch::channel(false);
        let conn = self.conn.clone();
        let task = tokio::spawn(subscribe_loop(
            self.conn.clone(),
            channel,
            Some(up_tx),
            None,
            move |msg| {
                let (handler, conn) = (handler.clone(), conn.clone());
                async move {
                    let Ok(req) = serde_json::from_slice::<PushRequest>(msg.get_payload_bytes())
                    else {
                        tracing::warn!("malformed push request ignored");
                        return;
                    };
                    // Every message is queued first, in order; results that come later
                    // (written through) are awaited on a task of their own, so one request
                    // does not hold up the next (such tasks are bounded by the handler's
                    // receipts waiting, beyond which it answers at once).
                    let deliveries: Vec<PushDelivery> = req
                        .items
                        .into_iter()
                        .map(|(player, m)| handler.deliver(&player, m))
                        .collect();
                    let (id, to) = (req.id, req.reply);
                    let waits = deliveries
                        .iter()
                        .any(|d| matches!(d, PushDelivery::Later(_)));
                    let answer = async move {
                        // Awaited together: each wait (its 600 ms write-through bound) runs
                        // from now, not after the one before it, so the batch's answer comes
                        // within the sending edge's 1 s (in order, one result per message).
                        let results = futures_util::future::join_all(
                            deliveries.into_iter().map(PushDelivery::resolve),
                        )
                        .await;
                        let Ok(body) = serde_json::to_vec(&PushReply { id, results }) else {
                            return;
                        };
                        if let Err(e) = conn
                            .run(|mut m| async move { m.publish::<_, _, u64>(to, body).await })
                            .await
                        {
                            tracing::warn!(error = %e, "could not answer a push batch");
                        }
                    };
                    if waits {
                        tokio::spawn(answer);
                    } else {
                        answer.await;
                    }
                }
            },
        ));
        PushServer { task, up }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_messages_round_trip_as_json() {
        let m = PushMessage {
            class: TrafficClass::Normal,
            msg_id: 9,
            payload: Bytes::from_static(b"\x00\xffhi"),
            id: 0,
        };
        let json = serde_json::to_string(&m).expect("ser");
        assert!(
            !json.contains("\"id\""),
            "no id field when there is none: {json}"
        );
        assert_eq!(serde_json::from_str::<PushMessage>(&json).expect("de"), m);
        let m = PushMessage { id: 77, ..m };
        let json = serde_json::to_string(&m).expect("ser");
        assert_eq!(serde_json::from_str::<PushMessage>(&json).expect("de"), m);
    }
}

//! The I/O shell of one backend link, shared by both ends: a reader task and a writer task
//! over a byte stream, moving [`LinkFrame`]s through bounded channels. It answers LINK_PING
//! itself, sends LINK_PING when it has written nothing for the heartbeat interval, and ends
//! the link after three intervals without receiving anything, or when an answer it gives at
//! once finds no room in the write queue for [`REPLY_WAIT`] (5 s). Nothing else is decided
//! here.
//!
//! # waygate-link
//!
//! Owns only that shell (PROTOCOL.md §9): the edge's `LinkClient` (crate `waygate-edge`) and
//! the backend SDK (crate `waygate-backend`) both run their links on it, both load the
//! link secret with [`load_link_secret`] and build mutual-TLS configs with [`tls`]. What it must never do: interpret frames beyond
//! LINK_PING/LINK_PONG, know sessions or routes, or depend on the edge (a game server's
//! dependency tree contains it).

pub mod tls;

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use waygate_protocol::link::{LinkCodec, LinkFrame};
use waygate_protocol::CloseCode;

/// Frames queued for writing before `send` waits.
const WRITE_QUEUE: usize = 1024;
/// Frames read but not yet taken by the owner before the reader stops reading (plus the
/// owner's message credit, see [`LinkIoOptions::read_queue`]).
const READ_QUEUE: usize = 1024;

/// The environment variable holding the link secret (PROTOCOL.md §9.3), for edges and
/// backends alike.
pub const LINK_SECRET_ENV: &str = "WAYGATE_LINK_SECRET";

/// The link secret: [`LINK_SECRET_ENV`] when set and not empty, else the first line of
/// `file`, else none. A secret shorter than
/// [`MIN_LINK_SECRET_LEN`](waygate_protocol::link_auth::MIN_LINK_SECRET_LEN) bytes, or a
/// file that cannot be read, is an error naming its source.
pub fn load_link_secret(
    file: Option<&std::path::Path>,
) -> Result<Option<std::sync::Arc<[u8]>>, String> {
    load_secret(
        "link secret",
        LINK_SECRET_ENV,
        file,
        waygate_protocol::link_auth::MIN_LINK_SECRET_LEN,
    )
}

/// A shared secret (`what`, for errors): the environment variable `env` when set and not
/// empty, else the first line of `file`, else none. One shorter than `min_len` bytes, the
/// deploy kit's placeholder, or a file that cannot be read is an error naming its source.
pub fn load_secret(
    what: &str,
    env: &str,
    file: Option<&std::path::Path>,
    min_len: usize,
) -> Result<Option<std::sync::Arc<[u8]>>, String> {
    let (secret, source) = match std::env::var(env) {
        Ok(v) if !v.trim().is_empty() => (v.trim().to_owned(), env.to_owned()),
        _ => {
            let Some(path) = file else {
                return Ok(None);
            };
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("{what} file {}: {e}", path.display()))?;
            let line = text.lines().next().unwrap_or_default().trim().to_owned();
            (line, path.display().to_string())
        }
    };
    if secret.len() < min_len {
        return Err(format!(
            "the {what} from {source} must be at least {min_len} bytes"
        ));
    }
    if is_placeholder_secret(&secret) {
        return Err(format!(
            "the {what} from {source} is the deploy kit's placeholder: put a random \
             secret there (e.g. `openssl rand -hex 32`)"
        ));
    }
    Ok(Some(secret.into_bytes().into()))
}

/// Whether `secret` is still one of the deploy kit's placeholders (`replace-with-...`, in
/// `edge-bin/deploy/`): a value anyone who read the repository knows, refused like the
/// development key.
pub fn is_placeholder_secret(secret: &str) -> bool {
    secret.trim_start().starts_with("replace-with")
}

/// A handler for CREDIT frames, called by the reader itself.
pub type OnCredit = std::sync::Arc<dyn Fn(u32) + Send + Sync>;

/// What the owner's frame hook ([`LinkIoOptions::on_frame`]) did with a frame.
#[derive(Debug)]
pub enum FrameHandled {
    /// Carried out; nothing more to do.
    Taken,
    /// Carried out; write these frames back to the peer, in order (the reader waits at
    /// most [`REPLY_WAIT`] for room in the write queue, then ends the link:
    /// [`LinkEnd::NotReading`]).
    Reply(Vec<LinkFrame>),
    /// Not handled here: queue it for the owner (`LinkIo::rx`), in order.
    Queue(LinkFrame),
}

/// A hook the reader calls for every frame it reads (LINK_PING/PONG/CLOSE excepted), on its
/// own task: the owner carries out what it can without waiting, saving a channel hop.
pub type OnFrame = std::sync::Arc<dyn Fn(LinkFrame) -> FrameHandled + Send + Sync>;

/// Options of [`spawn_link_io`].
#[derive(Clone, Default)]
pub struct LinkIoOptions {
    /// Frames the reader may queue for the owner. Must be at least the message credit the
    /// owner grants the peer plus room for control frames, so the reader never stops
    /// reading while the peer is within its credit (otherwise a CREDIT frame behind those
    /// messages could never be read: a credit deadlock). 0 = a default of 1024.
    pub read_queue: usize,
    /// Handles CREDIT frames at once in the reader instead of queueing them behind
    /// messages, so an owner busy handling a message (e.g. waiting for credit itself) still
    /// receives the credit it waits for.
    pub on_credit: Option<OnCredit>,
    /// Called by the reader for every other frame before it is queued (see [`OnFrame`]).
    /// It must never wait.
    pub on_frame: Option<OnFrame>,
}

impl std::fmt::Debug for LinkIoOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkIoOptions")
            .field("read_queue", &self.read_queue)
            .field("on_credit", &self.on_credit.is_some())
            .field("on_frame", &self.on_frame.is_some())
            .finish()
    }
}

/// The owner's side of a running link. Dropping it ends both tasks and closes the socket,
/// even while clones of `tx` live elsewhere.
#[derive(Debug)]
pub struct LinkIo {
    /// Frames to write (a LINK_CLOSE is written, then the link ends).
    pub tx: mpsc::Sender<LinkFrame>,
    /// Frames read (PING/PONG excluded). `None` once the link ended.
    pub rx: mpsc::Receiver<LinkFrame>,
    _alive: watch::Sender<()>,
}

/// Why a link ended, as seen by its reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkEnd {
    /// The peer closed the stream or sent LINK_CLOSE with this code.
    Closed(CloseCode),
    /// Nothing arrived for three heartbeat intervals.
    Dead,
    /// The peer sent an invalid frame.
    Invalid,
    /// The peer stopped reading: an answer given at once ([`FrameHandled::Reply`]) found no
    /// room in the write queue for [`REPLY_WAIT`] (the link is reset, PROTOCOL.md §9.3).
    NotReading,
}

/// How long the reader waits for room in the write queue for an answer it gives at once
/// before it gives up on a peer that does not read (PROTOCOL.md §9.3).
pub const REPLY_WAIT: Duration = Duration::from_secs(5);

/// Starts the reader and writer tasks over `stream`.
pub fn spawn_link_io<S>(
    stream: S,
    max_frame: usize,
    heartbeat: Duration,
    options: LinkIoOptions,
) -> LinkIo
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (read_half, write_half) = tokio::io::split(stream);
    let (out_tx, out_rx) = mpsc::channel(WRITE_QUEUE);
    let read_queue = if options.read_queue == 0 {
        READ_QUEUE
    } else {
        options.read_queue
    };
    let (in_tx, in_rx) = mpsc::channel(read_queue);
    let codec = LinkCodec::new(max_frame);
    let (alive, alive_rx) = watch::channel(());
    tokio::spawn(write_loop(
        write_half,
        out_rx,
        codec,
        heartbeat,
        alive_rx.clone(),
    ));
    tokio::spawn(read_loop(
        read_half,
        in_tx,
        out_tx.downgrade(),
        codec,
        heartbeat,
        alive_rx,
        options,
    ));
    LinkIo {
        tx: out_tx,
        rx: in_rx,
        _alive: alive,
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<LinkFrame>,
    codec: LinkCodec,
    heartbeat: Duration,
    mut alive: watch::Receiver<()>,
) {
    let mut buf = BytesMut::new();
    let mut ping = 0u64;
    loop {
        // Biased: what was queued before the owner let go (a LINK_CLOSE) is still written.
        let first = tokio::select! {
            biased;
            next = tokio::time::timeout(heartbeat, rx.recv()) => match next {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(_) => {
                    ping += 1;
                    LinkFrame::Ping { timestamp: ping }
                }
            },
            _ = alive.changed() => break,
        };
        let mut closing = matches!(first, LinkFrame::Close { .. });
        if codec.encode(&first, &mut buf).is_err() {
            tracing::warn!("link frame too large; dropped");
        }
        // Let the tasks that are ready run first, so their frames join this write: woken
        // for one session's frame, the writer would otherwise write it alone while the
        // other sessions' tasks queue theirs behind it (W3, 50 sessions: one `sendto` per
        // FORWARD; with the yield ~0.28, 11% less CPU per message on the edge). Alone on
        // the link (W1) it costs one poll of the runtime's driver per write; on a busy
        // worker the write waits until that worker has run what is ready (tokio runs a
        // yielded task when it has nothing else, or after at most 61 polls): bounded.
        if !closing && rx.is_empty() {
            tokio::task::yield_now().await;
        }
        // Coalesce what is already queued into one write.
        while buf.len() < 64 * 1024 && !closing {
            match rx.try_recv() {
                Ok(frame) => {
                    closing = matches!(frame, LinkFrame::Close { .. });
                    if codec.encode(&frame, &mut buf).is_err() {
                        tracing::warn!("link frame too large; dropped");
                    }
                }
                Err(_) => break,
            }
        }
        // A peer that stopped reading must not keep the socket open once the owner let
        // the link go (the write would wait for it for good). Biased: what the socket takes
        // at once is still written.
        let wrote = tokio::select! {
            biased;
            wrote = w.write_all(&buf) => wrote.is_ok(),
            _ = alive.changed() => false,
        };
        if !wrote {
            return;
        }
        buf.clear();
        if closing {
            break;
        }
    }
    let _ = w.shutdown().await;
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut r: R,
    tx: mpsc::Sender<LinkFrame>,
    out: mpsc::WeakSender<LinkFrame>,
    codec: LinkCodec,
    heartbeat: Duration,
    mut alive: watch::Receiver<()>,
    options: LinkIoOptions,
) -> LinkEnd {
    let LinkIoOptions {
        on_credit,
        on_frame,
        ..
    } = options;
    let reply = |frame: LinkFrame| {
        if let Some(out) = out.upgrade() {
            let _ = out.try_send(frame);
        }
    };
    let mut buf = BytesMut::with_capacity(8 * 1024);
    let dead_after = heartbeat * 3;
    let mut last_rx = Instant::now();
    loop {
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(LinkFrame::Ping { timestamp })) => {
                    reply(LinkFrame::Pong { timestamp });
                }
                Ok(Some(LinkFrame::Pong { .. })) => {}
                Ok(Some(LinkFrame::Credit { credits })) if on_credit.is_some() => {
                    if let Some(f) = &on_credit {
                        f(credits);
                    }
                }
                Ok(Some(LinkFrame::Close { code, message })) => {
                    tracing::debug!(%code, %message, "link closed by peer");
                    return LinkEnd::Closed(code);
                }
                Ok(Some(frame)) => {
                    let handled = match &on_frame {
                        Some(f) => f(frame),
                        None => FrameHandled::Queue(frame),
                    };
                    let frame = match handled {
                        FrameHandled::Queue(frame) => frame,
                        FrameHandled::Taken => continue,
                        FrameHandled::Reply(answers) => {
                            let Some(out) = out.upgrade() else {
                                return LinkEnd::Closed(CloseCode::Normal);
                            };
                            for answer in answers {
                                tokio::select! {
                                    sent = tokio::time::timeout(REPLY_WAIT, out.send(answer)) => match sent {
                                        Ok(Ok(())) => {}
                                        Ok(Err(_)) => return LinkEnd::Closed(CloseCode::Normal),
                                        Err(_) => {
                                            tracing::warn!("the peer has not read its link for 5 s: link reset");
                                            return LinkEnd::NotReading;
                                        }
                                    },
                                    _ = alive.changed() => return LinkEnd::Closed(CloseCode::Normal),
                                }
                            }
                            continue;
                        }
                    };
                    tokio::select! {
                        sent = tx.send(frame) => if sent.is_err() {
                            return LinkEnd::Closed(CloseCode::Normal);
                        },
                        _ = alive.changed() => return LinkEnd::Closed(CloseCode::Normal),
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "invalid frame on backend link");
                    reply(LinkFrame::Close {
                        code: e.close_code(),
                        message: e.to_string(),
                    });
                    return LinkEnd::Invalid;
                }
            }
        }
        buf.reserve(8 * 1024);
        let read = tokio::select! {
            read = tokio::time::timeout_at(last_rx + dead_after, r.read_buf(&mut buf)) => read,
            _ = alive.changed() => return LinkEnd::Closed(CloseCode::Normal),
        };
        match read {
            Ok(Ok(0)) | Ok(Err(_)) => return LinkEnd::Closed(CloseCode::GoingAway),
            Ok(Ok(_)) => last_rx = Instant::now(),
            Err(_) => {
                tracing::warn!("backend link dead: nothing received for three heartbeats");
                return LinkEnd::Dead;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::Arc;

    use super::*;

    /// The reader's hook sees every frame but LINK_PING/PONG: what it takes never reaches the
    /// owner's queue, its replies are written to the peer, what it queues arrives in order.
    #[tokio::test]
    async fn the_frame_hook_takes_replies_and_queues_in_order() {
        let (a, b) = tokio::io::duplex(64 * 1024);
        let hook: OnFrame = Arc::new(|frame| match frame {
            LinkFrame::Credit { credits: 1 } => FrameHandled::Taken,
            LinkFrame::Credit { credits: 2 } => FrameHandled::Reply(vec![
                LinkFrame::Credit { credits: 20 },
                LinkFrame::Credit { credits: 21 },
            ]),
            other => FrameHandled::Queue(other),
        });
        let heartbeat = Duration::from_secs(5);
        let mut hooked = spawn_link_io(
            a,
            DEFAULT_TEST_FRAME,
            heartbeat,
            LinkIoOptions {
                on_frame: Some(hook),
                ..LinkIoOptions::default()
            },
        );
        let mut peer = spawn_link_io(b, DEFAULT_TEST_FRAME, heartbeat, LinkIoOptions::default());
        for credits in [1, 3, 2, 4] {
            peer.tx.send(LinkFrame::Credit { credits }).await.unwrap();
        }
        let queued = [hooked.rx.recv().await, hooked.rx.recv().await];
        assert_eq!(
            queued,
            [
                Some(LinkFrame::Credit { credits: 3 }),
                Some(LinkFrame::Credit { credits: 4 })
            ]
        );
        let replies = [peer.rx.recv().await, peer.rx.recv().await];
        assert_eq!(
            replies,
            [
                Some(LinkFrame::Credit { credits: 20 }),
                Some(LinkFrame::Credit { credits: 21 })
            ]
        );
        drop(hooked.tx);
    }

    /// Regression (2026-12-05, an audit of PROTOCOL.md §9.3 against the code): an answer the
    /// reader gives at once (the edge's CREDIT, CHANNEL_RESULT, PIN_RESULT...) waited
    /// without a bound for room in the write queue, so a peer that kept sending but stopped
    /// reading stalled the reader, and the link, for ever (the document says: reset after
    /// 5 s). Now the reader gives up after [`REPLY_WAIT`]: the link ends (`NotReading`).
    #[tokio::test]
    async fn a_peer_that_stops_reading_ends_the_link_after_the_reply_wait() {
        use tokio::io::AsyncWriteExt as _;
        let (a, mut b) = tokio::io::duplex(16 * 1024);
        let hook: OnFrame = Arc::new(|_| {
            FrameHandled::Reply(vec![LinkFrame::Push {
                handle: 1,
                msg_id: 7,
                class: waygate_protocol::wire::TrafficClass::Normal,
                payload: bytes::Bytes::from(vec![0u8; 4 * 1024]),
            }])
        });
        let mut hooked = spawn_link_io(
            a,
            DEFAULT_TEST_FRAME,
            Duration::from_secs(60),
            LinkIoOptions {
                on_frame: Some(hook),
                ..LinkIoOptions::default()
            },
        );
        // The peer asks and asks, and never reads an answer.
        let writer = tokio::spawn(async move {
            let codec = LinkCodec::new(DEFAULT_TEST_FRAME);
            let mut out = BytesMut::new();
            for credits in 0..100_000u32 {
                out.clear();
                codec
                    .encode(&LinkFrame::Credit { credits }, &mut out)
                    .unwrap();
                if b.write_all(&out).await.is_err() {
                    return;
                }
            }
        });
        let ended = tokio::time::timeout(Duration::from_secs(30), hooked.rx.recv()).await;
        assert_eq!(ended, Ok(None), "the link ended within the reply wait");
        writer.abort();
    }

    /// Regression (2026-12-04, second stop): a write to a peer that stopped reading held the
    /// socket's write half, so dropping the owner's side did not close the socket (the
    /// edge could not reset a link to a stuck backend).
    #[tokio::test]
    async fn dropping_the_owner_closes_the_socket_even_while_a_write_waits() {
        use tokio::io::AsyncWriteExt as _;
        let (a, mut b) = tokio::io::duplex(1024);
        let io = spawn_link_io(
            a,
            DEFAULT_TEST_FRAME,
            Duration::from_secs(5),
            LinkIoOptions::default(),
        );
        // More than the pipe holds: the writer waits for a reader that never comes.
        io.tx
            .send(LinkFrame::Push {
                handle: 1,
                msg_id: 7,
                class: waygate_protocol::wire::TrafficClass::Normal,
                payload: bytes::Bytes::from(vec![0u8; 16 * 1024]),
            })
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(io);
        let closed = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if b.write_all(b"x").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(closed.is_ok(), "the socket stayed open");
    }

    /// A TCP stream that counts the writes that moved bytes.
    struct CountingStream {
        inner: tokio::net::TcpStream,
        writes: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl AsyncRead for CountingStream {
        fn poll_read(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for CountingStream {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let this = self.get_mut();
            let wrote = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
            if matches!(wrote, std::task::Poll::Ready(Ok(n)) if n > 0) {
                this.writes
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            wrote
        }

        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.get_mut().inner).poll_flush(cx)
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
        }
    }

    /// Frames queued by tasks that became ready while the writer was being woken for an
    /// earlier frame leave with it in one write (issue 17, W3: the edge made one `sendto`
    /// per FORWARD, 2.0 per echo with the client's; 1.28 after, and 11% less CPU per
    /// message). Before the writer let the ready tasks run first: two writes here.
    #[tokio::test]
    async fn frames_of_tasks_ready_together_share_one_write() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (ours, theirs) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let writes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let heartbeat = Duration::from_secs(5);
        let io = spawn_link_io(
            CountingStream {
                inner: ours.unwrap(),
                writes: writes.clone(),
            },
            DEFAULT_TEST_FRAME,
            heartbeat,
            LinkIoOptions::default(),
        );
        let mut peer = spawn_link_io(
            theirs.unwrap().0,
            DEFAULT_TEST_FRAME,
            heartbeat,
            LinkIoOptions::default(),
        );
        let go = Arc::new(tokio::sync::Notify::new());
        let mut senders = Vec::new();
        for credits in 1..=9 {
            let (tx, go) = (io.tx.clone(), go.clone());
            let waiting = go.notified_owned();
            senders.push(tokio::spawn(async move {
                waiting.await;
                tx.send(LinkFrame::Credit { credits }).await.unwrap();
            }));
        }
        // The writer task was spawned before the nine senders, so the current-thread
        // runtime polls it first: it finds this frame with nothing behind it.
        io.tx
            .send(LinkFrame::Credit { credits: 100 })
            .await
            .unwrap();
        go.notify_waiters();
        let mut got = Vec::new();
        for _ in 0..10 {
            let frame = tokio::time::timeout(Duration::from_secs(5), peer.rx.recv())
                .await
                .expect("the frames arrive")
                .expect("link up");
            got.push(frame);
        }
        let credits: Vec<u32> = got
            .iter()
            .map(|f| match f {
                LinkFrame::Credit { credits } => *credits,
                other => panic!("unexpected frame {other:?}"),
            })
            .collect();
        assert_eq!(credits, [100, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(
            writes.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one write for the ten frames"
        );
        for s in senders {
            s.await.unwrap();
        }
    }

    const DEFAULT_TEST_FRAME: usize = 64 * 1024;
}

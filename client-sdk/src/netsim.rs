//! A network simulator for testing a game under a bad network (SDK issue item 9; Photon's
//! lag simulation): added latency, jitter and loss on every frame the client sends and
//! receives, configured in [`crate::ClientOptions::net_sim`].
//!
//! It works on frames, above the transport, the same way for every transport:
//!
//! - every frame is held for `latency` plus a random share of `jitter`;
//! - a lost **best-effort** DATA is gone (as a lost datagram), and best-effort frames may
//!   overtake each other through jitter (reordering);
//! - a lost frame of any other kind arrives `retransmit_delay` later, as on a reliable
//!   transport that resends it (TCP, QUIC streams, KCP), and never overtakes an earlier
//!   one: the stream stays in order.
//!
//! [`NetSim`] is the sans-IO core (the time comes in, the frames come out when due);
//! [`SimConnection`] wraps a connection with one core per direction.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::sync::mpsc;
use waygate_transport::conn::{ConnInfo, Connection};
use waygate_transport::{BoxConnection, CloseCode, Frame, TrafficClass, TransportError};

/// How bad the simulated network is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetSimConfig {
    /// Added to every frame, each direction.
    pub latency: Duration,
    /// Up to this much more, uniformly at random, per frame.
    pub jitter: Duration,
    /// Share of frames lost (0.0..=1.0): best-effort ones are dropped, the others arrive
    /// `retransmit_delay` late.
    pub loss: f64,
    /// How much later a lost reliable frame arrives (a retransmission timeout).
    pub retransmit_delay: Duration,
    /// Seed of the random choices (the same seed, the same choices).
    pub seed: u64,
}

impl Default for NetSimConfig {
    fn default() -> Self {
        Self {
            latency: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            retransmit_delay: Duration::from_millis(200),
            seed: 1,
        }
    }
}

/// What a simulator did (both directions of a connection, or every connection of a client).
#[derive(Debug, Default)]
pub struct NetSimStats {
    /// Frames that went through.
    pub frames: AtomicU64,
    /// Best-effort frames dropped.
    pub dropped: AtomicU64,
    /// Reliable frames delayed as if retransmitted.
    pub retransmitted: AtomicU64,
}

/// One direction of the simulated network, sans-IO.
#[derive(Debug)]
pub struct NetSim {
    config: NetSimConfig,
    rng: StdRng,
    /// Frames in flight by delivery time (then arrival order).
    queue: BinaryHeap<Reverse<(Instant, u64, FrameSlot)>>,
    /// When the last reliable frame is delivered: later ones never overtake it.
    last_reliable: Option<Instant>,
    order: u64,
    stats: Arc<NetSimStats>,
}

/// A frame in the heap (ordered by the heap's key only).
#[derive(Debug)]
struct FrameSlot(Frame);

impl PartialEq for FrameSlot {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for FrameSlot {}
impl PartialOrd for FrameSlot {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for FrameSlot {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

impl NetSim {
    /// A direction with `config`, its random choices seeded with `config.seed ^ salt`,
    /// counting into `stats`.
    pub fn new(config: NetSimConfig, salt: u64, stats: Arc<NetSimStats>) -> Self {
        Self {
            config,
            rng: StdRng::seed_from_u64(config.seed ^ salt),
            queue: BinaryHeap::new(),
            last_reliable: None,
            order: 0,
            stats,
        }
    }

    /// A frame enters the network at `now`.
    pub fn on_frame(&mut self, now: Instant, frame: Frame) {
        self.stats.frames.fetch_add(1, Ordering::Relaxed);
        let lost = self.config.loss > 0.0 && self.rng.random_bool(self.config.loss.min(1.0));
        let best_effort = matches!(&frame, Frame::Data(d) if d.class == TrafficClass::BestEffort);
        if lost && best_effort {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let jitter = if self.config.jitter.is_zero() {
            Duration::ZERO
        } else {
            self.config.jitter.mul_f64(self.rng.random_range(0.0..1.0))
        };
        let mut at = now + self.config.latency + jitter;
        if lost {
            self.stats.retransmitted.fetch_add(1, Ordering::Relaxed);
            at += self.config.retransmit_delay;
        }
        if !best_effort {
            at = self.last_reliable.map_or(at, |last| at.max(last));
            self.last_reliable = Some(at);
        }
        self.order += 1;
        self.queue.push(Reverse((at, self.order, FrameSlot(frame))));
    }

    /// The next frame due at `now`, if any.
    pub fn poll(&mut self, now: Instant) -> Option<Frame> {
        let Reverse((at, _, _)) = self.queue.peek()?;
        if *at > now {
            return None;
        }
        self.queue.pop().map(|Reverse((_, _, FrameSlot(f)))| f)
    }

    /// When the next frame is due.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.queue.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Frames in flight.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
}

/// Frames in flight per direction beyond which the simulated network pushes back.
const SIM_QUEUE: usize = 4096;

enum Up {
    Frame(Frame),
    Close(CloseCode, String),
}

/// A connection seen through the simulated network: a task moves the frames between the
/// wrapper and the real connection, holding each as [`NetSim`] says.
pub struct SimConnection {
    info: ConnInfo,
    up: mpsc::Sender<Up>,
    down: mpsc::Receiver<Result<Frame, TransportError>>,
    /// The link ended (its error was returned once).
    ended: bool,
}

impl std::fmt::Debug for SimConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimConnection")
            .field("info", &self.info)
            .finish()
    }
}

impl SimConnection {
    /// Wraps `inner`; `stats` counts what both directions did.
    pub fn wrap(
        inner: BoxConnection,
        config: NetSimConfig,
        stats: Arc<NetSimStats>,
    ) -> BoxConnection {
        let info = inner.info().clone();
        let (up_tx, up_rx) = mpsc::channel(SIM_QUEUE);
        let (down_tx, down_rx) = mpsc::channel(SIM_QUEUE);
        tokio::spawn(pump(inner, config, stats, up_rx, down_tx));
        Box::new(Self {
            info,
            up: up_tx,
            down: down_rx,
            ended: false,
        })
    }
}

fn link_gone() -> TransportError {
    TransportError::Closed
}

/// Moves frames: the wrapper's sends through the upstream simulator to the real connection,
/// the real connection's frames through the downstream one to the wrapper.
async fn pump(
    mut inner: BoxConnection,
    config: NetSimConfig,
    stats: Arc<NetSimStats>,
    mut up_rx: mpsc::Receiver<Up>,
    down_tx: mpsc::Sender<Result<Frame, TransportError>>,
) {
    let mut up = NetSim::new(config, 0x75, stats.clone());
    let mut down = NetSim::new(config, 0xd0, stats);
    // A receive error ends reading; it reaches the wrapper after the frames before it.
    let mut read_error: Option<TransportError> = None;
    loop {
        let now = Instant::now();
        while let Some(f) = up.poll(now) {
            if let Err(e) = inner.send(&f).await {
                let _ = down_tx.send(Err(e)).await;
                return;
            }
        }
        while let Some(f) = down.poll(now) {
            if down_tx.send(Ok(f)).await.is_err() {
                return;
            }
        }
        if let Some(e) = read_error.take_if(|_| down.in_flight() == 0) {
            let _ = down_tx.send(Err(e)).await;
            return;
        }
        let deadline = [up.next_deadline(), down.next_deadline()]
            .into_iter()
            .flatten()
            .min();
        let sleep = async {
            match deadline {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            cmd = up_rx.recv(), if up.in_flight() < SIM_QUEUE => match cmd {
                Some(Up::Frame(f)) => up.on_frame(Instant::now(), f),
                Some(Up::Close(code, message)) => {
                    // What is in flight goes first, as the CLOSE would follow it.
                    while let Some(f) = up.poll(Instant::now() + Duration::from_secs(3600)) {
                        if inner.send(&f).await.is_err() {
                            break;
                        }
                    }
                    inner.close(code, &message).await;
                    return;
                }
                None => return,
            },
            r = inner.recv(), if read_error.is_none() && down.in_flight() < SIM_QUEUE => match r {
                Ok(f) => down.on_frame(Instant::now(), f),
                Err(e) => read_error = Some(e),
            },
            () = sleep => {}
        }
    }
}

#[async_trait]
impl Connection for SimConnection {
    fn info(&self) -> &ConnInfo {
        &self.info
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), TransportError> {
        self.up
            .send(Up::Frame(frame.clone()))
            .await
            .map_err(|_| link_gone())
    }

    async fn recv(&mut self) -> Result<Frame, TransportError> {
        if self.ended {
            return Err(link_gone());
        }
        match self.down.recv().await {
            Some(Ok(f)) => Ok(f),
            Some(Err(e)) => {
                self.ended = true;
                Err(e)
            }
            None => {
                self.ended = true;
                Err(link_gone())
            }
        }
    }

    async fn close(&mut self, code: CloseCode, message: &str) {
        // Bounded like the real transports' close: a pump that stopped draining (its
        // downstream full, nobody reading) must not hold the caller for ever.
        let close = self.up.send(Up::Close(code, message.to_owned()));
        if !matches!(
            tokio::time::timeout(std::time::Duration::from_millis(500), close).await,
            Ok(Ok(()))
        ) {
            // The connection ends either way: the simulated peer sees it gone.
            tracing::debug!("simulated link closed without its CLOSE (pump gone or full)");
        }
    }

    fn handshake_done(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use proptest::prelude::*;
    use waygate_protocol::frame::Data;

    fn data(class: TrafficClass, seq: u64) -> Frame {
        Frame::Data(Data {
            class,
            msg_id: 1,
            seq,
            ack: None,
            payload: Bytes::new(),
        })
    }

    fn seq(f: &Frame) -> u64 {
        match f {
            Frame::Data(d) => d.seq,
            _ => 0,
        }
    }

    #[test]
    fn latency_holds_every_frame_and_loss_delays_reliable_ones() {
        let t0 = Instant::now();
        let stats = Arc::new(NetSimStats::default());
        let config = NetSimConfig {
            latency: Duration::from_millis(50),
            loss: 1.0,
            ..NetSimConfig::default()
        };
        let mut sim = NetSim::new(config, 0, stats.clone());
        sim.on_frame(t0, data(TrafficClass::Normal, 1));
        sim.on_frame(t0, data(TrafficClass::BestEffort, 0));
        assert_eq!(sim.in_flight(), 1, "the best-effort frame is lost");
        assert_eq!(sim.poll(t0 + Duration::from_millis(249)), None);
        assert_eq!(sim.next_deadline(), Some(t0 + Duration::from_millis(250)));
        assert_eq!(
            sim.poll(t0 + Duration::from_millis(250)).map(|f| seq(&f)),
            Some(1)
        );
        assert_eq!(stats.dropped.load(Ordering::Relaxed), 1);
        assert_eq!(stats.retransmitted.load(Ordering::Relaxed), 1);
    }

    proptest! {
        /// Whatever the latency, jitter and loss: every reliable frame arrives, once, in the
        /// order it was sent; only best-effort frames are ever missing.
        #[test]
        fn reliable_frames_all_arrive_in_order(
            seed: u64,
            loss in 0.0f64..0.5,
            jitter_ms in 0u64..100,
            sends in proptest::collection::vec((any::<bool>(), 0u64..30), 1..200),
        ) {
            let t0 = Instant::now();
            let config = NetSimConfig {
                latency: Duration::from_millis(10),
                jitter: Duration::from_millis(jitter_ms),
                loss,
                seed,
                ..NetSimConfig::default()
            };
            let mut sim = NetSim::new(config, 7, Arc::new(NetSimStats::default()));
            let mut now = t0;
            let mut sent = 0u64;
            let mut got = Vec::new();
            for (reliable, gap_ms) in sends {
                now += Duration::from_millis(gap_ms);
                while let Some(f) = sim.poll(now) { got.push(f) }
                if reliable {
                    sent += 1;
                    sim.on_frame(now, data(TrafficClass::Normal, sent));
                } else {
                    sim.on_frame(now, data(TrafficClass::BestEffort, 0));
                }
            }
            let end = now + Duration::from_secs(3600);
            while let Some(f) = sim.poll(end) { got.push(f) }
            let reliable: Vec<u64> = got.iter().map(seq).filter(|s| *s > 0).collect();
            prop_assert_eq!(reliable, (1..=sent).collect::<Vec<_>>());
            prop_assert_eq!(sim.in_flight(), 0);
        }
    }
}

//! The servers of a bench run besides the edge:
//! - the **direct echo** server speaks the client protocol itself (HELLO -> WELCOME after the
//!   same HMAC token check, DATA ECHO -> DATA ECHO_REPLY with the same prefix shape as the
//!   demo backend, PING -> PONG, optional pushes) on every transport, through the same
//!   transport crate as the edge: the floor the edge is compared with;
//! - the **bench backend**: a backend-library service that answers ECHO like the demo backend
//!   and optionally pushes to every session at a fixed rate (W2 push variant, W7).
//!
//! Push payloads are `[counter u64 LE][unix nanos u64 LE][padding]`, so clients check order
//! and loss and measure one-way latency.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use waygate_protocol::frame::{Data, Welcome, WelcomeOutcome};
use waygate_session::auth::KeyRing;
use waygate_session::HmacAuthenticator;
use waygate_transport::{BoxConnection, CloseCode, Frame, TrafficClass};

use waygate_backend::demo::{ECHO, ECHO_REPLY};
use waygate_backend::{Backend, BackendConfig, BackendSession, Incoming, Refusal, Service};
use waygate_edge::config::{EdgeConfig, DEV_KEY_ID, DEV_KEY_SECRET};

/// Message id of bench pushes (backend -> client).
pub const PUSH: u32 = 1002;

/// Unix time in nanoseconds (comparable across processes on one host).
pub fn unix_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// A push payload of `size` bytes (at least 16).
pub fn push_payload(counter: u64, size: usize) -> Bytes {
    let mut b = BytesMut::with_capacity(size.max(16));
    b.put_u64_le(counter);
    b.put_u64_le(unix_nanos());
    b.resize(size.max(16), 0x5a);
    b.freeze()
}

/// Reads `(counter, unix nanos)` back from a push payload.
pub fn parse_push(p: &[u8]) -> Option<(u64, u64)> {
    let c = u64::from_le_bytes(p.get(0..8)?.try_into().ok()?);
    let t = u64::from_le_bytes(p.get(8..16)?.try_into().ok()?);
    Some((c, t))
}

fn period(rate: f64) -> Option<Duration> {
    (rate > 0.0).then(|| Duration::from_secs_f64(1.0 / rate))
}

/// Runs the direct echo server on every transport until interrupted; prints
/// `{"event":"ready","listeners":{...}}`.
pub async fn run_echo(push_rate: f64, payload: usize, ca_out: PathBuf) -> Result<(), String> {
    let mut config = EdgeConfig::default();
    config.use_ephemeral_ports();
    config.admin.enabled = false;
    config.tls.dev_ca_out = Some(ca_out);
    config.kcp.max_sessions = 20_000;
    let bound = waygate_edge::listeners::bind_all(&config, None, None)
        .await
        .map_err(|e| e.to_string())?;
    let mut keys = KeyRing::new();
    keys.insert(DEV_KEY_ID, DEV_KEY_SECRET.as_bytes());
    let auth = Arc::new(HmacAuthenticator::new(keys));
    let listeners: std::collections::BTreeMap<String, String> = bound
        .addrs
        .iter()
        .map(|(k, a)| (k.as_str().to_string(), a.to_string()))
        .collect();
    println!(
        "{}",
        serde_json::json!({"event": "ready", "listeners": listeners})
    );
    for mut listener in bound.listeners {
        let auth = auth.clone();
        tokio::spawn(async move {
            while let Some(conn) = listener.accept().await {
                tokio::spawn(echo_conn(conn, auth.clone(), period(push_rate), payload));
            }
        });
    }
    tokio::signal::ctrl_c().await.map_err(|e| e.to_string())
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

async fn echo_conn(
    mut conn: BoxConnection,
    auth: Arc<HmacAuthenticator>,
    push: Option<Duration>,
    push_size: usize,
) {
    let hello = match conn.recv().await {
        Ok(Frame::Hello(h)) => h,
        _ => return,
    };
    let now_unix = unix_nanos() / 1_000_000_000;
    let player = match auth.verify(&hello.token, now_unix) {
        Ok(p) => p.claims.player_id,
        Err(e) => {
            conn.close(e.close_code(), "auth").await;
            return;
        }
    };
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed).to_le_bytes();
    let mut sid = [0u8; 16];
    sid[..8].copy_from_slice(&id);
    let welcome = Frame::Welcome(Welcome {
        session_id: sid,
        resume_token: sid,
        outcome: WelcomeOutcome::NewSession,
        heartbeat_interval_ms: 10_000,
        idle_timeout_ms: 30_000,
        max_frame_size: 65_536,
        server_seq_base: 0,
        client_seq_ack: 0,
    });
    conn.handshake_done();
    if conn.send(&welcome).await.is_err() {
        return;
    }
    let prefix = format!("direct|{player}|").into_bytes();
    let mut server_seq = 0u64;
    let mut client_cum = 0u64;
    let mut pushed = 0u64;
    let mut ticker = push.map(|p| {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + p, p);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    loop {
        let tick = async {
            match ticker.as_mut() {
                Some(t) => {
                    t.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        let out = tokio::select! {
            f = conn.recv() => match f {
                Ok(Frame::Data(d)) => {
                    if d.seq > client_cum {
                        client_cum = d.seq;
                    }
                    if d.msg_id != ECHO {
                        continue;
                    }
                    let mut p = BytesMut::with_capacity(prefix.len() + d.payload.len());
                    p.extend_from_slice(&prefix);
                    p.extend_from_slice(&d.payload);
                    let seq = if d.class.is_sequenced() {
                        server_seq += 1;
                        server_seq
                    } else {
                        0
                    };
                    Frame::Data(Data {
                        class: d.class,
                        msg_id: ECHO_REPLY,
                        seq,
                        ack: Some(client_cum),
                        payload: p.freeze(),
                    })
                }
                Ok(Frame::Ping { timestamp }) => Frame::Pong { timestamp },
                Ok(_) => continue,
                Err(_) => return,
            },
            () = tick => {
                server_seq += 1;
                pushed += 1;
                Frame::Data(Data {
                    class: TrafficClass::Normal,
                    msg_id: PUSH,
                    seq: server_seq,
                    ack: None,
                    payload: push_payload(pushed, push_size),
                })
            }
        };
        if conn.send(&out).await.is_err() {
            return;
        }
    }
}

/// The channel the fan-out workload publishes to.
pub const FANOUT_CHANNEL: &str = "world";

/// The bench backend service (see the module docs).
#[derive(Debug)]
pub struct BenchService {
    push: Option<Duration>,
    push_size: usize,
    pushers: Mutex<HashMap<[u8; 16], tokio::task::AbortHandle>>,
    /// Fan-out workload: sessions join [`FANOUT_CHANNEL`] and one publisher publishes at
    /// the push rate (every member receives each publication) instead of a pusher per
    /// session.
    fanout: Option<Arc<FanoutPublisher>>,
}

/// The one publisher of the fan-out workload: publishes through any live session's link.
#[derive(Debug, Default)]
pub struct FanoutPublisher {
    sessions: Mutex<HashMap<[u8; 16], BackendSession>>,
    started: std::sync::atomic::AtomicBool,
}

impl FanoutPublisher {
    fn any_session(&self) -> Option<BackendSession> {
        self.sessions.lock().ok()?.values().next().cloned()
    }

    async fn run(self: Arc<Self>, period: Duration, size: usize) {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0u64;
        loop {
            t.tick().await;
            let Some(s) = self.any_session() else {
                continue;
            };
            n += 1;
            if let Err(e) = s
                .publish(FANOUT_CHANNEL, TrafficClass::Normal, push_payload(n, size))
                .await
            {
                tracing::debug!(error = %e, "publish failed");
                n -= 1;
            }
        }
    }
}

impl BenchService {
    /// A service pushing `push_rate` messages per second of `push_size` bytes to every
    /// session (0 = no pushes).
    pub fn new(push_rate: f64, push_size: usize) -> Self {
        Self {
            push: period(push_rate),
            push_size,
            pushers: Mutex::new(HashMap::new()),
            fanout: None,
        }
    }

    /// The fan-out variant: every session joins [`FANOUT_CHANNEL`]; `push_rate`
    /// publications per second go to all of them.
    pub fn fanout(push_rate: f64, push_size: usize) -> Self {
        Self {
            fanout: Some(Arc::default()),
            ..Self::new(push_rate, push_size)
        }
    }
}

#[async_trait]
impl Service for BenchService {
    async fn session_open(&self, session: &BackendSession) {
        let Some(p) = self.push else { return };
        if let Some(f) = &self.fanout {
            // Joined off the link's frame loop: a thousand sessions opening at once must
            // not hold up the FORWARDs behind them (the edge would answer them `busy`).
            let (f, s, size) = (f.clone(), session.clone(), self.push_size);
            tokio::spawn(async move {
                if let Err(e) = s.join_channel(FANOUT_CHANNEL, None).await {
                    tracing::warn!(error = %e, "fan-out join refused");
                    return;
                }
                if let Ok(mut m) = f.sessions.lock() {
                    m.insert(*s.session_id(), s.clone());
                }
                if !f.started.swap(true, Ordering::AcqRel) {
                    tokio::spawn(f.clone().run(p, size));
                }
            });
            return;
        }
        let s = session.clone();
        let size = self.push_size;
        let task = tokio::spawn(async move {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + p, p);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n = 0u64;
            loop {
                t.tick().await;
                n += 1;
                if let Err(e) = s
                    .push(PUSH, TrafficClass::Normal, push_payload(n, size))
                    .await
                {
                    tracing::debug!(error = %e, "push failed; pusher ends");
                    return;
                }
            }
        });
        if let Ok(mut m) = self.pushers.lock() {
            if let Some(old) = m.insert(*session.session_id(), task.abort_handle()) {
                old.abort();
            }
        }
    }

    async fn message(&self, session: &BackendSession, msg: Incoming) -> Result<(), Refusal> {
        // The same work as the demo backend's ECHO.
        if msg.msg_id != ECHO {
            return Err(Refusal {
                code: CloseCode::NoRoute,
                retry_after_ms: 0,
            });
        }
        let mut out = format!("{}|{}|", session.instance_id(), session.player_id()).into_bytes();
        out.extend_from_slice(&msg.payload);
        session
            .push(ECHO_REPLY, msg.class, Bytes::from(out))
            .await
            .map_err(|_| Refusal {
                code: CloseCode::Internal,
                retry_after_ms: 0,
            })
    }

    async fn session_closed(&self, session: &BackendSession, _code: CloseCode) {
        if let Some(f) = &self.fanout {
            if let Ok(mut m) = f.sessions.lock() {
                m.remove(session.session_id());
            }
        }
        if let Ok(mut m) = self.pushers.lock() {
            if let Some(t) = m.remove(session.session_id()) {
                t.abort();
            }
        }
    }
}

/// Runs the bench backend at `addr` until interrupted; prints
/// `{"event":"ready","backend":ADDR}`.
pub async fn run_backend(
    addr: SocketAddr,
    push_rate: f64,
    payload: usize,
    forward_credits: Option<u32>,
    fanout: bool,
) -> Result<(), String> {
    let mut config = BackendConfig::new("b1");
    if let Some(c) = forward_credits {
        config.forward_credits = c;
    }
    let service = if fanout {
        BenchService::fanout(push_rate, payload)
    } else {
        BenchService::new(push_rate, payload)
    };
    let backend = Backend::bind(addr, config, Arc::new(service))
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::json!({"event": "ready", "backend": backend.local_addr().to_string()})
    );
    tokio::signal::ctrl_c().await.map_err(|e| e.to_string())
}

//! The load generator: N sessions against one endpoint, each a task driving the sans-IO
//! [`ClientSession`] over `waygate_transport::endpoint::connect` (the lean client), or the
//! SDK [`Client`] for comparison. Phases are broadcast through a watch channel; counters are
//! atomics; latencies go into shared HDR histograms (one lock per sample, one worker thread).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use hdrhistogram::Histogram;
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;
use waygate_client::{Client, ClientOptions, Event};
use waygate_protocol::frame::WelcomeOutcome;
use waygate_session::auth::TokenClaims;
use waygate_session::client::{ClientConfig, ClientEvent, ClientSession};
use waygate_transport::endpoint::{connect, ConnectOptions, Endpoint};
use waygate_transport::{BoxConnection, CloseCode, TrafficClass};

use super::echo::{parse_push, unix_nanos, PUSH};
use waygate_backend::demo::{ECHO, ECHO_REPLY};
use waygate_edge::config::{DEV_KEY_ID, DEV_KEY_SECRET};
use waygate_protocol::channel::{ChannelEvent, ChannelEventKind, CHANNEL_EVENT_MSG_ID};

/// What the sessions do once connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Send ECHO at the rate (0 = closed loop, one outstanding per session); count pushes.
    Echo,
    /// Connect, then stay idle (heartbeats only): RSS per session, idle CPU.
    Idle,
    /// Connect as fast as the concurrency allows: sessions per second, CPU per new session.
    Connect,
    /// Every session drops its link at once and resumes: time to restore, loss, duplicates.
    Restore,
}

/// Which client implementation drives the sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientImpl {
    /// `ClientSession` + `connect`, one task per session.
    Lean,
    /// The SDK `Client` (a task per session plus channels).
    Sdk,
}

/// Reads named counters of the target (blocking; run off the runtime).
pub type SutCounters =
    std::sync::Arc<dyn Fn() -> std::collections::BTreeMap<String, u64> + Send + Sync>;

/// One load run.
#[derive(Clone)]
pub struct LoadSpec {
    /// Where to connect.
    pub endpoint: Endpoint,
    /// Transport options (trusted CA).
    pub connect: ConnectOptions,
    /// Sessions.
    pub sessions: usize,
    /// ECHO per second per session (0 = closed loop).
    pub rate: f64,
    /// ECHO payload bytes.
    pub payload: usize,
    /// Warm-up before measuring.
    pub warmup: Duration,
    /// Measurement window.
    pub duration: Duration,
    /// What sessions do.
    pub mode: Mode,
    /// Client implementation.
    pub client: ClientImpl,
    /// Connects in flight at once.
    pub concurrency: usize,
    /// Player id prefix (unique per run, so no run kicks another's sessions).
    pub player_prefix: String,
    /// The process under test (CPU and RSS).
    pub sut_pid: Option<u32>,
    /// Counters of the target read at the window's start and end (their differences land
    /// in [`LoadResult::sut_counters`]).
    pub counters: Option<SutCounters>,
}

/// What one load run measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LoadResult {
    /// Sessions welcomed.
    pub connected: u64,
    /// Sessions that failed to connect.
    pub connect_failed: u64,
    /// Measurement window, seconds.
    pub window_s: f64,
    /// ECHO round trips completed in the window.
    pub echoes: u64,
    /// Pushes received in the window.
    pub pushes: u64,
    /// Round trips (or pushes when there are no echoes) per second.
    pub msgs_per_s: f64,
    /// Round trip percentiles, microseconds.
    pub rtt_us: Percentiles,
    /// Push one-way latency percentiles, microseconds.
    pub push_us: Percentiles,
    /// CPU of the process under test per message (round trip, or push), microseconds.
    pub sut_cpu_us_per_msg: Option<f64>,
    /// CPU of the process under test in the window, percent of one core.
    pub sut_cpu_pct: Option<f64>,
    /// CPU of this load generator per message, microseconds.
    pub client_cpu_us_per_msg: Option<f64>,
    /// RSS of the process under test before connecting, KiB.
    pub sut_rss_before_kib: Option<u64>,
    /// RSS of the process under test with every session connected, KiB.
    pub sut_rss_kib: Option<u64>,
    /// (RSS after - before) / connected, KiB.
    pub rss_per_session_kib: Option<f64>,
    /// Connect mode: sessions welcomed per second.
    pub setups_per_s: Option<f64>,
    /// Connect mode: CPU of the process under test per new session, microseconds.
    pub sut_cpu_us_per_session: Option<f64>,
    /// Connect time (connect + HELLO/WELCOME) percentiles, microseconds.
    pub setup_us: Percentiles,
    /// Restore mode: time from the drop to WELCOME restored, microseconds.
    pub restore_us: Percentiles,
    /// Restore mode: time from the drop to the first push after the restore.
    pub replayed_us: Percentiles,
    /// Restore mode: sessions restored.
    pub restored: u64,
    /// Restore mode: sessions restored with a gap, given a new session, or not back
    /// within the window (after retrying as the SDK does).
    pub restore_failed: u64,
    /// Connect rounds retried after a refusal or a failed connect (initial connects outside
    /// the setup-rate workload, and resumes).
    pub resume_retries: u64,
    /// Pushes missing (counter gaps).
    pub lost: u64,
    /// Pushes received twice.
    pub duplicated: u64,
    /// Messages refused by the server (ERROR frames).
    pub refused: u64,
    /// Refusals by close code.
    pub refused_by_code: std::collections::BTreeMap<String, u64>,
    /// What [`LoadSpec::counters`] rose by in the window.
    pub sut_counters: std::collections::BTreeMap<String, u64>,
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Percentiles {
    /// Samples.
    pub n: u64,
    /// Median.
    pub p50: u64,
    /// 90th.
    pub p90: u64,
    /// 99th.
    pub p99: u64,
    /// 99.9th.
    pub p999: u64,
    /// Largest.
    pub max: u64,
}

impl Percentiles {
    fn of(h: &Histogram<u64>) -> Self {
        Self {
            n: h.len(),
            p50: h.value_at_quantile(0.5),
            p90: h.value_at_quantile(0.9),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            max: h.max(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connect,
    Warmup,
    Measure,
    Drop,
    Stop,
}

#[derive(Debug, Default)]
struct Counters {
    connected: AtomicU64,
    connect_failed: AtomicU64,
    echoes: AtomicU64,
    pushes: AtomicU64,
    restored: AtomicU64,
    restore_failed: AtomicU64,
    resume_retries: AtomicU64,
    lost: AtomicU64,
    duplicated: AtomicU64,
    refused: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

struct Hists {
    rtt: Histogram<u64>,
    push: Histogram<u64>,
    setup: Histogram<u64>,
    restore: Histogram<u64>,
    replayed: Histogram<u64>,
}

fn hist() -> Histogram<u64> {
    // 1 us .. 10 min, 3 significant digits; `saturating_record` clamps outliers.
    Histogram::new_with_bounds(1, 600_000_000, 3)
        .unwrap_or_else(|_| Histogram::new(3).unwrap_or_else(|_| unreachable!("valid sigfig")))
}

struct Ctx {
    spec: LoadSpec,
    base: Instant,
    phase: watch::Receiver<Phase>,
    recording: AtomicBool,
    drop_at: Mutex<Option<Instant>>,
    c: Counters,
    h: Mutex<Hists>,
    gate: Semaphore,
    codes: Mutex<std::collections::BTreeMap<String, u64>>,
}

impl Ctx {
    fn token(&self, idx: usize) -> Bytes {
        let now = unix_nanos() / 1_000_000_000;
        waygate_session::mint_token(
            DEV_KEY_ID,
            DEV_KEY_SECRET.as_bytes(),
            &TokenClaims {
                player_id: format!("{}-{idx}", self.spec.player_prefix),
                issuer: "waygate-bench".into(),
                issued_at: now,
                expires_at: now + 3600,
                extensions: Vec::new(),
            },
        )
        .unwrap_or_default()
    }

    fn refused(&self, code: CloseCode) {
        inc(&self.c.refused);
        if let Ok(mut c) = self.codes.lock() {
            *c.entry(code.as_str().to_string()).or_default() += 1;
        }
    }

    fn record(&self, f: impl FnOnce(&mut Hists)) {
        if let Ok(mut h) = self.h.lock() {
            f(&mut h);
        }
    }

    fn echo_payload(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(self.spec.payload.max(8));
        b.put_u64_le(self.base.elapsed().as_nanos() as u64);
        b.resize(self.spec.payload.max(8), 0x5a);
        b.freeze()
    }

    /// Handles a downstream message: ECHO_REPLY -> RTT, PUSH -> one-way latency and order.
    /// Returns whether it was an echo reply.
    fn on_message(&self, msg_id: u32, payload: &[u8], next_push: &mut u64) -> bool {
        let recording = self.recording.load(Ordering::Relaxed);
        match msg_id {
            ECHO_REPLY => {
                let sent_len = self.spec.payload.max(8);
                let off = payload.len().saturating_sub(sent_len);
                if let Some(ts) = payload
                    .get(off..off + 8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_le_bytes)
                {
                    if recording {
                        let now = self.base.elapsed().as_nanos() as u64;
                        let us = now.saturating_sub(ts) / 1000;
                        inc(&self.c.echoes);
                        self.record(|h| h.rtt.saturating_record(us.max(1)));
                    }
                }
                true
            }
            CHANNEL_EVENT_MSG_ID => {
                // Fan-out: a publication counts as a push, ordered by its offset; JOINED
                // says where this member's stream starts.
                let Ok(e) = ChannelEvent::decode(Bytes::copy_from_slice(payload)) else {
                    return false;
                };
                match e.kind {
                    ChannelEventKind::Joined | ChannelEventKind::HistoryLost => {
                        *next_push = e.position.offset + 1;
                    }
                    ChannelEventKind::Publication => {
                        self.on_push(e.position.offset, &e.body, next_push, recording);
                    }
                    _ => {}
                }
                false
            }
            PUSH => {
                if let Some((n, _)) = parse_push(payload) {
                    self.on_push(n, payload, next_push, recording);
                }
                false
            }
            _ => false,
        }
    }

    /// One push (or publication) numbered `n`: order check, count, one-way latency.
    fn on_push(&self, n: u64, payload: &[u8], next_push: &mut u64, recording: bool) {
        let Some((_, t)) = parse_push(payload) else {
            return;
        };
        if n == *next_push {
            *next_push += 1;
        } else if n > *next_push {
            self.c.lost.fetch_add(n - *next_push, Ordering::Relaxed);
            *next_push = n + 1;
        } else {
            inc(&self.c.duplicated);
        }
        if recording {
            inc(&self.c.pushes);
            let us = unix_nanos().saturating_sub(t) / 1000;
            self.record(|h| h.push.saturating_record(us.max(1)));
        }
    }
}

/// Runs one load run and returns what it measured.
pub async fn run(spec: LoadSpec) -> LoadResult {
    let (phase_tx, phase_rx) = watch::channel(Phase::Connect);
    let concurrency = spec.concurrency.max(1);
    let ctx = Arc::new(Ctx {
        base: Instant::now(),
        phase: phase_rx,
        recording: AtomicBool::new(false),
        drop_at: Mutex::new(None),
        c: Counters::default(),
        h: Mutex::new(Hists {
            rtt: hist(),
            push: hist(),
            setup: hist(),
            restore: hist(),
            replayed: hist(),
        }),
        gate: Semaphore::new(concurrency),
        codes: Mutex::new(std::collections::BTreeMap::new()),
        spec,
    });
    let spec = &ctx.spec;
    let sut = spec.sut_pid;
    let rss_before = sut.and_then(super::procs::rss_kib);
    let mut result = LoadResult {
        sut_rss_before_kib: rss_before,
        ..LoadResult::default()
    };

    let setup_counters = if spec.mode == Mode::Connect {
        read_counters(spec.counters.clone()).await
    } else {
        Default::default()
    };
    let setup_mark = super::procs::CpuMark::now(sut);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..spec.sessions {
        let ctx = ctx.clone();
        match spec.client {
            ClientImpl::Lean => tasks.spawn(lean_session(ctx, i)),
            ClientImpl::Sdk => tasks.spawn(sdk_session(ctx, i)),
        };
    }
    // Wait until every session connected or failed (bounded).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = get(&ctx.c.connected) + get(&ctx.c.connect_failed);
        if done >= spec.sessions as u64 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let setup_end = super::procs::CpuMark::now(sut);
    result.connected = get(&ctx.c.connected);
    result.connect_failed = get(&ctx.c.connect_failed);
    if spec.mode == Mode::Connect {
        let (el, sut_us, _) = setup_mark.since(&setup_end);
        let n = result.connected.max(1) as f64;
        result.setups_per_s = Some(result.connected as f64 / el.as_secs_f64());
        result.sut_cpu_us_per_session = sut_us.map(|u| u as f64 / n);
        result.window_s = el.as_secs_f64();
        let after = read_counters(spec.counters.clone()).await;
        result.sut_counters = counters_rise(&setup_counters, after);
    } else {
        let _ = phase_tx.send(Phase::Warmup);
        tokio::time::sleep(spec.warmup).await;
        if spec.mode == Mode::Restore {
            // Pushes flow during the warm-up; now every link drops at once.
            ctx.recording.store(true, Ordering::Relaxed);
            *ctx.drop_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
            let _ = phase_tx.send(Phase::Drop);
            tokio::time::sleep(spec.duration).await;
        } else {
            let before = read_counters(spec.counters.clone()).await;
            let mark = super::procs::CpuMark::now(sut);
            ctx.recording.store(true, Ordering::Relaxed);
            let _ = phase_tx.send(Phase::Measure);
            tokio::time::sleep(spec.duration).await;
            ctx.recording.store(false, Ordering::Relaxed);
            let end = super::procs::CpuMark::now(sut);
            let after = read_counters(spec.counters.clone()).await;
            result.sut_counters = counters_rise(&before, after);
            let (el, sut_us, own_us) = mark.since(&end);
            result.window_s = el.as_secs_f64();
            result.echoes = get(&ctx.c.echoes);
            result.pushes = get(&ctx.c.pushes);
            let msgs = if result.echoes > 0 {
                result.echoes
            } else {
                result.pushes
            };
            result.msgs_per_s = msgs as f64 / result.window_s;
            if msgs > 0 {
                result.sut_cpu_us_per_msg = sut_us.map(|u| u as f64 / msgs as f64);
                result.client_cpu_us_per_msg = own_us.map(|u| u as f64 / msgs as f64);
            }
            result.sut_cpu_pct = sut_us.map(|u| u as f64 / el.as_micros() as f64 * 100.0);
        }
    }
    result.sut_rss_kib = sut.and_then(super::procs::rss_kib);
    if let (Some(a), Some(b)) = (result.sut_rss_kib, rss_before) {
        if result.connected > 0 {
            result.rss_per_session_kib = Some((a as f64 - b as f64) / result.connected as f64);
        }
    }
    let _ = phase_tx.send(Phase::Stop);
    let drain = tokio::time::timeout(Duration::from_secs(20), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drain.is_err() {
        tasks.abort_all();
    }
    result.restored = get(&ctx.c.restored);
    result.restore_failed = get(&ctx.c.restore_failed);
    result.resume_retries = get(&ctx.c.resume_retries);
    result.lost = get(&ctx.c.lost);
    result.duplicated = get(&ctx.c.duplicated);
    result.refused = get(&ctx.c.refused);
    if let Ok(c) = ctx.codes.lock() {
        result.refused_by_code = c.clone();
    }
    if let Ok(h) = ctx.h.lock() {
        result.rtt_us = Percentiles::of(&h.rtt);
        result.push_us = Percentiles::of(&h.push);
        result.setup_us = Percentiles::of(&h.setup);
        result.restore_us = Percentiles::of(&h.restore);
        result.replayed_us = Percentiles::of(&h.replayed);
    }
    result
}

async fn read_counters(c: Option<SutCounters>) -> BTreeMap<String, u64> {
    match c {
        Some(c) => tokio::task::spawn_blocking(move || c())
            .await
            .unwrap_or_default(),
        None => BTreeMap::new(),
    }
}

/// What each counter rose by from `before` to `after` (counters missing in either, or
/// that went down, are left out).
fn counters_rise(
    before: &BTreeMap<String, u64>,
    after: BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .into_iter()
        .filter_map(|(k, v)| Some((k.clone(), v.checked_sub(*before.get(&k)?)?)))
        .collect()
}

fn now() -> std::time::Instant {
    Instant::now().into_std()
}

async fn flush(conn: &mut BoxConnection, cs: &mut ClientSession) -> Result<(), CloseCode> {
    let mut frames = Vec::new();
    while let Some(f) = cs.poll_transmit() {
        frames.push(f);
    }
    if frames.is_empty() {
        return Ok(());
    }
    conn.send_batch(&frames).await.map_err(|e| e.close_code())
}

/// Connects and runs the handshake; returns the connection and WELCOME's outcome. Events
/// after the WELCOME stay queued in `cs`.
/// Why a connect round did not end in WELCOME.
#[derive(Debug)]
enum ConnectError {
    /// REJECT: try again after the hint unless terminal.
    Rejected {
        code: CloseCode,
        retry_after_ms: u32,
        terminal: bool,
    },
    /// The transport or the handshake failed.
    Failed(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Rejected { code, .. } => write!(f, "rejected: {code}"),
            Self::Failed(e) => f.write_str(e),
        }
    }
}

async fn connect_welcome(
    ctx: &Ctx,
    cs: &mut ClientSession,
) -> Result<(BoxConnection, WelcomeOutcome), ConnectError> {
    let failed = |e: String| ConnectError::Failed(e);
    let mut conn = connect(&ctx.spec.endpoint, &ctx.spec.connect)
        .await
        .map_err(|e| failed(e.to_string()))?;
    cs.connect(now()).map_err(|e| failed(e.to_string()))?;
    flush(&mut conn, cs)
        .await
        .map_err(|c| failed(c.to_string()))?;
    loop {
        let f = conn.recv().await.map_err(|e| failed(e.to_string()))?;
        cs.handle_frame(now(), f)
            .map_err(|e| failed(e.to_string()))?;
        flush(&mut conn, cs)
            .await
            .map_err(|c| failed(c.to_string()))?;
        while let Some(ev) = cs.poll_event() {
            match ev {
                ClientEvent::Welcomed { outcome, .. } => return Ok((conn, outcome)),
                ClientEvent::Rejected {
                    code,
                    retry_after_ms,
                    terminal,
                } => {
                    return Err(ConnectError::Rejected {
                        code,
                        retry_after_ms,
                        terminal,
                    })
                }
                _ => {}
            }
        }
    }
}

/// Connects (or resumes after a link loss) like the SDK does: connect rounds until WELCOME, a refusal
/// honoured (its retry-after at least) and failures backed off with full jitter (100 ms
/// doubling to 5 s, the SDK's defaults), until `deadline`. Counts every retry.
async fn resume_until(
    ctx: &Ctx,
    cs: &mut ClientSession,
    deadline: Instant,
) -> Result<(BoxConnection, WelcomeOutcome), ConnectError> {
    use rand::RngExt as _;
    let mut failures: u32 = 0;
    loop {
        let err = match connect_welcome(ctx, cs).await {
            Ok(up) => return Ok(up),
            Err(e) => e,
        };
        // The session lingers on the edge; the client forgets this attempt's link.
        cs.handle_link_down(now(), CloseCode::GoingAway);
        let at_least = match &err {
            ConnectError::Rejected { terminal: true, .. } => return Err(err),
            ConnectError::Rejected { retry_after_ms, .. } => u64::from(*retry_after_ms),
            ConnectError::Failed(_) => 0,
        };
        failures = failures.saturating_add(1);
        let cap = (100u64 << failures.min(6)).min(5_000);
        let wait = Duration::from_millis(rand::rng().random_range(0..=cap).max(at_least));
        if Instant::now() + wait >= deadline {
            return Err(err);
        }
        inc(&ctx.c.resume_retries);
        tokio::time::sleep(wait).await;
    }
}

fn sending(p: Phase) -> bool {
    matches!(p, Phase::Warmup | Phase::Measure)
}

async fn lean_session(ctx: Arc<Ctx>, idx: usize) {
    let spec = &ctx.spec;
    let mut cs = ClientSession::new(ctx.token(idx), ClientConfig::default());
    let t0 = Instant::now();
    let conn = {
        let _permit = ctx.gate.acquire().await;
        if spec.mode == Mode::Connect {
            // The setup-rate workload measures single attempts: a refusal is a data point.
            connect_welcome(&ctx, &mut cs).await
        } else {
            // The others need their sessions: retried as the SDK does (refusals with their
            // retry-after, failures with backoff), for up to 60 s.
            resume_until(&ctx, &mut cs, Instant::now() + Duration::from_secs(60)).await
        }
    };
    let mut conn = match conn {
        Ok((c, _)) => c,
        Err(e) => {
            tracing::debug!(idx, error = %e, "bench session failed to connect");
            inc(&ctx.c.connect_failed);
            return;
        }
    };
    ctx.record(|h| h.setup.saturating_record(t0.elapsed().as_micros() as u64));
    inc(&ctx.c.connected);
    let mut phase_rx = ctx.phase.clone();
    let period = (spec.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / spec.rate));
    let mut ticker = period.map(|p| {
        // Spread the sessions' send times over one period.
        let offset = p.mul_f64((idx % 997) as f64 / 997.0);
        let mut t = tokio::time::interval_at(Instant::now() + offset, p);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    let closed_loop = spec.mode == Mode::Echo && period.is_none();
    let mut outstanding = false;
    let mut next_push = 1u64;
    if matches!(spec.mode, Mode::Idle | Mode::Restore) {
        // One message opens the session on the backend (the edge opens it on the first
        // forward), so the backend knows it and can push to it.
        let _ = cs.send(now(), TrafficClass::Normal, ECHO, ctx.echo_payload());
    }
    let mut awaiting_replay: Option<Instant> = None;
    let mut dropped = false;
    loop {
        let phase = *phase_rx.borrow_and_update();
        if phase == Phase::Stop {
            break;
        }
        // Events first (some may be queued from the handshake).
        while let Some(ev) = cs.poll_event() {
            match ev {
                ClientEvent::Message {
                    msg_id, payload, ..
                } => {
                    if ctx.on_message(msg_id, &payload, &mut next_push) {
                        outstanding = false;
                    } else if msg_id == PUSH {
                        if let Some(at) = awaiting_replay.take() {
                            ctx.record(|h| {
                                h.replayed
                                    .saturating_record(at.elapsed().as_micros() as u64)
                            });
                        }
                    }
                }
                ClientEvent::Error(e) => {
                    ctx.refused(e.code);
                    outstanding = false;
                }
                _ => {}
            }
        }
        // After the events above (the pushes the session has taken are counted first).
        // Acted on by value, once: a change seen here (borrow_and_update marks it seen)
        // never fires `changed()` again, so a session busy when the phase turned to Drop
        // used to miss it and never drop (W7's "not restored" stragglers).
        if phase == Phase::Drop && spec.mode == Mode::Restore && !dropped {
            dropped = true;
            // Drop the link without a CLOSE, as a network failure would; resume.
            drop(conn);
            cs.handle_link_down(now(), CloseCode::GoingAway);
            let drop_at = ctx
                .drop_at
                .lock()
                .ok()
                .and_then(|d| *d)
                .unwrap_or_else(Instant::now);
            match resume_until(&ctx, &mut cs, drop_at + spec.duration).await {
                Ok((c, outcome)) => {
                    conn = c;
                    if outcome == WelcomeOutcome::Restored {
                        inc(&ctx.c.restored);
                        ctx.record(|h| {
                            h.restore
                                .saturating_record(drop_at.elapsed().as_micros() as u64)
                        });
                        awaiting_replay = Some(drop_at);
                    } else {
                        inc(&ctx.c.restore_failed);
                    }
                }
                Err(e) => {
                    tracing::debug!(idx, error = %e, "resume failed");
                    inc(&ctx.c.restore_failed);
                    return;
                }
            }
        }
        if closed_loop
            && sending(phase)
            && !outstanding
            && cs
                .send(now(), TrafficClass::Normal, ECHO, ctx.echo_payload())
                .is_ok()
        {
            outstanding = true;
        }
        if flush(&mut conn, &mut cs).await.is_err() {
            break;
        }
        let timer = cs.poll_timeout().map(Instant::from_std);
        tokio::select! {
            // A phase change only wakes the loop: the loop top acts on the phase itself.
            r = phase_rx.changed() => {
                if r.is_err() { break; }
            }
            _ = async { match ticker.as_mut() { Some(t) => { t.tick().await; } None => std::future::pending().await } }, if sending(phase) && spec.mode == Mode::Echo && !closed_loop => {
                let _ = cs.send(now(), TrafficClass::Normal, ECHO, ctx.echo_payload());
            }
            f = conn.recv() => match f {
                Ok(frame) => { let _ = cs.handle_frame(now(), frame); }
                Err(e) => {
                    tracing::debug!(idx, error = %e, "bench session lost its link");
                    return;
                }
            },
            () = async { match timer { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => {
                cs.handle_timeout(now());
            }
        }
    }
    conn.close(CloseCode::Normal, "bench done").await;
}

async fn sdk_session(ctx: Arc<Ctx>, idx: usize) {
    let spec = &ctx.spec;
    let mut opts = ClientOptions::new(vec![spec.endpoint.clone()], ctx.token(idx));
    opts.connect = spec.connect.clone();
    let t0 = Instant::now();
    let permit = ctx.gate.acquire().await;
    let mut client = Client::start(opts);
    let up = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match client.next_event().await {
                Some(Event::Connected { .. }) => return true,
                Some(Event::Closed { .. }) | None => return false,
                Some(_) => {}
            }
        }
    })
    .await;
    drop(permit);
    if up != Ok(true) {
        inc(&ctx.c.connect_failed);
        return;
    }
    ctx.record(|h| h.setup.saturating_record(t0.elapsed().as_micros() as u64));
    inc(&ctx.c.connected);
    let mut phase_rx = ctx.phase.clone();
    let period = (spec.rate > 0.0).then(|| Duration::from_secs_f64(1.0 / spec.rate));
    let mut ticker = period.map(|p| {
        let offset = p.mul_f64((idx % 997) as f64 / 997.0);
        let mut t = tokio::time::interval_at(Instant::now() + offset, p);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    let closed_loop = spec.mode == Mode::Echo && period.is_none();
    let mut outstanding = false;
    let mut next_push = 1u64;
    loop {
        let phase = *phase_rx.borrow_and_update();
        if phase == Phase::Stop {
            break;
        }
        if closed_loop && sending(phase) && !outstanding {
            if client
                .send(TrafficClass::Normal, ECHO, ctx.echo_payload())
                .await
                .is_err()
            {
                break;
            }
            outstanding = true;
        }
        tokio::select! {
            r = phase_rx.changed() => if r.is_err() { break },
            _ = async { match ticker.as_mut() { Some(t) => { t.tick().await; } None => std::future::pending().await } }, if sending(phase) && spec.mode == Mode::Echo && !closed_loop => {
                let _ = client.send(TrafficClass::Normal, ECHO, ctx.echo_payload()).await;
            }
            ev = client.next_event() => match ev {
                Some(Event::Message { msg_id, payload, .. }) => {
                    if ctx.on_message(msg_id, &payload, &mut next_push) {
                        outstanding = false;
                    }
                }
                Some(Event::Error(e)) => { ctx.refused(e.code); outstanding = false; }
                Some(Event::Closed { .. }) | None => break,
                Some(_) => {}
            }
        }
    }
    client.close().await;
}

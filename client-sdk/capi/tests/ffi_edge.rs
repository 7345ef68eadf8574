//! The C functions called from Rust against an in-process edge: an echo round trip with
//! the payload pointer, stats, a kick by a second login (terminal event, then
//! `WAYGATE_CLOSED` everywhere), and a local close.

#![allow(unsafe_code)] // It calls the C functions; every block has a `// SAFETY:` comment.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

mod common;

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use common::token_bytes;
use waygate_client_capi::waygate_event_kind::*;
use waygate_client_capi::waygate_outcome::*;
use waygate_client_capi::waygate_result::*;
use waygate_client_capi::*;
use waygate_transport::TransportKind;

/// A handle, freed on drop (also when an assertion fails).
struct Handle(*mut waygate_client);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and used by this thread only; it is not used again.
        unsafe { waygate_client_free(self.0) };
    }
}

fn new_client(endpoint: &str, token: &[u8]) -> Handle {
    new_client_with_key(endpoint, token, None)
}

fn new_client_with_key(endpoint: &str, token: &[u8], session_key: Option<&[u8; 32]>) -> Handle {
    new_client_with(endpoint, token, |o| {
        if let Some(key) = session_key {
            o.session_key = key.as_ptr();
        }
    })
}

/// A client whose options `tune` adjusts (pointers it sets must outlive this call).
fn new_client_with(
    endpoint: &str,
    token: &[u8],
    tune: impl FnOnce(&mut waygate_options),
) -> Handle {
    let endpoints = std::ffi::CString::new(endpoint).unwrap();
    let mut o = MaybeUninit::uninit();
    // SAFETY: `o` is writable; init fills every field; the pointers set below outlive
    // `waygate_client_new`, which copies them.
    let client = unsafe {
        waygate_options_init(o.as_mut_ptr(), std::mem::size_of::<waygate_options>());
        let mut o = o.assume_init();
        o.endpoints = endpoints.as_ptr();
        o.token = token.as_ptr();
        o.token_len = token.len();
        tune(&mut o);
        waygate_client_new(&o)
    };
    assert!(!client.is_null());
    Handle(client)
}

/// An owned copy of an event.
#[derive(Debug)]
struct Ev {
    kind: waygate_event_kind,
    code: u16,
    msg_id: u32,
    seq: u64,
    payload: Vec<u8>,
    text: String,
    channel: (u64, u64),
    outcome: waygate_outcome,
    request_id: u32,
}

/// Waits up to 10 s for the next event; `Err` carries the result code when none came.
fn next(h: &Handle) -> Result<Ev, waygate_result> {
    let mut ev = MaybeUninit::<waygate_event>::zeroed();
    // SAFETY: `ev` is writable; its `struct_size` is set as the API asks.
    unsafe { (*ev.as_mut_ptr()).struct_size = std::mem::size_of::<waygate_event>() };
    // SAFETY: live handle, writable `ev`.
    let r = unsafe { waygate_client_wait_event(h.0, 10_000, ev.as_mut_ptr()) };
    // SAFETY: the call always writes `ev` (all of it: its size is this library's).
    let ev = unsafe { ev.assume_init() };
    if r != WAYGATE_OK {
        assert_eq!(ev.kind, WAYGATE_EVENT_NONE);
        return Err(r);
    }
    let payload = if ev.payload.is_null() {
        Vec::new()
    } else {
        // SAFETY: valid until the next poll on this handle; copied now.
        unsafe { std::slice::from_raw_parts(ev.payload, ev.payload_len) }.to_vec()
    };
    // SAFETY: `text` is never NULL and valid until the next poll.
    let text = unsafe { CStr::from_ptr(ev.text) }
        .to_string_lossy()
        .into_owned();
    Ok(Ev {
        kind: ev.kind,
        code: ev.code,
        msg_id: ev.msg_id,
        seq: ev.seq,
        payload,
        text,
        channel: (ev.channel_epoch, ev.channel_offset),
        outcome: ev.outcome,
        request_id: ev.request_id,
    })
}

fn wait_for(h: &Handle, kind: waygate_event_kind) -> Ev {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        match next(h) {
            Ok(ev) if ev.kind == kind => return ev,
            Ok(_) => {}
            Err(WAYGATE_NO_EVENT) => {}
            Err(other) => panic!("waiting for {kind:?}: {other:?}"),
        }
    }
    panic!("no {kind:?} in time");
}

/// Waits for the next session up with `outcome`.
fn wait_for_outcome(h: &Handle, outcome: waygate_outcome) -> Ev {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let ev = wait_for(h, WAYGATE_EVENT_CONNECTED);
        if ev.outcome == outcome {
            return ev;
        }
    }
    panic!("no session up with {outcome:?} in time");
}

fn send(h: &Handle, msg_id: u32, body: &[u8]) -> Result<u64, waygate_result> {
    let mut seq = 0;
    // SAFETY: live handle; `body` readable for its length; `seq` writable.
    let r = unsafe {
        waygate_client_send(
            h.0,
            WAYGATE_CLASS_NORMAL,
            msg_id,
            body.as_ptr(),
            body.len(),
            &mut seq,
        )
    };
    if r == WAYGATE_OK {
        Ok(seq)
    } else {
        Err(r)
    }
}

/// An in-process edge and its backends on their own runtime (the C functions run their own
/// client thread; this test thread must not be a runtime).
struct System {
    endpoint: String,
    cluster: Option<common::Cluster>,
    rt: Option<tokio::runtime::Runtime>,
    _dir: tempfile::TempDir,
}

impl System {
    fn start() -> Self {
        Self::start_with(|_| {})
    }

    fn start_with(tune: impl FnOnce(&mut waygate_edge::config::EdgeConfig)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let c = rt.block_on(common::cluster_with(dir.path(), tune));
        let endpoint = format!("tcp://{}", c.edge.addrs[&TransportKind::Tcp]);
        Self {
            endpoint,
            cluster: Some(c),
            rt: Some(rt),
            _dir: dir,
        }
    }
}

impl Drop for System {
    fn drop(&mut self) {
        drop(self.cluster.take());
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

#[test]
fn echo_kick_and_close_through_the_c_functions() {
    let system = System::start();
    let endpoint = system.endpoint.clone();

    let first = new_client(&endpoint, &token_bytes("ffi-player"));
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(first.0) }, WAYGATE_OK);
    // SAFETY: live handle.
    assert_eq!(
        unsafe { waygate_client_state(first.0) },
        waygate_state::WAYGATE_STATE_CONNECTING
    );
    let connected = wait_for(&first, WAYGATE_EVENT_CONNECTED);
    assert_eq!(connected.text, endpoint);
    assert_eq!(connected.outcome, WAYGATE_OUTCOME_NEW_SESSION);
    // SAFETY: live handle.
    assert_eq!(
        unsafe { waygate_client_state(first.0) },
        waygate_state::WAYGATE_STATE_CONNECTED
    );
    assert_eq!(send(&first, 1000, b"hello"), Ok(1));
    let reply = wait_for(&first, WAYGATE_EVENT_MESSAGE);
    assert_eq!(reply.msg_id, 1001);
    assert_eq!(reply.seq, 1);
    assert_eq!(reply.payload, b"b1|ffi-player|hello");
    let mut stats = MaybeUninit::uninit();
    // SAFETY: live handle, writable `stats`.
    assert_eq!(
        unsafe { waygate_client_stats(first.0, stats.as_mut_ptr()) },
        WAYGATE_OK
    );
    // SAFETY: written by the call above.
    let stats = unsafe { stats.assume_init() };
    assert_eq!(stats.connects, 1);
    assert_eq!(stats.last_server_seq, 1);

    // A second login of the same player takes over: the first gets a terminal KICKED.
    let second = new_client(&endpoint, &token_bytes("ffi-player"));
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(second.0) }, WAYGATE_OK);
    wait_for(&second, WAYGATE_EVENT_CONNECTED);
    let kicked = wait_for(&first, WAYGATE_EVENT_KICKED);
    assert_eq!((kicked.code, kicked.text.as_str()), (301, "kicked"));
    assert_eq!(next(&first).unwrap_err(), WAYGATE_CLOSED);
    assert_eq!(send(&first, 1000, b"late"), Err(WAYGATE_CLOSED));
    // SAFETY: live handle.
    assert_eq!(
        unsafe { waygate_client_state(first.0) },
        waygate_state::WAYGATE_STATE_CLOSED
    );
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_tick(first.0, 0) }, WAYGATE_CLOSED);

    // A lifecycle hook: reconnect now (the app came back from the background) resumes.
    // SAFETY: live handle.
    assert_eq!(
        unsafe { waygate_client_reconnect_now(second.0) },
        WAYGATE_OK
    );
    wait_for_outcome(&second, WAYGATE_OUTCOME_RESTORED);
    // SAFETY: a closed handle answers CLOSED.
    assert_eq!(
        unsafe { waygate_client_reconnect_now(first.0) },
        WAYGATE_CLOSED
    );

    // The second session works, then closes locally.
    assert_eq!(send(&second, 1000, b"again"), Ok(1));
    assert_eq!(
        wait_for(&second, WAYGATE_EVENT_MESSAGE).payload,
        b"b1|ffi-player|again"
    );
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_close(second.0) }, WAYGATE_OK);
    let closed = wait_for(&second, WAYGATE_EVENT_CLOSED);
    assert_eq!(closed.text, "normal");
    assert_eq!(next(&second).unwrap_err(), WAYGATE_CLOSED);
    drop((first, second));
    drop(system);
}

/// A sealed KCP session through the C functions (hardening item 4, PROTOCOL.md §8.9): a
/// connect token and its session key in the options; the echo round trip works and the edge
/// counts the session as sealed.
/// Requests and the clock (SDK issue item 9) through the C functions: the request returns
/// its id at once; its answer, or its failure, is an event with that id.
#[test]
fn requests_and_the_clock_through_the_c_functions() {
    let system = System::start();
    let h = new_client(&system.endpoint, &token_bytes("ffi-asker"));
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(h.0) }, WAYGATE_OK);
    wait_for(&h, WAYGATE_EVENT_CONNECTED);
    let mut id = 0u32;
    // SAFETY: live handle; the body is readable for its length; `id` is writable.
    let r = unsafe {
        waygate_client_request(
            h.0,
            WAYGATE_CLASS_NORMAL,
            1011,
            b"why".as_ptr(),
            3,
            10_000,
            &mut id,
        )
    };
    assert_eq!(r, WAYGATE_OK);
    let answer = wait_for(&h, WAYGATE_EVENT_ANSWER);
    assert_eq!((answer.request_id, answer.code), (id, 0));
    assert_eq!(answer.payload, b"b1|ffi-asker|why");
    // Unanswered (ECHO is not a request): REQUEST_FAILED "timeout" with its id.
    // SAFETY: as above.
    let r = unsafe {
        waygate_client_request(
            h.0,
            WAYGATE_CLASS_NORMAL,
            1000,
            b"x".as_ptr(),
            1,
            200,
            &mut id,
        )
    };
    assert_eq!(r, WAYGATE_OK);
    let failed = wait_for(&h, WAYGATE_EVENT_REQUEST_FAILED);
    assert_eq!((failed.request_id, failed.text.as_str()), (id, "timeout"));
    // A best-effort request is refused at once.
    // SAFETY: as above.
    let r = unsafe {
        waygate_client_request(
            h.0,
            WAYGATE_CLASS_BEST_EFFORT,
            1011,
            std::ptr::null(),
            0,
            200,
            &mut id,
        )
    };
    assert_eq!(r, WAYGATE_INVALID_ARGUMENT);
    // The clock: no estimate before a sample; one after its answer.
    let (mut offset, mut rtt) = (0i64, 0u64);
    // SAFETY: live handle; writable outputs.
    assert_eq!(
        unsafe { waygate_client_clock_offset(h.0, &mut offset, &mut rtt) },
        WAYGATE_NOT_FOUND
    );
    // SAFETY: as above.
    assert_eq!(
        unsafe { waygate_client_sync_clock(h.0, 1010, 10_000, &mut id) },
        WAYGATE_OK
    );
    assert_eq!(wait_for(&h, WAYGATE_EVENT_ANSWER).request_id, id);
    // SAFETY: as above.
    assert_eq!(
        unsafe { waygate_client_clock_offset(h.0, &mut offset, &mut rtt) },
        WAYGATE_OK
    );
    let bound = i64::try_from(rtt / 1000).unwrap() / 2 + 2;
    assert!(offset.abs() <= bound, "offset {offset} ms, rtt {rtt} us");
    // Pause (to the background) and resume.
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_pause(h.0) }, WAYGATE_OK);
    // SAFETY: live handle.
    assert_eq!(
        unsafe { waygate_client_state(h.0) },
        waygate_state::WAYGATE_STATE_PAUSED
    );
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_reconnect_now(h.0) }, WAYGATE_OK);
    wait_for_outcome(&h, WAYGATE_OUTCOME_RESTORED);
}

/// The network simulator through the C options: 10% of frames lost (delayed as
/// retransmitted), latency and jitter, and the link dropped half way: every echo answered
/// exactly once, in order.
#[test]
fn a_resume_at_ten_percent_simulated_loss_through_the_c_functions() {
    let system = System::start();
    let h = new_client_with(&system.endpoint, &token_bytes("ffi-lossy"), |o| {
        o.sim_latency_ms = 10;
        o.sim_jitter_ms = 10;
        o.sim_loss_permille = 100;
        o.sim_seed = 7;
    });
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(h.0) }, WAYGATE_OK);
    wait_for(&h, WAYGATE_EVENT_CONNECTED);
    for i in 0..40u32 {
        send(&h, 1000, i.to_string().as_bytes()).unwrap();
        if i == 20 {
            // SAFETY: live handle.
            assert_eq!(unsafe { waygate_client_drop_link(h.0) }, WAYGATE_OK);
        }
    }
    let mut got = Vec::new();
    let mut restored = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < 40 && Instant::now() < deadline {
        match next(&h) {
            Ok(ev) if ev.kind == WAYGATE_EVENT_MESSAGE => {
                let text = String::from_utf8(ev.payload).unwrap();
                got.push(text.rsplit('|').next().unwrap().parse::<u32>().unwrap());
            }
            Ok(ev) if ev.kind == WAYGATE_EVENT_CONNECTED => {
                restored |= ev.outcome == WAYGATE_OUTCOME_RESTORED;
            }
            _ => {}
        }
    }
    assert_eq!(got, (0..40).collect::<Vec<_>>(), "exactly once, in order");
    assert!(restored);
}

#[test]
fn a_sealed_kcp_session_through_the_c_functions() {
    let system = System::start();
    let cluster = system.cluster.as_ref().unwrap();
    let kcp = format!("kcp://{}", cluster.edge.addrs[&TransportKind::Kcp]);
    let key = [0x5Au8; 32];
    let token = common::connect_token_bytes("ffi-sealed", &key);
    let client = new_client_with_key(&kcp, &token, Some(&key));
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(client.0) }, WAYGATE_OK);
    wait_for(&client, WAYGATE_EVENT_CONNECTED);
    assert_eq!(send(&client, 1000, b"sealed"), Ok(1));
    assert_eq!(
        wait_for(&client, WAYGATE_EVENT_MESSAGE).payload,
        b"b1|ffi-sealed|sealed"
    );
    let metrics = cluster.edge.admin().metrics_text();
    let sealed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("waygate_kcp_sealed_sessions_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert_eq!(sealed, Some(1.0), "{metrics}");
    drop(client);
    drop(system);
}

/// A failed connect attempt through the C functions (SDK issue item 3): the TLS endpoint
/// first (its certificate is not trusted: no CA given), then TCP. A
/// `WAYGATE_EVENT_CONNECT_FAILED` names the endpoint and the reason before `CONNECTED`.
#[test]
fn a_failed_connect_attempt_through_the_c_functions() {
    let system = System::start();
    let cluster = system.cluster.as_ref().unwrap();
    let endpoints = format!(
        "tls://localhost:{},{}",
        cluster.edge.addrs[&TransportKind::Tls].port(),
        system.endpoint
    );
    let client = new_client(&endpoints, &token_bytes("ffi-failure"));
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(client.0) }, WAYGATE_OK);
    let failed = wait_for(&client, WAYGATE_EVENT_CONNECT_FAILED);
    assert!(
        failed.text.starts_with("tls://localhost:"),
        "{}",
        failed.text
    );
    assert_eq!(failed.seq, 1, "the first round");
    let connected = wait_for(&client, WAYGATE_EVENT_CONNECTED);
    assert_eq!(connected.text, system.endpoint);
    drop(client);
    drop(system);
}

/// SDK issue item 4: a C caller that stops polling never blocks. It sends 5,000 echoes, then
/// reads nothing for 3 s while the replies pile up past the 4,096-event queue, then sends
/// again: every `waygate_client_send` returns at once (`WAYGATE_OK`, or
/// `WAYGATE_BUFFER_FULL` while 4,096 are unacked), and afterwards every message is answered
/// (a reply, or ERROR busy when the backend had no room) or a gap is reported. Before, the worker waited for room in the full event queue while `send` waited for
/// the worker: a deadlock (the watchdog ends the test process).
#[test]
fn a_caller_that_does_not_poll_never_blocks_in_send() {
    let system = System::start_with(|c| {
        c.backpressure.inbound_msgs_per_sec = 1_000_000;
        c.backpressure.inbound_msg_burst = 1_000_000;
    });
    let client = new_client(&system.endpoint, &token_bytes("ffi-no-poll"));
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(client.0) }, WAYGATE_OK);
    wait_for(&client, WAYGATE_EVENT_CONNECTED);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            for _ in 0..600 {
                if done.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!("waygate_client_send blocked for 60 s: deadlock");
            std::process::exit(1);
        })
    };
    let (mut ok, mut full) = (0u32, 0u32);
    let mut slowest = Duration::ZERO;
    let mut send_some = |from: u32, to: u32| {
        for i in from..to {
            let t = Instant::now();
            match send(&client, 1000, format!("m{i}").as_bytes()) {
                Ok(_) => ok += 1,
                Err(WAYGATE_BUFFER_FULL) => full += 1,
                Err(other) => panic!("send {i}: {other:?}"),
            }
            slowest = slowest.max(t.elapsed());
        }
    };
    send_some(0, 5_000);
    // The game stalls (a level load): nothing is polled while the replies arrive.
    std::thread::sleep(Duration::from_secs(3));
    send_some(5_000, 5_100);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = watchdog.join();
    eprintln!(
        "sends without polling: {ok} queued, {full} refused BUFFER_FULL, slowest {slowest:?}"
    );
    assert!(slowest < Duration::from_secs(2), "a send took {slowest:?}");
    // Polling again: every reply is there, or — when the edge's queue for this session
    // overflowed while the game read nothing (it closes a slow consumer, and the resume
    // reports what it could not keep) — a RESTORED_WITH_GAP says so. Never a silent loss.
    // (A message the backend could not take is answered too: ERROR 402 busy.)
    let (mut replies, mut refused, mut gap) = (0u32, 0u32, false);
    let deadline = Instant::now() + Duration::from_secs(30);
    while replies + refused < ok && !gap && Instant::now() < deadline {
        match next(&client) {
            Ok(ev) if ev.kind == WAYGATE_EVENT_MESSAGE => replies += 1,
            Ok(ev) if ev.kind == WAYGATE_EVENT_ERROR => refused += 1,
            Ok(ev)
                if ev.kind == WAYGATE_EVENT_CONNECTED
                    && ev.outcome == WAYGATE_OUTCOME_RESTORED_WITH_GAP =>
            {
                gap = true
            }
            _ => {}
        }
    }
    eprintln!("after the stall: {replies} replies, {refused} refused (busy), gap reported: {gap}");
    assert!(
        replies + refused == ok || gap,
        "{replies} replies + {refused} refusals of {ok}, and no gap reported"
    );
    // And the client still works.
    let mut answered = false;
    let deadline = Instant::now() + Duration::from_secs(30);
    send(&client, 1000, b"still-alive").unwrap();
    while !answered && Instant::now() < deadline {
        if let Ok(ev) = next(&client) {
            answered = ev.kind == WAYGATE_EVENT_MESSAGE && ev.payload.ends_with(b"still-alive");
        }
    }
    assert!(answered, "the client works after the stall");
    drop(client);
    drop(system);
}

/// Channels through the C functions (PROTOCOL.md §12, the demo game's CHANNEL_JOIN and CHAT):
/// JOINED, then the publication with its epoch, offset and body; the position is readable.
#[test]
fn channel_events_through_the_c_functions() {
    let system = System::start();
    let endpoint = system.endpoint.clone();
    let h = new_client(&endpoint, &token_bytes("ffi-chatter"));
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(h.0) }, WAYGATE_OK);
    wait_for(&h, WAYGATE_EVENT_CONNECTED);
    let world = std::ffi::CString::new("world").unwrap();
    let (mut epoch, mut offset) = (0u64, 0u64);
    // SAFETY: live handle; NUL-terminated name; writable outputs.
    let r =
        unsafe { waygate_client_channel_position(h.0, world.as_ptr(), &mut epoch, &mut offset) };
    assert_eq!(r, WAYGATE_NOT_FOUND, "not a member yet");
    send(&h, 1200, b"world").unwrap();
    let joined = wait_for(&h, WAYGATE_EVENT_CHANNEL_JOINED);
    assert_eq!(joined.text, "world");
    assert_eq!(joined.channel.1, 0);
    send(&h, 1202, b"world|hello from C").unwrap();
    let publication = wait_for(&h, WAYGATE_EVENT_CHANNEL_PUBLICATION);
    assert_eq!(publication.text, "world");
    assert_eq!(publication.channel, (joined.channel.0, 1));
    assert_eq!(publication.payload, b"ffi-chatter|hello from C");
    // SAFETY: as above.
    let r =
        unsafe { waygate_client_channel_position(h.0, world.as_ptr(), &mut epoch, &mut offset) };
    assert_eq!(r, WAYGATE_OK);
    assert_eq!((epoch, offset), (joined.channel.0, 1));
    // A refreshed token is taken (for the next HELLO); a NULL one with a length is refused.
    let fresh = token_bytes("ffi-chatter");
    // SAFETY: live handle; `fresh` readable for its length.
    assert_eq!(
        unsafe { waygate_client_set_token(h.0, fresh.as_ptr(), fresh.len()) },
        WAYGATE_OK
    );
    // SAFETY: live handle; NULL with a length is refused before any read.
    assert_eq!(
        unsafe { waygate_client_set_token(h.0, std::ptr::null(), 4) },
        WAYGATE_INVALID_ARGUMENT
    );
    // So are a token with its session key (sealed KCP), and one with no key.
    let key = [7u8; 32];
    // SAFETY: live handle; `fresh` readable for its length, `key` for 32 bytes.
    assert_eq!(
        unsafe { waygate_client_set_credentials(h.0, fresh.as_ptr(), fresh.len(), key.as_ptr()) },
        WAYGATE_OK
    );
    // SAFETY: live handle; `fresh` readable for its length; no key.
    assert_eq!(
        unsafe {
            waygate_client_set_credentials(h.0, fresh.as_ptr(), fresh.len(), std::ptr::null())
        },
        WAYGATE_OK
    );
    // SAFETY: live handle; NULL with a length is refused before any read.
    assert_eq!(
        unsafe { waygate_client_set_credentials(h.0, std::ptr::null(), 4, key.as_ptr()) },
        WAYGATE_INVALID_ARGUMENT
    );
    // A refused request is an ERROR with the edge's code.
    send(&h, 1200, b"nosuch:1").unwrap();
    let refused = wait_for(&h, WAYGATE_EVENT_ERROR);
    assert_eq!(
        (refused.code, refused.text.as_str()),
        (408, "unknown_channel_kind")
    );
    drop(h);
    drop(system);
}

//! The client handle and its functions.

use std::ffi::CString;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use ::waygate_client::{Client, ClientOptions, ConnectionState, Event, RequestError, SdkError};
use bytes::Bytes;
use tokio::runtime::Runtime;
use waygate_session::client::ClientError;
use waygate_transport::TrafficClass;

use crate::error::set_last_error;
use crate::event::{flatten, waygate_event};
use crate::options::{to_client_options, waygate_options};
use crate::result::waygate_result;
use crate::result::waygate_result::*;

/// How long `waygate_client_free` waits for the CLOSE to go out and the worker to stop.
const FREE_GRACE: Duration = Duration::from_secs(1);

/// An opaque client handle: created by `waygate_client_new`, released by
/// `waygate_client_free`. Use it from one thread at a time.
pub struct waygate_client {
    rt: Runtime,
    /// Options until `waygate_client_connect` starts the client.
    pending: Option<ClientOptions>,
    client: Option<Client>,
    /// The last polled event: its payload is what `waygate_event.payload` points into.
    current: Option<Event>,
    /// What `waygate_event.text` points to.
    text: CString,
    /// The client task has ended (its event stream is exhausted), or it was closed before
    /// it was ever connected.
    ended: bool,
}

/// Live numbers of a client (all 0 before the first connect).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct waygate_stats {
    /// Latest PING/PONG round-trip time in microseconds (0: no sample yet).
    pub rtt_latest_us: u64,
    /// Smoothed round-trip time in microseconds (RFC 6298 weights).
    pub rtt_smoothed_us: u64,
    /// Smallest round-trip time seen, in microseconds.
    pub rtt_min_us: u64,
    /// Number of round-trip samples.
    pub rtt_samples: u64,
    /// Sent messages not yet acked by the server.
    pub unacked: u64,
    /// Highest server seq received without a gap.
    pub last_server_seq: u64,
    /// Successful connects and resumes.
    pub connects: u64,
}

impl waygate_client {
    fn new(options: ClientOptions) -> Result<Self, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("waygate-client")
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the client thread: {e}"))?;
        Ok(Self {
            rt,
            pending: Some(options),
            client: None,
            current: None,
            text: CString::default(),
            ended: false,
        })
    }

    /// Runs one SDK command to completion on the handle's runtime: `WAYGATE_OK`, or the
    /// code of why it could not be taken (not connected yet, ended).
    fn command<'a, F, Fut>(&'a mut self, f: F) -> waygate_result
    where
        F: FnOnce(&'a Client) -> Fut,
        Fut: Future<Output = Result<(), SdkError>>,
    {
        if let Err(code) = self.running() {
            return code;
        }
        let Some(c) = self.client.as_ref() else {
            return WAYGATE_INVALID_STATE;
        };
        match self.rt.block_on(f(c)) {
            Ok(()) => WAYGATE_OK,
            Err(_) => {
                set_last_error("the client is closed");
                WAYGATE_CLOSED
            }
        }
    }

    /// The running client, or the code to return when there is none.
    fn running(&mut self) -> Result<&mut Client, waygate_result> {
        match (&mut self.client, self.ended) {
            (_, true) => {
                set_last_error("the client is closed");
                Err(WAYGATE_CLOSED)
            }
            (Some(c), false) => Ok(c),
            (None, false) => {
                set_last_error("call waygate_client_connect first");
                Err(WAYGATE_INVALID_STATE)
            }
        }
    }

    /// Takes events until one is ready (`Ok`), none is (`NO_EVENT`), or the stream ended
    /// (`CLOSED`). `wait` bounds how long to block (`None`: do not block).
    fn next(&mut self, wait: Option<Duration>) -> Result<waygate_event, waygate_result> {
        self.current = None;
        loop {
            self.running()?;
            let rt = &self.rt;
            let Some(client) = self.client.as_mut() else {
                return Err(WAYGATE_INVALID_STATE);
            };
            let polled = match wait {
                None => poll_once(client.next_event()),
                Some(d) => match rt
                    .block_on(async { tokio::time::timeout(d, client.next_event()).await })
                {
                    Ok(ev) => Poll::Ready(ev),
                    Err(_) => Poll::Pending,
                },
            };
            match polled {
                Poll::Pending => return Err(WAYGATE_NO_EVENT),
                Poll::Ready(None) => {
                    self.ended = true;
                    return Err(WAYGATE_CLOSED);
                }
                Poll::Ready(Some(event)) => {
                    let Some((mut flat, text)) = flatten(&event) else {
                        continue;
                    };
                    self.text = CString::new(text.replace('\0', " ")).unwrap_or_default();
                    flat.text = self.text.as_ptr();
                    // Moving `event` does not move the bytes its payload points to.
                    self.current = Some(event);
                    return Ok(flat);
                }
            }
        }
    }
}

/// Polls a future once without blocking or registering interest (the event channel is
/// cancel-safe: a dropped `recv` loses nothing).
fn poll_once<F: Future>(f: F) -> Poll<F::Output> {
    let mut cx = Context::from_waker(Waker::noop());
    pin!(f).poll(&mut cx)
}

/// Borrows the handle behind `client`.
///
/// # Safety
///
/// `client` is a non-NULL handle from `waygate_client_new`, not freed, not in use on
/// another thread.
unsafe fn handle<'a>(client: *mut waygate_client) -> &'a mut waygate_client {
    // SAFETY: the caller's promise above: a live, exclusively used Box allocation.
    unsafe { &mut *client }
}

/// Creates a client from `options` (which are copied). It does not connect yet: call
/// `waygate_client_connect`. Returns NULL when an option is invalid or the client thread
/// cannot start; `waygate_last_error()` says why.
///
/// # Safety
///
/// `options` is NULL or points to a `waygate_options` initialised by `waygate_options_init`
/// (readable for its `struct_size` bytes) whose pointers are NULL or valid as documented
/// there.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_new(
    options: *const waygate_options,
) -> *mut waygate_client {
    ffi_body!(std::ptr::null_mut() => {
        non_null!(options, std::ptr::null_mut());
        // SAFETY: not NULL; the caller promises an initialised struct (its `struct_size`
        // bytes readable) with valid pointers.
        let converted =
            unsafe { crate::options::read_sized(options) }.and_then(|o| unsafe { to_client_options(&o) });
        match converted.and_then(waygate_client::new) {
            Ok(client) => Box::into_raw(Box::new(client)),
            Err(e) => {
                set_last_error(e);
                std::ptr::null_mut()
            }
        }
    })
}

/// Starts connecting (in the background: `WAYGATE_EVENT_CONNECTED` tells when the session is
/// up). From now on the client reconnects and resumes by itself until it is closed or
/// kicked. `WAYGATE_INVALID_STATE` when called twice.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_connect(client: *mut waygate_client) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        if h.ended {
            set_last_error("the client is closed");
            return WAYGATE_CLOSED;
        }
        let Some(options) = h.pending.take() else {
            set_last_error("waygate_client_connect was already called");
            return WAYGATE_INVALID_STATE;
        };
        let _guard = h.rt.enter();
        h.client = Some(Client::start(options));
        WAYGATE_OK
    })
}

/// Lets the client advance its timers to `now_ms` (any monotonic clock in milliseconds).
///
/// This implementation runs the protocol on its own thread, so `tick` only validates the
/// handle: calling it is optional, and cheap. It returns `WAYGATE_CLOSED` once the client
/// has ended, else `WAYGATE_OK`.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_tick(
    client: *mut waygate_client,
    now_ms: u64,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        let _ = now_ms;
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        if h.ended { WAYGATE_CLOSED } else { WAYGATE_OK }
    })
}

fn write_event(
    out: *mut waygate_event,
    next: Result<waygate_event, waygate_result>,
) -> waygate_result {
    let (mut event, code) = match next {
        Ok(e) => (e, WAYGATE_OK),
        Err(code) => (waygate_event::none(), code),
    };
    // SAFETY: the callers checked `out` for NULL, and their caller promises the struct's
    // `struct_size` field is set and that many bytes are writable.
    let size = unsafe { std::ptr::addr_of!((*out).struct_size).read_unaligned() };
    event.struct_size = size;
    // SAFETY: as above; at most `size` bytes (and one struct) are written.
    unsafe { crate::sized::write_prefix(out, &event, size) };
    code
}

/// `WAYGATE_INVALID_ARGUMENT` unless the caller set `out->struct_size`.
///
/// # Safety
///
/// `out` is not NULL and its `struct_size` field is readable.
unsafe fn check_event_size(out: *const waygate_event) -> Result<(), waygate_result> {
    // SAFETY: the caller's promise above.
    let size = unsafe { std::ptr::addr_of!((*out).struct_size).read_unaligned() };
    if size < std::mem::size_of::<usize>() + std::mem::size_of::<u32>() {
        set_last_error("set ev.struct_size = sizeof ev before polling");
        return Err(WAYGATE_INVALID_ARGUMENT);
    }
    Ok(())
}

/// Takes the next event without blocking: `WAYGATE_OK` with `*out` filled, or
/// `WAYGATE_NO_EVENT` (none ready; `out->kind` is `WAYGATE_EVENT_NONE`), or
/// `WAYGATE_CLOSED` once the client has ended and every event was taken.
///
/// The previous event's `payload` and `text` become invalid with this call.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; `out` is NULL
/// or a `waygate_event` whose `struct_size` is set, writable for that many bytes.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_poll_event(
    client: *mut waygate_client,
    out: *mut waygate_event,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        non_null!(out, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises `struct_size` is set.
        if let Err(code) = unsafe { check_event_size(out) } {
            return code;
        }
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        write_event(out, h.next(None))
    })
}

/// Like `waygate_client_poll_event`, but blocks the calling thread up to `timeout_ms`
/// milliseconds for an event (for tools and tests; a game loop polls instead).
///
/// # Safety
///
/// As `waygate_client_poll_event`; and the calling thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_wait_event(
    client: *mut waygate_client,
    timeout_ms: u32,
    out: *mut waygate_event,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        non_null!(out, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises `struct_size` is set.
        if let Err(code) = unsafe { check_event_size(out) } {
            return code;
        }
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        write_event(out, h.next(Some(Duration::from_millis(u64::from(timeout_ms)))))
    })
}

/// Sends a message of `traffic_class` (`WAYGATE_CLASS_*`) with id `msg_id` and `len` bytes
/// at `payload` (copied; NULL allowed when `len` is 0). On `WAYGATE_OK`, `*seq_out` (if
/// not NULL) is the message's client seq (0 for best-effort).
///
/// Sequenced messages (critical, normal) sent while disconnected are kept and go out after
/// the resume; they are kept until the server acks them, so none is lost or duplicated.
/// Returns `WAYGATE_BUFFER_FULL` when too many are unacked, `WAYGATE_DROPPED` for a
/// best-effort message while no link is up, `WAYGATE_CLOSED` after the end,
/// `WAYGATE_INVALID_ARGUMENT` when its frame would exceed the max frame size (nothing sent).
///
/// It waits until the client thread has taken the message: microseconds. The client thread
/// never waits for the caller (connect attempts run beside it; events the caller has not
/// polled wait in the handle, and past 4,096 of them the thread stops reading the link
/// instead; status events such as connect failures, which need no link, are dropped past
/// 256 more and counted in one `WAYGATE_EVENT_EVENTS_DROPPED`), so a caller that has not
/// polled for minutes is not blocked here, and its backlog stays bounded.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; `payload` is
/// NULL or readable for `len` bytes; `seq_out` is NULL or writable; the calling thread is
/// not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_send(
    client: *mut waygate_client,
    traffic_class: u8,
    msg_id: u32,
    payload: *const u8,
    len: usize,
    seq_out: *mut u64,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        if payload.is_null() && len != 0 {
            set_last_error("`payload` is NULL but `len` is not 0");
            return WAYGATE_INVALID_ARGUMENT;
        }
        let Some(class) = TrafficClass::from_bits(traffic_class) else {
            set_last_error(format!("unknown traffic class {traffic_class}"));
            return WAYGATE_INVALID_ARGUMENT;
        };
        let body = if len == 0 {
            Bytes::new()
        } else {
            // SAFETY: not NULL; the caller promises `len` readable bytes, copied at once.
            Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(payload, len) })
        };
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        if let Err(code) = h.running() {
            return code;
        }
        let rt = &h.rt;
        let Some(client) = h.client.as_mut() else {
            return WAYGATE_INVALID_STATE;
        };
        match rt.block_on(client.send(class, msg_id, body)) {
            Ok(Some(seq)) => {
                if !seq_out.is_null() {
                    // SAFETY: not NULL; the caller promises it is writable.
                    unsafe { seq_out.write(seq) };
                }
                WAYGATE_OK
            }
            Ok(None) => {
                set_last_error("best-effort message dropped: no link is up");
                WAYGATE_DROPPED
            }
            Err(e) => {
                set_last_error(e.to_string());
                match e {
                    SdkError::Session(ClientError::SendBufferFull(_)) => WAYGATE_BUFFER_FULL,
                    SdkError::Session(ClientError::TooLarge { .. }) => WAYGATE_INVALID_ARGUMENT,
                    SdkError::Closed | SdkError::Session(ClientError::InvalidState { .. }) => {
                        WAYGATE_CLOSED
                    }
                    _ => WAYGATE_INVALID_STATE,
                }
            }
        }
    })
}

/// Sends a request (PROTOCOL.md §13) of `traffic_class` (critical or normal) to `msg_id`
/// with `len` bytes of `body` (copied), and returns at once: `*request_id_out` is its id.
/// Its outcome comes as one event with that `request_id`: `WAYGATE_EVENT_ANSWER` (the game
/// server's status and body) or `WAYGATE_EVENT_REQUEST_FAILED` (timeout after `timeout_ms`,
/// refused, expired offline, session lost, closed). `WAYGATE_BUFFER_FULL` when too many
/// messages are unacked; `WAYGATE_INVALID_ARGUMENT` for a best-effort class or a frame
/// above the max frame size.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; `body` is
/// NULL or readable for `len` bytes; `request_id_out` is NULL or writable; the calling
/// thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_request(
    client: *mut waygate_client,
    traffic_class: u8,
    msg_id: u32,
    body: *const u8,
    len: usize,
    timeout_ms: u32,
    request_id_out: *mut u32,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        if body.is_null() && len != 0 {
            set_last_error("`body` is NULL but `len` is not 0");
            return WAYGATE_INVALID_ARGUMENT;
        }
        let Some(class) = TrafficClass::from_bits(traffic_class).filter(|c| c.is_sequenced()) else {
            set_last_error(format!("a request needs a critical or normal class, not {traffic_class}"));
            return WAYGATE_INVALID_ARGUMENT;
        };
        let body = if len == 0 {
            Bytes::new()
        } else {
            // SAFETY: not NULL; the caller promises `len` readable bytes, copied at once.
            Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(body, len) })
        };
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        request_started(h, request_id_out, |c| c.start_request(class, msg_id, body, timeout))
    })
}

/// Takes a sample of the game server's clock (a request to `msg_id` answered with its Unix
/// time in ms, big-endian u64: the demo's `TIME`, 1010) and returns at once with its id
/// in `*request_id_out`. When its `WAYGATE_EVENT_ANSWER` comes, `waygate_client_clock_offset`
/// has the updated estimate.
///
/// # Safety
///
/// As `waygate_client_request`.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_sync_clock(
    client: *mut waygate_client,
    msg_id: u32,
    timeout_ms: u32,
    request_id_out: *mut u32,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        request_started(h, request_id_out, |c| c.start_sync_clock(msg_id, timeout))
    })
}

/// Runs a request start on the handle's runtime and writes the id.
fn request_started<'a, F, Fut>(
    h: &'a mut waygate_client,
    request_id_out: *mut u32,
    start: F,
) -> waygate_result
where
    F: FnOnce(&'a Client) -> Fut,
    Fut: Future<Output = Result<u32, RequestError>>,
{
    if let Err(code) = h.running() {
        return code;
    }
    let Some(c) = h.client.as_ref() else {
        return WAYGATE_INVALID_STATE;
    };
    match h.rt.block_on(start(c)) {
        Ok(id) => {
            if !request_id_out.is_null() {
                // SAFETY: not NULL; the caller promises it is writable.
                unsafe { request_id_out.write(id) };
            }
            WAYGATE_OK
        }
        Err(e) => {
            set_last_error(e.to_string());
            match e {
                RequestError::SendBufferFull => WAYGATE_BUFFER_FULL,
                RequestError::NotSequenced | RequestError::TooLarge { .. } => {
                    WAYGATE_INVALID_ARGUMENT
                }
                _ => WAYGATE_CLOSED,
            }
        }
    }
}

/// The game server's clock offset estimate (server time = local Unix time + offset), from
/// the clock samples taken so far: `*offset_ms` and the round trip of the sample it rests on
/// (the estimate is within half of it) in `*rtt_us`. `WAYGATE_NOT_FOUND` before the first
/// sample was answered.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; `offset_ms`
/// and `rtt_us` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_clock_offset(
    client: *mut waygate_client,
    offset_ms: *mut i64,
    rtt_us: *mut u64,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        let Some(estimate) = h.client.as_ref().and_then(|c| c.stats().clock) else {
            set_last_error("no clock sample yet: call waygate_client_sync_clock");
            return WAYGATE_NOT_FOUND;
        };
        if !offset_ms.is_null() {
            // SAFETY: not NULL; the caller promises it is writable.
            unsafe { offset_ms.write(estimate.offset_ms) };
        }
        if !rtt_us.is_null() {
            // SAFETY: not NULL; the caller promises it is writable.
            unsafe { rtt_us.write(u64::try_from(estimate.rtt.as_micros()).unwrap_or(u64::MAX)) };
        }
        WAYGATE_OK
    })
}

/// Pauses the client (the game goes to the background): drops the link without a CLOSE, so
/// the session lingers on the server, and makes no connect attempt until
/// `waygate_client_reconnect_now` resumes it. Sends meanwhile wait; the give-up deadline
/// does not run while paused. `WAYGATE_CLOSED` once the client has ended.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; the calling
/// thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_pause(client: *mut waygate_client) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        h.command(|c| c.pause())
    })
}

/// Drops the current link without a CLOSE, as a network failure would (a test drill): the
/// client reconnects at once and resumes, losing nothing. `WAYGATE_OK` also when no link
/// is up.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; the calling
/// thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_drop_link(client: *mut waygate_client) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        h.command(|c| c.drop_link())
    })
}

/// Reconnects now (a lifecycle hook: the app came back from the background, the network
/// changed): drops the current link even if it looks alive, forgets the reconnect backoff
/// and connects at once; the session resumes. `WAYGATE_OK` also when no link is up.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; the calling
/// thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_reconnect_now(
    client: *mut waygate_client,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        h.command(|c| c.reconnect_now())
    })
}

/// Replaces the auth token (refreshed from the login service) for the next HELLO. An
/// expired token never ends a session that can still be resumed (the client resumes with
/// its resume token alone); a fresh one is needed for a new login. With a `session_key`
/// (sealed KCP), whose key must match the token, use `waygate_client_set_credentials`
/// instead. The bytes are copied.
/// `WAYGATE_INVALID_STATE` before `waygate_client_connect`, `WAYGATE_CLOSED` once the
/// client has ended.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; `token` is
/// NULL (with `token_len` 0) or readable for `token_len` bytes; the calling thread is not
/// running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_set_token(
    client: *mut waygate_client,
    token: *const u8,
    token_len: usize,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        // SAFETY: the caller's promises, passed on.
        unsafe { replace_credentials(client, token, token_len, None) }
    })
}

/// Replaces the connect token and the session key handed out beside it (the options'
/// `session_key`): sealed KCP needs both to match, and a listener that requires sealing
/// checks the token in its CONNECT before any resume (PROTOCOL.md §8.2.4), so a client
/// whose only endpoints are sealed KCP reconnects after its token expired only with a fresh
/// token and its key. `session_key`: 32 bytes, or NULL for plain KCP sessions from now on.
/// Used from the next connect; the bytes are copied. `WAYGATE_INVALID_STATE` before
/// `waygate_client_connect`, `WAYGATE_CLOSED` once the client has ended.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; `token` is
/// NULL (with `token_len` 0) or readable for `token_len` bytes; `session_key` is NULL or
/// readable for 32 bytes; the calling thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_set_credentials(
    client: *mut waygate_client,
    token: *const u8,
    token_len: usize,
    session_key: *const u8,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        let key = (!session_key.is_null()).then(|| {
            let mut key = [0u8; 32];
            // SAFETY: not NULL; the caller promises 32 readable bytes.
            key.copy_from_slice(unsafe { std::slice::from_raw_parts(session_key, 32) });
            key
        });
        // SAFETY: the caller's promises, passed on.
        unsafe { replace_credentials(client, token, token_len, Some(key)) }
    })
}

/// `waygate_client_set_token` (`key` None: the session key stays) and
/// `waygate_client_set_credentials` (`key` Some: the key too).
///
/// # Safety
///
/// As `waygate_client_set_token`.
unsafe fn replace_credentials(
    client: *mut waygate_client,
    token: *const u8,
    token_len: usize,
    key: Option<Option<[u8; 32]>>,
) -> waygate_result {
    non_null!(client, WAYGATE_INVALID_ARGUMENT);
    if token.is_null() && token_len > 0 {
        set_last_error("token is NULL");
        return WAYGATE_INVALID_ARGUMENT;
    }
    let bytes = if token_len == 0 {
        bytes::Bytes::new()
    } else {
        // SAFETY: not NULL; the caller promises `token_len` readable bytes.
        bytes::Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(token, token_len) })
    };
    // SAFETY: not NULL; the caller promises a live handle used only by this thread.
    let h = unsafe { handle(client) };
    if let Err(code) = h.running() {
        return code;
    }
    let Some(c) = h.client.as_ref() else {
        // Not connected yet: the token given to `waygate_client_new` is used.
        set_last_error("credentials set before waygate_client_connect");
        return WAYGATE_INVALID_STATE;
    };
    let done = match key {
        None => h.rt.block_on(c.set_token(bytes)),
        Some(key) => h.rt.block_on(c.set_credentials(bytes, key)),
    };
    match done {
        Ok(()) => WAYGATE_OK,
        Err(_) => WAYGATE_CLOSED,
    }
}

/// Sends CLOSE (normal) and ends the client: a `WAYGATE_EVENT_CLOSED` event follows, then
/// polls return `WAYGATE_CLOSED`. The edge keeps the session for its linger (PROTOCOL.md
/// §7.5), so the player can come back to it; `waygate_client_logout` ends it instead.
/// Closing a client that never connected ends it at once. Closing twice is fine.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; the calling
/// thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_close(client: *mut waygate_client) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        end(h, false)
    })
}

/// Ends a client: CLOSE `normal`, or `logout` (`logout`), on a running client; a client that
/// never connected ends at once. A logout says whether it reached the edge:
/// `WAYGATE_INVALID_STATE` when no session was up on a link, `WAYGATE_CLOSED` when the
/// client had already ended (the session lingers out in both cases).
fn end(h: &mut waygate_client, logout: bool) -> waygate_result {
    match h.client.as_ref() {
        Some(c) if !h.ended && logout => match h.rt.block_on(c.logout()) {
            Ok(()) => WAYGATE_OK,
            Err(SdkError::NotConnected) => {
                set_last_error("no session was up on a link: it lingers out on the edge");
                WAYGATE_INVALID_STATE
            }
            Err(_) => {
                set_last_error("the client is closed");
                WAYGATE_CLOSED
            }
        },
        Some(c) if !h.ended => {
            h.rt.block_on(c.close());
            WAYGATE_OK
        }
        Some(_) if logout => {
            set_last_error("the client is closed");
            WAYGATE_CLOSED
        }
        Some(_) => WAYGATE_OK,
        None => {
            h.pending = None;
            h.ended = true;
            WAYGATE_OK
        }
    }
}

/// As `waygate_client_close`, but sends CLOSE `logout`: the edge ends the session at once
/// (the player is offline, its ownership released) instead of letting it linger
/// (PROTOCOL.md §7.5). The `WAYGATE_EVENT_CLOSED` event carries code 2 (`logout`). Returns
/// `WAYGATE_OK` when the CLOSE went out on a live session's link; `WAYGATE_INVALID_STATE`
/// when no session was up on a link (reconnecting: the client ends anyway and the session
/// lingers out on the edge); `WAYGATE_CLOSED` when the client had already ended. A client
/// that never connected ends at once (`WAYGATE_OK`: there is no session).
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; the calling
/// thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_logout(client: *mut waygate_client) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        end(h, true)
    })
}

/// Where a client is (`waygate_client_state`); the names are the same in every SDK.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum waygate_state {
    /// `idle`: created, `waygate_client_connect` not called yet.
    WAYGATE_STATE_IDLE = 0,
    /// `connecting`: no session has been up yet.
    WAYGATE_STATE_CONNECTING = 1,
    /// `connected`: a session is up.
    WAYGATE_STATE_CONNECTED = 2,
    /// `reconnecting`: the link dropped; connecting again to resume the session.
    WAYGATE_STATE_RECONNECTING = 3,
    /// `closed`: ended for good (closed, kicked, expired, refused, gave up).
    WAYGATE_STATE_CLOSED = 4,
    /// `paused`: `waygate_client_pause` was called; no link until
    /// `waygate_client_reconnect_now`.
    WAYGATE_STATE_PAUSED = 5,
}

/// Where the client is now: a game's "connecting... / reconnecting, attempt 3" screen reads
/// it each frame (`WAYGATE_EVENT_CONNECT_FAILED` says why an attempt failed). A NULL
/// handle reads as `WAYGATE_STATE_CLOSED`.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_state(client: *mut waygate_client) -> waygate_state {
    use waygate_state::*;
    ffi_body!(WAYGATE_STATE_CLOSED => {
        non_null!(client, WAYGATE_STATE_CLOSED);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        match (&h.client, h.ended) {
            (_, true) => WAYGATE_STATE_CLOSED,
            (None, false) => WAYGATE_STATE_IDLE,
            (Some(c), false) => match c.state() {
                ConnectionState::Idle => WAYGATE_STATE_IDLE,
                ConnectionState::Connecting => WAYGATE_STATE_CONNECTING,
                ConnectionState::Connected => WAYGATE_STATE_CONNECTED,
                ConnectionState::Reconnecting => WAYGATE_STATE_RECONNECTING,
                ConnectionState::Paused => WAYGATE_STATE_PAUSED,
                _ => WAYGATE_STATE_CLOSED,
            },
        }
    })
}

/// The state's name, as in every SDK ("idle", "connecting", "connected", "reconnecting",
/// "closed"; "unknown" for another value). Never NULL.
#[no_mangle]
pub extern "C" fn waygate_state_str(state: std::ffi::c_int) -> *const std::ffi::c_char {
    ffi_body!(c"".as_ptr() => {
        let s = match state {
            0 => c"idle",
            1 => c"connecting",
            2 => c"connected",
            3 => c"reconnecting",
            4 => c"closed",
            5 => c"paused",
            _ => c"unknown",
        };
        s.as_ptr()
    })
}

/// Fills `*out` with live statistics.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; `out` is NULL
/// or writable for one `waygate_stats`.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_stats(
    client: *mut waygate_client,
    out: *mut waygate_stats,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        non_null!(out, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        let stats = match &h.client {
            Some(c) => {
                let s = c.stats();
                let us = |d: Option<Duration>| d.map_or(0, |d| d.as_micros() as u64);
                waygate_stats {
                    rtt_latest_us: us(s.rtt.latest),
                    rtt_smoothed_us: us(s.rtt.smoothed),
                    rtt_min_us: us(s.rtt.min),
                    rtt_samples: s.rtt.samples,
                    unacked: s.unacked as u64,
                    last_server_seq: s.last_server_seq,
                    connects: s.connects,
                }
            }
            None => waygate_stats::default(),
        };
        // SAFETY: not NULL; the caller promises it is writable for one struct.
        unsafe { out.write(stats) };
        WAYGATE_OK
    })
}

/// The last position of `channel` (a NUL-terminated UTF-8 name) this session holds: from
/// its JOINED, HISTORY_LOST and publications (PROTOCOL.md §12.3). Hand it to your game
/// server after a new login so it can join you with recovery. `WAYGATE_NOT_FOUND` when the
/// session is not a member of that channel.
///
/// # Safety
///
/// `client` is NULL or a live handle used by no other thread during the call; `channel` is
/// NULL or a NUL-terminated string; `out_epoch` and `out_offset` are NULL or writable for
/// one `uint64_t` each.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_channel_position(
    client: *mut waygate_client,
    channel: *const std::ffi::c_char,
    out_epoch: *mut u64,
    out_offset: *mut u64,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        non_null!(client, WAYGATE_INVALID_ARGUMENT);
        non_null!(channel, WAYGATE_INVALID_ARGUMENT);
        non_null!(out_epoch, WAYGATE_INVALID_ARGUMENT);
        non_null!(out_offset, WAYGATE_INVALID_ARGUMENT);
        // SAFETY: not NULL; the caller promises a NUL-terminated string.
        let Ok(name) = unsafe { std::ffi::CStr::from_ptr(channel) }.to_str() else {
            set_last_error("channel is not UTF-8");
            return WAYGATE_INVALID_ARGUMENT;
        };
        // SAFETY: not NULL; the caller promises a live handle used only by this thread.
        let h = unsafe { handle(client) };
        let Some(position) = h
            .client
            .as_ref()
            .and_then(|c| c.channel_positions().get(name).copied())
        else {
            return WAYGATE_NOT_FOUND;
        };
        // SAFETY: not NULL; the caller promises both are writable.
        unsafe {
            out_epoch.write(position.epoch);
            out_offset.write(position.offset);
        }
        WAYGATE_OK
    })
}

/// Releases the handle: sends CLOSE if the connection is still open (waiting up to one
/// second for it to go out), stops the client thread and frees everything, including the
/// last event's payload and text. NULL is ignored. The handle must not be used afterwards.
///
/// # Safety
///
/// `client` is NULL or a live handle from `waygate_client_new` that no other thread uses
/// and that is not used again; the calling thread is not running a tokio runtime.
#[no_mangle]
pub unsafe extern "C" fn waygate_client_free(client: *mut waygate_client) {
    ffi_body!(() => {
        non_null!(client);
        // SAFETY: not NULL; the caller promises a live handle from `Box::into_raw` in
        // `waygate_client_new` that is never used again, so we own it from here.
        let h = unsafe { Box::from_raw(client) };
        let waygate_client { rt, client, .. } = *h;
        if let Some(mut c) = client {
            rt.block_on(async {
                c.close().await;
                let drain = async { while c.next_event().await.is_some() {} };
                let _ = tokio::time::timeout(FREE_GRACE, drain).await;
            });
        }
        rt.shutdown_timeout(FREE_GRACE);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::waygate_event_kind;

    fn new_client() -> *mut waygate_client {
        let token = b"not a real token";
        let mut o = std::mem::MaybeUninit::uninit();
        // SAFETY: `o` is writable; init fills every field.
        let mut o = unsafe {
            crate::waygate_options_init(o.as_mut_ptr(), std::mem::size_of::<waygate_options>());
            o.assume_init()
        };
        // Port 9 (discard) on loopback: nothing listens, connects are refused.
        o.endpoints = c"tcp://127.0.0.1:9".as_ptr();
        o.token = token.as_ptr();
        o.token_len = token.len();
        // SAFETY: valid options.
        let c = unsafe { waygate_client_new(&o) };
        assert!(!c.is_null());
        c
    }

    /// The event struct as a caller built against an older header has it (before the
    /// channel fields were added), followed by bytes the library must never touch.
    #[repr(C)]
    struct OlderEvent {
        struct_size: usize,
        kind: waygate_event_kind,
        traffic_class: u8,
        code: u16,
        msg_id: u32,
        retry_after_ms: u32,
        seq: u64,
        payload: *const u8,
        payload_len: usize,
        text: *const std::ffi::c_char,
        session_id: [u8; 16],
    }

    #[repr(C)]
    struct GuardedEvent {
        older: OlderEvent,
        canary: [u8; 64],
    }

    /// SDK issue item 5: polling into an older caller's smaller event writes only its
    /// `struct_size` bytes; an event without `struct_size` is refused, not overrun.
    #[test]
    fn an_older_callers_event_is_written_within_its_size() {
        let c = new_client();
        let mut g = std::mem::MaybeUninit::<GuardedEvent>::zeroed();
        // SAFETY: zeroed is a valid bit pattern for these plain fields (kind 0 = NONE).
        let g = unsafe { g.as_mut_ptr().as_mut() }.unwrap();
        g.canary = [0xA5; 64];
        let out = (&mut g.older as *mut OlderEvent).cast::<waygate_event>();
        // Not set: refused before anything is written.
        // SAFETY: live handle; `out` is readable for its struct_size field.
        assert_eq!(
            unsafe { waygate_client_poll_event(c, out) },
            WAYGATE_INVALID_ARGUMENT
        );
        g.older.struct_size = std::mem::size_of::<OlderEvent>();
        assert!(g.older.struct_size < std::mem::size_of::<waygate_event>());
        // Not connected: refused with an empty event written, within the older size.
        // SAFETY: live handle; `out` writable for its struct_size bytes.
        let r = unsafe { waygate_client_poll_event(c, out) };
        assert_eq!(r, WAYGATE_INVALID_STATE);
        assert_eq!(
            g.canary, [0xA5; 64],
            "the event was written past the caller's struct"
        );
        assert_eq!(g.older.kind, waygate_event_kind::WAYGATE_EVENT_NONE);
        assert_eq!(g.older.struct_size, std::mem::size_of::<OlderEvent>());
        // SAFETY: a live handle, freed once.
        unsafe { waygate_client_free(c) };
    }

    #[test]
    fn null_handles_and_outputs_are_refused() {
        let mut ev = waygate_event::none();
        // SAFETY: NULL pointers are the point of this test; `ev` is writable.
        unsafe {
            assert!(waygate_client_new(std::ptr::null()).is_null());
            assert_eq!(
                waygate_client_connect(std::ptr::null_mut()),
                WAYGATE_INVALID_ARGUMENT
            );
            assert_eq!(
                waygate_client_tick(std::ptr::null_mut(), 1),
                WAYGATE_INVALID_ARGUMENT
            );
            assert_eq!(
                waygate_client_poll_event(std::ptr::null_mut(), &mut ev),
                WAYGATE_INVALID_ARGUMENT
            );
            assert_eq!(
                waygate_client_send(
                    std::ptr::null_mut(),
                    1,
                    1,
                    std::ptr::null(),
                    0,
                    std::ptr::null_mut()
                ),
                WAYGATE_INVALID_ARGUMENT
            );
            assert_eq!(
                waygate_client_close(std::ptr::null_mut()),
                WAYGATE_INVALID_ARGUMENT
            );
            waygate_client_free(std::ptr::null_mut());
        }
        let c = new_client();
        // SAFETY: `c` is live; NULL `out` is refused before use.
        unsafe {
            assert_eq!(
                waygate_client_poll_event(c, std::ptr::null_mut()),
                WAYGATE_INVALID_ARGUMENT
            );
            assert_eq!(
                waygate_client_send(c, 1, 1, std::ptr::null(), 3, std::ptr::null_mut()),
                WAYGATE_INVALID_ARGUMENT
            );
            assert_eq!(
                waygate_client_send(c, 7, 1, std::ptr::null(), 0, std::ptr::null_mut()),
                WAYGATE_INVALID_ARGUMENT
            );
            waygate_client_free(c);
        }
    }

    #[test]
    fn lifecycle_states_without_a_server() {
        let c = new_client();
        let mut ev = waygate_event::none();
        let mut seq = 0u64;
        // SAFETY: `c` is live until freed at the end; `ev` and `seq` are writable.
        unsafe {
            assert_eq!(waygate_client_poll_event(c, &mut ev), WAYGATE_INVALID_STATE);
            assert_eq!(
                waygate_client_send(c, 1, 1000, b"x".as_ptr(), 1, &mut seq),
                WAYGATE_INVALID_STATE
            );
            assert_eq!(waygate_client_connect(c), WAYGATE_OK);
            assert_eq!(waygate_client_connect(c), WAYGATE_INVALID_STATE);
            assert_eq!(waygate_client_tick(c, 5), WAYGATE_OK);
            // Nothing listens: the message is buffered for the resume, with seq 1.
            assert_eq!(
                waygate_client_send(c, 1, 1000, b"x".as_ptr(), 1, &mut seq),
                WAYGATE_OK
            );
            assert_eq!(seq, 1);
            assert_eq!(
                waygate_client_send(c, 2, 1000, b"x".as_ptr(), 1, &mut seq),
                WAYGATE_DROPPED
            );
            assert_eq!(waygate_client_close(c), WAYGATE_OK);
            let mut kinds = Vec::new();
            loop {
                match waygate_client_wait_event(c, 5000, &mut ev) {
                    WAYGATE_OK => kinds.push(ev.kind),
                    WAYGATE_CLOSED => break,
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(
                kinds.last(),
                Some(&waygate_event_kind::WAYGATE_EVENT_CLOSED)
            );
            assert_eq!(ev.kind, waygate_event_kind::WAYGATE_EVENT_NONE);
            assert_eq!(waygate_client_poll_event(c, &mut ev), WAYGATE_CLOSED);
            assert_eq!(waygate_client_tick(c, 6), WAYGATE_CLOSED);
            assert_eq!(
                waygate_client_send(c, 1, 1000, b"x".as_ptr(), 1, &mut seq),
                WAYGATE_CLOSED
            );
            assert_eq!(waygate_client_close(c), WAYGATE_OK);
            waygate_client_free(c);
        }
    }

    #[test]
    fn close_before_connect_ends_the_client() {
        let c = new_client();
        let mut ev = waygate_event::none();
        // SAFETY: `c` is live until freed; `ev` is writable.
        unsafe {
            assert_eq!(waygate_client_close(c), WAYGATE_OK);
            assert_eq!(waygate_client_connect(c), WAYGATE_CLOSED);
            assert_eq!(waygate_client_poll_event(c, &mut ev), WAYGATE_CLOSED);
            waygate_client_free(c);
        }
    }
}

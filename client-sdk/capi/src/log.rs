//! An optional log callback (SDK issue item 3): what the client threads log (connect
//! attempts and why they failed, resumes, refusals) reaches a C caller that has no `tracing`
//! of its own. One callback per process; it is installed as the process's `tracing`
//! subscriber the first time it is set.

use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt::Write as _;
use std::sync::RwLock;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

use crate::error::set_last_error;
use crate::result::waygate_result;
use crate::result::waygate_result::*;

/// Log level `error`: something failed for good.
pub const WAYGATE_LOG_ERROR: c_int = 1;
/// Log level `warn`: something failed and is retried.
pub const WAYGATE_LOG_WARN: c_int = 2;
/// Log level `info`: connects, resumes, migrations.
pub const WAYGATE_LOG_INFO: c_int = 3;
/// Log level `debug`: each connect attempt and why it failed.
pub const WAYGATE_LOG_DEBUG: c_int = 4;
/// Log level `trace`: everything.
pub const WAYGATE_LOG_TRACE: c_int = 5;

/// A log callback: `level` (`WAYGATE_LOG_*`), `target` (the Rust module, e.g.
/// "waygate_client::driver") and `message` (the text then `key=value` fields), both
/// NUL-terminated and valid during the call only. Called on the library's own threads,
/// possibly several at once: it must be thread-safe, return quickly and not call back into
/// the library.
pub type waygate_log_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        level: c_int,
        target: *const c_char,
        message: *const c_char,
    ),
>;

#[derive(Clone, Copy)]
struct Sink {
    callback: unsafe extern "C" fn(*mut c_void, c_int, *const c_char, *const c_char),
    user: *mut c_void,
    max_level: c_int,
}

// SAFETY: the caller promises the callback and `user` may be used from any thread
// (documented on `waygate_set_log_callback`).
unsafe impl Send for Sink {}
// SAFETY: as above.
unsafe impl Sync for Sink {}

static SINK: RwLock<Option<Sink>> = RwLock::new(None);
static INSTALLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn level_number(level: &Level) -> c_int {
    match *level {
        Level::ERROR => WAYGATE_LOG_ERROR,
        Level::WARN => WAYGATE_LOG_WARN,
        Level::INFO => WAYGATE_LOG_INFO,
        Level::DEBUG => WAYGATE_LOG_DEBUG,
        _ => WAYGATE_LOG_TRACE,
    }
}

fn current() -> Option<Sink> {
    SINK.read().ok().and_then(|s| *s)
}

/// The subscriber that hands events to the C callback (spans are not reported).
struct CallbackSubscriber;

/// Collects an event's message and fields as text.
struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.push_str(value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

impl Subscriber for CallbackSubscriber {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        current().is_some_and(|s| level_number(metadata.level()) <= s.max_level)
    }

    fn register_callsite(&self, _: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        // Asked at each event: the callback and its level can change at any time.
        tracing::subscriber::Interest::sometimes()
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let Some(sink) = current() else { return };
        let meta = event.metadata();
        let level = level_number(meta.level());
        if level > sink.max_level {
            return;
        }
        let mut text = Text(String::new());
        event.record(&mut text);
        let message = CString::new(text.0.replace('\0', " ")).unwrap_or_default();
        let target = CString::new(meta.target().replace('\0', " ")).unwrap_or_default();
        // SAFETY: the caller of `waygate_set_log_callback` promised a callback callable
        // from any thread with `user`; both strings live until it returns.
        unsafe { (sink.callback)(sink.user, level, target.as_ptr(), message.as_ptr()) };
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// Sends the library's log lines up to `max_level` (`WAYGATE_LOG_ERROR` .. `WAYGATE_LOG_TRACE`)
/// to `callback` with `user`; a NULL callback stops them. Process-wide: the last call wins.
///
/// The first call installs the library's log handling for the whole process (the Rust
/// `tracing` global subscriber): `WAYGATE_INVALID_STATE` when the process already has one
/// (a Rust host that logs by itself: use its logging instead). `WAYGATE_INVALID_ARGUMENT`
/// for a level outside 1..=5.
///
/// # Safety
///
/// `callback` is NULL or a function that may be called from any thread, at the same time
/// on several, with `user`, until it is replaced or removed by another call; `user` stays
/// valid that long.
#[no_mangle]
pub unsafe extern "C" fn waygate_set_log_callback(
    callback: waygate_log_fn,
    user: *mut c_void,
    max_level: c_int,
) -> waygate_result {
    ffi_body!(WAYGATE_PANIC => {
        if !(WAYGATE_LOG_ERROR..=WAYGATE_LOG_TRACE).contains(&max_level) {
            set_last_error(format!("log level {max_level} is not 1 (error) .. 5 (trace)"));
            return WAYGATE_INVALID_ARGUMENT;
        }
        let installed = *INSTALLED.get_or_init(|| {
            tracing::subscriber::set_global_default(CallbackSubscriber).is_ok()
        });
        if !installed {
            set_last_error("this process already has a tracing subscriber");
            return WAYGATE_INVALID_STATE;
        }
        let sink = callback.map(|callback| Sink { callback, user, max_level });
        match SINK.write() {
            Ok(mut s) => *s = sink,
            Err(poisoned) => *poisoned.into_inner() = sink,
        }
        // Levels are cached per call site; a new maximum takes effect now.
        tracing::callsite::rebuild_interest_cache();
        WAYGATE_OK
    })
}

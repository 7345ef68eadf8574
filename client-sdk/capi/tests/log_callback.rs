//! The C log callback (SDK issue item 3): a C caller sees what the client threads log —
//! here each failed connect attempt and its reason — through `waygate_set_log_callback`;
//! a NULL callback stops the lines; a bad level is refused. Its own test binary: the
//! callback is the process's one `tracing` subscriber.

#![allow(unsafe_code)] // It calls the C functions; every block has a `// SAFETY:` comment.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    unreachable_pub
)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::mem::MaybeUninit;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use waygate_client_capi::waygate_result::*;
use waygate_client_capi::*;

static LINES: Mutex<Vec<(usize, c_int, String, String)>> = Mutex::new(Vec::new());

/// A C-style callback: records (user tag, level, target, message).
unsafe extern "C" fn record(
    user: *mut c_void,
    level: c_int,
    target: *const c_char,
    message: *const c_char,
) {
    // SAFETY: the library passes NUL-terminated strings valid during the call.
    let (target, message) = unsafe {
        (
            CStr::from_ptr(target).to_string_lossy().into_owned(),
            CStr::from_ptr(message).to_string_lossy().into_owned(),
        )
    };
    LINES
        .lock()
        .unwrap()
        .push((user as usize, level, target, message));
}

fn lines_with(text: &str) -> Vec<(usize, c_int, String, String)> {
    LINES
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.3.contains(text))
        .cloned()
        .collect()
}

#[test]
fn the_client_threads_log_through_the_callback() {
    // SAFETY: `record` may be called from any thread; the user tag is not dereferenced.
    unsafe {
        assert_eq!(
            waygate_set_log_callback(Some(record), 7 as *mut c_void, 9),
            WAYGATE_INVALID_ARGUMENT
        );
        assert_eq!(
            waygate_set_log_callback(Some(record), 7 as *mut c_void, WAYGATE_LOG_DEBUG),
            WAYGATE_OK
        );
    }
    // Nothing listens there: every connect attempt fails, and the worker says why.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = CString::new(format!("tcp://{}", dead.local_addr().unwrap())).unwrap();
    drop(dead);
    let token = b"token";
    let mut o = MaybeUninit::uninit();
    // SAFETY: `o` is writable; init fills every field; the pointers outlive the call.
    let client = unsafe {
        waygate_options_init(o.as_mut_ptr(), std::mem::size_of::<waygate_options>());
        let mut o = o.assume_init();
        o.endpoints = url.as_ptr();
        o.token = token.as_ptr();
        o.token_len = token.len();
        waygate_client_new(&o)
    };
    assert!(!client.is_null());
    // SAFETY: live handle.
    assert_eq!(unsafe { waygate_client_connect(client) }, WAYGATE_OK);
    let deadline = Instant::now() + Duration::from_secs(20);
    while lines_with("connect failed").is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let failed = lines_with("connect failed");
    let (user, level, target, message) = failed.first().expect("a connect failure logged");
    assert_eq!((*user, *level), (7, WAYGATE_LOG_DEBUG));
    assert!(target.starts_with("waygate_client"), "{target}");
    assert!(message.contains("endpoint=tcp://127.0.0.1:"), "{message}");
    assert!(message.contains("reason="), "{message}");

    // Errors only: the next failures are not reported; a NULL callback stops everything.
    // SAFETY: as above.
    assert_eq!(
        unsafe { waygate_set_log_callback(Some(record), 8 as *mut c_void, WAYGATE_LOG_ERROR) },
        WAYGATE_OK
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(lines_with("connect failed").iter().all(|l| l.0 == 7));
    // SAFETY: removing the callback.
    assert_eq!(
        unsafe { waygate_set_log_callback(None, std::ptr::null_mut(), WAYGATE_LOG_TRACE) },
        WAYGATE_OK
    );
    // SAFETY: live handle, freed once.
    unsafe {
        waygate_client_close(client);
        waygate_client_free(client);
    }
}

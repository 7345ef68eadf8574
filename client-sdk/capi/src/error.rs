//! The per-thread last error message, and the version string.

use std::cell::RefCell;
use std::ffi::{c_char, CString};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error (NUL bytes become spaces).
pub(crate) fn set_last_error(message: impl Into<String>) {
    let text = message.into().replace('\0', " ");
    let text = CString::new(text).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = text);
}

#[cfg(test)]
pub(crate) fn last_error_string() -> String {
    LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned())
}

/// Why the last failed call on this thread failed, in English ("" if none failed yet).
///
/// The string stays valid until the next call that fails on this thread. Never NULL.
#[no_mangle]
pub extern "C" fn waygate_last_error() -> *const c_char {
    ffi_body!(c"".as_ptr() => {
        LAST_ERROR
            .try_with(|e| e.borrow().as_ptr())
            .unwrap_or(c"".as_ptr())
    })
}

/// The library version, e.g. "0.1.0" (a static string).
#[no_mangle]
pub extern "C" fn waygate_version() -> *const c_char {
    ffi_body!(c"".as_ptr() => {
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
    })
}

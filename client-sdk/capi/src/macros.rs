//! The boundary macros: nothing unwinds into C, no NULL is dereferenced.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs the body of an exported function: a panic becomes `$on_panic` (its message goes
/// to `waygate_last_error`), so nothing ever unwinds into C. hyper's `ffi_fn!` wraps the
/// whole function; this wraps the body so that cbindgen (which does not expand macros on
/// stable Rust) still sees every signature. `return` inside the body returns from it.
macro_rules! ffi_body {
    ($on_panic:expr => $body:block) => {
        $crate::macros::guard(|| $on_panic, move || $body)
    };
}

/// Returns `$ret` (or `()`) from the enclosing `ffi_body!`, with a message for
/// `waygate_last_error`, when the pointer `$ptr` is NULL.
macro_rules! non_null {
    ($ptr:ident) => {
        if $ptr.is_null() {
            $crate::error::set_last_error(concat!("`", stringify!($ptr), "` is NULL"));
            return;
        }
    };
    ($ptr:ident, $ret:expr) => {
        if $ptr.is_null() {
            $crate::error::set_last_error(concat!("`", stringify!($ptr), "` is NULL"));
            return $ret;
        }
    };
}

/// `catch_unwind` with a fallback value; the panic message is kept for
/// `waygate_last_error`.
pub(crate) fn guard<T>(on_panic: impl FnOnce() -> T, body: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(value) => value,
        Err(payload) => {
            let message = waygate_transport::panic_message(&*payload)
                .unwrap_or_else(|| "a panic without a message".to_owned());
            // A payload whose destructor panics would unwind from here: leak it instead.
            std::mem::forget(payload);
            crate::error::set_last_error(format!("panic caught at the C boundary: {message}"));
            on_panic()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::waygate_result;

    #[test]
    fn a_panic_becomes_the_fallback_and_its_message_is_kept() {
        let r = guard(|| waygate_result::WAYGATE_PANIC, || panic!("boom {}", 7));
        assert_eq!(r, waygate_result::WAYGATE_PANIC);
        assert!(crate::error::last_error_string().contains("boom 7"));
        let r = ffi_body!(waygate_result::WAYGATE_PANIC => { waygate_result::WAYGATE_OK });
        assert_eq!(r, waygate_result::WAYGATE_OK);
    }

    #[test]
    fn non_null_returns_early() {
        fn check(p: *const u8) -> waygate_result {
            ffi_body!(waygate_result::WAYGATE_PANIC => {
                non_null!(p, waygate_result::WAYGATE_INVALID_ARGUMENT);
                waygate_result::WAYGATE_OK
            })
        }
        assert_eq!(
            check(std::ptr::null()),
            waygate_result::WAYGATE_INVALID_ARGUMENT
        );
        assert!(crate::error::last_error_string().contains("`p` is NULL"));
        assert_eq!(check(b"x".as_ptr()), waygate_result::WAYGATE_OK);
    }
}

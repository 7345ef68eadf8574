//! Result codes.

use std::ffi::{c_char, c_int};

/// What a call returned. Every function that can fail returns one of these.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum waygate_result {
    /// Success.
    WAYGATE_OK = 0,
    /// No event is ready yet: poll again later (the call would block).
    WAYGATE_NO_EVENT = 1,
    /// A NULL pointer, a string that is not UTF-8, an unknown traffic class, or an option
    /// that does not parse (endpoint URL, CA PEM). `waygate_last_error()` says which.
    WAYGATE_INVALID_ARGUMENT = 2,
    /// Not valid now: sending or polling before `waygate_client_connect`, connecting twice.
    WAYGATE_INVALID_STATE = 3,
    /// The client has ended (closed locally, kicked, banned, expired, token refused, a
    /// backend's KICK): no more
    /// events will come and nothing can be sent.
    WAYGATE_CLOSED = 4,
    /// The buffer of sent-but-unacked messages is full: keep polling (acks free it) and
    /// send again later.
    WAYGATE_BUFFER_FULL = 5,
    /// A best-effort message was dropped because no link is up (never resent).
    WAYGATE_DROPPED = 6,
    /// An internal failure (e.g. the client's thread could not be started).
    WAYGATE_INTERNAL = 7,
    /// A panic was caught at the boundary: a bug in waygate. The handle may be unusable.
    WAYGATE_PANIC = 8,
    /// What was asked for does not exist (e.g. a channel the session is not a member of).
    WAYGATE_NOT_FOUND = 9,
}

/// A static English description of a result code (`code` is a `waygate_result` value; an
/// unknown value gives "unknown result code"). Never NULL.
#[no_mangle]
pub extern "C" fn waygate_result_str(code: c_int) -> *const c_char {
    ffi_body!(c"".as_ptr() => {
        let s = match code {
            0 => c"ok",
            1 => c"no event ready",
            2 => c"invalid argument",
            3 => c"invalid state",
            4 => c"client closed",
            5 => c"send buffer full",
            6 => c"best-effort message dropped: no link",
            7 => c"internal error",
            8 => c"panic caught at the C boundary",
            9 => c"not found",
            _ => c"unknown result code",
        };
        s.as_ptr()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn every_code_has_its_own_text() {
        let mut seen = std::collections::HashSet::new();
        for code in 0..=8 {
            // SAFETY: waygate_result_str returns a static NUL-terminated string.
            let s = unsafe { CStr::from_ptr(waygate_result_str(code)) };
            assert!(seen.insert(s.to_owned()), "{code}");
            assert_ne!(s.to_bytes(), b"unknown result code");
        }
        assert_eq!(waygate_result::WAYGATE_PANIC as c_int, 8);
        // SAFETY: as above.
        let s = unsafe { CStr::from_ptr(waygate_result_str(99)) };
        assert_eq!(s.to_bytes(), b"unknown result code");
    }
}

//! Client options as a C struct, and their conversion to [`ClientOptions`].

use std::ffi::{c_char, CStr};
use std::time::Duration;

use bytes::Bytes;
use waygate_client::ClientOptions;
use waygate_transport::endpoint::Endpoint;
use waygate_transport::tls::ClientTls;

/// Traffic class `Critical`: never dropped; sequenced, acked and resent after a resume.
pub const WAYGATE_CLASS_CRITICAL: u8 = 0;
/// Traffic class `Normal`: sequenced, acked and resent after a resume; may be slowed under
/// overload.
pub const WAYGATE_CLASS_NORMAL: u8 = 1;
/// Traffic class `BestEffort`: not sequenced, never resent, dropped first.
pub const WAYGATE_CLASS_BEST_EFFORT: u8 = 2;

/// How to connect. Fill it with `waygate_options_init` first, then set the fields you need:
/// later versions may add fields at the end, with defaults set by `waygate_options_init`.
///
/// The strings and the token are copied by `waygate_client_new`; they need not outlive it.
/// A number left at 0 means "the default".
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct waygate_options {
    /// Required. Endpoint URLs in order of preference, separated by commas, e.g.
    /// "kcp://127.0.0.1:7100,quic://localhost:7444,tcp://127.0.0.1:7000". Schemes: tcp, tls,
    /// ws, wss, quic, kcp; hosts are IP literals ([v6] in brackets) or DNS names, resolved at
    /// each connect (every address tried).
    pub endpoints: *const c_char,
    /// Required. The auth token bytes from the login service (decoded, not base64).
    pub token: *const u8,
    /// Length of `token` in bytes.
    pub token_len: usize,
    /// PEM text of the CA certificates to trust for tls, wss and quic endpoints (NULL: the
    /// system's trust roots).
    pub ca_pem: *const c_char,
    /// How long a UDP endpoint (kcp, quic) may take to connect before the next one is tried
    /// (default 2000 ms).
    pub udp_timeout_ms: u32,
    /// Deadline of a transport handshake: TCP connect, TLS, WebSocket upgrade (default
    /// 10000 ms).
    pub handshake_timeout_ms: u32,
    /// A link that receives nothing for this long is considered dead (default 30000 ms).
    pub idle_timeout_ms: u32,
    /// First reconnect delay cap, doubled per failed round (full jitter; default 100 ms).
    pub backoff_min_ms: u32,
    /// Largest reconnect delay (default 5000 ms).
    pub backoff_max_ms: u32,
    /// Most sent-but-unacked messages kept for resending; beyond it `waygate_client_send`
    /// returns `WAYGATE_BUFFER_FULL` (default 4096).
    pub max_unacked: u32,
    /// The 32-byte session key the login service handed out beside a connect token (`token`
    /// of format version 2, PROTOCOL.md §7.2.2): KCP sessions are then sealed with it (every
    /// datagram authenticated and encrypted, §8.9). NULL: plain KCP sessions, which an edge
    /// listening beyond loopback refuses by default. Copied by `waygate_client_new`.
    pub session_key: *const u8,
}

/// Fills `out` with the defaults: NULL strings and token, 0 (default) numbers. Does nothing
/// when `out` is NULL.
///
/// # Safety
///
/// `out` is NULL or points to writable memory for one `waygate_options`.
#[no_mangle]
pub unsafe extern "C" fn waygate_options_init(out: *mut waygate_options) {
    ffi_body!(() => {
        non_null!(out);
        let defaults = waygate_options {
            endpoints: std::ptr::null(),
            token: std::ptr::null(),
            token_len: 0,
            ca_pem: std::ptr::null(),
            udp_timeout_ms: 0,
            handshake_timeout_ms: 0,
            idle_timeout_ms: 0,
            backoff_min_ms: 0,
            backoff_max_ms: 0,
            max_unacked: 0,
            session_key: std::ptr::null(),
        };
        // SAFETY: `out` is not NULL and the caller promises it is writable for one struct;
        // `write` does not read (or drop) what was there, so it may be uninitialised.
        unsafe { out.write(defaults) };
    })
}

/// Reads a NUL-terminated UTF-8 string (`what` names it in errors).
///
/// # Safety
///
/// `ptr` is a valid NUL-terminated string.
unsafe fn utf8<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, String> {
    // SAFETY: the caller promises a valid NUL-terminated string.
    let s = unsafe { CStr::from_ptr(ptr) };
    s.to_str().map_err(|_| format!("{what} is not UTF-8"))
}

fn ms(value: u32) -> Option<Duration> {
    (value != 0).then(|| Duration::from_millis(u64::from(value)))
}

/// Converts C options, checking every field.
///
/// # Safety
///
/// The pointers in `o` are NULL or valid as documented on [`waygate_options`].
pub(crate) unsafe fn to_client_options(o: &waygate_options) -> Result<ClientOptions, String> {
    if o.endpoints.is_null() {
        return Err("options.endpoints is NULL".into());
    }
    // SAFETY: not NULL; the caller promises a NUL-terminated string.
    let list = unsafe { utf8(o.endpoints, "options.endpoints") }?;
    let endpoints = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|url| Endpoint::parse(url).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    if endpoints.is_empty() {
        return Err("options.endpoints lists no endpoint".into());
    }
    if o.token.is_null() || o.token_len == 0 {
        return Err("options.token is NULL or empty".into());
    }
    // SAFETY: not NULL; the caller promises `token_len` readable bytes at `token`. They
    // are copied at once.
    let token = Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(o.token, o.token_len) });
    let mut options = ClientOptions::new(endpoints, token);
    if !o.ca_pem.is_null() {
        // SAFETY: not NULL; the caller promises a NUL-terminated string.
        let pem = unsafe { utf8(o.ca_pem, "options.ca_pem") }?;
        options.connect.tls = Some(ClientTls::from_ca_pem(pem).map_err(|e| e.to_string())?);
    }
    if let Some(d) = ms(o.udp_timeout_ms) {
        options.udp_timeout = d;
    }
    if let Some(d) = ms(o.handshake_timeout_ms) {
        options.connect.conn.handshake_timeout = d;
    }
    if let Some(d) = ms(o.idle_timeout_ms) {
        options.connect.conn.idle_timeout = Some(d);
    }
    if let Some(d) = ms(o.backoff_min_ms) {
        options.backoff_min = d;
    }
    if let Some(d) = ms(o.backoff_max_ms) {
        options.backoff_max = d;
    }
    if options.backoff_max < options.backoff_min {
        return Err("options.backoff_max_ms is below options.backoff_min_ms".into());
    }
    if o.max_unacked != 0 {
        options.session.max_unacked = o.max_unacked as usize;
    }
    if !o.session_key.is_null() {
        let mut key = [0u8; 32];
        // SAFETY: not NULL; the caller promises 32 readable bytes. Copied at once.
        key.copy_from_slice(unsafe { std::slice::from_raw_parts(o.session_key, 32) });
        options.session_key = Some(key);
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::MaybeUninit;

    fn init() -> waygate_options {
        let mut o = MaybeUninit::uninit();
        // SAFETY: `o` is writable for one struct.
        unsafe { waygate_options_init(o.as_mut_ptr()) };
        // SAFETY: waygate_options_init wrote every field.
        unsafe { o.assume_init() }
    }

    fn convert(o: &waygate_options) -> Result<ClientOptions, String> {
        // SAFETY: the tests pass NULL or valid pointers.
        unsafe { to_client_options(o) }
    }

    #[test]
    fn options_convert_with_defaults_and_overrides() {
        let mut o = init();
        let token = b"tok";
        o.endpoints = c" kcp://127.0.0.1:7100, tcp://localhost:7000 ,".as_ptr();
        o.token = token.as_ptr();
        o.token_len = token.len();
        let c = convert(&o).unwrap();
        assert_eq!(c.endpoints.len(), 2);
        assert_eq!(c.endpoints[1].to_string(), "tcp://localhost:7000");
        assert_eq!(&c.token[..], b"tok");
        assert_eq!(c.udp_timeout, Duration::from_secs(2));
        assert!(c.connect.tls.is_none());
        o.udp_timeout_ms = 250;
        o.max_unacked = 8;
        o.backoff_min_ms = 10;
        o.backoff_max_ms = 20;
        let c = convert(&o).unwrap();
        assert_eq!(c.udp_timeout, Duration::from_millis(250));
        assert_eq!(c.session.max_unacked, 8);
        assert_eq!(c.backoff_max, Duration::from_millis(20));
        assert_eq!(c.session_key, None);
        let key = [7u8; 32];
        o.session_key = key.as_ptr();
        assert_eq!(convert(&o).unwrap().session_key, Some(key));
    }

    #[test]
    fn bad_options_are_refused_with_a_reason() {
        let token = b"tok";
        let base = {
            let mut o = init();
            o.endpoints = c"tcp://127.0.0.1:7000".as_ptr();
            o.token = token.as_ptr();
            o.token_len = token.len();
            o
        };
        let cases: Vec<(waygate_options, &str)> = vec![
            (
                waygate_options {
                    endpoints: std::ptr::null(),
                    ..base
                },
                "endpoints is NULL",
            ),
            (
                waygate_options {
                    endpoints: c" , ".as_ptr(),
                    ..base
                },
                "no endpoint",
            ),
            (
                waygate_options {
                    endpoints: c"ftp://1.2.3.4:5".as_ptr(),
                    ..base
                },
                "unknown scheme",
            ),
            (
                waygate_options {
                    endpoints: c"\xff".as_ptr(),
                    ..base
                },
                "not UTF-8",
            ),
            (
                waygate_options {
                    token: std::ptr::null(),
                    ..base
                },
                "token is NULL",
            ),
            (
                waygate_options {
                    token_len: 0,
                    ..base
                },
                "token is NULL or empty",
            ),
            (
                waygate_options {
                    ca_pem: c"not a pem".as_ptr(),
                    ..base
                },
                "CA",
            ),
            (
                waygate_options {
                    backoff_min_ms: 50,
                    backoff_max_ms: 10,
                    ..base
                },
                "backoff",
            ),
        ];
        for (o, want) in cases {
            let err = convert(&o).unwrap_err();
            assert!(err.contains(want), "{err:?} lacks {want:?}");
        }
        assert!(convert(&base).is_ok());
    }
}

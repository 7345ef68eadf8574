//! Client options as a C struct, and their conversion to [`ClientOptions`].

use std::ffi::{c_char, CStr};
use std::time::Duration;

use bytes::Bytes;
use waygate_client::ClientOptions;
use waygate_transport::endpoint::Endpoint;
use waygate_transport::tls::ClientTls;

/// The library's major version (`waygate_version()` as numbers): compare at compile time
/// with `#if WAYGATE_VERSION_MAJOR ...`. Structs only grow (see `struct_size`) within a
/// major version.
pub const WAYGATE_VERSION_MAJOR: u32 = 0;
/// The library's minor version.
pub const WAYGATE_VERSION_MINOR: u32 = 2;
/// The library's patch version.
pub const WAYGATE_VERSION_PATCH: u32 = 0;

/// Traffic class `Critical`: never dropped; sequenced, acked and resent after a resume.
pub const WAYGATE_CLASS_CRITICAL: u8 = 0;
/// Traffic class `Normal`: sequenced, acked and resent after a resume; may be slowed under
/// overload.
pub const WAYGATE_CLASS_NORMAL: u8 = 1;
/// Traffic class `BestEffort`: not sequenced, never resent, dropped first.
pub const WAYGATE_CLASS_BEST_EFFORT: u8 = 2;

/// How to connect. Fill it with `waygate_options_init(&o, sizeof o)` first, then set the
/// fields you need. Later versions add fields at the end only: `struct_size` tells the
/// library which fields your header had, and fields beyond it take their defaults, so a
/// program built against an older header keeps working with a newer library.
///
/// The strings and the token are copied by `waygate_client_new`; they need not outlive it.
/// A number left at 0 means "the default".
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct waygate_options {
    /// `sizeof(waygate_options)` as the caller compiled it (set by `waygate_options_init`).
    pub struct_size: usize,
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
    /// returns `WAYGATE_BUFFER_FULL` (default and most 4096, the edge's window).
    pub max_unacked: u32,
    /// The 32-byte session key the login service handed out beside a connect token (`token`
    /// of format version 2, PROTOCOL.md §7.2.2): KCP sessions are then sealed with it (every
    /// datagram authenticated and encrypted, §8.9). NULL: plain KCP sessions, which an edge
    /// listening beyond loopback refuses by default. Copied by `waygate_client_new`.
    pub session_key: *const u8,
    /// Give up when no session has been up for this long: the client ends with
    /// `WAYGATE_EVENT_CLOSED`, code 403 `unavailable` (default 0: retry for ever).
    pub give_up_after_ms: u32,
    /// A message sent while no session is up waits for the next one; when it comes up,
    /// each such message never sent and older than this is dropped instead
    /// (`WAYGATE_EVENT_EXPIRED`) and the later ones move down one seq (default 0: no bound;
    /// since 0.2).
    pub max_offline_age_ms: u32,
    /// Network simulator, for testing a game under a bad network (never in production):
    /// milliseconds added to every frame each way (since 0.2; all four 0: off).
    pub sim_latency_ms: u32,
    /// Simulator: up to this many more milliseconds per frame, at random.
    pub sim_jitter_ms: u32,
    /// Simulator: frames lost per thousand (best-effort ones are dropped; the others arrive
    /// 200 ms late, as retransmitted).
    pub sim_loss_permille: u32,
    /// Simulator: seed of its random choices (the same seed, the same choices).
    pub sim_seed: u32,
    /// Give up after this many failed connect rounds in a row with no session in between:
    /// `WAYGATE_EVENT_CLOSED`, code 403 `unavailable` (since 0.2; default 0: no cap).
    pub give_up_after_attempts: u32,
}

/// Fills the first `size` bytes of `out` with the defaults (NULL strings and token, 0 =
/// default numbers) and sets `out->struct_size = size`: pass `sizeof` of your struct.
/// `WAYGATE_INVALID_ARGUMENT` when `out` is NULL or `size` cannot even hold `struct_size`.
///
/// # Safety
///
/// `out` is NULL or points to `size` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn waygate_options_init(
    out: *mut waygate_options,
    size: usize,
) -> crate::result::waygate_result {
    use crate::result::waygate_result::*;
    ffi_body!(WAYGATE_PANIC => {
        non_null!(out, WAYGATE_INVALID_ARGUMENT);
        if size < std::mem::size_of::<usize>() {
            crate::error::set_last_error("waygate_options_init: size must be sizeof(waygate_options)");
            return WAYGATE_INVALID_ARGUMENT;
        }
        let defaults = waygate_options {
            struct_size: size,
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
            give_up_after_ms: 0,
            max_offline_age_ms: 0,
            sim_latency_ms: 0,
            sim_jitter_ms: 0,
            sim_loss_permille: 0,
            sim_seed: 0,
            give_up_after_attempts: 0,
        };
        // SAFETY: `out` is not NULL and the caller promises `size` writable bytes; at most
        // that many (and at most one struct) are copied, nothing is read from `out`.
        unsafe { crate::sized::write_prefix(out, &defaults, size) };
        WAYGATE_OK
    })
}

/// The caller's options as this library's struct: the fields its `struct_size` covers,
/// defaults for the rest (a caller built against an older header).
///
/// # Safety
///
/// `o` is not NULL and points to a struct of at least `struct_size` readable bytes.
pub(crate) unsafe fn read_sized(o: *const waygate_options) -> Result<waygate_options, String> {
    // SAFETY: the caller promises at least the `struct_size` field is readable.
    let size = unsafe { std::ptr::addr_of!((*o).struct_size).read_unaligned() };
    if size < std::mem::size_of::<usize>() {
        return Err(
            "options.struct_size is not set: call waygate_options_init(&o, sizeof o)".into(),
        );
    }
    let mut local = std::mem::MaybeUninit::<waygate_options>::uninit();
    // SAFETY: `local` is writable for one struct.
    unsafe {
        waygate_options_init(local.as_mut_ptr(), std::mem::size_of::<waygate_options>());
    }
    // SAFETY: init wrote every field.
    let mut local = unsafe { local.assume_init() };
    // SAFETY: the caller promises `size` readable bytes at `o`; at most one struct copied.
    unsafe { crate::sized::read_prefix(o, &mut local, size) };
    local.struct_size = size;
    Ok(local)
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
    options.give_up_after = ms(o.give_up_after_ms);
    options.give_up_after_attempts =
        (o.give_up_after_attempts > 0).then_some(o.give_up_after_attempts);
    options.session.max_offline_age = ms(o.max_offline_age_ms);
    if o.sim_loss_permille > 1000 {
        return Err("options.sim_loss_permille is above 1000".into());
    }
    if o.sim_latency_ms != 0 || o.sim_jitter_ms != 0 || o.sim_loss_permille != 0 {
        options.net_sim = Some(waygate_client::netsim::NetSimConfig {
            latency: Duration::from_millis(u64::from(o.sim_latency_ms)),
            jitter: Duration::from_millis(u64::from(o.sim_jitter_ms)),
            loss: f64::from(o.sim_loss_permille) / 1000.0,
            seed: u64::from(o.sim_seed),
            ..waygate_client::netsim::NetSimConfig::default()
        });
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
        unsafe { waygate_options_init(o.as_mut_ptr(), std::mem::size_of::<waygate_options>()) };
        // SAFETY: waygate_options_init wrote every field.
        unsafe { o.assume_init() }
    }

    #[test]
    fn version_numbers_are_the_crates() {
        assert_eq!(
            (
                WAYGATE_VERSION_MAJOR.to_string(),
                WAYGATE_VERSION_MINOR.to_string(),
                WAYGATE_VERSION_PATCH.to_string()
            ),
            (
                env!("CARGO_PKG_VERSION_MAJOR").to_string(),
                env!("CARGO_PKG_VERSION_MINOR").to_string(),
                env!("CARGO_PKG_VERSION_PATCH").to_string()
            )
        );
    }

    /// The options struct as a caller built against an older header has it (before
    /// `session_key` was added), followed by bytes the library must never touch.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct OlderOptions {
        struct_size: usize,
        endpoints: *const c_char,
        token: *const u8,
        token_len: usize,
        ca_pem: *const c_char,
        udp_timeout_ms: u32,
        handshake_timeout_ms: u32,
        idle_timeout_ms: u32,
        backoff_min_ms: u32,
        backoff_max_ms: u32,
        max_unacked: u32,
    }

    #[repr(C)]
    struct Guarded {
        older: OlderOptions,
        canary: [u8; 64],
    }

    /// SDK issue item 5: an older caller's smaller struct is neither written nor read past
    /// its end, and the fields it does not have take their defaults.
    #[test]
    fn an_older_callers_options_are_read_and_written_within_their_size() {
        let mut g = std::mem::MaybeUninit::<Guarded>::zeroed();
        // SAFETY: zeroed is a valid bit pattern for these plain fields.
        let g = unsafe { g.as_mut_ptr().as_mut() }.unwrap();
        g.canary = [0xA5; 64];
        let older_size = std::mem::size_of::<OlderOptions>();
        assert!(older_size < std::mem::size_of::<waygate_options>());
        let ptr = (&mut g.older as *mut OlderOptions).cast::<waygate_options>();
        // SAFETY: `ptr` is writable for `older_size` bytes.
        let r = unsafe { waygate_options_init(ptr, older_size) };
        assert_eq!(r, crate::result::waygate_result::WAYGATE_OK);
        assert_eq!(g.canary, [0xA5; 64], "init wrote past the caller's struct");
        assert_eq!(g.older.struct_size, older_size);
        let token = b"tok";
        g.older.endpoints = c"tcp://127.0.0.1:7000".as_ptr();
        g.older.token = token.as_ptr();
        g.older.token_len = token.len();
        g.older.max_unacked = 9;
        // The canary would be a non-NULL `session_key` pointer if the library read it.
        // SAFETY: `older_size` readable bytes at `ptr`.
        let read = unsafe { read_sized(ptr) }.unwrap();
        let c = convert(&read).unwrap();
        assert_eq!(c.session.max_unacked, 9);
        assert_eq!(
            c.session_key, None,
            "a field the caller does not have is the default"
        );
        // SAFETY: zero is not a size: refused, nothing written.
        assert_eq!(
            unsafe { waygate_options_init(ptr, 0) },
            crate::result::waygate_result::WAYGATE_INVALID_ARGUMENT
        );
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
        // The 0.2 fields: give-up cap, staleness bound, network simulator.
        assert_eq!(convert(&o).unwrap().give_up_after_attempts, None);
        assert!(convert(&o).unwrap().net_sim.is_none());
        o.give_up_after_attempts = 3;
        o.max_offline_age_ms = 1500;
        o.sim_loss_permille = 100;
        let c = convert(&o).unwrap();
        assert_eq!(c.give_up_after_attempts, Some(3));
        assert_eq!(c.session.max_offline_age, Some(Duration::from_millis(1500)));
        assert_eq!(c.net_sim.map(|s| s.loss), Some(0.1));
        o.sim_loss_permille = 1001;
        assert!(convert(&o).is_err());
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

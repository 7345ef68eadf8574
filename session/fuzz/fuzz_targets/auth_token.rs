//! Arbitrary bytes as an auth token: verification never panics, and only a correctly
//! signed token verifies.
#![no_main]

use libfuzzer_sys::fuzz_target;
use waygate_session::{HmacAuthenticator, KeyRing};

fuzz_target!(|data: &[u8]| {
    let mut ring = KeyRing::new();
    ring.insert(1, b"fuzz key, thirty-two bytes long.");
    let auth = HmacAuthenticator::new(ring);
    let _ = auth.verify(data, 1_800_000_000);
    let _ = waygate_session::auth::token_from_base64url(&String::from_utf8_lossy(data));
});

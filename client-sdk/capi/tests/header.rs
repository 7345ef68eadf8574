//! `include/waygate.h` is what cbindgen generates from the crate source today.
//!
//! Regenerate after changing the API: `WAYGATE_BLESS=1 cargo test -p waygate-client-capi
//! --test header`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::Path;

#[test]
fn header_matches_the_crate_source() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    let path = dir.join("include/waygate.h");
    if std::env::var_os("WAYGATE_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/waygate.h");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != generated {
        let first = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(generated.lines().count()));
        panic!(
            "include/waygate.h is out of date (first difference at line {}).\n\
             Regenerate it with:\n    \
             WAYGATE_BLESS=1 cargo test -p waygate-client-capi --test header\n\
             and commit the result.",
            first + 1
        );
    }
}

#[test]
fn header_declares_the_whole_api() {
    let header = include_str!("../include/waygate.h");
    for name in [
        "waygate_client_new",
        "waygate_client_connect",
        "waygate_client_tick",
        "waygate_client_poll_event",
        "waygate_client_wait_event",
        "waygate_client_send",
        "waygate_client_drop_link",
        "waygate_client_close",
        "waygate_client_stats",
        "waygate_client_free",
        "waygate_result_str",
        "waygate_last_error",
        "WAYGATE_BUFFER_FULL",
        "WAYGATE_OUTCOME_RESTORED_WITH_GAP",
        "WAYGATE_EVENT_EXPIRED",
        "waygate_client_state",
        "WAYGATE_STATE_RECONNECTING",
        "waygate_client_request",
        "waygate_client_sync_clock",
        "waygate_client_clock_offset",
        "WAYGATE_EVENT_REQUEST_FAILED",
        "WAYGATE_EVENT_EVENTS_DROPPED",
        "waygate_set_log_callback",
        "waygate_client_pause",
        "WAYGATE_STATE_PAUSED",
        "WAYGATE_LOG_DEBUG",
        "WAYGATE_CLASS_NORMAL",
        "typedef struct waygate_client waygate_client;",
    ] {
        assert!(header.contains(name), "waygate.h lacks {name}");
    }
}

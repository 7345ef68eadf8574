//! Arbitrary operation sequences into the session machine: it must never panic and must
//! end ACTIVE, EXPIRED or CLOSED with a reason (`sim::run` asserts both).
#![no_main]

use libfuzzer_sys::fuzz_target;
use waygate_session::sim::{run, SimOp};

fuzz_target!(|data: &[u8]| {
    let ops = SimOp::decode_all(data);
    let _ = run(&ops);
});

//! Arbitrary bytes through the backend link codec: must never panic.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use waygate_protocol::link::{LinkCodec, LinkFrame};

fuzz_target!(|data: &[u8]| {
    let codec = LinkCodec::new(64 * 1024);
    let mut buf = BytesMut::from(data);
    while let Ok(Some(frame)) = codec.decode(&mut buf) {
        let mut out = BytesMut::new();
        codec.encode(&frame, &mut out).expect("fits");
        let again = codec.decode(&mut out).expect("valid").expect("complete");
        assert_eq!(again, frame);
    }
    let _ = LinkFrame::decode(bytes::Bytes::copy_from_slice(data));
});

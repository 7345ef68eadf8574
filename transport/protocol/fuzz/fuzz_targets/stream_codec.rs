//! Arbitrary bytes through the client-protocol stream codec and the message decoder: must
//! never panic; every decoded frame must re-encode to a frame that decodes to itself.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use waygate_protocol::codec::{decode_message, StreamCodec};
use waygate_protocol::Frame;

fuzz_target!(|data: &[u8]| {
    let codec = StreamCodec::new(4096);
    let mut buf = BytesMut::from(data);
    while let Ok(Some(frame)) = codec.decode(&mut buf) {
        let again = Frame::decode(frame.to_bytes()).expect("re-encoded frame decodes");
        assert_eq!(again, frame);
    }
    let _ = decode_message(bytes::Bytes::copy_from_slice(data), 4096);
});

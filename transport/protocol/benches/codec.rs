//! Codec throughput: encode and decode of DATA frames with 64-byte and 1 KiB payloads, one
//! frame at a time through the stream codec (length prefix included).

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use waygate_protocol::codec::StreamCodec;
use waygate_protocol::frame::Data;
use waygate_protocol::{Frame, TrafficClass};

fn data(payload: usize) -> Frame {
    Frame::Data(Data {
        class: TrafficClass::Normal,
        msg_id: 1001,
        seq: 123_456,
        ack: Some(654_321),
        payload: Bytes::from(vec![0x5a; payload]),
    })
}

fn codec(c: &mut Criterion) {
    let codec = StreamCodec::new(64 * 1024);
    let mut group = c.benchmark_group("codec");
    for payload in [64usize, 1024] {
        let frame = data(payload);
        group.throughput(Throughput::Elements(1));
        group.bench_with_input(BenchmarkId::new("encode", payload), &frame, |b, frame| {
            let mut out = BytesMut::with_capacity(4096);
            b.iter(|| {
                out.clear();
                codec.encode(black_box(frame), &mut out).expect("fits");
                black_box(out.len())
            })
        });
        let mut wire = BytesMut::new();
        codec.encode(&frame, &mut wire).expect("fits");
        let wire = wire.freeze();
        group.bench_with_input(BenchmarkId::new("decode", payload), &wire, |b, wire| {
            b.iter(|| {
                let mut buf = BytesMut::from(&wire[..]);
                black_box(codec.decode(&mut buf).expect("valid"))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);

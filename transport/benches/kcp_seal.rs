//! Cost of KCP packet sealing (PROTOCOL.md §8.9) per datagram: seal and open of 100-byte and
//! 1,172-byte plaintexts (a small game update; a full segment at mtu 1200), against the copy
//! an unsealed session makes anyway (`to_vec`, measured in the same run: the ratio is what
//! BENCHMARKS.md reports).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use waygate_transport::kcp::seal::session_seals;

fn seal(c: &mut Criterion) {
    let key = [7u8; 32];
    let mut group = c.benchmark_group("kcp_seal");
    for len in [100usize, 1172] {
        let plain = vec![0x5au8; len];
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_with_input(BenchmarkId::new("plain_copy", len), &plain, |b, p| {
            b.iter(|| black_box(p.to_vec()));
        });
        group.bench_with_input(BenchmarkId::new("seal", len), &plain, |b, p| {
            let (mut tx, _) = session_seals(&key, 42, false);
            b.iter(|| black_box(tx.seal(p)));
        });
        group.bench_with_input(BenchmarkId::new("seal_open", len), &plain, |b, p| {
            let (mut tx, _) = session_seals(&key, 42, false);
            let (_, mut rx) = session_seals(&key, 42, true);
            b.iter(|| {
                let d = tx.seal(p);
                black_box(rx.open(&d).map(|v| v.len()).unwrap_or(0))
            });
        });
    }
    group.finish();
}

criterion_group!(benches, seal);
criterion_main!(benches);

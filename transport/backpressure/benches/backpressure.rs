//! Per-message cost of the backpressure stages, alone and together (inbound limiter check +
//! outbound push + pop + governor observe), on a virtual clock advancing 1 µs per message.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};
use waygate_backpressure::{
    Admission, AdmissionConfig, AdmissionControl, GovernorConfig, InboundLimiter, InboundLimits,
    OutboundConfig, OutboundQueue, OverloadGovernor, OverloadInputs, Rate, TokenBucket,
};
use waygate_protocol::TrafficClass;

const STEP: Duration = Duration::from_micros(1);

fn limits() -> InboundLimits {
    // Generous enough that the measured path is the accept path.
    InboundLimits {
        messages_per_sec: 10_000_000,
        message_burst: 10_000_000,
        bytes_per_sec: 1 << 40,
        byte_burst: 1 << 40,
    }
}

fn inputs(i: u64) -> OverloadInputs {
    OverloadInputs {
        loop_lag_ms: i & 0xffff,
        sessions: 1_000,
        memory_bytes: 100 << 20,
    }
}

fn stages(c: &mut Criterion) {
    let mut g = c.benchmark_group("backpressure");
    g.throughput(Throughput::Elements(1));

    g.bench_function("token_bucket_try_take", |b| {
        let mut now = Instant::now();
        let mut bucket = TokenBucket::new(Rate::per_second(1_000_000), 1_000, now);
        b.iter(|| {
            now += STEP;
            black_box(bucket.try_take(now, 1)).ok();
        })
    });

    g.bench_function("inbound_check", |b| {
        let mut now = Instant::now();
        let mut l = InboundLimiter::new(limits(), now);
        b.iter(|| {
            now += STEP;
            let _ = black_box(l.check(now, black_box(64)));
        })
    });

    g.bench_function("outbound_push_pop_normal", |b| {
        let mut q = OutboundQueue::new(OutboundConfig::default());
        // A queue with some depth, as under load.
        for i in 0..64u64 {
            let _ = q.push(TrafficClass::Normal, i, 64, None);
        }
        let mut i = 0u64;
        b.iter(|| {
            i += 1;
            let _ = black_box(q.push(TrafficClass::Normal, i, 64, None));
            black_box(q.pop());
        })
    });

    g.bench_function("outbound_push_coalesce_pop_best_effort", |b| {
        let mut q = OutboundQueue::new(OutboundConfig::default());
        for i in 0..64u64 {
            let _ = q.push(TrafficClass::BestEffort, i, 64, Some(i));
        }
        let mut i = 0u64;
        b.iter(|| {
            i += 1;
            // Two updates of one key: the second coalesces.
            let _ = black_box(q.push(TrafficClass::BestEffort, i, 64, Some(1_000 + i)));
            let _ = black_box(q.push(TrafficClass::BestEffort, i, 64, Some(1_000 + i)));
            black_box(q.pop());
        })
    });

    g.bench_function("governor_observe", |b| {
        let mut now = Instant::now();
        let mut gov =
            OverloadGovernor::new(GovernorConfig::for_limits(100_000, 8 << 30, 1_000), now);
        let mut i = 0u64;
        b.iter(|| {
            now += STEP;
            i += 1;
            black_box(gov.observe(now, inputs(i)));
        })
    });

    g.bench_function("admission_admit_1024_sources", |b| {
        let mut now = Instant::now();
        let cfg = AdmissionConfig {
            global_rate: Rate::per_second(10_000_000),
            global_burst: 10_000_000,
            ..AdmissionConfig::default()
        };
        let mut ac = AdmissionControl::new(cfg, now);
        let mut i = 0u32;
        b.iter(|| {
            now += STEP;
            i = i.wrapping_add(1);
            let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | (i & 1023)));
            match ac.admit(now, ip) {
                Admission::Admit(permit) => drop(black_box(permit)),
                refuse => drop(black_box(refuse)),
            }
        })
    });

    g.bench_function("all_stages_per_message", |b| {
        let mut now = Instant::now();
        let mut l = InboundLimiter::new(limits(), now);
        let mut q = OutboundQueue::new(OutboundConfig::default());
        for i in 0..64u64 {
            let _ = q.push(TrafficClass::Normal, i, 64, None);
        }
        let mut gov =
            OverloadGovernor::new(GovernorConfig::for_limits(100_000, 8 << 30, 1_000), now);
        let mut i = 0u64;
        b.iter(|| {
            now += STEP;
            i += 1;
            let _ = black_box(l.check(now, black_box(64)));
            let _ = black_box(q.push(TrafficClass::Normal, i, 64, None));
            black_box(q.pop());
            black_box(gov.observe(now, inputs(i)));
        })
    });

    g.finish();
}

criterion_group!(benches, stages);
criterion_main!(benches);

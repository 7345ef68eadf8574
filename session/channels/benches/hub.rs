//! The channel hub's publish path when the histories' byte budget binds and the publishing
//! channel keeps one publication (so another channel's oldest must go): the budget's
//! "oldest of any channel" over 10,000 channels.

#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Instant;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use waygate_channels::{ChannelHub, ChannelsConfig, KindPolicy};
use waygate_protocol::TrafficClass;

const CHANNELS: usize = 10_000;

fn hub() -> ChannelHub {
    let kind = KindPolicy {
        history_len: 1,
        history_ttl_ms: 3_600_000,
        max_members: 8,
        max_body: 64,
        publish_rate: 1_000_000_000,
        publish_burst: 1_000_000_000,
        queue_critical: 8,
        queue_normal: 8,
        queue_best_effort: 8,
        backlog: false,
    };
    let config = ChannelsConfig {
        max_channels: CHANNELS + 1,
        kinds: [("guild".to_owned(), kind)].into_iter().collect(),
        // About half the channels' one publication each fits: every publish evicts.
        history_budget_bytes: 64 * 1024,
        ..ChannelsConfig::default()
    };
    ChannelHub::new(config, 1)
}

fn drain(hub: &mut ChannelHub) {
    while let Some(ch) = hub.poll_ready() {
        while hub.next_delivery(&ch).is_some() {}
    }
}

fn publish_over_budget(c: &mut Criterion) {
    let mut hub = hub();
    let now = Instant::now();
    let names: Vec<String> = (0..CHANNELS).map(|i| format!("guild:{i}")).collect();
    let body = Bytes::from_static(&[7; 16]);
    for name in &names {
        hub.publish(now, name, 0, TrafficClass::Normal, body.clone())
            .unwrap();
        drain(&mut hub);
    }
    let mut i = 0usize;
    c.bench_function(
        "channels/publish over the history budget, 10k channels",
        |b| {
            b.iter(|| {
                i = (i + 1) % CHANNELS;
                hub.publish(now, &names[i], 0, TrafficClass::Normal, body.clone())
                    .unwrap();
                drain(&mut hub);
            })
        },
    );
}

criterion_group!(benches, publish_over_budget);
criterion_main!(benches);

use super::*;
use proptest::prelude::*;
use TrafficClass::{BestEffort as B, Critical as C, Normal as N};

fn config() -> OutboundConfig {
    OutboundConfig {
        max_messages: 10,
        max_bytes: 1_000,
        reserve_messages: 2,
        reserve_bytes: 200,
        high_watermark_permille: 700,
        low_watermark_permille: 300,
    }
}

fn pops(q: &mut OutboundQueue<u32>) -> Vec<(TrafficClass, u32)> {
    q.drain().map(|p| (p.class, p.item)).collect()
}

#[test]
fn pops_in_push_order_across_classes_when_asked() {
    let mut q = OutboundQueue::new(config());
    for (i, class) in [B, N, C, B, N, C, N].into_iter().enumerate() {
        assert_eq!(q.push(class, i as u32, 10, None), PushOutcome::Queued);
    }
    // A best-effort message coalesced in place keeps its place.
    assert_eq!(q.push(B, 7, 10, Some(9)), PushOutcome::Queued);
    assert_eq!(q.push(B, 8, 10, Some(9)), PushOutcome::Coalesced);
    let order: Vec<u32> = q.drain_in_order().map(|p| p.item).collect();
    assert_eq!(order, vec![0, 1, 2, 3, 4, 5, 6, 8]);
    assert!(q.is_empty());
    assert_eq!(q.bytes(), 0);
    assert_eq!(q.stats().class(C).popped, 2);
}

#[test]
fn pops_in_class_order_and_fifo_within_a_class() {
    let mut q = OutboundQueue::new(config());
    for (i, class) in [B, N, C, B, N, C, N].into_iter().enumerate() {
        assert_eq!(q.push(class, i as u32, 10, None), PushOutcome::Queued);
    }
    assert_eq!(q.peek_class(), Some(C));
    assert_eq!(
        pops(&mut q),
        vec![(C, 2), (C, 5), (N, 1), (N, 4), (N, 6), (B, 0), (B, 3)]
    );
    assert!(q.is_empty());
    assert_eq!(q.bytes(), 0);
    assert_eq!(q.stats().class(N).popped, 3);
}

#[test]
fn count_bound_evicts_best_effort_then_refuses_normal() {
    let mut q = OutboundQueue::new(config());
    for i in 0..4 {
        assert_eq!(q.push(B, i, 1, None), PushOutcome::Queued);
    }
    for i in 10..14 {
        assert_eq!(q.push(N, i, 1, None), PushOutcome::Queued);
    }
    // 8 = the non-critical limit (10 - reserve 2): normal evicts the oldest best-effort.
    assert_eq!(
        q.push(N, 14, 1, None),
        PushOutcome::DroppedBestEffort { evicted: 1 }
    );
    assert_eq!(q.len(), 8);
    // A new best-effort evicts an older best-effort.
    assert_eq!(
        q.push(B, 4, 1, None),
        PushOutcome::DroppedBestEffort { evicted: 1 }
    );
    for i in 15..18 {
        assert!(matches!(
            q.push(N, i, 1, None),
            PushOutcome::DroppedBestEffort { evicted: 1 }
        ));
    }
    assert_eq!(q.class_len(B), 0);
    assert_eq!(q.push(N, 99, 1, None), PushOutcome::Refused { item: 99 });
    assert_eq!(q.push(B, 98, 1, None), PushOutcome::Refused { item: 98 });
    // Critical uses the reserve.
    assert_eq!(q.push(C, 100, 1, None), PushOutcome::Queued);
    assert_eq!(q.push(C, 101, 1, None), PushOutcome::Queued);
    assert_eq!(
        q.push(C, 102, 1, None),
        PushOutcome::SlowConsumer { item: 102 }
    );
    assert_eq!(q.len(), 10);
    let s = q.stats();
    assert_eq!(s.class(B).dropped, 6);
    assert_eq!(s.class(N).refused, 1);
    assert_eq!(s.class(C).refused, 1);
    assert_eq!(s.class(C).dropped, 0);
    assert_eq!(s.class(N).dropped, 0);
}

#[test]
fn byte_bound_evicts_oldest_best_effort_first() {
    let mut q = OutboundQueue::new(config());
    assert_eq!(q.push(B, 1, 300, None), PushOutcome::Queued);
    assert_eq!(q.push(B, 2, 300, None), PushOutcome::Queued);
    assert_eq!(q.push(N, 3, 150, None), PushOutcome::Queued);
    // 750 + 100 > 800 (the non-critical byte limit): the oldest best-effort goes.
    assert_eq!(
        q.push(N, 4, 100, None),
        PushOutcome::DroppedBestEffort { evicted: 1 }
    );
    assert_eq!(q.bytes(), 550);
    // Critical may go to 1000 bytes, evicting best-effort first.
    assert_eq!(
        q.push(C, 5, 700, None),
        PushOutcome::DroppedBestEffort { evicted: 1 }
    );
    assert_eq!(q.bytes(), 950);
    assert_eq!(
        q.push(C, 6, 51, None),
        PushOutcome::SlowConsumer { item: 6 }
    );
    assert_eq!(q.push(C, 7, 50, None), PushOutcome::Queued);
    assert_eq!(pops(&mut q), vec![(C, 5), (C, 7), (N, 3), (N, 4)]);
}

#[test]
fn oversized_messages_are_refused_without_evicting() {
    let mut q = OutboundQueue::new(config());
    assert_eq!(q.push(B, 1, 10, None), PushOutcome::Queued);
    assert_eq!(q.push(N, 2, 801, None), PushOutcome::Refused { item: 2 });
    assert_eq!(
        q.push(C, 3, 1001, None),
        PushOutcome::SlowConsumer { item: 3 }
    );
    assert_eq!(q.class_len(B), 1);
}

#[test]
fn coalescing_is_newest_wins_in_place() {
    let mut q = OutboundQueue::new(config());
    assert_eq!(q.push(B, 1, 10, Some(7)), PushOutcome::Queued);
    assert_eq!(q.push(B, 2, 10, Some(8)), PushOutcome::Queued);
    assert_eq!(q.push(B, 3, 20, Some(7)), PushOutcome::Coalesced);
    assert_eq!(q.len(), 2);
    assert_eq!(q.bytes(), 30);
    // Key 7 kept its place ahead of key 8, with the newest value.
    assert_eq!(pops(&mut q), vec![(B, 3), (B, 2)]);
    // After it was sent, the same key queues anew.
    assert_eq!(q.push(B, 4, 10, Some(7)), PushOutcome::Queued);
    // Keys only apply to best-effort.
    assert_eq!(q.push(N, 5, 10, Some(7)), PushOutcome::Queued);
    assert_eq!(q.push(N, 6, 10, Some(7)), PushOutcome::Queued);
    assert_eq!(q.stats().class(B).coalesced, 1);
}

#[test]
fn coalescing_that_does_not_fit_in_place_requeues_at_the_tail() {
    let mut q = OutboundQueue::new(config());
    assert_eq!(q.push(B, 1, 100, Some(1)), PushOutcome::Queued);
    assert_eq!(q.push(B, 2, 300, Some(2)), PushOutcome::Queued);
    assert_eq!(q.push(N, 3, 300, None), PushOutcome::Queued);
    // Key 1 grows to 450: 700 - 100 + 450 > 800. It leaves its place, and to fit at the tail
    // the oldest other best-effort (key 2) is evicted.
    assert_eq!(
        q.push(B, 4, 450, Some(1)),
        PushOutcome::DroppedBestEffort { evicted: 1 }
    );
    assert_eq!(q.bytes(), 750);
    assert_eq!(pops(&mut q), vec![(N, 3), (B, 4)]);
    let s = q.stats().class(B);
    assert_eq!((s.coalesced, s.dropped), (1, 1));
}

#[test]
fn watermarks_have_hysteresis() {
    let mut q = OutboundQueue::new(config());
    // High: above 7 messages or 700 bytes. Low: below 3 messages and 300 bytes.
    for i in 0..7 {
        let _ = q.push(N, i, 10, None);
        assert!(!q.is_congested());
    }
    let _ = q.push(N, 7, 10, None);
    assert!(q.is_congested());
    for expect_congested in [true, true, true, true, true, false] {
        q.pop();
        assert_eq!(q.is_congested(), expect_congested, "len {}", q.len());
    }
    assert_eq!(q.len(), 2);
    // Bytes alone also trip it.
    let _ = q.push(C, 100, 690, None);
    assert!(q.is_congested());
    assert_eq!(q.stats().congested_episodes, 2);
}

#[test]
fn shedding_and_draining() {
    let mut q = OutboundQueue::new(config());
    let _ = q.push(B, 1, 10, Some(1));
    let _ = q.push(N, 2, 10, None);
    let _ = q.push(B, 3, 10, None);
    assert_eq!(q.shed_best_effort(), 2);
    assert_eq!(q.stats().class(B).dropped, 2);
    assert_eq!(q.push(B, 4, 10, Some(1)), PushOutcome::Queued);
    assert_eq!(pops(&mut q), vec![(N, 2), (B, 4)]);
    assert!(q.keys.as_ref().is_none_or(|k| k.is_empty()));
}

#[test]
fn config_validation() {
    assert!(OutboundConfig::default().validate(64 * 1024).is_ok());
    assert!(config().validate(801).is_err());
    let mut c = config();
    c.low_watermark_permille = 700;
    assert!(c.validate(10).unwrap_err().contains("watermark"));
}

// ---- property test against a model ----

#[derive(Debug, Clone)]
enum Op {
    Push {
        class: TrafficClass,
        len: usize,
        key: Option<u64>,
    },
    Pop,
    Shed,
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..3, 0usize..300, proptest::option::of(0u64..4)).prop_map(|(c, len, key)| Op::Push {
            class: TrafficClass::ALL[c as usize],
            len,
            key,
        }),
        3 => Just(Op::Pop),
        1 => Just(Op::Shed),
    ]
}

#[derive(Debug, Clone, Copy)]
struct M {
    class: TrafficClass,
    id: u32,
    len: usize,
    key: Option<u64>,
}

/// The straightforward reference: one Vec in push order, linear scans.
#[derive(Default)]
struct Model {
    entries: Vec<M>,
    congested: bool,
}

impl Model {
    fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.len).sum()
    }

    fn limits(cfg: &OutboundConfig, class: TrafficClass) -> (usize, usize) {
        if class == C {
            (cfg.max_messages, cfg.max_bytes)
        } else {
            (
                cfg.max_messages - cfg.reserve_messages,
                cfg.max_bytes - cfg.reserve_bytes,
            )
        }
    }

    fn push(
        &mut self,
        cfg: &OutboundConfig,
        class: TrafficClass,
        id: u32,
        len: usize,
        key: Option<u64>,
    ) -> PushOutcome<u32> {
        let (max_m, max_b) = Self::limits(cfg, class);
        let key = if class == B { key } else { None };
        let mut coalesced = false;
        if let Some(k) = key {
            if let Some(i) = self
                .entries
                .iter()
                .position(|e| e.class == B && e.key == Some(k))
            {
                let others = self.bytes() - self.entries[i].len;
                if others + len <= max_b {
                    self.entries[i].id = id;
                    self.entries[i].len = len;
                    return PushOutcome::Coalesced;
                }
                self.entries.remove(i);
                coalesced = true;
            }
        }
        let keep: Vec<&M> = self.entries.iter().filter(|e| e.class != B).collect();
        let keep_bytes: usize = keep.iter().map(|e| e.len).sum();
        if keep.len() + 1 > max_m || keep_bytes + len > max_b {
            return match class {
                C => PushOutcome::SlowConsumer { item: id },
                _ => PushOutcome::Refused { item: id },
            };
        }
        let mut evicted = 0;
        while self.entries.len() + 1 > max_m || self.bytes() + len > max_b {
            let i = self.entries.iter().position(|e| e.class == B).unwrap();
            self.entries.remove(i);
            evicted += 1;
        }
        self.entries.push(M {
            class,
            id,
            len,
            key,
        });
        match (evicted, coalesced) {
            (0, true) => PushOutcome::Coalesced,
            (0, false) => PushOutcome::Queued,
            (evicted, _) => PushOutcome::DroppedBestEffort { evicted },
        }
    }

    fn pop(&mut self) -> Option<(TrafficClass, u32)> {
        let class = TrafficClass::ALL
            .into_iter()
            .find(|&c| self.entries.iter().any(|e| e.class == c))?;
        let i = self.entries.iter().position(|e| e.class == class)?;
        let e = self.entries.remove(i);
        Some((e.class, e.id))
    }

    /// Thresholds are floor(max * permille / 1000): congested above high, cleared below low
    /// (a low threshold of 0 means "empty").
    fn update_watermarks(&mut self, cfg: &OutboundConfig) {
        let at = |max: usize, p: u16| max * usize::from(p) / 1000;
        let (m, b) = (self.entries.len(), self.bytes());
        if self.congested {
            let low_m = at(cfg.max_messages, cfg.low_watermark_permille).max(1);
            let low_b = at(cfg.max_bytes, cfg.low_watermark_permille).max(1);
            if m < low_m && b < low_b {
                self.congested = false;
            }
        } else if m > at(cfg.max_messages, cfg.high_watermark_permille)
            || b > at(cfg.max_bytes, cfg.high_watermark_permille)
        {
            self.congested = true;
        }
    }
}

fn arb_config() -> impl Strategy<Value = OutboundConfig> {
    (
        2usize..20,
        300usize..3_000,
        0usize..3,
        0usize..300,
        1u16..1000,
    )
        .prop_flat_map(|(max_messages, max_bytes, rm, rb, high)| {
            (0..high).prop_map(move |low| OutboundConfig {
                max_messages,
                max_bytes,
                reserve_messages: rm.min(max_messages - 1),
                reserve_bytes: rb,
                high_watermark_permille: high,
                low_watermark_permille: low,
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn matches_the_model_and_never_exceeds_bounds(
        cfg in arb_config(),
        ops in proptest::collection::vec(arb_op(), 1..300),
    ) {
        let mut q = OutboundQueue::new(cfg);
        let mut model = Model::default();
        let mut next_id = 0u32;
        let mut critical_in = 0u64;
        let mut critical_out = 0u64;
        let mut was_congested = false;
        for op in ops {
            match op {
                Op::Push { class, len, key } => {
                    let id = next_id;
                    next_id += 1;
                    let got = q.push(class, id, len, key);
                    let want = model.push(&cfg, class, id, len, key);
                    prop_assert_eq!(&got, &want, "push {:?} {} {:?}", class, len, key);
                    if class == C {
                        critical_in += 1;
                        if let PushOutcome::SlowConsumer { .. } = got {
                            critical_out += 1;
                        }
                    }
                }
                Op::Pop => {
                    let got = q.pop().map(|p| (p.class, p.item));
                    prop_assert_eq!(got, model.pop());
                    if let Some((C, _)) = got {
                        critical_out += 1;
                    }
                }
                Op::Shed => {
                    q.shed_best_effort();
                    model.entries.retain(|e| e.class != B);
                }
            }
            model.update_watermarks(&cfg);
            prop_assert!(q.len() <= cfg.max_messages);
            prop_assert!(q.bytes() <= cfg.max_bytes);
            prop_assert_eq!(q.len(), model.entries.len());
            prop_assert_eq!(q.bytes(), model.bytes());
            for c in TrafficClass::ALL {
                let of_class = model.entries.iter().filter(|e| e.class == c);
                prop_assert_eq!(q.class_len(c), of_class.clone().count());
                prop_assert_eq!(q.class_bytes(c), of_class.map(|e| e.len).sum::<usize>());
            }
            prop_assert_eq!(q.is_congested(), model.congested);
            if q.is_congested() != was_congested {
                // It turns on only above high and off only below low.
                let fill = (q.len() * 1000).max(1) / cfg.max_messages.max(1);
                let fill = fill.max(q.bytes() * 1000 / cfg.max_bytes);
                if q.is_congested() {
                    prop_assert!(fill >= usize::from(cfg.high_watermark_permille));
                } else {
                    prop_assert!(fill <= usize::from(cfg.low_watermark_permille));
                }
            }
            was_congested = q.is_congested();
            // Keys index exactly the queued best-effort entries that carry a key.
            let keyed = model.entries.iter().filter(|e| e.class == B && e.key.is_some()).count();
            prop_assert_eq!(q.keys.as_ref().map_or(0, |k| k.len()), keyed);
            // Critical is never dropped: each one pushed is queued, popped or handed back.
            prop_assert_eq!(critical_in, critical_out + q.class_len(C) as u64);
            prop_assert_eq!(q.stats().class(C).dropped + q.stats().class(N).dropped, 0);
        }
    }
}

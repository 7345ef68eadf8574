//! Layer 2: weighted rendezvous hashing (SPEC R2).
//!
//! For a key `k` every candidate instance `i` with weight `w_i > 0` gets
//! `score(k, i) = w_i / -ln(u(k, i))` (equivalently the minimum of `-ln(u)/w`), with
//! `u = unit_interval(pair_hash(k, i))` from [`crate::hash`]; the highest score wins.
//!
//! Exact rule (pinned by the golden vectors):
//! 1. Candidates are grouped by weight (bit-identical `f64`). Within a group the score is a
//!    strictly increasing function of `u`, so the group's winner is the largest `u`, compared
//!    exactly as the integer `pair_hash >> 12` (no floating point), ties to the smaller
//!    instance id.
//! 2. Each group winner's score is computed with [`crate::hash::stable_ln`]; the largest score
//!    wins, ties to the smaller instance id.
//!
//! This is the textbook argmax, computed with one logarithm per distinct weight instead of
//! one per instance. The result depends only on the set of (id, weight) pairs, never on
//! their order. Removing an instance only moves the keys it won; a weight of 0 (or a
//! non-finite or negative one) takes no keys.

use crate::hash::{instance_hash, key_hash, pair_hash, stable_ln, unit_interval};

#[derive(Debug, Clone)]
struct Node {
    id: String,
    weight: f64,
    hash: u64,
}

#[derive(Debug, Clone)]
struct Group {
    weight: f64,
    members: Vec<usize>,
}

/// A compiled set of weighted candidates. Indices returned by the `pick*` methods are
/// positions in the slice the ring was built from.
#[derive(Debug, Clone, Default)]
pub struct Rendezvous {
    nodes: Vec<Node>,
    groups: Vec<Group>,
}

impl Rendezvous {
    /// Builds a ring from `(instance id, weight)` pairs. Candidates with a weight that is not
    /// finite and positive are kept (indices stay aligned) but never chosen.
    pub fn new<I, S>(candidates: I) -> Self
    where
        I: IntoIterator<Item = (S, f64)>,
        S: Into<String>,
    {
        let nodes: Vec<Node> = candidates
            .into_iter()
            .map(|(id, weight)| {
                let id = id.into();
                let hash = instance_hash(&id);
                Node { id, weight, hash }
            })
            .collect();
        let mut groups: Vec<Group> = Vec::new();
        for (idx, n) in nodes.iter().enumerate() {
            if !(n.weight.is_finite() && n.weight > 0.0) {
                continue;
            }
            match groups
                .iter_mut()
                .find(|g| g.weight.to_bits() == n.weight.to_bits())
            {
                Some(g) => g.members.push(idx),
                None => groups.push(Group {
                    weight: n.weight,
                    members: vec![idx],
                }),
            }
        }
        Self { nodes, groups }
    }

    /// Number of candidates (including weight-0 ones).
    #[must_use]
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the ring has no candidates at all.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Id of candidate `idx`.
    #[must_use]
    pub fn id(&self, idx: usize) -> Option<&str> {
        self.nodes.get(idx).map(|n| n.id.as_str())
    }

    /// The winning instance id for `key` among all positive-weight candidates.
    #[must_use]
    pub fn pick(&self, key: &str) -> Option<&str> {
        self.pick_index_where(key, |_| true)
            .and_then(|i| self.id(i))
    }

    /// The winning candidate index for `key` among those for which `eligible(index)` holds
    /// (the router skips draining, disabled, unhealthy and full instances this way).
    pub fn pick_index_where(
        &self,
        key: &str,
        mut eligible: impl FnMut(usize) -> bool,
    ) -> Option<usize> {
        let kh = key_hash(key);
        let mut best: Option<(f64, usize)> = None;
        for g in &self.groups {
            let mut gbest: Option<(u64, usize)> = None;
            for &idx in &g.members {
                let n = &self.nodes[idx];
                // Only the 52 bits that make up `u` count, so equal `u` ties go to the id.
                let h = pair_hash(kh, n.hash) >> 12;
                let better = match gbest {
                    None => true,
                    Some((bh, bi)) => h > bh || (h == bh && n.id < self.nodes[bi].id),
                };
                if better && eligible(idx) {
                    gbest = Some((h, idx));
                }
            }
            let Some((h, idx)) = gbest else { continue };
            let score = g.weight / -stable_ln(unit_interval(h << 12));
            let better = match best {
                None => true,
                Some((bs, bi)) => {
                    score > bs || (score == bs && self.nodes[idx].id < self.nodes[bi].id)
                }
            };
            if better {
                best = Some((score, idx));
            }
        }
        best.map(|(_, i)| i)
    }

    /// The score of `key` on instance `id` with `weight` (the textbook formula, for tests,
    /// tooling and documentation; `pick*` compare the same quantity).
    #[must_use]
    pub fn score(key: &str, id: &str, weight: f64) -> f64 {
        if !(weight.is_finite() && weight > 0.0) {
            return f64::NEG_INFINITY;
        }
        weight / -stable_ln(unit_interval(pair_hash(key_hash(key), instance_hash(id))))
    }

    /// Reference implementation: one score per instance, argmax, ties to the smaller id.
    /// Slower than [`Rendezvous::pick`]; used by tests and the benchmark as a baseline.
    #[must_use]
    pub fn pick_naive<'a>(key: &str, candidates: &'a [(&'a str, f64)]) -> Option<&'a str> {
        let mut best: Option<(f64, &str)> = None;
        for &(id, w) in candidates {
            if !(w.is_finite() && w > 0.0) {
                continue;
            }
            let s = Self::score(key, id, w);
            if best.is_none_or(|(bs, bid)| s > bs || (s == bs && id < bid)) {
                best = Some((s, id));
            }
        }
        best.map(|(_, id)| id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_zero_weight() {
        assert_eq!(Rendezvous::new(Vec::<(String, f64)>::new()).pick("k"), None);
        let r = Rendezvous::new([("a", 0.0), ("b", f64::NAN), ("c", -1.0)]);
        assert_eq!(r.pick("k"), None);
        let r = Rendezvous::new([("a", 0.0), ("b", 1.0)]);
        assert_eq!(r.pick("k"), Some("b"));
    }

    #[test]
    fn matches_naive() {
        let cands = [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 0.5)];
        let r = Rendezvous::new(cands);
        for i in 0..5000 {
            let k = format!("key-{i}");
            assert_eq!(r.pick(&k), Rendezvous::pick_naive(&k, &cands), "{k}");
        }
    }

    #[test]
    fn eligibility_filter() {
        let r = Rendezvous::new([("a", 1.0), ("b", 1.0)]);
        for i in 0..100 {
            let k = format!("k{i}");
            let first = r.pick_index_where(&k, |_| true).expect("some");
            let other = r.pick_index_where(&k, |x| x != first).expect("some");
            assert_ne!(first, other);
            assert_eq!(r.pick_index_where(&k, |_| false), None);
        }
    }
}

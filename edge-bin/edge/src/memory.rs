//! Giving freed memory back to the operating system (hardening item 13). glibc keeps what a
//! burst of connections freed in its per-thread arenas, so 3,500 pre-auth connections that
//! came and went left the edge's resident memory at its peak. [`TrimPolicy`] (sans-IO)
//! decides when enough went away to be worth a trim; [`give_back`] asks the allocator to
//! return its free pages (`malloc_trim`). Never frees anything itself.

/// Follow-up trims after a drop ([`TrimPolicy::follow_up`]): the connections still closing
/// when the drop was seen free their memory over the next ticks.
pub const FOLLOW_UP_TRIMS: u8 = 5;

/// When to trim: after the number of live connections and sessions fell by at least
/// `min_drop` below the highest seen since the last trim, and on the next
/// [`FOLLOW_UP_TRIMS`] ticks after that.
#[derive(Debug, Clone)]
pub struct TrimPolicy {
    min_drop: u64,
    high_water: u64,
    follow_ups: u8,
}

impl TrimPolicy {
    /// Trims after a drop of `min_drop` (at least 1).
    pub fn new(min_drop: u64) -> Self {
        Self {
            min_drop: min_drop.max(1),
            high_water: 0,
            follow_ups: 0,
        }
    }

    /// Observes the live count; returns whether to trim now (then the count is the new
    /// high-water mark).
    pub fn observe(&mut self, live: u64) -> bool {
        if live > self.high_water {
            self.high_water = live;
            return false;
        }
        if self.high_water - live >= self.min_drop {
            self.high_water = live;
            self.follow_ups = FOLLOW_UP_TRIMS;
            return true;
        }
        false
    }

    /// On a tick whose [`observe`](Self::observe) said no: whether to trim anyway, once on
    /// each of the [`FOLLOW_UP_TRIMS`] ticks after a drop. A drop is seen while it happens
    /// (a tick may count 400 of 3,500 closing connections still live); without these, what
    /// the last few hundred freed stayed with the allocator (CI: 4 MiB of 14 after 10 s).
    pub fn follow_up(&mut self) -> bool {
        if self.follow_ups == 0 {
            return false;
        }
        self.follow_ups -= 1;
        true
    }
}

/// Asks the allocator to return free memory to the operating system; whether it did.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn give_back() -> bool {
    // SAFETY: malloc_trim takes a plain integer and only walks glibc's own heap structures
    // under glibc's locks; it touches no memory Rust owns.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Other allocators return memory on their own; nothing to do.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn give_back() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_once_per_drop_of_the_threshold() {
        let mut p = TrimPolicy::new(100);
        assert!(!p.observe(50));
        assert!(!p.observe(500));
        assert!(!p.observe(420), "a drop of 80 is not enough");
        assert!(p.observe(400), "a drop of 100 is");
        assert!(!p.observe(350), "counted from the last trim");
        assert!(!p.observe(301));
        assert!(p.observe(300));
        assert!(!p.observe(1_000));
        assert!(p.observe(0));
        assert!(!p.observe(0));
    }

    /// After a drop, the next ticks trim too (the tail of the drop), then no more.
    #[test]
    fn a_drop_is_followed_by_a_few_trims() {
        let mut p = TrimPolicy::new(512);
        assert!(!p.follow_up(), "nothing dropped yet");
        assert!(!p.observe(3_500));
        assert!(p.observe(400));
        for _ in 0..FOLLOW_UP_TRIMS {
            assert!(!p.observe(0), "400 -> 0 is under the threshold");
            assert!(p.follow_up());
        }
        assert!(!p.follow_up());
    }

    #[test]
    fn give_back_can_be_called_any_time() {
        let v: Vec<Vec<u8>> = (0..1_000).map(|_| vec![1u8; 4096]).collect();
        drop(v);
        let _ = give_back();
        let _ = give_back();
    }
}

//! Giving freed memory back to the operating system (hardening item 13). glibc keeps what a
//! burst of connections freed in its per-thread arenas, so 3,500 pre-auth connections that
//! came and went left the edge's resident memory at its peak. [`TrimPolicy`] (sans-IO)
//! decides when enough went away to be worth a trim; [`give_back`] asks the allocator to
//! return its free pages (`malloc_trim`). Never frees anything itself.

/// When to trim: after the number of live connections and sessions fell by at least
/// `min_drop` below the highest seen since the last trim.
#[derive(Debug, Clone)]
pub struct TrimPolicy {
    min_drop: u64,
    high_water: u64,
}

impl TrimPolicy {
    /// Trims after a drop of `min_drop` (at least 1).
    pub fn new(min_drop: u64) -> Self {
        Self {
            min_drop: min_drop.max(1),
            high_water: 0,
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
            return true;
        }
        false
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

    #[test]
    fn give_back_can_be_called_any_time() {
        let v: Vec<Vec<u8>> = (0..1_000).map(|_| vec![1u8; 4096]).collect();
        drop(v);
        let _ = give_back();
        let _ = give_back();
    }
}

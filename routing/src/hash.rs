//! The pinned, platform-independent hash behind every placement decision.
//!
//! **Changing anything in this file moves players between instances.** The golden vectors in
//! `tests/golden_rendezvous.txt` pin the outputs; a failing golden test is a production
//! incident in waiting, not a test to regenerate.
//!
//! Definition (all integers little-endian, all arithmetic wrapping on `u64`):
//!
//! ```text
//! fnv(bytes)        = FNV-1a 64 (offset 0xcbf29ce484222325, prime 0x100000001b3)
//!                     over  u64_le(len(bytes)) || bytes
//! splitmix64(z)     = z += 0x9e3779b97f4a7c15;
//!                     z = (z ^ z>>30) * 0xbf58476d1ce4e5b9;
//!                     z = (z ^ z>>27) * 0x94d049bb133111eb;
//!                     z ^ z>>31
//! key_hash(k)       = splitmix64(fnv(k))
//! instance_hash(id) = splitmix64(fnv(id) ^ 0x5741_5947_4154_4531)   ("WAYGATE1")
//! pair_hash(k, id)  = splitmix64(key_hash(k) ^ instance_hash(id))
//! unit(h)           = ((h >> 12) + 0.5) / 2^52          in (0, 1), never 0 or 1
//! ```
//!
//! `instance_hash` is computed once per instance when a ring is built and `key_hash` once
//! per decision, so a decision costs one `splitmix64` per candidate instance.
//!
//! The natural logarithm used for weighted scores is [`stable_ln`], written here with only
//! IEEE-754 `+ - * /` (correctly rounded everywhere) instead of the platform's `libm`, whose
//! last bit may differ between operating systems.
//!
//! This is not a cryptographic hash: a client that chooses its own player id could aim at an
//! instance. Player ids are issued by the login service, so this is acceptable.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
const INSTANCE_DOMAIN: u64 = 0x5741_5947_4154_4531;
const CANARY_DOMAIN: u64 = 0x4341_4e41_5259_3031;

/// FNV-1a 64 over the length (u64 little-endian) followed by the bytes.
#[must_use]
pub fn fnv1a64_prefixed(bytes: &[u8]) -> u64 {
    let mut h = FNV_OFFSET;
    for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// The splitmix64 finalizer (Steele, Lea, Flood 2014).
#[must_use]
pub const fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Per-decision half of the pair hash.
#[must_use]
pub fn key_hash(key: &str) -> u64 {
    splitmix64(fnv1a64_prefixed(key.as_bytes()))
}

/// Per-instance half of the pair hash (precomputed when a ring is built).
#[must_use]
pub fn instance_hash(id: &str) -> u64 {
    splitmix64(fnv1a64_prefixed(id.as_bytes()) ^ INSTANCE_DOMAIN)
}

/// The stable 64-bit hash of (key, instance id) from its two precomputed halves.
#[must_use]
pub const fn pair_hash(key_hash: u64, instance_hash: u64) -> u64 {
    splitmix64(key_hash ^ instance_hash)
}

/// Maps a hash into the open interval (0, 1): never 0 (ln would be -inf) nor 1 (score inf).
#[must_use]
pub fn unit_interval(h: u64) -> f64 {
    // 52 bits + 0.5 fit a f64 mantissa exactly, so the result is exact.
    ((h >> 12) as f64 + 0.5) * (1.0 / 4_503_599_627_370_496.0)
}

/// Bucket in `0..10_000` (basis points) for the canary of `salt` (the service name):
/// a player is in the canary when `canary_bucket < percent * 100`.
#[must_use]
pub fn canary_bucket(player: &str, salt: &str) -> u32 {
    let h = pair_hash(
        key_hash(player),
        fnv1a64_prefixed(salt.as_bytes()) ^ CANARY_DOMAIN,
    );
    // Multiply-shift instead of modulo: unbiased enough and platform independent.
    ((u128::from(h) * 10_000u128) >> 64) as u32
}

/// Natural logarithm from IEEE-754 basic operations only, so that it is bit-identical on
/// every platform. Valid for finite `x > 0` in the normal range (the crate only passes
/// [`unit_interval`] values, at least 2^-53).
#[must_use]
pub fn stable_ln(x: f64) -> f64 {
    // fdlibm's split of ln 2: the high part has 32 trailing zero bits, so `e * LN2_HI` is exact.
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    const SQRT2: f64 = std::f64::consts::SQRT_2;
    if x.is_nan() || x <= 0.0 || x.is_infinite() {
        return f64::NAN;
    }
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | (1023u64 << 52));
    if m > SQRT2 {
        m *= 0.5;
        e += 1;
    }
    // ln(m) = 2 atanh(s), s = (m-1)/(m+1), |s| <= 0.1716: 13 odd terms reach < 1 ulp.
    let s = (m - 1.0) / (m + 1.0);
    let z = s * s;
    let mut p = 1.0 / 25.0;
    for k in (0..12).rev() {
        p = p * z + 1.0 / (2 * k + 1) as f64;
    }
    let ln_m = 2.0 * s * p;
    let ef = e as f64;
    ef * LN2_HI + (ln_m + ef * LN2_LO)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_known_values() {
        // Length prefix of 0 = eight zero bytes.
        assert_eq!(fnv1a64_prefixed(b""), {
            let mut h = FNV_OFFSET;
            for _ in 0..8 {
                h = h.wrapping_mul(FNV_PRIME);
            }
            h
        });
        assert_ne!(fnv1a64_prefixed(b"a"), fnv1a64_prefixed(b"b"));
    }

    #[test]
    fn pinned_values() {
        // Pins the definition above; see the module docs before touching.
        assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
        assert_eq!(key_hash("player-0"), key_hash("player-0"));
    }

    #[test]
    fn unit_interval_is_open() {
        assert!(unit_interval(0) > 0.0);
        assert!(unit_interval(u64::MAX) < 1.0);
        assert!(stable_ln(unit_interval(u64::MAX)) < 0.0);
    }

    #[test]
    fn stable_ln_close_to_libm() {
        for i in 1..10_000u64 {
            let x = unit_interval(splitmix64(i));
            let a = stable_ln(x);
            let b = x.ln();
            assert!(
                (a - b).abs() <= 4.0 * f64::EPSILON * b.abs().max(1e-300),
                "{x}: {a} vs {b}"
            );
        }
        assert!((stable_ln(0.5) + std::f64::consts::LN_2).abs() < 1e-15);
        assert_eq!(stable_ln(1.0), 0.0);
        assert!(stable_ln(0.0).is_nan());
    }

    #[test]
    fn canary_bucket_range() {
        for i in 0..1000 {
            assert!(canary_bucket(&format!("player-{i}"), "svc") < 10_000);
        }
    }
}

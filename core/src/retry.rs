//! Retry-After: its configuration, the hint, and the arithmetic that needs no ledger. What a
//! ledger's leases are expected to free, and when, is `ledger::retry_after`.

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryAfterConfig {
    pub min_ms: u64,
    pub max_ms: u64,
    /// Fraction in [0, 1]: the wait is multiplied by a random factor in [1, 1 + jitter].
    pub jitter: f64,
    /// Assumed lease lifetime before any lease has been released.
    pub default_lease_ms: u64,
}

impl Default for RetryAfterConfig {
    fn default() -> Self {
        RetryAfterConfig {
            min_ms: 1000,
            max_ms: 30_000,
            jitter: 0.25,
            default_lease_ms: 5_000,
        }
    }
}

/// A retry hint; `seconds` is `ms` rounded up (the `Retry-After` header has whole seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryAfter {
    pub ms: u64,
    pub seconds: u64,
}

impl RetryAfter {
    pub fn from_ms(ms: u64) -> Self {
        RetryAfter {
            ms,
            seconds: ms.div_ceil(1000),
        }
    }
}

/// SplitMix64: one step of a tiny, well-mixed PRNG, enough to spread clients apart.
pub fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Over `ends` (`(wait, bytes freed)`, soonest first: [`expected_ends`]), the wait until they
/// have freed `bytes`; `None`: they hold less.
pub(crate) fn wait_for(ends: impl IntoIterator<Item = (u64, u64)>, bytes: u64) -> Option<u64> {
    let mut freed: u64 = 0;
    for (wait, b) in ends {
        freed = freed.saturating_add(b);
        if freed >= bytes {
            return Some(wait);
        }
    }
    None
}

/// The hint for an expected wait of `base_ms`: clamped to `[min_ms, max_ms]`, then stretched by
/// a random jitter of up to `jitter` (never shortened, so a client is not told to come back
/// before the estimate), so rejected clients do not return in step.
pub fn hint(base_ms: u64, cfg: &RetryAfterConfig, jitter_seed: u64) -> RetryAfter {
    let clamped = base_ms.clamp(cfg.min_ms, cfg.max_ms.max(cfg.min_ms));
    // u in [0, 1) from the top 53 bits.
    let u = (splitmix64(jitter_seed) >> 11) as f64 / (1u64 << 53) as f64;
    let factor = 1.0 + cfg.jitter.clamp(0.0, 1.0) * u;
    let jittered = (clamped as f64 * factor) as u64;
    RetryAfter::from_ms(jittered.clamp(cfg.min_ms, cfg.max_ms.max(cfg.min_ms)))
}

//! Model spec and KV pricing.
//!
//! Every byte quantity is `u64`: the plugin runs on wasm32 where `usize` is 32 bits and real KV
//! budgets exceed 4 GiB. All arithmetic is checked; a spec or a request whose price overflows is an
//! error, never a wrap.

use crate::error::ConfigError;

/// Bumped whenever the pricing formula changes, so a lease records which estimator priced it.
pub const ESTIMATOR_VERSION: u32 = 1;

/// The shape of a model's KV cache, as far as pricing needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub layers: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub kv_dtype_bytes: u64,
    pub context_tokens: u64,
}

impl ModelSpec {
    /// Checks every field is positive and the per-token price fits in `u64`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("model.layers", self.layers),
            ("model.kv_heads", self.kv_heads),
            ("model.head_dim", self.head_dim),
            ("model.kv_dtype_bytes", self.kv_dtype_bytes),
            ("model.context_tokens", self.context_tokens),
        ] {
            if value == 0 {
                return Err(ConfigError::new(field, value, "must be greater than 0"));
            }
        }
        let per_token = self.kv_bytes_per_token().ok_or_else(|| {
            ConfigError::new(
                "model",
                format!("{self:?}"),
                "2 x layers x kv_heads x head_dim x kv_dtype_bytes must fit in 64 bits",
            )
        })?;
        if per_token.checked_mul(self.context_tokens).is_none() {
            return Err(ConfigError::new(
                "model.context_tokens",
                self.context_tokens,
                "context_tokens x KV bytes per token must fit in 64 bits",
            ));
        }
        Ok(())
    }

    /// `2 × layers × kv_heads × head_dim × dtype_bytes` (keys and values), or `None` on overflow.
    pub fn kv_bytes_per_token(&self) -> Option<u64> {
        2u64.checked_mul(self.layers)?
            .checked_mul(self.kv_heads)?
            .checked_mul(self.head_dim)?
            .checked_mul(self.kv_dtype_bytes)
    }

    /// The fingerprint as 16 hex digits (as the status endpoint and the backend report it).
    pub fn fingerprint_hex(&self) -> String {
        format!("{:016x}", self.fingerprint())
    }

    /// A stable 64-bit fingerprint of the estimator version and the spec (FNV-1a over a fixed
    /// little-endian layout). It does not depend on Rust's `Hash`, which is not stable across builds.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv1a::new();
        h.write(&ESTIMATOR_VERSION.to_le_bytes());
        for v in [
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.kv_dtype_bytes,
            self.context_tokens,
        ] {
            h.write(&v.to_le_bytes());
        }
        h.finish()
    }
}

/// FNV-1a, 64 bit: tiny, stable, good enough for fingerprints (not for adversarial hashing).
pub(crate) struct Fnv1a(u64);

impl Fnv1a {
    pub(crate) fn new() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

/// How requests are priced against a budget: the validated spec, its per-token price, the scratch
/// margin added to every reservation, and the usable capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct Pricing {
    pub spec: ModelSpec,
    pub bytes_per_token: u64,
    pub scratch_margin_bytes: u64,
    pub total_kv_bytes: u64,
    pub safety_fraction: f64,
    pub capacity_bytes: u64,
}

impl Pricing {
    /// The context a request can really use here: the model's, or less when the usable budget
    /// holds fewer tokens for one sequence. Prompts are checked and unset caps priced against it,
    /// so a request without `max_tokens` is admitted when the pool has room (not refused as
    /// larger than the whole budget, forever).
    pub fn served_context(&self) -> u64 {
        let usable = self
            .capacity_bytes
            .saturating_sub(self.scratch_margin_bytes)
            / self.bytes_per_token.max(1);
        self.spec.context_tokens.min(usable)
    }

    pub fn new(
        spec: ModelSpec,
        total_kv_bytes: u64,
        safety_fraction: f64,
        scratch_margin_bytes: u64,
    ) -> Result<Self, ConfigError> {
        spec.validate()?;
        if !(safety_fraction > 0.0 && safety_fraction <= 1.0) {
            return Err(ConfigError::new(
                "safety_fraction",
                safety_fraction,
                "must be in (0, 1]",
            ));
        }
        if total_kv_bytes == 0 {
            return Err(ConfigError::new(
                "kv_budget_bytes",
                0,
                "must be greater than 0",
            ));
        }
        let bytes_per_token = spec.kv_bytes_per_token().unwrap_or(u64::MAX);
        let capacity_bytes = usable_capacity(total_kv_bytes, safety_fraction);
        if capacity_bytes < bytes_per_token.saturating_add(scratch_margin_bytes) {
            return Err(ConfigError::new(
                "kv_budget_bytes",
                total_kv_bytes,
                format!(
                    "usable capacity ({capacity_bytes} B at safety_fraction {safety_fraction}) must hold at least one token ({bytes_per_token} B) plus the scratch margin ({scratch_margin_bytes} B)"
                ),
            ));
        }
        Ok(Pricing {
            spec,
            bytes_per_token,
            scratch_margin_bytes,
            total_kv_bytes,
            safety_fraction,
            capacity_bytes,
        })
    }

    /// Bytes reserved for `tokens` tokens of KV plus the scratch margin, or `None` on overflow.
    pub fn reservation_bytes(&self, tokens: u64) -> Option<u64> {
        tokens
            .checked_mul(self.bytes_per_token)?
            .checked_add(self.scratch_margin_bytes)
    }

    /// The most tokens a single reservation can cover within capacity.
    pub fn max_tokens_in_capacity(&self) -> u64 {
        self.capacity_bytes
            .saturating_sub(self.scratch_margin_bytes)
            / self.bytes_per_token
    }
}

/// `floor(total × fraction)`, exact for budgets far above 2^53 bytes: the fraction is applied in
/// parts-per-billion integer arithmetic so large `u64` budgets do not lose their low bits to `f64`.
pub fn usable_capacity(total: u64, fraction: f64) -> u64 {
    const SCALE: u128 = 1_000_000_000;
    // `as` on a float saturates; the fraction was validated to (0, 1].
    let ppb = (fraction * SCALE as f64).round() as u128;
    let ppb = ppb.min(SCALE);
    ((u128::from(total) * ppb) / SCALE) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn smollm2() -> ModelSpec {
        ModelSpec {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            kv_dtype_bytes: 4,
            context_tokens: 8192,
        }
    }

    #[test]
    fn smollm2_per_token_price_matches_the_facts() {
        assert_eq!(smollm2().kv_bytes_per_token(), Some(46_080));
        // A full context is 360 MiB in f32.
        assert_eq!(46_080 * 8192, 360 * 1024 * 1024);
    }

    #[test]
    fn overflowing_spec_is_a_config_error() {
        let spec = ModelSpec {
            layers: u64::MAX / 2,
            ..smollm2()
        };
        let err = spec.validate().unwrap_err();
        assert_eq!(err.field, "model");
        let zero = ModelSpec {
            kv_heads: 0,
            ..smollm2()
        };
        assert_eq!(zero.validate().unwrap_err().field, "model.kv_heads");
    }

    #[test]
    fn fingerprint_is_stable_and_sensitive() {
        let a = smollm2();
        assert_eq!(a.fingerprint(), smollm2().fingerprint());
        // Pinned (computed independently in Python): a change here means leases priced by older builds look foreign. Bump
        // ESTIMATOR_VERSION on purpose instead of changing the hash.
        assert_eq!(a.fingerprint(), 0xebbd_44da_4ae0_4b5d);
        let b = ModelSpec {
            context_tokens: 4096,
            ..a
        };
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn safety_fraction_must_be_in_unit_interval() {
        for bad in [0.0, -0.1, 1.01, f64::NAN] {
            let err = Pricing::new(smollm2(), 1 << 30, bad, 0).unwrap_err();
            assert_eq!(err.field, "safety_fraction");
        }
        assert!(Pricing::new(smollm2(), 1 << 30, 1.0, 0).is_ok());
    }

    #[test]
    fn budgets_above_4_gib_are_exact() {
        let total = 80 * (1u64 << 30) + 7; // 80 GiB and change
        let p = Pricing::new(smollm2(), total, 0.9, 0).unwrap();
        assert_eq!(p.capacity_bytes, (u128::from(total) * 9 / 10) as u64);
        assert!(p.capacity_bytes > u64::from(u32::MAX));
        assert_eq!(usable_capacity(u64::MAX, 1.0), u64::MAX);
    }

    #[test]
    fn budget_too_small_for_one_token_is_refused() {
        let err = Pricing::new(smollm2(), 46_080, 0.9, 0).unwrap_err();
        assert_eq!(err.field, "kv_budget_bytes");
    }
}

//! The output cap and the price of a request.
//!
//! A request is priced at the worst case it is *allowed* to reach: every prompt plus the full
//! effective output cap, for every choice. An unset cap is worth the rest of the context.
//!
//! `n` / `best_of`: each choice is decoded as its own sequence with its own KV (no prefix
//! sharing is assumed, which is what a backend without copy-on-write prompt blocks does), so the
//! reservation is `choices × (prompt + cap)`. For a backend that shares the prompt this over-prices
//! by `(choices − 1) × prompt` tokens — safe, never under.

use crate::error::{ApiError, ErrorKind};
use crate::spec::Pricing;

/// The cap a request will actually run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapDecision {
    /// Output tokens the request may generate (per choice).
    pub cap: u64,
    /// What the client asked for, if anything.
    pub requested: Option<u64>,
    /// True when the client asked for more than the context leaves and was clamped.
    pub clamped: bool,
}

/// Clamp the output cap to what the context leaves after the prompt.
///
/// unset → `context − prompt`; requested > remaining → remaining (clamped); prompt ≥ context →
/// `context_length_exceeded` (413).
pub fn effective_output_cap(
    requested: Option<u64>,
    prompt_tokens: u64,
    context: u64,
) -> Result<CapDecision, ApiError> {
    if prompt_tokens >= context {
        let asked = requested.map_or_else(|| "no".to_string(), |c| c.to_string());
        return Err(ApiError::new(
            ErrorKind::ContextLengthExceeded,
            format!(
                "This model's maximum context length is {context} tokens. However, your prompt has \
                 {prompt_tokens} tokens, which leaves no room for output ({asked} output tokens \
                 requested). Please reduce the length of the prompt."
            ),
        )
        .with_param("messages")
        .with_extra("context_tokens", context)
        .with_extra("prompt_tokens", prompt_tokens));
    }
    let remaining = context - prompt_tokens;
    Ok(match requested {
        None => CapDecision {
            cap: remaining,
            requested,
            clamped: false,
        },
        Some(r) if r > remaining => CapDecision {
            cap: remaining,
            requested,
            clamped: true,
        },
        Some(r) => CapDecision {
            cap: r,
            requested,
            clamped: false,
        },
    })
}

/// `context_length_exceeded` for a prompt whose counting stopped past the context: there is no
/// exact count to report, only that it has more than `context` tokens.
pub fn prompt_over_context(requested: Option<u64>, context: u64) -> ApiError {
    let asked = requested.map_or_else(|| "no".to_string(), |c| c.to_string());
    ApiError::new(
        ErrorKind::ContextLengthExceeded,
        format!(
            "This model's maximum context length is {context} tokens. However, your prompt has \
             more than {context} tokens, which leaves no room for output ({asked} output tokens \
             requested). Please reduce the length of the prompt."
        ),
    )
    .with_param("messages")
    .with_extra("context_tokens", context)
    .with_extra("prompt_tokens_more_than", context)
}

/// A request's price: its cap and the tokens and bytes to reserve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Price {
    pub cap: CapDecision,
    /// Prompt tokens summed over all prompts (a completions request may carry several).
    pub prompt_tokens: u64,
    /// Sequences decoded: prompts × choices.
    pub sequences: u64,
    /// Tokens reserved: Σ over prompts of choices × (prompt + cap).
    pub reserved_tokens: u64,
    /// Bytes reserved: tokens × per-token price + scratch margin.
    pub bytes: u64,
    /// The client set no cap, the request has one prompt, and the cap is what the model's whole
    /// context leaves after it: each sequence is reserved the whole context, which the server's
    /// own context bounds (if it is not longer than the one priced), so the cap need not be
    /// written into the body. Written, it would be the context less the gateway's count, which
    /// a server whose count of the same prompt is higher (a configured tokenizer only
    /// approximates the model's, and a chat template may add a system prompt) refuses as over
    /// its context. `gate::price` clears it when the model comes from the backend's
    /// descriptor, whose counts are the backend's own.
    pub cap_from_context: bool,
}

/// Price a request whose prompts have the given token counts, asking for `requested` output
/// tokens per choice and `choices` choices per prompt.
///
/// The cap is clamped against the longest prompt so one value can be written back into the body.
pub fn price_request(
    pricing: &Pricing,
    prompt_tokens: &[u64],
    requested: Option<u64>,
    choices: u64,
) -> Result<Price, ApiError> {
    let longest = prompt_tokens.iter().copied().max().unwrap_or(0);
    // An unset cap is what the served context leaves (never more than the budget can hold); an
    // explicit one is clamped to the model's context only, and refused if it cannot fit.
    let context = if requested.is_none() {
        pricing.served_context()
    } else {
        pricing.spec.context_tokens
    };
    let cap = effective_output_cap(requested, longest, context)?;
    let too_large = |what: String| {
        ApiError::new(
            ErrorKind::KvRequestTooLarge,
            format!("The request's worst-case KV reservation does not fit in 64 bits: {what}."),
        )
    };
    let mut reserved_tokens: u64 = 0;
    for p in prompt_tokens {
        let seq = p
            .checked_add(cap.cap)
            .and_then(|t| t.checked_mul(choices))
            .ok_or_else(|| {
                too_large(format!(
                    "({p} prompt + {} output tokens) × {choices} choices",
                    cap.cap
                ))
            })?;
        reserved_tokens = reserved_tokens.checked_add(seq).ok_or_else(|| {
            too_large(format!(
                "{} prompts of up to {longest} tokens, {} output tokens and {choices} choices each",
                prompt_tokens.len(),
                cap.cap
            ))
        })?;
    }
    let bytes = pricing.reservation_bytes(reserved_tokens).ok_or_else(|| {
        too_large(format!(
            "{reserved_tokens} tokens × {} bytes per token + {} bytes of scratch margin",
            pricing.bytes_per_token, pricing.scratch_margin_bytes
        ))
    })?;
    Ok(Price {
        cap_from_context: requested.is_none()
            && prompt_tokens.len() == 1
            && context == pricing.spec.context_tokens,
        cap,
        prompt_tokens: prompt_tokens.iter().fold(0u64, |a, p| a.saturating_add(*p)),
        sequences: (prompt_tokens.len() as u64).saturating_mul(choices),
        reserved_tokens,
        bytes,
    })
}

/// The largest cap (≤ `cap`) whose price fits in `free_bytes`, for degrade policies. `None` when
/// not even one output token fits.
pub fn largest_cap_that_fits(
    pricing: &Pricing,
    prompt_tokens: &[u64],
    choices: u64,
    cap: u64,
    free_bytes: u64,
) -> Option<u64> {
    let budget_tokens =
        free_bytes.checked_sub(pricing.scratch_margin_bytes)? / pricing.bytes_per_token;
    let prompts: u64 = prompt_tokens
        .iter()
        .try_fold(0u64, |a, p| a.checked_add(p.checked_mul(choices)?))?;
    let per_cap_token = (prompt_tokens.len() as u64).checked_mul(choices)?;
    if per_cap_token == 0 {
        return None;
    }
    let fits = budget_tokens.checked_sub(prompts)? / per_cap_token;
    let fits = fits.min(cap);
    (fits >= 1).then_some(fits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ModelSpec;
    use proptest::prelude::*;

    fn pricing(context: u64, margin: u64) -> Pricing {
        let spec = ModelSpec {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            kv_dtype_bytes: 4,
            context_tokens: context,
        };
        Pricing::new(spec, 1 << 34, 0.9, margin).unwrap()
    }

    #[test]
    fn seed_numbers() {
        let p = pricing(8192, 0);
        // 200-token prompt with max_tokens=4000 occupies 4,200 tokens.
        let a = price_request(&p, &[200], Some(4000), 1).unwrap();
        assert_eq!(a.reserved_tokens, 4200);
        assert_eq!(a.bytes, 4200 * 46_080);
        // 3,000 + 200 → 3,200.
        let b = price_request(&p, &[3000], Some(200), 1).unwrap();
        assert_eq!(b.reserved_tokens, 3200);
        // Unset cap with an 8,192 context: the whole context.
        let c = price_request(&p, &[200], None, 1).unwrap();
        assert_eq!(c.cap.cap, 7992);
        assert_eq!(c.reserved_tokens, 8192);
        // A prompt of 8,192 → 413 context_length_exceeded.
        let d = price_request(&p, &[8192], Some(1), 1).unwrap_err();
        assert_eq!(d.status, 413);
        assert_eq!(d.kind.code(), "context_length_exceeded");
        assert!(d.message.contains("8192"));
    }

    #[test]
    fn only_an_unset_cap_the_whole_context_bounds_is_left_to_the_server() {
        let p = pricing(8192, 0);
        // One prompt, no cap, a budget that holds the context: every sequence is reserved the
        // whole context, so the server's own context bounds it.
        assert!(price_request(&p, &[200], None, 2).unwrap().cap_from_context);
        // A cap the client set, clamped or not, is written.
        assert!(
            !price_request(&p, &[200], Some(100), 1)
                .unwrap()
                .cap_from_context
        );
        assert!(
            !price_request(&p, &[200], Some(100_000), 1)
                .unwrap()
                .cap_from_context
        );
        // Several prompts share the cap the longest leaves: a shorter one would run past it.
        assert!(
            !price_request(&p, &[200, 10], None, 1)
                .unwrap()
                .cap_from_context
        );
        // A budget smaller than the context: the unset cap is what the budget holds, below
        // what the server's context would let it reach.
        let small = Pricing::new(p.spec, 4096 * 46_080, 1.0, 0).unwrap();
        let c = price_request(&small, &[200], None, 1).unwrap();
        assert_eq!((c.cap.cap, c.cap_from_context), (3896, false));
    }

    #[test]
    fn a_reservation_past_64_bits_says_which_values_overflow() {
        // 2 bytes per token and a context of half of 64 bits: one sequence fits, more do not.
        let spec = ModelSpec {
            layers: 1,
            kv_heads: 1,
            head_dim: 1,
            kv_dtype_bytes: 1,
            context_tokens: u64::MAX / 2,
        };
        let p = Pricing::new(spec, u64::MAX, 1.0, 7).unwrap();
        let cap = u64::MAX / 4;
        for (prompts, choices, want) in [
            (
                &[10u64][..],
                8,
                format!("(10 prompt + {cap} output tokens) × 8 choices"),
            ),
            (
                &[10, 20][..],
                3,
                format!("2 prompts of up to 20 tokens, {cap} output tokens and 3 choices each"),
            ),
            (
                &[10][..],
                3,
                format!("{} tokens × 2 bytes per token + 7 bytes", 3 * (10 + cap)),
            ),
        ] {
            let e = price_request(&p, prompts, Some(cap), choices).unwrap_err();
            assert_eq!(e.kind.code(), "kv_request_too_large");
            assert_eq!(e.param, None);
            assert!(e.message.contains(&want), "{}", e.message);
        }
    }

    #[test]
    fn over_context_names_the_limit_without_a_count() {
        let e = prompt_over_context(Some(10), 8192);
        assert_eq!((e.status, e.kind.code()), (413, "context_length_exceeded"));
        assert!(e.message.contains("more than 8192 tokens"));
        assert!(e.message.contains("(10 output tokens requested)"));
    }

    #[test]
    fn clamping_is_reported() {
        let d = effective_output_cap(Some(10_000), 200, 8192).unwrap();
        assert_eq!(d.cap, 7992);
        assert!(d.clamped);
        let e = effective_output_cap(Some(100), 200, 8192).unwrap();
        assert!(!e.clamped);
        assert_eq!(e.cap, 100);
    }

    #[test]
    fn choices_multiply_and_margin_adds() {
        let p = pricing(8192, 1000);
        let a = price_request(&p, &[100, 50], Some(10), 3).unwrap();
        assert_eq!(a.reserved_tokens, 3 * 110 + 3 * 60);
        assert_eq!(a.bytes, a.reserved_tokens * 46_080 + 1000);
        assert_eq!(a.sequences, 6);
        assert_eq!(a.prompt_tokens, 150);
    }

    #[test]
    fn degrade_finds_largest_cap() {
        let p = pricing(8192, 0);
        let free = 1000 * 46_080;
        assert_eq!(largest_cap_that_fits(&p, &[200], 1, 4000, free), Some(800));
        assert_eq!(largest_cap_that_fits(&p, &[200], 1, 500, free), Some(500));
        assert_eq!(largest_cap_that_fits(&p, &[1000], 1, 500, free), None);
        assert_eq!(largest_cap_that_fits(&p, &[200], 2, 4000, free), Some(300));
    }

    proptest! {
        #[test]
        fn price_never_exceeds_context_per_sequence(prompt in 0u64..9000, req in proptest::option::of(1u64..20_000)) {
            let p = pricing(8192, 0);
            match price_request(&p, &[prompt], req, 1) {
                Ok(price) => {
                    prop_assert!(price.reserved_tokens <= 8192);
                    prop_assert!(price.cap.cap >= 1);
                    if let Some(r) = req { prop_assert!(price.cap.cap <= r); }
                }
                Err(e) => prop_assert!(prompt >= 8192 && e.status == 413),
            }
        }

        #[test]
        fn degraded_cap_fits(prompt in 0u64..8000, cap in 1u64..8000, free in 0u64..(1u64 << 32)) {
            let p = pricing(8192, 4096);
            if let Some(c) = largest_cap_that_fits(&p, &[prompt], 1, cap, free) {
                let price = price_request(&p, &[prompt], Some(c), 1).unwrap();
                prop_assert!(price.bytes <= free);
                prop_assert!(c <= cap);
            }
        }
    }
}

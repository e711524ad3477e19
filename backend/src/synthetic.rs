//! Synthetic models: a named Llama shape with random weights drawn from a seed at start, so the
//! backend runs (and can be benchmarked, and compared across devices) with no model file — the GPU
//! machines can neither download nor carry the real one.
//!
//! - Weights: `Llama::synthetic`; every value comes from a counter-based generator keyed by
//!   (seed, tensor id, chunk), so generation is parallel yet bit-identical on every run and device.
//! - Tokenizer: byte-level, not a trained BPE (`tokenizer`). Good for throughput and for serving
//!   requests; the text a random model writes is of course noise.

use anyhow::{bail, Result};
use kvgate_core::tokenize::{CustomBpe, GPT2_STYLE_PATTERN, IM_END, IM_START};
use kvgate_core::{TokenCounter, TokenizerSpec};

use crate::model::Config;
use crate::tokenizer::Tokenizer;

/// The shapes `--synthetic` knows.
pub const SHAPES: &[&str] = &["smollm2", "llama8b", "tiny"];

/// The hyper-parameters of a named shape; the context is capped at `max_context`.
/// - `smollm2`: SmolLM2-135M (30 layers, hidden 576, FFN 1536, 9 heads, 3 KV heads, head_dim 64,
///   vocab 49152, context 8192, rope theta 100000).
/// - `llama8b`: Llama-3-8B (32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads, head_dim
///   128, vocab 128256, context 8192, rope theta 500000).
/// - `tiny`: 2 layers, hidden 64, for tests.
pub fn config(shape: &str, max_context: usize) -> Result<Config> {
    let cfg = match shape {
        "smollm2" => Config {
            vocab: 49152,
            hidden: 576,
            ffn: 1536,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            rope_theta: 100_000.0,
            rms_eps: 1e-5,
            context: 8192,
        },
        "llama8b" => Config {
            vocab: 128_256,
            hidden: 4096,
            ffn: 14336,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            rope_theta: 500_000.0,
            rms_eps: 1e-5,
            context: 8192,
        },
        "tiny" => Config {
            vocab: 512,
            hidden: 64,
            ffn: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            rope_theta: 10_000.0,
            rms_eps: 1e-5,
            context: 1024,
        },
        other => bail!(
            "unknown synthetic shape {other:?}: one of {}",
            SHAPES.join(", ")
        ),
    };
    Ok(Config {
        context: cfg.context.min(max_context),
        ..cfg
    })
}

/// Parameter count of a shape (tied embeddings counted once).
pub fn parameters(c: &Config) -> u64 {
    let (h, f) = (c.hidden as u64, c.ffn as u64);
    let (q, kv) = (
        (c.heads * c.head_dim) as u64,
        (c.kv_heads * c.head_dim) as u64,
    );
    let layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h;
    c.vocab as u64 * h + c.layers as u64 * layer + h
}

/// A byte-level tokenizer covering the model's whole vocabulary, ChatML-compatible:
/// id 0 `<|endoftext|>`, 1 `<|im_start|>`, 2 `<|im_end|>` (specials, as in SmolLM2), ids 3..259
/// the 256 single bytes, and the rest two- then three-letter ASCII strings (`aa`, `ab`, …), which
/// act as merges. Every id decodes to bytes, so whatever a random model samples streams as text,
/// except the specials: control tokens, counted but never streamed (as a real model's are).
pub fn tokenizer(vocab: usize) -> Result<Tokenizer> {
    const SPECIALS: [&str; 3] = ["<|endoftext|>", IM_START, IM_END];
    if vocab < SPECIALS.len() + 256 {
        bail!("a synthetic vocabulary needs at least 259 ids, not {vocab}");
    }
    let letters: Vec<u8> = (b'a'..=b'z').chain(b'A'..=b'Z').collect();
    let pairs = letters
        .iter()
        .flat_map(|&a| letters.iter().map(move |&b| vec![a, b]));
    let l = &letters;
    let triples = l.iter().flat_map(move |&a| {
        l.iter()
            .flat_map(move |&b| l.iter().map(move |&c| vec![a, b, c]))
    });
    let words: Vec<Vec<u8>> = (0..=255u8)
        .map(|b| vec![b])
        .chain(pairs)
        .chain(triples)
        .take(vocab - SPECIALS.len())
        .collect();
    if words.len() + SPECIALS.len() != vocab {
        bail!("a synthetic vocabulary of {vocab} ids is too large");
    }
    let ranks = words
        .into_iter()
        .zip(SPECIALS.len() as u32..)
        .collect::<Vec<_>>();
    let special_tokens = SPECIALS
        .iter()
        .zip(0u32..)
        .map(|(s, id)| (s.to_string(), id))
        .collect();
    let bpe = CustomBpe {
        ranks,
        pattern: GPT2_STYLE_PATTERN.to_string(),
        special_tokens,
        ..CustomBpe::default()
    };
    let counter = TokenCounter::new(&TokenizerSpec::Custom(bpe.clone()))?;
    Ok(Tokenizer {
        counter,
        bpe,
        stop_ids: vec![0, 2],
        hidden_ids: (0..SPECIALS.len() as u32).collect(),
        vocab: vocab as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Llama, SeqKv};
    use crate::random_weights::{fill_uniform, CHUNK};
    use candle_core::Device;

    #[test]
    fn shapes_match_their_models() {
        let s = config("smollm2", 8192).unwrap();
        assert_eq!(
            (s.layers, s.hidden, s.ffn, s.heads, s.kv_heads, s.head_dim),
            (30, 576, 1536, 9, 3, 64)
        );
        // SmolLM2-135M: 134.5 M parameters with tied embeddings.
        assert_eq!(parameters(&s), 134_515_008);
        let l = config("llama8b", 4096).unwrap();
        assert_eq!(l.context, 4096);
        assert_eq!(l.heads * l.head_dim, l.hidden);
        // Llama-3-8B is 8.03 B with an untied output head (0.53 B): 7.50 B tied.
        assert_eq!(parameters(&l), 7_504_924_672);
        assert!(config("nope", 1).is_err());
    }

    #[test]
    fn weights_are_deterministic_and_thread_independent() {
        let mut a = vec![0f32; 3 * CHUNK + 17];
        let mut b = vec![0f32; 3 * CHUNK + 17];
        fill_uniform(&mut a, 7, 3, 0.5);
        fill_uniform(&mut b, 7, 3, 0.5);
        assert_eq!(a, b);
        // Chunk by chunk on one thread gives the same values.
        let mut c = vec![0f32; CHUNK];
        fill_uniform(&mut c, 7, 3, 0.5);
        assert_eq!(a.get(..CHUNK), Some(c.as_slice()));
        assert!(a.iter().all(|v| v.abs() <= 0.5));
        let mean = a.iter().map(|v| *v as f64).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 1e-2, "{mean}");
        let mut d = vec![0f32; 16];
        fill_uniform(&mut d, 8, 3, 0.5);
        assert_ne!(a.get(..16), Some(d.as_slice()));
    }

    #[test]
    fn byte_tokenizer_round_trips_and_covers_the_vocabulary() {
        let tok = tokenizer(49152).unwrap();
        let text = "Hello, wörld! 123 <|im_end|>";
        let ids = tok.counter.encode_text(text);
        assert!(ids.iter().all(|&i| (i as usize) < 49152));
        assert_eq!(tok.counter.decode_bytes(&ids).unwrap(), text.as_bytes());
        assert_eq!(tok.counter.special_id(IM_END), Some(2));
        for id in [0u32, 3, 258, 259, 3000, 49151] {
            assert!(tok.counter.decode_bytes(&[id]).is_some(), "id {id}");
        }
        assert!(tokenizer(128_256).is_ok());
        assert!(tokenizer(100).is_err());
    }

    #[test]
    fn a_tiny_synthetic_model_decodes_like_its_prefill() {
        let cfg = config("tiny", 64).unwrap();
        let dev = Device::Cpu;
        let m = Llama::synthetic(cfg.clone(), 1, &dev).unwrap();
        let m2 = Llama::synthetic(cfg, 1, &dev).unwrap();
        let prompt = [5u32, 9, 77, 300, 4];
        // Prefill of n+1 tokens == prefill of n then one decode step.
        let mut kv = m.new_kv(&[], 16).unwrap();
        let full = m
            .prefill(&prompt, &mut kv)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut kv2 = m2.new_kv(&[], 16).unwrap();
        m2.prefill(&prompt[..4], &mut kv2).unwrap();
        let step = m2
            .decode(&prompt[4..], &mut [&mut kv2])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let diff = full
            .iter()
            .zip(&step[0])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-4, "{diff}");
        assert!(full.iter().all(|v| v.is_finite()));
    }

    fn argmax(v: &[f32]) -> u32 {
        (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best }) as u32
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    }

    #[test]
    fn a_prompt_fed_in_chunks_and_tiles_gives_what_one_prefill_gives() {
        let cfg = config("tiny", 256).unwrap();
        let dev = Device::Cpu;
        let prompt: Vec<u32> = (0..61u32).map(|i| (i * 37 + 11) % 512).collect();
        let whole = Llama::synthetic(cfg.clone(), 3, &dev).unwrap();
        let mut kv = whole.new_kv(&[], 64).unwrap();
        let one = whole
            .prefill(&prompt, &mut kv)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let next = whole
            .decode(&[7], &mut [&mut kv])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        // Tiles of one query row (groups × len × 4 bytes is over 64), and uneven chunks.
        let tiled = Llama::synthetic(cfg, 3, &dev)
            .unwrap()
            .with_attention_tile_bytes(64);
        let mut kv2 = tiled.new_kv(&[], 64).unwrap();
        let mut last = Vec::new();
        let mut at = 0;
        for n in [7, 13, 1, 40] {
            last = tiled
                .prefill(&prompt[at..at + n], &mut kv2)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            at += n;
            assert_eq!(kv2.len(), at);
        }
        assert!(max_diff(&one, &last) < 1e-4, "{}", max_diff(&one, &last));
        // The cache the chunks left behind is the same: the next decode step agrees.
        let next2 = tiled
            .decode(&[7], &mut [&mut kv2])
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!(max_diff(&next[0], &next2[0]) < 1e-4);
        // A chunk past the cache's capacity, or past the context, is refused before anything
        // is written; so is an empty one.
        assert!(tiled.prefill(&[1, 2, 3, 4], &mut kv2).is_err());
        assert_eq!(kv2.len(), 62);
        assert!(tiled.prefill(&[], &mut kv2).is_err());
        let mut roomy = tiled.new_kv(&[], 300).unwrap();
        let err = tiled.prefill(&[1; 257], &mut roomy).unwrap_err();
        assert!(err.to_string().contains("past the context"), "{err}");
        assert_eq!(roomy.len(), 0);
    }

    #[test]
    fn the_paged_arena_decodes_what_the_host_caches_decode() {
        let cfg = config("tiny", 256).unwrap();
        let dev = Device::Cpu;
        let host = Llama::synthetic(cfg.clone(), 5, &dev).unwrap();
        // 12 blocks of 4 tokens; the sequences hold scattered, interleaved blocks.
        let paged = Llama::synthetic(cfg, 5, &dev)
            .unwrap()
            .with_paged_kv(12, 4, candle_core::DType::F32)
            .unwrap();
        let tables: [&[u32]; 3] = [&[7, 2, 9, 6], &[0, 11, 4, 5], &[10, 3, 1]];
        let prompts: [Vec<u32>; 3] = [
            (0..9).map(|i| i * 31 % 512).collect(),
            (0..5).map(|i| i * 7 + 100).collect(),
            (0..3).map(|i| i + 400).collect(),
        ];
        let mut hk: Vec<_> = (0..3).map(|_| host.new_kv(&[], 16).unwrap()).collect();
        let mut pk: Vec<_> = tables
            .iter()
            .zip(&prompts)
            .map(|(t, p)| paged.new_kv(&t[..p.len().div_ceil(4)], 64).unwrap())
            .collect();
        assert_eq!(pk[2].capacity(), 4, "one block of 4");
        for i in 0..3 {
            // The paged one in two chunks.
            let a = host
                .prefill(&prompts[i], &mut hk[i])
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let cut = prompts[i].len() / 2 + 1;
            paged.prefill(&prompts[i][..cut], &mut pk[i]).unwrap();
            let b = paged
                .prefill(&prompts[i][cut..], &mut pk[i])
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert!(max_diff(&a, &b) < 1e-4, "prefill {i}: {}", max_diff(&a, &b));
        }
        // Decode steps across block boundaries; the caches grow into their next blocks.
        let mut next = [1u32, 2, 3];
        for step in 0..6 {
            for (kv, t) in pk.iter_mut().zip(tables) {
                if kv.len() == kv.capacity() {
                    let blocks = kv.capacity() / 4 + 1;
                    paged.grow_kv(kv, &t[..blocks], 4 * blocks).unwrap();
                }
            }
            let a = host
                .decode(&next, &mut hk.iter_mut().collect::<Vec<_>>())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let b = paged
                .decode(&next, &mut pk.iter_mut().collect::<Vec<_>>())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            for i in 0..3 {
                assert!(max_diff(&a[i], &b[i]) < 1e-4, "step {step} seq {i}");
                next[i] = crate::sampling::argmax(&a[i]);
            }
        }
        assert_eq!(pk.iter().map(|k| k.len()).collect::<Vec<_>>(), [15, 11, 9]);
        // A cache whose blocks changed under it is refused.
        assert!(paged.grow_kv(&mut pk[2], &[1, 3, 10, 8], 16).is_err());
    }

    #[test]
    fn a_cache_cut_back_to_its_first_blocks_and_fed_the_rest_gives_what_one_prefill_gives() {
        // What an elastic sequence does when it gives back borrowed blocks: it keeps the
        // positions its own blocks hold and is fed the rest when it runs again.
        let cfg = config("tiny", 256).unwrap();
        let dev = Device::Cpu;
        let tokens: Vec<u32> = (0..23u32).map(|i| (i * 53 + 7) % 512).collect();
        let host = Llama::synthetic(cfg.clone(), 4, &dev).unwrap();
        let paged = Llama::synthetic(cfg, 4, &dev)
            .unwrap()
            .with_paged_kv(12, 4, candle_core::DType::F32)
            .unwrap();
        let whole = {
            let mut kv = host.new_kv(&[], 32).unwrap();
            host.prefill(&tokens, &mut kv)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let table = [9u32, 2, 7, 0, 11, 5];
        for m in [&host, &paged] {
            let mut kv = m.new_kv(&table, 24).unwrap();
            m.prefill(&tokens[..21], &mut kv).unwrap();
            // Back to 2 blocks (8 tokens): positions 8.. are gone.
            m.shrink_kv(&mut kv, &table[..2], 8).unwrap();
            assert_eq!((kv.len(), kv.capacity()), (8, 8));
            // Grown again into other blocks than before, and fed from position 8.
            let again = [9u32, 2, 3, 4, 1, 6];
            m.grow_kv(&mut kv, &again, 24).unwrap();
            let b = m
                .prefill(&tokens[8..], &mut kv)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert!(max_diff(&whole, &b) < 1e-4, "{}", max_diff(&whole, &b));
        }
        // A paged cache may keep only blocks it had, first ones first.
        let mut kv = paged.new_kv(&table[..3], 12).unwrap();
        assert!(paged.shrink_kv(&mut kv, &table[1..3], 8).is_err());
    }

    #[test]
    fn a_cache_that_starts_in_another_sequences_blocks_gives_the_same_tokens() {
        // Prefix caching: B's first two blocks are A's (A wrote them); B is fed only the rest
        // of the same prompt and then decodes: the logits and greedy tokens are A's.
        let cfg = config("tiny", 256).unwrap();
        let dev = Device::Cpu;
        let m = Llama::synthetic(cfg, 6, &dev)
            .unwrap()
            .with_paged_kv(16, 4, candle_core::DType::F32)
            .unwrap();
        let prompt: Vec<u32> = (0..11u32).map(|i| (i * 37 + 5) % 512).collect();
        let greedy = |kv: &mut SeqKv, first: Vec<f32>| {
            let mut out = vec![argmax(&first)];
            for _ in 0..8 {
                let last = *out.last().unwrap();
                let row = m
                    .decode(&[last], &mut [kv])
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                out.push(argmax(&row[0]));
            }
            out
        };
        let a_table = [3u32, 8, 1, 12, 6];
        let mut a = m.new_kv(&a_table, 20).unwrap();
        let la = m
            .prefill(&prompt, &mut a)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let b_table = [3u32, 8, 0, 15, 9];
        let mut b = m.new_kv(&b_table, 20).unwrap().starting_at(8).unwrap();
        let lb = m
            .prefill(&prompt[8..], &mut b)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(max_diff(&la, &lb) < 1e-5, "{}", max_diff(&la, &lb));
        // B decodes first (it must not write into A's blocks), then A.
        let tb = greedy(&mut b, lb);
        let ta = greedy(&mut a, la);
        assert_eq!(ta, tb);
        // Only a paged cache starts after positions its blocks hold.
        let host = Llama::synthetic(config("tiny", 256).unwrap(), 6, &dev).unwrap();
        assert!(host.new_kv(&[], 20).unwrap().starting_at(4).is_err());
    }

    #[test]
    fn bf16_weights_and_a_bf16_arena_stay_close_to_f32() {
        let cfg = config("tiny", 256).unwrap();
        let dev = Device::Cpu;
        let f32m = Llama::synthetic(cfg.clone(), 9, &dev).unwrap();
        let half = Llama::synthetic(cfg, 9, &dev)
            .unwrap()
            .with_dtype(candle_core::DType::BF16)
            .unwrap()
            .with_paged_kv(8, 4, candle_core::DType::BF16)
            .unwrap();
        let prompt: Vec<u32> = (0..11u32).map(|i| i * 45 % 512).collect();
        let mut a = f32m.new_kv(&[], 32).unwrap();
        let mut b = half.new_kv(&[0, 1, 2, 3, 4, 5, 6, 7], 32).unwrap();
        let mut la = f32m
            .prefill(&prompt, &mut a)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut lb = half
            .prefill(&prompt, &mut b)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for _ in 0..8 {
            let scale = la.iter().fold(0f32, |m, v| m.max(v.abs()));
            // bf16 keeps 8 bits of mantissa: a few percent of the largest logit at most.
            assert!(
                max_diff(&la, &lb) < 0.05 * scale,
                "{} vs {scale}",
                max_diff(&la, &lb)
            );
            let next = [crate::sampling::argmax(&la)];
            la = f32m
                .decode(&next, &mut [&mut a])
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
                .remove(0);
            lb = half
                .decode(&next, &mut [&mut b])
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
                .remove(0);
        }
        assert_ne!(max_diff(&la, &lb), 0.0, "it really ran in bf16");
    }
}

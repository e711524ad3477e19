//! Decode benchmark, same run, same model, same dequantized f32 weights:
//! - single-stream greedy decode tok/s: ours vs candle-transformers' `quantized_llama`;
//! - aggregate decode tok/s of our batched forward at 1, 4, 8 and 16 concurrent sequences, with
//!   host caches and with the paged KV arena;
//! - time to first token (prefill + first sample) for a ~100-token chat prompt.
//!
//! `cargo run --release -p kvgate-backend --example decode_bench [-- MODEL.gguf]`
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)]

use std::time::Instant;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use kvgate_backend::model::{Config, Llama};
use kvgate_backend::sampling::argmax;
use kvgate_backend::tokenizer::Tokenizer;
use kvgate_core::request::ChatMessage;

const STEPS: usize = 64;

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let dev = Device::Cpu;
    let mut f = std::fs::File::open(&path).expect("model file (run `make setup`)");
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let cfg = Config::from_gguf(&ct, 4096).unwrap();
    let tok = Tokenizer::from_gguf(&ct).unwrap();
    let ours = Llama::from_gguf(&ct, &mut f, cfg, &dev).unwrap();
    let question = "Explain in detail how a key-value cache speeds up transformer decoding, and why its memory grows with every generated token. Give a worked example with numbers for a small model, then discuss what a server should do when many users send long prompts with large max_tokens at the same time.";
    let prompt = tok
        .counter
        .encode_chat(&[ChatMessage {
            role: "user".into(),
            content: question.into(),
            ..ChatMessage::default()
        }])
        .unwrap();

    // Reference: candle-transformers with every weight dequantized to f32.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let mut f2 = std::fs::File::open(&path).unwrap();
    let ct2 = gguf_file::Content::read(&mut f2).unwrap();
    let mut reference =
        candle_transformers::models::quantized_llama::ModelWeights::from_gguf(ct2, &mut f2, &dev)
            .unwrap();
    let t0 = Instant::now();
    let input = Tensor::new(prompt.as_slice(), &dev)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = reference.forward(&input, 0).unwrap().squeeze(0).unwrap();
    let mut next = argmax(&logits.to_vec1::<f32>().unwrap());
    let ref_ttft = t0.elapsed();
    let t0 = Instant::now();
    for i in 0..STEPS {
        let input = Tensor::new(&[next], &dev).unwrap().unsqueeze(0).unwrap();
        let logits = reference
            .forward(&input, prompt.len() + i)
            .unwrap()
            .squeeze(0)
            .unwrap();
        next = argmax(&logits.to_vec1::<f32>().unwrap());
    }
    let ref_tps = STEPS as f64 / t0.elapsed().as_secs_f64();

    // The same weights with the paged KV arena (`--kv-layout paged`, the CUDA default): each
    // sequence in its own run of the pool's blocks.
    let block_tokens = 16;
    let per_seq = (prompt.len() + STEPS + 1).div_ceil(block_tokens);
    let mut f3 = std::fs::File::open(&path).unwrap();
    let ct3 = gguf_file::Content::read(&mut f3).unwrap();
    let paged = Llama::from_gguf(&ct3, &mut f3, ours.cfg.clone(), &dev)
        .unwrap()
        .with_paged_kv(16 * per_seq, block_tokens, candle_core::DType::F32)
        .unwrap();
    let mut rows = Vec::new();
    let mut ttft = None;
    for batch in [1usize, 4, 8, 16] {
        let host_tps = decode_tps(&ours, &prompt, batch, |_| vec![], &mut ttft);
        let paged_tps = decode_tps(
            &paged,
            &prompt,
            batch,
            |i| {
                (0..per_seq as u32)
                    .map(|b| i as u32 * per_seq as u32 + b)
                    .collect()
            },
            &mut None,
        );
        rows.push((batch, host_tps, paged_tps));
    }
    // bf16 weights (`--dtype bf16`): half the bytes per decode step, widened to f32 in the
    // streamed kernel; host caches.
    let mut f4 = std::fs::File::open(&path).unwrap();
    let ct4 = gguf_file::Content::read(&mut f4).unwrap();
    let bf16 = Llama::from_gguf(&ct4, &mut f4, ours.cfg.clone(), &dev)
        .unwrap()
        .with_dtype(candle_core::DType::BF16)
        .unwrap();
    let bf16_rows: Vec<(usize, f64)> = [1usize, 8]
        .into_iter()
        .map(|b| (b, decode_tps(&bf16, &prompt, b, |_| vec![], &mut None)))
        .collect();
    let single = rows[0].1;
    println!(
        "prompt {} tokens, {STEPS} decode steps, f32 weights, CPU",
        prompt.len()
    );
    println!();
    println!("| measure | candle-transformers quantized_llama | kvgate-backend | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| single-stream decode tok/s | {ref_tps:.1} | {single:.1} | {:.2} |",
        single / ref_tps
    );
    let ours_ttft = ttft.unwrap().as_secs_f64() * 1e3;
    println!(
        "| time to first token ({} tokens), ms | {:.0} | {ours_ttft:.0} | {:.2} |",
        prompt.len(),
        ref_ttft.as_secs_f64() * 1e3,
        ours_ttft / (ref_ttft.as_secs_f64() * 1e3)
    );
    println!();
    println!("| concurrent streams | aggregate decode tok/s | vs 1 stream | paged KV arena tok/s | paged / host |");
    println!("|---|---|---|---|---|");
    for (b, tps, paged) in &rows {
        println!(
            "| {b} | {tps:.1} | {:.2}x | {paged:.1} | {:.2} |",
            tps / single,
            paged / tps
        );
    }
    println!();
    println!("| concurrent streams | f32 weights tok/s | bf16 weights tok/s | bf16 / f32 |");
    println!("|---|---|---|---|");
    for (b, tps) in bf16_rows {
        let f32_tps = rows.iter().find(|r| r.0 == b).map_or(f64::NAN, |r| r.1);
        println!("| {b} | {f32_tps:.1} | {tps:.1} | {:.2} |", tps / f32_tps);
    }
}

/// Aggregate decode tok/s of `batch` sequences decoded together for `STEPS` steps after their
/// prefill; `blocks(i)` is sequence `i`'s block table (empty for host caches).
fn decode_tps(
    m: &Llama,
    prompt: &[u32],
    batch: usize,
    blocks: impl Fn(usize) -> Vec<u32>,
    ttft: &mut Option<std::time::Duration>,
) -> f64 {
    let mut kvs: Vec<_> = (0..batch)
        .map(|i| m.new_kv(&blocks(i), prompt.len() + STEPS + 1).unwrap())
        .collect();
    let mut next = Vec::with_capacity(batch);
    for kv in kvs.iter_mut() {
        let t0 = Instant::now();
        let logits = m.prefill(prompt, kv).unwrap();
        next.push(argmax(&logits.to_vec1::<f32>().unwrap()));
        ttft.get_or_insert(t0.elapsed());
    }
    let t0 = Instant::now();
    for _ in 0..STEPS {
        let mut refs: Vec<_> = kvs.iter_mut().collect();
        let logits = m
            .decode(&next, &mut refs)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        next = logits.iter().map(|r| argmax(r)).collect();
    }
    (batch * STEPS) as f64 / t0.elapsed().as_secs_f64()
}

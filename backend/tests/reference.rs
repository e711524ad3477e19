//! Correctness: our batched Llama, greedy, produces exactly the tokens candle-transformers'
//! `quantized_llama` produces on the same dequantized weights — alone, and in a batch with other
//! sequences of different lengths (batching must not change any sequence's output).
//!
//! Needs the default model (`make setup` fetches it); run in release (`make test` does).
#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use std::path::PathBuf;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use kvgate_backend::model::{Config, Llama};
use kvgate_backend::sampling::argmax;
use kvgate_backend::tokenizer::Tokenizer;
use kvgate_core::request::ChatMessage;

fn model_path() -> PathBuf {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} missing: run `make setup`", p.display());
    p
}

fn chat(tok: &Tokenizer, q: &str) -> Vec<u32> {
    tok.counter
        .encode_chat(&[ChatMessage {
            role: "user".into(),
            content: q.into(),
            ..ChatMessage::default()
        }])
        .unwrap()
}

/// Greedy decode with candle-transformers' reference implementation (all weights dequantized).
fn reference(prompt: &[u32], steps: usize, stop: &[u32]) -> Vec<u32> {
    // Read once per thread by candle's QMatMul: set before any reference model is built.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let mut f = std::fs::File::open(model_path()).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut m = candle_transformers::models::quantized_llama::ModelWeights::from_gguf(
        ct,
        &mut f,
        &Device::Cpu,
    )
    .unwrap();
    let input = Tensor::new(prompt, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = m.forward(&input, 0).unwrap().squeeze(0).unwrap();
    let mut next = argmax(&logits.to_vec1::<f32>().unwrap());
    let mut out = vec![];
    for i in 0..steps {
        if stop.contains(&next) {
            break;
        }
        out.push(next);
        let input = Tensor::new(&[next], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = m
            .forward(&input, prompt.len() + i)
            .unwrap()
            .squeeze(0)
            .unwrap();
        next = argmax(&logits.to_vec1::<f32>().unwrap());
    }
    out
}

fn ours() -> (Llama, Tokenizer) {
    let mut f = std::fs::File::open(model_path()).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let cfg = Config::from_gguf(&ct, 4096).unwrap();
    let tok = Tokenizer::from_gguf(&ct).unwrap();
    let m = Llama::from_gguf(&ct, &mut f, cfg, &Device::Cpu).unwrap();
    // The batched decodes compared below run through the streamed CPU matmul.
    assert!(m.decode_matmuls_stream().unwrap());
    (m, tok)
}

/// Greedy decode of several prompts together: one prefill each, then batched decode steps.
fn ours_batched(m: &Llama, prompts: &[Vec<u32>], steps: usize, stop: &[u32]) -> Vec<Vec<u32>> {
    let mut kvs: Vec<_> = prompts
        .iter()
        .map(|p| m.new_kv(&[], p.len() + steps + 1).unwrap())
        .collect();
    let mut outs: Vec<Vec<u32>> = vec![vec![]; prompts.len()];
    let mut next: Vec<u32> = prompts
        .iter()
        .zip(kvs.iter_mut())
        .map(|(p, kv)| argmax(&m.prefill(p, kv).unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    let mut done = vec![false; prompts.len()];
    for _ in 0..steps {
        for i in 0..prompts.len() {
            if !done[i] && stop.contains(&next[i]) {
                done[i] = true;
            }
            if !done[i] {
                outs[i].push(next[i]);
            }
        }
        // Keep decoding finished sequences too (their outputs are ignored): the batch shape
        // changes nothing for the others, which is what this checks.
        let mut refs: Vec<_> = kvs.iter_mut().collect();
        let logits = m
            .decode(&next, &mut refs)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        next = logits.iter().map(|row| argmax(row)).collect();
    }
    outs
}

#[test]
fn greedy_matches_candle_transformers_token_for_token() {
    let (m, tok) = ours();
    let q = chat(&tok, "What is the capital of France?");
    let expect = reference(&q, 24, &tok.stop_ids);
    let text = String::from_utf8(tok.counter.decode_bytes(&expect).unwrap()).unwrap();
    assert!(text.contains("Paris"), "reference said {text:?}");

    let alone = ours_batched(&m, std::slice::from_ref(&q), 24, &tok.stop_ids);
    assert_eq!(alone[0], expect, "ours alone vs candle-transformers");

    let other1 = chat(&tok, "Write a haiku about the sea.");
    let other2 = tok
        .counter
        .encode_text("The quick brown fox jumps over the lazy dog, and then");
    let batch = ours_batched(
        &m,
        &[other1.clone(), q.clone(), other2.clone()],
        24,
        &tok.stop_ids,
    );
    assert_eq!(batch[1], expect, "the same sequence inside a batch of 3");
    assert_eq!(
        batch[0],
        reference(&other1, 24, &tok.stop_ids),
        "first batch member"
    );
    assert_eq!(
        batch[2],
        reference(&other2, 24, &tok.stop_ids),
        "third batch member"
    );
}

/// Logits of a prefill (in chunks, through the GEMM) and of batched decode steps (the streamed
/// matmul), for each prompt.
fn logits_of(m: &Llama, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<f32>> {
    let mut kvs: Vec<_> = prompts
        .iter()
        .map(|p| m.new_kv(&[], p.len() + steps + 1).unwrap())
        .collect();
    let mut all = Vec::new();
    let mut next = Vec::new();
    for (p, kv) in prompts.iter().zip(kvs.iter_mut()) {
        let (head, tail) = p.split_at(p.len() / 2);
        m.prefill(head, kv).unwrap();
        let l = m.prefill(tail, kv).unwrap().to_vec1::<f32>().unwrap();
        next.push(argmax(&l));
        all.push(l);
    }
    for _ in 0..steps {
        let mut refs: Vec<_> = kvs.iter_mut().collect();
        let rows = m
            .decode(&next, &mut refs)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        next = rows.iter().map(|r| argmax(r)).collect();
        all.extend(rows);
    }
    all
}

#[test]
fn weights_kept_as_stored_give_the_f32_logits_bit_for_bit() {
    let (dense, tok) = ours();
    let mut f = std::fs::File::open(model_path()).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let cfg = Config::from_gguf(&ct, 4096).unwrap();
    let stored = Llama::from_gguf_as_stored(&ct, &mut f, cfg, &Device::Cpu).unwrap();
    assert!(stored.decode_matmuls_stream().unwrap());
    // Every projection (30 layers x 7) and the tied embedding and head are kept as stored.
    assert_eq!(stored.stored_matrices(), 30 * 7 + 2);
    assert_eq!(dense.stored_matrices(), 0);
    let prompts = [
        chat(&tok, "What is the capital of France?"),
        chat(&tok, "Write a haiku about the sea."),
        tok.counter
            .encode_text("The quick brown fox jumps over the lazy dog, and then"),
    ];
    let (a, b) = (
        logits_of(&dense, &prompts, 12),
        logits_of(&stored, &prompts, 12),
    );
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x == y, "logits row {i} differ");
    }
}

#[test]
fn tokenizer_counts_what_the_filter_counts() {
    // The filter and the backend share kvgate-core: a chat counted for pricing is exactly the
    // prompt the backend prefills.
    let (_, tok) = ours();
    let msgs = [ChatMessage {
        role: "user".into(),
        content: "What is the capital of France?".into(),
        ..ChatMessage::default()
    }];
    assert_eq!(
        tok.counter.count_chat(&msgs),
        tok.counter.encode_chat(&msgs).unwrap().len() as u64
    );
    // ChatML specials are single tokens of this vocabulary.
    let ids = tok.counter.encode_chat(&msgs).unwrap();
    assert_eq!(ids.first().copied(), tok.counter.special_id("<|im_start|>"));
    assert_eq!(
        tok.counter
            .decode_bytes(&tok.counter.encode_text("héllo wörld"))
            .unwrap(),
        "héllo wörld".as_bytes()
    );
}

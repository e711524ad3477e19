//! What `--on-kv-exhaustion` does to an oversubscribed burst under `--admission none`, same run,
//! same model (the real SmolLM2-135M on CPU), same requests:
//! - `ample`: a pool that holds the whole burst (the reference outputs: greedy, never preempted);
//! - `error`: a small pool, sequences that find it dry end in a mid-decode KV OOM (today's default);
//! - `recompute`: the same small pool, the youngest other sequence is preempted and recomputed.
//!
//! Per arm: how requests ended, output tokens of the completed ones, makespan, goodput,
//! preemptions and recomputed tokens (the engine's own counters), and how many streamed outputs
//! equal the reference token for token (completed) or are a prefix of it (errored).
//!
//! `cargo run --release -p kvgate-backend --example recompute_bench [-- MODEL.gguf]
//!  [--requests 12] [--max-tokens 128] [--blocks 40] [--rounds 1]`
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file;
use candle_core::Device;
use kvgate_backend::engine::{
    self, Admission, EngineConfig, Event, FinishReason, GenParams, OnKvExhaustion, Submit,
};
use kvgate_backend::model::{Config, Llama};
use kvgate_backend::pool::BlockPool;
use kvgate_backend::tokenizer::Tokenizer;
use tokio::sync::mpsc::unbounded_channel;

struct Opts {
    model: String,
    requests: usize,
    max_tokens: u64,
    blocks: u64,
    rounds: usize,
}

fn opts() -> Opts {
    let mut o = Opts {
        model: "models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
        requests: 12,
        max_tokens: 128,
        blocks: 40,
        rounds: 1,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = || args.get(i + 1).expect("a value after the flag").clone();
        match args[i].as_str() {
            "--requests" => o.requests = value().parse().unwrap(),
            "--max-tokens" => o.max_tokens = value().parse().unwrap(),
            "--blocks" => o.blocks = value().parse().unwrap(),
            "--rounds" => o.rounds = value().parse().unwrap(),
            path => {
                o.model = path.into();
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    o
}

struct Outcome {
    text: String,
    reason: FinishReason,
    completion_tokens: u64,
    done_at: Duration,
}

struct Arm {
    outcomes: Vec<Outcome>,
    makespan: Duration,
    preemptions: u64,
    recomputed: u64,
    kv_oom: u64,
}

fn run_arm(
    o: &Opts,
    tok: &Arc<Tokenizer>,
    prompts: &[Vec<u32>],
    blocks: u64,
    on: OnKvExhaustion,
) -> Arm {
    let mut f = std::fs::File::open(&o.model).expect("model file (run `make setup`)");
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let cfg = Config::from_gguf(&ct, 4096).unwrap();
    let per_token = cfg.kv_spec().kv_bytes_per_token().unwrap();
    let model = Llama::from_gguf(&ct, &mut f, cfg, &Device::Cpu).unwrap();
    let pool = BlockPool::new(blocks * 16 * per_token, 16, per_token);
    let handle = engine::spawn(
        model,
        Arc::clone(tok),
        pool,
        EngineConfig {
            admission: Admission::None,
            on_kv_exhaustion: on,
            max_batch: 16,
            prefill_token_budget: 2048,
            lazy_blocks: false,
            prefix_caching: false,
            step_delay: Duration::ZERO,
        },
        Arc::new(kvgate_backend::metrics::Metrics::default()),
    );
    let t0 = Instant::now();
    let mut rxs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (tx, rx) = unbounded_channel();
            assert!(handle.submit(Submit {
                lease: Some(format!("r{i}")),
                class: None,
                reserve_output: None,
                gateway_prompt_tokens: 0,
                prompt: p.clone(),
                params: GenParams {
                    max_tokens: o.max_tokens,
                    temperature: 0.0,
                    top_p: 1.0,
                    seed: 0,
                    stop: vec![],
                },
                events: tx,
            }));
            rx
        })
        .collect();
    let mut texts = vec![String::new(); prompts.len()];
    let mut ends: Vec<Option<(FinishReason, u64, Duration)>> = vec![None; prompts.len()];
    while ends.iter().any(Option::is_none) {
        for (i, rx) in rxs.iter_mut().enumerate() {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    Event::Text(t) => texts[i].push_str(&t),
                    Event::Finished {
                        reason,
                        completion_tokens,
                        ..
                    } => ends[i] = Some((reason, completion_tokens, t0.elapsed())),
                    Event::Rejected(e) => panic!("rejected: {}", e.message),
                    Event::Admitted { .. } => {}
                }
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let makespan = t0.elapsed();
    let m = &handle.metrics;
    Arm {
        outcomes: texts
            .into_iter()
            .zip(ends)
            .map(|(text, end)| {
                let (reason, completion_tokens, done_at) = end.unwrap();
                Outcome {
                    text,
                    reason,
                    completion_tokens,
                    done_at,
                }
            })
            .collect(),
        makespan,
        preemptions: m.recompute_preemptions.get(),
        recomputed: m.recomputed_tokens.get(),
        kv_oom: m.kv_oom.get(),
    }
}

fn main() {
    let o = opts();
    let mut f = std::fs::File::open(&o.model).expect("model file (run `make setup`)");
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let tok = Arc::new(Tokenizer::from_gguf(&ct).unwrap());
    // Counting continuations: every one runs to its cap, each from a different start.
    let prompts: Vec<Vec<u32>> = (0..o.requests)
        .map(|i| {
            let k = 1 + 37 * i;
            tok.counter
                .encode_text(&format!("{}, {}, {}, {},", k, k + 1, k + 2, k + 3))
        })
        .collect();
    let demand: u64 = prompts
        .iter()
        .map(|p| (p.len() as u64 + o.max_tokens).div_ceil(16))
        .sum();
    println!(
        "{} requests x max_tokens {} (greedy), worst case {} blocks of 16 tokens; small pool {} blocks, ample {}",
        o.requests, o.max_tokens, demand, o.blocks, demand
    );
    println!();
    println!("| round | arm | pool blocks | completed | errors (KV OOM) | output tokens of completed | makespan s | goodput tok/s | p50 / max latency s | preemptions | recomputed tokens | recomputed / output | equal to reference |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for round in 1..=o.rounds {
        let reference = run_arm(&o, &tok, &prompts, demand, OnKvExhaustion::Error);
        let arms = [
            ("error", OnKvExhaustion::Error),
            ("recompute", OnKvExhaustion::Recompute),
        ]
        .map(|(name, on)| (name, run_arm(&o, &tok, &prompts, o.blocks, on)));
        let rows = std::iter::once(("ample", demand, &reference))
            .chain(arms.iter().map(|(n, a)| (*n, o.blocks, a)));
        for (name, blocks, arm) in rows {
            let completed: Vec<&Outcome> = arm
                .outcomes
                .iter()
                .filter(|x| matches!(x.reason, FinishReason::Stop | FinishReason::Length))
                .collect();
            let errors = arm
                .outcomes
                .iter()
                .filter(|x| x.reason == FinishReason::Error)
                .count();
            let output: u64 = completed.iter().map(|x| x.completion_tokens).sum();
            let secs = arm.makespan.as_secs_f64();
            let mut lat: Vec<f64> = completed.iter().map(|x| x.done_at.as_secs_f64()).collect();
            lat.sort_by(f64::total_cmp);
            let p50 = lat.get(lat.len() / 2).copied().unwrap_or(f64::NAN);
            let max = lat.last().copied().unwrap_or(f64::NAN);
            // Completed: identical to the reference; errored: what was streamed is its prefix.
            let equal = arm
                .outcomes
                .iter()
                .zip(&reference.outcomes)
                .filter(|(x, r)| match x.reason {
                    FinishReason::Error => r.text.starts_with(&x.text),
                    _ => x.text == r.text,
                })
                .count();
            println!(
                "| {round} | {name} | {blocks} | {}/{} | {errors} ({}) | {output} | {secs:.1} | {:.1} | {p50:.1} / {max:.1} | {} | {} | {:.2} | {equal}/{} |",
                completed.len(),
                arm.outcomes.len(),
                arm.kv_oom,
                output as f64 / secs,
                arm.preemptions,
                arm.recomputed,
                arm.recomputed as f64 / output.max(1) as f64,
                arm.outcomes.len(),
            );
        }
    }
}

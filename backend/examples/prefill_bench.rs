//! A 4k-token prompt on the real model (SmolLM2-135M, f32 weights, CPU), fed whole and in chunks
//! (`--prefill-token-budget`), same run:
//! - `memory`: the prefill's peak memory beyond the weights and the KV cache it fills (VmHWM
//!   after `clear_refs`, each arm in its own process), against `Llama::prefill_scratch_bytes`;
//! - `stall`: four streams decoding when the 4k prompt arrives through the engine: the longest
//!   gap between two of their tokens while it is prefilled, their median gap, and the prompt's
//!   time to first token.
//!
//! `cargo run --release -p kvgate-backend --example prefill_bench [-- MODEL.gguf] [--prompt 4096]
//!  [--chunks 4096,512,256]`
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file;
use candle_core::Device;
use kvgate_backend::engine::{
    self, Admission, EngineConfig, Event, GenParams, OnKvExhaustion, Submit,
};
use kvgate_backend::model::{Config, Llama};
use kvgate_backend::pool::BlockPool;
use kvgate_backend::tokenizer::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

const TEXT: &str = "A key-value cache keeps the keys and values of every past token so that \
    decoding the next one reads them instead of recomputing them. Its memory grows with every \
    token, which is why a server must price each request at the most it may grow to. ";

struct Opts {
    model: String,
    prompt: usize,
    chunks: Vec<usize>,
    /// Internal: run one arm (`memory` or `stall`) with this chunk and print one line.
    arm: Option<(String, usize)>,
}

fn opts() -> Opts {
    let mut o = Opts {
        model: "models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
        prompt: 4096,
        chunks: vec![4096, 512, 256],
        arm: None,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = || args.get(i + 1).expect("a value after the flag").clone();
        match args[i].as_str() {
            "--prompt" => o.prompt = value().parse().unwrap(),
            "--chunks" => o.chunks = value().split(',').map(|c| c.parse().unwrap()).collect(),
            "--arm" => {
                let v = value();
                let (kind, chunk) = v.split_once(':').expect("--arm KIND:CHUNK");
                o.arm = Some((kind.into(), chunk.parse().unwrap()));
            }
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

fn load(o: &Opts) -> (Llama, Arc<Tokenizer>, u64) {
    let mut f = std::fs::File::open(&o.model).expect("model file (run `make setup`)");
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let cfg = Config::from_gguf(&ct, o.prompt + 512).unwrap();
    let per_token = cfg.kv_spec().kv_bytes_per_token().unwrap();
    let tok = Tokenizer::from_gguf(&ct).unwrap();
    let model = Llama::from_gguf(&ct, &mut f, cfg, &Device::Cpu).unwrap();
    (model, Arc::new(tok), per_token)
}

fn long_prompt(tok: &Tokenizer, n: usize) -> Vec<u32> {
    let ids = tok.counter.encode_text(&TEXT.repeat(n / 30 + 2));
    ids[..n].to_vec()
}

/// `VmRSS` or `VmHWM` of this process, bytes.
fn proc_status(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(key)).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

fn memory_arm(o: &Opts, chunk: usize) {
    let (model, tok, per_token) = load(o);
    let prompt = long_prompt(&tok, o.prompt);
    // Warm the allocator and the kernels on a short prefill first.
    let mut warm = model.new_kv(&[], 64).unwrap();
    model.prefill(&prompt[..32], &mut warm).unwrap();
    drop(warm);
    let mut kv = model.new_kv(&[], o.prompt).unwrap();
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = proc_status("VmRSS:");
    let t0 = Instant::now();
    for c in prompt.chunks(chunk) {
        model.prefill(c, &mut kv).unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let peak = proc_status("VmHWM:");
    let kv_bytes = o.prompt as u64 * per_token;
    let extra = peak.saturating_sub(before).saturating_sub(kv_bytes);
    let bound = model.prefill_scratch_bytes(chunk, o.prompt);
    println!(
        "{chunk}\t{:.1}\t{:.1}\t{:.2}\t{:.0}",
        extra as f64 / 1e6,
        bound as f64 / 1e6,
        secs,
        o.prompt as f64 / secs
    );
}

fn stall_arm(o: &Opts, chunk: usize) {
    let (model, tok, per_token) = load(o);
    let prompt = long_prompt(&tok, o.prompt);
    // Blocks are taken as sequences grow (`none`): the pool is accounting here, never short.
    let blocks = 4 * (o.prompt as u64 + 512) / 16;
    let handle = engine::spawn(
        model,
        Arc::clone(&tok),
        BlockPool::new(blocks * 16 * per_token, 16, per_token),
        EngineConfig {
            admission: Admission::None,
            on_kv_exhaustion: OnKvExhaustion::Error,
            max_batch: 16,
            prefill_token_budget: chunk,
            lazy_blocks: false,
            prefix_caching: false,
            step_delay: Duration::ZERO,
        },
        Arc::new(kvgate_backend::metrics::Metrics::default()),
    );
    let submit = |id: &str, p: Vec<u32>, max_tokens: u64| -> UnboundedReceiver<Event> {
        let (tx, rx) = unbounded_channel();
        assert!(handle.submit(Submit {
            lease: Some(id.into()),
            class: None,
            reserve_output: None,
            gateway_prompt_tokens: 0,
            prompt: p,
            params: GenParams {
                max_tokens,
                temperature: 0.0,
                top_p: 1.0,
                seed: 0,
                stop: vec![],
            },
            events: tx,
        }));
        rx
    };
    let mut decoders: Vec<_> = (0..4)
        .map(|i| submit(&format!("d{i}"), prompt[i * 8..i * 8 + 24].to_vec(), 4000))
        .collect();
    let mut times: Vec<Vec<Instant>> = vec![Vec::new(); 4];
    let drain = |decoders: &mut Vec<UnboundedReceiver<Event>>, times: &mut Vec<Vec<Instant>>| {
        for (rx, t) in decoders.iter_mut().zip(times.iter_mut()) {
            while let Ok(ev) = rx.try_recv() {
                if matches!(ev, Event::Text(_)) {
                    t.push(Instant::now());
                }
            }
        }
    };
    // Let them settle into steady decoding.
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(3) {
        drain(&mut decoders, &mut times);
        std::thread::sleep(Duration::from_millis(1));
    }
    let arrived = Instant::now();
    let mut long = submit("long", prompt, 1);
    let mut first = None;
    while first.is_none() {
        drain(&mut decoders, &mut times);
        while let Ok(ev) = long.try_recv() {
            if matches!(ev, Event::Text(_) | Event::Finished { .. }) && first.is_none() {
                first = Some(Instant::now());
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let done = first.unwrap();
    // Keep decoding a little after, then stop (dropping the receivers cancels them).
    let tail = Instant::now();
    while tail.elapsed() < Duration::from_secs(1) {
        drain(&mut decoders, &mut times);
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut gaps_before = Vec::new();
    let mut worst_during = Duration::ZERO;
    for t in &times {
        for w in t.windows(2) {
            let gap = w[1] - w[0];
            if w[1] < arrived {
                gaps_before.push(gap);
            } else if w[0] <= done {
                worst_during = worst_during.max(gap);
            }
        }
    }
    gaps_before.sort();
    let median = gaps_before[gaps_before.len() / 2];
    println!(
        "{chunk}\t{:.0}\t{:.0}\t{:.2}",
        median.as_secs_f64() * 1e3,
        worst_during.as_secs_f64() * 1e3,
        (done - arrived).as_secs_f64()
    );
}

fn run_arm(o: &Opts, kind: &str, chunk: usize) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .arg(&o.model)
        .args(["--prompt", &o.prompt.to_string()])
        .args(["--arm", &format!("{kind}:{chunk}")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

fn main() {
    let o = opts();
    if let Some((kind, chunk)) = &o.arm {
        match kind.as_str() {
            "memory" => memory_arm(&o, *chunk),
            "stall" => stall_arm(&o, *chunk),
            other => panic!("unknown arm {other}"),
        }
        return;
    }
    println!("prefill of a {}-token prompt, {}", o.prompt, o.model);
    println!("\n| chunk (tokens) | peak extra memory (MB) | stated bound (MB) | prefill (s) | prefill tok/s |");
    println!("|---|---|---|---|---|");
    print_rows(&o, "memory");
    println!("\n| --prefill-token-budget | decoders' median gap before (ms) | longest gap while it prefills (ms) | its time to first token (s) |");
    println!("|---|---|---|---|");
    print_rows(&o, "stall");
}

/// One table row per chunk size: the arm's tab-separated line as markdown.
fn print_rows(o: &Opts, kind: &str) {
    for &c in &o.chunks {
        println!("| {} |", run_arm(o, kind, c).replace('\t', " | "));
    }
}

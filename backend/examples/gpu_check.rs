//! GPU readiness check on synthetic weights (no model file needed); `tools/gpu-check.sh` runs the
//! prebuilt binary on a CUDA machine.
//!
//! Both parts run the device with the paged KV arena (`--kv-layout paged`, what the server uses
//! on CUDA: KV and attention stay on the device); the CPU side keeps host caches.
//!
//! 1. Correctness: the same synthetic weights (same seed) on the CPU and on `--device`; three
//!    prompts of different lengths are prefilled, then decoded together in batched steps. Both
//!    devices are fed the CPU's greedy tokens (teacher forcing, so one near-tie cannot cascade).
//!    Every step compares the logits. PASS when max |Δlogit| ≤ 1e-3 · max |logit| and every step's
//!    greedy token agrees, except where the CPU's top two are closer than 2 · max |Δlogit| (a tie
//!    within float noise).
//! 2. Throughput on `--device`, per shape: time to first token (prefill + greedy pick) of a
//!    `--prompt`-token prompt, and decode tok/s at 1, 8 and 16 concurrent streams (one batched
//!    forward per step).
//!
//! `gpu_check [--device cuda:0] [--check-only | --bench-only] [--shapes smollm2,llama8b]
//!            [--steps 64] [--prompt 128] [--dtype bf16] [--json FILE]`
#![allow(
    clippy::expect_used,
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use candle_core::{DType, Device};
use kvgate_backend::model::{Config, Llama};
use kvgate_backend::sampling::argmax;
use kvgate_backend::synthetic;

const SEED: u64 = 1;

struct Opts {
    device: String,
    check: bool,
    bench: bool,
    shapes: Vec<String>,
    steps: usize,
    prompt: usize,
    json: Option<String>,
    /// Weights and paged KV in the throughput part (the server's default on CUDA: bf16).
    dtype: DType,
}

fn parse() -> Result<Opts> {
    let mut o = Opts {
        device: "cuda:0".into(),
        check: true,
        bench: true,
        shapes: vec!["smollm2".into(), "llama8b".into()],
        steps: 64,
        prompt: 128,
        json: None,
        dtype: DType::BF16,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--device" => o.device = val()?,
            "--check-only" => o.bench = false,
            "--bench-only" => o.check = false,
            "--shapes" => o.shapes = val()?.split(',').map(str::to_string).collect(),
            "--steps" => o.steps = val()?.parse()?,
            "--prompt" => o.prompt = val()?.parse()?,
            "--json" => o.json = Some(val()?),
            "--dtype" => {
                o.dtype = match val()?.as_str() {
                    "f32" => DType::F32,
                    "f16" => DType::F16,
                    "bf16" => DType::BF16,
                    other => bail!("--dtype {other}: f32, f16 or bf16"),
                }
            }
            "-h" | "--help" => {
                println!(
                    "{}",
                    include_str!("gpu_check.rs")
                        .lines()
                        .take(15)
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?} (see --help)"),
        }
    }
    Ok(o)
}

fn device(spec: &str) -> Result<Device> {
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    let n: usize = spec
        .strip_prefix("cuda:")
        .with_context(|| format!("bad device {spec:?}"))?
        .parse()?;
    Device::new_cuda(n).with_context(|| format!("CUDA device {n} (built with --features cuda?)"))
}

/// Deterministic prompt ids (avoiding the specials 0..3).
fn prompt(len: usize, salt: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            3 + (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 97_531)) % (vocab as u32 - 3)
        })
        .collect()
}

struct Compare {
    max_diff: f32,
    max_abs: f32,
    steps: usize,
    agree: usize,
    ties: usize,
    hard_mismatch: usize,
}

impl Compare {
    fn new() -> Compare {
        Compare {
            max_diff: 0.0,
            max_abs: 0.0,
            steps: 0,
            agree: 0,
            ties: 0,
            hard_mismatch: 0,
        }
    }
    fn add(&mut self, cpu: &[f32], gpu: &[f32]) -> Result<()> {
        if cpu.len() != gpu.len() {
            bail!(
                "logit rows differ in length: {} vs {}",
                cpu.len(),
                gpu.len()
            );
        }
        if let Some(bad) = gpu.iter().find(|v| !v.is_finite()) {
            bail!("non-finite logit on the device: {bad}");
        }
        let diff = cpu
            .iter()
            .zip(gpu)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        self.max_diff = self.max_diff.max(diff);
        self.max_abs = cpu.iter().fold(self.max_abs, |m, v| m.max(v.abs()));
        self.steps += 1;
        let (c, g) = (argmax(cpu), argmax(gpu));
        if c == g {
            self.agree += 1;
        } else {
            // A mismatch is only acceptable when the CPU's own top-1 vs the device's pick is
            // within float noise.
            let gap = cpu[c as usize] - cpu[g as usize];
            if gap <= 2.0 * diff {
                self.ties += 1;
            } else {
                self.hard_mismatch += 1;
            }
        }
        Ok(())
    }
    fn rel(&self) -> f32 {
        self.max_diff / self.max_abs.max(1e-6)
    }
    fn pass(&self) -> bool {
        self.rel() <= 1e-3 && self.hard_mismatch == 0 && self.steps > 0
    }
}

/// CPU vs device on one shape; `layers` trims the depth (the 8B shape at full depth on the CPU
/// would take minutes).
fn check(shape: &str, layers: Option<usize>, dev: &Device, steps: usize) -> Result<Compare> {
    let mut cfg: Config = synthetic::config(shape, 4096)?;
    if let Some(l) = layers {
        cfg.layers = l;
    }
    let cpu = Llama::synthetic(cfg.clone(), SEED, &Device::Cpu)?;
    let per = (64 + steps + 1).div_ceil(BLOCK);
    let gpu =
        Llama::synthetic(cfg.clone(), SEED, dev)?.with_paged_kv(3 * per, BLOCK, DType::F32)?;
    let prompts: Vec<Vec<u32>> = [7usize, 33, 64]
        .iter()
        .zip(1u32..)
        .map(|(&n, salt)| prompt(n, salt, cfg.vocab))
        .collect();
    let mut cmp = Compare::new();
    let mut kc = Vec::new();
    let mut kg = Vec::new();
    let mut next = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut a = cpu.new_kv(&[], p.len() + steps + 1)?;
        let mut b = gpu.new_kv(&table(i, per), p.len() + steps + 1)?;
        let lc = cpu.prefill(p, &mut a)?.to_vec1::<f32>()?;
        let lg = gpu.prefill(p, &mut b)?.to_vec1::<f32>()?;
        cmp.add(&lc, &lg)?;
        next.push(argmax(&lc));
        kc.push(a);
        kg.push(b);
    }
    for _ in 0..steps {
        let mut rc: Vec<_> = kc.iter_mut().collect();
        let mut rg: Vec<_> = kg.iter_mut().collect();
        let lc = cpu.decode(&next, &mut rc)?.to_vec2::<f32>()?;
        let lg = gpu.decode(&next, &mut rg)?.to_vec2::<f32>()?;
        for (c, g) in lc.iter().zip(&lg) {
            cmp.add(c, g)?;
        }
        next = lc.iter().map(|r| argmax(r)).collect();
    }
    Ok(cmp)
}

/// Tokens per KV block of the paged arena (the server's default `--block-size`).
const BLOCK: usize = 16;

/// Sequence `i`'s block table: its own run of `per` blocks.
fn table(i: usize, per: usize) -> Vec<u32> {
    (i * per..(i + 1) * per).map(|b| b as u32).collect()
}

struct Bench {
    shape: String,
    params: u64,
    load_s: f64,
    ttft_ms: f64,
    prompt: usize,
    /// (streams, aggregate tok/s, ms per step)
    rows: Vec<(usize, f64, f64)>,
}

fn bench(
    shape: &str,
    dev: &Device,
    steps: usize,
    prompt_len: usize,
    dtype: DType,
) -> Result<Bench> {
    let cfg = synthetic::config(shape, 8192)?;
    let params = synthetic::parameters(&cfg);
    let t0 = Instant::now();
    let per = (prompt_len + steps + 4).div_ceil(BLOCK);
    let m = Llama::synthetic(cfg.clone(), SEED, dev)?
        .with_dtype(dtype)?
        .with_paged_kv(17 * per, BLOCK, dtype)?;
    dev.synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    // Warm-up: kernels load lazily, cuBLAS picks algorithms on first use.
    {
        let p = prompt(prompt_len, 99, cfg.vocab);
        let mut kv = m.new_kv(&table(0, per), p.len() + 4)?;
        let l = m.prefill(&p, &mut kv)?.to_vec1::<f32>()?;
        let mut refs = [&mut kv];
        m.decode(&[argmax(&l)], &mut refs)?.to_vec2::<f32>()?;
        m.decode(&[argmax(&l)], &mut refs)?.to_vec2::<f32>()?;
    }
    let mut ttfts = Vec::new();
    for salt in 0..3 {
        let p = prompt(prompt_len, salt, cfg.vocab);
        let mut kv = m.new_kv(&table(0, per), p.len() + 1)?;
        let t0 = Instant::now();
        let l = m.prefill(&p, &mut kv)?.to_vec1::<f32>()?;
        let _ = argmax(&l);
        ttfts.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ttfts.sort_by(f64::total_cmp);
    let ttft_ms = ttfts[1];
    let mut rows = Vec::new();
    for streams in [1usize, 8, 16] {
        let mut kvs = Vec::new();
        let mut next = Vec::new();
        for s in 0..streams {
            let p = prompt(prompt_len, 1000 + s as u32, cfg.vocab);
            let mut kv = m.new_kv(&table(s + 1, per), p.len() + steps + 1)?;
            next.push(argmax(&m.prefill(&p, &mut kv)?.to_vec1::<f32>()?));
            kvs.push(kv);
        }
        let t0 = Instant::now();
        for _ in 0..steps {
            let mut refs: Vec<_> = kvs.iter_mut().collect();
            let l = m.decode(&next, &mut refs)?.to_vec2::<f32>()?;
            next = l.iter().map(|r| argmax(r)).collect();
        }
        let secs = t0.elapsed().as_secs_f64();
        rows.push((
            streams,
            (streams * steps) as f64 / secs,
            secs * 1e3 / steps as f64,
        ));
        eprintln!("  {shape}: {streams} streams done");
    }
    Ok(Bench {
        shape: shape.into(),
        params,
        load_s,
        ttft_ms,
        prompt: prompt_len,
        rows,
    })
}

fn main() -> Result<()> {
    let o = parse()?;
    let dev = device(&o.device)?;
    let mut json = serde_json::Map::new();
    json.insert("device".into(), o.device.clone().into());
    let mut ok = true;
    if o.check {
        println!(
            "## Correctness: CPU vs {} on the same synthetic weights (seed {SEED}, f32)",
            o.device
        );
        println!();
        println!("3 prompts (7, 33, 64 tokens) prefilled, then 24 batched decode steps fed the CPU's greedy tokens.");
        println!("PASS: max |Δlogit| ≤ 1e-3 × max |logit|, and the greedy token agrees at every step except near-ties.");
        println!();
        println!("| shape | layers | logit rows | max abs Δ | max abs logit | rel | greedy agree | near-ties | hard mismatches | result |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        let mut checks = Vec::new();
        for (shape, layers) in [("smollm2", None), ("llama8b", Some(2usize))] {
            let t0 = Instant::now();
            let c = check(shape, layers, &dev, 24)?;
            let nl = layers.unwrap_or(synthetic::config(shape, 1)?.layers);
            let pass = c.pass();
            ok &= pass;
            println!(
                "| {shape} | {nl} | {} | {:.3e} | {:.3} | {:.2e} | {}/{} | {} | {} | {} |",
                c.steps,
                c.max_diff,
                c.max_abs,
                c.rel(),
                c.agree,
                c.steps,
                c.ties,
                c.hard_mismatch,
                if pass { "PASS" } else { "FAIL" }
            );
            eprintln!("  check {shape} took {:.1}s", t0.elapsed().as_secs_f64());
            checks.push(serde_json::json!({
                "shape": shape, "layers": nl, "rows": c.steps, "max_abs_diff": c.max_diff,
                "max_abs_logit": c.max_abs, "rel": c.rel(), "agree": c.agree, "ties": c.ties,
                "hard_mismatch": c.hard_mismatch, "pass": pass,
            }));
        }
        json.insert("correctness".into(), checks.into());
        println!();
    }
    if o.bench {
        let mut results = Vec::new();
        for s in &o.shapes {
            eprintln!("bench {s} on {} ...", o.device);
            results.push(bench(s, &dev, o.steps, o.prompt, o.dtype)?);
        }
        println!(
            "## Decode throughput on {} (synthetic weights, {:?} weights and paged KV, {} steps per run)",
            o.device, o.dtype, o.steps
        );
        println!();
        println!("| shape | params | weights GiB | load s | TTFT ms | 1 stream tok/s | 8 streams tok/s | 16 streams tok/s | 8 vs 1 | 16 vs 1 | step ms @1/8/16 |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        let mut out = Vec::new();
        for b in &results {
            let tps = |n: usize| b.rows.iter().find(|r| r.0 == n).map(|r| r.1).unwrap_or(0.0);
            let ms = |n: usize| b.rows.iter().find(|r| r.0 == n).map(|r| r.2).unwrap_or(0.0);
            println!(
                "| {} | {:.2} B | {:.1} | {:.1} | {:.1} ({} tok) | {:.1} | {:.1} | {:.1} | {:.2}x | {:.2}x | {:.1} / {:.1} / {:.1} |",
                b.shape,
                b.params as f64 / 1e9,
                b.params as f64 * o.dtype.size_in_bytes() as f64 / (1u64 << 30) as f64,
                b.load_s,
                b.ttft_ms,
                b.prompt,
                tps(1),
                tps(8),
                tps(16),
                tps(8) / tps(1),
                tps(16) / tps(1),
                ms(1),
                ms(8),
                ms(16),
            );
            out.push(serde_json::json!({
                "shape": b.shape, "params": b.params, "load_s": b.load_s, "ttft_ms": b.ttft_ms,
                "prompt_tokens": b.prompt, "steps": o.steps,
                "decode": b.rows.iter().map(|r| serde_json::json!({"streams": r.0, "tok_s": r.1, "step_ms": r.2})).collect::<Vec<_>>(),
            }));
        }
        json.insert("throughput".into(), out.into());
    }
    json.insert("ok".into(), ok.into());
    if let Some(path) = &o.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
    }
    if !ok {
        bail!("correctness check FAILED");
    }
    Ok(())
}

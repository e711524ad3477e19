//! A discrete-event simulator of admission strategies (issue 11, "goodput near the oracle"), at
//! scales the 2-core CPU machine cannot run live.
//!
//! `cargo run --release -p kvgate-backend --example sim -- [--preset cpu|gpu] [--backends N]
//! [--workload mix|live] [--seed S] [--jobs N] [--clients C | --rate R] [--give-up-s S]
//! [--arms none,reserve,kvgate,elastic,oracle,vllm] [--blocks B] [--elastic-prior T]
//! [--filter-config PATH] [--context T] [--step-ms A,B] [--prefill-ms P] [--max-tries N]
//! [--backfill on|off] [--lazy-blocks true|false] [--patience first-token|retries]
//! [--allowance-by-prompt true|false] [--poll-ms M] [--safety-fraction F] [--set KEY=JSON]...
//! [--dump FILE]` prints one markdown table (`make bench-sim` runs the
//! defaults), and on stderr, per gateway arm, where the pool went: the ledger's committed, held
//! back and claimed bytes, the backend's blocks in use and promised, averaged over the polls.
//! `--poll-ms` is how often the gateway polls each backend (500, the shipped configs'
//! `backend.poll_ms`). `--safety-fraction` overrides the filter config's (0.9 shipped).
//! `--set KEY=JSON` sets any filter setting, by dotted path, after the arm's own (`*` for
//! every class: `--set 'policy.classes.*.preempts=null'`, `--set fair_retry_patience_ms=0`).
//!
//! `--allowance-by-prompt` is every elastic class's `elastic_by_prompt` (default `false`, as the
//! filter's; the filter can do it since it tells the backend the allowance in its body field):
//! an elastic request's allowance is the class's quantile over the outputs that answered
//! prompts of about its length (within 5 %, at least one token either way, the Retry-After
//! estimator's rule) once at least `elastic_min_samples` of them are kept, else over all the
//! class's outputs. Commands run
//! before 2026-12-04 14:00 UTC meant `false` without the flag and `true` with it.
//!
//! `--lazy-blocks true` (the default, as the backend's) is the backend's `--lazy-blocks`.
//!
//! **The gateway arms decide with kvgate-core's own code, not a re-implementation:** the filter
//! configuration is parsed by `Config::from_json` from envoy/kvgate-filter.yaml (the shipped
//! policy: classes, degrade, queue, preemption, Retry-After, fair-retry claims), requests are
//! priced by `price_request` into a `gate::Priced` (`with_allowance` for elastic classes, the
//! allowance from `ElasticPolicy::allowance` over the class's `OutputLengths`), decided by
//! `gate::decide` on a `Ledger` (two passes as `fleet::admit`, with `fleet::plan` / `fleet::home`),
//! queued in `queue::AdmissionQueue`, released with `Ledger::release`, and reconciled every poll
//! with `reconcile::reconcile` from a `BackendReport` built from the simulated backend (what
//! holds back elastic growth and block rounding), with the progress model the filter's
//! `ProgressTracker` learns from the same reports (lease ends for Retry-After and backfills,
//! the decode rate for run estimates); queued requests behind the front are retried when their
//! place in line is active and tried as backfills (`gate::backfill`) as the filter's tick does
//! (`--backfill off`: no run estimates, no such tries). **The backends are the real engine**
//! (`kvgate_backend::engine`, stepped by `engine::Stepper`; `backend.rs` here): admission, lazy
//! promises and their time-aware peak, elastic growth, reclaim, preemption and recompute,
//! demotion, prefix caching and the lease report are the backend's code, over a stand-in model
//! that costs nothing and answers each request with its true output. What the simulator writes
//! itself is that model, the clients, the step-time law and the clock. (Until 2026-12-08 it
//! transcribed the engine's rules by hand, and had drifted: see BENCHMARKS.md, "Simulator".)
//!
//! Model and assumptions:
//! - Time advances by events (µs integers): job arrivals, request tries, scheduler steps,
//!   deliveries to clients, gateway polls, queue deadlines. Zero network latency.
//! - A backend is the engine over a pool of B blocks of 16 tokens, stepped whenever it has
//!   work: each step takes the commands that arrived since the last one (answered at once),
//!   then runs one engine step. A step lasts `a + b × decoded + p × prefilled tokens` ms (what
//!   the stand-in model was asked to compute); its tokens and ends reach clients at its end. A
//!   request of true length L capped at C produces min(L, C) tokens, then (L < C) EOS in a step
//!   of its own. `none`, `prompt` and `vllm` are `--admission none|prompt|none
//!   --on-kv-exhaustion recompute`; the others `--admission reserve`; all with prefix caching
//!   (the paged default), which these workloads never share.
//! - `--preset cpu`: the live bench's backend (SmolLM2-135M, f32 KV 46,080 B/token, a pool of 40
//!   blocks = 640 tokens, context served = the pool's 640 tokens, max batch 16, prefill budget
//!   2,048). Step: a = 30 ms (the bench's `--step-delay-ms 10` plus ≈ 20 ms), b = 5 ms per
//!   sequence, a fit to docs/lab/2026-12-benchmarks-history.md, "Backend: decode throughput" (38.9 / 70.5 / 105.1 / 150.8
//!   tok/s at 1 / 4 / 8 / 16 streams = 25.7 / 56.7 / 76.1 / 106.1 ms per step; least squares
//!   29.5 + 5.05 × n ms without the delay — the fit is rounded down to allow the delay: 35 ms at
//!   1 stream vs 35.7 measured + delay, 70 ms at 8 vs 86, 110 ms at 16 vs 116). Prefill
//!   p = 2.3 ms per token (TTFT 152 ms for a 67-token prompt, same table). The shared, loaded
//!   live machine was slower than these figures; only orderings and counts are comparable.
//! - `--preset gpu`: an 80 GB card serving an 8B Llama: 128 KiB of KV per token (bf16, GQA:
//!   2 × 32 layers × 8 KV heads × 128 × 2 B), 64 GiB of KV per backend = 32,768 blocks = 524,288
//!   tokens, context 8,192, max batch 256, prefill budget 8,192 tokens, step 25 ms + 0.05 ms per
//!   sequence, prefill 0.1 ms per token; `--backends N` backends (4 by default). None of these
//!   figures was measured: they are the brief's assumptions for a card of that class.
//! - Workload (`make_workload`): bench/admission_bench.py's mix, seeded with SplitMix64 (so not
//!   the same draws as Python's `random`): every kind once, then draws by weight; one agent
//!   fan-out burst of 10–20 batch branches per 12 jobs; one prompt over the context. Caps scale
//!   with the served context as there. Prompt tokens and true output lengths were measured
//!   against the live backend (SmolLM2-135M with its own chat template, greedy, a 900-token cap;
//!   2026-12-03): France 37 prompt tokens / 7 output tokens (7 with the fan-out's stop strings
//!   "\n" and "."), colours 34 / 137 (2), 2 + 2 38 / 11 (11), Spanish 35 / to the cap (to the
//!   cap), sky 36 / 53 (9), a fruit 34 / 9 (9), planet 36 / to the cap (22), spider 38 / 154
//!   (13); stories 42 prompt tokens, the counting prompt 11, the long prompt about 30 tokens per
//!   filler sentence + 37 (367 for 11); stories, counting and the long prompt run to their caps.
//!   `--workload live` replays instead the exact 25 requests of the live bench at seed 11 and 12
//!   jobs with a 640-token context (kinds, classes and caps from make_workload, prompt tokens as
//!   the backend counted them, true lengths from vLLM's-behaviour arm of a live run, 20:45 UTC
//!   on 2026-12-02, where nothing was cut short).
//! - Clients: `--clients C` closed-loop clients take jobs in order (a fan-out job sends its
//!   branches at once and waits for all), or `--rate R` open-loop Poisson arrivals of jobs at
//!   R / (mean requests per job) jobs/s, i.e. R requests/s offered. Every request honours the
//!   Retry-After it gets (ms) and gives up when the next try would start more than `--give-up-s`
//!   after its first. Latency and TTFT count from the first try. A request past the context is
//!   refused (413 at the gateway, 400 at a bare backend: the "413" column either way).
//! - Arms, each on the same request sequence and a fresh backend pool: `none` (`--admission
//!   none`: blocks as sequences grow; a sequence that finds none fails = mid-decode KV OOM),
//!   `reserve` (`--admission reserve` alone), `kvgate` (the gateway with the shipped policy in
//!   front of `--admission reserve`), `elastic` (as kvgate, every class `reservation: elastic`,
//!   0.9 quantile (`--elastic-quantile`), 5 samples, prior `--elastic-prior` = 64), `queued` (as elastic, every class
//!   `action: queue` for up to `--queue-wait-ms` = 20,000 and 64 deep, as the live bench's queued
//!   arm), `oracle` (kvgate with every cap set to
//!   the request's true output length), `vllm` (`--admission none --on-kv-exhaustion recompute`).
//!   Several bare backends are balanced round robin; the gateway picks one as `fleet::admit`
//!   does (most room, claims at their home endpoint). The gateway learns finished output lengths
//!   when the client sees the end (the live filter learns them from the next poll).
//! - Not modelled: token counting cost, Envoy, HTTP, lease TTLs and the reaper (every owner is
//!   alive), several gateway workers (one worker holds the queue and the learned lengths).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};

use kvgate_core::config::Config;
use kvgate_core::elastic::OutputLengths;
use kvgate_core::fleet::{self, View};
use kvgate_core::gate::{self, Decision, Holder, Priced};
use kvgate_core::ledger::{ClaimTicket, Ledger};
use kvgate_core::policy::{Action, ClassPolicy, Reservation};
use kvgate_core::queue::{AdmissionQueue, Waiting};
use kvgate_core::reconcile::{self, ProgressTracker};
use kvgate_core::retry::splitmix64;
use kvgate_core::{price_request, ErrorKind, ModelSpec};

type Res<T> = Result<T, String>;

const BLOCK_TOKENS: u64 = 16;
/// Lease ids carry gateway number 1, as the filter's do (`kvgate_core::lease_id`).
const GATEWAY: u64 = 1;
/// A true length for outputs that run to any cap.
const TO_CAP: u64 = 1 << 40;

// ----- the clock and the random numbers -------------------------------------------------------

fn ms(x: f64) -> u64 {
    (x * 1000.0).round().max(0.0) as u64
}

fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

/// SplitMix64 over kvgate-core's mixing step.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let out = splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        out
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi.saturating_sub(lo) + 1)
    }
    fn index(&mut self, n: usize) -> usize {
        (self.next() % (n.max(1) as u64)) as usize
    }
}

/// A request's fair-retry claim key: the same on every try (the filter hashes the caller and the
/// body; here the request's id stands for both).
fn claim_key_of(req: &Req) -> u64 {
    splitmix64(req.id).max(1)
}

// ----- between the clients, the gateway and the backends ----------------------------------------

/// What a request hears from its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Note {
    FirstToken,
    Done(u64, bool),
    KvOom,
    Preempted,
    /// The backend's own 429 (Retry-After 1 s).
    Refused,
}

/// What a backend is sent.
enum Cmd {
    Submit {
        req: usize,
        lease: Option<u64>,
        max_tokens: u64,
        reserve_output: Option<u64>,
        prompt: u64,
        true_len: u64,
    },
    Cancel {
        req: usize,
    },
    /// The gateway preempted its lease for a higher class (the engine's `demote`).
    Demote {
        req: usize,
    },
}

mod arms;
mod backend;
mod gateway;
mod run;
mod workload;

use arms::*;
use backend::Backend;
use gateway::*;
use run::*;
use workload::*;

/// bench/admission_bench.py's `pct` (Python's round: ties to even).
fn pct(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let i = ((p / 100.0 * n as f64 + 0.5).round_ties_even() as i64 - 1).max(0) as usize;
    v.get(i.min(n - 1)).copied().unwrap_or(f64::NAN)
}

fn table(rows: &[Row]) -> String {
    let f = |v: f64, d: usize| {
        if v.is_nan() {
            "–".to_string()
        } else {
            format!("{v:.d$}")
        }
    };
    let oracle = rows
        .iter()
        .find(|r| r.arm == Arm::Oracle)
        .map(|r| r.goodput);
    let mut s = String::from(
        "| arm | completed / sent | mid-decode KV OOM | stopped by preemption (demoted) | 413 | gave up | output tokens | \
         makespan s | goodput tok/s | vs oracle | latency p50 / p99 s | TTFT p50 / p99 s | 429s | \
         degraded | mean KV used / capacity | recomputed tokens (preemptions) |\n",
    );
    s.push_str(&"|---".repeat(16));
    s.push_str("|\n");
    for r in rows {
        let vs = oracle
            .filter(|o| *o > 0.0)
            .map_or("–".to_string(), |o| format!("{:.2}×", r.goodput / o));
        s.push_str(&format!(
            "| {} | {} / {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} | {:.0}% | {} ({}) |\n",
            r.arm.name(),
            r.completed,
            r.sent,
            r.kv_oom,
            r.preempted,
            r.demotions,
            r.too_large,
            r.gave_up,
            r.tokens,
            f(r.makespan_s, 1),
            f(r.goodput, 1),
            vs,
            f(r.lat.0, 1),
            f(r.lat.1, 1),
            f(r.ttft.0, 2),
            f(r.ttft.1, 2),
            r.r429,
            r.degraded,
            100.0 * r.kv_used,
            r.recomputed,
            r.preemptions,
        ));
    }
    s
}

// ----- the command line -----------------------------------------------------------------------

fn parse<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Res<T> {
    let v = v.ok_or(format!("{flag} needs a value"))?;
    v.parse().map_err(|_| format!("{flag}: cannot parse {v:?}"))
}

/// A flag that takes one of two words: true for `yes`, false for `no`.
fn either(flag: &str, v: Option<String>, yes: &str, no: &str) -> Res<bool> {
    match parse::<String>(flag, v)? {
        w if w == yes => Ok(true),
        w if w == no => Ok(false),
        w => Err(format!("{flag} {w:?}: {yes} or {no}")),
    }
}

fn main() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let mut preset_name = "cpu".to_string();
    let mut backends = None;
    let mut workload_name = "mix".to_string();
    let mut seed = 11u64;
    let mut jobs = None;
    let mut clients = None;
    let mut rate = None;
    let mut give_up_s = 60.0;
    let mut patience_to_first_token = true;
    let mut arms = "none,prompt,cap,reserve,kvgate,elastic,queued,oracle,vllm".to_string();
    let mut queue_wait_ms: u64 = 20_000;
    let mut quantile: f64 = 0.9;
    let mut backfill = true;
    let mut lazy_blocks = true;
    let mut by_prompt = false;
    let mut cap = None;
    let mut blocks = None;
    let mut elastic_prior = 64u64;
    let mut max_tries = None;
    let mut step_ms: Option<String> = None;
    let mut prefill_ms = None;
    let mut dump: Option<String> = None;
    let mut context = None;
    let mut poll_ms = 500u64;
    let mut safety: Option<f64> = None;
    let mut sets: Vec<(String, serde_json::Value)> = Vec::new();
    let mut filter_path =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/kvgate-filter.yaml").to_string();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--preset" => preset_name = parse(&a, args.next())?,
            "--backends" => backends = Some(parse(&a, args.next())?),
            "--workload" => workload_name = parse(&a, args.next())?,
            "--seed" => seed = parse(&a, args.next())?,
            "--jobs" => jobs = Some(parse(&a, args.next())?),
            "--clients" => clients = Some(parse(&a, args.next())?),
            "--rate" => rate = Some(parse(&a, args.next())?),
            "--give-up-s" => give_up_s = parse(&a, args.next())?,
            "--patience" => {
                patience_to_first_token = either(&a, args.next(), "first-token", "retries")?
            }
            "--arms" => arms = parse(&a, args.next())?,
            "--cap" => cap = Some(parse(&a, args.next())?),
            "--blocks" => blocks = Some(parse(&a, args.next())?),
            "--elastic-prior" => elastic_prior = parse(&a, args.next())?,
            "--queue-wait-ms" => queue_wait_ms = parse(&a, args.next())?,
            "--elastic-quantile" => quantile = parse(&a, args.next())?,
            "--backfill" => backfill = either(&a, args.next(), "on", "off")?,
            "--filter-config" => filter_path = parse(&a, args.next())?,
            "--lazy-blocks" => lazy_blocks = either(&a, args.next(), "true", "false")?,
            "--allowance-by-prompt" => by_prompt = either(&a, args.next(), "true", "false")?,
            "--max-tries" => max_tries = Some(parse(&a, args.next())?),
            "--step-ms" => step_ms = Some(parse(&a, args.next())?),
            "--prefill-ms" => prefill_ms = Some(parse(&a, args.next())?),
            "--dump" => dump = Some(parse(&a, args.next())?),
            "--context" => context = Some(parse(&a, args.next())?),
            "--poll-ms" => poll_ms = parse(&a, args.next())?,
            "--safety-fraction" => safety = Some(parse(&a, args.next())?),
            "--set" => {
                let kv: String = parse(&a, args.next())?;
                let (k, v) = kv.split_once('=').ok_or("--set needs KEY=JSON")?;
                let v = serde_json::from_str(v).map_err(|e| format!("--set {k}: {e}"))?;
                sets.push((k.to_string(), v));
            }
            "-h" | "--help" => {
                println!("see the header of backend/examples/sim/main.rs");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let mut p = preset(&preset_name)?;
    if let Some(b) = blocks {
        p.blocks = b;
    }
    if let Some(s) = step_ms {
        let (a, b) = s.split_once(',').ok_or(format!(
            "--step-ms {s:?}: A,B (ms per step, ms per sequence)"
        ))?;
        p.step_a_ms = parse("--step-ms", Some(a.to_string()))?;
        p.step_b_ms = parse("--step-ms", Some(b.to_string()))?;
    }
    if let Some(c) = context {
        p.model_context = c;
    }
    if let Some(x) = prefill_ms {
        p.prefill_ms = x;
    }
    let gpu = p.name == "gpu";
    let backends: usize = backends.unwrap_or(if gpu { 4 } else { 1 }).max(1);
    let jobs: usize = jobs.unwrap_or(if gpu { 4000 } else { 12 });
    if clients.is_none() && rate.is_none() {
        if gpu {
            rate = Some(400.0);
        } else {
            clients = Some(8);
        }
    }
    let workload = match workload_name.as_str() {
        "mix" => make_workload(seed, jobs, p.context()),
        "live" => live_workload(),
        other => return Err(format!("--workload {other:?}: must be mix or live")),
    };
    // The cap arm's N as the live bench sizes it: the pool's tokens over the mean worst case
    // (prompt + max_tokens, the context when unset, at most the context).
    let cap = cap.unwrap_or_else(|| {
        let ctx = p.context();
        let sizes: Vec<u64> = workload
            .iter()
            .flatten()
            .map(|r| (r.prompt + r.cap.unwrap_or(ctx)).min(ctx))
            .collect();
        let mean = sizes.iter().sum::<u64>() as f64 / sizes.len().max(1) as f64;
        ((p.blocks * BLOCK_TOKENS) as f64 / mean.max(1.0))
            .round()
            .max(1.0) as usize
    });
    let arms: Vec<Arm> = arms
        .split(',')
        .map(|a| {
            Arm::parse(a).map(|arm| match arm {
                Arm::Cap(_) => Arm::Cap(cap),
                other => other,
            })
        })
        .collect::<Res<_>>()?;
    let o = Opts {
        preset: p.clone(),
        backends,
        clients,
        rate,
        give_up_s,
        patience_to_first_token,
        max_tries,
        seed,
        poll_ms,
        lazy_blocks,
    };
    let n: usize = workload.iter().map(Vec::len).sum();
    let load = match (clients, rate) {
        (Some(c), _) => format!("{c} closed-loop clients"),
        (None, Some(r)) => format!("open-loop Poisson arrivals at {r} requests/s"),
        _ => String::new(),
    };
    println!(
        "preset {} ({} backend(s) × {} blocks = {} tokens of KV each, context {}, step {} + {} ms × batch, prefill {} ms/token, max batch {}); workload {workload_name}: {n} requests in {} jobs, seed {seed}, {load}, give up after {give_up_s} s{} {}; blocks {}\n",
        p.name,
        backends,
        p.blocks,
        p.blocks * BLOCK_TOKENS,
        p.context(),
        p.step_a_ms,
        p.step_b_ms,
        p.prefill_ms,
        p.max_batch,
        workload.len(),
        max_tries.map_or(String::new(), |m| format!(" or {m} tries")),
        if patience_to_first_token {
            "without a first token (wherever the request waits)"
        } else {
            "of retries (a request waiting in a queue waits for ever)"
        },
        if lazy_blocks {
            "lazy (a reservation is a promise, taken as the sequence grows)"
        } else {
            "taken at admission"
        },
    );
    if let Some(Arm::Cap(n)) = arms.iter().find(|a| matches!(a, Arm::Cap(_))) {
        println!("the cap arm runs at most {n} sequences at once per backend\n");
    }
    let tuning = Tuning {
        quantile,
        by_prompt,
        safety,
        sets,
    };
    let mut rows = Vec::new();
    let mut dumped = Vec::new();
    for arm in arms {
        let gw = match arm {
            Arm::Kvgate | Arm::Oracle => Some(Gateway::new(
                filter_config(&filter_path, &p, None, None, &tuning)?,
                backends,
                backfill,
            )),
            Arm::Elastic => Some(Gateway::new(
                filter_config(&filter_path, &p, Some(elastic_prior), None, &tuning)?,
                backends,
                backfill,
            )),
            Arm::Queued => Some(Gateway::new(
                filter_config(
                    &filter_path,
                    &p,
                    Some(elastic_prior),
                    Some(queue_wait_ms),
                    &tuning,
                )?,
                backends,
                backfill,
            )),
            _ => None,
        };
        let (row, lines) = Sim::new(&o, arm, &workload, gw)?.run()?;
        dumped.extend(lines);
        rows.push(row);
    }
    println!("{}", table(&rows));
    if let Some(path) = dump {
        std::fs::write(&path, dumped.join("\n") + "\n").map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}

//! A discrete-event simulator of admission strategies (issue 11, "goodput near the oracle"), at
//! scales the 2-core CPU machine cannot run live.
//!
//! `cargo run --release -p kvgate-backend --example sim -- [--preset cpu|gpu] [--backends N]
//! [--workload mix|live] [--seed S] [--jobs N] [--clients C | --rate R] [--give-up-s S]
//! [--arms none,reserve,kvgate,elastic,oracle,vllm] [--blocks B] [--elastic-prior T]
//! [--filter-config PATH] [--context T] [--step-ms A,B] [--prefill-ms P] [--max-tries N]
//! [--backfill on|off] [--lazy-blocks true|false] [--patience first-token|retries]
//! [--allowance-by-prompt true|false] [--poll-ms M] [--safety-fraction F] [--dump FILE]` prints one markdown table (`make bench-sim` runs the
//! defaults), and on stderr, per gateway arm, where the pool went: the ledger's committed, held
//! back and claimed bytes, the backend's blocks in use and promised, averaged over the polls.
//! `--poll-ms` is how often the gateway polls each backend (500, the shipped configs'
//! `backend.poll_ms`). `--safety-fraction` overrides the filter config's (0.9 shipped).
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

// ----- the workload ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Req {
    id: u64,
    kind: &'static str,
    class: &'static str,
    prompt: u64,
    cap: Option<u64>,
    /// Tokens greedy decoding produces with no cap.
    true_len: u64,
}

/// A chat question: prompt tokens with ChatML, its answer's length, and with the fan-out's stop
/// strings ("\n", ".").
struct Question(u64, u64, u64);

/// bench/admission_bench.py's QUESTIONS, in order (see the header for where the lengths come from).
const QUESTIONS: [Question; 8] = [
    Question(37, 7, 7),       // What is the capital of France?
    Question(34, 137, 2),     // Name three colours.
    Question(38, 11, 11),     // What is 2 + 2?
    Question(35, 1000, 1000), // Say hello in Spanish. (ran to a 900-token cap, stops or not)
    Question(36, 53, 9),      // What colour is the sky?
    Question(34, 9, 9),       // Name a fruit.
    Question(36, 1000, 22),   // What is the largest planet? (ran to a 900-token cap)
    Question(38, 154, 13),    // How many legs does a spider have?
];

struct Kind {
    name: &'static str,
    weight: u64,
    class: &'static str,
}

#[rustfmt::skip]
const KINDS: [Kind; 8] = [
    kind("short prompt, big cap", 5, "batch"),
    kind("short prompt, big cap (strict)", 3, "standard"),
    kind("unset cap", 2, "standard"),
    kind("chat", 4, "interactive"),
    kind("vip chat", 1, "vip"),
    kind("long prompt, small cap", 3, "interactive"),
    kind("counting, to its cap", 2, "batch"),
    kind("long story", 1, "standard"),
];

const fn kind(name: &'static str, weight: u64, class: &'static str) -> Kind {
    Kind {
        name,
        weight,
        class,
    }
}

const FALLBACK_KIND: Kind = kind("long story", 1, "standard");

fn question(rng: &mut Rng) -> &'static Question {
    QUESTIONS
        .get(rng.index(QUESTIONS.len()))
        .unwrap_or(&Question(37, 7, 7))
}

fn make_request(kind: usize, rng: &mut Rng, context: u64, id: u64) -> Req {
    let k = KINDS.get(kind).unwrap_or(&FALLBACK_KIND);
    let big = |rng: &mut Rng| rng.range(context * 2 / 5, context * 3 / 4);
    let (prompt, cap, true_len) = match kind {
        0 | 1 => {
            let q = question(rng);
            (q.0, Some(big(rng)), q.1)
        }
        2 => {
            let q = question(rng);
            (q.0, None, q.1)
        }
        3 | 4 => {
            let q = question(rng);
            (q.0, Some(128), q.1)
        }
        5 => (30 * rng.range(8, 14) + 37, Some(40), TO_CAP),
        6 => (11, Some(rng.range(100, 200)), TO_CAP),
        _ => (42, Some(rng.range(150, 250)), TO_CAP),
    };
    Req {
        id,
        kind: k.name,
        class: k.class,
        prompt,
        cap,
        true_len,
    }
}

/// The mix of bench/admission_bench.py's `make_workload`: jobs of one request, or a fan-out burst.
fn make_workload(seed: u64, jobs: usize, context: u64) -> Vec<Vec<Req>> {
    let mut rng = Rng(seed);
    let n_fan = (jobs / 12).max(1);
    let fanouts: Vec<usize> = (0..n_fan)
        .map(|i| (jobs as f64 * (i as f64 + 0.5) / n_fan as f64) as usize)
        .collect();
    let over_at = (jobs / 3..jobs).find(|j| !fanouts.contains(j));
    let mut deck: Vec<usize> = (0..KINDS.len()).collect();
    for i in (1..deck.len()).rev() {
        let j = rng.index(i + 1);
        deck.swap(i, j);
    }
    let mut deck: VecDeque<usize> = deck.into();
    let total_weight: u64 = KINDS.iter().map(|k| k.weight).sum();
    let mut out = Vec::with_capacity(jobs);
    let mut id = 0u64;
    for j in 0..jobs {
        if fanouts.contains(&j) {
            let k = rng.range(10, 20);
            let job = (0..k)
                .map(|_| {
                    id += 1;
                    let q = question(&mut rng);
                    Req {
                        id,
                        kind: "agent fan-out branch",
                        class: "batch",
                        prompt: q.0,
                        cap: Some(rng.range(200, 400)),
                        true_len: q.2,
                    }
                })
                .collect();
            out.push(job);
        } else if Some(j) == over_at {
            id += 1;
            out.push(vec![Req {
                id,
                kind: "prompt over the context",
                class: "standard",
                prompt: context + 64,
                cap: Some(16),
                true_len: 16,
            }]);
        } else {
            let kind = deck.pop_front().unwrap_or_else(|| {
                let mut x = rng.range(1, total_weight);
                KINDS
                    .iter()
                    .position(|k| {
                        if x <= k.weight {
                            true
                        } else {
                            x -= k.weight;
                            false
                        }
                    })
                    .unwrap_or(0)
            });
            id += 1;
            out.push(vec![make_request(kind, &mut rng, context, id)]);
        }
    }
    out
}

/// The live bench's 25 requests at seed 11, 12 jobs, 640 tokens of context: (job, kind, class,
/// prompt tokens, cap, tokens it produced greedily).
type LiveRow = (usize, &'static str, &'static str, u64, Option<u64>, u64);

#[rustfmt::skip]
const LIVE_SEED11_640: [LiveRow; 25] = [
    (0, "long story", "standard", 42, Some(230), 230),
    (1, "counting, to its cap", "batch", 11, Some(178), 178),
    (2, "vip chat", "vip", 38, Some(128), 11),
    (3, "chat", "interactive", 34, Some(128), 128),
    (4, "prompt over the context", "standard", 704, Some(16), 16),
    (5, "long prompt, small cap", "interactive", 367, Some(40), 40),
    (6, "agent fan-out branch", "batch", 38, Some(223), 11),
    (6, "agent fan-out branch", "batch", 37, Some(352), 7),
    (6, "agent fan-out branch", "batch", 36, Some(315), 22),
    (6, "agent fan-out branch", "batch", 38, Some(359), 11),
    (6, "agent fan-out branch", "batch", 37, Some(335), 7),
    (6, "agent fan-out branch", "batch", 34, Some(215), 2),
    (6, "agent fan-out branch", "batch", 37, Some(248), 7),
    (6, "agent fan-out branch", "batch", 35, Some(353), 353),
    (6, "agent fan-out branch", "batch", 37, Some(399), 7),
    (6, "agent fan-out branch", "batch", 38, Some(283), 13),
    (6, "agent fan-out branch", "batch", 38, Some(351), 13),
    (6, "agent fan-out branch", "batch", 35, Some(332), 332),
    (6, "agent fan-out branch", "batch", 35, Some(363), 363),
    (6, "agent fan-out branch", "batch", 36, Some(327), 9),
    (7, "unset cap", "standard", 37, None, 7),
    (8, "short prompt, big cap", "batch", 34, Some(373), 137),
    (9, "short prompt, big cap (strict)", "standard", 36, Some(360), 53),
    (10, "long story", "standard", 42, Some(240), 240),
    (11, "short prompt, big cap (strict)", "standard", 35, Some(387), 387),
];

fn live_workload() -> Vec<Vec<Req>> {
    let mut out: Vec<Vec<Req>> = Vec::new();
    for (i, (job, kind, class, prompt, cap, len)) in LIVE_SEED11_640.iter().enumerate() {
        while out.len() <= *job {
            out.push(Vec::new());
        }
        // An output that ended at its cap in the oracle pass would have run on.
        let true_len = if Some(*len) == *cap { TO_CAP } else { *len };
        if let Some(j) = out.get_mut(*job) {
            j.push(Req {
                id: i as u64 + 1,
                kind,
                class,
                prompt: *prompt,
                cap: *cap,
                true_len,
            });
        }
    }
    out
}

// ----- presets and arms -----------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Preset {
    name: &'static str,
    /// layers, kv heads, head dim, KV dtype bytes
    spec: (u64, u64, u64, u64),
    model_context: u64,
    blocks: u64,
    step_a_ms: f64,
    step_b_ms: f64,
    prefill_ms: f64,
    max_batch: usize,
    prefill_budget: u64,
}

impl Preset {
    /// The KV shape as the backend's report gives it.
    fn model_spec(&self) -> ModelSpec {
        let (layers, kv_heads, head_dim, kv_dtype_bytes) = self.spec;
        ModelSpec {
            layers,
            kv_heads,
            head_dim,
            kv_dtype_bytes,
            context_tokens: self.model_context,
        }
    }
    fn bytes_per_token(&self) -> u64 {
        let (l, h, d, b) = self.spec;
        2 * l * h * d * b
    }
    fn block_bytes(&self) -> u64 {
        self.bytes_per_token() * BLOCK_TOKENS
    }
    /// The backend serves no more context than its pool holds.
    fn context(&self) -> u64 {
        self.model_context.min(self.blocks * BLOCK_TOKENS)
    }
}

fn preset(name: &str) -> Res<Preset> {
    match name {
        "cpu" => Ok(Preset {
            name: "cpu",
            spec: (30, 3, 64, 4),
            model_context: 8192,
            blocks: 40,
            step_a_ms: 30.0,
            step_b_ms: 5.0,
            prefill_ms: 2.3,
            max_batch: 16,
            prefill_budget: 2048,
        }),
        "gpu" => Ok(Preset {
            name: "gpu",
            spec: (32, 8, 128, 2),
            model_context: 8192,
            blocks: 32_768,
            step_a_ms: 25.0,
            step_b_ms: 0.05,
            prefill_ms: 0.1,
            max_batch: 256,
            prefill_budget: 8192,
        }),
        other => Err(format!("--preset {other:?}: must be cpu or gpu")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arm {
    None,
    /// Admission on prompt length alone (backend `--admission prompt`).
    Prompt,
    /// A concurrency cap: `--admission none --max-batch N`.
    Cap(usize),
    Reserve,
    Kvgate,
    Elastic,
    /// As elastic, every class waiting in the gateway's queue (`action: queue`).
    Queued,
    Oracle,
    Vllm,
}

impl Arm {
    fn parse(s: &str) -> Res<Arm> {
        Ok(match s {
            "none" => Arm::None,
            "prompt" => Arm::Prompt,
            // N is sized from the workload in `main` (or `--cap`).
            "cap" => Arm::Cap(0),
            "reserve" => Arm::Reserve,
            "kvgate" => Arm::Kvgate,
            "elastic" => Arm::Elastic,
            "queued" => Arm::Queued,
            "oracle" => Arm::Oracle,
            "vllm" => Arm::Vllm,
            other => return Err(format!("--arms: unknown arm {other:?}")),
        })
    }
    fn name(self) -> &'static str {
        match self {
            Arm::None => "none",
            Arm::Prompt => "prompt",
            Arm::Cap(_) => "cap",
            Arm::Reserve => "reserve",
            Arm::Kvgate => "kvgate",
            Arm::Elastic => "elastic",
            Arm::Queued => "queued",
            Arm::Oracle => "oracle",
            Arm::Vllm => "vllm",
        }
    }
    fn gateway(self) -> bool {
        matches!(self, Arm::Kvgate | Arm::Elastic | Arm::Queued | Arm::Oracle)
    }
    fn reserve(self) -> bool {
        !matches!(self, Arm::None | Arm::Prompt | Arm::Cap(_) | Arm::Vllm)
    }
    /// Most sequences running at once.
    fn max_batch(self, p: &Preset) -> usize {
        match self {
            Arm::Cap(n) => n.min(p.max_batch),
            _ => p.max_batch,
        }
    }
}

/// The shipped filter configuration (the JSON block of envoy/kvgate-filter.yaml) priced against
/// one backend's pool; with `elastic_prior`, every class reserves elastically.
fn filter_config(
    path: &str,
    p: &Preset,
    elastic_prior: Option<u64>,
    queue_ms: Option<u64>,
    quantile: f64,
    by_prompt: bool,
    safety: Option<f64>,
) -> Res<Config> {
    let yaml = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    // The JSON is the block scalar after `value: |`, up to the first line indented less.
    let mut lines = yaml
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("value: |"));
    let head = lines.next().ok_or(format!("{path}: no `value: |` block"))?;
    let indent = head.len() - head.trim_start().len();
    let json: String = lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
        .map(|l| format!("{l}\n"))
        .collect();
    let mut v: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| format!("{path}: the filter JSON: {e}"))?;
    let o = v
        .as_object_mut()
        .ok_or(format!("{path}: the filter JSON is not an object"))?;
    let (layers, kv_heads, head_dim, dtype) = p.spec;
    // What the backend's descriptor tells a "from_backend" filter: its spec at the served context.
    o.insert(
        "model".into(),
        serde_json::json!({"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                           "kv_dtype_bytes": dtype, "context_tokens": p.context()}),
    );
    o.remove("fallback_model");
    o.remove("fallback_token_multiplier");
    // `backend` stays: classes that preempt need it (the simulated backend demotes their
    // victims); nothing here reads its callout settings.
    // As bench/admission_bench.py's filter_config: the budget is the pool, one block of margin.
    o.insert(
        "kv_budget_bytes".into(),
        (p.blocks * p.block_bytes()).into(),
    );
    o.insert("scratch_margin_bytes".into(), p.block_bytes().into());
    if let Some(f) = safety {
        o.insert("safety_fraction".into(), f.into());
    }
    if let Some(prior) = elastic_prior {
        let classes = o
            .get_mut("policy")
            .and_then(|p| p.get_mut("classes"))
            .and_then(|c| c.as_object_mut())
            .ok_or(format!("{path}: no policy.classes"))?;
        for c in classes.values_mut() {
            if let Some(c) = c.as_object_mut() {
                c.insert("reservation".into(), "elastic".into());
                c.insert("elastic_quantile".into(), quantile.into());
                c.insert("elastic_min_samples".into(), 5.into());
                c.insert("elastic_prior_tokens".into(), prior.into());
                c.insert("elastic_by_prompt".into(), by_prompt.into());
                if let Some(ms) = queue_ms {
                    // As bench/admission_bench.py's filter_config with `queue_ms`.
                    c.remove("min_output_tokens");
                    c.insert("action".into(), "queue".into());
                    c.insert("max_wait_ms".into(), ms.into());
                    c.insert("max_depth".into(), 64.into());
                }
            }
        }
    }
    Config::from_json(v.to_string().as_bytes()).map_err(|e| format!("filter config: {e:?}"))
}

// ----- the backend (backend/src/engine.rs's rules) --------------------------------------------

/// A request's fair-retry claim key: the same on every try (the filter hashes the caller and the
/// body; here the request's id stands for both).
fn claim_key_of(req: &Req) -> u64 {
    splitmix64(req.id).max(1)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Note {
    FirstToken,
    Done(u64, bool),
    KvOom,
    Preempted,
    /// The backend's own 429 (Retry-After 1 s).
    Refused,
}

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
    /// engine.rs's `demote`: the gateway preempted its lease for a higher class.
    Demote {
        req: usize,
    },
}

mod backend;
use backend::Backend;

// ----- the gateway ----------------------------------------------------------------------------

struct Gateway {
    cfg: Config,
    ledgers: Vec<Ledger>,
    views: Vec<View>,
    queue: AdmissionQueue<usize>,
    learned: HashMap<String, OutputLengths>,
    next_lease: u64,
    /// Live lease id → (request, endpoint).
    leases: HashMap<u64, (usize, usize)>,
    /// Per backend, output tokens a second of one decoding sequence as the polls see it (the
    /// filter's `Endpoint::tokens_per_s`; 0 until its tracker's model is warm).
    tokens_per_s: Vec<f64>,
    /// Per backend, the filter's `ProgressTracker`.
    progress: Vec<ProgressTracker>,
    /// Requests carry their expected run (`ClaimTicket::run_ms`) and the queue is tried behind
    /// its front (`--backfill`).
    backfill: bool,
}

enum Attempt {
    Forward { cmds: Vec<(usize, Cmd)> },
    Queued { deadline_ms: u64 },
    Refused { status: u32, retry_ms: Option<u64> },
}

impl Gateway {
    fn new(cfg: Config, backends: usize, backfill: bool) -> Self {
        let cap = cfg.pricing.capacity_bytes;
        let on = cfg.backfill;
        let ledgers: Vec<Ledger> = (0..backends)
            .map(|i| {
                Ledger::new(
                    cap,
                    ((i as u64 + 1) << 32) | kvgate_core::lease_id::compose(GATEWAY, 0),
                )
            })
            .collect();
        let views = ledgers
            .iter()
            .map(|l| {
                let mut v = View {
                    eligible: true,
                    ..View::default()
                };
                v.observe(l);
                v
            })
            .collect();
        let mut queue = AdmissionQueue::default();
        queue.set_aging_ms(cfg.policy.queue_aging_ms);
        Gateway {
            cfg,
            ledgers,
            views,
            queue,
            learned: HashMap::new(),
            tokens_per_s: vec![0.0; backends],
            progress: vec![ProgressTracker::default(); backends],
            backfill: backfill && on,
            next_lease: 1,
            leases: HashMap::new(),
        }
    }

    fn class(&self, name: &str) -> ClassPolicy {
        self.cfg.policy.resolve(Some(name)).clone()
    }

    /// What request `r` reserves now: as the filter's `Ticket::reprice`, at every try (the
    /// allowance of an elastic class moves as it learns).
    fn priced(&self, r: &ReqState) -> Result<(ClassPolicy, Priced), kvgate_core::ApiError> {
        let cfg = &self.cfg;
        let prompt = vec![r.req.prompt];
        let price = price_request(&cfg.pricing, &prompt, r.cap, 1)?;
        let class = self.class(r.req.class);
        let mut priced = Priced {
            prompt_tokens: prompt,
            choices: 1,
            price,
            elastic: None,
            prefix: None,
        };
        if let Reservation::Elastic(p) = class.reservation {
            let a = p.allowance_for(self.learned.get(&class.name), r.req.prompt, u64::MAX);
            if a < u64::MAX {
                priced = priced.with_allowance(cfg, a);
            }
        }
        Ok((class, priced))
    }

    /// The filter's `Ticket::claim_active`: request `r`'s place in line at some endpoint is
    /// active (the ledger sets bytes aside for it).
    fn claim_active(&self, r: &ReqState) -> bool {
        let key = claim_key_of(&r.req);
        self.ledgers
            .iter()
            .any(|l| l.claims().iter().any(|c| c.key == key && c.active))
    }

    /// `Ticket::run_ms`: how long request `r` is expected to decode (0: unknown).
    fn run_ms_of(&self, r: &ReqState) -> u64 {
        match self.priced(r) {
            // To its cap, as the filter's: the line does not take back what a backfill grows
            // past an elastic allowance.
            Ok((_, p)) if self.backfill => {
                reconcile::run_ms(self.tokens_per_s.iter().copied(), p.price.cap.cap)
            }
            _ => 0,
        }
    }

    /// One try of request `r` (as the filter's `finish` and `Ticket::attempt`).
    fn attempt(
        &mut self,
        r: &ReqState,
        idx: usize,
        now_ms: u64,
        jitter_seed: u64,
        from_queue: bool,
        behind: bool,
    ) -> Attempt {
        let (class, priced) = match self.priced(r) {
            Ok(v) => v,
            Err(e) => {
                let status = match e.kind {
                    ErrorKind::ContextLengthExceeded => self.cfg.context_error_status,
                    _ => e.status,
                };
                return Attempt::Refused {
                    status,
                    retry_ms: None,
                };
            }
        };
        let run_ms = self.run_ms_of(r);
        let cfg = &self.cfg;
        let lease_id = kvgate_core::lease_id::compose(GATEWAY, self.next_lease);
        self.next_lease += 1;
        let claim = (cfg.fair_retry_patience_ms > 0).then(|| ClaimTicket {
            key: claim_key_of(&r.req),
            patience_ms: cfg.fair_retry_patience_ms,
            run_ms,
            max_line_permille: cfg.max_line_permille(&class),
            waits: from_queue || self.queue.would_wait(&class),
            grows_to: priced.price.bytes,
        });
        let holder = Holder {
            lease_id: Some(lease_id),
            owner: 1,
            claim,
        };
        let need = priced.reserve_bytes();
        for (v, l) in self.views.iter_mut().zip(&self.ledgers) {
            v.observe(l);
        }
        // fleet::admit's plain pass: no degrade, no preemption, where the request fits.
        let plain_class = ClassPolicy {
            action: Action::Reject,
            preempts: Vec::new(),
            ..class.clone()
        };
        let claim_key = claim.map(|c| c.key);
        let home = claim_key.and_then(|k| fleet::home(&self.views, need, k));
        let mut placed = None;
        // A backfill try keeps only a backfill, which the plain pass never is.
        let plain = if behind {
            Vec::new()
        } else {
            fleet::plan(&self.views, need, fleet::Choice::MostRoom, None)
        };
        for index in plain {
            let Some(l) = self.ledgers.get_mut(index) else {
                continue;
            };
            let own = claim_key.map_or(0, |k| l.held_for(k));
            if l.free().saturating_add(own) < need {
                continue;
            }
            let before = l.clone();
            match gate::decide(l, cfg, &plain_class, &priced, holder, now_ms, jitter_seed) {
                d @ Decision::Admitted { .. } => {
                    if let (Some(h), Some(k)) = (home.filter(|h| *h != index), claim_key) {
                        if let Some(hl) = self.ledgers.get_mut(h) {
                            hl.drop_claim(k);
                        }
                    }
                    placed = Some((index, d));
                    break;
                }
                Decision::Rejected(_) => *l = before,
            }
        }
        let (index, decision) = match placed {
            Some(p) => p,
            None => {
                // The policy pass: the request's home, else the most room that could hold it.
                let index = home.unwrap_or_else(|| {
                    (0..self.views.len())
                        .max_by_key(|&i| {
                            let v = self.views.get(i).copied().unwrap_or_default();
                            (v.capacity >= need, v.room, Reverse(i))
                        })
                        .unwrap_or(0)
                });
                let Some(l) = self.ledgers.get_mut(index) else {
                    return Attempt::Refused {
                        status: 503,
                        retry_ms: Some(cfg.retry_after.min_ms),
                    };
                };
                if behind {
                    // Ticket::attempt_backfill: only what the ledger admits ahead of the line.
                    match gate::backfill(l, cfg, &class, &priced, holder, now_ms) {
                        Some(d) => (index, d),
                        None => {
                            return Attempt::Refused {
                                status: 429,
                                retry_ms: None,
                            }
                        }
                    }
                } else {
                    let d = gate::decide(l, cfg, &class, &priced, holder, now_ms, jitter_seed);
                    (index, d)
                }
            }
        };
        match decision {
            Decision::Admitted {
                lease,
                cap,
                preempted,
                ..
            } => {
                let mut cmds = Vec::new();
                // Demoted, not stopped: the victims keep their leases (reserving nothing) until
                // their requests end.
                for v in preempted {
                    if let Some((victim, at)) = self.leases.get(&v.id).copied() {
                        cmds.push((at, Cmd::Demote { req: victim }));
                    }
                }
                self.leases.insert(lease.id, (idx, index));
                cmds.push((
                    index,
                    Cmd::Submit {
                        req: idx,
                        lease: Some(lease.id),
                        max_tokens: cap,
                        reserve_output: priced.elastic.map(|e| e.output_tokens),
                        prompt: r.req.prompt,
                        true_len: r.req.true_len,
                    },
                ));
                Attempt::Forward { cmds }
            }
            Decision::Rejected(err) => {
                if let (
                    false,
                    ErrorKind::KvCapacityExceeded,
                    Action::Queue {
                        max_wait_ms,
                        max_depth,
                    },
                ) = (from_queue, err.kind, &class.action)
                {
                    let deadline_ms = now_ms + max_wait_ms;
                    // A retry keeps the age of its first refusal (the filter's waiting_since).
                    let arrived_ms = claim_key
                        .and_then(|k| self.ledgers.get(index)?.waiting_since(k))
                        .map_or(now_ms, |w| w.min(now_ms));
                    let pushed = self.queue.push(
                        idx,
                        Waiting {
                            class: &class.name,
                            priority: class.priority,
                            arrived_ms,
                            deadline_ms,
                            max_depth: *max_depth,
                        },
                    );
                    if pushed.is_ok() {
                        return Attempt::Queued { deadline_ms };
                    }
                    return Attempt::Refused {
                        status: 429,
                        retry_ms: Some(err.retry_after_ms.unwrap_or(cfg.retry_after.min_ms)),
                    };
                }
                Attempt::Refused {
                    status: err.status,
                    retry_ms: err.retry_after_ms,
                }
            }
        }
    }

    /// The end of a request's stream (or the backend's refusal): its lease goes back.
    fn release(&mut self, lease: u64, now_ms: u64) {
        if let Some((_, at)) = self.leases.remove(&lease) {
            if let Some(l) = self.ledgers.get_mut(at) {
                l.release(lease, now_ms);
            }
        }
    }
}

// ----- the simulation -------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    KvOom,
    Preempted,
    TooLarge,
    GaveUp,
}

struct ReqState {
    req: Req,
    job: usize,
    /// The cap this arm sends (the oracle's is the true length).
    cap: Option<u64>,
    first_try: Option<u64>,
    outcome: Option<Outcome>,
    ttft: Option<u64>,
    end: u64,
    tokens: u64,
    n429: u64,
    tries: u64,
    degraded: bool,
    lease: Option<u64>,
    /// The backend it was last sent to (where a client that gives up cancels it).
    backend: Option<usize>,
}

enum Ev {
    Job(usize, Option<usize>),
    Try(usize),
    /// The client's patience runs out: no first token `give_up_s` after its first try.
    Patience(usize),
    Step(usize),
    Deliver(usize, Note),
    Poll,
    Drain,
}

struct Entry {
    t: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.t, self.seq) == (o.t, o.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    /// Earliest first in a max-heap.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.t, o.seq).cmp(&(self.t, self.seq))
    }
}

struct Opts {
    preset: Preset,
    backends: usize,
    clients: Option<usize>,
    rate: Option<f64>,
    give_up_s: f64,
    /// The client gives up on a request without a first token `give_up_s` after its first
    /// try, wherever it waits (`--patience first-token`, the default); with `--patience
    /// retries` only a Retry-After that would end past it makes it give up (a request waiting
    /// in a queue waits for ever).
    patience_to_first_token: bool,
    max_tries: Option<u64>,
    seed: u64,
    poll_ms: u64,
    /// `--lazy-blocks`: the backend's `--lazy-blocks` (see the header).
    lazy_blocks: bool,
}

struct Sim<'a> {
    o: &'a Opts,
    arm: Arm,
    now: u64,
    seq: u64,
    heap: BinaryHeap<Entry>,
    reqs: Vec<ReqState>,
    jobs: Vec<Vec<usize>>,
    job_left: Vec<usize>,
    job_client: Vec<Option<usize>>,
    next_job: usize,
    resolved: usize,
    backends: Vec<Backend>,
    gw: Option<Gateway>,
    rr: usize,
    tries: u64,
    last_step: Vec<u64>,
    /// Polls × endpoints seen, then the sums of what `poll` samples (see its end).
    pools: [f64; 6],
}

#[derive(Debug, Clone)]
struct Row {
    arm: Arm,
    sent: usize,
    completed: usize,
    kv_oom: usize,
    preempted: usize,
    too_large: usize,
    gave_up: usize,
    tokens: u64,
    makespan_s: f64,
    goodput: f64,
    lat: (f64, f64),
    ttft: (f64, f64),
    r429: u64,
    degraded: usize,
    kv_used: f64,
    recomputed: u64,
    preemptions: u64,
    demotions: u64,
}

impl<'a> Sim<'a> {
    fn new(o: &'a Opts, arm: Arm, workload: &[Vec<Req>], gw: Option<Gateway>) -> Res<Self> {
        let ctx = o.preset.context();
        let mut reqs = Vec::new();
        let mut jobs = Vec::new();
        for (j, job) in workload.iter().enumerate() {
            let mut ids = Vec::new();
            for r in job {
                // The oracle's first pass produced min(true length, cap or what the context
                // leaves); a request past the context taught it nothing and keeps its cap.
                let cap = match arm {
                    Arm::Oracle if r.prompt < ctx => Some(
                        r.true_len
                            .min(r.cap.unwrap_or(ctx - r.prompt))
                            .min(ctx - r.prompt)
                            .max(1),
                    ),
                    _ => r.cap,
                };
                ids.push(reqs.len());
                reqs.push(ReqState {
                    req: r.clone(),
                    job: j,
                    cap,
                    first_try: None,
                    outcome: None,
                    ttft: None,
                    end: 0,
                    tokens: 0,
                    n429: 0,
                    tries: 0,
                    degraded: false,
                    lease: None,
                    backend: None,
                });
            }
            jobs.push(ids);
        }
        let job_left = jobs.iter().map(Vec::len).collect();
        Ok(Sim {
            o,
            arm,
            now: 0,
            seq: 0,
            heap: BinaryHeap::new(),
            job_client: vec![None; jobs.len()],
            jobs,
            job_left,
            reqs,
            next_job: 0,
            resolved: 0,
            backends: (0..o.backends)
                .map(|_| Backend::new(&o.preset, arm, o.lazy_blocks))
                .collect::<Res<Vec<_>>>()?,
            gw,
            rr: 0,
            tries: 0,
            last_step: vec![0; o.backends],
            pools: [0.0; 6],
        })
    }

    fn push(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Entry {
            t,
            seq: self.seq,
            ev,
        });
    }

    fn run(mut self) -> Res<(Row, Vec<String>)> {
        match (self.o.clients, self.o.rate) {
            (Some(c), _) => {
                for client in 0..c {
                    self.next_client_job(client);
                }
            }
            (None, Some(rate)) => {
                let per_job = self.reqs.len() as f64 / self.jobs.len().max(1) as f64;
                let mean_gap_ms = 1000.0 * per_job / rate;
                let mut rng = Rng(self.o.seed ^ 0x5eed_a77e);
                let mut t = 0.0;
                for j in 0..self.jobs.len() {
                    self.push(ms(t), Ev::Job(j, None));
                    t += -mean_gap_ms * (1.0 - rng.unit()).ln();
                }
            }
            (None, None) => return Err("give --clients or --rate".into()),
        }
        if self.gw.is_some() {
            self.push(0, Ev::Poll);
        }
        let total = self.reqs.len();
        let limit = ms(3_600_000.0 * 24.0);
        while self.resolved < total {
            let Some(e) = self.heap.pop() else {
                return Err(format!(
                    "{}: no events left with {} of {total} requests unresolved",
                    self.arm.name(),
                    total - self.resolved
                ));
            };
            if e.t > limit {
                return Err(format!("{}: past a simulated day", self.arm.name()));
            }
            self.now = e.t;
            match e.ev {
                Ev::Job(j, client) => self.start_job(j, client),
                Ev::Try(r) => self.try_request(r),
                Ev::Patience(r) => self.patience(r),
                Ev::Step(b) => self.step(b),
                Ev::Deliver(r, n) => self.deliver(r, n),
                Ev::Poll => self.poll(),
                Ev::Drain => self.drain(),
            }
        }
        let lines = self
            .reqs
            .iter()
            .map(|s| {
                serde_json::json!({
                    "arm": self.arm.name(), "id": s.req.id, "kind": s.req.kind,
                    "class": s.req.class, "prompt": s.req.prompt, "cap": s.cap,
                    "outcome": format!("{:?}", s.outcome), "tokens": s.tokens,
                    "tries": s.tries, "degraded": s.degraded,
                    "first_try_s": s.first_try.map(secs), "end_s": secs(s.end),
                    "ttft_s": s.ttft.map(secs),
                })
                .to_string()
            })
            .collect();
        if self.gw.is_some() {
            let [n, sums @ ..] = self.pools;
            let [committed, held_back, claimed, used, promised] = sums.map(|x| x / n.max(1.0));
            eprintln!(
                "{}: mean over polls and endpoints: of the ledger's capacity {committed:.2} committed, {held_back:.2} held back, {claimed:.2} set aside for claims; of the pool {used:.2} in use, {promised:.2} promised",
                self.arm.name()
            );
        }
        Ok((self.summarise(), lines))
    }

    fn next_client_job(&mut self, client: usize) {
        if self.next_job < self.jobs.len() {
            let j = self.next_job;
            self.next_job += 1;
            self.push(self.now, Ev::Job(j, Some(client)));
        }
    }

    fn start_job(&mut self, j: usize, client: Option<usize>) {
        if let Some(c) = self.job_client.get_mut(j) {
            *c = client;
        }
        let ids = self.jobs.get(j).cloned().unwrap_or_default();
        for r in ids {
            self.try_request(r);
        }
    }

    fn resolve(&mut self, r: usize, outcome: Outcome) {
        let now = self.now;
        let Some(s) = self.reqs.get_mut(r) else {
            return;
        };
        if s.outcome.is_some() {
            return;
        }
        s.outcome = Some(outcome);
        s.end = now;
        let j = s.job;
        self.resolved += 1;
        if let Some(left) = self.job_left.get_mut(j) {
            *left = left.saturating_sub(1);
            if *left == 0 {
                if let Some(Some(c)) = self.job_client.get(j).copied() {
                    self.next_client_job(c);
                }
            }
        }
    }

    /// The client gives up on a request with no first token `give_up_s` after its first try,
    /// wherever it waits: sleeping on a Retry-After, in the gateway's queue, or admitted and
    /// waiting in a backend's queue (or preempted before its first token). It closes the
    /// connection: the filter releases the lease at the stream's end and the backend drops the
    /// sequence at its next step (engine.rs drops a sequence whose client is gone).
    fn patience(&mut self, r: usize) {
        let now_ms = self.now / 1000;
        let Some(s) = self.reqs.get(r) else {
            return;
        };
        if s.outcome.is_some() || s.ttft.is_some() {
            return;
        }
        let (lease, backend, key) = (s.lease, s.backend, claim_key_of(&s.req));
        if let Some(gw) = self.gw.as_mut() {
            // The filter's end of stream: a request still in the queue leaves its place in
            // line holding nothing (Worker::leave_line).
            if !gw.queue.remove_where(|i| *i == r).is_empty() {
                for l in &mut gw.ledgers {
                    l.leave_line(key, now_ms);
                }
            }
            if let Some(l) = lease {
                gw.release(l, now_ms);
            }
        }
        if let Some(b) = backend {
            self.submit(b, Cmd::Cancel { req: r });
        }
        self.resolve(r, Outcome::GaveUp);
        self.drain();
    }

    fn refused(&mut self, r: usize, status: u32, retry_ms: Option<u64>) {
        if status != 429 && status != 503 {
            self.resolve(r, Outcome::TooLarge);
            return;
        }
        let now = self.now;
        let give_up = ms(self.o.give_up_s * 1000.0);
        let Some(s) = self.reqs.get_mut(r) else {
            return;
        };
        if status == 429 {
            s.n429 += 1;
        }
        let wait = ms(retry_ms.unwrap_or(1000) as f64);
        let first = s.first_try.unwrap_or(now);
        let out_of_tries = self.o.max_tries.is_some_and(|m| s.tries >= m);
        if out_of_tries || now + wait - first > give_up {
            self.resolve(r, Outcome::GaveUp);
        } else {
            self.push(now + wait, Ev::Try(r));
        }
    }

    fn submit(&mut self, b: usize, cmd: Cmd) {
        let now = self.now;
        if let Cmd::Submit { req, .. } = cmd {
            if let Some(s) = self.reqs.get_mut(req) {
                s.backend = Some(b);
            }
        }
        if let Some(be) = self.backends.get_mut(b) {
            be.inbox.push(cmd);
            if !be.stepping {
                be.stepping = true;
                self.push(now, Ev::Step(b));
            }
        }
    }

    fn try_request(&mut self, r: usize) {
        let now = self.now;
        let ctx = self.o.preset.context();
        self.tries += 1;
        let Some(s) = self.reqs.get_mut(r) else {
            return;
        };
        if s.outcome.is_some() {
            return;
        }
        let first = s.first_try.is_none();
        s.first_try.get_or_insert(now);
        s.tries += 1;
        if first && self.o.patience_to_first_token {
            let give_up = ms(self.o.give_up_s * 1000.0);
            self.push(now + give_up, Ev::Patience(r));
        }
        let Some(s) = self.reqs.get(r) else {
            return;
        };
        if !self.arm.gateway() {
            let (prompt, cap, true_len) = (s.req.prompt, s.cap, s.req.true_len);
            // The backend's own validation: a prompt or a cap past the context is a 400.
            let fits = prompt < ctx && cap.is_none_or(|c| prompt + c <= ctx);
            if !fits {
                self.resolve(r, Outcome::TooLarge);
                return;
            }
            let b = self.rr % self.backends.len().max(1);
            self.rr += 1;
            self.submit(
                b,
                Cmd::Submit {
                    req: r,
                    lease: None,
                    max_tokens: cap.unwrap_or(ctx - prompt),
                    reserve_output: None,
                    prompt,
                    true_len,
                },
            );
            return;
        }
        self.gateway_try(r, false);
    }

    /// Returns true when the request is no longer waiting for budget (forwarded or answered).
    fn gateway_try(&mut self, r: usize, from_queue: bool) -> bool {
        self.gateway_try_as(r, from_queue, false)
    }

    /// `behind`: a queued request behind the front, tried as a backfill (the filter's
    /// `attempt_backfill`).
    fn gateway_try_as(&mut self, r: usize, from_queue: bool, behind: bool) -> bool {
        let now_ms = self.now / 1000;
        let jitter = splitmix64(self.o.seed ^ self.tries.wrapping_mul(0x2545_f491_4f6c_dd1d));
        let (Some(gw), Some(s)) = (self.gw.as_mut(), self.reqs.get(r)) else {
            return true;
        };
        match gw.attempt(s, r, now_ms, jitter, from_queue, behind) {
            Attempt::Forward { cmds } => {
                let lease = cmds.iter().find_map(|(_, c)| match c {
                    Cmd::Submit { req, lease, .. } if *req == r => *lease,
                    _ => None,
                });
                let degraded = cmds.iter().any(|(_, c)| match c {
                    Cmd::Submit {
                        req, max_tokens, ..
                    } if *req == r => s.cap.is_some_and(|c| *max_tokens < c),
                    _ => false,
                });
                if let Some(s) = self.reqs.get_mut(r) {
                    s.lease = lease;
                    s.degraded |= degraded;
                }
                for (b, c) in cmds {
                    self.submit(b, c);
                }
                true
            }
            Attempt::Queued { deadline_ms } => {
                self.push(deadline_ms * 1000, Ev::Drain);
                false
            }
            Attempt::Refused { status, retry_ms } => {
                if from_queue && status == 429 {
                    return false;
                }
                self.refused(r, status, retry_ms);
                true
            }
        }
    }

    /// The filter's `drain_queue`: answer expired entries, then admit from the front.
    fn drain(&mut self) {
        let now_ms = self.now / 1000;
        let (expired, min_ms) = match self.gw.as_mut() {
            Some(gw) => (gw.queue.expire(now_ms), gw.cfg.retry_after.min_ms),
            None => return,
        };
        for e in expired {
            self.refused(e.item, 429, Some(min_ms));
        }
        while let Some(front) = self
            .gw
            .as_ref()
            .and_then(|g| g.queue.front().map(|e| e.item))
        {
            if !self.gateway_try(front, true) {
                break;
            }
            if let Some(gw) = self.gw.as_mut() {
                gw.queue.pop_front();
            }
        }
        // The filter's retries of queued requests behind the front whose claim is active (the
        // ledger sets bytes aside for them), then its backfill tries (at most BACKFILL_TRIES).
        let served: Vec<usize> = match self.gw.as_ref() {
            Some(g) => g
                .queue
                .items()
                .skip(1)
                .copied()
                .filter(|&r| self.reqs.get(r).is_some_and(|s| g.claim_active(s)))
                .collect(),
            None => Vec::new(),
        };
        for r in served {
            if self.gateway_try(r, true) {
                if let Some(gw) = self.gw.as_mut() {
                    gw.queue.remove_where(|i| *i == r);
                }
            }
        }
        let behind: Vec<usize> = match self.gw.as_ref() {
            Some(g) if g.backfill => {
                let mut b: Vec<(u64, usize)> = g
                    .queue
                    .items()
                    .skip(1)
                    .filter(|&&r| self.reqs.get(r).is_some_and(|s| !g.claim_active(s)))
                    .filter_map(|&r| Some((g.run_ms_of(self.reqs.get(r)?), r)))
                    .filter(|(run_ms, _)| *run_ms > 0)
                    .collect();
                b.sort_by_key(|(run_ms, _)| *run_ms);
                b.into_iter().take(8).map(|(_, r)| r).collect()
            }
            _ => Vec::new(),
        };
        for r in behind {
            if self.gateway_try_as(r, true, true) {
                if let Some(gw) = self.gw.as_mut() {
                    gw.queue.remove_where(|i| *i == r);
                }
            }
        }
    }

    fn step(&mut self, b: usize) {
        let now = self.now;
        let o = self.o;
        let p = &o.preset;
        let Some(be) = self.backends.get_mut(b) else {
            return;
        };
        let out = be.step(p);
        let d = ms(out.ms);
        be.used_area += be.used_blocks() as f64 * d as f64;
        let busy = be.busy();
        be.stepping = busy || d > 0;
        if let Some(t) = self.last_step.get_mut(b) {
            *t = now + d;
        }
        for (r, n) in out.now {
            self.push(now, Ev::Deliver(r, n));
        }
        for (r, n) in out.later {
            self.push(now + d, Ev::Deliver(r, n));
        }
        if busy || d > 0 {
            self.push(now + d, Ev::Step(b));
        }
    }

    fn deliver(&mut self, r: usize, note: Note) {
        let now = self.now;
        let (lease, class) = match self.reqs.get_mut(r) {
            Some(s) => {
                if s.outcome.is_some() {
                    return;
                }
                (s.lease, s.req.class)
            }
            None => return,
        };
        let release = |sim: &mut Sim<'_>| {
            if let (Some(gw), Some(l)) = (sim.gw.as_mut(), lease) {
                gw.release(l, now / 1000);
            }
        };
        match note {
            Note::FirstToken => {
                if let Some(s) = self.reqs.get_mut(r) {
                    let first = s.first_try.unwrap_or(now);
                    s.ttft.get_or_insert(now - first);
                }
            }
            Note::Done(tokens, at_cap) => {
                if let Some(s) = self.reqs.get_mut(r) {
                    s.tokens = tokens;
                }
                release(self);
                if let Some(gw) = self.gw.as_mut() {
                    let name = gw.class(class).name;
                    let prompt = self.reqs.get(r).map_or(0, |s| s.req.prompt);
                    gw.learned
                        .entry(name)
                        .or_default()
                        .push_answer(tokens, at_cap, prompt);
                }
                self.resolve(r, Outcome::Ok);
                self.drain();
            }
            Note::KvOom => {
                release(self);
                self.resolve(r, Outcome::KvOom);
                self.drain();
            }
            Note::Preempted => {
                release(self);
                self.resolve(r, Outcome::Preempted);
                self.drain();
            }
            Note::Refused => {
                // The filter's check_upstream: a backend 429 ends the reservation.
                release(self);
                if let Some(s) = self.reqs.get_mut(r) {
                    s.lease = None;
                }
                self.refused(r, 429, Some(1000));
                self.drain();
            }
        }
    }

    fn poll(&mut self) {
        let now_ms = self.now / 1000;
        let o = self.o;
        let p = &o.preset;
        if let Some(gw) = self.gw.as_mut() {
            for (((be, ledger), rate), tracker) in self
                .backends
                .iter_mut()
                .zip(gw.ledgers.iter_mut())
                .zip(gw.tokens_per_s.iter_mut())
                .zip(gw.progress.iter_mut())
            {
                // As the filter's poll: the decode rate and typical outputs from the report,
                // lease ends estimated from them, the rate kept for run estimates.
                let report = be.report(p);
                let progress = tracker
                    .observe(&report, now_ms)
                    .filter(|_| gw.cfg.retry_from_progress);
                *rate = progress
                    .as_ref()
                    .filter(|p| p.warm())
                    .map_or(0.0, |p| p.tokens_per_s);
                let etas = reconcile::own_etas(ledger, &report, progress.as_ref(), now_ms);
                reconcile::reconcile(ledger, &report, now_ms, 30_000, &etas, GATEWAY);
                let cap = ledger.capacity() as f64;
                // Where the pool goes, for the line printed at the end (stderr).
                let pool = be.total_blocks().max(1) as f64;
                for (sum, x) in self.pools.iter_mut().zip([
                    1.0,
                    ledger.committed() as f64 / cap,
                    ledger.held_back() as f64 / cap,
                    ledger.claimed() as f64 / cap,
                    be.used_blocks() as f64 / pool,
                    be.promised_blocks() as f64 / pool,
                ]) {
                    *sum += x;
                }
            }
        }
        self.drain();
        if self.resolved < self.reqs.len() {
            self.push(self.now + self.o.poll_ms * 1000, Ev::Poll);
        }
    }

    fn summarise(&self) -> Row {
        let count = |o: Outcome| self.reqs.iter().filter(|s| s.outcome == Some(o)).count();
        let ok: Vec<&ReqState> = self
            .reqs
            .iter()
            .filter(|s| s.outcome == Some(Outcome::Ok))
            .collect();
        let makespan = self.reqs.iter().map(|s| s.end).max().unwrap_or(0);
        let tokens: u64 = ok.iter().map(|s| s.tokens).sum();
        let lat: Vec<f64> = ok
            .iter()
            .map(|s| secs(s.end - s.first_try.unwrap_or(0)))
            .collect();
        let ttft: Vec<f64> = ok
            .iter()
            .map(|s| secs(s.ttft.unwrap_or(s.end - s.first_try.unwrap_or(0))))
            .collect();
        let capacity = self.backends.iter().map(|b| b.total_blocks()).sum::<u64>() as f64;
        let area: f64 = self.backends.iter().map(|b| b.used_area).sum();
        Row {
            arm: self.arm,
            sent: self.reqs.len(),
            completed: ok.len(),
            kv_oom: count(Outcome::KvOom),
            preempted: count(Outcome::Preempted),
            too_large: count(Outcome::TooLarge),
            gave_up: count(Outcome::GaveUp),
            tokens,
            makespan_s: secs(makespan),
            goodput: if makespan > 0 {
                tokens as f64 / secs(makespan)
            } else {
                0.0
            },
            lat: (pct(&lat, 50.0), pct(&lat, 99.0)),
            ttft: (pct(&ttft, 50.0), pct(&ttft, 99.0)),
            r429: self.reqs.iter().map(|s| s.n429).sum(),
            degraded: self.reqs.iter().filter(|s| s.degraded).count(),
            kv_used: if makespan > 0 && capacity > 0.0 {
                area / (capacity * makespan as f64)
            } else {
                0.0
            },
            recomputed: self.backends.iter().map(|b| b.recomputed_tokens()).sum(),
            preemptions: self.backends.iter().map(|b| b.preemptions()).sum(),
            demotions: self.backends.iter().map(|b| b.demotions()).sum(),
        }
    }
}

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
            "-h" | "--help" => {
                println!("see the header of core/examples/sim.rs");
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
    let mut rows = Vec::new();
    let mut dumped = Vec::new();
    for arm in arms {
        let gw = match arm {
            Arm::Kvgate | Arm::Oracle => Some(Gateway::new(
                filter_config(&filter_path, &p, None, None, quantile, by_prompt, safety)?,
                backends,
                backfill,
            )),
            Arm::Elastic => Some(Gateway::new(
                filter_config(
                    &filter_path,
                    &p,
                    Some(elastic_prior),
                    None,
                    quantile,
                    by_prompt,
                    safety,
                )?,
                backends,
                backfill,
            )),
            Arm::Queued => Some(Gateway::new(
                filter_config(
                    &filter_path,
                    &p,
                    Some(elastic_prior),
                    Some(queue_wait_ms),
                    quantile,
                    by_prompt,
                    safety,
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

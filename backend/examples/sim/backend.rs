//! A simulated backend: the real engine (`kvgate_backend::engine`, driven one step at a time by
//! its `Stepper`) over a stand-in model whose forward passes cost nothing and whose time is the
//! preset's step law. Nothing of the scheduler is transcribed: admission, lazy promises, the
//! time-aware peak, elastic growth and reclaim, preemption and recompute, demotion, prefix
//! caching and the lease report are the backend's own code.
//!
//! The stand-in model answers each request with its true output: a prompt starts with its
//! request's number (`ID_DIGITS` digit tokens, then filler), and the model answers `b` for the
//! request's true length, then EOS (a step of its own, as a real model's end is; a sequence
//! capped at or below its true length ends at its cap without it). It answers from what its
//! cache holds, so a preempted sequence prefilled again goes on where it was.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

use kvgate_backend::engine::{
    Admission, Demoted, EngineConfig, Event, Forward, GenParams, KvState, OnKvExhaustion, Stepper,
    Submit,
};
use kvgate_backend::pool::BlockPool;
use kvgate_backend::tokenizer::Tokenizer;
use kvgate_core::reconcile::BackendReport;
use kvgate_core::tokenize::{CustomBpe, GPT2_STYLE_PATTERN};
use kvgate_core::wire::{LeaseReport, ModelReport};
use kvgate_core::{ErrorKind, TokenCounter, TokenizerSpec};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::{Arm, Cmd, Note, Preset, Res, BLOCK_TOKENS};

const EOS: u32 = 0;
const FILLER: u32 = 1;
const ANSWER: u32 = 2;
const DIGIT0: u32 = 3;
const ID_DIGITS: usize = 6;
const VOCAB: usize = DIGIT0 as usize + 16;
const NEVER: f32 = -1e9;

/// Prompt tokens and the cost of one step's forward passes.
#[derive(Default)]
pub struct Model {
    /// Request number -> its true output length.
    targets: RefCell<HashMap<u32, u64>>,
    prefilled: Cell<u64>,
    decoded: Cell<u64>,
}

pub struct Kv {
    len: usize,
    cap: usize,
    /// The request number, once its digits are in the cache.
    head: Vec<u32>,
    /// Answer tokens in the cache (always its last ones).
    answers: u64,
}

impl KvState for Kv {
    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.cap
    }
}

impl Kv {
    fn feed(&mut self, tokens: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(self.len + tokens.len() <= self.cap, "past capacity");
        for &t in tokens {
            if self.head.len() < ID_DIGITS {
                self.head.push(t);
            }
            if t == ANSWER {
                self.answers += 1;
            }
        }
        self.len += tokens.len();
        Ok(())
    }
}

impl Model {
    fn logits(&self, kv: &Kv) -> Vec<f32> {
        let id = kv.head.iter().fold(0u32, |n, &d| {
            n.wrapping_mul(16)
                .wrapping_add(d.saturating_sub(DIGIT0) & 15)
        });
        let target = self.targets.borrow().get(&id).copied().unwrap_or(1);
        let mut l = vec![NEVER; VOCAB];
        let next = match kv.answers >= target {
            true => EOS,
            false => ANSWER,
        };
        if let Some(x) = l.get_mut(next as usize) {
            *x = 1.0;
        }
        l
    }
}

impl Forward for Model {
    type Kv = Kv;
    fn new_kv(&self, _blocks: &[u32], capacity: usize, cached: &[u32]) -> anyhow::Result<Kv> {
        let mut kv = Kv {
            len: 0,
            cap: capacity,
            head: Vec::new(),
            answers: 0,
        };
        kv.feed(cached)?;
        Ok(kv)
    }
    fn shares_blocks(&self) -> bool {
        true
    }
    fn grow_kv(&self, kv: &mut Kv, _blocks: &[u32], capacity: usize) -> anyhow::Result<()> {
        kv.cap = kv.cap.max(capacity);
        Ok(())
    }
    fn shrink_kv(&self, kv: &mut Kv, _blocks: &[u32], capacity: usize) -> anyhow::Result<()> {
        kv.cap = kv.cap.min(capacity);
        if kv.len > kv.cap {
            kv.answers = kv.answers.saturating_sub((kv.len - kv.cap) as u64);
            kv.len = kv.cap;
            kv.head.truncate(kv.len);
        }
        Ok(())
    }
    fn prefill(&self, tokens: &[u32], kv: &mut Kv) -> anyhow::Result<Vec<f32>> {
        kv.feed(tokens)?;
        self.prefilled
            .set(self.prefilled.get() + tokens.len() as u64);
        Ok(self.logits(kv))
    }
    fn decode(&self, tokens: &[u32], kvs: &mut [&mut Kv]) -> anyhow::Result<Vec<Vec<f32>>> {
        self.decoded.set(self.decoded.get() + kvs.len() as u64);
        kvs.iter_mut()
            .zip(tokens)
            .map(|(kv, &t)| {
                kv.feed(&[t])?;
                Ok(self.logits(kv))
            })
            .collect()
    }
}

/// The stand-in model's vocabulary: EOS, the filler, the answer and 16 digits (control tokens,
/// never text).
fn tokenizer() -> Res<Tokenizer> {
    let mut tokens: Vec<String> = ["<|endoftext|>", "a", "b"].map(String::from).to_vec();
    let mut types = vec![3, 1, 1];
    for d in 0..16 {
        tokens.push(format!("<|d{d}|>"));
        types.push(3);
    }
    let bpe = CustomBpe::from_gpt2_vocab(&tokens, &types, GPT2_STYLE_PATTERN)
        .map_err(|e| e.to_string())?;
    let counter =
        TokenCounter::new(&TokenizerSpec::Custom(bpe.clone())).map_err(|e| e.to_string())?;
    Ok(Tokenizer {
        counter,
        bpe,
        stop_ids: vec![EOS],
        hidden_ids: (0..VOCAB as u32)
            .filter(|&i| types.get(i as usize) == Some(&3))
            .collect(),
        vocab: VOCAB as u64,
    })
}

/// A request's prompt: its number, then filler to `len` tokens (at least `ID_DIGITS`; the
/// workloads' shortest prompt is 11). No two requests share a prompt block, so prefix caching
/// serves only a preempted sequence resuming its own prompt.
fn prompt(req: usize, len: u64) -> Vec<u32> {
    let mut p: Vec<u32> = (0..ID_DIGITS)
        .rev()
        .map(|i| DIGIT0 + ((req >> (4 * i)) & 15) as u32)
        .collect();
    p.resize((len as usize).max(ID_DIGITS), FILLER);
    p
}

pub struct StepOut {
    pub now: Vec<(usize, Note)>,
    pub later: Vec<(usize, Note)>,
    pub ms: f64,
}

pub struct Backend {
    engine: Stepper<Model>,
    /// Requests here: their event streams, whether their first token was seen, their id here.
    streams: Vec<(usize, UnboundedReceiver<Event>, bool)>,
    ids: HashMap<usize, String>,
    pub inbox: Vec<Cmd>,
    pub stepping: bool,
    cursor: u64,
    /// Σ used blocks × step µs.
    pub used_area: f64,
    admission: Admission,
}

impl Backend {
    pub fn new(p: &Preset, arm: Arm, lazy: bool) -> Res<Self> {
        let admission = match arm {
            Arm::Prompt => Admission::Prompt,
            _ if arm.reserve() => Admission::Reserve,
            _ => Admission::None,
        };
        let cfg = EngineConfig {
            admission,
            on_kv_exhaustion: match arm {
                Arm::Vllm => OnKvExhaustion::Recompute,
                _ => OnKvExhaustion::Error,
            },
            max_batch: arm.max_batch(p),
            prefill_token_budget: p.prefill_budget as usize,
            lazy_blocks: lazy,
            prefix_caching: true,
            step_delay: std::time::Duration::ZERO,
        };
        let pool = BlockPool::new(
            p.blocks * p.block_bytes(),
            BLOCK_TOKENS as u32,
            p.bytes_per_token(),
        );
        Ok(Backend {
            engine: Stepper::new(Model::default(), Arc::new(tokenizer()?), pool, cfg),
            streams: Vec::new(),
            ids: HashMap::new(),
            inbox: Vec::new(),
            stepping: false,
            cursor: 0,
            used_area: 0.0,
            admission,
        })
    }

    pub fn busy(&self) -> bool {
        self.engine.busy() || !self.inbox.is_empty()
    }

    pub fn total_blocks(&self) -> u64 {
        u64::from(self.engine.handle().pool.stats().blocks_total)
    }

    pub fn used_blocks(&self) -> u64 {
        let s = self.engine.handle().pool.stats();
        u64::from(s.blocks_total.saturating_sub(s.blocks_free))
    }

    /// Blocks promised to live sequences and not taken yet (`--lazy-blocks`).
    pub fn promised_blocks(&self) -> u64 {
        let h = self.engine.handle();
        let promised = h.published.lock().map_or(0, |p| p.promised_bytes);
        promised / h.pool.block_bytes.max(1)
    }

    pub fn recomputed_tokens(&self) -> u64 {
        self.engine.handle().metrics.recomputed_tokens.get()
    }

    pub fn preemptions(&self) -> u64 {
        self.engine.handle().metrics.recompute_preemptions.get()
    }

    pub fn demotions(&self) -> u64 {
        self.engine.handle().metrics.demoted.get()
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Submit {
                req,
                lease,
                max_tokens,
                reserve_output,
                prompt: len,
                true_len,
            } => {
                let id = lease.map_or_else(|| format!("r{req}"), |l| l.to_string());
                let number = (req & ((1 << (4 * ID_DIGITS)) - 1)) as u32;
                self.engine
                    .model()
                    .targets
                    .borrow_mut()
                    .insert(number, true_len.max(1));
                let (tx, rx) = unbounded_channel();
                self.streams.push((req, rx, false));
                self.ids.insert(req, id.clone());
                self.engine.submit(Submit {
                    lease: Some(id),
                    class: None,
                    reserve_output,
                    gateway_prompt_tokens: len,
                    prompt: prompt(req, len),
                    params: GenParams {
                        max_tokens,
                        temperature: 0.0,
                        top_p: 1.0,
                        seed: 0,
                        stop: Vec::new(),
                    },
                    events: tx,
                });
            }
            Cmd::Cancel { req } => {
                if let Some(id) = self.ids.get(&req) {
                    self.engine.cancel(id);
                }
            }
            Cmd::Demote { req } => {
                if let Some(id) = self.ids.get(&req) {
                    let _: Demoted = self.engine.demote(id.clone());
                }
            }
        }
    }

    /// What the requests here heard since the last call.
    fn events(&mut self) -> Vec<(usize, Note)> {
        let mut notes = Vec::new();
        let ids = &mut self.ids;
        self.streams.retain_mut(|(req, rx, first)| {
            while let Ok(ev) = rx.try_recv() {
                let note = match ev {
                    Event::Admitted { .. } => continue,
                    Event::Text(_) if *first => continue,
                    Event::Text(_) => {
                        *first = true;
                        Note::FirstToken
                    }
                    Event::Rejected(_) => Note::Refused,
                    Event::Finished {
                        reason,
                        completion_tokens,
                        error,
                        ..
                    } => match error {
                        None => Note::Done(
                            completion_tokens,
                            reason == kvgate_core::wire::FinishReason::Length,
                        ),
                        Some(e) if e.kind == ErrorKind::KvCacheExhausted => Note::KvOom,
                        Some(e) if e.kind == ErrorKind::Preempted => Note::Preempted,
                        Some(e) => {
                            // The stand-in model's own errors are engine bookkeeping bugs: loud,
                            // and counted as failed requests.
                            eprintln!("sim: request {req} failed: {}", e.message);
                            Note::KvOom
                        }
                    },
                };
                let end = !matches!(note, Note::FirstToken);
                notes.push((*req, note));
                if end {
                    ids.remove(req);
                    return false;
                }
            }
            true
        });
        notes
    }

    /// Commands since the last step (their answers now), then one engine step (what it
    /// decided reaches clients when the step ends, `ms` later).
    pub fn step(&mut self, p: &Preset) -> StepOut {
        for cmd in std::mem::take(&mut self.inbox) {
            self.command(cmd);
        }
        let now = self.events();
        if !self.engine.busy() {
            return StepOut {
                now,
                later: Vec::new(),
                ms: 0.0,
            };
        }
        let model = self.engine.model();
        model.prefilled.set(0);
        model.decoded.set(0);
        self.engine.step();
        let model = self.engine.model();
        let ms = p.step_a_ms
            + p.step_b_ms * model.decoded.get() as f64
            + p.prefill_ms * model.prefilled.get() as f64;
        StepOut {
            now,
            later: self.events(),
            ms,
        }
    }

    /// The lease report, as the admission API serves it and the filter reads it.
    pub fn report(&mut self, p: &Preset) -> BackendReport {
        let (pool, leases, finished, cursor) = self.engine.handle().lease_report(self.cursor);
        self.cursor = cursor;
        BackendReport::from(&LeaseReport {
            pool,
            admission: self.admission.as_str().into(),
            gateway_note: true,
            model: Some(ModelReport {
                spec: Some(p.model_spec()),
                kv_bytes_per_token: Some(p.bytes_per_token()),
                scratch_margin_bytes: Some(p.block_bytes()),
                prefix_caching: true,
                ..ModelReport::default()
            }),
            leases,
            finished,
            cursor,
            other_gateways: Vec::new(),
            served_at: None,
        })
    }
}

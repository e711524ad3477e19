//! The engine: one OS thread that owns the model, the KV pool's sequences, and the waiting and
//! running queues (continuous batching).
//!
//! Handlers talk to it through a cloneable `EngineHandle` (a channel). Each loop iteration:
//! take commands; drop sequences whose client went away (their KV blocks return to the pool at
//! once); prefill within a token budget (`--prefill-token-budget`: a long prompt goes in chunks
//! over several steps); then run ONE batched decode forward for every running sequence whose
//! prefill is done. Forward passes never touch the async executor.
//!
//! Admission (`--admission`): `reserve` takes blocks for prompt + cap when a request arrives
//! and answers 429 if they are not free, so a sequence can never run out mid-decode; `prompt`
//! takes the prompt's blocks at arrival (429 if they are not free) and the rest as the output
//! grows — a server that admits on prompt length alone, kept for comparison; `none` takes
//! every block as a sequence grows. Under both, a sequence that finds no block fails mid-decode
//! (a KV OOM) unless `--on-kv-exhaustion recompute`.
//!
//! When a running sequence needs a block and none is free (`--on-kv-exhaustion`): `error` ends
//! it there (the KV OOM above); `recompute` does what vLLM does instead. Running sequences grow
//! oldest first; the one that finds the pool dry preempts the youngest *other* running sequence,
//! which gives back all its blocks and goes to the front of the waiting queue keeping its
//! generated tokens, sampler and text stream. Its next prefill runs over prompt + generated, so
//! the logits it yields are those the skipped decode step would have given: the next token is
//! sampled from them and streaming resumes there, nothing re-sent and nothing skipped. A
//! sequence alone that still cannot grow, or a waiting one that cannot fit with nothing
//! running to free blocks, ends in the KV OOM (no preemption loop). With `--admission reserve`
//! no sequence ever needs a block mid-decode, so the flag changes nothing there.
//!
//! Elastic sequences (the gateway's body note, `kvgate.reserve_output`, or from an older gateway
//! `x-kvgate-reserve-output`, below the cap; `--admission reserve`): the reservation covers prompt + that many output tokens, and the sequence grows
//! past it from free blocks — blocks nobody reserved. Those blocks are borrowed: when a
//! reservation needs them (a new request the gateway admitted, a sequence needing its next
//! block), the youngest sequence grown past its reservation gives back what it borrowed and is
//! recomputed later, whatever `--on-kv-exhaustion` says. A sequence within its reservation is
//! never preempted for it, so a worst-case request still never fails mid-decode, and an elastic
//! one is at worst delayed. A preempted elastic sequence keeps its reservation while it waits,
//! and the KV cache its reservation's blocks hold: when it runs again only the positions past
//! them are prefilled (one at the end of its reservation with no block free only pauses). With
//! lazy blocks the youngest waiting elastic sequence's blocks and cache are given back, one
//! sequence at a time, when a running sequence needs a block and none is free (its
//! reservation stays a promise; it is then recomputed whole); a paused one's too. Sequences
//! holding their reservations are prefilled before it.
//!
//! Lazy blocks (`--lazy-blocks`, with `--admission reserve`): a reservation is a promise of
//! blocks, not blocks taken. A request is admitted while what the live sequences can hold
//! together at any step to come, and its whole reservation, fit the pool (the time-aware worst
//! case, `unpromised_blocks`: sequences decoding within their reservations end at their caps;
//! the gateway's ledger prices them the same way from the lease report), and a sequence takes
//! its blocks as it grows into them. Until then those blocks are free, and an
//! elastic sequence grown past its own reservation may borrow them; when the sequence they were
//! promised to needs one, the youngest borrower gives back what it borrowed and is recomputed
//! later (that peak fits the pool, so what is missing is always borrowed). While it waits, a
//! running sequence that needs a block takes the blocks its reservation holds before any
//! running borrower is preempted (`drop_an_idle_cache`); its reservation stays a promise. So an
//! admission never preempts a borrower, and a borrower is preempted only when a reservation
//! really needs its blocks. The lease
//! report counts each sequence at what it holds or was promised, whichever is more (`pool.
//! promised_bytes`: the promised blocks not taken yet, counted in `used_bytes`).
//!
//! Prefix caching (the paged arena, `--kv-layout paged`, the default): a prompt takes the cached blocks it
//! starts with and skips their prefill; one whose next prefix block an older live sequence will
//! write waits for it; under lazy blocks a prefix block several reservations hold is promised
//! once (`engine/promise.rs`; the cache itself is `pool`'s).
//!
//! This file schedules and nothing else: the handle and its messages are in `handle.rs`, what
//! the engine publishes for the lease report in `published.rs` (the report itself is
//! `kvgate_core::wire`), what the reservations promise in `engine/promise.rs`, how room is made
//! in `engine/reclaim.rs`, stop-string hold-back in `tokenizer::TextStream`, metrics in
//! `metrics.rs`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvgate_core::peak::{peak, Growth};
use kvgate_core::wire::{LeaseEntry, LeaseState};
use kvgate_core::{ApiError, ErrorKind};
use tokio::sync::mpsc::UnboundedSender;

pub use crate::forward::{Forward, KvState};
use crate::handle::Command;
pub use crate::handle::{Demoted, EngineHandle, Event, GenParams, Submit};
use crate::metrics::Metrics;
use crate::pool::{Allocation, BlockPool};
use crate::published::Published;
use crate::sampling::Sampler;
use crate::tokenizer::{TextStream, Tokenizer};
pub use kvgate_core::wire::FinishReason;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Admission {
    Reserve,
    /// Admission on prompt length alone: what a server without kvgate does (for comparison).
    Prompt,
    None,
}

impl Admission {
    /// As the lease report and the command line spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Admission::Reserve => "reserve",
            Admission::Prompt => "prompt",
            Admission::None => "none",
        }
    }
}

/// What a running sequence that needs a KV block does when none is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnKvExhaustion {
    /// End it with an error (`kv_cache_exhausted`, the mid-decode KV OOM).
    #[default]
    Error,
    /// Preempt the youngest other running sequence and recompute it later (vLLM's way).
    Recompute,
}

pub struct EngineConfig {
    pub admission: Admission,
    pub on_kv_exhaustion: OnKvExhaustion,
    pub max_batch: usize,
    pub prefill_token_budget: usize,
    /// A reservation is a promise of blocks, taken as the sequence grows (`--admission reserve`
    /// only; see the module header).
    pub lazy_blocks: bool,
    /// Keep written prompt blocks for the prompts that start with them (a paged model only;
    /// see `pool`).
    pub prefix_caching: bool,
    /// Test-only: sleep this long in every scheduler step (a slow backend on demand).
    pub step_delay: Duration,
}

/// Whether a running sequence has a KV slot for the token it feeds next.
enum Room {
    Ready,
    /// No block free in the pool.
    NoBlock,
    /// Blocks were there but the model's cache did not grow to them.
    Failed,
}

pub fn spawn<M: Forward + Send + 'static>(
    model: M,
    tok: Arc<Tokenizer>,
    pool: BlockPool,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
) -> EngineHandle {
    let (engine, handle, rx) = Engine::with_handle(model, tok, pool, cfg, metrics);
    let spawned = std::thread::Builder::new()
        .name("kvgate-engine".into())
        .spawn(move || engine.run(rx));
    if let Err(e) = spawned {
        eprintln!("kvgate-backend: cannot start the engine thread: {e}");
        std::process::exit(1);
    }
    handle
}

struct Engine<M: Forward> {
    model: M,
    tok: Arc<Tokenizer>,
    pool: BlockPool,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    published: Arc<Mutex<Published>>,
    waiting: VecDeque<Seq<M::Kv>>,
    running: Vec<Seq<M::Kv>>,
    next_internal_id: u64,
    arrivals: u64,
    /// Leases demoted before they arrived (newest last, at most `DEMOTED_KEPT`).
    demoted_early: VecDeque<String>,
}

/// Demotions of leases not arrived yet that are remembered (a lease the gateway demoted as its
/// request was on its way here arrives within moments; an older one never will).
const DEMOTED_KEPT: usize = 1024;

impl<M: Forward> Engine<M> {
    /// An engine, the handle that reads what it publishes, and the channel the handle's
    /// commands come down.
    fn with_handle(
        model: M,
        tok: Arc<Tokenizer>,
        pool: BlockPool,
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
    ) -> (Self, EngineHandle, Receiver<Command>) {
        let (tx, rx) = mpsc::channel();
        let published = Arc::new(Mutex::new(Published::default()));
        let handle = EngineHandle::new(
            tx,
            Arc::clone(&published),
            pool.clone(),
            Arc::clone(&metrics),
        );
        (
            Engine::new(model, tok, pool, cfg, metrics, published),
            handle,
            rx,
        )
    }

    fn new(
        model: M,
        tok: Arc<Tokenizer>,
        pool: BlockPool,
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
        published: Arc<Mutex<Published>>,
    ) -> Self {
        Engine {
            model,
            tok,
            pool,
            cfg,
            metrics,
            published,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_internal_id: 0,
            arrivals: 0,
            demoted_early: VecDeque::new(),
        }
    }

    fn run(mut self, rx: Receiver<Command>) {
        loop {
            let idle = self.waiting.is_empty() && self.running.is_empty();
            // Idle: block for work (with a timeout so published state stays fresh).
            let first = if idle {
                match rx.recv_timeout(Duration::from_millis(500)) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            } else {
                None
            };
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                self.command(cmd);
            }
            self.step();
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(s) => self.admit(*s),
            Command::Cancel(id, reply) => {
                let found = self.preempt(&id);
                let _ = reply.send(found);
            }
            Command::Demote(id, reply) => {
                let done = self.demote(id);
                let _ = reply.send(done);
            }
        }
    }

    /// One scheduler iteration after commands: free abandoned sequences, prefill within the
    /// budget, one batched decode step.
    fn step(&mut self) {
        self.drop_abandoned();
        let busy = !self.waiting.is_empty() || !self.running.is_empty();
        if busy && !self.cfg.step_delay.is_zero() {
            std::thread::sleep(self.cfg.step_delay);
        }
        self.prefill_step();
        self.publish();
        self.decode_step();
        self.publish();
    }

    fn admit(&mut self, s: Submit) {
        // A client gone since the last step still holds its blocks until the next one frees
        // them; the gateway gave its reservation back the moment the stream closed, and may
        // have admitted this request into it. Free them first, so this one is neither refused
        // (429) nor paid for by taking back what a borrower holds.
        self.drop_abandoned();
        let id = s.lease.clone().unwrap_or_else(|| {
            self.next_internal_id += 1;
            format!("internal-{}", self.next_internal_id)
        });
        let prompt_len = s.prompt.len() as u64;
        let output = match s.reserve_output {
            Some(r) if self.cfg.admission == Admission::Reserve => r.min(s.params.max_tokens),
            _ => s.params.max_tokens,
        };
        // Demoted by the gateway while on its way: it reserves nothing (see `demote`).
        let demoted = match s.lease.as_ref() {
            Some(l) => match self.demoted_early.iter().position(|d| d == l) {
                Some(i) => self.demoted_early.remove(i).is_some(),
                None => false,
            },
            None => false,
        };
        let elastic = output < s.params.max_tokens || demoted;
        let reserve_tokens = match self.cfg.admission {
            Admission::Reserve if demoted => 0,
            Admission::Reserve => prompt_len + output,
            Admission::Prompt => prompt_len,
            Admission::None => 0,
        };
        let blocks = self.pool.blocks_for(reserve_tokens);
        let prefix = match self.cfg.prefix_caching && self.model.shares_blocks() {
            true => self.pool.prefix_hashes(
                &s.prompt,
                s.prompt.len().saturating_sub(1) / self.pool.block_tokens.max(1) as usize,
            ),
            false => Vec::new(),
        };
        // The cached blocks its prompt starts with are its own from now on (no longer free to
        // be taken), as far as its reservation reaches.
        let mut alloc = self.pool.allocate(0);
        let adopted = alloc.as_mut().map_or(0, |a| {
            a.adopt(
                prefix
                    .get(..(blocks as usize).min(prefix.len()))
                    .unwrap_or_default(),
            )
        });
        let alloc = if self.lazy() {
            // A promise: admitted while the peak of what the live sequences can hold together,
            // and its whole reservation, fit the pool (its prefix blocks promised once among
            // the sequences that share them); no block is taken (and no borrower preempted)
            // until the sequence grows into them.
            let counted = prefix.get(..(blocks as usize).min(prefix.len()));
            let held = self.promised_blocks(Some((counted.unwrap_or_default(), blocks)));
            alloc.filter(|_| held <= self.pool.stats().blocks_total)
        } else {
            // Blocks lent to elastic sequences come back first: the gateway admitted this one.
            // Only when that makes room: a borrower preempted for a reservation refused anyway
            // would be recomputed for nothing (and again at every retry of the same request).
            let need = blocks.saturating_sub(adopted as u32);
            let free = self.pool.stats().blocks_free;
            if free < need && free.saturating_add(self.borrowed_blocks()) >= need {
                self.reclaim_borrowed(need);
            }
            alloc.and_then(|mut a| a.grow(need).then_some(a))
        };
        let Some(alloc) = alloc else {
            self.metrics.rejected_kv.inc();
            let need = u64::from(blocks) * self.pool.block_bytes;
            let free = match self.lazy() {
                true => u64::from(self.unpromised_blocks()) * self.pool.block_bytes,
                false => self.pool.stats().free_bytes,
            };
            let priced = match self.cfg.admission {
                Admission::Prompt => format!("its prompt of {prompt_len} tokens"),
                _ => format!(
                    "prompt {prompt_len} + max_tokens {} tokens",
                    s.params.max_tokens
                ),
            };
            let err = ApiError::new(
                ErrorKind::KvCapacityExceeded,
                format!(
                    "The backend's KV cache cannot hold this request now: it needs {need} bytes \
                     ({priced}) and {free} bytes are free."
                ),
            )
            .with_extra("need_bytes", need)
            .with_extra("free_bytes", free)
            .with_retry_after_ms(1000);
            // The engine took the request, so it reports the outcome: the HTTP layer records
            // nothing for a request it submitted (its handler may be gone by now).
            if let Some(lease) = &s.lease {
                self.published().record_finished(
                    lease,
                    FinishReason::Refused,
                    0,
                    0,
                    s.class.clone(),
                    s.gateway_prompt_tokens,
                );
            }
            let _ = s.events.send(Event::Rejected(err));
            return;
        };
        self.metrics.requests.inc();
        self.arrivals += 1;
        let admitted = Event::Admitted { id: id.clone() };
        self.waiting.push_back(Seq {
            id,
            class: s.class,
            gateway_prompt_tokens: s.gateway_prompt_tokens,
            promised: reserve_tokens,
            promised_blocks: blocks,
            elastic,
            sampler: Sampler::new(s.params.temperature, s.params.top_p, s.params.seed),
            text: TextStream::new(&s.params.stop),
            prompt: s.prompt,
            generated: Vec::new(),
            params: s.params,
            kv: None,
            alloc,
            events: s.events,
            arrived: Instant::now(),
            order: self.arrivals,
            last_token: None,
            prefilling: false,
            prompt_fed: 0,
            prefix,
        });
        // The lease report reads the promises (and the allocator, as far as it had taken
        // blocks) from what was published: a promise published only after the step that takes
        // its first blocks would be missing from a report read in between (the ledger's whole
        // reservation as drift).
        self.publish();
        // Only now may the client see its 200: a lease report read after it shows the promise.
        if let Some(seq) = self.waiting.back() {
            let _ = seq.events.send(admitted);
        }
    }

    /// `--lazy-blocks` under `--admission reserve`.
    fn lazy(&self) -> bool {
        self.cfg.lazy_blocks && self.cfg.admission == Admission::Reserve
    }

    fn drop_abandoned(&mut self) {
        let gone = |s: &Seq<M::Kv>| s.events.is_closed();
        let mut abandoned: Vec<Seq<M::Kv>> = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running.get(i).is_some_and(gone) {
                abandoned.push(self.running.swap_remove(i));
            } else {
                i += 1;
            }
        }
        type Queue<K> = VecDeque<Seq<K>>;
        let (gone_waiting, keep): (Queue<M::Kv>, Queue<M::Kv>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(gone);
        self.waiting = keep;
        abandoned.extend(gone_waiting);
        for s in abandoned {
            self.metrics.cancelled.inc();
            self.finish(s, FinishReason::Cancelled, None);
        }
    }

    /// Prefill within the step's token budget: sequences part-way through their prefill go on
    /// first (oldest first), then waiting ones start. What does not fit in the budget is fed in
    /// chunks over the next steps, between decode steps, so a long prompt delays the running
    /// decoders by at most `prefill_token_budget` tokens of prefill per step, never by its
    /// whole prefill, and its attention scratch is that of one chunk.
    fn prefill_step(&mut self) {
        let mut budget = self.cfg.prefill_token_budget;
        let (mut partial, decoding): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| s.prefilling);
        self.running = decoding;
        partial.sort_by_key(|s| s.order);
        for seq in partial {
            if budget == 0 {
                self.running.push(seq);
            } else {
                budget -= self.feed(seq, budget);
            }
        }
        // Elastic sequences waiting for blocks beyond their reservation, passed over.
        let mut passed = 0;
        let lazy = self.lazy();
        while budget > 0 && self.running.len() < self.cfg.max_batch {
            if self.waits_for_its_prefix(passed) {
                self.give_back_unreserved(passed);
                passed += 1;
                continue;
            }
            let Some(front) = self.waiting.get_mut(passed) else {
                break;
            };
            let len = front.prefill_len();
            // Room for what it prefills (in reserve mode it holds prompt + cap already, unless
            // its blocks are lazy).
            let mut room = front.alloc.ensure_tokens(len as u64);
            let blocks = self.pool.blocks_for(len as u64);
            if !room && lazy && blocks <= front.promised_blocks {
                // Lazy blocks: what its reservation promised and the pool lacks is borrowed;
                // the youngest borrowers give it back now. Not first the blocks a waiting
                // sequence holds idle, as `decode_step` does: tried (085a974), it recomputed
                // 1.22x the tokens with 1.25x the preemptions over 6 live rounds (docs/design/
                // 005-idle-caches-on-the-prefill-path.md). A borrower preempted here keeps its
                // reservation's cache; an idle cache dropped is recomputed whole.
                let (order, missing) = (front.order, blocks.saturating_sub(front.alloc.blocks()));
                self.reclaim_borrowed(missing);
                // A running borrower preempted goes first in line: find this one again.
                passed = self
                    .waiting
                    .iter()
                    .position(|s| s.order == order)
                    .unwrap_or(passed);
                room = self
                    .waiting
                    .get_mut(passed)
                    .is_some_and(|f| f.alloc.ensure_tokens(len as u64));
            }
            let others_can_free = !self.running.is_empty() || self.waiting.len() > passed + 1;
            let Some(front) = self.waiting.get_mut(passed) else {
                break;
            };
            if !room && front.elastic {
                if others_can_free {
                    // Sequences holding their reservations go first; blocks come back as
                    // they end. What it took of its cached prefix beyond its reservation (a
                    // demoted one's) it does not hold meanwhile.
                    self.give_back_unreserved(passed);
                    passed += 1;
                    continue;
                }
                // Nothing else can free blocks: every sequence left waits for more than is
                // free (the ones passed over too). The oldest of them takes what the younger
                // waiting elastic sequences hold (they are recomputed from scratch later; they
                // were only delayed). Not the one in front: an older one passed over may hold
                // what it needs, and neither would ever run.
                let oldest = (0..=passed)
                    .filter_map(|i| self.waiting.get(i).map(|s| (s.order, i)))
                    .min()
                    .map_or(passed, |(_, i)| i);
                let order = self.waiting.get(oldest).map_or(0, |s| s.order);
                for s in self
                    .waiting
                    .iter_mut()
                    .filter(|s| s.elastic && s.order > order)
                {
                    s.drop_cache();
                }
                passed = oldest;
                room = self.waiting.get_mut(passed).is_some_and(|f| {
                    let len = f.prefill_len();
                    f.alloc.ensure_tokens(len as u64)
                });
            }
            if !room
                && self.cfg.on_kv_exhaustion == OnKvExhaustion::Recompute
                && !self.running.is_empty()
            {
                // The running sequences will give blocks back: wait first in line.
                self.give_back_unreserved(passed);
                break;
            }
            let Some(mut seq) = self.waiting.remove(passed) else {
                break;
            };
            // Its first start (not a restart after a preemption, mid-prefill or later).
            if seq.prompt_fed == 0 && seq.generated.is_empty() {
                let queued = seq.arrived.elapsed().as_secs_f64();
                self.metrics.queue_seconds.inc_by(queued);
                self.metrics.queue_wait.observe(queued);
            }
            if !room {
                self.kv_oom(seq);
                continue;
            }
            // A sequence that gave back borrowed blocks, or paused at the end of its
            // reservation, kept what its own blocks hold: it grows from there and is fed only
            // the rest.
            let tokens = seq.alloc.tokens() as usize;
            let kv = match seq.kv.take() {
                Some(mut kv) => self
                    .model
                    .grow_kv(&mut kv, seq.alloc.ids(), tokens)
                    .map(|()| kv),
                None => {
                    // Its first blocks hold a cached prefix: fed from after them.
                    let b = self.pool.block_tokens as usize;
                    let cached = seq
                        .prompt
                        .get(..seq.cached_blocks() * b)
                        .unwrap_or_default();
                    self.metrics
                        .prefix_cached_tokens
                        .inc_by(cached.len() as u64);
                    seq.prompt_fed = seq.prompt_fed.max(cached.len());
                    self.model.new_kv(seq.alloc.ids(), tokens, cached)
                }
            };
            match kv {
                Ok(kv) => {
                    seq.kv = Some(kv);
                    seq.prefilling = true;
                    budget -= self.feed(seq, budget);
                }
                Err(e) => self.internal_failure(seq, &e),
            }
        }
    }

    /// Feed a prefilling sequence its next chunk, at most `budget` tokens; returns how many it
    /// took. After the last chunk it samples its next token and joins the decode batch (or ends).
    fn feed(&mut self, mut seq: Seq<M::Kv>, budget: usize) -> usize {
        let total = seq.prefill_len();
        let done = seq.kv.as_ref().map_or(0, |kv| kv.len());
        let n = total.saturating_sub(done).min(budget);
        let chunk = seq.prefill_chunk(done, n);
        let started = Instant::now();
        let result = match seq.kv.as_mut() {
            Some(kv) => self.model.prefill(&chunk, kv),
            None => Err(anyhow::anyhow!("a prefilling sequence without a KV cache")),
        };
        self.metrics
            .prefill_seconds
            .inc_by(started.elapsed().as_secs_f64());
        let logits = match result {
            Ok(logits) => logits,
            Err(e) => {
                self.internal_failure(seq, &e);
                return n;
            }
        };
        // Its prompt blocks written now are cached for the prompts that start with them.
        let written = seq.kv.as_ref().map_or(0, |kv| kv.len()) / self.pool.block_tokens as usize;
        for (i, h) in seq.prefix.iter().enumerate().take(written) {
            seq.alloc.register(i, *h);
        }
        // Prompt positions fed for the first time count as prompt; the rest was recomputed,
        // except the token sampled last before a preemption, which was never fed.
        let fresh = (done + n)
            .min(seq.prompt.len())
            .saturating_sub(seq.prompt_fed.max(done));
        let never_fed = usize::from(done + n == total && !seq.generated.is_empty());
        seq.prompt_fed = seq.prompt_fed.max((done + n).min(seq.prompt.len()));
        self.metrics.prompt_tokens.inc_by(fresh as u64);
        self.metrics
            .recomputed_tokens
            .inc_by(n.saturating_sub(fresh + never_fed) as u64);
        if done + n < total {
            self.running.push(seq);
            return n;
        }
        seq.prefilling = false;
        let next = seq.sampler.sample(&logits);
        let now = Instant::now();
        match seq.last_token.replace(now) {
            // After a preemption: the stall its client saw between two tokens.
            Some(last) => self
                .metrics
                .inter_token_latency
                .observe(now.duration_since(last).as_secs_f64()),
            None => self
                .metrics
                .time_to_first_token
                .observe(seq.arrived.elapsed().as_secs_f64()),
        }
        if let Some((reason, error)) = self.accept_token(&mut seq, next) {
            self.finish(seq, reason, error);
        } else {
            self.running.push(seq);
        }
        n
    }

    fn decode_step(&mut self) {
        if self.running.is_empty() {
            return;
        }
        // Every running sequence needs a KV slot for the token it feeds now; the oldest take
        // theirs first.
        self.running.sort_by_key(|s| s.order);
        let mut i = 0;
        while i < self.running.len() {
            if self.running.get(i).is_some_and(|s| s.prefilling) {
                // It holds the blocks for its whole prefill already.
                i += 1;
                continue;
            }
            match self.make_room(i) {
                Room::Ready => i += 1,
                Room::NoBlock if self.drop_an_idle_cache() => {
                    // Blocks a waiting sequence held idle came back: try again.
                }
                Room::NoBlock if self.youngest_overgrown().is_some() => {
                    // Borrowed blocks go back first: the youngest sequence grown past its
                    // reservation (perhaps this one) is recomputed later. With lazy blocks a
                    // sequence within its reservation always finds some here: the peak of what
                    // the reservations can hold fits the pool, so what it lacks is borrowed, and only running sequences
                    // borrow (a waiting one gave back what it borrowed when it was preempted).
                    let victim = self.youngest_overgrown().unwrap_or(i);
                    let seq = self.running.remove(victim);
                    if victim < i {
                        i -= 1;
                    }
                    self.requeue_for_recompute(seq);
                }
                Room::NoBlock if self.running.get(i).is_some_and(|s| s.elastic) => {
                    // At the end of its reservation with no block free and none borrowed to
                    // take back (every block is someone's reservation): it waits, keeping its
                    // reservation, until blocks free up. Delayed, never failed, and it takes
                    // nobody's reservation.
                    let seq = self.running.remove(i);
                    self.requeue_for_recompute(seq);
                }
                Room::NoBlock
                    if self.cfg.on_kv_exhaustion == OnKvExhaustion::Recompute
                        && self.running.len() > 1 =>
                {
                    // The youngest running sequence other than this one makes way, then this
                    // one tries again (more may have to go if the victim held few blocks).
                    let last = self.running.len() - 1;
                    let victim = if i == last { last - 1 } else { last };
                    let seq = self.running.remove(victim);
                    if victim < i {
                        i -= 1;
                    }
                    self.requeue_for_recompute(seq);
                }
                Room::NoBlock | Room::Failed => {
                    let seq = self.running.remove(i);
                    self.kv_oom(seq);
                }
            }
        }
        let (mut decoding, prefilling): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| !s.prefilling);
        self.running = prefilling;
        if decoding.is_empty() {
            return;
        }
        let tokens: Vec<u32> = decoding
            .iter()
            .map(|s| s.generated.last().copied().unwrap_or(0))
            .collect();
        let started = Instant::now();
        let result = {
            let mut kvs: Vec<&mut M::Kv> =
                decoding.iter_mut().filter_map(|s| s.kv.as_mut()).collect();
            self.model.decode(&tokens, &mut kvs)
        };
        self.metrics
            .decode_seconds
            .inc_by(started.elapsed().as_secs_f64());
        self.metrics.decode_steps.inc();
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                for seq in decoding {
                    self.internal_failure(seq, &e);
                }
                return;
            }
        };
        let now = Instant::now();
        for (mut seq, row) in decoding.into_iter().zip(logits) {
            let next = seq.sampler.sample(&row);
            if let Some(last) = seq.last_token.replace(now) {
                self.metrics
                    .inter_token_latency
                    .observe(now.duration_since(last).as_secs_f64());
            }
            match self.accept_token(&mut seq, next) {
                Some((reason, error)) => self.finish(seq, reason, error),
                None => self.running.push(seq),
            }
        }
    }

    /// Record a sampled token, stream its text, and decide whether the sequence is done.
    fn accept_token(
        &mut self,
        seq: &mut Seq<M::Kv>,
        token: u32,
    ) -> Option<(FinishReason, Option<ApiError>)> {
        if self.tok.stop_ids.contains(&token) {
            let rest = seq.text.rest();
            send_text(seq, rest);
            return Some((FinishReason::Stop, None));
        }
        seq.generated.push(token);
        self.metrics.generated_tokens.inc();
        // A control token (`<|im_start|>`, `<|start_header_id|>`) counts as generated but is no
        // text: never streamed, never part of a stop string (OpenAI, vLLM's default).
        let text = match self.tok.hidden_ids.contains(&token) {
            true => None,
            false => self.tok.counter.decode_bytes(&[token]),
        };
        let stopped = match text {
            Some(bytes) => seq.text.push(&bytes),
            None => false,
        };
        if stopped {
            let ready = seq.text.ready();
            send_text(seq, ready);
            return Some((FinishReason::Stop, None));
        }
        if seq.generated.len() as u64 >= seq.params.max_tokens {
            let rest = seq.text.rest();
            send_text(seq, rest);
            return Some((FinishReason::Length, None));
        }
        let ready = seq.text.ready();
        send_text(seq, ready);
        None
    }

    fn kv_oom(&mut self, seq: Seq<M::Kv>) {
        self.metrics.kv_oom.inc();
        let used = seq.used_tokens();
        let err = ApiError::new(
            ErrorKind::KvCacheExhausted,
            format!(
                "The backend ran out of KV cache mid-decode after {used} tokens ({} generated) and \
                 stopped this generation. An admission gateway (kvgate) prevents this by reserving \
                 the worst case up front.",
                seq.generated.len()
            ),
        );
        self.finish(seq, FinishReason::Error, Some(err));
    }

    fn internal_failure(&mut self, seq: Seq<M::Kv>, e: &anyhow::Error) {
        eprintln!("kvgate-backend: sequence {} failed: {e:#}", seq.id);
        let err = ApiError::new(
            ErrorKind::Internal,
            format!("The model failed on this request: {e}"),
        );
        self.finish(seq, FinishReason::Error, Some(err));
    }

    /// End a sequence: report it, record it for the filter, and free its KV (drop).
    fn finish(&mut self, seq: Seq<M::Kv>, reason: FinishReason, error: Option<ApiError>) {
        // Text was flushed by `accept_token` on a normal end; an abnormal end emits no more.
        let prompt_tokens = seq.prompt.len() as u64;
        let completion_tokens = seq.generated.len() as u64;
        let Seq {
            id,
            class,
            gateway_prompt_tokens,
            events,
            alloc,
            kv,
            ..
        } = seq;
        drop(kv);
        drop(alloc);
        // The blocks go back to the pool (the Allocation drops with the rest of `seq`) and the
        // end is in the report *before* the client can see its last byte.
        self.published().record_finished(
            &id,
            reason,
            prompt_tokens,
            completion_tokens,
            class,
            gateway_prompt_tokens,
        );
        let _ = events.send(Event::Finished {
            reason,
            prompt_tokens,
            completion_tokens,
            error,
        });
    }

    /// What the lease report reads, locked (a panic elsewhere while it was held leaves it as
    /// it was: kept, not poisoned for good).
    fn published(&self) -> std::sync::MutexGuard<'_, Published> {
        self.published.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self) {
        let per_token = self.pool.block_bytes / u64::from(self.pool.block_tokens.max(1));
        let block_tokens = u64::from(self.pool.block_tokens.max(1));
        let lazy = self.lazy();
        // A sequence's prefix blocks held once: under lazy blocks those its reservation
        // promises (the wait keeps them written once); otherwise those it holds that are cached.
        let prefix_of = |s: &Seq<M::Kv>| -> usize {
            match lazy {
                true => s.counted_prefix().len(),
                false => s.alloc.cached_prefix_blocks().min(s.counted_prefix().len()),
            }
        };
        let live = || self.running.iter().chain(self.waiting.iter());
        let mut holders: HashMap<u64, u32> = HashMap::new();
        for s in live() {
            for h in s.prefix.iter().take(prefix_of(s)) {
                *holders.entry(*h).or_default() += 1;
            }
        }
        let view = |s: &Seq<M::Kv>, state: LeaseState, queued: bool| {
            // An elastic sequence preempted to be recomputed counts what it needs to resume
            // (its reservation plus what it borrowed): the gateway holds that back from new
            // admissions until it runs again, rather than admitting into the blocks it needs.
            // A demoted one (nothing reserved) counts its need from its first token on too: it
            // has no reservation to start from, and without that need held back at the
            // gateway new admissions could keep taking the room it waits for.
            let resume = if s.elastic && queued && (!s.generated.is_empty() || s.promised == 0) {
                (s.prefill_len() as u64 + 1).div_ceil(block_tokens) * block_tokens
            } else {
                0
            };
            // Lazy blocks: what it holds or was promised, whichever is more (the ledger's view).
            let held = match lazy {
                true => s
                    .alloc
                    .tokens()
                    .max(u64::from(s.promised_blocks) * block_tokens),
                false => s.alloc.tokens(),
            };
            let reserved_tokens = held.max(resume);
            let resuming = resume > held;
            LeaseEntry {
                id: s.id.clone(),
                state,
                prompt_tokens: s.prompt.len() as u64,
                max_tokens: s.params.max_tokens,
                reserved_tokens,
                reserved_bytes: reserved_tokens * per_token,
                used_tokens: s.used_tokens(),
                used_bytes: s.used_tokens() * per_token,
                elastic_output_tokens: s
                    .elastic
                    .then(|| s.promised.saturating_sub(s.prompt.len() as u64)),
                resuming,
                // Of those, the ones another live sequence holds too: the gateway may have
                // admitted it without them.
                prefix_tokens: s
                    .prefix
                    .iter()
                    .take(prefix_of(s))
                    .take_while(|h| holders.get(*h).is_some_and(|n| *n > 1))
                    .count() as u64
                    * block_tokens,
            }
        };
        let leases: Vec<LeaseEntry> = self
            .waiting
            .iter()
            .map(|s| view(s, LeaseState::Waiting, true))
            // Part-way through its prefill it holds KV but is not decoding yet: the gateway
            // reads decode progress from running entries only.
            .chain(self.running.iter().map(|s| {
                let state = if s.prefilling {
                    LeaseState::Waiting
                } else {
                    LeaseState::Running
                };
                view(s, state, false)
            }))
            .collect();
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
        let written: u64 = leases.iter().map(|l| l.used_bytes).sum();
        self.metrics
            .kv_written_bytes
            .set(i64::try_from(written).unwrap_or(i64::MAX));
        // Promised and not taken: a prefix block promised to several is counted once, on the
        // first holder (a sharer waiting for it takes nothing, and is promised nothing more).
        let untaken = match lazy {
            true => {
                let mut counted: HashSet<u64> = HashSet::new();
                live()
                    .map(|s| {
                        let elsewhere = s
                            .counted_prefix()
                            .iter()
                            .filter(|h| !counted.insert(**h))
                            .count() as u32;
                        let held = s.alloc.blocks().max(elsewhere);
                        u64::from(s.promised_blocks.saturating_sub(held))
                    })
                    .sum::<u64>()
            }
            false => 0,
        };
        let mut p = self.published();
        p.leases = leases;
        p.promised_bytes = untaken * self.pool.block_bytes;
        p.allocated_bytes = self.pool.stats().used_bytes;
    }
}

fn send_text<K>(seq: &Seq<K>, chunk: Option<String>) {
    if let Some(chunk) = chunk {
        let _ = seq.events.send(Event::Text(chunk));
    }
}

mod promise;
mod reclaim;
mod seq;
mod stepper;

use seq::Seq;
pub use stepper::Stepper;

#[cfg(test)]
mod tests;

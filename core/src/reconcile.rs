//! Reconciliation of the ledger with the backend's own account of its leases.
//!
//! The backend (`GET /v1/admission/leases`) reports its KV pool, the leases it holds (arrived at
//! its HTTP layer, waiting or running), and the leases that finished since a cursor. One pure
//! transition applies a report. The report informs; it never deletes a live request's lease:
//! - a lease the backend says finished is released early (idempotent with the release at the
//!   end of the stream);
//! - a lease the backend does not know, past a grace period, is *unseen*: drift, reported and
//!   alerted on, never removed (its request may still be on its way, or the backend may be
//!   wrong; only the end of the request or the loss of its owner ends a lease);
//! - bytes the backend uses beyond what the ledger has committed (negative drift: requests that
//!   bypassed this gateway, block rounding, a release the backend has not caught up with) are
//!   held back from admission until the next report says otherwise; what an own lease held
//!   past its reservation is given back when that lease is released (`Ledger::release`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::ledger::{Lease, Ledger};
use crate::peak::{peak, Growth};
use crate::wire::LeaseReport;

/// What one poll of the backend said.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BackendReport {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    /// Ids the backend holds now (arrived, waiting or running).
    pub live: Vec<u64>,
    /// Ids that finished since the cursor we sent.
    pub finished: Vec<u64>,
    pub cursor: u64,
    pub fingerprint: Option<String>,
    /// The served model's KV shape (its spec) and name, when reported.
    pub spec: Option<crate::spec::ModelSpec>,
    pub model: Option<String>,
    /// Every live entry at the backend.
    pub entries: Vec<LiveEntry>,
    /// Output lengths of the requests that finished by themselves (stop or length) since the
    /// cursor.
    pub finished_outputs: Vec<Output>,
    /// The same outputs with the class the gateway named for them (those that had one).
    pub class_outputs: Vec<(String, Output)>,
    /// The backend's admission mode (`reserve`, `prompt`, `none`; empty from an older backend).
    pub admission: String,
    /// It reads the gateway's body note (false from an older backend).
    pub gateway_note: bool,
    /// The margin its block rounding needs on every reservation (`None` from an older backend).
    pub scratch_margin_bytes: Option<u64>,
    /// The numbers of the other gateways that poll it (empty from an older backend, or one
    /// that no other gateway polls).
    pub other_gateways: Vec<u64>,
    /// The address the poll reached there (`None` from an older backend).
    pub served_at: Option<String>,
    /// The server reports its pool, not its leases (vLLM's metrics: `vllm.rs`): no lease
    /// it does not list is unseen.
    pub pool_only: bool,
}

/// One request the backend holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LiveEntry {
    /// Its id when it is a gateway's lease id.
    pub id: Option<u64>,
    /// What it holds or has reserved there, whichever is more.
    pub bytes: u64,
    /// Decoding (else waiting or just arrived).
    pub running: bool,
    /// Preempted and waiting to resume: `bytes` is what it needs, not what it holds.
    pub resuming: bool,
    /// Reserved elastically: what it holds past its reservation is borrowed, and the backend
    /// takes it back (preempting it) when a reservation needs the blocks.
    pub elastic: bool,
    pub prompt_tokens: u64,
    /// Its output cap at the backend.
    pub max_tokens: u64,
    /// Tokens in its KV cache: prompt + output so far.
    pub used_tokens: u64,
    /// Of `bytes`, its prompt's first blocks that the backend holds once for every live lease
    /// starting with them (a cached prefix): a lease admitted without its shared prefix
    /// (`Lease::credit`) holds that much of it elsewhere.
    pub prefix_bytes: u64,
}

/// How long one finished output ran, and whether its cap cut it short: an output that ran to
/// its cap says only that it would have run at least that long (a censored length). With the
/// length of the prompt it answered (0 when not known).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Output {
    pub tokens: u64,
    pub at_cap: bool,
    pub prompt_tokens: u64,
}

impl Output {
    /// (tokens, ended at its cap): what [`kaplan_meier`] reads.
    pub fn sample(&self) -> (u64, bool) {
        (self.tokens, self.at_cap)
    }

    /// An output that stopped by itself.
    #[cfg(test)]
    pub fn stopped(tokens: u64) -> Self {
        Output {
            tokens,
            ..Output::default()
        }
    }

    /// An output that its cap ended.
    #[cfg(test)]
    pub fn capped(tokens: u64) -> Self {
        Output {
            tokens,
            at_cap: true,
            ..Output::default()
        }
    }

    /// The same output, for a prompt of `prompt_tokens`.
    #[cfg(test)]
    pub fn after(self, prompt_tokens: u64) -> Self {
        Output {
            prompt_tokens,
            ..self
        }
    }

    /// Did it answer a prompt of about the length of one of `prompt_tokens` (within 5 %, at
    /// least one token either way)? Never when either length is not known (0).
    fn answered_like(&self, prompt_tokens: u64) -> bool {
        prompts_alike(self.prompt_tokens, prompt_tokens)
    }
}

/// Are prompts of `a` and `b` tokens about the same length (within 5 % of `b`, at least one
/// token either way)? Never when either is not known (0). Prompts of about the same length
/// are, often enough, the same task or template: their outputs are the better guide to how
/// long an answer runs (Retry-After's expected ends, an elastic class's allowance).
pub fn prompts_alike(a: u64, b: u64) -> bool {
    a > 0 && b > 0 && a.abs_diff(b) <= (b / 20).max(1)
}

impl LiveEntry {
    pub fn generated(&self) -> u64 {
        self.used_tokens.saturating_sub(self.prompt_tokens)
    }
}

/// How fast the backend's sequences progress and how long outputs turn out: what turns a
/// lease's progress into its expected end.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Output tokens per second of one decoding sequence.
    pub tokens_per_s: f64,
    /// Recently finished outputs, ascending (at equal lengths, one that stopped by itself
    /// before one its cap ended).
    pub outputs: Vec<Output>,
}

/// How long a request reserving `output_tokens` per sequence is expected to decode, at the
/// slowest of the backends' rates (output tokens a second of one sequence); 0 (unknown) until
/// every one has a rate. Saturates for an absurd cap (a float `as` never panics).
pub fn run_ms(tokens_per_s: impl IntoIterator<Item = f64>, output_tokens: u64) -> u64 {
    let slowest = tokens_per_s.into_iter().fold(f64::INFINITY, f64::min);
    if !(slowest > 0.0 && slowest.is_finite()) {
        return 0;
    }
    ((output_tokens as f64 * 1000.0 / slowest).ceil() as u64).max(1)
}

/// Learns [`Progress`] from successive reports of one backend: the decode rate from how far its
/// running sequences moved between two reports, the typical output from what finished.
#[derive(Debug, Clone, Default)]
pub struct ProgressTracker {
    /// Output so far of each running lease at the last report, and when.
    last: std::collections::HashMap<u64, u64>,
    last_ms: u64,
    tokens_per_s: f64,
    /// The latest finished outputs, oldest first.
    outputs: std::collections::VecDeque<Output>,
}

/// Finished outputs kept for the estimate of the lengths a lease may reach.
const OUTPUTS_KEPT: usize = 128;
/// Finished requests needed before a typical length is trusted.
const OUTPUTS_NEEDED: usize = 5;

impl ProgressTracker {
    /// Take one report; the progress model it supports now, if any.
    pub fn observe(&mut self, r: &BackendReport, now_ms: u64) -> Option<Progress> {
        for o in &r.finished_outputs {
            if self.outputs.len() == OUTPUTS_KEPT {
                self.outputs.pop_front();
            }
            self.outputs.push_back(*o);
        }
        let dt = now_ms.saturating_sub(self.last_ms);
        if self.last_ms > 0 && dt >= 100 {
            let mut rates: Vec<f64> = r
                .entries
                .iter()
                .filter(|e| e.running)
                .filter_map(|e| {
                    let before = *self.last.get(&e.id?)?;
                    let moved = e.generated().checked_sub(before).filter(|m| *m > 0)?;
                    Some(moved as f64 * 1000.0 / dt as f64)
                })
                .collect();
            rates.sort_by(f64::total_cmp);
            if let Some(m) = rates.get(rates.len() / 2) {
                self.tokens_per_s = if self.tokens_per_s > 0.0 {
                    0.7 * self.tokens_per_s + 0.3 * m
                } else {
                    *m
                };
            }
        }
        self.last = r
            .entries
            .iter()
            .filter(|e| e.running)
            .filter_map(|e| Some((e.id?, e.generated())))
            .collect();
        self.last_ms = now_ms;
        // The rate alone is enough to start: until OUTPUTS_NEEDED outputs have finished, what
        // they say weighs only their share (see `Progress::lengths_after`).
        if self.tokens_per_s <= 0.0 {
            return None;
        }
        let mut outputs: Vec<Output> = self.outputs.iter().copied().collect();
        outputs.sort_unstable();
        Some(Progress {
            tokens_per_s: self.tokens_per_s,
            outputs,
        })
    }
}

impl Progress {
    /// Have enough outputs finished ([`OUTPUTS_NEEDED`]) for run estimates? Backfills wait for
    /// it; Retry-After does not (see [`Progress::lengths_after`]).
    pub fn warm(&self) -> bool {
        self.outputs.len() >= OUTPUTS_NEEDED
    }

    /// When `e` is expected to end: at the median of the lengths it may still reach (see
    /// [`Progress::lengths_after`]), never past its cap; at the midpoint of what its cap still
    /// allows when no finished output that counts was longer than what it has produced. A
    /// request not yet decoding is expected to start now (optimistic: Retry-After must not
    /// overshoot).
    pub fn eta_ms(&self, e: &LiveEntry, now_ms: u64) -> Option<u64> {
        if !(self.tokens_per_s.is_finite() && self.tokens_per_s > 0.0) {
            return None;
        }
        let remaining = self.remaining_ms(e, &self.lengths_after(e), 0.5);
        Some(now_ms.saturating_add(remaining))
    }

    /// The lengths a lease `e` may still reach: the Kaplan–Meier estimate over the finished
    /// outputs longer than what it has produced (see [`kaplan_meier`]). Outputs are bimodal —
    /// short answers and long runs — and one that is past the short ones is a long one. The
    /// outputs that answered a prompt of about the length of `e`'s (within 5 %: the same
    /// template or task, usually) say the most: once [`OUTPUTS_NEEDED`] of them are longer than
    /// what `e` has produced only they count; before that, their estimate weighs one
    /// [`OUTPUTS_NEEDED`]th for each of them, and the estimate over all outputs the rest.
    /// `None` when no output that counts was longer.
    ///
    /// Cold (fewer than [`OUTPUTS_NEEDED`] finished outputs seen: a new backend's first
    /// requests; a restarted gateway relearns those its backend still reports): the `n` seen
    /// weigh `n / (n + 1)`, and the rest of the chance, as much as one more output, is spread
    /// evenly from what the lease has produced up to its cap ([`Law::uniform`]), as when
    /// nothing is known. Not the mean lifetime of the few leases that ended: one short answer
    /// would make every long run look about to end. Not a fifth per output either: one run to
    /// its cap, repeated, would then be expected well before its cap.
    fn lengths_after(&self, e: &LiveEntry) -> Option<Law> {
        let learned = self.learned_after(e)?;
        let seen = self.outputs.len();
        if seen >= OUTPUTS_NEEDED {
            return Some(learned);
        }
        let w = seen as f64 / (seen as f64 + 1.0);
        let done = e.generated();
        let cap = e.max_tokens.max(done.saturating_add(1));
        Some(mix(&learned, w, &Law::uniform(done, cap), 1.0 - w))
    }

    /// [`Progress::lengths_after`] from the finished outputs alone.
    fn learned_after(&self, e: &LiveEntry) -> Option<Law> {
        let done = e.generated();
        let like = |o: &&Output| o.answered_like(e.prompt_tokens);
        let longer = |o: &&Output| o.tokens > done;
        let pooled = || kaplan_meier(self.outputs.iter().filter(longer).map(Output::sample));
        let similar = self.outputs.iter().filter(longer).filter(like).count();
        if similar == 0 {
            return pooled();
        }
        let own = kaplan_meier(
            self.outputs
                .iter()
                .filter(longer)
                .filter(like)
                .map(Output::sample),
        )?;
        if similar >= OUTPUTS_NEEDED {
            return Some(own);
        }
        let w = similar as f64 / OUTPUTS_NEEDED as f64;
        Some(mix(&own, w, &pooled()?, 1.0 - w))
    }

    /// How long `e` still runs when its length is the one at cumulative chance `u` in `[0, 1)`
    /// of `law`. Past its last length: between the longest output that ran to its cap and
    /// `e`'s own cap, uniformly (such outputs say only that it may run at least that long).
    /// Without a law: uniformly up to its cap.
    fn remaining_ms(&self, e: &LiveEntry, law: &Option<Law>, u: f64) -> u64 {
        let done = e.generated();
        let cap = e.max_tokens.max(done.saturating_add(1));
        let between = |from: u64, frac: f64| {
            let from = from.clamp(done, cap);
            let span = cap.saturating_sub(from) as f64;
            from.saturating_add((frac.clamp(0.0, 1.0) * span).ceil() as u64)
                .max(done.saturating_add(1))
        };
        let total = match law {
            None => between(done, u),
            Some(law) => match law
                .steps
                .get(law.steps.partition_point(|(_, cum)| *cum <= u))
            {
                Some((t, _)) => *t,
                None => {
                    let last = law.steps.last().map_or(0.0, |(_, cum)| *cum);
                    let left = 1.0 - last;
                    let frac = if left > 0.0 { (u - last) / left } else { 0.0 };
                    between(law.tail_from, frac)
                }
            },
        }
        .min(cap);
        (total.saturating_sub(done) as f64 / self.tokens_per_s * 1000.0) as u64
    }

    /// Expected ends of several live leases taken together, in `entries`' order (`None` without
    /// a decode rate). One expected end per lease overshoots when several may each end early —
    /// three just-started answers, each a short one or a long run: the first of them to end is
    /// usually a short one — so the ends are sampled jointly: in each of [`JOINT_SAMPLES`]
    /// draws every lease's total length is drawn from the lengths it may still reach
    /// ([`Progress::lengths_after`]; uniformly up to its cap when no finished output was
    /// longer), and the k-th earliest lease is expected to end at the median, over the draws,
    /// of the k-th earliest end. Leases are ranked by their own [`Progress::eta_ms`].
    /// Deterministic (a fixed-seed generator over the lease ids), so a CAS retry computes the
    /// same.
    pub fn joint_etas(&self, entries: &[&LiveEntry], now_ms: u64) -> Option<Vec<u64>> {
        if !(self.tokens_per_s.is_finite() && self.tokens_per_s > 0.0) {
            return None;
        }
        let n = entries.len();
        let laws: Vec<Option<Law>> = entries.iter().map(|e| self.lengths_after(e)).collect();
        let mut seed = entries.iter().fold(0x6b76_6761_7465_u64, |h, e| {
            crate::retry::splitmix64(h ^ e.id.unwrap_or(0))
        });
        let mut kth: Vec<Vec<u64>> = vec![Vec::with_capacity(JOINT_SAMPLES); n];
        let mut ends = Vec::with_capacity(n);
        for _ in 0..JOINT_SAMPLES {
            ends.clear();
            for (e, law) in entries.iter().zip(&laws) {
                seed = crate::retry::splitmix64(seed);
                // u in [0, 1) from the top 53 bits.
                let u = (seed >> 11) as f64 / (1u64 << 53) as f64;
                ends.push(self.remaining_ms(e, law, u));
            }
            ends.sort_unstable();
            for (k, t) in ends.iter().enumerate() {
                if let Some(v) = kth.get_mut(k) {
                    v.push(*t);
                }
            }
        }
        let medians: Vec<u64> = kth
            .iter_mut()
            .map(|v| {
                v.sort_unstable();
                v.get(v.len() / 2).copied().unwrap_or(0)
            })
            .collect();
        let solo: Vec<u64> = entries
            .iter()
            .zip(&laws)
            .map(|(e, law)| self.remaining_ms(e, law, 0.5))
            .collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (solo.get(i).copied().unwrap_or(u64::MAX), i));
        let mut out = vec![now_ms; n];
        for (rank, i) in order.into_iter().enumerate() {
            if let (Some(slot), Some(m)) = (out.get_mut(i), medians.get(rank)) {
                *slot = now_ms.saturating_add(*m);
            }
        }
        Some(out)
    }
}

/// The lengths a lease may still reach ([`Progress::lengths_after`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Law {
    /// Each length outputs stopped at by themselves, with the chance of ending there or before.
    steps: Vec<(u64, f64)>,
    /// What is left above the last step's chance is outputs that ran to their caps, the longest
    /// of them this long (0 when none did).
    tail_from: u64,
}

/// The Kaplan–Meier estimate over `at_risk` (ascending). An output its cap ended is not a
/// length: it stays among those that could still end up to its own length and then drops out,
/// so outputs that ran to their caps leave a chance that the lease runs past all the lengths
/// (what is left above the last step's chance). `None` when `at_risk` is empty. Items are
/// (tokens, ended at its cap) ([`Output::sample`]); at equal lengths a stop comes first.
pub(crate) fn kaplan_meier(at_risk: impl Iterator<Item = (u64, bool)> + Clone) -> Option<Law> {
    let mut n = at_risk.clone().count() as f64;
    if n == 0.0 {
        return None;
    }
    let mut survive = 1.0_f64;
    let mut law = Law::default();
    for (tokens, at_cap) in at_risk {
        if at_cap {
            law.tail_from = law.tail_from.max(tokens);
        } else {
            survive *= (n - 1.0) / n;
            law.steps.push((tokens, 1.0 - survive));
        }
        n -= 1.0;
    }
    Some(certain_at_the_end(law))
}

/// Steps of [`Law::uniform`].
const UNIFORM_STEPS: u64 = 64;

impl Law {
    /// Every length in `(done, cap]` as likely as another, in at most [`UNIFORM_STEPS`] equal
    /// steps (each at its upper end): what is known of a lease when nothing is, as explicit
    /// steps so that [`mix`] weighs it point by point.
    fn uniform(done: u64, cap: u64) -> Law {
        let span = cap.saturating_sub(done).max(1);
        let n = span.min(UNIFORM_STEPS);
        certain_at_the_end(Law {
            steps: (1..=n)
                .map(|i| {
                    // At most `span`: no overflow, even for an absurd cap.
                    let up = (u128::from(i) * u128::from(span)).div_ceil(u128::from(n));
                    let at = done.saturating_add(u64::try_from(up).unwrap_or(span));
                    (at, i as f64 / n as f64)
                })
                .collect(),
            tail_from: 0,
        })
    }

    /// The shortest length that outputs end at or before with at least chance `share`; when
    /// the steps never reach it (the rest ran to their caps), the longest output seen, a lower
    /// bound. The tolerance keeps exact shares (9 of 10 for 0.9) exact in floating point.
    pub(crate) fn quantile(&self, share: f64) -> u64 {
        self.steps
            .iter()
            .find(|(_, cum)| *cum >= share - 1e-9)
            .map_or_else(
                || self.steps.last().map_or(0, |s| s.0).max(self.tail_from),
                |s| s.0,
            )
    }
}

/// `a` with weight `wa` and `b` with weight `wb` (summing to 1), as one law.
fn mix(a: &Law, wa: f64, b: &Law, wb: f64) -> Law {
    let at = |law: &Law, t: u64| {
        law.steps
            .get(..law.steps.partition_point(|(l, _)| *l <= t))
            .and_then(|upto| upto.last())
            .map_or(0.0, |(_, cum)| *cum)
    };
    let mut lengths: Vec<u64> = a.steps.iter().chain(&b.steps).map(|(t, _)| *t).collect();
    lengths.sort_unstable();
    lengths.dedup();
    certain_at_the_end(Law {
        steps: lengths
            .into_iter()
            .map(|t| (t, wa * at(a, t) + wb * at(b, t)))
            .collect(),
        tail_from: a.tail_from.max(b.tail_from),
    })
}

/// A law whose last chance is all but 1 ends there for certain (no rounding left over as a
/// chance of running past it).
fn certain_at_the_end(mut law: Law) -> Law {
    if let Some(last) = law.steps.last_mut().filter(|l| l.1 > 1.0 - 1e-9) {
        last.1 = 1.0;
    }
    law
}

/// Draws of every lease's remaining length behind [`Progress::joint_etas`].
pub const JOINT_SAMPLES: usize = 63;

impl BackendReport {
    /// What a finished request says of output lengths: one that stopped by itself or at its
    /// cap; nothing from one cut short (an error, a cancel: how long it would have run is
    /// unknown).
    fn learned_output(f: &crate::wire::FinishedEntry) -> Option<Output> {
        use crate::wire::FinishReason;
        matches!(f.reason, FinishReason::Stop | FinishReason::Length).then(|| Output {
            tokens: f.completion_tokens,
            at_cap: f.reason == FinishReason::Length,
            prompt_tokens: f.prompt_tokens,
        })
    }

    /// Does this backend serve the model priced with `spec` (named `model`)? The KV shape and
    /// the name must agree; the context may differ (each backend advertises what its own pool
    /// holds). Without a reported spec, the fingerprints must agree.
    pub fn serves(
        &self,
        spec: &crate::spec::ModelSpec,
        model: Option<&str>,
        fingerprint: Option<&str>,
    ) -> bool {
        let same_name = match (self.model.as_deref(), model) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        match &self.spec {
            Some(s) => {
                same_name
                    && (s.layers, s.kv_heads, s.head_dim, s.kv_dtype_bytes)
                        == (
                            spec.layers,
                            spec.kv_heads,
                            spec.head_dim,
                            spec.kv_dtype_bytes,
                        )
            }
            None => {
                same_name
                    && (self.fingerprint.is_none()
                        || fingerprint.is_none()
                        || self.fingerprint.as_deref() == fingerprint)
            }
        }
    }

    /// Parse the backend's report (`wire::LeaseReport`).
    pub fn parse(body: &[u8]) -> Result<BackendReport, String> {
        LeaseReport::parse(body).map(|r| BackendReport::from(&r))
    }
}

/// The filter's own lease ids. Ids that are not (not a u64) are ignored: they are requests that
/// reached the backend without passing through this gateway.
fn own_ids<'a>(ids: impl Iterator<Item = &'a str>) -> Vec<u64> {
    ids.filter_map(|s| s.parse().ok()).collect()
}

impl From<&LeaseReport> for BackendReport {
    fn from(r: &LeaseReport) -> Self {
        BackendReport {
            capacity_bytes: r.pool.capacity_bytes,
            used_bytes: r.pool.used_bytes,
            live: own_ids(r.leases.iter().map(|l| l.id.as_str())),
            finished: own_ids(r.finished.iter().map(|f| f.id.as_str())),
            cursor: r.cursor,
            fingerprint: r.model.as_ref().and_then(|m| m.fingerprint.clone()),
            spec: r.model.as_ref().and_then(|m| m.spec),
            model: r.model.as_ref().and_then(|m| m.name.clone()),
            scratch_margin_bytes: r.model.as_ref().and_then(|m| m.scratch_margin_bytes),
            entries: r
                .leases
                .iter()
                .map(|l| LiveEntry {
                    id: l.id.parse().ok(),
                    bytes: l.reserved_bytes.max(l.used_bytes),
                    running: l.state == crate::wire::LeaseState::Running,
                    resuming: l.resuming,
                    elastic: l.elastic_output_tokens.is_some(),
                    prompt_tokens: l.prompt_tokens,
                    max_tokens: l.max_tokens,
                    used_tokens: l.used_tokens,
                    prefix_bytes: l
                        .reserved_bytes
                        .checked_div(l.reserved_tokens)
                        .unwrap_or(0)
                        .saturating_mul(l.prefix_tokens),
                })
                .collect(),
            finished_outputs: r.finished.iter().filter_map(Self::learned_output).collect(),
            admission: r.admission.clone(),
            gateway_note: r.gateway_note,
            other_gateways: r.other_gateways.clone(),
            served_at: r.served_at.clone(),
            pool_only: false,
            class_outputs: r
                .finished
                .iter()
                .filter(|f| !f.class.is_empty())
                .filter_map(|f| {
                    // Keyed by the prompt as the gateway counted it: that is what it prices.
                    let out = Self::learned_output(f)?;
                    Some((
                        f.class.clone(),
                        Output {
                            prompt_tokens: f.gateway_prompt_tokens,
                            ..out
                        },
                    ))
                })
                .collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reconciled {
    /// Released because the backend reported them finished.
    pub released: Vec<Lease>,
    /// Kept, but unknown to the backend past the grace period: drift to alert on.
    pub unseen: Vec<Lease>,
    /// Bytes now held back from admission: the backend's use beyond the ledger's committed
    /// bytes, or what foreign leases hold there, whichever is more.
    pub held_back: u64,
    /// Live at the backend but not in this ledger: another gateway's requests (or ones that
    /// bypassed the gateways), and their bytes.
    pub foreign_leases: usize,
    pub foreign_bytes: u64,
    /// Of the foreign bytes, those of leases another gateway's number is in: that gateway's
    /// reservations, which its own ledger counts. Not drift between this ledger and the
    /// backend (a request that bypassed the gateways, or one of this gateway's own released
    /// leases the backend still holds, is).
    pub peer_bytes: u64,
    /// Gateways other than this one at the backend: those that poll it (as it reports them),
    /// and those with live leases there that do not (from the gateway number in their lease
    /// ids: an older gateway). The room free now is shared with them until the next poll.
    pub other_gateways: u64,
    /// What this ledger's own leases hold at the backend beyond what they reserved here:
    /// elastic sequences grown past their reservation (and block rounding). Expected, so not
    /// drift; held back from admission like any use the ledger does not count.
    pub grown_bytes: u64,
    /// Of what is held back, what elastic sequences hold past their reservations (decoding,
    /// or part-way through a prefill): the backend gives it back to a reservation on demand,
    /// so a class that preempts may be admitted into it (`Ledger::admit_into_lent`). Plus, of
    /// the room held for a preempted sequence to resume, what the requests that were in line
    /// before it was admitted need beyond the spare.
    pub lendable: u64,
    /// Of `lendable`, what requests in line may take: that resume room, not the growth.
    pub lendable_to_line: u64,
    /// Of the reservations of this ledger's leases decoding there, what they will never all
    /// hold at once ([`Ledger::set_slack`]).
    pub slack: u64,
}

/// A lease decoding at the backend as the time-aware worst case reads it ([`crate::peak`]):
/// from its progress at the report, growing a token a step until it ends at its cap there.
/// `None` for one that may stop decoding before it ends (waiting, elastic, resuming), or when
/// the report does not say how the backend rounds its blocks (an older backend).
fn growth(e: &LiveEntry, report: &BackendReport) -> Option<Growth> {
    if !e.running || e.elastic || e.resuming {
        return None;
    }
    let per_token = report.spec.as_ref()?.kv_bytes_per_token()?;
    let margin = report.scratch_margin_bytes?;
    let cap = e.prompt_tokens.saturating_add(e.max_tokens);
    let at = |tokens: u64| tokens.saturating_mul(per_token).saturating_add(margin);
    // The token it feeds next is not in its cache yet: one more, and a step more to its end.
    Some(Growth {
        now: at(e.used_tokens.saturating_add(1).min(cap)),
        per_step: per_token,
        most: at(cap),
        steps_left: cap.saturating_sub(e.used_tokens),
    })
}

/// A prefix several own leases share (one pays it, the others were admitted without it) is
/// held once while any of them lives: in the time-aware worst case it is counted on the holder
/// that may hold it longest, as the backend counts its promise. If one of them is not decoding
/// (counted whole, for ever), none of the decoding ones carries it and the payer's reserved
/// bytes count it outside the decoding ones (the return value, to take off them); else the
/// decoding holder furthest from its end carries it and the others' growth leaves it out.
fn shared_prefixes_once(
    ledger: &Ledger,
    decoding: &mut [Growth],
    decoding_ids: &[(usize, u64)],
) -> u64 {
    // Per prefix shared at all, its bytes (a credited lease's credit).
    let shared: HashMap<u64, u64> = ledger
        .leases()
        .iter()
        .filter(|l| l.credit > 0)
        .map(|l| (l.prefix, l.credit))
        .collect();
    if shared.is_empty() {
        return 0;
    }
    let lease = |id: u64| ledger.lease(id);
    let decoding_set: HashSet<u64> = decoding_ids.iter().map(|(_, id)| *id).collect();
    let mut outside = 0u64;
    for (&key, &bytes) in &shared {
        let holders: Vec<(usize, bool)> = decoding_ids
            .iter()
            .filter_map(|&(i, id)| {
                let l = lease(id)?;
                (l.prefix == key).then_some((i, l.credit == 0))
            })
            .collect();
        let whole_elsewhere = ledger
            .leases()
            .iter()
            .any(|l| l.prefix == key && !decoding_set.contains(&l.id));
        let carrier = match whole_elsewhere {
            true => None,
            false => holders
                .iter()
                .max_by_key(|(i, _)| decoding.get(*i).map_or(0, |g| g.steps_left))
                .map(|(i, _)| *i),
        };
        for &(i, pays) in &holders {
            if Some(i) == carrier {
                continue;
            }
            if let Some(g) = decoding.get_mut(i) {
                g.now = g.now.saturating_sub(bytes);
                g.most = g.most.saturating_sub(bytes);
            }
            // Counted whole outside the decoding ones: the payer's bytes hold it there.
            if pays && whole_elsewhere {
                outside = outside.saturating_add(bytes);
            }
        }
    }
    outside
}

impl Reconciled {
    pub fn unseen_bytes(&self) -> u64 {
        self.unseen
            .iter()
            .map(|l| l.bytes)
            .fold(0, u64::saturating_add)
    }
}

/// Expected ends (ms) of this ledger's leases that `report` shows, by lease id, from the
/// decode progress: the joint Monte Carlo behind [`Progress::joint_etas`]. Computed once,
/// before the compare-and-swap that applies the report (a CAS retry does not redo it), from
/// the ledger as last read: a lease admitted since gets its end at the next poll.
pub fn own_etas(
    ledger: &Ledger,
    report: &BackendReport,
    progress: Option<&Progress>,
    now_ms: u64,
) -> BTreeMap<u64, u64> {
    let Some(p) = progress else {
        return BTreeMap::new();
    };
    let reserved: HashSet<u64> = ledger.leases().iter().map(|l| l.id).collect();
    let own: Vec<&LiveEntry> = report
        .entries
        .iter()
        .filter(|e| e.id.is_some_and(|id| reserved.contains(&id)))
        .collect();
    p.joint_etas(&own, now_ms)
        .map(|etas| {
            own.iter()
                .zip(etas)
                .filter_map(|(e, eta)| Some((e.id?, eta)))
                .collect()
        })
        .unwrap_or_default()
}

/// Apply a backend report to the ledger, with the expected ends `etas` ([`own_etas`]). Pure and
/// cheap: safe to re-run on a CAS retry. Never removes a lease the backend did not report
/// finished.
pub fn reconcile(
    ledger: &mut Ledger,
    report: &BackendReport,
    now_ms: u64,
    grace_ms: u64,
    etas: &BTreeMap<u64, u64>,
    own_gateway: u64,
) -> Reconciled {
    let mut out = Reconciled::default();
    for id in &report.finished {
        if let crate::ledger::ReleaseOutcome::Released(l) = ledger.release(*id, now_ms) {
            out.released.push(l);
        }
    }
    let live: HashSet<u64> = report.live.iter().copied().collect();
    out.unseen = ledger
        .leases()
        .iter()
        .filter(|_| !report.pool_only)
        .filter(|l| !live.contains(&l.id) && l.created_ms.saturating_add(grace_ms) <= now_ms)
        .cloned()
        .collect();
    // One pass over the report: this ledger's own leases (with what each reserved here), and
    // the rest, foreign.
    let reserved: HashMap<u64, (u64, u64, u64)> = ledger
        .leases()
        .iter()
        .map(|l| (l.id, (l.bytes, l.created_ms, l.credit)))
        .collect();
    let mut gateways = BTreeSet::new();
    // What own leases hold or need beyond their reservations: what they hold (running, or
    // part-way through a prefill), all of it; of those waiting to resume, the largest need.
    let (mut needed, mut resume) = (0u64, 0u64);
    // When the first of those waiting to resume was admitted.
    let mut resume_since = u64::MAX;
    // Per own lease, what it holds beyond its reservation (held back; it frees with the lease).
    // Not a preempted one's need to resume: only the largest of those is held back.
    let mut held: HashMap<u64, u64> = HashMap::new();
    let peer_has_own_number = report.other_gateways.contains(&own_gateway);
    // Own leases decoding within their reservations, as the time-aware worst case reads them,
    // and what they reserve here.
    let mut decoding: Vec<Growth> = Vec::new();
    let mut decoding_reserved = 0u64;
    // Of those, the ones sharing a prefix: (index in `decoding`, lease id).
    let mut decoding_ids: Vec<(usize, u64)> = Vec::new();
    for e in &report.entries {
        match e.id.and_then(|id| reserved.get(&id).map(|b| (id, b))) {
            Some((id, &(bytes, created_ms, credit))) => {
                if let Some(g) = growth(e, report).filter(|_| bytes > 0) {
                    decoding_ids.push((decoding.len(), id));
                    decoding.push(g);
                    decoding_reserved = decoding_reserved.saturating_add(bytes);
                }
                // Admitted without its shared prefix: what the backend says it holds of it
                // once is paid by another lease.
                let grown = e
                    .bytes
                    .saturating_sub(credit.min(e.prefix_bytes))
                    .saturating_sub(bytes);
                out.grown_bytes = out.grown_bytes.saturating_add(grown);
                if e.resuming {
                    resume = resume.max(grown);
                    resume_since = resume_since.min(created_ms);
                } else {
                    held.insert(id, grown);
                    needed = needed.saturating_add(grown);
                    if e.elastic {
                        out.lendable = out.lendable.saturating_add(grown);
                    }
                }
            }
            None => {
                out.foreign_leases += 1;
                out.foreign_bytes = out.foreign_bytes.saturating_add(e.bytes);
                // Not this gateway's own (a lease it has released that the backend still
                // finishes) and not a request that bypassed the gateways.
                // A peer that drew this gateway's own number (it polls under it) makes such
                // leases its own as likely as this gateway's.
                if let Some(g) =
                    e.id.map(crate::lease_id::gateway_of)
                        .filter(|g| *g != own_gateway || peer_has_own_number)
                {
                    gateways.insert(g);
                    out.peer_bytes = out.peer_bytes.saturating_add(e.bytes);
                }
            }
        }
    }
    ledger.set_held(|id| held.get(&id).copied().unwrap_or(0));
    let counted_elsewhere = shared_prefixes_once(ledger, &mut decoding, &decoding_ids);
    decoding_reserved = decoding_reserved.saturating_sub(counted_elsewhere);
    // What they will never all hold at once is admitted on top of the capacity.
    out.slack = decoding_reserved.saturating_sub(peak(&decoding));
    ledger.set_slack(out.slack);
    if !etas.is_empty() {
        ledger.set_etas(|id| etas.get(&id).copied());
    }
    // Held back: what the backend uses beyond this ledger, or what foreign leases hold there
    // plus what this ledger's own leases hold or need beyond their reservations, whichever is
    // more (the two are different blocks: with both, their sum is in use beyond the ledger
    // even while its own reservations are not filled yet). Own leases: the growth elastic
    // sequences hold, and room for the preempted
    // sequence that needs the most to resume. Not every preempted one's need: they resume one
    // at a time as room frees, so holding back their sum (which can exceed the pool) would
    // stop every admission until all had resumed, while the room beyond the largest need
    // stays idle. Right after a poll, what this ledger admits leaves the largest need free
    // (but what it lends to requests older than the resume, below); until the next one, a
    // smaller need that resumed first may take part of it.
    let base = report.used_bytes.saturating_sub(ledger.committed()).max(
        out.foreign_bytes
            .saturating_add(needed)
            .saturating_add(resume),
    );
    // Lendable: the part of that the borrowers' growth makes up. Without it, what would still
    // be held back (the firm part) stays held back.
    let (growth, foreign, committed) = (out.lendable, out.foreign_bytes, ledger.committed());
    let firm_with = |resume_firm: u64| {
        report
            .used_bytes
            .saturating_sub(growth)
            .saturating_sub(committed)
            .max(
                foreign
                    .saturating_add(needed.saturating_sub(growth))
                    .saturating_add(resume_firm),
            )
    };
    let growth_lent = base.saturating_sub(firm_with(resume));
    // Other gateways admit onto this backend too, and this one learns of it only at its next
    // poll: until then it takes only its share of the room free now, 1/(others + 1), so that
    // gateways racing for the same room rarely over-admit it (the backend refuses what they
    // do). Its own releases free room for it at once; the next poll splits the room again.
    // Those that poll (one per Envoy where the backend trusts its pollers, so two that drew the
    // same number both count; without a secret, a capped few: `backend/src/pollers.rs`), and those
    // seen only by their leases.
    let polling: BTreeSet<u64> = report.other_gateways.iter().copied().collect();
    let unpolled = gateways.iter().filter(|g| !polling.contains(*g)).count();
    let others = (report.other_gateways.len() + unpolled) as u64;
    let spare = ledger
        .admits()
        .saturating_sub(ledger.committed())
        .saturating_sub(base);
    out.other_gateways = others;
    out.held_back = base.saturating_add(spare / (others + 1) * others);
    // The room held for a preempted sequence to resume is not its reservation: it is growth
    // it was made to give back (or, demoted, all it needs). Requests that were already in line
    // when the first of those waiting to resume was admitted (live claims older than its
    // lease) are lent as much of it as they need beyond what is spare: they are served ahead
    // of it, as they would have been had it not grown. Claims are served oldest first, so that
    // lends later requests nothing: they wait for the resume, and a preempted sequence waits
    // for a line of bounded length. Without this, a short request in line waits behind sequences admitted
    // after it for as long as they take turns outgrowing the pool.
    let older_need = ledger
        .claims()
        .iter()
        .filter(|c| c.active && c.expires_ms > now_ms && c.first_ms < resume_since)
        .map(|c| c.bytes)
        .fold(0u64, u64::saturating_add);
    ledger.set_held_back(out.held_back);
    // What the claims could take now without it: the spare (not the borrowers' growth, which
    // is lent only to classes that preempt: `Ledger::settle_claims`).
    let resume_lent = resume.min(older_need.saturating_sub(ledger.unclaimed()));
    out.lendable = base.saturating_sub(firm_with(resume.saturating_sub(resume_lent)));
    ledger.set_lendable(out.lendable);
    ledger.set_lendable_to_line(out.lendable.saturating_sub(growth_lent));
    // What is lent to the line goes to the claims now, oldest first, before any other
    // admission can count it as room (`Ledger::admit_into_lent`).
    ledger.settle_claims(now_ms);
    out.lendable = ledger.lendable();
    out.lendable_to_line = ledger.lendable_to_line();
    out
}

/// Ledger committed minus backend used, as a signed number of bytes.
pub fn drift(ledger: &Ledger, report: &BackendReport) -> i128 {
    i128::from(ledger.committed()) - i128::from(report.used_bytes)
}

/// The disagreement to measure and alert on, after a reconcile: [`drift`], less what is
/// expected to differ — what this ledger's own elastic leases hold past their reservations and
/// what other gateways' leases hold ([`Reconciled::peer_bytes`]). What is left is use no
/// gateway accounts for (bypass traffic, a lease released here that the backend still runs) or
/// reservations the backend does not hold.
pub fn unexplained_drift(ledger: &Ledger, report: &BackendReport, rec: &Reconciled) -> i128 {
    let d = drift(ledger, report) + i128::from(rec.grown_bytes) + i128::from(rec.peer_bytes);
    // A server that reports only its pool (vLLM) uses less than the worst cases reserved there
    // as a rule, with no lease to say which: only use beyond the reservations disagrees.
    if report.pool_only {
        d.min(0)
    } else {
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{AdmitOutcome, AdmitRequest};
    use crate::retry::RetryAfterConfig;

    fn request(id: u64, bytes: u64, now: u64) -> AdmitRequest<'static> {
        AdmitRequest {
            id: Some(id),
            bytes,
            class: "c",
            priority: 0,
            now_ms: now,
            owner: 1,
            claim: None,
        }
    }

    /// One of this gateway's leases in a report: running, or preempted and waiting to resume.
    fn own_entry(id: u64, bytes: u64, elastic: bool, resuming: bool) -> LiveEntry {
        LiveEntry {
            id: Some(id),
            bytes,
            running: !resuming,
            elastic,
            resuming,
            ..Default::default()
        }
    }

    fn admit(l: &mut Ledger, id: u64, bytes: u64, now: u64) {
        let r = request(id, bytes, now);
        assert!(matches!(
            l.try_admit(&r, &RetryAfterConfig::default(), 0),
            AdmitOutcome::Admitted { .. }
        ));
    }

    #[test]
    fn parses_the_backend_document() {
        let body = br#"{"pool":{"capacity_bytes":1000,"used_bytes":300},"cursor":7,
            "leases":[{"id":"11"},{"id":"internal-3"}],"finished":[{"id":"12","reason":"stop"}],
            "model":{"fingerprint":"abc"}}"#;
        let r = BackendReport::parse(body).unwrap();
        assert_eq!(r.live, vec![11]);
        assert_eq!(r.finished, vec![12]);
        assert_eq!((r.capacity_bytes, r.used_bytes, r.cursor), (1000, 300, 7));
        assert_eq!(r.fingerprint.as_deref(), Some("abc"));
        assert!(BackendReport::parse(b"{}").is_err());
        assert!(BackendReport::parse(b"nope").is_err());
    }

    #[test]
    fn what_decoding_leases_never_all_hold_at_once_is_admitted_on_top() {
        // 10 bytes a token, no block rounding. Lease 1: 700 tokens (7,000 B here), 5 steps from
        // its cap; lease 2: 300 (3,000 B), at 30 of them. At most 7,000 + 360 at once (in 5
        // steps), or 3,000 later: 2,640 of the 10,000 reserved are never all held.
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 7_000, 0);
        admit(&mut l, 2, 3_000, 0);
        let entry = |id, prompt_tokens, max_tokens, used_tokens| LiveEntry {
            id: Some(id),
            bytes: (prompt_tokens + max_tokens) * 10,
            running: true,
            prompt_tokens,
            max_tokens,
            used_tokens,
            ..Default::default()
        };
        let spec = crate::spec::ModelSpec {
            layers: 1,
            kv_heads: 1,
            head_dim: 5,
            kv_dtype_bytes: 1,
            context_tokens: 1_000,
        };
        let report = BackendReport {
            live: vec![1, 2],
            used_bytes: 10_000,
            entries: vec![entry(1, 690, 10, 695), entry(2, 20, 280, 30)],
            spec: Some(spec),
            scratch_margin_bytes: Some(0),
            ..Default::default()
        };
        let r = reconcile(&mut l.clone(), &report, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!(r.slack, 2_640);
        reconcile(&mut l, &report, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!((l.slack(), l.admits(), l.free()), (2_640, 12_640, 2_640));
        admit(&mut l, 3, 2_640, 200);
        // An end takes its bytes off the slack until the next report: it may have been all of it.
        l.release(2, 300);
        assert_eq!((l.slack(), l.free()), (0, 10_000 - 7_000 - 2_640));
        // Waiting, elastic or resuming leases, and a report without the block rounding, count
        // whole.
        for e in [
            LiveEntry {
                running: false,
                ..entry(2, 20, 280, 30)
            },
            LiveEntry {
                elastic: true,
                ..entry(2, 20, 280, 30)
            },
            LiveEntry {
                resuming: true,
                ..entry(2, 20, 280, 30)
            },
        ] {
            let mut m = Ledger::new(10_000, 1);
            admit(&mut m, 1, 7_000, 0);
            admit(&mut m, 2, 3_000, 0);
            let partial = BackendReport {
                entries: vec![entry(1, 690, 10, 695), e],
                ..report.clone()
            };
            assert_eq!(
                reconcile(&mut m, &partial, 100, 5_000, &BTreeMap::new(), 0).slack,
                0
            );
        }
        let older = BackendReport {
            scratch_margin_bytes: None,
            ..report.clone()
        };
        assert_eq!(
            reconcile(&mut l, &older, 400, 5_000, &BTreeMap::new(), 0).slack,
            0
        );
    }

    #[test]
    fn a_shared_prefix_is_carried_in_the_peak_by_the_holder_that_may_hold_it_longest() {
        // Lease 1 pays a 600-byte prefix and ends in 5 steps; lease 2, admitted without it,
        // ends in 50: the prefix is in lease 2's growth, not in both.
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 1_000, 0);
        admit(&mut l, 2, 400, 0);
        l.set_prefix(1, 9, 0);
        l.set_prefix(2, 9, 600);
        let g = |now, most, steps_left| Growth {
            now,
            per_step: 1,
            most,
            steps_left,
        };
        let mut decoding = vec![g(900, 1_000, 5), g(700, 1_000, 50)];
        assert_eq!(
            shared_prefixes_once(&l, &mut decoding, &[(0, 1), (1, 2)]),
            0
        );
        assert_eq!(decoding, vec![g(300, 400, 5), g(700, 1_000, 50)]);
        // Lease 2 not decoding (waiting: counted whole, for ever): the payer's growth leaves the
        // prefix out, and so do its reserved bytes in the decoding sum.
        let mut decoding = vec![g(900, 1_000, 5)];
        assert_eq!(shared_prefixes_once(&l, &mut decoding, &[(0, 1)]), 600);
        assert_eq!(decoding, vec![g(300, 400, 5)]);
    }

    #[test]
    fn a_lease_admitted_without_its_shared_prefix_is_not_grown_when_the_backend_shares_it() {
        // Lease 1 pays a 600-byte prefix; lease 2 was admitted without it. The backend holds
        // the prefix once and says so (`prefix_bytes`); then nothing is grown. A backend that
        // does not share it (no prefix caching) shows lease 2 holding it too: held back.
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 1_000, 0);
        admit(&mut l, 2, 400, 0);
        l.set_prefix(1, 9, 0);
        l.set_prefix(2, 9, 600);
        l.check().unwrap();
        let entry = |id, prefix_bytes| LiveEntry {
            id: Some(id),
            bytes: 1_000,
            running: true,
            prefix_bytes,
            ..Default::default()
        };
        let shared = BackendReport {
            live: vec![1, 2],
            used_bytes: 1_400,
            entries: vec![entry(1, 600), entry(2, 600)],
            ..Default::default()
        };
        let r = reconcile(&mut l.clone(), &shared, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!((r.grown_bytes, r.held_back), (0, 0));
        let unshared = BackendReport {
            used_bytes: 2_000,
            entries: vec![entry(1, 0), entry(2, 0)],
            ..shared
        };
        let r = reconcile(&mut l, &unshared, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!((r.grown_bytes, r.held_back), (600, 600));
    }

    #[test]
    fn growth_past_a_reservation_is_held_back_and_not_drift() {
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 1_000, 0); // elastic, grown to 1,600 at the backend
        admit(&mut l, 2, 2_000, 0); // within its reservation
        let entry = |id, bytes| LiveEntry {
            id: Some(id),
            bytes,
            running: true,
            ..Default::default()
        };
        let report = BackendReport {
            live: vec![1, 2],
            used_bytes: 1_600 + 1_500,
            entries: vec![entry(1, 1_600), entry(2, 1_500)],
            ..Default::default()
        };
        let r = reconcile(&mut l, &report, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!(r.grown_bytes, 600);
        // Each lease knows what of that it holds: it frees with the lease (Retry-After).
        let held = |l: &Ledger, id| l.lease(id).map(|x| x.held);
        assert_eq!((held(&l, 1), held(&l, 2)), (Some(600), Some(0)));
        // A preempted elastic sequence holds little but needs its growth back to resume: the
        // backend reports the need, and it is held back even though the pool does not use it.
        let mut waiting = l.clone();
        let needs = BackendReport {
            used_bytes: 1_000 + 1_500,
            entries: vec![
                LiveEntry {
                    running: false,
                    resuming: true,
                    ..entry(1, 1_600)
                },
                entry(2, 1_500),
            ],
            ..report.clone()
        };
        let w = reconcile(&mut waiting, &needs, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!((w.grown_bytes, w.held_back), (600, 600));
        // A need to resume is not held for that lease alone (only the largest one is held
        // back): its end is not counted on to free it.
        assert_eq!(held(&waiting, 1), Some(0));
        // Two preempted, needing 600 and 4,000 beyond their reservations, and one running
        // 200 past its own: they resume one at a time, so room for the larger need is held
        // back (with the running growth), not both needs: 4,200 of the 4,800 grown.
        let mut two = Ledger::new(10_000, 1);
        admit(&mut two, 1, 1_000, 0);
        admit(&mut two, 2, 2_000, 0);
        admit(&mut two, 3, 1_000, 0);
        let both = BackendReport {
            live: vec![1, 2, 3],
            used_bytes: 1_000 + 2_000 + 1_200,
            entries: vec![
                LiveEntry {
                    running: false,
                    resuming: true,
                    ..entry(1, 1_600)
                },
                LiveEntry {
                    running: false,
                    resuming: true,
                    ..entry(2, 6_000)
                },
                entry(3, 1_200),
            ],
            ..Default::default()
        };
        let b = reconcile(&mut two, &both, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!((b.grown_bytes, b.held_back), (4_800, 4_200));
        // Admitting into all of that still leaves the larger need (4,000) free at the backend,
        // which holds 4,200 of the 10,000.
        assert_eq!(two.free(), 10_000 - 4_000 - 4_200);
        // Lease 3 part-way through its prefill after resuming, holding 5,000 past its own
        // reservation (not decoding, not waiting to resume either): what it holds counts in
        // full beside the largest need, so lease 2 can still resume.
        let mut three = two.clone();
        let mut held = both.clone();
        held.used_bytes = 1_000 + 2_000 + 6_000;
        held.entries[2] = LiveEntry {
            running: false,
            ..entry(3, 6_000)
        };
        let h = reconcile(&mut three, &held, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!(h.held_back, 5_000 + 4_000);
        assert_eq!(three.free(), 0);
        // The backend holds 3,100 bytes for the 3,000 committed, but lease 2 may still grow into
        // the 500 of its reservation it does not use yet: what is promised or borrowed is 3,600,
        // so the growth (600), not the pool's excess (100), is held back.
        assert_eq!(r.held_back, 600);
        assert_eq!(l.free(), 10_000 - 3_000 - 600);
        assert_eq!(drift(&l, &report) + i128::from(r.grown_bytes), 500);
    }

    /// One try of a request that keeps its place in line (key `key`): admitted or not.
    fn try_in_line(l: &mut Ledger, id: u64, bytes: u64, key: u64, now: u64) -> bool {
        let r = AdmitRequest {
            claim: Some(crate::ledger::ClaimTicket {
                key,
                patience_ms: 60_000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..request(id, bytes, now)
        };
        matches!(
            l.try_admit(&r, &RetryAfterConfig::default(), 0),
            AdmitOutcome::Admitted { .. }
        )
    }

    /// Lease 1 (worst case, 5,000) runs. X (3,500; only `with_x`) is refused at t=10 beside
    /// lease 9's 2,000 and keeps a place in line; lease 9 ends. Lease 2 (elastic, 1,000) is
    /// admitted at t=30, grows, and is preempted: it needs 3,000 past its reservation to
    /// resume. Y (3,500) first tries at t=45, after lease 2 was admitted. Both come back and
    /// are refused again (their places in line are active), and the backend reports at t=60.
    fn a_resumer_and_a_line(with_x: bool) -> (Ledger, Reconciled) {
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 5_000, 0);
        admit(&mut l, 9, 2_000, 0);
        if with_x {
            assert!(!try_in_line(&mut l, 3, 3_500, 33, 10), "X does not fit");
        }
        l.release(9, 20);
        admit(&mut l, 2, 1_000, 30);
        let report = BackendReport {
            live: vec![1, 2],
            used_bytes: 5_000 + 1_000,
            entries: vec![
                own_entry(1, 5_000, false, false),
                own_entry(2, 4_000, true, true),
            ],
            ..Default::default()
        };
        let r = reconcile(&mut l, &report, 40, 5_000, &BTreeMap::new(), 0);
        assert_eq!((r.held_back, r.lendable), (3_000, 0), "no one in line yet");
        assert!(!try_in_line(&mut l, 4, 3_500, 44, 45), "Y does not fit");
        if with_x {
            assert!(
                !try_in_line(&mut l, 3, 3_500, 33, 50),
                "X, back, still does not"
            );
        }
        assert!(
            !try_in_line(&mut l, 4, 3_500, 44, 55),
            "Y, back, still does not"
        );
        let r = reconcile(&mut l, &report, 60, 5_000, &BTreeMap::new(), 0);
        (l, r)
    }

    #[test]
    fn the_room_to_resume_is_lent_only_to_requests_in_line_before_the_resumer_was_admitted() {
        // X was in line before lease 2 was admitted: of the room lease 2 needs to resume, what
        // X lacks beyond the 1,000 spare is lent to it, and set aside for it at once. Nothing
        // of it is left to Y, or to a request of a class that may preempt.
        let (mut l, r) = a_resumer_and_a_line(true);
        assert_eq!((r.held_back, r.lendable), (3_000, 2_500));
        let held: Vec<u64> = l.claims().iter().map(|c| c.held).collect();
        assert_eq!(held, vec![3_500, 0], "X holds all it needs, Y nothing");
        let vip = request(5, 100, 65);
        assert!(l.admit_into_lent(&vip).is_none(), "no lent room left over");
        assert!(try_in_line(&mut l, 3, 3_500, 33, 70), "X is admitted");
        // Y came after lease 2 was admitted: that room is not lent to it, and it waits.
        let (mut l, r) = a_resumer_and_a_line(false);
        assert_eq!((r.held_back, r.lendable), (3_000, 0));
        assert!(
            !try_in_line(&mut l, 4, 3_500, 44, 70),
            "Y waits for lease 2"
        );
        let held: Vec<u64> = l.claims().iter().map(|c| c.held).collect();
        assert_eq!(held, vec![10_000 - 6_000 - 3_000], "Y holds only the spare");
    }

    #[test]
    fn a_request_in_line_is_lent_the_resume_room_and_not_the_growth() {
        // Lease 1 (elastic, 1,000) runs 3,000 past its reservation. X (2,500) is refused at
        // t=10 beside lease 9's 7,000 and keeps a place in line; lease 9 ends. Lease 2
        // (elastic, 1,000) and lease 8 (worst case, 4,000) are admitted at t=30; lease 2 is
        // preempted and needs 3,000 past its reservation to resume. 6,000 is committed and
        // 6,000 held back (the growth and the resume room). The growth is lendable (to a class
        // that preempts), not to the line; X, in line before lease 2 was admitted, is lent
        // what it lacks of the resume room.
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 1_000, 0);
        admit(&mut l, 9, 7_000, 0);
        assert!(!try_in_line(&mut l, 3, 2_500, 33, 10), "X does not fit");
        l.release(9, 20);
        admit(&mut l, 2, 1_000, 30);
        admit(&mut l, 8, 4_000, 30);
        let report = BackendReport {
            live: vec![1, 2, 8],
            used_bytes: 4_000 + 1_000 + 4_000,
            entries: vec![
                own_entry(1, 4_000, true, false),
                own_entry(2, 4_000, true, true),
                own_entry(8, 4_000, false, false),
            ],
            ..Default::default()
        };
        let r = reconcile(&mut l, &report, 40, 5_000, &BTreeMap::new(), 0);
        assert_eq!(
            (r.held_back, r.lendable, r.lendable_to_line),
            (6_000, 3_000, 0),
            "X is not back yet"
        );
        assert!(
            !try_in_line(&mut l, 3, 2_500, 33, 50),
            "the growth is not lent to the line"
        );
        assert_eq!(l.held_for(33), 0);
        let r = reconcile(&mut l, &report, 60, 5_000, &BTreeMap::new(), 0);
        // 2,500 of the resume room is lent on top of the growth, all X's.
        assert_eq!(
            (r.held_back, r.lendable, r.lendable_to_line),
            (6_000, 5_500, 2_500)
        );
        let held: Vec<u64> = l.claims().iter().map(|c| c.held).collect();
        assert_eq!(held, vec![2_500]);
        assert!(try_in_line(&mut l, 3, 2_500, 33, 70), "X is admitted");
    }

    #[test]
    fn only_what_elastic_sequences_borrowed_and_run_on_is_lendable_and_not_to_the_line() {
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 1_000, 0); // elastic, running 600 past its reservation
        admit(&mut l, 2, 2_000, 0); // worst case, 100 of block rounding past it
        admit(&mut l, 3, 1_000, 0); // elastic, preempted: needs 900 past it to resume
        let report = BackendReport {
            live: vec![1, 2, 3],
            used_bytes: 1_600 + 2_100 + 1_000,
            entries: vec![
                own_entry(1, 1_600, true, false),
                own_entry(2, 2_100, false, false),
                own_entry(3, 1_900, true, true),
            ],
            ..Default::default()
        };
        let r = reconcile(&mut l, &report, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!(r.held_back, 600 + 100 + 900);
        // The rounding is no one's to give back, and the preempted one's need is its room to
        // resume: only the running borrower's 600 is lendable, to a class that preempts, and
        // none of it to the line.
        assert_eq!((r.lendable, l.lendable()), (600, 600));
        assert_eq!((r.lendable_to_line, l.lendable_to_line()), (0, 0));
        // With another gateway on the backend, its share of the room is held back too, and
        // none of it is lendable.
        let mut shared = Ledger::new(10_000, 1);
        admit(&mut shared, 1, 1_000, 0);
        let mut two = report.clone();
        two.live = vec![1];
        two.entries.truncate(1);
        two.entries.push(LiveEntry {
            id: Some(crate::lease_id::compose(7, 1)),
            ..own_entry(0, 500, false, false)
        });
        two.used_bytes = 1_600 + 500;
        let s = reconcile(&mut shared, &two, 100, 5_000, &BTreeMap::new(), 0);
        // Base 1,100 (the growth and the other gateway's 500 the pool uses beyond the 1,000
        // committed), plus half of the 10,000 − 1,000 − 1,100 left, the other gateway's share.
        assert_eq!(s.held_back, 1_100 + 7_900 / 2);
        assert_eq!(shared.lendable(), 600);
        // Foreign use (2,000, from requests that bypassed the gateways) beside the growth
        // (600) while lease 2 is not at the backend yet: both are held back, though the pool
        // uses less than is committed, and only the growth is lent (not the foreign bytes).
        let mut bypassed = Ledger::new(10_000, 1);
        admit(&mut bypassed, 1, 1_000, 0);
        admit(&mut bypassed, 2, 3_000, 0); // not at the backend yet
        let foreign = BackendReport {
            live: vec![1],
            used_bytes: 1_600 + 2_000,
            entries: vec![
                own_entry(1, 1_600, true, false),
                LiveEntry {
                    id: None,
                    ..own_entry(0, 2_000, false, false)
                },
            ],
            ..Default::default()
        };
        let f = reconcile(&mut bypassed, &foreign, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!((f.held_back, f.lendable), (2_600, 600));
        // All 4,000 committed plus 2,600 in use beyond them: 3,400 free, as in the pool once
        // lease 2 arrives.
        assert_eq!(bypassed.free(), 10_000 - 4_000 - 2_600);
        // More growth than foreign use: the growth is lent, the foreign use never.
        let mut grown = foreign.clone();
        grown.entries[0].bytes = 3_500;
        grown.used_bytes = 3_500 + 2_000;
        let mut g_ledger = Ledger::new(10_000, 1);
        admit(&mut g_ledger, 1, 1_000, 0);
        admit(&mut g_ledger, 2, 3_000, 0);
        let g = reconcile(&mut g_ledger, &grown, 100, 5_000, &BTreeMap::new(), 0);
        assert_eq!((g.held_back, g.lendable), (2_000 + 2_500, 2_500));
    }

    #[test]
    fn finished_outputs_carry_the_class_the_gateway_named() {
        let body = br#"{"pool":{"capacity_bytes":1000,"used_bytes":0},
            "finished":[{"id":"1","reason":"stop","prompt_tokens":30,"completion_tokens":7,
                         "class":"batch","gateway_prompt_tokens":24},
                        {"id":"2","reason":"length","completion_tokens":9},
                        {"id":"4","reason":"length","completion_tokens":16,"class":"batch"},
                        {"id":"3","reason":"cancelled","completion_tokens":2,"class":"batch"}]}"#;
        let r = BackendReport::parse(body).unwrap();
        // The one that ran to its cap is marked: it would have run at least that long.
        assert_eq!(
            r.finished_outputs,
            vec![
                Output::stopped(7).after(30),
                Output::capped(9),
                Output::capped(16)
            ]
        );
        // Per class too: the elastic quantile counts an output cut at its cap as censored. The
        // prompt there is the gateway's count (what it prices), not the backend's.
        assert_eq!(
            r.class_outputs,
            vec![
                ("batch".to_string(), Output::stopped(7).after(24)),
                ("batch".to_string(), Output::capped(16))
            ]
        );
    }

    #[test]
    fn finished_are_released_and_unknown_leases_are_kept_as_drift() {
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 100, 0); // backend reports it finished
        admit(&mut l, 2, 200, 0); // backend holds it
        admit(&mut l, 3, 300, 0); // backend never heard of it: unseen, kept
        admit(&mut l, 4, 400, 9_500); // too young to call unseen
        let report = BackendReport {
            live: vec![2],
            finished: vec![1, 99],
            used_bytes: 208,
            ..Default::default()
        };
        let r = reconcile(&mut l, &report, 10_000, 5_000, &BTreeMap::new(), 0);
        assert_eq!(r.released.iter().map(|x| x.id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(r.unseen.iter().map(|x| x.id).collect::<Vec<_>>(), vec![3]);
        assert_eq!(r.unseen_bytes(), 300);
        assert_eq!(l.committed(), 900, "an unseen lease keeps its bytes");
        assert_eq!(r.held_back, 0);
        assert_eq!(drift(&l, &report), 692);
        l.check().unwrap();
        // Idempotent: the same report again releases nothing more and removes nothing.
        let again = reconcile(&mut l, &report, 10_000, 5_000, &BTreeMap::new(), 0);
        assert!(again.released.is_empty());
        assert_eq!(again.unseen.len(), 1);
        assert_eq!(l.committed(), 900);
        assert_eq!(l.counters().reaped, 0);
    }

    fn entry(id: u64, bytes: u64) -> LiveEntry {
        LiveEntry {
            id: Some(id),
            bytes,
            ..LiveEntry::default()
        }
    }

    #[test]
    fn a_backend_serves_the_model_when_shape_and_name_agree_whatever_its_context() {
        let spec = crate::spec::ModelSpec {
            layers: 30,
            kv_heads: 3,
            head_dim: 64,
            kv_dtype_bytes: 4,
            context_tokens: 8192,
        };
        let report = |ctx: u64, layers: u64, name: &str| BackendReport {
            spec: Some(crate::spec::ModelSpec {
                context_tokens: ctx,
                layers,
                ..spec
            }),
            model: Some(name.into()),
            ..Default::default()
        };
        assert!(report(1024, 30, "m").serves(&spec, Some("m"), None));
        assert!(!report(8192, 32, "m").serves(&spec, Some("m"), None));
        assert!(!report(8192, 30, "other").serves(&spec, Some("m"), None));
        let bare = BackendReport {
            fingerprint: Some("ab".into()),
            ..Default::default()
        };
        assert!(bare.serves(&spec, None, Some("ab")));
        assert!(!bare.serves(&spec, None, Some("cd")));
    }

    #[test]
    fn several_leases_that_may_each_stop_early_are_expected_to_end_jointly() {
        // Three answers just started; finished outputs are short (10) or long (300) runs.
        let p = Progress {
            tokens_per_s: 10.0,
            outputs: [10, 10, 10, 300, 300, 300].map(Output::stopped).to_vec(),
        };
        let started = |id| LiveEntry {
            id: Some(id),
            bytes: 100,
            running: true,
            resuming: false,
            elastic: false,
            prompt_tokens: 20,
            max_tokens: 1000,
            used_tokens: 21,
            prefix_bytes: 0,
        };
        let entries = [started(1), started(2), started(3)];
        // Alone, each is expected at the median of all outputs: a long run, 29.9 s.
        assert_eq!(p.eta_ms(&entries[0], 0), Some(29_900));
        // Together: the first to end is a short one (all three long: 1 in 8), the last a long one.
        let refs: Vec<&LiveEntry> = entries.iter().collect();
        let mut etas = p.joint_etas(&refs, 0).unwrap();
        etas.sort_unstable();
        assert_eq!(etas[0], 900);
        assert_eq!(etas[2], 29_900);
        assert_eq!(
            p.joint_etas(&refs, 0).unwrap(),
            p.joint_etas(&refs, 0).unwrap()
        );
        // One lease alone: the joint draw agrees with its own short-or-long median.
        let one = p.joint_etas(&refs[..1], 0).unwrap()[0];
        assert!(one == 900 || one == 29_900, "{one}");
    }

    #[test]
    fn an_output_its_cap_ended_says_only_that_it_ran_at_least_that_long() {
        // Short answers stop by themselves (10, 50); long runs were cut by caps of 200.
        let mut outputs = [10, 10, 10, 10, 50].map(Output::stopped).to_vec();
        outputs.extend([200, 200].map(Output::capped));
        outputs.sort_unstable();
        let p = Progress {
            tokens_per_s: 10.0,
            outputs,
        };
        let running = |generated: u64, cap| LiveEntry {
            id: Some(1),
            bytes: 100,
            running: true,
            resuming: false,
            elastic: false,
            prompt_tokens: 20,
            max_tokens: cap,
            used_tokens: 20 + generated,
            prefix_bytes: 0,
        };
        // Past the short answers, one in three of those left stopped by itself (at 50); the
        // other two ran to their caps of 200 and say only that it may run past 200: the median
        // is a quarter of the way from 200 to this lease's cap of 400 (250), not an end at 200:
        // 230 more tokens at 10/s.
        assert_eq!(p.eta_ms(&running(20, 400), 0), Some(23_000));
        // A smaller cap ends it sooner.
        assert_eq!(p.eta_ms(&running(20, 150), 0), Some(13_000));
        // Past every output that stopped by itself, with only runs to caps left: halfway from
        // 200 to its cap (300).
        assert_eq!(p.eta_ms(&running(60, 400), 0), Some(24_000));
        // Just started, the short answers are most of what may come: the median is 10.
        assert_eq!(p.eta_ms(&running(2, 400), 0), Some(800));
        // The same outputs, none of them cut by a cap: the lengths they reached are lengths.
        let stopped = Progress {
            tokens_per_s: 10.0,
            outputs: [10, 10, 10, 10, 50, 200, 200].map(Output::stopped).to_vec(),
        };
        assert_eq!(stopped.eta_ms(&running(20, 400), 0), Some(18_000));
        // In joint draws a run to its cap is drawn as often as the censored outputs say: of
        // three leases past the short answers, the first ends at 50 when any of them stops by
        // itself (19 in 27), the last only when all three do (1 in 27): else past 200.
        let a = running(20, 400);
        let b = LiveEntry { id: Some(2), ..a };
        let c = LiveEntry { id: Some(3), ..a };
        let mut etas = p.joint_etas(&[&a, &b, &c], 0).unwrap();
        etas.sort_unstable();
        assert_eq!(etas[0], 3_000);
        assert!((18_000..=38_000).contains(&etas[2]), "{}", etas[2]);
    }

    #[test]
    fn outputs_that_answered_prompts_of_about_the_same_length_come_first() {
        // `short` answers to a 30-token prompt, and `runs` runs to the cap after a 50-token one.
        let progress = |short: usize, runs: usize| {
            let mut outputs: Vec<Output> = vec![Output::stopped(56).after(30); short];
            outputs.extend(vec![Output::capped(400).after(50); runs]);
            outputs.sort_unstable();
            Progress {
                tokens_per_s: 10.0,
                outputs,
            }
        };
        let running = |prompt_tokens: u64| LiveEntry {
            id: Some(1),
            bytes: 100,
            running: true,
            resuming: false,
            elastic: false,
            prompt_tokens,
            max_tokens: 400,
            used_tokens: prompt_tokens + 10,
            prefix_bytes: 0,
        };
        let p = progress(6, 5);
        // Like the short answers: 46 more tokens at 10/s.
        assert_eq!(p.eta_ms(&running(30), 0), Some(4_600));
        // Like the runs (51 is within 5 % of 50): to its cap, 390 more.
        assert_eq!(p.eta_ms(&running(51), 0), Some(39_000));
        // Past every answer like it: the others say (runs to the cap of 400).
        assert_eq!(
            p.eta_ms(
                &LiveEntry {
                    used_tokens: 30 + 60,
                    ..running(30)
                },
                0
            ),
            Some(34_000)
        );
        // Like none of them: all outputs count, and most of them (6 of 11) stopped at 56.
        assert_eq!(p.eta_ms(&running(45), 0), Some(4_600));
        // Fewer than five like it: their estimate (a run to the cap) weighs 4/5, the one over
        // all outputs (6 of 10 stopped at 56) the rest: most likely a run to the cap.
        assert_eq!(progress(6, 4).eta_ms(&running(50), 0), Some(39_000));
        // One like it: 1/5 of the weight, and the short answers are most of all outputs.
        assert_eq!(progress(6, 1).eta_ms(&running(50), 0), Some(4_600));
        // Three short answers among eight runs: over all outputs a run to the cap is most
        // likely (8 of 11), but the three like it weigh 3/5 and say it stops at 56.
        assert_eq!(progress(3, 8).eta_ms(&running(30), 0), Some(4_600));
        assert_eq!(progress(3, 8).eta_ms(&running(45), 0), Some(39_000));
    }

    #[test]
    fn progress_sets_each_leases_expected_end() {
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 100, 0);
        admit(&mut l, 2, 100, 0);
        admit(&mut l, 3, 100, 0);
        // Finished outputs: short answers (10-12) and long runs (50-60).
        let p = Progress {
            tokens_per_s: 10.0,
            outputs: [10, 11, 12, 50, 50, 60].map(Output::stopped).to_vec(),
        };
        let running = |id, generated: u64, cap| LiveEntry {
            id: Some(id),
            bytes: 100,
            running: true,
            resuming: false,
            elastic: false,
            prompt_tokens: 20,
            max_tokens: cap,
            used_tokens: 20 + generated,
            prefix_bytes: 0,
        };
        let report = BackendReport {
            entries: vec![
                running(1, 15, 1000),
                running(2, 80, 100),
                running(3, 0, 30),
                running(4, 5, 1000),
            ],
            ..Default::default()
        };
        let eta = |i: usize| p.eta_ms(&report.entries[i], 1_000).unwrap();
        // 1: past the short answers: a long one, 50 (the median of 50, 50, 60): 35 more at 10/s.
        assert_eq!(eta(0), 1_000 + 3_500);
        // 2: past every finished output: half of the 20 its cap still allows.
        assert_eq!(eta(1), 1_000 + 1_000);
        // 3: its cap (30) comes before the median (50).
        assert_eq!(eta(2), 1_000 + 3_000);
        // 4: 5 tokens in: the median of all six outputs (50): 45 more.
        assert_eq!(eta(3), 1_000 + 4_500);
        // Reconciled, each of the ledger's leases gets an expected end (taken jointly).
        let etas = own_etas(&l, &report, Some(&p), 1_000);
        assert_eq!(etas.len(), 3, "the ledger's leases only: 4 is another's");
        reconcile(&mut l, &report, 1_000, 5_000, &etas, 0);
        for id in 1..=3 {
            assert!(l.lease(id).unwrap().eta_ms > 1_000);
        }
        // No rate known: nothing set.
        let mut fresh = Ledger::new(10_000, 1);
        admit(&mut fresh, 1, 100, 0);
        let none = Progress {
            tokens_per_s: 0.0,
            outputs: vec![Output::stopped(50)],
        };
        let etas = own_etas(&fresh, &report, Some(&none), 1_000);
        reconcile(&mut fresh, &report, 1_000, 5_000, &etas, 0);
        assert_eq!(fresh.lease(1).unwrap().eta_ms, 0);
    }

    #[test]
    fn a_cold_gateway_expects_ends_within_the_cap_until_enough_outputs_have_finished() {
        let running = |generated: u64| LiveEntry {
            id: Some(1),
            bytes: 100,
            running: true,
            prompt_tokens: 20,
            max_tokens: 400,
            used_tokens: 20 + generated,
            ..LiveEntry::default()
        };
        let seen = |n: usize| Progress {
            tokens_per_s: 10.0,
            outputs: vec![Output::stopped(10); n],
        };
        // Nothing finished yet: halfway through what its cap still allows, at the rate (190
        // more of the 380 tokens left, at 10/s).
        assert_eq!(seen(0).eta_ms(&running(20), 0), Some(19_000));
        // One short answer seen weighs a half, the even spread over the 395 tokens left the
        // other half: the median is just past the answer (the spread's first step, at 12).
        assert_eq!(seen(1).eta_ms(&running(5), 0), Some(700));
        // A long answer seen (300) weighs a half too: the spread reaches only 0.37 below it, so
        // the median is the answer.
        let long = |capped: bool| Progress {
            tokens_per_s: 10.0,
            outputs: vec![if capped {
                Output::capped(300)
            } else {
                Output::stopped(300)
            }],
        };
        assert_eq!(long(false).eta_ms(&running(5), 0), Some(29_500));
        // One its cap ended at 300 (it could have run longer) says only "past 300": the spread
        // holds the whole half below the median, which is where runs past 300 start.
        assert_eq!(long(true).eta_ms(&running(5), 0), Some(29_500));
        // Two of the same short answer weigh two thirds: the median is the answer (5 more).
        assert_eq!(seen(2).eta_ms(&running(5), 0), Some(500));
        // Five: trusted alone, as before.
        assert_eq!(seen(5).eta_ms(&running(5), 0), Some(500));
        // Past every output seen, cold or not: uniformly up to the cap (190 more).
        assert_eq!(seen(2).eta_ms(&running(20), 0), Some(19_000));
        // Jointly, of three just started with one short answer seen, the first is expected to
        // end as the short answer (1 s) and the last in the spread: all three end short only
        // once in eight draws.
        let a = running(0);
        let b = LiveEntry { id: Some(2), ..a };
        let c = LiveEntry { id: Some(3), ..a };
        let mut etas = seen(1).joint_etas(&[&a, &b, &c], 0).unwrap();
        etas.sort_unstable();
        assert!(etas[0] <= 1_200 && etas[2] > 15_000, "{etas:?}");
    }

    #[test]
    fn the_tracker_learns_the_rate_and_the_typical_output() {
        let mut t = ProgressTracker::default();
        let at = |generated: u64, finished: Vec<u64>| BackendReport {
            entries: vec![LiveEntry {
                id: Some(1),
                running: true,
                prompt_tokens: 10,
                max_tokens: 500,
                used_tokens: 10 + generated,
                ..LiveEntry::default()
            }],
            finished_outputs: finished.into_iter().map(Output::stopped).collect(),
            ..Default::default()
        };
        // No rate before two reports have seen a sequence move.
        assert_eq!(t.observe(&at(0, vec![]), 1_000), None);
        // 20 tokens in 1 s: the rate is known, with the two outputs finished so far (cold:
        // `lengths_after` weighs them by their number).
        let p = t.observe(&at(20, vec![30, 40]), 2_000).unwrap();
        assert!((p.tokens_per_s - 20.0).abs() < 1e-9);
        assert_eq!(p.outputs, [30, 40].map(Output::stopped));
        assert!(!p.warm(), "too few outputs for run estimates (backfills)");
        let p = t.observe(&at(40, vec![50, 60, 200]), 3_000).unwrap();
        assert!(p.warm());
        assert!((p.tokens_per_s - 20.0).abs() < 1e-9);
        assert_eq!(p.outputs, [30, 40, 50, 60, 200].map(Output::stopped));
        // Rates are smoothed: a slower second keeps most of the earlier estimate.
        let p = t.observe(&at(50, vec![]), 4_000).unwrap();
        assert!((p.tokens_per_s - 17.0).abs() < 1e-9, "{}", p.tokens_per_s);
    }

    #[test]
    fn another_gateways_leases_are_foreign_and_held_back() {
        const OURS: u64 = 3;
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 1_000, 0);
        // Ours (1), another gateway's (77: reserved 2,500 while using 100), one that bypassed
        // the gateways, and a backend that reserves at arrival: used covers all three.
        let r = BackendReport::parse(
            br#"{"pool":{"capacity_bytes":10000,"used_bytes":3900},
                "leases":[{"id":"1","reserved_bytes":1000},{"id":"77","reserved_bytes":2500,"used_bytes":100},
                          {"id":"internal-2","used_bytes":400}]}"#,
        )
        .unwrap();
        let rec = reconcile(&mut l, &r, 10, 5_000, &BTreeMap::new(), OURS);
        assert_eq!((rec.foreign_leases, rec.foreign_bytes), (2, 2_900));
        // Gateway 0's 2,500 are its own ledger's: not drift. The bypassing request's 400 are.
        assert_eq!(rec.peer_bytes, 2_500);
        assert_eq!(drift(&l, &r), -2_900);
        assert_eq!(unexplained_drift(&l, &r, &rec), -400);
        // The foreign bytes, and half of the 6,100 still free: one other gateway (77's) may be
        // admitting into it before the next poll.
        assert_eq!(rec.other_gateways, 1);
        assert_eq!(rec.held_back, 2_900 + 3_050);
        assert_eq!(l.free(), 3_050);
        // A backend that does not reserve (admission none) reports less used than reserved:
        // the foreign reservations still hold.
        let r = BackendReport {
            used_bytes: 1_200,
            entries: vec![entry(1, 1_000), entry(77, 2_500)],
            ..Default::default()
        };
        let rec = reconcile(&mut l, &r, 20, 5_000, &BTreeMap::new(), OURS);
        assert_eq!(rec.held_back, 2_500 + 3_250);
        // Two other gateways (numbers 1 and 2 in their lease ids): a third of the room each.
        let r = BackendReport {
            used_bytes: 3_000,
            entries: vec![
                entry(1, 1_000),
                entry(1 << 43, 1_000),
                entry((2 << 43) | 5, 1_000),
            ],
            ..Default::default()
        };
        let rec = reconcile(&mut l, &r, 25, 5_000, &BTreeMap::new(), OURS);
        assert_eq!(rec.other_gateways, 2);
        assert_eq!(rec.held_back, 2_000 + 7_000 / 3 * 2);
        // The other gateway's request ended: nothing foreign, nothing held back.
        let r = BackendReport {
            used_bytes: 1_000,
            entries: vec![entry(1, 1_000)],
            ..Default::default()
        };
        let rec = reconcile(&mut l, &r, 30, 5_000, &BTreeMap::new(), OURS);
        assert_eq!((rec.foreign_leases, rec.held_back), (0, 0));
        assert_eq!(
            l.free(),
            9_000,
            "alone again: all the room is this gateway's"
        );
        // A lease of this gateway's that it has released (its client went away) while the
        // backend still finishes it: foreign bytes, but no other gateway to share room with.
        let r = BackendReport {
            used_bytes: 1_500,
            entries: vec![entry(1, 1_000), entry((OURS << 43) | 9, 500)],
            ..Default::default()
        };
        let rec = reconcile(&mut l, &r, 35, 5_000, &BTreeMap::new(), OURS);
        assert_eq!((rec.other_gateways, rec.held_back), (0, 500));
    }

    #[test]
    fn gateways_that_poll_share_the_room_before_any_holds_a_lease() {
        const OURS: u64 = 3;
        let mut l = Ledger::new(10_000, 1);
        let polled = |others: Vec<u64>, entries: Vec<LiveEntry>| BackendReport {
            used_bytes: entries.iter().map(|e| e.bytes).sum(),
            entries,
            other_gateways: others,
            ..Default::default()
        };
        // Another gateway polls, with no lease yet: half the room is its until the next poll.
        let rec = reconcile(
            &mut l,
            &polled(vec![5], vec![]),
            10,
            5_000,
            &BTreeMap::new(),
            OURS,
        );
        assert_eq!((rec.other_gateways, rec.held_back), (1, 5_000));
        assert_eq!(l.free(), 5_000);
        // Two Envoys that drew the same number are two gateways.
        let rec = reconcile(
            &mut l,
            &polled(vec![5, 5], vec![]),
            20,
            5_000,
            &BTreeMap::new(),
            OURS,
        );
        assert_eq!(rec.other_gateways, 2);
        assert_eq!(l.free(), 10_000 - 10_000 / 3 * 2);
        // A polling gateway's leases do not count it twice; an older one, seen only by its
        // leases, counts too.
        let two = vec![entry(5 << 43, 1_000), entry((7 << 43) | 1, 1_000)];
        let rec = reconcile(
            &mut l,
            &polled(vec![5], two),
            30,
            5_000,
            &BTreeMap::new(),
            OURS,
        );
        assert_eq!(rec.other_gateways, 2);
        assert_eq!(
            (rec.peer_bytes, rec.held_back),
            (2_000, 2_000 + 8_000 / 3 * 2)
        );
        // One that polls and two older ones seen only by their leases: three.
        let three = vec![entry((7 << 43) | 1, 1_000), entry((8 << 43) | 1, 1_000)];
        let rec = reconcile(
            &mut l,
            &polled(vec![5], three),
            35,
            5_000,
            &BTreeMap::new(),
            OURS,
        );
        assert_eq!(rec.other_gateways, 3);
        // A peer polling under this gateway's own number: leases in that number are as likely
        // its as this gateway's (released here, still running there), and it shares the room.
        let same = vec![entry((OURS << 43) | 9, 500)];
        let rec = reconcile(
            &mut l,
            &polled(vec![OURS], same.clone()),
            40,
            5_000,
            &BTreeMap::new(),
            OURS,
        );
        assert_eq!((rec.other_gateways, rec.peer_bytes), (1, 500));
        // Without such a peer they are this gateway's own, and no room is shared.
        let rec = reconcile(
            &mut l,
            &polled(vec![], same),
            50,
            5_000,
            &BTreeMap::new(),
            OURS,
        );
        assert_eq!(
            (rec.other_gateways, rec.peer_bytes, rec.held_back),
            (0, 0, 500)
        );
        assert_eq!(l.free(), 9_500, "alone: all the room is this gateway's");
    }

    #[test]
    fn negative_drift_is_held_back_until_it_clears() {
        let mut l = Ledger::new(10_000, 1);
        admit(&mut l, 1, 1_000, 0);
        // The backend uses 4,000 B: 3,000 more than the ledger knows of.
        let hot = BackendReport {
            live: vec![1],
            used_bytes: 4_000,
            ..Default::default()
        };
        let r = reconcile(&mut l, &hot, 10, 5_000, &BTreeMap::new(), 0);
        assert_eq!(r.held_back, 3_000);
        assert_eq!(l.free(), 6_000);
        let cool = BackendReport {
            live: vec![1],
            used_bytes: 500,
            ..Default::default()
        };
        reconcile(&mut l, &cool, 20, 5_000, &BTreeMap::new(), 0);
        assert_eq!(l.held_back(), 0);
        assert_eq!(l.free(), 9_000);
    }
}

/// The backend's model descriptor (`GET /v1/admission/leases?include=tokenizer`): what the filter
/// needs to price exactly for the served model.
#[derive(Debug, Clone, PartialEq)]
pub struct Descriptor {
    pub spec: crate::spec::ModelSpec,
    pub fingerprint: String,
    pub kv_capacity_bytes: u64,
    /// Added to every reservation (one KV block: the backend allocates whole blocks); 0 when
    /// the backend does not say.
    pub scratch_margin_bytes: u64,
    pub tokenizer: crate::tokenize::TokenizerSpec,
    /// What the backend serves (model name, vocabulary, limits): the filter validates with it.
    pub served: crate::validate::Served,
    /// It holds a shared prompt prefix once (prefix caching): a gateway may charge it once.
    pub prefix_caching: bool,
}

impl Descriptor {
    /// `None` when the document carries no tokenizer ranks (a poll without `include=tokenizer`).
    pub fn parse(body: &[u8]) -> Result<Option<Descriptor>, String> {
        Descriptor::from_report(&LeaseReport::parse(body)?)
    }

    /// The descriptor in a parsed report; `None` without tokenizer ranks.
    pub fn from_report(r: &LeaseReport) -> Result<Option<Descriptor>, String> {
        let model = r.model.as_ref().ok_or("no `model`")?;
        let tok = model.tokenizer.as_ref().ok_or("no `model.tokenizer`")?;
        let Some(ranks) = &tok.ranks else {
            return Ok(None);
        };
        let spec = model.spec.ok_or("no `model.spec`")?;
        if tok.pattern.is_empty() {
            return Err("no `model.tokenizer.pattern`".into());
        }
        let ranks = crate::tokenize::CustomBpe::parse_tiktoken(ranks).map_err(|e| e.to_string())?;
        let served = crate::validate::Served {
            model: model.name.clone(),
            vocab: model.vocab,
            max_choices: model.limits.max_choices,
            batched_prompts: model.limits.batched_prompts,
        };
        Ok(Some(Descriptor {
            served,
            prefix_caching: model.prefix_caching,
            spec,
            fingerprint: model.fingerprint.clone().unwrap_or_default(),
            kv_capacity_bytes: r.pool.capacity_bytes,
            scratch_margin_bytes: model.scratch_margin_bytes.unwrap_or(0),
            tokenizer: crate::tokenize::TokenizerSpec::Custom(crate::tokenize::CustomBpe {
                ranks,
                pattern: tok.pattern.clone(),
                special_tokens: tok
                    .special_tokens
                    .iter()
                    .map(|(k, v)| (k.clone(), *v))
                    .collect(),
                chat_template: crate::tokenize::ChatTemplate::from_wire(
                    &tok.chat_template,
                    &tok.bos_token,
                    &tok.eos_token,
                ),
                add_bos: tok.add_bos,
            }),
        }))
    }
}

#[cfg(test)]
mod descriptor_tests {
    use super::*;

    #[test]
    fn parses_spec_budget_and_tokenizer() {
        let body = br#"{"pool":{"capacity_bytes":737280,"used_bytes":0},"cursor":0,"leases":[],"finished":[],
            "model":{"name":"smol","vocab":3,"limits":{"max_choices":1,"batched_prompts":false},"fingerprint":"ebbd44da4ae04b5d","spec":{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192},
            "tokenizer":{"pattern":"\\w+|\\s+","special_tokens":{"<|im_end|>":3},"ranks":"YQ== 0\nYg== 1\nYWI= 2\n"}}}"#;
        let d = Descriptor::parse(body).unwrap().unwrap();
        assert_eq!(d.spec.layers, 30);
        assert_eq!(d.kv_capacity_bytes, 737_280);
        assert_eq!(d.scratch_margin_bytes, 0, "not sent: nothing added");
        assert_eq!(d.served.model.as_deref(), Some("smol"));
        assert_eq!(
            (
                d.served.vocab,
                d.served.max_choices,
                d.served.batched_prompts
            ),
            (Some(3), 1, false)
        );
        assert_eq!(d.fingerprint, d.spec.fingerprint_hex());
        let c = crate::TokenCounter::new(&d.tokenizer).unwrap();
        assert_eq!(c.encode_text("ab"), vec![2]);
        assert_eq!(c.special_id("<|im_end|>"), Some(3));
        let no_ranks = br#"{"pool":{"capacity_bytes":1,"used_bytes":0},"model":{"tokenizer":{"pattern":"x"}}}"#;
        assert_eq!(Descriptor::parse(no_ranks).unwrap(), None);
        assert!(Descriptor::parse(b"[]").is_err());
        // An older backend sends "chatml" (or nothing): the built-in rendering, no BOS.
        let crate::tokenize::TokenizerSpec::Custom(bpe) = &d.tokenizer else {
            panic!("custom")
        };
        assert_eq!(bpe.chat_template, crate::tokenize::ChatTemplate::ChatMl);
        assert_eq!(bpe.add_bos, None);
    }

    #[test]
    fn carries_the_models_chat_template_and_bos() {
        let body = br#"{"pool":{"capacity_bytes":1,"used_bytes":0},"model":{"spec":{"layers":1,"kv_heads":1,"head_dim":1,"kv_dtype_bytes":4,"context_tokens":64},
            "scratch_margin_bytes":128,"prefill_scratch_bytes":4096,
            "tokenizer":{"pattern":"\\w+|\\s+","special_tokens":{"<s>":3},"ranks":"YQ== 0\nYg== 1\nYWI= 2\n",
              "chat_template":"{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}","bos_token":"<s>","eos_token":"</s>","add_bos":3}}}"#;
        let d = Descriptor::parse(body).unwrap().unwrap();
        assert_eq!(d.scratch_margin_bytes, 128);
        let c = crate::TokenCounter::new(&d.tokenizer).unwrap();
        let msgs = [crate::request::ChatMessage {
            role: "user".into(),
            content: "ab".into(),
            ..Default::default()
        }];
        assert_eq!(c.encode_chat(&msgs).unwrap(), vec![3, 2]);
        assert_eq!(c.count_chat(&msgs), 2);
        assert_eq!(c.encode_prompt("ab"), vec![3, 2]);
    }
}

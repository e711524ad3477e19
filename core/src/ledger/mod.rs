//! The KV ledger: capacity, committed bytes and the live leases.
//!
//! The ledger is a plain value. Every transition is a pure method; the filter runs one of them
//! inside a compare-and-swap on Envoy shared data (decode → transition → encode → CAS), so deciding
//! and reserving are one step that all workers see.
//!
//! Invariant, checked by `check()` and by the decoder: `committed == Σ lease.bytes`, and
//! `committed ≤ capacity` after every admission. (Lowering the capacity by reconfiguration can leave
//! `committed` above it until leases end; admissions are refused meanwhile.)
//!
//! It must never panic: it runs inside the proxy, where a panic kills the VM.
//!
//! Fair retries: worst-case pricing with reject-and-retry starves exactly the big promises (every
//! freed byte goes to whichever small request comes first). A refused request may leave a *claim*
//! (keyed by a hash of its caller and body, so its retry is recognised). Once its client has come
//! back (a refused retry: the claim is active), freed bytes are poured into active claims in
//! arrival order before anyone else can take them, and the claimant's retry can use what its
//! claim holds. A client that never retries never holds anything. A request that fits the pool alone is therefore admitted within the time
//! it takes the leases ahead of it to end, as long as its client keeps retrying; a claim whose
//! client does not come back by its expiry is dropped and its bytes return.

mod line;
mod prefix;
mod retry_after;

use line::line_has_room;
pub use line::{claim_key, Claim, ClaimTicket, MAX_CLAIMS};

use crate::retry::{RetryAfter, RetryAfterConfig};
pub use retry_after::estimate_retry_after;

/// One reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub id: u64,
    pub bytes: u64,
    pub class: String,
    pub priority: u8,
    pub created_ms: u64,
    /// The filter worker (wasm VM instance) whose request holds this lease; its heartbeat says
    /// whether the request can still end by itself.
    pub owner: u64,
    /// When it is expected to end, from the backend's report of its progress (0: unknown).
    /// Only Retry-After reads it.
    pub eta_ms: u64,
    /// What the backend held for it beyond `bytes` at the last report (an elastic sequence
    /// grown past its reservation; all a demoted lease holds): held back, and given back to
    /// admission when the lease is released (`Ledger::release`). Part of it may have been lent
    /// since (`admit_into_lent`, claims): Retry-After counts it as freed only up to what was
    /// not.
    pub held: u64,
    /// The key of the shared prompt prefix it starts with (0: none): agents of one swarm
    /// sending the same system prompt, which the backend holds once for all of them.
    pub prefix: u64,
    /// What it does not pay of that prefix because another live lease with the same key pays
    /// it (0: it pays its own). When the payer ends, the next one pays (`end_reservation`).
    pub credit: u64,
}

impl Lease {
    /// The lease a request is admitted under, as id `id`.
    fn of(req: &AdmitRequest<'_>, id: u64) -> Lease {
        Lease {
            id,
            bytes: req.bytes,
            class: req.class.to_string(),
            priority: req.priority,
            created_ms: req.now_ms,
            owner: req.owner,
            eta_ms: 0,
            held: 0,
            prefix: 0,
            credit: 0,
        }
    }
}

/// Running counters kept with the ledger, so every worker reports the same totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub admitted: u64,
    pub rejected: u64,
    pub released: u64,
    pub reaped: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    pub(crate) capacity: u64,
    pub(crate) committed: u64,
    pub(crate) next_id: u64,
    /// Exponentially weighted mean of lease lifetimes (ms); 0 until the first release.
    pub(crate) mean_lease_ms: u64,
    pub(crate) counters: Counters,
    /// Bytes the backend really uses beyond what this ledger has committed (negative drift, from
    /// the last reconciliation): held back from admission until it clears.
    pub(crate) held_back: u64,
    /// The part of `held_back` that elastic sequences hold past their reservations: blocks the
    /// backend takes back (preempting the borrower) when a reservation needs them; and of the
    /// room held for a preempted sequence to resume, what requests in line before it need
    /// (`reconcile`). Never lent to newcomers: requests in line take part of it (below), and
    /// a class that preempts may take all of it (`admit_into_lent`) rather than demote a lease.
    pub(crate) lendable: u64,
    /// Of `lendable`, what requests in line (claims) may still take until the next report sets
    /// it again (see `settle_claims`): the room held for a preempted sequence to resume, as far
    /// as requests in line before it need it. What an admission takes of it (its claim's part
    /// poured from it, `grant`) comes off, so the line takes at most what the report lent it
    /// in all between two reports, not that much at every pour.
    pub(crate) lendable_to_line: u64,
    /// Of the decoding leases' reservations, what they will never all hold at once (the
    /// time-aware worst case, [`crate::peak`]), from the last report: admitted on top of the
    /// capacity. Each end or demotion takes its lease's bytes off it until the next report
    /// sets it again (it may have been all slack), so it only ever errs low.
    pub(crate) slack: u64,
    pub(crate) leases: Vec<Lease>,
    /// Refused requests waiting for their retry, oldest first.
    pub(crate) claims: Vec<Claim>,
}

/// What one admission asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmitRequest<'a> {
    /// The lease id to use, chosen by the caller (the filter announces it before the body is
    /// read); `None` lets the ledger assign one.
    pub id: Option<u64>,
    pub bytes: u64,
    pub class: &'a str,
    pub priority: u8,
    pub now_ms: u64,
    /// The worker that will release it: the lease ends with its request, or when this worker
    /// is gone (its heartbeat stopped).
    pub owner: u64,
    /// Fair retries: the request's caller+body hash and how long a claim left by its refusal
    /// waits for the retry. `None`: no claim is used or left.
    pub claim: Option<ClaimTicket>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// Not enough free bytes now; retrying later can succeed.
    InsufficientCapacity,
    /// The request alone is larger than the usable capacity; retrying cannot help.
    ExceedsCapacity,
    /// The caller-chosen lease id is already live (a 2^-53 event with random ids).
    DuplicateId,
}

impl RejectReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::InsufficientCapacity => "insufficient_capacity",
            RejectReason::ExceedsCapacity => "exceeds_capacity",
            RejectReason::DuplicateId => "duplicate_id",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdmitOutcome {
    Admitted {
        lease: Lease,
    },
    Rejected {
        reason: RejectReason,
        need: u64,
        free: u64,
        retry_after: Option<RetryAfter>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseOutcome {
    Released(Lease),
    /// Already released, reaped, or never existed. Releasing twice is harmless.
    Unknown,
}

/// Green / amber / red, from the committed fraction of capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Green,
    Amber,
    Red,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Green => "green",
            Level::Amber => "amber",
            Level::Red => "red",
        }
    }
    /// 0, 1, 2: for a gauge.
    pub fn as_gauge(self) -> u64 {
        self as u64
    }
}

/// Fractions of capacity at which the level turns amber and red.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LevelThresholds {
    pub amber: f64,
    pub red: f64,
}

impl Default for LevelThresholds {
    fn default() -> Self {
        LevelThresholds {
            amber: 0.7,
            red: 0.9,
        }
    }
}

/// Weight of the newest sample in the lease-lifetime mean (1/8, as TCP's SRTT).
const MEAN_SHIFT: u32 = 3;

impl Ledger {
    /// An empty ledger. `first_id` seeds lease ids (pick it at random per gateway so ids from
    /// several gateways in front of one backend do not collide).
    pub fn new(capacity: u64, first_id: u64) -> Self {
        Ledger {
            capacity,
            committed: 0,
            next_id: first_id.max(1),
            mean_lease_ms: 0,
            counters: Counters::default(),
            held_back: 0,
            slack: 0,
            lendable: 0,
            lendable_to_line: 0,
            leases: Vec::new(),
            claims: Vec::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }
    pub fn committed(&self) -> u64 {
        self.committed
    }
    /// What a request without a claim may still reserve: capacity less committed, less the
    /// bytes held back for negative drift, less what claims hold for waiting requests.
    pub fn free(&self) -> u64 {
        self.unclaimed().saturating_sub(self.claimed())
    }

    /// Capacity less committed and held back (claims included).
    pub(crate) fn unclaimed(&self) -> u64 {
        self.unclaimed_at(self.committed)
    }

    /// `unclaimed` were `committed` bytes committed.
    fn unclaimed_at(&self, committed: u64) -> u64 {
        self.admits()
            .saturating_sub(committed)
            .saturating_sub(self.held_back)
    }

    /// Bytes set aside for claims.
    pub fn claimed(&self) -> u64 {
        self.claims
            .iter()
            .map(|c| c.held)
            .fold(0, u64::saturating_add)
    }

    /// Add another ledger's totals, leases and claims to this one: the summary of a fleet's
    /// ledgers for the status document (never stored, never decided on).
    pub fn absorb(&mut self, o: &Ledger) {
        self.capacity = self.capacity.saturating_add(o.capacity);
        self.committed = self.committed.saturating_add(o.committed);
        self.held_back = self.held_back.saturating_add(o.held_back);
        self.slack = self.slack.saturating_add(o.slack);
        self.lendable = self.lendable.saturating_add(o.lendable);
        self.lendable_to_line = self.lendable_to_line.saturating_add(o.lendable_to_line);
        self.mean_lease_ms = self.mean_lease_ms.max(o.mean_lease_ms);
        let (a, b) = (&mut self.counters, o.counters);
        a.admitted = a.admitted.saturating_add(b.admitted);
        a.rejected = a.rejected.saturating_add(b.rejected);
        a.released = a.released.saturating_add(b.released);
        a.reaped = a.reaped.saturating_add(b.reaped);
        self.leases.extend(o.leases.iter().cloned());
        self.claims.extend(o.claims.iter().cloned());
    }

    /// Shadow mode: reserve whatever the decision was, past the capacity if need be (the request
    /// goes through; the ledger must show what the backend really holds). An id already live
    /// (or none) records nothing and returns false: that lease is another request's, and this
    /// one must not end it.
    #[must_use]
    pub fn record(&mut self, req: &AdmitRequest<'_>) -> bool {
        let Some(id) = req.id.filter(|id| *id != 0 && self.lease(*id).is_none()) else {
            return false;
        };
        self.committed = self.committed.saturating_add(req.bytes);
        self.counters.admitted = self.counters.admitted.saturating_add(1);
        self.leases.push(Lease::of(req, id));
        true
    }

    /// Record when a lease is expected to end (the backend's report of its progress).
    pub fn set_eta(&mut self, id: u64, eta_ms: u64) {
        if let Some(l) = self.leases.iter_mut().find(|l| l.id == id) {
            l.eta_ms = eta_ms;
        }
    }

    /// Set the expected end of every lease that `eta(id)` knows, in one pass.
    pub fn set_etas(&mut self, eta: impl Fn(u64) -> Option<u64>) {
        for l in &mut self.leases {
            if let Some(e) = eta(l.id) {
                l.eta_ms = e;
            }
        }
    }

    /// Set every lease's `held` (what the backend holds for it beyond its reservation) from a
    /// report: `held(id)`.
    pub fn set_held(&mut self, held: impl Fn(u64) -> u64) {
        for l in &mut self.leases {
            l.held = held(l.id);
        }
    }

    /// Drop expired claims, and those of requests larger than the capacity (it was lowered
    /// since their refusal: they can never be admitted, and the oldest would otherwise hold all
    /// that frees until it expired). Then set bytes aside for the active claims, oldest first:
    /// each takes what it needs from what is not committed, until nothing is left. Recomputed
    /// from scratch at every transition, so only one claim is ever partly served and all
    /// younger ones hold nothing: an older claim that becomes active takes precedence over
    /// younger ones, and no two claims can each hold part of what the other needs (which would
    /// deadlock the line).
    ///
    /// Once what is not committed has run out, the claims also take the room held for a
    /// preempted sequence to resume, as far as the requests that were in line before it was
    /// admitted need it (`lendable_to_line`, from `reconcile`): they are served ahead of it, as
    /// they would have been had it not grown. Without that, a request in line waits behind
    /// sequences admitted after it for as long as they take turns outgrowing the pool.
    ///
    /// Not what elastic sequences have borrowed past their reservations: the backend would
    /// give it back by preempting the borrowers, and under sustained load they outgrow the pool
    /// again at once, so the line would keep them recomputing (in the simulator at GPU scale,
    /// 4.8–5.6× the recomputed tokens and 0.77–0.91× the goodput: docs/design/
    /// 003-the-line-is-not-lent-borrowed-growth.md). A request in line waits for the borrowers to end instead: once
    /// its client is back, nobody is admitted past it but backfills and classes that preempt,
    /// so they are a finite set, each done within its cap's decode time.
    /// Spare bytes are poured before lent ones, so `free()` (what is unclaimed less what claims
    /// hold) counts none of the lent bytes as taken from the spare. What is lent to the line
    /// is poured within what it may still take (`lendable_to_line`, lowered by each admission
    /// that takes part of it), so the line never takes borrowed growth by refilling claims
    /// behind each admitted one.
    pub(crate) fn settle_claims(&mut self, now_ms: u64) {
        let capacity = self.capacity;
        self.claims
            .retain(|c| c.expires_ms > now_ms && c.bytes <= capacity);
        self.pour_claims();
    }

    pub fn held_back(&self) -> u64 {
        self.held_back
    }
    /// What the live leases hold past their reservations (growth, all a demoted lease holds,
    /// rounding) as of the last report, within what is held back: freed only as they end.
    pub(crate) fn held_by_leases(&self) -> u64 {
        self.leases
            .iter()
            .map(|l| l.held)
            .fold(0, u64::saturating_add)
            .min(self.held_back)
    }
    /// Hold back `bytes` from admission (the backend uses that much more than the ledger knows).
    pub fn set_held_back(&mut self, bytes: u64) {
        self.held_back = bytes;
        self.set_lendable(self.lendable);
    }
    /// Of the bytes held back, how many may be lent (borrowed growth the backend gives back on
    /// demand, and resume room lent to requests older than the resume); at most what is held
    /// back.
    pub fn set_lendable(&mut self, bytes: u64) {
        self.lendable = bytes.min(self.held_back);
        self.lendable_to_line = self.lendable_to_line.min(self.lendable);
    }
    pub fn lendable(&self) -> u64 {
        self.lendable
    }
    /// Of what may be lent, how much requests in line may take until it is set again (see
    /// `settle_claims`); at most what may be lent.
    pub fn set_lendable_to_line(&mut self, bytes: u64) {
        self.lendable_to_line = bytes.min(self.lendable);
    }
    pub fn lendable_to_line(&self) -> u64 {
        self.lendable_to_line
    }
    /// The distinct owners of live leases (0 excluded), in first-seen order.
    pub fn owners(&self) -> Vec<u64> {
        let mut out: Vec<u64> = Vec::new();
        for l in &self.leases {
            if l.owner != 0 && !out.contains(&l.owner) {
                out.push(l.owner);
            }
        }
        out
    }
    pub fn leases(&self) -> &[Lease] {
        &self.leases
    }
    pub fn counters(&self) -> Counters {
        self.counters
    }
    pub fn mean_lease_ms(&self) -> u64 {
        self.mean_lease_ms
    }
    pub fn lease(&self, id: u64) -> Option<&Lease> {
        self.leases.iter().find(|l| l.id == id)
    }

    /// What admissions may commit: the capacity, plus what the decoding leases will never all
    /// hold at once ([`Ledger::set_slack`]).
    pub fn admits(&self) -> u64 {
        self.capacity.saturating_add(self.slack)
    }
    pub fn slack(&self) -> u64 {
        self.slack
    }
    /// From a report: of the reservations of this ledger's leases that are decoding, what they
    /// will never all hold at once (their reservations less their [`crate::peak::peak`]); at
    /// most what they reserve here.
    pub fn set_slack(&mut self, bytes: u64) {
        self.slack = bytes.min(self.committed);
    }

    /// Reconfiguration: a new capacity applies to future admissions; live leases are kept.
    pub fn set_capacity(&mut self, capacity: u64) {
        self.capacity = capacity;
    }

    /// Decide and reserve in one step.
    pub fn try_admit(
        &mut self,
        req: &AdmitRequest<'_>,
        retry: &RetryAfterConfig,
        jitter_seed: u64,
    ) -> AdmitOutcome {
        // A request whose claim is waiting has come back: its claim is active from now on, and
        // takes its place in line before anything is set aside.
        if let Some(t) = req.claim {
            if let Some(c) = self.claims.iter_mut().find(|c| c.key == t.key) {
                c.active = true;
            }
        }
        self.settle_claims(req.now_ms);
        self.admit(req, retry, jitter_seed)
    }

    fn admit(
        &mut self,
        req: &AdmitRequest<'_>,
        retry: &RetryAfterConfig,
        jitter_seed: u64,
    ) -> AdmitOutcome {
        // A retry whose claim is waiting may use what the claim holds.
        let own = req
            .claim
            .and_then(|t| self.claims.iter().position(|c| c.key == t.key));
        let own_held = own.and_then(|i| self.claims.get(i)).map_or(0, |c| c.held);
        let free = self.free().saturating_add(own_held);
        if req.id.is_some_and(|id| id == 0 || self.lease(id).is_some()) {
            return AdmitOutcome::Rejected {
                reason: RejectReason::DuplicateId,
                need: req.bytes,
                free,
                retry_after: None,
            };
        }
        if req.bytes > self.capacity {
            self.counters.rejected = self.counters.rejected.saturating_add(1);
            // It can never fit (the capacity was lowered since its place in line was taken,
            // or it was priced larger since): its place goes, and what it held goes to the
            // places behind it.
            if let Some(i) = own {
                self.claims.remove(i);
                self.settle_claims(req.now_ms);
            }
            return AdmitOutcome::Rejected {
                reason: RejectReason::ExceedsCapacity,
                need: req.bytes,
                free,
                retry_after: None,
            };
        }
        if req.bytes > free {
            let before_own = own.unwrap_or(self.claims.len());
            if let Some(lease) = self.backfill(req, own, |i| i < before_own, retry) {
                return AdmitOutcome::Admitted { lease };
            }
            self.counters.rejected = self.counters.rejected.saturating_add(1);
            // What its claim already holds for it is not waited for: a request near the head of
            // the line is told to come back as soon as the rest is likely free (bytes set aside
            // for it sit idle until it does). What the claims ahead of it still lack is waited
            // for: freed bytes go to them first (a request not in line yet joins at the end).
            let ahead = self
                .claims
                .iter()
                .take(own.unwrap_or(self.claims.len()))
                .map(|c| c.bytes.saturating_sub(c.held))
                .fold(0, u64::saturating_add);
            let retry_after = estimate_retry_after(
                self,
                req.bytes.saturating_sub(own_held).saturating_add(ahead),
                req.now_ms,
                retry,
                jitter_seed,
            );
            if let Some(t) = req.claim {
                // Keep (or take) this request's place in line until a little (the patience)
                // after it was told to come back. Not longer: what is set aside for a client
                // that gave up sits idle, nobody else may take it, until then.
                let expires_ms = req
                    .now_ms
                    .saturating_add(retry_after.ms)
                    .saturating_add(t.patience_ms);
                let (count, active_need) = (self.claims.len(), self.active_need());
                match own.and_then(|i| self.claims.get_mut(i)) {
                    Some(c) => {
                        c.bytes = req.bytes;
                        c.held = c.held.min(req.bytes);
                        c.expires_ms = expires_ms;
                        c.active = true;
                        c.waits = t.waits;
                    }
                    None if count < MAX_CLAIMS && line_has_room(self.capacity, active_need, t) => {
                        self.claims.push(Claim {
                            key: t.key,
                            bytes: req.bytes,
                            held: 0,
                            first_ms: req.now_ms,
                            expires_ms,
                            active: false,
                            waits: t.waits,
                        })
                    }
                    None => {}
                }
                self.settle_claims(req.now_ms);
            }
            return AdmitOutcome::Rejected {
                reason: RejectReason::InsufficientCapacity,
                need: req.bytes,
                free,
                retry_after: Some(retry_after),
            };
        }
        // bytes ≤ free ≤ capacity − committed (what a claim holds comes from what is not
        // committed, or from lent bytes, which are part of held back).
        AdmitOutcome::Admitted {
            lease: self.grant(req, own),
        }
    }

    /// Backfill: admit `req`, which does not fit beside what the line ahead of it holds, into
    /// those bytes when it is expected to be done before anyone ahead of it in line could start
    /// anyway (as in a batch scheduler's EASY backfilling). Without it a front that needs most
    /// of the pool leaves what is free idle, and everyone behind it waiting, until enough
    /// leases end; with it, what is free runs requests that are done by then. Only spare bytes
    /// are taken, never lent ones. The lease starts with that expected end (`eta_ms`), so the
    /// next decision counts it as freeing its bytes then; the backend's reports refine it.
    /// `ahead`: the claims it must not delay (those before its own place in line, or all but
    /// its own for [`Ledger::try_backfill`]).
    fn backfill(
        &mut self,
        req: &AdmitRequest<'_>,
        own: Option<usize>,
        ahead: impl Fn(usize) -> bool,
        retry: &RetryAfterConfig,
    ) -> Option<Lease> {
        let t = req.claim?;
        if t.run_ms == 0 || req.bytes > self.unclaimed() {
            return None;
        }
        if !self.delays_nobody(&ahead, req.bytes, t, req.now_ms, retry) {
            return None;
        }
        // bytes ≤ unclaimed ≤ capacity − committed: committed stays within the capacity.
        let mut lease = self.grant(req, own);
        lease.eta_ms = req.now_ms.saturating_add(t.run_ms);
        self.set_eta(lease.id, lease.eta_ms);
        // What the claims hold came from the bytes it took: pour again from what is left.
        self.settle_claims(req.now_ms);
        Some(lease)
    }

    /// Whether `bytes` held for `t.run_ms` from now leave every claim `ahead` (by index) to
    /// start when it could have without them: each is done with by then, or there is still
    /// room for it then beside them (as EASY backfilling's "extra" nodes). `false` when there
    /// is no claim ahead: a backfill goes ahead of someone.
    ///
    /// When a claim could start, a lower bound: not before what is not committed now (as if
    /// what is held back cleared at once, but for what leases hold past their reservations:
    /// an elastic sequence's growth, which the line does not take back, frees when its lease
    /// ends), plus what the live leases free as they are expected to end (their reservations
    /// and that growth, in the Retry-After estimate's order), covers its need and that of the
    /// active claims before it (served first; past what the live leases hold, not before they
    /// have all ended), and not before its client is back: a claim whose client has not come
    /// back yet was told to retry no earlier than its expiry less the patience.
    fn delays_nobody(
        &self,
        ahead: &impl Fn(usize) -> bool,
        bytes: u64,
        t: ClaimTicket,
        now_ms: u64,
        retry: &RetryAfterConfig,
    ) -> bool {
        let uncommitted = self
            .admits()
            .saturating_sub(self.committed)
            .saturating_sub(self.held_by_leases());
        let ends =
            retry_after::expected_ends(self, now_ms, retry, |l| l.bytes.saturating_add(l.held));
        let freed_by = |at: u64| {
            ends.iter()
                .take_while(|(wait, _)| *wait <= at)
                .map(|(_, b)| *b)
                .fold(0, u64::saturating_add)
        };
        let mut served_first: u64 = 0;
        let mut any = false;
        for (i, c) in self.claims.iter().enumerate() {
            if c.expires_ms <= now_ms {
                continue; // dropped at the next transition
            }
            let need = served_first.saturating_add(c.bytes);
            if c.active {
                served_first = need;
            }
            if !ahead(i) {
                continue;
            }
            any = true;
            let fits_ms = match need.checked_sub(uncommitted).filter(|s| *s > 0) {
                None => 0,
                Some(short) => crate::retry::wait_for(ends.iter().copied(), short)
                    .unwrap_or_else(|| ends.last().map_or(0, |(wait, _)| *wait)),
            };
            // A client sent away is back no earlier than it was told, whether or not it has
            // come back before (each refusal tells it again); one waiting here is back now.
            let back_ms = match c.waits {
                true => 0,
                false => c
                    .expires_ms
                    .saturating_sub(t.patience_ms)
                    .saturating_sub(now_ms),
            };
            let start_ms = fits_ms.max(back_ms);
            let done_by_then = t.run_ms <= start_ms;
            // Beside the claim at the most it may grow to: what an elastic backfill grows past
            // its reservation, the line does not take back.
            let room_beside = need.saturating_add(bytes.max(t.grows_to))
                <= uncommitted.saturating_add(freed_by(start_ms));
            if !(done_by_then || room_beside) {
                return false;
            }
        }
        any
    }

    /// Only a backfill (see `backfill`), for a request waiting somewhere else (a gateway
    /// queue) that must not pass anyone in line by any other rule: ahead of it are all the
    /// claims but its own, which is neither activated nor served first, and a refusal changes
    /// nothing (no claim is left or refreshed, no refusal counted). Admitted, its own claim is
    /// spent.
    pub fn try_backfill(
        &mut self,
        req: &AdmitRequest<'_>,
        retry: &RetryAfterConfig,
    ) -> Option<Lease> {
        if req.id.is_some_and(|id| id == 0 || self.lease(id).is_some()) {
            return None;
        }
        // Nothing is changed until it is admitted: the check reads no claim's holdings and
        // passes over expired claims, and the grant settles the claims afterwards.
        let own = req
            .claim
            .and_then(|t| self.claims.iter().position(|c| c.key == t.key));
        self.backfill(req, own, |i| Some(i) != own, retry)
    }

    /// Reserve for `req`, whose bytes the caller found room for (within capacity − committed):
    /// its claim (`own`, if any) is spent, what it held being part of that room. What it takes
    /// of what was lent to the line (its claim's lent part, as far as it goes past the room
    /// not held back) is no longer the line's to take until the next report.
    fn grant(&mut self, req: &AdmitRequest<'_>, own: Option<usize>) -> Lease {
        if let Some(i) = own {
            let lent = self
                .lent_to_claim(i)
                .min(req.bytes.saturating_sub(self.unclaimed()));
            self.lendable_to_line = self.lendable_to_line.saturating_sub(lent);
            self.claims.remove(i);
        }
        let id = self.take_id(req.id);
        let lease = Lease::of(req, id);
        self.committed = self.committed.saturating_add(req.bytes);
        self.counters.admitted = self.counters.admitted.saturating_add(1);
        self.leases.push(lease.clone());
        lease
    }

    /// Of what is lendable, what may still be lent now. The rest of held back (block rounding,
    /// use nobody reported, other gateways' share) can never be given back, so it stays out of
    /// reach: what is poured into claims (the spare, then this) never goes past the capacity
    /// less committed less that firm part. Held back may be more than is left uncommitted
    /// (right after lent bytes were admitted, until the next poll or the borrower's release),
    /// and what was lent since the poll is then no longer lendable.
    pub(crate) fn lendable_now(&self) -> u64 {
        self.lendable_now_at(self.committed)
    }

    /// The id a new lease gets: the caller's, or the next one.
    fn take_id(&mut self, chosen: Option<u64>) -> u64 {
        chosen.unwrap_or_else(|| {
            let id = self.next_id;
            // Ids wrap only after 2^64 admissions; skip 0, which means "no lease".
            self.next_id = self.next_id.wrapping_add(1).max(1);
            id
        })
    }

    /// Release a lease by id. Idempotent: an unknown id changes nothing and says so.
    pub fn release(&mut self, id: u64, now_ms: u64) -> ReleaseOutcome {
        let Some(lease) = self.take(id) else {
            return ReleaseOutcome::Unknown;
        };
        // What the backend held for it past its reservation at the last report (growth, or all
        // a demoted lease holds) is held back, and frees with it: the backend gives a
        // sequence's blocks back before its stream ends. Held back since that report, its
        // growth went to nobody else: a reservation lent it since took it back from the
        // borrower (preempted, holding nothing past its reservation), so held back was already
        // that much above what the backend holds, and less what it frees stays as accurate as
        // the report. Not lendable any more either (borrowed growth never is firm, so this
        // errs towards lending less when the lease's part was firm: block rounding). What is
        // lent to the line (resume room, in no lease's `held`) stays, within what is left.
        self.give_back_held(lease.held);
        self.counters.released = self.counters.released.saturating_add(1);
        self.observe_lifetime(now_ms.saturating_sub(lease.created_ms));
        ReleaseOutcome::Released(lease)
    }

    /// A lease that held `held` past its reservation at the last report has ended: that much
    /// held back, and lendable, frees with it (see [`Ledger::release`]). What is lent to the
    /// line stays, within what is left.
    fn give_back_held(&mut self, held: u64) {
        let to_line = self.lendable_to_line;
        self.set_lendable(self.lendable.saturating_sub(held));
        self.set_held_back(self.held_back.saturating_sub(held));
        self.set_lendable_to_line(to_line);
    }

    /// Reclaim the leases whose request can no longer end by itself: those whose owner is gone
    /// (`owner_alive` says no), and those without one. A live owner's lease is never reclaimed,
    /// however old: it ends when its request ends. What the backend held for a reclaimed lease past its reservation
    /// is given back with it, as on a release.
    pub fn reap(&mut self, now_ms: u64, owner_alive: impl Fn(u64) -> bool) -> Vec<Lease> {
        let mut reaped = Vec::new();
        let mut i = 0;
        while i < self.leases.len() {
            // Owner 0: none (a lease a version-7 ledger kept from before owners): only the
            // reaper can end it.
            let orphaned = self
                .leases
                .get(i)
                .is_some_and(|l| l.owner == 0 || !owner_alive(l.owner));
            if orphaned {
                let lease = self.leases.swap_remove(i);
                self.end_reservation(&lease);
                self.give_back_held(lease.held);
                reaped.push(lease);
            } else {
                i += 1;
            }
        }
        self.counters.reaped = self.counters.reaped.saturating_add(reaped.len() as u64);
        // Places in line whose clients stopped retrying give their bytes back too.
        self.settle_claims(now_ms);
        reaped
    }

    /// Demote a lease to make room for a higher class (preemption): it stays, reserving
    /// nothing, until its request ends (released then, like any lease). Its request goes on at
    /// the backend in borrowed blocks, which the backend takes back (recomputing it later) when
    /// a reservation needs them. So its bytes become borrowed growth until the next report
    /// says what it really holds (or its release gives them back): held back and lendable —
    /// room for the request that demoted it (`admit_into_lent`), not for requests in line or a
    /// newcomer. Returns the lease as it was; `None` (nothing changed) for an unknown id
    /// or a lease already reserving nothing.
    pub fn demote(&mut self, id: u64) -> Option<Lease> {
        let lease = self.leases.iter_mut().find(|l| l.id == id && l.bytes > 0)?;
        let was = lease.clone();
        lease.bytes = 0;
        lease.held = lease.held.saturating_add(was.bytes);
        // Reserving nothing, it shares no prefix charge any more.
        lease.prefix = 0;
        lease.credit = 0;
        let slack = self.slack;
        self.end_reservation(&was);
        self.held_back = self.held_back.saturating_add(was.bytes);
        self.lendable = self.lendable.saturating_add(was.bytes);
        if self.slack < slack {
            // Its bytes may have been all slack: room the claims held is gone.
            self.pour_claims();
        }
        Some(was)
    }

    /// Undo [`Ledger::demote`] for a demotion the backend did not confirm: its sequence may
    /// still hold its reservation there, so the lease reserves `bytes` (what it reserved
    /// before) again, within the capacity. What it held past its reservation as of the last
    /// report (all it held, if the report came after the demotion) stops being held back as
    /// far as the reservation covers it. Returns the bytes reserved again: 0 for an unknown id
    /// or a lease that reserves something already.
    pub fn undemote(&mut self, id: u64, bytes: u64, now_ms: u64) -> u64 {
        let room = self.admits().saturating_sub(self.committed);
        let Some(lease) = self.leases.iter_mut().find(|l| l.id == id && l.bytes == 0) else {
            return 0;
        };
        let back = bytes.min(room);
        let from_held = back.min(lease.held);
        lease.bytes = back;
        lease.held -= from_held;
        self.committed = self.committed.saturating_add(back);
        self.set_held_back(self.held_back.saturating_sub(from_held));
        self.settle_claims(now_ms);
        back
    }

    /// Remove a lease and give its bytes back.
    fn take(&mut self, id: u64) -> Option<Lease> {
        let pos = self.leases.iter().position(|l| l.id == id)?;
        let lease = self.leases.swap_remove(pos);
        self.end_reservation(&lease);
        Some(lease)
    }

    pub fn level(&self, t: &LevelThresholds) -> Level {
        if self.capacity == 0 {
            return Level::Red;
        }
        let used = self
            .committed
            .saturating_add(self.held_back)
            .saturating_add(self.claimed()) as f64
            / self.admits() as f64;
        if used >= t.red {
            Level::Red
        } else if used >= t.amber {
            Level::Amber
        } else {
            Level::Green
        }
    }

    /// Undo one rejection count (a degrade retry that replaces the first attempt).
    pub fn uncount_rejection(&mut self) {
        self.counters.rejected = self.counters.rejected.saturating_sub(1);
    }

    fn observe_lifetime(&mut self, ms: u64) {
        self.mean_lease_ms = if self.mean_lease_ms == 0 {
            ms.max(1)
        } else {
            // mean += (sample − mean) / 8, in signed arithmetic widened to avoid overflow.
            let m = i128::from(self.mean_lease_ms);
            let next = m + ((i128::from(ms) - m) >> MEAN_SHIFT);
            u64::try_from(next.max(1)).unwrap_or(u64::MAX)
        };
    }

    /// Verify the invariant `committed == Σ lease.bytes` (and ids unique).
    pub fn check(&self) -> Result<(), String> {
        let mut sum: u64 = 0;
        for l in &self.leases {
            sum = sum
                .checked_add(l.bytes)
                .ok_or_else(|| "lease bytes overflow u64".to_string())?;
        }
        if sum != self.committed {
            return Err(format!(
                "committed {} != sum of lease bytes {}",
                self.committed, sum
            ));
        }
        if self.claims.iter().any(|c| c.held > c.bytes) {
            return Err("a claim holds more than it needs".to_string());
        }
        if self.slack > self.committed {
            return Err("more slack than committed".to_string());
        }
        if self.lendable > self.held_back {
            return Err("more lendable than held back".to_string());
        }
        if self.lendable_to_line > self.lendable {
            return Err("more lendable to the line than lendable".to_string());
        }
        // A lease excused its prefix has a live lease paying it (checked on every decode: no
        // set is built unless some lease is excused).
        if self.leases.iter().any(|l| l.credit > 0) {
            let payers: std::collections::HashSet<u64> = self
                .leases
                .iter()
                .filter(|l| l.prefix != 0 && l.credit == 0 && l.bytes > 0)
                .map(|l| l.prefix)
                .collect();
            if self
                .leases
                .iter()
                .any(|l| l.credit > 0 && (l.prefix == 0 || !payers.contains(&l.prefix)))
            {
                return Err("a lease excused its prefix with no lease paying it".to_string());
            }
        }
        let mut ids: Vec<u64> = self.leases.iter().map(|l| l.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w.first() == w.get(1)) {
            return Err("duplicate lease id".to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn retry() -> RetryAfterConfig {
        RetryAfterConfig::default()
    }

    /// Retry-After without jitter, bounds wide enough that the estimate shows as it is.
    fn exact_retry() -> RetryAfterConfig {
        RetryAfterConfig {
            min_ms: 100,
            max_ms: 60_000,
            jitter: 0.0,
            default_lease_ms: 10_000,
        }
    }

    /// A request that keeps its place in line (key `key`) and is expected to run `run_ms`.
    fn keyed(bytes: u64, key: u64, run_ms: u64, now_ms: u64) -> AdmitRequest<'static> {
        AdmitRequest {
            claim: Some(ClaimTicket {
                key,
                patience_ms: 60_000,
                run_ms,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(bytes, now_ms)
        }
    }

    /// Refuse `at(now)` at 0 and 1 ms: the second refusal makes its place in line active, so
    /// it holds what is spare.
    fn refused_twice(
        l: &mut Ledger,
        cfg: &RetryAfterConfig,
        at: impl Fn(u64) -> AdmitRequest<'static>,
    ) {
        for now in [0, 1] {
            assert!(matches!(
                l.try_admit(&at(now), cfg, 1),
                AdmitOutcome::Rejected { .. }
            ));
        }
    }

    /// [`keyed`], for a request that waits in a gateway's queue when refused.
    fn queued(bytes: u64, key: u64, run_ms: u64, now_ms: u64) -> AdmitRequest<'static> {
        let mut r = keyed(bytes, key, run_ms, now_ms);
        r.claim = r.claim.map(|t| ClaimTicket { waits: true, ..t });
        r
    }

    /// Admit a lease of `bytes` at 0 that is expected to end at `eta_ms`; its id.
    fn lease_ending_at(l: &mut Ledger, bytes: u64, eta_ms: u64) -> u64 {
        let AdmitOutcome::Admitted { lease } = l.try_admit(&req(bytes, 0), &exact_retry(), 1)
        else {
            panic!("fits");
        };
        l.set_eta(lease.id, eta_ms);
        lease.id
    }

    fn req(bytes: u64, now_ms: u64) -> AdmitRequest<'static> {
        AdmitRequest {
            id: None,
            bytes,
            class: "default",
            priority: 0,
            now_ms,
            owner: 1,
            claim: None,
        }
    }

    #[test]
    fn admit_until_full_then_reject_then_release_frees() {
        let mut l = Ledger::new(100, 1);
        let AdmitOutcome::Admitted { lease: a } = l.try_admit(&req(60, 0), &retry(), 1) else {
            panic!("first admission must fit");
        };
        assert_eq!(l.committed(), 60);
        match l.try_admit(&req(50, 1), &retry(), 1) {
            AdmitOutcome::Rejected {
                reason: RejectReason::InsufficientCapacity,
                need: 50,
                free: 40,
                retry_after: Some(r),
            } => assert!(r.ms >= retry().min_ms),
            other => panic!("expected rejection, got {other:?}"),
        }
        assert_eq!(l.committed(), 60, "a rejection reserves nothing");
        assert!(matches!(l.release(a.id, 10), ReleaseOutcome::Released(_)));
        assert_eq!(l.committed(), 0);
        assert_eq!(l.release(a.id, 11), ReleaseOutcome::Unknown, "idempotent");
        assert_eq!(l.counters().released, 1);
        assert!(matches!(
            l.try_admit(&req(50, 12), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
    }

    #[test]
    fn a_demoted_lease_frees_its_bytes_at_once_and_ends_with_its_request() {
        let mut l = Ledger::new(100, 1);
        let AdmitOutcome::Admitted { lease: a } = l.try_admit(&req(60, 0), &retry(), 1) else {
            panic!("first admission must fit");
        };
        let was = l.demote(a.id).expect("a live lease");
        assert_eq!(was.bytes, 60, "returned as it was");
        assert_eq!(l.committed(), 0);
        assert_eq!(
            l.lease(a.id).map(|x| (x.bytes, x.held)),
            Some((0, 60)),
            "kept, reserving nothing, what it held held back with it"
        );
        assert_eq!(l.demote(a.id), None, "a demoted lease frees nothing more");
        assert_eq!(l.demote(99), None);
        // Its sequence still holds its blocks at the backend until the next report: borrowed,
        // so not room for a newcomer, but for the request that demoted it.
        assert_eq!((l.held_back(), l.lendable()), (60, 60));
        assert_eq!(l.free(), 40);
        assert!(matches!(
            l.try_admit(&req(100, 1), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        l.uncount_rejection();
        assert!(l.admit_into_lent(&req(100, 1)).is_some());
        l.check().unwrap();
        // Its request ends: released like any lease, once.
        assert!(matches!(l.release(a.id, 10), ReleaseOutcome::Released(x) if x.bytes == 0));
        assert_eq!(l.committed(), 100);
        assert_eq!(l.release(a.id, 11), ReleaseOutcome::Unknown);
        l.check().unwrap();
    }

    #[test]
    fn a_demotion_the_backend_did_not_confirm_is_undone() {
        let mut l = Ledger::new(100, 1);
        let AdmitOutcome::Admitted { lease: a } = l.try_admit(&req(60, 0), &retry(), 1) else {
            panic!("first admission must fit");
        };
        let was = l.demote(a.id).expect("a live lease");
        let b = l.admit_into_lent(&req(90, 1)).expect("the preemptor");
        // The backend did not confirm: the preemptor goes, the victim reserves its bytes again.
        assert!(matches!(l.release(b.id, 2), ReleaseOutcome::Released(_)));
        assert_eq!(l.undemote(a.id, was.bytes, 5), 60);
        assert_eq!(l.lease(a.id).map(|x| (x.bytes, x.held)), Some((60, 0)));
        assert_eq!((l.committed(), l.held_back(), l.lendable()), (60, 0, 0));
        assert_eq!(l.free(), 40);
        assert_eq!(l.undemote(a.id, was.bytes, 5), 0, "once");
        assert_eq!(l.undemote(99, 10, 5), 0);
        l.check().unwrap();
        // A report came between: it says what the demoted lease holds (30 of its 60, its
        // blocks taken lazily). Reserved again whole, it holds nothing past that.
        l.demote(a.id).expect("live");
        l.set_held(|x| if x == a.id { 30 } else { 0 });
        l.set_held_back(30);
        assert_eq!(l.undemote(a.id, was.bytes, 6), 60);
        assert_eq!(l.lease(a.id).map(|x| (x.bytes, x.held)), Some((60, 0)));
        assert_eq!((l.committed(), l.held_back(), l.free()), (60, 0, 40));
        l.check().unwrap();
        // Within the capacity: what does not fit stays held back.
        l.demote(a.id).expect("live");
        assert!(matches!(
            l.try_admit(&req(40, 3), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert!(l.admit_into_lent(&req(50, 4)).is_some());
        assert_eq!(l.undemote(a.id, was.bytes, 5), 10);
        assert_eq!(l.lease(a.id).map(|x| (x.bytes, x.held)), Some((10, 50)));
        assert_eq!((l.committed(), l.held_back()), (100, 50));
        l.check().unwrap();
    }

    #[test]
    fn larger_than_capacity_never_fits() {
        let mut l = Ledger::new(100, 1);
        assert!(matches!(
            l.try_admit(&req(101, 0), &retry(), 1),
            AdmitOutcome::Rejected {
                reason: RejectReason::ExceedsCapacity,
                retry_after: None,
                ..
            }
        ));
    }

    #[test]
    fn caller_chosen_ids_must_be_unique() {
        let mut l = Ledger::new(100, 1);
        let r = AdmitRequest {
            id: Some(77),
            ..req(10, 0)
        };
        assert!(
            matches!(l.try_admit(&r, &retry(), 1), AdmitOutcome::Admitted { lease } if lease.id == 77)
        );
        assert!(matches!(
            l.try_admit(&r, &retry(), 1),
            AdmitOutcome::Rejected {
                reason: RejectReason::DuplicateId,
                ..
            }
        ));
        let zero = AdmitRequest {
            id: Some(0),
            ..req(10, 0)
        };
        assert!(matches!(
            l.try_admit(&zero, &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!(l.committed(), 10);
    }

    #[test]
    fn a_live_owners_lease_is_never_reaped_however_old_and_an_orphan_is() {
        let mut l = Ledger::new(1000, 1);
        let owned = |owner, now| AdmitRequest {
            owner,
            ..req(100, now)
        };
        l.try_admit(&owned(7, 0), &retry(), 1);
        l.try_admit(&owned(8, 0), &retry(), 1);
        assert_eq!(l.owners(), vec![7, 8]);
        // However old: nothing goes while both owners live.
        assert!(l.reap(1_000_000, |_| true).is_empty());
        assert_eq!(l.committed(), 200);
        // Owner 8 is gone: its lease is reclaimed, owner 7's stays.
        let r = l.reap(1_000_001, |o| o == 7);
        assert_eq!(r.iter().map(|x| x.owner).collect::<Vec<_>>(), vec![8]);
        assert_eq!(l.committed(), 100);
        assert_eq!(l.counters().reaped, 1);
    }

    #[test]
    fn a_refused_big_request_keeps_its_place_and_is_not_starved_by_small_ones() {
        let mut l = Ledger::new(100, 1);
        let small = |now| req(20, now);
        let big = |now| AdmitRequest {
            claim: Some(ClaimTicket {
                key: 42,
                patience_ms: 1000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(90, now)
        };
        // Four small leases hold 80 of 100.
        let mut ids = Vec::new();
        for t in 0..4 {
            let AdmitOutcome::Admitted { lease } = l.try_admit(&small(t), &retry(), 1) else {
                panic!("small fits");
            };
            ids.push(lease.id);
        }
        // The big one is refused and leaves a claim, which holds nothing until it retries.
        assert!(matches!(
            l.try_admit(&big(10), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!(l.claims().len(), 1);
        assert_eq!(l.claimed(), 0);
        assert_eq!(l.free(), 20);
        // Refused again (its client came back): the claim is active and the free 20 go to it.
        assert!(matches!(
            l.try_admit(&big(11), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!(l.claimed(), 20);
        assert_eq!(l.free(), 0);
        // Its place dates from the first refusal, not from the retry.
        let key = l.claims()[0].key;
        assert_eq!(l.waiting_since(key), Some(10));
        assert_eq!(l.waiting_since(key ^ 1), None);
        // A small one ends; its bytes go to the claim, not to the next small request.
        l.release(ids[0], 20);
        assert!(matches!(
            l.try_admit(&small(21), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!(l.claimed(), 40);
        l.release(ids[1], 22);
        l.release(ids[2], 23);
        assert!(matches!(
            l.try_admit(&small(24), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!(l.claimed(), 80);
        // The retry takes what its claim held plus what is free: admitted, the claim is spent.
        l.release(ids[3], 25);
        assert!(matches!(
            l.try_admit(&big(26), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert!(l.claims().is_empty());
        assert_eq!(l.committed(), 90);
        assert_eq!(l.free(), 10);
        l.check().unwrap();
    }

    #[test]
    fn a_request_done_before_the_front_could_start_backfills_what_the_front_holds() {
        let mut l = Ledger::new(100, 1);
        let cfg = exact_retry();
        let long = lease_ending_at(&mut l, 60, 10_000);
        // The front needs 80: refused twice, its claim is active and holds the 40 spare. It
        // can start at 10 s, when the 60-byte lease is expected to end.
        refused_twice(&mut l, &cfg, |now| keyed(80, 1, 0, now));
        assert_eq!((l.held_for(1), l.free()), (40, 0));
        // Without a run estimate, or expected to run past 10 s, a newcomer waits its turn.
        for (key, run_ms) in [(2, 0), (3, 9_500)] {
            assert!(matches!(
                l.try_admit(&keyed(30, key, run_ms, 1_000), &cfg, 1),
                AdmitOutcome::Rejected { .. }
            ));
        }
        // The second one's retry, done by 6 s: it goes ahead (of the front, and of the first
        // one's claim, waiting for its client), into 30 of the 40 the front held, and starts
        // with that expected end.
        assert_eq!(l.claims().len(), 3);
        let AdmitOutcome::Admitted { lease: short } =
            l.try_admit(&keyed(30, 3, 5_000, 1_000), &cfg, 1)
        else {
            panic!("a run that ends before the front can start backfills");
        };
        assert_eq!(short.eta_ms, 6_000);
        assert_eq!(l.lease(short.id).map(|x| x.eta_ms), Some(6_000));
        assert_eq!((l.committed(), l.held_for(1), l.free()), (90, 10, 0));
        assert!(
            l.claims().iter().all(|c| c.key != 3),
            "its own claim is spent"
        );
        assert_eq!(l.claims().len(), 2);
        // More than what is left uncommitted is never taken, whatever the estimate.
        assert!(matches!(
            l.try_admit(&keyed(20, 5, 100, 1_000), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        l.check().unwrap();
        // The front's start is still 10 s (the backfill ends first): a refused front is told
        // to come back then.
        match l.try_admit(&keyed(80, 1, 0, 2_000), &cfg, 1) {
            AdmitOutcome::Rejected {
                retry_after: Some(r),
                ..
            } => assert_eq!(r.ms, 8_000),
            other => panic!("{other:?}"),
        }
        // Both end: the front takes its 80.
        l.release(short.id, 6_000);
        l.release(long, 10_000);
        assert!(matches!(
            l.try_admit(&keyed(80, 1, 0, 10_000), &cfg, 1),
            AdmitOutcome::Admitted { .. }
        ));
        // A front waiting in a gateway's queue that holds all it needs already is not
        // backfilled past: it starts at once.
        let front_holding_all = |front: fn(u64, u64, u64, u64) -> AdmitRequest<'static>| {
            let mut m = Ledger::new(100, 1);
            let AdmitOutcome::Admitted { lease: a } = m.try_admit(&req(50, 0), &cfg, 1) else {
                panic!("fits");
            };
            m.set_eta(a.id, 1_000);
            for now in [0, 1] {
                match m.try_admit(&front(60, 1, 0, now), &cfg, 1) {
                    // Told to come back when the 50-byte lease is expected to end (1 s).
                    AdmitOutcome::Rejected {
                        retry_after: Some(r),
                        ..
                    } => assert_eq!(r.ms, 1_000 - now),
                    other => panic!("{other:?}"),
                }
            }
            m.release(a.id, 2);
            m
        };
        let mut m = front_holding_all(queued);
        // 40 are free beside the 60 it holds; 50 are not, even for 1 ms.
        assert!(matches!(
            m.try_admit(&keyed(50, 2, 1, 3), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!((m.held_for(1), m.free()), (60, 40));
        m.check().unwrap();
        // A front whose client was sent away is back at 1 s, as it was told: what is set aside
        // for it sits idle until then, and a run done by then may use it.
        let mut m = front_holding_all(keyed);
        assert!(matches!(
            m.try_admit(&keyed(50, 2, 1_000, 3), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        let AdmitOutcome::Admitted { lease: b } = m.try_admit(&keyed(50, 3, 990, 3), &cfg, 1)
        else {
            panic!("done before the front's client is back");
        };
        assert_eq!((b.eta_ms, m.held_for(1)), (993, 50));
        m.check().unwrap();
    }

    #[test]
    fn a_backfill_delays_no_claim_ahead_even_one_whose_client_has_not_come_back() {
        let cfg = exact_retry();
        let mut l = Ledger::new(100, 1);
        lease_ending_at(&mut l, 30, 3_000);
        lease_ending_at(&mut l, 40, 10_000);
        // A needs 50: refused once, its claim waits for its client (it holds nothing). Then the
        // front F, waiting in a gateway's queue, needs 90: active, it holds the 30 spare; alone
        // it could start at 10 s.
        assert!(matches!(
            l.try_admit(&keyed(50, 1, 0, 0), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        for now in [1, 2] {
            assert!(matches!(
                l.try_admit(&queued(90, 2, 0, now), &cfg, 1),
                AdmitOutcome::Rejected { .. }
            ));
        }
        assert_eq!((l.held_for(1), l.held_for(2)), (0, 30));
        // A, back at 3 s, fits once the 30-byte lease ends: a 9 s run would still hold its
        // bytes then, a 2 s run would not.
        assert!(matches!(
            l.try_admit(&keyed(30, 3, 9_000, 5), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert!(matches!(
            l.try_admit(&keyed(30, 4, 2_000, 5), &cfg, 1),
            AdmitOutcome::Admitted { .. }
        ));
        l.check().unwrap();

        // 15 are held back (use nobody reported), which may clear at any time: the front's
        // start counts them as free already. It needs 90 and the 60-byte lease ends at 10 s:
        // it cannot start before then, whenever they clear.
        let mut m = Ledger::new(100, 1);
        lease_ending_at(&mut m, 60, 10_000);
        m.set_held_back(15);
        refused_twice(&mut m, &cfg, |now| queued(90, 1, 0, now));
        assert_eq!(m.held_for(1), 25);
        assert!(matches!(
            m.try_admit(&keyed(20, 2, 10_500, 2), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert!(matches!(
            m.try_admit(&keyed(20, 3, 9_500, 2), &cfg, 1),
            AdmitOutcome::Admitted { .. }
        ));
        m.check().unwrap();
    }

    #[test]
    fn a_backfill_does_not_count_on_growth_the_line_cannot_take_back() {
        let cfg = exact_retry();
        let mut l = Ledger::new(100, 1);
        // A borrower reserves 10 and has grown 40 past it (lendable to a class that preempts,
        // not to the line); it ends at 10 s. A lease of 25 ends at 1 s.
        let borrower = lease_ending_at(&mut l, 10, 10_000);
        lease_ending_at(&mut l, 25, 1_000);
        l.set_held(|id| if id == borrower { 40 } else { 0 });
        l.set_held_back(40);
        l.set_lendable(40);
        // C, waiting in a gateway's queue, needs 45 and holds the 25 spare: it starts at 1 s.
        refused_twice(&mut l, &cfg, |now| queued(45, 1, 0, now));
        assert_eq!(l.held_for(1), 25);
        // A 5 s run of 20 would leave C 30 at 1 s, not 45: refused. Counting the growth as
        // room (it would have been, were it lent to the line) let it in.
        assert!(matches!(
            l.try_admit(&keyed(20, 2, 5_000, 2), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        // Done before 1 s: admitted.
        assert!(matches!(
            l.try_admit(&keyed(20, 3, 900, 2), &cfg, 1),
            AdmitOutcome::Admitted { .. }
        ));
        l.check().unwrap();
    }

    #[test]
    fn a_backfill_try_from_a_queue_passes_nobody_by_any_other_rule_and_changes_nothing_refused() {
        let cfg = exact_retry();
        let mut l = Ledger::new(100, 1);
        let short = lease_ending_at(&mut l, 20, 1_000);
        lease_ending_at(&mut l, 60, 10_000);
        // Nobody in line: a request that fits is not admitted by a backfill try.
        assert_eq!(l.try_backfill(&keyed(10, 9, 1_000, 0), &cfg), None);
        // B (30) is refused once; then F (80) takes the front of a gateway's queue, and its
        // claim, younger than B's, is active and holds the 40 spare.
        assert!(matches!(
            l.try_admit(&keyed(30, 1, 5_000, 0), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        l.release(short, 1);
        for now in [2, 3] {
            assert!(matches!(
                l.try_admit(&queued(80, 2, 0, now), &cfg, 1),
                AdmitOutcome::Rejected { .. }
            ));
        }
        assert_eq!((l.held_for(1), l.held_for(2)), (0, 40));
        // B's own retry would activate its older claim and take the bytes F holds; queued
        // behind F, it may only go ahead of F by a backfill.
        let mut retried = l.clone();
        assert!(matches!(
            retried.try_admit(&keyed(30, 1, 0, 4), &cfg, 1),
            AdmitOutcome::Admitted { .. }
        ));
        // A run past F's start (10 s): refused, and nothing changed.
        let before = l.clone();
        assert_eq!(l.try_backfill(&keyed(30, 1, 12_000, 4), &cfg), None);
        assert_eq!(l, before);
        // Done by 9 s: admitted ahead of F, its own claim spent.
        let b = l.try_backfill(&keyed(30, 1, 9_000, 4), &cfg).unwrap();
        assert_eq!(b.eta_ms, 9_004);
        assert_eq!(l.held_for(2), 10);
        assert!(l.claims().iter().all(|c| c.key != 1));
        l.check().unwrap();
    }

    /// 70 of 100 held until 10 s, and a front that needs 80, refused twice: it holds the 30
    /// spare and starts at 10 s, when 100 are free.
    fn a_front_of_80_that_starts_at_10_s(cfg: &RetryAfterConfig) -> Ledger {
        let mut l = Ledger::new(100, 1);
        lease_ending_at(&mut l, 70, 10_000);
        refused_twice(&mut l, cfg, |now| keyed(80, 1, 0, now));
        l
    }

    #[test]
    fn a_long_backfill_goes_ahead_when_the_front_has_room_beside_it_at_its_start() {
        let cfg = exact_retry();
        let mut l = a_front_of_80_that_starts_at_10_s(&cfg);
        // For a minute, 25 would leave it 75 at 10 s; 20 leave it its 80.
        assert!(matches!(
            l.try_admit(&keyed(25, 2, 60_000, 2), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        let AdmitOutcome::Admitted { lease: long } = l.try_admit(&keyed(20, 3, 60_000, 2), &cfg, 1)
        else {
            panic!("room beside the front at its start");
        };
        assert_eq!(long.eta_ms, 60_002);
        assert_eq!((l.committed(), l.held_for(1)), (90, 10));
        // 5 more for a minute would leave it 75; for a second, they are gone by then.
        assert!(matches!(
            l.try_admit(&keyed(5, 4, 60_000, 3), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert!(matches!(
            l.try_admit(&keyed(5, 5, 1_000, 3), &cfg, 1),
            AdmitOutcome::Admitted { .. }
        ));
        l.check().unwrap();
    }

    #[test]
    fn an_elastic_backfill_leaves_room_beside_the_front_at_what_it_may_grow_to() {
        let cfg = exact_retry();
        // As above: 20 for a minute fit beside the front when it starts.
        let with_front = || a_front_of_80_that_starts_at_10_s(&cfg);
        let growing = |grows_to| {
            let r = keyed(20, 3, 60_000, 2);
            AdmitRequest {
                claim: r.claim.map(|t| ClaimTicket { grows_to, ..t }),
                ..r
            }
        };
        // Reserving 20 and able to grow to 25 past them (an elastic class, its cap), it would
        // leave the front 75 at 10 s: the line does not take that growth back.
        let mut l = with_front();
        assert!(matches!(
            l.try_admit(&growing(25), &cfg, 1),
            AdmitOutcome::Rejected { .. }
        ));
        // Able to grow to 20 only (its cap is its reservation), it goes ahead.
        let mut l = with_front();
        assert!(matches!(
            l.try_admit(&growing(20), &cfg, 1),
            AdmitOutcome::Admitted { .. }
        ));
        l.check().unwrap();
    }

    #[test]
    fn a_bounded_line_gives_no_new_place_past_its_bound_and_keeps_the_places_it_gave() {
        // Bound: half the capacity (50 of 100). 90 committed, 10 free.
        let bounded = |bytes, key, now| AdmitRequest {
            claim: Some(ClaimTicket {
                key,
                patience_ms: 60_000,
                run_ms: 0,
                max_line_permille: 500,
                waits: false,
                grows_to: 0,
            }),
            ..req(bytes, now)
        };
        let refused = |o: AdmitOutcome| {
            matches!(
                o,
                AdmitOutcome::Rejected {
                    reason: RejectReason::InsufficientCapacity,
                    retry_after: Some(_),
                    ..
                }
            )
        };
        let mut l = Ledger::new(100, 1);
        assert!(matches!(
            l.try_admit(&req(90, 0), &exact_retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        // A (95, more than the bound): the line is empty, its place is taken (a request bigger
        // than the bound is not kept out of line for ever).
        assert!(refused(l.try_admit(&bounded(95, 1, 1), &exact_retry(), 1)));
        // B (30): A's client has not come back (it may never: a caller sending a new body each
        // time never does), so what A lacks does not close the line: B takes a place.
        assert!(refused(l.try_admit(&bounded(30, 2, 2), &exact_retry(), 1)));
        let keys: Vec<u64> = l.claims().iter().map(|c| c.key).collect();
        assert_eq!(keys, [1, 2]);
        // A's retry keeps its place, and its claim, now active, holds the 10 free.
        assert!(refused(l.try_admit(&bounded(95, 1, 3), &exact_retry(), 1)));
        assert_eq!((l.claims().len(), l.held_for(1)), (2, 10));
        // A holds 10 of its 95 and still lacks 85 > 50: C gets no place, unless unbounded.
        assert!(refused(l.try_admit(&bounded(20, 3, 5), &exact_retry(), 1)));
        assert_eq!(l.claims().len(), 2);
        let unbounded = AdmitRequest {
            claim: Some(ClaimTicket {
                max_line_permille: 0,
                ..bounded(20, 4, 6).claim.unwrap()
            }),
            ..req(20, 6)
        };
        assert!(refused(l.try_admit(&unbounded, &exact_retry(), 1)));
        let keys: Vec<u64> = l.claims().iter().map(|c| c.key).collect();
        assert_eq!(keys, [1, 2, 4]);
        // A smaller active front (40, lacking 30 ≤ 50 once it holds 10) lets C in.
        let mut m = Ledger::new(100, 1);
        assert!(matches!(
            m.try_admit(&req(90, 0), &exact_retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert!(refused(m.try_admit(&bounded(40, 1, 1), &exact_retry(), 1)));
        assert!(refused(m.try_admit(&bounded(40, 1, 2), &exact_retry(), 1)));
        assert_eq!(m.held_for(1), 10);
        assert!(refused(m.try_admit(&bounded(20, 3, 3), &exact_retry(), 1)));
        assert_eq!(m.claims().len(), 2, "30 lacking ahead ≤ 50: a place");
        l.check().unwrap();
        m.check().unwrap();
    }

    #[test]
    fn a_client_gone_from_the_line_holds_nothing_and_keeps_its_place_for_its_retry() {
        let in_line = |bytes, key, now| AdmitRequest {
            claim: Some(ClaimTicket {
                key,
                patience_ms: 60_000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(bytes, now)
        };
        let mut l = Ledger::new(100, 1);
        let Some(first) = (match l.try_admit(&req(80, 0), &exact_retry(), 1) {
            AdmitOutcome::Admitted { lease } => Some(lease),
            _ => None,
        }) else {
            panic!("80 of 100 must fit");
        };
        // A (50) then B (30) refused twice each: both active, in that order.
        for now in [1, 2] {
            l.try_admit(&in_line(50, 1, now), &exact_retry(), 1);
            l.try_admit(&in_line(30, 2, now), &exact_retry(), 1);
        }
        assert_eq!((l.held_for(1), l.held_for(2)), (20, 0));
        // A's client closes its stream in the queue: A's 20 go to B at once.
        assert!(l.leave_line(1, 3));
        assert_eq!((l.held_for(1), l.held_for(2)), (0, 20));
        assert!(!l.leave_line(9, 3), "no such claim");
        // The 80 end: B is served first (it holds 30 of the 100 now), A still has its place.
        l.release(first.id, 4);
        l.try_admit(&in_line(30, 2, 5), &exact_retry(), 1);
        assert_eq!(l.waiting_since(1), Some(1));
        // A's retry (the same request) finds its place, first in line, and is admitted.
        assert!(matches!(
            l.try_admit(&in_line(50, 1, 6), &exact_retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert!(l.waiting_since(1).is_none());
        l.check().unwrap();
    }

    #[test]
    fn a_request_in_line_may_take_what_is_lent_to_the_line_and_a_newcomer_may_not() {
        let mut l = Ledger::new(100, 1);
        let waiting = |now| AdmitRequest {
            claim: Some(ClaimTicket {
                key: 7,
                patience_ms: 1000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(30, now)
        };
        let AdmitOutcome::Admitted { lease } = l.try_admit(&req(50, 0), &retry(), 1) else {
            panic!("fits");
        };
        // The elastic lease has grown 40 past its reservation (lendable), and 5 more are held
        // back that nobody can give back (block rounding, unknown use).
        l.set_held_back(45);
        l.set_lendable(40);
        assert_eq!(l.free(), 5);
        // A newcomer does not fit in the 5 free: it is not lent the borrowed bytes.
        assert!(matches!(
            l.try_admit(&req(30, 1), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        // The request in line is refused once (its claim, holding nothing, is made), then its
        // retry finds only the 5 free in its claim: what elastic sequences borrowed is not lent
        // to the line.
        for now in [2, 3] {
            assert!(matches!(
                l.try_admit(&waiting(now), &retry(), 1),
                AdmitOutcome::Rejected { .. }
            ));
        }
        assert_eq!(l.held_for(7), 5);
        // What `reconcile` lends the line (room held for a resume): its next retry finds its
        // claim filled with the 5 free and 25 of them, and is admitted.
        l.set_lendable_to_line(40);
        assert!(matches!(
            l.try_admit(&waiting(4), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert_eq!(l.committed(), 80);
        assert!(l.claims().is_empty());
        // Nothing is free until the next poll sees the borrower give the blocks back, and of
        // the 40 borrowed only the 15 not lent yet may still be lent (the 5 held back that
        // nobody can give back stay out of reach): a second request in line for 20 waits.
        assert_eq!(l.free(), 0);
        let second = |now| AdmitRequest {
            claim: Some(ClaimTicket {
                key: 8,
                patience_ms: 1000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(20, now)
        };
        for now in [5, 6] {
            assert!(matches!(
                l.try_admit(&second(now), &retry(), 1),
                AdmitOutcome::Rejected { .. }
            ));
        }
        assert_eq!(l.held_for(8), 15);
        // The line took 25 of the 40: 15 is what it may still take until the next report.
        assert_eq!(l.lendable_to_line(), 15);
        l.check().unwrap();
        // Lending never goes past what is held back; lendable, and what of it the line may
        // take, follow held back down.
        l.set_held_back(10);
        assert_eq!((l.lendable(), l.lendable_to_line()), (10, 10));
        l.set_lendable(50);
        l.set_lendable_to_line(50);
        assert_eq!((l.lendable(), l.lendable_to_line()), (10, 10));
        l.release(lease.id, 7);
        l.drop_claim(8);
        assert_eq!(l.free(), 100 - 30 - 10);
    }

    #[test]
    fn the_line_takes_at_most_what_is_lent_to_it_between_two_reports_in_all() {
        // 80 committed; 20 held back: 15 elastic sequences' borrowed growth and 5 of room held
        // for a resume, which the report lends to the line.
        let mut l = Ledger::new(100, 1);
        assert!(matches!(
            l.try_admit(&req(80, 0), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        l.set_held_back(20);
        l.set_lendable(20);
        // Three requests of 5 in line, their clients back, holding nothing yet.
        for key in 1..=3 {
            refused_twice(&mut l, &retry(), |now| keyed(5, key, 0, now));
        }
        assert_eq!(l.claimed(), 0);
        l.set_lendable_to_line(5);
        // The first is lent the 5 and admitted.
        assert!(matches!(
            l.try_admit(&keyed(5, 1, 0, 10), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert_eq!(l.lendable_to_line(), 0);
        // Nothing more is lent to the others until the next report: the 15 left are the
        // borrowers' growth, which the line never takes.
        for key in [2, 3] {
            assert!(matches!(
                l.try_admit(&keyed(5, key, 0, 11), &retry(), 1),
                AdmitOutcome::Rejected { .. }
            ));
            assert_eq!(l.held_for(key), 0);
        }
        assert_eq!(l.committed(), 85);
        assert_eq!(
            l.committed() + l.held_back() - l.capacity(),
            5,
            "lent in all"
        );
        l.check().unwrap();
        // The next report lends the line again.
        l.set_lendable_to_line(5);
        assert!(matches!(
            l.try_admit(&keyed(5, 2, 0, 12), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert_eq!((l.committed(), l.lendable_to_line()), (90, 0));
        assert_eq!(l.held_for(3), 0);
        l.check().unwrap();
    }

    #[test]
    fn a_reaped_lease_gives_back_what_it_held_past_its_reservation_as_a_release_does() {
        let mut l = Ledger::new(100, 1);
        let owned = |owner, bytes| AdmitRequest {
            owner,
            ..req(bytes, 0)
        };
        let AdmitOutcome::Admitted { lease: a } = l.try_admit(&owned(7, 60), &retry(), 1) else {
            panic!("fits");
        };
        assert!(matches!(
            l.try_admit(&owned(8, 20), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        // A report: 10 held back, room for a resume, lent to the line.
        l.set_held_back(10);
        l.set_lendable(10);
        l.set_lendable_to_line(10);
        // Demoted: its 60 are held back (and lendable) until its request ends.
        l.demote(a.id).expect("a live lease");
        assert_eq!((l.committed(), l.held_back(), l.lendable()), (20, 70, 70));
        let mut released = l.clone();
        assert!(matches!(
            released.release(a.id, 5),
            ReleaseOutcome::Released(_)
        ));
        // Its worker is gone: reaped, it gives the 60 back as its release would.
        let reaped = l.reap(5, |o| o != 7);
        assert_eq!(reaped.iter().map(|x| x.id).collect::<Vec<_>>(), vec![a.id]);
        let totals = |l: &Ledger| {
            (
                l.committed(),
                l.held_back(),
                l.lendable(),
                l.lendable_to_line(),
                l.free(),
            )
        };
        assert_eq!(totals(&l), (20, 10, 10, 10, 70));
        assert_eq!(totals(&l), totals(&released));
        l.check().unwrap();
    }

    #[test]
    fn a_place_in_line_larger_than_the_capacity_holds_nothing_and_goes() {
        let mut l = Ledger::new(100, 1);
        let AdmitOutcome::Admitted { lease } = l.try_admit(&req(50, 0), &retry(), 1) else {
            panic!("fits");
        };
        refused_twice(&mut l, &retry(), |now| keyed(80, 7, 0, now));
        assert_eq!(l.held_for(7), 50);
        // A reload (or a smaller backend pool) lowers the capacity below what it needs.
        l.set_capacity(60);
        l.release(lease.id, 2);
        // A newcomer is not kept out by a place that can never be admitted.
        assert!(matches!(
            l.try_admit(&req(30, 3), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert!(l.claims().is_empty());
        // Its retry is told it can never fit, and takes no place again.
        assert!(matches!(
            l.try_admit(&keyed(80, 7, 0, 4), &retry(), 1),
            AdmitOutcome::Rejected {
                reason: RejectReason::ExceedsCapacity,
                ..
            }
        ));
        assert!(l.claims().is_empty());
        // A place taken within the capacity whose retry is priced past it goes too, and what
        // it held is free again.
        refused_twice(&mut l, &retry(), |now| keyed(40, 8, 0, now + 5));
        assert_eq!((l.held_for(8), l.free()), (30, 0));
        assert!(matches!(
            l.try_admit(&keyed(61, 8, 0, 7), &retry(), 1),
            AdmitOutcome::Rejected {
                reason: RejectReason::ExceedsCapacity,
                ..
            }
        ));
        assert!(l.claims().is_empty());
        assert_eq!(l.free(), 30);
        l.check().unwrap();
    }

    #[test]
    fn what_the_backend_held_past_a_reservation_frees_when_the_lease_ends_not_at_the_next_poll() {
        // A report: an elastic lease of 30 has grown 40 past it (lendable), 5 more are held
        // back that nobody can give back; a worst-case lease of 20 beside it.
        let reported = || {
            let mut l = Ledger::new(100, 1);
            let a = lease_ending_at(&mut l, 30, 0);
            lease_ending_at(&mut l, 20, 0);
            l.set_held(|id| if id == a { 40 } else { 0 });
            l.set_held_back(45);
            l.set_lendable(40);
            (l, a)
        };
        let (mut l, a) = reported();
        assert_eq!(l.free(), 5);
        assert!(matches!(l.release(a, 10), ReleaseOutcome::Released(x) if x.held == 40));
        // The backend gave back all 70 of its blocks with the stream: 75 free, not 35 until
        // the next poll; the 5 nobody can give back stay held back, and nothing is lendable.
        assert_eq!((l.free(), l.held_back(), l.lendable()), (75, 5, 0));
        l.check().unwrap();

        // The same, but a class that preempts was lent 25 of the growth (the backend preempted
        // the borrower to give it those blocks) before the lease ended: what is free after is
        // what the backend has free, 100 − 20 − 30 − 5, not 25 more.
        let (mut l, a) = reported();
        assert!(l.admit_into_lent(&keyed(30, 7, 0, 2)).is_some());
        assert_eq!((l.committed(), l.free()), (80, 0));
        l.release(a, 10);
        assert_eq!((l.free(), l.held_back(), l.lendable()), (45, 5, 0));
        l.check().unwrap();
    }

    #[test]
    fn a_claimant_is_told_to_wait_only_for_what_its_claim_does_not_hold_yet() {
        let mut l = Ledger::new(100, 1);
        let cfg = exact_retry();
        let big = |now| AdmitRequest {
            claim: Some(ClaimTicket {
                key: 7,
                patience_ms: 1000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(90, now)
        };
        // A lease of 30 that ends "soon" (by the mean, at 10 s) and one of 60 that ends late.
        let AdmitOutcome::Admitted { lease: soon } = l.try_admit(&req(30, 0), &cfg, 1) else {
            panic!("fits");
        };
        let AdmitOutcome::Admitted { .. } = l.try_admit(&req(60, 0), &cfg, 1) else {
            panic!("fits");
        };
        l.set_eta(soon.id, 2_000);
        let later = l
            .leases()
            .iter()
            .find(|x| x.id != soon.id)
            .map(|x| x.id)
            .unwrap();
        l.set_eta(later, 40_000);
        // Needs 90 with 10 free: both leases must end; told 40 s.
        let AdmitOutcome::Rejected { retry_after, .. } = l.try_admit(&big(1_000), &cfg, 1) else {
            panic!("refused");
        };
        assert_eq!(retry_after.unwrap().ms, 39_000);
        // Its claim (active at its second refusal) holds the 10 free, then the soon one's 30:
        // 50 still lacking, which the later lease's end covers. Counting the whole 90 against
        // what is free (0) would find no end that covers it and say the maximum, 60 s.
        l.try_admit(&big(1_500), &cfg, 1);
        l.release(soon.id, 2_000);
        let AdmitOutcome::Rejected { retry_after, .. } = l.try_admit(&big(2_000), &cfg, 1) else {
            panic!("refused");
        };
        assert_eq!(l.held_for(7), 40);
        assert_eq!(retry_after.unwrap().ms, 38_000);
        l.check().unwrap();
    }

    #[test]
    fn a_request_behind_others_in_line_is_told_to_wait_for_their_needs_too() {
        let mut l = Ledger::new(100, 1);
        let cfg = exact_retry();
        let claimant = |key, bytes, now| AdmitRequest {
            claim: Some(ClaimTicket {
                key,
                patience_ms: 1000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(bytes, now)
        };
        // Three leases of 30 (10 free) ending at 2 s, 5 s and 9 s.
        for eta in [2_000, 5_000, 9_000] {
            let AdmitOutcome::Admitted { lease } = l.try_admit(&req(30, 0), &cfg, 1) else {
                panic!("fits");
            };
            l.set_eta(lease.id, eta);
        }
        let wait = |l: &mut Ledger, key, bytes, now| match l.try_admit(
            &claimant(key, bytes, now),
            &cfg,
            1,
        ) {
            AdmitOutcome::Rejected { retry_after, .. } => retry_after.unwrap().ms,
            AdmitOutcome::Admitted { .. } => panic!("refused"),
        };
        // A needs 40: one lease's end covers its deficit of 30.
        assert_eq!(wait(&mut l, 1, 40, 1_000), 1_000);
        // B needs 30 too, behind A: the 10 free and the first end go to A, so B waits for the
        // second (alone it would be told the first, 1 s, and find A's claim holding the bytes).
        assert_eq!(wait(&mut l, 2, 30, 1_000), 4_000);
        // A comes back (active, holds the 10 free); B's place is unchanged, its wait too.
        assert_eq!(wait(&mut l, 1, 40, 1_100), 900);
        assert_eq!(l.held_for(1), 10);
        assert_eq!(wait(&mut l, 2, 30, 1_100), 3_900);
        // A request not in line yet joins behind both.
        assert_eq!(wait(&mut l, 3, 20, 1_100), 7_900);
        l.check().unwrap();
    }

    #[test]
    fn an_older_claim_that_becomes_active_takes_precedence_and_the_line_never_deadlocks() {
        // Reproduces a deadlock seen through Envoy: younger claims had been given bytes while an
        // older one was not active yet; then neither could complete.
        let mut l = Ledger::new(100, 1);
        let keyed = |key, bytes, now| AdmitRequest {
            claim: Some(ClaimTicket {
                key,
                patience_ms: 10_000,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(bytes, now)
        };
        let AdmitOutcome::Admitted { lease } = l.try_admit(&req(100, 0), &retry(), 1) else {
            panic!("fits");
        };
        // The big one (90) is refused first: its claim is the oldest but not active yet.
        assert!(matches!(
            l.try_admit(&keyed(1, 90, 1), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        // Two small ones (20 each) are refused twice: active.
        for t in [2, 3] {
            for key in [2, 3] {
                assert!(matches!(
                    l.try_admit(&keyed(key, 20, t), &retry(), 1),
                    AdmitOutcome::Rejected { .. }
                ));
            }
        }
        l.release(lease.id, 4);
        // Nothing committed: the small ones hold their 20 each; the big one is not active.
        assert!(matches!(
            l.try_admit(&req(1000, 5), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!(l.claimed(), 40);
        // The big one comes back: it is the oldest, so it is served first, in full.
        assert!(matches!(
            l.try_admit(&keyed(1, 90, 6), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert_eq!(l.committed(), 90);
        // The small ones then share what is left, in order, and each completes in turn.
        assert!(matches!(
            l.try_admit(&keyed(2, 20, 7), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        let held: Vec<u64> = l.claims().iter().map(|c| c.held).collect();
        assert_eq!(held, vec![10, 0], "only the first in line is partly served");
        l.check().unwrap();
    }

    #[test]
    fn a_claim_whose_client_never_returns_expires_and_its_bytes_come_back() {
        let mut l = Ledger::new(100, 1);
        let AdmitOutcome::Admitted { lease } = l.try_admit(&req(60, 0), &retry(), 1) else {
            panic!("fits");
        };
        let big = AdmitRequest {
            claim: Some(ClaimTicket {
                key: 7,
                patience_ms: 500,
                run_ms: 0,
                max_line_permille: 0,
                waits: false,
                grows_to: 0,
            }),
            ..req(90, 1)
        };
        assert!(matches!(
            l.try_admit(&big, &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        let AdmitOutcome::Rejected {
            retry_after: Some(r),
            ..
        } = l.try_admit(&big, &retry(), 1)
        else {
            panic!("refused");
        };
        assert_eq!(l.claimed(), 40);
        l.release(lease.id, 2);
        // Until its expiry (the advertised wait + patience) the claim holds what was freed:
        // nobody else takes it.
        let expires = 1 + r.ms + 500;
        assert!(matches!(
            l.try_admit(&req(100, expires - 1), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
        assert_eq!(l.claimed(), 90);
        // From then on the claim is gone and its bytes are free.
        assert!(matches!(
            l.try_admit(&req(100, expires), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        assert!(l.claims().is_empty());
    }

    #[test]
    fn held_back_bytes_are_not_admitted_and_count_in_the_level() {
        let mut l = Ledger::new(100, 1);
        l.set_held_back(70);
        assert_eq!(l.free(), 30);
        assert_eq!(l.level(&LevelThresholds::default()), Level::Amber);
        assert!(matches!(
            l.try_admit(&req(31, 0), &retry(), 1),
            AdmitOutcome::Rejected {
                reason: RejectReason::InsufficientCapacity,
                free: 30,
                ..
            }
        ));
        assert!(matches!(
            l.try_admit(&req(30, 0), &retry(), 1),
            AdmitOutcome::Admitted { .. }
        ));
        l.set_held_back(0);
        assert_eq!(l.free(), 70);
    }

    #[test]
    fn levels_follow_thresholds() {
        let t = LevelThresholds::default();
        let mut l = Ledger::new(100, 1);
        assert_eq!(l.level(&t), Level::Green);
        l.try_admit(&req(70, 0), &retry(), 1);
        assert_eq!(l.level(&t), Level::Amber);
        l.try_admit(&req(20, 0), &retry(), 1);
        assert_eq!(l.level(&t), Level::Red);
    }

    #[test]
    fn budgets_above_4_gib() {
        let cap = 200 * (1u64 << 30);
        let mut l = Ledger::new(cap, 1);
        let big = 5 * (1u64 << 30);
        for i in 0..40 {
            assert!(matches!(
                l.try_admit(&req(big, i), &retry(), 1),
                AdmitOutcome::Admitted { .. }
            ));
        }
        assert_eq!(l.committed(), cap);
        assert!(matches!(
            l.try_admit(&req(1, 0), &retry(), 1),
            AdmitOutcome::Rejected { .. }
        ));
    }

    #[test]
    fn lifetime_mean_tracks_releases() {
        let mut l = Ledger::new(1000, 1);
        for i in 0..20u64 {
            if let AdmitOutcome::Admitted { lease } = l.try_admit(&req(1, i * 1000), &retry(), 1) {
                l.release(lease.id, i * 1000 + 400);
            }
        }
        let m = l.mean_lease_ms();
        assert!((390..=410).contains(&m), "mean {m}");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Admit(u64),
        AdmitKeyed(u64, u64),
        Release(usize),
        ReleaseUnknown,
        Reap(u64),
        /// A poll: held back, and how much of it is lendable.
        HoldBack(u64, u64),
        /// A poll's report of what one lease holds past its reservation.
        Held(usize, u64),
        Demote(usize),
        /// A poll's time-aware slack (only raised here: the global invariants below hold for
        /// admissions made within it, and a report that lowers it finds them over).
        Slack(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..400).prop_map(Op::Admit),
            (1u64..1000, 0u64..4).prop_map(|(b, k)| Op::AdmitKeyed(b, k)),
            (0usize..64).prop_map(Op::Release),
            Just(Op::ReleaseUnknown),
            (1u64..5).prop_map(Op::Reap),
            (0u64..600, 0u64..600).prop_map(|(h, l)| Op::HoldBack(h, l)),
            (0usize..64, 0u64..300).prop_map(|(i, h)| Op::Held(i, h)),
            (0usize..64).prop_map(Op::Demote),
            (0u64..800).prop_map(Op::Slack),
        ]
    }

    proptest! {
        #[test]
        fn invariants_hold_under_random_sequences(ops in proptest::collection::vec(op(), 1..200)) {
            let mut l = Ledger::new(1000, 1);
            let mut now = 0u64;
            // What the last report lent the line, what admissions have taken of it since (what
            // they took past the room not held back), and whether the claims were poured since
            // (a report does not pour them here).
            let (mut lent_to_line, mut line_took, mut poured) = (0u64, 0u64, true);
            for o in ops {
                now += 1;
                match o {
                    Op::Admit(b) => {
                        let (before, unclaimed) = (l.committed(), l.unclaimed());
                        poured = true;
                        match l.try_admit(&AdmitRequest { owner: 1 + b % 4, ..req(b, now) }, &retry(), now) {
                            AdmitOutcome::Admitted { lease } => {
                                line_took += b.saturating_sub(unclaimed);
                                prop_assert_eq!(l.committed(), before + b);
                                prop_assert_eq!(lease.bytes, b);
                                // A newcomer is never lent anything held back.
                                prop_assert!(l.committed() + l.held_back() <= l.admits());
                            }
                            AdmitOutcome::Rejected { need, free, .. } => {
                                prop_assert!(need > free);
                                prop_assert_eq!(l.committed(), before);
                            }
                        }
                    }
                    Op::AdmitKeyed(b, key) => {
                        let (before, unclaimed) = (l.committed(), l.unclaimed());
                        poured = true;
                        let r = AdmitRequest {
                            owner: 1 + b % 4,
                            claim: Some(ClaimTicket { key, patience_ms: 20, run_ms: key % 40 , max_line_permille: 0,waits: false, grows_to: 0,}),
                            ..req(b, now)
                        };
                        if let AdmitOutcome::Admitted { .. } = l.try_admit(&r, &retry(), now) {
                            line_took += b.saturating_sub(unclaimed);
                            prop_assert_eq!(l.committed(), before + b);
                            prop_assert!(l.claims().iter().all(|c| c.key != key));
                            // A request in line may be lent what is lent to the line, never
                            // the part of held back that nobody can give back.
                            let firm = l.held_back() - l.lendable();
                            prop_assert!(l.committed() + firm <= l.admits());
                        }
                    }
                    Op::Release(i) => {
                        if let Some((id, held)) = l.leases().get(i % l.leases().len().max(1)).map(|x| (x.id, x.held)) {
                            let (back, lend) = (l.held_back(), l.lendable());
                            prop_assert!(matches!(l.release(id, now), ReleaseOutcome::Released(_)));
                            // What it held past its reservation is given back with it.
                            prop_assert_eq!(l.held_back(), back.saturating_sub(held));
                            prop_assert!(l.lendable() <= lend);
                            prop_assert_eq!(l.release(id, now), ReleaseOutcome::Unknown);
                        }
                    }
                    Op::ReleaseUnknown => {
                        let before = l.clone();
                        prop_assert_eq!(l.release(u64::MAX, now), ReleaseOutcome::Unknown);
                        prop_assert_eq!(&l, &before);
                    }
                    Op::Reap(gone) => {
                        // Owner `gone` (of 1..=4) stopped its heartbeat: its leases, and only
                        // they, are reclaimed.
                        let back = l.held_back();
                        let reaped = l.reap(now, |o| o != gone);
                        poured = true;
                        prop_assert!(reaped.iter().all(|r| r.owner == gone));
                        // What they held past their reservations is given back with them.
                        let held = reaped.iter().map(|r| r.held).fold(0, u64::saturating_add);
                        prop_assert_eq!(l.held_back(), back.saturating_sub(held));
                        prop_assert!(l.leases().iter().all(|x| x.owner != gone));
                    }
                    Op::HoldBack(h, lend) => {
                        l.set_held_back(h);
                        l.set_lendable(lend);
                        // Half of it to the line (as a resume's room), half only to a class
                        // that preempts (as borrowed growth).
                        l.set_lendable_to_line(lend / 2);
                        (lent_to_line, line_took, poured) = (l.lendable_to_line(), 0, false);
                    }
                    Op::Held(i, h) => {
                        if let Some(id) = l.leases().get(i % l.leases().len().max(1)).map(|x| x.id) {
                            l.set_held(|x| if x == id { h } else { 0 });
                        }
                    }
                    Op::Slack(s) => {
                        l.set_slack(l.slack().max(s));
                        poured = false;
                    }
                    Op::Demote(i) => {
                        if let Some(id) = l.leases().get(i % l.leases().len().max(1)).map(|x| x.id) {
                            // Every other one not confirmed by the backend: undone at once.
                            if let Some(was) = l.demote(id) {
                                if i % 2 == 1 {
                                    l.undemote(id, was.bytes, now);
                                }
                            }
                        }
                    }
                }
                prop_assert!(l.check().is_ok());
                prop_assert!(l.committed() <= l.admits());
                // Claims only ever hold bytes nobody has committed.
                prop_assert!(l.committed() + l.claimed() <= l.admits());
                // Between two reports the line takes at most what the first lent it, in all:
                // what admissions took past the room not held back, and what claims hold
                // past it.
                prop_assert!(line_took <= lent_to_line);
                if poured {
                    let held = l.claimed().saturating_sub(l.unclaimed());
                    prop_assert!(
                        line_took + held <= lent_to_line,
                        "took {} + held {} > lent {}", line_took, held, lent_to_line
                    );
                }
            }
            // Releasing everything returns committed to exactly zero.
            let ids: Vec<u64> = l.leases().iter().map(|x| x.id).collect();
            for id in ids { l.release(id, now); }
            prop_assert_eq!((l.committed(), l.slack()), (0, 0));
        }
    }
}

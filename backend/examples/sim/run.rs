//! One arm's run: the event loop over clients, gateway, backends and polls, and its summary.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Ok,
    KvOom,
    Preempted,
    TooLarge,
    GaveUp,
}

pub(super) struct ReqState {
    pub(super) req: Req,
    pub(super) job: usize,
    /// The cap this arm sends (the oracle's is the true length).
    pub(super) cap: Option<u64>,
    pub(super) first_try: Option<u64>,
    pub(super) outcome: Option<Outcome>,
    pub(super) ttft: Option<u64>,
    pub(super) end: u64,
    pub(super) tokens: u64,
    pub(super) n429: u64,
    pub(super) tries: u64,
    pub(super) degraded: bool,
    pub(super) lease: Option<u64>,
    /// The backend it was last sent to (where a client that gives up cancels it).
    pub(super) backend: Option<usize>,
}

pub(super) enum Ev {
    Job(usize, Option<usize>),
    Try(usize),
    /// The client's patience runs out: no first token `give_up_s` after its first try.
    Patience(usize),
    Step(usize),
    Deliver(usize, Note),
    Poll,
    Drain,
}

pub(super) struct Entry {
    pub(super) t: u64,
    pub(super) seq: u64,
    pub(super) ev: Ev,
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

pub(super) struct Opts {
    pub(super) preset: Preset,
    pub(super) backends: usize,
    pub(super) clients: Option<usize>,
    pub(super) rate: Option<f64>,
    pub(super) give_up_s: f64,
    /// The client gives up on a request without a first token `give_up_s` after its first
    /// try, wherever it waits (`--patience first-token`, the default); with `--patience
    /// retries` only a Retry-After that would end past it makes it give up (a request waiting
    /// in a queue waits for ever).
    pub(super) patience_to_first_token: bool,
    pub(super) max_tries: Option<u64>,
    pub(super) seed: u64,
    pub(super) poll_ms: u64,
    /// `--lazy-blocks`: the backend's `--lazy-blocks` (see the header).
    pub(super) lazy_blocks: bool,
}

pub(super) struct Sim<'a> {
    pub(super) o: &'a Opts,
    pub(super) arm: Arm,
    pub(super) now: u64,
    pub(super) seq: u64,
    pub(super) heap: BinaryHeap<Entry>,
    pub(super) reqs: Vec<ReqState>,
    pub(super) jobs: Vec<Vec<usize>>,
    pub(super) job_left: Vec<usize>,
    pub(super) job_client: Vec<Option<usize>>,
    pub(super) next_job: usize,
    pub(super) resolved: usize,
    pub(super) backends: Vec<Backend>,
    pub(super) gw: Option<Gateway>,
    pub(super) rr: usize,
    pub(super) tries: u64,
    pub(super) last_step: Vec<u64>,
    /// Polls × endpoints seen, then the sums of what `poll` samples (see its end).
    pub(super) pools: [f64; 6],
}

#[derive(Debug, Clone)]
pub(super) struct Row {
    pub(super) arm: Arm,
    pub(super) sent: usize,
    pub(super) completed: usize,
    pub(super) kv_oom: usize,
    pub(super) preempted: usize,
    pub(super) too_large: usize,
    pub(super) gave_up: usize,
    pub(super) tokens: u64,
    pub(super) makespan_s: f64,
    pub(super) goodput: f64,
    pub(super) lat: (f64, f64),
    pub(super) ttft: (f64, f64),
    pub(super) r429: u64,
    pub(super) degraded: usize,
    pub(super) kv_used: f64,
    pub(super) recomputed: u64,
    pub(super) preemptions: u64,
    pub(super) demotions: u64,
}

impl<'a> Sim<'a> {
    pub(super) fn new(
        o: &'a Opts,
        arm: Arm,
        workload: &[Vec<Req>],
        gw: Option<Gateway>,
    ) -> Res<Self> {
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

    pub(super) fn push(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Entry {
            t,
            seq: self.seq,
            ev,
        });
    }

    pub(super) fn run(mut self) -> Res<(Row, Vec<String>)> {
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

    pub(super) fn next_client_job(&mut self, client: usize) {
        if self.next_job < self.jobs.len() {
            let j = self.next_job;
            self.next_job += 1;
            self.push(self.now, Ev::Job(j, Some(client)));
        }
    }

    pub(super) fn start_job(&mut self, j: usize, client: Option<usize>) {
        if let Some(c) = self.job_client.get_mut(j) {
            *c = client;
        }
        let ids = self.jobs.get(j).cloned().unwrap_or_default();
        for r in ids {
            self.try_request(r);
        }
    }

    pub(super) fn resolve(&mut self, r: usize, outcome: Outcome) {
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
    pub(super) fn patience(&mut self, r: usize) {
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

    pub(super) fn refused(&mut self, r: usize, status: u32, retry_ms: Option<u64>) {
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

    pub(super) fn submit(&mut self, b: usize, cmd: Cmd) {
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

    pub(super) fn try_request(&mut self, r: usize) {
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
    pub(super) fn gateway_try(&mut self, r: usize, from_queue: bool) -> bool {
        self.gateway_try_as(r, from_queue, false)
    }

    /// `behind`: a queued request behind the front, tried as a backfill (the filter's
    /// `attempt_backfill`).
    pub(super) fn gateway_try_as(&mut self, r: usize, from_queue: bool, behind: bool) -> bool {
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
    pub(super) fn drain(&mut self) {
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

    pub(super) fn step(&mut self, b: usize) {
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

    pub(super) fn deliver(&mut self, r: usize, note: Note) {
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

    pub(super) fn poll(&mut self) {
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

    pub(super) fn summarise(&self) -> Row {
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

//! The root context of a worker: configuration, the ledger's seeding, and a 100 ms tick that
//! reaps expired leases, retries queued requests, and polls the backend's admission API.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use kvgate_core::config::Config;
use kvgate_core::reconcile::{
    own_etas, reconcile, unexplained_drift, BackendReport, Descriptor, ProgressTracker,
};
use kvgate_core::spec::usable_capacity;
use kvgate_core::store::{self, StoreError};
use kvgate_core::{ApiError, ErrorKind, Ledger, Pricing, TokenCounter};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel, MapType};

use crate::filter::Filter;
use crate::host::{self, EnvoyStore};
use crate::ticket::{Attempt, Ticket};
use crate::worker::{BackendHealth, Endpoint, Runtime, Worker};
use crate::CAS_ATTEMPTS;

/// The tick: fast enough for queued requests to move when budget frees.
const TICK: Duration = Duration::from_millis(100);
/// Most queued requests behind the front tried as backfills on one tick (each try is a CAS).
const BACKFILL_TRIES: usize = 8;

/// What retrying a queued request came to (see `Root::retry_queued`).
enum Retried {
    Waiting(ApiError),
    Done,
}

pub struct Root {
    worker: Rc<Worker>,
    next_reap_ms: u64,
    /// Other workers' heartbeats, watched for change (see `OwnerWatch`).
    watch: RefCell<crate::worker::OwnerWatch>,
    /// One poll state per endpoint, in the endpoints' order.
    polls: Vec<Poll>,
    /// The configuration as written (before a backend descriptor is applied to it).
    configured: Option<Config>,
    /// `"model": "from_backend"`: a poll asks for the descriptor (one at a time).
    want_descriptor: bool,
    descriptor_fingerprint: Option<String>,
}

/// The lease poll of one endpoint.
struct Poll {
    address: Option<String>,
    in_flight: Option<u32>,
    /// The poll in flight asked for the descriptor (`include=tokenizer`).
    asked_descriptor: bool,
    next_ms: u64,
    cursor: u64,
    /// Unseen leases already logged (one warning per lease, not one per poll).
    unseen_warned: Vec<u64>,
    /// The endpoint's decode rate and usual output length (each lease's expected end).
    progress: ProgressTracker,
    /// A vLLM's metrics at its last poll (`None` before the first).
    vllm: Option<kvgate_core::vllm::Metrics>,
}

impl Poll {
    fn new(address: Option<String>) -> Poll {
        Poll {
            address,
            in_flight: None,
            asked_descriptor: false,
            next_ms: 0,
            cursor: 0,
            unseen_warned: Vec::new(),
            progress: ProgressTracker::default(),
            vllm: None,
        }
    }
}

impl Root {
    pub fn new() -> Root {
        Root {
            worker: Rc::new(Worker::new()),
            next_reap_ms: 0,
            watch: RefCell::default(),
            polls: Vec::new(),
            configured: None,
            want_descriptor: false,
            descriptor_fingerprint: None,
        }
    }

    fn configure(&mut self, bytes: &[u8]) -> Result<(), String> {
        let cfg = Config::from_json(bytes).map_err(|e| e.to_string())?;
        // Building a tokenizer is expensive (ranks → hash maps): reuse it when unchanged.
        let counter = match self.worker.runtime() {
            Some(rt) if rt.cfg.tokenizer == cfg.tokenizer => Rc::clone(&rt.counter),
            _ => Rc::new(TokenCounter::new(&cfg.tokenizer).map_err(|e| e.to_string())?),
        };
        let capacity = cfg.pricing.capacity_bytes;
        // Alive before any lease can carry this owner.
        crate::worker::beat(host::now_ms());
        self.worker.configure_endpoints(&cfg);
        // The requests already waiting are re-placed if the aging changed.
        self.worker
            .queue
            .borrow_mut()
            .set_aging_ms(cfg.policy.queue_aging_ms);
        let endpoints = self.worker.endpoints();
        let (mut created, mut kept) = (0, 0);
        for e in &endpoints {
            // Lease ids are drawn by the filter, so the ledger's own counter is unused. An
            // unreadable ledger is kept as it is (it may hold live leases): the configuration is
            // accepted, and admission there answers 503 kvgate_ledger_unavailable.
            let fresh = match store::seed(&EnvoyStore, &e.ledger_key, || Ledger::new(capacity, 1)) {
                Ok(fresh) => fresh,
                Err(err @ StoreError::Corrupt(_)) => {
                    self.worker.metrics.ledger_errors.inc();
                    host::log(
                        LogLevel::Critical,
                        &format!("kvgate: admission stopped at {}: {err}; it is kept, not replaced, since it may hold live leases; start a new ledger with a new vm_id", e.name(&cfg)),
                    );
                    continue;
                }
                Err(err) => return Err(err.to_string()),
            };
            created += usize::from(fresh);
            // A new ledger has this capacity already. With the model from the backend, the
            // fallback's capacity only seeds a new ledger: an existing one may already hold the
            // capacity another worker read from the backend's pool (workers configure one after
            // another), and it stays until a poll reads the pool again.
            let ledger = if fresh || cfg.from_backend {
                store::read(&EnvoyStore, &e.ledger_key)
            } else {
                store::transact(&EnvoyStore, &e.ledger_key, CAS_ATTEMPTS, |l| {
                    l.set_capacity(capacity)
                })
                .map(|(_, l)| l)
            };
            match ledger {
                Ok(ledger) => {
                    e.observe(&ledger);
                    kept += ledger.leases().len();
                }
                Err(StoreError::Corrupt(_)) => {}
                Err(err) => return Err(err.to_string()),
            }
        }
        self.worker.metrics.observe(&self.worker, &cfg);
        // Polls of endpoints that stay keep their cursor.
        let mut old = std::mem::take(&mut self.polls);
        self.polls = endpoints
            .iter()
            .map(|e| match old.iter().position(|p| p.address == e.address) {
                Some(i) => old.swap_remove(i),
                None => Poll::new(e.address.clone()),
            })
            .collect();
        hostcalls::set_tick_period(TICK).map_err(|s| format!("set_tick_period failed: {s:?}"))?;
        host::info(&format!(
            "kvgate {} ({}) configured: capacity {} B ({} B x {}) per endpoint, {} B/token, context {}, tokenizer {}, model fingerprint {:016x}, backend callout {}, {} endpoint(s), {} ledger(s) created, {} live leases kept",
            kvgate_core::VERSION,
            option_env!("KVGATE_GIT_HASH").unwrap_or("unknown"),
            capacity,
            cfg.pricing.total_kv_bytes,
            cfg.pricing.safety_fraction,
            cfg.pricing.bytes_per_token,
            cfg.pricing.spec.context_tokens,
            counter.name(),
            cfg.pricing.spec.fingerprint(),
            cfg.backend.as_ref().map_or("off".to_string(), |b| format!("{} every {} ms", b.cluster, b.poll_ms)),
            endpoints.len(),
            created,
            kept,
        ));
        self.want_descriptor = cfg.from_backend;
        for p in &mut self.polls {
            p.next_ms = 0;
        }
        self.configured = Some(cfg.clone());
        *self.worker.runtime.borrow_mut() = Some(Rc::new(Runtime { cfg, counter }));
        Ok(())
    }

    /// The runtime with a larger scratch margin on every reservation (`None`, and a warning, if
    /// the pricing refuses it).
    fn raise_margin(&self, rt: &Rc<Runtime>, margin: u64) -> Option<Rc<Runtime>> {
        let p = &rt.cfg.pricing;
        match Pricing::new(p.spec, p.total_kv_bytes, p.safety_fraction, margin) {
            Ok(pricing) => {
                host::info(&format!(
                    "kvgate: a backend allocates in blocks of {margin} B: the scratch margin per reservation is {margin} B (was {} B)",
                    p.scratch_margin_bytes
                ));
                let cfg = Config {
                    pricing,
                    ..rt.cfg.clone()
                };
                let new = Rc::new(Runtime {
                    cfg,
                    counter: Rc::clone(&rt.counter),
                });
                *self.worker.runtime.borrow_mut() = Some(Rc::clone(&new));
                Some(new)
            }
            Err(err) => {
                host::warn(&format!("kvgate: scratch margin {margin} B refused: {err}"));
                None
            }
        }
    }

    /// Price with the served model's own spec, budget and tokenizer from now on. The endpoint
    /// that sent it takes its capacity now; the others at their next poll.
    fn apply_descriptor(&mut self, d: Descriptor, endpoint: &Endpoint) -> Result<(), String> {
        let Some(base) = &self.configured else {
            return Ok(());
        };
        let started = host::now_ms();
        let mut d = d;
        // The margin only grows (see `raise_margin`).
        if let Some(rt) = self.worker.runtime() {
            d.scratch_margin_bytes = d
                .scratch_margin_bytes
                .max(rt.cfg.pricing.scratch_margin_bytes);
        }
        let (spec, budget, fingerprint) = (d.spec, d.kv_capacity_bytes, d.fingerprint.clone());
        let cfg = base.with_descriptor(d).map_err(|e| e.to_string())?;
        let counter = Rc::new(TokenCounter::new(&cfg.tokenizer).map_err(|e| e.to_string())?);
        let capacity = cfg.pricing.capacity_bytes;
        let (_, ledger) = store::transact(&EnvoyStore, &endpoint.ledger_key, CAS_ATTEMPTS, |l| {
            l.set_capacity(capacity)
        })
        .map_err(|e| e.to_string())?;
        endpoint.observe(&ledger);
        host::info(&format!(
            "kvgate: model descriptor from the backend {}: fingerprint {} ({} layers, {} KV heads x {}, context {}), KV budget {} B (capacity {} B), scratch margin {} B per reservation, its own tokenizer; built in {} ms",
            endpoint.name(&cfg),
            fingerprint,
            spec.layers,
            spec.kv_heads,
            spec.head_dim,
            spec.context_tokens,
            budget,
            capacity,
            cfg.pricing.scratch_margin_bytes,
            host::now_ms().saturating_sub(started),
        ));
        self.descriptor_fingerprint = Some(fingerprint);
        self.want_descriptor = false;
        *self.worker.runtime.borrow_mut() = Some(Rc::new(Runtime { cfg, counter }));
        Ok(())
    }

    /// Reclaim the leases of workers that are gone (heartbeat unchanged over `owner_timeout_ms`
    /// of this worker's watching): their requests can no longer end by themselves. A live
    /// worker's lease is never touched.
    fn reap(&self, rt: &Runtime, endpoint: &Endpoint, now: u64) -> Result<(), StoreError> {
        let key = endpoint.ledger_key.as_str();
        let ledger = store::read(&EnvoyStore, key)?;
        let timeout = rt.cfg.owner_timeout_ms;
        let gone = self.watch.borrow_mut().gone(
            &ledger.owners(),
            now,
            timeout,
            rt.cfg.tick_ms.saturating_mul(2),
        );
        let ownerless = ledger.leases().iter().any(|l| l.owner == 0);
        if gone.is_empty() && !ownerless && ledger.next_claim_expiry().is_none_or(|d| d > now) {
            endpoint.observe(&ledger);
            return Ok(());
        }
        let (reaped, ledger) = store::transact(&EnvoyStore, key, CAS_ATTEMPTS, |l| {
            l.reap(now, |o| !gone.contains(&o))
        })?;
        endpoint.observe(&ledger);
        for lease in &reaped {
            host::warn(&format!(
                "kvgate: reaped lease {} ({} B, class {}): its worker {:016x} has sent no heartbeat for over {timeout} ms",
                lease.id, lease.bytes, lease.class, lease.owner
            ));
        }
        self.worker.metrics.reaped.add(reaped.len() as u64);
        Ok(())
    }

    /// Try a queued request again, its stream made the effective context first. `Waiting(e)`:
    /// refused for lack of budget (`e`), it stays where it is; `Done`: admitted (resumed, or
    /// waiting for its preemption demotions), answered with another refusal, or its stream is gone
    /// — it leaves the queue.
    fn retry_queued(&self, ticket: &Rc<Ticket>, rt: &Runtime) -> Retried {
        self.retry_queued_with(ticket, rt, |t| t.attempt(&self.worker, rt))
    }

    /// [`Self::retry_queued`] with another kind of try (`attempt`).
    fn retry_queued_with(
        &self,
        ticket: &Rc<Ticket>,
        rt: &Runtime,
        attempt: impl Fn(&Rc<Ticket>) -> Attempt,
    ) -> Retried {
        if hostcalls::set_effective_context(ticket.context_id).is_err() {
            return Retried::Done;
        }
        match attempt(ticket) {
            Attempt::Admitted { ready } => {
                if ready {
                    let _ = hostcalls::resume_http_request();
                }
                Retried::Done
            }
            Attempt::Rejected(e) if e.kind == ErrorKind::KvCapacityExceeded => Retried::Waiting(e),
            Attempt::Rejected(e) => {
                self.worker.reply_error(&e, self.worker.level(&rt.cfg));
                Retried::Done
            }
        }
    }

    /// Answer queued requests whose wait ran out, then admit from the front while budget allows.
    fn drain_queue(&self, rt: &Runtime, now: u64) {
        let expired = self.worker.queue.borrow_mut().expire(now);
        for e in expired {
            self.worker.metrics.queued.add_signed(-1);
            // One last try: it may fit now, and a refusal refreshes its place in the fair-retry
            // line and says how long the line ahead of it and its own need will likely take
            // (not the shortest wait, which would bring it back to find the same queue). Its
            // client is away from then on.
            e.item.sent_away.set(true);
            let Retried::Waiting(refused) = self.retry_queued(&e.item, rt) else {
                continue;
            };
            let err = ApiError::new(
                ErrorKind::QueueTimeout,
                format!(
                    "The request waited the class {} limit for KV cache budget without it freeing up. Retry after the time in the Retry-After header.",
                    e.class
                ),
            )
            .with_retry_after_ms(
                refused
                    .retry_after_ms
                    .unwrap_or(rt.cfg.retry_after.min_ms),
            );
            self.worker.reply_error(&err, self.worker.level(&rt.cfg));
        }
        // Strict order: the front waits for budget; nothing jumps ahead of it.
        loop {
            let Some(ticket) = self
                .worker
                .queue
                .borrow()
                .front()
                .map(|e| Rc::clone(&e.item))
            else {
                break;
            };
            if let Retried::Waiting(_) = self.retry_queued(&ticket, rt) {
                break;
            }
            self.worker.queue.borrow_mut().pop_front();
            self.worker.metrics.queued.add_signed(-1);
        }
        // A request whose claim is active (it was refused at the front twice, or it is a
        // client's retry that kept its place) but that is not at the front now keeps its place
        // in the fair-retry line across workers: the ledger sets freed bytes aside for it, which
        // nobody else may take. Retry it too, or those bytes sit idle while the front waits (seen
        // as an empty pool with requests queued until their max_wait ran out).
        let served: Vec<Rc<Ticket>> = self
            .worker
            .queue
            .borrow()
            .items()
            .skip(1)
            .filter(|t| t.claim_active.get())
            .cloned()
            .collect();
        for ticket in served {
            if let Retried::Done = self.retry_queued(&ticket, rt) {
                self.worker.unqueue(ticket.context_id);
            }
        }
        // In a fleet, a request behind the front that fits on an endpoint with nobody in line
        // goes there, as a newcomer would (the plain pass), rather than wait out its
        // `max_wait_ms` while newcomers take that room. With one endpoint the queue keeps its
        // order: trying the requests behind the front in spare room there was measured to
        // raise p99 latency (docs/design/011-queued-try-behind-the-front.md).
        let endpoints = self.worker.endpoints();
        let open_room = match endpoints.len() {
            0 | 1 => 0,
            _ => endpoints
                .iter()
                .map(|e| e.view.get())
                .filter(|v| v.eligible && v.claims == 0)
                .map(|v| v.room)
                .max()
                .unwrap_or(0),
        };
        if open_room > 0 {
            let elsewhere: Vec<Rc<Ticket>> = self
                .worker
                .queue
                .borrow()
                .items()
                .skip(1)
                .filter(|t| !t.claim_active.get())
                .inspect(|t| t.reprice(&self.worker, rt))
                .filter(|t| t.priced.borrow().reserve_bytes() <= open_room)
                .take(BACKFILL_TRIES)
                .cloned()
                .collect();
            self.try_behind(elsewhere, rt, |t| t.attempt_plain(&self.worker, rt));
        }
        // Behind a front that waits, a request expected to be done before the front could
        // start goes ahead of it (a backfill, see the ledger), where the bytes the line holds
        // would cover it at all. The others keep their places: a refused try changes nothing.
        let room = self
            .worker
            .endpoints()
            .iter()
            .map(|e| {
                let v = e.view.get();
                v.room.saturating_add(v.claimed)
            })
            .max()
            .unwrap_or(0);
        // The shortest runs first: they are the likeliest to be done in time.
        let mut behind: Vec<(u64, Rc<Ticket>)> = self
            .worker
            .queue
            .borrow()
            .items()
            .skip(1)
            .filter(|t| t.claim.is_some() && !t.claim_active.get())
            // Priced as of now, as the try itself will be: an elastic class may have learned
            // since this request's last try.
            .inspect(|t| t.reprice(&self.worker, rt))
            .filter(|t| t.priced.borrow().reserve_bytes() <= room)
            .map(|t| (t.run_ms(&self.worker, &rt.cfg), Rc::clone(t)))
            .filter(|(run_ms, _)| *run_ms > 0)
            .collect();
        behind.sort_by_key(|(run_ms, _)| *run_ms);
        self.try_behind(
            behind.into_iter().take(BACKFILL_TRIES).map(|(_, t)| t),
            rt,
            |t| t.attempt_backfill(&self.worker, rt),
        );
    }

    /// Try queued requests behind the front, each with `attempt` (a try whose refusal for
    /// room changes nothing): those admitted leave the queue and go on, those refused for
    /// another reason (a body that grew past the limit when written again) are answered and
    /// leave it, as do those whose stream is gone.
    fn try_behind(
        &self,
        tickets: impl IntoIterator<Item = Rc<Ticket>>,
        rt: &Runtime,
        attempt: impl Fn(&Rc<Ticket>) -> Attempt,
    ) {
        for ticket in tickets {
            if let Retried::Done = self.retry_queued_with(&ticket, rt, &attempt) {
                self.worker.unqueue(ticket.context_id);
            }
        }
    }

    fn poll_backends(&mut self, rt: &Runtime, now: u64) {
        let Some(b) = &rt.cfg.backend else { return };
        // One poll at a time carries the (large) descriptor.
        let mut asking = self.polls.iter().any(|p| p.asked_descriptor);
        for i in 0..self.polls.len() {
            let Some(p) = self.polls.get_mut(i) else {
                continue;
            };
            if p.in_flight.is_some() || now < p.next_ms {
                continue;
            }
            p.next_ms = now + b.poll_ms;
            let ask = self.want_descriptor && !asking;
            let include = if ask { "&include=tokenizer" } else { "" };
            // Naming this Envoy, so the backend tells it of the other gateways that poll (a
            // vLLM's metrics take no query).
            let path = if !b.keeps_leases() {
                b.leases_path.clone()
            } else {
                format!(
                    "{}?since={}&gateway={}&instance={:016x}&poll_ms={}{include}",
                    b.leases_path,
                    p.cursor,
                    self.worker.gateway(),
                    self.worker.instance(),
                    b.poll_ms
                )
            };
            match host::call_backend(b, p.address.as_deref(), "GET", &path) {
                Ok(token) => {
                    p.in_flight = Some(token);
                    p.asked_descriptor = ask;
                    asking |= ask;
                }
                Err(s) => self.poll_failed(rt, i, &format!("dispatch failed: {s:?}"), true),
            }
        }
    }

    fn endpoint_of(&self, i: usize) -> Option<Rc<Endpoint>> {
        let p = self.polls.get(i)?;
        self.worker.endpoint(p.address.as_deref())
    }

    /// A poll failed (`unreachable`: no answer from the backend at all — Envoy's own 503 or
    /// 504, a failed dispatch — rather than an answer it did not like).
    fn poll_failed(&mut self, rt: &Runtime, i: usize, why: &str, unreachable: bool) {
        if let Some(e) = self.endpoint_of(i) {
            e.unreachable.set(unreachable);
        }
        let Some(b) = &rt.cfg.backend else { return };
        if let Some(p) = self.polls.get_mut(i) {
            p.asked_descriptor = false;
        }
        let Some(e) = self.endpoint_of(i) else { return };
        self.worker.metrics.backend_poll_failures.inc();
        e.refresh_health();
        let mut h = e.health();
        h.polled = true;
        h.failures += 1;
        // One line when it goes down (also when it was never up), not one per failed poll.
        if h.failures == b.down_after_failures {
            host::warn(&format!(
                "kvgate: backend {} is down after {} failed polls: {why}; no new request goes there, its leases end with their requests",
                e.name(&rt.cfg),
                h.failures
            ));
        }
        if h.failures >= b.down_after_failures {
            h.up = false;
        }
        e.set_health(&h);
        self.observe_backends(rt);
    }

    /// The fleet-wide backend gauges, from every endpoint's health.
    fn observe_backends(&self, rt: &Runtime) {
        let (mut up, mut used, mut drift) = (false, 0u64, 0u64);
        let (mut unseen_leases, mut unseen_bytes) = (0u64, 0u64);
        for e in self.worker.endpoints() {
            let h = e.health();
            up |= !h.down();
            used = used.saturating_add(h.used_bytes);
            drift = drift
                .saturating_add(u64::try_from(h.drift_bytes.unsigned_abs()).unwrap_or(u64::MAX));
            unseen_leases = unseen_leases.saturating_add(h.unseen_leases);
            unseen_bytes = unseen_bytes.saturating_add(h.unseen_bytes);
        }
        // Totals over every endpoint, from each one's last poll: one endpoint's poll does not
        // hide what another's found.
        let m = &self.worker.metrics;
        m.backend_up.set(u64::from(up));
        m.backend_used_bytes.set(used);
        m.drift_bytes.set(drift);
        m.unseen_leases.set(unseen_leases);
        m.unseen_bytes.set(unseen_bytes);
        m.observe(&self.worker, &rt.cfg);
    }

    /// Requests sent to an endpoint before it was known to be down (its polls get no answer at
    /// all) get their answer now: a 503 with a Retry-After, as a request sent after would
    /// (their leases end with them). An endpoint that answers its polls, if wrongly, may still
    /// be serving them: they are left alone.
    fn answer_stranded(&self, rt: &Runtime) {
        for t in self.worker.stranded() {
            if hostcalls::set_effective_context(t.context_id).is_err() {
                continue;
            }
            let err = kvgate_core::ApiError::new(
                kvgate_core::ErrorKind::BackendUnavailable,
                "The model server stopped answering after this request was sent to it. Retry \
                 after the time in the Retry-After header.",
            )
            .with_retry_after_ms(
                rt.cfg
                    .retry_after
                    .max_ms
                    .min(5_000)
                    .max(rt.cfg.retry_after.min_ms),
            );
            self.worker.metrics.stranded.inc();
            host::send_error(&err, kvgate_core::Level::Red.as_str());
        }
    }

    fn poll_answered(&mut self, rt: &Runtime, i: usize, body_size: usize) {
        let Some(b) = &rt.cfg.backend else { return };
        let Some(e) = self.endpoint_of(i) else { return };
        let status = abi_status();
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        if status != Some(200) {
            let unreachable = matches!(status, None | Some(503) | Some(504));
            return self.poll_failed(rt, i, &format!("status {status:?}"), unreachable);
        }
        let parsed = if b.keeps_leases() {
            BackendReport::parse(&body)
        } else {
            self.read_vllm(rt, i, &e, &body)
        };
        let report = match parsed {
            Ok(r) => r,
            Err(err) => return self.poll_failed(rt, i, &err, false),
        };
        // Answered by the host it named? Else that host is not in the cluster and Envoy fell
        // back to another: its pool is not this endpoint's, which is then down.
        if let (Some(named), Some(at)) = (&e.address, &report.served_at) {
            if !kvgate_core::fleet::same_host(named, at) {
                self.worker.metrics.upstream_mismatch.inc();
                return self.poll_failed(rt, i, &format!("answered by {at}, not {named}"), false);
            }
        }
        e.unreachable.set(false);
        let mismatch = self.follow_descriptor(i, &e, &body, &report);
        // The runtime may have changed (a descriptor applied).
        let Some(rt) = self.worker.runtime() else {
            return;
        };
        // A backend that allocates larger KV blocks than the margin covers (restarted with
        // another --block-size) needs that margin on every reservation: take it now. The margin
        // only grows here, so a fleet ends priced at its largest.
        // A vLLM publishes its block size, so its margin too.
        let published = rt.cfg.from_backend || !b.keeps_leases();
        let rt = match report.scratch_margin_bytes {
            Some(m) if published && m > rt.cfg.pricing.scratch_margin_bytes => {
                self.raise_margin(&rt, m).unwrap_or(rt)
            }
            _ => rt,
        };
        // Each endpoint's capacity follows its own pool once the model is known.
        let capacity = ((rt.cfg.from_backend && self.descriptor_fingerprint.is_some())
            || !b.keeps_leases())
        .then(|| usable_capacity(report.capacity_bytes, rt.cfg.pricing.safety_fraction));
        let now = host::now_ms();
        let progress = self
            .polls
            .get_mut(i)
            .and_then(|p| p.progress.observe(&report, now))
            .filter(|_| rt.cfg.retry_from_progress);
        // No rate for run estimates (no decode rate measured yet, fewer than 5 outputs seen —
        // `Progress::warm` — or Retry-After not estimated from progress): no backfills.
        e.tokens_per_s.set(
            progress
                .as_ref()
                .filter(|p| p.warm())
                .map_or(0.0, |p| p.tokens_per_s),
        );
        // Expected ends from the ledger as it is now, outside the CAS (a retry does not redo
        // the Monte Carlo); applied by id inside it.
        let etas = match progress
            .as_ref()
            .map(|_| store::read(&EnvoyStore, &e.ledger_key))
        {
            Some(Ok(ledger)) => own_etas(&ledger, &report, progress.as_ref(), now),
            _ => Default::default(),
        };
        let done = store::transact(&EnvoyStore, &e.ledger_key, CAS_ATTEMPTS, |l| {
            if let Some(c) = capacity {
                l.set_capacity(c);
            }
            reconcile(
                l,
                &report,
                now,
                b.lost_grace_ms,
                &etas,
                self.worker.gateway(),
            )
        });
        let (rec, ledger) = match done {
            Ok(v) => v,
            Err(err) => {
                self.worker.metrics.ledger_errors.inc();
                return host::warn(&format!("kvgate: reconcile at {}: {err}", e.name(&rt.cfg)));
            }
        };
        e.observe(&ledger);
        let Some(p) = self.polls.get_mut(i) else {
            return;
        };
        p.cursor = report.cursor;
        // One line per lease when it first counts as unseen; it stays in the ledger.
        p.unseen_warned
            .retain(|id| rec.unseen.iter().any(|l| l.id == *id));
        for l in &rec.unseen {
            if !p.unseen_warned.contains(&l.id) {
                p.unseen_warned.push(l.id);
                host::warn(&format!(
                    "kvgate: drift: lease {} ({} B, class {}) is unknown to the backend {} {} ms after admission; kept until its request ends",
                    l.id,
                    l.bytes,
                    l.class,
                    e.name(&rt.cfg),
                    now.saturating_sub(l.created_ms)
                ));
            }
        }
        self.worker
            .metrics
            .released_by_backend
            .add(rec.released.len() as u64);
        // Elastic sequences grown past their reservations hold more than the ledger counts,
        // and other gateways' leases are their ledgers': expected (and held back from
        // admission), not drift.
        let d = unexplained_drift(&ledger, &report, &rec);
        e.grown.set(rec.grown_bytes);
        // An older backend in reserve mode reads elastic reservations only from a header this
        // gateway no longer sends: worst case in front of it.
        e.lends
            .set(report.admission == "reserve" && report.gateway_note);
        self.worker.learn_outputs(&rt.cfg, &report.class_outputs);
        let before = e.health();
        let was_over = before.drift_bytes.unsigned_abs() > u128::from(b.drift_warn_bytes);
        // Edge-triggered: one line when the gap crosses the threshold, not one per poll.
        if d.unsigned_abs() > u128::from(b.drift_warn_bytes) && !was_over {
            host::warn(&format!(
                "kvgate: drift {d} B between the ledger ({} B committed) and the backend {} ({} B used) exceeds {} B",
                ledger.committed(),
                e.name(&rt.cfg),
                report.used_bytes,
                b.drift_warn_bytes
            ));
        }
        if before.down() {
            host::info(&format!("kvgate: backend {} is up again", e.name(&rt.cfg)));
        }
        e.set_health(&BackendHealth {
            polled: true,
            up: true,
            full: false,
            mismatch,
            failures: 0,
            used_bytes: report.used_bytes,
            capacity_bytes: report.capacity_bytes,
            drift_bytes: d,
            last_ok_ms: now,
            unseen_bytes: rec.unseen_bytes(),
            unseen_leases: rec.unseen.len() as u64,
            foreign_bytes: rec.foreign_bytes,
            foreign_leases: rec.foreign_leases as u64,
            other_gateways: rec.other_gateways,
        });
        self.observe_backends(&rt);
    }
}

impl Root {
    /// A vLLM's metrics as a report (its pool and use, no leases), priced per token as this
    /// filter prices, and the output lengths it finished since the last poll, learned by the
    /// elastic classes. A preemption counter that moved is an alarm: priced at their worst case,
    /// requests behind this gateway alone never make it preempt; it does when requests bypass
    /// the gateway, when its pool is smaller than it says, or when elastic reservations turn out
    /// short.
    fn read_vllm(
        &mut self,
        rt: &Runtime,
        i: usize,
        e: &Endpoint,
        body: &[u8],
    ) -> Result<BackendReport, String> {
        let m = kvgate_core::vllm::Metrics::parse(body)?;
        let report = m.report(rt.cfg.pricing.bytes_per_token);
        if let Some(p) = self.polls.get_mut(i) {
            let (moved, outputs) = m.since(p.vllm.as_ref(), kvgate_core::elastic::OUTPUTS_KEPT);
            // For the elastic classes (vLLM does not say which class a request was: every
            // elastic class learns every output).
            let learned: Vec<(String, kvgate_core::reconcile::Output)> = rt
                .cfg
                .policy
                .classes()
                .iter()
                .filter(|c| matches!(c.reservation, kvgate_core::Reservation::Elastic(_)))
                .flat_map(|c| outputs.iter().map(|o| (c.name.clone(), *o)))
                .collect();
            self.worker.learn_outputs(&rt.cfg, &learned);
            if moved > 0 {
                host::warn(&format!(
                    "kvgate: the vLLM {} preempted {moved} sequences ({} running, {} waiting, {} of {} blocks used): it serves more than this gateway admitted",
                    e.name(&rt.cfg),
                    m.running,
                    m.waiting,
                    m.used_blocks,
                    m.blocks
                ));
            }
            p.vllm = Some(m);
            // Every worker polls: the gauge is the servers' own counters (each worker sets the
            // same), not a count of what each worker saw move.
            let total = self
                .polls
                .iter()
                .filter_map(|p| p.vllm.as_ref())
                .fold(0u64, |t, m| t.saturating_add(m.preemptions));
            self.worker.metrics.backend_preemptions.set(total);
        }
        Ok(report)
    }

    /// `"model": "from_backend"`: take the descriptor when a poll asked for it. Returns whether
    /// this endpoint serves another model than the one priced with: with one endpoint that
    /// means fetching its descriptor again (live leases keep the fingerprint that priced them);
    /// in a fleet the endpoint is left out of the choice, and the descriptor is fetched again
    /// only when no endpoint serves the priced model any more.
    fn follow_descriptor(
        &mut self,
        i: usize,
        e: &Endpoint,
        body: &[u8],
        report: &BackendReport,
    ) -> bool {
        if !self.configured.as_ref().is_some_and(|c| c.from_backend) {
            return false;
        }
        if let Some(p) = self.polls.get_mut(i) {
            if std::mem::take(&mut p.asked_descriptor) {
                match Descriptor::parse(body) {
                    Ok(Some(d)) => {
                        if let Err(err) = self.apply_descriptor(d, e) {
                            host::warn(&format!("kvgate: model descriptor refused: {err}"));
                        }
                    }
                    Ok(None) => {}
                    Err(err) => host::warn(&format!("kvgate: model descriptor unreadable: {err}")),
                }
                return false;
            }
        }
        let single = self.polls.len() <= 1;
        let differs = self.descriptor_fingerprint.is_some()
            && if single {
                // One backend: any change (a new pool size changes its served context too)
                // means pricing with its new descriptor.
                report.fingerprint.is_some() && report.fingerprint != self.descriptor_fingerprint
            } else {
                // A fleet: backends may hold different pools (and advertise different
                // contexts); only another KV shape or model name is another model.
                self.worker.runtime().is_some_and(|rt| {
                    !report.serves(
                        &rt.cfg.pricing.spec,
                        rt.cfg.served.model.as_deref(),
                        self.descriptor_fingerprint.as_deref(),
                    )
                })
            };
        if !differs {
            return false;
        }
        let others_serve_it = self.worker.endpoints().iter().any(|o| {
            let h = o.health();
            o.address != e.address && !h.down() && !h.mismatch && h.polled
        });
        if !e.health().mismatch {
            host::info(&format!(
                "kvgate: the backend {} serves model fingerprint {:?}, not {:?}{}",
                e.address.as_deref().unwrap_or("backend"),
                report.fingerprint,
                self.descriptor_fingerprint,
                if others_serve_it {
                    "; left out of the choice"
                } else {
                    "; fetching its descriptor"
                }
            ));
        }
        if !others_serve_it && !self.want_descriptor {
            self.want_descriptor = true;
            if let Some(p) = self.polls.get_mut(i) {
                p.next_ms = 0;
            }
        }
        others_serve_it
    }
}

fn abi_status() -> Option<u32> {
    crate::abi::header(MapType::HttpCallResponseHeaders, ":status").and_then(|s| s.parse().ok())
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Some(i) = self.polls.iter().position(|p| p.in_flight == Some(token)) else {
            // A preemption demotion sent while the tick admitted from the queue.
            self.worker.demotion_answered(token);
            return;
        };
        if let Some(p) = self.polls.get_mut(i) {
            p.in_flight = None;
        }
        if let Some(rt) = self.worker.runtime() {
            self.poll_answered(&rt, i, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size) {
            Ok(Some(b)) => b,
            Ok(None) => Vec::new(),
            Err(s) => {
                host::log(
                    LogLevel::Critical,
                    &format!("kvgate: cannot read plugin configuration: {s:?}"),
                );
                return false;
            }
        };
        match self.configure(&bytes) {
            Ok(()) => true,
            Err(e) => {
                host::log(LogLevel::Critical, &format!("kvgate: {e}"));
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(rt) = self.worker.runtime() else {
            return;
        };
        let now = host::now_ms();
        crate::worker::beat(now);
        self.worker.refresh_endpoints();
        self.answer_stranded(&rt);
        self.worker.retry_releases(now);
        // A clock stepped back does not hold the reaper off for as long.
        if now >= self.next_reap_ms || self.next_reap_ms > now.saturating_add(rt.cfg.tick_ms) {
            self.next_reap_ms = now + rt.cfg.tick_ms;
            for e in self.worker.endpoints() {
                if let Err(err) = self.reap(&rt, &e, now) {
                    self.worker.metrics.ledger_errors.inc();
                    host::warn(&format!("kvgate: reaper at {}: {err}", e.name(&rt.cfg)));
                }
            }
            // Dropped from the configuration: watched until nothing is left in their ledgers.
            for e in self.worker.retired() {
                match self.reap(&rt, &e, now) {
                    Ok(()) if e.view.get().leases == 0 && e.view.get().claimed == 0 => {
                        self.worker.forget_retired(&e);
                    }
                    Ok(()) => {}
                    Err(err) => {
                        self.worker.metrics.ledger_errors.inc();
                        host::warn(&format!(
                            "kvgate: reaper at retired {}: {err}",
                            e.name(&rt.cfg)
                        ));
                    }
                }
            }
            self.worker.metrics.observe(&self.worker, &rt.cfg);
        }
        if !self.worker.queue.borrow().is_empty() {
            self.drain_queue(&rt, now);
        }
        self.poll_backends(&rt, now);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter::new(context_id, Rc::clone(&self.worker))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

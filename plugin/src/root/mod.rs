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
use crate::ticket::Worker;
use crate::ticket::{Attempt, Ticket};
use crate::worker::{BackendHealth, Endpoint, Runtime};
use crate::CAS_ATTEMPTS;

mod poll;
mod queue;

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
        self.worker.observe_metrics(&cfg);
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
            self.worker.observe_metrics(&rt.cfg);
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

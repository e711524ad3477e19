//! The root context of a worker: configuration, the ledger's seeding, and a 100 ms tick that
//! reaps expired leases, retries queued requests, and polls the backend's admission API.

use std::rc::Rc;
use std::time::Duration;

use kvgate_core::config::Config;
use kvgate_core::reconcile::{drift, reconcile, BackendReport, Descriptor};
use kvgate_core::store::{self, StoreError};
use kvgate_core::{ApiError, ErrorKind, Ledger, TokenCounter};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel, MapType};

use crate::filter::{level_now, reply_error, Filter};
use crate::host::{self, EnvoyStore};
use crate::ticket::Attempt;
use crate::worker::{Runtime, Worker};
use crate::{CAS_ATTEMPTS, LEDGER_KEY};

/// The tick: fast enough for queued requests to move when budget frees.
const TICK: Duration = Duration::from_millis(100);

pub struct Root {
    worker: Rc<Worker>,
    next_reap_ms: u64,
    next_poll_ms: u64,
    poll_in_flight: Option<u32>,
    cursor: u64,
    /// The configuration as written (before a backend descriptor is applied to it).
    configured: Option<Config>,
    /// `"model": "from_backend"`: the next poll asks for the descriptor.
    want_descriptor: bool,
    descriptor_fingerprint: Option<String>,
    /// Unseen leases already logged (one warning per lease, not one per poll).
    unseen_warned: Vec<u64>,
}

impl Root {
    pub fn new() -> Root {
        Root {
            worker: Rc::new(Worker::new()),
            next_reap_ms: 0,
            next_poll_ms: 0,
            poll_in_flight: None,
            cursor: 0,
            configured: None,
            want_descriptor: false,
            descriptor_fingerprint: None,
            unseen_warned: Vec::new(),
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
        // Lease ids are drawn by the filter, so the ledger's own counter is unused. An unreadable
        // ledger is kept as it is (it may hold live leases): the configuration is accepted, and
        // every admission answers 503 kvgate_ledger_unavailable until an operator acts.
        let seeded = match store::seed(&EnvoyStore, LEDGER_KEY, || Ledger::new(capacity, 1)) {
            Ok(s) => s,
            Err(e @ StoreError::Corrupt(_)) => {
                self.worker.metrics.ledger_errors.inc();
                host::log(
                    LogLevel::Critical,
                    &format!("kvgate: admission stopped: {e}; it is kept, not replaced, since it may hold live leases; start a new ledger with a new vm_id"),
                );
                false
            }
            Err(e) => return Err(e.to_string()),
        };
        let kept = match store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            l.set_capacity(capacity)
        }) {
            Ok((_, ledger)) => {
                self.worker
                    .metrics
                    .observe(&ledger, ledger.level(&cfg.levels));
                ledger.leases().len()
            }
            Err(StoreError::Corrupt(_)) => 0,
            Err(e) => return Err(e.to_string()),
        };
        hostcalls::set_tick_period(TICK).map_err(|s| format!("set_tick_period failed: {s:?}"))?;
        host::info(&format!(
            "kvgate {} ({}) configured: capacity {} B ({} B x {}), {} B/token, context {}, tokenizer {}, model fingerprint {:016x}, backend callout {}, ledger {} with {} live leases",
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
            if seeded { "created" } else { "kept" },
            kept,
        ));
        self.want_descriptor = cfg.from_backend;
        self.next_poll_ms = 0;
        self.configured = Some(cfg.clone());
        *self.worker.runtime.borrow_mut() = Some(Rc::new(Runtime { cfg, counter }));
        Ok(())
    }

    /// Price with the served model's own spec, budget and tokenizer from now on.
    fn apply_descriptor(&mut self, d: Descriptor) -> Result<(), String> {
        let Some(base) = &self.configured else {
            return Ok(());
        };
        let started = host::now_ms();
        let cfg = base
            .with_descriptor(d.spec, d.kv_capacity_bytes, d.tokenizer, d.served)
            .map_err(|e| e.to_string())?;
        let counter = Rc::new(TokenCounter::new(&cfg.tokenizer).map_err(|e| e.to_string())?);
        let capacity = cfg.pricing.capacity_bytes;
        store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            l.set_capacity(capacity)
        })
        .map_err(|e| e.to_string())?;
        host::info(&format!(
            "kvgate: model descriptor from the backend: fingerprint {} ({} layers, {} KV heads x {}, context {}), KV budget {} B (capacity {} B), its own tokenizer; built in {} ms",
            d.fingerprint,
            d.spec.layers,
            d.spec.kv_heads,
            d.spec.head_dim,
            d.spec.context_tokens,
            d.kv_capacity_bytes,
            capacity,
            host::now_ms().saturating_sub(started),
        ));
        self.descriptor_fingerprint = Some(d.fingerprint);
        self.want_descriptor = false;
        *self.worker.runtime.borrow_mut() = Some(Rc::new(Runtime { cfg, counter }));
        Ok(())
    }

    /// Reclaim the leases of workers that are gone (heartbeat older than `owner_timeout_ms`):
    /// their requests can no longer end by themselves. A live worker's lease is never touched.
    fn reap(&self, rt: &Runtime, now: u64) -> Result<(), StoreError> {
        let ledger = store::read(&EnvoyStore, LEDGER_KEY)?;
        let timeout = rt.cfg.owner_timeout_ms;
        let gone: Vec<u64> = ledger
            .owners()
            .into_iter()
            .filter(|o| !crate::worker::owner_alive(*o, now, timeout))
            .collect();
        if gone.is_empty()
            && ledger.next_deadline().is_none_or(|d| d > now)
            && ledger.next_claim_expiry().is_none_or(|d| d > now)
        {
            self.worker
                .metrics
                .observe(&ledger, self.worker.level(&ledger, &rt.cfg));
            return Ok(());
        }
        let (reaped, ledger) = store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            l.reap(now, |o| !gone.contains(&o))
        })?;
        for lease in &reaped {
            if lease.owner == 0 {
                host::warn(&format!(
                    "kvgate: reaped ownerless lease {} ({} B, class {}) {} ms past its deadline",
                    lease.id,
                    lease.bytes,
                    lease.class,
                    now.saturating_sub(lease.deadline_ms)
                ));
            } else {
                host::warn(&format!(
                    "kvgate: reaped lease {} ({} B, class {}): its worker {:016x} has sent no heartbeat for over {timeout} ms",
                    lease.id, lease.bytes, lease.class, lease.owner
                ));
            }
        }
        self.worker.metrics.reaped.add(reaped.len() as u64);
        self.worker
            .metrics
            .observe(&ledger, self.worker.level(&ledger, &rt.cfg));
        Ok(())
    }

    /// Answer queued requests whose wait ran out, then admit from the front while budget allows.
    fn drain_queue(&self, rt: &Runtime, now: u64) {
        let expired = self.worker.queue.borrow_mut().expire(now);
        for e in expired {
            self.worker.metrics.queued.add_signed(-1);
            if hostcalls::set_effective_context(e.item.context_id).is_err() {
                continue; // the stream is gone
            }
            let err = ApiError::new(
                ErrorKind::QueueTimeout,
                format!(
                    "The request waited the class {} limit for KV cache budget without it freeing up. Retry after the time in the Retry-After header.",
                    e.class
                ),
            )
            .with_retry_after_ms(rt.cfg.retry_after.min_ms);
            reply_error(&self.worker, &err, level_now(&self.worker, rt));
        }
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
            if hostcalls::set_effective_context(ticket.context_id).is_err() {
                self.worker.queue.borrow_mut().pop_front();
                self.worker.metrics.queued.add_signed(-1);
                continue;
            }
            match ticket.attempt(&self.worker, rt) {
                Attempt::Admitted { ready } => {
                    self.worker.queue.borrow_mut().pop_front();
                    self.worker.metrics.queued.add_signed(-1);
                    if ready {
                        let _ = hostcalls::resume_http_request();
                    }
                }
                // Strict order: the front waits for budget; nothing jumps ahead of it.
                Attempt::Rejected(e) if e.kind == ErrorKind::KvCapacityExceeded => break,
                Attempt::Rejected(e) => {
                    self.worker.queue.borrow_mut().pop_front();
                    self.worker.metrics.queued.add_signed(-1);
                    reply_error(&self.worker, &e, level_now(&self.worker, rt));
                }
            }
        }
    }

    fn poll_backend(&mut self, rt: &Runtime, now: u64) {
        let Some(b) = &rt.cfg.backend else { return };
        if self.poll_in_flight.is_some() || now < self.next_poll_ms {
            return;
        }
        self.next_poll_ms = now + b.poll_ms;
        let include = if self.want_descriptor {
            "&include=tokenizer"
        } else {
            ""
        };
        let path = format!("{}?since={}{include}", b.leases_path, self.cursor);
        match host::call_backend(b, "GET", &path) {
            Ok(token) => self.poll_in_flight = Some(token),
            Err(s) => self.poll_failed(rt, &format!("dispatch failed: {s:?}")),
        }
    }

    fn poll_failed(&self, rt: &Runtime, why: &str) {
        let Some(b) = &rt.cfg.backend else { return };
        self.worker.metrics.backend_poll_failures.inc();
        let mut h = self.worker.backend();
        h.polled = true;
        h.failures += 1;
        // One line when it goes down (also when it was never up), not one per failed poll.
        if h.failures == b.down_after_failures {
            host::warn(&format!(
                "kvgate: backend {} is down after {} failed polls: {why}",
                b.cluster, h.failures
            ));
        }
        if h.failures >= b.down_after_failures {
            h.up = false;
            self.worker.metrics.backend_up.set(0);
        }
        self.worker.set_backend(&h);
        // The level gauge follows at once (red while down), not at the next reaper pass.
        if let Ok(ledger) = store::read(&EnvoyStore, LEDGER_KEY) {
            self.worker
                .metrics
                .observe(&ledger, self.worker.level(&ledger, &rt.cfg));
        }
    }

    fn poll_answered(&mut self, rt: &Runtime, body_size: usize) {
        let Some(b) = &rt.cfg.backend else { return };
        let status = abi_status();
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        if status != Some(200) {
            return self.poll_failed(rt, &format!("status {status:?}"));
        }
        let report = match BackendReport::parse(&body) {
            Ok(r) => r,
            Err(e) => return self.poll_failed(rt, &e),
        };
        self.follow_descriptor(&body, &report);
        let now = host::now_ms();
        let done = store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            reconcile(l, &report, now, b.lost_grace_ms)
        });
        let (rec, ledger) = match done {
            Ok(v) => v,
            Err(e) => {
                self.worker.metrics.ledger_errors.inc();
                return host::warn(&format!("kvgate: reconcile: {e}"));
            }
        };
        self.cursor = report.cursor;
        // One line per lease when it first counts as unseen; it stays in the ledger.
        let mut warned = std::mem::take(&mut self.unseen_warned);
        warned.retain(|id| rec.unseen.iter().any(|l| l.id == *id));
        for l in &rec.unseen {
            if !warned.contains(&l.id) {
                warned.push(l.id);
                host::warn(&format!(
                    "kvgate: drift: lease {} ({} B, class {}) is unknown to the backend {} ms after admission; kept until its request ends",
                    l.id,
                    l.bytes,
                    l.class,
                    now.saturating_sub(l.created_ms)
                ));
            }
        }
        self.unseen_warned = warned;
        self.worker
            .metrics
            .released_by_backend
            .add(rec.released.len() as u64);
        self.worker
            .metrics
            .unseen_leases
            .set(rec.unseen.len() as u64);
        self.worker.metrics.unseen_bytes.set(rec.unseen_bytes());
        let d = drift(&ledger, &report);
        let was_over =
            self.worker.backend().drift_bytes.unsigned_abs() > u128::from(b.drift_warn_bytes);
        // Edge-triggered: one line when the gap crosses the threshold, not one per poll.
        if d.unsigned_abs() > u128::from(b.drift_warn_bytes) && !was_over {
            host::warn(&format!(
                "kvgate: drift {d} B between the ledger ({} B committed) and the backend ({} B used) exceeds {} B",
                ledger.committed(),
                report.used_bytes,
                b.drift_warn_bytes
            ));
        }
        let before = self.worker.backend();
        if !before.up && before.polled {
            host::info(&format!("kvgate: backend {} is up again", b.cluster));
        }
        let h = crate::worker::BackendHealth {
            polled: true,
            up: true,
            failures: 0,
            used_bytes: report.used_bytes,
            capacity_bytes: report.capacity_bytes,
            drift_bytes: d,
            last_ok_ms: now,
            unseen_bytes: rec.unseen_bytes(),
        };
        self.worker.set_backend(&h);
        let m = &self.worker.metrics;
        m.backend_up.set(1);
        m.backend_used_bytes.set(report.used_bytes);
        m.drift_bytes
            .set(u64::try_from(d.unsigned_abs()).unwrap_or(u64::MAX));
        m.observe(&ledger, self.worker.level(&ledger, &rt.cfg));
    }
}

impl Root {
    /// `"model": "from_backend"`: take the descriptor when asked for, and ask again when the
    /// backend's fingerprint changes (live leases keep the fingerprint that priced them).
    fn follow_descriptor(&mut self, body: &[u8], report: &BackendReport) {
        if !self.configured.as_ref().is_some_and(|c| c.from_backend) {
            return;
        }
        if self.want_descriptor {
            match Descriptor::parse(body) {
                Ok(Some(d)) => {
                    if let Err(e) = self.apply_descriptor(d) {
                        host::warn(&format!("kvgate: model descriptor refused: {e}"));
                    }
                }
                Ok(None) => {}
                Err(e) => host::warn(&format!("kvgate: model descriptor unreadable: {e}")),
            }
        } else if report.fingerprint.is_some() && report.fingerprint != self.descriptor_fingerprint
        {
            host::info(&format!(
                "kvgate: the backend's model fingerprint changed ({:?} -> {:?}); fetching its descriptor",
                self.descriptor_fingerprint, report.fingerprint
            ));
            self.want_descriptor = true;
            self.next_poll_ms = 0;
        }
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
        if self.poll_in_flight != Some(token) {
            // A preemption cancel sent while the tick admitted from the queue.
            self.worker.cancel_answered(token);
            return;
        }
        self.poll_in_flight = None;
        if let Some(rt) = self.worker.runtime() {
            self.poll_answered(&rt, body_size);
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
        self.worker.refresh_backend();
        if now >= self.next_reap_ms {
            self.next_reap_ms = now + rt.cfg.tick_ms;
            if let Err(e) = self.reap(&rt, now) {
                self.worker.metrics.ledger_errors.inc();
                host::warn(&format!("kvgate: reaper: {e}"));
            }
        }
        if !self.worker.queue.borrow().is_empty() {
            self.drain_queue(&rt, now);
        }
        self.poll_backend(&rt, now);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter::new(context_id, Rc::clone(&self.worker))))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

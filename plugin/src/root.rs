//! The root context: configuration, the ledger's seeding, the reaper tick, and metrics.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use kvgate_core::config::Config;
use kvgate_core::retry::splitmix64;
use kvgate_core::store::{self, StoreError};
use kvgate_core::{ErrorKind, Ledger, TokenCounter};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};

use crate::filter::Filter;
use crate::host::{self, EnvoyStore, Metric};
use crate::{CAS_ATTEMPTS, LEDGER_KEY};

/// What a request needs from the configuration; replaced whole on reconfiguration.
pub struct Runtime {
    pub cfg: Config,
    pub counter: Rc<TokenCounter>,
    lease_ids: Rc<LeaseIds>,
}

impl Runtime {
    pub fn next_lease_id(&self) -> u64 {
        self.lease_ids.next()
    }
}

/// Lease ids drawn without coordination between workers and gateways: a per-VM random seed
/// (WASI random) stepped by a counter through SplitMix64, kept below 2^53 so JSON clients read
/// them exactly. A collision among live leases is a ~n²/2^54 event, and the ledger refuses it.
pub struct LeaseIds {
    seed: u64,
    counter: std::cell::Cell<u64>,
}

impl LeaseIds {
    fn new() -> LeaseIds {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(host::now_nanos());
        LeaseIds {
            seed: h.finish(),
            counter: std::cell::Cell::new(0),
        }
    }

    fn next(&self) -> u64 {
        let n = self.counter.get().wrapping_add(1);
        self.counter.set(n);
        (splitmix64(self.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 11).max(1)
    }
}

pub struct Metrics {
    pub admitted: Metric,
    pub degraded: Metric,
    pub released: Metric,
    pub reaped: Metric,
    pub release_unknown: Metric,
    pub ledger_errors: Metric,
    rejected: Vec<(ErrorKind, Metric)>,
    pub committed_bytes: Metric,
    pub capacity_bytes: Metric,
    pub level: Metric,
    pub live_leases: Metric,
}

impl Metrics {
    fn define() -> Metrics {
        let rejected = [
            ErrorKind::InvalidRequest,
            ErrorKind::BodyTooLarge,
            ErrorKind::ContextLengthExceeded,
            ErrorKind::KvRequestTooLarge,
            ErrorKind::KvCapacityExceeded,
            ErrorKind::Internal,
        ]
        .into_iter()
        .map(|k| (k, Metric::counter(&format!("kvgate.rejected.{}", k.code()))))
        .collect();
        Metrics {
            admitted: Metric::counter("kvgate.admitted"),
            degraded: Metric::counter("kvgate.degraded"),
            released: Metric::counter("kvgate.released"),
            reaped: Metric::counter("kvgate.reaped"),
            release_unknown: Metric::counter("kvgate.release_unknown"),
            ledger_errors: Metric::counter("kvgate.ledger_errors"),
            rejected,
            committed_bytes: Metric::gauge("kvgate.committed_bytes"),
            capacity_bytes: Metric::gauge("kvgate.capacity_bytes"),
            level: Metric::gauge("kvgate.level"),
            live_leases: Metric::gauge("kvgate.live_leases"),
        }
    }

    pub fn rejected(&self, kind: ErrorKind) {
        if let Some((_, m)) = self.rejected.iter().find(|(k, _)| *k == kind) {
            m.inc();
        }
    }

    /// Gauges mirror the global ledger; every worker writes the same values.
    pub fn observe(&self, ledger: &Ledger, cfg: &Config) {
        self.committed_bytes.set(ledger.committed());
        self.capacity_bytes.set(ledger.capacity());
        self.level.set(ledger.level(&cfg.levels).as_gauge());
        self.live_leases.set(ledger.leases().len() as u64);
    }
}

pub struct Root {
    runtime: Rc<RefCell<Option<Rc<Runtime>>>>,
    metrics: Rc<Metrics>,
    lease_ids: Rc<LeaseIds>,
}

impl Root {
    pub fn new() -> Root {
        Root {
            runtime: Rc::new(RefCell::new(None)),
            metrics: Rc::new(Metrics::define()),
            lease_ids: Rc::new(LeaseIds::new()),
        }
    }

    fn current(&self) -> Option<Rc<Runtime>> {
        self.runtime.borrow().clone()
    }

    fn configure(&mut self, bytes: &[u8]) -> Result<(), String> {
        let cfg = Config::from_json(bytes).map_err(|e| e.to_string())?;
        // Building a tokenizer is expensive (ranks → hash maps): reuse it when unchanged.
        let counter = match self.current() {
            Some(rt) if rt.cfg.tokenizer == cfg.tokenizer => Rc::clone(&rt.counter),
            _ => Rc::new(TokenCounter::new(&cfg.tokenizer).map_err(|e| e.to_string())?),
        };
        let capacity = cfg.pricing.capacity_bytes;
        // Lease ids are drawn by the filter (`LeaseIds`), so the ledger's own counter is unused.
        let seeded = store::seed(&EnvoyStore, LEDGER_KEY, || Ledger::new(capacity, 1))
            .map_err(|e| e.to_string())?;
        let (_, ledger) = store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            l.set_capacity(capacity)
        })
        .map_err(|e| e.to_string())?;
        self.metrics.observe(&ledger, &cfg);
        if let Err(s) = hostcalls::set_tick_period(Duration::from_millis(cfg.tick_ms)) {
            return Err(format!("set_tick_period failed: {s:?}"));
        }
        host::info(&format!(
            "kvgate {} ({}) configured: capacity {} B ({} B x {}), {} B/token, context {}, tokenizer {}, model fingerprint {:016x}, ledger {} with {} live leases",
            kvgate_core::VERSION,
            option_env!("KVGATE_GIT_HASH").unwrap_or("unknown"),
            capacity,
            cfg.pricing.total_kv_bytes,
            cfg.pricing.safety_fraction,
            cfg.pricing.bytes_per_token,
            cfg.pricing.spec.context_tokens,
            counter.name(),
            cfg.pricing.spec.fingerprint(),
            if seeded { "created" } else { "kept" },
            ledger.leases().len(),
        ));
        *self.runtime.borrow_mut() = Some(Rc::new(Runtime {
            cfg,
            counter,
            lease_ids: Rc::clone(&self.lease_ids),
        }));
        Ok(())
    }

    fn reap(&self, rt: &Runtime) -> Result<(), StoreError> {
        let now = host::now_ms();
        let ledger = store::read(&EnvoyStore, LEDGER_KEY)?;
        if ledger.next_deadline().is_none_or(|d| d > now) {
            self.metrics.observe(&ledger, &rt.cfg);
            return Ok(());
        }
        let (reaped, ledger) =
            store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| l.reap(now))?;
        for lease in &reaped {
            host::warn(&format!(
                "kvgate: reaped lease {} ({} B, class {}) {} ms past its deadline; its stream never ended",
                lease.id,
                lease.bytes,
                lease.class,
                now.saturating_sub(lease.deadline_ms)
            ));
        }
        self.metrics.reaped.add(reaped.len() as u64);
        self.metrics.observe(&ledger, &rt.cfg);
        Ok(())
    }
}

impl Context for Root {}

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
        let Some(rt) = self.current() else { return };
        if let Err(e) = self.reap(&rt) {
            self.metrics.ledger_errors.inc();
            host::warn(&format!("kvgate: reaper: {e}"));
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter::new(
            self.current(),
            Rc::clone(&self.metrics),
        )))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

//! State shared by the root context and the HTTP contexts of one worker (one wasm VM): the
//! current configuration, metrics, lease-id source, the admission queue and the backend's health.
//! Never shared across workers: what all workers must agree on lives in the ledger.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::OnceLock;

use kvgate_core::config::Config;
use kvgate_core::queue::AdmissionQueue;
use kvgate_core::retry::splitmix64;
use kvgate_core::{ErrorKind, Ledger, Level, TokenCounter};

use crate::host::{self, Metric};
use crate::ticket::Ticket;

/// What a request needs from the configuration; replaced whole on reconfiguration.
pub struct Runtime {
    pub cfg: Config,
    pub counter: Rc<TokenCounter>,
}

/// The backend as this worker's polls last saw it.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackendHealth {
    pub polled: bool,
    pub up: bool,
    pub failures: u32,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub drift_bytes: i128,
    pub last_ok_ms: u64,
    /// Bytes of ledger leases the backend did not know past the grace period (drift).
    pub unseen_bytes: u64,
}

const HEALTH_KEY: &str = "kvgate.backend.v2";

impl BackendHealth {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(46);
        v.push(u8::from(self.polled));
        v.push(u8::from(self.up));
        v.extend_from_slice(&self.failures.to_le_bytes());
        v.extend_from_slice(&self.used_bytes.to_le_bytes());
        v.extend_from_slice(&self.capacity_bytes.to_le_bytes());
        v.extend_from_slice(&self.drift_bytes.to_le_bytes());
        v.extend_from_slice(&self.last_ok_ms.to_le_bytes());
        v.extend_from_slice(&self.unseen_bytes.to_le_bytes());
        v
    }

    fn decode(b: &[u8]) -> Option<BackendHealth> {
        let u64_at = |i: usize| Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
        Some(BackendHealth {
            polled: *b.first()? != 0,
            up: *b.get(1)? != 0,
            failures: u32::from_le_bytes(b.get(2..6)?.try_into().ok()?),
            used_bytes: u64_at(6)?,
            capacity_bytes: u64_at(14)?,
            drift_bytes: i128::from_le_bytes(b.get(22..38)?.try_into().ok()?),
            last_ok_ms: u64_at(38)?,
            unseen_bytes: u64_at(46)?,
        })
    }
}

/// This worker's identity as a lease owner: one per wasm VM (an Envoy worker thread), shared by
/// every root context the VM runs, so a reconfiguration that keeps the VM keeps the owner of the
/// requests still in flight.
pub fn owner_id() -> u64 {
    static OWNER: OnceLock<u64> = OnceLock::new();
    *OWNER.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(host::now_nanos());
        h.finish().max(1)
    })
}

/// The shared-data key of an owner's heartbeat (milliseconds since the epoch, little endian).
fn heartbeat_key(owner: u64) -> String {
    format!("kvgate.owner.v1.{owner:016x}")
}

/// Say this worker is alive (every tick; no CAS: only this worker writes its key).
pub fn beat(now_ms: u64) {
    let key = heartbeat_key(owner_id());
    if let Err(s) = proxy_wasm::hostcalls::set_shared_data(&key, Some(&now_ms.to_le_bytes()), None)
    {
        host::warn(&format!("kvgate: cannot write heartbeat: {s:?}"));
    }
}

/// Is `owner` alive: its heartbeat is no older than `timeout_ms`. A host error counts as alive
/// (never reclaim on doubt).
pub fn owner_alive(owner: u64, now_ms: u64, timeout_ms: u64) -> bool {
    if owner == owner_id() {
        return true;
    }
    match proxy_wasm::hostcalls::get_shared_data(&heartbeat_key(owner)) {
        Ok((Some(b), _)) => b
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .is_some_and(|t| now_ms.saturating_sub(t) <= timeout_ms),
        Ok((None, _)) => false,
        Err(_) => true,
    }
}

pub struct Worker {
    pub runtime: RefCell<Option<Rc<Runtime>>>,
    pub metrics: Metrics,
    pub queue: RefCell<AdmissionQueue<Rc<Ticket>>>,
    /// Preemption cancels in flight, by callout token: whichever context the host delivers the
    /// answer to, it reaches the ticket that is waiting for it.
    pub cancels: RefCell<HashMap<u32, Rc<Ticket>>>,
    /// The backend's health as last read from shared data (each tick) or written by this
    /// worker's own poll: the request path reads this copy and makes no host call for it.
    health: Cell<BackendHealth>,
    lease_seed: u64,
    lease_counter: Cell<u64>,
}

impl Worker {
    pub fn new() -> Worker {
        use std::hash::{BuildHasher, Hasher};
        // WASI random (through std's RandomState) mixed with the clock.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(host::now_nanos());
        Worker {
            runtime: RefCell::new(None),
            metrics: Metrics::define(),
            queue: RefCell::new(AdmissionQueue::default()),
            cancels: RefCell::new(HashMap::new()),
            lease_seed: h.finish(),
            lease_counter: Cell::new(0),
            health: Cell::new(BackendHealth::default()),
        }
    }

    pub fn runtime(&self) -> Option<Rc<Runtime>> {
        self.runtime.borrow().clone()
    }

    /// Lease ids drawn without coordination between workers and gateways: a per-VM random seed
    /// stepped through SplitMix64, below 2^53 so JSON clients read them exactly. A collision
    /// among live leases is a ~n²/2^54 event, and the ledger refuses it.
    pub fn next_lease_id(&self) -> u64 {
        let n = self.lease_counter.get().wrapping_add(1);
        self.lease_counter.set(n);
        (splitmix64(self.lease_seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 11).max(1)
    }

    /// The backend's health as the last poll of any worker saw it (Envoy shared data, so every
    /// worker reports the same level).
    pub fn backend(&self) -> BackendHealth {
        self.health.get()
    }

    /// Re-read the health any worker's poll last recorded (the root context's tick).
    pub fn refresh_backend(&self) {
        if let Ok((Some(bytes), _)) = proxy_wasm::hostcalls::get_shared_data(HEALTH_KEY) {
            if let Some(h) = BackendHealth::decode(&bytes) {
                self.health.set(h);
            }
        }
    }

    pub fn set_backend(&self, h: &BackendHealth) {
        self.health.set(*h);
        if let Err(s) = proxy_wasm::hostcalls::set_shared_data(HEALTH_KEY, Some(&h.encode()), None)
        {
            host::warn(&format!("kvgate: cannot record backend health: {s:?}"));
        }
    }

    /// The level callers see: the ledger's (held-back bytes count), at least amber while the
    /// ledger and the backend disagree past the warning threshold, red while the backend is down.
    pub fn level(&self, ledger: &Ledger, cfg: &Config) -> Level {
        let Some(callout) = &cfg.backend else {
            return ledger.level(&cfg.levels);
        };
        let b = self.backend();
        if b.polled && !b.up {
            return Level::Red;
        }
        let drifting = b.unseen_bytes > 0
            || b.drift_bytes.unsigned_abs() > u128::from(callout.drift_warn_bytes);
        let l = ledger.level(&cfg.levels);
        if drifting {
            l.max(Level::Amber)
        } else {
            l
        }
    }

    /// A preemption cancel was answered (or failed): when the ticket's last one is in, its
    /// request goes on. Returns false when the token is not a cancel of this worker.
    pub fn cancel_answered(&self, token: u32) -> bool {
        let Some(t) = self.cancels.borrow_mut().remove(&token) else {
            return false;
        };
        let left = t.pending_cancels.get().saturating_sub(1);
        t.pending_cancels.set(left);
        if left == 0 && proxy_wasm::hostcalls::set_effective_context(t.context_id).is_ok() {
            if let Err(s) = proxy_wasm::hostcalls::resume_http_request() {
                host::warn(&format!("kvgate: resume after preemption failed: {s:?}"));
            }
        }
        true
    }
}

pub struct Metrics {
    pub admitted: Metric,
    pub degraded: Metric,
    pub preempted: Metric,
    pub released: Metric,
    pub released_by_backend: Metric,
    pub reaped: Metric,
    pub unseen_leases: Metric,
    pub unseen_bytes: Metric,
    pub held_back_bytes: Metric,
    pub release_unknown: Metric,
    pub ledger_errors: Metric,
    pub backend_poll_failures: Metric,
    rejected: Vec<(ErrorKind, Metric)>,
    pub queued: Metric,
    pub committed_bytes: Metric,
    pub capacity_bytes: Metric,
    pub level: Metric,
    pub live_leases: Metric,
    pub backend_up: Metric,
    pub backend_used_bytes: Metric,
    pub drift_bytes: Metric,
}

impl Metrics {
    fn define() -> Metrics {
        let rejected = [
            ErrorKind::InvalidRequest,
            ErrorKind::BodyTooLarge,
            ErrorKind::ContextLengthExceeded,
            ErrorKind::KvRequestTooLarge,
            ErrorKind::KvCapacityExceeded,
            ErrorKind::QueueTimeout,
            ErrorKind::QueueFull,
            ErrorKind::LedgerUnavailable,
            ErrorKind::BackendUnavailable,
            ErrorKind::MethodNotAllowed,
            ErrorKind::Internal,
        ]
        .into_iter()
        .map(|k| (k, Metric::counter(&format!("kvgate.rejected.{}", k.code()))))
        .collect();
        Metrics {
            admitted: Metric::counter("kvgate.admitted"),
            degraded: Metric::counter("kvgate.degraded"),
            preempted: Metric::counter("kvgate.preempted"),
            released: Metric::counter("kvgate.released"),
            released_by_backend: Metric::counter("kvgate.released_by_backend"),
            reaped: Metric::counter("kvgate.reaped"),
            unseen_leases: Metric::gauge("kvgate.unseen_leases"),
            unseen_bytes: Metric::gauge("kvgate.unseen_bytes"),
            held_back_bytes: Metric::gauge("kvgate.held_back_bytes"),
            release_unknown: Metric::counter("kvgate.release_unknown"),
            ledger_errors: Metric::counter("kvgate.ledger_errors"),
            backend_poll_failures: Metric::counter("kvgate.backend_poll_failures"),
            rejected,
            queued: Metric::gauge("kvgate.queued"),
            committed_bytes: Metric::gauge("kvgate.committed_bytes"),
            capacity_bytes: Metric::gauge("kvgate.capacity_bytes"),
            level: Metric::gauge("kvgate.level"),
            live_leases: Metric::gauge("kvgate.live_leases"),
            backend_up: Metric::gauge("kvgate.backend_up"),
            backend_used_bytes: Metric::gauge("kvgate.backend_used_bytes"),
            drift_bytes: Metric::gauge("kvgate.drift_bytes"),
        }
    }

    pub fn rejected(&self, kind: ErrorKind) {
        if let Some((_, m)) = self.rejected.iter().find(|(k, _)| *k == kind) {
            m.inc();
        }
    }

    /// Gauges mirror the global ledger; every worker writes the same values.
    pub fn observe(&self, ledger: &Ledger, level: Level) {
        self.committed_bytes.set(ledger.committed());
        self.capacity_bytes.set(ledger.capacity());
        self.level.set(level.as_gauge());
        self.live_leases.set(ledger.leases().len() as u64);
        self.held_back_bytes.set(ledger.held_back());
    }
}

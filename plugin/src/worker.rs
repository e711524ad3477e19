//! State shared by the root context and the HTTP contexts of one worker (one wasm VM): the
//! current configuration, metrics, lease-id source, the admission queue and the backend's health.
//! Never shared across workers: what all workers must agree on lives in the ledger.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::OnceLock;

use kvgate_core::config::{Config, MAX_GATEWAY_ID};
use kvgate_core::elastic::OutputLengths;
use kvgate_core::fleet::{self, View};
use kvgate_core::queue::AdmissionQueue;
use kvgate_core::reconcile::Output;
use kvgate_core::retry::splitmix64;
use kvgate_core::store;
use kvgate_core::{ClassPolicy, Ledger, Level, Reservation, TokenCounter};

use crate::host::{self, EnvoyStore};
pub use crate::metrics::{EndpointMetrics, Metrics};
use crate::{CAS_ATTEMPTS, LEDGER_KEY};

thread_local! {
    /// Leases whose release failed (every compare-and-swap lost, or a host error), released
    /// again at every tick until the ledger takes them. One list per VM (a wasm VM is one
    /// thread), shared by its root contexts: see [`Worker::release_later`].
    static UNRELEASED: RefCell<Vec<(Rc<Endpoint>, u64)>> = const { RefCell::new(Vec::new()) };
}

#[cfg(test)]
thread_local! {
    /// Tests only: lease ids handed out, first to last, before any is drawn (so that a test
    /// can make two requests draw the same id).
    pub static FORCED_LEASE_IDS: RefCell<std::collections::VecDeque<u64>> =
        const { RefCell::new(std::collections::VecDeque::new()) };
}

/// What a request needs from the configuration; replaced whole on reconfiguration.
pub struct Runtime {
    pub cfg: Config,
    pub counter: Rc<TokenCounter>,
}

/// One backend endpoint as this worker's polls last saw it.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackendHealth {
    pub polled: bool,
    pub up: bool,
    /// The backend refused an admitted request (its own 429) since its last poll: chosen again
    /// after the next poll.
    pub full: bool,
    /// Serves another model than the descriptor this gateway prices with.
    pub mismatch: bool,
    pub failures: u32,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub drift_bytes: i128,
    pub last_ok_ms: u64,
    /// Bytes of ledger leases the backend did not know past the grace period (drift).
    pub unseen_bytes: u64,
    /// How many such leases.
    pub unseen_leases: u64,
    /// Bytes the backend holds for leases this gateway does not own.
    pub foreign_bytes: u64,
    pub foreign_leases: u64,
    /// Other gateways admitting onto it, as its last poll found them: the room free then is
    /// shared with them until the next poll.
    pub other_gateways: u64,
}

impl BackendHealth {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(88);
        v.push(u8::from(self.polled));
        v.push(u8::from(self.up));
        v.extend_from_slice(&self.failures.to_le_bytes());
        v.extend_from_slice(&self.used_bytes.to_le_bytes());
        v.extend_from_slice(&self.capacity_bytes.to_le_bytes());
        v.extend_from_slice(&self.drift_bytes.to_le_bytes());
        v.extend_from_slice(&self.last_ok_ms.to_le_bytes());
        v.extend_from_slice(&self.unseen_bytes.to_le_bytes());
        v.extend_from_slice(&self.foreign_bytes.to_le_bytes());
        v.extend_from_slice(&self.foreign_leases.to_le_bytes());
        v.push(u8::from(self.full));
        v.push(u8::from(self.mismatch));
        v.extend_from_slice(&self.unseen_leases.to_le_bytes());
        v.extend_from_slice(&self.other_gateways.to_le_bytes());
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
            foreign_bytes: u64_at(54)?,
            foreign_leases: u64_at(62)?,
            full: *b.get(70)? != 0,
            mismatch: *b.get(71)? != 0,
            // Absent from what an older filter wrote.
            unseen_leases: u64_at(72).unwrap_or(0),
            other_gateways: u64_at(80).unwrap_or(0),
        })
    }

    /// Known to be unable to take new requests.
    pub fn down(&self) -> bool {
        self.polled && !self.up
    }
}

/// One backend endpoint: its ledger, its health, and this worker's view of its room.
pub struct Endpoint {
    /// `ip:port` (the host Envoy's override_host balancer is told to pick); `None`: the one
    /// backend behind the cluster's own balancing.
    pub address: Option<String>,
    pub ledger_key: String,
    health_key: String,
    health: Cell<BackendHealth>,
    /// Capacity and room as this worker last saw them (stale by at most a tick; the CAS decides).
    pub view: Cell<View>,
    /// Bytes this gateway's leases hold there beyond their reservations (elastic growth), as
    /// this worker's last poll saw them.
    pub grown: Cell<u64>,
    /// Its last report said `--admission reserve`: it reserves what the gateway tells it and
    /// lends and reclaims past elastic reservations, and reads the gateway's body note (which
    /// carries the reservation). Elastic classes apply only while every endpoint does; the
    /// note is written only into requests for such an endpoint.
    pub lends: Cell<bool>,
    /// This worker's last poll of it got no answer at all (Envoy's 503 or 504, or no dispatch):
    /// requests sent there wait for nothing.
    pub unreachable: Cell<bool>,
    /// Output tokens a second of one decoding sequence there, from this worker's polls (0:
    /// not known yet, or Retry-After is not estimated from progress).
    pub tokens_per_s: Cell<f64>,
    pub metrics: Option<EndpointMetrics>,
}

impl Endpoint {
    fn new(address: Option<String>) -> Endpoint {
        let (ledger_key, health_key, metrics) = match &address {
            None => (LEDGER_KEY.to_string(), HEALTH_KEY.to_string(), None),
            Some(a) => (
                format!("{LEDGER_KEY}@{a}"),
                format!("{HEALTH_KEY}@{a}"),
                Some(EndpointMetrics::define(a)),
            ),
        };
        let e = Endpoint {
            address,
            ledger_key,
            health_key,
            health: Cell::new(BackendHealth::default()),
            view: Cell::new(View::default()),
            grown: Cell::new(0),
            lends: Cell::new(false),
            unreachable: Cell::new(false),
            tokens_per_s: Cell::new(0.0),
            metrics,
        };
        // Named by its address for the homes of requests' places in line (`fleet::home`), so
        // they stay put when a new endpoint list reorders it.
        let name = e.address.as_deref().map_or(0, fleet::endpoint_name);
        e.update_view(|v| v.name = name);
        e.refresh();
        e
    }

    /// The name in logs and status.
    pub fn name<'a>(&'a self, cfg: &'a Config) -> &'a str {
        self.address
            .as_deref()
            .or(cfg.backend.as_ref().map(|b| b.cluster.as_str()))
            .unwrap_or("backend")
    }

    /// The health any worker's poll last recorded (read each tick; no host call here).
    pub fn health(&self) -> BackendHealth {
        self.health.get()
    }

    pub fn set_health(&self, h: &BackendHealth) {
        self.health.set(*h);
        if let Err(s) =
            proxy_wasm::hostcalls::set_shared_data(&self.health_key, Some(&h.encode()), None)
        {
            host::warn(&format!("kvgate: cannot record backend health: {s:?}"));
        }
        self.update_view(|_| ());
    }

    /// Re-read the health and the room (header only) other workers last recorded.
    pub fn refresh(&self) {
        self.refresh_health();
        self.refresh_room();
    }

    /// Re-read the health the last poll of any worker recorded. Every worker polls and writes
    /// it, so a worker that changes it (a failed poll counted) reads it first: a count made
    /// from its own copy, a tick old, would write "up" over another worker's "down".
    pub fn refresh_health(&self) {
        if let Ok((Some(bytes), _)) = proxy_wasm::hostcalls::get_shared_data(&self.health_key) {
            if let Some(h) = BackendHealth::decode(&bytes) {
                self.health.set(h);
                // Whether the endpoint may take a request follows its health.
                self.update_view(|_| ());
            }
        }
    }

    /// Re-read the room only (the ledger's header).
    pub fn refresh_room(&self) {
        if let Ok((Some(bytes), _)) = proxy_wasm::hostcalls::get_shared_data(&self.ledger_key) {
            if let Some(p) = fleet::peek(&bytes) {
                self.update_view(|v| v.observe_peek(&p));
            }
        }
    }

    /// Take what a ledger read or transaction showed.
    pub fn observe(&self, ledger: &Ledger) {
        self.update_view(|v| v.observe(ledger));
    }

    fn update_view(&self, f: impl FnOnce(&mut View)) {
        let mut v = self.view.get();
        f(&mut v);
        let h = self.health.get();
        v.eligible = !h.down() && !h.full && !h.mismatch;
        self.view.set(v);
    }

    /// This endpoint's level: its ledger's (held-back bytes count), at least amber while the
    /// ledger and the backend disagree past the warning threshold, red while it is down.
    pub fn level(&self, ledger: &Ledger, cfg: &Config) -> Level {
        let Some(callout) = &cfg.backend else {
            return ledger.level(&cfg.levels);
        };
        let b = self.health();
        if b.down() {
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
}

const HEALTH_KEY: &str = "kvgate.backend.v3";
/// A gateway number drawn for this Envoy when none is configured.
const GATEWAY_KEY: &str = "kvgate.gateway.v1";
/// This Envoy's instance, drawn once: its polls name it, so that a backend tells every gateway
/// of the others (even two that drew the same number).
const INSTANCE_KEY: &str = "kvgate.instance.v1";

/// The value under `key` in shared data, or `drawn` put there first when there is none. Two
/// first workers may both write (the store has no compare-and-swap on a missing key): the last
/// write stays, so a reader that must agree with the others reads the key again when it uses it.
fn drawn_once(key: &str, drawn: &[u8]) -> Vec<u8> {
    if let Some(v) = stored(key) {
        return v;
    }
    let _ = proxy_wasm::hostcalls::set_shared_data(key, Some(drawn), None);
    stored(key).unwrap_or_else(|| drawn.to_vec())
}

fn stored(key: &str) -> Option<Vec<u8>> {
    proxy_wasm::hostcalls::get_shared_data(key).ok()?.0
}

fn stored_u64(key: &str) -> Option<u64> {
    le_u64(&stored(key)?)
}

/// The first 8 bytes of a shared-data value, little endian.
fn le_u64(b: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?))
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

/// Other workers' liveness, judged by watching their heartbeats change, never by comparing
/// one clock with another: a clock stepped forward (NTP) or a process frozen for a while (a
/// paused container, a live-migrated VM) would otherwise make every other worker look silent
/// at once and reap live requests' leases. An owner is gone once its heartbeat has not
/// changed over `timeout_ms` of this worker's own watching, where each observation adds at
/// most `max_gap_ms` (a clock jump or a pause counts as one tick, not as silence); a clock
/// stepped back adds nothing.
#[derive(Debug, Default)]
pub struct OwnerWatch {
    seen: HashMap<u64, Seen>,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    /// The heartbeat as last read (`None`: no key).
    beat: Option<u64>,
    /// How long, by this worker's watching, it has not changed.
    silent_ms: u64,
    /// When this worker last read it.
    checked_ms: u64,
}

impl OwnerWatch {
    /// The owners among `owners` that are gone, by their heartbeats in shared data. This
    /// worker's own owner is never gone; a host error counts as alive (never reclaim on
    /// doubt). Owners not read for ten timeouts are forgotten.
    pub fn gone(
        &mut self,
        owners: &[u64],
        now_ms: u64,
        timeout_ms: u64,
        max_gap_ms: u64,
    ) -> Vec<u64> {
        let mut gone = Vec::new();
        for &owner in owners {
            if owner == owner_id() {
                continue;
            }
            let Ok((beat, _)) = proxy_wasm::hostcalls::get_shared_data(&heartbeat_key(owner))
            else {
                self.seen.remove(&owner);
                continue;
            };
            let beat = beat.as_deref().and_then(le_u64);
            let seen = self.seen.entry(owner).or_insert(Seen {
                beat,
                silent_ms: 0,
                checked_ms: now_ms,
            });
            if seen.beat != beat {
                seen.beat = beat;
                seen.silent_ms = 0;
            } else {
                let gap = now_ms.saturating_sub(seen.checked_ms).min(max_gap_ms);
                seen.silent_ms = seen.silent_ms.saturating_add(gap);
            }
            seen.checked_ms = now_ms;
            if seen.silent_ms > timeout_ms {
                gone.push(owner);
            }
        }
        let horizon = timeout_ms.saturating_mul(10);
        self.seen
            .retain(|_, s| now_ms.saturating_sub(s.checked_ms) <= horizon);
        gone
    }
}

/// A demotion in flight: the request waiting for it, the victim's lease id and the bytes it
/// reserved (given back to it if the backend does not confirm).
pub type Demotion<T> = (T, u64, u64);

/// A worker's state. `T` is what it queues and awaits: the filter's requests
/// (`ticket::Worker`, with the methods that read them); a parameter so that this module does
/// not depend on the ticket's, which depends on it.
pub struct Worker<T> {
    pub runtime: RefCell<Option<Rc<Runtime>>>,
    pub metrics: Metrics,
    pub queue: RefCell<AdmissionQueue<T>>,
    /// Preemption demotions in flight, by callout token: whichever context the host delivers the
    /// answer to, it reaches the ticket that is waiting for it.
    /// Each with its victim: the lease id and the bytes it reserved.
    pub demotions: RefCell<HashMap<u32, Demotion<T>>>,
    /// The backend endpoints of the current configuration (one, without `backend.endpoints`).
    pub(crate) endpoints: RefCell<Vec<Rc<Endpoint>>>,
    /// Callers (hashed) that dropped a request at once after admission, until when they get
    /// no place in the fair-retry line. This worker's own: a caller whose requests land on
    /// several workers is caught on each within as many drops.
    forfeits: RefCell<HashMap<u64, u64>>,
    /// Admitted requests sent on to their endpoint that have no response yet, by stream: when
    /// that endpoint is then known to be down they are answered at once (503 with a
    /// Retry-After) rather than left to the route's idle timeout.
    pub awaiting: RefCell<Vec<T>>,
    /// Endpoints a new configuration dropped whose ledgers may still hold leases: their
    /// requests release them as they end; the reaper keeps watching them for leases whose
    /// worker is gone, until their ledger is empty.
    retired: RefCell<Vec<Rc<Endpoint>>>,
    lease_seed: u64,
    /// This gateway's number (configured, or drawn once per Envoy in shared data).
    gateway: Cell<u16>,
    /// This Envoy's instance (drawn once per Envoy in shared data).
    instance: Cell<u64>,
    lease_counter: Cell<u64>,
    /// Output lengths each class's requests produced, from the backends' reports (elastic
    /// classes reserve a quantile of them).
    outputs: RefCell<BTreeMap<String, OutputLengths>>,
}

/// A request of over half the pool cut short by its client within this long of its admission
/// was not wanted: its caller made the line set the pool aside for nothing.
pub const DROPPED_AT_ONCE_MS: u64 = 2_000;
/// How long such a caller gets no place in the fair-retry line (plain 429s; it is still
/// admitted wherever its request simply fits).
pub const FORFEIT_MS: u64 = 60_000;
/// Most callers remembered; past it the one whose penalty ends first is forgotten.
const MAX_FORFEITS: usize = 4_096;

impl<T> Worker<T> {
    /// Send an OpenAI-style error as the local reply of the current (effective) stream, and
    /// count it.
    pub fn reply_error(&self, err: &kvgate_core::ApiError, level: Level) {
        self.metrics.rejected(err.kind);
        host::send_error(err, level.as_str());
    }

    /// Does `caller` have no place in line now?
    pub fn forfeited(&self, caller: u64, now_ms: u64) -> bool {
        self.forfeits
            .borrow()
            .get(&caller)
            .is_some_and(|until| *until > now_ms)
    }

    /// `caller` dropped a request the line served: no place in line for [`FORFEIT_MS`].
    pub fn forfeit(&self, caller: u64, now_ms: u64) {
        let mut f = self.forfeits.borrow_mut();
        f.retain(|_, until| *until > now_ms);
        if f.len() >= MAX_FORFEITS {
            if let Some(first) = f.iter().min_by_key(|(_, until)| **until).map(|(c, _)| *c) {
                f.remove(&first);
            }
        }
        f.insert(caller, now_ms.saturating_add(FORFEIT_MS));
        self.metrics.forfeited.inc();
    }

    /// The client of a request waiting in this worker's queue closed its stream: its place in
    /// the fair-retry line, on whichever endpoint's ledger holds it, stops holding bytes (they
    /// go to the places behind it now, not when the claim expires) and stays for the same
    /// request's retry.
    pub fn leave_line(&self, claim_key: u64) {
        let now = host::now_ms();
        for e in self.endpoints() {
            match kvgate_core::store::transact(
                &crate::host::EnvoyStore,
                &e.ledger_key,
                crate::CAS_ATTEMPTS,
                |l| l.leave_line(claim_key, now),
            ) {
                Ok((held, ledger)) => {
                    e.observe(&ledger);
                    if held {
                        self.metrics.left_line_holding.inc();
                    }
                }
                Err(err) => {
                    self.metrics.ledger_errors.inc();
                    host::warn(&format!(
                        "kvgate: could not take a gone client's place out of line at {}: {err}",
                        e.ledger_key
                    ));
                }
            }
        }
    }

    pub fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        // WASI random (through std's RandomState) mixed with the clock.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(host::now_nanos());
        Worker {
            runtime: RefCell::new(None),
            metrics: Metrics::define(),
            queue: RefCell::new(AdmissionQueue::default()),
            demotions: RefCell::new(HashMap::new()),
            lease_seed: h.finish(),
            lease_counter: Cell::new(0),
            endpoints: RefCell::new(Vec::new()),
            retired: RefCell::new(Vec::new()),
            awaiting: RefCell::new(Vec::new()),
            forfeits: RefCell::new(HashMap::new()),
            gateway: Cell::new(0),
            instance: Cell::new(0),
            outputs: RefCell::new(BTreeMap::new()),
        }
    }

    /// Learn the output lengths of finished requests of the configured classes.
    pub fn learn_outputs(&self, cfg: &Config, outputs: &[(String, Output)]) {
        let mut learned = self.outputs.borrow_mut();
        for (class, out) in outputs {
            if cfg.policy.get(class).is_none() {
                continue;
            }
            // An output cut at its cap counts as "at least this long" (censored).
            learned.entry(class.clone()).or_default().push_answer(
                out.tokens,
                out.at_cap,
                out.prompt_tokens,
            );
        }
    }

    /// The output tokens an elastic class reserves per sequence now for a prompt of
    /// `prompt_tokens` (0: any; before the request's own cap clamps it); `None` for a
    /// worst-case class, or an elastic one with neither enough samples nor a prior.
    pub fn elastic_allowance(&self, class: &ClassPolicy, prompt_tokens: u64) -> Option<u64> {
        let Reservation::Elastic(p) = class.reservation else {
            return None;
        };
        // Only a backend that reserves what it is told, and lends and reclaims past it, keeps
        // the guarantee; until every endpoint has said so, the worst case. A vLLM reclaims by
        // itself (it preempts and recomputes): what a sequence holds past its reservation shows
        // in its use and is held back (docs/vllm.md).
        if !self.endpoints.borrow().iter().all(|e| e.lends.get()) && !self.behind_vllm() {
            return None;
        }
        let learned = self.outputs.borrow();
        Some(p.allowance_for(learned.get(&class.name), prompt_tokens, u64::MAX))
            .filter(|a| *a < u64::MAX)
    }

    /// The backend is a vLLM (`backend.api: vllm`).
    fn behind_vllm(&self) -> bool {
        self.runtime()
            .and_then(|rt| rt.cfg.backend.as_ref().map(|b| !b.keeps_leases()))
            .unwrap_or(false)
    }

    /// What each elastic class reserves now, for `/kvgate/status`.
    pub fn elastic_status(&self, cfg: &Config) -> serde_json::Value {
        let learned = self.outputs.borrow();
        let mut out = serde_json::Map::new();
        for c in cfg.policy.classes() {
            let Reservation::Elastic(p) = c.reservation else {
                continue;
            };
            let l = learned.get(&c.name);
            out.insert(
                c.name.clone(),
                serde_json::json!({
                    "quantile": f64::from(p.quantile_permille) / 1000.0,
                    "samples": l.map_or(0, OutputLengths::len),
                    "min_samples": p.min_samples,
                    "learned_tokens": l.filter(|l| l.len() >= p.min_samples as usize)
                        .and_then(|l| l.quantile(p.quantile_permille)),
                    "prior_tokens": p.prior_tokens,
                    "by_prompt": p.by_prompt,
                    // False until every endpoint has reported `--admission reserve`: until
                    // then the class is priced at its worst case.
                    "active": self.endpoints.borrow().iter().all(|e| e.lends.get()) || self.behind_vllm(),
                    "reserved_output_tokens": self.elastic_allowance(c, 0),
                }),
            );
        }
        out.into()
    }

    pub fn runtime(&self) -> Option<Rc<Runtime>> {
        self.runtime.borrow().clone()
    }

    /// Lease ids drawn without coordination between workers (`kvgate_core::lease_id`): the
    /// gateway's number, then a per-VM random seed stepped through SplitMix64. A collision among live leases is a ~n²/2^44 event, and the ledger refuses it.
    pub fn next_lease_id(&self) -> u64 {
        #[cfg(test)]
        if let Some(id) = FORCED_LEASE_IDS.with(|f| f.borrow_mut().pop_front()) {
            return id;
        }
        let n = self.lease_counter.get().wrapping_add(1);
        self.lease_counter.set(n);
        let r = splitmix64(self.lease_seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 21;
        kvgate_core::lease_id::compose(u64::from(self.gateway.get()), r)
    }

    /// This gateway's number, as its lease ids carry it.
    pub fn gateway(&self) -> u64 {
        u64::from(self.gateway.get())
    }

    /// This Envoy's instance, as its polls name it: read again each time, so that every worker
    /// names the one the store kept, even after two first workers both drew one.
    pub fn instance(&self) -> u64 {
        stored_u64(INSTANCE_KEY).unwrap_or(self.instance.get())
    }

    /// The configured `gateway_id`, or one drawn once per Envoy (every worker reads the same
    /// shared-data key).
    fn pick_gateway(&self, cfg: &Config) -> u16 {
        if let Some(g) = cfg.gateway_id {
            return g;
        }
        let drawn = (splitmix64(self.lease_seed) % (u64::from(MAX_GATEWAY_ID) + 1)) as u16;
        drawn_once(GATEWAY_KEY, &drawn.to_le_bytes())
            .get(..2)
            .and_then(|b| b.try_into().ok())
            .map_or(drawn, u16::from_le_bytes)
    }

    fn pick_instance(&self) -> u64 {
        let drawn = splitmix64(self.lease_seed ^ 0x6b76_6761_7465_0001);
        let _ = drawn_once(INSTANCE_KEY, &drawn.to_le_bytes());
        stored_u64(INSTANCE_KEY).unwrap_or(drawn)
    }

    /// Take a new configuration's endpoint list and gateway id. Endpoints that stay keep their
    /// state; every endpoint's ledger is seeded (an existing one is kept with its leases).
    pub fn configure_endpoints(&self, cfg: &Config) {
        self.gateway.set(self.pick_gateway(cfg));
        self.instance.set(self.pick_instance());
        let wanted: Vec<Option<String>> = match cfg.backend.as_ref() {
            Some(b) if !b.endpoints.is_empty() => b.endpoints.iter().cloned().map(Some).collect(),
            _ => vec![None],
        };
        let mut old = self.endpoints.borrow().clone();
        old.extend(self.retired.borrow_mut().drain(..));
        let next: Vec<Rc<Endpoint>> = wanted
            .into_iter()
            .map(|a| {
                old.iter()
                    .find(|e| e.address == a)
                    .cloned()
                    .unwrap_or_else(|| Rc::new(Endpoint::new(a)))
            })
            .collect();
        *self.retired.borrow_mut() = old
            .into_iter()
            .filter(|e| !next.iter().any(|n| Rc::ptr_eq(n, e)))
            .collect();
        *self.endpoints.borrow_mut() = next;
    }

    /// Endpoints no longer configured whose ledgers the reaper still watches.
    pub fn retired(&self) -> Vec<Rc<Endpoint>> {
        self.retired.borrow().clone()
    }

    /// Stop watching a retired endpoint (its ledger is empty).
    pub fn forget_retired(&self, e: &Rc<Endpoint>) {
        self.retired.borrow_mut().retain(|r| !Rc::ptr_eq(r, e));
    }

    /// Give lease `lease` on `endpoint` back to its ledger, counted as released (or as already
    /// gone: released by the backend's report, reaped, or preempted), and, in the same change,
    /// give `victims` (lease id, bytes it reserved) of its preemption whose demotion is not
    /// known to be done their reservations back ([`kvgate_core::Ledger::undemote`]).
    pub fn release_lease(
        &self,
        endpoint: &Endpoint,
        lease: u64,
        victims: &[(u64, u64)],
        now: u64,
    ) -> Result<(), store::StoreError> {
        let (outcome, ledger) =
            store::transact(&EnvoyStore, &endpoint.ledger_key, CAS_ATTEMPTS, |l| {
                let outcome = l.release(lease, now);
                for (id, bytes) in victims {
                    l.undemote(*id, *bytes, now);
                }
                outcome
            })
            .inspect_err(|_| self.metrics.ledger_errors.inc())?;
        endpoint.observe(&ledger);
        if matches!(outcome, kvgate_core::ReleaseOutcome::Released(_)) {
            self.metrics.released.inc();
        } else {
            self.metrics.release_unknown.inc();
        }
        if let Some(rt) = self.runtime() {
            let level = self.level(&rt.cfg);
            self.observe_request_metrics(Some(endpoint), level);
        }
        Ok(())
    }

    /// A release that failed: tried again at every tick (`retry_releases`), by whichever root
    /// context of this VM ticks: a configuration update starts a new root context beside this
    /// one, and this one is gone once its last stream ends, while its leases' owner (the VM)
    /// keeps its heartbeat, so the reaper would never take them.
    pub fn release_later(&self, endpoint: Rc<Endpoint>, lease: u64) {
        UNRELEASED.with(|u| u.borrow_mut().push((endpoint, lease)));
    }

    /// Try the failed releases again; those that lost their races again (or met a failed host
    /// call) stay for the next tick. A ledger that is missing or unreadable will not take them
    /// later either: admission has stopped on it, and they are dropped, logged.
    pub fn retry_releases(&self, now: u64) {
        let pending = UNRELEASED.with(|u| std::mem::take(&mut *u.borrow_mut()));
        for (endpoint, lease) in pending {
            match self.release_lease(&endpoint, lease, &[], now) {
                Ok(()) => {}
                Err(store::StoreError::Contended { .. } | store::StoreError::Host(_)) => {
                    self.release_later(endpoint, lease);
                }
                Err(e) => host::warn(&format!(
                    "kvgate: release of lease {lease} dropped: {e}; its ledger cannot take it"
                )),
            }
        }
    }

    pub fn endpoints(&self) -> Vec<Rc<Endpoint>> {
        self.endpoints.borrow().clone()
    }

    /// How long a request reserving `output_tokens` per sequence is expected to decode, at the
    /// slowest endpoint's rate; 0 (unknown) until every endpoint has one.
    pub fn run_ms(&self, output_tokens: u64) -> u64 {
        let eps = self.endpoints.borrow();
        kvgate_core::reconcile::run_ms(eps.iter().map(|e| e.tokens_per_s.get()), output_tokens)
    }

    /// The endpoint at `address` (`None`: the single backend), if configured.
    pub fn endpoint(&self, address: Option<&str>) -> Option<Rc<Endpoint>> {
        self.endpoints
            .borrow()
            .iter()
            .find(|e| e.address.as_deref() == address)
            .cloned()
    }

    /// Re-read every endpoint's health and room (the root context's tick).
    pub fn refresh_endpoints(&self) {
        for e in self.endpoints.borrow().iter() {
            e.refresh();
        }
    }

    /// Re-read every endpoint's health only (a request's "is anything up?", between ticks).
    pub fn refresh_health(&self) {
        for e in self.endpoints.borrow().iter() {
            e.refresh_health();
        }
    }

    /// Every configured endpoint is known to be down (or serves another model): nothing new
    /// can be sent anywhere.
    pub fn all_down(&self) -> bool {
        let eps = self.endpoints.borrow();
        !eps.is_empty()
            && eps.iter().all(|e| {
                let h = e.health();
                h.down() || h.mismatch
            })
    }

    /// The level callers see: the fleet's, from every endpoint's view (no ledger read). Red when
    /// no endpoint is up; otherwise from the fleet's used share of the up endpoints' capacity,
    /// at least amber while an up endpoint drifts.
    pub fn level(&self, cfg: &Config) -> Level {
        let eps = self.endpoints.borrow();
        let (mut capacity, mut used, mut up, mut drifting) = (0u64, 0u64, false, false);
        for e in eps.iter() {
            let h = e.health();
            if h.down() {
                continue;
            }
            up = true;
            let v = e.view.get();
            capacity = capacity.saturating_add(v.capacity);
            used = used.saturating_add(v.capacity.saturating_sub(v.room));
            if let Some(b) = &cfg.backend {
                drifting |= h.unseen_bytes > 0
                    || h.drift_bytes.unsigned_abs() > u128::from(b.drift_warn_bytes);
            }
        }
        if !up || capacity == 0 {
            return Level::Red;
        }
        let share = used as f64 / capacity as f64;
        let l = if share >= cfg.levels.red {
            Level::Red
        } else if share >= cfg.levels.amber {
            Level::Amber
        } else {
            Level::Green
        };
        if drifting {
            l.max(Level::Amber)
        } else {
            l
        }
    }
}

/// Gauges.
impl<T> Worker<T> {
    /// Gauges mirror the ledgers (the fleet's totals, and each endpoint's); every worker writes
    /// the same values. From each endpoint's view: no ledger read. The tick, polls and
    /// reconfiguration write every endpoint's gauges; a request only the totals and its own
    /// endpoint's (`observe_request`), so its host calls do not grow with the fleet.
    pub fn observe_metrics(&self, cfg: &Config) {
        for e in self.endpoints.borrow().iter() {
            Self::observe_endpoint_metrics(e);
        }
        self.observe_totals(self.level(cfg));
    }

    /// After a request's own ledger transition on `endpoint` (`level`: the fleet's, already
    /// computed for the request).
    pub fn observe_request_metrics(&self, endpoint: Option<&Endpoint>, level: Level) {
        if let Some(e) = endpoint {
            Self::observe_endpoint_metrics(e);
        }
        self.observe_totals(level);
    }

    fn observe_endpoint_metrics(e: &Endpoint) {
        if let Some(m) = &e.metrics {
            let (v, h) = (e.view.get(), e.health());
            m.committed_bytes.set(v.committed);
            m.capacity_bytes.set(v.capacity);
            m.foreign_bytes.set(h.foreign_bytes);
            m.up.set(u64::from(!h.down()));
        }
    }

    fn observe_totals(&self, level: Level) {
        let mut t = View::default();
        let mut grown = 0u64;
        for e in self.endpoints.borrow().iter() {
            grown = grown.saturating_add(e.grown.get());
            let v = e.view.get();
            t.capacity = t.capacity.saturating_add(v.capacity);
            t.committed = t.committed.saturating_add(v.committed);
            t.held_back = t.held_back.saturating_add(v.held_back);
            t.slack = t.slack.saturating_add(v.slack);
            t.leases = t.leases.saturating_add(v.leases);
        }
        self.metrics.committed_bytes.set(t.committed);
        self.metrics.capacity_bytes.set(t.capacity);
        self.metrics.level.set(level.as_gauge());
        self.metrics.live_leases.set(t.leases);
        self.metrics.held_back_bytes.set(t.held_back);
        self.metrics.slack_bytes.set(t.slack);
        self.metrics.grown_bytes.set(grown);
    }
}

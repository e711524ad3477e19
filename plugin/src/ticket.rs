//! A priced request on its way through admission: decided at once, or parked in the worker's
//! queue and decided later by the root context. Either way the same code reserves, rewrites the
//! body, and starts the preemption cancels; the HTTP context reads the outcome to answer headers
//! and to release the lease at the end of the stream.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvgate_core::gate::{self, Decision, Priced};
use kvgate_core::retry::splitmix64;
use kvgate_core::store;
use kvgate_core::{write_cap, ApiError, ClassPolicy, ErrorKind, Lease};
use proxy_wasm::types::BufferType;
use serde_json::{Map, Value};

use crate::abi;
use crate::host::{self, EnvoyStore};
use crate::worker::{Runtime, Worker};
use crate::{CAS_ATTEMPTS, LEDGER_KEY};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    pub lease: u64,
    pub cap: u64,
    pub degraded_from: Option<u64>,
}

pub struct Ticket {
    pub context_id: u32,
    /// Fair retries: this request's place in line if it is refused.
    pub claim: Option<kvgate_core::ClaimTicket>,
    pub lease_id: u64,
    pub class: ClassPolicy,
    pub priced: Priced,
    pub body: RefCell<Map<String, Value>>,
    pub body_size: usize,
    pub granted: Cell<Option<Granted>>,
    /// The level after this ticket's last admission attempt (answers its response headers).
    pub level: Cell<Option<kvgate_core::Level>>,
    /// Preemption cancels still in flight; the request goes on when they are answered.
    pub pending_cancels: Cell<u32>,
}

pub enum Attempt {
    /// Reserved and rewritten; `ready` is false while preemption cancels are in flight.
    Admitted {
        ready: bool,
    },
    Rejected(ApiError),
}

impl Ticket {
    /// Decide and reserve (one CAS). On admission the body is rewritten with the granted cap and
    /// the preempted leases are cancelled at the backend. The effective context must be this
    /// ticket's stream.
    pub fn attempt(self: &Rc<Self>, worker: &Worker, rt: &Runtime) -> Attempt {
        let now = host::now_ms();
        let seed = splitmix64(host::now_nanos() ^ self.lease_id);
        let decided = store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            gate::decide(
                l,
                &rt.cfg,
                &self.class,
                &self.priced,
                gate::Holder {
                    lease_id: Some(self.lease_id),
                    owner: crate::worker::owner_id(),
                    claim: self.claim,
                },
                now,
                seed,
            )
        });
        let (decision, ledger) = match decided {
            Ok(v) => v,
            Err(e) => {
                worker.metrics.ledger_errors.inc();
                return Attempt::Rejected(ledger_error(&e, rt));
            }
        };
        let level = worker.level(&ledger, &rt.cfg);
        self.level.set(Some(level));
        worker.metrics.observe(&ledger, level);
        match decision {
            Decision::Rejected(err) => {
                host::info(&format!(
                    "kvgate: rejected ({}) class {} need {} B, committed {} B of {} B, retry after {} ms",
                    err.kind.code(),
                    self.class.name,
                    self.priced.price.bytes,
                    ledger.committed(),
                    ledger.capacity(),
                    err.retry_after_ms.unwrap_or(0),
                ));
                Attempt::Rejected(err)
            }
            Decision::Admitted {
                lease,
                cap,
                degraded_from,
                preempted,
            } => {
                self.granted.set(Some(Granted {
                    lease: lease.id,
                    cap,
                    degraded_from,
                }));
                worker.metrics.admitted.inc();
                if degraded_from.is_some() {
                    worker.metrics.degraded.inc();
                }
                let new_body = write_cap(&mut self.body.borrow_mut(), cap);
                if let Err(s) =
                    abi::set_buffer(BufferType::HttpRequestBody, 0, self.body_size, &new_body)
                {
                    // Half-admitted is not allowed: give the reservation back and fail clearly.
                    self.release(worker);
                    return Attempt::Rejected(ApiError::new(
                        ErrorKind::Internal,
                        format!("kvgate could not rewrite the request body ({s:?})."),
                    ));
                }
                let cancels = self.cancel_at_backend(worker, rt, &preempted);
                self.pending_cancels.set(cancels);
                Attempt::Admitted {
                    ready: cancels == 0,
                }
            }
        }
    }

    /// Ask the backend to stop the preempted sequences now; their streams end with an explicit
    /// error the client can retry. Returns the number of cancels in flight.
    fn cancel_at_backend(self: &Rc<Self>, worker: &Worker, rt: &Runtime, victims: &[Lease]) -> u32 {
        let mut sent = 0;
        for v in victims {
            worker.metrics.preempted.inc();
            host::info(&format!(
                "kvgate: preempting lease {} ({} B, class {}) for class {}",
                v.id, v.bytes, v.class, self.class.name
            ));
            if let Some(token) = cancel_lease(rt, v.id) {
                worker.cancels.borrow_mut().insert(token, Rc::clone(self));
                sent += 1;
            }
        }
        sent
    }

    /// Give the reservation back (end of stream, or a failure after admission). Idempotent.
    pub fn release(&self, worker: &Worker) {
        let Some(g) = self.granted.take() else { return };
        let now = host::now_ms();
        match store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            l.release(g.lease, now)
        }) {
            Ok((kvgate_core::ReleaseOutcome::Released(_), ledger)) => {
                worker.metrics.released.inc();
                if let Some(rt) = worker.runtime() {
                    worker
                        .metrics
                        .observe(&ledger, worker.level(&ledger, &rt.cfg));
                }
            }
            // Already released by the backend's report, reaped, or preempted: nothing to do.
            Ok((kvgate_core::ReleaseOutcome::Unknown, _)) => worker.metrics.release_unknown.inc(),
            Err(e) => {
                worker.metrics.ledger_errors.inc();
                host::warn(&format!(
                    "kvgate: release of lease {} failed: {e}; the reaper will reclaim it",
                    g.lease
                ));
            }
        }
    }
}

/// `POST` the backend's cancel endpoint for a lease (when the callout is configured). Returns
/// the callout's token when the call went out.
pub fn cancel_lease(rt: &Runtime, id: u64) -> Option<u32> {
    let b = rt.cfg.backend.as_ref()?;
    let path = b.cancel_path.replace("{id}", &id.to_string());
    match host::call_backend(b, "POST", &path) {
        Ok(token) => Some(token),
        Err(s) => {
            host::warn(&format!("kvgate: cancel of lease {id} not sent: {s:?}"));
            None
        }
    }
}

/// The client's answer when the ledger cannot be changed: nothing was reserved. An unreadable
/// ledger stops admission loudly (it is never replaced: it may hold live leases).
pub fn ledger_error(e: &store::StoreError, rt: &Runtime) -> ApiError {
    match e {
        store::StoreError::Corrupt(_) => {
            host::log(
                proxy_wasm::types::LogLevel::Critical,
                &format!("kvgate: admission stopped: {e}; start a new ledger with a new vm_id"),
            );
            ApiError::new(
                ErrorKind::LedgerUnavailable,
                "kvgate cannot read its admission ledger, so it admits nothing rather than forget live reservations. Nothing was reserved.",
            )
            .with_retry_after_ms(rt.cfg.retry_after.max_ms)
        }
        _ => {
            host::warn(&format!("kvgate: ledger: {e}"));
            ApiError::new(
                ErrorKind::Internal,
                "kvgate could not update its admission ledger; nothing was reserved. Retry shortly.",
            )
            .with_status(503)
            .with_retry_after_ms(rt.cfg.retry_after.min_ms)
        }
    }
}

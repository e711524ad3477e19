//! A priced request on its way through admission: decided at once, or parked in the worker's
//! queue and decided later by the root context. Either way the same code reserves, rewrites the
//! body, and starts the preemption demotions; the HTTP context reads the outcome to answer headers
//! and to release the lease at the end of the stream.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvgate_core::config::Mode;
use kvgate_core::fleet::{self, Placed, View};
use kvgate_core::gate::{self, Decision, Priced};
use kvgate_core::retry::splitmix64;
use kvgate_core::store;
use kvgate_core::{write_cap, ApiError, ClassPolicy, ErrorKind, GatewayNote, Lease};
use proxy_wasm::types::BufferType;
use serde_json::{Map, Value};

use crate::abi;
use crate::host::{self, EnvoyStore};
use crate::worker::{Endpoint, Runtime};

/// A worker of the filter: what it queues and awaits are its requests' tickets.
pub type Worker = crate::worker::Worker<Rc<Ticket>>;
use crate::CAS_ATTEMPTS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    pub lease: u64,
    pub cap: u64,
    pub degraded_from: Option<u64>,
    /// Admitted ahead of the fair-retry line (a backfill): when it was expected to end.
    pub went_ahead_until: Option<u64>,
    /// When it was admitted.
    pub at_ms: u64,
    /// It took bytes its place in the fair-retry line held (the line set them aside for it).
    pub from_line: bool,
}

/// How much a rewritten body may exceed `max_body_bytes`: the cap and the gateway's note it
/// adds, not numbers written out longer than the client wrote them.
const REWRITE_SLACK: u64 = 1024;

pub struct Ticket {
    pub context_id: u32,
    /// Who sent it (a hash of the mapped API key or the peer's IP): a caller that drops a
    /// request at once after the line served it loses its places in line for a while.
    pub caller: u64,
    /// Fair retries: this request's place in line if it is refused.
    pub claim: Option<kvgate_core::ClaimTicket>,
    pub lease_id: u64,
    pub class: ClassPolicy,
    /// The request at its worst case (every sequence to its cap).
    pub worst_case: Priced,
    /// As of its last try: an elastic class's allowance is chosen at each try, from what the
    /// class has learned by then (see [`Ticket::reprice`]).
    pub priced: RefCell<Priced>,
    /// The size of the request body, which stays in Envoy's buffer (the stream is paused)
    /// until admission rewrites it: a queued request holds no copy of it here.
    pub body_size: usize,
    /// The body as parsed when priced, for the first try only (then dropped: a queued request
    /// would hold several times the body's size; a later try reads the buffer again).
    pub first_body: RefCell<Option<Map<String, Value>>>,
    pub granted: Cell<Option<Granted>>,
    /// The level after this ticket's last admission attempt (answers its response headers).
    pub level: Cell<Option<kvgate_core::Level>>,
    /// Preemption demotions still in flight; the request goes on when they are answered.
    pub pending_demotions: Cell<u32>,
    /// Victims (lease id, bytes it reserved) whose demotion was not sent or not confirmed:
    /// they still hold their reservations at the backend, so this request does not go on.
    pub failed_demotions: RefCell<Vec<(u64, u64)>>,
    /// Where the lease was reserved.
    pub endpoint: RefCell<Option<Rc<Endpoint>>>,
    /// Shadow mode: what enforce would have done (the `x-kvgate-shadow` response header).
    pub shadow_note: RefCell<Option<String>>,
    /// Its place in the fair-retry line is active: the ledger sets freed bytes aside for it, so
    /// it must keep being retried (see the worker's queue). The ledger activates a claim when
    /// its request comes back: this stream's second refusal, or already the first refusal of a
    /// client's retry whose earlier try left the claim.
    pub claim_active: Cell<bool>,
    /// When its place in the fair-retry line was taken (its first refusal, on an earlier try of
    /// the same request too): the arrival its place in the worker's queue is aged from.
    pub waiting_since: Cell<Option<u64>>,
    /// Its wait in the queue ran out: its last try's refusal sends the client away with a
    /// Retry-After, so its place in line no longer `waits` here.
    pub sent_away: Cell<bool>,
}

pub enum Attempt {
    /// Reserved and rewritten; `ready` is false while preemption demotions are in flight.
    Admitted {
        ready: bool,
    },
    Rejected(ApiError),
}

/// How a ticket is tried: the whole policy, or (for a queued request behind the front) only
/// as a backfill or only where it simply fits, refusals changing nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Try {
    Full,
    Backfill,
    Plain,
}

impl Ticket {
    /// Decide and reserve (one CAS on the chosen endpoint's ledger; see `kvgate_core::fleet`).
    /// On admission the body is rewritten with the granted cap, the endpoint is named to Envoy's
    /// load balancer, and the preempted leases are cancelled at that endpoint. The effective
    /// context must be this ticket's stream.
    pub fn attempt(self: &Rc<Self>, worker: &Worker, rt: &Runtime) -> Attempt {
        self.try_admit(worker, rt, Try::Full)
    }

    /// Try a queued request that is not at the front where it simply fits (the plain pass
    /// alone): for an endpoint where nobody is in line, which the front is not waiting for. A
    /// refusal changes nothing, as a backfill's. No degrade, no preemption.
    pub fn attempt_plain(self: &Rc<Self>, worker: &Worker, rt: &Runtime) -> Attempt {
        self.try_admit(worker, rt, Try::Plain)
    }

    /// Try a queued request that is not at the front as a backfill: admitted only where the
    /// ledger lets it go ahead of the line (it is expected to be done before the line's front
    /// could start) or where it simply fits; a refusal changes nothing (no claim taken or
    /// activated, no refusal counted or logged), since its turn comes at the front. No degrade,
    /// no preemption.
    pub fn attempt_backfill(self: &Rc<Self>, worker: &Worker, rt: &Runtime) -> Attempt {
        self.try_admit(worker, rt, Try::Backfill)
    }

    /// How long this request is expected to decode once admitted (0: unknown, or backfills
    /// are off).
    pub fn run_ms(&self, worker: &Worker, cfg: &kvgate_core::config::Config) -> u64 {
        if !cfg.backfill {
            return 0;
        }
        // To its cap, for an elastic class too: a backfill goes ahead of the line, which does not
        // take back what a sequence grows past its allowance (`Ledger::settle_claims`), so it
        // must be done by its cap before the line's front could start. At its allowance, half
        // of a 0.5 quantile's backfills ran past that (live: 11 of 15 in a round) and a request
        // in line waited out its client's 60 s behind them.
        worker.run_ms(self.priced.borrow().price.cap.cap)
    }

    /// The prompt's length as this gateway counted it (the longest, with several prompts): the
    /// key an elastic class's outputs are learned and looked up by.
    pub fn prompt_tokens(&self) -> u64 {
        self.worst_case
            .prompt_tokens
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// Price this try: an elastic class reserves its allowance for this prompt as learned now
    /// (the request keeps its cap); a worst-case class, shadow mode, or a fleet with an endpoint
    /// that does not lend, the whole cap.
    pub fn reprice(&self, worker: &Worker, rt: &Runtime) {
        let allowance = (rt.cfg.mode != Mode::Shadow)
            .then(|| worker.elastic_allowance(&self.class, self.prompt_tokens()))
            .flatten();
        let priced = match allowance {
            Some(a) => self.worst_case.clone().with_allowance(&rt.cfg, a),
            None => self.worst_case.clone(),
        };
        *self.priced.borrow_mut() = priced;
    }

    fn try_admit(self: &Rc<Self>, worker: &Worker, rt: &Runtime, mode: Try) -> Attempt {
        self.reprice(worker, rt);
        let priced = self.priced.borrow().clone();
        let now = host::now_ms();
        let seed = splitmix64(host::now_nanos() ^ self.lease_id);
        let endpoints = worker.endpoints();
        let mut views: Vec<View> = endpoints.iter().map(|e| e.view.get()).collect();
        let rule = rt
            .cfg
            .backend
            .as_ref()
            .map_or_else(Default::default, |b| b.endpoint_choice);
        let run_ms = self.run_ms(worker, &rt.cfg);
        let holder = gate::Holder {
            lease_id: Some(self.lease_id),
            owner: crate::worker::owner_id(),
            claim: self.claim.map(|c| kvgate_core::ClaimTicket {
                run_ms,
                waits: c.waits && !self.sent_away.get(),
                // An elastic reservation may grow to its cap.
                grows_to: priced.price.bytes,
                ..c
            }),
        };
        // The plain pass: no degrade, no preemption; a request that does not fit changes nothing.
        let plain_class = ClassPolicy {
            action: kvgate_core::Action::Reject,
            preempts: Vec::new(),
            ..self.class.clone()
        };
        let need = priced.reserve_bytes();
        let claim_key = self.claim.map(|c| c.key);
        let shadow = rt.cfg.mode == Mode::Shadow;
        let decide = if shadow { gate::shadow } else { gate::decide };
        // A backfill try: only what the ledger admits ahead of the line; a refusal changes
        // nothing, so a queued request never takes a place in line that way.
        // Whether the admission took bytes its place in line held (set by the pass that admits).
        let from_line = Cell::new(false);
        let probe = |l: &mut kvgate_core::Ledger| -> Decision {
            gate::backfill(l, &rt.cfg, &self.class, &priced, holder, now)
                .unwrap_or_else(|| Decision::Rejected(not_ahead()))
        };
        let decided = fleet::admit(
            &EnvoyStore,
            |i| {
                endpoints
                    .get(i)
                    .map_or_else(String::new, |e| e.ledger_key.clone())
            },
            &mut views,
            need,
            rule,
            priced.prefix,
            claim_key,
            CAS_ATTEMPTS,
            |l| {
                if mode == Try::Backfill {
                    return match probe(l) {
                        d @ Decision::Admitted { .. } => Some(d),
                        Decision::Rejected(_) => None,
                    };
                }
                let own = claim_key.map_or(0, |k| l.held_for(k));
                let credit = priced.credit_in(l);
                if l.free().saturating_add(own).saturating_add(credit) < need {
                    return None;
                }
                let before = l.clone();
                match decide(l, &rt.cfg, &plain_class, &priced, holder, now, seed) {
                    d @ Decision::Admitted { .. } => {
                        from_line.set(own > 0);
                        Some(d)
                    }
                    Decision::Rejected(_) => {
                        *l = before;
                        None
                    }
                }
            },
            |l| {
                let own = claim_key.map_or(0, |k| l.held_for(k));
                let d = match mode {
                    Try::Backfill => probe(l),
                    Try::Plain => Decision::Rejected(not_ahead()),
                    Try::Full => decide(l, &rt.cfg, &self.class, &priced, holder, now, seed),
                };
                from_line.set(own > 0 && matches!(d, Decision::Admitted { .. }));
                d
            },
        );
        for (e, v) in endpoints.iter().zip(&views) {
            e.view.set(View {
                eligible: e.view.get().eligible,
                ..*v
            });
        }
        // A try from behind the front: a refusal changes nothing.
        if mode != Try::Full
            && !matches!(
                decided,
                Ok(Placed::At {
                    out: Decision::Admitted { .. },
                    ..
                })
            )
        {
            if let Err((_, e)) = &decided {
                worker.metrics.ledger_errors.inc();
                host::warn(&format!("kvgate: {mode:?} try from the queue: {e}"));
            }
            return Attempt::Rejected(not_ahead());
        }
        let level = worker.level(&rt.cfg);
        self.level.set(Some(level));
        let placed_at = match &decided {
            Ok(Placed::At { index, .. }) => endpoints.get(*index).map(|e| &**e),
            _ => None,
        };
        worker.observe_request_metrics(placed_at, level);
        let (endpoint, decision, ledger) = match decided {
            Ok(Placed::At { index, out, ledger }) => {
                let Some(e) = endpoints.get(index) else {
                    return Attempt::Rejected(ApiError::new(
                        ErrorKind::Internal,
                        "kvgate lost track of a backend endpoint; nothing was reserved. Retry.",
                    ));
                };
                (Rc::clone(e), out, ledger)
            }
            Ok(Placed::Nowhere) => {
                // Up but full (a backend refused an admitted request): wait for its next poll.
                let full = endpoints.iter().any(|e| {
                    let h = e.health();
                    h.full && !h.down() && !h.mismatch
                });
                return Attempt::Rejected(if full {
                    backends_full(rt)
                } else {
                    no_endpoint(rt)
                });
            }
            Err((_, e)) => {
                worker.metrics.ledger_errors.inc();
                return Attempt::Rejected(ledger_error(&e, rt));
            }
        };
        if shadow {
            return match decision {
                // Not recorded (its lease id was live): through without the lease, which is
                // another request's and must not end with this one.
                Decision::Rejected(err) if err.kind == ErrorKind::LeaseIdTaken => {
                    Attempt::Rejected(err)
                }
                d => self.let_through(worker, &endpoint, &d),
            };
        }
        match decision {
            Decision::Rejected(err) => {
                host::info(&format!(
                    "kvgate: rejected ({}) class {} need {} B, committed {} B of {} B at {}, retry after {} ms",
                    err.kind.code(),
                    self.class.name,
                    priced.reserve_bytes(),
                    ledger.committed(),
                    ledger.capacity(),
                    endpoint.name(&rt.cfg),
                    err.retry_after_ms.unwrap_or(0),
                ));
                if let Some(since) = claim_key.and_then(|k| ledger.waiting_since(k)) {
                    // The claim was there before this refusal (refused before, on this stream
                    // or an earlier try): it is active now.
                    if self.waiting_since.get().is_some() || since < now {
                        self.claim_active.set(true);
                    }
                    let earliest = self.waiting_since.get().map_or(since, |w| w.min(since));
                    self.waiting_since.set(Some(earliest));
                }
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
                    went_ahead_until: went_ahead(&lease).then_some(lease.eta_ms),
                    at_ms: lease.created_ms,
                    from_line: from_line.get(),
                }));
                *self.endpoint.borrow_mut() = Some(Rc::clone(&endpoint));
                worker.awaiting.borrow_mut().push(Rc::clone(self));
                worker.metrics.admitted.inc();
                if let Some(m) = &endpoint.metrics {
                    m.admitted.inc();
                }
                if went_ahead(&lease) {
                    worker.metrics.backfilled.inc();
                }
                if degraded_from.is_some() {
                    worker.metrics.degraded.inc();
                } else if priced.elastic.is_some() {
                    worker.metrics.elastic_admitted.inc();
                }
                // The victims are demoted in the ledger: until their demotions are sent, a
                // failure here gives them their bytes back with this request's release.
                *self.failed_demotions.borrow_mut() =
                    // At their whole price: a demotion ends a lease's share of a prefix charge.
                    preempted
                        .iter()
                        .map(|v| (v.id, v.bytes.saturating_add(v.credit)))
                        .collect();
                let new_body = match self.forwarded_body() {
                    Ok(mut body) => {
                        // Only for a backend known to read it (`x-kvgate-note` told it to
                        // look); another server would take it for a request field.
                        if endpoint.lends.get() {
                            GatewayNote {
                                reserve_output: priced.elastic.map(|e| e.output_tokens),
                                prompt_tokens: self.prompt_tokens(),
                            }
                            .write(&mut body);
                        }
                        // An unset cap the whole context bounds is left to the server
                        // (`Price::cap_from_context`), unless a degrade lowered it.
                        let from_context = priced.price.cap_from_context && degraded_from.is_none();
                        write_cap(&mut body, (!from_context).then_some(cap))
                    }
                    Err(e) => {
                        self.release(worker);
                        return Attempt::Rejected(e);
                    }
                };
                if new_body.len() as u64 > rt.cfg.max_body_bytes.saturating_add(REWRITE_SLACK) {
                    // Written again, the body grew past the limit (numbers such as `1e15` are
                    // written out in full): the server would refuse it after admission.
                    self.release(worker);
                    return Attempt::Rejected(ApiError::new(
                        ErrorKind::BodyTooLarge,
                        format!(
                            "The request body, as forwarded ({} bytes from the {} sent: numbers are written out in full), is larger than the gateway's limit of {} bytes.",
                            new_body.len(),
                            self.body_size,
                            rt.cfg.max_body_bytes
                        ),
                    ));
                }
                // Demotions go before the body is rewritten: if none could be sent, the request
                // is refused with its body as the client sent it (a queue class tries it again).
                self.failed_demotions.borrow_mut().clear();
                let demotions = self.demote_at_backend(worker, rt, &endpoint, &preempted);
                if demotions == 0 && !self.failed_demotions.borrow().is_empty() {
                    return Attempt::Rejected(self.undo_preemption(worker, rt));
                }
                let routed = match &endpoint.address {
                    // Envoy's override_host balancer picks this host (header_mutation copies the
                    // filter state into x-kvgate-endpoint after the buffer filter).
                    Some(a) => abi::set_property(&["kvgate_endpoint"], a.as_bytes()),
                    None => Ok(()),
                };
                let rewritten = routed.and_then(|()| {
                    abi::set_buffer(BufferType::HttpRequestBody, 0, self.body_size, &new_body)
                });
                if let Err(s) = rewritten {
                    // Half-admitted is not allowed: give the reservation back (and the victims
                    // of demotions still in flight theirs) and fail clearly.
                    worker.forget_demotions(self.context_id);
                    self.release(worker);
                    return Attempt::Rejected(ApiError::new(
                        ErrorKind::Internal,
                        format!("kvgate could not forward the admitted request ({s:?})."),
                    ));
                }
                if mode == Try::Plain {
                    // Counted once it goes on (not when refused after its admission).
                    worker.metrics.passed_in_queue.inc();
                }
                self.pending_demotions.set(demotions);
                Attempt::Admitted {
                    ready: demotions == 0,
                }
            }
        }
    }

    /// Shadow mode: count what enforce would have done, and forward the request as it came
    /// (reserved at its worst case by `gate::shadow`, routed to the chosen endpoint).
    fn let_through(
        &self,
        worker: &Worker,
        endpoint: &Rc<Endpoint>,
        decision: &Decision,
    ) -> Attempt {
        let note = match decision {
            Decision::Rejected(err) => {
                let queue = matches!(self.class.action, kvgate_core::Action::Queue { .. })
                    && err.kind == ErrorKind::KvCapacityExceeded;
                if queue {
                    worker.metrics.would_queue.inc();
                    "would_queue".to_string()
                } else {
                    worker.metrics.would_reject(err.kind);
                    format!("would_reject={}", err.kind.code())
                }
            }
            Decision::Admitted {
                degraded_from: Some(asked),
                cap,
                ..
            } => {
                worker.metrics.would_degrade.inc();
                format!("would_degrade=max_tokens:{asked}->{cap}")
            }
            Decision::Admitted { preempted, .. } if !preempted.is_empty() => {
                worker.metrics.would_preempt.add(preempted.len() as u64);
                format!("would_preempt={}", preempted.len())
            }
            Decision::Admitted { .. } => "would_admit".to_string(),
        };
        *self.shadow_note.borrow_mut() = Some(note);
        self.granted.set(Some(Granted {
            lease: self.lease_id,
            cap: self.priced.borrow().price.cap.cap,
            degraded_from: None,
            went_ahead_until: None,
            at_ms: host::now_ms(),
            from_line: false,
        }));
        *self.endpoint.borrow_mut() = Some(Rc::clone(endpoint));
        worker.metrics.admitted.inc();
        if let Some(a) = &endpoint.address {
            if let Err(s) = abi::set_property(&["kvgate_endpoint"], a.as_bytes()) {
                host::warn(&format!("kvgate: cannot name the endpoint to Envoy: {s:?}"));
            }
        }
        Attempt::Admitted { ready: true }
    }

    /// Tell the backend the preempted leases reserve nothing any more, before this request
    /// reaches it: their sequences go on in borrowed blocks, which the backend takes back for
    /// this request's reservation (they are recomputed later, their clients only delayed). A
    /// backend that cannot lend stops them, and their streams end with an explicit error the
    /// client can retry. Returns the number of demotions in flight.
    fn demote_at_backend(
        self: &Rc<Self>,
        worker: &Worker,
        rt: &Runtime,
        endpoint: &Endpoint,
        victims: &[Lease],
    ) -> u32 {
        let mut sent = 0;
        for v in victims {
            worker.metrics.preempted.inc();
            host::info(&format!(
                "kvgate: demoting lease {} ({} B, class {}) for class {} at {}",
                v.id,
                v.bytes,
                v.class,
                self.class.name,
                endpoint.name(&rt.cfg)
            ));
            match lease_call(rt, endpoint, v.id, Call::Demote) {
                Some(token) => {
                    worker.await_demotion(token, Rc::clone(self), v);
                    sent += 1;
                }
                None => {
                    worker.metrics.demote_failed.inc();
                    self.failed_demotions.borrow_mut().push((v.id, v.bytes));
                }
            }
        }
        sent
    }

    /// The body to forward: read again from Envoy's buffer (the stream is paused), without a
    /// client's copy of the gateway's own field (the note replaces it, or, for a backend that
    /// does not read notes, nothing does). It was parsed when priced; a queued request keeps
    /// no parsed copy, which takes several times the body's size.
    fn forwarded_body(&self) -> Result<Map<String, Value>, ApiError> {
        if let Some(body) = self.first_body.borrow_mut().take() {
            return Ok(body);
        }
        let unreadable = |why: String| {
            ApiError::new(
                ErrorKind::Internal,
                format!("kvgate could not read the admitted request's body again ({why})."),
            )
        };
        let raw = proxy_wasm::hostcalls::get_buffer(BufferType::HttpRequestBody, 0, self.body_size)
            .map_err(|s| unreadable(format!("{s:?}")))?
            .unwrap_or_default();
        let mut body: Map<String, Value> =
            serde_json::from_slice(&raw).map_err(|e| unreadable(e.to_string()))?;
        body.remove(kvgate_core::GATEWAY_FIELD);
        Ok(body)
    }

    /// One or more of its demotions were not sent or not confirmed: the victims' sequences
    /// still hold their reservations at the backend, so this request, admitted into their
    /// room, must not go on. Its lease is released and the victims reserve their bytes again,
    /// in the same change of the ledger (see [`Ticket::release`]). Returns the client's answer.
    pub fn undo_preemption(&self, worker: &Worker, rt: &Runtime) -> ApiError {
        self.release(worker);
        ApiError::new(
            ErrorKind::KvCapacityExceeded,
            "The model server did not confirm the preemption of lower-priority requests, so their KV cache is still in use; nothing was sent. Retry after the time in the Retry-After header.",
        )
        .with_retry_after_ms(one_poll_ms(rt))
    }

    /// The endpoint this ticket's lease is on (once admitted).
    pub fn endpoint(&self) -> Option<Rc<Endpoint>> {
        self.endpoint.borrow().clone()
    }

    /// Give the reservation back (end of stream, or a failure after admission). Idempotent.
    /// Victims of its preemption whose demotion is not known to be done (not sent, not
    /// confirmed, or still in flight when its client left) reserve their bytes again in the
    /// same change of the ledger: their sequences may still hold them at the backend.
    pub fn release(&self, worker: &Worker) {
        let Some(g) = self.granted.take() else { return };
        let Some(endpoint) = self.endpoint() else {
            return;
        };
        let victims = std::mem::take(&mut *self.failed_demotions.borrow_mut());
        let now = host::now_ms();
        // A backfill that ran past its expected end kept the line's front waiting longer than
        // the decision counted on (its run is weighed at its cap at the measured decode rate,
        // which can drop, and a prefill or a pause adds to it).
        if let Some(end) = g.went_ahead_until.filter(|end| now > *end) {
            worker.metrics.backfill_overran.inc();
            worker.metrics.backfill_overrun_ms.add(now - end);
        }
        if let Err(e) = worker.release_lease(&endpoint, g.lease, &victims, now) {
            // The worker is alive, so the reaper would never take this lease: it is released
            // again at every tick until the ledger takes it. (The victims' use, if any, is held
            // back at the next report.)
            host::warn(&format!(
                "kvgate: release of lease {} failed: {e}; retried at the next tick",
                g.lease
            ));
            worker.release_later(endpoint, g.lease);
        }
    }
}

/// Every endpoint that is up refused an admitted request (its own 429) since its last poll.
pub fn backends_full(rt: &Runtime) -> ApiError {
    ApiError::new(
        ErrorKind::KvCapacityExceeded,
        "The model servers' KV caches are full right now (they refused a request another gateway raced for). Retry after the time in the Retry-After header.",
    )
    .with_retry_after_ms(one_poll_ms(rt))
}

/// A Retry-After of one poll period (when the backend's next report tells more), within the
/// configured bounds.
fn one_poll_ms(rt: &Runtime) -> u64 {
    let poll = rt.cfg.backend.as_ref().map_or(1_000, |b| b.poll_ms);
    poll.clamp(rt.cfg.retry_after.min_ms, rt.cfg.retry_after.max_ms)
}

/// No endpoint can take requests now (every one down, or serving another model).
pub fn no_endpoint(rt: &Runtime) -> ApiError {
    ApiError::new(
        ErrorKind::BackendUnavailable,
        "No model server is answering the gateway; nothing was sent. Retry after the time in the Retry-After header.",
    )
    .with_retry_after_ms(rt.cfg.retry_after.max_ms.min(5_000))
}

/// `POST` the backend's cancel endpoint for a lease (when the callout is configured). Returns
/// the callout's token when the call went out.
/// A call about one lease to its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// Stop its sequence now (`backend.cancel_path`).
    Cancel,
    /// It reserves nothing any more (`backend.demote_path`).
    Demote,
}

/// POST `call` for lease `id` to `endpoint`; the callout's token, `None` when it could not be
/// sent (logged). Envoy sends every callout as the VM's root context's (proxy-wasm-cpp-host's
/// `http_call`), so one sent as a stream ends outlives that stream; the SDK delivers the answer
/// to the context that was active when it was sent, or drops it if that one is gone.
pub fn lease_call(rt: &Runtime, endpoint: &Endpoint, id: u64, call: Call) -> Option<u32> {
    // A vLLM keeps no leases: a request that ends early is stopped by its stream's reset.
    let b = rt.cfg.backend.as_ref().filter(|b| b.keeps_leases())?;
    let template = match call {
        Call::Cancel => &b.cancel_path,
        Call::Demote => &b.demote_path,
    };
    let path = template.replace("{id}", &id.to_string());
    match host::call_backend(b, endpoint.address.as_deref(), "POST", &path) {
        Ok(token) => Some(token),
        Err(s) => {
            host::warn(&format!("kvgate: {call:?} of lease {id} not sent: {s:?}"));
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

/// The ledger starts a lease with an expected end only when it let the request go ahead of the
/// line (a backfill: see `kvgate_core::ledger`).
fn went_ahead(lease: &Lease) -> bool {
    lease.eta_ms > 0
}

/// A backfill try that did not go ahead (never answered to a client: the request stays queued).
fn not_ahead() -> ApiError {
    ApiError::new(
        ErrorKind::KvCapacityExceeded,
        "not admitted ahead of the line",
    )
}

/// The requests a worker queues and awaits.
impl Worker {
    /// Stream `context_id` has its response (or ended): nothing to answer for it any more.
    pub fn answered(&self, context_id: u32) {
        self.awaiting
            .borrow_mut()
            .retain(|t| t.context_id != context_id);
    }

    /// The admitted requests still waiting for an answer from an endpoint now known to be down
    /// and unreachable: taken out of `awaiting`, for the caller to answer.
    pub fn stranded(&self) -> Vec<Rc<Ticket>> {
        let mut awaiting = self.awaiting.borrow_mut();
        if awaiting.is_empty() {
            return Vec::new();
        }
        let (down, up): (Vec<_>, Vec<_>) = awaiting.drain(..).partition(|t| {
            t.endpoint()
                .is_some_and(|e| e.health().down() && e.unreachable.get())
        });
        *awaiting = up;
        down
    }

    /// Take the request of stream `context_id` out of the admission queue (if it is there).
    /// Whether it was there.
    pub fn unqueue(&self, context_id: u32) -> bool {
        let gone = self
            .queue
            .borrow_mut()
            .remove_where(|t| t.context_id == context_id);
        self.metrics.queued.add_signed(-(gone.len() as i64));
        !gone.is_empty()
    }

    /// A demotion of `victim` sent for request `ticket`, answered under callout `token`.
    pub fn await_demotion(&self, token: u32, ticket: Rc<Ticket>, victim: &kvgate_core::Lease) {
        let entry = (ticket, victim.id, victim.bytes);
        if self.demotions.borrow_mut().insert(token, entry).is_none() {
            // Every worker moves the same gauge: added to, never set.
            self.metrics.demotions_pending.add(1);
        }
    }

    /// The request of stream `context_id` ended: it waits for no demotion any more. The SDK
    /// delivers a callout's answer to the context that sent it, and drops it once that
    /// context is gone, so an answer after the stream's end never reaches
    /// `demotion_answered`: without this, its ticket (and the request body it holds) would
    /// stay here for the life of the VM.
    pub fn forget_demotions(&self, context_id: u32) {
        let mut d = self.demotions.borrow_mut();
        let before = d.len();
        // Their outcome is unknown now (the SDK drops an answer to a context that is gone):
        // the victims reserve their bytes again with the request's release.
        d.retain(|_, (t, victim, bytes)| {
            let mine = t.context_id == context_id;
            if mine {
                t.failed_demotions.borrow_mut().push((*victim, *bytes));
            }
            !mine
        });
        let gone = before.saturating_sub(d.len());
        if gone > 0 {
            self.metrics
                .demotions_pending
                .add_signed(-i64::try_from(gone).unwrap_or(i64::MAX));
        }
    }

    /// A preemption demotion was answered (or failed): when the ticket's last one is in, its
    /// request goes on if every one was confirmed; if one was not, the preemption is undone
    /// and its client answered 429 ([`Ticket::undo_preemption`]). Returns false when the
    /// token is not a demotion of this worker.
    pub fn demotion_answered(&self, token: u32) -> bool {
        let Some((t, victim, bytes)) = self.demotions.borrow_mut().remove(&token) else {
            return false;
        };
        self.metrics.demotions_pending.add_signed(-1);
        let status = crate::abi::header(
            proxy_wasm::types::MapType::HttpCallResponseHeaders,
            ":status",
        );
        if status.as_deref() != Some("200") {
            // Not demoted (or not known to be): the victim may still hold its reservation at
            // the backend. A backend that does not refuse on its own would run out of KV with
            // this request on top of it: it does not go on.
            self.metrics.demote_failed.inc();
            t.failed_demotions.borrow_mut().push((victim, bytes));
            host::warn(&format!(
                "kvgate: a demotion was not confirmed (status {})",
                status.as_deref().unwrap_or("none: timed out or failed")
            ));
        }
        let left = t.pending_demotions.get().saturating_sub(1);
        t.pending_demotions.set(left);
        if left > 0 || proxy_wasm::hostcalls::set_effective_context(t.context_id).is_err() {
            return true;
        }
        if t.failed_demotions.borrow().is_empty() {
            if let Err(s) = proxy_wasm::hostcalls::resume_http_request() {
                host::warn(&format!("kvgate: resume after preemption failed: {s:?}"));
            }
        } else if let Some(rt) = self.runtime() {
            let e = t.undo_preemption(self, &rt);
            self.reply_error(&e, self.level(&rt.cfg));
        }
        true
    }
}

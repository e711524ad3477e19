//! The per-request context: strip, buffer, parse, price, reserve (or queue), forward; release
//! at the end of the stream, whatever ends it.
//!
//! Envoy turns a paused request-headers callback into "stop everything" and would never hand
//! the body over, so headers continue at once; the buffer filter configured right after this
//! one holds headers and body back from the router until this filter has decided. What must be
//! in the forwarded headers is therefore set in the headers callback: the lease id is drawn
//! there (random, unique without coordination) and reserved under that id once the body is
//! priced. A rejected request is answered locally and never reaches the backend.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvgate_core::config::PathKind;
use kvgate_core::gate;
use kvgate_core::queue::Waiting;
use kvgate_core::report::status_json;
use kvgate_core::store;
use kvgate_core::{parse_request, Action as PolicyAction, ApiError, Endpoint, ErrorKind, Level};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};
use serde_json::json;

use crate::abi;
use crate::host::{self, EnvoyStore};
use crate::ticket::Worker;
use crate::ticket::{Attempt, Ticket};
use crate::worker::{Runtime, DROPPED_AT_ONCE_MS};

const REQ: MapType = MapType::HttpRequestHeaders;
const RESP: MapType = MapType::HttpResponseHeaders;
/// Tells the backend the body carries this gateway's note, if any (see `GatewayNote`).
const NOTE_HEADER: &str = "x-kvgate-note";

pub struct Filter {
    context_id: u32,
    worker: Rc<Worker>,
    rt: Option<Rc<Runtime>>,
    /// Set for a guarded request between its headers and its decision.
    pending: Option<Pending>,
    ticket: Option<Rc<Ticket>>,
    queued: bool,
    /// The upstream response reached its end (otherwise the stream was cut short).
    response_done: bool,
    /// A request on a guarded path (shadow mode lets its refusals through).
    guarded: bool,
    /// Shadow mode: a refusal this request would have had.
    shadow_note: Option<String>,
}

struct Pending {
    endpoint: Endpoint,
    /// Who sent it (API key, else the client's IP): with the path and body, the key that
    /// recognises a retry of this request (fair retries).
    caller: Vec<u8>,
    path: String,
    lease_id: u64,
    class: String,
    body_size: usize,
}

impl Filter {
    pub fn new(context_id: u32, worker: Rc<Worker>) -> Filter {
        let rt = worker.runtime();
        Filter {
            context_id,
            worker,
            rt,
            pending: None,
            ticket: None,
            queued: false,
            response_done: false,
            guarded: false,
            shadow_note: None,
        }
    }

    /// The level from this request's own admission when there was one, else from the tick's
    /// view of the room and the health as recorded now: no ledger is read on the hot path.
    fn current_level(&self, rt: &Runtime) -> Level {
        self.ticket
            .as_ref()
            .and_then(|t| t.level.get())
            .unwrap_or_else(|| level_now(&self.worker, rt))
    }

    /// Answer locally with an error and count it. Nothing is reserved on this path.
    fn reject(&mut self, rt: &Runtime, err: &ApiError) -> Action {
        self.pending = None;
        if self.guarded && rt.cfg.mode == kvgate_core::config::Mode::Shadow {
            // Shadow: count it, send nothing, let the request through as it came. Refused
            // before it was recorded: it goes without the gateway's lease headers, or the
            // backend would run it under a lease the ledger does not have.
            self.worker.metrics.would_reject(err.kind);
            self.shadow_note = Some(format!("would_reject={}", err.kind.code()));
            for h in ["x-kvgate-lease", "x-kvgate-class", "x-kvgate-secret"] {
                let _ = abi::remove_header(REQ, h);
            }
            return Action::Continue;
        }
        self.worker.reply_error(err, self.current_level(rt));
        Action::Pause
    }

    fn serve_status(&mut self, rt: &Runtime) -> Action {
        // Health as any worker last recorded it (each ledger read below refreshes the room).
        self.worker.refresh_health();
        let mut total: Option<kvgate_core::Ledger> = None;
        let mut endpoints = Vec::new();
        for e in self.worker.endpoints() {
            let ledger = match store::read(&EnvoyStore, &e.ledger_key) {
                Ok(l) => l,
                Err(err) => {
                    let err = crate::ticket::ledger_error(&err, rt);
                    return self.reject(rt, &err);
                }
            };
            e.observe(&ledger);
            let h = e.health();
            if let Some(a) = &e.address {
                endpoints.push(json!({
                    "address": a, "up": !h.down(), "polled": h.polled, "full": h.full,
                    "other_model": h.mismatch,
                    "committed_bytes": ledger.committed(), "capacity_bytes": ledger.capacity(),
                    "free_bytes": ledger.free(), "held_back_bytes": ledger.held_back(),
                    "lendable_bytes": ledger.lendable(),
                    "lendable_to_line_bytes": ledger.lendable_to_line(),
                    "foreign_bytes": h.foreign_bytes, "foreign_leases": h.foreign_leases,
                    "other_gateways": h.other_gateways,
                    "drift_bytes": i64::try_from(h.drift_bytes).unwrap_or(i64::MAX),
                    "unseen_bytes": h.unseen_bytes, "unseen_leases": h.unseen_leases,
                    "live_leases": ledger.leases().len(),
                    "level": e.level(&ledger, &rt.cfg).as_str(),
                    "backend_used_bytes": h.used_bytes, "consecutive_failures": h.failures,
                }));
            }
            match &mut total {
                Some(t) => t.absorb(&ledger),
                None => total = Some(ledger),
            }
        }
        let Some(total) = total else {
            return Action::Continue;
        };
        let mut doc = status_json(&total, &rt.cfg, rt.counter.name());
        if let Some(o) = doc.as_object_mut() {
            o.insert("level".into(), self.worker.level(&rt.cfg).as_str().into());
            o.insert("queued".into(), self.worker.metrics.queued.get().into());
            o.insert("elastic".into(), self.worker.elastic_status(&rt.cfg));
            match (rt.cfg.backend.is_some(), endpoints.is_empty()) {
                (true, true) => {
                    let b = self
                        .worker
                        .endpoints()
                        .first()
                        .map(|e| e.health())
                        .unwrap_or_default();
                    o.insert(
                        "backend".into(),
                        json!({
                            "polled": b.polled, "up": b.up, "consecutive_failures": b.failures,
                            "used_bytes": b.used_bytes, "capacity_bytes": b.capacity_bytes,
                            "drift_bytes": i64::try_from(b.drift_bytes).unwrap_or(i64::MAX),
                            "unseen_bytes": b.unseen_bytes, "foreign_bytes": b.foreign_bytes,
                            "other_gateways": b.other_gateways,
                            "last_ok_ms": b.last_ok_ms,
                        }),
                    );
                }
                (true, false) => {
                    o.insert("endpoints".into(), endpoints.into());
                }
                _ => {}
            }
        }
        let headers = [
            ("content-type", "application/json"),
            ("cache-control", "no-store"),
        ];
        if let Err(s) = abi::send_local_response(200, &headers, doc.to_string().as_bytes()) {
            host::warn(&format!("kvgate: status reply failed: {s:?}"));
        }
        Action::Pause
    }

    /// Client-sent `x-kvgate-*` headers are never trusted (except a configured class header).
    fn strip_spoofed_headers(rt: &Runtime) {
        let Ok(headers) = hostcalls::get_map_bytes(REQ) else {
            return;
        };
        let keep = rt.cfg.policy.class_header.as_deref();
        for (name, _) in headers {
            if name.starts_with("x-kvgate-") && Some(name.as_str()) != keep {
                let _ = abi::remove_header(REQ, &name);
            }
        }
    }

    /// The whole body is here: price it, then admit, queue or reject.
    fn finish(&mut self) -> Action {
        let (Some(rt), Some(p)) = (self.rt.clone(), self.pending.take()) else {
            return Action::Continue;
        };
        let body = match hostcalls::get_buffer(BufferType::HttpRequestBody, 0, p.body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(s) => {
                let e = ApiError::new(
                    ErrorKind::Internal,
                    format!("kvgate could not read the request body ({s:?})."),
                );
                return self.reject(&rt, &e);
            }
        };
        let (req, mut obj) = match parse_request(p.endpoint, &body) {
            Ok(v) => v,
            Err(e) => return self.reject(&rt, &e),
        };
        // The gateway's own field to the backend: a client's copy is not forwarded (the note
        // replaces it, or, for a backend that does not read notes, nothing does).
        obj.remove(kvgate_core::GATEWAY_FIELD);
        // Refuse here, before reserving, what the backend would refuse.
        if let Err(e) = kvgate_core::validate(&req, &obj, &rt.cfg.served) {
            return self.reject(&rt, &e);
        }
        // At the worst case; an elastic class's allowance is chosen at each try (it moves as
        // the class learns, and a request waiting in the queue is tried again and again).
        let priced = match gate::price(&rt.cfg, &rt.counter, &req) {
            Ok(v) => v,
            Err(e) => return self.reject(&rt, &e),
        };
        let class = rt.cfg.policy.resolve(Some(&p.class)).clone();
        let caller = kvgate_core::ledger::claim_key(&p.caller, b"", b"");
        let in_line =
            rt.cfg.fair_retry_patience_ms > 0 && !self.worker.forfeited(caller, host::now_ms());
        let claim = in_line.then(|| kvgate_core::ClaimTicket {
            key: kvgate_core::ledger::claim_key(&p.caller, p.path.as_bytes(), &body),
            patience_ms: rt.cfg.fair_retry_patience_ms,
            max_line_permille: rt.cfg.max_line_permille(&class),
            // Each try sets it from the decode rate of the moment (`Ticket::run_ms`).
            run_ms: 0,
            waits: self.worker.queue.borrow().would_wait(&class),
            grows_to: 0,
        });
        let ticket = Rc::new(Ticket {
            context_id: self.context_id,
            caller,
            claim,
            lease_id: p.lease_id,
            class,
            priced: RefCell::new(priced.clone()),
            worst_case: priced,
            body_size: p.body_size,
            first_body: RefCell::new(Some(obj)),
            granted: Cell::new(None),
            level: Cell::new(None),
            pending_demotions: Cell::new(0),
            failed_demotions: RefCell::new(Vec::new()),
            endpoint: RefCell::new(None),
            shadow_note: RefCell::new(None),
            claim_active: Cell::new(false),
            waiting_since: Cell::new(None),
            sent_away: Cell::new(false),
        });
        self.ticket = Some(Rc::clone(&ticket));
        let attempt = ticket.attempt(&self.worker, &rt);
        // Whatever the first try did, the parsed body is not kept (see `Ticket::first_body`).
        drop(ticket.first_body.borrow_mut().take());
        match attempt {
            Attempt::Admitted { ready: true } => Action::Continue,
            Attempt::Admitted { ready: false } => Action::Pause,
            Attempt::Rejected(err) => {
                if let (
                    ErrorKind::KvCapacityExceeded,
                    PolicyAction::Queue {
                        max_wait_ms,
                        max_depth,
                    },
                ) = (err.kind, &ticket.class.action)
                {
                    let now = host::now_ms();
                    let pushed = self.worker.queue.borrow_mut().push(
                        Rc::clone(&ticket),
                        Waiting {
                            class: &ticket.class.name,
                            priority: ticket.class.priority,
                            // A retry keeps the age of its first refusal.
                            arrived_ms: ticket.waiting_since.get().map_or(now, |w| w.min(now)),
                            deadline_ms: now.saturating_add(*max_wait_ms),
                            max_depth: *max_depth,
                        },
                    );
                    if pushed.is_ok() {
                        self.queued = true;
                        self.worker.metrics.queued.add(1);
                        return Action::Pause;
                    }
                    let full = ApiError::new(
                        ErrorKind::QueueFull,
                        format!(
                            "The KV cache budget is spent and the admission queue of class {} is full ({max_depth} waiting). Retry after the time in the Retry-After header.",
                            ticket.class.name
                        ),
                    )
                    .with_retry_after_ms(err.retry_after_ms.unwrap_or(rt.cfg.retry_after.min_ms));
                    return self.reject(&rt, &full);
                }
                self.reject(&rt, &err)
            }
        }
    }

    /// An admitted request's response has begun: check that Envoy sent it to the endpoint it was
    /// reserved on, and take a refusal by the backend itself (its own 429: two gateways raced
    /// for its last blocks) as the end of the reservation. The backend's answer, with its
    /// Retry-After, goes to the client as it is.
    fn check_upstream(&mut self, rt: &Runtime, t: &Ticket) {
        let Some(e) = t.endpoint() else { return };
        if let Some(want) = &e.address {
            let got = abi::get_property(&["upstream", "address"]);
            if got.as_deref() != Some(want.as_bytes()) {
                self.worker.metrics.upstream_mismatch.inc();
                host::warn(&format!(
                    "kvgate: lease reserved at {want} was sent to {}; is {want} a host of cluster {} with the override_host balancer?",
                    got.as_deref().map_or("no upstream".into(), String::from_utf8_lossy),
                    rt.cfg.backend.as_ref().map_or("", |b| b.cluster.as_str()),
                ));
            }
        }
        if abi::header(RESP, ":status").as_deref() == Some("429") {
            self.worker.metrics.backend_refused.inc();
            if let Some(m) = &e.metrics {
                m.backend_refused.inc();
            }
            // From what any worker recorded last: a copy a tick old would write "up" over
            // another worker's "down".
            e.refresh_health();
            let mut h = e.health();
            if !h.full {
                h.full = true;
                e.set_health(&h);
            }
            host::info(&format!(
                "kvgate: the backend {} refused an admitted request (429); its reservation ends and it gets nothing new until its next poll",
                e.name(&rt.cfg)
            ));
            t.release(&self.worker);
        }
    }

    fn end_of_stream(&mut self) {
        if self.queued {
            self.queued = false;
            // Still in the queue: its client gave up waiting, and what its place in line holds
            // goes to the places behind it.
            if self.worker.unqueue(self.context_id) {
                if let Some(key) = self.ticket.as_ref().and_then(|t| t.claim).map(|c| c.key) {
                    self.worker.leave_line(key);
                }
            }
        }
        self.worker.forget_demotions(self.context_id);
        if let Some(t) = self.ticket.take() {
            self.worker.answered(self.context_id);
            // Cut short (client gone, reset) while the backend may still be decoding: tell it to
            // stop now, or it would hold KV the ledger no longer counts.
            if let (Some(g), Some(rt), Some(e), false) =
                (t.granted.get(), &self.rt, t.endpoint(), self.response_done)
            {
                let _ = crate::ticket::lease_call(rt, &e, g.lease, crate::ticket::Call::Cancel);
                // A request of over half the pool that the line served (it set the pool aside
                // for it), dropped at once: that drained the pool for nothing, and a client can
                // do it on demand (ask, come back at Retry-After, drop, again).
                let now = host::now_ms();
                let big = t.priced.borrow().price.bytes.saturating_mul(2) > e.view.get().capacity;
                if g.from_line && big && now.saturating_sub(g.at_ms) < DROPPED_AT_ONCE_MS {
                    self.worker.forfeit(t.caller, now);
                }
            }
            t.release(&self.worker);
        }
    }
}

impl Context for Filter {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        _body: usize,
        _trailers: usize,
    ) {
        // A preemption demotion answered (or failed: counted and logged; the backend may then
        // refuse this request until the victim ends). When the last one is in, the request
        // goes on.
        self.worker.demotion_answered(token);
    }

    fn on_done(&mut self) -> bool {
        self.end_of_stream();
        true
    }
}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(rt) = self.rt.clone() else {
            return Action::Continue;
        };
        let path = abi::header(REQ, ":path").unwrap_or_default();
        let method = abi::header(REQ, ":method").unwrap_or_default();
        if method == "GET"
            && !rt.cfg.status_path.is_empty()
            && path.split('?').next() == Some(rt.cfg.status_path.as_str())
            && reached_on_loopback()
        {
            return self.serve_status(&rt);
        }
        Self::strip_spoofed_headers(&rt);
        match rt.cfg.path_kind(&path) {
            PathKind::Guarded => {}
            PathKind::Internal => {
                // The backend's admission API is the gateway's own (its callouts do not pass
                // through this listener): refused here whatever the routes would do with it,
                // in shadow mode too. Guarded paths, the hot path, never pay for the check.
                let e = ApiError::new(ErrorKind::NotFound, "Unknown path.");
                return self.reject(&rt, &e);
            }
            PathKind::DisguisedGuarded => {
                // A catch-all route would forward it unpriced to a server that decodes it.
                let e = ApiError::invalid(
                    "path",
                    format!(
                        "The path {} is not in canonical form; send it as one of {}.",
                        kvgate_core::error::clip(&path),
                        rt.cfg.guarded_paths.join(", ")
                    ),
                );
                return self.reject(&rt, &e);
            }
            PathKind::Other => return Action::Continue,
        }
        let Some(endpoint) = Endpoint::from_path(&path) else {
            return Action::Continue;
        };
        self.guarded = true;
        if method != "POST" {
            let e = ApiError::new(
                ErrorKind::MethodNotAllowed,
                format!(
                    "{method} is not allowed on {}; use POST.",
                    path.split('?').next().unwrap_or("")
                ),
            );
            return self.reject(&rt, &e);
        }
        // Refuse an oversized body before reading any of it.
        let declared =
            abi::header(REQ, "content-length").and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > rt.cfg.max_body_bytes) {
            let e = ApiError::new(
                ErrorKind::BodyTooLarge,
                format!(
                    "The request body ({} bytes) is larger than the gateway's limit of {} bytes.",
                    declared.unwrap_or(0),
                    rt.cfg.max_body_bytes
                ),
            );
            return self.reject(&rt, &e);
        }
        // Model servers known to be down or hung get nothing new: answer at once. Health as any
        // worker last recorded it: this one's copy may be a tick old.
        if rt.cfg.backend.is_some() {
            self.worker.refresh_health();
            if self.worker.all_down() {
                return self.reject(&rt, &crate::ticket::no_endpoint(&rt));
            }
        }
        if end_of_stream {
            let e = ApiError::new(
                ErrorKind::InvalidRequest,
                "The request has no body; a JSON body is required.",
            );
            return self.reject(&rt, &e);
        }
        // The class comes from what a client cannot forge: a mapped API key, or a header the
        // operator marked trusted (config refuses an untrusted class header).
        let class_value = rt
            .cfg
            .policy
            .class_header
            .as_deref()
            .and_then(|h| abi::header(REQ, h));
        let authorization = abi::header(REQ, "authorization");
        let policy = &rt.cfg.policy;
        let property =
            |path: &[&str]| abi::get_property(path).and_then(|v| String::from_utf8(v).ok());
        let claim = policy.claim_path.as_ref().and_then(|p| {
            let path: Vec<&str> = p.iter().map(String::as_str).collect();
            property(&path)
        });
        let route = policy
            .class_from_route
            .then(|| {
                property(&[
                    "xds",
                    "route_metadata",
                    "filter_metadata",
                    "kvgate",
                    "class",
                ])
            })
            .flatten();
        let (class_policy, keyed) = policy.classify_keyed(kvgate_core::ClassSources {
            authorization: authorization.as_deref(),
            claim: claim.as_deref(),
            route: route.as_deref(),
            header: class_value.as_deref(),
        });
        let class = class_policy.name.clone();
        let lease_id = self.worker.next_lease_id();
        // Announce the lease and class; drop content-length (the body will be rewritten; the
        // buffer filter sets the new length once the whole body is known).
        let secret = rt.cfg.backend.as_ref().map_or("", |b| b.secret.as_str());
        let lease = lease_id.to_string();
        let mut told: Vec<(&str, &str)> = Vec::new();
        // A vLLM keeps no leases: it is told none of them.
        if rt.cfg.backend.as_ref().is_none_or(|b| b.keeps_leases()) {
            told.extend([
                ("x-kvgate-lease", lease.as_str()),
                ("x-kvgate-class", &class),
            ]);
            // The body this filter forwards carries its note (`kvgate`), or none: the backend
            // reads that field only beside this header, so a client's own copy is never read
            // (shadow mode and unguarded paths forward bodies unchanged).
            if rt.cfg.mode != kvgate_core::config::Mode::Shadow {
                told.push((NOTE_HEADER, "body"));
            }
        }
        if !secret.is_empty() {
            told.push(("x-kvgate-secret", secret));
        }
        let set = abi::remove_header(REQ, "content-length").and_then(|()| {
            told.iter()
                .try_for_each(|(k, v)| abi::set_header(REQ, k, v))
        });
        if let Err(s) = set {
            let err = ApiError::new(
                ErrorKind::Internal,
                format!("kvgate could not set request headers ({s:?})."),
            );
            return self.reject(&rt, &err);
        }
        // Only fair retries need to recognise the caller: by a mapped (so verified) API key,
        // else by the connection's peer, the IP without the port (a retry comes on a new
        // connection). Never by what a client writes: an unmapped Authorization is its own
        // choice, and so is X-Forwarded-For unless the HCM trusts hops (the shipped configs
        // set `use_remote_address`, so `source.address` is the peer).
        let caller = match &authorization {
            _ if rt.cfg.fair_retry_patience_ms == 0 => Vec::new(),
            Some(a) if keyed => kvgate_core::policy::bearer_key(a)
                .unwrap_or(a)
                .as_bytes()
                .to_vec(),
            _ => address_property("source")
                .map(|a| kvgate_core::addr::ip(&a).map_or(a, |ip| ip.to_string()))
                .unwrap_or_default()
                .into_bytes(),
        };
        self.pending = Some(Pending {
            endpoint,
            caller,
            path: path.clone(),
            lease_id,
            class,
            body_size: 0,
        });
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(rt) = self.rt.clone() else {
            return Action::Continue;
        };
        let Some(p) = self.pending.as_mut() else {
            // Decided already (queued or waiting on preemption demotions): hold the rest.
            return if self.queued
                || self
                    .ticket
                    .as_ref()
                    .is_some_and(|t| t.pending_demotions.get() > 0)
            {
                Action::Pause
            } else {
                Action::Continue
            };
        };
        p.body_size = body_size;
        if body_size as u64 > rt.cfg.max_body_bytes {
            let e = ApiError::new(
                ErrorKind::BodyTooLarge,
                format!(
                    "The request body is larger than the gateway's limit of {} bytes.",
                    rt.cfg.max_body_bytes
                ),
            );
            return self.reject(&rt, &e);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.finish()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // With trailers the body callback never sees end_of_stream: the trailers end the body.
        if self.pending.is_some() {
            return self.finish();
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        self.response_done |= end_of_stream;
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.response_done = true;
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.response_done |= end_of_stream;
        if self
            .ticket
            .as_ref()
            .is_some_and(|t| t.granted.get().is_some())
        {
            self.worker.answered(self.context_id);
        }
        let Some(rt) = self.rt.clone() else {
            return Action::Continue;
        };
        if let Some(t) = self.ticket.clone() {
            if t.granted.get().is_some() {
                self.check_upstream(&rt, &t);
            }
        }
        let _ = abi::set_header(RESP, "x-kvgate-level", self.current_level(&rt).as_str());
        let note = self.shadow_note.clone().or_else(|| {
            self.ticket
                .as_ref()
                .and_then(|t| t.shadow_note.borrow().clone())
        });
        if let Some(n) = note {
            let _ = abi::set_header(RESP, "x-kvgate-shadow", &n);
        }
        if let Some(g) = self.ticket.as_ref().and_then(|t| t.granted.get()) {
            let _ = abi::set_header(RESP, "x-kvgate-lease", &g.lease.to_string());
            let _ = abi::set_header(RESP, "x-kvgate-max-tokens", &g.cap.to_string());
            if let Some(asked) = g.degraded_from {
                let _ = abi::set_header(
                    RESP,
                    "x-kvgate-degraded",
                    &format!("max_tokens={asked}->{}", g.cap),
                );
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.end_of_stream();
    }
}

/// The level callers see (the fleet's), for a request that made no admission of its own: the
/// room as this worker's last tick (or transaction) saw it, at most a tick old, and the health
/// as recorded now (a small record: another worker may have seen the backend go down since this
/// one's last tick). Reading every ledger here cost a copy of each per response, health checks
/// included.
pub fn level_now(worker: &Worker, rt: &Runtime) -> Level {
    worker.refresh_health();
    worker.level(&rt.cfg)
}

/// `source.address` or `destination.address` of the downstream connection, as text.
fn address_property(side: &str) -> Option<String> {
    hostcalls::get_property(vec![side, "address"])
        .ok()
        .flatten()
        .map(|a| String::from_utf8_lossy(&a).into_owned())
}

/// Did the client connect to a loopback address of this Envoy (a listener on 127.0.0.1, or a
/// local client of one on 0.0.0.0)? The status page is answered only then: what the listener
/// accepted on, which no header can change.
fn reached_on_loopback() -> bool {
    address_property("destination")
        .and_then(|a| kvgate_core::addr::ip(&a))
        .is_some_and(|ip| ip.is_loopback())
}

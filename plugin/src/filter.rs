//! The per-request context: strip, buffer, parse, price, reserve, forward; release at the end.
//!
//! Envoy turns a paused request-headers callback into "stop everything" and would never hand
//! the body over, so headers continue at once; the buffer filter configured right after this
//! one holds headers and body back from the router until the body callback has decided. What
//! must be in the forwarded headers is therefore set in the headers callback: the lease id is
//! drawn there (random, so it is unique without coordination) and reserved under that id once
//! the body is priced. A rejected request is answered locally and never reaches the backend.

use std::rc::Rc;

use kvgate_core::gate::{self, Decision};
use kvgate_core::report::status_json;
use kvgate_core::retry::splitmix64;
use kvgate_core::store::{self, StoreError};
use kvgate_core::{parse_request, write_cap, ApiError, Endpoint, ErrorKind, Level, ReleaseOutcome};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use crate::abi;
use crate::host::{self, EnvoyStore};
use crate::root::{Metrics, Runtime};
use crate::{CAS_ATTEMPTS, LEDGER_KEY};

const REQ: MapType = MapType::HttpRequestHeaders;
const RESP: MapType = MapType::HttpResponseHeaders;

pub struct Filter {
    rt: Option<Rc<Runtime>>,
    metrics: Rc<Metrics>,
    /// Set for a guarded request until it is decided.
    pending: Option<Pending>,
    /// The reservation to release at the end of the stream.
    lease: Option<u64>,
    level: Option<Level>,
    cap: Option<u64>,
    degraded: Option<(u64, u64)>,
}

struct Pending {
    endpoint: Endpoint,
    lease_id: u64,
    class: String,
    body_size: usize,
}

impl Filter {
    pub fn new(rt: Option<Rc<Runtime>>, metrics: Rc<Metrics>) -> Filter {
        Filter {
            rt,
            metrics,
            pending: None,
            lease: None,
            level: None,
            cap: None,
            degraded: None,
        }
    }

    fn current_level(&self, rt: &Runtime) -> Level {
        match self.level {
            Some(l) => l,
            None => store::read(&EnvoyStore, LEDGER_KEY)
                .map(|l| l.level(&rt.cfg.levels))
                .unwrap_or(Level::Red),
        }
    }

    /// Answer locally with an error and count it. Nothing is reserved on this path.
    fn reject(&mut self, rt: &Runtime, err: &ApiError) -> Action {
        self.pending = None;
        self.metrics.rejected(err.kind);
        host::send_error(err, self.current_level(rt).as_str());
        Action::Pause
    }

    fn serve_status(&mut self, rt: &Runtime) -> Action {
        let body = match store::read(&EnvoyStore, LEDGER_KEY) {
            Ok(ledger) => status_json(&ledger, &rt.cfg, rt.counter.name()).to_string(),
            Err(e) => {
                let err = ApiError::new(ErrorKind::Internal, format!("kvgate: {e}"));
                return self.reject(rt, &err);
            }
        };
        let headers = [
            ("content-type", "application/json"),
            ("cache-control", "no-store"),
        ];
        if let Err(s) = abi::send_local_response(200, &headers, body.as_bytes()) {
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

    /// Announce the lease id and class, and drop content-length (the body will be rewritten;
    /// the buffer filter sets the new length once the whole body is known).
    fn prepare_forward_headers(rt: &Runtime, p: &Pending) -> Result<(), String> {
        abi::remove_header(REQ, "content-length").map_err(|s| format!("content-length: {s:?}"))?;
        abi::set_header(REQ, "x-kvgate-lease", &p.lease_id.to_string())
            .map_err(|s| format!("x-kvgate-lease: {s:?}"))?;
        abi::set_header(REQ, "x-kvgate-class", &p.class)
            .map_err(|s| format!("x-kvgate-class: {s:?}"))?;
        let _ = rt;
        Ok(())
    }

    /// The whole body is here: decide.
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
        let priced = match gate::price(&rt.cfg, &rt.counter, &req) {
            Ok(v) => v,
            Err(e) => return self.reject(&rt, &e),
        };
        let class = rt.cfg.policy.resolve(Some(&p.class));
        let now = host::now_ms();
        let seed = splitmix64(host::now_nanos() ^ p.lease_id);
        let decided = store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            gate::decide(l, &rt.cfg, class, &priced, Some(p.lease_id), now, seed)
        });
        let (decision, ledger) = match decided {
            Ok(v) => v,
            Err(e) => return self.ledger_failure(&rt, &e),
        };
        self.metrics.observe(&ledger, &rt.cfg);
        self.level = Some(ledger.level(&rt.cfg.levels));
        match decision {
            Decision::Rejected(err) => {
                host::info(&format!(
                    "kvgate: rejected ({}) class {} need {} B, committed {} B of {} B, retry after {} ms",
                    err.kind.code(),
                    class.name,
                    priced.price.bytes,
                    ledger.committed(),
                    ledger.capacity(),
                    err.retry_after_ms.unwrap_or(0),
                ));
                self.reject(&rt, &err)
            }
            Decision::Admitted {
                lease,
                cap,
                degraded_from,
            } => {
                self.lease = Some(lease.id);
                self.cap = Some(cap);
                self.metrics.admitted.inc();
                if let Some(asked) = degraded_from {
                    self.metrics.degraded.inc();
                    self.degraded = Some((asked, cap));
                }
                let new_body = write_cap(&mut obj, cap);
                if let Err(s) =
                    abi::set_buffer(BufferType::HttpRequestBody, 0, p.body_size, &new_body)
                {
                    // Half-admitted is not allowed: give the reservation back and fail clearly.
                    self.release();
                    let e = ApiError::new(
                        ErrorKind::Internal,
                        format!("kvgate could not rewrite the request body ({s:?})."),
                    );
                    return self.reject(&rt, &e);
                }
                Action::Continue
            }
        }
    }

    fn ledger_failure(&mut self, rt: &Runtime, e: &StoreError) -> Action {
        self.metrics.ledger_errors.inc();
        host::warn(&format!("kvgate: ledger: {e}"));
        let err = ApiError::new(
            ErrorKind::Internal,
            "kvgate could not update its admission ledger; nothing was reserved. Retry shortly.",
        )
        .with_status(503)
        .with_retry_after_ms(rt.cfg.retry_after.min_ms);
        self.reject(rt, &err)
    }

    fn release(&mut self) {
        let Some(id) = self.lease.take() else { return };
        let now = host::now_ms();
        match store::transact(&EnvoyStore, LEDGER_KEY, CAS_ATTEMPTS, |l| {
            l.release(id, now)
        }) {
            Ok((ReleaseOutcome::Released(_), ledger)) => {
                self.metrics.released.inc();
                if let Some(rt) = &self.rt {
                    self.metrics.observe(&ledger, &rt.cfg);
                }
            }
            // Already reaped (or released by the backend's report): nothing to do.
            Ok((ReleaseOutcome::Unknown, _)) => self.metrics.release_unknown.inc(),
            Err(e) => {
                self.metrics.ledger_errors.inc();
                host::warn(&format!(
                    "kvgate: release of lease {id} failed: {e}; the reaper will reclaim it"
                ));
            }
        }
    }
}

impl Context for Filter {
    fn on_done(&mut self) -> bool {
        self.release();
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
        if method == "GET" && path.split('?').next() == Some(rt.cfg.status_path.as_str()) {
            return self.serve_status(&rt);
        }
        Self::strip_spoofed_headers(&rt);
        if method != "POST" || !rt.cfg.guards(&path) {
            return Action::Continue;
        }
        let Some(endpoint) = Endpoint::from_path(&path) else {
            return Action::Continue;
        };
        if end_of_stream {
            let e = ApiError::new(
                ErrorKind::InvalidRequest,
                "The request has no body; a JSON body is required.",
            );
            return self.reject(&rt, &e);
        }
        let class_value = rt
            .cfg
            .policy
            .class_header
            .as_deref()
            .and_then(|h| abi::header(REQ, h));
        let class = rt.cfg.policy.resolve(class_value.as_deref()).name.clone();
        let p = Pending {
            endpoint,
            lease_id: rt.next_lease_id(),
            class,
            body_size: 0,
        };
        if let Err(e) = Self::prepare_forward_headers(&rt, &p) {
            let err = ApiError::new(
                ErrorKind::Internal,
                format!("kvgate could not set request headers ({e})."),
            );
            return self.reject(&rt, &err);
        }
        self.pending = Some(p);
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(rt) = self.rt.clone() else {
            return Action::Continue;
        };
        let Some(p) = self.pending.as_mut() else {
            return Action::Continue;
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
        self.finish()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(rt) = self.rt.clone() else {
            return Action::Continue;
        };
        let _ = abi::set_header(RESP, "x-kvgate-level", self.current_level(&rt).as_str());
        if let Some(id) = self.lease {
            let _ = abi::set_header(RESP, "x-kvgate-lease", &id.to_string());
        }
        if let Some(cap) = self.cap {
            let _ = abi::set_header(RESP, "x-kvgate-max-tokens", &cap.to_string());
        }
        if let Some((asked, granted)) = self.degraded {
            let _ = abi::set_header(
                RESP,
                "x-kvgate-degraded",
                &format!("max_tokens={asked}->{granted}"),
            );
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release();
    }
}

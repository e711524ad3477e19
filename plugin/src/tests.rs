//! The filter's state machine (headers → body → admit/queue → end, callouts, tick, reaper)
//! driven through the SDK's exported entry points against the in-memory host (`testhost`).
//! Every test asserts on what the client sees (actions, local replies, headers, the forwarded
//! body) and on the side effects: the shared-data ledger and the metrics.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvgate_core::store::{self, StoreError};
use kvgate_core::{AdmitOutcome, AdmitRequest, Ledger, RetryAfterConfig};
use proxy_wasm::types::Action;
use serde_json::{json, Value};

use crate::host::EnvoyStore;
use crate::testhost::{self, Stream, Vm, EPOCH_MS};
use crate::worker::owner_id;
use crate::LEDGER_KEY;

/// KV bytes per token of the test model (2 x 30 layers x 3 KV heads x 64 x f32).
const PER_TOKEN: u64 = 46_080;
const CONTEXT: u64 = 32_768;

/// A configuration with a budget of exactly `tokens` tokens; `extra` overrides top-level fields.
fn config(tokens: u64, extra: Value) -> String {
    let mut cfg = json!({
        "model": {"layers": 30, "kv_heads": 3, "head_dim": 64, "kv_dtype_bytes": 4,
                  "context_tokens": CONTEXT},
        "kv_budget_bytes": tokens * PER_TOKEN,
        "safety_fraction": 1.0,
        "retry_after": {"min_ms": 500, "max_ms": 10000, "jitter": 0.0, "default_lease_ms": 3000},
    });
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        cfg[k] = v;
    }
    cfg.to_string()
}

fn start(tokens: u64, extra: Value) -> Vm {
    let (vm, ok) = Vm::start(&config(tokens, extra));
    assert!(ok, "configuration refused: {:?}", logs());
    vm
}

/// A pre-tokenized completion request (counted exactly: `prompt` tokens).
fn completion(prompt: usize, max_tokens: Option<u64>) -> String {
    let mut body = json!({"model": "m", "prompt": vec![1; prompt]});
    if let Some(m) = max_tokens {
        body["max_tokens"] = m.into();
    }
    body.to_string()
}

fn ledger() -> Ledger {
    store::read(&EnvoyStore, LEDGER_KEY).expect("a readable ledger")
}

fn logs() -> Vec<String> {
    testhost::with(|h| h.logs.iter().map(|(_, m)| m.clone()).collect())
}

fn lease_of(s: Stream) -> u64 {
    Vm::request_header(s, "x-kvgate-lease")
        .expect("the lease id is announced in the request headers")
        .parse()
        .expect("a numeric lease id")
}

/// Put a lease straight into the shared ledger, as another request (or worker) would have.
fn put_lease(id: u64, tokens: u64, class: &str, priority: u8, owner: u64) {
    let now = Vm::now_ms();
    let (out, _) = store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| {
        l.try_admit(
            &AdmitRequest {
                id: Some(id),
                bytes: tokens * PER_TOKEN,
                class,
                priority,
                fingerprint: 0,
                now_ms: now,
                ttl_ms: 1_000,
                owner,
            },
            &RetryAfterConfig::default(),
            0,
        )
    })
    .unwrap();
    assert!(matches!(out, AdmitOutcome::Admitted { .. }), "{out:?}");
}

fn heartbeat_key(owner: u64) -> String {
    format!("kvgate.owner.v1.{owner:016x}")
}

fn write_heartbeat(owner: u64, at_ms: u64) {
    testhost::with(|h| {
        h.shared
            .insert(heartbeat_key(owner), (at_ms.to_le_bytes().to_vec(), 1));
    });
}

fn calls_to(path_part: &str) -> Vec<testhost::Call> {
    Vm::calls()
        .into_iter()
        .filter(|c| c.header(":path").is_some_and(|p| p.contains(path_part)))
        .collect()
}

// ---- 1. headers → body → admitted → end ----------------------------------------------------

#[test]
fn an_admitted_request_is_rewritten_reserved_under_this_worker_and_released_at_its_end() {
    let mut vm = start(100_000, json!({}));
    assert_eq!(ledger().committed(), 0, "the ledger is seeded empty");
    assert_eq!(testhost::with(|h| h.tick_period_ms), 100);

    // No max_tokens: the cap is the rest of the context, and it is written into the body.
    let (s, action) = vm.post("/v1/completions", &[], &completion(200, None));
    assert_eq!(action, Action::Continue, "admitted: the body goes on");
    assert!(Vm::replies(s).is_empty());
    let cap = CONTEXT - 200;
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert_eq!(forwarded["max_tokens"], cap);
    assert_eq!(forwarded["prompt"].as_array().unwrap().len(), 200);
    assert_eq!(
        Vm::request_header(s, "content-length"),
        None,
        "dropped: the body was rewritten"
    );
    assert_eq!(
        Vm::request_header(s, "x-kvgate-class").as_deref(),
        Some("default")
    );

    let id = lease_of(s);
    let l = ledger();
    assert_eq!(l.leases().len(), 1);
    let lease = l.lease(id).expect("reserved under the announced id");
    assert_eq!(lease.owner, owner_id(), "owned by this worker");
    assert_eq!(lease.bytes, CONTEXT * PER_TOKEN);
    assert_eq!(l.committed(), CONTEXT * PER_TOKEN);
    assert_eq!(Vm::metric("kvgate.admitted"), 1);
    assert_eq!(
        Vm::metric("kvgate.committed_bytes"),
        (CONTEXT * PER_TOKEN) as i64
    );
    assert_eq!(Vm::metric("kvgate.live_leases"), 1);

    vm.respond(s);
    assert_eq!(
        Vm::response_header(s, "x-kvgate-lease"),
        Some(id.to_string())
    );
    assert_eq!(
        Vm::response_header(s, "x-kvgate-level").as_deref(),
        Some("green")
    );
    assert_eq!(
        Vm::response_header(s, "x-kvgate-max-tokens"),
        Some(cap.to_string())
    );
    assert_eq!(
        ledger().committed(),
        CONTEXT * PER_TOKEN,
        "held until the end"
    );

    vm.finish(s);
    let l = ledger();
    assert_eq!(l.committed(), 0);
    assert!(l.leases().is_empty());
    assert_eq!(Vm::metric("kvgate.released"), 1);
    assert_eq!(
        Vm::metric("kvgate.release_unknown"),
        0,
        "on_log and on_done release once"
    );
    assert_eq!(Vm::metric("kvgate.committed_bytes"), 0);
    assert!(
        calls_to("/cancel").is_empty(),
        "a completed stream is not cancelled"
    );
}

#[test]
fn a_body_in_chunks_is_held_until_its_end_and_trailers_end_it_too() {
    let mut vm = start(20_000, json!({}));
    let body = completion(100, Some(50));
    let (head, tail) = body.split_at(body.len() / 2);

    let s = vm.open("POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(vm.request_headers(s, false), Action::Continue);
    assert_eq!(vm.request_body(s, head.as_bytes(), false), Action::Pause);
    assert!(
        ledger().leases().is_empty(),
        "nothing decided on half a body"
    );
    assert_eq!(vm.request_body(s, tail.as_bytes(), true), Action::Continue);
    assert_eq!(ledger().committed(), 150 * PER_TOKEN);
    vm.finish(s);

    // With trailers the body callback never sees end_of_stream: the trailers decide.
    let t = vm.open("POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(vm.request_headers(t, false), Action::Continue);
    assert_eq!(vm.request_body(t, body.as_bytes(), false), Action::Pause);
    assert_eq!(vm.request_trailers(t), Action::Continue);
    assert_eq!(ledger().lease(lease_of(t)).unwrap().bytes, 150 * PER_TOKEN);
    vm.finish(t);
    assert_eq!(ledger().committed(), 0);
}

#[test]
fn client_sent_kvgate_headers_are_stripped() {
    let mut vm = start(20_000, json!({}));
    let (s, action) = vm.post(
        "/v1/completions",
        &[("x-kvgate-lease", "1"), ("x-kvgate-anything", "x")],
        &completion(10, Some(10)),
    );
    assert_eq!(action, Action::Continue);
    assert_ne!(lease_of(s), 1, "the forged lease id is replaced");
    assert_eq!(Vm::request_header(s, "x-kvgate-anything"), None);
    vm.finish(s);
}

#[test]
fn a_reservation_survives_lost_cas_races() {
    let mut vm = start(20_000, json!({}));
    testhost::with(|h| h.inject_cas_mismatches = 3);
    let (s, action) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(action, Action::Continue);
    assert_eq!(testhost::with(|h| h.inject_cas_mismatches), 0);
    assert_eq!(
        ledger().committed(),
        200 * PER_TOKEN,
        "reserved exactly once"
    );
    testhost::with(|h| h.inject_cas_mismatches = 2);
    vm.finish(s);
    assert_eq!(ledger().committed(), 0, "released exactly once");
}

#[test]
fn a_stream_cut_short_is_cancelled_at_the_backend_and_released() {
    let mut vm = start(20_000, json!({"backend": {"cluster": "kvgate_backend"}}));
    let (s, _) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    let id = lease_of(s);
    vm.finish(s); // no response: the client went away
    let cancels = calls_to(&format!("/v1/admission/leases/{id}/cancel"));
    assert_eq!(cancels.len(), 1);
    assert_eq!(cancels[0].header(":method"), Some("POST"));
    assert_eq!(cancels[0].upstream, "kvgate_backend");
    assert_eq!(ledger().committed(), 0);
}

// ---- 2. full: 429 -----------------------------------------------------------------------------

#[test]
fn a_request_that_does_not_fit_gets_429_with_retry_after_and_reserves_nothing() {
    let mut vm = start(1_000, json!({}));
    let (a, action) = vm.post("/v1/completions", &[], &completion(100, Some(500)));
    assert_eq!(action, Action::Continue);
    let before = ledger();
    assert_eq!(before.committed(), 600 * PER_TOKEN);

    let (b, action) = vm.post("/v1/completions", &[], &completion(100, Some(500)));
    assert_eq!(action, Action::Pause, "answered locally");
    let replies = Vm::replies(b);
    assert_eq!(replies.len(), 1);
    let r = &replies[0];
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/json"));
    let secs: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(secs >= 1, "Retry-After {secs}");
    let ms: u64 = r.header("retry-after-ms").unwrap().parse().unwrap();
    assert!((500..=10_000).contains(&ms), "Retry-After-Ms {ms}");
    assert!(r.header("x-kvgate-level").is_some());
    let err = &r.json()["error"];
    assert_eq!(err["code"], "kv_capacity_exceeded");
    assert!(err["type"].is_string());
    assert!(!err["message"].as_str().unwrap().is_empty());

    let after = ledger();
    assert_eq!(after.committed(), before.committed(), "nothing reserved");
    assert_eq!(after.leases(), before.leases());
    assert!(after.lease(lease_of(b)).is_none());
    assert_eq!(Vm::metric("kvgate.rejected.kv_capacity_exceeded"), 1);
    assert_eq!(Vm::metric("kvgate.admitted"), 1);

    vm.finish(b);
    assert_eq!(
        ledger().committed(),
        600 * PER_TOKEN,
        "a rejected end frees nothing"
    );
    assert_eq!(Vm::metric("kvgate.release_unknown"), 0);
    vm.finish(a);
    assert_eq!(ledger().committed(), 0);
}

// ---- 3. the reaper -----------------------------------------------------------------------------

#[test]
fn the_reaper_takes_only_leases_of_gone_workers_never_a_live_ones_however_old() {
    let timeout = 5_000;
    let mut vm = start(20_000, json!({"owner_timeout_ms": timeout, "tick_ms": 100}));
    let (gone, alive) = (0x0dea_d000_0000_0001_u64, 0x0a11_0e00_0000_0002_u64);
    assert_ne!(gone, owner_id());
    assert_ne!(alive, owner_id());
    write_heartbeat(gone, EPOCH_MS - 60_000); // stopped a minute ago
    write_heartbeat(alive, EPOCH_MS);
    put_lease(11, 1_000, "default", 0, gone);
    put_lease(12, 2_000, "default", 0, alive);
    let (mine, _) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    let my_lease = lease_of(mine);

    vm.tick();
    let l = ledger();
    assert!(l.lease(11).is_none(), "the stale owner's lease is reaped");
    assert!(l.lease(12).is_some());
    assert!(l.lease(my_lease).is_some());
    assert_eq!(l.committed(), (2_000 + 200) * PER_TOKEN);
    assert_eq!(Vm::metric("kvgate.reaped"), 1);
    assert!(logs()
        .iter()
        .any(|m| m.contains("reaped lease 11") && m.contains("heartbeat")));
    // This worker said it is alive.
    let beat = testhost::with(|h| h.shared.get(&heartbeat_key(owner_id())).cloned());
    let beat = u64::from_le_bytes(beat.unwrap().0[..8].try_into().unwrap());
    assert_eq!(beat, EPOCH_MS);

    // Far past any lease TTL (max 1 h): live owners keep their leases.
    for _ in 0..5 {
        vm.advance_ms(3 * 3_600_000);
        write_heartbeat(alive, Vm::now_ms());
        vm.tick();
    }
    let l = ledger();
    assert!(
        l.lease(12).is_some(),
        "a live owner's lease is never reaped"
    );
    assert!(l.lease(my_lease).is_some(), "nor this worker's own");
    assert_eq!(Vm::metric("kvgate.reaped"), 1);

    // Once the other owner stops, its lease goes; this worker's stays until its stream ends.
    vm.advance_ms(timeout + 1);
    vm.tick();
    assert!(ledger().lease(12).is_none());
    assert_eq!(Vm::metric("kvgate.reaped"), 2);
    vm.finish(mine);
    assert_eq!(ledger().committed(), 0);
}

// ---- 4. queue + preempt ----------------------------------------------------------------------

fn queue_config() -> Value {
    json!({
        "backend": {"cluster": "kvgate_backend"},
        "policy": {
            "default_class": "vip",
            "classes": {
                "vip": {"action": "queue", "max_wait_ms": 5000, "max_depth": 8, "priority": 9,
                        "preempts": ["batch"]},
                "batch": {"action": "reject", "priority": 0},
            }
        }
    })
}

#[test]
fn a_queued_request_is_admitted_on_tick_by_preemption_and_resumes_when_the_cancel_is_answered() {
    let mut vm = start(10_000, queue_config());
    put_lease(21, 6_000, "vip", 9, owner_id()); // not preemptible
    put_lease(22, 3_000, "batch", 0, owner_id());

    // Needs 9,500 tokens: 1,000 free + 3,000 preemptible is not enough: it waits.
    let (s, action) = vm.post("/v1/completions", &[], &completion(500, Some(9_000)));
    assert_eq!(action, Action::Pause, "queued");
    assert!(Vm::replies(s).is_empty());
    assert_eq!(Vm::metric("kvgate.queued"), 1);
    assert!(ledger().lease(lease_of(s)).is_none());
    // Held: more body data is paused while queued.
    assert_eq!(vm.request_body(s, b"", true), Action::Pause);

    vm.tick();
    assert_eq!(Vm::metric("kvgate.queued"), 1, "still no room");

    // The big lease ends: now 7,000 free + 3,000 preemptible fits.
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(21, Vm::now_ms())).unwrap();
    vm.tick();
    let l = ledger();
    assert!(l.lease(22).is_none(), "the batch lease was preempted");
    let lease = l.lease(lease_of(s)).expect("admitted from the queue");
    assert_eq!(lease.bytes, 9_500 * PER_TOKEN);
    assert_eq!(l.committed(), 9_500 * PER_TOKEN);
    assert_eq!(Vm::metric("kvgate.queued"), 0);
    assert_eq!(Vm::metric("kvgate.preempted"), 1);
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert_eq!(forwarded["max_tokens"], 9_000);

    let cancels = calls_to("/v1/admission/leases/22/cancel");
    assert_eq!(cancels.len(), 1, "the victim is cancelled at the backend");
    assert_eq!(
        cancels[0].during, vm.root,
        "sent from the root context's tick"
    );
    assert_eq!(
        cancels[0].context, s.0,
        "while the queued stream was the effective one"
    );
    assert!(
        !Vm::resumed(s),
        "the request waits for the cancel to be answered"
    );

    vm.answer_call(cancels[0].token, 200, b"{}");
    assert!(Vm::resumed(s), "the queued stream is resumed");
    assert!(Vm::replies(s).is_empty());

    vm.respond(s);
    assert_eq!(
        Vm::response_header(s, "x-kvgate-lease"),
        Some(lease_of(s).to_string())
    );
    vm.finish(s);
    assert_eq!(ledger().committed(), 0);
}

#[test]
fn a_queued_request_whose_wait_runs_out_gets_a_timeout_reply() {
    let mut vm = start(10_000, queue_config());
    put_lease(31, 9_000, "vip", 9, owner_id());
    let (s, action) = vm.post("/v1/completions", &[], &completion(500, Some(1_000)));
    assert_eq!(action, Action::Pause);
    vm.advance_ms(5_001);
    vm.tick();
    let replies = Vm::replies(s);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].status, 429);
    assert_eq!(replies[0].json()["error"]["code"], "kv_queue_timeout");
    assert!(replies[0].header("retry-after").is_some());
    assert_eq!(Vm::metric("kvgate.queued"), 0);
    assert_eq!(ledger().committed(), 9_000 * PER_TOKEN, "nothing reserved");
    vm.finish(s);
}

// ---- 5. the backend poll -------------------------------------------------------------------

fn report(used: u64, live: &[u64], finished: &[u64], cursor: u64) -> Vec<u8> {
    let ids =
        |v: &[u64]| -> Vec<Value> { v.iter().map(|i| json!({"id": i.to_string()})).collect() };
    json!({
        "pool": {"capacity_bytes": 20_000 * PER_TOKEN, "used_bytes": used},
        "leases": ids(live), "finished": ids(finished), "cursor": cursor,
    })
    .to_string()
    .into_bytes()
}

#[test]
fn the_backend_report_informs_unknown_is_drift_and_finished_releases_early() {
    let mut vm = start(
        20_000,
        json!({"backend": {"cluster": "kvgate_backend", "poll_ms": 200, "lost_grace_ms": 1000,
                           "drift_warn_bytes": 1_000_000}}),
    );
    let (s, _) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    let id = lease_of(s);
    let bytes = 200 * PER_TOKEN;

    // The backend does not know the lease, long past the grace period.
    vm.advance_ms(5_000);
    vm.tick();
    let polls = calls_to("/v1/admission/leases?since=0");
    assert_eq!(polls.len(), 1);
    assert_eq!(polls[0].header(":method"), Some("GET"));
    assert_eq!(polls[0].context, vm.root);
    vm.answer_call(polls[0].token, 200, &report(0, &[], &[], 3));
    let l = ledger();
    assert_eq!(
        l.lease(id).map(|l| l.bytes),
        Some(bytes),
        "unknown is not removed"
    );
    assert_eq!(Vm::metric("kvgate.unseen_leases"), 1);
    assert_eq!(Vm::metric("kvgate.unseen_bytes"), bytes as i64);
    assert_eq!(Vm::metric("kvgate.drift_bytes"), bytes as i64);
    assert_eq!(Vm::metric("kvgate.backend_up"), 1);
    assert_eq!(Vm::metric("kvgate.level"), 1, "drift turns the level amber");
    assert_eq!(Vm::metric("kvgate.released_by_backend"), 0);
    assert!(logs()
        .iter()
        .any(|m| m.contains("drift") && m.contains(&id.to_string())));

    // The next poll carries the cursor; the backend now says the lease finished.
    vm.advance_ms(300);
    vm.tick();
    let polls = calls_to("/v1/admission/leases?since=3");
    assert_eq!(polls.len(), 1);
    vm.answer_call(polls[0].token, 200, &report(0, &[], &[id], 4));
    let l = ledger();
    assert!(l.lease(id).is_none(), "finished: released early");
    assert_eq!(l.committed(), 0);
    assert_eq!(Vm::metric("kvgate.released_by_backend"), 1);
    assert_eq!(Vm::metric("kvgate.unseen_leases"), 0);

    // The stream's own end later is harmless.
    vm.respond(s);
    vm.finish(s);
    assert_eq!(ledger().committed(), 0);
    assert_eq!(Vm::metric("kvgate.release_unknown"), 1);
    assert_eq!(Vm::metric("kvgate.released"), 0);
    assert_eq!(Vm::metric("kvgate.ledger_errors"), 0);
}

#[test]
fn failed_polls_mark_the_backend_down_and_an_answer_brings_it_back() {
    let vm = start(
        20_000,
        json!({"backend": {"cluster": "kvgate_backend", "poll_ms": 200,
                           "down_after_failures": 2}}),
    );
    let poll = |status: u32, body: &[u8]| {
        vm.advance_ms(300);
        vm.tick();
        let call = Vm::calls().last().cloned().unwrap();
        assert!(call
            .header(":path")
            .unwrap()
            .starts_with("/v1/admission/leases?since="));
        vm.answer_call(call.token, status, body);
    };
    poll(200, &report(0, &[], &[], 1));
    assert_eq!(Vm::metric("kvgate.backend_up"), 1);
    poll(503, b"");
    assert_eq!(
        Vm::metric("kvgate.backend_up"),
        1,
        "one failure is not down"
    );
    poll(200, b"not json");
    assert_eq!(Vm::metric("kvgate.backend_poll_failures"), 2);
    assert_eq!(Vm::metric("kvgate.backend_up"), 0);
    assert!(logs()
        .iter()
        .any(|m| m.contains("is down after 2 failed polls")));
    // The gauges follow at the next reaper pass (every tick_ms).
    vm.advance_ms(1_000);
    vm.tick();
    assert_eq!(
        Vm::metric("kvgate.level"),
        2,
        "red while the backend is down"
    );
    poll(200, &report(0, &[], &[], 2));
    assert_eq!(Vm::metric("kvgate.backend_up"), 1);
    assert!(logs().iter().any(|m| m.contains("is up again")));
    assert_eq!(Vm::metric("kvgate.level"), 0);
}

// ---- 6. an unreadable ledger ---------------------------------------------------------------

#[test]
fn a_corrupt_ledger_is_kept_and_stops_admission_with_503() {
    let corrupt = b"not a ledger".to_vec();
    let (mut vm, ok) = Vm::start_with(&config(20_000, json!({})), |h| {
        h.shared
            .insert(LEDGER_KEY.to_string(), (corrupt.clone(), 7));
    });
    assert!(ok, "the configuration itself is accepted");
    assert!(logs().iter().any(|m| m.contains("admission stopped")));
    assert!(Vm::metric("kvgate.ledger_errors") >= 1);
    assert!(matches!(
        store::read(&EnvoyStore, LEDGER_KEY),
        Err(StoreError::Corrupt(_))
    ));

    let (s, action) = vm.post("/v1/completions", &[], &completion(10, Some(10)));
    assert_eq!(action, Action::Pause);
    let replies = Vm::replies(s);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].status, 503);
    assert_eq!(
        replies[0].json()["error"]["code"],
        "kvgate_ledger_unavailable"
    );
    assert!(replies[0].header("retry-after").is_some());
    assert_eq!(Vm::metric("kvgate.rejected.kvgate_ledger_unavailable"), 1);

    vm.tick();
    vm.finish(s);
    assert_eq!(
        testhost::with(|h| h.shared.get(LEDGER_KEY).cloned()),
        Some((corrupt, 7)),
        "the unreadable bytes are left untouched"
    );
    assert_eq!(
        testhost::with(|h| h.shared_writes.get(LEDGER_KEY).copied()),
        None
    );
}

// ---- the status endpoint -----------------------------------------------------------------------

#[test]
fn the_status_endpoint_reports_the_ledger() {
    let mut vm = start(20_000, json!({}));
    let (a, _) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    let s = vm.open("GET", "/kvgate/status", &[], b"");
    assert_eq!(vm.request_headers(s, true), Action::Pause);
    let replies = Vm::replies(s);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].status, 200);
    let doc = replies[0].json();
    assert_eq!(doc["committed_bytes"], 200 * PER_TOKEN);
    assert_eq!(doc["leases"], 1);
    assert_eq!(doc["level"], "green");
    vm.finish(s);
    vm.finish(a);
}

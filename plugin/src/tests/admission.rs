//! One stream at a time: headers → body → admitted or answered locally → end.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvgate_core::store::{self, StoreError};
use proxy_wasm::types::Action;
use serde_json::{json, Value};

use super::*;
use crate::host::EnvoyStore;
use crate::testhost::{self, Vm};
use crate::worker::owner_id;
use crate::LEDGER_KEY;

// ---- 1. headers → body → admitted → end ----------------------------------------------------

#[test]
fn an_admitted_request_is_rewritten_reserved_under_this_worker_and_released_at_its_end() {
    let mut vm = start(100_000, json!({}));
    assert_eq!(ledger().committed(), 0, "the ledger is seeded empty");
    assert_eq!(testhost::with(|h| h.tick_period_ms), 100);

    // No max_tokens: the cap is the rest of the context, reserved whole. The server's own
    // context bounds it, so none is written (a server that counts the prompt higher would
    // refuse the gateway's context - prompt as over its context).
    let (s, action) = vm.post("/v1/completions", &[], &completion(200, None));
    assert_eq!(action, Action::Continue, "admitted: the body goes on");
    assert!(Vm::replies(s).is_empty());
    let cap = CONTEXT - 200;
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert!(forwarded.get("max_tokens").is_none(), "{forwarded}");
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
fn the_backends_admission_api_is_refused_to_clients_in_every_mode() {
    for mode in ["enforce", "shadow"] {
        let mut vm = start(
            20_000,
            json!({"mode": mode, "backend": {"cluster": "kvgate_backend"}}),
        );
        for (method, path) in [
            ("GET", "/v1/admission/leases"),
            ("POST", "/v1/admission/leases/1/cancel"),
            ("POST", "//v1/admission/leases/1/demote"),
        ] {
            let s = vm.open(method, path, &[], b"");
            assert_eq!(vm.request_headers(s, true), Action::Pause, "{mode} {path}");
            let replies = Vm::replies(s);
            assert_eq!(replies.len(), 1, "{mode} {method} {path}");
            assert_eq!(replies[0].status, 404);
            assert_eq!(replies[0].json()["error"]["code"], "not_found");
            vm.finish(s);
        }
        assert_eq!(Vm::metric("kvgate.rejected.not_found"), 3);
        assert!(ledger().leases().is_empty());
    }
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
fn a_release_that_loses_every_cas_race_is_retried_at_the_next_tick() {
    // The worker is alive and heartbeating, so the reaper would never take the lease: without
    // a retry it would hold its bytes for the life of the ledger.
    let mut vm = start(20_000, json!({}));
    let (s, action) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(action, Action::Continue);
    testhost::with(|h| h.inject_cas_mismatches = crate::CAS_ATTEMPTS);
    vm.finish(s);
    assert_eq!(ledger().committed(), 200 * PER_TOKEN, "every attempt lost");
    assert_eq!(Vm::metric("kvgate.ledger_errors"), 1);
    vm.tick();
    assert_eq!(ledger().committed(), 0, "released at the next tick");
    assert!(ledger().leases().is_empty());
    assert_eq!(Vm::metric("kvgate.released"), 1, "released once");
    vm.tick();
    assert_eq!(
        Vm::metric("kvgate.released") + Vm::metric("kvgate.release_unknown"),
        1,
        "and not again"
    );
}

#[test]
fn a_failed_release_outlives_the_root_context_of_its_configuration() {
    // A configuration update starts a new root context beside the old one; the old one is
    // gone once its last stream ends. The lease's owner (this VM) keeps its heartbeat through
    // the new root, so only a retry from the new root can release it.
    let mut vm = start(20_000, json!({}));
    let (s, action) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(action, Action::Continue);
    let (old, ok) = vm.new_root(&config(20_000, json!({"tick_ms": 100})));
    assert!(ok);
    testhost::with(|h| h.inject_cas_mismatches = crate::CAS_ATTEMPTS);
    vm.finish(s);
    assert_eq!(ledger().committed(), 200 * PER_TOKEN, "every attempt lost");
    vm.retire_root(old);
    vm.tick();
    assert_eq!(ledger().committed(), 0, "released by the new root's tick");
    assert!(ledger().leases().is_empty());
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
    assert_eq!(cancels[0].during, s.0, "sent as the stream ended");
    vm.answer_call(cancels[0].token, 200, b"{}"); // nobody waits for it
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

// ---- other local answers, degrade, reconfiguration --------------------------------------------

/// Exactly one local reply on this stream, with this status and error code; nothing reserved.
fn assert_rejected(s: testhost::Stream, status: u32, code: &str) {
    let replies = Vm::replies(s);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].status, status);
    assert_eq!(replies[0].json()["error"]["code"], code);
    assert!(ledger().leases().is_empty(), "nothing reserved");
    assert_eq!(Vm::metric(&format!("kvgate.rejected.{code}")), 1);
}

#[test]
fn an_unreadable_body_gets_400_and_an_oversized_one_413() {
    let mut vm = start(20_000, json!({"max_body_bytes": 1_000}));
    let (s, action) = vm.post("/v1/completions", &[], "{not json");
    assert_eq!(action, Action::Pause);
    assert_rejected(s, 400, "invalid_request");

    // Refused at the headers (declared length) or at the body, never forwarded.
    let big = completion(600, Some(10));
    let t = vm.open("POST", "/v1/completions", &[], big.as_bytes());
    if vm.request_headers(t, false) == Action::Continue && Vm::replies(t).is_empty() {
        assert_eq!(vm.request_body(t, big.as_bytes(), true), Action::Pause);
    }
    assert_rejected(t, 413, "request_body_too_large");
    vm.finish(s);
    vm.finish(t);
    assert_eq!(Vm::metric("kvgate.admitted"), 0);
}

#[test]
fn a_body_that_grows_past_the_limit_when_written_again_gets_413_and_keeps_nothing() {
    // `1e15` is written out as `1000000000000000.0`: 4 bytes become 18.
    let mut vm = start(20_000, json!({"max_body_bytes": 4_000}));
    let pad = vec!["1e15"; 600].join(",");
    let body = format!(r#"{{"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "pad": [{pad}]}}"#);
    assert!(body.len() < 4_000);
    let (s, action) = vm.post("/v1/completions", &[], &body);
    assert_eq!(action, Action::Pause);
    assert_rejected(s, 413, "request_body_too_large");
    assert_eq!(ledger().committed(), 0, "its reservation is given back");
    vm.finish(s);
    // A body the rewrite does not grow past the limit goes through.
    let (t, action) = vm.post("/v1/completions", &[], &completion(3, Some(5)));
    assert_eq!(action, Action::Continue);
    vm.finish(t);
    assert_eq!(ledger().committed(), 0);
}

#[test]
fn a_degrade_class_is_admitted_with_the_cap_that_fits() {
    let mut vm = start(
        1_000,
        json!({"policy": {"default_class": "batch", "classes": {
            "batch": {"action": "degrade", "min_output_tokens": 64, "priority": 0}}}}),
    );
    put_lease(41, 600, "batch", 0, owner_id());
    let (s, action) = vm.post("/v1/completions", &[], &completion(100, Some(500)));
    assert_eq!(action, Action::Continue);
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert_eq!(
        forwarded["max_tokens"], 300,
        "the 400 free tokens: 100 prompt + 300"
    );
    assert_eq!(ledger().lease(lease_of(s)).unwrap().bytes, 400 * PER_TOKEN);
    assert_eq!(ledger().committed(), 1_000 * PER_TOKEN);
    assert_eq!(Vm::metric("kvgate.degraded"), 1);
    vm.respond(s);
    assert_eq!(
        Vm::response_header(s, "x-kvgate-degraded").as_deref(),
        Some("max_tokens=500->300")
    );
    assert_eq!(
        Vm::response_header(s, "x-kvgate-max-tokens").as_deref(),
        Some("300")
    );
    vm.finish(s);
    assert_eq!(ledger().committed(), 600 * PER_TOKEN);
}

#[test]
fn an_unset_cap_is_written_when_a_degrade_lowers_it_and_left_to_the_server_otherwise() {
    let mut vm = start(
        CONTEXT + 1_000,
        json!({"policy": {"default_class": "batch", "classes": {
            "batch": {"action": "degrade", "min_output_tokens": 64, "priority": 0}}}}),
    );
    let (a, _) = vm.post("/v1/completions", &[], &completion(100, None));
    let forwarded: Value = serde_json::from_slice(&Vm::body(a)).unwrap();
    assert!(
        forwarded.get("max_tokens").is_none(),
        "reserved the whole context"
    );
    assert_eq!(ledger().committed(), CONTEXT * PER_TOKEN);
    // 1,000 tokens left: the next unset cap is lowered to 900, and the server must be told.
    let (b, _) = vm.post("/v1/completions", &[], &completion(100, None));
    let forwarded: Value = serde_json::from_slice(&Vm::body(b)).unwrap();
    assert_eq!(forwarded["max_tokens"], 900);
    vm.respond(b);
    assert_eq!(
        Vm::response_header(b, "x-kvgate-degraded"),
        Some(format!("max_tokens={}->900", CONTEXT - 100))
    );
    vm.finish(a);
    vm.finish(b);
    assert_eq!(ledger().committed(), 0);
}

#[test]
fn an_unset_cap_is_written_when_the_model_comes_from_the_backend() {
    // Priced from the backend's descriptor (or, until it comes, its fallback with padded
    // counts), the written cap fits the server's context, and it bounds an endpoint that
    // serves a longer context than the one priced.
    let spec = json!({"layers": 30, "kv_heads": 3, "head_dim": 64, "kv_dtype_bytes": 4,
                      "context_tokens": CONTEXT});
    let mut vm = start(
        CONTEXT + 1_000,
        json!({"model": "from_backend", "fallback_model": spec,
               "backend": {"cluster": "kvgate_backend"}}),
    );
    let (s, action) = vm.post("/v1/completions", &[], &completion(100, None));
    assert_eq!(action, Action::Continue);
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert_eq!(forwarded["max_tokens"], CONTEXT - 100);
    vm.finish(s);
    assert_eq!(ledger().committed(), 0);
}

#[test]
fn reconfiguration_keeps_the_ledger_and_its_leases() {
    let mut vm = start(20_000, json!({}));
    let (s, _) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    let id = lease_of(s);
    assert!(vm.reconfigure(&config(30_000, json!({}))));
    let l = ledger();
    assert_eq!(l.capacity(), 30_000 * PER_TOKEN);
    assert_eq!(l.lease(id).map(|l| l.bytes), Some(200 * PER_TOKEN));
    assert_eq!(
        Vm::metric("kvgate.capacity_bytes"),
        (30_000 * PER_TOKEN) as i64
    );
    // A bad configuration is refused with one line naming the field; the old one stays.
    assert!(!vm.reconfigure(&config(30_000, json!({"tick_ms": 1}))));
    assert!(logs().iter().any(|m| m.contains("tick_ms")));
    assert_eq!(ledger().capacity(), 30_000 * PER_TOKEN);
    vm.finish(s);
    assert_eq!(
        ledger().committed(),
        0,
        "released by the stream admitted before"
    );
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

// ---- a caller that drops what the line served ----------------------------------------------------

#[test]
fn a_caller_that_drops_a_big_request_at_once_loses_its_place_in_line_for_a_while() {
    let mut vm = start(1_000, json!({}));
    let big = completion(100, Some(600)); // 700 of the 1,000 tokens
                                          // Dropped at once, but admitted on its first try (the line served it nothing): no forfeit.
    let (s, a) = vm.post("/v1/completions", &[], &big);
    assert_eq!(a, Action::Continue);
    vm.finish(s);
    assert_eq!(Vm::metric("kvgate.forfeited"), 0);
    let (filler, _) = vm.post("/v1/completions", &[], &completion(100, Some(300)));
    for _ in 0..2 {
        let (s, _) = vm.post("/v1/completions", &[], &big);
        assert_eq!(Vm::replies(s)[0].status, 429);
        vm.finish(s);
    }
    assert!(
        ledger().claims()[0].active,
        "its client came back: an active place"
    );
    vm.respond(filler);
    vm.finish(filler);
    assert!(
        ledger().claims()[0].held > 0,
        "the line set the freed bytes aside for it"
    );
    // Its retry is admitted, and its client drops it at once.
    let (s, a) = vm.post("/v1/completions", &[], &big);
    assert_eq!(a, Action::Continue);
    vm.finish(s);
    assert_eq!(Vm::metric("kvgate.forfeited"), 1);
    // Again: refused with no place in line (a plain 429), for a minute.
    let (filler, _) = vm.post("/v1/completions", &[], &completion(100, Some(300)));
    let (s, _) = vm.post("/v1/completions", &[], &big);
    assert_eq!(Vm::replies(s)[0].status, 429);
    vm.finish(s);
    assert!(ledger().claims().is_empty(), "no place while forfeited");
    vm.advance_ms(61_000);
    let (s, _) = vm.post("/v1/completions", &[], &big);
    assert_eq!(Vm::replies(s)[0].status, 429);
    vm.finish(s);
    assert_eq!(ledger().claims().len(), 1, "a place again after a minute");
    vm.respond(filler);
    vm.finish(filler);
    let (small, _) = vm.post("/v1/completions", &[], &completion(10, Some(10)));
    vm.finish(small);
    assert_eq!(
        Vm::metric("kvgate.forfeited"),
        1,
        "a small request dropped at once: nothing"
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

#[test]
fn the_status_page_is_answered_only_on_a_loopback_address() {
    let mut vm = start(20_000, json!({}));
    for (addr, served) in [
        ("10.1.2.3:10000", false),
        ("[2001:db8::1]:10000", false),
        ("[::1]:10000", true),
        ("127.0.0.1:10000", true),
    ] {
        let s = vm.open(
            "GET",
            "/kvgate/status",
            &[("x-forwarded-for", "127.0.0.1")],
            b"",
        );
        vm.set_address(s, "destination", addr);
        let action = vm.request_headers(s, true);
        assert_eq!(action == Action::Pause, served, "{addr}");
        assert_eq!(Vm::replies(s).len(), usize::from(served), "{addr}");
        vm.finish(s);
    }
}

#[test]
fn an_empty_status_path_turns_the_status_endpoint_off() {
    let mut vm = start(20_000, json!({"status_path": ""}));
    let s = vm.open("GET", "/kvgate/status", &[], b"");
    assert_eq!(
        vm.request_headers(s, true),
        Action::Continue,
        "passed on, as any path"
    );
    assert!(Vm::replies(s).is_empty());
    vm.finish(s);
}

// ---- 7. shadow mode ------------------------------------------------------------------------

#[test]
fn shadow_mode_counts_what_enforce_would_do_and_lets_everything_through_unchanged() {
    let mut vm = start(
        1_000,
        json!({"mode": "shadow",
               "policy": {"default_class": "batch",
                          "classes": {"batch": {"action": "degrade", "min_output_tokens": 500}}}}),
    );
    let (first, a) = vm.post("/v1/completions", &[], &completion(100, Some(700)));
    assert_eq!(a, Action::Continue);
    // Enforce would refuse this one (it fits nowhere, not even degraded to 500).
    let body = completion(100, Some(700));
    let (second, a) = vm.post("/v1/completions", &[], &body);
    assert_eq!(a, Action::Continue, "let through");
    assert!(Vm::replies(second).is_empty(), "nothing answered locally");
    assert_eq!(Vm::body(second), body.as_bytes(), "forwarded unchanged");
    // So the backend is not told to read a note: a client's `kvgate` field stays unread.
    assert_eq!(Vm::request_header(second, "x-kvgate-note"), None);
    assert_eq!(
        Vm::metric("kvgate.shadow.would_reject.kv_capacity_exceeded"),
        1
    );
    assert_eq!(Vm::metric("kvgate.rejected.kv_capacity_exceeded"), 0);
    // Both are recorded at their worst case: the ledger shows the load as it is.
    assert_eq!(ledger().committed(), 1_600 * PER_TOKEN);
    assert!(ledger().committed() > ledger().capacity());
    vm.respond(first);
    vm.respond(second);
    assert_eq!(
        Vm::response_header(first, "x-kvgate-shadow").as_deref(),
        Some("would_admit")
    );
    assert_eq!(
        Vm::response_header(second, "x-kvgate-shadow").as_deref(),
        Some("would_reject=kv_capacity_exceeded")
    );
    vm.finish(first);
    vm.finish(second);
    assert_eq!(ledger().committed(), 0);
    // Bad input goes through too, counted.
    let (bad, a) = vm.post("/v1/completions", &[], "{not json");
    assert_eq!(a, Action::Continue);
    assert!(Vm::replies(bad).is_empty());
    assert_eq!(Vm::metric("kvgate.shadow.would_reject.invalid_request"), 1);
    // Not recorded, so not forwarded under a lease.
    assert_eq!(Vm::request_header(bad, "x-kvgate-lease"), None);
    assert_eq!(Vm::request_header(bad, "x-kvgate-secret"), None);
    assert!(
        Vm::request_header(first, "x-kvgate-lease").is_some(),
        "recorded ones are"
    );
    vm.finish(bad);
    // A degrade that enforce would apply is counted, the body is not rewritten.
    let (big, _) = vm.post("/v1/completions", &[], &completion(100, Some(700)));
    let (d, _) = vm.post("/v1/completions", &[], &completion(100, Some(700)));
    assert_eq!(
        Vm::metric("kvgate.shadow.would_reject.kv_capacity_exceeded"),
        2
    );
    vm.finish(big);
    vm.finish(d);
    let (d1, _) = vm.post("/v1/completions", &[], &completion(100, Some(300)));
    let (d2, _) = vm.post("/v1/completions", &[], &completion(100, Some(600)));
    assert_eq!(Vm::metric("kvgate.shadow.would_degrade"), 1);
    let fwd: Value = serde_json::from_slice(&Vm::body(d2)).unwrap();
    assert_eq!(fwd["max_tokens"], 600);
    vm.finish(d1);
    vm.finish(d2);
    assert_eq!(ledger().committed(), 0);
}

#[test]
fn a_lease_id_drawn_twice_never_ends_the_live_lease_that_holds_it() {
    for mode in ["enforce", "shadow"] {
        let mut vm = start(1_000, json!({"mode": mode}));
        let (first, a) = vm.post("/v1/completions", &[], &completion(100, Some(200)));
        assert_eq!(a, Action::Continue);
        let id = lease_of(first);
        let held = ledger()
            .lease(id)
            .cloned()
            .expect("the first request's lease");
        // The next request draws the same id (about n/2^43 with n leases live; forced here).
        crate::worker::FORCED_LEASE_IDS.with(|f| f.borrow_mut().push_back(id));
        let body = completion(50, Some(100));
        let (second, a) = vm.post("/v1/completions", &[], &body);
        assert!(
            crate::worker::FORCED_LEASE_IDS.with(|f| f.borrow().is_empty()),
            "{mode}: the second request drew the forced id"
        );
        if mode == "shadow" {
            // Let through as every shadow request is, but not under the other request's lease.
            assert_eq!(a, Action::Continue, "{mode}");
            assert!(Vm::replies(second).is_empty(), "{mode}");
            assert_eq!(
                Vm::body(second),
                body.as_bytes(),
                "{mode}: forwarded unchanged"
            );
            assert_eq!(Vm::request_header(second, "x-kvgate-lease"), None, "{mode}");
            assert_eq!(
                Vm::metric("kvgate.shadow.would_reject.kvgate_lease_id_conflict"),
                1,
                "{mode}"
            );
            vm.respond(second);
            assert_eq!(
                Vm::response_header(second, "x-kvgate-shadow").as_deref(),
                Some("would_reject=kvgate_lease_id_conflict"),
                "{mode}"
            );
        } else {
            let replies = Vm::replies(second);
            let [reply] = replies.as_slice() else {
                panic!("{mode}: one local reply, got {replies:?}")
            };
            assert_eq!(reply.status, 503, "{mode}");
            let err: Value = serde_json::from_slice(&reply.body).unwrap();
            assert_eq!(err["error"]["code"], "kvgate_lease_id_conflict", "{mode}");
            assert_eq!(
                Vm::metric("kvgate.rejected.kvgate_lease_id_conflict"),
                1,
                "{mode}"
            );
        }
        // Nothing recorded for the second, and its end leaves the first's lease as it was.
        assert_eq!(ledger().leases().len(), 1, "{mode}");
        vm.finish(second);
        assert_eq!(ledger().lease(id), Some(&held), "{mode}");
        assert_eq!(ledger().committed(), 300 * PER_TOKEN, "{mode}");
        vm.finish(first);
        assert_eq!(ledger().committed(), 0, "{mode}");
        assert!(ledger().leases().is_empty(), "{mode}");
    }
}

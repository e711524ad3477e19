//! What the root context does on its tick and with callout answers: the reaper, the
//! admission queue with preemption, and the backend poll.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvgate_core::store;
use proxy_wasm::types::Action;
use serde_json::{json, Value};

use super::*;
use crate::host::EnvoyStore;
use crate::testhost::{self, Vm, EPOCH_MS};
use crate::worker::owner_id;
use crate::LEDGER_KEY;

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
    assert!(
        ledger().lease(11).is_some(),
        "an old heartbeat alone is no proof: a clock may have jumped"
    );
    // Watched: the stopped owner's heartbeat does not change for the timeout, the live one's does.
    tick_for(&mut vm, timeout + 200, &[alive]);
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
    assert_eq!(beat, Vm::now_ms());

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

    // A clock stepped forward, or the whole process frozen, past the timeout: one tick's
    // worth of silence, not the timeout's.
    vm.advance_ms(10 * timeout);
    vm.tick();
    tick_for(&mut vm, timeout / 2, &[]);
    assert!(ledger().lease(12).is_some(), "a jump is not silence");
    // A clock stepped back: nothing is reaped for it either.
    vm.advance_ms_back(5 * timeout);
    vm.tick();
    assert!(ledger().lease(12).is_some());
    // Once the other owner stops, its lease goes; this worker's stays until its stream ends.
    tick_for(&mut vm, timeout, &[]);
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
fn a_queued_request_is_admitted_on_tick_by_preemption_and_resumes_when_the_demotion_is_answered() {
    preempted_from_the_queue(200);
}

#[test]
fn a_demotion_the_backend_does_not_confirm_is_undone_and_the_request_does_not_go_on() {
    // The victim still holds its reservation at the backend: a backend that does not refuse
    // on its own would run out of KV with the preempting request on top of it.
    preempted_from_the_queue(503);
}

/// A queued vip admitted on tick by demoting a batch lease; the demotion answered `status`.
fn preempted_from_the_queue(status: u32) {
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
    assert_eq!(
        l.lease(22).map(|v| v.bytes),
        Some(0),
        "the batch lease was demoted: kept until its request ends, reserving nothing"
    );
    let lease = l.lease(lease_of(s)).expect("admitted from the queue");
    assert_eq!(lease.bytes, 9_500 * PER_TOKEN);
    assert_eq!(l.committed(), 9_500 * PER_TOKEN);
    assert_eq!(Vm::metric("kvgate.queued"), 0);
    assert_eq!(Vm::metric("kvgate.preempted"), 1);
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert_eq!(forwarded["max_tokens"], 9_000);

    assert!(calls_to("/cancel").is_empty(), "nobody is cancelled");
    let demotions = calls_to("/v1/admission/leases/22/demote");
    assert_eq!(demotions.len(), 1, "the victim is demoted at the backend");
    assert_eq!(demotions[0].header(":method"), Some("POST"));
    assert_eq!(
        demotions[0].during, vm.root,
        "sent from the root context's tick"
    );
    assert_eq!(
        demotions[0].context, s.0,
        "while the queued stream was the effective one"
    );
    assert!(
        !Vm::resumed(s),
        "the request waits for the demotion to be answered"
    );

    assert_eq!(Vm::metric("kvgate.demotions_pending"), 1);
    vm.answer_call(demotions[0].token, status, b"{}");
    assert_eq!(Vm::metric("kvgate.demotions_pending"), 0);
    assert_eq!(
        Vm::metric("kvgate.demote_failed"),
        i64::from(status != 200),
        "a demotion not confirmed is counted"
    );
    if status != 200 {
        assert!(!Vm::resumed(s), "not sent to the backend");
        let replies = Vm::replies(s);
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].status, 429);
        let body: Value = serde_json::from_slice(&replies[0].body).unwrap();
        assert_eq!(body["error"]["code"], "kv_capacity_exceeded");
        assert!(replies[0].header("retry-after").is_some());
        let l = ledger();
        assert!(l.lease(lease_of(s)).is_none(), "its lease is released");
        assert_eq!(
            l.lease(22).map(|v| v.bytes),
            Some(3_000 * PER_TOKEN),
            "the victim reserves its bytes again"
        );
        assert_eq!(l.committed(), 3_000 * PER_TOKEN);
        vm.finish(s);
        assert_eq!(
            ledger().committed(),
            3_000 * PER_TOKEN,
            "nothing else to release"
        );
        return;
    }
    assert!(Vm::resumed(s), "the queued stream is resumed");
    assert!(Vm::replies(s).is_empty());

    vm.respond(s);
    assert_eq!(
        Vm::response_header(s, "x-kvgate-lease"),
        Some(lease_of(s).to_string())
    );
    vm.finish(s);
    assert_eq!(ledger().committed(), 0);
    assert!(
        ledger().lease(22).is_some(),
        "the demoted lease ends with its own request"
    );
}

#[test]
fn a_preempting_request_whose_client_left_before_its_demotion_was_answered_leaves_nothing() {
    // The SDK delivers a callout's answer to the context that sent it and drops it once that
    // context is gone: the request waiting for the demotion must not stay in the worker (with
    // its body) for the life of the VM.
    let mut vm = start(10_000, queue_config());
    put_lease(22, 3_000, "batch", 0, owner_id());
    // 7,000 free + 3,000 preemptible: admitted at once by demoting the batch lease.
    let (s, action) = vm.post("/v1/completions", &[], &completion(500, Some(9_000)));
    assert_eq!(
        action,
        Action::Pause,
        "waits for the demotion to be answered"
    );
    assert_eq!(ledger().lease(22).map(|v| v.bytes), Some(0));
    let demotions = calls_to("/v1/admission/leases/22/demote");
    assert_eq!(demotions.len(), 1);
    assert_eq!(Vm::metric("kvgate.demotions_pending"), 1);

    vm.finish(s); // the client is gone before the backend answers
    assert_eq!(
        Vm::metric("kvgate.demotions_pending"),
        0,
        "nothing waits for it"
    );
    // Its reservation is released, and the victim, whose demotion's outcome nobody will
    // read now, reserves its bytes again: it may still hold them at the backend.
    assert_eq!(ledger().lease(22).map(|v| v.bytes), Some(3_000 * PER_TOKEN));
    assert_eq!(ledger().committed(), 3_000 * PER_TOKEN);
    vm.answer_call(demotions[0].token, 200, b"{}"); // dropped by the SDK: its stream is gone
    assert_eq!(Vm::metric("kvgate.demotions_pending"), 0);
    assert!(!Vm::resumed(s));
    assert_eq!(ledger().committed(), 3_000 * PER_TOKEN);
}

#[test]
fn a_preempting_request_refused_after_the_decision_gives_its_victims_back_their_bytes() {
    // Admitted by demoting a batch lease, then refused before the demotion is sent (its body,
    // written again, grows past the limit): the victim was never told, so it reserves again.
    let mut cfg = queue_config();
    cfg["max_body_bytes"] = json!(5_000);
    let mut vm = start(10_000, cfg);
    put_lease(22, 3_000, "batch", 0, owner_id());
    let pad = vec!["1e15"; 600].join(",");
    let body =
        format!(r#"{{"model": "m", "prompt": [1, 2, 3], "max_tokens": 9000, "pad": [{pad}]}}"#);
    assert!(body.len() < 5_000);
    let (s, action) = vm.post("/v1/completions", &[], &body);
    assert_eq!(action, Action::Pause);
    let replies = Vm::replies(s);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].status, 413);
    assert!(calls_to("/demote").is_empty(), "never told");
    let l = ledger();
    assert_eq!(l.lease(22).map(|v| v.bytes), Some(3_000 * PER_TOKEN));
    assert_eq!(l.committed(), 3_000 * PER_TOKEN);
    assert_eq!(l.held_back(), 0);
    l.check().unwrap();
    vm.finish(s);
    assert_eq!(ledger().committed(), 3_000 * PER_TOKEN);
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

#[test]
fn a_full_queue_answers_429_queue_full() {
    let mut cfg = queue_config();
    cfg["policy"]["classes"]["vip"]["max_depth"] = 1.into();
    let mut vm = start(10_000, cfg);
    put_lease(51, 9_000, "vip", 9, owner_id());
    let (a, action) = vm.post("/v1/completions", &[], &completion(500, Some(1_000)));
    assert_eq!(action, Action::Pause);
    assert!(Vm::replies(a).is_empty(), "queued");
    let (b, action) = vm.post("/v1/completions", &[], &completion(500, Some(1_000)));
    assert_eq!(action, Action::Pause);
    let replies = Vm::replies(b);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].status, 429);
    assert_eq!(replies[0].json()["error"]["code"], "kv_queue_full");
    assert_eq!(Vm::metric("kvgate.queued"), 1);
    // A queued client that goes away leaves the queue; nothing was reserved for it.
    vm.finish(a);
    assert_eq!(Vm::metric("kvgate.queued"), 0);
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(51, Vm::now_ms())).unwrap();
    vm.tick();
    assert!(
        ledger().leases().is_empty(),
        "nothing admitted for a gone stream"
    );
    vm.finish(b);
}

/// A policy of two queued classes, vip (9) and batch (0), chosen by a trusted `x-class` header.
fn vip_and_batch_queued(default_class: &str, max_wait_ms: u64) -> Value {
    let queued = |priority: u8| json!({"action": "queue", "max_wait_ms": max_wait_ms, "max_depth": 8, "priority": priority});
    json!({"default_class": default_class, "class_header": "x-class", "class_header_trusted": true,
           "classes": {"vip": queued(9), "batch": queued(0)}})
}

/// Strict priority lets a low class wait as long as higher ones keep coming: with
/// `queue_aging_ms`, waiting that long is worth one priority level, so a batch request is passed
/// only by higher classes that arrived within their priority gap's worth of aging after it.
#[test]
fn a_long_wait_in_the_queue_outranks_a_later_higher_class() {
    let mut policy = vip_and_batch_queued("vip", 60_000);
    policy["queue_aging_ms"] = 1_000.into();
    let mut vm = start(9_000, json!({ "policy": policy }));
    for id in 71..77 {
        put_lease(id, 1_500, "vip", 9, owner_id());
    }
    // Each needs 1,500 tokens; bodies differ, so each keeps its own place in the fair-retry line.
    fn post(vm: &mut Vm, class: &str, prompt: usize) -> Stream {
        let body = completion(prompt, Some(1_500 - prompt as u64));
        let (s, action) = vm.post("/v1/completions", &[("x-class", class)], &body);
        assert_eq!(action, Action::Pause, "queued");
        s
    }
    let first_vip = post(&mut vm, "vip", 500);
    vm.advance_ms(10);
    let batch = post(&mut vm, "batch", 499);
    vm.advance_ms(9_990); // the batch request has waited 9.99 s: more than 9 levels' worth
    let late_vip = post(&mut vm, "vip", 498);
    let admitted = |s: Stream| ledger().lease(lease_of(s)).is_some();

    let free = |id: u64| {
        store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(id, Vm::now_ms())).unwrap();
    };
    free(71);
    vm.tick();
    assert!(
        admitted(first_vip),
        "a vip that came 10 ms before it still goes first"
    );
    assert!(!admitted(batch) && !admitted(late_vip));
    free(72);
    vm.tick();
    assert!(admitted(batch), "aged past the vip that came 10 s after it");
    assert!(!admitted(late_vip));
    free(73);
    vm.tick();
    assert!(admitted(late_vip));
    assert_eq!(Vm::metric("kvgate.queued"), 0);
    for s in [first_vip, batch, late_vip] {
        vm.respond(s);
        vm.finish(s);
    }
    for id in 74..77 {
        free(id);
    }
    assert_eq!(ledger().committed(), 0);
}

/// A request whose wait in the queue ran out and whose client retried keeps its age: its place
/// in the fair-retry line dates from its first refusal, and the queue orders the retry by that,
/// ahead of a request of the same class that came after it.
#[test]
fn a_retry_after_a_queue_timeout_keeps_its_age_in_the_queue() {
    let mut vm = start(
        3_000,
        json!({"policy": {"default_class": "q", "classes": {"q": {
            "action": "queue", "max_wait_ms": 5_000, "max_depth": 8, "priority": 0}}}}),
    );
    put_lease(81, 1_500, "q", 0, owner_id());
    put_lease(82, 1_500, "q", 0, owner_id());
    let older = completion(500, Some(1_000));
    let (first, action) = vm.post("/v1/completions", &[], &older);
    assert_eq!(action, Action::Pause, "queued");
    let waits = || {
        ledger()
            .claims()
            .iter()
            .map(|c| c.waits)
            .collect::<Vec<_>>()
    };
    assert_eq!(waits(), [true], "its client waits in the queue");
    vm.advance_ms(5_001);
    vm.tick();
    let replies = Vm::replies(first);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].json()["error"]["code"], "kv_queue_timeout");
    assert_eq!(
        waits(),
        [false],
        "its client is sent away with a Retry-After"
    );
    vm.finish(first);

    vm.advance_ms(400);
    let (newer, action) = vm.post("/v1/completions", &[], &completion(499, Some(1_001)));
    assert_eq!(action, Action::Pause, "queued");
    vm.advance_ms(100); // within the Retry-After + the patience: the retry keeps its place
    let (retry, action) = vm.post("/v1/completions", &[], &older);
    assert_eq!(action, Action::Pause, "queued");

    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(81, Vm::now_ms())).unwrap();
    vm.tick();
    let admitted = |s: Stream| ledger().lease(lease_of(s)).is_some();
    assert!(
        admitted(retry),
        "the retry is older than the request that came before it"
    );
    assert!(!admitted(newer));
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(82, Vm::now_ms())).unwrap();
    vm.tick();
    assert!(admitted(newer));
    for s in [retry, newer] {
        vm.respond(s);
        vm.finish(s);
    }
    assert_eq!(ledger().committed(), 0);
    assert_eq!(Vm::metric("kvgate.queued"), 0);
}

/// A client's retry whose earlier try left a place in the fair-retry line has an active claim
/// from its first refusal: the ledger sets freed bytes aside for it at once. Queued behind a
/// front that does not fit, it is still retried on every tick and admitted with what its claim
/// holds, instead of leaving those bytes idle until the front fits.
#[test]
fn a_retry_with_an_active_claim_behind_the_front_is_admitted_with_what_it_holds() {
    let mut vm = start(
        3_000,
        json!({ "policy": vip_and_batch_queued("batch", 5_000) }),
    );
    put_lease(91, 1_500, "batch", 0, owner_id());
    put_lease(92, 1_500, "batch", 0, owner_id());
    let body = completion(500, Some(1_000));
    let (first, _) = vm.post("/v1/completions", &[], &body);
    vm.advance_ms(5_001);
    vm.tick();
    assert_eq!(
        Vm::replies(first)[0].json()["error"]["code"],
        "kv_queue_timeout"
    );
    vm.finish(first);
    // A vip request that needs the whole pool takes the front; then the client retries.
    vm.advance_ms(100);
    let (vip, action) = vm.post(
        "/v1/completions",
        &[("x-class", "vip")],
        &completion(1_000, Some(2_000)),
    );
    assert_eq!(action, Action::Pause, "queued");
    vm.advance_ms(100);
    let (retry, action) = vm.post("/v1/completions", &[], &body);
    assert_eq!(action, Action::Pause, "queued");

    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(91, Vm::now_ms())).unwrap();
    vm.tick();
    let admitted = |s: Stream| ledger().lease(lease_of(s)).is_some();
    assert!(!admitted(vip), "the front needs the whole pool");
    assert!(admitted(retry), "admitted with the bytes its claim held");
    assert_eq!(ledger().claimed(), 0, "nothing set aside sits idle");
    vm.respond(retry);
    vm.finish(retry);
    vm.finish(vip);
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(92, Vm::now_ms())).unwrap();
    assert_eq!(ledger().committed(), 0);
}

/// Behind a 9,000-token front (500 + `front_cap` tokens in
/// [`a_queue_front_blocked_for_20_s_with_cap`]) that waits for a 6,000-token lease expected to end in about
/// 19.6 s (of a 10,000-token pool), a 300-token batch request queued before the polls gave a
/// decode rate; then two polls give one (100 tokens/s). `extra`: more filter configuration.
fn a_queue_front_blocked_for_20_s(extra: Value) -> (Vm, Stream, Stream) {
    a_queue_front_blocked_for_20_s_with_cap(8_500, extra)
}

/// [`a_queue_front_blocked_for_20_s`], with a front of 500 + `front_cap` tokens (more than the
/// 4,000 free).
fn a_queue_front_blocked_for_20_s_with_cap(front_cap: u64, extra: Value) -> (Vm, Stream, Stream) {
    let mut config = json!({ "policy": vip_and_batch_queued("vip", 60_000) });
    config["backend"] = json!({"cluster": "kvgate_backend", "poll_ms": 200,
                               "lost_grace_ms": 600_000});
    if let (Some(c), Some(e)) = (config.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    let mut vm = start(10_000, config);
    put_lease(21, 6_000, "vip", 9, owner_id());
    // The front (9,000 tokens by default), refused twice (arrival, then a tick): its claim is
    // active and holds the 4,000 free.
    let (front, action) = vm.post("/v1/completions", &[], &completion(500, Some(front_cap)));
    assert_eq!(action, Action::Pause, "queued");
    vm.advance_ms(100);
    vm.tick();
    let l = ledger();
    assert_eq!((l.free(), l.claimed()), (0, 4_000 * PER_TOKEN));
    // No decode rate known yet: a short batch request queues behind the front like any other.
    let batch = |prompt: usize, cap: u64| completion(prompt, Some(cap));
    let (early, action) = vm.post("/v1/completions", &[("x-class", "batch")], &batch(100, 200));
    assert_eq!(action, Action::Pause, "queued: its run is not known");

    // Two polls: lease 21 decodes 30 tokens in 300 ms (100 tokens/s) and outputs have been
    // stopping at 2,000 tokens, so it is expected to end in about 19.6 s.
    let mut answered = Vec::new();
    let mut poll = |vm: &mut Vm, generated: u64, finished: Value| {
        vm.advance_ms(300);
        vm.tick();
        let call = Vm::calls()
            .into_iter()
            .filter(|c| {
                c.header(":path")
                    .is_some_and(|p| p.starts_with("/v1/admission/leases"))
            })
            .find(|c| !answered.contains(&c.token))
            .expect("a poll");
        answered.push(call.token);
        let body = json!({
            "pool": {"capacity_bytes": 10_000 * PER_TOKEN, "used_bytes": 6_000 * PER_TOKEN},
            "admission": "reserve", "gateway_note": true,
            "leases": [{"id": "21", "state": "running", "prompt_tokens": 100,
                        "max_tokens": 5_900, "reserved_tokens": 6_000,
                        "reserved_bytes": 6_000 * PER_TOKEN, "used_tokens": 100 + generated,
                        "used_bytes": (100 + generated) * PER_TOKEN}],
            "finished": finished, "cursor": 1,
        });
        vm.answer_call(call.token, 200, body.to_string().as_bytes());
    };
    let outputs: Vec<Value> = (0..5)
        .map(|i| json!({"id": format!("internal-{i}"), "reason": "stop", "completion_tokens": 2_000}))
        .collect();
    poll(&mut vm, 10, Value::Array(outputs));
    poll(&mut vm, 40, json!([]));
    let eta = ledger().lease(21).map(|l| l.eta_ms).unwrap();
    assert!(
        (Vm::now_ms() + 15_000..Vm::now_ms() + 25_000).contains(&eta),
        "lease 21 expected to end in about 19.6 s: {}",
        eta.saturating_sub(Vm::now_ms())
    );
    (vm, front, early)
}

/// A backfill: behind a front that needs most of the pool, a request expected to be done
/// before the front could start goes ahead, both from the queue (once the polls give a decode
/// rate) and on arrival; one that would still run when the front could start waits its turn.
#[test]
fn a_request_done_before_the_queue_front_could_start_goes_ahead_of_it() {
    let (mut vm, front, early) = a_queue_front_blocked_for_20_s(json!({}));
    let batch = |prompt: usize, cap: u64| completion(prompt, Some(cap));
    let admitted = |s: Stream| ledger().lease(lease_of(s)).cloned();
    // That poll's tick came before the rate: the next one backfills the queued request (200
    // tokens: 2 s), and its lease starts with that expected end.
    assert!(admitted(early).is_none());
    vm.advance_ms(100);
    vm.tick();
    let lease = admitted(early).expect("backfilled from the queue");
    assert_eq!(lease.eta_ms, Vm::now_ms() + 2_000);
    assert!(Vm::resumed(early));
    assert!(admitted(front).is_none(), "the front still waits");
    assert_eq!(Vm::metric("kvgate.backfilled"), 1);
    assert_eq!(Vm::metric("kvgate.queued"), 1);
    // 3,500 tokens would run 35 s, past the front's start: it queues and stays queued.
    let (long, action) = vm.post(
        "/v1/completions",
        &[("x-class", "batch")],
        &batch(100, 3_500),
    );
    assert_eq!(action, Action::Pause, "queued");
    vm.advance_ms(100);
    vm.tick();
    assert!(admitted(long).is_none(), "it would delay the front");
    // A newcomer done in 1 s goes ahead on arrival.
    let (quick, action) = vm.post("/v1/completions", &[("x-class", "batch")], &batch(100, 100));
    assert_eq!(action, Action::Continue, "admitted at once");
    assert!(admitted(quick).is_some());
    assert_eq!(Vm::metric("kvgate.backfilled"), 2);
    assert_eq!(Vm::metric("kvgate.queued"), 2);
    let l = ledger();
    assert_eq!(l.committed(), (6_000 + 300 + 200) * PER_TOKEN);
    l.check().unwrap();

    // Lease 21 ends: the front takes its 9,000 beside the two backfills (their 500 end first in
    // a real run); the long one still waits behind it.
    for s in [early, quick] {
        vm.respond(s);
        vm.finish(s);
    }
    assert_eq!(
        Vm::metric("kvgate.backfill_overran"),
        0,
        "both ended in time"
    );
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(21, Vm::now_ms())).unwrap();
    vm.advance_ms(100);
    vm.tick();
    assert!(
        admitted(front).is_some(),
        "the front goes first once it fits"
    );
    assert!(admitted(long).is_none());
    vm.respond(front);
    vm.finish(front);
    vm.tick();
    assert!(admitted(long).is_some());
    vm.respond(long);
    vm.finish(long);
    assert_eq!(ledger().committed(), 0);
    assert_eq!(Vm::metric("kvgate.queued"), 0);
}

/// A queued elastic batch request (100 + a cap of 5,000 tokens) behind a front of 500 +
/// `front_cap` tokens, weighed as a backfill on the tick after a poll taught its class that it
/// answers in 150 tokens. Returns the VM, the front, the early backfill and the request.
fn an_elastic_request_queued_behind_a_front_of(front_cap: u64) -> (Vm, Stream, Stream, Stream) {
    let queued = |priority: u8| json!({"action": "queue", "max_wait_ms": 60_000, "max_depth": 8, "priority": priority});
    let mut batch = queued(0);
    batch["reservation"] = "elastic".into();
    batch["elastic_min_samples"] = 5.into();
    let policy = json!({"default_class": "vip", "class_header": "x-class", "class_header_trusted": true,
                        "classes": {"vip": queued(9), "batch": batch}});
    let (mut vm, front, early) =
        a_queue_front_blocked_for_20_s_with_cap(front_cap, json!({ "policy": policy }));
    let admitted = |s: Stream| ledger().lease(lease_of(s)).cloned();
    vm.advance_ms(100);
    vm.tick();
    assert!(admitted(early).is_some(), "backfilled as before");
    // Nothing learned of the class yet: priced at its cap of 5,000 (50 s), it queues behind the
    // front and is no backfill: it needs more than the 4,000 tokens the line holds.
    let (late, action) = vm.post(
        "/v1/completions",
        &[("x-class", "batch")],
        &completion(100, Some(5_000)),
    );
    assert_eq!(action, Action::Pause, "queued");
    vm.advance_ms(100);
    vm.tick();
    assert!(admitted(late).is_none());
    // A poll brings five outputs of the class that answered prompts of its length in 150
    // tokens: priced now at 100 + 150 tokens, it fits in what the line holds.
    vm.advance_ms(300);
    vm.tick();
    let call = Vm::calls()
        .into_iter()
        .rev()
        .find(|c| {
            c.header(":path")
                .is_some_and(|p| p.starts_with("/v1/admission/leases"))
        })
        .expect("a poll");
    let finished: Vec<Value> = (0..5)
        .map(|i| {
            json!({"id": format!("b{i}"), "reason": "stop", "completion_tokens": 150,
                        "class": "batch", "gateway_prompt_tokens": 100})
        })
        .collect();
    let body = json!({
        "pool": {"capacity_bytes": 10_000 * PER_TOKEN, "used_bytes": 6_300 * PER_TOKEN},
        "admission": "reserve", "gateway_note": true,
        "leases": [{"id": "21", "state": "running", "prompt_tokens": 100,
                    "max_tokens": 5_900, "reserved_tokens": 6_000,
                    "reserved_bytes": 6_000 * PER_TOKEN, "used_tokens": 170,
                    "used_bytes": 170 * PER_TOKEN}],
        "finished": finished, "cursor": 2,
    });
    vm.answer_call(call.token, 200, body.to_string().as_bytes());
    vm.advance_ms(100);
    vm.tick();
    (vm, front, early, late)
}

/// A queued elastic request is priced as of each tick when it is weighed as a backfill, not as
/// of its last try: its class may have learned since that it answers in far less than its cap.
#[test]
fn a_queued_elastic_request_is_weighed_as_a_backfill_at_what_its_class_has_learned_since() {
    // A front of 4,500 tokens: when it starts, 5,500 are left beside it, room for the request
    // even grown to its cap (5,100). Its run is weighed at its cap (about 50 s at 100
    // tokens/s), not at 150 tokens: the line does not take back what it grows past them.
    let (vm, front, early, late) = an_elastic_request_queued_behind_a_front_of(4_000);
    let admitted = |s: Stream| ledger().lease(lease_of(s)).cloned();
    let lease = admitted(late).expect("backfilled at what its class learned");
    assert_eq!(lease.bytes, 250 * PER_TOKEN);
    let run_ms = lease.eta_ms - Vm::now_ms();
    assert!(
        (50_000..60_000).contains(&run_ms),
        "run to its cap: {run_ms} ms"
    );
    assert!(Vm::resumed(late));
    assert!(admitted(front).is_none(), "the front still waits");
    let forwarded: Value = serde_json::from_slice(&Vm::body(late)).unwrap();
    assert_eq!(forwarded["kvgate"]["reserve_output"], 150);
    assert_eq!(forwarded["max_tokens"], 5_000, "the cap is kept");
    for s in [early, late, front] {
        vm.finish(s);
    }
}

/// Beside a front of 9,000 tokens, 1,000 are left when it starts: room for the request's 250
/// tokens, not for the 5,100 it may grow to, which the line would not take back. It waits.
#[test]
fn a_queued_elastic_request_is_no_backfill_where_it_could_outgrow_the_room_beside_the_front() {
    let (vm, front, early, late) = an_elastic_request_queued_behind_a_front_of(8_500);
    assert!(ledger().lease(lease_of(late)).is_none());
    assert!(!Vm::resumed(late));
    for s in [early, late, front] {
        vm.finish(s);
    }
}

/// A backfill that runs past its expected end is counted, with by how much: what the estimate
/// cost the line's front (the decode rate the estimate used can drop).
#[test]
fn a_backfill_that_runs_past_its_expected_end_is_counted() {
    let (vm, front, early) = a_queue_front_blocked_for_20_s(json!({}));
    vm.advance_ms(100);
    vm.tick();
    let lease = ledger()
        .lease(lease_of(early))
        .cloned()
        .expect("backfilled from the queue");
    assert_eq!(lease.eta_ms, Vm::now_ms() + 2_000);
    // It runs 3.5 s, not the 2 s expected.
    vm.advance_ms(3_500);
    vm.respond(early);
    vm.finish(early);
    assert_eq!(Vm::metric("kvgate.backfilled"), 1);
    assert_eq!(Vm::metric("kvgate.backfill_overran"), 1);
    assert_eq!(Vm::metric("kvgate.backfill_overrun_ms"), 1_500);
    // The front is served once lease 21 ends; nothing else is counted.
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(21, Vm::now_ms())).unwrap();
    vm.advance_ms(100);
    vm.tick();
    assert!(ledger().lease(lease_of(front)).is_some());
    vm.respond(front);
    vm.finish(front);
    assert_eq!(Vm::metric("kvgate.backfill_overran"), 1);
    assert_eq!(ledger().committed(), 0);
}

/// `fair_retry_backfill: false`: nobody goes ahead of the line, from the queue or on arrival.
#[test]
fn with_backfills_off_nothing_goes_ahead_of_the_queue_front() {
    let (mut vm, front, early) =
        a_queue_front_blocked_for_20_s(json!({"fair_retry_backfill": false}));
    vm.advance_ms(100);
    vm.tick();
    let (quick, action) = vm.post(
        "/v1/completions",
        &[("x-class", "batch")],
        &completion(100, Some(100)),
    );
    assert_eq!(action, Action::Pause, "queued");
    vm.tick();
    let admitted = |s: Stream| ledger().lease(lease_of(s)).is_some();
    assert!(!admitted(early) && !admitted(quick) && !admitted(front));
    assert_eq!(Vm::metric("kvgate.backfilled"), 0);
    assert_eq!(Vm::metric("kvgate.queued"), 3);
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(21, Vm::now_ms())).unwrap();
    vm.tick();
    assert!(admitted(front), "the front first");
    vm.respond(front);
    vm.finish(front);
    vm.tick();
    for s in [early, quick] {
        assert!(admitted(s));
        vm.respond(s);
        vm.finish(s);
    }
    assert_eq!(ledger().committed(), 0);
}

// ---- 5. the backend poll -------------------------------------------------------------------

fn report(used: u64, live: &[u64], finished: &[u64], cursor: u64) -> Vec<u8> {
    let ids =
        |v: &[u64]| -> Vec<Value> { v.iter().map(|i| json!({"id": i.to_string()})).collect() };
    let ended: Vec<Value> = finished
        .iter()
        .map(|i| json!({"id": i.to_string(), "reason": "stop"}))
        .collect();
    json!({
        "pool": {"capacity_bytes": 20_000 * PER_TOKEN, "used_bytes": used},
        "leases": ids(live), "finished": ended, "cursor": cursor,
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

/// Post `body` in front of a vLLM (which is told no lease id): the stream and the lease it added.
fn post_for_lease(vm: &mut Vm, body: &str) -> (Stream, u64) {
    let before: Vec<u64> = ledger().leases().iter().map(|l| l.id).collect();
    let (s, _) = vm.post("/v1/completions", &[], body);
    let id = ledger()
        .leases()
        .iter()
        .map(|l| l.id)
        .find(|id| !before.contains(id))
        .expect("a lease was added");
    (s, id)
}

/// vLLM's metrics: a pool of `blocks` blocks of 16 tokens, `usage` of it in use, `preemptions`
/// so far.
fn vllm_metrics(blocks: u64, usage: f64, preemptions: u64) -> Vec<u8> {
    format!(
        "# TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {usage}\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 1.0\n\
         vllm:num_preemptions_total{{engine=\"0\",model_name=\"m\"}} {preemptions}.0\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"{blocks}\"}} 1.0\n"
    )
    .into_bytes()
}

#[test]
fn in_front_of_a_vllm_its_pool_sizes_the_ledger_its_use_is_held_back_and_preemptions_alarm() {
    let mut vm = start(
        20_000,
        json!({"backend": {"api": "vllm", "cluster": "vllm", "poll_ms": 200}}),
    );
    let (s, id) = post_for_lease(&mut vm, &completion(100, Some(100)));
    // The request reaches vLLM without kvgate's note in its body (it would take it for a field).
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert!(forwarded.get("kvgate").is_none());
    for h in [
        "x-kvgate-lease",
        "x-kvgate-class",
        "x-kvgate-note",
        "x-kvgate-secret",
    ] {
        assert_eq!(Vm::request_header(s, h), None, "{h} is not told to vLLM");
    }
    vm.advance_ms(5_000);
    vm.tick();
    let polls = calls_to("/metrics");
    assert_eq!(polls.len(), 1);
    assert_eq!(polls[0].header(":path"), Some("/metrics"), "no query");
    // 1,000 blocks of 16 tokens, 30 % in use: 4,800 tokens, 2,600 more than the lease reserves
    // with its block of margin.
    vm.answer_call(polls[0].token, 200, &vllm_metrics(1_000, 0.3, 2));
    let l = ledger();
    assert_eq!(
        l.capacity(),
        16_000 * PER_TOKEN,
        "the ledger follows vLLM's pool"
    );
    assert_eq!(
        l.lease(id).map(|l| l.bytes),
        Some(200 * PER_TOKEN),
        "not released early"
    );
    assert_eq!(l.held_back(), (4_800 - 200) * PER_TOKEN);
    assert_eq!(
        Vm::metric("kvgate.unseen_leases"),
        0,
        "vLLM lists no leases: none unseen"
    );
    assert_eq!(
        Vm::metric("kvgate.backend_preemptions"),
        2,
        "vLLM's own counter"
    );
    // Later, fewer in use, and 3 more preemptions: counted and logged.
    vm.advance_ms(300);
    vm.tick();
    let polls = calls_to("/metrics");
    vm.answer_call(polls[1].token, 200, &vllm_metrics(1_000, 0.0, 5));
    assert_eq!(ledger().held_back(), 0);
    assert_eq!(Vm::metric("kvgate.backend_preemptions"), 5);
    assert!(logs().iter().any(|m| m.contains("preempted 3 sequences")));
    // A new request is priced with vLLM's block as its margin.
    let (s2, id2) = post_for_lease(&mut vm, &completion(100, Some(100)));
    assert_eq!(ledger().lease(id2).map(|l| l.bytes), Some(216 * PER_TOKEN));
    // Ends release; a client gone sends vLLM no cancel (its stream's reset stops it).
    vm.respond(s);
    vm.finish(s);
    vm.finish(s2);
    assert_eq!(ledger().committed(), 0);
    assert!(calls_to("cancel").is_empty());
    // What is not a vLLM's metrics is a failed poll.
    vm.advance_ms(300);
    vm.tick();
    let polls = calls_to("/metrics");
    vm.answer_call(polls[2].token, 200, b"{}");
    assert_eq!(Vm::metric("kvgate.backend_poll_failures"), 1);
}

#[test]
fn in_front_of_a_vllm_an_elastic_class_reserves_what_its_histogram_says_outputs_run_to() {
    let mut vm = start(
        20_000,
        json!({"backend": {"api": "vllm", "cluster": "vllm", "poll_ms": 200},
               "policy": {"classes": {"default": {"reservation": "elastic",
                   "elastic_min_samples": 5, "elastic_prior_tokens": 64, "elastic_quantile": 0.9}}}}),
    );
    // Before anything finished: the prior.
    let (s, id) = post_for_lease(&mut vm, &completion(100, Some(4_000)));
    assert_eq!(
        ledger().lease(id).map(|l| l.bytes),
        Some((100 + 64) * PER_TOKEN)
    );
    vm.respond(s);
    vm.finish(s);
    // The first poll is the baseline (nothing finished yet); then ten outputs of at most 50
    // tokens, one of at most 200.
    vm.advance_ms(300);
    vm.tick();
    let polls = calls_to("/metrics");
    vm.answer_call(polls[0].token, 200, &vllm_metrics(1_000, 0.0, 0));
    let mut body = vllm_metrics(1_000, 0.0, 0);
    body.extend_from_slice(
        b"vllm:request_generation_tokens_bucket{le=\"50.0\"} 10\n\
          vllm:request_generation_tokens_bucket{le=\"200.0\"} 11\n\
          vllm:request_generation_tokens_bucket{le=\"+Inf\"} 11\n",
    );
    vm.advance_ms(300);
    vm.tick();
    let polls = calls_to("/metrics");
    vm.answer_call(polls[1].token, 200, &body);
    let (s, id) = post_for_lease(&mut vm, &completion(100, Some(4_000)));
    let lease = ledger().lease(id).map(|l| l.bytes);
    // The 0.9 quantile of eleven: the tenth, 50 tokens, and a vLLM block of 16; the request
    // keeps its cap of 4,000.
    assert_eq!(lease, Some((100 + 50 + 16) * PER_TOKEN));
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert_eq!(forwarded["max_tokens"], 4_000);
    assert!(forwarded.get("kvgate").is_none(), "vLLM gets no note");
    vm.respond(s);
    vm.finish(s);
    assert_eq!(ledger().committed(), 0);
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

#[test]
fn a_request_sent_before_its_backend_went_down_is_answered_503_once_it_is_known_down() {
    let mut vm = start(
        20_000,
        json!({"backend": {"cluster": "kvgate_backend", "poll_ms": 200,
                           "down_after_failures": 2}}),
    );
    let poll = |vm: &Vm, status: u32, body: &[u8]| {
        vm.advance_ms(300);
        vm.tick();
        let call = Vm::calls().last().cloned().unwrap();
        vm.answer_call(call.token, status, body);
    };
    poll(&vm, 200, &report(0, &[], &[], 1));
    // Sent on before the backend froze; another answered before (nothing to answer for it).
    let (answered, a) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(a, Action::Continue);
    vm.respond(answered);
    let (sent, a) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(a, Action::Continue);
    poll(&vm, 503, b"");
    assert!(Vm::replies(sent).is_empty(), "one failure is not down");
    poll(&vm, 503, b"");
    vm.advance_ms(100);
    vm.tick();
    let replies = Vm::replies(sent);
    assert_eq!(
        replies.len(),
        1,
        "answered at the first tick that knows it is down"
    );
    assert_eq!(replies[0].status, 503);
    assert_eq!(replies[0].json()["error"]["code"], "backend_unavailable");
    assert!(replies[0].header("retry-after").is_some());
    assert!(Vm::replies(answered).is_empty());
    vm.finish(sent);
    vm.finish(answered);
    assert_eq!(ledger().committed(), 0);
}

/// Every worker polls the backend and writes its health to shared data; this one's copy is a
/// tick old when another worker has just counted the backend down. Each path that reads the
/// health between ticks sees "down" — a priced request (a fast 503), the level an unpriced
/// request is told, the status — and each path that writes it (a failed poll, the backend's own
/// 429) counts on from the record instead of writing this worker's stale "up" over it. Before
/// each check this worker's copy is made "up" again, so every check stands on its own.
#[test]
fn a_backend_another_worker_marked_down_is_down_here_before_this_workers_tick() {
    let mut vm = start(
        20_000,
        json!({"backend": {"cluster": "kvgate_backend", "poll_ms": 200,
                           "down_after_failures": 2}}),
    );
    let health_key = "kvgate.backend.v3";
    /// The level a request that is not priced (`GET /v1/models`) is told.
    fn level_seen(vm: &mut Vm) -> Option<String> {
        let s = vm.open("GET", "/v1/models", &[], b"");
        assert_eq!(vm.request_headers(s, true), Action::Continue);
        vm.respond(s);
        Vm::response_header(s, "x-kvgate-level")
    }
    fn poll(vm: &Vm, status: u32, body: &[u8]) {
        vm.advance_ms(300);
        vm.tick();
        let call = Vm::calls().last().cloned().unwrap();
        vm.answer_call(call.token, status, body);
    }
    let recorded = || {
        testhost::with(|h| h.shared.get(health_key).cloned())
            .unwrap()
            .0
    };
    let record = |bytes: &[u8]| {
        testhost::with(|h| {
            let cas = h.shared.get(health_key).map_or(0, |(_, c)| *c);
            h.shared
                .insert(health_key.to_string(), (bytes.to_vec(), cas + 1));
        });
    };
    poll(&vm, 503, b"");
    poll(&vm, 503, b"");
    assert_eq!(Vm::metric("kvgate.backend_up"), 0);
    // What "another worker" records: down, after two failures.
    let down = recorded();
    let mut cursor = 0;
    // This worker's copy (and the record) up after an answered poll; then the other worker's
    // "down" lands, with no tick in between. Returns the "up" record.
    let mut up_here_down_recorded = |vm: &Vm| {
        cursor += 1;
        poll(vm, 200, &report(0, &[], &[], cursor));
        assert_eq!(Vm::metric("kvgate.backend_up"), 1);
        let up = recorded();
        record(&down);
        up
    };

    // A priced request is answered from its headers, before its body is read.
    up_here_down_recorded(&vm);
    let body = completion(10, Some(10));
    let p = vm.open("POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(vm.request_headers(p, false), Action::Pause);
    let replies = Vm::replies(p);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].status, 503);
    assert_eq!(ledger().committed(), 0);

    up_here_down_recorded(&vm);
    assert_eq!(level_seen(&mut vm).as_deref(), Some("red"));

    up_here_down_recorded(&vm);
    let st = vm.open("GET", "/kvgate/status", &[], b"");
    assert_eq!(vm.request_headers(st, true), Action::Pause);
    let doc = Vm::replies(st)[0].json();
    assert_eq!(doc["backend"]["up"], false, "{doc}");
    assert_eq!(doc["level"], "red");

    // This worker's next poll goes out while the record says up; the other worker records
    // "down" before it is answered, and then it fails too: counted on from the record (still
    // down), not from this worker's copy ("up", which one more failure would not turn down).
    let up = up_here_down_recorded(&vm);
    record(&up);
    vm.advance_ms(300);
    vm.tick();
    let call = Vm::calls().last().cloned().unwrap();
    record(&down);
    vm.answer_call(call.token, 503, b"");
    assert_eq!(Vm::metric("kvgate.backend_up"), 0);
    assert_eq!(level_seen(&mut vm).as_deref(), Some("red"));

    // An admitted request that the backend refuses (its own 429) marks the endpoint full, from
    // the record: "down" stays down.
    record(&up);
    vm.advance_ms(300);
    vm.tick(); // this worker's copy: up
    let (s, _) = vm.post("/v1/completions", &[], &completion(10, Some(10)));
    assert!(ledger().lease(lease_of(s)).is_some(), "admitted while up");
    record(&down);
    vm.respond_from(s, 429, "127.0.0.1:8000");
    vm.finish(s);
    assert_eq!(level_seen(&mut vm).as_deref(), Some("red"));
}

/// `fair_retry_max_line` (here half the pool) bounds the fair-retry line for requests answered
/// with a 429: refusals take places while what the active places (those whose clients came
/// back) lack is within the bound, the next gets a 429 and no place. A `queue` class's
/// requests keep their places in the gateway's queue however long the line.
#[test]
fn the_line_bound_gives_no_place_past_it_to_a_refusal_and_leaves_the_queue_alone() {
    let mut policy = vip_and_batch_queued("std", 60_000);
    policy["classes"]["std"] = json!({"action": "reject", "priority": 1});
    let mut vm = start(
        1_000,
        json!({ "policy": policy, "fair_retry_max_line": 0.5 }),
    );
    put_lease(91, 950, "std", 1, owner_id());
    let keys = || ledger().claims().iter().map(|c| c.key).collect::<Vec<_>>();
    // 300 tokens each (bodies differ, so each would have its own place).
    let mut refuse = |prompt: usize| {
        let (s, _) = vm.post(
            "/v1/completions",
            &[("x-class", "std")],
            &completion(prompt, Some(300 - prompt as u64)),
        );
        assert_eq!(Vm::replies(s)[0].status, 429);
        vm.finish(s);
    };
    refuse(100);
    assert_eq!(keys().len(), 1, "an empty line: a place");
    refuse(101);
    assert_eq!(keys().len(), 2, "no active place ahead: a place");
    // Their clients come back: both places active, lacking 550 (the first holds the 50 free).
    refuse(100);
    refuse(101);
    assert!(ledger().claims().iter().all(|c| c.active));
    refuse(102);
    assert_eq!(
        keys().len(),
        2,
        "550 lacking ahead > 500: a 429 and no place"
    );
    // Queued requests keep their places past the bound.
    for prompt in [103, 104] {
        let (s, action) = vm.post(
            "/v1/completions",
            &[("x-class", "batch")],
            &completion(prompt, Some(300 - prompt as u64)),
        );
        assert_eq!(action, Action::Pause, "queued");
        vm.finish(s);
    }
    assert_eq!(keys().len(), 4, "both queued requests have their places");
    // The queued requests' clients are there (a backfill may not count on their absence); the
    // refused ones' are away until their Retry-After.
    let waits: Vec<bool> = ledger().claims().iter().map(|c| c.waits).collect();
    assert_eq!(waits, [false, false, true, true]);
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(91, Vm::now_ms())).unwrap();
    assert_eq!(ledger().committed(), 0);
}

/// A client that closes its stream while its request waits in the queue is gone: what its place
/// in the fair-retry line holds goes to the requests behind it at once, not when the place
/// expires (live under sustained overload, before this, places in line held 10.4 MiB of the
/// 25.3 MiB pool on average, much of it for clients gone from the queue). Its place stays,
/// inactive, for the same request's retry.
#[test]
fn a_client_gone_from_the_queue_leaves_what_its_place_held_to_the_next() {
    let mut vm = start(
        3_000,
        json!({ "policy": vip_and_batch_queued("batch", 60_000) }),
    );
    put_lease(91, 1_000, "batch", 0, owner_id());
    put_lease(92, 2_000, "batch", 0, owner_id());
    // A needs 1,500 tokens, B 1,000; both wait, A in front.
    let (a, action) = vm.post("/v1/completions", &[], &completion(500, Some(1_000)));
    assert_eq!(action, Action::Pause, "queued");
    vm.advance_ms(100);
    let (b, action) = vm.post("/v1/completions", &[], &completion(400, Some(600)));
    assert_eq!(action, Action::Pause, "queued");
    vm.advance_ms(100);
    vm.tick();
    // 1,000 free up: set aside for A, the front, which still lacks 500.
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(91, Vm::now_ms())).unwrap();
    vm.advance_ms(100);
    vm.tick();
    let admitted = |s: Stream| ledger().lease(lease_of(s)).is_some();
    assert!(!admitted(a) && !admitted(b));
    assert_eq!(
        ledger().claimed(),
        1_000 * 46_080,
        "A's place holds the 1,000 freed"
    );
    // A's client gives up.
    vm.finish(a);
    assert_eq!(
        ledger().claimed(),
        0,
        "nothing held for a client who is gone"
    );
    assert_eq!(Vm::metric("kvgate.left_line_holding"), 1);
    assert!(
        ledger()
            .claims()
            .iter()
            .any(|c| c.bytes == 1_500 * 46_080 && !c.active),
        "A's place stays for its retry, holding nothing"
    );
    vm.advance_ms(100);
    vm.tick();
    assert!(admitted(b), "B takes the 1,000 at the next tick");
    vm.respond(b);
    vm.finish(b);
    store::transact(&EnvoyStore, LEDGER_KEY, 1, |l| l.release(92, Vm::now_ms())).unwrap();
    assert_eq!(ledger().committed(), 0);
}

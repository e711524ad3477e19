//! Several backend endpoints behind one filter: the choice, the routing, each endpoint's own
//! ledger, polls and health, foreign bytes, a backend's own refusal, and a live endpoint list.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvgate_core::store;
use kvgate_core::Ledger;
use proxy_wasm::types::Action;
use serde_json::{json, Value};

use super::*;
use crate::host::EnvoyStore;
use crate::testhost::{self, Stream, Vm, EPOCH_MS};

const A: &str = "10.0.0.1:8000";
const B: &str = "10.0.0.2:8000";

fn fleet(endpoints: &[&str], extra: Value) -> Value {
    let mut backend = json!({"cluster": "kvgate_backend", "endpoints": endpoints,
                             "poll_ms": 200, "down_after_failures": 2, "lost_grace_ms": 1000});
    for (k, v) in extra.as_object().cloned().unwrap_or_default() {
        backend[k] = v;
    }
    json!({ "backend": backend })
}

fn ledger_at(address: &str) -> Ledger {
    store::read(&EnvoyStore, &format!("{LEDGER_KEY}@{address}")).expect("a readable ledger")
}

/// Where the filter told Envoy's balancer to send stream `s`.
fn routed_to(s: Stream) -> Option<String> {
    Vm::property(s, &["kvgate_endpoint"]).map(|v| String::from_utf8(v).unwrap())
}

fn report(used: u64, leases: Value) -> Vec<u8> {
    json!({"pool": {"capacity_bytes": 10_000 * PER_TOKEN, "used_bytes": used},
           "leases": leases, "finished": [], "cursor": 1})
    .to_string()
    .into_bytes()
}

/// A poll answer: A fails, B answers with an empty pool.
fn a_down(e: &str) -> (u32, Vec<u8>) {
    if e == A {
        (503, Vec::new())
    } else {
        (200, report(0, json!([])))
    }
}

/// One poll round: a tick after `poll_ms`, then each endpoint's callout answered by `answer`.
fn poll_round(vm: &Vm, answer: impl Fn(&str) -> (u32, Vec<u8>)) {
    let before = Vm::calls().len();
    vm.advance_ms(300);
    vm.tick();
    for call in Vm::calls().into_iter().skip(before) {
        let path = call.header(":path").unwrap_or_default().to_string();
        if !path.starts_with("/v1/admission/leases") {
            continue;
        }
        let endpoint = call
            .header("x-kvgate-endpoint")
            .expect("a poll names its endpoint")
            .to_string();
        let (status, body) = answer(&endpoint);
        vm.answer_call(call.token, status, &body);
    }
}

#[test]
fn requests_spread_over_the_endpoints_each_reserved_and_released_in_its_own_ledger() {
    let mut vm = start(10_000, fleet(&[A, B], json!({})));
    let streams: Vec<Stream> = (0..4)
        .map(|_| {
            let (s, a) = vm.post("/v1/completions", &[], &completion(500, Some(500)));
            assert_eq!(a, Action::Continue);
            s
        })
        .collect();
    let routes: Vec<_> = streams.iter().map(|s| routed_to(*s).unwrap()).collect();
    assert_eq!(
        routes,
        [A, B, A, B],
        "most room first, ties to the first listed"
    );
    for (s, at) in streams.iter().zip(&routes) {
        assert!(ledger_at(at).lease(lease_of(*s)).is_some());
    }
    assert_eq!(ledger_at(A).committed(), 2_000 * PER_TOKEN);
    assert_eq!(ledger_at(B).committed(), 2_000 * PER_TOKEN);
    assert_eq!(Vm::metric("kvgate.endpoint.10_0_0_1_8000.admitted"), 2);
    assert_eq!(
        Vm::metric("kvgate.committed_bytes"),
        (4_000 * PER_TOKEN) as i64,
        "the fleet's total"
    );
    // The status document lists each endpoint; its totals are the fleet's.
    let st = vm.open("GET", "/kvgate/status", &[], b"");
    vm.request_headers(st, true);
    let doc = Vm::replies(st)[0].json();
    assert_eq!(doc["committed_bytes"], 4_000 * PER_TOKEN);
    assert_eq!(doc["capacity_bytes"], 20_000 * PER_TOKEN);
    assert_eq!(doc["endpoints"][1]["address"], B);
    assert_eq!(doc["endpoints"][1]["committed_bytes"], 2_000 * PER_TOKEN);
    assert_eq!(doc["endpoints"][1]["up"], true);

    // Envoy sent each where it was told: nothing counted as a mismatch.
    for (s, at) in streams.iter().zip(&routes) {
        vm.respond_from(*s, 200, at);
        vm.finish(*s);
    }
    assert_eq!(Vm::metric("kvgate.upstream_mismatch"), 0);
    assert_eq!(ledger_at(A).committed(), 0);
    assert_eq!(ledger_at(B).committed(), 0);

    // Sent elsewhere than reserved (a host missing from the cluster): counted, and still
    // released where it was reserved.
    let (s, _) = vm.post("/v1/completions", &[], &completion(500, Some(500)));
    vm.respond_from(s, 200, "10.9.9.9:8000");
    vm.finish(s);
    assert_eq!(Vm::metric("kvgate.upstream_mismatch"), 1);
    assert_eq!(ledger_at(A).committed() + ledger_at(B).committed(), 0);
}

#[test]
fn a_request_goes_where_it_fits_whole_before_any_policy_applies() {
    // Batch degrades when nothing fits; here B has room for the whole cap, so no degrade.
    // (Without fair retries, a request that fits nowhere whole is decided where the room is
    // largest; with them, at its home endpoint, where its place in line is kept.)
    let mut vm = start(
        10_000,
        json!({
            "fair_retry_patience_ms": 0,
            "backend": {"cluster": "kvgate_backend", "endpoints": [A, B],
                        "endpoint_choice": "best_fit"},
            "policy": {"default_class": "batch",
                       "classes": {"batch": {"action": "degrade", "min_output_tokens": 10}}},
        }),
    );
    let (big, _) = vm.post("/v1/completions", &[], &completion(100, Some(8_900)));
    assert_eq!(routed_to(big).as_deref(), Some(A));
    let (s, a) = vm.post("/v1/completions", &[], &completion(100, Some(5_000)));
    assert_eq!(a, Action::Continue);
    assert_eq!(routed_to(s).as_deref(), Some(B), "fits whole on B");
    assert_eq!(Vm::metric("kvgate.degraded"), 0);
    // Best fit: a small one goes into A's remaining 1,000 tokens, keeping B's 4,900 whole.
    let (small, _) = vm.post("/v1/completions", &[], &completion(100, Some(400)));
    assert_eq!(routed_to(small).as_deref(), Some(A));
    // Nothing fits whole anywhere now: the policy (degrade) applies on the one with most room.
    let (d, _) = vm.post("/v1/completions", &[], &completion(100, Some(9_000)));
    assert_eq!(routed_to(d).as_deref(), Some(B));
    assert_eq!(Vm::metric("kvgate.degraded"), 1);
    for s in [big, s, small, d] {
        vm.finish(s);
    }
    assert_eq!(ledger_at(A).committed() + ledger_at(B).committed(), 0);
}

#[test]
fn each_endpoint_is_polled_on_its_own_and_a_down_one_is_left_out_until_it_answers() {
    let mut vm = start(10_000, fleet(&[A, B], json!({})));
    let up = |_: &str| (200, report(0, json!([])));
    poll_round(&vm, up);
    // A long request on A, then A stops answering.
    let (on_a, _) = vm.post("/v1/completions", &[], &completion(500, Some(500)));
    assert_eq!(routed_to(on_a).as_deref(), Some(A));
    let a_lease = lease_of(on_a);
    poll_round(&vm, a_down);
    poll_round(&vm, a_down);
    assert!(logs()
        .iter()
        .any(|m| m.contains(A) && m.contains("is down after 2 failed polls")));
    assert_eq!(Vm::metric("kvgate.endpoint.10_0_0_1_8000.up"), 0);
    // New requests go to B only, though A has more room.
    for _ in 0..3 {
        let (s, a) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
        assert_eq!(a, Action::Continue);
        assert_eq!(routed_to(s).as_deref(), Some(B));
        vm.finish(s);
    }
    // The request on A ends as every request does: its lease goes then, not before.
    assert!(ledger_at(A).lease(a_lease).is_some());
    vm.finish(on_a);
    assert_eq!(ledger_at(A).committed(), 0);
    // B down too: nothing is sent anywhere, answered at once.
    let all_down = |_: &str| (503, Vec::new());
    poll_round(&vm, all_down);
    poll_round(&vm, all_down);
    let body = completion(100, Some(100));
    let s = vm.open("POST", "/v1/completions", &[], body.as_bytes());
    assert_eq!(
        vm.request_headers(s, false),
        Action::Pause,
        "answered at the headers"
    );
    let r = &Vm::replies(s)[0];
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "backend_unavailable");
    // A answers again: chosen again.
    poll_round(&vm, |e| {
        if e == A {
            (200, report(0, json!([])))
        } else {
            (503, Vec::new())
        }
    });
    let (s, a) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(a, Action::Continue);
    assert_eq!(routed_to(s).as_deref(), Some(A));
    vm.finish(s);
}

#[test]
fn another_gateways_leases_are_held_back_at_their_endpoint() {
    let mut vm = start(10_000, fleet(&[A, B], json!({})));
    // B holds 6,000 tokens for a lease this gateway does not own.
    let foreign = 6_000 * PER_TOKEN;
    poll_round(&vm, |e| {
        if e == B {
            let leases = json!([{"id": "999", "state": "running", "reserved_bytes": foreign}]);
            (200, report(foreign, leases))
        } else {
            (200, report(0, json!([])))
        }
    });
    // The foreign bytes, and half of the rest: the other gateway may take it before B's next
    // poll.
    assert_eq!(ledger_at(B).held_back(), foreign + 2_000 * PER_TOKEN);
    assert_eq!(
        Vm::metric("kvgate.endpoint.10_0_0_2_8000.foreign_bytes"),
        foreign as i64
    );
    // A 5,500-token request fits only on A now (B has 2,000); a second fits nowhere.
    let (s1, a1) = vm.post("/v1/completions", &[], &completion(1_000, Some(4_500)));
    assert_eq!(a1, Action::Continue);
    assert_eq!(routed_to(s1).as_deref(), Some(A));
    let (s2, a2) = vm.post("/v1/completions", &[], &completion(1_000, Some(4_500)));
    assert_eq!(a2, Action::Pause);
    assert_eq!(Vm::replies(s2)[0].status, 429);
    let st = vm.open("GET", "/kvgate/status", &[], b"");
    vm.request_headers(st, true);
    let doc = Vm::replies(st)[0].json();
    assert_eq!(doc["endpoints"][1]["foreign_bytes"], foreign);
    assert_eq!(doc["endpoints"][1]["foreign_leases"], 1);
    // The foreign request ended: B's room is back at its next poll.
    poll_round(&vm, |_| (200, report(0, json!([]))));
    let (s3, a3) = vm.post("/v1/completions", &[], &completion(1_000, Some(4_500)));
    assert_eq!(a3, Action::Continue);
    assert_eq!(routed_to(s3).as_deref(), Some(B));
    for s in [s1, s2, s3] {
        vm.finish(s);
    }
    assert_eq!(ledger_at(A).committed() + ledger_at(B).committed(), 0);
}

#[test]
fn a_poll_names_this_envoy_and_a_peer_that_polls_takes_half_the_room_before_it_holds_a_lease() {
    let mut vm = start(10_000, fleet(&[A, B], json!({})));
    let before = Vm::calls().len();
    // B says another gateway (number 9) polls it; it holds no lease there yet.
    poll_round(&vm, |e| {
        let mut r: Value = serde_json::from_slice(&report(0, json!([]))).unwrap();
        if e == B {
            r["other_gateways"] = json!([9]);
        }
        (200, r.to_string().into_bytes())
    });
    // Every poll names this gateway's number, its Envoy and its poll period, the same Envoy
    // for both endpoints.
    let polls: Vec<String> = Vm::calls()
        .into_iter()
        .skip(before)
        .filter_map(|c| c.header(":path").map(str::to_string))
        .filter(|p| p.starts_with("/v1/admission/leases"))
        .collect();
    assert_eq!(polls.len(), 2);
    let instance = |p: &str| {
        let i = p.split("&instance=").nth(1).unwrap();
        i.split('&').next().unwrap().to_string()
    };
    for p in &polls {
        assert!(p.contains("&gateway=") && p.contains("&poll_ms=200"), "{p}");
        assert_eq!(instance(p).len(), 16, "{p}");
    }
    assert_eq!(instance(&polls[0]), instance(&polls[1]));
    // It is the one this Envoy keeps in shared data, which every worker reads when it polls:
    // after two first workers both drew one, the one the store kept.
    let kept = |key| {
        let (v, _) = proxy_wasm::hostcalls::get_shared_data(key).unwrap();
        u64::from_le_bytes(v.unwrap()[..8].try_into().unwrap())
    };
    let drawn = kept("kvgate.instance.v1");
    assert_ne!(drawn, 0);
    assert_eq!(instance(&polls[0]), format!("{drawn:016x}"));
    // Half of B's room is the other gateway's until B's next poll; A is this gateway's alone.
    assert_eq!(ledger_at(B).held_back(), 5_000 * PER_TOKEN);
    assert_eq!(ledger_at(A).held_back(), 0);
    let st = vm.open("GET", "/kvgate/status", &[], b"");
    vm.request_headers(st, true);
    let doc = Vm::replies(st)[0].json();
    assert_eq!(doc["endpoints"][0]["other_gateways"], 0);
    assert_eq!(doc["endpoints"][1]["other_gateways"], 1);
    // A 6,000-token request fits only on A.
    let (s, a) = vm.post("/v1/completions", &[], &completion(1_000, Some(5_000)));
    assert_eq!(a, Action::Continue);
    assert_eq!(routed_to(s).as_deref(), Some(A));
    vm.finish(s);
    // The peer stopped polling: B's room is all this gateway's again.
    poll_round(&vm, |_| (200, report(0, json!([]))));
    assert_eq!(ledger_at(B).held_back(), 0);
    // Another worker's write won the race to draw the instance: this one names that one too,
    // and so does a new configuration's root context.
    let other = drawn ^ 1;
    proxy_wasm::hostcalls::set_shared_data("kvgate.instance.v1", Some(&other.to_le_bytes()), None)
        .unwrap();
    let (_, ok) = vm.new_root(&config(10_000, fleet(&[A, B], json!({}))));
    assert!(ok);
    let before = Vm::calls().len();
    poll_round(&vm, |_| (200, report(0, json!([]))));
    let names: Vec<String> = Vm::calls()
        .into_iter()
        .skip(before)
        .filter_map(|c| c.header(":path").map(str::to_string))
        .filter(|p| p.starts_with("/v1/admission/leases"))
        .map(|p| instance(&p))
        .collect();
    assert!(!names.is_empty());
    assert!(
        names.iter().all(|n| *n == format!("{other:016x}")),
        "{names:?}"
    );
}

#[test]
fn a_backend_refusal_ends_the_reservation_and_marks_the_endpoint_full_until_its_next_poll() {
    let mut vm = start(10_000, fleet(&[A, B], json!({})));
    poll_round(&vm, |_| (200, report(0, json!([]))));
    let (s, _) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(routed_to(s).as_deref(), Some(A));
    // Another gateway took A's last blocks first: A answers 429 itself.
    vm.respond_from(s, 429, A);
    assert_eq!(ledger_at(A).committed(), 0, "released at the refusal");
    assert_eq!(Vm::metric("kvgate.backend_refused"), 1);
    assert_eq!(
        Vm::metric("kvgate.endpoint.10_0_0_1_8000.backend_refused"),
        1
    );
    assert!(
        Vm::response_header(s, "x-kvgate-lease").is_none(),
        "the backend's answer goes out as it is"
    );
    vm.finish(s);
    assert_eq!(Vm::metric("kvgate.release_unknown"), 0, "released once");
    // A is left out until it reports again; then it is chosen again.
    let (s, _) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(routed_to(s).as_deref(), Some(B));
    // B refuses too: every endpoint is full, which is a 429 (not "unavailable").
    vm.respond_from(s, 429, B);
    vm.finish(s);
    let (s, a) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(a, Action::Pause);
    let r = &Vm::replies(s)[0];
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["code"], "kv_capacity_exceeded");
    assert!(r.header("retry-after").is_some());
    vm.finish(s);
    poll_round(&vm, |_| (200, report(0, json!([]))));
    let (s, _) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(routed_to(s).as_deref(), Some(A));
    vm.finish(s);
}

#[test]
fn a_changed_endpoint_list_keeps_the_leases_of_endpoints_that_stay() {
    let mut vm = start(10_000, fleet(&[A, B], json!({})));
    let (on_a, _) = vm.post("/v1/completions", &[], &completion(500, Some(500)));
    let (on_b, _) = vm.post("/v1/completions", &[], &completion(500, Some(500)));
    assert_eq!(routed_to(on_a).as_deref(), Some(A));
    assert_eq!(routed_to(on_b).as_deref(), Some(B));
    let (la, lb) = (lease_of(on_a), lease_of(on_b));
    let c = "10.0.0.3:8000";
    assert!(vm.reconfigure(&config(10_000, fleet(&[A, c], json!({})))));
    assert!(ledger_at(A).lease(la).is_some(), "A stays, with its lease");
    // B left the list: its request still ends normally and releases where it was reserved.
    vm.finish(on_b);
    assert!(ledger_at(B).lease(lb).is_none());
    // New requests go to A or C only.
    let (s, _) = vm.post("/v1/completions", &[], &completion(500, Some(500)));
    assert_eq!(routed_to(s).as_deref(), Some(c));
    vm.finish(s);
    vm.finish(on_a);
    assert_eq!(ledger_at(A).committed(), 0);
    // Polls go to the new list.
    let before = Vm::calls().len();
    vm.advance_ms(300);
    vm.tick();
    let polled: Vec<String> = Vm::calls()
        .into_iter()
        .skip(before)
        .filter_map(|c| c.header("x-kvgate-endpoint").map(str::to_string))
        .collect();
    assert_eq!(polled, [A, c]);
}

#[test]
fn a_dropped_endpoints_ledger_is_still_reaped_until_it_is_empty() {
    let mut extra = fleet(&[A, B], json!({}));
    extra["owner_timeout_ms"] = json!(5_000);
    let vm = start(10_000, extra);
    // A lease on B of a worker that is gone (another Envoy worker that crashed).
    let gone = 0x0dea_d000_0000_0001_u64;
    write_heartbeat(gone, EPOCH_MS - 60_000);
    let (out, _) = store::transact(&EnvoyStore, &format!("{LEDGER_KEY}@{B}"), 1, |l| {
        l.try_admit(
            &kvgate_core::AdmitRequest {
                id: Some(11),
                bytes: 1_000 * PER_TOKEN,
                class: "default",
                priority: 0,
                now_ms: Vm::now_ms(),
                owner: gone,
                claim: None,
            },
            &kvgate_core::RetryAfterConfig::default(),
            0,
        )
    })
    .unwrap();
    assert!(matches!(out, kvgate_core::AdmitOutcome::Admitted { .. }));
    // B leaves the list before the reaper ran: its ledger is still watched, and emptied.
    let mut next = fleet(&[A], json!({}));
    next["owner_timeout_ms"] = json!(5_000);
    assert!(vm.reconfigure(&config(10_000, next)));
    // Its heartbeat does not change for the timeout, by this worker's watching.
    let mut vm = vm;
    tick_for(&mut vm, 6_500, &[]);
    assert!(
        ledger_at(B).lease(11).is_none(),
        "reaped at the dropped endpoint"
    );
    assert_eq!(ledger_at(B).committed(), 0);
    assert_eq!(Vm::metric("kvgate.reaped"), 1);
}

#[test]
fn lease_ids_carry_the_gateway_id() {
    let mut vm = start(10_000, json!({"gateway_id": 5}));
    for _ in 0..20 {
        let (s, _) = vm.post("/v1/completions", &[], &completion(10, Some(10)));
        let id = lease_of(s);
        assert_eq!(id >> 43, 5);
        assert!(id < 1 << 53);
        vm.finish(s);
    }
}

#[test]
fn an_elastic_class_reserves_its_prior_then_what_it_learned_and_tells_the_backend() {
    let policy = json!({"classes": {"default": {"reservation": "elastic",
        "elastic_min_samples": 2, "elastic_prior_tokens": 10, "elastic_quantile": 0.5}}});
    let mut cfg = fleet(&[A], json!({}));
    cfg["policy"] = policy;
    let mut vm = start(10_000, cfg);
    // Admitted at its worst case (200 + 1,000 tokens), with no note in the body it forwards.
    let at_worst_case = |vm: &mut Vm, body: &str, why: &str| {
        let (s, _) = vm.post("/v1/completions", &[], body);
        assert_eq!(note_of(s), Value::Null, "{why}");
        assert_eq!(
            ledger_at(A).lease(lease_of(s)).unwrap().bytes,
            1_200 * PER_TOKEN
        );
        vm.respond_from(s, 200, A);
        s
    };
    // Until the backend has said it reserves what it is told (and lends past it): worst case.
    let s = at_worst_case(
        &mut vm,
        &completion(200, Some(1_000)),
        "not known to read the note yet",
    );
    vm.finish(s);
    // A backend that reserves but does not read the gateway's body note (an older one) would
    // reserve the whole cap: the worst case still.
    let older = json!({"pool": {"capacity_bytes": 10_000 * PER_TOKEN, "used_bytes": 0},
        "admission": "reserve", "leases": [], "finished": [], "cursor": 0});
    poll_round(&vm, |_| (200, older.to_string().into_bytes()));
    // A client's own `kvgate` field is not forwarded either.
    let mut body: Value = serde_json::from_str(&completion(200, Some(1_000))).unwrap();
    body["kvgate"] = json!({"reserve_output": 1, "prompt_tokens": 9});
    let s = at_worst_case(
        &mut vm,
        &body.to_string(),
        "no note for a backend that does not read it",
    );
    assert_eq!(
        Vm::request_header(s, "x-kvgate-note").as_deref(),
        Some("body")
    );
    vm.finish(s);
    let reserving = json!({"pool": {"capacity_bytes": 10_000 * PER_TOKEN, "used_bytes": 0},
        "admission": "reserve", "gateway_note": true, "leases": [], "finished": [], "cursor": 0});
    poll_round(&vm, |_| (200, reserving.to_string().into_bytes()));
    // The prior: 200 prompt + 10 output tokens reserved, the cap of 1,000 kept in the body.
    let (s, a) = vm.post("/v1/completions", &[], &completion(200, Some(1_000)));
    assert_eq!(a, Action::Continue);
    assert_eq!(
        note_of(s),
        json!({"reserve_output": 10, "prompt_tokens": 200})
    );
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    assert_eq!(forwarded["max_tokens"], 1_000);
    assert_eq!(
        ledger_at(A).lease(lease_of(s)).unwrap().bytes,
        210 * PER_TOKEN
    );
    assert_eq!(Vm::metric("kvgate.elastic_admitted"), 1);
    vm.respond_from(s, 200, A);
    vm.finish(s);

    // The backend reports four outputs of the class: two that stopped by themselves (40, 60)
    // and two cut at a cap of 10, which would have run at least that long (and one cut short,
    // which says nothing).
    poll_round(&vm, |_| {
        let doc = json!({"pool": {"capacity_bytes": 10_000 * PER_TOKEN, "used_bytes": 0},
            "admission": "reserve", "gateway_note": true, "leases": [], "cursor": 5, "finished": [
                {"cursor": 1, "id": "1", "reason": "stop", "completion_tokens": 40, "class": "default"},
                {"cursor": 2, "id": "2", "reason": "length", "completion_tokens": 10, "class": "default"},
                {"cursor": 3, "id": "3", "reason": "cancelled", "completion_tokens": 900, "class": "default"},
                {"cursor": 4, "id": "4", "reason": "length", "completion_tokens": 10, "class": "default"},
                {"cursor": 5, "id": "5", "reason": "stop", "completion_tokens": 60, "class": "default"}]});
        (200, doc.to_string().into_bytes())
    });
    let st = vm.open("GET", "/kvgate/status", &[], b"");
    vm.request_headers(st, true);
    let e = Vm::replies(st)[0].json()["elastic"]["default"].clone();
    assert_eq!(
        (e["samples"].clone(), e["learned_tokens"].clone()),
        (json!(4), json!(40))
    );

    // Learned: the median. Counted as stops, the two cut at 10 would make it 10; as censored
    // (Kaplan–Meier) half of the outputs are estimated to run past 10, and it is 40.
    let (s, _) = vm.post("/v1/completions", &[], &completion(200, Some(1_000)));
    assert_eq!(note_of(s)["reserve_output"], 40);
    assert_eq!(
        ledger_at(A).lease(lease_of(s)).unwrap().bytes,
        240 * PER_TOKEN
    );
    // A cap below the allowance reserves the cap: the worst case, not elastic.
    let (s2, _) = vm.post("/v1/completions", &[], &completion(200, Some(20)));
    assert_eq!(
        ledger_at(A).lease(lease_of(s2)).unwrap().bytes,
        220 * PER_TOKEN
    );
    assert_eq!(Vm::metric("kvgate.elastic_admitted"), 2);
    for s in [s, s2] {
        vm.respond_from(s, 200, A);
        vm.finish(s);
    }
    assert_eq!(ledger_at(A).committed(), 0);
}

/// The gateway's private body field (`kvgate`) as forwarded to the backend.
fn note_of(s: Stream) -> Value {
    let forwarded: Value = serde_json::from_slice(&Vm::body(s)).unwrap();
    forwarded["kvgate"].clone()
}

#[test]
fn an_elastic_request_reserves_what_answers_to_prompts_of_its_length_were() {
    let policy = json!({"classes": {"default": {"reservation": "elastic",
        "elastic_min_samples": 3, "elastic_prior_tokens": 10, "elastic_quantile": 0.9,
        "elastic_by_prompt": true}}});
    let mut cfg = fleet(&[A], json!({}));
    cfg["policy"] = policy;
    let mut vm = start(10_000, cfg);
    // Three short answers to prompts of 100 tokens (as the gateway counted them, echoed by the
    // backend; the backend's own count differs) and three that ran to caps of 500 after prompts
    // of 300: the class's 0.9 quantile is the long mode.
    let mut finished = Vec::new();
    for (i, (prompt, tokens, reason)) in [
        (100, 8, "stop"),
        (300, 500, "length"),
        (101, 12, "stop"),
        (300, 500, "length"),
        (99, 5, "stop"),
        (302, 500, "length"),
    ]
    .into_iter()
    .enumerate()
    {
        finished.push(
            json!({"cursor": i + 1, "id": format!("{}", i + 1), "reason": reason,
            "prompt_tokens": prompt + 40, "gateway_prompt_tokens": prompt,
            "completion_tokens": tokens, "class": "default"}),
        );
    }
    let doc = json!({"pool": {"capacity_bytes": 10_000 * PER_TOKEN, "used_bytes": 0},
        "admission": "reserve", "gateway_note": true, "leases": [], "cursor": 6, "finished": finished});
    poll_round(&vm, |_| (200, doc.to_string().into_bytes()));
    let (short, _) = vm.post("/v1/completions", &[], &completion(100, Some(1_000)));
    assert_eq!(
        note_of(short),
        json!({"reserve_output": 12, "prompt_tokens": 100})
    );
    assert_eq!(
        ledger_at(A).lease(lease_of(short)).unwrap().bytes,
        112 * PER_TOKEN
    );
    // Like the long ones: their quantile (censored at 500, the longest kept).
    let (long, _) = vm.post("/v1/completions", &[], &completion(301, Some(1_000)));
    assert_eq!(note_of(long)["reserve_output"], 500);
    // A length nobody asked at: the class's quantile.
    let (other, _) = vm.post("/v1/completions", &[], &completion(200, Some(1_000)));
    assert_eq!(note_of(other)["reserve_output"], 500);
    for s in [short, long, other] {
        vm.respond_from(s, 200, A);
        vm.finish(s);
    }
    assert_eq!(ledger_at(A).committed(), 0);
}

/// Another worker has marked endpoint A down since this worker's last tick: a request reads the
/// recorded health, and the choice of endpoint follows it (A would be the first pick on a tie).
#[test]
fn an_endpoint_another_worker_marked_down_is_not_chosen_before_this_workers_tick() {
    let mut vm = start(10_000, fleet(&[A, B], json!({})));
    let key = format!("kvgate.backend.v3@{A}");
    poll_round(&vm, a_down);
    poll_round(&vm, a_down);
    let down = testhost::with(|h| h.shared.get(&key).cloned()).unwrap().0;
    poll_round(&vm, |_| (200, report(0, json!([]))));
    let (s, _) = vm.post("/v1/completions", &[], &completion(500, Some(500)));
    assert_eq!(
        routed_to(s).as_deref(),
        Some(A),
        "both up: the first listed"
    );
    vm.respond_from(s, 200, A);
    vm.finish(s);

    testhost::with(|h| {
        let cas = h.shared.get(&key).map_or(0, |(_, c)| *c);
        h.shared.insert(key.clone(), (down.clone(), cas + 1));
    });
    let (s, a) = vm.post("/v1/completions", &[], &completion(500, Some(500)));
    assert_eq!(a, Action::Continue);
    assert_eq!(routed_to(s).as_deref(), Some(B), "A is down: B");
    vm.respond_from(s, 200, B);
    vm.finish(s);
    assert_eq!(ledger_at(A).committed() + ledger_at(B).committed(), 0);
}

#[test]
fn drift_totals_every_endpoint_and_another_gateways_leases_are_not_drift() {
    let mut vm = start(10_000, fleet(&[A, B], json!({"drift_warn_bytes": 1})));
    let (s, action) = vm.post("/v1/completions", &[], &completion(100, Some(100)));
    assert_eq!(action, Action::Continue);
    let (mine, other) = match routed_to(s).as_deref() {
        Some(A) => (A, B),
        _ => (B, A),
    };
    let lease = lease_of(s);
    let held = 200 * PER_TOKEN;
    // Another gateway (the next number) holds 3,000 tokens at the other endpoint; this
    // gateway's lease is never reported where it was sent. Answer this gateway's endpoint
    // first, so the other endpoint's poll comes last in every round.
    let peer = (((lease >> 43) + 1) << 43) | 7;
    let peers = 3_000 * PER_TOKEN;
    for _ in 0..5 {
        let before = Vm::calls().len();
        vm.advance_ms(300);
        vm.tick();
        let mut calls: Vec<_> = Vm::calls().into_iter().skip(before).collect();
        calls.retain(|c| {
            c.header(":path")
                .unwrap_or_default()
                .starts_with("/v1/admission/leases")
        });
        calls.sort_by_key(|c| c.header("x-kvgate-endpoint").unwrap_or_default() != mine);
        for call in calls {
            let body = if call.header("x-kvgate-endpoint").unwrap_or_default() == mine {
                report(0, json!([]))
            } else {
                let leases = json!([{"id": peer.to_string(), "reserved_bytes": peers}]);
                report(peers, leases)
            };
            vm.answer_call(call.token, 200, &body);
        }
    }
    // Past the 1 s grace: the lease is unseen at its endpoint, whatever the other one said.
    assert_eq!(Vm::metric("kvgate.unseen_leases"), 1);
    assert_eq!(Vm::metric("kvgate.unseen_bytes"), held as i64);
    // The drift is this gateway's reservation the backend does not hold, and nothing at the
    // other endpoint: the other gateway's reservation is its own ledger's.
    assert_eq!(Vm::metric("kvgate.drift_bytes"), held as i64);
    let st = vm.open("GET", "/kvgate/status", &[], b"");
    vm.request_headers(st, true);
    let doc = Vm::replies(st)[0].json();
    let entry = |a: &str| {
        doc["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["address"] == a)
            .unwrap()
            .clone()
    };
    assert_eq!(entry(mine)["unseen_leases"], 1);
    assert_eq!(entry(mine)["drift_bytes"], held);
    assert_eq!(entry(other)["drift_bytes"], 0);
    assert_eq!(entry(other)["level"], "green", "{doc}");
    vm.finish(s);
    assert_eq!(ledger_at(A).committed() + ledger_at(B).committed(), 0);
}

/// A queued request behind a front that fits nowhere goes to an endpoint that has room for it
/// and nobody in line there, as a newcomer would, rather than wait out its `max_wait_ms`.
#[test]
fn a_queued_request_behind_a_waiting_front_goes_to_another_endpoint_with_room() {
    let mut config = fleet(&[A, B], json!({}));
    config["fair_retry_patience_ms"] = 0.into();
    config["max_body_bytes"] = 4_000.into();
    config["policy"] = json!({"default_class": "q", "classes": {"q": {
        "action": "queue", "max_wait_ms": 60_000, "max_depth": 8}}});
    let mut vm = start(10_000, config);
    let admit = |vm: &mut Vm, cap: u64, at: &str| {
        let (s, a) = vm.post("/v1/completions", &[], &completion(100, Some(cap)));
        assert_eq!((a, routed_to(s).as_deref()), (Action::Continue, Some(at)));
        s
    };
    let on_a = admit(&mut vm, 8_900, A); // A: 1,000 free
    let on_b = admit(&mut vm, 4_400, B);
    let on_b2 = admit(&mut vm, 4_900, B); // B: 500 free
                                          // The front needs 6,000 and the one behind it 1,200: neither fits.
    let (front, a) = vm.post("/v1/completions", &[], &completion(100, Some(5_900)));
    assert_eq!(a, Action::Pause, "queued");
    let (behind, a) = vm.post("/v1/completions", &[], &completion(100, Some(1_100)));
    assert_eq!(a, Action::Pause, "queued");
    // And one whose body grows past the limit when written again (`1e15` is written out).
    let pad = vec!["1e15"; 600].join(",");
    let grows =
        format!(r#"{{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1100, "pad": [{pad}]}}"#);
    let (grown, a) = vm.post("/v1/completions", &[], &grows);
    assert_eq!(a, Action::Pause, "queued");
    // B frees 4,500: room for the two behind, not for the front.
    vm.respond_from(on_b, 200, B);
    vm.finish(on_b);
    vm.advance_ms(100);
    vm.tick();
    assert_eq!(routed_to(behind).as_deref(), Some(B), "went where it fits");
    assert!(ledger_at(B).lease(lease_of(behind)).is_some());
    assert_eq!(
        Vm::metric("kvgate.passed_in_queue"),
        1,
        "counted; the grown body is not"
    );
    // Refused after its admission, for good: answered at once, not tried again every tick.
    let replies = Vm::replies(grown);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].status, 413);
    assert_eq!(replies[0].json()["error"]["code"], "request_body_too_large");
    assert_eq!(Vm::metric("kvgate.queued"), 1, "the front still waits");
    assert_eq!(
        ledger_at(B).leases().len(),
        2,
        "the refused one keeps nothing"
    );
    vm.finish(grown);
    assert!(routed_to(front).is_none());
    // A frees its 9,000: the front goes there.
    vm.respond_from(on_a, 200, A);
    vm.finish(on_a);
    vm.advance_ms(100);
    vm.tick();
    assert_eq!(routed_to(front).as_deref(), Some(A));
    assert_eq!(Vm::metric("kvgate.queued"), 0);
    assert_eq!(Vm::metric("kvgate.passed_in_queue"), 1, "the front is not");
    for (s, at) in [(on_b2, B), (front, A), (behind, B)] {
        vm.respond_from(s, 200, at);
        vm.finish(s);
    }
    assert_eq!(ledger_at(A).committed() + ledger_at(B).committed(), 0);
}

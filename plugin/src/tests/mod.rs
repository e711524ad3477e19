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

use kvgate_core::store;
use kvgate_core::{AdmitOutcome, AdmitRequest, Ledger, RetryAfterConfig};
use serde_json::{json, Value};

use crate::host::EnvoyStore;
use crate::testhost::{self, Stream, Vm};
use crate::LEDGER_KEY;

mod admission;
mod fleet;
mod tick;

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
        "status_path": "/kvgate/status",
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
                now_ms: now,
                owner,
                claim: None,
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

/// Tick every 100 ms for `ms`, the owners in `beating` writing their heartbeats before each.
fn tick_for(vm: &mut Vm, ms: u64, beating: &[u64]) {
    for _ in 0..ms.div_ceil(100) {
        vm.advance_ms(100);
        for &o in beating {
            write_heartbeat(o, Vm::now_ms());
        }
        vm.tick();
    }
}

fn calls_to(path_part: &str) -> Vec<testhost::Call> {
    Vm::calls()
        .into_iter()
        .filter(|c| c.header(":path").is_some_and(|p| p.contains(path_part)))
        .collect()
}

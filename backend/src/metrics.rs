//! Prometheus metrics of the backend, rendered by hand in the text exposition format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::pool::PoolStats;

#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub rejected_kv: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub queue_us: AtomicU64,
    pub prefill_us: AtomicU64,
    pub decode_us: AtomicU64,
    pub decode_steps: AtomicU64,
    pub kv_oom: AtomicU64,
    pub preempted: AtomicU64,
    pub cancelled: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
}

impl Metrics {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    pub fn render(&self, pool: &PoolStats) -> String {
        let mut s = String::new();
        let mut line = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let g = |c: &AtomicU64| c.load(Relaxed) as f64;
        line(
            "kvgate_backend_requests_total",
            "counter",
            "Requests accepted by the engine.",
            g(&self.requests),
        );
        line(
            "kvgate_backend_rejected_kv_total",
            "counter",
            "Requests refused for lack of KV blocks (429).",
            g(&self.rejected_kv),
        );
        line(
            "kvgate_backend_prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled.",
            g(&self.prompt_tokens),
        );
        line(
            "kvgate_backend_generated_tokens_total",
            "counter",
            "Tokens generated.",
            g(&self.generated_tokens),
        );
        line(
            "kvgate_backend_queue_seconds_total",
            "counter",
            "Time requests waited before prefill.",
            g(&self.queue_us) / 1e6,
        );
        line(
            "kvgate_backend_prefill_seconds_total",
            "counter",
            "Time spent in prefill forwards.",
            g(&self.prefill_us) / 1e6,
        );
        line(
            "kvgate_backend_decode_seconds_total",
            "counter",
            "Time spent in batched decode forwards.",
            g(&self.decode_us) / 1e6,
        );
        line(
            "kvgate_backend_decode_steps_total",
            "counter",
            "Batched decode steps.",
            g(&self.decode_steps),
        );
        line(
            "kvgate_backend_kv_oom_total",
            "counter",
            "Sequences that failed mid-decode for lack of KV blocks.",
            g(&self.kv_oom),
        );
        line(
            "kvgate_backend_preempted_total",
            "counter",
            "Sequences cancelled through the admission API.",
            g(&self.preempted),
        );
        line(
            "kvgate_backend_cancelled_total",
            "counter",
            "Sequences freed because the client went away.",
            g(&self.cancelled),
        );
        line(
            "kvgate_backend_running",
            "gauge",
            "Sequences decoding.",
            g(&self.running),
        );
        line(
            "kvgate_backend_waiting",
            "gauge",
            "Sequences waiting for prefill.",
            g(&self.waiting),
        );
        line(
            "kvgate_backend_kv_capacity_bytes",
            "gauge",
            "KV pool capacity.",
            pool.capacity_bytes as f64,
        );
        line(
            "kvgate_backend_kv_used_bytes",
            "gauge",
            "KV bytes held by sequences.",
            pool.used_bytes as f64,
        );
        line(
            "kvgate_backend_kv_free_bytes",
            "gauge",
            "KV bytes free.",
            pool.free_bytes as f64,
        );
        s
    }
}

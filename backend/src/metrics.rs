//! Prometheus metrics of the backend (the `prometheus-client` crate, OpenMetrics text on
//! `/metrics`; no exporter of its own).
//!
//! Counters are registered without their `_total` suffix: the encoder appends it, so the names
//! scraped are `kvgate_backend_requests_total` and so on. Besides the counters and gauges, three
//! histograms give the latencies users of TGI and vLLM look for: time to first token, inter-token
//! latency, and queue wait (arrival at the engine to the start of prefill). The engine records;
//! nothing here schedules.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::pool::PoolStats;

/// The `content-type` of `render`'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Seconds = Counter<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    pub requests: Counter,
    pub rejected_kv: Counter,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub queue_seconds: Seconds,
    pub prefill_seconds: Seconds,
    pub decode_seconds: Seconds,
    pub decode_steps: Counter,
    pub kv_oom: Counter,
    /// Sequences preempted to be recomputed (`--on-kv-exhaustion recompute`).
    pub recompute_preemptions: Counter,
    /// Tokens prefilled again for preempted sequences (prompt + generated so far).
    pub recomputed_tokens: Counter,
    /// Tokens not prefilled (at a first start or a restart): their KV blocks were cached (a
    /// shared prefix).
    pub prefix_cached_tokens: Counter,
    pub preempted: Counter,
    pub demoted: Counter,
    pub cancelled: Counter,
    pub running: Gauge,
    pub waiting: Gauge,
    kv_capacity_bytes: Gauge,
    kv_used_bytes: Gauge,
    kv_free_bytes: Gauge,
    /// KV bytes of the tokens sequences have written so far (prompt + output): what the cache
    /// really holds, where `kv_used_bytes` counts whole blocks taken (under `--admission reserve
    /// --lazy-blocks false`, the whole reservation from arrival).
    pub kv_written_bytes: Gauge,
    /// Arrival at the engine to the first sampled token (queue wait + prefill).
    pub time_to_first_token: Histogram,
    /// Between two consecutive tokens of one sequence (one batched decode step, as it saw it).
    pub inter_token_latency: Histogram,
    /// Arrival at the engine to the start of its prefill.
    pub queue_wait: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        // 1 ms .. ~33 s for the waits, 1 ms .. ~8 s between tokens.
        let waits = || Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let mut m = Metrics {
            registry: Registry::default(),
            requests: Counter::default(),
            rejected_kv: Counter::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            queue_seconds: Seconds::default(),
            prefill_seconds: Seconds::default(),
            decode_seconds: Seconds::default(),
            decode_steps: Counter::default(),
            kv_oom: Counter::default(),
            recompute_preemptions: Counter::default(),
            recomputed_tokens: Counter::default(),
            prefix_cached_tokens: Counter::default(),
            preempted: Counter::default(),
            demoted: Counter::default(),
            cancelled: Counter::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_capacity_bytes: Gauge::default(),
            kv_used_bytes: Gauge::default(),
            kv_free_bytes: Gauge::default(),
            kv_written_bytes: Gauge::default(),
            time_to_first_token: waits(),
            inter_token_latency: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            queue_wait: waits(),
        };
        let r = &mut m.registry;
        let counters = [
            ("requests", "Requests accepted by the engine", &m.requests),
            (
                "rejected_kv",
                "Requests refused for lack of KV blocks (429)",
                &m.rejected_kv,
            ),
            ("prompt_tokens", "Prompt tokens prefilled", &m.prompt_tokens),
            ("generated_tokens", "Tokens generated", &m.generated_tokens),
            ("decode_steps", "Batched decode steps", &m.decode_steps),
            (
                "kv_oom",
                "Sequences that failed mid-decode for lack of KV blocks",
                &m.kv_oom,
            ),
            (
                "recompute_preemptions",
                "Sequences preempted when the pool ran dry, to be recomputed from prompt + output",
                &m.recompute_preemptions,
            ),
            (
                "recomputed_tokens",
                "Tokens prefilled again for preempted sequences (prompt + generated so far)",
                &m.recomputed_tokens,
            ),
            (
                "prefix_cached_tokens",
                "Prompt tokens not prefilled (first start or restart) because their KV blocks were cached",
                &m.prefix_cached_tokens,
            ),
            (
                "preempted",
                "Sequences cancelled through the admission API",
                &m.preempted,
            ),
            (
                "demoted",
                "Leases demoted through the admission API: they reserve nothing and go on in borrowed blocks",
                &m.demoted,
            ),
            (
                "cancelled",
                "Sequences freed because the client went away",
                &m.cancelled,
            ),
        ];
        for (name, help, c) in counters {
            r.register(format!("kvgate_backend_{name}"), help, c.clone());
        }
        let seconds = [
            (
                "queue_seconds",
                "Time requests waited before prefill",
                &m.queue_seconds,
            ),
            (
                "prefill_seconds",
                "Time spent in prefill forwards",
                &m.prefill_seconds,
            ),
            (
                "decode_seconds",
                "Time spent in batched decode forwards",
                &m.decode_seconds,
            ),
        ];
        for (name, help, c) in seconds {
            r.register(format!("kvgate_backend_{name}"), help, c.clone());
        }
        let gauges = [
            ("running", "Sequences decoding", &m.running),
            ("waiting", "Sequences waiting for prefill", &m.waiting),
            (
                "kv_capacity_bytes",
                "KV pool capacity",
                &m.kv_capacity_bytes,
            ),
            (
                "kv_used_bytes",
                "KV bytes held by sequences",
                &m.kv_used_bytes,
            ),
            ("kv_free_bytes", "KV bytes free", &m.kv_free_bytes),
            (
                "kv_written_bytes",
                "KV bytes of the tokens written so far (prompt + output)",
                &m.kv_written_bytes,
            ),
        ];
        for (name, help, g) in gauges {
            r.register(format!("kvgate_backend_{name}"), help, g.clone());
        }
        let histograms = [
            (
                "time_to_first_token_seconds",
                "Arrival at the engine to the first sampled token",
                &m.time_to_first_token,
            ),
            (
                "inter_token_latency_seconds",
                "Time between two consecutive tokens of a sequence",
                &m.inter_token_latency,
            ),
            (
                "queue_wait_seconds",
                "Arrival at the engine to the start of prefill",
                &m.queue_wait,
            ),
        ];
        for (name, help, h) in histograms {
            r.register(format!("kvgate_backend_{name}"), help, h.clone());
        }
        m
    }

    /// The OpenMetrics text, with the pool's gauges read now.
    pub fn render(&self, pool: &PoolStats) -> String {
        let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
        self.kv_capacity_bytes.set(bytes(pool.capacity_bytes));
        self.kv_used_bytes.set(bytes(pool.used_bytes));
        self.kv_free_bytes.set(bytes(pool.free_bytes));
        let mut s = String::new();
        if let Err(e) = encode(&mut s, &self.registry) {
            eprintln!("kvgate-backend: encoding metrics failed: {e}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_ones_scrapers_read() {
        let m = Metrics::new();
        m.requests.inc();
        m.prefill_seconds.inc_by(0.25);
        m.time_to_first_token.observe(0.003);
        m.running.set(2);
        let pool = PoolStats {
            blocks_total: 4,
            blocks_free: 3,
            block_tokens: 16,
            block_bytes: 16,
            capacity_bytes: 64,
            used_bytes: 16,
            free_bytes: 48,
            promised_bytes: 0,
        };
        let text = m.render(&pool);
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|v| v.parse::<f64>().ok())
        };
        assert_eq!(value("kvgate_backend_requests_total"), Some(1.0));
        assert_eq!(value("kvgate_backend_kv_oom_total"), Some(0.0));
        assert_eq!(
            value("kvgate_backend_recompute_preemptions_total"),
            Some(0.0)
        );
        assert_eq!(value("kvgate_backend_recomputed_tokens_total"), Some(0.0));
        assert_eq!(value("kvgate_backend_prefill_seconds_total"), Some(0.25));
        assert_eq!(value("kvgate_backend_running"), Some(2.0));
        assert_eq!(value("kvgate_backend_kv_capacity_bytes"), Some(64.0));
        assert_eq!(value("kvgate_backend_kv_written_bytes"), Some(0.0));
        assert_eq!(
            value("kvgate_backend_time_to_first_token_seconds_count"),
            Some(1.0)
        );
        assert_eq!(
            value("kvgate_backend_time_to_first_token_seconds_bucket{le=\"0.004\"}"),
            Some(1.0)
        );
        assert_eq!(value("kvgate_backend_queue_wait_seconds_count"), Some(0.0));
        assert!(text.contains("# TYPE kvgate_backend_inter_token_latency_seconds histogram"));
    }
}

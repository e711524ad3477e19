//! A vLLM server as the filter's backend: what its Prometheus metrics (`GET /metrics`) say.
//!
//! vLLM has no lease API: it does not know the gateway's reservations, so it reports no leases
//! and never releases one early (a lease ends with its request, as without a callout). What it
//! publishes is enough for the rest of reconciliation: its KV pool (`vllm:cache_config_info`:
//! blocks and block size), the share of it in use (`vllm:kv_cache_usage_perc`), its running and
//! waiting requests, and the preemptions it had to make (`vllm:num_preemptions_total`: with
//! every admission priced at its worst case, one that moves is an alarm). Use beyond the
//! ledger's reservations (requests that bypassed the gateway) is held back as with kvgate's
//! backend.

use crate::reconcile::{BackendReport, Output};

/// The metrics of one vLLM server (summed over its engines when it runs several).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Metrics {
    /// KV blocks of its pool, and tokens a block holds.
    pub blocks: u64,
    pub block_size: u64,
    /// Blocks in use (the usage share times the pool; cached blocks no request holds are free).
    pub used_blocks: u64,
    pub running: u64,
    pub waiting: u64,
    /// Preemptions since it started.
    pub preemptions: u64,
    /// The served model (`model_name` label), when it says.
    pub model: Option<String>,
    /// The output lengths of the requests it finished (`vllm:request_generation_tokens`, a
    /// histogram): (bucket bound in tokens, requests at most that long so far), by bound; the
    /// last bound is `u64::MAX` (`+Inf`).
    pub generated: Vec<(u64, u64)>,
}

/// Longest metrics document read: a real one is tens of kilobytes.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// Most buckets of the output-length histogram read (vLLM's 1-2-5 series has a dozen or so).
pub const MAX_BUCKETS: usize = 64;

impl Metrics {
    /// Parse the text exposition format. Errors when the pool is not described (no
    /// `vllm:cache_config_info` with `num_gpu_blocks` and `block_size`): the body is not a
    /// vLLM's metrics, or the pool is not sized yet.
    pub fn parse(body: &[u8]) -> Result<Metrics, String> {
        if body.len() > MAX_BODY_BYTES {
            return Err(format!(
                "metrics of {} B are over {MAX_BODY_BYTES} B",
                body.len()
            ));
        }
        let text = std::str::from_utf8(body).map_err(|_| "metrics are not UTF-8".to_string())?;
        let mut m = Metrics::default();
        // Engines (data-parallel ranks) each report their own pool and usage. The older name of
        // the usage gauge counts only where the newer is absent (a server may expose both).
        let (mut engines, mut usage, mut old_usage) = (0u64, None::<f64>, 0f64);
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((name, labels, value)) = sample(line) else {
                continue;
            };
            let count = || {
                // Counters and gauges are floats; a negative or absurd one reads as 0.
                if value.is_finite() && value > 0.0 {
                    value.min(u64::MAX as f64) as u64
                } else {
                    0
                }
            };
            match name {
                "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                    let share = if value.is_finite() {
                        value.clamp(0.0, 1.0)
                    } else {
                        1.0
                    };
                    if name == "vllm:kv_cache_usage_perc" {
                        usage = Some(usage.unwrap_or(0.0) + share);
                    } else {
                        old_usage += share;
                    }
                }
                "vllm:num_requests_running" => m.running = m.running.saturating_add(count()),
                "vllm:num_requests_waiting" => m.waiting = m.waiting.saturating_add(count()),
                "vllm:num_preemptions_total" | "vllm:num_preemptions" => {
                    m.preemptions = m.preemptions.saturating_add(count());
                }
                "vllm:request_generation_tokens_bucket" => {
                    let bound = match label(labels, "le") {
                        Some("+Inf") => u64::MAX,
                        Some(le) => match le.parse::<f64>() {
                            Ok(v) if (0.0..1e15).contains(&v) => v as u64,
                            _ => continue,
                        },
                        None => continue,
                    };
                    match m.generated.binary_search_by_key(&bound, |b| b.0) {
                        Ok(i) => {
                            if let Some(b) = m.generated.get_mut(i) {
                                b.1 = b.1.saturating_add(count());
                            }
                        }
                        // A real one has a dozen or two; more is not a vLLM's (and would make
                        // this insertion quadratic).
                        Err(_) if m.generated.len() >= MAX_BUCKETS => {
                            return Err(format!(
                                "more than {MAX_BUCKETS} buckets of vllm:request_generation_tokens"
                            ));
                        }
                        Err(i) => m.generated.insert(i, (bound, count())),
                    }
                }
                "vllm:cache_config_info" => {
                    let n = |k: &str| label(labels, k).and_then(|v| v.parse::<u64>().ok());
                    if let (Some(blocks), Some(size)) = (n("num_gpu_blocks"), n("block_size")) {
                        engines += 1;
                        m.blocks = m.blocks.saturating_add(blocks);
                        m.block_size = size;
                    }
                }
                _ => continue,
            }
            if m.model.is_none() {
                m.model = label(labels, "model_name").map(str::to_string);
            }
        }
        if engines == 0 || m.blocks == 0 || m.block_size == 0 {
            return Err("no vllm:cache_config_info with num_gpu_blocks and block_size".into());
        }
        // The mean share over engines of equal pools, of the whole pool.
        let usage = usage.unwrap_or(old_usage);
        let share = (usage / engines as f64).clamp(0.0, 1.0);
        m.used_blocks = ((m.blocks as f64) * share).ceil() as u64;
        Ok(m)
    }

    /// What happened since the previous poll `before` of the same server: the preemptions it
    /// made and the outputs it finished (at most `most`, [`Metrics::outputs_since`]). The first
    /// poll (`None`) is the baseline: what the server did before this gateway polled it is not
    /// counted. A server restarted since: all of its counts are new.
    pub fn since(&self, before: Option<&Metrics>, most: usize) -> (u64, Vec<Output>) {
        match before {
            None => (0, Vec::new()),
            Some(was) if self.restarted_since(was) => {
                (self.preemptions, self.outputs_since(None, most))
            }
            Some(was) => (
                self.preemptions.saturating_sub(was.preemptions),
                self.outputs_since(Some(was), most),
            ),
        }
    }

    /// Did the server start again since `before` (a counter fell)?
    pub fn restarted_since(&self, before: &Metrics) -> bool {
        let finished = |m: &Metrics| m.generated.last().map_or(0, |b| b.1);
        self.preemptions < before.preemptions || finished(self) < finished(before)
    }

    /// The output lengths of the requests finished since `before` (an earlier poll of the same
    /// server that has not restarted since; `None`: since it started), as [`Output`]s: each at
    /// its bucket's upper bound (the histogram says no more), one past the last finite bound as
    /// at least that long (censored). At most `most`, drawn from every bucket in proportion, so
    /// that a busy interval does not keep only the shortest.
    pub fn outputs_since(&self, before: Option<&Metrics>, most: usize) -> Vec<Output> {
        let cumulative = |m: &Metrics, bound: u64| {
            m.generated
                .binary_search_by_key(&bound, |b| b.0)
                .ok()
                .and_then(|i| m.generated.get(i))
                .map_or(0, |b| b.1)
        };
        // New outputs per bucket: (tokens, censored, how many).
        let mut new = Vec::with_capacity(self.generated.len());
        let (mut below_now, mut below_then, mut last_finite) = (0u64, 0u64, 0u64);
        for &(bound, now) in &self.generated {
            let then = before.map_or(0, |b| cumulative(b, bound));
            let n = now
                .saturating_sub(below_now)
                .saturating_sub(then.saturating_sub(below_then));
            (below_now, below_then) = (now, then);
            let (tokens, at_cap) = if bound == u64::MAX {
                (last_finite, true)
            } else {
                last_finite = bound;
                (bound, false)
            };
            new.push((tokens, at_cap, n));
        }
        let total = new.iter().fold(0u64, |t, b| t.saturating_add(b.2));
        let most = most as u64;
        let mut out = Vec::new();
        for (tokens, at_cap, n) in new {
            // Each bucket's share of `most`, rounded up so that no bucket that had outputs is
            // left out (at most one more per bucket than `most` in all).
            let n = if total > most {
                (u128::from(n) * u128::from(most)).div_ceil(u128::from(total)) as u64
            } else {
                n
            };
            out.extend(std::iter::repeat_n(
                Output {
                    tokens,
                    at_cap,
                    prompt_tokens: 0,
                },
                usize::try_from(n).unwrap_or(0),
            ));
        }
        out
    }

    /// The report reconciliation reads, for KV of `bytes_per_token`: the pool and its use, no
    /// leases (`pool_only`), and a block's bytes as the margin each request needs
    /// (vLLM allocates whole blocks).
    pub fn report(&self, bytes_per_token: u64) -> BackendReport {
        let block = self.block_size.saturating_mul(bytes_per_token);
        BackendReport {
            capacity_bytes: self.blocks.saturating_mul(block),
            used_bytes: self.used_blocks.saturating_mul(block),
            model: self.model.clone(),
            scratch_margin_bytes: Some(block),
            admission: "none".into(),
            pool_only: true,
            ..BackendReport::default()
        }
    }
}

/// `name{labels} value [timestamp]` → (name, labels, value).
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, rest) = match line.find(['{', ' ']) {
        Some(i) => line.split_at(i),
        None => return None,
    };
    let (labels, rest) = match rest.strip_prefix('{') {
        // Label values may hold `}` only inside quotes; vLLM's never do, and a line that
        // breaks this reads as no sample.
        Some(r) => r.split_once('}')?,
        None => ("", rest),
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, labels, value))
}

/// The value of label `key` in `a="x",b="y"` (escapes are not undone: vLLM's numbers and model
/// names hold none).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let (k, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let end = after.find('"')?;
        if k.trim() == key {
            return after.get(..end);
        }
        rest = after.get(end + 1..)?.trim_start_matches(',').trim_start();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as vLLM 0.32 (CPU) writes them, trimmed.
    const BODY: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.2
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 7.0
vllm:num_preemptions_created{engine="0",model_name="smollm2"} 1.796663318104149e+09
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_cpu_blocks="None",num_gpu_blocks="45",num_gpu_blocks_override="45"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="smollm2"} 12.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="smollm2"} 12.0
vllm:request_generation_tokens_bucket{engine="0",le="1.0",model_name="smollm2"} 0.0
vllm:request_generation_tokens_bucket{engine="0",le="10.0",model_name="smollm2"} 2.0
vllm:request_generation_tokens_bucket{engine="0",le="100.0",model_name="smollm2"} 9.0
vllm:request_generation_tokens_bucket{engine="0",le="1000.0",model_name="smollm2"} 11.0
vllm:request_generation_tokens_bucket{engine="0",le="+Inf",model_name="smollm2"} 12.0
vllm:request_generation_tokens_count{engine="0",model_name="smollm2"} 12.0
"#;

    #[test]
    fn reads_the_pool_its_use_the_queue_and_preemptions() {
        let m = Metrics::parse(BODY.as_bytes()).unwrap();
        assert_eq!((m.blocks, m.block_size), (45, 128));
        assert_eq!(m.used_blocks, 9, "20 % of 45 blocks");
        assert_eq!((m.running, m.waiting, m.preemptions), (3, 2, 7));
        assert_eq!(m.model.as_deref(), Some("smollm2"));
        let r = m.report(10);
        assert_eq!(r.capacity_bytes, 45 * 128 * 10);
        assert_eq!(r.used_bytes, 9 * 128 * 10);
        assert_eq!(r.scratch_margin_bytes, Some(1280), "one block a request");
        assert!(r.pool_only && r.entries.is_empty());
    }

    #[test]
    fn output_lengths_are_learned_from_the_histogram_at_their_buckets_upper_bounds() {
        let m = Metrics::parse(BODY.as_bytes()).unwrap();
        let lengths = |outs: Vec<Output>| -> Vec<(u64, bool)> {
            outs.iter().map(|o| (o.tokens, o.at_cap)).collect()
        };
        let all = lengths(m.outputs_since(None, 100));
        assert_eq!(all.len(), 12);
        assert_eq!(&all[..2], &[(10, false), (10, false)]);
        assert_eq!(all.iter().filter(|o| **o == (100, false)).count(), 7);
        assert_eq!(all.iter().filter(|o| **o == (1000, false)).count(), 2);
        assert_eq!(
            all.last(),
            Some(&(1000, true)),
            "past the last bound: at least that long"
        );
        // Bounded, every bucket in proportion: of 12, 2 at 10, 7 at 100, 2 at 1,000, 1 past.
        let few = lengths(m.outputs_since(None, 6));
        assert_eq!(
            few,
            vec![
                (10, false),
                (100, false),
                (100, false),
                (100, false),
                (100, false),
                (1000, false),
                (1000, true)
            ]
        );
        // Since an earlier poll: only what finished in between.
        let later = BODY
            .replace(
                "le=\"100.0\",model_name=\"smollm2\"} 9.0",
                "le=\"100.0\",model_name=\"smollm2\"} 10.0",
            )
            .replace(
                "le=\"1000.0\",model_name=\"smollm2\"} 11.0",
                "le=\"1000.0\",model_name=\"smollm2\"} 12.0",
            )
            .replace(
                "le=\"+Inf\",model_name=\"smollm2\"} 12.0\nvllm:request_generation_tokens_count",
                "le=\"+Inf\",model_name=\"smollm2\"} 13.0\nvllm:request_generation_tokens_count",
            );
        let now = Metrics::parse(later.as_bytes()).unwrap();
        assert_eq!(
            lengths(now.outputs_since(Some(&m), 100)),
            vec![(100, false)]
        );
        // A restarted server: its counts fell, and all it has are new.
        assert!(m.restarted_since(&now));
        assert!(!now.restarted_since(&m));
        assert_eq!(m.since(Some(&now), 100), (7, m.outputs_since(None, 100)));
        assert_eq!(
            now.since(Some(&m), 100),
            (0, now.outputs_since(Some(&m), 100))
        );
        assert_eq!(
            m.since(None, 100),
            (0, Vec::new()),
            "the first poll is the baseline"
        );
    }

    #[test]
    fn two_engines_add_their_pools() {
        let body = BODY.to_string()
            + "vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"smollm2\"} 0.6\n"
            + "vllm:cache_config_info{block_size=\"128\",engine=\"1\",num_gpu_blocks=\"45\"} 1.0\n"
            + "vllm:num_requests_running{engine=\"1\",model_name=\"smollm2\"} 1\n";
        let m = Metrics::parse(body.as_bytes()).unwrap();
        assert_eq!(m.blocks, 90);
        assert_eq!(m.used_blocks, 36, "a mean share of 40 % of 90 blocks");
        assert_eq!(m.running, 4);
    }

    #[test]
    fn what_is_not_a_vllms_metrics_is_refused_and_odd_values_are_bounded() {
        for bad in ["", "{}", "vllm:kv_cache_usage_perc 0.5\n", "\u{0}\u{1}"] {
            assert!(Metrics::parse(bad.as_bytes()).is_err(), "{bad:?}");
        }
        assert!(Metrics::parse(&[0xff, 0xfe]).is_err());
        assert!(Metrics::parse(&vec![b'#'; MAX_BODY_BYTES + 1]).is_err());
        let odd = "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"10\"} 1\n\
                   vllm:kv_cache_usage_perc NaN\n\
                   vllm:num_requests_running -3\n\
                   vllm:num_preemptions_total 1e300\n\
                   vllm:num_requests_waiting{broken 4\n\
                   garbage line\n";
        let m = Metrics::parse(odd.as_bytes()).unwrap();
        assert_eq!(m.used_blocks, 10, "an unreadable use is a full pool");
        assert_eq!(m.running, 0);
        assert_eq!(m.preemptions, u64::MAX);
        assert_eq!(m.waiting, 0);
    }

    #[test]
    fn a_hostile_histogram_is_refused_and_the_older_usage_name_does_not_add_up() {
        let mut body = BODY.to_string();
        for i in 0..=MAX_BUCKETS {
            body += &format!(
                "vllm:request_generation_tokens_bucket{{le=\"{}\"}} 1\n",
                5000 - i
            );
        }
        assert!(Metrics::parse(body.as_bytes())
            .unwrap_err()
            .contains("buckets"));
        let huge = BODY.to_string() + "vllm:request_generation_tokens_bucket{le=\"1e30\"} 5\n";
        let m = Metrics::parse(huge.as_bytes()).unwrap();
        assert!(m
            .generated
            .iter()
            .all(|b| b.0 == u64::MAX || b.0 < 1_000_000_000_000_000));
        let both = BODY.to_string() + "vllm:gpu_cache_usage_perc{engine=\"0\"} 0.2\n";
        assert_eq!(
            Metrics::parse(both.as_bytes()).unwrap().used_blocks,
            9,
            "not 18"
        );
        let old = BODY.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc");
        assert_eq!(Metrics::parse(old.as_bytes()).unwrap().used_blocks, 9);
    }

    #[test]
    fn labels_are_read_by_name() {
        assert_eq!(label(r#"a="1",b="x y""#, "b"), Some("x y"));
        assert_eq!(label(r#"a="1", b="2""#, "b"), Some("2"));
        assert_eq!(label(r#"a="1""#, "c"), None);
        assert_eq!(label(r#"a=1"#, "a"), None);
        assert_eq!(label("", "a"), None);
    }
}

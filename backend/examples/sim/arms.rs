//! The presets (the CPU bench's backend, a GPU card) and the arms compared.

use super::*;

#[derive(Debug, Clone)]
pub(super) struct Preset {
    pub(super) name: &'static str,
    /// layers, kv heads, head dim, KV dtype bytes
    pub(super) spec: (u64, u64, u64, u64),
    pub(super) model_context: u64,
    pub(super) blocks: u64,
    pub(super) step_a_ms: f64,
    pub(super) step_b_ms: f64,
    pub(super) prefill_ms: f64,
    pub(super) max_batch: usize,
    pub(super) prefill_budget: u64,
}

impl Preset {
    /// The KV shape as the backend's report gives it.
    pub(super) fn model_spec(&self) -> ModelSpec {
        let (layers, kv_heads, head_dim, kv_dtype_bytes) = self.spec;
        ModelSpec {
            layers,
            kv_heads,
            head_dim,
            kv_dtype_bytes,
            context_tokens: self.model_context,
        }
    }
    pub(super) fn bytes_per_token(&self) -> u64 {
        let (l, h, d, b) = self.spec;
        2 * l * h * d * b
    }
    pub(super) fn block_bytes(&self) -> u64 {
        self.bytes_per_token() * BLOCK_TOKENS
    }
    /// The backend serves no more context than its pool holds.
    pub(super) fn context(&self) -> u64 {
        self.model_context.min(self.blocks * BLOCK_TOKENS)
    }
}

pub(super) fn preset(name: &str) -> Res<Preset> {
    match name {
        "cpu" => Ok(Preset {
            name: "cpu",
            spec: (30, 3, 64, 4),
            model_context: 8192,
            blocks: 40,
            step_a_ms: 30.0,
            step_b_ms: 5.0,
            prefill_ms: 2.3,
            max_batch: 16,
            prefill_budget: 2048,
        }),
        "gpu" => Ok(Preset {
            name: "gpu",
            spec: (32, 8, 128, 2),
            model_context: 8192,
            blocks: 32_768,
            step_a_ms: 25.0,
            step_b_ms: 0.05,
            prefill_ms: 0.1,
            max_batch: 256,
            prefill_budget: 8192,
        }),
        other => Err(format!("--preset {other:?}: must be cpu or gpu")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Arm {
    None,
    /// Admission on prompt length alone (backend `--admission prompt`).
    Prompt,
    /// A concurrency cap: `--admission none --max-batch N`.
    Cap(usize),
    Reserve,
    Kvgate,
    Elastic,
    /// As elastic, every class waiting in the gateway's queue (`action: queue`).
    Queued,
    Oracle,
    Vllm,
}

impl Arm {
    pub(super) fn parse(s: &str) -> Res<Arm> {
        Ok(match s {
            "none" => Arm::None,
            "prompt" => Arm::Prompt,
            // N is sized from the workload in `main` (or `--cap`).
            "cap" => Arm::Cap(0),
            "reserve" => Arm::Reserve,
            "kvgate" => Arm::Kvgate,
            "elastic" => Arm::Elastic,
            "queued" => Arm::Queued,
            "oracle" => Arm::Oracle,
            "vllm" => Arm::Vllm,
            other => return Err(format!("--arms: unknown arm {other:?}")),
        })
    }
    pub(super) fn name(self) -> &'static str {
        match self {
            Arm::None => "none",
            Arm::Prompt => "prompt",
            Arm::Cap(_) => "cap",
            Arm::Reserve => "reserve",
            Arm::Kvgate => "kvgate",
            Arm::Elastic => "elastic",
            Arm::Queued => "queued",
            Arm::Oracle => "oracle",
            Arm::Vllm => "vllm",
        }
    }
    pub(super) fn gateway(self) -> bool {
        matches!(self, Arm::Kvgate | Arm::Elastic | Arm::Queued | Arm::Oracle)
    }
    pub(super) fn reserve(self) -> bool {
        !matches!(self, Arm::None | Arm::Prompt | Arm::Cap(_) | Arm::Vllm)
    }
    /// Most sequences running at once.
    pub(super) fn max_batch(self, p: &Preset) -> usize {
        match self {
            Arm::Cap(n) => n.min(p.max_batch),
            _ => p.max_batch,
        }
    }
}

/// The shipped filter configuration (the JSON block of envoy/kvgate-filter.yaml) priced against
/// one backend's pool; with `elastic_prior`, every class reserves elastically.
/// What the command line changes in every gateway arm's filter configuration.
pub(super) struct Tuning {
    pub(super) quantile: f64,
    pub(super) by_prompt: bool,
    pub(super) safety: Option<f64>,
    /// `--set KEY=JSON`, in order.
    pub(super) sets: Vec<(String, serde_json::Value)>,
}

pub(super) fn filter_config(
    path: &str,
    p: &Preset,
    elastic_prior: Option<u64>,
    queue_ms: Option<u64>,
    t: &Tuning,
) -> Res<Config> {
    let Tuning {
        quantile,
        by_prompt,
        safety,
        sets,
    } = t;
    let yaml = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    // The JSON is the block scalar after `value: |`, up to the first line indented less.
    let mut lines = yaml
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("value: |"));
    let head = lines.next().ok_or(format!("{path}: no `value: |` block"))?;
    let indent = head.len() - head.trim_start().len();
    let json: String = lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
        .map(|l| format!("{l}\n"))
        .collect();
    let mut v: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| format!("{path}: the filter JSON: {e}"))?;
    let o = v
        .as_object_mut()
        .ok_or(format!("{path}: the filter JSON is not an object"))?;
    let (layers, kv_heads, head_dim, dtype) = p.spec;
    // What the backend's descriptor tells a "from_backend" filter: its spec at the served context.
    o.insert(
        "model".into(),
        serde_json::json!({"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                           "kv_dtype_bytes": dtype, "context_tokens": p.context()}),
    );
    o.remove("fallback_model");
    o.remove("fallback_token_multiplier");
    // `backend` stays: classes that preempt need it (the simulated backend demotes their
    // victims); nothing here reads its callout settings.
    // As bench/admission_bench.py's filter_config: the budget is the pool, one block of margin.
    o.insert(
        "kv_budget_bytes".into(),
        (p.blocks * p.block_bytes()).into(),
    );
    o.insert("scratch_margin_bytes".into(), p.block_bytes().into());
    if let Some(f) = safety {
        o.insert("safety_fraction".into(), (*f).into());
    }
    if let Some(prior) = elastic_prior {
        let classes = o
            .get_mut("policy")
            .and_then(|p| p.get_mut("classes"))
            .and_then(|c| c.as_object_mut())
            .ok_or(format!("{path}: no policy.classes"))?;
        for c in classes.values_mut() {
            if let Some(c) = c.as_object_mut() {
                c.insert("reservation".into(), "elastic".into());
                c.insert("elastic_quantile".into(), (*quantile).into());
                c.insert("elastic_min_samples".into(), 5.into());
                c.insert("elastic_prior_tokens".into(), prior.into());
                c.insert("elastic_by_prompt".into(), (*by_prompt).into());
                if let Some(ms) = queue_ms {
                    // As bench/admission_bench.py's filter_config with `queue_ms`.
                    c.remove("min_output_tokens");
                    c.insert("action".into(), "queue".into());
                    c.insert("max_wait_ms".into(), ms.into());
                    c.insert("max_depth".into(), 64.into());
                }
            }
        }
    }
    for (key, value) in sets {
        let parts: Vec<&str> = key.split('.').collect();
        set_at(&mut v, &parts, value);
    }
    Config::from_json(v.to_string().as_bytes()).map_err(|e| format!("filter config: {e:?}"))
}

/// `--set KEY=JSON`: the value at dotted `path` (`*` for every member of an object, e.g.
/// `policy.classes.*.action`), created where missing; `null` removes it.
fn set_at(v: &mut serde_json::Value, path: &[&str], value: &serde_json::Value) {
    let Some(o) = v.as_object_mut() else {
        return;
    };
    match path {
        [] => {}
        [last] if value.is_null() => {
            o.remove(*last);
        }
        [last] => {
            o.insert(last.to_string(), value.clone());
        }
        ["*", rest @ ..] => {
            for m in o.values_mut() {
                set_at(m, rest, value);
            }
        }
        [first, rest @ ..] => {
            let m = o
                .entry(first.to_string())
                .or_insert_with(|| serde_json::json!({}));
            set_at(m, rest, value);
        }
    }
}

//! A written configuration checked into a [`Config`]: every error names the field, the
//! value and the rule.

use super::*;

impl TryFrom<RawConfig> for Config {
    type Error = ConfigError;

    fn try_from(mut raw: RawConfig) -> Result<Config, ConfigError> {
        // A vLLM's report is its metrics.
        if let Some(b) = raw.backend.as_mut() {
            if b.api == Api::Vllm && b.leases_path == RawBackend::default().leases_path {
                b.leases_path = "/metrics".into();
            }
        }
        let (spec, from_backend) = match &raw.model {
            serde_json::Value::String(s) if s == "from_backend" => {
                if !raw.backend.as_ref().is_some_and(RawBackend::keeps_leases) {
                    return Err(ConfigError::new(
                        "model",
                        "\"from_backend\"",
                        "needs the `backend` callout to kvgate-backend to fetch the descriptor \
                         (a vLLM publishes none: give the model's spec)",
                    ));
                }
                let spec = raw.fallback_model.ok_or_else(|| {
                    ConfigError::new(
                        "fallback_model",
                        "missing",
                        "is required with \"model\": \"from_backend\" (used until the descriptor arrives)",
                    )
                })?;
                (spec, true)
            }
            v @ serde_json::Value::Object(_) => (
                serde_json::from_value::<ModelSpec>(v.clone())
                    .map_err(|e| ConfigError::new("model", v.to_string(), e.to_string()))?,
                false,
            ),
            other => {
                return Err(ConfigError::new(
                    "model",
                    other.to_string(),
                    "must be a model spec object or \"from_backend\"",
                ))
            }
        };
        for (field, m) in [
            ("fallback_token_multiplier", raw.fallback_token_multiplier),
            ("tokenizer.multiplier", raw.tokenizer.multiplier),
        ] {
            if let Some(m) = m.filter(|m| !(1.0..=4.0).contains(m)) {
                return Err(ConfigError::new(field, m, "must be in [1, 4]"));
            }
        }
        // One pad for the configured tokenizer's counts; with "from_backend" it applies only
        // until the descriptor's (exact) tokenizer arrives.
        let token_multiplier = match (raw.tokenizer.multiplier, raw.fallback_token_multiplier) {
            (Some(_), Some(f)) => {
                return Err(ConfigError::new(
                    "fallback_token_multiplier",
                    f,
                    "set it or tokenizer.multiplier, not both (both pad the configured \
                     tokenizer's counts)",
                ))
            }
            (None, Some(f)) if !from_backend => {
                return Err(ConfigError::new(
                    "fallback_token_multiplier",
                    f,
                    "applies only with model \"from_backend\"; use tokenizer.multiplier",
                ))
            }
            (Some(m), None) | (None, Some(m)) => m,
            (None, None) if from_backend => d_multiplier(),
            (None, None) => 1.0,
        };
        let pad_runs =
            match raw.tokenizer.pad_runs {
                Some(p) if token_multiplier <= 1.0 => return Err(ConfigError::new(
                    "tokenizer.pad_runs",
                    p,
                    "applies only to an approximate tokenizer, one whose counts are multiplied \
                     by more than 1 (tokenizer.multiplier, or fallback_token_multiplier with \
                     model \"from_backend\")",
                )),
                p => p.unwrap_or(true),
            };
        let pricing = Pricing::new(
            spec,
            raw.kv_budget_bytes,
            raw.safety_fraction,
            raw.scratch_margin_bytes,
        )?;
        let tokenizer = tokenizer_spec(raw.tokenizer)?;
        let l = raw.levels;
        if !(l.amber > 0.0 && l.amber <= l.red && l.red <= 1.0) {
            return Err(ConfigError::new(
                "levels",
                format!("amber {} red {}", l.amber, l.red),
                "must satisfy 0 < amber <= red <= 1",
            ));
        }
        let r = raw.retry_after;
        if r.min_ms == 0 || r.min_ms > r.max_ms {
            return Err(ConfigError::new(
                "retry_after",
                format!("min_ms {} max_ms {}", r.min_ms, r.max_ms),
                "must satisfy 0 < min_ms <= max_ms",
            ));
        }
        if !(0.0..=1.0).contains(&r.jitter) {
            return Err(ConfigError::new(
                "retry_after.jitter",
                r.jitter,
                "must be in [0, 1]",
            ));
        }
        if r.default_lease_ms == 0 {
            return Err(ConfigError::new(
                "retry_after.default_lease_ms",
                0,
                "must be greater than 0",
            ));
        }
        if !(0.0..=1000.0).contains(&raw.fair_retry_max_line) {
            return Err(ConfigError::new(
                "fair_retry_max_line",
                raw.fair_retry_max_line,
                "must be in [0, 1000] (a fraction of the capacity; 0: no bound)",
            ));
        }
        let policy = PolicyTable::try_from(raw.policy)?;
        if let Some(b) = raw.backend.as_ref().filter(|b| !b.keeps_leases()) {
            if !b.secret.is_empty() {
                return Err(ConfigError::new(
                    "backend.secret",
                    "set",
                    "is kvgate-backend's: never sent to a vLLM",
                ));
            }
            if let Some(c) = policy
                .classes()
                .iter()
                .find(|c| matches!(c.reservation, crate::Reservation::Elastic(p) if p.by_prompt))
            {
                return Err(ConfigError::new(
                    format!("policy.classes.{}.elastic_by_prompt", c.name),
                    "true",
                    "needs kvgate-backend: a vLLM's output lengths do not say their prompts",
                ));
            }
            if let Some(c) = policy.classes().iter().find(|c| !c.preempts.is_empty()) {
                return Err(ConfigError::new(
                    format!("policy.classes.{}.preempts", c.name),
                    format!("{:?}", c.preempts),
                    "needs kvgate-backend: a vLLM cannot be asked to let a lease go",
                ));
            }
        }
        if raw.guarded_paths.is_empty() {
            return Err(ConfigError::new(
                "guarded_paths",
                "[]",
                "must name at least one path",
            ));
        }
        for p in raw
            .guarded_paths
            .iter()
            .chain(Some(&raw.status_path).filter(|p| !p.is_empty()))
        {
            if !p.starts_with('/') {
                return Err(ConfigError::new(
                    "guarded_paths/status_path",
                    format!("{p:?}"),
                    "paths must start with '/'",
                ));
            }
        }
        for p in &raw.guarded_paths {
            if crate::request::Endpoint::from_path(p).is_none() {
                return Err(ConfigError::new(
                    "guarded_paths",
                    format!("{p:?}"),
                    "must end in /completions or /chat/completions",
                ));
            }
        }
        if raw.max_body_bytes == 0 || raw.max_body_bytes > 64 * 1024 * 1024 {
            return Err(ConfigError::new(
                "max_body_bytes",
                raw.max_body_bytes,
                "must be in 1..=67108864",
            ));
        }
        if raw.context_error_status != 413 && raw.context_error_status != 400 {
            return Err(ConfigError::new(
                "context_error_status",
                raw.context_error_status,
                "must be 413 or 400",
            ));
        }
        if !(50..=60_000).contains(&raw.tick_ms) {
            return Err(ConfigError::new(
                "tick_ms",
                raw.tick_ms,
                "must be in 50..=60000",
            ));
        }
        if !(1_000..=3_600_000).contains(&raw.owner_timeout_ms) {
            return Err(ConfigError::new(
                "owner_timeout_ms",
                raw.owner_timeout_ms,
                "must be in 1000..=3600000",
            ));
        }
        if raw.owner_timeout_ms < raw.tick_ms.saturating_mul(3) {
            // The reaper counts a tick's gap as at most two ticks of silence (a clock jump or a
            // pause): a shorter timeout would reap live workers after one.
            return Err(ConfigError::new(
                "owner_timeout_ms",
                raw.owner_timeout_ms,
                format!("must be at least 3 x tick_ms ({})", raw.tick_ms),
            ));
        }
        if let Some(b) = &raw.backend {
            if b.cluster.is_empty() {
                return Err(ConfigError::new(
                    "backend.cluster",
                    "\"\"",
                    "must name an Envoy cluster",
                ));
            }
            if b.secret.starts_with("REPLACE") {
                return Err(ConfigError::new(
                    "backend.secret",
                    format!("{:?}", b.secret),
                    "is the sample's placeholder: set the backend's admission secret \
                     (e.g. `openssl rand -hex 32`)",
                ));
            }
            let per_lease = |p: &str| p.starts_with('/') && p.contains("{id}");
            if !b.leases_path.starts_with('/')
                || !per_lease(&b.cancel_path)
                || !per_lease(&b.demote_path)
            {
                return Err(ConfigError::new(
                    "backend.leases_path/cancel_path/demote_path",
                    format!(
                        "{:?} {:?} {:?}",
                        b.leases_path, b.cancel_path, b.demote_path
                    ),
                    "paths must start with '/'; cancel_path and demote_path must contain {id}",
                ));
            }
            if !(100..=60_000).contains(&b.poll_ms) || b.timeout_ms == 0 {
                return Err(ConfigError::new(
                    "backend.poll_ms",
                    b.poll_ms,
                    "must be in 100..=60000 (and timeout_ms > 0)",
                ));
            }
            if b.lost_grace_ms < 2 * b.poll_ms {
                return Err(ConfigError::new(
                    "backend.lost_grace_ms",
                    b.lost_grace_ms,
                    "must be at least twice poll_ms, or requests still on their way count as drift",
                ));
            }
            if b.down_after_failures == 0 {
                return Err(ConfigError::new(
                    "backend.down_after_failures",
                    b.down_after_failures,
                    "must be at least 1 (the failed polls in a row that mark a backend down)",
                ));
            }
            check_endpoints(&b.endpoints)?;
        } else if let Some(c) = policy.classes().iter().find(|c| !c.preempts.is_empty()) {
            // A preempted lease is demoted at the backend; without the callout its request would
            // go on holding its KV while the preempting one is admitted on top of it.
            return Err(ConfigError::new(
                format!("policy.classes.{}.preempts", c.name),
                format!("{:?}", c.preempts),
                "needs the `backend` callout: a preempted lease is demoted at the backend",
            ));
        }
        if let Some(g) = raw.gateway_id.filter(|g| *g > MAX_GATEWAY_ID) {
            return Err(ConfigError::new(
                "gateway_id",
                g,
                format!("must be in 0..={MAX_GATEWAY_ID}"),
            ));
        }
        Ok(Config {
            pricing,
            from_backend,
            token_multiplier,
            pad_runs,
            share_prefixes: raw.backend.as_ref().is_some_and(RawBackend::keeps_leases),
            tokenizer,
            levels: LevelThresholds {
                amber: l.amber,
                red: l.red,
            },
            retry_after: RetryAfterConfig {
                min_ms: r.min_ms,
                max_ms: r.max_ms,
                jitter: r.jitter,
                default_lease_ms: r.default_lease_ms,
            },
            retry_from_progress: r.from_progress,
            policy,
            normalized_guarded: raw
                .guarded_paths
                .iter()
                .map(|g| normalize_path(g))
                .collect(),
            guarded_paths: raw.guarded_paths,
            max_body_bytes: raw.max_body_bytes,
            status_path: raw.status_path,
            context_error_status: raw.context_error_status,
            tick_ms: raw.tick_ms,
            owner_timeout_ms: raw.owner_timeout_ms,
            // A shadow filter refuses nothing, so no request waits in line.
            fair_retry_patience_ms: if raw.mode == Mode::Shadow {
                0
            } else {
                raw.fair_retry_patience_ms
            },
            // In [0, 1000] (checked above): at most 1,000,000, and a nonzero fraction is at
            // least one thousandth.
            fair_retry_max_line_permille: match raw.fair_retry_max_line {
                f if f > 0.0 => ((f * 1000.0).round() as u32).max(1),
                _ => 0,
            },
            backfill: raw.fair_retry_backfill && raw.mode != Mode::Shadow,
            mode: raw.mode,
            gateway_id: raw.gateway_id,
            internal_templates: raw.backend.as_ref().map_or_else(Vec::new, |b| {
                [&b.leases_path, &b.cancel_path, &b.demote_path]
                    .iter()
                    .map(|t| normalize_path(t))
                    .collect()
            }),
            backend: raw.backend,
            served: crate::validate::Served::default(),
        })
    }
}

/// Endpoints are `host:port` as Envoy's cluster holds them (an IPv6 host in brackets), each
/// once, at most `MAX_ENDPOINTS`.
fn check_endpoints(endpoints: &[String]) -> Result<(), ConfigError> {
    if endpoints.len() > MAX_ENDPOINTS {
        return Err(ConfigError::new(
            "backend.endpoints",
            endpoints.len(),
            format!("at most {} endpoints", MAX_ENDPOINTS),
        ));
    }
    for (i, e) in endpoints.iter().enumerate() {
        let ok = e.len() <= 255
            && e.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty()
                    && port.parse::<u16>().is_ok_and(|p| p > 0)
                    && host
                        .bytes()
                        .all(|c| c.is_ascii_alphanumeric() || b".-:[]_".contains(&c))
            });
        if !ok {
            return Err(ConfigError::new(
                "backend.endpoints",
                format!("{e:?}"),
                "each must be host:port (the address Envoy's cluster holds)",
            ));
        }
        if endpoints.get(..i).is_some_and(|seen| seen.contains(e)) {
            return Err(ConfigError::new(
                "backend.endpoints",
                format!("{e:?}"),
                "is listed twice",
            ));
        }
    }
    Ok(())
}

fn tokenizer_spec(raw: RawTokenizer) -> Result<TokenizerSpec, ConfigError> {
    if raw.ranks.is_none() && (raw.chat_template.is_some() || raw.add_bos.is_some()) {
        return Err(ConfigError::new(
            "tokenizer.chat_template/add_bos",
            "set",
            "only with custom `ranks` (a built-in encoding renders chats as ChatML)",
        ));
    }
    match (raw.encoding, raw.ranks) {
        (Some(_), Some(_)) => Err(ConfigError::new(
            "tokenizer",
            "encoding and ranks",
            "set either a built-in `encoding` or custom `ranks`, not both",
        )),
        (Some(name), None) => Encoding::from_name(&name)
            .map(TokenizerSpec::Builtin)
            .ok_or_else(|| {
                ConfigError::new(
                    "tokenizer.encoding",
                    format!("{name:?}"),
                    "must be one of cl100k_base, o200k_base, r50k_base",
                )
            }),
        (None, None) => Ok(TokenizerSpec::Builtin(Encoding::Cl100kBase)),
        (None, Some(ranks)) => {
            let pattern = raw.pattern.ok_or_else(|| {
                ConfigError::new(
                    "tokenizer.pattern",
                    "missing",
                    "is required with custom ranks",
                )
            })?;
            Ok(TokenizerSpec::Custom(CustomBpe {
                ranks: CustomBpe::parse_tiktoken(&ranks)?,
                pattern,
                special_tokens: raw.special_tokens.into_iter().collect(),
                chat_template: crate::tokenize::ChatTemplate::from_wire(
                    raw.chat_template.as_deref().unwrap_or_default(),
                    &raw.bos_token,
                    &raw.eos_token,
                ),
                add_bos: raw.add_bos,
            }))
        }
    }
}

//! The filter's configuration: raw serde structs (unknown fields refused, explicit defaults)
//! validated into a typed `Config`. Every error names the field, the value and the rule.
//!
//! Lives in core, not in the plugin, so the whole validation is tested natively.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::error::ConfigError;
use crate::ledger::LevelThresholds;
use crate::policy::{PolicyTable, RawPolicy};
use crate::retry::RetryAfterConfig;
use crate::spec::{ModelSpec, Pricing};
use crate::tokenize::{CustomBpe, Encoding, TokenizerSpec};

mod from_raw;
mod path;
mod raw;

pub use path::PathKind;
use path::{normalize_path, template_matches};
pub use raw::*;

/// The validated configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub pricing: Pricing,
    /// The model descriptor comes from the backend (`"model": "from_backend"`).
    pub from_backend: bool,
    /// Counted prompt tokens are multiplied by this (above 1 while pricing with a fallback
    /// tokenizer; exactly 1 with the model's own).
    pub token_multiplier: f64,
    /// With `token_multiplier` above 1: runs the tokenizer merges are padded too
    /// (`tokenizer.pad_runs`).
    pub pad_runs: bool,
    /// A chat's prefix before its last message is charged once among the live requests that
    /// share it (`gate::SharedPrefix`): behind kvgate-backend, whose lease report says what
    /// it holds once (a vLLM's does not).
    pub share_prefixes: bool,
    pub tokenizer: TokenizerSpec,
    pub levels: LevelThresholds,
    pub retry_after: RetryAfterConfig,
    /// Retry-After from the live leases' reported progress (`retry_after.from_progress`).
    pub retry_from_progress: bool,
    pub policy: PolicyTable,
    pub guarded_paths: Vec<String>,
    /// The guarded paths as [`normalize_path`] writes them, for [`Config::path_kind`].
    pub normalized_guarded: Vec<String>,
    pub max_body_bytes: u64,
    pub status_path: String,
    pub context_error_status: u32,
    pub tick_ms: u64,
    pub owner_timeout_ms: u64,
    pub fair_retry_patience_ms: u64,
    /// `fair_retry_max_line`, in thousandths of the capacity (0: no bound).
    pub fair_retry_max_line_permille: u32,
    /// Backfills (`fair_retry_backfill`); off with fair retries off.
    pub backfill: bool,
    pub mode: Mode,
    pub gateway_id: Option<u16>,
    pub backend: Option<BackendCallout>,
    /// The configured `backend` paths, normalized once (`normalize_path`) for `path_kind`.
    pub internal_templates: Vec<String>,
    /// What the backend serves (from its descriptor): requests it would refuse are refused here,
    /// before anything is reserved. Unknown until the descriptor arrives.
    pub served: crate::validate::Served,
}

impl Config {
    /// Parse and validate the plugin configuration JSON.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = serde_json::from_slice(bytes).map_err(|e| {
            ConfigError::new(
                "(plugin configuration)",
                format!("line {} column {}", e.line(), e.column()),
                e.to_string(),
            )
        })?;
        Config::try_from(raw)
    }

    /// Is this path one whose requests are priced?
    pub fn guards(&self, path: &str) -> bool {
        let p = path.split('?').next().unwrap_or(path);
        self.guarded_paths.iter().any(|g| g == p)
    }

    /// What the filter does with a request for `path`: price it (a guarded path), refuse it (the
    /// backend's admission API — the shipped `/v1/admission/…` or a configured `backend` path,
    /// `{id}` standing for any non-empty text — or a guarded path in disguise), or let it pass.
    /// Compared as a permissive server would route it: percent-decoded, repeated slashes
    /// merged, `.` and `..` resolved, any case. One normalization at most, and none for a
    /// guarded path (the hot path).
    pub fn path_kind(&self, path: &str) -> PathKind {
        if self.guards(path) {
            return PathKind::Guarded;
        }
        let raw = path.split(['?', '#']).next().unwrap_or(path);
        let p = normalize_path(raw);
        if p == "/v1/admission"
            || p.starts_with("/v1/admission/")
            || self
                .internal_templates
                .iter()
                .any(|t| template_matches(t, &p))
        {
            PathKind::Internal
        } else if self.normalized_guarded.contains(&p) {
            PathKind::DisguisedGuarded
        } else {
            PathKind::Other
        }
    }
}

/// Whether the filter acts on its decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    Shadow,
}

/// Highest `gateway_id` (10 bits of a lease id).
/// Most endpoints one filter configuration may name.
pub const MAX_ENDPOINTS: usize = 256;

/// Which endpoint gets a request that fits on several.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Choice {
    /// The one with the most room after the reservation: spreads load, keeps every endpoint's
    /// headroom (and its decode batch) even.
    #[default]
    MostRoom,
    /// The one with the least room that still fits: packs small requests together and keeps
    /// large holes for large requests (fewer big requests refused while the total room would
    /// hold them).
    BestFit,
}

pub const MAX_GATEWAY_ID: u16 = 1023;

impl Config {
    /// The bound on the fair-retry line for a request of `class` (thousandths of the capacity,
    /// 0: none): `fair_retry_max_line` for requests answered with a 429, none for a `queue`
    /// class, whose requests wait in the gateway's queue (their places are retried there as
    /// soon as they are filled, and `max_wait_ms` bounds the wait).
    pub fn max_line_permille(&self, class: &crate::policy::ClassPolicy) -> u32 {
        match class.action {
            crate::policy::Action::Queue { .. } => 0,
            _ => self.fair_retry_max_line_permille,
        }
    }

    /// This configuration with the backend's model descriptor applied: its spec, KV budget and
    /// scratch margin (the configured margin when larger), its tokenizer, and exact counting.
    pub fn with_descriptor(&self, d: crate::reconcile::Descriptor) -> Result<Config, ConfigError> {
        let crate::reconcile::Descriptor {
            spec,
            kv_capacity_bytes,
            scratch_margin_bytes,
            tokenizer,
            served,
            prefix_caching,
            ..
        } = d;
        let pricing = Pricing::new(
            spec,
            kv_capacity_bytes,
            self.pricing.safety_fraction,
            self.pricing.scratch_margin_bytes.max(scratch_margin_bytes),
        )?;
        Ok(Config {
            pricing,
            tokenizer,
            token_multiplier: 1.0,
            served,
            // A backend that holds a shared prefix once says so; one that does not, is charged
            // for every copy.
            share_prefixes: self.share_prefixes && prefix_caching,
            ..self.clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admission_api_is_internal_however_the_path_is_spelled() {
        let with_backend = |backend: &str| {
            Config::from_json(
                format!(
                    r#"{{"model": {{"layers": 2, "kv_heads": 1, "head_dim": 8, "kv_dtype_bytes": 2,
                       "context_tokens": 1024}}, "kv_budget_bytes": 1000000, "backend": {backend}}}"#
                )
                .as_bytes(),
            )
            .unwrap()
        };
        let cfg = with_backend(
            r#"{"cluster": "b", "leases_path": "/internal/leases",
                "cancel_path": "/internal/leases/{id}/cancel",
                "demote_path": "/admin/lease-{id}/demote"}"#,
        );
        let flood = format!("{}v1/admission/leases", "/".repeat(5000));
        for p in [
            "/v1/admission/leases",
            "/v1/admission/leases?since=0",
            "/v1/admission/leases/7/cancel",
            "//v1//admission/leases/7/demote",
            "/V1/Admission/leases",
            "/v1/admission",
            "/v1/admission%2Fleases",
            "/v1/%61dmission/leases",
            "/v1/models/../admission/leases",
            "/v1/./admission/leases/",
            flood.as_str(),
            "/internal/leases",
            "/internal/leases/",
            "/internal/leases/9/cancel",
            "/admin/lease-7/demote",
        ] {
            assert_eq!(cfg.path_kind(p), PathKind::Internal, "{p}");
        }
        for p in [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/v1/admissions",
            "/internal",
            "/internal/leases/9",
            "/admin/lease-/demote",
            "/",
            "",
        ] {
            assert_ne!(cfg.path_kind(p), PathKind::Internal, "{p}");
        }
        // Templates whose `{id}` leaves a short prefix never shadow other paths, nor a guarded
        // path itself.
        let odd = with_backend(
            r#"{"cluster": "b", "cancel_path": "/v1/completions/{id}/cancel",
                "demote_path": "/v1/{id}/demote"}"#,
        );
        assert_ne!(odd.path_kind("/v1/completions"), PathKind::Internal);
        assert_ne!(odd.path_kind("/v1/models"), PathKind::Internal);
        assert_eq!(
            odd.path_kind("/v1/completions/3/cancel"),
            PathKind::Internal
        );
        assert_eq!(odd.path_kind("/v1/3/demote"), PathKind::Internal);
    }

    #[test]
    fn a_placeholder_secret_refuses_to_load() {
        let e = Config::from_json(
            r#"{"model": {"layers": 2, "kv_heads": 1, "head_dim": 8, "kv_dtype_bytes": 2,
                "context_tokens": 1024}, "kv_budget_bytes": 1000000,
                "backend": {"cluster": "b", "secret": "REPLACE-WITH-YOUR-SECRET"}}"#
                .as_bytes(),
        )
        .unwrap_err();
        assert_eq!(e.field, "backend.secret");
        assert!(e.to_string().contains("placeholder"), "{e}");
    }

    #[test]
    fn a_guarded_path_in_disguise_is_recognised() {
        let cfg = Config::from_json(MIN.as_bytes()).unwrap();
        for p in [
            "/v1/%63hat/completions",
            "/v1/chat/complet%69ons",
            "//v1/chat/completions",
            "/v1/./completions",
            "/V1/Completions",
            "/v1/models/../completions?x=1",
            "/v1/chat/completions/",
        ] {
            assert!(!cfg.guards(p), "{p}");
            assert_eq!(cfg.path_kind(p), PathKind::DisguisedGuarded, "{p}");
        }
        for p in ["/v1/models", "/v1/chat", "/", "/v1/completionsx"] {
            assert_ne!(cfg.path_kind(p), PathKind::DisguisedGuarded, "{p}");
        }
    }

    const MIN: &str = r#"{"model":{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192},"kv_budget_bytes":1073741824}"#;

    fn with(extra: &str) -> Result<Config, ConfigError> {
        let json = format!("{},{}}}", &MIN[..MIN.len() - 1], extra);
        Config::from_json(json.as_bytes())
    }

    #[test]
    fn a_descriptor_prices_with_the_backends_spec_budget_and_at_least_its_margin() {
        let c = with(r#""scratch_margin_bytes":1000"#).unwrap();
        let mut d = crate::reconcile::Descriptor {
            spec: ModelSpec {
                layers: 2,
                kv_heads: 1,
                head_dim: 4,
                kv_dtype_bytes: 2,
                context_tokens: 512,
            },
            fingerprint: String::new(),
            kv_capacity_bytes: 1 << 20,
            scratch_margin_bytes: 5000,
            prefix_caching: false,
            tokenizer: c.tokenizer.clone(),
            served: c.served.clone(),
        };
        let p = c.with_descriptor(d.clone()).unwrap().pricing;
        assert_eq!(
            (
                p.bytes_per_token,
                p.scratch_margin_bytes,
                p.spec.context_tokens
            ),
            (32, 5000, 512)
        );
        // A larger configured margin stays.
        d.scratch_margin_bytes = 10;
        assert_eq!(
            c.with_descriptor(d).unwrap().pricing.scratch_margin_bytes,
            1000
        );
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_json(MIN.as_bytes()).unwrap();
        assert_eq!(c.pricing.capacity_bytes, 966_367_641);
        assert_eq!(c.tokenizer, TokenizerSpec::Builtin(Encoding::Cl100kBase));
        assert!(c.guards("/v1/chat/completions?x"));
        assert!(!c.guards("/v1/models"));
        assert_eq!(c.status_path, "", "off unless configured");
        assert_eq!(c.context_error_status, 413);
    }

    #[test]
    fn endpoints_and_gateway_id() {
        let c = with(
            r#""gateway_id":7,"backend":{"endpoints":["10.0.0.1:8000","[fd00::1]:8000","b.svc:80"],"endpoint_choice":"best_fit"}"#,
        )
        .unwrap();
        let b = c.backend.unwrap();
        assert_eq!(b.endpoints.len(), 3);
        assert_eq!(b.endpoint_choice, Choice::BestFit);
        assert_eq!(c.gateway_id, Some(7));
        let c = with(r#""backend":{}"#).unwrap();
        assert!(c.backend.unwrap().endpoints.is_empty());
        assert_eq!(c.gateway_id, None);
        assert_eq!(c.mode, Mode::Enforce);
        let c = with(r#""mode":"shadow""#).unwrap();
        assert_eq!(
            (c.mode, c.fair_retry_patience_ms, c.backfill),
            (Mode::Shadow, 0, false)
        );
        assert!(Config::from_json(MIN.as_bytes()).unwrap().backfill);
        assert!(!with(r#""fair_retry_backfill":false"#).unwrap().backfill);
        assert_eq!(
            Config::from_json(MIN.as_bytes())
                .unwrap()
                .fair_retry_max_line_permille,
            500
        );
        assert_eq!(
            with(r#""fair_retry_max_line":0"#)
                .unwrap()
                .fair_retry_max_line_permille,
            0
        );
        let c = with(r#""fair_retry_max_line":0.5"#).unwrap();
        assert_eq!(c.fair_retry_max_line_permille, 500);
        let bound = |action| {
            c.max_line_permille(&crate::policy::ClassPolicy {
                name: "c".into(),
                action,
                priority: 0,
                preempts: Vec::new(),
                reservation: Default::default(),
            })
        };
        assert_eq!(bound(crate::policy::Action::Reject), 500);
        assert_eq!(
            bound(crate::policy::Action::Degrade {
                min_output_tokens: 1
            }),
            500
        );
        assert_eq!(
            bound(crate::policy::Action::Queue {
                max_wait_ms: 1,
                max_depth: 1
            }),
            0,
            "a queued request keeps its place in the gateway's queue"
        );
        assert!(with(r#""mode":"dry""#).is_err());
    }

    #[test]
    fn errors_name_the_field() {
        for (extra, field) in [
            (r#""safety_fraction":1.5"#, "safety_fraction"),
            (r#""fair_retry_max_line":-1"#, "fair_retry_max_line"),
            (r#""levels":{"amber":0.9,"red":0.5}"#, "levels"),
            (r#""retry_after":{"min_ms":0}"#, "retry_after"),
            (r#""retry_after":{"jitter":2}"#, "retry_after.jitter"),
            (r#""guarded_paths":[]"#, "guarded_paths"),
            (r#""guarded_paths":["/v1/embeddings"]"#, "guarded_paths"),
            (r#""max_body_bytes":0"#, "max_body_bytes"),
            (r#""context_error_status":500"#, "context_error_status"),
            (r#""tick_ms":1"#, "tick_ms"),
            (r#""owner_timeout_ms":10"#, "owner_timeout_ms"),
            (r#""tokenizer":{"encoding":"p99k"}"#, "tokenizer.encoding"),
            (r#""tokenizer":{"ranks":"YQ== 0"}"#, "tokenizer.pattern"),
            (
                r#""policy":{"default_class":"nope","classes":{"a":{}}}"#,
                "policy.default_class",
            ),
            (r#""surprise":1"#, "(plugin configuration)"),
            (r#""backend":{"poll_ms":10}"#, "backend.poll_ms"),
            (
                r#""backend":{"cancel_path":"/x"}"#,
                "backend.leases_path/cancel_path/demote_path",
            ),
            (
                r#""backend":{"demote_path":"/v1/demote"}"#,
                "backend.leases_path/cancel_path/demote_path",
            ),
            (
                r#""backend":{"poll_ms":1000,"lost_grace_ms":1000}"#,
                "backend.lost_grace_ms",
            ),
            (
                r#""backend":{"endpoints":["a:1","a:1"]}"#,
                "backend.endpoints",
            ),
            (r#""backend":{"endpoints":["a"]}"#, "backend.endpoints"),
            (r#""backend":{"endpoints":[":80"]}"#, "backend.endpoints"),
            (r#""backend":{"endpoints":["a:0"]}"#, "backend.endpoints"),
            (r#""backend":{"endpoints":["a b:80"]}"#, "backend.endpoints"),
            (
                r#""backend":{"endpoint_choice":"random"}"#,
                "(plugin configuration)",
            ),
            (r#""gateway_id":1024"#, "gateway_id"),
        ] {
            let e = with(extra).unwrap_err();
            assert_eq!(e.field, field, "{extra}: {e}");
        }
        let e = Config::from_json(br#"{"model":{"layers":0,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192},"kv_budget_bytes":1}"#).unwrap_err();
        assert_eq!(e.field, "model.layers");
    }

    #[test]
    fn model_from_backend_needs_a_fallback_and_the_callout() {
        let base = r#""kv_budget_bytes":1073741824,"backend":{}"#;
        let ok = Config::from_json(
            format!(r#"{{"model":"from_backend","fallback_model":{{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192}},{base}}}"#).as_bytes(),
        )
        .unwrap();
        assert!(ok.from_backend);
        assert_eq!(ok.token_multiplier, 1.25);
        let e = Config::from_json(format!(r#"{{"model":"from_backend",{base}}}"#).as_bytes())
            .unwrap_err();
        assert_eq!(e.field, "fallback_model");
        let e = Config::from_json(br#"{"model":"from_backend","kv_budget_bytes":1}"#).unwrap_err();
        assert_eq!(e.field, "model");
        let e = Config::from_json(br#"{"model":"llama","kv_budget_bytes":1}"#).unwrap_err();
        assert_eq!(e.field, "model");
        assert_eq!(
            Config::from_json(MIN.as_bytes()).unwrap().token_multiplier,
            1.0
        );
    }

    #[test]
    fn an_approximate_tokenizer_is_padded_by_its_multiplier() {
        let inline = |tok: &str| {
            Config::from_json(
                format!(r#"{{"model":{{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192}},"kv_budget_bytes":1073741824,"tokenizer":{tok}}}"#)
                    .as_bytes(),
            )
        };
        let ok = inline(r#"{"encoding":"cl100k_base","multiplier":1.5}"#).unwrap();
        assert_eq!(ok.token_multiplier, 1.5);
        for bad in ["0.9", "4.5"] {
            let e = inline(&format!(r#"{{"multiplier":{bad}}}"#)).unwrap_err();
            assert_eq!(e.field, "tokenizer.multiplier");
        }
        // With "from_backend" it pads the fallback tokenizer's counts in place of
        // fallback_token_multiplier.
        let from_backend = |extra: &str| {
            Config::from_json(
                format!(r#"{{"model":"from_backend","fallback_model":{{"layers":30,"kv_heads":3,"head_dim":64,"kv_dtype_bytes":4,"context_tokens":8192}},"kv_budget_bytes":1073741824,"backend":{{}}{extra}}}"#)
                    .as_bytes(),
            )
        };
        let fallback = from_backend(r#","tokenizer":{"multiplier":1.5}"#).unwrap();
        assert_eq!(fallback.token_multiplier, 1.5);
        // Runs are padded too unless turned off; turning them off where nothing is
        // approximated is an error, not a no-op.
        assert!(ok.pad_runs && fallback.pad_runs);
        assert!(from_backend("").unwrap().pad_runs);
        let off = inline(r#"{"encoding":"cl100k_base","multiplier":1.5,"pad_runs":false}"#);
        assert!(!off.unwrap().pad_runs);
        assert!(
            !from_backend(r#","tokenizer":{"pad_runs":false}"#)
                .unwrap()
                .pad_runs
        );
        let e = inline(r#"{"encoding":"cl100k_base","pad_runs":true}"#).unwrap_err();
        assert_eq!(e.field, "tokenizer.pad_runs");
        // Two pads of the same counts: a configuration error, not one silently ignored.
        let e = from_backend(r#","tokenizer":{"multiplier":1.5},"fallback_token_multiplier":1.1"#)
            .unwrap_err();
        assert_eq!(e.field, "fallback_token_multiplier");
        assert!(e.to_string().contains("not both"), "{e}");
        // A fallback pad without "from_backend" would never apply.
        let e =
            inline(r#"{"encoding":"cl100k_base"},"fallback_token_multiplier":1.5"#).unwrap_err();
        assert_eq!(e.field, "fallback_token_multiplier");
        for bad in ["0.9", "4.5"] {
            let e = from_backend(&format!(r#","fallback_token_multiplier":{bad}"#)).unwrap_err();
            assert_eq!(e.field, "fallback_token_multiplier");
        }
    }

    #[test]
    fn preemption_needs_the_callout_a_backend_is_down_after_a_failure_and_owners_outlast_three_ticks(
    ) {
        let policy =
            r#""policy":{"classes":{"default":{},"vip":{"priority":9,"preempts":["default"]}}}"#;
        let e = with(policy).unwrap_err();
        assert_eq!(e.field, "policy.classes.vip.preempts");
        assert!(e.rule.contains("`backend`"), "{}", e.rule);
        assert!(with(&format!(r#"{policy},"backend":{{}}"#)).is_ok());
        let e = with(r#""tick_ms":1000,"owner_timeout_ms":2999"#).unwrap_err();
        assert_eq!(e.field, "owner_timeout_ms");
        assert!(with(r#""tick_ms":1000,"owner_timeout_ms":3000"#).is_ok());
        let e = with(r#""backend":{"down_after_failures":0}"#).unwrap_err();
        assert_eq!(e.field, "backend.down_after_failures");
        assert_eq!(
            with(r#""backend":{"down_after_failures":1}"#)
                .unwrap()
                .backend
                .map(|b| b.down_after_failures),
            Some(1)
        );
    }

    #[test]
    fn custom_tokenizer_from_config() {
        let c = with(r#""tokenizer":{"ranks":"YQ== 0\nYg== 1\nYWI= 2","pattern":"\\w+|\\s+","special_tokens":{"<|im_start|>":3}}"#).unwrap();
        let TokenizerSpec::Custom(bpe) = &c.tokenizer else {
            panic!()
        };
        assert_eq!(
            bpe.ranks,
            vec![(b"a".to_vec(), 0), (b"b".to_vec(), 1), (b"ab".to_vec(), 2)]
        );
        let counter = crate::TokenCounter::new(&c.tokenizer).unwrap();
        assert_eq!(counter.encode_text("ab"), vec![2]);
    }

    #[test]
    fn a_custom_tokenizer_carries_the_models_chat_template_and_bos() {
        let c = with(r#""tokenizer":{"ranks":"YQ== 0\nYg== 1\nYWI= 2","pattern":"\\w+|\\s+","special_tokens":{"<s>":3},
            "chat_template":"{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}","bos_token":"<s>","add_bos":3}"#).unwrap();
        let counter = crate::TokenCounter::new(&c.tokenizer).unwrap();
        let msgs = [crate::request::ChatMessage {
            role: "user".into(),
            content: "ab".into(),
            ..Default::default()
        }];
        assert_eq!(counter.encode_chat(&msgs).unwrap(), vec![3, 2]);
        assert_eq!(counter.encode_prompt("ab"), vec![3, 2]);
        let e = with(r#""tokenizer":{"encoding":"cl100k_base","chat_template":"x"}"#).unwrap_err();
        assert_eq!(e.field, "tokenizer.chat_template/add_bos");
    }

    #[test]
    fn in_front_of_a_vllm_the_metrics_are_polled_and_what_needs_leases_is_refused() {
        let c = with(r#""backend":{"api":"vllm","cluster":"vllm"}"#).unwrap();
        let b = c.backend.as_ref().unwrap();
        assert_eq!(b.leases_path, "/metrics");
        assert!(!b.keeps_leases());
        assert_eq!(
            c.path_kind("/metrics"),
            PathKind::Internal,
            "never routed to clients"
        );
        let own =
            with(r#""backend":{"api":"vllm","cluster":"vllm","leases_path":"/stats"}"#).unwrap();
        assert_eq!(own.backend.unwrap().leases_path, "/stats");
        let e = with(
            r#""backend":{"api":"vllm","cluster":"vllm"},
            "policy":{"classes":{"default":{"priority":1,"preempts":["b"]},"b":{}}}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "policy.classes.default.preempts");
        let e = Config::from_json(br#"{"model":"from_backend","fallback_model":{"layers":1,"kv_heads":1,"head_dim":1,"kv_dtype_bytes":1,"context_tokens":10},
            "kv_budget_bytes":1000,"backend":{"api":"vllm","cluster":"vllm"}}"#)
        .unwrap_err();
        assert_eq!(e.field, "model");
        assert!(with(r#""backend":{"api":"sglang","cluster":"x"}"#).is_err());
        let e = with(r#""backend":{"api":"vllm","cluster":"vllm","secret":"s"}"#).unwrap_err();
        assert_eq!(e.field, "backend.secret");
        let e = with(
            r#""backend":{"api":"vllm","cluster":"vllm"},
            "policy":{"classes":{"default":{"reservation":"elastic","elastic_by_prompt":true}}}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "policy.classes.default.elastic_by_prompt");
    }
}

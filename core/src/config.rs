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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// The model's KV shape, or `"from_backend"`: take spec, KV budget and tokenizer from the
    /// backend's descriptor (needs `backend`); until it arrives, price with `fallback_model`,
    /// `kv_budget_bytes` and the configured tokenizer, counts multiplied by
    /// `fallback_token_multiplier`.
    pub model: serde_json::Value,
    #[serde(default)]
    pub fallback_model: Option<ModelSpec>,
    /// Default 1.25 with `"from_backend"`; not with `tokenizer.multiplier` (one pad, not two
    /// that silently override each other).
    #[serde(default)]
    pub fallback_token_multiplier: Option<f64>,
    pub kv_budget_bytes: u64,
    #[serde(default = "d_safety")]
    pub safety_fraction: f64,
    #[serde(default)]
    pub scratch_margin_bytes: u64,
    #[serde(default)]
    pub tokenizer: RawTokenizer,
    #[serde(default)]
    pub levels: RawLevels,
    #[serde(default)]
    pub retry_after: RawRetryAfter,
    #[serde(default)]
    pub policy: RawPolicy,
    #[serde(default = "d_paths")]
    pub guarded_paths: Vec<String>,
    #[serde(default = "d_max_body")]
    pub max_body_bytes: u64,
    #[serde(default = "d_status_path")]
    pub status_path: String,
    #[serde(default = "d_context_status")]
    pub context_error_status: u32,
    #[serde(default = "d_tick")]
    pub tick_ms: u64,
    /// A worker whose heartbeat has not changed for this long (as another worker watched it) is
    /// gone; only then are its leases reclaimed.
    #[serde(default = "d_owner_timeout")]
    pub owner_timeout_ms: u64,
    /// Fair retries: a refused request keeps its place in line (freed bytes are set aside for it)
    /// while its client retries; the place is dropped when the client has not come back this
    /// long after the advertised Retry-After. 0 turns fair retries off.
    #[serde(default = "d_patience")]
    pub fair_retry_patience_ms: u64,
    /// Backfills: a request expected to be done before the requests in line ahead of it could
    /// start (or that leaves them room then) may take what the line holds (see `ledger`).
    #[serde(default = "d_true")]
    pub fair_retry_backfill: bool,
    /// A refused request takes a new place in line only while what the line ahead of it still
    /// lacks is at most this fraction of the capacity (its own need is not counted, so a big
    /// request is not kept out); past it, a plain 429 with nothing set aside for it. 0: no
    /// bound. Default 0.5: under sustained overload an unbounded line sets bytes aside for
    /// clients who give up before their turn (docs/design/012-a-bound-on-the-line.md).
    #[serde(default = "d_max_line")]
    pub fair_retry_max_line: f64,
    /// `enforce` (default): admit, queue, degrade, preempt and refuse. `shadow`: decide exactly
    /// as `enforce` would and count it (`kvgate.shadow.*` stats, an `x-kvgate-shadow` response
    /// header), but let every request through unchanged; every forwarded request is reserved at
    /// its worst case, so the ledger shows the load as it really is.
    #[serde(default)]
    pub mode: Mode,
    /// This gateway's number (0..=1023), put in the top bits of its lease ids so ids from several
    /// gateways in front of one backend never collide. Absent: drawn at random at start.
    #[serde(default)]
    pub gateway_id: Option<u16>,
    /// Poll the backend's admission API (leases, releases, real KV use). Absent: no callout.
    #[serde(default)]
    pub backend: Option<RawBackend>,
}

/// The callout to the backend's `GET /v1/admission/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawBackend {
    /// What the backend speaks: `kvgate` (kvgate-backend's lease API) or `vllm` (a vLLM server:
    /// its Prometheus metrics are polled, [`crate::vllm`]).
    pub api: Api,
    /// Envoy cluster of the backend.
    pub cluster: String,
    /// `:authority` of the callout requests.
    pub authority: String,
    /// The report polled: the lease report, or with `api: vllm` its metrics (`/metrics`).
    pub leases_path: String,
    /// `{id}` is replaced by the lease id. Stops a lease's sequence (its client went away).
    pub cancel_path: String,
    /// `{id}` is replaced by the lease id. Preemption: the backend lets the lease's sequence go
    /// on in borrowed blocks (it reserves nothing there any more, and is recomputed later when
    /// a reservation needs the blocks), or stops it if it cannot lend.
    pub demote_path: String,
    pub poll_ms: u64,
    pub timeout_ms: u64,
    /// A ledger lease the backend does not know after this long is drift: counted, logged and
    /// shown in the level; never removed (it ends with its request).
    pub lost_grace_ms: u64,
    /// Log a warning when |ledger committed − backend used| exceeds this.
    pub drift_warn_bytes: u64,
    /// Consecutive failed polls before the backend is reported down (level red).
    pub down_after_failures: u32,
    /// Sent as `x-kvgate-secret` on every callout and on every forwarded request that carries a
    /// lease, so the backend can refuse admission calls and lease headers from anyone else
    /// (its `--admission-secret-file`). Empty: none sent.
    pub secret: String,
    /// The backend hosts (`ip:port`, as the cluster holds them) this gateway balances over, each
    /// with its own ledger; the choice is sent to Envoy's `override_host` load balancer (filter
    /// state `wasm.kvgate_endpoint`, copied into `x-kvgate-endpoint`) and the callouts to one
    /// endpoint carry that header. Empty: one backend (or the cluster's own balancing), one
    /// ledger.
    pub endpoints: Vec<String>,
    /// Which endpoint gets a request that fits on several: `most_room` or `best_fit`.
    pub endpoint_choice: crate::fleet::Choice,
}

impl Default for RawBackend {
    fn default() -> Self {
        RawBackend {
            api: Api::Kvgate,
            cluster: "kvgate_backend".into(),
            authority: "kvgate-backend".into(),
            leases_path: "/v1/admission/leases".into(),
            cancel_path: "/v1/admission/leases/{id}/cancel".into(),
            demote_path: "/v1/admission/leases/{id}/demote".into(),
            poll_ms: 1000,
            timeout_ms: 2000,
            lost_grace_ms: 30_000,
            drift_warn_bytes: 256 * 1024 * 1024,
            down_after_failures: 3,
            secret: String::new(),
            endpoints: Vec::new(),
            endpoint_choice: crate::fleet::Choice::default(),
        }
    }
}

pub type BackendCallout = RawBackend;

/// What the backend speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// kvgate-backend: leases, releases, cancels, demotions, the model descriptor.
    #[default]
    Kvgate,
    /// A vLLM server: its KV pool, use, queue and preemptions from `/metrics`; no lease API, so
    /// no cancels, demotions, early releases or descriptor.
    Vllm,
}

impl RawBackend {
    /// The server keeps the gateway's leases (cancels, demotions, releases by report).
    pub fn keeps_leases(&self) -> bool {
        self.api == Api::Kvgate
    }
}

fn d_max_line() -> f64 {
    0.5
}

fn d_safety() -> f64 {
    0.9
}
fn d_multiplier() -> f64 {
    1.25
}
fn d_paths() -> Vec<String> {
    vec!["/v1/completions".into(), "/v1/chat/completions".into()]
}
fn d_max_body() -> u64 {
    4 * 1024 * 1024
}
fn d_status_path() -> String {
    // Off unless asked for: it shows backend addresses and the line's state to whoever can
    // reach the listener.
    String::new()
}
fn d_context_status() -> u32 {
    413
}
fn d_tick() -> u64 {
    1000
}
fn d_owner_timeout() -> u64 {
    30_000
}
fn d_patience() -> u64 {
    2_000
}

fn d_true() -> bool {
    true
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTokenizer {
    /// A built-in encoding: cl100k_base (default), o200k_base, r50k_base.
    pub encoding: Option<String>,
    /// A custom vocabulary as the text of a `.tiktoken` ranks file.
    pub ranks: Option<String>,
    pub pattern: Option<String>,
    #[serde(default)]
    pub special_tokens: BTreeMap<String, u32>,
    /// Custom ranks: the model's Jinja chat template (absent: ChatML), with the strings it
    /// renders for `bos_token` and `eos_token`, and the BOS id a completions prompt starts with
    /// (`kvgate-backend --describe` writes all of them from a GGUF).
    pub chat_template: Option<String>,
    #[serde(default)]
    pub bos_token: String,
    #[serde(default)]
    pub eos_token: String,
    pub add_bos: Option<u32>,
    /// Text prompt counts are multiplied by this, because this tokenizer only approximates the
    /// model's own. With `"from_backend"`, until the descriptor's exact tokenizer arrives (in
    /// place of `fallback_token_multiplier`).
    pub multiplier: Option<f64>,
    /// With a multiplier (or `"from_backend"`'s fallback): also pad the runs this tokenizer
    /// merges and the model may not (`tokenize::approximation_excess`), and price no text
    /// below the pieces the model's pre-tokenizer cuts it into (`tokenize::pretokens`).
    /// Default true.
    pub pad_runs: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLevels {
    pub amber: f64,
    pub red: f64,
}

impl Default for RawLevels {
    fn default() -> Self {
        let d = LevelThresholds::default();
        RawLevels {
            amber: d.amber,
            red: d.red,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRetryAfter {
    pub min_ms: u64,
    pub max_ms: u64,
    pub jitter: f64,
    pub default_lease_ms: u64,
    /// Estimate from the live leases' progress as the backend reports it (true), or only from
    /// the mean lifetime of past leases (false).
    pub from_progress: bool,
}

impl Default for RawRetryAfter {
    fn default() -> Self {
        let d = RetryAfterConfig::default();
        RawRetryAfter {
            min_ms: d.min_ms,
            max_ms: d.max_ms,
            jitter: d.jitter,
            default_lease_ms: d.default_lease_ms,
            from_progress: true,
        }
    }
}

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

/// See [`Config::path_kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathKind {
    Guarded,
    Internal,
    DisguisedGuarded,
    Other,
}

/// `path` percent-decoded, lower-cased, with repeated slashes merged, `.` and `..` segments
/// resolved and no trailing slash (but the root's).
fn normalize_path(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&c) = bytes.get(i) {
        let hex = |j: usize| bytes.get(j).and_then(|h| (*h as char).to_digit(16));
        match (c, hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                decoded.push(u8::try_from(h * 16 + l).unwrap_or(b'%'));
                i += 3;
            }
            _ => {
                decoded.push(c);
                i += 1;
            }
        }
    }
    let decoded = String::from_utf8_lossy(&decoded).to_ascii_lowercase();
    let mut segments: Vec<&str> = Vec::new();
    for seg in decoded.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    format!("/{}", segments.join("/"))
}

/// Does normalized `path` match normalized `template`, segment by segment, `{id}` in a segment
/// standing for any non-empty text?
fn template_matches(template: &str, path: &str) -> bool {
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    template != "/"
        && t.len() == p.len()
        && t.iter().zip(&p).all(|(t, p)| match t.split_once("{id}") {
            None => t == p,
            Some((before, after)) => {
                p.len() > before.len() + after.len() && p.starts_with(before) && p.ends_with(after)
            }
        })
}

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

/// Whether the filter acts on its decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Enforce,
    Shadow,
}

/// Highest `gateway_id` (10 bits of a lease id).
pub const MAX_GATEWAY_ID: u16 = 1023;

/// Endpoints are `host:port` as Envoy's cluster holds them (an IPv6 host in brackets), each
/// once, at most `fleet::MAX_ENDPOINTS`.
fn check_endpoints(endpoints: &[String]) -> Result<(), ConfigError> {
    if endpoints.len() > crate::fleet::MAX_ENDPOINTS {
        return Err(ConfigError::new(
            "backend.endpoints",
            endpoints.len(),
            format!("at most {} endpoints", crate::fleet::MAX_ENDPOINTS),
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
        assert_eq!(b.endpoint_choice, crate::fleet::Choice::BestFit);
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

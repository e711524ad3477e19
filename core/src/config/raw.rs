//! The configuration as written: serde structs, unknown fields refused, explicit defaults.

use super::*;

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
    pub endpoint_choice: Choice,
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
            endpoint_choice: Choice::default(),
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

pub(super) fn d_max_line() -> f64 {
    0.5
}

pub(super) fn d_safety() -> f64 {
    0.9
}
pub(super) fn d_multiplier() -> f64 {
    1.25
}
pub(super) fn d_paths() -> Vec<String> {
    vec!["/v1/completions".into(), "/v1/chat/completions".into()]
}
pub(super) fn d_max_body() -> u64 {
    4 * 1024 * 1024
}
pub(super) fn d_status_path() -> String {
    // Off unless asked for: it shows backend addresses and the line's state to whoever can
    // reach the listener.
    String::new()
}
pub(super) fn d_context_status() -> u32 {
    413
}
pub(super) fn d_tick() -> u64 {
    1000
}
pub(super) fn d_owner_timeout() -> u64 {
    30_000
}
pub(super) fn d_patience() -> u64 {
    2_000
}

pub(super) fn d_true() -> bool {
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

//! The backend→filter lease report (`GET /v1/admission/leases`), defined once for both sides.
//!
//! The backend builds a [`LeaseReport`] and serialises it; the filter deserialises the same type
//! and reads what it needs through `reconcile::BackendReport` and `reconcile::Descriptor`. Peers
//! of different versions meet on the wire, so every field that an older backend may not send is
//! `#[serde(default)]`, unknown fields are ignored, and an enum value this build does not know
//! reads as `Unknown` rather than failing the whole report. Only `pool.capacity_bytes` and
//! `pool.used_bytes` are required: without them a report cannot be reconciled.
//!
//! Lease ids are strings: the filter's own are decimal `u64`s; anything else (`internal-3`) is a
//! request that reached the backend without the gateway, and the filter ignores it.
//!
//! This module only describes the document: no I/O, no policy.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::spec::ModelSpec;

/// The whole document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseReport {
    pub pool: PoolReport,
    /// The backend's admission mode (`reserve`, `prompt`, `none`).
    #[serde(default)]
    pub admission: String,
    /// It reads the gateway's body note (`kvgate`, beside `x-kvgate-note`): the gateway tells
    /// it an elastic reservation only that way, so elastic pricing needs it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gateway_note: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelReport>,
    /// Leases the backend holds now: arrived at its HTTP layer, waiting or running.
    #[serde(default)]
    pub leases: Vec<LeaseEntry>,
    /// Leases that finished after the cursor the poll sent (`?since=`).
    #[serde(default)]
    pub finished: Vec<FinishedEntry>,
    /// The newest finished entry's cursor: the next poll's `since`.
    #[serde(default)]
    pub cursor: u64,
    /// The other gateways polling this backend: the number (`gateway_id`) of every Envoy,
    /// other than the one asking, whose poll named its instance within the last three of its
    /// poll periods: one per Envoy where the backend has an admission secret; without one, one
    /// per number that holds a lease here and at most one that holds none.
    /// A gateway learns of its peers here before any of them holds a lease.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_gateways: Vec<u64>,
    /// The address (`ip:port`) the poll's connection reached, as the backend's socket saw it:
    /// a gateway that named one host and was answered by another (override_host falls back
    /// when the named host is not in the cluster) can tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_at: Option<String>,
}

/// The backend's KV block pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PoolReport {
    #[serde(default)]
    pub blocks_total: u32,
    #[serde(default)]
    pub blocks_free: u32,
    #[serde(default)]
    pub block_tokens: u32,
    #[serde(default)]
    pub block_bytes: u64,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    #[serde(default)]
    pub free_bytes: u64,
    /// Blocks promised to sequences that have not grown into them yet (a backend with lazy
    /// blocks), counted in `used_bytes` and not in `free_bytes`: the allocator itself holds
    /// `used_bytes - promised_bytes`. 0 where every reservation takes its blocks at admission.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub promised_bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The served model: what the filter needs to price and validate exactly as the backend would.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelReport {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<ModelSpec>,
    /// `ModelSpec::fingerprint` as 16 hex digits: the filter refetches the descriptor when it
    /// changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_bytes_per_token: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerReport>,
    /// Token ids must be below this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<u64>,
    #[serde(default)]
    pub limits: LimitsReport,
    /// What the gateway adds to every reservation: the backend allocates whole KV blocks, so a
    /// request holds up to one block more than its tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scratch_margin_bytes: Option<u64>,
    /// The most memory one prefill step uses beyond the weights and the KV pool (attention
    /// tiles and activations of a `--prefill-token-budget` chunk at the full context): a device
    /// needs weights + pool + this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_scratch_bytes: Option<u64>,
    /// The same for one decode step of a full batch at the full context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_scratch_bytes: Option<u64>,
    /// It caches prompt blocks and holds a shared prefix once (`LeaseEntry::prefix_tokens`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub prefix_caching: bool,
}

/// The served tokenizer. `ranks` (tiktoken format, one `base64 rank` a line) is only sent when
/// the poll asks for it (`?include=tokenizer`): it is large.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TokenizerReport {
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub pattern: String,
    #[serde(default)]
    pub special_tokens: BTreeMap<String, u32>,
    /// `"chatml"`: the built-in ChatML rendering (what older backends send); anything else is the
    /// source of the model's Jinja chat template, rendered with `bos_token` and `eos_token`.
    #[serde(default)]
    pub chat_template: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub bos_token: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub eos_token: String,
    /// The id a completions text prompt starts with (the model adds BOS); absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_bos: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<String>,
}

/// What the backend's validator accepts beyond the request's own shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitsReport {
    #[serde(default = "default_max_choices")]
    pub max_choices: u64,
    #[serde(default = "default_batched_prompts")]
    pub batched_prompts: bool,
}

fn default_max_choices() -> u64 {
    crate::request::MAX_CHOICES
}

fn default_batched_prompts() -> bool {
    true
}

impl Default for LimitsReport {
    /// An older backend that sends no limits: the request parser's own limits.
    fn default() -> Self {
        LimitsReport {
            max_choices: default_max_choices(),
            batched_prompts: default_batched_prompts(),
        }
    }
}

/// Where a live lease is in the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    /// Its request reached the HTTP layer; the engine has not taken it yet.
    #[default]
    Arrived,
    /// Holds its KV, queued for prefill.
    Waiting,
    /// Decoding.
    Running,
    /// A state this build does not know (a newer backend).
    #[serde(other)]
    Unknown,
}

/// A live lease. An entry without an id reads as id `""`, which is no one's lease.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LeaseEntry {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub state: LeaseState,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub max_tokens: u64,
    /// What it holds; for an elastic sequence preempted to be recomputed, what it needs to
    /// resume (the gateway holds that back).
    #[serde(default)]
    pub reserved_tokens: u64,
    #[serde(default)]
    pub reserved_bytes: u64,
    #[serde(default)]
    pub used_tokens: u64,
    #[serde(default)]
    pub used_bytes: u64,
    /// Elastic: the output tokens its reservation covers (below `max_tokens`); it may grow past
    /// them from free blocks, and is preempted first when a reservation needs them back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic_output_tokens: Option<u64>,
    /// An elastic sequence preempted and waiting to run again: `reserved_tokens` is what it
    /// needs to resume, not what it holds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub resuming: bool,
    /// Of `reserved_tokens`, the tokens of its prompt's first blocks that the backend holds
    /// once for it and another live lease whose prompt starts with them (prefix caching): a
    /// gateway that charged a shared prefix once counts these tokens once.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prefix_tokens: u64,
}

/// Why a sequence ended, as the lease report says; also the OpenAI `finish_reason` of the ones
/// that end normally (`stop`, `length`). A stream cut short ends with an error event instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    /// No KV block left mid-decode, or the model failed.
    Error,
    /// Cancelled through the admission API.
    Preempted,
    /// The client went away.
    Cancelled,
    /// Refused before it reached the engine (invalid, or no room): nothing was allocated.
    Refused,
    /// A reason this build does not know (a newer backend), or none given. The backend never
    /// sends it.
    #[default]
    #[serde(other)]
    Unknown,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Error => "error",
            FinishReason::Preempted => "preempted",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Refused => "refused",
            FinishReason::Unknown => "unknown",
        }
    }
}

/// A lease that ended, numbered by `cursor` so a poll asks only for what is new.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinishedEntry {
    #[serde(default)]
    pub cursor: u64,
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub reason: FinishReason,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    /// The admission class the gateway named (`x-kvgate-class`); elastic classes learn their
    /// output lengths from it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub class: String,
    /// The prompt's length as the gateway counted it (its private `kvgate.prompt_tokens` body
    /// field; 0 when not sent): elastic classes learn output lengths by prompt length in the
    /// gateway's own count, which may differ from the backend's tokenizer.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gateway_prompt_tokens: u64,
}

impl LeaseReport {
    pub fn parse(body: &[u8]) -> Result<LeaseReport, String> {
        serde_json::from_slice(body).map_err(|e| format!("bad lease report: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> LeaseReport {
        LeaseReport {
            pool: PoolReport {
                blocks_total: 4,
                blocks_free: 3,
                block_tokens: 16,
                block_bytes: 16,
                capacity_bytes: 64,
                used_bytes: 16,
                free_bytes: 48,
                promised_bytes: 8,
            },
            admission: "reserve".into(),
            gateway_note: true,
            model: Some(ModelReport {
                name: Some("m".into()),
                spec: Some(ModelSpec {
                    layers: 1,
                    kv_heads: 1,
                    head_dim: 1,
                    kv_dtype_bytes: 1,
                    context_tokens: 64,
                }),
                fingerprint: Some("00000000000000ab".into()),
                kv_bytes_per_token: Some(2),
                tokenizer: Some(TokenizerReport {
                    kind: "tiktoken_bpe".into(),
                    pattern: "x".into(),
                    special_tokens: [("<|e|>".to_string(), 3)].into_iter().collect(),
                    chat_template: "chatml".into(),
                    ranks: None,
                    ..TokenizerReport::default()
                }),
                vocab: Some(4),
                limits: LimitsReport {
                    max_choices: 1,
                    batched_prompts: false,
                },
                scratch_margin_bytes: Some(16),
                prefill_scratch_bytes: Some(1 << 20),
                decode_scratch_bytes: Some(1 << 16),
                prefix_caching: true,
            }),
            leases: vec![LeaseEntry {
                id: "7".into(),
                state: LeaseState::Running,
                prompt_tokens: 3,
                max_tokens: 4,
                reserved_tokens: 16,
                reserved_bytes: 16,
                used_tokens: 5,
                used_bytes: 5,
                elastic_output_tokens: Some(1),
                resuming: false,
                prefix_tokens: 0,
            }],
            finished: vec![FinishedEntry {
                cursor: 1,
                id: "6".into(),
                reason: FinishReason::Preempted,
                prompt_tokens: 2,
                completion_tokens: 1,
                class: "batch".into(),
                gateway_prompt_tokens: 3,
            }],
            cursor: 1,
            other_gateways: vec![4, 4],
            served_at: Some("127.0.0.1:8000".into()),
        }
    }

    #[test]
    fn round_trips_and_keeps_the_field_names_peers_read() {
        let r = full();
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["pool"]["capacity_bytes"], 64);
        assert_eq!(v["admission"], "reserve");
        assert_eq!(v["model"]["tokenizer"]["special_tokens"]["<|e|>"], 3);
        assert!(
            v["model"]["tokenizer"].get("ranks").is_none(),
            "ranks only when asked for"
        );
        assert_eq!(v["model"]["limits"]["batched_prompts"], false);
        assert_eq!(v["leases"][0]["state"], "running");
        assert_eq!(v["finished"][0]["reason"], "preempted");
        assert_eq!(v["finished"][0]["gateway_prompt_tokens"], 3);
        assert_eq!(v["other_gateways"], serde_json::json!([4, 4]));
        assert_eq!(v["served_at"], "127.0.0.1:8000");
        let back = LeaseReport::parse(v.to_string().as_bytes()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn older_and_newer_peers_are_read() {
        // The least a report can be.
        let r = LeaseReport::parse(br#"{"pool":{"capacity_bytes":1,"used_bytes":0}}"#).unwrap();
        assert!(r.leases.is_empty() && r.model.is_none() && r.cursor == 0);
        assert!(r.other_gateways.is_empty() && r.served_at.is_none());
        // Fields and values this build does not know.
        let r = LeaseReport::parse(
            br#"{"pool":{"capacity_bytes":1,"used_bytes":0,"tier":"hbm"},"new":1,
                "leases":[{"id":"a","state":"swapped"}],
                "finished":[{"id":"b","reason":"migrated"},{"id":"c"},{}],"model":{"limits":{}}}"#,
        )
        .unwrap();
        assert_eq!(r.leases[0].state, LeaseState::Unknown);
        assert_eq!(r.finished[0].reason, FinishReason::Unknown);
        assert_eq!(r.finished[1].reason, FinishReason::Unknown);
        assert_eq!(r.finished[2].id, "", "an entry without an id is no one's");
        assert_eq!(r.model.unwrap().limits, LimitsReport::default());
        assert!(LeaseReport::parse(b"{}").is_err());
        assert!(LeaseReport::parse(br#"{"pool":{"used_bytes":0}}"#).is_err());
    }
}

//! Per-class admission policy: what to do with a request that does not fit.
//!
//! Raw serde structs (unknown fields refused) are validated into a `PolicyTable`; every error
//! names the field, the value and the rule.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::error::ConfigError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Answer 429 with Retry-After.
    Reject,
    /// Wait for budget, in priority then arrival order, up to `max_wait_ms`; at most `max_depth`
    /// waiting requests of this class.
    Queue { max_wait_ms: u64, max_depth: u32 },
    /// Lower the cap to the largest that fits, not below `min_output_tokens`; announced in a header.
    Degrade { min_output_tokens: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassPolicy {
    pub name: String,
    pub action: Action,
    /// Higher is more important.
    pub priority: u8,
    /// Classes whose leases this class may cancel to make room (each of lower priority).
    pub preempts: Vec<String>,
    /// What a request of this class reserves.
    pub reservation: Reservation,
}

pub use crate::elastic::Reservation;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyTable {
    classes: Vec<ClassPolicy>,
    default_class: usize,
    /// A request header trusted to name the class (only when the operator marked it trusted:
    /// the edge in front of kvgate sets or strips it). `None`: no header is read.
    pub class_header: Option<String>,
    /// SHA-256 digests of API keys (sent as `Authorization: Bearer KEY`) → class name.
    api_keys: Vec<([u8; 32], String)>,
    /// Where a verified JWT's claim naming the class is (the `jwt_authn` filter's dynamic
    /// metadata): the property path the filter reads. `None`: no claim is read.
    pub claim_path: Option<Vec<String>>,
    /// Read the class from the route's metadata (`filter_metadata.kvgate.class`).
    pub class_from_route: bool,
    /// How long a wait in the admission queue is worth one priority level (`queue::AdmissionQueue`).
    pub queue_aging_ms: u64,
}

/// What the class of a request may come from, as the filter found them. Each is read only when
/// its source is configured.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClassSources<'a> {
    /// The `Authorization` header (API keys).
    pub authorization: Option<&'a str>,
    /// The configured claim of a JWT the `jwt_authn` filter verified.
    pub claim: Option<&'a str>,
    /// The route's `filter_metadata.kvgate.class`.
    pub route: Option<&'a str>,
    /// The trusted class header.
    pub header: Option<&'a str>,
}

/// Where the `jwt_authn` filter puts a verified JWT's payload, and the claim naming the class.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClaim {
    /// `payload_in_metadata` of the jwt_authn provider.
    pub payload_in_metadata: String,
    /// The claim whose (string) value names the class.
    pub claim: String,
    /// The dynamic metadata namespace (the jwt_authn filter's name).
    #[serde(default = "default_jwt_namespace")]
    pub namespace: String,
}

fn default_jwt_namespace() -> String {
    "envoy.filters.http.jwt_authn".to_string()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClass {
    #[serde(default = "default_action")]
    pub action: String,
    #[serde(default)]
    pub priority: u8,
    #[serde(default)]
    pub preempts: Vec<String>,
    pub max_wait_ms: Option<u64>,
    pub max_depth: Option<u32>,
    pub min_output_tokens: Option<u64>,
    /// `"worst_case"` (default) or `"elastic"`.
    #[serde(default)]
    pub reservation: Option<String>,
    /// Elastic only: the quantile of learned output lengths reserved (0.5–1.0, default 0.9).
    #[serde(default)]
    pub elastic_quantile: Option<f64>,
    /// Elastic only: finished outputs of the class needed before the quantile is used (default 20).
    #[serde(default)]
    pub elastic_min_samples: Option<u32>,
    /// Elastic only: the output tokens reserved until then (unset: the whole cap).
    #[serde(default)]
    pub elastic_prior_tokens: Option<u64>,
    /// Elastic only: reserve the quantile of the outputs that answered prompts of about this
    /// request's length, once there are enough of them (default false).
    #[serde(default)]
    pub elastic_by_prompt: Option<bool>,
}

fn default_action() -> String {
    "reject".to_string()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    #[serde(default = "default_class_name")]
    pub default_class: String,
    #[serde(default)]
    pub class_header: Option<String>,
    /// Clients can send any header: `class_header` is honoured only when this is true, which
    /// says the edge in front of kvgate sets or strips it.
    #[serde(default)]
    pub class_header_trusted: bool,
    /// `"sha256:<64 hex digits>"` of an API key → class name. Keys are never stored in clear.
    #[serde(default)]
    pub api_keys: BTreeMap<String, String>,
    /// The class from a claim of a JWT that Envoy's `jwt_authn` filter verified (it must run
    /// before kvgate, with `payload_in_metadata`).
    #[serde(default)]
    pub class_claim: Option<RawClaim>,
    /// The class from the route's metadata: `metadata: {filter_metadata: {kvgate: {class: NAME}}}`.
    #[serde(default)]
    pub class_from_route: bool,
    /// In a worker's admission queue, waiting this long is worth one priority level (0: strict
    /// priority, which can keep a low class waiting as long as higher ones keep coming).
    #[serde(default = "default_queue_aging_ms")]
    pub queue_aging_ms: u64,
    #[serde(default)]
    pub classes: BTreeMap<String, RawClass>,
}

fn default_queue_aging_ms() -> u64 {
    1000
}

fn default_class_name() -> String {
    "default".to_string()
}

impl Default for RawPolicy {
    fn default() -> Self {
        RawPolicy {
            default_class: default_class_name(),
            class_header: None,
            class_header_trusted: false,
            api_keys: BTreeMap::new(),
            class_claim: None,
            class_from_route: false,
            queue_aging_ms: default_queue_aging_ms(),
            classes: BTreeMap::new(),
        }
    }
}

impl TryFrom<RawPolicy> for PolicyTable {
    type Error = ConfigError;

    fn try_from(raw: RawPolicy) -> Result<Self, ConfigError> {
        let mut classes = Vec::new();
        let mut raw_classes = raw.classes;
        if raw_classes.is_empty() {
            raw_classes.insert(
                raw.default_class.clone(),
                RawClass {
                    action: default_action(),
                    priority: 0,
                    preempts: Vec::new(),
                    max_wait_ms: None,
                    max_depth: None,
                    min_output_tokens: None,
                    reservation: None,
                    elastic_quantile: None,
                    elastic_min_samples: None,
                    elastic_prior_tokens: None,
                    elastic_by_prompt: None,
                },
            );
        }
        for (name, c) in &raw_classes {
            let at = |f: &str| format!("policy.classes.{name}.{f}");
            if name.is_empty() || name.len() > 64 || !name.bytes().all(is_name_byte) {
                return Err(ConfigError::new(
                    "policy.classes",
                    format!("{name:?}"),
                    "class names are 1-64 characters of [A-Za-z0-9_.-]",
                ));
            }
            let unused = |f: &str, v: bool| {
                if v {
                    Err(ConfigError::new(
                        at(f),
                        "set",
                        format!("does not apply to action \"{}\"", c.action),
                    ))
                } else {
                    Ok(())
                }
            };
            let action = match c.action.as_str() {
                "reject" => {
                    unused("max_wait_ms", c.max_wait_ms.is_some())?;
                    unused("max_depth", c.max_depth.is_some())?;
                    unused("min_output_tokens", c.min_output_tokens.is_some())?;
                    Action::Reject
                }
                "queue" => {
                    unused("min_output_tokens", c.min_output_tokens.is_some())?;
                    let max_wait_ms = c.max_wait_ms.unwrap_or(10_000);
                    let max_depth = c.max_depth.unwrap_or(64);
                    if max_wait_ms == 0 || max_wait_ms > 600_000 {
                        return Err(ConfigError::new(
                            at("max_wait_ms"),
                            max_wait_ms,
                            "must be in 1..=600000",
                        ));
                    }
                    if max_depth == 0 || max_depth > 100_000 {
                        return Err(ConfigError::new(
                            at("max_depth"),
                            max_depth,
                            "must be in 1..=100000",
                        ));
                    }
                    Action::Queue {
                        max_wait_ms,
                        max_depth,
                    }
                }
                "degrade" => {
                    unused("max_wait_ms", c.max_wait_ms.is_some())?;
                    unused("max_depth", c.max_depth.is_some())?;
                    let min_output_tokens = c.min_output_tokens.unwrap_or(16);
                    if min_output_tokens == 0 {
                        return Err(ConfigError::new(
                            at("min_output_tokens"),
                            0,
                            "must be at least 1",
                        ));
                    }
                    Action::Degrade { min_output_tokens }
                }
                other => {
                    return Err(ConfigError::new(
                        at("action"),
                        format!("{other:?}"),
                        "must be one of \"reject\", \"queue\", \"degrade\"",
                    ))
                }
            };
            for victim in &c.preempts {
                let Some(v) = raw_classes.get(victim) else {
                    return Err(ConfigError::new(
                        at("preempts"),
                        format!("{victim:?}"),
                        "names a class that is not defined",
                    ));
                };
                if v.priority >= c.priority {
                    return Err(ConfigError::new(
                        at("preempts"),
                        format!("{victim:?}"),
                        format!(
                            "may only preempt classes of lower priority ({} has {}, {name} has {})",
                            victim, v.priority, c.priority
                        ),
                    ));
                }
            }
            let raw = crate::elastic::RawReservation {
                reservation: c.reservation.as_deref(),
                quantile: c.elastic_quantile,
                min_samples: c.elastic_min_samples,
                prior_tokens: c.elastic_prior_tokens,
                by_prompt: c.elastic_by_prompt,
            };
            let reservation = crate::elastic::ElasticPolicy::from_raw(&raw, &at)?;
            classes.push(ClassPolicy {
                name: name.clone(),
                action,
                priority: c.priority,
                preempts: c.preempts.clone(),
                reservation,
            });
        }
        let Some(default_class) = classes.iter().position(|c| c.name == raw.default_class) else {
            return Err(ConfigError::new(
                "policy.default_class",
                format!("{:?}", raw.default_class),
                "must name a class defined in policy.classes",
            ));
        };
        if let Some(h) = &raw.class_header {
            if h.is_empty()
                || !h
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                return Err(ConfigError::new(
                    "policy.class_header",
                    format!("{h:?}"),
                    "must be a lowercase header name ([a-z0-9-]+)",
                ));
            }
        }
        if raw.class_header.is_some() && !raw.class_header_trusted {
            return Err(ConfigError::new(
                "policy.class_header",
                format!("{:?}", raw.class_header.as_deref().unwrap_or("")),
                "is sent by clients, who could pick any class: set policy.class_header_trusted to true only if the edge in front of kvgate sets or strips this header, or map API keys to classes with policy.api_keys",
            ));
        }
        let mut api_keys = Vec::new();
        for (digest, class) in &raw.api_keys {
            let field = format!("policy.api_keys.{digest}");
            let hex = digest
                .strip_prefix("sha256:")
                .filter(|h| h.len() == 64)
                .ok_or_else(|| {
                    ConfigError::new(
                        &field,
                        format!("{digest:?}"),
                        "keys must be \"sha256:\" and 64 hex digits of the API key's SHA-256",
                    )
                })?;
            let mut d = [0u8; 32];
            for (i, byte) in d.iter_mut().enumerate() {
                *byte = hex
                    .get(2 * i..2 * i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| ConfigError::new(&field, format!("{digest:?}"), "is not hex"))?;
            }
            if !classes.iter().any(|c| &c.name == class) {
                return Err(ConfigError::new(
                    &field,
                    format!("{class:?}"),
                    "must name a class defined in policy.classes",
                ));
            }
            api_keys.push((d, class.clone()));
        }
        let claim_path = match &raw.class_claim {
            None => None,
            Some(c) => {
                for (f, v) in [
                    ("payload_in_metadata", &c.payload_in_metadata),
                    ("claim", &c.claim),
                    ("namespace", &c.namespace),
                ] {
                    if v.is_empty() || v.len() > 128 || v.contains('\0') {
                        return Err(ConfigError::new(
                            format!("policy.class_claim.{f}"),
                            format!("{v:?}"),
                            "must be 1-128 characters without NUL",
                        ));
                    }
                }
                Some(vec![
                    "metadata".to_string(),
                    "filter_metadata".to_string(),
                    c.namespace.clone(),
                    c.payload_in_metadata.clone(),
                    c.claim.clone(),
                ])
            }
        };
        if raw.queue_aging_ms > 600_000 {
            return Err(ConfigError::new(
                "policy.queue_aging_ms",
                raw.queue_aging_ms,
                "must be in 0..=600000 (0: strict priority)",
            ));
        }
        Ok(PolicyTable {
            classes,
            default_class,
            class_header: raw.class_header,
            api_keys,
            claim_path,
            class_from_route: raw.class_from_route,
            queue_aging_ms: raw.queue_aging_ms,
        })
    }
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.'
}

impl PolicyTable {
    pub fn classes(&self) -> &[ClassPolicy] {
        &self.classes
    }

    pub fn default_class(&self) -> &ClassPolicy {
        // `default_class` is an index validated at construction; fall back to the first class.
        self.classes
            .get(self.default_class)
            .or_else(|| self.classes.first())
            .unwrap_or(&FALLBACK)
    }

    pub fn get(&self, name: &str) -> Option<&ClassPolicy> {
        self.classes.iter().find(|c| c.name == name)
    }

    /// The class of a request, given the value of the trusted class header (if configured and
    /// present). An unknown class name gets the default class.
    pub fn resolve(&self, header_value: Option<&str>) -> &ClassPolicy {
        header_value
            .and_then(|v| self.get(v.trim()))
            .unwrap_or_else(|| self.default_class())
    }

    /// The class of a request from what a client cannot forge: its API key (the `Authorization`
    /// header's bearer token) when it is mapped, else the trusted class header, else the default.
    /// The class of a request, from the first source that names a defined class: an API key,
    /// a verified JWT claim, the route, the trusted header; else the default class. Sources that
    /// are not configured are ignored whatever the request carries.
    pub fn classify(&self, src: ClassSources<'_>) -> &ClassPolicy {
        self.classify_keyed(src).0
    }

    /// As [`classify`](Self::classify), and whether the class came from a mapped API key: then
    /// the key is a verified identity (an unmapped `Authorization` is whatever the client wrote).
    pub fn classify_keyed(&self, src: ClassSources<'_>) -> (&ClassPolicy, bool) {
        if !self.api_keys.is_empty() {
            let key = src.authorization.and_then(bearer_key);
            if let Some(key) = key {
                use sha2::{Digest, Sha256};
                let d: [u8; 32] = Sha256::digest(key.as_bytes()).into();
                if let Some((_, class)) = self.api_keys.iter().find(|(k, _)| *k == d) {
                    if let Some(c) = self.get(class) {
                        return (c, true);
                    }
                }
            }
        }
        let named = [
            src.claim.filter(|_| self.claim_path.is_some()),
            src.route.filter(|_| self.class_from_route),
            src.header.filter(|_| self.class_header.is_some()),
        ];
        named
            .into_iter()
            .flatten()
            .find_map(|name| self.get(name.trim()))
            .map_or_else(|| (self.default_class(), false), |c| (c, false))
    }
}

/// The API key of an `Authorization: Bearer KEY` header (either case of `Bearer`, spaces
/// around the key dropped): one key, one spelling.
pub fn bearer_key(authorization: &str) -> Option<&str> {
    authorization
        .strip_prefix("Bearer ")
        .or_else(|| authorization.strip_prefix("bearer "))
        .map(str::trim)
}

static FALLBACK: ClassPolicy = ClassPolicy {
    name: String::new(),
    action: Action::Reject,
    priority: 0,
    preempts: Vec::new(),
    reservation: Reservation::WorstCase,
};

#[cfg(test)]
mod api_key_tests {
    use super::*;

    fn table(json: &str) -> Result<PolicyTable, ConfigError> {
        PolicyTable::try_from(serde_json::from_str::<RawPolicy>(json).unwrap())
    }

    #[test]
    fn api_keys_pick_the_class_and_nothing_else_does() {
        // sha256("secret-vip-key"), computed independently with Python's hashlib.
        let t = table(
            r#"{"default_class":"std","api_keys":{"sha256:1c1dc3f48bd50128ffcd52793409d4ca7b7605ef76f9d12e18f6ab9d4a106d97":"vip"},
                "classes":{"std":{},"vip":{"priority":9}}}"#,
        )
        .unwrap();
        assert_eq!(t.classify(auth("Bearer secret-vip-key")).name, "vip");
        assert_eq!(t.classify(auth("Bearer wrong")).name, "std");
        assert_eq!(
            t.classify(header("vip")).name,
            "std",
            "no trusted header: ignored"
        );
        let e = table(r#"{"api_keys":{"sha256:00":"default"}}"#).unwrap_err();
        assert_eq!(e.field, "policy.api_keys.sha256:00");
        let e = table(&format!(
            r#"{{"api_keys":{{"sha256:{}":"nope"}}}}"#,
            "0".repeat(64)
        ))
        .unwrap_err();
        assert!(e.to_string().contains("must name a class"), "{e}");
    }

    #[test]
    fn a_trusted_header_picks_the_class() {
        let t = table(
            r#"{"default_class":"std","class_header":"x-tenant-class","class_header_trusted":true,
                "classes":{"std":{},"vip":{}}}"#,
        )
        .unwrap();
        assert_eq!(t.classify(header("vip")).name, "vip");
        assert_eq!(t.classify(header("nope")).name, "std");
    }

    fn auth(a: &str) -> ClassSources<'_> {
        ClassSources {
            authorization: Some(a),
            ..Default::default()
        }
    }

    fn header(h: &str) -> ClassSources<'_> {
        ClassSources {
            header: Some(h),
            ..Default::default()
        }
    }

    #[test]
    fn a_verified_claim_and_the_route_pick_the_class_only_when_configured() {
        let classes = r#""classes":{"std":{},"batch":{},"vip":{"priority":9}}"#;
        let both = table(&format!(
            r#"{{"default_class":"std","class_claim":{{"payload_in_metadata":"jwt_payload","claim":"tier"}},
                "class_from_route":true,{classes}}}"#
        ))
        .unwrap();
        assert_eq!(
            both.claim_path.as_deref().unwrap(),
            [
                "metadata",
                "filter_metadata",
                "envoy.filters.http.jwt_authn",
                "jwt_payload",
                "tier"
            ]
        );
        let src = ClassSources {
            claim: Some("vip"),
            route: Some("batch"),
            ..Default::default()
        };
        // The claim first, then the route; a claim naming no class falls through to the route.
        assert_eq!(both.classify(src).name, "vip");
        let unknown = ClassSources {
            claim: Some("gold"),
            ..src
        };
        assert_eq!(both.classify(unknown).name, "batch");
        // Neither configured: whatever the request carried, the default class.
        let neither = table(&format!(r#"{{"default_class":"std",{classes}}}"#)).unwrap();
        assert_eq!(neither.classify(src).name, "std");
        let e = table(r#"{"class_claim":{"payload_in_metadata":"","claim":"tier"}}"#).unwrap_err();
        assert_eq!(e.field, "policy.class_claim.payload_in_metadata");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<PolicyTable, ConfigError> {
        let raw: RawPolicy = serde_json::from_str(json).unwrap();
        PolicyTable::try_from(raw)
    }

    #[test]
    fn elastic_classes_parse_and_bad_values_name_their_field() {
        let t = parse(
            r#"{"classes":{"default":{},"batch":{"reservation":"elastic","elastic_quantile":0.95,"elastic_prior_tokens":128}}}"#,
        )
        .unwrap();
        assert_eq!(
            t.get("default").unwrap().reservation,
            Reservation::WorstCase
        );
        let Reservation::Elastic(e) = t.get("batch").unwrap().reservation else {
            panic!("batch is elastic")
        };
        assert_eq!(
            (
                e.quantile_permille,
                e.min_samples,
                e.prior_tokens,
                e.by_prompt
            ),
            (950, 20, Some(128), false)
        );
        let t =
            parse(r#"{"classes":{"default":{"reservation":"elastic","elastic_by_prompt":true}}}"#)
                .unwrap();
        assert!(matches!(
            t.get("default").unwrap().reservation,
            Reservation::Elastic(crate::elastic::ElasticPolicy {
                by_prompt: true,
                ..
            })
        ));
        for (doc, field) in [
            (
                r#"{"classes":{"default":{"elastic_by_prompt":true}}}"#,
                "policy.classes.default.elastic_by_prompt",
            ),
            (
                r#"{"classes":{"default":{"reservation":"maybe"}}}"#,
                "policy.classes.default.reservation",
            ),
            (
                r#"{"classes":{"default":{"elastic_quantile":0.9}}}"#,
                "policy.classes.default.elastic_quantile",
            ),
            (
                r#"{"classes":{"default":{"reservation":"elastic","elastic_quantile":0.2}}}"#,
                "policy.classes.default.elastic_quantile",
            ),
            (
                r#"{"classes":{"default":{"reservation":"elastic","elastic_min_samples":0}}}"#,
                "policy.classes.default.elastic_min_samples",
            ),
            (
                r#"{"classes":{"default":{"reservation":"elastic","elastic_prior_tokens":0}}}"#,
                "policy.classes.default.elastic_prior_tokens",
            ),
        ] {
            assert_eq!(parse(doc).unwrap_err().field, field, "{doc}");
        }
    }

    #[test]
    fn empty_policy_is_one_reject_class() {
        let t = parse("{}").unwrap();
        assert_eq!(t.default_class().name, "default");
        assert_eq!(t.default_class().action, Action::Reject);
        assert_eq!(t.resolve(Some("anything")).name, "default");
    }

    #[test]
    fn full_table() {
        let t = parse(
            r#"{"default_class":"batch","class_header":"x-tenant-class","class_header_trusted":true,"classes":{
                "interactive":{"action":"queue","priority":10,"max_wait_ms":2000,"max_depth":8,"preempts":["batch"]},
                "batch":{"action":"degrade","min_output_tokens":32},
                "strict":{}}}"#,
        )
        .unwrap();
        assert_eq!(t.resolve(None).name, "batch");
        let i = t.resolve(Some("interactive"));
        assert_eq!(
            i.action,
            Action::Queue {
                max_wait_ms: 2000,
                max_depth: 8
            }
        );
        assert_eq!(i.preempts, vec!["batch".to_string()]);
        assert_eq!(t.resolve(Some("strict")).action, Action::Reject);
        assert_eq!(
            t.resolve(Some("batch")).action,
            Action::Degrade {
                min_output_tokens: 32
            }
        );
    }

    #[test]
    fn errors_name_field_value_rule() {
        let e = parse(r#"{"classes":{"default":{"action":"drop"}}}"#).unwrap_err();
        assert_eq!(e.field, "policy.classes.default.action");
        assert_eq!(e.value, "\"drop\"");
        let e = parse(r#"{"default_class":"x","classes":{"default":{}}}"#).unwrap_err();
        assert_eq!(e.field, "policy.default_class");
        let e = parse(r#"{"classes":{"default":{"preempts":["ghost"]}}}"#).unwrap_err();
        assert_eq!(e.field, "policy.classes.default.preempts");
        let e =
            parse(r#"{"classes":{"default":{"priority":1,"preempts":["b"]},"b":{"priority":1}}}"#)
                .unwrap_err();
        assert!(e.rule.contains("lower priority"));
        let e = parse(r#"{"classes":{"default":{"action":"reject","max_depth":3}}}"#).unwrap_err();
        assert_eq!(e.field, "policy.classes.default.max_depth");
        let e = parse(r#"{"classes":{"default":{"action":"queue","max_wait_ms":0}}}"#).unwrap_err();
        assert_eq!(e.value, "0");
        let e = parse(r#"{"class_header":"X-Class","class_header_trusted":true}"#).unwrap_err();
        assert_eq!(e.field, "policy.class_header");
        // A header clients send is not trusted unless the operator says so.
        let e = parse(r#"{"class_header":"x-class"}"#).unwrap_err();
        assert_eq!(e.field, "policy.class_header");
        assert!(e.to_string().contains("class_header_trusted"), "{e}");
        assert!(serde_json::from_str::<RawPolicy>(r#"{"clases":{}}"#).is_err());
        let e = parse(r#"{"queue_aging_ms":600001}"#).unwrap_err();
        assert_eq!(e.field, "policy.queue_aging_ms");
        assert_eq!(e.value, "600001");
        assert_eq!(parse(r#"{"queue_aging_ms":0}"#).unwrap().queue_aging_ms, 0);
        assert_eq!(parse("{}").unwrap().queue_aging_ms, 1000);
    }
}

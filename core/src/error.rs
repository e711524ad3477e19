//! Errors: configuration errors that name the field, the value and the rule, and the API errors a
//! client sees, rendered as OpenAI-style JSON bodies with the right HTTP status.

use std::fmt;

/// A configuration value that breaks a rule. Rendered as one log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub value: String,
    pub rule: String,
}

impl ConfigError {
    pub fn new(
        field: impl Into<String>,
        value: impl fmt::Display,
        rule: impl Into<String>,
    ) -> Self {
        ConfigError {
            field: field.into(),
            value: value.to_string(),
            rule: rule.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid config: field `{}` = {}: {}",
            self.field, self.value, self.rule
        )
    }
}

impl std::error::Error for ConfigError {}

/// Declares `ErrorKind` and `ErrorKind::ALL` from one list, so no kind can be left out of `ALL`.
macro_rules! error_kinds {
    ($($(#[$doc:meta])* $kind:ident,)*) => {
        /// The kind of an API error. `code()` is the stable string used in the JSON body *and* as
        /// the metric label, so the two never disagree.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorKind {
            $($(#[$doc])* $kind,)*
        }

        impl ErrorKind {
            /// Every kind, in declaration order: the filter defines a `rejected.<code>` counter
            /// for each.
            pub const ALL: &'static [ErrorKind] = &[$(ErrorKind::$kind,)*];
        }
    };
}

error_kinds! {
    /// Body is not JSON, or a field has the wrong type or value.
    InvalidRequest,
    /// The body is larger than the configured limit.
    BodyTooLarge,
    /// The prompt leaves no room for output in the model's context.
    ContextLengthExceeded,
    /// The request alone is larger than the whole usable KV budget: retrying cannot help.
    KvRequestTooLarge,
    /// The KV budget is spent for now: retry after the given time.
    KvCapacityExceeded,
    /// The request waited in the admission queue past its class's limit.
    QueueTimeout,
    /// The admission queue of the request's class is full.
    QueueFull,
    /// The request was cancelled to make room for a higher class.
    Preempted,
    /// The requested model is not served here.
    ModelNotFound,
    /// A call only the gateway may make, without the gateway's credential.
    Unauthorized,
    /// The model server is known to be down or hung: nothing is sent to it.
    BackendUnavailable,
    /// The method is not allowed on this path (the OpenAI paths take POST).
    MethodNotAllowed,
    /// A path not served to this caller (the backend's admission API, through the gateway).
    NotFound,
    /// The admission ledger cannot be read (corrupt, or written by an unknown version). Admission
    /// stops rather than forget live leases. Nothing was reserved.
    LedgerUnavailable,
    /// The backend ran out of KV cache mid-decode and stopped the generation (a backend that
    /// admits without reserving: `--admission none`).
    KvCacheExhausted,
    /// An internal failure (a host call failed). Nothing was reserved.
    Internal,
    /// The lease id drawn for a request is already live in the ledger: nothing was reserved
    /// or recorded (503, retry). A kind of its own, so that shadow mode tells "not recorded" from
    /// every other refusal by its kind.
    LeaseIdTaken,
}

impl ErrorKind {
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::BodyTooLarge => "request_body_too_large",
            ErrorKind::ContextLengthExceeded => "context_length_exceeded",
            ErrorKind::KvRequestTooLarge => "kv_request_too_large",
            ErrorKind::KvCapacityExceeded => "kv_capacity_exceeded",
            ErrorKind::QueueTimeout => "kv_queue_timeout",
            ErrorKind::QueueFull => "kv_queue_full",
            ErrorKind::Preempted => "kv_preempted",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::LedgerUnavailable => "kvgate_ledger_unavailable",
            ErrorKind::BackendUnavailable => "backend_unavailable",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::NotFound => "not_found",
            ErrorKind::KvCacheExhausted => "kv_cache_exhausted",
            ErrorKind::Internal => "kvgate_internal_error",
            ErrorKind::LeaseIdTaken => "kvgate_lease_id_conflict",
        }
    }

    /// The OpenAI `type` field.
    pub fn error_type(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest
            | ErrorKind::BodyTooLarge
            | ErrorKind::ContextLengthExceeded
            | ErrorKind::KvRequestTooLarge
            | ErrorKind::ModelNotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::NotFound => "invalid_request_error",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::KvCapacityExceeded | ErrorKind::QueueTimeout | ErrorKind::QueueFull => {
                "rate_limit_error"
            }
            ErrorKind::Preempted
            | ErrorKind::LedgerUnavailable
            | ErrorKind::BackendUnavailable
            | ErrorKind::KvCacheExhausted
            | ErrorKind::Internal
            | ErrorKind::LeaseIdTaken => "server_error",
        }
    }

    pub fn default_status(self) -> u32 {
        match self {
            ErrorKind::InvalidRequest => 400,
            ErrorKind::BodyTooLarge
            | ErrorKind::ContextLengthExceeded
            | ErrorKind::KvRequestTooLarge => 413,
            ErrorKind::KvCapacityExceeded | ErrorKind::QueueTimeout | ErrorKind::QueueFull => 429,
            ErrorKind::Preempted
            | ErrorKind::LedgerUnavailable
            | ErrorKind::BackendUnavailable
            | ErrorKind::KvCacheExhausted
            | ErrorKind::LeaseIdTaken => 503,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::Unauthorized => 401,
            ErrorKind::ModelNotFound | ErrorKind::NotFound => 404,
            ErrorKind::Internal => 500,
        }
    }
}

/// An error a client sees. `param` names the offending request field where there is one.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub status: u32,
    pub message: String,
    pub param: Option<String>,
    /// Extra members of the `error` object (e.g. need/free bytes on a 429).
    pub extra: Vec<(&'static str, serde_json::Value)>,
    /// Retry hint in milliseconds; becomes `retry-after` / `retry-after-ms` headers.
    pub retry_after_ms: Option<u64>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            status: kind.default_status(),
            message: message.into(),
            param: None,
            extra: Vec::new(),
            retry_after_ms: None,
        }
    }

    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError::new(ErrorKind::InvalidRequest, message).with_param(param)
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn with_status(mut self, status: u32) -> Self {
        self.status = status;
        self
    }

    pub fn with_extra(mut self, key: &'static str, value: impl Into<serde_json::Value>) -> Self {
        self.extra.push((key, value.into()));
        self
    }

    pub fn with_retry_after_ms(mut self, ms: u64) -> Self {
        self.retry_after_ms = Some(ms);
        self
    }

    /// `Retry-After` in whole seconds, rounded up so a client never comes back early.
    pub fn retry_after_seconds(&self) -> Option<u64> {
        self.retry_after_ms.map(|ms| ms.div_ceil(1000))
    }

    /// The OpenAI-style JSON body: `{"error": {"message", "type", "param", "code", ...}}`.
    pub fn body(&self) -> String {
        let mut err = serde_json::Map::new();
        err.insert("message".into(), self.message.clone().into());
        err.insert("type".into(), self.kind.error_type().into());
        err.insert(
            "param".into(),
            self.param
                .clone()
                .map_or(serde_json::Value::Null, serde_json::Value::from),
        );
        err.insert("code".into(), self.kind.code().into());
        if let Some(s) = self.retry_after_seconds() {
            err.insert("retry_after_seconds".into(), s.into());
        }
        for (k, v) in &self.extra {
            err.insert((*k).into(), v.clone());
        }
        let mut root = serde_json::Map::new();
        root.insert("error".into(), serde_json::Value::Object(err));
        serde_json::Value::Object(root).to_string()
    }

    /// Response headers that go with the body.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![("content-type", "application/json".to_string())];
        if let (Some(ms), Some(s)) = (self.retry_after_ms, self.retry_after_seconds()) {
            h.push(("retry-after", s.to_string()));
            h.push(("retry-after-ms", ms.to_string()));
        }
        h
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status,
            self.kind.code(),
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

/// A client's value as an error message quotes it: at most 128 characters, then `…`. An error
/// never echoes a huge field back in full.
pub fn clip(value: &str) -> String {
    match value.char_indices().nth(128) {
        Some((at, _)) => format!("{}…", value.get(..at).unwrap_or_default()),
        None => value.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_own_code() {
        let codes: std::collections::HashSet<&str> =
            ErrorKind::ALL.iter().map(|k| k.code()).collect();
        assert_eq!(codes.len(), ErrorKind::ALL.len(), "codes are distinct");
    }

    #[test]
    fn body_is_openai_shaped() {
        let e = ApiError::new(ErrorKind::KvCapacityExceeded, "full")
            .with_extra("need_bytes", 10u64)
            .with_retry_after_ms(1500);
        let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
        assert_eq!(v["error"]["code"], "kv_capacity_exceeded");
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["need_bytes"], 10);
        assert_eq!(v["error"]["retry_after_seconds"], 2);
        assert!(v["error"]["param"].is_null());
        assert_eq!(e.status, 429);
        let h = e.headers();
        assert!(h.contains(&("retry-after", "2".to_string())));
        assert!(h.contains(&("retry-after-ms", "1500".to_string())));
    }

    #[test]
    fn config_error_names_field_value_rule() {
        let e = ConfigError::new("safety_fraction", 1.5, "must be in (0, 1]");
        assert_eq!(
            e.to_string(),
            "invalid config: field `safety_fraction` = 1.5: must be in (0, 1]"
        );
    }
}

//! What the served model accepts, checked the same way at the gateway and in the backend.
//!
//! `parse_request` reads the fields that price a request; this module checks everything else a
//! server would refuse (sampling parameters, unsupported features, unknown model, token ids past
//! the vocabulary, an empty prompt), so the gateway refuses exactly what the backend would,
//! *before* reserving anything. Unsupported features are refused with a 400 naming the field,
//! never silently dropped. Pure: no I/O, never panics.

use serde_json::{Map, Value};

use crate::error::{ApiError, ErrorKind};
use crate::request::{describe, Input, ParsedRequest, PromptItem};

/// What the server behind the gateway serves. Unknown parts (`None`) are not checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The model name clients must send (when they send one).
    pub model: Option<String>,
    /// Token ids must be below this.
    pub vocab: Option<u64>,
    /// Most choices (`n`, `best_of`) per request.
    pub max_choices: u64,
    /// Several prompts in one completions request.
    pub batched_prompts: bool,
}

impl Default for Served {
    /// Nothing known: only the request's own shape is checked.
    fn default() -> Self {
        Served {
            model: None,
            vocab: None,
            max_choices: crate::request::MAX_CHOICES,
            batched_prompts: true,
        }
    }
}

/// The sampling parameters of a valid request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub include_usage: bool,
}

/// Features this server does not implement. Sending one with a non-empty value is a 400 naming
/// it: silently ignoring `tools` or `response_format` would hand the client an answer it did
/// not ask for.
const UNSUPPORTED: &[&str] = &[
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "suffix",
    "echo",
    "audio",
    "modalities",
    "prediction",
    // vLLM's extensions that change the rendered prompt: neither served here nor priceable by
    // a gateway in front of a server that takes them.
    "documents",
    "chat_template",
    "chat_template_kwargs",
];

pub const ROLES: &[&str] = &["system", "developer", "user", "assistant"];

/// The longest stop string accepted, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;

/// The most stop strings accepted, as OpenAI's API.
pub const MAX_STOPS: usize = 4;

/// Values of `field` that ask for nothing: `null`, `false`, `0`, `""`, `[]`, `{}`, and the
/// defaults spelled out (`response_format: {"type": "text"}`, `modalities: ["text"]`).
fn asks_nothing(field: &str, v: &Value) -> bool {
    let default = match field {
        "response_format" => v
            .as_object()
            .is_some_and(|o| o.len() == 1 && o.get("type").and_then(Value::as_str) == Some("text")),
        "modalities" => v
            .as_array()
            .is_some_and(|a| a.iter().all(|m| m.as_str() == Some("text"))),
        _ => false,
    };
    default
        || match v {
            Value::Null => true,
            Value::Bool(b) => !b,
            Value::Number(n) => n.as_f64() == Some(0.0),
            Value::String(s) => s.is_empty(),
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
        }
}

/// Check a parsed request against what is served. `obj` is the request's JSON object.
pub fn validate(
    req: &ParsedRequest,
    obj: &Map<String, Value>,
    served: &Served,
) -> Result<Sampling, ApiError> {
    for field in UNSUPPORTED {
        if obj.get(*field).is_some_and(|v| !asks_nothing(field, v)) {
            return Err(ApiError::invalid(
                field,
                format!("'{field}' is not supported by this server."),
            ));
        }
    }
    if let (Some(want), Some(got)) = (&served.model, &req.model) {
        if want != got {
            return Err(ApiError::new(
                ErrorKind::ModelNotFound,
                format!("The model `{got}` does not exist. This server serves `{want}`."),
            )
            .with_param("model"));
        }
    }
    if req.choices() > served.max_choices {
        return Err(ApiError::invalid(
            "n",
            format!(
                "This server returns at most {} choice(s) per request (n, best_of); send one request per choice.",
                served.max_choices
            ),
        ));
    }
    match &req.input {
        Input::Prompts(items) => {
            if items.len() > 1 && !served.batched_prompts {
                return Err(ApiError::invalid(
                    "prompt",
                    "Batched prompts are not supported by this server; send one prompt per request.",
                ));
            }
            if items.is_empty()
                || items.iter().any(|i| match i {
                    PromptItem::Text(t) => t.is_empty(),
                    PromptItem::Tokens(n) => *n == 0,
                })
            {
                return Err(ApiError::invalid("prompt", "The prompt is empty."));
            }
            if let Some(vocab) = served.vocab {
                check_token_ids(obj.get("prompt"), vocab)?;
            }
        }
        Input::Chat(messages) => {
            for (i, m) in messages.iter().enumerate() {
                if !ROLES.contains(&m.role.as_str()) {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].role"),
                        format!(
                            "'{}' is not a supported role; use one of {}.",
                            m.role,
                            ROLES.join(", ")
                        ),
                    ));
                }
            }
        }
    }
    let num = |field: &str, default: f64, lo: f64, hi: f64| -> Result<f64, ApiError> {
        match obj.get(field) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(v) if (lo..=hi).contains(&v) => Ok(v),
                _ => Err(ApiError::invalid(
                    field,
                    format!("'{field}' must be between {lo} and {hi}, got {n}."),
                )),
            },
            Some(v) => Err(ApiError::invalid(
                field,
                format!("'{field}' must be a number, got {}.", describe(v)),
            )),
        }
    };
    let temperature = num("temperature", 1.0, 0.0, 2.0)? as f32;
    let top_p = num("top_p", 1.0, 0.0, 1.0)? as f32;
    if top_p <= 0.0 {
        return Err(ApiError::invalid(
            "top_p",
            "'top_p' must be greater than 0.",
        ));
    }
    for field in ["presence_penalty", "frequency_penalty"] {
        if num(field, 0.0, -2.0, 2.0)? != 0.0 {
            return Err(ApiError::invalid(
                field,
                format!("'{field}' other than 0 is not supported by this server."),
            ));
        }
    }
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .map(|s| s as u64)
                .or_else(|| v.as_u64())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "seed",
                        format!(
                            "'seed' must be an integer that fits in 64 bits, got {}.",
                            describe(v)
                        ),
                    )
                })?,
        ),
    };
    let stop_rule = format!("'stop' must be a string or an array of at most {MAX_STOPS} strings");
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() > MAX_STOPS => {
            return Err(ApiError::invalid(
                "stop",
                format!("{stop_rule}, got an array of {}.", a.len()),
            ))
        }
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, s)| match s {
                Value::String(s) => Ok(s.clone()),
                other => Err(ApiError::invalid(
                    "stop",
                    format!("{stop_rule}; stop[{i}] is {}.", describe(other)),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!("{stop_rule}, got {}.", describe(other)),
            ))
        }
    };
    // The server looks for every stop string in the output after every token: their length is
    // work per token for the whole batch.
    if let Some((i, s)) = stop
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_BYTES)
    {
        let which = if obj.get("stop").is_some_and(Value::is_array) {
            format!("stop[{i}]")
        } else {
            "'stop'".to_string()
        };
        return Err(ApiError::invalid(
            "stop",
            format!(
                "Each stop string must be at most {MAX_STOP_BYTES} bytes; {which} has {} bytes.",
                s.len()
            ),
        ));
    }
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::invalid(
                    "stream_options.include_usage",
                    format!(
                        "'stream_options.include_usage' must be a boolean, got {}.",
                        describe(v)
                    ),
                ))
            }
        },
        Some(v) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("'stream_options' must be an object, got {}.", describe(v)),
            ))
        }
    };
    match obj.get("user") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(v) => {
            return Err(ApiError::invalid(
                "user",
                format!("'user' must be a string, got {}.", describe(v)),
            ))
        }
    }
    Ok(Sampling {
        temperature,
        top_p,
        seed,
        stop,
        include_usage,
    })
}

/// Token ids in a pre-tokenized prompt (`[1, 2]` or `[[1, 2], [3]]`) must be in the vocabulary.
fn check_token_ids(prompt: Option<&Value>, vocab: u64) -> Result<(), ApiError> {
    let Some(Value::Array(outer)) = prompt else {
        return Ok(());
    };
    let ids = outer.iter().flat_map(|v| match v {
        Value::Array(inner) => inner.iter().collect::<Vec<_>>(),
        other => vec![other],
    });
    for id in ids {
        if let Some(n) = id.as_u64().filter(|n| *n >= vocab) {
            return Err(ApiError::invalid(
                "prompt",
                format!("Token id {n} is outside the vocabulary of {vocab} tokens."),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse_request, Endpoint};

    fn served() -> Served {
        Served {
            model: Some("m".into()),
            vocab: Some(100),
            max_choices: 1,
            batched_prompts: false,
        }
    }

    fn check(endpoint: Endpoint, body: &str) -> Result<Sampling, ApiError> {
        let (req, obj) = parse_request(endpoint, body.as_bytes())?;
        validate(&req, &obj, &served())
    }

    fn refused(endpoint: Endpoint, body: &str) -> (u32, String) {
        match check(endpoint, body) {
            Err(e) => (e.status, e.param.clone().unwrap_or_default()),
            Ok(s) => panic!("accepted {body}: {s:?}"),
        }
    }

    #[test]
    fn what_the_backend_refuses_is_refused_naming_the_field() {
        use Endpoint::*;
        let cases: &[(Endpoint, &str, u32, &str)] = &[
            (
                Completions,
                r#"{"prompt":"hi","temperature":"hot"}"#,
                400,
                "temperature",
            ),
            (
                Completions,
                r#"{"prompt":"hi","temperature":2.5}"#,
                400,
                "temperature",
            ),
            (Completions, r#"{"prompt":"hi","top_p":7}"#, 400, "top_p"),
            (Completions, r#"{"prompt":"hi","top_p":0}"#, 400, "top_p"),
            (Completions, r#"{"prompt":"hi","stop":5}"#, 400, "stop"),
            (
                Completions,
                r#"{"prompt":"hi","stop":["a","b","c","d","e"]}"#,
                400,
                "stop",
            ),
            (Completions, r#"{"prompt":"hi","seed":1.5}"#, 400, "seed"),
            (Completions, r#"{"prompt":""}"#, 400, "prompt"),
            (Completions, r#"{"prompt":[]}"#, 400, "prompt"),
            (Completions, r#"{"prompt":[1,2,100]}"#, 400, "prompt"),
            (Completions, r#"{"prompt":[[1],[2,1000]]}"#, 400, "prompt"),
            (Completions, r#"{"prompt":["a","b"]}"#, 400, "prompt"),
            (
                Completions,
                r#"{"prompt":"hi","model":"other"}"#,
                404,
                "model",
            ),
            (Completions, r#"{"prompt":"hi","n":2}"#, 400, "n"),
            (
                Completions,
                r#"{"prompt":"hi","logprobs":"x"}"#,
                400,
                "logprobs",
            ),
            (
                Completions,
                r#"{"prompt":"hi","stream_options":5}"#,
                400,
                "stream_options",
            ),
            (
                Completions,
                r#"{"prompt":"hi","presence_penalty":1}"#,
                400,
                "presence_penalty",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#,
                400,
                "tools",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"auto"}"#,
                400,
                "tool_choice",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"functions":[{}]}"#,
                400,
                "functions",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"response_format":5}"#,
                400,
                "response_format",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}"#,
                400,
                "response_format",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"modalities":["text","audio"]}"#,
                400,
                "modalities",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"documents":[{"text":"long"}]}"#,
                400,
                "documents",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":1}}"#,
                400,
                "chat_template_kwargs",
            ),
            (
                ChatCompletions,
                r#"{"messages":[{"role":"alien","content":"x"}]}"#,
                400,
                "messages[0].role",
            ),
        ];
        for (endpoint, body, status, field) in cases {
            assert_eq!(
                refused(*endpoint, body),
                (*status, field.to_string()),
                "{body}"
            );
        }
        // A stop string past the limit (searched for after every token); one at it is served.
        let stop = |n: usize| format!(r#"{{"prompt":"hi","stop":["{}"]}}"#, "y".repeat(n));
        assert_eq!(
            refused(Endpoint::Completions, &stop(MAX_STOP_BYTES + 1)),
            (400, "stop".to_string())
        );
        assert!(check(Endpoint::Completions, &stop(MAX_STOP_BYTES)).is_ok());
    }

    #[test]
    fn refusals_say_what_was_sent() {
        let msg = |body: &str| match check(Endpoint::Completions, body) {
            Err(e) => e.message,
            Ok(s) => panic!("accepted {body}: {s:?}"),
        };
        for (body, want) in [
            (
                r#"{"prompt":"hi","temperature":"hot"}"#,
                r#"got a string: "hot""#,
            ),
            (r#"{"prompt":"hi","top_p":[1]}"#, "got an array: [1]"),
            (r#"{"prompt":"hi","seed":1.5}"#, "got a number: 1.5"),
            (r#"{"prompt":"hi","seed":"7"}"#, r#"got a string: "7""#),
            (r#"{"prompt":"hi","user":5}"#, "got an integer: 5"),
            (
                r#"{"prompt":"hi","user":{"id":"u1"}}"#,
                r#"got an object: {"id":"u1"}"#,
            ),
            (r#"{"prompt":"hi","stop":5}"#, "got an integer: 5"),
            (
                r#"{"prompt":"hi","stop":["a","b","c","d","e"]}"#,
                "got an array of 5",
            ),
            (
                r#"{"prompt":"hi","stop":["a",7]}"#,
                "stop[1] is an integer: 7",
            ),
        ] {
            let m = msg(body);
            assert!(m.contains(want), "{body}: {m}");
        }
        // Which stop string is too long, and by how much.
        let long = "y".repeat(MAX_STOP_BYTES + 1);
        let m = msg(&format!(r#"{{"prompt":"hi","stop":["a","{long}"]}}"#));
        assert!(m.contains("stop[1] has 1025 bytes"), "{m}");
        let m = msg(&format!(r#"{{"prompt":"hi","stop":"{long}"}}"#));
        assert!(m.contains("'stop' has 1025 bytes"), "{m}");
        // Long client text is cut: never more than 64 bytes of it, on a character boundary.
        let m = msg(&format!(
            r#"{{"prompt":"hi","user":["{}"]}}"#,
            "é".repeat(10_000)
        ));
        assert!(m.contains("got an array: [\"éé"), "{m}");
        assert!(m.contains('…') && m.matches('é').count() <= 32, "{m}");
    }

    #[test]
    fn what_is_served_is_accepted() {
        let s = check(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"x"}],
                "temperature":0,"top_p":0.5,"seed":-3,"stop":["\n"],"stream_options":{"include_usage":true},
                "tools":[],"logprobs":false,"presence_penalty":0,"user":"u1",
                "response_format":{"type":"text"},"modalities":["text"]}"#,
        )
        .unwrap();
        assert_eq!((s.temperature, s.top_p), (0.0, 0.5));
        assert_eq!(s.seed, Some(-3i64 as u64));
        assert_eq!(s.stop, vec!["\n".to_string()]);
        assert!(s.include_usage);
        let d = check(Endpoint::Completions, r#"{"prompt":[1,2,99]}"#).unwrap();
        assert_eq!((d.temperature, d.top_p, d.seed), (1.0, 1.0, None));
        // Nothing known about the server: its model name and vocabulary are not checked.
        let (req, obj) = parse_request(
            Endpoint::Completions,
            br#"{"prompt":[5000],"model":"x","n":2}"#,
        )
        .unwrap();
        assert!(validate(&req, &obj, &Served::default()).is_ok());
    }
}

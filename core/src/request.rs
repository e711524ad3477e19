//! OpenAI-style request parsing: a body becomes a validated `ParsedRequest` before admission.
//!
//! Only what pricing needs is validated here (prompt or messages, caps, `n`, `best_of`, `stream`);
//! every other field is passed through untouched. Errors name the field, the rule and the value,
//! and map to 400 with an OpenAI-style body.

use serde_json::{Map, Value};

use crate::error::{ApiError, ErrorKind};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    /// The endpoint for a request path (query string ignored), if it is one we price.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        let path = path.split('?').next().unwrap_or(path);
        match path.trim_end_matches('/') {
            p if p.ends_with("/chat/completions") => Some(Endpoint::ChatCompletions),
            p if p.ends_with("/completions") => Some(Endpoint::Completions),
            _ => None,
        }
    }
}

/// One prompt of a completions request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptItem {
    Text(String),
    /// A pre-tokenized prompt: counted exactly, without the tokenizer.
    Tokens(u64),
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatMessage {
    pub role: String,
    /// Text content; content parts are joined and tool calls serialized (what a chat template
    /// renders).
    pub content: String,
    /// The message's other non-empty fields (`name`, …), as `\n{key}: {value}` each: counted
    /// on top of the rendered chat, since a server's template may render them (vLLM passes
    /// them to it), and not rendered by kvgate-backend's own template.
    pub extra: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Prompts(Vec<PromptItem>),
    Chat(Vec<ChatMessage>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub input: Input,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub n: u64,
    pub best_of: Option<u64>,
    pub stream: bool,
}

/// Upper bound on `n` and `best_of`, as OpenAI's API.
pub const MAX_CHOICES: u64 = 128;

impl ParsedRequest {
    /// The request field that holds the prompt: what an error about its length names.
    pub fn prompt_field(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Completions => "prompt",
            Endpoint::ChatCompletions => "messages",
        }
    }

    /// The output cap the client asked for: the stricter of the two cap fields.
    pub fn requested_cap(&self) -> Option<u64> {
        match (self.max_tokens, self.max_completion_tokens) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Sequences decoded per prompt: `max(n, best_of)`.
    pub fn choices(&self) -> u64 {
        self.best_of.unwrap_or(1).max(self.n)
    }
}

/// The most JSON objects and arrays a body may hold. Parsed, each costs a tree node of some
/// hundreds of bytes (a 4 MiB body of `{"a":0}` grew a wasm VM, whose memory never shrinks, by
/// about 100 MB); every request that fits a context holds far fewer.
pub const MAX_JSON_CONTAINERS: usize = 16_384;

/// The most values a body may list (commas, outside strings): a parsed value is a few tens of
/// bytes, so a 4 MiB body of `0,0,…` would cost some 50 MB. A prompt of token ids for a
/// million-token context still fits.
pub const MAX_JSON_VALUES: usize = 1 << 20;

/// Refuse a body with more than [`MAX_JSON_CONTAINERS`] objects and arrays, or more than
/// [`MAX_JSON_VALUES`] values, before it is parsed into a tree: one pass over its bytes,
/// nothing allocated.
fn bound_containers(body: &[u8]) -> Result<(), ApiError> {
    let (mut in_string, mut escaped, mut containers, mut commas) = (false, false, 0usize, 0usize);
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'{' | b'[' => containers += 1,
                b',' => commas += 1,
                _ => {}
            }
        }
    }
    if commas > MAX_JSON_VALUES {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "The request body lists more than {MAX_JSON_VALUES} JSON values ({commas} commas)."
            ),
        ));
    }
    if containers > MAX_JSON_CONTAINERS {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "The request body holds {containers} JSON objects and arrays; the gateway accepts \
                 at most {MAX_JSON_CONTAINERS}."
            ),
        ));
    }
    Ok(())
}

/// Parse a body. Returns the validated request and the JSON object (kept for rewriting the cap).
pub fn parse_request(
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(ParsedRequest, Map<String, Value>), ApiError> {
    bound_containers(body)?;
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("We could not parse the JSON body of your request: {e}"),
        )
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "The request body must be a JSON object, got {}.",
                type_name(&value)
            ),
        ));
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(wrong_type("model", "a string", v)),
    };
    let input = match endpoint {
        Endpoint::Completions => Input::Prompts(parse_prompt(obj.get("prompt"))?),
        Endpoint::ChatCompletions => Input::Chat(parse_messages(obj.get("messages"))?),
    };
    let max_tokens = opt_count(&obj, "max_tokens", 1)?;
    let max_completion_tokens = opt_count(&obj, "max_completion_tokens", 1)?;
    let n = opt_count(&obj, "n", 1)?.unwrap_or(1);
    let best_of = opt_count(&obj, "best_of", 1)?;
    for (field, v) in [("n", Some(n)), ("best_of", best_of)] {
        if let Some(v) = v.filter(|v| *v > MAX_CHOICES) {
            return Err(ApiError::invalid(
                field,
                format!("'{field}' must be at most {MAX_CHOICES}, got {v}."),
            ));
        }
    }
    if let Some(b) = best_of.filter(|b| *b < n) {
        return Err(ApiError::invalid(
            "best_of",
            format!("'best_of' must be greater than or equal to 'n' ({n}), got {b}."),
        ));
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(wrong_type("stream", "a boolean", v)),
    };
    Ok((
        ParsedRequest {
            endpoint,
            model,
            input,
            max_tokens,
            max_completion_tokens,
            n,
            best_of,
            stream,
        },
        obj,
    ))
}

/// The body field in which the gateway tells the backend what it decided after reading the
/// body (headers are on their way by then). Only the gateway writes it: the filter drops a
/// client's, and the backend honours it only beside the gateway's secret, as the `x-kvgate-*`
/// headers.
pub const GATEWAY_FIELD: &str = "kvgate";

/// What [`GATEWAY_FIELD`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GatewayNote {
    /// Elastic: the output tokens per sequence the lease reserves (below the cap); `None`: the
    /// whole cap.
    pub reserve_output: Option<u64>,
    /// The prompt's length as the gateway counted it, echoed in the backend's finished
    /// entries: the gateway learns output lengths by its own count of the prompts.
    pub prompt_tokens: u64,
}

impl GatewayNote {
    /// Put the note into the request's body object.
    pub fn write(&self, obj: &mut Map<String, Value>) {
        let mut note = Map::new();
        if let Some(r) = self.reserve_output {
            note.insert("reserve_output".into(), Value::from(r));
        }
        note.insert("prompt_tokens".into(), Value::from(self.prompt_tokens));
        obj.insert(GATEWAY_FIELD.into(), Value::Object(note));
    }

    /// Take the note out of a request's body object: `Ok(None)` when there is none; an
    /// `invalid_request_error` on `kvgate` when it is not what the gateway writes.
    pub fn take(obj: &mut Map<String, Value>) -> Result<Option<GatewayNote>, ApiError> {
        let Some(v) = obj.remove(GATEWAY_FIELD) else {
            return Ok(None);
        };
        let bad = || {
            ApiError::invalid(
                GATEWAY_FIELD,
                "'kvgate' is the gateway's own field: an object of non-negative integers \
                 reserve_output and prompt_tokens.",
            )
        };
        let Value::Object(note) = v else {
            return Err(bad());
        };
        let mut out = GatewayNote::default();
        for (k, v) in &note {
            let n = v.as_u64().ok_or_else(bad)?;
            match k.as_str() {
                "reserve_output" => out.reserve_output = Some(n),
                "prompt_tokens" => out.prompt_tokens = n,
                _ => return Err(bad()),
            }
        }
        Ok(Some(out))
    }
}

/// Write the effective cap into the body so the backend cannot generate past the reservation.
/// `max_tokens` is always set to `cap`: it is the one cap field every OpenAI-compatible server
/// reads, on both endpoints (the legacy completions API has no other), so a server that ignores
/// `max_completion_tokens` and runs an unset `max_tokens` to its context (llama.cpp's default)
/// still stops at the cap. A `max_completion_tokens` the client sent is set to `cap` too.
/// `None` leaves the body's cap fields as they are (see [`crate::cap::Price::cap_from_context`]).
pub fn write_cap(obj: &mut Map<String, Value>, cap: Option<u64>) -> Vec<u8> {
    if let Some(cap) = cap {
        obj.insert("max_tokens".into(), Value::from(cap));
        if let Some(v) = obj.get_mut("max_completion_tokens") {
            if !v.is_null() {
                *v = Value::from(cap);
            }
        }
    }
    serde_json::to_vec(obj).unwrap_or_default()
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_u64() || n.is_i64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The most bytes of a client's value an error message shows.
const SHOWN_BYTES: usize = 64;

/// What a client sent, for an error message: its type and its compact JSON, cut after
/// [`SHOWN_BYTES`] bytes (on a character boundary, marked `…`). Serializes no further than that,
/// however large the value.
pub(crate) fn describe(v: &Value) -> String {
    struct Upto(Vec<u8>);
    impl std::io::Write for Upto {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let room = SHOWN_BYTES.saturating_sub(self.0.len());
            self.0.extend(buf.iter().take(room));
            if buf.len() > room {
                return Err(std::io::Error::other("shown enough"));
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut w = Upto(Vec::new());
    let cut = serde_json::to_writer(&mut w, v).is_err();
    let shown = match std::str::from_utf8(&w.0) {
        Ok(s) => s,
        Err(e) => {
            std::str::from_utf8(w.0.get(..e.valid_up_to()).unwrap_or_default()).unwrap_or_default()
        }
    };
    match v {
        Value::Null => "null".to_string(),
        _ if cut => format!("{}: {shown}…", type_name(v)),
        _ => format!("{}: {shown}", type_name(v)),
    }
}

fn wrong_type(field: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        field,
        format!(
            "Invalid type for '{field}': expected {want}, but got {}.",
            type_name(got)
        ),
    )
}

/// An optional integer count ≥ `min`. `null` means unset.
fn opt_count(obj: &Map<String, Value>, field: &str, min: u64) -> Result<Option<u64>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) if v >= min => Ok(Some(v)),
            Some(v) => Err(ApiError::invalid(
                field,
                format!("'{field}' must be at least {min}, got {v}."),
            )),
            None if n.as_i64().is_some() => Err(ApiError::invalid(
                field,
                format!("'{field}' must be a non-negative integer, got {n}."),
            )),
            None => Err(ApiError::invalid(
                field,
                format!("'{field}' must be an integer, got {n}."),
            )),
        },
        Some(v) => Err(wrong_type(field, "an integer", v)),
    }
}

fn token_array(arr: &[Value], field: &str) -> Result<u64, ApiError> {
    for v in arr {
        if v.as_u64().is_none_or(|t| t > u64::from(u32::MAX)) {
            return Err(ApiError::invalid(
                field,
                format!("'{field}' token ids must be non-negative integers, got {v}."),
            ));
        }
    }
    Ok(arr.len() as u64)
}

fn parse_prompt(v: Option<&Value>) -> Result<Vec<PromptItem>, ApiError> {
    let missing = || ApiError::invalid("prompt", "'prompt' is a required property.");
    match v {
        None | Some(Value::Null) => Err(missing()),
        Some(Value::String(s)) => Ok(vec![PromptItem::Text(s.clone())]),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid("prompt", "'prompt' must not be empty."));
            }
            match items.first() {
                Some(Value::Number(_)) => Ok(vec![PromptItem::Tokens(token_array(items, "prompt")?)]),
                _ => items
                    .iter()
                    .map(|item| match item {
                        Value::String(s) => Ok(PromptItem::Text(s.clone())),
                        Value::Array(toks) if !toks.is_empty() => {
                            Ok(PromptItem::Tokens(token_array(toks, "prompt")?))
                        }
                        other => Err(ApiError::invalid(
                            "prompt",
                            format!(
                                "'prompt' must be a string, an array of strings, an array of \
                                 token ids or an array of non-empty token arrays; found {} in the array.",
                                type_name(other)
                            ),
                        )),
                    })
                    .collect(),
            }
        }
        Some(other) => Err(wrong_type("prompt", "a string or an array", other)),
    }
}

fn parse_messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let arr = match v {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "messages",
                "'messages' is a required property.",
            ))
        }
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid(
                "messages",
                "'messages' must contain at least one message.",
            ))
        }
        Some(Value::Array(a)) => a,
        Some(other) => return Err(wrong_type("messages", "an array", other)),
    };
    arr.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = |f: &str| format!("messages[{i}].{f}");
            let Value::Object(m) = m else {
                return Err(wrong_type(&format!("messages[{i}]"), "an object", m));
            };
            let role = match m.get("role") {
                Some(Value::String(r)) => r.clone(),
                None => {
                    return Err(ApiError::invalid(
                        &at("role"),
                        format!("'{}' is a required property.", at("role")),
                    ))
                }
                Some(other) => return Err(wrong_type(&at("role"), "a string", other)),
            };
            let mut content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => content_parts(parts, &at("content"))?,
                Some(other) => {
                    return Err(wrong_type(
                        &at("content"),
                        "a string or an array of parts",
                        other,
                    ))
                }
            };
            // Tool calls are rendered into the prompt by the model's template: count their JSON.
            if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                content.push_str(&calls.to_string());
            }
            let mut extra = String::new();
            other_fields(m, &mut extra);
            Ok(ChatMessage {
                role,
                content,
                extra,
            })
        })
        .collect()
}

/// Message keys read above; every other key is counted by [`other_fields`].
const MESSAGE_KEYS: [&str; 3] = ["role", "content", "tool_calls"];

/// Append a message's other fields to the text that is counted, as `\n{key}: {value}`.
///
/// They are forwarded, and a server's chat template may render any of them (vLLM hands the whole
/// message to the template: `name`, for one), so a field nobody counted would be KV the
/// reservation does not cover. They are not refused: the openai client echoes assistant
/// messages back with `refusal`, `audio`, `function_call` and `annotations` set to null or
/// empty, and those ask for nothing and add nothing here. A string counts as its text, any other
/// value as its compact JSON; the key and separator are the per-field overhead. The text joins the
/// content, so it goes through the counter's caps (its byte bound first) as content does, and
/// its length is linear in the body's.
fn other_fields(m: &Map<String, Value>, out: &mut String) {
    for (key, v) in m {
        let empty = match v {
            Value::Null => true,
            Value::Bool(b) => !b,
            Value::String(s) => s.is_empty(),
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            Value::Number(_) => false,
        };
        if empty || MESSAGE_KEYS.contains(&key.as_str()) {
            continue;
        }
        out.push('\n');
        out.push_str(key);
        out.push_str(": ");
        match v {
            Value::String(s) => out.push_str(s),
            other => out.push_str(&other.to_string()),
        }
    }
}

fn content_parts(parts: &[Value], field: &str) -> Result<String, ApiError> {
    let mut out = String::new();
    for (j, p) in parts.iter().enumerate() {
        let at = format!("{field}[{j}]");
        let Value::Object(p) = p else {
            return Err(wrong_type(&at, "an object", p));
        };
        match (p.get("type"), p.get("text")) {
            // Joined with newlines, as vLLM (and TensorRT-LLM) render text parts: a filter in
            // front of them counts what they render.
            (Some(Value::String(t)), Some(Value::String(text))) if t == "text" => {
                if j > 0 {
                    out.push('\n');
                }
                out.push_str(text)
            }
            (Some(Value::String(t)), _) if t == "text" => {
                return Err(ApiError::invalid(
                    &format!("{at}.text"),
                    format!("'{at}.text' must be a string."),
                ))
            }
            (Some(Value::String(t)), _) => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    format!(
                    "Content part type '{t}' is not supported by this text model; only 'text' is."
                ),
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    format!("'{at}.type' is a required string."),
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comp(body: &str) -> Result<ParsedRequest, ApiError> {
        parse_request(Endpoint::Completions, body.as_bytes()).map(|(p, _)| p)
    }
    fn chat(body: &str) -> Result<ParsedRequest, ApiError> {
        parse_request(Endpoint::ChatCompletions, body.as_bytes()).map(|(p, _)| p)
    }

    #[test]
    fn a_body_of_many_small_objects_is_refused_before_it_is_parsed() {
        let many = |n: usize| {
            let items = vec![r#"{"a":"[{\"}"}"#; n].join(",");
            format!(r#"{{"prompt":"hi","max_tokens":1,"x":[{items}]}}"#)
        };
        // The body's object, the array, and n objects; brackets inside strings do not count.
        assert!(comp(&many(MAX_JSON_CONTAINERS - 2)).is_ok());
        let e = comp(&many(MAX_JSON_CONTAINERS - 1)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("16385 JSON objects"), "{}", e.message);
        // Messages and token arrays far beyond any context stay under it.
        let msgs = vec![r#"{"role":"user","content":"hi"}"#; 4_000].join(",");
        assert!(chat(&format!(r#"{{"messages":[{msgs}]}}"#)).is_ok());
        let ids = |n: usize| {
            format!(
                r#"{{"prompt":[{}],"max_tokens":1}}"#,
                vec!["7"; n].join(",")
            )
        };
        assert!(comp(&ids(200_000)).is_ok());
        let e = comp(&ids(MAX_JSON_VALUES + 2)).unwrap_err();
        assert!(e.message.contains("JSON values"), "{}", e.message);
    }

    #[test]
    fn endpoints_from_paths() {
        assert_eq!(
            Endpoint::from_path("/v1/completions"),
            Some(Endpoint::Completions)
        );
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions?x=1"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(Endpoint::from_path("/v1/models"), None);
    }

    #[test]
    fn prompt_shapes() {
        let p = comp(r#"{"prompt":"hi","max_tokens":5}"#).unwrap();
        assert_eq!(p.input, Input::Prompts(vec![PromptItem::Text("hi".into())]));
        assert_eq!(p.requested_cap(), Some(5));
        let p = comp(r#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(
            p.input,
            Input::Prompts(vec![
                PromptItem::Text("a".into()),
                PromptItem::Text("b".into())
            ])
        );
        let p = comp(r#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(p.input, Input::Prompts(vec![PromptItem::Tokens(3)]));
        let p = comp(r#"{"prompt":[[1,2],[3]]}"#).unwrap();
        assert_eq!(
            p.input,
            Input::Prompts(vec![PromptItem::Tokens(2), PromptItem::Tokens(1)])
        );
    }

    #[test]
    fn chat_shapes() {
        let p = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
                {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],
                "max_completion_tokens":7,"max_tokens":9,"n":2,"stream":true}"#,
        )
        .unwrap();
        let Input::Chat(m) = &p.input else { panic!() };
        assert_eq!(m[1].content, "a\nb", "text parts joined as vLLM joins them");
        assert_eq!(m[2].content, r#"[{"id":"1"}]"#);
        assert_eq!(p.requested_cap(), Some(7));
        assert_eq!(p.choices(), 2);
        assert!(p.stream);
        assert_eq!(p.model.as_deref(), Some("m"));
    }

    #[test]
    fn other_message_fields_are_counted_and_empty_ones_are_not() {
        use crate::tokenize::{Capped, Encoding, TokenCounter, TokenizerSpec};
        let c = TokenCounter::new(&TokenizerSpec::Builtin(Encoding::Cl100kBase)).unwrap();
        let count = |body: &str| c.count_input(&chat(body).unwrap().input)[0];
        let plain = count(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#);
        // A server whose template renders `name` (vLLM passes it) allocates KV for it.
        let name = "lorem ipsum dolor sit amet, ".repeat(300);
        let n = c.count_text(&name);
        assert!(n > 1000, "{n}");
        let named = format!(
            r#"{{"messages":[{{"role":"user","content":"hi","name":"{name}"}}],"max_tokens":1}}"#
        );
        assert!(
            count(&named) >= plain + n,
            "{} < {plain} + {n}",
            count(&named)
        );
        // Any other value: its compact JSON.
        let meta = serde_json::json!({ "note": name, "n": [1, 2, 3] });
        let m = c.count_text(&meta.to_string());
        let body = serde_json::json!({
            "messages": [{ "role": "user", "content": "hi", "metadata": meta }]
        });
        assert!(count(&body.to_string()) >= plain + m);
        // `true` and numbers are values too.
        assert!(
            count(r#"{"messages":[{"role":"user","content":"hi","x":true,"y":12345}]}"#) > plain
        );
        // What the openai client echoes back, and other empty values, count nothing.
        let bare = count(
            r#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"}]}"#,
        );
        let echoed = count(
            r#"{"messages":[{"role":"user","content":"hi","name":""},
                {"role":"assistant","content":"yo","refusal":null,"audio":null,
                 "function_call":null,"annotations":[],"tool_calls":null,"x":false,"y":{}}]}"#,
        );
        assert_eq!(echoed, bare);
        // The field goes through the same caps as content: over by its bytes, before a render.
        let Input::Chat(msgs) = chat(&named).unwrap().input else {
            panic!()
        };
        // Counted, not rendered: kvgate-backend's template sees the content alone.
        assert_eq!(msgs[0].content, "hi");
        assert!(msgs[0].extra.starts_with("\nname: lorem"));
        assert_eq!(
            c.encode_chat(&msgs),
            c.encode_chat(&[ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..ChatMessage::default()
            }])
        );
        assert_eq!(c.count_chat_capped(&msgs, 100), Capped::Over);
        let huge = format!(
            r#"{{"messages":[{{"role":"user","content":"hi","name":"{}"}}]}}"#,
            "x".repeat(4 << 20)
        );
        let Input::Chat(msgs) = chat(&huge).unwrap().input else {
            panic!()
        };
        assert_eq!(c.count_chat_capped(&msgs, 8192), Capped::Over);
    }

    #[test]
    fn bad_inputs_are_400_naming_the_field() {
        for (body, param) in [
            (r#"{"prompt":"x","max_tokens":-1}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":1.5}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":"10"}"#, "max_tokens"),
            (r#"{"prompt":"x","max_tokens":0}"#, "max_tokens"),
            (r#"{"prompt":"x","n":0}"#, "n"),
            (r#"{"prompt":"x","n":500}"#, "n"),
            (r#"{"prompt":"x","n":3,"best_of":2}"#, "best_of"),
            (r#"{"prompt":"x","stream":"yes"}"#, "stream"),
            (r#"{"max_tokens":3}"#, "prompt"),
            (r#"{"prompt":[]}"#, "prompt"),
            (r#"{"prompt":[1,-2]}"#, "prompt"),
            (r#"{"prompt":["a",3]}"#, "prompt"),
            (r#"{"prompt":{"a":1}}"#, "prompt"),
            (r#"{"prompt":"x","model":5}"#, "model"),
        ] {
            let e = comp(body).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        for (body, param) in [
            (r#"{"messages":[]}"#, "messages"),
            (r#"{}"#, "messages"),
            (r#"{"messages":"hi"}"#, "messages"),
            (r#"{"messages":[{"content":"x"}]}"#, "messages[0].role"),
            (
                r#"{"messages":[{"role":"user","content":5}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                "messages[0].content[0].type",
            ),
        ] {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let e = comp("{not json").unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.kind.code(), "invalid_request");
        assert_eq!(comp("[1]").unwrap_err().status, 400);
    }

    #[test]
    fn cap_is_written_into_the_body() {
        let (_, mut obj) = parse_request(
            Endpoint::ChatCompletions,
            br#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":9000}"#,
        )
        .unwrap();
        let body: Value = serde_json::from_slice(&write_cap(&mut obj, Some(100))).unwrap();
        assert_eq!(body["max_completion_tokens"], 100);
        assert_eq!(
            body["max_tokens"], 100,
            "the field every server reads, always"
        );
        let (_, mut obj) = parse_request(
            Endpoint::Completions,
            br#"{"prompt":"x","max_tokens":null}"#,
        )
        .unwrap();
        let body: Value = serde_json::from_slice(&write_cap(&mut obj, Some(42))).unwrap();
        assert_eq!(body["max_tokens"], 42);
        assert!(body.get("max_completion_tokens").is_none());
        // The legacy completions API has no `max_completion_tokens`: a server that does not read
        // it gets the cap in `max_tokens`.
        let (_, mut obj) = parse_request(
            Endpoint::Completions,
            br#"{"prompt":"x","max_completion_tokens":16}"#,
        )
        .unwrap();
        let body: Value = serde_json::from_slice(&write_cap(&mut obj, Some(16))).unwrap();
        assert_eq!(
            (&body["max_tokens"], &body["max_completion_tokens"]),
            (&16.into(), &16.into())
        );
    }

    #[test]
    fn the_gateways_note_goes_into_the_body_and_comes_out_whole_or_refused() {
        let (_, mut obj) = parse_request(
            Endpoint::Completions,
            br#"{"prompt":"hi","max_tokens":100}"#,
        )
        .unwrap();
        let note = GatewayNote {
            reserve_output: Some(12),
            prompt_tokens: 7,
        };
        note.write(&mut obj);
        let body = write_cap(&mut obj, Some(100));
        let (_, mut back) = parse_request(Endpoint::Completions, &body).unwrap();
        assert_eq!(GatewayNote::take(&mut back).unwrap(), Some(note));
        assert!(back.get(GATEWAY_FIELD).is_none(), "taken out of the body");
        assert_eq!(GatewayNote::take(&mut back).unwrap(), None);
        // The whole cap: no reserve_output.
        let whole = GatewayNote {
            reserve_output: None,
            prompt_tokens: 7,
        };
        whole.write(&mut back);
        assert_eq!(GatewayNote::take(&mut back).unwrap(), Some(whole));
        for bad in [
            r#"{"kvgate":1}"#,
            r#"{"kvgate":{"reserve_output":-1}}"#,
            r#"{"kvgate":{"reserve_output":"5"}}"#,
            r#"{"kvgate":{"lease":"7"}}"#,
        ] {
            let mut obj: Map<String, Value> = serde_json::from_str(bad).unwrap();
            let e = GatewayNote::take(&mut obj).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(GATEWAY_FIELD), "{bad}");
        }
    }
}

//! The HTTP surface: OpenAI-compatible completions and chat completions (JSON and SSE), models,
//! health, Prometheus metrics, and the admission API the kvgate filter polls.
//!
//! Requests are validated into `Submit` values with the same parser the filter uses
//! (kvgate-core), so both sides agree on what a request is; every error is an OpenAI-style JSON
//! body with the right status, and nothing is allocated for a request that fails validation.
//! Validation (parsing, counting, template rendering) runs on tokio's blocking pool, a bounded
//! number at a time, never on the executor that serves the streams and the lease polls.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use kvgate_core::{
    effective_output_cap, parse_request, ApiError, Endpoint, ErrorKind, GatewayNote, Input,
};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::Semaphore;

use crate::engine::Admission;
use crate::handle::{Demoted, EngineHandle, Event, GenParams, Submit};
use crate::pollers::{Poll, Pollers};
use crate::published::Published;
use crate::tokenizer::Tokenizer;
use kvgate_core::tokenize::ChatTemplate;
use kvgate_core::wire::{FinishReason, LeaseReport, LimitsReport, ModelReport, TokenizerReport};

pub struct AppState {
    pub engine: EngineHandle,
    pub tok: Arc<Tokenizer>,
    pub model_name: String,
    pub spec: kvgate_core::ModelSpec,
    pub admission: Admission,
    /// What the gateway may send as `x-kvgate-secret` (the current one and the next, during a
    /// rotation); empty: the admission API is open (the backend then listens on loopback only).
    pub admission_secrets: Vec<String>,
    /// Published in the descriptor: the margin the gateway adds to every reservation (one KV
    /// block) and the bound on one prefill step's scratch memory.
    pub scratch_margin_bytes: u64,
    pub prefill_scratch_bytes: u64,
    pub decode_scratch_bytes: u64,
    /// Prompt blocks are cached and shared (the paged arena).
    pub prefix_caching: bool,
    /// The largest request body accepted (`--max-body-bytes`).
    pub max_body_bytes: usize,
    /// The gateways that poll the lease report, so each can be told of the others.
    pub pollers: Mutex<Pollers>,
    /// Permits to validate a request off the async executor (one a core): a request beyond
    /// them waits for one, so blocking validations never queue up without bound.
    pub validation_slots: Arc<Semaphore>,
}

impl AppState {
    /// Admission calls and lease headers come from the gateway only: with a secret configured,
    /// a request without it is refused (401).
    fn check_secret(&self, headers: &HeaderMap) -> Result<(), HttpError> {
        if self.admission_secrets.is_empty() {
            return Ok(());
        }
        let got = headers
            .get("x-kvgate-secret")
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        // Constant time in each secret's content (length is not secret); every one compared.
        let same = self.admission_secrets.iter().fold(false, |any, want| {
            let this = got.len() == want.len()
                && got
                    .iter()
                    .zip(want.as_bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0;
            any | this
        });
        if same {
            Ok(())
        } else {
            Err(HttpError(
                ApiError::new(
                    ErrorKind::Unauthorized,
                    "The admission API and lease headers are for the kvgate gateway only.",
                )
                .with_status(401),
            ))
        }
    }
}

type Shared = State<Arc<AppState>>;

/// The address a connection reached on this backend (its socket's local address): the lease
/// report names it, so a gateway answered by another host than the one it named can tell.
#[derive(Debug, Clone, Copy)]
pub struct ServedAt(Option<std::net::SocketAddr>);

impl
    axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, tokio::net::TcpListener>>
    for ServedAt
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        ServedAt(stream.io().local_addr().ok())
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let body_limit = axum::extract::DefaultBodyLimit::max(state.max_body_bytes);
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/admission/leases", get(leases))
        .route("/v1/admission/leases/{id}/cancel", post(cancel))
        .route("/v1/admission/leases/{id}/demote", post(demote))
        .fallback(not_found)
        .layer(body_limit)
        .with_state(state)
}

/// An `ApiError` as an HTTP response (the one `IntoResponse` of this surface).
pub struct HttpError(pub ApiError);

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status as u16).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, self.0.body()).into_response();
        for (k, v) in self.0.headers() {
            if let Ok(v) = HeaderValue::from_str(&v) {
                resp.headers_mut().insert(k, v);
            }
        }
        resp
    }
}

impl From<ApiError> for HttpError {
    fn from(e: ApiError) -> Self {
        HttpError(e)
    }
}

async fn not_found() -> HttpError {
    HttpError(ApiError::new(ErrorKind::NotFound, "Unknown path."))
}

async fn health() -> &'static str {
    "ok"
}

async fn models(State(st): Shared) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": 0, "owned_by": "kvgate",
        "max_model_len": st.spec.context_tokens,
    }]}))
}

async fn metrics(State(st): Shared) -> impl IntoResponse {
    let body = st.engine.metrics.render(&st.engine.pool_stats());
    ([("content-type", crate::metrics::CONTENT_TYPE)], body)
}

#[derive(serde::Deserialize)]
struct LeasesQuery {
    #[serde(default)]
    since: u64,
    #[serde(default)]
    include: Option<String>,
    /// The polling gateway: its Envoy (16 hex digits), its number and its poll period. A poll
    /// without them (an older gateway) is answered all the same.
    #[serde(default)]
    instance: Option<String>,
    #[serde(default)]
    gateway: Option<u64>,
    #[serde(default)]
    poll_ms: Option<u64>,
}

impl LeasesQuery {
    fn poll(&self) -> Option<Poll> {
        let instance = self.instance.as_deref()?;
        if instance.is_empty() || instance.len() > 16 {
            return None;
        }
        Some(Poll {
            instance: u64::from_str_radix(instance, 16).ok()?,
            gateway: self.gateway?,
            poll_ms: self.poll_ms.unwrap_or(1_000),
        })
    }
}

async fn leases(
    State(st): Shared,
    headers: HeaderMap,
    extensions: axum::http::Extensions,
    Query(q): Query<LeasesQuery>,
) -> Result<Json<LeaseReport>, HttpError> {
    st.check_secret(&headers)?;
    let (pool, leases, finished, cursor) = st.engine.lease_report(q.since);
    // The gateways that hold leases here: without a secret, a poller that holds none counts for
    // little.
    let holding: std::collections::BTreeSet<u64> = leases
        .iter()
        .filter_map(|l| l.id.parse().ok().map(kvgate_core::lease_id::gateway_of))
        .collect();
    let other_gateways = st
        .pollers
        .lock()
        .map(|mut p| {
            let untrusted = st.admission_secrets.is_empty().then_some(&holding);
            p.polled(q.poll(), Instant::now(), untrusted)
        })
        .unwrap_or_default();
    let tokenizer = TokenizerReport {
        kind: "tiktoken_bpe".into(),
        pattern: st.tok.bpe.pattern.clone(),
        special_tokens: st.tok.bpe.special_tokens.iter().cloned().collect(),
        chat_template: st.tok.bpe.chat_template.wire().to_string(),
        bos_token: match &st.tok.bpe.chat_template {
            ChatTemplate::Jinja { bos_token, .. } => bos_token.clone(),
            ChatTemplate::ChatMl => String::new(),
        },
        eos_token: match &st.tok.bpe.chat_template {
            ChatTemplate::Jinja { eos_token, .. } => eos_token.clone(),
            ChatTemplate::ChatMl => String::new(),
        },
        add_bos: st.tok.bpe.add_bos,
        ranks: (q.include.as_deref() == Some("tokenizer")).then(|| st.tok.bpe.to_tiktoken()),
    };
    Ok(Json(LeaseReport {
        pool,
        admission: st.admission.as_str().into(),
        gateway_note: true,
        model: Some(ModelReport {
            name: Some(st.model_name.clone()),
            spec: Some(st.spec),
            fingerprint: Some(format!("{:016x}", st.spec.fingerprint())),
            kv_bytes_per_token: st.spec.kv_bytes_per_token(),
            tokenizer: Some(tokenizer),
            // What the validator checks, so the gateway refuses exactly what this server would.
            vocab: Some(st.tok.vocab),
            limits: LimitsReport {
                max_choices: 1,
                batched_prompts: false,
            },
            scratch_margin_bytes: Some(st.scratch_margin_bytes),
            prefill_scratch_bytes: Some(st.prefill_scratch_bytes),
            decode_scratch_bytes: Some(st.decode_scratch_bytes),
            prefix_caching: st.prefix_caching,
        }),
        leases,
        finished,
        cursor,
        other_gateways,
        served_at: extensions
            .get::<axum::extract::ConnectInfo<ServedAt>>()
            .and_then(|c| c.0 .0)
            .map(|a| a.to_string()),
    }))
}

async fn cancel(
    State(st): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, HttpError> {
    st.check_secret(&headers)?;
    if st.engine.cancel(id.clone()).await {
        Ok(Json(json!({"id": id, "cancelled": true})))
    } else {
        Err(no_live_lease(&id))
    }
}

/// 404 for a lease id the backend does not hold.
fn no_live_lease(id: &str) -> HttpError {
    HttpError(ApiError::new(ErrorKind::NotFound, format!("No live lease {id:?}.")).with_param("id"))
}

async fn demote(
    State(st): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, HttpError> {
    st.check_secret(&headers)?;
    match st.engine.demote(id.clone()).await {
        Some(Demoted::Lent) => Ok(Json(json!({"id": id, "demoted": true}))),
        Some(Demoted::OnArrival) => {
            Ok(Json(json!({"id": id, "demoted": true, "on_arrival": true})))
        }
        Some(Demoted::Cancelled) => Ok(Json(json!({"id": id, "cancelled": true}))),
        Some(Demoted::Finished) => Ok(Json(json!({"id": id, "finished": true}))),
        Some(Demoted::Unknown) => Err(no_live_lease(&id)),
        None => Err(HttpError(
            ApiError::new(ErrorKind::Internal, "The engine has stopped.").with_status(503),
        )),
    }
}

/// A request body as the handlers read it: over `--max-body-bytes` (or unreadable), an
/// OpenAI-style error, not axum's plain-text rejection.
type Body = Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>;

async fn completions(State(st): Shared, headers: HeaderMap, body: Body) -> Response {
    match body {
        Ok(b) => generate(st, headers, Endpoint::Completions, b).await,
        Err(e) => body_refused(&st, &e),
    }
}

async fn chat_completions(State(st): Shared, headers: HeaderMap, body: Body) -> Response {
    match body {
        Ok(b) => generate(st, headers, Endpoint::ChatCompletions, b).await,
        Err(e) => body_refused(&st, &e),
    }
}

fn body_refused(st: &AppState, e: &axum::extract::rejection::BytesRejection) -> Response {
    let err = match e.status() {
        axum::http::StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            ErrorKind::BodyTooLarge,
            format!(
                "The request body is larger than this server accepts ({} bytes, --max-body-bytes).",
                st.max_body_bytes
            ),
        ),
        status => ApiError::new(
            ErrorKind::InvalidRequest,
            format!("The request body could not be read: {}", e.body_text()),
        )
        .with_status(u32::from(status.as_u16())),
    };
    HttpError(err).into_response()
}

struct Validated {
    /// The gateway's private body field (taken out of the body).
    note: Option<GatewayNote>,
    prompt: Vec<u32>,
    params: GenParams,
    stream: bool,
    include_usage: bool,
}

impl AppState {
    /// What this server serves, as the gateway's validator checks it too (the descriptor carries
    /// the same values to the filter).
    pub fn served(&self) -> kvgate_core::Served {
        kvgate_core::Served {
            model: Some(self.model_name.clone()),
            vocab: Some(self.tok.vocab),
            max_choices: 1,
            batched_prompts: false,
        }
    }
}

/// `read_note`: the request carries `x-kvgate-note` (from the gateway, with its secret), so its
/// body's `kvgate` field is the gateway's note; without it the field is a client's, dropped
/// unread.
fn validate(
    st: &AppState,
    endpoint: Endpoint,
    body: &[u8],
    read_note: bool,
) -> Result<Validated, ApiError> {
    let (req, mut obj) = parse_request(endpoint, body)?;
    let note = if read_note {
        GatewayNote::take(&mut obj)?
    } else {
        obj.remove(kvgate_core::GATEWAY_FIELD);
        None
    };
    // The same checks the gateway runs before reserving (kvgate-core's validator).
    let sampling = kvgate_core::validate(&req, &obj, &st.served())?;
    let context = st.spec.context_tokens;
    // Counted first, capped at the context, as the gateway counts: a prompt surely past the
    // context is refused before the exact encoder runs. (On a run of about a million
    // whitespace characters tiktoken-rs's encoder panics, which would end this process; the
    // capped count takes each byte after such a run as a token, so it is over any context
    // this server serves.)
    if st
        .tok
        .counter
        .count_input_capped(&req.input, context)
        .is_err()
    {
        return Err(
            kvgate_core::cap::prompt_over_context(req.requested_cap(), context)
                .with_status(400)
                .with_param(req.prompt_field()),
        );
    }
    let prompt: Vec<u32> = match &req.input {
        Input::Chat(messages) => st.tok.counter.encode_chat(messages).map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("The model's chat template refused the messages: {e}"),
            )
        })?,
        Input::Prompts(_) => match obj.get("prompt") {
            Some(Value::String(s)) => st.tok.counter.encode_prompt(s),
            Some(Value::Array(a)) if a.first().is_some_and(Value::is_string) => st
                .tok
                .counter
                .encode_prompt(a.first().and_then(Value::as_str).unwrap_or("")),
            Some(Value::Array(a)) => {
                let flat = match a.first() {
                    Some(Value::Array(inner)) => inner,
                    _ => a,
                };
                flat.iter()
                    .map(|v| v.as_u64().unwrap_or(u64::MAX) as u32)
                    .collect()
            }
            _ => Vec::new(),
        },
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "The prompt is empty."));
    }
    let p = prompt.len() as u64;
    let cap = effective_output_cap(req.requested_cap(), p, context)
        .map_err(|e| e.with_status(400).with_param(req.prompt_field()))?;
    if cap.clamped {
        let asked = req.requested_cap().unwrap_or(0);
        let field = if req.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(ApiError::new(
            ErrorKind::ContextLengthExceeded,
            format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens \
                 ({p} in the prompt, {asked} for the completion). Please reduce the prompt or the completion length.",
                p.saturating_add(asked)
            ),
        )
        .with_param(field)
        .with_status(400));
    }
    let seed = sampling.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    Ok(Validated {
        note,
        prompt,
        params: GenParams {
            max_tokens: cap.cap,
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            seed,
            stop: sampling.stop,
        },
        stream: req.stream,
        include_usage: sampling.include_usage,
    })
}

/// `validate` on tokio's blocking pool, at most `validation_slots` at a time. Parsing a body of
/// megabytes (a token-id prompt of 2 M numbers), counting a long prompt and rendering a chat
/// template take the CPU for long enough to stall every SSE stream, `/health` and the
/// gateway's lease polls if run on the executor's few worker threads. A request beyond the
/// permits waits for one here, as an idle future; the permit goes with the blocking task, so a
/// handler dropped meanwhile (its client gone) frees it only when the work is done.
async fn validate_off_executor(
    st: &Arc<AppState>,
    endpoint: Endpoint,
    body: axum::body::Bytes,
    read_note: bool,
) -> Result<Validated, ApiError> {
    let stopped = |what: String| ApiError::new(ErrorKind::Internal, what);
    let permit = Arc::clone(&st.validation_slots)
        .acquire_owned()
        .await
        .map_err(|e| stopped(format!("The request could not be validated: {e}")))?;
    let st = Arc::clone(st);
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        validate(&st, endpoint, &body, read_note)
    })
    .await
    .unwrap_or_else(|e| Err(stopped(format!("The request could not be validated: {e}"))))
}

/// A lease acknowledged the moment its request arrives: listed in the leases report (state
/// `arrived` until the engine lists it) for as long as its handler or response stream lives.
/// A request the engine never took is recorded as finished (`refused`) when it lets go, so the
/// filter can release at once.
struct Arrival {
    published: Arc<Mutex<Published>>,
    id: String,
    engine_took_it: bool,
}

impl Arrival {
    /// Acknowledge `id`, or refuse a second live request with the same lease id.
    fn acknowledge(published: &Arc<Mutex<Published>>, id: &str) -> Result<Arrival, ApiError> {
        let mut p = published.lock().unwrap_or_else(|e| e.into_inner());
        if p.is_live(id) {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                format!("A request holding lease {id:?} is already in flight; lease ids are single-use."),
            )
            .with_status(409));
        }
        p.arrived.insert(id.to_string());
        Ok(Arrival {
            published: Arc::clone(published),
            id: id.to_string(),
            engine_took_it: false,
        })
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        let mut p = self.published.lock().unwrap_or_else(|e| e.into_inner());
        p.arrived.remove(&self.id);
        if !self.engine_took_it {
            p.record_finished(&self.id, FinishReason::Refused, 0, 0, None, 0);
        }
    }
}

async fn generate(
    st: Arc<AppState>,
    headers: HeaderMap,
    endpoint: Endpoint,
    body: axum::body::Bytes,
) -> Response {
    let lease = headers
        .get("x-kvgate-lease")
        .and_then(|h| h.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 64)
        .map(str::to_string);
    // Only the gateway may name a lease, a class or an elastic reservation (in a header, or in
    // the body's note that `x-kvgate-note` points to).
    if [
        "x-kvgate-lease",
        "x-kvgate-class",
        "x-kvgate-reserve-output",
        "x-kvgate-note",
    ]
    .iter()
    .any(|h| headers.contains_key(*h))
    {
        if let Err(e) = st.check_secret(&headers) {
            return e.into_response();
        }
    }
    let class = headers
        .get("x-kvgate-class")
        .and_then(|h| h.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 64)
        .map(str::to_string);
    let header_reserve_output = headers
        .get("x-kvgate-reserve-output")
        .and_then(|h| h.to_str().ok())
        .and_then(|s| s.parse::<u64>().ok());
    let mut arrival = match lease
        .as_deref()
        .map(|id| Arrival::acknowledge(&st.engine.published, id))
    {
        Some(Ok(a)) => Some(a),
        Some(Err(e)) => return HttpError(e).into_response(),
        None => None,
    };
    let read_note = headers.contains_key("x-kvgate-note");
    let v = match validate_off_executor(&st, endpoint, body, read_note).await {
        Ok(v) => v,
        Err(e) => return HttpError(e).into_response(),
    };
    // The gateway decides after reading the body: its note wins over the header (which older
    // gateways send).
    let reserve_output = match v.note {
        Some(n) => n.reserve_output,
        None => header_reserve_output,
    };
    let (tx, mut rx) = unbounded_channel();
    let submitted = st.engine.submit(Submit {
        lease,
        class,
        reserve_output,
        gateway_prompt_tokens: v.note.map_or(0, |n| n.prompt_tokens),
        prompt: v.prompt,
        params: v.params,
        events: tx,
    });
    if submitted {
        // From here the engine reports how the lease ends (refused, cancelled when this
        // handler is dropped, or finished), even if this handler is dropped before the answer.
        if let Some(a) = arrival.as_mut() {
            a.engine_took_it = true;
        }
    }
    let id = match (submitted, rx.recv().await) {
        (true, Some(Event::Admitted { id })) => id,
        (_, Some(Event::Rejected(e))) => return HttpError(e).into_response(),
        _ => {
            return HttpError(ApiError::new(
                ErrorKind::Internal,
                "The engine is not running.",
            ))
            .into_response()
        }
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let shape = Shape {
        endpoint,
        id: format!("{}-{id}", endpoint_prefix(endpoint)),
        created,
        model: st.model_name.clone(),
    };
    if v.stream {
        let mut resp = Sse::new(sse_stream(rx, shape, v.include_usage, arrival))
            .keep_alive(KeepAlive::default())
            .into_response();
        if let Ok(h) = HeaderValue::from_str(&id) {
            resp.headers_mut().insert("x-kvgate-lease", h);
        }
        return resp;
    }
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Finished { error: Some(e), .. } => return HttpError(e).into_response(),
            Event::Finished {
                reason,
                prompt_tokens,
                completion_tokens,
                error: None,
            } => {
                return Json(shape.full(&text, reason, prompt_tokens, completion_tokens))
                    .into_response();
            }
            Event::Admitted { .. } | Event::Rejected(_) => {}
        }
    }
    HttpError(ApiError::new(
        ErrorKind::Internal,
        "The engine dropped the request.",
    ))
    .into_response()
}

fn endpoint_prefix(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Completions => "cmpl",
        Endpoint::ChatCompletions => "chatcmpl",
    }
}

/// The OpenAI response shapes of one request.
struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

fn usage(p: u64, c: u64) -> Value {
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
}

impl Shape {
    fn full(&self, text: &str, reason: FinishReason, p: u64, c: u64) -> Value {
        match self.endpoint {
            Endpoint::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": reason.as_str()}],
                "usage": usage(p, c),
            }),
            Endpoint::ChatCompletions => json!({
                "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": null, "finish_reason": reason.as_str()}],
                "usage": usage(p, c),
            }),
        }
    }

    fn chunk(&self, text: Option<&str>, first: bool, reason: Option<FinishReason>) -> Value {
        let reason = reason.map(FinishReason::as_str);
        match self.endpoint {
            Endpoint::Completions => json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": reason}],
            }),
            Endpoint::ChatCompletions => {
                let mut delta = Map::new();
                if first {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason}],
                })
            }
        }
    }

    fn usage_chunk(&self, p: u64, c: u64) -> Value {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::ChatCompletions => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": usage(p, c)})
    }
}

/// Engine events → SSE. The stream owns the event receiver: when the client goes away axum
/// drops the stream, the receiver closes, and the engine frees the sequence on its next step.
fn sse_stream(
    rx: UnboundedReceiver<Event>,
    shape: Shape,
    include_usage: bool,
    arrival: Option<Arrival>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let data = |v: &Value| Ok(SseEvent::default().data(v.to_string()));
    // The stream holds the arrival: the lease stays acknowledged while the response is sent.
    stream::unfold(
        (rx, shape, true, false, arrival),
        move |(mut rx, shape, mut first, done, arrival)| async move {
            if done {
                return None;
            }
            let mut out: Vec<Result<SseEvent, Infallible>> = Vec::new();
            let mut finished = false;
            match rx.recv().await {
                Some(Event::Text(t)) => {
                    out.push(data(&shape.chunk(Some(&t), first, None)));
                    first = false;
                }
                Some(Event::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    error,
                }) => {
                    if let Some(e) = error {
                        // Cut short (preempted, out of KV): the error event ends the stream, as
                        // vLLM ends one. No chunk carries `error` or `preempted` as a
                        // `finish_reason`: OpenAI's clients know only their own values.
                        let body: Value = serde_json::from_str(&e.body()).unwrap_or(Value::Null);
                        out.push(data(&body));
                    } else {
                        out.push(data(&shape.chunk(None, first, Some(reason))));
                        if include_usage {
                            out.push(data(&shape.usage_chunk(prompt_tokens, completion_tokens)));
                        }
                    }
                    out.push(Ok(SseEvent::default().data("[DONE]")));
                    finished = true;
                }
                Some(Event::Admitted { .. } | Event::Rejected(_)) => {}
                None => return None,
            }
            Some((stream::iter(out), (rx, shape, first, finished, arrival)))
        },
    )
    .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handle::EngineHandle;
    use crate::metrics::Metrics;
    use crate::pool::BlockPool;

    /// A server state over the synthetic tokenizer, a context of 64 tokens, and `slots`
    /// validation permits (no engine: validation never reaches it).
    fn state(slots: usize) -> Arc<AppState> {
        let (tx, _) = std::sync::mpsc::channel();
        let pool = BlockPool::new(1 << 20, 16, 64);
        let engine = EngineHandle::new(tx, Default::default(), pool, Arc::new(Metrics::default()));
        Arc::new(AppState {
            engine,
            tok: Arc::new(crate::synthetic::tokenizer(512).unwrap()),
            model_name: "m".into(),
            spec: kvgate_core::ModelSpec {
                layers: 1,
                kv_heads: 1,
                head_dim: 1,
                kv_dtype_bytes: 4,
                context_tokens: 64,
            },
            admission: Admission::Reserve,
            admission_secrets: Vec::new(),
            scratch_margin_bytes: 0,
            prefill_scratch_bytes: 0,
            decode_scratch_bytes: 0,
            prefix_caching: false,
            max_body_bytes: 1 << 20,
            pollers: Default::default(),
            validation_slots: Arc::new(Semaphore::new(slots)),
        })
    }

    const OK: &str = r#"{"model":"m","prompt":"hello","max_tokens":4}"#;

    #[tokio::test]
    async fn validation_off_the_executor_answers_exactly_as_validation_does() {
        let st = state(2);
        let ids = |n: usize| format!("{:?}", vec![5u32; n]);
        let bodies = [
            (Endpoint::Completions, OK.to_string()),
            (Endpoint::Completions, "not json".into()),
            (
                Endpoint::Completions,
                r#"{"model":"other","prompt":"x"}"#.into(),
            ),
            (
                Endpoint::Completions,
                format!(r#"{{"model":"m","prompt":{}}}"#, ids(8)),
            ),
            (
                Endpoint::Completions,
                format!(r#"{{"model":"m","prompt":{}}}"#, ids(65)),
            ),
            (
                Endpoint::Completions,
                format!(r#"{{"model":"m","prompt":"{}"}}"#, " ".repeat(5000)),
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#
                    .into(),
            ),
        ];
        for (endpoint, body) in bodies {
            let inline = validate(&st, endpoint, body.as_bytes(), false);
            let off = validate_off_executor(&st, endpoint, body.clone().into(), false).await;
            match (inline, off) {
                (Ok(a), Ok(b)) => assert_eq!(
                    (a.prompt, a.params.max_tokens, a.stream),
                    (b.prompt, b.params.max_tokens, b.stream),
                    "{body}"
                ),
                (Err(a), Err(b)) => {
                    assert_eq!((a.status, a.body()), (b.status, b.body()), "{body}")
                }
                (a, b) => panic!("{body}: {:?} vs {:?}", a.err(), b.err()),
            }
        }
        assert_eq!(st.validation_slots.available_permits(), 2, "all given back");
    }

    #[tokio::test]
    async fn a_validation_beyond_the_permits_waits_for_one() {
        let st = state(1);
        let held = Arc::clone(&st.validation_slots)
            .acquire_owned()
            .await
            .unwrap();
        let st2 = Arc::clone(&st);
        let waiting = tokio::spawn(async move {
            validate_off_executor(&st2, Endpoint::Completions, OK.into(), false)
                .await
                .is_ok()
        });
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "no permit: it waits");
        drop(held);
        assert!(waiting.await.unwrap());
        assert_eq!(st.validation_slots.available_permits(), 1);
    }

    fn query(instance: Option<&str>, gateway: Option<u64>) -> LeasesQuery {
        LeasesQuery {
            since: 0,
            include: None,
            instance: instance.map(str::to_string),
            gateway,
            poll_ms: Some(500),
        }
    }

    #[test]
    fn a_poll_names_its_envoy_with_up_to_16_hex_digits_and_its_number() {
        let p = query(Some("00000000000000ff"), Some(3)).poll();
        assert_eq!(
            p,
            Some(Poll {
                instance: 255,
                gateway: 3,
                poll_ms: 500
            })
        );
        // Anything else is a poll that names no Envoy: answered, not recorded.
        for (instance, gateway) in [
            (Some("10000000000000000"), Some(3)),
            (Some("xyz"), Some(3)),
            (Some(""), Some(3)),
            (None, Some(3)),
            (Some("ff"), None),
        ] {
            assert_eq!(
                query(instance, gateway).poll(),
                None,
                "{instance:?} {gateway:?}"
            );
        }
    }
}

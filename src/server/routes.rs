//! The axum router and its handlers: `/v1/chat/completions`,
//! `/v1/completions`, `/v1/models`, `/health` and `/metrics`.
//!
//! A body is read as bytes under the size limit (413 past it), parsed as
//! JSON (400 when malformed), then as the endpoint's fields and the shared
//! sampling fields (400 naming the field). The prompt is tokenised here;
//! the request goes to the engine thread, and its tokens come back as text
//! through a [`Detokenizer`] per request (stop strings included), either
//! collected into one answer or streamed as server-sent events.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokenizers::Tokenizer;

use super::engine_thread::{EngineHandle, Event, SubmitError, Submitted};
use super::error::ApiError;
use super::metrics::Metrics;
use super::protocol::*;
use super::text::Detokenizer;
use crate::engine::{FinishReason, SamplingParams};
use crate::text::chat::{ChatMessage, ChatTemplate};
use crate::text::tokenizer::ModelTokenizer;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
/// Stop strings a request may give at most (each token's text is searched
/// for all of them).
pub const MAX_STOPS: usize = 16;
/// Bytes of one stop string at most.
pub const MAX_STOP_BYTES: usize = 256;

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The engine thread.
    pub engine: EngineHandle,
    /// The tokenizer for prompts (encoding switches a flag of it).
    pub encoder: Mutex<ModelTokenizer>,
    /// The tokenizer for answers.
    pub decoder: Tokenizer,
    /// The chat template.
    pub chat_template: Option<ChatTemplate>,
    /// Tokens that end an answer (unless `ignore_eos`).
    pub stop_tokens: Vec<u32>,
    /// The served model's name.
    pub model_name: String,
    /// Token ids are below this.
    pub vocab_size: usize,
    /// Prompt plus new tokens at most.
    pub max_seq_len: usize,
    /// New tokens when a request gives no `max_tokens` (at most what the
    /// context leaves).
    pub default_max_tokens: Option<usize>,
    /// Unix seconds at start.
    pub created: u64,
    /// Metrics.
    pub metrics: Metrics,
}

/// The router over `state`, with bodies limited to `max_body_bytes`.
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    Router::new()
        .route(CHAT, post(chat_completions))
        .route(COMPLETIONS, post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("no route for {uri}")).code("not_found")
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{uri} does not take {method} requests"),
    )
    .code("method_not_allowed")
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.is_alive() {
        (StatusCode::OK, "ok").into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "/health: the engine thread has stopped",
        )
        .into_response()
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: state.model_name.clone(),
            object: "model".into(),
            created: state.created,
            owned_by: "candle-paged-attention".into(),
            max_model_len: state.max_seq_len,
        }],
    })
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    match state.metrics.render() {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("/metrics: {e}"))
            .into_response(),
    }
}

/// Counts a refusal in the metrics and passes it on.
fn refused(state: &AppState, e: ApiError) -> ApiError {
    state
        .metrics
        .refused
        .with_label_values(&[e.status.as_str()])
        .inc();
    e
}

/// The body as JSON: 413 past the size limit, 400 when malformed or not an
/// object.
fn read_json(endpoint: &str, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let bytes = body.map_err(|rejection| {
        let status = rejection.status();
        let message = match status {
            StatusCode::PAYLOAD_TOO_LARGE => {
                format!("{endpoint}: the request body is larger than the server's limit")
            }
            _ => format!(
                "{endpoint}: reading the request body: {}",
                rejection.body_text()
            ),
        };
        ApiError::new(status, message)
    })?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("{endpoint}: the body is not valid JSON: {e}"),
        )
    })?;
    if !value.is_object() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("{endpoint}: the body must be a JSON object"),
        ));
    }
    Ok(value)
}

/// Reads `T` out of `value`, naming the field at fault.
fn fields<T: DeserializeOwned>(endpoint: &str, value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let param = if path == "." { None } else { Some(path) };
        let message = match &param {
            Some(p) => format!("{endpoint}: field {p}: {}", e.inner()),
            None => format!("{endpoint}: {}", e.inner()),
        };
        let err = ApiError::new(StatusCode::BAD_REQUEST, message);
        match param {
            Some(p) => err.param(&p),
            None => err,
        }
    })
}

/// 404 unless `model` is absent, empty or the served model's name.
fn check_model(state: &AppState, endpoint: &str, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        None | Some("") => Ok(()),
        Some(m) if m == state.model_name => Ok(()),
        Some(m) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "{endpoint}: model {m:?} does not exist; this server serves {:?}",
                state.model_name
            ),
        )
        .param("model")
        .code("model_not_found")),
    }
}

/// How a request is answered, after its prompt and parameters are checked.
struct Job {
    endpoint: &'static str,
    chat: bool,
    prompt: Vec<u32>,
    params: SamplingParams,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// Choices and chunks carry `token_ids`.
    return_token_ids: bool,
}

/// Checks the shared fields and builds the sampling parameters for a
/// prompt of `prompt_len` tokens.
fn sampling_params(
    state: &AppState,
    endpoint: &str,
    f: &SamplingFields,
    max_tokens: Option<(u64, &str)>,
    prompt_len: usize,
) -> Result<SamplingParams, ApiError> {
    let bad = |param: &str, msg: String| ApiError::invalid(param, format!("{endpoint}: {msg}"));
    if let Some(n) = f.n {
        if n != 1 {
            return Err(bad("n", format!("n = {n} is not supported (only 1)")));
        }
    }
    let mut penalties = [0f32; 2];
    for (slot, (name, value)) in penalties.iter_mut().zip([
        ("frequency_penalty", f.frequency_penalty),
        ("presence_penalty", f.presence_penalty),
    ]) {
        if let Some(v) = value {
            if !(-2.0..=2.0).contains(&v) {
                return Err(bad(name, format!("{name} must be in [-2, 2], got {v}")));
            }
            *slot = v as f32;
        }
    }
    let [frequency_penalty, presence_penalty] = penalties;
    let min_p = match f.min_p {
        None => None,
        Some(p) if (0.0..=1.0).contains(&p) => (p > 0.0).then_some(p),
        Some(p) => return Err(bad("min_p", format!("min_p must be in [0, 1], got {p}"))),
    };
    let truthy = |v: &Option<Value>| match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(_) => true,
    };
    if truthy(&f.logprobs) {
        return Err(bad("logprobs", "logprobs are not supported".into()));
    }
    if truthy(&f.top_logprobs) {
        return Err(bad("top_logprobs", "top_logprobs are not supported".into()));
    }
    let temperature = f.temperature.unwrap_or(1.0);
    // A draw divides f32 logits by it: past f32's range it would be infinite.
    if !(temperature.is_finite() && temperature >= 0.0 && temperature <= f32::MAX as f64) {
        // Huge values in scientific notation, not hundreds of digits.
        let shown = if temperature.abs() >= 1e16 {
            format!("{temperature:e}")
        } else {
            temperature.to_string()
        };
        return Err(bad(
            "temperature",
            format!(
                "temperature must be finite, at least 0 and at most {:e}, got {shown}",
                f32::MAX
            ),
        ));
    }
    let top_p = match f.top_p {
        None => None,
        Some(p) if p > 0.0 && p <= 1.0 && (p as f32) >= f32::MIN_POSITIVE => (p < 1.0).then_some(p),
        Some(p) => return Err(bad("top_p", format!("top_p must be in (0, 1], got {p}"))),
    };
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(bad(
                "top_k",
                format!("top_k must be at least 1 (or -1 for all tokens), got {k}"),
            ))
        }
    };
    let repeat_penalty = f.repetition_penalty.unwrap_or(1.0);
    if !(repeat_penalty.is_finite() && repeat_penalty > 0.0 && repeat_penalty < f32::MAX as f64) {
        return Err(bad(
            "repetition_penalty",
            format!("repetition_penalty must be finite and positive, got {repeat_penalty}"),
        ));
    }
    let seed = match &f.seed {
        None => {
            // Distinct per request when none is given.
            let t = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            t ^ 0x9e37_79b9_7f4a_7c15
        }
        Some(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(bad("seed", format!("seed must be an integer, got {n}"))),
        },
    };
    let ctx = state.max_seq_len;
    if prompt_len >= ctx {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "{endpoint}: the prompt has {prompt_len} tokens, but the model's context length is {ctx} (prompt plus at least 1 new token)"
            ),
        )
        .code("context_length_exceeded"));
    }
    let room = ctx - prompt_len;
    let max_tokens = match max_tokens {
        None => state.default_max_tokens.unwrap_or(room).min(room),
        Some((0, field)) => {
            return Err(bad(field, format!("{field} must be at least 1, got 0")));
        }
        Some((n, field)) => {
            let n_usize = usize::try_from(n).unwrap_or(usize::MAX);
            if n_usize > room {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "{endpoint}: {prompt_len} prompt tokens + {field} {n} = {} tokens, more than the model's context length of {ctx}",
                        prompt_len as u128 + n as u128
                    ),
                )
                .code("context_length_exceeded"));
            }
            n_usize
        }
    };
    let params = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty: repeat_penalty as f32,
        frequency_penalty,
        presence_penalty,
        seed,
        max_tokens,
        stop_tokens: if f.ignore_eos == Some(true) {
            Vec::new()
        } else {
            state.stop_tokens.clone()
        },
        ..SamplingParams::default()
    };
    params
        .validate()
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("{endpoint}: {e}")))?;
    Ok(params)
}

/// The text of a chat message's `content`: a string, null, or a list of
/// text parts.
fn message_text(k: usize, content: &Value) -> Result<String, ApiError> {
    let param = format!("messages[{k}].content");
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(s))) => text.push_str(s),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            &param,
                            format!(
                                "{CHAT}: {param}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}, got type {}",
                                kind.unwrap_or("(none)")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        other => Err(ApiError::invalid(
            &param,
            format!("{CHAT}: {param} must be a string or a list of text parts, got {other}"),
        )),
    }
}

fn chat_job(state: &AppState, body: Value) -> Result<Job, ApiError> {
    let req: ChatCompletionRequest = fields(CHAT, &body)?;
    let f: SamplingFields = fields(CHAT, &body)?;
    check_model(state, CHAT, req.model.as_deref())?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            format!("{CHAT}: messages must not be empty"),
        ));
    }
    let Some(template) = &state.chat_template else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "{CHAT}: model {:?} has no chat template; use {COMPLETIONS}",
                state.model_name
            ),
        ));
    };
    let messages = req
        .messages
        .iter()
        .enumerate()
        .map(|(k, m)| Ok(ChatMessage::new(&m.role, &message_text(k, &m.content)?)))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let segments = template.render_segments(&messages, true).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("{CHAT}: applying the chat template: {e}"),
        )
    })?;
    let prompt = {
        let mut tok = state.encoder.lock().unwrap_or_else(|p| p.into_inner());
        tok.encode_segments(&segments)
    }
    .map_err(|e| ApiError::invalid("messages", format!("{CHAT}: tokenizing: {e}")))?;
    let max_tokens = match (req.max_completion_tokens, f.max_tokens) {
        (Some(n), _) => Some((n, "max_completion_tokens")),
        (None, Some(n)) => Some((n, "max_tokens")),
        (None, None) => None,
    };
    job(state, CHAT, true, prompt, &f, max_tokens)
}

/// Token ids of a `prompt` list, each below the vocabulary size.
fn prompt_ids(state: &AppState, items: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    let vocab = state.vocab_size;
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) if id < vocab as u64 => Ok(id as u32),
            _ => Err(ApiError::invalid(
                param,
                format!(
                    "{COMPLETIONS}: {param}[{i}] = {v} is not a token id: ids are integers in 0..{vocab}"
                ),
            )),
        })
        .collect()
}

fn completion_job(state: &AppState, body: Value) -> Result<Job, ApiError> {
    let req: CompletionRequest = fields(COMPLETIONS, &body)?;
    let f: SamplingFields = fields(COMPLETIONS, &body)?;
    check_model(state, COMPLETIONS, req.model.as_deref())?;
    let bad = |param: &str, msg: String| ApiError::invalid(param, format!("{COMPLETIONS}: {msg}"));
    if req.echo == Some(true) {
        return Err(bad("echo", "echo = true is not supported".into()));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(bad("suffix", "suffix is not supported".into()));
    }
    if let Some(b) = req.best_of {
        if b != 1 {
            return Err(bad(
                "best_of",
                format!("best_of = {b} is not supported (only 1)"),
            ));
        }
    }
    let encode = |text: &str| -> Result<Vec<u32>, ApiError> {
        let tok = state.encoder.lock().unwrap_or_else(|p| p.into_inner());
        tok.encode_raw(text)
            .map_err(|e| bad("prompt", format!("tokenizing the prompt: {e}")))
    };
    let prompt = match &req.prompt {
        Value::String(s) => encode(s)?,
        Value::Array(items) if items.iter().all(Value::is_number) && !items.is_empty() => {
            prompt_ids(state, items, "prompt")?
        }
        Value::Array(items) if items.len() == 1 => match &items[0] {
            Value::String(s) => encode(s)?,
            Value::Array(ids) => prompt_ids(state, ids, "prompt[0]")?,
            other => {
                return Err(bad(
                    "prompt",
                    format!("prompt[0] must be a string or a list of token ids, got {other}"),
                ))
            }
        },
        Value::Array(items) if items.is_empty() => {
            return Err(bad("prompt", "prompt must not be empty".into()))
        }
        Value::Array(items) => {
            return Err(bad(
                "prompt",
                format!(
                    "a batch of {} prompts is not supported: send one prompt per request",
                    items.len()
                ),
            ))
        }
        other => {
            return Err(bad(
                "prompt",
                format!("prompt must be a string or a list of token ids, got {other}"),
            ))
        }
    };
    if prompt.is_empty() {
        return Err(bad("prompt", "the prompt has no tokens".into()));
    }
    job(
        state,
        COMPLETIONS,
        false,
        prompt,
        &f,
        f.max_tokens.map(|n| (n, "max_tokens")),
    )
}

fn job(
    state: &AppState,
    endpoint: &'static str,
    chat: bool,
    prompt: Vec<u32>,
    f: &SamplingFields,
    max_tokens: Option<(u64, &str)>,
) -> Result<Job, ApiError> {
    let params = sampling_params(state, endpoint, f, max_tokens, prompt.len())?;
    let stops = f.stop.as_ref().map(Stop::strings).unwrap_or_default();
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "{endpoint}: {} stop strings, more than the {MAX_STOPS} allowed",
                stops.len()
            ),
        ));
    }
    if let Some((k, long)) = stops
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "{endpoint}: stop string {k} has {} bytes, more than the {MAX_STOP_BYTES} allowed",
                long.len()
            ),
        ));
    }
    Ok(Job {
        endpoint,
        chat,
        prompt,
        params,
        stops,
        stream: f.stream.unwrap_or(false),
        include_usage: f
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        return_token_ids: f.return_token_ids.unwrap_or(false),
    })
}

/// Reads the body and builds the job on a blocking thread (rendering the
/// chat template and tokenising a long prompt take a while), so that no
/// request stalls the others.
async fn prepare(
    state: &Arc<AppState>,
    endpoint: &'static str,
    body: Result<Bytes, BytesRejection>,
    build: fn(&AppState, Value) -> Result<Job, ApiError>,
) -> Result<Job, ApiError> {
    let value = read_json(endpoint, body)?;
    let state = state.clone();
    tokio::task::spawn_blocking(move || build(&state, value))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{endpoint}: preparing the request: {e}"),
            ))
        })
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let job = prepare(&state, CHAT, body, chat_job).await;
    answer(state, job).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let job = prepare(&state, COMPLETIONS, body, completion_job).await;
    answer(state, job).await
}

/// Submits a checked job and answers it, whole or streamed.
async fn answer(state: Arc<AppState>, job: Result<Job, ApiError>) -> Response {
    let job = match job {
        Ok(j) => j,
        Err(e) => return refused(&state, e).into_response(),
    };
    let submitted = match state
        .engine
        .submit(job.prompt.clone(), job.params.clone())
        .await
    {
        Ok(s) => s,
        Err(e) => {
            let err = match e {
                SubmitError::QueueFull(n) => ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "{}: the server is busy: the queue of waiting requests is full ({n} of {n}); retry later",
                        job.endpoint
                    ),
                )
                .code("queue_full"),
                SubmitError::Invalid(msg) => {
                    ApiError::new(StatusCode::BAD_REQUEST, format!("{}: {msg}", job.endpoint))
                }
                SubmitError::Unavailable => ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("{}: the engine is shutting down", job.endpoint),
                ),
            };
            return refused(&state, err).into_response();
        }
    };
    let answer = Answer::new(state, job, submitted);
    if answer.job.stream {
        stream_answer(answer).into_response()
    } else {
        whole_answer(answer).await
    }
}

/// One request's answer in progress.
struct Answer {
    state: Arc<AppState>,
    job: Job,
    submitted: Submitted,
    text: Detokenizer,
    tokens: usize,
    /// Generated ids not yet sent (with `return_token_ids`).
    pending_ids: Vec<u32>,
    created: u64,
    id: String,
}

/// What the next engine event turned into.
enum Step {
    /// New final text (may be empty).
    Text(String),
    /// The answer ended: its last text and finish reason.
    End(String, &'static str),
    /// The request failed.
    Error(ApiError),
}

impl Answer {
    fn new(state: Arc<AppState>, job: Job, submitted: Submitted) -> Self {
        let id = if job.chat {
            format!("chatcmpl-{}", submitted.id)
        } else {
            format!("cmpl-{}", submitted.id)
        };
        Self {
            text: Detokenizer::new(job.stops.clone()),
            state,
            job,
            submitted,
            tokens: 0,
            pending_ids: Vec::new(),
            created: now_secs(),
            id,
        }
    }

    fn usage(&self) -> Usage {
        Usage::new(self.job.prompt.len(), self.tokens)
    }

    fn internal(&self, msg: String) -> ApiError {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "{}: request {}: {msg}",
                self.job.endpoint, self.submitted.id
            ),
        )
    }

    /// Waits for the next event of the request.
    async fn next(&mut self) -> Step {
        let tokenizer = &self.state.decoder;
        match self.submitted.events.recv().await {
            Some(Event::Token(token)) => {
                self.tokens += 1;
                if self.job.return_token_ids {
                    self.pending_ids.push(token);
                }
                // A stop token ends the answer; its text is not part of it.
                if self.job.params.stop_tokens.contains(&token) {
                    return Step::Text(String::new());
                }
                match self.text.push(tokenizer, token) {
                    Ok(delta) if delta.stopped => {
                        self.state.engine.abort(self.submitted.id, "stop");
                        Step::End(delta.text, "stop")
                    }
                    Ok(delta) => Step::Text(delta.text),
                    Err(e) => {
                        self.state.engine.abort(self.submitted.id, "error");
                        Step::Error(self.internal(format!("decoding token {token}: {e}")))
                    }
                }
            }
            Some(Event::Done(completion)) => {
                let reason = match &completion.finish {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Aborted => {
                        return Step::Error(self.internal("the request was aborted".into()))
                    }
                    FinishReason::Error(msg) => return Step::Error(self.internal(msg.clone())),
                };
                match self.text.finish(tokenizer) {
                    Ok(delta) => Step::End(delta.text, reason),
                    Err(e) => Step::Error(self.internal(format!("decoding: {e}"))),
                }
            }
            Some(Event::Failed(msg)) => Step::Error(self.internal(msg)),
            None => Step::Error(self.internal("the engine thread stopped".into())),
        }
    }

    /// The ids not yet sent, when the request asked for them.
    fn take_ids(&mut self) -> Option<Vec<u32>> {
        self.job
            .return_token_ids
            .then(|| std::mem::take(&mut self.pending_ids))
    }

    fn chunk(&mut self, text: Option<String>, role: bool, finish: Option<&str>) -> String {
        let usage = self.job.include_usage.then_some(None);
        let token_ids = if role { None } else { self.take_ids() };
        let json = if self.job.chat {
            serde_json::to_string(&ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.created,
                model: self.state.model_name.clone(),
                choices: vec![ChatChunkChoice {
                    index: 0,
                    delta: ChatDelta {
                        role: role.then(|| "assistant".to_string()),
                        content: text,
                    },
                    finish_reason: finish.map(str::to_string),
                    logprobs: None,
                    token_ids,
                }],
                usage,
            })
        } else {
            serde_json::to_string(&CompletionResponse {
                id: self.id.clone(),
                object: "text_completion".into(),
                created: self.created,
                model: self.state.model_name.clone(),
                choices: vec![CompletionChoice {
                    index: 0,
                    text: text.unwrap_or_default(),
                    finish_reason: finish.map(str::to_string),
                    logprobs: None,
                    token_ids,
                }],
                usage,
            })
        };
        json.unwrap_or_default()
    }

    fn usage_chunk(&self) -> String {
        let usage = Some(Some(self.usage()));
        let json = if self.job.chat {
            serde_json::to_string(&ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.created,
                model: self.state.model_name.clone(),
                choices: Vec::new(),
                usage,
            })
        } else {
            serde_json::to_string(&CompletionResponse {
                id: self.id.clone(),
                object: "text_completion".into(),
                created: self.created,
                model: self.state.model_name.clone(),
                choices: Vec::new(),
                usage,
            })
        };
        json.unwrap_or_default()
    }
}

async fn whole_answer(mut a: Answer) -> Response {
    let mut text = String::new();
    let finish = loop {
        match a.next().await {
            Step::Text(t) => text.push_str(&t),
            Step::End(t, reason) => {
                text.push_str(&t);
                break reason;
            }
            Step::Error(e) => return e.into_response(),
        }
    };
    let usage = a.usage();
    let token_ids = a.take_ids();
    if a.job.chat {
        Json(ChatCompletionResponse {
            id: a.id.clone(),
            object: "chat.completion".into(),
            created: a.created,
            model: a.state.model_name.clone(),
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessageOut {
                    role: "assistant".into(),
                    content: text,
                },
                finish_reason: Some(finish.into()),
                logprobs: None,
                token_ids,
            }],
            usage,
        })
        .into_response()
    } else {
        Json(CompletionResponse {
            id: a.id.clone(),
            object: "text_completion".into(),
            created: a.created,
            model: a.state.model_name.clone(),
            choices: vec![CompletionChoice {
                index: 0,
                text,
                finish_reason: Some(finish.into()),
                logprobs: None,
                token_ids,
            }],
            usage: Some(Some(usage)),
        })
        .into_response()
    }
}

/// Where a stream is.
enum Phase {
    Start,
    Running,
    Ended,
}

/// Server-sent events: a role chunk (chat), text chunks, a chunk with the
/// finish reason, a usage chunk when asked for, then `[DONE]`; an error
/// ends the stream with `{"error": ...}` and `[DONE]`. Dropping the stream
/// (the client went away) drops the request's receiver, which aborts it.
fn stream_answer(answer: Answer) -> impl IntoResponse {
    let events = stream::unfold((answer, Phase::Start), |(mut a, phase)| async move {
        let data = |s: String| SseEvent::default().data(s);
        match phase {
            Phase::Ended => None,
            Phase::Start => {
                let first = if a.job.chat {
                    vec![data(a.chunk(Some(String::new()), true, None))]
                } else {
                    Vec::new()
                };
                Some((first, (a, Phase::Running)))
            }
            Phase::Running => {
                let mut out = Vec::new();
                let ended = loop {
                    match a.next().await {
                        // A token with no text yet (part of a character)
                        // still gets its chunk when its id is asked for.
                        Step::Text(t) if t.is_empty() && !a.job.return_token_ids => continue,
                        Step::Text(t) => {
                            out.push(data(a.chunk(Some(t), false, None)));
                            break false;
                        }
                        Step::End(t, reason) => {
                            if !t.is_empty() {
                                out.push(data(a.chunk(Some(t), false, None)));
                            }
                            let empty = (!a.job.chat).then(String::new);
                            out.push(data(a.chunk(empty, false, Some(reason))));
                            if a.job.include_usage {
                                out.push(data(a.usage_chunk()));
                            }
                            break true;
                        }
                        Step::Error(e) => {
                            out.push(data(serde_json::to_string(&e.body()).unwrap_or_default()));
                            break true;
                        }
                    }
                };
                if ended {
                    out.push(data("[DONE]".to_string()));
                    Some((out, (a, Phase::Ended)))
                } else {
                    Some((out, (a, Phase::Running)))
                }
            }
        }
    })
    .flat_map(stream::iter)
    .map(Ok::<_, Infallible>);
    Sse::new(events)
}

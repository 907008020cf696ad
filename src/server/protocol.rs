//! The OpenAI wire format: request bodies, responses, stream chunks and
//! error bodies (serde).
//!
//! Request fields the server does not use (`user`, `tools`, ...) are
//! ignored; fields it cannot honour (`n > 1`, `logprobs`, penalties other
//! than 0) are refused by the handlers, naming the field. A body is read as
//! two structs: the endpoint's own fields ([`ChatCompletionRequest`],
//! [`CompletionRequest`]) and the shared [`SamplingFields`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `stop`: one string or a list of strings.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings, empty ones left out.
    pub fn strings(&self) -> Vec<String> {
        let all = match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        };
        all.into_iter().filter(|s| !s.is_empty()).collect()
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling and stopping fields shared by both endpoints (read from
/// the same body as the endpoint's own fields).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    /// New tokens at most (`max_tokens`, or chat's `max_completion_tokens`).
    pub max_tokens: Option<u64>,
    /// Softmax temperature (default 1; 0 is greedy).
    pub temperature: Option<f64>,
    /// Nucleus sampling threshold.
    pub top_p: Option<f64>,
    /// Sample among the `k` most likely tokens (-1 or 0: all).
    pub top_k: Option<i64>,
    /// Random seed (any integer).
    pub seed: Option<serde_json::Number>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Choices per prompt (only 1).
    pub n: Option<u64>,
    /// Repeat penalty (1 is off).
    pub repetition_penalty: Option<f64>,
    /// OpenAI's frequency penalty, in `[-2, 2]` (0 is off).
    pub frequency_penalty: Option<f64>,
    /// OpenAI's presence penalty, in `[-2, 2]` (0 is off).
    pub presence_penalty: Option<f64>,
    /// vLLM's extension: keep tokens at least `min_p` times as likely as
    /// the most likely one, in `[0, 1]` (0 is off).
    pub min_p: Option<f64>,
    /// Log-probabilities (not supported: only absent, null, false or 0).
    pub logprobs: Option<Value>,
    /// Top log-probabilities (not supported: only absent, null or 0).
    pub top_logprobs: Option<Value>,
    /// Keep generating past the model's stop tokens.
    pub ignore_eos: Option<bool>,
    /// vLLM's extension: each choice (and each stream chunk) also carries
    /// the ids of the tokens it holds, as `token_ids`.
    pub return_token_ids: Option<bool>,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
}

/// One message of a chat request.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// A string, a list of `{"type": "text", "text": ...}` parts, or null.
    #[serde(default)]
    pub content: Value,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    /// The model name (must be the served one when given).
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// New tokens at most (newer name of `max_tokens`).
    pub max_completion_tokens: Option<u64>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// The model name (must be the served one when given).
    pub model: Option<String>,
    /// A string, a list of token ids, or a list holding one of those.
    pub prompt: Value,
    /// Echo the prompt (only false).
    pub echo: Option<bool>,
    /// Text after the completion (not supported: only empty).
    pub suffix: Option<String>,
    /// Candidates per choice (only 1).
    pub best_of: Option<u64>,
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// The counts of `prompt` and `completion` tokens.
    pub fn new(prompt: usize, completion: usize) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}

/// An assistant message.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatMessageOut {
    /// Always `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// A choice of a chat answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Always 0.
    pub index: usize,
    /// The answer.
    pub message: ChatMessageOut,
    /// `stop` or `length`.
    pub finish_reason: Option<String>,
    /// Always null.
    pub logprobs: Option<Value>,
    /// With `return_token_ids`: the ids of the generated tokens this
    /// choice (or chunk) holds, a stop token included; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A chat answer (`object: chat.completion`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    /// `chatcmpl-<n>`.
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// The change a chat stream chunk brings.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChatDelta {
    /// `assistant` in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// A choice of a chat stream chunk.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    /// Always 0.
    pub index: usize,
    /// The change.
    pub delta: ChatDelta,
    /// Set in the last chunk of the choice.
    pub finish_reason: Option<String>,
    /// Always null.
    pub logprobs: Option<Value>,
    /// With `return_token_ids`: the ids of the generated tokens this
    /// choice (or chunk) holds, a stop token included; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A chat stream chunk (`object: chat.completion.chunk`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    /// The id shared by all chunks of an answer.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    /// Null, but in the last chunk when `stream_options.include_usage`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// A choice of a text completion (answer or stream chunk).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Always 0.
    pub index: usize,
    /// The (new) text.
    pub text: String,
    /// `stop` or `length` (in a stream, in the last chunk only).
    pub finish_reason: Option<String>,
    /// Always null.
    pub logprobs: Option<Value>,
    /// With `return_token_ids`: the ids of the generated tokens this
    /// choice (or chunk) holds, a stop token included; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A text completion or one of its stream chunks (`object:
/// text_completion`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// `cmpl-<n>`.
    pub id: String,
    /// `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// One choice, or none in a stream's usage chunk.
    pub choices: Vec<CompletionChoice>,
    /// Token counts (in a stream: null but in the last chunk when
    /// `stream_options.include_usage`; absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One model of `GET /v1/models`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelCard {
    /// Its name.
    pub id: String,
    /// `model`.
    pub object: String,
    /// Unix seconds when the server started.
    pub created: u64,
    /// Who serves it.
    pub owned_by: String,
    /// Its context length.
    pub max_model_len: usize,
}

/// `GET /v1/models`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    /// The served model.
    pub data: Vec<ModelCard>,
}

/// The inside of an error body.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorDetail {
    /// What went wrong, naming the endpoint, the field and the value.
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `rate_limit_error`,
    /// `server_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A short code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<String>,
}

/// An OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

//! What goes in and out of the engine: a [`Request`], the [`TokenEvent`]s
//! of its tokens and its [`Completion`] (with its [`FinishReason`]); the
//! state of a request inside the engine; the engine's [`EngineStats`].

use std::time::{Duration, Instant};

use super::sampling::{Sampler, SamplingParams};

/// A prompt to complete.
#[derive(Clone, Debug)]
pub struct Request {
    /// Caller-chosen id, unique among live requests.
    pub id: u64,
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Sampling and stopping.
    pub params: SamplingParams,
}

/// Why a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced a stop token (kept as its last token).
    Stop,
    /// It reached `max_tokens`.
    Length,
    /// [`Engine::abort`](super::Engine::abort) cancelled it.
    Aborted,
    /// It could not go on: the message says why (it names the request). The
    /// completion's tokens are those generated before, all valid. Raised
    /// when a sequence outgrows the KV cache while running alone (its next
    /// token needs more blocks than the whole cache has), when its sampler
    /// fails on its logits (NaN, say), or when the block manager refuses
    /// to admit it.
    Error(String),
}

/// A token produced by [`Engine::step`](super::Engine::step).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenEvent {
    /// The request.
    pub id: u64,
    /// The new token.
    pub token: u32,
    /// Set when this was the sequence's last token.
    pub finished: Option<FinishReason>,
}

/// A finished request: the tokens it generated and why it ended.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The request.
    pub id: u64,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub finish: FinishReason,
    /// From admission to the first token (zero when none was generated).
    pub time_to_first_token: Duration,
    /// From admission to the last token.
    pub latency: Duration,
    /// Times it was preempted (its cache dropped and recomputed).
    pub preemptions: usize,
}

impl Completion {
    /// The error message when the request finished with
    /// [`FinishReason::Error`].
    pub fn error(&self) -> Option<&str> {
        match &self.finish {
            FinishReason::Error(e) => Some(e),
            _ => None,
        }
    }
}

/// A request in the engine: its prompt, what it generated and its sampler.
#[derive(Debug)]
pub(super) struct Sequence {
    /// The request as submitted.
    pub(super) request: Request,
    /// Tokens generated so far.
    pub(super) generated: Vec<u32>,
    /// Sampled but not yet fed back.
    pub(super) pending: Option<u32>,
    /// Picks its tokens (from its sampling parameters).
    pub(super) sampler: Sampler,
    /// When it was queued.
    pub(super) arrival: Instant,
    /// From arrival to its first token.
    pub(super) first_token: Option<Duration>,
    /// Times it was preempted.
    pub(super) preemptions: usize,
}

impl Sequence {
    /// Tokens the cache must hold before decoding resumes: the prompt and
    /// everything generated (after a preemption, all of it is recomputed).
    pub(super) fn context(&self) -> Vec<u32> {
        let mut t = self.request.prompt.clone();
        t.extend_from_slice(&self.generated);
        t
    }

    /// Tokens in context: the prompt and everything generated.
    pub(super) fn context_len(&self) -> usize {
        self.request.prompt.len() + self.generated.len()
    }

    /// Its completion, ended by `finish`.
    pub(super) fn into_completion(self, finish: FinishReason) -> Completion {
        Completion {
            id: self.request.id,
            prompt_len: self.request.prompt.len(),
            tokens: self.generated,
            finish,
            time_to_first_token: self.first_token.unwrap_or_default(),
            latency: self.arrival.elapsed(),
            preemptions: self.preemptions,
        }
    }
}

/// What an engine has done so far (see
/// [`Engine::stats`](super::Engine::stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps whose forward pass succeeded.
    pub steps: usize,
    /// Prompt tokens computed (tokens recomputed after a preemption
    /// included, tokens taken from the prefix cache excluded).
    pub prefill_tokens: usize,
    /// Tokens decoded (one per sequence and decode step).
    pub decode_tokens: usize,
    /// Prompt tokens taken from the prefix cache instead of computed.
    pub prefix_cache_hit_tokens: usize,
    /// Times a running sequence was preempted (its blocks freed, its tokens
    /// recomputed later).
    pub preemptions: usize,
    /// The most full-attention blocks in use at once during a step (shared
    /// blocks once).
    pub peak_used_blocks: usize,
    /// Full-attention blocks in the cache.
    pub num_blocks: usize,
    /// Steps run by replaying a CUDA graph (see
    /// [`Engine::with_cuda_graphs`](super::Engine::with_cuda_graphs)); the
    /// other steps ran eagerly.
    pub graph_steps: usize,
    /// Those of them with prefills or prefill chunks (the rest were
    /// pure-decode steps).
    pub mixed_graph_steps: usize,
    /// CUDA graphs captured (one per bucket shape).
    pub graphs_captured: usize,
    /// Captures that failed (those shapes run eagerly; see
    /// [`Engine::cuda_graph_error`](super::Engine::cuda_graph_error)).
    pub graph_capture_failures: usize,
    /// Kernels one captured decode step launches (the latest decode
    /// graph's kernel nodes; 0 before the first decode capture).
    pub kernels_per_graph_step: usize,
}

//! Continuous batching: an engine that admits requests, schedules chunked
//! prefills and decodes within a token budget, runs the model and samples.
//!
//! Failures are isolated: a request that cannot run is refused by
//! [`Engine::add_request`] or finishes with [`FinishReason::Error`] while the
//! others go on; a step that fails for a reason no request owns (the model,
//! a kernel, the device) is rolled back and its error returned.

#[cfg(feature = "cuda")]
use std::cell::RefCell;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use candle_core::{bail, DType, Device, Error, Result, Tensor, D};

use super::buckets::decode_split_plan_keys;
#[cfg(feature = "cuda")]
use super::graphs::DecodeGraphs;
use super::sampling::{Sampler, SamplingParams};
use crate::cache::{BlockManager, ScheduledBatch, Work};
use crate::models::{PagedKvCache, PagedModel};

const OP: &str = "engine";

/// Limits of one engine step.
///
/// * `max_batch_tokens` - query tokens per step (decodes count one each;
///   prompts are prefilled in chunks that fit what is left; the decodes of
///   all running sequences always run, so keep it `>= max_num_seqs`).
/// * `max_num_seqs` - sequences running at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Token budget of a step.
    pub max_batch_tokens: usize,
    /// Running sequences at most.
    pub max_num_seqs: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            max_num_seqs: 64,
        }
    }
}

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
    /// [`Engine::abort`] cancelled it.
    Aborted,
    /// It could not go on: the message says why (it names the request). The
    /// completion's tokens are those generated before, all valid. Raised
    /// when a sequence outgrows the KV cache while running alone (its next
    /// token needs more blocks than the whole cache has), when its sampler
    /// fails on its logits (NaN, say), or when the block manager refuses
    /// to admit it.
    Error(String),
}

/// A token produced by [`Engine::step`].
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

#[derive(Debug)]
struct Sequence {
    request: Request,
    generated: Vec<u32>,
    /// Sampled but not yet fed back.
    pending: Option<u32>,
    sampler: Sampler,
    arrival: Instant,
    first_token: Option<Duration>,
    preemptions: usize,
}

impl Sequence {
    /// Tokens the cache must hold before decoding resumes: the prompt and
    /// everything generated (after a preemption, all of it is recomputed).
    fn context(&self) -> Vec<u32> {
        let mut t = self.request.prompt.clone();
        t.extend_from_slice(&self.generated);
        t
    }

    fn context_len(&self) -> usize {
        self.request.prompt.len() + self.generated.len()
    }

    fn into_completion(self, finish: FinishReason) -> Completion {
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

/// What an engine has done so far (see [`Engine::stats`]).
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
    /// Decode steps run by replaying a CUDA graph (see
    /// [`Engine::with_cuda_graphs`]); the other steps ran eagerly.
    pub graph_steps: usize,
    /// CUDA graphs captured (one per batch bucket and table width).
    pub graphs_captured: usize,
    /// Captures that failed (those shapes run eagerly; see
    /// [`Engine::cuda_graph_error`]).
    pub graph_capture_failures: usize,
    /// Kernels one captured decode step launches (the latest graph's
    /// kernel nodes; 0 before the first capture).
    pub kernels_per_graph_step: usize,
}

/// What a successful forward pass hands to the sampling of a step.
struct StepLogits {
    /// The argmax of the logit row of each sequence whose sampler takes the
    /// plain argmax (greedy, no repeat penalty), by logit row.
    argmax: Vec<Option<u32>>,
    /// True for a greedy row holding a NaN or infinite logit (its argmax
    /// means nothing), by logit row.
    non_finite: Vec<bool>,
    /// The logit rows of the other sequences (sampled, or penalised), on the host,
    /// by logit row.
    sampled: Vec<Option<Tensor>>,
}

/// Rows `idx` of `(rows, vocab)` `logits`: a view of all of them when `idx`
/// lists every row in order, else one gather on the logits' device.
fn pick_rows(logits: &Tensor, idx: &[usize]) -> Result<Tensor> {
    if idx.iter().copied().eq(0..logits.dim(0)?) {
        return Ok(logits.clone());
    }
    let ids: Vec<u32> = idx.iter().map(|&r| r as u32).collect();
    logits.index_select(&Tensor::new(ids, logits.device())?, 0)
}

/// The argmax of each row of `(rows, vocab)` `logits` and whether the row is
/// finite (no NaN, no infinity), computed on the logits' device and read back
/// in one copy of `2 * rows` integers.
fn greedy_argmax(logits: &Tensor) -> Result<(Vec<u32>, Vec<bool>)> {
    let n = logits.dim(0)?;
    let tokens = logits.argmax(D::Minus1)?;
    // x - x is 0 for a finite logit and NaN for NaN or +-inf, so a row sums
    // to exactly 0 when every logit is finite, and to NaN otherwise.
    let finite = logits
        .sub(logits)?
        .sum(D::Minus1)?
        .eq(0f64)?
        .to_dtype(DType::U32)?;
    let both: Vec<u32> = Tensor::cat(&[&tokens, &finite], 0)?.to_vec1()?;
    let (tokens, finite) = both.split_at(n);
    Ok((tokens.to_vec(), finite.iter().map(|&f| f == 1).collect()))
}

/// Runs requests through a [`PagedModel`] with continuous batching.
///
/// Each [`step`](Self::step) schedules the decodes of all running sequences,
/// then prefill chunks of sequences still reading their prompts, then admits
/// waiting requests while the token budget and `max_num_seqs` allow. When
/// the cache runs out of blocks, the newest admission is put back or the
/// newest running sequence is preempted (its blocks freed, its prompt and
/// generated tokens recomputed later).
///
/// With prefix caching (the cache's [`CacheConfig`](crate::models::CacheConfig)),
/// a prefill takes the cached blocks of its prompt when it is scheduled,
/// including those an earlier sequence computes in the same step (see
/// [`BlockManager`]): prompts submitted together compute a shared prefix
/// once. Prefill chunks are budgeted after the blocks cached by earlier
/// steps, and admission counts the blocks a prompt shares with running
/// sequences as free. [`stats`](Self::stats) counts the tokens reused.
///
/// # Failures
/// * [`add_request`](Self::add_request) refuses what can never run: invalid
///   sampling parameters, an empty prompt, a token id outside the
///   vocabulary, a prompt plus `max_tokens` beyond the model's
///   [`max_seq_len`](PagedModel::max_seq_len), a prompt larger than the
///   whole cache. The error names the request.
/// * A sequence that outgrows the cache while running alone (a prompt chunk
///   is first halved down to one token) finishes with
///   [`FinishReason::Error`] and the tokens generated so far; a sampler
///   that fails on a sequence's logits finishes that sequence the same way.
///   The others go on.
/// * When the forward pass (or reading its logits) fails, the step is
///   rolled back exactly: block allocations, computed positions, the tokens
///   waiting to be fed back, the step's admissions; no token is sampled.
///   `step` and `run` return the error; calling them again retries, and
///   recomputes the same positions with the same tokens. Preemptions the
///   step made stand (a preempted sequence recomputes its tokens later).
///
/// Every step makes progress (a batch runs or a request finishes) or
/// returns an error, so [`run`](Self::run) never spins.
pub struct Engine<'m, M: PagedModel + ?Sized> {
    model: &'m M,
    cache: PagedKvCache,
    manager: BlockManager,
    config: SchedulerConfig,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    completions: Vec<Completion>,
    steps: usize,
    /// Requests finished so far (in any way but an abort).
    finished: usize,
    stats: EngineStats,
    /// The block manager's hit counter when `stats` was last reset.
    hits_base: usize,
    /// Whether pure-decode steps on a CUDA device replay CUDA graphs.
    cuda_graphs: bool,
    #[cfg(feature = "cuda")]
    graphs: RefCell<DecodeGraphs>,
    /// Whether the grow-only scratch buffers of the forward pass have been
    /// sized for the largest step before the first capture.
    #[cfg(feature = "cuda")]
    graph_scratch_sized: std::cell::Cell<bool>,
    /// Graph counters when `stats` was last reset.
    #[cfg(feature = "cuda")]
    graphs_base: super::graphs::GraphStats,
}

impl<'m, M: PagedModel + ?Sized> Engine<'m, M> {
    /// An engine over `model` whose layers store into `cache`.
    pub fn new(model: &'m M, cache: PagedKvCache, config: SchedulerConfig) -> Result<Self> {
        if config.max_batch_tokens == 0 {
            bail!("{OP}: max_batch_tokens must be at least 1, got 0");
        }
        if config.max_num_seqs == 0 {
            bail!("{OP}: max_num_seqs must be at least 1, got 0");
        }
        let manager = cache.block_manager()?;
        Ok(Self {
            model,
            cache,
            manager,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            completions: Vec::new(),
            steps: 0,
            finished: 0,
            stats: EngineStats::default(),
            hits_base: 0,
            cuda_graphs: true,
            #[cfg(feature = "cuda")]
            graphs: RefCell::new(DecodeGraphs::new()),
            #[cfg(feature = "cuda")]
            graph_scratch_sized: std::cell::Cell::new(false),
            #[cfg(feature = "cuda")]
            graphs_base: Default::default(),
        })
    }

    /// Whether pure-decode steps (every running sequence decoding one
    /// token, at most 256 of them) on a CUDA device run as CUDA-graph
    /// replays: on (the default), each batch bucket and table width is
    /// captured on its first step and replayed after (see
    /// [`DecodeGraphs`](crate::engine::DecodeGraphs), feature
    /// `cuda`); off, every step launches its kernels one by one. Prefills
    /// and mixed steps always run eagerly; on the CPU, or built without the
    /// `cuda` feature, this has no effect. The tokens are the same either way.
    pub fn with_cuda_graphs(mut self, enable: bool) -> Self {
        self.cuda_graphs = enable;
        self
    }

    /// True when decode steps may replay CUDA graphs: graphs are on
    /// ([`with_cuda_graphs`](Self::with_cuda_graphs)), the crate has the
    /// `cuda` feature and the model is on a CUDA device.
    pub fn uses_cuda_graphs(&self) -> bool {
        self.cuda_graphs && cfg!(feature = "cuda") && self.model.device().is_cuda()
    }

    /// Captures, before any request runs, the decode graphs of every batch
    /// bucket up to `max_num_seqs` sequences (see
    /// [`BATCH_BUCKETS`](crate::engine::BATCH_BUCKETS)) for
    /// sequences of up to `max_context` tokens, so that no step pays for a
    /// capture later (vLLM captures at start-up too). Returns the graphs
    /// ready; 0 when graphs are off or unavailable (see
    /// [`uses_cuda_graphs`](Self::uses_cuda_graphs)).
    pub fn capture_cuda_graphs(&mut self, max_context: usize) -> Result<usize> {
        if !self.uses_cuda_graphs() {
            return Ok(0);
        }
        #[cfg(feature = "cuda")]
        {
            use super::buckets::{decode_bucket, BATCH_BUCKETS, MIN_TABLE_WIDTH};
            let bs = self.cache.block_size();
            let Some((_, max_width)) = decode_bucket(1, max_context.div_ceil(bs)) else {
                return Ok(0);
            };
            self.size_graph_scratch()?;
            let mut ready = 0;
            let mut graphs = self.graphs.borrow_mut();
            // Largest first: no capture grows a scratch buffer an earlier
            // graph uses.
            for &b in BATCH_BUCKETS.iter().rev() {
                if b > self.config.max_num_seqs.next_power_of_two() {
                    continue;
                }
                let mut w = MIN_TABLE_WIDTH;
                while w <= max_width {
                    let padding = self.manager.padding_batch(b, w, &Device::Cpu)?;
                    ready += graphs.capture(self.model, &self.cache, &padding)? as usize;
                    w *= 2;
                }
            }
            Ok(ready)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = max_context;
            Ok(0)
        }
    }

    /// Why the most recent CUDA-graph capture failed (its shape then runs
    /// eagerly), if one did.
    pub fn cuda_graph_error(&self) -> Option<String> {
        #[cfg(feature = "cuda")]
        {
            self.graphs.borrow().last_error().map(str::to_owned)
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }

    /// Queues a request; it joins the running batch at a later step.
    ///
    /// Fails, naming the request, when its sampling parameters are invalid,
    /// its prompt is empty, its id is already queued or running, a prompt
    /// token is `>= vocab_size`, its prompt length plus `max_tokens` exceeds
    /// the model's context length, or its prompt needs more blocks than the
    /// whole cache has. A refused request is not queued.
    pub fn add_request(&mut self, request: Request) -> Result<()> {
        let id = request.id;
        request
            .params
            .validate()
            .map_err(|e| Error::msg(format!("{OP}: request {id}: {e}")))?;
        let prompt = &request.prompt;
        if prompt.is_empty() {
            bail!("{OP}: request {id} has an empty prompt");
        }
        if self
            .running
            .iter()
            .chain(&self.waiting)
            .any(|s| s.request.id == id)
        {
            bail!("{OP}: request id {id} is already queued or running");
        }
        let vocab = self.model.vocab_size();
        if let Some((pos, tok)) = prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            bail!(
                "{OP}: request {id} has token id {tok} at prompt position {pos}, outside the model's vocabulary of {vocab} tokens"
            );
        }
        let max_len = self.model.max_seq_len();
        let max_tokens = request.params.max_tokens;
        match prompt.len().checked_add(max_tokens) {
            Some(total) if total <= max_len => {}
            total => bail!(
                "{OP}: request {id} needs {} prompt tokens + {max_tokens} new tokens = {} positions, more than the model's context length of {max_len}",
                prompt.len(),
                total.map_or_else(|| "more than usize::MAX".to_string(), |t| t.to_string())
            ),
        }
        let (bs, num_blocks) = (self.cache.block_size(), self.cache.config().num_blocks);
        let need = prompt.len().div_ceil(bs);
        if need > num_blocks {
            bail!(
                "{OP}: request {id} has {} prompt tokens, which need {need} blocks of {bs} tokens, but the KV cache has {num_blocks} blocks in all",
                prompt.len()
            );
        }
        self.waiting.push_back(Sequence {
            sampler: Sampler::new(&request.params),
            request,
            generated: Vec::new(),
            pending: None,
            arrival: Instant::now(),
            first_token: None,
            preemptions: 0,
        });
        Ok(())
    }

    /// Cancels request `id`, waiting or running, and frees its blocks.
    ///
    /// Returns its completion ([`FinishReason::Aborted`], with the tokens
    /// generated so far), or `None` when no such request is waiting or
    /// running (it may have finished already: its completion is then among
    /// those of [`take_completions`](Self::take_completions)). An aborted
    /// request never appears among the engine's completions.
    pub fn abort(&mut self, id: u64) -> Result<Option<Completion>> {
        if let Some(pos) = self.waiting.iter().position(|s| s.request.id == id) {
            // Waiting sequences hold no blocks (preemption freed them).
            return Ok(self
                .waiting
                .remove(pos)
                .map(|seq| seq.into_completion(FinishReason::Aborted)));
        }
        let Some(pos) = self.running.iter().position(|s| s.request.id == id) else {
            return Ok(None);
        };
        let seq = self.running.remove(pos);
        self.manager.free(id)?;
        Ok(Some(seq.into_completion(FinishReason::Aborted)))
    }

    /// True while requests are waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Sequences in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting to join the running batch (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Steps run so far (batches whose forward pass succeeded).
    pub fn num_steps(&self) -> usize {
        self.steps
    }

    /// The caches.
    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// The block manager (which blocks each running sequence holds).
    pub fn block_manager(&self) -> &BlockManager {
        &self.manager
    }

    /// Counters of the steps run since the engine was built or
    /// [`reset_stats`](Self::reset_stats) was last called.
    pub fn stats(&self) -> EngineStats {
        let stats = EngineStats {
            prefix_cache_hit_tokens: self
                .manager
                .prefix_cache_hit_tokens()
                .saturating_sub(self.hits_base),
            num_blocks: self.manager.num_blocks(),
            ..self.stats
        };
        #[cfg(feature = "cuda")]
        let stats = {
            let (g, base) = (self.graphs.borrow().stats(), self.graphs_base);
            EngineStats {
                graph_steps: g.replays - base.replays,
                graphs_captured: g.captured - base.captured,
                graph_capture_failures: g.failed - base.failed,
                kernels_per_graph_step: g.kernels_per_step,
                ..stats
            }
        };
        stats
    }

    /// Starts the counters of [`stats`](Self::stats) afresh (after a
    /// warm-up, say); the peak block use restarts from the blocks in use now.
    pub fn reset_stats(&mut self) {
        self.stats = EngineStats {
            peak_used_blocks: self.manager.num_used_blocks(),
            ..EngineStats::default()
        };
        self.hits_base = self.manager.prefix_cache_hit_tokens();
        #[cfg(feature = "cuda")]
        {
            self.graphs_base = self.graphs.borrow().stats();
        }
    }

    /// Finished requests, in the order they finished (drained).
    pub fn take_completions(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.completions)
    }

    /// Runs steps until every request has finished; `on_token` sees each
    /// token as it is sampled. Returns the completions in finishing order
    /// (requests that ended with [`FinishReason::Error`] included).
    ///
    /// When a step fails (see [`step`](Self::step)), returns its error at
    /// once: the step is rolled back, the completions of the requests that
    /// finished before stay in [`take_completions`](Self::take_completions),
    /// and calling `run` again retries.
    pub fn run(&mut self, mut on_token: impl FnMut(&TokenEvent)) -> Result<Vec<Completion>> {
        while self.has_work() {
            let before = (self.steps, self.finished);
            for ev in self.step()? {
                on_token(&ev);
            }
            if (self.steps, self.finished) == before {
                // Every step runs a batch or finishes a request; this guards
                // the loop against a scheduling bug all the same.
                bail!(
                    "{OP}: a step made no progress ({} waiting, {} running requests, {} of {} blocks free)",
                    self.waiting.len(),
                    self.running.len(),
                    self.manager.num_free_blocks(),
                    self.cache.config().num_blocks
                );
            }
        }
        Ok(self.take_completions())
    }

    /// Schedules and runs one batch; returns the tokens it sampled (none
    /// when the batch only computed prompt chunks, or when the step only
    /// finished requests with errors).
    ///
    /// Requests that cannot go on finish with [`FinishReason::Error`] (see
    /// [`Engine`]); their completions wait in
    /// [`take_completions`](Self::take_completions). When the forward pass
    /// fails, the step is rolled back exactly and its error returned: call
    /// `step` again to retry it.
    pub fn step(&mut self) -> Result<Vec<TokenEvent>> {
        if !self.has_work() {
            return Ok(Vec::new());
        }
        let mut admitted = self.admit();
        // At most this many prompt tokens per sequence: halved while a lone
        // sequence's chunk does not fit (sliding-window pools).
        let mut chunk_limit = usize::MAX;
        loop {
            let work = self.plan(chunk_limit);
            if work.is_empty() {
                if !self.has_work() {
                    // This step finished every request with an error.
                    return Ok(Vec::new());
                }
                bail!(
                    "{OP}: nothing can be scheduled although {} requests wait and {} run (max_num_seqs {})",
                    self.waiting.len(),
                    self.running.len(),
                    self.config.max_num_seqs
                );
            }
            let shortfall = match self.manager.shortfall(&work) {
                Ok(s) => s,
                Err(e) => {
                    self.unadmit(admitted)?;
                    return Err(e);
                }
            };
            let Some(why) = shortfall else {
                // A decode step that may replay a graph is built on the host:
                // its values are copied into the graph's inputs.
                let graph_step = self.uses_cuda_graphs()
                    && work.iter().all(|w| matches!(w, Work::Decode { .. }));
                let device = if graph_step {
                    &Device::Cpu
                } else {
                    self.model.device()
                };
                let mut batch = match self.manager.schedule(&work, device) {
                    Ok(batch) => batch,
                    Err(e) => {
                        self.unadmit(admitted)?;
                        return Err(e);
                    }
                };
                if batch.metadata.batch().host().is_pure_decode() {
                    // Eager or graph, a decode step plans split-KV for its
                    // bucket's width (see `decode_split_plan_keys`).
                    let host = batch.metadata.batch().host();
                    let keys = decode_split_plan_keys(host.block_table_width(), host.block_size());
                    batch.metadata = batch.metadata.with_split_plan_keys(keys);
                }
                return self.run_batch(batch, admitted);
            };
            if self.running.len() > 1 {
                if admitted > 0 {
                    self.unadmit(1)?;
                    admitted -= 1;
                } else {
                    self.preempt_newest()?;
                }
                continue;
            }
            // One sequence alone: smaller prompt chunks may fit the window
            // pools; a single token that does not fit never will.
            let largest_chunk = work
                .iter()
                .filter_map(|w| match w {
                    Work::Prefill { num_tokens, .. } => Some(*num_tokens),
                    Work::Decode { .. } => None,
                })
                .max()
                .unwrap_or(0);
            if largest_chunk > 1 {
                chunk_limit = largest_chunk / 2;
                continue;
            }
            self.fail_running_alone(&why)?;
            admitted = self.admit();
            chunk_limit = usize::MAX;
        }
    }

    /// Moves waiting requests into the running batch while sequences and a
    /// rough block estimate allow; returns how many joined. A request the
    /// block manager refuses finishes with an error.
    fn admit(&mut self) -> usize {
        let bs = self.cache.block_size();
        let mut free = self.manager.num_free_blocks();
        let mut admitted = 0;
        while self.running.len() < self.config.max_num_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            // Cached blocks other sequences use are shared, not taken.
            let shared = if self.cache.config().prefix_caching {
                self.manager.shared_prefix_blocks(&seq.context())
            } else {
                0
            };
            let need = seq.context_len().div_ceil(bs).saturating_sub(shared);
            // The first admission of an empty batch always tries, so that a
            // sequence too large for the cache ends with an error instead of
            // waiting forever.
            if need > free && !(self.running.is_empty() && admitted == 0) {
                break;
            }
            let Some(seq) = self.waiting.pop_front() else {
                break;
            };
            if let Err(e) = self.manager.add_sequence(seq.request.id, &seq.context()) {
                let why = format!("{OP}: request {} cannot be admitted: {e}", seq.request.id);
                self.finished += 1;
                self.completions
                    .push(seq.into_completion(FinishReason::Error(why)));
                continue;
            }
            free = free.saturating_sub(need);
            self.running.push(seq);
            admitted += 1;
        }
        admitted
    }

    /// Takes the `n` newest admissions back to the front of the waiting
    /// queue, in their order.
    fn unadmit(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let Some(seq) = self.running.pop() else {
                bail!("{OP}: cannot take back an admission: no sequence is running");
            };
            self.manager.free(seq.request.id)?;
            self.waiting.push_front(seq);
        }
        Ok(())
    }

    /// Frees the newest running sequence and queues it for recomputation.
    fn preempt_newest(&mut self) -> Result<()> {
        let Some(mut seq) = self.running.pop() else {
            bail!("{OP}: cannot preempt: no sequence is running");
        };
        self.manager.free(seq.request.id)?;
        seq.pending = None;
        seq.preemptions += 1;
        self.stats.preemptions += 1;
        self.waiting.push_front(seq);
        Ok(())
    }

    /// Finishes the only running sequence, which cannot get the blocks of
    /// its next token even with the whole cache to itself.
    fn fail_running_alone(&mut self, why: &str) -> Result<()> {
        let Some(seq) = self.running.pop() else {
            bail!("{OP}: no running sequence to finish ({why})");
        };
        let id = seq.request.id;
        self.manager.free(id)?;
        let msg = format!(
            "{OP}: request {id} outgrew the KV cache: with {} tokens in context it needs more blocks than the cache has even alone ({} blocks of {} tokens); it ends with the {} tokens generated so far ({why})",
            seq.context_len(),
            self.cache.config().num_blocks,
            self.cache.block_size(),
            seq.generated.len()
        );
        self.finished += 1;
        self.completions
            .push(seq.into_completion(FinishReason::Error(msg)));
        Ok(())
    }

    /// Decodes first, then prefill chunks of at most `chunk_limit` tokens,
    /// within the token budget.
    fn plan(&self, chunk_limit: usize) -> Vec<Work> {
        let mut budget = self.config.max_batch_tokens;
        let mut work = Vec::with_capacity(self.running.len());
        for seq in &self.running {
            if let Some(token) = seq.pending {
                work.push(Work::Decode {
                    seq_id: seq.request.id,
                    token,
                });
                budget = budget.saturating_sub(1);
            }
        }
        for seq in &self.running {
            if seq.pending.is_some() || budget == 0 {
                continue;
            }
            let id = seq.request.id;
            let total = self.manager.tokens(id).map_or(0, |t| t.len());
            let done = self.manager.num_computed(id).unwrap_or(total);
            // Blocks cached by earlier steps are taken, not computed: they
            // cost no budget. (Blocks that earlier items of this step compute
            // are taken too, leaving part of this item's budget unused.)
            let cached = self.manager.cached_prefix_len(id);
            let n = total
                .saturating_sub(done.saturating_add(cached))
                .min(budget)
                .min(chunk_limit);
            if n > 0 {
                work.push(Work::Prefill {
                    seq_id: id,
                    num_tokens: n,
                });
                budget -= n;
            }
        }
        work
    }

    /// Runs the model on `batch` and reads what sampling needs: everything
    /// that can fail for a reason no request owns, with nothing changed.
    fn forward(&self, batch: &ScheduledBatch, ready: &[usize]) -> Result<StepLogits> {
        let dev = self.model.device();
        let input = || Tensor::new(batch.token_ids.as_slice(), dev);
        if ready.is_empty() {
            // Only prompt chunks that do not end their prompts: the keys and
            // values are stored, no logits are needed (one row is computed).
            self.model
                .forward(&input()?, &batch.metadata, &self.cache, &[0])?;
            return Ok(StepLogits {
                argmax: Vec::new(),
                non_finite: Vec::new(),
                sampled: Vec::new(),
            });
        }
        let rows: Vec<usize> = ready.iter().map(|&i| batch.last_rows[i]).collect();
        let logits = if batch.metadata.device().is_cpu() && !dev.is_cpu() {
            self.host_built_forward(batch, &rows)?
        } else {
            self.model
                .forward(&input()?, &batch.metadata, &self.cache, &rows)?
        };
        let vocab = self.model.vocab_size();
        if logits.dims() != [rows.len(), vocab] {
            bail!(
                "{OP}: the model returned logits of shape {:?} for {} rows of a {vocab}-token vocabulary",
                logits.dims(),
                rows.len()
            );
        }
        let greedy: Vec<bool> = ready
            .iter()
            .map(|&i| {
                self.running
                    .iter()
                    .find(|s| s.request.id == batch.seq_ids[i])
                    .is_none_or(|s| s.sampler.is_greedy())
            })
            .collect();
        let (greedy_rows, sampled_rows): (Vec<usize>, Vec<usize>) =
            (0..rows.len()).partition(|&r| greedy[r]);
        // Greedy rows take their argmax on the logits' device in one pass
        // and one copy, instead of one copy of a vocabulary row per sequence;
        // the copy also carries a finiteness flag per row.
        let mut argmax = vec![None; rows.len()];
        let mut non_finite = vec![false; rows.len()];
        if !greedy_rows.is_empty() {
            let (tokens, finite) = greedy_argmax(&pick_rows(&logits, &greedy_rows)?)?;
            for ((&r, t), ok) in greedy_rows.iter().zip(tokens).zip(finite) {
                argmax[r] = Some(t);
                non_finite[r] = !ok;
            }
        }
        // Sampled rows come to the host in one copy, without the greedy ones.
        let mut sampled = vec![None; rows.len()];
        if !sampled_rows.is_empty() {
            let host = pick_rows(&logits, &sampled_rows)?.to_device(&Device::Cpu)?;
            for (j, &r) in sampled_rows.iter().enumerate() {
                sampled[r] = Some(host.get(j)?);
            }
        }
        Ok(StepLogits {
            argmax,
            non_finite,
            sampled,
        })
    }

    /// Runs a decode step whose metadata was built on the host: through its
    /// CUDA graph when one applies, else eagerly on the metadata moved to
    /// the model's device.
    fn host_built_forward(&self, batch: &ScheduledBatch, rows: &[usize]) -> Result<Tensor> {
        // A graph computes the logits of every row, in order.
        #[cfg(feature = "cuda")]
        if rows.iter().copied().eq(0..batch.metadata.num_tokens()) {
            self.size_graph_scratch()?;
            let graphs = self.graphs.try_borrow_mut();
            let mut graphs =
                graphs.map_err(|_| Error::Msg(format!("{OP}: the decode graphs are in use")))?;
            if let Some(logits) =
                graphs.forward(self.model, &self.cache, &batch.token_ids, &batch.metadata)?
            {
                return Ok(logits);
            }
        }
        let host = batch.metadata.batch().host();
        let metadata = batch.metadata.padded(
            host.num_seqs(),
            host.block_table_width(),
            self.model.device(),
        )?;
        let input = Tensor::new(batch.token_ids.as_slice(), self.model.device())?;
        self.model.forward(&input, &metadata, &self.cache, rows)
    }

    /// Runs, once before the first CUDA-graph capture, the largest eager
    /// forward passes the engine will ever run: a step of
    /// `max(max_batch_tokens, max_num_seqs)` tokens and a decode of 8
    /// sequences, on padding sequences that store nothing.
    ///
    /// Some kernels keep grow-only scratch buffers (candle's quantized
    /// matmuls: one for batches of up to 8 rows, one for larger ones) and
    /// free the old buffer when they grow; a graph captured before such a
    /// growth would go on using the freed memory. Sized first, they never
    /// grow again. (The split-KV workspace of the attention kernels keeps
    /// its replaced buffers instead.)
    #[cfg(feature = "cuda")]
    fn size_graph_scratch(&self) -> Result<()> {
        if self.graph_scratch_sized.get() {
            return Ok(());
        }
        let dev = self.model.device();
        let largest = self.config.max_batch_tokens.max(self.config.max_num_seqs);
        for (seqs, logit_rows) in [(largest, self.config.max_num_seqs.min(largest)), (8, 8)] {
            let padding = self
                .manager
                .padding_batch(seqs, super::buckets::MIN_TABLE_WIDTH, dev)?;
            let input = Tensor::zeros(seqs, candle_core::DType::U32, dev)?;
            let rows: Vec<usize> = (0..logit_rows).collect();
            self.model.forward(&input, &padding, &self.cache, &rows)?;
        }
        self.graph_scratch_sized.set(true);
        Ok(())
    }

    fn run_batch(&mut self, batch: ScheduledBatch, admitted: usize) -> Result<Vec<TokenEvent>> {
        let ready: Vec<usize> = (0..batch.seq_ids.len())
            .filter(|&i| batch.ready[i])
            .collect();
        let logits = match self.forward(&batch, &ready) {
            Ok(l) => l,
            Err(e) => {
                let (seqs, tokens) = (batch.seq_ids.len(), batch.token_ids.len());
                self.manager.rollback(batch)?;
                self.unadmit(admitted)?;
                return Err(e.context(format!(
                    "{OP}: the forward pass of a batch of {seqs} sequences and {tokens} tokens failed; the step was rolled back and can be retried"
                )));
            }
        };
        // The step is committed: nothing below fails for a reason no request owns.
        self.steps += 1;
        let decodes = batch
            .seq_ids
            .iter()
            .filter(|id| {
                self.running
                    .iter()
                    .any(|s| s.request.id == **id && s.pending.is_some())
            })
            .count();
        self.stats.steps += 1;
        self.stats.decode_tokens += decodes;
        self.stats.prefill_tokens += batch.token_ids.len().saturating_sub(decodes);
        self.stats.peak_used_blocks = self
            .stats
            .peak_used_blocks
            .max(self.manager.num_used_blocks());
        for seq in &mut self.running {
            if batch.seq_ids.contains(&seq.request.id) {
                seq.pending = None;
            }
        }
        let mut events = Vec::with_capacity(ready.len());
        let mut finished = Vec::new();
        for (r, &i) in ready.iter().enumerate() {
            let id = batch.seq_ids[i];
            let Some(seq) = self.running.iter_mut().find(|s| s.request.id == id) else {
                bail!("{OP}: scheduled sequence {id} is not running");
            };
            if logits.non_finite.get(r).copied().unwrap_or(false) {
                let why = format!(
                    "{OP}: request {id}: the model gave non-finite logits (NaN or infinity) for its next token; greedy decoding cannot pick one"
                );
                finished.push((id, FinishReason::Error(why)));
                continue;
            }
            let token = match (&logits.sampled[r], logits.argmax.get(r).copied().flatten()) {
                (Some(row), _) => {
                    match seq.sampler.sample(row, &seq.request.prompt, &seq.generated) {
                        Ok(t) => t,
                        Err(e) => {
                            let why =
                                format!("{OP}: request {id}: sampling its next token failed: {e}");
                            finished.push((id, FinishReason::Error(why)));
                            continue;
                        }
                    }
                }
                (None, Some(t)) => t,
                (None, None) => bail!("{OP}: no logits were read for request {id}"),
            };
            seq.generated.push(token);
            seq.first_token.get_or_insert_with(|| seq.arrival.elapsed());
            let finish = if seq.request.params.stop_tokens.contains(&token) {
                Some(FinishReason::Stop)
            } else if seq.generated.len() >= seq.request.params.max_tokens {
                Some(FinishReason::Length)
            } else {
                seq.pending = Some(token);
                None
            };
            if let Some(f) = &finish {
                finished.push((id, f.clone()));
            }
            events.push(TokenEvent {
                id,
                token,
                finished: finish,
            });
        }
        for (id, finish) in finished {
            self.finish(id, finish)?;
        }
        Ok(events)
    }

    fn finish(&mut self, id: u64, finish: FinishReason) -> Result<()> {
        let Some(pos) = self.running.iter().position(|s| s.request.id == id) else {
            bail!("{OP}: finished sequence {id} is not running");
        };
        let seq = self.running.remove(pos);
        self.manager.free(id)?;
        self.finished += 1;
        self.completions.push(seq.into_completion(finish));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_argmax_flags_non_finite_rows_and_keeps_the_tokens_of_finite_ones() -> Result<()> {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let rows: [[f32; 5]; 6] = [
            [0.0, 1.0, 3.0, -2.0, 2.5],
            [nan; 5],
            [1.0, 2.0, nan, 0.0, 0.0],
            [1.0, inf, 2.0, 0.0, 0.0],
            [-inf, 1.0, 2.0, 0.0, 0.0],
            // Large finite logits: x - x is still exactly 0.
            [1e38, -1e38, 0.0, 0.0, 1.0],
        ];
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let logits = Tensor::from_vec(flat.clone(), (6, 5), &Device::Cpu)?.to_dtype(dtype)?;
            let (tokens, finite) = greedy_argmax(&logits)?;
            // 1e38 is infinite in f16: that row is flagged there.
            let last = dtype != DType::F16;
            assert_eq!(
                finite,
                [true, false, false, false, false, last],
                "{dtype:?}"
            );
            // The argmax of the finite rows is candle's, unchanged.
            let want: Vec<u32> = logits.argmax(D::Minus1)?.to_vec1()?;
            assert_eq!(tokens, want, "{dtype:?}");
            assert_eq!((tokens[0], tokens[5]), (2, 0), "{dtype:?}");
            // A gather of some rows, as for a batch of greedy and sampled rows.
            let (tokens, finite) = greedy_argmax(&pick_rows(&logits, &[3, 0])?)?;
            assert_eq!((tokens[1], finite), (2, vec![false, true]), "{dtype:?}");
        }
        Ok(())
    }
}

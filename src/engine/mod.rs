//! The continuous-batching engine over a paged model (feature `engine`):
//! sequences join and leave the running batch between steps; prompts are
//! prefilled in chunks that fit a per-step token budget, mixed with the
//! decodes of the other sequences.
//!
//! Each [`Engine::step`] is schedule, run, update: the scheduler
//! (`scheduler.rs`: admission in first-come-first-served order, the
//! chunked-prefill token budget, preemption) picks the step's work; the
//! model runner (`runner.rs`: the batch's metadata and device tensors, the
//! forward pass, the CUDA graphs of its steps, the greedy rows' argmax)
//! runs it; the engine samples and feeds the tokens back to their requests
//! (`request.rs`), or rolls the step back when the forward pass fails.
//! [`CacheSizing`] and [`MemoryProfile`] size the cache before an engine is
//! built.
//!
//! # Several engines in one process
//! Engines may step and capture CUDA graphs on threads of their own at the
//! same time. Engines whose models share one CUDA device handle (a
//! `Device` and its clones: one stream) take turns for their steps and
//! captures (`device_turns.rs`); give each model a handle of its own
//! (`Device::new_cuda` once per model) to run them side by side. One
//! capture runs on a device at a time, and work that synchronizes the
//! whole device (loading a model, creating a handle) must not run while
//! one does: load models before engines step, or hold
//! [`hold_captures`] around the loading. Choose
//! the engine's options through its methods
//! ([`Engine::with_device_picking`] rather than setting
//! `CANDLE_PAGED_ATTENTION_DEVICE_SAMPLING` from the program): changing
//! the environment while other threads run is not safe, since the CUDA
//! libraries read it from C.
//!
//! # Example
//! A tiny Llama with random weights (feature `models`; any [`PagedModel`]
//! works) completes three greedy requests in one continuous batch: the
//! two with the same prompt get the same tokens, the same as that prompt
//! alone in another engine, and every cache block is free at the end.
//! ```
//! # #[cfg(feature = "models")]
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_paged_attention::engine::{
//!     Engine, FinishReason, Request, SamplingParams, SchedulerConfig,
//! };
//! use candle_paged_attention::models::{llama, CacheConfig, PagedKvCache, PagedModel, PagedOptions};
//!
//! let dev = Device::Cpu;
//! let cfg: llama::LlamaConfig = serde_json::from_str(
//!     r#"{"hidden_size": 32, "intermediate_size": 48, "vocab_size": 64,
//!         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
//!         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128}"#,
//! ).map_err(candle_core::Error::wrap)?;
//! let varmap = VarMap::new(); // random weights
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let model = llama::Llama::load(vb, &cfg.into_config(false), PagedOptions::default())?;
//! let engine = || {
//!     let cache =
//!         PagedKvCache::new(&model.attention_layers(), CacheConfig::new(16), DType::F32, &dev)?;
//!     Engine::new(&model, cache, SchedulerConfig::default())
//! };
//! let request = |id, prompt: &[u32]| Request {
//!     id,
//!     prompt: prompt.to_vec(),
//!     params: SamplingParams::greedy(6), // 6 new tokens, no stop token
//! };
//!
//! let mut batch = engine()?;
//! batch.add_request(request(0, &[1, 2, 3, 4, 5]))?;
//! batch.add_request(request(1, &[9, 8, 7]))?;
//! batch.add_request(request(2, &[1, 2, 3, 4, 5]))?;
//! let mut done = batch.run(|_token| {})?; // or `step()` until `!has_work()`
//! done.sort_by_key(|c| c.id);
//! assert_eq!(done.len(), 3);
//! assert!(done.iter().all(|c| c.tokens.len() == 6 && c.finish == FinishReason::Length));
//! assert_eq!(done[0].tokens, done[2].tokens);
//! assert_eq!(batch.block_manager().num_used_blocks(), 0);
//!
//! let mut alone = engine()?;
//! alone.add_request(request(7, &[1, 2, 3, 4, 5]))?;
//! while alone.has_work() {
//!     alone.step()?;
//! }
//! assert_eq!(alone.take_completions()[0].tokens, done[0].tokens);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "models"))]
//! # fn main() {}
//! ```

mod buckets;
mod builder;
mod device_turns;
#[cfg(feature = "cuda")]
mod graphs;
mod pick;
mod profile;
mod request;
mod runner;
mod sampling;
mod scheduler;

use std::time::Instant;

use candle_core::{bail, Error, Result};

pub use buckets::{
    decode_bucket, decode_split_plan_keys, mixed_bucket, BATCH_BUCKETS, MAX_MIXED_GRAPH_TOKENS,
    MIN_TABLE_WIDTH, MIXED_TOKEN_BUCKETS,
};
pub use builder::{EngineBuilder, KvCacheSpec};
pub use device_turns::{hold_captures, Turn};
#[cfg(feature = "cuda")]
pub use graphs::{GraphStats, StepGraphs, MAX_MIXED_GRAPHS};
pub use pick::DevicePicking;
pub use profile::{
    CachePlan, CacheSizing, MemoryProfile, DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION,
};
pub use request::{Completion, EngineStats, FinishReason, Request, TokenEvent};
pub use sampling::{Sampler, SamplingParams};
pub use scheduler::SchedulerConfig;

use crate::cache::{BlockManager, ScheduledBatch};
use crate::models::{PagedKvCache, PagedModel};
use pick::RowPick;
use request::Sequence;
use runner::{ModelRunner, StepLogits};
use scheduler::Scheduler;

const OP: &str = "engine";

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
    /// Builds the steps' batches, runs the model, owns the caches and the
    /// CUDA graphs.
    runner: ModelRunner<'m, M>,
    /// The waiting queue and the running batch.
    scheduler: Scheduler,
    manager: BlockManager,
    completions: Vec<Completion>,
    steps: usize,
    /// Requests finished so far (in any way but an abort).
    finished: usize,
    stats: EngineStats,
    /// The block manager's hit counter when `stats` was last reset.
    hits_base: usize,
    /// Graph counters when `stats` was last reset.
    #[cfg(feature = "cuda")]
    graphs_base: GraphStats,
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
        let scheduler = Scheduler::new(config, cache.config(), cache.block_size());
        Ok(Self {
            runner: ModelRunner::new(model, cache, config),
            scheduler,
            manager,
            completions: Vec::new(),
            steps: 0,
            finished: 0,
            stats: EngineStats::default(),
            hits_base: 0,
            #[cfg(feature = "cuda")]
            graphs_base: Default::default(),
        })
    }

    /// Whether steps on a CUDA device run as CUDA-graph replays: on (the
    /// default), pure-decode steps (at most 256 sequences) and steps with
    /// prefills or prefill chunks (at most 255 sequences and
    /// [`MAX_MIXED_GRAPH_TOKENS`] tokens) are captured per bucket shape on
    /// their first step and replayed after (see `StepGraphs`, feature
    /// `cuda`); off, every step launches its kernels one by one. Larger
    /// steps always run eagerly; on the CPU, or built without the `cuda`
    /// feature, this has no effect. The tokens are the same either way, up
    /// to the rounding of a padded batch in 16-bit activations.
    pub fn with_cuda_graphs(mut self, enable: bool) -> Self {
        self.runner.set_cuda_graphs(enable);
        self
    }

    /// Whether steps with prefills or prefill chunks replay CUDA graphs too
    /// while graphs are on ([`with_cuda_graphs`](Self::with_cuda_graphs)):
    /// on by default; off, only pure-decode steps do (as vLLM's
    /// `FULL_DECODE_ONLY` graph mode). Their attention is planned for their
    /// bucket either way, so the tokens do not change.
    pub fn with_mixed_step_graphs(mut self, enable: bool) -> Self {
        self.runner.set_mixed_graphs(enable);
        self
    }

    /// Which rows of a step's logits on a CUDA device the crate's picking
    /// kernels take ([`DevicePicking`]; the tokens are the same in every
    /// mode). By default [`DevicePicking::from_env`], which is
    /// [`DevicePicking::All`] unless `CANDLE_PAGED_ATTENTION_DEVICE_SAMPLING`
    /// says otherwise. Prefer this to setting the variable from a program:
    /// changing the environment while other threads run (the CUDA driver
    /// reads it from C) is not safe.
    pub fn with_device_picking(mut self, picking: DevicePicking) -> Self {
        self.runner.set_device_picking(picking);
        self
    }

    /// True when steps may replay CUDA graphs: graphs are on
    /// ([`with_cuda_graphs`](Self::with_cuda_graphs)), the crate has the
    /// `cuda` feature and the model is on a CUDA device.
    pub fn uses_cuda_graphs(&self) -> bool {
        self.runner.uses_cuda_graphs()
    }

    /// Captures, before any request runs, the decode graphs of every batch
    /// bucket up to `max_num_seqs` sequences (see [`BATCH_BUCKETS`]) for
    /// sequences of up to `max_context` tokens, and, unless
    /// [`with_mixed_step_graphs`](Self::with_mixed_step_graphs) turned them
    /// off, the graphs of steps with prefills: every bucket of sequences and
    /// tokens ([`MIXED_TOKEN_BUCKETS`], up to the step budget) at the widest
    /// table, so that no step pays for a capture later (vLLM captures at
    /// start-up too). Returns the graphs ready; 0 when graphs are off or
    /// unavailable (see [`uses_cuda_graphs`](Self::uses_cuda_graphs)).
    pub fn capture_cuda_graphs(&mut self, max_context: usize) -> Result<usize> {
        let _turn = device_turns::handle_turn(self.runner.model().device())?;
        self.runner.capture_cuda_graphs(&self.manager, max_context)
    }

    /// Why the most recent CUDA-graph capture failed (its shape then runs
    /// eagerly), if one did.
    pub fn cuda_graph_error(&self) -> Option<String> {
        self.runner.cuda_graph_error()
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
        if self.scheduler.contains(id) {
            bail!("{OP}: request id {id} is already queued or running");
        }
        let model = self.runner.model();
        let vocab = model.vocab_size();
        if let Some((pos, tok)) = prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            bail!(
                "{OP}: request {id} has token id {tok} at prompt position {pos}, outside the model's vocabulary of {vocab} tokens"
            );
        }
        let max_len = model.max_seq_len();
        let max_tokens = request.params.max_tokens;
        match prompt.len().checked_add(max_tokens) {
            Some(total) if total <= max_len => {}
            total => bail!(
                "{OP}: request {id} needs {} prompt tokens + {max_tokens} new tokens = {} positions, more than the model's context length of {max_len}",
                prompt.len(),
                total.map_or_else(|| "more than usize::MAX".to_string(), |t| t.to_string())
            ),
        }
        let cache = self.runner.cache();
        let (bs, num_blocks) = (cache.block_size(), cache.config().num_blocks);
        let need = prompt.len().div_ceil(bs);
        if need > num_blocks {
            bail!(
                "{OP}: request {id} has {} prompt tokens, which need {need} blocks of {bs} tokens, but the KV cache has {num_blocks} blocks in all",
                prompt.len()
            );
        }
        self.scheduler.add(Sequence {
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
        Ok(self
            .scheduler
            .abort(id, &mut self.manager)?
            .map(|seq| seq.into_completion(FinishReason::Aborted)))
    }

    /// True while requests are waiting or running.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Sequences in the running batch.
    pub fn num_running(&self) -> usize {
        self.scheduler.num_running()
    }

    /// Requests waiting to join the running batch (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting()
    }

    /// Steps run so far (batches whose forward pass succeeded).
    pub fn num_steps(&self) -> usize {
        self.steps
    }

    /// The caches.
    pub fn cache(&self) -> &PagedKvCache {
        self.runner.cache()
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
            let (g, base) = (self.runner.graph_stats(), self.graphs_base);
            EngineStats {
                graph_steps: g.replays - base.replays,
                mixed_graph_steps: g.mixed_replays - base.mixed_replays,
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
            self.graphs_base = self.runner.graph_stats();
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
                    self.scheduler.num_waiting(),
                    self.scheduler.num_running(),
                    self.manager.num_free_blocks(),
                    self.runner.cache().config().num_blocks
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
        // Engines sharing a CUDA device handle step one at a time (a
        // capture records whatever enters its stream).
        let _turn = device_turns::handle_turn(self.runner.model().device())?;
        // Schedule: admissions, the step's work, preemptions.
        let scheduled = self.scheduler.schedule(&mut self.manager);
        self.collect_scheduler_outcomes();
        let scheduled = scheduled?;
        if scheduled.work.is_empty() {
            // This step finished every request with an error.
            return Ok(Vec::new());
        }
        let admitted = scheduled.admitted;
        let batch = match self.runner.prepare(&mut self.manager, &scheduled.work) {
            Ok(batch) => batch,
            Err(e) => {
                self.scheduler.unadmit(admitted, &mut self.manager)?;
                return Err(e);
            }
        };
        // Run, then update the sequences with the sampled tokens.
        let ready: Vec<usize> = (0..batch.seq_ids.len())
            .filter(|&i| batch.ready[i])
            .collect();
        let picks: Vec<RowPick> = ready
            .iter()
            .map(|&i| {
                self.scheduler.running(batch.seq_ids[i]).map_or(
                    RowPick {
                        penalties: Vec::new(),
                        draw: None,
                    },
                    |s| s.sampler.row_pick(&s.request.prompt, &s.generated),
                )
            })
            .collect();
        let logits = match self.runner.forward(&self.manager, &batch, &ready, &picks) {
            Ok(l) => l,
            Err(e) => {
                let (seqs, tokens) = (batch.seq_ids.len(), batch.token_ids.len());
                self.manager.rollback(batch)?;
                self.scheduler.unadmit(admitted, &mut self.manager)?;
                return Err(e.context(format!(
                    "{OP}: the forward pass of a batch of {seqs} sequences and {tokens} tokens failed; the step was rolled back and can be retried"
                )));
            }
        };
        self.update(&batch, &ready, logits)
    }

    /// Takes the completions of the requests that scheduling finished and
    /// its preemptions into the engine's completions and counters.
    fn collect_scheduler_outcomes(&mut self) {
        let done = self.scheduler.take_finished();
        self.finished += done.len();
        self.completions.extend(done);
        self.stats.preemptions += self.scheduler.take_preemptions();
    }

    /// Commits a step whose forward pass succeeded: counts it, feeds the
    /// sampled tokens back to their sequences (`ready` lists the batch's
    /// sequences, by index, that got logits) and finishes those that are
    /// done.
    fn update(
        &mut self,
        batch: &ScheduledBatch,
        ready: &[usize],
        logits: StepLogits,
    ) -> Result<Vec<TokenEvent>> {
        // The step is committed: nothing below fails for a reason no request owns.
        self.steps += 1;
        let decodes = batch
            .seq_ids
            .iter()
            .filter(|&&id| {
                self.scheduler
                    .running(id)
                    .is_some_and(|s| s.pending.is_some())
            })
            .count();
        self.stats.steps += 1;
        self.stats.decode_tokens += decodes;
        self.stats.prefill_tokens += batch.token_ids.len().saturating_sub(decodes);
        self.stats.peak_used_blocks = self
            .stats
            .peak_used_blocks
            .max(self.manager.num_used_blocks());
        for seq in self.scheduler.running_mut() {
            if batch.seq_ids.contains(&seq.request.id) {
                seq.pending = None;
            }
        }
        let mut events = Vec::with_capacity(ready.len());
        let mut finished = Vec::new();
        for (r, &i) in ready.iter().enumerate() {
            let id = batch.seq_ids[i];
            let Some(seq) = self
                .scheduler
                .running_mut()
                .iter_mut()
                .find(|s| s.request.id == id)
            else {
                bail!("{OP}: scheduled sequence {id} is not running");
            };
            let token = match logits.tokens.get(r) {
                Some(Ok(token)) => *token,
                Some(Err(detail)) => {
                    let why = format!(
                        "{OP}: request {id}: the model gave non-finite logits (NaN or infinity) for its next token ({detail}); no token can be picked"
                    );
                    finished.push((id, FinishReason::Error(why)));
                    continue;
                }
                None => bail!("{OP}: no token was picked for request {id}"),
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
            let seq = self.scheduler.finish(id, &mut self.manager)?;
            self.finished += 1;
            self.completions.push(seq.into_completion(finish));
        }
        Ok(events)
    }
}

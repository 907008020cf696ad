//! The engine's model runner: turns a step's scheduled work into the
//! batch's metadata and device tensors, runs the model (eagerly, or by
//! replaying a CUDA graph of the step's shape) and reads back what
//! each row's token (picked on the logits' device, [`super::pick`]).

#[cfg(feature = "cuda")]
use std::cell::RefCell;

#[cfg(feature = "cuda")]
use candle_core::Error;
use candle_core::{bail, Device, Result, Tensor};

use super::buckets::{decode_split_plan_keys, MAX_MIXED_GRAPH_TOKENS};
#[cfg(feature = "cuda")]
use super::graphs::StepGraphs;
use super::pick::RowPick;
use super::pick::{first_non_finite, pick_tokens, DevicePicking};
use super::scheduler::SchedulerConfig;
use super::OP;
use crate::cache::{BlockManager, ScheduledBatch, Work};
use crate::models::{PagedKvCache, PagedModel};
use crate::GraphMode;

/// What a successful forward pass hands to the update of a step: the token
/// of each logit row, or for a row whose logits (after its penalties) hold
/// a NaN or an infinity, what it holds (`"token 3 of 32 has logit NaN"`).
pub(super) struct StepLogits {
    pub(super) tokens: Vec<std::result::Result<u32, String>>,
}

/// The first non-finite logit of row `r` of `(rows, vocab)` `logits`, in
/// words (one copy of the row: only for a row that picked no token).
fn non_finite_detail(logits: &Tensor, r: usize) -> Result<String> {
    Ok(first_non_finite(&logits.get(r)?)?.unwrap_or_else(|| {
        "its logits are finite, but not once its penalties are applied".to_string()
    }))
}

/// Runs the steps of an engine on its model and caches, and owns its CUDA
/// graphs.
pub(super) struct ModelRunner<'m, M: PagedModel + ?Sized> {
    model: &'m M,
    cache: PagedKvCache,
    /// The engine's limits (the largest step sizes the graphs' scratch).
    #[cfg(feature = "cuda")]
    config: SchedulerConfig,
    /// Whether steps on a CUDA device replay CUDA graphs.
    cuda_graphs: bool,
    /// Whether steps with prefills do too (else only pure-decode steps).
    mixed_graphs: bool,
    /// Which rows of CUDA logits the crate's picking kernels take.
    picking: DevicePicking,
    #[cfg(feature = "cuda")]
    graphs: RefCell<StepGraphs>,
    /// Whether the grow-only scratch buffers of the forward pass have been
    /// sized for the largest step before the first capture.
    #[cfg(feature = "cuda")]
    graph_scratch_sized: std::cell::Cell<bool>,
}

impl<'m, M: PagedModel + ?Sized> ModelRunner<'m, M> {
    /// A runner of `model` storing into `cache`, with CUDA graphs on.
    pub(super) fn new(model: &'m M, cache: PagedKvCache, config: SchedulerConfig) -> Self {
        #[cfg(not(feature = "cuda"))]
        let _ = config;
        #[cfg(feature = "cuda")]
        let mixed_token_limit = mixed_graph_token_limit(&config);
        Self {
            model,
            cache,
            #[cfg(feature = "cuda")]
            config,
            cuda_graphs: true,
            mixed_graphs: true,
            picking: DevicePicking::from_env(),
            #[cfg(feature = "cuda")]
            graphs: RefCell::new(StepGraphs::new().with_mixed_token_limit(mixed_token_limit)),
            #[cfg(feature = "cuda")]
            graph_scratch_sized: std::cell::Cell::new(false),
        }
    }

    /// The model.
    pub(super) fn model(&self) -> &'m M {
        self.model
    }

    /// The caches.
    pub(super) fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// Turns CUDA graphs of steps on or off.
    pub(super) fn set_cuda_graphs(&mut self, enable: bool) {
        self.cuda_graphs = enable;
    }

    /// Turns CUDA graphs of steps with prefills on or off (pure-decode
    /// steps keep theirs while graphs are on).
    pub(super) fn set_mixed_graphs(&mut self, enable: bool) {
        self.mixed_graphs = enable;
    }

    /// Sets which rows of CUDA logits the crate's picking kernels take.
    pub(super) fn set_device_picking(&mut self, picking: DevicePicking) {
        self.picking = picking;
    }

    /// True when steps may replay CUDA graphs: graphs are on, the
    /// crate has the `cuda` feature and the model is on a CUDA device.
    pub(super) fn uses_cuda_graphs(&self) -> bool {
        self.cuda_graphs && cfg!(feature = "cuda") && self.model.device().is_cuda()
    }

    /// Captures the decode graphs of every batch bucket up to `max_num_seqs`
    /// sequences for sequences of up to `max_context` tokens, and (with
    /// graphs of steps with prefills) those of every bucket of a step with
    /// prefills at the widest table, on padding batches of `manager`;
    /// returns the graphs ready (0 when graphs are off or unavailable).
    pub(super) fn capture_cuda_graphs(
        &self,
        manager: &BlockManager,
        max_context: usize,
    ) -> Result<usize> {
        if !self.uses_cuda_graphs() {
            return Ok(0);
        }
        #[cfg(feature = "cuda")]
        {
            use super::buckets::{
                decode_bucket, BATCH_BUCKETS, MIN_TABLE_WIDTH, MIXED_TOKEN_BUCKETS,
            };
            let bs = self.cache.block_size();
            let Some((_, max_width)) = decode_bucket(1, max_context.div_ceil(bs)) else {
                return Ok(0);
            };
            self.size_graph_scratch(manager)?;
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
                    let padding = manager.padding_batch(b, w, &Device::Cpu)?;
                    ready += graphs.capture(self.model, &self.cache, &padding)? as usize;
                    w *= 2;
                }
            }
            if self.mixed_graphs {
                // Steps with prefills: every (sequences, tokens) bucket a
                // step of at most `max_num_seqs` sequences can take, at the
                // widest table (so one width serves every step).
                graphs.set_mixed_min_width(max_width);
                let padding = manager.padding_batch(1, graphs.mixed_min_width(), &Device::Cpu)?;
                let seqs_limit = BATCH_BUCKETS
                    .iter()
                    .copied()
                    .find(|&b| b > self.config.max_num_seqs)
                    .unwrap_or(0);
                for &b in BATCH_BUCKETS
                    .iter()
                    .rev()
                    .filter(|&&b| b > 1 && b <= seqs_limit)
                {
                    for &t in MIXED_TOKEN_BUCKETS.iter().rev() {
                        if t <= graphs.mixed_token_limit() {
                            ready +=
                                graphs.capture_mixed(self.model, &self.cache, &padding, b, t)?
                                    as usize;
                        }
                    }
                }
            }
            Ok(ready)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (manager, max_context);
            Ok(0)
        }
    }

    /// Why the most recent CUDA-graph capture failed, if one did.
    pub(super) fn cuda_graph_error(&self) -> Option<String> {
        #[cfg(feature = "cuda")]
        {
            self.graphs.borrow().last_error().map(str::to_owned)
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }

    /// The counters of the decode graphs.
    #[cfg(feature = "cuda")]
    pub(super) fn graph_stats(&self) -> super::graphs::GraphStats {
        self.graphs.borrow().stats()
    }

    /// Schedules `work` in `manager` into a batch: on the host for a step
    /// that may replay a graph (its values are copied into the graph's
    /// inputs), else on the model's device. A step that a graph bucket
    /// holds plans its attention for the bucket, graph or not (see
    /// [`decode_split_plan_keys`] and `Self::mixed_plan_keys`).
    pub(super) fn prepare(
        &self,
        manager: &mut BlockManager,
        work: &[Work],
    ) -> Result<ScheduledBatch> {
        // A step that may replay a graph is built on the host: its values
        // are copied into the graph's inputs. Its tokens are at most the
        // work's (prefix-cache hits take some).
        let work_tokens: usize = work
            .iter()
            .map(|w| match w {
                Work::Prefill { num_tokens, .. } => *num_tokens,
                _ => 1,
            })
            .sum();
        let all_decode = work.iter().all(|w| matches!(w, Work::Decode { .. }));
        let graph_step = self.uses_cuda_graphs()
            && (all_decode || (self.mixed_graphs && work_tokens <= MAX_MIXED_GRAPH_TOKENS));
        let device = if graph_step {
            &Device::Cpu
        } else {
            self.model.device()
        };
        let mut batch = manager.schedule(work, device)?;
        let host = batch.metadata.batch().host();
        let (bs, width) = (host.block_size(), host.block_table_width());
        let plan_keys = if host.is_pure_decode() {
            // Eager or graph, a decode step plans split-KV for its
            // bucket's width (see `decode_split_plan_keys`).
            Some(decode_split_plan_keys(width, bs))
        } else {
            self.mixed_plan_keys(host.num_seqs(), host.num_tokens(), width, bs)?
        };
        if let Some(plan_keys) = plan_keys {
            batch.metadata = batch
                .metadata
                .with_graph_mode(GraphMode::Replayable { plan_keys });
        }
        Ok(batch)
    }

    /// The keys a step with prefills of `num_seqs` sequences and
    /// `num_tokens` tokens over tables `width` blocks of `block_size`
    /// plans split-KV for: its graph bucket's `W * block_size`
    /// (`StepGraphs::mixed_shape`), `None` when no bucket holds it or
    /// without the `cuda` feature (no launch plan to make).
    fn mixed_plan_keys(
        &self,
        num_seqs: usize,
        num_tokens: usize,
        width: usize,
        block_size: usize,
    ) -> Result<Option<usize>> {
        #[cfg(feature = "cuda")]
        {
            let graphs = self
                .graphs
                .try_borrow()
                .map_err(|_| Error::Msg(format!("{OP}: the step graphs are in use")))?;
            Ok(graphs
                .mixed_shape(num_seqs, num_tokens, width, block_size)
                .map(|(_, _, w)| w * block_size))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (num_seqs, num_tokens, width, block_size);
            Ok(None)
        }
    }

    /// Runs the model on `batch` and reads what sampling needs: everything
    /// that can fail for a reason no request owns, with nothing changed.
    ///
    /// `ready` lists the batch's sequences (by index) whose logits are
    /// wanted; `picks[r]` says how the sequence `ready[r]` picks its token
    /// (on the logits' device).
    pub(super) fn forward(
        &self,
        manager: &BlockManager,
        batch: &ScheduledBatch,
        ready: &[usize],
        picks: &[RowPick],
    ) -> Result<StepLogits> {
        let dev = self.model.device();
        // Only prompt chunks that do not end their prompts: the keys and
        // values are stored, no logits are needed (one row is computed).
        let rows: Vec<usize> = match ready {
            [] => vec![0],
            _ => ready.iter().map(|&i| batch.last_rows[i]).collect(),
        };
        let logits = if batch.metadata.device().is_cpu() && !dev.is_cpu() {
            self.host_built_forward(manager, batch, &rows)?
        } else {
            let input = Tensor::new(batch.token_ids.as_slice(), dev)?;
            self.model
                .forward(&input, &batch.metadata, &self.cache, &rows)?
        };
        if ready.is_empty() {
            return Ok(StepLogits { tokens: Vec::new() });
        }
        let vocab = self.model.vocab_size();
        if logits.dims() != [rows.len(), vocab] {
            bail!(
                "{OP}: the model returned logits of shape {:?} for {} rows of a {vocab}-token vocabulary",
                logits.dims(),
                rows.len()
            );
        }
        Ok(StepLogits {
            tokens: pick_tokens(&logits, picks, self.picking)?
                .into_iter()
                .enumerate()
                .map(|(r, t)| match t {
                    Some(t) => Ok(Ok(t)),
                    None => non_finite_detail(&logits, r).map(Err),
                })
                .collect::<Result<_>>()?,
        })
    }

    /// Runs a step whose metadata was built on the host: through its CUDA
    /// graph when one applies, else eagerly on the metadata moved to the
    /// model's device.
    fn host_built_forward(
        &self,
        manager: &BlockManager,
        batch: &ScheduledBatch,
        rows: &[usize],
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        {
            self.size_graph_scratch(manager)?;
            let graphs = self.graphs.try_borrow_mut();
            let mut graphs =
                graphs.map_err(|_| Error::Msg(format!("{OP}: the step graphs are in use")))?;
            if let Some(logits) = graphs.forward(
                self.model,
                &self.cache,
                &batch.token_ids,
                &batch.metadata,
                rows,
            )? {
                return Ok(logits);
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = manager;
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
    /// `max(max_batch_tokens, max_num_seqs)` tokens, or of the most tokens
    /// a graph of a step with prefills may hold when that is more (see
    /// [`mixed_graph_token_limit`]), and a decode of 8 sequences, on
    /// padding sequences that store nothing.
    ///
    /// Some kernels keep grow-only scratch buffers (candle's quantized
    /// matmuls: one for batches of up to 8 rows, one for larger ones) and
    /// free the old buffer when they grow; a graph captured before such a
    /// growth would go on using the freed memory. Sized first, they never
    /// grow again. (The split-KV workspace of the attention kernels keeps
    /// its replaced buffers instead.)
    #[cfg(feature = "cuda")]
    fn size_graph_scratch(&self, manager: &BlockManager) -> Result<()> {
        if self.graph_scratch_sized.get() {
            return Ok(());
        }
        let dev = self.model.device();
        let largest = self
            .config
            .max_batch_tokens
            .max(self.config.max_num_seqs)
            .max(mixed_graph_token_limit(&self.config));
        for (seqs, logit_rows) in [(largest, self.config.max_num_seqs.min(largest)), (8, 8)] {
            let padding = manager.padding_batch(seqs, super::buckets::MIN_TABLE_WIDTH, dev)?;
            let input = Tensor::zeros(seqs, candle_core::DType::U32, dev)?;
            let rows: Vec<usize> = (0..logit_rows).collect();
            self.model.forward(&input, &padding, &self.cache, &rows)?;
        }
        self.graph_scratch_sized.set(true);
        Ok(())
    }
}

/// The most tokens a graph of a step with prefills holds, padding included,
/// for an engine of `config`: the token bucket above the step budget
/// (`max_batch_tokens`; a step at the budget pads past it), at most
/// [`MAX_MIXED_GRAPH_TOKENS`]. The engine runs one eager forward of that
/// many tokens before its first capture (`size_graph_scratch`).
#[cfg(feature = "cuda")]
fn mixed_graph_token_limit(config: &SchedulerConfig) -> usize {
    use super::buckets::MIXED_TOKEN_BUCKETS;
    let budget = config.max_batch_tokens.max(config.max_num_seqs);
    MIXED_TOKEN_BUCKETS
        .iter()
        .copied()
        .find(|&t| t > budget)
        .unwrap_or(MAX_MIXED_GRAPH_TOKENS)
}

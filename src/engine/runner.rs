//! The engine's model runner: turns a step's scheduled work into the
//! batch's metadata and device tensors, runs the model (eagerly, or by
//! replaying a CUDA graph of a pure-decode step) and reads back what
//! sampling needs (the greedy rows' argmax and finiteness in one copy, the
//! other rows' logits on the host).

#[cfg(feature = "cuda")]
use std::cell::RefCell;

#[cfg(feature = "cuda")]
use candle_core::Error;
use candle_core::{bail, DType, Device, Result, Tensor, D};

use super::buckets::decode_split_plan_keys;
#[cfg(feature = "cuda")]
use super::graphs::DecodeGraphs;
use super::scheduler::SchedulerConfig;
use super::OP;
use crate::cache::{BlockManager, ScheduledBatch, Work};
use crate::models::{PagedKvCache, PagedModel};
use crate::GraphMode;

/// What a successful forward pass hands to the sampling of a step.
pub(super) struct StepLogits {
    /// The argmax of the logit row of each sequence whose sampler takes the
    /// plain argmax (greedy, no repeat penalty), by logit row.
    pub(super) argmax: Vec<Option<u32>>,
    /// True for a greedy row holding a NaN or infinite logit (its argmax
    /// means nothing), by logit row.
    pub(super) non_finite: Vec<bool>,
    /// The logit rows of the other sequences (sampled, or penalised), on the host,
    /// by logit row.
    pub(super) sampled: Vec<Option<Tensor>>,
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
    if logits.device().is_cuda() && logits.dtype() == DType::F32 {
        // One kernel and one read of the logits for both answers.
        let pairs = crate::ops::greedy::greedy_tokens(logits)?.to_vec2::<u32>()?;
        return Ok(pairs.iter().map(|p| (p[0], p[1] == 1)).unzip());
    }
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

/// Runs the steps of an engine on its model and caches, and owns its CUDA
/// graphs.
pub(super) struct ModelRunner<'m, M: PagedModel + ?Sized> {
    model: &'m M,
    cache: PagedKvCache,
    /// The engine's limits (the largest step sizes the graphs' scratch).
    #[cfg(feature = "cuda")]
    config: SchedulerConfig,
    /// Whether pure-decode steps on a CUDA device replay CUDA graphs.
    cuda_graphs: bool,
    #[cfg(feature = "cuda")]
    graphs: RefCell<DecodeGraphs>,
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
        Self {
            model,
            cache,
            #[cfg(feature = "cuda")]
            config,
            cuda_graphs: true,
            #[cfg(feature = "cuda")]
            graphs: RefCell::new(DecodeGraphs::new()),
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

    /// Turns CUDA graphs of pure-decode steps on or off.
    pub(super) fn set_cuda_graphs(&mut self, enable: bool) {
        self.cuda_graphs = enable;
    }

    /// True when decode steps may replay CUDA graphs: graphs are on, the
    /// crate has the `cuda` feature and the model is on a CUDA device.
    pub(super) fn uses_cuda_graphs(&self) -> bool {
        self.cuda_graphs && cfg!(feature = "cuda") && self.model.device().is_cuda()
    }

    /// Captures the decode graphs of every batch bucket up to `max_num_seqs`
    /// sequences for sequences of up to `max_context` tokens, on padding
    /// batches of `manager`; returns the graphs ready (0 when graphs are off
    /// or unavailable).
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
            use super::buckets::{decode_bucket, BATCH_BUCKETS, MIN_TABLE_WIDTH};
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

    /// Schedules `work` in `manager` into a batch: on the host for a decode
    /// step that may replay a graph (its values are copied into the graph's
    /// inputs), else on the model's device; a pure-decode step plans
    /// split-KV for its bucket's width.
    pub(super) fn prepare(
        &self,
        manager: &mut BlockManager,
        work: &[Work],
    ) -> Result<ScheduledBatch> {
        // A decode step that may replay a graph is built on the host: its
        // values are copied into the graph's inputs.
        let graph_step =
            self.uses_cuda_graphs() && work.iter().all(|w| matches!(w, Work::Decode { .. }));
        let device = if graph_step {
            &Device::Cpu
        } else {
            self.model.device()
        };
        let mut batch = manager.schedule(work, device)?;
        if batch.metadata.batch().host().is_pure_decode() {
            // Eager or graph, a decode step plans split-KV for its
            // bucket's width (see `decode_split_plan_keys`).
            let host = batch.metadata.batch().host();
            let plan_keys = decode_split_plan_keys(host.block_table_width(), host.block_size());
            batch.metadata = batch
                .metadata
                .with_graph_mode(GraphMode::Replayable { plan_keys });
        }
        Ok(batch)
    }

    /// Runs the model on `batch` and reads what sampling needs: everything
    /// that can fail for a reason no request owns, with nothing changed.
    ///
    /// `ready` lists the batch's sequences (by index) whose logits are
    /// wanted; `greedy[r]` says whether the sequence `ready[r]` takes the
    /// plain argmax.
    pub(super) fn forward(
        &self,
        manager: &BlockManager,
        batch: &ScheduledBatch,
        ready: &[usize],
        greedy: &[bool],
    ) -> Result<StepLogits> {
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
            self.host_built_forward(manager, batch, &rows)?
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
    fn host_built_forward(
        &self,
        manager: &BlockManager,
        batch: &ScheduledBatch,
        rows: &[usize],
    ) -> Result<Tensor> {
        // A graph computes the logits of every row, in order.
        #[cfg(feature = "cuda")]
        if rows.iter().copied().eq(0..batch.metadata.num_tokens()) {
            self.size_graph_scratch(manager)?;
            let graphs = self.graphs.try_borrow_mut();
            let mut graphs =
                graphs.map_err(|_| Error::Msg(format!("{OP}: the decode graphs are in use")))?;
            if let Some(logits) =
                graphs.forward(self.model, &self.cache, &batch.token_ids, &batch.metadata)?
            {
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
    fn size_graph_scratch(&self, manager: &BlockManager) -> Result<()> {
        if self.graph_scratch_sized.get() {
            return Ok(());
        }
        let dev = self.model.device();
        let largest = self.config.max_batch_tokens.max(self.config.max_num_seqs);
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

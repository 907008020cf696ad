//! CUDA-graph steps: the forward pass of a step is captured once per shape
//! and replayed with new inputs, for pure-decode steps and for steps with
//! prefills or prefill chunks of up to
//! [`MAX_MIXED_GRAPH_TOKENS`](super::buckets::MAX_MIXED_GRAPH_TOKENS)
//! tokens.
//!
//! A decode step of a small model is launch-bound: hundreds of kernels of a
//! few microseconds each, with host work between them. A graph replays them
//! in one launch. A serving workload's steps mix decodes with prompt chunks;
//! those of a few hundred tokens are launch-bound too.
//!
//! # Shapes
//! A step of `n` decodes runs the graph of its bucket `(B, W)` (see
//! [`decode_bucket`](super::decode_bucket)): padded up to `B` sequences
//! with sequences that store nothing (see [`AttentionMetadata::padded`];
//! their rows are ignored), tables widened to `W` blocks, split-KV planned
//! for `W * block_size` keys, so no launch depends on the lengths that
//! change between replays. A step with prefills runs the graph of its
//! bucket `(B, T, W)` (see [`mixed_bucket`](super::mixed_bucket)): padded
//! to `B` sequences of `T` tokens in all ([`AttentionMetadata::padded_to`]),
//! its attention planned for the shape alone (both launches of a mixed
//! batch, see [`KvSplit::AutoUpTo`](crate::KvSplit::AutoUpTo)).
//!
//! # Inputs and outputs
//! Everything a captured forward reads lives in tensors allocated before the
//! capture and kept with the graph: the token ids `(T,)` u32 and the
//! metadata's tensors ([`AttentionMetadata::tensors`]: `cu_seqlens_q`,
//! `seq_lens`, `block_tables` `(B, W)`, slots, positions, those of each
//! window group, and the `(B,)` logit rows). Before each replay they are
//! overwritten from the host with the step's values (a tensor whose values
//! did not change is skipped). The logits of the `B` logit rows (the
//! step's rows, then row 0 for each padding one) are copied, inside the
//! graph, into a persistent `(B, vocab)` f32 tensor; every other allocation
//! of the forward is made and freed inside the graph. The KV caches and
//! the weights are the model's own tensors.
//!
//! # Capture
//! The first step of a shape runs the forward eagerly on the padded inputs
//! (which loads the kernels, sizes the split-KV workspace, and records the
//! layout parameters candle uploads, through candle's CUDA-graph host-copy
//! cache), then captures the same forward. Host-to-device copies during the
//! capture come from that cache; a copy of data not seen in the eager run
//! fails the capture. A failed capture is reported
//! ([`StepGraphs::last_error`]) and that shape runs eagerly from then on.
//! [`Engine::capture_cuda_graphs`](super::Engine::capture_cuda_graphs)
//! captures the decode buckets and, for steps with prefills, every
//! (sequences, tokens) bucket at the widest table the engine will need
//! (one width for all of them: [`StepGraphs::set_mixed_min_width`]);
//! other shapes are captured on their first step. At most
//! [`MAX_MIXED_GRAPHS`] graphs of steps with prefills; later shapes run
//! eagerly.
//!
//! # Scratch buffers
//! A graph keeps the device addresses it was captured with. Kernels that
//! keep grow-only scratch buffers and free the old one when they grow
//! (candle's quantized matmuls do) would leave a graph captured earlier
//! using freed memory. Before the first capture, run the largest eager
//! forward passes the program will run (the most tokens a step can have,
//! and a decode of 8 sequences), and capture the largest buckets first;
//! [`Engine`](super::Engine) does both. The attention kernels' split-KV
//! workspace keeps the buffers it replaces.
//!
//! Not captured: steps of more than the largest bucket's sequences or
//! tokens, batches with prefix ranges, and models with chunked local
//! attention (whose per-layer remaps are uploaded inside the forward).

use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{
    self, CUgraphInstantiate_flags, CUgraphNodeType, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::{
    bail, CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Result, Tensor,
};

use super::buckets::{decode_bucket, mixed_bucket, MAX_MIXED_GRAPH_TOKENS, MIN_TABLE_WIDTH};
use crate::attention::Attention;
use crate::metadata::{AttentionMetadata, GraphMode};
use crate::models::{PagedKvCache, PagedModel};

const OP: &str = "step-graph";

/// The most graphs of steps with prefills one [`StepGraphs`] captures.
pub const MAX_MIXED_GRAPHS: usize = 128;

/// Counters of the step graphs of one engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps run by replaying a graph.
    pub replays: usize,
    /// Those of them with prefills or prefill chunks.
    pub mixed_replays: usize,
    /// Graphs captured (one per bucket shape seen).
    pub captured: usize,
    /// Those of them for steps with prefills.
    pub mixed_captured: usize,
    /// Captures that failed (those shapes then run eagerly).
    pub failed: usize,
    /// Kernel nodes of the most recently captured decode graph: the
    /// kernels one decode step launches.
    pub kernels_per_step: usize,
    /// All nodes of that graph (kernels, copies, memsets, allocations).
    pub nodes_per_step: usize,
}

/// One captured forward and the tensors it reads and writes.
struct Captured {
    graph: CudaGraph,
    /// `(T,)` u32 token ids.
    input_ids: Tensor,
    /// The padded metadata whose tensors the graph reads.
    metadata: AttentionMetadata,
    /// `(B, vocab)` f32, written by each replay.
    logits: Tensor,
    /// The host values last written into each of `metadata.tensors()`.
    written: Vec<HostValues>,
}

/// The shape a graph is captured for: sequences, tokens, table width.
type ShapeKey = (usize, usize, usize);

/// The CUDA graphs of the steps of one model and cache.
pub struct StepGraphs {
    /// By (sequences, tokens, table width); `None` where the capture failed.
    graphs: HashMap<ShapeKey, Option<Captured>>,
    /// The most tokens (padding included) of a graph of a step with
    /// prefills.
    mixed_token_limit: usize,
    /// The narrowest table of a graph of a step with prefills, in blocks.
    mixed_min_width: usize,
    stats: GraphStats,
    last_error: Option<String>,
}

impl Default for StepGraphs {
    fn default() -> Self {
        Self::new()
    }
}

impl StepGraphs {
    /// No graphs yet: each shape is captured on its first step.
    pub fn new() -> Self {
        Self {
            graphs: HashMap::new(),
            mixed_token_limit: MAX_MIXED_GRAPH_TOKENS,
            mixed_min_width: MIN_TABLE_WIDTH,
            stats: GraphStats::default(),
            last_error: None,
        }
    }

    /// Graphs of steps with prefills hold at most `tokens` tokens, padding
    /// included (and never more than [`MAX_MIXED_GRAPH_TOKENS`]): the most
    /// a step of the program has run eagerly before the first capture, so
    /// that no scratch buffer grows under a graph (see the module docs) and
    /// no replay needs more memory than the largest eager step.
    pub fn with_mixed_token_limit(mut self, tokens: usize) -> Self {
        self.mixed_token_limit = tokens.min(MAX_MIXED_GRAPH_TOKENS);
        self
    }

    /// Graphs of steps with prefills have tables at least `width` blocks
    /// wide (a power of two, at least [`MIN_TABLE_WIDTH`]): one width for
    /// every step up to that many blocks, so that capturing each (sequences,
    /// tokens) bucket once at that width ([`Self::capture_mixed`]) covers
    /// them. Their attention plans split-KV for `width x block_size` keys.
    pub fn set_mixed_min_width(&mut self, width: usize) {
        self.mixed_min_width = width
            .max(MIN_TABLE_WIDTH)
            .checked_next_power_of_two()
            .unwrap_or(width);
    }

    /// The most tokens of a graph of a step with prefills (see
    /// [`Self::with_mixed_token_limit`]).
    pub fn mixed_token_limit(&self) -> usize {
        self.mixed_token_limit
    }

    /// The narrowest table of a graph of a step with prefills, in blocks
    /// (see [`Self::set_mixed_min_width`]).
    pub fn mixed_min_width(&self) -> usize {
        self.mixed_min_width
    }

    /// The bucket `(B, T, W)` of a step with prefills of `num_seqs`
    /// sequences and `num_tokens` tokens whose tables are `width` blocks of
    /// `block_size` tokens, as this object captures it ([`mixed_bucket`],
    /// at least [`Self::mixed_min_width`] wide, at most the token limit);
    /// `None` when no graph of it may be captured.
    pub fn mixed_shape(
        &self,
        num_seqs: usize,
        num_tokens: usize,
        width: usize,
        block_size: usize,
    ) -> Option<(usize, usize, usize)> {
        mixed_bucket(
            num_seqs,
            num_tokens,
            width.max(self.mixed_min_width),
            block_size,
        )
        .filter(|&(_, t, _)| t <= self.mixed_token_limit)
    }

    /// Counters so far.
    pub fn stats(&self) -> GraphStats {
        self.stats
    }

    /// Why the most recent failed capture failed.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// Runs a step through its graph and returns the logits of `rows`,
    /// `(rows.len(), vocab)` f32 (a copy, valid after the next replay).
    /// Returns `None` when this step is not run by a graph (no bucket holds
    /// it, chunked local attention, prefix ranges, a shape whose capture
    /// failed, the mixed graphs' limit reached): run it eagerly then.
    ///
    /// # Arguments
    /// * `model`, `cache` - the model on a CUDA device and its caches.
    /// * `token_ids` - the step's token ids, one per query row.
    /// * `metadata` - the step's metadata built on the CPU (host values only:
    ///   it is checked there and copied into the graph's inputs).
    /// * `rows` - the query rows whose logits are wanted (at most one per
    ///   sequence), each `< token_ids.len()`.
    pub fn forward<M: PagedModel + ?Sized>(
        &mut self,
        model: &M,
        cache: &PagedKvCache,
        token_ids: &[u32],
        metadata: &AttentionMetadata,
        rows: &[usize],
    ) -> Result<Option<Tensor>> {
        let n = metadata.num_seqs();
        let host = metadata.batch().host();
        let layers = model.attention_layers();
        if !model.device().is_cuda()
            || !metadata.device().is_cpu()
            || token_ids.len() != metadata.num_tokens()
            || rows.is_empty()
            || rows.len() > n
            || host.prefix_ranges().iter().any(|r| !r.is_empty())
            || layers
                .iter()
                .any(|a| a.options().attention_chunk_size.is_some())
        {
            return Ok(None);
        }
        let bs = host.block_size();
        let width = host.block_table_width();
        let mixed = !host.is_pure_decode();
        let shape = if mixed {
            self.mixed_shape(n, token_ids.len(), width, bs)
        } else {
            decode_bucket(n, width).map(|(b, w)| (b, b, w))
        };
        let Some((b, t, w)) = shape else {
            return Ok(None);
        };
        let key = (b, t, w);
        if mixed && !self.graphs.contains_key(&key) && self.stats.mixed_captured >= MAX_MIXED_GRAPHS
        {
            return Ok(None);
        }
        // The step's rows, then row 0 for each padding sequence.
        let mut logit_rows = rows.to_vec();
        logit_rows.resize(b, 0);
        let padded = metadata
            .padded_to(b, t, w, &Device::Cpu)?
            .with_graph_mode(GraphMode::Replayable { plan_keys: w * bs })
            .with_logit_rows(&logit_rows)?;
        check_blocks(&layers, cache, &padded)?;
        let mut ids = token_ids.to_vec();
        ids.resize(t, 0);
        let Some(c) = self.ensure(model, cache, &padded, &ids, mixed)? else {
            return Ok(None);
        };
        write_host(&c.input_ids, &HostValues::U32(ids))?;
        let sources = padded.tensors();
        let targets = c.metadata.tensors();
        if sources.len() != targets.len() || sources.len() != c.written.len() {
            bail!(
                "{OP}: the step's metadata lists {} tensors but the graph's {}",
                sources.len(),
                targets.len()
            );
        }
        for ((src, dst), last) in sources.iter().zip(&targets).zip(c.written.iter_mut()) {
            if src.dims() != dst.dims() || src.dtype() != dst.dtype() {
                bail!(
                    "{OP}: a metadata tensor of shape {:?} {:?} does not fit the graph's {:?} {:?}",
                    src.dims(),
                    src.dtype(),
                    dst.dims(),
                    dst.dtype()
                );
            }
            let values = HostValues::of(src)?;
            if values != *last {
                write_host(dst, &values)?;
                *last = values;
            }
        }
        c.graph
            .launch()
            .map_err(|e| candle_core::Error::Msg(format!("{OP}: replay failed: {e:?}")))?;
        let logits = c.logits.narrow(0, 0, rows.len())?.copy()?;
        self.stats.replays += 1;
        self.stats.mixed_replays += mixed as usize;
        Ok(Some(logits))
    }
}

impl StepGraphs {
    /// Captures the graph of the bucket of `padding` (a batch of padding
    /// sequences from [`BlockManager::padding_batch`](crate::BlockManager::padding_batch),
    /// built on the CPU for a bucket's sequences and width) unless it exists,
    /// so that a later step of that shape does not pay for the capture.
    /// Returns whether a graph of that shape is ready (false where its
    /// capture failed; see [`last_error`](Self::last_error)).
    pub fn capture<M: PagedModel + ?Sized>(
        &mut self,
        model: &M,
        cache: &PagedKvCache,
        padding: &AttentionMetadata,
    ) -> Result<bool> {
        let host = padding.batch().host();
        let (b, w) = (host.num_seqs(), host.block_table_width());
        if decode_bucket(b, w) != Some((b, w)) || !host.is_pure_decode() {
            bail!("{OP}: {b} sequences of width {w} is not a bucket's decode shape");
        }
        let rows: Vec<usize> = (0..b).collect();
        let padded = padding
            .padded(b, w, &Device::Cpu)?
            .with_graph_mode(GraphMode::Replayable {
                plan_keys: w * host.block_size(),
            })
            .with_logit_rows(&rows)?;
        Ok(self
            .ensure(model, cache, &padded, &vec![0; b], false)?
            .is_some())
    }

    /// Captures the graph of steps with prefills of `num_seqs` sequences
    /// and `num_tokens` tokens (a bucket: see [`mixed_bucket`]) over tables
    /// as wide as `padding`'s, unless it exists, so that a later step of
    /// that shape does not pay for the capture. `padding` is one padding
    /// sequence of one token ([`BlockManager::padding_batch`](crate::BlockManager::padding_batch)
    /// with one sequence, built on the CPU). Returns whether a graph of that
    /// shape is ready: false where its capture failed, the shape holds no
    /// step with prefills (`2 num_tokens <= num_seqs`: a step with prefills
    /// has more tokens than sequences, and more sequences than half its
    /// bucket), its padding tokens do not fit the tables, or
    /// [`MAX_MIXED_GRAPHS`] are captured.
    pub fn capture_mixed<M: PagedModel + ?Sized>(
        &mut self,
        model: &M,
        cache: &PagedKvCache,
        padding: &AttentionMetadata,
        num_seqs: usize,
        num_tokens: usize,
    ) -> Result<bool> {
        let host = padding.batch().host();
        let (w, bs) = (host.block_table_width(), host.block_size());
        if host.num_seqs() != 1 || host.num_tokens() != 1 {
            bail!("{OP}: a mixed capture pads one padding sequence of one token");
        }
        let key = (num_seqs, num_tokens, w);
        if self.graphs.contains_key(&key) {
            return Ok(self.graphs[&key].is_some());
        }
        // The first padding sequence takes the padding tokens. A step with
        // prefills has more tokens than sequences, and more than half as
        // many sequences as its bucket (`mixed_bucket`): smaller token
        // counts hold none. (The first test leaves `num_tokens >= 1` for the
        // second; the padding sequence's one token is the other.)
        if num_tokens.saturating_mul(2) <= num_seqs
            || num_tokens - 1 > w.saturating_mul(bs)
            || self.stats.mixed_captured >= MAX_MIXED_GRAPHS
        {
            return Ok(false);
        }
        let padded = padding
            .padded_to(num_seqs, num_tokens, w, &Device::Cpu)?
            .with_graph_mode(GraphMode::Replayable { plan_keys: w * bs })
            .with_logit_rows(&vec![0; num_seqs])?;
        Ok(self
            .ensure(model, cache, &padded, &vec![0; num_tokens], true)?
            .is_some())
    }

    /// The graph of `padded`'s shape (a step with prefills when `mixed`),
    /// captured on `padded` and `ids` when it does not exist yet; `None`
    /// when its capture failed.
    fn ensure<M: PagedModel + ?Sized>(
        &mut self,
        model: &M,
        cache: &PagedKvCache,
        padded: &AttentionMetadata,
        ids: &[u32],
        mixed: bool,
    ) -> Result<Option<&mut Captured>> {
        let host = padded.batch().host();
        let key = (host.num_seqs(), ids.len(), host.block_table_width());
        if !self.graphs.contains_key(&key) {
            let captured = match capture(model, cache, padded, ids) {
                Ok(c) => {
                    self.stats.captured += 1;
                    self.stats.mixed_captured += mixed as usize;
                    if !mixed {
                        self.stats.kernels_per_step = c.1;
                        self.stats.nodes_per_step = c.2;
                    }
                    Some(c.0)
                }
                Err(Failure::Forward(e)) => return Err(e),
                Err(Failure::Capture(e)) => {
                    self.stats.failed += 1;
                    self.last_error = Some(format!(
                        "{OP}: {} sequences, {} tokens, table width {}: {e}",
                        key.0, key.1, key.2
                    ));
                    None
                }
            };
            self.graphs.insert(key, captured);
        }
        Ok(self.graphs.get_mut(&key).and_then(Option::as_mut))
    }
}

/// Checks every layer's block ids and slots against its cache: the graph's
/// kernels read the tables as written, with no host validation against the
/// cache at replay time.
fn check_blocks(
    layers: &[&Attention],
    cache: &PagedKvCache,
    padded: &AttentionMetadata,
) -> Result<()> {
    for (i, layer) in layers.iter().enumerate() {
        let view = padded.for_layer(layer.options().sliding_window, None)?;
        let blocks = cache.layer(i)?.num_blocks();
        let host = view.batch.host();
        if let Some(id) = host.max_block_id().filter(|&id| id as usize >= blocks) {
            bail!("{OP}: layer {i} reads block {id} of a cache of {blocks} blocks");
        }
        let capacity = blocks * host.block_size();
        if let Some(slot) = view
            .slot_mapping
            .max_slot()
            .filter(|&s| s as usize >= capacity)
        {
            bail!("{OP}: layer {i} writes slot {slot} of a cache of {capacity} slots");
        }
    }
    Ok(())
}

/// Why a capture did not produce a graph.
enum Failure {
    /// The eager forward on the padded inputs failed: the step fails.
    Forward(candle_core::Error),
    /// Only the capture failed: the shape runs eagerly.
    Capture(String),
}

/// Runs the padded step eagerly, then captures it. Returns the graph, its
/// kernel node count and its node count.
fn capture<M: PagedModel + ?Sized>(
    model: &M,
    cache: &PagedKvCache,
    padded: &AttentionMetadata,
    ids: &[u32],
) -> std::result::Result<(Captured, usize, usize), Failure> {
    let dev = model.device();
    let cuda = dev.as_cuda_device().map_err(Failure::Forward)?;
    let host = padded.batch().host();
    let (b, w) = (host.num_seqs(), host.block_table_width());
    let Some((rows, _)) = padded.logit_rows() else {
        return Err(Failure::Forward(candle_core::Error::Msg(format!(
            "{OP}: a padded step without logit rows"
        ))));
    };
    let rows: Vec<usize> = rows.iter().map(|&r| r as usize).collect();
    let setup = || -> Result<(AttentionMetadata, Tensor, Tensor)> {
        // Same sizes: a copy on the device, split plan and rows included.
        let metadata = padded.padded_to(b, ids.len(), w, dev)?;
        let input_ids = Tensor::new(ids, dev)?;
        let logits = Tensor::zeros((rows.len(), model.vocab_size()), DType::F32, dev)?;
        Ok((metadata, input_ids, logits))
    };
    let (metadata, input_ids, logits) = setup().map_err(Failure::Forward)?;
    let step = || -> Result<()> {
        let out = model.forward(&input_ids, &metadata, cache, &rows)?;
        logits.slice_set(&out.to_dtype(DType::F32)?, 0, 0)
    };
    // The host copies candle makes inside the forward (layout parameters)
    // are cached by content during the eager run and
    // replayed from device memory during the capture.
    let _htod_cache = cuda.enable_cuda_graph_htod_cache();
    step().map_err(Failure::Forward)?;
    let stream = cuda.cuda_stream();
    let ctx = stream.context().clone();
    let capture_err =
        |what: &str, e: &dyn std::fmt::Debug| Failure::Capture(format!("{what}: {e:?}"));
    // One capture on the device at a time, and none while another thread
    // holds `hold_captures` (see `device_turns`).
    let capture_turn =
        super::device_turns::capture_turn(model.device()).map_err(Failure::Forward)?;
    stream
        .synchronize()
        .map_err(|e| capture_err("synchronize before capture", &e))?;
    // SAFETY: candle runs all work of a device on its one stream, so no
    // cross-stream ordering event is needed while capturing (and an event
    // recorded before the capture may not be waited on inside it). Tracking
    // is turned back on right after the capture; the slices created while it
    // was off are the forward's temporaries, all freed inside the capture.
    unsafe { ctx.disable_event_tracking() };
    let begun = stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED);
    let recorded = begun.is_ok().then(step);
    let ended = stream.end_capture(CUgraphInstantiate_flags(0));
    drop(capture_turn);
    // SAFETY: see above; slices created from here on track their uses again.
    unsafe { ctx.enable_event_tracking() };
    begun.map_err(|e| capture_err("begin capture", &e))?;
    match recorded {
        Some(Ok(())) => {}
        Some(Err(e)) => {
            return Err(Failure::Capture(format!(
                "the captured forward failed: {e}"
            )))
        }
        None => return Err(Failure::Capture("the capture did not start".into())),
    }
    let graph = ended
        .map_err(|e| capture_err("end capture", &e))?
        .ok_or_else(|| Failure::Capture("the capture recorded nothing".into()))?;
    graph
        .upload()
        .map_err(|e| capture_err("graph upload", &e))?;
    let (kernels, nodes) = count_nodes(&graph).map_err(|e| capture_err("counting nodes", &e))?;
    // The device tensors hold what the padded host metadata held.
    let written = padded
        .tensors()
        .iter()
        .map(|t| HostValues::of(t))
        .collect::<Result<Vec<_>>>()
        .map_err(Failure::Forward)?;
    Ok((
        Captured {
            graph,
            input_ids,
            metadata,
            logits,
            written,
        },
        kernels,
        nodes,
    ))
}

/// The kernel nodes and all nodes of `graph`.
fn count_nodes(graph: &CudaGraph) -> std::result::Result<(usize, usize), sys::CUresult> {
    let mut count = 0usize;
    // SAFETY: `cu_graph` is the live graph `graph` owns; a null node array
    // asks only for the count.
    let r = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut count) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(r);
    }
    let mut nodes = vec![std::ptr::null_mut(); count];
    let mut filled = count;
    // SAFETY: `nodes` holds `filled` writable entries.
    let r = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), nodes.as_mut_ptr(), &mut filled) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(r);
    }
    let mut kernels = 0;
    for &node in nodes.iter().take(filled) {
        let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is a node of the live graph.
        let r = unsafe { sys::cuGraphNodeGetType(node, &mut kind) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(r);
        }
        if kind == CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            kernels += 1;
        }
    }
    Ok((kernels, filled))
}

/// The values of one metadata tensor on the host.
#[derive(Clone, Debug, PartialEq)]
enum HostValues {
    U32(Vec<u32>),
    I64(Vec<i64>),
}

impl HostValues {
    /// The values of a CPU tensor (u32 or i64), in row-major order.
    fn of(t: &Tensor) -> Result<Self> {
        let flat = t.flatten_all()?;
        Ok(match t.dtype() {
            DType::U32 => Self::U32(flat.to_vec1()?),
            DType::I64 => Self::I64(flat.to_vec1()?),
            dt => bail!("{OP}: metadata tensors are u32 or i64, got {dt:?}"),
        })
    }

    fn len(&self) -> usize {
        match self {
            Self::U32(v) => v.len(),
            Self::I64(v) => v.len(),
        }
    }
}

/// Overwrites the contiguous tensor `dst` with `values` (same length and
/// dtype), in place: the graph keeps reading the same device memory.
fn write_host(dst: &Tensor, values: &HostValues) -> Result<()> {
    if !dst.is_contiguous() || dst.elem_count() != values.len() {
        bail!(
            "{OP}: cannot write {} values into a tensor of shape {:?}",
            values.len(),
            dst.dims()
        );
    }
    dst.inplace_op1(&WriteHost(values))
}

/// The in-place op behind [`write_host`].
struct WriteHost<'a>(&'a HostValues);

impl InplaceOp1 for WriteHost<'_> {
    fn name(&self) -> &'static str {
        "step-graph-write"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{OP}: the destination is not contiguous");
        };
        match (storage, self.0) {
            (CpuStorage::U32(d), HostValues::U32(v)) => d[start..end].copy_from_slice(v),
            (CpuStorage::I64(d), HostValues::I64(v)) => d[start..end].copy_from_slice(v),
            (d, v) => bail!(
                "{OP}: cannot write {} values into a {:?} tensor",
                match v {
                    HostValues::U32(_) => "u32",
                    HostValues::I64(_) => "i64",
                },
                d.dtype()
            ),
        }
        Ok(())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{OP}: the destination is not contiguous");
        };
        let stream = storage.device().cuda_stream();
        let copy = match self.0 {
            HostValues::U32(v) => {
                let mut dst = storage.as_cuda_slice_mut::<u32>()?.slice_mut(start..end);
                stream.memcpy_htod(v.as_slice(), &mut dst)
            }
            HostValues::I64(v) => {
                let mut dst = storage.as_cuda_slice_mut::<i64>()?.slice_mut(start..end);
                stream.memcpy_htod(v.as_slice(), &mut dst)
            }
        };
        copy.map_err(|e| candle_core::Error::Msg(format!("{OP}: host-to-device copy: {e:?}")))
    }
}

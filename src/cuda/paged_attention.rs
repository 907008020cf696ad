//! Launches of `PagedAttention` on CUDA: the parameter block and the kernel
//! launches of a plan (decided in `plan`), with the split-KV partials and
//! arrival counters in the per-device workspace (owned by `workspace`).
//!
//! f16/bf16 queries run the tensor-core kernel
//! (`unified_attention_h{HEAD}_{kind}_{dtype}[_fp8]`), either writing the
//! output directly (one segment) or writing split-KV partials into the
//! workspace, which `reduce_segments_{dtype}` merges (one program per
//! partial row and head), or the launch itself (the last program of each
//! split group, through arrival counters; see `plan::Merge`): by default
//! the stream-decode instances (`unified_attention_h{HEAD}_stream_r{8|16}_..`,
//! kernels/stream_decode.cu, which serve most decode-shaped launches) merge
//! their own, the unified kernel's decode instances leave it to the reduce.
//! Prefill-shaped launches split only under `KvSplit::Segments`. f32
//! queries run
//! `unified_attention_scalar_f32[_fp8]`.
//!
//! * Tile shapes: sequences whose new tokens (times the packed heads of a KV
//!   group) fit 16 rows run decode-shaped programs, one per sequence
//!   (stream decode where `plan` finds an instance for the call); longer
//!   ones run prefill-shaped programs of 128 rows (64 when that launch has
//!   less than a wave of programs, and for head sizes above 128). A batch
//!   that mixes both is two launches that overlap: the prefill launch runs
//!   on the device's side stream (`workspace::SideStream`, raw driver
//!   handles that cudarc does not track), forked from the device's stream
//!   before the launches and joined back into it after them, so the two
//!   launches' programs share the SMs. A CUDA graph captures the fork and
//!   the join, with cudarc's event tracking on or off.
//!   `CANDLE_PAGED_ATTENTION_OVERLAP=0` runs both on the device's stream,
//!   one after the other; `=one-launch` runs both parts' programs in one
//!   launch where an instance serves the batch (`launch_one`,
//!   kernels/mixed_attention.cuh: 16-bit caches, head sizes 64 and 128).
//! * Split-KV (`KvSplit::Auto`): a pure decode batch splits its keys into
//!   the segment count with the least modelled time on the resident
//!   programs (`plan::choose_segments`); in a mixed batch only the
//!   decode-shaped launch splits, its partials indexed by (sequence, row).
//!
//! Everything is decided from the batch's host copies: a forward makes no
//! device-to-host copy and, once the workspace is large enough, no
//! allocation besides its output, so it can be captured in a CUDA graph
//! (`examples/bench.rs` times graph replays).
//!
//! `launch` runs named steps: `gather_params` (device addresses, their
//! guards and the parameter block), then `launch_scalar` for f32, or
//! `ensure_workspace`, `launch_parts` (with `launch_each`, or `launch_one`)
//! and `launch_reduce` (each split part
//! that does not merge in its own launch). Every launch
//! goes through `launch_attention` (grid check, then launch).
//!
//! Imports `params` and the sibling CUDA modules; never `ops` or `cpu`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    result, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{
    bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, StorageRef, Tensor,
};

use super::buffers::{alloc_uninit, float_name};
use super::contract::{AttnParams, MixedParams};
use super::occupancy::Residency;
use super::plan::{plan, Instance, Merge, Part, Plan};
use super::policy::{LaunchPolicy, Overlap};
use super::tiles::{Kind, MixedInstance};
use super::workspace::{self, SideStream, Workspace};
use super::{
    attention_function, cuda_storage, device_address, fill_nan, function, optional_address,
    poison_outputs, AttnModule, DeviceLimits, ATTENTION_MODULE,
};
use crate::params::{AttentionDims, KvSplit, PagedAttentionParams};

const OP: &str = "paged-attention";

/// Threads of every attention program (4 warps).
const THREADS: u32 = 128;

/// A contiguous copy (or the tensor itself when already contiguous) of an
/// optional f32 tensor; its device address is taken later, at launch.
fn contiguous(t: &Option<Tensor>) -> Result<Option<Tensor>> {
    t.as_ref().map(|t| t.contiguous()).transpose()
}

fn check_i32(name: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        candle_core::Error::Msg(format!(
            "{OP}: {name} = {v} does not fit the kernels' 32-bit indices"
        ))
    })
}

/// Runs the op on CUDA storage; `dims` comes from validation.
pub(crate) fn forward(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    q: &CudaStorage,
    q_layout: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dev = q.device().clone();
    let host = params.batch.host();
    let q_dtype = q.dtype();
    let out_fp8 = params.output_scale.is_some();
    let shape = Shape::from((dims.num_tokens, dims.num_heads, dims.head_size));
    if q_layout.contiguous_offsets().is_none() {
        bail!("{OP}: q must be contiguous");
    }
    let n_out = dims.num_tokens * dims.num_heads * dims.head_size;
    // Output, in the query dtype or fp8 (the launches poison it first when
    // poisoning is on).
    let out_dtype = match (out_fp8, float_name(q_dtype)) {
        (true, _) => DType::F8E4M3,
        (false, Some(_)) => q_dtype,
        (false, None) => bail!("{OP}: q must be f32, f16 or bf16, got {q_dtype:?}"),
    };
    let out = alloc_uninit(OP, &dev, out_dtype, n_out)?;
    if n_out > 0 && host.num_seqs() > 0 {
        launch(params, dims, q, q_layout, &out, n_out)?;
    }
    Ok((out, shape))
}

/// Enqueues the kernels of one forward on the query's stream, writing `out`:
/// gathers the parameter block, then runs the f32 scalar kernel, or the
/// tensor-core parts of the plan, then the reduce of each split part that
/// does not merge its own partials.
fn launch(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    q: &CudaStorage,
    q_layout: &Layout,
    out: &CudaStorage,
    n_out: usize,
) -> Result<()> {
    let dev = q.device().clone();
    let stream = dev.cuda_stream();
    let cache_fp8 = params.key_cache.dtype() == DType::F8E4M3;

    let copies = OptionalInputs::contiguous(params)?;
    let storages = Storages::lock(params, &copies);
    let inputs = Inputs {
        q,
        q_layout,
        out,
        n_out,
    };
    // Each `_sync` guard lives until after the launches (end of scope).
    let (mut p, _sync) = gather_params(params, dims, &inputs, &storages, &copies, &stream)?;

    let dtype_name = match q.dtype() {
        DType::F32 => return launch_scalar(&dev, &stream, dims, cache_fp8, &p),
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => bail!("{OP}: q must be f32, f16 or bf16, got {dt:?}"),
    };

    let mut spaces = workspace::lock()?;
    let ws = workspace::for_device(&mut spaces, &dev)?;
    let limits = ws.limits;
    let residency = Residency {
        dev: &dev,
        limits: &limits,
        dtype_name,
        fp8: cache_fp8,
    };
    let policy = LaunchPolicy::current();
    // Planned once per batch and layer kind: the layers of one kind share
    // the batch and every other input of the plan (the key).
    let key = PlanKey {
        device: dev.id(),
        dims: *dims,
        dtype_name,
        cache_dtype: params.key_cache.dtype(),
        sliding_window: params.sliding_window,
        kv_split: params.kv_split,
        aligned: p.vec_loads != 0,
        policy: *policy,
    };
    let plan = params.batch.memo(key, || {
        plan(
            params,
            dims,
            &limits,
            p.vec_loads != 0,
            &|kind, tile, head| residency.resident(kind, tile, head),
            policy,
        )
    })?;
    let split = SplitLayout::of(&plan, params, dims);
    p.ws_seq_rows = plan.ws_seq_rows as i32;
    let overlap = policy.overlap;
    let side = match (&plan.parts, overlap) {
        ([Some(_), Some(_)], mode) if mode != Overlap::Off && plan.one_launch.is_none() => {
            Some(ws.side_stream(&stream)?)
        }
        _ => None,
    };
    let _ws_sync = ensure_workspace(ws, &dev, &stream, &split, dims, &mut p)?;
    let host = params.batch.host();
    let kernels = Kernels {
        dev: &dev,
        stream: &stream,
        side: side.as_deref(),
        prefill_first: !matches!(overlap, Overlap::DecodeFirst),
        one_launch_prefill_first: overlap
            == Overlap::OneLaunch {
                prefill_first: true,
            },
        dtype_name,
        cache_fp8,
        decode_only: host.is_pure_decode(),
        seq_len_hint: check_i32("max_seqlen_k", host.max_seqlen_k())?,
    };
    launch_parts(&kernels, &plan, &limits, dims, &mut p)?;
    for part in plan.parts.iter().flatten() {
        if part.merge == Merge::Reduce && part.segments > 1 {
            launch_reduce(&kernels, part, dims, &mut p)?;
        }
    }
    Ok(())
}

/// Everything a launch plan depends on besides the batch: calls over one
/// batch with equal keys (the layers of one kind) share one plan.
#[derive(PartialEq)]
struct PlanKey {
    device: candle_core::cuda_backend::DeviceId,
    dims: AttentionDims,
    dtype_name: &'static str,
    cache_dtype: DType,
    sliding_window: Option<usize>,
    kv_split: KvSplit,
    aligned: bool,
    policy: LaunchPolicy,
}

/// The query and output storages of one forward.
struct Inputs<'a> {
    q: &'a CudaStorage,
    q_layout: &'a Layout,
    out: &'a CudaStorage,
    n_out: usize,
}

/// Contiguous copies of the optional inputs (`prefix_ranges`, ALiBi slopes,
/// sinks, `qq_bias`), owned for the duration of the launches.
struct OptionalInputs {
    ranges: Option<Tensor>,
    alibi: Option<Tensor>,
    sinks: Option<Tensor>,
    qq: Option<Tensor>,
}

impl OptionalInputs {
    fn contiguous(params: &PagedAttentionParams) -> Result<Self> {
        Ok(Self {
            ranges: params
                .batch
                .prefix_ranges()
                .map(|t| t.contiguous())
                .transpose()?,
            alibi: contiguous(&params.alibi_slopes)?,
            sinks: contiguous(&params.sinks)?,
            qq: contiguous(&params.qq_bias)?,
        })
    }
}

/// A locked storage and its layout.
type Locked<'t> = (StorageRef<'t>, &'t Layout);

/// The storage guards of every tensor the kernels read besides the query,
/// held until the launches are enqueued.
struct Storages<'t> {
    k: Locked<'t>,
    v: Locked<'t>,
    cu: Locked<'t>,
    sl: Locked<'t>,
    bt: Locked<'t>,
    ranges: Option<Locked<'t>>,
    alibi: Option<Locked<'t>>,
    sinks: Option<Locked<'t>>,
    qq: Option<Locked<'t>>,
}

impl<'t> Storages<'t> {
    fn lock(params: &'t PagedAttentionParams, copies: &'t OptionalInputs) -> Self {
        let batch = &params.batch;
        Self {
            k: params.key_cache.storage_and_layout(),
            v: params.value_cache.storage_and_layout(),
            cu: batch.cu_seqlens_q().storage_and_layout(),
            sl: batch.seq_lens().storage_and_layout(),
            bt: batch.block_tables().storage_and_layout(),
            ranges: copies.ranges.as_ref().map(|t| t.storage_and_layout()),
            alibi: copies.alibi.as_ref().map(|t| t.storage_and_layout()),
            sinks: copies.sinks.as_ref().map(|t| t.storage_and_layout()),
            qq: copies.qq.as_ref().map(|t| t.storage_and_layout()),
        }
    }
}

/// Guards that record, when dropped, the kernels' use of each device address
/// on the stream; drop them only after the launches are enqueued.
struct SyncGuards<'a> {
    /// Held only for their drop.
    _held: Vec<SyncOnDrop<'a>>,
}

/// Gathers the device addresses (with their guards) and fills the parameter
/// block of one forward; the per-part fields (`group_entries`, segments,
/// workspace addresses, ...) are left for the launch steps. Poisons the
/// output when poisoning is on.
fn gather_params<'a>(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    inputs: &Inputs<'a>,
    s: &'a Storages<'_>,
    copies: &OptionalInputs,
    stream: &'a CudaStream,
) -> Result<(AttnParams, SyncGuards<'a>)> {
    let host = params.batch.host();
    let q_dtype = inputs.q.dtype();
    let cache_fp8 = params.key_cache.dtype() == DType::F8E4M3;
    let out_fp8 = params.output_scale.is_some();

    let kcs = cuda_storage(&s.k.0, OP, "key_cache")?;
    let vcs = cuda_storage(&s.v.0, OP, "value_cache")?;
    let cucs = cuda_storage(&s.cu.0, OP, "cu_seqlens_q")?;
    let slcs = cuda_storage(&s.sl.0, OP, "seq_lens")?;
    let btcs = cuda_storage(&s.bt.0, OP, "block_tables")?;

    let n_out = inputs.n_out;
    let (q_addr, q_sync) = device_address(inputs.q, inputs.q_layout, stream);
    let (k_addr, k_sync) = device_address(kcs, s.k.1, stream);
    let (v_addr, v_sync) = device_address(vcs, s.v.1, stream);
    let (out_addr, out_sync) = device_address(inputs.out, &Layout::contiguous((n_out,)), stream);
    let (cu_addr, cu_sync) = device_address(cucs, s.cu.1, stream);
    let (sl_addr, sl_sync) = device_address(slcs, s.sl.1, stream);
    let (bt_addr, bt_sync) = device_address(btcs, s.bt.1, stream);
    let mut guards = vec![q_sync, k_sync, v_sync, out_sync, cu_sync, sl_sync, bt_sync];
    let mut optional = |g: &'a Option<Locked<'_>>, name: &str| -> Result<u64> {
        Ok(match optional_address(g, OP, name, stream)? {
            Some((addr, sync)) => {
                guards.push(sync);
                addr
            }
            None => 0,
        })
    };
    let ranges_a = optional(&s.ranges, "prefix_ranges")?;
    let alibi_a = optional(&s.alibi, "alibi_slopes")?;
    let sinks_a = optional(&s.sinks, "sinks")?;
    let qq_a = optional(&s.qq, "qq_bias")?;

    let kv_scales = params.effective_kv_scales();
    let out_bytes = n_out * if out_fp8 { 1 } else { q_dtype.size_in_bytes() };
    if poison_outputs() {
        fill_nan(out_addr, out_bytes, stream)?;
    }
    let hs = dims.head_size;
    let vec_loads = hs.is_multiple_of(8)
        && (!cache_fp8 || hs.is_multiple_of(16))
        && [q_addr, k_addr, v_addr]
            .iter()
            .all(|a| a.is_multiple_of(16));
    let (qq_rows, qq_cols) = match &copies.qq {
        Some(t) => (t.dims()[0], t.dims()[1]),
        None => (0, 0),
    };
    let p = AttnParams {
        q: q_addr,
        k_cache: k_addr,
        v_cache: v_addr,
        out: out_addr,
        cu_seqlens_q: cu_addr,
        seq_lens: sl_addr,
        block_tables: bt_addr,
        prefix_ranges: ranges_a,
        alibi_slopes: alibi_a,
        sinks: sinks_a,
        qq_bias: qq_a,
        ws_acc: 0,
        ws_ml: 0,
        ws_counters: 0,
        block_stride: (dims.block_size * dims.num_kv_heads * hs) as i64,
        num_seqs: check_i32("num_seqs", host.num_seqs())?,
        num_tokens: check_i32("num_tokens", dims.num_tokens)?,
        num_heads: check_i32("num_heads", dims.num_heads)?,
        num_kv_heads: check_i32("num_kv_heads", dims.num_kv_heads)?,
        head_size: hs as i32,
        block_size: check_i32("block_size", dims.block_size)?,
        block_table_width: check_i32("block_table_width", host.block_table_width())?,
        max_ranges: copies
            .ranges
            .as_ref()
            .map_or(Ok(0), |t| check_i32("max_ranges", t.dims()[1]))?,
        qq_rows: check_i32("qq_bias rows", qq_rows)?,
        qq_cols: check_i32("qq_bias cols", qq_cols)?,
        sliding_window: params.sliding_window.map_or(Ok(0), |w| {
            check_i32("sliding_window", w.min(i32::MAX as usize))
        })?,
        num_segments: 1,
        out_fp8: out_fp8 as i32,
        vec_loads: vec_loads as i32,
        group_entries: 1,
        head_chunks: 1,
        q_len_min: 0,
        q_len_max: i32::MAX,
        ws_seq_rows: 0,
        seq_programs: 0,
        seq_len_hint: 0,
        decode_only: 0,
        single_segment_steps: 0,
        reserved: 0,
        scale: params.scale * kv_scales.k_scale,
        softcap: params.active_softcap().unwrap_or(0.0),
        v_scale: kv_scales.v_scale,
        out_inv_scale: params.output_scale.map_or(1.0, |s| 1.0 / s),
    };
    check_i32("max_seqlen_k", host.max_seqlen_k())?;
    Ok((p, SyncGuards { _held: guards }))
}

/// The f32 path: one warp per (query row, head), `unified_attention_scalar_f32[_fp8]`.
fn launch_scalar(
    dev: &CudaDevice,
    stream: &CudaStream,
    dims: &AttentionDims,
    cache_fp8: bool,
    p: &AttnParams,
) -> Result<()> {
    let cache_suffix = if cache_fp8 { "_fp8" } else { "" };
    let name = format!("unified_attention_scalar_f32{cache_suffix}");
    let func = function(dev, &name, &ATTENTION_MODULE, 0)?;
    let cfg = LaunchConfig {
        grid_dim: (dims.num_tokens as u32, dims.num_heads.div_ceil(4) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every address in `p` points into a live allocation of this
    // device whose extent validation checked against the sizes in `p`; the
    // caller's guards (from `gather_params`) keep them alive and ordered
    // until after the launch.
    unsafe { launch_attention(Target::Main(stream), &func, cfg, p) }
}

/// The split-KV partials of one call: segments of the most split part, the
/// rows the partials are indexed by and the arrival counters (one per
/// (grid x, grid y) of a split decode-shaped part; 0 when none splits).
struct SplitLayout {
    segments: usize,
    partial_rows: usize,
    counters: usize,
}

impl SplitLayout {
    fn of(plan: &Plan, params: &PagedAttentionParams, dims: &AttentionDims) -> Self {
        let segments = plan
            .parts
            .iter()
            .flatten()
            .map(|p| p.segments)
            .max()
            .unwrap_or(1);
        let partial_rows = if plan.ws_seq_rows > 0 {
            params.batch.host().num_seqs() * plan.ws_seq_rows
        } else {
            dims.num_tokens
        };
        let counters = plan
            .parts
            .iter()
            .flatten()
            .filter(|p| p.merge == Merge::InLaunch && p.segments > 1)
            .map(|p| p.grid_x * dims.num_kv_heads * p.head_chunks)
            .max()
            .unwrap_or(0);
        Self {
            segments,
            partial_rows,
            counters,
        }
    }
}

/// Grows the device's workspace for this call's split-KV partials and
/// arrival counters (when a part merges in its own launch) and points
/// `p.ws_acc`/`p.ws_ml`/`p.ws_counters` into it (the partials poisoned when
/// poisoning is on; the counters never: they are zero between launches). Returns the buffers' guards, to drop after
/// the launches; empty when nothing splits.
///
/// Partials: [partial_rows, num_heads, segments, head_size] outputs and
/// [.., 2] (max, sum) pairs, in one reusable buffer; counters: one u32 per
/// (grid x, grid y) of a split launch, in another.
fn ensure_workspace<'a>(
    ws: &'a mut Workspace,
    dev: &CudaDevice,
    stream: &'a CudaStream,
    split: &SplitLayout,
    dims: &AttentionDims,
    p: &mut AttnParams,
) -> Result<Vec<SyncOnDrop<'a>>> {
    if split.segments <= 1 {
        return Ok(Vec::new());
    }
    let hs = dims.head_size;
    let partials = split.partial_rows * dims.num_heads * split.segments;
    let ws_len = partials * (hs + 2);
    ws.grow(dev, ws_len)?;
    ws.grow_counters(dev, split.counters)?;
    let ws: &'a Workspace = ws;
    let Some((base, guard)) = ws.address(ws_len, stream) else {
        bail!("{OP}: split-kv workspace of {ws_len} floats is missing after growing it");
    };
    p.ws_acc = base;
    p.ws_ml = base + (partials * hs * 4) as u64;
    if poison_outputs() {
        fill_nan(base, ws_len * 4, stream)?;
    }
    let mut guards = vec![guard];
    if let Some((counters, counters_guard)) = ws.counters_address(split.counters, stream) {
        // `launch_parts` hands them to the parts that merge in the launch.
        p.ws_counters = counters;
        guards.push(counters_guard);
    } else if split.counters > 0 {
        bail!(
            "{OP}: {} split-kv counters are missing after growing them",
            split.counters
        );
    }
    Ok(guards)
}

/// What every tensor-core launch of one call shares.
struct Kernels<'a> {
    dev: &'a CudaDevice,
    stream: &'a CudaStream,
    /// A mixed batch's side stream: its prefill launch runs there, beside
    /// the decode launch on `stream` (which waits for it before returning).
    side: Option<&'a SideStream>,
    /// With a side stream: enqueue the prefill launch before the decode one.
    prefill_first: bool,
    /// In a one-launch plan: the prefill programs take the launch's first
    /// places (else they are spread evenly among the decode ones).
    one_launch_prefill_first: bool,
    dtype_name: &'static str,
    cache_fp8: bool,
    /// Every sequence has one new token (`PagedBatchHost::is_pure_decode`).
    decode_only: bool,
    /// The longest sequence's key count, the stream-decode programs' hint.
    seq_len_hint: i32,
}

/// The tensor-core launches, one per part of the plan
/// (`unified_attention_h{HEAD}_{kind}_{dtype}[_fp8]`).
fn launch_parts(
    k: &Kernels<'_>,
    plan: &Plan,
    limits: &DeviceLimits,
    dims: &AttentionDims,
    p: &mut AttnParams,
) -> Result<()> {
    if let Some(mixed) = &plan.one_launch {
        return launch_one(k, plan, mixed, limits, dims, p);
    }
    let Some(side) = k.side else {
        return launch_each(k, plan, limits, dims, p);
    };
    // The side stream starts after the work enqueued so far (the parameter
    // uploads, the poison fills); the device's stream waits for it even when
    // a launch failed, so nothing the side stream reads is released early.
    side.fork_from(k.stream)?;
    let launched = launch_each(k, plan, limits, dims, p);
    side.join_into(k.stream)?;
    launched
}

/// `launch_parts`' launches: each part on the device's stream, or a mixed
/// batch's prefill part on the side stream.
fn launch_each(
    k: &Kernels<'_>,
    plan: &Plan,
    limits: &DeviceLimits,
    dims: &AttentionDims,
    p: &mut AttnParams,
) -> Result<()> {
    let counters = p.ws_counters;
    let mut order: Vec<&Part> = plan.parts.iter().flatten().collect();
    if k.side.is_some() && k.prefill_first {
        order.reverse();
    }
    for part in order {
        let stream = match k.side {
            Some(side) if part.kind == Kind::Prefill => Target::Side(side),
            _ => Target::Main(k.stream),
        };
        *p = part_params(k, plan, part, p, counters);
        let Instance {
            name, smem, module, ..
        } = plan.instance(part, k.dtype_name, k.cache_fp8);
        if smem > limits.max_smem_per_block {
            bail!(
                "{OP}: head size {} needs {smem} bytes of shared memory per program, this device allows {}",
                dims.head_size,
                limits.max_smem_per_block
            );
        }
        let func = attention_function(k.dev, &name, module, smem)?;
        let cfg = LaunchConfig {
            grid_dim: part_grid(plan, part, dims)?,
            block_dim: (part.tile.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: every address in `p` points into a live allocation of this
        // device sized for the dimensions in `p` (validated on the host; the
        // workspace was grown by `ensure_workspace`); the caller's guards keep
        // them alive and ordered until after the launch (a side-stream
        // launch sits between `launch_parts`' fork and join, so it is
        // ordered like one on the device's stream); `smem` matches the
        // kernel's layout. The parts write disjoint rows.
        unsafe { launch_attention(stream, &func, cfg, p) }?;
    }
    Ok(())
}

/// `p` with the fields that differ between the parts of `plan` set for
/// `part` (`counters`: the call's arrival counters, handed to a part that
/// merges its splits in its launch).
fn part_params(
    k: &Kernels<'_>,
    plan: &Plan,
    part: &Part,
    p: &AttnParams,
    counters: u64,
) -> AttnParams {
    let mut p = *p;
    // A null counter buffer: the reduce launch merges this part.
    p.ws_counters = if part.merge == Merge::InLaunch {
        counters
    } else {
        0
    };
    p.group_entries = part.group_entries as i32;
    p.head_chunks = part.head_chunks as i32;
    p.q_len_min = part.q_len_min.min(i32::MAX as usize) as i32;
    p.q_len_max = part.q_len_max.min(i32::MAX as usize) as i32;
    p.num_segments = part.segments as i32;
    p.single_segment_steps = part.single_segment_steps.min(i32::MAX as usize) as i32;
    p.seq_programs = matches!(part.kind, Kind::Decode | Kind::Stream) as i32;
    // Stream decode: what its programs may load before the lengths arrive.
    p.decode_only = (part.kind == Kind::Stream && plan.parts[1].is_none() && k.decode_only) as i32;
    p.seq_len_hint = if part.kind == Kind::Stream {
        k.seq_len_hint
    } else {
        0
    };
    p
}

/// The grid of `part`'s programs as a launch of its own: (sequences or
/// query blocks, KV heads x head chunks, segments x value chunks).
fn part_grid(plan: &Plan, part: &Part, dims: &AttentionDims) -> Result<(u32, u32, u32)> {
    let grid_x = u32::try_from(part.grid_x)
        .ok()
        .filter(|&x| x < i32::MAX as u32)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{OP}: grid of {} programs is too large",
                part.grid_x
            ))
        })?;
    let grid = (
        grid_x,
        (dims.num_kv_heads * part.head_chunks) as u32,
        (part.segments * plan.dv_chunks) as u32,
    );
    check_grid_yz(grid)?;
    Ok(grid)
}

/// A mixed batch's one launch (`plan.one_launch`): the decode-shaped and
/// the prefill part's programs in one flat grid of the instance `mixed`
/// (kernels/mixed_attention.cuh), each part with its own parameters and
/// grid as `launch_each` would launch it, on the device's stream.
fn launch_one(
    k: &Kernels<'_>,
    plan: &Plan,
    mixed: &MixedInstance,
    limits: &DeviceLimits,
    dims: &AttentionDims,
    p: &AttnParams,
) -> Result<()> {
    let [Some(decode), Some(prefill)] = &plan.parts else {
        bail!("{OP}: a one-launch plan needs a decode-shaped and a prefill part");
    };
    let (prefill_grid, decode_grid) = (
        part_grid(plan, prefill, dims)?,
        part_grid(plan, decode, dims)?,
    );
    let count = |(x, y, z): (u32, u32, u32)| x as u64 * y as u64 * z as u64;
    let programs = count(prefill_grid) + count(decode_grid);
    let programs = u32::try_from(programs)
        .ok()
        .filter(|&x| x < i32::MAX as u32)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{OP}: one launch of {programs} programs is too large"
            ))
        })?;
    let as_i32 = |(x, y, z): (u32, u32, u32)| [x as i32, y as i32, z as i32];
    let m = MixedParams {
        prefill: part_params(k, plan, prefill, p, p.ws_counters),
        decode: part_params(k, plan, decode, p, p.ws_counters),
        prefill_grid: as_i32(prefill_grid),
        decode_grid: as_i32(decode_grid),
        prefill_first: k.one_launch_prefill_first as i32,
        reserved: 0,
    };
    let smem = mixed.smem();
    if smem > limits.max_smem_per_block {
        bail!(
            "{OP}: head size {} needs {smem} bytes of shared memory per program, this device allows {}",
            dims.head_size,
            limits.max_smem_per_block
        );
    }
    let func = attention_function(k.dev, &mixed.name(k.dtype_name), AttnModule::Sm90a, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (programs, 1, 1),
        block_dim: (mixed.threads() as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: as for `launch_each`: both parameter blocks are `p` with
    // per-part fields, whose addresses the caller's guards keep alive and
    // ordered on this stream; `smem` is the larger of the two roles'
    // layouts, each of which lays itself out from the start of it; the
    // parts write disjoint rows.
    unsafe { launch_attention(Target::Main(k.stream), &func, cfg, &m) }
}

/// The split-KV reduce of a part that does not merge its own partials
/// (`reduce_segments_{dtype}`): one program per token and head; tokens of
/// the other launch's sequences exit.
fn launch_reduce(
    k: &Kernels<'_>,
    part: &Part,
    dims: &AttentionDims,
    p: &mut AttnParams,
) -> Result<()> {
    p.num_segments = part.segments as i32;
    p.q_len_min = part.q_len_min.min(i32::MAX as usize) as i32;
    p.q_len_max = part.q_len_max.min(i32::MAX as usize) as i32;
    let name = format!("reduce_segments_{}", k.dtype_name);
    // One f32 weight per segment in dynamic shared memory.
    let smem = part.segments * std::mem::size_of::<f32>();
    let func = function(k.dev, &name, &ATTENTION_MODULE, smem)?;
    // Partial rows: tokens, or (sequence, row) pairs for a mixed batch's
    // decode-shaped part.
    let partial_rows = match p.ws_seq_rows {
        0 => dims.num_tokens,
        rows => p.num_seqs as usize * rows as usize,
    };
    let rows = u32::try_from(partial_rows)
        .ok()
        .filter(|&x| x < i32::MAX as u32)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!("{OP}: {partial_rows} partial rows is too many"))
        })?;
    let cfg = LaunchConfig {
        grid_dim: (rows, dims.num_heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: as for `launch_parts`; the reduce reads the partials the
    // part's launch just wrote on the same stream, in the workspace
    // `ensure_workspace` sized for them.
    unsafe { launch_attention(Target::Main(k.stream), &func, cfg, p) }
}

/// The stream an attention launch goes on.
#[derive(Clone, Copy)]
enum Target<'a> {
    /// The device's stream, through cudarc's launch builder.
    Main(&'a CudaStream),
    /// A mixed batch's side stream, through the driver's launch call (see
    /// `workspace::SideStream` for why it is no cudarc stream).
    Side(&'a SideStream),
}

/// The one launch sequence of the attention kernels: checks the grid, then
/// launches `func` on `target` with the parameter block `p` as its only
/// argument.
///
/// # Safety
/// Every address in `p` must point into a live allocation of the stream's
/// device sized for the dimensions in `p`, kept alive and ordered (by the
/// caller's storage guards, and for the side stream by its fork and join
/// around the launch) until after the launch, and `cfg.shared_mem_bytes`
/// must match the kernel's shared-memory layout.
unsafe fn launch_attention<P: DeviceRepr>(
    target: Target<'_>,
    func: &CudaFunction,
    cfg: LaunchConfig,
    p: &P,
) -> Result<()> {
    check_grid_yz(cfg.grid_dim)?;
    match target {
        Target::Main(stream) => {
            let mut b = stream.launch_builder(func);
            b.arg(p);
            // SAFETY: the caller upholds this function's contract.
            unsafe { b.launch(cfg) }.w()?;
        }
        Target::Side(side) => {
            // The kernel copies its one argument at launch; `p` outlives
            // the call.
            let mut args = [p as *const P as *mut std::ffi::c_void];
            // SAFETY: the caller upholds this function's contract; `func` is
            // a loaded kernel whose one parameter is an `AttnParams`, and
            // `fork_from` bound the context to this thread.
            unsafe {
                result::launch_kernel(
                    func.cu_function(),
                    cfg.grid_dim,
                    cfg.block_dim,
                    cfg.shared_mem_bytes,
                    side.raw(),
                    &mut args,
                )
            }
            .w()?;
        }
    }
    Ok(())
}

fn check_grid_yz((x, y, z): (u32, u32, u32)) -> Result<()> {
    if x == 0 || x > i32::MAX as u32 || y > 65535 || z > 65535 {
        bail!("{OP}: launch grid ({x}, {y}, {z}) is out of range");
    }
    Ok(())
}

//! Launch plumbing of `PagedAttention` on CUDA: kernel choice, tile shape,
//! split-KV segment count, the reusable split-KV workspace, and the launches.
//!
//! f16/bf16 queries run the tensor-core kernel
//! (`unified_attention_h{HEAD}_{kind}_{dtype}[_fp8]`), either writing the
//! output directly (one segment) or writing split-KV partials into the
//! workspace that `reduce_segments_{dtype}` merges. f32 queries run
//! `unified_attention_scalar_f32[_fp8]`.
//!
//! * Tile shapes: sequences whose new tokens (times the packed heads of a KV
//!   group) fit 16 rows run decode-shaped programs, one per sequence; longer
//!   ones run prefill-shaped programs of 128 rows (64 when that launch has
//!   less than a wave of programs, and for head sizes above 128). A batch
//!   that mixes both is two launches.
//! * Split-KV (`KvSplit::Auto`): a pure decode batch splits its keys so the
//!   programs fill whole waves; in a mixed batch only the decode-shaped
//!   launch splits, its partials indexed by (sequence, row).
//!
//! Everything is decided from the batch's host copies: a forward makes no
//! device-to-host copy and, once the workspace is large enough, no
//! allocation besides its output, so it can be captured in a CUDA graph
//! (`examples/bench.rs` times graph replays).
//!
//! Imports `params`; never `ops` or `cpu`.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, DeviceId, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Tensor};

use super::contract::AttnParams;
use super::tiles::{instance_name, smem_bytes, tile_shape, Kind, TileShape, HEAD_SIZES};
use super::{
    cuda_storage, device_address, device_limits, fill_nan, function, optional_address,
    poison_outputs, ptx, DeviceLimits, ATTENTION_MODULE,
};
use crate::params::{AttentionDims, KvSplit, PagedAttentionParams};

const OP: &str = "paged-attention";

/// Most split-KV segments per (sequence, KV head).
pub(crate) const MAX_SEGMENTS: usize = 256;
/// Threads of every attention program (4 warps).
const THREADS: u32 = 128;

/// One launch of the tensor-core kernel: a tile shape and the sequences
/// (by new-token count) whose programs do work.
#[derive(Clone, Copy, Debug)]
pub(super) struct Part {
    pub(super) kind: Kind,
    pub(super) tile: TileShape,
    /// Split-KV segments of this launch (1: it writes the output).
    pub(super) segments: usize,
    pub(super) group_entries: usize,
    pub(super) head_chunks: usize,
    pub(super) grid_x: usize,
    pub(super) q_len_min: usize,
    pub(super) q_len_max: usize,
}

/// How one call is launched: one part, or two for a batch that mixes
/// sequences that fit a decode-shaped program with longer ones.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    pub(super) head: usize,
    pub(super) dv_chunks: usize,
    /// 0: split-KV partial rows are tokens; else rows per sequence (partial
    /// row `seq * ws_seq_rows + row`), for a mixed batch's decode launch.
    pub(super) ws_seq_rows: usize,
    pub(super) parts: [Option<Part>; 2],
}

fn part(
    kind: Kind,
    tile: TileShape,
    dims: &AttentionDims,
    num_seqs: usize,
    q_lens: (usize, usize),
) -> Part {
    let group = dims.group_size();
    let group_entries = group.min(tile.rows());
    let block_q = tile.rows() / group_entries;
    // A decode-shaped launch serves spans of at most `block_q` rows: one
    // program per sequence.
    let grid_x = match kind {
        Kind::Decode => num_seqs,
        Kind::Prefill => dims.num_tokens / block_q + num_seqs,
    };
    Part {
        kind,
        tile,
        segments: 1,
        group_entries,
        head_chunks: group.div_ceil(group_entries),
        grid_x,
        q_len_min: q_lens.0,
        q_len_max: q_lens.1,
    }
}

pub(super) fn plan(
    params: &PagedAttentionParams,
    dims: &AttentionDims,
    limits: &DeviceLimits,
) -> Result<Plan> {
    let sms = limits.sms;
    let host = params.batch.host();
    let Some(&head) = HEAD_SIZES.iter().find(|&&h| h >= dims.head_size) else {
        bail!(
            "{OP}: head_size {} exceeds the largest kernel (512)",
            dims.head_size
        );
    };
    let group = dims.group_size();
    let n = host.num_seqs();
    let all = (0, i32::MAX as usize);
    // Longest span whose rows (times the packed heads) fit one decode-shaped program.
    let fits = 16 / group.min(16);
    let decode = tile_shape(Kind::Decode, head, false);
    // Prefill programs of 128 rows: less than a wave takes 64-row ones.
    let prefill_programs: usize = (0..n)
        .filter(|&i| host.q_len(i) > fits)
        .map(|i| host.q_len(i).div_ceil(128 / group.min(128)))
        .sum::<usize>()
        * dims.num_kv_heads
        * group.div_ceil(128);
    let small = match prefill_tile_override() {
        Some(rows) => rows == 64,
        None => prefill_programs < 2 * sms,
    };
    let prefill = tile_shape(Kind::Prefill, head, small);
    let parts = if host.max_seqlen_q() <= fits {
        [Some(part(Kind::Decode, decode, dims, n, all)), None]
    } else if (0..n).any(|i| (1..=fits).contains(&host.q_len(i))) {
        [
            Some(part(Kind::Decode, decode, dims, n, (1, fits))),
            Some(part(Kind::Prefill, prefill, dims, n, (fits + 1, all.1))),
        ]
    } else {
        [Some(part(Kind::Prefill, prefill, dims, n, all)), None]
    };
    let dv_chunks = head / head.min(256);
    let fp8 = params.key_cache.dtype() == DType::F8E4M3;
    // Split so that the decode-shaped programs, one per (sequence, KV head,
    // chunk), fill whole waves of resident programs, with at least 128
    // visible keys per segment.
    let auto_segments = |p: &Part, seqs: usize, max_keys: usize| {
        let active = seqs * dims.num_kv_heads * p.head_chunks * dv_chunks;
        let slots = resident_programs(&p.tile, head, fp8, limits) * sms;
        let keys = params.sliding_window.map_or(max_keys, |w| w.min(max_keys));
        choose_segments(active, slots, keys.div_ceil(128).clamp(1, 64))
    };
    let mut parts = parts;
    let mut ws_seq_rows = 0;
    match (params.kv_split, &mut parts) {
        (KvSplit::Never, _) => {}
        (KvSplit::Segments(k), parts) => {
            for p in parts.iter_mut().flatten() {
                p.segments = (k as usize).clamp(1, MAX_SEGMENTS);
            }
        }
        (KvSplit::Auto, [Some(p), None]) if host.is_pure_decode() => {
            p.segments = auto_segments(p, n, host.max_seqlen_k());
        }
        (KvSplit::Auto, [Some(d), Some(_)]) => {
            // A mixed batch: only the decode-shaped launch splits; its
            // partials are indexed by (sequence, row) so the workspace does
            // not grow with the prefill tokens.
            let decode_seqs: Vec<usize> = (0..n)
                .filter(|&i| (1..=fits).contains(&host.q_len(i)))
                .collect();
            let max_keys = decode_seqs
                .iter()
                .map(|&i| host.seq_lens()[i] as usize)
                .max()
                .unwrap_or(0);
            d.segments = auto_segments(d, decode_seqs.len(), max_keys);
            if d.segments > 1 {
                ws_seq_rows = fits;
            }
        }
        (KvSplit::Auto, _) => {}
    }
    Ok(Plan {
        head,
        dv_chunks,
        ws_seq_rows,
        parts,
    })
}

/// `CANDLE_PAGED_ATTENTION_PREFILL_ROWS=64|128` forces the prefill tile's
/// packed rows (up to head size 128), so that tests cover both instances
/// whatever the batch size. Read once per process.
fn prefill_tile_override() -> Option<usize> {
    static ROWS: OnceLock<Option<usize>> = OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("CANDLE_PAGED_ATTENTION_PREFILL_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&rows| rows == 64 || rows == 128)
    })
}

/// Programs of one instance resident on one SM: the device's shared memory
/// per SM over the instance's bytes plus the driver's reservation per
/// program, and the register limit (the launch bounds the instance was
/// compiled with).
pub(super) fn resident_programs(
    tile: &TileShape,
    head: usize,
    fp8: bool,
    limits: &DeviceLimits,
) -> usize {
    let by_smem =
        limits.smem_per_sm / (smem_bytes(tile, head, fp8) + limits.reserved_smem_per_block);
    by_smem.min(tile.max_resident).max(1)
}

/// Segments per program for `active` programs on `slots` resident ones.
/// Less than a wave: as many segments as still fit one wave. Otherwise the
/// smallest count (up to `max_segments`) whose waves come within 3% of
/// perfectly filled ones, else the count with the best-filled waves.
fn choose_segments(active: usize, slots: usize, max_segments: usize) -> usize {
    let (active, slots) = (active.max(1), slots.max(1));
    if active <= slots {
        return (slots / active).clamp(1, max_segments.max(1));
    }
    let waves = |s: usize| (active * s).div_ceil(slots) as f64 / s as f64;
    let ideal = active as f64 / slots as f64;
    (1..=max_segments)
        .find(|&s| waves(s) <= ideal * 1.03)
        .unwrap_or_else(|| {
            (1..=max_segments)
                .min_by(|&a, &b| waves(a).total_cmp(&waves(b)))
                .unwrap_or(1)
        })
}

/// The split-KV workspace of one device and the limits its plans use.
///
/// Lifetime: created on the first tensor-core launch on the device, grown
/// (never shrunk) when a call needs more partials, and kept for the life of
/// the process (the map is a static, never dropped; the driver reclaims the
/// memory at exit). One per candle device (`DeviceId`), behind a lock held
/// for the whole launch sequence of a call; the launches go on that
/// device's stream, so a later call reusing the buffer runs after the
/// reduce of the earlier one.
struct Workspace {
    limits: DeviceLimits,
    buf: Option<CudaSlice<f32>>,
}

/// The per-device workspaces (see [`Workspace`] for their lifetime).
fn workspaces() -> &'static Mutex<HashMap<DeviceId, Workspace>> {
    static W: OnceLock<Mutex<HashMap<DeviceId, Workspace>>> = OnceLock::new();
    W.get_or_init(|| Mutex::new(HashMap::new()))
}

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
    // At least one element: a zero-byte allocation is not portable.
    let n_alloc = n_out.max(1);

    // Output, in the query dtype or fp8.
    let out = match (out_fp8, q_dtype) {
        (true, _) => alloc_output::<float8::F8E4M3>(&dev, n_alloc)?,
        (false, DType::BF16) => alloc_output::<half::bf16>(&dev, n_alloc)?,
        (false, DType::F16) => alloc_output::<half::f16>(&dev, n_alloc)?,
        (false, DType::F32) => alloc_output::<f32>(&dev, n_alloc)?,
        (false, dt) => bail!("{OP}: q must be f32, f16 or bf16, got {dt:?}"),
    };
    if n_out > 0 && host.num_seqs() > 0 {
        launch(params, dims, q, q_layout, &out, n_out)?;
    }
    Ok((out, shape))
}

/// Enqueues the kernels of one forward on the query's stream, writing `out`.
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
    let host = params.batch.host();
    let q_dtype = q.dtype();
    let cache_fp8 = params.key_cache.dtype() == DType::F8E4M3;
    let out_fp8 = params.output_scale.is_some();

    // Device addresses; each `_sync` guard lives until after the launches.
    let (kg, kl) = params.key_cache.storage_and_layout();
    let (vg, vl) = params.value_cache.storage_and_layout();
    let kcs = cuda_storage(&kg, OP, "key_cache")?;
    let vcs = cuda_storage(&vg, OP, "value_cache")?;
    let batch = &params.batch;
    let (cug, cul) = batch.cu_seqlens_q().storage_and_layout();
    let (slg, sll) = batch.seq_lens().storage_and_layout();
    let (btg, btl) = batch.block_tables().storage_and_layout();
    let cucs = cuda_storage(&cug, OP, "cu_seqlens_q")?;
    let slcs = cuda_storage(&slg, OP, "seq_lens")?;
    let btcs = cuda_storage(&btg, OP, "block_tables")?;
    let ranges_t = batch.prefix_ranges().map(|t| t.contiguous()).transpose()?;
    let alibi_t = contiguous(&params.alibi_slopes)?;
    let sinks_t = contiguous(&params.sinks)?;
    let qq_t = contiguous(&params.qq_bias)?;
    let ranges_g = ranges_t.as_ref().map(|t| t.storage_and_layout());
    let alibi_g = alibi_t.as_ref().map(|t| t.storage_and_layout());
    let sinks_g = sinks_t.as_ref().map(|t| t.storage_and_layout());
    let qq_g = qq_t.as_ref().map(|t| t.storage_and_layout());

    let (q_addr, _q_sync) = device_address(q, q_layout, &stream);
    let (k_addr, _k_sync) = device_address(kcs, kl, &stream);
    let (v_addr, _v_sync) = device_address(vcs, vl, &stream);
    let (out_addr, _out_sync) = device_address(out, &Layout::contiguous((n_out,)), &stream);
    let (cu_addr, _cu_sync) = device_address(cucs, cul, &stream);
    let (sl_addr, _sl_sync) = device_address(slcs, sll, &stream);
    let (bt_addr, _bt_sync) = device_address(btcs, btl, &stream);
    let ranges_a = optional_address(&ranges_g, OP, "prefix_ranges", &stream)?;
    let alibi_a = optional_address(&alibi_g, OP, "alibi_slopes", &stream)?;
    let sinks_a = optional_address(&sinks_g, OP, "sinks", &stream)?;
    let qq_a = optional_address(&qq_g, OP, "qq_bias", &stream)?;

    let kv_scales = params.effective_kv_scales();
    let out_bytes = n_out * if out_fp8 { 1 } else { q_dtype.size_in_bytes() };
    if poison_outputs() {
        fill_nan(out_addr, out_bytes, &stream)?;
    }
    let hs = dims.head_size;
    let vec_loads = hs.is_multiple_of(8)
        && (!cache_fp8 || hs.is_multiple_of(16))
        && [q_addr, k_addr, v_addr]
            .iter()
            .all(|a| a.is_multiple_of(16));
    let (qq_rows, qq_cols) = match &qq_t {
        Some(t) => (t.dims()[0], t.dims()[1]),
        None => (0, 0),
    };
    let mut p = AttnParams {
        q: q_addr,
        k_cache: k_addr,
        v_cache: v_addr,
        out: out_addr,
        cu_seqlens_q: cu_addr,
        seq_lens: sl_addr,
        block_tables: bt_addr,
        prefix_ranges: ranges_a.as_ref().map_or(0, |a| a.0),
        alibi_slopes: alibi_a.as_ref().map_or(0, |a| a.0),
        sinks: sinks_a.as_ref().map_or(0, |a| a.0),
        qq_bias: qq_a.as_ref().map_or(0, |a| a.0),
        ws_acc: 0,
        ws_ml: 0,
        block_stride: (dims.block_size * dims.num_kv_heads * hs) as i64,
        num_seqs: check_i32("num_seqs", host.num_seqs())?,
        num_tokens: check_i32("num_tokens", dims.num_tokens)?,
        num_heads: check_i32("num_heads", dims.num_heads)?,
        num_kv_heads: check_i32("num_kv_heads", dims.num_kv_heads)?,
        head_size: hs as i32,
        block_size: check_i32("block_size", dims.block_size)?,
        block_table_width: check_i32("block_table_width", host.block_table_width())?,
        max_ranges: ranges_t
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
        scale: params.scale * kv_scales.k_scale,
        softcap: params.active_softcap().unwrap_or(0.0),
        v_scale: kv_scales.v_scale,
        out_inv_scale: params.output_scale.map_or(1.0, |s| 1.0 / s),
    };
    check_i32("max_seqlen_k", host.max_seqlen_k())?;

    let cache_suffix = if cache_fp8 { "_fp8" } else { "" };
    if q_dtype == DType::F32 {
        // The f32 path: one warp per (query row, head).
        let name = format!("unified_attention_scalar_f32{cache_suffix}");
        let func = function(&dev, &name, ATTENTION_MODULE, ptx::UNIFIED_ATTENTION, 0)?;
        let cfg = LaunchConfig {
            grid_dim: (dims.num_tokens as u32, dims.num_heads.div_ceil(4) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every address in `p` points into a live allocation of this
        // device whose extent validation checked against the sizes in `p`;
        // the guards keep them alive and ordered until after the launch.
        unsafe { launch_attention(&stream, &func, cfg, &p) }?;
        return Ok(());
    }
    let dtype_name = match q_dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => bail!("{OP}: q must be f32, f16 or bf16, got {dt:?}"),
    };

    let mut spaces = workspaces()
        .lock()
        .map_err(|_| candle_core::Error::Msg(format!("{OP}: workspace lock poisoned")))?;
    let ws = match spaces.entry(dev.id()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(Workspace {
            limits: device_limits(&dev)?,
            buf: None,
        }),
    };
    let plan = plan(params, dims, &ws.limits)?;
    let segments = plan
        .parts
        .iter()
        .flatten()
        .map(|p| p.segments)
        .max()
        .unwrap_or(1);
    let partial_rows = if plan.ws_seq_rows > 0 {
        host.num_seqs() * plan.ws_seq_rows
    } else {
        dims.num_tokens
    };
    p.ws_seq_rows = plan.ws_seq_rows as i32;

    // Split-KV partials: [partial_rows, num_heads, segments, head_size]
    // outputs and [.., 2] (max, sum) pairs, in one reusable buffer.
    let partials = partial_rows * dims.num_heads * segments;
    let ws_len = if segments > 1 { partials * (hs + 2) } else { 0 };
    if ws_len > 0 && ws.buf.as_ref().is_none_or(|b| b.len() < ws_len) {
        ws.buf = None;
        // SAFETY: the kernels write every partial they later read; the reduce
        // reads only partials of programs that ran.
        ws.buf = Some(unsafe { dev.alloc::<f32>(ws_len)? });
    }
    let ws_guard = match (&ws.buf, ws_len > 0) {
        (Some(buf), true) => Some(buf.device_ptr(&stream)),
        _ => None,
    };
    if let Some((base, _)) = &ws_guard {
        p.ws_acc = *base;
        p.ws_ml = *base + (partials * hs * 4) as u64;
        if poison_outputs() {
            fill_nan(*base, ws_len * 4, &stream)?;
        }
    }

    for part in plan.parts.iter().flatten() {
        p.group_entries = part.group_entries as i32;
        p.head_chunks = part.head_chunks as i32;
        p.q_len_min = part.q_len_min.min(i32::MAX as usize) as i32;
        p.q_len_max = part.q_len_max.min(i32::MAX as usize) as i32;
        p.num_segments = part.segments as i32;
        p.seq_programs = (part.kind == Kind::Decode) as i32;
        let name = instance_name(plan.head, part.kind, &part.tile, dtype_name, cache_fp8);
        let smem = smem_bytes(&part.tile, plan.head, cache_fp8);
        if smem > ws.limits.max_smem_per_block {
            bail!(
                "{OP}: head size {} needs {smem} bytes of shared memory per program, this device allows {}",
                dims.head_size,
                ws.limits.max_smem_per_block
            );
        }
        let func = function(&dev, &name, ATTENTION_MODULE, ptx::UNIFIED_ATTENTION, smem)?;
        let grid_x = u32::try_from(part.grid_x)
            .ok()
            .filter(|&x| x < i32::MAX as u32)
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "{OP}: grid of {} programs is too large",
                    part.grid_x
                ))
            })?;
        let cfg = LaunchConfig {
            grid_dim: (
                grid_x,
                (dims.num_kv_heads * part.head_chunks) as u32,
                (part.segments * plan.dv_chunks) as u32,
            ),
            block_dim: (part.tile.threads() as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: every address in `p` points into a live allocation of this
        // device sized for the dimensions in `p` (validated on the host; the
        // workspace was grown to `ws_len` above); the guards keep them alive
        // and ordered until after the launch; `smem` matches the kernel's
        // layout. The parts write disjoint rows.
        unsafe { launch_attention(&stream, &func, cfg, &p) }?;
    }

    if segments > 1 {
        // One program per partial row and head; with (sequence, row) rows,
        // rows past a sequence's span or of the unsplit launch exit.
        p.num_segments = segments as i32;
        p.q_len_min = 0;
        p.q_len_max = if plan.ws_seq_rows > 0 {
            plan.ws_seq_rows as i32
        } else {
            i32::MAX
        };
        let name = format!("reduce_segments_{dtype_name}");
        let func = function(&dev, &name, ATTENTION_MODULE, ptx::UNIFIED_ATTENTION, 0)?;
        let rows = u32::try_from(partial_rows)
            .ok()
            .filter(|&x| x < i32::MAX as u32)
            .ok_or_else(|| {
                candle_core::Error::Msg(format!("{OP}: {partial_rows} partial rows is too many"))
            })?;
        let cfg = LaunchConfig {
            grid_dim: (rows, dims.num_heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; the reduce reads the partials the attention
        // launch just wrote on the same stream.
        unsafe { launch_attention(&stream, &func, cfg, &p) }?;
    }
    drop(ws_guard);
    Ok(())
}

/// An uninitialised output buffer of `n` elements.
fn alloc_output<T: CudaDType + DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaStorage> {
    // SAFETY: the kernels write every element of the output before anything
    // reads it (poisoning, when on, fills it with NaN first).
    let slice = unsafe { dev.alloc::<T>(n)? };
    Ok(CudaStorage::wrap_cuda_slice(slice, dev.clone()))
}

/// The one launch sequence of the attention kernels: checks the grid, then
/// launches `func` on `stream` with the parameter block `p` as its only
/// argument.
///
/// # Safety
/// Every address in `p` must point into a live allocation of the stream's
/// device sized for the dimensions in `p`, kept alive and ordered (by the
/// caller's storage guards) until after the launch, and
/// `cfg.shared_mem_bytes` must match the kernel's shared-memory layout.
unsafe fn launch_attention(
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    p: &AttnParams,
) -> Result<()> {
    check_grid_yz(cfg.grid_dim)?;
    let mut b = stream.launch_builder(func);
    b.arg(p);
    // SAFETY: the caller upholds this function's contract.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

fn check_grid_yz((x, y, z): (u32, u32, u32)) -> Result<()> {
    if x == 0 || x > i32::MAX as u32 || y > 65535 || z > 65535 {
        bail!("{OP}: launch grid ({x}, {y}, {z}) is out of range");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_fill_waves() {
        // One long decode: split until the GPU is full.
        assert_eq!(choose_segments(8, 396, 64), 49);
        // Short context: capped by the keys.
        assert_eq!(choose_segments(8, 396, 8), 8);
        // 512 programs on 396 slots: a few segments even out the waves.
        let s = choose_segments(512, 396, 64);
        assert!((2..=16).contains(&s), "{s}");
        // Already many full waves: no split.
        assert_eq!(choose_segments(396 * 8, 396, 64), 1);
    }

    #[test]
    fn shared_memory_fits_hopper() {
        for &head in &HEAD_SIZES {
            for kind in [Kind::Decode, Kind::Prefill] {
                for fp8 in [false, true] {
                    for small in [false, true] {
                        let s = smem_bytes(&tile_shape(kind, head, small), head, fp8);
                        assert!(s <= 227 * 1024, "{kind:?} h{head} fp8={fp8}: {s} bytes");
                    }
                }
            }
        }
    }
}

//! Launch plumbing of the fused layer ops on CUDA (kernels/layer_ops.cu):
//! `rms_norm`, `add_rms_norm`, the gated activations and the skinny
//! matmul. Each launch
//! allocates its output and nothing else, so it can be captured in a CUDA
//! graph.
//!
//! Imports `params` and the sibling CUDA modules; never `ops` or `cpu`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

use super::buffers::{alloc_poisoned, float_name};
use super::layer_shapes::{
    skinny_cols_per_warp, ACT_THREADS, GREEDY_THREADS, NORM_THREADS, SAMPLE_CACHE_MAX_BYTES,
    SAMPLE_CLUSTER, SAMPLE_PARAM_WORDS, SAMPLE_THREADS, SKINNY_MAX_ROWS, SKINNY_MMA_ROWS,
    SKINNY_MMA_WARPS, SKINNY_THREADS,
};
use super::policy::{LaunchPolicy, SkinnyKernel};
use super::{device_address, function, LAYER_MODULE};
use crate::params::GatedActivation;

/// The rows and columns of a norm call and its arithmetic.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NormShape {
    /// Rows normalised (one program each).
    pub(crate) rows: usize,
    /// Elements per row.
    pub(crate) cols: usize,
    pub(crate) eps: f32,
    /// Added to each weight in f32 (1 for Gemma's `1 + w` norms).
    pub(crate) weight_offset: f32,
}

fn dtype_name(op: &str, dtype: DType) -> Result<&'static str> {
    float_name(dtype).ok_or_else(|| {
        candle_core::Error::Msg(format!("{op}: expected f32, f16 or bf16, got {dtype:?}"))
    })
}

fn contiguous(op: &str, name: &str, layout: &Layout) -> Result<()> {
    if layout.contiguous_offsets().is_none() {
        bail!("{op}: {name} must be contiguous");
    }
    Ok(())
}

fn grid(op: &str, programs: usize) -> Result<u32> {
    u32::try_from(programs)
        .map_err(|_| candle_core::Error::Msg(format!("{op}: {programs} programs is too many")))
}

/// `rms_norm` (no `delta`) or `add_rms_norm` of `x` `(rows, cols)` with
/// `weight` `(cols,)`, all contiguous and of one dtype; `delta` `(rows, cols)`
/// of that dtype or f32. Returns `(rows, cols)` normalised values, or for
/// `add_rms_norm` `(2, rows, cols)`: `x + delta`, then the normalised sum.
pub(crate) fn norm(
    op: &str,
    shape: NormShape,
    x: (&CudaStorage, &Layout),
    delta: Option<(&CudaStorage, &Layout)>,
    weight: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dtype = x.0.dtype();
    let t = dtype_name(op, dtype)?;
    contiguous(op, "x", x.1)?;
    contiguous(op, "weight", weight.1)?;
    let n = shape.rows * shape.cols;
    let dev = x.0.device().clone();
    let stream = dev.cuda_stream();
    let outputs = if delta.is_some() { 2 } else { 1 };
    let out = alloc_poisoned(op, &dev, dtype, outputs * n)?;
    if n == 0 {
        return Ok(out);
    }
    // The guards end with this block, before `out` is returned.
    {
        let (x_addr, _x_sync) = device_address(x.0, x.1, &stream);
        let (w_addr, _w_sync) = device_address(weight.0, weight.1, &stream);
        let (out_addr, _out_sync) = device_address(&out, &Layout::contiguous(outputs * n), &stream);
        let cols = i64::try_from(shape.cols)
            .map_err(|_| candle_core::Error::Msg(format!("{op}: {} columns", shape.cols)))?;
        let cfg = LaunchConfig {
            grid_dim: (grid(op, shape.rows)?, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (eps, offset) = (shape.eps, shape.weight_offset);
        match delta {
            None => {
                let func = function(&dev, &format!("rms_norm_{t}"), &LAYER_MODULE, 0)?;
                let mut b = stream.launch_builder(&func);
                b.arg(&x_addr);
                b.arg(&w_addr);
                b.arg(&out_addr);
                b.arg(&cols);
                b.arg(&eps);
                b.arg(&offset);
                // SAFETY: `x` and `out` hold rows * cols elements and `weight`
                // cols elements of the kernel's type (checked above and by the
                // op); the guards keep them alive and ordered past the launch.
                unsafe { b.launch(cfg) }.w()?;
            }
            Some((d, dl)) => {
                contiguous(op, "delta", dl)?;
                let dn = match d.dtype() {
                    dt if dt == dtype => t,
                    DType::F32 => "f32",
                    dt => bail!("{op}: delta must be {dtype:?} or f32, got {dt:?}"),
                };
                let func = function(&dev, &format!("add_rms_norm_{t}_{dn}"), &LAYER_MODULE, 0)?;
                let (d_addr, _d_sync) = device_address(d, dl, &stream);
                let norm_addr = out_addr + (n * dtype.size_in_bytes()) as u64;
                let mut b = stream.launch_builder(&func);
                b.arg(&x_addr);
                b.arg(&d_addr);
                b.arg(&w_addr);
                b.arg(&out_addr);
                b.arg(&norm_addr);
                b.arg(&cols);
                b.arg(&eps);
                b.arg(&offset);
                // SAFETY: `x` and `delta` hold rows * cols elements, `weight`
                // cols, and `out` 2 * rows * cols of the kernel's types (checked
                // above and by the op); the guards keep them alive and ordered
                // past the launch.
                unsafe { b.launch(cfg) }.w()?;
            }
        }
    }
    Ok(out)
}

/// `act(gate) * up` of `gate_up` `(rows, 2 * inter)` (contiguous; gate
/// columns first), as `(rows, inter)` of `out_dtype`: the input's dtype, or
/// f16/bf16 for an f32 input.
pub(crate) fn gated(
    op: &str,
    act: GatedActivation,
    gate_up: (&CudaStorage, &Layout),
    rows: usize,
    inter: usize,
    out_dtype: DType,
) -> Result<CudaStorage> {
    let tin = dtype_name(op, gate_up.0.dtype())?;
    let tout = dtype_name(op, out_dtype)?;
    if tin != tout && tin != "f32" {
        bail!("{op}: a {tin} input gives a {tin} output, not {tout}");
    }
    contiguous(op, "gate_up", gate_up.1)?;
    let dev = gate_up.0.device().clone();
    let stream = dev.cuda_stream();
    let n = rows * inter;
    let out = alloc_poisoned(op, &dev, out_dtype, n)?;
    if n == 0 {
        return Ok(out);
    }
    let name = match act {
        GatedActivation::Silu => "silu",
        GatedActivation::GeluTanh => "gelu_tanh",
    };
    let func = function(&dev, &format!("{name}_mul_{tin}_{tout}"), &LAYER_MODULE, 0)?;
    // The guards end with this block, before `out` is returned.
    {
        let (in_addr, _in_sync) = device_address(gate_up.0, gate_up.1, &stream);
        let (out_addr, _out_sync) = device_address(&out, &Layout::contiguous(n), &stream);
        let (Ok(rows_i), Ok(inter_i)) = (i64::try_from(rows), i64::try_from(inter)) else {
            bail!("{op}: {rows} rows of {inter} do not fit 64-bit offsets");
        };
        // Grid-stride loop: at most 65536 programs, each looping as needed.
        let programs = n.div_ceil(ACT_THREADS as usize).min(1 << 16);
        let cfg = LaunchConfig {
            grid_dim: (grid(op, programs)?, 1, 1),
            block_dim: (ACT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&in_addr);
        b.arg(&out_addr);
        b.arg(&rows_i);
        b.arg(&inter_i);
        // SAFETY: `gate_up` holds rows * 2 * inter elements and `out` rows *
        // inter of the kernel's types (checked above and by the op); the guards
        // keep them alive and ordered past the launch.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(out)
}

/// `x · wᵀ` of `x` `(m, k)` and `w` `(n, k)`, both contiguous, of one
/// 16-bit dtype, with `1 <= m <= SKINNY_MAX_ROWS`, `k > 0` and `k % 8 == 0`; both
/// must start 16-byte aligned. Returns `(m, n)` of that dtype. Runs the
/// tensor-core kernel (`skinny_mma_{t}`, 16 outputs per program) unless
/// the launch policy says `fma` (`skinny_matmul_{t}_m{m}`).
pub(crate) fn skinny_matmul(
    op: &str,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    (m, n, k): (usize, usize, usize),
) -> Result<CudaStorage> {
    let dtype = x.0.dtype();
    let t = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => bail!("{op}: x must be bf16 or f16, got {dt:?}"),
    };
    if w.0.dtype() != dtype {
        bail!("{op}: w must be {dtype:?} like x, got {:?}", w.0.dtype());
    }
    contiguous(op, "x", x.1)?;
    contiguous(op, "w", w.1)?;
    if !(1..=SKINNY_MAX_ROWS).contains(&m) || k == 0 || !k.is_multiple_of(8) {
        bail!(
            "{op}: takes 1 to {SKINNY_MAX_ROWS} rows of a positive multiple of 8 columns, got {m} x {k}"
        );
    }
    let dev = x.0.device().clone();
    let stream = dev.cuda_stream();
    let out = alloc_poisoned(op, &dev, dtype, m * n)?;
    if n == 0 {
        return Ok(out);
    }
    let mma = LaunchPolicy::current().skinny == SkinnyKernel::Mma;
    let (name, per_program, threads) = if mma {
        (
            format!("skinny_mma_{t}"),
            SKINNY_MMA_ROWS,
            SKINNY_MMA_WARPS * 32,
        )
    } else {
        (
            format!("skinny_matmul_{t}_m{m}"),
            (SKINNY_THREADS as usize / 32) * skinny_cols_per_warp(m),
            SKINNY_THREADS,
        )
    };
    let func = function(&dev, &name, &LAYER_MODULE, 0)?;
    // The guards end with this block, before `out` is returned.
    {
        let (x_addr, _x_sync) = device_address(x.0, x.1, &stream);
        let (w_addr, _w_sync) = device_address(w.0, w.1, &stream);
        let (y_addr, _y_sync) = device_address(&out, &Layout::contiguous(m * n), &stream);
        if !x_addr.is_multiple_of(16) || !w_addr.is_multiple_of(16) {
            bail!("{op}: x and w must start 16-byte aligned (x at {x_addr:#x}, w at {w_addr:#x})");
        }
        let (Ok(n_i), Ok(k_i)) = (i64::try_from(n), i64::try_from(k)) else {
            bail!("{op}: {n} x {k} does not fit 64-bit offsets");
        };
        let m_i = m as i32; // <= SKINNY_MAX_ROWS
        let cfg = LaunchConfig {
            grid_dim: (grid(op, n.div_ceil(per_program))?, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&x_addr);
        b.arg(&w_addr);
        b.arg(&y_addr);
        if mma {
            b.arg(&m_i);
        }
        b.arg(&n_i);
        b.arg(&k_i);
        // SAFETY: `x` holds m * k, `w` n * k and `out` m * n elements of the
        // kernel's type, x and w 16-byte aligned with k % 8 == 0 (checked
        // above); the guards keep them alive and ordered past the launch.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(out)
}

/// `act(x · gateᵀ) * (x · upᵀ)` of `x` `(m, k)` and a joined gate/up weight
/// `w` `(2 n, k)` (its `n` gate rows, then its `n` up rows), both
/// contiguous, of one 16-bit dtype, under [`skinny_matmul`]'s conditions on
/// `m`, `k` and alignment. Returns `(m, n)` of that dtype, bit for bit the
/// skinny product followed by [`gated`]: `skinny_mma_{act}_{t}`, one program
/// per 8 outputs (8 gate rows and their up rows as one tile).
pub(crate) fn skinny_gated(
    op: &str,
    act: GatedActivation,
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    (m, n, k): (usize, usize, usize),
) -> Result<CudaStorage> {
    let dtype = x.0.dtype();
    let t = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => bail!("{op}: x must be bf16 or f16, got {dt:?}"),
    };
    if w.0.dtype() != dtype {
        bail!("{op}: w must be {dtype:?} like x, got {:?}", w.0.dtype());
    }
    contiguous(op, "x", x.1)?;
    contiguous(op, "w", w.1)?;
    if !(1..=SKINNY_MAX_ROWS).contains(&m) || k == 0 || !k.is_multiple_of(8) {
        bail!(
            "{op}: takes 1 to {SKINNY_MAX_ROWS} rows of a positive multiple of 8 columns, got {m} x {k}"
        );
    }
    let dev = x.0.device().clone();
    let stream = dev.cuda_stream();
    let out = alloc_poisoned(op, &dev, dtype, m * n)?;
    if n == 0 {
        return Ok(out);
    }
    let name = match act {
        GatedActivation::Silu => format!("skinny_mma_silu_{t}"),
        GatedActivation::GeluTanh => format!("skinny_mma_gelu_tanh_{t}"),
    };
    let func = function(&dev, &name, &LAYER_MODULE, 0)?;
    // The guards end with this block, before `out` is returned.
    {
        let (x_addr, _x_sync) = device_address(x.0, x.1, &stream);
        let (w_addr, _w_sync) = device_address(w.0, w.1, &stream);
        let (y_addr, _y_sync) = device_address(&out, &Layout::contiguous(m * n), &stream);
        if !x_addr.is_multiple_of(16) || !w_addr.is_multiple_of(16) {
            bail!("{op}: x and w must start 16-byte aligned (x at {x_addr:#x}, w at {w_addr:#x})");
        }
        let (Ok(n_i), Ok(k_i)) = (i64::try_from(n), i64::try_from(k)) else {
            bail!("{op}: {n} x {k} does not fit 64-bit offsets");
        };
        let m_i = m as i32; // <= SKINNY_MAX_ROWS
        let cfg = LaunchConfig {
            grid_dim: (grid(op, n.div_ceil(SKINNY_MMA_ROWS / 2))?, 1, 1),
            block_dim: (SKINNY_MMA_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&x_addr);
        b.arg(&w_addr);
        b.arg(&y_addr);
        b.arg(&m_i);
        b.arg(&n_i);
        b.arg(&k_i);
        // SAFETY: `x` holds m * k, `w` 2 n * k and `out` m * n elements of
        // the kernel's type, x and w 16-byte aligned with k % 8 == 0
        // (checked above and by the op); the kernel reads gate rows below n
        // and up rows below 2 n only. The guards keep the buffers alive and
        // ordered past the launch.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(out)
}

/// The greedy token of each row of `logits` `(rows, vocab)` f32 (contiguous)
/// and whether the row is finite: `(rows, 2)` u32 of `[token, finite]`.
pub(crate) fn greedy_rows(
    op: &str,
    logits: (&CudaStorage, &Layout),
    rows: usize,
    vocab: usize,
) -> Result<CudaStorage> {
    if logits.0.dtype() != DType::F32 {
        bail!("{op}: logits must be f32, got {:?}", logits.0.dtype());
    }
    contiguous(op, "logits", logits.1)?;
    let dev = logits.0.device().clone();
    let stream = dev.cuda_stream();
    let out = alloc_poisoned(op, &dev, DType::U32, 2 * rows)?;
    if rows == 0 {
        return Ok(out);
    }
    let func = function(&dev, "greedy_rows_f32", &LAYER_MODULE, 0)?;
    // The guards end with this block, before `out` is returned.
    {
        let (in_addr, _in_sync) = device_address(logits.0, logits.1, &stream);
        let (out_addr, _out_sync) = device_address(&out, &Layout::contiguous(2 * rows), &stream);
        let Ok(vocab_i) = i64::try_from(vocab) else {
            bail!("{op}: a vocabulary of {vocab} does not fit 64-bit offsets");
        };
        let cfg = LaunchConfig {
            grid_dim: (grid(op, rows)?, 1, 1),
            block_dim: (GREEDY_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&in_addr);
        b.arg(&out_addr);
        b.arg(&vocab_i);
        // SAFETY: `logits` holds rows * vocab f32 values and `out` 2 * rows
        // u32 (checked above and by the op); the guards keep them alive and
        // ordered past the launch.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(out)
}

/// One token of each row of `logits` `(rows, vocab)` f32 drawn with the
/// row's `params` `(rows, SAMPLE_PARAM_WORDS)` u32 (both contiguous; the
/// layout is `sample_rows_f32`'s): `(rows, 2)` u32 of `[token, finite]`.
pub(crate) fn sample_rows(
    op: &str,
    logits: (&CudaStorage, &Layout),
    params: (&CudaStorage, &Layout),
    rows: usize,
    vocab: usize,
) -> Result<CudaStorage> {
    if logits.0.dtype() != DType::F32 || params.0.dtype() != DType::U32 {
        bail!(
            "{op}: logits must be f32 and params u32, got {:?} and {:?}",
            logits.0.dtype(),
            params.0.dtype()
        );
    }
    contiguous(op, "logits", logits.1)?;
    contiguous(op, "params", params.1)?;
    if params.1.shape().elem_count() != rows * SAMPLE_PARAM_WORDS {
        bail!(
            "{op}: params must be ({rows}, {SAMPLE_PARAM_WORDS}), got {:?}",
            params.1.dims()
        );
    }
    let dev = logits.0.device().clone();
    let stream = dev.cuda_stream();
    let out = alloc_poisoned(op, &dev, DType::U32, 2 * rows)?;
    if rows == 0 {
        return Ok(out);
    }
    // SAMPLE_CLUSTER programs per row, each over a slice of the row that it
    // keeps in shared memory when the slice fits SAMPLE_CACHE_MAX_BYTES.
    let Some(programs) = rows.checked_mul(SAMPLE_CLUSTER as usize) else {
        bail!("{op}: {rows} rows is too many");
    };
    let slice = vocab.div_ceil(SAMPLE_CLUSTER as usize).next_multiple_of(4);
    let cache_floats = if slice * 4 <= SAMPLE_CACHE_MAX_BYTES {
        slice
    } else {
        0
    };
    // Both fit: cache_floats <= SAMPLE_CACHE_MAX_BYTES / 4 = 40 Ki.
    let (cache_cap, cache_bytes) = (cache_floats as i64, (cache_floats * 4) as u32);
    let func = function(
        &dev,
        "sample_rows_f32",
        &LAYER_MODULE,
        SAMPLE_CACHE_MAX_BYTES,
    )?;
    // The guards end with this block, before `out` is returned.
    {
        let (in_addr, _in_sync) = device_address(logits.0, logits.1, &stream);
        let (p_addr, _p_sync) = device_address(params.0, params.1, &stream);
        let (out_addr, _out_sync) = device_address(&out, &Layout::contiguous(2 * rows), &stream);
        let Ok(vocab_i) = i64::try_from(vocab) else {
            bail!("{op}: a vocabulary of {vocab} does not fit 64-bit offsets");
        };
        let cfg = LaunchConfig {
            grid_dim: (grid(op, programs)?, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: cache_bytes,
        };
        let mut b = stream.launch_builder(&func);
        b.arg(&in_addr);
        b.arg(&p_addr);
        b.arg(&out_addr);
        b.arg(&vocab_i);
        b.arg(&cache_cap);
        // SAFETY: `logits` holds rows * vocab f32 values, `params` rows *
        // SAMPLE_PARAM_WORDS u32 and `out` 2 * rows u32 (checked above and by
        // the op); the launch gives each program cache_cap floats of dynamic
        // shared memory, within the limit `function` raised the kernel to;
        // the guards keep the buffers alive and ordered past the launch.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(out)
}

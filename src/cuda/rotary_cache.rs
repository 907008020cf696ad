//! Launch plumbing of `rotary_reshape_and_cache` on CUDA
//! (`rotary_cache_*` in kernels/reshape_and_cache.cu): one program per
//! token rotates its query and key heads, writes the queries to a new
//! output and the keys and values to the caches (skipping slots outside the
//! cache). Allocates only its output, so it can be captured in a CUDA graph.
//!
//! Imports `params` and the sibling CUDA modules; never `ops` or `cpu`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaStorage, DType, Layout, Result, Storage};

use super::buffers::{alloc_uninit, float_name};
use super::{cuda_storage, device_address, fill_nan, function, poison_outputs, CACHE_MODULE};
use crate::params::KvScales;

/// Threads of a program (one per token and head slot): one rotated pair
/// each at head size 128, two value elements.
const THREADS: u32 = 64;

/// The most programs along a launch's y dimension (head slots per token).
const MAX_GRID_Y: u32 = 65_535;

/// What the rotation needs besides the operands.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rotation {
    /// Query heads.
    pub(crate) heads: usize,
    pub(crate) interleaved: bool,
    /// Divisors of an fp8 cache's stores (checked by the op).
    pub(crate) scales: KvScales,
}

fn name_of(op: &str, dtype: DType) -> Result<&'static str> {
    float_name(dtype).ok_or_else(|| {
        candle_core::Error::Msg(format!("{op}: expected f32, f16 or bf16, got {dtype:?}"))
    })
}

/// Runs the kernel. `qkv` `(n, (heads + 2 kv_heads) * d)`, `cos`/`sin`
/// `(n, d / 2)` of the model's dtype, the caches `(blocks, block_size,
/// kv_heads, d)` of that dtype or fp8, `slots` `(n,)` i64; all contiguous
/// and checked by the op. Returns the rotated queries, `n * heads * d`
/// elements of the model's dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    op: &str,
    rot: Rotation,
    qkv: (&CudaStorage, &Layout),
    cos: (&CudaStorage, &Layout),
    sin: (&CudaStorage, &Layout),
    key_cache: (&Storage, &Layout),
    value_cache: (&Storage, &Layout),
    slots: (&Storage, &Layout),
) -> Result<CudaStorage> {
    let kc = cuda_storage(key_cache.0, op, "key_cache")?;
    let vc = cuda_storage(value_cache.0, op, "value_cache")?;
    let sl = cuda_storage(slots.0, op, "slot_mapping")?;
    for (name, l) in [
        ("qkv", qkv.1),
        ("cos", cos.1),
        ("sin", sin.1),
        ("key_cache", key_cache.1),
        ("value_cache", value_cache.1),
        ("slot_mapping", slots.1),
    ] {
        if l.contiguous_offsets().is_none() {
            bail!("{op}: {name} must be contiguous");
        }
    }
    let &[_, _, _, d] = key_cache.1.dims() else {
        bail!(
            "{op}: key_cache must have rank 4, got {:?}",
            key_cache.1.dims()
        );
    };
    let n = qkv.1.dims().first().copied().unwrap_or(0);
    name_of(op, qkv.0.dtype())?;
    let fp8 = match kc.dtype() {
        DType::F8E4M3 => true,
        dt if dt == cos.0.dtype() => false,
        dt => bail!(
            "{op}: the caches are {dt:?}, not {:?} or F8E4M3",
            cos.0.dtype()
        ),
    };
    if vc.dtype() != kc.dtype() || sl.dtype() != DType::I64 {
        bail!(
            "{op}: value_cache {:?} / slots {:?}",
            vc.dtype(),
            sl.dtype()
        );
    }
    let dev = qkv.0.device().clone();
    let q_elems = n * rot.heads * d;
    // The kernel (one program per token) writes every query element.
    let q = alloc_uninit(op, &dev, cos.0.dtype(), q_elems)?;
    if n == 0 {
        return Ok(q);
    }
    launch(
        op,
        rot,
        &q,
        n,
        (qkv, cos, sin),
        (kc, vc, sl),
        (key_cache.1, value_cache.1, slots.1),
        fp8,
    )?;
    Ok(q)
}

/// Launches the kernel writing `q` (`n` tokens); the arguments as in
/// [`forward`], unpacked.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn launch(
    op: &str,
    rot: Rotation,
    q: &CudaStorage,
    n: usize,
    (qkv, cos, sin): (
        (&CudaStorage, &Layout),
        (&CudaStorage, &Layout),
        (&CudaStorage, &Layout),
    ),
    (kc, vc, sl): (&CudaStorage, &CudaStorage, &CudaStorage),
    (kc_l, vc_l, sl_l): (&Layout, &Layout, &Layout),
    fp8: bool,
) -> Result<()> {
    let dev = qkv.0.device().clone();
    let stream = dev.cuda_stream();
    let &[blocks, block_size, kv_heads, d] = kc_l.dims() else {
        bail!("{op}: key_cache must have rank 4, got {:?}", kc_l.dims());
    };
    let model = name_of(op, cos.0.dtype())?;
    let input = name_of(op, qkv.0.dtype())?;
    let q_elems = n * rot.heads * d;
    let (q_addr, _q_sync) = device_address(q, &Layout::contiguous(q_elems), &stream);
    if poison_outputs() {
        fill_nan(q_addr, q_elems * cos.0.dtype().size_in_bytes(), &stream)?;
    }
    let (Ok(heads), Ok(kvh), Ok(d_i)) = (
        i32::try_from(rot.heads),
        i32::try_from(kv_heads),
        i32::try_from(d),
    ) else {
        bail!("{op}: {} heads, {kv_heads} kv heads of {d}", rot.heads);
    };
    let Some(capacity) = blocks
        .checked_mul(block_size)
        .and_then(|c| i64::try_from(c).ok())
    else {
        bail!("{op}: {blocks} blocks of {block_size} rows overflow i64");
    };
    let (qkv_addr, _a) = device_address(qkv.0, qkv.1, &stream);
    let (cos_addr, _b) = device_address(cos.0, cos.1, &stream);
    let (sin_addr, _c) = device_address(sin.0, sin.1, &stream);
    let (kc_addr, _d) = device_address(kc, kc_l, &stream);
    let (vc_addr, _e) = device_address(vc, vc_l, &stream);
    let (slot_addr, _f) = device_address(sl, sl_l, &stream);
    let inv = |s: f32| if fp8 { 1.0 / s } else { 1.0 };
    let (k_inv, v_inv) = (inv(rot.scales.k_scale), inv(rot.scales.v_scale));
    let interleaved = rot.interleaved as i32;
    let name = format!(
        "rotary_cache_{input}_{model}{}",
        if fp8 { "_fp8" } else { "" }
    );
    let func = function(&dev, &name, &CACHE_MODULE, 0)?;
    let grid = u32::try_from(n).map_err(|_| {
        candle_core::Error::Msg(format!("{op}: {n} tokens is too many for one launch"))
    })?;
    // One program per (token, head slot): query, key, then value heads.
    let slots_per_token = rot.heads + 2 * kv_heads;
    let head_slots = u32::try_from(slots_per_token)
        .ok()
        .filter(|&s| s <= MAX_GRID_Y)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "{op}: {} heads and 2 x {kv_heads} kv heads exceed {MAX_GRID_Y} programs per token",
                rot.heads
            ))
        })?;
    let cfg = LaunchConfig {
        grid_dim: (grid, head_slots, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(&qkv_addr);
    b.arg(&cos_addr);
    b.arg(&sin_addr);
    b.arg(&q_addr);
    b.arg(&kc_addr);
    b.arg(&vc_addr);
    b.arg(&slot_addr);
    b.arg(&heads);
    b.arg(&kvh);
    b.arg(&d_i);
    b.arg(&interleaved);
    b.arg(&capacity);
    b.arg(&k_inv);
    b.arg(&v_inv);
    // SAFETY: `qkv` holds n rows of (heads + 2 kv_heads) * d elements,
    // `cos`/`sin` n rows of d / 2, `q` n * heads * d, the caches `capacity`
    // rows of kv_heads * d and `slots` n i64 values, of the kernel's types
    // (checked by the op and above); the kernel writes cache rows only for
    // slots in 0..capacity. The caches are written through their addresses
    // while their storages are read-locked by the caller: as for every
    // kernel output, the device memory is not aliased by any host reference,
    // and the stream orders these writes after earlier reads. The guards
    // keep every buffer alive and ordered past the launch.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

//! Launch plumbing of `ReshapeAndCache` on CUDA: one program per new token
//! copies its `num_kv_heads * head_size` row to cache row `slot` (skipping
//! negative slots and slots past the cache), converting to fp8 for an
//! `F8E4M3` cache.
//!
//! Imports `params`; never `ops` or `cpu`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtrMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{bail, CudaStorage, DType, Layout, Result};

use super::buffers::float_name;
use super::{device_address, function, CACHE_MODULE};
use crate::params::CacheWrite;

const OP: &str = "reshape-and-cache";

/// Writes `new` `(num_tokens, num_kv_heads, head_size)` into `cache`
/// `(num_blocks, block_size, num_kv_heads, head_size)` at `slots`; an fp8
/// cache stores `x * write.inv_scale`. `write` comes from the op's checks
/// (shapes, dtypes, contiguity); the slots stay on the device, so the kernel
/// skips any slot outside `0..write.capacity`.
pub(crate) fn forward(
    write: &CacheWrite,
    cache: &mut CudaStorage,
    cache_layout: &Layout,
    new: &CudaStorage,
    new_layout: &Layout,
    slots: &CudaStorage,
    slots_layout: &Layout,
) -> Result<()> {
    let num_tokens = write.num_tokens;
    if new_layout.contiguous_offsets().is_none() || cache_layout.contiguous_offsets().is_none() {
        bail!("{OP}: the new values and the cache must be contiguous");
    }
    if slots.dtype() != DType::I64 || slots_layout.contiguous_offsets().is_none() {
        bail!("{OP}: slot_mapping must be a contiguous i64 tensor");
    }
    if slots_layout.shape().elem_count() != num_tokens
        || num_tokens.checked_mul(write.row) != Some(new_layout.shape().elem_count())
    {
        bail!(
            "{OP}: slot_mapping has {} entries and the new values {} elements, but there are {num_tokens} tokens of {} elements",
            slots_layout.shape().elem_count(),
            new_layout.shape().elem_count(),
            write.row
        );
    }
    if num_tokens == 0 {
        return Ok(());
    }
    let Some(src_name) = float_name(new.dtype()) else {
        bail!(
            "{OP}: values must be f32, f16 or bf16, got {:?}",
            new.dtype()
        );
    };
    let fp8 = match cache.dtype() {
        DType::F8E4M3 => true,
        dt if dt == new.dtype() => false,
        dt => bail!(
            "{OP}: cache must be {:?} or F8E4M3, got {dt:?}",
            new.dtype()
        ),
    };
    let dev = cache.device().clone();
    let stream = dev.cuda_stream();
    let (Ok(row_elems), Ok(capacity)) = (i64::try_from(write.row), i64::try_from(write.capacity))
    else {
        bail!(
            "{OP}: {} rows of {} elements do not fit 64-bit offsets",
            write.capacity,
            write.row
        );
    };
    let elem = new.dtype().size_in_bytes();

    let (src_addr, _src_sync) = device_address(new, new_layout, &stream);
    let (slot_addr, _slot_sync) = device_address(slots, slots_layout, &stream);
    let cache_off = cache_layout.start_offset();
    let cache_elem = cache.dtype().size_in_bytes();
    let (cache_base, _cache_sync) = match &mut cache.slice {
        CudaStorageSlice::F32(s) => s.device_ptr_mut(&stream),
        CudaStorageSlice::F16(s) => s.device_ptr_mut(&stream),
        CudaStorageSlice::BF16(s) => s.device_ptr_mut(&stream),
        CudaStorageSlice::F8E4M3(s) => s.device_ptr_mut(&stream),
        _ => bail!("{OP}: unsupported cache dtype {:?}", cache.dtype()),
    };
    let cache_addr = cache_base + (cache_off * cache_elem) as u64;
    // 16-byte loads when every row starts 16-byte aligned (fp8 stores are bytewise).
    let epv = 16 / elem;
    let vec = row_elems % epv as i64 == 0
        && src_addr.is_multiple_of(16)
        && (fp8 || cache_addr.is_multiple_of(16));

    let name = format!(
        "reshape_and_cache_{src_name}{}",
        if fp8 { "_fp8" } else { "" }
    );
    let func = function(&dev, &name, &CACHE_MODULE, 0)?;
    let grid_x = u32::try_from(num_tokens).map_err(|_| {
        candle_core::Error::Msg(format!(
            "{OP}: {num_tokens} tokens is too many for one launch"
        ))
    })?;
    let cfg = LaunchConfig {
        grid_dim: (grid_x, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let inv_scale = write.inv_scale;
    let vec_i = vec as i32;
    let mut b = stream.launch_builder(&func);
    b.arg(&src_addr);
    b.arg(&cache_addr);
    b.arg(&slot_addr);
    b.arg(&row_elems);
    b.arg(&capacity);
    b.arg(&inv_scale);
    b.arg(&vec_i);
    // SAFETY: `src` holds num_tokens rows of row_elems elements, `slots`
    // num_tokens i64 values, and `cache` `capacity` rows of row_elems
    // (checked by the op from the layouts); the kernel writes only rows
    // `0 <= slot < capacity`. The guards keep the buffers alive and ordered
    // until after the launch.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

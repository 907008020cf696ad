//! `ReshapeAndCache`: scatters new keys and values into the paged caches.

use candle_core::{bail, CpuStorage, DType, Layout, Result, Tensor};

use crate::batch::SlotMapping;
use crate::ops::KvScales;

const OP: &str = "reshape-and-cache";

/// The in-place op on one cache. Applied as
/// `cache.inplace_op3(&new, slot_mapping.slots(), &ReshapeAndCache { .. })`,
/// which locks `cache` for writing: `new` `(num_tokens, num_kv_heads, head_size)`
/// goes to rows `slot % block_size` of blocks `slot / block_size`; negative
/// slots are skipped. An `F8E4M3` cache stores `clamp(x / scale, -448, 448)`.
/// Use it through [`reshape_and_cache`], which validates the call.
#[derive(Clone, Copy, Debug)]
pub struct ReshapeAndCache {
    /// Divides values stored into an `F8E4M3` cache.
    pub scale: f32,
}

impl candle_core::InplaceOp3 for ReshapeAndCache {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        cache_layout: &Layout,
        new: &CpuStorage,
        new_layout: &Layout,
        slots: &CpuStorage,
        slots_layout: &Layout,
    ) -> Result<()> {
        crate::cpu::reshape_and_cache::forward(
            self.scale,
            cache,
            cache_layout,
            new,
            new_layout,
            slots,
            slots_layout,
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cache_layout: &Layout,
        new: &candle_core::CudaStorage,
        new_layout: &Layout,
        slots: &candle_core::CudaStorage,
        slots_layout: &Layout,
    ) -> Result<()> {
        crate::cuda::reshape_and_cache::forward(
            self.scale,
            cache,
            cache_layout,
            new,
            new_layout,
            slots,
            slots_layout,
        )
    }
}

fn validate_pair(
    name: &str,
    new: &Tensor,
    cache: &Tensor,
    slot_mapping: &SlotMapping,
) -> Result<()> {
    let &[num_tokens, num_kv_heads, head_size] = new.dims() else {
        bail!(
            "{OP}: {name} must have rank 3 [num_tokens, num_kv_heads, head_size], got shape {:?}",
            new.dims()
        );
    };
    let &[num_blocks, block_size, cache_heads, cache_head_size] = cache.dims() else {
        bail!(
            "{OP}: {name}_cache must have rank 4 [num_blocks, block_size, num_kv_heads, head_size], got shape {:?}",
            cache.dims()
        );
    };
    if !matches!(new.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        bail!(
            "{OP}: {name} must be f32, f16 or bf16, got {:?}",
            new.dtype()
        );
    }
    if cache.dtype() != new.dtype() && cache.dtype() != DType::F8E4M3 {
        bail!(
            "{OP}: {name}_cache must be {:?} (the {name} dtype) or F8E4M3, got {:?}",
            new.dtype(),
            cache.dtype()
        );
    }
    if !new.device().same_device(cache.device()) {
        bail!(
            "{OP}: {name} is on {:?} but {name}_cache is on {:?}",
            new.device().location(),
            cache.device().location()
        );
    }
    if !slot_mapping.slots().device().same_device(cache.device()) {
        bail!(
            "{OP}: slot_mapping is on {:?} but {name}_cache is on {:?}",
            slot_mapping.slots().device().location(),
            cache.device().location()
        );
    }
    if !cache.is_contiguous() {
        bail!("{OP}: {name}_cache must be contiguous");
    }
    if (cache_heads, cache_head_size) != (num_kv_heads, head_size) {
        bail!(
            "{OP}: {name} has {num_kv_heads} heads of size {head_size} but {name}_cache has {cache_heads} heads of size {cache_head_size}"
        );
    }
    if slot_mapping.len() != num_tokens {
        bail!(
            "{OP}: slot_mapping has {} entries but {name} has {num_tokens} tokens",
            slot_mapping.len()
        );
    }
    if let Some(max) = slot_mapping.max_slot() {
        let capacity = (num_blocks * block_size) as i64;
        if max >= capacity {
            bail!("{OP}: slot_mapping holds slot {max} >= num_blocks * block_size = {capacity}");
        }
    }
    Ok(())
}

/// Writes new keys and values into the paged caches, in place.
///
/// # Arguments
/// * `key`, `value` - `(num_tokens, num_kv_heads, head_size)`, f32/f16/bf16.
/// * `key_cache`, `value_cache` - `(num_blocks, block_size, num_kv_heads, head_size)`,
///   contiguous, the dtype of `key`/`value` or `F8E4M3`.
/// * `slot_mapping` - one slot per token, `block * block_size + row`; negative = padding.
/// * `scales` - an `F8E4M3` cache stores `clamp(k / k_scale)` and `clamp(v / v_scale)`.
pub fn reshape_and_cache(
    key: &Tensor,
    value: &Tensor,
    key_cache: &Tensor,
    value_cache: &Tensor,
    slot_mapping: &SlotMapping,
    scales: KvScales,
) -> Result<()> {
    if key.dims() != value.dims() {
        bail!(
            "{OP}: key shape {:?} differs from value shape {:?}",
            key.dims(),
            value.dims()
        );
    }
    if key_cache.dims() != value_cache.dims() {
        bail!(
            "{OP}: key_cache shape {:?} differs from value_cache shape {:?}",
            key_cache.dims(),
            value_cache.dims()
        );
    }
    validate_pair("key", key, key_cache, slot_mapping)?;
    validate_pair("value", value, value_cache, slot_mapping)?;
    if key_cache.dtype() == DType::F8E4M3 || value_cache.dtype() == DType::F8E4M3 {
        scales.validate(OP)?;
    }
    if slot_mapping.is_empty() {
        return Ok(());
    }
    let key = key.contiguous()?;
    let value = value.contiguous()?;
    key_cache.inplace_op3(
        &key,
        slot_mapping.slots(),
        &ReshapeAndCache {
            scale: scales.k_scale,
        },
    )?;
    value_cache.inplace_op3(
        &value,
        slot_mapping.slots(),
        &ReshapeAndCache {
            scale: scales.v_scale,
        },
    )
}

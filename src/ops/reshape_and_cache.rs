//! `ReshapeAndCache`: scatters new keys and values into the paged caches.
//!
//! Imports `params`, `batch` and the backends; nothing above it.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Tensor};

use crate::batch::SlotMapping;
use crate::ops::storage_address;
use crate::params::{check_scale, CacheWrite, KvScales};

const OP: &str = "reshape-and-cache";

/// The in-place op on one cache. Applied as
/// `cache.inplace_op3(&new, slot_mapping.slots(), &ReshapeAndCache { .. })`,
/// which locks `cache` for writing: `new` `(num_tokens, num_kv_heads, head_size)`
/// goes to rows `slot % block_size` of blocks `slot / block_size`; negative
/// slots are skipped. An `F8E4M3` cache stores `clamp(x / scale, -448, 448)`.
///
/// Prefer [`reshape_and_cache`], which validates the whole call (both caches,
/// the slot mapping's bounds and duplicates) on the host. Applied directly,
/// the op still checks everything it can without reading device memory
/// before it reaches a backend: ranks, dtypes, that `new` has the cache's
/// heads and head size, one i64 slot per token, contiguity and the scale of
/// an fp8 cache. On the CPU it also rejects a slot `>= num_blocks *
/// block_size` before writing anything; on CUDA, where the slots are not
/// read back, the kernel skips such slots instead.
///
/// Duplicate slots in one call: on the CPU the last token wins; on CUDA
/// which one wins is unspecified. [`SlotMapping`] rejects duplicates, so
/// [`reshape_and_cache`] never sees any.
#[derive(Clone, Copy, Debug)]
pub struct ReshapeAndCache {
    /// Divides values stored into an `F8E4M3` cache; must be a normal,
    /// finite, positive float (ignored for other caches).
    pub scale: f32,
}

impl ReshapeAndCache {
    /// Checks one application of the op from the operands' dtypes and
    /// layouts (no device data is read).
    pub(crate) fn check(
        &self,
        cache: (DType, &Layout),
        new: (DType, &Layout),
        slots: (DType, &Layout),
    ) -> Result<CacheWrite> {
        let (cache_dtype, cache_layout) = cache;
        let (new_dtype, new_layout) = new;
        let (slots_dtype, slots_layout) = slots;
        let &[num_blocks, block_size, cache_heads, cache_head_size] = cache_layout.dims() else {
            bail!(
                "{OP}: the cache must have rank 4 [num_blocks, block_size, num_kv_heads, head_size], got shape {:?}",
                cache_layout.dims()
            );
        };
        let &[num_tokens, num_kv_heads, head_size] = new_layout.dims() else {
            bail!(
                "{OP}: the new values must have rank 3 [num_tokens, num_kv_heads, head_size], got shape {:?}",
                new_layout.dims()
            );
        };
        if (num_kv_heads, head_size) != (cache_heads, cache_head_size) {
            bail!(
                "{OP}: the new values have {num_kv_heads} heads of size {head_size} but the cache has {cache_heads} heads of size {cache_head_size}"
            );
        }
        if block_size == 0 || num_kv_heads == 0 || head_size == 0 {
            bail!(
                "{OP}: block_size, num_kv_heads and head_size must be positive, got {block_size}, {num_kv_heads} and {head_size}"
            );
        }
        if !matches!(new_dtype, DType::F32 | DType::F16 | DType::BF16) {
            bail!("{OP}: the new values must be f32, f16 or bf16, got {new_dtype:?}");
        }
        if cache_dtype != new_dtype && cache_dtype != DType::F8E4M3 {
            bail!(
                "{OP}: the cache must be {new_dtype:?} (the new values' dtype) or F8E4M3, got {cache_dtype:?}"
            );
        }
        let inv_scale = if cache_dtype == DType::F8E4M3 {
            check_scale(OP, "scale", self.scale)?;
            1.0 / self.scale
        } else {
            1.0
        };
        if slots_dtype != DType::I64 {
            bail!("{OP}: slot_mapping must be i64, got {slots_dtype:?}");
        }
        if slots_layout.shape().elem_count() != num_tokens {
            bail!(
                "{OP}: slot_mapping has {} entries but there are {num_tokens} new tokens",
                slots_layout.shape().elem_count()
            );
        }
        for (name, layout) in [
            ("the cache", cache_layout),
            ("the new values", new_layout),
            ("slot_mapping", slots_layout),
        ] {
            if layout.contiguous_offsets().is_none() {
                bail!("{OP}: {name} must be contiguous");
            }
        }
        // The cache and `new` exist, so these products fit; checked anyway.
        let row = num_kv_heads.checked_mul(head_size);
        let capacity = num_blocks.checked_mul(block_size);
        let (Some(row), Some(capacity)) = (row, capacity) else {
            bail!(
                "{OP}: cache shape {:?} overflows usize",
                cache_layout.dims()
            );
        };
        Ok(CacheWrite {
            num_tokens,
            row,
            capacity,
            inv_scale,
        })
    }
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
        let write = self.check(
            (cache.dtype(), cache_layout),
            (new.dtype(), new_layout),
            (slots.dtype(), slots_layout),
        )?;
        crate::cpu::reshape_and_cache::forward(
            &write,
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
        let write = self.check(
            (cache.dtype(), cache_layout),
            (new.dtype(), new_layout),
            (slots.dtype(), slots_layout),
        )?;
        crate::cuda::reshape_and_cache::forward(
            &write,
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
    let new = NewRows {
        num_tokens,
        num_kv_heads,
        head_size,
        dtype: new.dtype(),
        device: new.device(),
    };
    validate_write(OP, name, &new, cache, slot_mapping)
}

/// The rows a cache write stores: `(num_tokens, num_kv_heads, head_size)`
/// of `dtype` on `device`.
pub(crate) struct NewRows<'a> {
    pub(crate) num_tokens: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_size: usize,
    pub(crate) dtype: DType,
    pub(crate) device: &'a candle_core::Device,
}

/// Checks that `new` rows can be stored into `cache` (named `{name}_cache`
/// in errors of `op`) at `slot_mapping`: shapes, dtypes, devices,
/// contiguity and every slot below the cache's capacity.
pub(crate) fn validate_write(
    op: &str,
    name: &str,
    new: &NewRows<'_>,
    cache: &Tensor,
    slot_mapping: &SlotMapping,
) -> Result<()> {
    let (num_tokens, num_kv_heads, head_size) = (new.num_tokens, new.num_kv_heads, new.head_size);
    let &[num_blocks, block_size, cache_heads, cache_head_size] = cache.dims() else {
        bail!(
            "{op}: {name}_cache must have rank 4 [num_blocks, block_size, num_kv_heads, head_size], got shape {:?}",
            cache.dims()
        );
    };
    if block_size == 0 || cache_heads == 0 || cache_head_size == 0 {
        bail!(
            "{op}: {name}_cache has block_size {block_size}, {cache_heads} heads and head_size {cache_head_size}; all must be positive"
        );
    }
    if !matches!(new.dtype, DType::F32 | DType::F16 | DType::BF16) {
        bail!("{op}: {name} must be f32, f16 or bf16, got {:?}", new.dtype);
    }
    if cache.dtype() != new.dtype && cache.dtype() != DType::F8E4M3 {
        bail!(
            "{op}: {name}_cache must be {:?} (the {name} dtype) or F8E4M3, got {:?}",
            new.dtype,
            cache.dtype()
        );
    }
    if !new.device.same_device(cache.device()) {
        bail!(
            "{op}: {name} is on {:?} but {name}_cache is on {:?}",
            new.device.location(),
            cache.device().location()
        );
    }
    if !slot_mapping.slots().device().same_device(cache.device()) {
        bail!(
            "{op}: slot_mapping is on {:?} but {name}_cache is on {:?}",
            slot_mapping.slots().device().location(),
            cache.device().location()
        );
    }
    if !cache.is_contiguous() {
        bail!("{op}: {name}_cache must be contiguous");
    }
    if (cache_heads, cache_head_size) != (num_kv_heads, head_size) {
        bail!(
            "{op}: {name} has {num_kv_heads} heads of size {head_size} but {name}_cache has {cache_heads} heads of size {cache_head_size}"
        );
    }
    if slot_mapping.len() != num_tokens {
        bail!(
            "{op}: slot_mapping has {} entries but {name} has {num_tokens} tokens",
            slot_mapping.len()
        );
    }
    if let Some(max) = slot_mapping.max_slot() {
        // A slot past i64::MAX rows cannot be named, so saturating is exact here.
        let capacity = i64::try_from(num_blocks.saturating_mul(block_size)).unwrap_or(i64::MAX);
        if max >= capacity {
            bail!("{op}: slot_mapping holds slot {max} >= num_blocks * block_size = {capacity}");
        }
    }
    Ok(())
}

/// Writes new keys and values into the paged caches, in place.
///
/// # Arguments
/// * `key`, `value` - `(num_tokens, num_kv_heads, head_size)`, f32/f16/bf16.
/// * `key_cache`, `value_cache` - `(num_blocks, block_size, num_kv_heads, head_size)`,
///   contiguous, the dtype of `key`/`value` or `F8E4M3`; two distinct
///   allocations (one tensor, or two views of one, as both caches is an error).
/// * `slot_mapping` - one slot per token, `block * block_size + row`, each
///   below `num_blocks * block_size`; negative = padding. A [`SlotMapping`]
///   holds no duplicate slot, so each cache row is written at most once.
/// * `scales` - an `F8E4M3` cache stores `clamp(k / k_scale)` and `clamp(v / v_scale)`;
///   both scales must then be normal, finite and positive.
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
    if storage_address(key_cache) == storage_address(value_cache) {
        bail!(
            "{OP}: key_cache and value_cache share one allocation; they must be distinct tensors"
        );
    }
    if key_cache.dtype() == DType::F8E4M3 || value_cache.dtype() == DType::F8E4M3 {
        scales.validate(OP)?;
    }
    // Launched even when every slot is padding: the launches depend only on
    // the shapes, so a CUDA graph captured on padding sequences stores the
    // real tokens of its replays.
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

//! One layer's paged key and value caches and their sizing.
//!
//! Imports `ops` (storage identity) and `cuda` (free device memory).

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::ops::storage_address;

const OP: &str = "kv-cache";

/// The paged key and value caches of one attention layer.
///
/// Both tensors are `(num_blocks, block_size, num_kv_heads, head_size)`,
/// contiguous, of the model's dtype or `F8E4M3` (then with the layer's
/// [`KvScales`](crate::KvScales)). Token `t` of a sequence lives in block
/// `block_table[t / block_size]`, row `t % block_size`.
///
/// Cloning is cheap and shares the storage: writes through one clone are
/// seen by all.
#[derive(Clone, Debug)]
pub struct LayerKvCache {
    key: Tensor,
    value: Tensor,
}

impl LayerKvCache {
    /// Zero-filled caches of `num_blocks` blocks (0 gives an empty cache,
    /// usable only by a single-token prefill).
    ///
    /// The size is checked before anything is allocated: the two caches
    /// must fit in the device's memory (on CUDA the free memory the driver
    /// reports, on the CPU the machine's physical memory where it is known,
    /// and never more than `isize::MAX` bytes); otherwise the error gives
    /// the byte count.
    ///
    /// # Arguments
    /// * `dtype` - the model's dtype (f32/f16/bf16) or `F8E4M3`.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if block_size == 0 || num_kv_heads == 0 || head_size == 0 {
            bail!(
                "{OP}: block_size, num_kv_heads and head_size must be positive, got {block_size}, {num_kv_heads}, {head_size}"
            );
        }
        check_dtype(dtype)?;
        let per_block = Self::bytes_per_block(block_size, num_kv_heads, head_size, dtype)?;
        let Some(bytes) = per_block.checked_mul(num_blocks) else {
            bail!(
                "{OP}: {num_blocks} blocks of {per_block} bytes (key and value caches) overflow usize"
            );
        };
        let (limit, what) = memory_limit(device)?;
        if bytes > limit {
            bail!(
                "{OP}: {num_blocks} blocks of (block_size {block_size}, {num_kv_heads} kv heads, head_size {head_size}, {dtype:?}) need {bytes} bytes for the key and value caches, more than the {limit} bytes of {what}"
            );
        }
        let shape = (num_blocks, block_size, num_kv_heads, head_size);
        let key = Tensor::zeros(shape, dtype, device)?;
        let value = Tensor::zeros(shape, dtype, device)?;
        Ok(Self { key, value })
    }

    /// Wraps existing caches, `(num_blocks, block_size, num_kv_heads, head_size)`
    /// each, same shape, dtype and device, contiguous.
    ///
    /// The two must be distinct allocations: one tensor (or two views of
    /// one) as both caches would store values over keys.
    pub fn from_tensors(key: Tensor, value: Tensor) -> Result<Self> {
        if key.rank() != 4 {
            bail!(
                "{OP}: key cache must have rank 4 [num_blocks, block_size, num_kv_heads, head_size], got shape {:?}",
                key.dims()
            );
        }
        if key.dims() != value.dims() || key.dtype() != value.dtype() {
            bail!(
                "{OP}: key cache {:?} {:?} and value cache {:?} {:?} differ",
                key.dims(),
                key.dtype(),
                value.dims(),
                value.dtype()
            );
        }
        if !key.device().same_device(value.device()) {
            bail!("{OP}: key and value caches are on different devices");
        }
        if !key.is_contiguous() || !value.is_contiguous() {
            bail!("{OP}: key and value caches must be contiguous");
        }
        check_dtype(key.dtype())?;
        if storage_address(&key) == storage_address(&value) {
            bail!("{OP}: the key and value caches share one allocation; they must be distinct tensors");
        }
        Ok(Self { key, value })
    }

    /// Key cache, `(num_blocks, block_size, num_kv_heads, head_size)`.
    pub fn key(&self) -> &Tensor {
        &self.key
    }

    /// Value cache, `(num_blocks, block_size, num_kv_heads, head_size)`.
    pub fn value(&self) -> &Tensor {
        &self.value
    }

    // The accessors below index dims() of rank-4 tensors: both constructors
    // check the rank, so they cannot panic.

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.key.dims()[0]
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.key.dims()[1]
    }

    /// KV heads per token.
    pub fn num_kv_heads(&self) -> usize {
        self.key.dims()[2]
    }

    /// Elements per head.
    pub fn head_size(&self) -> usize {
        self.key.dims()[3]
    }

    /// Element type of both caches.
    pub fn dtype(&self) -> DType {
        self.key.dtype()
    }

    /// True when the cache has no block.
    pub fn is_empty(&self) -> bool {
        self.num_blocks() == 0
    }

    /// Bytes one block takes in the key and value caches of one layer:
    /// `2 * block_size * num_kv_heads * head_size * dtype size`; an error
    /// when that overflows `usize`.
    pub fn bytes_per_block(
        block_size: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: DType,
    ) -> Result<usize> {
        let bytes = [block_size, num_kv_heads, head_size, dtype.size_in_bytes()]
            .into_iter()
            .try_fold(2usize, |acc, x| acc.checked_mul(x));
        let Some(bytes) = bytes else {
            bail!(
                "{OP}: a block of {block_size} tokens x {num_kv_heads} kv heads x head_size {head_size} of {dtype:?} overflows usize bytes"
            );
        };
        Ok(bytes)
    }
}

/// The most bytes a cache on `device` may take, and what that bound is.
fn memory_limit(device: &Device) -> Result<(usize, String)> {
    let addressable = isize::MAX as usize;
    match device {
        Device::Cpu => Ok(match physical_memory() {
            Some(total) => (total.min(addressable), "physical memory".to_string()),
            None => (addressable, "the address space (isize::MAX)".to_string()),
        }),
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let (free, total) = crate::cuda::memory_info(dev)?;
            Ok((
                free.min(addressable),
                format!("free memory on the cuda device ({total} bytes in all)"),
            ))
        }
        #[allow(unreachable_patterns)]
        _ => Ok((addressable, "the address space (isize::MAX)".to_string())),
    }
}

/// Total physical memory in bytes (`MemTotal` of /proc/meminfo), where the
/// system reports it.
fn physical_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: usize = line
        .trim_start_matches("MemTotal:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

fn check_dtype(dtype: DType) -> Result<()> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3) {
        bail!("{OP}: cache dtype must be f32, f16, bf16 or F8E4M3, got {dtype:?}");
    }
    Ok(())
}

/// How many blocks per layer fit in `budget_bytes` when `num_layers` layers
/// each hold a key and a value cache of `(num_blocks, block_size,
/// num_kv_heads, head_size)` elements of `dtype`.
pub fn num_blocks_for_budget(
    budget_bytes: usize,
    num_layers: usize,
    block_size: usize,
    num_kv_heads: usize,
    head_size: usize,
    dtype: DType,
) -> Result<usize> {
    if num_layers == 0 || block_size == 0 || num_kv_heads == 0 || head_size == 0 {
        bail!(
            "{OP}: num_layers, block_size, num_kv_heads and head_size must be positive, got {num_layers}, {block_size}, {num_kv_heads}, {head_size}"
        );
    }
    let per_block = LayerKvCache::bytes_per_block(block_size, num_kv_heads, head_size, dtype)?;
    let Some(per_block_all_layers) = per_block.checked_mul(num_layers) else {
        bail!("{OP}: {num_layers} layers x {per_block} bytes per block overflow usize");
    };
    // Both factors are positive (checked above), so this divides by >= 1.
    let blocks = budget_bytes / per_block_all_layers;
    if blocks == 0 {
        bail!(
            "{OP}: a budget of {budget_bytes} bytes holds no block ({num_layers} layers x {per_block} bytes per block)"
        );
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_from_budget() {
        // 2 (k, v) * 16 tokens * 2 heads * 64 * 2 bytes = 8 KiB per block and layer.
        assert_eq!(
            LayerKvCache::bytes_per_block(16, 2, 64, DType::BF16).unwrap(),
            8192
        );
        assert_eq!(
            num_blocks_for_budget(8192 * 4 * 10 + 5, 4, 16, 2, 64, DType::BF16).unwrap(),
            10
        );
        assert_eq!(
            num_blocks_for_budget(8192 * 4 * 10, 4, 16, 2, 64, DType::F8E4M3).unwrap(),
            20
        );
        let err = num_blocks_for_budget(100, 4, 16, 2, 64, DType::BF16).unwrap_err();
        assert!(err.to_string().contains("holds no block"), "{err}");
    }

    #[test]
    fn allocates_and_wraps() {
        let c = LayerKvCache::new(5, 4, 2, 8, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            (
                c.num_blocks(),
                c.block_size(),
                c.num_kv_heads(),
                c.head_size()
            ),
            (5, 4, 2, 8)
        );
        assert!(LayerKvCache::new(5, 4, 2, 8, DType::U32, &Device::Cpu).is_err());
        let k = Tensor::zeros((2, 4, 1, 8), DType::F32, &Device::Cpu).unwrap();
        let v = Tensor::zeros((2, 4, 1, 4), DType::F32, &Device::Cpu).unwrap();
        assert!(LayerKvCache::from_tensors(k, v).is_err());
    }
}

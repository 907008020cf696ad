//! One layer's paged key and value caches and their sizing.

use candle_core::{bail, DType, Device, Result, Tensor};

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
        let shape = (num_blocks, block_size, num_kv_heads, head_size);
        let key = Tensor::zeros(shape, dtype, device)?;
        let value = Tensor::zeros(shape, dtype, device)?;
        Ok(Self { key, value })
    }

    /// Wraps existing caches, `(num_blocks, block_size, num_kv_heads, head_size)`
    /// each, same shape, dtype and device, contiguous.
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

    /// Bytes one block takes in the key and value caches of one layer.
    pub fn bytes_per_block(
        block_size: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: DType,
    ) -> usize {
        2 * block_size * num_kv_heads * head_size * dtype.size_in_bytes()
    }
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
    let per_block = LayerKvCache::bytes_per_block(block_size, num_kv_heads, head_size, dtype);
    if num_layers == 0 || per_block == 0 {
        bail!(
            "{OP}: num_layers, block_size, num_kv_heads and head_size must be positive, got {num_layers}, {block_size}, {num_kv_heads}, {head_size}"
        );
    }
    let blocks = budget_bytes / (per_block * num_layers);
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
        assert_eq!(LayerKvCache::bytes_per_block(16, 2, 64, DType::BF16), 8192);
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

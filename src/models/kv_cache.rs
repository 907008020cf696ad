//! The KV caches of all layers of a model, the block manager that fits
//! them, and their sizing: [`CacheFootprint`] (bytes per block) and
//! [`MemoryProfile`] (what the device leaves for the cache after the
//! weights and a profiled forward pass, vLLM's `gpu_memory_utilization`).

use candle_core::{bail, DType, Device, Result, Tensor};

use super::PagedModel;
use crate::attention::{Attention, KvCacheDtype};
use crate::cache::{BlockManager, BlockManagerConfig, LayerKvCache, Work};

const OP: &str = "paged-kv-cache";

/// How many blocks the caches hold.
///
/// * `num_blocks` - blocks of each full-attention layer's cache.
/// * `window_blocks` - `Some(n)`: layers with a sliding window get caches of
///   `n` blocks in their window group, whose blocks are recycled once they
///   fall out of the window; `None`: they share the full-attention tables.
/// * `prefix_caching` - share cached prompt blocks between sequences (not
///   with window groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Blocks of each full-attention layer's cache.
    pub num_blocks: usize,
    /// Blocks of each sliding-window layer's cache, when windows get groups.
    pub window_blocks: Option<usize>,
    /// Share full prompt blocks between sequences with the same prefix.
    pub prefix_caching: bool,
}

impl CacheConfig {
    /// `num_blocks` blocks per layer, no window groups, no prefix caching.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            num_blocks,
            window_blocks: None,
            prefix_caching: false,
        }
    }
}

/// One [`LayerKvCache`] per decoder layer, each
/// `(num_blocks, block_size, num_kv_heads, head_size)` for keys and values.
#[derive(Debug)]
pub struct PagedKvCache {
    layers: Vec<LayerKvCache>,
    config: CacheConfig,
    block_size: usize,
    windows: Vec<usize>,
}

impl PagedKvCache {
    /// Allocates zeroed caches for `layers` (a model's
    /// [`attention_layers`](super::PagedModel::attention_layers)).
    ///
    /// # Arguments
    /// * `layers` - one attention layer per decoder layer; all share one block size.
    /// * `config` - block counts.
    /// * `dtype` - the model's activation dtype (fp8 layers get fp8 caches).
    /// * `device` - where the caches live.
    pub fn new(
        layers: &[&Attention],
        config: CacheConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let Some(first) = layers.first() else {
            bail!("{OP}: a model needs at least one attention layer");
        };
        let block_size = first.options().block_size;
        if config.num_blocks == 0 || config.window_blocks == Some(0) {
            bail!("{OP}: block counts must be positive, got {config:?}");
        }
        let mut windows = Vec::new();
        let mut caches = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let opts = layer.options();
            if opts.block_size != block_size {
                bail!(
                    "{OP}: layer {i} has block_size {} but layer 0 has {block_size}",
                    opts.block_size
                );
            }
            let blocks = match (opts.sliding_window, config.window_blocks) {
                (Some(w), Some(n)) => {
                    if !windows.contains(&w) {
                        windows.push(w);
                    }
                    n
                }
                _ => config.num_blocks,
            };
            caches.push(layer.new_cache(blocks, dtype, device)?);
        }
        if config.prefix_caching && !windows.is_empty() {
            bail!(
                "{OP}: prefix caching cannot be combined with window groups (windows {windows:?})"
            );
        }
        Ok(Self {
            layers: caches,
            config,
            block_size,
            windows,
        })
    }

    /// A block manager whose pools match these caches.
    pub fn block_manager(&self) -> Result<BlockManager> {
        let mut cfg = BlockManagerConfig::new(self.block_size, self.config.num_blocks)
            .with_prefix_caching(self.config.prefix_caching);
        if let Some(n) = self.config.window_blocks {
            for &w in &self.windows {
                cfg = cfg.with_window_group(w, n);
            }
        }
        BlockManager::new(cfg)
    }

    /// The cache of layer `i`; an error naming `i` and the layer count when
    /// `i >= num_layers()` (see [`get_layer`](Self::get_layer) for an
    /// `Option`).
    pub fn layer(&self, i: usize) -> Result<&LayerKvCache> {
        match self.layers.get(i) {
            Some(layer) => Ok(layer),
            None => bail!(
                "{OP}: layer {i} does not exist; the cache has {} layers",
                self.layers.len()
            ),
        }
    }

    /// The cache of layer `i`, or `None` when `i >= num_layers()`.
    pub fn get_layer(&self, i: usize) -> Option<&LayerKvCache> {
        self.layers.get(i)
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The block counts the caches were built with.
    pub fn config(&self) -> CacheConfig {
        self.config
    }

    /// Bytes held by all key and value caches.
    pub fn memory_bytes(&self) -> usize {
        // Allocated tensors: each product fits; the sum saturates in theory.
        self.layers
            .iter()
            .map(|c| 2 * c.key().elem_count() * c.dtype().size_in_bytes())
            .fold(0, usize::saturating_add)
    }
}

/// What the KV caches of a model cost, for sizing them: the bytes of one
/// block in every full-attention layer's key and value caches, and the
/// fixed bytes of the window groups' caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheFootprint {
    block_bytes: usize,
    fixed_bytes: usize,
    num_layers: usize,
    block_size: usize,
}

impl CacheFootprint {
    /// The footprint of the caches [`PagedKvCache::new`] would build for
    /// `layers` with activations in `dtype` (fp8 layers store one byte per
    /// element); `window_blocks` as in [`CacheConfig`]. Fails when there is
    /// no layer, when the layers' block sizes differ, or when a size
    /// overflows `usize`.
    pub fn new(layers: &[&Attention], dtype: DType, window_blocks: Option<usize>) -> Result<Self> {
        let Some(first) = layers.first() else {
            bail!("{OP}: a model needs at least one attention layer");
        };
        let block_size = first.options().block_size;
        let (mut block_bytes, mut fixed_bytes) = (0usize, 0usize);
        for (i, l) in layers.iter().enumerate() {
            let opts = l.options();
            if opts.block_size != block_size {
                bail!(
                    "{OP}: layer {i} has block_size {} but layer 0 has {block_size}",
                    opts.block_size
                );
            }
            let elem = match opts.kv_cache_dtype {
                KvCacheDtype::Auto => dtype.size_in_bytes(),
                KvCacheDtype::Fp8E4M3(_) => DType::F8E4M3.size_in_bytes(),
            };
            let Some(bytes) = [block_size, l.num_kv_heads(), l.head_size(), elem]
                .into_iter()
                .try_fold(2usize, |acc, x| acc.checked_mul(x))
            else {
                bail!(
                    "{OP}: a block of {block_size} tokens of layer {i} ({} kv heads x head_size {}) takes more than usize::MAX bytes",
                    l.num_kv_heads(),
                    l.head_size()
                );
            };
            let sum = match (opts.sliding_window, window_blocks) {
                (Some(_), Some(n)) => n
                    .checked_mul(bytes)
                    .and_then(|b| fixed_bytes.checked_add(b))
                    .map(|b| fixed_bytes = b),
                _ => block_bytes.checked_add(bytes).map(|b| block_bytes = b),
            };
            if sum.is_none() {
                bail!("{OP}: the caches' bytes per block overflow usize at layer {i}");
            }
        }
        Ok(Self {
            block_bytes,
            fixed_bytes,
            num_layers: layers.len(),
            block_size,
        })
    }

    /// Bytes of one block in every full-attention layer's key and value
    /// caches (0 when every layer has a window group).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Bytes of the window groups' caches, whatever `num_blocks` is.
    pub fn fixed_bytes(&self) -> usize {
        self.fixed_bytes
    }

    /// Bytes of all caches with `num_blocks` blocks per full-attention
    /// layer; `None` when they overflow `usize`.
    pub fn total_bytes(&self, num_blocks: usize) -> Option<usize> {
        num_blocks
            .checked_mul(self.block_bytes)?
            .checked_add(self.fixed_bytes)
    }

    /// The most blocks per full-attention layer whose caches, with the
    /// window groups' ones, fit in `budget` bytes. Fails, giving the sizes,
    /// when not even one block fits, and when no layer has a full-attention
    /// cache (its block count is then not a matter of bytes).
    pub fn blocks_for_bytes(&self, budget: usize) -> Result<usize> {
        if self.block_bytes == 0 {
            bail!(
                "{OP}: every layer has a window cache, so a byte budget does not size the full-attention pool; give its block count"
            );
        }
        let blocks = budget.saturating_sub(self.fixed_bytes) / self.block_bytes;
        if blocks == 0 {
            bail!(
                "{OP}: {budget} bytes hold no cache block ({} layers, {} bytes per block of {} tokens over the full-attention layers, {} bytes of window caches)",
                self.num_layers,
                self.block_bytes,
                self.block_size,
                self.fixed_bytes
            );
        }
        Ok(blocks)
    }
}

/// The device memory a model leaves for its KV cache, measured by
/// [`MemoryProfile::measure`] (or given, to size a cache by hand).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryProfile {
    /// The device's memory.
    pub total_bytes: usize,
    /// Free memory after the weights are loaded and the profiling forward
    /// pass ran (its activations released).
    pub free_bytes: usize,
    /// The most memory the profiling forward pass held at once beyond what
    /// was allocated before it (activations, workspaces).
    pub activation_peak_bytes: usize,
}

/// The default fraction of the device memory the engine's process may use,
/// KV cache included (vLLM's `gpu_memory_utilization`).
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

/// The default KV-cache budget on the CPU, over all layers.
pub const DEFAULT_CPU_KV_BYTES: usize = 256 << 20;

impl MemoryProfile {
    /// Bytes the KV cache may take when the process uses at most
    /// `utilization` of the device memory: `utilization * total` minus the
    /// memory in use (`total - free`: weights, other allocations, other
    /// processes) minus the activation peak, and never more than what is
    /// free beside the activation peak.
    ///
    /// Fails when `utilization` is not in `(0, 1]`, when `free > total`, or
    /// when nothing is left for the cache; the message gives every figure.
    pub fn kv_budget(&self, utilization: f64) -> Result<usize> {
        if !(utilization > 0.0 && utilization <= 1.0) {
            bail!("{OP}: gpu memory utilization must be in (0, 1], got {utilization}");
        }
        let Self {
            total_bytes: total,
            free_bytes: free,
            activation_peak_bytes: peak,
        } = *self;
        let Some(used) = total.checked_sub(free) else {
            bail!("{OP}: the device reports {free} bytes free of {total} in all");
        };
        // f64 holds byte counts up to 2^53 exactly; the cast saturates.
        let allowed = (total as f64 * utilization).floor() as usize;
        let taken = used.saturating_add(peak);
        match allowed.checked_sub(taken) {
            Some(budget) if budget > 0 => Ok(budget.min(free.saturating_sub(peak))),
            _ => bail!(
                "{OP}: gpu memory utilization {utilization} allows {allowed} of the device's {total} bytes, but {used} are in use (weights and other allocations) and the profiled forward pass needs {peak} more: nothing is left for the KV cache"
            ),
        }
    }

    /// Measures `model`'s device before its KV cache is allocated: runs one
    /// forward pass of `max_batch_tokens` prompt tokens spread over
    /// `min(max_num_seqs, max_batch_tokens)` sequences (each asking for its
    /// logits) through a cache just large enough, then reads the device's
    /// free and total memory and the memory pool's high-water mark.
    ///
    /// Returns `None` on the CPU, where nothing is measured. On CUDA the
    /// activation peak is read from the stream-ordered memory pool candle
    /// allocates from; without pools (`cuMemAlloc`) it is 0.
    pub fn measure(
        model: &dyn PagedModel,
        max_batch_tokens: usize,
        max_num_seqs: usize,
    ) -> Result<Option<Self>> {
        let device = model.device();
        if device.is_cpu() {
            return Ok(None);
        }
        if max_batch_tokens == 0 || max_num_seqs == 0 {
            bail!("{OP}: profiling needs max_batch_tokens and max_num_seqs >= 1, got {max_batch_tokens} and {max_num_seqs}");
        }
        let layers = model.attention_layers();
        let Some(first) = layers.first() else {
            bail!("{OP}: a model needs at least one attention layer");
        };
        let bs = first.options().block_size;
        // Enough sequences that none is longer than the model's context.
        let seqs = max_num_seqs
            .min(max_batch_tokens)
            .max(max_batch_tokens.div_ceil(model.max_seq_len().max(1)));
        let lens: Vec<usize> = (0..seqs)
            .map(|i| max_batch_tokens / seqs + usize::from(i < max_batch_tokens % seqs))
            .collect();
        let blocks: usize = lens.iter().map(|l| l.div_ceil(bs)).sum();
        let cache = PagedKvCache::new(&layers, CacheConfig::new(blocks), model.dtype(), device)?;
        let mut manager = cache.block_manager()?;
        let mut work = Vec::with_capacity(seqs);
        for (i, &len) in lens.iter().enumerate() {
            manager.add_sequence(i as u64, &vec![0; len])?;
            work.push(Work::Prefill {
                seq_id: i as u64,
                num_tokens: len,
            });
        }
        let batch = manager.schedule(&work, device)?;
        let input = Tensor::new(batch.token_ids.as_slice(), device)?;
        device.synchronize()?;
        let before = pool::reset_peak(device)?;
        let logits = model.forward(&input, &batch.metadata, &cache, &batch.last_rows)?;
        drop(logits);
        device.synchronize()?;
        let activation_peak_bytes = pool::peak_since(device, before)?;
        drop((batch, input, manager, cache));
        device.synchronize()?;
        let (free_bytes, total_bytes) = pool::mem_info(device)?;
        Ok(Some(Self {
            total_bytes,
            free_bytes,
            activation_peak_bytes,
        }))
    }
}

/// How to size a model's KV cache (see [`CacheSizing::plan`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CacheSizing {
    /// This many blocks per full-attention layer.
    Blocks(usize),
    /// As many blocks as fit in this many bytes over all layers.
    Bytes(usize),
    /// On CUDA, the KV cache takes what `utilization` of the device memory
    /// leaves after the weights and a profiled forward pass of the engine's
    /// largest step ([`MemoryProfile`]); on the CPU,
    /// [`DEFAULT_CPU_KV_BYTES`].
    Device {
        /// Fraction of the device memory the process may use, in `(0, 1]`.
        utilization: f64,
        /// Tokens of the largest step (the engine's `max_batch_tokens`).
        max_batch_tokens: usize,
        /// Sequences of the largest step (the engine's `max_num_seqs`).
        max_num_seqs: usize,
    },
}

/// The block count [`CacheSizing::plan`] chose, and what it was chosen from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CachePlan {
    /// Blocks per full-attention layer (the [`CacheConfig::num_blocks`]).
    pub num_blocks: usize,
    /// Bytes the caches will take.
    pub bytes: usize,
    /// Bytes the cache was allowed (`None` for [`CacheSizing::Blocks`]).
    pub budget_bytes: Option<usize>,
    /// The device measurement, for [`CacheSizing::Device`] on CUDA.
    pub profile: Option<MemoryProfile>,
}

impl CacheSizing {
    /// Chooses the block count of `model`'s caches, before they are
    /// allocated (`window_blocks` as in [`CacheConfig`]). For
    /// [`CacheSizing::Device`] on CUDA this runs the profiling forward pass
    /// of [`MemoryProfile::measure`].
    ///
    /// Fails when no block fits the budget, when the caches' bytes overflow
    /// `usize`, or when the device leaves nothing for the cache; the
    /// messages give the figures.
    pub fn plan(&self, model: &dyn PagedModel, window_blocks: Option<usize>) -> Result<CachePlan> {
        let footprint =
            CacheFootprint::new(&model.attention_layers(), model.dtype(), window_blocks)?;
        let (num_blocks, budget_bytes, profile) = match *self {
            CacheSizing::Blocks(n) => (n, None, None),
            CacheSizing::Bytes(b) => (footprint.blocks_for_bytes(b)?, Some(b), None),
            CacheSizing::Device {
                utilization,
                max_batch_tokens,
                max_num_seqs,
            } => match MemoryProfile::measure(model, max_batch_tokens, max_num_seqs)? {
                Some(p) => {
                    let budget = p.kv_budget(utilization)?;
                    (footprint.blocks_for_bytes(budget)?, Some(budget), Some(p))
                }
                None => (
                    footprint.blocks_for_bytes(DEFAULT_CPU_KV_BYTES)?,
                    Some(DEFAULT_CPU_KV_BYTES),
                    None,
                ),
            },
        };
        if num_blocks == 0 {
            bail!("{OP}: a cache needs at least one block, got 0");
        }
        let Some(bytes) = footprint.total_bytes(num_blocks) else {
            bail!(
                "{OP}: {num_blocks} blocks of {} bytes (and {} bytes of window caches) overflow usize",
                footprint.block_bytes(),
                footprint.fixed_bytes()
            );
        };
        Ok(CachePlan {
            num_blocks,
            bytes,
            budget_bytes,
            profile,
        })
    }
}

/// The device queries of [`MemoryProfile::measure`].
#[cfg(feature = "cuda")]
mod pool {
    use candle_core::cuda_backend::cudarc::driver::{result, sys};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{Device, Result};

    /// The memory pool candle's stream allocates from (`cuMemAllocAsync`
    /// takes the device's current pool), or `None` without pools.
    fn current_pool(device: &Device) -> Result<Option<sys::CUmemoryPool>> {
        let stream = device.as_cuda_device()?.cuda_stream();
        let ctx = stream.context();
        if !ctx.has_async_alloc() {
            return Ok(None);
        }
        ctx.bind_to_thread().w()?;
        // SAFETY: `cu_device` is the device of a live context.
        let pool = unsafe { result::device::get_mem_pool(ctx.cu_device()) }.w()?;
        Ok(Some(pool))
    }

    /// Reads a `cuuint64_t` attribute of `pool`.
    fn attribute(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: the used-memory attributes are `cuuint64_t`, which `value`
        // is; `pool` is the device's live current pool.
        unsafe { result::mem_pool::get_attribute(pool, attr, (&mut value as *mut u64).cast()) }
            .w()?;
        Ok(value)
    }

    /// Resets the pool's high-water mark of used memory; returns the memory
    /// in use now.
    pub(super) fn reset_peak(device: &Device) -> Result<u64> {
        let Some(pool) = current_pool(device)? else {
            return Ok(0);
        };
        let mut zero: u64 = 0;
        // SAFETY: the high-water mark is a `cuuint64_t` that may only be
        // set to zero (a reset); `pool` is the device's live current pool.
        unsafe {
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        }
        .w()?;
        attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        )
    }

    /// The pool's high-water mark of used memory beyond `before` bytes.
    pub(super) fn peak_since(device: &Device, before: u64) -> Result<usize> {
        let Some(pool) = current_pool(device)? else {
            return Ok(0);
        };
        let high = attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        )?;
        Ok(usize::try_from(high.saturating_sub(before)).unwrap_or(usize::MAX))
    }

    /// Free and total device memory, in bytes.
    pub(super) fn mem_info(device: &Device) -> Result<(usize, usize)> {
        device
            .as_cuda_device()?
            .cuda_stream()
            .context()
            .mem_get_info()
            .w()
    }
}

/// Without CUDA only the CPU runs models, and `measure` returns before
/// these are called.
#[cfg(not(feature = "cuda"))]
mod pool {
    use candle_core::{bail, Device, Result};

    pub(super) fn reset_peak(device: &Device) -> Result<u64> {
        bail!("paged-kv-cache: no memory profile for {device:?} without the cuda feature")
    }

    pub(super) fn peak_since(device: &Device, _before: u64) -> Result<usize> {
        bail!("paged-kv-cache: no memory profile for {device:?} without the cuda feature")
    }

    pub(super) fn mem_info(device: &Device) -> Result<(usize, usize)> {
        bail!("paged-kv-cache: no memory profile for {device:?} without the cuda feature")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::AttentionOptions;
    use crate::KvScales;

    /// An error's message without the backtrace candle appends when
    /// `RUST_BACKTRACE` is set.
    fn msg(e: candle_core::Error) -> String {
        e.to_string().lines().next().unwrap_or_default().to_string()
    }

    fn layer(kv_heads: usize, window: Option<usize>, fp8: bool) -> Attention {
        let options = AttentionOptions {
            block_size: 16,
            sliding_window: window,
            kv_cache_dtype: if fp8 {
                KvCacheDtype::Fp8E4M3(KvScales::new(1.0, 1.0))
            } else {
                KvCacheDtype::Auto
            },
            ..Default::default()
        };
        Attention::new(4, kv_heads, 64, 0.125, options).expect("layer")
    }

    #[test]
    fn footprint_counts_full_window_and_fp8_layers() -> Result<()> {
        let (full, window, fp8) = (
            layer(2, None, false),
            layer(2, Some(32), false),
            layer(1, None, true),
        );
        let layers = [&full, &window, &fp8];
        // bf16: 2 (k, v) x 16 tokens x 2 heads x 64 x 2 bytes = 8192 per
        // layer and block; fp8 with one head: 2048.
        let shared = CacheFootprint::new(&layers, DType::BF16, None)?;
        assert_eq!(
            (shared.block_bytes(), shared.fixed_bytes()),
            (8192 * 2 + 2048, 0)
        );
        let grouped = CacheFootprint::new(&layers, DType::BF16, Some(10))?;
        assert_eq!(
            (grouped.block_bytes(), grouped.fixed_bytes()),
            (8192 + 2048, 81920)
        );
        assert_eq!(grouped.total_bytes(3), Some(3 * 10240 + 81920));
        assert_eq!(grouped.total_bytes(usize::MAX), None);
        assert_eq!(grouped.blocks_for_bytes(81920 + 10240 * 7 + 10239)?, 7);
        let err = grouped
            .blocks_for_bytes(81920 + 10239)
            .map_err(msg)
            .unwrap_err();
        assert_eq!(
            err,
            "paged-kv-cache: 92159 bytes hold no cache block (3 layers, 10240 bytes per block of 16 tokens over the full-attention layers, 81920 bytes of window caches)"
        );
        let only_window = CacheFootprint::new(&[&window], DType::F32, Some(4))?;
        assert!(only_window
            .blocks_for_bytes(1 << 30)
            .map_err(msg)
            .unwrap_err()
            .contains("every layer has a window cache"));
        // The layers' own cache sizes agree.
        let cache = PagedKvCache::new(
            &layers,
            CacheConfig {
                num_blocks: 3,
                window_blocks: Some(10),
                prefix_caching: false,
            },
            DType::BF16,
            &Device::Cpu,
        )?;
        assert_eq!(Some(cache.memory_bytes()), grouped.total_bytes(3));
        assert!(CacheFootprint::new(&[], DType::F32, None).is_err());
        Ok(())
    }

    #[test]
    fn a_layer_index_out_of_range_is_an_error() -> Result<()> {
        let (full, window) = (layer(2, None, false), layer(2, Some(32), false));
        let cache = PagedKvCache::new(
            &[&full, &window],
            CacheConfig::new(2),
            DType::F32,
            &Device::Cpu,
        )?;
        assert_eq!(cache.layer(1)?.num_blocks(), 2);
        assert!(cache.get_layer(2).is_none());
        for i in [2, usize::MAX] {
            let err = cache.layer(i).map(|_| ()).map_err(msg).unwrap_err();
            assert_eq!(
                err,
                format!("paged-kv-cache: layer {i} does not exist; the cache has 2 layers")
            );
        }
        Ok(())
    }

    #[test]
    fn kv_budget_takes_the_fraction_left_after_weights_and_activations() -> Result<()> {
        let gib = 1usize << 30;
        // An H200-sized device: 140 GiB, 1 GiB in use, 2 GiB of activations.
        let p = MemoryProfile {
            total_bytes: 140 * gib,
            free_bytes: 139 * gib,
            activation_peak_bytes: 2 * gib,
        };
        assert_eq!(p.kv_budget(0.9)?, 126 * gib - 3 * gib);
        // Never more than what is free beside the activations.
        assert_eq!(p.kv_budget(1.0)?, 137 * gib);
        let too_low = p.kv_budget(0.02).map_err(msg).unwrap_err();
        assert_eq!(
            too_low,
            format!(
                "paged-kv-cache: gpu memory utilization 0.02 allows {} of the device's {} bytes, but {gib} are in use (weights and other allocations) and the profiled forward pass needs {} more: nothing is left for the KV cache",
                (140.0 * gib as f64 * 0.02).floor() as usize,
                140 * gib,
                2 * gib
            )
        );
        for bad in [0.0, -0.5, 1.01, f64::NAN] {
            let e = p.kv_budget(bad).map_err(msg).unwrap_err();
            assert!(
                e.contains("gpu memory utilization must be in (0, 1]"),
                "{e}"
            );
        }
        let odd = MemoryProfile {
            total_bytes: 10,
            free_bytes: 11,
            activation_peak_bytes: 0,
        };
        assert_eq!(
            odd.kv_budget(0.9).map_err(msg).unwrap_err(),
            "paged-kv-cache: the device reports 11 bytes free of 10 in all"
        );
        // Near usize::MAX the arithmetic saturates instead of wrapping.
        let huge = MemoryProfile {
            total_bytes: usize::MAX,
            free_bytes: usize::MAX - 1,
            activation_peak_bytes: usize::MAX,
        };
        assert!(huge.kv_budget(0.9).is_err());
        Ok(())
    }
}

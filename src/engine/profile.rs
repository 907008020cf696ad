//! The KV cache's sizing from the device: [`MemoryProfile`] (what the
//! device leaves for the cache after the weights and a profiled forward
//! pass, vLLM's `gpu_memory_utilization`) and [`CacheSizing`] (a block
//! count from a count, a byte budget or the device), planned before the
//! caches are allocated.

use candle_core::{bail, Result, Tensor};

use crate::cache::Work;
use crate::models::{CacheConfig, CacheFootprint, PagedKvCache, PagedModel};

const OP: &str = "paged-kv-cache";

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

    /// An error's message without the backtrace candle appends when
    /// `RUST_BACKTRACE` is set.
    fn msg(e: candle_core::Error) -> String {
        e.to_string().lines().next().unwrap_or_default().to_string()
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

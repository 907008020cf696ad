//! The KV caches of all layers of a model, the block manager that fits
//! them, and their footprint: [`CacheFootprint`] (bytes per block). Sizing
//! them from the device (a profiled forward pass) is the engine's
//! `MemoryProfile`.

use candle_core::{bail, DType, Device, Result};

use crate::attention::{Attention, KvCacheDtype};
use crate::cache::{BlockManager, BlockManagerConfig, LayerKvCache};

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

    /// Every layer's cache, in order.
    #[cfg(feature = "models")]
    pub(crate) fn layers(&self) -> &[LayerKvCache] {
        &self.layers
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

/// The memory available to this process in bytes (`MemAvailable` of
/// `/proc/meminfo`, Linux), `None` where unknown.
pub fn host_memory_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
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
}

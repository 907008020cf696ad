//! The KV caches of all layers of a model and the block manager that fits them.

use candle_core::{bail, DType, Device, Result};

use crate::attention::Attention;
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

    /// The cache of layer `i`.
    ///
    /// # Panics
    /// When `i >= num_layers()`, as slice indexing does; see
    /// [`get_layer`](Self::get_layer).
    pub fn layer(&self, i: usize) -> &LayerKvCache {
        &self.layers[i]
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

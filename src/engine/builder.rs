//! [`EngineBuilder`]: a loaded model to a running [`Engine`] in one place:
//! the KV cache sized ([`CacheSizing`]), checked against the host's memory
//! on the CPU, allocated, and the engine made with its scheduler limits and
//! CUDA-graph switch. The runners (and the server, through
//! [`KvCacheSpec`]) take their cache and engine from here, so that a flag
//! means the same in each of them.

use candle_core::{bail, Result};

use super::{CachePlan, CacheSizing, DevicePicking, Engine, SchedulerConfig};
use crate::models::{host_memory_available, CacheConfig, PagedKvCache, PagedModel};

const OP: &str = "EngineBuilder";

/// What a model's KV cache is made of: its sizing, the sliding-window
/// layers' own caches (`window_blocks`, as in [`CacheConfig`]) and prefix
/// caching.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvCacheSpec {
    /// How many blocks of each full-attention layer's
    /// `(num_blocks, block_size, num_kv_heads, head_size)` cache.
    pub sizing: CacheSizing,
    /// Blocks of each sliding-window layer's cache, when windows get their
    /// own groups.
    pub window_blocks: Option<usize>,
    /// Share full prompt blocks between sequences with the same prefix.
    pub prefix_caching: bool,
}

impl KvCacheSpec {
    /// A cache sized by `sizing`, without window groups or prefix caching.
    pub fn new(sizing: CacheSizing) -> Self {
        Self {
            sizing,
            window_blocks: None,
            prefix_caching: false,
        }
    }

    /// Plans the cache of `model` (see [`CacheSizing::plan`]; on CUDA,
    /// [`CacheSizing::Device`] runs a profiled forward pass) and allocates
    /// it on the model's device, one cache per attention layer.
    ///
    /// Fails, with the figures, where [`CacheSizing::plan`] does, and, on
    /// the CPU, when the cache's bytes exceed the memory available to the
    /// process (before anything is allocated).
    pub fn build(&self, model: &dyn PagedModel) -> Result<(PagedKvCache, CachePlan)> {
        if self.window_blocks == Some(0) {
            bail!("{OP}: window_blocks must be at least 1, got 0");
        }
        if self.window_blocks.is_some() && self.prefix_caching {
            bail!("{OP}: prefix caching cannot be combined with window_blocks (window groups)");
        }
        let layers = model.attention_layers();
        let plan = self.sizing.plan(model, self.window_blocks)?;
        if model.device().is_cpu() {
            if let Some(avail) = host_memory_available() {
                if plan.bytes > avail {
                    bail!(
                        "{OP}: the KV cache would take {} bytes ({} blocks per layer, {} layers), more than the {avail} bytes of memory available",
                        plan.bytes,
                        plan.num_blocks,
                        layers.len()
                    );
                }
            }
        }
        let config = CacheConfig {
            num_blocks: plan.num_blocks,
            window_blocks: self.window_blocks,
            prefix_caching: self.prefix_caching,
        };
        let cache = PagedKvCache::new(&layers, config, model.dtype(), model.device())?;
        Ok((cache, plan))
    }
}

/// Builds an [`Engine`] over a model: its KV cache ([`KvCacheSpec`]), its
/// scheduler limits and whether decode steps replay CUDA graphs (and which
/// are captured before the first request). A concrete model coerces to the
/// `&dyn PagedModel` it takes.
///
/// ```no_run
/// # use candle_paged_attention::engine::{CacheSizing, EngineBuilder, SchedulerConfig};
/// # fn f(model: &dyn candle_paged_attention::models::PagedModel) -> candle_core::Result<()> {
/// let (mut engine, plan) = EngineBuilder::new(model)
///     .sizing(CacheSizing::Blocks(1024))
///     .scheduler(SchedulerConfig { max_batch_tokens: 256, max_num_seqs: 64 })
///     .build()?;
/// # Ok(()) }
/// ```
pub struct EngineBuilder<'m> {
    model: &'m dyn PagedModel,
    cache: KvCacheSpec,
    scheduler: SchedulerConfig,
    cuda_graphs: bool,
    capture_up_to: Option<usize>,
    picking: Option<DevicePicking>,
}

impl<'m> EngineBuilder<'m> {
    /// A builder over `model` with the default scheduler limits, the cache
    /// sized as [`CacheSizing::Device`] at the default utilization for
    /// them (on the CPU, [`DEFAULT_CPU_KV_BYTES`](super::DEFAULT_CPU_KV_BYTES)),
    /// and CUDA graphs on, captured on first use.
    pub fn new(model: &'m dyn PagedModel) -> Self {
        let scheduler = SchedulerConfig::default();
        Self {
            model,
            cache: KvCacheSpec::new(CacheSizing::Device {
                utilization: super::DEFAULT_GPU_MEMORY_UTILIZATION,
                max_batch_tokens: scheduler.max_batch_tokens,
                max_num_seqs: scheduler.max_num_seqs,
            }),
            scheduler,
            cuda_graphs: true,
            capture_up_to: None,
            picking: None,
        }
    }

    /// How the cache is sized. A [`CacheSizing::Device`] profiles the step
    /// it names: give it the scheduler's limits.
    pub fn sizing(mut self, sizing: CacheSizing) -> Self {
        self.cache.sizing = sizing;
        self
    }

    /// The whole cache specification.
    pub fn cache(mut self, spec: KvCacheSpec) -> Self {
        self.cache = spec;
        self
    }

    /// Sliding-window layers get their own caches of `blocks` blocks each.
    pub fn window_blocks(mut self, blocks: Option<usize>) -> Self {
        self.cache.window_blocks = blocks;
        self
    }

    /// Prefix caching on or off.
    pub fn prefix_caching(mut self, on: bool) -> Self {
        self.cache.prefix_caching = on;
        self
    }

    /// The scheduler's step budget and running-sequence limit (the sizing
    /// is not changed: a [`CacheSizing::Device`] keeps the limits it names).
    pub fn scheduler(mut self, config: SchedulerConfig) -> Self {
        self.scheduler = config;
        self
    }

    /// Whether decode steps replay CUDA graphs
    /// ([`Engine::with_cuda_graphs`]).
    pub fn cuda_graphs(mut self, on: bool) -> Self {
        self.cuda_graphs = on;
        self
    }

    /// Which rows of a step's CUDA logits the crate's picking kernels take
    /// ([`Engine::with_device_picking`]; unset, the engine's default).
    pub fn device_picking(mut self, picking: DevicePicking) -> Self {
        self.picking = Some(picking);
        self
    }

    /// Captures the step graphs (decode steps and steps with prefills) for
    /// sequences of up to `max_context` tokens before the engine is returned
    /// ([`Engine::capture_cuda_graphs`]); `None` (the default) captures
    /// each on first use.
    pub fn capture_graphs_up_to(mut self, max_context: Option<usize>) -> Self {
        self.capture_up_to = max_context;
        self
    }

    /// Sizes and allocates the cache, makes the engine and captures its
    /// graphs as asked. Returns the engine and the cache's plan (blocks,
    /// bytes, the device profile). Fails where [`KvCacheSpec::build`] or
    /// [`Engine::new`] does, or when a capture fails.
    pub fn build(self) -> Result<(Engine<'m, dyn PagedModel + 'm>, CachePlan)> {
        let (cache, plan) = self.cache.build(self.model)?;
        let mut engine =
            Engine::new(self.model, cache, self.scheduler)?.with_cuda_graphs(self.cuda_graphs);
        if let Some(picking) = self.picking {
            engine = engine.with_device_picking(picking);
        }
        if let Some(context) = self.capture_up_to {
            engine.capture_cuda_graphs(context)?;
        }
        Ok((engine, plan))
    }
}

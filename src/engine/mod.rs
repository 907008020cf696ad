//! The continuous-batching engine over a paged model (feature `engine`):
//! sequences join and leave the running batch between steps; prompts are
//! prefilled in chunks that fit a per-step token budget, mixed with the
//! decodes of the other sequences.
//!
//! # Example
//! A tiny Llama with random weights (feature `models`; any
//! [`PagedModel`](crate::models::PagedModel) works) completes three greedy
//! requests in one continuous batch: the two with the same prompt get the
//! same tokens, the same as that prompt alone in another engine, and every
//! cache block is free at the end.
//! ```
//! # #[cfg(feature = "models")]
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_paged_attention::engine::{
//!     Engine, FinishReason, Request, SamplingParams, SchedulerConfig,
//! };
//! use candle_paged_attention::models::{llama, CacheConfig, PagedKvCache, PagedModel, PagedOptions};
//!
//! let dev = Device::Cpu;
//! let cfg: llama::LlamaConfig = serde_json::from_str(
//!     r#"{"hidden_size": 32, "intermediate_size": 48, "vocab_size": 64,
//!         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
//!         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128}"#,
//! ).map_err(candle_core::Error::wrap)?;
//! let varmap = VarMap::new(); // random weights
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let model = llama::Llama::load(vb, &cfg.into_config(false), PagedOptions::default())?;
//! let engine = || {
//!     let cache =
//!         PagedKvCache::new(&model.attention_layers(), CacheConfig::new(16), DType::F32, &dev)?;
//!     Engine::new(&model, cache, SchedulerConfig::default())
//! };
//! let request = |id, prompt: &[u32]| Request {
//!     id,
//!     prompt: prompt.to_vec(),
//!     params: SamplingParams::greedy(6), // 6 new tokens, no stop token
//! };
//!
//! let mut batch = engine()?;
//! batch.add_request(request(0, &[1, 2, 3, 4, 5]))?;
//! batch.add_request(request(1, &[9, 8, 7]))?;
//! batch.add_request(request(2, &[1, 2, 3, 4, 5]))?;
//! let mut done = batch.run(|_token| {})?; // or `step()` until `!has_work()`
//! done.sort_by_key(|c| c.id);
//! assert_eq!(done.len(), 3);
//! assert!(done.iter().all(|c| c.tokens.len() == 6 && c.finish == FinishReason::Length));
//! assert_eq!(done[0].tokens, done[2].tokens);
//! assert_eq!(batch.block_manager().num_used_blocks(), 0);
//!
//! let mut alone = engine()?;
//! alone.add_request(request(7, &[1, 2, 3, 4, 5]))?;
//! while alone.has_work() {
//!     alone.step()?;
//! }
//! assert_eq!(alone.take_completions()[0].tokens, done[0].tokens);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "models"))]
//! # fn main() {}
//! ```

mod buckets;
#[cfg(feature = "cuda")]
mod graphs;
mod profile;
mod sampling;
mod scheduler;

pub use buckets::{decode_bucket, decode_split_plan_keys, BATCH_BUCKETS, MIN_TABLE_WIDTH};
#[cfg(feature = "cuda")]
pub use graphs::{DecodeGraphs, GraphStats};
pub use profile::{
    CachePlan, CacheSizing, MemoryProfile, DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION,
};
pub use sampling::{Sampler, SamplingParams};
pub use scheduler::{
    Completion, Engine, EngineStats, FinishReason, Request, SchedulerConfig, TokenEvent,
};

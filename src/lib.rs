#![warn(missing_docs)]
//! Paged attention for [candle](https://github.com/huggingface/candle).
//!
//! One [`paged_attention`] call serves a mixed batch of prefills, chunked
//! prefills (cached context plus new tokens) and decodes over a paged KV cache
//! `(num_blocks, block_size, num_kv_heads, head_size)`, with causal masking,
//! GQA/MQA, sliding windows, softcapping, ALiBi, attention sinks, a
//! query-query bias, bidirectional prefix ranges and fp8 (`F8E4M3`) caches.
//! [`reshape_and_cache`] writes new keys and values into their slots.
//!
//! The CPU path is a fast, parallel CPU kernel with every feature; the `cuda`
//! feature adds compiled CUDA kernels for the same ops. [`reference`](mod@reference) holds a
//! naive f64 implementation that both are tested against.
//!
//! # Features
//! * none: the ops, the [`Attention`] layer, the block manager and the
//!   reference implementation.
//! * `engine`: [`models::PagedModel`] (the interface of a paged model),
//!   [`models::PagedKvCache`], rotary embeddings and the continuous-batching
//!   [`engine::Engine`], for models of your own.
//! * `models`: `engine` plus paged Llama / Gemma 2 / Gemma 3 (safetensors
//!   and GGUF), tokenizers from the checkpoint and chat templates
//!   ([`text`]).
//! * `hub`: `models` plus downloads from the Hugging Face hub.
//! * `cuda`: the CUDA kernels (needs the CUDA toolkit to build).
//!
//! # Example
//! Two sequences: a prefill of 3 tokens and a decode of 1 token after 4 cached
//! ones, with 2 query heads sharing 1 KV head of size 8 and blocks of 4 tokens.
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_paged_attention::{
//!     paged_attention, reshape_and_cache, KvScales, PagedAttentionParams, PagedBatch, SlotMapping,
//! };
//!
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let (num_blocks, block_size, kv_heads, heads, head_size) = (8, 4, 1, 2, 8);
//! let key_cache = Tensor::zeros((num_blocks, block_size, kv_heads, head_size), DType::F32, &dev)?;
//! let value_cache = key_cache.zeros_like()?;
//!
//! // Sequence 0 owns block 3; sequence 1 owns blocks 5 and 1 (5 tokens).
//! // Store sequence 1's 4 cached tokens, then the batch's 4 new tokens.
//! let cached = SlotMapping::new(&[20, 21, 22, 23], &dev)?;
//! let k_old = Tensor::randn(0f32, 1., (4, kv_heads, head_size), &dev)?;
//! reshape_and_cache(&k_old, &k_old, &key_cache, &value_cache, &cached, KvScales::default())?;
//!
//! let slots = SlotMapping::new(&[12, 13, 14, 4], &dev)?;
//! let k_new = Tensor::randn(0f32, 1., (4, kv_heads, head_size), &dev)?;
//! let v_new = Tensor::randn(0f32, 1., (4, kv_heads, head_size), &dev)?;
//! reshape_and_cache(&k_new, &v_new, &key_cache, &value_cache, &slots, KvScales::default())?;
//!
//! // cu_seqlens_q: rows 0..3 are sequence 0, row 3 is sequence 1.
//! let batch = PagedBatch::from_rows(&[0, 3, 4], &[3, 5], &[vec![3], vec![5, 1]], block_size, &dev)?;
//! let q = Tensor::randn(0f32, 1., (4, heads, head_size), &dev)?;
//! let params = PagedAttentionParams::new(&key_cache, &value_cache, &batch, 1.0 / (head_size as f32).sqrt());
//! let out = paged_attention(&q, &params)?;
//! assert_eq!(out.dims(), &[4, heads, head_size]);
//! # Ok(())
//! # }
//! ```

mod attention;
mod batch;
mod cache;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "engine")]
pub mod engine;
mod metadata;
#[cfg(feature = "engine")]
pub mod models;
mod ops;
#[cfg(feature = "models")]
pub mod parallel;
mod params;
pub mod reference;
pub mod remap;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "models")]
pub mod text;

// One public path per item: the modules above are private and their items
// are re-exported here; `engine`, `models`, `reference`, `remap` and `text`
// are public namespaces of many items and are not re-exported.
pub use attention::{Attention, AttentionOptions, KvCacheDtype};
pub use batch::{BatchHost, PagedBatch, PrefixRanges, SlotMapping};
pub use cache::{
    num_blocks_for_budget, BlockManager, BlockManagerConfig, LayerKvCache, ScheduledBatch,
    WindowGroupConfig, Work,
};
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use cuda::describe::{kernel_instance_reports, KernelInstanceReport, LaunchResidency};
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use cuda::plan::launch_plans_made;
pub use metadata::{AttentionMetadata, GraphMode, LayerBatch, WindowGroup};
pub use ops::greedy::{greedy_tokens, GreedyTokens};
pub use ops::layer_ops::{add_rms_norm, gated_activation, rms_norm};
pub use ops::linear::{
    gated_linear, linear, skinny_gated_matmul, skinny_matmul, SkinnyGated, SkinnyMatmul,
    SKINNY_GATED_ENV, SKINNY_LINEAR_ROWS, SKINNY_MATMUL_ENV, SKINNY_MAX_ROWS,
};
#[cfg(feature = "cuda")]
pub use ops::paged_attention::cuda_launch_plan;
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use ops::paged_attention::cuda_launch_residency;
pub use ops::paged_attention::{paged_attention, PagedAttention};
pub use ops::reshape_and_cache::{reshape_and_cache, ReshapeAndCache};
pub use ops::rotary_cache::{rotary_reshape_and_cache, RotaryRows};
pub use ops::sample::{
    philox4x32_10, sample_row, sample_rows, uniform, RowSampling, SampleRows, SAMPLE_PARAM_WORDS,
};
pub use params::{
    AttentionDims, GatedActivation, KvScales, KvSplit, PagedAttentionParams, MAX_HEAD_SIZE,
};

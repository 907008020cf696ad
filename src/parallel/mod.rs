//! Tensor parallelism for the decoder stack (feature `models`):
//! Megatron-style sharding over the ranks of a group, the collectives it
//! needs, and a model that drives the ranks in lockstep.
//!
//! * [`ShardPlan`] - what each rank owns: query heads, KV heads
//!   (replicated when there are fewer than ranks), intermediate columns,
//!   vocabulary rows; a pure function of the shape, the world size and the
//!   rank.
//! * [`Communicator`] - all-reduce (sum) and all-gather, with abort and
//!   timeouts so that a failed rank fails the step for every rank instead
//!   of hanging it; [`LocalGroup`] is the in-process reference over
//!   threads (an NCCL implementation can slot in behind the same trait).
//! * [`DecoderStack::load_shard`](crate::models::decoder::DecoderStack::load_shard):
//!   one rank's shard of a decoder: column-parallel q/k/v and gate/up,
//!   row-parallel o and down (one all-reduce after each), a
//!   vocabulary-parallel embedding (one all-reduce) and LM head (logits
//!   gathered).
//! * [`TensorParallel`] - every rank of a group as one
//!   [`PagedModel`](crate::models::PagedModel), each forward pass run on
//!   one thread per rank; the [`Engine`](crate::engine::Engine) drives it
//!   like any model.
//!
//! # Example
//! A tiny Llama with random weights on two ranks gives the logits of the
//! whole model.
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_paged_attention::models::{llama, CacheConfig, PagedKvCache, PagedModel, PagedOptions};
//! use candle_paged_attention::parallel::TensorParallel;
//! use candle_paged_attention::{AttentionMetadata, PagedBatch, SlotMapping};
//!
//! let dev = Device::Cpu;
//! let cfg: llama::LlamaConfig = serde_json::from_str(
//!     r#"{"hidden_size": 32, "intermediate_size": 48, "vocab_size": 64,
//!         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
//!         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128}"#,
//! ).map_err(candle_core::Error::wrap)?;
//! let cfg = cfg.into_config(false);
//! let varmap = VarMap::new(); // random weights
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let whole = llama::Llama::load(vb.clone(), &cfg, PagedOptions::default())?;
//! let sharded = TensorParallel::local(vb, &llama::spec(&cfg)?, PagedOptions::default(), 2)?;
//! let logits = |model: &dyn PagedModel| {
//!     // One block of 16 tokens holds the 5-token prompt.
//!     let cache = PagedKvCache::new(&model.attention_layers(), CacheConfig::new(1), DType::F32, &dev)?;
//!     let batch = PagedBatch::from_rows(&[0, 5], &[5], &[vec![0]], 16, &dev)?;
//!     let meta = AttentionMetadata::new(batch, SlotMapping::new(&[0, 1, 2, 3, 4], &dev)?)?;
//!     model.forward(&Tensor::new(&[1u32, 7, 3, 9, 4], &dev)?, &meta, &cache, &[4])
//! };
//! let diff = (logits(&whole)? - logits(&sharded)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
//! assert!(diff < 1e-4, "{diff}");
//! # Ok(())
//! # }
//! ```

pub mod comm;
pub(crate) mod layers;
mod model;
pub mod shard;

pub use comm::{Communicator, LocalGroup};
pub use model::TensorParallel;
pub use shard::{ShardConfig, ShardPlan};

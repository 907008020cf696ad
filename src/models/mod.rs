//! Paged Llama, Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2 and Gemma 3
//! models (feature `models`).
//!
//! The decoder stacks of candle-transformers 0.11.1, adapted to the paged
//! cache: every forward pass takes the flat tokens of a whole mixed batch
//! (prefills, prefill chunks and decodes of many sequences, `(num_tokens,)`
//! u32), the batch's [`AttentionMetadata`] (block tables, slots and each
//! token's position) and the [`PagedKvCache`] of all layers, and returns the
//! logits of the rows asked for (usually the last row of each sequence).
//! There are no mask tensors and no concatenated KV caches: rotary
//! embeddings gather their cos/sin rows at each token's position, and each
//! layer's [`Attention`] stores its keys and values in its cache and attends.
//!
//! * [`decoder::DecoderStack`] - one pre-norm decoder stack for the
//!   Llama-like families, built from a [`decoder::DecoderSpec`].
//! * [`llama::Llama`] - Llama 2/3 (SmolLM2, TinyLlama, ...) from safetensors.
//! * [`mistral`], [`qwen2`], [`qwen3`], [`phi3`] - Mistral (sliding
//!   window), Qwen2/2.5 (q/k/v biases), Qwen3 (q/k norms) and Phi-3 (joined
//!   projections, partial and long rope) from safetensors, on the stack.
//! * [`quantized_llama::QuantizedLlama`] - Llama, Qwen2, Qwen3 and Phi-3
//!   from a GGUF file (`QMatMul`).
//! * [`quantized_gemma3::QuantizedGemma3`] - Gemma 3 from a GGUF file
//!   (`QMatMul`), with Hugging Face's sliding window and activation.
//! * [`gemma2::Gemma2`], [`gemma3::Gemma3`] - softcapping, alternating
//!   sliding-window and global layers, Gemma 3's q/k norms and rope bases.
//! * [`registry`] - one table from a checkpoint's architecture to its
//!   loaders, and [`load`]: a GGUF file or a safetensors folder into a
//!   model, its tokenizer and its chat template.
//! * [`limits`] - limits on what a checkpoint controls, checked before
//!   loading: GGUF headers and tensors ([`limits::read_gguf`]), decoder
//!   hyper-parameters.
//!
//! Feature `engine` holds [`PagedModel`], [`PagedKvCache`] and the rotary
//! embeddings, for models of your own (the continuous-batching engine that
//! runs them is [`crate::engine`]); feature `models` adds the models and
//! their loaders. Tokenizers, chat templates and checkpoint files are
//! [`crate::text`].

// Feature `engine`: the model interface, the paged cache and rotary
// embeddings. Feature `models` adds the models and their loaders.
#[cfg(feature = "models")]
pub mod decoder;
#[cfg(feature = "models")]
pub mod gemma2;
#[cfg(feature = "models")]
pub mod gemma3;
#[cfg(feature = "models")]
mod gguf;
mod kv_cache;
#[cfg(feature = "models")]
mod layers;
#[cfg(feature = "models")]
pub mod limits;
#[cfg(feature = "models")]
pub mod llama;
#[cfg(feature = "models")]
pub mod mistral;
#[cfg(feature = "models")]
pub mod phi3;
#[cfg(feature = "models")]
pub mod quantized_gemma3;
#[cfg(feature = "models")]
pub mod quantized_llama;
#[cfg(feature = "models")]
pub mod qwen2;
#[cfg(feature = "models")]
pub mod qwen3;
#[cfg(feature = "models")]
pub mod registry;
mod rotary;

use candle_core::{DType, Device, Result, Tensor};

use crate::attention::{Attention, KvCacheDtype};
use crate::metadata::AttentionMetadata;

pub use kv_cache::{host_memory_available, CacheConfig, CacheFootprint, PagedKvCache};
#[cfg(feature = "models")]
pub use registry::{load, Dequantize, LoadOptions, Loaded};
pub use rotary::{Rotary, RotaryEmbedding};

/// Paging options shared by every attention layer of a model.
///
/// * `block_size` - tokens per cache block (the caches' dimension 1).
/// * `kv_cache_dtype` - the caches' element type (the model's by default).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PagedOptions {
    /// Tokens per cache block.
    pub block_size: usize,
    /// Cache element type (and fp8 scales).
    pub kv_cache_dtype: KvCacheDtype,
}

impl Default for PagedOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_dtype: KvCacheDtype::Auto,
        }
    }
}

/// A decoder-only language model running over a paged KV cache.
///
/// # Example
/// A tiny Llama with random weights (feature `models`) runs a prompt of 5
/// tokens whole, and again as two chunks (3 tokens, then 2 over the 3
/// cached): the last token's logits agree.
/// ```
/// # #[cfg(feature = "models")]
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_paged_attention::models::{llama, CacheConfig, PagedKvCache, PagedModel, PagedOptions};
/// use candle_paged_attention::{AttentionMetadata, PagedBatch, SlotMapping};
///
/// let dev = Device::Cpu;
/// let cfg: llama::LlamaConfig = serde_json::from_str(
///     r#"{"hidden_size": 32, "intermediate_size": 48, "vocab_size": 64,
///         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
///         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128}"#,
/// ).map_err(candle_core::Error::wrap)?;
/// let varmap = VarMap::new(); // random weights
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let model = llama::Llama::load(vb, &cfg.into_config(false), PagedOptions::default())?;
/// let new_cache = || {
///     PagedKvCache::new(&model.attention_layers(), CacheConfig::new(4), DType::F32, &dev)
/// };
/// let ids = [1u32, 7, 3, 9, 4];
/// // Rows `cu[i]..cu[i + 1]` of the batch belong to sequence i, whose
/// // context is `seq_len` tokens in blocks `table` (16 tokens each).
/// let run = |cache: &PagedKvCache, first: u32, n: u32| {
///     let batch = PagedBatch::from_rows(&[0, n], &[first + n], &[vec![0]], 16, &dev)?;
///     let slots: Vec<i64> = (first..first + n).map(i64::from).collect();
///     let meta = AttentionMetadata::new(batch, SlotMapping::new(&slots, &dev)?)?;
///     let input = Tensor::new(&ids[first as usize..(first + n) as usize], &dev)?;
///     model.forward(&input, &meta, cache, &[n as usize - 1]) // the last row's logits
/// };
/// let whole = run(&new_cache()?, 0, 5)?;
/// assert_eq!(whole.dims(), &[1, 64]);
/// let cache = new_cache()?;
/// run(&cache, 0, 3)?;
/// let chunked = run(&cache, 3, 2)?;
/// let diff = (whole - chunked)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-4, "{diff}");
/// # Ok(())
/// # }
/// # #[cfg(not(feature = "models"))]
/// # fn main() {}
/// ```
pub trait PagedModel {
    /// The attention layer of each decoder layer, in order (their windows
    /// and shapes size the caches).
    fn attention_layers(&self) -> Vec<&Attention>;

    /// Vocabulary size: the width of the logits. Token ids are `< vocab_size`.
    fn vocab_size(&self) -> usize;

    /// The context length the checkpoint was trained for (Llama GGUF
    /// `llama.context_length`, Hugging Face `max_position_embeddings`):
    /// positions `0..max_seq_len` are supported, and the engine refuses a
    /// request whose prompt plus `max_tokens` exceeds it.
    fn max_seq_len(&self) -> usize;

    /// The device of the weights.
    fn device(&self) -> &Device;

    /// The activation dtype (the caches' dtype unless they are fp8).
    fn dtype(&self) -> DType;

    /// Runs the batch and returns the logits of the query rows `rows`.
    ///
    /// # Arguments
    /// * `input_ids` - `(num_tokens,)` u32, the batch's new tokens in the row
    ///   order of `metadata` (sequence by sequence), each `< vocab_size`
    ///   (checked when `input_ids` is on the CPU; on a GPU the check would
    ///   cost a device-to-host copy, and the [`Engine`](crate::engine::Engine) checks
    ///   the ids when a request is added).
    /// * `metadata` - tables, slots and positions of the batch.
    /// * `cache` - the caches of all layers; the new keys and values are
    ///   stored in them.
    /// * `rows` - the query rows whose logits are wanted, each `< num_tokens`.
    ///
    /// Returns `(rows.len(), vocab_size)` f32.
    fn forward(
        &self,
        input_ids: &Tensor,
        metadata: &AttentionMetadata,
        cache: &PagedKvCache,
        rows: &[usize],
    ) -> Result<Tensor>;
}

/// Picks the hidden states of `rows` out of `(num_tokens, hidden)` `xs`.
///
/// When `metadata` carries logit rows equal to `rows`
/// ([`AttentionMetadata::with_logit_rows`]) on `xs`' device, they index the
/// rows (a captured CUDA graph then reads the rows of each replay);
/// otherwise the rows are uploaded here.
#[cfg(feature = "models")]
fn select_rows(
    component: &str,
    xs: &Tensor,
    rows: &[usize],
    metadata: &AttentionMetadata,
) -> Result<Tensor> {
    let n = xs.dim(0)?;
    if rows.is_empty() {
        candle_core::bail!("{component}: no logit rows requested");
    }
    if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
        candle_core::bail!("{component}: logit row {bad} is out of range for {n} tokens");
    }
    if let Some((host, idx)) = metadata.logit_rows() {
        if idx.device().same_device(xs.device())
            && host.len() == rows.len()
            && host.iter().zip(rows).all(|(&h, &r)| h as usize == r)
        {
            return xs.index_select(idx, 0);
        }
    }
    let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let idx = Tensor::from_vec(idx, rows.len(), xs.device())?;
    xs.index_select(&idx, 0)
}

/// Checks that `input_ids` is `(num_tokens,)` u32 for the metadata's batch
/// and, on the CPU, that every id is `< vocab_size` (an embedding lookup
/// must never see an id outside its table).
#[cfg(feature = "models")]
fn check_input(
    component: &str,
    input_ids: &Tensor,
    metadata: &AttentionMetadata,
    vocab_size: usize,
) -> Result<()> {
    let n = metadata.num_tokens();
    if input_ids.dims() != [n] || input_ids.dtype() != DType::U32 {
        candle_core::bail!(
            "{component}: input_ids must be ({n},) u32 to match the metadata, got {:?} {:?}",
            input_ids.dims(),
            input_ids.dtype()
        );
    }
    if input_ids.device().is_cpu() {
        let ids = input_ids.to_vec1::<u32>()?;
        if let Some((row, id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= vocab_size)
        {
            candle_core::bail!(
                "{component}: token id {id} at row {row} is outside the vocabulary of {vocab_size} tokens"
            );
        }
    }
    Ok(())
}

/// Checks that the cache has one layer per decoder layer.
#[cfg(feature = "models")]
fn check_cache(component: &str, cache: &PagedKvCache, num_layers: usize) -> Result<()> {
    if cache.num_layers() != num_layers {
        candle_core::bail!(
            "{component}: the cache has {} layers but the model has {num_layers}",
            cache.num_layers()
        );
    }
    Ok(())
}

//! Paged Llama, Gemma 2 and Gemma 3 models (feature `models`).
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
//! * [`llama::Llama`] - Llama 2/3 (SmolLM2, TinyLlama, ...) from safetensors.
//! * [`quantized_llama::QuantizedLlama`] - Llama from a GGUF file (`QMatMul`).
//! * [`quantized_gemma3::QuantizedGemma3`] - Gemma 3 from a GGUF file
//!   (`QMatMul`), with Hugging Face's sliding window and activation.
//! * [`gemma2::Gemma2`], [`gemma3::Gemma3`] - softcapping, alternating
//!   sliding-window and global layers, Gemma 3's q/k norms and rope bases.
//! * [`tokenizer`] - tokenizers from the checkpoint: GGUF GPT-2 BPE and
//!   SentencePiece vocabularies, `tokenizer.json`; special tokens.
//! * [`chat`] - the checkpoint's chat template, rendered with `minijinja`.
//! * [`generation`] - sampling and a continuous-batching [`generation::Engine`].

pub mod chat;
pub mod gemma2;
pub mod gemma3;
pub mod generation;
mod gguf;
mod kv_cache;
mod layers;
pub mod llama;
pub mod quantized_gemma3;
pub mod quantized_llama;
mod rotary;
pub mod tokenizer;

use candle_core::{DType, Device, Result, Tensor};

use crate::attention::{Attention, KvCacheDtype};
use crate::metadata::AttentionMetadata;

pub use kv_cache::{
    CacheConfig, CacheFootprint, CachePlan, CacheSizing, MemoryProfile, PagedKvCache,
    DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_MEMORY_UTILIZATION,
};
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
    ///   cost a device-to-host copy, and the [`generation::Engine`] checks
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
fn select_rows(component: &str, xs: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let n = xs.dim(0)?;
    if rows.is_empty() {
        candle_core::bail!("{component}: no logit rows requested");
    }
    if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
        candle_core::bail!("{component}: logit row {bad} is out of range for {n} tokens");
    }
    let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let idx = Tensor::from_vec(idx, rows.len(), xs.device())?;
    xs.index_select(&idx, 0)
}

/// Checks that `input_ids` is `(num_tokens,)` u32 for the metadata's batch
/// and, on the CPU, that every id is `< vocab_size` (an embedding lookup
/// must never see an id outside its table).
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
fn check_cache(component: &str, cache: &PagedKvCache, num_layers: usize) -> Result<()> {
    if cache.num_layers() != num_layers {
        candle_core::bail!(
            "{component}: the cache has {} layers but the model has {num_layers}",
            cache.num_layers()
        );
    }
    Ok(())
}

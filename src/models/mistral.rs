//! Paged Mistral from safetensors, on the shared [`DecoderStack`].
//!
//! candle-transformers 0.11.1's `mistral`: GQA, an optional explicit
//! `head_dim`, and a sliding window on every layer when `sliding_window` is
//! set (`null` attends globally), as Hugging Face applies it: a query at `p`
//! sees keys at `> p - sliding_window`, in prefills, chunks and decodes
//! alike (candle-transformers masks only a prefill's new keys).

use candle_core::Result;
use candle_nn::{Activation, VarBuilder};

use super::decoder::{self, DecoderSpec, DecoderStack, RopeSpec, WeightNames, Windows};
use super::limits::DecoderShape;
use super::PagedOptions;

const OP: &str = "mistral";

/// A paged Mistral.
pub type Mistral = DecoderStack;

/// Mistral configuration (`config.json`, `model_type` `mistral`).
#[derive(serde::Deserialize, Debug, Clone)]
pub struct Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Elements per head (`hidden_size / num_attention_heads` when absent).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// KV heads.
    pub num_key_value_heads: usize,
    /// MLP activation.
    #[serde(default = "decoder::default_hidden_act")]
    pub hidden_act: Activation,
    /// Rotary table length.
    pub max_position_embeddings: usize,
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary base.
    #[serde(default = "decoder::default_rope_theta")]
    pub rope_theta: f64,
    /// Rotary scaling: only `null` is supported.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Window of every layer (`null`: global attention).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// The LM head is the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// Mistral's inverse rotary frequencies, in f32 as candle-transformers
/// computes them.
fn inv_freq(head_dim: usize, theta: f64) -> Vec<f32> {
    (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / (theta as f32).powf(i as f32 / head_dim as f32))
        .collect()
}

/// Loads a Hugging Face Mistral checkpoint (`model.*`, `lm_head` unless
/// tied) from `vb`; the dtype and device are `vb`'s.
pub fn load(vb: VarBuilder, cfg: &Config, options: PagedOptions) -> Result<Mistral> {
    DecoderStack::load(vb, &spec(cfg)?, options)
}

/// The decoder of a config, checked: what [`load`] builds (and
/// [`TensorParallel`](crate::parallel::TensorParallel) shards).
pub fn spec(cfg: &Config) -> Result<DecoderSpec> {
    let heads = cfg.num_attention_heads;
    let (head_dim, key) = match cfg.head_dim {
        Some(d) => (d, "head_dim"),
        None => (
            decoder::head_dim_of(OP, cfg.hidden_size, heads)?,
            "hidden_size / num_attention_heads",
        ),
    };
    DecoderShape {
        component: OP,
        source: "config.json ",
        hidden_size: ("hidden_size", cfg.hidden_size),
        num_heads: ("num_attention_heads", heads),
        num_kv_heads: ("num_key_value_heads", cfg.num_key_value_heads),
        head_dim: (key, head_dim),
        num_layers: ("num_hidden_layers", cfg.num_hidden_layers),
        max_layers: None,
        rope_dim: (key, head_dim),
        rms_norm_eps: ("rms_norm_eps", cfg.rms_norm_eps),
        rope_bases: &[("rope_theta", cfg.rope_theta)],
    }
    .check()?;
    decoder::no_rope_scaling(OP, &cfg.rope_scaling)?;
    let spec = DecoderSpec {
        component: OP,
        names: WeightNames::SEPARATE,
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden_size,
        num_layers: cfg.num_hidden_layers,
        num_heads: heads,
        num_kv_heads: cfg.num_key_value_heads,
        head_dim,
        qkv_bias: false,
        o_bias: false,
        qk_norm_eps: None,
        windows: cfg.sliding_window.map_or(Windows::None, Windows::All),
        rope: RopeSpec {
            inv_freq: inv_freq(head_dim, cfg.rope_theta),
            long: None,
            max_positions: cfg.max_position_embeddings,
        },
        rms_norm_eps: cfg.rms_norm_eps,
        intermediate_size: cfg.intermediate_size,
        activation: cfg.hidden_act,
        tie_word_embeddings: cfg.tie_word_embeddings,
    };
    Ok(spec)
}

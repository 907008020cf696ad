//! Paged Qwen3 (dense) from safetensors, on the shared [`DecoderStack`].
//!
//! candle-transformers 0.11.1's `qwen3`: an explicit `head_dim` (so
//! `num_attention_heads * head_dim` need not be `hidden_size`), per-head RMS
//! norms of q and k before the rotation, biases on q/k/v/o when
//! `attention_bias`. Sliding windows as Qwen2's (Hugging Face's
//! `use_sliding_window`, `max_window_layers`, `layer_types`), which
//! candle-transformers refuses.

use candle_core::Result;
use candle_nn::{Activation, VarBuilder};

use super::decoder::{self, DecoderSpec, DecoderStack, RopeSpec, WeightNames, Windows};
use super::gemma2::LayerType;
use super::limits::DecoderShape;
use super::rotary::RotaryEmbedding;
use super::PagedOptions;

const OP: &str = "qwen3";

/// A paged Qwen3.
pub type Qwen3 = DecoderStack;

fn default_head_dim() -> usize {
    128
}

/// Qwen3 configuration (`config.json`, `model_type` `qwen3`).
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
    /// Elements per head (128 when absent, as Hugging Face's default).
    #[serde(default = "default_head_dim")]
    pub head_dim: usize,
    /// Biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// KV heads (`num_attention_heads` when absent).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Rotary table length.
    pub max_position_embeddings: usize,
    /// Window of the sliding layers.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Layers `0..max_window_layers` attend globally.
    #[serde(default)]
    pub max_window_layers: usize,
    /// Whether any layer slides.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Per-layer attention type (overrides `max_window_layers`).
    #[serde(default)]
    pub layer_types: Option<Vec<LayerType>>,
    /// The LM head is the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Rotary base.
    #[serde(default = "decoder::default_rope_theta")]
    pub rope_theta: f64,
    /// Rotary scaling: only `null` is supported.
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// RMS norm epsilon (also of the q/k norms).
    pub rms_norm_eps: f64,
    /// MLP activation.
    #[serde(default = "decoder::default_hidden_act")]
    pub hidden_act: Activation,
}

/// Loads a Hugging Face Qwen3 checkpoint (`model.*`, `lm_head` unless
/// tied) from `vb`; the dtype and device are `vb`'s.
pub fn load(vb: VarBuilder, cfg: &Config, options: PagedOptions) -> Result<Qwen3> {
    DecoderStack::load(vb, &spec(cfg)?, options)
}

/// The decoder of a config, checked: what [`load`] builds (and
/// [`TensorParallel`](crate::parallel::TensorParallel) shards).
pub fn spec(cfg: &Config) -> Result<DecoderSpec> {
    let (heads, head_dim) = (cfg.num_attention_heads, cfg.head_dim);
    let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
    DecoderShape {
        component: OP,
        source: "config.json ",
        hidden_size: ("hidden_size", cfg.hidden_size),
        num_heads: ("num_attention_heads", heads),
        num_kv_heads: ("num_key_value_heads", kv_heads),
        head_dim: ("head_dim", head_dim),
        num_layers: ("num_hidden_layers", cfg.num_hidden_layers),
        max_layers: None,
        rope_dim: ("head_dim", head_dim),
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
        num_kv_heads: kv_heads,
        head_dim,
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm_eps: Some(cfg.rms_norm_eps),
        windows: Windows::qwen(
            cfg.use_sliding_window,
            cfg.sliding_window,
            cfg.max_window_layers,
            cfg.layer_types.as_deref(),
        ),
        rope: RopeSpec {
            inv_freq: RotaryEmbedding::default_inv_freq(head_dim, cfg.rope_theta),
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

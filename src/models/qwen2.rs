//! Paged Qwen2 / Qwen2.5 from safetensors, on the shared [`DecoderStack`].
//!
//! candle-transformers 0.11.1's `qwen2`: biases on q/k/v (none on o), tied
//! embeddings. Sliding windows as Hugging Face applies them: only when
//! `use_sliding_window`, on the layers from `max_window_layers` on (or the
//! `sliding_attention` entries of `layer_types`); candle-transformers masks
//! every prefill with `sliding_window` instead.

use candle_core::Result;
use candle_nn::{Activation, VarBuilder};

use super::decoder::{self, DecoderSpec, DecoderStack, RopeSpec, WeightNames, Windows};
use super::gemma2::LayerType;
use super::limits::DecoderShape;
use super::rotary::RotaryEmbedding;
use super::PagedOptions;

const OP: &str = "qwen2";

/// A paged Qwen2.
pub type Qwen2 = DecoderStack;

/// Qwen2 / Qwen2.5 configuration (`config.json`, `model_type` `qwen2`).
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
    /// RMS norm epsilon.
    pub rms_norm_eps: f64,
    /// MLP activation.
    #[serde(default = "decoder::default_hidden_act")]
    pub hidden_act: Activation,
}

/// Loads a Hugging Face Qwen2 checkpoint (`model.*`, `lm_head` unless
/// tied) from `vb`; the dtype and device are `vb`'s.
pub fn load(vb: VarBuilder, cfg: &Config, options: PagedOptions) -> Result<Qwen2> {
    DecoderStack::load(vb, &spec(cfg)?, options)
}

/// The decoder of a config, checked: what [`load`] builds (and
/// [`TensorParallel`](crate::parallel::TensorParallel) shards).
pub fn spec(cfg: &Config) -> Result<DecoderSpec> {
    let heads = cfg.num_attention_heads;
    let head_dim = decoder::head_dim_of(OP, cfg.hidden_size, heads)?;
    let kv_heads = cfg.num_key_value_heads.unwrap_or(heads);
    DecoderShape {
        component: OP,
        source: "config.json ",
        hidden_size: ("hidden_size", cfg.hidden_size),
        num_heads: ("num_attention_heads", heads),
        num_kv_heads: ("num_key_value_heads", kv_heads),
        head_dim: ("hidden_size / num_attention_heads", head_dim),
        num_layers: ("num_hidden_layers", cfg.num_hidden_layers),
        max_layers: None,
        rope_dim: ("hidden_size / num_attention_heads", head_dim),
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
        qkv_bias: true,
        o_bias: false,
        qk_norm_eps: None,
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
